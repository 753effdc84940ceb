/*
 * comm.h - the communication interface of fp8moe: a communicator (one process group, with a short
 * name such as "dp") and the collectives and point-to-point messages the trainer needs.
 *
 * The model, optimizer and trainer talk to other ranks only through these functions, never through
 * MPI or NCCL directly (DESIGN.md section 2 and 5), exactly as they reach devices only through
 * kernels/kernels.h. Backends:
 *   COMM_SINGLE  one process, size 1, no MPI at all: every collective is the identity (what the unit
 *                tests and a binary that never called comm_init use).
 *   COMM_MPI     an MPI communicator (CPU ranks; GPU ranks sharing a GPU, device buffers staged through
 *                pinned host memory; also the bootstrap and control plane of GPU jobs).
 *                Without mpirun, comm_init starts MPI as a singleton and the world has size 1.
 *   COMM_NCCL    GPU ranks, one GPU each (parallel/comm_nccl.c, built when the build finds NCCL): an MPI
 *                group as above, whose host buffers, counts and checks travel over MPI exactly as in
 *                COMM_MPI, plus an NCCL communicator over the same ranks in the same order (its unique id
 *                broadcast over MPI) with a CUDA stream of its own, which carries the device buffers.
 *                comm_nccl_dup makes one from an MPI group; comm_split of a COMM_NCCL group gives COMM_NCCL
 *                groups. See "NCCL" below.
 * At size 1 every call returns after checking its arguments (and, where there is an output buffer
 * distinct from the input, one copy), whatever the backend: the single-process path costs what it
 * did before MPI existed (COMM_NCCL too, unless a test asks otherwise: comm_nccl_force_for_tests).
 *
 * Conventions:
 * - Buffers are host or device memory, and every call takes either. Which one a buffer is, the pointer
 *   itself says (device_of_pointer, kernels/kernels.h: cudaPointerGetAttributes in a CUDA build once the
 *   process has allocated device memory; never asked on a CPU run). COMM_MPI stages a device buffer
 *   through a pinned host buffer that the Comm owns (device_host_alloc): copy to the host, the MPI
 *   messages, copy back, so that several MPI ranks can share one GPU (DESIGN.md section 5; the test
 *   path of multi-rank GPU code on one GPU; COMM_NCCL is the fast path, one GPU per rank). The results
 *   are the bits the host path gives. Why the pointer and not a Device argument or a device flag on the
 *   Comm: one group carries both kinds of memory (the dp group sums the step's host loss terms and the
 *   device gradients, the EP group exchanges host row counts and device rows), so a flag on the Comm
 *   would be wrong for half its calls; an argument would change every caller (train/step.c's
 *   comm_allreduce_sum_real(ts->dp, m->grads, n) works as written on both devices) and could disagree
 *   with the pointer, a memory error instead of a message; the pointer's attributes cannot. Its cost is
 *   one cudaPointerGetAttributes (about a microsecond) per buffer per call, at size > 1 only.
 *   Rules: the count arrays (counts, send_bytes, recv_bytes, send_counts, recv_counts) are host arrays;
 *   the non-empty buffers of one call are on the same device; every rank of a group passes the same kind
 *   of memory to a call (staged reductions travel in rounds of their own, so a host rank and a device
 *   rank would disagree on message sizes, and the job ends naming them). Staged reductions and gathers
 *   run in rounds, so their pinned buffer stays near the reduction round size (64 MiB) whatever the
 *   count; all-to-all-v, broadcast and send/recv stage their whole buffer (a nonblocking one in a pinned
 *   buffer of its own, allocated per request and freed by comm_wait: slow, for pipeline tests only).
 *   At size 1 nothing is staged; an out-of-place call's one copy is a device copy for device buffers.
 * - Counts are element counts unless the name says _bytes. Every rank of a group must make the same
 *   collective calls in the same order with matching counts; mismatched sizes are detected where the
 *   receiver can see them (a message longer or shorter than expected) and end the job.
 * - Sums are deterministic and in RANK ORDER: result[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... for ranks
 *   0, 1, 2, ... of the group, computed once by the rank that owns element i and sent to everyone, so
 *   every rank holds identical bits, and the same bits as one process adding the same values in that
 *   order (e.g. gradient accumulation over the micro-batches of ranks 0, 1, ...). MPI_SUM is never
 *   used: its order is the library's choice. Max/min also propagate NaN (any rank's NaN wins).
 * - Every blocking call (and comm_wait) honours the process-wide timeout (comm_set_timeout, default
 *   COMM_DEFAULT_TIMEOUT_S, the config key parallel.timeout_s). A call that does not complete in time
 *   prints `fp8moe: rank R: <op> on group <name> (size S) timed out after T s - nothing yet from world
 *   rank(s) Q` (R is the world rank; a pending send names its receiver instead: "world rank(s) Q have not
 *   taken this rank's messages"; every blocking call but comm_bcast_bytes is built on point-to-point
 *   messages, so it knows its peers) and ends the whole job with MPI_Abort(COMM_EXIT_TIMEOUT). Waiting ranks poll with a ~50 us sleep,
 *   so ranks oversubscribing the cores yield them to the rank that has work.
 * - Any MPI error (every communicator has MPI_ERRORS_RETURN, every return code is checked) and any
 *   invalid argument print one line naming the function, the group, the rank and the MPI error
 *   string, and end the job with MPI_Abort(COMM_EXIT_ERROR). A COMM_SINGLE communicator of size > 1
 *   cannot exist; a call on one stops with the file and line.
 *
 * NCCL (COMM_NCCL; the implementation's opening comment says why each choice was made):
 * - Device buffers go through NCCL, host buffers through the MPI code above, call by call (the pointer
 *   decides, as for staging). A call whose buffers are all empty on this rank counts as a device call on a
 *   COMM_NCCL group (an expert rank that receives no rows must still take part in NCCL's exchange), so host
 *   data that may be empty on some ranks belongs on a COMM_MPI group.
 * - The same results as COMM_MPI, bit for bit: sums are the rank-order sums above, computed on the GPU from
 *   every rank's copy of a block, which NCCL only moves (ncclSend / ncclRecv; never ncclAllReduce or
 *   ncclReduceScatter with ncclSum, whose order is NCCL's); gathers, all-to-all-v and broadcast are copies.
 * - Every device call is first checked over MPI: the ranks compare the operation, its number among the
 *   group's device calls and its counts (all-to-all-v: what each peer sends against recv_bytes), so ranks
 *   that make different calls or pass different counts end the job with one line naming both ranks and
 *   the values, instead of hanging NCCL. The timeout holds for the check and for NCCL (the communicator is
 *   non-blocking and every wait polls); a timed-out call prints the timeout line above, aborts the NCCL
 *   communicator (ncclCommAbort) and ends the job. NCCL and CUDA errors are reported like MPI errors, with
 *   the call and NCCL's last error string.
 * - Calls are synchronous, as over MPI: a call returns when its result is in the buffer. Its NCCL work runs on
 *   the group's stream after the work queued before the call on the legacy default stream (fp8moe's kernels).
 * - Point to point: NCCL has no tags and a send blocks its stream until the peer receives, so
 *   comm_isend_bytes / comm_irecv_bytes queue the message; the group's next comm_wait, blocking send or
 *   receive, or device collective launches every queued message of this rank in one NCCL group (a ring of
 *   isend + recv, or irecv + isend + waits, completes). Messages of device buffers between a pair are matched
 *   in the order they are posted, whatever their tags: post them in the same order on both ranks. Each one
 *   carries a header over MPI with its size and its number, checked by the receiver before NCCL moves
 *   anything: a size mismatch (`the message from rank 0 (world rank 0, tag 3) has 100 bytes, expected 200`)
 *   or an order mismatch ends the job.
 * - One GPU per rank: NCCL cannot put two ranks of a communicator on one GPU, so comm_nccl_dup refuses that
 *   ("parallel.backend = nccl needs one GPU per rank; use backend = mpi to share a GPU"); comm_nccl_select_gpu
 *   gives each rank of a host its own GPU first. comm_nccl_dup sets NCCL_NVLS_ENABLE=0 in the process'
 *   environment unless it is already set (NVLink multicast can take a shared host's GPUs out of service).
 */
