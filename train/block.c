/*
 * block.c - one pre-norm Transformer block: x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x)), where FFN is
 * the dense SwiGLU or the MoE layer. Also the allocation of the activations a block keeps and of the
 * scratch gradients shared by the blocks of a chunk.
 */
#include "train/layers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------- allocation
void *arena_alloc(ActsArena *a, size_t bytes) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 64;
        a->ptrs = realloc(a->ptrs, (size_t)a->cap * sizeof(void *));
        if (!a->ptrs) { fprintf(stderr, "fp8moe: out of host memory (train/block.c)\n"); exit(1); }
    }
    void *p = device_alloc(a->dev, bytes ? bytes : 1);
    a->ptrs[a->n++] = p;
    return p;
}

void arena_free_all(ActsArena *a) {
    for (int i = 0; i < a->n; i++) device_free(a->dev, a->ptrs[i]);
    for (int i = 0; i < a->n_host; i++) free(a->host_ptrs[i]);
    free(a->ptrs);
    free(a->host_ptrs);
    memset(a, 0, sizeof *a);
}

// Host-side integer buffers of the same lifetime (copies of small device results the host loops over).
static int *host_ints(ActsArena *a, int64_t n) {
    a->host_ptrs = realloc(a->host_ptrs, (size_t)(a->n_host + 1) * sizeof(void *));
    int *p = calloc((size_t)(n ? n : 1), sizeof(int));
    if (!a->host_ptrs || !p) { fprintf(stderr, "fp8moe: out of host memory (train/block.c)\n"); exit(1); }
    a->host_ptrs[a->n_host++] = p;
    return p;
}

// A Linear input's kept Wgrad operand (linear.h) for `rows` rows of C columns in at most n_groups groups, or
// nothing (q NULL) unless `keep`.
static KeptInput kept_alloc(ActsArena *ar, int keep, int64_t rows, int n_groups, int C) {
    if (!keep) return (KeptInput){0};
    const int tiles = linear_kept_tiles(rows, n_groups);
    return (KeptInput){.q = arena_alloc(ar, (size_t)C * tiles * FP8_TILE),
                       .s = arena_alloc(ar, sizeof(float) * tiles * C), .tiles = tiles, .C = C};
}

static void mla_acts_alloc(ActsArena *ar, MlaActs *a, const Dims *d, const LayerScratch *s, int keep) {
    int N = d->N, NH = d->N * d->H;
    if (d->qr > 0) {
        a->cq = ARENA_REALS(ar, (int64_t)N * d->qr);
        a->cq_rstd = ARENA_REALS(ar, N);
        if (!keep) a->cqn = ARENA_REALS(ar, (int64_t)N * d->qr);
    }
    // q and kv are transient, in their gradients' memory (layer_scratch_alloc): the attention state keeps what its
    // backward reads (kernels.h)
    a->qf = s->d_qf, a->kv = s->d_kv;
    a->q16 = s->t_q16, a->kv16 = s->t_kv16;
    a->kva = s->t_kva;
    a->ckv = ARENA_REALS(ar, (int64_t)N * d->kvr);
    a->ckv_rstd = ARENA_REALS(ar, N);
    if (!keep) a->ckvn = ARENA_REALS(ar, (int64_t)N * d->kvr);  // keep: never written (linear.h NormInput)
    a->k_rope_raw = s->t_k_rope_raw;
    a->k_rope = ARENA_REALS(ar, (int64_t)N * d->dr);
    a->att = ARENA_REALS(ar, attention_state_elems(ar->dev, d->B, d->T, d->H, d->dn, d->dr, d->dv));
    a->o = ARENA_REALS(ar, (int64_t)NH * d->dv);
    a->xn_kept = kept_alloc(ar, keep, N, 1, d->D);
    a->cqn_kept = kept_alloc(ar, keep && d->qr > 0, N, 1, d->qr);
    a->ckvn_kept = kept_alloc(ar, keep, N, 1, d->kvr);
    a->o_kept = kept_alloc(ar, keep, N, 1, d->H * d->dv);
}

