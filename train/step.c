/*
 * step.c - train_step: a step's op list, then norm, clip, AdamW and the bias update (see step.h).
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
#include "optim/clip.h"
#include "optim/lr_schedule.h"

int step_ops_one_process(StepOp *ops, int max_ops, int grad_accum) {
    if (2 * grad_accum > max_ops) return -1;
    for (int mb = 0; mb < grad_accum; mb++) {
        ops[2 * mb] = (StepOp){STEP_FORWARD, 0, mb};
        ops[2 * mb + 1] = (StepOp){STEP_BACKWARD, 0, mb};
    }
    return 2 * grad_accum;
}

int train_step(TrainState *ts, const StepOp *ops, int n_ops, StepResult *out, char *err, size_t err_size) {
    Model *m = &ts->model;
    Batch *bt = &ts->batch;
    const Config *cfg = ts->cfg;
    const int A = cfg->train.grad_accum, s = ts->step + 1;  // s: 1-based, as logs and AdamW count
    const int dp = ts->dp->size;
    // every backward's loss terms are scaled by 1/(micro-batches of the global batch), so the dp sum of the
    // ranks' gradients is the gradient of the global batch's mean loss
    const real loss_scale = (real)(1.0 / ((double)A * dp));
    const int64_t n_elems = m->n_dense_elems + m->n_expert_elems;
    const int64_t fp8_gemms_before = m->rc.fp8_gemm_count;
    double loss_sum = 0, mtp_sum = 0, bal_sum = 0;
    int live = -1;  // the micro-batch whose activations ts->acts holds
    int bad_mb = -1;  // the first micro-batch whose loss was not finite
    LossTerms bad = {0};
    model_zero_grads(m);
    ep_traffic_reset(&m->ep);
    m->count_load = 1;
    // a non-finite loss skips the rest of the ops (see below), except under expert parallelism, whose
    // forwards and backwards exchange rows with the other ranks of the EP group: those must all run
    const int may_skip = m->ep.ep_size == 1;
    for (int i = 0; i < n_ops && (bad_mb < 0 || !may_skip); i++) {
        const StepOp *op = &ops[i];
        if (op->chunk != 0 || op->micro_batch < 0 || op->micro_batch >= A) {
            snprintf(err, err_size, "step %d: op %d (chunk %d, micro-batch %d) is outside this model's chunk 0 and "
                     "micro-batches 0..%d", s, i, op->chunk, op->micro_batch, A - 1);
            m->count_load = 0;
            return -1;
        }
        if (op->kind == STEP_FORWARD) {
            if (live >= 0) {
                snprintf(err, err_size, "step %d: op %d forwards micro-batch %d while %d awaits its backward; this "
                         "state keeps one set of activations", s, i, op->micro_batch, live);
                m->count_load = 0;
                return -1;
            }
            if (loader_next(&ts->train, bt->rows) != 0) {
                snprintf(err, err_size, "step %d: the training loader returned no batch", s);
                m->count_load = 0;
                return -1;
            }
            train_split_batch(bt->rows, bt->rows, bt->B, bt->T, bt->inputs, bt->targets);
            real weighted = chunk_forward(m, 0, ts->acts, bt->inputs, bt->targets, NULL, NULL);
            LossTerms lt = chunk_losses(ts->acts);
            // A non-finite loss ends the step at the agreement below, which every data-parallel rank reaches,
            // so all ranks stop at the same step. At ep = 1 the rest of this rank's ops is skipped: a backward
            // from a non-finite loss has nothing to give.
            if (bad_mb < 0 &&
                (!isfinite((double)weighted) || !isfinite(lt.main) || !isfinite(lt.mtp_mean) || !isfinite(lt.balance)))
                bad_mb = op->micro_batch, bad = lt;
            loss_sum += lt.main;
            mtp_sum += lt.mtp_mean;
            bal_sum += lt.balance;
            live = op->micro_batch;
        } else {
            if (live != op->micro_batch) {
                snprintf(err, err_size, "step %d: op %d runs the backward of micro-batch %d, whose forward is not the "
                         "last one run", s, i, op->micro_batch);
                m->count_load = 0;
                return -1;
            }
            chunk_backward(m, 0, ts->acts, NULL, NULL, loss_scale);
            live = -1;
        }
    }
    m->count_load = 0;
    // The step's one agreement over dp: loss sums (rank order), and whether any rank met a non-finite loss
    // or FP8 value (deferred on the GPU, kernels.h), so that every rank stops at the same step.
    char why[512] = "";
    const int fp8_bad = fp8_check_finite(ts->dev, why, sizeof why) != 0;
    double agreed[7] = {loss_sum, mtp_sum, bal_sum, bad_mb >= 0, fp8_bad, (double)m->ep.rows_within_node,
                        (double)m->ep.rows_across_nodes};
    comm_allreduce_sum_double(ts->dp, agreed, 7);
    double max_nodes = m->ep.max_nodes_per_token;
    if (m->ep.node_of_ep_rank) comm_allreduce_max_double(ts->dp, &max_nodes, 1);
    if (agreed[3] > 0) {
        if (bad_mb >= 0)
            snprintf(err, err_size, "step %d, micro-batch %d: the loss is not finite (loss %g, mtp %g, bal %g); "
                     "stopping. Lower optim.lr or check the data.", s, bad_mb + 1, bad.main, bad.mtp_mean, bad.balance);
        else
            snprintf(err, err_size, "step %d: the loss is not finite on another data-parallel rank; stopping", s);
        return -1;
    }
    if (agreed[4] > 0) {
        if (fp8_bad) snprintf(err, err_size, "step %d: FP8 quantisation met a non-finite value: %s; stopping", s, why);
        else snprintf(err, err_size, "step %d: FP8 quantisation met a non-finite value on another data-parallel rank; "
                      "stopping", s);
        return -1;
    }
    const int n_mb = A * dp;
    loss_sum = agreed[0], mtp_sum = agreed[1], bal_sum = agreed[2];
    // gradients: the non-expert part over dp, the routed experts over their replicas (edp), in rank order;
    // with ZeRO-1 reduce-scattered, each rank keeping the sum of its shard (the same bits as the all-reduce's)
    for (int k = 0; k < 2; k++) {
        const TrainedRegion *r = &ts->regions[k];
        if (ts->zero1) comm_reduce_scatter_sum_real(r->group, m->grads + r->part_lo, m->grads + r->lo, r->shard_n);
        else comm_allreduce_sum_real(r->group, m->grads + r->part_lo, r->part_n);
    }
    profile_begin(PHASE_OPTIMIZER);
    double gnorm;
    if (!ts->zero1 && m->ep.ep_size == 1) {  // every gradient is here: one call, the bits of one process
        gnorm = grad_global_norm(ts->dev, m->grads, n_elems);
    } else {  // the squares of this rank's elements summed over the ranks that hold the others, in rank order
        double sq[2];
        for (int k = 0; k < 2; k++) {
            const TrainedRegion *r = &ts->regions[k];
            sq[k] = sum_squares(ts->dev, m->grads + r->lo, r->n);
            if (ts->zero1) comm_allreduce_sum_double(r->group, &sq[k], 1);
        }
        comm_allreduce_sum_double(m->ep.comm, &sq[REGION_EXPERTS], 1);  // the other experts: the EP group
        gnorm = grad_norm_from_sum_squares(sq[REGION_DENSE] + sq[REGION_EXPERTS]);
    }
    if (!isfinite(gnorm)) {  // the same reduced gradients on every rank: every rank stops here
        profile_end(PHASE_OPTIMIZER);
        snprintf(err, err_size, "step %d: the gradient norm is not finite (%g) though the loss was %.4f; stopping", s,
                 gnorm, loss_sum / n_mb);
        return -1;
    }
    const float scale = clip_scale(gnorm, cfg->optim.grad_clip);
    const double lr = lr_at(&cfg->optim, ts->step, ts->total_steps);
    for (int k = 0; k < 2; k++) {  // AdamW is elementwise: the two regions give the bits of one call over both
        TrainedRegion *r = &ts->regions[k];
        adamw_step(&r->opt, m->weights + r->lo, m->grads + r->lo, r->groups, r->n_groups, (float)lr, scale, s);
        if (ts->zero1) comm_allgather_real(r->group, m->weights + r->lo, m->weights + r->part_lo, r->shard_n);
    }
    model_weights_changed(m);
    profile_end(PHASE_OPTIMIZER);
    // every rank that routed distinct tokens adds its counts, so every rank applies the same bias update
    model_reduce_load(m, ts->dp);
    const double worst_load = model_update_router_bias(m);
    ts->step = s;
    *out = (StepResult){.loss = loss_sum / n_mb, .mtp = mtp_sum / n_mb, .balance = bal_sum / n_mb, .grad_norm = gnorm,
                        .lr = lr, .worst_load = worst_load, .fp8_gemms = m->rc.fp8_gemm_count - fp8_gemms_before,
                        .rows_within_node = (int64_t)agreed[5], .rows_across_nodes = (int64_t)agreed[6],
                        .max_nodes_per_token = (int)max_nodes};
    return 0;
}
