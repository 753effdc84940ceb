/*
 * test_shards.c - integrity of prepared data (issue 17): text inputs that are not regular files are
 * refused instead of read forever, and shards whose content changed at the same size are caught by
 * the checksums of the SOURCE.txt stamp, both when a prepared directory is reused (it is prepared
 * again, saying why) and when the loader opens shards given as they are (an error naming the shard).
 *
 * References are independent of the code under test: the shard checksum is FNV-1a 64 computed here
 * byte by byte over the file as read from disk, and corruption is made by rewriting single bytes of
 * a shard in place (same size, valid header). Every file lives in a mkdtemp directory under /tmp.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/loader.h"
#include "data/prep.h"
#include "data/shard.h"

// ---------------------------------------------------------------------------- helpers
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}
static int setup_dir(void **state) {
    char *dir = strdup("/tmp/fp8moe_test_shards_XXXXXX");
    if (!dir || !mkdtemp(dir)) return -1;
    *state = dir;
    return 0;
}
static int teardown_dir(void **state) {
    nftw(*state, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(*state);
    return 0;
}

static char *path_in(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

// The whole file, NUL-terminated (so a text file can be searched); *n = its size.
static unsigned char *read_all(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)size + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    buf[size] = '\0';
    *n = size;
    return buf;
}

// Rewrites byte `offset` of the file in place as its value + 1 (the size does not change).
static void flip_byte(const char *path, long offset) {
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, offset), 1);
    b = (unsigned char)(b + 1);
    assert_int_equal(pwrite(fd, &b, 1, offset), 1);
    assert_int_equal(close(fd), 0);
}

// FNV-1a 64 of the file's bytes, byte by byte (the reference for the stamp's shard checksum).
static uint64_t file_fnv1a64(const char *path) {
    long n = 0;
    unsigned char *b = read_all(path, &n);
    assert_non_null(b);
    uint64_t h = 0xcbf29ce484222325ULL;
    for (long i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    free(b);
    return h;
}

static void assert_contains(const char *text, const char *part) {
    if (!strstr(text, part)) fail_msg("expected \"%s\" in: %s", part, text);
}

// A 3000-byte text of printable bytes (so every token is below 128), prepared into dir/out.
static char *prep_text(const char *dir, char **text_path) {
    char text[3000];
    uint64_t s = 12345;
    for (size_t i = 0; i < sizeof text; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        text[i] = (char)(32 + (s >> 33) % 95);
    }
    *text_path = path_in(dir, "text.txt");
    write_bytes(*text_path, text, sizeof text);
    char *out = path_in(dir, "out"), err[512];
    const char *paths[1] = {*text_path};
    if (data_prep(paths, 1, out, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(data_prep_is_current(paths, 1, out), 1);
    return out;
}

// ---------------------------------------------------------------------------- the stamp's checksums

// SOURCE.txt lists each shard with the FNV-1a 64 of its file.
static void test_stamp_lists_shard_checksums(void **state) {
    char *text, *out = prep_text(*state, &text);
    char *stamp_p = path_in(out, DATA_PREP_STAMP), *train_p = path_in(out, "bytes_train_000000.bin"),
         *val_p = path_in(out, "bytes_val_000000.bin");
    long n = 0;
    char *stamp = (char *)read_all(stamp_p, &n);
    assert_non_null(stamp);
    char line[128];
    snprintf(line, sizeof line, "\nshard %016" PRIx64 " bytes_train_000000.bin\n", file_fnv1a64(train_p));
    assert_contains(stamp, line);
    snprintf(line, sizeof line, "\nshard %016" PRIx64 " bytes_val_000000.bin\n", file_fnv1a64(val_p));
    assert_contains(stamp, line);
    free(stamp);
    free(stamp_p);
    free(train_p);
    free(val_p);
    free(out);
    free(text);
}

// A token byte of the training shard changes at the same size: the directory is no longer current,
// the reason names the shard, and preparing again restores the text's bytes.
static void test_corrupt_shard_is_prepared_again(void **state) {
    char *text, *out = prep_text(*state, &text);
    const char *paths[1] = {text};
    char *train_p = path_in(out, "bytes_train_000000.bin");
    long token = 100, offset = SHARD_HEADER_BYTES + 2 * token;  // low byte of token 100
    flip_byte(train_p, offset);
    assert_int_equal(data_prep_is_current(paths, 1, out), 0);
    char why[512] = "";
    assert_int_equal(data_prep_check(paths, 1, out, why, sizeof why), 0);
    assert_contains(why, train_p);
    assert_contains(why, "checksum");
    char err[512];
    if (data_prep(paths, 1, out, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(data_prep_check(paths, 1, out, why, sizeof why), 1);
    assert_string_equal(why, "");
    uint16_t *tok = NULL;
    int64_t n = 0;
    assert_int_equal(shard_read(train_p, 256, &tok, &n, err, sizeof err), 0);
    long text_n = 0;
    unsigned char *bytes = read_all(text, &text_n);
    assert_int_equal(tok[token], bytes[token]);
    free(bytes);
    free(tok);
    free(train_p);
    free(out);
    free(text);
}

// The unused part of a validation shard's header changes (the loader ignores it, a checksum does not).
static void test_corrupt_header_is_prepared_again(void **state) {
    char *text, *out = prep_text(*state, &text);
    const char *paths[1] = {text};
    char *val_p = path_in(out, "bytes_val_000000.bin");
    flip_byte(val_p, 4 * 100);  // header[100], which must be 0
    char why[512] = "";
    assert_int_equal(data_prep_check(paths, 1, out, why, sizeof why), 0);
    assert_contains(why, val_p);
    assert_int_equal(data_prep_is_current(paths, 1, out), 0);
    free(val_p);
    free(out);
    free(text);
}

// A stamp written before shards had checksums is not taken as current (the shards are prepared once
// more, with checksums), and a reason says so.
static void test_stamp_without_checksums_is_not_current(void **state) {
    char *text, *out = prep_text(*state, &text);
    const char *paths[1] = {text};
    char *stamp_p = path_in(out, DATA_PREP_STAMP);
    long n = 0;
    char *stamp = (char *)read_all(stamp_p, &n);
    char *cut = strstr(stamp, "\n# shards");
    assert_non_null(cut);
    write_bytes(stamp_p, stamp, (size_t)(cut - stamp + 1));
    char why[512] = "";
    assert_int_equal(data_prep_check(paths, 1, out, why, sizeof why), 0);
    assert_contains(why, stamp_p);
    free(stamp);
    free(stamp_p);
    free(out);
    free(text);
}

// data.shards = a prepared directory, used as it is: the loader checks the shards against the stamp
// and names the corrupted one; the untouched split still loads.
static void test_loader_refuses_corrupt_shard(void **state) {
    char *text, *out = prep_text(*state, &text);
    char *train_p = path_in(out, "bytes_train_000000.bin"), err[1024] = "";
    flip_byte(train_p, SHARD_HEADER_BYTES + 2 * 7);
    DataLoader L;
    LoaderOptions o = {.dir = out, .split = LOADER_TRAIN, .vocab_size = 256, .B = 1, .T = 8, .seed = 1,
                       .dp_rank = 0, .dp_size = 1};
    assert_int_equal(loader_open(&L, &o, err, sizeof err), -1);
    assert_contains(err, train_p);
    assert_contains(err, "checksum");
    assert_contains(err, DATA_PREP_STAMP);
    o.split = LOADER_VAL;
    if (loader_open(&L, &o, err, sizeof err) != 0) fail_msg("%s", err);
    loader_close(&L);
    free(train_p);
    free(out);
    free(text);
}

// Shards without a stamp (llm.c's own, or made by hand) have no checksum to check and load as before.
static void test_loader_without_stamp(void **state) {
    char *dir = *state, err[512];
    uint16_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (uint16_t)(i * 7 % 256);
    char *train_p = path_in(dir, "x_train_000000.bin");
    assert_int_equal(shard_write(train_p, tok, 40, err, sizeof err), 0);
    DataLoader L;
    LoaderOptions o = {.dir = dir, .split = LOADER_TRAIN, .vocab_size = 256, .B = 1, .T = 8, .seed = 1,
                       .dp_rank = 0, .dp_size = 1};
    if (loader_open(&L, &o, err, sizeof err) != 0) fail_msg("%s", err);
    loader_close(&L);
    free(train_p);
}

// ---------------------------------------------------------------------------- text that is not a file

// data.text = /dev/zero used to hash an endless file forever; a FIFO would block in open. The
// alarm turns a hang into a failure.
static void test_text_must_be_regular_file(void **state) {
    char *dir = *state, err[512] = "";
    char *fifo = path_in(dir, "fifo"), *sub = path_in(dir, "subdir"), *out = path_in(dir, "out");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(mkdir(sub, 0700), 0);
    const char *cases[3][2] = {{"/dev/zero", "character device"}, {fifo, "FIFO"}, {sub, "directory"}};
    alarm(20);
    for (int i = 0; i < 3; i++) {
        const char *paths[1] = {cases[i][0]};
        assert_int_equal(data_prep_is_current(paths, 1, out), 0);
        assert_int_equal(data_prep(paths, 1, out, err, sizeof err), -1);
        assert_contains(err, cases[i][0]);
        assert_contains(err, "not a regular file");
        assert_contains(err, cases[i][1]);
    }
    alarm(0);
    free(fifo);
    free(sub);
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_stamp_lists_shard_checksums, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_corrupt_shard_is_prepared_again, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_corrupt_header_is_prepared_again, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_stamp_without_checksums_is_not_current, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_refuses_corrupt_shard, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_loader_without_stamp, setup_dir, teardown_dir),
        cmocka_unit_test_setup_teardown(test_text_must_be_regular_file, setup_dir, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
