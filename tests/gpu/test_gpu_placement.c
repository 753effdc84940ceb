/*
 * test_gpu_placement.c - the Stage on the GPU (the CPU form is tests/unit/test_placement.c): configs/tiny.ini
 * on DEVICE_CUDA, the whole model against the same model cut into three stages, each its own Model with only
 * its tensors, run one after another with the boundary activations and gradients handed over in device
 * buffers (no host copy). Every stage tensor has the whole model's initial values, and the loss terms and
 * every gradient are bitwise the whole model's, in fp32, bf16 and fp8, with and without MTP (whose
 * embedding copy on the last stage hands its gradient to the first stage before that stage's backward, the
 * tied-embedding reduction). Both sides run the same kernels on the same device in the same order, so the
 * comparison is exact, not within a tolerance.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/rng.h"
#include "tests/gpu/gpucheck.h"
#include "train/config.h"
#include "train/model.h"

enum { B = 2, T = 16 };

static void load_tiny(Config *cfg, const char *mode, int mtp_depth) {
    char err[1024], m[64], d[64];
    snprintf(m, sizeof m, "precision.mode=%s", mode);
    snprintf(d, sizeof d, "mtp.depth=%d", mtp_depth);
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", m, d, "train.device=cuda"};
    if (config_load(cfg, "configs/tiny.ini", ov, 5, err, sizeof err) != 0) fail_msg("%s", err);
}

static real *to_host(const Model *m, const real *d, int64_t n) {
    real *h = malloc((size_t)n * sizeof(real));
    assert_non_null(h);
    device_memcpy_to_host(m->rc.dev, h, d, (size_t)n * sizeof(real));
    return h;
}

static void check_three_stages(const char *mode, int mtp_depth) {
    Config cfg;
    load_tiny(&cfg, mode, mtp_depth);
    const int D = cfg.model.dim, N = B * T;
    int inputs[B * T], targets[B * T];
    const uint64_t key = rng_key(11, 4, 5, 6);
    for (int b = 0; b < B; b++) {
        int row[T + 1];
        for (int t = 0; t <= T; t++) row[t] = (int)(rng_u64(key, (uint64_t)(b * 100 + t)) % 256);
        for (int t = 0; t < T; t++) inputs[b * T + t] = row[t], targets[b * T + t] = row[t + 1];
    }
    char err[256];
    Model whole, st[3];
    assert_int_equal(model_create(&whole, &cfg, DEVICE_CUDA, 1, err, sizeof err), 0);
    for (int s = 0; s < 3; s++) {
        Placement pl;
        assert_int_equal(placement_stages(&cfg, &s, 1, 3, &pl, err, sizeof err), 0);
        assert_int_equal(model_create_placement(&st[s], &cfg, DEVICE_CUDA, &pl, err, sizeof err), 0);
    }
    ChunkActs *wa = chunk_acts_create(&whole, 0, B, T);
    assert_non_null(wa);
    model_zero_grads(&whole);
    const real loss_whole = chunk_forward(&whole, 0, wa, inputs, targets, NULL, NULL);
    const LossTerms lt_whole = chunk_losses(wa);
    chunk_backward(&whole, 0, wa, NULL, NULL, 1);

    ChunkActs *sa[3];
    real *act[2], *grad[2];  // boundary tensors: device buffers
    for (int i = 0; i < 2; i++) {
        act[i] = device_alloc(DEVICE_CUDA, (size_t)N * D * sizeof(real));
        grad[i] = device_alloc(DEVICE_CUDA, (size_t)N * D * sizeof(real));
    }
    real loss = 0;
    for (int s = 0; s < 3; s++) {
        sa[s] = chunk_acts_create(&st[s], 0, B, T);
        assert_non_null(sa[s]);
        model_zero_grads(&st[s]);
        loss += chunk_forward(&st[s], 0, sa[s], inputs, targets, s ? act[s - 1] : NULL, s < 2 ? act[s] : NULL);
    }
    const LossTerms lt = chunk_losses(sa[2]);
    for (int s = 2; s >= 0; s--) {
        if (s == 0 && mtp_depth > 0) {  // the tied embedding: the last stage's copy's gradient first
            const ParamInfo *e0 = model_find_param(&st[0], "embed.weight"), *e2 = model_find_param(&st[2], "embed.weight");
            copy_block(DEVICE_CUDA, st[0].grads + e0->offset, D, st[2].grads + e2->offset, D, e0->shape[0], D, 0);
        }
        chunk_backward(&st[s], 0, sa[s], s < 2 ? grad[s] : NULL, s ? grad[s - 1] : NULL, 1);
    }
    assert_memory_equal(&lt.main, &lt_whole.main, sizeof lt.main);
    if (mtp_depth > 0) assert_memory_equal(&lt.mtp[0], &lt_whole.mtp[0], sizeof lt.mtp[0]);
    assert_true(fabs((double)loss - (double)loss_whole) <= 1e-6 * fabs((double)loss_whole));
    const int64_t nw = whole.n_dense_elems + whole.n_expert_elems;
    real *w_whole = to_host(&whole, whole.weights, nw), *g_whole = to_host(&whole, whole.grads, nw);
    int compared = 0;
    for (int s = 0; s < 3; s++) {
        const int64_t ns = st[s].n_dense_elems + st[s].n_expert_elems;
        real *w = to_host(&st[s], st[s].weights, ns), *g = to_host(&st[s], st[s].grads, ns);
        for (int i = 0; i < st[s].n_params; i++) {
            const ParamInfo *p = &st[s].params[i], *q = model_find_param(&whole, p->name);
            assert_non_null(q);
            if (memcmp(w + p->offset, w_whole + q->offset, (size_t)p->numel * sizeof(real)) != 0)
                fail_msg("%s: %s: initial values differ from the whole model's", mode, p->name);
            if (s == 2 && p->role == PARAM_EMBEDDING) continue;  // the copy; stage 0 holds the sum
            if (memcmp(g + p->offset, g_whole + q->offset, (size_t)p->numel * sizeof(real)) != 0)
                fail_msg("%s: %s gradient differs from the whole model's", mode, p->name);
            compared++;
        }
        free(w);
        free(g);
    }
    assert_int_equal(compared, whole.n_params);
    printf("cuda %s, MTP depth %d: %d gradients and the loss terms bitwise equal over 3 stages (loss %.6f)\n", mode,
           mtp_depth, compared, (double)loss);
    free(w_whole);
    free(g_whole);
    for (int i = 0; i < 2; i++) {
        device_free(DEVICE_CUDA, act[i]);
        device_free(DEVICE_CUDA, grad[i]);
    }
    for (int s = 0; s < 3; s++) {
        chunk_acts_free(sa[s]);
        model_free(&st[s]);
    }
    chunk_acts_free(wa);
    model_free(&whole);
}

static void test_three_stages(void **state) {
    (void)state;
    const char *modes[] = {"fp32", "bf16", "fp8"};
    for (int i = 0; i < 3; i++) {
        check_three_stages(modes[i], 0);
        check_three_stages(modes[i], 1);
    }
}

int main(void) {
    if (!gpucheck_devices("test_gpu_placement")) return 1;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_three_stages)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
