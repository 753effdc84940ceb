/*
 * bias_balance.c - the aux-loss-free expert-bias update and the max/mean load metric.
 * sign(mean - load_i) is taken in integers as sign(total - E * load_i), so an expert at exactly the
 * mean load is left unchanged with no floating-point doubt.
 */
#include "optim/bias_balance.h"

#include <stdio.h>
#include <stdlib.h>

// Checks E and the counts, returns sum_i counts[i].
static int64_t total_load(const int64_t *counts, int E, const char *fn) {
    if (E < 1) {
        fprintf(stderr, "fp8moe: %s (optim/bias_balance.c): E = %d experts, expected E >= 1\n", fn, E);
        exit(1);
    }
    int64_t total = 0;
    for (int i = 0; i < E; i++) {
        if (counts[i] < 0) {
            fprintf(stderr, "fp8moe: %s (optim/bias_balance.c): expert %d has count %lld, expected a "
                            "token count >= 0\n", fn, i, (long long)counts[i]);
            exit(1);
        }
        total += counts[i];
    }
    return total;
}

void bias_update(real *bias, const int64_t *counts, int E, double gamma) {
    int64_t total = total_load(counts, E, "bias_update");
    for (int i = 0; i < E; i++) {
        int64_t mean_minus_load_times_E = total - (int64_t)E * counts[i];
        double sign = mean_minus_load_times_E > 0 ? 1.0 : (mean_minus_load_times_E < 0 ? -1.0 : 0.0);
        bias[i] = (real)((double)bias[i] + gamma * sign);
    }
}

double max_mean_load(const int64_t *counts, int E) {
    int64_t total = total_load(counts, E, "max_mean_load");
    if (total == 0) return 0.0;
    int64_t max = counts[0];
    for (int i = 1; i < E; i++) if (counts[i] > max) max = counts[i];
    return (double)max * (double)E / (double)total;
}
