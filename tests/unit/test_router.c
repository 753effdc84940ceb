/*
 * test_router.c - unit tests of the MoE router and the sequence-wise balance loss
 * (kernels/cpu/router.c, contracts in kernels/kernels.h, numerics in DESIGN.md section 3).
 *
 * Routing cases are worked by hand in the comments; each builds logits from chosen scores
 * (logit = log(s / (1 - s))) or uses logit 0 (score exactly 0.5) with exactly representable biases.
 * A brute-force double-precision reference (sort by value, then index) checks many random tokens,
 * and the backward passes are checked against central finite differences with routing frozen.
 */
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/cpu/cpu_ops.h"

// ---------------------------------------------------------------------------- helpers
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double rand_uniform(double lo, double hi) {  // splitmix64 -> [lo, hi)
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * (1.0 / 9007199254740992.0);
}
static real logit_of(double s) { return (real)log(s / (1.0 - s)); }
static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

#define ASSERT_NEAR(actual, expected, tol)                                                          \
    do {                                                                                            \
        double a_ = (double)(actual), e_ = (double)(expected);                                      \
        if (!(fabs(a_ - e_) <= (tol))) fail_msg("%s = %.9g, expected %.9g (tol %.2g)", #actual, a_, e_, \
                                                (double)(tol));                                     \
    } while (0)

// One token through the router; returns nothing, fills idx (K) and w (K).
static void route_one(int *idx, real *w, const real *logits, const real *bias, int E, int K, int n_groups,
                      int n_limited, real route_scale) {
    real scores[64];
    cpu_router_forward(idx, w, scores, logits, bias, 1, E, K, n_groups, n_limited, route_scale, 0);
}

// ---------------------------------------------------------------------------- routing, hand cases
// E = 4, groups {0,1} {2,3}, keep 1 group, K = 2, route_scale 2.5.
//   s      = [0.6, 0.5, 0.4, 0.45]       unbiased group sums: g0 = 1.1 > g1 = 0.85 (g0 would win)
//   bias   = [0,   0,   0.2, 0.1 ]
//   sb     = [0.6, 0.5, 0.6, 0.55]       biased group sums:  g0 = 1.1 < g1 = 1.15 -> g1 wins
//   top-2 of masked [-inf, -inf, 0.6, 0.55] -> idx = [2, 3]
//   w = s / (0.4 + 0.45) * 2.5 = [0.4/0.85*2.5, 0.45/0.85*2.5] = [1.176470588, 1.323529412]
static void test_group_score_uses_biased_scores(void **state) {
    (void)state;
    real logits[4] = {logit_of(0.6), logit_of(0.5), logit_of(0.4), logit_of(0.45)};
    real bias[4] = {0, 0, 0.2f, 0.1f};
    int idx[2];
    real w[2];
    route_one(idx, w, logits, bias, 4, 2, 2, 1, 2.5f);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 3);
    ASSERT_NEAR(w[0], 1.176470588, 2e-6);
    ASSERT_NEAR(w[1], 1.323529412, 2e-6);
    // without the bias, group 0 wins and its experts 0, 1 are chosen
    route_one(idx, w, logits, NULL, 4, 2, 2, 1, 2.5f);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 1);
}

// E = 6, groups {0,1} {2,3} {4,5}, keep 2, K = 2, route_scale 1, no bias.
//   s = [0.9, 0.1, 0.55, 0.5, 0.6, 0.52]; group sums g0 = 1.0, g1 = 1.05, g2 = 1.12 -> keep g2, g1.
//   Expert 0 has the highest score (0.9) but its group is masked to -inf.
//   top-2 of [-inf, -inf, 0.55, 0.5, 0.6, 0.52] -> idx = [4, 2]
//   w = [0.6, 0.55] / 1.15 = [0.5217391304, 0.4782608696]
static void test_masked_group_expert_never_chosen(void **state) {
    (void)state;
    real logits[6] = {logit_of(0.9), logit_of(0.1), logit_of(0.55), logit_of(0.5), logit_of(0.6),
                      logit_of(0.52)};
    int idx[2];
    real w[2];
    route_one(idx, w, logits, NULL, 6, 2, 3, 2, 1.0f);
    assert_int_equal(idx[0], 4);
    assert_int_equal(idx[1], 2);
    ASSERT_NEAR(w[0], 0.5217391304, 1e-6);
    ASSERT_NEAR(w[1], 0.4782608696, 1e-6);
}

