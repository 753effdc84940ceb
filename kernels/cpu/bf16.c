/*
 * bf16.c - FP32 <-> BF16 conversion on the host (declared in kernels/kernels.h).
 *
 * BF16 is the top 16 bits of an IEEE-754 binary32: same sign and 8-bit exponent, 7 fraction bits.
 * The optimizer stores AdamW moments in BF16 (DESIGN.md section 4), so this rounding is part of the
 * numerical recipe: round-to-nearest, ties to even, done on the bit pattern so that it is exact for
 * normals, subnormals and the overflow to infinity alike. The CUDA side uses __float2bfloat16_rn,
 * which rounds the same way; tests compare the two bit for bit.
 */
#include "kernels/cpu/cpu_ops.h"

#include <stdlib.h>
#include <string.h>

// NaN keeps its sign and becomes a quiet NaN: truncating the payload could otherwise leave an
// all-zero fraction, i.e. turn the NaN into an infinity.
uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
        return (uint16_t)((bits >> 16) | 0x0040u);
    }
    // Round to nearest even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit, so an exact
    // tie (dropped bits = 0x8000) rounds up only when the kept part is odd. A carry out of the
    // fraction bumps the exponent, which is the correct result (up to +inf for the largest finites);
    // infinities have zero dropped bits and pass unchanged.
    uint32_t lsb = (bits >> 16) & 1u;
    bits += 0x7FFFu + lsb;
    return (uint16_t)(bits >> 16);
}

float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// v (rows, cols) packed = the values (exact) of x, rows of `cols` BF16 values at stride ld (bf16_rows_ld(cols) for a
// GEMM's BF16 product, kernels.h).
void cpu_bf16_rows_widen(real *v, const uint16_t *x, int64_t ld, int64_t rows, int cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) v[r * cols + c] = (real)bf16_to_float(x[r * ld + c]);
}

// The same into a new array, freed by the caller: the CPU reference of the ops that read such rows widens them first.
real *cpu_bf16_rows_widened(const uint16_t *x, int64_t ld, int64_t rows, int cols) {
    real *v = cpu_values_or_die((size_t)(rows > 0 ? rows : 0) * (size_t)(cols > 0 ? cols : 0), "widened BF16 rows");
    cpu_bf16_rows_widen(v, x, ld, rows, cols);
    return v;
}

// v (rows, cols) packed += the values of x (rows at stride ld, as above), one add per element: a further BF16 source
// of an op that sums several in order (kernels.h rmsnorm_backward_bf16, DgradUnpermute's post arrays).
void cpu_bf16_rows_add(real *v, const uint16_t *x, int64_t ld, int64_t rows, int cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) v[r * cols + c] += (real)bf16_to_float(x[r * ld + c]);
}

// The other way: v (rows, cols) packed, rounded (RNE) into rows of x at stride ld.
void cpu_bf16_rows_round(uint16_t *x, int64_t ld, const real *v, int64_t rows, int cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) x[r * ld + c] = float_to_bf16((float)v[r * cols + c]);
}
