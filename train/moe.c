/*
 * moe.c - the FFN half of a block: the dense SwiGLU FFN and the DeepSeek-V3 MoE layer (router with
 * group-limited top-K, shared expert, routed experts over contiguous per-expert segments, sequence-wise
 * balance loss), forward and backward.
 *
 * The routed path is: router -> permute token rows into per-expert segments -> ep_dispatch (the seam
 * where expert parallelism's all-to-all plugs in; the identity with one EP rank) -> local experts ->
 * ep_combine -> weighted sum back into token order. Load counts for the aux-loss-free bias update are
 * taken here, once per training forward pass.
 */
#include "train/layers.h"
#include "train/linear.h"

#include "kernels/profile.h"

#include <string.h>

// ---------------------------------------------------------------------------- SwiGLU FFNs
// y = w2 (silu(w1 x) * w3 x) over n_groups groups of rows [offsets[g], offsets[g+1]) with their own weights (one
// group: the dense FFN and the shared expert; the local experts' segments: the routed ones, weights stacked), row
// r of x read through x_rows when given. w1, w3 (I, D), w2 (D, I) per group. The gate h = silu(a) * b is w2's
// operand, computed inside fp8's quantisers (linear_*_swiglu_grouped); bf16 and fp32 write it to a->h, a forward
// transient (see FfnActs).
// y_bf16 (the routed experts and the shared expert where their outputs stay BF16, else NULL; y then NULL): y left as
// w2's BF16 product (linear.h).
static void swiglu_ffn_forward(Model *m, const FfnWeights *w, FfnActs *a, int n_groups, const int *offsets, int D,
                               int I, const real *x, const int *x_rows, real *y, uint16_t *y_bf16) {
    linear_forward_swiglu_grouped(&m->rc, n_groups, offsets, w, x, x_rows, &a->gate, a->h, y, y_bf16, D, I, &a->x_kept,
                                  &a->h_kept, &a->x_fprop);
}

// Its backward from d_y (or d_y_combine, linear.h CombineGrad): parameter gradients +=, d_x written or added to per
// d_x_store (in token order with unpermute, linear.h), or left as w1's and w3's BF16 Dgrad products in d_x_bf16
// (linear.h linear_backward_swiglu_grouped). h is recomputed from a and b: the same arithmetic on the
// same inputs, so the same bits. d_h, d_a and d_b are written, not cleared and added to.
static void swiglu_ffn_backward(Model *m, const FfnWeights *w, const FfnWeights *g, FfnActs *a, LayerScratch *s,
                                int n_groups, const int *offsets, int D, int I, const real *x, const int *x_rows,
                                const real *d_y, const CombineGrad *d_y_combine, real *d_x, uint16_t *d_x_bf16,
                                GradStore d_x_store, const DgradUnpermute *unpermute) {
    const SwigluScratch scratch = {a->h, s->d_h, s->d_a, s->d_b, s->d_h16};
    linear_backward_swiglu_grouped(&m->rc, n_groups, offsets, w, g, &a->gate, d_y, d_y_combine, x, x_rows, d_x,
                                   d_x_bf16, d_x_store, unpermute, &scratch, D, I, &a->x_kept, &a->h_kept);
}

// x (rows, D) -> out (rows, D) or out_bf16: the dense FFN and the shared expert, one group.
void ffn_forward(Model *m, const FfnWeights *w, FfnActs *a, int rows, int D, int width, const real *x,
                 real *out, uint16_t *out_bf16) {
    const int offsets[2] = {0, rows};
    swiglu_ffn_forward(m, w, a, 1, offsets, D, width, x, NULL, out, out_bf16);
}

void ffn_backward(Model *m, const FfnWeights *w, const FfnWeights *g, FfnActs *a, LayerScratch *s,
                  int rows, int D, int width, const real *x, const real *d_out, real *d_x, uint16_t *d_x_bf16,
                  GradStore d_x_store) {
    const int offsets[2] = {0, rows};
    swiglu_ffn_backward(m, w, g, a, s, 1, offsets, D, width, x, NULL, d_out, NULL, d_x, d_x_bf16, d_x_store, NULL);
}

// ---------------------------------------------------------------------------- routed experts
int moe_experts_read_tokens(const Model *m) {
    return m->cfg.precision.mode != PRECISION_FP32 && m->ep.ep_size == 1;
}

int moe_combine_grad_in_operand(const Model *m) {
    return linear_bf16_products(&m->rc) && moe_experts_read_tokens(m);
}

// Every local expert over its segment of rows, one phase at a time: each Linear runs for all experts, the SwiGLU
// once over all rows; segment e of the local experts is rows [offsets[e], offsets[e+1]), offsets[0] = 0. The same
// numbers as running the experts one after another: every op touches only its own expert's rows and weights. Their
// GEMMs count as expert GEMMs (kernels/profile.h). In the backward the input gradient d_xs is written in slot
// order, or with unpermute (the rows read through xs_rows) in token order as the gradient of xs itself.
static void experts_forward(Model *m, const FfnWeights *w, FfnActs *a, const int *offsets, int n_experts,
                            int D, int I, const real *xs, const int *xs_rows, real *ys, uint16_t *ys_bf16) {
    profile_begin(PHASE_EXPERT_GEMM);
    swiglu_ffn_forward(m, w, a, n_experts, offsets, D, I, xs, xs_rows, ys, ys_bf16);
    profile_end(PHASE_EXPERT_GEMM);
}

