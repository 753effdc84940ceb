/*
 * train_state.h - everything a training run owns between steps: the model (this process's part of
 * it), AdamW with its parameter groups, the training and validation loaders with their cursors, the
 * activations and batch buffers, and the step counters. It is the root that a checkpoint writer walks
 * and a resume restores (DESIGN.md section 2, "TrainState"), and the one setup that `fp8moe train`,
 * `fp8moe bench step` and the tests share, so none of them builds the pieces its own way.
 *
 * Ownership: train_state_create allocates every member; train_state_free releases what was created,
 * also after a failed create. The config is the caller's and must outlive the state.
 */
#ifndef FP8MOE_TRAIN_STATE_H
#define FP8MOE_TRAIN_STATE_H

#include <stdint.h>

#include "data/loader.h"
#include "optim/adamw.h"
#include "parallel/groups.h"
#include "train/config.h"
#include "train/model.h"
#include "train/step_plan.h"

// One micro-batch's token buffers on the host: rows and labels (B, T+1) as the loader returns them,
// inputs and targets (B, T) as the model takes them (train_split_batch); and the rows of all the step's
// micro-batches (A, B, T+1), read at the step's start, since a rank with two chunks forwards a micro-batch
// twice and not in the loader's order.
typedef struct {
    int B, T, A;
    int *rows, *labels, *inputs, *targets;
    int *step_rows;
} Batch;

// A trained region of the flat buffer: the non-expert part (reduced over dp) or the local experts' part
// (reduced over edp), each with its own AdamW. Without ZeRO-1 this rank updates the whole part; with
// parallel.zero1 (DESIGN.md section 5) its gradients are reduce-scattered over the part's group, this rank
// updates its shard [lo, lo + n) (the shards of the group's ranks, in rank order, tile the part), and the
// shards' weights are all-gathered after the update. The moments exist for [lo, lo + n) only.
typedef struct {
    int64_t part_lo, part_n;  // the part in the flat buffer
    int64_t lo, n;            // the elements this rank updates (the whole part without ZeRO-1)
    int64_t *shard_n;         // ZeRO-1: every rank's shard size, in rank order of `group` (NULL without)
    Comm *group;              // the replicas that sum the part's gradients: dp or edp (not owned)
    AdamW opt;
    ParamGroup *groups;       // tile [0, n) relative to lo: decay for matrices, none for norms and padding
    int n_groups;
    int opt_ok;
} TrainedRegion;

enum { REGION_DENSE = 0, REGION_EXPERTS = 1 };

// In a pipeline, one micro-batch's boundary tensors (B*T, D) on the model's device: the input received from the
// previous stage, the output sent to the next, the output-gradient received from the next, the input-gradient sent
// to the previous (train/step_plan.h "boundary slot"; NULL in one process).
typedef struct {
    real *in, *out, *dout, *din;
} BoundarySlot;

typedef struct {
    const Config *cfg;
    Device dev;
    Model model;
    TrainedRegion regions[2];  // REGION_DENSE, REGION_EXPERTS
    int zero1;                 // parallel.zero1 with dp > 1
    DataLoader train, val;
    StepPlan plan;       // the step's ops (train/step_plan.h): one process's F0 B0 F1 B1 ..., or this pp rank's schedule
    ChunkActs **act_sets;  // plan.n_acts activation sets, set a of chunk plan.act_chunk[a] (at least one per chunk)
    BoundarySlot *slots;   // plan.n_slots boundary slots (at least one per chunk)
    int live_bound;      // the most activation sets (forwarded, backward not yet run) the schedule allows this rank
                         // (schedule_memory; 1 in one process): train_step stops with an error past it
    // the stages of the pipe that evaluation runs (pipe 0 of the schedule; every stage once): the pp rank and
    // chunk of each, in stage order; one stage on rank 0 at pp = 1
    int n_stages;
    int stage_rank[2 * SCHED_MAX_PP], stage_chunk[2 * SCHED_MAX_PP];
    ChunkActs *acts;     // activation set 0 (chunk 0's first)
    Batch batch;
    Comm *world;         // every rank of the job: the step's agreement and the expert loads (not owned)
    Comm *pp;            // this rank's pipeline: the boundary tensors, the grad norm (not owned)
    Comm *ends;          // 1f1b / zb1p with MTP on, stages 0 and pp-1: the embedding copies' gradients (else NULL)
    Comm *mirror;        // dualpipe, stages s and pp-1-s: the two copies of both stages' gradients (else NULL)
    Comm *dp;            // data-parallel group: non-expert gradients, losses, expert loads (not owned)
    Comm *edp;           // the replicas of this rank's experts: their gradients (dp while ep = 1; not owned)
    int step;            // optimizer steps taken
    int total_steps;     // steps of the LR schedule
    int64_t tokens_per_step;  // of the global batch: grad_accum x micro_batch_size x seq_len x dp
    // what exists, so train_state_free can run after a create that failed half-way
    int model_ok, train_ok, val_ok;
} TrainState;

// The job's shard directory: data.shards as given, or the text files of data.text (comma-separated; none: the
// default text) prepared, when not already current, into data.cache_dir/<16 hex digits of FNV-1a over the path
// list>. verbose: say what was found or prepared. Returns 0, or -1 with err.
int train_state_data_dir(const Config *cfg, int verbose, char *shard_dir, size_t shard_dir_size, char *err,
                         size_t err_size);

// Picks the device train.device asks for and prints the choice and why. auto takes the GPU when this
// build has CUDA and a GPU is visible, else the CPU; cuda insists. Returns 0, or -1 (message printed).
int train_state_pick_device(const Config *cfg, Device *dev);

// Builds the state for cfg on dev: the data (data.shards, or data.text prepared into data.cache_dir
// when not already current, by world rank 0 only; prints what it does), the training loader and, when
// with_val, the validation loader, each reading this data-parallel rank's part of the order; the model
// initialised from train.seed (this rank's stage of parallel.pp and its share of the experts), the two trained
// regions (AdamW and parameter groups of this rank's part or, with parallel.zero1, its shard), the step's plan
// (parallel.schedule at pp > 1) and the activation slots it needs, and the batch buffers.
// groups: the job's process groups (parallel/groups.h), or NULL for one process; the state keeps
// pointers to its dp and edp groups, so groups must outlive it. total_steps is the LR schedule's length.
// Collective over the world when groups is given: a failure on any rank fails it on every rank.
// Returns 0, or -1 with a message in err that names the file or key at fault.
int train_state_create(TrainState *ts, const Config *cfg, Device dev, const Groups *groups, int total_steps,
                       int with_val, char *err, size_t err_size);
void train_state_free(TrainState *ts);

// Whether every rank of `world` passes ok = 1 (collective; the identity in one process): a setup step that
// fails on one rank then fails on all of them, so none is left waiting in a later collective.
int all_ranks_ok(Comm *world, int ok);

// rows (B, T+1) token windows -> inputs (B, T) = rows[:, :T] and targets (B, T) = labels[:, 1:]
// (labels is rows itself for training batches, the masked labels for evaluation).
void train_split_batch(const int *rows, const int *labels, int B, int T, int *inputs, int *targets);

#endif