#ifndef FP8MOE_COMM_H
#define FP8MOE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include <mpi.h>

#include "kernels/kernels.h"

typedef enum {
    COMM_SINGLE = 0,  // one process, size 1, no MPI: every collective is the identity
    COMM_MPI = 1,     // MPI communicator (CPU ranks, and GPU ranks that share a GPU: device buffers staged)
    COMM_NCCL = 2,    // MPI communicator + NCCL communicator (GPU ranks, one GPU each: device buffers through NCCL)
} CommKind;

#define COMM_NAME_MAX 16             // group names are short: "world", "dp", "ep", "edp", "pp", "node"
#define COMM_DEFAULT_TIMEOUT_S 300.0 // the default of parallel.timeout_s
#define COMM_EXIT_ERROR 3            // MPI_Abort code after an MPI error or a bad argument
#define COMM_EXIT_TIMEOUT 4          // MPI_Abort code after a timeout
#define COMM_TAG_MAX 32767           // user tags of send/recv are 0 .. COMM_TAG_MAX (MPI guarantees this many)
#define COMM_UNDEFINED (-1)          // comm_split color: this rank joins no group (the call returns NULL)

typedef struct {
    int rank;                 // this process' rank in the group, 0 .. size-1
    int size;                 // number of ranks in the group
    CommKind kind;            // which backend carries the data
    char name[COMM_NAME_MAX]; // for messages: "world", "dp", ...
    int world_rank;           // this process' rank in the world, for messages
    // COMM_MPI only
    MPI_Comm mpi;             // point-to-point messages of the caller, broadcast, barrier
    MPI_Comm coll;            // a duplicate of mpi that carries the messages collectives build on, so that
                              // they never match a caller's send/recv
    void *scratch;            // reduction buffer, grown on demand, owned by the Comm
    size_t scratch_bytes;
    void *pinned;             // device staging: pinned host buffer (device_host_alloc), grown on demand, owned
    size_t pinned_bytes;
    // COMM_NCCL only: the NCCL communicator, its stream, the reductions' device slots, the queue of posted
    // messages (parallel/comm_nccl.c; NULL for a group of size 1, which never uses NCCL outside tests)
    struct CommNccl *nccl;
} Comm;

