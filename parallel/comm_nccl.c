/*
 * comm_nccl.c - the NCCL backend of parallel/comm.h (COMM_NCCL): GPU ranks, one GPU each, whose device buffers
 * travel through NCCL, while host buffers, counts, the checks of every call and the unique id go over MPI.
 *
 * A COMM_NCCL group is comm.c's MPI group (mpi, coll: host buffers take comm.c's MPI code unchanged) plus a
 * CommNccl: two MPI communicators of its own (ctl for the checks below and the set-up, hdr for the headers of
 * point-to-point messages, so that no tag of comm.c or of a caller can match them), an ncclComm_t over the same
 * ranks in the same order (a fresh unique id per group, drawn by group rank 0 and broadcast over ctl, so NCCL
 * rank = MPI rank by construction), a CUDA stream and the device buffer of the reductions' slots.
 *
 * Why it is built this way:
 * - Sums in rank order, the MPI backend's bits. ncclAllReduce / ncclReduceScatter with ncclSum add in an order of
 *   NCCL's choosing (ring, tree or NVLS, by size and channel count), so they are not used. A reduction is the MPI
 *   backend's algorithm with NCCL as the wire: the owner of each block receives every rank's copy of it into one
 *   slot per rank (ncclSend / ncclRecv in one group, the rank itself included, so that a group of one runs the
 *   same code), kernels/cuda/comm_reduce.cu adds the slots in rank order (comm.c's combine_slots on the GPU), and
 *   the owners' results are all-gathered. Rounds of at most 64 MiB of slots bound the device buffer.
 * - Every device call is checked over MPI first: each rank sends each peer a descriptor (the operation, its
 *   number among the group's device calls, the counts that peer must agree with) and compares what it receives,
 *   so ranks making different calls, or the same call with different counts, end the job with a line naming both
 *   (NCCL would hang or move the wrong bytes), and a rank that never comes is named by the timeout ("nothing yet
 *   from world rank(s) 3"), as in comm.c. It costs one small MPI message per peer and call.
 * - The timeout. Communicators are non-blocking (ncclConfig_t.blocking = 0), so no NCCL call waits for a peer,
 *   and every wait here polls (MPI_Testall, ncclCommGetAsyncError, cudaStreamQuery) with a 50 us sleep. A call
 *   not complete after comm_timeout() seconds prints comm.h's timeout line, aborts the NCCL communicator
 *   (ncclCommAbort) and ends the job (MPI_Abort, COMM_EXIT_TIMEOUT).
 * - Synchronous calls, as over MPI: a call returns when its stream work is done. The stream first waits for an
 *   event recorded on the legacy default stream, where every fp8moe kernel runs, so NCCL reads what the caller
 *   wrote before the call.
 * - Point to point. NCCL has no tags, and a ncclSend blocks its stream until the peer receives, so isend and
 *   irecv only queue their message; the group's next wait, blocking send or receive, or device collective
 *   launches every queued message in one ncclGroupStart/End. Each message also sends a 16-byte header over hdr
 *   with the caller's tag (its size and its number among this rank's messages to that peer), which the receiver
 *   checks before NCCL moves anything: another size than was sent, or messages posted in another order on the two
 *   sides, end the job with both named.
 * The opening comment of comm.h states the contract; docs/parallelism.md describes the backend for users.
 */
#include "parallel/comm_nccl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(FP8MOE_NCCL) && defined(FP8MOE_CUDA)
#define HAVE_NCCL 1
#include <nccl.h>
#endif
#ifdef FP8MOE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef HAVE_NCCL
#include "kernels/cuda/comm_reduce.h"
#endif

#define NCCL_MISSING "NCCL is not in this build (make finds nccl.h and libnccl in a CUDA build: NCCL_HOME, the CUDA " \
                     "toolkit, /usr or python3's nvidia.nccl) - use parallel.backend = mpi"
#define ONE_GPU_PER_RANK "parallel.backend = nccl needs one GPU per rank; use backend = mpi to share a GPU"

// ---------------------------------------------------------------------------- errors (comm.c's formats)

// comm.c's error line, naming this file (comm_nccl.h)
#define fail(c, op, line, ...) comm_fail_at(c, op, __FILE__, line, __VA_ARGS__)
#define end_job comm_end_job

#ifdef FP8MOE_CUDA
static void cuda_check(const Comm *c, const char *op, const char *call, cudaError_t rc, int line) {
    if (rc == cudaSuccess) return;
    fail(c, op, line, "%s failed: %s (%s)", call, cudaGetErrorString(rc), cudaGetErrorName(rc));
}
#define CU_CHECK(c, op, call) cuda_check((c), (op), #call, (call), __LINE__)
#endif

#ifdef HAVE_NCCL

// ---------------------------------------------------------------------------- state

typedef struct CommNccl CommNccl;

#define POLL_SPINS 16         // polls before a wait starts to sleep between polls (comm.c's)
#define POLL_SLEEP_NS 50000L  // 50 us
#define DEFAULT_ROUND_BYTES ((size_t)64 << 20)
#define TAG_CHECK 1  // the checks' tag on ctl (hdr carries the callers' tags)

static size_t round_bytes = DEFAULT_ROUND_BYTES;
static int forced;  // comm_nccl_force_for_tests

