/*
 * ep.c - expert-parallel dispatch/combine (parallel/ep.h).
 *
 * With one rank every expert is local, so dispatch and combine are identities that hand back views
 * of the caller's buffers. With more, the rows travel as FP32 over the EP group's communicator
 * (parallel/comm.h, host buffers: CPU ranks). This rank's permuted rows are already sorted by expert,
 * and each rank owns a contiguous range of experts, so the rows for rank q are one contiguous block:
 * dispatch sends perm_rows as it is. What arrives is ordered by source, then local expert; the local
 * segments want local expert, then source, so one reordering copy (staging <-> local rows) follows
 * each exchange one way and precedes it the other.
 */
#include "parallel/ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EP_FAIL(...)                                                  \
    do {                                                              \
        fprintf(stderr, "fp8moe: %s:%d: ", __FILE__, __LINE__);       \
        fprintf(stderr, __VA_ARGS__);                                 \
        fputc('\n', stderr);                                          \
        exit(1);                                                      \
    } while (0)

static void ep_require_group(const EpGroup *g, const char *fn) {
    if (g == NULL || g->comm == NULL) EP_FAIL("%s: EpGroup not initialised; call ep_group_init first", fn);
}

void ep_group_init(EpGroup *g, Comm *comm, int n_experts) {
    if (comm == NULL || comm->size < 1 || comm->rank < 0 || comm->rank >= comm->size)
        EP_FAIL("ep_group_init: invalid communicator (rank %d of %d); expected 0 <= rank < size",
                comm ? comm->rank : -1, comm ? comm->size : 0);
    if (n_experts < 1 || n_experts % comm->size != 0)
        EP_FAIL("ep_group_init: moe.n_routed_experts = %d over parallel.ep = %d ranks; expected a "
                "positive multiple of parallel.ep (experts are split evenly)", n_experts, comm->size);
    g->comm = comm;
    g->ep_size = comm->size;
    g->ep_rank = comm->rank;
    g->n_experts = n_experts;
    g->experts_per_rank = n_experts / comm->size;
}

int ep_expert_owner(const EpGroup *g, int expert) { return expert / g->experts_per_rank; }

int ep_first_local_expert(const EpGroup *g) { return g->ep_rank * g->experts_per_rank; }

// Grows *p to hold n rows of C reals (kept for the next call: sized by the first step).
static real *ensure_rows(real **p, int64_t *capacity, int64_t n, int C, const char *what) {
    if (*p && n <= *capacity) return *p;
    free(*p);
    *p = malloc((size_t)(n > 0 ? n : 1) * (size_t)C * sizeof(real));
    if (!*p) EP_FAIL("ep: out of host memory for %lld rows of %d (%s)", (long long)n, C, what);
    *capacity = n;
    return *p;
}

// Copies between the exchange's order (source r, then local expert j: staging) and the local segments
// (local expert j, then source r: local). to_local = 1: staging -> local; 0: local -> staging.
static void reorder(const EpGroup *g, const EpBuffers *b, real *staging, real *local, int to_local) {
    const int P = g->ep_size, J = g->experts_per_rank, C = b->C;
    const int64_t *recv = b->counts + (int64_t)P * J;  // [r][j]
    int64_t at_staging = 0;
    for (int r = 0; r < P; r++)
        for (int j = 0; j < J; j++) {
            int64_t before = 0;  // rows of sources < r in local segment j
            for (int q = 0; q < r; q++) before += recv[(int64_t)q * J + j];
            const int64_t at_local = b->local_offsets[j] + before, n = recv[(int64_t)r * J + j];
            real *l = local + at_local * C, *st = staging + at_staging * C;
            if (to_local) memcpy(l, st, (size_t)n * C * sizeof(real));
            else memcpy(st, l, (size_t)n * C * sizeof(real));
            at_staging += n;
        }
}

// send/recv bytes per rank for rows moving the dispatch way (perm -> owners) or the combine way.
static void row_bytes(const EpGroup *g, const EpBuffers *b, int dispatch_way, int64_t *send, int64_t *recv) {
    const int P = g->ep_size, J = g->experts_per_rank;
    for (int q = 0; q < P; q++) {
        int64_t out = 0, in = 0;
        for (int j = 0; j < J; j++) out += b->counts[(int64_t)q * J + j], in += b->counts[(int64_t)(P + q) * J + j];
        const int64_t so = out * b->C * (int64_t)sizeof(real), si = in * b->C * (int64_t)sizeof(real);
        send[q] = dispatch_way ? so : si;
        recv[q] = dispatch_way ? si : so;
    }
}

