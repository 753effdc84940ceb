/*
 * adamw.cu - CUDA AdamW step over a flat FP32 parameter buffer with BF16 moments (kernels.h:
 * adamw_update), the DeepSeek-V3 optimizer recipe: FP32 master weights and gradients, first and
 * second moments stored as BF16 (round-to-nearest-even), the update computed in FP32.
 * Same function as cpu_adamw_update; checked against it by tests/gpu.
 *
 * Elementwise grid-stride loop over n (int64). Every operation is a __f*_rn intrinsic, in the order
 * of cpu_adamw_update (kernels/cpu/optim_ops.c), so nvcc cannot contract it into FMAs: with the CPU
 * reference built with -ffp-contract=off the same expressions give the same bits. The bias
 * corrections 1 - beta^t are computed once on the host in double and rounded to float, as the CPU op
 * does. The step uses the FP32 moments just computed; BF16 rounding applies only to what is stored
 * (__float2bfloat16_rn is round-to-nearest-even, like float_to_bf16 on the host; a NaN moment
 * becomes the canonical NaN 0x7FFF here but keeps its sign there, the only bit difference possible).
 */
#include <math.h>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static const int ADAMW_THREADS = 256;

// One element, in FP32:
//   g = grad * grad_scale
//   m = beta1 m + (1 - beta1) g;          v = beta2 v + (1 - beta2) (g g)
//   mhat = m / (1 - beta1^t);             vhat = v / (1 - beta2^t)
//   param -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * param)
//   store m, v rounded to BF16 (RNE)
struct AdamwArgs {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction1, bias_correction2, eps, weight_decay,
        grad_scale;
};

__device__ inline void adamw_element(float &p, float grad, uint16_t &m, uint16_t &v, const AdamwArgs &a) {
    const float g = __fmul_rn(grad, a.grad_scale);
    const float m_old = __bfloat162float(__ushort_as_bfloat16(m));
    const float v_old = __bfloat162float(__ushort_as_bfloat16(v));
    const float m_new = __fadd_rn(__fmul_rn(a.beta1, m_old), __fmul_rn(a.one_minus_beta1, g));
    const float v_new = __fadd_rn(__fmul_rn(a.beta2, v_old), __fmul_rn(a.one_minus_beta2, __fmul_rn(g, g)));
    const float m_hat = __fdiv_rn(m_new, a.bias_correction1);
    const float v_hat = __fdiv_rn(v_new, a.bias_correction2);
    const float step = __fadd_rn(__fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), a.eps)), __fmul_rn(a.weight_decay, p));
    p = __fsub_rn(p, __fmul_rn(a.lr, step));
    m = __bfloat16_as_ushort(__float2bfloat16_rn(m_new));
    v = __bfloat16_as_ushort(__float2bfloat16_rn(v_new));
}

// param, grad (n) FP32; m, v (n) BF16 bit patterns; b (n), when not NULL, the updated param rounded to BF16 (RNE,
// bf16_round_array's bits: kernels.h adamw_update_bf16_copy). With VEC4 each thread moves 4 consecutive elements
// per step (16-byte FP32 and 8-byte BF16 accesses): four times the bytes in flight per thread, which the
// scalar loop lacked to reach the memory bandwidth (its divisions and square root sit between the loads of
// one element and the next). The callers pick it when n is a multiple of 4 and the pointers are aligned.
template <bool VEC4>
__global__ void adamw_kernel(float *param, const float *grad, uint16_t *m, uint16_t *v, uint16_t *b, int64_t n,
                             const AdamwArgs a) {
    const int per = VEC4 ? 4 : 1;
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * per; i < n;
         i += (int64_t)gridDim.x * blockDim.x * per) {
        if (VEC4) {
            float4 p = *reinterpret_cast<const float4 *>(param + i);
            const float4 g = *reinterpret_cast<const float4 *>(grad + i);
            ushort4 mm = *reinterpret_cast<const ushort4 *>(m + i), vv = *reinterpret_cast<const ushort4 *>(v + i);
            adamw_element(p.x, g.x, mm.x, vv.x, a);
            adamw_element(p.y, g.y, mm.y, vv.y, a);
            adamw_element(p.z, g.z, mm.z, vv.z, a);
            adamw_element(p.w, g.w, mm.w, vv.w, a);
            *reinterpret_cast<float4 *>(param + i) = p;
            *reinterpret_cast<ushort4 *>(m + i) = mm, *reinterpret_cast<ushort4 *>(v + i) = vv;
            if (b != NULL) *reinterpret_cast<uint2 *>(b + i) = make_uint2(bf16x2_bits(p.x, p.y), bf16x2_bits(p.z, p.w));
        } else {
            adamw_element(param[i], grad[i], m[i], v[i], a);
            if (b != NULL) b[i] = bf16_bits(param[i]);
        }
    }
}

// kernels.h adamw_update (b NULL) and adamw_update_bf16_copy: one launch.
static void launch_adamw(const char *op, real *param, const real *grad, uint16_t *m, uint16_t *v, uint16_t *b,
                         int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                         int t) {
    if (n <= 0) return;
    if (t < 1) {
        fprintf(stderr, "%s:%d: %s got step t = %d; expected t >= 1 (bias correction)\n", __FILE__, __LINE__, op, t);
        exit(1);
    }
    // In double, rounded once to float, exactly as cpu_adamw_update does.
    const float bias_correction1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float bias_correction2 = (float)(1.0 - pow((double)beta2, (double)t));
    const AdamwArgs a = {lr, beta1, 1.0f - beta1, beta2, 1.0f - beta2, bias_correction1, bias_correction2, eps,
                         weight_decay, grad_scale};
    const int vec4 = n % 4 == 0 && (uintptr_t)param % 16 == 0 && (uintptr_t)grad % 16 == 0 && (uintptr_t)m % 8 == 0 &&
                     (uintptr_t)v % 8 == 0 && (uintptr_t)b % 8 == 0;
    if (vec4) adamw_kernel<true><<<grid_for(n / 4, ADAMW_THREADS), ADAMW_THREADS>>>(param, grad, m, v, b, n, a);
    else adamw_kernel<false><<<grid_for(n, ADAMW_THREADS), ADAMW_THREADS>>>(param, grad, m, v, b, n, a);
    CUDA_CHECK_LAUNCH("adamw_kernel");
}

extern "C" void cuda_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr,
                                  float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t) {
    launch_adamw("cuda_adamw_update", param, grad, m, v, NULL, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
}

extern "C" void cuda_adamw_update_bf16_copy(real *param, const real *grad, uint16_t *m, uint16_t *v, uint16_t *b,
                                            int64_t n, float lr, float beta1, float beta2, float eps,
                                            float weight_decay, float grad_scale, int t) {
    launch_adamw("cuda_adamw_update_bf16_copy", param, grad, m, v, b, n, lr, beta1, beta2, eps, weight_decay,
                 grad_scale, t);
}
