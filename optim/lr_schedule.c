/*
 * lr_schedule.c - warm-up + cosine / WSD learning rate (formulas in lr_schedule.h).
 * Computed in double from integers each step, so the value never depends on history.
 */
#include "optim/lr_schedule.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

double lr_at(const OptimConfig *o, int step, int total_steps) {
    if (total_steps < 1 || step < 0) {
        fprintf(stderr, "fp8moe: lr_at (optim/lr_schedule.c): step %d of total_steps %d; expected "
                        "total_steps >= 1 and step >= 0\n", step, total_steps);
        exit(1);
    }
    if (step >= total_steps) step = total_steps - 1;
    const int warmup = o->warmup_steps > 0 ? o->warmup_steps : 0;
    if (step < warmup) return o->lr * (double)(step + 1) / (double)warmup;

    if (o->schedule == LR_WSD) {
        double d = floor(o->decay_frac * (double)total_steps + 0.5);
        int64_t decay_steps = d > 0 ? (int64_t)d : 0;
        if (decay_steps > total_steps - warmup) decay_steps = total_steps - warmup;
        int64_t decay_start = total_steps - decay_steps;
        if (step < decay_start) return o->lr;
        return o->lr + (o->min_lr - o->lr) * (double)(step - decay_start + 1) / (double)decay_steps;
    }
    // cosine: from lr at step `warmup` down to min_lr at the last step
    int decay_intervals = total_steps - 1 - warmup;
    double p = decay_intervals > 0 ? (double)(step - warmup) / (double)decay_intervals : 1.0;
    return o->min_lr + (o->lr - o->min_lr) * 0.5 * (1.0 + cos(M_PI * p));
}
