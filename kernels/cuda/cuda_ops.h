/*
 * cuda_ops.h - CUDA implementations behind kernels.h (one cuda_ function per op, same arguments
 * without the Device; pointers are device pointers). Only built when FP8MOE_CUDA is defined.
 */
#ifndef FP8MOE_CUDA_OPS_H
#define FP8MOE_CUDA_OPS_H

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif
void cuda_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C);
void cuda_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, const real *rstd, int N, int C);
void cuda_rmsnorm_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src, int64_t src_stride, const real *inp, const real *weight, const real *rstd, int N, int C);
void cuda_swiglu_forward(real *out, const real *a, const real *b, int64_t n);
void cuda_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n);
void cuda_swiglu_forward_bf16(uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width);
void cuda_swiglu_backward_bf16(uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh, const uint16_t *a,
                               const uint16_t *b, int rows, int width);
void cuda_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V);
void cuda_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N, int V);
void cuda_crossentropy_forward_bf16(real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                                    const int *targets, int N, int V);
void cuda_crossentropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                     const double *row_sum, const int *targets, real dloss, int N, int V);
void cuda_crossentropy_probs_bf16(real *probs, const uint16_t *logits, const real *row_max, const double *row_sum,
                                  int N, int V);
void cuda_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);
void cuda_adamw_update_bf16_copy(real *param, const real *grad, uint16_t *m, uint16_t *v, uint16_t *b, int64_t n,
                                 float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                                 int t);

// FP8 block scaling and the BF16 baseline GEMMs (kernels/cuda/fp8_quant.cu, kernels/cuda/gemm.cu).
int cuda_fp8_check_finite(char *err, size_t err_size);
// The quantisers' fast division against __fdiv_rn over every FP32 significand of the scale (fp8_quant.cu): how many
// of the 2^23 x per_scale quotients differ in E4M3 code, or in FP32 bits where the fast path claims them (the answer
// must be 0). For tests/gpu/test_gpu_fp8.c.
unsigned long long cuda_fp8_division_mismatches(int per_scale);
int cuda_fp8_quantize_1x128(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size);
int cuda_fp8_quantize_128x128_batched(uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N, int K, char *err,
                                      size_t err_size);
int cuda_fp8_quantize_128x128(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err, size_t err_size);
int cuda_fp8_quantize_128x1_transposed(uint8_t *q, float *s, const real *x, int T, int C, char *err, size_t err_size);
int cuda_fp8_quantize_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T, int C, char *err,
                                   size_t err_size);
int cuda_fp8_quantize_rmsnorm_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                           const real *rstd, const real *weight, int T, int C, char *err,
                                           size_t err_size);
int cuda_fp8_quantize_1x128_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg, const int *rows0, int K, char *err,
                                    size_t err_size);
int cuda_fp8_quantize_128x1_transposed_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg, const int *rows0, int C,
                                               char *err, size_t err_size);
int cuda_fp8_quantize_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int n_seg,
                                           const int *rows0, int C, char *err, size_t err_size);
void cuda_fp8_gather_1x128_grouped(uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n, const int *x_rows,
                                   int n_seg, const int *rows0, int K);
int cuda_fp8_quantize_combine_grad_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                                        const real *dout, const int *seg_token, const int *slot_of,
                                                        const real *topk_w, int K, int n_seg, const int *rows0, int C,
                                                        char *err, size_t err_size);
int cuda_fp8_quantize_swiglu_1x128_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout, const uint16_t *a,
                                           const uint16_t *b, int n_seg, const int *rows0, int C, char *err,
                                           size_t err_size);
int cuda_fp8_quantize_swiglu_128x1_transposed_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                                      const uint16_t *a, const uint16_t *b, int n_seg, const int *rows0, int C,
                                                      char *err, size_t err_size);
int cuda_fp8_quantize_swiglu_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, SwigluValue value,
                                                  const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                  const int *rows0, int C, char *err, size_t err_size);
int cuda_fp8_quantize_swiglu_grads_both_layouts_grouped(uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                        uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                        const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                        const int *rows0, int C, char *err, size_t err_size);
void cuda_fp8_gemm_fprop(real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw, int T, int N, int K);
void cuda_fp8_gemm_dgrad(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw, int T, int N, int K);
void cuda_fp8_gemm_fprop_grouped_bf16(uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                      const float *const *sw, int n_seg, const int *rows0, int N, int K);
void cuda_fp8_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *const *qwt,
                                      const float *const *sw, int n_seg, const int *rows0, int N, int K);
void cuda_fp8_gemm_fprop_grouped(real *y, const real *residual, const uint8_t *qx, const float *sx,
                                 const uint8_t *const *qw, const float *const *sw, int n_seg, const int *rows0, int N,
                                 int K);
void cuda_fp8_gemm_dgrad_grouped(real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats, const uint8_t *const *qdy, const float *const *sdy,
                                 const uint8_t *const *const *qwt, const float *const *const *sw, int n_seg, const int *rows0,
                                 int N, int K);
