/*
 * cpu_ops.h - the FP32/FP64 reference implementations behind kernels.h (one cpu_ function per op,
 * same arguments without the Device). Tests may call them directly.
 */
#ifndef FP8MOE_CPU_OPS_H
#define FP8MOE_CPU_OPS_H

#include "kernels/kernels.h"
void cpu_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cpu_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);
void cpu_embedding_forward(real *out, const int *tokens, const real *table, int N, int C);
void cpu_embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C);
void cpu_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C);
void cpu_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, const real *rstd, int N, int C);
void cpu_rope_forward(real *out, const real *inp, int B, int T, int H, int D, real theta);
void cpu_rope_backward(real *dinp, const real *dout, int B, int T, int H, int D, real theta);
void cpu_attention_forward(real *out, real *att, const real *q, const real *k, const real *v, int B, int T, int H, int Dqk, int Dv);
void cpu_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *att, const real *q, const real *k, const real *v, int B, int T, int H, int Dqk, int Dv);
void cpu_swiglu_forward(real *out, const real *a, const real *b, int64_t n);
void cpu_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n);
void cpu_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V);
void cpu_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N, int V);
double cpu_sum_squares(const real *x, int64_t n);
void cpu_scale_inplace(real *x, real s, int64_t n);
void cpu_add_inplace(real *y, const real *x, int64_t n);
void cpu_copy_block(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate);
void cpu_router_forward(int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias, int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze);
void cpu_router_backward(real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx, const real *scores, int N, int E, int K, real route_scale);
real cpu_balance_loss_forward(int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, int freeze);
void cpu_balance_loss_backward(real *dscores, const int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, real dloss);
void cpu_gather_rows(real *out, const real *inp, const int *src_row, int n_rows, int C);
void cpu_moe_unpermute_backward(real *dinp, const real *dseg, const int *slot_of, int N, int K, int C);
void cpu_moe_combine_forward(real *out, const real *expert_out, const int *slot_of, const real *topk_w, int N, int K, int C);
void cpu_moe_combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out, const int *slot_of, const real *topk_w, int N, int K, int C);
void cpu_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);

#endif