// rows of x in n_groups groups (the routed experts: their local experts' segments, x read through the routing
// plan and not kept); keep (fp8 mode): keep the Wgrad operands; bf16_products (linear_bf16_products): the gate's
// inputs in BF16.
static void ffn_acts_alloc(ActsArena *ar, FfnActs *a, int64_t rows, int n_groups, int D, int width,
                           const LayerScratch *s, int keep, int bf16_products) {
    if (bf16_products) {  // the Fprops' BF16 products, with 15 rows of scratch (kernels.h fp8_gemm_fprop_grouped_bf16)
        const size_t bytes = (size_t)bf16_rows_elems(rows, width) * sizeof(uint16_t);
        a->gate.a16 = arena_alloc(ar, bytes), a->gate.b16 = arena_alloc(ar, bytes);
    } else {
        a->gate.a = ARENA_REALS(ar, rows * width), a->gate.b = ARENA_REALS(ar, rows * width);
    }
    a->h = s->t_h;
    a->x_kept = kept_alloc(ar, keep && n_groups == 1, rows, 1, D);
    a->h_kept = kept_alloc(ar, keep, rows, n_groups, width);
}

void block_acts_alloc(ActsArena *ar, BlockActs *a, const Dims *d, int is_moe, const LayerScratch *s,
                      int keep_inputs, int bf16_products, int bf16_expert_outputs) {
    int N = d->N, D = d->D;
    a->xn1 = s->t_xn;
    a->rstd1 = ARENA_REALS(ar, N);
    mla_acts_alloc(ar, &a->mla, d, s, keep_inputs);
    a->x_mid = ARENA_REALS(ar, (int64_t)N * D);
    a->xn2 = s->t_xn;
    a->rstd2 = ARENA_REALS(ar, N);
    if (!is_moe) {
        ffn_acts_alloc(ar, &a->ffn, N, 1, D, d->inter, s, keep_inputs, bf16_products);
        return;
    }
    MoeActs *e = &a->moe;
    int64_t NK = (int64_t)N * d->K;
    e->logits = ARENA_REALS(ar, (int64_t)N * d->E);
    e->scores = ARENA_REALS(ar, (int64_t)N * d->E);
    e->topk_idx = ARENA_INTS(ar, NK);
    e->topk_idx_host = host_ints(ar, NK);
    e->topk_w = ARENA_REALS(ar, NK);
    e->plain_topk = ARENA_INTS(ar, NK);
    e->seg_offsets = ARENA_INTS(ar, d->E + 1);
    e->seg_offsets_host = host_ints(ar, d->E + 1);
    e->seg_token = ARENA_INTS(ar, NK);
    e->slot_of = ARENA_INTS(ar, NK);
    e->xp = s->t_xp;
    // the local experts' rows: this rank's own N x K at ep = 1, up to the EP group's N x K x ep (d->local_rows)
    ffn_acts_alloc(ar, &e->experts, d->local_rows, d->E, D, d->I, s, keep_inputs, bf16_products);
    if (bf16_expert_outputs)  // read by the combine and its backward in BF16 (moe.c)
        e->eout_bf16 = arena_alloc(ar, (size_t)bf16_rows_elems(NK, D) * sizeof(uint16_t));
    else
        e->eout = ARENA_REALS(ar, d->local_rows * D);
    // the routed experts copy their Fprop operand's rows from the shared expert's (linear.h SharedFprop); without
    // shared experts (moe.n_shared_experts = 0: no shared FFN runs, moe.c) they quantise their rows themselves
    if (d->shared_I > 0) {
        ffn_acts_alloc(ar, &e->shared, N, 1, D, d->shared_I, s, keep_inputs, bf16_products);
        e->experts.x_fprop = e->shared.x_fprop = s->t_x_fprop;
        if (bf16_expert_outputs) e->shared_out16 = s->t_shared16;
    }
}

// n BF16 values in the memory of grad, a gradient of grad_elems reals, when they fit there; else in memory of their
// own. For a forward transient in a gradient that only the backward writes, or a gradient that replaces it.
static uint16_t *bf16_in_grad(ActsArena *ar, real *grad, int64_t grad_elems, int64_t n) {
    if ((size_t)n * sizeof(uint16_t) <= (size_t)grad_elems * sizeof(real)) return (uint16_t *)grad;
    return arena_alloc(ar, (size_t)n * sizeof(uint16_t));
}