// perm layout (this rank's rows, by expert) -> local segments, through the exchange
static void exchange_to_local(EpGroup *g, EpBuffers *b, const real *perm, real *local) {
    int64_t *send = b->bytes, *recv = b->bytes + g->ep_size;
    row_bytes(g, b, 1, send, recv);
    comm_alltoallv_bytes(g->comm, perm, send, b->staging, recv);
    reorder(g, b, b->staging, local, 1);
}

// local segments -> perm layout, through the exchange
static void exchange_to_perm(EpGroup *g, EpBuffers *b, const real *local, real *perm) {
    int64_t *send = b->bytes, *recv = b->bytes + g->ep_size;
    reorder(g, b, b->staging, (real *)local, 0);
    row_bytes(g, b, 0, send, recv);
    comm_alltoallv_bytes(g->comm, b->staging, send, perm, recv);
}

void ep_dispatch(EpGroup *g, const real *perm_rows, const int *seg_offsets, int C, EpBuffers *out) {
    ep_require_group(g, "ep_dispatch");
    out->C = C;
    out->perm_seg_offsets = seg_offsets;
    out->n_perm_rows = seg_offsets[g->n_experts];
    if (g->ep_size == 1) {  // one rank owns all E experts: its local segments are its permuted rows, unchanged
        out->rows = perm_rows;
        out->seg_offsets = seg_offsets;
        out->n_rows = seg_offsets[g->n_experts];
        return;
    }
    const int P = g->ep_size, J = g->experts_per_rank;
    if (!out->counts) {
        out->counts = calloc((size_t)2 * P * J, sizeof *out->counts);
        out->bytes = calloc((size_t)4 * P, sizeof *out->bytes);
        out->local_offsets = calloc((size_t)J + 1, sizeof *out->local_offsets);
        if (!out->counts || !out->bytes || !out->local_offsets) EP_FAIL("ep_dispatch: out of host memory");
    }
    // the counts step: rows for each (destination, its local expert), then what each source sends here
    int64_t *sent = out->counts, *received = out->counts + (int64_t)P * J;
    for (int e = 0; e < g->n_experts; e++) sent[e] = seg_offsets[e + 1] - seg_offsets[e];
    int64_t *cb = out->bytes, *rb = out->bytes + P;
    for (int q = 0; q < P; q++) cb[q] = rb[q] = (int64_t)J * (int64_t)sizeof(int64_t);
    comm_alltoallv_bytes(g->comm, sent, cb, received, rb);
    int64_t n_local = 0;
    out->local_offsets[0] = 0;
    for (int j = 0; j < J; j++) {
        for (int r = 0; r < P; r++) n_local += received[(int64_t)r * J + j];
        out->local_offsets[j + 1] = (int)n_local;
    }
    if (n_local > out->capacity_local || !out->local_rows) {  // the three local-row buffers grow together
        int64_t cap = 0;
        free(out->staging), out->staging = NULL;
        free(out->local_grad), out->local_grad = NULL;
        ensure_rows(&out->staging, &cap, n_local, C, "staging");
        cap = 0;
        ensure_rows(&out->local_grad, &cap, n_local, C, "local gradient");
        ensure_rows(&out->local_rows, &out->capacity_local, n_local, C, "received rows");
    }
    ensure_rows(&out->perm_out, &out->capacity_perm, out->n_perm_rows, C, "combined rows");
    exchange_to_local(g, out, perm_rows, out->local_rows);
    out->rows = out->local_rows;
    out->seg_offsets = out->local_offsets;
    out->n_rows = (int)n_local;
}

const real *ep_combine(EpGroup *g, EpBuffers *buf, const real *local_out) {
    ep_require_group(g, "ep_combine");
    if (g->ep_size == 1) return local_out;
    exchange_to_perm(g, buf, local_out, buf->perm_out);
    return buf->perm_out;
}

const real *ep_combine_backward(EpGroup *g, EpBuffers *buf, const real *dperm_out) {
    ep_require_group(g, "ep_combine_backward");
    if (g->ep_size == 1) return dperm_out;
    exchange_to_local(g, buf, dperm_out, buf->local_grad);
    return buf->local_grad;
}

const real *ep_dispatch_backward(EpGroup *g, EpBuffers *buf, const real *dlocal_rows) {
    ep_require_group(g, "ep_dispatch_backward");
    if (g->ep_size == 1) return dlocal_rows;
    exchange_to_perm(g, buf, dlocal_rows, buf->perm_out);
    return buf->perm_out;
}

void ep_buffers_release(EpBuffers *buf) {
    if (!buf) return;
    free(buf->counts);
    free(buf->bytes);
    free(buf->local_offsets);
    free(buf->local_rows);
    free(buf->staging);
    free(buf->local_grad);
    free(buf->perm_out);
    memset(buf, 0, sizeof(*buf));
}