// Ties. All logits 0 -> every score is exactly 0.5; biases are exact binary fractions.
//  (a) no groups (1 group), K = 2, bias [0, 0.25, 0.25, 0.25]: sb = [0.5, 0.75, 0.75, 0.75]
//      three-way tie at 0.75 -> the two lowest indices: idx = [1, 2]; w = [0.5, 0.5] (s all 0.5).
//  (b) groups {0,1} {2,3}, keep 1, K = 1, bias [0.25, 0.25, 0, 0.5]: sb = [0.75, 0.75, 0.5, 1.0]
//      group sums g0 = 1.5 = g1 -> tie, lower group g0 kept. Expert 3 (1.0, the highest) is in g1
//      and masked. Inside g0 experts 0 and 1 tie at 0.75 -> idx = [0]; w = [1] * route_scale 2.
static void test_ties_go_to_lower_index(void **state) {
    (void)state;
    real logits[4] = {0, 0, 0, 0};
    int idx[2];
    real w[2];
    real bias_a[4] = {0, 0.25f, 0.25f, 0.25f};
    route_one(idx, w, logits, bias_a, 4, 2, 1, 1, 1.0f);
    assert_int_equal(idx[0], 1);
    assert_int_equal(idx[1], 2);
    ASSERT_NEAR(w[0], 0.5, 1e-7);
    ASSERT_NEAR(w[1], 0.5, 1e-7);

    real bias_b[4] = {0.25f, 0.25f, 0, 0.5f};
    route_one(idx, w, logits, bias_b, 4, 1, 2, 1, 2.0f);
    assert_int_equal(idx[0], 0);
    ASSERT_NEAR(w[0], 2.0, 1e-7);
}

// Negative biased scores. E = 4, groups {0,1} {2,3}, keep 1, K = 2, route_scale 2.5.
//   logits [0, 0, 1, -1] -> s = [0.5, 0.5, 0.7310586, 0.2689414]
//   bias   [-1.8, -1.6, -1.9, -1.2] -> sb = [-1.3, -1.1, -1.1689414, -0.9310586] (all < 0)
//   group sums: g0 = -2.4, g1 = -2.1 -> g1 kept (an implementation starting its top-2 at 0 would
//   see 0 = 0 and keep g0; one that multiplies masked scores by 0 would pick experts 0, 1 at 0 > sb).
//   top-2 of [-inf, -inf, -1.1689, -0.9311] -> idx = [3, 2] (expert 1, -1.1 > -1.1689, is masked)
//   w = s / (s2 + s3) * 2.5, s2 + s3 = sigmoid(1) + sigmoid(-1) = 1 -> [0.6723536, 1.8276464]
static void test_negative_biased_scores(void **state) {
    (void)state;
    real logits[4] = {0, 0, 1, -1};
    real bias[4] = {-1.8f, -1.6f, -1.9f, -1.2f};
    int idx[2];
    real w[2];
    route_one(idx, w, logits, bias, 4, 2, 2, 1, 2.5f);
    assert_int_equal(idx[0], 3);
    assert_int_equal(idx[1], 2);
    ASSERT_NEAR(w[0], 0.6723535534, 2e-6);
    ASSERT_NEAR(w[1], 1.8276464466, 2e-6);
}

// Weights come from the UNBIASED scores, renormalised over the K chosen, times route_scale.
//   E = 4, one group, K = 2, route_scale 1.5; logits [2, 0, -1, 1]
//   s  = [0.8807971, 0.5, 0.2689414, 0.7310586]; bias [0, 0, 1, 0]
//   sb = [0.8807971, 0.5, 1.2689414, 0.7310586] -> idx = [2, 0]
//   w  = [0.2689414, 0.8807971] / 1.1497385 * 1.5 = [0.3508729440, 1.1491270560]
//   (biased weights would have given 1.2689/2.1497*1.5 = 0.885 for the first)
static void test_weights_renormalised_unbiased_times_scale(void **state) {
    (void)state;
    real logits[4] = {2, 0, -1, 1};
    real bias[4] = {0, 0, 1, 0};
    int idx[2];
    real w[2];
    real scores[4];
    cpu_router_forward(idx, w, scores, logits, bias, 1, 4, 2, 1, 1, 1.5f, 0);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 0);
    ASSERT_NEAR(w[0], 0.3508729440, 1e-6);
    ASSERT_NEAR(w[1], 1.1491270560, 1e-6);
    // scores are the plain sigmoid, bias not added
    ASSERT_NEAR(scores[0], 0.8807970780, 1e-7);
    ASSERT_NEAR(scores[2], 0.2689414214, 1e-7);
}

