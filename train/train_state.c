/*
 * train_state.c - building and releasing a TrainState (see train_state.h): data, loaders, model,
 * optimizer and its parameter groups, activations and batch buffers, in that order.
 */
#include "train/train_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/prep.h"

// ---------------------------------------------------------------------------- device

int train_state_pick_device(const Config *cfg, Device *dev) {
    *dev = DEVICE_CPU;
    int gpus = cuda_device_count();
    switch (cfg->train.device) {
    case DEVICE_SEL_CPU:
        printf("device: cpu (train.device = cpu)\n");
        return 0;
    case DEVICE_SEL_AUTO:
        if (gpus > 0) {
            *dev = DEVICE_CUDA;
            printf("device: cuda (auto: %d GPU%s visible, using GPU 0)\n", gpus, gpus == 1 ? "" : "s");
        } else {
#ifdef FP8MOE_CUDA
            printf("device: cpu (auto: no CUDA device is visible)\n");
#else
            printf("device: cpu (auto: this build has no CUDA)\n");
#endif
        }
        return 0;
    case DEVICE_SEL_CUDA:
        if (gpus == 0) {
            fprintf(stderr, "fp8moe: %s: train.device = cuda, but %s; set train.device = cpu or auto\n", cfg->path,
#ifdef FP8MOE_CUDA
                    "no CUDA device is visible"
#else
                    "this build has no CUDA (nvcc >= 12.9 was not found at build time)"
#endif
            );
            return -1;
        }
        *dev = DEVICE_CUDA;
        printf("device: cuda (train.device = cuda)\n");
        return 0;
    }
    return 0;
}

// ---------------------------------------------------------------------------- data

// Splits data.text ("a.txt, b.txt") into trimmed paths, stored in buf. Returns the count, or -1 with
// err when an entry is empty.
static int split_text_list(const char *list, char *buf, size_t buf_size, const char **paths, int max_paths,
                           char *err, size_t err_size) {
    snprintf(buf, buf_size, "%s", list);
    int n = 0;
    int only_space = 1;
    for (const char *c = list; *c; c++) only_space &= (*c == ' ' || *c == '\t');
    if (only_space) return 0;
    for (char *tok = buf, *next; tok; tok = next) {
        next = strchr(tok, ',');
        if (next) *next++ = '\0';
        while (*tok == ' ' || *tok == '\t') tok++;
        char *end = tok + strlen(tok);
        while (end > tok && (end[-1] == ' ' || end[-1] == '\t')) *--end = '\0';
        if (*tok == '\0') {
            snprintf(err, err_size, "data.text = \"%s\": empty entry in the comma-separated list of text files",
                     list);
            return -1;
        }
        if (n == max_paths) {
            snprintf(err, err_size, "data.text: more than %d text files", max_paths);
            return -1;
        }
        paths[n++] = tok;
    }
    return n;
}

int train_state_data_dir(const Config *cfg, int verbose, char *shard_dir, size_t shard_dir_size, char *err,
                         size_t err_size) {
    if (cfg->data.shards[0]) {
        snprintf(shard_dir, shard_dir_size, "%s", cfg->data.shards);
        if (verbose) printf("data: shards in %s (data.shards)\n", shard_dir);
        return 0;
    }
    char list_buf[CONFIG_PATH_MAX];
    const char *paths[256];
    int n = split_text_list(cfg->data.text, list_buf, sizeof list_buf, paths, 256, err, err_size);
    if (n < 0) return -1;
    // The directory name identifies which files (the stamp inside checks their content).
    const char *const *hashed = paths;
    int n_hashed = n;
    if (n == 0) hashed = data_default_text(&n_hashed);
    uint64_t h = DATA_FNV1A64_INIT;
    for (int i = 0; i < n_hashed; i++) h = data_fnv1a64(hashed[i], strlen(hashed[i]) + 1, h);
    snprintf(shard_dir, shard_dir_size, "%s/%016llx", cfg->data.cache_dir, (unsigned long long)h);
    const char *what = n ? "data.text" : "the default text";
    if (data_prep_is_current(paths, n, shard_dir)) {
        if (verbose) printf("data: %s is already prepared in %s\n", what, shard_dir);
        return 0;
    }
    if (verbose)
        printf("data: preparing %s (%d file%s) into %s\n", what, n ? n : n_hashed, (n ? n : n_hashed) == 1 ? "" : "s",
               shard_dir);
    fflush(stdout);
    return data_prep(paths, n, shard_dir, err, err_size);
}