void layer_scratch_alloc(ActsArena *ar, LayerScratch *s, const Dims *d, int has_moe, int needs_xp, int bf16_products,
                         int needs_d_eout, int shares_fprop) {
    int64_t N = d->N, NH = (int64_t)d->N * d->H, NK = (int64_t)d->N * d->K;
    s->t_xn = ARENA_REALS(ar, N * d->D);
    s->t_rstd = ARENA_REALS(ar, N);
    s->t_kva = ARENA_REALS(ar, N * (d->kvr + d->dr));
    s->t_k_rope_raw = ARENA_REALS(ar, N * d->dr);
    s->d_xn = ARENA_REALS(ar, N * d->D);
    if (d->qr > 0) {
        s->d_cq = ARENA_REALS(ar, N * d->qr);
        s->d_cqn = ARENA_REALS(ar, N * d->qr);
    }
    s->d_qf = ARENA_REALS(ar, NH * d->dqk);
    s->d_kva = ARENA_REALS(ar, N * (d->kvr + d->dr));
    s->d_ckv = ARENA_REALS(ar, N * d->kvr);
    s->d_ckvn = ARENA_REALS(ar, N * d->kvr);
    s->d_k_rope = ARENA_REALS(ar, N * d->dr);
    s->d_k_rope_raw = ARENA_REALS(ar, N * d->dr);
    s->d_kv = ARENA_REALS(ar, NH * (d->dn + d->dv));
    s->d_o = ARENA_REALS(ar, NH * d->dv);
    // MLA's transient q and kv (mla_acts_alloc), or their BF16 products, live in the memory of their gradients. A
    // block's forward is done with them before it ends, and a chunk's backward, which writes d_qf and d_kv, never
    // runs at the same time as its forward, so each chunk keeps no extra scratch for them.
    if (bf16_products && d->qr > 0) {
        s->t_q16 = bf16_in_grad(ar, s->d_qf, NH * d->dqk, bf16_rows_elems(N, d->H * d->dqk));
        s->t_kv16 = bf16_in_grad(ar, s->d_kv, NH * (d->dn + d->dv), bf16_rows_elems(N, d->H * (d->dn + d->dv)));
    }
    if (bf16_products) {
        s->d_o16 = bf16_in_grad(ar, s->d_o, NH * d->dv, bf16_rows_elems(N, d->H * d->dv));
        s->d_ckvn16 = bf16_in_grad(ar, s->d_ckvn, N * d->kvr, bf16_rows_elems(N, d->kvr));
        if (d->qr > 0) s->d_cqn16 = bf16_in_grad(ar, s->d_cqn, N * d->qr, bf16_rows_elems(N, d->qr));
    }
    // the shared expert's output as w2's BF16 product where the routed experts' stay BF16 (!needs_d_eout): a forward
    // transient, read by the combine (moe.c)
    if (has_moe && !needs_d_eout && d->shared_I > 0) {
        s->t_shared16 = bf16_in_grad(ar, s->d_xn, N * d->D, bf16_rows_elems(N, d->D));
        // and its input gradient's two parts, which the routed experts' unpermute adds (moe.c); MLA's backward, which
        // writes d_kv, comes after
        s->d_shared16 = bf16_in_grad(ar, s->d_kv, NH * (d->dn + d->dv), 2 * bf16_rows_elems(N, d->D));
    }
    int64_t ffn_elems = N * d->inter;
    if (has_moe) {
        if (N * d->shared_I > ffn_elems) ffn_elems = N * d->shared_I;
        if (d->local_rows * d->I > ffn_elems) ffn_elems = d->local_rows * d->I;
        s->d_logits = ARENA_REALS(ar, N * d->E);
        s->d_scores = ARENA_REALS(ar, N * d->E);
        s->d_topk_w = ARENA_REALS(ar, NK);
        if (needs_xp) {  // where the experts read the token rows, their input gradient is unpermuted directly
            s->t_xp = ARENA_REALS(ar, NK * d->D);              // this rank's permuted rows
            s->d_xp = ARENA_REALS(ar, d->local_rows * d->D);   // the gradient of the local experts' rows
        }
        if (needs_d_eout) s->d_eout = ARENA_REALS(ar, NK * d->D);
        if (shares_fprop && d->shared_I > 0) {
            const int64_t R16 = (N + 15) / 16 * 16, KB = (d->D + FP8_TILE - 1) / FP8_TILE;
            s->t_x_fprop = (SharedFprop){.q = arena_alloc(ar, (size_t)(R16 * KB * FP8_TILE)),
                                         .s = arena_alloc(ar, sizeof(float) * (size_t)(KB * R16)), .rows = d->N,
                                         .C = d->D};
        }
    }
    if (!bf16_products) {
        s->t_h = ARENA_REALS(ar, ffn_elems);
        s->d_a = ARENA_REALS(ar, ffn_elems);
        s->d_b = ARENA_REALS(ar, ffn_elems);
        s->d_h = ARENA_REALS(ar, ffn_elems);
        return;
    }
    // d_h in BF16, rows + 15 rows of round_up(width, 128) for the largest FFN (linear.h SwigluScratch)
    int64_t d_h16 = bf16_rows_elems(N, d->inter);
    if (has_moe) {
        if (bf16_rows_elems(N, d->shared_I) > d_h16) d_h16 = bf16_rows_elems(N, d->shared_I);
        if (bf16_rows_elems(d->local_rows, d->I) > d_h16) d_h16 = bf16_rows_elems(d->local_rows, d->I);
    }
    const int64_t d_xn16 = MLA_INPUT_GRAD_PARTS * bf16_rows_elems(N, d->D);
    if (d_xn16 > d_h16) d_h16 = d_xn16;
    s->d_h16 = arena_alloc(ar, (size_t)d_h16 * sizeof(uint16_t));
    s->d_xn16 = s->d_h16;
}

