/*
 * comm.h - the communication interface of fp8moe: a communicator (one process group) and the
 * collectives the trainer needs (all-reduce of gradients, losses, norms and expert load counts,
 * barrier).
 *
 * The model, optimizer and trainer talk to other ranks only through these functions, never through
 * MPI or NCCL directly (DESIGN.md section 2 and 5), exactly as they reach devices only through
 * kernels/kernels.h. Today there is one backend: the single process (COMM_SINGLE, size 1), where
 * every collective is the identity and does nothing. The MPI backend (CPU ranks, bootstrap and control
 * plane) and the NCCL backend (GPU ranks; its id is broadcast over MPI) plug in later behind the same
 * functions: a Comm then also carries the MPI_Comm / ncclComm_t handles, the functions switch on
 * `kind`, and no caller changes.
 *
 * Conventions: buffers are reduced in place; n is an element count; every rank of the group must
 * call a collective with the same n in the same order. Sums are deterministic: a backend must reduce
 * in a fixed rank order (no floating-point atomics), so the same job gives bitwise-identical results.
 * A collective asked of a group of size > 1 in a build without its backend stops the process with a
 * message naming the function, this file and line.
 */
#ifndef FP8MOE_COMM_H
#define FP8MOE_COMM_H

#include <stdint.h>

#include "kernels/kernels.h"

typedef enum {
    COMM_SINGLE = 0,  // one process, size 1: every collective is the identity
    COMM_MPI = 1,     // later issue: MPI communicator (CPU ranks)
    COMM_NCCL = 2,    // later issue: NCCL communicator (GPU ranks, device buffers)
} CommKind;

typedef struct {
    int rank;       // this process' rank in the group, 0 .. size-1
    int size;       // number of ranks in the group
    CommKind kind;  // which backend carries the data
} Comm;

// The world of a single process (rank 0, size 1, COMM_SINGLE). A process-wide object, like
// MPI_COMM_WORLD: never freed, and every call returns the same pointer. Its fields must not be changed.
Comm *comm_world_single(void);
const char *comm_kind_name(CommKind kind);

// x (n) = sum over the ranks of the group of x (n), in place. double: losses, norms; int64: expert
// load counts; real: flat gradient buffers (int64 count: a stage's buffer can pass 2^31 elements).
void comm_allreduce_sum_double(Comm *comm, double *x, int n);
void comm_allreduce_sum_i64(Comm *comm, int64_t *x, int n);
void comm_allreduce_sum_real(Comm *comm, real *x, int64_t n);
// Returns when every rank of the group has entered it.
void comm_barrier(Comm *comm);

#endif
