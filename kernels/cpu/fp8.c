/*
 * fp8.c - the CPU reference of DeepSeek-V3's FP8 recipe (kernels.h "FP8 (E4M3) block scaling",
 * DESIGN.md section 4, docs/fp8.md): bit-exact E4M3 conversion, the three block quantisers and the
 * three block-scaled GEMMs (Fprop, Dgrad, Wgrad) with promotion of partial sums every 128 elements, and
 * their grouped (per-expert segment) forms.
 *
 * What this file is for: the quantisers define the FP8 bits. The CUDA quantisers must produce the same
 * q bytes and scales bit for bit, so every step here is one IEEE operation stated in the comments
 * (FP32 amax, one FP32 division for the scale, one FP32 division per element, RNE to E4M3).
 * The GEMMs define the reference arithmetic "each 128-block partial sum, times its two scales, added
 * into an FP32 accumulator" with the block partial computed exactly; tensor cores sum inside a block
 * with less precision, so CUDA agrees with these GEMMs to a stated tolerance, not bit for bit.
 * The GEMMs also run inside CPU training (fp8 mode), so they decode the E4M3 operands once into
 * double panels and use a register-blocked micro-kernel with OpenMP over output rows.
 *
 * Also here: cpu_fp8_dot_emulated, one GEMM output element under a model of a tensor core's limited
 * accumulator, for the "why promotion matters" experiment (tests/unit/test_fp8_promotion.c). It shares
 * the promotion step with the GEMMs.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// ---------------------------------------------------------------------------- E4M3 conversion
// E4M3 (the "FN" variant): sign, 4 exponent bits with bias 7, 3 mantissa bits. Exponent field 1..15
// is a normal 1.mmm * 2^(e-7); field 0 is a subnormal 0.mmm * 2^-6 = m * 2^-9. There is no infinity:
// 0x7F and 0xFF (field 15, mantissa 7) are NaN, so the largest finite value is 0x7E = 1.75 * 2^8 = 448.
//
// The encoder works on the FP32 bit pattern only (exact, independent of the rounding mode) and is
// branch-free integer code, so that the quantisers' loops vectorise (#pragma omp simd).

// FP32 bit patterns of 448 (every |x| >= 448, infinities included, saturates to 448), of 2^-6 (the
// smallest E4M3 normal) and of infinity. Positive floats order like their bit patterns.
#define F32_BITS_448 0x43E00000u
#define F32_BITS_2POW_M6 0x3C800000u
#define F32_BITS_INF 0x7F800000u

static inline uint8_t e4m3_encode(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t mag = bits & 0x7FFFFFFFu;
    // Normal result (|x| in [2^-6, 448)): keep 3 of the 23 fraction bits, adding 0x7FFFF plus the lowest
    // kept bit so that the 20 dropped bits round to nearest, ties to even. A carry out of the fraction
    // moves to the next binade, which is the correctly rounded value (it cannot pass 448: 448 is
    // representable). Then (biased exponent << 3 | mantissa) = rounded >> 20, and rebiasing the exponent
    // from 127 to 7 subtracts 120 << 3.
    const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) & ~0xFFFFFu;
    const uint32_t normal_code = (rounded >> 20) - (120u << 3);
    // Subnormal result (|x| < 2^-6): the code m is |x| / 2^-9 rounded to an integer in 0..8 (8 = 2^-6 is
    // code 0x08, the smallest normal, so the integer is the code): count the midpoints (2m + 1) * 2^-10
    // that |x| lies above. At a midpoint the tie goes to the even code: strictly above for even m,
    // at or above for odd m.
    const uint32_t subnormal_code = (mag > 0x3A800000u) + (mag >= 0x3B400000u)   // 1 * 2^-10, 3 * 2^-10
                                    + (mag > 0x3BA00000u) + (mag >= 0x3BE00000u) // 5, 7
                                    + (mag > 0x3C100000u) + (mag >= 0x3C300000u) // 9, 11
                                    + (mag > 0x3C500000u) + (mag >= 0x3C700000u); // 13, 15
    uint32_t code = mag < F32_BITS_2POW_M6 ? subnormal_code : normal_code;
    code = mag >= F32_BITS_448 ? 0x7Eu : code;  // saturate
    code |= sign;
    code = mag > F32_BITS_INF ? 0x7Fu : code;   // NaN (either sign) -> the positive NaN code
    return (uint8_t)code;
}

uint8_t fp8_e4m3_from_float(float x) { return e4m3_encode(x); }

float fp8_e4m3_to_float(uint8_t q) {
    const int e = (q >> 3) & 15, m = q & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexpf((float)m, -9);
    else v = ldexpf((float)(8 + m), e - 10);         // 1.mmm * 2^(e-7) = (8 + m) * 2^(e-10)
    return (q & 0x80) ? -v : v;
}

// ---------------------------------------------------------------------------- quantisers
// The element a quantiser sees is (float)x: `real` may be double (gradient-check build), and the recipe
// is defined on FP32 values. In the FP32 build the cast is the identity.

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int round_up16(int rows) { return ceil_div(rows, 16) * 16; }

// The scale of a tile from its amax: s = amax / 448, one FP32 division. s = 1 when amax = 0 (an
// all-zero tile, e.g. padding) and also when amax is so small (< ~6e-43, an FP32 subnormal) that the
// quotient underflows to 0; then every x / 1 is below the smallest E4M3 subnormal and encodes as 0,
// where x / 0 would have produced NaN codes.
static float scale_of_amax(float amax) {
    const float s = amax / FP8_E4M3_MAX;
    return s > 0.0f ? s : 1.0f;
}

// Checks that every element of x (rows, cols) is finite as an FP32 value (not NaN, not Inf, not a double
// beyond the FP32 range). Returns 0 if so; else -1 with a message naming the first bad element in
// row-major order. The common all-finite case is one vectorised pass.
static int check_finite(const char *op, const real *x, int rows, int cols, char *err, size_t err_size) {
    const int64_t n = (int64_t)rows * cols;
    int bad = 0;
#pragma omp parallel for simd reduction(| : bad) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) bad |= !(fabsf((float)x[i]) <= FLT_MAX);
    if (!bad) return 0;
    for (int64_t i = 0; i < n; i++) {
        if (fabsf((float)x[i]) <= FLT_MAX) continue;
        if (err && err_size > 0) {
            snprintf(err, err_size,
                     "%s: input (%d x %d) has the non-finite value %g at row %d, column %d "
                     "(expected finite values within the FP32 range)",
                     op, rows, cols, (double)x[i], (int)(i / cols), (int)(i % cols));
        }
        break;
    }
    return -1;
}

// dst (n) = e4m3(src[i] / s): one FP32 division and one rounding per element.
static inline void encode_scaled(uint8_t *dst, const real *src, int n, float s) {
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = e4m3_encode((float)src[i] / s);
}

// max |x[i]| over finite values. Four running maxima, written as compares, let the compiler keep them in
// vector registers (the result is the same in any order: max is exact).
static inline float amax_of(const real *x, int n) {
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; j++) {
            const float a = fabsf((float)x[i + j]);
            m[j] = a > m[j] ? a : m[j];
        }
    }
    for (; i < n; i++) {
        const float a = fabsf((float)x[i]);
        m[0] = a > m[0] ? a : m[0];
    }
    const float m01 = m[0] > m[1] ? m[0] : m[1], m23 = m[2] > m[3] ? m[2] : m[3];
    return m01 > m23 ? m01 : m23;
}

// x (rows, K) -> q (R16, Kp), s (KB, R16), R16 = rows rounded up to 16: tile (r, kb) is
// x[r, 128 kb .. 128 kb + 127], its scale is s[kb * R16 + r] and q[r * Kp + k] = e4m3(x[r, k] / s) for
// k < K, 0 for K <= k < Kp. The padding rows r >= rows are all-zero tiles: code 0, scale 1. The input's
// finiteness is the caller's check (the public quantisers below make it once per call).
static void quantize_1x128_rows(uint8_t *q, float *s, const real *x, int rows, int K) {
    const int KB = ceil_div(K, FP8_TILE), Kp = KB * FP8_TILE, R16 = round_up16(rows);
    memset(q + (size_t)rows * Kp, 0, (size_t)(R16 - rows) * Kp);
    for (int kb = 0; kb < KB; kb++) {
        for (int r = rows; r < R16; r++) s[(size_t)kb * R16 + r] = 1.0f;
    }
#pragma omp parallel for schedule(static) if ((double)rows * K > 16384.0)
    for (int r = 0; r < rows; r++) {
        const real *xr = x + (size_t)r * K;
        uint8_t *qr = q + (size_t)r * Kp;
        for (int kb = 0; kb < KB; kb++) {
            const int k0 = kb * FP8_TILE, len = K - k0 < FP8_TILE ? K - k0 : FP8_TILE;
            const float sc = scale_of_amax(amax_of(xr + k0, len));
            s[(size_t)kb * R16 + r] = sc;
            encode_scaled(qr + k0, xr + k0, len, sc);
            memset(qr + k0 + len, 0, (size_t)(FP8_TILE - len));
        }
    }
}

int cpu_fp8_quantize_1x128(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size) {
    if (check_finite("fp8_quantize_1x128", x, rows, K, err, err_size)) return -1;
    quantize_1x128_rows(q, s, x, rows, K);
    return 0;
}

// w (N, K) -> q (Np, Kp), qt (Kp, Np) (may be NULL), s (NB, KB4): block (nb, kb) covers rows
// 128 nb .. 128 nb + 127 and columns 128 kb .. 128 kb + 127, scale s[nb * KB4 + kb];
// q[n * Kp + k] = qt[k * Np + n] = e4m3(w[n, k] / s) inside w, 0 in the padding. The scales of the
// padding blocks kb = KB .. KB4-1 are 1 (the scale of an all-zero block). The input's finiteness is the
// caller's check.
static void quantize_128x128_matrix(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K) {
    const int KB = ceil_div(K, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(N, FP8_TILE);
    const size_t Kp = (size_t)KB * FP8_TILE, Np = (size_t)NB * FP8_TILE;
#pragma omp parallel for schedule(static) if ((double)N * K > 16384.0)
    for (int blk = 0; blk < NB * KB; blk++) {
        const int nb = blk / KB, kb = blk % KB;
        const int n0 = nb * FP8_TILE, rows = N - n0 < FP8_TILE ? N - n0 : FP8_TILE;
        const int k0 = kb * FP8_TILE, len = K - k0 < FP8_TILE ? K - k0 : FP8_TILE;
        float amax = 0.0f;
        for (int i = 0; i < rows; i++) amax = fmaxf(amax, amax_of(w + (size_t)(n0 + i) * K + k0, len));
        const float sc = scale_of_amax(amax);
        s[(size_t)nb * KB4 + kb] = sc;
        for (int i = 0; i < FP8_TILE; i++) {
            uint8_t *qrow = q + (size_t)(n0 + i) * Kp + k0;
            if (i < rows) {
                encode_scaled(qrow, w + (size_t)(n0 + i) * K + k0, len, sc);
                memset(qrow + len, 0, (size_t)(FP8_TILE - len));
            } else {
                memset(qrow, 0, FP8_TILE);
            }
            if (qt) {
                for (int j = 0; j < FP8_TILE; j++) qt[(size_t)(k0 + j) * Np + n0 + i] = qrow[j];
            }
        }
    }
    for (int nb = 0; nb < NB; nb++) {
        for (int kb = KB; kb < KB4; kb++) s[(size_t)nb * KB4 + kb] = 1.0f;
    }
}

int cpu_fp8_quantize_128x128(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err,
                             size_t err_size) {
    if (check_finite("fp8_quantize_128x128", w, N, K, err, err_size)) return -1;
    quantize_128x128_matrix(q, qt, s, w, N, K);
    return 0;
}

// Matrix by matrix; the stack is checked once, first, so a bad element is named at its row of (batch * N, K).
int cpu_fp8_quantize_128x128_batched(uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N, int K,
                                     char *err, size_t err_size) {
    if (batch <= 0 || N <= 0 || K <= 0) return 0;
    if (check_finite("fp8_quantize_128x128_batched", w, batch * N, K, err, err_size)) return -1;
    const int KB4 = ceil_div(ceil_div(K, FP8_TILE), 4) * 4, NB = ceil_div(N, FP8_TILE);
    const size_t qn = (size_t)NB * FP8_TILE * ceil_div(K, FP8_TILE) * FP8_TILE, sn = (size_t)NB * KB4;
    for (int b = 0; b < batch; b++)
        quantize_128x128_matrix(q + b * qn, qt ? qt + b * qn : NULL, s + b * sn, w + (size_t)b * N * K, N, K);
    return 0;
}

// x (T, C) -> q (C, Tp), s (TB, C): tile (tb, c) is x[128 tb .. 128 tb + 127, c], its scale is
// s[tb * C + c] and q[c * Tp + t] = e4m3(x[t, c] / s) for t < T, 0 for T <= t < Tp.
static void quantize_128x1_rows(uint8_t *q, float *s, const real *x, int T, int C) {
    const int TB = ceil_div(T, FP8_TILE);
    const size_t Tp = (size_t)TB * FP8_TILE;
    // Work items are (T block, group of 64 columns): the rows of a block are read in memory order and
    // the block is transposed through a small local tile.
    enum { COLS = 64 };
    const int CG = ceil_div(C, COLS);
#pragma omp parallel for schedule(static) if ((double)T * C > 16384.0)
    for (int item = 0; item < TB * CG; item++) {
        const int tb = item / CG, c0 = (item % CG) * COLS, width = C - c0 < COLS ? C - c0 : COLS;
        const int t0 = tb * FP8_TILE, t1 = t0 + FP8_TILE < T ? t0 + FP8_TILE : T;
        float amax[COLS] = {0}, sc[COLS];
        for (int t = t0; t < t1; t++) {
            const real *xt = x + (size_t)t * C + c0;
#pragma omp simd
            for (int j = 0; j < width; j++) {
                const float a = fabsf((float)xt[j]);
                amax[j] = a > amax[j] ? a : amax[j];
            }
        }
        for (int j = 0; j < width; j++) {
            sc[j] = scale_of_amax(amax[j]);
            s[(size_t)tb * C + c0 + j] = sc[j];
        }
        // Codes of the block, row by row (vectorised), then written out column by column so that each
        // q row (one column of x) gets 128 contiguous bytes.
        uint8_t codes[FP8_TILE][COLS];
        for (int t = t0; t < t0 + FP8_TILE; t++) {
            uint8_t *ct = codes[t - t0];
            if (t < t1) {
                const real *xt = x + (size_t)t * C + c0;
#pragma omp simd
                for (int j = 0; j < width; j++) ct[j] = e4m3_encode((float)xt[j] / sc[j]);
            } else {
                memset(ct, 0, COLS);
            }
        }
        for (int j = 0; j < width; j++) {
            uint8_t *qc = q + (size_t)(c0 + j) * Tp + t0;
            for (int t = 0; t < FP8_TILE; t++) qc[t] = codes[t][j];
        }
    }
}

int cpu_fp8_quantize_128x1_transposed(uint8_t *q, float *s, const real *x, int T, int C, char *err,
                                      size_t err_size) {
    if (check_finite("fp8_quantize_128x1_transposed", x, T, C, err, err_size)) return -1;
    quantize_128x1_rows(q, s, x, T, C);
    return 0;
}

// The finiteness check and the encoder above, for kernels/cpu/fp8_pow2.c (power-of-2 scales), which uses them
// as they are instead of repeating them.
int cpu_fp8_check_finite(const char *op, const real *x, int rows, int cols, char *err, size_t err_size) {
    return check_finite(op, x, rows, cols, err, err_size);
}

void cpu_fp8_encode_scaled(uint8_t *dst, const real *src, int n, float s) { encode_scaled(dst, src, n, s); }

// ---------------------------------------------------------------------------- promotion
// Why a 128-block partial sum of E4M3 products is exact in double: every finite E4M3 value is an
// integer multiple of 2^-9 (the subnormal step) of magnitude <= 448, i.e. i * 2^-9 with |i| <= 229376
// < 2^18. A product of two is (i j) * 2^-18 with |i j| < 2^36 (its value is at most 448^2 = 200704), and
// every partial sum of at most 128 products is an integer multiple of 2^-18 below 128 * 2^36 = 2^43 in
// those units: at most 43 significant bits, representable in double (53 bits). Every addition is
// therefore exact, in any order and with any vector width, and the block partial P is the
// exact sum. (The same sums in FP32, 24 bits, are not exact in general.)
//
// The promotion step, shared by the GEMMs and the emulation below, is in this exact FP32 order:
//   acc = acc + ((float)P * s_a) * s_b
// (P rounded once to FP32, then one FP32 multiply by the scale of the operand that supplies the output
// row, s_a, then one by the other operand's scale, s_b, then one FP32 add; acc starts at 0 and the
// K-blocks are added in increasing order).
static inline float fp8_promote(float acc, double block_partial, float sa, float sb) {
    const float p = (float)block_partial;
    return acc + (p * sa) * sb;
}

// v truncated (towards zero) to `bits` significant bits.
static double truncate_significant_bits(double v, int bits) {
    if (v == 0.0 || !isfinite(v)) return v;
    int e;
    const double m = frexp(v, &e);  // v = m * 2^e, 0.5 <= |m| < 1
    return ldexp(trunc(ldexp(m, bits)), e - bits);
}

// Model of a tensor core's accumulator: acc = truncate(fl64(acc + p)) after every addition (bits = 0:
// plain double accumulation, which is exact for unscaled E4M3 products within a 128-block).
static double accumulate_limited(double acc, double p, int acc_bits) {
    const double sum = acc + p;
    return acc_bits > 0 ? truncate_significant_bits(sum, acc_bits) : sum;
}

float cpu_fp8_dot_emulated(const uint8_t *qa, const float *sa, const uint8_t *qb, const float *sb, int Kc,
                           int acc_bits, int promote) {
    const int KBc = Kc / FP8_TILE;
    if (promote) {
        float acc = 0.0f;
        for (int kb = 0; kb < KBc; kb++) {
            double partial = 0.0;
            for (int k = kb * FP8_TILE; k < (kb + 1) * FP8_TILE; k++) {
                const double p = (double)fp8_e4m3_to_float(qa[k]) * (double)fp8_e4m3_to_float(qb[k]);
                partial = accumulate_limited(partial, p, acc_bits);
            }
            acc = fp8_promote(acc, partial, sa[kb], sb[kb]);
        }
        return acc;
    }
    // No promotion: one accumulator over the whole contraction axis; each product carries its scales
    // (applied in double before it enters the accumulator), and the result is rounded to FP32 at the end.
    double acc = 0.0;
    for (int kb = 0; kb < KBc; kb++) {
        const double scale = (double)sa[kb] * (double)sb[kb];
        for (int k = kb * FP8_TILE; k < (kb + 1) * FP8_TILE; k++) {
            const double p = (double)fp8_e4m3_to_float(qa[k]) * (double)fp8_e4m3_to_float(qb[k]);
            acc = accumulate_limited(acc, p * scale, acc_bits);
        }
    }
    return (float)acc;
}

// ---------------------------------------------------------------------------- block-scaled GEMM
// The three GEMMs are one computation with both operands contiguous along the contraction axis
// (cuBLASLt's "TN"): out[m][n] = sum over K-blocks kb of promote(P(m, n, kb), sa(m, kb), sb(n, kb)),
//   A (M, Kc) E4M3 row-major, B (Ncols, Kc) E4M3 row-major, Kc a multiple of 128,
//   sa (KBc, M): sa[kb * M + m];  sbx (KBc, Ncols): sbx[kb * Ncols + n] (block scales expanded per column).
// Kernel shape: a panel of MR rows of A times a panel of NR columns of B, both decoded to double and
// stored k-major, so one k step is a few vector loads, MR broadcasts and MR*NR multiplies and adds.
// Because every block partial is exact (see "promotion"), the kernel may add in any order and with
// any vector width: the AVX variant (picked at run time on x86 CPUs that have it, since the default
// build targets plain x86-64) gives bit-identical results to the portable one.
typedef double dvec2 __attribute__((vector_size(16)));
#define MR 6
#define NR 8
#define PANEL_ALIGN 64

typedef enum { OUT_WRITE_BF16, OUT_ADD_BF16, OUT_ADD_FP32 } OutMode;

// 64-byte aligned memory for the GEMMs' decoded operand panels and expanded scales, or a message and exit (plain
// real arrays come from cpu_values_or_die).
static void *aligned_or_die(size_t bytes, const char *what) {
    size_t rounded = (bytes + PANEL_ALIGN - 1) / PANEL_ALIGN * PANEL_ALIGN;
    void *p = aligned_alloc(PANEL_ALIGN, rounded > 0 ? rounded : PANEL_ALIGN);
    if (!p) {
        fprintf(stderr, "fp8moe: kernels/cpu/fp8.c:%d: out of memory allocating %zu bytes for %s\n", __LINE__,
                bytes, what);
        exit(1);
    }
    return p;
}

// dst[k * width + i] = value of src row (row0 + i) at column k, for i < rows; 0 for rows .. width-1.
static void decode_panel(double *dst, const double *lut, const uint8_t *src, size_t ld, int row0, int rows,
                         int width, int Kc) {
    for (int i = 0; i < width; i++) {
        if (i < rows) {
            const uint8_t *s = src + (size_t)(row0 + i) * ld;
            for (int k = 0; k < Kc; k++) dst[(size_t)k * width + i] = lut[s[k]];
        } else {
            for (int k = 0; k < Kc; k++) dst[(size_t)k * width + i] = 0.0;
        }
    }
}

// P[i][j0 .. j0+3] = sum over the 128 k of one block of ap[k][i] * bp[k][j0 .. j0+3], 16-byte vectors:
// 12 accumulators fit the 16 registers of SSE2.
static void block_micro_kernel_half(double P[MR][NR], const double *ap, const double *bp, int j0) {
    dvec2 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    dvec2 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int k = 0; k < FP8_TILE; k++) {
        dvec2 b0, b1;
        memcpy(&b0, bp + (size_t)k * NR + j0, sizeof b0);
        memcpy(&b1, bp + (size_t)k * NR + j0 + 2, sizeof b1);
        const double *a = ap + (size_t)k * MR;
        c00 += b0 * a[0]; c01 += b1 * a[0];
        c10 += b0 * a[1]; c11 += b1 * a[1];
        c20 += b0 * a[2]; c21 += b1 * a[2];
        c30 += b0 * a[3]; c31 += b1 * a[3];
        c40 += b0 * a[4]; c41 += b1 * a[4];
        c50 += b0 * a[5]; c51 += b1 * a[5];
    }
    const dvec2 c[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < MR; i++) memcpy(&P[i][j0], c[i], sizeof c[i]);
}

static void block_micro_kernel_portable(double P[MR][NR], const double *ap, const double *bp) {
    block_micro_kernel_half(P, ap, bp, 0);
    block_micro_kernel_half(P, ap, bp, NR / 2);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX_KERNEL 1
typedef double dvec4 __attribute__((vector_size(32)));
// The same block sums with 32-byte vectors: 12 accumulators of 4 doubles cover the whole 6 x 8 tile.
__attribute__((target("avx"))) static void block_micro_kernel_avx(double P[MR][NR], const double *ap,
                                                                  const double *bp) {
    dvec4 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    dvec4 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int k = 0; k < FP8_TILE; k++) {
        dvec4 b0, b1;
        memcpy(&b0, bp + (size_t)k * NR, sizeof b0);
        memcpy(&b1, bp + (size_t)k * NR + 4, sizeof b1);
        const double *a = ap + (size_t)k * MR;
        c00 += b0 * a[0]; c01 += b1 * a[0];
        c10 += b0 * a[1]; c11 += b1 * a[1];
        c20 += b0 * a[2]; c21 += b1 * a[2];
        c30 += b0 * a[3]; c31 += b1 * a[3];
        c40 += b0 * a[4]; c41 += b1 * a[4];
        c50 += b0 * a[5]; c51 += b1 * a[5];
    }
    const dvec4 c[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < MR; i++) memcpy(&P[i][0], c[i], sizeof c[i]);
}
#endif

typedef void (*BlockKernel)(double P[MR][NR], const double *ap, const double *bp);

static BlockKernel pick_block_kernel(void) {
#ifdef HAVE_AVX_KERNEL
    if (__builtin_cpu_supports("avx")) return block_micro_kernel_avx;
#endif
    return block_micro_kernel_portable;
}

// out (M, Ncols), row stride Ncols: written as BF16(acc) or added to (out += BF16(acc) or acc), see
// OutMode. A's scales are sa[kb * sa_stride + m] (sa_stride >= M: the 1x128 operands have padded rows).
// Every output element is computed by one thread in the fixed order above, so the result does not
// depend on the thread count. OpenMP splits the row panels (output rows); B is decoded once up front.
static void block_scaled_gemm(real *out, OutMode mode, const uint8_t *A, const float *sa, int sa_stride,
                              const uint8_t *B, const float *sbx, int M, int Ncols, int Kc) {
    if (M <= 0 || Ncols <= 0) return;
    double lut[256];
    for (int v = 0; v < 256; v++) lut[v] = (double)fp8_e4m3_to_float((uint8_t)v);
    const int KBc = Kc / FP8_TILE;
    const int m_panels = ceil_div(M, MR), n_panels = ceil_div(Ncols, NR);
    const BlockKernel block_kernel = pick_block_kernel();
    double *bp = aligned_or_die((size_t)n_panels * NR * (size_t)Kc * sizeof(double), "decoded FP8 operand B");
    const int parallel = (double)M * Ncols * Kc > 65536.0;
    CpuRegionError err = {0};  // a thread's panel that cannot be allocated (scratch.c)
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int q = 0; q < n_panels; q++) {
            const int cols = Ncols - q * NR < NR ? Ncols - q * NR : NR;
            decode_panel(bp + (size_t)q * NR * Kc, lut, B, (size_t)Kc, q * NR, cols, NR, Kc);
        }
        double *ap = cpu_region_alloc(&err, (size_t)MR * Kc * sizeof(double), PANEL_ALIGN, "decoded FP8 operand A");
#pragma omp for schedule(static)
        for (int p = 0; p < m_panels; p++) {
            if (ap == NULL) continue;
            const int m0 = p * MR, rows = M - m0 < MR ? M - m0 : MR;
            decode_panel(ap, lut, A, (size_t)Kc, m0, rows, MR, Kc);
            for (int q = 0; q < n_panels; q++) {
                const int n0 = q * NR, cols = Ncols - n0 < NR ? Ncols - n0 : NR;
                const double *bq = bp + (size_t)q * NR * Kc;
                float acc[MR][NR] = {{0}};
                double P[MR][NR];
                for (int kb = 0; kb < KBc; kb++) {
                    block_kernel(P, ap + (size_t)kb * FP8_TILE * MR, bq + (size_t)kb * FP8_TILE * NR);
                    const float *sak = sa + (size_t)kb * sa_stride + m0, *sbk = sbx + (size_t)kb * Ncols + n0;
                    for (int i = 0; i < rows; i++) {
                        for (int j = 0; j < cols; j++) acc[i][j] = fp8_promote(acc[i][j], P[i][j], sak[i], sbk[j]);
                    }
                }
                for (int i = 0; i < rows; i++) {
                    real *o = out + (size_t)(m0 + i) * Ncols + n0;
                    for (int j = 0; j < cols; j++) {
                        if (mode == OUT_WRITE_BF16) o[j] = (real)bf16_to_float(float_to_bf16(acc[i][j]));
                        else if (mode == OUT_ADD_BF16) o[j] = o[j] + (real)bf16_to_float(float_to_bf16(acc[i][j]));
                        else o[j] = o[j] + (real)acc[i][j];
                    }
                }
            }
        }
        free(ap);
    }
    cpu_region_check(&err);
    free(bp);
}

// Both activation layouts of x (T, C): the two quantisers above, the reference the GPU's one-pass kernel
// matches bit for bit; the input is checked once.
int cpu_fp8_quantize_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T, int C, char *err,
                                  size_t err_size) {
    if (check_finite("fp8_quantize_both_layouts", x, T, C, err, err_size)) return -1;
    quantize_1x128_rows(q1, s1, x, T, C);
    quantize_128x1_rows(q2, s2, x, T, C);
    return 0;
}

// kernels.h's fp8_quantize_rmsnorm_both_layouts: its definition, RMSNorm's rows (as cpu_rmsnorm_forward writes them)
// and the both-layouts quantiser.
int cpu_fp8_quantize_rmsnorm_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                          const real *rstd, const real *weight, int T, int C, char *err,
                                          size_t err_size) {
    real *xn = cpu_values_or_die((size_t)T * C, "RMSNorm's rows");
    for (int t = 0; t < T; t++) cpu_rmsnorm_row(xn + (size_t)t * C, x + (size_t)t * C, rstd[t], weight, C);
    const int rc = check_finite("fp8_quantize_rmsnorm_both_layouts", xn, T, C, err, err_size);
    if (rc == 0) quantize_1x128_rows(q1, s1, xn, T, C), quantize_128x1_rows(q2, s2, xn, T, C);
    free(xn);
    return rc;
}

// ---------------------------------------------------------------------------- grouped quantisers
// kernels.h's *_grouped forms: the plain quantisers segment by segment, at the offsets kernels.h defines.
static void check_segments(const char *op, int n, const int *rows0) {
    int ok = n >= 1 && n <= FP8_MAX_SEGMENTS && rows0[0] == 0;
    for (int g = 0; ok && g < n; g++) ok = rows0[g + 1] >= rows0[g];
    if (!ok) {
        fprintf(stderr, "fp8moe: %s: %d segments with rows0[0] = %d - expected 1 to %d segments, rows0[0] = 0 and "
                        "rows0 non-decreasing\n", op, n, n >= 1 ? rows0[0] : 0, FP8_MAX_SEGMENTS);
        exit(1);
    }
}

// The segments' operands one after another; the input is checked by the caller, once for all segments.
static void quantize_1x128_segments(uint8_t *q, float *s, const real *x, int n, const int *rows0, int K) {
    const size_t KB = (size_t)ceil_div(K, FP8_TILE);
    size_t p16 = 0;
    for (int g = 0; g < n; g++) {
        const int T = rows0[g + 1] - rows0[g];
        if (T == 0) continue;
        quantize_1x128_rows(q + KB * FP8_TILE * p16, s + KB * p16, x + (size_t)rows0[g] * K, T, K);
        p16 += (size_t)round_up16(T);
    }
}

static void quantize_128x1_segments(uint8_t *q, float *s, const real *x, int n, const int *rows0, int C) {
    size_t tiles = 0;
    for (int g = 0; g < n; g++) {
        const int T = rows0[g + 1] - rows0[g];
        if (T == 0) continue;
        quantize_128x1_rows(q + (size_t)C * FP8_TILE * tiles, s + (size_t)C * tiles, x + (size_t)rows0[g] * C, T, C);
        tiles += (size_t)ceil_div(T, FP8_TILE);
    }
}

// x with its rows in the order x_rows gives (a new array of rows x cols, freed by the caller), or x itself
// when x_rows is NULL.
static const real *gathered(const real *x, const int *x_rows, int rows, int cols) {
    if (x_rows == NULL) return x;
    real *g = cpu_values_or_die((size_t)rows * cols, "gathered rows");
    for (int r = 0; r < rows; r++) memcpy(g + (size_t)r * cols, x + (size_t)x_rows[r] * cols, (size_t)cols * sizeof(real));
    return g;
}

typedef void (*SegmentQuantiser)(uint8_t *q, float *s, const real *x, int n, const int *rows0, int cols);

// A grouped quantiser on x's rows in the order x_rows gives (or x as it is): checked once, then quantised.
static int quantize_grouped(const char *op, SegmentQuantiser quantise, uint8_t *q, float *s, const real *x,
                            const int *x_rows, int n, const int *rows0, int cols, char *err, size_t err_size) {
    check_segments(op, n, rows0);
    const real *xg = gathered(x, x_rows, rows0[n], cols);
    const int rc = check_finite(op, xg, rows0[n], cols, err, err_size);
    if (rc == 0) quantise(q, s, xg, n, rows0, cols);
    if (xg != x) free((void *)xg);
    return rc ? -1 : 0;
}

int cpu_fp8_quantize_1x128_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n, const int *rows0,
                                   int K, char *err, size_t err_size) {
    return quantize_grouped("fp8_quantize_1x128_grouped", quantize_1x128_segments, q, s, x, x_rows, n, rows0, K, err,
                            err_size);
}

// kernels.h fp8_gather_1x128_grouped: segment by segment, row r's bytes and scales from row x_rows[r] of x's
// operand, then the padding rows as quantize_1x128_rows writes them.
void cpu_fp8_gather_1x128_grouped(uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n, const int *x_rows,
                                  int n, const int *rows0, int K) {
    static const char op[] = "fp8_gather_1x128_grouped";
    check_segments(op, n, rows0);
    const size_t KB = (size_t)ceil_div(K, FP8_TILE), Kp = KB * FP8_TILE, R16x = (size_t)round_up16(x_n);
    size_t p16 = 0;
    for (int g = 0; g < n; g++) {
        const int T = rows0[g + 1] - rows0[g], R16 = round_up16(T);
        if (T == 0) continue;
        uint8_t *qg = q + Kp * p16;
        float *sg = s + KB * p16;
        for (int r = 0; r < R16; r++) {
            const int src = r < T ? x_rows[rows0[g] + r] : -1;
            if (r < T && (src < 0 || src >= x_n)) {
                fprintf(stderr, "fp8moe: %s: x_rows[%d] = %d - expected a row of x in [0, %d)\n", op, rows0[g] + r,
                        src, x_n);
                exit(1);
            }
            if (src >= 0) memcpy(qg + (size_t)r * Kp, qx + (size_t)src * Kp, Kp);
            else memset(qg + (size_t)r * Kp, 0, Kp);
            for (size_t kb = 0; kb < KB; kb++) sg[kb * (size_t)R16 + (size_t)r] = src >= 0 ? sx[kb * R16x + (size_t)src] : 1.0f;
        }
        p16 += (size_t)R16;
    }
}

int cpu_fp8_quantize_128x1_transposed_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n,
                                              const int *rows0, int C, char *err, size_t err_size) {
    return quantize_grouped("fp8_quantize_128x1_transposed_grouped", quantize_128x1_segments, q, s, x, x_rows, n,
                            rows0, C, err, err_size);
}

static int quantize_both_grouped(const char *op, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int n,
                                 const int *rows0, int C, char *err, size_t err_size) {
    check_segments(op, n, rows0);
    if (check_finite(op, x, rows0[n], C, err, err_size)) return -1;
    quantize_1x128_segments(q1, s1, x, n, rows0, C);
    quantize_128x1_segments(q2, s2, x, n, rows0, C);
    return 0;
}

int cpu_fp8_quantize_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int n,
                                          const int *rows0, int C, char *err, size_t err_size) {
    return quantize_both_grouped("fp8_quantize_both_layouts_grouped", q1, s1, q2, s2, x, n, rows0, C, err, err_size);
}

// ---------------------------------------------------------------------------- the combine's gradient
// kernels.h's fp8_quantize_combine_grad_both_layouts_grouped: the rows moe_combine_backward would write into
// dexpert_out (the same product), then the both-layouts quantiser - the definition itself.
int cpu_fp8_quantize_combine_grad_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *dout,
                                                       const int *seg_token, const int *slot_of, const real *topk_w,
                                                       int K, int n, const int *rows0, int C, char *err,
                                                       size_t err_size) {
    static const char op[] = "fp8_quantize_combine_grad_both_layouts_grouped";
    check_segments(op, n, rows0);
    const int rows = rows0[n];
    real *dy = cpu_values_or_die((size_t)rows * C, "the combine's gradient rows");
    for (int s = 0; s < rows; s++) {
        const int t = seg_token[s];
        int k = 0;
        while (k < K && slot_of[(size_t)t * K + k] != s) k++;
        if (k == K) {
            fprintf(stderr, "fp8moe: %s: slot %d is not among the slots of its token %d - expected the routing plan's "
                            "seg_token and slot_of\n", op, s, t);
            exit(1);
        }
        const real w = topk_w[(size_t)t * K + k], *dt = dout + (size_t)t * C;
        for (int c = 0; c < C; c++) dy[(size_t)s * C + c] = w * dt[c];
    }
    const int rc = quantize_both_grouped(op, q1, s1, q2, s2, dy, n, rows0, C, err, err_size);
    free(dy);
    return rc;
}

// ---------------------------------------------------------------------------- SwiGLU values
// kernels.h's fp8_quantize_swiglu_*: the value computed into a temporary array by the CPU SwiGLU ops, then quantised
// by the grouped quantiser of the same name - the definition itself (the CUDA kernels compute it as they read).
// The BF16 inputs (kernels.h bf16_rows_ld) are widened to the FP32 values they hold first.
static real *swiglu_value(const char *op, SwigluValue value, const uint16_t *dout16, const uint16_t *a16,
                          const uint16_t *b16, int n, const int *rows0, int C) {
    check_segments(op, n, rows0);
    const int64_t count = (int64_t)rows0[n] * C;
    real *v = cpu_values_or_die((size_t)count, "SwiGLU values");
    const int64_t ld = bf16_rows_ld(C);
    real *a = cpu_bf16_rows_widened(a16, ld, rows0[n], C);
    real *b = b16 ? cpu_bf16_rows_widened(b16, ld, rows0[n], C) : NULL;
    real *dout = dout16 ? cpu_bf16_rows_widened(dout16, ld, rows0[n], C) : NULL;
    if (value == SWIGLU_OUT) cpu_swiglu_forward(v, a, b, count);
    else if (value == SWIGLU_DA) cpu_swiglu_backward(v, NULL, dout, a, b, count);
    else cpu_swiglu_backward(NULL, v, dout, a, b, count);
    free(a), free(b), free(dout);
    return v;
}

int cpu_fp8_quantize_swiglu_1x128_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout, const uint16_t *a,
                                          const uint16_t *b, int n, const int *rows0, int C, char *err, size_t err_size) {
    static const char op[] = "fp8_quantize_swiglu_1x128_grouped";
    real *v = swiglu_value(op, value, dout, a, b, n, rows0, C);
    const int rc = quantize_grouped(op, quantize_1x128_segments, q, s, v, NULL, n, rows0, C, err, err_size);
    free(v);
    return rc;
}

int cpu_fp8_quantize_swiglu_128x1_transposed_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                                     const uint16_t *a, const uint16_t *b, int n, const int *rows0, int C,
                                                     char *err, size_t err_size) {
    static const char op[] = "fp8_quantize_swiglu_128x1_transposed_grouped";
    real *v = swiglu_value(op, value, dout, a, b, n, rows0, C);
    const int rc = quantize_grouped(op, quantize_128x1_segments, q, s, v, NULL, n, rows0, C, err, err_size);
    free(v);
    return rc;
}

int cpu_fp8_quantize_swiglu_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, SwigluValue value,
                                                 const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n,
                                                 const int *rows0, int C, char *err, size_t err_size) {
    static const char op[] = "fp8_quantize_swiglu_both_layouts_grouped";
    real *v = swiglu_value(op, value, dout, a, b, n, rows0, C);
    const int rc = quantize_both_grouped(op, q1, s1, q2, s2, v, n, rows0, C, err, err_size);
    free(v);
    return rc;
}

// kernels.h's fp8_quantize_swiglu_grads_both_layouts_grouped: its definition, the two calls (DA, then DB).
int cpu_fp8_quantize_swiglu_grads_both_layouts_grouped(uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                       uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                       const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n,
                                                       const int *rows0, int C, char *err, size_t err_size) {
    if (cpu_fp8_quantize_swiglu_both_layouts_grouped(qa1, sa1, qa2, sa2, SWIGLU_DA, dout, a, b, n, rows0, C, err,
                                                     err_size))
        return -1;
    return cpu_fp8_quantize_swiglu_both_layouts_grouped(qb1, sb1, qb2, sb2, SWIGLU_DB, dout, a, NULL, n, rows0, C, err,
                                                        err_size);
}

// ---------------------------------------------------------------------------- FP8 GEMMs
// Fprop  y (T, N) = X W^T, written as BF16.
//   qx (T16, Kp), sx (KB, T16) from fp8_quantize_1x128(x, T, K): A = qx, sa = sx;
//   qw (Np, Kp), sw (NB, KB4) from fp8_quantize_128x128(w, N, K): B = the first N rows of qw,
//   sb(n, kb) = sw[(n / 128) * KB4 + kb]. Contraction over Kp.
void cpu_fp8_gemm_fprop(real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw, int T, int N,
                        int K) {
    const int KB = ceil_div(K, FP8_TILE), KB4 = ceil_div(KB, 4) * 4;
    float *sbx = aligned_or_die((size_t)KB * N * sizeof(float), "expanded weight scales");
    for (int kb = 0; kb < KB; kb++) {
        for (int n = 0; n < N; n++) sbx[(size_t)kb * N + n] = sw[(size_t)(n / FP8_TILE) * KB4 + kb];
    }
    block_scaled_gemm(y, OUT_WRITE_BF16, qx, sx, round_up16(T), qw, sbx, T, N, KB * FP8_TILE);
    free(sbx);
}

// Dgrad  dx (T, K) += dY W, the product rounded to BF16 (in the forward pass this was y = X W^T, so dX = dY W).
//   qdy (T16, Np), sdy (NB, T16) from fp8_quantize_1x128(dy, T, N): A = qdy, sa = sdy;
//   qwt (Kp, Np) and sw (NB, KB4) of the same weight: B = the first K rows of qwt,
//   sb(k, nb) = sw[nb * KB4 + k / 128]. Contraction over Np. mode: OUT_ADD_BF16, or OUT_WRITE_BF16 (GRAD_WRITE).
static void fp8_dgrad(OutMode mode, real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                      const float *sw, int T, int N, int K) {
    const int KB = ceil_div(K, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(N, FP8_TILE);
    float *sbx = aligned_or_die((size_t)NB * K * sizeof(float), "expanded weight scales");
    for (int nb = 0; nb < NB; nb++) {
        for (int k = 0; k < K; k++) sbx[(size_t)nb * K + k] = sw[(size_t)nb * KB4 + k / FP8_TILE];
    }
    block_scaled_gemm(dx, mode, qdy, sdy, round_up16(T), qwt, sbx, T, K, NB * FP8_TILE);
    free(sbx);
}

void cpu_fp8_gemm_dgrad(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw, int T,
                        int N, int K) {
    fp8_dgrad(OUT_ADD_BF16, dx, qdy, sdy, qwt, sw, T, N, K);
}

static void fp8_dgrad_write(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw,
                            int T, int N, int K) {
    fp8_dgrad(OUT_WRITE_BF16, dx, qdy, sdy, qwt, sw, T, N, K);
}

// Grouped Fprop and Dgrad: the plain GEMM segment by segment, at the *_grouped 1x128 offsets (kernels.h);
// out_cols and contraction are N and K for Fprop, K and N for Dgrad.
typedef void (*SegmentGemm)(real *out, const uint8_t *qa, const float *sa, const uint8_t *qb, const float *sb, int T,
                            int N, int K);

static void gemm_segments(const char *op, SegmentGemm gemm, real *out, int out_cols, int contraction, const uint8_t *qa,
                          const float *sa, const uint8_t *const *qb, const float *const *sb, int n, const int *rows0,
                          int N, int K) {
    check_segments(op, n, rows0);
    const size_t CB = (size_t)ceil_div(contraction, FP8_TILE);
    size_t p16 = 0;
    for (int g = 0; g < n; g++) {
        const int T = rows0[g + 1] - rows0[g];
        if (T == 0) continue;
        gemm(out + (size_t)rows0[g] * out_cols, qa + CB * FP8_TILE * p16, sa + CB * p16, qb[g], sb[g], T, N, K);
        p16 += (size_t)round_up16(T);
    }
}

void cpu_fp8_gemm_fprop_grouped(real *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                const float *const *sw, int n, const int *rows0, int N, int K) {
    gemm_segments("fp8_gemm_fprop_grouped", cpu_fp8_gemm_fprop, y, N, K, qx, sx, qw, sw, n, rows0, N, K);
}

// v (rows, cols), BF16 values already, as BF16 bits with row stride round_up(cols, 128); the padding columns and
// the 15 scratch rows 0 (kernels.h *_grouped_bf16).
static void store_bf16_rows(uint16_t *y, const real *v, size_t rows, int cols) {
    const size_t ld = (size_t)bf16_rows_ld(cols);
    memset(y, 0, (size_t)bf16_rows_elems((int64_t)rows, cols) * sizeof(uint16_t));
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < (size_t)cols; c++) y[r * ld + c] = float_to_bf16((float)v[r * (size_t)cols + c]);
}

// kernels.h fp8_gemm_fprop_grouped_bf16 and fp8_gemm_dgrad_grouped_bf16: the FP32 GEMMs' values (BF16-rounded
// already) as BF16 bits.
void cpu_fp8_gemm_fprop_grouped_bf16(uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                     const float *const *sw, int n, const int *rows0, int N, int K) {
    const size_t rows = (size_t)rows0[n];
    real *v = cpu_values_or_die(rows * (size_t)N, "BF16 Fprop output");
    cpu_fp8_gemm_fprop_grouped(v, qx, sx, qw, sw, n, rows0, N, K);
    store_bf16_rows(y, v, rows, N);
    free(v);
}

void cpu_fp8_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *const *qwt,
                                     const float *const *sw, int n, const int *rows0, int N, int K) {
    const size_t rows = (size_t)rows0[n];
    real *v = cpu_values_or_die(rows * (size_t)K, "BF16 Dgrad output");
    cpu_fp8_gemm_dgrad_grouped(v, GRAD_WRITE, qdy, sdy, qwt, sw, n, rows0, N, K);
    store_bf16_rows(dx, v, rows, K);
    free(v);
}

void cpu_fp8_gemm_dgrad_grouped(real *dx, GradStore store, const uint8_t *qdy, const float *sdy,
                                const uint8_t *const *qwt, const float *const *sw, int n, const int *rows0, int N,
                                int K) {
    gemm_segments("fp8_gemm_dgrad_grouped", store == GRAD_WRITE ? fp8_dgrad_write : cpu_fp8_gemm_dgrad, dx, K, N, qdy,
                  sdy, qwt, sw, n, rows0, N, K);
}

// Wgrad  dw (N, K) += dY^T X in FP32 (each element: dw = dw + acc, once).
//   qdyt (N, Tp), sdyt (TB, N) from fp8_quantize_128x1_transposed(dy, T, N): A = qdyt, sa = sdyt;
//   qxt (K, Tp), sxt (TB, K) from fp8_quantize_128x1_transposed(x, T, K): B = qxt, sb = sxt.
//   Contraction over Tp.
void cpu_fp8_gemm_wgrad(real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt, int T,
                        int N, int K) {
    const int TB = ceil_div(T, FP8_TILE);
    block_scaled_gemm(dw, OUT_ADD_FP32, qdyt, sdyt, N, qxt, sxt, N, K, TB * FP8_TILE);
}
