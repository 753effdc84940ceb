/*
 * test_ops.c - unit tests of the CPU reference ops (kernels/cpu: matmul, embedding, RMSNorm, SwiGLU,
 * RoPE, attention, cross-entropy), run in the FP32 build.
 *
 * Every arithmetic op is checked against a naive double-precision reference written here, independently
 * of the code under test (the attention core, which reads MLA's key/value layout in place, is also checked
 * bitwise against the per-head formulation it replaced). Every backward op is checked twice: against
 * central finite differences of the double reference forward (so the gradient formula is verified without
 * trusting any analytic derivation) and against an analytic double reference (which is itself checked
 * against the finite differences). Tolerances are derived from float rounding and stated at each check. Also covered:
 * accumulation into non-zero gradient buffers (and, for ops that write their gradients, that NaN poison
 * is overwritten), NULL gradients, masked cross-entropy targets, a RoPE case worked by hand, attention
 * causality, and bitwise determinism across OpenMP thread counts.
 * The file is longer than most because it carries its own double-precision reference of every op.
 * Run with OPCHECK_VERBOSE=1 to print how much room each tolerance leaves.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "opcheck.h"

#define U OPCHECK_UNIT_ROUNDOFF
// Finite differences in double carry ~1e-10 absolute error on the O(1) losses used here (opcheck.h);
// this is added to every bound that compares against them.
#define FD_STEP 1e-5
#define FD_SLACK 1e-8

// ---------------------------------------------------------------------------- allocation
// Every test allocates through talloc and releases everything with tfree_all at its end.
static void *tracked[512];
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
static int *ialloc(size_t n) { return talloc(n * sizeof(int)); }
// A real buffer full of NaN: poison for outputs an op must write entirely (a missed or accumulated
// element stays NaN and fails every comparison).
static real *nan_ralloc(size_t n) {
    real *x = ralloc(n);
    for (size_t i = 0; i < n; i++) x[i] = (real)NAN;
    return x;
}
static void tfree_all(void) {
    for (int i = 0; i < n_tracked; i++) free(tracked[i]);
    n_tracked = 0;
}

// A double copy of a real array.
static double *dcopy(const real *x, size_t n) {
    double *d = dalloc(n);
    opcheck_to_double(d, x, n);
    return d;
}
static double *dabs(const double *x, size_t n) {
    double *d = dalloc(n);
    for (size_t i = 0; i < n; i++) d[i] = fabs(x[i]);
    return d;
}
static double ddot(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static double max_abs(const double *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

// Gradient accumulation: got_acc came from a backward run whose buffer held G, got_fresh from a run on
// a zeroed buffer. The ops checked with this sum their contribution first and add it once, so the
// result is exactly fl(G + fresh): "+=" semantics, with no other change from the old contents.
static void check_accumulated(const char *what, const real *got_acc, const real *G, const real *got_fresh,
                              size_t n) {
    for (size_t i = 0; i < n; i++) {
        const real want = G[i] + got_fresh[i];
        if (memcmp(&got_acc[i], &want, sizeof(real)) != 0) {
            fprintf(stderr, "%s: element %zu: accumulated %.9g, want G + fresh = %.9g\n", what, i,
                    (double)got_acc[i], (double)want);
            fail();
        }
    }
}

// ---------------------------------------------------------------------------- double references
// matmul: out (N, OC) = inp (N, C) @ w (OC, C)^T
static void ref_matmul(double *out, const double *inp, const double *w, int N, int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = 0;
            for (int c = 0; c < C; c++) s += inp[n * C + c] * w[o * C + c];
            out[n * OC + o] = s;
        }
}
// dinp (N, C) = dout @ w; dw (OC, C) = dout^T @ inp   (written, not accumulated)
static void ref_matmul_backward(double *dinp, double *dw, const double *dout, const double *inp, const double *w,
                                int N, int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int o = 0; o < OC; o++) s += dout[n * OC + o] * w[o * C + c];
            dinp[n * C + c] = s;
        }
    for (int o = 0; o < OC; o++)
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int n = 0; n < N; n++) s += dout[n * OC + o] * inp[n * C + c];
            dw[o * C + c] = s;
        }
}

static void ref_rmsnorm(double *out, double *rstd, const double *inp, const double *w, int N, int C) {
    for (int n = 0; n < N; n++) {
        double ms = 0;
        for (int c = 0; c < C; c++) ms += inp[n * C + c] * inp[n * C + c];
        const double r = 1.0 / sqrt(ms / C + RMSNORM_EPS);
        for (int c = 0; c < C; c++) out[n * C + c] = inp[n * C + c] * r * w[c];
        if (rstd) rstd[n] = r;
    }
}
// Through the full Jacobian dy_c/dx_k = w_c (r delta_ck - x_c x_k r^3 / C), a different route from
// the factored formula in the code under test.
static void ref_rmsnorm_backward(double *dinp, double *dw, const double *dout, const double *inp, const double *w,
                                 int N, int C) {
    for (int c = 0; c < C; c++) dw[c] = 0;
    for (int n = 0; n < N; n++) {
        const double *x = inp + n * C, *g = dout + n * C;
        double ms = 0;
        for (int c = 0; c < C; c++) ms += x[c] * x[c];
        const double r = 1.0 / sqrt(ms / C + RMSNORM_EPS);
        for (int k = 0; k < C; k++) {
            double s = 0;
            for (int c = 0; c < C; c++) s += g[c] * w[c] * ((c == k ? r : 0.0) - x[c] * x[k] * r * r * r / C);
            dinp[n * C + k] = s;
        }
        for (int c = 0; c < C; c++) dw[c] += g[c] * x[c] * r;
    }
}

static double ref_sigmoid(double a) { return 1.0 / (1.0 + exp(-a)); }
static void ref_swiglu(double *out, const double *a, const double *b, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] * ref_sigmoid(a[i]) * b[i];
}
// d silu/da = s + a s (1 - s)
static void ref_swiglu_backward(double *da, double *db, const double *dout, const double *a, const double *b,
                                int n) {
    for (int i = 0; i < n; i++) {
        const double s = ref_sigmoid(a[i]);
        da[i] = dout[i] * b[i] * (s + a[i] * s * (1.0 - s));
        db[i] = dout[i] * a[i] * s;
    }
}

// x (B, T, H, D): pair (x[2j], x[2j+1]) at position t rotated by t * theta^(-2j/D)
static void ref_rope(double *out, const double *inp, int B, int T, int H, int D, double theta, int inverse) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++)
                for (int j = 0; j < D / 2; j++) {
                    const double angle = (inverse ? -1.0 : 1.0) * t * pow(theta, -2.0 * j / D);
                    const size_t i = (((size_t)b * T + t) * H + h) * D + 2 * j;
                    const double x0 = inp[i], x1 = inp[i + 1];
                    out[i] = x0 * cos(angle) - x1 * sin(angle);
                    out[i + 1] = x0 * sin(angle) + x1 * cos(angle);
                }
}

#define AT(x, b, t, h, D) ((x) + ((((size_t)(b) * T + (t)) * H + (h)) * (D)))
static void ref_attention(double *out, double *att, const double *q, const double *k, const double *v, int B,
                          int T, int H, int Dqk, int Dv) {
    const double scale = 1.0 / sqrt((double)Dqk);
    double *score = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                double mx = -INFINITY, sum = 0;
                for (int s = 0; s <= t; s++) {
                    double dot = 0;
                    for (int d = 0; d < Dqk; d++) dot += AT(q, b, t, h, Dqk)[d] * AT(k, b, s, h, Dqk)[d];
                    score[s] = dot * scale;
                    mx = fmax(mx, score[s]);
                }
                for (int s = 0; s <= t; s++) sum += exp(score[s] - mx);
                double *p = att + (((size_t)b * H + h) * T + t) * T;
                for (int s = 0; s < T; s++) p[s] = s <= t ? exp(score[s] - mx) / sum : 0.0;
                for (int d = 0; d < Dv; d++) {
                    double o = 0;
                    for (int s = 0; s <= t; s++) o += p[s] * AT(v, b, s, h, Dv)[d];
                    AT(out, b, t, h, Dv)[d] = o;
                }
            }
    free(score);
}
// Through the explicit softmax Jacobian dP_j/dscore_s = P_j (delta_js - P_s). Written, not accumulated.
static void ref_attention_backward(double *dq, double *dk, double *dv, const double *dout, const double *q,
                                   const double *k, const double *v, int B, int T, int H, int Dqk, int Dv) {
    const double scale = 1.0 / sqrt((double)Dqk);
    const size_t nqk = (size_t)B * T * H * Dqk, nv = (size_t)B * T * H * Dv;
    double *out = calloc(nv, sizeof(double)), *att = calloc((size_t)B * H * T * T, sizeof(double));
    double *datt = malloc(sizeof(double) * T);
    ref_attention(out, att, q, k, v, B, T, H, Dqk, Dv);
    memset(dq, 0, sizeof(double) * nqk);
    memset(dk, 0, sizeof(double) * nqk);
    memset(dv, 0, sizeof(double) * nv);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const double *p = att + (((size_t)b * H + h) * T + t) * T;
                const double *g = AT(dout, b, t, h, Dv);
                for (int j = 0; j <= t; j++) {
                    datt[j] = 0;
                    for (int d = 0; d < Dv; d++) {
                        datt[j] += g[d] * AT(v, b, j, h, Dv)[d];
                        AT(dv, b, j, h, Dv)[d] += p[j] * g[d];
                    }
                }
                for (int s = 0; s <= t; s++) {
                    double dscore = 0;
                    for (int j = 0; j <= t; j++) dscore += datt[j] * p[j] * ((j == s ? 1.0 : 0.0) - p[s]);
                    for (int d = 0; d < Dqk; d++) {
                        AT(dq, b, t, h, Dqk)[d] += dscore * scale * AT(k, b, s, h, Dqk)[d];
                        AT(dk, b, s, h, Dqk)[d] += dscore * scale * AT(q, b, t, h, Dqk)[d];
                    }
                }
            }
    free(out);
    free(att);
    free(datt);
}

static void ref_crossentropy(double *losses, double *probs, const double *logits, const int *targets, int N,
                             int V) {
    for (int n = 0; n < N; n++) {
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) mx = fmax(mx, logits[n * V + i]);
        for (int i = 0; i < V; i++) sum += exp(logits[n * V + i] - mx);
        for (int i = 0; i < V; i++) probs[n * V + i] = exp(logits[n * V + i] - mx) / sum;
        losses[n] = targets[n] < 0 ? 0.0 : -log(probs[n * V + targets[n]]);
    }
}

// ---------------------------------------------------------------------------- matmul
static void check_matmul_forward(int N, int C, int OC, uint64_t seed) {
    real *inp = ralloc((size_t)N * C), *w = ralloc((size_t)OC * C), *out = ralloc((size_t)N * OC);
    opcheck_fill_nonzero(inp, (size_t)N * C, seed, 0.1, 1.0);
    opcheck_fill_nonzero(w, (size_t)OC * C, seed + 1, 0.1, 1.0);
    opcheck_fill(out, (size_t)N * OC, seed + 2, 5, 6); // garbage that the forward must overwrite
    cpu_matmul_forward(out, inp, w, N, C, OC);
    double *want = dalloc((size_t)N * OC), *absdot = dalloc((size_t)N * OC);
    double *din = dcopy(inp, (size_t)N * C), *dw = dcopy(w, (size_t)OC * C);
    ref_matmul(want, din, dw, N, C, OC);
    // A float dot product of length C is within gamma_C * sum |a_k b_k| of the exact value.
    ref_matmul(absdot, dabs(din, (size_t)N * C), dabs(dw, (size_t)OC * C), N, C, OC);
    for (size_t i = 0; i < (size_t)N * OC; i++) absdot[i] = opcheck_gamma(C) * absdot[i] + 1e-30;
    char what[96];
    snprintf(what, sizeof what, "matmul_forward N=%d C=%d OC=%d", N, C, OC);
    assert_true(opcheck_ratio_bound(what, out, want, absdot, (size_t)N * OC) <= 1.0);
    tfree_all();
}

// Sizes cover single elements, partial micro-tiles (6 x 8) and partial thread blocks (48 x 128).
static void test_matmul_forward(void **state) {
    (void)state;
    check_matmul_forward(1, 1, 1, 10);
    check_matmul_forward(5, 7, 9, 20);
    check_matmul_forward(13, 33, 17, 30);
    check_matmul_forward(100, 70, 150, 40);
    check_matmul_forward(64, 256, 136, 50);
    check_matmul_forward(3, 0, 4, 60); // empty sum: out must be 0
}

typedef struct {
    double *inp, *w, *dout, *out;
    int N, C, OC;
} MatmulProbe;
static double matmul_loss(void *ctx) {
    MatmulProbe *m = ctx;
    ref_matmul(m->out, m->inp, m->w, m->N, m->C, m->OC);
    return ddot(m->out, m->dout, (size_t)m->N * m->OC);
}

static void check_matmul_backward(int N, int C, int OC, uint64_t seed, int finite_differences) {
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    real *inp = ralloc(ni), *w = ralloc(nw), *dout = ralloc(no), *dinp = ralloc(ni), *dw = ralloc(nw);
    opcheck_fill_nonzero(inp, ni, seed, 0.1, 1.0);
    opcheck_fill_nonzero(w, nw, seed + 1, 0.1, 1.0);
    opcheck_fill_nonzero(dout, no, seed + 2, 0.1, 1.0);
    cpu_matmul_backward(dinp, dw, dout, inp, w, N, C, OC);

    MatmulProbe m = {dcopy(inp, ni), dcopy(w, nw), dcopy(dout, no), dalloc(no), N, C, OC};
    double *ref_dinp = dalloc(ni), *ref_dw = dalloc(nw), *bound_dinp = dalloc(ni), *bound_dw = dalloc(nw);
    ref_matmul_backward(ref_dinp, ref_dw, m.dout, m.inp, m.w, N, C, OC);
    // dinp sums OC products, dweight sums N products: gamma_K * sum |terms| (rigorous float bound).
    ref_matmul_backward(bound_dinp, bound_dw, dabs(m.dout, no), dabs(m.inp, ni), dabs(m.w, nw), N, C, OC);
    for (size_t i = 0; i < ni; i++) bound_dinp[i] = opcheck_gamma(OC) * bound_dinp[i] + FD_SLACK;
    for (size_t i = 0; i < nw; i++) bound_dw[i] = opcheck_gamma(N) * bound_dw[i] + FD_SLACK;
    assert_true(opcheck_ratio_bound("matmul dinp vs analytic", dinp, ref_dinp, bound_dinp, ni) <= 1.0);
    assert_true(opcheck_ratio_bound("matmul dweight vs analytic", dw, ref_dw, bound_dw, nw) <= 1.0);
    if (finite_differences) {
        double *fd_dinp = dalloc(ni), *fd_dw = dalloc(nw);
        opcheck_fd_grad(fd_dinp, m.inp, ni, FD_STEP, matmul_loss, &m);
        opcheck_fd_grad(fd_dw, m.w, nw, FD_STEP, matmul_loss, &m);
        // The analytic reference and finite differences are both double: they agree to FD accuracy.
        assert_true(opcheck_ratio_d("matmul ref dinp vs fd", ref_dinp, fd_dinp, ni, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio_d("matmul ref dweight vs fd", ref_dw, fd_dw, nw, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio_bound("matmul dinp vs fd", dinp, fd_dinp, bound_dinp, ni) <= 1.0);
        assert_true(opcheck_ratio_bound("matmul dweight vs fd", dw, fd_dw, bound_dw, nw) <= 1.0);
    }
    tfree_all();
}

static void test_matmul_backward(void **state) {
    (void)state;
    check_matmul_backward(5, 7, 9, 100, 1);
    check_matmul_backward(8, 3, 13, 110, 1);
    check_matmul_backward(70, 50, 30, 120, 0);
    check_matmul_backward(130, 129, 140, 130, 0);
}

// dinp and dweight are added to what the buffers held; a NULL gradient is skipped and does not
// change the other one.
static void test_matmul_backward_accumulates(void **state) {
    (void)state;
    const int N = 19, C = 23, OC = 29;
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    real *inp = ralloc(ni), *w = ralloc(nw), *dout = ralloc(no);
    opcheck_fill_nonzero(inp, ni, 200, 0.1, 1.0);
    opcheck_fill_nonzero(w, nw, 201, 0.1, 1.0);
    opcheck_fill_nonzero(dout, no, 202, 0.1, 1.0);
    real *G_inp = ralloc(ni), *G_w = ralloc(nw);
    opcheck_fill_nonzero(G_inp, ni, 203, 0.5, 3.0);
    opcheck_fill_nonzero(G_w, nw, 204, 0.5, 3.0);
    real *dinp0 = ralloc(ni), *dw0 = ralloc(nw), *dinp = ralloc(ni), *dw = ralloc(nw);
    cpu_matmul_backward(dinp0, dw0, dout, inp, w, N, C, OC);
    memcpy(dinp, G_inp, ni * sizeof(real));
    memcpy(dw, G_w, nw * sizeof(real));
    cpu_matmul_backward(dinp, dw, dout, inp, w, N, C, OC);
    check_accumulated("matmul dinp", dinp, G_inp, dinp0, ni);
    check_accumulated("matmul dweight", dw, G_w, dw0, nw);

    real *only = ralloc(nw > ni ? nw : ni);
    cpu_matmul_backward(NULL, only, dout, inp, w, N, C, OC);
    assert_memory_equal(only, dw0, nw * sizeof(real));
    memset(only, 0, ni * sizeof(real));
    cpu_matmul_backward(only, NULL, dout, inp, w, N, C, OC);
    assert_memory_equal(only, dinp0, ni * sizeof(real));
    tfree_all();
}

// ---------------------------------------------------------------------------- embedding
static void test_embedding(void **state) {
    (void)state;
    const int V = 7, N = 23, C = 9;
    real *table = ralloc((size_t)V * C), *out = ralloc((size_t)N * C), *dout = ralloc((size_t)N * C);
    int *tokens = ialloc(N);
    opcheck_fill_nonzero(table, (size_t)V * C, 300, 0.1, 1.0);
    opcheck_fill_nonzero(dout, (size_t)N * C, 301, 0.1, 1.0);
    opcheck_fill_int(tokens, N, 302, 0, V - 1); // token V-1 never appears: its gradient row stays 0
    tokens[3] = tokens[11] = tokens[17] = 2;    // repeated tokens sum their rows
    cpu_embedding_forward(out, tokens, table, N, C);
    for (int n = 0; n < N; n++)
        assert_memory_equal(out + (size_t)n * C, table + (size_t)tokens[n] * C, C * sizeof(real));

    real *dtable = ralloc((size_t)V * C);
    cpu_embedding_backward(dtable, dout, tokens, N, C);
    // Reference: dtable[v] = sum of dout rows with token v, in double; float sums of m rows are
    // within gamma_m * sum |rows|.
    double *want = dalloc((size_t)V * C), *bound = dalloc((size_t)V * C);
    int count[7] = {0};
    for (int n = 0; n < N; n++) count[tokens[n]]++;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            want[tokens[n] * C + c] += dout[n * C + c];
            bound[tokens[n] * C + c] += opcheck_gamma(count[tokens[n]]) * fabs((double)dout[n * C + c]);
        }
    for (int i = 0; i < V * C; i++) bound[i] += 1e-30;
    assert_true(opcheck_ratio_bound("embedding_backward", dtable, want, bound, (size_t)V * C) <= 1.0);
    for (int c = 0; c < C; c++) assert_true(dtable[(V - 1) * C + c] == 0);

    // Accumulation into a non-zero table gradient: rows are added one by one onto G, so the result
    // is G + the row sum up to gamma_(m+1) * (|G| + sum |rows|).
    real *G = ralloc((size_t)V * C), *acc = ralloc((size_t)V * C);
    double *want_acc = dalloc((size_t)V * C), *bound_acc = dalloc((size_t)V * C);
    opcheck_fill_nonzero(G, (size_t)V * C, 303, 0.5, 3.0);
    memcpy(acc, G, (size_t)V * C * sizeof(real));
    cpu_embedding_backward(acc, dout, tokens, N, C);
    for (int v = 0; v < V; v++)
        for (int c = 0; c < C; c++) {
            want_acc[v * C + c] = G[v * C + c] + want[v * C + c];
            bound_acc[v * C + c] = opcheck_gamma(count[v] + 1) * fabs((double)G[v * C + c]) + 1e-30;
        }
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            bound_acc[tokens[n] * C + c] += opcheck_gamma(count[tokens[n]] + 1) * fabs((double)dout[n * C + c]);
    assert_true(opcheck_ratio_bound("embedding_backward accumulated", acc, want_acc, bound_acc, (size_t)V * C) <=
                1.0);
    tfree_all();
}

// ---------------------------------------------------------------------------- RMSNorm
typedef struct {
    double *inp, *w, *dout, *out;
    int N, C;
} RmsProbe;
static double rmsnorm_loss(void *ctx) {
    RmsProbe *r = ctx;
    ref_rmsnorm(r->out, NULL, r->inp, r->w, r->N, r->C);
    return ddot(r->out, r->dout, (size_t)r->N * r->C);
}

static void check_rmsnorm(int N, int C, uint64_t seed, int finite_differences) {
    const size_t n = (size_t)N * C;
    real *inp = ralloc(n), *w = ralloc(C), *out = ralloc(n), *rstd = ralloc(N), *dout = ralloc(n);
    opcheck_fill_nonzero(inp, n, seed, 0.1, 2.0);
    opcheck_fill_nonzero(w, C, seed + 1, 0.5, 1.5);
    opcheck_fill_nonzero(dout, n, seed + 2, 0.1, 1.0);
    cpu_rmsnorm_forward(out, rstd, inp, w, N, C);
    RmsProbe p = {dcopy(inp, n), dcopy(w, C), dcopy(dout, n), dalloc(n), N, C};
    double *want = dalloc(n), *want_rstd = dalloc(N);
    ref_rmsnorm(want, want_rstd, p.inp, p.w, N, C);
    // The sum of squares adds C positive terms (relative error <= gamma_C, no cancellation); the
    // mean, eps, sqrt, division and two products add a few more roundings: rtol (C + 8) u.
    assert_true(opcheck_ratio("rmsnorm rstd", rstd, want_rstd, N, 0, (C + 8) * U) <= 1.0);
    assert_true(opcheck_ratio("rmsnorm out", out, want, n, 0, (C + 8) * U) <= 1.0);

    real *dinp = ralloc(n), *dw = ralloc(C);
    cpu_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
    double *ref_dinp = dalloc(n), *ref_dw = dalloc(C);
    ref_rmsnorm_backward(ref_dinp, ref_dw, p.dout, p.inp, p.w, N, C);
    // dinp = r (w g - x r^2 sum(g w x)/C) can cancel, so its error is measured against the largest
    // gradient entry: sums of C (dinp) or N (dweight) terms give relative errors ~(C or N) u of the
    // magnitudes involved, bounded here by 4 (K + 8) u * max|gradient| (K = C for dinp, N for dweight).
    const double atol_dinp = 4.0 * (C + 8) * U * max_abs(ref_dinp, n) + FD_SLACK;
    const double atol_dw = 4.0 * (N + 8) * U * max_abs(ref_dw, C) + FD_SLACK;
    assert_true(opcheck_ratio("rmsnorm dinp vs analytic", dinp, ref_dinp, n, atol_dinp, 0) <= 1.0);
    assert_true(opcheck_ratio("rmsnorm dweight vs analytic", dw, ref_dw, C, atol_dw, 0) <= 1.0);
    if (finite_differences) {
        double *fd_dinp = dalloc(n), *fd_dw = dalloc(C);
        opcheck_fd_grad(fd_dinp, p.inp, n, FD_STEP, rmsnorm_loss, &p);
        opcheck_fd_grad(fd_dw, p.w, C, FD_STEP, rmsnorm_loss, &p);
        assert_true(opcheck_ratio_d("rmsnorm ref dinp vs fd", ref_dinp, fd_dinp, n, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio_d("rmsnorm ref dweight vs fd", ref_dw, fd_dw, C, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio("rmsnorm dinp vs fd", dinp, fd_dinp, n, atol_dinp, 0) <= 1.0);
        assert_true(opcheck_ratio("rmsnorm dweight vs fd", dw, fd_dw, C, atol_dw, 0) <= 1.0);
    }

    // Accumulation, and NULL gradients skipped.
    real *G_inp = ralloc(n), *G_w = ralloc(C), *acc_inp = ralloc(n), *acc_w = ralloc(C);
    opcheck_fill_nonzero(G_inp, n, seed + 3, 0.5, 3.0);
    opcheck_fill_nonzero(G_w, C, seed + 4, 0.5, 3.0);
    memcpy(acc_inp, G_inp, n * sizeof(real));
    memcpy(acc_w, G_w, C * sizeof(real));
    cpu_rmsnorm_backward(acc_inp, acc_w, dout, inp, w, rstd, N, C);
    check_accumulated("rmsnorm dinp", acc_inp, G_inp, dinp, n);
    check_accumulated("rmsnorm dweight", acc_w, G_w, dw, C);
    real *only_inp = ralloc(n), *only_w = ralloc(C);
    cpu_rmsnorm_backward(only_inp, NULL, dout, inp, w, rstd, N, C);
    cpu_rmsnorm_backward(NULL, only_w, dout, inp, w, rstd, N, C);
    assert_memory_equal(only_inp, dinp, n * sizeof(real));
    assert_memory_equal(only_w, dw, C * sizeof(real));

    // dout as BF16 rows at a padded stride (padding NaN, never read): the bits of the FP32 backward on the widened
    // values, both gradients accumulated onto G as above.
    const int64_t ld = C + 3;
    uint16_t *dout16 = malloc(sizeof(uint16_t) * (size_t)(N * ld));
    real *wide = ralloc(n), *acc16_inp = ralloc(n), *acc16_w = ralloc(C);
    assert_non_null(dout16);
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < ld; c++) dout16[r * ld + c] = c < C ? float_to_bf16((float)dout[r * C + c]) : 0x7FC0;
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < C; c++) wide[r * C + c] = bf16_to_float(dout16[r * ld + c]);
    memcpy(acc_inp, G_inp, n * sizeof(real)), memcpy(acc_w, G_w, C * sizeof(real));
    memcpy(acc16_inp, G_inp, n * sizeof(real)), memcpy(acc16_w, G_w, C * sizeof(real));
    cpu_rmsnorm_backward(acc_inp, acc_w, wide, inp, w, rstd, N, C);
    cpu_rmsnorm_backward_bf16(acc16_inp, acc16_w, dout16, ld, 1, 0, inp, w, rstd, N, C);
    assert_memory_equal(acc16_inp, acc_inp, n * sizeof(real));
    assert_memory_equal(acc16_w, acc_w, C * sizeof(real));

    // dout as the sum of two such arrays (a gap of 5 NaN values between them, never read): the bits of the FP32
    // backward on the widened first + the widened second.
    const int64_t stride = N * ld + 5;
    uint16_t *two16 = opcheck_two_bf16_sources(wide, dout, N, C, ld, stride);
    memcpy(acc_inp, G_inp, n * sizeof(real)), memcpy(acc_w, G_w, C * sizeof(real));
    memcpy(acc16_inp, G_inp, n * sizeof(real)), memcpy(acc16_w, G_w, C * sizeof(real));
    cpu_rmsnorm_backward(acc_inp, acc_w, wide, inp, w, rstd, N, C);
    cpu_rmsnorm_backward_bf16(acc16_inp, acc16_w, two16, ld, 2, stride, inp, w, rstd, N, C);
    assert_memory_equal(acc16_inp, acc_inp, n * sizeof(real));
    assert_memory_equal(acc16_w, acc_w, C * sizeof(real));
    free(dout16), free(two16);
    tfree_all();
}

static void test_rmsnorm(void **state) {
    (void)state;
    check_rmsnorm(3, 8, 400, 1);
    check_rmsnorm(4, 5, 410, 1);
    check_rmsnorm(17, 100, 420, 0);
    check_rmsnorm(9, 150, 430, 0); // more than two column chunks of the dweight reduction
}

// ---------------------------------------------------------------------------- SwiGLU
typedef struct {
    double *a, *b, *dout, *out;
    int n;
} SwigluProbe;
static double swiglu_loss(void *ctx) {
    SwigluProbe *s = ctx;
    ref_swiglu(s->out, s->a, s->b, s->n);
    return ddot(s->out, s->dout, (size_t)s->n);
}

static void test_swiglu(void **state) {
    (void)state;
    const int n = 61;
    real *a = ralloc(n), *b = ralloc(n), *out = ralloc(n), *dout = ralloc(n);
    real *da = nan_ralloc(n), *db = nan_ralloc(n); // the backward WRITES them: poison must not survive
    opcheck_fill_nonzero(a, n, 500, 0.05, 6.0); // both signs, past the region where sigmoid saturates
    opcheck_fill_nonzero(b, n, 501, 0.1, 2.0);
    opcheck_fill_nonzero(dout, n, 502, 0.1, 1.0);
    cpu_swiglu_forward(out, a, b, n);
    SwigluProbe p = {dcopy(a, n), dcopy(b, n), dcopy(dout, n), dalloc(n), n};
    double *want = dalloc(n);
    ref_swiglu(want, p.a, p.b, n);
    // exp, one add, one division and two products: a handful of roundings, rtol 8 u.
    assert_true(opcheck_ratio("swiglu out", out, want, n, 0, 8 * U) <= 1.0);

    cpu_swiglu_backward(da, db, dout, a, b, n);
    double *ref_da = dalloc(n), *ref_db = dalloc(n), *fd_da = dalloc(n), *fd_db = dalloc(n);
    ref_swiglu_backward(ref_da, ref_db, p.dout, p.a, p.b, n);
    opcheck_fd_grad(fd_da, p.a, n, FD_STEP, swiglu_loss, &p);
    opcheck_fd_grad(fd_db, p.b, n, FD_STEP, swiglu_loss, &p);
    assert_true(opcheck_ratio_d("swiglu ref da vs fd", ref_da, fd_da, n, FD_SLACK, 1e-7) <= 1.0);
    assert_true(opcheck_ratio_d("swiglu ref db vs fd", ref_db, fd_db, n, FD_SLACK, 1e-7) <= 1.0);
    // silu'(a) = s (1 + a (1 - s)) cancels near a = -1.28, so da is bounded by roundings of its
    // terms: 16 u |dout b| (1 + |a|); db is a product chain, rtol 8 u.
    double *bound_da = dalloc(n);
    for (int i = 0; i < n; i++) bound_da[i] = 16 * U * fabs(p.dout[i] * p.b[i]) * (1 + fabs(p.a[i])) + FD_SLACK;
    assert_true(opcheck_ratio_bound("swiglu da vs analytic", da, ref_da, bound_da, n) <= 1.0);
    assert_true(opcheck_ratio_bound("swiglu da vs fd", da, fd_da, bound_da, n) <= 1.0);
    assert_true(opcheck_ratio("swiglu db vs analytic", db, ref_db, n, FD_SLACK, 8 * U) <= 1.0);
    assert_true(opcheck_ratio("swiglu db vs fd", db, fd_db, n, FD_SLACK, 8 * U) <= 1.0);

    // Written, not accumulated: over finite garbage the same bits as over the NaN poison above (an op
    // that added to the old values would give garbage + gradient here).
    real *over_a = ralloc(n), *over_b = ralloc(n), *only_a = nan_ralloc(n), *only_b = nan_ralloc(n);
    opcheck_fill_nonzero(over_a, n, 503, 0.5, 3.0);
    opcheck_fill_nonzero(over_b, n, 504, 0.5, 3.0);
    cpu_swiglu_backward(over_a, over_b, dout, a, b, n);
    assert_memory_equal(over_a, da, n * sizeof(real));
    assert_memory_equal(over_b, db, n * sizeof(real));
    // one gradient at a time (the other NULL): the same bits, also written over poison
    cpu_swiglu_backward(NULL, only_b, dout, a, b, n);
    assert_memory_equal(only_b, db, n * sizeof(real));
    cpu_swiglu_backward(only_a, NULL, dout, a, b, n);
    assert_memory_equal(only_a, da, n * sizeof(real));
    tfree_all();
}

// ---------------------------------------------------------------------------- RoPE
// Worked by hand: D = 4, theta = 10000, so pair 0 turns by t * 1 rad and pair 1 by t * 10000^(-1/2)
// = t * 0.01 rad. At position 1, x = (1, 2, 3, 4):
//   cos 1 = 0.5403023058681398, sin 1 = 0.8414709848078965
//   cos 0.01 = 0.9999500004166653, sin 0.01 = 0.0099998333341667   (Taylor series)
//   out = (1 cos1 - 2 sin1, 1 sin1 + 2 cos1, 3 cos.01 - 4 sin.01, 3 sin.01 + 4 cos.01)
//       = (-1.1426396637476532, 1.9220755965441761, 2.9598506679133293, 4.0297995016691612)
// Position 0 does not rotate at all (cos 0 = 1, sin 0 = 0 exactly), so that row is copied bitwise.
static void test_rope_hand_worked(void **state) {
    (void)state;
    real x[8] = {0.5f, -1.5f, 2.5f, 0.25f, 1, 2, 3, 4}; // (B=1, T=2, H=1, D=4)
    real out[8];
    cpu_rope_forward(out, x, 4, 1, 2, 1, 4, 10000);
    assert_memory_equal(out, x, 4 * sizeof(real));
    const double want[4] = {-1.1426396637476532, 1.9220755965441761, 2.9598506679133293, 4.0297995016691612};
    // cos/sin rounded to float (u each), two products and a sum: |err| <= 4 u (|x0| + |x1|) per pair.
    const double bound[4] = {4 * U * 3, 4 * U * 3, 4 * U * 7, 4 * U * 7};
    assert_true(opcheck_ratio_bound("rope hand-worked", out + 4, want, bound, 4) <= 1.0);
}

typedef struct {
    double *x, *dout, *out;
    int B, T, H, D;
} RopeProbe;
static double rope_loss(void *ctx) {
    RopeProbe *r = ctx;
    ref_rope(r->out, r->x, r->B, r->T, r->H, r->D, 10000, 0);
    return ddot(r->out, r->dout, (size_t)r->B * r->T * r->H * r->D);
}

// Per-element bound for rotated pairs: scale * u * (|x0| + |x1|) of the pair the element belongs to.
static double *pair_bound(const double *x, size_t n, double scale) {
    double *bound = dalloc(n);
    for (size_t i = 0; i < n; i += 2) bound[i] = bound[i + 1] = scale * U * (fabs(x[i]) + fabs(x[i + 1])) + 1e-30;
    return bound;
}

// Strided vectors (MLA rotates the rope part of its (B, T, H, dqk) queries in place): D of every LD columns from
// column OFF, rotated in place (backward: the inverse rotation), must give the packed call's bits (want) and
// leave the other columns alone.
static void check_rope_strided(const real *src, const real *want, int backward, int B, int T, int H, int D) {
    enum { LD = 13, OFF = 3 };
    const size_t nv = (size_t)B * T * H;
    real *wide = ralloc(nv * LD);
    for (size_t i = 0; i < nv * LD; i++) wide[i] = (real)-777;
    for (size_t v = 0; v < nv; v++) memcpy(wide + v * LD + OFF, src + v * D, D * sizeof(real));
    if (backward) cpu_rope_backward(wide + OFF, wide + OFF, LD, B, T, H, D, 10000);
    else cpu_rope_forward(wide + OFF, wide + OFF, LD, B, T, H, D, 10000);
    for (size_t v = 0; v < nv; v++) {
        assert_memory_equal(wide + v * LD + OFF, want + v * D, D * sizeof(real));
        for (int c = 0; c < LD; c++)
            if (c < OFF || c >= OFF + D) assert_true(wide[v * LD + c] == (real)-777);
    }
}

static void test_rope(void **state) {
    (void)state;
    const int B = 2, T = 6, H = 3, D = 8;
    const size_t n = (size_t)B * T * H * D;
    real *x = ralloc(n), *out = ralloc(n), *dout = ralloc(n);
    opcheck_fill_nonzero(x, n, 600, 0.1, 2.0);
    opcheck_fill_nonzero(dout, n, 601, 0.1, 1.0);
    cpu_rope_forward(out, x, D, B, T, H, D, 10000);
    RopeProbe p = {dcopy(x, n), dcopy(dout, n), dalloc(n), B, T, H, D};
    double *want = dalloc(n);
    ref_rope(want, p.x, B, T, H, D, 10000, 0);
    assert_true(opcheck_ratio_bound("rope forward", out, want, pair_bound(p.x, n, 4), n) <= 1.0);

    // Rotation preserves each pair's norm: the float result's squared pair norm is within a few u.
    for (size_t i = 0; i < n; i += 2) {
        const double before = p.x[i] * p.x[i] + p.x[i + 1] * p.x[i + 1];
        const double after = (double)out[i] * out[i] + (double)out[i + 1] * out[i + 1];
        assert_true(fabs(after - before) <= 16 * U * before);
    }
    // out may alias inp.
    real *inplace = ralloc(n);
    memcpy(inplace, x, n * sizeof(real));
    cpu_rope_forward(inplace, inplace, D, B, T, H, D, 10000);
    assert_memory_equal(inplace, out, n * sizeof(real));

    // rope_backward applies the inverse rotation: backward(forward(x)) = x up to two rotations' rounding.
    real *back = ralloc(n);
    cpu_rope_backward(back, out, D, B, T, H, D, 10000);
    assert_true(opcheck_ratio_bound("rope backward(forward(x))", back, p.x, pair_bound(p.x, n, 8), n) <= 1.0);

    // Gradient: finite differences of the double forward and the analytic inverse rotation.
    real *dx = ralloc(n);
    cpu_rope_backward(dx, dout, D, B, T, H, D, 10000);
    double *fd = dalloc(n), *ref_dx = dalloc(n);
    opcheck_fd_grad(fd, p.x, n, FD_STEP, rope_loss, &p);
    ref_rope(ref_dx, p.dout, B, T, H, D, 10000, 1);
    assert_true(opcheck_ratio_d("rope ref dx vs fd", ref_dx, fd, n, FD_SLACK, 1e-7) <= 1.0);
    double *bound = pair_bound(p.dout, n, 4);
    for (size_t i = 0; i < n; i++) bound[i] += FD_SLACK;
    assert_true(opcheck_ratio_bound("rope dx vs analytic", dx, ref_dx, bound, n) <= 1.0);
    assert_true(opcheck_ratio_bound("rope dx vs fd", dx, fd, bound, n) <= 1.0);

    // rope_backward writes: over garbage, and in place (dinp = dout), the same bits as dx
    real *G = ralloc(n);
    opcheck_fill_nonzero(G, n, 602, 0.5, 3.0);
    cpu_rope_backward(G, dout, D, B, T, H, D, 10000);
    assert_memory_equal(G, dx, n * sizeof(real));
    memcpy(G, dout, n * sizeof(real));
    cpu_rope_backward(G, G, D, B, T, H, D, 10000);
    assert_memory_equal(G, dx, n * sizeof(real));

    check_rope_strided(x, out, 0, B, T, H, D);
    check_rope_strided(dout, dx, 1, B, T, H, D);
    tfree_all();
}

// Far positions: the angle t * theta^(-2j/D) must keep its phase (an angle formed in float would be
// off by ~t * 2^-24 rad, ~1e-4 at t = 4000, far outside this bound).
static void test_rope_large_positions(void **state) {
    (void)state;
    const int T = 4096, D = 8;
    const size_t n = (size_t)T * D;
    real *x = ralloc(n), *out = ralloc(n);
    opcheck_fill_nonzero(x, n, 650, 0.5, 1.0);
    cpu_rope_forward(out, x, D, 1, T, 1, D, 10000);
    double *dx = dcopy(x, n), *want = dalloc(n);
    ref_rope(want, dx, 1, T, 1, D, 10000, 0);
    assert_true(opcheck_ratio_bound("rope far positions", out, want, pair_bound(dx, n, 4), n) <= 1.0);
    tfree_all();
}

// ---------------------------------------------------------------------------- attention
// The op reads keys and values in MLA's layout (kernels.h): kv (B, T, H, Dn + Dv) = [k_nope ; v] per token and
// head, k_rope (B, T, Dr) shared by the heads. The double references below work on per-head keys (B, T, H, Dqk)
// and values (B, T, H, Dv), made from kv and k_rope here; the gradients go back the same way (d_k_rope = the sum
// of the heads' rope-key gradients).
static void expand_kv(double *k, double *v, const double *kv, const double *k_rope, int N, int H, int Dn, int Dr,
                      int Dv) {
    const int Dqk = Dn + Dr, ld = Dn + Dv;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const double *row = kv + ((size_t)n * H + h) * ld;
            double *kr = k + ((size_t)n * H + h) * Dqk, *vr = v + ((size_t)n * H + h) * Dv;
            for (int d = 0; d < Dn; d++) kr[d] = row[d];
            for (int d = 0; d < Dr; d++) kr[Dn + d] = k_rope[(size_t)n * Dr + d];
            for (int d = 0; d < Dv; d++) vr[d] = row[Dn + d];
        }
}
static void gather_kv_grad(double *d_kv, double *d_k_rope, const double *dk, const double *dv, int N, int H, int Dn,
                           int Dr, int Dv) {
    const int Dqk = Dn + Dr, ld = Dn + Dv;
    for (int n = 0; n < N; n++) {
        for (int d = 0; d < Dr; d++) d_k_rope[(size_t)n * Dr + d] = 0;
        for (int h = 0; h < H; h++) {
            double *row = d_kv + ((size_t)n * H + h) * ld;
            const double *kr = dk + ((size_t)n * H + h) * Dqk, *vr = dv + ((size_t)n * H + h) * Dv;
            for (int d = 0; d < Dn; d++) row[d] = kr[d];
            for (int d = 0; d < Dv; d++) row[Dn + d] = vr[d];
            for (int d = 0; d < Dr; d++) d_k_rope[(size_t)n * Dr + d] += kr[Dn + d];
        }
    }
}

typedef struct {
    double *q, *kv, *k_rope, *dout, *k, *v, *out, *att;
    int B, T, H, Dn, Dr, Dv;
} AttnProbe;
static double attention_loss(void *ctx) {
    AttnProbe *a = ctx;
    expand_kv(a->k, a->v, a->kv, a->k_rope, a->B * a->T, a->H, a->Dn, a->Dr, a->Dv);
    ref_attention(a->out, a->att, a->q, a->k, a->v, a->B, a->T, a->H, a->Dn + a->Dr, a->Dv);
    return ddot(a->out, a->dout, (size_t)a->B * a->T * a->H * a->Dv);
}

static void check_attention(int B, int T, int H, int Dn, int Dr, int Dv, uint64_t seed, int finite_differences) {
    const int Dqk = Dn + Dr, N = B * T;
    const size_t nqk = (size_t)N * H * Dqk, nkv = (size_t)N * H * (Dn + Dv), nr = (size_t)N * Dr;
    const size_t nv = (size_t)N * H * Dv, natt = (size_t)B * H * T * T;
    // the state: the probabilities (natt), then the operands' copies
    real *q = ralloc(nqk), *kv = ralloc(nkv), *k_rope = ralloc(nr), *out = ralloc(nv);
    real *att = ralloc((size_t)cpu_attention_state_elems(B, T, H, Dn, Dr, Dv)), *dout = ralloc(nv);
    opcheck_fill_nonzero(q, nqk, seed, 0.1, 1.5);
    // k_nope and v share kv: its elements are keys' and values' alike, |.| < 1.5 (the bounds below assume
    // |k| <= 1.5 and |v| <= 1.5)
    opcheck_fill_nonzero(kv, nkv, seed + 1, 0.1, 1.5);
    opcheck_fill_nonzero(k_rope, nr, seed + 2, 0.1, 1.5);
    opcheck_fill_nonzero(dout, nv, seed + 3, 0.1, 1.0);
    opcheck_fill(att, natt, seed + 4, 5, 6); // garbage above the diagonal must become 0
    cpu_attention_forward(out, att, q, kv, Dr > 0 ? k_rope : NULL, B, T, H, Dn, Dr, Dv);

    AttnProbe p = {dcopy(q, nqk), dcopy(kv, nkv), dcopy(k_rope, nr), dcopy(dout, nv), dalloc(nqk), dalloc(nv),
                   dalloc(nv), dalloc(natt), B, T, H, Dn, Dr, Dv};
    double *want = dalloc(nv), *want_att = dalloc(natt), *k = dalloc(nqk), *v = dalloc(nv);
    expand_kv(k, v, p.kv, p.k_rope, N, H, Dn, Dr, Dv);
    ref_attention(want, want_att, p.q, k, v, B, T, H, Dqk, Dv);
    // A score is a float dot product of Dqk terms |q k| <= 1.5^2, times 1/sqrt(Dqk): error at most
    // gamma_Dqk * Dqk * 2.25 / sqrt(Dqk) ~ 2.25 Dqk^1.5 u. A score error e moves a probability by at
    // most 2 e p; exp, the sum over <= T terms and the division add (T + 4) u relative. Outputs are
    // convex combinations of |v| <= 1.5 summed over <= T terms, adding 1.5 T u. Absolute bound on the
    // probabilities: tol = (2 * 2.25 Dqk^1.5 + 2 T + 16) u; on the outputs 1.5 tol (|v| <= 1.5 scales every
    // term of their error).
    const double tol = (2.0 * 2.25 * Dqk * sqrt((double)Dqk) + 2.0 * T + 16) * U;
    assert_true(opcheck_ratio("attention att", att, want_att, natt, tol, 0) <= 1.0);
    assert_true(opcheck_ratio("attention out", out, want, nv, 1.5 * tol, 0) <= 1.0);
    for (int bh = 0; bh < B * H; bh++)
        for (int t = 0; t < T; t++)
            for (int s = t + 1; s < T; s++) assert_true(att[((size_t)bh * T + t) * T + s] == 0);

    real *dq = ralloc(nqk), *d_kv = ralloc(nkv), *d_k_rope = ralloc(nr);
    cpu_attention_backward(dq, d_kv, d_k_rope, dout, att, B, T, H, Dn, Dr, Dv);
    double *ref_dq = dalloc(nqk), *ref_dk = dalloc(nqk), *ref_dv = dalloc(nv);
    double *ref_d_kv = dalloc(nkv), *ref_d_k_rope = dalloc(nr);
    ref_attention_backward(ref_dq, ref_dk, ref_dv, p.dout, p.q, k, v, B, T, H, Dqk, Dv);
    gather_kv_grad(ref_d_kv, ref_d_k_rope, ref_dk, ref_dv, N, H, Dn, Dr, Dv);
    // Gradients chain the forward error through further sums over T positions and D dims; measured
    // against the largest gradient entry with the forward budget scaled by 4 for those extra sums. d_kv holds
    // dk's nope part and dv, so it takes the looser of the two bounds. d_k_rope adds H heads' rope-key
    // gradients, each within atol_k, in H - 1 more roundings of at most u H max|dk| each.
    const double gtol = 4 * tol;
    const double atol_q = gtol * max_abs(ref_dq, nqk) + FD_SLACK, atol_k = gtol * max_abs(ref_dk, nqk) + FD_SLACK;
    const double atol_v = gtol * max_abs(ref_dv, nv) + FD_SLACK, atol_kv = fmax(atol_k, atol_v);
    const double atol_kr = H * atol_k + (double)H * H * U * max_abs(ref_dk, nqk);
    assert_true(opcheck_ratio("attention dq vs analytic", dq, ref_dq, nqk, atol_q, 0) <= 1.0);
    assert_true(opcheck_ratio("attention d_kv vs analytic", d_kv, ref_d_kv, nkv, atol_kv, 0) <= 1.0);
    assert_true(opcheck_ratio("attention d_k_rope vs analytic", d_k_rope, ref_d_k_rope, nr, atol_kr, 0) <= 1.0);
    if (finite_differences) {
        double *fd_q = dalloc(nqk), *fd_kv = dalloc(nkv), *fd_kr = dalloc(nr);
        opcheck_fd_grad(fd_q, p.q, nqk, FD_STEP, attention_loss, &p);
        opcheck_fd_grad(fd_kv, p.kv, nkv, FD_STEP, attention_loss, &p);
        opcheck_fd_grad(fd_kr, p.k_rope, nr, FD_STEP, attention_loss, &p);
        assert_true(opcheck_ratio_d("attention ref dq vs fd", ref_dq, fd_q, nqk, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio_d("attention ref d_kv vs fd", ref_d_kv, fd_kv, nkv, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio_d("attention ref d_k_rope vs fd", ref_d_k_rope, fd_kr, nr, FD_SLACK, 1e-7) <= 1.0);
        assert_true(opcheck_ratio("attention dq vs fd", dq, fd_q, nqk, atol_q, 0) <= 1.0);
        assert_true(opcheck_ratio("attention d_kv vs fd", d_kv, fd_kv, nkv, atol_kv, 0) <= 1.0);
        assert_true(opcheck_ratio("attention d_k_rope vs fd", d_k_rope, fd_kr, nr, atol_kr, 0) <= 1.0);
    }

    // The gradients are written: over garbage, the same bits as before; and each NULL combination leaves
    // the others unchanged.
    real *w_q = ralloc(nqk), *w_kv = ralloc(nkv), *w_kr = ralloc(nr);
    opcheck_fill_nonzero(w_q, nqk, seed + 5, 0.5, 3.0);
    opcheck_fill_nonzero(w_kv, nkv, seed + 6, 0.5, 3.0);
    opcheck_fill_nonzero(w_kr, nr, seed + 7, 0.5, 3.0);
    cpu_attention_backward(w_q, w_kv, w_kr, dout, att, B, T, H, Dn, Dr, Dv);
    assert_memory_equal(w_q, dq, nqk * sizeof(real));
    assert_memory_equal(w_kv, d_kv, nkv * sizeof(real));
    if (nr > 0) assert_memory_equal(w_kr, d_k_rope, nr * sizeof(real));
    real *only_q = ralloc(nqk), *only_kv = ralloc(nkv), *only_kr = ralloc(nr);
    cpu_attention_backward(only_q, NULL, NULL, dout, att, B, T, H, Dn, Dr, Dv);
    cpu_attention_backward(NULL, only_kv, NULL, dout, att, B, T, H, Dn, Dr, Dv);
    cpu_attention_backward(NULL, NULL, only_kr, dout, att, B, T, H, Dn, Dr, Dv);
    assert_memory_equal(only_q, dq, nqk * sizeof(real));
    assert_memory_equal(only_kv, d_kv, nkv * sizeof(real));
    if (nr > 0) assert_memory_equal(only_kr, d_k_rope, nr * sizeof(real));
    tfree_all();
}

static void test_attention(void **state) {
    (void)state;
    check_attention(2, 4, 2, 2, 2, 2, 700, 1);
    check_attention(1, 6, 3, 3, 2, 4, 710, 1);
    check_attention(2, 33, 3, 16, 8, 16, 720, 0);
    check_attention(1, 1, 1, 2, 2, 3, 730, 1);  // a single position attends only to itself
    check_attention(2, 5, 3, 0, 4, 3, 740, 1);  // no nope part: every key is the shared rope key
    check_attention(1, 5, 2, 5, 0, 3, 750, 1);  // no rope part (k_rope NULL, d_k_rope untouched)
}

// ---------------------------------------------------------------------------- attention: the per-head formulation
// The op must give bitwise what MLA computed before it read its layout directly: keys [k_nope ; k_rope broadcast]
// and values copied into per-head arrays, the attention core run on those, and the gradients gathered back - d_kv
// copied from dk's nope part and dv, d_k_rope the heads' rope-key gradients added to a zeroed buffer one head at a
// time in head order (the old copy_block / broadcast_rows / sum_row_groups glue). The reference here is that
// formulation written out plainly in `real`, one head at a time, in the op's arithmetic order (each score summed
// over d, each output and gradient summed over t2 or t, in increasing order from 0; the same roundings), so
// equality is exact: tolerance 0, bitwise, because the op only changed where it reads and writes, not what it
// computes.
//
// exp and sqrt of a float as the op takes them (kernels/cpu/attention.c calls them through <tgmath.h>); this file
// is built with real = float only.
_Static_assert(sizeof(real) == sizeof(float), "per_head_attention calls the float functions the op calls");
static void per_head_attention(real *out, real *att, real *dq, real *dk, real *dv, const real *q, const real *k,
                               const real *v, const real *dout, int B, int T, int H, int Dqk, int Dv) {
    const real scale = (real)1 / sqrtf((real)Dqk);
    real *datt = malloc(sizeof(real) * (size_t)T);
    assert_non_null(datt);
    memset(dk, 0, sizeof(real) * (size_t)B * T * H * Dqk);
    memset(dv, 0, sizeof(real) * (size_t)B * T * H * Dv);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                real *p = att + (((size_t)b * H + h) * T + t) * T;
                real mx = -INFINITY, sum = 0;
                for (int s = 0; s <= t; s++) {
                    real dot = 0;
                    for (int d = 0; d < Dqk; d++) dot += AT(q, b, t, h, Dqk)[d] * AT(k, b, s, h, Dqk)[d];
                    p[s] = dot * scale;
                    if (p[s] > mx) mx = p[s];
                }
                for (int s = 0; s <= t; s++) {
                    p[s] = expf(p[s] - mx);
                    sum += p[s];
                }
                for (int s = 0; s < T; s++) p[s] = s <= t ? p[s] / sum : 0;
                for (int d = 0; d < Dv; d++) {
                    real o = 0;
                    for (int s = 0; s <= t; s++) o += p[s] * AT(v, b, s, h, Dv)[d];
                    AT(out, b, t, h, Dv)[d] = o;
                }
                // backward of this query row: dv and dk collect over t in increasing order
                const real *g = AT(dout, b, t, h, Dv);
                real pdot = 0;
                for (int s = 0; s <= t; s++) {
                    for (int d = 0; d < Dv; d++) AT(dv, b, s, h, Dv)[d] += p[s] * g[d];
                    real a = 0;
                    for (int d = 0; d < Dv; d++) a += g[d] * AT(v, b, s, h, Dv)[d];
                    datt[s] = a;
                }
                for (int s = 0; s <= t; s++) pdot += p[s] * datt[s];
                for (int s = 0; s <= t; s++) datt[s] = (p[s] * (datt[s] - pdot)) * scale;  // dscore
                for (int d = 0; d < Dqk; d++) {
                    real acc = 0;
                    for (int s = 0; s <= t; s++) acc += datt[s] * AT(k, b, s, h, Dqk)[d];
                    AT(dq, b, t, h, Dqk)[d] = acc;
                }
                for (int s = 0; s <= t; s++)
                    for (int d = 0; d < Dqk; d++) AT(dk, b, s, h, Dqk)[d] += datt[s] * AT(q, b, t, h, Dqk)[d];
            }
    free(datt);
}

static void check_attention_per_head(int B, int T, int H, int Dn, int Dr, int Dv, uint64_t seed) {
    const int Dqk = Dn + Dr, N = B * T, ld = Dn + Dv;
    const size_t nqk = (size_t)N * H * Dqk, nkv = (size_t)N * H * ld, nr = (size_t)N * Dr;
    const size_t nv = (size_t)N * H * Dv, natt = (size_t)B * H * T * T;
    real *q = ralloc(nqk), *kv = ralloc(nkv), *k_rope = ralloc(nr), *dout = ralloc(nv);
    opcheck_fill_nonzero(q, nqk, seed, 0.1, 2.0);
    opcheck_fill_nonzero(kv, nkv, seed + 1, 0.1, 1.5);
    opcheck_fill_nonzero(k_rope, nr, seed + 2, 0.1, 1.5);
    opcheck_fill_nonzero(dout, nv, seed + 3, 0.1, 1.0);
    // the old formulation: per-head copies of the keys (the rope key broadcast to every head) and values, the core
    // on them
    real *k = ralloc(nqk), *v = ralloc(nv);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const real *row = kv + ((size_t)n * H + h) * ld;
            memcpy(k + ((size_t)n * H + h) * Dqk, row, sizeof(real) * (size_t)Dn);
            memcpy(k + ((size_t)n * H + h) * Dqk + Dn, k_rope + (size_t)n * Dr, sizeof(real) * (size_t)Dr);
            memcpy(v + ((size_t)n * H + h) * Dv, row + Dn, sizeof(real) * (size_t)Dv);
        }
    real *want_out = ralloc(nv), *want_att = ralloc(natt), *want_dq = ralloc(nqk), *dk = ralloc(nqk),
         *dv = ralloc(nv);
    per_head_attention(want_out, want_att, want_dq, dk, dv, q, k, v, dout, B, T, H, Dqk, Dv);
    // and its gradients gathered back: d_kv = [dk_nope ; dv]; d_k_rope zeroed, then each head's rope gradient
    // added in head order (one rounded addition per head)
    real *want_d_kv = ralloc(nkv), *want_d_k_rope = ralloc(nr), *reversed = ralloc(nr);
    for (int n = 0; n < N; n++) {
        for (int h = 0; h < H; h++) {
            real *row = want_d_kv + ((size_t)n * H + h) * ld;
            memcpy(row, dk + ((size_t)n * H + h) * Dqk, sizeof(real) * (size_t)Dn);
            memcpy(row + Dn, dv + ((size_t)n * H + h) * Dv, sizeof(real) * (size_t)Dv);
        }
        for (int d = 0; d < Dr; d++) want_d_k_rope[(size_t)n * Dr + d] = reversed[(size_t)n * Dr + d] = 0;
        for (int h = 0; h < H; h++)
            for (int d = 0; d < Dr; d++) {
                want_d_k_rope[(size_t)n * Dr + d] += dk[((size_t)n * H + h) * Dqk + Dn + d];
                reversed[(size_t)n * Dr + d] += dk[((size_t)n * H + (H - 1 - h)) * Dqk + Dn + d];
            }
    }

    // the op on MLA's layout; gradients over NaN poison (an element not written stays NaN and differs)
    real *out = nan_ralloc(nv), *att = nan_ralloc((size_t)cpu_attention_state_elems(B, T, H, Dn, Dr, Dv)),
         *dq = nan_ralloc(nqk), *d_kv = nan_ralloc(nkv),
         *d_k_rope = nan_ralloc(nr);
    cpu_attention_forward(out, att, q, kv, Dr > 0 ? k_rope : NULL, B, T, H, Dn, Dr, Dv);
    cpu_attention_backward(dq, d_kv, d_k_rope, dout, att, B, T, H, Dn, Dr, Dv);
    assert_memory_equal(out, want_out, nv * sizeof(real));
    assert_memory_equal(att, want_att, natt * sizeof(real));
    assert_memory_equal(dq, want_dq, nqk * sizeof(real));
    assert_memory_equal(d_kv, want_d_kv, nkv * sizeof(real));
    if (nr > 0) assert_memory_equal(d_k_rope, want_d_k_rope, nr * sizeof(real));
    // The inputs tell orders apart (heads summed in reverse give other bits), so the check above really pins
    // head order 0, 1, ..., H-1 wherever there are three or more heads.
    if (H >= 3 && nr >= 8) assert_memory_not_equal(reversed, want_d_k_rope, nr * sizeof(real));
    tfree_all();
}

static void test_attention_per_head_bitwise(void **state) {
    (void)state;
    check_attention_per_head(2, 9, 4, 8, 4, 6, 1400);    // an MLA-like split: nope, rope and v all present
    check_attention_per_head(1, 33, 16, 16, 8, 16, 1410); // many heads, and large enough to open the parallel regions
    check_attention_per_head(2, 7, 3, 5, 3, 7, 1420);    // odd head dims
    check_attention_per_head(1, 6, 3, 0, 6, 4, 1430);    // Dn = 0
    check_attention_per_head(2, 6, 2, 6, 0, 5, 1440);    // Dr = 0
}

// attention_forward_bf16 on BF16 products (rows at strides of their own, pad values apart) gives the bits of
// widening them, rope_forward on the query's rope part and attention_forward: out and the whole state (its
// probabilities and the operands' copies the backward reads). The rotation must really happen (Dr > 0): the state's
// query then differs from the plain widened one. attention_backward_bf16 gives attention_backward's gradients on
// the widened dout.
static void check_attention_bf16_products(int B, int T, int H, int Dn, int Dr, int Dv, int pad, uint64_t seed) {
    const int Dqk = Dn + Dr, ld = Dn + Dv, N = B * T;
    const int64_t ldq = (int64_t)H * Dqk + pad, ldkv = (int64_t)H * ld + pad;
    const size_t nqk = (size_t)N * H * Dqk, nkv = (size_t)N * H * ld, nr = (size_t)N * Dr, nv = (size_t)N * H * Dv;
    const size_t nstate = (size_t)cpu_attention_state_elems(B, T, H, Dn, Dr, Dv);
    const real theta = 10000;
    // the products: random values rounded to BF16, written row by row at their strides (the pads left random too)
    real *src_q = ralloc((size_t)N * ldq), *src_kv = ralloc((size_t)N * ldkv), *k_rope = ralloc(nr);
    opcheck_fill_nonzero(src_q, (size_t)N * ldq, seed, 0.1, 2.0);
    opcheck_fill_nonzero(src_kv, (size_t)N * ldkv, seed + 1, 0.1, 1.5);
    opcheck_fill_nonzero(k_rope, nr, seed + 2, 0.1, 1.5);
    uint16_t *q16 = talloc(sizeof(uint16_t) * (size_t)N * ldq), *kv16 = talloc(sizeof(uint16_t) * (size_t)N * ldkv);
    cpu_bf16_round_array(q16, src_q, (int64_t)N * ldq);
    cpu_bf16_round_array(kv16, src_kv, (int64_t)N * ldkv);
    // the unfused path
    real *q = ralloc(nqk), *q_plain = ralloc(nqk), *kv = ralloc(nkv);
    for (int n = 0; n < N; n++) {
        cpu_bf16_widen_array(q + (size_t)n * H * Dqk, q16 + n * ldq, (int64_t)H * Dqk);
        cpu_bf16_widen_array(kv + (size_t)n * H * ld, kv16 + n * ldkv, (int64_t)H * ld);
    }
    memcpy(q_plain, q, nqk * sizeof(real));
    if (Dr > 0) cpu_rope_forward(q + Dn, q + Dn, Dqk, B, T, H, Dr, theta);
    real *want_out = nan_ralloc(nv), *want_state = nan_ralloc(nstate);
    cpu_attention_forward(want_out, want_state, q, kv, Dr > 0 ? k_rope : NULL, B, T, H, Dn, Dr, Dv);
    // the fused op, over NaN poison
    real *out = nan_ralloc(nv), *state = nan_ralloc(nstate);
    cpu_attention_forward_bf16(out, state, q16, ldq, kv16, ldkv, Dr > 0 ? k_rope : NULL, B, T, H, Dn, Dr, Dv, theta);
    assert_memory_equal(out, want_out, nv * sizeof(real));
    assert_memory_equal(state, want_state, nstate * sizeof(real));
    if (Dr > 0) assert_memory_not_equal(q, q_plain, nqk * sizeof(real));
    // the backward on a BF16 dout at a padded row stride: the gradients of the widened dout, bit for bit
    const int64_t ldo = (int64_t)H * Dv + pad;
    real *src_do = ralloc((size_t)N * ldo), *dout = ralloc(nv);
    opcheck_fill_nonzero(src_do, (size_t)N * ldo, seed + 3, 0.1, 1.0);
    uint16_t *dout16 = talloc(sizeof(uint16_t) * (size_t)N * ldo);
    cpu_bf16_round_array(dout16, src_do, (int64_t)N * ldo);
    for (int n = 0; n < N; n++) cpu_bf16_widen_array(dout + (size_t)n * H * Dv, dout16 + n * ldo, (int64_t)H * Dv);
    real *want_dq = nan_ralloc(nqk), *want_dkv = nan_ralloc(nkv), *want_dkr = nan_ralloc(nr);
    real *dq = nan_ralloc(nqk), *dkv = nan_ralloc(nkv), *dkr = nan_ralloc(nr);
    cpu_attention_backward(want_dq, want_dkv, want_dkr, dout, want_state, B, T, H, Dn, Dr, Dv);
    cpu_attention_backward_bf16(dq, dkv, dkr, dout16, ldo, state, B, T, H, Dn, Dr, Dv);
    assert_memory_equal(dq, want_dq, nqk * sizeof(real));
    assert_memory_equal(dkv, want_dkv, nkv * sizeof(real));
    if (nr > 0) assert_memory_equal(dkr, want_dkr, nr * sizeof(real));
    tfree_all();
}

static void test_attention_bf16_products(void **state) {
    (void)state;
    check_attention_bf16_products(2, 9, 3, 8, 4, 6, 5, 1500);  // MLA-like, rows padded
    check_attention_bf16_products(1, 7, 2, 0, 6, 4, 0, 1510);  // Dn = 0: the whole query rotated
    check_attention_bf16_products(2, 5, 2, 6, 0, 5, 3, 1520);  // Dr = 0: no rotation
    check_attention_bf16_products(1, 12, 4, 5, 2, 3, 1, 1530); // odd Dn: the pairs start at an odd column
}

// Changing the query, key and value of position tf may not change anything at earlier positions:
// outputs and probability rows for t < tf stay bitwise identical, and position tf itself changes.
static void test_attention_causal(void **state) {
    (void)state;
    const int B = 2, T = 9, H = 2, Dn = 4, Dr = 2, Dv = 5, Dqk = Dn + Dr, ld = Dn + Dv, tf = 5;
    const size_t nqk = (size_t)B * T * H * Dqk, nkv = (size_t)B * T * H * ld, nr = (size_t)B * T * Dr;
    const size_t nv = (size_t)B * T * H * Dv;
    real *q = ralloc(nqk), *kv = ralloc(nkv), *k_rope = ralloc(nr);
    const size_t nstate = (size_t)cpu_attention_state_elems(B, T, H, Dn, Dr, Dv);
    real *out1 = ralloc(nv), *att1 = ralloc(nstate), *out2 = ralloc(nv), *att2 = ralloc(nstate);
    opcheck_fill_nonzero(q, nqk, 750, 0.1, 1.5);
    opcheck_fill_nonzero(kv, nkv, 751, 0.1, 1.5);
    opcheck_fill_nonzero(k_rope, nr, 752, 0.1, 1.5);
    cpu_attention_forward(out1, att1, q, kv, k_rope, B, T, H, Dn, Dr, Dv);
    for (int b = 0; b < B; b++)
        for (int t = tf; t < T; t++) {
            // the future rows get fresh random values (of the same kind)
            opcheck_fill_nonzero(AT(q, b, t, 0, Dqk), (size_t)H * Dqk, 760 + 10 * b + t, 0.1, 1.5);
            opcheck_fill_nonzero(AT(kv, b, t, 0, ld), (size_t)H * ld, 860 + 10 * b + t, 0.1, 1.5);
            opcheck_fill_nonzero(k_rope + ((size_t)b * T + t) * Dr, (size_t)Dr, 960 + 10 * b + t, 0.1, 1.5);
        }
    cpu_attention_forward(out2, att2, q, kv, k_rope, B, T, H, Dn, Dr, Dv);
    for (int b = 0; b < B; b++) {
        assert_memory_equal(AT(out1, b, 0, 0, Dv), AT(out2, b, 0, 0, Dv), (size_t)tf * H * Dv * sizeof(real));
        assert_memory_not_equal(AT(out1, b, tf, 0, Dv), AT(out2, b, tf, 0, Dv), (size_t)H * Dv * sizeof(real));
        for (int h = 0; h < H; h++) {
            const size_t row0 = ((size_t)b * H + h) * T * T;
            assert_memory_equal(att1 + row0, att2 + row0, (size_t)tf * T * sizeof(real));
        }
    }
    tfree_all();
}

// ---------------------------------------------------------------------------- cross-entropy
typedef struct {
    double *logits, *losses, *probs;
    const int *targets;
    double dloss;
    int N, V;
} CeProbe;
static double crossentropy_loss(void *ctx) {
    CeProbe *c = ctx;
    ref_crossentropy(c->losses, c->probs, c->logits, c->targets, c->N, c->V);
    double s = 0;
    for (int n = 0; n < c->N; n++) s += c->dloss * c->losses[n];
    return s;
}

static void check_crossentropy(int N, int V, uint64_t seed) {
    const size_t nl = (size_t)N * V;
    real *logits = ralloc(nl), *probs = ralloc(nl), *losses = ralloc(N), *dlogits = ralloc(nl);
    int *targets = ialloc(N);
    opcheck_fill_nonzero(logits, nl, seed, 0.1, 4.0);
    opcheck_fill_int(targets, N, seed + 1, 0, V);
    targets[1] = -1; // masked rows
    targets[N - 1] = -1;
    int n_valid = 0;
    for (int n = 0; n < N; n++) n_valid += targets[n] >= 0;
    opcheck_fill(losses, N, seed + 2, 5, 6); // garbage the forward must overwrite
    cpu_crossentropy_forward(losses, probs, logits, targets, N, V);

    CeProbe p = {dcopy(logits, nl), dalloc(N), dalloc(nl), targets, 1.0 / n_valid, N, V};
    double *want_losses = dalloc(N), *want_probs = dalloc(nl);
    ref_crossentropy(want_losses, want_probs, p.logits, targets, N, V);
    // Each probability is exp(x - max) / sum: exp, the sum of V terms <= 1 (relative gamma_V) and a
    // division, rtol (V + 4) u. The loss log(sum) + max - x[target] has absolute error about
    // (V + 4) u (from log of the sum) plus u times the magnitudes |max|, |x[target]| <= 4.
    assert_true(opcheck_ratio("crossentropy probs", probs, want_probs, nl, 0, (V + 4) * U) <= 1.0);
    assert_true(opcheck_ratio("crossentropy losses", losses, want_losses, N, (V + 4 + 3 * 8) * U, 0) <= 1.0);
    assert_true(losses[1] == 0 && losses[N - 1] == 0);

    // backward WRITES: the garbage in dlogits must not leak into the result.
    opcheck_fill(dlogits, nl, seed + 3, 5, 6);
    const real dloss = (real)(1.0 / n_valid);
    cpu_crossentropy_backward(dlogits, probs, targets, dloss, N, V);
    double *fd = dalloc(nl), *ref_d = dalloc(nl);
    opcheck_fd_grad(fd, p.logits, nl, FD_STEP, crossentropy_loss, &p);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < V; i++)
            ref_d[n * V + i] = targets[n] < 0 ? 0.0 : (want_probs[n * V + i] - (i == targets[n])) * (double)dloss;
    assert_true(opcheck_ratio_d("crossentropy ref dlogits vs fd", ref_d, fd, nl, FD_SLACK, 1e-7) <= 1.0);
    // (p - onehot) * dloss: the probability's error plus two roundings.
    const double atol = (V + 8) * U * (double)dloss + FD_SLACK;
    assert_true(opcheck_ratio("crossentropy dlogits vs analytic", dlogits, ref_d, nl, atol, (V + 8) * U) <= 1.0);
    assert_true(opcheck_ratio("crossentropy dlogits vs fd", dlogits, fd, nl, atol, (V + 8) * U) <= 1.0);
    for (int i = 0; i < V; i++) assert_true(dlogits[1 * V + i] == 0 && dlogits[(size_t)(N - 1) * V + i] == 0);

    // in place (kernels.h: probs may be logits, dlogits may be probs): bitwise the out-of-place results
    real *inplace = ralloc(nl), *losses2 = ralloc(N);
    memcpy(inplace, logits, nl * sizeof(real));
    cpu_crossentropy_forward(losses2, inplace, inplace, targets, N, V);
    assert_memory_equal(inplace, probs, nl * sizeof(real));
    assert_memory_equal(losses2, losses, (size_t)N * sizeof(real));
    cpu_crossentropy_backward(inplace, inplace, targets, dloss, N, V);
    assert_memory_equal(inplace, dlogits, nl * sizeof(real));

    tfree_all();
}

static void test_crossentropy(void **state) {
    (void)state;
    check_crossentropy(6, 11, 800);
    check_crossentropy(5, 65, 810);
    check_crossentropy(3, 1000, 820);
}

// The output head's BF16 form (kernels.h crossentropy_*_bf16, bf16_matmul_*_bf16) against the FP32 forms on the
// same values: the head GEMM's product rounded to BF16 is what both read, and every result must have the FP32
// form's bits (the losses, the probabilities from the kept row statistics, the gradient rounded to BF16 as
// bf16_matmul_backward rounds it, and the head's input and weight gradients).
static void check_head_bf16(int N, int D, int V, uint64_t seed) {
    const size_t nl = (size_t)N * V;
    real *h = ralloc((size_t)N * D), *w = ralloc((size_t)V * D), *logits = ralloc(nl), *probs = ralloc(nl);
    real *losses = ralloc(N), *losses16 = ralloc(N), *row_max = ralloc(N), *probs16 = ralloc(nl);
    double *row_sum = talloc((size_t)N * sizeof(double));
    uint16_t *logits16 = talloc(nl * sizeof(uint16_t)), *dlogits16 = talloc(nl * sizeof(uint16_t));
    int *targets = ialloc(N);
    opcheck_fill_nonzero(h, (size_t)N * D, seed, 0.1, 2.0);
    opcheck_fill_nonzero(w, (size_t)V * D, seed + 1, 0.1, 2.0);
    opcheck_fill_int(targets, N, seed + 2, 0, V);
    targets[1] = -1;
    cpu_bf16_matmul_forward(logits, h, w, N, D, V);
    cpu_bf16_matmul_forward_bf16(logits16, h, w, N, D, V);
    for (size_t i = 0; i < nl; i++) assert_true(logits16[i] == float_to_bf16((float)logits[i]));
    for (size_t i = 0; i < nl; i++) assert_true((real)bf16_to_float(logits16[i]) == logits[i]);

    cpu_crossentropy_forward(losses, probs, logits, targets, N, V);
    opcheck_fill(losses16, N, seed + 3, 5, 6);  // garbage the forward must overwrite
    cpu_crossentropy_forward_bf16(losses16, row_max, row_sum, logits16, targets, N, V);
    assert_memory_equal(losses16, losses, (size_t)N * sizeof(real));
    cpu_crossentropy_probs_bf16(probs16, logits16, row_max, row_sum, N, V);
    assert_memory_equal(probs16, probs, nl * sizeof(real));

    const real dloss = (real)0.37;
    real *dlogits = ralloc(nl);
    cpu_crossentropy_backward(dlogits, probs, targets, dloss, N, V);
    memcpy(dlogits16, logits16, nl * sizeof(uint16_t));  // in place, as the head runs it
    cpu_crossentropy_backward_bf16(dlogits16, dlogits16, row_max, row_sum, targets, dloss, N, V);
    for (size_t i = 0; i < nl; i++) assert_true(dlogits16[i] == float_to_bf16((float)dlogits[i]));

    real *dh = ralloc((size_t)N * D), *dw = ralloc((size_t)V * D), *dh16 = ralloc((size_t)N * D);
    real *dw16 = ralloc((size_t)V * D);
    opcheck_fill(dh, (size_t)N * D, seed + 4, 0.1, 1.0);  // both accumulate into the same starting values
    opcheck_fill(dw, (size_t)V * D, seed + 5, 0.1, 1.0);
    memcpy(dh16, dh, (size_t)N * D * sizeof(real));
    memcpy(dw16, dw, (size_t)V * D * sizeof(real));
    cpu_bf16_matmul_backward(dh, dw, dlogits, h, w, N, D, V);
    cpu_bf16_matmul_backward_bf16(dh16, dw16, dlogits16, h, w, N, D, V);
    assert_memory_equal(dh16, dh, (size_t)N * D * sizeof(real));
    assert_memory_equal(dw16, dw, (size_t)V * D * sizeof(real));
    tfree_all();
}

static void test_head_bf16(void **state) {
    (void)state;
    check_head_bf16(6, 16, 11, 830);
    check_head_bf16(5, 24, 300, 840);
}

// ---------------------------------------------------------------------------- determinism
// Runs every op once with `threads` OpenMP threads on fixed inputs (large enough that each op opens
// its parallel region) and returns the concatenated outputs.
typedef struct {
    real *data;
    size_t n;
} Outputs;

static void append(Outputs *o, const real *x, size_t n) {
    memcpy(o->data + o->n, x, n * sizeof(real));
    o->n += n;
}

enum { DET_N = 150, DET_C = 64, DET_OC = 100, DET_V = 300, DET_B = 2, DET_T = 40, DET_H = 3 };
// attention: B H T^2 (Dqk + Dv) = 6.6M (threshold 65k), and the heads' sum of the rope-key gradients
// B T Dr H = 73.7k (threshold 65k)
enum { DET_AB = 1, DET_AT = 72, DET_AH = 16, DET_DN = 8, DET_DR = 64, DET_DV = 8 };

static void run_all_ops(Outputs *o, int threads) {
    omp_set_num_threads(threads);
    // matmul: 960k multiply-adds per product (its parallel threshold is 32k)
    const size_t ni = (size_t)DET_N * DET_C, nw = (size_t)DET_OC * DET_C, no = (size_t)DET_N * DET_OC;
    real *inp = ralloc(ni), *w = ralloc(nw), *out = ralloc(no), *dinp = ralloc(ni), *dw = ralloc(nw);
    opcheck_fill_nonzero(inp, ni, 900, 0.1, 1.0);
    opcheck_fill_nonzero(w, nw, 901, 0.1, 1.0);
    cpu_matmul_forward(out, inp, w, DET_N, DET_C, DET_OC);
    cpu_matmul_backward(dinp, dw, out, inp, w, DET_N, DET_C, DET_OC);
    append(o, out, no); append(o, dinp, ni); append(o, dw, nw);

    // row-wise and element-wise ops on R x C = 90k elements (their parallel threshold is 16k)
    const int R = DET_V, C = DET_V, V_EMB = 17;
    const size_t nr = (size_t)R * C;
    real *x = ralloc(nr), *g = ralloc(nr), *rw = ralloc(C);
    opcheck_fill_nonzero(x, nr, 902, 0.1, 2.0);
    opcheck_fill_nonzero(g, nr, 903, 0.1, 1.0);
    opcheck_fill_nonzero(rw, C, 904, 0.5, 1.5);

    real *y = ralloc(nr), *rstd = ralloc(R), *dx = ralloc(nr), *drw = ralloc(C);
    cpu_rmsnorm_forward(y, rstd, x, rw, R, C);
    cpu_rmsnorm_backward(dx, drw, g, x, rw, rstd, R, C);
    append(o, y, nr); append(o, rstd, R); append(o, dx, nr); append(o, drw, C);

    real *s = ralloc(nr), *da = ralloc(nr), *db = ralloc(nr);
    cpu_swiglu_forward(s, x, g, (int64_t)nr);
    cpu_swiglu_backward(da, db, y, x, g, (int64_t)nr);
    append(o, s, nr); append(o, da, nr); append(o, db, nr);

    int *targets = ialloc(R);
    opcheck_fill_int(targets, R, 905, -1, C);
    real *losses = ralloc(R), *probs = ralloc(nr), *dlogits = ralloc(nr);
    cpu_crossentropy_forward(losses, probs, x, targets, R, C);
    cpu_crossentropy_backward(dlogits, probs, targets, (real)0.01, R, C);
    append(o, losses, R); append(o, probs, nr); append(o, dlogits, nr);

    int *tokens = ialloc(R);
    opcheck_fill_int(tokens, R, 906, 0, V_EMB); // many repeats: the table gradient sums rows
    real *table = ralloc((size_t)V_EMB * C), *emb = ralloc(nr), *dtable = ralloc((size_t)V_EMB * C);
    opcheck_fill_nonzero(table, (size_t)V_EMB * C, 907, 0.1, 1.0);
    cpu_embedding_forward(emb, tokens, table, R, C);
    cpu_embedding_backward(dtable, g, tokens, R, C);
    append(o, emb, nr); append(o, dtable, (size_t)V_EMB * C);

    // RoPE on (B, T, H, 96) = 23k elements
    const size_t nrope = (size_t)DET_B * DET_T * DET_H * 96;
    real *rot = ralloc(nrope), *drot = ralloc(nrope);
    cpu_rope_forward(rot, x, 96, DET_B, DET_T, DET_H, 96, 10000);
    cpu_rope_backward(drot, g, 96, DET_B, DET_T, DET_H, 96, 10000);
    append(o, rot, nrope); append(o, drot, nrope);

    // attention (sizes above); q is a slice of x, kv, k_rope and dout slices of g
    const size_t an = (size_t)DET_AB * DET_AT, nqk = an * DET_AH * (DET_DN + DET_DR);
    const size_t nkv = an * DET_AH * (DET_DN + DET_DV), nkr = an * DET_DR, nv = an * DET_AH * DET_DV;
    const size_t natt = (size_t)DET_AB * DET_AH * DET_AT * DET_AT;
    real *att = ralloc((size_t)cpu_attention_state_elems(DET_AB, DET_AT, DET_AH, DET_DN, DET_DR, DET_DV));
    real *ao = ralloc(nv), *dq = ralloc(nqk), *d_kv = ralloc(nkv), *d_kr = ralloc(nkr);
    const real *kv = g, *k_rope = g + nkv, *dout = g + nkv + nkr;
    cpu_attention_forward(ao, att, x, kv, k_rope, DET_AB, DET_AT, DET_AH, DET_DN, DET_DR, DET_DV);
    cpu_attention_backward(dq, d_kv, d_kr, dout, att, DET_AB, DET_AT, DET_AH, DET_DN, DET_DR, DET_DV);
    append(o, ao, nv); append(o, att, natt); append(o, dq, nqk); append(o, d_kv, nkv); append(o, d_kr, nkr);
}

static void test_deterministic_across_threads(void **state) {
    (void)state;
    const int saved = omp_get_max_threads();
    const size_t cap = 4 * 1000 * 1000;
    Outputs one = {ralloc(cap), 0}, two = {ralloc(cap), 0}, three = {ralloc(cap), 0};
    run_all_ops(&one, 1);
    run_all_ops(&two, 2);
    run_all_ops(&three, 3);
    omp_set_num_threads(saved);
    assert_true(one.n > 0 && one.n <= cap && one.n == two.n && one.n == three.n);
    assert_memory_equal(one.data, two.data, one.n * sizeof(real));
    assert_memory_equal(one.data, three.data, one.n * sizeof(real));
    tfree_all();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_forward),
        cmocka_unit_test(test_matmul_backward),
        cmocka_unit_test(test_matmul_backward_accumulates),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_rope_hand_worked),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_rope_large_positions),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_per_head_bitwise),
        cmocka_unit_test(test_attention_causal),
        cmocka_unit_test(test_attention_bf16_products),
        cmocka_unit_test(test_crossentropy),
        cmocka_unit_test(test_head_bf16),
        cmocka_unit_test(test_deterministic_across_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