// A posted message of a device buffer.
typedef struct {
    void *buf;
    size_t bytes;
    int peer, tag, is_send;
    uint64_t ticket;
    int64_t header[2];  // {bytes, number}: sent to the peer with the message, or received from it
    int64_t number;     // a receive: the number it must carry (its place among the messages from the peer)
    MPI_Request hreq;   // the header's send or receive on hdr
} NcclMsg;

typedef struct {
    NcclMsg **at;
    int n, cap;
} MsgList;

struct CommNccl {
    ncclComm_t comm;     // NULL for a group of size 1 outside tests: it never uses NCCL
    cudaStream_t stream;
    cudaEvent_t ready;   // recorded on the legacy default stream at the start of a call
    MPI_Comm ctl, hdr;
    int *world_of;       // size entries: the world rank of each group rank, for messages
    void *slots;         // device: the reductions' slots (device_alloc, kept)
    size_t slots_bytes;
    int64_t calls;       // device collectives so far, checked equal on every rank
    int64_t *sent, *received;  // size entries: device messages so far to / from each peer
    MsgList queue;       // posted, not launched
    MsgList flight;      // launched, their completion not yet seen
    uint64_t next_ticket, launched, completed;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void nap(long polls) {
    const struct timespec t = {0, POLL_SLEEP_NS};
    if (polls >= POLL_SPINS) nanosleep(&t, NULL);
}

static void nccl_check(const Comm *c, const char *op, const char *call, ncclResult_t rc, int line) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;  // in progress: a non-blocking call, polled after
    const char *last = ncclGetLastError(c != NULL && c->nccl != NULL ? c->nccl->comm : NULL);
    fail(c, op, line, "%s failed: %s%s%s", call, ncclGetErrorString(rc), last && last[0] ? " - " : "", last ? last : "");
}
#define NCCL_CHECK(c, op, call) nccl_check((c), (op), #call, (call), __LINE__)

// An error that a non-blocking communicator reports after the call that caused it (ncclCommGetAsyncError).
static _Noreturn void nccl_async_failed(const Comm *c, const char *op, ncclResult_t st, int line) {
    const char *last = ncclGetLastError(c->nccl->comm);
    fail(c, op, line, "NCCL failed: %s%s%s", ncclGetErrorString(st), last && last[0] ? " - " : "", last ? last : "");
}

static void mpi_check(const Comm *c, const char *op, const char *call, int rc, int line) {
    if (rc == MPI_SUCCESS) return;
    char s[MPI_MAX_ERROR_STRING] = "unknown MPI error";
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    fail(c, op, line, "%s failed: %s", call, s);
}
#define MPI_CHECK(c, op, call) mpi_check((c), (op), #call, (call), __LINE__)

// comm.h's timeout line; the NCCL communicator is aborted (its kernels stop) before the job ends.
static _Noreturn void timed_out(Comm *c, const char *op, const char *why) {
    fprintf(stderr, "fp8moe: rank %d: %s on group %s (size %d) timed out after %g s%s - a rank of the group has not "
                    "taken part (stopped, hung, dead, or making different calls); ending the job\n",
            c->world_rank, op, c->name, c->size, comm_timeout(), why);
    fflush(stderr);
    if (c->nccl != NULL && c->nccl->comm != NULL) ncclCommAbort(c->nccl->comm);
    end_job(COMM_EXIT_TIMEOUT);
}

static CommNccl *state(const Comm *c, const char *op) {
    if (c->kind != COMM_NCCL || c->nccl == NULL || c->nccl->comm == NULL)
        fail(c, op, __LINE__, "a %s group of size %d without an NCCL communicator - expected a COMM_NCCL group from "
             "comm_nccl_dup or comm_split (a group of size 1 has one only under comm_nccl_force_for_tests)",
             comm_kind_name(c->kind), c->size);
    return c->nccl;
}

static void list_push(const Comm *c, const char *op, MsgList *l, NcclMsg *m) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 16;
        l->at = realloc(l->at, (size_t)l->cap * sizeof *l->at);
        if (l->at == NULL) fail(c, op, __LINE__, "out of memory for %d messages", l->cap);
    }
    l->at[l->n++] = m;
}

// ---------------------------------------------------------------------------- waiting, with the timeout

// Completes the n MPI requests on ctl or hdr, or ends the job at the timeout naming the peers still missing
// (peers[i]: the group rank of request i, is_recv[i]: a receive; NULL: none named). t0: when the call began.
static void wait_mpi(Comm *c, const char *op, int n, MPI_Request *reqs, const int *peers, const int *is_recv, double t0) {
    if (n == 0) return;
    for (long polls = 0;; polls++) {
        int done = 0;
        MPI_CHECK(c, op, MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
        if (done) return;
        if (now_s() - t0 > comm_timeout()) {
            char why[256] = "";
            size_t at = 0;
            for (int pass = 0; pass < 2 && peers != NULL; pass++) {  // receives, then sends
                int listed = 0;
                for (int i = 0; i < n && at + 48 < sizeof why; i++) {
                    int flag = 1;
                    if ((pass == 0) != (is_recv[i] != 0) || MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag)
                        continue;
                    const char *lead = pass == 0 ? " - nothing yet from world rank(s) " : at ? "; world rank(s) " : " - world rank(s) ";
                    at += (size_t)snprintf(why + at, sizeof why - at, "%s%d", listed ? ", " : lead,
                                           c->nccl->world_of[peers[i]]);
                    listed = 1;
                }
                if (pass == 1 && listed) at += (size_t)snprintf(why + at, sizeof why - at, " have not taken this rank's messages");
            }
            timed_out(c, op, why);
        }
        nap(polls);
    }
}

// While a wait polls NCCL or CUDA, MPI must progress too: a peer may be waiting for a header this rank has posted
// (a small MPI_Isend is not always out before the next MPI call; any MPI call drives Open MPI's progress engine).
static void progress_mpi(const Comm *c, const char *op) {
    int flag = 0;
    MPI_CHECK(c, op, MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, c->nccl->hdr, &flag, MPI_STATUS_IGNORE));
}

