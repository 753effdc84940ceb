/*
 * crossentropy.cu - CUDA softmax cross-entropy over the vocabulary (kernels.h: crossentropy_forward /
 * crossentropy_backward on FP32 logits, crossentropy_*_bf16 on BF16 logits), for the output head and the MTP
 * heads. Same function as cpu_crossentropy_*; checked against it by tests/gpu. The BF16 forms run the same
 * kernels reading BF16 (one template), keep each row's max and sum instead of writing probabilities, and the
 * backward recomputes each probability from them: the bits of the FP32 forms on the logits' values.
 *
 * One block per row (token): V is large (50257 for GPT-2 text, 129280 for DeepSeek-V3), so each row
 * is reduced by a whole block in a fixed tree order (deterministic, no atomics). Rows are indexed
 * with int64 so N * V may exceed 2^31.
 */
#include <cuda_bf16.h>

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

// The probability of logit x in a row of those statistics (the forward's, the backward's and
// crossentropy_probs_bf16's: the same bits).
__device__ inline float row_prob(float x, float max_x, float sum_exp) {
    return __fdiv_rn(expf(__fsub_rn(x, max_x)), sum_exp);
}

// Logit j of a row: FP32, or BF16 bits (the head's rounded products, kernels.h crossentropy_*_bf16).
__device__ inline float logit_at(const float *x, int64_t j) { return x[j]; }
__device__ inline float logit_at(const uint16_t *x, int64_t j) { return bf16_bits_to_float(x[j]); }

// What a forward writes besides the losses: the probabilities (FP32 logits; probs may alias them), or each row's
// max and sum (BF16 logits; probs NULL).
struct CeOut {
    float *probs, *row_max;
    double *row_sum;
};

// logits (N, V), targets (N) int32 in [0, V) or -1 (masked) ->
//   probs (N, V) = softmax of each row (written for masked rows too: it is the same function), or the row's
//   statistics, and losses (N) = -log probs[target] = (log(sum_j exp(x_j - max)) + max) - x_target; 0 where masked
//   (from the sum, not the rounded probability, so it stays accurate when that probability is tiny).
// A target outside [-1, V) makes that row's loss NaN, so a bad id shows up in the loss instead of
// reading out of bounds.
template <class L>
__global__ void crossentropy_forward_kernel(float *losses, CeOut out, const L *logits, const int *targets, int V) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const L *x = logits + row * V;
    float *p = out.probs ? out.probs + row * V : NULL;
    // probs may alias logits: the target's logit is read before the barriers in block_max/block_sum,
    // every other x[j] is read by the thread that later overwrites it
    const int t = targets[row];
    const float x_target = (threadIdx.x == 0 && t >= 0 && t < V) ? logit_at(x, t) : 0.0f;

    float max_x = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) max_x = fmaxf(max_x, logit_at(x, j));
    max_x = block_max(max_x, scratch);

    float sum_exp = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        sum_exp = __fadd_rn(sum_exp, expf(__fsub_rn(logit_at(x, j), max_x)));
    sum_exp = block_sum(sum_exp, scratch);

    if (p)
        for (int j = threadIdx.x; j < V; j += blockDim.x) p[j] = row_prob(logit_at(x, j), max_x, sum_exp);

    if (threadIdx.x == 0) {
        losses[row] = row_loss(t, V, max_x, sum_exp, x_target);
        if (!p) out.row_max[row] = max_x, out.row_sum[row] = sum_exp;
    }
}

// The same function with the row held in registers (V <= PER_THREAD * CE_THREADS): element j stays with thread
// j % blockDim.x, in slot j / blockDim.x, exactly the elements and order of the loops above, so the max, the sum
// and every probability have the kernel above's bits. The row is read from memory once instead of three times
// (the head's logits are N x V, 2 GiB per 16384-token micro-batch at V = 32768 in FP32), and each exponential is
// computed once.
template <int PER_THREAD, class L>
__global__ void __launch_bounds__(CE_THREADS)
    crossentropy_forward_registers_kernel(float *losses, CeOut out, const L *logits, const int *targets, int V) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const L *x = logits + row * V;
    float *p = out.probs ? out.probs + row * V : NULL;
    const int t = targets[row];
    const float x_target = (threadIdx.x == 0 && t >= 0 && t < V) ? logit_at(x, t) : 0.0f;  // before any store

    float v[PER_THREAD];
    float max_x = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < V ? logit_at(x, j) : -INFINITY;
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

    if (p) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; i++) {
            const int j = threadIdx.x + i * blockDim.x;
            if (j < V) p[j] = __fdiv_rn(v[i], sum_exp);  // row_prob, its exponential already taken
        }
    }

    if (threadIdx.x == 0) {
        losses[row] = row_loss(t, V, max_x, sum_exp, x_target);
        if (!p) out.row_max[row] = max_x, out.row_sum[row] = sum_exp;
    }
}

