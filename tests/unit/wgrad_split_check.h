/*
 * wgrad_split_check.h - the check of tests/unit/test_wgrad_split.c (CPU) and tests/gpu/test_gpu_wgrad_split.c
 * (GPU): the backward split into its input-gradient part and its weight-gradient part (the pipeline schedules' I
 * and W: train/model.h chunk_backward_input / chunk_backward_weights, the W ticket of train/wgrad_ticket.h) against
 * the full backward on the same device, in one precision mode (the tiny model: a dense and two MoE layers, MTP
 * depth 1, two micro-batches):
 *   - F0 F1 I0 I1: every block Linear's gradient (roles PARAM_BLOCK_LINEAR and PARAM_ROUTED_EXPERT) is still
 *     zero, the W tickets hold GEMMs, and every other tensor's gradient is, bit for bit, what F0 B0 F1 B1 gives;
 *   - then W0 W1: every gradient is F0 B0 F1 B1's, bit for bit, and the tickets are empty;
 *   - the same again in a second step, after the tickets have been remade as one block each (their storage is
 *     reused, not reallocated: a stale operand would show as a differing gradient).
 * Both sides run the same kernels on the same device in the same order, so the comparison is exact. The order
 * F0 F1 I0 I1 W0 W1 is ZB1P's at its last stage with two micro-batches in flight; what it checks is that
 * deferring the Wgrads changes no product and no order of accumulation. Include after cmocka.h.
 */
#ifndef FP8MOE_TESTS_WGRAD_SPLIT_CHECK_H
#define FP8MOE_TESTS_WGRAD_SPLIT_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/rng.h"
#include "tests/unit/token_batch.h"
#include "train/config.h"
#include "train/model.h"

enum { SPLIT_B = 2, SPLIT_T = 16, SPLIT_MB = 2 };

static void split_load_tiny(Config *cfg, const char *mode, Device dev) {
    char err[1024], m[64];
    snprintf(m, sizeof m, "precision.mode=%s", mode);
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", m, "train.threads=1",
                        dev == DEVICE_CUDA ? "train.device=cuda" : "train.device=cpu"};
    if (config_load(cfg, "configs/tiny.ini", ov, 5, err, sizeof err) != 0) fail_msg("%s", err);
}

static void split_random_batch(int *inputs, int *targets, uint64_t seed) {
    token_batch(inputs, targets, SPLIT_B, SPLIT_T, rng_key(seed, 7, 8, 9));
}

static int split_is_block_linear(const ParamInfo *p) {
    return p->role == PARAM_BLOCK_LINEAR || p->role == PARAM_ROUTED_EXPERT;
}

static int split_all_zero(const real *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != 0) return 0;
    return 1;
}

// Every tensor's gradient in `split` against `full`'s: bitwise, or (only_others) bitwise for tensors that are not
// block Linears and all zero for those that are. Returns the number of tensors compared bitwise.
static int split_compare_grads(const Model *full, const Model *split, int only_others, const char *what) {
    const int64_t n = full->n_dense_elems + full->n_expert_elems;
    real *full_g = malloc((size_t)n * sizeof(real)), *split_g = malloc((size_t)n * sizeof(real));
    assert_true(full_g && split_g);
    device_memcpy_to_host(full->rc.dev, full_g, full->grads, (size_t)n * sizeof(real));
    device_memcpy_to_host(split->rc.dev, split_g, split->grads, (size_t)n * sizeof(real));
    int bitwise = 0;
    for (int i = 0; i < full->n_params; i++) {
        const ParamInfo *p = &full->params[i];
        const real *g = split_g + p->offset, *want = full_g + p->offset;
        if (only_others && split_is_block_linear(p)) {
            if (!split_all_zero(g, p->numel)) fail_msg("%s: %s has a gradient before its W ticket ran", what, p->name);
            continue;
        }
        if (memcmp(g, want, (size_t)p->numel * sizeof(real)) != 0)
            fail_msg("%s: %s's gradient differs from the full backward's", what, p->name);
        bitwise++;
    }
    free(full_g);
    free(split_g);
    return bitwise;
}

static void check_split(const char *mode, Device dev) {
    Config cfg;
    split_load_tiny(&cfg, mode, dev);
    char err[256];
    Model full, split;
    assert_int_equal(model_create(&full, &cfg, dev, 1, err, sizeof err), 0);
    assert_int_equal(model_create(&split, &cfg, dev, 1, err, sizeof err), 0);
    int inputs[SPLIT_MB][SPLIT_B * SPLIT_T], targets[SPLIT_MB][SPLIT_B * SPLIT_T];
    ChunkActs *fa[SPLIT_MB], *sa[SPLIT_MB];
    for (int k = 0; k < SPLIT_MB; k++) {
        fa[k] = chunk_acts_create(&full, 0, SPLIT_B, SPLIT_T);
        sa[k] = chunk_acts_create(&split, 0, SPLIT_B, SPLIT_T);
        assert_non_null(fa[k]);
        assert_non_null(sa[k]);
    }
    int linears = 0;
    for (int i = 0; i < full.n_params; i++) linears += split_is_block_linear(&full.params[i]);
    assert_true(linears > 0 && linears < full.n_params);
    for (int step = 0; step < 2; step++) {
        for (int k = 0; k < SPLIT_MB; k++)
            split_random_batch(inputs[k], targets[k], 100 * (uint64_t)step + (uint64_t)k + 1);
        model_zero_grads(&full);
        model_zero_grads(&split);
        // F0 B0 F1 B1
        real loss_full[SPLIT_MB], loss_split[SPLIT_MB];
        for (int k = 0; k < SPLIT_MB; k++) {
            loss_full[k] = chunk_forward(&full, 0, fa[k], inputs[k], targets[k], NULL, NULL);
            chunk_backward(&full, 0, fa[k], NULL, NULL, (real)(1.0 / SPLIT_MB));
        }
        // F0 F1 I0 I1, then W0 W1
        for (int k = 0; k < SPLIT_MB; k++)
            loss_split[k] = chunk_forward(&split, 0, sa[k], inputs[k], targets[k], NULL, NULL);
        assert_memory_equal(loss_split, loss_full, sizeof loss_full);
        for (int k = 0; k < SPLIT_MB; k++) {
            chunk_backward_input(&split, 0, sa[k], NULL, NULL, (real)(1.0 / SPLIT_MB));
            assert_true(chunk_weights_pending(sa[k]));
        }
        char what[64];
        snprintf(what, sizeof what, "%s step %d after I0 I1", mode, step + 1);
        const int others = split_compare_grads(&full, &split, 1, what);
        assert_int_equal(others, full.n_params - linears);
        for (int k = 0; k < SPLIT_MB; k++) {
            chunk_backward_weights(&split, sa[k]);
            assert_false(chunk_weights_pending(sa[k]));
        }
        snprintf(what, sizeof what, "%s step %d after W0 W1", mode, step + 1);
        assert_int_equal(split_compare_grads(&full, &split, 0, what), full.n_params);
        print_message("%s on %s, step %d: %d block Linear gradients deferred to W, all %d gradients bitwise equal\n",
                      mode, device_name(dev), step + 1, linears, full.n_params);
    }
    for (int k = 0; k < SPLIT_MB; k++) {
        chunk_acts_free(fa[k]);
        chunk_acts_free(sa[k]);
    }
    model_free(&full);
    model_free(&split);
}

#endif
