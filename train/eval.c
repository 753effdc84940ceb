/*
 * eval.c - `fp8moe eval` (see eval.h): a trained model's losses on given data, with the trainer's evaluation loop
 * in one process.
 *
 * Deliberately one process: evaluation is a forward pass per batch, and the one-process model gives the same
 * numbers as any layout (the losses are a mean over targets; only the order of the sum over ranks differs). The
 * MTP loss is reported as the trainer logs it, the mean over depths of each depth's mean CE over its valid
 * positions (here over the whole evaluated data).
 */
#include "train/cli.h"
#include "train/eval.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/loader.h"
#include "data/prep.h"
#include "data/shard.h"
#include "train/model_source.h"
#include "train/train_state.h"

const char *const eval_usage =
    "  fp8moe eval CKPT [--text FILE | --shards DIR] [--batches N] [--set section.key=value]...\n"
    "      Print the main loss and the MTP loss of a trained model (CKPT: a checkpoint DIR/step_NNNNNNNN,\n"
    "      DIR/latest or DIR, of any parallel layout; or a weights.h5) on FILE's bytes, on DIR's validation\n"
    "      shards, or by default on the job's validation split, without training: one process, fp32 unless\n"
    "      --set precision.mode=bf16|fp8. --batches N evaluates the first N micro-batches (0 = all; default\n"
    "      all, or on the job's split the trainer's evaluation, train.eval_batches x the run's parallel.dp,\n"
    "      so the number is its val_loss).\n";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------- data

// FILE's bytes as the one validation shard of a new temporary directory (its path into dir).
static int text_shard_dir(const char *file, char *dir, size_t size, char *err, size_t err_size) {
    struct stat st;
    if (stat(file, &st) != 0) {
        snprintf(err, err_size, "--text %s: %s", file, strerror(errno));
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, err_size, "--text %s: not a regular file", file);
        return -1;
    }
    FILE *f = fopen(file, "rb");
    if (!f) {
        snprintf(err, err_size, "--text %s: %s", file, strerror(errno));
        return -1;
    }
    const int64_t n = st.st_size;
    unsigned char *bytes = malloc((size_t)(n ? n : 1));
    uint16_t *tokens = malloc((size_t)(n ? n : 1) * sizeof *tokens);
    int rc = -1;
    if (!bytes || !tokens) {
        snprintf(err, err_size, "--text %s: out of memory for %lld bytes", file, (long long)n);
        goto done;
    }
    if ((int64_t)fread(bytes, 1, (size_t)n, f) != n) {
        snprintf(err, err_size, "--text %s: read failed: %s", file, ferror(f) ? strerror(errno) : "the file shrank");
        goto done;
    }
    if (n < 2) {
        snprintf(err, err_size, "--text %s: %lld byte%s; at least 2 are needed (one target)", file, (long long)n,
                 n == 1 ? "" : "s");
        goto done;
    }
    if (n > SHARD_MAX_TOKENS) {
        snprintf(err, err_size, "--text %s: %lld bytes, more than one shard holds (%d)", file, (long long)n,
                 SHARD_MAX_TOKENS);
        goto done;
    }
    for (int64_t i = 0; i < n; i++) tokens[i] = bytes[i];
    const char *tmpdir = getenv("TMPDIR");
    snprintf(dir, size, "%s/fp8moe-eval-XXXXXX", tmpdir && tmpdir[0] ? tmpdir : "/tmp");
    if (!mkdtemp(dir)) {
        snprintf(err, err_size, "%s: cannot make a temporary directory for --text's shard: %s", dir, strerror(errno));
        dir[0] = '\0';
        goto done;
    }
    char path[CONFIG_PATH_MAX + 64];
    if (snprintf(path, sizeof path, "%s/%s_val_000000.bin", dir, DATA_PREP_NAME) >= (int)sizeof path) {
        snprintf(err, err_size, "%s: the temporary directory's path is too long", dir);
        rmdir(dir);
        dir[0] = '\0';
        goto done;
    }
    if (shard_write(path, tokens, n, err, err_size) != 0) {
        rmdir(dir);
        dir[0] = '\0';
        goto done;
    }
    rc = 0;
done:
    fclose(f);
    free(bytes);
    free(tokens);
    return rc;
}

static void remove_text_shard_dir(const char *dir) {
    if (!dir[0]) return;
    char path[CONFIG_PATH_MAX + 64];
    if (snprintf(path, sizeof path, "%s/%s_val_000000.bin", dir, DATA_PREP_NAME) < (int)sizeof path) unlink(path);
    rmdir(dir);
}

// ---------------------------------------------------------------------------- evaluation

typedef struct {
    double main;                  // mean main CE over the evaluated targets
    double mtp[MTP_MAX_DEPTH];    // per depth, mean over its valid positions
    double mtp_mean;              // mean over depths
    int64_t targets, batches;
} EvalResult;

