/*
 * optim_config.h - the optimizer's numbers as the job file's [optim] section gives them: learning-rate
 * schedule, AdamW hyperparameters and gradient clipping.
 *
 * It lives here, below train/, so that optim/ takes its numbers without including the trainer's config
 * (train/config.h includes this file and embeds the struct in its Config).
 */
#ifndef FP8MOE_OPTIM_CONFIG_H
#define FP8MOE_OPTIM_CONFIG_H

typedef enum { LR_COSINE = 0, LR_WSD = 1 } LrSchedule;
typedef struct {
    double lr;            // peak learning rate
    double min_lr;        // final learning rate of the decay
    int warmup_steps;
    LrSchedule schedule;
    double decay_frac;    // wsd: fraction of steps spent in the final decay
    double beta1, beta2, eps;
    double weight_decay;
    double grad_clip;     // max global grad norm; 0 = off
} OptimConfig;

#endif
