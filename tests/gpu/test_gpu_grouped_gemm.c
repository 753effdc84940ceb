/*
 * test_gpu_grouped_gemm.c - fp8moe's own grouped FP8 GEMM (kernels/cuda/fp8_grouped_gemm.cu), in both forms the model
 * runs on it with FP8MOE_GROUPED_GEMM=own: kernels.h's fp8_gemm_fprop_grouped_bf16 and fp8_gemm_dgrad_grouped_bf16
 * (the weights' transposed codes and scales), each called through kernels.h with the own kernel selected
 * (cuda_fp8_grouped_gemm_use_own(1)) against the CPU reference of the same FP8 operands (the same call on DEVICE_CPU,
 * kernels/cpu/fp8.c) and against the cuBLASLt path (use_own(0): one GEMM per segment), in each of the kernel's
 * forms (fp8_grouped_gemm.h: 128 x 256 output tiles, 128 x 128 tiles). Runs only on a Hopper GPU
 * (tests/gpu/run.sh); with no visible GPU it FAILS.
 *
 * Inputs are fresh random values every run (the seed is printed; FP8MOE_TEST_SEED=<n> repeats a run): non-zero,
 * random signs, magnitudes spread over 8 binades, so tiles have different scales and E4M3 subnormals occur. They are
 * quantised by the CUDA quantisers (bit-identical to the CPU's: test_gpu_fp8) and the CPU and both GPU GEMMs read
 * the same bytes. Segment lengths are uneven: empty segments, lengths that are not multiples of 128 or of 16, a
 * segment of one row, segments longer than one row tile, N and K that are not multiples of 128 (padded blocks), odd
 * and even numbers of output column blocks (the two-block forms run only for even ones), the bench-1gpu expert shapes
 * (w1,w3 and w2 Fprop, w2 Dgrad; 32 segments), and more non-empty segments than one launch takes (80).
 *
 * Tolerance, per output element, |own - cpu| <= (2^-10 + 4 KB 2^-24) S (1 + 2^-7) + ulp_bf16(max(|own|, |cpu|))
 * (KB: the contraction's 128-blocks): both compute sum over K blocks of P_kb s_x s_w from the same E4M3 values and
 * scales. The CPU's P_kb is exact (then
 * rounded to FP32); the tensor cores add a block's 128 products with reduced precision, within 2^-10 of S = sum_k
 * |a_k s_a b_k s_b| (DESIGN.md section 4, the bound cuBLASLt's path is held to in test_gpu_fp8). The promotion
 * (CPU: acc + (P s_x) s_w; here fma(P, s_x s_w, acc)) differs by a few FP32 roundings per block, within 4 KB 2^-24
 * S. Both round their FP32 result to BF16 (half an ulp each, so one ulp of the larger between them). S itself is
 * computed by the same CPU GEMM on |a| and |b| (sign bits cleared) in BF16 (hence the 1 + 2^-7). Against cuBLASLt
 * both sides carry the tensor-core term: twice the first term. Columns N.. of a row must be 0 exactly, the
 * 15 rows after the last must be untouched (poison), and the share of elements bitwise equal to the CPU's and to
 * cuBLASLt's is printed (with the same tensor-core sums and promotion order most agree exactly), and the own kernel
 * must equal cuBLASLt bit for bit (the model's bits do not depend on which kernel runs, FP8MOE_GROUPED_GEMM).
 * The FP32-output forms (kernels.h's fp8_gemm_fprop_grouped, and fp8_gemm_dgrad_grouped of two matrices, whose
 * products go through gemm.cu's conversion scratch at the operand's padded rows) must also give cuBLASLt's bits.
 * Determinism: each variant runs twice into freshly poisoned outputs; the results must be bitwise identical, and the
 * forms must agree bit for bit (same products, same order).
 * The Wgrad form (cuda_fp8_grouped_wgrad: dW_g += dY_g^T X_g on 128x1 operands, the contraction over each segment's
 * tokens; not used by the model yet, being slower than cuBLASLt) has its own cases and bound (test_grouped_wgrad); its
 * bits against cuBLASLt's are reported, not required (they differ in 25-40% of the elements: the two promote the
 * per-column scales in different orders), and cuBLASLt's own ratio to the CPU bound is printed beside it. Its wide
 * form (128 x 256 tiles, the default) must give the 128 x 128 form's bits.
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
#include <time.h>

#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/kernels.h"
#include "tests/gpu/gpucheck.h"
#include "unit/opcheck.h"

#define TC_REL 0x1p-10  // tensor-core accumulation inside a 128-block (DESIGN.md section 4)
#define N_VARIANTS 2     // of the own kernel: fp8_grouped_gemm.h's forms, wide and single

static uint64_t run_seed;

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------- buffers
// A device buffer of 0xFF bytes: NaN as BF16 (0xFFFF) and as E4M3.
static void poison_device(void *d, size_t bytes) {
    void *h = gpucheck_malloc(bytes);
    memset(h, 0xFF, bytes);
    device_memcpy_from_host(DEVICE_CUDA, d, h, bytes);
    free(h);
}

// x (n): random sign, |x| = 2^e with e uniform in [lo_exp, hi_exp): non-zero, many binades.
static void fill_log_uniform(float *x, int64_t n, uint64_t seed, double lo_exp, double hi_exp) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const double e = lo_exp + (hi_exp - lo_exp) * opcheck_uniform(seed, 2 * (uint64_t)i);
        const double sign = opcheck_uniform(seed, 2 * (uint64_t)i + 1) < 0.5 ? -1.0 : 1.0;
        x[i] = (float)(sign * exp2(e));
    }
}

// One ulp of BF16 (8 significant bits) at |v|; the smallest normal's ulp below it.
static double bf16_ulp(double v) {
    const double a = fmax(fabs(v), (double)FLT_MIN);
    return ldexp(1.0, (int)floor(log2(a)) - 7);
}

// ---------------------------------------------------------------------------- cases
typedef struct {
    const char *name;
    int n_seg;
    const int *lengths;  // n_seg lengths; NULL: random in [lo, hi], segment 1 empty, segment 2 of 77 rows
    int lo, hi;
    int N, K;   // the weights (N, K)
    int dgrad;  // 0: Fprop y (T, N) = x W^T; 1: Dgrad dx (T, K) = dy W
} Case;

// The segments' row offsets (n + 1 entries).
static void case_rows0(const Case *c, uint64_t seed, int *rows0) {
    rows0[0] = 0;
    for (int g = 0; g < c->n_seg; g++) {
        int len = c->lengths != NULL ? c->lengths[g]
                                     : c->lo + (int)(opcheck_uniform(seed, (uint64_t)g) * (double)(c->hi - c->lo + 1));
        if (c->lengths == NULL && g == 1) len = 0;
        if (c->lengths == NULL && g == 2) len = 77;
        rows0[g + 1] = rows0[g] + len;
    }
}

// The FP8 operands of one case on both sides: the device ones (CUDA quantisers) and their host copies. The GEMM
// reads a (T, C) 1x128 operand and the weights' codes (the Dgrad's: transposed) and writes O columns.
typedef struct {
    int n, T, P16, N, K, dgrad;
    int C, CB, Cp, O, Op;  // contraction, its 128-blocks and padded length; output columns and their row stride
    size_t qw_bytes;       // one weight's codes (either layout)
    int rows0[FP8_MAX_SEGMENTS + 1];
    uint8_t *qx_d, *qx;
    float *sx_d, *sx;
    const uint8_t *qw_d[FP8_MAX_SEGMENTS], *qw[FP8_MAX_SEGMENTS];  // the codes the GEMM reads
    const float *sw_d[FP8_MAX_SEGMENTS], *sw[FP8_MAX_SEGMENTS];
    uint8_t *codes_d[FP8_MAX_SEGMENTS][2];  // both code layouts on the device, for freeing
} Operands;

static void operands_make(Operands *o, const Case *c, uint64_t seed) {
    memset(o, 0, sizeof *o);
    o->n = c->n_seg, o->N = c->N, o->K = c->K, o->dgrad = c->dgrad;
    o->C = c->dgrad ? c->N : c->K, o->O = c->dgrad ? c->K : c->N;
    case_rows0(c, seed, o->rows0);
    o->T = o->rows0[o->n];
    for (int g = 0; g < o->n; g++) o->P16 += ceil_div(o->rows0[g + 1] - o->rows0[g], 16) * 16;
    o->CB = ceil_div(o->C, FP8_TILE), o->Cp = o->CB * FP8_TILE, o->Op = ceil_div(o->O, FP8_TILE) * FP8_TILE;
    char err[256] = "";

    float *x = gpucheck_malloc((size_t)o->T * o->C * sizeof(float));
    fill_log_uniform(x, (int64_t)o->T * o->C, seed + 1, -6.0, 2.0);
    float *x_d = device_alloc(DEVICE_CUDA, (size_t)o->T * o->C * sizeof(float) + 16);
    device_memcpy_from_host(DEVICE_CUDA, x_d, x, (size_t)o->T * o->C * sizeof(float));
    const size_t qx_bytes = (size_t)o->P16 * o->Cp, sx_bytes = (size_t)o->CB * o->P16 * sizeof(float);
    o->qx_d = device_alloc(DEVICE_CUDA, qx_bytes + 16), o->sx_d = device_alloc(DEVICE_CUDA, sx_bytes + 16);
    poison_device(o->qx_d, qx_bytes + 16), poison_device(o->sx_d, sx_bytes + 16);
    assert_int_equal(fp8_quantize_1x128_grouped(DEVICE_CUDA, o->qx_d, o->sx_d, x_d, NULL, o->n, o->rows0, o->C, err,
                                                sizeof err), 0);
    device_free(DEVICE_CUDA, x_d), free(x);

    const int NB = ceil_div(c->N, FP8_TILE), KB = ceil_div(c->K, FP8_TILE), KB4 = (KB + 3) / 4 * 4;
    const size_t w_elems = (size_t)c->N * c->K, qw_bytes = o->qw_bytes = (size_t)NB * KB * FP8_TILE * FP8_TILE;
    const size_t sw_bytes = (size_t)NB * KB4 * sizeof(float);
    float *w = gpucheck_malloc(w_elems * sizeof(float));
    float *w_d = device_alloc(DEVICE_CUDA, w_elems * sizeof(float));
    for (int g = 0; g < o->n; g++) {
        if (o->rows0[g + 1] == o->rows0[g]) continue;
        fill_log_uniform(w, (int64_t)w_elems, seed + 100 + (uint64_t)g, -8.0, 0.0);
        device_memcpy_from_host(DEVICE_CUDA, w_d, w, w_elems * sizeof(float));
        uint8_t *q = device_alloc(DEVICE_CUDA, qw_bytes), *qt = device_alloc(DEVICE_CUDA, qw_bytes);
        float *s = device_alloc(DEVICE_CUDA, sw_bytes);
        assert_int_equal(fp8_quantize_128x128(DEVICE_CUDA, q, qt, s, w_d, c->N, c->K, err, sizeof err), 0);
        o->codes_d[g][0] = q, o->codes_d[g][1] = qt;
        o->qw_d[g] = c->dgrad ? qt : q, o->sw_d[g] = s;
        o->qw[g] = gpucheck_to_host(o->qw_d[g], qw_bytes), o->sw[g] = gpucheck_to_host(s, sw_bytes);
    }
    device_free(DEVICE_CUDA, w_d), free(w);
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
    o->qx = gpucheck_to_host(o->qx_d, qx_bytes), o->sx = gpucheck_to_host(o->sx_d, sx_bytes);
}

static void operands_free(Operands *o) {
    for (int g = 0; g < o->n; g++) {
        if (o->qw_d[g] == NULL) continue;
        device_free(DEVICE_CUDA, o->codes_d[g][0]), device_free(DEVICE_CUDA, o->codes_d[g][1]);
        device_free(DEVICE_CUDA, (void *)o->sw_d[g]);
        free((void *)o->qw[g]), free((void *)o->sw[g]);
    }
    device_free(DEVICE_CUDA, o->qx_d), device_free(DEVICE_CUDA, o->sx_d);
    free(o->qx), free(o->sx);
}

// The case's GEMM through kernels.h on dev: the Fprop or the Dgrad with BF16 output.
static void run_gemm(const Operands *o, Device dev, uint16_t *y, const uint8_t *qx, const float *sx,
                     const uint8_t *const *qw, const float *const *sw) {
    if (o->dgrad) fp8_gemm_dgrad_grouped_bf16(dev, y, qx, sx, qw, sw, o->n, o->rows0, o->N, o->K);
    else fp8_gemm_fprop_grouped_bf16(dev, y, qx, sx, qw, sw, o->n, o->rows0, o->N, o->K);
}

// The case's GEMM in kernels.h's FP32-output form on the GPU with the own kernel (own = 1) or cuBLASLt: the Fprop
// written into y (T, O), or the Dgrad of two matrices (the same weights twice, as w1 and w3) written over y, which
// goes through the conversion scratch at the operand's padded rows. Returns the host copy of y.
static float *run_gemm_f32(const Operands *o, int own) {
    const size_t bytes = (size_t)o->T * o->O * sizeof(float);
    float *y_d = device_alloc(DEVICE_CUDA, bytes + 16);
    poison_device(y_d, bytes + 16);
    const int before = cuda_fp8_grouped_gemm_use_own(own);
    if (o->dgrad) {
        const uint8_t *qdy[2] = {o->qx_d, o->qx_d}, *const *qwt[2] = {o->qw_d, o->qw_d};
        const float *sdy[2] = {o->sx_d, o->sx_d}, *const *sw[2] = {o->sw_d, o->sw_d};
        fp8_gemm_dgrad_grouped(DEVICE_CUDA, y_d, GRAD_WRITE, NULL, 2, qdy, sdy, qwt, sw, o->n, o->rows0, o->N, o->K);
    } else {
        fp8_gemm_fprop_grouped(DEVICE_CUDA, y_d, NULL, o->qx_d, o->sx_d, o->qw_d, o->sw_d, o->n, o->rows0, o->N, o->K);
    }
    cuda_fp8_grouped_gemm_use_own(before);
    float *y = gpucheck_to_host(y_d, bytes);
    device_free(DEVICE_CUDA, y_d);
    return y;
}

// A copy of n E4M3 codes with their sign bits cleared: the magnitudes (scales are positive, so a GEMM of these is
// sum_k |a s_a b s_b|).
static uint8_t *abs_codes(const uint8_t *q, size_t n) {
    uint8_t *a = gpucheck_malloc(n);
    for (size_t i = 0; i < n; i++) a[i] = q[i] & 0x7F;
    return a;
}

// The same GEMM on |a| and |b| (abs_codes): S (T, O) = sum_k |a s_a b s_b|, rounded to BF16 by the CPU op.
static float *abs_sums(const Operands *o) {
    uint8_t *qx = abs_codes(o->qx, (size_t)o->P16 * o->Cp);
    const uint8_t *qw[FP8_MAX_SEGMENTS] = {NULL};
    for (int g = 0; g < o->n; g++)
        if (o->qw[g] != NULL) qw[g] = abs_codes(o->qw[g], o->qw_bytes);
    uint16_t *s16 = gpucheck_malloc((size_t)bf16_rows_elems(o->T, o->O) * sizeof(uint16_t));
    run_gemm(o, DEVICE_CPU, s16, qx, o->sx, qw, o->sw);
    float *S = gpucheck_malloc((size_t)o->T * o->O * sizeof(float) + 1);
    for (int64_t r = 0; r < o->T; r++)
        for (int64_t j = 0; j < o->O; j++) S[r * o->O + j] = bf16_to_float(s16[r * o->Op + j]);
    for (int g = 0; g < o->n; g++) free((void *)qw[g]);
    free(qx), free(s16);
    return S;
}

// ---------------------------------------------------------------------------- the comparison
typedef struct {
    double max_abs, max_ratio;  // max |x - ref|, max |x - ref| / bound
    int64_t worst, equal, n;
} Cmp;

// x against ref over the T x O valid elements (BF16 bits, row stride Op) with the bound of the file comment, tc_terms
// tensor-core terms.
static Cmp compare(const Operands *o, const uint16_t *x, const uint16_t *ref, const float *S, int tc_terms) {
    Cmp c = {0, 0, 0, 0, 0};
    const double rel = (tc_terms * TC_REL + 4.0 * o->CB * 0x1p-24) * (1.0 + 0x1p-7);
    for (int64_t r = 0; r < o->T; r++)
        for (int64_t j = 0; j < o->O; j++) {
            const int64_t i = r * o->Op + j;
            const double a = bf16_to_float(x[i]), b = bf16_to_float(ref[i]);
            const double bound = rel * S[r * o->O + j] + bf16_ulp(fmax(fabs(a), fabs(b)));
            double ratio = fabs(a - b) / bound;
            if (isnan(ratio)) ratio = INFINITY;
            if (!(ratio <= c.max_ratio)) c.max_ratio = ratio, c.worst = r * o->O + j;
            if (fabs(a - b) > c.max_abs) c.max_abs = fabs(a - b);
            c.equal += x[i] == ref[i];
            c.n++;
        }
    return c;
}

// Elements of the own kernel's output that break the layout: columns O.. of a valid row not 0, and the 15 rows after
// the last not the poison they started as.
static int64_t layout_errors(const Operands *o, const uint16_t *y) {
    int64_t bad = 0;
    for (int64_t r = 0; r < o->T + 15; r++)
        for (int64_t j = (r < o->T ? o->O : 0); j < o->Op; j++) bad += y[r * o->Op + j] != (r < o->T ? 0x0000 : 0xFFFF);
    return bad;
}

static void test_grouped_gemm(void **state) {
    const Case *c = *state;
    const uint64_t seed =
        run_seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(c->N * 7 + c->K * 13 + c->n_seg + 1000 * c->dgrad));
    Operands o;
    operands_make(&o, c, seed);
    const size_t y_elems = (size_t)bf16_rows_elems(o.T, o.O), y_bytes = y_elems * sizeof(uint16_t);

    // CPU reference and S
    uint16_t *y_cpu = gpucheck_malloc(y_bytes);
    run_gemm(&o, DEVICE_CPU, y_cpu, o.qx, o.sx, o.qw, o.sw);
    float *S = abs_sums(&o);

    // the cuBLASLt path
    uint16_t *y_d = device_alloc(DEVICE_CUDA, y_bytes);
    poison_device(y_d, y_bytes);
    const int own_before = cuda_fp8_grouped_gemm_use_own(0);
    run_gemm(&o, DEVICE_CUDA, y_d, o.qx_d, o.sx_d, o.qw_d, o.sw_d);
    uint16_t *y_lt = gpucheck_to_host(y_d, y_bytes);

    // own kernel: each form twice
    static const int forms[N_VARIANTS] = {FP8_GROUPED_WIDE, FP8_GROUPED_SINGLE};
    cuda_fp8_grouped_gemm_use_own(1);
    uint16_t *y_own[N_VARIANTS][2];
    for (int v = 0; v < N_VARIANTS; v++) {
        const int form_before = cuda_fp8_grouped_gemm_form(forms[v]);
        for (int rep = 0; rep < 2; rep++) {
            poison_device(y_d, y_bytes);
            run_gemm(&o, DEVICE_CUDA, y_d, o.qx_d, o.sx_d, o.qw_d, o.sw_d);
            y_own[v][rep] = gpucheck_to_host(y_d, y_bytes);
        }
        cuda_fp8_grouped_gemm_form(form_before);
    }
    cuda_fp8_grouped_gemm_use_own(own_before);

    // the FP32-output form: own and cuBLASLt bitwise equal, every element written (no poison left)
    float *f_own = run_gemm_f32(&o, 1), *f_lt = run_gemm_f32(&o, 0);
    const size_t f_bytes = (size_t)o.T * o.O * sizeof(float);
    int64_t f_nan = 0;
    for (size_t i = 0; i < (size_t)o.T * o.O; i++) f_nan += isnan(f_own[i]);
    const int f32_ok = memcmp(f_own, f_lt, f_bytes) == 0 && f_nan == 0;
    free(f_own), free(f_lt);

    int pass = f32_ok;
    printf("%-15s FP32 form (%s): own %s cuBLASLt, %lld unwritten\n", c->name,
           o.dgrad ? "2-matrix Dgrad, GRAD_WRITE" : "Fprop", f32_ok ? "bitwise equal to" : "DIFFERENT from",
           (long long)f_nan);
    char shape[48];
    snprintf(shape, sizeof shape, "%s %d seg %d x %d x %d", o.dgrad ? "D" : "F", o.n, o.T, o.O, o.C);
    for (int v = 0; v < N_VARIANTS; v++) {
        const Cmp vc = compare(&o, y_own[v][0], y_cpu, S, 1), vl = compare(&o, y_own[v][0], y_lt, S, 2);
        const int64_t layout = layout_errors(&o, y_own[v][0]);
        const int repeat = memcmp(y_own[v][0], y_own[v][1], y_bytes) == 0;
        const int same_variant = memcmp(y_own[v][0], y_own[0][0], y_bytes) == 0;
        const int ok = vc.max_ratio <= 1.0 && vl.max_ratio <= 1.0 && vl.equal == vl.n && layout == 0 && repeat &&
                       same_variant;
        const int pairs = o.Op / FP8_TILE % 2 == 0;  // the two-block forms run only on pairs of weight blocks
        const char *variant = v == 1 ? "single" : pairs ? "wide" : "single(odd NB)";
        printf("%-15s %-14s %-30s %10.3e %9.4f %8.3f%% %9.4f %8.3f%% %6lld  %-5s %-5s %s\n", c->name, variant, shape,
               vc.max_abs, vc.max_ratio, 100.0 * (double)vc.equal / (double)(vc.n > 0 ? vc.n : 1), vl.max_ratio,
               100.0 * (double)vl.equal / (double)(vl.n > 0 ? vl.n : 1), (long long)layout, repeat ? "yes" : "NO",
               same_variant ? "yes" : "NO", ok ? "ok" : "FAIL");
        if (!(vc.max_ratio <= 1.0)) {
            const int64_t r = vc.worst / o.O, j = vc.worst % o.O;
            printf("    worst vs cpu at row %lld col %lld: own %.9g cpu %.9g S %.6g\n", (long long)r, (long long)j,
                   bf16_to_float(y_own[v][0][r * o.Op + j]), bf16_to_float(y_cpu[r * o.Op + j]), S[vc.worst]);
        }
        pass &= ok;
    }
    fflush(stdout);
    for (int v = 0; v < N_VARIANTS; v++) free(y_own[v][0]), free(y_own[v][1]);
    free(y_cpu), free(y_lt), free(S);
    device_free(DEVICE_CUDA, y_d);
    operands_free(&o);
    assert_true(pass);
}

// ---------------------------------------------------------------------------- the Wgrad form
// kernels.h's fp8_gemm_wgrad_grouped: dw + g N K (N, K) += dY_g^T X_g for every segment, on the 128x1 operands of dY
// (T, N) and X (T, K) (fp8_quantize_128x1_transposed_grouped), with the own kernel (cuda_fp8_grouped_wgrad, called
// directly: the model's Wgrads stay on cuBLASLt, gemm.cu) against the CPU reference and cuBLASLt (one GEMM per
// segment). dw starts as random values (the call adds to it). Bound per
// element: |own - cpu| <= (2^-10 + 4 TB_g 2^-24) S (1 + 2^-7) + ulp_fp32(max(|own|, |cpu|)) (TB_g: segment g's token
// tiles, the contraction's 128-blocks; the last term: both round dw + acc to FP32 once), S the CPU's FP32 sum of
// |dy s_dy x s_x| (sign bits cleared, added onto zeros); against cuBLASLt twice the first term. The 2^-10 is
// DESIGN.md's tensor-core term; over the expert shapes' 67M elements cuBLASLt's own Wgrads exceeded it against the
// CPU by up to 3.5% with one seed (1796493503, on an H100: 1.035 and 1.032 of the bound, the own kernel the same to
// 1e-4; docs/fp8.md), so where cuBLASLt's worst ratio is above 1 the own kernel's may be up to 1% above cuBLASLt's.
// Empty segments' dw must be untouched; a second run from the same dw must give the same bits.
typedef struct {
    int n, T, TB, N, K;
    int rows0[FP8_MAX_SEGMENTS + 1];
    size_t qdy_bytes, sdy_bytes, qx_bytes, sx_bytes, dw_elems;
    uint8_t *qdy_d, *qx_d, *qdy, *qx;
    float *sdy_d, *sx_d, *sdy, *sx, *dw0;
} WgradOperands;

static void wgrad_operands_make(WgradOperands *o, const Case *c, uint64_t seed) {
    memset(o, 0, sizeof *o);
    o->n = c->n_seg, o->N = c->N, o->K = c->K;
    case_rows0(c, seed, o->rows0);
    o->T = o->rows0[o->n];
    for (int g = 0; g < o->n; g++) o->TB += ceil_div(o->rows0[g + 1] - o->rows0[g], FP8_TILE);
    o->qdy_bytes = (size_t)o->N * o->TB * FP8_TILE, o->sdy_bytes = (size_t)o->TB * o->N * sizeof(float);
    o->qx_bytes = (size_t)o->K * o->TB * FP8_TILE, o->sx_bytes = (size_t)o->TB * o->K * sizeof(float);
    char err[256] = "";
    const int cols[2] = {o->N, o->K};
    uint8_t **q_d[2] = {&o->qdy_d, &o->qx_d};
    float **s_d[2] = {&o->sdy_d, &o->sx_d};
    const size_t q_bytes[2] = {o->qdy_bytes, o->qx_bytes}, s_bytes[2] = {o->sdy_bytes, o->sx_bytes};
    for (int i = 0; i < 2; i++) {
        const size_t n = (size_t)o->T * cols[i];
        float *v = gpucheck_malloc(n * sizeof(float) + 1);
        fill_log_uniform(v, (int64_t)n, seed + 1 + (uint64_t)i, -6.0, 2.0);
        float *v_d = device_alloc(DEVICE_CUDA, n * sizeof(float) + 16);
        device_memcpy_from_host(DEVICE_CUDA, v_d, v, n * sizeof(float));
        *q_d[i] = device_alloc(DEVICE_CUDA, q_bytes[i] + 16), *s_d[i] = device_alloc(DEVICE_CUDA, s_bytes[i] + 16);
        assert_int_equal(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, *q_d[i], *s_d[i], v_d, NULL, o->n, o->rows0,
                                                               cols[i], err, sizeof err), 0);
        device_free(DEVICE_CUDA, v_d), free(v);
    }
    assert_int_equal(fp8_check_finite(DEVICE_CUDA, err, sizeof err), 0);
    o->qdy = gpucheck_to_host(o->qdy_d, o->qdy_bytes), o->sdy = gpucheck_to_host(o->sdy_d, o->sdy_bytes);
    o->qx = gpucheck_to_host(o->qx_d, o->qx_bytes), o->sx = gpucheck_to_host(o->sx_d, o->sx_bytes);
    o->dw_elems = (size_t)o->n * o->N * o->K;
    o->dw0 = gpucheck_malloc(o->dw_elems * sizeof(float));
    fill_log_uniform(o->dw0, (int64_t)o->dw_elems, seed + 7, -4.0, 4.0);
}

static void wgrad_operands_free(WgradOperands *o) {
    device_free(DEVICE_CUDA, o->qdy_d), device_free(DEVICE_CUDA, o->qx_d);
    device_free(DEVICE_CUDA, o->sdy_d), device_free(DEVICE_CUDA, o->sx_d);
    free(o->qdy), free(o->qx), free(o->sdy), free(o->sx), free(o->dw0);
}

// dw0 + the Wgrads on the GPU with the own kernel (own = 1: cuda_fp8_grouped_wgrad) or cuBLASLt (kernels.h, which
// runs them there with either FP8MOE_GROUPED_GEMM); the host copy.
static float *run_wgrad_gpu(const WgradOperands *o, int own) {
    const size_t bytes = o->dw_elems * sizeof(float);
    float *dw_d = gpucheck_to_device(o->dw0, bytes);
    if (own) cuda_fp8_grouped_wgrad(dw_d, o->qdy_d, o->sdy_d, o->qx_d, o->sx_d, o->n, o->rows0, o->N, o->K);
    else fp8_gemm_wgrad_grouped(DEVICE_CUDA, dw_d, GRAD_ADD, o->qdy_d, o->sdy_d, o->qx_d, o->sx_d, o->n, o->rows0, o->N,
                                o->K);
    float *dw = gpucheck_to_host(dw_d, bytes);
    device_free(DEVICE_CUDA, dw_d);
    return dw;
}

static double f32_ulp(double v) {
    const double a = fmax(fabs(v), (double)FLT_MIN);
    return ldexp(1.0, (int)floor(log2(a)) - 23);
}

// x against ref over the non-empty segments' gradients; returns max |x - ref| / bound with tc_terms tensor-core terms,
// and the share bitwise equal in *equal. Empty segments' gradients must equal dw0: their differing elements go to
// *untouched_errors.
static double wgrad_compare(const WgradOperands *o, const float *x, const float *ref, const float *S, int tc_terms,
                            double *equal, int64_t *untouched_errors) {
    double worst = 0;
    int64_t same = 0, n = 0, bad = 0;
    const size_t NK = (size_t)o->N * o->K;
    for (int g = 0; g < o->n; g++) {
        const int TBg = ceil_div(o->rows0[g + 1] - o->rows0[g], FP8_TILE);
        const double rel = (tc_terms * TC_REL + 4.0 * TBg * 0x1p-24) * (1.0 + 0x1p-7);
        for (size_t i = g * NK; i < (g + 1) * NK; i++) {
            if (TBg == 0) {
                bad += memcmp(&x[i], &o->dw0[i], sizeof(float)) != 0;
                continue;
            }
            const double a = x[i], b = ref[i];
            double ratio = fabs(a - b) / (rel * S[i] + f32_ulp(fmax(fabs(a), fabs(b))));
            if (isnan(ratio)) ratio = INFINITY;
            if (!(ratio <= worst)) worst = ratio;
            same += memcmp(&x[i], &ref[i], sizeof(float)) == 0;
            n++;
        }
    }
    *equal = (double)same / (double)(n > 0 ? n : 1);
    *untouched_errors = bad;
    return worst;
}

static void test_grouped_wgrad(void **state) {
    const Case *c = *state;
    const uint64_t seed = run_seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(c->N * 7 + c->K * 13 + c->n_seg + 2000));
    WgradOperands o;
    wgrad_operands_make(&o, c, seed);
    const size_t bytes = o.dw_elems * sizeof(float);

    // CPU reference, and S from the codes with their sign bits cleared onto zeros
    float *dw_cpu = gpucheck_malloc(bytes);
    memcpy(dw_cpu, o.dw0, bytes);
    fp8_gemm_wgrad_grouped(DEVICE_CPU, dw_cpu, GRAD_ADD, o.qdy, o.sdy, o.qx, o.sx, o.n, o.rows0, o.N, o.K);
    uint8_t *ady = abs_codes(o.qdy, o.qdy_bytes), *ax = abs_codes(o.qx, o.qx_bytes);
    float *S = gpucheck_malloc(bytes);
    memset(S, 0, bytes);
    fp8_gemm_wgrad_grouped(DEVICE_CPU, S, GRAD_ADD, ady, o.sdy, ax, o.sx, o.n, o.rows0, o.N, o.K);
    free(ady), free(ax);

    // the wide form twice (the default; weights with an odd number of column blocks run 128 x 128 tiles in both), the
    // single form once: the same products in the same order, so all three must be bitwise equal
    const int form_before = cuda_fp8_grouped_gemm_form(FP8_GROUPED_WIDE);
    float *own[2] = {run_wgrad_gpu(&o, 1), run_wgrad_gpu(&o, 1)}, *lt = run_wgrad_gpu(&o, 0);
    cuda_fp8_grouped_gemm_form(FP8_GROUPED_SINGLE);
    float *own_single = run_wgrad_gpu(&o, 1);
    cuda_fp8_grouped_gemm_form(form_before);
    const int same_forms = memcmp(own[0], own_single, bytes) == 0;
    double eq_cpu, eq_lt;
    int64_t untouched, untouched_lt;
    double eq_lt_cpu;
    int64_t untouched_lt_cpu;
    const double r_cpu = wgrad_compare(&o, own[0], dw_cpu, S, 1, &eq_cpu, &untouched);
    const double r_lt = wgrad_compare(&o, own[0], lt, S, 2, &eq_lt, &untouched_lt);
    const double r_lt_cpu = wgrad_compare(&o, lt, dw_cpu, S, 1, &eq_lt_cpu, &untouched_lt_cpu);
    const int repeat = memcmp(own[0], own[1], bytes) == 0;
    // the design bound, or no more than 1% past cuBLASLt's own worst ratio where the hardware's accumulation takes
    // cuBLASLt past it too (the wgrad comment)
    const int ok = r_cpu <= fmax(1.0, 1.01 * r_lt_cpu) && r_lt <= 1.0 && untouched == 0 && repeat && same_forms;
    char shape[48];
    snprintf(shape, sizeof shape, "W %d seg %d x %d x %d", o.n, o.N, o.K, o.T);
    printf("%-15s %-14s %-30s %10s %9.4f %8.3f%% %9.4f %8.3f%% %6lld  %-5s %-5s %s  (cuBLASLt vs cpu %.4f)\n", c->name,
           ceil_div(o.K, FP8_TILE) % 2 == 0 ? "wide" : "single (odd)", shape, "", r_cpu, 100.0 * eq_cpu, r_lt,
           100.0 * eq_lt, (long long)untouched, repeat ? "yes" : "NO", same_forms ? "yes" : "NO", ok ? "ok" : "FAIL",
           r_lt_cpu);
    fflush(stdout);
    free(own[0]), free(own[1]), free(own_single), free(lt), free(dw_cpu), free(S);
    wgrad_operands_free(&o);
    assert_true(ok);
}

static int print_header(void **state) {
    (void)state;
    printf("\nown grouped FP8 GEMM (fp8_gemm_fprop/dgrad_grouped_bf16 on cuda_fp8_grouped_gemm_bf16) vs the CPU reference "
           "and vs cuBLASLt per segment; seed %llu\n", (unsigned long long)run_seed);
    printf("F/D: Fprop or Dgrad, rows x output columns x contraction; err/bnd: max |own - ref| / the file comment's "
           "bound (pass <= 1); =cpu, =lt: share of the elements bitwise equal to ref (=lt must be 100%% for F and D); "
           "layout: padding columns not 0 or rows after T written (W: empty segments' dw changed); rep: second run "
           "bitwise equal; =wide: equal to the wide form. W: Wgrad, dW rows x columns x tokens\n");
    printf("%-15s %-14s %-30s %10s %9s %9s %9s %9s %6s  %-5s %-5s\n", "case", "variant", "form segments rows x O x C",
           "max|o-c|", "err/bnd", "=cpu", "vs lt", "=lt", "layout", "rep", "=wide");
    return 0;
}

int main(void) {
    if (gpucheck_devices("test_gpu_grouped_gemm") == 0) return 1;
    const char *s = getenv("FP8MOE_TEST_SEED");
    run_seed = s != NULL ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
    static const int len_a[] = {200, 0, 77, 128, 300, 16}, len_b[] = {45, 0, 260, 1}, len_c[] = {129, 0, 255, 64, 500};
    static Case cases[] = {
        {"mixed", 6, len_a, 0, 0, 384, 512, 0},
        {"padded N,K", 4, len_b, 0, 0, 320, 300, 0},
        {"even NB", 5, len_c, 0, 0, 256, 640, 0},
        {"expert w1,w3", 32, NULL, 0, 400, 1024, 2048, 0},
        {"expert w2", 32, NULL, 0, 400, 2048, 1024, 0},
        {"80 segments", 80, NULL, 1, 50, 256, 256, 0},
        {"dgrad mixed", 6, len_a, 0, 0, 384, 512, 1},
        {"dgrad padded", 4, len_b, 0, 0, 320, 300, 1},
        {"dgrad even KB", 5, len_c, 0, 0, 640, 256, 1},
        {"expert w2 dgrad", 32, NULL, 0, 400, 2048, 1024, 1},
        {"dgrad 80 seg", 80, NULL, 1, 50, 256, 384, 1},
    };
    static Case wgrad_cases[] = {  // N, K: dW's (N, K); dgrad unused
        {"wgrad mixed", 6, len_a, 0, 0, 384, 512, 0},
        {"wgrad padded", 4, len_b, 0, 0, 320, 300, 0},
        {"w1,w3 wgrad", 32, NULL, 0, 400, 1024, 2048, 0},
        {"w2 wgrad", 32, NULL, 0, 400, 2048, 1024, 0},
        {"wgrad 80 seg", 80, NULL, 1, 50, 256, 384, 0},
    };
    enum { N_CASES = sizeof cases / sizeof cases[0], N_WGRAD = sizeof wgrad_cases / sizeof wgrad_cases[0] };
    struct CMUnitTest tests[N_CASES + N_WGRAD];
    for (size_t i = 0; i < N_CASES; i++) {
        const struct CMUnitTest t = cmocka_unit_test_prestate_setup_teardown(test_grouped_gemm, i == 0 ? print_header : NULL,
                                                                              NULL, &cases[i]);
        tests[i] = t;
    }
    for (size_t i = 0; i < N_WGRAD; i++) {
        const struct CMUnitTest t = cmocka_unit_test_prestate_setup_teardown(test_grouped_wgrad, NULL, NULL,
                                                                              &wgrad_cases[i]);
        tests[N_CASES + i] = t;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
