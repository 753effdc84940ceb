/*
 * mla.c - Multi-head Latent Attention (DeepSeek-V2/V3), forward and backward, composed from kernels.h
 * ops. Per token (DESIGN.md section 3):
 *   c_Q = RMSNorm(W_DQ h);  [q_C ; q_R] = W_UQ c_Q per head;  q_R = RoPE(q_R)
 *   [c_KV ; k_R] = W_DKV h;  k_R = RoPE(k_R), shared by all heads
 *   [k_C ; v] = W_UKV RMSNorm(c_KV) per head
 *   o_i = softmax(q_i . k_i / sqrt(dqk), causal) v_i;  u = W_O [o_1 .. o_H]
 * Every head's full key and value are used (no weight absorption): this is the training formulation, and
 * absorption is an inference optimisation. They are not copied out per head: the attention core reads the
 * keys and values in W_UKV's output kv = [k_C ; v] per head and the one k_R per token (kernels.h), and
 * writes their gradients in the same layout. q and kv live only until the attention core has read them: its state
 * keeps what its backward needs. In fp8 mode they are never FP32 at all (kernels.h attention_forward_bf16), and
 * neither is the attention output's gradient (attention_backward_bf16).
 */
#include "train/layers.h"
#include "train/linear.h"

#include "kernels/profile.h"

void mla_forward(Model *m, const MlaWeights *w, MlaActs *a, const Dims *d, const NormInput *xn, const real *residual,
                 real *out) {
    Device dev = m->rc.dev;
    int N = d->N, H = d->H, dqk = d->dqk;
    // the down-projections of xn for the queries and for the keys and values are one Linear call (xn quantised
    // once); q (N, H dqk) is qf (N*H, dqk): its projection writes it, then the rope part of every head is rotated
    // in place (stride dqk), the nope part kept
    int kva_w = d->kvr + d->dr;
    {
        real *const outs[2] = {d->qr > 0 ? a->cq : a->qf, a->kva};
        const real *const ws[2] = {d->qr > 0 ? w->wq_a : w->wq, w->wkv_a};
        const int widths[2] = {d->qr > 0 ? d->qr : H * dqk, kva_w};
        linear_forward_norm(&m->rc, 2, outs, NULL, xn, ws, N, d->D, widths, &a->xn_kept);
    }
    // fp8 and bf16 modes (with a query compression) leave the up-projections' products in BF16, and the attention
    // core reads them as they are, rotating the queries' rope parts as it stages them (kernels.h
    // attention_forward_bf16): the bits of the FP32 path below, without its FP32 q and kv
    const int bf16_products = a->q16 != NULL;
    // the latents' norms: in fp8 mode their outputs are never written (linear.h NormInput)
    if (d->qr > 0) {
        const NormInput cqn = {a->cq, w->q_norm, a->cq_rstd, a->cqn};
        const real *const wq_b[1] = {w->wq_b};
        const int q_w = H * dqk;
        linear_forward_norm(&m->rc, 1, bf16_products ? NULL : &a->qf, bf16_products ? &a->q16 : NULL, &cqn, wq_b, N,
                            d->qr, &q_w, &a->cqn_kept);
    }
    if (!bf16_products) rope_forward(dev, a->qf + d->dn, a->qf + d->dn, dqk, d->B, d->T, H, d->dr, d->rope_theta);
    // keys and values through the compressed latent
    copy_block(dev, a->ckv, d->kvr, a->kva, kva_w, N, d->kvr, 0);
    copy_block(dev, a->k_rope_raw, d->dr, a->kva + d->kvr, kva_w, N, d->dr, 0);
    rope_forward(dev, a->k_rope, a->k_rope_raw, d->dr, d->B, d->T, 1, d->dr, d->rope_theta);
    int kv_w = d->dn + d->dv;
    {
        const NormInput ckvn = {a->ckv, w->kv_norm, a->ckv_rstd, a->ckvn};
        const real *const wkv_b[1] = {w->wkv_b};
        const int kv_cols = H * kv_w;
        linear_forward_norm(&m->rc, 1, bf16_products ? NULL : &a->kv, bf16_products ? &a->kv16 : NULL, &ckvn, wkv_b,
                            N, d->kvr, &kv_cols, &a->ckvn_kept);
    }
    // attention core (head h's key [kv's k_C ; the shared k_rope], its value kv's v, read in place) and output
    // projection
    profile_begin(PHASE_ATTENTION);
    if (bf16_products)
        attention_forward_bf16(dev, a->o, a->att, a->q16, bf16_rows_ld(H * dqk), a->kv16, bf16_rows_ld(H * kv_w),
                               a->k_rope, d->B, d->T, H, d->dn, d->dr, d->dv, d->rope_theta);
    else attention_forward(dev, a->o, a->att, a->qf, a->kv, a->k_rope, d->B, d->T, H, d->dn, d->dr, d->dv);
    profile_end(PHASE_ATTENTION);
    linear_forward_residual(&m->rc, out, a->o, w->wo, residual, N, H * d->dv, d->D, &a->o_kept);
}

