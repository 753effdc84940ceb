/*
 * test_weights_io.c - the HDF5 weights file (train/weights_io.c): round trip and error messages.
 *
 * The reference for "what the file holds" is read here with plain HDF5 calls, independent of
 * weights_load; the reference for the round trip is the model's own initial weights (random,
 * non-zero, from the model's seeded init) and random non-zero router biases set by the test.
 * Broken files are made by editing a good file with HDF5 directly.
 *
 * Failing writes. This executable defines pwrite(2), write(2), fallocate(2), fsync(2) and
 * rename(2) (below): the dynamic linker binds HDF5's calls to them, and the static library's calls
 * bind to them at link time, so the test can make the temporary weights file's writes and space
 * allocation fail with ENOSPC past a given file offset (a disk that is full once the file reaches
 * that size: rewrites below it still succeed, as on a real file system) and can record the order
 * of fsync and rename. Every other call passes straight through. Saves that must fail, and
 * anything whose crash is the bug, run in a child process (this binary re-executed with --child
 * ...), so a crash in HDF5's exit handler or a signal shows as the child's wait status instead of
 * killing the test runner. Where the machine allows a tmpfs mount (root with CAP_SYS_ADMIN), the
 * full disk is also a real 200 KB tmpfs, as in issue 17.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/rng.h"
#include "train/config.h"
#include "train/model.h"
#include "train/sample.h"
#include "train/weights_io.h"

// ---------------------------------------------------------------------------- interposed I/O

// What the interposed calls do. `match`: a substring of the file's path (from /proc/self/fd) that
// selects the affected descriptors; empty = none.
static struct {
    char match[256];
    long long limit;       // writes reaching past this offset fail with ENOSPC (-1: no limit)
    long long signal_at;   // the first write reaching past this offset raises SIGUSR1 first (-1: never)
    int record;            // record fsync and rename calls of any file into `events`
    char events[4096];
} g_io = {.limit = -1, .signal_at = -1};

static int fd_path(int fd, char *buf, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, buf, size - 1);
    if (n < 0) return -1;
    buf[n] = '\0';
    return 0;
}

static void record_event(const char *fmt, const char *a, const char *b) {
    size_t len = strlen(g_io.events);
    snprintf(g_io.events + len, sizeof g_io.events - len, fmt, a, b);
}

// How many of `count` bytes at `offset` on fd may be written: count, fewer (a short write, as when a
// disk fills mid-write), or -1 with errno = ENOSPC.
static ssize_t allowed_bytes(int fd, size_t count, long long offset) {
    char path[512];
    if (!g_io.match[0] || fd_path(fd, path, sizeof path) != 0 || !strstr(path, g_io.match)) return (ssize_t)count;
    if (g_io.signal_at >= 0 && offset + (long long)count > g_io.signal_at) {
        g_io.signal_at = -1;
        raise(SIGUSR1);
    }
    if (g_io.limit < 0 || offset + (long long)count <= g_io.limit) return (ssize_t)count;
    if (offset < g_io.limit) return (ssize_t)(g_io.limit - offset);
    errno = ENOSPC;
    return -1;
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = (ssize_t(*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
    ssize_t n = allowed_bytes(fd, count, (long long)offset);
    return n < 0 ? -1 : real(fd, buf, (size_t)n, offset);
}

ssize_t write(int fd, const void *buf, size_t count) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (!g_io.match[0]) return real(fd, buf, count);
    off_t at = lseek(fd, 0, SEEK_CUR);
    ssize_t n = allowed_bytes(fd, count, at < 0 ? 0 : (long long)at);
    return n < 0 ? -1 : real(fd, buf, (size_t)n);
}

// weights_save allocates the file's space before HDF5's final flush: past the limit that fails too.
int fallocate(int fd, int mode, off_t offset, off_t len) {
    static int (*real)(int, int, off_t, off_t);
    if (!real) real = (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate");
    char path[512];
    if (g_io.match[0] && g_io.limit >= 0 && fd_path(fd, path, sizeof path) == 0 && strstr(path, g_io.match) &&
        (long long)offset + (long long)len > g_io.limit) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, mode, offset, len);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    char path[512];
    if (g_io.record && fd_path(fd, path, sizeof path) == 0) record_event("fsync %s%s\n", path, "");
    return real(fd);
}

int rename(const char *from, const char *to) {
    static int (*real)(const char *, const char *);
    if (!real) real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    if (g_io.record) record_event("rename %s -> %s\n", from, to);
    return real(from, to);
}

// ---------------------------------------------------------------------------- fixtures

// A tiny DeepSeek-V3-shaped model: 1 dense + 2 MoE blocks, MTP depth 1 (so 3 MoE layers), 4 experts.
static void tiny_config(Config *c, uint64_t seed) {
    config_defaults(c);
    c->model.vocab_size = 256;
    c->model.dim = 16;
    c->model.n_layers = 3;
    c->model.n_dense_layers = 1;
    c->model.inter_dim = 24;
    c->model.n_heads = 2;
    c->model.q_lora_rank = 8;
    c->model.kv_lora_rank = 8;
    c->model.qk_nope_head_dim = 4;
    c->model.qk_rope_head_dim = 4;
    c->model.v_head_dim = 4;
    c->moe.n_routed_experts = 4;
    c->moe.n_activated_experts = 2;
    c->moe.n_expert_groups = 2;
    c->moe.n_limited_groups = 1;
    c->moe.moe_inter_dim = 8;
    c->mtp.depth = 1;
    c->train.seq_len = 8;
    c->train.seed = seed;
    c->optim.lr = 0.0125;  // a non-default value to see in the stored config
}

typedef struct {
    char dir[64];
    char path[128];
} TmpFile;

static void tmp_make(TmpFile *t) {
    snprintf(t->dir, sizeof t->dir, "/tmp/fp8moe_wio_XXXXXX");
    assert_non_null(mkdtemp(t->dir));
    snprintf(t->path, sizeof t->path, "%s/weights.h5", t->dir);
}
static void tmp_remove(TmpFile *t) {
    unlink(t->path);
    rmdir(t->dir);
}

static void set_random_biases(Model *m, uint64_t seed) {
    int E = m->cfg.moe.n_routed_experts;
    uint64_t key = rng_key(seed, 77, 0, 0);
    for (int64_t i = 0; i < (int64_t)m->n_moe_layers * E; i++)
        m->router_bias[i] = (real)(0.01 * (rng_uniform(key, (uint64_t)i) - 0.5) + 0.001);
}

// Saves a fresh tiny model (seed 11) to t->path.
static void save_tiny(TmpFile *t, Model *m) {
    Config c;
    tiny_config(&c, 11);
    char err[1024];
    assert_int_equal(model_create(m, &c, DEVICE_CPU, 1, err, sizeof err), 0);
    set_random_biases(m, 5);
    int rc = weights_save(m, t->path, err, sizeof err);
    if (rc != 0) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
}

// ---------------------------------------------------------------------------- round trip

static void test_round_trip_bitwise(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);

    // The stored config rebuilds the same shape.
    Config c;
    char err[1024];
    assert_int_equal(weights_read_config(t.path, &c, err, sizeof err), 0);
    assert_int_equal(c.model.dim, 16);
    assert_int_equal(c.model.n_layers, 3);
    assert_int_equal(c.moe.n_routed_experts, 4);
    assert_int_equal(c.mtp.depth, 1);
    assert_true(c.train.seed == 11);
    assert_true(c.optim.lr == 0.0125);

    // A model with another seed starts with other weights; loading must make them the saved ones.
    c.train.seed = 99;
    Model b;
    assert_int_equal(model_create(&b, &c, DEVICE_CPU, 1, err, sizeof err), 0);
    int64_t n = a.n_dense_elems + a.n_expert_elems;
    assert_int_equal(b.n_dense_elems + b.n_expert_elems, n);
    assert_true(memcmp(a.weights, b.weights, (size_t)n * sizeof(real)) != 0);
    int rc = weights_load(&b, t.path, err, sizeof err);
    if (rc != 0) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    // The file holds FP32: the expected value is the original rounded to float (exact in the float
    // build, so this is a bitwise comparison there).
    for (int64_t i = 0; i < n; i++) {
        real want = (real)(float)a.weights[i];
        assert_memory_equal(&b.weights[i], &want, sizeof(real));
    }
    int E = c.moe.n_routed_experts;
    assert_int_equal(b.n_moe_layers, 3);
    for (int64_t i = 0; i < (int64_t)b.n_moe_layers * E; i++) {
        real want = (real)(float)a.router_bias[i];
        assert_memory_equal(&b.router_bias[i], &want, sizeof(real));
        assert_true(want != 0);
    }
    model_free(&b);
    model_free(&a);
    tmp_remove(&t);
}

// Reads the file with HDF5 directly: datasets under the parameter names with their shapes, router
// biases under the names worked out by hand for this config, and the config attribute.
static void test_file_layout(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);

    hid_t f = H5Fopen(t.path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    // embed.weight: (V, D) = (256, 16), FP32, values equal to the model's
    hid_t d = H5Dopen2(f, "embed.weight", H5P_DEFAULT);
    assert_true(d >= 0);
    hid_t s = H5Dget_space(d), ty = H5Dget_type(d);
    hsize_t dims[4];
    assert_int_equal(H5Sget_simple_extent_dims(s, dims, NULL), 2);
    assert_int_equal(dims[0], 256);
    assert_int_equal(dims[1], 16);
    assert_int_equal(H5Tget_class(ty), H5T_FLOAT);
    assert_int_equal(H5Tget_size(ty), 4);
    float *embed = malloc(256 * 16 * sizeof *embed);
    assert_true(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, embed) >= 0);
    const ParamInfo *pe = model_find_param(&a, "embed.weight");
    assert_non_null(pe);
    for (int i = 0; i < 256 * 16; i++) assert_true(embed[i] == (float)a.weights[pe->offset + i]);
    free(embed);
    H5Tclose(ty);
    H5Sclose(s);
    H5Dclose(d);

    // one dataset per parameter tensor, with its shape
    for (int p = 0; p < a.n_params; p++) {
        d = H5Dopen2(f, a.params[p].name, H5P_DEFAULT);
        assert_true(d >= 0);
        s = H5Dget_space(d);
        assert_int_equal(H5Sget_simple_extent_dims(s, dims, NULL), a.params[p].ndim);
        for (int k = 0; k < a.params[p].ndim; k++) assert_int_equal(dims[k], a.params[p].shape[k]);
        H5Sclose(s);
        H5Dclose(d);
    }

    // MoE layers: blocks 1 and 2 of the main model, then the MTP module's block; E = 4 values each
    const char *bias_names[3] = {"layers.1.ffn.gate.bias", "layers.2.ffn.gate.bias", "mtp.0.block.ffn.gate.bias"};
    for (int l = 0; l < 3; l++) {
        char name[128];
        assert_int_equal(weights_router_bias_name(&a, l, name, sizeof name), 0);
        assert_string_equal(name, bias_names[l]);
        d = H5Dopen2(f, bias_names[l], H5P_DEFAULT);
        assert_true(d >= 0);
        float b[4];
        assert_true(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, b) >= 0);
        for (int e = 0; e < 4; e++) assert_true(b[e] == (float)a.router_bias[l * 4 + e]);
        H5Dclose(d);
    }
    // nothing else at the root: params + 3 biases
    H5G_info_t info;
    assert_true(H5Gget_info(f, &info) >= 0);
    assert_int_equal(info.nlinks, a.n_params + 3);

    // the config attribute is the INI text of the resolved config
    hid_t at = H5Aopen(f, "config", H5P_DEFAULT);
    assert_true(at >= 0);
    hid_t at_type = H5Aget_type(at);
    size_t len = H5Tget_size(at_type);
    char *text = calloc(len + 1, 1);
    assert_true(H5Aread(at, at_type, text) >= 0);
    assert_non_null(strstr(text, "[model]"));
    assert_non_null(strstr(text, "dim = 16"));
    assert_non_null(strstr(text, "n_routed_experts = 4"));
    free(text);
    H5Tclose(at_type);
    H5Aclose(at);
    H5Fclose(f);

    // written atomically: only weights.h5 is left in the directory (no temporary file)
    char cmd[256];
    snprintf(cmd, sizeof cmd, "test \"$(ls %s)\" = weights.h5", t.dir);
    assert_int_equal(system(cmd), 0);
    model_free(&a);
    tmp_remove(&t);
}

// ---------------------------------------------------------------------------- errors

// Loads t->path into a fresh tiny model and returns the error text (static buffer), asserting failure.
static const char *load_error(const TmpFile *t) {
    static char err[1024];
    Config c;
    tiny_config(&c, 11);
    Model m;
    assert_int_equal(model_create(&m, &c, DEVICE_CPU, 1, err, sizeof err), 0);
    err[0] = '\0';
    assert_int_equal(weights_load(&m, t->path, err, sizeof err), -1);
    model_free(&m);
    return err;
}

static void test_missing_dataset(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    hid_t f = H5Fopen(t.path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(f >= 0);
    assert_true(H5Ldelete(f, "layers.2.attn.wkv_b.weight", H5P_DEFAULT) >= 0);
    H5Fclose(f);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "layers.2.attn.wkv_b.weight"));
    assert_non_null(strstr(err, "missing"));
    tmp_remove(&t);
}

static void test_missing_router_bias(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    hid_t f = H5Fopen(t.path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(H5Ldelete(f, "mtp.0.block.ffn.gate.bias", H5P_DEFAULT) >= 0);
    H5Fclose(f);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "mtp.0.block.ffn.gate.bias"));
    tmp_remove(&t);
}

static void test_wrong_shape(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    // replace head.weight (256, 16) by a (16, 256) dataset
    hid_t f = H5Fopen(t.path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(H5Ldelete(f, "head.weight", H5P_DEFAULT) >= 0);
    hsize_t dims[2] = {16, 256};
    hid_t s = H5Screate_simple(2, dims, NULL);
    hid_t d = H5Dcreate2(f, "head.weight", H5T_IEEE_F32LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    assert_true(d >= 0);
    float *zeros = calloc(16 * 256, sizeof *zeros);
    assert_true(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros) >= 0);
    free(zeros);
    H5Dclose(d);
    H5Sclose(s);
    H5Fclose(f);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "head.weight"));
    assert_non_null(strstr(err, "(16, 256)"));
    assert_non_null(strstr(err, "expected (256, 16)"));
    tmp_remove(&t);
}

static void test_unknown_dataset(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    hid_t f = H5Fopen(t.path, H5F_ACC_RDWR, H5P_DEFAULT);
    hsize_t dims[1] = {3};
    hid_t s = H5Screate_simple(1, dims, NULL);
    hid_t d = H5Dcreate2(f, "layers.7.attn_norm.weight", H5T_IEEE_F32LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    assert_true(d >= 0);
    H5Dclose(d);
    H5Sclose(s);
    H5Fclose(f);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "layers.7.attn_norm.weight"));
    tmp_remove(&t);
}

static void test_not_hdf5(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    FILE *f = fopen(t.path, "w");
    assert_non_null(f);
    fputs("[model]\ndim = 16\n", f);
    fclose(f);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "not an HDF5 file"));
    Config c;
    char err2[1024];
    assert_int_equal(weights_read_config(t.path, &c, err2, sizeof err2), -1);
    assert_non_null(strstr(err2, t.path));
    assert_non_null(strstr(err2, "not an HDF5 file"));
    tmp_remove(&t);
}

static void test_missing_file_and_config(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Config c;
    char err[1024];
    // no file at all
    assert_int_equal(weights_read_config(t.path, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, t.path));
    // an HDF5 file without the config attribute
    hid_t f = H5Fcreate(t.path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    assert_true(f >= 0);
    H5Fclose(f);
    assert_int_equal(weights_read_config(t.path, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "\"config\""));
    tmp_remove(&t);
}

static void test_save_into_missing_directory(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Config c;
    tiny_config(&c, 11);
    Model m;
    char err[1024];
    assert_int_equal(model_create(&m, &c, DEVICE_CPU, 1, err, sizeof err), 0);
    char path[256];
    snprintf(path, sizeof path, "%s/no/such/dir/weights.h5", t.dir);
    assert_int_equal(weights_save(&m, path, err, sizeof err), -1);
    assert_non_null(strstr(err, "no/such/dir/weights.h5"));
    assert_int_equal(access(path, F_OK), -1);
    model_free(&m);
    tmp_remove(&t);
}

// ---------------------------------------------------------------------------- child processes

// A SIGUSR1 handler standing for the trainer's second Ctrl-C: remove the partial file, exit at once.
static void on_interrupt(int sig) {
    (void)sig;
    weights_remove_partial();
    _exit(130);
}

// The child side of run_child (argv = prog --child KIND ARGS...). Prints "rc N", "err TEXT" and
// "open_ids N" (HDF5 ids still open after the call) and returns from main, so exit() and HDF5's
// exit handler run as in the real program. KINDs:
//   save DIR LIMIT        weights_save of the tiny model to DIR/weights.h5, writes failing past LIMIT
//   interrupt DIR OFFSET  the same save, with SIGUSR1 (on_interrupt) raised once it writes past OFFSET
//   sample PATH           sample_run on PATH (4 bytes, greedy)
static int child_main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 4) return 99;
    const char *kind = argv[2];
    char err[1024] = "";
    int rc;
    if (strcmp(kind, "save") == 0 || strcmp(kind, "interrupt") == 0) {
        if (argc < 5) return 99;
        Config c;
        tiny_config(&c, 11);
        Model m;
        if (model_create(&m, &c, DEVICE_CPU, 1, err, sizeof err) != 0) {
            printf("model_create: %s\n", err);
            return 98;
        }
        char path[512];
        snprintf(path, sizeof path, "%s/weights.h5", argv[3]);
        snprintf(g_io.match, sizeof g_io.match, "/weights.h5.tmp.");
        if (strcmp(kind, "save") == 0) {
            g_io.limit = atoll(argv[4]);
        } else {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = on_interrupt;
            sigaction(SIGUSR1, &sa, NULL);
            g_io.signal_at = atoll(argv[4]);
        }
        rc = weights_save(&m, path, err, sizeof err);
        g_io.match[0] = '\0';
        model_free(&m);
    } else if (strcmp(kind, "sample") == 0) {
        FILE *sink = fopen("/dev/null", "w");
        SampleOptions o = {.weights_path = argv[3], .prompt = "ab", .steps = 4, .temperature = 0, .seed = 1};
        rc = sink ? sample_run(&o, sink, err, sizeof err) : -2;
        if (sink) fclose(sink);
    } else {
        return 99;
    }
    printf("rc %d\nerr %s\nopen_ids %lld\n", rc, rc ? err : "", (long long)H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL));
    return rc == 0 ? 0 : 3;
}

// Runs this binary as `--child args...` with stdout and stderr into out; returns the wait status.
static int run_child(const char *const *args, char *out, size_t out_size) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        const char *argv[16] = {"test_weights_io", "--child"};
        int n = 2;
        for (int i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
        argv[n] = NULL;
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(97);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t got;
    while (len + 1 < out_size && (got = read(fds[0], out + len, out_size - 1 - len)) > 0) len += (size_t)got;
    out[len] = '\0';
    char sink[256];
    while (read(fds[0], sink, sizeof sink) > 0) {}
    close(fds[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return status;
}

static const char *describe_status(int status, char *buf, size_t size) {
    if (WIFEXITED(status)) snprintf(buf, size, "exited with %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(buf, size, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else snprintf(buf, size, "wait status %d", status);
    return buf;
}

// The names in dir other than . and .., space-separated (static buffer).
static const char *dir_listing(const char *dir) {
    static char names[1024];
    char cmd[300];
    snprintf(cmd, sizeof cmd, "ls -A '%s'", dir);
    names[0] = '\0';
    FILE *p = popen(cmd, "r");
    if (!p) return "(ls failed)";
    char line[256];
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = '\0';
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", names[0] ? " " : "", line);
    }
    pclose(p);
    return names;
}

static long long file_size(const char *path) {
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    return (long long)st.st_size;
}

// The size of the tiny model's complete weights file, from a save that succeeds.
static long long tiny_file_size(void) {
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    long long size = file_size(t.path);
    tmp_remove(&t);
    return size;
}

// A failed save: the child exits normally with 3 (no crash in HDF5's exit handler), says why, closed
// every HDF5 id, and left nothing in the directory but `left` (neither weights.h5 nor a temporary).
static void expect_clean_failure(int status, const char *out, const char *dir, const char *left, const char *why) {
    char st[128];
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 3)
        fail_msg("%s: the process %s, expected a clean exit with 3; its output:\n%s", why,
                 describe_status(status, st, sizeof st), out);
    if (!strstr(out, "rc -1")) fail_msg("%s: weights_save did not return -1:\n%s", why, out);
    if (!strstr(out, "No space left on device")) fail_msg("%s: the message does not say the disk is full:\n%s", why, out);
    if (!strstr(out, "open_ids 0\n")) fail_msg("%s: HDF5 ids left open:\n%s", why, out);
    const char *names = dir_listing(dir);
    if (strcmp(names, left) != 0) fail_msg("%s: the directory holds \"%s\", expected \"%s\"", why, names, left);
}

// ---------------------------------------------------------------------------- full disk, fsync, interruption

// Writes to the temporary file fail with ENOSPC once it would reach past `limit` bytes, at sizes from
// nothing at all to one byte short of the complete file (the last write HDF5 makes to extend it).
static void test_save_disk_full(void **state) {
    (void)state;
    long long S = tiny_file_size();
    long long limits[] = {0, 40, 2048, S / 2, S - 4096, S - 600, S - 1};
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        if (limits[i] < 0 || limits[i] >= S) continue;
        TmpFile t;
        tmp_make(&t);
        char lim[32], out[8192], why[96];
        snprintf(lim, sizeof lim, "%lld", limits[i]);
        const char *args[] = {"save", t.dir, lim, NULL};
        int status = run_child(args, out, sizeof out);
        snprintf(why, sizeof why, "disk full at %lld of %lld bytes", limits[i], S);
        expect_clean_failure(status, out, t.dir, "", why);
        tmp_remove(&t);
    }
}

// The reproduction: checkpoint.dir on a 200 KB tmpfs, filled so that half the file fits.
static void test_save_full_tmpfs(void **state) {
    (void)state;
    long long S = tiny_file_size();
    TmpFile t;
    tmp_make(&t);
    char mnt[128], cmd[300];
    snprintf(mnt, sizeof mnt, "%s/full", t.dir);
    assert_int_equal(mkdir(mnt, 0700), 0);
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=200k tmpfs '%s' 2>/dev/null", mnt);
    if (system(cmd) != 0) {
        printf("test_save_full_tmpfs: no tmpfs mount here (needs root with CAP_SYS_ADMIN); "
               "test_save_disk_full makes the same ENOSPC with interposed writes\n");
        rmdir(mnt);
        rmdir(t.dir);
        return;
    }
    // leave S/2 bytes free (tmpfs counts whole pages)
    struct statvfs vfs;
    int ok = statvfs(mnt, &vfs) == 0;
    long long free_bytes = ok ? (long long)vfs.f_bavail * (long long)vfs.f_frsize : 0;
    long long fill = (free_bytes - S / 2) / 4096 * 4096;
    char filler[160];
    snprintf(filler, sizeof filler, "%s/filler", mnt);
    if (ok && fill > 0) {
        int fd = open(filler, O_CREAT | O_WRONLY | O_TRUNC, 0600);
        char page[4096] = {0};
        for (long long w = 0; fd >= 0 && w < fill; w += 4096) ok = ok && write(fd, page, sizeof page) == 4096;
        ok = ok && fd >= 0 && close(fd) == 0;
    }
    char out[8192] = "", listing[1024] = "";
    int status = 0;
    if (ok) {
        const char *args[] = {"save", mnt, "-1", NULL};
        status = run_child(args, out, sizeof out);
        snprintf(listing, sizeof listing, "%s", dir_listing(mnt));
    }
    unlink(filler);
    snprintf(cmd, sizeof cmd, "umount '%s'", mnt);
    int unmounted = system(cmd) == 0;
    rmdir(mnt);
    rmdir(t.dir);
    assert_true(ok);
    assert_true(unmounted);
    char why[96];
    snprintf(why, sizeof why, "200 KB tmpfs with %lld of %lld bytes free", S / 2, S);
    char st[128];
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 3)
        fail_msg("%s: the process %s, expected a clean exit with 3; its output:\n%s", why,
                 describe_status(status, st, sizeof st), out);
    if (!strstr(out, "No space left on device")) fail_msg("%s: the message does not say the disk is full:\n%s", why, out);
    if (!strstr(out, "open_ids 0\n")) fail_msg("%s: HDF5 ids left open:\n%s", why, out);
    if (strcmp(listing, "filler") != 0) fail_msg("%s: the directory held \"%s\", expected only the filler", why, listing);
}

// The file is fsync'ed before the rename and its directory after it, so a crash (power loss) right
// after weights_save returns cannot leave a missing or empty weights.h5.
static void test_save_fsyncs_file_and_directory(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    g_io.events[0] = '\0';
    g_io.record = 1;
    Model a;
    save_tiny(&t, &a);
    g_io.record = 0;
    model_free(&a);
    char tmp[256], want_fsync_tmp[300], want_rename[600], want_fsync_dir[200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", t.path, (long)getpid());
    snprintf(want_fsync_tmp, sizeof want_fsync_tmp, "fsync %s\n", tmp);
    snprintf(want_rename, sizeof want_rename, "rename %s -> %s\n", tmp, t.path);
    snprintf(want_fsync_dir, sizeof want_fsync_dir, "fsync %s\n", t.dir);
    const char *ev = g_io.events;
    const char *f1 = strstr(ev, want_fsync_tmp), *r = strstr(ev, want_rename);
    const char *f2 = r ? strstr(r, want_fsync_dir) : NULL;
    if (!f1 || !r || f1 > r || !f2)
        fail_msg("expected fsync of the temporary file, the rename, then fsync of the directory; recorded:\n%s", ev);
    tmp_remove(&t);
}

// An interrupted save (a signal whose handler calls weights_remove_partial and exits) leaves nothing.
static void test_remove_partial(void **state) {
    (void)state;
    assert_int_equal(weights_remove_partial(), 0);  // no save in progress: nothing to remove
    long long S = tiny_file_size();
    TmpFile t;
    tmp_make(&t);
    char at[32], out[8192], st[128];
    snprintf(at, sizeof at, "%lld", S / 2);
    const char *args[] = {"interrupt", t.dir, at, NULL};
    int status = run_child(args, out, sizeof out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 130)
        fail_msg("the interrupted save %s, expected exit 130 from the handler; output:\n%s",
                 describe_status(status, st, sizeof st), out);
    const char *names = dir_listing(t.dir);
    if (names[0]) fail_msg("the interrupted save left \"%s\" behind", names);
    tmp_remove(&t);
}

// ---------------------------------------------------------------------------- values and format at load

// Sets element `index` of dataset `name` of the file to v.
static void poke_value(const char *path, const char *name, int64_t index, float v) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(f >= 0);
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    assert_true(d >= 0);
    hid_t s = H5Dget_space(d);
    hssize_t n = H5Sget_simple_extent_npoints(s);
    assert_true(index < n);
    float *buf = malloc((size_t)n * sizeof *buf);
    assert_true(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    buf[index] = v;
    assert_true(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    free(buf);
    H5Sclose(s);
    H5Dclose(d);
    assert_true(H5Fclose(f) >= 0);
}

static void test_load_refuses_nonfinite(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    // gate weight (E, D) = (4, 16): row 2, column 3
    poke_value(t.path, "layers.1.ffn.gate.weight", 2 * 16 + 3, NAN);
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "layers.1.ffn.gate.weight"));
    assert_non_null(strstr(err, "(2, 3)"));
    assert_non_null(strstr(err, "NaN"));
    tmp_remove(&t);

    tmp_make(&t);
    save_tiny(&t, &a);
    model_free(&a);
    poke_value(t.path, "mtp.0.block.ffn.gate.bias", 1, -INFINITY);
    err = load_error(&t);
    assert_non_null(strstr(err, "mtp.0.block.ffn.gate.bias"));
    assert_non_null(strstr(err, "(1)"));
    assert_non_null(strstr(err, "-Inf"));
    tmp_remove(&t);
}

// The reproduction: `fp8moe sample` on a file with one NaN, with two OpenMP threads, crashed
// in the router (exit inside a parallel region); it must stop with a message naming the tensor.
static void test_sample_refuses_nonfinite(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Config c;
    tiny_config(&c, 11);
    c.train.threads = 2;
    Model a;
    char err[1024];
    assert_int_equal(model_create(&a, &c, DEVICE_CPU, 1, err, sizeof err), 0);
    assert_int_equal(weights_save(&a, t.path, err, sizeof err), 0);
    model_free(&a);
    poke_value(t.path, "layers.1.ffn.gate.weight", 5, NAN);
    char out[8192], st[128];
    const char *args[] = {"sample", t.path, NULL};
    int status = run_child(args, out, sizeof out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 3 || !strstr(out, "layers.1.ffn.gate.weight"))
        fail_msg("sample on a file with a NaN %s, expected sample_run to return -1 naming the tensor; output:\n%s",
                 describe_status(status, st, sizeof st), out);
    tmp_remove(&t);
}

// Replaces the root attribute "format" by `text` (NULL: removes it).
static void set_format_attr(const char *path, const char *text) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(f >= 0);
    assert_true(H5Adelete(f, "format") >= 0);
    if (text) {
        hid_t type = H5Tcopy(H5T_C_S1);
        H5Tset_size(type, strlen(text) + 1);
        hid_t space = H5Screate(H5S_SCALAR);
        hid_t attr = H5Acreate2(f, "format", type, space, H5P_DEFAULT, H5P_DEFAULT);
        assert_true(attr >= 0);
        assert_true(H5Awrite(attr, type, text) >= 0);
        H5Aclose(attr);
        H5Sclose(space);
        H5Tclose(type);
    }
    assert_true(H5Fclose(f) >= 0);
}

static void test_format_attribute_checked(void **state) {
    (void)state;
    TmpFile t;
    tmp_make(&t);
    Model a;
    save_tiny(&t, &a);
    model_free(&a);
    set_format_attr(t.path, "fp8moe-weights-0");
    const char *err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "\"format\""));
    assert_non_null(strstr(err, "\"fp8moe-weights-0\""));
    assert_non_null(strstr(err, "\"" WEIGHTS_FORMAT "\""));
    Config c;
    char err2[1024];
    assert_int_equal(weights_read_config(t.path, &c, err2, sizeof err2), -1);
    assert_non_null(strstr(err2, t.path));
    assert_non_null(strstr(err2, "\"fp8moe-weights-0\""));
    assert_non_null(strstr(err2, "\"" WEIGHTS_FORMAT "\""));

    set_format_attr(t.path, NULL);
    err = load_error(&t);
    assert_non_null(strstr(err, t.path));
    assert_non_null(strstr(err, "\"format\""));
    assert_non_null(strstr(err, "missing"));
    tmp_remove(&t);
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "--child") == 0) return child_main(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_bitwise),
        cmocka_unit_test(test_file_layout),
        cmocka_unit_test(test_missing_dataset),
        cmocka_unit_test(test_missing_router_bias),
        cmocka_unit_test(test_wrong_shape),
        cmocka_unit_test(test_unknown_dataset),
        cmocka_unit_test(test_not_hdf5),
        cmocka_unit_test(test_missing_file_and_config),
        cmocka_unit_test(test_save_into_missing_directory),
        cmocka_unit_test(test_save_disk_full),
        cmocka_unit_test(test_save_full_tmpfs),
        cmocka_unit_test(test_save_fsyncs_file_and_directory),
        cmocka_unit_test(test_remove_partial),
        cmocka_unit_test(test_load_refuses_nonfinite),
        cmocka_unit_test(test_sample_refuses_nonfinite),
        cmocka_unit_test(test_format_attribute_checked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
