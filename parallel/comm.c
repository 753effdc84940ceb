/*
 * comm.c - the single-process communication backend behind parallel/comm.h.
 *
 * With size 1 every collective is the identity, so these functions only check their arguments and
 * return. Groups of size > 1 need the MPI or NCCL backend (a later issue); asking for one here stops
 * with a message instead of silently returning local (wrong) sums.
 */
#include "parallel/comm.h"

#include <stdio.h>
#include <stdlib.h>

static Comm world_single = {.rank = 0, .size = 1, .kind = COMM_SINGLE};

Comm *comm_world_single(void) { return &world_single; }

const char *comm_kind_name(CommKind kind) {
    switch (kind) {
    case COMM_SINGLE: return "single";
    case COMM_MPI: return "mpi";
    case COMM_NCCL: return "nccl";
    }
    return "unknown";
}

// Returns when the collective is the identity (size 1); stops the process when it would need a
// backend this build does not have.
static void comm_require_single(const Comm *comm, const char *fn, int64_t n, int line) {
    if (comm == NULL || n < 0) {
        fprintf(stderr, "fp8moe: %s:%d: %s: comm = %p, n = %lld; expected a communicator and n >= 0\n",
                __FILE__, line, fn, (const void *)comm, (long long)n);
        exit(1);
    }
    if (comm->size == 1) return;
    fprintf(stderr, "fp8moe: %s:%d: %s: group of %d ranks (kind %s) but this build has only the "
                    "single-process backend; expected size 1 (the MPI/NCCL backends come in a later "
                    "issue)\n", __FILE__, line, fn, comm->size, comm_kind_name(comm->kind));
    exit(1);
}

void comm_allreduce_sum_double(Comm *comm, double *x, int n) {
    (void)x;
    comm_require_single(comm, "comm_allreduce_sum_double", n, __LINE__);
}

void comm_allreduce_sum_i64(Comm *comm, int64_t *x, int n) {
    (void)x;
    comm_require_single(comm, "comm_allreduce_sum_i64", n, __LINE__);
}

void comm_allreduce_sum_real(Comm *comm, real *x, int64_t n) {
    (void)x;
    comm_require_single(comm, "comm_allreduce_sum_real", n, __LINE__);
}

void comm_barrier(Comm *comm) {
    comm_require_single(comm, "comm_barrier", 0, __LINE__);
}