// Until the NCCL calls made on c have been issued (a non-blocking communicator answers ncclInProgress first).
static void nccl_settle(Comm *c, const char *op, double t0) {
    for (long polls = 0;; polls++) {
        progress_mpi(c, op);
        ncclResult_t st = ncclSuccess;
        NCCL_CHECK(c, op, ncclCommGetAsyncError(c->nccl->comm, &st));
        if (st == ncclSuccess) return;
        if (st != ncclInProgress) nccl_async_failed(c, op, st, __LINE__);
        if (now_s() - t0 > comm_timeout()) timed_out(c, op, " - NCCL has not issued its operations");
        nap(polls);
    }
}

// Until everything launched on c's stream has completed; then the launched messages' headers, and they are done.
static void nccl_complete(Comm *c, const char *op, double t0) {
    CommNccl *nc = c->nccl;
    for (long polls = 0;; polls++) {
        progress_mpi(c, op);
        ncclResult_t st = ncclSuccess;
        NCCL_CHECK(c, op, ncclCommGetAsyncError(nc->comm, &st));
        if (st != ncclSuccess && st != ncclInProgress) nccl_async_failed(c, op, st, __LINE__);
        const cudaError_t e = cudaStreamQuery(nc->stream);
        if (e == cudaSuccess && st == ncclSuccess) break;
        if (e != cudaSuccess && e != cudaErrorNotReady) cuda_check(c, op, "cudaStreamQuery", e, __LINE__);
        if (e == cudaErrorNotReady) (void)cudaGetLastError();  // not an error; keep it from a later launch check
        if (now_s() - t0 > comm_timeout())
            timed_out(c, op, " - its NCCL operations have not completed (the NCCL communicator is aborted)");
        nap(polls);
    }
    const int n = nc->flight.n;
    if (n > 0) {
        MPI_Request *reqs = malloc((size_t)n * sizeof *reqs);
        int *peers = malloc((size_t)n * sizeof *peers), *is_recv = calloc((size_t)n, sizeof *is_recv);
        if (reqs == NULL || peers == NULL || is_recv == NULL) fail(c, op, __LINE__, "out of memory");
        for (int i = 0; i < n; i++) reqs[i] = nc->flight.at[i]->hreq, peers[i] = nc->flight.at[i]->peer;
        wait_mpi(c, op, n, reqs, peers, is_recv, t0);  // sends only: the receives were completed at the launch
        for (int i = 0; i < n; i++) free(nc->flight.at[i]);
        nc->flight.n = 0;
        free(reqs), free(peers), free(is_recv);
    }
    nc->completed = nc->launched;
}

// The call's NCCL work starts after what the caller queued on the legacy default stream before it.
static void after_callers_work(Comm *c, const char *op) {
    CommNccl *nc = c->nccl;
    CU_CHECK(c, op, cudaEventRecord(nc->ready, cudaStreamLegacy));
    CU_CHECK(c, op, cudaStreamWaitEvent(nc->stream, nc->ready, 0));
}

// ---------------------------------------------------------------------------- the check of every device call

static const char *const op_names[] = {
    "comm_allreduce_sum_double", "comm_allreduce_sum_i64", "comm_allreduce_sum_real", "comm_allreduce_max_double",
    "comm_allreduce_min_double", "comm_reduce_scatter_sum_real", "comm_allgather_real", "comm_allgather_bytes",
    "comm_alltoallv_bytes", "comm_bcast_bytes",
};
#define N_OPS ((int)(sizeof op_names / sizeof op_names[0]))

static int64_t op_code(const char *op) {
    for (int i = 0; i < N_OPS; i++)
        if (strcmp(op, op_names[i]) == 0) return i + 1;
    return 0;
}

static const char *op_name(int64_t code) { return code >= 1 && code <= N_OPS ? op_names[code - 1] : "another call"; }

// FNV-1a of a count array: every rank's counts must be the same array.
static int64_t counts_checksum(const int64_t *counts, int n) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++) {
        uint64_t v = (uint64_t)counts[i];
        for (int b = 0; b < 8; b++) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ULL;
    }
    return (int64_t)h;
}

