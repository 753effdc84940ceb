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

// logits (N, V), targets (N) int32 with -1 = masked -> probs (N, V) = softmax(logits) for every row,
// losses (N) = -log probs[target] for unmasked rows, 0 for masked rows. The loss is computed as
// log(sum) + max - logit[target] rather than from the rounded probability, so it stays accurate
// when the target's probability is tiny.
void cpu_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V) {
    check_targets("crossentropy_forward", targets, N, V);
#pragma omp parallel for schedule(static) if ((int64_t)N * V >= 16384)
    for (int n = 0; n < N; n++) {
        const real *x = logits + (size_t)n * V;
        real *p = probs + (size_t)n * V;
        const int target = targets[n];
        const real x_target = target < 0 ? (real)0 : x[target];  // read before p (may alias x) is written
        real maxval = -INFINITY;
        for (int i = 0; i < V; i++) {
            if (x[i] > maxval) maxval = x[i];
        }
        // the normaliser is summed in double: in FP32 a running sum over a large vocabulary drops the
        // smallest terms and is biased low (1.7e-4 relative at V = 129280)
        double sum = 0;
        for (int i = 0; i < V; i++) {
            p[i] = exp(x[i] - maxval);
            sum += p[i];
        }
        for (int i = 0; i < V; i++) p[i] = (real)(p[i] / sum);
        losses[n] = target < 0 ? (real)0 : (real)((log(sum) + maxval) - x_target);
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
