/*
 * permute.c - CPU reference of MoE token permutation: the per-expert segment plan, the row gather
 * that builds the expert inputs, its adjoint, and the weighted combine of expert outputs back into
 * token order (kernels/kernels.h, "MoE token permutation").
 *
 * Experts run over contiguous per-expert segments of a permuted buffer of N*K rows. The plan is an
 * integer counting sort, stable in (t, k) order, so the layout is a pure function of topk_idx. Every
 * reduction here runs over a token's K slots in k order inside one thread, so there are no
 * floating-point atomics and results do not depend on the thread count. The scatters of the
 * backward passes are written as gathers from the token side, which is race-free because slot_of is
 * a permutation of the N*K rows (moe_permute_plan builds it so).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// ---------------------------------------------------------------------------- plan
// topk_idx (N, K) -> seg_offsets (E+1), seg_token (N*K), slot_of (N*K); see kernels.h.
void moe_permute_plan(int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx, int N, int K,
                      int E) {
    if (N < 0 || K < 1 || E < 1) {
        fprintf(stderr, "fp8moe: %s:%d: moe_permute_plan: N = %d, K = %d, E = %d; expected N >= 0, "
                        "K >= 1, E >= 1\n", __FILE__, __LINE__, N, K, E);
        exit(1);
    }
    const int64_t n_slots = (int64_t)N * K;
    // count rows per expert into seg_offsets[e + 1], then prefix-sum into segment starts
    memset(seg_offsets, 0, (size_t)(E + 1) * sizeof(int));
    for (int64_t i = 0; i < n_slots; i++) {
        const int e = topk_idx[i];
        if (e < 0 || e >= E) {
            fprintf(stderr, "fp8moe: %s:%d: moe_permute_plan: topk_idx[%lld, %lld] = %d; expected an "
                            "expert index in [0, %d)\n", __FILE__, __LINE__, (long long)(i / K),
                    (long long)(i % K), e, E);
            exit(1);
        }
        seg_offsets[e + 1]++;
    }
    for (int e = 0; e < E; e++) seg_offsets[e + 1] += seg_offsets[e];

    // fill each segment in (t, k) order; cursor[e] is the next free row of segment e
    int *cursor = malloc((size_t)E * sizeof(int));
    if (cursor == NULL) {
        fprintf(stderr, "fp8moe: %s:%d: moe_permute_plan: out of memory (%d ints)\n", __FILE__, __LINE__, E);
        exit(1);
    }
    memcpy(cursor, seg_offsets, (size_t)E * sizeof(int));
    for (int64_t i = 0; i < n_slots; i++) {
        const int row = cursor[topk_idx[i]]++;
        seg_token[row] = (int)(i / K);
        slot_of[i] = row;
    }
    free(cursor);
}

// ---------------------------------------------------------------------------- gather and its adjoint
// inp (rows of inp, C), src_row (n_rows) -> out (n_rows, C), out[r] = inp[src_row[r]].
// With src_row = seg_token this builds the permuted expert inputs (N*K, C) from the tokens (N, C).
void cpu_gather_rows(real *out, const real *inp, const int *src_row, int n_rows, int C) {
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < n_rows; r++)
        memcpy(out + (size_t)r * C, inp + (size_t)src_row[r] * C, (size_t)C * sizeof(real));
}

// In the forward pass this was xp[slot_of[t,k]] = x[t] for every k, so each token's gradient is the
// sum of its K permuted rows' gradients: dinp (N, C) += sum_k dseg[slot_of[t,k]], dseg (N*K, C).
void cpu_moe_unpermute_backward(real *dinp, const real *dseg, const int *slot_of, int N, int K, int C) {
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        real *dt = dinp + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            const real *ds = dseg + (size_t)slot_of[(size_t)t * K + k] * C;
            for (int c = 0; c < C; c++) dt[c] += ds[c];
        }
    }
}

// ---------------------------------------------------------------------------- combine
// expert_out (N*K, C) permuted rows, slot_of (N*K), topk_w (N, K) ->
// out (N, C) += sum_k topk_w[t,k] * expert_out[slot_of[t,k]], k in order. Accumulating lets the
// shared expert's output already be in out.
void cpu_moe_combine_forward(real *out, const real *expert_out, const int *slot_of, const real *topk_w,
                             const real *residual, int N, int K, int C) {
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        real *ot = out + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            const real w = topk_w[(size_t)t * K + k];
            const real *eo = expert_out + (size_t)slot_of[(size_t)t * K + k] * C;
            for (int c = 0; c < C; c++) ot[c] += w * eo[c];
        }
        if (residual)
            for (int c = 0; c < C; c++) ot[c] += residual[(size_t)t * C + c];
    }
}

// In the forward pass this was out[t] += sum_k w[t,k] * expert_out[slot_of[t,k]], so:
//   dexpert_out[slot_of[t,k]] (N*K, C)  = w[t,k] * dout[t]                        (written)
//   dtopk_w[t,k] (N, K)               += dot(dout[t], expert_out[slot_of[t,k]])  (summed in double)
// Either gradient pointer may be NULL. Each slot belongs to exactly one (t, k), so the per-token
// loop writes disjoint rows and covers all N*K of them: dexpert_out is written, not accumulated,
// which spares the caller a memset of the whole (N*K, C) buffer (its only contribution is this one).
void cpu_moe_combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out,
                              const int *slot_of, const real *topk_w, int N, int K, int C) {
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const real *dt = dout + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            const size_t slot = (size_t)slot_of[(size_t)t * K + k];
            if (dexpert_out) {
                const real w = topk_w[(size_t)t * K + k];
                real *de = dexpert_out + slot * C;
                for (int c = 0; c < C; c++) de[c] = w * dt[c];
            }
            if (dtopk_w) {
                const real *eo = expert_out + slot * C;
                double dot = 0.0;
                for (int c = 0; c < C; c++) dot += (double)dt[c] * (double)eo[c];
                dtopk_w[(size_t)t * K + k] += (real)dot;
            }
        }
    }
}

// kernels.h moe_combine_grad_bf16: the dexpert_out rows of cpu_moe_combine_backward, rounded.
void cpu_moe_combine_grad_bf16(uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of, int N, int K,
                               int C) {
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const real *dt = dout + (size_t)t * C;
        for (int k = 0; k < K; k++) {
            const real w = topk_w[(size_t)t * K + k];
            uint16_t *de = dy + (size_t)slot_of[(size_t)t * K + k] * C;
            for (int c = 0; c < C; c++) de[c] = float_to_bf16((float)(w * dt[c]));
        }
    }
}

// kernels.h's *_bf16 forms: the ops above on the FP32 values of the BF16 rows (kernels.h bf16_rows_ld).
void cpu_moe_combine_forward_bf16(real *out, const uint16_t *base, const uint16_t *expert_out, const int *slot_of,
                                  const real *topk_w, const real *residual, int N, int K, int C) {
    if (base) cpu_bf16_rows_widen(out, base, bf16_rows_ld(C), N, C);  // out = base's values, then the sum as above
    real *eo = cpu_bf16_rows_widened(expert_out, bf16_rows_ld(C), (int64_t)N * K, C);
    cpu_moe_combine_forward(out, eo, slot_of, topk_w, residual, N, K, C);
    free(eo);
}

void cpu_moe_combine_backward_bf16(real *dtopk_w, const real *dout, const uint16_t *expert_out, const int *slot_of,
                                   const real *topk_w, int N, int K, int C) {
    real *eo = cpu_bf16_rows_widened(expert_out, bf16_rows_ld(C), (int64_t)N * K, C);
    cpu_moe_combine_backward(NULL, dtopk_w, dout, eo, slot_of, topk_w, N, K, C);
    free(eo);
}
