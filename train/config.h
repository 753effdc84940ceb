/*
 * config.h - the job: everything an INI job file (plus --set overrides) can say, resolved and checked.
 *
 * One plain struct per INI section. config_load() parses the file with libinih against a table of
 * keys (type, range, default, doc); every key is documented in docs/config.md, which is checked
 * against that table by a test. Errors stop with `file:line: section.key: what was expected`.
 */
#ifndef FP8MOE_CONFIG_H
#define FP8MOE_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "optim/optim_config.h"  // OptimConfig: optim/ owns the numbers it takes

#define CONFIG_PATH_MAX 1024
#define CONFIG_MAX_STAGES 256  // pipeline stages parallel.stage_layers may list (dualpipev: 2 x parallel.pp)

typedef struct {
    int vocab_size;        // 256 for byte-level data, 50257 for GPT-2 shards
    int dim;               // model width d
    int n_layers;          // Transformer blocks in the main model
    int n_dense_layers;    // first_k_dense_replace: blocks 0..n_dense_layers-1 use a dense FFN
    int inter_dim;         // dense SwiGLU hidden width
    int n_heads;
    int q_lora_rank;       // 0 = no query compression (q = W_Q h)
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    double rope_theta;     // 10000
    double init_std;       // std of the normal init of Linear and embedding weights
} ModelConfig;

typedef struct {
    int n_routed_experts;      // E
    int n_shared_experts;      // shared expert width = n_shared_experts * moe_inter_dim
    int n_activated_experts;   // K, top-K per token
    int n_expert_groups;
    int n_limited_groups;      // groups a token may use (node-limited routing)
    int moe_inter_dim;
    double route_scale;
    double bias_update_speed;  // gamma of the aux-loss-free bias update
    double balance_loss_alpha; // alpha of the sequence-wise balance loss
} MoeConfig;

typedef struct {
    int depth;           // D MTP modules (0 = off)
    double loss_weight;  // lambda
} MtpConfig;

typedef enum { PRECISION_FP32 = 0, PRECISION_BF16 = 1, PRECISION_FP8 = 2 } PrecisionMode;
typedef struct {
    PrecisionMode mode;
    // fp8 mode only: GEMM kinds of the block Linears run in BF16 instead (the bf16 mode's GEMMs), for finding
    // which kind makes fp8 differ from bf16 (TransformerEngine's override_linear_precision does the same)
    int bf16_fprop, bf16_dgrad, bf16_wgrad;
    // with bf16_fprop: only the Linears whose tensor names contain one of these comma-separated parts ("wq_b",
    // "layers.2.attn.wq_a") run their Fprop in BF16; empty = every Linear
    char bf16_fprop_only[CONFIG_PATH_MAX];
} PrecisionConfig;

typedef enum { PARALLEL_BACKEND_AUTO = 0, PARALLEL_BACKEND_MPI = 1, PARALLEL_BACKEND_NCCL = 2 } ParallelBackend;
// The pipeline schedules, in the order of parallel/schedule.h's SchedKind (config.c checks that they agree).
typedef enum { PIPE_1F1B = 0, PIPE_ZB1P = 1, PIPE_DUALPIPE = 2, PIPE_DUALPIPEV = 3 } PipelineSchedule;
typedef struct {
    int pp;                   // pipeline stages
    PipelineSchedule schedule;  // the pipeline schedule of pp > 1 (its micro-batches: train.grad_accum)
    char stage_layers[CONFIG_PATH_MAX];  // layers per pipeline stage, "2,3,3"; empty = as even as the count allows
    int n_stage_layers;                  // the entries of stage_layers, parsed by config_load (0: empty)
    int stage_layer_count[CONFIG_MAX_STAGES];
    int ep;                   // expert-parallel ranks
    int dp;                   // data-parallel ranks
    ParallelBackend backend;  // auto: NCCL for GPU ranks when the build has it, else MPI
    int gpus_per_node;        // ranks per node for node-limited routing; 0 = the ranks MPI reports per host
    double timeout_s;         // the longest any collective or message may wait (parallel/comm.h)
    int zero1;                // shard FP32 master weights and AdamW moments over dp
} ParallelConfig;


