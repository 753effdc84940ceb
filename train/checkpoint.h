/*
 * checkpoint.h - resumable training checkpoints (DESIGN.md section 7, issue 21): everything a run needs to
 * continue bit for bit, written atomically as one HDF5 file per rank that owns state plus a manifest, and
 * readable into a TrainState of the same or another parallel layout (dp, ep, ZeRO-1). The format, the
 * guarantees and how to inspect a checkpoint with h5ls are in docs/checkpoints.md.
 *
 * This is not the weights export (train/weights_io.h: one FP32 file of the whole model for sampling). A
 * checkpoint holds, by the model's global tensor names:
 *   - the FP32 master weights of every tensor, each written once (non-expert tensors by dp rank 0 of each
 *     stage, an expert's tensors by edp rank 0 of the EP rank that holds it), with the global shape and this
 *     piece's offsets as attributes;
 *   - the BF16 AdamW moments m and v (raw BF16 bits, an HDF5 16-bit float type that h5dump prints): without
 *     ZeRO-1 written like the weights, with ZeRO-1 every rank writes its shard of each region, a tensor's
 *     shard as a run of its row-major elements with attribute flat_offset;
 *   - the router biases (the aux-loss-free balancer's whole state: the expert load counts are reset after
 *     every step), written by dp rank 0 of each stage;
 *   - in the manifest: the step (which is also the LR schedule's position: lr_at(step, total_steps) is a pure
 *     function), total_steps, the training loader's cursor of every dp rank, the config, the layout and every
 *     rank file with its size.
 * There is no RNG state to keep: every random draw of fp8moe is counter-based (kernels/rng.h), a pure
 * function of train.seed (in the config) and counters the state already holds (the loader cursor's epoch;
 * the tensor names of the initialisation), so nothing else is written.
 * Every dataset is chunked with HDF5's Fletcher32 checksum filter, and the files use the HDF5 1.8 object
 * format whose superblock and object headers (groups, attributes) carry checksums too: a flipped byte is an
 * error on reading, naming the file and the tensor, never a silently different run.
 *
 * Collectives: with groups (parallel/groups.h) both functions are collective over groups->world, and every
 * rank returns the same result: a failure on any rank fails the call on every rank with that rank's message
 * ("rank R: ..."), so no rank is left waiting in a later collective. groups = NULL is one process. Every rank
 * must see the same checkpoint directory (a local disk for one host, a shared file system across hosts).
 *
 * Errors are one line in err naming the file and, where one is involved, the dataset (tensor), what was
 * found and what was expected. HDF5 prints nothing; checkpoint_save prints (world rank 0, stdout) what it
 * removes: a partial checkpoint left by a killed save, and the checkpoints that keep_last prunes.
 */
#ifndef FP8MOE_CHECKPOINT_H
#define FP8MOE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "data/loader.h"
#include "parallel/groups.h"
#include "train/config.h"
#include "train/train_state.h"

#define CHECKPOINT_FORMAT "fp8moe-checkpoint-1"
#define CHECKPOINT_MANIFEST "manifest.h5"
#define CHECKPOINT_LATEST "latest"
#define CHECKPOINT_DIR_MAX (CONFIG_PATH_MAX + 64)  // a checkpoint's path: DIR/step_NNNNNNNN

// Writes the state of ts after ts->step steps to DIR/step_NNNNNNNN (8 digits, the step):
//   1. world rank 0 makes DIR (mkdir -p), removes partial checkpoints that killed saves left
//      (DIR/step_*.tmp, DIR/latest.tmp.*) and makes DIR/step_NNNNNNNN.tmp;
//   2. every rank that owns state writes its file there (rankRRRRR-stageS-dpD-epE.h5), fsync'd;
//   3. once every rank has succeeded, world rank 0 writes manifest.h5, fsyncs the directory, renames it to
//      step_NNNNNNNN (exchanging it with an existing checkpoint of the same step, which is then removed),
//      fsyncs DIR, then points DIR/latest (a symlink to "step_NNNNNNNN") at it by an atomic rename,
//   4. and removes the oldest step_* directories beyond keep_last (<= 0 keeps all; the new one is never
//      removed). A failure to prune is a warning on stderr, not a failed save.
// A failure anywhere (a full disk, an I/O error, a cursor that differs between ranks) removes the .tmp
// directory and leaves DIR/latest and every earlier checkpoint as they were. A process killed at any moment
// leaves at most a .tmp directory, which no load reads and the next save removes. One save at a time per DIR.
// Returns 0, or -1 with err (the same on every rank).
int checkpoint_save(const TrainState *ts, const Groups *groups, const char *dir, int keep_last, char *err,
                    size_t err_size);

