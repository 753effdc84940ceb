/*
 * config.c - the job file: INI text (plus --set overrides) -> a checked Config.
 *
 * Everything a job file can say is one row of key_table below: section, key, type, range, default,
 * one-line doc and the offset of the field in Config. Parsing, defaults, printing the resolved job
 * and the Markdown reference in docs/config.md are all driven by that table, so a key cannot exist
 * in one of them and be missing from another.
 *
 * libinih does the INI tokenising. It is fed through our own line reader, which counts lines (the
 * Debian build has no INI_HANDLER_LINENO, and defining it here would break the library's ABI), strips
 * leading whitespace (so an indented line is never glued to the previous value as a multi-line
 * continuation), checks [section] headers and `key = value` syntax with messages that say what was
 * expected, and hands values longer than libinih's 200-byte line buffer to the handler on the side.
 * Every error is one line: `file:line: section.key: what was found - expected what`.
 */
#include "train/config.h"

#include "kernels/kernels.h"  // FP8_MAX_SEGMENTS
#include "parallel/groups.h"   // layout_make
#include "parallel/schedule.h" // SchedKind, which PipelineSchedule mirrors
#include "train/model.h"      // MTP_MAX_DEPTH

#include <errno.h>
#include <float.h>
#include <ini.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------- the key table

typedef enum { KEY_INT, KEY_UINT64, KEY_DOUBLE, KEY_BOOL, KEY_STRING, KEY_ENUM } KeyType;

typedef struct {
    const char *section;
    const char *name;
    KeyType type;
    size_t offset;             // of the field inside Config
    double lo, hi;             // int/double: allowed range; string: allowed length
    int lo_open, hi_open;      // double: bound excluded, printed as ( or )
    const char *def;           // default, as it would be written in the job file
    const char *const *words;  // enum: allowed words, index = enum value, NULL-terminated
    int required;              // must appear in the job file (or a --set)
    const char *doc;
} ConfigKey;

// Offsets with a compile-time type check: a table row whose type does not match the field in
// config.h fails to build instead of writing the wrong number of bytes.
#define OFF_INT(f) _Generic(((Config *)0)->f, int: offsetof(Config, f))
#define OFF_U64(f) _Generic(((Config *)0)->f, uint64_t: offsetof(Config, f))
#define OFF_DBL(f) _Generic(((Config *)0)->f, double: offsetof(Config, f))
#define OFF_STR(f) _Generic(((Config *)0)->f, char *: offsetof(Config, f))
#define OFF_ENUM(f, T) _Generic(((Config *)0)->f, T: offsetof(Config, f))

// Enum fields are stored through an int; that needs the enum types to be int-sized.
_Static_assert(sizeof(PrecisionMode) == sizeof(int), "enum stored as int");
_Static_assert(sizeof(LrSchedule) == sizeof(int), "enum stored as int");
_Static_assert(sizeof(DeviceSelect) == sizeof(int), "enum stored as int");
_Static_assert(sizeof(ParallelBackend) == sizeof(int), "enum stored as int");

#define INT_MAXD 2147483647.0
#define STR_MAX ((double)(CONFIG_PATH_MAX - 1))

