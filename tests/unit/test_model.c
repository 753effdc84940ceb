/*
 * test_model.c - model-level behaviour of the CPU reference: MTP target alignment, parameter table
 * layout, chunk equivalence (the same micro-batch through one chunk or three gives the same loss and
 * gradients, the property pipeline parallelism relies on), determinism across thread counts, load
 * counting only when asked, frozen routing, the FP8 GEMM count of fp8 mode and its weight cache, and the
 * grouped Linears of the routed experts against the same Linears group by group.
 */
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/rng.h"
#include "tests/unit/token_batch.h"
#include "train/config.h"
#include "train/linear.h"
#include "train/model.h"

enum { B = 2, T = 16 };

static void load_tiny(Config *cfg) {
    char err[1024];
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2"};
    int rc = config_load(cfg, "configs/tiny.ini", ov, 2, err, sizeof err);
    if (rc != 0) fail_msg("%s", err);
}

static void random_batch(int *inputs, int *targets, uint64_t seed) {
    token_batch(inputs, targets, B, T, rng_key(seed, 1, 2, 3));
}

// Runs forward + backward of one micro-batch through all chunks, its gradients added to m's; returns the loss.
static double forward_backward(Model *m, const int *inputs, const int *targets) {
    int D = m->cfg.model.dim;
    real *h[2] = {calloc((size_t)B * T * D, sizeof(real)), calloc((size_t)B * T * D, sizeof(real))};
    ChunkActs **acts = calloc((size_t)m->n_chunks, sizeof(ChunkActs *));
    real **hidden = calloc((size_t)m->n_chunks, sizeof(real *));
    double loss = 0;
    for (int c = 0; c < m->n_chunks; c++) {
        acts[c] = chunk_acts_create(m, c, B, T);
        hidden[c] = calloc((size_t)B * T * D, sizeof(real));
        loss += chunk_forward(m, c, acts[c], inputs, targets, c ? hidden[c - 1] : NULL,
                              c < m->n_chunks - 1 ? hidden[c] : NULL);
    }
    for (int c = m->n_chunks - 1; c >= 0; c--) {
        real *din = c ? h[c % 2] : NULL;
        chunk_backward(m, c, acts[c], c < m->n_chunks - 1 ? h[(c + 1) % 2] : NULL, din, 1);
    }
    for (int c = 0; c < m->n_chunks; c++) {
        chunk_acts_free(acts[c]);
        free(hidden[c]);
    }
    free(acts);
    free(hidden);
    free(h[0]);
    free(h[1]);
    return loss;
}

// The same from cleared gradients.
static double run_step(Model *m, const int *inputs, const int *targets) {
    model_zero_grads(m);
    return forward_backward(m, inputs, targets);
}

static void test_mtp_alignment(void **state) {
    (void)state;
    // two sequences of T=4; targets[i] = t_{i+1}: sequence 0 is t = 10 11 12 13 14, sequence 1 is 20..24
    const int targets[8] = {11, 12, 13, 14, 21, 22, 23, 24};
    int tok[8], tgt[8];
    model_mtp_tokens(tok, tgt, targets, 2, 4, 1);
    // depth 1 at position i: input t_{i+1}, target t_{i+2}; the last position is masked (input 0)
    const int tok1[8] = {11, 12, 13, 0, 21, 22, 23, 0}, tgt1[8] = {12, 13, 14, -1, 22, 23, 24, -1};
    assert_memory_equal(tok, tok1, sizeof tok);
    assert_memory_equal(tgt, tgt1, sizeof tgt);
    model_mtp_tokens(tok, tgt, targets, 2, 4, 2);
    // depth 2: input t_{i+2}, target t_{i+3}; the last two positions are masked (input 0)
    const int tok2[8] = {12, 13, 0, 0, 22, 23, 0, 0}, tgt2[8] = {13, 14, -1, -1, 23, 24, -1, -1};
    assert_memory_equal(tok, tok2, sizeof tok);
    assert_memory_equal(tgt, tgt2, sizeof tgt);
}

