/*
 * comm_reduce.cu - rank-order combination of P slots on the GPU for the NCCL backend (kernels/cuda/comm_reduce.h).
 *
 * Why not ncclAllReduce / ncclReduceScatter with ncclSum: NCCL's order of addition depends on its algorithm
 * (ring, tree, NVLS), the channel count and the message size, so its sums are neither the MPI backend's bits
 * nor one process's. Here NCCL only moves bytes (every rank's copy of a block into one slot each, on the
 * block's owner), and this kernel adds the slots in rank order, exactly as parallel/comm.c's combine_slots
 * does on the host. Memory-bound: P reads and one write per element, coalesced across a warp for each slot.
 */
#include "kernels/cuda/comm_reduce.h"

#include <cuda_runtime.h>

// ---------------------------------------------------------------------------- the operations, as comm.c has them

// Sums: the host's SSE addition y = y + x returns, when an operand is a NaN, the first NaN operand, quieted. The GPU's
// add does not make that choice when both are NaNs (seen on an H200: NaN + NaN of two payloads gave other bits than
// the host in the double sums of tests/gpu/test_gpu_nccl.c), so NaNs take the host's rule explicitly, and every
// result has the host's bits.
struct SumF {
    __device__ float operator()(float a, float b) const {
        if (isnan(a) || isnan(b)) return __uint_as_float(__float_as_uint(isnan(a) ? a : b) | 0x00400000u);
        return __fadd_rn(a, b);
    }
};
struct SumD {
    __device__ double operator()(double a, double b) const {
        if (isnan(a) || isnan(b))
            return __longlong_as_double(__double_as_longlong(isnan(a) ? a : b) | 0x0008000000000000LL);
        return __dadd_rn(a, b);
    }
};
struct SumU64 {  // int64 sums in uint64: wrap modulo 2^64 like the host's
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a + b; }
};
// comm.c: max_nan(a, b) = isnan(a) ? a : isnan(b) ? b : (b > a ? b : a), a the running value: the first NaN wins
struct MaxD {
    __device__ double operator()(double a, double b) const { return isnan(a) ? a : isnan(b) ? b : (b > a ? b : a); }
};
struct MinD {
    __device__ double operator()(double a, double b) const { return isnan(a) ? a : isnan(b) ? b : (b < a ? b : a); }
};

// ---------------------------------------------------------------------------- kernel

// One thread per element (grid-stride): y = slot 0, then y = op(y, slot r) for r = 1 .. P-1.
template <typename T, typename Op>
__global__ void combine_slots_kernel(T *out, const T *slots, int P, int64_t stride, int64_t n, Op op) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        T y = slots[i];
        for (int r = 1; r < P; r++) y = op(y, slots[(int64_t)r * stride + i]);
        out[i] = y;
    }
}

template <typename T, typename Op>
static cudaError_t launch(void *out, const void *slots, int P, int64_t stride, int64_t n, cudaStream_t s, Op op) {
    const int threads = 256;
    const int64_t want = (n + threads - 1) / threads;
    const int blocks = (int)(want < 8192 ? want : 8192);  // 132 SMs x 2048 threads / 256 = 1056 resident; the rest stride
    combine_slots_kernel<T, Op><<<blocks, threads, 0, s>>>((T *)out, (const T *)slots, P, stride, n, op);
    return cudaGetLastError();
}

extern "C" int cuda_comm_combine_slots(int type, int op, void *out, const void *slots, int P, int64_t stride, int64_t n,
                                       void *stream) {
    if (n <= 0) return (int)cudaSuccess;
    if (P < 1 || stride < n) return (int)cudaErrorInvalidValue;
    cudaStream_t s = (cudaStream_t)stream;
    switch (type) {
    case COMM_COMBINE_FLOAT:
        if (op != COMM_COMBINE_SUM) break;  // only sums are asked of floats (comm.h)
        return (int)launch<float>(out, slots, P, stride, n, s, SumF());
    case COMM_COMBINE_I64:
        if (op != COMM_COMBINE_SUM) break;
        return (int)launch<unsigned long long>(out, slots, P, stride, n, s, SumU64());
    case COMM_COMBINE_DOUBLE:
        if (op == COMM_COMBINE_SUM) return (int)launch<double>(out, slots, P, stride, n, s, SumD());
        if (op == COMM_COMBINE_MAX) return (int)launch<double>(out, slots, P, stride, n, s, MaxD());
        if (op == COMM_COMBINE_MIN) return (int)launch<double>(out, slots, P, stride, n, s, MinD());
        break;
    }
    return (int)cudaErrorInvalidValue;
}
