/*
 * trainer.c - the single-process training loop behind `fp8moe train` (see trainer.h).
 *
 * Order of the file follows the order of a run: signals, data preparation, the optimizer's parameter
 * groups, evaluation, then trainer_run (setup, the step loop, the final save). One process holds the
 * whole model as one chunk; the pipeline executor and the communicators of later issues replace the
 * micro-batch loop here without changing the step's arithmetic: mean loss over micro-batches
 * (loss_scale = 1/grad_accum), global-norm clipping, AdamW with BF16 moments over the flat buffer,
 * then the expert-bias update from the step's load counts.
 */
#include "train/trainer.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/loader.h"
#include "data/prep.h"
#include "optim/adamw.h"
#include "optim/bias_balance.h"
#include "optim/clip.h"
#include "optim/lr_schedule.h"
#include "train/metrics.h"
#include "train/model.h"
#include "train/run_dir.h"
#include "train/weights_io.h"

#define ERR_MAX 2048

// ---------------------------------------------------------------------------- stop signals

// Set by the first SIGINT/SIGTERM: the loop finishes its step (an evaluation stops at its next batch),
// saves and returns. A second signal means the user does not want to wait, so the handler leaves at
// once, except while the weights are being written: leaving then would lose the run's result and
// leave a temp file behind, so from the start of the save to the return of trainer_run further
// interrupts are only acknowledged (SIGKILL still ends it, and then the earlier weights file, if any,
// is untouched: weights_save renames into place only when complete).
static volatile sig_atomic_t stop_requested = 0;
static volatile sig_atomic_t saving_weights = 0;

static void say(const char *msg, size_t len) {
    ssize_t r = write(STDERR_FILENO, msg, len);
    (void)r;
}

