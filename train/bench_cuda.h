/*
 * bench_cuda.h - what the GPU benchmarks (train/bench_gemm.c, train/bench_attention.c) share: a check of
 * every CUDA runtime call that stops with file:line, the call and CUDA's reason. Include only in code
 * compiled with FP8MOE_CUDA.
 */
#ifndef FP8MOE_BENCH_CUDA_H
#define FP8MOE_BENCH_CUDA_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define BENCH_CHECK(call)                                                                                   \
    do {                                                                                                    \
        cudaError_t e_ = (call);                                                                            \
        if (e_ != cudaSuccess) {                                                                            \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));   \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

#endif
