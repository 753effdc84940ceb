/*
 * swiglu.cuh - the SwiGLU gate's per-element arithmetic on the GPU, shared by its ops (swiglu.cu) and by the
 * FP8 quantisers that compute the gate's values as they read them (fp8_quant.cu, kernels.h
 * fp8_quantize_swiglu_*): one definition, so a value quantised on the fly has the bits swiglu_forward /
 * swiglu_backward would have written.
 *
 * The __f*_rn intrinsics keep nvcc from fusing a multiply and an add into an FMA: the CPU reference is built
 * with -ffp-contract=off, and keeping the same roundings leaves expf (CUDA's is within 2 ulp, glibc's within
 * 1) as the only difference from cpu_swiglu_*.
 */
#ifndef FP8MOE_CUDA_SWIGLU_CUH
#define FP8MOE_CUDA_SWIGLU_CUH

__device__ inline float sigmoidf_rn(float a) { return __frcp_rn(__fadd_rn(1.0f, expf(-a))); }

// out = silu(a) * b = (a * sigmoid(a)) * b, rounded as cpu_swiglu_forward does.
__device__ inline float swiglu_element(float a, float b) { return __fmul_rn(__fmul_rn(a, sigmoidf_rn(a)), b); }

// In the forward pass this was out = silu(a) * b, so with s = sigmoid(a) (computed once):
//   db = dout * silu(a)
//   da = dout * b * silu'(a),  silu'(a) = s * (1 + a * (1 - s))
__device__ inline void swiglu_backward_element(float *da, float *db, float dout, float a, float b) {
    const float s = sigmoidf_rn(a);
    *db = __fmul_rn(dout, __fmul_rn(a, s));
    const float dsilu = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(a, __fsub_rn(1.0f, s))));
    *da = __fmul_rn(__fmul_rn(dout, b), dsilu);
}

#endif