// freeze != 0: topk_idx is an input. Same token as above, routed by hand to experts [3, 1]:
//   w = [0.7310586, 0.5] / 1.2310586 * 1.5 = [0.8907463, 0.6092537]
static void test_freeze_keeps_given_indices(void **state) {
    (void)state;
    real logits[4] = {2, 0, -1, 1};
    real bias[4] = {0, 0, 1, 0};
    int idx[2] = {3, 1};
    real w[2];
    real scores[4];
    cpu_router_forward(idx, w, scores, logits, bias, 1, 4, 2, 1, 1, 1.5f, 1);
    assert_int_equal(idx[0], 3);
    assert_int_equal(idx[1], 1);
    ASSERT_NEAR(w[0], 1.5 * 0.7310585786 / 1.2310585786, 1e-6);
    ASSERT_NEAR(w[1], 1.5 * 0.5 / 1.2310585786, 1e-6);
}

// ---------------------------------------------------------------------------- routing vs brute force
// Independent double-precision reference: sort experts by (biased score desc, index asc) inside
// each group for the group score, sort groups the same way, then sort the kept experts.
typedef struct { double v; int i; } ValIdx;
static int cmp_desc_then_index(const void *a, const void *b) {
    const ValIdx *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->i - y->i;
}

static void reference_route(int *idx, double *w, const real *scores, const real *bias, int E, int K,
                            int n_groups, int n_limited, double route_scale) {
    ValIdx ex[64], gr[64];
    const int gs = E / n_groups;
    int kept[64] = {0};
    for (int g = 0; g < n_groups; g++) {
        for (int j = 0; j < gs; j++) {
            int e = g * gs + j;
            ex[j].v = (double)(real)(scores[e] + bias[e]);
            ex[j].i = e;
        }
        qsort(ex, (size_t)gs, sizeof(ValIdx), cmp_desc_then_index);
        gr[g].v = (double)(real)((real)ex[0].v + (real)ex[1].v);
        gr[g].i = g;
    }
    qsort(gr, (size_t)n_groups, sizeof(ValIdx), cmp_desc_then_index);
    for (int g = 0; g < n_limited; g++) kept[gr[g].i] = 1;
    int n = 0;
    for (int e = 0; e < E; e++) {
        if (!kept[e / gs]) continue;
        ex[n].v = (double)(real)(scores[e] + bias[e]);
        ex[n].i = e;
        n++;
    }
    qsort(ex, (size_t)n, sizeof(ValIdx), cmp_desc_then_index);
    double sum = 0;
    for (int k = 0; k < K; k++) sum += (double)scores[ex[k].i];
    for (int k = 0; k < K; k++) {
        idx[k] = ex[k].i;
        w[k] = (double)scores[ex[k].i] / sum * route_scale;
    }
}

static void test_random_tokens_match_brute_force(void **state) {
    (void)state;
    const int configs[][4] = {{16, 4, 2, 4}, {12, 3, 1, 2}, {8, 1, 1, 3}, {32, 8, 3, 6}};  // E, G, M, K
    for (size_t c = 0; c < sizeof(configs) / sizeof(configs[0]); c++) {
        const int E = configs[c][0], G = configs[c][1], M = configs[c][2], K = configs[c][3], N = 50;
        real *logits = malloc(sizeof(real) * N * E), *scores = malloc(sizeof(real) * N * E);
        real *bias = malloc(sizeof(real) * E), *w = malloc(sizeof(real) * N * K);
        int *idx = malloc(sizeof(int) * N * K);
        for (int i = 0; i < N * E; i++) logits[i] = (real)rand_uniform(-3, 3);
        for (int e = 0; e < E; e++) bias[e] = (real)rand_uniform(-0.3, 0.3);
        cpu_router_forward(idx, w, scores, logits, bias, N, E, K, G, M, 2.5f, 0);
        for (int t = 0; t < N; t++) {
            for (int e = 0; e < E; e++) ASSERT_NEAR(scores[t * E + e], sigmoid_d(logits[t * E + e]), 1e-7);
            int ridx[64];
            double rw[64];
            reference_route(ridx, rw, scores + t * E, bias, E, K, G, M, 2.5);
            for (int k = 0; k < K; k++) {
                assert_int_equal(idx[t * K + k], ridx[k]);
                ASSERT_NEAR(w[t * K + k], rw[k], 2e-6);
            }
        }
        free(logits); free(scores); free(bias); free(w); free(idx);
    }
}

