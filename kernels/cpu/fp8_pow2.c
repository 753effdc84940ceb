/*
 * fp8_pow2.c - power-of-2 tile scales for FP8 expert dispatch, the CPU reference (docs/fp8.md "Power-of-2
 * scales for expert dispatch", DESIGN.md section 5).
 *
 * At ep > 1 the MoE up-projections' input X is dispatched as FP8 rows with 1x128 scales (DeepSeek-V3 report,
 * section 3.3.3), so the expert rank holds X only in 1x128 tiles, while the experts' Wgrad needs X in 128x1
 * tiles. With scales that are integral powers of 2, dequantising is exact in FP32 and requantising a value
 * only moves its exponent, so the conversion 1x128 -> 128x1 loses nothing except in the E4M3 subnormals.
 * The same holds for the gradient dispatched to the down-projections. This file defines the bits:
 *   - the scale rule (cpu_fp8_pow2_scale_of_amax),
 *   - the two activation quantisers with that rule, in the layouts of fp8_quantize_1x128 and
 *     fp8_quantize_128x1_transposed (kernels.h, docs/fp8.md "Layouts"),
 *   - the conversion of a 1x128 power-of-2 operand into the 128x1 power-of-2 operand of the same values.
 * What it is not: wired into training (train/ still uses the exact scales amax / 448 everywhere), nor on CUDA.
 * It reuses fp8.c's E4M3 encoder, decoder and finiteness check. Like fp8.c it builds with -ffp-contract=off.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------- the scale rule
// s = 2^e with e = ceil(log2(amax / 448)) in exact arithmetic, i.e. the smallest power of 2 with amax <= 448 s,
// clamped to e in [FP8_POW2_MIN_EXP, FP8_POW2_MAX_EXP] = [-126, 119]; s = 1 when amax = 0.
// Integer operations on the FP32 bits only (no division, so no rounding to match): for a normal amax = 1.f * 2^E
// with biased exponent field E + 127 and fraction bits F, amax / 448 = (1.f / 1.75) * 2^(E - 8), so e = E - 8 if
// 1.f <= 1.75 (F <= 0x600000) and E - 7 otherwise. Adding 0x1FFFFF to the bits carries into the exponent field
// exactly when F > 0x600000, so the biased exponent of s is ((bits + 0x1FFFFF) >> 23) - 8. A subnormal amax gives
// at most 1 - 8 there and is clamped like every amax <= 448 * 2^-126.
// Why the clamp: 2^-126 is the smallest normal FP32 power of 2 (below it x / s and q * s stay exact, but nothing
// is gained for tiles whose largest value is below 6e-34); 2^119 keeps q * s <= 448 * 2^119 < FLT_MAX, so that
// dequantising never overflows (a tile with amax above 448 * 2^119 = 2.98e38 saturates to 448 instead).
float cpu_fp8_pow2_scale_of_amax(float amax) {
    uint32_t bits;
    memcpy(&bits, &amax, sizeof bits);
    bits &= 0x7FFFFFFFu;  // amax >= 0; a -0 is an all-zero tile too
    if (bits == 0) return 1.0f;
    int biased = (int)((bits + 0x1FFFFFu) >> 23) - 8;
    if (biased < FP8_POW2_MIN_EXP + 127) biased = FP8_POW2_MIN_EXP + 127;
    if (biased > FP8_POW2_MAX_EXP + 127) biased = FP8_POW2_MAX_EXP + 127;
    const uint32_t sbits = (uint32_t)biased << 23;
    float s;
    memcpy(&s, &sbits, sizeof s);
    return s;
}

// Whether s is a scale the rule can give: +2^e, e in [-126, 119] (the all-zero tile's 1 is 2^0).
static int is_pow2_scale(float s) {
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    const int field = (int)(bits >> 23);  // the sign bit makes a negative scale fail the range test
    return (bits & 0x7FFFFFu) == 0 && field >= FP8_POW2_MIN_EXP + 127 && field <= FP8_POW2_MAX_EXP + 127;
}

// ---------------------------------------------------------------------------- quantisers
// Per element q = e4m3_rne_sat(x / s) with fp8.c's encoder (one FP32 division, then RNE to E4M3). With s = 2^e
// the division is exact whenever |x / s| >= 2^-126 (it only changes the exponent), and smaller quotients encode
// as a zero of x's sign either way, so q is the single rounding of the exact x / s; x * 2^-e gives the same bits
// (CUDA may multiply). |x / s| <= 448 by the rule except above the clamp, so saturation is never reached below it.

static inline float amax_of(const real *x, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf((float)x[i]);
        m = a > m ? a : m;
    }
    return m;
}

// x (rows, K) -> q (R16, Kp), s (KB, R16), the layout of fp8_quantize_1x128: tile (r, kb) is x[r, 128 kb ..
// 128 kb + 127] with scale s[kb * R16 + r] = cpu_fp8_pow2_scale_of_amax(its amax); columns K..Kp-1 code 0; the
// padding rows rows..R16-1 code 0, scale 1.
int cpu_fp8_quantize_1x128_pow2(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size) {
    if (cpu_fp8_check_finite("fp8_quantize_1x128_pow2", x, rows, K, err, err_size)) return -1;
    const int KB = ceil_div(K, FP8_TILE), Kp = KB * FP8_TILE, R16 = ceil_div(rows, 16) * 16;
    memset(q + (size_t)rows * Kp, 0, (size_t)(R16 - rows) * Kp);
    for (int kb = 0; kb < KB; kb++) {
        for (int r = rows; r < R16; r++) s[(size_t)kb * R16 + r] = 1.0f;
    }
#pragma omp parallel for schedule(static) if ((double)rows * K > 16384.0)
    for (int r = 0; r < rows; r++) {
        for (int kb = 0; kb < KB; kb++) {
            const int k0 = kb * FP8_TILE, len = K - k0 < FP8_TILE ? K - k0 : FP8_TILE;
            const real *xt = x + (size_t)r * K + k0;
            uint8_t *qt = q + (size_t)r * Kp + k0;
            const float sc = cpu_fp8_pow2_scale_of_amax(amax_of(xt, len));
            s[(size_t)kb * R16 + r] = sc;
            cpu_fp8_encode_scaled(qt, xt, len, sc);
            memset(qt + len, 0, (size_t)(FP8_TILE - len));
        }
    }
    return 0;
}

// One block of 128 tokens of the 128x1 layout: xb (rows, C), rows <= 128, the block's rows of x ->
// q[c * Tp + i] for i < 128 (code 0 for i >= rows; q already points at the block's first token) and
// s_block[c] (the block's row of the (TB, C) scales). Column by column: gathered into a contiguous tile,
// its amax, its scale, encoded with fp8.c's encoder.
static void quantize_128x1_pow2_block(uint8_t *q, size_t Tp, float *s_block, const real *xb, int rows, int C) {
#pragma omp parallel for schedule(static) if ((double)rows * C > 16384.0)
    for (int c = 0; c < C; c++) {
        real col[FP8_TILE];
        for (int i = 0; i < rows; i++) col[i] = xb[(size_t)i * C + c];
        const float sc = cpu_fp8_pow2_scale_of_amax(amax_of(col, rows));
        s_block[c] = sc;
        uint8_t *qc = q + (size_t)c * Tp;
        cpu_fp8_encode_scaled(qc, col, rows, sc);
        memset(qc + rows, 0, (size_t)(FP8_TILE - rows));
    }
}

// x (T, C) -> q (C, Tp), s (TB, C), the layout of fp8_quantize_128x1_transposed: tile (tb, c) is
// x[128 tb .. 128 tb + 127, c] with scale s[tb * C + c] = cpu_fp8_pow2_scale_of_amax(its amax), and
// q[c * Tp + t] = e4m3(x[t, c] / s), code 0 for T <= t < Tp.
int cpu_fp8_quantize_128x1_transposed_pow2(uint8_t *q, float *s, const real *x, int T, int C, char *err,
                                           size_t err_size) {
    if (cpu_fp8_check_finite("fp8_quantize_128x1_transposed_pow2", x, T, C, err, err_size)) return -1;
    const int TB = ceil_div(T, FP8_TILE);
    const size_t Tp = (size_t)TB * FP8_TILE;
    for (int tb = 0; tb < TB; tb++) {
        const int t0 = tb * FP8_TILE, rows = T - t0 < FP8_TILE ? T - t0 : FP8_TILE;
        quantize_128x1_pow2_block(q + t0, Tp, s + (size_t)tb * C, x + (size_t)t0 * C, rows, C);
    }
    return 0;
}

// ---------------------------------------------------------------------------- 1x128 -> 128x1
// Defined as: dequantise exactly, v[t, c] = e4m3_value(q1[t, c]) * s1[c / 128, t] (one FP32 product, exact: a
// code has at most 4 significant bits, its lowest bit weighs at least 2^-9, and s1 = 2^e with e in [-126, 119],
// so the product is a multiple of 2^-135 below 448 * 2^119), then quantise v with
// cpu_fp8_quantize_128x1_transposed_pow2. The result equals that quantiser applied to the dequantised array, bit
// for bit (the same block routine).
// When it is lossless (docs/fp8.md): with s2 the 128x1 tile's scale, the new code is v / s2 = q1 * (s1 / s2),
// a shift of q1's exponent. E4M3's normals are closed under such shifts within [2^-6, 448], and |v| <= 448 s2
// by the rule, so w = v whenever s2 <= s1 or |v| >= 2^-6 s2; otherwise (v lands in the 128x1 tile's subnormals)
// w is v rounded to a multiple of 2^-9 s2: |w - v| <= 2^-10 s2.
int cpu_fp8_1x128_to_128x1_transposed_pow2(uint8_t *q2, float *s2, const uint8_t *q1, const float *s1, int T, int C,
                                           char *err, size_t err_size) {
    static const char op[] = "fp8_1x128_to_128x1_transposed_pow2";
    const int CB = ceil_div(C, FP8_TILE), Cp = CB * FP8_TILE, R16 = ceil_div(T, 16) * 16, TB = ceil_div(T, FP8_TILE);
    const size_t Tp = (size_t)TB * FP8_TILE;
    // Refused before anything is written: a scale the rule cannot give (e.g. the exact amax / 448 of
    // fp8_quantize_1x128, for which the dequantised products round and the conversion is not this op), and the
    // NaN codes 0x7F / 0xFF that no quantiser writes (they quantise finite values only).
    for (int t = 0; t < T; t++) {
        for (int cb = 0; cb < CB; cb++) {
            const float sc = s1[(size_t)cb * R16 + t];
            if (is_pow2_scale(sc)) continue;
            if (err && err_size > 0) {
                snprintf(err, err_size,
                         "%s: input (%d x %d) has the scale %a (%g) at row %d, column block %d (expected a power of 2 "
                         "in [2^%d, 2^%d], as fp8_quantize_1x128_pow2 writes)",
                         op, T, C, (double)sc, (double)sc, t, cb, FP8_POW2_MIN_EXP, FP8_POW2_MAX_EXP);
            }
            return -1;
        }
        for (int c = 0; c < C; c++) {
            const uint8_t code = q1[(size_t)t * Cp + c];
            if ((code & 0x7F) != 0x7F) continue;
            if (err && err_size > 0) {
                snprintf(err, err_size,
                         "%s: input (%d x %d) has the NaN code 0x%02X at row %d, column %d (expected the codes of "
                         "finite values, as the quantisers write)", op, T, C, code, t, c);
            }
            return -1;
        }
    }
    float value[256];
    for (int i = 0; i < 256; i++) value[i] = fp8_e4m3_to_float((uint8_t)i);
    real *v = cpu_values_or_die((size_t)FP8_TILE * C, "fp8_1x128_to_128x1_transposed_pow2 block");
    for (int tb = 0; tb < TB; tb++) {
        const int t0 = tb * FP8_TILE, rows = T - t0 < FP8_TILE ? T - t0 : FP8_TILE;
        for (int i = 0; i < rows; i++) {
            const uint8_t *qr = q1 + (size_t)(t0 + i) * Cp;
            real *vr = v + (size_t)i * C;
            for (int c = 0; c < C; c++) vr[c] = (real)(value[qr[c]] * s1[(size_t)(c / FP8_TILE) * R16 + t0 + i]);
        }
        quantize_128x1_pow2_block(q2 + t0, Tp, s2 + (size_t)tb * C, v, rows, C);
    }
    free(v);
    return 0;
}
