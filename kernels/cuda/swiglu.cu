/*
 * swiglu.cu - CUDA SwiGLU gate, forward and backward (kernels.h: swiglu_forward / swiglu_backward),
 * the elementwise middle of every dense FFN and expert: out = silu(a) * b with a = w1 x, b = w3 x.
 * Same function as cpu_swiglu_*; checked against it by tests/gpu.
 *
 * Each element is independent, so these are grid-stride loops over n (int64: expert buffers can
 * exceed 2^31 elements). Arithmetic uses the __f*_rn intrinsics so nvcc cannot fuse a multiply and
 * an add into an FMA: the CPU reference is built with -ffp-contract=off, and keeping the same
 * roundings leaves expf (CUDA's is within 2 ulp, glibc's within 1) as the only difference.
 */
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static const int SWIGLU_THREADS = 256;

__device__ inline float sigmoidf_rn(float a) { return __frcp_rn(__fadd_rn(1.0f, expf(-a))); }

// a, b, out (n): out = a * sigmoid(a) * b
__global__ void swiglu_forward_kernel(float *out, const float *a, const float *b, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float silu = __fmul_rn(a[i], sigmoidf_rn(a[i]));
        out[i] = __fmul_rn(silu, b[i]);
    }
}

extern "C" void cuda_swiglu_forward(real *out, const real *a, const real *b, int64_t n) {
    if (n <= 0) return;
    swiglu_forward_kernel<<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(out, a, b, n);
    CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

// In the forward pass this was out = silu(a) * b, so:
//   db += dout * silu(a)
//   da += dout * b * silu'(a),  silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))
// da or db may be NULL (not needed).
__global__ void swiglu_backward_kernel(float *da, float *db, const float *dout, const float *a, const float *b,
                                       int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float s = sigmoidf_rn(a[i]);
        if (db != NULL) db[i] = __fadd_rn(db[i], __fmul_rn(dout[i], __fmul_rn(a[i], s)));
        if (da != NULL) {
            const float dsilu = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(a[i], __fsub_rn(1.0f, s))));
            da[i] = __fadd_rn(da[i], __fmul_rn(__fmul_rn(dout[i], b[i]), dsilu));
        }
    }
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n) {
    if (n <= 0 || (da == NULL && db == NULL)) return;
    swiglu_backward_kernel<<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(da, db, dout, a, b, n);
    CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}