// ---------------------------------------------------------------------------- forward / backward
void block_forward(Model *m, const BlockWeights *w, BlockActs *a, const Dims *d, const real *x_in,
                   real *x_out) {
    Device dev = m->rc.dev;
    int N = d->N, D = d->D;
    a->x_in = (real *)x_in;
    const NormInput xn1 = {x_in, w->attn_norm, a->rstd1, a->xn1};  // (in fp8 mode xn1 is not written: linear.h)
    mla_forward(m, &w->attn, &a->mla, d, &xn1, x_in, a->x_mid);  // x_mid = x_in + MLA(RMSNorm(x_in))
    rmsnorm_forward(dev, a->xn2, a->rstd2, a->x_mid, w->ffn_norm, N, D);
    if (w->is_moe) {  // the residual is added in the combine's pass
        moe_forward(m, w, &a->moe, d, a->xn2, a->x_mid, x_out);
    } else {
        ffn_forward(m, &w->ffn, &a->ffn, N, D, d->inter, a->xn2, x_out, NULL);
        add_inplace(dev, x_out, a->x_mid, (int64_t)N * D);
    }
}

void block_backward(Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, const Dims *d,
                    LayerScratch *s, real *d_x, real d_balance) {
    Device dev = m->rc.dev;
    int N = d->N, D = d->D;
    // forward was x_out = x_mid + FFN(RMSNorm(x_mid)); RMSNorm(x_mid) is recomputed (a forward
    // transient, see BlockActs): the same op on the same input, so the same bits. A dense FFN that kept its input's
    // Wgrad operand (fp8) does not read it; the MoE's router and routed experts do.
    if (w->is_moe || a->ffn.x_kept.q == NULL) rmsnorm_forward(dev, a->xn2, s->t_rstd, a->x_mid, w->ffn_norm, N, D);
    // d_xn is written by the FFN's / MoE's backward and then by MLA's (their first op writes, GRAD_WRITE)
    if (w->is_moe)
        moe_backward(m, w, g, &a->moe, d, s, a->xn2, d_x, s->d_xn, d_balance);
    else
        ffn_backward(m, &w->ffn, &g->ffn, &a->ffn, s, N, D, d->inter, a->xn2, d_x, s->d_xn, NULL, GRAD_WRITE);
    // d_x becomes x_mid's gradient: the output's + the FFN branch's, added in place (rmsnorm_backward adds)
    rmsnorm_backward(dev, d_x, g->ffn_norm, s->d_xn, a->x_mid, w->ffn_norm, a->rstd2, N, D);
    // and x_mid = x_in + MLA(RMSNorm(x_in)): x_in's gradient is x_mid's + the MLA branch's, added in place once
    // MLA's backward has read x_mid's. MLA reads RMSNorm(x_in) only for its Wgrads, so where it kept their operand
    // (fp8) the recomputation is skipped and xn1 holds another block's values, never read.
    if (a->mla.xn_kept.q == NULL) rmsnorm_forward(dev, a->xn1, s->t_rstd, a->x_in, w->attn_norm, N, D);
    mla_backward(m, &w->attn, &g->attn, &a->mla, d, s, a->xn1, d_x, s->d_xn);
    if (s->d_xn16)  // MLA left its input's gradient in parts (mla_backward)
        rmsnorm_backward_bf16(dev, d_x, g->attn_norm, s->d_xn16, bf16_rows_ld(D), MLA_INPUT_GRAD_PARTS,
                              bf16_rows_elems(N, D), a->x_in, w->attn_norm, a->rstd1, N, D);
    else
        rmsnorm_backward(dev, d_x, g->attn_norm, s->d_xn, a->x_in, w->attn_norm, a->rstd1, N, D);
}
