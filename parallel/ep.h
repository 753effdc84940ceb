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
 * caller's buffers. With ep_size > 1 (the MPI backend: CPU ranks, or GPU ranks sharing a GPU, whose
 * rows comm.c stages through pinned host memory) ep_dispatch exchanges the per-(source, local expert)
 * row counts (host arrays), then all-to-all-v's the FP32 rows: local expert j's segment holds the rows
 * from source rank 0, then rank 1, ..., each in the source's (t, k) order, so when the sources' tokens
 * are consecutive rows of one batch the segment is the one a single process would build from that
 * batch. EpBuffers owns the received storage: the rows on the group's device, the counts and offsets on
 * the host; every copy of rows is a device copy (device_memcpy), and only the MPI transfer itself goes
 * through the host. The row buffers are sized on first use for the most rows this rank can receive,
 * ep_size x N*K (every source routing all its rows to this rank's experts, as the layer's activations
 * are sized), so later steps allocate nothing (ep_buffers_release frees them). Since the exchange moves
 * each row to exactly one place, the backward functions are the same exchange in the other direction
 * (no accumulation). Payload: FP32 rows, or in bf16 mode BF16 rows the dispatch way (bf16_rows below; the same
 * bits). The typed FP8 payload of DESIGN.md section 5 (rows with their 1x128 power-of-2 scales, docs/fp8.md)
 * and BF16 combine replace the rest later; the seam does not change.
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
    Device dev;            // where the rows live (the model's device); counts and offsets are on the host
    int ep_size;           // ranks in the EP group (comm->size)
    int ep_rank;           // this rank in the EP group (comm->rank)
    int n_experts;         // E, routed experts of the model (global)
    int experts_per_rank;  // E / ep_size
    // node-limited routing (DESIGN.md section 5): the node of each EP rank (ep_group_set_nodes; NULL: not
    // counted) and what this rank's dispatches sent since the last ep_traffic_reset
    int *node_of_ep_rank;  // (ep_size), owned
    int64_t rows_within_node, rows_across_nodes;  // (token, k) rows sent to ranks on this node / other nodes
    int max_nodes_per_token;                      // the most nodes one token's experts were on (ep_count_token_nodes)
    // the dispatch-way exchanges (token rows to their experts in ep_dispatch, the output-gradient rows in
    // ep_combine_backward) carry BF16 rows: set for bf16 mode (ep_group_set_bf16_rows), whose expert GEMMs read
    // exactly those rows rounded to BF16, so rounding them before the exchange gives the same bits in half the
    // bytes. The combine-way exchanges (expert outputs, input-gradients) stay FP32.
    int bf16_rows;
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
    // ep_size > 1: what the exchange needs, owned (ep_buffers_release)
    int64_t *counts;          // (2 * ep_size * experts_per_rank): rows sent to [q][j], then received from [r][j]
    int64_t *bytes;           // (4 * ep_size): send and receive bytes per rank, and their scratch
    int *local_offsets;       // (experts_per_rank + 1): the local segments (what seg_offsets points to)
    real *local_rows;         // (capacity_local, C) received rows in local segment order (what rows points to)
    real *staging;            // (capacity_local, C) rows in the exchange's order (per source, then expert)
    real *local_grad;         // (capacity_local, C) ep_combine_backward's result
    real *perm_out;           // (capacity_perm, C) ep_combine's and ep_dispatch_backward's results
    uint16_t *send16;         // (capacity_perm, C) bf16_rows: the dispatch-way rows, rounded, as they leave
    uint16_t *recv16;         // (capacity_local, C) bf16_rows: as they arrive (widened into staging)
    int64_t capacity_local, capacity_perm;
    Device dev;               // the device of the four row buffers above (the group's, from the first dispatch)
} EpBuffers;

// g describes the EP group `comm` over n_experts experts, whose rows live on dev. Stops with a message when E
// is not divisible by the group size.
void ep_group_init(EpGroup *g, Comm *comm, int n_experts, Device dev);
// Records the node of each EP rank (ep_size entries, copied), so the dispatches count the rows they send
// within and across nodes. Frees nothing else; ep_group_free releases the copy.
void ep_group_set_nodes(EpGroup *g, const int *node_of_ep_rank);
// Makes the dispatch-way exchanges carry BF16 rows (EpGroup.bf16_rows): only where every reader of those rows
// rounds them to BF16 first (bf16 mode's expert GEMMs).
void ep_group_set_bf16_rows(EpGroup *g, int on);
void ep_group_free(EpGroup *g);
// Zeroes the traffic counters (the trainer does it at each step's start).
void ep_traffic_reset(EpGroup *g);
// topk_idx (N, K) on the host: raises max_nodes_per_token to the most distinct nodes any token's K experts lie
// on. With the expert groups whole on nodes (groups_check_expert_groups) it is at most moe.n_limited_groups.
void ep_count_token_nodes(EpGroup *g, const int *topk_idx, int N, int K);
int ep_expert_owner(const EpGroup *g, int expert);   // EP rank holding global expert `expert`
int ep_first_local_expert(const EpGroup *g);         // global index of local expert 0

// perm_rows (seg_offsets[E], C) on g->dev: this rank's tokens in per-expert segments of all E experts,
// seg_offsets (E+1) from moe_permute_plan -> out: the rows of this rank's experts_per_rank experts.
// ep_size 1: out->rows = perm_rows, out->seg_offsets = seg_offsets (no copy). seg_offsets is a host array.
// Collective over the EP group. out must be zeroed before its first call; it keeps its storage from the
// previous call (the same layer's last step).
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
// Frees storage the exchange owns (none at ep_size 1) and clears buf.
void ep_buffers_release(EpBuffers *buf);

#endif
