/*
 * loader.c - the deterministic token-window loader (rules for windows, order, sharding over dp ranks,
 * cursor and the evaluation pass are in loader.h).
 *
 * Everything is index arithmetic over one in-memory array of tokens: a window id maps to its first
 * token through window_start, and the epoch's order is a permutation of window ids recomputed from
 * (seed, epoch) whenever the cursor enters a new epoch. No state outside the cursor affects a batch,
 * which is what makes save/restore exact.
 */
#include "data/loader.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data/prep.h"
#include "data/shard.h"
#include "kernels/error.h"
#include "kernels/rng.h"

// purpose tag of the data-order stream, so it never coincides with another stream of the same seed
#define LOADER_RNG_PURPOSE 0x646174616f726472ULL  // "dataordr"

static const char *split_pattern(LoaderSplit s) { return s == LOADER_TRAIN ? "*_train_*.bin" : "*_val_*.bin"; }

// ---------------------------------------------------------------------------- finding shards
static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// Paths of the regular files in dir matching the split's pattern, sorted by strcmp of the name.
static int list_shards(DataLoader *L, char *err, size_t errsz) {
    const char *dir = L->opt.dir, *pattern = split_pattern(L->opt.split);
    DIR *d = opendir(dir);
    if (!d) {
        set_err(err, errsz, "%s: cannot open shard directory: %s", dir, strerror(errno));
        return -1;
    }
    int cap = 0, oom = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (fnmatch(pattern, e->d_name, 0) != 0) continue;
        size_t dl = strlen(dir), nl = strlen(e->d_name);
        char *path = malloc(dl + nl + 2);
        if (!path) {
            oom = 1;
            break;
        }
        memcpy(path, dir, dl);
        path[dl] = '/';
        memcpy(path + dl + 1, e->d_name, nl + 1);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(path);
            continue;
        }
        if (L->n_shards == cap) {
            cap = cap ? 2 * cap : 16;
            char **np = realloc(L->shard_paths, (size_t)cap * sizeof *np);
            if (!np) {
                free(path);
                oom = 1;
                break;
            }
            L->shard_paths = np;
        }
        L->shard_paths[L->n_shards++] = path;
    }
    closedir(d);
    if (oom) {
        set_err(err, errsz, "%s: out of memory listing shards", dir);
        return -1;
    }
    if (L->n_shards == 0) {
        set_err(err, errsz, "%s: no shard matching %s/%s (expected llm.c token shards such as bytes_%s_000000.bin)",
                dir, dir, pattern, L->opt.split == LOADER_TRAIN ? "train" : "val");
        return -1;
    }
    qsort(L->shard_paths, (size_t)L->n_shards, sizeof *L->shard_paths, cmp_str);
    return 0;
}

static void make_order(DataLoader *L, uint64_t epoch);

