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

#include "train/checkpoint.h"
#include "train/job_groups.h"
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

// "fp8moe: message", or "fp8moe: rank R: message" in a job of several ranks.
static void print_error(const Comm *world, const char *msg) {
    if (world->size > 1) fprintf(stderr, "fp8moe: rank %d: %s\n", world->rank, msg);
    else fprintf(stderr, "fp8moe: %s\n", msg);
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
// Whether any rank of the world has been asked to stop (the identity in one process). Every rank calls it
// at the same points, so all of them stop at the same step or evaluation batch.
static int stop_agreed(Comm *world) {
    double stop = stop_requested;
    comm_allreduce_max_double(world, &stop, 1);
    if (stop > 0) stop_requested = 1;
    return stop > 0;
}

// In a pipeline the stages of pipe 0 run each batch's forward one after another, in stage order: a stage's
// input comes from the previous stage's rank (a blocking receive: evaluation needs no overlap) or from this
// rank's other chunk, and the last stage's loss is summed over the world (in world rank order: the other ranks
// add zeros, so this is the dp sum). Chunk c evaluates in its first activation set and boundary slot c.
static ChunkActs *chunk_act_set(const TrainState *ts, int chunk) {
    int a = 0;
    while (ts->plan.act_chunk[a] != chunk) a++;  // every chunk has a set (train_state.h)
    return ts->act_sets[a];
}

static EvalMetrics evaluate(TrainState *ts, int max_batches, int step, int *interrupted) {
    Model *m = &ts->model;
    DataLoader *val = &ts->val;
    const Batch *bt = &ts->batch;
    const int me = ts->pp->rank;
    const size_t boundary_bytes = (size_t)bt->B * bt->T * m->cfg.model.dim * sizeof(real);
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
        if (stop_agreed(ts->world)) {
            *interrupted = 1;
            break;
        }
        int64_t n_targets = 0;
        if (!loader_next_eval(val, bt->rows, bt->labels, &n_targets)) break;
        // pure padding rows: skipped (by every stage of a pipeline alike: they read the same rows), except under
        // expert parallelism, whose forward the EP group runs together
        if (n_targets == 0 && m->ep.ep_size == 1) continue;
        train_split_batch(bt->rows, bt->labels, bt->B, bt->T, bt->inputs, bt->targets);
        for (int st = 0; st < ts->n_stages; st++) {
            if (ts->stage_rank[st] != me) continue;
            const int c = ts->stage_chunk[st];
            const ChunkSpec *cs = &m->chunks[c];
            BoundarySlot *sl = &ts->slots[c];
            ChunkActs *acts = chunk_act_set(ts, c);
            const real *in = NULL;
            if (!cs->has_embedding && ts->stage_rank[st - 1] == me) {
                in = ts->slots[ts->stage_chunk[st - 1]].out;
            } else if (!cs->has_embedding) {
                comm_recv_bytes(ts->pp, sl->in, boundary_bytes, ts->stage_rank[st - 1], 0);
                in = sl->in;
            }
            chunk_forward(m, c, acts, bt->inputs, bt->targets, in, cs->has_head ? NULL : sl->out);
            if (!cs->has_head) {
                if (ts->stage_rank[st + 1] != me) comm_send_bytes(ts->pp, sl->out, boundary_bytes, ts->stage_rank[st + 1], 0);
                continue;
            }
            LossTerms lt = chunk_losses(acts);
            if (lt.n_valid == 0) continue;
            loss_sum += lt.main * (double)lt.n_valid;
            n_targets_total += lt.n_valid;
        }
    }
    m->count_load = saved_count_load;
    double sums[2] = {loss_sum, (double)n_targets_total};  // every dp rank evaluated its part of the pass
    comm_allreduce_sum_double(ts->world, sums, 2);
    loss_sum = sums[0], n_targets_total = (int64_t)sums[1];
    EvalMetrics e = {.step = step,
                     .val_loss = n_targets_total ? loss_sum / (double)n_targets_total : NAN,
                     .tokens = n_targets_total,
                     .seconds = now_s() - t0};
    return e;
}

