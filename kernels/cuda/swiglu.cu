/*
 * swiglu.cu - CUDA SwiGLU gate, forward and backward (kernels.h: swiglu_forward / swiglu_backward),
 * the elementwise middle of every dense FFN and expert: out = silu(a) * b with a = w1 x, b = w3 x.
 * Same function as cpu_swiglu_*; checked against it by tests/gpu.
 *
 * Each element is independent, so these are grid-stride loops over n (int64: expert buffers can
 * exceed 2^31 elements). The per-element arithmetic is swiglu.cuh's, shared with the FP8 quantisers that
 * compute these values as they read them (fp8 mode's FFNs never call these ops).
 *
 * Both ops are pure memory traffic (a few flops per 12 or 20 bytes), so when every pointer is 16-byte
 * aligned each thread moves float4s: a quarter of the load/store instructions and four elements in
 * flight per access, which the scalar loop lacked to reach the memory bandwidth. The last n % 4
 * elements then take one thread each. Misaligned pointers (a caller's offset view) take the scalar
 * kernel; both give the same bits, the per-element arithmetic is shared.
 */
#include <stdint.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/swiglu.cuh"

static const int SWIGLU_THREADS = 256;

static bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }  // NULL counts as aligned

// ---------------------------------------------------------------------------- forward
// a, b, out (n). VEC4: a, b, out are 16-byte aligned; float4 i covers elements 4i .. 4i+3.
template <bool VEC4>
__global__ void swiglu_forward_kernel(float *out, const float *a, const float *b, int64_t n) {
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    int64_t scalar_from = 0;
    if (VEC4) {
        const int64_t n4 = n / 4;
        const float4 *a4 = reinterpret_cast<const float4 *>(a), *b4 = reinterpret_cast<const float4 *>(b);
        for (int64_t i = tid; i < n4; i += stride) {
            const float4 x = a4[i], y = b4[i];
            reinterpret_cast<float4 *>(out)[i] = make_float4(swiglu_element(x.x, y.x), swiglu_element(x.y, y.y),
                                                             swiglu_element(x.z, y.z), swiglu_element(x.w, y.w));
        }
        scalar_from = 4 * n4;  // the tail: fewer than 4 elements, fewer than the threads of one block
    }
    for (int64_t i = scalar_from + tid; i < n; i += stride) out[i] = swiglu_element(a[i], b[i]);
}

extern "C" void cuda_swiglu_forward(real *out, const real *a, const real *b, int64_t n) {
    if (n <= 0) return;
    if (aligned16(out) && aligned16(a) && aligned16(b))
        swiglu_forward_kernel<true><<<grid_for(n / 4, SWIGLU_THREADS), SWIGLU_THREADS>>>(out, a, b, n);
    else
        swiglu_forward_kernel<false><<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(out, a, b, n);
    CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

// ---------------------------------------------------------------------------- backward
// da and db are WRITTEN (kernels.h), so the old contents are never read: 20 bytes per element instead of
// the 28 of an accumulating version, and no memset of da, db before the call.

// Element i. da or db may be NULL (not needed); b is read only for da.
__device__ inline void swiglu_backward_at(float *da, float *db, const float *dout, const float *a, const float *b,
                                          int64_t i) {
    float ga, gb;
    swiglu_backward_element(&ga, &gb, dout[i], a[i], da != NULL ? b[i] : 0.0f);
    if (da != NULL) da[i] = ga;
    if (db != NULL) db[i] = gb;
}

// dout, a, b, da, db (n). VEC4: every non-NULL pointer is 16-byte aligned.
template <bool VEC4>
__global__ void swiglu_backward_kernel(float *da, float *db, const float *dout, const float *a, const float *b,
                                       int64_t n) {
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    int64_t scalar_from = 0;
    if (VEC4) {
        const int64_t n4 = n / 4;
        const float4 *g4 = reinterpret_cast<const float4 *>(dout), *a4 = reinterpret_cast<const float4 *>(a);
        const float4 *b4 = reinterpret_cast<const float4 *>(b);
        for (int64_t i = tid; i < n4; i += stride) {
            const float4 g = g4[i], x = a4[i], y = da != NULL ? b4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float4 ga, gb;
            swiglu_backward_element(&ga.x, &gb.x, g.x, x.x, y.x);
            swiglu_backward_element(&ga.y, &gb.y, g.y, x.y, y.y);
            swiglu_backward_element(&ga.z, &gb.z, g.z, x.z, y.z);
            swiglu_backward_element(&ga.w, &gb.w, g.w, x.w, y.w);
            if (da != NULL) reinterpret_cast<float4 *>(da)[i] = ga;
            if (db != NULL) reinterpret_cast<float4 *>(db)[i] = gb;
        }
        scalar_from = 4 * n4;  // the tail, as in the forward
    }
    for (int64_t i = scalar_from + tid; i < n; i += stride) swiglu_backward_at(da, db, dout, a, b, i);
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n) {
    if (n <= 0 || (da == NULL && db == NULL)) return;
    if (aligned16(da) && aligned16(db) && aligned16(dout) && aligned16(a) && aligned16(b))
        swiglu_backward_kernel<true><<<grid_for(n / 4, SWIGLU_THREADS), SWIGLU_THREADS>>>(da, db, dout, a, b, n);
    else
        swiglu_backward_kernel<false><<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(da, db, dout, a, b, n);
    CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}