// ---------------------------------------------------------------------------- open / close
int loader_open(DataLoader *L, const LoaderOptions *opt, char *err, size_t errsz) {
    memset(L, 0, sizeof *L);
    L->opt = *opt;
    const char *dir = opt->dir ? opt->dir : "(null)";
    if (opt->B < 1 || opt->T < 1 || opt->dp_size < 1 || opt->dp_rank < 0 || opt->dp_rank >= opt->dp_size) {
        set_err(err, errsz, "%s: loader needs B >= 1, T >= 1 and 0 <= dp_rank < dp_size (got B=%d T=%d dp_rank=%d dp_size=%d)",
                dir, opt->B, opt->T, opt->dp_rank, opt->dp_size);
        return -1;
    }
    L->dir_copy = strdup(dir);
    if (!L->dir_copy) goto oom;
    L->opt.dir = L->dir_copy;
    if (list_shards(L, err, errsz) != 0) goto fail;

    // sizes first (header checks only) so all tokens go into one allocation
    int64_t *counts = calloc((size_t)L->n_shards, sizeof *counts);
    if (!counts) goto oom;
    for (int s = 0; s < L->n_shards; s++) {
        if (shard_open(L->shard_paths[s], &counts[s], err, errsz) != 0) {
            free(counts);
            goto fail;
        }
        L->n_tokens += counts[s];
    }
    const int64_t T = opt->T;
    for (int s = 0; s < L->n_shards; s++) {
        if (counts[s] >= T + 1) L->n_windows += (counts[s] - 1) / T;
        if (counts[s] >= 2) L->n_eval_windows += (counts[s] - 1 + T - 1) / T;
    }
    L->tokens = malloc((size_t)(L->n_tokens > 0 ? L->n_tokens : 1) * sizeof(uint16_t));
    L->window_start = malloc((size_t)(L->n_windows > 0 ? L->n_windows : 1) * sizeof(int64_t));
    L->order = malloc((size_t)(L->n_windows > 0 ? L->n_windows : 1) * sizeof(int64_t));
    L->eval_start = malloc((size_t)(L->n_eval_windows > 0 ? L->n_eval_windows : 1) * sizeof(int64_t));
    L->eval_len = malloc((size_t)(L->n_eval_windows > 0 ? L->n_eval_windows : 1) * sizeof(int32_t));
    if (!L->tokens || !L->window_start || !L->order || !L->eval_start || !L->eval_len) {
        free(counts);
        goto oom;
    }
    // A directory prepared by fp8moe (data/prep.h) records each shard's checksum in its stamp: the
    // shards it lists must still be what was written. Others (llm.c's own shards) have none.
    char *stamp = data_stamp_load(L->dir_copy);
    int64_t base = 0, w = 0, ew = 0;
    for (int s = 0; s < L->n_shards; s++) {
        uint16_t *buf = NULL;
        int64_t n = 0;
        uint64_t sum = 0, recorded = 0;
        if (shard_read_checksum(L->shard_paths[s], opt->vocab_size, &buf, &n, stamp ? &sum : NULL, err, errsz) != 0) {
            free(stamp);
            free(counts);
            goto fail;
        }
        if (stamp && data_stamp_shard_sum(stamp, strrchr(L->shard_paths[s], '/') + 1, &recorded) && sum != recorded) {
            set_err(err, errsz,
                    "%s: checksum %016" PRIx64 " differs from %016" PRIx64 " recorded for it in %s/%s: the shard was "
                    "corrupted or changed after it was prepared (prepare it again: fp8moe prep, or data.text)",
                    L->shard_paths[s], sum, recorded, dir, DATA_PREP_STAMP);
            free(buf);
            free(stamp);
            free(counts);
            goto fail;
        }
        if (n != counts[s]) {  // the file was replaced between the two reads
            set_err(err, errsz, "%s: token count changed from %" PRId64 " to %" PRId64 " while loading", L->shard_paths[s],
                    counts[s], n);
            free(buf);
            free(stamp);
            free(counts);
            goto fail;
        }
        if (n > 0) memcpy(L->tokens + base, buf, (size_t)n * sizeof(uint16_t));
        free(buf);
        for (int64_t p = 0; p + T + 1 <= n; p += T) L->window_start[w++] = base + p;
        for (int64_t p = 0; p < n - 1; p += T) {
            L->eval_start[ew] = base + p;
            L->eval_len[ew++] = (int32_t)(n - p < T + 1 ? n - p : T + 1);
        }
        if (n >= 2) L->eval_targets += n - 1;
        base += n;
    }
    free(stamp);
    free(counts);

    L->per_epoch = L->n_windows / opt->dp_size * opt->dp_size;
    if (opt->split == LOADER_TRAIN && L->per_epoch == 0) {
        set_err(err, errsz,
                "%s: the %d shard(s) matching %s hold %" PRId64 " full windows of T+1 = %d tokens; need at least "
                "dp_size = %d (more text, or a smaller seq_len)",
                dir, L->n_shards, split_pattern(opt->split), L->n_windows, opt->T + 1, opt->dp_size);
        goto fail;
    }
    if (opt->split == LOADER_VAL && L->n_eval_windows == 0) {
        set_err(err, errsz, "%s: the %d shard(s) matching %s hold no shard of 2 or more tokens (nothing to evaluate)",
                dir, L->n_shards, split_pattern(opt->split));
        goto fail;
    }
    make_order(L, 0);
    loader_reset(L);
    return 0;
oom:
    set_err(err, errsz, "%s: out of memory loading shards", dir);
fail:
    loader_close(L);
    return -1;
}

void loader_close(DataLoader *L) {
    for (int s = 0; s < L->n_shards; s++) free(L->shard_paths[s]);
    free(L->shard_paths);
    free(L->dir_copy);
    free(L->tokens);
    free(L->window_start);
    free(L->order);
    free(L->eval_start);
    free(L->eval_len);
    memset(L, 0, sizeof *L);
}