// A pending isend/irecv. Fill it with comm_isend_bytes / comm_irecv_bytes, complete it with comm_wait
// (exactly once); the buffer must stay untouched until then. Messages of more than 1 GiB travel in pieces.
typedef struct {
    Comm *comm;
    const char *op;          // "comm_isend_bytes" / "comm_irecv_bytes", for messages
    int peer, tag;
    size_t bytes;
    int is_send;
    int n;                   // pieces in flight (0 = nothing pending: after comm_wait)
    MPI_Request *reqs;       // n requests: inline_reqs, or allocated for more pieces
    MPI_Request inline_reqs[2];
    // a device buffer: the requests move `staged` (pinned host memory), which a receive copies to device_dst
    // in comm_wait; owns_staged: staged was allocated for this request (comm_isend/irecv) and comm_wait frees it
    void *staged;
    void *device_dst;
    int owns_staged;
    // a device message of a COMM_NCCL group: its place in the group's queue (0: not one), parallel/comm_nccl.c
    uint64_t nccl_ticket;
} CommRequest;

// ---------------------------------------------------------------------------- process set-up

// Whether an MPI launcher started this process: Open MPI's mpirun, a PMIx or PMI launcher (MPICH's Hydra,
// Slurm's srun with --mpi) all leave their rank in the environment. The commands start MPI only then: without
// a launcher the process is the whole job (a singleton MPI start costs time and fails under some resource
// limits, e.g. ulimit -f, for nothing one process needs).
int comm_launched_by_mpi(void);
// Starts MPI (MPI_Init_thread, MPI_THREAD_FUNNELED: only the thread that called comm_init calls comm_*;
// OpenMP threads never do) and builds the world communicator. Without mpirun, Open MPI starts as a
// singleton: a world of one rank. Calling it twice is an error. After comm_init, comm_world() is the MPI
// world (size 1 included).
void comm_init(int *argc, char ***argv);
// Frees the world communicator and calls MPI_Finalize. Every Comm from comm_split must be freed first.
// Does nothing when comm_init was not called.
void comm_finalize(void);
// 1 between comm_init and comm_finalize.
int comm_is_initialized(void);
// The world: after comm_init, MPI_COMM_WORLD (name "world"); before, the single-process world
// (comm_world_single). A process-wide object: never freed by the caller; its fields must not be changed.
Comm *comm_world(void);
// The world of a single process (rank 0, size 1, COMM_SINGLE), usable without MPI.
Comm *comm_world_single(void);
const char *comm_kind_name(CommKind kind);
// The timeout of every blocking call, in seconds (> 0; default COMM_DEFAULT_TIMEOUT_S). Process-wide;
// set the same value on every rank.
void comm_set_timeout(double seconds);
double comm_timeout(void);