// ---------------------------------------------------------------------------- the run

// Everything trainer_run owns, so one cleanup path frees it all.
typedef struct {
    JobGroups jg;   // the job's process groups (one rank in one process) and its world
    int writes;     // this rank writes the run's outputs (world rank 0; the dp replicas are identical)
    TrainState ts;
    MetricsLog log;
    RunDir out_dir;
    struct sigaction old_int, old_term;
    int signals_set;
    int checkpoint_step;  // the step of the last checkpoint this run wrote or resumed from (-1: none)
} Run;

static void run_free(Run *r) {
    if (r->signals_set) {
        sigaction(SIGINT, &r->old_int, NULL);
        sigaction(SIGTERM, &r->old_term, NULL);
    }
    metrics_close(&r->log);
    run_dir_close(&r->out_dir);
    train_state_free(&r->ts);
    job_groups_free(&r->jg);
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
static int open_outputs(Run *r, const Config *cfg, const char *resume) {
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
    // a resumed run continues the metrics file up to the step it resumes from (metrics.h); the step is read from
    // the checkpoint's manifest (one that cannot be read fails the resume after this, with its reason)
    int64_t continue_after = -1;
    CheckpointInfo *info = resume ? malloc(sizeof *info) : NULL;  // holds a whole Config
    if (info && checkpoint_read_info(resume, info, err, sizeof err) == 0) continue_after = info->step;
    free(info);
    err[0] = '\0';
    if (metrics_open(&r->log, jsonl, cfg->path, continue_after, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: log.jsonl: %s\n", err);
        return -1;
    }
    printf("metrics: %s\n", jsonl);
    return 0;
}

// A metrics write failed mid-run (disk full, a file system gone read-only): the weights the run has
// trained so far are saved before stopping, so the failure costs the log, not the run. Every rank calls
// it; the writing rank saves.
static void save_after_write_error(const Run *r, const Config *cfg, int step) {
    if (!cfg->checkpoint.save_weights || !r->writes) return;
    fprintf(stderr, "fp8moe: saving the weights of step %d before stopping\n", step);
    save_weights(r, cfg);
}

// What this rank holds of the parameters, gradients and AdamW moments (rank 0's line; under expert parallel
// every rank holds the same share, under ZeRO-1 shards of at most one element more).
static void print_rank_memory(const TrainState *ts, const Comm *world) {
    const Model *m = &ts->model;
    const int64_t n = m->n_dense_elems + m->n_expert_elems;
    const int64_t moments = ts->regions[REGION_DENSE].n + ts->regions[REGION_EXPERTS].n;
    const double mib = 1.0 / (1 << 20);
    printf("memory%s: parameters %lld elements (%lld non-expert + %lld of experts [%d, %d) of %d) = %.2f MiB FP32, "
           "gradients the same; AdamW moments for %lld elements (%s) = %.2f MiB BF16\n",
           world->size > 1 ? " (rank 0)" : "", (long long)n, (long long)m->n_dense_elems, (long long)m->n_expert_elems,
           m->placement.expert0, m->placement.expert0 + m->placement.n_experts, m->cfg.moe.n_routed_experts,
           (double)n * sizeof(real) * mib, (long long)moments, ts->zero1 ? "ZeRO-1 shards" : "every element",
           (double)moments * 2 * sizeof(uint16_t) * mib);
}

// At pp > 1: the schedule and which layers every stage holds, on which pp rank and chunk (world rank 0's line; every
// rank computes the same map), and this rank's activation slots against the schedule's bound.
static void print_pipeline(const TrainState *ts, const Config *cfg) {
    if (ts->pp->size == 1) return;
    const int P = ts->pp->size;
    const char *kind = schedule_kind_name((SchedKind)cfg->parallel.schedule);
    printf("pipeline: parallel.schedule = %s over %d micro-batches (train.grad_accum), %d stages on %d pp ranks%s; "
           "rank 0: %d activation sets (the schedule's bound: %d) and %d boundary slots\n", kind, cfg->train.grad_accum,
           ts->n_stages, P, cfg->parallel.schedule == PIPE_DUALPIPE ? " (direction A; direction B runs a copy of stage s "
                                                                      "on rank pp-1-s)" : "",
           ts->plan.n_acts, ts->live_bound, ts->plan.n_slots);
    for (int st = 0; st < ts->n_stages; st++) {
        int first, n;
        placement_stage_layers(cfg, st, ts->n_stages, &first, &n);
        printf("  stage %d: layers %d..%d%s%s on pp rank %d, chunk %d\n", st, first, first + n - 1,
               st == 0 ? " + embedding" : "", st == ts->n_stages - 1 ? " + norm, head, MTP" : "", ts->stage_rank[st],
               ts->stage_chunk[st]);
    }
}

// Writes a checkpoint of step ts->step on every rank (collective), further interrupts held off as during the
// weights save. Returns 0, or -1 after printing why (the previous checkpoint is kept).
static int save_checkpoint(Run *r, const Config *cfg) {
    char err[ERR_MAX];
    printf("saving checkpoint of step %d to %s\n", r->ts.step, cfg->checkpoint.dir);
    fflush(stdout);
    const sig_atomic_t was_saving = saving_weights;
    saving_weights = 1;
    const int rc = checkpoint_save(&r->ts, &r->jg.groups, cfg->checkpoint.dir, cfg->checkpoint.keep_last, err,
                                   sizeof err);
    saving_weights = was_saving;
    if (rc != 0) {
        print_error(r->jg.world, err);
        return -1;
    }
    printf("checkpoint saved: %s/step_%08d\n", cfg->checkpoint.dir, r->ts.step);
    r->checkpoint_step = r->ts.step;
    return 0;
}

// Loads the checkpoint `path` into the state just built (every rank) and says what it resumed from.
// Returns 0, or -1 after printing why.
static int resume_from(Run *r, const Config *cfg, const char *path) {
    char err[ERR_MAX];
    if (checkpoint_load(&r->ts, &r->jg.groups, path, err, sizeof err) != 0) {
        print_error(r->jg.world, err);
        return -1;
    }
    CheckpointInfo *info = malloc(sizeof *info);  // holds a whole Config
    if (info && checkpoint_read_info(path, info, err, sizeof err) == 0) {
        printf("resumed from %s at step %d (written by %d rank%s: pp %d, dp %d, ep %d%s)\n", info->dir, info->step,
               info->world, info->world == 1 ? "" : "s", info->pp, info->dp, info->ep, info->zero1 ? ", ZeRO-1" : "");
        char changes[ERR_MAX], kept[ERR_MAX] = "";
        checkpoint_config_changes(&info->cfg, cfg, 0, changes, sizeof changes);
        // where outputs go and how often they are written do not change the arithmetic
        for (char *key = strtok(changes, ";"); key; key = strtok(NULL, ";")) {
            while (*key == ' ') key++;
            if (!strncmp(key, "checkpoint.", 11) || !strncmp(key, "log.", 4) || !strncmp(key, "train.stop_after", 16))
                continue;
            snprintf(kept + strlen(kept), sizeof kept - strlen(kept), "%s%s", kept[0] ? "; " : "", key);
        }
        if (kept[0])
            printf("note: the job differs from the checkpoint's (the run is no longer bitwise the uninterrupted "
                   "one): %s\n", kept);
    }
    free(info);
    r->checkpoint_step = r->ts.step;
    return 0;
}

// Prints an evaluation's line and writes its record (the writing rank); a failed write saves the weights
// and fails on every rank. Returns 0 or -1.
static int write_eval(Run *r, const EvalMetrics *em, int step) {
    char line[256], err[ERR_MAX];
    format_eval_line(line, sizeof line, em);
    printf("%s\n", line);
    fflush(stdout);
    int ok = !r->writes || metrics_write_eval(&r->log, em, err, sizeof err) == 0;
    if (!ok) print_error(r->jg.world, err);
    if (all_ranks_ok(r->jg.world, ok)) return 0;
    save_after_write_error(r, r->ts.cfg, step);
    return -1;
}

int trainer_run(const Config *cfg, const char *resume) {
    Run r;
    memset(&r, 0, sizeof r);
    r.checkpoint_step = -1;
    char err[ERR_MAX];
    int rc = 1;
    const int B = cfg->train.micro_batch_size, T = cfg->train.seq_len, A = cfg->train.grad_accum;
    const int total_steps = cfg->train.steps;
    // train.stop_after: the run ends early, with a checkpoint, but every step is that of the total_steps run
    const int last_step = cfg->train.stop_after > 0 ? cfg->train.stop_after : total_steps;

    // Only world rank 0 prints progress and writes the outputs; every rank prints its own errors.
    Comm *world = comm_world();
    if (world->rank != 0 && !freopen("/dev/null", "w", stdout)) {
        fprintf(stderr, "fp8moe: rank %d: cannot silence stdout\n", world->rank);
        return 1;
    }
    printf("# resolved config\n");
    config_print(cfg, stdout);
    printf("\n");
    Device dev;
    if (train_state_pick_device(cfg, &dev) != 0) return 1;  // (config_load refuses pp, ep > 1)
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    printf("threads: %d%s\n", omp_get_max_threads(), cfg->train.threads > 0 ? "" : " (OpenMP default)");
    if (job_groups_create(&r.jg, cfg, dev) != 0) {
        rc = 2;  // the layout does not fit the launch: an invalid job, as config_load's errors
        goto done;
    }
    const ParallelConfig *pc = &cfg->parallel;
    if ((pc->ep > 1 || pc->pp > 1) && cfg->checkpoint.save_weights) {
        if (world->rank == 0)
            fprintf(stderr, "fp8moe: %s: checkpoint.save_weights with parallel.pp = %d, parallel.ep = %d: each rank "
                    "holds only its stage's layers and its experts, and weights.h5 is one file of the whole model - "
                    "set checkpoint.save_weights = false (the sharded checkpoints of checkpoint.every_steps hold "
                    "every tensor)\n", cfg->path, pc->pp, pc->ep);
        rc = 2;
        goto done;
    }
    r.writes = world->rank == 0;

    // ---- outputs, then data, model and optimizer
    if (!all_ranks_ok(world, !r.writes || open_outputs(&r, cfg, resume) == 0)) goto done;
    TrainState *ts = &r.ts;
    if (train_state_create(ts, cfg, dev, &r.jg.groups, total_steps, 1, err, sizeof err) != 0) {
        print_error(world, err);
        goto done;
    }
    Model *m = &ts->model;
    if (resume && resume_from(&r, cfg, resume) != 0) goto done;
    printf("data: %lld train tokens (%lld windows of %d+1), %lld validation targets\n",
           (long long)ts->train.n_tokens, (long long)ts->train.n_windows, T, (long long)loader_eval_targets(&ts->val));
    printf("model: %lld parameters, %lld active per token, %d MoE layers, MTP depth %d\n",
           (long long)model_num_params(m), (long long)model_active_params(m), m->n_moe_layers, cfg->mtp.depth);
    print_rank_memory(ts, world);
    print_pipeline(ts, cfg);

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
    printf("training: %d steps of %d x %d x %d tokens", total_steps, A, B, T);
    if (last_step < total_steps) printf(", stopping after step %d (train.stop_after)", last_step);
    printf("%s", world->size > 1 ? "" : "\n");
    if (world->size > 1) printf(" on each of %d data-parallel ranks\n", ts->dp->size);
    fflush(stdout);
    // A failed metrics write on rank 0 stops every rank (agreed with the stop requests after each step).
    int write_failed = 0;
    if (ts->step >= last_step && last_step < total_steps) {
        snprintf(err, sizeof err, "%s: train.stop_after = %d, and the run resumes from step %d - expected a later "
                 "train.stop_after, or 0 to train to train.steps = %d", cfg->path, last_step, ts->step, total_steps);
        print_error(world, err);
        rc = 2;
        goto done;
    }
    while (ts->step < last_step) {
        const double t0 = now_s();
        StepResult sr;
        if (train_step(ts, &sr, err, sizeof err) != 0) {
            print_error(world, err);
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
                          .eta_s = train_s / s * (last_step - s),
                          .has_fp8 = cfg->precision.mode == PRECISION_FP8, .fp8_gemms = sr.fp8_gemms,
                          .has_nodes = m->ep.node_of_ep_rank != NULL, .rows_within_node = sr.rows_within_node,
                          .rows_across_nodes = sr.rows_across_nodes, .max_nodes_per_token = sr.max_nodes_per_token};
        sm.tokens_per_s = tokens_since_line / fmax(train_s - train_s_at_last_line, 1e-9);
        sm.model_tflops = sm.tokens_per_s * flops_per_token * 1e-12 / world->size;  // per rank
        if (s % cfg->log.every == 0 || s == 1 || s == last_step) {
            char line[512];
            format_step_line(line, sizeof line, &sm);
            printf("%s\n", line);
            fflush(stdout);
            tokens_since_line = 0;
            train_s_at_last_line = train_s;
        }
        if (r.writes && metrics_write_step(&r.log, &sm, err, sizeof err) != 0) {
            print_error(world, err);
            write_failed = 1;
        }
        // one agreement per step: a failed metrics write on the writing rank, and any rank's stop request
        double flags[2] = {write_failed, stop_requested};
        comm_allreduce_max_double(world, flags, 2);
        if (flags[0] > 0) {
            save_after_write_error(&r, cfg, s);
            goto done;
        }
        if (flags[1] > 0) stop_requested = 1;
        int stop = flags[1] > 0;
        const int every = cfg->checkpoint.every_steps;
        if (every > 0 && s % every == 0 && s < last_step) {
            if (save_checkpoint(&r, cfg) != 0) goto done;
            stop = stop_agreed(world);  // a request that came during the save
        }
        if (stop) break;
        if (cfg->train.eval_every > 0 && s % cfg->train.eval_every == 0 && s < last_step) {
            int interrupted;
            EvalMetrics em = evaluate(ts, cfg->train.eval_batches, s, &interrupted);
            last_eval_step = s;
            if (interrupted) {
                printf("eval step %d: interrupted, not recorded\n", s);
                break;
            }
            if (write_eval(&r, &em, s) != 0) goto done;
        }
    }

    const int step = ts->step;
    if (!stop_requested && last_eval_step != step) {
        int interrupted;
        EvalMetrics em = evaluate(ts, cfg->train.eval_batches, step, &interrupted);
        if (interrupted) printf("eval step %d: interrupted, not recorded\n", step);
        else if (write_eval(&r, &em, step) != 0) goto done;
    }
    if (stop_requested) printf("interrupted after step %d of %d\n", step, total_steps);
    else if (step < total_steps)
        printf("stopped after step %d of %d (train.stop_after); `fp8moe train --resume` continues\n", step, total_steps);
    // the end, or a stop: a last checkpoint when checkpoints are on or the run stops before train.steps (every
    // rank), then the weights
    const int wants_checkpoint = cfg->checkpoint.every_steps > 0 || (step < total_steps && !stop_requested);
    if (wants_checkpoint && step > 0 && step != r.checkpoint_step && save_checkpoint(&r, cfg) != 0) goto done;
    if (cfg->checkpoint.save_weights && !all_ranks_ok(world, !r.writes || save_weights(&r, cfg) == 0)) goto done;
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
