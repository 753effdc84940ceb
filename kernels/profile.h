/*
 * profile.h - a process-wide phase profiler for `fp8moe bench step`: where the time of a training
 * step goes (attention core, expert GEMMs, other GEMMs, FP8 quantisation, MoE permute/unpermute,
 * optimizer). It exists so the model code can mark its phases once and the benchmark can read a
 * per-step breakdown without a separate instrumented build.
 *
 * Off by default; while off, profile_begin/profile_end cost one predictable branch, so the marks stay
 * in the training path for good.
 *
 * Nesting: begin/end pairs nest as a stack and time accrues to the innermost open phase only. So
 * quantisation inside a Linear is reported under PHASE_QUANTISE and is not part of the enclosing GEMM
 * phase; the sum of the phases never counts an interval twice, and "other" = step time - sum.
 * One more rule: a PHASE_OTHER_GEMM opened while PHASE_EXPERT_GEMM is on the stack is counted as
 * PHASE_EXPERT_GEMM (train/linear.c marks every Linear as a GEMM; train/moe.c marks the routed experts'
 * FFNs as expert GEMMs, so the same Linear code is attributed by its caller). The expert phase thus
 * also holds the SwiGLU activation between the experts' GEMMs.
 *
 * Timing: on DEVICE_CPU the host clock (omp_get_wtime) at every push/pop; on DEVICE_CUDA a cudaEvent
 * recorded on the default stream (every op is a step of it: gemm.cu's lanes join back into it) at every
 * push/pop, from a preallocated pool (grown if a step needs more); the intervals are summed at collect
 * after cudaEventSynchronize.
 * Marks must come from one host thread (the ops' OpenMP parallelism lives inside the ops).
 * Misuse (end without the matching begin, nesting deeper than PROFILE_MAX_DEPTH, collect with phases
 * open) stops the process with a message naming the phase: it is a bug in the marks, not user input.
 */
#ifndef FP8MOE_PROFILE_H
#define FP8MOE_PROFILE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

typedef enum {
    PHASE_ATTENTION,    // attention core: attention_forward / attention_backward (train/mla.c)
    PHASE_EXPERT_GEMM,  // routed experts' FFNs (train/moe.c experts_forward / experts_backward)
    PHASE_OTHER_GEMM,   // every other linear_* call, and the router's matmuls
    PHASE_QUANTISE,     // fp8_quantize_* inside train/linear.c
    PHASE_PERMUTE,      // MoE permute plan, gather, combine and unpermute (train/moe.c)
    PHASE_OPTIMIZER,    // gradient norm + AdamW (the caller's step loop)
    // communication (zero in one process). Each is the time the call took on this rank, waiting for its peers
    // included: a rank that waits for a slower one counts that wait here, not in "other".
    PHASE_EP_COMM,      // the expert-parallel all-to-alls of dispatch and combine, forward and backward (parallel/ep.c)
    PHASE_PIPE_WAIT,    // waiting for the pipeline's activation and gradient messages, and for the other stages to
                        // finish their ops at the step's end (the loss agreement when pp > 1; train/step.c)
    PHASE_GRAD_SYNC,    // the step's reductions over ranks: loss agreement, gradients, norm, ZeRO-1 gathers, load
    PHASE_COUNT
} Phase;

#define PROFILE_MAX_DEPTH 16
#define PROFILE_MAX_CHUNKS 2  // model chunks a process holds (train/model.h PLACEMENT_MAX_CHUNKS)

// The compute ops of a step's op list (train/step.c), each timed whole besides the phases inside it, by kind and by
// the model chunk it runs (a pipeline rank holds one or two): what `fp8moe bench step` gives the pipeline simulator
// as the measured costs of every stage (parallel/schedule_sim.h).
// FORWARD: F; BACKWARD: B (a full backward); BACKWARD_INPUT: I, its input-gradient part; BACKWARD_WEIGHT: W, the
// weight-gradient part (parallel/schedule.h).
typedef enum {
    PROFILE_OP_FORWARD,
    PROFILE_OP_BACKWARD,
    PROFILE_OP_BACKWARD_INPUT,
    PROFILE_OP_BACKWARD_WEIGHT,
    PROFILE_OP_COUNT
} ProfileOp;

// Turns the profiler on (1) or off (0) for ops on dev, and clears all accumulated time and the
// memory peak. Turning on for DEVICE_CUDA in a build without CUDA stops with a message.
void profile_enable(Device dev, int on);
int profile_enabled(void);

// Opens / closes phase p. profile_end's p must be the innermost open phase.
void profile_begin(Phase p);
void profile_end(Phase p);
// The phase time accrues to now: the innermost open one as charged (PHASE_OTHER_GEMM inside PHASE_EXPERT_GEMM is
// PHASE_EXPERT_GEMM); PHASE_OTHER_GEMM when none is open or the profiler is off. A GEMM run later on behalf of the
// code running now (a W ticket, train/wgrad_ticket.h) is counted in it.
Phase profile_current_phase(void);

// Opens / closes op k of chunk `chunk` (0 .. PROFILE_MAX_CHUNKS - 1; ops do not nest). Time still accrues to the
// phases as before: an op mark is only a boundary of the phase intervals.
void profile_op_begin(ProfileOp k, int chunk);
void profile_op_end(ProfileOp k);
// The seconds and the number of the ops of each chunk and kind that ended since profile_enable, as of the last
// profile_step_collect (which reads the device's timings).
void profile_op_totals(double seconds[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT],
                       int64_t counts[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT]);

// Waits for the device, writes the seconds accrued to each phase since the last collect (or enable)
// into seconds_out[PHASE_COUNT], samples the memory in use into the peak, and resets the times.
// All zeros while the profiler is off.
void profile_step_collect(double seconds_out[PHASE_COUNT]);

// Peak memory seen since profile_enable, in bytes. DEVICE_CUDA: the maximum of (total - free) from
// cudaMemGetInfo over the collects (device-wide, so it includes the CUDA context and the other
// processes on the GPU). DEVICE_CPU: the process's peak resident set (getrusage ru_maxrss), which
// never decreases within a process. 0 while off.
double profile_peak_memory_bytes(void);

// "attention", "expert GEMM", ... for tables.
const char *profile_phase_name(Phase p);

#endif
