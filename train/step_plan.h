/*
 * step_plan.h - the op list one rank runs in a training step (train_step, train/step.h) and the activation
 * slots it needs: F0 B0 F1 B1 ... in one process, or this pp rank's ops of a pipeline schedule
 * (parallel/schedule.h) with its activation and gradient messages.
 *
 * Why a plan, made once when the state is built: the schedule is the same every step, so where each (chunk,
 * micro-batch) keeps its tensors, and how many of each the rank needs, are decided here, before the first step,
 * and the step allocates nothing. Two kinds of storage, with their own lifetimes:
 *   - an activation set (ChunkActs of the op's chunk): taken by the forward, free again after the backward (a
 *     B, or the W that runs an I's ticket: the ticket's operands may lie in the set), so a rank holds exactly the
 *     schedule's live sets (schedule_memory), what Table 2's activation column counts;
 *   - a boundary slot (the received input, the output sent on, the received output-gradient, the input-gradient
 *     sent back; (B*T, D) each, any chunk): taken by the first op that names its (chunk, micro-batch), a receive
 *     or the forward, and free again after the backward, or, when the backward's input-gradient is sent, after
 *     the batch of messages that sends it (a batch is a maximal run of message ops, which the executor posts
 *     together and waits for before its next compute op: parallel/schedule.h's batch semantics).
 *
 * Mapping from the schedule (parallel/schedule.h "Mapping to the executor"): F -> STEP_FORWARD, B ->
 * STEP_BACKWARD, I -> STEP_BACKWARD_INPUT (the backward without the block Linears' weight gradients, left in
 * the activation set's W ticket: train/model.h chunk_backward_input), W -> STEP_BACKWARD_WEIGHT (runs the
 * ticket of the (chunk, micro-batch) the schedule names, the FIFO's oldest), SEND / RECV -> the four message
 * kinds, FB -> STEP_FORWARD then STEP_BACKWARD (one after the other: correct, without the overlap). The
 * gradients are those of full backwards in the same order: every weight gradient gets its micro-batches'
 * products in micro-batch order, in the I parts or in the W parts (train/wgrad_ticket.h); the validator checks
 * the FIFO. Two stages of one pipe on one rank (dualpipev's turn at rank pp-1) hand over without a message: the
 * later stage's forward reads the earlier one's output, and its backward writes the earlier one's
 * output-gradient, in the earlier one's boundary slot (StepOp.local_slot).
 */
#ifndef FP8MOE_STEP_PLAN_H
#define FP8MOE_STEP_PLAN_H

#include <stddef.h>

#include "parallel/schedule.h"

typedef enum {
    STEP_FORWARD,           // forward of the chunk for the micro-batch (the next batch of the loader)
    STEP_BACKWARD,          // its full backward
    STEP_BACKWARD_INPUT,    // its backward without the block Linears' weight gradients (a W ticket)
    STEP_BACKWARD_WEIGHT,   // the weight gradients of its STEP_BACKWARD_INPUT (uses no boundary slot)
    STEP_SEND_ACTIVATION,   // the forward's output to the next stage's pp rank
    STEP_RECV_ACTIVATION,   // the forward's input from the previous stage's pp rank
    STEP_SEND_GRADIENT,     // the backward's input-gradient to the previous stage's pp rank
    STEP_RECV_GRADIENT,     // the backward's output-gradient from the next stage's pp rank
} StepOpKind;

typedef struct {
    StepOpKind kind;
    int chunk;        // chunk of this process's model (0: a rank holds one)
    int micro_batch;  // 0 .. grad_accum - 1 within the step, in the loader's order
    int slot;         // the boundary slot the op reads or writes, 0 .. n_slots - 1; -1 for STEP_BACKWARD_WEIGHT
    int act;          // compute ops: the activation set, 0 .. n_acts - 1; -1 for messages
    int peer;         // message ops: the pp rank at the other end; -1 for compute ops
    int local_slot;   // the previous stage is on this rank: a forward's input is this slot's output, a backward's
                      // input-gradient goes to this slot's output-gradient; -1 otherwise
} StepOp;

typedef struct {
    StepOp *ops;      // owned
    int n_ops;
    int n_slots;      // boundary slots the ops use at most at once
    int n_acts;       // activation sets the ops use at most at once
    int *act_chunk;   // (n_acts, owned) the chunk whose activations each set holds (a chunk's own shape)
} StepPlan;

// F0 B0 F1 B1 ... F(A-1) B(A-1) on chunk 0, all in activation set 0 and boundary slot 0. Returns 0, or -1 with err (grad_accum < 1, or
// out of memory).
int step_plan_one_process(StepPlan *p, int grad_accum, char *err, size_t err_size);
// pp rank `rank`'s ops of schedule s (built for the step's micro-batches), with their slots. Returns 0, or -1
// with err (out of memory, or rank outside the schedule).
int step_plan_pipeline(StepPlan *p, const Schedule *s, int rank, char *err, size_t err_size);
void step_plan_free(StepPlan *p);
// Forwards and the three backward kinds; the rest are messages.
int step_op_is_compute(StepOpKind k);
// "0F3" (chunk 0, micro-batch 3), "1B3", "1I3", "1W3", "s0A3>1" (send the activation of chunk 0's micro-batch 3 to pp rank 1),
// "r0A3<0", "s1G3>0", "r1G3<2": for error messages and tests.
void step_op_format(const StepOp *op, char *buf, size_t size);

#endif
