/*
 * bench_step.c - `fp8moe bench step`: the training step of a job timed end to end in fp8 and in bf16
 * in one run, with tokens/s, model TFLOPS, peak memory and where the step's time goes (kernels/profile.h
 * phases). It exists to answer "how much does the FP8 recipe buy on this job, and what is left".
 *
 * The step is the trainer's own (train_step, train/step.h) on the same TrainState, without the
 * trainer's logging, evaluation and checkpoints. Steps before --warmup are run and discarded
 * (first-step allocation, cuBLASLt heuristics).
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/profile.h"
#include "train/bench.h"
#include "train/step.h"
#include "train/train_state.h"

const char *const bench_step_usage =
    "  fp8moe bench step [JOB.ini] [--steps N] [--warmup N] [--set section.key=value]...\n"
    "      Time N training steps (default 10) of JOB.ini (default configs/bench-1gpu.ini) after N warm-up\n"
    "      steps (default 3), in fp8 and then in bf16: tokens/s, model TFLOPS, peak memory and the ms per\n"
    "      step of attention, expert GEMMs, other GEMMs, quantisation, MoE permute, optimizer and the rest.\n";

typedef struct {
    int steps;
    int64_t tokens_per_step;
    double flops_per_token;
    double step_s;  // summed over the timed steps
    double phase_s[PHASE_COUNT];
    double peak_bytes;
    Device dev;
} StepBench;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------- one precision

// Loads the job with precision.mode = mode appended to the user's overrides, runs warmup + steps
// training steps with the profiler on, fills *out. Returns 0, 1 on a run error, 2 on an invalid job.
static int bench_precision(const char *job, const char **overrides, int n_overrides, const char *mode, int steps,
                           int warmup, StepBench *out) {
    char err[2048];
    char mode_set[64];
    snprintf(mode_set, sizeof mode_set, "precision.mode=%s", mode);
    overrides[n_overrides] = mode_set;  // the caller left one slot
    Config *cfg = malloc(sizeof *cfg);
    if (!cfg) return 1;
    if (config_load(cfg, job, overrides, n_overrides + 1, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        free(cfg);
        return 2;
    }
    int rc = 1;
    TrainState ts;
    memset(&ts, 0, sizeof ts);
    const int B = cfg->train.micro_batch_size, T = cfg->train.seq_len, A = cfg->train.grad_accum;
    Device dev;
    printf("\n# bench step: precision %s\n", mode);
    if (train_state_pick_device(cfg, &dev) != 0) goto done;
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    if (train_state_create(&ts, cfg, dev, NULL, warmup + steps, 0, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe: %s\n", err);
        goto done;
    }
    Model *m = &ts.model;
    *out = (StepBench){.steps = steps, .tokens_per_step = ts.tokens_per_step,
                       .flops_per_token = model_flops_per_token(m, T), .dev = dev};
    printf("bench step: %lld parameters, %d x %d x %d tokens per step, %d warm-up + %d timed steps\n",
           (long long)model_num_params(m), A, B, T, warmup, steps);
    fflush(stdout);

    profile_enable(dev, 1);
    model_zero_load(m);
    for (int step = 0; step < warmup + steps; step++) {
        double phase_s[PHASE_COUNT];
        profile_step_collect(phase_s);  // waits for the device: the step starts from idle
        const double t0 = now_s();
        StepResult sr;
        if (train_step(&ts, &sr, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe: bench step (%s): %s\n", mode, err);
            goto done;
        }
        profile_step_collect(phase_s);
        const double t1 = now_s();
        if (step < warmup) continue;
        out->step_s += t1 - t0;
        for (int p = 0; p < PHASE_COUNT; p++) out->phase_s[p] += phase_s[p];
    }
    out->peak_bytes = profile_peak_memory_bytes();
    rc = 0;
done:
    profile_enable(dev, 0);
    train_state_free(&ts);
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
    printf("\n%s: %d steps, %.1f ms/step\n", mode, r->steps, step_ms);
    printf("  %-14s %14.0f\n", "tokens/s", tps);
    printf("  %-14s %14.3f\n", "model TFLOPS", tps * r->flops_per_token * 1e-12);
    printf("  %-14s %14.2f GiB (%s)\n", "peak memory", r->peak_bytes / (1024.0 * 1024.0 * 1024.0),
           r->dev == DEVICE_CUDA ? "GPU in use, cudaMemGetInfo" : "process peak RSS");
    printf("  %-14s %14s %9s\n", "phase", "ms/step", "% step");
    double sum_s = 0;
    for (int p = 0; p < PHASE_COUNT; p++) {
        sum_s += r->phase_s[p];
        printf("  %-14s %14.3f %8.1f%%\n", profile_phase_name((Phase)p), 1e3 * r->phase_s[p] / r->steps,
               100.0 * r->phase_s[p] / r->step_s);
    }
    printf("  %-14s %14.3f %8.1f%%\n", "other", 1e3 * (r->step_s - sum_s) / r->steps,
           100.0 * (r->step_s - sum_s) / r->step_s);
}

// ---------------------------------------------------------------------------- command

static int parse_count(const char *opt, const char *value, int min, int *out) {
    char *end = NULL;
    long v = value ? strtol(value, &end, 10) : 0;
    if (!value || *end != '\0' || end == value || v < min || v > 1000000) {
        fprintf(stderr, "fp8moe bench step: %s %s: expected an integer >= %d\n\nUsage:\n%s", opt,
                value ? value : "(missing)", min, bench_step_usage);
        return -1;
    }
    *out = (int)v;
    return 0;
}

int bench_step_main(int argc, char **argv) {
    const char *job = NULL;
    int steps = 10, warmup = 3;
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
            if (i + 1 >= argc || !strchr(argv[i + 1], '=') || !strchr(argv[i + 1], '.')) {
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
    static const char *const modes[2] = {"fp8", "bf16"};
    StepBench r[2];
    for (int i = 0; i < 2; i++) {
        rc = bench_precision(job, overrides, n_overrides, modes[i], steps, warmup, &r[i]);
        if (rc != 0) goto done;
    }
    printf("\n# bench step: %s, %d timed steps after %d warm-up\n", job, steps, warmup);
    for (int i = 0; i < 2; i++) print_table(modes[i], &r[i]);
    printf("\nfp8/bf16 tokens/s: %.3f\n", tokens_per_s(&r[0]) / tokens_per_s(&r[1]));
    const double g_bf16 = gemm_s(&r[1], 0);
    if (g_bf16 > 0)
        printf("GEMM time fp8 (expert + other GEMM + quantisation) / bf16 (expert + other GEMM): %.3f\n",
               gemm_s(&r[0], 1) / g_bf16);
    fflush(stdout);
    rc = 0;
done:
    free(overrides);
    return rc;
}