// Reads a checkpoint into ts, a state from train_state_create for the job to continue (the same or another
// layout: parallel.dp, parallel.ep and parallel.zero1 may differ from the run that wrote it; each rank finds
// the tensors, moment shards and router biases it holds by global name in whichever files hold them and
// assembles its ZeRO-1 shard from the pieces that overlap it). path: a checkpoint (DIR/step_NNNNNNNN), or a
// checkpoint directory DIR, whose DIR/latest is taken. Restores the weights, both AdamW regions' moments,
// the router biases, ts->step and the training loader's cursor (loader_set_cursor: the cursor must fit this
// layout's dp size). ts->total_steps stays the caller's (the job's train.steps); with another value than the
// checkpoint's the LR schedule after the step differs (checkpoint_read_info tells).
// Refused with the differing keys: a checkpoint of another model (every key of [model], [moe] and [mtp]
// must match except the training-only model.init_std, moe.bias_update_speed, moe.balance_loss_alpha and
// mtp.loss_weight). precision.mode may differ: the master weights are FP32 and the moments BF16 in every mode,
// so a run may continue in another precision (not bitwise then). Other sections ([train], [optim], [data],
// [parallel]) are the job's to choose; keys that differ there end the bitwise guarantee
// (checkpoint_config_changes lists them).
// Errors: a missing manifest or rank file, a file whose size differs from the manifest's, a Fletcher32 or
// metadata checksum failure, a tensor of the wrong shape, a tensor or moment element this rank needs that
// no file holds, each naming the file and tensor. After a failure ts holds a mix of old and loaded values:
// free it (or load again). Returns 0, or -1 with err (the same on every rank).
int checkpoint_load(TrainState *ts, const Groups *groups, const char *path, char *err, size_t err_size);

// Reads only the FP32 weights and the router biases of a checkpoint (any layout it was written under) into m, a
// model built from the checkpoint's config (checkpoint_read_info) by model_create: the whole model in one process,
// for `fp8moe export` and `fp8moe eval`. path as checkpoint_load takes it. Not collective. The same checks as
// checkpoint_load (another model's keys, a missing or truncated rank file, a checksum failure, a tensor of the wrong
// shape, a tensor or router bias that no file holds), each naming the file and tensor; moments and cursors are not
// read. *step (may be NULL) gets the checkpoint's step. Returns 0, or -1 with err.
int checkpoint_load_model(Model *m, const char *path, int *step, char *err, size_t err_size);

// What a checkpoint's manifest says, for the trainer's messages and checks before it builds the state.
typedef struct {
    char dir[CHECKPOINT_DIR_MAX];    // the checkpoint directory (DIR/latest resolved to DIR/step_NNNNNNNN)
    int step, total_steps;
    int64_t tokens_per_step;
    int world, pp, dp, ep, zero1;    // the layout that wrote it
    LoaderCursor cursor;             // the training loader's cursor (the same on every dp rank)
    int n_files;                     // rank files
    Config cfg;                      // the config it was written with (parsed from its "config" attribute)
} CheckpointInfo;

// Reads the manifest of `path` (as checkpoint_load takes it). Not collective. Returns 0, or -1 with err.
int checkpoint_read_info(const char *path, CheckpointInfo *info, char *err, size_t err_size);

// The keys whose values differ between two configs, as "section.key = A -> B" joined by "; " into out
// (truncated to out_size). incompatible_only: only those that make checkpoint_load refuse. Returns the count.
int checkpoint_config_changes(const Config *saved, const Config *now, int incompatible_only, char *out,
                              size_t out_size);

#endif
