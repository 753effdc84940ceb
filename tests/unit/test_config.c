/*
 * test_config.c - the job-file parser (train/config.c): defaults, a full file, every class of error
 * with its exact `file:line: section.key:` prefix, --set overrides, the print -> reparse round trip,
 * and that docs/config.md still holds the reference generated from the key table.
 *
 * Expected values are written out by hand from the spec (config.h comments and the task's defaults),
 * never taken from the parser's own output.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/config.h"

#define DOC_MARKER "<!-- generated: fp8moe config reference -->"

static char err[2048];

static int load(Config *c, const char *text) { return config_load_string(c, "job.ini", text, NULL, 0, err, sizeof err); }

// Loads text that must fail and checks the error line starts with `prefix`.
static void expect_error(const char *text, const char *const *overrides, int n, const char *prefix) {
    Config c;
    int rc = config_load_string(&c, "job.ini", text, overrides, n, err, sizeof err);
    if (rc == 0 || strncmp(err, prefix, strlen(prefix)) != 0)
        fail_msg("text:\n%s\nwanted an error starting with: %s\ngot rc=%d err: %s", text, prefix, rc, err);
    assert_null(strchr(err, '\n'));  // one line
}

// Writes text to a temporary file and returns its path (in buf).
static void write_temp(char *buf, size_t size, const char *text) {
    snprintf(buf, size, "/tmp/fp8moe_test_config_XXXXXX");
    int fd = mkstemp(buf);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

// ---------------------------------------------------------------------------- defaults

static void test_defaults(void **state) {
    (void)state;
    Config c;
    config_defaults(&c);
    assert_int_equal(c.model.vocab_size, 256);
    assert_true(c.model.rope_theta == 10000.0);
    assert_true(c.model.init_std == 0.02);
    assert_true(c.moe.route_scale == 1.0);
    assert_true(c.moe.bias_update_speed == 0.001);
    assert_true(c.moe.balance_loss_alpha == 1e-4);
    assert_int_equal(c.mtp.depth, 1);
    assert_true(c.mtp.loss_weight == 0.3);
    assert_int_equal(c.precision.mode, PRECISION_FP32);
    assert_int_equal(c.parallel.pp, 1);
    assert_int_equal(c.parallel.ep, 1);
    assert_int_equal(c.parallel.dp, 1);
    assert_true(c.optim.lr == 1e-3);
    assert_true(c.optim.min_lr == 1e-4);
    assert_int_equal(c.optim.warmup_steps, 100);
    assert_int_equal(c.optim.schedule, LR_COSINE);
    assert_true(c.optim.decay_frac == 0.2);
    assert_true(c.optim.beta1 == 0.9);
    assert_true(c.optim.beta2 == 0.95);
    assert_true(c.optim.eps == 1e-8);
    assert_true(c.optim.weight_decay == 0.1);
    assert_true(c.optim.grad_clip == 1.0);
    assert_int_equal(c.train.steps, 1000);
    assert_int_equal(c.train.micro_batch_size, 8);
    assert_int_equal(c.train.seq_len, 256);
    assert_int_equal(c.train.grad_accum, 1);
    assert_true(c.train.seed == 1234);
    assert_int_equal(c.train.device, DEVICE_SEL_AUTO);
    assert_int_equal(c.train.eval_every, 100);
    assert_int_equal(c.train.eval_batches, 0);
    assert_int_equal(c.train.threads, 0);
    assert_string_equal(c.data.text, "");
    assert_string_equal(c.data.shards, "");
    assert_string_equal(c.data.cache_dir, "data/prepared");
    assert_string_equal(c.checkpoint.dir, "runs/default");
    assert_int_equal(c.checkpoint.save_weights, 1);
    assert_int_equal(c.log.every, 1);
    assert_string_equal(c.log.jsonl, "");
    // The default model is a valid small MoE: the cross-key rules hold.
    assert_true(c.model.dim > 0 && c.model.n_layers > c.model.n_dense_layers);
    assert_int_equal(c.model.qk_rope_head_dim % 2, 0);
    assert_int_equal(c.moe.n_routed_experts % c.moe.n_expert_groups, 0);
    assert_true(c.moe.n_routed_experts / c.moe.n_expert_groups >= 2);

    // An empty job file (only comments) is valid and gives exactly the defaults.
    Config d;
    assert_int_equal(config_load_string(&d, "empty.ini", "; nothing here\n# or here\n\n", NULL, 0, err, sizeof err),
                     0);
    assert_string_equal(d.path, "empty.ini");
    memset(d.path, 0, sizeof d.path);
    memset(c.path, 0, sizeof c.path);
    assert_memory_equal(&c, &d, sizeof c);
}

// ---------------------------------------------------------------------------- a full file

static const char *full_job =
    "; every key, none at its default\n"
    "[model]\n"
    "vocab_size = 50257\n"
    "dim = 96\n"
    "n_layers = 5\n"
    "n_dense_layers = 2\n"
    "inter_dim = 200\n"
    "n_heads = 6\n"
    "q_lora_rank = 0\n"
    "kv_lora_rank = 24\n"
    "qk_nope_head_dim = 12\n"
    "qk_rope_head_dim = 6\n"
    "v_head_dim = 10\n"
    "rope_theta = 50000.5\n"
    "init_std = 0.006\n"
    "\n"
    "[moe]\n"
    "n_routed_experts = 16\n"
    "n_shared_experts = 2\n"
    "n_activated_experts = 6\n"
    "n_expert_groups = 4\n"
    "n_limited_groups = 3\n"
    "moe_inter_dim = 40\n"
    "route_scale = 2.5\n"
    "bias_update_speed = 0.0025\n"
    "balance_loss_alpha = 3e-5\n"
    "[mtp]\n"
    "depth = 2\n"
    "loss_weight = 0.1\n"
    "[precision]\n"
    "mode = fp32\n"
    "[parallel]\n"
    "pp = 4\n"
    "ep = 2\n"
    "dp = 6\n"
    "[optim]\n"
    "lr = 0.0007\n"
    "min_lr = 7e-05\n"
    "warmup_steps = 33\n"
    "schedule = wsd\n"
    "decay_frac = 0.15\n"
    "beta1 = 0.8\n"
    "beta2 = 0.999\n"
    "eps = 1e-10\n"
    "weight_decay = 0.05\n"
    "grad_clip = 0\n"
    "[train]\n"
    "steps = 77\n"
    "micro_batch_size = 3\n"
    "seq_len = 64\n"
    "grad_accum = 5\n"
    "seed = 18446744073709551615\n"
    "device = cpu\n"
    "eval_every = 0\n"
    "eval_batches = 9\n"
    "threads = 2\n"
    "[data]\n"
    "text = a.txt,b.txt\n"
    "shards = /data/fineweb\n"
    "cache_dir = /tmp/cache\n"
    "[checkpoint]\n"
    "dir = runs/full\n"
    "save_weights = false\n"
    "[log]\n"
    "every = 10\n"
    "jsonl = m.jsonl\n";

static void test_full_file(void **state) {
    (void)state;
    Config c;
    char path[64];
    write_temp(path, sizeof path, full_job);
    int rc = config_load(&c, path, NULL, 0, err, sizeof err);
    unlink(path);
    if (rc != 0) fail_msg("%s", err);
    assert_int_equal(c.parallel.pp, 4);
    assert_int_equal(c.parallel.dp, 6);
    assert_int_equal(c.parallel.ep, 2);
    assert_int_equal(c.parallel.schedule, PIPE_1F1B);
    assert_string_equal(c.path, path);
    assert_int_equal(c.model.vocab_size, 50257);
    assert_int_equal(c.model.dim, 96);
    assert_int_equal(c.model.n_layers, 5);
    assert_int_equal(c.model.n_dense_layers, 2);
    assert_int_equal(c.model.inter_dim, 200);
    assert_int_equal(c.model.n_heads, 6);
    assert_int_equal(c.model.q_lora_rank, 0);
    assert_int_equal(c.model.kv_lora_rank, 24);
    assert_int_equal(c.model.qk_nope_head_dim, 12);
    assert_int_equal(c.model.qk_rope_head_dim, 6);
    assert_int_equal(c.model.v_head_dim, 10);
    assert_true(c.model.rope_theta == 50000.5);
    assert_true(c.model.init_std == 0.006);
    assert_int_equal(c.moe.n_routed_experts, 16);
    assert_int_equal(c.moe.n_shared_experts, 2);
    assert_int_equal(c.moe.n_activated_experts, 6);
    assert_int_equal(c.moe.n_expert_groups, 4);
    assert_int_equal(c.moe.n_limited_groups, 3);
    assert_int_equal(c.moe.moe_inter_dim, 40);
    assert_true(c.moe.route_scale == 2.5);
    assert_true(c.moe.bias_update_speed == 0.0025);
    assert_true(c.moe.balance_loss_alpha == 3e-5);
    assert_int_equal(c.mtp.depth, 2);
    assert_true(c.mtp.loss_weight == 0.1);
    assert_int_equal(c.precision.mode, PRECISION_FP32);
    assert_true(c.optim.lr == 0.0007);
    assert_true(c.optim.min_lr == 7e-05);
    assert_int_equal(c.optim.warmup_steps, 33);
    assert_int_equal(c.optim.schedule, LR_WSD);
    assert_true(c.optim.decay_frac == 0.15);
    assert_true(c.optim.beta1 == 0.8);
    assert_true(c.optim.beta2 == 0.999);
    assert_true(c.optim.eps == 1e-10);
    assert_true(c.optim.weight_decay == 0.05);
    assert_true(c.optim.grad_clip == 0.0);
    assert_int_equal(c.train.steps, 77);
    assert_int_equal(c.train.micro_batch_size, 3);
    assert_int_equal(c.train.seq_len, 64);
    assert_int_equal(c.train.grad_accum, 5);
    assert_true(c.train.seed == UINT64_MAX);
    assert_int_equal(c.train.device, DEVICE_SEL_CPU);
    assert_int_equal(c.train.eval_every, 0);
    assert_int_equal(c.train.eval_batches, 9);
    assert_int_equal(c.train.threads, 2);
    assert_string_equal(c.data.text, "a.txt,b.txt");
    assert_string_equal(c.data.shards, "/data/fineweb");
    assert_string_equal(c.data.cache_dir, "/tmp/cache");
    assert_string_equal(c.checkpoint.dir, "runs/full");
    assert_int_equal(c.checkpoint.save_weights, 0);
    assert_int_equal(c.log.every, 10);
    assert_string_equal(c.log.jsonl, "m.jsonl");
}

// Syntax the parser accepts: comments, indentation, CRLF, spaces inside [ ], a value longer than
// libinih's 200-byte line buffer, and an indented line that must not continue the previous value.
static void test_syntax_accepted(void **state) {
    (void)state;
    Config c;
    char longpath[701];
    for (int i = 0; i < 700; i++) longpath[i] = (char)('a' + (i * 7) % 26);
    longpath[0] = '/';
    longpath[700] = 0;
    char text[2048];
    snprintf(text, sizeof text,
             "\xEF\xBB\xBF# job\r\n"
             "[ model ]   ; the model\r\n"
             "   dim=48 ; inline comment\r\n"
             "\tn_layers   =   3\r\n"
             "[data]\n"
             "text = %s ; a long path\n"
             "shards = x;y\n",
             longpath);
    if (load(&c, text) != 0) fail_msg("%s", err);
    assert_int_equal(c.model.dim, 48);
    assert_int_equal(c.model.n_layers, 3);
    assert_string_equal(c.data.text, longpath);
    assert_string_equal(c.data.shards, "x;y");  // ';' without a blank before it is not a comment

    // The same from a file (read by getline, not from a string), without a final newline.
    text[strlen(text) - 1] = 0;
    char path[64];
    write_temp(path, sizeof path, text);
    int rc = config_load(&c, path, NULL, 0, err, sizeof err);
    unlink(path);
    if (rc != 0) fail_msg("%s", err);
    assert_int_equal(c.model.dim, 48);
    assert_string_equal(c.data.text, longpath);
    assert_string_equal(c.data.shards, "x;y");

    // Lines of every length around libinih's 200-byte buffer (198 characters + '\n' + NUL) parse whole.
    for (int len = 180; len <= 220; len++) {
        char line[256] = "shards = ";
        size_t head = strlen(line);
        for (size_t i = head; i < (size_t)len; i++) line[i] = (char)('A' + i % 26);
        line[len] = 0;
        snprintf(text, sizeof text, "[data]\n%s\ncache_dir = after\n", line);
        if (load(&c, text) != 0) fail_msg("line of %d characters: %s", len, err);
        assert_int_equal(strlen(c.data.shards), (size_t)len - head);
        assert_memory_equal(c.data.shards, line + head, (size_t)len - head);
        assert_string_equal(c.data.cache_dir, "after");
    }
}

// ---------------------------------------------------------------------------- errors

static void test_error_bad_int(void **state) {
    (void)state;
    expect_error("[model]\n\n; c\n\n\n\ndim = abc\n", NULL, 0,
                 "job.ini:7: model.dim: \"abc\" is not an integer - expected an integer in [1, 65536]");
    assert_string_equal(err, "job.ini:7: model.dim: \"abc\" is not an integer - expected an integer in [1, 65536]");
    expect_error("[model]\nn_heads = 1.5\n", NULL, 0, "job.ini:2: model.n_heads: \"1.5\" is not an integer");
    expect_error("[model]\nn_heads = 1e3\n", NULL, 0, "job.ini:2: model.n_heads: \"1e3\" is not an integer");
    expect_error("[model]\nn_heads =\n", NULL, 0, "job.ini:2: model.n_heads: \"\" is not an integer");
    expect_error("[train]\nseed = -1\n", NULL, 0, "job.ini:2: train.seed: \"-1\" is not an unsigned integer");
    expect_error("[optim]\nlr = fast\n", NULL, 0, "job.ini:2: optim.lr: \"fast\" is not a number - expected a number in (0, 10]");
    expect_error("[optim]\nlr = nan\n", NULL, 0, "job.ini:2: optim.lr: \"nan\" is not a number");
    expect_error("[checkpoint]\nsave_weights = yes\n", NULL, 0,
                 "job.ini:2: checkpoint.save_weights: \"yes\" is not a boolean - expected true or false");
}

static void test_error_out_of_range(void **state) {
    (void)state;
    expect_error("[model]\ndim = 65537\n", NULL, 0,
                 "job.ini:2: model.dim: \"65537\" is out of range - expected an integer in [1, 65536]");
    expect_error("[model]\ndim = 0\n", NULL, 0, "job.ini:2: model.dim: \"0\" is out of range");
    expect_error("[model]\ndim = 99999999999999999999\n", NULL, 0, "job.ini:2: model.dim: \"99999999999999999999\" is out of range");
    expect_error("[train]\nseed = 18446744073709551616\n", NULL, 0, "job.ini:2: train.seed: \"18446744073709551616\" is out of range");
    expect_error("[optim]\nbeta2 = 1\n", NULL, 0, "job.ini:2: optim.beta2: \"1\" is out of range - expected a number in [0, 1)");
    expect_error("[optim]\nlr = 0\n", NULL, 0, "job.ini:2: optim.lr: \"0\" is out of range - expected a number in (0, 10]");
    expect_error("[optim]\nlr = 1e999\n", NULL, 0, "job.ini:2: optim.lr: \"1e999\" is out of range");
    expect_error("[checkpoint]\ndir =\n", NULL, 0,
                 "job.ini:2: checkpoint.dir: \"\" is empty - expected a non-empty string of at most 1023 characters");
    char text[1200] = "[data]\ntext = ";
    size_t n = strlen(text);
    memset(text + n, 'p', 1024);
    text[n + 1024] = 0;
    expect_error(text, NULL, 0, "job.ini:2: data.text: a value of 1024 characters is too long");
}

static void test_error_unknown_section(void **state) {
    (void)state;
    expect_error("; job\n\n[modle]\ndim = 3\n", NULL, 0,
                 "job.ini:3: [modle]: unknown section - expected one of [model] [moe] [mtp] [precision] [parallel] "
                 "[optim] [train] [data] [checkpoint] [log] (did you mean [model]?)");
    expect_error("[model]\ndim = 3\n[zzzzzz]\n", NULL, 0, "job.ini:3: [zzzzzz]: unknown section - expected one of [model]");
    assert_null(strstr(err, "did you mean"));
    expect_error("dim = 3\n", NULL, 0, "job.ini:1: dim: key outside any section - expected a [section] header");
    expect_error("[model\n", NULL, 0, "job.ini:1: cannot read \"[model\" - expected a section header");
    expect_error("[model]\ndim: 3\n", NULL, 0, "job.ini:2: cannot read \"dim: 3\" - expected key = value");
    expect_error("[model]\ndim\n", NULL, 0, "job.ini:2: cannot read \"dim\" - expected key = value");
}

static void test_error_unknown_key(void **state) {
    (void)state;
    expect_error("[model]\ndim = 8\nn_layer = 2\n", NULL, 0,
                 "job.ini:3: model.n_layer: unknown key - expected a key of [model] (did you mean model.n_layers?)");
    // A key written under the wrong section is pointed to its own section.
    expect_error("[train]\nlr = 0.1\n", NULL, 0, "job.ini:2: train.lr: unknown key - expected a key of [train] (did you mean optim.lr?)");
    // Nothing close: the message lists the section's keys instead.
    expect_error("[mtp]\nbanana = 1\n", NULL, 0, "job.ini:2: mtp.banana: unknown key - expected one of depth, loss_weight");
}

static void test_error_bad_enum(void **state) {
    (void)state;
    expect_error("[precision]\nmode = fp16\n", NULL, 0,
                 "job.ini:2: precision.mode: \"fp16\" is not an allowed value - expected one of fp32, bf16, fp8");
    expect_error("[train]\ndevice = gpu\n", NULL, 0,
                 "job.ini:2: train.device: \"gpu\" is not an allowed value - expected one of auto, cpu, cuda");
    expect_error("[optim]\nschedule = Cosine\n", NULL, 0,
                 "job.ini:2: optim.schedule: \"Cosine\" is not an allowed value - expected one of cosine, wsd");
}

static void test_error_duplicate_key(void **state) {
    (void)state;
    expect_error("[model]\ndim = 8\n[moe]\nmoe_inter_dim = 4\n[model]\ndim = 16\n", NULL, 0,
                 "job.ini:6: model.dim: duplicate key (first set on line 2) - expected each key once");
}

static void test_error_missing_file(void **state) {
    (void)state;
    Config c;
    assert_int_equal(config_load(&c, "/nonexistent-dir/job.ini", NULL, 0, err, sizeof err), -1);
    assert_string_equal(err, "/nonexistent-dir/job.ini: cannot open: No such file or directory");
    // A tiny error buffer is cut, never overrun.
    char small[12];
    assert_int_equal(config_load_string(&c, "job.ini", "[model]\ndim = abc\n", NULL, 0, small, sizeof small), -1);
    assert_string_equal(small, "job.ini:2: ");
}

static void test_error_cross_key(void **state) {
    (void)state;
    expect_error("[model]\nn_layers = 3\nn_dense_layers = 4\n", NULL, 0,
                 "job.ini:3: model.n_dense_layers: 4 is more than model.n_layers = 3 - expected at most model.n_layers");
    expect_error("[model]\nqk_rope_head_dim = 7\n", NULL, 0, "job.ini:2: model.qk_rope_head_dim: 7 is odd - expected an even number");
    expect_error("[moe]\nn_routed_experts = 10\nn_expert_groups = 4\n", NULL, 0,
                 "job.ini:3: moe.n_expert_groups: 4 does not divide moe.n_routed_experts = 10");
    expect_error("[moe]\nn_routed_experts = 8\nn_expert_groups = 8\nn_limited_groups = 2\n", NULL, 0,
                 "job.ini:3: moe.n_expert_groups: 8 groups of moe.n_routed_experts = 8 leave 1 expert per group - "
                 "expected at least 2 experts per group");
    expect_error("[moe]\nn_limited_groups = 5\n", NULL, 0,
                 "job.ini:2: moe.n_limited_groups: 5 is more than moe.n_expert_groups = 4");
    // Defaults E = 8, 4 groups of 2: one limited group reaches 2 experts, so K = 3 cannot be met.
    expect_error("[moe]\nn_limited_groups = 1\nn_activated_experts = 3\n", NULL, 0,
                 "job.ini:3: moe.n_activated_experts: 3 is more than the 2 experts in moe.n_limited_groups = 1 groups of 2");
    expect_error("[parallel]\ndp = 6\nep = 4\n", NULL, 0, "job.ini:3: parallel.ep: 4 does not divide parallel.dp = 6");
    expect_error("[parallel]\ndp = 6\nep = 3\n", NULL, 0, "job.ini:3: parallel.ep: 3 does not divide moe.n_routed_experts = 8");
    expect_error("[moe]\nn_routed_experts = 512\n[precision]\nmode = fp8\n", NULL, 0,
                 "job.ini:2: moe.n_routed_experts: 512 experts over parallel.ep = 1 ranks is 512 per rank - expected at "
                 "most 256 per rank in fp8 mode");
    expect_error("[optim]\nlr = 0.001\nmin_lr = 0.002\n", NULL, 0,
                 "job.ini:3: optim.min_lr: 0.002 is more than optim.lr = 0.001 - expected at most optim.lr");
    expect_error("[mtp]\ndepth = 3\n[train]\nseq_len = 4\n", NULL, 0,
                 "job.ini:4: train.seq_len: 4 is too short for mtp.depth = 3 - expected at least 2 + mtp.depth = 5");
    // A key left at its default is blamed on the file as a whole (no line to point at).
    expect_error("[moe]\nn_routed_experts = 6\n", NULL, 0, "job.ini: moe.n_expert_groups: 4 does not divide moe.n_routed_experts = 6");
}

// Numbers the trainer would see as something else in FP32: 0 instead of a tiny positive value (optim.eps = 1e-46
// made AdamW divide 0 by 0, NaN weights at step 2, then a crash in the router), or beyond the FP32 range.
static void test_error_fp32_values(void **state) {
    (void)state;
    Config c;
    expect_error("[optim]\neps = 1e-46\n", NULL, 0,
                 "job.ini:2: optim.eps: \"1e-46\" is 0 in FP32 - expected a number in (0, 1] of magnitude at least "
                 "1.401298e-45 (the smallest FP32 number)");
    expect_error("[optim]\neps = 5e-324\n", NULL, 0, "job.ini:2: optim.eps: \"5e-324\" is 0 in FP32");
    const char *tiny_lr[] = {"optim.lr=1e-300", "optim.min_lr=0"};
    expect_error("", tiny_lr, 2, "--set optim.lr=1e-300: optim.lr: \"1e-300\" is 0 in FP32");
    expect_error("[optim]\nmin_lr = 1e-50\n", NULL, 0, "job.ini:2: optim.min_lr: \"1e-50\" is 0 in FP32");
    expect_error("[moe]\nbalance_loss_alpha = 7e-46\n", NULL, 0, "job.ini:2: moe.balance_loss_alpha: \"7e-46\" is 0 in FP32");
    // 0 itself where the range allows it, and the smallest FP32 numbers, are what they say
    assert_int_equal(load(&c, "[optim]\nmin_lr = 0\neps = 1e-45\n[moe]\nbalance_loss_alpha = 8e-46\n"), 0);
    assert_true(c.optim.min_lr == 0.0 && c.optim.eps == 1e-45 && c.moe.balance_loss_alpha == 8e-46);
    assert_true((float)c.optim.eps > 0 && (float)c.moe.balance_loss_alpha > 0);
    // beyond FP32 (3.4e38): every number key's range stops well below it, and says so
    expect_error("[model]\nrope_theta = 1e39\n", NULL, 0, "job.ini:2: model.rope_theta: \"1e39\" is out of range");
    expect_error("[optim]\ngrad_clip = 3.5e38\n", NULL, 0, "job.ini:2: optim.grad_clip: \"3.5e38\" is out of range");
}

// Sizes the program computes from several keys: a micro-batch's token rows are 32-bit ints, and the memory a job
// needs is bounded (both used to overflow or fail an allocation at step 1: 65536 * 65537 tokens).
static void test_error_sizes(void **state) {
    (void)state;
    Config c;
    const char *big[] = {"train.micro_batch_size=65536", "train.seq_len=65537"};
    expect_error("", big, 2,
                 "--set train.seq_len=65537: train.micro_batch_size * train.seq_len: 65536 * 65537 = 4295032832 tokens "
                 "per micro-batch - expected at most 536870911 = 2147483647 / 4 (max(model.n_heads, "
                 "moe.n_activated_experts) rows per token");
    // the bound is 2^31 - 1 rows over the larger of n_heads (4) and n_activated_experts (2): 65536 * 8192 is one over
    const char *over[] = {"train.micro_batch_size=65536", "train.seq_len=8192"};
    expect_error("", over, 2, "--set train.seq_len=8192: train.micro_batch_size * train.seq_len: 65536 * 8192 = 536870912");
    const char *under[] = {"train.micro_batch_size=65536", "train.seq_len=8191"};
    if (config_load_string(&c, "job.ini", "", under, 2, err, sizeof err) != 0) fail_msg("%s", err);
    const char *routed[] = {"moe.n_activated_experts=8", "moe.n_limited_groups=4", "train.micro_batch_size=65536",
                            "train.seq_len=4096"};
    expect_error("", routed, 4, "--set train.seq_len=4096: train.micro_batch_size * train.seq_len: 65536 * 4096 = "
                                "268435456 tokens per micro-batch - expected at most 268435455 = 2147483647 / 8");
    // seq_len left at its default: the line of micro_batch_size is the one pointed at
    expect_error("[train]\nmicro_batch_size = 65536\n[model]\nn_heads = 1024\n", NULL, 0,
                 "job.ini:2: train.micro_batch_size * train.seq_len: 65536 * 256 = 16777216 tokens per micro-batch - "
                 "expected at most 2097151 = 2147483647 / 1024");
    // memory: 1.4e19 parameters
    const char *huge[] = {"model.dim=65536", "model.n_layers=1024", "moe.n_routed_experts=65536",
                          "moe.n_expert_groups=1", "moe.n_limited_groups=1", "moe.moe_inter_dim=1048576"};
    expect_error("", huge, 6, "--set model.dim=65536: model: the job needs at least 144.0 EiB (144.0 EiB for 1.384e+19 "
                              "parameters with their gradients and AdamW moments, ");
    assert_non_null(strstr(err, "- expected at most 16.0 TiB in one process; lower model.dim, model.n_layers, "
                                "model.vocab_size, moe.n_routed_experts or moe.moe_inter_dim"));
    // activations: 2^29 tokens of 65536-wide logits
    const char *acts[] = {"model.vocab_size=65536", "train.micro_batch_size=65536", "train.seq_len=8191"};
    expect_error("", acts, 3, "--set train.seq_len=8191: train.micro_batch_size * train.seq_len: the job needs at least ");
    assert_non_null(strstr(err, "of activations for train.micro_batch_size * train.seq_len = 536805376 tokens) - "
                                "expected at most 16.0 TiB in one process; lower train.micro_batch_size or "
                                "train.seq_len"));
    // DeepSeek-V3's shape (671B parameters, 7.3 TiB with gradients and moments) is below the bound
    const char *v3[] = {"model.vocab_size=65536", "model.dim=7168", "model.n_layers=61", "model.n_dense_layers=3",
                        "model.inter_dim=18432", "model.n_heads=128", "model.q_lora_rank=1536",
                        "model.kv_lora_rank=512", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64",
                        "model.v_head_dim=128", "moe.n_routed_experts=256", "moe.n_activated_experts=8",
                        "moe.n_expert_groups=8", "moe.n_limited_groups=4", "moe.moe_inter_dim=2048",
                        "train.micro_batch_size=1", "train.seq_len=4096"};
    if (config_load_string(&c, "job.ini", "", v3, 18, err, sizeof err) != 0) fail_msg("%s", err);
}

// The ranges are what the program accepts: the model has at most 8 MTP modules (MTP_MAX_DEPTH) and token shards
// hold uint16 ids (a vocabulary of at most 65536).
static void test_ranges_match_the_program(void **state) {
    (void)state;
    Config c;
    expect_error("[mtp]\ndepth = 9\n[train]\nseq_len = 64\n", NULL, 0,
                 "job.ini:2: mtp.depth: \"9\" is out of range - expected an integer in [0, 8]");
    assert_int_equal(load(&c, "[mtp]\ndepth = 8\n[train]\nseq_len = 64\n"), 0);
    assert_int_equal(c.mtp.depth, 8);
    expect_error("[model]\nvocab_size = 65537\n", NULL, 0,
                 "job.ini:2: model.vocab_size: \"65537\" is out of range - expected an integer in [2, 65536]");
    assert_int_equal(load(&c, "[model]\nvocab_size = 65536\n"), 0);
    assert_int_equal(c.model.vocab_size, 65536);
}

// precision.bf16_fprop_only: only with bf16_fprop (in fp8 mode), comma-separated parts of tensor names; the parts
// are kept as written (the model checks them against its tensors, tests/unit/bf16_gemm_kinds.sh).
static void test_bf16_fprop_only(void **state) {
    (void)state;
    Config c;
    expect_error("[precision]\nmode = fp8\nbf16_fprop_only = wq_b\n", NULL, 0,
                 "job.ini:3: precision.bf16_fprop_only: \"wq_b\" without precision.bf16_fprop = true");
    const char *bad[] = {"wq b", "wq_b,", ",wq_b", "wq_a,,wq_b", "wq-b"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[128], want[128];
        snprintf(text, sizeof text, "[precision]\nmode = fp8\nbf16_fprop = true\nbf16_fprop_only = %s\n", bad[i]);
        snprintf(want, sizeof want, "job.ini:4: precision.bf16_fprop_only: \"%s\" - expected comma-separated parts",
                 bad[i]);
        expect_error(text, NULL, 0, want);
    }
    assert_int_equal(load(&c, "[precision]\nmode = fp8\nbf16_fprop = true\nbf16_fprop_only = layers.2.attn.wq_a,wq_b\n"),
                     0);
    assert_string_equal(c.precision.bf16_fprop_only, "layers.2.attn.wq_a,wq_b");
}

// Pipeline layouts the model cannot hold are invalid jobs, named by their key, after the checks that say what would be
// wrong with the layout itself: more stages than layers (dualpipev cuts 2 pp stages). Pipeline,
// data and expert parallel layouts load (their world size is checked at launch, train/trainer.c).
static void test_error_parallel_layout(void **state) {
    (void)state;
    expect_error("[model]\nn_layers = 3\n[parallel]\npp = 4\n", NULL, 0,
                 "job.ini:4: parallel.pp: 4 pipeline stages for model.n_layers = 3 - expected at most one stage per "
                 "layer");
    expect_error("[parallel]\npp = 2\nschedule = dualpipev\n", NULL, 0,
                 "job.ini:2: parallel.pp: 2 ranks of parallel.schedule = dualpipev cut the model into 4 stages, but "
                 "model.n_layers = 2 - expected at most one stage per layer (parallel.pp <= 1)");
    Config ok;
    assert_int_equal(load(&ok, "[model]\nn_layers = 4\n[parallel]\npp = 2\nschedule = dualpipev\n"), 0);
    assert_int_equal(ok.parallel.schedule, PIPE_DUALPIPEV);
    // parallel.stage_layers: one count per stage (2 x pp under dualpipev), each >= 1, summing to the layers
    assert_int_equal(load(&ok, "[model]\nn_layers = 6\n[parallel]\npp = 3\nstage_layers = 1, 3,2\n"), 0);
    assert_int_equal(ok.parallel.n_stage_layers, 3);
    assert_int_equal(ok.parallel.stage_layer_count[0], 1);
    assert_int_equal(ok.parallel.stage_layer_count[1], 3);
    assert_int_equal(ok.parallel.stage_layer_count[2], 2);
    expect_error("[model]\nn_layers = 6\n[parallel]\npp = 3\nstage_layers = 1,3\n", NULL, 0,
                 "job.ini:5: parallel.stage_layers: \"1,3\" lists 2 stage(s) of 4 layers - expected 3 stages (parallel.pp) "
                 "of model.n_layers = 6 in all");
    expect_error("[model]\nn_layers = 6\n[parallel]\npp = 2\nschedule = dualpipev\nstage_layers = 3,3\n", NULL, 0,
                 "job.ini:6: parallel.stage_layers: \"3,3\" lists 2 stage(s) of 6 layers - expected 4 stages (parallel.pp x 2 "
                 "under dualpipev) of model.n_layers = 6 in all");
    expect_error("[model]\nn_layers = 6\n[parallel]\npp = 2\nstage_layers = 6,0\n", NULL, 0,
                 "job.ini:5: parallel.stage_layers: \"6,0\": entry 2 is not a layer count - expected 2 comma-separated "
                 "integers >= 1");
    expect_error("[model]\nn_layers = 6\n[parallel]\npp = 2\nstage_layers = 3;3\n", NULL, 0,
                 "job.ini:5: parallel.stage_layers: \"3;3\": entry 1 is not a layer count");
    expect_error("[parallel]\nschedule = gpipe\n", NULL, 0, "job.ini:2: parallel.schedule: \"gpipe\"");
    expect_error("[parallel]\nep = 2\n", NULL, 0, "job.ini:2: parallel.ep: 2 does not divide parallel.dp = 1");
    const char *layouts[2][2] = {{"parallel.dp=4", "parallel.ep=1"}, {"parallel.dp=4", "parallel.ep=2"}};
    for (int i = 0; i < 2; i++) {
        Config c;
        char path[64];
        write_temp(path, sizeof path, "[model]\ndim = 32\n");
        int rc = config_load(&c, path, layouts[i], 2, err, sizeof err);
        unlink(path);
        if (rc != 0) fail_msg("%s %s should load: %s", layouts[i][0], layouts[i][1], err);
        assert_int_equal(c.parallel.dp, 4);
        assert_int_equal(c.parallel.ep, i + 1);
    }
}

// A NUL byte used to end the line silently where it stood (`dim = 3<NUL>2` read as dim = 3): it is refused, with
// the file, the line and the column.
static void test_error_nul_byte(void **state) {
    (void)state;
    static const char text[] = "[model]\ndim = 3\0" "2\nn_heads = 2\n";
    char path[64];
    snprintf(path, sizeof path, "/tmp/fp8moe_test_config_XXXXXX");
    const int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(fd);
    Config c;
    const int rc = config_load(&c, path, NULL, 0, err, sizeof err);
    char want[128];
    snprintf(want, sizeof want, "%s:2: a NUL byte at column 8 - expected a text file (no NUL bytes)", path);
    assert_int_equal(rc, -1);
    assert_string_equal(err, want);
    // in a comment too: the file is not text
    static const char comment[] = "; a\0b\n[model]\ndim = 3\n";
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fwrite(comment, 1, sizeof comment - 1, f), sizeof comment - 1);
    fclose(f);
    assert_int_equal(config_load(&c, path, NULL, 0, err, sizeof err), -1);
    snprintf(want, sizeof want, "%s:1: a NUL byte at column 4", path);
    unlink(path);
    if (strncmp(err, want, strlen(want)) != 0) fail_msg("wanted %s...\ngot %s", want, err);
}

// ---------------------------------------------------------------------------- overrides

static void test_overrides(void **state) {
    (void)state;
    Config c;
    const char *sets[] = {"model.dim=24", " optim.lr = 0.002 ", "train.device=cuda", "model.dim=40",
                          "data.text=x.txt"};
    int rc = config_load_string(&c, "job.ini", "[model]\ndim = 8\nn_heads = 3\n[data]\ntext = y.txt\n", sets, 5,
                                err, sizeof err);
    if (rc != 0) fail_msg("%s", err);
    assert_int_equal(c.model.dim, 40);  // the last --set wins, and any --set wins over the file
    assert_int_equal(c.model.n_heads, 3);
    assert_true(c.optim.lr == 0.002);
    assert_int_equal(c.train.device, DEVICE_SEL_CUDA);
    assert_string_equal(c.data.text, "x.txt");

    const char *no_eq[] = {"model.dim"};
    expect_error("", no_eq, 1, "--set model.dim: missing '=' - expected --set section.key=value");
    const char *no_dot[] = {"dim=3"};
    expect_error("", no_dot, 1, "--set dim=3: \"dim\" is not a section.key name - expected --set section.key=value");
    const char *ctl_name[] = {"model.di\nm=3"};
    expect_error("", ctl_name, 1, "--set model.di\\x0am=3: \"model.di\\x0am\" is not a section.key name");
    const char *unknown[] = {"model.dimm=3"};
    expect_error("", unknown, 1, "--set model.dimm=3: model.dimm: unknown key - expected a key of [model] (did you mean model.dim?)");
    const char *bad_section[] = {"modle.dim=3"};
    expect_error("", bad_section, 1, "--set modle.dim=3: [modle]: unknown section - expected one of [model]");
    const char *bad_value[] = {"model.dim=3", "train.seq_len=x"};
    expect_error("", bad_value, 2, "--set train.seq_len=x: train.seq_len: \"x\" is not an integer - expected an integer in [2, 1048576]");
    const char *newline[] = {"data.text=a\nb"};
    expect_error("", newline, 1, "--set data.text=a\\x0ab: data.text: \"a\\x0ab\" has a control character at position 2");
    // A cross-key error caused by an override points at that override.
    const char *dense[] = {"model.n_dense_layers=9"};
    expect_error("", dense, 1, "--set model.n_dense_layers=9: model.n_dense_layers: 9 is more than model.n_layers = 2");
}

// ---------------------------------------------------------------------------- round trip

// Print -> reparse gives the identical struct, including doubles drawn at random (shortest
// round-trip printing must keep every bit) and a path longer than libinih's line buffer.
static void test_round_trip(void **state) {
    (void)state;
    char longdir[400];
    for (int i = 0; i < 399; i++) longdir[i] = (char)('a' + (i * 11) % 26);
    longdir[399] = 0;
    char set_dir[450], set_lr[64], set_theta[64], set_std[64], set_wd[64];
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", longdir);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    double r[4];
    for (int i = 0; i < 4; i++) {  // xorshift64: fixed, non-zero doubles in (0, 1)
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        r[i] = ((double)(x >> 11) + 0.5) / 9007199254740992.0;
    }
    snprintf(set_lr, sizeof set_lr, "optim.lr=%.17g", 5.0 * r[0] + 1e-3);
    snprintf(set_theta, sizeof set_theta, "model.rope_theta=%.17g", 1e6 * r[1] + 1.0);
    snprintf(set_std, sizeof set_std, "model.init_std=%.17g", r[2] * 1e-3);
    snprintf(set_wd, sizeof set_wd, "optim.weight_decay=%.17g", r[3]);
    const char *sets[] = {set_dir, set_lr, set_theta, set_std, set_wd, "optim.min_lr=0"};

    Config a, b;
    int rc = config_load_string(&a, "full.ini", full_job, sets, 6, err, sizeof err);
    if (rc != 0) fail_msg("%s", err);
    assert_string_equal(a.checkpoint.dir, longdir);

    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    config_print(&a, f);
    fclose(f);
    rc = config_load_string(&b, "printed.ini", text, NULL, 0, err, sizeof err);
    if (rc != 0) fail_msg("%s\n%s", err, text);
    // Every key is printed: count the `key = value` lines against the keys of config.h (67).
    int lines = 0;
    for (char *p = text; (p = strstr(p, " = ")) != NULL; p += 3) lines++;
    assert_int_equal(lines, 67);
    free(text);
    memset(a.path, 0, sizeof a.path);
    memset(b.path, 0, sizeof b.path);
    assert_memory_equal(&a, &b, sizeof a);

    // The defaults round-trip too.
    config_defaults(&a);
    f = open_memstream(&text, &len);
    config_print(&a, f);
    fclose(f);
    rc = config_load_string(&b, "printed.ini", text, NULL, 0, err, sizeof err);
    free(text);
    if (rc != 0) fail_msg("%s", err);
    memset(b.path, 0, sizeof b.path);
    assert_memory_equal(&a, &b, sizeof a);
}

// ---------------------------------------------------------------------------- docs/config.md

// docs/config.md must end with exactly the reference generated from the key table.
static void test_doc_up_to_date(void **state) {
    (void)state;
    FILE *f = fopen("docs/config.md", "r");
    if (f == NULL) fail_msg("cannot open docs/config.md (tests run from the repository root)");
    char *doc = NULL;
    size_t cap = 0;
    ssize_t n = getdelim(&doc, &cap, 0, f);
    fclose(f);
    assert_true(n > 0);
    char *marker = strstr(doc, DOC_MARKER "\n");
    if (marker == NULL) fail_msg("docs/config.md has no line %s", DOC_MARKER);
    const char *generated = marker + strlen(DOC_MARKER "\n");

    char *ref = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&ref, &len);
    config_print_reference(m);
    fclose(m);
    if (strcmp(generated, ref) != 0) {
        size_t i = 0;
        while (generated[i] && generated[i] == ref[i]) i++;
        fail_msg("docs/config.md is out of date (first difference at byte %zu after the marker); regenerate it:\n"
                 "  sed -i '/^%s$/q' docs/config.md && build/fp8moe config-doc >> docs/config.md",
                 i, DOC_MARKER);
    }
    // Every key of config.h appears as a table row (spot checks of names from the spec).
    assert_non_null(strstr(ref, "| `qk_rope_head_dim` | int |"));
    assert_non_null(strstr(ref, "| `mode` | enum | `fp32` | `fp32`, `bf16`, `fp8` |"));
    assert_non_null(strstr(ref, "| `save_weights` | bool | `true` |"));
    free(ref);
    free(doc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_full_file),
        cmocka_unit_test(test_syntax_accepted),
        cmocka_unit_test(test_error_bad_int),
        cmocka_unit_test(test_error_out_of_range),
        cmocka_unit_test(test_error_unknown_section),
        cmocka_unit_test(test_error_unknown_key),
        cmocka_unit_test(test_error_bad_enum),
        cmocka_unit_test(test_error_duplicate_key),
        cmocka_unit_test(test_error_missing_file),
        cmocka_unit_test(test_error_cross_key),
        cmocka_unit_test(test_error_fp32_values),
        cmocka_unit_test(test_error_sizes),
        cmocka_unit_test(test_ranges_match_the_program),
        cmocka_unit_test(test_error_parallel_layout),
        cmocka_unit_test(test_error_nul_byte),
        cmocka_unit_test(test_overrides),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_doc_up_to_date),
        cmocka_unit_test(test_bf16_fprop_only),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
