/*
 * ep.c - expert-parallel dispatch/combine (parallel/ep.h).
 *
 * With one rank every expert is local, so dispatch and combine are identities that hand back views
 * of the caller's buffers. With more, the rows travel as FP32 over the EP group's communicator
 * (parallel/comm.h, which takes host or device buffers: the rows stay on the group's device, and
 * comm.c stages them through pinned host memory for MPI). This rank's permuted rows are already sorted by expert,
 * and each rank owns a contiguous range of experts, so the rows for rank q are one contiguous block:
 * dispatch sends perm_rows as it is. What arrives is ordered by source, then local expert; the local
 * segments want local expert, then source, so one reordering copy (staging <-> local rows) follows
 * each exchange one way and precedes it the other.
 */
#include "parallel/ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/profile.h"

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

void ep_group_init(EpGroup *g, Comm *comm, int n_experts, Device dev) {
    if (comm == NULL || comm->size < 1 || comm->rank < 0 || comm->rank >= comm->size)
        EP_FAIL("ep_group_init: invalid communicator (rank %d of %d); expected 0 <= rank < size",
                comm ? comm->rank : -1, comm ? comm->size : 0);
    if (n_experts < 1 || n_experts % comm->size != 0)
        EP_FAIL("ep_group_init: moe.n_routed_experts = %d over parallel.ep = %d ranks; expected a "
                "positive multiple of parallel.ep (experts are split evenly)", n_experts, comm->size);
    g->comm = comm;
    g->dev = dev;
    g->ep_size = comm->size;
    g->ep_rank = comm->rank;
    g->n_experts = n_experts;
    g->experts_per_rank = n_experts / comm->size;
    g->node_of_ep_rank = NULL;  // (ep_group_set_nodes comes after)
    g->bf16_rows = 0;           // (ep_group_set_bf16_rows comes after)
    ep_traffic_reset(g);
}

void ep_group_set_nodes(EpGroup *g, const int *node_of_ep_rank) {
    free(g->node_of_ep_rank);
    g->node_of_ep_rank = malloc((size_t)g->ep_size * sizeof *g->node_of_ep_rank);
    if (!g->node_of_ep_rank) EP_FAIL("ep_group_set_nodes: out of host memory");
    memcpy(g->node_of_ep_rank, node_of_ep_rank, (size_t)g->ep_size * sizeof *g->node_of_ep_rank);
}

void ep_group_free(EpGroup *g) {
    free(g->node_of_ep_rank);
    g->node_of_ep_rank = NULL;
}

void ep_traffic_reset(EpGroup *g) {
    g->rows_within_node = g->rows_across_nodes = 0;
    g->max_nodes_per_token = 0;
}

void ep_count_token_nodes(EpGroup *g, const int *topk_idx, int N, int K) {
    if (!g->node_of_ep_rank) return;
    for (int t = 0; t < N; t++) {
        int distinct = 0;
        for (int k = 0; k < K; k++) {
            const int node = g->node_of_ep_rank[ep_expert_owner(g, topk_idx[(int64_t)t * K + k])];
            int seen = 0;
            for (int j = 0; j < k; j++) seen |= g->node_of_ep_rank[ep_expert_owner(g, topk_idx[(int64_t)t * K + j])] == node;
            distinct += !seen;
        }
        if (distinct > g->max_nodes_per_token) g->max_nodes_per_token = distinct;
    }
}

void ep_group_set_bf16_rows(EpGroup *g, int on) { g->bf16_rows = on != 0; }

int ep_expert_owner(const EpGroup *g, int expert) { return expert / g->experts_per_rank; }

int ep_first_local_expert(const EpGroup *g) { return g->ep_rank * g->experts_per_rank; }

// *p (on dev) becomes a buffer of `rows` rows of C reals; the old one, if any, is freed (device_alloc stops with
// a message when the memory is not there).
static void alloc_rows(Device dev, real **p, int64_t rows, int C) {
    device_free(dev, *p);
    *p = device_alloc(dev, (size_t)(rows > 0 ? rows : 1) * (size_t)C * sizeof(real));
}

// The same for rows of C BF16 values (the BF16 payload).
static void alloc_rows16(Device dev, uint16_t **p, int64_t rows, int C) {
    device_free(dev, *p);
    *p = device_alloc(dev, (size_t)(rows > 0 ? rows : 1) * (size_t)C * sizeof(uint16_t));
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
            if (to_local) device_memcpy(g->dev, l, st, (size_t)n * C * sizeof(real));
            else device_memcpy(g->dev, st, l, (size_t)n * C * sizeof(real));
            at_staging += n;
        }
}

