/*
 * comm.c - the communication backends behind parallel/comm.h: the single process (COMM_SINGLE, the
 * identity) and MPI (COMM_MPI, host buffers, and device buffers staged through pinned host memory).
 *
 * Why the collectives are built from point-to-point messages instead of MPI_Allreduce / MPI_SUM:
 * - Determinism. MPI chooses the order in which it adds (and may change it with the number of ranks,
 *   the message size or the library version). Here the rank that owns a block of elements receives
 *   every rank's copy of that block and adds them itself in rank order, so the result is
 *   ((x_0 + x_1) + x_2) + ... exactly, and the owner sends the same bits to every rank.
 * - Timeouts. Every operation is a set of nonblocking MPI requests polled with MPI_Testall and a short
 *   sleep; a call that has not completed after comm_timeout() seconds names itself and ends the job,
 *   where a blocking MPI call would hang forever on a rank that stopped.
 * - Large counts. MPI counts are int; buffers here can pass 2^31 elements. Reductions run in rounds of
 *   a bounded piece per block (which also bounds the owner's receive buffer), and every other message
 *   travels in pieces of at most 1 GiB.
 * Every communicator has MPI_ERRORS_RETURN and every return code is checked (MPI_CHECK): an MPI error
 * prints the function, group, rank and MPI's error string and calls MPI_Abort, never a silent abort.
 *
 * Device staging (several MPI ranks sharing a GPU): a call given device buffers (device_of_pointer) copies
 * them into the pinned host buffer the Comm owns, runs the host algorithm on that copy, and copies the
 * result back (section "device staging" below), so the bits are those of host buffers. Reductions and
 * gathers stage in rounds (each round a collective of its own over one piece of every block), so the
 * pinned buffer stays near ROUND_BYTES; every element still sees the same rank-order sum. The host
 * path's messages are unchanged: a host buffer costs one pointer query (none before the process' first
 * cudaMalloc).
 */
#include "parallel/comm.h"
#include "parallel/comm_nccl.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// ---------------------------------------------------------------------------- process state

static Comm world_single = {.rank = 0, .size = 1, .kind = COMM_SINGLE, .name = "world", .world_rank = 0};
static Comm world_mpi;
static int mpi_started;  // between comm_init and comm_finalize
static double timeout_s = COMM_DEFAULT_TIMEOUT_S;

#define DEFAULT_PIECE_BYTES ((size_t)1 << 30)  // largest single MPI message
#define DEFAULT_ROUND_BYTES ((size_t)64 << 20)  // a reduction round's receive buffer, over all ranks
static size_t PIECE_BYTES = DEFAULT_PIECE_BYTES;
static size_t ROUND_BYTES = DEFAULT_ROUND_BYTES;
#define POLL_SPINS 16                          // polls before a wait starts to sleep between polls
#define POLL_SLEEP_NS 50000L                   // 50 us: oversubscribed ranks yield their core

enum { TAG_REDUCE = 1, TAG_GATHER = 2, TAG_ALLTOALL = 3, TAG_COUNTS = 4, TAG_BARRIER = 5 };  // tags on Comm.coll

Comm *comm_world_single(void) { return &world_single; }
Comm *comm_world(void) { return mpi_started ? &world_mpi : &world_single; }
int comm_is_initialized(void) { return mpi_started; }

int comm_launched_by_mpi(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return 1;
    return 0;
}

const char *comm_kind_name(CommKind kind) {
    switch (kind) {
    case COMM_SINGLE: return "single";
    case COMM_MPI: return "mpi";
    case COMM_NCCL: return "nccl";
    }
    return "unknown";
}

// ---------------------------------------------------------------------------- errors

static int world_rank_now(void) { return mpi_started ? world_mpi.rank : 0; }

_Noreturn void comm_end_job(int code) {
    fflush(stdout);
    fflush(stderr);
    if (mpi_started) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}
#define end_job comm_end_job

static _Noreturn void fail_v(const Comm *c, const char *op, const char *file, int line, const char *fmt, va_list ap) {
    char what[1024];
    vsnprintf(what, sizeof what, fmt, ap);
    if (c != NULL)
        fprintf(stderr, "fp8moe: rank %d: %s on group %s (size %d, rank %d there): %s (%s:%d)\n", world_rank_now(),
                op, c->name, c->size, c->rank, what, file, line);
    else
        fprintf(stderr, "fp8moe: rank %d: %s: %s (%s:%d)\n", world_rank_now(), op, what, file, line);
    end_job(COMM_EXIT_ERROR);
}

_Noreturn void comm_fail_at(const Comm *c, const char *op, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(c, op, file, line, fmt, ap);
}

// "fp8moe: rank R: OP on group NAME (size S): WHAT" and the job ends.
static _Noreturn void __attribute__((format(printf, 4, 5)))
comm_fail(const Comm *c, const char *op, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(c, op, __FILE__, line, fmt, ap);
}

static void mpi_error_string(int rc, char *buf, size_t size) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) len = 0;
    s[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = 0;
    snprintf(buf, size, "%s", len > 0 ? s : "unknown MPI error");
}

static void mpi_check(const Comm *c, const char *op, const char *call, int rc, int line) {
    if (rc == MPI_SUCCESS) return;
    char s[MPI_MAX_ERROR_STRING + 8];
    mpi_error_string(rc, s, sizeof s);
    comm_fail(c, op, line, "%s failed: %s", call, s);
}
#define MPI_CHECK(c, op, call) mpi_check((c), (op), #call, (call), __LINE__)

// Arguments every call checks first. Returns 1 when there is nothing to communicate (size 1).
static int check_comm(const Comm *c, const char *op, int line) {
    if (c == NULL) comm_fail(NULL, op, line, "comm is NULL - expected a communicator");
    if (c->kind == COMM_SINGLE) {
        if (c->size != 1) comm_fail(c, op, line, "a COMM_SINGLE group has size %d - expected 1", c->size);
        return 1;
    }
    if (c->kind != COMM_MPI && !(c->kind == COMM_NCCL && comm_nccl_available()))
        comm_fail(c, op, line, "backend %s is not in this build - expected %s or %s%s", comm_kind_name(c->kind),
                  comm_kind_name(COMM_SINGLE), comm_kind_name(COMM_MPI), comm_nccl_available() ? " or nccl" : "");
    if (!mpi_started) comm_fail(c, op, line, "MPI is not running - expected comm_init first (or after comm_finalize)");
    return c->size == 1;
}

static void check_count(const Comm *c, const char *op, int line, const char *what, int64_t n, const void *buf) {
    if (n < 0) comm_fail(c, op, line, "%s = %lld - expected >= 0", what, (long long)n);
    if (n > 0 && buf == NULL) comm_fail(c, op, line, "buffer is NULL with %s = %lld", what, (long long)n);
}

static void check_peer(const Comm *c, const char *op, int line, const char *what, int peer) {
    if (peer < 0 || peer >= c->size)
        comm_fail(c, op, line, "%s %d - expected a rank of the group, 0 .. %d", what, peer, c->size - 1);
}

// ---------------------------------------------------------------------------- waiting, with the timeout

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void comm_set_timeout(double seconds) {
    if (!(seconds > 0) || !isfinite(seconds))
        comm_fail(NULL, "comm_set_timeout", __LINE__, "%g s - expected a finite number of seconds > 0", seconds);
    timeout_s = seconds;
}