// Every rank sends every other rank {operation, call number, value, extra} on ctl and compares what it gets with
// its own: the operation, the number and extra must be equal; the value is `value` on every rank, or, with
// to_peer / from_peer (size entries each), rank q gets to_peer[q] and expects from_peer[p] from rank p (an
// all-to-all-v: what p sends to q against q's recv_bytes[p]). what / extra_what name them in the message.
static void agree(Comm *c, const char *op, double t0, int64_t value, const int64_t *to_peer, const int64_t *from_peer,
                  const char *what, int64_t extra, const char *extra_what) {
    CommNccl *nc = c->nccl;
    const int P = c->size, me = c->rank;
    const int64_t code = op_code(op), call = nc->calls++;
    if (P == 1) return;
    int64_t (*out)[4] = malloc((size_t)P * sizeof *out), (*in)[4] = malloc((size_t)P * sizeof *in);
    MPI_Request *reqs = malloc(2 * (size_t)P * sizeof *reqs);
    int *peers = malloc(2 * (size_t)P * sizeof *peers), *is_recv = malloc(2 * (size_t)P * sizeof *is_recv);
    if (out == NULL || in == NULL || reqs == NULL || peers == NULL || is_recv == NULL) fail(c, op, __LINE__, "out of memory");
    int n = 0;
    for (int k = 1; k < P; k++) {
        const int r = (me + P - k) % P;
        MPI_CHECK(c, op, MPI_Irecv(in[r], 4, MPI_INT64_T, r, TAG_CHECK, nc->ctl, &reqs[n]));
        peers[n] = r, is_recv[n++] = 1;
    }
    for (int k = 1; k < P; k++) {
        const int r = (me + k) % P;
        out[r][0] = code, out[r][1] = call, out[r][2] = to_peer ? to_peer[r] : value, out[r][3] = extra;
        MPI_CHECK(c, op, MPI_Isend(out[r], 4, MPI_INT64_T, r, TAG_CHECK, nc->ctl, &reqs[n]));
        peers[n] = r, is_recv[n++] = 0;
    }
    wait_mpi(c, op, n, reqs, peers, is_recv, t0);
    for (int k = 1; k < P; k++) {
        const int p = (me + P - k) % P, wp = nc->world_of[p];
        const int64_t *got = in[p], want = from_peer ? from_peer[p] : value;
        if (got[0] != code)
            fail(c, op, __LINE__, "world rank %d makes %s as device call %lld of this group, where this rank makes %s - "
                 "every rank of a group must make the same collective calls in the same order", wp, op_name(got[0]),
                 (long long)got[1], op);
        if (got[1] != call)
            fail(c, op, __LINE__, "world rank %d is at device call %lld of this group, this rank at %lld - every rank "
                 "of a group must make the same collective calls in the same order", wp, (long long)got[1], (long long)call);
        if (got[2] != want && from_peer != NULL)
            fail(c, op, __LINE__, "world rank %d (rank %d here) sends %lld bytes to this rank, but recv_bytes[%d] = %lld - "
                 "expected recv_bytes as comm_alltoall_counts returns them for the peers' send_bytes", wp, p,
                 (long long)got[2], p, (long long)want);
        if (got[2] != want)
            fail(c, op, __LINE__, "world rank %d passed %s = %lld, this rank %s = %lld - expected the same on every "
                 "rank of the group", wp, what, (long long)got[2], what, (long long)want);
        if (got[3] != extra)
            fail(c, op, __LINE__, "world rank %d passed %s %lld, this rank %lld - expected the same on every rank of "
                 "the group", wp, extra_what, (long long)got[3], (long long)extra);
    }
    free(out), free(in), free(reqs), free(peers), free(is_recv);
}

// ---------------------------------------------------------------------------- point to point

// Launches every queued message of c in one NCCL group, once the headers of its receives have arrived and agree.
static void launch_queue(Comm *c, const char *op, double t0) {
    CommNccl *nc = c->nccl;
    const int n = nc->queue.n;
    if (n == 0) return;
    MPI_Request *reqs = malloc((size_t)n * sizeof *reqs);
    int *peers = malloc((size_t)n * sizeof *peers), *is_recv = malloc((size_t)n * sizeof *is_recv);
    if (reqs == NULL || peers == NULL || is_recv == NULL) fail(c, op, __LINE__, "out of memory");
    int nr = 0;
    for (int i = 0; i < n; i++) {
        NcclMsg *m = nc->queue.at[i];
        if (m->is_send) continue;
        reqs[nr] = m->hreq, peers[nr] = m->peer, is_recv[nr++] = 1;
    }
    wait_mpi(c, op, nr, reqs, peers, is_recv, t0);
    nr = 0;
    for (int i = 0; i < n; i++) {
        NcclMsg *m = nc->queue.at[i];
        if (m->is_send) continue;
        m->hreq = reqs[nr++];  // MPI_REQUEST_NULL now
        if (m->header[0] != (int64_t)m->bytes)
            fail(c, op, __LINE__, "the message from rank %d (world rank %d, tag %d) has %lld bytes, expected %zu - the "
                 "sender and the receiver disagree on the size (sends and receives of a pair must match one to one)",
                 m->peer, nc->world_of[m->peer], m->tag, (long long)m->header[0], m->bytes);
        if (m->header[1] != m->number)
            fail(c, op, __LINE__, "the message with tag %d from rank %d (world rank %d) is that rank's message %lld to "
                 "this one, where this receive is the %lld-th from it (counting from 0) - device messages of a COMM_NCCL "
                 "group between two ranks match in the order they are posted (NCCL has no tags): post them in the same "
                 "order on both ranks", m->tag, m->peer, nc->world_of[m->peer], (long long)m->header[1],
                 (long long)m->number);
    }
    free(reqs), free(peers), free(is_recv);
    after_callers_work(c, op);
    NCCL_CHECK(c, op, ncclGroupStart());
    for (int i = 0; i < n; i++) {
        NcclMsg *m = nc->queue.at[i];
        if (m->bytes == 0) continue;  // both sides skip it: the header said 0
        if (m->is_send) NCCL_CHECK(c, op, ncclSend(m->buf, m->bytes, ncclUint8, m->peer, nc->comm, nc->stream));
        else NCCL_CHECK(c, op, ncclRecv(m->buf, m->bytes, ncclUint8, m->peer, nc->comm, nc->stream));
    }
    NCCL_CHECK(c, op, ncclGroupEnd());
    nccl_settle(c, op, t0);
    for (int i = 0; i < n; i++) list_push(c, op, &nc->flight, nc->queue.at[i]);
    nc->launched = nc->queue.at[n - 1]->ticket;
    nc->queue.n = 0;
}