// A loader of this data-parallel rank (rank r's rows of each micro-batch: data/loader.h).
static int open_loader(const Config *cfg, const char *shard_dir, LoaderSplit split, int B, int T, const Comm *dp,
                       DataLoader *loader, char *err, size_t err_size) {
    LoaderOptions lo = {.dir = shard_dir, .split = split, .vocab_size = cfg->model.vocab_size, .B = B, .T = T,
                        .seed = cfg->train.seed, .dp_rank = dp->rank, .dp_size = dp->size};
    return loader_open(loader, &lo, err, err_size);
}

void train_split_batch(const int *rows, const int *labels, int B, int T, int *inputs, int *targets) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = rows[b * (T + 1) + t];
            targets[b * T + t] = labels[b * (T + 1) + t + 1];
        }
}

// ---------------------------------------------------------------------------- optimizer groups

static int compare_param_offset(const void *a, const void *b) {
    const ParamInfo *x = *(const ParamInfo *const *)a, *y = *(const ParamInfo *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

// Groups that tile [0, n) of the flat buffer in order (adamw.h): consecutive tensors with the same
// decay choice merged; any gap between tensors (alignment padding) is a no-decay group, whose zero
// gradients leave it unchanged. Returns a malloc'd array, or NULL on a malformed table (err set).
static ParamGroup *build_param_groups(const Model *m, int64_t n, int *n_groups, char *err, size_t err_size) {
    const ParamInfo **sorted = malloc((size_t)m->n_params * sizeof *sorted);
    ParamGroup *groups = malloc((size_t)(2 * m->n_params + 1) * sizeof *groups);
    if (!sorted || !groups) {
        free(sorted);
        free(groups);
        snprintf(err, err_size, "out of memory for %d parameter groups", m->n_params);
        return NULL;
    }
    for (int p = 0; p < m->n_params; p++) sorted[p] = &m->params[p];
    qsort(sorted, (size_t)m->n_params, sizeof *sorted, compare_param_offset);
    int ng = 0;
    int64_t pos = 0;
    for (int p = 0; p < m->n_params; p++) {
        const ParamInfo *pi = sorted[p];
        if (pi->offset < pos || pi->offset + pi->numel > n) {
            snprintf(err, err_size, "model parameter table: %s at offset %lld (%lld elements) overlaps the "
                     "previous tensor or passes the %lld-element buffer", pi->name, (long long)pi->offset,
                     (long long)pi->numel, (long long)n);
            free(sorted);
            free(groups);
            return NULL;
        }
        if (pi->offset > pos) groups[ng++] = (ParamGroup){pos, pi->offset - pos, 0};
        int decay = !pi->no_decay;
        ParamGroup *prev = ng > 0 ? &groups[ng - 1] : NULL;
        if (prev && prev->apply_weight_decay == decay && prev->offset + prev->count == pi->offset)
            prev->count += pi->numel;
        else groups[ng++] = (ParamGroup){pi->offset, pi->numel, decay};
        pos = pi->offset + pi->numel;
    }
    if (pos < n) groups[ng++] = (ParamGroup){pos, n - pos, 0};
    free(sorted);
    *n_groups = ng;
    return groups;
}

// ---------------------------------------------------------------------------- trained regions

// r: the part [part_lo, part_lo + part_n) of the flat buffer, reduced over `group`; with zero1 this rank's
// shard is the group rank's piece of an even split (the first part_n % size pieces one element longer).
// Its parameter groups are those of `all` (tiling the whole buffer) cut to [lo, lo + n) and shifted to 0.
static int region_init(TrainedRegion *r, const Config *cfg, Device dev, int64_t part_lo, int64_t part_n, Comm *group,
                       int zero1, const ParamGroup *all, int n_all, char *err, size_t err_size) {
    memset(r, 0, sizeof *r);
    r->part_lo = part_lo, r->part_n = part_n, r->group = group;
    r->lo = part_lo, r->n = part_n;
    if (zero1) {
        const int P = group->size;
        if (!(r->shard_n = malloc((size_t)P * sizeof *r->shard_n))) {
            snprintf(err, err_size, "out of memory for %d ZeRO-1 shard sizes", P);
            return -1;
        }
        int64_t at = part_lo;
        for (int q = 0; q < P; q++) {
            r->shard_n[q] = part_n / P + (q < part_n % P);
            if (q == group->rank) r->lo = at, r->n = r->shard_n[q];
            at += r->shard_n[q];
        }
    }
    if (!(r->groups = malloc((size_t)(n_all > 0 ? n_all : 1) * sizeof *r->groups))) {
        snprintf(err, err_size, "out of memory for %d parameter groups", n_all);
        return -1;
    }
    for (int i = 0; i < n_all; i++) {
        const int64_t a = all[i].offset > r->lo ? all[i].offset : r->lo;
        const int64_t b = all[i].offset + all[i].count < r->lo + r->n ? all[i].offset + all[i].count : r->lo + r->n;
        if (b > a) r->groups[r->n_groups++] = (ParamGroup){a - r->lo, b - a, all[i].apply_weight_decay};
    }
    if (r->n_groups == 0) r->groups[r->n_groups++] = (ParamGroup){0, 0, 0};  // an empty part: one empty group
    adamw_init(&r->opt, dev, r->n, &cfg->optim);
    r->opt_ok = 1;
    return 0;
}

// ---------------------------------------------------------------------------- the step's plan

// At pp > 1: parallel.schedule over train.grad_accum micro-batches, validated, and the placement of this pp
// rank's chunks (its stages of the schedule's chunk map). Returns 0, or -1 with err naming the keys.
static int make_schedule(TrainState *ts, const Config *cfg, Schedule *sched, Placement *pl, char *err,
                         size_t err_size) {
    const int A = cfg->train.grad_accum, P = ts->pp->size, rank = ts->pp->rank;
    const SchedKind kind = (SchedKind)cfg->parallel.schedule;
    char why[512];
    int stages[PLACEMENT_MAX_CHUNKS];
    if (schedule_build(sched, kind, P, A, why, sizeof why) == 0 && schedule_validate(sched, why, sizeof why) == 0) {
        for (int c = 0; c < sched->n_chunks; c++) stages[c] = sched->chunk[rank][c].stage;
        ts->n_stages = sched->n_stages;
        int param_chunks;
        schedule_memory(sched, rank, &ts->live_bound, &param_chunks);
        for (int st = 0; st < sched->n_stages; st++)
            ts->stage_rank[st] = schedule_stage_rank(sched, 0, st, &ts->stage_chunk[st]);
        if (placement_stages(cfg, stages, sched->n_chunks, sched->n_stages, pl, why, sizeof why) == 0) return 0;
    }
    snprintf(err, err_size, "%s: parallel.schedule = %s, parallel.pp = %d, train.grad_accum = %d: %s", cfg->path,
             schedule_kind_name(kind), P, A, why);
    return -1;
}

// The step's op list (one process, or this pp rank's ops of the schedule) and the activation slots it uses,
// each with the boundary tensors of a pipeline.
static int make_plan(TrainState *ts, const Config *cfg, const Schedule *sched, char *err, size_t err_size) {
    const int A = cfg->train.grad_accum, P = ts->pp->size;
    char why[512];
    const int rc = P == 1 ? step_plan_one_process(&ts->plan, A, why, sizeof why)
                          : step_plan_pipeline(&ts->plan, sched, ts->pp->rank, why, sizeof why);
    if (rc != 0) {
        snprintf(err, err_size, "%s: the step's plan: %s", cfg->path, why);
        return -1;
    }
    // evaluation runs chunk c in boundary slot c (trainer.c)
    if (ts->plan.n_slots < ts->model.n_chunks) ts->plan.n_slots = ts->model.n_chunks;
    ts->slots = calloc((size_t)ts->plan.n_slots, sizeof *ts->slots);
    ts->act_sets = calloc((size_t)ts->plan.n_acts, sizeof *ts->act_sets);
    if (!ts->slots || !ts->act_sets) {
        snprintf(err, err_size, "out of memory for %d activation sets", ts->plan.n_acts);
        return -1;
    }
    for (int a = 0; a < ts->plan.n_acts; a++) {
        if (!(ts->act_sets[a] = chunk_acts_create(&ts->model, ts->plan.act_chunk[a], cfg->train.micro_batch_size,
                                                  cfg->train.seq_len))) {
            snprintf(err, err_size, "out of memory for the activations of %d x %d tokens (set %d of %d)",
                     cfg->train.micro_batch_size, cfg->train.seq_len, a + 1, ts->plan.n_acts);
            return -1;
        }
    }
    const size_t bytes = (size_t)cfg->train.micro_batch_size * cfg->train.seq_len * cfg->model.dim * sizeof(real);
    for (int k = 0; k < ts->plan.n_slots && P > 1; k++) {  // (a slot serves either chunk of the rank)
        BoundarySlot *sl = &ts->slots[k];
        sl->in = device_alloc(ts->dev, bytes), sl->din = device_alloc(ts->dev, bytes);
        sl->out = device_alloc(ts->dev, bytes), sl->dout = device_alloc(ts->dev, bytes);
    }
    ts->acts = ts->act_sets[0];
    return 0;
}

// ---------------------------------------------------------------------------- create / free

int all_ranks_ok(Comm *world, int ok) {
    double bad = !ok;
    comm_allreduce_max_double(world, &bad, 1);
    return bad == 0;
}

int train_state_create(TrainState *ts, const Config *cfg, Device dev, const Groups *groups, int total_steps,
                       int with_val, char *err, size_t err_size) {
    memset(ts, 0, sizeof *ts);
    ts->cfg = cfg;
    ts->dev = dev;
    ts->total_steps = total_steps;
    Comm *world = groups ? groups->world : comm_world_single();
    ts->world = world;
    ts->pp = groups ? groups->pp : comm_world_single();
    ts->dp = groups ? groups->dp : comm_world_single();
    ts->edp = groups ? groups->edp : comm_world_single();
    const int B = cfg->train.micro_batch_size, T = cfg->train.seq_len;
    ts->tokens_per_step = (int64_t)cfg->train.grad_accum * B * T * ts->dp->size;
    char shard_dir[CONFIG_PATH_MAX + 32], why[1536];
    // world rank 0 prepares the data (the others would race it on the same files); then every rank opens it
    int prepared = world->rank != 0 || train_state_data_dir(cfg, 1, shard_dir, sizeof shard_dir, why, sizeof why) == 0;
    if (!all_ranks_ok(world, prepared)) {
        snprintf(err, err_size, "data: %s", prepared ? "preparing the data failed on rank 0" : why);
        return -1;
    }
    if (world->rank != 0 && train_state_data_dir(cfg, 0, shard_dir, sizeof shard_dir, why, sizeof why) != 0) {
        snprintf(err, err_size, "data: %s", why);  // rank 0 made it current; this only finds it
        return -1;
    }
    int opened = open_loader(cfg, shard_dir, LOADER_TRAIN, B, T, ts->dp, &ts->train, why, sizeof why) == 0;
    ts->train_ok = opened;
    if (opened && with_val) {
        opened = open_loader(cfg, shard_dir, LOADER_VAL, B, T, ts->dp, &ts->val, why, sizeof why) == 0;
        ts->val_ok = opened;
    }
    if (!all_ranks_ok(world, opened)) {
        snprintf(err, err_size, "data: %s", opened ? "opening the data failed on another rank" : why);
        return -1;
    }
    // this rank's part of the model: its stages' layers, and its EP group's share of the routed experts
    Placement pl = placement_whole(cfg);
    Schedule sched = {0};
    ts->n_stages = 1;  // one process: one stage, rank 0's chunk 0, one live activation set
    ts->live_bound = 1;
    if (ts->pp->size > 1 && make_schedule(ts, cfg, &sched, &pl, err, err_size) != 0) {
        schedule_free(&sched);
        return -1;
    }
    Comm *ep = groups ? groups->ep : comm_world_single();
    const int per_rank = cfg->moe.n_routed_experts / ep->size;
    if ((ep->size > 1 && placement_set_experts(cfg, &pl, ep->rank * per_rank, per_rank, why, sizeof why) != 0) ||
        model_create_placement(&ts->model, cfg, dev, &pl, why, sizeof why) != 0) {
        snprintf(err, err_size, "%s: model: %s", cfg->path, why);
        return -1;
    }
    ts->model_ok = 1;
    if (model_set_ep_group(&ts->model, ep, why, sizeof why) != 0) {
        snprintf(err, err_size, "%s: model: %s", cfg->path, why);
        return -1;
    }
    if (groups && ep->size > 1) {  // the node of each rank of the EP group, for the dispatch's node traffic
        int nodes[ep->size];
        for (int q = 0; q < ep->size; q++)
            nodes[q] = groups->node_of_rank[layout_world_rank(&groups->layout, groups->me.stage,
                                                              groups->me.ep_group * ep->size + q)];
        ep_group_set_nodes(&ts->model.ep, nodes);
    }
    const int64_t n_elems = ts->model.n_dense_elems + ts->model.n_expert_elems;
    int n_all = 0;
    ParamGroup *all = build_param_groups(&ts->model, n_elems, &n_all, err, err_size);
    if (!all) return -1;
    ts->zero1 = cfg->parallel.zero1 && ts->dp->size > 1;
    const int64_t part_lo[2] = {0, ts->model.n_dense_elems}, part_n[2] = {ts->model.n_dense_elems,
                                                                          ts->model.n_expert_elems};
    Comm *part_group[2] = {ts->dp, ts->edp};
    for (int k = 0; k < 2; k++) {
        if (region_init(&ts->regions[k], cfg, dev, part_lo[k], part_n[k], part_group[k], ts->zero1, all, n_all, err,
                        err_size) != 0) {
            free(all);
            return -1;
        }
    }
    free(all);
    // 1f1b and zb1p: both ends of a pipeline hold the embedding when MTP is on (model.h Placement); dualpipe: the
    // mirror ranks hold the same two stages
    const int one_chunk = cfg->parallel.schedule == PIPE_1F1B || cfg->parallel.schedule == PIPE_ZB1P;
    if (groups && groups->ends && one_chunk && ts->model.placement.has_embedding) ts->ends = groups->ends;
    if (groups && groups->mirror && cfg->parallel.schedule == PIPE_DUALPIPE) ts->mirror = groups->mirror;
    const int planned = make_plan(ts, cfg, &sched, err, err_size);
    schedule_free(&sched);
    if (planned != 0) return -1;
    Batch *bt = &ts->batch;
    *bt = (Batch){.B = B, .T = T, .A = cfg->train.grad_accum};
    bt->rows = malloc((size_t)B * (T + 1) * sizeof(int));
    bt->step_rows = malloc((size_t)bt->A * B * (T + 1) * sizeof(int));
    bt->labels = malloc((size_t)B * (T + 1) * sizeof(int));
    bt->inputs = malloc((size_t)B * T * sizeof(int));
    bt->targets = malloc((size_t)B * T * sizeof(int));
    if (!bt->rows || !bt->step_rows || !bt->labels || !bt->inputs || !bt->targets) {
        snprintf(err, err_size, "out of memory for the activations of %d x %d tokens", B, T);
        return -1;
    }
    return 0;
}

void train_state_free(TrainState *ts) {
    for (int k = 0; k < 2; k++) {
        TrainedRegion *r = &ts->regions[k];
        free(r->groups);
        free(r->shard_n);
        if (r->opt_ok) adamw_free(&r->opt);
    }
    free(ts->batch.rows);
    free(ts->batch.step_rows);
    free(ts->batch.labels);
    free(ts->batch.inputs);
    free(ts->batch.targets);
    for (int a = 0; ts->act_sets && a < ts->plan.n_acts; a++)
        if (ts->act_sets[a]) chunk_acts_free(ts->act_sets[a]);
    for (int k = 0; ts->slots && k < ts->plan.n_slots; k++) {
        real *bufs[4] = {ts->slots[k].in, ts->slots[k].out, ts->slots[k].dout, ts->slots[k].din};
        for (int b = 0; b < 4; b++)
            if (bufs[b]) device_free(ts->dev, bufs[b]);
    }
    free(ts->act_sets);
    free(ts->slots);
    step_plan_free(&ts->plan);
    if (ts->val_ok) loader_close(&ts->val);
    if (ts->train_ok) loader_close(&ts->train);
    if (ts->model_ok) model_free(&ts->model);
    memset(ts, 0, sizeof *ts);
}
