/*
 * comm_nccl.h - internal: what parallel/comm.c asks of the NCCL backend (parallel/comm_nccl.c). Everything
 * outside parallel/comm*.c uses parallel/comm.h (comm_nccl_dup and the others are declared there).
 *
 * comm.c checks every argument, takes the size-1 shortcut where comm_nccl_takes says no, and picks the path by
 * the buffers' device; these functions then move a COMM_NCCL group's device buffers through NCCL under
 * comm.h's contract (rank-order sums, the timeout, every error named) and return when the call is complete.
 * Counts and displacements are host arrays of size entries, as comm.c checked them. In a build without NCCL
 * no COMM_NCCL group can be made, comm_nccl_takes is 0 and the rest stop the job with a message if reached.
 */
#ifndef FP8MOE_COMM_NCCL_H
#define FP8MOE_COMM_NCCL_H

#include "parallel/comm.h"

// What comm.c gives the backend: its error line, "fp8moe: rank R: OP on group NAME (size S, rank r there): WHAT
// (file:line)", and its end of the job (MPI_Abort with code under MPI, else exit).
_Noreturn void __attribute__((format(printf, 5, 6)))
comm_fail_at(const Comm *c, const char *op, const char *file, int line, const char *fmt, ...);
_Noreturn void comm_end_job(int code);

// 1 when c is a COMM_NCCL group whose device buffers go through NCCL: size > 1, or any size with an NCCL
// communicator under comm_nccl_force_for_tests.
int comm_nccl_takes(const Comm *c);
// Builds c->nccl for a COMM_NCCL group whose MPI part comm.c has made (comm_split, comm_nccl_dup). Collective.
void comm_nccl_attach(Comm *c, const char *op);
// Frees c->nccl (NULL allowed). Collective, as comm_free is.
void comm_nccl_detach(Comm *c);
// comm_set_limits_for_tests' round: the reductions' slot buffer (0: the default, 64 MiB).
void comm_nccl_set_round_bytes(size_t bytes);

// type: 0 double, 1 float, 2 int64; red: 0 sum, 1 max, 2 min (comm.c's RedType and RedOp, kernels/cuda/comm_reduce.h).
void comm_nccl_allreduce(Comm *c, const char *op, int type, int red, void *x, int64_t n);
// recv (counts[rank]) = the rank-order sum of block `rank` of every rank's send; recv may be send + d[rank].
void comm_nccl_reduce_scatter(Comm *c, const char *op, const real *send, real *recv, const int64_t *counts,
                              const int64_t *d);
// recv's block r (counts[r] elements of es bytes at d[r]) = rank r's send; send may be recv + d[rank] * es.
void comm_nccl_allgather(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                         const int64_t *d);
void comm_nccl_alltoallv(Comm *c, const char *op, const void *send, const int64_t *send_bytes, const int64_t *sd,
                         void *recv, const int64_t *recv_bytes, const int64_t *rd);
void comm_nccl_bcast(Comm *c, const char *op, void *buf, size_t bytes, int root);
// Queues a message and fills req (nccl_ticket != 0); comm_nccl_wait launches the queue and completes req.
void comm_nccl_post(Comm *c, const char *op, void *buf, size_t bytes, int peer, int tag, CommRequest *req,
                    int is_send);
void comm_nccl_wait(CommRequest *req);

#endif