void comm_nccl_post(Comm *c, const char *op, void *buf, size_t bytes, int peer, int tag, CommRequest *req, int is_send) {
    CommNccl *nc = state(c, op);
    NcclMsg *m = calloc(1, sizeof *m);
    if (m == NULL) fail(c, op, __LINE__, "out of memory");
    m->buf = buf, m->bytes = bytes, m->peer = peer, m->tag = tag, m->is_send = is_send;
    m->ticket = ++nc->next_ticket;
    if (is_send) {
        m->header[0] = (int64_t)bytes, m->header[1] = nc->sent[peer]++;
        MPI_CHECK(c, op, MPI_Isend(m->header, 2, MPI_INT64_T, peer, tag, nc->hdr, &m->hreq));
    } else {
        m->number = nc->received[peer]++;
        MPI_CHECK(c, op, MPI_Irecv(m->header, 2, MPI_INT64_T, peer, tag, nc->hdr, &m->hreq));
    }
    list_push(c, op, &nc->queue, m);
    memset(req, 0, sizeof *req);
    req->comm = c, req->op = op, req->peer = peer, req->tag = tag, req->bytes = bytes, req->is_send = is_send;
    req->n = 1;
    req->nccl_ticket = m->ticket;
}

void comm_nccl_wait(CommRequest *req) {
    const double t0 = now_s();
    Comm *c = req->comm;
    CommNccl *nc = state(c, req->op);
    if (req->nccl_ticket > nc->launched) launch_queue(c, req->op, t0);
    if (req->nccl_ticket > nc->completed) nccl_complete(c, req->op, t0);
    memset(req, 0, sizeof *req);
}

// ---------------------------------------------------------------------------- reductions and gathers

// The slot buffer of at least `bytes` (kept; every call completes before it returns, so a larger one may replace
// it at the start of the next).
static void *slot_buffer(Comm *c, size_t bytes) {
    CommNccl *nc = c->nccl;
    if (bytes > nc->slots_bytes) {
        device_free(DEVICE_CUDA, nc->slots);
        nc->slots = device_alloc(DEVICE_CUDA, bytes);
        nc->slots_bytes = bytes;
    }
    return nc->slots;
}

// recv (counts[me] elements of es bytes) = the rank-order combination of block `me` of every rank's send (block b:
// counts[b] elements at d[b]). In rounds of `piece` elements per block (round_bytes of slots at most): each round
// one NCCL group (every rank's piece of block me into slot r, this rank's piece of block b to rank b), then the
// combine kernel into recv. recv may be send + d[me] * es: the round sends its piece of it to this rank's own slot
// before the kernel, later on the stream, writes it.
static void reduce_blocks(Comm *c, const char *op, int type, int red, size_t es, const void *send, void *recv,
                          const int64_t *counts, const int64_t *d, double t0) {
    CommNccl *nc = c->nccl;
    const int P = c->size, me = c->rank;
    int64_t piece = (int64_t)(round_bytes / es / (size_t)P), most = 0;
    if (piece < 1) piece = 1;
    for (int b = 0; b < P; b++) most = counts[b] > most ? counts[b] : most;
    if (most == 0) return;
    const int64_t stride = most < piece ? most : piece;
    char *slots = slot_buffer(c, (size_t)P * (size_t)stride * es);
    for (int64_t off = 0; off < most; off += piece) {
        int64_t mine = counts[me] - off;
        mine = mine < 0 ? 0 : mine > piece ? piece : mine;
        NCCL_CHECK(c, op, ncclGroupStart());
        for (int r = 0; r < P && mine > 0; r++)
            NCCL_CHECK(c, op, ncclRecv(slots + (size_t)r * (size_t)stride * es, (size_t)mine * es, ncclUint8, r,
                                       nc->comm, nc->stream));
        for (int b = 0; b < P; b++) {
            int64_t len = counts[b] - off;
            if (len <= 0) continue;
            len = len > piece ? piece : len;
            NCCL_CHECK(c, op, ncclSend((const char *)send + (size_t)(d[b] + off) * es, (size_t)len * es, ncclUint8, b,
                                       nc->comm, nc->stream));
        }
        NCCL_CHECK(c, op, ncclGroupEnd());
        nccl_settle(c, op, t0);
        if (mine > 0) {
            const int rc = cuda_comm_combine_slots(type, red, (char *)recv + (size_t)off * es, slots, P, stride, mine,
                                                   (void *)nc->stream);
            if (rc != 0) cuda_check(c, op, "cuda_comm_combine_slots (kernels/cuda/comm_reduce.cu)", (cudaError_t)rc, __LINE__);
        }
    }
}