// The BF16 form of the same function with the row staged in shared memory (V <= PER_THREAD * CE_THREADS, V * 2 bytes
// of dynamic shared memory): the block copies the row in 16-byte chunks, all of a thread's loads in flight at once,
// then thread t reads its elements t + i * CE_THREADS from shared memory - the elements and order of the kernels
// above, so the same bits. The registers form holds 64 values per thread, which leaves one 512-thread block per SM
// whose loads, reductions and stores take turns (about 0.7 TB/s on an H100); staged, three blocks share an SM and
// overlap. Only the statistics are written (the BF16 form's), so each exponential is taken once, as it is summed.
template <int PER_THREAD>
__global__ void __launch_bounds__(CE_THREADS, 3)
    crossentropy_forward_staged_bf16_kernel(float *losses, CeOut out, const uint16_t *logits, const int *targets,
                                            int V) {
    extern __shared__ __align__(16) uint16_t row_bf16[];
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const uint16_t *x = logits + row * V;
    const int chunks = V / 8;  // V % 8 == 0 and 16-byte aligned rows: the launch checks
    for (int i = threadIdx.x; i < chunks; i += CE_THREADS)
        reinterpret_cast<uint4 *>(row_bf16)[i] = reinterpret_cast<const uint4 *>(x)[i];
    __syncthreads();
    const int t = targets[row];
    const float x_target = (threadIdx.x == 0 && t >= 0 && t < V) ? bf16_bits_to_float(row_bf16[t]) : 0.0f;

    float max_x = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        const int j = threadIdx.x + i * CE_THREADS;
        if (j < V) max_x = fmaxf(max_x, bf16_bits_to_float(row_bf16[j]));
    }
    max_x = block_max(max_x, scratch);

    float sum_exp = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        const int j = threadIdx.x + i * CE_THREADS;
        if (j < V) sum_exp = __fadd_rn(sum_exp, expf(__fsub_rn(bf16_bits_to_float(row_bf16[j]), max_x)));
    }
    sum_exp = block_sum(sum_exp, scratch);

    if (threadIdx.x == 0) {
        losses[row] = row_loss(t, V, max_x, sum_exp, x_target);
        out.row_max[row] = max_x, out.row_sum[row] = sum_exp;
    }
}

template <class L>
static void crossentropy_forward_launch(float *losses, CeOut out, const L *logits, const int *targets, int N, int V) {
    if (N <= 0 || V <= 0) return;
    const int per_thread = (V + CE_THREADS - 1) / CE_THREADS;  // 64 at V = 32768; larger rows take three passes
    if (per_thread <= 8)
        crossentropy_forward_registers_kernel<8><<<N, CE_THREADS>>>(losses, out, logits, targets, V);
    else if (per_thread <= 32)
        crossentropy_forward_registers_kernel<32><<<N, CE_THREADS>>>(losses, out, logits, targets, V);
    else if (per_thread <= 64)
        crossentropy_forward_registers_kernel<64><<<N, CE_THREADS>>>(losses, out, logits, targets, V);
    else
        crossentropy_forward_kernel<<<N, CE_THREADS>>>(losses, out, logits, targets, V);
    CUDA_CHECK_LAUNCH("crossentropy_forward_kernel");
}

extern "C" void cuda_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N,
                                          int V) {
    crossentropy_forward_launch(losses, CeOut{probs, NULL, NULL}, logits, targets, N, V);
}

// Rows of at most 64 x CE_THREADS BF16 logits (64 KiB: three blocks per SM) go through the staged kernel.
extern "C" void cuda_crossentropy_forward_bf16(real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                                               const int *targets, int N, int V) {
    const CeOut out = {NULL, row_max, row_sum};
    const int per_thread = (V + CE_THREADS - 1) / CE_THREADS;
    if (N <= 0 || V <= 0 || per_thread > 64 || V % 8 != 0 || (uintptr_t)logits % 16 != 0) {
        crossentropy_forward_launch(losses, out, logits, targets, N, V);
        return;
    }
    const size_t smem = (size_t)V * sizeof(uint16_t);
    if (per_thread <= 8) {
        crossentropy_forward_staged_bf16_kernel<8><<<N, CE_THREADS, smem>>>(losses, out, logits, targets, V);
    } else if (per_thread <= 32) {
        crossentropy_forward_staged_bf16_kernel<32><<<N, CE_THREADS, smem>>>(losses, out, logits, targets, V);
    } else {
        static int smem_allowed = 0;  // 64 KiB is above the default 48 KiB limit
        if (!smem_allowed) {
            CUDA_CHECK(cudaFuncSetAttribute(crossentropy_forward_staged_bf16_kernel<64>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * CE_THREADS * 2));
            smem_allowed = 1;
        }
        crossentropy_forward_staged_bf16_kernel<64><<<N, CE_THREADS, smem>>>(losses, out, logits, targets, V);
    }
    CUDA_CHECK_LAUNCH("crossentropy_forward_staged_bf16_kernel");
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was loss = -log softmax(x)[target], so d loss / d x = probs - onehot(target).
// WRITES (does not accumulate) dlogits (N, V) = (probs - onehot(target)) * dloss; 0 for masked rows.
// One block per row so the row's target is read once. dlogits may alias probs (each element is read and
// written by the same thread).
__device__ inline float row_grad(float p, int j, int t, float dloss) {
    return __fmul_rn(__fsub_rn(p, j == t ? 1.0f : 0.0f), dloss);
}

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
    for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = row_grad(p[j], j, t, dloss);
}

