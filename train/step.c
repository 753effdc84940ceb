/*
 * step.c - train_step: a step's op list, then norm, clip, AdamW and the bias update (see step.h).
 *
 * The order of the arithmetic is that of the trainer before this file existed, op for op, so the
 * bits of every run are unchanged: zero the gradients, count loads during the forwards, each
 * backward with loss_scale 1/grad_accum, the deferred FP8 finiteness check, the global norm over the
 * flat buffer, the clip factor, AdamW over the parameter groups, the weights-changed notice, and the
 * aux-loss-free bias update from the step's loads.
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

int train_step(TrainState *ts, const StepOp *ops, int n_ops, const StepHooks *hooks, StepResult *out, char *err,
               size_t err_size) {
    Model *m = &ts->model;
    Batch *bt = &ts->batch;
    const Config *cfg = ts->cfg;
    const int A = cfg->train.grad_accum, s = ts->step + 1;  // s: 1-based, as logs and AdamW count
    const int64_t n_elems = m->n_dense_elems + m->n_expert_elems;
    const int64_t fp8_gemms_before = m->rc.fp8_gemm_count;
    double loss_sum = 0, mtp_sum = 0, bal_sum = 0;
    int live = -1;  // the micro-batch whose activations ts->acts holds
    model_zero_grads(m);
    m->count_load = 1;
    for (int i = 0; i < n_ops; i++) {
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
            if (!isfinite((double)weighted) || !isfinite(lt.main) || !isfinite(lt.mtp_mean) || !isfinite(lt.balance)) {
                snprintf(err, err_size, "step %d, micro-batch %d: the loss is not finite (loss %g, mtp %g, bal %g); "
                         "stopping. Lower optim.lr or check the data.", s, op->micro_batch + 1, lt.main, lt.mtp_mean,
                         lt.balance);
                m->count_load = 0;
                return -1;
            }
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
            chunk_backward(m, 0, ts->acts, NULL, NULL, (real)(1.0 / A));
            live = -1;
        }
    }
    m->count_load = 0;
    if (hooks && hooks->reduce_grads) hooks->reduce_grads(hooks->ctx, ts);
    char why[512];
    if (fp8_check_finite(ts->dev, why, sizeof why) != 0) {  // deferred on the GPU (kernels.h)
        snprintf(err, err_size, "step %d: FP8 quantisation met a non-finite value: %s; stopping", s, why);
        return -1;
    }
    profile_begin(PHASE_OPTIMIZER);
    const double gnorm = grad_global_norm(ts->dev, m->grads, n_elems);
    if (!isfinite(gnorm)) {
        profile_end(PHASE_OPTIMIZER);
        snprintf(err, err_size, "step %d: the gradient norm is not finite (%g) though the loss was %.4f; stopping", s,
                 gnorm, loss_sum / A);
        return -1;
    }
    const float scale = clip_scale(gnorm, cfg->optim.grad_clip);
    const double lr = lr_at(&cfg->optim, ts->step, ts->total_steps);
    adamw_step(&ts->opt, m->weights, m->grads, ts->groups, ts->n_groups, (float)lr, scale, s);
    model_weights_changed(m);
    profile_end(PHASE_OPTIMIZER);
    if (hooks && hooks->reduce_expert_load) hooks->reduce_expert_load(hooks->ctx, ts);
    const double worst_load = model_update_router_bias(m);
    ts->step = s;
    *out = (StepResult){.loss = loss_sum / A, .mtp = mtp_sum / A, .balance = bal_sum / A, .grad_norm = gnorm,
                        .lr = lr, .worst_load = worst_load, .fp8_gemms = m->rc.fp8_gemm_count - fp8_gemms_before};
    return 0;
}
