/*
 * crossentropy.cu - CUDA softmax cross-entropy over the vocabulary (kernels.h: crossentropy_forward /
 * crossentropy_backward), for the output head and the MTP heads. Same function as cpu_crossentropy_*;
 * checked against it by tests/gpu.
 *
 * One block per row (token): V is large (50257 for GPT-2 text, 129280 for DeepSeek-V3), so each row
 * is reduced by a whole block in a fixed tree order (deterministic, no atomics). Rows are indexed
 * with int64 so N * V may exceed 2^31.
 */
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static const int CE_THREADS = 512;

// ---------------------------------------------------------------------------- forward
// A row's loss -log softmax(x)[t] = (log(sum_exp) + max) - x[t] from its statistics: 0 for a masked row (t = -1),
// NaN for a target outside [-1, V).
__device__ inline float row_loss(int t, int V, float max_x, float sum_exp, float x_target) {
    if (t == -1) return 0.0f;
    if (t < -1 || t >= V) return NAN;
    return __fsub_rn(__fadd_rn(logf(sum_exp), max_x), x_target);
}

// logits (N, V), targets (N) int32 in [0, V) or -1 (masked) ->
//   probs (N, V) = softmax of each row (written for masked rows too: it is the same function),
//   losses (N) = -log probs[target] = (log(sum_j exp(x_j - max)) + max) - x_target; 0 where masked
//   (from the sum, not the rounded probability, so it stays accurate when that probability is tiny).
// A target outside [-1, V) makes that row's loss NaN, so a bad id shows up in the loss instead of
// reading out of bounds.
__global__ void crossentropy_forward_kernel(float *losses, float *probs, const float *logits, const int *targets,
                                            int V) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = logits + row * V;
    float *p = probs + row * V;
    // probs may alias logits: the target's logit is read before the barriers in block_max/block_sum,
    // every other x[j] is read by the thread that later overwrites it
    const int t = targets[row];
    const float x_target = (threadIdx.x == 0 && t >= 0 && t < V) ? x[t] : 0.0f;

    float max_x = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) max_x = fmaxf(max_x, x[j]);
    max_x = block_max(max_x, scratch);

    float sum_exp = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) sum_exp = __fadd_rn(sum_exp, expf(__fsub_rn(x[j], max_x)));
    sum_exp = block_sum(sum_exp, scratch);

    for (int j = threadIdx.x; j < V; j += blockDim.x) p[j] = __fdiv_rn(expf(__fsub_rn(x[j], max_x)), sum_exp);

    if (threadIdx.x == 0) losses[row] = row_loss(t, V, max_x, sum_exp, x_target);
}

// The same function with the row held in registers (V <= PER_THREAD * CE_THREADS): element j stays with thread
// j % blockDim.x, in slot j / blockDim.x, exactly the elements and order of the loops above, so the max, the sum
// and every probability have the kernel above's bits. The row is read from memory once instead of three times
// (the head's logits are N x V floats, 2 GiB per 16384-token micro-batch at V = 32768), and each exponential is
// computed once.
template <int PER_THREAD>
__global__ void __launch_bounds__(CE_THREADS)
    crossentropy_forward_registers_kernel(float *losses, float *probs, const float *logits, const int *targets,
                                          int V) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = logits + row * V;
    float *p = probs + row * V;
    const int t = targets[row];
    const float x_target = (threadIdx.x == 0 && t >= 0 && t < V) ? x[t] : 0.0f;  // before any store (aliasing)

    float v[PER_THREAD];
    float max_x = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < V ? x[j] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++)
        if (threadIdx.x + i * blockDim.x < V) max_x = fmaxf(max_x, v[i]);
    max_x = block_max(max_x, scratch);

    float sum_exp = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        if (threadIdx.x + i * blockDim.x < V) {
            v[i] = expf(__fsub_rn(v[i], max_x));
            sum_exp = __fadd_rn(sum_exp, v[i]);
        }
    }
    sum_exp = block_sum(sum_exp, scratch);

#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < V) p[j] = __fdiv_rn(v[i], sum_exp);
    }

    if (threadIdx.x == 0) losses[row] = row_loss(t, V, max_x, sum_exp, x_target);
}

extern "C" void cuda_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N,
                                          int V) {
    if (N <= 0 || V <= 0) return;
    const int per_thread = (V + CE_THREADS - 1) / CE_THREADS;  // 64 at V = 32768; larger rows take three passes
    if (per_thread <= 8)
        crossentropy_forward_registers_kernel<8><<<N, CE_THREADS>>>(losses, probs, logits, targets, V);
    else if (per_thread <= 32)
        crossentropy_forward_registers_kernel<32><<<N, CE_THREADS>>>(losses, probs, logits, targets, V);
    else if (per_thread <= 64)
        crossentropy_forward_registers_kernel<64><<<N, CE_THREADS>>>(losses, probs, logits, targets, V);
    else
        crossentropy_forward_kernel<<<N, CE_THREADS>>>(losses, probs, logits, targets, V);
    CUDA_CHECK_LAUNCH("crossentropy_forward_kernel");
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was loss = -log softmax(x)[target], so d loss / d x = probs - onehot(target).
// WRITES (does not accumulate) dlogits (N, V) = (probs - onehot(target)) * dloss; 0 for masked rows.
// One block per row so the row's target is read once. dlogits may alias probs (each element is read and
// written by the same thread).
__global__ void crossentropy_backward_kernel(float *dlogits, const float *probs, const int *targets, float dloss,
                                             int V) {
    const int64_t row = blockIdx.x;
    const float *p = probs + row * V;
    float *d = dlogits + row * V;
    const int t = targets[row];
    if (t < 0) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = 0.0f;
        return;
    }
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float indicator = j == t ? 1.0f : 0.0f;
        d[j] = __fmul_rn(__fsub_rn(p[j], indicator), dloss);
    }
}

extern "C" void cuda_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N,
                                           int V) {
    if (N <= 0 || V <= 0) return;
    crossentropy_backward_kernel<<<N, CE_THREADS>>>(dlogits, probs, targets, dloss, V);
    CUDA_CHECK_LAUNCH("crossentropy_backward_kernel");
}
