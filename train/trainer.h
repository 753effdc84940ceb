/*
 * trainer.h - `fp8moe train`: one process, one chunk, the whole training loop of DESIGN.md section 2.
 *
 * trainer_run prepares the data (or uses data.shards), builds the model and AdamW, then runs
 * train.steps optimizer steps of grad_accum micro-batches each, with global-norm clipping, the LR
 * schedule, the aux-loss-free bias update, periodic validation, a log line per log.every steps and a
 * JSON Lines metrics file. Every output location is checked and locked before the first step
 * (train/run_dir.h). SIGINT/SIGTERM finish the current step (or stop an evaluation), save the weights
 * and return 0; a second signal exits at once (status 130) unless the save has begun.
 */
#ifndef FP8MOE_TRAINER_H
#define FP8MOE_TRAINER_H

#include "data/loader.h"
#include "kernels/kernels.h"
#include "train/config.h"

// Returns 0 on success (also after a requested stop), 1 on an error (already printed to stderr,
// naming the file, key or step at fault).
int trainer_run(const Config *cfg);

// The setup steps of trainer_run, shared with `fp8moe bench step` (train/bench_step.c).
// Puts the shard directory of cfg's data into shard_dir (data.shards, or data.text prepared into
// data.cache_dir when not already current). Returns 0, or -1 with err set.
int trainer_prepare_data(const Config *cfg, char *shard_dir, size_t shard_dir_size, char *err, size_t err_size);
// Picks the device train.device asks for and prints the choice. Returns 0, or -1 (message printed).
int trainer_pick_device(const Config *cfg, Device *dev);
// Opens the `split` loader of the shards in shard_dir for B x T micro-batches (cfg's vocabulary and
// seed, one data-parallel rank). Returns 0, or -1 with err set.
int trainer_open_loader(const Config *cfg, const char *shard_dir, LoaderSplit split, int B, int T, DataLoader *loader,
                        char *err, size_t err_size);
// rows (B, T+1) token windows -> inputs (B, T) = rows[:, :T] and targets (B, T) = labels[:, 1:]
// (labels is rows itself for training batches, the masked labels for evaluation).
void trainer_split_batch(const int *rows, const int *labels, int B, int T, int *inputs, int *targets);

#endif