double comm_timeout(void) { return timeout_s; }

// The world ranks of the peers of the n requests that have not completed, as " - nothing yet from world rank(s)
// 3, 5; world rank(s) 4 have not taken this rank's messages" into buf (empty when none is known): the ranks a
// stopped or dead job waits for. A pending receive names its sender; a pending send names its receiver (a large
// message waits for the receive to be posted, so a rank that stopped after its own sends went out is still
// named by the send it never took). peers[i]: the group rank of request i, expect[i] >= 0 for a receive, < 0 for
// a send (NULL: not known).
static void pending_peers(const Comm *c, int n, MPI_Request *reqs, const int *peers, const int64_t *expect, char *buf,
                          size_t size) {
    buf[0] = '\0';
    if (!peers || !expect || n <= 0) return;
    MPI_Group group, world;
    if (MPI_Comm_group(c->coll, &group) != MPI_SUCCESS || MPI_Comm_group(MPI_COMM_WORLD, &world) != MPI_SUCCESS)
        return;
    size_t at = 0;
    for (int pass = 0; pass < 2; pass++) {  // receives, then sends
        int last = -1, listed = 0;
        for (int i = 0; i < n && at + 48 < size; i++) {
            int flag = 1, peer = peers[i], wr = -1;
            if ((pass == 0) != (expect[i] >= 0) || peer == last) continue;
            if (MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) continue;  // (the job ends anyway)
            if (MPI_Group_translate_ranks(group, 1, &peer, world, &wr) != MPI_SUCCESS) wr = -1;
            const char *lead = pass == 0 ? " - nothing yet from world rank(s) " : at ? "; world rank(s) " : " - world rank(s) ";
            at += (size_t)snprintf(buf + at, size - at, "%s%d", listed ? ", " : lead, wr);
            last = peer, listed = 1;
        }
        if (pass == 1 && listed) at += (size_t)snprintf(buf + at, size - at, " have not taken this rank's messages");
    }
    MPI_Group_free(&group);
    MPI_Group_free(&world);
}

static _Noreturn void timed_out(const Comm *c, const char *op, const char *pending) {
    fprintf(stderr, "fp8moe: rank %d: %s on group %s (size %d) timed out after %g s%s - a rank of the group has not "
                    "taken part (stopped, hung, dead, or making different calls); ending the job\n",
            world_rank_now(), op, c->name, c->size, timeout_s, pending);
    end_job(COMM_EXIT_TIMEOUT);
}

// Completes the n requests (statuses into st, n of them; st may be NULL when no receive needs checking)
// or ends the job at the timeout, naming the peers it still waits for when peers and expect are given
// (pending_peers). t0: when the call began (the timeout covers the whole call).
static void wait_requests(const Comm *c, const char *op, int n, MPI_Request *reqs, MPI_Status *st, double t0,
                          const int *peers, const int64_t *expect) {
    if (n == 0) return;
    MPI_Status inline_st[8];
    MPI_Status *stat = st ? st : n <= 8 ? inline_st : malloc((size_t)n * sizeof *stat);
    if (stat == NULL) comm_fail(c, op, __LINE__, "out of memory for %d statuses", n);
    const struct timespec nap = {0, POLL_SLEEP_NS};
    for (long polls = 0;; polls++) {
        int done = 0;
        int rc = MPI_Testall(n, reqs, &done, stat);
        if (rc == MPI_ERR_IN_STATUS) {
            for (int i = 0; i < n; i++) {
                int e = stat[i].MPI_ERROR;
                if (e == MPI_SUCCESS || e == MPI_ERR_PENDING) continue;
                char s[MPI_MAX_ERROR_STRING + 8];
                mpi_error_string(e, s, sizeof s);
                comm_fail(c, op, __LINE__, "request %d of %d (peer %d) failed: %s", i, n, stat[i].MPI_SOURCE, s);
            }
        }
        MPI_CHECK(c, op, rc);
        if (done) break;
        if (now_s() - t0 > timeout_s) {
            char pending[256];
            pending_peers(c, n, reqs, peers, expect, pending, sizeof pending);
            timed_out(c, op, pending);
        }
        if (polls >= POLL_SPINS) nanosleep(&nap, NULL);
    }
    if (stat != st && stat != inline_st) free(stat);
}

// A received piece must be exactly as long as expected (a longer one already failed as MPI_ERR_TRUNCATE).
static void check_received(const Comm *c, const char *op, const MPI_Status *st, size_t expect_bytes) {
    int got = 0;
    MPI_CHECK(c, op, MPI_Get_count(st, MPI_BYTE, &got));
    if ((size_t)got != expect_bytes)
        comm_fail(c, op, __LINE__, "received %d bytes from rank %d, expected %zu - the sender and the receiver "
                                   "disagree on the size (sends and receives of a pair must match one to one)",
                  got, st->MPI_SOURCE, expect_bytes);
}

// ---------------------------------------------------------------------------- batches of messages

// The requests of one step of a collective: receives and sends in pieces of at most PIECE_BYTES, then
// one wait for all of them, then a size check of every received piece.
typedef struct {
    const Comm *comm;
    const char *op;
    int n, cap;
    MPI_Request *reqs;
    int64_t *expect;  // receives: expected bytes of the piece; sends: -1
    int *peer;        // the group rank each request talks to (named when a wait times out)
} Batch;

static void batch_grow(Batch *b) {
    if (b->n < b->cap) return;
    b->cap = b->cap ? 2 * b->cap : 16;
    b->reqs = realloc(b->reqs, (size_t)b->cap * sizeof *b->reqs);
    b->expect = realloc(b->expect, (size_t)b->cap * sizeof *b->expect);
    b->peer = realloc(b->peer, (size_t)b->cap * sizeof *b->peer);
    if (b->reqs == NULL || b->expect == NULL || b->peer == NULL) comm_fail(b->comm, b->op, __LINE__, "out of memory for %d requests", b->cap);
}

// A zero-byte message is still one message: it keeps the pair's sequence of messages matched.
static void batch_send(Batch *b, const void *buf, size_t bytes, int peer, int tag) {
    size_t off = 0;
    do {
        const size_t piece = bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES;
        batch_grow(b);
        MPI_CHECK(b->comm, b->op, MPI_Isend((const char *)buf + off, (int)piece, MPI_BYTE, peer, tag, b->comm->coll,
                                            &b->reqs[b->n]));
        b->peer[b->n] = peer;
        b->expect[b->n++] = -1;
        off += piece;
    } while (off < bytes);
}

static void batch_recv(Batch *b, void *buf, size_t bytes, int peer, int tag) {
    size_t off = 0;
    do {
        const size_t piece = bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES;
        batch_grow(b);
        MPI_CHECK(b->comm, b->op, MPI_Irecv((char *)buf + off, (int)piece, MPI_BYTE, peer, tag, b->comm->coll,
                                            &b->reqs[b->n]));
        b->peer[b->n] = peer;
        b->expect[b->n++] = (int64_t)piece;
        off += piece;
    } while (off < bytes);
}

