/*
 * test_weights_io.c - the HDF5 weights file (train/weights_io.c): round trip and error messages.
 *
 * The reference for "what the file holds" is read here with plain HDF5 calls, independent of
 * weights_load; the reference for the round trip is the model's own initial weights (random,
 * non-zero, from the model's seeded init) and random non-zero router biases set by the test.
 * Broken files are made by editing a good file with HDF5 directly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/config.h"
#include "train/model.h"
#include "train/rng.h"
#include "train/weights_io.h"

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

int main(void) {
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
