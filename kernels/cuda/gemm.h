/*
 * gemm.h - the lower level of kernels/cuda/gemm.cu, for code that keeps GEMM outputs in BF16 on the GPU
 * (the benchmark now, the model's FP8 path later). kernels.h's fp8_gemm_fprop/dgrad and bf16_matmul_*
 * write `real` (float) and are built on these plus a BF16 -> float conversion.
 *
 * All pointers are device pointers; everything here runs on the default stream. BF16 values are uint16_t
 * bit patterns (the same as kernels.h's float_to_bf16). Shapes are row-major, last index fastest;
 * "M x N x K" means an (M, N) output and a contraction of length K.
 */
#ifndef FP8MOE_CUDA_GEMM_H
#define FP8MOE_CUDA_GEMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// FP8 Fprop with BF16 output, the GEMM alone: operands as for fp8_gemm_fprop (kernels.h);
// y (T, Np) BF16, Np = 128 * ceil(N/128) (columns N..Np-1 come from the zero padding rows of qw: 0).
// T must be a multiple of 16 (the row count of fp8_quantize_1x128's padded output); pointers 16-byte aligned.
void cuda_fp8_gemm_fprop_bf16(uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *qw,
                              const float *sw, int T, int N, int K);
// FP8 Dgrad with BF16 output written (not added): operands as for fp8_gemm_dgrad; dx (T, Kp) BF16,
// Kp = 128 * ceil(K/128), T a multiple of 16.
void cuda_fp8_gemm_dgrad_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                              const float *sw, int T, int N, int K);

// Which kernel runs the GEMMs of kernels.h's grouped FP8 Fprops and Dgrads with more than one segment from now on:
// 1 = fp8moe's own grouped kernel (fp8_grouped_gemm.h; the default), 0 = one cuBLASLt GEMM per segment. The first
// grouped call reads the environment variable FP8MOE_GROUPED_GEMM = own | cublaslt; this overrides it (the benchmark
// and the test compare the two). Returns the previous choice.
int cuda_fp8_grouped_gemm_use_own(int enable);

// BF16 GEMM, FP32 accumulation, row-major: C (M, N) = op(A) op(B) + beta C, where op(A) is (M, K) and
// op(B) is (K, N); A is stored (M, K), or (K, M) when a_trans; B is stored (K, N), or (N, K) when
// b_trans. C is FP32 when c_fp32, else BF16 (then beta must be 0).
//   Linear forward  out = inp W^T:    a = inp (M, K), b = W (N, K), b_trans = 1
//   dinp = dout W:                    a = dout (M, K), b = W (K, N)
//   dW  += dout^T inp:                a = dout (K, M), a_trans = 1, b = inp (K, N), beta = 1, FP32
void cuda_bf16_gemm(void *c, int c_fp32, float beta, const uint16_t *a, int a_trans, const uint16_t *b, int b_trans,
                    int M, int N, int K);

// dst (n) = BF16(src) with round-to-nearest-even.
void cuda_float_to_bf16(uint16_t *dst, const float *src, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
