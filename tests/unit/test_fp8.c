/*
 * test_fp8.c - unit tests of the FP8 recipe's CPU reference (kernels/cpu/fp8.c) and of the BF16
 * baseline GEMMs (kernels/cpu/bf16_gemm.c), FP32 build.
 *
 * Everything is checked against references written here from the definitions, not against the code
 * under test: E4M3 values come from the format's formula and rounding is a nearest-value search over
 * that table; the quantisers are re-implemented in double; every GEMM is compared (1) bit for bit with
 * a plain scalar loop of the documented FP32 arithmetic, (2) with the exact (double) product of the same
 * quantised operands, to the FP32 accumulation bound, and (3) with the unquantised FP64 product, to the
 * error E4M3 quantisation allows. The bounds are derived at each check and in docs/fp8.md. The grouped
 * (per-expert segment) quantisers and GEMMs must equal the plain ones segment by segment, bit for bit. The
 * quantisers of SwiGLU values (fp8_quantize_swiglu_*) must equal, bit for bit, the composition their contract
 * names: the public SwiGLU op into an array, then the grouped quantiser; the joint quantiser of both SwiGLU
 * gradients (fp8_quantize_swiglu_grads_both_layouts_grouped) the two calls it stands for, errors included. So must
 * the quantiser of the routed experts' output gradient read through the routing plan
 * (fp8_quantize_combine_grad_both_layouts_grouped): moe_combine_backward into dexpert_out, then the grouped
 * both-layouts quantiser.
 * Run with OPCHECK_VERBOSE=1 to see how much room each bound leaves.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "opcheck.h"

#define U32 0x1p-24  // FP32 unit roundoff
#define U_BF16 0x1p-8  // BF16 unit roundoff (8 significant bits): |bf16(x) - x| <= 2^-8 |bf16(x)|

// ---------------------------------------------------------------------------- allocation
static void *tracked[256];
static int n_tracked;

static void *talloc(size_t bytes) {
    void *p = calloc(1, bytes > 0 ? bytes : 1);
    assert_non_null(p);
    assert_true(n_tracked < (int)(sizeof(tracked) / sizeof(tracked[0])));
    tracked[n_tracked++] = p;
    return p;
}
static real *ralloc(size_t n) { return talloc(n * sizeof(real)); }
static double *dalloc(size_t n) { return talloc(n * sizeof(double)); }
static float *falloc(size_t n) { return talloc(n * sizeof(float)); }
static uint8_t *balloc(size_t n) { return talloc(n); }
static void tfree_all(void) {
    for (int i = 0; i < n_tracked; i++) free(tracked[i]);
    n_tracked = 0;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static uint32_t float_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

// ---------------------------------------------------------------------------- independent E4M3 reference
// Value of an E4M3 code from the format's definition: sign bit, exponent field e (bias 7), mantissa m;
// e = 0: m * 2^-9; e = 15, m = 7: NaN; else (1 + m/8) * 2^(e - 7).
static double ref_e4m3_value(int code) {
    const int e = (code >> 3) & 15, m = code & 7;
    double v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = m / 512.0;
    else v = (1.0 + m / 8.0) * pow(2.0, e - 7);
    return (code & 0x80) ? -v : v;
}

// Round v to E4M3: nearest finite value, ties to the even code (even mantissa), saturating at 448; NaN ->
// 0x7F. The non-negative finite values are codes 0..126 in increasing order; binary search the last one
// <= |v|, then compare the distances to it and to the next one (both differences are exact in double
// for the float-derived inputs used here, or far from a tie).
static uint8_t ref_e4m3_round(double v) {
    if (isnan(v)) return 0x7F;
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const double a = fabs(v);
    if (a >= 448.0) return sign | 0x7E;
    int lo = 0, hi = 126;  // value(lo) <= a < value(hi + ...) invariant on the search range
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ref_e4m3_value(mid) <= a) lo = mid;
        else hi = mid - 1;
    }
    const double below = ref_e4m3_value(lo), above = ref_e4m3_value(lo + 1);
    const double d_below = a - below, d_above = above - a;
    int code = lo;
    if (d_above < d_below || (d_above == d_below && (lo & 1))) code = lo + 1;
    return sign | (uint8_t)code;
}

// Quantise one tile as DESIGN.md section 4 says, in double where double is exact: xf are the FP32 values
// of the tile. amax = max |xf|; s = FP32(amax / 448) (a double quotient rounded to float is the correctly
// rounded FP32 quotient: 53 >= 2 * 24 + 2), s = 1 when that is 0; q = e4m3(FP32(xf / s)).
static float ref_quantize_tile(uint8_t *q, const double *xf, int n) {
    double amax = 0;
    for (int i = 0; i < n; i++) amax = fmax(amax, fabs(xf[i]));
    float s = (float)(amax / 448.0);
    if (s == 0.0f) s = 1.0f;
    for (int i = 0; i < n; i++) q[i] = ref_e4m3_round((double)(float)(xf[i] / (double)s));
    return s;
}

// x (n) random and never zero with a wide range of magnitudes: sign * (1 + u) * 2^(e + shift(i)), e
// uniform in [lo_exp, hi_exp]. Within a tile that spans about 2^-20 .. 2, so quotients x / s cover
// E4M3 normals, subnormals and values that round to zero.
static void fill_wide(real *x, size_t n, uint64_t seed, double lo_exp, double hi_exp) {
    for (size_t i = 0; i < n; i++) {
        const double u = opcheck_uniform(seed, 3 * i);
        const double e = lo_exp + (hi_exp - lo_exp) * opcheck_uniform(seed, 3 * i + 1);
        const double sign = opcheck_uniform(seed, 3 * i + 2) < 0.5 ? -1.0 : 1.0;
        x[i] = (real)(sign * (1.0 + u) * exp2(e));
    }
}

// Number of non-zero subnormal codes (exponent field 0) among n codes: the GEMM tests use data whose
// range within a tile reaches E4M3's subnormals, so the error bound's subnormal terms are exercised.
static size_t count_subnormal_codes(const uint8_t *q, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += (q[i] & 0x78) == 0 && (q[i] & 0x07) != 0;
    return count;
}

// ---------------------------------------------------------------------------- E4M3 conversion
static void test_e4m3_all_codes(void **state) {
    (void)state;
    int nan_codes = 0;
    for (int code = 0; code < 256; code++) {
        const float v = fp8_e4m3_to_float((uint8_t)code);
        const double want = ref_e4m3_value(code);
        if (isnan(want)) {
            assert_true(code == 0x7F || code == 0xFF);
            assert_true(isnan(v));
            nan_codes++;
            continue;
        }
        // decode is exact (compared as bits, so -0 must be -0) and encode(decode(code)) gives the code back
        assert_int_equal(float_bits(v), float_bits((float)want));
        assert_int_equal(fp8_e4m3_from_float(v), code);
    }
    assert_int_equal(nan_codes, 2);
    assert_int_equal(fp8_e4m3_from_float(0.0f), 0x00);
    assert_int_equal(fp8_e4m3_from_float(-0.0f), 0x80);
    assert_true(fp8_e4m3_to_float(0x7E) == 448.0f && fp8_e4m3_to_float(0x01) == 0x1p-9f);
}

static void test_e4m3_ties_to_even(void **state) {
    (void)state;
    // Hand-worked: (input, code). A tie goes to the even mantissa; just off a tie goes to the nearer value.
    const struct { float x; uint8_t code; } cases[] = {
        {1.0625f, 0x38},       // between 1.0 (0x38, m=0) and 1.125 (0x39): tie -> 1.0
        {1.1875f, 0x3A},       // between 1.125 (0x39, m=1) and 1.25 (0x3A): tie -> 1.25
        {nextafterf(1.0625f, 2.0f), 0x39}, {nextafterf(1.1875f, 0.0f), 0x39},
        {1.9375f, 0x40},       // between 1.875 (0x3F, m=7) and 2.0 (0x40): tie -> 2.0, carry into the exponent
        {272.0f, 0x78},        // 2^8 binade: between 256 (0x78) and 288 (0x79) -> 256
        {304.0f, 0x7A},        // between 288 (0x79) and 320 (0x7A) -> 320
        {432.0f, 0x7E},        // between 416 (0x7D) and 448 (0x7E) -> 448
        {232.0f, 0x76},        // between 224 (0x76) and 240 (0x77) -> 224
        {0x1.1p-6f, 0x08},     // smallest normal binade: between 2^-6 (0x08) and 1.125 * 2^-6 (0x09) -> 0x08
        {0x1.3p-6f, 0x0A},     // between 0x09 and 0x0A -> 0x0A
        {0x1p-10f, 0x00},      // half the smallest subnormal: tie between 0 and 2^-9 -> 0
        {nextafterf(0x1p-10f, 1.0f), 0x01},
        {3 * 0x1p-10f, 0x02},  // between 1 * 2^-9 and 2 * 2^-9 -> 2
        {5 * 0x1p-10f, 0x02},  // between 2 and 3 -> 2
        {7 * 0x1p-10f, 0x04},  // between 3 and 4 -> 4
        {13 * 0x1p-10f, 0x06}, // between 6 and 7 -> 6
        {15 * 0x1p-10f, 0x08}, // between 7 * 2^-9 (0x07) and 2^-6 (0x08) -> 0x08
        {0x1p-40f, 0x00}, {0x1p-149f, 0x00},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(fp8_e4m3_from_float(cases[i].x), cases[i].code);
        assert_int_equal(fp8_e4m3_from_float(-cases[i].x), cases[i].code | 0x80);
        assert_int_equal(ref_e4m3_round(cases[i].x), cases[i].code);  // the reference agrees with the hand work
    }
}

static void test_e4m3_saturation(void **state) {
    (void)state;
    const float big[] = {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1000.0f, 1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(fp8_e4m3_from_float(big[i]), 0x7E);
        assert_int_equal(fp8_e4m3_from_float(-big[i]), 0xFE);
    }
    assert_int_equal(fp8_e4m3_from_float(nextafterf(448.0f, 0.0f)), 0x7E);
    assert_int_equal(fp8_e4m3_from_float(NAN), 0x7F);
    assert_int_equal(fp8_e4m3_from_float(-NAN), 0x7F);
}

// Random FP32 values over the whole E4M3 range and beyond (|x| from 2^-14 to 2^10), plus random bit
// patterns of every exponent, against the nearest-value search.
static void test_e4m3_random_against_search(void **state) {
    (void)state;
    for (uint64_t i = 0; i < 200000; i++) {
        const double e = -14.0 + 24.0 * opcheck_uniform(11, 2 * i);
        const double sign = opcheck_uniform(11, 2 * i + 1) < 0.5 ? -1 : 1;
        const float x = (float)(sign * exp2(e));
        if (fp8_e4m3_from_float(x) != ref_e4m3_round(x)) fail_msg("x = %a: got 0x%02X, want 0x%02X", (double)x,
                                                                    fp8_e4m3_from_float(x), ref_e4m3_round(x));
        const uint32_t bits = (uint32_t)(opcheck_mix64(i ^ 0x5EEDull) >> 32);
        float y;
        memcpy(&y, &bits, sizeof y);
        if (fp8_e4m3_from_float(y) != ref_e4m3_round(y)) fail_msg("bits 0x%08X: got 0x%02X, want 0x%02X", bits,
                                                                    fp8_e4m3_from_float(y), ref_e4m3_round(y));
    }
}

// ---------------------------------------------------------------------------- quantisers
// 1x128: x (rows, K) -> q (R16, Kp), s (KB, R16). 37 rows (R16 = 48: 11 padding rows), K = 300 (2 full
// tiles + 44), one all-zero tile.
static void test_quantize_1x128(void **state) {
    (void)state;
    const int rows = 37, R16 = 48, K = 300, KB = ceil_div(K, 128), Kp = KB * 128;
    real *x = ralloc((size_t)rows * K);
    fill_wide(x, (size_t)rows * K, 21, -20, 1);
    for (int r = 0; r < rows; r++) {  // a different scale for every row: 2^-30 .. 2^30
        for (int k = 0; k < K; k++) x[(size_t)r * K + k] *= (real)exp2((r * 7) % 61 - 30);
    }
    for (int k = 128; k < 256; k++) x[(size_t)4 * K + k] = 0;  // tile (row 4, kb 1) is all zero
    uint8_t *q = balloc((size_t)R16 * Kp);
    float *s = falloc((size_t)KB * R16);
    memset(q, 0xAA, (size_t)R16 * Kp);
    for (size_t i = 0; i < (size_t)KB * R16; i++) s[i] = -7.0f;
    char err[256] = "";
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, q, s, x, rows, K, err, sizeof err), 0);
    for (int r = rows; r < R16; r++) {  // the padding rows: code 0, scale 1
        for (int k = 0; k < Kp; k++) assert_int_equal(q[(size_t)r * Kp + k], 0);
        for (int kb = 0; kb < KB; kb++) assert_true(s[(size_t)kb * R16 + r] == 1.0f);
    }

    double xf[128];
    uint8_t qref[128];
    for (int r = 0; r < rows; r++) {
        for (int kb = 0; kb < KB; kb++) {
            const int n = K - kb * 128 < 128 ? K - kb * 128 : 128;
            for (int i = 0; i < n; i++) xf[i] = (double)(float)x[(size_t)r * K + kb * 128 + i];
            const float sref = ref_quantize_tile(qref, xf, n);
            assert_int_equal(float_bits(s[(size_t)kb * R16 + r]), float_bits(sref));
            assert_memory_equal(q + (size_t)r * Kp + kb * 128, qref, (size_t)n);
            for (int i = n; i < 128; i++) assert_int_equal(q[(size_t)r * Kp + kb * 128 + i], 0);  // padding
        }
    }
    // the data reach every kind of code: subnormals, and non-zero inputs that round to +-0
    size_t rounded_to_zero = 0;
    for (int r = 0; r < rows; r++) {
        for (int k = 0; k < K; k++) rounded_to_zero += x[(size_t)r * K + k] != 0 && (q[(size_t)r * Kp + k] & 0x7F) == 0;
    }
    assert_true(rounded_to_zero > 0 && count_subnormal_codes(q, (size_t)rows * Kp) > 0);
    assert_true(s[1 * R16 + 4] == 1.0f);  // the all-zero tile: scale 1, codes 0
    for (int k = 128; k < 256; k++) assert_int_equal(q[(size_t)4 * Kp + k], 0);
    tfree_all();
}

// 128x128: w (N, K) -> q (Np, Kp), qt (Kp, Np), s (NB, KB4). N = 576 (4.5 blocks, as W_DKV), K = 300,
// so KB = 3 and KB4 = 4: one padding scale per block row. Block (1, 2) is all zero.
static void test_quantize_128x128(void **state) {
    (void)state;
    const int N = 576, K = 300, KB = ceil_div(K, 128), KB4 = 4, NB = ceil_div(N, 128), Kp = KB * 128, Np = NB * 128;
    real *w = ralloc((size_t)N * K);
    fill_wide(w, (size_t)N * K, 22, -20, 1);
    for (int n = 0; n < N; n++) {  // each block row at its own scale
        for (int k = 0; k < K; k++) w[(size_t)n * K + k] *= (real)exp2(10 * (n / 128) - 20);
    }
    for (int n = 128; n < 256; n++) {
        for (int k = 256; k < K; k++) w[(size_t)n * K + k] = 0;
    }
    uint8_t *q = balloc((size_t)Np * Kp), *qt = balloc((size_t)Np * Kp);
    float *s = falloc((size_t)NB * KB4);
    memset(q, 0xAA, (size_t)Np * Kp);
    memset(qt, 0xAA, (size_t)Np * Kp);
    char err[256] = "";
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, q, qt, s, w, N, K, err, sizeof err), 0);

    double *xf = dalloc(128 * 128);
    uint8_t *qref = balloc(128 * 128);
    for (int nb = 0; nb < NB; nb++) {
        for (int kb = 0; kb < KB; kb++) {
            const int rows = N - nb * 128 < 128 ? N - nb * 128 : 128, cols = K - kb * 128 < 128 ? K - kb * 128 : 128;
            for (int i = 0; i < rows; i++) {
                const real *wrow = w + (size_t)(nb * 128 + i) * K + kb * 128;
                for (int j = 0; j < cols; j++) xf[i * cols + j] = (double)(float)wrow[j];
            }
            const float sref = ref_quantize_tile(qref, xf, rows * cols);
            assert_int_equal(float_bits(s[(size_t)nb * KB4 + kb]), float_bits(sref));
            for (int i = 0; i < 128; i++) {
                for (int j = 0; j < 128; j++) {
                    const size_t n = (size_t)nb * 128 + i, k = (size_t)kb * 128 + j;
                    const uint8_t want = (i < rows && j < cols) ? qref[i * cols + j] : 0;
                    assert_int_equal(q[n * Kp + k], want);
                    assert_int_equal(qt[k * Np + n], want);
                }
            }
        }
        assert_true(s[(size_t)nb * KB4 + 3] == 1.0f);  // the K-block padding to a multiple of 4
    }
    assert_true(s[1 * KB4 + 2] == 1.0f);
    // qt may be NULL (no Dgrad follows): q and s are the same
    uint8_t *q2 = balloc((size_t)Np * Kp);
    float *s2 = falloc((size_t)NB * KB4);
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, q2, NULL, s2, w, N, K, err, sizeof err), 0);
    assert_memory_equal(q2, q, (size_t)Np * Kp);
    assert_memory_equal(s2, s, (size_t)NB * KB4 * sizeof(float));
    tfree_all();
}

// The batched form (a stack of routed-expert weights): each matrix gets the single call's bits, and a
// non-finite element is named at its row of the stacked (batch * N, K).
static void test_quantize_128x128_batched(void **state) {
    (void)state;
    enum { BATCH = 3, N = 200, K = 300, KB = 3, KB4 = 4, NB = 2, Kp = 384, Np = 256 };
    real *w = ralloc((size_t)BATCH * N * K);
    fill_wide(w, (size_t)BATCH * N * K, 23, -20, 1);
    uint8_t *q = balloc((size_t)BATCH * Np * Kp), *qt = balloc((size_t)BATCH * Np * Kp);
    uint8_t *q1 = balloc((size_t)Np * Kp), *qt1 = balloc((size_t)Np * Kp);
    float *s = falloc((size_t)BATCH * NB * KB4), *s1 = falloc((size_t)NB * KB4);
    char err[256] = "";
    assert_int_equal(fp8_quantize_128x128_batched(DEVICE_CPU, q, qt, s, w, BATCH, N, K, err, sizeof err), 0);
    for (int b = 0; b < BATCH; b++) {
        assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, q1, qt1, s1, w + (size_t)b * N * K, N, K, err, sizeof err), 0);
        assert_memory_equal(q + (size_t)b * Np * Kp, q1, (size_t)Np * Kp);
        assert_memory_equal(qt + (size_t)b * Np * Kp, qt1, (size_t)Np * Kp);
        assert_memory_equal(s + (size_t)b * NB * KB4, s1, sizeof(float) * NB * KB4);
    }
    w[((size_t)2 * N + 5) * K + 7] = (real)NAN;  // matrix 2, row 5: row 405 of the stack
    assert_int_equal(fp8_quantize_128x128_batched(DEVICE_CPU, q, qt, s, w, BATCH, N, K, err, sizeof err), -1);
    assert_non_null(strstr(err, "row 405, column 7"));
    tfree_all();
}

// 128x1 transposed: x (T, C) -> q (C, Tp), s (TB, C). T = 300 (2 full T-blocks + 44), C = 200;
// column 7 is zero in T-block 1.
static void test_quantize_128x1_transposed(void **state) {
    (void)state;
    const int T = 300, C = 200, TB = ceil_div(T, 128), Tp = TB * 128;
    real *x = ralloc((size_t)T * C);
    fill_wide(x, (size_t)T * C, 23, -20, 1);
    for (int t = 0; t < T; t++) {  // each column at its own scale
        for (int c = 0; c < C; c++) x[(size_t)t * C + c] *= (real)exp2((c * 13) % 61 - 30);
    }
    for (int t = 128; t < 256; t++) x[(size_t)t * C + 7] = 0;
    uint8_t *q = balloc((size_t)C * Tp);
    float *s = falloc((size_t)TB * C);
    memset(q, 0xAA, (size_t)C * Tp);
    char err[256] = "";
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, q, s, x, T, C, err, sizeof err), 0);

    double xf[128];
    uint8_t qref[128];
    for (int c = 0; c < C; c++) {
        for (int tb = 0; tb < TB; tb++) {
            const int n = T - tb * 128 < 128 ? T - tb * 128 : 128;
            for (int i = 0; i < n; i++) xf[i] = (double)(float)x[(size_t)(tb * 128 + i) * C + c];
            const float sref = ref_quantize_tile(qref, xf, n);
            assert_int_equal(float_bits(s[(size_t)tb * C + c]), float_bits(sref));
            assert_memory_equal(q + (size_t)c * Tp + tb * 128, qref, (size_t)n);
            for (int i = n; i < 128; i++) assert_int_equal(q[(size_t)c * Tp + tb * 128 + i], 0);
        }
    }
    assert_true(s[1 * C + 7] == 1.0f);
    for (int t = 128; t < 256; t++) assert_int_equal(q[(size_t)7 * Tp + t], 0);
    tfree_all();
}

// Grouped quantisers (kernels.h): segments of 37, 0, 163, 128 and 17 rows of x (C = 300) give, at the
// offsets kernels.h defines, the bytes and scales of the plain quantisers run on each segment; the empty
// segment takes no space, and both_layouts_grouped equals the other two.
static void test_quantize_grouped(void **state) {
    (void)state;
    enum { NSEG = 5, C = 300, KB = 3, Kp = 384 };
    const int rows0[NSEG + 1] = {0, 37, 37, 200, 328, 345}, T = rows0[NSEG];
    int p16 = 0, tiles = 0;
    for (int g = 0; g < NSEG; g++) {
        p16 += ceil_div(rows0[g + 1] - rows0[g], 16) * 16, tiles += ceil_div(rows0[g + 1] - rows0[g], 128);
    }
    assert_int_equal(p16, 48 + 0 + 176 + 128 + 32);
    assert_int_equal(tiles, 1 + 0 + 2 + 1 + 1);
    real *x = ralloc((size_t)T * C);
    fill_wide(x, (size_t)T * C, 24, -20, 1);
    uint8_t *q1 = balloc((size_t)p16 * Kp), *q2 = balloc((size_t)C * tiles * 128);
    uint8_t *b1 = balloc((size_t)p16 * Kp), *b2 = balloc((size_t)C * tiles * 128);
    float *s1 = falloc((size_t)KB * p16), *s2 = falloc((size_t)tiles * C);
    float *bs1 = falloc((size_t)KB * p16), *bs2 = falloc((size_t)tiles * C);
    char err[256] = "";
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, x, NULL, NSEG, rows0, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CPU, q2, s2, x, NULL, NSEG, rows0, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_both_layouts_grouped(DEVICE_CPU, b1, bs1, b2, bs2, x, NSEG, rows0, C, err, sizeof err),
                     0);
    assert_memory_equal(b1, q1, (size_t)p16 * Kp);
    assert_memory_equal(bs1, s1, (size_t)KB * p16 * sizeof(float));
    assert_memory_equal(b2, q2, (size_t)C * tiles * 128);
    assert_memory_equal(bs2, s2, (size_t)tiles * C * sizeof(float));
    for (int g = 0, at16 = 0, at128 = 0; g < NSEG; g++) {
        const int n = rows0[g + 1] - rows0[g], n16 = ceil_div(n, 16) * 16, nt = ceil_div(n, 128);
        if (n == 0) continue;
        uint8_t *q = balloc((size_t)n16 * Kp), *qt = balloc((size_t)C * nt * 128);
        float *s = falloc((size_t)KB * n16), *st = falloc((size_t)nt * C);
        assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, q, s, x + (size_t)rows0[g] * C, n, C, err, sizeof err), 0);
        assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, qt, st, x + (size_t)rows0[g] * C, n, C, err, sizeof err), 0);
        assert_memory_equal(q1 + (size_t)at16 * Kp, q, (size_t)n16 * Kp);
        assert_memory_equal(s1 + (size_t)KB * at16, s, (size_t)KB * n16 * sizeof(float));
        assert_memory_equal(q2 + (size_t)C * 128 * at128, qt, (size_t)C * nt * 128);
        assert_memory_equal(s2 + (size_t)C * at128, st, (size_t)nt * C * sizeof(float));
        at16 += n16, at128 += nt;
    }
    // rows read through an index (x_rows): the bits of the call on the gathered rows. src holds x's rows
    // scattered (row r of x is row dest[r] of src, the rest of src random), x_rows the way back.
    const int S = T + 50;
    real *src = ralloc((size_t)S * C);
    int *x_rows = talloc((size_t)T * sizeof(int)), *taken = talloc((size_t)S * sizeof(int));
    fill_wide(src, (size_t)S * C, 25, -20, 1);
    memset(taken, 0, (size_t)S * sizeof(int));
    uint64_t h = 12345;
    for (int r = 0; r < T; r++) {
        int d;
        do h = h * 6364136223846793005ull + 1442695040888963407ull, d = (int)((h >> 33) % (uint64_t)S);
        while (taken[d]);
        taken[d] = 1, x_rows[r] = d;
        memcpy(src + (size_t)d * C, x + (size_t)r * C, (size_t)C * sizeof(real));
    }
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, b1, bs1, src, x_rows, NSEG, rows0, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CPU, b2, bs2, src, x_rows, NSEG, rows0, C, err,
                                                           sizeof err), 0);
    assert_memory_equal(b1, q1, (size_t)p16 * Kp);
    assert_memory_equal(bs1, s1, (size_t)KB * p16 * sizeof(float));
    assert_memory_equal(b2, q2, (size_t)C * tiles * 128);
    assert_memory_equal(bs2, s2, (size_t)tiles * C * sizeof(float));
    // fp8_gather_1x128_grouped: the same operand copied from src's own 1x128 operand, for these rows and for rows
    // read several times (a token in several experts' segments, as top-K routing reads them); padding bytes poisoned
    const int S16 = ceil_div(S, 16) * 16;
    uint8_t *qs = balloc((size_t)S16 * Kp);
    float *ss = falloc((size_t)KB * S16);
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qs, ss, src, S, C, err, sizeof err), 0);
    int *dup_rows = talloc((size_t)T * sizeof(int));
    for (int r = 0; r < T; r++) dup_rows[r] = x_rows[(r * 7) % 40];
    const int *const gather_rows[2] = {x_rows, dup_rows};
    for (int v = 0; v < 2; v++) {
        assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, src, gather_rows[v], NSEG, rows0, C, err,
                                                    sizeof err), 0);
        memset(b1, 0xA5, (size_t)p16 * Kp);
        for (size_t i = 0; i < (size_t)KB * p16; i++) bs1[i] = -7.0f;
        fp8_gather_1x128_grouped(DEVICE_CPU, b1, bs1, qs, ss, S, gather_rows[v], NSEG, rows0, C);
        assert_memory_equal(b1, q1, (size_t)p16 * Kp);
        assert_memory_equal(bs1, s1, (size_t)KB * p16 * sizeof(float));
    }
    tfree_all();
}

// kernels.h fp8_quantize_rmsnorm_both_layouts: exactly its definition, rmsnorm_forward's out quantised in both layouts
// (the rstd of rmsnorm_forward without out, which must be the rstd it writes with out); and a NaN in x is reported as
// the norm's output's, at its row and column. 345 x 300: partial row and column blocks.
static void test_quantize_rmsnorm(void **state) {
    (void)state;
    enum { T = 345, C = 300, KB = 3, T16 = 352, TILES = 3 };
    real *x = ralloc((size_t)T * C), *w = ralloc(C), *xn = ralloc((size_t)T * C), *rstd = ralloc(T), *rstd2 = ralloc(T);
    fill_wide(x, (size_t)T * C, 26, -12, 3);
    fill_wide(w, C, 27, -3, 1);
    rmsnorm_forward(DEVICE_CPU, xn, rstd, x, w, T, C);
    rmsnorm_forward(DEVICE_CPU, NULL, rstd2, x, w, T, C);
    assert_memory_equal(rstd2, rstd, (size_t)T * sizeof(real));
    uint8_t *q1 = balloc((size_t)T16 * KB * 128), *q2 = balloc((size_t)C * TILES * 128);
    uint8_t *b1 = balloc((size_t)T16 * KB * 128), *b2 = balloc((size_t)C * TILES * 128);
    float *s1 = falloc((size_t)KB * T16), *s2 = falloc((size_t)TILES * C);
    float *bs1 = falloc((size_t)KB * T16), *bs2 = falloc((size_t)TILES * C);
    char err[256] = "";
    assert_int_equal(fp8_quantize_both_layouts(DEVICE_CPU, q1, s1, q2, s2, xn, T, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_rmsnorm_both_layouts(DEVICE_CPU, b1, bs1, b2, bs2, x, rstd, w, T, C, err, sizeof err),
                     0);
    assert_memory_equal(b1, q1, (size_t)T16 * KB * 128);
    assert_memory_equal(bs1, s1, (size_t)KB * T16 * sizeof(float));
    assert_memory_equal(b2, q2, (size_t)C * TILES * 128);
    assert_memory_equal(bs2, s2, (size_t)TILES * C * sizeof(float));
    x[200 * C + 7] = NAN;
    assert_int_equal(fp8_quantize_rmsnorm_both_layouts(DEVICE_CPU, b1, bs1, b2, bs2, x, rstd, w, T, C, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "fp8_quantize_rmsnorm_both_layouts"));
    assert_non_null(strstr(err, "row 200, column 7"));
    tfree_all();
}

// NaN or Inf input: return -1, an error that names the first bad element (row-major order) by row and
// column of the input, and no output written.
typedef int (*QuantizeFn)(uint8_t *q, float *s, const real *x, int rows, int cols, char *err, size_t err_size);
static int quantize_1x128_fn(uint8_t *q, float *s, const real *x, int rows, int cols, char *err, size_t n) {
    return fp8_quantize_1x128(DEVICE_CPU, q, s, x, rows, cols, err, n);
}
static int quantize_128x128_fn(uint8_t *q, float *s, const real *x, int rows, int cols, char *err, size_t n) {
    return fp8_quantize_128x128(DEVICE_CPU, q, q + 512 * 512, s, x, rows, cols, err, n);
}
static int quantize_128x1_fn(uint8_t *q, float *s, const real *x, int rows, int cols, char *err, size_t n) {
    return fp8_quantize_128x1_transposed(DEVICE_CPU, q, s, x, rows, cols, err, n);
}

static void test_quantize_rejects_non_finite(void **state) {
    (void)state;
    const QuantizeFn fns[] = {quantize_1x128_fn, quantize_128x128_fn, quantize_128x1_fn};
    const char *names[] = {"fp8_quantize_1x128", "fp8_quantize_128x128", "fp8_quantize_128x1_transposed"};
    const int rows = 150, cols = 260;
    real *x = ralloc((size_t)rows * cols);
    uint8_t *q = balloc(2 * 512 * 512);
    float *s = falloc(4096);
    for (int f = 0; f < 3; f++) {
        const struct { int r, c; real v; int r2, c2; real v2; } bad[] = {
            {5, 17, (real)NAN, 9, 3, (real)INFINITY},    // the first in row-major order is reported
            {149, 259, (real)-INFINITY, -1, -1, 0},
            {0, 0, (real)INFINITY, 0, 200, (real)NAN},
        };
        for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
            opcheck_fill_nonzero(x, (size_t)rows * cols, 31, 0.1, 1.0);
            x[(size_t)bad[b].r * cols + bad[b].c] = bad[b].v;
            if (bad[b].r2 >= 0) x[(size_t)bad[b].r2 * cols + bad[b].c2] = bad[b].v2;
            memset(q, 0xAA, 2 * 512 * 512);
            memset(s, 0xAA, 4096 * sizeof(float));
            char err[256] = "", want[64];
            assert_int_equal(fns[f](q, s, x, rows, cols, err, sizeof err), -1);
            snprintf(want, sizeof want, "row %d, column %d", bad[b].r, bad[b].c);
            if (!strstr(err, want) || !strstr(err, names[f])) {
                fail_msg("error \"%s\" should name %s and %s", err, names[f], want);
            }
            for (size_t i = 0; i < 2 * 512 * 512; i++) assert_int_equal(q[i], 0xAA);
            for (size_t i = 0; i < 4096; i++) assert_int_equal(float_bits(s[i]), 0xAAAAAAAAu);
        }
    }
    tfree_all();
}

// ---------------------------------------------------------------------------- SwiGLU values quantised as computed
// kernels.h fp8_quantize_swiglu_*: the SwiGLU value (h = silu(a) * b, or da / db of swiglu_backward) goes through
// the grouped quantiser of the same name as an array holding it would, bit for bit, without the array. The
// reference is that composition written with the public ops (swiglu_forward / swiglu_backward into an array, then
// the grouped quantiser, which test_quantize_grouped ties to the plain quantisers), so these tests check the
// contract itself rather than a re-derivation of the SwiGLU arithmetic.
typedef enum { SWQ_1X128, SWQ_128X1, SWQ_BOTH } SwigluQuant;
static const char *const swiglu_quant_ops[] = {"fp8_quantize_swiglu_1x128_grouped",
                                               "fp8_quantize_swiglu_128x1_transposed_grouped",
                                               "fp8_quantize_swiglu_both_layouts_grouped"};
static const char *const swiglu_value_names[] = {"SWIGLU_OUT", "SWIGLU_DA", "SWIGLU_DB"};

// Sizes of the grouped operands kernels.h defines for segments rows0 of width C: the 1x128 operand q1 (P16 x Kp
// bytes) with s1 (KB x P16 scales), the 128x1 operand q2 (C x 128 TB bytes) with s2 (TB x C scales), P16 and TB
// summed over the segments (an empty segment adds nothing).
typedef struct {
    size_t q1, s1, q2, s2;
} GroupedSizes;

static GroupedSizes grouped_sizes(int n_seg, const int *rows0, int C) {
    size_t p16 = 0, tiles = 0;
    for (int g = 0; g < n_seg; g++) {
        const int n = rows0[g + 1] - rows0[g];
        p16 += (size_t)ceil_div(n, 16) * 16, tiles += (size_t)ceil_div(n, 128);
    }
    const size_t KB = (size_t)ceil_div(C, 128);
    return (GroupedSizes){p16 * KB * 128, KB * p16, (size_t)C * 128 * tiles, tiles * (size_t)C};
}

// a, b or dout as the SwiGLU quantisers take them (kernels.h: the BF16 products of w1's and w3's Fprops and of w2's
// Dgrad, row stride round_up(C, 128)) from x, whose values the tests make BF16 values first (round_to_bf16) where a composition reads x
// itself. The padding columns hold a NaN, which the quantisers would report if they read it. NULL stays NULL.
static const uint16_t *gate_bf16(const real *x, int rows, int C) {
    if (x == NULL) return NULL;
    const size_t ld = (size_t)ceil_div(C, 128) * 128;
    uint16_t *g = talloc((size_t)rows * ld * sizeof(uint16_t) + sizeof(uint16_t));
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t c = 0; c < ld; c++) g[r * ld + c] = c < (size_t)C ? float_to_bf16((float)x[r * C + c]) : 0x7FC0;
    return g;
}

static void round_to_bf16(real *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = (real)bf16_to_float(float_to_bf16((float)x[i]));
}

// The fused op `which` on a and b (rows0[n_seg] x C) given to it in BF16 (gate_bf16): the 1x128 form writes q1, s1,
// the 128x1 form q2, s2, the both-layouts form all four.
static int swiglu_quant(SwigluQuant which, uint8_t *q1, float *s1, uint8_t *q2, float *s2, SwigluValue value,
                        const real *dout32, const real *a32, const real *b32, int n_seg, const int *rows0, int C,
                        char *err, size_t err_size) {
    const uint16_t *a = gate_bf16(a32, rows0[n_seg], C), *b = gate_bf16(b32, rows0[n_seg], C);
    const uint16_t *dout = gate_bf16(dout32, rows0[n_seg], C);
    switch (which) {
    case SWQ_1X128:
        return fp8_quantize_swiglu_1x128_grouped(DEVICE_CPU, q1, s1, value, dout, a, b, n_seg, rows0, C, err, err_size);
    case SWQ_128X1:
        return fp8_quantize_swiglu_128x1_transposed_grouped(DEVICE_CPU, q2, s2, value, dout, a, b, n_seg, rows0, C, err,
                                                            err_size);
    default:
        return fp8_quantize_swiglu_both_layouts_grouped(DEVICE_CPU, q1, s1, q2, s2, value, dout, a, b, n_seg, rows0, C,
                                                        err, err_size);
    }
}

// The definition: the value written into v (rows0[n_seg] x C) by the public SwiGLU op, then the grouped quantiser
// of the same name on v.
static int swiglu_quant_composed(SwigluQuant which, uint8_t *q1, float *s1, uint8_t *q2, float *s2, real *v,
                                 SwigluValue value, const real *dout, const real *a, const real *b, int n_seg,
                                 const int *rows0, int C, char *err, size_t err_size) {
    const int64_t n = (int64_t)rows0[n_seg] * C;
    if (value == SWIGLU_OUT) swiglu_forward(DEVICE_CPU, v, a, b, n);
    else if (value == SWIGLU_DA) swiglu_backward(DEVICE_CPU, v, NULL, dout, a, b, n);
    else swiglu_backward(DEVICE_CPU, NULL, v, dout, a, b, n);
    switch (which) {
    case SWQ_1X128: return fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, v, NULL, n_seg, rows0, C, err, err_size);
    case SWQ_128X1:
        return fp8_quantize_128x1_transposed_grouped(DEVICE_CPU, q2, s2, v, NULL, n_seg, rows0, C, err, err_size);
    default: return fp8_quantize_both_layouts_grouped(DEVICE_CPU, q1, s1, q2, s2, v, n_seg, rows0, C, err, err_size);
    }
}

// got and want (bytes) byte for byte; a failure names the case and the first differing byte.
static void expect_same_bytes(const char *what, const char *where, const void *got, const void *want, size_t bytes) {
    const uint8_t *g = got, *w = want;
    for (size_t i = 0; i < bytes; i++) {
        if (g[i] != w[i]) fail_msg("%s, %s: byte %zu of %zu is 0x%02X, the composition's 0x%02X", where, what, i, bytes,
                                   g[i], w[i]);
    }
}

// The segment layouts of the SwiGLU quantiser tests: one segment (a partial 128-tile, rows off 16); a mix (an empty
// segment, partial 128-tiles, 333 rows; SWIGLU_MIX, which the non-finite tests use); every segment empty.
static const int swiglu_one[] = {0, 150}, swiglu_mix[] = {0, 37, 37, 200, 333}, swiglu_none[] = {0, 0, 0};
static const struct {
    const int *rows0;
    int n_seg;
} swiglu_layouts[] = {{swiglu_one, 1}, {swiglu_mix, 4}, {swiglu_none, 2}};
enum { SWIGLU_MIX = 1, SWIGLU_N_LAYOUTS = 3 };
static const int swiglu_widths[] = {384, 200};  // whole 128-tiles, and a partial last tile

// The gate's inputs a, b and its output gradient dout over many binades, from seeds seed, seed + 1, seed + 2.
static void fill_swiglu_inputs(real *a, real *b, real *dout, size_t n, uint64_t seed) {
    fill_wide(a, n, seed, -8, 4);
    fill_wide(b, n, seed + 1, -12, 2);
    fill_wide(dout, n, seed + 2, -20, 0);
}

// The three fused ops on each value against the composition, every byte of q and every scale of the operands
// kernels.h defines (padding rows, partial tiles and the scales of the padding included). The two sides' outputs are
// poisoned with different bytes first, so a byte either side leaves unwritten differs. Every layout of
// swiglu_layouts (the empty one: nothing to write, nothing read) at each of swiglu_widths. Inputs are random and never zero: |a| over 2^-8 .. 2^4 (sigmoid from ~0 to ~1, so silu' crosses its zero), b and dout
// over many binades, so tiles reach E4M3 subnormals and values that round to zero. The fused call gets NULL for
// the input its value does not read (dout for SWIGLU_OUT, b for SWIGLU_DB): reading it would crash the test.
static void test_quantize_swiglu_grouped(void **state) {
    (void)state;
    for (size_t l = 0; l < SWIGLU_N_LAYOUTS; l++) {
        for (size_t w = 0; w < sizeof swiglu_widths / sizeof swiglu_widths[0]; w++) {
            const int n_seg = swiglu_layouts[l].n_seg, *rows0 = swiglu_layouts[l].rows0, C = swiglu_widths[w];
            const int T = rows0[n_seg];
            const size_t n = (size_t)T * C;
            const uint64_t seed = 80 + 8 * l + 2 * w;
            real *dout = ralloc(n), *a = ralloc(n), *b = ralloc(n), *v = ralloc(n);
            fill_swiglu_inputs(a, b, dout, n, seed);
            round_to_bf16(a, n), round_to_bf16(b, n), round_to_bf16(dout, n);  // the fused ops read BF16 (gate_bf16)
            const GroupedSizes z = grouped_sizes(n_seg, rows0, C);
            uint8_t *q1 = balloc(z.q1), *q2 = balloc(z.q2), *r1 = balloc(z.q1), *r2 = balloc(z.q2);
            float *s1 = falloc(z.s1), *s2 = falloc(z.s2), *rs1 = falloc(z.s1), *rs2 = falloc(z.s2);
            for (int value = SWIGLU_OUT; value <= SWIGLU_DB; value++) {
                for (int which = SWQ_1X128; which <= SWQ_BOTH; which++) {
                    char where[160], err[256] = "";
                    snprintf(where, sizeof where, "%s(%s), %d segments of %d rows, C = %d", swiglu_quant_ops[which],
                             swiglu_value_names[value], n_seg, T, C);
                    memset(q1, 0xA5, z.q1), memset(q2, 0xA5, z.q2);
                    memset(s1, 0xA5, z.s1 * sizeof(float)), memset(s2, 0xA5, z.s2 * sizeof(float));
                    memset(r1, 0x5A, z.q1), memset(r2, 0x5A, z.q2);
                    memset(rs1, 0x5A, z.s1 * sizeof(float)), memset(rs2, 0x5A, z.s2 * sizeof(float));
                    const int rc_ref = swiglu_quant_composed((SwigluQuant)which, r1, rs1, r2, rs2, v,
                                                             (SwigluValue)value, dout, a, b, n_seg, rows0, C, err,
                                                             sizeof err);
                    if (rc_ref != 0) fail_msg("%s: the composition returned %d: %s", where, rc_ref, err);
                    const int rc = swiglu_quant((SwigluQuant)which, q1, s1, q2, s2, (SwigluValue)value,
                                                value == SWIGLU_OUT ? NULL : dout, a, value == SWIGLU_DB ? NULL : b,
                                                n_seg, rows0, C, err, sizeof err);
                    if (rc != 0) fail_msg("%s: returned %d: %s", where, rc, err);
                    if (which != SWQ_128X1) {
                        expect_same_bytes("1x128 q", where, q1, r1, z.q1);
                        expect_same_bytes("1x128 scales", where, s1, rs1, z.s1 * sizeof(float));
                    }
                    if (which != SWQ_1X128) {
                        expect_same_bytes("128x1 q", where, q2, r2, z.q2);
                        expect_same_bytes("128x1 scales", where, s2, rs2, z.s2 * sizeof(float));
                    }
                    // the data are not degenerate: E4M3 subnormal codes occur (so do zeros, in the padding at least)
                    if (T > 0 && which == SWQ_BOTH) {
                        assert_true(count_subnormal_codes(q1, z.q1) > 0 && count_subnormal_codes(q2, z.q2) > 0);
                    }
                }
            }
            tfree_all();
        }
    }
}

// A non-finite value: -1, an error naming the op and the first bad element (row-major, row of the segments' rows
// and column), and nothing written. Two ways to get one: a NaN in a (two of them, the first in row-major order
// reported), and finite inputs whose value overflows FP32 (a = b = dout = 1e20: h, da and db are all ~1e40), which
// shows the check is on the value, not only on the inputs.
static void test_quantize_swiglu_rejects_non_finite(void **state) {
    (void)state;
    const int *rows0 = swiglu_layouts[SWIGLU_MIX].rows0, n_seg = swiglu_layouts[SWIGLU_MIX].n_seg, C = 200;
    const int T = rows0[n_seg];
    const size_t n = (size_t)T * C;
    real *dout = ralloc(n), *a = ralloc(n), *b = ralloc(n);
    const GroupedSizes z = grouped_sizes(n_seg, rows0, C);
    uint8_t *q1 = balloc(z.q1), *q2 = balloc(z.q2);
    float *s1 = falloc(z.s1), *s2 = falloc(z.s2);
    for (int value = SWIGLU_OUT; value <= SWIGLU_DB; value++) {
        for (int which = SWQ_1X128; which <= SWQ_BOTH; which++) {
            for (int overflow = 0; overflow < 2; overflow++) {
                fill_swiglu_inputs(a, b, dout, n, 90);
                int r = 250, c = 77;  // in the fourth segment (rows 200..332)
                if (overflow) {
                    r = 120, c = 199;  // the third segment's row 83, the last column (the partial tile)
                    a[(size_t)r * C + c] = b[(size_t)r * C + c] = dout[(size_t)r * C + c] = (real)1e20;
                } else {
                    a[(size_t)300 * C + 5] = (real)NAN;  // later in row-major order: not the one reported
                    a[(size_t)r * C + c] = (real)NAN;
                }
                memset(q1, 0xA5, z.q1), memset(q2, 0xA5, z.q2);
                memset(s1, 0xA5, z.s1 * sizeof(float)), memset(s2, 0xA5, z.s2 * sizeof(float));
                char err[256] = "", want[64];
                const int rc = swiglu_quant((SwigluQuant)which, q1, s1, q2, s2, (SwigluValue)value,
                                            value == SWIGLU_OUT ? NULL : dout, a, value == SWIGLU_DB ? NULL : b, n_seg,
                                            rows0, C, err, sizeof err);
                snprintf(want, sizeof want, "row %d, column %d", r, c);
                if (rc != -1 || !strstr(err, want) || !strstr(err, swiglu_quant_ops[which])) {
                    fail_msg("%s(%s), %s: returned %d with \"%s\"; expected -1 and an error naming %s and %s",
                             swiglu_quant_ops[which], swiglu_value_names[value],
                             overflow ? "value overflows" : "NaN in a", rc, err, swiglu_quant_ops[which], want);
                }
                for (size_t i = 0; i < z.q1; i++) assert_int_equal(q1[i], 0xA5);
                for (size_t i = 0; i < z.q2; i++) assert_int_equal(q2[i], 0xA5);
                for (size_t i = 0; i < z.s1; i++) assert_int_equal(float_bits(s1[i]), 0xA5A5A5A5u);
                for (size_t i = 0; i < z.s2; i++) assert_int_equal(float_bits(s2[i]), 0xA5A5A5A5u);
            }
        }
    }
    tfree_all();
}

// ---------------------------------------------------------------------------- both SwiGLU gradients in one pass
// kernels.h fp8_quantize_swiglu_grads_both_layouts_grouped: da and db in both layouts, each exactly what
// fp8_quantize_swiglu_both_layouts_grouped(SWIGLU_DA / SWIGLU_DB) writes (which test_quantize_swiglu_grouped ties
// to the composition), and a non-finite value reported as the two calls, DA's first, would report it. The reference
// is the two calls (DB given NULL for b, as the backward pass would call it).
typedef struct {
    uint8_t *qa1, *qa2, *qb1, *qb2;
    float *sa1, *sa2, *sb1, *sb2;
} GradOperands;

// Both gradients' operands for layout z, every byte set to `poison`.
static GradOperands grad_operands(GroupedSizes z, uint8_t poison) {
    GradOperands o = {balloc(z.q1), balloc(z.q2), balloc(z.q1), balloc(z.q2),
                      falloc(z.s1), falloc(z.s2), falloc(z.s1), falloc(z.s2)};
    memset(o.qa1, poison, z.q1), memset(o.qa2, poison, z.q2), memset(o.qb1, poison, z.q1), memset(o.qb2, poison, z.q2);
    memset(o.sa1, poison, z.s1 * sizeof(float)), memset(o.sa2, poison, z.s2 * sizeof(float));
    memset(o.sb1, poison, z.s1 * sizeof(float)), memset(o.sb2, poison, z.s2 * sizeof(float));
    return o;
}

static int swiglu_grads_quant(const GradOperands *o, const real *dout, const real *a, const real *b, int n_seg,
                              const int *rows0, int C, char *err, size_t err_size) {
    return fp8_quantize_swiglu_grads_both_layouts_grouped(DEVICE_CPU, o->qa1, o->sa1, o->qa2, o->sa2, o->qb1, o->sb1,
                                                          o->qb2, o->sb2, gate_bf16(dout, rows0[n_seg], C),
                                                          gate_bf16(a, rows0[n_seg], C),
                                                          gate_bf16(b, rows0[n_seg], C), n_seg, rows0, C, err,
                                                          err_size);
}

// The two separate calls (DA, then DB), each with its own error text; returns DA's rc, DB's in *rc_db.
static int swiglu_grads_separate(const GradOperands *o, const real *dout, const real *a, const real *b, int n_seg,
                                 const int *rows0, int C, char *err_da, char *err_db, size_t err_size, int *rc_db) {
    const uint16_t *a16 = gate_bf16(a, rows0[n_seg], C), *b16 = gate_bf16(b, rows0[n_seg], C);
    const uint16_t *d16 = gate_bf16(dout, rows0[n_seg], C);
    const int rc_da = fp8_quantize_swiglu_both_layouts_grouped(DEVICE_CPU, o->qa1, o->sa1, o->qa2, o->sa2, SWIGLU_DA,
                                                               d16, a16, b16, n_seg, rows0, C, err_da, err_size);
    *rc_db = fp8_quantize_swiglu_both_layouts_grouped(DEVICE_CPU, o->qb1, o->sb1, o->qb2, o->sb2, SWIGLU_DB, d16, a16,
                                                      NULL, n_seg, rows0, C, err_db, err_size);
    return rc_da;
}

// Every byte of got's da operands (da = 1) or db operands (da = 0) equal to want's.
static void expect_same_grad(const char *where, int da, const GradOperands *got, const GradOperands *want,
                             GroupedSizes z) {
    if (da) {
        expect_same_bytes("da 1x128 q", where, got->qa1, want->qa1, z.q1);
        expect_same_bytes("da 1x128 scales", where, got->sa1, want->sa1, z.s1 * sizeof(float));
        expect_same_bytes("da 128x1 q", where, got->qa2, want->qa2, z.q2);
        expect_same_bytes("da 128x1 scales", where, got->sa2, want->sa2, z.s2 * sizeof(float));
    } else {
        expect_same_bytes("db 1x128 q", where, got->qb1, want->qb1, z.q1);
        expect_same_bytes("db 1x128 scales", where, got->sb1, want->sb1, z.s1 * sizeof(float));
        expect_same_bytes("db 128x1 q", where, got->qb2, want->qb2, z.q2);
        expect_same_bytes("db 128x1 scales", where, got->sb2, want->sb2, z.s2 * sizeof(float));
    }
}

// The joint op against the two calls on the segment layouts and widths of test_quantize_swiglu_grouped (one
// segment; an empty segment among partial 128-tiles; every segment empty), every byte of the eight outputs, the
// two sides' outputs poisoned with different bytes.
static void test_quantize_swiglu_grads_grouped(void **state) {
    (void)state;
    for (size_t l = 0; l < SWIGLU_N_LAYOUTS; l++) {
        for (size_t w = 0; w < sizeof swiglu_widths / sizeof swiglu_widths[0]; w++) {
            const int n_seg = swiglu_layouts[l].n_seg, *rows0 = swiglu_layouts[l].rows0, C = swiglu_widths[w];
            const int T = rows0[n_seg];
            const size_t n = (size_t)T * C;
            const uint64_t seed = 180 + 8 * l + 2 * w;
            real *dout = ralloc(n), *a = ralloc(n), *b = ralloc(n);
            fill_swiglu_inputs(a, b, dout, n, seed);
            const GroupedSizes z = grouped_sizes(n_seg, rows0, C);
            const GradOperands got = grad_operands(z, 0xA5), want = grad_operands(z, 0x5A);
            char where[128], err[256] = "", err_db[256] = "";
            snprintf(where, sizeof where, "fp8_quantize_swiglu_grads_both_layouts_grouped, %d segments of %d rows, C = %d",
                     n_seg, T, C);
            int rc_db;
            const int rc_da = swiglu_grads_separate(&want, dout, a, b, n_seg, rows0, C, err, err_db, sizeof err, &rc_db);
            if (rc_da != 0 || rc_db != 0) fail_msg("%s: the separate calls returned %d, %d: %s %s", where, rc_da, rc_db,
                                                   err, err_db);
            const int rc = swiglu_grads_quant(&got, dout, a, b, n_seg, rows0, C, err, sizeof err);
            if (rc != 0) fail_msg("%s: returned %d: %s", where, rc, err);
            expect_same_grad(where, 1, &got, &want, z);
            expect_same_grad(where, 0, &got, &want, z);
            if (T > 0) {  // not degenerate: E4M3 subnormal codes in both gradients
                assert_true(count_subnormal_codes(got.qa1, z.q1) > 0 && count_subnormal_codes(got.qb2, z.q2) > 0);
            }
            tfree_all();
        }
    }
}

// A non-finite gradient: -1 and exactly the error the two calls give - the DA call's when da has a bad element
// (even after a bad db earlier in row-major order), else the DB call's - and, as those calls leave them, the
// outputs: nothing written when da is bad (the DB call is not made), da's operands written and db's not when only
// db is. Cases: a NaN in a (da and db both NaN: two of them, the first reported); a NaN in b (da only); db
// overflowing at (10, 3) with a NaN in b at (250, 77) (DA's error, the later element); only db overflowing: a = dout
// = 1e20 and b = 0 give da = 0 (finite) and db = 1e40.
static void test_quantize_swiglu_grads_rejects_non_finite(void **state) {
    (void)state;
    const int *rows0 = swiglu_layouts[SWIGLU_MIX].rows0, n_seg = swiglu_layouts[SWIGLU_MIX].n_seg, C = 200;
    const int T = rows0[n_seg];
    const size_t n = (size_t)T * C;
    const GroupedSizes z = grouped_sizes(n_seg, rows0, C);
    enum { NAN_A, NAN_B, DB_EARLIER, DB_ONLY };
    static const char *const names[] = {"NaN in a", "NaN in b", "db overflows before a bad da", "only db overflows"};
    for (int kind = NAN_A; kind <= DB_ONLY; kind++) {
        real *dout = ralloc(n), *a = ralloc(n), *b = ralloc(n);
        fill_swiglu_inputs(a, b, dout, n, 190);
        const size_t at = (size_t)250 * C + 77;
        int r = 250, c = 77, da_bad = 1;
        if (kind == NAN_A) a[(size_t)300 * C + 5] = (real)NAN, a[at] = (real)NAN;
        if (kind == NAN_B || kind == DB_EARLIER) b[at] = (real)NAN;
        if (kind == DB_EARLIER) a[(size_t)10 * C + 3] = dout[(size_t)10 * C + 3] = (real)1e20, b[(size_t)10 * C + 3] = 0;
        if (kind == DB_ONLY) {
            r = 120, c = 199, da_bad = 0;  // the third segment's row 83, the last column (the partial tile)
            a[(size_t)r * C + c] = dout[(size_t)r * C + c] = (real)1e20, b[(size_t)r * C + c] = 0;
        }
        const GradOperands got = grad_operands(z, 0xA5), want = grad_operands(z, 0xA5), poison = grad_operands(z, 0xA5);
        char err[256] = "", err_da[256] = "", err_db[256] = "", want_at[64];
        int rc_db;
        const int rc_da = swiglu_grads_separate(&want, dout, a, b, n_seg, rows0, C, err_da, err_db, sizeof err, &rc_db);
        assert_int_equal(rc_da, da_bad ? -1 : 0);
        assert_int_equal(rc_db, kind == NAN_B ? 0 : -1);  // a NaN in b is not read for db
        const int rc = swiglu_grads_quant(&got, dout, a, b, n_seg, rows0, C, err, sizeof err);
        const char *want_err = da_bad ? err_da : err_db;
        snprintf(want_at, sizeof want_at, "row %d, column %d", r, c);
        if (rc != -1 || strcmp(err, want_err) != 0 || !strstr(err, want_at)) {
            fail_msg("%s: returned %d with \"%s\"; expected -1 and the %s call's error \"%s\" (naming %s)", names[kind],
                     rc, err, da_bad ? "DA" : "DB", want_err, want_at);
        }
        expect_same_grad(names[kind], 1, &got, da_bad ? &poison : &want, z);  // da's as the DA call left them
        expect_same_grad(names[kind], 0, &got, &poison, z);
        tfree_all();
    }
}

// ---------------------------------------------------------------------------- the combine's gradient quantised through the plan
// kernels.h fp8_quantize_combine_grad_both_layouts_grouped: row s of the segments is topk_w[t,k] * dout[t] for the token
// t = seg_token[s] and its k with slot_of[t*K + k] = s, quantised in both layouts without the array. The reference is
// the composition the contract names, written with the public ops: moe_combine_backward into dexpert_out (N*K, C),
// then fp8_quantize_both_layouts_grouped on it with the plan's seg_offsets as the segments.
static const char combine_grad_op[] = "fp8_quantize_combine_grad_both_layouts_grouped";

// The routing plan of opcheck_routing(N, K, E, empty, seed) with positive topk_w (N, K) and dout (N, C) random and never
// zero, dout over many binades (so tiles reach E4M3 subnormals and values that round to zero).
typedef struct {
    int N, K, E, C, empty;
    int *seg_offsets, *seg_token, *slot_of;
    real *topk_w, *dout;
} CombineGradInputs;

static CombineGradInputs combine_grad_inputs(int N, int K, int E, int C, uint64_t seed) {
    CombineGradInputs in = {.N = N, .K = K, .E = E, .C = C, .empty = E / 2};
    int *topk_idx = talloc((size_t)N * K * sizeof(int));
    in.seg_offsets = talloc((size_t)(E + 1) * sizeof(int));
    in.seg_token = talloc((size_t)N * K * sizeof(int));
    in.slot_of = talloc((size_t)N * K * sizeof(int));
    opcheck_routing(topk_idx, N, K, E, in.empty, seed);
    moe_permute_plan(in.seg_offsets, in.seg_token, in.slot_of, topk_idx, N, K, E);
    assert_int_equal(in.seg_offsets[E], N * K);
    assert_int_equal(in.seg_offsets[in.empty + 1], in.seg_offsets[in.empty]);
    in.topk_w = ralloc((size_t)N * K);
    in.dout = ralloc((size_t)N * C);
    opcheck_fill(in.topk_w, (size_t)N * K, seed + 1, 1.0 / 64, 1.0);
    fill_wide(in.dout, (size_t)N * C, seed + 2, -20, 1);
    return in;
}

static int combine_grad_quant(const CombineGradInputs *in, uint8_t *q1, float *s1, uint8_t *q2, float *s2, char *err,
                              size_t err_size) {
    return fp8_quantize_combine_grad_both_layouts_grouped(DEVICE_CPU, q1, s1, q2, s2, in->dout, in->seg_token,
                                                          in->slot_of, in->topk_w, in->K, in->E, in->seg_offsets, in->C,
                                                          err, err_size);
}

// Shapes: an empty segment (always: expert E/2), segments of a few rows up to more than a 128-tile, widths of whole
// tiles (384) and with a partial last tile (200). Every byte of q and every scale of both operands (padding rows,
// partial tiles, the padding's scales) against the composition; the two sides' outputs are poisoned with different
// bytes first, and dexpert_out with NaN (a row the combine backward left unwritten would make the reference fail).
static void test_quantize_combine_grad(void **state) {
    (void)state;
    const struct {
        int N, K, E, C;
    } shapes[] = {{150, 3, 8, 384}, {150, 3, 8, 200}, {300, 2, 4, 200}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int N = shapes[i].N, K = shapes[i].K, E = shapes[i].E, C = shapes[i].C;
        const CombineGradInputs in = combine_grad_inputs(N, K, E, C, 120 + 4 * i);
        int longest = 0;
        for (int e = 0; e < E; e++)
            if (in.seg_offsets[e + 1] - in.seg_offsets[e] > longest) longest = in.seg_offsets[e + 1] - in.seg_offsets[e];
        assert_true(longest > 128);  // a segment with a partial second 128-tile
        real *dexpert_out = ralloc((size_t)N * K * C);
        for (size_t j = 0; j < (size_t)N * K * C; j++) dexpert_out[j] = (real)NAN;
        const GroupedSizes z = grouped_sizes(E, in.seg_offsets, C);
        uint8_t *q1 = balloc(z.q1), *q2 = balloc(z.q2), *r1 = balloc(z.q1), *r2 = balloc(z.q2);
        float *s1 = falloc(z.s1), *s2 = falloc(z.s2), *rs1 = falloc(z.s1), *rs2 = falloc(z.s2);
        memset(q1, 0xA5, z.q1), memset(q2, 0xA5, z.q2);
        memset(s1, 0xA5, z.s1 * sizeof(float)), memset(s2, 0xA5, z.s2 * sizeof(float));
        memset(r1, 0x5A, z.q1), memset(r2, 0x5A, z.q2);
        memset(rs1, 0x5A, z.s1 * sizeof(float)), memset(rs2, 0x5A, z.s2 * sizeof(float));
        char where[160], err[256] = "";
        snprintf(where, sizeof where, "%s, N = %d, K = %d, E = %d (longest segment %d rows), C = %d", combine_grad_op, N,
                 K, E, longest, C);
        moe_combine_backward(DEVICE_CPU, dexpert_out, NULL, in.dout, NULL, in.slot_of, in.topk_w, N, K, C);
        const int rc_ref = fp8_quantize_both_layouts_grouped(DEVICE_CPU, r1, rs1, r2, rs2, dexpert_out, E, in.seg_offsets,
                                                             C, err, sizeof err);
        if (rc_ref != 0) fail_msg("%s: the composition returned %d: %s", where, rc_ref, err);
        const int rc = combine_grad_quant(&in, q1, s1, q2, s2, err, sizeof err);
        if (rc != 0) fail_msg("%s: returned %d: %s", where, rc, err);
        expect_same_bytes("1x128 q", where, q1, r1, z.q1);
        expect_same_bytes("1x128 scales", where, s1, rs1, z.s1 * sizeof(float));
        expect_same_bytes("128x1 q", where, q2, r2, z.q2);
        expect_same_bytes("128x1 scales", where, s2, rs2, z.s2 * sizeof(float));
        assert_true(count_subnormal_codes(q1, z.q1) > 0 && count_subnormal_codes(q2, z.q2) > 0);
        tfree_all();
    }
}

// The first non-finite element of the slot-order array (row s = topk_w * dout[seg_token[s]]) in row-major order, found
// from seg_token alone (with topk_w positive and the product finite where dout is, it is where dout is non-finite).
static void first_non_finite_slot(const CombineGradInputs *in, int *row, int *col) {
    for (int s = 0; s < in->N * in->K; s++) {
        const real *dt = in->dout + (size_t)in->seg_token[s] * in->C;
        for (int c = 0; c < in->C; c++) {
            if (!isfinite((double)dt[c])) {
                *row = s, *col = c;
                return;
            }
        }
    }
    fail_msg("first_non_finite_slot: dout is finite");
}

// The first slot row (in segment order) holding token t.
static int first_slot_of_token(const CombineGradInputs *in, int t) {
    for (int s = 0; s < in->N * in->K; s++)
        if (in->seg_token[s] == t) return s;
    fail_msg("token %d has no slot", t);
    return -1;
}

// A non-finite dout element: -1, an error naming the op and the first bad element of the slot-order array (the first
// slot row in segment order holding a bad token, the column of its first bad element), nothing written. Cases: NaNs in
// two tokens where token order and segment order disagree (t_a < t_b, but t_b's first slot comes first: t_b is the
// last token of expert 0's segment, t_a a lower token not routed to expert 0), so the error must follow segment
// order; +Inf and NaN in one token (the lower column named); -Inf at the last element of dout (C = 200: in the
// partial last tile).
static void test_quantize_combine_grad_rejects_non_finite(void **state) {
    (void)state;
    const CombineGradInputs in = combine_grad_inputs(150, 3, 8, 200, 140);
    const int N = in.N, C = in.C;
    const int t_b = in.seg_token[in.seg_offsets[1] - 1];
    int t_a = 0;
    while (t_a < N && first_slot_of_token(&in, t_a) < in.seg_offsets[1]) t_a++;
    assert_true(in.seg_offsets[1] > 0 && t_a < t_b && first_slot_of_token(&in, t_b) < first_slot_of_token(&in, t_a));
    const struct {
        int t, c;
        real v;
        int t2, c2;
        real v2;
    } bad[] = {
        {t_a, 5, (real)NAN, t_b, 150, (real)NAN},
        {77, 120, (real)NAN, 77, 30, (real)INFINITY},
        {N - 1, C - 1, (real)-INFINITY, -1, -1, 0},
    };
    const GroupedSizes z = grouped_sizes(in.E, in.seg_offsets, C);
    uint8_t *q1 = balloc(z.q1), *q2 = balloc(z.q2);
    float *s1 = falloc(z.s1), *s2 = falloc(z.s2);
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        fill_wide(in.dout, (size_t)N * C, 142, -20, 1);
        in.dout[(size_t)bad[b].t * C + bad[b].c] = bad[b].v;
        if (bad[b].t2 >= 0) in.dout[(size_t)bad[b].t2 * C + bad[b].c2] = bad[b].v2;
        int r = -1, c = -1;
        first_non_finite_slot(&in, &r, &c);
        if (b == 0) assert_true(r == first_slot_of_token(&in, t_b) && c == 150);
        if (b == 1) assert_true(r == first_slot_of_token(&in, 77) && c == 30);
        memset(q1, 0xA5, z.q1), memset(q2, 0xA5, z.q2);
        memset(s1, 0xA5, z.s1 * sizeof(float)), memset(s2, 0xA5, z.s2 * sizeof(float));
        char err[256] = "", want[64];
        const int rc = combine_grad_quant(&in, q1, s1, q2, s2, err, sizeof err);
        snprintf(want, sizeof want, "row %d, column %d", r, c);
        if (rc != -1 || !strstr(err, want) || !strstr(err, combine_grad_op)) {
            fail_msg("%s, case %zu (dout token %d, column %d): returned %d with \"%s\"; expected -1 and an error naming "
                     "%s and %s",
                     combine_grad_op, b, bad[b].t, bad[b].c, rc, err, combine_grad_op, want);
        }
        for (size_t i = 0; i < z.q1; i++) assert_int_equal(q1[i], 0xA5);
        for (size_t i = 0; i < z.q2; i++) assert_int_equal(q2[i], 0xA5);
        for (size_t i = 0; i < z.s1; i++) assert_int_equal(float_bits(s1[i]), 0xA5A5A5A5u);
        for (size_t i = 0; i < z.s2; i++) assert_int_equal(float_bits(s2[i]), 0xA5A5A5A5u);
    }
    tfree_all();
}

// ---------------------------------------------------------------------------- GEMMs
// The checks shared by the three GEMMs, for one output element. The element is
//   out = sum over K-blocks kb of P_kb * sa_kb * sb_kb   (P_kb the exact block sum of decoded codes)
// and the GEMM's documented FP32 arithmetic is acc = acc + ((float)P_kb * sa_kb) * sb_kb from acc = 0.
//  (1) "order": got equals that loop, written out here (then BF16-rounded for Fprop and Dgrad).
//  (2) "exact": |got - ref| <= (KB + 3) u S + out_round, ref = sum P sa sb in double, S = sum |P sa sb|:
//      each term carries three FP32 roundings ((1+u)^3 - 1 <= 3.0001 u relative) and the KB - 1 sequential
//      additions add gamma_{KB-1} sum |terms| (Higham 3.1); (KB + 3) u covers both. out_round = 2^-8 |got|
//      for a BF16 output (RNE to 8 significant bits), 0 for FP32.
//  (3) "unquantised": |got - sum_k a_k b_k| <= Q + (KB + 3) u S + out_round with the quantisation bound
//      Q = sum_k (2e + e^2)|a_k b_k| + (1 + e)(|a_k| beta_k + |b_k| alpha_k) + alpha_k beta_k,
//      e = 2^-4 + 2^-24 + 2^-28, alpha = s_a 2^-10, beta = s_b 2^-10 (docs/fp8.md derives it: each
//      dequantised value q s is within e |x| + s 2^-10 of x).
#define QUANT_EPS (0x1p-4 + 0x1p-24 + 0x1p-28)

typedef struct {
    double worst_order, worst_exact, worst_unquantised;  // ratios |diff| / bound (order: 0 or 1 mismatch)
    double max_rel_unquantised;                          // max |got - exact| / sum |a b| (reported)
} GemmChecks;

typedef struct {
    double P[64], sa[64], sb[64];                  // per K-block
    double exact, abs_sum, quant_bound;             // unquantised sum, sum |a b|, Q
    int KB;
} Element;

static void element_add_pair(Element *e, int kb, uint8_t qa, uint8_t qb, double a, double b, double sa,
                             double sb) {
    e->P[kb] += ref_e4m3_value(qa) * ref_e4m3_value(qb);  // exact: see kernels/cpu/fp8.c "promotion"
    e->sa[kb] = sa;
    e->sb[kb] = sb;
    const double alpha = sa * 0x1p-10, beta = sb * 0x1p-10;
    e->exact += a * b;
    e->abs_sum += fabs(a * b);
    e->quant_bound += (2 * QUANT_EPS + QUANT_EPS * QUANT_EPS) * fabs(a * b) +
                      (1 + QUANT_EPS) * (fabs(a) * beta + fabs(b) * alpha) + alpha * beta;
}

static void element_check(GemmChecks *c, const Element *e, double got, int bf16_out) {
    float acc = 0.0f;
    double ref = 0, S = 0;
    for (int kb = 0; kb < e->KB; kb++) {
        acc = acc + ((float)e->P[kb] * (float)e->sa[kb]) * (float)e->sb[kb];
        ref += e->P[kb] * e->sa[kb] * e->sb[kb];
        S += fabs(e->P[kb]) * e->sa[kb] * e->sb[kb];
    }
    const double order = bf16_out ? (double)bf16_to_float(float_to_bf16(acc)) : (double)acc;
    if (float_bits((float)got) != float_bits((float)order)) c->worst_order = fmax(c->worst_order, 1.0);
    const double out_round = bf16_out ? U_BF16 * fabs(got) : 0.0;
    const double fp32_bound = (e->KB + 3) * U32 * S;
    c->worst_exact = fmax(c->worst_exact, fabs(got - ref) / (fp32_bound + out_round + 1e-300));
    const double b3 = e->quant_bound + fp32_bound + out_round;
    c->worst_unquantised = fmax(c->worst_unquantised, fabs(got - e->exact) / b3);
    c->max_rel_unquantised = fmax(c->max_rel_unquantised, fabs(got - e->exact) / e->abs_sum);
}

static void report_checks(const char *what, const GemmChecks *c) {
    char line[128];
    snprintf(line, sizeof line, "%s: same-order mismatch", what);
    opcheck_report(line, c->worst_order);
    snprintf(line, sizeof line, "%s: vs exact on quantised", what);
    opcheck_report(line, c->worst_exact);
    snprintf(line, sizeof line, "%s: vs unquantised FP64", what);
    opcheck_report(line, c->worst_unquantised);
    if (getenv("OPCHECK_VERBOSE")) {
        fprintf(stderr, "  %-44s max |err| / sum|ab| = %.3g\n", what, c->max_rel_unquantised);
    }
    assert_true(c->worst_order == 0.0);
    assert_true(c->worst_exact <= 1.0);
    assert_true(c->worst_unquantised <= 1.0);
}

// T = 45 rows: the 1x128 operands have 48 (three zero padding rows); the GEMMs write only the 45.
enum { G_T = 45, G_T16 = 48, G_N = 200, G_K = 300 };
static const real UNTOUCHED = (real)-12345.0;

static void test_gemm_fprop(void **state) {
    (void)state;
    const int T = G_T, N = G_N, K = G_K, KB = ceil_div(K, 128), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(N, 128);
    const int Kp = KB * 128, Np = NB * 128;
    real *x = ralloc((size_t)T * K), *w = ralloc((size_t)N * K), *y = ralloc((size_t)G_T16 * N);
    fill_wide(x, (size_t)T * K, 41, -20, 1);
    fill_wide(w, (size_t)N * K, 42, -20, -4);
    for (size_t i = 0; i < (size_t)G_T16 * N; i++) y[i] = UNTOUCHED;
    uint8_t *qx = balloc((size_t)G_T16 * Kp), *qw = balloc((size_t)Np * Kp);
    float *sx = falloc((size_t)KB * G_T16), *sw = falloc((size_t)NB * KB4);
    char err[256];
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qx, sx, x, T, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, qw, NULL, sw, w, N, K, err, sizeof err), 0);
    fp8_gemm_fprop(DEVICE_CPU, y, qx, sx, qw, sw, T, N, K);
    assert_true(count_subnormal_codes(qx, (size_t)T * Kp) > 0 && count_subnormal_codes(qw, (size_t)Np * Kp) > 0);

    GemmChecks c = {0};
    for (int t = 0; t < T; t++) {
        for (int n = 0; n < N; n++) {
            Element e = {.KB = KB};
            for (int k = 0; k < K; k++) {
                const int kb = k / 128;
                element_add_pair(&e, kb, qx[(size_t)t * Kp + k], qw[(size_t)n * Kp + k], (double)x[(size_t)t * K + k],
                                 (double)w[(size_t)n * K + k], sx[(size_t)kb * G_T16 + t],
                                 sw[(size_t)(n / 128) * KB4 + kb]);
            }
            element_check(&c, &e, (double)y[(size_t)t * N + n], 1);
        }
    }
    report_checks("fp8_gemm_fprop", &c);
    for (size_t i = (size_t)T * N; i < (size_t)G_T16 * N; i++) assert_true(y[i] == UNTOUCHED);  // padding rows
    tfree_all();
}

static void test_gemm_dgrad(void **state) {
    (void)state;
    // dx (T, K) = dY (T, N) W (N, K); the contraction is over N = 200 (two N-blocks, the second partial)
    const int T = G_T, N = G_N, K = G_K, KB = ceil_div(K, 128), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(N, 128);
    const int Kp = KB * 128, Np = NB * 128;
    real *dy = ralloc((size_t)T * N), *w = ralloc((size_t)N * K), *dx = ralloc((size_t)G_T16 * K);
    real *g = ralloc((size_t)T * K), *dx_acc = ralloc((size_t)G_T16 * K);
    fill_wide(dy, (size_t)T * N, 43, -24, -6);
    fill_wide(w, (size_t)N * K, 44, -20, -4);
    opcheck_fill_nonzero(g, (size_t)T * K, 48, 0.01, 1.0);
    for (size_t i = (size_t)T * K; i < (size_t)G_T16 * K; i++) dx[i] = dx_acc[i] = UNTOUCHED;
    uint8_t *qdy = balloc((size_t)G_T16 * Np), *qw = balloc((size_t)Np * Kp), *qwt = balloc((size_t)Np * Kp);
    float *sdy = falloc((size_t)NB * G_T16), *sw = falloc((size_t)NB * KB4);
    char err[256];
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qdy, sdy, dy, T, N, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, qw, qwt, sw, w, N, K, err, sizeof err), 0);
    fp8_gemm_dgrad(DEVICE_CPU, dx, qdy, sdy, qwt, sw, T, N, K);  // dx was zero: dx = 0 + bf16(acc)
    assert_true(count_subnormal_codes(qdy, (size_t)T * Np) > 0);

    GemmChecks c = {0};
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            Element e = {.KB = NB};
            for (int n = 0; n < N; n++) {
                const int nb = n / 128;
                // the weight's codes read from q (not qt), so this also checks that qt is q transposed
                element_add_pair(&e, nb, qdy[(size_t)t * Np + n], qw[(size_t)n * Kp + k], (double)dy[(size_t)t * N + n],
                                 (double)w[(size_t)n * K + k], sdy[(size_t)nb * G_T16 + t], sw[(size_t)nb * KB4 + k / 128]);
            }
            element_check(&c, &e, (double)dx[(size_t)t * K + k], 1);
        }
    }
    report_checks("fp8_gemm_dgrad", &c);
    // Accumulation: on a non-zero gradient the BF16 product is added once, dx = g + bf16(acc); the
    // padding rows are never written.
    memcpy(dx_acc, g, (size_t)T * K * sizeof(real));
    fp8_gemm_dgrad(DEVICE_CPU, dx_acc, qdy, sdy, qwt, sw, T, N, K);
    for (size_t i = 0; i < (size_t)T * K; i++) assert_int_equal(float_bits(dx_acc[i]), float_bits(g[i] + dx[i]));
    for (size_t i = (size_t)T * K; i < (size_t)G_T16 * K; i++) assert_true(dx[i] == UNTOUCHED && dx_acc[i] == UNTOUCHED);
    tfree_all();
}

static void test_gemm_wgrad(void **state) {
    (void)state;
    // dw (N, K) += dY^T (N, T) X (T, K); the contraction is over T = 300 (three T-blocks, the last partial)
    const int T = 300, N = 72, K = 200, TB = ceil_div(T, 128), Tp = TB * 128;
    real *dy = ralloc((size_t)T * N), *x = ralloc((size_t)T * K), *dw = ralloc((size_t)N * K);
    real *g = ralloc((size_t)N * K), *dw_acc = ralloc((size_t)N * K);
    fill_wide(dy, (size_t)T * N, 45, -24, -6);
    fill_wide(x, (size_t)T * K, 46, -20, 1);
    opcheck_fill_nonzero(g, (size_t)N * K, 47, 0.01, 1.0);
    uint8_t *qdyt = balloc((size_t)N * Tp), *qxt = balloc((size_t)K * Tp);
    float *sdyt = falloc((size_t)TB * N), *sxt = falloc((size_t)TB * K);
    char err[256];
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, qdyt, sdyt, dy, T, N, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, qxt, sxt, x, T, K, err, sizeof err), 0);
    fp8_gemm_wgrad(DEVICE_CPU, dw, qdyt, sdyt, qxt, sxt, T, N, K);  // dw was zero: dw = 0 + acc = acc
    assert_true(count_subnormal_codes(qdyt, (size_t)N * Tp) > 0 && count_subnormal_codes(qxt, (size_t)K * Tp) > 0);

    GemmChecks c = {0};
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++) {
            Element e = {.KB = TB};
            for (int t = 0; t < T; t++) {
                const int tb = t / 128;
                element_add_pair(&e, tb, qdyt[(size_t)n * Tp + t], qxt[(size_t)k * Tp + t],
                                 (double)dy[(size_t)t * N + n], (double)x[(size_t)t * K + k], sdyt[(size_t)tb * N + n],
                                 sxt[(size_t)tb * K + k]);
            }
            element_check(&c, &e, (double)dw[(size_t)n * K + k], 0);
        }
    }
    report_checks("fp8_gemm_wgrad", &c);
    // Accumulation: on a non-zero gradient the FP32 result is added once, dw = g + acc.
    memcpy(dw_acc, g, (size_t)N * K * sizeof(real));
    fp8_gemm_wgrad(DEVICE_CPU, dw_acc, qdyt, sdyt, qxt, sxt, T, N, K);
    for (size_t i = 0; i < (size_t)N * K; i++) assert_int_equal(float_bits(dw_acc[i]), float_bits(g[i] + dw[i]));
    tfree_all();
}

// Bitwise identical results for 1, 2 and 3 threads (each output element has one owner and one order).
static void test_gemm_deterministic_across_threads(void **state) {
    (void)state;
    const int T = 96, N = 256, K = 384, KB = 3, KB4 = 4, NB = 2, Kp = 384, Np = 256;
    real *x = ralloc((size_t)T * K), *w = ralloc((size_t)N * K), *dy = ralloc((size_t)T * N);
    opcheck_fill_nonzero(x, (size_t)T * K, 51, 0.01, 1.0);
    opcheck_fill_nonzero(w, (size_t)N * K, 52, 0.01, 1.0);
    opcheck_fill_nonzero(dy, (size_t)T * N, 53, 0.01, 1.0);
    uint8_t *qx = balloc((size_t)T * Kp), *qw = balloc((size_t)Np * Kp), *qwt = balloc((size_t)Np * Kp);
    uint8_t *qdy = balloc((size_t)T * Np);
    float *sx = falloc((size_t)KB * T), *sw = falloc((size_t)NB * KB4), *sdy = falloc((size_t)NB * T);
    char err[256];
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qx, sx, x, T, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, qw, qwt, sw, w, N, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qdy, sdy, dy, T, N, err, sizeof err), 0);
    real *y[3], *dx[3];
    const int saved = omp_get_max_threads();
    for (int i = 0; i < 3; i++) {
        omp_set_num_threads(i + 1);
        y[i] = ralloc((size_t)T * N);
        dx[i] = ralloc((size_t)T * K);
        fp8_gemm_fprop(DEVICE_CPU, y[i], qx, sx, qw, sw, T, N, K);
        fp8_gemm_dgrad(DEVICE_CPU, dx[i], qdy, sdy, qwt, sw, T, N, K);
    }
    omp_set_num_threads(saved);
    for (int i = 1; i < 3; i++) {
        assert_memory_equal(y[i], y[0], (size_t)T * N * sizeof(real));
        assert_memory_equal(dx[i], dx[0], (size_t)T * K * sizeof(real));
    }
    tfree_all();
}

// got (rows, ld) BF16 bits: row r's first cols the bits of want (rows, cols), values that are BF16 already (checked:
// the bits hold the value exactly), the padding columns 0.
static void check_bf16_rows(const char *what, const uint16_t *got, const real *want, int rows, int cols, int ld) {
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < ld; c++) {
            const uint16_t bits = c < cols ? float_to_bf16((float)want[(size_t)r * cols + c]) : 0;
            if (got[(size_t)r * ld + c] != bits)
                fail_msg("%s: row %d, column %d is 0x%04X, expected 0x%04X", what, r, c, got[(size_t)r * ld + c], bits);
            if (c < cols) assert_true(bf16_to_float(bits) == (float)want[(size_t)r * cols + c]);
        }
    }
}

// Grouped Fprop and Dgrad (kernels.h): segments of 37, 0, 163, 128 and 17 rows (the empty one with NULL
// weight pointers), each with its own weight (N = 200, K = 300: partial blocks on both axes), on the
// *_grouped 1x128 operands give bit for bit what the plain GEMMs give on each segment quantised alone; Dgrad
// adds onto a random dx (GRAD_ADD) or writes over poison (GRAD_WRITE: what the plain Dgrad adds to zeros), and
// the row after the segments is never written.
static void test_gemm_grouped(void **state) {
    (void)state;
    enum { NSEG = 5, N = 200, K = 300, KB = 3, KB4 = 4, NB = 2, Kp = 384, Np = 256 };
    const int rows0[NSEG + 1] = {0, 37, 37, 200, 328, 345}, T = rows0[NSEG], P16 = 48 + 0 + 176 + 128 + 32;
    real *x = ralloc((size_t)T * K), *dy = ralloc((size_t)T * N), *w = ralloc((size_t)N * K);
    fill_wide(x, (size_t)T * K, 61, -20, 1);
    fill_wide(dy, (size_t)T * N, 62, -24, -6);
    const uint8_t *qw[NSEG] = {NULL}, *qwt[NSEG] = {NULL};
    const float *sw[NSEG] = {NULL};
    char err[256];
    for (int g = 0; g < NSEG; g++) {
        if (rows0[g + 1] == rows0[g]) continue;
        uint8_t *q = balloc((size_t)Np * Kp), *qt = balloc((size_t)Np * Kp);
        float *s = falloc((size_t)NB * KB4);
        fill_wide(w, (size_t)N * K, 63 + (uint64_t)g, -20, -4);
        assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, q, qt, s, w, N, K, err, sizeof err), 0);
        qw[g] = q, qwt[g] = qt, sw[g] = s;
    }
    uint8_t *qx = balloc((size_t)P16 * Kp), *qdy = balloc((size_t)P16 * Np);
    float *sx = falloc((size_t)KB * P16), *sdy = falloc((size_t)NB * P16);
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, qx, sx, x, NULL, NSEG, rows0, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, qdy, sdy, dy, NULL, NSEG, rows0, N, err, sizeof err), 0);

    // outputs with one extra row; Dgrad's start from the same random dx
    real *y = ralloc((size_t)(T + 1) * N), *y_ref = ralloc((size_t)(T + 1) * N);
    real *dx = ralloc((size_t)(T + 1) * K), *dx_ref = ralloc((size_t)(T + 1) * K);
    for (size_t i = 0; i < (size_t)(T + 1) * N; i++) y[i] = y_ref[i] = UNTOUCHED;
    opcheck_fill_nonzero(dx, (size_t)T * K, 64, 0.01, 1.0);
    for (size_t i = (size_t)T * K; i < (size_t)(T + 1) * K; i++) dx[i] = UNTOUCHED;
    memcpy(dx_ref, dx, (size_t)(T + 1) * K * sizeof(real));
    for (int g = 0; g < NSEG; g++) {
        const int n = rows0[g + 1] - rows0[g], n16 = ceil_div(n, 16) * 16;
        if (n == 0) continue;
        uint8_t *qa = balloc((size_t)n16 * Kp), *qb = balloc((size_t)n16 * Np);
        float *sa = falloc((size_t)KB * n16), *sb = falloc((size_t)NB * n16);
        assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qa, sa, x + (size_t)rows0[g] * K, n, K, err, sizeof err), 0);
        assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, qb, sb, dy + (size_t)rows0[g] * N, n, N, err, sizeof err), 0);
        fp8_gemm_fprop(DEVICE_CPU, y_ref + (size_t)rows0[g] * N, qa, sa, qw[g], sw[g], n, N, K);
        fp8_gemm_dgrad(DEVICE_CPU, dx_ref + (size_t)rows0[g] * K, qb, sb, qwt[g], sw[g], n, N, K);
    }
    fp8_gemm_fprop_grouped(DEVICE_CPU, y, NULL, qx, sx, qw, sw, NSEG, rows0, N, K);
    const uint8_t *qdy1[1] = {qdy}, *const *qwt1[1] = {qwt};
    const float *sdy1[1] = {sdy}, *const *sw1[1] = {sw};
    fp8_gemm_dgrad_grouped(DEVICE_CPU, dx, GRAD_ADD, NULL, 1, qdy1, sdy1, qwt1, sw1, NSEG, rows0, N, K);
    for (size_t i = 0; i < (size_t)T * N; i++) assert_true(y_ref[i] != UNTOUCHED);
    assert_memory_equal(y, y_ref, (size_t)(T + 1) * N * sizeof(real));
    assert_memory_equal(dx, dx_ref, (size_t)(T + 1) * K * sizeof(real));
    // GRAD_WRITE: the plain Dgrad's product alone (added to zeros), with the old contents (NaN) never read
    real *dxw = ralloc((size_t)(T + 1) * K), *dxw_ref = ralloc((size_t)T * K);
    for (size_t i = 0; i < (size_t)T * K; i++) dxw[i] = (real)NAN, dxw_ref[i] = 0;
    for (int c = 0; c < K; c++) dxw[(size_t)T * K + c] = UNTOUCHED;
    for (int g = 0, p16 = 0; g < NSEG; g++) {
        const int n = rows0[g + 1] - rows0[g];
        if (n == 0) continue;
        fp8_gemm_dgrad(DEVICE_CPU, dxw_ref + (size_t)rows0[g] * K, qdy + (size_t)NB * 128 * p16, sdy + (size_t)NB * p16,
                       qwt[g], sw[g], n, N, K);
        p16 += ceil_div(n, 16) * 16;
    }
    fp8_gemm_dgrad_grouped(DEVICE_CPU, dxw, GRAD_WRITE, NULL, 1, qdy1, sdy1, qwt1, sw1, NSEG, rows0, N, K);
    for (size_t i = 0; i < (size_t)T * K; i++) assert_true(dxw[i] == dxw_ref[i] && dxw[i] != 0);
    for (int c = 0; c < K; c++) assert_true(dxw[(size_t)T * K + c] == UNTOUCHED);
    // two matrices (Linears sharing the input): the second product added after the first, as two calls
    real *dx2 = ralloc((size_t)T * K);
    const uint8_t *qdy2[2] = {qdy, qdy}, *const *qwt2[2] = {qwt, qwt};
    const float *sdy2[2] = {sdy, sdy}, *const *sw2[2] = {sw, sw};
    fp8_gemm_dgrad_grouped(DEVICE_CPU, dx2, GRAD_WRITE, NULL, 2, qdy2, sdy2, qwt2, sw2, NSEG, rows0, N, K);
    for (size_t i = 0; i < (size_t)T * K; i++) assert_true(dx2[i] == dxw[i] + dxw[i]);
    for (int c = 0; c < N; c++) assert_true(y[(size_t)T * N + c] == UNTOUCHED);
    for (int c = 0; c < K; c++) assert_true(dx[(size_t)T * K + c] == UNTOUCHED);
    // the Fprop's BF16 products as they are (fp8_gemm_fprop_grouped_bf16): row stride Np, every valid element the
    // BF16 bits of what the converting Fprop wrote, the padding columns 0 (T + 15 rows, poisoned first)
    uint16_t *y16 = talloc((size_t)(T + 15) * Np * sizeof(uint16_t));
    memset(y16, 0xA5, (size_t)(T + 15) * Np * sizeof(uint16_t));
    fp8_gemm_fprop_grouped_bf16(DEVICE_CPU, y16, qx, sx, qw, sw, NSEG, rows0, N, K);
    check_bf16_rows("BF16 Fprop", y16, y_ref, T, N, Np);
    // the Dgrad's (fp8_gemm_dgrad_grouped_bf16): the BF16 bits of the GRAD_WRITE Dgrad's values, row stride Kp
    uint16_t *dx16 = talloc((size_t)(T + 15) * Kp * sizeof(uint16_t));
    memset(dx16, 0xA5, (size_t)(T + 15) * Kp * sizeof(uint16_t));
    fp8_gemm_dgrad_grouped_bf16(DEVICE_CPU, dx16, qdy, sdy, qwt, sw, NSEG, rows0, N, K);
    check_bf16_rows("BF16 Dgrad", dx16, dxw, T, K, Kp);
    tfree_all();
}

// ---------------------------------------------------------------------------- BF16 baseline GEMMs
// Reference: operands rounded to BF16, products exact, the sum in double. The op sums BF16 products
// (exact in FP32) in FP32 in order: |acc - ref| <= gamma_{n-1} sum |a b| (Higham 3.1, the first addition
// to 0 is exact); BF16 outputs add 2^-8 |got|.
static double bf(real v) { return (double)bf16_to_float(float_to_bf16((float)v)); }

static void check_bf16_output(const char *what, const real *got, const double *ref, const double *abs_sum, size_t n,
                              int terms, int bf16_out) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (bf16_out) assert_true(bf((double)got[i]) == (double)got[i]);  // a BF16 value
        const double bound = opcheck_gamma(terms - 1) * abs_sum[i] + (bf16_out ? U_BF16 * fabs((double)got[i]) : 0);
        worst = fmax(worst, fabs((double)got[i] - ref[i]) / (bound + 1e-300));
    }
    opcheck_report(what, worst);
    assert_true(worst <= 1.0);
}

static void test_bf16_matmul(void **state) {
    (void)state;
    const int N = 33, C = 70, OC = 50;
    real *inp = ralloc((size_t)N * C), *w = ralloc((size_t)OC * C), *dout = ralloc((size_t)N * OC);
    real *out = ralloc((size_t)N * OC), *dinp = ralloc((size_t)N * C), *dw = ralloc((size_t)OC * C);
    real *g1 = ralloc((size_t)N * C), *g2 = ralloc((size_t)OC * C);
    real *dinp_acc = ralloc((size_t)N * C), *dw_acc = ralloc((size_t)OC * C);
    opcheck_fill_nonzero(inp, (size_t)N * C, 61, 0.01, 2.0);
    opcheck_fill_nonzero(w, (size_t)OC * C, 62, 0.01, 1.0);
    opcheck_fill_nonzero(dout, (size_t)N * OC, 63, 0.01, 1.0);
    opcheck_fill_nonzero(g1, (size_t)N * C, 64, 0.01, 1.0);
    opcheck_fill_nonzero(g2, (size_t)OC * C, 65, 0.01, 1.0);
    bf16_matmul_forward(DEVICE_CPU, out, inp, w, N, C, OC);
    bf16_matmul_backward(DEVICE_CPU, dinp, dw, dout, inp, w, N, C, OC);

    double *ref = dalloc((size_t)N * C * 4), *abs_sum = dalloc((size_t)N * C * 4);
    for (int i = 0; i < N; i++) {  // out (N, OC) = inp w^T
        for (int o = 0; o < OC; o++) {
            double s = 0, a = 0;
            for (int c = 0; c < C; c++) {
                const double p = bf(inp[(size_t)i * C + c]) * bf(w[(size_t)o * C + c]);
                s += p;
                a += fabs(p);
            }
            ref[(size_t)i * OC + o] = s;
            abs_sum[(size_t)i * OC + o] = a;
        }
    }
    check_bf16_output("bf16_matmul_forward", out, ref, abs_sum, (size_t)N * OC, C, 1);
    for (int i = 0; i < N; i++) {  // dinp (N, C) = dout w
        for (int c = 0; c < C; c++) {
            double s = 0, a = 0;
            for (int o = 0; o < OC; o++) {
                const double p = bf(dout[(size_t)i * OC + o]) * bf(w[(size_t)o * C + c]);
                s += p;
                a += fabs(p);
            }
            ref[(size_t)i * C + c] = s;
            abs_sum[(size_t)i * C + c] = a;
        }
    }
    check_bf16_output("bf16_matmul_backward dinp", dinp, ref, abs_sum, (size_t)N * C, OC, 1);
    for (int o = 0; o < OC; o++) {  // dweight (OC, C) = dout^T inp, FP32
        for (int c = 0; c < C; c++) {
            double s = 0, a = 0;
            for (int i = 0; i < N; i++) {
                const double p = bf(dout[(size_t)i * OC + o]) * bf(inp[(size_t)i * C + c]);
                s += p;
                a += fabs(p);
            }
            ref[(size_t)o * C + c] = s;
            abs_sum[(size_t)o * C + c] = a;
        }
    }
    check_bf16_output("bf16_matmul_backward dweight", dw, ref, abs_sum, (size_t)OC * C, N, 0);
    // Both gradients accumulate: the fresh result is added once to what the buffer held.
    memcpy(dinp_acc, g1, (size_t)N * C * sizeof(real));
    memcpy(dw_acc, g2, (size_t)OC * C * sizeof(real));
    bf16_matmul_backward(DEVICE_CPU, dinp_acc, dw_acc, dout, inp, w, N, C, OC);
    for (size_t i = 0; i < (size_t)N * C; i++) assert_int_equal(float_bits(dinp_acc[i]), float_bits(g1[i] + dinp[i]));
    for (size_t i = 0; i < (size_t)OC * C; i++) assert_int_equal(float_bits(dw_acc[i]), float_bits(g2[i] + dw[i]));
    tfree_all();
}

// The BF16 GEMMs on pre-rounded operands (train/linear.c's bf16 mode) give, group by group, the bits of
// bf16_matmul_forward / _backward on the unrounded operands: groups of 37, 0, 64 and 19 rows, a separate
// weight per group (NULL for the empty one), Dgrad and Wgrad adding onto random buffers (and Dgrad writing over
// poison with GRAD_WRITE: the product alone), and the row after the output left alone.
static void test_bf16_gemm_grouped(void **state) {
    (void)state;
    enum { G = 4, N = 48, K = 72 };
    const int rows0[G + 1] = {0, 37, 37, 101, 120}, T = rows0[G];
    real *x = ralloc((size_t)T * K), *dy = ralloc((size_t)T * N), *w = ralloc((size_t)G * N * K);
    opcheck_fill_nonzero(x, (size_t)T * K, 71, 0.01, 2.0);
    opcheck_fill_nonzero(dy, (size_t)T * N, 72, 0.01, 1.0);
    opcheck_fill_nonzero(w, (size_t)G * N * K, 73, 0.01, 1.0);
    uint16_t *xb = talloc((size_t)T * K * 2), *dyb = talloc((size_t)T * N * 2), *wb = talloc((size_t)G * N * K * 2);
    bf16_round_array(DEVICE_CPU, xb, x, (int64_t)T * K);
    bf16_round_array(DEVICE_CPU, dyb, dy, (int64_t)T * N);
    bf16_round_array(DEVICE_CPU, wb, w, (int64_t)G * N * K);
    const uint16_t *wg[G];
    for (int g = 0; g < G; g++) wg[g] = rows0[g + 1] > rows0[g] ? wb + (size_t)g * N * K : NULL;

    real *y = ralloc((size_t)(T + 1) * N), *y_ref = ralloc((size_t)T * N);
    real *dx = ralloc((size_t)(T + 1) * K), *dx_ref = ralloc((size_t)T * K);
    real *dw = ralloc((size_t)G * N * K), *dw_ref = ralloc((size_t)G * N * K);
    opcheck_fill_nonzero(dx, (size_t)T * K, 74, 0.01, 1.0);
    opcheck_fill_nonzero(dw, (size_t)G * N * K, 75, 0.01, 1.0);
    memcpy(dx_ref, dx, (size_t)T * K * sizeof(real));
    memcpy(dw_ref, dw, (size_t)G * N * K * sizeof(real));
    for (int c = 0; c < N; c++) y[(size_t)T * N + c] = UNTOUCHED;
    for (int c = 0; c < K; c++) dx[(size_t)T * K + c] = UNTOUCHED;

    bf16_gemm_fprop_grouped(DEVICE_CPU, y, NULL, xb, wg, G, rows0, N, K);
    const uint16_t *dyb1[1] = {dyb}, *const *wg1[1] = {wg};
    bf16_gemm_dgrad_grouped(DEVICE_CPU, dx, GRAD_ADD, NULL, 1, dyb1, wg1, G, rows0, N, K);
    real *dxw = ralloc((size_t)(T + 1) * K), *dxw_ref = ralloc((size_t)T * K);
    for (size_t i = 0; i < (size_t)T * K; i++) dxw[i] = (real)NAN, dxw_ref[i] = 0;
    for (int c = 0; c < K; c++) dxw[(size_t)T * K + c] = UNTOUCHED;
    bf16_gemm_dgrad_grouped(DEVICE_CPU, dxw, GRAD_WRITE, NULL, 1, dyb1, wg1, G, rows0, N, K);
    for (int g = 0; g < G; g++) {
        const int r0 = rows0[g], n = rows0[g + 1] - rows0[g];
        if (n == 0) continue;
        bf16_gemm_wgrad(DEVICE_CPU, dw + (size_t)g * N * K, dyb + (size_t)r0 * N, xb + (size_t)r0 * K, n, N, K);
        bf16_matmul_forward(DEVICE_CPU, y_ref + (size_t)r0 * N, x + (size_t)r0 * K, w + (size_t)g * N * K, n, K, N);
        bf16_matmul_backward(DEVICE_CPU, dx_ref + (size_t)r0 * K, dw_ref + (size_t)g * N * K, dy + (size_t)r0 * N,
                             x + (size_t)r0 * K, w + (size_t)g * N * K, n, K, N);
        bf16_matmul_backward(DEVICE_CPU, dxw_ref + (size_t)r0 * K, NULL, dy + (size_t)r0 * N, NULL,
                             w + (size_t)g * N * K, n, K, N);
    }
    for (size_t i = 0; i < (size_t)T * K; i++) assert_true(dxw[i] == dxw_ref[i] && dxw[i] != 0);
    for (int c = 0; c < K; c++) assert_true(dxw[(size_t)T * K + c] == UNTOUCHED);
    for (size_t i = 0; i < (size_t)T * N; i++) assert_int_equal(float_bits(y[i]), float_bits(y_ref[i]));
    for (size_t i = 0; i < (size_t)T * K; i++) assert_int_equal(float_bits(dx[i]), float_bits(dx_ref[i]));
    for (size_t i = 0; i < (size_t)G * N * K; i++) assert_int_equal(float_bits(dw[i]), float_bits(dw_ref[i]));
    for (int c = 0; c < N; c++) assert_true(y[(size_t)T * N + c] == UNTOUCHED);
    for (int c = 0; c < K; c++) assert_true(dx[(size_t)T * K + c] == UNTOUCHED);
    tfree_all();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_all_codes),
        cmocka_unit_test(test_e4m3_ties_to_even),
        cmocka_unit_test(test_e4m3_saturation),
        cmocka_unit_test(test_e4m3_random_against_search),
        cmocka_unit_test(test_quantize_1x128),
        cmocka_unit_test(test_quantize_128x128),
        cmocka_unit_test(test_quantize_128x128_batched),
        cmocka_unit_test(test_quantize_128x1_transposed),
        cmocka_unit_test(test_quantize_grouped),
        cmocka_unit_test(test_quantize_rmsnorm),
        cmocka_unit_test(test_quantize_rejects_non_finite),
        cmocka_unit_test(test_quantize_swiglu_grouped),
        cmocka_unit_test(test_quantize_swiglu_rejects_non_finite),
        cmocka_unit_test(test_quantize_swiglu_grads_grouped),
        cmocka_unit_test(test_quantize_swiglu_grads_rejects_non_finite),
        cmocka_unit_test(test_quantize_combine_grad),
        cmocka_unit_test(test_quantize_combine_grad_rejects_non_finite),
        cmocka_unit_test(test_gemm_fprop),
        cmocka_unit_test(test_gemm_dgrad),
        cmocka_unit_test(test_gemm_wgrad),
        cmocka_unit_test(test_gemm_deterministic_across_threads),
        cmocka_unit_test(test_gemm_grouped),
        cmocka_unit_test(test_bf16_matmul),
        cmocka_unit_test(test_bf16_gemm_grouped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