// ---------------------------------------------------------------------------- router backward
// L(logits) = sum dtopk_w . topk_w + sum dscores . scores with routing frozen. Central differences
// in float with eps 1e-3: the outputs carry ~1e-7 relative rounding each, so the difference quotient
// is good to ~1e-4 absolute; tolerance 5e-4 + 1e-3 |g| (the double build gets eps 1e-6, tol 1e-8).
#ifdef FP8MOE_REAL_DOUBLE
#define FD_EPS 1e-6
#define FD_TOL_ABS 1e-8
#define FD_TOL_REL 1e-7
#else
#define FD_EPS 1e-3
#define FD_TOL_ABS 5e-4
#define FD_TOL_REL 1e-3
#endif

static double router_objective(const real *logits, const real *bias, int *idx, const real *dtopk_w,
                               const real *dscores, int N, int E, int K, int G, int M, real rs) {
    real *w = malloc(sizeof(real) * N * K), *s = malloc(sizeof(real) * N * E);
    cpu_router_forward(idx, w, s, logits, bias, N, E, K, G, M, rs, 1);
    double L = 0;
    for (int i = 0; i < N * K; i++) L += (double)dtopk_w[i] * (double)w[i];
    for (int i = 0; i < N * E; i++) L += (double)dscores[i] * (double)s[i];
    free(w);
    free(s);
    return L;
}

static void test_router_backward_finite_differences(void **state) {
    (void)state;
    const int N = 6, E = 8, K = 3, G = 4, M = 2;
    const real rs = 2.5f;
    real logits[6 * 8], scores[6 * 8], bias[8], w[6 * 3], dtopk_w[6 * 3], dscores[6 * 8], dlogits[6 * 8];
    int idx[6 * 3];
    for (int i = 0; i < N * E; i++) logits[i] = (real)rand_uniform(-2, 2);
    for (int e = 0; e < E; e++) bias[e] = (real)rand_uniform(-0.1, 0.1);
    for (int i = 0; i < N * K; i++) dtopk_w[i] = (real)rand_uniform(-1, 1);
    for (int i = 0; i < N * E; i++) dscores[i] = (real)rand_uniform(-1, 1);
    cpu_router_forward(idx, w, scores, logits, bias, N, E, K, G, M, rs, 0);
    for (int i = 0; i < N * E; i++) dlogits[i] = 0.25f;  // backward accumulates onto this
    cpu_router_backward(dlogits, dtopk_w, dscores, idx, scores, N, E, K, rs);

    double max_err = 0;
    for (int i = 0; i < N * E; i++) {
        real saved = logits[i];
        logits[i] = (real)(saved + FD_EPS);
        double lp = router_objective(logits, bias, idx, dtopk_w, dscores, N, E, K, G, M, rs);
        logits[i] = (real)(saved - FD_EPS);
        double lm = router_objective(logits, bias, idx, dtopk_w, dscores, N, E, K, G, M, rs);
        logits[i] = saved;
        double h = (double)(real)(saved + FD_EPS) - (double)(real)(saved - FD_EPS);
        double numeric = (lp - lm) / h;
        double analytic = (double)dlogits[i] - 0.25;
        double err = fabs(analytic - numeric);
        if (err > max_err) max_err = err;
        if (err > FD_TOL_ABS + FD_TOL_REL * fabs(numeric))
            fail_msg("dlogits[%d]: analytic %.7g, numeric %.7g", i, analytic, numeric);
    }
    print_message("router_backward: max |analytic - numeric| = %.3g\n", max_err);

    // only the routed part (dscores NULL) must also match: the dscores term is separable
    real dl2[6 * 8] = {0};
    real zeros[6 * 8] = {0};
    cpu_router_backward(dl2, dtopk_w, NULL, idx, scores, N, E, K, rs);
    for (int i = 0; i < 4; i++) {
        real saved = logits[i];
        logits[i] = (real)(saved + FD_EPS);
        double lp = router_objective(logits, bias, idx, dtopk_w, zeros, N, E, K, G, M, rs);
        logits[i] = (real)(saved - FD_EPS);
        double lm = router_objective(logits, bias, idx, dtopk_w, zeros, N, E, K, G, M, rs);
        logits[i] = saved;
        double numeric = (lp - lm) / ((double)(real)(saved + FD_EPS) - (double)(real)(saved - FD_EPS));
        ASSERT_NEAR(dl2[i], numeric, FD_TOL_ABS + FD_TOL_REL * fabs(numeric));
    }
}

