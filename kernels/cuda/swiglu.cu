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

// ---------------------------------------------------------------------------- BF16 operands (bf16 mode's FFNs)
// kernels.h swiglu_forward_bf16 / swiglu_backward_bf16: a, b and dh are GEMM products in BF16 rows of stride ld
// (bf16_rows_ld(I)), the outputs packed (rows, I) GEMM operands; each value is swiglu.cuh's on the widened inputs,
// rounded once (the bits of swiglu_forward / swiglu_backward followed by bf16_round_array). PER = 4: I % 4 == 0 and
// every pointer 8-byte aligned, four elements per access; else one.
template <int PER> struct Bf16Unit;
template <> struct Bf16Unit<4> {
    typedef float4 Value;
    static __device__ float4 load(const uint16_t *p) { return bf16x4_to_float4(*reinterpret_cast<const uint2 *>(p)); }
    static __device__ void store(uint16_t *p, float4 v) {
        *reinterpret_cast<uint2 *>(p) = make_uint2(bf16x2_bits(v.x, v.y), bf16x2_bits(v.z, v.w));
    }
};
template <> struct Bf16Unit<1> {
    typedef float Value;
    static __device__ float load(const uint16_t *p) { return bf16_bits_to_float(*p); }
    static __device__ void store(uint16_t *p, float v) { *p = bf16_bits(v); }
};

__device__ inline float swiglu_unit(float a, float b) { return swiglu_element(a, b); }
__device__ inline float4 swiglu_unit(float4 a, float4 b) {
    return make_float4(swiglu_element(a.x, b.x), swiglu_element(a.y, b.y), swiglu_element(a.z, b.z),
                       swiglu_element(a.w, b.w));
}
__device__ inline void swiglu_backward_unit(float *da, float *db, float g, float a, float b) {
    swiglu_backward_element(da, db, g, a, b);
}
__device__ inline void swiglu_backward_unit(float4 *da, float4 *db, float4 g, float4 a, float4 b) {
    swiglu_backward_element(&da->x, &db->x, g.x, a.x, b.x);
    swiglu_backward_element(&da->y, &db->y, g.y, a.y, b.y);
    swiglu_backward_element(&da->z, &db->z, g.z, a.z, b.z);
    swiglu_backward_element(&da->w, &db->w, g.w, a.w, b.w);
}

// Element (r, c) of the launch's unit i: r = i / units, c = (i % units) * PER.
template <int PER>
__global__ void swiglu_forward_bf16_kernel(uint16_t *h, const uint16_t *a, const uint16_t *b, int64_t ld, int64_t rows,
                                           int width) {
    typedef Bf16Unit<PER> U;
    const int units = width / PER;
    const int64_t n = rows * units;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / units;
        const int64_t c = (i - r * units) * PER, at = r * ld + c;
        U::store(h + r * width + c, swiglu_unit(U::load(a + at), U::load(b + at)));
    }
}

template <int PER>
__global__ void swiglu_backward_bf16_kernel(uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh,
                                            const uint16_t *a, const uint16_t *b, int64_t ld, int64_t rows, int width) {
    typedef Bf16Unit<PER> U;
    const int units = width / PER;
    const int64_t n = rows * units;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / units;
        const int64_t c = (i - r * units) * PER, at = r * ld + c, out = r * width + c;
        const typename U::Value x = U::load(a + at), y = U::load(b + at);
        typename U::Value ga, gb;
        swiglu_backward_unit(&ga, &gb, U::load(dh + at), x, y);
        U::store(da + out, ga);
        U::store(db + out, gb);
        if (h != NULL) U::store(h + out, swiglu_unit(x, y));
    }
}

static bool aligned8(const void *p) { return (uintptr_t)p % 8 == 0; }  // NULL counts as aligned

extern "C" void cuda_swiglu_forward_bf16(uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width) {
    const int64_t n = (int64_t)rows * width, ld = bf16_rows_ld(width);
    if (n <= 0) return;
    if (width % 4 == 0 && aligned8(h) && aligned8(a) && aligned8(b))
        swiglu_forward_bf16_kernel<4><<<grid_for(n / 4, SWIGLU_THREADS), SWIGLU_THREADS>>>(h, a, b, ld, rows, width);
    else
        swiglu_forward_bf16_kernel<1><<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(h, a, b, ld, rows, width);
    CUDA_CHECK_LAUNCH("swiglu_forward_bf16_kernel");
}

extern "C" void cuda_swiglu_backward_bf16(uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh,
                                          const uint16_t *a, const uint16_t *b, int rows, int width) {
    const int64_t n = (int64_t)rows * width, ld = bf16_rows_ld(width);
    if (n <= 0) return;
    if (width % 4 == 0 && aligned8(h) && aligned8(da) && aligned8(db) && aligned8(dh) && aligned8(a) && aligned8(b))
        swiglu_backward_bf16_kernel<4><<<grid_for(n / 4, SWIGLU_THREADS), SWIGLU_THREADS>>>(h, da, db, dh, a, b, ld,
                                                                                             rows, width);
    else
        swiglu_backward_bf16_kernel<1><<<grid_for(n, SWIGLU_THREADS), SWIGLU_THREADS>>>(h, da, db, dh, a, b, ld,
                                                                                         rows, width);
    CUDA_CHECK_LAUNCH("swiglu_backward_bf16_kernel");
}
