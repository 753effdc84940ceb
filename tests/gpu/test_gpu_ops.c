/*
 * test_gpu_ops.c - CUDA vs CPU parity of the first CUDA ops (RMSNorm, SwiGLU, cross-entropy, AdamW)
 * and of the device-memory functions. Runs only on a machine with an NVIDIA GPU (tests/gpu/run.sh);
 * with no visible GPU it FAILS, so a GPU job can never pass by silently testing nothing.
 *
 * Every case draws fresh random non-zero inputs from the counter-based RNG, runs the op through the
 * kernels.h dispatch on DEVICE_CPU and on DEVICE_CUDA, and compares three ways against a
 * double-precision reference computed here from the same inputs:
 *   gpu-cpu  the parity asserted (the CPU op is the project's reference),
 *   gpu-f64  also asserted: the GPU result is right on its own, not only equal to the CPU's,
 *   cpu-f64  printed; when it is over the tolerance the CPU op itself is suspect (the message says so).
 * Errors are |x - y| / scale per element, where scale is the size of the quantities the element is
 * computed from (e.g. the sum of |terms| of a sum), so cancellation cannot make a right answer look
 * wrong. Each output has two tolerances, stated with their reason in units of u = 2^-24 (FP32 unit
 * roundoff): one for gpu-cpu (it must cover the CPU reference's own error too) and one for gpu-f64
 * (the GPU's error alone; usually the same, tighter where the CPU sums sequentially in FP32). Forward
 * outputs and the written gradients (dlogits, SwiGLU's da and db) are poisoned with NaN before the call
 * (an element the kernel does not write, or adds to, stays NaN and fails); accumulated gradients start
 * from random values (checks +=).
 * Shapes include non-multiples of every block size. One table row per output is printed.
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

#include "kernels/kernels.h"
#include "tests/gpu/gpucheck.h"
#include "unit/opcheck.h"

#define U_FP32 0x1p-24 // unit roundoff of FP32

// Tolerance of a sequential FP32 sum of n terms, relative to the sum of |terms|. The worst case is
// n u, but with rounding errors of random sign the largest error seen over many random rows is about
// sqrt(n) u (measured: 0.9 sqrt(n) u at n = 300 .. 50257, 1.5 sqrt(n) u at 129280); 8 sqrt(n) u
// keeps a wide margin, plus 16 u for the few roundings around the sum (division, sqrt, exp).
static double sum_tol(int64_t n) { return (8.0 * sqrt((double)n) + 16.0) * U_FP32; }

// The worst-case bound of a sequential FP32 sum of n terms (relative to the sum of |terms|), for
// parity with a CPU reference whose rounding errors need not average out (see cross-entropy).
static double sequential_sum_bound(int64_t n) { return ((double)n + 16.0) * U_FP32; }

// Tolerances of one output: gpu-cpu (parity) and gpu-f64.
typedef struct {
    double parity, f64;
} Tol;
static Tol tol_both(double t) { return (Tol){t, t}; }

// ---------------------------------------------------------------------------- buffers
// Zeroed (calloc): GCC's -Wmaybe-uninitialized cannot see that the tests fill what they pass on.
static void *xmalloc(size_t bytes) {
    void *p = calloc(1, bytes > 0 ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "%s:%d: calloc of %zu bytes failed\n", __FILE__, __LINE__, bytes);
        exit(1);
    }
    return p;
}
static float *floats(int64_t n) { return xmalloc((size_t)n * sizeof(float)); }
static double *doubles(int64_t n) { return xmalloc((size_t)n * sizeof(double)); }
static float *nan_floats(int64_t n) {
    float *x = floats(n);
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
static void *gpu_copy_of(const void *host, size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes);
    device_memcpy_from_host(DEVICE_CUDA, d, host, bytes);
    return d;
}
static float *gpu_nan_floats(int64_t n) {
    float *h = nan_floats(n);
    float *d = gpu_copy_of(h, (size_t)n * sizeof(float));
    free(h);
    return d;
}
static float *host_copy_of(const float *d, int64_t n) {
    float *h = floats(n);
    device_memcpy_to_host(DEVICE_CUDA, h, d, (size_t)n * sizeof(float));
    return h;
}

// ---------------------------------------------------------------------------- comparison and table
static void print_table_header(void) {
    printf("\n%-22s %-18s %-8s %10s %9s %9s %9s %9s %9s %9s  %s\n", "op", "shape", "output", "max|g-c|", "gpu-cpu",
           "tol", "gpu-f64", "tol", "cpu-f64", "bitwise", "result");
    printf("%-22s %-18s %-8s %10s %9s %9s %9s %9s %9s %9s  %s\n", "", "", "", "(abs)", "(err)", "(g-c)", "(err)",
           "(f64)", "(err)", "equal", "");
}

// Compares one output of one op, prints its table row, and on failure says which side is wrong and
// where. Returns 1 when gpu-cpu is within tol.parity and gpu-f64 within tol.f64.
static int check_output(const char *op, const char *shape, const char *output, const float *gpu, const float *cpu,
                        const double *ref, const double *scale, int64_t n, Tol tol) {
    int64_t w_gc, w_gr, w_cr, bitwise = 0;
    double max_abs = 0.0;
    const double e_gc = max_scaled_err(gpu, cpu, NULL, scale, n, &w_gc);
    const double e_gr = max_scaled_err(gpu, NULL, ref, scale, n, &w_gr);
    const double e_cr = max_scaled_err(cpu, NULL, ref, scale, n, &w_cr);
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&gpu[i], &cpu[i], sizeof(float)) == 0) bitwise++;
        const double d = fabs((double)gpu[i] - (double)cpu[i]);
        if (d > max_abs || isnan(d)) max_abs = d;
    }
    const int pass = e_gc <= tol.parity && e_gr <= tol.f64;
    printf("%-22s %-18s %-8s %10.3e %9.2e %9.2e %9.2e %9.2e %9.2e %8.4f%%  %s\n", op, shape, output, max_abs, e_gc,
           tol.parity, e_gr, tol.f64, e_cr, 100.0 * (double)bitwise / (double)n, pass ? "ok" : "FAIL");
    if (!pass) {
        int64_t first;
        int64_t nan_gpu = count_nan(gpu, n, &first);
        if (nan_gpu > 0)
            printf("    GPU %s has %lld NaN (poisoned before the call: not written by the kernel, or computed "
                   "as NaN), first at [%lld]\n", output, (long long)nan_gpu, (long long)first);
        int64_t nan_cpu = count_nan(cpu, n, &first);
        if (nan_cpu > 0)
            printf("    CPU %s has %lld NaN, first at [%lld]\n", output, (long long)nan_cpu, (long long)first);
        const int64_t w = e_gc > tol.parity ? w_gc : w_gr;
        printf("    worst [%lld]: gpu %.9g  cpu %.9g  f64 %.12g  scale %.6g  (gpu-cpu %.3g, gpu-f64 %.3g in units "
               "of scale; tol %.3g, %.3g)\n", (long long)w, gpu[w], cpu[w], ref[w], scale[w],
               fabs((double)gpu[w] - cpu[w]) / scale[w], fabs((double)gpu[w] - ref[w]) / scale[w], tol.parity,
               tol.f64);
        if (e_cr > tol.parity)
            printf("    cpu-f64 is over the tolerance too (worst [%lld]: cpu %.9g, f64 %.12g): the CPU reference "
                   "op is suspect, not only the CUDA one\n", (long long)w_cr, cpu[w_cr], ref[w_cr]);
        else if (e_gr > tol.f64)
            printf("    the CPU op agrees with the f64 reference; the CUDA op is the one that is off\n");
    }
    fflush(stdout);
    return pass;
}

// Two GPU results that must be bitwise identical: the same call run twice (`against` "run twice": no atomics,
// fixed reduction order), or two forms that promise the same bits (`against` names the other form). Prints a row
// and returns 1 on success.
static int check_bitwise_equal(const char *op, const char *shape, const char *output, const float *first,
                               const float *second, int64_t n, const char *against) {
    int64_t differ = 0, first_diff = -1;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&first[i], &second[i], sizeof(float)) != 0) {
            if (differ++ == 0) first_diff = i;
        }
    }
    printf("%-22s %-18s %-8s %10s %9s %9s %9s %9s %9s %9s  %s (%s: bitwise equal)\n", op, shape, output, "-", "-", "-",
           "-", "-", "-", differ == 0 ? "bitwise" : "differs", differ == 0 ? "ok" : "FAIL", against);
    if (differ > 0)
        printf("    %lld elements differ (%s), first [%lld]: %.9g vs %.9g\n", (long long)differ, against,
               (long long)first_diff, first[first_diff], second[first_diff]);
    fflush(stdout);
    return differ == 0;
}

// ---------------------------------------------------------------------------- device memory
static void test_device_memory(void **state) {
    (void)state;
    const int64_t n = 1000;
    float *pattern = floats(n), *back = floats(n);
    opcheck_fill_nonzero(pattern, (size_t)n, 101, 0.5, 2.0);
    assert_string_equal(device_name(DEVICE_CPU), "cpu");
    assert_string_equal(device_name(DEVICE_CUDA), "cuda");
    const Device devices[2] = {DEVICE_CPU, DEVICE_CUDA};
    for (int k = 0; k < 2; k++) {
        const Device dev = devices[k];
        assert_null(device_alloc(dev, 0));
        device_free(dev, NULL);
        float *p = device_alloc(dev, (size_t)n * sizeof(float));
        assert_non_null(p);
        memset(back, 0xFF, (size_t)n * sizeof(float));
        device_memcpy_to_host(dev, back, p, (size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) assert_true(back[i] == 0.0f && !signbit(back[i])); // zeroed
        device_memcpy_from_host(dev, p, pattern, (size_t)n * sizeof(float));
        device_memcpy_to_host(dev, back, p, (size_t)n * sizeof(float));
        assert_memory_equal(back, pattern, (size_t)n * sizeof(float));
        device_memset_zero(dev, p + 10, 20 * sizeof(float)); // a sub-range: elements 10..29
        device_memcpy_to_host(dev, back, p, (size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) assert_true(back[i] == ((i >= 10 && i < 30) ? 0.0f : pattern[i]));
        device_free(dev, p);
    }
    printf("%-22s %-18s %-8s %10s %9s %9s %9s %9s %9s %9s  %s\n", "device memory", "n=1000", "cpu+cuda", "-", "-",
           "-", "-", "-", "-", "exact", "ok (alloc zeroed, copies, memset)");
    free(pattern);
    free(back);
}

// ---------------------------------------------------------------------------- RMSNorm
typedef struct {
    int N, C;
} RmsnormCase;

// Forward tolerance: sum_tol(C), the sum of C squares (FP32 in a different order on each side:
// sequential on the CPU, a tree on the GPU), then sqrt, division and two products (few u).
// Backward: dinp has a C-term dot product per row, so sum_tol(C) relative to the |terms| scale;
// dweight sums N rows per column onto its initial value, so sum_tol(N + 1). The same for parity and
// f64: the terms here are of similar size (|x| in [0.05, 2]), so the CPU's sequential sums behave like
// a random walk (measured on an H200 run: cpu-f64 at most 0.1 of these tolerances).
static void test_rmsnorm(void **state) {
    const RmsnormCase *tc = (const RmsnormCase *)*state;
    const int N = tc->N, C = tc->C;
    const int64_t NC = (int64_t)N * C;
    char shape[48];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    const uint64_t seed = 1000u + 7u * (uint64_t)N + 13u * (uint64_t)C;
    int ok = 1;

    float *inp = floats(NC), *weight = floats(C), *dout = floats(NC), *dinp0 = floats(NC), *dweight0 = floats(C);
    opcheck_fill_nonzero(inp, (size_t)NC, seed + 1, 0.05, 2.0);
    opcheck_fill_nonzero(weight, (size_t)C, seed + 2, 0.5, 1.5);
    opcheck_fill_nonzero(dout, (size_t)NC, seed + 3, 0.01, 1.0);
    opcheck_fill_nonzero(dinp0, (size_t)NC, seed + 4, 0.01, 1.0);
    opcheck_fill_nonzero(dweight0, (size_t)C, seed + 5, 0.01, 1.0);

    // double reference: forward, and backward from the FP32 rstd both sides are given
    double *ref_out = doubles(NC), *sc_out = doubles(NC), *ref_rstd = doubles(N), *sc_rstd = doubles(N);
    double *ref_dinp = doubles(NC), *sc_dinp = doubles(NC), *ref_dw = doubles(C), *sc_dw = doubles(C);
    float *rstd_in = floats(N);
    for (int n = 0; n < N; n++) {
        const float *x = inp + (int64_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        const double r = 1.0 / sqrt(ss / C + RMSNORM_EPS);
        ref_rstd[n] = r;
        sc_rstd[n] = r;
        rstd_in[n] = (float)r;
        for (int c = 0; c < C; c++) {
            ref_out[(int64_t)n * C + c] = x[c] * r * weight[c];
            sc_out[(int64_t)n * C + c] = fabs(ref_out[(int64_t)n * C + c]);
        }
    }
    for (int c = 0; c < C; c++) {
        ref_dw[c] = dweight0[c];
        sc_dw[c] = fabs((double)dweight0[c]);
    }
    for (int n = 0; n < N; n++) {
        const float *x = inp + (int64_t)n * C, *g = dout + (int64_t)n * C;
        const double r = rstd_in[n];
        double dot = 0.0, dot_abs = 0.0;
        for (int c = 0; c < C; c++) {
            dot += (double)g[c] * weight[c] * x[c];
            dot_abs += fabs((double)g[c] * weight[c] * x[c]);
        }
        for (int c = 0; c < C; c++) {
            const int64_t i = (int64_t)n * C + c;
            const double gw = (double)g[c] * weight[c];
            ref_dinp[i] = dinp0[i] + r * (gw - x[c] * r * r * dot / C);
            sc_dinp[i] = fabs((double)dinp0[i]) + r * (fabs(gw) + fabs((double)x[c]) * r * r * dot_abs / C);
            ref_dw[c] += (double)g[c] * x[c] * r;
            sc_dw[c] += fabs((double)g[c] * x[c] * r);
        }
    }

    // forward
    float *c_out = nan_floats(NC), *c_rstd = nan_floats(N);
    rmsnorm_forward(DEVICE_CPU, c_out, c_rstd, inp, weight, N, C);
    float *d_inp = gpu_copy_of(inp, (size_t)NC * 4), *d_weight = gpu_copy_of(weight, (size_t)C * 4);
    float *d_out = gpu_nan_floats(NC), *d_rstd = gpu_nan_floats(N);
    rmsnorm_forward(DEVICE_CUDA, d_out, d_rstd, d_inp, d_weight, N, C);
    float *g_out = host_copy_of(d_out, NC), *g_rstd = host_copy_of(d_rstd, N);
    ok &= check_output("rmsnorm_forward", shape, "out", g_out, c_out, ref_out, sc_out, NC, tol_both(sum_tol(C)));
    ok &= check_output("rmsnorm_forward", shape, "rstd", g_rstd, c_rstd, ref_rstd, sc_rstd, N, tol_both(sum_tol(C)));

    // backward (accumulates into random initial gradients)
    float *c_dinp = floats(NC), *c_dw = floats(C);
    memcpy(c_dinp, dinp0, (size_t)NC * 4);
    memcpy(c_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward(DEVICE_CPU, c_dinp, c_dw, dout, inp, weight, rstd_in, N, C);
    float *d_dout = gpu_copy_of(dout, (size_t)NC * 4), *d_rstd_in = gpu_copy_of(rstd_in, (size_t)N * 4);
    float *d_dinp = gpu_copy_of(dinp0, (size_t)NC * 4), *d_dw = gpu_copy_of(dweight0, (size_t)C * 4);
    rmsnorm_backward(DEVICE_CUDA, d_dinp, d_dw, d_dout, d_inp, d_weight, d_rstd_in, N, C);
    float *g_dinp = host_copy_of(d_dinp, NC), *g_dw = host_copy_of(d_dw, C);
    ok &= check_output("rmsnorm_backward", shape, "dinp", g_dinp, c_dinp, ref_dinp, sc_dinp, NC, tol_both(sum_tol(C)));
    ok &= check_output("rmsnorm_backward", shape, "dweight", g_dw, c_dw, ref_dw, sc_dw, C,
                       tol_both(sum_tol((int64_t)N + 1)));

    // again, one gradient at a time (the other NULL): same bits as the first run (deterministic, and a
    // NULL gradient changes nothing else)
    device_memcpy_from_host(DEVICE_CUDA, d_dinp, dinp0, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward(DEVICE_CUDA, d_dinp, NULL, d_dout, d_inp, d_weight, d_rstd_in, N, C);
    rmsnorm_backward(DEVICE_CUDA, NULL, d_dw, d_dout, d_inp, d_weight, d_rstd_in, N, C);
    float *g_dinp2 = host_copy_of(d_dinp, NC), *g_dw2 = host_copy_of(d_dw, C);
    ok &= check_bitwise_equal("rmsnorm_backward", shape, "dinp", g_dinp, g_dinp2, NC, "run twice");
    ok &= check_bitwise_equal("rmsnorm_backward", shape, "dweight", g_dw, g_dw2, C, "run twice");

    // dout as BF16 rows at a padded stride (padding NaN, never read): the bits of rmsnorm_backward on the widened
    // values
    const int64_t ld = C + 3;
    uint16_t *dout16 = malloc(sizeof(uint16_t) * (size_t)(N * ld));
    float *wide = floats(NC);
    assert_non_null(dout16);
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < ld; c++) dout16[r * ld + c] = c < C ? float_to_bf16(dout[r * C + c]) : 0x7FC0;
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < C; c++) wide[r * C + c] = bf16_to_float(dout16[r * ld + c]);
    uint16_t *d_dout16 = device_alloc(DEVICE_CUDA, sizeof(uint16_t) * (size_t)(N * ld));
    device_memcpy_from_host(DEVICE_CUDA, d_dout16, dout16, sizeof(uint16_t) * (size_t)(N * ld));
    float *d_wide = gpu_copy_of(wide, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dinp, dinp0, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward(DEVICE_CUDA, d_dinp, d_dw, d_wide, d_inp, d_weight, d_rstd_in, N, C);
    float *w_dinp = host_copy_of(d_dinp, NC), *w_dw = host_copy_of(d_dw, C);
    device_memcpy_from_host(DEVICE_CUDA, d_dinp, dinp0, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward_bf16(DEVICE_CUDA, d_dinp, d_dw, d_dout16, ld, 1, 0, d_inp, d_weight, d_rstd_in, N, C);
    float *b_dinp = host_copy_of(d_dinp, NC), *b_dw = host_copy_of(d_dw, C);
    const char *widened = "rmsnorm_backward on the widened dout";
    ok &= check_bitwise_equal("rmsnorm_backward_bf16", shape, "dinp", w_dinp, b_dinp, NC, widened);
    ok &= check_bitwise_equal("rmsnorm_backward_bf16", shape, "dweight", w_dw, b_dw, C, widened);
    device_free(DEVICE_CUDA, d_dout16), device_free(DEVICE_CUDA, d_wide);
    free(w_dinp), free(w_dw), free(b_dinp), free(b_dw);

    // dout as the sum of two such arrays, 5 NaN values apart (MLA's input gradient in parts): the bits of
    // rmsnorm_backward on the widened first + the widened second, added as FP32 here
    const int64_t stride = N * ld + 5;
    uint16_t *two16 = opcheck_two_bf16_sources(wide, dout, N, C, ld, stride);
    uint16_t *d_two16 = device_alloc(DEVICE_CUDA, sizeof(uint16_t) * (size_t)(2 * stride));
    device_memcpy_from_host(DEVICE_CUDA, d_two16, two16, sizeof(uint16_t) * (size_t)(2 * stride));
    d_wide = gpu_copy_of(wide, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dinp, dinp0, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward(DEVICE_CUDA, d_dinp, d_dw, d_wide, d_inp, d_weight, d_rstd_in, N, C);
    w_dinp = host_copy_of(d_dinp, NC), w_dw = host_copy_of(d_dw, C);
    device_memcpy_from_host(DEVICE_CUDA, d_dinp, dinp0, (size_t)NC * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_dw, dweight0, (size_t)C * 4);
    rmsnorm_backward_bf16(DEVICE_CUDA, d_dinp, d_dw, d_two16, ld, 2, stride, d_inp, d_weight, d_rstd_in, N, C);
    b_dinp = host_copy_of(d_dinp, NC), b_dw = host_copy_of(d_dw, C);
    const char *summed = "rmsnorm_backward on the sum of the widened douts";
    ok &= check_bitwise_equal("rmsnorm_backward_bf16 (2 sources)", shape, "dinp", w_dinp, b_dinp, NC, summed);
    ok &= check_bitwise_equal("rmsnorm_backward_bf16 (2 sources)", shape, "dweight", w_dw, b_dw, C, summed);
    device_free(DEVICE_CUDA, d_two16), device_free(DEVICE_CUDA, d_wide);
    free(dout16), free(two16), free(wide), free(w_dinp), free(w_dw), free(b_dinp), free(b_dw);

    float *host[] = {inp, weight, dout, dinp0, dweight0, rstd_in, c_out, c_rstd, g_out, g_rstd, c_dinp, c_dw,
                     g_dinp, g_dw, g_dinp2, g_dw2};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    double *refs[] = {ref_out, sc_out, ref_rstd, sc_rstd, ref_dinp, sc_dinp, ref_dw, sc_dw};
    for (size_t k = 0; k < sizeof refs / sizeof refs[0]; k++) free(refs[k]);
    float *dev[] = {d_inp, d_weight, d_out, d_rstd, d_dout, d_rstd_in, d_dinp, d_dw};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) device_free(DEVICE_CUDA, dev[k]);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- SwiGLU
typedef struct {
    int64_t n;
    int offset;  // device buffers start this many floats into their allocation: 1 = not 16-byte aligned
} SwigluCase;

// n floats from host (NULL: NaN poison) at `offset` floats into a fresh device allocation; *base is
// what device_free takes.
static float *gpu_copy_at(const float *host, int64_t n, int offset, float **base) {
    *base = device_alloc(DEVICE_CUDA, (size_t)(n + offset) * sizeof(float));
    float *h = host != NULL ? NULL : nan_floats(n);
    device_memcpy_from_host(DEVICE_CUDA, *base + offset, host != NULL ? host : h, (size_t)n * sizeof(float));
    free(h);
    return *base + offset;
}

// The kernels move float4s when every pointer is 16-byte aligned (the last n % 4 elements one at a time)
// and single floats otherwise; the cases cover both (see "cases"). da and db are WRITTEN: both sides
// start from NaN poison and the reference has no initial term.
// Tolerance 32 u on every output. out = (a * s) * b with s = 1 / (1 + exp(-a)): CUDA's expf is within
// 2 ulp, glibc's within 1, then four roundings: at most 14 u apart, doubled for margin. For da, the
// scale counts the size of 1 and s inside (1 - s), times |a| (that difference cancels when s -> 1,
// so its absolute error, not its value, sets what is achievable).
static void test_swiglu(void **state) {
    const SwigluCase *tc = (const SwigluCase *)*state;
    const int64_t n = tc->n;
    const int off = tc->offset;
    char shape[48];
    snprintf(shape, sizeof shape, "n=%lld%s", (long long)n, off != 0 ? " misaligned" : "");
    const uint64_t seed = 2000u + (uint64_t)n;
    const Tol tol = tol_both(32 * U_FP32);
    int ok = 1;

    float *a = floats(n), *b = floats(n), *dout = floats(n);
    opcheck_fill_nonzero(a, (size_t)n, seed + 1, 0.01, 8.0); // into both tails of the sigmoid
    opcheck_fill_nonzero(b, (size_t)n, seed + 2, 0.01, 2.0);
    opcheck_fill_nonzero(dout, (size_t)n, seed + 3, 0.01, 1.0);

    double *ref_out = doubles(n), *sc_out = doubles(n), *ref_da = doubles(n), *sc_da = doubles(n);
    double *ref_db = doubles(n), *sc_db = doubles(n);
    for (int64_t i = 0; i < n; i++) {
        const double x = a[i], s = 1.0 / (1.0 + exp(-x)), gb = (double)dout[i] * b[i];
        ref_out[i] = x * s * b[i];
        sc_out[i] = fabs(ref_out[i]);
        ref_da[i] = gb * s * (1.0 + x * (1.0 - s));
        sc_da[i] = fabs(gb) * s * (1.0 + fabs(x) * (1.0 + s));
        ref_db[i] = dout[i] * x * s;
        sc_db[i] = fabs(dout[i] * x * s);
    }

    float *c_out = nan_floats(n);
    swiglu_forward(DEVICE_CPU, c_out, a, b, n);
    float *base[6];
    float *d_a = gpu_copy_at(a, n, off, &base[0]), *d_b = gpu_copy_at(b, n, off, &base[1]);
    float *d_out = gpu_copy_at(NULL, n, off, &base[2]);
    swiglu_forward(DEVICE_CUDA, d_out, d_a, d_b, n);
    float *g_out = host_copy_of(d_out, n);
    ok &= check_output("swiglu_forward", shape, "out", g_out, c_out, ref_out, sc_out, n, tol);

    float *c_da = nan_floats(n), *c_db = nan_floats(n);
    swiglu_backward(DEVICE_CPU, c_da, c_db, dout, a, b, n);
    float *d_dout = gpu_copy_at(dout, n, off, &base[3]), *d_da = gpu_copy_at(NULL, n, off, &base[4]);
    float *d_db = gpu_copy_at(NULL, n, off, &base[5]);
    swiglu_backward(DEVICE_CUDA, d_da, d_db, d_dout, d_a, d_b, n);
    float *g_da = host_copy_of(d_da, n), *g_db = host_copy_of(d_db, n);
    ok &= check_output("swiglu_backward", shape, "da", g_da, c_da, ref_da, sc_da, n, tol);
    ok &= check_output("swiglu_backward", shape, "db", g_db, c_db, ref_db, sc_db, n, tol);

    // one gradient at a time (the other NULL) gives the same bits, again over NaN poison
    float *poison = nan_floats(n);
    device_memcpy_from_host(DEVICE_CUDA, d_da, poison, (size_t)n * 4);
    device_memcpy_from_host(DEVICE_CUDA, d_db, poison, (size_t)n * 4);
    swiglu_backward(DEVICE_CUDA, d_da, NULL, d_dout, d_a, d_b, n);
    swiglu_backward(DEVICE_CUDA, NULL, d_db, d_dout, d_a, d_b, n);
    float *g_da2 = host_copy_of(d_da, n), *g_db2 = host_copy_of(d_db, n);
    ok &= check_bitwise_equal("swiglu_backward", shape, "da", g_da, g_da2, n, "run twice");
    ok &= check_bitwise_equal("swiglu_backward", shape, "db", g_db, g_db2, n, "run twice");

    float *host[] = {a, b, dout, poison, c_out, g_out, c_da, c_db, g_da, g_db, g_da2, g_db2};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    double *refs[] = {ref_out, sc_out, ref_da, sc_da, ref_db, sc_db};
    for (size_t k = 0; k < sizeof refs / sizeof refs[0]; k++) free(refs[k]);
    for (size_t k = 0; k < sizeof base / sizeof base[0]; k++) device_free(DEVICE_CUDA, base[k]);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- cross-entropy
typedef struct {
    int N, V;
} CrossentropyCase;

// probs: the row sum of V exponentials in FP32 sets the error (expf ulps and the division are small
// next to it). The GPU sums in a tree: gpu-f64 tolerance sum_tol(V). The CPU sums sequentially, and
// there the errors do not average out: every exponential below half an ulp of the running sum is
// dropped, always downwards (measured on an H200 run: cpu-f64 = 1.7e-4 at V = 129280, 2900 u, far
// above sqrt(V) u). So gpu-cpu gets the worst-case bound of a sequential sum, (V + 16) u; a GPU bug is
// still caught by the tight gpu-f64 check. losses = (log(sum) + max) - x[t]: the log turns the sum's
// relative error into an absolute one, so the scale is 1 + |log sum| + |max| + |x[t]|, same tolerances.
// dlogits = (p - onehot) * dloss from identical probs: 4 u (two roundings; expected bit-identical).
// Rows with a large offset (+100, beyond expf's range without the max shift) check the shift; row 0
// is masked (target -1), and about one row in five more.
static void test_crossentropy(void **state) {
    const CrossentropyCase *tc = (const CrossentropyCase *)*state;
    const int N = tc->N, V = tc->V;
    const int64_t NV = (int64_t)N * V;
    char shape[48];
    snprintf(shape, sizeof shape, "N=%d V=%d", N, V);
    const uint64_t seed = 3000u + 7u * (uint64_t)N + 13u * (uint64_t)V;
    int ok = 1;

    float *logits = floats(NV);
    int *targets = xmalloc((size_t)N * sizeof(int));
    opcheck_fill_nonzero(logits, (size_t)NV, seed + 1, 0.01, 6.0);
    for (int n = 0; n < N; n++) {
        if (n % 3 == 2) {
            for (int j = 0; j < V; j++) logits[(int64_t)n * V + j] += 100.0f;
        }
    }
    opcheck_fill_int(targets, (size_t)N, seed + 2, 0, V);
    int n_valid = 0;
    for (int n = 0; n < N; n++) {
        if (n == 0 || opcheck_uniform(seed + 3, (uint64_t)n) < 0.2) targets[n] = -1;
        n_valid += targets[n] >= 0;
    }
    const float dloss = 0.7f / (float)(n_valid > 0 ? n_valid : 1);
    const Tol ce_tol = {sequential_sum_bound(V), sum_tol(V)};

    double *ref_p = doubles(NV), *sc_p = doubles(NV), *ref_loss = doubles(N), *sc_loss = doubles(N);
    for (int n = 0; n < N; n++) {
        const float *x = logits + (int64_t)n * V;
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, x[j]);
        for (int j = 0; j < V; j++) sum += exp((double)x[j] - mx);
        for (int j = 0; j < V; j++) {
            ref_p[(int64_t)n * V + j] = exp((double)x[j] - mx) / sum;
            sc_p[(int64_t)n * V + j] = ref_p[(int64_t)n * V + j];
        }
        const int t = targets[n];
        ref_loss[n] = t < 0 ? 0.0 : log(sum) + mx - x[t];
        sc_loss[n] = 1.0 + fabs(log(sum)) + fabs(mx) + (t < 0 ? 0.0 : fabs((double)x[t]));
    }

    float *c_loss = nan_floats(N), *c_p = nan_floats(NV);
    crossentropy_forward(DEVICE_CPU, c_loss, c_p, logits, targets, N, V);
    float *d_logits = gpu_copy_of(logits, (size_t)NV * 4);
    int *d_targets = gpu_copy_of(targets, (size_t)N * sizeof(int));
    float *d_loss = gpu_nan_floats(N), *d_p = gpu_nan_floats(NV);
    crossentropy_forward(DEVICE_CUDA, d_loss, d_p, d_logits, d_targets, N, V);
    float *g_loss = host_copy_of(d_loss, N), *g_p = host_copy_of(d_p, NV);
    ok &= check_output("crossentropy_forward", shape, "losses", g_loss, c_loss, ref_loss, sc_loss, N, ce_tol);
    ok &= check_output("crossentropy_forward", shape, "probs", g_p, c_p, ref_p, sc_p, NV, ce_tol);

    // the forward again: bitwise the same (fixed-order block reductions)
    device_memcpy_from_host(DEVICE_CUDA, d_p, c_p, (size_t)NV * 4); // overwrite with other values first
    crossentropy_forward(DEVICE_CUDA, d_loss, d_p, d_logits, d_targets, N, V);
    float *g_loss2 = host_copy_of(d_loss, N), *g_p2 = host_copy_of(d_p, NV);
    ok &= check_bitwise_equal("crossentropy_forward", shape, "losses", g_loss, g_loss2, N, "run twice");
    ok &= check_bitwise_equal("crossentropy_forward", shape, "probs", g_p, g_p2, NV, "run twice");

    // backward from the same FP32 probs on both sides (the f64 ones, rounded), dlogits poisoned
    float *probs_in = floats(NV);
    double *ref_d = doubles(NV), *sc_d = doubles(NV);
    for (int64_t i = 0; i < NV; i++) probs_in[i] = (float)ref_p[i];
    for (int n = 0; n < N; n++) {
        for (int j = 0; j < V; j++) {
            const int64_t i = (int64_t)n * V + j;
            const double onehot = j == targets[n] ? 1.0 : 0.0;
            ref_d[i] = targets[n] < 0 ? 0.0 : ((double)probs_in[i] - onehot) * dloss;
            sc_d[i] = targets[n] < 0 ? 0.0 : ((double)probs_in[i] + onehot) * dloss;
        }
    }
    float *c_d = nan_floats(NV);
    crossentropy_backward(DEVICE_CPU, c_d, probs_in, targets, dloss, N, V);
    float *d_probs_in = gpu_copy_of(probs_in, (size_t)NV * 4), *d_d = gpu_nan_floats(NV);
    crossentropy_backward(DEVICE_CUDA, d_d, d_probs_in, d_targets, dloss, N, V);
    float *g_d = host_copy_of(d_d, NV);
    ok &= check_output("crossentropy_backward", shape, "dlogits", g_d, c_d, ref_d, sc_d, NV, tol_both(4 * U_FP32));

    // in place (kernels.h: probs may be logits, dlogits may be probs): bitwise the out-of-place results
    float *d_inplace = gpu_copy_of(logits, (size_t)NV * 4), *d_loss3 = gpu_nan_floats(N);
    crossentropy_forward(DEVICE_CUDA, d_loss3, d_inplace, d_inplace, d_targets, N, V);
    float *g_p3 = host_copy_of(d_inplace, NV), *g_loss3 = host_copy_of(d_loss3, N);
    device_memcpy_from_host(DEVICE_CUDA, d_inplace, probs_in, (size_t)NV * 4);
    crossentropy_backward(DEVICE_CUDA, d_inplace, d_inplace, d_targets, dloss, N, V);
    float *g_d3 = host_copy_of(d_inplace, NV);
    const int inplace_ok = memcmp(g_p3, g_p, (size_t)NV * 4) == 0 && memcmp(g_loss3, g_loss, (size_t)N * 4) == 0 &&
                           memcmp(g_d3, g_d, (size_t)NV * 4) == 0;
    printf("crossentropy %-14s in place (probs = logits, dlogits = probs) bitwise equal to out of place: %s\n", shape,
           inplace_ok ? "ok" : "FAIL");
    ok &= inplace_ok;
    free(g_p3), free(g_loss3), free(g_d3);
    device_free(DEVICE_CUDA, d_inplace), device_free(DEVICE_CUDA, d_loss3);

    float *host[] = {logits, c_loss, c_p, g_loss, g_p, g_loss2, g_p2, probs_in, c_d, g_d};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    free(targets);
    double *refs[] = {ref_p, sc_p, ref_loss, sc_loss, ref_d, sc_d};
    for (size_t k = 0; k < sizeof refs / sizeof refs[0]; k++) free(refs[k]);
    float *dev[] = {d_logits, d_loss, d_p, d_probs_in, d_d};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) device_free(DEVICE_CUDA, dev[k]);
    device_free(DEVICE_CUDA, d_targets);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- AdamW
typedef struct {
    int64_t n;
    int t;
    float lr, beta1, beta2, eps, weight_decay, grad_scale;
    int rounding_probe; // 1: gradients are chosen BF16 rounding cases (ties, subnormals, overflow)
} AdamwCase;

// BF16 round-to-nearest-even of a finite float, written independently of float_to_bf16: take the
// two BF16 neighbours (truncation and the next one away from zero) and pick the nearer in double,
// the even one on a tie. The neighbour above the largest finite BF16 is 2^128, i.e. +-infinity.
static uint16_t ref_bf16_rne(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint16_t lo = (uint16_t)(bits >> 16), hi = (uint16_t)(lo + 1);
    const double lo_val = fabs((double)bf16_to_float(lo));
    const double hi_val = (hi & 0x7FFF) == 0x7F80 ? ldexp(1.0, 128) : fabs((double)bf16_to_float(hi));
    const double x = fabs((double)f);
    if (x - lo_val < hi_val - x) return lo;
    if (x - lo_val > hi_val - x) return hi;
    return (lo & 1) ? hi : lo;
}

// Distance in BF16 steps between two BF16 bit patterns (same sign assumed near each other; a sign
// difference counts the steps through zero).
static int64_t bf16_steps(uint16_t x, uint16_t y) {
    const int64_t kx = (x & 0x8000) ? -(int64_t)(x & 0x7FFF) : (int64_t)x;
    const int64_t ky = (y & 0x8000) ? -(int64_t)(y & 0x7FFF) : (int64_t)y;
    return kx > ky ? kx - ky : ky - kx;
}

// Moments: compared as BF16 patterns. GPU and CPU run the same FP32 expressions in the same order, so
// they are expected bit-identical; the tolerance is 1 BF16 step, for an FP32 result that differs in its
// last bit and lands on the other side of a BF16 rounding boundary. Against f64 (the exact moment of
// the FP32 inputs, rounded RNE): also 1 step. In the rounding probe (beta = 0: the moment is exactly
// g, resp. g*g in FP32) the f64 check is exact: 0 steps from the independent RNE above.
static int check_moment(const char *shape, const char *output, const uint16_t *gpu, const uint16_t *cpu,
                        const uint16_t *ref, int64_t n, int64_t tol_steps) {
    int64_t max_gc = 0, max_gr = 0, max_cr = 0, bitwise = 0, worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t gc = bf16_steps(gpu[i], cpu[i]), gr = bf16_steps(gpu[i], ref[i]), cr = bf16_steps(cpu[i], ref[i]);
        bitwise += gpu[i] == cpu[i];
        if (gc > max_gc || (gc == max_gc && gr > max_gr)) worst = i;
        if (gc > max_gc) max_gc = gc;
        if (gr > max_gr) max_gr = gr;
        if (cr > max_cr) max_cr = cr;
    }
    const int pass = max_gc <= tol_steps && max_gr <= tol_steps;
    char steps_gc[32], steps_gr[32], steps_cr[32], tol[32];
    snprintf(steps_gc, sizeof steps_gc, "%lld st", (long long)max_gc);
    snprintf(steps_gr, sizeof steps_gr, "%lld st", (long long)max_gr);
    snprintf(steps_cr, sizeof steps_cr, "%lld st", (long long)max_cr);
    snprintf(tol, sizeof tol, "%lld st", (long long)tol_steps);
    printf("%-22s %-18s %-8s %10s %9s %9s %9s %9s %9s %8.4f%%  %s\n", "adamw_update", shape, output, "(bf16)",
           steps_gc, tol, steps_gr, tol, steps_cr, 100.0 * (double)bitwise / (double)n, pass ? "ok" : "FAIL");
    if (!pass)
        printf("    worst [%lld]: gpu 0x%04x (%.6g)  cpu 0x%04x (%.6g)  f64-rne 0x%04x (%.6g)  ('st' = BF16 steps)\n",
               (long long)worst, gpu[worst], bf16_to_float(gpu[worst]), cpu[worst], bf16_to_float(cpu[worst]),
               ref[worst], bf16_to_float(ref[worst]));
    if (max_cr > tol_steps) printf("    the CPU moments are off the f64 reference too: the CPU op is suspect\n");
    fflush(stdout);
    return pass;
}

// An AdamW step's n random inputs (never zero) from seed: weights, gradients, BF16 moments m0 and v0 (v0 >= 0), and
// tmp, a scratch array of n floats the caller may reuse.
static void adamw_inputs(int64_t n, uint64_t seed, float **param, float **grad, float **tmp, uint16_t **m0,
                         uint16_t **v0) {
    *param = floats(n), *grad = floats(n), *tmp = floats(n);
    *m0 = xmalloc((size_t)n * 2), *v0 = xmalloc((size_t)n * 2);
    opcheck_fill_nonzero(*param, (size_t)n, seed + 1, 0.01, 1.0);
    opcheck_fill_nonzero(*grad, (size_t)n, seed + 2, 1e-4, 0.1);
    opcheck_fill_nonzero(*tmp, (size_t)n, seed + 3, 1e-4, 0.05);
    for (int64_t i = 0; i < n; i++) (*m0)[i] = ref_bf16_rne((*tmp)[i]);
    opcheck_fill_nonzero(*tmp, (size_t)n, seed + 4, 1e-6, 1e-2);
    for (int64_t i = 0; i < n; i++) (*v0)[i] = ref_bf16_rne(fabsf((*tmp)[i]));
}

// Params: p - lr * upd. The scale is |p| + lr * (size of upd), where the size of upd counts the
// magnitudes that m is computed from (|beta1 m| + |(1-beta1) g|, which may cancel) over the same
// denominator, plus |wd p|. About ten roundings inside upd, one for the product with lr and one for
// the final subtraction: tolerance 16 u (about 1e-6 relative), expected bit-identical.
static void test_adamw(void **state) {
    const AdamwCase *tc = (const AdamwCase *)*state;
    const int64_t n = tc->n;
    char shape[48];
    snprintf(shape, sizeof shape, "n=%lld t=%d%s", (long long)n, tc->t, tc->rounding_probe ? " bf16" : "");
    const uint64_t seed = 4000u + (uint64_t)n + 101u * (uint64_t)tc->t + 7u * (uint64_t)tc->rounding_probe;
    int ok = 1;

    float *param, *grad, *tmp;
    uint16_t *m0, *v0;
    adamw_inputs(n, seed, &param, &grad, &tmp, &m0, &v0);
    if (tc->rounding_probe) {
        // gradients whose BF16 rounding is a tie (dropped 16 bits = 0x8000, odd and even kept part),
        // one off a tie either way, subnormal, and near the top of the range (rounds up to infinity:
        // the largest finite BF16 is 0x7F7F, and 0x7F7F8000 is its tie with 2^128)
        static const uint32_t probes[] = {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0xBF818000u,
                                          0x00018000u, 0x00008000u, 0x80028000u, 0x7F7F7FFFu, 0x7F7F8000u,
                                          0xFF7F8000u, 0x1F7F8000u, 0x5F7F8000u};
        const int64_t n_probes = (int64_t)(sizeof probes / sizeof probes[0]);
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = probes[i % n_probes];
            if (i >= n_probes) bits ^= (uint32_t)(opcheck_mix64(seed + (uint64_t)i) & 0x007E0000u); // vary kept bits
            memcpy(&grad[i], &bits, 4);
        }
    }

    // f64 reference of one step from the same inputs
    const double bc1 = 1.0 - pow(tc->beta1, tc->t), bc2 = 1.0 - pow(tc->beta2, tc->t);
    double *ref_p = doubles(n), *sc_p = doubles(n);
    uint16_t *ref_m = xmalloc((size_t)n * 2), *ref_v = xmalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) {
        const double g = (double)grad[i] * tc->grad_scale, m_old = bf16_to_float(m0[i]), v_old = bf16_to_float(v0[i]);
        const double m = tc->beta1 * m_old + (1.0 - tc->beta1) * g;
        const double v = tc->beta2 * v_old + (1.0 - tc->beta2) * g * g;
        const double denom = sqrt(v / bc2) + tc->eps, p = param[i];
        // where v overflows FP32 (only in the rounding probe: g near 2^128) the FP32 step divides by
        // infinity and its first term is 0; the reference follows FP32 there
        const int v_overflows = v > FLT_MAX;
        const double upd = (v_overflows ? 0.0 : (m / bc1) / denom) + tc->weight_decay * p;
        const double step_size =
            v_overflows ? 0.0 : (fabs(tc->beta1 * m_old) + fabs((1.0 - tc->beta1) * g)) / bc1 / denom;
        const double upd_size = step_size + fabs(tc->weight_decay * p);
        ref_p[i] = p - tc->lr * upd;
        sc_p[i] = fabs(p) + tc->lr * upd_size;
        ref_m[i] = ref_bf16_rne((float)m); // (float)m: exact in the probe; else within 1 step anyway
        ref_v[i] = v_overflows ? 0x7F80 : ref_bf16_rne((float)v);
    }

    float *c_p = floats(n);
    uint16_t *c_m = xmalloc((size_t)n * 2), *c_v = xmalloc((size_t)n * 2);
    memcpy(c_p, param, (size_t)n * 4);
    memcpy(c_m, m0, (size_t)n * 2);
    memcpy(c_v, v0, (size_t)n * 2);
    adamw_update(DEVICE_CPU, c_p, grad, c_m, c_v, n, tc->lr, tc->beta1, tc->beta2, tc->eps, tc->weight_decay,
                 tc->grad_scale, tc->t);
    float *d_p = gpu_copy_of(param, (size_t)n * 4), *d_g = gpu_copy_of(grad, (size_t)n * 4);
    uint16_t *d_m = gpu_copy_of(m0, (size_t)n * 2), *d_v = gpu_copy_of(v0, (size_t)n * 2);
    adamw_update(DEVICE_CUDA, d_p, d_g, d_m, d_v, n, tc->lr, tc->beta1, tc->beta2, tc->eps, tc->weight_decay,
                 tc->grad_scale, tc->t);
    float *g_p = host_copy_of(d_p, n);
    uint16_t *g_m = xmalloc((size_t)n * 2), *g_v = xmalloc((size_t)n * 2);
    device_memcpy_to_host(DEVICE_CUDA, g_m, d_m, (size_t)n * 2);
    device_memcpy_to_host(DEVICE_CUDA, g_v, d_v, (size_t)n * 2);

    ok &= check_output("adamw_update", shape, "param", g_p, c_p, ref_p, sc_p, n, tol_both(16 * U_FP32));
    const int64_t moment_tol = tc->rounding_probe ? 0 : 1;
    ok &= check_moment(shape, "m", g_m, c_m, ref_m, n, moment_tol);
    ok &= check_moment(shape, "v", g_v, c_v, ref_v, n, moment_tol);

    void *host[] = {param, grad, tmp, m0, v0, ref_p, sc_p, ref_m, ref_v, c_p, c_m, c_v, g_p, g_m, g_v};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    void *dev[] = {d_p, d_g, d_m, d_v};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) device_free(DEVICE_CUDA, dev[k]);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- cases
// Block sizes in the kernels: 256 (RMSNorm rows, dweight columns, elementwise), 512 (CE rows);
// the backward's blocks take 32 rows each (one chunk of the weight gradient's sum), and its finishing kernel
// sums the chunks in 8 warps. The shapes below are not multiples of them and cover one chunk (N = 1, 5), a few
// (37, 300), more chunks than warps (N = 2500), each register form (PER 1, 2, 4, 8, 16 columns per thread) and
// the loop form (C > 4096) with one chunk and with several.
static RmsnormCase rms_small = {37, 300}, rms_wide = {1, 7168}, rms_mid = {300, 1536}, rms_tall = {2500, 257},
                   rms_one_col = {5, 1}, rms_per4 = {200, 768}, rms_per16 = {100, 3000},
                   rms_wide_rows = {70, 5000};
// SwiGLU: float4 path with only the scalar tail (n = 1), float4 path and a 3-element tail (1000003), float4
// path alone (n a multiple of 4), and the scalar kernel (buffers 4 bytes past 16-byte alignment, odd n).
static SwigluCase swiglu_one = {1, 0}, swiglu_big = {1000003, 0}, swiglu_vec4 = {1048576, 0},
                  swiglu_misaligned = {4099, 1};
// The output head's BF16 form (kernels.h crossentropy_*_bf16, bf16_matmul_*_bf16) on the GPU: on the same BF16
// logits, every result must have the bits of the FP32 forms on the same device - the losses, the probabilities
// recomputed from the kept row statistics, the gradient (then rounded to BF16 as bf16_matmul_backward rounds it) and
// the head GEMMs' outputs - and the losses must match the CPU's BF16 form within test_crossentropy's tolerance.
static void test_crossentropy_bf16(void **state) {
    const CrossentropyCase *tc = (const CrossentropyCase *)*state;
    const int N = tc->N, V = tc->V, D = 64;
    const int64_t NV = (int64_t)N * V;
    char shape[48];
    snprintf(shape, sizeof shape, "N=%d V=%d", N, V);
    const uint64_t seed = 5000u + 7u * (uint64_t)N + 13u * (uint64_t)V;
    int ok = 1;
    // the logits as the head makes them: h (N, D) w (V, D)^T in BF16
    float *h = floats((int64_t)N * D), *w = floats((int64_t)V * D);
    int *targets = xmalloc((size_t)N * sizeof(int));
    opcheck_fill_nonzero(h, (size_t)N * D, seed, 0.1, 1.0);
    opcheck_fill_nonzero(w, (size_t)V * D, seed + 1, 0.1, 1.0);
    opcheck_fill_int(targets, (size_t)N, seed + 2, 0, V);
    targets[0] = -1;
    float *d_h = gpu_copy_of(h, (size_t)N * D * 4), *d_w = gpu_copy_of(w, (size_t)V * D * 4);
    int *d_targets = gpu_copy_of(targets, (size_t)N * sizeof(int));
    float *d_logits = gpu_nan_floats(NV), *d_loss = gpu_nan_floats(N), *d_loss16 = gpu_nan_floats(N);
    float *d_max = gpu_nan_floats(N), *d_p16 = gpu_nan_floats(NV);
    double *d_sum = device_alloc(DEVICE_CUDA, (size_t)N * sizeof(double));
    uint16_t *d_logits16 = device_alloc(DEVICE_CUDA, (size_t)NV * 2);
    bf16_matmul_forward(DEVICE_CUDA, d_logits, d_h, d_w, N, D, V);
    bf16_matmul_forward_bf16(DEVICE_CUDA, d_logits16, d_h, d_w, N, D, V);
    float *g_logits = host_copy_of(d_logits, NV);
    uint16_t *g_logits16 = xmalloc((size_t)NV * 2);
    device_memcpy_to_host(DEVICE_CUDA, g_logits16, d_logits16, (size_t)NV * 2);
    int64_t differ = 0;
    for (int64_t i = 0; i < NV; i++) differ += g_logits16[i] != float_to_bf16(g_logits[i]);
    printf("bf16 head %-14s logits: %lld of %lld differ from bf16_matmul_forward's  %s\n", shape, (long long)differ,
           (long long)NV, differ ? "FAIL" : "ok");
    ok &= differ == 0;

    crossentropy_forward(DEVICE_CUDA, d_loss, d_logits, d_logits, d_targets, N, V);  // probs in place
    crossentropy_forward_bf16(DEVICE_CUDA, d_loss16, d_max, d_sum, d_logits16, d_targets, N, V);
    crossentropy_probs_bf16(DEVICE_CUDA, d_p16, d_logits16, d_max, d_sum, N, V);
    float *g_loss = host_copy_of(d_loss, N), *g_loss16 = host_copy_of(d_loss16, N);
    float *g_p = host_copy_of(d_logits, NV), *g_p16 = host_copy_of(d_p16, NV);
    const int fwd_ok = memcmp(g_loss, g_loss16, (size_t)N * 4) == 0 && memcmp(g_p, g_p16, (size_t)NV * 4) == 0;
    printf("bf16 head %-14s losses and probabilities bitwise those of the FP32 form: %s\n", shape,
           fwd_ok ? "ok" : "FAIL");
    ok &= fwd_ok;

    // the CPU's BF16 form on the same logits, against f64
    float *c_loss = nan_floats(N), *c_max = nan_floats(N), *x = floats(NV);
    double *c_sum = doubles(N), *ref_loss = doubles(N), *sc_loss = doubles(N);
    crossentropy_forward_bf16(DEVICE_CPU, c_loss, c_max, c_sum, g_logits16, targets, N, V);
    for (int64_t i = 0; i < NV; i++) x[i] = bf16_to_float(g_logits16[i]);
    for (int n = 0; n < N; n++) {
        const float *xr = x + (int64_t)n * V;
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, xr[j]);
        for (int j = 0; j < V; j++) sum += exp((double)xr[j] - mx);
        const int t = targets[n];
        ref_loss[n] = t < 0 ? 0.0 : log(sum) + mx - xr[t];
        sc_loss[n] = 1.0 + fabs(log(sum)) + fabs(mx) + (t < 0 ? 0.0 : fabs((double)xr[t]));
    }
    ok &= check_output("crossentropy_fwd_bf16", shape, "losses", g_loss16, c_loss, ref_loss, sc_loss, N,
                       (Tol){sequential_sum_bound(V), sum_tol(V)});

    // backward in place: the FP32 form's gradient rounded to BF16, bit for bit; then the head's two GEMMs
    const float dloss = 0.37f;
    crossentropy_backward(DEVICE_CUDA, d_logits, d_logits, d_targets, dloss, N, V);
    crossentropy_backward_bf16(DEVICE_CUDA, d_logits16, d_logits16, d_max, d_sum, d_targets, dloss, N, V);
    float *g_d = host_copy_of(d_logits, NV);
    uint16_t *g_d16 = xmalloc((size_t)NV * 2);
    device_memcpy_to_host(DEVICE_CUDA, g_d16, d_logits16, (size_t)NV * 2);
    differ = 0;
    for (int64_t i = 0; i < NV; i++) differ += g_d16[i] != float_to_bf16(g_d[i]);
    printf("bf16 head %-14s dlogits: %lld of %lld differ from bf16(crossentropy_backward)  %s\n", shape,
           (long long)differ, (long long)NV, differ ? "FAIL" : "ok");
    ok &= differ == 0;
    float *d_dh = gpu_copy_of(h, (size_t)N * D * 4), *d_dw = gpu_copy_of(w, (size_t)V * D * 4);  // += onto these
    float *d_dh16 = gpu_copy_of(h, (size_t)N * D * 4), *d_dw16 = gpu_copy_of(w, (size_t)V * D * 4);
    bf16_matmul_backward(DEVICE_CUDA, d_dh, d_dw, d_logits, d_h, d_w, N, D, V);
    bf16_matmul_backward_bf16(DEVICE_CUDA, d_dh16, d_dw16, d_logits16, d_h, d_w, N, D, V);
    float *g_dh = host_copy_of(d_dh, (int64_t)N * D), *g_dh16 = host_copy_of(d_dh16, (int64_t)N * D);
    float *g_dw = host_copy_of(d_dw, (int64_t)V * D), *g_dw16 = host_copy_of(d_dw16, (int64_t)V * D);
    const int bwd_ok = memcmp(g_dh, g_dh16, (size_t)N * D * 4) == 0 && memcmp(g_dw, g_dw16, (size_t)V * D * 4) == 0;
    printf("bf16 head %-14s dh and dw bitwise bf16_matmul_backward's: %s\n", shape, bwd_ok ? "ok" : "FAIL");
    ok &= bwd_ok;

    float *host[] = {h, w, g_logits, g_loss, g_loss16, g_p, g_p16, c_loss, c_max, x, g_d, g_dh, g_dh16, g_dw, g_dw16};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++) free(host[k]);
    free(targets), free(g_logits16), free(g_d16), free(c_sum), free(ref_loss), free(sc_loss);
    float *dev[] = {d_h, d_w, d_logits, d_loss, d_loss16, d_max, d_p16, d_dh, d_dw, d_dh16, d_dw16};
    for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) device_free(DEVICE_CUDA, dev[k]);
    device_free(DEVICE_CUDA, d_targets), device_free(DEVICE_CUDA, d_sum), device_free(DEVICE_CUDA, d_logits16);
    assert_true(ok);
}

// adamw_update_bf16_copy: the CUDA op against the same inputs through adamw_update then bf16_round_array, and
// against the CPU op: weights, moments and copy bitwise equal to both. Tolerance 0: the op's contract is those
// calls' bits, and each of them is the CPU's function (test_adamw; the BF16 rounding); the copy is rounded from the
// same FP32 value in the same way. n a multiple of 4 (the 4-wide path) and not, and a start one element off
// alignment (a weight's offset in the flat buffer need not be a multiple of 4).
typedef struct {
    int64_t n;
    int shift;
} AdamwCopyCase;

static int differing_bytes(const void *a, const void *b, size_t n) {
    int d = 0;
    for (size_t i = 0; i < n; i++) d += ((const uint8_t *)a)[i] != ((const uint8_t *)b)[i];
    return d;
}

static void test_adamw_bf16_copy(void **state) {
    const AdamwCopyCase *tc = (const AdamwCopyCase *)*state;
    const int64_t n = tc->n, at = tc->shift, all = at + n;
    const float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.7f;
    const int t = 3;
    const uint64_t seed = 9100u + (uint64_t)n + (uint64_t)tc->shift;
    float *param, *grad, *tmp;
    uint16_t *m0, *v0;
    adamw_inputs(all, seed, &param, &grad, &tmp, &m0, &v0);

    // [0]: the CUDA op, [1]: the CUDA ops it stands for, [2]: the CPU op; every output copied to host[k][o]
    float *d_g = gpu_copy_of(grad, (size_t)all * 4);
    void *host[3][4];
    const size_t bytes[4] = {(size_t)all * 4, (size_t)all * 2, (size_t)all * 2, (size_t)n * 2};
    for (int k = 0; k < 3; k++) {
        const Device dev = k < 2 ? DEVICE_CUDA : DEVICE_CPU;
        float *p = device_alloc(dev, bytes[0]);
        uint16_t *m = device_alloc(dev, bytes[1]), *v = device_alloc(dev, bytes[2]), *b = device_alloc(dev, bytes[3]);
        device_memcpy_from_host(dev, p, param, bytes[0]);
        device_memcpy_from_host(dev, m, m0, bytes[1]);
        device_memcpy_from_host(dev, v, v0, bytes[2]);
        const float *g = k < 2 ? d_g : grad;
        if (k == 1) {
            adamw_update(dev, p + at, g + at, m + at, v + at, n, lr, beta1, beta2, eps, wd, grad_scale, t);
            bf16_round_array(dev, b, p + at, n);
        } else {
            adamw_update_bf16_copy(dev, p + at, g + at, m + at, v + at, b, n, lr, beta1, beta2, eps, wd, grad_scale, t);
        }
        void *src[4] = {p, m, v, b};
        for (int o = 0; o < 4; o++) {
            host[k][o] = xmalloc(bytes[o]);
            device_memcpy_to_host(dev, host[k][o], src[o], bytes[o]);
            device_free(dev, src[o]);
        }
    }
    const char *names[4] = {"param", "m", "v", "copy"};
    int ok = 1;
    for (int o = 0; o < 4; o++) {
        const int d01 = differing_bytes(host[0][o], host[1][o], bytes[o]);
        const int d02 = differing_bytes(host[0][o], host[2][o], bytes[o]);
        printf("adamw_update_bf16_copy n=%lld +%d %-6s differing bytes: vs CUDA ops %d, vs CPU op %d  %s\n",
               (long long)n, tc->shift, names[o], d01, d02, d01 == 0 && d02 == 0 ? "ok" : "FAIL");
        ok &= d01 == 0 && d02 == 0;
    }
    fflush(stdout);
    for (int k = 0; k < 3; k++)
        for (int o = 0; o < 4; o++) free(host[k][o]);
    device_free(DEVICE_CUDA, d_g);
    free(param), free(grad), free(tmp), free(m0), free(v0);
    assert_true(ok);
}

// Rows up to 64 x 512 elements are held in registers (kernels/cuda/crossentropy.cu), longer ones take three passes:
// tiny and mid (5000) and the bench's vocabulary (32768, the largest register row) take the first path.
static CrossentropyCase ce_gpt2 = {37, 50257}, ce_dsv3 = {4, 129280}, ce_tiny = {64, 3}, ce_mid = {9, 5000},
                        ce_bench = {16, 32768};
static AdamwCase adamw_first = {1000003, 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.8f, 0};
static AdamwCase adamw_later = {1000003, 1000, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 0};
static AdamwCase adamw_one = {1, 7, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 0.5f, 0};
static AdamwCase adamw_bf16 = {4099, 1, 1e-3f, 0.0f, 0.0f, 1e-8f, 0.1f, 1.0f, 1};
// n a multiple of 4 (aligned buffers): the kernel's 4-wide path; the cases above take the scalar one
static AdamwCase adamw_vec4 = {1000000, 5, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.8f, 0};
static AdamwCase adamw_vec4_bf16 = {4096, 1, 1e-3f, 0.0f, 0.0f, 1e-8f, 0.1f, 1.0f, 1};
static AdamwCopyCase copy_vec4 = {1000000, 0}, copy_odd = {4099, 0}, copy_shifted = {65536, 1};

int main(void) {
    const int n_gpu = gpucheck_devices("test_gpu_ops");
    if (n_gpu == 0) return 1;
    printf("test_gpu_ops: %d CUDA device(s) visible; comparing CUDA ops with the CPU reference and f64.\n"
           "err = |x - y| / scale per element (scale: size of what the element is computed from), max over "
           "elements; u = 2^-24 = %.3g; 'st' = BF16 steps.\n", n_gpu, U_FP32);
    print_table_header();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_memory),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_small),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_wide),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_mid),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_tall),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_one_col),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_per4),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_per16),
        cmocka_unit_test_prestate(test_rmsnorm, &rms_wide_rows),
        cmocka_unit_test_prestate(test_swiglu, &swiglu_one),
        cmocka_unit_test_prestate(test_swiglu, &swiglu_big),
        cmocka_unit_test_prestate(test_swiglu, &swiglu_vec4),
        cmocka_unit_test_prestate(test_swiglu, &swiglu_misaligned),
        cmocka_unit_test_prestate(test_crossentropy, &ce_gpt2),
        cmocka_unit_test_prestate(test_crossentropy, &ce_dsv3),
        cmocka_unit_test_prestate(test_crossentropy, &ce_tiny),
        cmocka_unit_test_prestate(test_crossentropy, &ce_mid),
        cmocka_unit_test_prestate(test_crossentropy, &ce_bench),
        cmocka_unit_test_prestate(test_crossentropy_bf16, &ce_tiny),  // V % 8 != 0: the unstaged kernels
        cmocka_unit_test_prestate(test_crossentropy_bf16, &ce_mid),
        cmocka_unit_test_prestate(test_crossentropy_bf16, &ce_bench),
        cmocka_unit_test_prestate(test_adamw, &adamw_first),
        cmocka_unit_test_prestate(test_adamw, &adamw_later),
        cmocka_unit_test_prestate(test_adamw, &adamw_one),
        cmocka_unit_test_prestate(test_adamw, &adamw_bf16),
        cmocka_unit_test_prestate(test_adamw, &adamw_vec4),
        cmocka_unit_test_prestate(test_adamw, &adamw_vec4_bf16),
        cmocka_unit_test_prestate(test_adamw_bf16_copy, &copy_vec4),
        cmocka_unit_test_prestate(test_adamw_bf16_copy, &copy_odd),
        cmocka_unit_test_prestate(test_adamw_bf16_copy, &copy_shifted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
