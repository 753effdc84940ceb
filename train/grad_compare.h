/*
 * grad_compare.h - `fp8moe gradcompare`: one training step's gradients of a job in several precision modes
 * at the same weights and on the same batch, compared tensor by tensor with the first mode's (issue 22).
 *
 * `fp8moe compare` says how far the modes' losses drift apart over a run; this says where they differ at
 * the source, before any drift: per parameter tensor, the L2 norm of each mode's gradient, its cosine with
 * the reference mode's (the first listed; fp32 is the natural one) and the ratio of the norms. The
 * gradients are the raw ones of the job's first global batch, before the clip (train_step leaves them in
 * Model.grads: the clip is only a factor given to AdamW), at the initial weights of train.seed or at the
 * weights of a weights.h5 (--weights). One process, one mode's TrainState at a time. docs/training.md,
 * "Comparing gradients", describes the CSV and the summary.
 */
#ifndef FP8MOE_GRAD_COMPARE_H
#define FP8MOE_GRAD_COMPARE_H

extern const char *const grad_compare_usage;

// argv holds the arguments after `gradcompare`. Returns the process exit status: 0, 1 (a step, the weights
// file or the CSV failed), 2 (bad usage, an invalid job or override, a parallel layout other than one process).
int grad_compare_main(int argc, char **argv);

#endif