void cuda_fp8_gemm_wgrad(real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt, int T, int N, int K);
void cuda_fp8_gemm_wgrad_grouped(real *dw, int write, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt,
                                 const float *sxt, int n_seg, const int *rows0, int N, int K);
void cuda_bf16_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cuda_bf16_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);
void cuda_bf16_gemm_fprop_grouped(real *y, const real *residual, const uint16_t *x, const uint16_t *const *w,
                                  int n_seg, const int *rows0, int N, int K);
void cuda_bf16_gemm_dgrad_grouped(real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats, const uint16_t *const *dy,
                                  const uint16_t *const *const *w, int n_seg, const int *rows0, int N, int K);
void cuda_bf16_gemm_fprop_grouped_bf16(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                       const int *rows0, int N, int K);
void cuda_bf16_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                       const int *rows0, int N, int K);
void cuda_float_rows_to_bf16(uint16_t *dst, const float *src, const int *rows, int n_rows, int C);
void cuda_bf16_to_float(float *dst, const uint16_t *src, int64_t n);
void cuda_bf16_gemm_wgrad(real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K);
void cuda_bf16_gemm_wgrad_grouped(real *dw, int write, const uint16_t *dy, const uint16_t *x, int n_seg,
                                  const int *rows0, int N, int K);
void cuda_bf16_matmul_forward_bf16(uint16_t *out, const real *inp, const real *weight, int N, int C, int OC);
void cuda_bf16_matmul_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                                    const real *weight, int N, int C, int OC);

// Causal attention core, flash-style (kernels/cuda/attention.cu); state = lse (B, H, T) and the staged BF16
// q, k, v, see kernels.h; the backward's out is the forward's output (B, T, H, Dv).
int64_t cuda_attention_state_elems(int B, int T, int H, int Dn, int Dr, int Dv);
void cuda_attention_forward(real *out, real *state, const real *q, const real *kv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv);
void cuda_attention_forward_bf16(real *out, real *state, const uint16_t *q16, int64_t ldq, const uint16_t *kv16,
                                 int64_t ldkv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv,
                                 real rope_theta);
void cuda_attention_backward(real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *out, const real *state, int B, int T, int H, int Dn, int Dr, int Dv);
void cuda_attention_backward_bf16(real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                                  const real *out, const real *state, int B, int T, int H, int Dn, int Dr, int Dv);
// Whether the attention core may run its Hopper kernels (kernels/cuda/attention_wgmma.cu) where they serve the
// head dims (default 1); 0 forces the mma.sync kernels. Returns the previous setting. For the benchmark's and the
// tests' comparison of the two kernel families on the same shape.
int cuda_attention_wgmma(int enable);

// Model glue ops (kernels/cuda/elementwise.cu), FP32 matmul (kernels/cuda/matmul.cu), MoE routing and
// permutation (kernels/cuda/moe.cu). embedding_forward, router_forward, balance_loss_forward, the permute plan
// and sum_squares copy a result or an error slot back to the host (they synchronise); see each file's comment.
void cuda_embedding_forward(real *out, const int *tokens, const real *table, int N, int C);
void cuda_embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C);
void cuda_rope_forward(real *out, const real *inp, int ld, int B, int T, int H, int D, real theta);
void cuda_rope_backward(real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta);
void cuda_copy_block(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate);
void cuda_add_inplace(real *y, const real *x, int64_t n);
void cuda_scale_inplace(real *x, real s, int64_t n);
double cuda_sum_squares(const real *x, int64_t n);
void cuda_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cuda_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);
void cuda_router_forward(int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias, int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze);
void cuda_router_backward(real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx, const real *scores, int N, int E, int K, real route_scale);
real cuda_balance_loss_forward(int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, int freeze);
void cuda_balance_loss_backward(real *dscores, const int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, real dloss);
void cuda_moe_permute_plan(int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx, int N, int K, int E);
void cuda_gather_rows(real *out, const real *inp, const int *src_row, int n_rows, int C);
void cuda_moe_unpermute_backward(real *dinp, const real *dseg, const int *slot_of, int N, int K, int C);
void cuda_moe_combine_forward(real *out, const real *expert_out, const int *slot_of, const real *topk_w, const real *residual, int N, int K, int C);
void cuda_moe_combine_forward_bf16(real *out, const uint16_t *base, const uint16_t *expert_out, const int *slot_of, const real *topk_w,
                                   const real *residual, int N, int K, int C);
void cuda_moe_combine_backward_bf16(real *dtopk_w, const real *dout, const uint16_t *expert_out, const int *slot_of,
                                    const real *topk_w, int N, int K, int C);
void cuda_moe_combine_grad_bf16(uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of, int N, int K,
                                int C);
void cuda_moe_combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out, const int *slot_of, const real *topk_w, int N, int K, int C);

#ifdef __cplusplus
}
#endif
#endif