static void batch_wait(Batch *b, double t0) {
    if (b->n == 0) return;
    MPI_Status *st = malloc((size_t)b->n * sizeof *st);
    if (st == NULL) comm_fail(b->comm, b->op, __LINE__, "out of memory for %d statuses", b->n);
    wait_requests(b->comm, b->op, b->n, b->reqs, st, t0, b->peer, b->expect);
    for (int i = 0; i < b->n; i++)
        if (b->expect[i] >= 0) check_received(b->comm, b->op, &st[i], (size_t)b->expect[i]);
    free(st);
    b->n = 0;
}

static void batch_free(Batch *b) {
    free(b->reqs);
    free(b->expect);
    free(b->peer);
    memset(b, 0, sizeof *b);
}

static void *scratch(Comm *c, const char *op, size_t bytes) {
    if (bytes > c->scratch_bytes) {
        free(c->scratch);
        c->scratch = malloc(bytes);
        if (c->scratch == NULL) comm_fail(c, op, __LINE__, "out of memory for a %zu-byte reduction buffer", bytes);
        c->scratch_bytes = bytes;
    }
    return c->scratch;
}

// ---------------------------------------------------------------------------- device staging

// The memory a call's buffers are in: a buffer of 0 elements (or NULL) does not count; two non-empty buffers
// on different devices are refused. Called at size > 1 only (and by the size-1 copies), so that one process
// asks nothing of the CUDA runtime.
static Device buffers_device(const Comm *c, const char *op, int line, const void *a, int64_t a_n, const void *b,
                             int64_t b_n) {
    const int has_a = a != NULL && a_n > 0, has_b = b != NULL && b_n > 0;
    const Device da = has_a ? device_of_pointer(a) : DEVICE_CPU;
    const Device db = has_b ? device_of_pointer(b) : da;
    if (has_a && has_b && da != db)
        comm_fail(c, op, line, "the send buffer is %s memory and the receive buffer %s memory - expected both on "
                  "the same device", device_name(da), device_name(db));
    return has_a ? da : db;
}

// Whether a call goes through NCCL (parallel/comm_nccl.c): a COMM_NCCL group that uses it (size > 1, or a test's) and
// device buffers, or none at all on this rank (an empty block must still take part in the NCCL exchange; comm.h).
static int nccl_path(const Comm *c, const char *op, int line, const void *a, int64_t a_n, const void *b, int64_t b_n) {
    if (!comm_nccl_takes(c)) return 0;
    if ((a == NULL || a_n <= 0) && (b == NULL || b_n <= 0)) return 1;
    return buffers_device(c, op, line, a, a_n, b, b_n) == DEVICE_CUDA;
}

// The Comm's pinned host buffer of at least `bytes` (kept: pinned allocations are slow).
static void *pinned(Comm *c, size_t bytes) {
    if (bytes > c->pinned_bytes) {
        device_host_free(DEVICE_CUDA, c->pinned);
        c->pinned = NULL;
        c->pinned_bytes = 0;
        c->pinned = device_host_alloc(DEVICE_CUDA, bytes);
        c->pinned_bytes = bytes;
    }
    return c->pinned;
}

static void to_host(void *host, const void *dev, size_t bytes) { device_memcpy_to_host(DEVICE_CUDA, host, dev, bytes); }
static void to_device(void *dev, const void *host, size_t bytes) { device_memcpy_from_host(DEVICE_CUDA, dev, host, bytes); }

// At size 1: dst = src (count bytes) on their device, the out-of-place calls' one copy. src == dst copies nothing.
static void local_copy(const Comm *c, const char *op, int line, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    if (buffers_device(c, op, line, src, (int64_t)bytes, dst, (int64_t)bytes) == DEVICE_CUDA)
        device_memcpy(DEVICE_CUDA, dst, src, bytes);
    else
        memmove(dst, src, bytes);
}

// ---------------------------------------------------------------------------- set-up and groups

// A new MPI group c->mpi gets errors returned, its rank and size, and the duplicate its collectives use.
static void finish_group(Comm *c, const char *op) {
    c->size = 1;  // until known, for messages
    MPI_CHECK(c, op, MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN));
    MPI_CHECK(c, op, MPI_Comm_rank(c->mpi, &c->rank));
    MPI_CHECK(c, op, MPI_Comm_size(c->mpi, &c->size));
    MPI_Request req;
    MPI_CHECK(c, op, MPI_Comm_idup(c->mpi, &c->coll, &req));
    wait_requests(c, op, 1, &req, NULL, now_s(), NULL, NULL);
    MPI_CHECK(c, op, MPI_Comm_set_errhandler(c->coll, MPI_ERRORS_RETURN));
}

static void check_name(const Comm *parent, const char *op, const char *name) {
    if (name == NULL || name[0] == 0 || strlen(name) >= COMM_NAME_MAX)
        comm_fail(parent, op, __LINE__, "name \"%s\" - expected 1 to %d characters", name ? name : "(null)",
                  COMM_NAME_MAX - 1);
}

void comm_init(int *argc, char ***argv) {
    const char *op = "comm_init";
    int already = 0;
    MPI_Initialized(&already);
    if (already || mpi_started) comm_fail(NULL, op, __LINE__, "MPI is already initialised - expected one comm_init per process");
    int provided = 0;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING + 8];
        mpi_error_string(rc, s, sizeof s);
        fprintf(stderr, "fp8moe: comm_init: MPI_Init_thread failed: %s\n", s);
        exit(COMM_EXIT_ERROR);
    }
    mpi_started = 1;
    memset(&world_mpi, 0, sizeof world_mpi);
    world_mpi.kind = COMM_MPI;
    snprintf(world_mpi.name, sizeof world_mpi.name, "world");
    world_mpi.mpi = MPI_COMM_WORLD;
    world_mpi.coll = MPI_COMM_NULL;
    finish_group(&world_mpi, op);
    world_mpi.world_rank = world_mpi.rank;
    if (provided < MPI_THREAD_FUNNELED)
        comm_fail(&world_mpi, op, __LINE__, "MPI gives thread level %d - expected at least MPI_THREAD_FUNNELED (%d)",
                  provided, MPI_THREAD_FUNNELED);
}

void comm_finalize(void) {
    if (!mpi_started) return;
    const char *op = "comm_finalize";
    MPI_CHECK(&world_mpi, op, MPI_Comm_free(&world_mpi.coll));
    free(world_mpi.scratch);
    world_mpi.scratch = NULL;
    world_mpi.scratch_bytes = 0;
    device_host_free(DEVICE_CUDA, world_mpi.pinned);  // NULL unless device buffers were staged
    world_mpi.pinned = NULL;
    world_mpi.pinned_bytes = 0;
    int rc = MPI_Finalize();
    mpi_started = 0;
    if (rc != MPI_SUCCESS) {
        char s[MPI_MAX_ERROR_STRING + 8];
        mpi_error_string(rc, s, sizeof s);
        fprintf(stderr, "fp8moe: rank %d: comm_finalize: MPI_Finalize failed: %s\n", world_mpi.rank, s);
        exit(COMM_EXIT_ERROR);
    }
}