#define INT(sec, key, lo_, hi_, def_, doc_) \
    { #sec, #key, KEY_INT, OFF_INT(sec.key), lo_, hi_, 0, 0, def_, NULL, 0, doc_ }
#define DBL(sec, key, lo_, lo_open_, hi_, hi_open_, def_, doc_) \
    { #sec, #key, KEY_DOUBLE, OFF_DBL(sec.key), lo_, hi_, lo_open_, hi_open_, def_, NULL, 0, doc_ }
#define STR(sec, key, min_len, def_, doc_) \
    { #sec, #key, KEY_STRING, OFF_STR(sec.key), min_len, STR_MAX, 0, 0, def_, NULL, 0, doc_ }
#define ENUM(sec, key, T, words_, def_, doc_) \
    { #sec, #key, KEY_ENUM, OFF_ENUM(sec.key, T), 0, 0, 0, 0, def_, words_, 0, doc_ }

static const char *const precision_words[] = {"fp32", "bf16", "fp8", NULL};
static const char *const schedule_words[] = {"cosine", "wsd", NULL};
static const char *const device_words[] = {"auto", "cpu", "cuda", NULL};
static const char *const backend_words[] = {"auto", "mpi", "nccl", NULL};
static const char *const pipeline_words[] = {"1f1b", "zb1p", "dualpipe", "dualpipev", NULL};
_Static_assert((int)PIPE_1F1B == (int)SCHED_1F1B && (int)PIPE_ZB1P == (int)SCHED_ZB1P &&
                   (int)PIPE_DUALPIPE == (int)SCHED_DUALPIPE && (int)PIPE_DUALPIPEV == (int)SCHED_DUALPIPEV,
               "PipelineSchedule (config.h) and SchedKind (parallel/schedule.h) must list the schedules in one order");

typedef struct {
    const char *name;
    const char *doc;
} ConfigSection;

static const ConfigSection section_table[] = {
    {"model", "Model shape. Names follow DeepSeek's `config_671B.json`; the defaults are a tiny valid model."},
    {"moe", "Mixture-of-Experts FFN of layers `n_dense_layers .. n_layers-1` and of the MTP blocks."},
    {"mtp", "Multi-token prediction modules."},
    {"precision", "Number format of the Linear layers inside blocks."},
    {"parallel", "Parallel layout: world = pp * dp ranks; EP groups of ep ranks are formed inside dp (docs/parallelism.md). "
                 "Pipeline, data and expert parallel train under mpirun (pp * dp ranks)."},
    {"optim", "AdamW and the learning-rate schedule."},
    {"train", "Steps, batch shape, seed and device."},
    {"data", "Training text and token shards."},
    {"checkpoint", "Run directory and saved weights."},
    {"log", "Step lines and the metrics file."},
};
#define N_SECTIONS ((int)(sizeof(section_table) / sizeof(section_table[0])))

static const ConfigKey key_table[] = {
    INT(model, vocab_size, 2, 65536, "256",
        "vocabulary size: 256 for byte-level text, 50257 for GPT-2 shards (token shards hold uint16 ids)"),
    INT(model, dim, 1, 65536, "64", "model width d"),
    INT(model, n_layers, 1, 1024, "2", "Transformer blocks in the main model"),
    INT(model, n_dense_layers, 0, 1024, "1", "first_k_dense_replace: blocks 0 .. n_dense_layers-1 use a dense FFN"),
    INT(model, inter_dim, 1, 1048576, "128", "hidden width of the dense SwiGLU FFN"),
    INT(model, n_heads, 1, 1024, "4", "attention heads"),
    INT(model, q_lora_rank, 0, 65536, "32", "query compression rank; 0 = no compression (q = W_Q h)"),
    INT(model, kv_lora_rank, 1, 65536, "32", "key/value compression rank"),
    INT(model, qk_nope_head_dim, 0, 4096, "16", "per-head query/key width without RoPE"),
    INT(model, qk_rope_head_dim, 2, 4096, "8", "per-head query/key width with RoPE (even: RoPE rotates pairs)"),
    INT(model, v_head_dim, 1, 4096, "16", "per-head value width"),
    DBL(model, rope_theta, 1, 0, 1e12, 0, "10000", "RoPE base"),
    DBL(model, init_std, 0, 1, 1, 0, "0.02", "std of the normal init of Linear and embedding weights"),

    INT(moe, n_routed_experts, 2, 65536, "8", "E, routed experts per MoE layer"),
    INT(moe, n_shared_experts, 0, 64, "1", "shared experts; the shared SwiGLU is n_shared_experts * moe_inter_dim wide"),
    INT(moe, n_activated_experts, 1, 65536, "2", "K, routed experts per token (top-K)"),
    INT(moe, n_expert_groups, 1, 65536, "4", "expert groups for group-limited routing (at least 2 experts per group)"),
    INT(moe, n_limited_groups, 1, 65536, "2", "groups a token may use (node-limited routing)"),
    INT(moe, moe_inter_dim, 1, 1048576, "32", "hidden width of each expert's SwiGLU"),
    DBL(moe, route_scale, 0, 1, 100, 0, "1.0", "scale of the renormalised routing weights"),
    DBL(moe, bias_update_speed, 0, 0, 1, 0, "0.001", "gamma of the aux-loss-free bias update; 0 = off"),
    DBL(moe, balance_loss_alpha, 0, 0, 1, 0, "1e-4", "alpha of the sequence-wise balance loss; 0 = off"),

    INT(mtp, depth, 0, MTP_MAX_DEPTH, "1", "D, multi-token prediction modules; 0 = off"),
    DBL(mtp, loss_weight, 0, 0, 10, 0, "0.3", "lambda: L = L_main + lambda / D * sum of the MTP losses + L_bal"),

    ENUM(precision, mode, PrecisionMode, precision_words, "fp32",
         "block Linears: fp32 reference, bf16 baseline, or fp8 (E4M3, 1x128 / 128x128 scaling, docs/fp8.md)"),
    {"precision", "bf16_fprop", KEY_BOOL, OFF_INT(precision.bf16_fprop), 0, 0, 0, 0, "false", NULL, 0,
     "fp8 mode: run the Linears' forward GEMMs (Y = X W^T) in BF16, as bf16 mode does (a diagnostic, docs/fp8.md)"},
    STR(precision, bf16_fprop_only, 0, "",
        "with bf16_fprop: only the block Linears whose tensor names contain one of these comma-separated parts "
        "(\"wq_b\", \"layers.2.attn.wq_a,layers.2.attn.wq_b\") run their forward GEMM in BF16; each part must be in "
        "some block Linear's name; empty = every Linear (a diagnostic: which Fprop a difference comes from, "
        "docs/fp8.md)"),
    {"precision", "bf16_dgrad", KEY_BOOL, OFF_INT(precision.bf16_dgrad), 0, 0, 0, 0, "false", NULL, 0,
     "fp8 mode: run the input-gradient GEMMs (dX = dY W) in BF16 (a diagnostic, docs/fp8.md)"},
    {"precision", "bf16_wgrad", KEY_BOOL, OFF_INT(precision.bf16_wgrad), 0, 0, 0, 0, "false", NULL, 0,
     "fp8 mode: run the weight-gradient GEMMs (dW = dY^T X) in BF16 (a diagnostic, docs/fp8.md)"},

    INT(parallel, pp, 1, 4096, "1", "pipeline-parallel stages (at most model.n_layers; layers split as evenly as the "
        "count allows, the first stages one more)"),
    STR(parallel, stage_layers, 0, "",
        "layers of each pipeline stage in stage order, comma-separated (\"2,3,3\"): as many entries as stages "
        "(parallel.pp; 2 x parallel.pp under dualpipev), each at least 1, summing to model.n_layers; empty = as even "
        "as the count allows, the first stages one more"),
    ENUM(parallel, schedule, PipelineSchedule, pipeline_words, "1f1b",
         "pipeline schedule at pp above 1, over the step's train.grad_accum micro-batches (N): 1f1b; zb1p; dualpipe "
         "(pp and N even, N >= 2 pp; two copies of every stage); dualpipev (N >= 2 pp; 2 pp stages in a V). The "
         "executor runs I as the backward without the block Linears' weight gradients, W as those (the same "
         "gradients, bit for bit), and FB as a forward then a backward (docs/parallelism.md)"),
    INT(parallel, ep, 1, 65536, "1", "expert-parallel ranks; divides dp and moe.n_routed_experts"),
    INT(parallel, dp, 1, 65536, "1", "data-parallel ranks per pipeline stage"),
    ENUM(parallel, backend, ParallelBackend, backend_words, "auto",
         "communication of device buffers: auto = NCCL for GPU ranks under a launcher when the build has it and every "
         "host has a GPU per rank, else MPI; mpi = MPI for every rank (CPU ranks, or GPU buffers staged through host "
         "memory so several ranks can share a GPU); nccl = NCCL, one GPU per rank (host data goes over MPI)"),
    INT(parallel, gpus_per_node, 0, 65536, "0",
        "ranks per node for node-limited routing (every expert group on one node); 0 = the ranks MPI reports on "
        "each host; a smaller value lets one host stand for several nodes"),
    DBL(parallel, timeout_s, 0, 1, 1e6, 0, "300",
        "seconds any collective or message may wait; then the job ends naming the rank, the operation and the group"),
    {"parallel", "zero1", KEY_BOOL, OFF_INT(parallel.zero1), 0, 0, 0, 0, "false", NULL, 0,
     "ZeRO-1: shard the FP32 master weights and the AdamW moments over dp (reduce-scatter of gradients, update of "
     "the shard, all-gather of weights); no effect at parallel.dp = 1"},

    DBL(optim, lr, 0, 1, 10, 0, "1e-3", "peak learning rate"),
    DBL(optim, min_lr, 0, 0, 10, 0, "1e-4", "learning rate at the end of the decay (at most lr)"),
    INT(optim, warmup_steps, 0, INT_MAXD, "100", "steps of linear warm-up from 0 to lr"),
    ENUM(optim, schedule, LrSchedule, schedule_words, "cosine",
         "decay after warm-up: cosine to min_lr, or wsd (warmup-stable-decay)"),
    DBL(optim, decay_frac, 0, 0, 1, 0, "0.2", "wsd: fraction of the steps spent in the final decay"),
    DBL(optim, beta1, 0, 0, 1, 1, "0.9", "AdamW beta1"),
    DBL(optim, beta2, 0, 0, 1, 1, "0.95", "AdamW beta2"),
    DBL(optim, eps, 0, 1, 1, 0, "1e-8", "AdamW epsilon"),
    DBL(optim, weight_decay, 0, 0, 10, 0, "0.1", "AdamW decoupled weight decay"),
    DBL(optim, grad_clip, 0, 0, 1e6, 0, "1.0", "max global gradient norm; 0 = off"),

    INT(train, steps, 1, INT_MAXD, "1000", "optimizer steps"),
    INT(train, stop_after, 0, INT_MAXD, "0",
        "stop after this step with a checkpoint in checkpoint.dir, the learning-rate schedule still that of "
        "train.steps (fp8moe train --resume continues; fp8moe compare --fork branches from it); 0 = train.steps"),
    INT(train, micro_batch_size, 1, 65536, "8", "sequences per micro-batch"),
    INT(train, seq_len, 2, 1048576, "256", "tokens per sequence (at least 2 + mtp.depth)"),
    INT(train, grad_accum, 1, 65536, "1", "micro-batches per step on each data-parallel rank"),
    {"train", "seed", KEY_UINT64, OFF_U64(train.seed), 0, 0, 0, 0, "1234", NULL, 0,
     "seed of the counter-based RNG (init, data order)"},
    ENUM(train, device, DeviceSelect, device_words, "auto", "auto = CUDA when a GPU is present, else CPU"),
    INT(train, eval_every, 0, INT_MAXD, "100", "steps between validation evaluations; 0 = only at the end"),
    INT(train, eval_batches, 0, INT_MAXD, "0", "micro-batches per evaluation; 0 = the whole validation split"),
    INT(train, threads, 0, 4096, "0", "OpenMP threads on the CPU; 0 = all cores"),

    STR(data, text, 0, "", "comma-separated text files to prepare; empty = the default text"),
    STR(data, shards, 0, "", "directory of existing llm.c token shards (overrides text)"),
    STR(data, cache_dir, 1, "data/prepared", "where prepared shards are written"),

    STR(checkpoint, dir, 1, "runs/default", "run directory: weights.h5 and metrics.jsonl go here"),
    {"checkpoint", "save_weights", KEY_BOOL, OFF_INT(checkpoint.save_weights), 0, 0, 0, 0, "true", NULL, 0,
     "save the FP32 weights at the end and on Ctrl-C"},
    INT(checkpoint, every_steps, 0, INT_MAXD, "0",
        "write a resumable checkpoint (docs/checkpoints.md) to checkpoint.dir/step_NNNNNNNN every N steps, at the "
        "end and on Ctrl-C / SIGTERM; 0 = none (fp8moe train --resume continues from one)"),
    INT(checkpoint, keep_last, 0, INT_MAXD, "3", "checkpoints kept in checkpoint.dir (older ones are removed after a "
        "new one is complete); 0 = keep all"),

    INT(log, every, 1, INT_MAXD, "1", "print a step line every N steps"),
    STR(log, jsonl, 0, "", "metrics file; empty = metrics.jsonl in checkpoint.dir"),
};
#define N_KEYS ((int)(sizeof(key_table) / sizeof(key_table[0])))

// ---------------------------------------------------------------------------- small helpers

static int find_section(const char *name) {
    for (int s = 0; s < N_SECTIONS; s++)
        if (strcmp(section_table[s].name, name) == 0) return s;
    return -1;
}

static int find_key(const char *section, const char *name) {
    for (int k = 0; k < N_KEYS; k++)
        if (strcmp(key_table[k].section, section) == 0 && strcmp(key_table[k].name, name) == 0) return k;
    return -1;
}

// Levenshtein distance, for "did you mean" hints; names are short, so the O(n*m) table is tiny.
static int edit_distance(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 64 || nb > 64) return 1000;
    int row[65];
    for (size_t j = 0; j <= nb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[nb];
}

// Shortest text that strtod reads back to the same bits: "0.001", "10000", "1e-08", "1e+12".
static void format_double(double v, char *buf, size_t size) {
    if (v == floor(v) && fabs(v) < 1e9 && !(v == 0 && signbit(v))) {  // whole numbers as written: 10000
        snprintf(buf, size, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        double back = strtod(buf, NULL);
        if (memcmp(&back, &v, sizeof v) == 0) return;
    }
}

static const int *field_int_c(const Config *c, const ConfigKey *key) {
    return (const int *)((const char *)c + key->offset);
}

// "an integer in [1, 65536]", "a number in (0, 10]", "one of fp32, bf16, fp8", ...
static void format_expected(const ConfigKey *key, char *buf, size_t size) {
    char lo[40], hi[40];
    switch (key->type) {
    case KEY_INT:
        snprintf(buf, size, "an integer in [%.0f, %.0f]", key->lo, key->hi);
        break;
    case KEY_UINT64:
        snprintf(buf, size, "an unsigned integer in [0, %llu]", (unsigned long long)UINT64_MAX);
        break;
    case KEY_DOUBLE:
        format_double(key->lo, lo, sizeof lo);
        format_double(key->hi, hi, sizeof hi);
        snprintf(buf, size, "a number in %c%s, %s%c", key->lo_open ? '(' : '[', lo, hi, key->hi_open ? ')' : ']');
        break;
    case KEY_BOOL:
        snprintf(buf, size, "true or false");
        break;
    case KEY_STRING:
        snprintf(buf, size, "a %sstring of at most %.0f characters", key->lo > 0 ? "non-empty " : "", key->hi);
        break;
    case KEY_ENUM: {
        size_t used = (size_t)snprintf(buf, size, "one of");
        for (int w = 0; key->words[w] && used < size; w++)
            used += (size_t)snprintf(buf + used, size - used, "%s %s", w ? "," : "", key->words[w]);
        break;
    }
    }
}

// Copies src into buf with control characters written as \xNN, so an error stays one line.
static void escape_text(const char *src, size_t max_chars, char *buf, size_t size) {
    size_t used = 0;
    for (size_t i = 0; src[i] && i < max_chars && used + 5 < size; i++) {
        unsigned char ch = (unsigned char)src[i];
        if (ch < 0x20 || ch == 0x7f) used += (size_t)snprintf(buf + used, size - used, "\\x%02x", ch);
        else buf[used++] = (char)ch;
    }
    buf[used] = 0;
}

// A value as quoted in messages; very long values are shortened so the line stays readable.
static void quote_value(const char *value, char *buf, size_t size) {
    char shown[64 * 4 + 1];
    escape_text(value, 57, shown, sizeof shown);
    snprintf(buf, size, "\"%s%s\"", shown, strlen(value) > 60 ? "..." : "");
}

// ---------------------------------------------------------------------------- parsing one value

// Parse `value` for `key` into c. On failure writes "<what was found> - expected <what>" into msg.
static int parse_value(Config *c, const ConfigKey *key, const char *value, char *msg, size_t msg_size) {
    char quoted[300], expected[160];
    quote_value(value, quoted, sizeof quoted);
    format_expected(key, expected, sizeof expected);
    void *field = (char *)c + key->offset;
    switch (key->type) {
    case KEY_INT: {
        // Plain decimal only: "1e3", "0x10", "1.0" and "" are all rejected, not guessed at.
        const char *p = value + (value[0] == '-' || value[0] == '+');
        if (*p == 0 || strspn(p, "0123456789") != strlen(p)) {
            snprintf(msg, msg_size, "%s is not an integer - expected %s", quoted, expected);
            return -1;
        }
        errno = 0;
        long long v = strtoll(value, NULL, 10);
        if (errno == ERANGE || (double)v < key->lo || (double)v > key->hi) {
            snprintf(msg, msg_size, "%s is out of range - expected %s", quoted, expected);
            return -1;
        }
        *(int *)field = (int)v;
        return 0;
    }
    case KEY_UINT64: {
        if (value[0] == 0 || strspn(value, "0123456789") != strlen(value)) {
            snprintf(msg, msg_size, "%s is not an unsigned integer - expected %s", quoted, expected);
            return -1;
        }
        errno = 0;
        unsigned long long v = strtoull(value, NULL, 10);
        if (errno == ERANGE) {
            snprintf(msg, msg_size, "%s is out of range - expected %s", quoted, expected);
            return -1;
        }
        *(uint64_t *)field = (uint64_t)v;
        return 0;
    }
    case KEY_DOUBLE: {
        // Decimal notation only, so "inf", "nan" and hex floats never reach the trainer.
        char *end = NULL;
        double v = 0;
        if (value[0] != 0 && strspn(value, "0123456789+-.eE") == strlen(value)) v = strtod(value, &end);
        if (end == NULL || end == value || *end != 0) {
            snprintf(msg, msg_size, "%s is not a number - expected %s", quoted, expected);
            return -1;
        }
        int below = key->lo_open ? !(v > key->lo) : !(v >= key->lo);
        int above = key->hi_open ? !(v < key->hi) : !(v <= key->hi);
        if (!isfinite(v) || below || above) {
            snprintf(msg, msg_size, "%s is out of range - expected %s", quoted, expected);
            return -1;
        }
        // The trainer computes in FP32: a value that is 0 there (optim.eps = 1e-46 made AdamW divide 0 by 0)
        // or beyond its range is not the value the job asked for.
        if (fabs(v) > FLT_MAX) {  // first: converting such a double to float is undefined
            snprintf(msg, msg_size, "%s overflows FP32 - expected %s of magnitude at most %.9g (the largest FP32 "
                                    "number)", quoted, expected, (double)FLT_MAX);
            return -1;
        }
        if (v != 0 && (float)v == 0) {
            snprintf(msg, msg_size, "%s is 0 in FP32 - expected %s of magnitude at least %.7g (the smallest FP32 "
                                    "number)", quoted, expected, (double)FLT_TRUE_MIN);
            return -1;
        }
        *(double *)field = v;
        return 0;
    }
    case KEY_BOOL:
        if (strcmp(value, "true") == 0 || strcmp(value, "false") == 0) {
            *(int *)field = strcmp(value, "true") == 0;
            return 0;
        }
        snprintf(msg, msg_size, "%s is not a boolean - expected %s", quoted, expected);
        return -1;
    case KEY_ENUM:
        for (int w = 0; key->words[w]; w++) {
            if (strcmp(value, key->words[w]) == 0) {
                *(int *)field = w;
                return 0;
            }
        }
        snprintf(msg, msg_size, "%s is not an allowed value - expected %s", quoted, expected);
        return -1;
    case KEY_STRING: {
        size_t n = strlen(value);
        if ((double)n < key->lo) {
            snprintf(msg, msg_size, "%s is empty - expected %s", quoted, expected);
            return -1;
        }
        if ((double)n > key->hi) {
            snprintf(msg, msg_size, "a value of %zu characters is too long - expected %s", n, expected);
            return -1;
        }
        // Control characters would break the one-line `key = value` form that config_print writes.
        for (size_t i = 0; i < n; i++) {
            if ((unsigned char)value[i] < 0x20) {
                snprintf(msg, msg_size, "%s has a control character at position %zu - expected %s", quoted, i + 1,
                         expected);
                return -1;
            }
        }
        // Clear the whole array so equal configs are equal byte for byte (resume checks, tests).
        memset(field, 0, CONFIG_PATH_MAX);
        memcpy(field, value, n);
        return 0;
    }
    }
    return -1;
}

// ---------------------------------------------------------------------------- parse state

typedef struct {
    Config *config;
    const char *name;  // file name used in messages
    // Source: a FILE or a NUL-terminated string.
    FILE *file;
    const char *text;
    char *line;        // the current raw line, NUL-terminated, without '\n'
    size_t line_cap;
    int lineno;
    int section;       // index of the current [section], -1 before the first header
    const char *long_value;  // value of the current line when the line was too long for libinih
    // Where each key was set: line > 0 in the file, -(i + 1) for override i, 0 = default.
    int origin[N_KEYS];
    const char *const *overrides;
    int failed;
    char *err;
    size_t err_size;
} ParseState;

static void fail(ParseState *st, const char *fmt, ...) {
    if (st->failed) return;
    st->failed = 1;
    if (st->err == NULL || st->err_size == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->err, st->err_size, fmt, ap);
    va_end(ap);
}

// "job.ini:7", "--set model.dim=3" or "job.ini" (a default), for messages about key k.
static void format_origin(const ParseState *st, int k, char *buf, size_t size) {
    int o = st->origin[k];
    if (o > 0) snprintf(buf, size, "%s:%d", st->name, o);
    else if (o < 0) {
        snprintf(buf, size, "--set ");
        if (size > 6) escape_text(st->overrides[-o - 1], CONFIG_PATH_MAX * 2, buf + 6, size - 6);
    }
    else snprintf(buf, size, "%s", st->name);
}

static void fail_unknown_section(ParseState *st, const char *where, const char *section) {
    char list[256];
    size_t used = 0;
    const char *hint = NULL;
    int best = 3;
    for (int s = 0; s < N_SECTIONS; s++) {
        used += (size_t)snprintf(list + used, sizeof list - used, "%s[%s]", s ? " " : "", section_table[s].name);
        int d = edit_distance(section, section_table[s].name);
        if (d < best) best = d, hint = section_table[s].name;
    }
    if (hint) fail(st, "%s: [%s]: unknown section - expected one of %s (did you mean [%s]?)", where, section, list, hint);
    else fail(st, "%s: [%s]: unknown section - expected one of %s", where, section, list);
}

// Suggest the closest key within edit distance 2, preferring the same section; a key that exists
// under another section (lr written under [train]) is suggested with its right section.
static void fail_unknown_key(ParseState *st, const char *where, const char *section, const char *name) {
    int best_k = -1, best_d = 3;
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < N_KEYS; k++) {
            int same = strcmp(key_table[k].section, section) == 0;
            if (pass == 0 ? !same : same) continue;
            int d = edit_distance(name, key_table[k].name);
            if (d < best_d) best_d = d, best_k = k;
        }
        if (best_k >= 0 && best_d <= 1) break;  // a close match in the same section beats others
    }
    if (best_k >= 0) {
        fail(st, "%s: %s.%s: unknown key - expected a key of [%s] (did you mean %s.%s?)", where, section, name,
             section, key_table[best_k].section, key_table[best_k].name);
        return;
    }
    char list[512];
    size_t used = 0;
    for (int k = 0; k < N_KEYS && used < sizeof list; k++)
        if (strcmp(key_table[k].section, section) == 0)
            used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", used ? ", " : "", key_table[k].name);
    fail(st, "%s: %s.%s: unknown key - expected one of %s", where, section, name, list);
}

// Set section.name = value; origin is a line number (> 0) or -(override index + 1).
static int set_key(ParseState *st, const char *where, const char *section, const char *name, const char *value,
                   int origin) {
    if (find_section(section) < 0) {
        fail_unknown_section(st, where, section);
        return -1;
    }
    int k = find_key(section, name);
    if (k < 0) {
        fail_unknown_key(st, where, section, name);
        return -1;
    }
    if (origin > 0 && st->origin[k] > 0) {
        fail(st, "%s: %s.%s: duplicate key (first set on line %d) - expected each key once", where, section, name,
             st->origin[k]);
        return -1;
    }
    char msg[1024];
    if (parse_value(st->config, &key_table[k], value, msg, sizeof msg) != 0) {
        fail(st, "%s: %s.%s: %s", where, section, name, msg);
        return -1;
    }
    st->origin[k] = origin;
    return 0;
}

// ---------------------------------------------------------------------------- the line reader

// Reads the next raw line into st->line (no '\n'); returns 0 at the end of the input.
static int next_raw_line(ParseState *st) {
    size_t n;
    if (st->file) {
        ssize_t got = getline(&st->line, &st->line_cap, st->file);
        if (got < 0) {
            if (ferror(st->file)) fail(st, "%s: cannot read: %s", st->name, strerror(errno));
            return 0;
        }
        n = (size_t)got;
        // every later step reads the line as a C string: a NUL byte would silently cut it there
        const char *nul = memchr(st->line, 0, n);
        if (nul != NULL) {
            fail(st, "%s:%d: a NUL byte at column %zu - expected a text file (no NUL bytes)", st->name, st->lineno + 1,
                 (size_t)(nul - st->line) + 1);
            return 0;
        }
        if (n > 0 && st->line[n - 1] == '\n') st->line[--n] = 0;
    } else {
        if (st->text == NULL || *st->text == 0) return 0;
        const char *eol = strchr(st->text, '\n');
        n = eol ? (size_t)(eol - st->text) : strlen(st->text);
        if (n + 1 > st->line_cap) {
            char *grown = realloc(st->line, n + 1);
            if (grown == NULL) {
                fail(st, "%s: out of memory reading line %d", st->name, st->lineno + 1);
                return 0;
            }
            st->line = grown;
            st->line_cap = n + 1;
        }
        memcpy(st->line, st->text, n);
        st->line[n] = 0;
        st->text = eol ? eol + 1 : st->text + n;
    }
    st->lineno++;
    return 1;
}

static int is_blank(char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\f' || ch == '\v'; }

static void rstrip(char *s) {
    size_t n = strlen(s);
    while (n > 0 && is_blank(s[n - 1])) s[--n] = 0;
}

// Cuts an inline comment: ';' preceded by whitespace, as libinih does.
static void cut_inline_comment(char *s) {
    for (char *p = s + 1; *p; p++) {
        if (*p == ';' && is_blank(p[-1])) {
            *p = 0;
            break;
        }
    }
    rstrip(s);
}

// ini_reader: hands libinih one checked line at a time. Returning NULL ends the parse, which is
// how the first error stops it.
static char *read_line(char *buf, int buf_size, void *stream) {
    ParseState *st = stream;
    if (st->failed || !next_raw_line(st)) return NULL;
    char *s = st->line;
    if (st->lineno == 1 && (unsigned char)s[0] == 0xEF && (unsigned char)s[1] == 0xBB && (unsigned char)s[2] == 0xBF)
        s += 3;  // UTF-8 byte order mark
    while (is_blank(*s)) s++;  // no leading whitespace: libinih would read it as a continuation line
    rstrip(s);
    st->long_value = NULL;
    size_t room = (size_t)buf_size - 2;  // libinih needs the '\n' and the NUL to fit as well

    if (*s == 0 || *s == ';' || *s == '#') {
        snprintf(buf, (size_t)buf_size, "\n");
        return buf;
    }
    char shown[300];
    if (*s == '[') {
        cut_inline_comment(s);
        size_t n = strlen(s);
        char *close = strchr(s, ']');
        if (close == NULL || close != s + n - 1) {
            quote_value(s, shown, sizeof shown);
            fail(st, "%s:%d: cannot read %s - expected a section header like [model]", st->name, st->lineno, shown);
            return NULL;
        }
        *close = 0;
        char *name = s + 1;
        while (is_blank(*name)) name++;
        rstrip(name);
        st->section = find_section(name);
        if (st->section < 0) {
            char where[CONFIG_PATH_MAX + 32];
            snprintf(where, sizeof where, "%s:%d", st->name, st->lineno);
            fail_unknown_section(st, where, name);
            return NULL;
        }
        snprintf(buf, (size_t)buf_size, "[%s]\n", name);  // canonical: "[ model ]" -> "[model]"
        return buf;
    }
    // A key line: `key = value`. libinih would also take "key: value"; the job format does not.
    char *eq = strchr(s, '=');
    char *colon = strchr(s, ':');
    char *comment = NULL;
    for (char *p = s + 1; *p; p++)
        if (*p == ';' && is_blank(p[-1])) {
            comment = p;
            break;
        }
    if (eq == NULL || eq == s || (comment && comment < eq) || (colon && colon < eq)) {
        quote_value(s, shown, sizeof shown);
        fail(st, "%s:%d: cannot read %s - expected key = value, a [section] header or a ; comment", st->name,
             st->lineno, shown);
        return NULL;
    }
    if (st->section < 0) {
        *eq = 0;
        rstrip(s);
        fail(st, "%s:%d: %s: key outside any section - expected a [section] header above it", st->name, st->lineno,
             s);
        return NULL;
    }
    if (strlen(s) <= room) {
        snprintf(buf, (size_t)buf_size, "%s\n", s);
        return buf;
    }
    // Too long for libinih's line buffer (a long path): it gets `key =`, the handler gets the value.
    if ((size_t)(eq - s) + 1 > room) {
        fail(st, "%s:%d: a key name of %d characters - expected a key of [%s]", st->name, st->lineno, (int)(eq - s),
             section_table[st->section].name);
        return NULL;
    }
    char *value = eq + 1;
    while (is_blank(*value)) value++;
    cut_inline_comment(value);
    st->long_value = value;
    snprintf(buf, (size_t)buf_size, "%.*s=\n", (int)(eq - s), s);
    return buf;
}

static int on_key(void *user, const char *section, const char *name, const char *value) {
    ParseState *st = user;
    char where[CONFIG_PATH_MAX + 32];
    snprintf(where, sizeof where, "%s:%d", st->name, st->lineno);
    if (st->long_value) value = st->long_value;
    return set_key(st, where, section, name, value, st->lineno) == 0;
}

// ---------------------------------------------------------------------------- overrides

#define CONTROL_CHARS "\x01\x02\x03\x04\x05\x06\x07\x08\t\n\v\f\r\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\x7f"

// Trims blanks from both ends of src[0..n) and returns a malloc'd copy (NULL when out of memory).
static char *trim_dup(const char *src, size_t n) {
    while (n > 0 && is_blank(*src)) src++, n--;
    while (n > 0 && is_blank(src[n - 1])) n--;
    char *out = malloc(n + 1);
    if (out) {
        memcpy(out, src, n);
        out[n] = 0;
    }
    return out;
}

static int apply_override(ParseState *st, int i) {
    const char *text = st->overrides[i];
    char where[CONFIG_PATH_MAX * 4 + 8] = "--set ";
    escape_text(text, CONFIG_PATH_MAX * 2, where + 6, sizeof where - 6);
    const char *eq = strchr(text, '=');
    if (eq == NULL) {
        fail(st, "%s: missing '=' - expected --set section.key=value", where);
        return -1;
    }
    char *lhs = trim_dup(text, (size_t)(eq - text));
    char *value = trim_dup(eq + 1, strlen(eq + 1));
    int rc = -1;
    char *dot = lhs ? strchr(lhs, '.') : NULL;
    char shown[300];
    if (lhs == NULL || value == NULL) {
        fail(st, "%s: out of memory", where);
    } else if (dot == NULL || dot == lhs || dot[1] == 0 || strcspn(lhs, CONTROL_CHARS) != strlen(lhs)) {
        quote_value(lhs, shown, sizeof shown);
        fail(st, "%s: %s is not a section.key name - expected --set section.key=value", where, shown);
    } else {
        *dot = 0;
        rc = set_key(st, where, lhs, dot + 1, value, -(i + 1));
    }
    free(lhs);
    free(value);
    return rc;
}

// ---------------------------------------------------------------------------- checks across keys

#define KEY_INDEX(sec, key) find_key(#sec, #key)

// The parameters of one block (attention, norms, and its dense FFN or MoE), counted as model.c's table lays them
// out; in double, so that no shape the key ranges allow can overflow.
static double block_params(const Config *c, int is_moe) {
    const ModelConfig *m = &c->model;
    const MoeConfig *e = &c->moe;
    const double D = m->dim, H = m->n_heads, dqk = (double)m->qk_nope_head_dim + m->qk_rope_head_dim;
    double n = 2 * D;  // attn_norm, ffn_norm
    if (m->q_lora_rank > 0) n += (double)m->q_lora_rank * (D + 1 + H * dqk);
    else n += H * dqk * D;
    n += ((double)m->kv_lora_rank + m->qk_rope_head_dim) * D + m->kv_lora_rank;
    n += H * ((double)m->qk_nope_head_dim + m->v_head_dim) * m->kv_lora_rank + D * H * m->v_head_dim;
    if (!is_moe) return n + 3.0 * m->inter_dim * D;
    return n + (double)e->n_routed_experts * D + 3.0 * e->n_shared_experts * e->moe_inter_dim * D +
           3.0 * e->n_routed_experts * e->moe_inter_dim * D;
}

// "1.5 TiB", "512 GiB", "3.2 MiB"
static void format_bytes(double bytes, char *buf, size_t size) {
    static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    while (bytes >= 1024 && u < 6) bytes /= 1024, u++;
    snprintf(buf, size, "%.*f %s", u == 0 ? 0 : 1, bytes, units[u]);
}

// The most one process is let to need: far beyond any single machine's memory (the 671B-parameter DeepSeek-V3
// would need 7.3 TiB for its weights, gradients and AdamW moments), so only shapes no run could ever allocate are
// refused here, with their keys named, instead of failing an allocation or overflowing a size at step 1.
#define CONFIG_MAX_BYTES 17592186044416.0  // 16 TiB

// Sizes the model and the trainer compute: token rows are counted in int (a micro-batch's tokens times the heads
// or the routed slots per token), and the memory is bounded below by the FP32 weights and gradients, the BF16
// AdamW moments, the residual stream and the logits of every output head.
static int check_sizes(ParseState *st) {
    const Config *c = st->config;
    char at[CONFIG_PATH_MAX * 4 + 8];
    const double tokens = (double)c->train.micro_batch_size * c->train.seq_len;
    const int per_token = c->model.n_heads > c->moe.n_activated_experts ? c->model.n_heads : c->moe.n_activated_experts;
    const double max_tokens = floor((double)INT_MAX / per_token);
    if (tokens > max_tokens) {
        const int k = st->origin[KEY_INDEX(train, seq_len)] != 0 ? KEY_INDEX(train, seq_len)
                                                                  : KEY_INDEX(train, micro_batch_size);
        format_origin(st, k, at, sizeof at);
        fail(st, "%s: train.micro_batch_size * train.seq_len: %d * %d = %.0f tokens per micro-batch - expected at most "
                 "%.0f = %d / %d (max(model.n_heads, moe.n_activated_experts) rows per token; token rows are counted "
                 "in 32-bit integers)",
             at, c->train.micro_batch_size, c->train.seq_len, tokens, max_tokens, INT_MAX, per_token);
        return -1;
    }
    const ModelConfig *m = &c->model;
    const int L = m->n_layers, dense = m->n_dense_layers, depth = c->mtp.depth;
    const double D = m->dim, V = m->vocab_size;
    double params = 2 * V * D + D;  // embedding, head, final norm
    params += dense * block_params(c, 0) + (L - dense) * block_params(c, 1);
    params += depth * (3 * D + 2 * D * D + block_params(c, L > dense));  // MTP: enorm, hnorm, norm, eh_proj, block
    const double logit_bytes = c->precision.mode == PRECISION_FP32 ? 4 : 2;
    const double weight_bytes = params * (4 + 4 + 2 + 2);
    const double act_bytes = tokens * (4 * D * (L + 1) + logit_bytes * V * (1 + depth));
    if (weight_bytes + act_bytes > CONFIG_MAX_BYTES) {
        char need[32], w[32], a[32], cap[32];
        format_bytes(weight_bytes + act_bytes, need, sizeof need);
        format_bytes(weight_bytes, w, sizeof w);
        format_bytes(act_bytes, a, sizeof a);
        format_bytes(CONFIG_MAX_BYTES, cap, sizeof cap);
        const int blame_batch = act_bytes > weight_bytes;
        const int k = blame_batch ? KEY_INDEX(train, seq_len) : KEY_INDEX(model, dim);
        format_origin(st, k, at, sizeof at);
        fail(st, "%s: %s: the job needs at least %s (%s for %.4g parameters with their gradients and AdamW moments, "
                 "%s of activations for train.micro_batch_size * train.seq_len = %.0f tokens) - expected at most %s in "
                 "one process; lower %s",
             at, blame_batch ? "train.micro_batch_size * train.seq_len" : "model", need, w, params, a, tokens, cap,
             blame_batch ? "train.micro_batch_size or train.seq_len"
                         : "model.dim, model.n_layers, model.vocab_size, moe.n_routed_experts or moe.moe_inter_dim");
        return -1;
    }
    return 0;
}

// parallel.stage_layers into parallel.stage_layer_count: `stages` positive counts summing to model.n_layers.
static int parse_stage_layers(ParseState *st, int stages) {
    ParallelConfig *p = &st->config->parallel;
    char at[CONFIG_PATH_MAX + 64];
    p->n_stage_layers = 0;
    if (p->stage_layers[0] == '\0') return 0;
    format_origin(st, KEY_INDEX(parallel, stage_layers), at, sizeof at);
    int sum = 0, n = 0;
    for (const char *c = p->stage_layers; *c;) {
        while (*c == ' ' || *c == '\t') c++;
        char *end;
        errno = 0;
        const long v = strtol(c, &end, 10);
        while (*end == ' ' || *end == '\t') end++;
        if (end == c || errno != 0 || v < 1 || v > INT_MAX / 2 || (*end != ',' && *end != '\0') || n == CONFIG_MAX_STAGES) {
            fail(st, "%s: parallel.stage_layers: \"%s\": entry %d is not a layer count - expected %d comma-separated "
                     "integers >= 1 (one per pipeline stage), at most %d", at, p->stage_layers, n + 1, stages,
                 CONFIG_MAX_STAGES);
            return -1;
        }
        p->stage_layer_count[n++] = (int)v;
        sum += (int)v;
        c = *end == ',' ? end + 1 : end;
    }
    if (n != stages || sum != st->config->model.n_layers) {
        fail(st, "%s: parallel.stage_layers: \"%s\" lists %d stage(s) of %d layers - expected %d stages (parallel.pp%s) "
                 "of model.n_layers = %d in all", at, p->stage_layers, n, sum, stages,
             stages == p->pp ? "" : " x 2 under dualpipev", st->config->model.n_layers);
        return -1;
    }
    p->n_stage_layers = n;
    return 0;
}

static int check_config(ParseState *st) {
    const Config *c = st->config;
    char at[CONFIG_PATH_MAX * 4 + 8];
    const ModelConfig *m = &c->model;
    const MoeConfig *e = &c->moe;

    for (int k = 0; k < N_KEYS; k++) {
        if (key_table[k].required && st->origin[k] == 0) {
            fail(st, "%s: %s.%s: missing - expected a value for this required key", st->name, key_table[k].section,
                 key_table[k].name);
            return -1;
        }
    }
    if (m->n_dense_layers > m->n_layers) {
        format_origin(st, KEY_INDEX(model, n_dense_layers), at, sizeof at);
        fail(st, "%s: model.n_dense_layers: %d is more than model.n_layers = %d - expected at most model.n_layers", at,
             m->n_dense_layers, m->n_layers);
        return -1;
    }
    if (m->qk_rope_head_dim % 2 != 0) {
        format_origin(st, KEY_INDEX(model, qk_rope_head_dim), at, sizeof at);
        fail(st, "%s: model.qk_rope_head_dim: %d is odd - expected an even number (RoPE rotates pairs)", at,
             m->qk_rope_head_dim);
        return -1;
    }
    if (e->n_routed_experts % e->n_expert_groups != 0) {
        format_origin(st, KEY_INDEX(moe, n_expert_groups), at, sizeof at);
        fail(st,
             "%s: moe.n_expert_groups: %d does not divide moe.n_routed_experts = %d - expected a divisor of "
             "moe.n_routed_experts",
             at, e->n_expert_groups, e->n_routed_experts);
        return -1;
    }
    int per_group = e->n_routed_experts / e->n_expert_groups;
    if (per_group < 2) {
        format_origin(st, KEY_INDEX(moe, n_expert_groups), at, sizeof at);
        fail(st,
             "%s: moe.n_expert_groups: %d groups of moe.n_routed_experts = %d leave %d expert per group - expected "
             "at least 2 experts per group (the group score sums the top 2)",
             at, e->n_expert_groups, e->n_routed_experts, per_group);
        return -1;
    }
    if (e->n_limited_groups > e->n_expert_groups) {
        format_origin(st, KEY_INDEX(moe, n_limited_groups), at, sizeof at);
        fail(st, "%s: moe.n_limited_groups: %d is more than moe.n_expert_groups = %d - expected at most "
                 "moe.n_expert_groups",
             at, e->n_limited_groups, e->n_expert_groups);
        return -1;
    }
    long long reachable = (long long)e->n_limited_groups * per_group;
    if (e->n_activated_experts > reachable) {
        format_origin(st, KEY_INDEX(moe, n_activated_experts), at, sizeof at);
        fail(st,
             "%s: moe.n_activated_experts: %d is more than the %lld experts in moe.n_limited_groups = %d groups of "
             "%d - expected at most moe.n_limited_groups * (moe.n_routed_experts / moe.n_expert_groups) = %lld",
             at, e->n_activated_experts, reachable, e->n_limited_groups, per_group, reachable);
        return -1;
    }
    const ParallelConfig *p = &c->parallel;
    if (p->dp % p->ep != 0) {
        format_origin(st, KEY_INDEX(parallel, ep), at, sizeof at);
        fail(st, "%s: parallel.ep: %d does not divide parallel.dp = %d - expected a divisor of parallel.dp (EP "
                 "groups are formed inside DP)",
             at, p->ep, p->dp);
        return -1;
    }
    if (e->n_routed_experts % p->ep != 0) {
        format_origin(st, KEY_INDEX(parallel, ep), at, sizeof at);
        fail(st, "%s: parallel.ep: %d does not divide moe.n_routed_experts = %d - expected a divisor of "
                 "moe.n_routed_experts (experts are split evenly over an EP group)",
             at, p->ep, e->n_routed_experts);
        return -1;
    }
    const int local_experts = e->n_routed_experts / p->ep;
    if (c->precision.mode == PRECISION_FP8 && local_experts > FP8_MAX_SEGMENTS) {
        format_origin(st, KEY_INDEX(moe, n_routed_experts), at, sizeof at);
        fail(st, "%s: moe.n_routed_experts: %d experts over parallel.ep = %d ranks is %d per rank - expected at most "
                 "%d per rank in fp8 mode (the grouped FP8 quantisers take one segment per local expert); raise "
                 "parallel.ep",
             at, e->n_routed_experts, p->ep, local_experts, FP8_MAX_SEGMENTS);
        return -1;
    }
    const PrecisionConfig *pc = &c->precision;
    if (pc->mode != PRECISION_FP8 && (pc->bf16_fprop || pc->bf16_dgrad || pc->bf16_wgrad)) {
        const int k = pc->bf16_fprop ? KEY_INDEX(precision, bf16_fprop)
                                     : pc->bf16_dgrad ? KEY_INDEX(precision, bf16_dgrad) : KEY_INDEX(precision, bf16_wgrad);
        format_origin(st, k, at, sizeof at);
        fail(st, "%s: precision.%s: true in precision.mode = %s - expected only in fp8 mode (the other modes run no FP8 "
                 "GEMMs to replace)",
             at, key_table[k].name, precision_words[pc->mode]);
        return -1;
    }
    if (pc->bf16_fprop_only[0] != '\0' && !pc->bf16_fprop) {
        format_origin(st, KEY_INDEX(precision, bf16_fprop_only), at, sizeof at);
        fail(st, "%s: precision.bf16_fprop_only: \"%s\" without precision.bf16_fprop = true - expected it only with "
                 "bf16_fprop (it narrows which Linears' Fprops that runs in BF16)",
             at, pc->bf16_fprop_only);
        return -1;
    }
    for (const char *p = pc->bf16_fprop_only; *p; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' ||
            *p == '.' || (*p == ',' && p[1] != ',' && p[1] != '\0' && p != pc->bf16_fprop_only))
            continue;
        format_origin(st, KEY_INDEX(precision, bf16_fprop_only), at, sizeof at);
        fail(st, "%s: precision.bf16_fprop_only: \"%s\" - expected comma-separated parts of tensor names (letters, "
                 "digits, '_' and '.'), e.g. wq_b or layers.2.attn.wq_a,layers.2.attn.wq_b",
             at, pc->bf16_fprop_only);
        return -1;
    }
    if (c->optim.min_lr > c->optim.lr) {
        char a[40], b[40];
        format_double(c->optim.min_lr, a, sizeof a);
        format_double(c->optim.lr, b, sizeof b);
        format_origin(st, KEY_INDEX(optim, min_lr), at, sizeof at);
        fail(st, "%s: optim.min_lr: %s is more than optim.lr = %s - expected at most optim.lr", at, a, b);
        return -1;
    }
    if (c->train.stop_after > c->train.steps) {
        format_origin(st, KEY_INDEX(train, stop_after), at, sizeof at);
        fail(st, "%s: train.stop_after: %d is more than train.steps = %d - expected at most train.steps (0 = run to the "
                 "end)", at, c->train.stop_after, c->train.steps);
        return -1;
    }
    if (c->train.seq_len < 2 + c->mtp.depth) {
        format_origin(st, KEY_INDEX(train, seq_len), at, sizeof at);
        fail(st, "%s: train.seq_len: %d is too short for mtp.depth = %d - expected at least 2 + mtp.depth = %d", at,
             c->train.seq_len, c->mtp.depth, 2 + c->mtp.depth);
        return -1;
    }
    if (check_sizes(st) != 0) return -1;
    // Last, so that a layout that could never work is named for what is wrong with it first.
    // dualpipev cuts the model into 2 pp stages (two per rank, the V); the others into pp
    const int stages = p->pp > 1 && p->schedule == PIPE_DUALPIPEV ? 2 * p->pp : p->pp;
    if (stages > c->model.n_layers) {
        format_origin(st, KEY_INDEX(parallel, pp), at, sizeof at);
        if (stages == p->pp)
            fail(st, "%s: parallel.pp: %d pipeline stages for model.n_layers = %d - expected at most one stage per "
                     "layer", at, p->pp, c->model.n_layers);
        else
            fail(st, "%s: parallel.pp: %d ranks of parallel.schedule = dualpipev cut the model into %d stages, but "
                     "model.n_layers = %d - expected at most one stage per layer (parallel.pp <= %d)", at, p->pp, stages,
                 c->model.n_layers, c->model.n_layers / 2);
        return -1;
    }
    return parse_stage_layers(st, stages);
}

// ---------------------------------------------------------------------------- public functions

int config_check_layout(const Config *c, int world_size, char *err, size_t err_size) {
    const ParallelConfig *p = &c->parallel;
    Layout layout;
    if (layout_make(&layout, world_size, p->pp, p->dp, p->ep, err, err_size) != 0) return -1;
    if (c->moe.n_routed_experts % p->ep != 0) {
        snprintf(err, err_size, "parallel.ep = %d does not divide moe.n_routed_experts = %d - expected a divisor of "
                 "moe.n_routed_experts (experts are split evenly over an EP group)", p->ep, c->moe.n_routed_experts);
        return -1;
    }
    if (p->backend == PARALLEL_BACKEND_NCCL && !comm_nccl_available()) {
        snprintf(err, err_size, "parallel.backend = nccl: this build has no NCCL backend (a CUDA build finds NCCL's "
                 "nccl.h and libnccl: `make` prints where it looked) - expected auto or mpi");
        return -1;
    }
    return 0;
}

void config_defaults(Config *c) {
    // Zero first so padding and the tails of strings are zero: configs compare equal byte for byte.
    memset(c, 0, sizeof *c);
    char msg[1024];
    for (int k = 0; k < N_KEYS; k++) {
        if (parse_value(c, &key_table[k], key_table[k].def, msg, sizeof msg) != 0) {
            // A default outside its own range is a bug in the table above, caught by the first test.
            fprintf(stderr, "config.c: default of %s.%s: %s\n", key_table[k].section, key_table[k].name, msg);
            abort();
        }
    }
}

static int load(Config *c, const char *name, FILE *file, const char *text, const char *const *overrides,
                int n_overrides, char *err, size_t err_size) {
    ParseState st = {0};
    st.config = c;
    st.name = name;
    st.file = file;
    st.text = text;
    st.section = -1;
    st.overrides = overrides;
    st.err = err;
    st.err_size = err_size;
    if (err && err_size) err[0] = 0;

    config_defaults(c);
    snprintf(c->path, sizeof c->path, "%s", name);
    int rc = ini_parse_stream(read_line, &st, on_key, &st);
    free(st.line);
    if (!st.failed && rc != 0) {
        // Every syntax error is caught by read_line first; this covers libinih failing on its own.
        if (rc > 0) fail(&st, "%s:%d: cannot parse this line - expected key = value or a [section] header", name, rc);
        else fail(&st, "%s: libinih failed (%d) - expected a readable INI file", name, rc);
    }
    for (int i = 0; i < n_overrides && !st.failed; i++) apply_override(&st, i);
    if (!st.failed) check_config(&st);
    return st.failed ? -1 : 0;
}

int config_load(Config *c, const char *path, const char *const *overrides, int n_overrides, char *err,
                size_t err_size) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        if (err && err_size) snprintf(err, err_size, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    int rc = load(c, path, f, NULL, overrides, n_overrides, err, err_size);
    fclose(f);
    return rc;
}

int config_load_string(Config *c, const char *name, const char *text, const char *const *overrides,
                       int n_overrides, char *err, size_t err_size) {
    return load(c, name, NULL, text, overrides, n_overrides, err, err_size);
}

// ---------------------------------------------------------------------------- printing

static void format_value(const Config *c, const ConfigKey *key, char *buf, size_t size) {
    const char *field = (const char *)c + key->offset;
    switch (key->type) {
    case KEY_INT: snprintf(buf, size, "%d", *field_int_c(c, key)); break;
    case KEY_UINT64: snprintf(buf, size, "%llu", (unsigned long long)*(const uint64_t *)field); break;
    case KEY_DOUBLE: format_double(*(const double *)field, buf, size); break;
    case KEY_BOOL: snprintf(buf, size, "%s", *field_int_c(c, key) ? "true" : "false"); break;
    case KEY_ENUM: snprintf(buf, size, "%s", key->words[*field_int_c(c, key)]); break;
    case KEY_STRING: snprintf(buf, size, "%s", field); break;
    }
}

void config_print(const Config *c, FILE *f) {
    char value[CONFIG_PATH_MAX + 8];
    fprintf(f, "; fp8moe job, resolved from %s\n", c->path[0] ? c->path : "(defaults)");
    for (int s = 0; s < N_SECTIONS; s++) {
        fprintf(f, "\n[%s]\n", section_table[s].name);
        for (int k = 0; k < N_KEYS; k++) {
            if (strcmp(key_table[k].section, section_table[s].name) != 0) continue;
            format_value(c, &key_table[k], value, sizeof value);
            fprintf(f, "%s = %s\n", key_table[k].name, value);
        }
    }
}

void config_print_reference(FILE *f) {
    static const char *const type_names[] = {"int", "uint64", "number", "bool", "string", "enum"};
    Config defaults;
    config_defaults(&defaults);
    char value[CONFIG_PATH_MAX + 8], range[160], lo[40], hi[40];
    for (int s = 0; s < N_SECTIONS; s++) {
        fprintf(f, "%s### [%s]\n\n%s\n\n", s ? "\n" : "", section_table[s].name, section_table[s].doc);
        fprintf(f, "| key | type | default | range / values | meaning |\n|---|---|---|---|---|\n");
        for (int k = 0; k < N_KEYS; k++) {
            const ConfigKey *key = &key_table[k];
            if (strcmp(key->section, section_table[s].name) != 0) continue;
            format_value(&defaults, key, value, sizeof value);
            switch (key->type) {
            case KEY_INT: snprintf(range, sizeof range, "[%.0f, %.0f]", key->lo, key->hi); break;
            case KEY_UINT64: snprintf(range, sizeof range, "[0, 2^64-1]"); break;
            case KEY_DOUBLE:
                format_double(key->lo, lo, sizeof lo);
                format_double(key->hi, hi, sizeof hi);
                snprintf(range, sizeof range, "%c%s, %s%c", key->lo_open ? '(' : '[', lo, hi, key->hi_open ? ')' : ']');
                break;
            case KEY_BOOL: snprintf(range, sizeof range, "`true`, `false`"); break;
            case KEY_STRING:
                snprintf(range, sizeof range, "%s%.0f characters", key->lo > 0 ? "non-empty, at most " : "at most ",
                         key->hi);
                break;
            case KEY_ENUM: {
                size_t used = 0;
                for (int w = 0; key->words[w] && used < sizeof range; w++)
                    used += (size_t)snprintf(range + used, sizeof range - used, "%s`%s`", w ? ", " : "", key->words[w]);
                break;
            }
            }
            int quote = key->type == KEY_STRING || key->type == KEY_ENUM || key->type == KEY_BOOL;
            fprintf(f, "| `%s` | %s | %s%s%s | %s | %s%s |\n", key->name, type_names[key->type],
                    quote ? "`" : "", key->type == KEY_STRING && value[0] == 0 ? "\"\"" : value, quote ? "`" : "",
                    range, key->doc, key->required ? " (required)" : "");
        }
    }
}

int config_parse_word_list(const char *list, const char *const *words, const char **out, char *err, size_t err_size) {
    int n = 0;
    for (const char *p = list;;) {
        const char *e = strchr(p, ',');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        int k = -1;
        for (int i = 0; words[i]; i++)
            if (strlen(words[i]) == len && !strncmp(p, words[i], len)) k = i;
        if (k < 0) {
            int at = snprintf(err, err_size, "unknown mode '%.*s'; expected a comma-separated list of", (int)len, p);
            for (int i = 0; words[i] && at >= 0 && (size_t)at < err_size; i++)
                at += snprintf(err + at, err_size - (size_t)at, "%s %s", i == 0 ? "" : words[i + 1] ? "," : " and",
                               words[i]);
            return -1;
        }
        for (int i = 0; i < n; i++)
            if (out[i] == words[k]) {
                snprintf(err, err_size, "%s appears twice; expected each mode once", words[k]);
                return -1;
            }
        out[n++] = words[k];
        if (!e) return n;
        p = e + 1;
    }
}

int config_parse_mode_list(const char *list, const char *modes[3], char *err, size_t err_size) {
    return config_parse_word_list(list, precision_words, modes, err, err_size);
}
