/*
 * trainer.h - `fp8moe train`: the whole training loop of DESIGN.md section 2, in one process or as one
 * rank of a data-parallel job (parallel.dp ranks under mpirun, each training its part of the global
 * batch; train/step.h says where they sum).
 *
 * trainer_run prepares the data (or uses data.shards), builds the model and AdamW, then runs
 * train.steps optimizer steps of grad_accum micro-batches each, with global-norm clipping, the LR
 * schedule, the aux-loss-free bias update, periodic validation, a log line per log.every steps and a
 * JSON Lines metrics file. Every output location is checked and locked before the first step
 * (train/run_dir.h). With checkpoint.every_steps a resumable checkpoint is written every N steps and at the
 * end (train/checkpoint.h). SIGINT/SIGTERM finish the current step (or stop an evaluation), save the
 * weights (and a checkpoint) and return 0; a second signal exits at once (status 130) unless a save has
 * begun.
 */
#ifndef FP8MOE_TRAINER_H
#define FP8MOE_TRAINER_H

#include "train/config.h"

// Returns 0 on success (also after a requested stop), 2 when the parallel layout does not fit the
// launch (world size, nodes, device), 1 on any other error (already printed to stderr, naming the
// file, key or step at fault). Under mpirun every rank runs it; only world rank 0 prints progress and
// writes the outputs.
// resume: NULL, or a checkpoint to continue from (DIR/step_NNNNNNNN, DIR/latest or DIR, docs/checkpoints.md):
// the state is loaded after it is built (any data / expert / ZeRO-1 layout) and training goes on from its step.
int trainer_run(const Config *cfg, const char *resume);

#endif