// The trainer's evaluation loop (train/trainer.c evaluate) in one process, with the MTP terms added.
static int run_eval(Model *m, DataLoader *val, int64_t max_batches, EvalResult *r, char *err, size_t err_size) {
    const int B = val->opt.B, T = val->opt.T, depth = m->cfg.mtp.depth;
    const int64_t N = (int64_t)B * T;
    int *rows = malloc((size_t)B * (T + 1) * sizeof *rows), *labels = malloc((size_t)B * (T + 1) * sizeof *labels);
    int *inputs = malloc((size_t)N * sizeof *inputs), *targets = malloc((size_t)N * sizeof *targets);
    int *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
    ChunkActs *acts = rows && labels && inputs && targets && tok && tgt ? chunk_acts_create(m, 0, B, T) : NULL;
    int rc = -1;
    if (!acts) {
        snprintf(err, err_size, "out of memory for the activations of %d x %d tokens", B, T);
        goto done;
    }
    memset(r, 0, sizeof *r);
    double main_sum = 0, mtp_sum[MTP_MAX_DEPTH] = {0};
    int64_t mtp_n[MTP_MAX_DEPTH] = {0};
    loader_reset(val);
    int64_t batches = loader_eval_batches(val);
    if (max_batches > 0 && max_batches < batches) batches = max_batches;
    for (int64_t i = 0; i < batches; i++) {
        int64_t n_targets = 0;
        if (!loader_next_eval(val, rows, labels, &n_targets)) break;
        if (n_targets == 0) continue;  // pure padding, as the trainer skips it
        train_split_batch(rows, labels, B, T, inputs, targets);
        chunk_forward(m, 0, acts, inputs, targets, NULL, NULL);
        const LossTerms lt = chunk_losses(acts);
        r->batches++;
        if (lt.n_valid == 0) continue;
        main_sum += lt.main * (double)lt.n_valid;
        r->targets += lt.n_valid;
        for (int k = 0; k < depth; k++) {  // each depth's mean is over its own valid positions
            model_mtp_tokens(tok, tgt, targets, B, T, k + 1);
            int64_t nk = 0;
            for (int64_t j = 0; j < N; j++) nk += tgt[j] >= 0;
            mtp_sum[k] += lt.mtp[k] * (double)nk;
            mtp_n[k] += nk;
        }
    }
    if (r->targets == 0) {
        snprintf(err, err_size, "no target in the %lld evaluated batch%s", (long long)batches, batches == 1 ? "" : "es");
        goto done;
    }
    r->main = main_sum / (double)r->targets;
    for (int k = 0; k < depth; k++) {
        r->mtp[k] = mtp_n[k] ? mtp_sum[k] / (double)mtp_n[k] : NAN;
        r->mtp_mean += r->mtp[k] / depth;
    }
    rc = 0;
done:
    chunk_acts_free(acts);
    free(rows);
    free(labels);
    free(inputs);
    free(targets);
    free(tok);
    free(tgt);
    return rc;
}

// ---------------------------------------------------------------------------- fp8moe eval

