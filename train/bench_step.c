/*
 * bench_step.c - `fp8moe bench step`: the training step of a job timed end to end in fp8 and in bf16
 * in one run, with tokens/s, model TFLOPS, peak memory and where the step's time goes (kernels/profile.h
 * phases). It exists to answer "how much does the FP8 recipe buy on this job, and what is left".
 *
 * The step is the trainer's own (train_step, train/step.h) on the same TrainState and process groups
 * (train/job_groups.h), without the trainer's logging, evaluation and checkpoints. Steps before --warmup are
 * run and discarded (first-step allocation, cuBLASLt heuristics). Under mpirun the job's parallel layout runs
 * on every rank: each rank times its own steps and phases, and world rank 0 prints the job's tokens/s (the
 * global batch over the slowest rank's step time), per rank, and each phase's mean and slowest rank, the
 * communication phases included (EP all-to-all, pipeline wait, grad sync).
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/profile.h"
#include "parallel/comm.h"
#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"
#include "train/bench.h"
#include "train/cli.h"
#include "train/job_groups.h"
#include "train/step.h"
#include "train/train_state.h"

const char *const bench_step_usage =
    "  [mpirun -np N] fp8moe bench step [JOB.ini] [--steps N] [--warmup N] [--set section.key=value]...\n"
    "      Time N training steps (default 10) of JOB.ini (default configs/bench-1gpu.ini) after N warm-up\n"
    "      steps (default 3), in fp8 and then in bf16: tokens/s, model TFLOPS, peak memory and the ms per\n"
    "      step of attention, expert GEMMs, other GEMMs, quantisation, MoE permute, optimizer, the\n"
    "      communication (EP all-to-all, pipeline wait, grad sync) and the rest. Under mpirun the job's\n"
    "      parallel layout runs as `fp8moe train` runs it; the figures are then per rank (mean and slowest).\n"
    "      With parallel.pp > 1 it also prints every stage's F, B and W and the schedule simulated with them\n"
    "      (sends that wait, as the executor's do, and sends that do not) beside the measured bubble.\n";

typedef struct {
    int steps;
    int ranks;                // world size
    int64_t tokens_per_step;  // of the global batch
    double flops_per_token;
    double step_s;                   // summed over the timed steps; the slowest rank's
    double phase_s[PHASE_COUNT];     // summed over the timed steps; mean over ranks
    double phase_max_s[PHASE_COUNT]; // the slowest rank's
    double peak_bytes;               // the largest rank's
    Device dev;
    // a pipeline (pp > 1): the compute ops over the timed steps by pp rank, chunk and kind, summed over the pp
    // rank's data-parallel replicas (profile_op_totals)
    int pp, n_mb;
    SchedKind kind;
    double op_s[SCHED_MAX_PP][PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT];
    double op_n[SCHED_MAX_PP][PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT];
    double busy_min_s, busy_max_s;  // a rank's compute ops per step: the least and the most busy rank's
} StepBench;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------- one precision

// Loads the job with precision.mode = mode appended to the user's overrides, makes its process groups, runs
// warmup + steps training steps with the profiler on, and fills *out with the figures over the ranks (on every
// rank). Collective. Returns 0, 1 on a run error, 2 on an invalid job (the same on every rank).
static int bench_precision(const char *job, const char **overrides, int n_overrides, const char *mode, int steps,
                           int warmup, StepBench *out) {
    char err[2048];
    char mode_set[64];
    Comm *world = comm_world();
    snprintf(mode_set, sizeof mode_set, "precision.mode=%s", mode);
    overrides[n_overrides] = mode_set;  // the caller left one slot
    Config *cfg = malloc(sizeof *cfg);
    if (!cfg) return 1;
    if (config_load(cfg, job, overrides, n_overrides + 1, err, sizeof err) != 0) {
        if (world->rank == 0) fprintf(stderr, "%s\n", err);  // the same message on every rank
        free(cfg);
        return 2;
    }
    int rc = 1, ok = 0;
    TrainState ts;
    memset(&ts, 0, sizeof ts);
    JobGroups jg;
    memset(&jg, 0, sizeof jg);
    const int B = cfg->train.micro_batch_size, T = cfg->train.seq_len, A = cfg->train.grad_accum;
    Device dev;
    printf("\n# bench step: precision %s\n", mode);
    if (train_state_pick_device(cfg, &dev) != 0) goto done;
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    if (job_groups_create(&jg, cfg, dev) != 0) {
        rc = 2;
        goto done;
    }
    ok = train_state_create(&ts, cfg, dev, &jg.groups, warmup + steps, 0, err, sizeof err) == 0;
    if (!ok) fprintf(stderr, "fp8moe: rank %d: %s\n", world->rank, err);
    double all_ok = ok;
    comm_allreduce_min_double(world, &all_ok, 1);
    if (all_ok == 0) goto done;  // every rank leaves here together
    Model *m = &ts.model;
    *out = (StepBench){.steps = steps, .ranks = world->size, .tokens_per_step = ts.tokens_per_step,
                       .flops_per_token = model_flops_per_token(m, T), .dev = dev};
    printf("bench step: %lld parameters%s, %d x %d x %d tokens per step%s, %d warm-up + %d timed steps\n",
           (long long)model_num_params(m), world->size > 1 ? " on rank 0" : "", A, B, T,
           world->size > 1 ? " per data-parallel rank" : "", warmup, steps);
    fflush(stdout);

    out->pp = cfg->parallel.pp, out->n_mb = A, out->kind = (SchedKind)cfg->parallel.schedule;
    double op_s[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT], op_s0[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT] = {{0}};
    int64_t op_n[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT], op_n0[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT] = {{0}};
    profile_enable(dev, 1);
    model_zero_load(m);
    for (int step = 0; step < warmup + steps; step++) {
        if (step == warmup) profile_op_totals(op_s0, op_n0);  // the ops of the warm-up steps are left out
        double phase_s[PHASE_COUNT];
        profile_step_collect(phase_s);  // waits for the device: the step starts from idle
        const double t0 = now_s();
        StepResult sr;
        if (train_step(&ts, &sr, err, sizeof err) != 0) {  // every rank fails the same step (the agreement)
            fprintf(stderr, "fp8moe: rank %d: bench step (%s): %s\n", world->rank, mode, err);
            goto done;
        }
        profile_step_collect(phase_s);
        const double t1 = now_s();
        if (step < warmup) continue;
        out->step_s += t1 - t0;
        for (int p = 0; p < PHASE_COUNT; p++) out->phase_s[p] += phase_s[p];
    }
    out->peak_bytes = profile_peak_memory_bytes();
    profile_op_totals(op_s, op_n);
    double busy = 0;
    const int q = ts.pp->rank;  // this rank's entries; the other pp ranks' come with the sums below
    for (int c = 0; c < PROFILE_MAX_CHUNKS; c++)
        for (int k = 0; k < PROFILE_OP_COUNT; k++) {
            out->op_s[q][c][k] = op_s[c][k] - op_s0[c][k];
            out->op_n[q][c][k] = (double)(op_n[c][k] - op_n0[c][k]);
            busy += out->op_s[q][c][k];
        }
    out->busy_min_s = out->busy_max_s = busy / steps;
    comm_allreduce_min_double(world, &out->busy_min_s, 1);
    comm_allreduce_max_double(world, &out->busy_max_s, 1);
    const int op_entries = SCHED_MAX_PP * PROFILE_MAX_CHUNKS * PROFILE_OP_COUNT;
    comm_allreduce_sum_double(world, &out->op_s[0][0][0], op_entries);
    comm_allreduce_sum_double(world, &out->op_n[0][0][0], op_entries);
    memcpy(out->phase_max_s, out->phase_s, sizeof out->phase_s);
    comm_allreduce_max_double(world, out->phase_max_s, PHASE_COUNT);
    comm_allreduce_sum_double(world, out->phase_s, PHASE_COUNT);
    for (int p = 0; p < PHASE_COUNT; p++) out->phase_s[p] /= world->size;
    comm_allreduce_max_double(world, &out->step_s, 1);
    comm_allreduce_max_double(world, &out->peak_bytes, 1);
    rc = 0;
done:
    profile_enable(dev, 0);
    train_state_free(&ts);
    job_groups_free(&jg);
    free(cfg);
    return rc;
}

// ---------------------------------------------------------------------------- report

static double tokens_per_s(const StepBench *r) { return (double)r->tokens_per_step * r->steps / r->step_s; }
static double gemm_s(const StepBench *r, int with_quantisation) {
    return r->phase_s[PHASE_EXPERT_GEMM] + r->phase_s[PHASE_OTHER_GEMM] +
           (with_quantisation ? r->phase_s[PHASE_QUANTISE] : 0);
}

static void print_table(const char *mode, const StepBench *r) {
    const double tps = tokens_per_s(r), step_ms = 1e3 * r->step_s / r->steps;
    const int many = r->ranks > 1;
    printf("\n%s: %d steps, %.1f ms/step%s\n", mode, r->steps, step_ms, many ? " (the slowest rank)" : "");
    printf("  %-14s %14.0f\n", "tokens/s", tps);
    if (many) printf("  %-14s %14.0f (%d ranks)\n", "tokens/s/rank", tps / r->ranks, r->ranks);
    printf("  %-14s %14.3f%s\n", "model TFLOPS", tps * r->flops_per_token * 1e-12 / r->ranks, many ? " per rank" : "");
    printf("  %-14s %14.2f GiB (%s%s)\n", "peak memory", r->peak_bytes / (1024.0 * 1024.0 * 1024.0),
           r->dev == DEVICE_CUDA ? "GPU in use, cudaMemGetInfo" : "process peak RSS", many ? "; the largest rank" : "");
    printf("  %-14s %14s %9s", "phase", "ms/step", "% step");
    if (many) printf(" %14s", "slowest rank");
    printf("\n");
    double sum_s = 0;
    for (int p = 0; p < PHASE_COUNT; p++) {
        sum_s += r->phase_s[p];
        printf("  %-14s %14.3f %8.1f%%", profile_phase_name((Phase)p), 1e3 * r->phase_s[p] / r->steps,
               100.0 * r->phase_s[p] / r->step_s);
        if (many) printf(" %14.3f", 1e3 * r->phase_max_s[p] / r->steps);
        printf("\n");
    }
    printf("  %-14s %14.3f %8.1f%%\n", "other", 1e3 * (r->step_s - sum_s) / r->steps,
           100.0 * (r->step_s - sum_s) / r->step_s);
}

// The mean seconds of op kind k of pp rank q's chunk c (q < 0: over every rank and chunk), 0 when none ran.
static double op_mean(const StepBench *r, int q, int c, ProfileOp k) {
    double s = 0, n = 0;
    for (int p = 0; p < r->pp; p++)
        for (int h = 0; h < PROFILE_MAX_CHUNKS; h++)
            if (q < 0 || (p == q && h == c)) s += r->op_s[p][h][k], n += r->op_n[p][h][k];
    return n > 0 ? s / n : 0.0;
}

// The simulator's costs of pp rank q's chunk c (q < 0: the means over all) from the measured ops: F; W, the
// weight-gradient part (W ops); B, the full backward where the chunk ran B ops (1F1B, DualPipe's), else I + W
// (ZB1P), so the simulator's I is B - W; F&B = F + B (the executor runs FB as F then B, train/step_plan.h).
// wait_sends: the executor waits for a batch's sends with its receives (train/step.c).
static SchedCosts measured_costs(const StepBench *r, int q, int c) {
    const double f = op_mean(r, q, c, PROFILE_OP_FORWARD), b = op_mean(r, q, c, PROFILE_OP_BACKWARD);
    const double i = op_mean(r, q, c, PROFILE_OP_BACKWARD_INPUT), w = op_mean(r, q, c, PROFILE_OP_BACKWARD_WEIGHT);
    const double full = b > 0 ? b : i + w;
    return (SchedCosts){.f = f, .b = full, .w = w, .fb = f + full, .wait_sends = 1};
}

// The largest of the pp ranks' simulated bubbles (the idlest rank's).
static double idlest_bubble(const SchedSim *sim, int pp) {
    double bubble = 0;
    for (int q = 0; q < pp; q++) bubble = sim->bubble[q] > bubble ? sim->bubble[q] : bubble;
    return bubble;
}

// A pipeline's bubble against the simulator's: the schedule of the job simulated with every stage's measured mean
// op costs (measured_costs of each pp rank and chunk: the stages differ, the last holding the head, the losses and
// MTP), beside the measured pipeline wait. Both are the idlest rank's, per step. The same simulated with sends that
// complete at once says what the executor's waiting for sends costs. The compute per step of the least and the most
// busy rank is printed too.
static void print_pipeline_check(const char *mode, const StepBench *r) {
    if (r->pp <= 1) return;
    const SchedCosts mean = measured_costs(r, -1, 0);
    if (mean.f <= 0 || mean.b <= 0) return;
    SchedCosts stage[2 * SCHED_MAX_PP];
    for (int q = 0; q < r->pp; q++)
        for (int c = 0; c < 2; c++) stage[2 * q + c] = measured_costs(r, q, c);
    char err[256];
    Schedule s;
    memset(&s, 0, sizeof s);
    SchedSim sim, sim_eager;
    memset(&sim, 0, sizeof sim);
    memset(&sim_eager, 0, sizeof sim_eager);
    int ok = schedule_build(&s, r->kind, r->pp, r->n_mb, err, sizeof err) == 0 &&
             schedule_simulate_stages(&s, stage, &sim, err, sizeof err) == 0;
    // What the executor's waiting for sends costs: the same schedule and costs with sends that complete at once
    for (int k = 0; k < 2 * r->pp; k++) stage[k].wait_sends = 0;
    ok = ok && schedule_simulate_stages(&s, stage, &sim_eager, err, sizeof err) == 0;
    if (!ok) {
        printf("%s pipeline: cannot simulate %s: %s\n", mode, schedule_kind_name(r->kind), err);
        schedule_sim_free(&sim_eager);
        schedule_sim_free(&sim);
        schedule_free(&s);
        return;
    }
    const double bubble = idlest_bubble(&sim, r->pp);
    const double bubble_eager = idlest_bubble(&sim_eager, r->pp);
    const double wait = r->phase_max_s[PHASE_PIPE_WAIT] / r->steps, step = r->step_s / r->steps;
    printf("%s pipeline (%s, pp %d, %d micro-batches): measured F %.3f ms, B %.3f ms", mode,
           schedule_kind_name(r->kind), r->pp, r->n_mb, 1e3 * mean.f, 1e3 * mean.b);
    if (mean.w > 0) printf(", W %.3f ms", 1e3 * mean.w);
    printf(" per op (mean over ranks and ops)\n");
    for (int q = 0; q < r->pp; q++)
        for (int c = 0; c < s.n_chunks; c++) {
            const SchedCosts *k = &stage[2 * q + c];
            printf("    rank %d chunk %d (stage %d of pipe %d): F %.3f ms, B %.3f ms, W %.3f ms\n", q, c,
                   s.chunk[q][c].stage, s.chunk[q][c].pipe, 1e3 * k->f, 1e3 * k->b, 1e3 * k->w);
        }
    printf("  simulated with every stage's costs: makespan %.3f ms, bubble %.3f ms (%.1f%%; the idlest rank)\n",
           1e3 * sim.makespan, 1e3 * bubble, sim.makespan > 0 ? 100.0 * bubble / sim.makespan : 0.0);
    printf("  simulated with sends that do not wait (the executor waits for a batch's sends with its receives): "
           "makespan %.3f ms, bubble %.3f ms\n", 1e3 * sim_eager.makespan, 1e3 * bubble_eager);
    printf("  measured: pipeline wait %.3f ms per step (%.1f%% of the step; the idlest rank); measured / simulated "
           "bubble %.3f\n", 1e3 * wait, 100.0 * wait / step, bubble > 0 ? wait / bubble : 0.0);
    printf("  stage balance: compute ops %.3f ms per step on the least busy rank, %.3f on the most busy\n",
           1e3 * r->busy_min_s, 1e3 * r->busy_max_s);
    schedule_sim_free(&sim_eager);
    schedule_sim_free(&sim);
    schedule_free(&s);
}

// ---------------------------------------------------------------------------- command

static int parse_count(const char *opt, const char *value, int min, int *out) {
    if (cli_parse_int(value, min, 1000000, out)) {
        fprintf(stderr, "fp8moe bench step: %s %s: expected an integer >= %d\n\nUsage:\n%s", opt,
                value ? value : "(missing)", min, bench_step_usage);
        return -1;
    }
    return 0;
}

int bench_step_main(int argc, char **argv) {
    const char *job = NULL;
    int steps = 10, warmup = 3, mpi = 0;
    const char **overrides = calloc((size_t)argc + 2, sizeof *overrides);  // + precision.mode
    int n_overrides = 0, rc = 2;
    if (!overrides) return 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", bench_step_usage);
            rc = 0;
            goto done;
        } else if (!strcmp(a, "--steps") || !strcmp(a, "--warmup")) {
            const char *v = i + 1 < argc ? argv[++i] : NULL;
            if (parse_count(a, v, !strcmp(a, "--steps") ? 1 : 0, !strcmp(a, "--steps") ? &steps : &warmup) != 0)
                goto done;
        } else if (!strcmp(a, "--set")) {
            if (i + 1 >= argc || !cli_is_override(argv[i + 1])) {
                fprintf(stderr, "fp8moe bench step: --set %s: expected section.key=value\n\nUsage:\n%s",
                        i + 1 < argc ? argv[i + 1] : "(missing)", bench_step_usage);
                goto done;
            }
            overrides[n_overrides++] = argv[++i];
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "fp8moe bench step: unknown option %s\n\nUsage:\n%s", a, bench_step_usage);
            goto done;
        } else if (job) {
            fprintf(stderr, "fp8moe bench step: one job file expected; got a second one: %s\n\nUsage:\n%s", a,
                    bench_step_usage);
            goto done;
        } else {
            job = a;
        }
    }
    if (!job) job = "configs/bench-1gpu.ini";
    // under mpirun every rank runs the job's layout and world rank 0 reports (the trainer's convention, main.c)
    mpi = comm_launched_by_mpi();
    if (mpi) comm_init(NULL, NULL);
    if (comm_world()->rank != 0 && !freopen("/dev/null", "w", stdout)) {
        fprintf(stderr, "fp8moe: rank %d: cannot silence stdout\n", comm_world()->rank);
        rc = 1;
        goto done;
    }
    static const char *const modes[2] = {"fp8", "bf16"};
    StepBench r[2];
    for (int i = 0; i < 2; i++) {
        rc = bench_precision(job, overrides, n_overrides, modes[i], steps, warmup, &r[i]);
        if (rc != 0) goto done;
    }
    if (r[0].ranks > 1) printf("\n# bench step: %d ranks; a phase's ms/step is the mean over the ranks, then the slowest rank's\n",
                               r[0].ranks);
    printf("\n# bench step: %s, %d timed steps after %d warm-up\n", job, steps, warmup);
    for (int i = 0; i < 2; i++) print_table(modes[i], &r[i]);
    if (r[0].pp > 1) printf("\n");
    for (int i = 0; i < 2; i++) print_pipeline_check(modes[i], &r[i]);
    printf("\nfp8/bf16 tokens/s: %.3f\n", tokens_per_s(&r[0]) / tokens_per_s(&r[1]));
    const double g_bf16 = gemm_s(&r[1], 0);
    if (g_bf16 > 0)
        printf("GEMM time fp8 (expert + other GEMM + quantisation) / bf16 (expert + other GEMM): %.3f\n",
               gemm_s(&r[0], 1) / g_bf16);
    fflush(stdout);
    rc = 0;
done:
    free(overrides);
    if (mpi) comm_finalize();
    return rc;
}