// ---------------------------------------------------------------------------- order
// Fisher-Yates over window ids, step i (W-1 down to 1) swapping with j = u64(key, i) mod (i+1).
// The modulo bias is below W / 2^64, far below anything measurable.
static void make_order(DataLoader *L, uint64_t epoch) {
    int64_t W = L->n_windows;
    for (int64_t i = 0; i < W; i++) L->order[i] = i;
    if (L->opt.split == LOADER_TRAIN) {
        uint64_t key = rng_key(L->opt.seed, epoch, 0, LOADER_RNG_PURPOSE);
        for (int64_t i = W - 1; i > 0; i--) {
            int64_t j = (int64_t)(rng_u64(key, (uint64_t)i) % (uint64_t)(i + 1));
            int64_t t = L->order[i];
            L->order[i] = L->order[j];
            L->order[j] = t;
        }
    }
    L->order_epoch = epoch;
}

// ---------------------------------------------------------------------------- batches
int loader_next(DataLoader *L, int *tokens) {
    if (L->per_epoch == 0) return -1;
    const int T = L->opt.T, B = L->opt.B;
    // the micro-batch of all ranks is the next dp * B entries; this rank's rows are entries [rank B, rank B + B)
    const int64_t first = (int64_t)L->opt.dp_rank * B, n = (int64_t)L->opt.dp_size * B;
    for (int64_t k = 0; k < n; k++) {
        if (k >= first && k < first + B) {
            if (L->order_epoch != L->cursor.epoch) make_order(L, L->cursor.epoch);
            int64_t window = L->order[L->cursor.position];
            const uint16_t *src = L->tokens + L->window_start[window];
            int *row = tokens + (size_t)(k - first) * (size_t)(T + 1);
            for (int t = 0; t <= T; t++) row[t] = src[t];
        }
        L->cursor.position++;
        if (L->cursor.position >= (uint64_t)L->per_epoch) {  // roll over now: the cursor is always a next position
            L->cursor.epoch++;
            L->cursor.position = 0;
        }
    }
    return 0;
}

int64_t loader_num_batches(const DataLoader *L) { return L->per_epoch / L->opt.dp_size / L->opt.B; }

LoaderCursor loader_get_cursor(const DataLoader *L) { return L->cursor; }

int loader_set_cursor(DataLoader *L, LoaderCursor c, char *err, size_t errsz) {
    if (c.position % (uint64_t)L->opt.dp_size != 0 || c.position >= (uint64_t)L->per_epoch) {
        set_err(err, errsz,
                "%s: loader cursor position %" PRIu64 " (epoch %" PRIu64 ") does not fit this split: expected a multiple "
                "of dp_size = %d below %" PRId64 " (the windows per epoch; was the cursor saved with other data, "
                "seq_len or dp_size?)",
                L->opt.dir, c.position, c.epoch, L->opt.dp_size, L->per_epoch);
        return -1;
    }
    L->cursor = c;
    return 0;
}

void loader_reset(DataLoader *L) {
    L->cursor.epoch = 0;
    L->cursor.position = 0;
    L->eval_next = 0;
}

// ---------------------------------------------------------------------------- evaluation pass
int64_t loader_eval_windows(const DataLoader *L) { return L->n_eval_windows; }

int64_t loader_eval_batches(const DataLoader *L) {
    int64_t per_batch = (int64_t)L->opt.dp_size * L->opt.B;
    return (L->n_eval_windows + per_batch - 1) / per_batch;
}

int64_t loader_eval_targets(const DataLoader *L) { return L->eval_targets; }

int loader_next_eval(DataLoader *L, int *tokens, int *labels, int64_t *n_targets) {
    if (L->eval_next >= loader_eval_batches(L)) {
        if (n_targets) *n_targets = 0;
        return 0;
    }
    const int T = L->opt.T, B = L->opt.B;
    int64_t targets = 0;
    for (int b = 0; b < B; b++) {
        int64_t window = (L->eval_next * L->opt.dp_size + L->opt.dp_rank) * B + b;
        int len = 0;
        const uint16_t *src = NULL;
        if (window < L->n_eval_windows) {
            len = L->eval_len[window];
            src = L->tokens + L->eval_start[window];
            targets += len - 1;
        }
        int *trow = tokens + (size_t)b * (size_t)(T + 1), *lrow = labels + (size_t)b * (size_t)(T + 1);
        for (int t = 0; t <= T; t++) {
            trow[t] = t < len ? src[t] : 0;
            lrow[t] = t < len ? src[t] : -1;
        }
    }
    L->eval_next++;
    if (n_targets) *n_targets = targets;
    return 1;
}