static void test_param_table(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg);
    Model m;
    char err[256];
    assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    // every tensor is in the buffer once: offsets are contiguous, non-expert tensors before expert ones
    int64_t next = 0;
    int seen_expert = 0;
    for (int i = 0; i < m.n_params; i++) {
        assert_int_equal(m.params[i].offset, next);
        next += m.params[i].numel;
        if (m.params[i].is_expert) seen_expert = 1;
        else assert_false(seen_expert);
    }
    assert_int_equal(next, model_num_params(&m));
    assert_int_equal(m.n_expert_elems, (int64_t)(cfg.model.n_layers - cfg.model.n_dense_layers + cfg.mtp.depth) *
                                           cfg.moe.n_routed_experts * 3 * cfg.moe.moe_inter_dim * cfg.model.dim);
    // shapes by hand for tiny.ini: wkv_a is (kv_lora_rank + qk_rope_head_dim, dim) = (20, 32)
    const ParamInfo *p = model_find_param(&m, "layers.1.attn.wkv_a.weight");
    assert_non_null(p);
    assert_int_equal(p->shape[0], 20);
    assert_int_equal(p->shape[1], 32);
    p = model_find_param(&m, "mtp.0.eh_proj.weight");
    assert_non_null(p);
    assert_int_equal(p->shape[1], 64);
    assert_non_null(model_find_param(&m, "layers.2.ffn.experts.7.w2.weight"));
    assert_null(model_find_param(&m, "layers.0.ffn.gate.weight"));  // layer 0 is dense
    assert_true(model_find_param(&m, "layers.1.ffn_norm.weight")->no_decay);
    // the stacked expert pointer of layer 2 w2 is expert 0's table entry
    assert_ptr_equal(m.w.blocks[2].moe.experts.w2, m.weights + model_find_param(&m, "layers.2.ffn.experts.0.w2.weight")->offset);
    // active parameters: all but the embedding, with K/E of the routed experts
    int64_t dense = m.n_dense_elems - (int64_t)cfg.model.vocab_size * cfg.model.dim;
    int64_t routed = m.n_expert_elems * cfg.moe.n_activated_experts / cfg.moe.n_routed_experts;
    assert_int_equal(model_active_params(&m), dense + routed);
    model_free(&m);
}

static void test_chunk_equivalence(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg);
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 5);
    Model one, three;
    char err[256];
    assert_int_equal(model_create(&one, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    assert_int_equal(model_create(&three, &cfg, DEVICE_CPU, 3, err, sizeof err), 0);
    assert_int_equal(three.chunks[1].n_blocks, 1);
    double l1 = run_step(&one, inputs, targets);
    double l3 = run_step(&three, inputs, targets);
    // every gradient is the same arithmetic in the same order: bitwise equal, not just close. The
    // returned loss adds the chunks' balance terms in another order, so it is equal to rounding.
    assert_true(fabs(l1 - l3) <= 1e-6 * fabs(l1));
    assert_memory_equal(one.grads, three.grads, (size_t)model_num_params(&one) * sizeof(real));
    model_free(&one);
    model_free(&three);
}

static void test_determinism_threads(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg);
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 9);
    Model m;
    char err[256];
    assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    size_t bytes = (size_t)model_num_params(&m) * sizeof(real);
    real *g1 = malloc(bytes);
    omp_set_num_threads(1);
    double l1 = run_step(&m, inputs, targets);
    memcpy(g1, m.grads, bytes);
    omp_set_num_threads(3);
    double l3 = run_step(&m, inputs, targets);
    omp_set_num_threads(omp_get_num_procs());
    assert_true(l1 == l3);
    assert_memory_equal(g1, m.grads, bytes);
    free(g1);
    model_free(&m);
}

