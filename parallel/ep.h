/*
 * ep.h - the expert-parallel seam of the MoE layer: dispatch of permuted token rows to the ranks that
 * own their experts, and combine of the expert outputs back to the tokens' owner (DESIGN.md section 5).
 *
 * The MoE layer always calls through these four functions, so the layer code is the same in one
 * process and in a PP x EP job:
 *
 *   forward:  plan + gather -> perm_rows (N*K, C) in per-expert segments (all E experts, this rank's
 *             tokens) -> ep_dispatch -> local expert segments -> experts -> local_out
 *             -> ep_combine -> rows back in this rank's permuted order -> moe_combine_forward
 *   backward: d of the combine input -> ep_combine_backward -> d local_out -> experts' backward
 *             -> d local rows -> ep_dispatch_backward -> d perm_rows -> moe_unpermute_backward
 *
 * EP group: ranks that split the experts of one pipeline stage; expert e lives on EP rank
 * e / experts_per_rank, and local expert j of rank r is global expert r * experts_per_rank + j.
 * With ep_size 1 every function is the identity and copies nothing: the results are views of the
 * caller's buffers. With ep_size > 1 (a later issue, MPI/NCCL backend) ep_dispatch exchanges
 * per-destination counts and all-to-all-v's the rows: local expert j's segment then holds the rows
 * from source rank 0, then rank 1, ..., each in the source's (t, k) order, and EpBuffers owns the
 * received storage (released by ep_buffers_release). Since the exchange moves each row to exactly one
 * place, the backward functions are the same exchange in the other direction (no accumulation).
 *
 * Lifetimes: a returned view lives as long as the buffer it points into (at ep_size 1, the caller's
 * own buffer) and, at ep_size > 1, until ep_buffers_release; keep the EpBuffers of a micro-batch with
 * its activations until its backward pass is done.
 */
#ifndef FP8MOE_EP_H
#define FP8MOE_EP_H

#include "kernels/kernels.h"
#include "parallel/comm.h"

typedef struct {
    Comm *comm;            // the EP group's communicator
    int ep_size;           // ranks in the EP group (comm->size)
    int ep_rank;           // this rank in the EP group (comm->rank)
    int n_experts;         // E, routed experts of the model (global)
    int experts_per_rank;  // E / ep_size
} EpGroup;

typedef struct {
    // what the local experts run on (set by ep_dispatch)
    const real *rows;         // (n_rows, C), contiguous per local expert
    const int *seg_offsets;   // (experts_per_rank + 1): local expert j owns rows [seg_offsets[j], seg_offsets[j+1])
    int n_rows;
    int C;
    // this rank's own permuted layout, for the way back
    const int *perm_seg_offsets;  // (E + 1) as given to ep_dispatch
    int n_perm_rows;              // perm_seg_offsets[E] = N*K
} EpBuffers;

// g describes the EP group `comm` over n_experts experts. Stops with a message when E is not divisible
// by the group size, or when the group has more than one rank (needs the MPI/NCCL backend).
void ep_group_init(EpGroup *g, Comm *comm, int n_experts);
int ep_expert_owner(const EpGroup *g, int expert);   // EP rank holding global expert `expert`
int ep_first_local_expert(const EpGroup *g);         // global index of local expert 0

// perm_rows (seg_offsets[E], C): this rank's tokens in per-expert segments of all E experts,
// seg_offsets (E+1) from moe_permute_plan -> out: the rows of this rank's experts_per_rank experts.
// ep_size 1: out->rows = perm_rows, out->seg_offsets = seg_offsets (no copy).
void ep_dispatch(EpGroup *g, const real *perm_rows, const int *seg_offsets, int C, EpBuffers *out);
// local_out (buf->n_rows, C): expert outputs in the local segment layout -> returns the rows in this
// rank's permuted layout (buf->n_perm_rows, C), ready for moe_combine_forward. ep_size 1: local_out.
const real *ep_combine(EpGroup *g, EpBuffers *buf, const real *local_out);
// dperm_out (buf->n_perm_rows, C): gradient of ep_combine's result -> returns the gradient of
// local_out (buf->n_rows, C). ep_size 1: dperm_out.
const real *ep_combine_backward(EpGroup *g, EpBuffers *buf, const real *dperm_out);
// dlocal_rows (buf->n_rows, C): gradient of buf->rows -> returns the gradient of perm_rows
// (buf->n_perm_rows, C), ready for moe_unpermute_backward. ep_size 1: dlocal_rows.
const real *ep_dispatch_backward(EpGroup *g, EpBuffers *buf, const real *dlocal_rows);
// Frees storage the backend received into (none at ep_size 1) and clears buf.
void ep_buffers_release(EpBuffers *buf);

#endif