// ---------------------------------------------------------------------------- balance loss
// Perfect balance: E = 4, K = 2, T = 4, B = 2. Token t of sequence b has scores
// v[(e - t - b) mod 4] with v = [0.8, 0.4, 0.2, 0.1]: its plain top-2 are experts t+b and t+b+1, so
// over a sequence every expert is chosen twice: f_i = E/(K T) * 2 = 4/8 * 2 = 1. Every expert sees each
// of v/S once: P_i = (1/4) (0.8 + 0.4 + 0.2 + 0.1) / 1.5 = 1/4. L = alpha * 4 * (1 * 1/4) = alpha.
static void test_balance_loss_perfect_balance_is_alpha(void **state) {
    (void)state;
    const int B = 2, T = 4, E = 4, K = 2;
    const double v[4] = {0.8, 0.4, 0.2, 0.1};
    real scores[2 * 4 * 4];
    int plain[2 * 4 * 2];
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int e = 0; e < E; e++) scores[(b * T + t) * E + e] = (real)v[((e - t - b) % 4 + 8) % 4];
    const real alpha = 1e-4f;
    real L = cpu_balance_loss_forward(plain, scores, B, T, E, K, alpha, 0);
    ASSERT_NEAR(L, 1e-4, 1e-4 * 1e-5);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            assert_int_equal(plain[(b * T + t) * K + 0], (t + b) % 4);
            assert_int_equal(plain[(b * T + t) * K + 1], (t + b + 1) % 4);
        }
}

// Imbalanced, E = 4, K = 1, T = 2, B = 2, alpha = 1:
//  sequence 0: t0 s = [0.5, 0.25, 0.125, 0.125] (S = 1) -> top-1 expert 0
//              t1 s = [0.2, 0.4, 0.3, 0.1]      (S = 1) -> top-1 expert 1
//              f = E/(K T) * counts = 2 * [1, 1, 0, 0] = [2, 2, 0, 0]
//              P0 = (0.5 + 0.2) / 2 = 0.35, P1 = (0.25 + 0.4) / 2 = 0.325
//              L0 = 2 * 0.35 + 2 * 0.325 = 1.35
//  sequence 1: both tokens s = [0.25, 0.25, 0.25, 0.25] -> four-way tie -> expert 0 (lower index)
//              f = [4, 0, 0, 0], P0 = 0.25 -> L1 = 1.0
//  returned: mean = (1.35 + 1.0) / 2 = 1.175
static void test_balance_loss_hand_imbalanced(void **state) {
    (void)state;
    real scores[16] = {0.5f, 0.25f, 0.125f, 0.125f, 0.2f, 0.4f, 0.3f, 0.1f,
                       0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f};
    int plain[4];
    real L = cpu_balance_loss_forward(plain, scores, 2, 2, 4, 1, 1.0f, 0);
    ASSERT_NEAR(L, 1.175, 1e-6);
    assert_int_equal(plain[0], 0);
    assert_int_equal(plain[1], 1);
    assert_int_equal(plain[2], 0);
    assert_int_equal(plain[3], 0);
    // frozen indicators: with plain = [3, 3 | 0, 0] sequence 0 has f = [0, 0, 0, 4],
    // P3 = (0.125 + 0.1) / 2 = 0.1125, L0 = 0.45; L1 stays 1.0 -> mean 0.725
    int frozen[4] = {3, 3, 0, 0};
    L = cpu_balance_loss_forward(frozen, scores, 2, 2, 4, 1, 1.0f, 1);
    ASSERT_NEAR(L, 0.725, 1e-6);
}