int eval_main(int argc, char **argv) {
    const char *ckpt = NULL, *text = NULL, *shards = NULL;
    long long max_batches = -1;  // -1: the default for the data
    // precision.mode = fp32 first, so that a --set precision.mode given later wins
    const char **overrides = calloc((size_t)argc + 2, sizeof *overrides);
    if (!overrides) return 1;
    int n_overrides = 0, rc = 2;
    overrides[n_overrides++] = "precision.mode=fp32";
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", eval_usage);
            free(overrides);
            return 0;
        }
        const int takes_value = !strcmp(a, "--text") || !strcmp(a, "--shards") || !strcmp(a, "--set") ||
                                !strcmp(a, "--batches");
        if (takes_value && i + 1 >= argc) {
            rc = cli_usage_error("eval", eval_usage, "%s needs a value", a);
            goto out;
        }
        if (!strcmp(a, "--text")) text = argv[++i];
        else if (!strcmp(a, "--shards")) shards = argv[++i];
        else if (!strcmp(a, "--set")) overrides[n_overrides++] = argv[++i];
        else if (!strncmp(a, "--set=", 6)) overrides[n_overrides++] = a + 6;
        else if (!strcmp(a, "--batches")) {
            int n;
            if (cli_parse_int(argv[++i], 0, INT_MAX, &n)) {
                rc = cli_usage_error("eval", eval_usage, "--batches %s: expected an integer >= 0 (0 = every batch)", argv[i]);
                goto out;
            }
            max_batches = n;
        } else if (a[0] == '-' && a[1] != '\0') {
            rc = cli_usage_error("eval", eval_usage, "unknown option %s", a);
            goto out;
        } else if (ckpt) {
            rc = cli_usage_error("eval", eval_usage, "one checkpoint expected; got a second one: %s", a);
            goto out;
        } else {
            ckpt = a;
        }
    }
    if (!ckpt) {
        rc = cli_usage_error("eval", eval_usage, "missing the checkpoint (CKPT: a checkpoint directory or a weights.h5)%s", "");
        goto out;
    }
    if (text && shards) {
        rc = cli_usage_error("eval", eval_usage, "--text and --shards: give one of them (or neither for the job's validation split)%s", "");
        goto out;
    }
    for (int i = 1; i < n_overrides; i++)
        if (!strchr(overrides[i], '=') || !strchr(overrides[i], '.')) {
            rc = cli_usage_error("eval", eval_usage, "--set %s: expected section.key=value", overrides[i]);
            goto out;
        }

    char err[2048], what[CONFIG_PATH_MAX + 128], dir[CONFIG_PATH_MAX + 64] = "", tmp_dir[CONFIG_PATH_MAX + 64] = "";
    ModelSource *src = malloc(sizeof *src);
    Config *cfg = malloc(sizeof *cfg);
    Model m;
    int model_ok = 0, loader_ok = 0;
    DataLoader val;
    rc = 1;
    if (!src || !cfg) goto done;
    if (model_source_config(ckpt, overrides, n_overrides, src, cfg, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe eval: %s\n", err);
        rc = strncmp(err, "--set", 5) == 0 ? 2 : 1;  // a bad override is bad usage
        goto done;
    }
    if (text && cfg->model.vocab_size != DATA_PREP_VOCAB) {
        fprintf(stderr, "fp8moe eval: --text %s: the model's vocabulary is %d tokens; --text reads bytes, for a "
                "byte-level model (vocab_size = %d); give tokenised shards with --shards\n", text,
                cfg->model.vocab_size, DATA_PREP_VOCAB);
        goto done;
    }
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    Device dev;
    if (train_state_pick_device(cfg, &dev) != 0) goto done;
    if (model_source_load(src, cfg, dev, &m, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe eval: %s\n", err);
        goto done;
    }
    model_ok = 1;
    const char *data_what;
    if (text) {
        if (text_shard_dir(text, tmp_dir, sizeof tmp_dir, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe eval: %s\n", err);
            goto done;
        }
        snprintf(dir, sizeof dir, "%s", tmp_dir);
        data_what = "every byte of";
    } else if (shards) {
        snprintf(dir, sizeof dir, "%s", shards);
        data_what = "the validation shards of";
    } else {
        if (train_state_data_dir(cfg, 1, dir, sizeof dir, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe eval: the job's data: %s\n", err);
            goto done;
        }
        data_what = "the job's validation split in";
        // the trainer's evaluation: train.eval_batches batches on each of its dp ranks, which together are the first
        // eval_batches x dp micro-batches of one process (data/loader.h)
        if (max_batches < 0) max_batches = (long long)cfg->train.eval_batches * src->stored.parallel.dp;
    }
    if (max_batches < 0) max_batches = 0;
    LoaderOptions lo = {.dir = dir, .split = LOADER_VAL, .vocab_size = cfg->model.vocab_size,
                        .B = cfg->train.micro_batch_size, .T = cfg->train.seq_len, .seed = cfg->train.seed,
                        .dp_rank = 0, .dp_size = 1};
    if (loader_open(&val, &lo, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe eval: %s%s\n", text ? "--text: " : shards ? "--shards: " : "", err);
        goto done;
    }
    loader_ok = 1;
    model_source_describe(src, what, sizeof what);
    static const char *const modes[] = {"fp32", "bf16", "fp8"};
    printf("eval: %s, %s mode, %d thread%s\n", what, modes[cfg->precision.mode], omp_get_max_threads(),
           omp_get_max_threads() == 1 ? "" : "s");
    const int64_t all = loader_eval_batches(&val);
    const int64_t n_batches = max_batches > 0 && max_batches < all ? max_batches : all;
    printf("data: %s %s: %lld of %lld batch%s of %d x %d tokens\n", data_what, text ? text : dir,
           (long long)n_batches, (long long)all, all == 1 ? "" : "es", lo.B, lo.T);
    double t0 = now_s();
    EvalResult r;
    if (run_eval(&m, &val, max_batches, &r, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe eval: %s\n", err);
        goto done;
    }
    char line[512];
    int len = snprintf(line, sizeof line, "eval | loss=%.9g", r.main);
    if (cfg->mtp.depth > 0) len += snprintf(line + len, sizeof line - (size_t)len, " | mtp_loss=%.9g", r.mtp_mean);
    for (int k = 0; cfg->mtp.depth > 1 && k < cfg->mtp.depth; k++)
        len += snprintf(line + len, sizeof line - (size_t)len, " | mtp%d_loss=%.9g", k + 1, r.mtp[k]);
    snprintf(line + len, sizeof line - (size_t)len, " | %lld targets | %.1fs", (long long)r.targets, now_s() - t0);
    printf("%s\n", line);
    rc = 0;
done:
    if (loader_ok) loader_close(&val);
    if (model_ok) model_free(&m);
    remove_text_shard_dir(tmp_dir);
    free(src);
    free(cfg);
out:
    free(overrides);
    return rc;
}