Comm *comm_split(Comm *parent, int color, int key, const char *name) {
    const char *op = "comm_split";
    check_comm(parent, op, __LINE__);
    check_name(parent, op, name);
    if (color < 0 && color != COMM_UNDEFINED)
        comm_fail(parent, op, __LINE__, "color %d - expected >= 0 or COMM_UNDEFINED", color);
    Comm *c = calloc(1, sizeof *c);
    if (c == NULL) comm_fail(parent, op, __LINE__, "out of memory");
    snprintf(c->name, sizeof c->name, "%s", name);
    c->kind = parent->kind;
    c->world_rank = parent->world_rank;
    if (parent->kind == COMM_SINGLE) {
        if (color == COMM_UNDEFINED) {
            free(c);
            return NULL;
        }
        c->size = 1;
        return c;
    }
    // MPI_Comm_split has no nonblocking form: a timed barrier first makes sure every rank has arrived, so a
    // missing rank ends the job by the timeout instead of hanging the split.
    comm_barrier(parent);
    MPI_Comm m = MPI_COMM_NULL;
    MPI_CHECK(parent, op, MPI_Comm_split(parent->mpi, color == COMM_UNDEFINED ? MPI_UNDEFINED : color, key, &m));
    if (m == MPI_COMM_NULL) {
        free(c);
        return NULL;
    }
    c->mpi = m;
    finish_group(c, op);
    if (c->kind == COMM_NCCL) comm_nccl_attach(c, op);  // an NCCL communicator of the new group's ranks
    return c;
}

Comm *comm_split_host(Comm *parent, const char *name) {
    const char *op = "comm_split_host";
    check_comm(parent, op, __LINE__);
    if (parent->kind == COMM_SINGLE) return comm_split(parent, 0, 0, name);
    check_name(parent, op, name);
    Comm *c = calloc(1, sizeof *c);
    if (c == NULL) comm_fail(parent, op, __LINE__, "out of memory");
    snprintf(c->name, sizeof c->name, "%s", name);
    c->kind = COMM_MPI;
    c->world_rank = parent->world_rank;
    comm_barrier(parent);  // as in comm_split: the split itself cannot time out
    MPI_CHECK(parent, op, MPI_Comm_split_type(parent->mpi, MPI_COMM_TYPE_SHARED, parent->rank, MPI_INFO_NULL, &c->mpi));
    finish_group(c, op);
    return c;
}

void comm_set_limits_for_tests(size_t piece_bytes, size_t round_bytes) {
    if (piece_bytes > DEFAULT_PIECE_BYTES || round_bytes > ((size_t)1 << 40))
        comm_fail(NULL, "comm_set_limits_for_tests", __LINE__, "piece %zu bytes, round %zu bytes - expected a piece of "
                  "at most %zu bytes (an int count)", piece_bytes, round_bytes, DEFAULT_PIECE_BYTES);
    PIECE_BYTES = piece_bytes ? piece_bytes : DEFAULT_PIECE_BYTES;
    ROUND_BYTES = round_bytes ? round_bytes : DEFAULT_ROUND_BYTES;
    comm_nccl_set_round_bytes(round_bytes);
}

void comm_free(Comm *c) {
    if (c == NULL) return;
    if (c == &world_mpi || c == &world_single) comm_fail(c, "comm_free", __LINE__, "the world cannot be freed");
    if (c->kind == COMM_NCCL && mpi_started) comm_nccl_detach(c);
    if ((c->kind == COMM_MPI || c->kind == COMM_NCCL) && mpi_started) {
        MPI_CHECK(c, "comm_free", MPI_Comm_free(&c->coll));
        MPI_CHECK(c, "comm_free", MPI_Comm_free(&c->mpi));
    }
    free(c->scratch);
    device_host_free(DEVICE_CUDA, c->pinned);
    free(c);
}

// ---------------------------------------------------------------------------- reductions

typedef enum { RED_SUM, RED_MAX, RED_MIN } RedOp;
typedef enum { TY_DOUBLE, TY_FLOAT, TY_I64 } RedType;
#define TY_REAL (sizeof(real) == sizeof(double) ? TY_DOUBLE : TY_FLOAT)
_Static_assert(TY_DOUBLE == 0 && TY_FLOAT == 1 && TY_I64 == 2 && RED_SUM == 0 && RED_MAX == 1 && RED_MIN == 2,
               "comm_nccl.h's type and operation codes (kernels/cuda/comm_reduce.h)");

static size_t type_bytes(RedType t) { return t == TY_FLOAT ? sizeof(float) : 8; }

// NaN wins, so that a non-finite value on any rank is seen by all.
static double max_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : (b > a ? b : a); }
static double min_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : (b < a ? b : a); }

// out (n) = slot 0 (op) slot 1 (op) ... (op) slot P-1, element by element, left to right: out starts as slot
// 0 and takes each later slot in turn, which is the rank order exactly (each element sees the same sequence
// of operations as ((x_0 + x_1) + x_2) + ...). The slots are `stride` elements apart.
static void combine_slots(RedType t, RedOp o, void *out, const void *slots, int P, int64_t stride, int64_t n) {
    switch (t) {
    case TY_DOUBLE: {
        double *y = out;
        const double *s = slots;
        memcpy(y, s, (size_t)n * sizeof *y);
        for (int r = 1; r < P; r++) {
            const double *x = s + (int64_t)r * stride;
            if (o == RED_SUM) for (int64_t i = 0; i < n; i++) y[i] = y[i] + x[i];
            else if (o == RED_MAX) for (int64_t i = 0; i < n; i++) y[i] = max_nan(y[i], x[i]);
            else for (int64_t i = 0; i < n; i++) y[i] = min_nan(y[i], x[i]);
        }
        break;
    }
    case TY_FLOAT: {
        float *y = out;
        const float *s = slots;
        memcpy(y, s, (size_t)n * sizeof *y);
        for (int r = 1; r < P; r++) {
            const float *x = s + (int64_t)r * stride;
            for (int64_t i = 0; i < n; i++) y[i] = y[i] + x[i];  // only sums are asked of floats
        }
        break;
    }
    case TY_I64: {
        // in uint64: wraps modulo 2^64 instead of the undefined behaviour of signed overflow
        uint64_t *y = out;
        const uint64_t *s = slots;
        memcpy(y, s, (size_t)n * sizeof *y);
        for (int r = 1; r < P; r++) {
            const uint64_t *x = s + (int64_t)r * stride;
            for (int64_t i = 0; i < n; i++) y[i] = y[i] + x[i];
        }
        break;
    }
    }
}

