/*
 * clip.c - global grad norm and the clip factor (see clip.h for the multi-rank seam).
 */
#include "optim/clip.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

double grad_global_norm(Device dev, const real *grads, int64_t n) {
    return grad_norm_from_sum_squares(sum_squares(dev, grads, n));
}

double grad_norm_from_sum_squares(double sum_sq) {
    return sqrt(sum_sq);
}

float clip_scale(double norm, double max_norm) {
    if (max_norm < 0) {
        fprintf(stderr, "fp8moe: clip_scale (optim/clip.c): max_norm (optim.grad_clip) = %g, expected "
                        ">= 0 (0 = no clipping)\n", max_norm);
        exit(1);
    }
    if (!isfinite(norm)) return NAN;
    if (max_norm == 0) return 1.0f;
    double s = max_norm / (norm + 1e-6);
    return s < 1.0 ? (float)s : 1.0f;
}