// recv's block r (counts[r] elements of es bytes at d[r]) = rank r's send. Equal blocks: ncclAllGather (a copy,
// in place when send is recv's own block); otherwise one group of ncclSend / ncclRecv, this rank included unless
// in place.
static void gather_blocks(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                          const int64_t *d, double t0) {
    CommNccl *nc = c->nccl;
    const int P = c->size, me = c->rank;
    const int in_place = (const char *)send == (const char *)recv + (size_t)d[me] * es;
    int equal = 1;
    for (int r = 1; r < P; r++) equal &= counts[r] == counts[0];
    if (equal) {
        if (counts[0] > 0)
            NCCL_CHECK(c, op, ncclAllGather(send, recv, (size_t)counts[0] * es, ncclUint8, nc->comm, nc->stream));
    } else {
        NCCL_CHECK(c, op, ncclGroupStart());
        for (int r = 0; r < P; r++)
            if (counts[r] > 0 && !(r == me && in_place))
                NCCL_CHECK(c, op, ncclRecv((char *)recv + (size_t)d[r] * es, (size_t)counts[r] * es, ncclUint8, r,
                                           nc->comm, nc->stream));
        for (int r = 0; r < P && counts[me] > 0; r++)
            if (!(r == me && in_place))
                NCCL_CHECK(c, op, ncclSend(send, (size_t)counts[me] * es, ncclUint8, r, nc->comm, nc->stream));
        NCCL_CHECK(c, op, ncclGroupEnd());
    }
    nccl_settle(c, op, t0);
}

static size_t type_bytes(int type) { return type == COMM_COMBINE_FLOAT ? sizeof(float) : 8; }

void comm_nccl_allreduce(Comm *c, const char *op, int type, int red, void *x, int64_t n) {
    const double t0 = now_s();
    state(c, op);
    launch_queue(c, op, t0);  // messages posted before this call go first, in order
    agree(c, op, t0, n, NULL, NULL, "n", 0, "");
    const int P = c->size;
    int64_t *counts = malloc(2 * (size_t)P * sizeof *counts);
    if (counts == NULL) fail(c, op, __LINE__, "out of memory");
    int64_t *d = counts + P;
    for (int b = 0; b < P; b++) counts[b] = n / P + (b < n % P);  // comm.c's even blocks
    comm_displacements(counts, P, d);
    const size_t es = type_bytes(type);
    after_callers_work(c, op);
    char *own = (char *)x + (size_t)d[c->rank] * es;
    reduce_blocks(c, op, type, red, es, x, own, counts, d, t0);
    gather_blocks(c, op, es, own, x, counts, d, t0);
    nccl_complete(c, op, t0);
    free(counts);
}

void comm_nccl_reduce_scatter(Comm *c, const char *op, const real *send, real *recv, const int64_t *counts,
                              const int64_t *d) {
    const double t0 = now_s();
    state(c, op);
    launch_queue(c, op, t0);
    const int P = c->size;
    agree(c, op, t0, d[P - 1] + counts[P - 1], NULL, NULL, "the sum of counts", counts_checksum(counts, P),
          "counts with the checksum");
    after_callers_work(c, op);
    reduce_blocks(c, op, sizeof(real) == sizeof(float) ? COMM_COMBINE_FLOAT : COMM_COMBINE_DOUBLE, COMM_COMBINE_SUM,
                  sizeof(real), send, recv, counts, d, t0);
    nccl_complete(c, op, t0);
}

void comm_nccl_allgather(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                         const int64_t *d) {
    const double t0 = now_s();
    state(c, op);
    launch_queue(c, op, t0);
    const int P = c->size;
    agree(c, op, t0, d[P - 1] + counts[P - 1], NULL, NULL, es == 1 ? "the bytes of all blocks" : "the sum of counts",
          counts_checksum(counts, P), "counts with the checksum");
    after_callers_work(c, op);
    gather_blocks(c, op, es, send, recv, counts, d, t0);
    nccl_complete(c, op, t0);
}

// ---------------------------------------------------------------------------- all-to-all-v, broadcast

void comm_nccl_alltoallv(Comm *c, const char *op, const void *send, const int64_t *send_bytes, const int64_t *sd,
                         void *recv, const int64_t *recv_bytes, const int64_t *rd) {
    const double t0 = now_s();
    CommNccl *nc = state(c, op);
    launch_queue(c, op, t0);
    agree(c, op, t0, 0, send_bytes, recv_bytes, "bytes", 0, "");
    const int P = c->size, me = c->rank;
    after_callers_work(c, op);
    NCCL_CHECK(c, op, ncclGroupStart());
    for (int k = 0; k < P; k++) {  // from me, me-1, me-2, ...; to me, me+1, ...: spreads the load over the peers
        const int r = (me + P - k) % P;
        if (recv_bytes[r] > 0)
            NCCL_CHECK(c, op, ncclRecv((char *)recv + rd[r], (size_t)recv_bytes[r], ncclUint8, r, nc->comm, nc->stream));
    }
    for (int k = 0; k < P; k++) {
        const int r = (me + k) % P;
        if (send_bytes[r] > 0)
            NCCL_CHECK(c, op, ncclSend((const char *)send + sd[r], (size_t)send_bytes[r], ncclUint8, r, nc->comm,
                                       nc->stream));
    }
    NCCL_CHECK(c, op, ncclGroupEnd());
    nccl_settle(c, op, t0);
    nccl_complete(c, op, t0);
}

void comm_nccl_bcast(Comm *c, const char *op, void *buf, size_t bytes, int root) {
    const double t0 = now_s();
    CommNccl *nc = state(c, op);
    launch_queue(c, op, t0);
    agree(c, op, t0, (int64_t)bytes, NULL, NULL, "bytes", root, "root");
    if (bytes > 0) {
        after_callers_work(c, op);
        NCCL_CHECK(c, op, ncclBroadcast(buf, buf, bytes, ncclUint8, root, nc->comm, nc->stream));
        nccl_settle(c, op, t0);
    }
    nccl_complete(c, op, t0);
}

