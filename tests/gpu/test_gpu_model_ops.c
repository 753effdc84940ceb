/*
 * test_gpu_model_ops.c - CUDA vs CPU parity of the model's remaining ops on the GPU: FP32 matmul (cuBLASLt),
 * embedding, RoPE, copy_block, add/scale, sum_squares, the DeepSeek-V3 router
 * and balance loss, and the MoE token permutation (the device plan, gather, unpermute, combine). Runs only on
 * a machine with an NVIDIA GPU (tests/gpu/run.sh); with no visible GPU it FAILS at once, so a GPU job can
 * never pass by testing nothing.
 *
 * As in test_gpu_ops.c: each case draws random non-zero inputs from the counter-based RNG, runs the op
 * through the kernels.h dispatch on DEVICE_CPU and on DEVICE_CUDA, and compares both with a double-precision
 * reference computed here from the same inputs:
 *   gpu-cpu  asserted (the CPU op is the project's reference),
 *   gpu-f64  asserted (the GPU result is right on its own),
 *   cpu-f64  printed (over the tolerance means the CPU op itself is suspect; the message says so).
 * Errors are |x - y| / scale per element, where scale is the size of what the element is computed from (the
 * sum of |terms|), so cancellation cannot make a right answer look wrong. Tolerances are in u = 2^-24 (FP32
 * unit roundoff), stated with their reason at each test. Forward outputs are poisoned with NaN (integer
 * outputs with -7) before the call, so an element a kernel does not write fails; accumulated gradients start
 * from random values (checks +=). Integer outputs (routing indices, the permutation plan) must be bitwise
 * equal to the CPU's and are also checked against independent invariants (the plain top-K really is the top
 * K; the plan really is a stable sort by expert). Every backward op runs twice on the GPU and must give the
 * same bits (no atomics, fixed reduction order); ops with optional gradients also run with one gradient at a
 * time (NULL for the other), which must give the same bits. Shapes are odd on purpose (N = 37, C = 300, ...),
 * and the router runs E = 8 / 4 groups / 2 kept / K = 2, E = 32 / 8 / 4 / K = 6 and DeepSeek-V3's
 * E = 256 / 8 / 4 / K = 8, with rows of exactly tied scores to check that ties go to the lower index.
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
#define U_FP64 0x1p-53 // unit roundoff of FP64
#define INT_POISON (-7)

// Tolerance of an FP32 sum of n terms in any order, relative to the sum of |terms|: rounding errors of random
// sign grow like sqrt(n) u (measured on an H200 for test_gpu_ops.c: 0.9 sqrt(n) u .. 1.5 sqrt(n) u);
// 8 sqrt(n) u keeps a wide margin, plus 16 u for the few roundings around the sum.
static double sum_tol(int64_t n) { return (8.0 * sqrt((double)n) + 16.0) * U_FP32; }

// Tolerances of one output: gpu-cpu (parity) and gpu-f64.
typedef struct {
    double parity, f64;
} Tol;
static Tol tol_both(double t) { return (Tol){t, t}; }

// ---------------------------------------------------------------------------- buffers
// Every buffer a test allocates is tracked and freed by free_all() at its end.
enum { MAX_ALLOCS = 512 };
static void *host_allocs[MAX_ALLOCS], *dev_allocs[MAX_ALLOCS];
static int n_host_allocs, n_dev_allocs;

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes > 0 ? bytes : 1);
    if (p == NULL || n_host_allocs == MAX_ALLOCS) {
        fprintf(stderr, "%s:%d: malloc of %zu bytes failed (or more than %d buffers)\n", __FILE__, __LINE__, bytes,
                MAX_ALLOCS);
        exit(1);
    }
    host_allocs[n_host_allocs++] = p;
    return p;
}
static void *dalloc(size_t bytes) {
    if (n_dev_allocs == MAX_ALLOCS) {
        fprintf(stderr, "%s:%d: more than %d device buffers in one test\n", __FILE__, __LINE__, MAX_ALLOCS);
        exit(1);
    }
    void *p = device_alloc(DEVICE_CUDA, bytes > 0 ? bytes : 4);
    dev_allocs[n_dev_allocs++] = p;
    return p;
}
static void free_all(void) {
    for (int i = 0; i < n_host_allocs; i++) free(host_allocs[i]);
    for (int i = 0; i < n_dev_allocs; i++) device_free(DEVICE_CUDA, dev_allocs[i]);
    n_host_allocs = n_dev_allocs = 0;
}

static float *floats(int64_t n) { return xmalloc((size_t)n * sizeof(float)); }
static double *doubles(int64_t n) { return xmalloc((size_t)n * sizeof(double)); }
static int *ints(int64_t n) { return xmalloc((size_t)n * sizeof(int)); }
static float *nan_floats(int64_t n) {
    float *x = floats(n);
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
static int *poison_ints(int64_t n) {
    int *x = ints(n);
    for (int64_t i = 0; i < n; i++) x[i] = INT_POISON;
    return x;
}
static float *copy_floats(const float *x, int64_t n) {
    float *y = floats(n);
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}
static int *copy_ints(const int *x, int64_t n) {
    int *y = ints(n);
    memcpy(y, x, (size_t)n * sizeof(int));
    return y;
}

// A device copy of host (bytes) starting `offset` floats into a fresh allocation: offset 1 gives a pointer
// that is only 4-byte aligned, as a slice of a flat parameter buffer can be.
static void *gpu_copy_at(const void *host, size_t bytes, int offset) {
    float *base = dalloc(bytes + (size_t)offset * sizeof(float));
    void *d = base + offset;
    if (bytes > 0) device_memcpy_from_host(DEVICE_CUDA, d, host, bytes);
    return d;
}
static float *gpu_floats(const float *h, int64_t n) { return gpu_copy_at(h, (size_t)n * sizeof(float), 0); }
static int *gpu_ints(const int *h, int64_t n) { return gpu_copy_at(h, (size_t)n * sizeof(int), 0); }
static float *gpu_nan_floats(int64_t n) { return gpu_floats(nan_floats(n), n); }
static int *gpu_poison_ints(int64_t n) { return gpu_ints(poison_ints(n), n); }
static void gpu_set_floats(float *d, const float *h, int64_t n) {
    device_memcpy_from_host(DEVICE_CUDA, d, h, (size_t)n * sizeof(float));
}
static float *host_floats(const float *d, int64_t n) {
    float *h = floats(n);
    if (n > 0) device_memcpy_to_host(DEVICE_CUDA, h, d, (size_t)n * sizeof(float));
    return h;
}
static int *host_ints(const int *d, int64_t n) {
    int *h = ints(n);
    if (n > 0) device_memcpy_to_host(DEVICE_CUDA, h, d, (size_t)n * sizeof(int));
    return h;
}

// ---------------------------------------------------------------------------- comparison and table
static void print_table_header(void) {
    printf("\n%-22s %-26s %-9s %10s %9s %9s %9s %9s %9s %9s  %s\n", "op", "shape", "output", "max|g-c|", "gpu-cpu",
           "tol", "gpu-f64", "tol", "cpu-f64", "bitwise", "result");
    printf("%-22s %-26s %-9s %10s %9s %9s %9s %9s %9s %9s  %s\n", "", "", "", "(abs)", "(err)", "(g-c)", "(err)",
           "(f64)", "(err)", "equal", "");
}

static void print_plain_row(const char *op, const char *shape, const char *output, const char *bitwise,
                            const char *result) {
    printf("%-22s %-26s %-9s %10s %9s %9s %9s %9s %9s %9s  %s\n", op, shape, output, "-", "-", "-", "-", "-", "-",
           bitwise, result);
    fflush(stdout);
}

// Compares one float output, prints its table row, and on failure says which side is wrong and where.
// Returns 1 when gpu-cpu is within tol.parity and gpu-f64 within tol.f64.
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
    printf("%-22s %-26s %-9s %10.3e %9.2e %9.2e %9.2e %9.2e %9.2e %8.4f%%  %s\n", op, shape, output, max_abs, e_gc,
           tol.parity, e_gr, tol.f64, e_cr, n > 0 ? 100.0 * (double)bitwise / (double)n : 100.0, pass ? "ok" : "FAIL");
    if (!pass) {
        int64_t first;
        const int64_t nan_gpu = count_nan(gpu, n, &first);
        if (nan_gpu > 0)
            printf("    GPU %s has %lld NaN (poisoned before the call: not written by the kernel, or computed as "
                   "NaN), first at [%lld]\n", output, (long long)nan_gpu, (long long)first);
        const int64_t nan_cpu = count_nan(cpu, n, &first);
        if (nan_cpu > 0) printf("    CPU %s has %lld NaN, first at [%lld]\n", output, (long long)nan_cpu, (long long)first);
        const int64_t w = e_gc > tol.parity ? w_gc : w_gr;
        printf("    worst [%lld]: gpu %.9g  cpu %.9g  f64 %.12g  scale %.6g  (gpu-cpu %.3g, gpu-f64 %.3g in units of "
               "scale; tol %.3g, %.3g)\n", (long long)w, gpu[w], cpu[w], ref[w], scale[w],
               fabs((double)gpu[w] - cpu[w]) / scale[w], fabs((double)gpu[w] - ref[w]) / scale[w], tol.parity, tol.f64);
        if (e_cr > tol.parity)
            printf("    cpu-f64 is over the tolerance too (worst [%lld]: cpu %.9g, f64 %.12g): the CPU reference op is "
                   "suspect, not only the CUDA one\n", (long long)w_cr, cpu[w_cr], ref[w_cr]);
        else if (e_gr > tol.f64)
            printf("    the CPU op agrees with the f64 reference; the CUDA op is the one that is off\n");
    }
    fflush(stdout);
    return pass;
}

// One scalar result (double or a real widened to double), same row format.
static int check_scalar(const char *op, const char *shape, const char *output, double gpu, double cpu, double ref,
                        double scale, Tol tol) {
    const double e_gc = fabs(gpu - cpu) / scale, e_gr = fabs(gpu - ref) / scale, e_cr = fabs(cpu - ref) / scale;
    const int pass = e_gc <= tol.parity && e_gr <= tol.f64; // false for NaN
    printf("%-22s %-26s %-9s %10.3e %9.2e %9.2e %9.2e %9.2e %9.2e %9s  %s\n", op, shape, output, fabs(gpu - cpu), e_gc,
           tol.parity, e_gr, tol.f64, e_cr, gpu == cpu ? "yes" : "no", pass ? "ok" : "FAIL");
    if (!pass)
        printf("    gpu %.17g  cpu %.17g  f64 %.17g  scale %.6g%s\n", gpu, cpu, ref, scale,
               e_cr > tol.parity ? "  (cpu-f64 over the tolerance too: the CPU op is suspect)" : "");
    fflush(stdout);
    return pass;
}

// Two GPU results of the same computation (run twice, or with one gradient at a time): must be bitwise equal.
static int check_bitwise_repeat(const char *op, const char *shape, const char *output, const float *first,
                                const float *second, int64_t n, const char *how) {
    int64_t differ = 0, first_diff = -1;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&first[i], &second[i], sizeof(float)) != 0 && differ++ == 0) first_diff = i;
    }
    char result[96];
    snprintf(result, sizeof result, differ == 0 ? "ok (%s: bitwise equal)" : "FAIL (%s)", how);
    print_plain_row(op, shape, output, differ == 0 ? "repeat" : "differs", result);
    if (differ > 0)
        printf("    %lld elements differ, first [%lld]: %.9g vs %.9g (nondeterministic kernel, or a NULL gradient "
               "changed the other one)\n", (long long)differ, (long long)first_diff, first[first_diff],
               second[first_diff]);
    return differ == 0;
}

// Integer outputs: GPU and CPU must be equal element for element.
static int check_ints(const char *op, const char *shape, const char *output, const int *gpu, const int *cpu, int64_t n) {
    int64_t differ = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        if (gpu[i] != cpu[i] && differ++ == 0) first = i;
    }
    print_plain_row(op, shape, output, differ == 0 ? "exact" : "differs", differ == 0 ? "ok (int, bitwise equal)" : "FAIL");
    if (differ > 0)
        printf("    %lld of %lld elements differ, first [%lld]: gpu %d, cpu %d%s\n", (long long)differ, (long long)n,
               (long long)first, gpu[first], cpu[first], gpu[first] == INT_POISON ? " (poison: never written)" : "");
    return differ == 0;
}

// A row for an independent invariant check; `failure` is NULL when it holds.
static int report_invariant(const char *op, const char *shape, const char *what, const char *failure) {
    char result[160];
    snprintf(result, sizeof result, failure == NULL ? "ok (%s)" : "FAIL (%s)", what);
    print_plain_row(op, shape, "invariant", failure == NULL ? "-" : "broken", result);
    if (failure != NULL) printf("    %s\n", failure);
    return failure == NULL;
}

// ---------------------------------------------------------------------------- matmul
typedef struct {
    int N, C, OC, offset; // offset 1: every pointer only 4-byte aligned
} MatmulCase;

// Tolerance of each output: sum_tol(K) for a contraction of K terms (+1 for the initial gradient value),
// relative to the sum of |terms|: the CPU sums sequentially in FP32, cuBLASLt in its tiles with FMA; both are
// FP32 rounding of random sign. TF32 (inputs rounded to 2^-11) would exceed it a hundredfold.
static void test_matmul(void **state) {
    const MatmulCase *tc = (const MatmulCase *)*state;
    const int N = tc->N, C = tc->C, OC = tc->OC, off = tc->offset;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d OC=%d%s", N, C, OC, off ? " (4B-aligned)" : "");
    const uint64_t seed = 5000u + 7u * (uint64_t)N + 13u * (uint64_t)C + 17u * (uint64_t)OC + (uint64_t)off;
    const int64_t NC = (int64_t)N * C, OCC = (int64_t)OC * C, NOC = (int64_t)N * OC;
    int ok = 1;

    float *inp = floats(NC), *w = floats(OCC), *dout = floats(NOC), *dinp0 = floats(NC), *dw0 = floats(OCC);
    opcheck_fill_nonzero(inp, (size_t)NC, seed + 1, 0.01, 1.0);
    opcheck_fill_nonzero(w, (size_t)OCC, seed + 2, 0.01, 1.0);
    opcheck_fill_nonzero(dout, (size_t)NOC, seed + 3, 0.01, 1.0);
    opcheck_fill_nonzero(dinp0, (size_t)NC, seed + 4, 0.01, 1.0);
    opcheck_fill_nonzero(dw0, (size_t)OCC, seed + 5, 0.01, 1.0);

    double *ref_out = doubles(NOC), *sc_out = doubles(NOC);
    for (int n = 0; n < N; n++) {
        for (int o = 0; o < OC; o++) {
            double s = 0.0, a = 0.0;
            for (int c = 0; c < C; c++) {
                const double p = (double)inp[(int64_t)n * C + c] * w[(int64_t)o * C + c];
                s += p;
                a += fabs(p);
            }
            ref_out[(int64_t)n * OC + o] = s;
            sc_out[(int64_t)n * OC + o] = a;
        }
    }
    double *ref_dinp = doubles(NC), *sc_dinp = doubles(NC), *ref_dw = doubles(OCC), *sc_dw = doubles(OCC);
    for (int64_t i = 0; i < NC; i++) ref_dinp[i] = dinp0[i], sc_dinp[i] = fabs((double)dinp0[i]);
    for (int64_t i = 0; i < OCC; i++) ref_dw[i] = dw0[i], sc_dw[i] = fabs((double)dw0[i]);
    for (int n = 0; n < N; n++) {
        for (int o = 0; o < OC; o++) {
            const double g = dout[(int64_t)n * OC + o];
            for (int c = 0; c < C; c++) {
                const double pi = g * w[(int64_t)o * C + c], pw = g * inp[(int64_t)n * C + c];
                ref_dinp[(int64_t)n * C + c] += pi;
                sc_dinp[(int64_t)n * C + c] += fabs(pi);
                ref_dw[(int64_t)o * C + c] += pw;
                sc_dw[(int64_t)o * C + c] += fabs(pw);
            }
        }
    }

    float *c_out = nan_floats(NOC);
    matmul_forward(DEVICE_CPU, c_out, inp, w, N, C, OC);
    float *d_inp = gpu_copy_at(inp, (size_t)NC * 4, off), *d_w = gpu_copy_at(w, (size_t)OCC * 4, off);
    float *d_dout = gpu_copy_at(dout, (size_t)NOC * 4, off), *d_out = gpu_copy_at(nan_floats(NOC), (size_t)NOC * 4, off);
    matmul_forward(DEVICE_CUDA, d_out, d_inp, d_w, N, C, OC);
    ok &= check_output("matmul_forward", shape, "out", host_floats(d_out, NOC), c_out, ref_out, sc_out, NOC,
                       tol_both(sum_tol(C)));

    float *c_dinp = copy_floats(dinp0, NC), *c_dw = copy_floats(dw0, OCC);
    matmul_backward(DEVICE_CPU, c_dinp, c_dw, dout, inp, w, N, C, OC);
    float *d_dinp = gpu_copy_at(dinp0, (size_t)NC * 4, off), *d_dw = gpu_copy_at(dw0, (size_t)OCC * 4, off);
    matmul_backward(DEVICE_CUDA, d_dinp, d_dw, d_dout, d_inp, d_w, N, C, OC);
    float *g_dinp = host_floats(d_dinp, NC), *g_dw = host_floats(d_dw, OCC);
    ok &= check_output("matmul_backward", shape, "dinp", g_dinp, c_dinp, ref_dinp, sc_dinp, NC, tol_both(sum_tol(OC + 1)));
    ok &= check_output("matmul_backward", shape, "dweight", g_dw, c_dw, ref_dw, sc_dw, OCC, tol_both(sum_tol(N + 1)));

    gpu_set_floats(d_dinp, dinp0, NC);
    gpu_set_floats(d_dw, dw0, OCC);
    matmul_backward(DEVICE_CUDA, d_dinp, NULL, d_dout, d_inp, d_w, N, C, OC);
    matmul_backward(DEVICE_CUDA, NULL, d_dw, d_dout, d_inp, d_w, N, C, OC);
    ok &= check_bitwise_repeat("matmul_backward", shape, "dinp", g_dinp, host_floats(d_dinp, NC), NC, "rerun, dweight NULL");
    ok &= check_bitwise_repeat("matmul_backward", shape, "dweight", g_dw, host_floats(d_dw, OCC), OCC, "rerun, dinp NULL");
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- embedding
typedef struct {
    int N, C, V;
} EmbeddingCase;

// Forward: a copy, tolerance 0. Backward: dtable[v] = dtable0[v] + the rows of token v added in row order;
// the GPU adds them in the CPU's order (stable sort), so bitwise equality is expected, and the asserted
// tolerance is that of the sum, sum_tol(most rows of one token + 1). V = 7 with N = 1000 gives runs of ~140
// rows (a character-level vocabulary).
static void test_embedding(void **state) {
    const EmbeddingCase *tc = (const EmbeddingCase *)*state;
    const int N = tc->N, C = tc->C, V = tc->V;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d V=%d", N, C, V);
    const uint64_t seed = 6000u + 7u * (uint64_t)N + 13u * (uint64_t)C + 17u * (uint64_t)V;
    const int64_t NC = (int64_t)N * C, VC = (int64_t)V * C;
    int ok = 1;

    int *tokens = ints(N);
    opcheck_fill_int(tokens, (size_t)N, seed + 1, 0, V);
    float *table = floats(VC), *dout = floats(NC), *dtable0 = floats(VC);
    opcheck_fill_nonzero(table, (size_t)VC, seed + 2, 0.01, 1.0);
    opcheck_fill_nonzero(dout, (size_t)NC, seed + 3, 0.01, 1.0);
    opcheck_fill_nonzero(dtable0, (size_t)VC, seed + 4, 0.01, 1.0);

    double *ref_out = doubles(NC), *sc_out = doubles(NC), *ref_dt = doubles(VC), *sc_dt = doubles(VC);
    int *count = ints(V);
    memset(count, 0, (size_t)V * sizeof(int));
    for (int64_t i = 0; i < VC; i++) ref_dt[i] = dtable0[i], sc_dt[i] = fabs((double)dtable0[i]);
    for (int n = 0; n < N; n++) {
        const int v = tokens[n];
        count[v]++;
        for (int c = 0; c < C; c++) {
            ref_out[(int64_t)n * C + c] = table[(int64_t)v * C + c];
            sc_out[(int64_t)n * C + c] = fabs((double)table[(int64_t)v * C + c]);
            ref_dt[(int64_t)v * C + c] += dout[(int64_t)n * C + c];
            sc_dt[(int64_t)v * C + c] += fabs((double)dout[(int64_t)n * C + c]);
        }
    }
    int max_count = 0;
    for (int v = 0; v < V; v++) max_count = count[v] > max_count ? count[v] : max_count;

    float *c_out = nan_floats(NC);
    embedding_forward(DEVICE_CPU, c_out, tokens, table, N, C);
    int *d_tokens = gpu_ints(tokens, N);
    float *d_table = gpu_floats(table, VC), *d_out = gpu_nan_floats(NC);
    embedding_forward(DEVICE_CUDA, d_out, d_tokens, d_table, N, C);
    ok &= check_output("embedding_forward", shape, "out", host_floats(d_out, NC), c_out, ref_out, sc_out, NC, tol_both(0.0));

    float *c_dt = copy_floats(dtable0, VC);
    embedding_backward(DEVICE_CPU, c_dt, dout, tokens, N, C);
    float *d_dout = gpu_floats(dout, NC), *d_dt = gpu_floats(dtable0, VC);
    embedding_backward(DEVICE_CUDA, d_dt, d_dout, d_tokens, N, C);
    float *g_dt = host_floats(d_dt, VC);
    ok &= check_output("embedding_backward", shape, "dtable", g_dt, c_dt, ref_dt, sc_dt, VC, tol_both(sum_tol(max_count + 1)));
    gpu_set_floats(d_dt, dtable0, VC);
    embedding_backward(DEVICE_CUDA, d_dt, d_dout, d_tokens, N, C);
    ok &= check_bitwise_repeat("embedding_backward", shape, "dtable", g_dt, host_floats(d_dt, VC), VC, "rerun");
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- RoPE
typedef struct {
    int B, T, H, D;
} RopeCase;

// Tolerance 4 u of |x0 cos| + |x1 sin| per output (one rounding costs at most 1 u, u = 2^-24): cos and sin are
// rounded to float once, then two products and one sum: at most 3 u, plus margin. Both sides use the same float table
// (built on the host by the same code) and the same operations, so bitwise equality is expected. The f64
// reference uses exact angles. The in-place forward (out == inp, as the model calls it) must equal the
// out-of-place one bit for bit.
static void test_rope(void **state) {
    const RopeCase *tc = (const RopeCase *)*state;
    const int B = tc->B, T = tc->T, H = tc->H, D = tc->D, half = D / 2;
    const float theta = 10000.0f;
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d D=%d", B, T, H, D);
    const uint64_t seed = 7000u + 7u * (uint64_t)B + 13u * (uint64_t)T + 17u * (uint64_t)H + 19u * (uint64_t)D;
    const int64_t n = (int64_t)B * T * H * D;
    const Tol tol = tol_both(4 * U_FP32);
    int ok = 1;

    float *inp = floats(n), *dout = floats(n);
    opcheck_fill_nonzero(inp, (size_t)n, seed + 1, 0.01, 2.0);
    opcheck_fill_nonzero(dout, (size_t)n, seed + 2, 0.01, 2.0);
    double *ref_out = doubles(n), *sc_out = doubles(n), *ref_d = doubles(n), *sc_d = doubles(n);
    for (int64_t vec = 0; vec < (int64_t)B * T * H; vec++) {
        const int t = (int)((vec / H) % T);
        for (int j = 0; j < half; j++) {
            const double angle = (double)t * pow((double)theta, -2.0 * j / (double)D);
            const double c = cos(angle), s = sin(angle);
            const int64_t i = vec * D + 2 * j;
            const double x0 = inp[i], x1 = inp[i + 1], d0 = dout[i], d1 = dout[i + 1];
            ref_out[i] = x0 * c - x1 * s;
            ref_out[i + 1] = x0 * s + x1 * c;
            sc_out[i] = fabs(x0 * c) + fabs(x1 * s);
            sc_out[i + 1] = fabs(x0 * s) + fabs(x1 * c);
            ref_d[i] = d0 * c + d1 * s;
            ref_d[i + 1] = d1 * c - d0 * s;
            sc_d[i] = fabs(d0 * c) + fabs(d1 * s);
            sc_d[i + 1] = fabs(d1 * c) + fabs(d0 * s);
        }
    }

    float *c_out = nan_floats(n);
    rope_forward(DEVICE_CPU, c_out, inp, D, B, T, H, D, theta);
    float *d_inp = gpu_floats(inp, n), *d_out = gpu_nan_floats(n);
    rope_forward(DEVICE_CUDA, d_out, d_inp, D, B, T, H, D, theta);
    float *g_out = host_floats(d_out, n);
    ok &= check_output("rope_forward", shape, "out", g_out, c_out, ref_out, sc_out, n, tol);
    float *d_inplace = gpu_floats(inp, n);
    rope_forward(DEVICE_CUDA, d_inplace, d_inplace, D, B, T, H, D, theta);
    ok &= check_bitwise_repeat("rope_forward", shape, "out", g_out, host_floats(d_inplace, n), n, "in place");

    // the backward writes dinp: NaN before, never read
    float *c_d = nan_floats(n);
    rope_backward(DEVICE_CPU, c_d, dout, D, B, T, H, D, theta);
    float *d_dout = gpu_floats(dout, n), *d_d = gpu_nan_floats(n);
    rope_backward(DEVICE_CUDA, d_d, d_dout, D, B, T, H, D, theta);
    float *g_d = host_floats(d_d, n);
    ok &= check_output("rope_backward", shape, "dinp", g_d, c_d, ref_d, sc_d, n, tol);
    float *d_d_inplace = gpu_floats(dout, n);
    rope_backward(DEVICE_CUDA, d_d_inplace, d_d_inplace, D, B, T, H, D, theta);
    ok &= check_bitwise_repeat("rope_backward", shape, "dinp", g_d, host_floats(d_d_inplace, n), n, "in place");

    // strided, in place, as MLA rotates the rope part of its (B, T, H, dqk) queries: D of every LD columns from
    // column OFF; the same bits as the packed calls, and the other columns (NaN) untouched
    const int LD = D + 6, OFF = 4;
    const int64_t nv = (int64_t)B * T * H, nw = nv * LD;
    float *wide_f = nan_floats(nw), *wide_b = nan_floats(nw);
    for (int64_t v = 0; v < nv; v++) {
        memcpy(wide_f + v * LD + OFF, inp + v * D, sizeof(float) * D);
        memcpy(wide_b + v * LD + OFF, dout + v * D, sizeof(float) * D);
    }
    float *d_wide_f = gpu_floats(wide_f, nw), *d_wide_b = gpu_floats(wide_b, nw);
    rope_forward(DEVICE_CUDA, d_wide_f + OFF, d_wide_f + OFF, LD, B, T, H, D, theta);
    rope_backward(DEVICE_CUDA, d_wide_b + OFF, d_wide_b + OFF, LD, B, T, H, D, theta);
    float *g_wide_f = host_floats(d_wide_f, nw), *g_wide_b = host_floats(d_wide_b, nw);
    int strided_ok = 1;
    for (int64_t v = 0; v < nv; v++) {
        strided_ok &= memcmp(g_wide_f + v * LD + OFF, g_out + v * D, sizeof(float) * D) == 0;
        strided_ok &= memcmp(g_wide_b + v * LD + OFF, g_d + v * D, sizeof(float) * D) == 0;
        for (int c = 0; c < LD; c++)
            if (c < OFF || c >= OFF + D) strided_ok &= isnan(g_wide_f[v * LD + c]) && isnan(g_wide_b[v * LD + c]);
    }
    printf("%-22s %-24s strided in place (ld %d, offset %d): %s\n", "rope_forward/backward", shape, LD, OFF,
           strided_ok ? "same bits as packed, gaps untouched  ok" : "FAIL");
    ok &= strided_ok;
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- copy_block
typedef struct {
    int rows, cols, src_ld, dst_ld;
} CopyCase;

// Plain copy: the whole destination (block and the gaps between rows, poisoned with NaN) must equal the
// CPU's bit for bit, and the gaps must still be NaN. Accumulating copy: one addition per element, at most 1 u
// of |dst0| + |src|, 2 u with margin; elements outside the block must be unchanged (error 0).
static void test_copy_block(void **state) {
    const CopyCase *tc = (const CopyCase *)*state;
    const int rows = tc->rows, cols = tc->cols, src_ld = tc->src_ld, dst_ld = tc->dst_ld;
    char shape[64];
    snprintf(shape, sizeof shape, "%dx%d ld %d->%d", rows, cols, src_ld, dst_ld);
    const uint64_t seed = 8000u + 7u * (uint64_t)rows + 13u * (uint64_t)cols + 17u * (uint64_t)dst_ld;
    const int64_t ns = (int64_t)rows * src_ld, nd = (int64_t)rows * dst_ld;
    int ok = 1;

    float *src = floats(ns), *dst0 = floats(nd);
    opcheck_fill_nonzero(src, (size_t)ns, seed + 1, 0.01, 2.0);
    opcheck_fill_nonzero(dst0, (size_t)nd, seed + 2, 0.01, 2.0);
    float *d_src = gpu_floats(src, ns);

    float *c_dst = nan_floats(nd), *d_dst = gpu_nan_floats(nd);
    copy_block(DEVICE_CPU, c_dst, dst_ld, src, src_ld, rows, cols, 0);
    copy_block(DEVICE_CUDA, d_dst, dst_ld, d_src, src_ld, rows, cols, 0);
    float *g_dst = host_floats(d_dst, nd);
    const char *failure = NULL;
    char msg[200];
    for (int64_t i = 0; i < nd && failure == NULL; i++) {
        const int64_t r = i / dst_ld, c = i % dst_ld;
        const int inside = c < cols;
        if (memcmp(&g_dst[i], &c_dst[i], sizeof(float)) != 0 ||
            (inside ? memcmp(&g_dst[i], &src[r * src_ld + c], sizeof(float)) != 0 : !isnan(g_dst[i]))) {
            snprintf(msg, sizeof msg, "dst[%lld, %lld] (%s the block): gpu %.9g, cpu %.9g, src %.9g", (long long)r,
                     (long long)c, inside ? "inside" : "outside", g_dst[i], c_dst[i], inside ? src[r * src_ld + c] : NAN);
            failure = msg;
        }
    }
    ok &= report_invariant("copy_block", shape, "copy: block = src, gaps untouched, = cpu", failure);

    double *ref = doubles(nd), *sc = doubles(nd);
    for (int64_t i = 0; i < nd; i++) {
        const int64_t r = i / dst_ld, c = i % dst_ld;
        ref[i] = dst0[i] + (c < cols ? (double)src[r * src_ld + c] : 0.0);
        sc[i] = fabs((double)dst0[i]) + (c < cols ? fabs((double)src[r * src_ld + c]) : 0.0);
    }
    float *c_acc = copy_floats(dst0, nd), *d_acc = gpu_floats(dst0, nd);
    copy_block(DEVICE_CPU, c_acc, dst_ld, src, src_ld, rows, cols, 1);
    copy_block(DEVICE_CUDA, d_acc, dst_ld, d_src, src_ld, rows, cols, 1);
    ok &= check_output("copy_block accumulate", shape, "dst", host_floats(d_acc, nd), c_acc, ref, sc, nd, tol_both(2 * U_FP32));
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- add, scale, sum of squares
typedef struct {
    int64_t n;
} VecCase;

// add_inplace and scale_inplace: one rounding per element, at most 1 u of |y0| + |x| (resp. |x s|); 2 u with
// margin (both sides do the same single operation: expected bitwise).
static void test_add_scale(void **state) {
    const VecCase *tc = (const VecCase *)*state;
    const int64_t n = tc->n;
    char shape[64];
    snprintf(shape, sizeof shape, "n=%lld", (long long)n);
    const uint64_t seed = 9000u + (uint64_t)n;
    const float s = 0.731f;
    int ok = 1;

    float *x = floats(n), *y0 = floats(n);
    opcheck_fill_nonzero(x, (size_t)n, seed + 1, 0.01, 2.0);
    opcheck_fill_nonzero(y0, (size_t)n, seed + 2, 0.01, 2.0);
    double *ref_add = doubles(n), *sc_add = doubles(n), *ref_sc = doubles(n), *sc_sc = doubles(n);
    for (int64_t i = 0; i < n; i++) {
        ref_add[i] = (double)y0[i] + x[i];
        sc_add[i] = fabs((double)y0[i]) + fabs((double)x[i]);
        ref_sc[i] = (double)x[i] * s;
        sc_sc[i] = fabs(ref_sc[i]);
    }
    float *c_y = copy_floats(y0, n), *d_y = gpu_floats(y0, n), *d_x = gpu_floats(x, n);
    add_inplace(DEVICE_CPU, c_y, x, n);
    add_inplace(DEVICE_CUDA, d_y, d_x, n);
    ok &= check_output("add_inplace", shape, "y", host_floats(d_y, n), c_y, ref_add, sc_add, n, tol_both(2 * U_FP32));
    float *c_x = copy_floats(x, n);
    scale_inplace(DEVICE_CPU, c_x, s, n);
    scale_inplace(DEVICE_CUDA, d_x, s, n);
    ok &= check_output("scale_inplace", shape, "x", host_floats(d_x, n), c_x, ref_sc, sc_sc, n, tol_both(2 * U_FP32));
    free_all();
    assert_true(ok);
}

// sum_squares in double, both sides (different fixed orders). Every term is positive, so any summation order is
// within (n - 1) u64 of the sum (Higham's gamma_n bound); the tolerance is (n + 16) u64 relative. The f64
// reference is compensated (Kahan) summation of the exact squares. Two GPU calls must agree bit for bit.
static void test_sum_squares(void **state) {
    const VecCase *tc = (const VecCase *)*state;
    const int64_t n = tc->n;
    char shape[64];
    snprintf(shape, sizeof shape, "n=%lld", (long long)n);
    float *x = floats(n);
    opcheck_fill_nonzero(x, (size_t)n, 9500u + (uint64_t)n, 0.01, 2.0);
    double sum = 0.0, comp = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double term = (double)x[i] * x[i] - comp, next = sum + term;
        comp = (next - sum) - term;
        sum = next;
    }
    const double cpu = sum_squares(DEVICE_CPU, x, n);
    float *d_x = gpu_floats(x, n);
    const double gpu = sum_squares(DEVICE_CUDA, d_x, n), gpu2 = sum_squares(DEVICE_CUDA, d_x, n);
    int ok = check_scalar("sum_squares", shape, "sum", gpu, cpu, sum, sum, tol_both(((double)n + 16.0) * U_FP64));
    print_plain_row("sum_squares", shape, "sum", gpu == gpu2 ? "repeat" : "differs",
                    gpu == gpu2 ? "ok (rerun: bitwise equal)" : "FAIL (rerun differs: nondeterministic)");
    ok &= gpu == gpu2;
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- router
typedef struct {
    int N, E, G, L, K, with_bias;
} RouterCase;

// Routing logits with exact ties: every 7th row is constant (all scores equal), every 11th has pairs of equal
// logits (e, e^1). The bias (when used) is shared by pairs too, so the biased scores of those rows tie exactly.
static void router_inputs(float *logits, float *bias, int N, int E, uint64_t seed) {
    opcheck_fill_nonzero(logits, (size_t)N * E, seed, 0.01, 4.0);
    for (int t = 0; t < N; t++) {
        float *row = logits + (int64_t)t * E;
        if (t % 7 == 3) {
            for (int e = 0; e < E; e++) row[e] = 0.75f;
        } else if (t % 11 == 5) {
            for (int e = 1; e < E; e += 2) row[e] = row[e - 1];
        }
    }
    if (bias != NULL) {
        float *pair = floats((E + 1) / 2);
        opcheck_fill_nonzero(pair, (size_t)(E + 1) / 2, seed + 100, 0.001, 0.1);
        for (int e = 0; e < E; e++) bias[e] = pair[e / 2];
    }
}

static double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }

// Independent checks of one routing: indices in range, distinct, and from at most L groups.
static int check_routing(const char *shape, const int *idx, int N, int E, int G, int L, int K) {
    const char *failure = NULL;
    char msg[200];
    const int group_size = E / G;
    for (int t = 0; t < N && failure == NULL; t++) {
        const int *it = idx + (int64_t)t * K;
        unsigned long long groups_used = 0; // G <= 64 in these tests
        int n_groups_used = 0;
        for (int k = 0; k < K && failure == NULL; k++) {
            if (it[k] < 0 || it[k] >= E) {
                snprintf(msg, sizeof msg, "token %d slot %d: expert %d out of [0, %d)", t, k, it[k], E);
                failure = msg;
                break;
            }
            for (int j = 0; j < k; j++) {
                if (it[j] == it[k]) {
                    snprintf(msg, sizeof msg, "token %d: expert %d chosen twice", t, it[k]);
                    failure = msg;
                }
            }
            const int g = it[k] / group_size;
            if (!(groups_used >> g & 1ull)) groups_used |= 1ull << g, n_groups_used++;
        }
        if (failure == NULL && n_groups_used > L) {
            snprintf(msg, sizeof msg, "token %d uses %d groups; at most n_limited = %d allowed", t, n_groups_used, L);
            failure = msg;
        }
    }
    return report_invariant("router_forward", shape, "distinct, in range, <= L groups", failure);
}

// router_backward's f64 reference (the CPU's formula from kernels/cpu/router.c, in double), with the scale
// |dlogits0| + s (1 - s) (|dscores| + sum over matching k of r (|dw_k| / S + sum_j |dw_j s_j| / S^2)).
static void router_backward_ref(double *ref, double *sc, const float *dlog0, const float *dtopk_w, const float *dscores,
                                const int *idx, const float *scores, int N, int E, int K, double r) {
    for (int t = 0; t < N; t++) {
        const float *st = scores + (int64_t)t * E;
        const int *it = idx + (int64_t)t * K;
        double S = 0.0, G = 0.0, G_abs = 0.0;
        if (dtopk_w != NULL) {
            for (int k = 0; k < K; k++) {
                S += st[it[k]];
                G += (double)dtopk_w[(int64_t)t * K + k] * st[it[k]];
                G_abs += fabs((double)dtopk_w[(int64_t)t * K + k] * st[it[k]]);
            }
        }
        for (int e = 0; e < E; e++) {
            const int64_t i = (int64_t)t * E + e;
            double d = dscores != NULL ? (double)dscores[i] : 0.0, d_abs = fabs(d);
            if (dtopk_w != NULL) {
                for (int k = 0; k < K; k++) {
                    if (it[k] != e) continue;
                    const double dw = dtopk_w[(int64_t)t * K + k];
                    d += r * (dw / S - G / (S * S));
                    d_abs += fabs(r) * (fabs(dw) / S + G_abs / (S * S));
                }
            }
            const double s = st[e];
            ref[i] = dlog0[i] + d * s * (1.0 - s);
            sc[i] = fabs((double)dlog0[i]) + d_abs * s * (1.0 - s);
        }
    }
}

// Tolerances (one rounding costs at most 1 u). scores: sigmoid in double, rounded once on both sides: 1 u of
// |s| (the GPU's double exp is within an ulp of glibc's, far below the float rounding), 2 u with margin.
// topk_w = s_k / sum_j s_j * route_scale from the float scores: K - 1 roundings in the sum of positive scores,
// one division, one product, plus the scores' own rounding: (K + 4) u of |w|. topk_idx: bitwise. dlogits:
// double arithmetic on both sides in the same order, rounded to float, then one float addition: 2 u of the
// scale, 3 u with margin (expected bitwise).
static void test_router(void **state) {
    const RouterCase *tc = (const RouterCase *)*state;
    const int N = tc->N, E = tc->E, G = tc->G, L = tc->L, K = tc->K;
    const float route_scale = 2.5f;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d E=%d G=%d L=%d K=%d%s", N, E, G, L, K, tc->with_bias ? "" : " nobias");
    const uint64_t seed = 10000u + 7u * (uint64_t)N + 13u * (uint64_t)E + 17u * (uint64_t)K + (uint64_t)G;
    const int64_t NE = (int64_t)N * E, NK = (int64_t)N * K;
    int ok = 1;

    float *logits = floats(NE), *bias = tc->with_bias ? floats(E) : NULL;
    router_inputs(logits, bias, N, E, seed + 1);
    double *ref_s = doubles(NE), *sc_s = doubles(NE);
    for (int64_t i = 0; i < NE; i++) ref_s[i] = sigmoid_f64(logits[i]), sc_s[i] = ref_s[i];

    int *c_idx = poison_ints(NK);
    float *c_w = nan_floats(NK), *c_s = nan_floats(NE);
    router_forward(DEVICE_CPU, c_idx, c_w, c_s, logits, bias, N, E, K, G, L, route_scale, 0);
    float *d_logits = gpu_floats(logits, NE), *d_bias = bias != NULL ? gpu_floats(bias, E) : NULL;
    int *d_idx = gpu_poison_ints(NK);
    float *d_w = gpu_nan_floats(NK), *d_s = gpu_nan_floats(NE);
    router_forward(DEVICE_CUDA, d_idx, d_w, d_s, d_logits, d_bias, N, E, K, G, L, route_scale, 0);
    int *g_idx = host_ints(d_idx, NK);
    ok &= check_ints("router_forward", shape, "topk_idx", g_idx, c_idx, NK);
    ok &= check_routing(shape, g_idx, N, E, G, L, K);
    ok &= check_output("router_forward", shape, "scores", host_floats(d_s, NE), c_s, ref_s, sc_s, NE, tol_both(2 * U_FP32));
    // topk_w reference from the CPU's routing (equal to the GPU's when the check above passes)
    double *ref_w = doubles(NK), *sc_w = doubles(NK);
    for (int t = 0; t < N; t++) {
        double S = 0.0;
        for (int k = 0; k < K; k++) S += ref_s[(int64_t)t * E + c_idx[(int64_t)t * K + k]];
        for (int k = 0; k < K; k++) {
            ref_w[(int64_t)t * K + k] = ref_s[(int64_t)t * E + c_idx[(int64_t)t * K + k]] / S * route_scale;
            sc_w[(int64_t)t * K + k] = fabs(ref_w[(int64_t)t * K + k]);
        }
    }
    ok &= check_output("router_forward", shape, "topk_w", host_floats(d_w, NK), c_w, ref_w, sc_w, NK,
                       tol_both((K + 4) * U_FP32));

    // frozen routing (as the gradient check holds it), with a repeated expert in every 5th token
    int *frozen = copy_ints(c_idx, NK);
    if (K >= 2)
        for (int t = 0; t < N; t += 5) frozen[(int64_t)t * K + 1] = frozen[(int64_t)t * K];
    int *fc_idx = copy_ints(frozen, NK);
    float *fc_w = nan_floats(NK), *fc_s = nan_floats(NE);
    router_forward(DEVICE_CPU, fc_idx, fc_w, fc_s, logits, bias, N, E, K, G, L, route_scale, 1);
    int *d_frozen = gpu_ints(frozen, NK);
    float *fd_w = gpu_nan_floats(NK), *fd_s = gpu_nan_floats(NE);
    router_forward(DEVICE_CUDA, d_frozen, fd_w, fd_s, d_logits, d_bias, N, E, K, G, L, route_scale, 1);
    char fshape[80];
    snprintf(fshape, sizeof fshape, "%s frozen", shape);
    ok &= check_ints("router_forward", fshape, "topk_idx", host_ints(d_frozen, NK), frozen, NK); // an input: unchanged
    ok &= check_output("router_forward", fshape, "scores", host_floats(fd_s, NE), fc_s, ref_s, sc_s, NE, tol_both(2 * U_FP32));
    for (int t = 0; t < N; t++) {
        double S = 0.0;
        for (int k = 0; k < K; k++) S += ref_s[(int64_t)t * E + frozen[(int64_t)t * K + k]];
        for (int k = 0; k < K; k++) {
            ref_w[(int64_t)t * K + k] = ref_s[(int64_t)t * E + frozen[(int64_t)t * K + k]] / S * route_scale;
            sc_w[(int64_t)t * K + k] = fabs(ref_w[(int64_t)t * K + k]);
        }
    }
    ok &= check_output("router_forward", fshape, "topk_w", host_floats(fd_w, NK), fc_w, ref_w, sc_w, NK,
                       tol_both((K + 4) * U_FP32));

    // backward on the frozen routing (repeated experts accumulate), with and without each input gradient
    float *dtopk_w = floats(NK), *dscores = floats(NE), *dlog0 = floats(NE);
    opcheck_fill_nonzero(dtopk_w, (size_t)NK, seed + 2, 0.01, 1.0);
    opcheck_fill_nonzero(dscores, (size_t)NE, seed + 3, 0.001, 0.1);
    opcheck_fill_nonzero(dlog0, (size_t)NE, seed + 4, 0.01, 1.0);
    float *d_dtopk_w = gpu_floats(dtopk_w, NK), *d_dscores = gpu_floats(dscores, NE), *d_scores = gpu_floats(fc_s, NE);
    double *ref_dl = doubles(NE), *sc_dl = doubles(NE);
    static const char *const variant[3] = {"dlogits", "dlog(w)", "dlog(s)"};
    float *g_first = NULL;
    for (int v = 0; v < 3; v++) {
        const float *h_dw = v != 2 ? dtopk_w : NULL, *h_ds = v != 1 ? dscores : NULL;
        router_backward_ref(ref_dl, sc_dl, dlog0, h_dw, h_ds, frozen, fc_s, N, E, K, route_scale);
        float *c_dl = copy_floats(dlog0, NE), *d_dl = gpu_floats(dlog0, NE);
        router_backward(DEVICE_CPU, c_dl, h_dw, h_ds, frozen, fc_s, N, E, K, route_scale);
        router_backward(DEVICE_CUDA, d_dl, v != 2 ? d_dtopk_w : NULL, v != 1 ? d_dscores : NULL, d_frozen, d_scores, N,
                        E, K, route_scale);
        float *g_dl = host_floats(d_dl, NE);
        ok &= check_output("router_backward", fshape, variant[v], g_dl, c_dl, ref_dl, sc_dl, NE, tol_both(3 * U_FP32));
        if (v == 0) {
            g_first = g_dl;
            gpu_set_floats(d_dl, dlog0, NE);
            router_backward(DEVICE_CUDA, d_dl, d_dtopk_w, d_dscores, d_frozen, d_scores, N, E, K, route_scale);
            ok &= check_bitwise_repeat("router_backward", fshape, "dlogits", g_first, host_floats(d_dl, NE), NE, "rerun");
        }
    }
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- balance loss
typedef struct {
    int B, T, E, K;
} BalanceCase;

// Independent check of a plain top-K: for each token, the chosen are in decreasing order of (score, then lower
// index first), and every chosen one beats every unchosen one in that order.
static int check_plain_topk(const char *shape, const int *idx, const float *scores, int N, int E, int K) {
    const char *failure = NULL;
    char msg[200];
    unsigned char *chosen = xmalloc((size_t)E);
    for (int t = 0; t < N && failure == NULL; t++) {
        const float *st = scores + (int64_t)t * E;
        const int *it = idx + (int64_t)t * K;
        memset(chosen, 0, (size_t)E);
        for (int k = 0; k < K; k++) {
            if (it[k] < 0 || it[k] >= E || chosen[it[k]]) {
                snprintf(msg, sizeof msg, "token %d slot %d: expert %d out of range or repeated", t, k, it[k]);
                failure = msg;
                break;
            }
            chosen[it[k]] = 1;
        }
        for (int k = 0; k + 1 < K && failure == NULL; k++) {
            const int a = it[k], b = it[k + 1];
            if (!(st[a] > st[b] || (st[a] == st[b] && a < b))) {
                snprintf(msg, sizeof msg, "token %d: slot %d (expert %d, %.9g) should come after slot %d (expert %d, "
                         "%.9g)", t, k, a, st[a], k + 1, b, st[b]);
                failure = msg;
            }
        }
        for (int e = 0; e < E && failure == NULL && K > 0; e++) {
            const int last = it[K - 1];
            if (!chosen[e] && !(st[last] > st[e] || (st[last] == st[e] && last < e))) {
                snprintf(msg, sizeof msg, "token %d: expert %d (%.9g) not chosen but beats chosen expert %d (%.9g)", t,
                         e, st[e], last, st[last]);
                failure = msg;
            }
        }
    }
    return report_invariant("balance_loss_forward", shape, "is the top-K, ties to lower idx", failure);
}

// f64 loss from the routing idx: mean_b alpha sum_e f_e P_e.
static double balance_loss_ref(const int *idx, const float *scores, int B, int T, int E, int K, double alpha) {
    double total = 0.0;
    double *P = doubles(E), *f = doubles(E);
    for (int b = 0; b < B; b++) {
        for (int e = 0; e < E; e++) P[e] = f[e] = 0.0;
        for (int t = 0; t < T; t++) {
            const float *st = scores + ((int64_t)b * T + t) * E;
            double S = 0.0;
            for (int e = 0; e < E; e++) S += st[e];
            for (int e = 0; e < E; e++) P[e] += st[e] / S / T;
            for (int k = 0; k < K; k++) f[idx[((int64_t)b * T + t) * K + k]] += (double)E / ((double)K * T);
        }
        for (int e = 0; e < E; e++) total += alpha * f[e] * P[e];
    }
    return total / B;
}

// Tolerances (one rounding costs at most 1 u). loss: double arithmetic on both sides (the GPU sums P_e in
// chunks of tokens, the CPU sequentially: ~1e-16 apart), one rounding to float at the end: 4 u of the loss
// (all its terms are >= 0). plain_topk: bitwise, and an independent top-K check. dscores: double on both sides
// in the same order, rounded to float, then one float addition: 2 u of |dscores0| + |c| (f_e + F_t) / S_t,
// 3 u with margin (expected bitwise).
static void test_balance(void **state) {
    const BalanceCase *tc = (const BalanceCase *)*state;
    const int B = tc->B, T = tc->T, E = tc->E, K = tc->K, N = B * T;
    const float alpha = 1e-4f, dloss = 0.7f;
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d E=%d K=%d", B, T, E, K);
    const uint64_t seed = 11000u + 7u * (uint64_t)B + 13u * (uint64_t)T + 17u * (uint64_t)E + (uint64_t)K;
    const int64_t NE = (int64_t)N * E, NK = (int64_t)N * K;
    int ok = 1;

    // scores = sigmoid(logits) with tied rows, as the router makes them
    float *scores = floats(NE);
    router_inputs(scores, NULL, N, E, seed + 1);
    for (int64_t i = 0; i < NE; i++) scores[i] = (float)sigmoid_f64(scores[i]);
    float *d_scores = gpu_floats(scores, NE);

    int *c_topk = poison_ints(NK), *d_topk = gpu_poison_ints(NK);
    const float c_loss = balance_loss_forward(DEVICE_CPU, c_topk, scores, B, T, E, K, alpha, 0);
    const float g_loss = balance_loss_forward(DEVICE_CUDA, d_topk, d_scores, B, T, E, K, alpha, 0);
    int *g_topk = host_ints(d_topk, NK);
    ok &= check_ints("balance_loss_forward", shape, "plain_topk", g_topk, c_topk, NK);
    ok &= check_plain_topk(shape, g_topk, scores, N, E, K);
    double ref = balance_loss_ref(c_topk, scores, B, T, E, K, alpha);
    ok &= check_scalar("balance_loss_forward", shape, "loss", g_loss, c_loss, ref, fabs(ref), tol_both(4 * U_FP32));

    // frozen routing: random experts, repeats allowed (counted twice)
    int *frozen = ints(NK);
    opcheck_fill_int(frozen, (size_t)NK, seed + 2, 0, E);
    int *d_frozen = gpu_ints(frozen, NK);
    char fshape[80];
    snprintf(fshape, sizeof fshape, "%s frozen", shape);
    const float fc_loss = balance_loss_forward(DEVICE_CPU, frozen, scores, B, T, E, K, alpha, 1);
    const float fg_loss = balance_loss_forward(DEVICE_CUDA, d_frozen, d_scores, B, T, E, K, alpha, 1);
    ok &= check_ints("balance_loss_forward", fshape, "plain_topk", host_ints(d_frozen, NK), frozen, NK); // unchanged
    ref = balance_loss_ref(frozen, scores, B, T, E, K, alpha);
    ok &= check_scalar("balance_loss_forward", fshape, "loss", fg_loss, fc_loss, ref, fabs(ref), tol_both(4 * U_FP32));

    // backward on the frozen routing
    float *ds0 = floats(NE);
    opcheck_fill_nonzero(ds0, (size_t)NE, seed + 3, 1e-9, 1e-8); // the size of the balance-loss term here
    double *ref_ds = doubles(NE), *sc_ds = doubles(NE), *f = doubles(E);
    const double c = (double)dloss * alpha / ((double)B * T);
    for (int b = 0; b < B; b++) {
        for (int e = 0; e < E; e++) f[e] = 0.0;
        for (int64_t i = (int64_t)b * T * K; i < (int64_t)(b + 1) * T * K; i++) f[frozen[i]] += (double)E / ((double)K * T);
        for (int t = 0; t < T; t++) {
            const int64_t row = (int64_t)b * T + t;
            double S = 0.0, F = 0.0;
            for (int e = 0; e < E; e++) S += scores[row * E + e];
            for (int e = 0; e < E; e++) F += f[e] * scores[row * E + e] / S;
            for (int e = 0; e < E; e++) {
                ref_ds[row * E + e] = ds0[row * E + e] + c * (f[e] - F) / S;
                sc_ds[row * E + e] = fabs((double)ds0[row * E + e]) + fabs(c) * (f[e] + F) / S;
            }
        }
    }
    float *c_ds = copy_floats(ds0, NE), *d_ds = gpu_floats(ds0, NE);
    balance_loss_backward(DEVICE_CPU, c_ds, frozen, scores, B, T, E, K, alpha, dloss);
    balance_loss_backward(DEVICE_CUDA, d_ds, d_frozen, d_scores, B, T, E, K, alpha, dloss);
    float *g_ds = host_floats(d_ds, NE);
    ok &= check_output("balance_loss_backward", fshape, "dscores", g_ds, c_ds, ref_ds, sc_ds, NE, tol_both(3 * U_FP32));
    gpu_set_floats(d_ds, ds0, NE);
    balance_loss_backward(DEVICE_CUDA, d_ds, d_frozen, d_scores, B, T, E, K, alpha, dloss);
    ok &= check_bitwise_repeat("balance_loss_backward", fshape, "dscores", g_ds, host_floats(d_ds, NE), NE, "rerun");
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- MoE permutation
typedef struct {
    int N, K, E, C;
    int mode; // 0: K distinct random experts per token; 1: skewed (most tokens pick expert 0 first); 2: repeats
} PermuteCase;

static void permute_topk(int *topk, int N, int K, int E, int mode, uint64_t seed) {
    int *perm = ints(E);
    for (int t = 0; t < N; t++) {
        int *it = topk + (int64_t)t * K;
        if (mode == 2) {
            for (int k = 0; k < K; k++) it[k] = (int)(opcheck_uniform(seed, (uint64_t)t * K + k) * E);
            continue;
        }
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int k = 0; k < K; k++) { // partial Fisher-Yates: K distinct experts
            const int j = k + (int)(opcheck_uniform(seed, (uint64_t)t * K + k) * (E - k));
            const int tmp = perm[k];
            perm[k] = perm[j];
            perm[j] = tmp;
            it[k] = perm[k];
        }
        if (mode == 1 && opcheck_uniform(seed + 1, (uint64_t)t) < 0.8) {
            for (int k = 0; k < K; k++) {
                if (it[k] == 0) it[k] = it[0];
            }
            it[0] = 0;
        }
    }
}

// Independent check that a plan is the stable sort of the slots by expert: offsets start at 0, never
// decrease and end at N*K; slot (t, k) sits in the segment of its expert, its row holds token t, and the
// rows of one expert increase with (t, k).
static int check_plan(const char *shape, const int *off, const int *tok, const int *slot_of, const int *topk, int N,
                      int K, int E) {
    const char *failure = NULL;
    char msg[200];
    const int64_t n = (int64_t)N * K;
    if (off[0] != 0 || off[E] != n) {
        snprintf(msg, sizeof msg, "seg_offsets[0] = %d, seg_offsets[E] = %d; expected 0 and %lld", off[0], off[E],
                 (long long)n);
        failure = msg;
    }
    for (int e = 0; e < E && failure == NULL; e++) {
        if (off[e + 1] < off[e]) {
            snprintf(msg, sizeof msg, "seg_offsets decreases at %d: %d > %d", e, off[e], off[e + 1]);
            failure = msg;
        }
    }
    int *last_row = ints(E);
    for (int e = 0; e < E; e++) last_row[e] = -1;
    for (int64_t i = 0; i < n && failure == NULL; i++) {
        const int e = topk[i], r = slot_of[i];
        if (r < off[e] || r >= off[e + 1] || tok[r] != (int)(i / K) || r <= last_row[e]) {
            snprintf(msg, sizeof msg, "slot [%lld, %lld] (expert %d) -> row %d: segment [%d, %d), token there %d, "
                     "previous row of the expert %d", (long long)(i / K), (long long)(i % K), e, r, off[e], off[e + 1],
                     r >= 0 && r < n ? tok[r] : -1, last_row[e]);
            failure = msg;
        }
        last_row[e] = r;
    }
    return report_invariant("moe_permute_plan_device", shape, "stable sort of slots by expert", failure);
}

// Tolerances. plan: bitwise (and the invariant above). gather_rows: a copy, 0. unpermute_backward: K additions
// in k order on both sides: (K + 2) u of |dinp0| + sum |dseg| (expected bitwise). combine_forward: K products
// and K additions: (2K + 2) u of |out0| + sum |w eo| (expected bitwise). combine_backward dexpert_out: written
// over NaN, one FP32 product on both sides: gpu-cpu tolerance 0 (expected and required bitwise), gpu-f64 1 u,
// 3 u with margin; dtopk_w: a double dot product (the GPU's order is strided per thread then a tree, the CPU's
// sequential: ~1e-16 apart) rounded to float, then one float addition: 2 u of |dtopk_w0| + sum |dout eo|, 3 u
// with margin.
static void test_permute(void **state) {
    const PermuteCase *tc = (const PermuteCase *)*state;
    const int N = tc->N, K = tc->K, E = tc->E, C = tc->C;
    static const char *const mode_name[3] = {"", " skewed", " repeats"};
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d K=%d E=%d C=%d%s", N, K, E, C, mode_name[tc->mode]);
    const uint64_t seed = 12000u + 7u * (uint64_t)N + 13u * (uint64_t)K + 17u * (uint64_t)E + 19u * (uint64_t)C +
                          (uint64_t)tc->mode;
    const int64_t NK = (int64_t)N * K, NC = (int64_t)N * C, NKC = NK * C;
    int ok = 1;

    int *topk = ints(NK);
    permute_topk(topk, N, K, E, tc->mode, seed + 1);
    int *c_off = poison_ints(E + 1), *c_tok = poison_ints(NK), *c_slot = poison_ints(NK);
    moe_permute_plan(c_off, c_tok, c_slot, topk, N, K, E);
    int *h_off = poison_ints(E + 1), *h_tok = poison_ints(NK), *h_slot = poison_ints(NK); // the CPU branch of _device
    moe_permute_plan_device(DEVICE_CPU, h_off, h_tok, h_slot, topk, N, K, E);
    int *d_topk = gpu_ints(topk, NK);
    int *d_off = gpu_poison_ints(E + 1), *d_tok = gpu_poison_ints(NK), *d_slot = gpu_poison_ints(NK);
    moe_permute_plan_device(DEVICE_CUDA, d_off, d_tok, d_slot, d_topk, N, K, E);
    int *g_off = host_ints(d_off, E + 1), *g_tok = host_ints(d_tok, NK), *g_slot = host_ints(d_slot, NK);
    ok &= check_ints("moe_permute_plan_device", shape, "seg_offs", g_off, c_off, E + 1);
    ok &= check_ints("moe_permute_plan_device", shape, "seg_token", g_tok, c_tok, NK);
    ok &= check_ints("moe_permute_plan_device", shape, "slot_of", g_slot, c_slot, NK);
    ok &= check_ints("moe_permute_plan_device", shape, "cpu offs", h_off, c_off, E + 1);
    ok &= check_ints("moe_permute_plan_device", shape, "cpu token", h_tok, c_tok, NK);
    ok &= check_ints("moe_permute_plan_device", shape, "cpu slot", h_slot, c_slot, NK);
    ok &= check_plan(shape, g_off, g_tok, g_slot, topk, N, K, E);
    if (N == 0) {
        free_all();
        assert_true(ok);
        return;
    }

    // gather_rows: xp (N*K, C) = x[seg_token[r]]
    float *x = floats(NC);
    opcheck_fill_nonzero(x, (size_t)NC, seed + 2, 0.01, 2.0);
    double *ref = doubles(NKC), *sc = doubles(NKC);
    for (int64_t r = 0; r < NK; r++) {
        for (int c = 0; c < C; c++) {
            ref[r * C + c] = x[(int64_t)c_tok[r] * C + c];
            sc[r * C + c] = fabs(ref[r * C + c]);
        }
    }
    float *c_xp = nan_floats(NKC), *d_x = gpu_floats(x, NC), *d_xp = gpu_nan_floats(NKC);
    gather_rows(DEVICE_CPU, c_xp, x, c_tok, (int)NK, C);
    gather_rows(DEVICE_CUDA, d_xp, d_x, d_tok, (int)NK, C);
    ok &= check_output("gather_rows", shape, "out", host_floats(d_xp, NKC), c_xp, ref, sc, NKC, tol_both(0.0));

    // moe_unpermute_backward: dinp (N, C) += sum_k dseg[slot_of[t, k]]
    float *dseg = floats(NKC), *dx0 = floats(NC);
    opcheck_fill_nonzero(dseg, (size_t)NKC, seed + 3, 0.01, 1.0);
    opcheck_fill_nonzero(dx0, (size_t)NC, seed + 4, 0.01, 1.0);
    double *ref_n = doubles(NC), *sc_n = doubles(NC);
    for (int t = 0; t < N; t++) {
        for (int c = 0; c < C; c++) {
            const int64_t i = (int64_t)t * C + c;
            ref_n[i] = dx0[i], sc_n[i] = fabs((double)dx0[i]);
            for (int k = 0; k < K; k++) {
                const double g = dseg[(int64_t)c_slot[(int64_t)t * K + k] * C + c];
                ref_n[i] += g, sc_n[i] += fabs(g);
            }
        }
    }
    float *c_dx = copy_floats(dx0, NC), *d_dseg = gpu_floats(dseg, NKC), *d_dx = gpu_floats(dx0, NC);
    moe_unpermute_backward(DEVICE_CPU, c_dx, dseg, c_slot, N, K, C);
    moe_unpermute_backward(DEVICE_CUDA, d_dx, d_dseg, d_slot, N, K, C);
    float *g_dx = host_floats(d_dx, NC);
    ok &= check_output("moe_unpermute_backward", shape, "dinp", g_dx, c_dx, ref_n, sc_n, NC, tol_both((K + 2) * U_FP32));
    gpu_set_floats(d_dx, dx0, NC);
    moe_unpermute_backward(DEVICE_CUDA, d_dx, d_dseg, d_slot, N, K, C);
    ok &= check_bitwise_repeat("moe_unpermute_backward", shape, "dinp", g_dx, host_floats(d_dx, NC), NC, "rerun");

    // moe_combine_forward: out (N, C) += sum_k w[t, k] eo[slot_of[t, k]]
    float *eo = floats(NKC), *w = floats(NK), *out0 = floats(NC);
    opcheck_fill_nonzero(eo, (size_t)NKC, seed + 5, 0.01, 2.0);
    opcheck_fill(w, (size_t)NK, seed + 6, 0.01, 1.0); // router weights are positive
    opcheck_fill_nonzero(out0, (size_t)NC, seed + 7, 0.01, 1.0);
    for (int t = 0; t < N; t++) {
        for (int c = 0; c < C; c++) {
            const int64_t i = (int64_t)t * C + c;
            ref_n[i] = out0[i], sc_n[i] = fabs((double)out0[i]);
            for (int k = 0; k < K; k++) {
                const double p = (double)w[(int64_t)t * K + k] * eo[(int64_t)c_slot[(int64_t)t * K + k] * C + c];
                ref_n[i] += p, sc_n[i] += fabs(p);
            }
        }
    }
    float *c_out = copy_floats(out0, NC), *d_eo = gpu_floats(eo, NKC), *d_w = gpu_floats(w, NK), *d_out = gpu_floats(out0, NC);
    moe_combine_forward(DEVICE_CPU, c_out, eo, c_slot, w, NULL, N, K, C);
    moe_combine_forward(DEVICE_CUDA, d_out, d_eo, d_slot, d_w, NULL, N, K, C);
    float *g_comb = host_floats(d_out, NC);
    ok &= check_output("moe_combine_forward", shape, "out", g_comb, c_out, ref_n, sc_n, NC,
                       tol_both((2 * K + 2) * U_FP32));
    // with the residual in the same pass: the bits of the combine followed by add_inplace, on each device
    float *res = floats(NC);
    opcheck_fill_nonzero(res, (size_t)NC, seed + 11, 0.01, 1.0);
    float *d_res = gpu_floats(res, NC), *d_out_r = gpu_floats(out0, NC), *d_out_a = gpu_floats(out0, NC);
    moe_combine_forward(DEVICE_CUDA, d_out_r, d_eo, d_slot, d_w, d_res, N, K, C);
    moe_combine_forward(DEVICE_CUDA, d_out_a, d_eo, d_slot, d_w, NULL, N, K, C);
    add_inplace(DEVICE_CUDA, d_out_a, d_res, NC);
    ok &= check_bitwise_repeat("moe_combine_forward", shape, "out", host_floats(d_out_a, NC), host_floats(d_out_r, NC), NC,
                               "residual in the pass vs add_inplace after");

    // moe_combine_backward: dexpert_out[slot] = w dout[t] (written over NaN: a row it skipped, or added to, stays
    // NaN); dtopk_w[t, k] += dot(dout[t], eo[slot])
    float *dout = floats(NC), *dw0 = floats(NK);
    opcheck_fill_nonzero(dout, (size_t)NC, seed + 8, 0.01, 1.0);
    opcheck_fill_nonzero(dw0, (size_t)NK, seed + 10, 0.01, 1.0);
    double *ref_dw = doubles(NK), *sc_dw = doubles(NK);
    for (int t = 0; t < N; t++) {
        for (int k = 0; k < K; k++) {
            const int64_t tk = (int64_t)t * K + k, slot = c_slot[tk];
            ref_dw[tk] = dw0[tk], sc_dw[tk] = fabs((double)dw0[tk]);
            for (int c = 0; c < C; c++) {
                const double g = dout[(int64_t)t * C + c], p = (double)w[tk] * g, q = g * eo[slot * C + c];
                ref[slot * C + c] = p, sc[slot * C + c] = fabs(p);
                ref_dw[tk] += q, sc_dw[tk] += fabs(q);
            }
        }
    }
    float *c_de = nan_floats(NKC), *c_dw = copy_floats(dw0, NK);
    moe_combine_backward(DEVICE_CPU, c_de, c_dw, dout, eo, c_slot, w, N, K, C);
    float *d_dout = gpu_floats(dout, NC), *d_de = gpu_nan_floats(NKC), *d_dw = gpu_floats(dw0, NK);
    moe_combine_backward(DEVICE_CUDA, d_de, d_dw, d_dout, d_eo, d_slot, d_w, N, K, C);
    float *g_de = host_floats(d_de, NKC), *g_dw = host_floats(d_dw, NK);
    const Tol tol_de = {0.0, 3 * U_FP32}; // gpu-cpu: the same one FP32 product, bitwise
    ok &= check_output("moe_combine_backward", shape, "dexpert", g_de, c_de, ref, sc, NKC, tol_de);
    ok &= check_output("moe_combine_backward", shape, "dtopk_w", g_dw, c_dw, ref_dw, sc_dw, NK, tol_both(3 * U_FP32));
    gpu_set_floats(d_de, nan_floats(NKC), NKC);
    gpu_set_floats(d_dw, dw0, NK);
    moe_combine_backward(DEVICE_CUDA, d_de, NULL, d_dout, d_eo, d_slot, d_w, N, K, C);
    moe_combine_backward(DEVICE_CUDA, NULL, d_dw, d_dout, d_eo, d_slot, d_w, N, K, C);
    ok &= check_bitwise_repeat("moe_combine_backward", shape, "dexpert", g_de, host_floats(d_de, NKC), NKC, "rerun, dtopk_w NULL");
    ok &= check_bitwise_repeat("moe_combine_backward", shape, "dtopk_w", g_dw, host_floats(d_dw, NK), NK, "rerun, dexpert NULL");

    // the *_bf16 forms on expert outputs left in BF16 (row stride round_up(C, 128), padding columns NaN): bitwise the
    // FP32 ops on the same values (eo rounded to BF16)
    const int64_t ld = (C + 127) / 128 * 128;
    float *eo_r = floats(NKC);
    uint16_t *eo16 = malloc((size_t)(NK * ld + 1) * sizeof(uint16_t));
    for (int64_t r = 0; r < NK; r++)
        for (int64_t c = 0; c < ld; c++) {
            if (c < C) eo_r[r * C + c] = bf16_to_float(float_to_bf16(eo[r * C + c]));
            eo16[r * ld + c] = c < C ? float_to_bf16(eo[r * C + c]) : 0x7FC0;
        }
    uint16_t *d_eo16 = device_alloc(DEVICE_CUDA, (size_t)(NK * ld + 1) * sizeof(uint16_t));
    device_memcpy_from_host(DEVICE_CUDA, d_eo16, eo16, (size_t)(NK * ld + 1) * sizeof(uint16_t));
    float *d_eo_r = gpu_floats(eo_r, NKC), *d_of = gpu_floats(out0, NC), *d_ob = gpu_floats(out0, NC);
    moe_combine_forward(DEVICE_CUDA, d_of, d_eo_r, d_slot, d_w, d_res, N, K, C);
    moe_combine_forward_bf16(DEVICE_CUDA, d_ob, NULL, d_eo16, d_slot, d_w, d_res, N, K, C);
    ok &= check_bitwise_repeat("moe_combine_forward_bf16", shape, "out", host_floats(d_of, NC), host_floats(d_ob, NC), NC,
                               "vs FP32 op on the values");
    // from a base of BF16 rows (the shared expert's output; padding NaN): out (NaN before) written, the bits of the
    // FP32 op on an out holding base's values
    uint16_t *base16 = malloc((size_t)(N * ld) * sizeof(uint16_t));
    float *base_r = floats(NC);
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < ld; c++) {
            base16[r * ld + c] = c < C ? float_to_bf16(out0[r * C + c] * 3.0f) : 0x7FC0;
            if (c < C) base_r[r * C + c] = bf16_to_float(base16[r * ld + c]);
        }
    uint16_t *d_base16 = device_alloc(DEVICE_CUDA, (size_t)(N * ld) * sizeof(uint16_t));
    device_memcpy_from_host(DEVICE_CUDA, d_base16, base16, (size_t)(N * ld) * sizeof(uint16_t));
    gpu_set_floats(d_of, base_r, NC);
    gpu_set_floats(d_ob, nan_floats(NC), NC);
    moe_combine_forward(DEVICE_CUDA, d_of, d_eo_r, d_slot, d_w, d_res, N, K, C);
    moe_combine_forward_bf16(DEVICE_CUDA, d_ob, d_base16, d_eo16, d_slot, d_w, d_res, N, K, C);
    ok &= check_bitwise_repeat("moe_combine_forward_bf16", shape, "out", host_floats(d_of, NC), host_floats(d_ob, NC), NC,
                               "from a BF16 base vs FP32 op on an out of its values");
    device_free(DEVICE_CUDA, d_base16);
    free(base16);
    float *d_wf = gpu_floats(dw0, NK), *d_wb = gpu_floats(dw0, NK);
    moe_combine_backward(DEVICE_CUDA, NULL, d_wf, d_dout, d_eo_r, d_slot, d_w, N, K, C);
    moe_combine_backward_bf16(DEVICE_CUDA, d_wb, d_dout, d_eo16, d_slot, d_w, N, K, C);
    ok &= check_bitwise_repeat("moe_combine_backward_bf16", shape, "dtopk_w", host_floats(d_wf, NK),
                               host_floats(d_wb, NK), NK, "vs FP32 op on the values");
    device_free(DEVICE_CUDA, d_eo16);
    free(eo16);
    free_all();
    assert_true(ok);
}

// ---------------------------------------------------------------------------- cases
// Block sizes in the kernels: 256 threads (rows, columns, elementwise), warps of 32 per routed token, chunks
// of 64 tokens (balance loss), 16384 elements (sum of squares). The shapes are not multiples of them.
static MatmulCase mm_small = {37, 300, 129, 0}, mm_wide = {1, 7168, 3, 0}, mm_router = {1000, 300, 32, 0},
                  mm_square = {256, 512, 384, 0}, mm_c1 = {5, 1, 7, 0}, mm_unaligned = {37, 300, 129, 1};
// N >= 4096 tokens and a narrow weight: the weight gradient goes through token chunks (kernels/cuda/matmul.cu),
// with a short last chunk (4100 = 16 x 256 + 4) and, unaligned, through a plain leftover GEMM of 3 rows
static MatmulCase mm_router_chunks = {4100, 256, 32, 0}, mm_router_chunks_unaligned = {4099, 300, 32, 1};
static EmbeddingCase emb_small = {37, 300, 50}, emb_chars = {1000, 64, 7}, emb_one = {5, 1, 3},
                     emb_big = {2048, 256, 5000};
static RopeCase rope_small = {2, 37, 3, 64}, rope_long = {1, 300, 1, 2}, rope_heads = {3, 129, 128, 64};
static CopyCase copy_small = {37, 300, 310, 333}, copy_one = {1, 1, 1, 1}, copy_mla = {1000, 64, 64, 192};
static VecCase vec_big = {1000003}, vec_one = {1}, vec_chunk = {16385};
static RouterCase router_a = {1000, 8, 4, 2, 2, 1}, router_b = {1000, 32, 8, 4, 6, 1}, router_dsv3 = {37, 256, 8, 4, 8, 1},
                  router_flat = {37, 16, 1, 1, 4, 0};
static BalanceCase bal_a = {4, 250, 8, 2}, bal_b = {2, 500, 32, 6}, bal_dsv3 = {1, 37, 256, 8};
// Combine backward takes the float4 path when C % 4 == 0 (perm_a, _b, _dsv3, _skew, _k17) and the scalar path
// otherwise (perm_repeat, _one, _k12), and handles at most 8 slots per launch: K = 12 and 17 take 2 and 3
// launches (the last with 4 and 1 slots); perm_k17 has the bench's C = 2048.
static PermuteCase perm_a = {1000, 2, 8, 300, 0}, perm_b = {1000, 6, 32, 256, 0}, perm_dsv3 = {37, 8, 256, 300, 0},
                   perm_skew = {1000, 2, 8, 64, 1}, perm_repeat = {37, 3, 2, 5, 2}, perm_one = {1, 1, 1, 1, 0},
                   perm_empty = {0, 2, 8, 16, 0}, perm_k12 = {300, 12, 64, 1030, 0}, perm_k17 = {64, 17, 64, 2048, 0};

int main(void) {
    const int n_gpu = gpucheck_devices("test_gpu_model_ops");
    if (n_gpu == 0) return 1;
    printf("test_gpu_model_ops: %d CUDA device(s) visible; comparing CUDA ops with the CPU reference and f64.\n"
           "err = |x - y| / scale per element (scale: size of what the element is computed from), max over "
           "elements; u = 2^-24 = %.3g.\n", n_gpu, U_FP32);
    print_table_header();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_matmul, &mm_small),
        cmocka_unit_test_prestate(test_matmul, &mm_wide),
        cmocka_unit_test_prestate(test_matmul, &mm_router),
        cmocka_unit_test_prestate(test_matmul, &mm_square),
        cmocka_unit_test_prestate(test_matmul, &mm_c1),
        cmocka_unit_test_prestate(test_matmul, &mm_unaligned),
        cmocka_unit_test_prestate(test_matmul, &mm_router_chunks),
        cmocka_unit_test_prestate(test_matmul, &mm_router_chunks_unaligned),
        cmocka_unit_test_prestate(test_embedding, &emb_small),
        cmocka_unit_test_prestate(test_embedding, &emb_chars),
        cmocka_unit_test_prestate(test_embedding, &emb_one),
        cmocka_unit_test_prestate(test_embedding, &emb_big),
        cmocka_unit_test_prestate(test_rope, &rope_small),
        cmocka_unit_test_prestate(test_rope, &rope_long),
        cmocka_unit_test_prestate(test_rope, &rope_heads),
        cmocka_unit_test_prestate(test_copy_block, &copy_small),
        cmocka_unit_test_prestate(test_copy_block, &copy_one),
        cmocka_unit_test_prestate(test_copy_block, &copy_mla),
        cmocka_unit_test_prestate(test_add_scale, &vec_big),
        cmocka_unit_test_prestate(test_add_scale, &vec_one),
        cmocka_unit_test_prestate(test_sum_squares, &vec_big),
        cmocka_unit_test_prestate(test_sum_squares, &vec_one),
        cmocka_unit_test_prestate(test_sum_squares, &vec_chunk),
        cmocka_unit_test_prestate(test_router, &router_a),
        cmocka_unit_test_prestate(test_router, &router_b),
        cmocka_unit_test_prestate(test_router, &router_dsv3),
        cmocka_unit_test_prestate(test_router, &router_flat),
        cmocka_unit_test_prestate(test_balance, &bal_a),
        cmocka_unit_test_prestate(test_balance, &bal_b),
        cmocka_unit_test_prestate(test_balance, &bal_dsv3),
        cmocka_unit_test_prestate(test_permute, &perm_a),
        cmocka_unit_test_prestate(test_permute, &perm_b),
        cmocka_unit_test_prestate(test_permute, &perm_dsv3),
        cmocka_unit_test_prestate(test_permute, &perm_skew),
        cmocka_unit_test_prestate(test_permute, &perm_repeat),
        cmocka_unit_test_prestate(test_permute, &perm_one),
        cmocka_unit_test_prestate(test_permute, &perm_empty),
        cmocka_unit_test_prestate(test_permute, &perm_k12),
        cmocka_unit_test_prestate(test_permute, &perm_k17),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
