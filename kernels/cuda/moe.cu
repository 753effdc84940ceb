/*
 * moe.cu - CUDA MoE routing and token permutation (kernels.h, "MoE routing" and "MoE token permutation"):
 * the DeepSeek-V3 router forward/backward, the sequence-wise balance loss forward/backward, the per-expert
 * segment plan built on the device, the row gather, its adjoint, and the weighted combine forward/backward.
 * Same functions as kernels/cpu/router.c and permute.c; checked against them by tests/gpu/test_gpu_model_ops.c.
 *
 * Routing runs one warp per token: the token's scores sit in shared memory, and each top-k step is a warp
 * arg-max over (value, index) that prefers the larger value and, on equal values, the lower index - the
 * same choice as the CPU's ascending scan with strict ">" - so topk_idx equals the CPU's whenever the scores
 * do. The scores are the CPU's sigmoid (computed in double, rounded once; CUDA's double exp is within an ulp
 * of glibc's, so the float result is the same except in the rare case of a double landing within an ulp of a
 * float rounding boundary).
 *
 * Numerics and determinism: no floating-point atomics. Float and double operations are __f*_rn / __d*_rn
 * intrinsics in the CPU's order (no FMA contraction: the CPU builds with -ffp-contract=off), so the router
 * weights and gradients, the balance-loss gradient, the unpermute and the combine forward and dexpert_out are
 * the CPU's bits. Two sums are in a different (fixed) order than the CPU's: the balance loss's P_i (chunks of
 * tokens, in double) and combine backward's dtopk_w dot products (strided per thread, then a block tree, in
 * double; the order is fixed by C and by whether the float4 path runs); both are rounded to float from double,
 * so they match the CPU to about 1e-16 before that rounding. Expert load counts use
 * integer atomics, whose result does not depend on order.
 *
 * The permutation plan is a stable sort of the N*K slots by expert: CUB's radix sort (documented stable) on
 * the bits of the expert index with the slot index as value, which leaves each expert's slots in (t, k)
 * order, exactly the CPU's counting sort; segment offsets are lower bounds in the sorted experts. Bitwise
 * equal to moe_permute_plan.
 *
 * Input errors: router_forward (NaN logits, frozen indices out of range), balance_loss_forward (frozen
 * indices) and the plan (indices out of range) stop the process as the CPU ops do. Their kernels record the
 * first bad element in a device error slot (integer atomicMin: order-free) and the op copies the slots back,
 * which synchronises; these ops are followed by host work anyway (the plan's segment sizes size the expert
 * GEMMs; the balance loss is returned to the host). router_backward and balance_loss_backward read indices
 * that their forward produced or checked; they skip an out-of-range index (never read or write out of bounds)
 * and record it, reported right away when FP8MOE_CUDA_SYNC=1 and otherwise by the next synchronising op of
 * this file. Bad values in the kernels never index memory.
 *
 * Scratch buffers are process-wide caches grown on demand; all ops run on the default stream, so reuse
 * between calls is ordered (if ops ever run on several streams or host threads they must become per stream).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static const int MOE_THREADS = 256;
static const int WARPS_PER_BLOCK = 8;
static const unsigned int FULL_MASK = 0xffffffffu;
static const size_t MAX_SHARED_BYTES = 48 * 1024;

// Stops with "moe.cu:<line>: <message>" (the message starts with the op).
#define MOE_FAIL(...)                                                                \
    do {                                                                             \
        fprintf(stderr, "fp8moe: %s:%d: ", __FILE__, __LINE__);                      \
        fprintf(stderr, __VA_ARGS__);                                                \
        fputc('\n', stderr);                                                         \
        exit(1);                                                                     \
    } while (0)
#define MOE_CHECK(cond, ...)                                                         \
    do {                                                                             \
        if (!(cond)) MOE_FAIL(__VA_ARGS__);                                          \
    } while (0)

// ---------------------------------------------------------------------------- error slots
// One slot per kind of input error (common.cuh ErrorSlots); the index is the bad element's linear index into the
// op's input.
enum {
    ERR_ROUTER_NAN_LOGIT,      // index t * E + e
    ERR_ROUTER_FROZEN_INDEX,   // index t * K + k, value = the index
    ERR_ROUTER_BACKWARD_INDEX, // index t * K + k
    ERR_BALANCE_FROZEN_INDEX,  // index t * K + k
    ERR_BALANCE_BACKWARD_INDEX,
    ERR_PLAN_INDEX,            // index t * K + k
    N_ERR_SLOTS
};
static ErrorSlots errors = {NULL, N_ERR_SLOTS};
// The shapes the message needs (K or E of the call that set the slot), kept on the host per slot.
static int err_width[N_ERR_SLOTS], err_limit[N_ERR_SLOTS];

// The device slot of one kind, emptied. width: the row length that splits the recorded index into (row,
// column); limit: E, for the message.
static unsigned long long *err_slot_reset(int which, int width, int limit) {
    err_width[which] = width;
    err_limit[which] = limit;
    return error_slot_reset(&errors, which);
}

// Copies the slots back (this synchronises) and stops the process on the first recorded error.
static void report_errors(void) {
    unsigned long long v[N_ERR_SLOTS];
    if (!error_slots_read(&errors, v)) return;
    for (int k = 0; k < N_ERR_SLOTS; k++) {
        if (v[k] == ERROR_SLOT_EMPTY) continue;
        const long long index = (long long)error_index(v[k]), row = index / err_width[k], col = index % err_width[k];
        const int value = error_value(v[k]), E = err_limit[k];
        switch (k) {
        case ERR_ROUTER_NAN_LOGIT:
            MOE_FAIL("router_forward: logits[%lld, %lld] is NaN; expected a finite router logit (the model diverged "
                     "or its input is corrupt)", row, col);
        case ERR_ROUTER_FROZEN_INDEX:
            MOE_FAIL("router_forward: frozen routing index [%lld, %lld] = %d is out of range; expected an expert "
                     "index in [0, %d)", row, col, value, E);
        case ERR_ROUTER_BACKWARD_INDEX:
            MOE_FAIL("router_backward: routing index [%lld, %lld] = %d is out of range; expected an expert index "
                     "in [0, %d)", row, col, value, E);
        case ERR_BALANCE_FROZEN_INDEX:
            MOE_FAIL("balance_loss_forward: frozen routing index [%lld, %lld] = %d is out of range; expected an "
                     "expert index in [0, %d)", row, col, value, E);
        case ERR_BALANCE_BACKWARD_INDEX:
            MOE_FAIL("balance_loss_backward: frozen routing index [%lld, %lld] = %d is out of range; expected an "
                     "expert index in [0, %d)", row, col, value, E);
        default:
            MOE_FAIL("moe_permute_plan: topk_idx[%lld, %lld] = %d; expected an expert index in [0, %d)", row, col,
                     value, E);
        }
    }
}

// ---------------------------------------------------------------------------- warp top-k
// The cnt largest entries of v (n), largest first; equal values: the lower index first (the CPU's
// select_topk). Called by all 32 lanes of a warp with cnt <= n. Lane l owns indices l, l + 32, ...; each
// step every lane takes its best untaken index (ascending scan, strict ">": the lowest index among its
// maxima), then a butterfly over (value, index) gives every lane the same winner (the comparison is a total
// order: larger value, then lower index). taken (n) is warp scratch in shared memory; afterwards taken[i]
// marks the chosen. Lane 0 writes out[k] unless out is NULL. Ends with __syncwarp.
__device__ void warp_select_topk(int *out, const float *v, unsigned char *taken, int n, int cnt) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < n; i += 32) taken[i] = 0;
    __syncwarp();
    for (int k = 0; k < cnt; k++) {
        float best_v = 0.0f;
        int best_i = -1;
        for (int i = lane; i < n; i += 32) {
            if (taken[i]) continue;
            const float x = v[i];
            if (best_i < 0 || x > best_v) { best_v = x; best_i = i; }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other_v = __shfl_xor_sync(FULL_MASK, best_v, offset);
            const int other_i = __shfl_xor_sync(FULL_MASK, best_i, offset);
            if (other_i >= 0 && (best_i < 0 || other_v > best_v || (other_v == best_v && other_i < best_i))) {
                best_v = other_v;
                best_i = other_i;
            }
        }
        if (lane == 0 && out != NULL) out[k] = best_i;
        if (best_i >= 0 && (best_i & 31) == lane) taken[best_i] = 1;
        __syncwarp();
    }
}

// The CPU's sigmoid_real: computed in double and rounded once (no overflow of exp for large |x|).
__device__ inline float sigmoid_ref(float x) {
    const double xd = (double)x;
    if (xd >= 0.0) return (float)(1.0 / (1.0 + exp(-xd)));
    const double e = exp(xd);
    return (float)(e / (1.0 + e));
}

// ---------------------------------------------------------------------------- router forward
// Per-warp shared memory of the router: scores (E) f32, masked biased scores (E) f32, group scores (G) f32,
// chosen experts (K) int, taken flags (E) bytes.
static size_t router_warp_bytes(int E, int G, int K) {
    const size_t bytes = 4 * (size_t)E + 4 * (size_t)E + 4 * (size_t)G + 4 * (size_t)K + (size_t)E;
    return (bytes + 15) / 16 * 16;
}

// logits (N, E), bias (E) or NULL -> scores (N, E), topk_idx (N, K) (input when freeze), topk_w (N, K).
// One warp per token t; see kernels.h and the CPU's cpu_router_forward for the steps.
__global__ void router_forward_kernel(int *topk_idx, float *topk_w, float *scores, const float *logits,
                                      const float *bias, int N, int E, int K, int G, int L, float route_scale,
                                      int freeze, size_t warp_bytes, unsigned long long *err_nan,
                                      unsigned long long *err_frozen) {
    extern __shared__ __align__(16) unsigned char router_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= N) return; // the whole warp leaves together; no block-wide barrier follows
    unsigned char *base = router_smem + warp * warp_bytes;
    float *sc = (float *)base;
    float *masked = sc + E;
    float *group_score = masked + E;
    int *chosen = (int *)(group_score + G);
    unsigned char *taken = (unsigned char *)(chosen + K);

    const float *lt = logits + t * E;
    float *st = scores + t * E;
    for (int e = lane; e < E; e += 32) {
        const float x = lt[e];
        if (isnan(x)) record_error(err_nan, t * E + e, 0);
        const float s = sigmoid_ref(x);
        sc[e] = s;
        st[e] = s;
        // biased scores choose the experts; the bias never reaches the weights
        masked[e] = bias != NULL ? __fadd_rn(s, bias[e]) : __fadd_rn(s, 0.0f);
    }
    __syncwarp();

    if (!freeze) {
        if (L < G) {
            // group score = top1 + top2 of the biased scores inside the group (both start at -inf: biased
            // scores may all be negative); lane g&31 scans group g in expert order, as the CPU does
            const int group_size = E / G;
            for (int g = lane; g < G; g += 32) {
                float top1 = -INFINITY, top2 = -INFINITY;
                for (int e = g * group_size; e < (g + 1) * group_size; e++) {
                    const float m = masked[e];
                    if (m > top1) { top2 = top1; top1 = m; }
                    else if (m > top2) top2 = m;
                }
                group_score[g] = __fadd_rn(top1, top2);
            }
            __syncwarp();
            warp_select_topk(NULL, group_score, taken, G, L); // taken[g] marks the kept groups
            for (int e = lane; e < E; e += 32)
                if (!taken[e / group_size]) masked[e] = -INFINITY; // never multiplied by 0
            __syncwarp();
        }
        warp_select_topk(chosen, masked, taken, E, K);
    } else if (lane == 0) {
        for (int k = 0; k < K; k++) {
            int e = topk_idx[t * K + k];
            if (e < 0 || e >= E) {
                record_error(err_frozen, t * K + k, e);
                e = 0; // keep reads in bounds; the op reports the error
            }
            chosen[k] = e;
        }
    }
    __syncwarp();

    // w_k = s_{i_k} / S * route_scale with the UNBIASED scores, S summed in k order
    if (lane == 0) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum = __fadd_rn(sum, sc[chosen[k]]);
        for (int k = 0; k < K; k++) {
            if (!freeze) topk_idx[t * K + k] = chosen[k];
            topk_w[t * K + k] = __fmul_rn(__fdiv_rn(sc[chosen[k]], sum), route_scale);
        }
    }
}

extern "C" void cuda_router_forward(int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias,
                                    int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze) {
    // the CPU op's argument checks, same messages
    MOE_CHECK(N >= 0 && E >= 1, "router_forward: N = %d, E = %d; expected N >= 0 and E >= 1", N, E);
    MOE_CHECK(K >= 1 && K <= E, "router_forward: n_activated_experts K = %d; expected 1 <= K <= E = %d", K, E);
    MOE_CHECK(n_groups >= 1 && E % n_groups == 0,
              "router_forward: n_expert_groups = %d does not divide n_routed_experts = %d; expected a divisor of E",
              n_groups, E);
    const int group_size = E / n_groups;
    MOE_CHECK(n_groups == 1 || group_size >= 2,
              "router_forward: %d experts per group; expected >= 2 (the group score is the sum of the top-2 experts "
              "of the group)", group_size);
    MOE_CHECK(n_limited >= 1 && n_limited <= n_groups,
              "router_forward: n_limited_groups = %d; expected 1 <= n_limited_groups <= n_expert_groups = %d",
              n_limited, n_groups);
    MOE_CHECK(K <= n_limited * group_size,
              "router_forward: K = %d experts per token, but the %d kept groups hold only %d experts; expected K <= "
              "n_limited_groups * E / n_expert_groups", K, n_limited, n_limited * group_size);
    if (N == 0) return;
    const size_t warp_bytes = router_warp_bytes(E, n_groups, K);
    MOE_CHECK(warp_bytes <= MAX_SHARED_BYTES,
              "router_forward: E = %d experts need %zu bytes of shared memory per token; at most %zu supported",
              E, warp_bytes, MAX_SHARED_BYTES);
    int warps = (int)(MAX_SHARED_BYTES / warp_bytes);
    if (warps > WARPS_PER_BLOCK) warps = WARPS_PER_BLOCK;
    unsigned long long *err_nan = err_slot_reset(ERR_ROUTER_NAN_LOGIT, E, E);
    unsigned long long *err_frozen = err_slot_reset(ERR_ROUTER_FROZEN_INDEX, K, E);
    const unsigned int blocks = (unsigned int)((N + warps - 1) / warps);
    router_forward_kernel<<<blocks, warps * 32, warps * warp_bytes>>>(topk_idx, topk_w, scores, logits, bias, N, E, K,
                                                                     n_groups, n_limited, route_scale, freeze,
                                                                     warp_bytes, err_nan, err_frozen);
    CUDA_CHECK_LAUNCH("router_forward_kernel");
    report_errors();
}

// ---------------------------------------------------------------------------- router backward
// In the forward pass this was, per token: s = sigmoid(logit); w_k = r s_{i_k} / S, S = sum_j s_{i_j}.
// So, with G = sum_k dw_k s_{i_k}:
//   dL/ds_{i_k} = r (dw_k / S - G / S^2)  (summed in k order if an index repeats under freeze)
//   dL/ds_e    += dscores_e               (balance loss, when given)
//   dlogit_e   += dL/ds_e * s_e (1 - s_e)
// in double, as the CPU. One warp per token; every lane computes S and G (same order, same bits), then lane l
// handles experts l, l + 32, ...
__global__ void router_backward_kernel(float *dlogits, const float *dtopk_w, const float *dscores,
                                       const int *topk_idx, const float *scores, int N, int E, int K,
                                       double route_scale, unsigned long long *err) {
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= N) return;
    const float *st = scores + t * E;
    const int *it = topk_idx + t * K;
    const float *dwt = dtopk_w != NULL ? dtopk_w + t * K : NULL;
    double S = 0.0, G = 0.0;
    if (dwt != NULL) {
        for (int k = 0; k < K; k++) {
            const int e = it[k];
            if (e < 0 || e >= E) { // skipped, reported
                if (lane == 0) record_error(err, t * K + k, e);
                continue;
            }
            const double s = (double)st[e];
            S = __dadd_rn(S, s);
            G = __dadd_rn(G, __dmul_rn((double)dwt[k], s));
        }
    }
    const double G_over_S2 = __ddiv_rn(G, __dmul_rn(S, S));
    for (int e = lane; e < E; e += 32) {
        double d = dscores != NULL ? (double)dscores[t * E + e] : 0.0;
        if (dwt != NULL) {
            for (int k = 0; k < K; k++)
                if (it[k] == e) d = __dadd_rn(d, __dmul_rn(route_scale, __dsub_rn(__ddiv_rn((double)dwt[k], S), G_over_S2)));
        }
        const double s = (double)st[e];
        float *dt = dlogits + t * E + e;
        *dt = __fadd_rn(*dt, (float)__dmul_rn(__dmul_rn(d, s), __dsub_rn(1.0, s)));
    }
}

extern "C" void cuda_router_backward(real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx,
                                     const real *scores, int N, int E, int K, real route_scale) {
    if (dlogits == NULL || (dtopk_w == NULL && dscores == NULL) || N <= 0 || E <= 0) return;
    MOE_CHECK(dtopk_w == NULL || K >= 1, "router_backward: K = %d; expected K >= 1", K);
    unsigned long long *err = err_slot_reset(ERR_ROUTER_BACKWARD_INDEX, K >= 1 ? K : 1, E);
    const unsigned int blocks = (unsigned int)((N + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK);
    router_backward_kernel<<<blocks, WARPS_PER_BLOCK * 32>>>(dlogits, dtopk_w, dscores, topk_idx, scores, N, E, K,
                                                             (double)route_scale, err);
    CUDA_CHECK_LAUNCH("router_backward_kernel");
    if (cuda_sync_after_launch()) report_errors();
}

// ---------------------------------------------------------------------------- balance loss forward
// Kernel 1, one warp per token t of B*T: plain top-K of the unbiased scores (unless frozen: then checked),
// the sequence's expert counts (integer atomics: order-free), and row_sum[t] = S_t = sum_e s_te in double,
// in e order (lane 0, as the CPU).
__global__ void balance_topk_kernel(int *plain_topk, double *row_sum, int *count, const float *scores, int N, int T,
                                    int E, int K, int freeze, size_t warp_bytes, unsigned long long *err) {
    extern __shared__ __align__(16) unsigned char balance_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= N) return;
    int *chosen = (int *)(balance_smem + warp * warp_bytes);
    unsigned char *taken = (unsigned char *)(chosen + K);
    const float *st = scores + t * E;
    int *it = plain_topk + t * K;
    if (!freeze) {
        warp_select_topk(chosen, st, taken, E, K);
        for (int k = lane; k < K; k += 32) it[k] = chosen[k];
    }
    const int64_t b = t / T;
    for (int k = lane; k < K; k += 32) {
        const int e = freeze ? it[k] : chosen[k];
        if (e < 0 || e >= E) {
            record_error(err, t * K + k, e);
            continue;
        }
        atomicAdd(&count[b * E + e], 1);
    }
    if (lane == 0) {
        double S = 0.0;
        for (int e = 0; e < E; e++) S = __dadd_rn(S, (double)st[e]);
        row_sum[t] = S;
    }
}

// Kernel 2: partial[b][chunk][e] = sum over the chunk's tokens t, in order, of s_te / S_t (double).
__global__ void balance_partial_kernel(double *partial, const float *scores, const double *row_sum, int B, int T,
                                       int E, int n_chunks, int chunk_len) {
    const int64_t n = (int64_t)B * n_chunks * E;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int e = (int)(i % E);
        const int64_t bc = i / E;
        const int chunk = (int)(bc % n_chunks);
        const int64_t b = bc / n_chunks;
        const int t0 = chunk * chunk_len, t1 = t0 + chunk_len < T ? t0 + chunk_len : T;
        double p = 0.0;
        for (int t = t0; t < t1; t++) {
            const int64_t row = b * T + t;
            p = __dadd_rn(p, __ddiv_rn((double)scores[row * E + e], row_sum[row]));
        }
        partial[i] = p;
    }
}

// Kernel 3: P[b][e] = (sum of the chunks' partials in chunk order) / T.
__global__ void balance_finish_kernel(double *P, const double *partial, int B, int T, int E, int n_chunks) {
    const int64_t n = (int64_t)B * E;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int e = (int)(i % E);
        const int64_t b = i / E;
        double p = 0.0;
        for (int c = 0; c < n_chunks; c++) p = __dadd_rn(p, partial[(b * n_chunks + c) * E + e]);
        P[i] = __ddiv_rn(p, (double)T);
    }
}

// Tokens per partial sum of P: enough threads (B * T/64 * E) for the GPU, short sequential sums.
static const int BALANCE_CHUNK = 64;
static Scratch bal_row_sum, bal_count, bal_partial, bal_P;

static void check_balance_shape(const char *op, int B, int T, int E, int K) {
    MOE_CHECK(B >= 1 && T >= 1 && E >= 1 && K >= 1 && K <= E,
              "%s: B = %d, T = %d, E = %d, K = %d; expected B, T, E >= 1 and 1 <= K <= E", op, B, T, E, K);
}

// Zeroed per-sequence expert counts (B, E) in scratch.
static int *balance_counts(int B, int E) {
    int *count = (int *)cuda_scratch(&bal_count, sizeof(int) * (size_t)B * E);
    CUDA_CHECK(cudaMemset(count, 0, sizeof(int) * (size_t)B * E));
    return count;
}

// scores (B*T, E) -> plain_topk (B*T, K) (output, or input when freeze); returns
// mean_b alpha sum_i f_i P_i, f_i = E/(K T) #{t : i in plain_topk_t}, P_i = (1/T) sum_t s_ti / S_t.
// The last step (B*E terms) runs on the host in the CPU's order, from P and the counts copied back.
extern "C" real cuda_balance_loss_forward(int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha,
                                          int freeze) {
    check_balance_shape("balance_loss_forward", B, T, E, K);
    const int N = B * T;
    const size_t warp_bytes = (4 * (size_t)K + (size_t)E + 15) / 16 * 16;
    MOE_CHECK(warp_bytes <= MAX_SHARED_BYTES,
              "balance_loss_forward: E = %d, K = %d need %zu bytes of shared memory per token; at most %zu supported",
              E, K, warp_bytes, MAX_SHARED_BYTES);
    int warps = (int)(MAX_SHARED_BYTES / warp_bytes);
    if (warps > WARPS_PER_BLOCK) warps = WARPS_PER_BLOCK;
    unsigned long long *err = err_slot_reset(ERR_BALANCE_FROZEN_INDEX, K, E);
    double *row_sum = (double *)cuda_scratch(&bal_row_sum, sizeof(double) * (size_t)N);
    int *count = balance_counts(B, E);
    balance_topk_kernel<<<(unsigned int)((N + warps - 1) / warps), warps * 32, warps * warp_bytes>>>(
        plain_topk, row_sum, count, scores, N, T, E, K, freeze, warp_bytes, err);
    CUDA_CHECK_LAUNCH("balance_topk_kernel");

    const int n_chunks = (T + BALANCE_CHUNK - 1) / BALANCE_CHUNK;
    const int64_t n_partial = (int64_t)B * n_chunks * E;
    double *partial = (double *)cuda_scratch(&bal_partial, sizeof(double) * (size_t)n_partial);
    double *P = (double *)cuda_scratch(&bal_P, sizeof(double) * (size_t)B * E);
    balance_partial_kernel<<<grid_for(n_partial, MOE_THREADS), MOE_THREADS>>>(partial, scores, row_sum, B, T, E,
                                                                              n_chunks, BALANCE_CHUNK);
    CUDA_CHECK_LAUNCH("balance_partial_kernel");
    balance_finish_kernel<<<grid_for((int64_t)B * E, MOE_THREADS), MOE_THREADS>>>(P, partial, B, T, E, n_chunks);
    CUDA_CHECK_LAUNCH("balance_finish_kernel");
    report_errors();

    double *host_P = (double *)malloc(sizeof(double) * (size_t)B * E);
    int *host_count = (int *)malloc(sizeof(int) * (size_t)B * E);
    MOE_CHECK(host_P != NULL && host_count != NULL, "balance_loss_forward: out of memory (%d x %d values)", B, E);
    CUDA_CHECK(cudaMemcpy(host_P, P, sizeof(double) * (size_t)B * E, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(host_count, count, sizeof(int) * (size_t)B * E, cudaMemcpyDeviceToHost));
    double total = 0.0;
    for (int b = 0; b < B; b++) {
        double loss = 0.0;
        for (int e = 0; e < E; e++)
            loss += ((double)E / ((double)K * T) * (double)host_count[(size_t)b * E + e]) * host_P[(size_t)b * E + e];
        total += (double)alpha * loss;
    }
    free(host_P);
    free(host_count);
    return (real)(total / B);
}

// ---------------------------------------------------------------------------- balance loss backward
// count[b][e] = #{entries of plain_topk in sequence b equal to e}; out-of-range entries skipped and recorded.
__global__ void balance_count_kernel(int *count, const int *plain_topk, int64_t n, int TK, int E,
                                     unsigned long long *err) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int e = plain_topk[i];
        if (e < 0 || e >= E) {
            record_error(err, i, e);
            continue;
        }
        atomicAdd(&count[(i / TK) * E + e], 1);
    }
}

// In the forward pass this was, per sequence: L_b = alpha sum_i f_i (1/T) sum_t s_ti / S_t, and the op
// returned mean_b L_b, with f held constant. So:
//   dL/ds_tj = dloss alpha / (B T) (f_j - F_t) / S_t,   F_t = sum_i f_i s_ti / S_t,   c = dloss alpha / (B T).
// One warp per token; every lane computes S_t and F_t in e order (same bits as the CPU), lane l writes
// experts l, l + 32, ...
__global__ void balance_backward_kernel(float *dscores, const int *count, const float *scores, int N, int T, int E,
                                        double f_scale, double c) {
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= N) return;
    const int *cb = count + (t / T) * E;
    const float *st = scores + t * E;
    double S = 0.0, fs = 0.0;
    for (int e = 0; e < E; e++) {
        const double s = (double)st[e];
        S = __dadd_rn(S, s);
        fs = __dadd_rn(fs, __dmul_rn(__dmul_rn((double)cb[e], f_scale), s));
    }
    const double F = __ddiv_rn(fs, S);
    for (int e = lane; e < E; e += 32) {
        const double f = __dmul_rn((double)cb[e], f_scale);
        float *dt = dscores + t * E + e;
        *dt = __fadd_rn(*dt, (float)__ddiv_rn(__dmul_rn(c, __dsub_rn(f, F)), S));
    }
}

extern "C" void cuda_balance_loss_backward(real *dscores, const int *plain_topk, const real *scores, int B, int T,
                                           int E, int K, real alpha, real dloss) {
    if (dscores == NULL) return;
    check_balance_shape("balance_loss_backward", B, T, E, K);
    const int N = B * T;
    unsigned long long *err = err_slot_reset(ERR_BALANCE_BACKWARD_INDEX, K, E);
    int *count = balance_counts(B, E);
    const int64_t n = (int64_t)N * K;
    balance_count_kernel<<<grid_for(n, MOE_THREADS), MOE_THREADS>>>(count, plain_topk, n, T * K, E, err);
    CUDA_CHECK_LAUNCH("balance_count_kernel");
    // the CPU's f[e] = (count of 1.0 additions) * E/(K T) and c, in the same double expressions
    const double f_scale = (double)E / ((double)K * T);
    const double c = (double)dloss * (double)alpha / ((double)B * T);
    balance_backward_kernel<<<(unsigned int)((N + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK), WARPS_PER_BLOCK * 32>>>(
        dscores, count, scores, N, T, E, f_scale, c);
    CUDA_CHECK_LAUNCH("balance_backward_kernel");
    if (cuda_sync_after_launch()) report_errors();
}

// ---------------------------------------------------------------------------- permutation plan
// keys (n) = topk_idx with out-of-range entries recorded and replaced by 0 (the op then stops), slots (n) = i.
__global__ void plan_keys_kernel(int *keys, int *slots, const int *topk_idx, int64_t n, int E,
                                 unsigned long long *err) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int e = topk_idx[i];
        if (e < 0 || e >= E) {
            record_error(err, i, e);
            e = 0;
        }
        keys[i] = e;
        slots[i] = (int)i;
    }
}

// Permuted row r holds slot sorted_slots[r] = t * K + k: seg_token[r] = t, slot_of[t * K + k] = r.
__global__ void plan_fill_kernel(int *seg_token, int *slot_of, const int *sorted_slots, int64_t n, int K) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < n; r += (int64_t)gridDim.x * blockDim.x) {
        const int slot = sorted_slots[r];
        seg_token[r] = slot / K;
        slot_of[slot] = (int)r;
    }
}

// seg_offsets[e] = first position of sorted_keys (n, ascending) with key >= e, for e = 0..E (E gives n).
__global__ void plan_offsets_kernel(int *seg_offsets, const int *sorted_keys, int n, int E) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e <= E; e += gridDim.x * blockDim.x) {
        int lo = 0, hi = n;
        while (lo < hi) {
            const int mid = lo + (hi - lo) / 2;
            if (sorted_keys[mid] < e) lo = mid + 1;
            else hi = mid;
        }
        seg_offsets[e] = lo;
    }
}

static Scratch plan_keys, plan_slots, plan_sorted_keys, plan_sorted_slots, plan_sort_temp;

// topk_idx (N, K) -> seg_offsets (E+1), seg_token (N*K), slot_of (N*K), all device arrays; see kernels.h.
extern "C" void cuda_moe_permute_plan(int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx, int N,
                                      int K, int E) {
    MOE_CHECK(N >= 0 && K >= 1 && E >= 1, "moe_permute_plan: N = %d, K = %d, E = %d; expected N >= 0, K >= 1, E >= 1",
              N, K, E);
    const int64_t n = (int64_t)N * K;
    MOE_CHECK(n <= 0x7FFFFFFF, "moe_permute_plan: N * K = %lld slots; expected at most 2^31 - 1 (int32 row ids)",
              (long long)n);
    if (n == 0) {
        CUDA_CHECK(cudaMemset(seg_offsets, 0, sizeof(int) * (size_t)(E + 1)));
        return;
    }
    unsigned long long *err = err_slot_reset(ERR_PLAN_INDEX, K, E);
    int *keys = (int *)cuda_scratch(&plan_keys, sizeof(int) * (size_t)n);
    int *slots = (int *)cuda_scratch(&plan_slots, sizeof(int) * (size_t)n);
    int *sorted_keys = (int *)cuda_scratch(&plan_sorted_keys, sizeof(int) * (size_t)n);
    int *sorted_slots = (int *)cuda_scratch(&plan_sorted_slots, sizeof(int) * (size_t)n);
    plan_keys_kernel<<<grid_for(n, MOE_THREADS), MOE_THREADS>>>(keys, slots, topk_idx, n, E, err);
    CUDA_CHECK_LAUNCH("plan_keys_kernel");
    // sort by the low bits that hold 0..E-1 (keys are in range now); stable, so (t, k) order within an expert
    int bits = 1;
    while (bits < 31 && (1 << bits) < E) bits++;
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, keys, sorted_keys, slots, sorted_slots, (int)n, 0, bits));
    void *temp = cuda_scratch(&plan_sort_temp, temp_bytes);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, slots, sorted_slots, (int)n, 0, bits));
    CUDA_CHECK_LAUNCH("cub::DeviceRadixSort::SortPairs (moe_permute_plan)");
    plan_fill_kernel<<<grid_for(n, MOE_THREADS), MOE_THREADS>>>(seg_token, slot_of, sorted_slots, n, K);
    CUDA_CHECK_LAUNCH("plan_fill_kernel");
    plan_offsets_kernel<<<grid_for((int64_t)E + 1, MOE_THREADS), MOE_THREADS>>>(seg_offsets, sorted_keys, (int)n, E);
    CUDA_CHECK_LAUNCH("plan_offsets_kernel");
    report_errors();
}

// ---------------------------------------------------------------------------- gather and its adjoint
// out (n_rows, C) = inp[src_row[r]] for each row r. One block per row; 16-byte copies when C and the
// pointers allow.
template <bool VEC4>
__global__ void gather_rows_kernel(float *out, const float *inp, const int *src_row, int C) {
    const int64_t r = blockIdx.x;
    const int64_t src = src_row[r];
    if (VEC4) {
        const float4 *s = reinterpret_cast<const float4 *>(inp + src * C);
        float4 *d = reinterpret_cast<float4 *>(out + r * C);
        for (int c = threadIdx.x; c < C / 4; c += blockDim.x) d[c] = s[c];
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) out[r * C + c] = inp[src * C + c];
    }
}

extern "C" void cuda_gather_rows(real *out, const real *inp, const int *src_row, int n_rows, int C) {
    if (n_rows <= 0 || C <= 0) return;
    if (C % 4 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)inp % 16 == 0)
        gather_rows_kernel<true><<<n_rows, MOE_THREADS>>>(out, inp, src_row, C);
    else
        gather_rows_kernel<false><<<n_rows, MOE_THREADS>>>(out, inp, src_row, C);
    CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

// In the forward pass this was xp[slot_of[t,k]] = x[t] for every k, so
// dinp (N, C) += sum_k dseg[slot_of[t,k]] (dseg (N*K, C)), k in order. One block per token t.
__global__ void moe_unpermute_backward_kernel(float *dinp, const float *dseg, const int *slot_of, int K, int C) {
    extern __shared__ int unpermute_slots[];
    const int64_t t = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) unpermute_slots[k] = slot_of[t * K + k];
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = dinp[t * C + c];
        for (int k = 0; k < K; k++) acc = __fadd_rn(acc, dseg[(int64_t)unpermute_slots[k] * C + c]);
        dinp[t * C + c] = acc;
    }
}

extern "C" void cuda_moe_unpermute_backward(real *dinp, const real *dseg, const int *slot_of, int N, int K, int C) {
    if (dinp == NULL || N <= 0 || K <= 0 || C <= 0) return;
    moe_unpermute_backward_kernel<<<N, MOE_THREADS, sizeof(int) * (size_t)K>>>(dinp, dseg, slot_of, K, C);
    CUDA_CHECK_LAUNCH("moe_unpermute_backward_kernel");
}

// ---------------------------------------------------------------------------- combine
// The value of an expert output element: FP32, or BF16 bits (the *_bf16 ops) widened exactly; and four consecutive
// ones (16-byte FP32 or 8-byte BF16 loads).
__device__ inline float expert_value(float v) { return v; }
__device__ inline float expert_value(uint16_t v) { return bf16_bits_to_float(v); }
__device__ inline float4 expert_values4(const float *p) { return *reinterpret_cast<const float4 *>(p); }
__device__ inline float4 expert_values4(const uint16_t *p) {
    return bf16x4_to_float4(*reinterpret_cast<const uint2 *>(p));
}

// Column quads per thread whose loads are in flight together in the vector form of the combine.
static const int COMBINE_QUADS = 2;

// The combine (below) of NQ quads of 4 columns, c0, c0 + step, ...: every one in range, so that no branch stands
// between the K slots' loads.
template <typename E, int NQ>
__device__ inline void combine_quads(float *out_row, const uint16_t *base_row, const E *__restrict__ expert_out,
                                     int64_t ld, const int *slots, const float *w, const float *res_row, int K, int c0,
                                     int step) {
    float4 acc[NQ];
#pragma unroll
    for (int q = 0; q < NQ; q++)
        acc[q] = base_row != NULL ? expert_values4(base_row + c0 + q * step)
                                  : *reinterpret_cast<const float4 *>(out_row + c0 + q * step);
#pragma unroll 4
    for (int k = 0; k < K; k++) {
        const E *row = expert_out + (int64_t)slots[k] * ld + c0;
        const float wk = w[k];
#pragma unroll
        for (int q = 0; q < NQ; q++) {
            const float4 v = expert_values4(row + q * step);
            acc[q].x = __fadd_rn(acc[q].x, __fmul_rn(wk, v.x));
            acc[q].y = __fadd_rn(acc[q].y, __fmul_rn(wk, v.y));
            acc[q].z = __fadd_rn(acc[q].z, __fmul_rn(wk, v.z));
            acc[q].w = __fadd_rn(acc[q].w, __fmul_rn(wk, v.w));
        }
    }
#pragma unroll
    for (int q = 0; q < NQ; q++) {
        if (res_row != NULL) {
            const float4 r = *reinterpret_cast<const float4 *>(res_row + c0 + q * step);
            acc[q].x = __fadd_rn(acc[q].x, r.x), acc[q].y = __fadd_rn(acc[q].y, r.y);
            acc[q].z = __fadd_rn(acc[q].z, r.z), acc[q].w = __fadd_rn(acc[q].w, r.w);
        }
        *reinterpret_cast<float4 *>(out_row + c0 + q * step) = acc[q];
    }
}

// expert_out (N*K rows of stride ld) permuted rows, slot_of (N*K), topk_w (N, K) ->
// out (N, C) += sum_k topk_w[t,k] * expert_out[slot_of[t,k]], k in order, then += residual[t] when given (with base,
// BF16 rows of stride bf16_rows_ld(C): out = base's values + ..., kernels.h moe_combine_forward_bf16). One
// block per token t. VEC4 (C, ld and the pointers allow it): each thread takes COMBINE_QUADS quads of 4 columns at
// a time, so that 8 to 16 bytes per load and all of a quad group's K loads are in flight at once; the scalar form
// had one 2- or 4-byte load per slot in flight and reached about half the memory bandwidth (an H100 profile of the
// bench model: 0.353 ms for 16,384 tokens x 6 slots x 2,048 BF16 columns). The same expressions in the same order
// either way.
template <typename E, bool VEC4>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_combine_forward_kernel(float *__restrict__ out, const uint16_t *__restrict__ base, int64_t base_ld,
                               const E *__restrict__ expert_out, int64_t ld, const int *slot_of, const float *topk_w,
                               const float *__restrict__ residual, int K, int C) {
    extern __shared__ int combine_shared[]; // slots (K) int, then weights (K) float
    int *slots = combine_shared;
    float *w = (float *)(combine_shared + K);
    const int64_t t = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        slots[k] = slot_of[t * K + k];
        w[k] = topk_w[t * K + k];
    }
    __syncthreads();
    float *out_row = out + t * C;
    const float *res_row = residual != NULL ? residual + t * C : NULL;
    const uint16_t *base_row = base != NULL ? base + t * base_ld : NULL;
    if constexpr (VEC4) {
        const int step = 4 * (int)blockDim.x;
        for (int c0 = 4 * (int)threadIdx.x; c0 < C; c0 += COMBINE_QUADS * step) {
            if (c0 + (COMBINE_QUADS - 1) * step < C)
                combine_quads<E, COMBINE_QUADS>(out_row, base_row, expert_out, ld, slots, w, res_row, K, c0, step);
            else
                for (int c = c0; c < C; c += step)
                    combine_quads<E, 1>(out_row, base_row, expert_out, ld, slots, w, res_row, K, c, step);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = base_row != NULL ? expert_value(base_row[c]) : out_row[c];
            for (int k = 0; k < K; k++)
                acc = __fadd_rn(acc, __fmul_rn(w[k], expert_value(expert_out[(int64_t)slots[k] * ld + c])));
            if (res_row != NULL) acc = __fadd_rn(acc, res_row[c]);
            out_row[c] = acc;
        }
    }
}

// The vector form when C, ld and every row start allow 16-byte FP32 and 4-value expert loads.
template <typename E>
static void combine_forward(float *out, const uint16_t *base, const E *expert_out, int64_t ld, const int *slot_of,
                            const float *topk_w, const float *residual, int N, int K, int C) {
    if (N <= 0 || K <= 0 || C <= 0) return;
    const size_t shared = 2 * sizeof(int) * (size_t)K;
    const bool vec4 = C % 4 == 0 && ld % 4 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)residual % 16 == 0 &&
                      (uintptr_t)base % 8 == 0 && (uintptr_t)expert_out % (4 * sizeof(E)) == 0;
    if (vec4)
        moe_combine_forward_kernel<E, true><<<N, MOE_THREADS, shared>>>(out, base, bf16_rows_ld(C), expert_out, ld,
                                                                        slot_of, topk_w, residual, K, C);
    else
        moe_combine_forward_kernel<E, false><<<N, MOE_THREADS, shared>>>(out, base, bf16_rows_ld(C), expert_out, ld,
                                                                         slot_of, topk_w, residual, K, C);
    CUDA_CHECK_LAUNCH("moe_combine_forward_kernel");
}

extern "C" void cuda_moe_combine_forward(real *out, const real *expert_out, const int *slot_of, const real *topk_w,
                                         const real *residual, int N, int K, int C) {
    combine_forward(out, NULL, expert_out, C, slot_of, topk_w, residual, N, K, C);
}

extern "C" void cuda_moe_combine_forward_bf16(real *out, const uint16_t *base, const uint16_t *expert_out,
                                              const int *slot_of, const real *topk_w, const real *residual, int N,
                                              int K, int C) {
    combine_forward(out, base, expert_out, bf16_rows_ld(C), slot_of, topk_w, residual, N, K, C);
}

__device__ inline double warp_sum_double(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = __dadd_rn(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// One unit of a row for combine backward: a float, or a float4 when C % 4 == 0 and the rows are 16-byte aligned.
// w * d is one __fmul_rn per float (the CPU's bits); the dot product adds exact double products in x, y, z, w order.
__device__ inline float scale_rn(float w, float d) { return __fmul_rn(w, d); }
__device__ inline float4 scale_rn(float w, float4 d) {
    return make_float4(__fmul_rn(w, d.x), __fmul_rn(w, d.y), __fmul_rn(w, d.z), __fmul_rn(w, d.w));
}
__device__ inline double dot_add(double acc, float a, float b) { return __dadd_rn(acc, __dmul_rn((double)a, (double)b)); }
// Unit u of a row of expert outputs (element u * (units per element) from `row`): FP32 as it is, BF16 widened.
__device__ inline float load_unit(const float *row, int64_t u, float) { return row[u]; }
__device__ inline float4 load_unit(const float *row, int64_t u, float4) { return reinterpret_cast<const float4 *>(row)[u]; }
__device__ inline float load_unit(const uint16_t *row, int64_t u, float) { return expert_value(row[u]); }
__device__ inline float4 load_unit(const uint16_t *row, int64_t u, float4) {
    return bf16x4_to_float4(reinterpret_cast<const uint2 *>(row)[u]);  // 4 BF16 values
}
__device__ inline double dot_add(double acc, float4 a, float4 b) {
    return dot_add(dot_add(dot_add(dot_add(acc, a.x, b.x), a.y, b.y), a.z, b.z), a.w, b.w);
}

// In the forward pass this was out[t] += sum_k w[t,k] * expert_out[slot_of[t,k]], so:
//   dexpert_out[slot_of[t,k]] (N*K, C)  = w[t,k] * dout[t]                        (written; the CPU's bits)
//   dtopk_w[t,k] (N, K)               += dot(dout[t], expert_out[slot_of[t,k]])  (in double)
// for the NK slots k = k0 .. k0 + NK - 1 of every token. Either gradient may be NULL (a block-uniform test).
// The op is pure memory traffic - read dout and expert_out, write dexpert_out, ~1.7 GB at N = 16384, K = 6,
// C = 2048 - so it is built to move every byte once, in 16-byte accesses on the float4 path, with many loads
// in flight:
//   - one block per token t; each thread loads a unit of dout[t] once and uses it for all NK slots;
//   - NK is a template argument, so the slot loops unroll with no per-slot tests and a unit's NK loads of
//     expert_out are issued back to back and wait together (the pointers are __restrict__: dexpert_out must
//     not overlap expert_out), and the kernel holds only the registers that NK needs;
//   - the NK dot products accumulate in registers over the one pass and are reduced together at its end: one
//     barrier pair per block instead of one block reduction (two barriers) per slot.
// dtopk_w's order is fixed by blockDim.x and C only, never by timing: each thread sums its units in column order,
// a warp butterfly per slot, the warps' partials through shared memory, and thread j adds them in warp order.
// (blockDim.x and the unit follow from C and the pointers' alignment, so a call with the same shapes and
// alignments gives the same bits.) No atomics; slot_of is a permutation, so blocks write disjoint rows.
// expert_out's rows are ld elements of E apart (E float: ld = C; uint16_t: the BF16 rows of the *_bf16 op).
template <typename Unit, int NK, typename E>
__global__ void __launch_bounds__(MOE_THREADS)
moe_combine_backward_kernel(float *__restrict__ dexpert_out, float *__restrict__ dtopk_w,
                            const float *__restrict__ dout, const E *__restrict__ expert_out, int64_t ld,
                            const int *__restrict__ slot_of, const float *__restrict__ topk_w, int k0, int K, int C) {
    __shared__ double warp_dots[NK][32];
    const int64_t t = blockIdx.x;
    const int per_unit = (int)(sizeof(Unit) / sizeof(float)), units = C / per_unit; // per row
    const Unit *dt = reinterpret_cast<const Unit *>(dout) + t * units;
    Unit *de = reinterpret_cast<Unit *>(dexpert_out);
    int64_t row[NK]; // unit offset of slot k0 + j's row in dexpert_out, and its element offset in expert_out
    const E *eo[NK];
    float w[NK];
    double dot[NK];
#pragma unroll
    for (int j = 0; j < NK; j++) {
        const int64_t slot = slot_of[t * K + k0 + j];
        row[j] = slot * units, eo[j] = expert_out + slot * ld;
        w[j] = topk_w[t * K + k0 + j];
        dot[j] = 0.0;
    }
    for (int c = threadIdx.x; c < units; c += blockDim.x) {
        // every load of the unit first, so they are in flight together; then the stores and the dot products
        const Unit d = dt[c];
        Unit e[NK];
        if (dtopk_w != NULL) {
#pragma unroll
            for (int j = 0; j < NK; j++) e[j] = load_unit(eo[j], c, Unit());
        }
        if (dexpert_out != NULL) {
#pragma unroll
            for (int j = 0; j < NK; j++) de[row[j] + c] = scale_rn(w[j], d);
        }
        if (dtopk_w != NULL) {
#pragma unroll
            for (int j = 0; j < NK; j++) dot[j] = dot_add(dot[j], d, e[j]);
        }
    }
    if (dtopk_w == NULL) return; // uniform over the block: every thread reaches the barrier below or none does
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < NK; j++) {
        const double v = warp_sum_double(dot[j]);
        if (lane == 0) warp_dots[j][warp] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < NK) {
        double sum = 0.0;
        for (int i = 0; i < n_warps; i++) sum = __dadd_rn(sum, warp_dots[threadIdx.x][i]);
        float *dw = dtopk_w + t * K + k0 + threadIdx.x;
        *dw = __fadd_rn(*dw, __double2float_rn(sum));
    }
}

// The most slots one launch handles (its loads and dot products live in registers). K = 8, DeepSeek-V3's top-8,
// is one launch; a larger K takes one launch per chunk of slots, each reading dout again.
static const int COMBINE_BWD_MAX_NK = 8;

// Launches the kernel instance for nk slots (1 <= nk <= NK): NK, then NK - 1, ... until it matches.
template <typename Unit, int NK, typename E>
static void launch_combine_backward(int nk, int N, int threads, float *dexpert_out, float *dtopk_w, const float *dout,
                                    const E *expert_out, int64_t ld, const int *slot_of, const float *topk_w, int k0,
                                    int K, int C) {
    if (nk == NK)
        moe_combine_backward_kernel<Unit, NK, E><<<N, threads>>>(dexpert_out, dtopk_w, dout, expert_out, ld, slot_of,
                                                                 topk_w, k0, K, C);
    else if constexpr (NK > 1)
        launch_combine_backward<Unit, NK - 1, E>(nk, N, threads, dexpert_out, dtopk_w, dout, expert_out, ld, slot_of,
                                                 topk_w, k0, K, C);
}

// Both forms: expert_out rows ld elements of E apart; float4 units when every row start is 16-byte aligned (8-byte
// for BF16 rows); expert_out is read only for dtopk_w, dexpert_out written only when given. The scalar path serves
// any C and alignment.
template <typename E>
static void combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const E *expert_out, int64_t ld,
                             const int *slot_of, const real *topk_w, int N, int K, int C) {
    if ((dexpert_out == NULL && dtopk_w == NULL) || N <= 0 || K <= 0) return;
    const bool vec4 = C % 4 == 0 && (uintptr_t)dout % 16 == 0 && (uintptr_t)dexpert_out % 16 == 0 &&
                      (dtopk_w == NULL || ((uintptr_t)expert_out % (4 * sizeof(E)) == 0 && ld % 4 == 0));
    const int units = vec4 ? C / 4 : C;
    // Just enough warps to cover a row's units (a small C would leave most of 256 threads idle), at most 256.
    const int threads = units >= MOE_THREADS ? MOE_THREADS : units <= 32 ? 32 : (units + 31) / 32 * 32;
    for (int k0 = 0; k0 < K; k0 += COMBINE_BWD_MAX_NK) {
        const int nk = K - k0 < COMBINE_BWD_MAX_NK ? K - k0 : COMBINE_BWD_MAX_NK;
        if (vec4)
            launch_combine_backward<float4, COMBINE_BWD_MAX_NK, E>(nk, N, threads, dexpert_out, dtopk_w, dout,
                                                                   expert_out, ld, slot_of, topk_w, k0, K, C);
        else
            launch_combine_backward<float, COMBINE_BWD_MAX_NK, E>(nk, N, threads, dexpert_out, dtopk_w, dout,
                                                                  expert_out, ld, slot_of, topk_w, k0, K, C);
        CUDA_CHECK_LAUNCH("moe_combine_backward_kernel");
    }
}

extern "C" void cuda_moe_combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out,
                                          const int *slot_of, const real *topk_w, int N, int K, int C) {
    combine_backward(dexpert_out, dtopk_w, dout, expert_out, C, slot_of, topk_w, N, K, C);
}

extern "C" void cuda_moe_combine_backward_bf16(real *dtopk_w, const real *dout, const uint16_t *expert_out,
                                               const int *slot_of, const real *topk_w, int N, int K, int C) {
    combine_backward<uint16_t>(NULL, dtopk_w, dout, expert_out, bf16_rows_ld(C), slot_of, topk_w, N, K, C);
}

// kernels.h moe_combine_grad_bf16: dy row slot_of[t K + k] = bf16(scale_rn(w[t,k], dout[t])), the dexpert_out rows of
// moe_combine_backward_kernel rounded as bf16_round_array rounds them. One block per token: dout[t] is read once
// for its K slots. VEC4: C % 4 == 0, dout 16-byte and dy 8-byte aligned.
template <bool VEC4>
__global__ void __launch_bounds__(MOE_THREADS)
moe_combine_grad_bf16_kernel(uint16_t *__restrict__ dy, const float *__restrict__ dout,
                             const float *__restrict__ topk_w, const int *__restrict__ slot_of, int K, int C) {
    const int64_t t = blockIdx.x;
    const float *dt = dout + t * C;
    for (int c = threadIdx.x * (VEC4 ? 4 : 1); c < C; c += blockDim.x * (VEC4 ? 4 : 1)) {
        if (VEC4) {
            const float4 d = *reinterpret_cast<const float4 *>(dt + c);
            for (int k = 0; k < K; k++) {
                const float4 v = scale_rn(topk_w[t * K + k], d);
                *reinterpret_cast<uint2 *>(dy + (int64_t)slot_of[t * K + k] * C + c) =
                    make_uint2(bf16x2_bits(v.x, v.y), bf16x2_bits(v.z, v.w));
            }
        } else {
            const float d = dt[c];
            for (int k = 0; k < K; k++)
                dy[(int64_t)slot_of[t * K + k] * C + c] = bf16_bits(scale_rn(topk_w[t * K + k], d));
        }
    }
}

extern "C" void cuda_moe_combine_grad_bf16(uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of,
                                           int N, int K, int C) {
    if (N <= 0 || K <= 0 || C <= 0) return;
    const bool vec4 = C % 4 == 0 && (uintptr_t)dout % 16 == 0 && (uintptr_t)dy % 8 == 0;
    const int units = vec4 ? C / 4 : C;
    const int threads = units >= MOE_THREADS ? MOE_THREADS : units <= 32 ? 32 : (units + 31) / 32 * 32;
    if (vec4) moe_combine_grad_bf16_kernel<true><<<N, threads>>>(dy, dout, topk_w, slot_of, K, C);
    else moe_combine_grad_bf16_kernel<false><<<N, threads>>>(dy, dout, topk_w, slot_of, K, C);
    CUDA_CHECK_LAUNCH("moe_combine_grad_bf16_kernel");
}
