/*
 * lr_schedule.h - the learning rate of each optimizer step: linear warm-up, then cosine or WSD decay.
 *
 * A pure function of (config, step, total), so a resumed run gets the same LR from the step counter
 * alone (the checkpoint stores only the step). Steps are 0-based: step s is the (s+1)-th update.
 *
 * With lr = peak, lo = min_lr, W = warmup_steps, N = total_steps:
 *   warm-up, s < W:      lr_at = lr * (s + 1) / W          (first step lr/W, step W-1 reaches lr)
 *   cosine, s >= W:      p = (s - W) / (N - 1 - W)          (p = 1 when N - 1 - W <= 0)
 *                        lr_at = lo + (lr - lo) * (1 + cos(pi * p)) / 2
 *                        (lr at step W, (lr + lo)/2 halfway, lo at the last step N-1)
 *   wsd, s >= W:         D = min(round(decay_frac * N), N - W) decay steps (round half up, >= 0),
 *                        decay starts at S = N - D;
 *                        s < S:  lr_at = lr                  (stable phase)
 *                        s >= S: lr_at = lr + (lo - lr) * (s - S + 1) / D
 *                        (D steps below the peak, linear, the last one N-1 at exactly lo; D = 0
 *                        means no decay phase)
 * Steps s >= N are clamped to N - 1 (an extended run keeps the final LR). step < 0 or N < 1 stops
 * the process with a message naming lr_at and the value.
 */
#ifndef FP8MOE_LR_SCHEDULE_H
#define FP8MOE_LR_SCHEDULE_H

#include "optim/optim_config.h"

double lr_at(const OptimConfig *o, int step, int total_steps);

#endif
