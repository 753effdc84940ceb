/*
 * mpitest.h - the few helpers the MPI test programs share: a CHECK that counts failures per rank instead
 * of stopping (one rank stopping early would leave the others waiting in a collective), the per-rank
 * deterministic inputs, and the end-of-run summary that every rank agrees on.
 *
 * Plain C rather than CMocka: CMocka's output and its longjmp-based failures are per process, and a test
 * here is one collective run by every rank of a job.
 */
#ifndef FP8MOE_MPITEST_H
#define FP8MOE_MPITEST_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "parallel/comm.h"

static long mpitest_checks, mpitest_failures;

#define CHECK(cond, ...)                                                                              \
    do {                                                                                              \
        mpitest_checks++;                                                                             \
        if (!(cond)) {                                                                                \
            if (mpitest_failures++ < 20) {                                                            \
                fprintf(stderr, "rank %d: %s:%d: CHECK(%s) failed: ", comm_world()->rank, __FILE__,  \
                        __LINE__, #cond);                                                             \
                fprintf(stderr, __VA_ARGS__);                                                         \
                fputc('\n', stderr);                                                                  \
            }                                                                                         \
        }                                                                                             \
    } while (0)

// splitmix64: a counter-based generator, so any rank can compute any other rank's inputs.
static inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline uint64_t input_bits(uint64_t seed, int rank, int64_t i) {
    return mix64(mix64(seed * 1000003ULL + (uint64_t)rank) ^ (uint64_t)i);
}

// Mixed magnitudes (1e8, 1, 1e-3) of both signs: with three or more ranks the order of the sum changes
// the rounded result in a good fraction of the elements.
static inline double input_double(uint64_t seed, int rank, int64_t i) {
    const uint64_t b = input_bits(seed, rank, i);
    static const double mag[3] = {1e8, 1.0, 1e-3};
    const double u = (double)(b >> 11) * 0x1.0p-53;  // [0, 1)
    return mag[(b & 0xff) % 3] * (2 * u - 1);
}

// Sums the failures over the world; rank 0 prints one line. Returns the process exit status.
static inline int mpitest_finish(const char *name) {
    int64_t counts[2] = {mpitest_checks, mpitest_failures};
    comm_allreduce_sum_i64(comm_world(), counts, 2);
    if (comm_world()->rank == 0)
        printf("%s: %d rank(s): %" PRId64 " checks, %" PRId64 " failed: %s\n", name, comm_world()->size, counts[0],
               counts[1], counts[1] == 0 ? "passed" : "FAILED");
    fflush(stdout);
    return counts[1] == 0 ? 0 : 1;
}

#endif
