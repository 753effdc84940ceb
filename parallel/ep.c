/*
 * ep.c - expert-parallel dispatch/combine (parallel/ep.h) for an EP group of one rank.
 *
 * With one rank every expert is local, so dispatch and combine are identities that hand back views
 * of the caller's buffers. This file exists so the MoE layer already calls through the seam; the
 * all-to-all-v exchange (counts, then FP8 or BF16 rows) arrives with the MPI/NCCL backend in a later
 * issue, behind the same functions. Until then an EP group of more than one rank is an error, never
 * a silent single-rank run.
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

// Every entry point checks this first: the exchange for ep_size > 1 does not exist yet.
static void ep_require_single_rank(const EpGroup *g, const char *fn) {
    if (g == NULL || g->comm == NULL) EP_FAIL("%s: EpGroup not initialised; call ep_group_init first", fn);
    if (g->ep_size != 1)
        EP_FAIL("%s: expert parallelism over %d ranks (parallel.ep = %d) needs the MPI/NCCL expert-"
                "parallel backend, which this build does not have yet (a later issue); expected "
                "parallel.ep = 1", fn, g->ep_size, g->ep_size);
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
    ep_require_single_rank(g, "ep_group_init");
}

int ep_expert_owner(const EpGroup *g, int expert) { return expert / g->experts_per_rank; }

int ep_first_local_expert(const EpGroup *g) { return g->ep_rank * g->experts_per_rank; }

void ep_dispatch(EpGroup *g, const real *perm_rows, const int *seg_offsets, int C, EpBuffers *out) {
    ep_require_single_rank(g, "ep_dispatch");
    // one rank owns all E experts: its local segments are its permuted rows, unchanged
    out->rows = perm_rows;
    out->seg_offsets = seg_offsets;
    out->n_rows = seg_offsets[g->n_experts];
    out->C = C;
    out->perm_seg_offsets = seg_offsets;
    out->n_perm_rows = seg_offsets[g->n_experts];
}

const real *ep_combine(EpGroup *g, EpBuffers *buf, const real *local_out) {
    ep_require_single_rank(g, "ep_combine");
    (void)buf;
    return local_out;
}

const real *ep_combine_backward(EpGroup *g, EpBuffers *buf, const real *dperm_out) {
    ep_require_single_rank(g, "ep_combine_backward");
    (void)buf;
    return dperm_out;
}

const real *ep_dispatch_backward(EpGroup *g, EpBuffers *buf, const real *dlocal_rows) {
    ep_require_single_rank(g, "ep_dispatch_backward");
    (void)buf;
    return dlocal_rows;
}

void ep_buffers_release(EpBuffers *buf) {
    if (buf) memset(buf, 0, sizeof(*buf));
}
