/*
 * step.h - the one training step of fp8moe: a list of forward and backward ops over micro-batches,
 * then the gradient norm, clipping, AdamW, the weights-changed notice and the expert-bias update.
 *
 * Every caller that trains (fp8moe train, fp8moe bench step, the tests) runs its steps through
 * train_step, so the step's arithmetic exists once. The op list is data, the state's plan
 * (train/step_plan.h, made when the state is built): one process runs F0 B0 F1 B1 ... over the step's
 * grad_accum micro-batches; a pipeline rank runs its ops of the schedule (parallel.schedule), whose
 * message ops send and receive the boundary tensors over the pp group. A batch of consecutive message
 * ops is posted at once (nonblocking) and waited for before the next compute op.
 *
 * Pipeline parallel (TrainState.pp, .ends; parallel.pp > 1): every stage reads the same micro-batches (the
 * first needs the tokens, the last the targets), so a pp group's loaders stay in step. The loss terms
 * live on the last stage and the balance terms on every stage: the agreement sums them over the world
 * (in world rank order, which at pp = 1 is the dp order). When MTP is on, the last stage holds its own copy
 * of the embedding; the two copies' gradients are summed over the ends group (first stage's, then the
 * last's) before the dp reduction, so both copies take the same update, and the grad norm counts the
 * embedding once (the first stage's). The norm sums every stage's squares over pp; the expert loads are
 * summed over the world, each stage contributing its own layers' counts, so every rank applies the same
 * bias update to every layer.
 *
 * Data parallel (TrainState.dp, .edp; both the single-process group in one process, where every sum
 * is the identity): each rank runs the ops on its own micro-batches, every backward scales its loss by
 * 1/(grad_accum x dp), and the step sums across ranks at three fixed points, in rank order
 * (parallel/comm.h): the loss terms with the ranks' failure flags (so every rank stops at the same
 * step), the gradients after the last backward (non-expert over dp, routed experts over edp, before
 * the norm), and the expert token counts before the bias update. Every rank then holds the same
 * gradients and applies the same update.
 *
 * The step's loss is the mean over the global batch's micro-batches, the clip uses the global norm
 * before clipping, and the learning rate is lr_at(step, total_steps) of the state's schedule. Load
 * counting is on only inside the step's forwards (never in evaluation).
 */
#ifndef FP8MOE_STEP_H
#define FP8MOE_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "train/train_state.h"

typedef struct {
    double loss, mtp, balance;  // means over the global batch's micro-batches (unweighted terms, as logged)
    double grad_norm;           // global L2 norm before clipping
    double lr;
    double worst_load;          // worst MoE layer's max/mean expert load of the step
    int64_t fp8_gemms;          // FP8 GEMMs this rank's step ran
    // expert parallel with nodes known (ep_group_set_nodes), summed (max) over the dp group; else 0
    int64_t rows_within_node, rows_across_nodes;
    int max_nodes_per_token;
} StepResult;

// Runs one step of ts: the ops of ts->plan (each micro-batch's forward before its backward, forwards in
// micro-batch order), then the update. Collective over the world. On success ts->step is one higher and
// *out filled. Returns 0, or -1 with err naming the step and what went wrong (no batch from the loader, a
// non-finite loss, FP8 quantisation or gradient norm, an op list the state cannot run), the weights then
// being those before the step's update.
int train_step(TrainState *ts, StepResult *out, char *err, size_t err_size);

#endif
