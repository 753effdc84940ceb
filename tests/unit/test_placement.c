/*
 * test_placement.c - the model built for a placement (a rank's share: a range of layers, the ends it
 * holds, a range of experts) against the whole model, on the CPU:
 *   - a placement holds exactly the whole model's tensors that it should, by global name, shape and
 *     role, with bitwise-identical initial values, and its flat buffer is those tensors and nothing more;
 *   - a Stage holding experts 4-7 of 8 has the initial weights of those experts of the whole model;
 *   - the model cut into three stages, each its own Model run one after another with the boundary
 *     activations and gradients handed over in device buffers, gives the whole model's losses and every
 *     gradient bit for bit, in fp32, bf16 and fp8 (the loss terms too; their weighted sum within
 *     1e-6, as the stages add the balance terms in another order). With MTP the last stage holds a copy of the
 *     embedding; its gradient is handed to the first stage before that stage's backward (the tied-
 *     embedding reduction), which keeps the whole model's accumulation order for one micro-batch.
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
#include "tests/unit/token_batch.h"
#include "train/config.h"
#include "train/model.h"

enum { B = 2, T = 16 };

static void load_tiny(Config *cfg, const char *mode, int mtp_depth, int n_layers) {
    char err[1024], m[64], d[64], l[64];
    snprintf(m, sizeof m, "precision.mode=%s", mode);
    snprintf(d, sizeof d, "mtp.depth=%d", mtp_depth);
    snprintf(l, sizeof l, "model.n_layers=%d", n_layers);
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", m, d, l, "train.threads=1"};
    if (config_load(cfg, "configs/tiny.ini", ov, 6, err, sizeof err) != 0) fail_msg("%s", err);
}

static void random_batch(int *inputs, int *targets, uint64_t seed) {
    token_batch(inputs, targets, B, T, rng_key(seed, 4, 5, 6));
}

// Every tensor of `part` is the tensor of the same global name in `whole`, with the same shape, role and
// initial values; `part` has exactly `expected` tensors and its buffer holds them and nothing else.
static void check_part_of(const Model *whole, const Model *part, int expected) {
    assert_int_equal(part->n_params, expected);
    int64_t elems = 0;
    for (int i = 0; i < part->n_params; i++) {
        const ParamInfo *p = &part->params[i];
        const ParamInfo *q = model_find_param(whole, p->name);
        if (!q) fail_msg("%s is not a tensor of the whole model", p->name);
        assert_int_equal(p->ndim, q->ndim);
        assert_memory_equal(p->shape, q->shape, sizeof p->shape);
        assert_int_equal(p->role, q->role);
        assert_int_equal(p->expert, q->expert);
        if (memcmp(part->weights + p->offset, whole->weights + q->offset, (size_t)p->numel * sizeof(real)) != 0)
            fail_msg("%s: initial values differ from the whole model's", p->name);
        elems += p->numel;
    }
    assert_int_equal(part->n_dense_elems + part->n_expert_elems, elems);
}

// The whole model's tensors that a placement should hold, counted from the whole model's table.
static int count_expected(const Model *whole, const Placement *pl) {
    int n = 0;
    for (int i = 0; i < whole->n_params; i++) {
        const ParamInfo *p = &whole->params[i];
        int in_layers = p->layer >= pl->chunk[0].first_layer && p->layer < pl->chunk[0].first_layer + pl->chunk[0].n_layers;
        int in_experts = p->expert < 0 || (p->expert >= pl->expert0 && p->expert < pl->expert0 + pl->n_experts);
        int ends = p->role == PARAM_EMBEDDING ? pl->has_embedding : pl->has_head;  // layer -1: embedding or head side
        n += (p->layer >= 0 ? in_layers : ends) && in_experts;
    }
    return n;
}

static void test_stage_tensors(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg, "fp32", 1, 3);
    Model whole;
    char err[256];
    assert_int_equal(model_create(&whole, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    for (int s = 0; s < 3; s++) {
        Placement pl;
        assert_int_equal(placement_stages(&cfg, &s, 1, 3, &pl, err, sizeof err), 0);
        assert_int_equal(pl.chunk[0].first_layer, s);
        assert_int_equal(pl.chunk[0].n_layers, 1);
        Model part;
        assert_int_equal(model_create_placement(&part, &cfg, DEVICE_CPU, &pl, err, sizeof err), 0);
        check_part_of(&whole, &part, count_expected(&whole, &pl));
        // the ends by hand: the embedding on stage 0 and (for MTP) stage 2; the head and MTP on stage 2 only
        assert_int_equal(model_find_param(&part, "embed.weight") != NULL, s == 0 || s == 2);
        assert_int_equal(model_find_param(&part, "head.weight") != NULL, s == 2);
        assert_int_equal(model_find_param(&part, "mtp.0.eh_proj.weight") != NULL, s == 2);
        char name[64];
        snprintf(name, sizeof name, "layers.%d.attn.wkv_a.weight", s);
        assert_non_null(model_find_param(&part, name));
        snprintf(name, sizeof name, "layers.%d.attn.wkv_a.weight", (s + 1) % 3);
        assert_null(model_find_param(&part, name));
        model_free(&part);
    }
    Placement bad;
    assert_int_equal(placement_stages(&cfg, (const int[]){0}, 1, 4, &bad, err, sizeof err), -1);  // 4 stages of 3 layers
    assert_non_null(strstr(err, "model.n_layers = 3"));
    model_free(&whole);
}

// parallel.stage_layers places the stages' layers as listed: tiny.ini with 5 layers in stages of 1, 3 and 1.
static void test_stage_layers_listed(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg, "fp32", 1, 5);
    snprintf(cfg.parallel.stage_layers, sizeof cfg.parallel.stage_layers, "1,3,1");
    cfg.parallel.n_stage_layers = 3, cfg.parallel.stage_layer_count[0] = 1, cfg.parallel.stage_layer_count[1] = 3;
    cfg.parallel.stage_layer_count[2] = 1;
    char err[256];
    const int want_first[3] = {0, 1, 4}, want_n[3] = {1, 3, 1};
    for (int s = 0; s < 3; s++) {
        Placement pl;
        assert_int_equal(placement_stages(&cfg, &s, 1, 3, &pl, err, sizeof err), 0);
        assert_int_equal(pl.chunk[0].first_layer, want_first[s]);
        assert_int_equal(pl.chunk[0].n_layers, want_n[s]);
    }
    Placement even;  // another stage count than the list's: the even split
    const int s0 = 0;
    assert_int_equal(placement_stages(&cfg, &s0, 1, 2, &even, err, sizeof err), 0);
    assert_int_equal(even.chunk[0].n_layers, 3);
}

static void test_stage_experts_4_to_7(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg, "fp32", 1, 3);
    Model whole, part;
    char err[256];
    assert_int_equal(model_create(&whole, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    Placement pl = placement_whole(&cfg);
    assert_int_equal(placement_set_experts(&cfg, &pl, 4, 4, err, sizeof err), 0);
    assert_int_equal(model_create_placement(&part, &cfg, DEVICE_CPU, &pl, err, sizeof err), 0);
    check_part_of(&whole, &part, count_expected(&whole, &pl));
    assert_null(model_find_param(&part, "layers.1.ffn.experts.3.w1.weight"));
    const ParamInfo *p = model_find_param(&part, "layers.1.ffn.experts.4.w1.weight");
    const ParamInfo *q = model_find_param(&whole, "layers.1.ffn.experts.4.w1.weight");
    assert_non_null(p);
    assert_int_equal(p->reduce, REDUCE_EDP);
    // the stacked pointer of the layer's w1 is the first local expert's, and holds that expert's values
    assert_ptr_equal(part.w.blocks[1].moe.experts.w1, part.weights + p->offset);
    assert_memory_equal(part.w.blocks[1].moe.experts.w1, whole.weights + q->offset, (size_t)q->numel * sizeof(real));
    // a quarter of the experts' memory: 4 of 8 experts
    assert_int_equal(2 * part.n_expert_elems, whole.n_expert_elems);
    assert_int_equal(part.n_dense_elems, whole.n_dense_elems);
    assert_int_equal(placement_set_experts(&cfg, &pl, 6, 4, err, sizeof err), -1);
    // its MoE layers need expert parallelism to run: refused, not run wrongly
    assert_null(chunk_acts_create(&part, 0, B, T));
    model_free(&part);
    model_free(&whole);
}

// The whole model against three stages for one micro-batch in `mode`: losses and every gradient bitwise.
static void check_three_stages(const char *mode, int mtp_depth) {
    Config cfg;
    load_tiny(&cfg, mode, mtp_depth, 3);
    const int D = cfg.model.dim, N = B * T;
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 11);
    char err[256];
    Model whole, st[3];
    assert_int_equal(model_create(&whole, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    for (int s = 0; s < 3; s++) {
        Placement pl;
        assert_int_equal(placement_stages(&cfg, &s, 1, 3, &pl, err, sizeof err), 0);
        assert_int_equal(model_create_placement(&st[s], &cfg, DEVICE_CPU, &pl, err, sizeof err), 0);
    }
    // whole model
    ChunkActs *wa = chunk_acts_create(&whole, 0, B, T);
    model_zero_grads(&whole);
    const real loss_whole = chunk_forward(&whole, 0, wa, inputs, targets, NULL, NULL);
    const LossTerms lt_whole = chunk_losses(wa);
    chunk_backward(&whole, 0, wa, NULL, NULL, 1);
    // three stages, boundary tensors in device buffers
    ChunkActs *sa[3];
    real *act[2], *grad[2];
    for (int i = 0; i < 2; i++) {
        act[i] = device_alloc(DEVICE_CPU, (size_t)N * D * sizeof(real));
        grad[i] = device_alloc(DEVICE_CPU, (size_t)N * D * sizeof(real));
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
            memcpy(st[0].grads + e0->offset, st[2].grads + e2->offset, (size_t)e0->numel * sizeof(real));
        }
        chunk_backward(&st[s], 0, sa[s], s < 2 ? grad[s] : NULL, s ? grad[s - 1] : NULL, 1);
    }
    // the loss terms bitwise; their weighted sum within rounding, since the stages add their balance
    // terms in another order than the whole model does (the sum is reported, never differentiated)
    assert_memory_equal(&lt.main, &lt_whole.main, sizeof lt.main);
    assert_true(fabs((double)loss - (double)loss_whole) <= 1e-6 * fabs((double)loss_whole));
    if (mtp_depth > 0) assert_memory_equal(&lt.mtp[0], &lt_whole.mtp[0], sizeof lt.mtp[0]);
    int compared = 0;
    for (int i = 0; i < whole.n_params; i++) {
        const ParamInfo *q = &whole.params[i];
        const Model *owner = NULL;
        const ParamInfo *p = NULL;
        for (int s = 0; s < 3 && !owner; s++) {  // the embedding: stage 0's, which holds the sum
            if ((p = model_find_param(&st[s], q->name))) owner = &st[s];
        }
        assert_non_null(owner);
        if (memcmp(owner->grads + p->offset, whole.grads + q->offset, (size_t)q->numel * sizeof(real)) != 0)
            fail_msg("%s: %s gradient differs from the whole model's", mode, q->name);
        compared++;
    }
    assert_int_equal(compared, whole.n_params);
    print_message("%s, MTP depth %d: loss %.6f and %d gradients bitwise equal over 3 stages\n", mode, mtp_depth,
                  (double)loss, compared);
    for (int i = 0; i < 2; i++) {
        device_free(DEVICE_CPU, act[i]);
        device_free(DEVICE_CPU, grad[i]);
    }
    for (int s = 0; s < 3; s++) {
        chunk_acts_free(sa[s]);
        model_free(&st[s]);
    }
    chunk_acts_free(wa);
    model_free(&whole);
}

static void test_three_stages_fp32(void **state) {
    (void)state;
    check_three_stages("fp32", 0);
    check_three_stages("fp32", 1);
}
static void test_three_stages_bf16(void **state) {
    (void)state;
    check_three_stages("bf16", 0);
    check_three_stages("bf16", 1);
}
static void test_three_stages_fp8(void **state) {
    (void)state;
    check_three_stages("fp8", 0);
    check_three_stages("fp8", 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stage_tensors),
        cmocka_unit_test(test_stage_experts_4_to_7),
        cmocka_unit_test(test_stage_layers_listed),
        cmocka_unit_test(test_three_stages_fp32),
        cmocka_unit_test(test_three_stages_bf16),
        cmocka_unit_test(test_three_stages_fp8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
