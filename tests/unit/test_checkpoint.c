/*
 * test_checkpoint.c - resumable checkpoints in one process (train/checkpoint.c, issue 21).
 *
 * The reference for a resume is the run itself: configs/tiny.ini on tests/data/shakespeare.txt trains 10 steps,
 * saves, trains on to step 20; a fresh state loads the checkpoint and trains 10 steps, and every step's numbers
 * (loss, MTP loss, balance loss, gradient norm: the bits of the doubles, printed in hex) and, at the end, the
 * weights, moments and router biases must equal those of the uninterrupted run bit for bit, in fp32 and fp8 mode.
 * Broken checkpoints are made by editing a good one: a byte flipped inside a dataset's chunk (found with
 * H5Dget_chunk_info) or inside a dataset's object header, a rank file removed, a model config changed. The
 * directory rules: keep_last pruning, DIR/latest naming the newest complete checkpoint, a partial .tmp
 * directory that a load never reads and the next save removes, a full disk (a small tmpfs, where the machine
 * lets root mount one) that fails the save and keeps the previous checkpoint.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "train/checkpoint.h"
#include "train/config.h"
#include "train/step.h"
#include "train/train_state.h"

static char g_root[128];   // this run's temporary directory
static char g_cache[192];  // data.cache_dir, shared by the tests (prepared once)
static char err[4096];

// ---------------------------------------------------------------------------- helpers

// configs/tiny.ini on the test text, CPU, 20 steps, plus up to 4 more overrides.
static void load_config(Config *cfg, const char *mode, const char *const *more, int n_more) {
    char o[4][CONFIG_PATH_MAX + 32];
    snprintf(o[0], sizeof o[0], "precision.mode=%s", mode);
    snprintf(o[1], sizeof o[1], "data.text=tests/data/shakespeare.txt");
    snprintf(o[2], sizeof o[2], "data.cache_dir=%s", g_cache);
    snprintf(o[3], sizeof o[3], "train.device=cpu");
    const char *ov[10] = {o[0], o[1], o[2], o[3], "checkpoint.save_weights=false", "train.steps=20"};
    for (int i = 0; i < n_more; i++) ov[6 + i] = more[i];
    char cerr[2048];
    if (config_load(cfg, "configs/tiny.ini", ov, 6 + n_more, cerr, sizeof cerr) != 0) fail_msg("%s", cerr);
}

static void make_state(TrainState *ts, const Config *cfg) {
    if (train_state_create(ts, cfg, DEVICE_CPU, NULL, 20, 0, err, sizeof err) != 0) fail_msg("%s", err);
    model_zero_load(&ts->model);
}

// n steps of ts into out[0..n).
static void train(TrainState *ts, int n, StepResult *out) {
    for (int s = 0; s < n; s++)
        if (train_step(ts, &out[s], err, sizeof err) != 0) fail_msg("step %d: %s", ts->step + 1, err);
}

static uint64_t bits(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static void ck_dir(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", g_root, name);
}

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

// The names in dir, sorted, joined by spaces.
static void listing(const char *dir, char *out, size_t size) {
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort);
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (list[i]->d_name[0] != '.')
            snprintf(out + strlen(out), size - strlen(out), "%s%s", out[0] ? " " : "", list[i]->d_name);
        free(list[i]);
    }
    if (n >= 0) free(list);
}

// The one rank file of a one-process checkpoint.
static void rank_file(const char *ck, char *out, size_t size) {
    snprintf(out, size, "%s/rank00000-stage0-dp0-ep0.h5", ck);
}

// Flips one byte of file at offset.
static void flip_byte(const char *path, long long offset) {
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char c;
    assert_int_equal(pread(fd, &c, 1, offset), 1);
    c ^= 0x5a;
    assert_int_equal(pwrite(fd, &c, 1, offset), 1);
    close(fd);
}

// The file offset of a byte inside the first chunk of dataset `name` (its stored data, which Fletcher32 covers).
static long long chunk_byte(const char *path, const char *name) {
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    assert_true(d >= 0);
    hsize_t offset[3], size = 0;
    haddr_t addr = 0;
    unsigned mask = 0;
    hid_t space = H5Dget_space(d);
    assert_true(space >= 0);
    assert_true(H5Dget_chunk_info(d, space, 0, offset, &mask, &addr, &size) >= 0);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
    assert_true(size > 8);
    return (long long)addr + (long long)size / 3;
}

// The file offset of a byte inside the object header of dataset `name` (metadata with a checksum).
static long long header_byte(const char *path, const char *name) {
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    H5O_info_t info;
    assert_true(H5Oget_info_by_name2(f, name, &info, H5O_INFO_BASIC | H5O_INFO_HDR, H5P_DEFAULT) >= 0);
    H5Fclose(f);
    assert_true(info.hdr.space.total > 40);
    return (long long)info.addr + (long long)info.hdr.space.total / 2;
}

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    assert_non_null(a);
    assert_non_null(b);
    char buf[65536];
    for (size_t n; (n = fread(buf, 1, sizeof buf, a)) > 0;) assert_int_equal(fwrite(buf, 1, n, b), n);
    fclose(a);
    assert_int_equal(fclose(b), 0);
}

static void remove_dir(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

// A fresh state of the same config must fail to load ck with a message holding every one of `want`.
// in_child: the load runs in a forked child that passes its message back through a pipe and leaves with _exit.
// For an object header that fails its checksum: HDF5 1.10.8 then leaks the header it was decoding (424 bytes
// from H5O_protect in H5Dopen2), and at exit prints "HDF5: infinite loop closing library" and LeakSanitizer
// fails the run; the child's _exit skips both, and the parent checks the message. (The load runs no OpenMP
// region, so forking after training steps is safe.)
static void expect_load_error_how(const Config *cfg, const char *ck, const char *const *want, int n_want,
                                  int in_child) {
    TrainState ts;
    make_state(&ts, cfg);
    err[0] = '\0';
    int rc;
    if (!in_child) rc = checkpoint_load(&ts, NULL, ck, err, sizeof err);
    else {
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        fflush(stdout);
        const pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(fds[0]);
            const int child_rc = checkpoint_load(&ts, NULL, ck, err, sizeof err);
            const ssize_t w = write(fds[1], err, strlen(err) + 1);
            _exit(child_rc != 0 && w > 0 ? 1 : 0);
        }
        close(fds[1]);
        size_t got = 0;
        for (ssize_t n; got < sizeof err - 1 && (n = read(fds[0], err + got, sizeof err - 1 - got)) > 0;) got += (size_t)n;
        err[got] = '\0';
        close(fds[0]);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        rc = WIFEXITED(status) && WEXITSTATUS(status) == 1 ? -1 : 0;
    }
    train_state_free(&ts);
    if (rc == 0) fail_msg("loading %s succeeded, expected an error", ck);
    printf("expected error: %s\n", err);
    for (int i = 0; i < n_want; i++)
        if (!strstr(err, want[i])) fail_msg("the error does not name \"%s\": %s", want[i], err);
}

static void expect_load_error(const Config *cfg, const char *ck, const char *const *want, int n_want) {
    expect_load_error_how(cfg, ck, want, n_want, 0);
}

// ---------------------------------------------------------------------------- bitwise resume

static void resume_bitwise(const char *mode) {
    Config cfg;
    load_config(&cfg, mode, NULL, 0);
    char dir[256];
    ck_dir(dir, sizeof dir, mode);
    TrainState a, b;
    StepResult ra[20], rb[10];
    make_state(&a, &cfg);
    train(&a, 10, ra);
    if (checkpoint_save(&a, NULL, dir, 3, err, sizeof err) != 0) fail_msg("%s", err);
    train(&a, 10, ra + 10);

    make_state(&b, &cfg);
    if (checkpoint_load(&b, NULL, dir, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(b.step, 10);
    train(&b, 10, rb);
    int differ = 0;
    for (int s = 0; s < 10; s++) {
        const StepResult *x = &ra[10 + s], *y = &rb[s];
        const int same = bits(x->loss) == bits(y->loss) && bits(x->mtp) == bits(y->mtp) &&
                         bits(x->balance) == bits(y->balance) && bits(x->grad_norm) == bits(y->grad_norm) &&
                         bits(x->lr) == bits(y->lr);
        printf("%s step %2d: loss %016llx (%.9f) resumed %016llx%s\n", mode, 11 + s, (unsigned long long)bits(x->loss),
               x->loss, (unsigned long long)bits(y->loss), same ? "" : "  DIFFERENT");
        differ += !same;
    }
    assert_int_equal(differ, 0);
    const Model *ma = &a.model, *mb = &b.model;
    const size_t n = (size_t)(ma->n_dense_elems + ma->n_expert_elems);
    assert_memory_equal(ma->weights, mb->weights, n * sizeof(real));
    assert_memory_equal(ma->router_bias, mb->router_bias,
                        (size_t)ma->n_moe_layers * cfg.moe.n_routed_experts * sizeof(real));
    for (int k = 0; k < 2; k++) {
        assert_memory_equal(a.regions[k].opt.m, b.regions[k].opt.m, (size_t)a.regions[k].n * sizeof(uint16_t));
        assert_memory_equal(a.regions[k].opt.v, b.regions[k].opt.v, (size_t)a.regions[k].n * sizeof(uint16_t));
    }
    LoaderCursor ca = loader_get_cursor(&a.train), cb = loader_get_cursor(&b.train);
    assert_true(ca.epoch == cb.epoch && ca.position == cb.position);
    train_state_free(&a);
    train_state_free(&b);
}

static void test_resume_bitwise_fp32(void **state) {
    (void)state;
    resume_bitwise("fp32");
}

static void test_resume_bitwise_fp8(void **state) {
    (void)state;
    resume_bitwise("fp8");
}

// ---------------------------------------------------------------------------- broken checkpoints

// A checkpoint after 2 steps in DIR/name; its step directory into ck.
static void small_checkpoint(const char *name, char *ck, size_t ck_size, Config *cfg) {
    load_config(cfg, "fp32", NULL, 0);
    char dir[256];
    ck_dir(dir, sizeof dir, name);
    TrainState ts;
    StepResult r[2];
    make_state(&ts, cfg);
    train(&ts, 2, r);
    if (checkpoint_save(&ts, NULL, dir, 0, err, sizeof err) != 0) fail_msg("%s", err);
    train_state_free(&ts);
    snprintf(ck, ck_size, "%s/step_00000002", dir);
}

static void test_flipped_byte(void **state) {
    (void)state;
    Config cfg;
    char ck[320], file[400], manifest[400];
    const char *const cases[][2] = {{"weights/layers.1.ffn.experts.3.w1.weight", "layers.1.ffn.experts.3.w1.weight"},
                                    {"adam_v/head.weight", "head.weight"},
                                    {"router_bias/layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias"}};
    for (int c = 0; c < 3; c++) {
        small_checkpoint("flip", ck, sizeof ck, &cfg);
        rank_file(ck, file, sizeof file);
        flip_byte(file, chunk_byte(file, cases[c][0]));
        const char *want[] = {file, cases[c][1], "Fletcher32"};
        expect_load_error(&cfg, ck, want, 3);
    }
    // metadata: a dataset's object header (HDF5 1.8 format headers carry a checksum)
    small_checkpoint("flip", ck, sizeof ck, &cfg);
    rank_file(ck, file, sizeof file);
    flip_byte(file, header_byte(file, "weights/layers.0.attn.wkv_b.weight"));
    const char *want_header[] = {file, "layers.0.attn.wkv_b.weight", "checksum"};
    expect_load_error_how(&cfg, ck, want_header, 3, 1);
    // the manifest's table of files
    small_checkpoint("flip", ck, sizeof ck, &cfg);
    snprintf(manifest, sizeof manifest, "%s/%s", ck, CHECKPOINT_MANIFEST);
    flip_byte(manifest, chunk_byte(manifest, "files"));
    const char *want_manifest[] = {manifest, "files", "Fletcher32"};
    expect_load_error(&cfg, ck, want_manifest, 3);
}

static void test_missing_shard(void **state) {
    (void)state;
    Config cfg;
    char ck[320], file[400];
    small_checkpoint("missing", ck, sizeof ck, &cfg);
    rank_file(ck, file, sizeof file);
    assert_int_equal(unlink(file), 0);
    const char *want[] = {file, "missing", "tensor ", "which this rank needs"};
    expect_load_error(&cfg, ck, want, 4);
    // a truncated one: its size differs from the manifest's
    small_checkpoint("missing", ck, sizeof ck, &cfg);
    struct stat st;
    assert_int_equal(stat(file, &st), 0);
    assert_int_equal(truncate(file, st.st_size - 100), 0);
    const char *want_size[] = {file, "bytes", "truncated"};
    expect_load_error(&cfg, ck, want_size, 3);
    // no manifest: not a complete checkpoint
    char manifest[400];
    snprintf(manifest, sizeof manifest, "%s/%s", ck, CHECKPOINT_MANIFEST);
    assert_int_equal(unlink(manifest), 0);
    const char *want_manifest[] = {ck};
    expect_load_error(&cfg, ck, want_manifest, 1);
}

static void test_config_mismatch(void **state) {
    (void)state;
    Config saved, other;
    char ck[320];
    small_checkpoint("config", ck, sizeof ck, &saved);
    const char *more[] = {"model.inter_dim=64", "mtp.depth=2", "moe.bias_update_speed=0.01"};
    load_config(&other, "fp32", more, 3);
    const char *want[] = {ck, "model.inter_dim = 48 -> 64", "mtp.depth = 1 -> 2"};
    expect_load_error(&other, ck, want, 3);
    assert_null(strstr(err, "bias_update_speed ="));  // a training-only key may change
    // another precision mode loads: the master weights and moments are the same kinds in every mode
    Config fp8;
    load_config(&fp8, "fp8", NULL, 0);
    TrainState ts;
    make_state(&ts, &fp8);
    if (checkpoint_load(&ts, NULL, ck, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(ts.step, 2);
    StepResult r;
    train(&ts, 1, &r);
    train_state_free(&ts);
    char changes[1024];
    assert_int_equal(checkpoint_config_changes(&saved, &fp8, 0, changes, sizeof changes), 1);
    assert_non_null(strstr(changes, "precision.mode = fp32 -> fp8"));
}

// ---------------------------------------------------------------------------- the directory

static void test_keep_last_latest_and_partial(void **state) {
    (void)state;
    Config cfg;
    load_config(&cfg, "fp32", NULL, 0);
    char dir[256], names[1024], link[512], path[512];
    ck_dir(dir, sizeof dir, "prune");
    TrainState ts;
    StepResult r;
    make_state(&ts, &cfg);
    for (int s = 1; s <= 4; s++) {
        train(&ts, 1, &r);
        if (checkpoint_save(&ts, NULL, dir, 2, err, sizeof err) != 0) fail_msg("%s", err);
    }
    listing(dir, names, sizeof names);
    assert_string_equal(names, "latest step_00000003 step_00000004");
    snprintf(path, sizeof path, "%s/latest", dir);
    ssize_t n = readlink(path, link, sizeof link - 1);
    assert_true(n > 0);
    link[n] = '\0';
    assert_string_equal(link, "step_00000004");
    CheckpointInfo info;
    if (checkpoint_read_info(dir, &info, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(info.step, 4);
    assert_int_equal(info.world, 1);
    assert_int_equal(info.n_files, 1);
    assert_true(strstr(info.dir, "step_00000004") != NULL);

    // a killed save's leftovers (a checkpoint complete but for its rename, a half-made link) are never read
    char tmp[320], from[400], to[400];
    snprintf(tmp, sizeof tmp, "%s/step_00000099.tmp", dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    snprintf(from, sizeof from, "%s/step_00000004/%s", dir, CHECKPOINT_MANIFEST);
    snprintf(to, sizeof to, "%s/%s", tmp, CHECKPOINT_MANIFEST);
    copy_file(from, to);
    rank_file(tmp, to, sizeof to);
    char step4[320];
    snprintf(step4, sizeof step4, "%s/step_00000004", dir);
    rank_file(step4, from, sizeof from);
    copy_file(from, to);
    snprintf(path, sizeof path, "%s/latest.tmp.12345", dir);
    assert_int_equal(symlink("step_00000099.tmp", path), 0);
    if (checkpoint_read_info(dir, &info, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(info.step, 4);
    TrainState b;
    make_state(&b, &cfg);
    assert_int_not_equal(checkpoint_load(&b, NULL, tmp, err, sizeof err), 0);
    printf("expected error: %s\n", err);
    assert_non_null(strstr(err, "partial"));
    if (checkpoint_load(&b, NULL, dir, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(b.step, 4);
    train_state_free(&b);

    // the next save removes them; a second save of the same step replaces the first
    train(&ts, 1, &r);
    if (checkpoint_save(&ts, NULL, dir, 2, err, sizeof err) != 0) fail_msg("%s", err);
    if (checkpoint_save(&ts, NULL, dir, 2, err, sizeof err) != 0) fail_msg("%s", err);
    listing(dir, names, sizeof names);
    assert_string_equal(names, "latest step_00000004 step_00000005");
    assert_false(exists(tmp));
    // keep_last = 0 keeps every checkpoint
    train(&ts, 1, &r);
    if (checkpoint_save(&ts, NULL, dir, 0, err, sizeof err) != 0) fail_msg("%s", err);
    listing(dir, names, sizeof names);
    assert_string_equal(names, "latest step_00000004 step_00000005 step_00000006");
    train_state_free(&ts);
}

// A save that runs out of disk fails with the system's reason, removes its partial directory and keeps the
// previous checkpoint (loadable, and still DIR/latest). Needs a tmpfs mount (root with CAP_SYS_ADMIN).
static void test_full_disk(void **state) {
    (void)state;
    Config cfg;
    char ck[320], mnt[256], cmd[512], names[1024];
    small_checkpoint("size", ck, sizeof ck, &cfg);
    long long bytes = 0;
    struct dirent *e;
    DIR *d = opendir(ck);
    assert_non_null(d);
    while ((e = readdir(d))) {
        char p[640];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", ck, e->d_name);
        if (e->d_name[0] != '.' && stat(p, &st) == 0) bytes += (long long)st.st_size;
    }
    closedir(d);
    ck_dir(mnt, sizeof mnt, "full");
    assert_int_equal(mkdir(mnt, 0700), 0);
    const long long size_kb = (bytes * 3 / 2) / 1024 + 16;  // room for one checkpoint, not two
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=%lldk tmpfs '%s' 2>/dev/null", size_kb, mnt);
    if (system(cmd) != 0) {
        printf("test_full_disk: no tmpfs mount here (needs root with CAP_SYS_ADMIN); skipped\n");
        rmdir(mnt);
        return;
    }
    TrainState ts;
    StepResult r;
    make_state(&ts, &cfg);
    train(&ts, 1, &r);
    int first = checkpoint_save(&ts, NULL, mnt, 0, err, sizeof err);
    char first_err[4096];
    snprintf(first_err, sizeof first_err, "%s", err);
    train(&ts, 1, &r);
    int second = first == 0 ? checkpoint_save(&ts, NULL, mnt, 0, err, sizeof err) : -1;
    printf("expected error: %s\n", err);
    const ssize_t open_ids = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    listing(mnt, names, sizeof names);
    TrainState b;
    make_state(&b, &cfg);
    int loaded = checkpoint_load(&b, NULL, mnt, err, sizeof err);
    train_state_free(&b);
    train_state_free(&ts);
    snprintf(cmd, sizeof cmd, "umount '%s'", mnt);
    const int unmounted = system(cmd) == 0;
    rmdir(mnt);
    if (first != 0) fail_msg("the first save (%lld KB of a %lld KB tmpfs) failed: %s", bytes / 1024, size_kb, first_err);
    assert_int_not_equal(second, 0);
    assert_true(unmounted);
    assert_int_equal(open_ids, 0);
    assert_string_equal(names, "latest step_00000001");
    if (loaded != 0) fail_msg("the previous checkpoint does not load: %s", err);
}

// ---------------------------------------------------------------------------- main

static int setup(void **state) {
    (void)state;
    snprintf(g_root, sizeof g_root, "/tmp/fp8moe_ck_XXXXXX");
    if (!mkdtemp(g_root)) return -1;
    snprintf(g_cache, sizeof g_cache, "%s/cache", g_root);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    remove_dir(g_root);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_bitwise_fp32),
        cmocka_unit_test(test_resume_bitwise_fp8),
        cmocka_unit_test(test_flipped_byte),
        cmocka_unit_test(test_missing_shard),
        cmocka_unit_test(test_config_mismatch),
        cmocka_unit_test(test_keep_last_latest_and_partial),
        cmocka_unit_test(test_full_disk),
    };
    if (getenv("CHECKPOINT_TEST_FILTER")) cmocka_set_test_filter(getenv("CHECKPOINT_TEST_FILTER"));  // e.g. "*disk*"
    return cmocka_run_group_tests(tests, setup, teardown);
}