// send/recv bytes per rank for rows of `es`-byte values moving the dispatch way (perm -> owners) or the combine way.
static void row_bytes(const EpGroup *g, const EpBuffers *b, int dispatch_way, int64_t es, int64_t *send, int64_t *recv) {
    const int P = g->ep_size, J = g->experts_per_rank;
    for (int q = 0; q < P; q++) {
        int64_t out = 0, in = 0;
        for (int j = 0; j < J; j++) out += b->counts[(int64_t)q * J + j], in += b->counts[(int64_t)(P + q) * J + j];
        const int64_t so = out * b->C * es, si = in * b->C * es;
        send[q] = dispatch_way ? so : si;
        recv[q] = dispatch_way ? si : so;
    }
}

// One all-to-all-v of the EP group, timed as the profiler's EP phase.
static void exchange(EpGroup *g, const void *send, const int64_t *send_bytes, void *recv, const int64_t *recv_bytes) {
    profile_begin(PHASE_EP_COMM);
    comm_alltoallv_bytes(g->comm, send, send_bytes, recv, recv_bytes);
    profile_end(PHASE_EP_COMM);
}

// perm layout (this rank's rows, by expert) -> local segments, through the exchange; in BF16 when the group's
// payload is (ep.h: rounded here once, widened back exactly on arrival)
static void exchange_to_local(EpGroup *g, EpBuffers *b, const real *perm, real *local) {
    int64_t *send = b->bytes, *recv = b->bytes + g->ep_size;
    if (g->bf16_rows) {
        row_bytes(g, b, 1, (int64_t)sizeof(uint16_t), send, recv);
        bf16_round_array(g->dev, b->send16, perm, (int64_t)b->n_perm_rows * b->C);
        exchange(g, b->send16, send, b->recv16, recv);
        bf16_widen_array(g->dev, b->staging, b->recv16, (int64_t)b->local_offsets[g->experts_per_rank] * b->C);
    } else {
        row_bytes(g, b, 1, (int64_t)sizeof(real), send, recv);
        exchange(g, perm, send, b->staging, recv);
    }
    reorder(g, b, b->staging, local, 1);
}

// local segments -> perm layout, through the exchange
static void exchange_to_perm(EpGroup *g, EpBuffers *b, const real *local, real *perm) {
    int64_t *send = b->bytes, *recv = b->bytes + g->ep_size;
    reorder(g, b, b->staging, (real *)local, 0);
    row_bytes(g, b, 0, (int64_t)sizeof(real), send, recv);
    exchange(g, b->staging, send, perm, recv);
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
    if (g->node_of_ep_rank)  // node-limited routing's traffic: rows for ranks on this node and on others
        for (int q = 0; q < P; q++) {
            int64_t rows = 0;
            for (int j = 0; j < J; j++) rows += sent[(int64_t)q * J + j];
            if (g->node_of_ep_rank[q] == g->node_of_ep_rank[g->ep_rank]) g->rows_within_node += rows;
            else g->rows_across_nodes += rows;
        }
    int64_t *cb = out->bytes, *rb = out->bytes + P;
    for (int q = 0; q < P; q++) cb[q] = rb[q] = (int64_t)J * (int64_t)sizeof(int64_t);
    exchange(g, sent, cb, received, rb);
    int64_t n_local = 0;
    out->local_offsets[0] = 0;
    for (int j = 0; j < J; j++) {
        for (int r = 0; r < P; r++) n_local += received[(int64_t)r * J + j];
        out->local_offsets[j + 1] = (int)n_local;
    }
    if (out->local_rows && out->dev != g->dev)
        EP_FAIL("ep_dispatch: these EpBuffers hold rows on %s, but the EP group's rows are on %s; expected one "
                "EpBuffers per layer and device", device_name(out->dev), device_name(g->dev));
    out->dev = g->dev;
    if (n_local > out->capacity_local || !out->local_rows) {  // the three local-row buffers grow together
        // the most rows this rank can receive: every source's N*K rows (as many as this rank's) for its experts,
        // as the layer's activations are sized (train/block.c local_rows), so later steps allocate nothing
        const int64_t worst = (int64_t)P * out->n_perm_rows, cap = n_local > worst ? n_local : worst;
        alloc_rows(g->dev, &out->staging, cap, C);
        alloc_rows(g->dev, &out->local_grad, cap, C);
        alloc_rows(g->dev, &out->local_rows, cap, C);
        if (g->bf16_rows) alloc_rows16(g->dev, &out->recv16, cap, C);
        out->capacity_local = cap;
    }
    if (out->n_perm_rows > out->capacity_perm || !out->perm_out) {
        alloc_rows(g->dev, &out->perm_out, out->n_perm_rows, C);
        if (g->bf16_rows) alloc_rows16(g->dev, &out->send16, out->n_perm_rows, C);
        out->capacity_perm = out->n_perm_rows;
    }
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
    device_free(buf->dev, buf->local_rows);
    device_free(buf->dev, buf->staging);
    device_free(buf->dev, buf->local_grad);
    device_free(buf->dev, buf->perm_out);
    device_free(buf->dev, buf->send16);
    device_free(buf->dev, buf->recv16);
    memset(buf, 0, sizeof(*buf));
}
