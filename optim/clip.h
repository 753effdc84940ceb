/*
 * clip.h - global gradient-norm clipping.
 *
 * The norm is over every gradient of the model on every rank, so it is computed in two halves with
 * a seam for the communication in between:
 *   local  = sum_squares(grads of this rank's buffers)            (kernels.h, fixed order, double)
 *   global = all-reduce(local) over the ranks that hold distinct parameters (parallel/comm.h, later)
 *   norm   = grad_norm_from_sum_squares(global)
 *   scale  = clip_scale(norm, grad_clip)  -> passed to adamw_step as grad_scale
 * On one rank grad_global_norm does the first and third lines in one call. The gradients are never
 * rescaled in memory; AdamW multiplies by the scale on the fly.
 * The trainer checks the norm is finite before using it: a NaN/Inf norm is an error to report, not
 * something to clip (clip_scale returns NaN for it rather than a silent 0 or 1).
 */
#ifndef FP8MOE_CLIP_H
#define FP8MOE_CLIP_H

#include <stdint.h>

#include "kernels/kernels.h"

// grads (n) on dev -> sqrt(sum of squares), the norm of this buffer alone.
double grad_global_norm(Device dev, const real *grads, int64_t n);
// sum_sq >= 0, already reduced over ranks and buffers -> the L2 norm sqrt(sum_sq).
double grad_norm_from_sum_squares(double sum_sq);
// min(1, max_norm / (norm + 1e-6)); max_norm = 0 means no clipping (returns 1); max_norm < 0 stops
// the process with a message (the config rejects it first).
float clip_scale(double norm, double max_norm);

#endif