static void experts_backward(Model *m, const FfnWeights *w, const FfnWeights *g, FfnActs *a,
                             LayerScratch *s, const int *offsets, int n_experts, int D, int I,
                             const real *xs, const int *xs_rows, const real *d_ys, const CombineGrad *d_ys_combine,
                             real *d_xs, const DgradUnpermute *unpermute) {
    profile_begin(PHASE_EXPERT_GEMM);
    swiglu_ffn_backward(m, w, g, a, s, n_experts, offsets, D, I, xs, xs_rows, d_ys, d_ys_combine, d_xs, NULL,
                        GRAD_WRITE, unpermute);
    profile_end(PHASE_EXPERT_GEMM);
}

// ---------------------------------------------------------------------------- MoE layer
void moe_forward(Model *m, const BlockWeights *w, MoeActs *a, const Dims *d, const real *x, const real *residual,
                 real *out) {
    Device dev = m->rc.dev;
    int N = d->N, E = d->E, K = d->K, D = d->D;
    const real *bias = m->router_bias + (int64_t)w->moe_index * E;
    profile_begin(PHASE_OTHER_GEMM);
    matmul_forward(dev, a->logits, x, w->moe.gate, N, D, E);
    profile_end(PHASE_OTHER_GEMM);
    router_forward(dev, a->topk_idx, a->topk_w, a->scores, a->logits, bias, N, E, K, d->n_groups, d->n_limited,
                   d->route_scale, m->freeze_routing);
    a->balance_loss = 0;
    if (d->balance_alpha > 0)
        a->balance_loss = balance_loss_forward(dev, a->plain_topk, a->scores, d->B, d->T, E, K, d->balance_alpha,
                                               m->freeze_routing);
    // shared expert writes out, routed experts are added on top (where their outputs stay BF16, the shared expert's
    // does too, shared_out16, and the combine starts from it); without shared experts (moe.n_shared_experts = 0)
    // out starts from zeros: the bits of a shared expert whose output is 0
    if (d->shared_I > 0)
        ffn_forward(m, &w->moe.shared, &a->shared, N, D, d->shared_I, x, a->shared_out16 ? NULL : out,
                    a->shared_out16);
    else device_memset_zero(dev, out, (size_t)N * D * sizeof(real));
    profile_begin(PHASE_PERMUTE);
    moe_permute_plan_device(dev, a->seg_offsets, a->seg_token, a->slot_of, a->topk_idx, N, K, E);
    device_memcpy_to_host(dev, a->seg_offsets_host, a->seg_offsets, (size_t)(E + 1) * sizeof(int));
    const int direct = moe_experts_read_tokens(m);
    if (!direct) gather_rows(dev, a->xp, x, a->seg_token, N * K, D);
    profile_end(PHASE_PERMUTE);
    if (m->count_load) {  // aux-loss-free balancing counts the routed tokens of training passes only:
        // expert e's segment holds its (token, k) pairs, so its length is e's load (no copy of topk_idx)
        int64_t *load = m->expert_load + (int64_t)w->moe_index * E;
        for (int e = 0; e < E; e++) load[e] += a->seg_offsets_host[e + 1] - a->seg_offsets_host[e];
        if (m->ep.node_of_ep_rank) {  // node-limited routing: on how many nodes each token's experts lie
            device_memcpy_to_host(dev, a->topk_idx_host, a->topk_idx, (size_t)N * K * sizeof(int));
            ep_count_token_nodes(&m->ep, a->topk_idx_host, N, K);
        }
    }
    ep_dispatch(&m->ep, a->xp, a->seg_offsets_host, D, &a->ep_buf);
    // fp8 and bf16 with one EP rank (moe_combine_grad_in_operand): the experts' outputs stay w2's BF16 product, which
    // the combine reads (and its backward, for the gate weights' gradient); ep_combine is the identity there
    const int bf16_out = moe_combine_grad_in_operand(m);
    experts_forward(m, &w->moe.experts, &a->experts, a->ep_buf.seg_offsets, m->ep.experts_per_rank, D, d->I,
                    direct ? x : a->ep_buf.rows, direct ? a->seg_token : NULL, bf16_out ? NULL : a->eout,
                    bf16_out ? a->eout_bf16 : NULL);
    if (!bf16_out) a->eout_perm = ep_combine(&m->ep, &a->ep_buf, a->eout);
    profile_begin(PHASE_PERMUTE);
    if (bf16_out)
        moe_combine_forward_bf16(dev, out, a->shared_out16, a->eout_bf16, a->slot_of, a->topk_w, residual, N, K, D);
    else moe_combine_forward(dev, out, a->eout_perm, a->slot_of, a->topk_w, residual, N, K, D);
    profile_end(PHASE_PERMUTE);
}

