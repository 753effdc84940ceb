/*
 * schedule.h - pipeline schedules as data (DESIGN.md section 6, issue 20): for every pp rank an ordered
 * list of ops over the rank's one or two model chunks and the step's micro-batches, the generators of
 * 1F1B, ZB1P (ZB-H1), DualPipe and DualPipeV, and a static validator for any op list.
 *
 * Why data: the executor (train/step.c, a later task) runs whatever list it is handed, the simulator
 * (parallel/schedule_sim.h) times it, and the validator proves it complete and deadlock-free before a
 * single rank starts. A schedule bug then shows up as a named op in one process, not as a hung job.
 *
 * Pipes, stages and chunks. A pipe is one pass of micro-batches through the model's stages 0 .. S-1:
 * the forward enters at stage 0 (the data) and has its loss at stage S-1; the backward runs S-1 .. 0.
 * Every (pipe, stage) lives on exactly one (rank, chunk):
 *   1f1b, zb1p   1 pipe, S = P stages, rank r chunk 0 = stage r.
 *   dualpipe     2 pipes (directions A and B, N/2 micro-batches each), S = P; rank r chunk 0 = stage r of
 *                A, chunk 1 = stage P-1-r of B: A enters at rank 0 and has its loss at rank P-1, B the
 *                reverse. Every stage exists twice (2x parameters).
 *   dualpipev    1 pipe, S = 2P stages; rank r chunk 0 = stage r, chunk 1 = stage 2P-1-r: data and loss
 *                on rank 0; at rank P-1 stage P-1 hands to stage P without a message.
 * Micro-batch numbers in ops count within their pipe (0 .. N/n_pipes - 1); micro-batch m of pipe d is
 * micro-batch d * (N / n_pipes) + m of the step's global batch (the loader's order).
 *
 * Ops (SchedOp). Compute ops: F (forward of chunk, mb), B (full backward), I (input-gradient part of the
 * backward: it sends the gradient on and leaves a W ticket in the rank's FIFO), W (weight-gradient part:
 * runs the oldest ticket; chunk, mb name that ticket, which the validator checks), FB (forward of chunk,
 * mb overlapped with the full backward of chunk_b, mb_b). Messages: SEND / RECV of an activation
 * (SCHED_ACT: a forward's output to the next stage's rank, or a forward's input from the previous
 * one) or a gradient (SCHED_GRAD: a backward's input-gradient to the previous stage's rank, or a
 * backward's output-gradient from the next one); chunk, mb name the local op the message belongs to,
 * peer the other pp rank. Between two stages on one rank nothing is sent.
 *
 * Message semantics: a maximal run of consecutive SEND / RECV ops is one batch. The rank posts the whole
 * batch at once (MPI: an Isend / Irecv per op, then Waitall; NCCL: one group) and goes on to its next
 * compute op only when every op of the batch has completed; an op completes once the peer has posted
 * its matching op. On each (src, dst) pair messages match in posting order (DESIGN.md section 6): the
 * k-th SEND of src to dst is the k-th RECV of dst from src, and must carry the same tensor.
 *
 * Compact form (schedule_op_format, `fp8moe schedule --print-ops`): `0F3` forward of chunk 0, mb 3;
 * `1B2` full backward; `1I2` input-gradient backward; `W` weight-gradient backward (its ticket is the
 * FIFO's oldest); `(0F7;1B3)` FB. Messages (shown with --print-ops=all, a batch in brackets):
 * `s0F3>1` send the output of 0F3 to rank 1, `r0F3<0` receive the input of 0F3 from rank 0,
 * `s1B2>0` send the input-gradient of 1B2 (or 1I2) to rank 0, `r1B2<2` receive its output-gradient
 * from rank 2.
 *
 * Mapping to the executor (train/step.h's StepOp list, which today has F and B only):
 *   F (c, m)       -> STEP_FORWARD chunk c, micro_batch = schedule_global_mb(s, c, m)
 *   B (c, m)       -> STEP_BACKWARD chunk c, same micro_batch
 *   I (c, m)       -> a new STEP_BACKWARD_INPUT: the backward that stops before the weight gradients and
 *                     appends its W tickets (one per Linear) to the rank's FIFO
 *   W              -> a new STEP_BACKWARD_WEIGHT: runs the oldest FIFO entry (every ticket of one I)
 *   FB             -> a new STEP_FORWARD_BACKWARD (or F then B on one stream, which is correct but
 *                     forgoes the overlap); its forward's messages on the communication stream
 *   SEND / RECV    -> new STEP_SEND / STEP_RECV with peer and tensor kind: post the batch nonblocking,
 *                     wait for its receives before the next compute op, and for a send only before its
 *                     buffer is reused or at the step's end. (Waiting for the sends at the batch too is
 *                     deadlock-free, which is what the validator checks, but costs ZB1P most of its
 *                     gain: schedule_sim's wait_sends.) A RECV's buffer is the input of the op it names
 *                     (forward) or its output-gradient (backward); a SEND's is that op's output or
 *                     input-gradient.
 * The executor also needs a live activation set per (chunk, mb) up to schedule_memory's peak (step.h's
 * one set today), the loss scale 1 / (N x dp) for every micro-batch, and the gradients of a stage's two
 * copies (DualPipe) summed before the optimizer step.
 *
 * Error behaviour: every function that can fail returns -1 with one line in err naming the numbers
 * (generators) or the rank, op index and op (validator); nothing is printed.
 */
