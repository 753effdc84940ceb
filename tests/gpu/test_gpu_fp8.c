/*
 * test_gpu_fp8.c - CUDA vs CPU parity of DeepSeek-V3's FP8 recipe (kernels.h "FP8 (E4M3) block scaling"):
 * the three quantisers, the three block-scaled cuBLASLt GEMMs (Fprop, Dgrad, Wgrad) and the BF16
 * baseline GEMMs. Runs only on a machine with an NVIDIA GPU (tests/gpu/run.sh); with no visible GPU
 * it FAILS, so a GPU job can never pass by testing nothing.
 *
 * Quantisers must be BIT-IDENTICAL to the CPU ones (DESIGN.md section 4): every q byte (padding
 * included) and every scale (the 128x128 K-block padding included) is compared bit for bit, and both
 * are also checked against the definition computed here (s = amax/448 over the tile's valid
 * elements, |decode(q) - x/s| <= half an E4M3 step at that magnitude, sign kept, padding 0) with an
 * E4M3 decoder written in this file. NaN/Inf inputs must return -1 naming the first bad element.
 *
 * GEMMs: tensor cores add FP8 products inside a 128-block with reduced precision, so the GPU agrees
 * with the CPU per element within 2^-10 * sum_k |a_k s_a b_k s_b| (the products of the dequantised
 * operands) plus the output's rounding: BF16 half an ulp of the value for Fprop/Dgrad (both sides round,
 * so one ulp for GPU vs CPU), FP32 roundings of the accumulation and the final add for Wgrad. The
 * reference is a double-precision sum computed here from the dequantised operands. BF16 GEMMs: exact
 * products of BF16-rounded operands, FP32 accumulation in different orders: (2K + 16) u of the sum of
 * |products| (u = 2^-24), plus the BF16 output rounding. Every GPU GEMM also runs twice: the results
 * must be bitwise identical.
 *
 * Inputs are random and non-zero with magnitudes spread over many binades (so tiles have different
 * scales and E4M3 subnormals and underflows occur); outputs are poisoned (NaN floats, 0xFF bytes)
 * before each call, so an element a kernel does not write fails. Shapes include partial blocks
 * (576 = 4.5 blocks of 128, K = 300), a token segment with zero padding rows, T not a multiple of 128
 * (Wgrad's zero-padded T blocks) and a misaligned Wgrad output (the scratch-and-add path).
 * The grouped Fprop and Dgrad (the routed experts: one output conversion for all segments) must equal the
 * plain CUDA calls segment by segment, bit for bit.
 * The quantisers of SwiGLU values (fp8_quantize_swiglu_*, computed where they are read) must equal the CUDA
 * composition their contract names (the SwiGLU op into an array, then the grouped quantiser) bit for bit, and the
 * CPU's to one E4M3 step with 99% of the codes identical: the GPU's expf is not libm's exp, so the value may
 * differ by a few ulp (test_quantize_swiglu derives the bound). The joint quantiser of both SwiGLU gradients
 * (fp8_quantize_swiglu_grads_both_layouts_grouped) must equal the two CUDA calls it stands for bit for bit, and
 * report a non-finite value with their message.
 * The quantiser of the routed experts' output gradient read through the routing plan
 * (fp8_quantize_combine_grad_both_layouts_grouped, plan built on the GPU) must equal the CUDA composition its contract
 * names (moe_combine_backward into dexpert_out, then the grouped both-layouts quantiser) AND the CPU op bit for bit:
 * its value is one FP32 product, the same on both.
 * One table row per check.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/kernels.h"
#include "tests/gpu/gpucheck.h"
#include "unit/opcheck.h"

#define U_FP32 0x1p-24
#define FP8_GEMM_REL 0x1p-10 // DESIGN.md section 4: tensor-core accumulation inside a 128-block

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------- buffers
static float *floats(int64_t n) { return gpucheck_malloc((size_t)n * sizeof(float)); }
static double *doubles(int64_t n) { return gpucheck_malloc((size_t)n * sizeof(double)); }
// Host and device buffers filled with 0xFF bytes: NaN as float, NaN (0xFF) as E4M3.
static void *host_poisoned(size_t bytes) {
    void *h = gpucheck_malloc(bytes);
    memset(h, 0xFF, bytes);
    return h;
}
static void *gpu_poisoned(size_t bytes) {
    void *h = host_poisoned(bytes);
    void *d = gpucheck_to_device(h, bytes);
    free(h);
    return d;
}
// A device buffer of zeros: what GRAD_ADD adds onto, to compare GRAD_WRITE's output with.
static void *gpu_zeros(size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes);
    device_memset_zero(DEVICE_CUDA, d, bytes);
    return d;
}

// x (n): random sign, |x| = 2^e with e uniform in [lo_exp, hi_exp): non-zero, many binades.
static void fill_log_uniform(float *x, int64_t n, uint64_t seed, double lo_exp, double hi_exp) {
    for (int64_t i = 0; i < n; i++) {
        const double e = lo_exp + (hi_exp - lo_exp) * opcheck_uniform(seed, 2 * (uint64_t)i);
        const double sign = opcheck_uniform(seed, 2 * (uint64_t)i + 1) < 0.5 ? -1.0 : 1.0;
        x[i] = (float)(sign * exp2(e));
    }
}

// ---------------------------------------------------------------------------- independent references
// E4M3 decoder (bias 7, 3 mantissa bits, no infinity, 0x7F/0xFF NaN), written here, not taken from fp8.c.
static double e4m3_value(uint8_t q) {
    const int e = (q >> 3) & 15, m = q & 7;
    double v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = ldexp((double)m, -9);
    else v = ldexp(1.0 + m / 8.0, e - 7);
    return (q & 0x80) ? -v : v;
}

// Half the spacing of E4M3 values around |v| (subnormal spacing 2^-9 below 2^-6).
static double e4m3_half_step(double v) {
    const double a = fabs(v);
    const int e = a < 0x1p-6 ? -6 : (int)floor(log2(a));
    return ldexp(1.0, e - 4);
}

// Half an ulp of BF16 (8 significant bits) at |v|; 0 for v = 0.
static double bf16_half_ulp(double v) {
    const double a = fabs(v);
    if (a == 0.0) return 0.0;
    return ldexp(1.0, (int)floor(log2(a)) - 8);
}

// Round-to-nearest-even to BF16, written here (finite inputs).
static float bf16_round(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    float y;
    memcpy(&y, &b, sizeof y);
    return y;
}

// ---------------------------------------------------------------------------- quantisers
typedef enum { Q_1X128, Q_128X128, Q_128X1T } QuantKind;
static const char *const quant_names[] = {"quantize_1x128", "quantize_128x128", "quantize_128x1_T"};
static const char *const quant_ops[] = {"fp8_quantize_1x128", "fp8_quantize_128x128", "fp8_quantize_128x1_transposed"};

// The layout of one quantiser's outputs for an input of (rows, cols).
typedef struct {
    QuantKind kind;
    int rows, cols;
    int64_t q_bytes, qt_bytes, s_count;
} QuantLayout;

static QuantLayout quant_layout(QuantKind kind, int rows, int cols, int with_qt) {
    QuantLayout L = {kind, rows, cols, 0, 0, 0};
    const int KB = ceil_div(cols, FP8_TILE), Kp = KB * FP8_TILE;
    if (kind == Q_1X128) {  // rows padded to 16 by the quantiser (zero rows, scale 1)
        const int R16 = ceil_div(rows, 16) * 16;
        L.q_bytes = (int64_t)R16 * Kp, L.s_count = (int64_t)KB * R16;
    } else if (kind == Q_128X128) {
        const int NB = ceil_div(rows, FP8_TILE), KB4 = (KB + 3) / 4 * 4;
        L.q_bytes = (int64_t)NB * FP8_TILE * Kp, L.s_count = (int64_t)NB * KB4;
        L.qt_bytes = with_qt ? L.q_bytes : 0;
    } else {
        const int TB = ceil_div(rows, FP8_TILE);
        L.q_bytes = (int64_t)cols * TB * FP8_TILE, L.s_count = (int64_t)TB * cols;
    }
    return L;
}

static int run_quantizer(Device dev, const QuantLayout *L, uint8_t *q, uint8_t *qt, float *s, const float *x,
                         char *err, size_t err_size) {
    switch (L->kind) {
    case Q_1X128: return fp8_quantize_1x128(dev, q, s, x, L->rows, L->cols, err, err_size);
    case Q_128X128: return fp8_quantize_128x128(dev, q, qt, s, x, L->rows, L->cols, err, err_size);
    default: return fp8_quantize_128x1_transposed(dev, q, s, x, L->rows, L->cols, err, err_size);
    }
}

// Checks q, qt, s against the definition for input x (rows, cols) and returns the worst
// |decode(q) s^-1... | ratio (<= 1 passes); counts definition violations into *bad.
// For element (r, c) of x: its tile's scale sc and its byte position(s) in q (and qt).
static double check_definition(const QuantLayout *L, const uint8_t *q, const uint8_t *qt, const float *s,
                               const float *x, int64_t *bad) {
    const int rows = L->rows, cols = L->cols;
    const int KB = ceil_div(cols, FP8_TILE), Kp = KB * FP8_TILE, KB4 = (KB + 3) / 4 * 4;
    const int NB = ceil_div(rows, FP8_TILE), Np = NB * FP8_TILE, TB = ceil_div(rows, FP8_TILE), Tp = TB * FP8_TILE;
    const int R16 = ceil_div(rows, 16) * 16;
    // tile amax, recomputed here
    const int64_t n_tiles = L->s_count;
    float *amax = floats(n_tiles);
    for (int64_t i = 0; i < n_tiles; i++) amax[i] = 0.0f;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t t = L->kind == Q_1X128     ? (int64_t)(c / FP8_TILE) * R16 + r
                        : L->kind == Q_128X128 ? (int64_t)(r / FP8_TILE) * KB4 + c / FP8_TILE
                                               : (int64_t)(r / FP8_TILE) * cols + c;
            amax[t] = fmaxf(amax[t], fabsf(x[(int64_t)r * cols + c]));
        }
    *bad = 0;
    for (int64_t t = 0; t < n_tiles; t++) {
        const float want = amax[t] / FP8_E4M3_MAX > 0.0f ? amax[t] / FP8_E4M3_MAX : 1.0f;
        if (memcmp(&want, &s[t], sizeof want) != 0) {
            if (*bad < 3) printf("    scale [%lld]: got %.9g, want amax/448 = %.9g\n", (long long)t, s[t], want);
            (*bad)++;
        }
    }
    // every byte: valid elements within half a step, padding 0
    double worst = 0.0;
    uint8_t *seen = calloc((size_t)L->q_bytes, 1);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t at, at_t = -1, t;
            if (L->kind == Q_1X128) at = (int64_t)r * Kp + c, t = (int64_t)(c / FP8_TILE) * R16 + r;
            else if (L->kind == Q_128X128)
                at = (int64_t)r * Kp + c, at_t = (int64_t)c * Np + r, t = (int64_t)(r / FP8_TILE) * KB4 + c / FP8_TILE;
            else at = (int64_t)c * Tp + r, t = (int64_t)(r / FP8_TILE) * cols + c;
            seen[at] = 1;
            const double target = (double)(x[(int64_t)r * cols + c] / s[t]); // the FP32 quotient
            const double got = e4m3_value(q[at]);
            const double ratio = fabs(got - target) / e4m3_half_step(target);
            const int sign_ok = (q[at] & 0x80) == (x[(int64_t)r * cols + c] < 0 ? 0x80 : 0);
            if (!(ratio <= worst)) worst = ratio;
            if (!(ratio <= 1.0) || !sign_ok || (qt != NULL && qt[at_t] != q[at])) {
                if (*bad < 3)
                    printf("    x[%d][%d] = %.9g, s = %.9g: q byte 0x%02x = %.9g, x/s = %.9g%s\n", r, c,
                           x[(int64_t)r * cols + c], s[t], q[at], got, target,
                           qt != NULL && qt[at_t] != q[at] ? " (qt differs)" : "");
                (*bad)++;
            }
        }
    for (int64_t i = 0; i < L->q_bytes; i++)
        if (!seen[i] && q[i] != 0) (*bad)++;
    if (qt != NULL) {
        int64_t pad_bad = 0;
        for (int64_t k = 0; k < Kp; k++)
            for (int64_t n = 0; n < Np; n++)
                if ((k >= cols || n >= rows) && qt[k * Np + n] != 0) pad_bad++;
        *bad += pad_bad;
    }
    free(seen);
    free(amax);
    return worst;
}

typedef struct {
    QuantKind kind;
    int rows, cols, with_qt;
} QuantCase;

// The quantisers divide by a tile's scale through a reciprocal and an FMA correction instead of an IEEE division
// (fp8_quant.cu fp8_div); the bit-exact CPU comparisons below need it to give the E4M3 code of __fdiv_rn's quotient
// for every element a tile can hold (|x| <= 448 s). Checked here for every FP32 significand of the scale, with 64
// pseudo-random x each (either sign, |x| / s from 2^-71 to 448, signed zeros; s from 2^-100 to 2^119, inside and
// outside the range the fast path serves, which starts at 2^-90): 2^29 codes, none may differ, nor the FP32 quotient
// where the fast path claims its bits (quotients >= 2^-12).
static void test_division_matches_ieee(void **state) {
    (void)state;
    const unsigned long long mismatches = cuda_fp8_division_mismatches(64);
    printf("fp8_div vs __fdiv_rn: %llu mismatches in %llu quotients\n", mismatches, 64ull << 23);
    assert_true(mismatches == 0);
}

static void test_quantizer(void **state) {
    const QuantCase *qc = *state;
    const QuantLayout L = quant_layout(qc->kind, qc->rows, qc->cols, qc->with_qt);
    const int64_t n = (int64_t)qc->rows * qc->cols;
    float *x = floats(n);
    fill_log_uniform(x, n, 1000 + (uint64_t)qc->kind * 17 + (uint64_t)qc->rows, -16.0, 4.0);
    char err[256] = "";

    uint8_t *q_cpu = host_poisoned((size_t)L.q_bytes), *qt_cpu = qc->with_qt ? host_poisoned((size_t)L.qt_bytes) : NULL;
    float *s_cpu = host_poisoned((size_t)L.s_count * sizeof(float));
    assert_int_equal(run_quantizer(DEVICE_CPU, &L, q_cpu, qt_cpu, s_cpu, x, err, sizeof err), 0);

    float *x_d = gpucheck_to_device(x, (size_t)n * sizeof(float));
    uint8_t *q_d = gpu_poisoned((size_t)L.q_bytes), *qt_d = qc->with_qt ? gpu_poisoned((size_t)L.qt_bytes) : NULL;
    float *s_d = gpu_poisoned((size_t)L.s_count * sizeof(float));
    assert_int_equal(run_quantizer(DEVICE_CUDA, &L, q_d, qt_d, s_d, x_d, err, sizeof err), 0);
    uint8_t *q_gpu = gpucheck_to_host(q_d, (size_t)L.q_bytes), *qt_gpu = qc->with_qt ? gpucheck_to_host(qt_d, (size_t)L.qt_bytes) : NULL;
    float *s_gpu = gpucheck_to_host(s_d, (size_t)L.s_count * sizeof(float));

    int64_t q_diff = 0, qt_diff = 0, s_diff = 0, first = -1;
    for (int64_t i = 0; i < L.q_bytes; i++)
        if (q_gpu[i] != q_cpu[i] && q_diff++ == 0) first = i;
    for (int64_t i = 0; i < L.qt_bytes; i++) qt_diff += qt_gpu[i] != qt_cpu[i];
    for (int64_t i = 0; i < L.s_count; i++) s_diff += memcmp(&s_gpu[i], &s_cpu[i], sizeof(float)) != 0;
    int64_t bad_gpu, bad_cpu;
    const double worst_gpu = check_definition(&L, q_gpu, qt_gpu, s_gpu, x, &bad_gpu);
    const double worst_cpu = check_definition(&L, q_cpu, qt_cpu, s_cpu, x, &bad_cpu);
    char shape[48];
    snprintf(shape, sizeof shape, "%d x %d%s", qc->rows, qc->cols, qc->with_qt ? " +qt" : "");
    const int pass = q_diff == 0 && qt_diff == 0 && s_diff == 0 && bad_gpu == 0 && bad_cpu == 0;
    printf("%-18s %-16s %9lld %9lld %9lld %11.3f %11.3f %8lld %8lld  %s\n", quant_names[qc->kind], shape,
           (long long)q_diff, (long long)qt_diff, (long long)s_diff, worst_gpu, worst_cpu, (long long)bad_gpu,
           (long long)bad_cpu, pass ? "ok" : "FAIL");
    if (q_diff > 0)
        printf("    first differing q byte [%lld]: gpu 0x%02x, cpu 0x%02x\n", (long long)first, q_gpu[first], q_cpu[first]);
    fflush(stdout);

    device_free(DEVICE_CUDA, x_d), device_free(DEVICE_CUDA, q_d), device_free(DEVICE_CUDA, qt_d);
    device_free(DEVICE_CUDA, s_d);
    free(x), free(q_cpu), free(qt_cpu), free(s_cpu), free(q_gpu), free(qt_gpu), free(s_gpu);
    assert_true(pass);
}

// NaN and Inf: every quantiser returns -1 on the CPU and names the first bad element (row-major); on the
// GPU the call returns 0 and fp8_check_finite reports the same element (kernels.h: deferred check), after
// a clean call of another quantiser that must not be blamed; a second check then finds nothing.
static void test_quantizer_nonfinite(void **state) {
    (void)state;
    const int rows = 200, cols = 300;
    const int64_t n = (int64_t)rows * cols;
    float *x = floats(n);
    fill_log_uniform(x, n, 77, -4.0, 2.0);
    x[7 * cols + 3] = INFINITY;  // the later one
    x[5 * cols + 17] = NAN;      // the first in row-major order
    x[150 * cols + 299] = -INFINITY;
    float *x_d = gpucheck_to_device(x, (size_t)n * sizeof(float));
    float *clean_h = floats(64 * 256);  // finite, for the clean call before the bad one
    fill_log_uniform(clean_h, 64 * 256, 78, -4.0, 2.0);
    float *clean_x = gpucheck_to_device(clean_h, sizeof(float) * 64 * 256);
    uint8_t *clean_q = gpu_poisoned(256 * 256), *clean_qt = gpu_poisoned(256 * 256);
    float *clean_s = gpu_poisoned(sizeof(float) * 256 * 4);
    for (int k = 0; k < 3; k++) {
        const QuantLayout L = quant_layout((QuantKind)k, rows, cols, 1);
        uint8_t *q_d = gpu_poisoned((size_t)L.q_bytes), *qt_d = L.qt_bytes ? gpu_poisoned((size_t)L.qt_bytes) : NULL;
        float *s_d = gpu_poisoned((size_t)L.s_count * sizeof(float));
        uint8_t *q_h = host_poisoned((size_t)L.q_bytes), *qt_h = L.qt_bytes ? host_poisoned((size_t)L.qt_bytes) : NULL;
        float *s_h = host_poisoned((size_t)L.s_count * sizeof(float));
        char err_gpu[256] = "", err_cpu[256] = "";
        const QuantLayout clean = quant_layout((QuantKind)((k + 1) % 3), 64, 256, 1);
        const int rc_clean = run_quantizer(DEVICE_CUDA, &clean, clean_q, clean_qt, clean_s, clean_x, err_gpu,
                                           sizeof err_gpu);
        const int rc_call = run_quantizer(DEVICE_CUDA, &L, q_d, qt_d, s_d, x_d, err_gpu, sizeof err_gpu);
        const int rc_gpu = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
        char err_again[256] = "";
        const int rc_again = fp8_check_finite(DEVICE_CUDA, err_again, sizeof err_again);
        const int rc_cpu = run_quantizer(DEVICE_CPU, &L, q_h, qt_h, s_h, x, err_cpu, sizeof err_cpu);
        const int named = strstr(err_gpu, "row 5, column 17") != NULL && strstr(err_gpu, quant_ops[k]) != NULL &&
                          strstr(err_gpu, "(200, 300)") != NULL && strstr(err_cpu, "row 5, column 17") != NULL;
        printf("%-18s %-16s rc gpu %d cpu %d; gpu: \"%s\"  %s\n", quant_names[k], "NaN at (5, 17)", rc_gpu, rc_cpu,
               err_gpu, rc_gpu == -1 && rc_cpu == -1 && named ? "ok" : "FAIL");
        fflush(stdout);
        assert_int_equal(rc_clean, 0);
        assert_int_equal(rc_call, 0);
        assert_int_equal(rc_gpu, -1);
        assert_int_equal(rc_again, 0);
        assert_int_equal(rc_cpu, -1);
        assert_true(named);
        device_free(DEVICE_CUDA, q_d), device_free(DEVICE_CUDA, qt_d), device_free(DEVICE_CUDA, s_d);
        free(q_h), free(qt_h), free(s_h);
    }
    // After an error the next call on finite data is clean (the error word is reset by the check).
    fill_log_uniform(x, n, 78, -4.0, 2.0);
    device_memcpy_from_host(DEVICE_CUDA, x_d, x, (size_t)n * sizeof(float));
    const QuantLayout L = quant_layout(Q_1X128, rows, cols, 0);
    uint8_t *q_d = gpu_poisoned((size_t)L.q_bytes);
    float *s_d = gpu_poisoned((size_t)L.s_count * sizeof(float));
    char err[256] = "";
    assert_int_equal(fp8_quantize_1x128(DEVICE_CUDA, q_d, s_d, x_d, rows, cols, err, sizeof err), 0);
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
    device_free(DEVICE_CUDA, q_d), device_free(DEVICE_CUDA, s_d), device_free(DEVICE_CUDA, x_d);
    device_free(DEVICE_CUDA, clean_x), device_free(DEVICE_CUDA, clean_q), device_free(DEVICE_CUDA, clean_qt);
    device_free(DEVICE_CUDA, clean_s);
    free(x), free(clean_h);
}

static int count_diff(const void *a, const void *b, size_t bytes) {
    const uint8_t *x = a, *y = b;
    int d = 0;
    for (size_t i = 0; i < bytes; i++) d += x[i] != y[i];
    return d;
}

// bf16_round_rows (bf16 mode's routed experts read their token rows through the routing plan) against the CPU:
// every BF16 bit equal, rows repeated and out of order, C a multiple of 4 (vector path) and not (scalar).
static void test_bf16_round_rows(void **state) {
    (void)state;
    for (int pass = 0; pass < 2; pass++) {
        const int S = 97, n_rows = 300, C = pass ? 301 : 300;
        float *src = floats((int64_t)S * C);
        fill_log_uniform(src, (int64_t)S * C, 1800 + (uint64_t)C, -16.0, 4.0);
        int rows[300];
        for (int r = 0; r < n_rows; r++) rows[r] = (r * 37 + 11) % S;
        float *src_d = gpucheck_to_device(src, (size_t)S * C * sizeof(float));
        int *rows_d = gpucheck_to_device(rows, sizeof rows);
        uint16_t *out_d = gpu_poisoned((size_t)n_rows * C * 2), *out_h = host_poisoned((size_t)n_rows * C * 2);
        bf16_round_rows(DEVICE_CUDA, out_d, src_d, rows_d, n_rows, C);
        bf16_round_rows(DEVICE_CPU, out_h, src, rows, n_rows, C);
        uint16_t *out_g = gpucheck_to_host(out_d, (size_t)n_rows * C * 2);
        const int diff = count_diff(out_g, out_h, (size_t)n_rows * C * 2);
        printf("%-18s %d rows of (%d, %d) through an index: differing bytes %d  %s\n", "bf16_round_rows", n_rows, S,
               C, diff, diff == 0 ? "ok" : "FAIL");
        fflush(stdout);
        device_free(DEVICE_CUDA, src_d), device_free(DEVICE_CUDA, rows_d), device_free(DEVICE_CUDA, out_d);
        free(src), free(out_h), free(out_g);
        assert_int_equal(diff, 0);
    }
}

// bf16_widen_array (the EP exchange's BF16 rows back in FP32, parallel/ep.c) against the CPU: every bit equal, on
// fresh BF16 bit patterns of finite values of both signs across the exponent range, zeros and subnormals among
// them, at a length that is not a multiple of the block size. Tolerance 0: widening is exact.
static void test_bf16_widen_array(void **state) {
    (void)state;
    const int64_t n = 100003;
    float *src = floats(n);
    fill_log_uniform(src, n, 1900, -130.0, 30.0);  // below 2^-126: BF16 subnormals and zeros after rounding
    uint16_t *bits = host_poisoned((size_t)n * 2);
    bf16_round_array(DEVICE_CPU, bits, src, n);
    uint16_t *bits_d = gpucheck_to_device(bits, (size_t)n * 2);
    float *out_d = gpu_poisoned((size_t)n * sizeof(float)), *out_h = floats(n);
    bf16_widen_array(DEVICE_CUDA, out_d, bits_d, n);
    bf16_widen_array(DEVICE_CPU, out_h, bits, n);
    float *out_g = gpucheck_to_host(out_d, (size_t)n * sizeof(float));
    const int diff = count_diff(out_g, out_h, (size_t)n * sizeof(float));
    int round_trip = 0;  // and the CPU op itself: rounding its output again gives the same bits
    for (int64_t i = 0; i < n; i++) round_trip += float_to_bf16(out_h[i]) != bits[i];
    printf("%-18s %lld values: differing bytes %d, round-trip changes %d  %s\n", "bf16_widen_array", (long long)n, diff,
           round_trip, diff == 0 && round_trip == 0 ? "ok" : "FAIL");
    fflush(stdout);
    device_free(DEVICE_CUDA, bits_d), device_free(DEVICE_CUDA, out_d);
    free(src), free(bits), free(out_h), free(out_g);
    assert_int_equal(diff, 0);
    assert_int_equal(round_trip, 0);
}

// fp8_quantize_128x128_batched (a routed-expert Linear's weights in one launch) against the CPU's batched op:
// every byte of q and qt and every scale of the stack bit-identical (poisoned outputs; partial blocks on both
// axes; K = 302 takes the scalar loads, K = 300 the vector ones); a NaN named at its row of the stack.
static void test_quantize_128x128_batched(void **state) {
    (void)state;
    for (int pass = 0; pass < 2; pass++) {
        const int batch = 5, N = 200, K = pass ? 302 : 300, KB = ceil_div(K, 128), KB4 = (KB + 3) / 4 * 4;
        const int NB = ceil_div(N, 128), Kp = KB * 128, Np = NB * 128;
        const int64_t n = (int64_t)batch * N * K, nq = (int64_t)batch * Np * Kp, ns = (int64_t)batch * NB * KB4;
        float *w = floats(n);
        fill_log_uniform(w, n, 1700 + (uint64_t)K, -16.0, 4.0);
        float *w_d = gpucheck_to_device(w, (size_t)n * sizeof(float));
        uint8_t *q_d = gpu_poisoned((size_t)nq), *qt_d = gpu_poisoned((size_t)nq);
        float *s_d = gpu_poisoned((size_t)ns * sizeof(float));
        uint8_t *q_h = host_poisoned((size_t)nq), *qt_h = host_poisoned((size_t)nq);
        float *s_h = host_poisoned((size_t)ns * sizeof(float));
        char err[256] = "";
        assert_int_equal(fp8_quantize_128x128_batched(DEVICE_CUDA, q_d, qt_d, s_d, w_d, batch, N, K, err, sizeof err), 0);
        assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
        assert_int_equal(fp8_quantize_128x128_batched(DEVICE_CPU, q_h, qt_h, s_h, w, batch, N, K, err, sizeof err), 0);
        uint8_t *q_g = gpucheck_to_host(q_d, (size_t)nq), *qt_g = gpucheck_to_host(qt_d, (size_t)nq);
        float *s_g = gpucheck_to_host(s_d, (size_t)ns * sizeof(float));
        const int dq = count_diff(q_g, q_h, (size_t)nq), dqt = count_diff(qt_g, qt_h, (size_t)nq);
        const int ds = count_diff(s_g, s_h, (size_t)ns * sizeof(float));
        w[((int64_t)3 * N + 9) * K + 11] = NAN;  // matrix 3, row 9: row 609 of the stack
        device_memcpy_from_host(DEVICE_CUDA, w_d, w, (size_t)n * sizeof(float));
        assert_int_equal(fp8_quantize_128x128_batched(DEVICE_CUDA, q_d, qt_d, s_d, w_d, batch, N, K, err, sizeof err), 0);
        const int rc = fp8_check_finite(DEVICE_CUDA, err, sizeof err);
        const int named = rc == -1 && strstr(err, "row 609, column 11") != NULL;
        const int pass_ok = dq == 0 && dqt == 0 && ds == 0 && named;
        printf("%-18s %d x (%d, %d): differing bytes q %d, qt %d, scales %d; NaN at stack row 609: %s  %s\n",
               "quantize_128x128 batched", batch, N, K, dq, dqt, ds, named ? "named" : "NOT NAMED",
               pass_ok ? "ok" : "FAIL");
        fflush(stdout);
        device_free(DEVICE_CUDA, w_d), device_free(DEVICE_CUDA, q_d), device_free(DEVICE_CUDA, qt_d);
        device_free(DEVICE_CUDA, s_d);
        free(w), free(q_h), free(qt_h), free(s_h), free(q_g), free(qt_g), free(s_g);
        assert_true(pass_ok);
    }
}

// fp8_quantize_both_layouts on the GPU (one pass over x) against the CPU's two separate quantisers: every
// byte and scale of both operands, padding included, bit-identical. Shapes: partial row and column
// blocks, T not a multiple of 16, and a width that is not a multiple of 4 (the scalar loads).
typedef struct {
    int T, C;
} BothCase;

static void test_quantize_both(void **state) {
    const BothCase *bc = *state;
    const int T = bc->T, C = bc->C;
    const int64_t n = (int64_t)T * C;
    float *x = floats(n);
    fill_log_uniform(x, n, 3000 + (uint64_t)T, -16.0, 4.0);
    const QuantLayout L1 = quant_layout(Q_1X128, T, C, 0), L2 = quant_layout(Q_128X1T, T, C, 0);
    uint8_t *q1 = host_poisoned((size_t)L1.q_bytes), *q2 = host_poisoned((size_t)L2.q_bytes);
    float *s1 = host_poisoned((size_t)L1.s_count * sizeof(float)), *s2 = host_poisoned((size_t)L2.s_count * sizeof(float));
    char err[256] = "";
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, q1, s1, x, T, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, q2, s2, x, T, C, err, sizeof err), 0);
    float *x_d = gpucheck_to_device(x, (size_t)n * sizeof(float));
    uint8_t *q1_d = gpu_poisoned((size_t)L1.q_bytes), *q2_d = gpu_poisoned((size_t)L2.q_bytes);
    float *s1_d = gpu_poisoned((size_t)L1.s_count * sizeof(float)), *s2_d = gpu_poisoned((size_t)L2.s_count * sizeof(float));
    assert_int_equal(fp8_quantize_both_layouts(DEVICE_CUDA, q1_d, s1_d, q2_d, s2_d, x_d, T, C, err, sizeof err), 0);
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
    uint8_t *g1 = gpucheck_to_host(q1_d, (size_t)L1.q_bytes), *g2 = gpucheck_to_host(q2_d, (size_t)L2.q_bytes);
    float *gs1 = gpucheck_to_host(s1_d, (size_t)L1.s_count * sizeof(float)), *gs2 = gpucheck_to_host(s2_d, (size_t)L2.s_count * sizeof(float));
    int64_t d1 = 0, d2 = 0, ds1 = 0, ds2 = 0;
    for (int64_t i = 0; i < L1.q_bytes; i++) d1 += g1[i] != q1[i];
    for (int64_t i = 0; i < L2.q_bytes; i++) d2 += g2[i] != q2[i];
    for (int64_t i = 0; i < L1.s_count; i++) ds1 += memcmp(&gs1[i], &s1[i], sizeof(float)) != 0;
    for (int64_t i = 0; i < L2.s_count; i++) ds2 += memcmp(&gs2[i], &s2[i], sizeof(float)) != 0;
    printf("%-18s %4d x %-9d differing from the CPU's two quantisers: 1x128 %lld bytes, %lld scales; "
           "128x1 %lld bytes, %lld scales  %s\n", "quantize_both", T, C, (long long)d1, (long long)ds1, (long long)d2,
           (long long)ds2, d1 + d2 + ds1 + ds2 == 0 ? "ok" : "FAIL");
    assert_true(d1 + d2 + ds1 + ds2 == 0);
    device_free(DEVICE_CUDA, x_d), device_free(DEVICE_CUDA, q1_d), device_free(DEVICE_CUDA, q2_d);
    device_free(DEVICE_CUDA, s1_d), device_free(DEVICE_CUDA, s2_d);
    free(x), free(q1), free(q2), free(s1), free(s2), free(g1), free(g2), free(gs1), free(gs2);
}

// Bytes and scales of two both-layouts outputs that differ (q1, s1, q2, s2 of L1 and L2), all four counts added.
static int64_t both_differing(const QuantLayout *L1, const QuantLayout *L2, const uint8_t *a1, const float *as1,
                              const uint8_t *a2, const float *as2, const uint8_t *b1, const float *bs1,
                              const uint8_t *b2, const float *bs2) {
    int64_t d = 0;
    for (int64_t i = 0; i < L1->q_bytes; i++) d += a1[i] != b1[i];
    for (int64_t i = 0; i < L2->q_bytes; i++) d += a2[i] != b2[i];
    for (int64_t i = 0; i < L1->s_count; i++) d += memcmp(&as1[i], &bs1[i], sizeof(float)) != 0;
    for (int64_t i = 0; i < L2->s_count; i++) d += memcmp(&as2[i], &bs2[i], sizeof(float)) != 0;
    return d;
}

// fp8_quantize_rmsnorm_both_layouts (RMSNorm's rows normalised as the quantiser reads them, fp8 mode's MLA inputs):
// BITWISE what its contract names, the CUDA rmsnorm_forward into an array and the CUDA both-layouts quantiser of it,
// and what the CPU op gives for the same rstd (one FP32 product per factor, the same on both; the rstd itself is a
// sum in another order on the CPU, so the CPU op is given the GPU's). rmsnorm_forward without out must write the
// rstd it writes with out, bit for bit. Then a NaN at (5, 17) must be reported naming the op, row and column.
static void test_quantize_rmsnorm(void **state) {
    const BothCase *bc = *state;
    const int T = bc->T, C = bc->C;
    const int64_t n = (int64_t)T * C;
    float *x = floats(n), *w = floats(C);
    fill_log_uniform(x, n, 5000 + (uint64_t)T, -12.0, 3.0);
    fill_log_uniform(w, C, 5100 + (uint64_t)C, -3.0, 1.0);
    const QuantLayout L1 = quant_layout(Q_1X128, T, C, 0), L2 = quant_layout(Q_128X1T, T, C, 0);
    const size_t b1 = (size_t)L1.q_bytes, b2 = (size_t)L2.q_bytes;
    const size_t f1 = (size_t)L1.s_count * sizeof(float), f2 = (size_t)L2.s_count * sizeof(float);
    float *x_d = gpucheck_to_device(x, (size_t)n * sizeof(float)), *w_d = gpucheck_to_device(w, C * sizeof(float));
    float *xn_d = gpu_poisoned((size_t)n * sizeof(float));
    float *rstd_d = gpu_poisoned((size_t)T * sizeof(float)), *rstd_out_d = gpu_poisoned((size_t)T * sizeof(float));
    uint8_t *q1_d = gpu_poisoned(b1), *q2_d = gpu_poisoned(b2), *r1_d = gpu_poisoned(b1), *r2_d = gpu_poisoned(b2);
    float *s1_d = gpu_poisoned(f1), *s2_d = gpu_poisoned(f2), *rs1_d = gpu_poisoned(f1), *rs2_d = gpu_poisoned(f2);
    char err[256] = "";
    rmsnorm_forward(DEVICE_CUDA, NULL, rstd_d, x_d, w_d, T, C);
    rmsnorm_forward(DEVICE_CUDA, xn_d, rstd_out_d, x_d, w_d, T, C);
    assert_int_equal(fp8_quantize_both_layouts(DEVICE_CUDA, r1_d, rs1_d, r2_d, rs2_d, xn_d, T, C, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_rmsnorm_both_layouts(DEVICE_CUDA, q1_d, s1_d, q2_d, s2_d, x_d, rstd_d, w_d, T, C, err,
                                                       sizeof err), 0);
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
    float *rstd = gpucheck_to_host(rstd_d, (size_t)T * sizeof(float));
    float *rstd_out = gpucheck_to_host(rstd_out_d, (size_t)T * sizeof(float));
    uint8_t *g1 = gpucheck_to_host(q1_d, b1), *g2 = gpucheck_to_host(q2_d, b2);
    uint8_t *r1 = gpucheck_to_host(r1_d, b1), *r2 = gpucheck_to_host(r2_d, b2);
    float *gs1 = gpucheck_to_host(s1_d, f1), *gs2 = gpucheck_to_host(s2_d, f2);
    float *rs1 = gpucheck_to_host(rs1_d, f1), *rs2 = gpucheck_to_host(rs2_d, f2);
    uint8_t *c1 = host_poisoned(b1), *c2 = host_poisoned(b2);
    float *cs1 = host_poisoned(f1), *cs2 = host_poisoned(f2);
    assert_int_equal(fp8_quantize_rmsnorm_both_layouts(DEVICE_CPU, c1, cs1, c2, cs2, x, rstd, w, T, C, err, sizeof err),
                     0);
    const int rstd_same = memcmp(rstd, rstd_out, (size_t)T * sizeof(float)) == 0;
    const int64_t d_cuda = both_differing(&L1, &L2, g1, gs1, g2, gs2, r1, rs1, r2, rs2);
    const int64_t d_cpu = both_differing(&L1, &L2, g1, gs1, g2, gs2, c1, cs1, c2, cs2);
    // a NaN in x: the call returns 0 and the check names the op, row 5 and column 17
    x[5 * C + 17] = NAN;
    float *bad_d = gpucheck_to_device(x, (size_t)n * sizeof(float));
    char err_gpu[256] = "";
    const int rc_call = fp8_quantize_rmsnorm_both_layouts(DEVICE_CUDA, q1_d, s1_d, q2_d, s2_d, bad_d, rstd_d, w_d, T, C,
                                                          err_gpu, sizeof err_gpu);
    const int rc_gpu = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
    const int named = strstr(err_gpu, "fp8_quantize_rmsnorm_both_layouts") != NULL &&
                      strstr(err_gpu, "row 5, column 17") != NULL;
    const int pass_ok = rstd_same && d_cuda == 0 && d_cpu == 0 && rc_call == 0 && rc_gpu == -1 && named;
    printf("%-18s %4d x %-5d rstd without out %s; differing bytes and scales (both layouts) from rmsnorm_forward + "
           "quantize_both %lld, from the CPU op %lld; NaN at (5, 17): \"%s\"  %s\n", "quantize_rmsnorm", T, C,
           rstd_same ? "bitwise equal" : "DIFFERS", (long long)d_cuda, (long long)d_cpu, err_gpu,
           pass_ok ? "ok" : "FAIL");
    fflush(stdout);
    assert_true(pass_ok);
    device_free(DEVICE_CUDA, x_d), device_free(DEVICE_CUDA, w_d), device_free(DEVICE_CUDA, xn_d);
    device_free(DEVICE_CUDA, rstd_d), device_free(DEVICE_CUDA, rstd_out_d), device_free(DEVICE_CUDA, bad_d);
    device_free(DEVICE_CUDA, q1_d), device_free(DEVICE_CUDA, q2_d), device_free(DEVICE_CUDA, r1_d);
    device_free(DEVICE_CUDA, r2_d), device_free(DEVICE_CUDA, s1_d), device_free(DEVICE_CUDA, s2_d);
    device_free(DEVICE_CUDA, rs1_d), device_free(DEVICE_CUDA, rs2_d);
    free(x), free(w), free(rstd), free(rstd_out), free(g1), free(g2), free(r1), free(r2), free(gs1), free(gs2);
    free(rs1), free(rs2), free(c1), free(c2), free(cs1), free(cs2);
}

// The grouped quantisers (the routed experts' segments in one launch) against the CPU's grouped ones,
// which test_fp8 checks against the plain quantisers segment by segment: every byte and scale of the
// 1x128, 128x1 and both-layouts outputs, padding included, bit-identical. Segment lists with empty
// segments, lengths off 16 and 128, and an expert-like split of 3000 rows into 32 segments.
typedef struct {
    int n_seg, C, seed;
} GroupedCase;

static void test_quantize_grouped(void **state) {
    const GroupedCase *gc = *state;
    const int n = gc->n_seg, C = gc->C, KB = ceil_div(C, FP8_TILE), Kp = KB * FP8_TILE;
    int rows0[FP8_MAX_SEGMENTS + 1] = {0};
    uint64_t r = 0x9E3779B97F4A7C15ull * (uint64_t)gc->seed;
    for (int g = 0; g < n; g++) {  // lengths 0..190, every fifth segment empty
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        rows0[g + 1] = rows0[g] + (g % 5 == 1 ? 0 : (int)((r >> 33) % 191));
    }
    int p16 = 0, tiles = 0;
    for (int g = 0; g < n; g++) p16 += ceil_div(rows0[g + 1] - rows0[g], 16) * 16, tiles += ceil_div(rows0[g + 1] - rows0[g], FP8_TILE);
    const int T = rows0[n];
    const size_t b1 = (size_t)p16 * Kp, n1 = (size_t)KB * p16, b2 = (size_t)C * tiles * FP8_TILE, n2 = (size_t)tiles * C;
    float *x = floats((int64_t)T * C);
    fill_log_uniform(x, (int64_t)T * C, 4000 + (uint64_t)gc->seed, -16.0, 4.0);
    float *x_d = gpucheck_to_device(x, (size_t)T * C * sizeof(float));
    // k = 3, 4: the 1x128 and 128x1 forms reading their rows through an index (x_rows, with repeats, as the
    // routed experts' token rows) from a source of S rows
    const int S = T / 3 + 7;
    int *x_rows = gpucheck_malloc((size_t)(T + 1) * sizeof(int));
    for (int i = 0; i < T; i++) r = r * 6364136223846793005ull + 1442695040888963407ull, x_rows[i] = (int)((r >> 33) % (uint64_t)S);
    float *src = floats((int64_t)S * C);
    fill_log_uniform(src, (int64_t)S * C, 4100 + (uint64_t)gc->seed, -16.0, 4.0);
    float *src_d = gpucheck_to_device(src, (size_t)S * C * sizeof(float));
    int *x_rows_d = gpucheck_to_device(x_rows, (size_t)(T + 1) * sizeof(int));
    char err[256] = "";
    // k = 5: the 1x128 rows through the index copied from src's own 1x128 operand (fp8_gather_1x128_grouped), against
    // the CPU quantising the gathered rows
    const int S16 = ceil_div(S, 16) * 16;
    uint8_t *qs_d = gpu_poisoned((size_t)S16 * Kp);
    float *ss_d = gpu_poisoned((size_t)KB * S16 * sizeof(float));
    assert_int_equal(fp8_quantize_1x128(DEVICE_CUDA, qs_d, ss_d, src_d, S, C, err, sizeof err), 0);
    int diff[6] = {0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 6; k++) {
        uint8_t *q1 = host_poisoned(b1), *q2 = host_poisoned(b2);
        float *s1 = host_poisoned(n1 * sizeof(float)), *s2 = host_poisoned(n2 * sizeof(float));
        uint8_t *q1_d = gpu_poisoned(b1), *q2_d = gpu_poisoned(b2);
        float *s1_d = gpu_poisoned(n1 * sizeof(float)), *s2_d = gpu_poisoned(n2 * sizeof(float));
        if (k == 0) {
            assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, x, NULL, n, rows0, C, err, sizeof err), 0);
            assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CUDA, q1_d, s1_d, x_d, NULL, n, rows0, C, err, sizeof err), 0);
        } else if (k == 1) {
            assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CPU, q2, s2, x, NULL, n, rows0, C, err, sizeof err), 0);
            assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, q2_d, s2_d, x_d, NULL, n, rows0, C, err, sizeof err), 0);
        } else if (k == 2) {
            assert_int_equal(fp8_quantize_both_layouts_grouped(DEVICE_CPU, q1, s1, q2, s2, x, n, rows0, C, err, sizeof err), 0);
            assert_int_equal(fp8_quantize_both_layouts_grouped(DEVICE_CUDA, q1_d, s1_d, q2_d, s2_d, x_d, n, rows0, C, err,
                                                               sizeof err), 0);
        } else if (k == 3) {
            assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, src, x_rows, n, rows0, C, err, sizeof err), 0);
            assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CUDA, q1_d, s1_d, src_d, x_rows_d, n, rows0, C, err,
                                                        sizeof err), 0);
        } else if (k == 4) {
            assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CPU, q2, s2, src, x_rows, n, rows0, C, err,
                                                                   sizeof err), 0);
            assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, q2_d, s2_d, src_d, x_rows_d, n, rows0, C,
                                                                   err, sizeof err), 0);
        } else {
            assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CPU, q1, s1, src, x_rows, n, rows0, C, err, sizeof err), 0);
            fp8_gather_1x128_grouped(DEVICE_CUDA, q1_d, s1_d, qs_d, ss_d, S, x_rows_d, n, rows0, C);
        }
        assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
        uint8_t *g1 = gpucheck_to_host(q1_d, b1), *g2 = gpucheck_to_host(q2_d, b2);
        float *gs1 = gpucheck_to_host(s1_d, n1 * sizeof(float)), *gs2 = gpucheck_to_host(s2_d, n2 * sizeof(float));
        if (k == 0 || k == 2 || k == 3 || k == 5) diff[k] += count_diff(g1, q1, b1) + count_diff(gs1, s1, n1 * sizeof(float));
        if (k == 1 || k == 2 || k == 4) diff[k] += count_diff(g2, q2, b2) + count_diff(gs2, s2, n2 * sizeof(float));
        device_free(DEVICE_CUDA, q1_d), device_free(DEVICE_CUDA, q2_d), device_free(DEVICE_CUDA, s1_d), device_free(DEVICE_CUDA, s2_d);
        free(q1), free(q2), free(s1), free(s2), free(g1), free(g2), free(gs1), free(gs2);
    }
    const int all = diff[0] + diff[1] + diff[2] + diff[3] + diff[4] + diff[5];
    printf("%-18s %2d segments, %4d rows x %-5d differing bytes vs CPU: 1x128 %d, 128x1 %d, both %d, through an index: "
           "1x128 %d, 128x1 %d, 1x128 gathered from the source's operand %d  %s\n", "quantize_grouped", n, T, C,
           diff[0], diff[1], diff[2], diff[3], diff[4], diff[5], all == 0 ? "ok" : "FAIL");
    device_free(DEVICE_CUDA, x_d), device_free(DEVICE_CUDA, src_d), device_free(DEVICE_CUDA, x_rows_d);
    device_free(DEVICE_CUDA, qs_d), device_free(DEVICE_CUDA, ss_d);
    free(x), free(src), free(x_rows);
    assert_int_equal(all, 0);
}

// ---------------------------------------------------------------------------- SwiGLU values quantised as read
// kernels.h fp8_quantize_swiglu_*: the FFN gate's value (h = silu(a) * b, or da / db of swiglu_backward)
// computed where it is quantised, with the bits the grouped quantiser of the same name gives an array holding
// it. Two comparisons per op and value:
//  (a) against the CUDA composition (swiglu_forward / swiglu_backward on the GPU into an array, then the CUDA
//      grouped quantiser): the same value bits by contract, so every byte and scale BITWISE identical;
//  (b) against the CPU's fused op on the same inputs. The CPU SwiGLU takes its sigmoid from libm's exp and CUDA's
//      from expf (within 2 ulp), so a value may differ by a few ulp (more where da's silu'(a) nearly cancels,
//      around a = -1.28) and an E4M3 code can round the other way, or a tile's amax (so its scale) move by an
//      ulp. Per valid element the dequantised values (code decoded times scale) must then agree to one E4M3 step
//      at the element's magnitude plus the scale ratio:
//        |v_gpu - v_cpu| <= (2^-3 m + 2^-9 s_max)(1 + rho) + m rho,   m = max(|v_gpu|, |v_cpu|),
//                                                                        rho = s_max / s_min - 1
//      (the step between adjacent E4M3 codes is at most 2^-3 of the larger value among normals and 2^-9 among
//      subnormals, in units of the scale; with codes Q and scales s, |Qg sg - Qc sc| <= |Qg - Qc| s_max +
//      |Qc| |sg - sc|, and Q s_max <= m (1 + rho)); every scale within
//      2^-10 relative of the CPU's (a few ulp expected; the bound keeps the scale-ratio term above from hiding a
//      wrong scale); at least 99% of the valid elements' codes identical (the few-ulp differences move a code
//      only near a rounding boundary); the padding (codes 0, scales 1) identical; no poison left.
typedef enum { SWQ_1X128, SWQ_128X1, SWQ_BOTH } SwigluQuant;
static const char *const swq_ops[] = {"fp8_quantize_swiglu_1x128_grouped", "fp8_quantize_swiglu_128x1_transposed_grouped",
                                      "fp8_quantize_swiglu_both_layouts_grouped"};
static const char *const swq_names[] = {"1x128", "128x1_T", "both"};
static const char *const swiglu_value_names[] = {"OUT", "DA", "DB"};

// The grouped operands of segments rows0 (width C) as kernels.h lays them out: segment g's 1x128 operand is rows
// p16[g] .. of (P16, Kp), its scales (KB, R16_g) at s1 + KB p16[g]; its 128x1 operand (C, Tp_g) at q2 + C 128 tb[g],
// its scales (TB_g, C) at s2 + C tb[g]. Sizes in bytes of q and counts of scales.
typedef struct {
    int n_seg, C, KB, Kp;
    const int *rows0;
    int p16[FP8_MAX_SEGMENTS + 1], tb[FP8_MAX_SEGMENTS + 1];
    size_t q1, s1, q2, s2;
} SegLayout;

static SegLayout seg_layout(int n_seg, const int *rows0, int C) {
    SegLayout L = {.n_seg = n_seg, .C = C, .KB = ceil_div(C, FP8_TILE), .rows0 = rows0};
    L.Kp = L.KB * FP8_TILE;
    L.p16[0] = L.tb[0] = 0;
    for (int g = 0; g < n_seg; g++) {
        const int T = rows0[g + 1] - rows0[g];
        L.p16[g + 1] = L.p16[g] + ceil_div(T, 16) * 16, L.tb[g + 1] = L.tb[g] + ceil_div(T, FP8_TILE);
    }
    L.q1 = (size_t)L.p16[n_seg] * L.Kp, L.s1 = (size_t)L.KB * L.p16[n_seg];
    L.q2 = (size_t)C * FP8_TILE * L.tb[n_seg], L.s2 = (size_t)C * L.tb[n_seg];
    return L;
}

// a, b or dout as the SwiGLU quantisers take them (kernels.h: w1's and w3's Fprop products and w2's Dgrad product,
// BF16 bits with row stride
// round_up(C, 128)) from x (rows x C, on dev), whose values the tests make BF16 values first (bf16_round) so that
// the CUDA composition on x sees the same numbers. The padding columns hold a NaN, which a read of them would report.
// Where x does not start 16-byte aligned (a case's offset), the copy starts 4 bytes into its buffer too, so the
// kernels take their scalar loads. *base gets the buffer (gate_free); NULL stays NULL.
static uint16_t *gate_bf16(Device dev, const float *x, int rows, int C, void **base) {
    *base = NULL;
    if (x == NULL) return NULL;
    const size_t ld = (size_t)ceil_div(C, FP8_TILE) * FP8_TILE, n = (size_t)rows * ld;
    const size_t offset = (uintptr_t)x % 16 ? 2 : 0;
    const float *xh = dev == DEVICE_CUDA ? gpucheck_to_host(x, (size_t)rows * C * sizeof(float)) : x;
    uint16_t *g = gpucheck_malloc((n + offset) * sizeof(uint16_t));
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t c = 0; c < ld; c++)
            g[offset + r * ld + c] = c < (size_t)C ? float_to_bf16(xh[r * C + c]) : 0x7FC0;
    if (dev == DEVICE_CPU) return *base = g, g + offset;
    free((void *)xh);
    *base = gpucheck_to_device(g, (n + offset) * sizeof(uint16_t));
    free(g);
    return (uint16_t *)*base + offset;
}

static void gate_free(Device dev, void *base) {
    if (base != NULL && dev == DEVICE_CUDA) device_free(DEVICE_CUDA, base);  // after the call: cudaFree waits for it
    else free(base);
}

// The fused op `which` (1x128: q1, s1; 128x1: q2, s2; both: all four) on a and b given to it in BF16 (gate_bf16),
// given NULL for the input its value does not read (dout for OUT, b for DB), so reading it would fault.
static int run_swiglu_quant(Device dev, SwigluQuant which, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                            SwigluValue value, const float *dout32, const float *a32, const float *b32,
                            const SegLayout *L, char *err, size_t err_size) {
    if (value == SWIGLU_OUT) dout32 = NULL;
    if (value == SWIGLU_DB) b32 = NULL;
    void *a_base, *b_base, *d_base;
    const int rows = L->rows0[L->n_seg];
    const uint16_t *a = gate_bf16(dev, a32, rows, L->C, &a_base), *b = gate_bf16(dev, b32, rows, L->C, &b_base);
    const uint16_t *dout = gate_bf16(dev, dout32, rows, L->C, &d_base);
    int rc;
    switch (which) {
    case SWQ_1X128:
        rc = fp8_quantize_swiglu_1x128_grouped(dev, q1, s1, value, dout, a, b, L->n_seg, L->rows0, L->C, err, err_size);
        break;
    case SWQ_128X1:
        rc = fp8_quantize_swiglu_128x1_transposed_grouped(dev, q2, s2, value, dout, a, b, L->n_seg, L->rows0, L->C, err,
                                                          err_size);
        break;
    default:
        rc = fp8_quantize_swiglu_both_layouts_grouped(dev, q1, s1, q2, s2, value, dout, a, b, L->n_seg, L->rows0, L->C,
                                                      err, err_size);
    }
    gate_free(dev, a_base), gate_free(dev, b_base), gate_free(dev, d_base);
    return rc;
}

// The contract's composition on the GPU: the value into v_d by the CUDA SwiGLU op, then the CUDA grouped quantiser.
static int run_swiglu_composed(SwigluQuant which, uint8_t *q1, float *s1, uint8_t *q2, float *s2, float *v_d,
                               SwigluValue value, const float *dout, const float *a, const float *b, const SegLayout *L,
                               char *err, size_t err_size) {
    const int64_t n = (int64_t)L->rows0[L->n_seg] * L->C;
    if (value == SWIGLU_OUT) swiglu_forward(DEVICE_CUDA, v_d, a, b, n);
    else if (value == SWIGLU_DA) swiglu_backward(DEVICE_CUDA, v_d, NULL, dout, a, b, n);
    else swiglu_backward(DEVICE_CUDA, NULL, v_d, dout, a, b, n);
    switch (which) {
    case SWQ_1X128:
        return fp8_quantize_1x128_grouped(DEVICE_CUDA, q1, s1, v_d, NULL, L->n_seg, L->rows0, L->C, err, err_size);
    case SWQ_128X1:
        return fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, q2, s2, v_d, NULL, L->n_seg, L->rows0, L->C, err,
                                                     err_size);
    default:
        return fp8_quantize_both_layouts_grouped(DEVICE_CUDA, q1, s1, q2, s2, v_d, L->n_seg, L->rows0, L->C, err,
                                                 err_size);
    }
}

// Comparison (b) of one GPU operand with the CPU's, accumulated over the operands of a call.
typedef struct {
    int64_t valid, same;  // valid elements; those with the same code on both
    int64_t pad_diff;     // differing bytes outside the valid elements
    int64_t s_diff;       // scales not bit-identical
    int64_t unwritten;    // poison left in the GPU operand (0xFF bytes: the E4M3 NaN, never a code; NaN scales)
    double worst, worst_s;  // max |v_gpu - v_cpu| / tolerance; max |s_gpu / s_cpu - 1|
} DequantCmp;

static void compare_dequant(DequantCmp *d, const SegLayout *L, int transposed, const uint8_t *qg, const float *sg,
                            const uint8_t *qc, const float *sc) {
    double lut[256];
    for (int i = 0; i < 256; i++) lut[i] = e4m3_value((uint8_t)i);
    const size_t qn = transposed ? L->q2 : L->q1, sn = transposed ? L->s2 : L->s1;
    const int C = L->C;
    uint8_t *valid = calloc(qn > 0 ? qn : 1, 1);
    for (int g = 0; g < L->n_seg; g++) {
        const int T = L->rows0[g + 1] - L->rows0[g], R16 = ceil_div(T, 16) * 16, Tp = ceil_div(T, FP8_TILE) * FP8_TILE;
        for (int i = 0; i < T; i++)
            for (int c = 0; c < C; c++) {
                size_t qi, si;
                if (transposed) {
                    qi = (size_t)C * FP8_TILE * L->tb[g] + (size_t)c * Tp + i;
                    si = (size_t)C * L->tb[g] + (size_t)(i / FP8_TILE) * C + c;
                } else {
                    qi = (size_t)L->Kp * (L->p16[g] + i) + c;
                    si = (size_t)L->KB * L->p16[g] + (size_t)(c / FP8_TILE) * R16 + i;
                }
                valid[qi] = 1;
                const double vg = lut[qg[qi]] * sg[si], vc = lut[qc[qi]] * sc[si];
                const double m = fmax(fabs(vg), fabs(vc)), smax = fmax(sg[si], sc[si]), smin = fmin(sg[si], sc[si]);
                const double rho = (smax - smin) / smin;
                double r = fabs(vg - vc) / ((0x1p-3 * m + 0x1p-9 * smax) * (1.0 + rho) + m * rho);
                if (isnan(r)) r = INFINITY;  // a NaN code or scale
                if (r > d->worst) d->worst = r;
                d->valid++, d->same += qg[qi] == qc[qi];
            }
    }
    for (size_t i = 0; i < qn; i++) d->pad_diff += !valid[i] && qg[i] != qc[i], d->unwritten += qg[i] == 0xFF;
    for (size_t i = 0; i < sn; i++) {
        double r = fabs((double)sg[i] / sc[i] - 1.0);
        if (isnan(r)) r = INFINITY;
        if (r > d->worst_s) d->worst_s = r;
        d->s_diff += memcmp(&sg[i], &sc[i], sizeof(float)) != 0, d->unwritten += isnan(sg[i]);
    }
    free(valid);
}

// Segment layouts (host rows0), a width, and which inputs start 4 bytes into their device buffers (bit 0: a; bit 1:
// b and dout), so that the fused kernels take their scalar loads; a width that is not a multiple of 4 does too.
typedef struct {
    int n_seg;
    const int *rows0;
    int C, offset, seed;
} SwigluCase;

static void test_quantize_swiglu(void **state) {
    const SwigluCase *sc = *state;
    const SegLayout L = seg_layout(sc->n_seg, sc->rows0, sc->C);
    const int T = sc->rows0[sc->n_seg], C = sc->C;
    const int64_t n = (int64_t)T * C;
    // |a| over 2^-8 .. 2^4: sigmoid from ~0 to ~1, silu' through its zero; b and dout over many binades, so tiles
    // reach E4M3 subnormals and values that round to zero. Never zero.
    float *a = floats(n), *b = floats(n), *dout = floats(n);
    fill_log_uniform(a, n, 5000 + (uint64_t)sc->seed, -8.0, 4.0);
    fill_log_uniform(b, n, 5100 + (uint64_t)sc->seed, -12.0, 2.0);
    fill_log_uniform(dout, n, 5200 + (uint64_t)sc->seed, -20.0, 0.0);
    for (int64_t i = 0; i < n; i++)  // the fused ops read BF16
        a[i] = bf16_round(a[i]), b[i] = bf16_round(b[i]), dout[i] = bf16_round(dout[i]);
    float *a_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    float *b_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    float *g_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    const int off_a = sc->offset & 1, off_b = (sc->offset >> 1) & 1;
    float *a_d = a_base + off_a, *b_d = b_base + off_b, *dout_d = g_base + off_b;
    device_memcpy_from_host(DEVICE_CUDA, a_d, a, (size_t)n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, b_d, b, (size_t)n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, dout_d, dout, (size_t)n * sizeof(float));
    float *v_d = device_alloc(DEVICE_CUDA, (size_t)(n > 0 ? n : 1) * sizeof(float));
    char where[96];
    snprintf(where, sizeof where, "%d seg %4d x %-4d%s", sc->n_seg, T, C,
             sc->offset == 1 ? " a+4B" : sc->offset == 2 ? " b,dout+4B" : "");
    int all_pass = 1;
    for (int value = SWIGLU_OUT; value <= SWIGLU_DB; value++) {
        for (int which = SWQ_1X128; which <= SWQ_BOTH; which++) {
            const int has1 = which != SWQ_128X1, has2 = which != SWQ_1X128;
            char err[256] = "";
            // CPU fused, CUDA fused (f*) and CUDA composition (c*), all outputs poisoned first
            uint8_t *q1 = host_poisoned(L.q1), *q2 = host_poisoned(L.q2);
            float *s1 = host_poisoned(L.s1 * sizeof(float)), *s2 = host_poisoned(L.s2 * sizeof(float));
            uint8_t *fq1_d = gpu_poisoned(L.q1), *fq2_d = gpu_poisoned(L.q2), *cq1_d = gpu_poisoned(L.q1);
            uint8_t *cq2_d = gpu_poisoned(L.q2);
            float *fs1_d = gpu_poisoned(L.s1 * sizeof(float)), *fs2_d = gpu_poisoned(L.s2 * sizeof(float));
            float *cs1_d = gpu_poisoned(L.s1 * sizeof(float)), *cs2_d = gpu_poisoned(L.s2 * sizeof(float));
            const int rc_cpu = run_swiglu_quant(DEVICE_CPU, (SwigluQuant)which, q1, s1, q2, s2, (SwigluValue)value,
                                                dout, a, b, &L, err, sizeof err);
            const int rc_fused = run_swiglu_quant(DEVICE_CUDA, (SwigluQuant)which, fq1_d, fs1_d, fq2_d, fs2_d,
                                                  (SwigluValue)value, dout_d, a_d, b_d, &L, err, sizeof err);
            const int rc_comp = run_swiglu_composed((SwigluQuant)which, cq1_d, cs1_d, cq2_d, cs2_d, v_d,
                                                    (SwigluValue)value, dout_d, a_d, b_d, &L, err, sizeof err);
            const int rc_check = fp8_check_finite(DEVICE_CUDA, err, sizeof err);
            uint8_t *fq1 = gpucheck_to_host(fq1_d, L.q1), *fq2 = gpucheck_to_host(fq2_d, L.q2);
            uint8_t *cq1 = gpucheck_to_host(cq1_d, L.q1), *cq2 = gpucheck_to_host(cq2_d, L.q2);
            float *fs1 = gpucheck_to_host(fs1_d, L.s1 * sizeof(float)), *fs2 = gpucheck_to_host(fs2_d, L.s2 * sizeof(float));
            float *cs1 = gpucheck_to_host(cs1_d, L.s1 * sizeof(float)), *cs2 = gpucheck_to_host(cs2_d, L.s2 * sizeof(float));
            // (a) bitwise against the CUDA composition
            int64_t diff_comp = 0;
            if (has1) diff_comp += count_diff(fq1, cq1, L.q1) + count_diff(fs1, cs1, L.s1 * sizeof(float));
            if (has2) diff_comp += count_diff(fq2, cq2, L.q2) + count_diff(fs2, cs2, L.s2 * sizeof(float));
            // (b) dequantised against the CPU's fused op
            DequantCmp d = {0, 0, 0, 0, 0, 0.0, 0.0};
            if (has1) compare_dequant(&d, &L, 0, fq1, fs1, q1, s1);
            if (has2) compare_dequant(&d, &L, 1, fq2, fs2, q2, s2);
            const double same = d.valid > 0 ? (double)d.same / (double)d.valid : 1.0;
            const int pass = rc_cpu == 0 && rc_fused == 0 && rc_comp == 0 && rc_check == 0 && diff_comp == 0 &&
                             d.worst <= 1.0 && d.worst_s <= 0x1p-10 && same >= 0.99 && d.pad_diff == 0 &&
                             d.unwritten == 0;
            printf("%-18s %-3s %-7s %-24s vs CUDA composition: %lld differing bytes; vs CPU: codes equal %.4f%%, "
                   "scales differing %lld (max rel %.2g), worst |dv|/tol %.3f, padding differing %lld, poison left "
                   "%lld%s  %s\n",
                   "quantize_swiglu", swiglu_value_names[value], swq_names[which], where, (long long)diff_comp,
                   100.0 * same, (long long)d.s_diff, d.worst_s, d.worst, (long long)d.pad_diff,
                   (long long)d.unwritten, rc_cpu || rc_fused || rc_comp || rc_check ? "; an op reported an error" : "",
                   pass ? "ok" : "FAIL");
            if (rc_cpu || rc_fused || rc_comp || rc_check)
                printf("    rc cpu %d, cuda fused %d, cuda composition %d, fp8_check_finite %d: \"%s\"\n", rc_cpu,
                       rc_fused, rc_comp, rc_check, err);
            fflush(stdout);
            all_pass &= pass;
            device_free(DEVICE_CUDA, fq1_d), device_free(DEVICE_CUDA, fq2_d), device_free(DEVICE_CUDA, cq1_d);
            device_free(DEVICE_CUDA, cq2_d), device_free(DEVICE_CUDA, fs1_d), device_free(DEVICE_CUDA, fs2_d);
            device_free(DEVICE_CUDA, cs1_d), device_free(DEVICE_CUDA, cs2_d);
            free(q1), free(q2), free(s1), free(s2), free(fq1), free(fq2), free(cq1), free(cq2);
            free(fs1), free(fs2), free(cs1), free(cs2);
        }
    }
    device_free(DEVICE_CUDA, a_base), device_free(DEVICE_CUDA, b_base), device_free(DEVICE_CUDA, g_base);
    device_free(DEVICE_CUDA, v_d);
    free(a), free(b), free(dout);
    assert_true(all_pass);
}

// The segments of the SwiGLU non-finite tests (one empty; the third ends in a partial tile) and their gate inputs
// a, b, dout (rows x C) on the host and on the device.
static const int nonfinite_rows0[] = {0, 37, 37, 200, 333};
typedef struct {
    int64_t n;
    float *a, *b, *dout, *a_d, *b_d, *dout_d;
} GateInputs;
static GateInputs gate_inputs(SegLayout L) {
    GateInputs g;
    g.n = (int64_t)L.rows0[L.n_seg] * L.C;
    g.a = floats(g.n), g.b = floats(g.n), g.dout = floats(g.n);
    g.a_d = device_alloc(DEVICE_CUDA, (size_t)g.n * sizeof(float));
    g.b_d = device_alloc(DEVICE_CUDA, (size_t)g.n * sizeof(float));
    g.dout_d = device_alloc(DEVICE_CUDA, (size_t)g.n * sizeof(float));
    return g;
}
// The host values over many binades, from seeds seed, seed + 1, seed + 2 (a test then plants its bad elements).
static void gate_inputs_fill(GateInputs *g, uint64_t seed) {
    fill_log_uniform(g->a, g->n, seed, -8.0, 4.0);
    fill_log_uniform(g->b, g->n, seed + 1, -12.0, 2.0);
    fill_log_uniform(g->dout, g->n, seed + 2, -20.0, 0.0);
}
static void gate_inputs_upload(const GateInputs *g) {
    device_memcpy_from_host(DEVICE_CUDA, g->a_d, g->a, (size_t)g->n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, g->b_d, g->b, (size_t)g->n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, g->dout_d, g->dout, (size_t)g->n * sizeof(float));
}
static void gate_inputs_free(GateInputs *g) {
    device_free(DEVICE_CUDA, g->a_d), device_free(DEVICE_CUDA, g->b_d), device_free(DEVICE_CUDA, g->dout_d);
    free(g->a), free(g->b), free(g->dout);
}

// A non-finite SwiGLU value on the GPU: the call returns 0 (kernels.h: the check is deferred) and fp8_check_finite
// then returns -1 naming the op, the shape and the first bad element (row of the segments' rows, column), as the
// CPU op's -1 does; a second check finds nothing. Two ways to get one: a NaN in a (two of them: the first in
// row-major order is named), and finite inputs whose value overflows FP32 (a = b = dout = 1e20: h, da and db are
// ~1e40), which the kernel must catch on the value it computed, not on its inputs. A check before each call clears
// the call log, so that the call's own return is 0 (every 4096th call checks the ones before it).
static void test_quantize_swiglu_nonfinite(void **state) {
    (void)state;
    const SegLayout L = seg_layout(4, nonfinite_rows0, 200);
    const int C = L.C;
    GateInputs in = gate_inputs(L);
    float *a = in.a, *b = in.b, *dout = in.dout, *a_d = in.a_d, *b_d = in.b_d, *dout_d = in.dout_d;
    uint8_t *q1_d = gpu_poisoned(L.q1), *q2_d = gpu_poisoned(L.q2);
    float *s1_d = gpu_poisoned(L.s1 * sizeof(float)), *s2_d = gpu_poisoned(L.s2 * sizeof(float));
    uint8_t *q1 = host_poisoned(L.q1), *q2 = host_poisoned(L.q2);
    float *s1 = host_poisoned(L.s1 * sizeof(float)), *s2 = host_poisoned(L.s2 * sizeof(float));
    int all_pass = 1;
    for (int value = SWIGLU_OUT; value <= SWIGLU_DB; value++) {
        for (int which = SWQ_1X128; which <= SWQ_BOTH; which++) {
            for (int overflow = 0; overflow < 2; overflow++) {
                gate_inputs_fill(&in, 5300);
                int r = 250, c = 77;  // in the fourth segment (rows 200..332)
                if (overflow) {
                    r = 120, c = 199;  // the third segment, the last column (in the partial tile)
                    a[(int64_t)r * C + c] = b[(int64_t)r * C + c] = dout[(int64_t)r * C + c] = 1e20f;
                } else {
                    a[(int64_t)300 * C + 5] = NAN;  // later in row-major order: not the one named
                    a[(int64_t)r * C + c] = NAN;
                }
                gate_inputs_upload(&in);
                char err_gpu[256] = "", err_cpu[256] = "", err_again[256] = "", want[64];
                const int rc_before = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
                const int rc_call = run_swiglu_quant(DEVICE_CUDA, (SwigluQuant)which, q1_d, s1_d, q2_d, s2_d,
                                                     (SwigluValue)value, dout_d, a_d, b_d, &L, err_gpu, sizeof err_gpu);
                const int rc_gpu = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
                const int rc_again = fp8_check_finite(DEVICE_CUDA, err_again, sizeof err_again);
                const int rc_cpu = run_swiglu_quant(DEVICE_CPU, (SwigluQuant)which, q1, s1, q2, s2, (SwigluValue)value,
                                                    dout, a, b, &L, err_cpu, sizeof err_cpu);
                snprintf(want, sizeof want, "row %d, column %d", r, c);
                const int named = strstr(err_gpu, swq_ops[which]) != NULL && strstr(err_gpu, want) != NULL &&
                                  strstr(err_gpu, "(333, 200)") != NULL && strstr(err_cpu, want) != NULL;
                const int pass =
                    rc_before == 0 && rc_call == 0 && rc_gpu == -1 && rc_again == 0 && rc_cpu == -1 && named;
                printf("%-18s %-3s %-7s %-24s rc call %d, check %d then %d, cpu %d; gpu: \"%s\"  %s\n",
                       "quantize_swiglu", swiglu_value_names[value], swq_names[which],
                       overflow ? "value overflows (120,199)" : "NaN in a at (250, 77)", rc_call, rc_gpu, rc_again,
                       rc_cpu, err_gpu, pass ? "ok" : "FAIL");
                fflush(stdout);
                all_pass &= pass;
            }
        }
    }
    gate_inputs_free(&in);
    device_free(DEVICE_CUDA, q1_d), device_free(DEVICE_CUDA, q2_d), device_free(DEVICE_CUDA, s1_d);
    device_free(DEVICE_CUDA, s2_d);
    free(q1), free(q2), free(s1), free(s2);
    assert_true(all_pass);
}

// ---------------------------------------------------------------------------- both SwiGLU gradients in one pass
// kernels.h fp8_quantize_swiglu_grads_both_layouts_grouped: da and db from one read of dout, a, b, each BITWISE what
// the CUDA fp8_quantize_swiglu_both_layouts_grouped(SWIGLU_DA / SWIGLU_DB) writes - every byte of q and every scale,
// padding included, both sides poisoned first (0xFF: the E4M3 NaN code, NaN scales), and no poison left - on the
// segment layouts, widths and input offsets of test_quantize_swiglu (the scalar-load kernel where an input is 4 bytes
// into its buffer or C = 202; the pipelined kernel at whole column tiles and aligned rows) and on one of about ten
// tiles per block of the pipelined kernel. test_quantize_swiglu ties those two calls to the composition and to the CPU.
typedef struct {
    uint8_t *qa1, *qa2, *qb1, *qb2;
    float *sa1, *sa2, *sb1, *sb2;
} GradOperands;

static GradOperands grad_operands_poisoned(Device dev, const SegLayout *L) {
    void *(*poisoned)(size_t) = dev == DEVICE_CUDA ? gpu_poisoned : host_poisoned;
    return (GradOperands){poisoned(L->q1), poisoned(L->q2), poisoned(L->q1), poisoned(L->q2),
                          poisoned(L->s1 * sizeof(float)), poisoned(L->s2 * sizeof(float)),
                          poisoned(L->s1 * sizeof(float)), poisoned(L->s2 * sizeof(float))};
}

static void grad_operands_free(Device dev, GradOperands *o) {
    void *all[] = {o->qa1, o->qa2, o->qb1, o->qb2, o->sa1, o->sa2, o->sb1, o->sb2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (dev == DEVICE_CUDA) device_free(DEVICE_CUDA, all[i]);
        else free(all[i]);
    }
}

static int run_swiglu_grads(Device dev, const GradOperands *o, const float *dout32, const float *a32, const float *b32,
                            const SegLayout *L, char *err, size_t err_size) {
    void *a_base, *b_base, *d_base;
    const int rows = L->rows0[L->n_seg];
    const uint16_t *a = gate_bf16(dev, a32, rows, L->C, &a_base), *b = gate_bf16(dev, b32, rows, L->C, &b_base);
    const uint16_t *dout = gate_bf16(dev, dout32, rows, L->C, &d_base);
    const int rc = fp8_quantize_swiglu_grads_both_layouts_grouped(dev, o->qa1, o->sa1, o->qa2, o->sa2, o->qb1, o->sb1,
                                                                  o->qb2, o->sb2, dout, a, b, L->n_seg, L->rows0, L->C,
                                                                  err, err_size);
    gate_free(dev, a_base), gate_free(dev, b_base), gate_free(dev, d_base);
    return rc;
}

// The two calls the joint op stands for, DA then DB (run_swiglu_quant gives DB NULL for b); the first nonzero rc.
static int run_swiglu_grads_separate(const GradOperands *o, const float *dout, const float *a, const float *b,
                                     const SegLayout *L, char *err, size_t err_size) {
    const int rc_da = run_swiglu_quant(DEVICE_CUDA, SWQ_BOTH, o->qa1, o->sa1, o->qa2, o->sa2, SWIGLU_DA, dout, a, b, L,
                                       err, err_size);
    const int rc_db = run_swiglu_quant(DEVICE_CUDA, SWQ_BOTH, o->qb1, o->sb1, o->qb2, o->sb2, SWIGLU_DB, dout, a, b, L,
                                       err, err_size);
    return rc_da ? rc_da : rc_db;
}

// Device buffers x and y (bytes) compared byte for byte; adds to *poison the poison left in x (0xFF codes of q, NaN
// scales).
static int64_t diff_device(const void *x_d, const void *y_d, size_t bytes, int scales, int64_t *poison) {
    uint8_t *x = gpucheck_to_host(x_d, bytes), *y = gpucheck_to_host(y_d, bytes);
    const int64_t diff = count_diff(x, y, bytes);
    if (scales) {
        for (size_t i = 0; i < bytes / sizeof(float); i++) *poison += isnan(((const float *)x)[i]);
    } else {
        for (size_t i = 0; i < bytes; i++) *poison += x[i] == 0xFF;
    }
    free(x), free(y);
    return diff;
}

static void test_quantize_swiglu_grads(void **state) {
    const SwigluCase *sc = *state;
    const SegLayout L = seg_layout(sc->n_seg, sc->rows0, sc->C);
    const int T = sc->rows0[sc->n_seg], C = sc->C;
    const int64_t n = (int64_t)T * C;
    // inputs as test_quantize_swiglu's (other seeds): never zero, da through silu's zero, tiles reaching subnormals
    float *a = floats(n), *b = floats(n), *dout = floats(n);
    fill_log_uniform(a, n, 5400 + (uint64_t)sc->seed, -8.0, 4.0);
    fill_log_uniform(b, n, 5500 + (uint64_t)sc->seed, -12.0, 2.0);
    fill_log_uniform(dout, n, 5600 + (uint64_t)sc->seed, -20.0, 0.0);
    for (int64_t i = 0; i < n; i++) a[i] = bf16_round(a[i]), b[i] = bf16_round(b[i]), dout[i] = bf16_round(dout[i]);
    float *a_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    float *b_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    float *g_base = device_alloc(DEVICE_CUDA, (size_t)(n + 1) * sizeof(float));
    const int off_a = sc->offset & 1, off_b = (sc->offset >> 1) & 1;
    float *a_d = a_base + off_a, *b_d = b_base + off_b, *dout_d = g_base + off_b;
    device_memcpy_from_host(DEVICE_CUDA, a_d, a, (size_t)n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, b_d, b, (size_t)n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, dout_d, dout, (size_t)n * sizeof(float));
    char where[96], err[256] = "";
    snprintf(where, sizeof where, "%d seg %4d x %-4d%s", sc->n_seg, T, C,
             sc->offset == 1 ? " a+4B" : sc->offset == 2 ? " b,dout+4B" : "");
    GradOperands joint = grad_operands_poisoned(DEVICE_CUDA, &L), sep = grad_operands_poisoned(DEVICE_CUDA, &L);
    const int rc_joint = run_swiglu_grads(DEVICE_CUDA, &joint, dout_d, a_d, b_d, &L, err, sizeof err);
    const int rc_sep = run_swiglu_grads_separate(&sep, dout_d, a_d, b_d, &L, err, sizeof err);
    const int rc_check = fp8_check_finite(DEVICE_CUDA, err, sizeof err);
    int64_t poison = 0, diff_a = 0, diff_b = 0;
    diff_a += diff_device(joint.qa1, sep.qa1, L.q1, 0, &poison) + diff_device(joint.qa2, sep.qa2, L.q2, 0, &poison);
    diff_a += diff_device(joint.sa1, sep.sa1, L.s1 * sizeof(float), 1, &poison) +
              diff_device(joint.sa2, sep.sa2, L.s2 * sizeof(float), 1, &poison);
    diff_b += diff_device(joint.qb1, sep.qb1, L.q1, 0, &poison) + diff_device(joint.qb2, sep.qb2, L.q2, 0, &poison);
    diff_b += diff_device(joint.sb1, sep.sb1, L.s1 * sizeof(float), 1, &poison) +
              diff_device(joint.sb2, sep.sb2, L.s2 * sizeof(float), 1, &poison);
    const int pass = rc_joint == 0 && rc_sep == 0 && rc_check == 0 && diff_a == 0 && diff_b == 0 && poison == 0;
    printf("%-18s %-7s %-24s vs the CUDA DA and DB calls: %lld, %lld differing bytes, poison left %lld%s  %s\n",
           "quantize_swiglu", "grads", where, (long long)diff_a, (long long)diff_b, (long long)poison,
           rc_joint || rc_sep || rc_check ? "; an op reported an error" : "", pass ? "ok" : "FAIL");
    if (rc_joint || rc_sep || rc_check)
        printf("    rc joint %d, separate %d, fp8_check_finite %d: \"%s\"\n", rc_joint, rc_sep, rc_check, err);
    fflush(stdout);
    grad_operands_free(DEVICE_CUDA, &joint), grad_operands_free(DEVICE_CUDA, &sep);
    device_free(DEVICE_CUDA, a_base), device_free(DEVICE_CUDA, b_base), device_free(DEVICE_CUDA, g_base);
    free(a), free(b), free(dout);
    assert_true(pass);
}

// A non-finite gradient on the GPU: the call returns 0 and fp8_check_finite then returns -1 with exactly the message
// of the two separate calls (checked after them the same way): the DA call's ("da of swiglu_backward") when da has a
// bad element, even after a bad db earlier in row-major order, else the DB call's; a second check finds nothing; the
// CPU op names the same element. Cases: a NaN in a (da and db NaN; two, the first named); a NaN in b (da only); db
// overflowing at (10, 3) before a NaN in b at (250, 77); only db overflowing (a = dout = 1e20, b = 0: da = 0, db =
// 1e40); and the NaN in a with the joint call made when the call log holds 4095 calls (of a finite tiny quantiser),
// so its two calls do not fit: it must check the earlier calls first (returning their 0) and log its own two anew.
static void test_quantize_swiglu_grads_nonfinite(void **state) {
    (void)state;
    const SegLayout L = seg_layout(4, nonfinite_rows0, 200);
    const int C = L.C;
    GateInputs in = gate_inputs(L);
    float *a = in.a, *b = in.b, *dout = in.dout, *a_d = in.a_d, *b_d = in.b_d, *dout_d = in.dout_d;
    GradOperands o_d = grad_operands_poisoned(DEVICE_CUDA, &L), o = grad_operands_poisoned(DEVICE_CPU, &L);
    // the tiny quantiser filling the log: one row of 4 ones
    const float ones[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    float *tx_d = gpucheck_to_device(ones, sizeof ones), *ts_d = device_alloc(DEVICE_CUDA, 16 * sizeof(float));
    uint8_t *tq_d = device_alloc(DEVICE_CUDA, 16 * FP8_TILE);
    enum { NAN_A, NAN_B, DB_EARLIER, DB_ONLY, NAN_A_LOG_FULL, LOG_FILL = 4095 };  // the log holds 4096 (kernels.h)
    static const char *const names[] = {"NaN in a (250, 77)", "NaN in b (250, 77)", "bad db (10,3), da (250,77)",
                                        "only db bad (120, 199)", "NaN in a, log at 4095"};
    int all_pass = 1;
    for (int kind = NAN_A; kind <= NAN_A_LOG_FULL; kind++) {
        gate_inputs_fill(&in, 5700);
        const int64_t at = (int64_t)250 * C + 77;
        int r = 250, c = 77, da_bad = 1;
        if (kind == NAN_A || kind == NAN_A_LOG_FULL) a[(int64_t)300 * C + 5] = NAN, a[at] = NAN;
        if (kind == NAN_B || kind == DB_EARLIER) b[at] = NAN;
        if (kind == DB_EARLIER) a[(int64_t)10 * C + 3] = dout[(int64_t)10 * C + 3] = 1e20f, b[(int64_t)10 * C + 3] = 0.0f;
        if (kind == DB_ONLY) {
            r = 120, c = 199, da_bad = 0;  // the third segment, the last column (in the partial tile)
            a[(int64_t)r * C + c] = dout[(int64_t)r * C + c] = 1e20f, b[(int64_t)r * C + c] = 0.0f;
        }
        gate_inputs_upload(&in);
        char err_sep[256] = "", err_gpu[256] = "", err_again[256] = "", err_cpu[256] = "", want[64];
        const int rc_before = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);  // an empty log
        const int rc_sep_call = run_swiglu_grads_separate(&o_d, dout_d, a_d, b_d, &L, err_sep, sizeof err_sep);
        const int rc_sep = fp8_check_finite(DEVICE_CUDA, err_sep, sizeof err_sep);
        int rc_fill = 0;
        if (kind == NAN_A_LOG_FULL)
            for (int i = 0; i < LOG_FILL; i++)
                rc_fill |= fp8_quantize_1x128(DEVICE_CUDA, tq_d, ts_d, tx_d, 1, 4, err_gpu, sizeof err_gpu);
        const int rc_call = run_swiglu_grads(DEVICE_CUDA, &o_d, dout_d, a_d, b_d, &L, err_gpu, sizeof err_gpu);
        const int rc_gpu = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
        const int rc_again = fp8_check_finite(DEVICE_CUDA, err_again, sizeof err_again);
        const int rc_cpu = run_swiglu_grads(DEVICE_CPU, &o, dout, a, b, &L, err_cpu, sizeof err_cpu);
        snprintf(want, sizeof want, "row %d, column %d", r, c);
        const char *tensor = da_bad ? "da of swiglu_backward" : "db of swiglu_backward";
        const int named = strcmp(err_gpu, err_sep) == 0 && strstr(err_gpu, want) != NULL &&
                          strstr(err_gpu, tensor) != NULL && strstr(err_gpu, "(333, 200)") != NULL &&
                          strstr(err_cpu, want) != NULL;
        const int pass = rc_before == 0 && rc_sep_call == 0 && rc_sep == -1 && rc_fill == 0 && rc_call == 0 &&
                         rc_gpu == -1 && rc_again == 0 && rc_cpu == -1 && named;
        printf("%-18s %-7s %-26s rc call %d, check %d then %d, cpu %d; gpu: \"%s\"  %s\n", "quantize_swiglu", "grads",
               names[kind], rc_call, rc_gpu, rc_again, rc_cpu, err_gpu, pass ? "ok" : "FAIL");
        if (!pass)
            printf("    the separate calls: rc %d, check %d: \"%s\"; the log filling calls: rc %d\n", rc_sep_call, rc_sep,
                   err_sep, rc_fill);
        fflush(stdout);
        all_pass &= pass;
    }
    gate_inputs_free(&in);
    device_free(DEVICE_CUDA, tx_d), device_free(DEVICE_CUDA, ts_d), device_free(DEVICE_CUDA, tq_d);
    grad_operands_free(DEVICE_CUDA, &o_d), grad_operands_free(DEVICE_CPU, &o);
    assert_true(all_pass);
}

// ---------------------------------------------------------------------------- the combine's gradient quantised through the plan
// kernels.h fp8_quantize_combine_grad_both_layouts_grouped: row s of the segments is topk_w[t,k] * dout[t] (one FP32
// product) for t = seg_token[s] and the k with slot_of[t*K + k] = s - the row moe_combine_backward writes into
// dexpert_out - quantised in both layouts without the array. The plan is built on the GPU (moe_permute_plan_device);
// rows0 is its seg_offsets, one segment per expert. Two comparisons, both BITWISE (every byte of q and every scale,
// padding included):
//  (a) against the CUDA composition the contract names (CUDA moe_combine_backward into dexpert_out, then the CUDA
//      both-layouts grouped quantiser);
//  (b) against the CPU op on the same inputs and plan: the product is one FP32 multiply on both, and the quantisers are
//      bit-exact, so nothing may differ.
// The GPU plan must also equal the CPU's moe_permute_plan (kernels.h), so that a difference is not put on the
// quantiser. Outputs are poisoned (0xFF: NaN scales, the E4M3 NaN code) and so is dexpert_out (NaN: a row the
// combine backward left unwritten makes the composition report a non-finite value).
static const char combine_grad_op[] = "fp8_quantize_combine_grad_both_layouts_grouped";

typedef struct {
    int N, K, E, C, offset, seed;  // offset: dout starts 4 bytes into its device buffer (scalar loads)
} CombineGradCase;

// The inputs on both sides: host topk_w (N, K) random positive, dout (N, C) random non-zero over many binades, and
// the routing plan built on the GPU from opcheck_routing's topk_idx, with host copies of it (rows0 = seg_offsets).
typedef struct {
    int N, K, E, C, empty;
    float *topk_w, *dout;                              // host
    int *rows0, *seg_token, *slot_of;                  // host copies of the GPU plan
    float *topk_w_d, *dout_d, *dout_base;              // device (dout_d = dout_base + offset)
    int *topk_idx_d, *seg_offsets_d, *seg_token_d, *slot_of_d;
    int plan_diff;                                     // differing ints between the GPU plan and moe_permute_plan
} CombineGradInputs;

static CombineGradInputs combine_grad_inputs(int N, int K, int E, int C, int offset, uint64_t seed) {
    CombineGradInputs in = {.N = N, .K = K, .E = E, .C = C, .empty = E / 2};
    const size_t NK = (size_t)N * K;
    int *topk_idx = gpucheck_malloc(NK * sizeof(int));
    opcheck_routing(topk_idx, N, K, E, in.empty, seed);
    in.topk_w = floats((int64_t)NK), in.dout = floats((int64_t)N * C);
    opcheck_fill(in.topk_w, NK, seed + 1, 1.0 / 64, 1.0);
    fill_log_uniform(in.dout, (int64_t)N * C, seed + 2, -20.0, 1.0);
    in.topk_idx_d = gpucheck_to_device(topk_idx, NK * sizeof(int));
    in.topk_w_d = gpucheck_to_device(in.topk_w, NK * sizeof(float));
    in.dout_base = device_alloc(DEVICE_CUDA, ((size_t)N * C + 4) * sizeof(float));
    in.dout_d = in.dout_base + (offset ? 1 : 0);
    device_memcpy_from_host(DEVICE_CUDA, in.dout_d, in.dout, (size_t)N * C * sizeof(float));
    in.seg_offsets_d = device_alloc(DEVICE_CUDA, (size_t)(E + 1) * sizeof(int));
    in.seg_token_d = device_alloc(DEVICE_CUDA, NK * sizeof(int));
    in.slot_of_d = device_alloc(DEVICE_CUDA, NK * sizeof(int));
    moe_permute_plan_device(DEVICE_CUDA, in.seg_offsets_d, in.seg_token_d, in.slot_of_d, in.topk_idx_d, N, K, E);
    in.rows0 = gpucheck_to_host(in.seg_offsets_d, (size_t)(E + 1) * sizeof(int));
    in.seg_token = gpucheck_to_host(in.seg_token_d, NK * sizeof(int));
    in.slot_of = gpucheck_to_host(in.slot_of_d, NK * sizeof(int));
    int *c_off = gpucheck_malloc((size_t)(E + 1) * sizeof(int)), *c_tok = gpucheck_malloc(NK * sizeof(int));
    int *c_slot = gpucheck_malloc(NK * sizeof(int));
    moe_permute_plan(c_off, c_tok, c_slot, topk_idx, N, K, E);
    in.plan_diff = 0;
    for (int e = 0; e <= E; e++) in.plan_diff += in.rows0[e] != c_off[e];
    for (size_t i = 0; i < NK; i++) in.plan_diff += (in.seg_token[i] != c_tok[i]) + (in.slot_of[i] != c_slot[i]);
    free(topk_idx), free(c_off), free(c_tok), free(c_slot);
    return in;
}

static void combine_grad_inputs_free(CombineGradInputs *in) {
    device_free(DEVICE_CUDA, in->topk_idx_d), device_free(DEVICE_CUDA, in->topk_w_d);
    device_free(DEVICE_CUDA, in->dout_base), device_free(DEVICE_CUDA, in->seg_offsets_d);
    device_free(DEVICE_CUDA, in->seg_token_d), device_free(DEVICE_CUDA, in->slot_of_d);
    free(in->topk_w), free(in->dout), free(in->rows0), free(in->seg_token), free(in->slot_of);
}

// The op on dev: the host inputs and plan on DEVICE_CPU, the device ones on DEVICE_CUDA (rows0 is a host array on both).
static int run_combine_grad_quant(Device dev, const CombineGradInputs *in, uint8_t *q1, float *s1, uint8_t *q2,
                                  float *s2, char *err, size_t err_size) {
    const int cuda = dev == DEVICE_CUDA;
    return fp8_quantize_combine_grad_both_layouts_grouped(
        dev, q1, s1, q2, s2, cuda ? in->dout_d : in->dout, cuda ? in->seg_token_d : in->seg_token,
        cuda ? in->slot_of_d : in->slot_of, cuda ? in->topk_w_d : in->topk_w, in->K, in->E, in->rows0, in->C, err,
        err_size);
}

static void test_quantize_combine_grad(void **state) {
    const CombineGradCase *cc = *state;
    CombineGradInputs in = combine_grad_inputs(cc->N, cc->K, cc->E, cc->C, cc->offset, 6000 + 10 * (uint64_t)cc->seed);
    const int N = in.N, K = in.K, E = in.E, C = in.C;
    const SegLayout L = seg_layout(E, in.rows0, C);
    int longest = 0;
    for (int e = 0; e < E; e++) longest = in.rows0[e + 1] - in.rows0[e] > longest ? in.rows0[e + 1] - in.rows0[e] : longest;
    const int has_empty = in.rows0[in.empty + 1] == in.rows0[in.empty];
    char err[256] = "";
    // CPU op, CUDA op (f*) and CUDA composition (c*), all outputs poisoned first
    uint8_t *q1 = host_poisoned(L.q1), *q2 = host_poisoned(L.q2);
    float *s1 = host_poisoned(L.s1 * sizeof(float)), *s2 = host_poisoned(L.s2 * sizeof(float));
    uint8_t *fq1_d = gpu_poisoned(L.q1), *fq2_d = gpu_poisoned(L.q2), *cq1_d = gpu_poisoned(L.q1);
    uint8_t *cq2_d = gpu_poisoned(L.q2);
    float *fs1_d = gpu_poisoned(L.s1 * sizeof(float)), *fs2_d = gpu_poisoned(L.s2 * sizeof(float));
    float *cs1_d = gpu_poisoned(L.s1 * sizeof(float)), *cs2_d = gpu_poisoned(L.s2 * sizeof(float));
    float *dexpert_d = gpu_poisoned((size_t)N * K * C * sizeof(float));
    const int rc_before = fp8_check_finite(DEVICE_CUDA, err, sizeof err);
    const int rc_cpu = run_combine_grad_quant(DEVICE_CPU, &in, q1, s1, q2, s2, err, sizeof err);
    const int rc_fused = run_combine_grad_quant(DEVICE_CUDA, &in, fq1_d, fs1_d, fq2_d, fs2_d, err, sizeof err);
    moe_combine_backward(DEVICE_CUDA, dexpert_d, NULL, in.dout_d, NULL, in.slot_of_d, in.topk_w_d, N, K, C);
    const int rc_comp =
        fp8_quantize_both_layouts_grouped(DEVICE_CUDA, cq1_d, cs1_d, cq2_d, cs2_d, dexpert_d, E, in.rows0, C, err, sizeof err);
    const int rc_check = fp8_check_finite(DEVICE_CUDA, err, sizeof err);
    uint8_t *fq1 = gpucheck_to_host(fq1_d, L.q1), *fq2 = gpucheck_to_host(fq2_d, L.q2);
    uint8_t *cq1 = gpucheck_to_host(cq1_d, L.q1), *cq2 = gpucheck_to_host(cq2_d, L.q2);
    float *fs1 = gpucheck_to_host(fs1_d, L.s1 * sizeof(float)), *fs2 = gpucheck_to_host(fs2_d, L.s2 * sizeof(float));
    float *cs1 = gpucheck_to_host(cs1_d, L.s1 * sizeof(float)), *cs2 = gpucheck_to_host(cs2_d, L.s2 * sizeof(float));
    // (a) bitwise against the CUDA composition, (b) bitwise against the CPU op
    const int64_t diff_comp = count_diff(fq1, cq1, L.q1) + count_diff(fs1, cs1, L.s1 * sizeof(float)) +
                              count_diff(fq2, cq2, L.q2) + count_diff(fs2, cs2, L.s2 * sizeof(float));
    const int64_t diff_cpu = count_diff(fq1, q1, L.q1) + count_diff(fs1, s1, L.s1 * sizeof(float)) +
                             count_diff(fq2, q2, L.q2) + count_diff(fs2, s2, L.s2 * sizeof(float));
    // poison left by the CUDA op (0xFF is never a code; a NaN scale), and E4M3 subnormal codes (the data reach them)
    int64_t unwritten = 0, subnormal = 0;
    for (size_t i = 0; i < L.q1; i++) unwritten += fq1[i] == 0xFF, subnormal += (fq1[i] & 0x78) == 0 && (fq1[i] & 7) != 0;
    for (size_t i = 0; i < L.q2; i++) unwritten += fq2[i] == 0xFF, subnormal += (fq2[i] & 0x78) == 0 && (fq2[i] & 7) != 0;
    for (size_t i = 0; i < L.s1; i++) unwritten += isnan(fs1[i]);
    for (size_t i = 0; i < L.s2; i++) unwritten += isnan(fs2[i]);
    const int rc_any = rc_before || rc_cpu || rc_fused || rc_comp || rc_check;
    const int pass = !rc_any && in.plan_diff == 0 && has_empty && diff_comp == 0 && diff_cpu == 0 && unwritten == 0 &&
                     subnormal > 0;
    char where[96];
    snprintf(where, sizeof where, "N %4d K %d E %2d (%s, longest %4d) C %-4d%s", N, K, E,
             has_empty ? "one empty" : "NO EMPTY", longest, C, cc->offset ? " dout+4B" : "");
    printf("%-18s %s: plan vs CPU %d differing; differing bytes vs CUDA composition %lld, vs CPU %lld; poison left "
           "%lld; subnormal codes %lld%s  %s\n",
           "quantize_combine", where, in.plan_diff, (long long)diff_comp, (long long)diff_cpu, (long long)unwritten,
           (long long)subnormal, rc_any ? "; an op reported an error" : "", pass ? "ok" : "FAIL");
    if (rc_any)
        printf("    rc check before %d, cpu %d, cuda op %d, cuda composition %d, fp8_check_finite %d: \"%s\"\n", rc_before,
               rc_cpu, rc_fused, rc_comp, rc_check, err);
    fflush(stdout);
    device_free(DEVICE_CUDA, fq1_d), device_free(DEVICE_CUDA, fq2_d), device_free(DEVICE_CUDA, cq1_d);
    device_free(DEVICE_CUDA, cq2_d), device_free(DEVICE_CUDA, fs1_d), device_free(DEVICE_CUDA, fs2_d);
    device_free(DEVICE_CUDA, cs1_d), device_free(DEVICE_CUDA, cs2_d), device_free(DEVICE_CUDA, dexpert_d);
    free(q1), free(q2), free(s1), free(s2), free(fq1), free(fq2), free(cq1), free(cq2);
    free(fs1), free(fs2), free(cs1), free(cs2);
    combine_grad_inputs_free(&in);
    assert_true(pass);
}

// The first non-finite element (row, column) of the slot-order array (row s = topk_w * dout[seg_token[s]]) in
// row-major order, from seg_token alone (topk_w is positive and the products of finite dout finite); -1 if none.
static void first_non_finite_slot(const CombineGradInputs *in, int *row, int *col) {
    *row = *col = -1;
    for (int s = 0; s < in->N * in->K; s++) {
        const float *dt = in->dout + (size_t)in->seg_token[s] * in->C;
        for (int c = 0; c < in->C; c++) {
            if (!isfinite(dt[c])) {
                *row = s, *col = c;
                return;
            }
        }
    }
}

static int first_slot_of_token(const CombineGradInputs *in, int t) {
    for (int s = 0; s < in->N * in->K; s++)
        if (in->seg_token[s] == t) return s;
    return -1;
}

// A non-finite dout element on the GPU: the call returns 0 (kernels.h: the check is deferred) and fp8_check_finite
// then returns -1 naming the op, the shape (N*K, C) and the first bad element of the slot-order array (the first slot
// row in segment order holding a bad token, the column), as the CPU op's -1 does; a second check finds nothing. Cases,
// at C = 200 (scalar loads) and 384 (vector loads): NaNs in two tokens where token order and segment order disagree
// (t_a < t_b, t_b's first slot earlier: t_b is the last token of expert 0's segment, t_a the lowest token not routed
// to expert 0); +Inf and NaN in one token (the lower column named); -Inf at dout's last element. A check before each
// call clears the call log, so that the call's own return is 0 (every 4096th call checks the ones before it).
static void test_quantize_combine_grad_nonfinite(void **state) {
    (void)state;
    const int widths[] = {200, 384};
    int all_pass = 1;
    for (int w = 0; w < 2; w++) {
        CombineGradInputs in = combine_grad_inputs(150, 3, 8, widths[w], 0, 6500 + (uint64_t)w);
        const int N = in.N, C = in.C;
        const SegLayout L = seg_layout(in.E, in.rows0, C);
        const int t_b = in.seg_token[in.rows0[1] - 1];
        int t_a = 0;
        while (t_a < N && first_slot_of_token(&in, t_a) < in.rows0[1]) t_a++;
        const int orders_differ =
            in.rows0[1] > 0 && t_a < t_b && first_slot_of_token(&in, t_b) < first_slot_of_token(&in, t_a);
        const struct {
            int t, c;
            float v;
            int t2, c2;
            float v2;
        } bad[] = {
            {t_a, 5, NAN, t_b, 150, NAN},
            {77, 120, NAN, 77, 30, INFINITY},
            {N - 1, C - 1, -INFINITY, -1, -1, 0.0f},
        };
        uint8_t *q1_d = gpu_poisoned(L.q1), *q2_d = gpu_poisoned(L.q2);
        float *s1_d = gpu_poisoned(L.s1 * sizeof(float)), *s2_d = gpu_poisoned(L.s2 * sizeof(float));
        uint8_t *q1 = host_poisoned(L.q1), *q2 = host_poisoned(L.q2);
        float *s1 = host_poisoned(L.s1 * sizeof(float)), *s2 = host_poisoned(L.s2 * sizeof(float));
        char shape[32];
        snprintf(shape, sizeof shape, "(%d, %d)", N * in.K, C);
        for (int b = 0; b < 3; b++) {
            fill_log_uniform(in.dout, (int64_t)N * C, 6502 + (uint64_t)w, -20.0, 1.0);
            in.dout[(size_t)bad[b].t * C + bad[b].c] = bad[b].v;
            if (bad[b].t2 >= 0) in.dout[(size_t)bad[b].t2 * C + bad[b].c2] = bad[b].v2;
            device_memcpy_from_host(DEVICE_CUDA, in.dout_d, in.dout, (size_t)N * C * sizeof(float));
            int r, c;
            first_non_finite_slot(&in, &r, &c);
            const int expected_ok = b == 0   ? orders_differ && r == first_slot_of_token(&in, t_b) && c == 150
                                    : b == 1 ? r == first_slot_of_token(&in, 77) && c == 30
                                             : r >= 0;
            char err_gpu[256] = "", err_cpu[256] = "", err_again[256] = "", want[64];
            const int rc_before = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
            const int rc_call = run_combine_grad_quant(DEVICE_CUDA, &in, q1_d, s1_d, q2_d, s2_d, err_gpu, sizeof err_gpu);
            const int rc_gpu = fp8_check_finite(DEVICE_CUDA, err_gpu, sizeof err_gpu);
            const int rc_again = fp8_check_finite(DEVICE_CUDA, err_again, sizeof err_again);
            const int rc_cpu = run_combine_grad_quant(DEVICE_CPU, &in, q1, s1, q2, s2, err_cpu, sizeof err_cpu);
            snprintf(want, sizeof want, "row %d, column %d", r, c);
            const int named = strstr(err_gpu, combine_grad_op) != NULL && strstr(err_gpu, want) != NULL &&
                              strstr(err_gpu, shape) != NULL && strstr(err_cpu, combine_grad_op) != NULL &&
                              strstr(err_cpu, want) != NULL;
            const int pass = expected_ok && rc_before == 0 && rc_call == 0 && rc_gpu == -1 && rc_again == 0 &&
                             rc_cpu == -1 && named;
            static const char *const what[] = {"NaN in tokens t_a < t_b", "+Inf, NaN in token 77", "-Inf last"};
            printf("%-18s C %-3d %-24s want %-22s%s: rc call %d, check %d then %d, cpu %d; gpu: \"%s\"  %s\n",
                   "quantize_combine", C, what[b], want, expected_ok ? "" : " (test setup wrong)", rc_call, rc_gpu,
                   rc_again, rc_cpu, err_gpu, pass ? "ok" : "FAIL");
            if (!pass) printf("    cpu: \"%s\"\n", err_cpu);
            fflush(stdout);
            all_pass &= pass;
        }
        device_free(DEVICE_CUDA, q1_d), device_free(DEVICE_CUDA, q2_d), device_free(DEVICE_CUDA, s1_d);
        device_free(DEVICE_CUDA, s2_d);
        free(q1), free(q2), free(s1), free(s2);
        combine_grad_inputs_free(&in);
    }
    assert_true(all_pass);
}

// ---------------------------------------------------------------------------- GEMM comparison
// Compares one output: |gpu - want| <= bound_f64[i] and |gpu - cpu| <= bound_par[i] for every i.
// Prints a table row; returns 1 when both hold.
static int check_gemm(const char *op, const char *shape, const float *gpu, const float *cpu, const double *want,
                      const double *bound_f64, const double *bound_par, int64_t n) {
    double e_gc = 0, e_gf = 0, e_cf = 0, max_abs = 0;
    int64_t w_gc = 0, w_gf = 0, equal = 0;
    for (int64_t i = 0; i < n; i++) {
        double r = fabs((double)gpu[i] - cpu[i]) / bound_par[i];
        if (!(r <= e_gc)) e_gc = isnan(r) ? INFINITY : r, w_gc = i;
        r = fabs((double)gpu[i] - want[i]) / bound_f64[i];
        if (!(r <= e_gf)) e_gf = isnan(r) ? INFINITY : r, w_gf = i;
        r = fabs((double)cpu[i] - want[i]) / bound_f64[i];
        if (!(r <= e_cf)) e_cf = isnan(r) ? INFINITY : r;
        const double d = fabs((double)gpu[i] - cpu[i]);
        if (!(d <= max_abs)) max_abs = d;
        equal += memcmp(&gpu[i], &cpu[i], sizeof(float)) == 0;
    }
    const int pass = e_gc <= 1.0 && e_gf <= 1.0;
    printf("%-16s %-22s %10.3e %12.3f %12.3f %12.3f %8.2f%%  %s\n", op, shape, max_abs, e_gc, e_gf, e_cf,
           100.0 * (double)equal / (double)n, pass ? "ok" : "FAIL");
    if (!pass) {
        const int64_t w = e_gc > 1.0 ? w_gc : w_gf;
        printf("    worst [%lld]: gpu %.9g cpu %.9g f64 %.12g; bounds f64 %.3g, gpu-cpu %.3g\n", (long long)w, gpu[w],
               cpu[w], want[w], bound_f64[w], bound_par[w]);
    }
    fflush(stdout);
    return pass;
}

static int check_repeat(const char *op, const char *shape, const float *a, const float *b, int64_t n) {
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    printf("%-16s %-22s %s\n", op, shape, differ == 0 ? "second run bitwise equal: ok" : "second run DIFFERS: FAIL");
    fflush(stdout);
    return differ == 0;
}

// A quantised operand on both devices: CPU and GPU outputs must agree bit for bit (checked here too, so
// the GEMM comparison below is about the GEMMs alone) and the host copy serves the f64 reference.
typedef struct {
    uint8_t *q, *qt;  // host (CPU results)
    float *s;
    uint8_t *q_d, *qt_d;  // device (GPU results)
    float *s_d;
} Quantised;

static Quantised quantise_both(QuantKind kind, const float *x, int rows, int cols, int with_qt) {
    const QuantLayout L = quant_layout(kind, rows, cols, with_qt);
    Quantised Q;
    char err[256] = "";
    Q.q = host_poisoned((size_t)L.q_bytes), Q.qt = with_qt ? host_poisoned((size_t)L.qt_bytes) : NULL;
    Q.s = host_poisoned((size_t)L.s_count * sizeof(float));
    assert_int_equal(run_quantizer(DEVICE_CPU, &L, Q.q, Q.qt, Q.s, x, err, sizeof err), 0);
    float *x_d = gpucheck_to_device(x, (size_t)rows * cols * sizeof(float));
    Q.q_d = gpu_poisoned((size_t)L.q_bytes), Q.qt_d = with_qt ? gpu_poisoned((size_t)L.qt_bytes) : NULL;
    Q.s_d = gpu_poisoned((size_t)L.s_count * sizeof(float));
    assert_int_equal(run_quantizer(DEVICE_CUDA, &L, Q.q_d, Q.qt_d, Q.s_d, x_d, err, sizeof err), 0);
    device_free(DEVICE_CUDA, x_d);
    uint8_t *q = gpucheck_to_host(Q.q_d, (size_t)L.q_bytes);
    float *s = gpucheck_to_host(Q.s_d, (size_t)L.s_count * sizeof(float));
    assert_memory_equal(q, Q.q, (size_t)L.q_bytes);
    assert_memory_equal(s, Q.s, (size_t)L.s_count * sizeof(float));
    if (with_qt) {
        uint8_t *qt = gpucheck_to_host(Q.qt_d, (size_t)L.qt_bytes);
        assert_memory_equal(qt, Q.qt, (size_t)L.qt_bytes);
        free(qt);
    }
    free(q), free(s);
    return Q;
}

static void quantised_free(Quantised *Q) {
    free(Q->q), free(Q->qt), free(Q->s);
    device_free(DEVICE_CUDA, Q->q_d), device_free(DEVICE_CUDA, Q->qt_d), device_free(DEVICE_CUDA, Q->s_d);
}

// Dequantised operands as double: a 1x128 operand (rows, cols) and a 128x128 operand (rows, cols).
static double *dequant_1x128(const Quantised *Q, int rows, int cols) {
    const int Kp = ceil_div(cols, FP8_TILE) * FP8_TILE, R16 = ceil_div(rows, 16) * 16;
    double *v = doubles((int64_t)rows * cols);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            v[(int64_t)r * cols + c] = e4m3_value(Q->q[(int64_t)r * Kp + c]) * Q->s[(int64_t)(c / FP8_TILE) * R16 + r];
    return v;
}
static double *dequant_128x128(const Quantised *Q, int rows, int cols) {
    const int KB = ceil_div(cols, FP8_TILE), Kp = KB * FP8_TILE, KB4 = (KB + 3) / 4 * 4;
    double *v = doubles((int64_t)rows * cols);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            v[(int64_t)r * cols + c] =
                e4m3_value(Q->q[(int64_t)r * Kp + c]) * Q->s[(int64_t)(r / FP8_TILE) * KB4 + c / FP8_TILE];
    return v;
}
// 128x1 transposed operand of x (T, C): returns the dequantised x (T, C).
static double *dequant_128x1t(const Quantised *Q, int T, int C) {
    const int Tp = ceil_div(T, FP8_TILE) * FP8_TILE;
    double *v = doubles((int64_t)T * C);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            v[(int64_t)t * C + c] = e4m3_value(Q->q[(int64_t)c * Tp + t]) * Q->s[(int64_t)(t / FP8_TILE) * C + c];
    return v;
}

// out (M, N) = sum_k a[m][k] b[n][k] for a (M, K), b (N, K); abs_sum (M, N) = sum_k |a b|. In double,
// which holds these sums to far below the tolerances.
static void ref_gemm(double *out, double *abs_sum, const double *a, const double *b, int M, int N, int K) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const double *ar = a + (int64_t)m * K, *br = b + (int64_t)n * K;
            double sum = 0, abs = 0;
            for (int k = 0; k < K; k++) {
                const double p = ar[k] * br[k];
                sum += p, abs += fabs(p);
            }
            out[(int64_t)m * N + n] = sum, abs_sum[(int64_t)m * N + n] = abs;
        }
}

// a (rows, cols) -> a new (cols, rows)
static double *transposed(const double *a, int rows, int cols) {
    double *t = doubles((int64_t)rows * cols);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) t[(int64_t)c * rows + r] = a[(int64_t)r * cols + c];
    return t;
}

static void print_gemm_header(void) {
    printf("\n%-16s %-22s %10s %12s %12s %12s %9s\n", "GEMM", "M x N x K", "max|g-c|", "(g-c)/bound",
           "(g-f64)/bnd", "(c-f64)/bnd", "bitwise");
}

// ---------------------------------------------------------------------------- FP8 GEMMs
typedef enum { G_FPROP, G_DGRAD, G_WGRAD } GemmKind;

typedef struct {
    GemmKind kind;
    int T, N, K;
    int zero_rows;      // Fprop: the last zero_rows of X are segment padding (0)
    int misaligned_out; // Wgrad: dw at a 4-byte (not 16-byte) aligned address
} GemmCase;

// The output row after the T valid ones (cols floats at row_d, allocated poisoned) is still poison: the
// GEMM runs on T16 rows but must write only T.
static void assert_row_untouched(const char *name, const char *out, const float *row_d, int T, int cols, int K) {
    float *row = gpucheck_to_host(row_d, (size_t)cols * sizeof(float));
    float *poison = host_poisoned((size_t)cols * sizeof(float));
    const int untouched = memcmp(row, poison, (size_t)cols * sizeof(float)) == 0;
    printf("%-16s %d x %d x %d: the row after %s untouched: %s\n", name, T, cols, K, out, untouched ? "ok" : "FAIL");
    free(row), free(poison);
    assert_true(untouched);
}

static void test_fp8_gemm(void **state) {
    const GemmCase *gc = *state;
    const int T = gc->T, N = gc->N, K = gc->K;
    int M_out, N_out, K_contr; // the GEMM as M x N x K
    int64_t n_out;
    float *init = NULL; // Wgrad's initial dw
    double *want, *abs_sum;
    float *out_cpu, *out_gpu, *out_gpu2;
    const char *name = gc->kind == G_FPROP ? "fp8 Fprop" : gc->kind == G_DGRAD ? "fp8 Dgrad" : "fp8 Wgrad";
    uint64_t seed = 5000 + (uint64_t)gc->kind * 100 + (uint64_t)T;

    if (gc->kind == G_FPROP) {
        // y (T, N) = X (T, K) W (N, K)^T
        M_out = T, N_out = N, K_contr = K, n_out = (int64_t)T * N;
        float *x = floats((int64_t)T * K), *w = floats((int64_t)N * K);
        fill_log_uniform(x, (int64_t)T * K, seed, -6.0, 2.0);
        fill_log_uniform(w, (int64_t)N * K, seed + 1, -8.0, 0.0);
        for (int64_t i = (int64_t)(T - gc->zero_rows) * K; i < (int64_t)T * K; i++) x[i] = 0.0f;
        Quantised qx = quantise_both(Q_1X128, x, T, K, 0), qw = quantise_both(Q_128X128, w, N, K, 0);
        out_cpu = host_poisoned((size_t)n_out * sizeof(float));
        fp8_gemm_fprop(DEVICE_CPU, out_cpu, qx.q, qx.s, qw.q, qw.s, T, N, K);
        // one row past the output, poisoned: the GEMM runs on T16 rows but must write only T
        float *y_d = gpu_poisoned((size_t)(n_out + N) * sizeof(float));
        fp8_gemm_fprop(DEVICE_CUDA, y_d, qx.q_d, qx.s_d, qw.q_d, qw.s_d, T, N, K);
        out_gpu = gpucheck_to_host(y_d, (size_t)n_out * sizeof(float));
        fp8_gemm_fprop(DEVICE_CUDA, y_d, qx.q_d, qx.s_d, qw.q_d, qw.s_d, T, N, K);
        out_gpu2 = gpucheck_to_host(y_d, (size_t)n_out * sizeof(float));
        assert_row_untouched(name, "y", y_d + n_out, T, N, K);
        double *xd = dequant_1x128(&qx, T, K), *wd = dequant_128x128(&qw, N, K);
        want = doubles(n_out), abs_sum = doubles(n_out);
        ref_gemm(want, abs_sum, xd, wd, T, N, K);
        free(xd), free(wd), free(x), free(w);
        quantised_free(&qx), quantised_free(&qw);
        device_free(DEVICE_CUDA, y_d);
    } else if (gc->kind == G_DGRAD) {
        // dx (T, K) += dY (T, N) W (N, K), onto a random dx (a Linear's backward accumulates)
        M_out = T, N_out = K, K_contr = N, n_out = (int64_t)T * K;
        float *dy = floats((int64_t)T * N), *w = floats((int64_t)N * K);
        fill_log_uniform(dy, (int64_t)T * N, seed, -10.0, -2.0);
        fill_log_uniform(w, (int64_t)N * K, seed + 1, -8.0, 0.0);
        init = floats(n_out);
        fill_log_uniform(init, n_out, seed + 2, -10.0, -2.0);
        Quantised qdy = quantise_both(Q_1X128, dy, T, N, 0), qw = quantise_both(Q_128X128, w, N, K, 1);
        out_cpu = floats(n_out);
        memcpy(out_cpu, init, (size_t)n_out * sizeof(float));
        fp8_gemm_dgrad(DEVICE_CPU, out_cpu, qdy.q, qdy.s, qw.qt, qw.s, T, N, K);
        // one row past the output, poisoned: the GEMM runs on T16 rows but must write only T
        float *dx_d = gpu_poisoned((size_t)(n_out + K) * sizeof(float));
        out_gpu = floats(n_out), out_gpu2 = floats(n_out);
        for (int rep = 0; rep < 2; rep++) {
            device_memcpy_from_host(DEVICE_CUDA, dx_d, init, (size_t)n_out * sizeof(float));
            fp8_gemm_dgrad(DEVICE_CUDA, dx_d, qdy.q_d, qdy.s_d, qw.qt_d, qw.s_d, T, N, K);
            device_memcpy_to_host(DEVICE_CUDA, rep == 0 ? out_gpu : out_gpu2, dx_d, (size_t)n_out * sizeof(float));
        }
        assert_row_untouched(name, "dx", dx_d + n_out, T, K, N);
        double *dyd = dequant_1x128(&qdy, T, N), *wd = dequant_128x128(&qw, N, K);
        want = doubles(n_out), abs_sum = doubles(n_out);
        double *wt = transposed(wd, N, K);
        ref_gemm(want, abs_sum, dyd, wt, T, K, N);
        for (int64_t i = 0; i < n_out; i++) want[i] += init[i];
        free(dyd), free(wd), free(wt), free(dy), free(w);
        quantised_free(&qdy), quantised_free(&qw);
        device_free(DEVICE_CUDA, dx_d);
    } else {
        // dw (N, K) += dY (T, N)^T X (T, K)
        M_out = N, N_out = K, K_contr = T, n_out = (int64_t)N * K;
        float *dy = floats((int64_t)T * N), *x = floats((int64_t)T * K);
        fill_log_uniform(dy, (int64_t)T * N, seed, -10.0, -2.0);
        fill_log_uniform(x, (int64_t)T * K, seed + 1, -6.0, 2.0);
        init = floats(n_out);
        fill_log_uniform(init, n_out, seed + 2, -4.0, 2.0);
        Quantised qdy = quantise_both(Q_128X1T, dy, T, N, 0), qx = quantise_both(Q_128X1T, x, T, K, 0);
        out_cpu = floats(n_out);
        memcpy(out_cpu, init, (size_t)n_out * sizeof(float));
        fp8_gemm_wgrad(DEVICE_CPU, out_cpu, qdy.q, qdy.s, qx.q, qx.s, T, N, K);
        const int off = gc->misaligned_out ? 1 : 0;
        float *dw_base = device_alloc(DEVICE_CUDA, (size_t)(n_out + off) * sizeof(float));
        float *dw_d = dw_base + off;
        out_gpu = floats(n_out), out_gpu2 = floats(n_out);
        for (int rep = 0; rep < 2; rep++) {
            device_memcpy_from_host(DEVICE_CUDA, dw_d, init, (size_t)n_out * sizeof(float));
            fp8_gemm_wgrad(DEVICE_CUDA, dw_d, qdy.q_d, qdy.s_d, qx.q_d, qx.s_d, T, N, K);
            device_memcpy_to_host(DEVICE_CUDA, rep == 0 ? out_gpu : out_gpu2, dw_d, (size_t)n_out * sizeof(float));
        }
        double *dyd = dequant_128x1t(&qdy, T, N), *xd = dequant_128x1t(&qx, T, K);
        want = doubles(n_out), abs_sum = doubles(n_out);
        double *dyt = transposed(dyd, T, N), *xt = transposed(xd, T, K);
        ref_gemm(want, abs_sum, dyt, xt, N, K, T);
        for (int64_t i = 0; i < n_out; i++) want[i] += init[i];
        free(dyd), free(xd), free(dyt), free(xt), free(dy), free(x);
        quantised_free(&qdy), quantised_free(&qx);
        device_free(DEVICE_CUDA, dw_base);
    }

    // Tolerances (see the file comment). Fprop/Dgrad: each side rounds to BF16 once.
    double *bound_f64 = doubles(n_out), *bound_par = doubles(n_out);
    for (int64_t i = 0; i < n_out; i++) {
        const double big = fmax(fabs(want[i]), fmax(fabs((double)out_gpu[i]), fabs((double)out_cpu[i])));
        if (gc->kind == G_WGRAD) {
            // FP32 promotion every 128 (one rounding per K-block) and the final add into dw
            const double fp32 = (ceil_div(K_contr, FP8_TILE) + 2) * U_FP32 * (abs_sum[i] + fabs((double)init[i]));
            bound_f64[i] = FP8_GEMM_REL * abs_sum[i] + fp32 + FLT_MIN;
            bound_par[i] = FP8_GEMM_REL * abs_sum[i] + 2 * fp32 + FLT_MIN;
        } else {
            // Dgrad adds its BF16 product to init: the product is |out - init|, plus one FP32 rounding
            const double prod = gc->kind == G_DGRAD ? fmax(fabs(want[i] - init[i]), fabs((double)out_gpu[i] - init[i])) : big;
            const double add = gc->kind == G_DGRAD ? 2 * U_FP32 * (fabs((double)init[i]) + prod) : 0;
            bound_f64[i] = FP8_GEMM_REL * abs_sum[i] + bf16_half_ulp(prod) + add + FLT_MIN;
            bound_par[i] = FP8_GEMM_REL * abs_sum[i] + 2 * bf16_half_ulp(prod) + 2 * add + FLT_MIN;
        }
    }
    char shape[64];
    snprintf(shape, sizeof shape, "%d x %d x %d%s%s", M_out, N_out, K_contr, gc->zero_rows ? " pad" : "",
             gc->misaligned_out ? " +4B" : "");
    int pass = check_gemm(name, shape, out_gpu, out_cpu, want, bound_f64, bound_par, n_out);
    pass &= check_repeat(name, shape, out_gpu, out_gpu2, n_out);
    if (gc->kind == G_FPROP && gc->zero_rows > 0) {
        // padding rows of the segment produce exact zeros
        int zeros = 1;
        for (int64_t i = (int64_t)(T - gc->zero_rows) * N; i < n_out; i++) zeros &= out_gpu[i] == 0.0f;
        printf("%-16s %-22s padding rows of y are 0: %s\n", name, shape, zeros ? "ok" : "FAIL");
        pass &= zeros;
    }
    free(bound_f64), free(bound_par), free(want), free(abs_sum), free(init);
    free(out_cpu), free(out_gpu), free(out_gpu2);
    assert_true(pass);
}

// ---------------------------------------------------------------------------- grouped FP8 GEMMs
// The grouped Fprop and Dgrad (one output conversion for all segments) against the plain CUDA calls segment
// by segment on the same quantised operands: the same GEMMs, so bit for bit. Every output row is written
// (no poison left), the rows just before and after the output stay poison, the segment lists have empty
// segments and lengths off 16, and Dgrad adds onto a random dx. An output width that is not a multiple of
// 4 takes the scalar conversion, the others the 4-wide one.
typedef struct {
    int n_seg, N, K, seed;
} GroupedGemmCase;

// Rows 1..T of out (T + 2 rows of cols floats) are non-NaN and rows 0 and T + 1 are poison (0xFF bytes).
static int written_inside_only(const float *out, int T, int cols) {
    const size_t row_bytes = (size_t)cols * sizeof(float);
    float *poison = host_poisoned(row_bytes);
    int ok = memcmp(out, poison, row_bytes) == 0 && memcmp(out + (int64_t)(T + 1) * cols, poison, row_bytes) == 0;
    for (int64_t i = cols; i < (int64_t)(T + 1) * cols; i++) ok &= !isnan(out[i]);
    free(poison);
    return ok;
}

// The token-order Dgrad (kernels.h DgradUnpermute) against the slot-order Dgrad (GRAD_WRITE) followed by
// moe_unpermute_backward, both on the GPU, for two matrices: T rows read by n_tok tokens, topk rows each (2 when T
// is even, else 1) through a permutation; the token gradients start from `init` (its first n_tok * K values) with
// GRAD_ADD, and from poison with GRAD_WRITE (against the unpermute onto zeros); and with two BF16 post arrays (the
// shared expert's Dgrad products: rows of bf16_rows_ld(K), padding NaN, 3 NaN values between the arrays) from
// `init`, against the first result with the arrays' rows added on the host, in order.
// fp8 when q* are given, else bf16 (b*). Returns the number of differing bytes (expected 0: the same sums in the
// same order).
static int unpermute_diff(int T, int K, const float *init, const uint8_t *const *qdy, const float *const *sdy,
                          const uint16_t *const *bdy, const uint8_t *const *const *qwt, const float *const *const *sw,
                          const uint16_t *const *const *bw, int n, const int *rows0, int N) {
    const int topk = T % 2 == 0 ? 2 : 1, n_tok = T / topk;
    int step = 5;
    while (T % step == 0) step += 2;  // coprime with T: i -> (i step + 3) % T is a permutation
    int *slot_of = gpucheck_malloc(sizeof(int) * (size_t)T);
    for (int i = 0; i < T; i++) slot_of[i] = (int)(((int64_t)i * step + 3) % T);
    int *slot_of_d = gpucheck_to_device(slot_of, sizeof(int) * (size_t)T);
    const size_t bytes = sizeof(float) * (size_t)n_tok * K;
    float *fused_d = gpucheck_to_device(init, bytes), *ref_d = gpucheck_to_device(init, bytes);
    float *slots_d = gpu_poisoned(sizeof(float) * (size_t)T * K);
    const DgradUnpermute u = {.slot_of = slot_of_d, .n_tok = n_tok, .topk = topk};
    if (qdy != NULL) {
        fp8_gemm_dgrad_grouped(DEVICE_CUDA, fused_d, GRAD_ADD, &u, 2, qdy, sdy, qwt, sw, n, rows0, N, K);
        fp8_gemm_dgrad_grouped(DEVICE_CUDA, slots_d, GRAD_WRITE, NULL, 2, qdy, sdy, qwt, sw, n, rows0, N, K);
    } else {
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, fused_d, GRAD_ADD, &u, 2, bdy, bw, n, rows0, N, K);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, slots_d, GRAD_WRITE, NULL, 2, bdy, bw, n, rows0, N, K);
    }
    moe_unpermute_backward(DEVICE_CUDA, ref_d, slots_d, slot_of_d, n_tok, topk, K);
    float *fused = gpucheck_to_host(fused_d, bytes), *ref = gpucheck_to_host(ref_d, bytes);
    int diff = count_diff(fused, ref, bytes);
    const int64_t ld = bf16_rows_ld(K), stride = (int64_t)n_tok * ld + 3;
    uint16_t *post = gpucheck_malloc(sizeof(uint16_t) * (size_t)(2 * stride));
    for (int64_t k = 0; k < 2 * stride; k++) post[k] = 0x7FC0;
    for (int i = 0; i < 2; i++)
        for (int64_t t = 0; t < n_tok; t++)
            for (int c = 0; c < K; c++) {
                post[i * stride + t * ld + c] = float_to_bf16(init[t * K + c] * (i == 0 ? 0.5f : -3.0f) + 1.0f);
                ref[t * K + c] += bf16_to_float(post[i * stride + t * ld + c]);
            }
    uint16_t *post_d = gpucheck_to_device(post, sizeof(uint16_t) * (size_t)(2 * stride));
    const DgradUnpermute up = {.slot_of = slot_of_d, .n_tok = n_tok, .topk = topk, .post = post_d, .n_post = 2,
                               .post_stride = stride};
    device_memcpy_from_host(DEVICE_CUDA, fused_d, init, bytes);
    if (qdy != NULL) fp8_gemm_dgrad_grouped(DEVICE_CUDA, fused_d, GRAD_ADD, &up, 2, qdy, sdy, qwt, sw, n, rows0, N, K);
    else bf16_gemm_dgrad_grouped(DEVICE_CUDA, fused_d, GRAD_ADD, &up, 2, bdy, bw, n, rows0, N, K);
    float *with_post = gpucheck_to_host(fused_d, bytes);
    diff += count_diff(with_post, ref, bytes);
    device_free(DEVICE_CUDA, post_d);
    free(post), free(with_post);
    // GRAD_WRITE over poison: the bits of the unpermute onto a cleared buffer
    float *poison_d = gpu_poisoned(bytes);
    device_memset_zero(DEVICE_CUDA, ref_d, bytes);
    if (qdy != NULL) fp8_gemm_dgrad_grouped(DEVICE_CUDA, poison_d, GRAD_WRITE, &u, 2, qdy, sdy, qwt, sw, n, rows0, N, K);
    else bf16_gemm_dgrad_grouped(DEVICE_CUDA, poison_d, GRAD_WRITE, &u, 2, bdy, bw, n, rows0, N, K);
    moe_unpermute_backward(DEVICE_CUDA, ref_d, slots_d, slot_of_d, n_tok, topk, K);
    float *written = gpucheck_to_host(poison_d, bytes), *ref0 = gpucheck_to_host(ref_d, bytes);
    diff += count_diff(written, ref0, bytes);
    device_free(DEVICE_CUDA, poison_d);
    free(written), free(ref0);
    device_free(DEVICE_CUDA, slot_of_d), device_free(DEVICE_CUDA, fused_d), device_free(DEVICE_CUDA, ref_d);
    device_free(DEVICE_CUDA, slots_d);
    free(slot_of), free(fused), free(ref);
    return diff;
}

// A grouped Fprop's residual (kernels.h: the block's, added after MLA's output projection): the bytes of y (rows,
// N) that differ between the call with the residual and the call without it followed by add_inplace(y, residual),
// with the residual 16-byte aligned (the float4 conversion) and one float off (the scalar one). fprop runs the
// Fprop under test into y with the residual given (or NULL).
typedef void (*FpropWithResidual)(float *y, const float *residual, const void *ctx);
static int fprop_residual_diff(FpropWithResidual fprop, const void *ctx, int rows, int N, uint64_t seed) {
    const int64_t n = (int64_t)rows * N;
    float *res = floats(n + 1);
    fill_log_uniform(res, n + 1, seed, -6.0, 0.0);
    float *res_d = gpucheck_to_device(res, (size_t)(n + 1) * sizeof(float));
    int differing = 0;
    for (int off = 0; off < 2; off++) {
        float *fused_d = gpu_poisoned((size_t)n * sizeof(float)), *sep_d = gpu_poisoned((size_t)n * sizeof(float));
        fprop(fused_d, res_d + off, ctx);
        fprop(sep_d, NULL, ctx);
        add_inplace(DEVICE_CUDA, sep_d, res_d + off, n);
        float *fused = gpucheck_to_host(fused_d, (size_t)n * sizeof(float)), *sep = gpucheck_to_host(sep_d, (size_t)n * sizeof(float));
        differing += count_diff(fused, sep, (size_t)n * sizeof(float));
        free(fused), free(sep);
        device_free(DEVICE_CUDA, fused_d), device_free(DEVICE_CUDA, sep_d);
    }
    device_free(DEVICE_CUDA, res_d);
    free(res);
    return differing;
}

typedef struct {
    const uint8_t *qx;
    const float *sx;
    const uint8_t *const *qw;
    const float *const *sw;
    int n, N, K;
    const int *rows0;
} Fp8FpropArgs;
static void fp8_fprop_with_residual(float *y, const float *residual, const void *ctx) {
    const Fp8FpropArgs *a = ctx;
    fp8_gemm_fprop_grouped(DEVICE_CUDA, y, residual, a->qx, a->sx, a->qw, a->sw, a->n, a->rows0, a->N, a->K);
}

typedef struct {
    const uint16_t *x;
    const uint16_t *const *w;
    int n, N, K;
    const int *rows0;
} Bf16FpropArgs;
static void bf16_fprop_with_residual(float *y, const float *residual, const void *ctx) {
    const Bf16FpropArgs *a = ctx;
    bf16_gemm_fprop_grouped(DEVICE_CUDA, y, residual, a->x, a->w, a->n, a->rows0, a->N, a->K);
}

static void test_fp8_gemm_grouped(void **state) {
    const GroupedGemmCase *gc = *state;
    const int n = gc->n_seg, N = gc->N, K = gc->K;
    const int KB = ceil_div(K, FP8_TILE), NB = ceil_div(N, FP8_TILE), KB4 = (KB + 3) / 4 * 4;
    const int Kp = KB * FP8_TILE, Np = NB * FP8_TILE;
    int rows0[FP8_MAX_SEGMENTS + 1] = {0};
    uint64_t r = 0x9E3779B97F4A7C15ull * (uint64_t)gc->seed;
    for (int g = 0; g < n; g++) {  // lengths 0..190, every fifth segment empty
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        rows0[g + 1] = rows0[g] + (g % 5 == 1 ? 0 : (int)((r >> 33) % 191));
    }
    int P16 = 0;
    for (int g = 0; g < n; g++) P16 += ceil_div(rows0[g + 1] - rows0[g], 16) * 16;
    const int T = rows0[n];
    char err[256] = "";

    // activations quantised in the *_grouped layout, one weight per non-empty segment
    float *x = floats((int64_t)T * K), *dy = floats((int64_t)T * N), *w = floats((int64_t)N * K);
    fill_log_uniform(x, (int64_t)T * K, 7000 + (uint64_t)gc->seed, -6.0, 2.0);
    fill_log_uniform(dy, (int64_t)T * N, 7100 + (uint64_t)gc->seed, -10.0, -2.0);
    float *x_d = gpucheck_to_device(x, (size_t)T * K * sizeof(float)), *dy_d = gpucheck_to_device(dy, (size_t)T * N * sizeof(float));
    uint8_t *qx_d = gpu_poisoned((size_t)P16 * Kp), *qdy_d = gpu_poisoned((size_t)P16 * Np);
    float *sx_d = gpu_poisoned((size_t)KB * P16 * sizeof(float)), *sdy_d = gpu_poisoned((size_t)NB * P16 * sizeof(float));
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CUDA, qx_d, sx_d, x_d, NULL, n, rows0, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CUDA, qdy_d, sdy_d, dy_d, NULL, n, rows0, N, err, sizeof err), 0);
    const uint8_t *qw[FP8_MAX_SEGMENTS] = {NULL}, *qwt[FP8_MAX_SEGMENTS] = {NULL};
    const float *sw[FP8_MAX_SEGMENTS] = {NULL};
    float *w_d = device_alloc(DEVICE_CUDA, (size_t)N * K * sizeof(float));
    for (int g = 0; g < n; g++) {
        if (rows0[g + 1] == rows0[g]) continue;
        fill_log_uniform(w, (int64_t)N * K, 7200 + 37 * (uint64_t)gc->seed + (uint64_t)g, -8.0, 0.0);
        device_memcpy_from_host(DEVICE_CUDA, w_d, w, (size_t)N * K * sizeof(float));
        uint8_t *q = gpu_poisoned((size_t)Np * Kp), *qt = gpu_poisoned((size_t)Np * Kp);
        float *s = gpu_poisoned((size_t)NB * KB4 * sizeof(float));
        assert_int_equal(fp8_quantize_128x128(DEVICE_CUDA, q, qt, s, w_d, N, K, err, sizeof err), 0);
        qw[g] = q, qwt[g] = qt, sw[g] = s;
    }
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);

    // Fprop y (T, N) and Dgrad dx (T, K) += ..., each with a poisoned row before and after: per segment, grouped
    const int64_t ny = (int64_t)(T + 2) * N, nx = (int64_t)(T + 2) * K;
    float *y_seg_d = gpu_poisoned((size_t)ny * sizeof(float)), *y_grp_d = gpu_poisoned((size_t)ny * sizeof(float));
    float *dx_seg_d = gpu_poisoned((size_t)nx * sizeof(float)), *dx_grp_d = gpu_poisoned((size_t)nx * sizeof(float));
    float *init = floats((int64_t)T * K);
    fill_log_uniform(init, (int64_t)T * K, 7300 + (uint64_t)gc->seed, -10.0, -2.0);
    device_memcpy_from_host(DEVICE_CUDA, dx_seg_d + K, init, (size_t)T * K * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, dx_grp_d + K, init, (size_t)T * K * sizeof(float));
    for (int g = 0, p16 = 0; g < n; g++) {
        const int rows = rows0[g + 1] - rows0[g];
        if (rows == 0) continue;
        fp8_gemm_fprop(DEVICE_CUDA, y_seg_d + N + (int64_t)rows0[g] * N, qx_d + (int64_t)p16 * Kp, sx_d + (int64_t)KB * p16,
                       qw[g], sw[g], rows, N, K);
        fp8_gemm_dgrad(DEVICE_CUDA, dx_seg_d + K + (int64_t)rows0[g] * K, qdy_d + (int64_t)p16 * Np,
                       sdy_d + (int64_t)NB * p16, qwt[g], sw[g], rows, N, K);
        p16 += ceil_div(rows, 16) * 16;
    }
    fp8_gemm_fprop_grouped(DEVICE_CUDA, y_grp_d + N, NULL, qx_d, sx_d, qw, sw, n, rows0, N, K);
    const uint8_t *qdy1[1] = {qdy_d}, *const *qwt1[1] = {qwt};
    const float *sdy1[1] = {sdy_d}, *const *sw1[1] = {sw};
    fp8_gemm_dgrad_grouped(DEVICE_CUDA, dx_grp_d + K, GRAD_ADD, NULL, 1, qdy1, sdy1, qwt1, sw1, n, rows0, N, K);
    // GRAD_WRITE over poison: each element the per-segment Dgrad's product alone (added to zeros)
    float *dx_zero_d = gpu_poisoned((size_t)nx * sizeof(float)), *dx_wr_d = gpu_poisoned((size_t)nx * sizeof(float));
    device_memset_zero(DEVICE_CUDA, dx_zero_d + K, (size_t)T * K * sizeof(float));
    for (int g = 0, p16 = 0; g < n; g++) {
        const int rows = rows0[g + 1] - rows0[g];
        if (rows == 0) continue;
        fp8_gemm_dgrad(DEVICE_CUDA, dx_zero_d + K + (int64_t)rows0[g] * K, qdy_d + (int64_t)p16 * Np,
                       sdy_d + (int64_t)NB * p16, qwt[g], sw[g], rows, N, K);
        p16 += ceil_div(rows, 16) * 16;
    }
    fp8_gemm_dgrad_grouped(DEVICE_CUDA, dx_wr_d + K, GRAD_WRITE, NULL, 1, qdy1, sdy1, qwt1, sw1, n, rows0, N, K);
    // two matrices in one call (one conversion): the bits of the second single call added after the first
    const uint8_t *qdy2[2] = {qdy_d, qdy_d}, *const *qwt2[2] = {qwt, qwt};
    const float *sdy2[2] = {sdy_d, sdy_d}, *const *sw2[2] = {sw, sw};
    float *dx_two_d = gpu_poisoned((size_t)nx * sizeof(float)), *dx_seq_d = gpu_poisoned((size_t)nx * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, dx_two_d + K, init, (size_t)T * K * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, dx_seq_d + K, init, (size_t)T * K * sizeof(float));
    fp8_gemm_dgrad_grouped(DEVICE_CUDA, dx_two_d + K, GRAD_ADD, NULL, 2, qdy2, sdy2, qwt2, sw2, n, rows0, N, K);
    fp8_gemm_dgrad_grouped(DEVICE_CUDA, dx_seq_d + K, GRAD_ADD, NULL, 1, qdy1, sdy1, qwt1, sw1, n, rows0, N, K);
    fp8_gemm_dgrad_grouped(DEVICE_CUDA, dx_seq_d + K, GRAD_ADD, NULL, 1, qdy1, sdy1, qwt1, sw1, n, rows0, N, K);
    float *dx_two = gpucheck_to_host(dx_two_d, (size_t)nx * sizeof(float)), *dx_seq = gpucheck_to_host(dx_seq_d, (size_t)nx * sizeof(float));
    const int two_diff = count_diff(dx_two, dx_seq, (size_t)nx * sizeof(float));
    const int unperm_diff = unpermute_diff(T, K, init, qdy2, sdy2, NULL, qwt2, sw2, NULL, n, rows0, N);
    float *dx_zero = gpucheck_to_host(dx_zero_d, (size_t)nx * sizeof(float)), *dx_wr = gpucheck_to_host(dx_wr_d, (size_t)nx * sizeof(float));
    int wr_diff = 0;
    for (int64_t i = K; i < (int64_t)(T + 1) * K; i++) wr_diff += !(dx_wr[i] == dx_zero[i]);
    const int wr_rows = written_inside_only(dx_wr, T, K);
    float *y_seg = gpucheck_to_host(y_seg_d, (size_t)ny * sizeof(float)), *y_grp = gpucheck_to_host(y_grp_d, (size_t)ny * sizeof(float));
    float *dx_seg = gpucheck_to_host(dx_seg_d, (size_t)nx * sizeof(float)), *dx_grp = gpucheck_to_host(dx_grp_d, (size_t)nx * sizeof(float));
    const int y_diff = count_diff(y_grp, y_seg, (size_t)ny * sizeof(float));
    const int dx_diff = count_diff(dx_grp, dx_seg, (size_t)nx * sizeof(float));
    const int y_rows = written_inside_only(y_grp, T, N), dx_rows = written_inside_only(dx_grp, T, K);
    const Fp8FpropArgs fa = {qx_d, sx_d, qw, sw, n, N, K, rows0};
    const int res_diff = fprop_residual_diff(fp8_fprop_with_residual, &fa, T, N, 7400 + (uint64_t)gc->seed);
    // the BF16 products as they are (fp8_gemm_fprop_grouped_bf16, each segment's GEMM straight into y16 with its
    // padding rows spilling onto the next segment's): every valid element the BF16 bits of the converted Fprop's
    // value, the padding columns 0
    const int Np16 = ceil_div(N, FP8_TILE) * FP8_TILE;
    uint16_t *y16_d = gpu_poisoned((size_t)(T + 15) * Np16 * sizeof(uint16_t));
    fp8_gemm_fprop_grouped_bf16(DEVICE_CUDA, y16_d, qx_d, sx_d, qw, sw, n, rows0, N, K);
    uint16_t *y16 = gpucheck_to_host(y16_d, (size_t)(T + 15) * Np16 * sizeof(uint16_t));
    int bf16_diff = 0;
    for (int64_t r = 0; r < T; r++)
        for (int c = 0; c < Np16; c++)
            bf16_diff += y16[r * Np16 + c] != (c < N ? float_to_bf16(y_grp[(r + 1) * N + c]) : 0) ||
                         (c < N && bf16_to_float(y16[r * Np16 + c]) != y_grp[(r + 1) * N + c]);
    device_free(DEVICE_CUDA, y16_d), free(y16);
    // the Dgrad's BF16 product as it is (fp8_gemm_dgrad_grouped_bf16): the BF16 bits of the GRAD_WRITE Dgrad's values
    const int Kp16 = ceil_div(K, FP8_TILE) * FP8_TILE;
    uint16_t *dx16_d = gpu_poisoned((size_t)(T + 15) * Kp16 * sizeof(uint16_t));
    fp8_gemm_dgrad_grouped_bf16(DEVICE_CUDA, dx16_d, qdy_d, sdy_d, qwt, sw, n, rows0, N, K);
    uint16_t *dx16 = gpucheck_to_host(dx16_d, (size_t)(T + 15) * Kp16 * sizeof(uint16_t));
    for (int64_t r = 0; r < T; r++)
        for (int c = 0; c < Kp16; c++)
            bf16_diff += dx16[r * Kp16 + c] != (c < K ? float_to_bf16(dx_wr[(r + 1) * K + c]) : 0) ||
                         (c < K && bf16_to_float(dx16[r * Kp16 + c]) != dx_wr[(r + 1) * K + c]);
    device_free(DEVICE_CUDA, dx16_d), free(dx16);
    // Wgrad per segment (fp8_gemm_wgrad_grouped, whose GEMMs may run on several streams) against one plain call per
    // segment: the same bits, into gradients that start from random values. cuBLASLt's block-scaled Wgrad needs N and
    // K multiples of 4, so the cases with other widths skip it (dw_diff -1).
    int dw_diff = -1, dw_moved = 0, write_diff = -1;
    if (N % 4 == 0 && K % 4 == 0) {
        int TB = 0;  // 128-row tiles of all segments (at least one buffer's worth when every segment is empty)
        for (int g = 0; g < n; g++) TB += ceil_div(rows0[g + 1] - rows0[g], FP8_TILE);
        const size_t tb = TB > 0 ? (size_t)TB : 1;
        uint8_t *qxt_d = gpu_poisoned((size_t)K * FP8_TILE * tb), *qdyt_d = gpu_poisoned((size_t)N * FP8_TILE * tb);
        float *sxt_d = gpu_poisoned((size_t)K * tb * sizeof(float)), *sdyt_d = gpu_poisoned((size_t)N * tb * sizeof(float));
        assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, qxt_d, sxt_d, x_d, NULL, n, rows0, K, err,
                                                               sizeof err), 0);
        assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, qdyt_d, sdyt_d, dy_d, NULL, n, rows0, N, err,
                                                               sizeof err), 0);
        const int64_t nw = (int64_t)n * N * K;
        float *dw0 = floats(nw);
        fill_log_uniform(dw0, nw, 7500 + (uint64_t)gc->seed, -6.0, 0.0);
        float *dw_seg_d = gpucheck_to_device(dw0, (size_t)nw * sizeof(float)), *dw_grp_d = gpucheck_to_device(dw0, (size_t)nw * sizeof(float));
        for (int g = 0, tiles = 0; g < n; g++) {
            const int rows = rows0[g + 1] - rows0[g];
            if (rows == 0) continue;
            fp8_gemm_wgrad(DEVICE_CUDA, dw_seg_d + (int64_t)g * N * K, qdyt_d + (size_t)N * FP8_TILE * tiles,
                           sdyt_d + (size_t)N * tiles, qxt_d + (size_t)K * FP8_TILE * tiles, sxt_d + (size_t)K * tiles, rows,
                           N, K);
            tiles += ceil_div(rows, FP8_TILE);
    }
    fp8_gemm_wgrad_grouped(DEVICE_CUDA, dw_grp_d, GRAD_ADD, qdyt_d, sdyt_d, qxt_d, sxt_d, n, rows0, N, K);
    float *dw_seg = gpucheck_to_host(dw_seg_d, (size_t)nw * sizeof(float)), *dw_grp = gpucheck_to_host(dw_grp_d, (size_t)nw * sizeof(float));
    dw_diff = count_diff(dw_grp, dw_seg, (size_t)nw * sizeof(float));
    // GRAD_WRITE over a poisoned dw (NaN) against GRAD_ADD onto zeros: equal values everywhere (a zero's sign may
    // differ: 0 + -0 is +0), the empty segments' zeros included
    float *dw_zero_d = gpu_zeros((size_t)nw * sizeof(float)), *dw_write_d = gpu_poisoned((size_t)nw * sizeof(float));
    fp8_gemm_wgrad_grouped(DEVICE_CUDA, dw_zero_d, GRAD_ADD, qdyt_d, sdyt_d, qxt_d, sxt_d, n, rows0, N, K);
    fp8_gemm_wgrad_grouped(DEVICE_CUDA, dw_write_d, GRAD_WRITE, qdyt_d, sdyt_d, qxt_d, sxt_d, n, rows0, N, K);
    float *dw_zero = gpucheck_to_host(dw_zero_d, (size_t)nw * sizeof(float));
    float *dw_write = gpucheck_to_host(dw_write_d, (size_t)nw * sizeof(float));
    write_diff = 0;
    for (int64_t i = 0; i < nw; i++) write_diff += !(dw_write[i] == dw_zero[i]);
    device_free(DEVICE_CUDA, dw_zero_d), device_free(DEVICE_CUDA, dw_write_d), free(dw_zero), free(dw_write);
    for (int64_t i = 0; i < nw; i++) dw_moved += dw_grp[i] != dw0[i];  // the check means something only if they moved
    device_free(DEVICE_CUDA, qxt_d), device_free(DEVICE_CUDA, qdyt_d), device_free(DEVICE_CUDA, sxt_d);
    device_free(DEVICE_CUDA, sdyt_d), device_free(DEVICE_CUDA, dw_seg_d), device_free(DEVICE_CUDA, dw_grp_d);
    free(dw0), free(dw_seg), free(dw_grp);
    }
    const int pass = y_diff == 0 && dx_diff == 0 && y_rows && dx_rows && wr_diff == 0 && wr_rows && two_diff == 0 &&
                     unperm_diff == 0 && res_diff == 0 && bf16_diff == 0 &&
                     (dw_diff == -1 || (dw_diff == 0 && write_diff == 0 && (T == 0 || dw_moved > 0)));
    printf("%-16s %2d segments, %4d rows, N %-4d K %-4d differing bytes vs per-segment: Fprop %d, Dgrad %d; "
           "Dgrad GRAD_WRITE differing values %d; 2 matrices vs 2 calls: %d bytes; unpermuted (also + 2 post arrays) vs "
           "slot order + moe_unpermute_backward: %d bytes; Fprop with a residual vs + add_inplace: %d bytes; BF16-output Fprop and "
           "Dgrad vs the converted values: %d differing; Wgrad grouped vs per segment: %d bytes (%d values changed), "
           "GRAD_WRITE over NaN vs GRAD_ADD onto zeros: %d values; only the rows inside written: %s  %s\n",
           "fp8 grouped", n, T, N, K, y_diff, dx_diff, wr_diff, two_diff, unperm_diff, res_diff, bf16_diff, dw_diff,
           dw_moved, write_diff,
           y_rows && dx_rows && wr_rows ? "yes" : "NO", pass ? "ok" : "FAIL");
    fflush(stdout);

    for (int g = 0; g < n; g++) {
        device_free(DEVICE_CUDA, (void *)qw[g]), device_free(DEVICE_CUDA, (void *)qwt[g]);
        device_free(DEVICE_CUDA, (void *)sw[g]);
    }
    device_free(DEVICE_CUDA, x_d), device_free(DEVICE_CUDA, dy_d), device_free(DEVICE_CUDA, w_d);
    device_free(DEVICE_CUDA, qx_d), device_free(DEVICE_CUDA, qdy_d), device_free(DEVICE_CUDA, sx_d);
    device_free(DEVICE_CUDA, sdy_d), device_free(DEVICE_CUDA, y_seg_d), device_free(DEVICE_CUDA, y_grp_d);
    device_free(DEVICE_CUDA, dx_seg_d), device_free(DEVICE_CUDA, dx_grp_d);
    device_free(DEVICE_CUDA, dx_zero_d), device_free(DEVICE_CUDA, dx_wr_d);
    device_free(DEVICE_CUDA, dx_two_d), device_free(DEVICE_CUDA, dx_seq_d);
    free(dx_two), free(dx_seq);
    free(x), free(dy), free(w), free(init), free(y_seg), free(y_grp), free(dx_seg), free(dx_grp);
    free(dx_zero), free(dx_wr);
    assert_true(pass);
}

// ---------------------------------------------------------------------------- BF16 GEMMs
typedef struct {
    int N, C, OC;
} Bf16Case;

static void test_bf16_matmul(void **state) {
    const Bf16Case *bc = *state;
    const int N = bc->N, C = bc->C, OC = bc->OC;
    const int64_t n_in = (int64_t)N * C, n_w = (int64_t)OC * C, n_out = (int64_t)N * OC;
    float *inp = floats(n_in), *w = floats(n_w), *dout = floats(n_out), *dinp0 = floats(n_in), *dw0 = floats(n_w);
    fill_log_uniform(inp, n_in, 9001, -6.0, 2.0);
    fill_log_uniform(w, n_w, 9002, -8.0, 0.0);
    fill_log_uniform(dout, n_out, 9003, -10.0, -2.0);
    fill_log_uniform(dinp0, n_in, 9004, -8.0, -2.0);
    fill_log_uniform(dw0, n_w, 9005, -4.0, 2.0);
    // BF16-rounded operands in double for the references
    double *ib = doubles(n_in), *wb = doubles(n_w), *gb = doubles(n_out);
    for (int64_t i = 0; i < n_in; i++) ib[i] = bf16_round(inp[i]);
    for (int64_t i = 0; i < n_w; i++) wb[i] = bf16_round(w[i]);
    for (int64_t i = 0; i < n_out; i++) gb[i] = bf16_round(dout[i]);

    float *inp_d = gpucheck_to_device(inp, (size_t)n_in * 4), *w_d = gpucheck_to_device(w, (size_t)n_w * 4);
    float *dout_d = gpucheck_to_device(dout, (size_t)n_out * 4);
    char shape[64];
    int pass = 1;

    // forward: out (N, OC)
    {
        float *cpu = host_poisoned((size_t)n_out * 4), *out_d = gpu_poisoned((size_t)n_out * 4);
        bf16_matmul_forward(DEVICE_CPU, cpu, inp, w, N, C, OC);
        bf16_matmul_forward(DEVICE_CUDA, out_d, inp_d, w_d, N, C, OC);
        float *gpu = gpucheck_to_host(out_d, (size_t)n_out * 4);
        bf16_matmul_forward(DEVICE_CUDA, out_d, inp_d, w_d, N, C, OC);
        float *gpu2 = gpucheck_to_host(out_d, (size_t)n_out * 4);
        double *want = doubles(n_out), *abs_sum = doubles(n_out), *bf = doubles(n_out), *bp = doubles(n_out);
        ref_gemm(want, abs_sum, ib, wb, N, OC, C);
        for (int64_t i = 0; i < n_out; i++) {
            const double big = fmax(fabs(want[i]), fmax(fabs((double)gpu[i]), fabs((double)cpu[i])));
            bf[i] = (2.0 * C + 16) * U_FP32 * abs_sum[i] + bf16_half_ulp(big) + FLT_MIN;
            bp[i] = (4.0 * C + 32) * U_FP32 * abs_sum[i] + 2 * bf16_half_ulp(big) + FLT_MIN;
        }
        snprintf(shape, sizeof shape, "%d x %d x %d", N, OC, C);
        pass &= check_gemm("bf16 forward", shape, gpu, cpu, want, bf, bp, n_out);
        pass &= check_repeat("bf16 forward", shape, gpu, gpu2, n_out);
        free(cpu), free(gpu), free(gpu2), free(want), free(abs_sum), free(bf), free(bp);
        device_free(DEVICE_CUDA, out_d);
    }
    // backward: dinp (N, C) += bf16(dout W); dweight (OC, C) += dout^T inp
    {
        float *dinp_c = floats(n_in), *dw_c = floats(n_w);
        memcpy(dinp_c, dinp0, (size_t)n_in * 4), memcpy(dw_c, dw0, (size_t)n_w * 4);
        bf16_matmul_backward(DEVICE_CPU, dinp_c, dw_c, dout, inp, w, N, C, OC);
        float *dinp_g[2], *dw_g[2];
        float *dinp_d = device_alloc(DEVICE_CUDA, (size_t)n_in * 4), *dw_d = device_alloc(DEVICE_CUDA, (size_t)n_w * 4);
        for (int rep = 0; rep < 2; rep++) {
            device_memcpy_from_host(DEVICE_CUDA, dinp_d, dinp0, (size_t)n_in * 4);
            device_memcpy_from_host(DEVICE_CUDA, dw_d, dw0, (size_t)n_w * 4);
            bf16_matmul_backward(DEVICE_CUDA, dinp_d, dw_d, dout_d, inp_d, w_d, N, C, OC);
            dinp_g[rep] = gpucheck_to_host(dinp_d, (size_t)n_in * 4), dw_g[rep] = gpucheck_to_host(dw_d, (size_t)n_w * 4);
        }
        // dinp: the sum over OC rounded to BF16, then one FP32 add to dinp0
        double *want = doubles(n_in), *abs_sum = doubles(n_in), *bf = doubles(n_in), *bp = doubles(n_in);
        double *wbt = transposed(wb, OC, C);
        ref_gemm(want, abs_sum, gb, wbt, N, C, OC);
        free(wbt);
        for (int64_t i = 0; i < n_in; i++) {
            const double sum = fabs(want[i]) * (1 + 0x1p-7) + (2.0 * OC + 16) * U_FP32 * abs_sum[i];
            want[i] += dinp0[i];
            const double fp32_add = 2 * U_FP32 * (fabs(want[i]) + sum);
            bf[i] = (2.0 * OC + 16) * U_FP32 * abs_sum[i] + bf16_half_ulp(sum) * 2 + fp32_add + FLT_MIN;
            bp[i] = 2 * bf[i];
        }
        snprintf(shape, sizeof shape, "%d x %d x %d", N, C, OC);
        pass &= check_gemm("bf16 dinp", shape, dinp_g[0], dinp_c, want, bf, bp, n_in);
        pass &= check_repeat("bf16 dinp", shape, dinp_g[0], dinp_g[1], n_in);
        free(want), free(abs_sum), free(bf), free(bp);
        // dweight: FP32 sum over N added to dw0
        want = doubles(n_w), abs_sum = doubles(n_w), bf = doubles(n_w), bp = doubles(n_w);
        double *gbt = transposed(gb, N, OC), *ibt = transposed(ib, N, C);
        ref_gemm(want, abs_sum, gbt, ibt, OC, C, N);
        free(gbt), free(ibt);
        for (int64_t i = 0; i < n_w; i++) {
            want[i] += dw0[i];
            bf[i] = (2.0 * N + 16) * U_FP32 * (abs_sum[i] + fabs((double)dw0[i])) + FLT_MIN;
            bp[i] = 2 * bf[i];
        }
        snprintf(shape, sizeof shape, "%d x %d x %d", OC, C, N);
        pass &= check_gemm("bf16 dweight", shape, dw_g[0], dw_c, want, bf, bp, n_w);
        pass &= check_repeat("bf16 dweight", shape, dw_g[0], dw_g[1], n_w);
        free(want), free(abs_sum), free(bf), free(bp);
        free(dinp_c), free(dw_c);
        for (int rep = 0; rep < 2; rep++) free(dinp_g[rep]), free(dw_g[rep]);
        device_free(DEVICE_CUDA, dinp_d), device_free(DEVICE_CUDA, dw_d);
    }
    device_free(DEVICE_CUDA, inp_d), device_free(DEVICE_CUDA, w_d), device_free(DEVICE_CUDA, dout_d);
    free(inp), free(w), free(dout), free(dinp0), free(dw0), free(ib), free(wb), free(gb);
    assert_true(pass);
}

// ---------------------------------------------------------------------------- BF16 GEMMs on rounded operands
// bf16_gemm_fprop_grouped_bf16 / _dgrad_grouped_bf16 (bf16 mode's FFNs): each value of their BF16 rows (stride
// bf16_rows_ld) against the FP32 forms' y (Fprop) and dx (Dgrad, GRAD_WRITE), which must hold the same BF16 values
// (the same GEMMs), and the columns past the width and the rows after the last untouched (poisoned). Returns the
// number of values or padding elements that differ.
static int bf16_forms_diff(const uint16_t *xb_d, const uint16_t *dyb_d, const uint16_t *const *wg_d, int n,
                           const int *rows0, int N, int K, const float *y, const float *dx) {
    const int T = rows0[n];
    int bad = 0;
    for (int dgrad = 0; dgrad < 2; dgrad++) {
        const int cols = dgrad ? K : N;
        const int64_t ld = bf16_rows_ld(cols), elems = (int64_t)(T + 1) * ld;
        uint16_t *o_d = gpu_poisoned((size_t)elems * 2);
        if (dgrad) bf16_gemm_dgrad_grouped_bf16(DEVICE_CUDA, o_d, dyb_d, wg_d, n, rows0, N, K);
        else bf16_gemm_fprop_grouped_bf16(DEVICE_CUDA, o_d, xb_d, wg_d, n, rows0, N, K);
        uint16_t *o = gpucheck_to_host(o_d, (size_t)elems * 2);
        const float *want = dgrad ? dx : y;
        for (int64_t r = 0; r <= T; r++)
            for (int64_t c = 0; c < ld; c++) {
                const uint16_t v = o[r * ld + c];
                if (r < T && c < cols) bad += bf16_to_float(v) != want[r * cols + c];
                else bad += v != 0xFFFF;
            }
        free(o);
        device_free(DEVICE_CUDA, o_d);
    }
    return bad;
}

// bf16 mode's SwiGLU operands (kernels.h swiglu_forward_bf16 / swiglu_backward_bf16, moe_combine_grad_bf16) on
// random BF16 rows (stride bf16_rows_ld, the padding poisoned): each output bitwise the CUDA composition it stands for
// (swiglu_forward / swiglu_backward / moe_combine_backward into FP32 arrays, then bf16_round_array), and against
// the CPU op: the combine's gradient bitwise (one FP32 product, rounded), the SwiGLU values within one BF16 ulp (CUDA's
// expf and glibc's exp differ by an ulp or two, docs/gpu.md, so a value may round to the neighbouring BF16).
typedef struct {
    int rows, width, topk;
} SwigluOperandCase;

static int64_t bf16_ulps_apart(uint16_t a, uint16_t b) {
    const int32_t x = a & 0x8000 ? -(int32_t)(a & 0x7FFF) : (int32_t)a;
    const int32_t y = b & 0x8000 ? -(int32_t)(b & 0x7FFF) : (int32_t)b;
    return x > y ? x - y : y - x;
}

static void test_bf16_swiglu_operands(void **state) {
    const SwigluOperandCase *sc = *state;
    const int rows = sc->rows, W = sc->width;
    const int64_t ld = bf16_rows_ld(W), nrow = (int64_t)(rows + 15) * ld, n = (int64_t)rows * W;
    float *av = floats(n), *bv = floats(n), *gv = floats(n);
    fill_log_uniform(av, n, 9301 + (uint64_t)W, -6.0, 3.0);
    fill_log_uniform(bv, n, 9302 + (uint64_t)W, -6.0, 2.0);
    fill_log_uniform(gv, n, 9303 + (uint64_t)W, -12.0, -2.0);
    uint16_t *a16 = host_poisoned((size_t)nrow * 2), *b16 = host_poisoned((size_t)nrow * 2);
    uint16_t *g16 = host_poisoned((size_t)nrow * 2);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < W; c++) {
            const int64_t i = (int64_t)r * W + c, at = r * ld + c;
            a16[at] = float_to_bf16(av[i]), b16[at] = float_to_bf16(bv[i]), g16[at] = float_to_bf16(gv[i]);
            av[i] = bf16_to_float(a16[at]), bv[i] = bf16_to_float(b16[at]), gv[i] = bf16_to_float(g16[at]);
        }
    uint16_t *a_d = gpucheck_to_device(a16, (size_t)nrow * 2), *b_d = gpucheck_to_device(b16, (size_t)nrow * 2);
    uint16_t *g_d = gpucheck_to_device(g16, (size_t)nrow * 2);
    // the ops, on the GPU and the CPU: h (forward), and h, da, db (backward)
    uint16_t *out_d[4], *out_g[4], *out_c[4];
    for (int i = 0; i < 4; i++) out_d[i] = gpu_poisoned((size_t)n * 2), out_c[i] = gpucheck_malloc((size_t)n * 2);
    swiglu_forward_bf16(DEVICE_CUDA, out_d[0], a_d, b_d, rows, W);
    swiglu_backward_bf16(DEVICE_CUDA, out_d[1], out_d[2], out_d[3], g_d, a_d, b_d, rows, W);
    swiglu_forward_bf16(DEVICE_CPU, out_c[0], a16, b16, rows, W);
    swiglu_backward_bf16(DEVICE_CPU, out_c[1], out_c[2], out_c[3], g16, a16, b16, rows, W);
    for (int i = 0; i < 4; i++) out_g[i] = gpucheck_to_host(out_d[i], (size_t)n * 2);
    // the compositions on the GPU
    float *af_d = gpucheck_to_device(av, (size_t)n * 4), *bf_d = gpucheck_to_device(bv, (size_t)n * 4);
    float *gf_d = gpucheck_to_device(gv, (size_t)n * 4), *t_d[3];
    uint16_t *want_d[3], *want[3];
    for (int i = 0; i < 3; i++)
        t_d[i] = device_alloc(DEVICE_CUDA, (size_t)n * 4), want_d[i] = gpu_poisoned((size_t)n * 2);
    swiglu_forward(DEVICE_CUDA, t_d[0], af_d, bf_d, n);
    swiglu_backward(DEVICE_CUDA, t_d[1], t_d[2], gf_d, af_d, bf_d, n);
    for (int i = 0; i < 3; i++) {
        bf16_round_array(DEVICE_CUDA, want_d[i], t_d[i], n);
        want[i] = gpucheck_to_host(want_d[i], (size_t)n * 2);
    }
    int comp_diff = 0, cpu_far = 0;
    for (int64_t i = 0; i < n; i++) {
        comp_diff += (out_g[0][i] != want[0][i]) + (out_g[1][i] != want[0][i]) + (out_g[2][i] != want[1][i]) +
                     (out_g[3][i] != want[2][i]);
        for (int k = 0; k < 4; k++) cpu_far += bf16_ulps_apart(out_g[k][i], out_c[k][i]) > 1;
    }
    // the combine's gradient: tokens = rows / topk, a permutation of the slots, dout FP32
    const int K = sc->topk, N = rows / K, C = W;
    const int64_t nd = (int64_t)N * C, ns = (int64_t)N * K * C;
    float *dout = floats(nd), *tw = floats((int64_t)N * K);
    fill_log_uniform(dout, nd, 9304 + (uint64_t)W, -14.0, -4.0);
    fill_log_uniform(tw, (int64_t)N * K, 9305 + (uint64_t)W, -3.0, 0.0);
    int *slot_of = gpucheck_malloc(sizeof(int) * (size_t)N * K);
    for (int s = 0; s < N * K; s++) slot_of[s] = s;
    for (int s = N * K - 1; s > 0; s--) {  // a fixed shuffle
        const int j = (int)(opcheck_uniform(9306, (uint64_t)s) * (s + 1)), t = slot_of[s];
        slot_of[s] = slot_of[j], slot_of[j] = t;
    }
    float *dout_d = gpucheck_to_device(dout, (size_t)nd * 4), *tw_d = gpucheck_to_device(tw, (size_t)N * K * 4);
    int *slot_d = gpucheck_to_device(slot_of, sizeof(int) * (size_t)N * K);
    uint16_t *dy_d = gpu_poisoned((size_t)ns * 2), *dy_c = gpucheck_malloc((size_t)ns * 2);
    uint16_t *dyw_d = gpu_poisoned((size_t)ns * 2);
    float *de_d = device_alloc(DEVICE_CUDA, (size_t)ns * 4);
    moe_combine_grad_bf16(DEVICE_CUDA, dy_d, dout_d, tw_d, slot_d, N, K, C);
    moe_combine_grad_bf16(DEVICE_CPU, dy_c, dout, tw, slot_of, N, K, C);
    moe_combine_backward(DEVICE_CUDA, de_d, NULL, dout_d, NULL, slot_d, tw_d, N, K, C);
    bf16_round_array(DEVICE_CUDA, dyw_d, de_d, ns);
    uint16_t *dy_g = gpucheck_to_host(dy_d, (size_t)ns * 2), *dyw = gpucheck_to_host(dyw_d, (size_t)ns * 2);
    int comb_cpu = 0, comb_comp = 0;
    for (int64_t i = 0; i < ns; i++) comb_cpu += dy_g[i] != dy_c[i], comb_comp += dy_g[i] != dyw[i];
    const int ok = comp_diff == 0 && cpu_far == 0 && comb_cpu == 0 && comb_comp == 0;
    printf("bf16 SwiGLU operands %d x %d (rows of %lld): h, da, db vs the CUDA ops + bf16_round_array: %d differing; "
           "vs the CPU: %d more than 1 BF16 ulp apart; combine grad (%d tokens x %d) vs CPU %d, vs "
           "moe_combine_backward + bf16_round_array %d differing  %s\n", rows, W, (long long)ld, comp_diff, cpu_far, N, K, comb_cpu,
           comb_comp, ok ? "ok" : "FAIL");
    for (int i = 0; i < 4; i++) device_free(DEVICE_CUDA, out_d[i]), free(out_g[i]), free(out_c[i]);
    for (int i = 0; i < 3; i++) device_free(DEVICE_CUDA, t_d[i]), device_free(DEVICE_CUDA, want_d[i]), free(want[i]);
    device_free(DEVICE_CUDA, a_d), device_free(DEVICE_CUDA, b_d), device_free(DEVICE_CUDA, g_d);
    device_free(DEVICE_CUDA, af_d), device_free(DEVICE_CUDA, bf_d), device_free(DEVICE_CUDA, gf_d);
    device_free(DEVICE_CUDA, dout_d), device_free(DEVICE_CUDA, tw_d), device_free(DEVICE_CUDA, slot_d);
    device_free(DEVICE_CUDA, dy_d), device_free(DEVICE_CUDA, dyw_d), device_free(DEVICE_CUDA, de_d);
    free(av), free(bv), free(gv), free(a16), free(b16), free(g16), free(dout), free(tw), free(slot_of);
    free(dy_g), free(dy_c), free(dyw);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- main
// bf16_gemm_fprop_grouped / _dgrad_grouped / _wgrad_grouped (train/linear.c's bf16 mode): groups of
// random length (every fifth empty) with their own weights; each output against the CPU's grouped result
// and a double reference with test_bf16_matmul's bounds, a second run bitwise equal (its Wgrad as one plain
// bf16_gemm_wgrad per group), and the row after the outputs (poisoned) untouched.
static void test_bf16_gemm_grouped(void **state) {
    const GroupedGemmCase *gc = *state;
    const int n = gc->n_seg, N = gc->N, K = gc->K;
    int rows0[FP8_MAX_SEGMENTS + 1] = {0};
    uint64_t r = 0x9E3779B97F4A7C15ull * (uint64_t)gc->seed;
    for (int g = 0; g < n; g++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        rows0[g + 1] = rows0[g] + (g % 5 == 1 ? 0 : (int)((r >> 33) % 191));
    }
    const int T = rows0[n];
    const int64_t nx = (int64_t)T * K, ndy = (int64_t)T * N, nw = (int64_t)n * N * K;
    float *x = floats(nx), *dy = floats(ndy), *w = floats(nw), *dx0 = floats(nx), *dw0 = floats(nw);
    fill_log_uniform(x, nx, 9101 + gc->seed, -6.0, 2.0);
    fill_log_uniform(dy, ndy, 9102 + gc->seed, -10.0, -2.0);
    fill_log_uniform(w, nw, 9103 + gc->seed, -8.0, 0.0);
    fill_log_uniform(dx0, nx, 9104 + gc->seed, -8.0, -2.0);
    fill_log_uniform(dw0, nw, 9105 + gc->seed, -4.0, 2.0);
    uint16_t *xb = gpucheck_malloc((size_t)nx * 2), *dyb = gpucheck_malloc((size_t)ndy * 2), *wb = gpucheck_malloc((size_t)nw * 2);
    bf16_round_array(DEVICE_CPU, xb, x, nx);
    bf16_round_array(DEVICE_CPU, dyb, dy, ndy);
    bf16_round_array(DEVICE_CPU, wb, w, nw);
    uint16_t *xb_d = gpucheck_to_device(xb, (size_t)nx * 2), *dyb_d = gpucheck_to_device(dyb, (size_t)ndy * 2);
    uint16_t *wb_d = gpucheck_to_device(wb, (size_t)nw * 2);
    const uint16_t *wg[FP8_MAX_SEGMENTS], *wg_d[FP8_MAX_SEGMENTS];
    for (int g = 0; g < n; g++) {
        const int empty = rows0[g + 1] == rows0[g];
        wg[g] = empty ? NULL : wb + (int64_t)g * N * K, wg_d[g] = empty ? NULL : wb_d + (int64_t)g * N * K;
    }
    // CPU results, then two GPU runs (outputs one row longer than the groups: the last row is poison)
    float *y_c = floats(ndy), *dx_c = floats(nx), *dw_c = floats(nw), *y_g[2], *dx_g[2], *dw_g[2];
    memcpy(dx_c, dx0, (size_t)nx * 4), memcpy(dw_c, dw0, (size_t)nw * 4);
    bf16_gemm_fprop_grouped(DEVICE_CPU, y_c, NULL, xb, wg, n, rows0, N, K);
    const uint16_t *dyb1[1] = {dyb}, *const *wg1[1] = {wg}, *dyb1_d[1] = {dyb_d}, *const *wg1_d[1] = {wg_d};
    bf16_gemm_dgrad_grouped(DEVICE_CPU, dx_c, GRAD_ADD, NULL, 1, dyb1, wg1, n, rows0, N, K);
    bf16_gemm_wgrad_grouped(DEVICE_CPU, dw_c, GRAD_ADD, dyb, xb, n, rows0, N, K);
    float *poison = host_poisoned((size_t)(N > K ? N : K) * 4);
    int pass = 1;
    for (int rep = 0; rep < 2; rep++) {
        float *y_d = gpu_poisoned((size_t)(ndy + N) * 4), *dx_d = gpu_poisoned((size_t)(nx + K) * 4);
        float *dw_d = device_alloc(DEVICE_CUDA, (size_t)nw * 4);
        device_memcpy_from_host(DEVICE_CUDA, dx_d, dx0, (size_t)nx * 4);
        device_memcpy_from_host(DEVICE_CUDA, dw_d, dw0, (size_t)nw * 4);
        bf16_gemm_fprop_grouped(DEVICE_CUDA, y_d, NULL, xb_d, wg_d, n, rows0, N, K);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, dx_d, GRAD_ADD, NULL, 1, dyb1_d, wg1_d, n, rows0, N, K);
        if (rep == 0) {
            bf16_gemm_wgrad_grouped(DEVICE_CUDA, dw_d, GRAD_ADD, dyb_d, xb_d, n, rows0, N, K);
        } else {  // one plain call per group: the grouped call's GEMMs (on several streams) must give these bits
            for (int g = 0; g < n; g++)
                bf16_gemm_wgrad(DEVICE_CUDA, dw_d + (int64_t)g * N * K, dyb_d + (int64_t)rows0[g] * N,
                                xb_d + (int64_t)rows0[g] * K, rows0[g + 1] - rows0[g], N, K);
        }
        y_g[rep] = gpucheck_to_host(y_d, (size_t)(ndy + N) * 4), dx_g[rep] = gpucheck_to_host(dx_d, (size_t)(nx + K) * 4);
        dw_g[rep] = gpucheck_to_host(dw_d, (size_t)nw * 4);
        pass &= memcmp(y_g[rep] + ndy, poison, (size_t)N * 4) == 0 && memcmp(dx_g[rep] + nx, poison, (size_t)K * 4) == 0;
        device_free(DEVICE_CUDA, y_d), device_free(DEVICE_CUDA, dx_d), device_free(DEVICE_CUDA, dw_d);
    }
    {  // Dgrad with GRAD_WRITE over poison: the value GRAD_ADD adds to zeros (the same GEMMs), the last row untouched
        float *wr_d = gpu_poisoned((size_t)(nx + K) * 4), *zero_d = gpu_poisoned((size_t)(nx + K) * 4);
        device_memset_zero(DEVICE_CUDA, zero_d, (size_t)nx * 4);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, wr_d, GRAD_WRITE, NULL, 1, dyb1_d, wg1_d, n, rows0, N, K);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, zero_d, GRAD_ADD, NULL, 1, dyb1_d, wg1_d, n, rows0, N, K);
        float *wr = gpucheck_to_host(wr_d, (size_t)(nx + K) * 4), *zero = gpucheck_to_host(zero_d, (size_t)(nx + K) * 4);
        int differing = 0;
        for (int64_t i = 0; i < nx; i++) differing += !(wr[i] == zero[i]);
        const int tail_ok = memcmp(wr + nx, poison, (size_t)K * 4) == 0;
        const int bf16_form_diff = bf16_forms_diff(xb_d, dyb_d, wg_d, n, rows0, N, K, y_g[0], wr);
        // two matrices in one call: the bits of the second single call added after the first
        const uint16_t *dyb2_d[2] = {dyb_d, dyb_d}, *const *wg2_d[2] = {wg_d, wg_d};
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, wr_d, GRAD_ADD, NULL, 2, dyb2_d, wg2_d, n, rows0, N, K);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, zero_d, GRAD_ADD, NULL, 1, dyb1_d, wg1_d, n, rows0, N, K);
        bf16_gemm_dgrad_grouped(DEVICE_CUDA, zero_d, GRAD_ADD, NULL, 1, dyb1_d, wg1_d, n, rows0, N, K);
        float *wr2 = gpucheck_to_host(wr_d, (size_t)nx * 4), *seq2 = gpucheck_to_host(zero_d, (size_t)nx * 4);
        const int two_diff = memcmp(wr2, seq2, (size_t)nx * 4) != 0;
        const int unperm_diff = unpermute_diff(T, K, dx0, NULL, NULL, dyb2_d, NULL, NULL, wg2_d, n, rows0, N);
        const Bf16FpropArgs fa = {xb_d, wg_d, n, N, K, rows0};
        const int res_diff = fprop_residual_diff(bf16_fprop_with_residual, &fa, T, N, 9106 + (uint64_t)gc->seed);
        // Wgrad with GRAD_WRITE over poison (NaN): the values GRAD_ADD gives on zeros, the empty groups' zeros too
        float *dww_d = gpu_poisoned((size_t)nw * 4), *dwz_d = gpu_zeros((size_t)nw * 4);
        bf16_gemm_wgrad_grouped(DEVICE_CUDA, dww_d, GRAD_WRITE, dyb_d, xb_d, n, rows0, N, K);
        bf16_gemm_wgrad_grouped(DEVICE_CUDA, dwz_d, GRAD_ADD, dyb_d, xb_d, n, rows0, N, K);
        float *dww = gpucheck_to_host(dww_d, (size_t)nw * 4), *dwz = gpucheck_to_host(dwz_d, (size_t)nw * 4);
        int wgrad_write_diff = 0;
        for (int64_t i = 0; i < nw; i++) wgrad_write_diff += !(dww[i] == dwz[i]);
        device_free(DEVICE_CUDA, dww_d), device_free(DEVICE_CUDA, dwz_d), free(dww), free(dwz);
        const int ok = differing == 0 && tail_ok && !two_diff && unperm_diff == 0 && res_diff == 0 &&
                       bf16_form_diff == 0 && wgrad_write_diff == 0;
        printf("%-16s %d groups, %d x %d x %d: Dgrad GRAD_WRITE vs GRAD_ADD onto zeros: %d differing values, last row "
               "untouched: %s; Wgrad the same: %d values; 2 matrices vs 2 calls: %s; unpermuted (also + 2 post arrays) "
               "vs slot order + moe_unpermute_backward: %d bytes; "
               "Fprop with a residual vs + add_inplace: %d bytes; *_bf16 forms vs the FP32 forms: %d values  %s\n",
               "bf16 grouped", n, T, N, K, differing, tail_ok ? "yes" : "NO", wgrad_write_diff,
               two_diff ? "DIFFERENT" : "same bits", unperm_diff, res_diff, bf16_form_diff, ok ? "ok" : "FAIL");
        pass &= ok;
        free(wr2), free(seq2);
        device_free(DEVICE_CUDA, wr_d), device_free(DEVICE_CUDA, zero_d);
        free(wr), free(zero);
    }
    // double references group by group, with test_bf16_matmul's bounds
    double *xd = doubles(nx), *dyd = doubles(ndy), *wd = doubles(nw);
    for (int64_t i = 0; i < nx; i++) xd[i] = bf16_round(x[i]);
    for (int64_t i = 0; i < ndy; i++) dyd[i] = bf16_round(dy[i]);
    for (int64_t i = 0; i < nw; i++) wd[i] = bf16_round(w[i]);
    double *y_w = doubles(ndy), *y_a = doubles(ndy), *dx_w = doubles(nx), *dx_a = doubles(nx);
    double *dw_w = doubles(nw), *dw_a = doubles(nw);
    for (int g = 0; g < n; g++) {
        const int r0 = rows0[g], m = rows0[g + 1] - rows0[g];
        const double *wgd = wd + (int64_t)g * N * K;
        if (m == 0) {
            for (int64_t i = 0; i < (int64_t)N * K; i++) dw_w[(int64_t)g * N * K + i] = 0, dw_a[(int64_t)g * N * K + i] = 0;
            continue;
        }
        ref_gemm(y_w + (int64_t)r0 * N, y_a + (int64_t)r0 * N, xd + (int64_t)r0 * K, wgd, m, N, K);
        double *wt = transposed(wgd, N, K), *dyt = transposed(dyd + (int64_t)r0 * N, m, N);
        double *xt = transposed(xd + (int64_t)r0 * K, m, K);
        ref_gemm(dx_w + (int64_t)r0 * K, dx_a + (int64_t)r0 * K, dyd + (int64_t)r0 * N, wt, m, K, N);
        ref_gemm(dw_w + (int64_t)g * N * K, dw_a + (int64_t)g * N * K, dyt, xt, N, K, m);
        free(wt), free(dyt), free(xt);
    }
    double *bf = doubles(nx > nw ? (nx > ndy ? nx : ndy) : (nw > ndy ? nw : ndy));
    double *bp = doubles(nx > nw ? (nx > ndy ? nx : ndy) : (nw > ndy ? nw : ndy));
    char shape[64];
    snprintf(shape, sizeof shape, "%d groups, %d x %d x %d", n, T, N, K);
    for (int64_t i = 0; i < ndy; i++) {
        const double big = fmax(fabs(y_w[i]), fmax(fabs((double)y_g[0][i]), fabs((double)y_c[i])));
        bf[i] = (2.0 * K + 16) * U_FP32 * y_a[i] + bf16_half_ulp(big) + FLT_MIN;
        bp[i] = (4.0 * K + 32) * U_FP32 * y_a[i] + 2 * bf16_half_ulp(big) + FLT_MIN;
    }
    pass &= check_gemm("bf16 fprop grp", shape, y_g[0], y_c, y_w, bf, bp, ndy);
    pass &= check_repeat("bf16 fprop grp", shape, y_g[0], y_g[1], ndy);
    for (int64_t i = 0; i < nx; i++) {
        const double sum = fabs(dx_w[i]) * (1 + 0x1p-7) + (2.0 * N + 16) * U_FP32 * dx_a[i];
        dx_w[i] += dx0[i];
        bf[i] = (2.0 * N + 16) * U_FP32 * dx_a[i] + bf16_half_ulp(sum) * 2 + 2 * U_FP32 * (fabs(dx_w[i]) + sum) + FLT_MIN;
        bp[i] = 2 * bf[i];
    }
    pass &= check_gemm("bf16 dgrad grp", shape, dx_g[0], dx_c, dx_w, bf, bp, nx);
    pass &= check_repeat("bf16 dgrad grp", shape, dx_g[0], dx_g[1], nx);
    for (int64_t i = 0; i < nw; i++) {
        dw_w[i] += dw0[i];
        bf[i] = (2.0 * T + 16) * U_FP32 * (dw_a[i] + fabs((double)dw0[i])) + FLT_MIN;
        bp[i] = 2 * bf[i];
    }
    pass &= check_gemm("bf16 wgrad grp", shape, dw_g[0], dw_c, dw_w, bf, bp, nw);
    pass &= check_repeat("bf16 wgrad grp", shape, dw_g[0], dw_g[1], nw);
    device_free(DEVICE_CUDA, xb_d), device_free(DEVICE_CUDA, dyb_d), device_free(DEVICE_CUDA, wb_d);
    for (int rep = 0; rep < 2; rep++) free(y_g[rep]), free(dx_g[rep]), free(dw_g[rep]);
    free(x), free(dy), free(w), free(dx0), free(dw0), free(xb), free(dyb), free(wb), free(y_c), free(dx_c), free(dw_c);
    free(poison), free(xd), free(dyd), free(wd), free(y_w), free(y_a), free(dx_w), free(dx_a), free(dw_w), free(dw_a);
    free(bf), free(bp);
    assert_true(pass);
}

static int print_quant_header(void **state) {
    (void)state;
    printf("\n%-18s %-16s %9s %9s %9s %11s %11s %8s %8s\n", "quantiser", "rows x cols", "q differ", "qt differ",
           "s differ", "gpu |q-x/s|", "cpu |q-x/s|", "gpu bad", "cpu bad");
    printf("%-18s %-16s %9s %9s %9s %11s %11s %8s %8s\n", "", "", "(bytes)", "(bytes)", "(scales)", "/half step",
           "/half step", "(defn)", "(defn)");
    return 0;
}
static int print_gemm_header_setup(void **state) {
    (void)state;
    print_gemm_header();
    return 0;
}

int main(void) {
    if (gpucheck_devices("test_gpu_fp8") == 0) return 1;
    static QuantCase q_a = {Q_1X128, 576, 300, 0}, q_b = {Q_1X128, 130, 1024, 0}, q_c = {Q_1X128, 33, 130, 0};
    static QuantCase q_d = {Q_128X128, 576, 300, 1}, q_e = {Q_128X128, 256, 1024, 0}, q_f = {Q_128X128, 100, 2100, 1};
    static QuantCase q_g = {Q_128X1T, 300, 576, 0}, q_h = {Q_128X1T, 200, 300, 0}, q_i = {Q_128X1T, 1000, 70, 0};
    static GemmCase f_a = {G_FPROP, 256, 576, 300, 0, 0}, f_b = {G_FPROP, 208, 256, 1024, 8, 0};
    static GemmCase f_c = {G_FPROP, 16, 2048, 512, 0, 0}, f_d = {G_FPROP, 45, 256, 384, 0, 0};
    static GemmCase d_a = {G_DGRAD, 256, 576, 300, 0, 0}, d_b = {G_DGRAD, 128, 1024, 512, 0, 0};
    static GemmCase d_c = {G_DGRAD, 200, 640, 256, 0, 0};
    static GemmCase w_a = {G_WGRAD, 300, 576, 300, 0, 0}, w_b = {G_WGRAD, 1000, 256, 512, 0, 1};
    static BothCase both_a = {300, 576}, both_b = {45, 200}, both_c = {1000, 70}, both_d = {3072, 2048};
    // the norm's shapes: partial blocks, a width off 4 (the scalar loads), MLA's latent and block widths
    static BothCase norm_a = {300, 576}, norm_b = {45, 202}, norm_c = {1000, 512}, norm_d = {2048, 2048};
    static GroupedCase gr_a = {5, 300, 1}, gr_b = {32, 2048, 2}, gr_c = {32, 1024, 3}, gr_d = {7, 70, 4};
    // SwiGLU quantisers (and the joint da, db one): one segment; an empty segment, partial 128-tiles and 333 rows (off 16) at whole tiles, at a
    // partial last tile (200) and at a width off 4 (202: scalar loads); 6 segments of ~3000 rows (one empty) at
    // C = 1024, with a or b and dout 4 bytes into their buffers (scalar loads), and at C = 202.
    static const int sw_one[] = {0, 300}, sw_mix[] = {0, 37, 37, 200, 333};
    static const int sw_big[] = {0, 700, 700, 1451, 2000, 2533, 3001};
    static SwigluCase sw_a = {1, sw_one, 384, 0, 1}, sw_b = {4, sw_mix, 384, 0, 2}, sw_c = {4, sw_mix, 200, 0, 3};
    static SwigluCase sw_d = {4, sw_mix, 202, 0, 4}, sw_e = {6, sw_big, 1024, 0, 5}, sw_f = {6, sw_big, 1024, 1, 6};
    static SwigluCase sw_g = {6, sw_big, 1024, 2, 7}, sw_h = {6, sw_big, 202, 0, 8};
    // The pipelined both-layouts kernel (the SwiGLU output and the joint da, db quantiser at whole column tiles and
    // aligned rows: sw_a, sw_b, sw_e) with about ten tiles per block, so that each block's two shared-memory stages
    // take turns: 9 segments of 21,000 rows (one empty, one of 50 rows) at C = 1024.
    static const int sw_many[] = {0, 2900, 2900, 6001, 9000, 11111, 15000, 18000, 18050, 21000};
    static SwigluCase sw_i = {9, sw_many, 1024, 0, 9};
    // The combine's gradient through the routing plan: one empty expert segment always; 150 tokens at whole tiles and a
    // partial last tile; 2048 tokens x 6 of 32 experts at C = 1024 (vector loads), with dout 4 bytes into its buffer
    // (scalar loads), and at C = 202 (scalar loads).
    static CombineGradCase cg_a = {150, 3, 8, 384, 0, 1}, cg_b = {150, 3, 8, 200, 0, 2};
    static CombineGradCase cg_c = {2048, 6, 32, 1024, 0, 3}, cg_d = {2048, 6, 32, 1024, 1, 4};
    static CombineGradCase cg_e = {2048, 6, 32, 202, 0, 5};
    static Bf16Case b_a = {256, 300, 576}, b_b = {128, 512, 1024};
    static GroupedGemmCase gg_a = {5, 576, 302, 1}, gg_b = {32, 1030, 512, 2}, gg_c = {32, 256, 2048, 3};
    // bf16: a runs on cuBLASLt (K % 8 != 0), b, c, d on the own kernel's BF16 Fprop and Dgrad (fp8_grouped_gemm.h):
    // b both in the wide form; c's Fprop wide (its last 56 columns dropped by TMA, the padding untouched), its Dgrad
    // single (304 columns); d's Fprop single with a K tail, its Dgrad wide (136 columns, a contraction of 384)
    static GroupedGemmCase bg_a = {5, 200, 300, 4}, bg_b = {32, 256, 512, 5}, bg_c = {9, 200, 304, 6},
                           bg_d = {7, 384, 136, 7};
    static SwigluOperandCase so_a = {111, 198, 3}, so_b = {240, 1024, 6};  // the scalar and the 4-wide paths
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_division_matches_ieee),
        cmocka_unit_test_prestate_setup_teardown(test_quantizer, print_quant_header, NULL, &q_a),
        cmocka_unit_test_prestate(test_quantizer, &q_b),
        cmocka_unit_test_prestate(test_quantizer, &q_c),
        cmocka_unit_test_prestate(test_quantizer, &q_d),
        cmocka_unit_test_prestate(test_quantizer, &q_e),
        cmocka_unit_test_prestate(test_quantizer, &q_f),
        cmocka_unit_test_prestate(test_quantizer, &q_g),
        cmocka_unit_test_prestate(test_quantizer, &q_h),
        cmocka_unit_test_prestate(test_quantizer, &q_i),
        cmocka_unit_test(test_quantizer_nonfinite),
        cmocka_unit_test(test_quantize_128x128_batched),
        cmocka_unit_test(test_bf16_round_rows),
        cmocka_unit_test(test_bf16_widen_array),
        cmocka_unit_test_prestate(test_quantize_both, &both_a),
        cmocka_unit_test_prestate(test_quantize_both, &both_b),
        cmocka_unit_test_prestate(test_quantize_both, &both_c),
        cmocka_unit_test_prestate(test_quantize_both, &both_d),
        cmocka_unit_test_prestate(test_quantize_rmsnorm, &norm_a),
        cmocka_unit_test_prestate(test_quantize_rmsnorm, &norm_b),
        cmocka_unit_test_prestate(test_quantize_rmsnorm, &norm_c),
        cmocka_unit_test_prestate(test_quantize_rmsnorm, &norm_d),
        cmocka_unit_test_prestate(test_quantize_grouped, &gr_a),
        cmocka_unit_test_prestate(test_quantize_grouped, &gr_b),
        cmocka_unit_test_prestate(test_quantize_grouped, &gr_c),
        cmocka_unit_test_prestate(test_quantize_grouped, &gr_d),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_a),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_b),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_c),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_d),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_e),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_f),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_g),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_h),
        cmocka_unit_test_prestate(test_quantize_swiglu, &sw_i),
        cmocka_unit_test(test_quantize_swiglu_nonfinite),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_a),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_b),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_c),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_d),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_e),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_f),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_g),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_h),
        cmocka_unit_test_prestate(test_quantize_swiglu_grads, &sw_i),
        cmocka_unit_test(test_quantize_swiglu_grads_nonfinite),
        cmocka_unit_test_prestate(test_quantize_combine_grad, &cg_a),
        cmocka_unit_test_prestate(test_quantize_combine_grad, &cg_b),
        cmocka_unit_test_prestate(test_quantize_combine_grad, &cg_c),
        cmocka_unit_test_prestate(test_quantize_combine_grad, &cg_d),
        cmocka_unit_test_prestate(test_quantize_combine_grad, &cg_e),
        cmocka_unit_test(test_quantize_combine_grad_nonfinite),
        cmocka_unit_test_prestate_setup_teardown(test_fp8_gemm, print_gemm_header_setup, NULL, &f_a),
        cmocka_unit_test_prestate(test_fp8_gemm, &f_b),
        cmocka_unit_test_prestate(test_fp8_gemm, &f_c),
        cmocka_unit_test_prestate(test_fp8_gemm, &f_d),
        cmocka_unit_test_prestate(test_fp8_gemm, &d_a),
        cmocka_unit_test_prestate(test_fp8_gemm, &d_b),
        cmocka_unit_test_prestate(test_fp8_gemm, &d_c),
        cmocka_unit_test_prestate(test_fp8_gemm, &w_a),
        cmocka_unit_test_prestate(test_fp8_gemm, &w_b),
        cmocka_unit_test_prestate(test_fp8_gemm_grouped, &gg_a),
        cmocka_unit_test_prestate(test_fp8_gemm_grouped, &gg_b),
        cmocka_unit_test_prestate(test_fp8_gemm_grouped, &gg_c),
        cmocka_unit_test_prestate(test_bf16_matmul, &b_a),
        cmocka_unit_test_prestate(test_bf16_matmul, &b_b),
        cmocka_unit_test_prestate(test_bf16_gemm_grouped, &bg_a),
        cmocka_unit_test_prestate(test_bf16_gemm_grouped, &bg_b),
        cmocka_unit_test_prestate(test_bf16_gemm_grouped, &bg_c),
        cmocka_unit_test_prestate(test_bf16_gemm_grouped, &bg_d),
        cmocka_unit_test_prestate(test_bf16_swiglu_operands, &so_a),
        cmocka_unit_test_prestate(test_bf16_swiglu_operands, &so_b),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