void moe_backward(Model *m, const BlockWeights *w, const BlockWeights *g, MoeActs *a, const Dims *d,
                  LayerScratch *s, const real *x, const real *d_out, real *d_x, real d_balance) {
    Device dev = m->rc.dev;
    int N = d->N, E = d->E, K = d->K, D = d->D, NK = d->N * d->K;
    size_t R = sizeof(real);
    // d_eout (moe_combine_backward) and d_xp (the experts' Dgrads) are written, not cleared and added to; where
    // the experts read the token rows (direct), their input gradient goes straight to d_x in token order, and in
    // fp8 mode (fused) their output gradient is read through the plan by w2's dY quantiser, so d_eout is not
    // written at all (the combine backward computes d_topk_w only)
    const int direct = moe_experts_read_tokens(m), fused = moe_combine_grad_in_operand(m);
    device_memset_zero(dev, s->d_topk_w, (size_t)N * K * R);
    device_memset_zero(dev, s->d_logits, (size_t)N * E * R);
    // out = shared(x) + sum_k w_k eout[slot(t,k)]
    profile_begin(PHASE_PERMUTE);
    if (fused) moe_combine_backward_bf16(dev, s->d_topk_w, d_out, a->eout_bf16, a->slot_of, a->topk_w, N, K, D);
    else moe_combine_backward(dev, s->d_eout, s->d_topk_w, d_out, a->eout_perm, a->slot_of, a->topk_w, N, K, D);
    profile_end(PHASE_PERMUTE);
    const real *d_local_out = fused ? NULL : ep_combine_backward(&m->ep, &a->ep_buf, s->d_eout);
    const CombineGrad combine = {.d_out = d_out, .topk_w = a->topk_w, .seg_token = a->seg_token,
                                 .slot_of = a->slot_of, .topk = K};
    // xp is a forward transient (the chunk's scratch, 4 x D bytes per routed row and layer): with one EP
    // rank ep_buf.rows is xp, so the experts' inputs are gathered again, the same rows in the same order
    // (or, in fp8 mode, read through seg_token again); with more ranks ep_buf keeps the rows it received.
    if (m->ep.ep_size == 1 && !direct) {
        profile_begin(PHASE_PERMUTE);
        gather_rows(dev, a->xp, x, a->seg_token, NK, D);
        profile_end(PHASE_PERMUTE);
    }
    // d_x is written first by the routed experts' input gradient (token order), then the shared expert's is added.
    // fused, the shared expert's backward runs first and leaves its input gradient as w1's and w3's Dgrad products
    // (s->d_shared16), which the routed experts' unpermute adds after their sum in its pass: the same adds in the same
    // order, so the same bits, without a pass over d_x
    uint16_t *shared16 = s->d_shared16;  // allocated exactly there (layer_scratch_alloc)
    if (shared16)
        ffn_backward(m, &w->moe.shared, &g->moe.shared, &a->shared, s, N, D, d->shared_I, x, d_out, NULL, shared16,
                     GRAD_WRITE);
    if (direct) {
        const DgradUnpermute unpermute = {a->slot_of, N, K, shared16, shared16 ? 2 : 0, bf16_rows_elems(N, D)};
        experts_backward(m, &w->moe.experts, &g->moe.experts, &a->experts, s, a->ep_buf.seg_offsets,
                         m->ep.experts_per_rank, D, d->I, x, a->seg_token, d_local_out, fused ? &combine : NULL, d_x,
                         &unpermute);
    } else {
        experts_backward(m, &w->moe.experts, &g->moe.experts, &a->experts, s, a->ep_buf.seg_offsets,
                         m->ep.experts_per_rank, D, d->I, a->ep_buf.rows, NULL, d_local_out, NULL, s->d_xp, NULL);
        const real *d_perm = ep_dispatch_backward(&m->ep, &a->ep_buf, s->d_xp);
        device_memset_zero(dev, d_x, (size_t)N * D * R);
        profile_begin(PHASE_PERMUTE);
        moe_unpermute_backward(dev, d_x, d_perm, a->slot_of, N, K, D);
        profile_end(PHASE_PERMUTE);
    }
    if (d->shared_I > 0 && !shared16)
        ffn_backward(m, &w->moe.shared, &g->moe.shared, &a->shared, s, N, D, d->shared_I, x, d_out, d_x, NULL,
                     GRAD_ADD);
    // router: gate weights and, when the balance loss is on, its gradient through the scores
    real *d_scores = NULL;
    if (d->balance_alpha > 0 && d_balance != 0) {
        device_memset_zero(dev, s->d_scores, (size_t)N * E * R);
        balance_loss_backward(dev, s->d_scores, a->plain_topk, a->scores, d->B, d->T, E, K, d->balance_alpha,
                              d_balance);
        d_scores = s->d_scores;
    }
    router_backward(dev, s->d_logits, s->d_topk_w, d_scores, a->topk_idx, a->scores, N, E, K, d->route_scale);
    profile_begin(PHASE_OTHER_GEMM);
    matmul_backward(dev, d_x, g->moe.gate, s->d_logits, x, w->moe.gate, N, D, E);
    profile_end(PHASE_OTHER_GEMM);
}