#ifndef FP8MOE_SCHEDULE_H
#define FP8MOE_SCHEDULE_H

#include <stddef.h>
#include <stdio.h>

#define SCHED_MAX_PP 128  // pp ranks a schedule may have
#define SCHED_MAX_MB 65536

typedef enum { SCHED_1F1B, SCHED_ZB1P, SCHED_DUALPIPE, SCHED_DUALPIPEV } SchedKind;

typedef enum { SCHED_F, SCHED_B, SCHED_I, SCHED_W, SCHED_FB, SCHED_SEND, SCHED_RECV } SchedOpKind;

typedef enum { SCHED_ACT, SCHED_GRAD } SchedMsg;

typedef struct {
    SchedOpKind kind;
    int chunk, mb;      // F, B, I, FB (its forward), W (its ticket), SEND / RECV (the local op served)
    int chunk_b, mb_b;  // FB: the backward; -1 otherwise
    int peer;           // SEND / RECV: the other pp rank; -1 otherwise
    SchedMsg msg;       // SEND / RECV: activation or gradient
} SchedOp;

typedef struct {
    int pipe, stage;  // the pipe and the stage of it a (rank, chunk) holds
} SchedChunk;

typedef struct {
    SchedKind kind;
    int pp;                                // ranks
    int n_mb;                              // micro-batches of the step, all pipes together
    int n_pipes;                           // 1, or 2 (dualpipe)
    int mb_per_pipe;                       // n_mb / n_pipes
    int n_stages;                          // stages per pipe
    int n_chunks;                          // chunks per rank (1 or 2)
    SchedChunk chunk[SCHED_MAX_PP][2];     // where every (pipe, stage) lives
    int n_ops[SCHED_MAX_PP];
    int cap_ops[SCHED_MAX_PP];             // room in ops[r]
    SchedOp *ops[SCHED_MAX_PP];            // owned; schedule_free releases them
} Schedule;

// "1f1b", "zb1p", "dualpipe", "dualpipev" <-> kind. schedule_kind_parse returns -1 on another name.
const char *schedule_kind_name(SchedKind kind);
int schedule_kind_parse(const char *name, SchedKind *kind);

// Builds the schedule of kind for pp ranks and n_mb micro-batches into *s (every rank's ops, the chunk
// map). Constraints: pp >= 1, 1 <= n_mb <= SCHED_MAX_MB; dualpipe: pp even, n_mb even, n_mb >= 2 pp;
// dualpipev: n_mb >= 2 pp. Returns 0, or -1 with err naming the kind and the numbers, *s then empty.
int schedule_build(Schedule *s, SchedKind kind, int pp, int n_mb, char *err, size_t err_size);
void schedule_free(Schedule *s);

// The (rank, chunk) holding stage `stage` of pipe `pipe`; -1 when there is none.
int schedule_stage_rank(const Schedule *s, int pipe, int stage, int *chunk);
// The global micro-batch (the loader's order) of micro-batch mb of rank's chunk.
int schedule_global_mb(const Schedule *s, int rank, int chunk, int mb);

// Checks every rank's ops: each (chunk, mb) forwarded once and backwarded once (B, I or the backward
// of an FB); a forward after its input arrived (a RECV, or the previous stage on this rank), a backward
// after its own forward and its output-gradient; every I's ticket run by a W, in FIFO order; every
// message between two ranks sent after the op that produces it, received before the op that uses it,
// and exactly once; on every (src, dst) pair the k-th SEND matching the k-th RECV; and no deadlock
// under the batch semantics above. Returns 0, or -1 with err naming the rank, op index and op.
int schedule_validate(const Schedule *s, char *err, size_t err_size);

// For every message op, the index of its matching op on the peer (in match[r][i], -1 for compute ops;
// each match[r] holds n_ops[r] ints, allocated here; free with schedule_free_matches). Returns 0, or -1
// with err as schedule_validate (it is its pair check).
int schedule_match_messages(const Schedule *s, int **match, char *err, size_t err_size);
void schedule_free_matches(const Schedule *s, int **match);

// Peak live activation sets of one rank, counted from the op order: a (chunk, mb) set is live from
// its forward until its backward has run in full (B, the backward of an FB, or the W of an I: a W
// ticket keeps X's and dY's operands). In an FB the forward's set is counted before the backward's is
// freed. Unit: one chunk's activations of one micro-batch. *param_chunks: the chunks the rank holds.
void schedule_memory(const Schedule *s, int rank, int *act_peak, int *param_chunks);

// The compact form of one op (see above) into buf; returns its length (snprintf's).
int schedule_op_format(const SchedOp *op, char *buf, size_t size);
// Every rank's ops, one line per rank ("rank R: op op ..."); with_messages adds the SEND / RECV ops,
// each batch in brackets.
void schedule_print_ops(const Schedule *s, FILE *f, int with_messages);

#endif
