/*
 * router.c - CPU reference of the DeepSeek-V3 MoE router and the sequence-wise balance loss
 * (DESIGN.md section 3; the op contracts are in kernels/kernels.h).
 *
 * This is the numerical reference the CUDA router will be tested against, so it favours plain,
 * obviously-correct loops over speed: selection is K passes of an arg-max with strict ">" scanning
 * ascending indices, which is what makes "ties go to the lower index" hold for experts and groups.
 * Masked experts are set to -inf (never multiplied by 0: biased scores can be negative, and a 0
 * would then beat every kept expert). Sums that feed gradients or losses are accumulated in double
 * in a fixed order; OpenMP splits work over tokens (or experts) only, so results do not depend on
 * the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_ops.h"

// Stops the process with the op, this file and line, what was found and what was expected. Not inside a
// parallel region: there, ROUTER_REGION_FAIL records the error for cpu_region_check after the region.
#define ROUTER_CHECK(cond, ...)                                                   \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "fp8moe: %s:%d: ", __FILE__, __LINE__);               \
            fprintf(stderr, __VA_ARGS__);                                         \
            fputc('\n', stderr);                                                  \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

#define ROUTER_REGION_FAIL(err, at, fmt, ...) \
    cpu_region_fail((err), (at), "%s:%d: " fmt, __FILE__, __LINE__, __VA_ARGS__)

static void *router_xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    ROUTER_CHECK(p != NULL, "out of memory allocating %zu bytes of router scratch", bytes);
    return p;
}

// Computed in double and rounded once, so the float and double builds both get a correctly
// rounded-or-nearly sigmoid, and exp never overflows into a NaN for large |x|.
static real sigmoid_real(real x) {
    double xd = (double)x;
    if (xd >= 0.0) return (real)(1.0 / (1.0 + exp(-xd)));
    double e = exp(xd);
    return (real)(e / (1.0 + e));
}

// idx (K) = indices of the K largest values of v (n), in descending order of value; ties go to the
// lower index (strict ">" while scanning up). taken (n) is scratch. Requires K <= n.
static void select_topk(int *idx, const real *v, int n, int K, unsigned char *taken) {
    for (int i = 0; i < n; i++) taken[i] = 0;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            if (taken[i]) continue;
            if (best < 0 || v[i] > v[best]) best = i;
        }
        taken[best] = 1;
        idx[k] = best;
    }
}

static void check_topk_input(const char *op, const int *idx, int N, int K, int E) {
    for (int64_t i = 0; i < (int64_t)N * K; i++) {
        ROUTER_CHECK(idx[i] >= 0 && idx[i] < E,
                     "%s: frozen routing index [%lld, %lld] = %d is out of range; expected an expert "
                     "index in [0, %d)", op, (long long)(i / K), (long long)(i % K), idx[i], E);
    }
}

// ---------------------------------------------------------------------------- router forward
// logits (N, E), bias (E) or NULL (= zeros) -> scores (N, E), topk_idx (N, K), topk_w (N, K).
// n_groups groups of E/n_groups consecutive experts; a token may use n_limited of them.
void cpu_router_forward(int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias,
                        int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze) {
    ROUTER_CHECK(N >= 0 && E >= 1, "router_forward: N = %d, E = %d; expected N >= 0 and E >= 1", N, E);
    ROUTER_CHECK(K >= 1 && K <= E, "router_forward: n_activated_experts K = %d; expected 1 <= K <= E = %d",
                 K, E);
    ROUTER_CHECK(n_groups >= 1 && E % n_groups == 0,
                 "router_forward: n_expert_groups = %d does not divide n_routed_experts = %d; expected a "
                 "divisor of E", n_groups, E);
    const int group_size = E / n_groups;
    ROUTER_CHECK(n_groups == 1 || group_size >= 2,
                 "router_forward: %d experts per group; expected >= 2 (the group score is the sum of "
                 "the top-2 experts of the group)", group_size);
    ROUTER_CHECK(n_limited >= 1 && n_limited <= n_groups,
                 "router_forward: n_limited_groups = %d; expected 1 <= n_limited_groups <= "
                 "n_expert_groups = %d", n_limited, n_groups);
    ROUTER_CHECK(K <= n_limited * group_size,
                 "router_forward: K = %d experts per token, but the %d kept groups hold only %d "
                 "experts; expected K <= n_limited_groups * E / n_expert_groups", K, n_limited,
                 n_limited * group_size);
    if (freeze) check_topk_input("router_forward", topk_idx, N, K, E);

    // A NaN logit is recorded (the first, in row order) and its thread computes no further rows: the
    // process stops after the region (cpu_region_check).
    CpuRegionError err = {0};
    #pragma omp parallel
    {
        real *masked = cpu_region_alloc(&err, (size_t)E * sizeof(real), 0, "router scratch");
        real *group_score = cpu_region_alloc(&err, (size_t)n_groups * sizeof(real), 0, "router scratch");
        int *kept_groups = cpu_region_alloc(&err, (size_t)n_limited * sizeof(int), 0, "router scratch");
        unsigned char *taken = cpu_region_alloc(&err, (size_t)(E > n_groups ? E : n_groups), 0, "router scratch");
        int stopped = !masked || !group_score || !kept_groups || !taken;

        #pragma omp for schedule(static)
        for (int t = 0; t < N; t++) {
            if (stopped) continue;
            const real *lt = logits + (size_t)t * E;
            real *st = scores + (size_t)t * E;
            int *it = topk_idx + (size_t)t * K;
            real *wt = topk_w + (size_t)t * K;

            for (int e = 0; e < E && !stopped; e++) {
                if (isnan(lt[e])) {
                    ROUTER_REGION_FAIL(&err, (int64_t)t * E + e, "router_forward: logits[%d, %d] is NaN; expected a "
                                       "finite router logit (the model diverged or its input is corrupt)", t, e);
                    stopped = 1;
                }
                st[e] = sigmoid_real(lt[e]);
            }
            if (stopped) continue;

            if (!freeze) {
                // biased scores choose the experts; the bias never reaches the weights
                for (int e = 0; e < E; e++) masked[e] = st[e] + (bias ? bias[e] : (real)0);

                if (n_limited < n_groups) {
                    // group score = top1 + top2 of the biased scores inside the group. Both start at
                    // -inf, not 0, because biased scores may all be negative.
                    for (int g = 0; g < n_groups; g++) {
                        real top1 = -INFINITY, top2 = -INFINITY;
                        for (int e = g * group_size; e < (g + 1) * group_size; e++) {
                            if (masked[e] > top1) { top2 = top1; top1 = masked[e]; }
                            else if (masked[e] > top2) top2 = masked[e];
                        }
                        group_score[g] = top1 + top2;
                    }
                    select_topk(kept_groups, group_score, n_groups, n_limited, taken);
                    // taken[g] now marks the kept groups; every expert of the others goes to -inf
                    for (int g = 0; g < n_groups; g++) {
                        if (taken[g]) continue;
                        for (int e = g * group_size; e < (g + 1) * group_size; e++) masked[e] = -INFINITY;
                    }
                }
                select_topk(it, masked, E, K, taken);
            }

            // w_k = s_{i_k} / S * route_scale with the UNBIASED scores, S summed in k order
            real sum = 0;
            for (int k = 0; k < K; k++) sum += st[it[k]];
            for (int k = 0; k < K; k++) wt[k] = st[it[k]] / sum * route_scale;
        }
        free(masked);
        free(group_score);
        free(kept_groups);
        free(taken);
    }
    cpu_region_check(&err);
}

// ---------------------------------------------------------------------------- router backward
// In the forward pass this was, per token: s = sigmoid(logit); w_k = r s_{i_k} / S, S = sum_j s_{i_j}.
// So (quotient rule), with G = sum_k dw_k s_{i_k}:
//   dL/ds_{i_k} = r (dw_k / S - G / S^2)            (summed if an index repeats under freeze)
//   dL/ds_e    += dscores_e for every e               (balance loss, when given)
//   dlogit_e   += dL/ds_e * s_e (1 - s_e)
// dtopk_w (N, K) or NULL, dscores (N, E) or NULL, scores (N, E) from the forward -> dlogits (N, E) +=.
void cpu_router_backward(real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx,
                         const real *scores, int N, int E, int K, real route_scale) {
    if (dlogits == NULL || (dtopk_w == NULL && dscores == NULL)) return;
    if (dtopk_w) check_topk_input("router_backward", topk_idx, N, K, E);

    CpuRegionError err = {0};
    #pragma omp parallel
    {
        double *dscore = cpu_region_alloc(&err, (size_t)E * sizeof(double), 0, "router_backward scratch");

        #pragma omp for schedule(static)
        for (int t = 0; t < N; t++) {
            if (dscore == NULL) continue;
            const real *st = scores + (size_t)t * E;
            for (int e = 0; e < E; e++) dscore[e] = dscores ? (double)dscores[(size_t)t * E + e] : 0.0;

            if (dtopk_w) {
                const int *it = topk_idx + (size_t)t * K;
                const real *dwt = dtopk_w + (size_t)t * K;
                double S = 0.0, G = 0.0;
                for (int k = 0; k < K; k++) {
                    S += (double)st[it[k]];
                    G += (double)dwt[k] * (double)st[it[k]];
                }
                for (int k = 0; k < K; k++)
                    dscore[it[k]] += (double)route_scale * ((double)dwt[k] / S - G / (S * S));
            }

            real *dt = dlogits + (size_t)t * E;
            for (int e = 0; e < E; e++) {
                double s = (double)st[e];
                dt[e] += (real)(dscore[e] * s * (1.0 - s));
            }
        }
        free(dscore);
    }
    cpu_region_check(&err);
}

// ---------------------------------------------------------------------------- balance loss
// scores (B*T, E) -> plain_topk (B*T, K) (output, or input when freeze); returns
// mean_b alpha sum_i f_i P_i with f_i = E/(K T) #{t : i in plain_topk_t}, P_i = (1/T) sum_t s_ti / S_t.
real cpu_balance_loss_forward(int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha,
                              int freeze) {
    ROUTER_CHECK(B >= 1 && T >= 1 && E >= 1 && K >= 1 && K <= E,
                 "balance_loss_forward: B = %d, T = %d, E = %d, K = %d; expected B, T, E >= 1 and "
                 "1 <= K <= E", B, T, E, K);
    const int N = B * T;
    if (freeze) {
        check_topk_input("balance_loss_forward", plain_topk, N, K, E);
    } else {
        // plain top-K: unbiased scores, no group limit, ties to the lower index
        CpuRegionError err = {0};
        #pragma omp parallel
        {
            unsigned char *taken = cpu_region_alloc(&err, (size_t)E, 0, "balance_loss_forward scratch");
            #pragma omp for schedule(static)
            for (int t = 0; t < N; t++)
                if (taken) select_topk(plain_topk + (size_t)t * K, scores + (size_t)t * E, E, K, taken);
            free(taken);
        }
        cpu_region_check(&err);
    }

    double *row_sum = router_xmalloc((size_t)T * sizeof(double));  // S_t of the current sequence
    double *P = router_xmalloc((size_t)E * sizeof(double));
    int64_t *count = router_xmalloc((size_t)E * sizeof(int64_t));
    double total = 0.0;
    for (int b = 0; b < B; b++) {
        const real *sb = scores + (size_t)b * T * E;
        const int *ib = plain_topk + (size_t)b * T * K;
        #pragma omp parallel for schedule(static)
        for (int t = 0; t < T; t++) {
            double S = 0.0;
            for (int e = 0; e < E; e++) S += (double)sb[(size_t)t * E + e];
            row_sum[t] = S;
        }
        // one expert per iteration, tokens summed in order: fixed reduction order
        #pragma omp parallel for schedule(static)
        for (int e = 0; e < E; e++) {
            double p = 0.0;
            for (int t = 0; t < T; t++) p += (double)sb[(size_t)t * E + e] / row_sum[t];
            P[e] = p / T;
        }
        for (int e = 0; e < E; e++) count[e] = 0;
        for (int i = 0; i < T * K; i++) count[ib[i]]++;
        double loss = 0.0;
        for (int e = 0; e < E; e++) loss += ((double)E / ((double)K * T) * (double)count[e]) * P[e];
        total += (double)alpha * loss;
    }
    free(row_sum);
    free(P);
    free(count);
    return (real)(total / B);
}

// In the forward pass this was, per sequence: L_b = alpha sum_i f_i (1/T) sum_t s_ti / S_t, and the
// op returned mean_b L_b. f holds indicator counts, which have no gradient (held constant). So:
//   dL/ds_tj = dloss alpha / (B T) (f_j - F_t) / S_t,   F_t = sum_i f_i s_ti / S_t.
// plain_topk (B*T, K) and scores (B*T, E) from the forward -> dscores (B*T, E) +=.
void cpu_balance_loss_backward(real *dscores, const int *plain_topk, const real *scores, int B, int T,
                               int E, int K, real alpha, real dloss) {
    if (dscores == NULL) return;
    ROUTER_CHECK(B >= 1 && T >= 1 && E >= 1 && K >= 1 && K <= E,
                 "balance_loss_backward: B = %d, T = %d, E = %d, K = %d; expected B, T, E >= 1 and "
                 "1 <= K <= E", B, T, E, K);
    check_topk_input("balance_loss_backward", plain_topk, B * T, K, E);
    const double c = (double)dloss * (double)alpha / ((double)B * T);
    double *f = router_xmalloc((size_t)E * sizeof(double));
    for (int b = 0; b < B; b++) {
        const int *ib = plain_topk + (size_t)b * T * K;
        for (int e = 0; e < E; e++) f[e] = 0.0;
        for (int i = 0; i < T * K; i++) f[ib[i]] += 1.0;
        for (int e = 0; e < E; e++) f[e] *= (double)E / ((double)K * T);

        #pragma omp parallel for schedule(static)
        for (int t = 0; t < T; t++) {
            const real *st = scores + ((size_t)b * T + t) * E;
            real *dt = dscores + ((size_t)b * T + t) * E;
            double S = 0.0, fs = 0.0;
            for (int e = 0; e < E; e++) {
                S += (double)st[e];
                fs += f[e] * (double)st[e];
            }
            const double F = fs / S;
            for (int e = 0; e < E; e++) dt[e] += (real)(c * (f[e] - F) / S);
        }
    }
    free(f);
}