// The engine of every reduction: send holds block b (counts[b] elements at displacement d[b]) for every rank b;
// rank b receives every rank's block b and combines them in rank order into recv. In rounds of at most `piece`
// elements per block, so the owner's buffer (P slots of a piece) stays near ROUND_BYTES whatever the counts.
// recv may alias send + d[rank]: each round copies this rank's own piece into its slot before writing recv.
static void reduce_scatter_core(Comm *c, const char *op, RedType t, RedOp o, const void *send, void *recv,
                                const int64_t *counts, const int64_t *d, double t0) {
    const int P = c->size, me = c->rank;
    const size_t es = type_bytes(t);
    int64_t piece = (int64_t)(ROUND_BYTES / es / (size_t)P);
    if (piece < 1) piece = 1;
    int64_t most = 0;
    for (int b = 0; b < P; b++) most = counts[b] > most ? counts[b] : most;
    char *slots = scratch(c, op, (size_t)P * (size_t)(most < piece ? most : piece) * es);
    const int64_t stride = most < piece ? most : piece;
    Batch batch = {.comm = c, .op = op};
    for (int64_t off = 0; off < most; off += piece) {
        int64_t mine = counts[me] - off;
        mine = mine < 0 ? 0 : mine > piece ? piece : mine;
        for (int r = 0; r < P && mine > 0; r++)
            if (r != me) batch_recv(&batch, slots + (size_t)r * (size_t)stride * es, (size_t)mine * es, r, TAG_REDUCE);
        for (int b = 0; b < P; b++) {
            int64_t len = counts[b] - off;
            if (b == me || len <= 0) continue;
            len = len > piece ? piece : len;
            batch_send(&batch, (const char *)send + (size_t)(d[b] + off) * es, (size_t)len * es, b, TAG_REDUCE);
        }
        if (mine > 0)
            memcpy(slots + (size_t)me * (size_t)stride * es, (const char *)send + (size_t)(d[me] + off) * es,
                   (size_t)mine * es);
        batch_wait(&batch, t0);
        if (mine > 0) combine_slots(t, o, (char *)recv + (size_t)off * es, slots, P, stride, mine);
    }
    batch_free(&batch);
}

// recv's block b (counts[b] elements at d[b]) = rank b's send. send may be recv + d[rank] (in place).
static void allgather_core(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                           const int64_t *d, double t0) {
    const int P = c->size, me = c->rank;
    char *own = (char *)recv + (size_t)d[me] * es;
    if ((const char *)send != own) memmove(own, send, (size_t)counts[me] * es);
    Batch batch = {.comm = c, .op = op};
    for (int r = 0; r < P; r++)
        if (r != me && counts[r] > 0) batch_recv(&batch, (char *)recv + (size_t)d[r] * es, (size_t)counts[r] * es, r, TAG_GATHER);
    for (int r = 0; r < P; r++)
        if (r != me && counts[me] > 0) batch_send(&batch, own, (size_t)counts[me] * es, r, TAG_GATHER);
    batch_wait(&batch, t0);
    batch_free(&batch);
}

// counts/displacements of the group for n elements split into P near-equal blocks (the first n % P one longer).
static int64_t *even_blocks(const Comm *c, const char *op, int64_t n, int64_t **d_out) {
    int64_t *counts = malloc(2 * (size_t)c->size * sizeof *counts);
    if (counts == NULL) comm_fail(c, op, __LINE__, "out of memory");
    for (int b = 0; b < c->size; b++) counts[b] = n / c->size + (b < n % c->size);
    *d_out = counts + c->size;
    comm_displacements(counts, c->size, *d_out);
    return counts;
}

// In place, x in host memory: reduce-scatter into this rank's block of x, then all-gather the blocks.
static void allreduce_host(Comm *c, const char *op, RedType t, RedOp o, void *x, int64_t n, double t0) {
    int64_t *d;
    int64_t *counts = even_blocks(c, op, n, &d);
    char *own = (char *)x + (size_t)d[c->rank] * type_bytes(t);
    reduce_scatter_core(c, op, t, o, x, own, counts, d, t0);
    allgather_core(c, op, type_bytes(t), own, x, counts, d, t0);
    free(counts);
}

// Elements a staged round moves per buffer: ROUND_BYTES' worth, at least one per rank.
static int64_t stage_elems(const Comm *c, size_t es) {
    const int64_t n = (int64_t)(ROUND_BYTES / es);
    return n > c->size ? n : c->size;
}

// x on the device: in rounds of stage_elems, each round an all-reduce of its own over pinned memory. The sum of
// each element is the same rank-order sum, whichever round and block it falls in.
static void allreduce_device(Comm *c, const char *op, RedType t, RedOp o, void *x, int64_t n, double t0) {
    const size_t es = type_bytes(t);
    const int64_t chunk = stage_elems(c, es);
    char *h = pinned(c, (size_t)(n < chunk ? n : chunk) * es);
    for (int64_t off = 0; off < n; off += chunk) {
        const int64_t len = n - off < chunk ? n - off : chunk;
        char *xd = (char *)x + (size_t)off * es;
        to_host(h, xd, (size_t)len * es);
        allreduce_host(c, op, t, o, h, len, t0);
        to_device(xd, h, (size_t)len * es);
    }
}

static void allreduce(Comm *c, const char *op, RedType t, RedOp o, void *x, int64_t n) {
    const double t0 = now_s();
    if (buffers_device(c, op, __LINE__, x, n, NULL, 0) == DEVICE_CUDA) allreduce_device(c, op, t, o, x, n, t0);
    else allreduce_host(c, op, t, o, x, n, t0);
}

