/*
 * step.h - the one training step of fp8moe: a list of forward and backward ops over micro-batches,
 * then the gradient norm, clipping, AdamW, the weights-changed notice and the expert-bias update.
 *
 * Every caller that trains (fp8moe train, fp8moe bench step, the tests) runs its steps through
 * train_step, so the step's arithmetic exists once. The op list is data: one process runs
 * F0 B0 F1 B1 ... over the step's grad_accum micro-batches (step_ops_one_process); the pipeline
 * schedules of later issues hand their own lists to the same function.
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

typedef enum { STEP_FORWARD, STEP_BACKWARD } StepOpKind;

typedef struct {
    StepOpKind kind;
    int chunk;        // chunk of this process's model
    int micro_batch;  // 0 .. grad_accum - 1 within the step
} StepOp;

// F0 B0 F1 B1 ... F(A-1) B(A-1) on chunk 0: 2 * grad_accum ops into ops (room for max_ops).
// Returns the count, or -1 when max_ops is too small.
int step_ops_one_process(StepOp *ops, int max_ops, int grad_accum);

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

// Runs one step of ts: the ops (each micro-batch's forward before its backward; with the state's one
// set of activations, each backward must follow its own forward directly), then the update. On
// success ts->step is one higher and *out filled. Returns 0, or -1 with err naming the step and what
// went wrong (no batch from the loader, a non-finite loss, FP8 quantisation or gradient norm), the
// weights then being those before the step's update.
int train_step(TrainState *ts, const StepOp *ops, int n_ops, StepResult *out, char *err, size_t err_size);

#endif
