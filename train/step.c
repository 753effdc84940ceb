/*
 * step.c - train_step: a step's op list (its compute ops and the pipeline's messages), then norm, clip,
 * AdamW and the bias update (see step.h).
 *
 * The order of the arithmetic is that of the trainer before this file existed, op for op, so the
 * bits of every one-process run are unchanged: zero the gradients, count loads during the forwards,
 * each backward with loss_scale 1/(grad_accum x dp), the deferred FP8 finiteness check, the global
 * norm over the flat buffer, the clip factor, AdamW over the parameter groups, the weights-changed
 * notice, and the aux-loss-free bias update from the step's loads. Data parallel adds three sums at
 * fixed points, each the identity in one process: the loss terms and failure flags, the gradients
 * (dp for the non-expert part, edp for the routed experts) and the expert loads.
 */
#include "train/step.h"

#include <math.h>
#include <stdio.h>

#include "kernels/profile.h"
#include "train/fault.h"
#include "optim/clip.h"
#include "optim/lr_schedule.h"

enum { PIPE_TAG = 1 };  // the tag of the boundary tensors on the pp group (one FIFO per pair of ranks)

// Posts one message op on the pp group: the boundary tensor of its slot (step_plan.h).
static void post_message(TrainState *ts, const StepOp *op, size_t bytes, CommRequest *req) {
    const BoundarySlot *sl = &ts->slots[op->slot];
    switch (op->kind) {
    case STEP_SEND_ACTIVATION: comm_isend_bytes(ts->pp, sl->out, bytes, op->peer, PIPE_TAG, req); break;
    case STEP_RECV_ACTIVATION: comm_irecv_bytes(ts->pp, sl->in, bytes, op->peer, PIPE_TAG, req); break;
    case STEP_SEND_GRADIENT: comm_isend_bytes(ts->pp, sl->din, bytes, op->peer, PIPE_TAG, req); break;
    case STEP_RECV_GRADIENT: comm_irecv_bytes(ts->pp, sl->dout, bytes, op->peer, PIPE_TAG, req); break;
    default: break;
    }
}

// The sum of squares of grads[lo, lo + n) without the elements [x0, x0 + xn) (xn = 0: none).
static double sum_squares_outside(Device dev, const real *grads, int64_t lo, int64_t n, int64_t x0, int64_t xn) {
    const int64_t hi = lo + n, a = x0 > lo ? x0 : lo, b = x0 + xn < hi ? x0 + xn : hi;
    if (xn == 0 || b <= a) return sum_squares(dev, grads + lo, n);
    return sum_squares(dev, grads + lo, a - lo) + sum_squares(dev, grads + b, hi - b);
}