// ---------------------------------------------------------------------------- set-up

int comm_nccl_available(void) { return 1; }

int comm_nccl_takes(const Comm *c) {
    return c->kind == COMM_NCCL && (c->size > 1 || (forced && c->nccl != NULL && c->nccl->comm != NULL));
}

void comm_nccl_force_for_tests(int on) { forced = on != 0; }

void comm_nccl_set_round_bytes(size_t bytes) { round_bytes = bytes ? bytes : DEFAULT_ROUND_BYTES; }

// An MPI communicator of c's ranks for this backend alone (errors returned), made without a blocking call.
static MPI_Comm dup_mpi(Comm *c, const char *op, double t0) {
    MPI_Comm m = MPI_COMM_NULL;
    MPI_Request req;
    MPI_CHECK(c, op, MPI_Comm_idup(c->mpi, &m, &req));
    wait_mpi(c, op, 1, &req, NULL, NULL, t0);
    MPI_CHECK(c, op, MPI_Comm_set_errhandler(m, MPI_ERRORS_RETURN));
    return m;
}

// Every rank's GPU (its UUID) differs from every other's, or the ranks that share one end the job.
typedef struct {
    unsigned char uuid[16];
    int device;
    char pci[32];
    char host[64];
} GpuOfRank;

static void check_one_gpu_per_rank(Comm *c, const char *op, double t0) {
    const int P = c->size, me = c->rank;
    GpuOfRank mine;
    memset(&mine, 0, sizeof mine);
    CU_CHECK(c, op, cudaGetDevice(&mine.device));
    struct cudaDeviceProp prop;
    CU_CHECK(c, op, cudaGetDeviceProperties(&prop, mine.device));
    memcpy(mine.uuid, prop.uuid.bytes, sizeof mine.uuid);
    CU_CHECK(c, op, cudaDeviceGetPCIBusId(mine.pci, (int)sizeof mine.pci - 1, mine.device));
    if (gethostname(mine.host, sizeof mine.host - 1) != 0) snprintf(mine.host, sizeof mine.host, "unknown");
    GpuOfRank *all = malloc((size_t)P * sizeof *all);
    if (all == NULL) fail(c, op, __LINE__, "out of memory");
    MPI_Request req;
    MPI_CHECK(c, op, MPI_Iallgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, c->nccl->ctl, &req));
    wait_mpi(c, op, 1, &req, NULL, NULL, t0);
    for (int r = 0; r < P; r++) {
        if (r == me || memcmp(all[r].uuid, mine.uuid, sizeof mine.uuid) != 0) continue;
        const int a = c->nccl->world_of[r < me ? r : me], b = c->nccl->world_of[r < me ? me : r];
        fail(c, op, __LINE__, "world ranks %d and %d both use GPU %d (PCI %s) of host %s - " ONE_GPU_PER_RANK, a, b,
             mine.device, mine.pci, mine.host);
    }
    free(all);
}

void comm_nccl_attach(Comm *c, const char *op) {
    const double t0 = now_s();
    const int P = c->size;
    CommNccl *nc = calloc(1, sizeof *nc);
    if (nc == NULL) fail(c, op, __LINE__, "out of memory");
    c->nccl = nc;
    nc->ctl = dup_mpi(c, op, t0);
    nc->hdr = dup_mpi(c, op, t0);
    nc->world_of = malloc((size_t)P * sizeof *nc->world_of);
    nc->sent = calloc((size_t)P, sizeof *nc->sent);
    nc->received = calloc((size_t)P, sizeof *nc->received);
    int *ranks = malloc((size_t)P * sizeof *ranks);
    if (nc->world_of == NULL || nc->sent == NULL || nc->received == NULL || ranks == NULL) fail(c, op, __LINE__, "out of memory");
    MPI_Group group, world;
    MPI_CHECK(c, op, MPI_Comm_group(nc->ctl, &group));
    MPI_CHECK(c, op, MPI_Comm_group(MPI_COMM_WORLD, &world));
    for (int r = 0; r < P; r++) ranks[r] = r;
    MPI_CHECK(c, op, MPI_Group_translate_ranks(group, P, ranks, world, nc->world_of));
    MPI_CHECK(c, op, MPI_Group_free(&group));
    MPI_CHECK(c, op, MPI_Group_free(&world));
    free(ranks);
    check_one_gpu_per_rank(c, op, t0);
    if (P == 1 && !forced) return;  // never used: no NCCL communicator (comm_nccl_takes is 0)
    if (setenv("NCCL_NVLS_ENABLE", "0", 0) != 0) fail(c, op, __LINE__, "setenv(NCCL_NVLS_ENABLE) failed");
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank == 0) NCCL_CHECK(c, op, ncclGetUniqueId(&id));
    MPI_Request req;
    MPI_CHECK(c, op, MPI_Ibcast(&id, (int)sizeof id, MPI_BYTE, 0, nc->ctl, &req));
    wait_mpi(c, op, 1, &req, NULL, NULL, t0);
    CU_CHECK(c, op, cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking));
    CU_CHECK(c, op, cudaEventCreateWithFlags(&nc->ready, cudaEventDisableTiming));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every wait polls, so the timeout holds (ncclCommInitRankConfig: from NCCL 2.14)
    NCCL_CHECK(c, op, ncclCommInitRankConfig(&nc->comm, P, id, c->rank, &config));
    nccl_settle(c, op, t0);
}