// A compressed latent's way back through its up-projection and RMSNorm: forward was cn = RMSNorm(c), y = cn W^T
// (W (OC, R)), so d_cn = dy W is written and d_c (N, R) += RMSNorm's backward of it; the norm's and W's gradients
// add. In fp8 mode (d_cn16 given) d_cn stays the Dgrad's BF16 product, which RMSNorm's backward reads as it is: the
// bits of the FP32 form, without its FP32 array.
static void latent_backward(Model *m, real *d_c, real *g_norm, real *g_w, real *d_cn, uint16_t *d_cn16, const real *dy,
                            const real *c, const real *cn, const real *rstd, const real *norm_w, const real *w, int N,
                            int R, int OC, KeptInput *cn_kept) {
    if (d_cn16) {
        linear_backward_bf16(&m->rc, d_cn16, g_w, dy, cn, w, N, R, OC, cn_kept);
        rmsnorm_backward_bf16(m->rc.dev, d_c, g_norm, d_cn16, bf16_rows_ld(R), 1, 0, c, norm_w, rstd, N, R);
    } else {
        linear_backward(&m->rc, d_cn, GRAD_WRITE, g_w, dy, cn, w, N, R, OC, cn_kept);
        rmsnorm_backward(m->rc.dev, d_c, g_norm, d_cn, c, norm_w, rstd, N, R);
    }
}

// Part i of MLA's input gradient (0: W_DKV's Dgrad, 1: W_DQ's or W_Q's; MLA_INPUT_GRAD_PARTS): with bf16_products
// the Dgrad's BF16 product, left in s->d_xn16 for the RMSNorm backward before MLA to add as it reads them, else
// written (i = 0) or added into d_xn.
static void input_grad_part(Model *m, const LayerScratch *s, int i, real *d_xn, real *g_w, const real *dy,
                            const real *xn, const real *w, int N, int D, int OC, const KeptInput *kept) {
    if (s->d_xn16)
        linear_backward_bf16(&m->rc, s->d_xn16 + i * bf16_rows_elems(N, D), g_w, dy, xn, w, N, D, OC, kept);
    else
        linear_backward(&m->rc, d_xn, i == 0 ? GRAD_WRITE : GRAD_ADD, g_w, dy, xn, w, N, D, OC, kept);
}

void mla_backward(Model *m, const MlaWeights *w, const MlaWeights *g, MlaActs *a, const Dims *d,
                  LayerScratch *s, const real *xn, const real *d_out, real *d_xn) {
    Device dev = m->rc.dev;
    int N = d->N, H = d->H, dqk = d->dqk;
    int kva_w = d->kvr + d->dr, kv_w = d->dn + d->dv;
    size_t R = sizeof(real);
    device_memset_zero(dev, s->d_ckv, (size_t)N * d->kvr * R);

    // d_o, d_qf, d_kv, d_k_rope, d_kva, d_ckvn and d_cqn are each filled by one op (a Linear with GRAD_WRITE,
    // attention_backward) or by copies that together cover every column, so they are written, not cleared
    // and added to.
    // forward was: out = o W_O^T, o = attention(qf, kv, k_rope)
    // (fp8 mode: d_o stays W_O's BF16 Dgrad product, which the attention backward reads as it is)
    if (s->d_o16) linear_backward_bf16(&m->rc, s->d_o16, g->wo, d_out, a->o, w->wo, N, H * d->dv, d->D, &a->o_kept);
    else linear_backward(&m->rc, s->d_o, GRAD_WRITE, g->wo, d_out, a->o, w->wo, N, H * d->dv, d->D, &a->o_kept);
    // d_kv = [d k_C ; dv] per head; d_k_rope, the shared rope key's, collects every head's gradient, added in
    // head order
    profile_begin(PHASE_ATTENTION);
    if (s->d_o16)
        attention_backward_bf16(dev, s->d_qf, s->d_kv, s->d_k_rope, s->d_o16, bf16_rows_ld(H * d->dv), a->o, a->att,
                                d->B, d->T, H, d->dn, d->dr, d->dv);
    else
        attention_backward(dev, s->d_qf, s->d_kv, s->d_k_rope, s->d_o, a->o, a->att, d->B, d->T, H, d->dn, d->dr,
                           d->dv);
    profile_end(PHASE_ATTENTION);
    rope_backward(dev, s->d_k_rope_raw, s->d_k_rope, d->dr, d->B, d->T, 1, d->dr, d->rope_theta);
    copy_block(dev, s->d_kva + d->kvr, kva_w, s->d_k_rope_raw, d->dr, N, d->dr, 0);
    latent_backward(m, s->d_ckv, g->kv_norm, g->wkv_b, s->d_ckvn, s->d_ckvn16, s->d_kv, a->ckv, a->ckvn, a->ckv_rstd,
                    w->kv_norm, w->wkv_b, N, d->kvr, H * kv_w, &a->ckvn_kept);
    copy_block(dev, s->d_kva, kva_w, s->d_ckv, d->kvr, N, d->kvr, 0);
    input_grad_part(m, s, 0, d_xn, g->wkv_a, s->d_kva, xn, w->wkv_a, N, d->D, kva_w, &a->xn_kept);
    // qf = [q_nope ; RoPE(q_rope)] per head: the rope part of d_qf is rotated back in place, and d_qf is then
    // the gradient of the projection's output q
    rope_backward(dev, s->d_qf + d->dn, s->d_qf + d->dn, dqk, d->B, d->T, H, d->dr, d->rope_theta);
    if (d->qr > 0) {
        device_memset_zero(dev, s->d_cq, (size_t)N * d->qr * R);
        latent_backward(m, s->d_cq, g->q_norm, g->wq_b, s->d_cqn, s->d_cqn16, s->d_qf, a->cq, a->cqn, a->cq_rstd,
                        w->q_norm, w->wq_b, N, d->qr, H * dqk, &a->cqn_kept);
        input_grad_part(m, s, 1, d_xn, g->wq_a, s->d_cq, xn, w->wq_a, N, d->D, d->qr, &a->xn_kept);
    } else {
        input_grad_part(m, s, 1, d_xn, g->wq, s->d_qf, xn, w->wq, N, d->D, H * dqk, &a->xn_kept);
    }
}