static void on_stop_signal(int sig) {
    (void)sig;
    if (saving_weights) {
        static const char msg[] = "\nfp8moe: still saving the weights; they are complete in a moment\n";
        say(msg, sizeof msg - 1);
        stop_requested = 1;
        return;
    }
    if (stop_requested) {
        static const char msg[] = "\nfp8moe: second interrupt, exiting now without saving\n";
        say(msg, sizeof msg - 1);
        _exit(130);
    }
    stop_requested = 1;
    static const char msg[] = "\nfp8moe: interrupt: finishing this step, then saving (interrupt again to quit now)\n";
    say(msg, sizeof msg - 1);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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

// Picks the shard directory: data.shards as given, or the text files prepared (when not already
// current) into data.cache_dir/<16 hex digits of FNV-1a over the path list>.
int trainer_prepare_data(const Config *cfg, char *shard_dir, size_t shard_dir_size, char *err, size_t err_size) {
    if (cfg->data.shards[0]) {
        snprintf(shard_dir, shard_dir_size, "%s", cfg->data.shards);
        printf("data: shards in %s (data.shards)\n", shard_dir);
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
        printf("data: %s is already prepared in %s\n", what, shard_dir);
        return 0;
    }
    printf("data: preparing %s (%d file%s) into %s\n", what, n ? n : n_hashed, (n ? n : n_hashed) == 1 ? "" : "s",
           shard_dir);
    fflush(stdout);
    return data_prep(paths, n, shard_dir, err, err_size);
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

// ---------------------------------------------------------------------------- evaluation

typedef struct {
    int B, T;
    int *rows;     // (B, T+1) tokens from the loader
    int *labels;   // (B, T+1) eval labels (-1 = masked)
    int *inputs;   // (B*T)
    int *targets;  // (B*T)
} Batch;

// Mean main-head CE over the validation pass (or its first max_batches batches when > 0).
// Load counting is off: evaluation must not move the router biases. A stop request ends it at the
// next batch (an evaluation can take longer than a step); *interrupted then says its number is partial.
static EvalMetrics evaluate(Model *m, ChunkActs *acts, DataLoader *val, const Batch *bt, int max_batches,
                            int step, int *interrupted) {
    double t0 = now_s();
    int saved_count_load = m->count_load;
    m->count_load = 0;
    loader_reset(val);
    int64_t batches = loader_eval_batches(val);
    if (max_batches > 0 && max_batches < batches) batches = max_batches;
    double loss_sum = 0;
    int64_t n_targets_total = 0;
    *interrupted = 0;
    for (int64_t i = 0; i < batches; i++) {
        if (stop_requested) {
            *interrupted = 1;
            break;
        }
        int64_t n_targets = 0;
        if (!loader_next_eval(val, bt->rows, bt->labels, &n_targets)) break;
        if (n_targets == 0) continue;  // pure padding rows
        trainer_split_batch(bt->rows, bt->labels, bt->B, bt->T, bt->inputs, bt->targets);
        chunk_forward(m, 0, acts, bt->inputs, bt->targets, NULL, NULL);
        LossTerms lt = chunk_losses(acts);
        loss_sum += lt.main * (double)lt.n_valid;
        n_targets_total += lt.n_valid;
    }
    m->count_load = saved_count_load;
    EvalMetrics e = {.step = step,
                     .val_loss = n_targets_total ? loss_sum / (double)n_targets_total : NAN,
                     .tokens = n_targets_total,
                     .seconds = now_s() - t0};
    return e;
}

// ---------------------------------------------------------------------------- the run

// Everything trainer_run owns, so one cleanup path frees it all.
typedef struct {
    Model model;
    int model_ok;
    AdamW opt;
    int opt_ok;
    DataLoader train, val;
    int train_ok, val_ok;
    ChunkActs *acts;
    Batch batch;
    ParamGroup *groups;
    MetricsLog log;
    RunDir out_dir;
    struct sigaction old_int, old_term;
    int signals_set;
} Run;

static void run_free(Run *r) {
    if (r->signals_set) {
        sigaction(SIGINT, &r->old_int, NULL);
        sigaction(SIGTERM, &r->old_term, NULL);
    }
    metrics_close(&r->log);
    run_dir_close(&r->out_dir);
    free(r->groups);
    free(r->batch.rows);
    free(r->batch.labels);
    free(r->batch.inputs);
    free(r->batch.targets);
    if (r->acts) chunk_acts_free(r->acts);
    if (r->val_ok) loader_close(&r->val);
    if (r->train_ok) loader_close(&r->train);
    if (r->opt_ok) adamw_free(&r->opt);
    if (r->model_ok) model_free(&r->model);
}

// Writes checkpoint.dir/weights.h5 with further interrupts held off (on_stop_signal). Returns 0 or -1
// (message printed).
static int save_weights(const Run *r, const Config *cfg) {
    char err[ERR_MAX], path[CONFIG_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/weights.h5", cfg->checkpoint.dir);
    printf("saving weights to %s\n", path);
    fflush(stdout);
    saving_weights = 1;
    int rc = weights_save(&r->model, path, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "fp8moe: saving weights failed: %s\n", err);
        return -1;
    }
    printf("weights saved to %s\n", path);
    return 0;
}

// Every output location is checked, locked and tidied before the data and the model are touched, so
// an unwritable directory or a mistyped log.jsonl costs nothing (run_dir.h). Returns 0 or -1 (message
// printed).
static int open_outputs(Run *r, const Config *cfg) {
    char err[ERR_MAX];
    const char *outputs[2];
    int n_outputs = 0;
    if (cfg->checkpoint.save_weights) outputs[n_outputs++] = "weights.h5";
    if (!cfg->log.jsonl[0]) outputs[n_outputs++] = "metrics.jsonl";
    if (n_outputs > 0) {
        if (run_dir_open(&r->out_dir, cfg->checkpoint.dir, outputs, n_outputs, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe: checkpoint.dir: %s\n", err);
            return -1;
        }
        if (cfg->checkpoint.save_weights) {
            char path[CONFIG_PATH_MAX + 32];
            snprintf(path, sizeof path, "%s/weights.h5", cfg->checkpoint.dir);
            if (run_dir_keep_previous(path, "checkpoint.dir", err, sizeof err) != 0) {
                fprintf(stderr, "fp8moe: checkpoint.dir: %s\n", err);
                return -1;
            }
        }
    }
    char jsonl[CONFIG_PATH_MAX + 32];
    if (cfg->log.jsonl[0]) snprintf(jsonl, sizeof jsonl, "%s", cfg->log.jsonl);
    else snprintf(jsonl, sizeof jsonl, "%s/metrics.jsonl", cfg->checkpoint.dir);
    if (metrics_open(&r->log, jsonl, cfg->path, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: log.jsonl: %s\n", err);
        return -1;
    }
    printf("metrics: %s\n", jsonl);
    return 0;
}

// A metrics write failed mid-run (disk full, a file system gone read-only): the weights the run has
// trained so far are saved before stopping, so the failure costs the log, not the run.
static void save_after_write_error(const Run *r, const Config *cfg, int step) {
    if (!cfg->checkpoint.save_weights) return;
    fprintf(stderr, "fp8moe: saving the weights of step %d before stopping\n", step);
    save_weights(r, cfg);
}

// A parallel layout is refused rather than silently run as one process. Returns -1 (message printed).
static int check_parallel_layout(const Config *cfg) {
    const ParallelConfig *p = &cfg->parallel;
    if (p->pp * p->dp > 1 || p->ep > 1) {  // no silent single-process run of a parallel job
        fprintf(stderr, "fp8moe: %s: parallel.pp = %d, parallel.dp = %d, parallel.ep = %d: this build runs one "
                "process; expected 1 for each (pipeline, data and expert parallelism come in a later release)\n",
                cfg->path, p->pp, p->dp, p->ep);
        return -1;
    }
    return 0;
}

// Selects the device; prints the choice and why. Returns -1 (message printed) when it cannot run.
// auto takes the GPU when this build has CUDA and a GPU is visible, else the CPU; cuda insists.
int trainer_pick_device(const Config *cfg, Device *dev) {
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

int trainer_open_loader(const Config *cfg, const char *shard_dir, LoaderSplit split, int B, int T, DataLoader *loader,
                        char *err, size_t err_size) {
    LoaderOptions lo = {.dir = shard_dir, .split = split, .vocab_size = cfg->model.vocab_size, .B = B, .T = T,
                        .seed = cfg->train.seed, .dp_rank = 0, .dp_size = 1};
    return loader_open(loader, &lo, err, err_size);
}

void trainer_split_batch(const int *rows, const int *labels, int B, int T, int *inputs, int *targets) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = rows[b * (T + 1) + t];
            targets[b * T + t] = labels[b * (T + 1) + t + 1];
        }
}

int trainer_run(const Config *cfg) {
    Run r;
    memset(&r, 0, sizeof r);
    char err[ERR_MAX];
    int rc = 1;
    const int B = cfg->train.micro_batch_size, T = cfg->train.seq_len, A = cfg->train.grad_accum;
    const int total_steps = cfg->train.steps;

    printf("# resolved config\n");
    config_print(cfg, stdout);
    printf("\n");
    Device dev;
    if (check_parallel_layout(cfg) != 0 || trainer_pick_device(cfg, &dev) != 0) return 1;
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    printf("threads: %d%s\n", omp_get_max_threads(), cfg->train.threads > 0 ? "" : " (OpenMP default)");

    // ---- outputs
    if (open_outputs(&r, cfg) != 0) goto done;

    // ---- data
    char shard_dir[CONFIG_PATH_MAX + 32];
    if (trainer_prepare_data(cfg, shard_dir, sizeof shard_dir, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: data: %s\n", err);
        goto done;
    }
    if (trainer_open_loader(cfg, shard_dir, LOADER_TRAIN, B, T, &r.train, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: data: %s\n", err);
        goto done;
    }
    r.train_ok = 1;
    if (trainer_open_loader(cfg, shard_dir, LOADER_VAL, B, T, &r.val, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: data: %s\n", err);
        goto done;
    }
    r.val_ok = 1;
    printf("data: %lld train tokens (%lld windows of %d+1), %lld validation targets\n",
           (long long)r.train.n_tokens, (long long)r.train.n_windows, T, (long long)loader_eval_targets(&r.val));

    // ---- model and optimizer
    if (model_create(&r.model, cfg, dev, 1, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: %s: model: %s\n", cfg->path, err);
        goto done;
    }
    r.model_ok = 1;
    Model *m = &r.model;
    const int64_t n_elems = m->n_dense_elems + m->n_expert_elems;
    printf("model: %lld parameters, %lld active per token, %d MoE layers, MTP depth %d\n",
           (long long)model_num_params(m), (long long)model_active_params(m), m->n_moe_layers, cfg->mtp.depth);
    adamw_init(&r.opt, dev, n_elems, &cfg->optim);
    r.opt_ok = 1;
    int n_groups = 0;
    if (!(r.groups = build_param_groups(m, n_elems, &n_groups, err, sizeof err))) {
        fprintf(stderr, "fp8moe: %s\n", err);
        goto done;
    }
    r.acts = chunk_acts_create(m, 0, B, T);
    r.batch = (Batch){.B = B, .T = T};
    r.batch.rows = malloc((size_t)B * (T + 1) * sizeof(int));
    r.batch.labels = malloc((size_t)B * (T + 1) * sizeof(int));
    r.batch.inputs = malloc((size_t)B * T * sizeof(int));
    r.batch.targets = malloc((size_t)B * T * sizeof(int));
    if (!r.acts || !r.batch.rows || !r.batch.labels || !r.batch.inputs || !r.batch.targets) {
        fprintf(stderr, "fp8moe: out of memory for the activations of %d x %d tokens\n", B, T);
        goto done;
    }

    stop_requested = 0;
    saving_weights = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &r.old_int);
    sigaction(SIGTERM, &sa, &r.old_term);
    r.signals_set = 1;

    // ---- steps
    const double flops_per_token = model_flops_per_token(m, T);
    int64_t allocations_after_step1 = 0;
    const int64_t tokens_per_step = (int64_t)A * B * T;
    const double t_start = now_s();
    double train_s = 0, train_s_at_last_line = 0;
    int64_t tokens_since_line = 0;
    int step = 0, last_eval_step = -1;
    model_zero_load(m);
    printf("training: %d steps of %d x %d x %d tokens\n", total_steps, A, B, T);
    fflush(stdout);
    while (step < total_steps && !stop_requested) {
        const double t0 = now_s();
        const int s = step + 1;  // 1-based in logs; lr_at and AdamW's bias correction use their own bases
        model_zero_grads(m);
        m->count_load = 1;
        double loss_sum = 0, mtp_sum = 0, bal_sum = 0;
        const int64_t fp8_gemms_before = m->fp8_gemm_count;
        for (int mb = 0; mb < A; mb++) {
            if (loader_next(&r.train, r.batch.rows) != 0) {
                fprintf(stderr, "fp8moe: step %d: the training loader returned no batch\n", s);
                goto done;
            }
            trainer_split_batch(r.batch.rows, r.batch.rows, B, T, r.batch.inputs, r.batch.targets);
            real weighted = chunk_forward(m, 0, r.acts, r.batch.inputs, r.batch.targets, NULL, NULL);
            LossTerms lt = chunk_losses(r.acts);
            if (!isfinite((double)weighted) || !isfinite(lt.main) || !isfinite(lt.mtp_mean) ||
                !isfinite(lt.balance)) {
                fprintf(stderr, "fp8moe: step %d, micro-batch %d: the loss is not finite (loss %g, mtp %g, "
                        "bal %g); stopping. Lower optim.lr or check the data.\n", s, mb + 1, lt.main,
                        lt.mtp_mean, lt.balance);
                goto done;
            }
            chunk_backward(m, 0, r.acts, NULL, NULL, (real)(1.0 / A));
            loss_sum += lt.main;
            mtp_sum += lt.mtp_mean;
            bal_sum += lt.balance;
        }
        m->count_load = 0;
        char fp8_err[512];
        if (fp8_check_finite(dev, fp8_err, sizeof fp8_err) != 0) {  // deferred on the GPU (kernels.h)
            fprintf(stderr, "fp8moe: step %d: FP8 quantisation met a non-finite value: %s; stopping\n", s, fp8_err);
            goto done;
        }
        const double gnorm = grad_global_norm(dev, m->grads, n_elems);
        if (!isfinite(gnorm)) {
            fprintf(stderr, "fp8moe: step %d: the gradient norm is not finite (%g) though the loss was %.4f; "
                    "stopping\n", s, gnorm, loss_sum / A);
            goto done;
        }
        const float scale = clip_scale(gnorm, cfg->optim.grad_clip);
        const double lr = lr_at(&cfg->optim, step, total_steps);
        adamw_step(&r.opt, m->weights, m->grads, r.groups, n_groups, (float)lr, scale, s);
        model_weights_changed(m);
        const double worst_load = model_update_router_bias(m);
        step = s;
        if (s == 1) allocations_after_step1 = device_allocation_count();
        const double t1 = now_s();
        train_s += t1 - t0;
        tokens_since_line += tokens_per_step;

        StepMetrics sm = {.step = s, .total_steps = total_steps, .loss = loss_sum / A,
                          .has_mtp = cfg->mtp.depth > 0, .mtp = mtp_sum / A, .balance = bal_sum / A,
                          .has_moe = m->n_moe_layers > 0, .load_max_mean = worst_load, .lr = lr,
                          .grad_norm = gnorm, .elapsed_s = t1 - t_start,
                          .eta_s = train_s / s * (total_steps - s),
                          .has_fp8 = cfg->precision.mode == PRECISION_FP8,
                          .fp8_gemms = m->fp8_gemm_count - fp8_gemms_before};
        sm.tokens_per_s = tokens_since_line / fmax(train_s - train_s_at_last_line, 1e-9);
        sm.model_tflops = sm.tokens_per_s * flops_per_token * 1e-12;
        if (s % cfg->log.every == 0 || s == 1 || s == total_steps) {
            char line[512];
            format_step_line(line, sizeof line, &sm);
            printf("%s\n", line);
            fflush(stdout);
            tokens_since_line = 0;
            train_s_at_last_line = train_s;
        }
        if (metrics_write_step(&r.log, &sm, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe: %s\n", err);
            save_after_write_error(&r, cfg, s);
            goto done;
        }
        if (!stop_requested && cfg->train.eval_every > 0 && s % cfg->train.eval_every == 0 && s < total_steps) {
            int interrupted;
            EvalMetrics em = evaluate(m, r.acts, &r.val, &r.batch, cfg->train.eval_batches, s, &interrupted);
            last_eval_step = s;
            if (interrupted) {
                printf("eval step %d: interrupted, not recorded\n", s);
                break;
            }
            char line[256];
            format_eval_line(line, sizeof line, &em);
            printf("%s\n", line);
            fflush(stdout);
            if (metrics_write_eval(&r.log, &em, err, sizeof err) != 0) {
                fprintf(stderr, "fp8moe: %s\n", err);
                save_after_write_error(&r, cfg, s);
                goto done;
            }
        }
    }

    if (!stop_requested && last_eval_step != step) {
        int interrupted;
        EvalMetrics em = evaluate(m, r.acts, &r.val, &r.batch, cfg->train.eval_batches, step, &interrupted);
        if (interrupted) {
            printf("eval step %d: interrupted, not recorded\n", step);
        } else {
            char line[256];
            format_eval_line(line, sizeof line, &em);
            printf("%s\n", line);
            if (metrics_write_eval(&r.log, &em, err, sizeof err) != 0) {
                fprintf(stderr, "fp8moe: %s\n", err);
                save_after_write_error(&r, cfg, step);
                goto done;
            }
        }
    }
    if (stop_requested) printf("interrupted after step %d of %d\n", step, total_steps);
    if (cfg->checkpoint.save_weights && save_weights(&r, cfg) != 0) goto done;
    char took[32];
    format_duration(took, sizeof took, now_s() - t_start);
    printf("done: %d steps in %s\n", step, took);
    if (dev == DEVICE_CUDA && step > 1)  // every buffer should be sized by the first step (docs/gpu.md)
        printf("device: %lld cudaMalloc calls after the first step (expected 0)\n",
               (long long)(device_allocation_count() - allocations_after_step1));
    fflush(stdout);
    rc = 0;
done:
    fflush(stdout);
    run_free(&r);
    return rc;
}
