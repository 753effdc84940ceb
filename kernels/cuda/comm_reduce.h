/*
 * comm_reduce.h - the device half of the NCCL backend's rank-order reductions (parallel/comm_nccl.c): P slots
 * that NCCL filled with every rank's copy of a block are combined on the GPU, left to right, into the result.
 *
 * Plain C: comm_nccl.c (gcc) and comm_reduce.cu (nvcc) include it. Only a CUDA build has the function.
 */
#ifndef FP8MOE_CUDA_COMM_REDUCE_H
#define FP8MOE_CUDA_COMM_REDUCE_H

#include <stdint.h>

// Element types and operations; the values are parallel/comm.c's RedType and RedOp (comm.c asserts it).
enum { COMM_COMBINE_DOUBLE = 0, COMM_COMBINE_FLOAT = 1, COMM_COMBINE_I64 = 2 };
enum { COMM_COMBINE_SUM = 0, COMM_COMBINE_MAX = 1, COMM_COMBINE_MIN = 2 };

#ifdef __cplusplus
extern "C" {
#endif
// out (n) = slot 0 (op) slot 1 (op) ... (op) slot P-1, element by element and left to right: out starts as
// slot 0 and takes each later slot in turn, the order of parallel/comm.c's combine_slots, so every element
// gets the bits of ((x_0 + x_1) + x_2) + ... as the host computes them. slots: P blocks `stride` elements
// apart (stride >= n), device memory; out: n elements, device memory, not overlapping the slots. Sums of
// doubles and floats round once per addition (__dadd_rn / __fadd_rn: never fused) and give a NaN operand as
// the host's SSE addition does (the first NaN of the two, quieted); int64 sums wrap modulo 2^64; max / min are
// only for doubles and return the first NaN in rank order, as it is, when there is one (comm.c's max_nan /
// min_nan). Asynchronous on `stream` (a cudaStream_t). Returns the launch's cudaError_t (0:
// launched), for the caller to report with its group and rank.
int cuda_comm_combine_slots(int type, int op, void *out, const void *slots, int P, int64_t stride, int64_t n,
                            void *stream);
#ifdef __cplusplus
}
#endif

#endif
