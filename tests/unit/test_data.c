/*
 * test_data.c - the data module: llm.c shard format and its validation, byte-level prep of text into
 * shards with its SOURCE.txt stamp, and the loader's windows, shuffled order, dp sharding, cursor and
 * evaluation pass; and data/durable.h's DurableFile, through which every text and shard file is written.
 *
 * References are independent of the code under test: shard headers are checked byte by byte against
 * the llm.c layout, prep output against the text file read here, FNV-1a against published test
 * vectors, and loader rows against window positions computed here from the shard sizes. Shard tokens
 * are a random permutation of 1..N (non-zero, distinct), so every token names its own position.
 * All files go to a mkdtemp directory under /tmp that is removed afterwards.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"
#include "data/loader.h"
#include "data/prep.h"
#include "data/shard.h"

#define GPT2_VOCAB 50257

// ---------------------------------------------------------------------------- helpers
static uint64_t test_rng(uint64_t *state) {  // splitmix64, independent of kernels/rng.h
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static char *make_tmpdir(void) {
    char *dir = strdup("/tmp/fp8moe_test_data_XXXXXX");
    assert_non_null(dir);
    assert_non_null(mkdtemp(dir));
    return dir;
}
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}
static void remove_tmpdir(char *dir) {
    nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}
// Each test gets a fresh directory as *state; teardown removes it even when the test failed.
static int setup_dir(void **state) {
    *state = make_tmpdir();
    return 0;
}
static int teardown_dir(void **state) {
    remove_tmpdir(*state);
    return 0;
}
static char *path_in(const char *dir, const char *name) {
    size_t len = strlen(dir) + strlen(name) + 2;
    char *p = malloc(len);
    assert_non_null(p);
    snprintf(p, len, "%s/%s", dir, name);
    return p;
}
static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}
// Whole file into memory; *n its size.
static unsigned char *read_all(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)*n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)*n, f), (size_t)*n);
    fclose(f);
    return buf;
}
static void assert_contains(const char *haystack, const char *needle) {
    if (!strstr(haystack, needle)) fail_msg("expected \"%s\" in error message \"%s\"", needle, haystack);
}
// A raw llm.c shard written here byte by byte (not with shard_write): header ints then tokens.
static void write_raw_shard(const char *path, int32_t magic, int32_t version, int32_t count, const uint16_t *tokens,
                            size_t n_tokens, size_t extra_bytes) {
    size_t size = 1024 + 2 * n_tokens + extra_bytes;
    unsigned char *buf = calloc(size, 1);
    assert_non_null(buf);
    int32_t h[3] = {magic, version, count};
    memcpy(buf, h, sizeof h);
    memcpy(buf + 1024, tokens, 2 * n_tokens);
    for (size_t i = 0; i < extra_bytes; i++) buf[1024 + 2 * n_tokens + i] = (unsigned char)(0x5a + i);
    write_bytes(path, buf, size);
    free(buf);
}

// A split on disk: shards of the given sizes whose tokens are a random permutation of 1..total, so
// a token value identifies its global position (value -> position via pos_of).
typedef struct {
    int n_shards;
    int64_t size[8], base[8];
    int64_t total;
    uint16_t *tokens;  // (total) all shards concatenated
    int64_t *pos_of;   // (total+1) global position of each value
} Corpus;

static void corpus_make(Corpus *c, const char *dir, const char *prefix, const char *split, const int64_t *sizes,
                        int n_shards, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->n_shards = n_shards;
    for (int s = 0; s < n_shards; s++) {
        c->size[s] = sizes[s];
        c->base[s] = c->total;
        c->total += sizes[s];
    }
    assert_true(c->total < GPT2_VOCAB);
    c->tokens = malloc((size_t)c->total * sizeof(uint16_t) + 2);
    c->pos_of = malloc((size_t)(c->total + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < c->total; i++) c->tokens[i] = (uint16_t)(i + 1);
    for (int64_t i = c->total - 1; i > 0; i--) {
        int64_t j = (int64_t)(test_rng(&seed) % (uint64_t)(i + 1));
        uint16_t t = c->tokens[i];
        c->tokens[i] = c->tokens[j];
        c->tokens[j] = t;
    }
    for (int64_t i = 0; i < c->total; i++) c->pos_of[c->tokens[i]] = i;
    for (int s = 0; s < n_shards; s++) {
        char name[128], err[512];
        snprintf(name, sizeof name, "%s_%s_%06d.bin", prefix, split, s);
        char *p = path_in(dir, name);
        assert_int_equal(shard_write(p, c->tokens + c->base[s], sizes[s], err, sizeof err), 0);
        free(p);
    }
}
static void corpus_free(Corpus *c) {
    free(c->tokens);
    free(c->pos_of);
}
// Check that row (T+1 tokens) is a full window of the corpus; return its global start.
static int64_t row_window(const Corpus *c, const int *row, int T) {
    assert_true(row[0] >= 1 && row[0] <= c->total);
    int64_t g = c->pos_of[row[0]];
    int s = 0;
    while (s + 1 < c->n_shards && g >= c->base[s + 1]) s++;
    int64_t p = g - c->base[s];
    assert_int_equal(p % T, 0);          // windows start at multiples of T
    assert_true(p + T + 1 <= c->size[s]);  // and lie inside one shard
    for (int t = 0; t <= T; t++) assert_int_equal(row[t], c->tokens[g + t]);
    return g;
}
// Expected full-window starts (global positions), computed from the shard sizes.
static int64_t expected_windows(const Corpus *c, int T, int64_t *starts) {
    int64_t w = 0;
    for (int s = 0; s < c->n_shards; s++)
        for (int64_t p = 0; p + T + 1 <= c->size[s]; p += T) starts[w++] = c->base[s] + p;
    return w;
}
static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}
static LoaderOptions opts(const char *dir, LoaderSplit split, int B, int T, uint64_t seed, int rank, int dp) {
    LoaderOptions o = {.dir = dir, .split = split, .vocab_size = GPT2_VOCAB, .B = B, .T = T, .seed = seed,
                       .dp_rank = rank, .dp_size = dp};
    return o;
}

// ---------------------------------------------------------------------------- shards
static void test_shard_roundtrip_gpt2_vocab(void **state) {
    char *dir = *state;
    char *p = path_in(dir, "x_train_000000.bin"), err[512];
    enum { N = 1000 };
    uint16_t tok[N];
    uint64_t seed = 11;
    for (int i = 0; i < N; i++) tok[i] = (uint16_t)(1 + test_rng(&seed) % (GPT2_VOCAB - 1));
    tok[5] = GPT2_VOCAB - 1;  // the largest GPT-2 id, far above a byte
    assert_int_equal(shard_write(p, tok, N, err, sizeof err), 0);

    // the bytes on disk are llm.c's layout
    long size = 0;
    unsigned char *raw = read_all(p, &size);
    assert_int_equal(size, 1024 + 2 * N);
    int32_t h[256];
    memcpy(h, raw, sizeof h);
    assert_int_equal(h[0], 20240520);
    assert_int_equal(h[1], 1);
    assert_int_equal(h[2], N);
    for (int i = 3; i < 256; i++) assert_int_equal(h[i], 0);
    assert_memory_equal(raw + 1024, tok, 2 * N);
    free(raw);

    int64_t n = -1;
    assert_int_equal(shard_open(p, &n, err, sizeof err), 0);
    assert_int_equal(n, N);
    uint16_t *back = NULL;
    assert_int_equal(shard_read(p, GPT2_VOCAB, &back, &n, err, sizeof err), 0);
    assert_int_equal(n, N);
    assert_memory_equal(back, tok, sizeof tok);
    free(back);
    // vocab 256 rejects the GPT-2 ids
    assert_int_equal(shard_read(p, 256, &back, &n, err, sizeof err), -1);
    assert_null(back);

    // the loader accepts GPT-2 ids with vocab 50257: T = 9 gives floor(999 / 9) = 111 windows
    DataLoader L;
    LoaderOptions o = opts(dir, LOADER_TRAIN, 1, 9, 1, 0, 1);
    assert_int_equal(loader_open(&L, &o, err, sizeof err), 0);
    assert_int_equal(L.n_windows, 111);
    int row[10];
    assert_int_equal(loader_next(&L, row), 0);
    int found = 0;  // the row is 10 consecutive tokens starting at a multiple of 9
    for (int s = 0; s + 10 <= N; s += 9) {
        int same = 1;
        for (int t = 0; t < 10; t++) same &= row[t] == tok[s + t];
        found += same;
    }
    assert_int_equal(found, 1);
    loader_close(&L);

    // no temporary file is left next to the shard: the directory holds exactly one entry
    DIR *d = opendir(dir);
    assert_non_null(d);
    int entries = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) entries += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    assert_int_equal(entries, 1);
    free(p);
}

static void test_shard_errors_name_the_file(void **state) {
    char *dir = *state;
    char err[512];
    uint16_t tok[40];
    uint64_t seed = 5;
    for (int i = 0; i < 40; i++) tok[i] = (uint16_t)(1 + test_rng(&seed) % 255);
    uint16_t *got = NULL;
    int64_t n = 0;

    char *p = path_in(dir, "bad_magic.bin");
    write_raw_shard(p, 12345, 1, 40, tok, 40, 0);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "bad magic 12345");
    assert_contains(err, "20240520");
    assert_int_equal(shard_open(p, &n, err, sizeof err), -1);
    free(p);

    p = path_in(dir, "bad_version.bin");
    write_raw_shard(p, 20240520, 2, 40, tok, 40, 0);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "version 2");
    free(p);

    p = path_in(dir, "truncated.bin");  // header says 40 tokens, 39 are there
    write_raw_shard(p, 20240520, 1, 40, tok, 39, 0);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "truncated");
    assert_contains(err, "1104");  // expected size 1024 + 2*40
    assert_contains(err, "1102");  // found: 39 tokens
    free(p);

    p = path_in(dir, "short_header.bin");
    write_bytes(p, tok, 64);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "header");
    free(p);

    p = path_in(dir, "trailing.bin");  // one odd byte after the last token
    write_raw_shard(p, 20240520, 1, 40, tok, 40, 1);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "trailing");
    free(p);

    p = path_in(dir, "big_token.bin");  // token 300 at position 17 with vocab 256
    tok[17] = 300;
    write_raw_shard(p, 20240520, 1, 40, tok, 40, 0);
    assert_int_equal(shard_read(p, 256, &got, &n, err, sizeof err), -1);
    assert_null(got);
    assert_contains(err, p);
    assert_contains(err, "position 17");
    assert_contains(err, "300");
    assert_contains(err, "256");
    free(p);

    p = path_in(dir, "missing.bin");
    assert_int_equal(shard_open(p, &n, err, sizeof err), -1);
    assert_contains(err, p);
    free(p);

    // the loader passes shard errors through: a train shard with a token >= vocab
    char *sub = path_in(dir, "split");
    assert_int_equal(mkdir(sub, 0700), 0);
    p = path_in(sub, "t_train_000000.bin");
    write_raw_shard(p, 20240520, 1, 40, tok, 40, 0);
    DataLoader L;
    LoaderOptions o = opts(sub, LOADER_TRAIN, 1, 4, 1, 0, 1);
    o.vocab_size = 256;
    assert_int_equal(loader_open(&L, &o, err, sizeof err), -1);
    assert_contains(err, p);
    assert_contains(err, "position 17");
    free(p);
    // and a directory without matching shards names the directory and the pattern
    o.split = LOADER_VAL;
    assert_int_equal(loader_open(&L, &o, err, sizeof err), -1);
    assert_contains(err, sub);
    assert_contains(err, "*_val_*.bin");
    free(sub);
}

// ---------------------------------------------------------------------------- prep
static void test_fnv1a64_vectors(void **state) {
    (void)state;  // published FNV-1a 64 test vectors
    assert_true(data_fnv1a64("", 0, DATA_FNV1A64_INIT) == 0xcbf29ce484222325ULL);
    assert_true(data_fnv1a64("a", 1, DATA_FNV1A64_INIT) == 0xaf63dc4c8601ec8cULL);
    assert_true(data_fnv1a64("foobar", 6, DATA_FNV1A64_INIT) == 0x85944171f73967e8ULL);
    // streaming in two pieces equals one pass
    assert_true(data_fnv1a64("bar", 3, data_fnv1a64("foo", 3, DATA_FNV1A64_INIT)) == 0x85944171f73967e8ULL);
}

// The committed text (tests/data/README.md: the first 299,868 bytes of Tiny Shakespeare), read relative to the
// repository root, where tests/run_unit.sh runs the tests. Its size and FNV-1a 64 hash were measured outside
// the code under test (`wc -c`, and the hash in Python over the file's bytes).
#define SHAKESPEARE_TEXT "tests/data/shakespeare.txt"
#define SHAKESPEARE_BYTES 299868L
#define SHAKESPEARE_FNV1A64 0xd072a9d0114c9a36ULL

static void test_prep_shakespeare(void **state) {
    char *dir = *state;
    const char *text = SHAKESPEARE_TEXT;
    long size = 0;
    unsigned char *bytes = read_all(text, &size);
    if (!bytes) fail_msg("cannot read %s (run the tests from the repository root)", text);
    assert_int_equal(size, SHAKESPEARE_BYTES);
    char *out = path_in(dir, "cache/bytes"), err[512];  // out_dir does not exist yet
    const char *paths[1] = {text};
    assert_int_equal(data_prep_is_current(paths, 1, out), 0);
    if (data_prep(paths, 1, out, err, sizeof err) != 0) fail_msg("%s", err);

    char *train_p = path_in(out, "bytes_train_000000.bin"), *val_p = path_in(out, "bytes_val_000000.bin");
    uint16_t *train = NULL, *val = NULL;
    int64_t n_train = 0, n_val = 0;
    assert_int_equal(shard_read(train_p, 256, &train, &n_train, err, sizeof err), 0);
    assert_int_equal(shard_read(val_p, 256, &val, &n_val, err, sizeof err), 0);
    assert_int_equal(n_train + n_val, size);
    assert_int_equal(n_val, 29986);  // floor(10% of 299,868 bytes)
    assert_int_equal(n_train, 269882);
    for (int64_t i = 0; i < n_train; i++)
        if (train[i] != bytes[i]) fail_msg("train token %lld is %u, text byte is %u", (long long)i, train[i], bytes[i]);
    for (int64_t i = 0; i < n_val; i++)
        if (val[i] != bytes[n_train + i]) fail_msg("val token %lld differs from the text's tail", (long long)i);
    assert_int_equal(data_prep_is_current(paths, 1, out), 1);

    // the stamp lists the path with its size and its FNV-1a hash (hash computed here byte by byte)
    uint64_t h = 0xcbf29ce484222325ULL;
    for (long i = 0; i < size; i++) h = (h ^ bytes[i]) * 0x100000001b3ULL;
    assert_true(h == SHAKESPEARE_FNV1A64);
    char line[1200];
    snprintf(line, sizeof line, "%ld %016llx %s\n", size, (unsigned long long)h, text);
    char *stamp_p = path_in(out, "SOURCE.txt");
    long stamp_n = 0;
    char *stamp = (char *)read_all(stamp_p, &stamp_n);
    assert_non_null(stamp);
    stamp[stamp_n] = '\0';
    assert_contains(stamp, line);
    free(stamp);

    // the loader sees the prepared splits
    DataLoader L;
    LoaderOptions o = opts(out, LOADER_VAL, 4, 64, 0, 0, 1);
    o.vocab_size = 256;
    assert_int_equal(loader_open(&L, &o, err, sizeof err), 0);
    assert_int_equal(loader_eval_targets(&L), n_val - 1);
    loader_close(&L);

    free(stamp_p);
    free(train);
    free(val);
    free(train_p);
    free(val_p);
    free(out);
    free(bytes);
}

static void test_prep_small_texts_and_stamp(void **state) {
    char *dir = *state;
    char *a = path_in(dir, "a.txt"), *b = path_in(dir, "b.txt"), *out = path_in(dir, "out");
    char err[512];
    const char *ta = "Hello, world\n";                 // 13 bytes
    const char *tb = "\x01\xff\x80 byte values\n";     // 16 bytes, including bytes >= 128
    write_bytes(a, ta, 13);
    write_bytes(b, tb, 16);
    const char *paths[2] = {a, b};
    assert_int_equal(data_prep(paths, 2, out, err, sizeof err), 0);
    // 29 bytes: val = floor(2.9) = 2 (the last two bytes of b), train = the other 27 in order
    unsigned char all[29];
    memcpy(all, ta, 13);
    memcpy(all + 13, tb, 16);
    char *train_p = path_in(out, "bytes_train_000000.bin"), *val_p = path_in(out, "bytes_val_000000.bin");
    uint16_t *train = NULL, *val = NULL;
    int64_t n_train, n_val;
    assert_int_equal(shard_read(train_p, 256, &train, &n_train, err, sizeof err), 0);
    assert_int_equal(shard_read(val_p, 256, &val, &n_val, err, sizeof err), 0);
    assert_int_equal(n_train, 27);
    assert_int_equal(n_val, 2);
    for (int i = 0; i < 27; i++) assert_int_equal(train[i], all[i]);
    assert_int_equal(val[0], all[27]);
    assert_int_equal(val[1], all[28]);
    free(train);
    free(val);
    assert_int_equal(data_prep_is_current(paths, 2, out), 1);

    // the stamp goes stale when content changes at the same size, when the order or the list changes
    const char *swapped[2] = {b, a};
    assert_int_equal(data_prep_is_current(swapped, 2, out), 0);
    assert_int_equal(data_prep_is_current(paths, 1, out), 0);
    write_bytes(a, "Hello, World\n", 13);
    assert_int_equal(data_prep_is_current(paths, 2, out), 0);
    assert_int_equal(data_prep(paths, 2, out, err, sizeof err), 0);
    assert_int_equal(data_prep_is_current(paths, 2, out), 1);
    // ... and when a shard is missing
    assert_int_equal(unlink(val_p), 0);
    assert_int_equal(data_prep_is_current(paths, 2, out), 0);

    // 5 bytes: floor(0.5) = 0, but validation keeps at least 1 byte; a stale second train shard of an
    // earlier, larger prep is removed (the loader would otherwise read it)
    write_bytes(a, "abcde", 5);
    char *stale = path_in(out, "bytes_train_000001.bin");
    uint16_t stale_tok[3] = {7, 8, 9};
    assert_int_equal(shard_write(stale, stale_tok, 3, err, sizeof err), 0);
    assert_int_equal(data_prep(paths, 1, out, err, sizeof err), 0);
    assert_int_not_equal(access(stale, F_OK), 0);
    free(stale);
    assert_int_equal(shard_open(train_p, &n_train, err, sizeof err), 0);
    assert_int_equal(shard_open(val_p, &n_val, err, sizeof err), 0);
    assert_int_equal(n_train, 4);
    assert_int_equal(n_val, 1);

    // errors: too little text, a missing file
    write_bytes(a, "x", 1);
    assert_int_equal(data_prep(paths, 1, out, err, sizeof err), -1);
    assert_contains(err, a);
    assert_contains(err, "at least 2");
    char *missing = path_in(dir, "missing.txt");
    const char *with_missing[2] = {b, missing};
    assert_int_equal(data_prep(with_missing, 2, out, err, sizeof err), -1);
    assert_contains(err, missing);
    assert_int_equal(data_prep_is_current(with_missing, 2, out), 0);
    free(missing);
    free(train_p);
    free(val_p);
    free(a);
    free(b);
    free(out);
}

static void test_default_text(void **state) {
    char *dir = *state;
    char err[512];
    int n = -1;
    assert_null(data_default_text_in(dir, &n, err, sizeof err));
    assert_int_equal(n, 0);
    assert_contains(err, "apt-get install fortunes");
    assert_contains(err, dir);

    // only plain files named like the package's English files count: not .dat/.u8, not off/, not others
    const char *names[] = {"zippy", "art", "art.dat", "art.u8", "bofh-excuses", "science"};
    for (int i = 0; i < 6; i++) {
        char *p = path_in(dir, names[i]);
        write_bytes(p, "x\n%\n", 4);
        free(p);
    }
    char *off = path_in(dir, "off");
    assert_int_equal(mkdir(off, 0700), 0);
    char *off_art = path_in(off, "art");
    write_bytes(off_art, "x\n", 2);
    const char *const *paths = data_default_text_in(dir, &n, err, sizeof err);
    assert_non_null(paths);
    assert_int_equal(n, 3);
    const char *want[] = {"art", "science", "zippy"};
    for (int i = 0; i < 3; i++) {
        char *p = path_in(dir, want[i]);
        assert_string_equal(paths[i], p);
        free(p);
    }
    free(off_art);
    free(off);

    // on this machine: whatever is installed is sorted and readable
    paths = data_default_text(&n);
    for (int i = 0; i < n; i++) {
        assert_int_equal(access(paths[i], R_OK), 0);
        if (i > 0) assert_true(strcmp(paths[i - 1], paths[i]) < 0);
    }
}

// ---------------------------------------------------------------------------- loader: train order
// shards of 203 and 150 tokens, T = 8: floor(202/8) + floor(149/8) = 25 + 18 = 43 windows
static const int64_t train_sizes[2] = {203, 150};
enum { TT = 8, TB = 4, TW = 43 };

static void collect(DataLoader *L, int n_batches, int B, int T, int *out) {
    for (int i = 0; i < n_batches; i++) assert_int_equal(loader_next(L, out + (size_t)i * B * (T + 1)), 0);
}

static void test_loader_determinism_and_epochs(void **state) {
    char *dir = *state;
    char err[512];
    Corpus c;
    corpus_make(&c, dir, "tiny", "train", train_sizes, 2, 77);
    char *decoy = path_in(dir, "notes.txt");  // files outside the pattern are ignored
    write_bytes(decoy, "hello", 5);
    free(decoy);
    int64_t starts[64];
    assert_int_equal(expected_windows(&c, TT, starts), TW);

    enum { NB = 30 };  // 120 rows: almost three epochs of 43
    static int a[NB * TB * (TT + 1)], b[NB * TB * (TT + 1)], d[NB * TB * (TT + 1)];
    DataLoader L1, L2, L3;
    LoaderOptions o = opts(dir, LOADER_TRAIN, TB, TT, 1234, 0, 1);
    assert_int_equal(loader_open(&L1, &o, err, sizeof err), 0);
    assert_int_equal(loader_open(&L2, &o, err, sizeof err), 0);
    o.seed = 1235;
    assert_int_equal(loader_open(&L3, &o, err, sizeof err), 0);
    assert_int_equal(L1.n_windows, TW);
    assert_int_equal(loader_num_batches(&L1), TW / TB);
    collect(&L1, NB, TB, TT, a);
    collect(&L2, NB, TB, TT, b);
    collect(&L3, NB, TB, TT, d);
    assert_memory_equal(a, b, sizeof a);      // same seed, same batches
    assert_memory_not_equal(a, d, sizeof a);  // another seed, another order

    // every row is a valid window; each epoch (rows 43e .. 43e+42) visits each window exactly once,
    // even where an epoch ends inside a micro-batch; consecutive epochs use different orders
    int64_t seen[2][TW];
    for (int e = 0; e < 2; e++)
        for (int r = 0; r < TW; r++) seen[e][r] = row_window(&c, a + (size_t)(e * TW + r) * (TT + 1), TT);
    assert_memory_not_equal(seen[0], seen[1], sizeof seen[0]);
    int ascending = 1;  // epoch 0 is shuffled too, not the windows in file order
    for (int r = 1; r < TW; r++) ascending &= seen[0][r - 1] < seen[0][r];
    assert_false(ascending);
    for (int e = 0; e < 2; e++) {
        qsort(seen[e], TW, sizeof(int64_t), cmp_i64);
        assert_memory_equal(seen[e], starts, sizeof seen[e]);
    }
    for (int r = 2 * TW; r < NB * TB; r++) row_window(&c, a + (size_t)r * (TT + 1), TT);
    // 120 rows = 2 epochs + 34 windows
    LoaderCursor cur = loader_get_cursor(&L1);
    assert_int_equal(cur.epoch, 2);
    assert_int_equal(cur.position, 120 - 2 * TW);
    loader_close(&L1);
    loader_close(&L2);
    loader_close(&L3);
    corpus_free(&c);
}

static void test_loader_dp_sharding(void **state) {
    char *dir = *state;
    char err[512];
    // 44 windows (25 + 19): dp = 2 splits an epoch evenly
    const int64_t sizes[2] = {203, 153};
    Corpus c;
    corpus_make(&c, dir, "tiny", "train", sizes, 2, 99);
    int64_t starts[64];
    const int W = (int)expected_windows(&c, TT, starts);
    assert_int_equal(W, 44);
    enum { B = 2 };
    static int one[44 * (TT + 1)], r0[22 * (TT + 1)], r1[22 * (TT + 1)];
    DataLoader L, L0, L1;
    LoaderOptions o = opts(dir, LOADER_TRAIN, B, TT, 42, 0, 1);
    assert_int_equal(loader_open(&L, &o, err, sizeof err), 0);
    o.dp_size = 2;
    assert_int_equal(loader_open(&L0, &o, err, sizeof err), 0);
    o.dp_rank = 1;
    assert_int_equal(loader_open(&L1, &o, err, sizeof err), 0);
    assert_int_equal(loader_num_batches(&L0), 11);
    collect(&L, 22, B, TT, one);
    collect(&L0, 11, B, TT, r0);
    collect(&L1, 11, B, TT, r1);
    int64_t w0[22], w1[22], all[44], both[44];
    for (int i = 0; i < 22; i++) {
        w0[i] = row_window(&c, r0 + (size_t)i * (TT + 1), TT);
        w1[i] = row_window(&c, r1 + (size_t)i * (TT + 1), TT);
        both[i] = w0[i];
        both[22 + i] = w1[i];
    }
    for (int i = 0; i < 44; i++) all[i] = row_window(&c, one + (size_t)i * (TT + 1), TT);
    // micro-batch i of rank r is entries [(2i + r) B, (2i + r) B + B) of the same epoch order: the one-process
    // micro-batch 2i + r
    for (int i = 0; i < 11; i++)
        for (int b = 0; b < B; b++) {
            assert_int_equal(w0[i * B + b], all[(2 * i) * B + b]);
            assert_int_equal(w1[i * B + b], all[(2 * i + 1) * B + b]);
        }
    // disjoint, and together exactly the dp = 1 epoch's set (= every window)
    qsort(both, 44, sizeof(int64_t), cmp_i64);
    for (int i = 1; i < 44; i++) assert_true(both[i - 1] < both[i]);
    qsort(all, 44, sizeof(int64_t), cmp_i64);
    assert_memory_equal(both, all, sizeof all);
    assert_memory_equal(all, starts, sizeof all);
    // both ranks roll into epoch 1 together
    assert_int_equal(loader_get_cursor(&L0).epoch, 1);
    assert_int_equal(loader_get_cursor(&L1).epoch, 1);
    assert_int_equal(loader_get_cursor(&L0).position, 0);
    loader_close(&L);
    loader_close(&L0);
    loader_close(&L1);

    // dp = 3 with 44 windows: 14 per rank per epoch, 2 windows skipped, ranks never overlap
    int64_t seen[42];
    for (int r = 0; r < 3; r++) {
        LoaderOptions o3 = opts(dir, LOADER_TRAIN, 7, TT, 42, r, 3);
        DataLoader L3;
        assert_int_equal(loader_open(&L3, &o3, err, sizeof err), 0);
        static int rows[14 * (TT + 1)];
        collect(&L3, 2, 7, TT, rows);
        for (int i = 0; i < 14; i++) seen[r * 14 + i] = row_window(&c, rows + (size_t)i * (TT + 1), TT);
        assert_int_equal(loader_get_cursor(&L3).epoch, 1);
        loader_close(&L3);
    }
    qsort(seen, 42, sizeof(int64_t), cmp_i64);
    for (int i = 1; i < 42; i++) assert_true(seen[i - 1] < seen[i]);
    corpus_free(&c);
}

static void test_loader_cursor_resume(void **state) {
    char *dir = *state;
    char err[512];
    Corpus c;
    corpus_make(&c, dir, "tiny", "train", train_sizes, 2, 31);
    enum { B = 3, N = 25 };
    static int ref[N * B * (TT + 1)], got[N * B * (TT + 1)];
    for (int stop = 0; stop < N; stop += 6) {  // resume points inside epochs 0 and 1
        DataLoader A, R;
        LoaderOptions o = opts(dir, LOADER_TRAIN, B, TT, 7, 1, 2);
        assert_int_equal(loader_open(&A, &o, err, sizeof err), 0);
        collect(&A, N, B, TT, ref);
        loader_close(&A);
        assert_int_equal(loader_open(&A, &o, err, sizeof err), 0);
        collect(&A, stop, B, TT, got);
        LoaderCursor cur = loader_get_cursor(&A);
        loader_close(&A);
        assert_int_equal(loader_open(&R, &o, err, sizeof err), 0);  // a fresh process, as after a restart
        assert_int_equal(loader_set_cursor(&R, cur, err, sizeof err), 0);
        collect(&R, N - stop, B, TT, got + (size_t)stop * B * (TT + 1));
        assert_memory_equal(got, ref, sizeof ref);
        loader_close(&R);
    }
    // a cursor that does not fit: odd position with dp = 2, and past the epoch (21 entries per rank)
    DataLoader R;
    LoaderOptions o = opts(dir, LOADER_TRAIN, B, TT, 7, 0, 2);
    assert_int_equal(loader_open(&R, &o, err, sizeof err), 0);
    LoaderCursor bad = {0, 3};
    assert_int_equal(loader_set_cursor(&R, bad, err, sizeof err), -1);
    assert_contains(err, dir);
    bad.position = 42;
    assert_int_equal(loader_set_cursor(&R, bad, err, sizeof err), -1);
    assert_contains(err, "42");
    loader_close(&R);
    corpus_free(&c);
}

// ---------------------------------------------------------------------------- loader: validation
static void test_loader_validation_pass(void **state) {
    char *dir = *state;
    char err[512];
    // T = 8. Shard: targets, eval windows, full windows:
    //   50: 49, 7 (6 full + one of 2 tokens, i.e. 1 target), 6    17: 16, 2, 2 (no short window)
    //    1: 0, 0, 0 (nothing to predict)   9: 8, 1, 1   12: 11, 2, 1   3: 2, 1, 0
    // totals: 86 targets, 13 eval windows, 10 full windows. Six shards, so that the directory's own
    // order (readdir) is unlikely to be the sorted one.
    const int64_t sizes[6] = {50, 17, 1, 9, 12, 3};
    Corpus c;
    corpus_make(&c, dir, "v", "val", sizes, 6, 5);
    const int T = TT;
    for (int dp = 1; dp <= 2; dp++) {
        for (int B = 1; B <= 3; B += 2) {
            int hits[92] = {0};
            int64_t total = 0;
            for (int r = 0; r < dp; r++) {
                DataLoader L;
                LoaderOptions o = opts(dir, LOADER_VAL, B, T, 0, r, dp);
                assert_int_equal(loader_open(&L, &o, err, sizeof err), 0);
                assert_int_equal(loader_eval_windows(&L), 13);
                assert_int_equal(loader_eval_targets(&L), 86);
                assert_int_equal(loader_eval_batches(&L), (13 + dp * B - 1) / (dp * B));
                assert_int_equal(loader_num_batches(&L), 10 / (dp * B));  // full windows only
                int tokens[3 * (TT + 1)], labels[3 * (TT + 1)];
                int64_t nt, batches = 0;
                int first[3 * (TT + 1)];
                for (int pass = 0; pass < 2; pass++) {  // loader_reset starts the same pass over
                    batches = 0;
                    while (loader_next_eval(&L, tokens, labels, &nt)) {
                        if (batches == 0 && pass == 0) memcpy(first, labels, sizeof first);
                        if (batches == 0 && pass == 1) assert_memory_equal(first, labels, sizeof(int) * B * (T + 1));
                        int64_t counted = 0;
                        for (int b = 0; b < B; b++) {
                            const int *trow = tokens + b * (T + 1), *lrow = labels + b * (T + 1);
                            int len = 0;
                            while (len <= T && lrow[len] != -1) len++;
                            for (int t = len; t <= T; t++) {  // padding: label -1, token 0
                                assert_int_equal(lrow[t], -1);
                                assert_int_equal(trow[t], 0);
                            }
                            if (len == 0) continue;
                            assert_true(len >= 2);
                            int64_t g = c.pos_of[lrow[0]];
                            for (int t = 0; t < len; t++) {  // consecutive tokens of one shard
                                assert_int_equal(trow[t], lrow[t]);
                                assert_int_equal(lrow[t], c.tokens[g + t]);
                            }
                            for (int t = 1; t < len; t++) {
                                if (pass == 0) hits[g + t]++;
                                counted++;
                            }
                        }
                        assert_int_equal(nt, counted);
                        if (pass == 0) total += nt;
                        batches++;
                    }
                    assert_int_equal(batches, loader_eval_batches(&L));
                    loader_reset(&L);
                }
                loader_close(&L);
            }
            // each token except the first of each shard is a target exactly once, over all ranks
            assert_int_equal(total, 86);
            for (int s = 0; s < 6; s++)
                for (int64_t p = 0; p < sizes[s]; p++) assert_int_equal(hits[c.base[s] + p], p == 0 ? 0 : 1);
        }
    }
    // loader_next on VAL: the 10 full windows in shard-name order (global starts: shard bases 0, 50,
    // 67, 68, 77 plus multiples of 8), then wrapping to the first again
    DataLoader L;
    LoaderOptions o = opts(dir, LOADER_VAL, 3, T, 0, 0, 1);
    assert_int_equal(loader_open(&L, &o, err, sizeof err), 0);
    const int64_t want[12] = {0, 8, 16, 24, 32, 40, 50, 58, 68, 77, 0, 8};
    int rows[12 * (TT + 1)];
    collect(&L, 4, 3, T, rows);
    for (int i = 0; i < 12; i++) assert_int_equal(row_window(&c, rows + i * (T + 1), T), want[i]);
    loader_close(&L);
    corpus_free(&c);
}

// ---------------------------------------------------------------------------- durable files
static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}
static void assert_file_text(const char *path, const char *text) {
    long n = 0;
    unsigned char *got = read_all(path, &n);
    assert_int_equal(n, (long)strlen(text));
    assert_memory_equal(got, text, (size_t)n);
    free(got);
}

// A durable write leaves the new content and nothing else; a discarded one, or one whose writes failed,
// leaves the old content and nothing else; the errors name the file and the system's reason.
static void test_durable_file(void **state) {
    char *dir = *state;
    char err[512];
    char *p = path_in(dir, "out.txt");
    assert_int_equal(durable_write_text(p, "old text\n", err, sizeof err), 0);
    assert_file_text(p, "old text\n");
    assert_int_equal(count_entries(dir), 1);

    DurableFile d;
    assert_int_equal(durable_open(&d, p, err, sizeof err), 0);
    fprintf(d.f, "new %d\n", 42);
    assert_int_equal(count_entries(dir), 2);  // the temporary file, beside the old one
    durable_discard(&d);
    assert_file_text(p, "old text\n");
    assert_int_equal(count_entries(dir), 1);

    assert_int_equal(durable_open(&d, p, err, sizeof err), 0);
    fprintf(d.f, "new %d\n", 42);
    assert_int_equal(durable_commit(&d, err, sizeof err), 0);
    assert_file_text(p, "new 42\n");
    assert_int_equal(count_entries(dir), 1);

    // a write that fails: files limited to 4 KiB (EFBIG instead of SIGXFSZ), 64 KiB written
    struct rlimit old_limit, small = {4096, 4096};
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    small.rlim_max = old_limit.rlim_max;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(durable_open(&d, p, err, sizeof err), 0);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    for (int i = 0; i < 64 * 1024 / 16; i++) fputs("0123456789abcde\n", d.f);
    const int rc = durable_commit(&d, err, sizeof err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old_limit), 0);
    signal(SIGXFSZ, old_handler);
    assert_int_equal(rc, -1);
    assert_contains(err, p);
    assert_contains(err, strerror(EFBIG));
    assert_file_text(p, "new 42\n");
    assert_int_equal(count_entries(dir), 1);

    char *missing = path_in(dir, "no/such/dir/out.txt");
    assert_int_equal(durable_write_text(missing, "x", err, sizeof err), -1);
    assert_contains(err, "no/such/dir/out.txt");
    assert_contains(err, strerror(ENOENT));
    assert_int_equal(count_entries(dir), 1);
    free(missing);
    free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_shard_roundtrip_gpt2_vocab, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_shard_errors_name_the_file, setup_dir, teardown_dir),
        cmocka_unit_test(test_fnv1a64_vectors),
        cmocka_unit_test_setup_teardown(test_durable_file, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_prep_shakespeare, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_prep_small_texts_and_stamp, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_default_text, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_determinism_and_epochs, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_dp_sharding, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_cursor_resume, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_validation_pass, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
