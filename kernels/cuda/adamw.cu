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

// param, grad (n) FP32; m, v (n) BF16 bit patterns. For each element, in FP32:
//   g = grad * grad_scale
//   m = beta1 m + (1 - beta1) g;          v = beta2 v + (1 - beta2) (g g)
//   mhat = m / (1 - beta1^t);             vhat = v / (1 - beta2^t)
//   param -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * param)
//   store m, v rounded to BF16 (RNE)
__global__ void adamw_kernel(float *param, const float *grad, uint16_t *m, uint16_t *v, int64_t n, float lr,
                             float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                             float bias_correction1, float bias_correction2, float eps, float weight_decay,
                             float grad_scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = __fmul_rn(grad[i], grad_scale);
        const float m_old = __bfloat162float(__ushort_as_bfloat16(m[i]));
        const float v_old = __bfloat162float(__ushort_as_bfloat16(v[i]));
        const float m_new = __fadd_rn(__fmul_rn(beta1, m_old), __fmul_rn(one_minus_beta1, g));
        const float v_new = __fadd_rn(__fmul_rn(beta2, v_old), __fmul_rn(one_minus_beta2, __fmul_rn(g, g)));
        const float m_hat = __fdiv_rn(m_new, bias_correction1);
        const float v_hat = __fdiv_rn(v_new, bias_correction2);
        const float p = param[i];
        const float step = __fadd_rn(__fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), eps)), __fmul_rn(weight_decay, p));
        param[i] = __fsub_rn(p, __fmul_rn(lr, step));
        m[i] = __bfloat16_as_ushort(__float2bfloat16_rn(m_new));
        v[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v_new));
    }
}

extern "C" void cuda_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr,
                                  float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t) {
    if (n <= 0) return;
    if (t < 1) {
        fprintf(stderr, "%s:%d: cuda_adamw_update got step t = %d; expected t >= 1 (bias correction)\n", __FILE__,
                __LINE__, t);
        exit(1);
    }
    // In double, rounded once to float, exactly as cpu_adamw_update does.
    const float bias_correction1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float bias_correction2 = (float)(1.0 - pow((double)beta2, (double)t));
    adamw_kernel<<<grid_for(n, ADAMW_THREADS), ADAMW_THREADS>>>(param, grad, m, v, n, lr, beta1, 1.0f - beta1, beta2,
                                                                1.0f - beta2, bias_correction1, bias_correction2, eps,
                                                                weight_decay, grad_scale);
    CUDA_CHECK_LAUNCH("adamw_kernel");
}