// A training step's gradient clearing (model_zero_grads_for_step, model_finish_step_grads): the routed experts' stacks
// are not cleared but written by the step's first Wgrad into each (the old contents, NaN here, never read), then added
// to; the gradients of two micro-batches must equal those from model_zero_grads in every mode (values compared, so a
// zero's sign may differ). A step whose backward never ran leaves the stacks zero.
static void test_step_grad_stacks(void **state) {
    (void)state;
    const char *modes[3] = {"fp8", "bf16", "fp32"};
    for (int k = 0; k < 3; k++) {
        Config cfg;
        char err[1024], ov_mode[32];
        snprintf(ov_mode, sizeof ov_mode, "precision.mode=%s", modes[k]);
        const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", ov_mode};
        if (config_load(&cfg, "configs/tiny.ini", ov, 3, err, sizeof err) != 0) fail_msg("%s", err);
        int in_a[B * T], tg_a[B * T], in_b[B * T], tg_b[B * T];
        random_batch(in_a, tg_a, 21), random_batch(in_b, tg_b, 22);
        Model m;
        assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
        assert_true(m.rc.n_grad_stacks == 3 * m.n_moe_layers && m.n_moe_layers > 0);
        const int64_t n = model_num_params(&m);
        real *ref = malloc((size_t)n * sizeof(real));
        model_zero_grads(&m);
        forward_backward(&m, in_a, tg_a), forward_backward(&m, in_b, tg_b);
        memcpy(ref, m.grads, (size_t)n * sizeof(real));
        for (int64_t i = 0; i < n; i++) m.grads[i] = NAN;
        model_zero_grads_for_step(&m);
        forward_backward(&m, in_a, tg_a), forward_backward(&m, in_b, tg_b);
        model_finish_step_grads(&m);
        int64_t differing = 0, expert_moved = 0;
        for (int64_t i = 0; i < n; i++) differing += !(m.grads[i] == ref[i]);
        for (int64_t i = m.n_dense_elems; i < n; i++) expert_moved += ref[i] != 0;
        assert_int_equal(differing, 0);
        assert_true(expert_moved > 0);
        for (int64_t i = 0; i < n; i++) m.grads[i] = NAN;  // no backward at all: the stacks come out zero
        model_zero_grads_for_step(&m);
        model_finish_step_grads(&m);
        for (int64_t i = 0; i < n; i++) differing += m.grads[i] != 0;
        assert_int_equal(differing, 0);
        free(ref);
        model_free(&m);
    }
}

static void test_load_counting_and_freeze(void **state) {
    (void)state;
    Config cfg;
    load_tiny(&cfg);
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 3);
    Model m;
    char err[256];
    assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    ChunkActs *a = chunk_acts_create(&m, 0, B, T);
    int E = cfg.moe.n_routed_experts, K = cfg.moe.n_activated_experts;
    int64_t n_counts = (int64_t)m.n_moe_layers * E;
    chunk_forward(&m, 0, a, inputs, targets, NULL, NULL);  // count_load is off: an eval pass
    for (int64_t i = 0; i < n_counts; i++) assert_int_equal(m.expert_load[i], 0);
    m.count_load = 1;
    double loss = chunk_forward(&m, 0, a, inputs, targets, NULL, NULL);
    for (int l = 0; l < m.n_moe_layers; l++) {  // every token is counted K times per MoE layer
        int64_t total = 0;
        for (int e = 0; e < E; e++) total += m.expert_load[l * E + e];
        assert_int_equal(total, (int64_t)B * T * K);
    }
    // with routing frozen, a bias that would change the choices changes nothing
    m.count_load = 0;
    m.freeze_routing = 1;
    for (int64_t i = 0; i < n_counts; i++) m.router_bias[i] = (real)(i % 3);
    double frozen = chunk_forward(&m, 0, a, inputs, targets, NULL, NULL);
    assert_true(loss == frozen);
    m.freeze_routing = 0;
    double moved = chunk_forward(&m, 0, a, inputs, targets, NULL, NULL);
    assert_true(moved != loss);
    LossTerms lt = chunk_losses(a);
    assert_int_equal(lt.n_valid, B * T);
    assert_true(lt.main > 4.0 && lt.main < 7.0);  // ~ln(256) = 5.55 at initialisation
    chunk_acts_free(a);
    model_free(&m);
}