// A new group of the ranks of `parent` that pass the same color (>= 0), ordered by (key, parent rank),
// named `name` (at most COMM_NAME_MAX-1 characters). Collective over parent. Returns NULL on the ranks that
// pass COMM_UNDEFINED. The result has the kind of the parent (a COMM_SINGLE parent gives a COMM_SINGLE
// group of size 1). Free it with comm_free.
Comm *comm_split(Comm *parent, int color, int key, const char *name);
// The ranks of `parent` that share this host's memory (MPI_Comm_split_type MPI_COMM_TYPE_SHARED), ordered
// by parent rank, named `name`. Collective over parent. A COMM_SINGLE parent gives a group of size 1.
Comm *comm_split_host(Comm *parent, const char *name);
// Frees a group from comm_split / comm_split_host (NULL is allowed). Not collective for COMM_SINGLE; MPI_Comm_free otherwise.
// The world cannot be freed.
void comm_free(Comm *comm);

// ---------------------------------------------------------------------------- reductions

// x (n) = sum over the ranks of the group of x (n), in place, in rank order (see the conventions above).
// double: losses, norms; int64: expert load counts (wraps modulo 2^64 on overflow); real: flat gradient
// buffers. All take int64 counts: a stage's buffer can pass 2^31 elements.
void comm_allreduce_sum_double(Comm *comm, double *x, int64_t n);
void comm_allreduce_sum_i64(Comm *comm, int64_t *x, int64_t n);
void comm_allreduce_sum_real(Comm *comm, real *x, int64_t n);
// x (n) = element-wise max / min over the ranks, in place; a NaN on any rank gives NaN.
void comm_allreduce_max_double(Comm *comm, double *x, int64_t n);
void comm_allreduce_min_double(Comm *comm, double *x, int64_t n);

// send (sum of counts) holds one block per rank, block r = counts[r] elements at offset
// displacements[r] = counts[0] + ... + counts[r-1]; recv (counts[rank]) = the rank-order sum over the ranks
// of their block `rank`. counts (size entries) must be the same on every rank. recv may be
// send + displacements[rank] (in place); otherwise the two must not overlap.
void comm_reduce_scatter_sum_real(Comm *comm, const real *send, real *recv, const int64_t *counts);
// The same with every block `block` elements: send (size * block), recv (block).
void comm_reduce_scatter_block_sum_real(Comm *comm, const real *send, real *recv, int64_t block);
// recv (sum of counts): block r (counts[r] elements at displacements[r]) = rank r's send (counts[r]).
// send may be recv + displacements[rank] (in place, as ZeRO-1's weight all-gather uses it).
void comm_allgather_real(Comm *comm, const real *send, real *recv, const int64_t *counts);
void comm_allgather_block_real(Comm *comm, const real *send, real *recv, int64_t block);
// recv (size * bytes): block r = rank r's send (bytes). For small control data (host names, banners).
void comm_allgather_bytes(Comm *comm, const void *send, void *recv, size_t bytes);

// Tests only: the largest single MPI message (default 1 GiB) and a reduction round's receive buffer over all
// ranks (default 64 MiB; also the NCCL reductions' device slots). Small values exercise, with small buffers,
// the paths that large counts take (messages in pieces, reductions in rounds). 0 restores a default. Set the
// same values on every rank.
void comm_set_limits_for_tests(size_t piece_bytes, size_t round_bytes);

