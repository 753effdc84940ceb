/*
 * metrics.h - what a training run reports: the one-line step and eval summaries printed to stdout and
 * the same numbers as JSON Lines (one object per step and per eval) for plots and tests.
 *
 * Formatting lives here, apart from the trainer loop, so that the exact text of a log line (which
 * scripts and tests grep for, e.g. `val_loss=1.9876`) is defined in one place.
 */
#ifndef FP8MOE_METRICS_H
#define FP8MOE_METRICS_H

#include <stdint.h>
#include <stdio.h>

typedef struct {
    int step, total_steps;       // 1-based step just finished, of total_steps
    double loss;                 // main-head CE, mean over the step's micro-batches (nats/token)
    int has_mtp;                 // MTP depth > 0: mtp is meaningful
    double mtp;                  // mean over depths of the MTP CE, mean over micro-batches
    double balance;              // sequence-wise balance loss, mean over micro-batches
    int has_moe;                 // the model has MoE layers: load_max_mean is meaningful
    double load_max_mean;        // worst MoE layer's max/mean of this step's expert token counts
    double lr;
    double grad_norm;            // global L2 norm before clipping
    double tokens_per_s;
    double model_tflops;         // tokens_per_s x model FLOPs per token (model_flops_per_token), per device
    double elapsed_s;            // wall time since training started
    double eta_s;                // estimated time to the last step
    int has_fp8;                 // precision = fp8: fp8_gemms is meaningful
    int64_t fp8_gemms;           // FP8 GEMMs run in this step (Fprop + Dgrad + Wgrad of every block Linear)
    int has_nodes;               // expert parallel: the dispatch's node traffic below is meaningful
    int64_t rows_within_node, rows_across_nodes;  // (token, k) rows all ranks' dispatches sent this step
    int max_nodes_per_token;     // the most nodes one token's experts lay on (node-limited routing's bound)
} StepMetrics;

typedef struct {
    int step;
    double val_loss;             // main-head CE over the evaluated validation tokens
    int64_t tokens;              // validation tokens evaluated
    double seconds;              // wall time of the evaluation
} EvalMetrics;

// Duration as the log prints it: "42s", "1m02s", "2h05m"; "-" for negative or non-finite seconds.
void format_duration(char *buf, size_t size, double seconds);
// Non-negative integer part of x with thousands separators: 12345.6 -> "12,345".
void format_thousands(char *buf, size_t size, double x);

// `step 12/1000 | loss 2.3456 | mtp 2.4567 | bal 1.02e-04 | load max/mean 1.23 | lr 1.00e-03 |
//  gnorm 0.456 | 12,345 tok/s | 0.041 TFLOPS | elapsed 1m02s | eta 9m15s` (mtp and load parts only when present;
//  `| fp8 gemms 540` at the end in fp8 mode; `| a2a rows 900 in-node 300 cross-node, <= 2 nodes/token` under
//  expert parallel).
void format_step_line(char *buf, size_t size, const StepMetrics *s);
// `eval step 100 | val_loss=1.9876 | 3.2s`
void format_eval_line(char *buf, size_t size, const EvalMetrics *e);

// JSON Lines writer. Each write is one complete line, flushed, so a killed run leaves a valid prefix.
typedef struct {
    FILE *f;
    char path[1024];
} MetricsLog;

#define METRICS_FORMAT "fp8moe-metrics-1"

// Opens path for a new run and writes its first record, {"type":"run","format":METRICS_FORMAT,
// "pid":N,"job":JOB}, flushed, so an output that cannot take data fails here, before any training.
// Refuses (-1) a path that holds anything but an earlier metrics file, or one that another live run
// is writing; an earlier run's metrics file is kept as <stem>.prev.jsonl (run_dir_keep_previous).
// continue_after >= 0 (a run resumed from the checkpoint of that step): the new file starts with the earlier
// file's records up to that step (its run records, and its step and eval records of steps <= continue_after),
// so that one file holds the whole run however often it was resumed; the records after it, of the steps the
// resumed run trains again, stay in the .prev file only. -1: a new file.
// Returns 0, or -1 with `path: reason` in err.
int metrics_open(MetricsLog *log, const char *path, const char *job, int64_t continue_after, char *err,
                 size_t err_size);
// {"type":"step","step":12,...}; non-finite numbers are written as null (JSON has no NaN).
// Returns 0, or -1 with `path: reason` in err.
int metrics_write_step(MetricsLog *log, const StepMetrics *s, char *err, size_t err_size);
int metrics_write_eval(MetricsLog *log, const EvalMetrics *e, char *err, size_t err_size);
void metrics_close(MetricsLog *log);

#endif