int train_step(TrainState *ts, StepResult *out, char *err, size_t err_size) {
    Model *m = &ts->model;
    Batch *bt = &ts->batch;
    const Config *cfg = ts->cfg;
    const StepOp *ops = ts->plan.ops;
    const int n_ops = ts->plan.n_ops;
    const int A = cfg->train.grad_accum, s = ts->step + 1;  // s: 1-based, as logs and AdamW count
    const int dp = ts->dp->size;
    // every backward's loss terms are scaled by 1/(micro-batches of the global batch), so the dp sum of the
    // ranks' gradients is the gradient of the global batch's mean loss
    const real loss_scale = (real)(1.0 / ((double)A * dp));
    const int64_t n_elems = m->n_dense_elems + m->n_expert_elems;
    const int64_t fp8_gemms_before = m->rc.fp8_gemm_count;
    const size_t boundary_bytes = (size_t)bt->B * bt->T * m->cfg.model.dim * sizeof(real);
    double loss_sum = 0, mtp_sum = 0, bal_sum = 0;
    int bad_mb = -1;  // the first micro-batch whose loss was not finite
    LossTerms bad = {0};
    int holds[ts->plan.n_acts];  // the (chunk, micro-batch) whose activations each set holds, as chunk * A + mb, or -1
    int awaits_w[ts->plan.n_acts];  // the set's micro-batch has run its I and awaits its W
    CommRequest reqs[n_ops > 0 ? n_ops : 1];
    int n_reqs = 0, live = 0;
    for (int k = 0; k < ts->plan.n_acts; k++) holds[k] = -1, awaits_w[k] = 0;
    // the step's micro-batches, in the loader's order (a rank with two chunks forwards each twice)
    const size_t row_ints = (size_t)bt->B * (bt->T + 1);
    for (int mb = 0; mb < A; mb++) {
        if (loader_next(&ts->train, bt->step_rows + mb * row_ints) != 0) {
            snprintf(err, err_size, "step %d: the training loader returned no batch", s);
            return -1;
        }
    }
    model_zero_grads_for_step(m);
    ep_traffic_reset(&m->ep);
    m->count_load = 1;
    // a non-finite loss skips the rest of the ops (see below), except when other ranks exchange rows or boundary
    // tensors with this one during the ops (expert or pipeline parallel): those must all run
    const int may_skip = m->ep.ep_size == 1 && ts->pp->size == 1;
    for (int i = 0; i < n_ops && (bad_mb < 0 || !may_skip); i++) {
        const StepOp *op = &ops[i];
        char name[32];
        const int weights = op->kind == STEP_BACKWARD_WEIGHT;  // uses no boundary slot
        const int compute = step_op_is_compute(op->kind);
        if (op->chunk < 0 || op->chunk >= m->n_chunks || op->micro_batch < 0 || op->micro_batch >= A ||
            (!weights && (op->slot < 0 || op->slot >= ts->plan.n_slots)) || op->local_slot >= ts->plan.n_slots ||
            (compute && (op->act < 0 || op->act >= ts->plan.n_acts || ts->plan.act_chunk[op->act] != op->chunk))) {
            step_op_format(op, name, sizeof name);  // (only for the message: not every op's cost)
            snprintf(err, err_size, "step %d: op %d (%s, slot %d, activation set %d) is outside this model's %d chunk(s), "
                     "micro-batches 0..%d, %d slots and %d sets of its chunk", s, i, name, op->slot, op->act, m->n_chunks,
                     A - 1, ts->plan.n_slots, ts->plan.n_acts);
            m->count_load = 0;
            return -1;
        }
        BoundarySlot *sl = weights ? NULL : &ts->slots[op->slot];
        ChunkActs *acts = compute ? ts->act_sets[op->act] : NULL;
        const ChunkSpec *cs = &m->chunks[op->chunk];
        const int key = op->chunk * A + op->micro_batch;
        // the boundary tensors: from / to another rank through this slot, or the previous stage's slot on this rank
        const real *in = cs->has_embedding || weights ? NULL : op->local_slot >= 0 ? ts->slots[op->local_slot].out : sl->in;
        real *din = cs->has_embedding || weights ? NULL : op->local_slot >= 0 ? ts->slots[op->local_slot].dout : sl->din;
        if (!compute) {
            // a batch of messages: posted together, waited for before the next compute op
            post_message(ts, op, boundary_bytes, &reqs[n_reqs++]);
            const int batch_ends = i + 1 == n_ops || step_op_is_compute(ops[i + 1].kind);
            if (batch_ends) {
                profile_begin(PHASE_PIPE_WAIT);
                for (int r = 0; r < n_reqs; r++) comm_wait(&reqs[r]);
                profile_end(PHASE_PIPE_WAIT);
                n_reqs = 0;
            }
        } else if (op->kind == STEP_FORWARD) {
            if (holds[op->act] >= 0) {
                step_op_format(op, name, sizeof name);  // (only for the message: not every op's cost)
                snprintf(err, err_size, "step %d: op %d (%s): its activation set %d still holds a micro-batch awaiting "
                         "its backward", s, i, name, op->act);
                m->count_load = 0;
                return -1;
            }
            const int *rows = bt->step_rows + op->micro_batch * row_ints;
            train_split_batch(rows, rows, bt->B, bt->T, bt->inputs, bt->targets);
            profile_op_begin(PROFILE_OP_FORWARD, op->chunk);
            real weighted = chunk_forward(m, op->chunk, acts, bt->inputs, bt->targets, in, cs->has_head ? NULL : sl->out);
            LossTerms lt = chunk_losses(acts);
            profile_op_end(PROFILE_OP_FORWARD);
            // A non-finite loss ends the step at the agreement below, which every rank reaches, so all ranks stop
            // at the same step. In one process the rest of the ops is skipped: a backward from a non-finite loss
            // has nothing to give.
            if (bad_mb < 0 &&
                (!isfinite((double)weighted) || !isfinite(lt.main) || !isfinite(lt.mtp_mean) || !isfinite(lt.balance)))
                bad_mb = op->micro_batch, bad = lt;
            loss_sum += lt.main;
            mtp_sum += lt.mtp_mean;
            bal_sum += lt.balance;
            holds[op->act] = key;
            if (++live > ts->live_bound) {  // the plan does not keep the schedule's activation bound: a bug
                step_op_format(op, name, sizeof name);  // (only for the message: not every op's cost)
                snprintf(err, err_size, "step %d: op %d (%s) makes %d activation sets live, more than the schedule's %d", s,
                         i, name, live, ts->live_bound);
                m->count_load = 0;
                return -1;
            }
        } else {
            // B and I after the forward (and not after an I), W after the I
            if (holds[op->act] != key || awaits_w[op->act] != weights) {
                step_op_format(op, name, sizeof name);  // (only for the message: not every op's cost)
                snprintf(err, err_size, "step %d: op %d (%s) runs the %s of chunk %d's micro-batch %d, but its activation "
                         "set %d does not hold %s", s, i, name, weights ? "weight gradients" : "backward", op->chunk,
                         op->micro_batch, op->act, weights ? "the input-gradient part of its backward (an I)" :
                         awaits_w[op->act] ? "a forward whose backward is still to run" : "its forward");
                m->count_load = 0;
                return -1;
            }
            if (op->kind == STEP_BACKWARD) {
                profile_op_begin(PROFILE_OP_BACKWARD, op->chunk);
                chunk_backward(m, op->chunk, acts, cs->has_head ? NULL : sl->dout, din, loss_scale);
                profile_op_end(PROFILE_OP_BACKWARD);
            } else if (op->kind == STEP_BACKWARD_INPUT) {
                profile_op_begin(PROFILE_OP_BACKWARD_INPUT, op->chunk);
                chunk_backward_input(m, op->chunk, acts, cs->has_head ? NULL : sl->dout, din, loss_scale);
                profile_op_end(PROFILE_OP_BACKWARD_INPUT);
                awaits_w[op->act] = 1;
                continue;  // the set stays live until the W
            } else {
                profile_op_begin(PROFILE_OP_BACKWARD_WEIGHT, op->chunk);
                chunk_backward_weights(m, acts);
                profile_op_end(PROFILE_OP_BACKWARD_WEIGHT);
                awaits_w[op->act] = 0;
            }
            holds[op->act] = -1;
            live--;
        }
    }
    m->count_load = 0;
    model_finish_step_grads(m);
    for (int k = 0; k < ts->plan.n_acts && (bad_mb < 0 || !may_skip); k++)
        if (awaits_w[k]) {  // the validated schedules run every I's ticket: a bug in the op list
            snprintf(err, err_size, "step %d: activation set %d still holds the weight gradients of an I at the end of "
                     "the ops (its W is missing from the op list)", s, k);
            return -1;
        }
    fault_point("step", s, ts->world->rank);  // the crash tests' SIGKILL during a step (train/fault.h)
    // The step's one agreement over the world: loss sums (rank order), and whether any rank met a non-finite loss
    // or FP8 value (deferred on the GPU, kernels.h), so that every rank stops at the same step.
    char why[512] = "";
    const int fp8_bad = fp8_check_finite(ts->dev, why, sizeof why) != 0;
    double agreed[7] = {loss_sum, mtp_sum, bal_sum, bad_mb >= 0, fp8_bad, (double)m->ep.rows_within_node,
                        (double)m->ep.rows_across_nodes};
    // In a pipeline a rank that ends its ops early waits here for the last stage's: the tail of its bubble, counted
    // with its other pipeline waits (what the simulator's bubble counts: parallel/schedule_sim.h).
    const Phase agreement = ts->pp->size > 1 ? PHASE_PIPE_WAIT : PHASE_GRAD_SYNC;
    profile_begin(agreement);
    comm_allreduce_sum_double(ts->world, agreed, 7);
    double max_nodes = m->ep.max_nodes_per_token;
    if (m->ep.node_of_ep_rank) comm_allreduce_max_double(ts->world, &max_nodes, 1);
    profile_end(agreement);
    if (agreed[3] > 0) {
        if (bad_mb >= 0)
            snprintf(err, err_size, "step %d, micro-batch %d: the loss is not finite (loss %g, mtp %g, bal %g); "
                     "stopping. Lower optim.lr or check the data.", s, bad_mb + 1, bad.main, bad.mtp_mean, bad.balance);
        else
            snprintf(err, err_size, "step %d: the loss is not finite on another rank; stopping", s);
        return -1;
    }
    if (agreed[4] > 0) {
        if (fp8_bad) snprintf(err, err_size, "step %d: FP8 quantisation met a non-finite value: %s; stopping", s, why);
        else snprintf(err, err_size, "step %d: FP8 quantisation met a non-finite value on another rank; stopping", s);
        return -1;
    }
    const int n_mb = A * dp;
    loss_sum = agreed[0], mtp_sum = agreed[1], bal_sum = agreed[2];
    // the embedding's two copies at the ends of a pipeline (MTP on): the first stage's gradient plus the last's
    const ParamInfo *embed = ts->ends ? model_find_param(m, "embed.weight") : NULL;
    profile_begin(PHASE_GRAD_SYNC);
    if (embed) comm_allreduce_sum_real(ts->ends, m->grads + embed->offset, embed->numel);
    // dualpipe: both copies of this rank's two stages (pipe A's and pipe B's), on the mirror ranks, in rank order
    if (ts->mirror) comm_allreduce_sum_real(ts->mirror, m->grads, n_elems);
    // gradients: the non-expert part over dp, the routed experts over their replicas (edp), in rank order;
    // with ZeRO-1 reduce-scattered, each rank keeping the sum of its shard (the same bits as the all-reduce's)
    for (int k = 0; k < 2; k++) {
        const TrainedRegion *r = &ts->regions[k];
        if (ts->zero1) comm_reduce_scatter_sum_real(r->group, m->grads + r->part_lo, m->grads + r->lo, r->shard_n);
        else comm_allreduce_sum_real(r->group, m->grads + r->part_lo, r->part_n);
    }
    profile_end(PHASE_GRAD_SYNC);
    profile_begin(PHASE_OPTIMIZER);
    double gnorm;
    if (!ts->zero1 && m->ep.ep_size == 1 && ts->pp->size == 1) {  // every gradient is here: the bits of one process
        gnorm = grad_global_norm(ts->dev, m->grads, n_elems);
    } else {  // the squares of this rank's elements summed over the ranks that hold the others, in rank order
        // the last stage's copy of the embedding is not counted: the first stage's holds the same gradient; nor is
        // the upper mirror rank's copy of its stages under dualpipe
        const int skip_embed = embed && ts->ends->rank == 1, skip_all = ts->mirror && ts->mirror->rank == 1;
        double sq[2];
        for (int k = 0; k < 2; k++) {
            const TrainedRegion *r = &ts->regions[k];
            sq[k] = skip_all ? 0.0 : sum_squares_outside(ts->dev, m->grads, r->lo, r->n, skip_embed ? embed->offset : 0,
                                                         skip_embed ? embed->numel : 0);
        }
        profile_begin(PHASE_GRAD_SYNC);
        for (int k = 0; k < 2 && ts->zero1; k++) comm_allreduce_sum_double(ts->regions[k].group, &sq[k], 1);
        comm_allreduce_sum_double(m->ep.comm, &sq[REGION_EXPERTS], 1);  // the other experts: the EP group
        double total = sq[REGION_DENSE] + sq[REGION_EXPERTS];
        comm_allreduce_sum_double(ts->pp, &total, 1);  // the other stages
        profile_end(PHASE_GRAD_SYNC);
        gnorm = grad_norm_from_sum_squares(total);
    }
    if (!isfinite(gnorm)) {  // the same reduced gradients on every rank: every rank stops here
        profile_end(PHASE_OPTIMIZER);
        snprintf(err, err_size, "step %d: the gradient norm is not finite (%g) though the loss was %.4f; stopping", s,
                 gnorm, loss_sum / n_mb);
        return -1;
    }
    const float scale = clip_scale(gnorm, cfg->optim.grad_clip);
    const double lr = lr_at(&cfg->optim, ts->step, ts->total_steps);
    // The weights change below: the new version first, since in bf16 mode the update writes the cached BF16 copies
    // of the block Linear weights of its region (linear_bf16_copy_ranges) for it. With ZeRO-1 a rank updates a shard
    // and gathers the rest, so the cache makes those copies at their next use instead.
    model_weights_changed(m);
    for (int k = 0; k < 2; k++) {  // AdamW is elementwise: the two regions give the bits of one call over both
        TrainedRegion *r = &ts->regions[k];
        int n_copies = 0;
        const AdamwCopyRange *copies = ts->zero1 ? NULL : linear_bf16_copy_ranges(&m->rc, r->lo, r->n, &n_copies);
        adamw_step(&r->opt, m->weights + r->lo, m->grads + r->lo, r->groups, r->n_groups, copies, n_copies, (float)lr,
                   scale, s);
        linear_bf16_copies_written(&m->rc, r->lo, copies, n_copies);
        if (ts->zero1) {
            profile_begin(PHASE_GRAD_SYNC);
            comm_allgather_real(r->group, m->weights + r->lo, m->weights + r->part_lo, r->shard_n);
            profile_end(PHASE_GRAD_SYNC);
        }
    }
    profile_end(PHASE_OPTIMIZER);
    // every rank that routed distinct tokens adds its counts (each stage those of its own layers, the others'
    // counts being zero), so every rank applies the same bias update to every layer
    profile_begin(PHASE_GRAD_SYNC);
    model_reduce_load(m, ts->world);
    profile_end(PHASE_GRAD_SYNC);
    const double worst_load = model_update_router_bias(m);
    ts->step = s;
    *out = (StepResult){.loss = loss_sum / n_mb, .mtp = mtp_sum / n_mb, .balance = bal_sum / n_mb, .grad_norm = gnorm,
                        .lr = lr, .worst_load = worst_load, .fp8_gemms = m->rc.fp8_gemm_count - fp8_gemms_before,
                        .rows_within_node = (int64_t)agreed[5], .rows_across_nodes = (int64_t)agreed[6],
                        .max_nodes_per_token = (int)max_nodes};
    return 0;
}