// Backward vs central differences of the forward with frozen indicators (f constant).
// eps 1e-3 in float: L ~ 0.5 carries ~3e-8 rounding -> ~3e-5 in the quotient; tol 1e-4 + 1e-3 |g|.
static void test_balance_loss_backward_finite_differences(void **state) {
    (void)state;
    const int B = 2, T = 5, E = 6, K = 2;
    const real alpha = 0.5f, dloss = 0.7f;
    real scores[2 * 5 * 6], dscores[2 * 5 * 6];
    int plain[2 * 5 * 2];
    for (int i = 0; i < B * T * E; i++) scores[i] = (real)rand_uniform(0.05, 0.95);
    cpu_balance_loss_forward(plain, scores, B, T, E, K, alpha, 0);
    for (int i = 0; i < B * T * E; i++) dscores[i] = -0.5f;  // accumulates onto this
    cpu_balance_loss_backward(dscores, plain, scores, B, T, E, K, alpha, dloss);
#ifdef FP8MOE_REAL_DOUBLE
    const double eps = 1e-6, tol_abs = 1e-9;
#else
    const double eps = 1e-3, tol_abs = 1e-4;
#endif
    double max_err = 0;
    for (int i = 0; i < B * T * E; i++) {
        real saved = scores[i];
        scores[i] = (real)(saved + eps);
        double lp = cpu_balance_loss_forward(plain, scores, B, T, E, K, alpha, 1);
        scores[i] = (real)(saved - eps);
        double lm = cpu_balance_loss_forward(plain, scores, B, T, E, K, alpha, 1);
        scores[i] = saved;
        double h = (double)(real)(saved + eps) - (double)(real)(saved - eps);
        double numeric = (double)dloss * (lp - lm) / h;
        double analytic = (double)dscores[i] + 0.5;
        double err = fabs(analytic - numeric);
        if (err > max_err) max_err = err;
        if (err > tol_abs + 1e-3 * fabs(numeric))
            fail_msg("dscores[%d]: analytic %.7g, numeric %.7g", i, analytic, numeric);
    }
    print_message("balance_loss_backward: max |analytic - numeric| = %.3g\n", max_err);
}

// The balance-loss gradient reaches the logits through router_backward's dscores path:
// with dtopk_w = 0, dlogits = dscores * s (1 - s) exactly (worked per element).
static void test_router_backward_dscores_through_sigmoid(void **state) {
    (void)state;
    real logits[4] = {0, 1, -1, 2}, scores[4], w[1], dscores[4] = {1, -2, 0.5f, 4};
    int idx[1];
    cpu_router_forward(idx, w, scores, logits, NULL, 1, 4, 1, 1, 1, 1.0f, 0);
    real dlogits[4] = {0}, dw[1] = {0};
    cpu_router_backward(dlogits, dw, dscores, idx, scores, 1, 4, 1, 1.0f);
    // s(1-s): 0.25, 0.19661193, 0.19661193, 0.10499359
    ASSERT_NEAR(dlogits[0], 0.25, 1e-7);
    ASSERT_NEAR(dlogits[1], -2 * 0.1966119332, 1e-6);
    ASSERT_NEAR(dlogits[2], 0.5 * 0.1966119332, 1e-6);
    ASSERT_NEAR(dlogits[3], 4 * 0.1049935854, 1e-6);
}

// ---------------------------------------------------------------------------- errors inside the parallel region
// A NaN logit stops the process with one message and exit status 1, however many threads find one. The check runs
// inside the router's OpenMP region; calling exit() there made every thread that found a NaN print and exit at
// once: two messages, then SIGABRT ("double free or corruption") or SIGSEGV in the exit handlers. The router
// runs in a fresh process (this binary again, NAN_CHILD_ARG, OMP_NUM_THREADS=2), not a forked copy: libgomp's
// thread pool does not survive fork().
#define NAN_CHILD_ARG "--router-nan-child"
enum { NAN_N = 64, NAN_E = 8 };