#define ALLREDUCE(fn, T, ty, red)                                                                   \
    void fn(Comm *comm, T *x, int64_t n) {                                                          \
        const int single = check_comm(comm, #fn, __LINE__);                                         \
        check_count(comm, #fn, __LINE__, "n", n, x);                                                \
        if (nccl_path(comm, #fn, __LINE__, x, n, NULL, 0)) comm_nccl_allreduce(comm, #fn, ty, red, x, n); \
        else if (!single) allreduce(comm, #fn, ty, red, x, n);                                      \
    }
ALLREDUCE(comm_allreduce_sum_double, double, TY_DOUBLE, RED_SUM)
ALLREDUCE(comm_allreduce_sum_i64, int64_t, TY_I64, RED_SUM)
ALLREDUCE(comm_allreduce_sum_real, real, TY_REAL, RED_SUM)
ALLREDUCE(comm_allreduce_max_double, double, TY_DOUBLE, RED_MAX)
ALLREDUCE(comm_allreduce_min_double, double, TY_DOUBLE, RED_MIN)

int64_t comm_displacements(const int64_t *counts, int n, int64_t *displacements) {
    int64_t total = 0;
    for (int r = 0; r < n; r++) {
        displacements[r] = total;
        total += counts[r];
    }
    return total;
}

static int64_t *checked_displacements(const Comm *c, const char *op, const int64_t *counts, const char *what) {
    if (counts == NULL) comm_fail(c, op, __LINE__, "%s is NULL - expected %d entries", what, c->size);
    int64_t *d = malloc((size_t)c->size * sizeof *d);
    if (d == NULL) comm_fail(c, op, __LINE__, "out of memory");
    for (int r = 0; r < c->size; r++)
        if (counts[r] < 0) comm_fail(c, op, __LINE__, "%s[%d] = %lld - expected >= 0", what, r, (long long)counts[r]);
    comm_displacements(counts, c->size, d);
    return d;
}

// Staged rounds of a reduce-scatter or an all-gather: round k moves elements [k piece, (k+1) piece) of every
// block; sub (size entries) gets the round's block lengths and sub_d their packed displacements. Every rank
// computes the same rounds (counts are the same on every rank). staged_piece returns the piece (elements of each
// block per round) and the longest block in *most.
static int64_t staged_piece(const Comm *c, size_t es, const int64_t *counts, int64_t *most) {
    int64_t piece = stage_elems(c, es) / c->size;
    *most = 0;
    for (int b = 0; b < c->size; b++) *most = counts[b] > *most ? counts[b] : *most;
    return piece < *most ? piece : (*most > 0 ? *most : 1);
}

static void staged_round(const Comm *c, const int64_t *counts, int64_t off, int64_t piece, int64_t *sub, int64_t *sub_d) {
    for (int b = 0; b < c->size; b++) {
        const int64_t len = counts[b] - off;
        sub[b] = len < 0 ? 0 : len > piece ? piece : len;
    }
    comm_displacements(sub, c->size, sub_d);
}

// reduce_scatter_core for device send/recv. Each round copies every block's piece into pinned memory (one copy
// when all blocks fit one round: the packed layout is then send's own), reduces, and copies this rank's piece of
// the result back. In place (recv = send + d[rank]) is safe: a round reads its piece of send before it writes
// the same piece of recv.
static void reduce_scatter_device(Comm *c, const char *op, const real *send, real *recv, const int64_t *counts,
                                  const int64_t *d, double t0) {
    const int P = c->size, me = c->rank;
    const size_t es = sizeof(real);
    int64_t most;
    const int64_t piece = staged_piece(c, es, counts, &most);
    int64_t *sub = malloc(2 * (size_t)P * sizeof *sub);
    if (sub == NULL) comm_fail(c, op, __LINE__, "out of memory");
    int64_t *sub_d = sub + P;
    real *h = pinned(c, (size_t)(P + 1) * (size_t)piece * es), *result = h + (size_t)P * (size_t)piece;
    for (int64_t off = 0; off < most; off += piece) {
        staged_round(c, counts, off, piece, sub, sub_d);
        if (most <= piece) {
            to_host(h, send, (size_t)(sub_d[P - 1] + sub[P - 1]) * es);
        } else {
            for (int b = 0; b < P; b++)
                if (sub[b] > 0) to_host(h + sub_d[b], send + d[b] + off, (size_t)sub[b] * es);
        }
        reduce_scatter_core(c, op, TY_REAL, RED_SUM, h, result, sub, sub_d, t0);
        if (sub[me] > 0) to_device(recv + off, result, (size_t)sub[me] * es);
    }
    free(sub);
}

// allgather_core for device send/recv (es bytes per element): each round gathers every block's piece in pinned
// memory, in place there, and copies the pieces to recv (one copy when all blocks fit one round). In place
// (send = recv + d[rank]) is safe: a round reads its piece of send before it writes recv.
static void allgather_device(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                             const int64_t *d, double t0) {
    const int P = c->size, me = c->rank;
    int64_t most;
    const int64_t piece = staged_piece(c, es, counts, &most);
    int64_t *sub = malloc(2 * (size_t)P * sizeof *sub);
    if (sub == NULL) comm_fail(c, op, __LINE__, "out of memory");
    int64_t *sub_d = sub + P;
    char *h = pinned(c, (size_t)P * (size_t)piece * es);
    for (int64_t off = 0; off < most; off += piece) {
        staged_round(c, counts, off, piece, sub, sub_d);
        char *own = h + (size_t)sub_d[me] * es;
        if (sub[me] > 0) to_host(own, (const char *)send + (size_t)off * es, (size_t)sub[me] * es);
        allgather_core(c, op, es, own, h, sub, sub_d, t0);
        if (most <= piece) {
            to_device(recv, h, (size_t)(sub_d[P - 1] + sub[P - 1]) * es);
        } else {
            for (int b = 0; b < P; b++)
                if (sub[b] > 0) to_device((char *)recv + (size_t)(d[b] + off) * es, h + (size_t)sub_d[b] * es,
                                          (size_t)sub[b] * es);
        }
    }
    free(sub);
}

// allgather_core on host or device buffers
static void allgather_any(Comm *c, const char *op, size_t es, const void *send, void *recv, const int64_t *counts,
                          const int64_t *d, double t0) {
    const int64_t total = d[c->size - 1] + counts[c->size - 1];
    if (buffers_device(c, op, __LINE__, send, counts[c->rank], recv, total) == DEVICE_CUDA)
        allgather_device(c, op, es, send, recv, counts, d, t0);
    else
        allgather_core(c, op, es, send, recv, counts, d, t0);
}

void comm_reduce_scatter_sum_real(Comm *comm, const real *send, real *recv, const int64_t *counts) {
    const char *op = "comm_reduce_scatter_sum_real";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    int64_t *d = checked_displacements(comm, op, counts, "counts");
    check_count(comm, op, __LINE__, "the sum of counts", d[comm->size - 1] + counts[comm->size - 1], send);
    check_count(comm, op, __LINE__, "counts[rank]", counts[comm->rank], recv);
    const int P = comm->size;
    if (nccl_path(comm, op, __LINE__, send, d[P - 1] + counts[P - 1], recv, counts[comm->rank])) {
        comm_nccl_reduce_scatter(comm, op, send, recv, counts, d);
    } else if (single) {
        local_copy(comm, op, __LINE__, recv, send, (size_t)counts[0] * sizeof *recv);
    } else if (buffers_device(comm, op, __LINE__, send, d[P - 1] + counts[P - 1], recv, counts[comm->rank]) ==
               DEVICE_CUDA) {
        reduce_scatter_device(comm, op, send, recv, counts, d, t0);
    } else {
        reduce_scatter_core(comm, op, TY_REAL, RED_SUM, send, recv, counts, d, t0);
    }
    free(d);
}

// counts of `block` elements for every rank of the group
static int64_t *block_counts(const Comm *c, const char *op, int64_t block) {
    if (c == NULL) comm_fail(NULL, op, __LINE__, "comm is NULL - expected a communicator");
    if (block < 0) comm_fail(c, op, __LINE__, "block = %lld - expected >= 0", (long long)block);
    int64_t *counts = malloc((size_t)c->size * sizeof *counts);
    if (counts == NULL) comm_fail(c, op, __LINE__, "out of memory");
    for (int r = 0; r < c->size; r++) counts[r] = block;
    return counts;
}

void comm_reduce_scatter_block_sum_real(Comm *comm, const real *send, real *recv, int64_t block) {
    int64_t *counts = block_counts(comm, "comm_reduce_scatter_block_sum_real", block);
    comm_reduce_scatter_sum_real(comm, send, recv, counts);
    free(counts);
}

void comm_allgather_real(Comm *comm, const real *send, real *recv, const int64_t *counts) {
    const char *op = "comm_allgather_real";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    int64_t *d = checked_displacements(comm, op, counts, "counts");
    check_count(comm, op, __LINE__, "the sum of counts", d[comm->size - 1] + counts[comm->size - 1], recv);
    check_count(comm, op, __LINE__, "counts[rank]", counts[comm->rank], send);
    if (nccl_path(comm, op, __LINE__, send, counts[comm->rank], recv, d[comm->size - 1] + counts[comm->size - 1]))
        comm_nccl_allgather(comm, op, sizeof(real), send, recv, counts, d);
    else if (single) local_copy(comm, op, __LINE__, recv, send, (size_t)counts[0] * sizeof *recv);
    else allgather_any(comm, op, sizeof(real), send, recv, counts, d, t0);
    free(d);
}

void comm_allgather_block_real(Comm *comm, const real *send, real *recv, int64_t block) {
    int64_t *counts = block_counts(comm, "comm_allgather_block_real", block);
    comm_allgather_real(comm, send, recv, counts);
    free(counts);
}

void comm_allgather_bytes(Comm *comm, const void *send, void *recv, size_t bytes) {
    const char *op = "comm_allgather_bytes";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    check_count(comm, op, __LINE__, "bytes", (int64_t)bytes, send);
    check_count(comm, op, __LINE__, "bytes", (int64_t)bytes, recv);
    const int nccl = nccl_path(comm, op, __LINE__, send, (int64_t)bytes, recv, (int64_t)bytes * comm->size);
    if (single && !nccl) {
        local_copy(comm, op, __LINE__, recv, send, bytes);
        return;
    }
    int64_t *counts = block_counts(comm, op, (int64_t)bytes);
    int64_t *d = checked_displacements(comm, op, counts, "counts");
    if (nccl) comm_nccl_allgather(comm, op, 1, send, recv, counts, d);
    else allgather_any(comm, op, 1, send, recv, counts, d, t0);
    free(d);
    free(counts);
}

// ---------------------------------------------------------------------------- all-to-all

void comm_alltoall_counts(Comm *comm, const int64_t *send_counts, int64_t *recv_counts) {
    const char *op = "comm_alltoall_counts";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    if (send_counts == NULL || recv_counts == NULL)
        comm_fail(comm, op, __LINE__, "send_counts or recv_counts is NULL - expected %d entries each", comm->size);
    if (single) {
        recv_counts[0] = send_counts[0];
        return;
    }
    // point-to-point messages rather than MPI_Ialltoall, so that a timeout names the ranks not heard from
    const int P = comm->size, me = comm->rank;
    recv_counts[me] = send_counts[me];
    Batch batch = {.comm = comm, .op = op};
    for (int k = 1; k < P; k++) {
        const int r = (me + P - k) % P;
        batch_recv(&batch, &recv_counts[r], sizeof *recv_counts, r, TAG_COUNTS);
    }
    for (int k = 1; k < P; k++) {
        const int r = (me + k) % P;
        batch_send(&batch, &send_counts[r], sizeof *send_counts, r, TAG_COUNTS);
    }
    batch_wait(&batch, t0);
    batch_free(&batch);
}

// The messages of an all-to-all-v between this rank and its peers (the own block is the caller's).
static void alltoallv_peers(Comm *comm, const char *op, const void *send, const int64_t *send_bytes, const int64_t *sd,
                            void *recv, const int64_t *recv_bytes, const int64_t *rd, double t0) {
    const int P = comm->size, me = comm->rank;
    // every pair exchanges one message even when it is empty, so that a disagreement on a size is a
    // receive of the wrong length (reported) and never a message left over for a later call
    Batch batch = {.comm = comm, .op = op};
    for (int k = 1; k < P; k++) {
        const int r = (me + P - k) % P;  // receive from me-1, me-2, ...: spreads the load over the peers
        batch_recv(&batch, (char *)recv + rd[r], (size_t)recv_bytes[r], r, TAG_ALLTOALL);
    }
    for (int k = 1; k < P; k++) {
        const int r = (me + k) % P;
        batch_send(&batch, (const char *)send + sd[r], (size_t)send_bytes[r], r, TAG_ALLTOALL);
    }
    batch_wait(&batch, t0);
    batch_free(&batch);
}

void comm_alltoallv_bytes(Comm *comm, const void *send, const int64_t *send_bytes, void *recv,
                          const int64_t *recv_bytes) {
    const char *op = "comm_alltoallv_bytes";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    int64_t *sd = checked_displacements(comm, op, send_bytes, "send_bytes");
    int64_t *rd = checked_displacements(comm, op, recv_bytes, "recv_bytes");
    const int P = comm->size, me = comm->rank;
    check_count(comm, op, __LINE__, "the sum of send_bytes", sd[P - 1] + send_bytes[P - 1], send);
    check_count(comm, op, __LINE__, "the sum of recv_bytes", rd[P - 1] + recv_bytes[P - 1], recv);
    if (send_bytes[me] != recv_bytes[me])
        comm_fail(comm, op, __LINE__, "send_bytes[%d] = %lld but recv_bytes[%d] = %lld - expected the same (this "
                                      "rank's block to itself)", me, (long long)send_bytes[me], me,
                  (long long)recv_bytes[me]);
    const int64_t total_send = sd[P - 1] + send_bytes[P - 1], total_recv = rd[P - 1] + recv_bytes[P - 1];
    if (nccl_path(comm, op, __LINE__, send, total_send, recv, total_recv)) {  // the own block too: through NCCL
        comm_nccl_alltoallv(comm, op, send, send_bytes, sd, recv, recv_bytes, rd);
        free(sd);
        free(rd);
        return;
    }
    const Device dev = buffers_device(comm, op, __LINE__, send, total_send, recv, total_recv);
    if (send_bytes[me] > 0)  // this rank's block to itself never leaves its device
        device_memcpy(dev, (char *)recv + rd[me], (const char *)send + sd[me], (size_t)send_bytes[me]);
    if (!single) {
        if (dev == DEVICE_CUDA) {
            // the whole exchange through pinned memory: send, then recv, in one buffer; the own block stays out
            char *hs = pinned(comm, (size_t)(total_send + total_recv)), *hr = hs + total_send;
            to_host(hs, send, (size_t)total_send);
            alltoallv_peers(comm, op, hs, send_bytes, sd, hr, recv_bytes, rd, t0);
            to_device(recv, hr, (size_t)rd[me]);
            const int64_t after = rd[me] + recv_bytes[me];
            to_device((char *)recv + after, hr + after, (size_t)(total_recv - after));
        } else {
            alltoallv_peers(comm, op, send, send_bytes, sd, recv, recv_bytes, rd, t0);
        }
    }
    free(sd);
    free(rd);
}

// ---------------------------------------------------------------------------- point to point

// blocking: the call waits before it returns (comm_send/recv_bytes), so a device buffer may be staged in the
// Comm's pinned buffer; a nonblocking request gets a pinned buffer of its own, freed by the wait.
static void request_post(Comm *comm, const char *op, void *buf, size_t bytes, int peer, int tag, CommRequest *req,
                         int is_send, int blocking) {
    if (req == NULL) comm_fail(comm, op, __LINE__, "req is NULL - expected a CommRequest to fill");
    memset(req, 0, sizeof *req);
    if (check_comm(comm, op, __LINE__) && comm->kind == COMM_SINGLE)
        comm_fail(comm, op, __LINE__, "a single-process group has no peer to %s", is_send ? "send to" : "receive from");
    check_count(comm, op, __LINE__, "bytes", (int64_t)bytes, buf);
    check_peer(comm, op, __LINE__, is_send ? "dest" : "src", peer);
    if (tag < 0 || tag > COMM_TAG_MAX) comm_fail(comm, op, __LINE__, "tag %d - expected 0 .. %d", tag, COMM_TAG_MAX);
    if (nccl_path(comm, op, __LINE__, buf, (int64_t)bytes, NULL, 0)) {  // queued; launched by a wait (comm_nccl.c)
        comm_nccl_post(comm, op, buf, bytes, peer, tag, req, is_send);
        return;
    }
    const size_t pieces = bytes == 0 ? 1 : (bytes + PIECE_BYTES - 1) / PIECE_BYTES;
    if (pieces > INT_MAX) comm_fail(comm, op, __LINE__, "%zu bytes is too many pieces", bytes);
    req->comm = comm;
    req->op = op;
    req->peer = peer;
    req->tag = tag;
    req->bytes = bytes;
    req->is_send = is_send;
    req->reqs = pieces <= 2 ? req->inline_reqs : malloc(pieces * sizeof *req->reqs);
    if (req->reqs == NULL) comm_fail(comm, op, __LINE__, "out of memory for %zu requests", pieces);
    if (bytes > 0 && buffers_device(comm, op, __LINE__, buf, (int64_t)bytes, NULL, 0) == DEVICE_CUDA) {
        // a send's bytes are copied to pinned memory now; a receive's from it in the wait
        req->owns_staged = !blocking;
        req->staged = blocking ? pinned(comm, bytes) : device_host_alloc(DEVICE_CUDA, bytes);
        if (is_send) to_host(req->staged, buf, bytes);
        else req->device_dst = buf;
        buf = req->staged;
    }
    for (size_t i = 0; i < pieces; i++) {
        const size_t off = i * PIECE_BYTES, len = bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES;
        if (is_send)
            MPI_CHECK(comm, op, MPI_Isend((char *)buf + off, (int)len, MPI_BYTE, peer, tag, comm->mpi, &req->reqs[i]));
        else
            MPI_CHECK(comm, op, MPI_Irecv((char *)buf + off, (int)len, MPI_BYTE, peer, tag, comm->mpi, &req->reqs[i]));
        req->n = (int)i + 1;
    }
}

static void request_wait(CommRequest *req, double t0) {
    if (req == NULL) comm_fail(NULL, "comm_wait", __LINE__, "req is NULL - expected a CommRequest");
    if (req->nccl_ticket != 0) {
        comm_nccl_wait(req);
        return;
    }
    if (req->n == 0) return;
    Comm *c = req->comm;
    // one or two pieces (messages up to 2 GiB) on the stack: a pipeline step waits for many messages
    // (initialised: the GPU machine's GCC 13.3 cannot see that the loop below fills them whenever they are used)
    MPI_Status st_in[2];
    int peers_in[2] = {0, 0};
    int64_t expect_in[2] = {0, 0};
    const int small = req->n <= 2;
    MPI_Status *st = small ? st_in : malloc((size_t)req->n * sizeof *st);
    int *peers = small ? peers_in : malloc((size_t)req->n * sizeof *peers);
    int64_t *expect = small ? expect_in : malloc((size_t)req->n * sizeof *expect);
    if (st == NULL || peers == NULL || expect == NULL) comm_fail(c, req->op, __LINE__, "out of memory");
    for (int i = 0; i < req->n; i++) peers[i] = req->peer, expect[i] = req->is_send ? -1 : 0;
    wait_requests(c, req->op, req->n, req->reqs, st, t0, peers, expect);
    for (int i = 0; i < req->n && !req->is_send; i++) {
        const size_t off = (size_t)i * PIECE_BYTES;
        check_received(c, req->op, &st[i], req->bytes - off < PIECE_BYTES ? req->bytes - off : PIECE_BYTES);
    }
    if (!small) free(st), free(peers), free(expect);
    if (req->reqs != req->inline_reqs) free(req->reqs);
    if (req->device_dst != NULL) to_device(req->device_dst, req->staged, req->bytes);
    if (req->owns_staged) device_host_free(DEVICE_CUDA, req->staged);
    memset(req, 0, sizeof *req);
}

void comm_isend_bytes(Comm *comm, const void *buf, size_t bytes, int dest, int tag, CommRequest *req) {
    request_post(comm, "comm_isend_bytes", (void *)buf, bytes, dest, tag, req, 1, 0);
}

void comm_irecv_bytes(Comm *comm, void *buf, size_t bytes, int src, int tag, CommRequest *req) {
    request_post(comm, "comm_irecv_bytes", buf, bytes, src, tag, req, 0, 0);
}

void comm_wait(CommRequest *req) { request_wait(req, now_s()); }

void comm_send_bytes(Comm *comm, const void *buf, size_t bytes, int dest, int tag) {
    const double t0 = now_s();
    CommRequest req;
    request_post(comm, "comm_send_bytes", (void *)buf, bytes, dest, tag, &req, 1, 1);
    request_wait(&req, t0);
}

void comm_recv_bytes(Comm *comm, void *buf, size_t bytes, int src, int tag) {
    const double t0 = now_s();
    CommRequest req;
    request_post(comm, "comm_recv_bytes", buf, bytes, src, tag, &req, 0, 1);
    request_wait(&req, t0);
}

// ---------------------------------------------------------------------------- broadcast, barrier

void comm_bcast_bytes(Comm *comm, void *buf, size_t bytes, int root) {
    const char *op = "comm_bcast_bytes";
    const double t0 = now_s();
    const int single = check_comm(comm, op, __LINE__);
    check_count(comm, op, __LINE__, "bytes", (int64_t)bytes, buf);
    check_peer(comm, op, __LINE__, "root", root);
    if (nccl_path(comm, op, __LINE__, buf, (int64_t)bytes, NULL, 0)) {
        comm_nccl_bcast(comm, op, buf, bytes, root);
        return;
    }
    if (single) return;
    void *dev_buf = NULL;  // a device buffer: the broadcast moves a pinned copy (the root's copied there first)
    if (buffers_device(comm, op, __LINE__, buf, (int64_t)bytes, NULL, 0) == DEVICE_CUDA) {
        dev_buf = buf;
        buf = pinned(comm, bytes);
        if (comm->rank == root) to_host(buf, dev_buf, bytes);
    }
    const size_t pieces = (bytes + PIECE_BYTES - 1) / PIECE_BYTES;
    MPI_Request inline_reqs[4];
    MPI_Request *reqs = pieces <= 4 ? inline_reqs : malloc(pieces * sizeof *reqs);
    if (reqs == NULL) comm_fail(comm, op, __LINE__, "out of memory");
    for (size_t i = 0; i < pieces; i++) {
        const size_t off = i * PIECE_BYTES, len = bytes - off < PIECE_BYTES ? bytes - off : PIECE_BYTES;
        MPI_CHECK(comm, op, MPI_Ibcast((char *)buf + off, (int)len, MPI_BYTE, root, comm->coll, &reqs[i]));
    }
    wait_requests(comm, op, (int)pieces, reqs, NULL, t0, NULL, NULL);
    if (reqs != inline_reqs) free(reqs);
    if (dev_buf != NULL && comm->rank != root) to_device(dev_buf, buf, bytes);
}

void comm_barrier(Comm *comm) {
    const char *op = "comm_barrier";
    const double t0 = now_s();
    if (check_comm(comm, op, __LINE__)) return;
    // a dissemination barrier of empty messages (round k: to rank + 2^k, from rank - 2^k) rather than
    // MPI_Ibarrier, so that a timeout names the rank not heard from
    const int P = comm->size, me = comm->rank;
    Batch batch = {.comm = comm, .op = op};
    char empty[2];
    for (int k = 1; k < P; k *= 2) {
        batch_recv(&batch, &empty[0], 0, (me + P - k) % P, TAG_BARRIER);
        batch_send(&batch, &empty[1], 0, (me + k) % P, TAG_BARRIER);
        batch_wait(&batch, t0);
    }
    batch_free(&batch);
}
