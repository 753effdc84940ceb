/*
 * optim_ops.c - CPU reference of the optimizer-side ops of kernels.h: the AdamW update with BF16
 * moments, the sum of squares behind the global gradient norm, and two flat-buffer helpers.
 *
 * These run over the whole flat parameter / gradient buffers once per step. They are elementwise
 * except sum_squares, whose reduction order is fixed by a chunking that depends only on n (never on
 * the thread count), so the grad norm, and therefore the clip scale and every update after it, are
 * bitwise-identical whatever OMP_NUM_THREADS is.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_ops.h"

// ---------------------------------------------------------------------------- AdamW
// param (n) FP32 master (real), grad (n) real, m (n) and v (n) BF16 bit patterns; updated in place.
// The arithmetic is FP32 in exactly this order (the CUDA kernel must use the same order and the
// same host-computed bias corrections, because the BF16 store turns any FP32 difference that
// crosses a rounding boundary into a 2^-8 relative jump of the moment):
//   g    = grad * grad_scale
//   m32  = beta1 * m + (1 - beta1) * g                 -> m = bf16_rne(m32)
//   v32  = beta2 * v + (1 - beta2) * (g * g)           -> v = bf16_rne(v32)
//   mhat = m32 / bc1,  vhat = v32 / bc2,   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
//          (bc computed once in double, rounded to float)
//   upd  = mhat / (sqrt(vhat) + eps) + weight_decay * p
//   p    = p - lr * upd
// The update uses the FP32 moments of this step (before the BF16 store), as an FP32 optimizer
// that keeps its state in BF16 does: the rounding only affects what the next step reads.
// In the FP8MOE_REAL_DOUBLE build the last line runs in double on the double master weight.
void cpu_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t) {
    if (t < 1) {
        fprintf(stderr, "fp8moe: cpu_adamw_update (kernels/cpu/optim_ops.c): step t = %d, expected t >= 1 "
                        "(bias correction divides by 1 - beta^t)\n", t);
        exit(1);
    }
    const float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    const float one_minus_beta1 = 1.0f - beta1;
    const float one_minus_beta2 = 1.0f - beta2;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float g = (float)grad[i] * grad_scale;
        float m32 = beta1 * bf16_to_float(m[i]) + one_minus_beta1 * g;
        float v32 = beta2 * bf16_to_float(v[i]) + one_minus_beta2 * (g * g);
        m[i] = float_to_bf16(m32);
        v[i] = float_to_bf16(v32);
        float mhat = m32 / bc1;
        float vhat = v32 / bc2;
        float upd = mhat / (sqrtf(vhat) + eps) + weight_decay * (float)param[i];
        param[i] = param[i] - (real)lr * (real)upd;
    }
}

// ---------------------------------------------------------------------------- reductions, helpers
// x (n) -> sum of x[i]^2 in double. Fixed order: chunks of SUM_SQUARES_CHUNK consecutive elements are
// each summed left to right, then the chunk sums are added left to right. The chunking depends only
// on n, so threads merely decide who computes which chunk.
#define SUM_SQUARES_CHUNK 16384
double cpu_sum_squares(const real *x, int64_t n) {
    if (n <= 0) return 0.0;
    const int64_t n_chunks = (n + SUM_SQUARES_CHUNK - 1) / SUM_SQUARES_CHUNK;
    double *partial = malloc((size_t)n_chunks * sizeof *partial);
    if (!partial) {
        fprintf(stderr, "fp8moe: cpu_sum_squares (kernels/cpu/optim_ops.c): out of memory for %lld "
                        "chunk sums\n", (long long)n_chunks);
        exit(1);
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n_chunks; c++) {
        int64_t begin = c * SUM_SQUARES_CHUNK;
        int64_t end = begin + SUM_SQUARES_CHUNK < n ? begin + SUM_SQUARES_CHUNK : n;
        double s = 0.0;
        for (int64_t i = begin; i < end; i++) s += (double)x[i] * (double)x[i];
        partial[c] = s;
    }
    double total = 0.0;
    for (int64_t c = 0; c < n_chunks; c++) total += partial[c];
    free(partial);
    return total;
}

// x (n) *= s
void cpu_scale_inplace(real *x, real s, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

// y (n) += x (n)
void cpu_add_inplace(real *y, const real *x, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}