void comm_nccl_detach(Comm *c) {
    CommNccl *nc = c->nccl;
    if (nc == NULL) return;
    const char *op = "comm_free";
    const double t0 = now_s();
    if (nc->queue.n > 0 || nc->flight.n > 0)
        fail(c, op, __LINE__, "%d device message(s) posted with comm_isend_bytes / comm_irecv_bytes were never "
             "waited for - expected a comm_wait for each before comm_free", nc->queue.n + nc->flight.n);
    if (nc->comm != NULL) {
        NCCL_CHECK(c, op, ncclCommFinalize(nc->comm));
        nccl_settle(c, op, t0);
        NCCL_CHECK(c, op, ncclCommDestroy(nc->comm));
        nc->comm = NULL;
        CU_CHECK(c, op, cudaStreamDestroy(nc->stream));
        CU_CHECK(c, op, cudaEventDestroy(nc->ready));
    }
    device_free(DEVICE_CUDA, nc->slots);
    MPI_CHECK(c, op, MPI_Comm_free(&nc->ctl));
    MPI_CHECK(c, op, MPI_Comm_free(&nc->hdr));
    free(nc->world_of), free(nc->sent), free(nc->received), free(nc->queue.at), free(nc->flight.at);
    free(nc);
    c->nccl = NULL;
}

Comm *comm_nccl_dup(Comm *comm) {
    const char *op = "comm_nccl_dup";
    if (comm == NULL) fail(NULL, op, __LINE__, "comm is NULL - expected an MPI group");
    if (comm->kind != COMM_MPI && comm->kind != COMM_NCCL)
        fail(comm, op, __LINE__, "a %s group - expected a COMM_MPI or COMM_NCCL group (NCCL needs MPI for its set-up: "
             "comm_init first)", comm_kind_name(comm->kind));
    Comm *c = comm_split(comm, 0, comm->rank, comm->name);  // a COMM_NCCL parent gives a COMM_NCCL group already
    if (c->kind != COMM_NCCL) {
        c->kind = COMM_NCCL;
        comm_nccl_attach(c, op);
    }
    return c;
}

#else  // ------------------------------------------------------------------------- a build without NCCL

int comm_nccl_available(void) { return 0; }
int comm_nccl_takes(const Comm *c) {
    (void)c;
    return 0;
}
void comm_nccl_force_for_tests(int on) { (void)on; }
void comm_nccl_set_round_bytes(size_t bytes) { (void)bytes; }
Comm *comm_nccl_dup(Comm *comm) { fail(comm, "comm_nccl_dup", __LINE__, NCCL_MISSING); }
void comm_nccl_attach(Comm *c, const char *op) { fail(c, op, __LINE__, NCCL_MISSING); }
void comm_nccl_detach(Comm *c) {
    if (c->nccl != NULL) fail(c, "comm_free", __LINE__, NCCL_MISSING);
}
void comm_nccl_allreduce(Comm *c, const char *op, int type, int red, void *x, int64_t n) {
    (void)type, (void)red, (void)x, (void)n;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_reduce_scatter(Comm *c, const char *op, const real *send, real *recv, const int64_t *counts,
                              const int64_t *d) {
    (void)send, (void)recv, (void)counts, (void)d;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_allgather(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                         const int64_t *d) {
    (void)es, (void)send, (void)recv, (void)counts, (void)d;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_alltoallv(Comm *c, const char *op, const void *send, const int64_t *send_bytes, const int64_t *sd,
                         void *recv, const int64_t *recv_bytes, const int64_t *rd) {
    (void)send, (void)send_bytes, (void)sd, (void)recv, (void)recv_bytes, (void)rd;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_bcast(Comm *c, const char *op, void *buf, size_t bytes, int root) {
    (void)buf, (void)bytes, (void)root;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_post(Comm *c, const char *op, void *buf, size_t bytes, int peer, int tag, CommRequest *req, int is_send) {
    (void)buf, (void)bytes, (void)peer, (void)tag, (void)req, (void)is_send;
    fail(c, op, __LINE__, NCCL_MISSING);
}
void comm_nccl_wait(CommRequest *req) { fail(req->comm, req->op, __LINE__, NCCL_MISSING); }

#endif

// ---------------------------------------------------------------------------- one GPU per rank (CUDA builds)

int comm_nccl_select_gpu(Comm *comm) {
    const char *op = "comm_nccl_select_gpu";
    if (comm == NULL) fail(NULL, op, __LINE__, "comm is NULL - expected a communicator");
#ifdef FP8MOE_CUDA
    Comm *host = comm_split_host(comm, "host");  // this host's ranks of comm, in rank order
    const int local = host->rank, local_size = host->size;
    comm_free(host);
    int n = 0;
    CU_CHECK(comm, op, cudaGetDeviceCount(&n));
    if (local_size > n) {
        char name[64] = "unknown";
        if (gethostname(name, sizeof name - 1) != 0) snprintf(name, sizeof name, "unknown");
        fail(comm, op, __LINE__, "host %s runs %d ranks of this group but has %d GPU(s) visible - " ONE_GPU_PER_RANK,
             name, local_size, n);
    }
    CU_CHECK(comm, op, cudaSetDevice(local));
    return local;
#else
    fail(comm, op, __LINE__, "this build has no CUDA - one GPU per rank needs a CUDA build (CUDA >= 12.9)");
#endif
}
