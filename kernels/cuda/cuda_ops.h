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
void cuda_swiglu_forward(real *out, const real *a, const real *b, int64_t n);
void cuda_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n);
void cuda_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V);
void cuda_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N, int V);
void cuda_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);

// FP8 block scaling and the BF16 baseline GEMMs (kernels/cuda/fp8_quant.cu, kernels/cuda/gemm.cu).
int cuda_fp8_quantize_1x128(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size);
int cuda_fp8_quantize_128x128(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err, size_t err_size);
int cuda_fp8_quantize_128x1_transposed(uint8_t *q, float *s, const real *x, int T, int C, char *err, size_t err_size);
void cuda_fp8_gemm_fprop(real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw, int T, int N, int K);
void cuda_fp8_gemm_dgrad(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw, int T, int N, int K);
void cuda_fp8_gemm_wgrad(real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt, int T, int N, int K);
void cuda_bf16_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cuda_bf16_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);

// Causal attention core, flash-style (kernels/cuda/attention.cu); state = lse (B, H, T), see kernels.h.
void cuda_attention_forward(real *out, real *state, const real *q, const real *k, const real *v, int B, int T, int H, int Dqk, int Dv);
void cuda_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *state, const real *q, const real *k, const real *v, int B, int T, int H, int Dqk, int Dv);

#ifdef __cplusplus
}
#endif
#endif