typedef enum { DEVICE_SEL_AUTO = 0, DEVICE_SEL_CPU = 1, DEVICE_SEL_CUDA = 2 } DeviceSelect;
typedef struct {
    int steps;
    int stop_after;        // stop after this step with a checkpoint (the schedule still spans steps); 0 = steps
    int micro_batch_size;  // sequences per micro-batch
    int seq_len;
    int grad_accum;        // micro-batches per step
    uint64_t seed;
    DeviceSelect device;
    int eval_every;        // steps between validation evaluations (0 = only at the end)
    int eval_batches;      // micro-batches per evaluation; 0 = the whole validation split
    int threads;           // OpenMP threads on the CPU; 0 = all cores
} TrainConfig;

typedef struct {
    char text[CONFIG_PATH_MAX];      // comma-separated text files to prepare; empty = default text
    char shards[CONFIG_PATH_MAX];    // directory of existing llm.c shards (overrides text)
    char cache_dir[CONFIG_PATH_MAX]; // where prepared shards go
} DataConfig;

typedef struct {
    char dir[CONFIG_PATH_MAX];       // run directory: weights.h5 and metrics.jsonl go here
    int save_weights;                // save FP32 weights at the end and on Ctrl-C
    int every_steps;                 // a resumable checkpoint every N steps (and at the end); 0 = none
    int keep_last;                   // checkpoints kept; 0 = all
} CheckpointConfig;

typedef struct {
    int every;                       // print a step line every N steps
    char jsonl[CONFIG_PATH_MAX];     // metrics file; empty = <checkpoint.dir>/metrics.jsonl
} LogConfig;

typedef struct {
    char path[CONFIG_PATH_MAX];  // the job file it came from
    ModelConfig model;
    MoeConfig moe;
    MtpConfig mtp;
    PrecisionConfig precision;
    ParallelConfig parallel;
    OptimConfig optim;
    TrainConfig train;
    DataConfig data;
    CheckpointConfig checkpoint;
    LogConfig log;
} Config;

// Fill every key with its default (a valid config except for required keys).
void config_defaults(Config *c);
// Parse `path`, then apply `n_overrides` strings of the form "section.key=value" in order.
// Returns 0 on success; on error writes one line `file:line: section.key: what was expected` (or
// `--set section.key=...: ...` for overrides) into err and returns -1.
int config_load(Config *c, const char *path, const char *const *overrides, int n_overrides, char *err,
                size_t err_size);
// Same as config_load but from a string (tests); `name` is used as the file name in errors.
int config_load_string(Config *c, const char *name, const char *text, const char *const *overrides,
                       int n_overrides, char *err, size_t err_size);
// The checks that need the number of ranks, made at start by every rank: world_size = parallel.pp *
// parallel.dp, parallel.ep divides parallel.dp and moe.n_routed_experts, and parallel.backend is one this
// build has. Returns 0, or -1 with one line in err naming the keys and numbers. (The placement of expert
// groups on nodes needs the hosts: groups_check_expert_groups in parallel/groups.h.)
int config_check_layout(const Config *c, int world_size, char *err, size_t err_size);
// Print the resolved config as INI (every key, including defaults) to f.
void config_print(const Config *c, FILE *f);

// "bf16,fp8" -> the words of the list, each one of `words` (NULL-terminated) and at most once, in the list's order
// (the --modes lists of fp8moe compare and gradcompare). out receives pointers into words (room for as many as
// words has). Returns how many, or -1 with err saying which word is unknown or repeated and listing `words`.
int config_parse_word_list(const char *list, const char *const *words, const char **out, char *err, size_t err_size);
// The same over the precision.mode words ("fp32", "bf16", "fp8").
int config_parse_mode_list(const char *list, const char *modes[3], char *err, size_t err_size);
// Print the key table as the Markdown reference (docs/config.md is generated from it and checked).
void config_print_reference(FILE *f);

#endif