// An exit handler that takes its time, as a real process's do (HDF5 closing its library, the C library flushing
// streams): while it runs, a second thread that reached exit() too runs them again, at the same time.
static void slow_exit_handler(void) {
    static int entered;
    if (__atomic_add_fetch(&entered, 1, __ATOMIC_SEQ_CST) > 1)
        fprintf(stderr, "router_nan_child: exit handlers entered twice, by two threads at once\n");
    usleep(300 * 1000);
}

// Rows 0..31 go to thread 0 and 32..63 to thread 1 (schedule(static)); each finds a NaN in its first row.
static int router_nan_child(void) {
    if (omp_get_max_threads() < 2) {
        fprintf(stderr, "router_nan_child: %d OpenMP thread(s); expected at least 2\n", omp_get_max_threads());
        return 3;
    }
    atexit(slow_exit_handler);
    static real logits[NAN_N * NAN_E], scores[NAN_N * NAN_E], w[NAN_N * 2];
    static int idx[NAN_N * 2];
    for (int i = 0; i < NAN_N * NAN_E; i++) logits[i] = (real)((i % 7) - 3) * 0.25f;
    logits[0 * NAN_E + 3] = NAN;   // the first in row order: the one reported
    logits[32 * NAN_E + 1] = NAN;  // thread 1's first row
    for (int t = 40; t < NAN_N; t++) logits[t * NAN_E] = NAN;
    cpu_router_forward(idx, w, scores, logits, NULL, NAN_N, NAN_E, 2, 4, 2, 1.0f, 0);
    fprintf(stderr, "router_nan_child: router_forward returned on NaN logits\n");
    return 0;
}

static void test_router_nan_two_threads_one_message_exit_1(void **state) {
    (void)state;
    for (int run = 0; run < 3; run++) {
        char path[] = "/tmp/fp8moe_router_nan_XXXXXX";
        const int fd = mkstemp(path);
        assert_true(fd >= 0);
        fflush(NULL);
        const pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            dup2(fd, 2);
            setenv("OMP_NUM_THREADS", "2", 1);
            setenv("OMP_DYNAMIC", "false", 1);
            execl("/proc/self/exe", "test_router", NAN_CHILD_ARG, (char *)NULL);
            _exit(127);
        }
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        char text[4096] = {0};
        const ssize_t got = pread(fd, text, sizeof text - 1, 0);
        close(fd);
        unlink(path);
        if (!WIFEXITED(status))
            fail_msg("run %d: the router stopped by signal %d (exit status %d), expected exit(1); stderr:\n%s", run,
                     WIFSIGNALED(status) ? WTERMSIG(status) : 0, 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0),
                     text);
        if (WEXITSTATUS(status) != 1) fail_msg("run %d: exit status %d, expected 1; stderr:\n%s", run, WEXITSTATUS(status), text);
        assert_true(got > 0);
        int messages = 0, lines = 0;
        for (const char *p = text; (p = strstr(p, "is NaN")) != NULL; p++) messages++;
        for (const char *p = text; *p; p++) lines += *p == '\n';
        if (messages != 1 || lines != 1) fail_msg("run %d: %d NaN messages in %d lines, expected 1:\n%s", run, messages, lines, text);
        if (strstr(text, "fp8moe: kernels/cpu/router.c:") != text || !strstr(text, "router_forward: logits[0, 3] is NaN"))
            fail_msg("run %d: expected the first NaN in row order, logits[0, 3], with file and line:\n%s", run, text);
    }
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], NAN_CHILD_ARG) == 0) return router_nan_child();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_group_score_uses_biased_scores),
        cmocka_unit_test(test_masked_group_expert_never_chosen),
        cmocka_unit_test(test_ties_go_to_lower_index),
        cmocka_unit_test(test_negative_biased_scores),
        cmocka_unit_test(test_weights_renormalised_unbiased_times_scale),
        cmocka_unit_test(test_freeze_keeps_given_indices),
        cmocka_unit_test(test_random_tokens_match_brute_force),
        cmocka_unit_test(test_router_backward_finite_differences),
        cmocka_unit_test(test_router_backward_dscores_through_sigmoid),
        cmocka_unit_test(test_balance_loss_perfect_balance_is_alpha),
        cmocka_unit_test(test_balance_loss_hand_imbalanced),
        cmocka_unit_test(test_balance_loss_backward_finite_differences),
        cmocka_unit_test(test_router_nan_two_threads_one_message_exit_1),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