extern "C" void cuda_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N,
                                           int V) {
    if (N <= 0 || V <= 0) return;
    crossentropy_backward_kernel<<<N, CE_THREADS>>>(dlogits, probs, targets, dloss, V);
    CUDA_CHECK_LAUNCH("crossentropy_backward_kernel");
}

// The BF16 form: each probability recomputed from the row's statistics (row_prob, the forward's bits), the gradient
// rounded to BF16 (RNE, as cuda_float_to_bf16 rounds bf16_matmul_backward's dout). dlogits may alias logits (every
// element is read before it is written, by the thread that writes it).
__device__ inline uint16_t bf16_grad(uint16_t x, int j, int t, float max_x, float sum_exp, float dloss) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(row_grad(row_prob(bf16_bits_to_float(x), max_x, sum_exp), j, t,
                                                             dloss)));
}

// VEC8: V % 8 == 0 and 16-byte aligned rows; each thread takes 8 consecutive logits per 16-byte access, two such
// chunks loaded before either is written (element by element, one 2-byte load in flight per thread left the memory
// at about 1.2 TB/s on an H100). The same function of each element either way.
template <bool VEC8>
__global__ void crossentropy_backward_bf16_kernel(uint16_t *dlogits, const uint16_t *logits, const float *row_max,
                                                  const double *row_sum, const int *targets, float dloss, int V) {
    const int64_t row = blockIdx.x;
    const uint16_t *x = logits + row * V;
    uint16_t *d = dlogits + row * V;
    const int t = targets[row];
    if constexpr (VEC8) {
        const uint4 *xv = reinterpret_cast<const uint4 *>(x);
        uint4 *dv = reinterpret_cast<uint4 *>(d);
        const int chunks = V / 8;
        if (t < 0) {
            for (int i = threadIdx.x; i < chunks; i += blockDim.x) dv[i] = make_uint4(0, 0, 0, 0);
            return;
        }
        const float max_x = row_max[row], sum_exp = (float)row_sum[row];
        for (int i0 = threadIdx.x; i0 < chunks; i0 += 2 * blockDim.x) {
            const int i1 = i0 + blockDim.x;
            uint4 c[2];
            c[0] = xv[i0];
            if (i1 < chunks) c[1] = xv[i1];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int i = h ? i1 : i0;
                if (i >= chunks) break;
                uint16_t e[8];
                memcpy(e, &c[h], sizeof e);
#pragma unroll
                for (int k = 0; k < 8; k++) e[k] = bf16_grad(e[k], 8 * i + k, t, max_x, sum_exp, dloss);
                memcpy(&c[h], e, sizeof e);
                dv[i] = c[h];
            }
        }
    } else {
        if (t < 0) {
            for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = 0;
            return;
        }
        const float max_x = row_max[row], sum_exp = (float)row_sum[row];
        for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = bf16_grad(x[j], j, t, max_x, sum_exp, dloss);
    }
}

extern "C" void cuda_crossentropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                                const double *row_sum, const int *targets, real dloss, int N, int V) {
    if (N <= 0 || V <= 0) return;
    const bool vec8 = V % 8 == 0 && (uintptr_t)logits % 16 == 0 && (uintptr_t)dlogits % 16 == 0;
    if (vec8)
        crossentropy_backward_bf16_kernel<true><<<N, CE_THREADS>>>(dlogits, logits, row_max, row_sum, targets, dloss, V);
    else
        crossentropy_backward_bf16_kernel<false><<<N, CE_THREADS>>>(dlogits, logits, row_max, row_sum, targets, dloss, V);
    CUDA_CHECK_LAUNCH("crossentropy_backward_bf16_kernel");
}

__global__ void crossentropy_probs_bf16_kernel(float *probs, const uint16_t *logits, const float *row_max,
                                               const double *row_sum, int V) {
    const int64_t row = blockIdx.x;
    const float max_x = row_max[row], sum_exp = (float)row_sum[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) probs[row * V + j] = row_prob(logit_at(logits + row * V, j), max_x, sum_exp);
}

extern "C" void cuda_crossentropy_probs_bf16(real *probs, const uint16_t *logits, const real *row_max,
                                             const double *row_sum, int N, int V) {
    if (N <= 0 || V <= 0) return;
    crossentropy_probs_bf16_kernel<<<N, CE_THREADS>>>(probs, logits, row_max, row_sum, V);
    CUDA_CHECK_LAUNCH("crossentropy_probs_bf16_kernel");
}