// ---------------------------------------------------------------------------- all-to-all

// displacements[r] = counts[0] + ... + counts[r-1] for r < n; returns the total. (No communication.)
int64_t comm_displacements(const int64_t *counts, int n, int64_t *displacements);
// recv_counts[r] = what rank r passed as send_counts[this rank]: the counts step before an all-to-all-v,
// which tells every rank how much it will receive from each. send_counts, recv_counts: size entries.
void comm_alltoall_counts(Comm *comm, const int64_t *send_counts, int64_t *recv_counts);
// Rank r's block for rank q (send_bytes[q] bytes at the packed displacement of send_bytes) lands in q's
// recv at the packed displacement of q's recv_bytes for r. recv_bytes must be what comm_alltoall_counts
// returns for send_bytes (a mismatch ends the job). Zero counts are allowed. send and recv must not overlap.
void comm_alltoallv_bytes(Comm *comm, const void *send, const int64_t *send_bytes, void *recv,
                          const int64_t *recv_bytes);

// ---------------------------------------------------------------------------- point to point, broadcast

// Messages between a pair with the same tag arrive in the order they were sent (MPI's non-overtaking
// rule), and a receive must name exactly the size that was sent (else the job ends with both sizes
// named). Blocking calls return when the buffer may be reused.
void comm_send_bytes(Comm *comm, const void *buf, size_t bytes, int dest, int tag);
void comm_recv_bytes(Comm *comm, void *buf, size_t bytes, int src, int tag);
void comm_isend_bytes(Comm *comm, const void *buf, size_t bytes, int dest, int tag, CommRequest *req);
void comm_irecv_bytes(Comm *comm, void *buf, size_t bytes, int src, int tag, CommRequest *req);
// Completes req (honouring the timeout) and clears it; a cleared request returns at once.
void comm_wait(CommRequest *req);
// buf (bytes) on every rank = root's buf.
void comm_bcast_bytes(Comm *comm, void *buf, size_t bytes, int root);
// Returns when every rank of the group has entered it.
void comm_barrier(Comm *comm);

// ---------------------------------------------------------------------------- NCCL (GPU ranks, one GPU each)

// 1 when this build has the NCCL backend (a CUDA build that found nccl.h and libnccl: `make` prints which).
// Without it, comm_nccl_dup stops the job with a message saying so; check first to refuse a configuration.
int comm_nccl_available(void);
// Gives every rank of `comm` its own GPU: the ranks that share a host (comm_split_host) take GPUs 0, 1, ... of
// that host in rank order (cudaSetDevice; CUDA_VISIBLE_DEVICES applies). Collective over comm. Call it before
// the process' first device allocation. Returns the GPU index. A host with more ranks than GPUs ends the job:
// "parallel.backend = nccl needs one GPU per rank; use backend = mpi to share a GPU". Needs a CUDA build.
int comm_nccl_select_gpu(Comm *comm);
// A COMM_NCCL copy of the MPI group `comm` (COMM_MPI or COMM_NCCL; comm_world() after comm_init): the same
// ranks in the same order, the same name, a new MPI communicator and an NCCL communicator (unique id from group
// rank 0, broadcast over MPI) on each rank's current GPU, with a CUDA stream of its own. Collective over comm.
// Two ranks on one GPU end the job (every rank that shares one prints the line, naming both). comm_split of the
// result gives COMM_NCCL groups; comm_split_host gives COMM_MPI groups (host data only). Free it with comm_free,
// after the groups split from it and before comm_finalize. In a build without NCCL the job ends with a message.
Comm *comm_nccl_dup(Comm *comm);
// Tests only: on != 0 makes COMM_NCCL groups of size 1 take the NCCL path for device buffers (messages to
// themselves through NCCL, the device sums) instead of the size-1 identity, so that a one-GPU machine runs the
// NCCL code. Set it before the groups are made (a group of size 1 made without it has no NCCL communicator).
void comm_nccl_force_for_tests(int on);

#endif
