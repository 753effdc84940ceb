/*
 * bench.h - benchmark subcommands of the fp8moe CLI (`fp8moe bench ...`). Each takes the arguments
 * after its own name and returns the process exit status (0 ok, 1 failure, 2 bad usage).
 */
#ifndef FP8MOE_BENCH_H
#define FP8MOE_BENCH_H

#include <stdio.h>

// What a GPU-only benchmark (`fp8moe bench NAME`, implemented in FILE) does in a build without CUDA: says
// so and returns the failure status.
static inline int bench_without_cuda(const char *name, const char *file) {
    fprintf(stderr, "fp8moe bench %s: this build has no CUDA (%s) - expected a build with CUDA >= 12.9 (see "
                    "docs/gpu.md)\n", name, file);
    return 1;
}

// `fp8moe bench gemm [JOB.ini] [--runs N] [--warmup N]`: FP8 (block-scaled cuBLASLt) and BF16 GEMM
// throughput on the GPU at fixed shapes and at the Linear shapes of JOB.ini (default
// configs/bench-1gpu.ini), GEMM alone, with quantisation, and through kernels.h; plus quantiser
// bandwidth against a device-to-device copy. train/bench_gemm.c.
int bench_gemm_main(int argc, char **argv);
extern const char *const bench_gemm_usage;

// `fp8moe bench step [JOB.ini] [--steps N] [--warmup N] [--set section.key=value]...`: training steps
// of JOB.ini (default configs/bench-1gpu.ini) in fp8 and then bf16: tokens/s, model TFLOPS, peak
// memory and a per-phase time breakdown (kernels/profile.h). train/bench_step.c.
int bench_step_main(int argc, char **argv);
extern const char *const bench_step_usage;

// `fp8moe bench attention [--B N] [--T N] [--H N] [--dn N] [--dr N] [--dv N] [--runs N]`: the CUDA causal
// attention core alone (kernels.h attention_forward / attention_backward, keys and values in MLA's layout): median
// ms and TFLOPS of the forward and the backward, default shape that of configs/bench-1gpu.ini.
// train/bench_attention.c.
int bench_attention_main(int argc, char **argv);
extern const char *const bench_attention_usage;

// `fp8moe bench a2a [JOB.ini] [--tokens N] [--runs N] [--warmup N] [--skew S] [--seed N] [--set ...]`: the
// expert-parallel dispatch + combine of parallel/ep.h over the job's ranks (one process, or mpirun -np P)
// at JOB.ini's token shapes (default configs/bench-1gpu.ini), routing drawn at random (uniform and
// skewed), beside the backend's raw all-to-all-v of the same byte counts in the same run: bytes per rank,
// ms, GB/s, ratio to raw. Starts MPI itself under a launcher. train/bench_a2a.c.
int bench_a2a_main(int argc, char **argv);
extern const char *const bench_a2a_usage;

#endif
