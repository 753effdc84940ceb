/*
 * wgrad_ticket.h - the weight-gradient GEMMs of one backward, held for later: the W ticket of the pipeline
 * schedules' I/W split (parallel/schedule.h: I runs the input-gradient part of a backward and leaves a ticket,
 * W runs it).
 *
 * Why: ZB1P and DualPipe fill their pipeline bubbles by running a micro-batch's weight gradients (about a third
 * of its backward) later than its input gradients, which the previous stage is waiting for. While a RunCtx has a
 * ticket (RunCtx.wgrad_ticket), every block Linear's backward (train/linear.c) makes its Wgrad operands as it
 * would (fp8: dY and X in 128x1 tiles; bf16: dY and X rounded; fp32: copies of dY and X) in the ticket's own
 * storage instead of scratch, and records the GEMM instead of running it; wgrad_ticket_run runs the recorded
 * GEMMs in the order they were recorded. Each weight gradient thus gets the same products added in the same
 * order as without the split: the same bits. The weight gradients of what is not a block Linear (norms, router,
 * embedding, head) are small and stay in the input-gradient part.
 *
 * Storage: device memory on the model's device, in blocks that never move while the ticket holds GEMMs (a block
 * is added when one runs out, of at least the capacity so far); once run, a ticket of several blocks is remade as
 * one block of their total and a quarter, so a ticket reaches its size in the first step and allocates nothing
 * after, unless a later micro-batch's routed rows (which vary with the routing, and with expert parallelism) need
 * more again.
 */
#ifndef FP8MOE_WGRAD_TICKET_H
#define FP8MOE_WGRAD_TICKET_H

#include <stddef.h>

#include "kernels/kernels.h"
#include "kernels/profile.h"
#include "train/run_ctx.h"

typedef enum { WGRAD_FP8, WGRAD_BF16, WGRAD_FP32 } WgradForm;

// One recorded Wgrad GEMM: dw (n_groups, OC, C) += per group g, over rows [offsets[g], offsets[g+1]):
//   WGRAD_FP8:  fp8_gemm_wgrad_grouped(dw, dy, dy_s, x, x_s) - dY and X in 128x1 tiles (kernels.h)
//   WGRAD_BF16: bf16_gemm_wgrad_grouped(dw, dy, x) - dY and X rounded to BF16
//   WGRAD_FP32: matmul_backward's weight gradient of dY (rows, OC) and X (rows, C) in FP32
// phase: the profiler phase its time is counted in (the GEMM phase that was open when it was recorded).
typedef struct {
    WgradForm form;
    Phase phase;
    real *dw;
    const void *dy, *x;
    const float *dy_s, *x_s;  // WGRAD_FP8 only
    int n_groups, OC, C;
    const int *offsets;       // n_groups + 1 host ints, copied by wgrad_ticket_add
} WgradGemm;

// Runs g now (what a ticket does with each GEMM it holds; train/linear.c without a ticket).
void wgrad_gemm_run(const WgradGemm *g, RunCtx *rc);

typedef struct WgradTicket WgradTicket;

WgradTicket *wgrad_ticket_create(Device dev);
void wgrad_ticket_free(WgradTicket *t);
// `bytes` of the ticket's storage (256-byte aligned), valid until the ticket has run.
void *wgrad_ticket_take(WgradTicket *t, size_t bytes);
// Records g (its offsets copied).
void wgrad_ticket_add(WgradTicket *t, const WgradGemm *g);
// GEMMs recorded and not yet run.
int wgrad_ticket_pending(const WgradTicket *t);
// Runs the recorded GEMMs in order (rc->fp8_gemm_count counts the FP8 ones as linear.h says), then empties the
// ticket for its next backward.
void wgrad_ticket_run(WgradTicket *t, RunCtx *rc);

#endif