// In fp8 mode every block Linear runs 3 FP8 GEMMs per micro-batch (Fprop, Dgrad, Wgrad), and nothing
// else does; and the scratch sized when the activations are created is never grown by a step. The expected count comes from the parameter table: every 2-D tensor except the embedding,
// the output head and the routers is a block Linear; a routed expert's Linears run only when the
// expert received tokens.
static void test_fp8_gemm_count(void **state) {
    (void)state;
    Config cfg;
    char err[1024];
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2"};
    if (config_load(&cfg, "configs/tiny-fp8.ini", ov, 2, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(cfg.precision.mode, PRECISION_FP8);
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 21);
    Model m;
    assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    ChunkActs *a = chunk_acts_create(&m, 0, B, T);  // sizes the FP8 scratch for B*T tokens
    size_t reserved = m.rc.linear_scratch_bytes;
    chunk_acts_free(a);
    assert_true(reserved > 0);
    m.count_load = 1;
    run_step(&m, inputs, targets);
    assert_int_equal(m.rc.linear_scratch_bytes, reserved);  // no Linear had to grow it during the step
    int E = cfg.moe.n_routed_experts;
    int64_t linears = 0;
    for (int i = 0; i < m.n_params; i++) {
        const ParamInfo *p = &m.params[i];
        if (p->ndim != 2 || strcmp(p->name, "embed.weight") == 0 || strcmp(p->name, "head.weight") == 0 ||
            strstr(p->name, ".ffn.gate.weight"))
            continue;
        if (!p->is_expert) {
            linears++;
            continue;
        }
        // "<block>.ffn.experts.<e>.w<j>.weight": which MoE layer is the block's moe_index
        const char *x = strstr(p->name, ".ffn.experts.");
        int e = atoi(x + strlen(".ffn.experts."));
        char block[MODEL_NAME_MAX];
        snprintf(block, sizeof block, "%.*s", (int)(x - p->name), p->name);
        int moe_index = strncmp(block, "mtp.", 4) == 0 ? m.w.mtp[atoi(block + 4)].block.moe_index
                                                       : m.w.blocks[atoi(block + strlen("layers."))].moe_index;
        if (m.expert_load[(int64_t)moe_index * E + e] > 0) linears++;
    }
    assert_true(linears > 20);
    assert_int_equal(m.rc.fp8_gemm_count, 3 * linears);
    model_free(&m);
}

// The FP8 weight cache (train/linear.c) keeps each block Linear's 128x128 quantisation until
// model_weights_changed. After the weights change and the call, a model gives bitwise the loss and
// gradients of a fresh model holding the same weights; without the call it keeps the stale quantisation
// and does not (which shows that the cache is used at all).
static void test_fp8_weight_cache(void **state) {
    (void)state;
    Config cfg;
    char err[1024];
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2"};
    if (config_load(&cfg, "configs/tiny-fp8.ini", ov, 2, err, sizeof err) != 0) fail_msg("%s", err);
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 23);
    Model a, fresh;
    assert_int_equal(model_create(&a, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    run_step(&a, inputs, targets);  // fills the cache
    const int64_t n = a.n_dense_elems + a.n_expert_elems;
    for (int64_t i = 0; i < n; i++) a.weights[i] *= (real)1.01;  // every weight, the Linears' included
    model_weights_changed(&a);
    const double loss_a = run_step(&a, inputs, targets);
    assert_int_equal(model_create(&fresh, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    memcpy(fresh.weights, a.weights, (size_t)n * sizeof(real));
    model_weights_changed(&fresh);
    const double loss_fresh = run_step(&fresh, inputs, targets);
    assert_memory_equal(&loss_a, &loss_fresh, sizeof loss_a);
    assert_memory_equal(a.grads, fresh.grads, (size_t)n * sizeof(real));
    // negative control: weights changed again, the call left out
    for (int64_t i = 0; i < n; i++) a.weights[i] *= (real)1.01, fresh.weights[i] *= (real)1.01;
    model_weights_changed(&fresh);
    const double stale = run_step(&a, inputs, targets), current = run_step(&fresh, inputs, targets);
    assert_true(stale != current);
    model_free(&a);
    model_free(&fresh);
}

// linear_*_grouped (the routed experts: one call for all experts, in fp8 mode one quantisation launch for
// all segments) give bitwise what the plain calls give group by group: outputs, input gradient and every
// expert's weight gradients, for w1 alone and for w1 and w3 sharing their input, with empty groups and
// group lengths off 16, in each precision mode, and (fp8, bf16) with the input read through a row index. Layer 1
// of configs/tiny-fp8.ini: 8 experts, D = I = 384.
static void fill_random(real *x, size_t n, uint64_t seed) {
    const uint64_t key = rng_key(seed, 7, 8, 9);
    for (size_t i = 0; i < n; i++) x[i] = (real)(2.0 * rng_uniform(key, i) - 1.0);
}

static void check_grouped(const char *mode) {
    Config cfg;
    char err[1024], set_mode[64];
    snprintf(set_mode, sizeof set_mode, "precision.mode=%s", mode);
    const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", set_mode};
    if (config_load(&cfg, "configs/tiny-fp8.ini", ov, 3, err, sizeof err) != 0) fail_msg("%s", err);
    Model m;
    assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
    ChunkActs *acts = chunk_acts_create(&m, 0, B, T);  // sizes the FP8 scratch for B x T x top-K routed rows
    enum { G = 8 };
    const int offsets[G + 1] = {0, 5, 5, 22, 40, 41, 41, 60, 64}, R = offsets[G];
    const int D = cfg.model.dim, I = cfg.moe.moe_inter_dim;
    assert_true(R <= B * T * cfg.moe.n_activated_experts && G == cfg.moe.n_routed_experts);
    const ParamInfo *p1 = model_find_param(&m, "layers.1.ffn.experts.0.w1.weight");
    const ParamInfo *p3 = model_find_param(&m, "layers.1.ffn.experts.0.w3.weight");
    assert_non_null(p1);
    assert_non_null(p3);
    const real *const w[2] = {m.weights + p1->offset, m.weights + p3->offset};
    real *const gw[2] = {m.grads + p1->offset, m.grads + p3->offset};
    const size_t wn = (size_t)G * I * D;
    real *x = malloc(sizeof(real) * R * D), *dy[2], *out_g[2], *out_p[2], *dx_g = calloc((size_t)R * D, sizeof(real));
    real *dx_p = calloc((size_t)R * D, sizeof(real)), *gw_p[2];
    fill_random(x, (size_t)R * D, 1);
    for (int i = 0; i < 2; i++) {
        dy[i] = malloc(sizeof(real) * R * I), out_g[i] = malloc(sizeof(real) * R * I);
        out_p[i] = malloc(sizeof(real) * R * I), gw_p[i] = malloc(sizeof(real) * wn);
        fill_random(dy[i], (size_t)R * I, 2 + (uint64_t)i);
    }
    for (int n_out = 1; n_out <= 2; n_out++) {
        // group by group with the plain calls
        for (int i = 0; i < n_out; i++) memset(gw[i], 0, sizeof(real) * wn);
        memset(dx_p, 0, sizeof(real) * R * D);
        for (int g = 0; g < G; g++) {
            const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
            if (n == 0) continue;
            real *o[2], *gwg[2];
            const real *wg[2], *dyg[2];
            for (int i = 0; i < n_out; i++) {
                o[i] = out_p[i] + (size_t)r0 * I, wg[i] = w[i] + (size_t)g * I * D, gwg[i] = gw[i] + (size_t)g * I * D;
                dyg[i] = dy[i] + (size_t)r0 * I;
            }
            const int widths[2] = {I, I};
            linear_forward_shared(&m.rc, n_out, o, x + (size_t)r0 * D, wg, n, D, widths, NULL);
            linear_backward_shared(&m.rc, n_out, dx_p + (size_t)r0 * D, GRAD_ADD, gwg, dyg, x + (size_t)r0 * D, wg, n, D, I,
                                   NULL);
        }
        for (int i = 0; i < n_out; i++) memcpy(gw_p[i], gw[i], sizeof(real) * wn);
        // all groups in one call
        for (int i = 0; i < n_out; i++) memset(gw[i], 0, sizeof(real) * wn);
        // dx_g written over poison (GRAD_WRITE): no element of the old contents may survive or be read
        for (size_t k = 0; k < (size_t)R * D; k++) dx_g[k] = (real)NAN;
        linear_forward_grouped(&m.rc, G, offsets, n_out, out_g, x, NULL, w, D, I, NULL, NULL);
        linear_backward_grouped(&m.rc, G, offsets, n_out, dx_g, GRAD_WRITE, NULL, gw, (const real *const *)dy, x, NULL, w,
                                D, I, NULL);
        for (int i = 0; i < n_out; i++) {
            assert_memory_equal(out_g[i], out_p[i], sizeof(real) * R * I);
            assert_memory_equal(gw[i], gw_p[i], sizeof(real) * wn);
        }
        assert_memory_equal(dx_g, dx_p, sizeof(real) * R * D);
        if (m.cfg.precision.mode == PRECISION_FP8) {
            // the input's Wgrad operand kept by the forward (linear.h KeptInput): the same bits, and the backward
            // does not read the input (given as NaNs, which the FP8 quantiser would report)
            const int tiles = linear_kept_tiles(R, G);
            KeptInput kept = {malloc((size_t)D * tiles * FP8_TILE), malloc(sizeof(float) * tiles * D), tiles, D};
            real *out_k[2], *dx_k = calloc((size_t)R * D, sizeof(real)), *x_nan = malloc(sizeof(real) * R * D);
            for (size_t k = 0; k < (size_t)R * D; k++) x_nan[k] = (real)NAN;
            for (int i = 0; i < n_out; i++) out_k[i] = malloc(sizeof(real) * R * I), memset(gw[i], 0, sizeof(real) * wn);
            linear_forward_grouped(&m.rc, G, offsets, n_out, out_k, x, NULL, w, D, I, &kept, NULL);
            linear_backward_grouped(&m.rc, G, offsets, n_out, dx_k, GRAD_WRITE, NULL, gw, (const real *const *)dy, x_nan,
                                    NULL, w, D, I, &kept);
            for (int i = 0; i < n_out; i++) {
                assert_memory_equal(out_k[i], out_p[i], sizeof(real) * R * I);
                assert_memory_equal(gw[i], gw_p[i], sizeof(real) * wn);
                free(out_k[i]);
            }
            assert_memory_equal(dx_k, dx_p, sizeof(real) * R * D);
            free(kept.q), free(kept.s), free(dx_k), free(x_nan);
        }
        if (m.cfg.precision.mode != PRECISION_FP32) {  // the input read through an index: the same bits
            const int S = R + 9;
            real *src = malloc(sizeof(real) * S * D), *out_i[2], *dx_i = calloc((size_t)R * D, sizeof(real));
            int *rows = malloc(sizeof(int) * R);
            fill_random(src, (size_t)S * D, 7);
            for (int r = 0; r < R; r++) {  // x's row r is row (r * 5 + 3) % S of src: a permutation
                rows[r] = (r * 5 + 3) % S;
                memcpy(src + (size_t)rows[r] * D, x + (size_t)r * D, sizeof(real) * D);
            }
            for (int i = 0; i < n_out; i++) out_i[i] = malloc(sizeof(real) * R * I), memset(gw[i], 0, sizeof(real) * wn);
            linear_forward_grouped(&m.rc, G, offsets, n_out, out_i, src, rows, w, D, I, NULL, NULL);
            linear_backward_grouped(&m.rc, G, offsets, n_out, dx_i, GRAD_ADD, NULL, gw, (const real *const *)dy, src, rows, w, D,
                                    I, NULL);  // added to zeros: the same bits as written
            for (int i = 0; i < n_out; i++) {
                assert_memory_equal(out_i[i], out_p[i], sizeof(real) * R * I);
                assert_memory_equal(gw[i], gw_p[i], sizeof(real) * wn);
            }
            assert_memory_equal(dx_i, dx_p, sizeof(real) * R * D);
            if (m.cfg.precision.mode == PRECISION_FP8) {
                // the rows' Fprop operand copied from the operand a token-order call on src made (linear.h
                // SharedFprop): the same outputs
                const int S16 = (S + 15) / 16 * 16, KB = (D + 127) / 128;
                SharedFprop fprop = {malloc((size_t)S16 * KB * 128), malloc(sizeof(float) * KB * S16), S, D};
                real *out_s[2];
                for (int i = 0; i < n_out; i++) out_s[i] = malloc(sizeof(real) * S * I);
                const int whole[2] = {0, S};
                linear_forward_grouped(&m.rc, 1, whole, n_out, out_s, src, NULL, w, D, I, NULL, &fprop);
                for (int i = 0; i < n_out; i++) memset(out_i[i], 0, sizeof(real) * R * I);
                linear_forward_grouped(&m.rc, G, offsets, n_out, out_i, src, rows, w, D, I, NULL, &fprop);
                for (int i = 0; i < n_out; i++) {
                    assert_memory_equal(out_i[i], out_p[i], sizeof(real) * R * I);
                    free(out_s[i]);
                }
                free(fprop.q), free(fprop.s);
            }
            for (int i = 0; i < n_out; i++) free(out_i[i]);
            free(src), free(dx_i), free(rows);
        }
        double sum = 0;  // the outputs are not trivially equal (zeros): the check has something to compare
        for (size_t k = 0; k < (size_t)R * I; k++) sum += fabs((double)out_g[n_out - 1][k]);
        assert_true(sum > 0);
    }
    if (m.cfg.precision.mode != PRECISION_FP32) {
        // The routed experts' token-order input gradient (linear.h unpermute): NT tokens read by 2 rows each
        // through a permutation, the gradient added to the tokens' in k order - the bits of the slot-order
        // gradient (GRAD_WRITE) followed by moe_unpermute_backward - and then two BF16 post arrays' rows in order
        // (kernels.h DgradUnpermute: the shared expert's Dgrad products; rows of bf16_rows_ld(D), padding NaN, 3
        // NaN values between the arrays).
        enum { TOPK = 2 };
        const int NT = R / TOPK;
        int *slot_of = malloc(sizeof(int) * R), *rows = malloc(sizeof(int) * R);
        real *src = malloc(sizeof(real) * NT * D), *dtok = malloc(sizeof(real) * NT * D);
        real *dtok_ref = malloc(sizeof(real) * NT * D);
        fill_random(src, (size_t)NT * D, 11);
        fill_random(dtok, (size_t)NT * D, 12);
        memcpy(dtok_ref, dtok, sizeof(real) * NT * D);
        for (int i = 0; i < R; i++) slot_of[i] = (i * 5 + 3) % R, rows[slot_of[i]] = i / TOPK;
        for (int r = 0; r < R; r++) memcpy(x + (size_t)r * D, src + (size_t)rows[r] * D, sizeof(real) * D);
        for (int i = 0; i < 2; i++) memset(gw[i], 0, sizeof(real) * wn);
        linear_backward_grouped(&m.rc, G, offsets, 2, dx_p, GRAD_WRITE, NULL, gw, (const real *const *)dy, x, NULL, w, D,
                                I, NULL);
        moe_unpermute_backward(DEVICE_CPU, dtok_ref, dx_p, slot_of, NT, TOPK, D);
        const int64_t ld = bf16_rows_ld(D), stride = NT * ld + 3;
        uint16_t *post = malloc(sizeof(uint16_t) * (size_t)(2 * stride));
        assert_non_null(post);
        for (int64_t k = 0; k < 2 * stride; k++) post[k] = 0x7FC0;
        for (int i = 0; i < 2; i++)
            for (int t = 0; t < NT; t++)
                for (int c = 0; c < D; c++) {
                    const float v = (float)src[(size_t)t * D + c] * (i == 0 ? 0.5f : -3.0f);
                    post[i * stride + t * ld + c] = float_to_bf16(v);
                    dtok_ref[(size_t)t * D + c] += (real)bf16_to_float(post[i * stride + t * ld + c]);
                }
        for (int i = 0; i < 2; i++) memcpy(gw_p[i], gw[i], sizeof(real) * wn), memset(gw[i], 0, sizeof(real) * wn);
        const DgradUnpermute unpermute = {.slot_of = slot_of, .n_tok = NT, .topk = TOPK, .post = post, .n_post = 2,
                                          .post_stride = stride};
        linear_backward_grouped(&m.rc, G, offsets, 2, dtok, GRAD_ADD, &unpermute, gw, (const real *const *)dy, src, rows,
                                w, D, I, NULL);
        assert_memory_equal(dtok, dtok_ref, sizeof(real) * NT * D);
        for (int i = 0; i < 2; i++) assert_memory_equal(gw[i], gw_p[i], sizeof(real) * wn);
        free(slot_of), free(rows), free(src), free(dtok), free(dtok_ref), free(post);
    }
    for (int i = 0; i < 2; i++) free(dy[i]), free(out_g[i]), free(out_p[i]), free(gw_p[i]);
    free(x), free(dx_g), free(dx_p);
    chunk_acts_free(acts);
    model_free(&m);
}

static void test_linear_grouped(void **state) {
    (void)state;
    check_grouped("fp8");
    check_grouped("bf16");
    check_grouped("fp32");
}

// moe.n_shared_experts = 0 (range [0, 64]): a MoE without shared experts, in every precision mode. bf16 and fp8
// used to stop at the first forward (train/linear.c: "weight ... (32 x 0) is not a cached block Linear weight":
// the shared expert's empty weights have no cache entry). The loss and every gradient are finite, the shared
// expert's tensors are empty and get no gradient, the routed experts and the gate get one, and the three modes
// agree to their rounding. fp32 keeps its bits: it computed the empty shared expert's output as zeros before.
static void test_no_shared_experts(void **state) {
    (void)state;
    static const char *const modes[] = {"fp32", "bf16", "fp8"};
    double loss[3];
    int inputs[B * T], targets[B * T];
    random_batch(inputs, targets, 21);
    for (int i = 0; i < 3; i++) {
        Config cfg;
        char err[1024], mode[64];
        snprintf(mode, sizeof mode, "precision.mode=%s", modes[i]);
        const char *ov[] = {"train.seq_len=16", "train.micro_batch_size=2", "moe.n_shared_experts=0", mode};
        if (config_load(&cfg, "configs/tiny.ini", ov, 4, err, sizeof err) != 0) fail_msg("%s", err);
        Model m;
        assert_int_equal(model_create(&m, &cfg, DEVICE_CPU, 1, err, sizeof err), 0);
        loss[i] = run_step(&m, inputs, targets);
        // L = L_main + 0.3 L_mtp + L_bal, each cross-entropy near log(256) = 5.55 at init: about 7.2
        if (!isfinite(loss[i]) || loss[i] < 6 || loss[i] > 8.5) fail_msg("%s: loss %g, expected about 1.3 log(256) = 7.2", modes[i], loss[i]);
        const int64_t n = model_num_params(&m);
        for (int64_t j = 0; j < n; j++)
            if (!isfinite(m.grads[j])) fail_msg("%s: gradient %lld is %g", modes[i], (long long)j, (double)m.grads[j]);
        int shared = 0;
        for (int p = 0; p < m.n_params; p++) {
            const ParamInfo *pi = &m.params[p];
            if (strstr(pi->name, ".shared_experts.") != NULL) {
                shared++;
                assert_int_equal(pi->numel, 0);
            } else if (strstr(pi->name, "layers.1.ffn.gate.weight") || strstr(pi->name, "layers.2.ffn.experts.0.w2.weight")) {
                double sq = 0;
                for (int64_t j = 0; j < pi->numel; j++) sq += (double)m.grads[pi->offset + j] * m.grads[pi->offset + j];
                if (!(sq > 0)) fail_msg("%s: %s has no gradient", modes[i], pi->name);
            }
        }
        assert_int_equal(shared, 3 * 3);  // w1, w2, w3 of 2 MoE layers and the MTP block
        model_free(&m);
    }
    for (int i = 1; i < 3; i++)
        if (fabs(loss[i] - loss[0]) > 0.01 * loss[0]) fail_msg("%s loss %.6f vs fp32 %.6f", modes[i], loss[i], loss[0]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mtp_alignment),
        cmocka_unit_test(test_param_table),
        cmocka_unit_test(test_chunk_equivalence),
        cmocka_unit_test(test_determinism_threads),
        cmocka_unit_test(test_step_grad_stacks),
        cmocka_unit_test(test_load_counting_and_freeze),
        cmocka_unit_test(test_fp8_gemm_count),
        cmocka_unit_test(test_fp8_weight_cache),
        cmocka_unit_test(test_linear_grouped),
        cmocka_unit_test(test_no_shared_experts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
