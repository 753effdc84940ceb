/*
 * bias_balance.h - DeepSeek-V3's auxiliary-loss-free load balancing (DESIGN.md section 3).
 *
 * Each MoE layer keeps a bias b (E) that is added to the router scores for expert selection only.
 * After each step, with load_i = tokens routed to expert i over the whole global batch (already
 * summed over micro-batches and ranks by the caller):
 *   mean = sum_j load_j / E;   b_i += gamma * sign(mean - load_i),   sign(0) = 0
 * so over-loaded experts get less attractive and under-loaded ones more. The bias is FP32, outside
 * AdamW and without gradient.
 */
#ifndef FP8MOE_BIAS_BALANCE_H
#define FP8MOE_BIAS_BALANCE_H

#include <stdint.h>

#include "kernels/kernels.h"

// bias (E) host memory, updated in place (the add is done in double, then rounded to real);
// counts (E) >= 0 tokens per expert; gamma = moe.bias_update_speed. E >= 1.
void bias_update(real *bias, const int64_t *counts, int E, double gamma);
// max_i load_i / mean_j load_j (1 = perfect balance, E = every token on one expert), for the log.
// Returns 0 when no token was counted.
double max_mean_load(const int64_t *counts, int E);

#endif
