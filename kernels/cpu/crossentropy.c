/*
 * crossentropy.c - CPU reference of the fused softmax + cross-entropy loss (crossentropy_forward /
 * _backward in kernels.h), used by the output head and every MTP depth.
 *
 * Rows are independent, so OpenMP splits over rows; each row's max and sum run over the vocabulary in
 * order, so results do not depend on the thread count. A target of -1 masks a row (loss 0, gradient 0),
 * which is how MTP marks the last positions of a sequence that have nothing left to predict.
 */
#include <stdio.h>
#include <stdlib.h>
#include <tgmath.h>

#include "kernels/cpu/cpu_ops.h"

static void check_targets(const char *op, const int *targets, int N, int V) {
    for (int n = 0; n < N; n++) {
        if (targets[n] < -1 || targets[n] >= V) {
            fprintf(stderr, "fp8moe: kernels/cpu/crossentropy.c:%d: %s: target %d at row %d is out of range; "
                            "expected -1 (masked) or an id in [0, %d)\n", __LINE__, op, targets[n], n, V);
            exit(1);
        }
    }
}

// One row's maximum and sum of exp(x - max) (x (V)), with p (V, may be x) = exp(x - max) when given. The
// normaliser is summed in double: in FP32 a running sum over a large vocabulary drops the smallest terms and is
// biased low (1.7e-4 relative at V = 129280).
static void row_stats(real *p, const real *x, int V, real *max_out, double *sum_out) {
    real maxval = -INFINITY;
    for (int i = 0; i < V; i++) {
        if (x[i] > maxval) maxval = x[i];
    }
    double sum = 0;
    for (int i = 0; i < V; i++) {
        const real e = exp(x[i] - maxval);
        if (p) p[i] = e;
        sum += e;
    }
    *max_out = maxval, *sum_out = sum;
}

// -log softmax(x)[target] as log(sum) + max - x[target], not from the rounded probability, so it stays accurate
// when the target's probability is tiny; 0 for a masked row.
static real row_loss(int target, real maxval, double sum, real x_target) {
    return target < 0 ? (real)0 : (real)((log(sum) + maxval) - x_target);
}

// The probability of logit x in a row of those statistics: the bits the FP32 forward stores.
static real row_prob(real x, real maxval, double sum) {
    const real e = exp(x - maxval);
    return (real)(e / sum);
}

// logits (N, V), targets (N) int32 with -1 = masked -> probs (N, V) = softmax(logits) for every row,
// losses (N) = -log probs[target] for unmasked rows, 0 for masked rows.
void cpu_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V) {
    check_targets("crossentropy_forward", targets, N, V);
#pragma omp parallel for schedule(static) if ((int64_t)N * V >= 16384)
    for (int n = 0; n < N; n++) {
        const real *x = logits + (size_t)n * V;
        real *p = probs + (size_t)n * V;
        const int target = targets[n];
        const real x_target = target < 0 ? (real)0 : x[target];  // read before p (may alias x) is written
        real maxval;
        double sum;
        row_stats(p, x, V, &maxval, &sum);
        for (int i = 0; i < V; i++) p[i] = (real)(p[i] / sum);
        losses[n] = row_loss(target, maxval, sum, x_target);
    }
}

// BF16 logits (N, V): each row widened to real, then the forward above without its probabilities.
void cpu_crossentropy_forward_bf16(real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                                   const int *targets, int N, int V) {
    check_targets("crossentropy_forward_bf16", targets, N, V);
    CpuRegionError err = {0};  // a thread's row that cannot be allocated (scratch.c)
#pragma omp parallel if ((int64_t)N * V >= 16384)
    {
        real *x = cpu_region_alloc(&err, sizeof(real) * (size_t)V, 0, "a widened logits row");
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            if (x == NULL) continue;
            for (int i = 0; i < V; i++) x[i] = (real)bf16_to_float(logits[(size_t)n * V + i]);
            row_stats(NULL, x, V, &row_max[n], &row_sum[n]);
            losses[n] = row_loss(targets[n], row_max[n], row_sum[n], targets[n] < 0 ? (real)0 : x[targets[n]]);
        }
        free(x);
    }
    cpu_region_check(&err);
}

void cpu_crossentropy_probs_bf16(real *probs, const uint16_t *logits, const real *row_max, const double *row_sum,
                                 int N, int V) {
#pragma omp parallel for schedule(static) if ((int64_t)N * V >= 16384)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < V; i++)
            probs[(size_t)n * V + i] = row_prob((real)bf16_to_float(logits[(size_t)n * V + i]), row_max[n], row_sum[n]);
}

// The backward below on the probabilities recomputed from the statistics, its result rounded to BF16 (RNE).
void cpu_crossentropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                    const double *row_sum, const int *targets, real dloss, int N, int V) {
    check_targets("crossentropy_backward_bf16", targets, N, V);
#pragma omp parallel for schedule(static) if ((int64_t)N * V >= 16384)
    for (int n = 0; n < N; n++) {
        const uint16_t *x = logits + (size_t)n * V;
        uint16_t *d = dlogits + (size_t)n * V;
        const int target = targets[n];
        if (target < 0) {
            for (int i = 0; i < V; i++) d[i] = float_to_bf16(0.0f);
            continue;
        }
        for (int i = 0; i < V; i++) {
            const real p = row_prob((real)bf16_to_float(x[i]), row_max[n], row_sum[n]);
            d[i] = float_to_bf16((float)(i == target ? (p - (real)1) * dloss : p * dloss));
        }
    }
}

// In the forward pass this was loss = -log softmax(logits)[target], so
//   dlogits (N, V) = (probs - onehot(target)) * dloss for unmasked rows, 0 for masked rows.
// This op WRITES dlogits (the logits have no other consumer to accumulate with).
void cpu_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N, int V) {
    check_targets("crossentropy_backward", targets, N, V);
#pragma omp parallel for schedule(static) if ((int64_t)N * V >= 16384)
    for (int n = 0; n < N; n++) {
        const real *p = probs + (size_t)n * V;
        real *d = dlogits + (size_t)n * V;
        const int target = targets[n];
        if (target < 0) {
            for (int i = 0; i < V; i++) d[i] = 0;
            continue;
        }
        const real p_target = p[target];  // read before d (may alias p) is written
#pragma omp simd
        for (int i = 0; i < V; i++) d[i] = p[i] * dloss;
        d[target] = (p_target - (real)1) * dloss;
    }
}
