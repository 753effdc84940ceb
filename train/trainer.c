/*
 * trainer.c - the single-process training loop behind `fp8moe train` (see trainer.h).
 *
 * Order of the file follows the order of a run: signals, evaluation, the outputs (train/run_dir.h),
 * then trainer_run: the TrainState (train/train_state.h), the step loop of train_step (train/step.h,
 * where the step's arithmetic lives) with its log lines, metrics and evaluations, and the final save.
 */
#include "train/trainer.h"

#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "train/metrics.h"
#include "train/model.h"
#include "train/run_dir.h"
#include "train/step.h"
#include "train/train_state.h"
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

// ---------------------------------------------------------------------------- evaluation

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
        train_split_batch(bt->rows, bt->labels, bt->B, bt->T, bt->inputs, bt->targets);
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
    TrainState ts;
    StepOp *ops;  // the step's op list: F0 B0 F1 B1 ... (step_ops_one_process)
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
    free(r->ops);
    train_state_free(&r->ts);
}

// Writes checkpoint.dir/weights.h5 with further interrupts held off (on_stop_signal). Returns 0 or -1
// (message printed).
static int save_weights(const Run *r, const Config *cfg) {
    char err[ERR_MAX], path[CONFIG_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/weights.h5", cfg->checkpoint.dir);
    printf("saving weights to %s\n", path);
    fflush(stdout);
    saving_weights = 1;
    int rc = weights_save(&r->ts.model, path, err, sizeof err);
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
    if (train_state_pick_device(cfg, &dev) != 0) return 1;  // (config_load refuses pp, dp, ep > 1)
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    printf("threads: %d%s\n", omp_get_max_threads(), cfg->train.threads > 0 ? "" : " (OpenMP default)");

    // ---- outputs, then data, model and optimizer
    if (open_outputs(&r, cfg) != 0) goto done;
    TrainState *ts = &r.ts;
    if (train_state_create(ts, cfg, dev, total_steps, 1, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: %s\n", err);
        goto done;
    }
    Model *m = &ts->model;
    printf("data: %lld train tokens (%lld windows of %d+1), %lld validation targets\n",
           (long long)ts->train.n_tokens, (long long)ts->train.n_windows, T, (long long)loader_eval_targets(&ts->val));
    printf("model: %lld parameters, %lld active per token, %d MoE layers, MTP depth %d\n",
           (long long)model_num_params(m), (long long)model_active_params(m), m->n_moe_layers, cfg->mtp.depth);
    if (!(r.ops = malloc((size_t)2 * A * sizeof *r.ops))) {
        fprintf(stderr, "fp8moe: out of host memory for the step's %d ops\n", 2 * A);
        goto done;
    }
    const int n_ops = step_ops_one_process(r.ops, 2 * A, A);

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
    const double t_start = now_s();
    double train_s = 0, train_s_at_last_line = 0;
    int64_t tokens_since_line = 0;
    int last_eval_step = -1;
    model_zero_load(m);
    printf("training: %d steps of %d x %d x %d tokens\n", total_steps, A, B, T);
    fflush(stdout);
    while (ts->step < total_steps && !stop_requested) {
        const double t0 = now_s();
        StepResult sr;
        if (train_step(ts, r.ops, n_ops, NULL, &sr, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe: %s\n", err);
            goto done;
        }
        const int s = ts->step;
        if (s == 1) allocations_after_step1 = device_allocation_count();
        const double t1 = now_s();
        train_s += t1 - t0;
        tokens_since_line += ts->tokens_per_step;

        StepMetrics sm = {.step = s, .total_steps = total_steps, .loss = sr.loss,
                          .has_mtp = cfg->mtp.depth > 0, .mtp = sr.mtp, .balance = sr.balance,
                          .has_moe = m->n_moe_layers > 0, .load_max_mean = sr.worst_load, .lr = sr.lr,
                          .grad_norm = sr.grad_norm, .elapsed_s = t1 - t_start,
                          .eta_s = train_s / s * (total_steps - s),
                          .has_fp8 = cfg->precision.mode == PRECISION_FP8, .fp8_gemms = sr.fp8_gemms};
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
            EvalMetrics em = evaluate(m, ts->acts, &ts->val, &ts->batch, cfg->train.eval_batches, s, &interrupted);
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

    const int step = ts->step;
    if (!stop_requested && last_eval_step != step) {
        int interrupted;
        EvalMetrics em = evaluate(m, ts->acts, &ts->val, &ts->batch, cfg->train.eval_batches, step, &interrupted);
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
