/*
 * linear.c - block Linear layers in the precision mode of the job (see linear.h). In fp8 mode every
 * call quantises its activation operands afresh; a weight's 128x128 quantisation (q, its transpose and
 * the scales) is a pure function of the FP32 master weight, so it is kept in a cache and recomputed only
 * when the weights changed (model_weights_changed): once per Linear per optimizer step instead of twice
 * per micro-batch, with the same bits. Linears that share an input (the SwiGLU FFN's w1 and w3) quantise
 * it once (linear_forward_shared / linear_backward_shared). Any row count works: the quantisers pad the
 * token axis themselves (kernels.h), so expert segments are used where they lie, without copies.
 */
#include "train/linear.h"

#include "kernels/profile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Scratch for quantised operands, grown on demand and kept with the model (no allocation per call
// once the largest shape has been seen).
static void *scratch_take(Model *m, size_t *used, size_t bytes) {
    size_t aligned = (bytes + 63) & ~(size_t)63;
    if (*used + aligned > m->fp8_scratch_bytes) {  // scratch_reserve was given the total beforehand
        fprintf(stderr, "fp8moe: train/linear.c: internal error: FP8 scratch too small\n");
        exit(1);
    }
    void *p = (char *)m->fp8_scratch + *used;
    *used += aligned;
    return p;
}

static void scratch_reserve(Model *m, size_t bytes) {
    if (bytes <= m->fp8_scratch_bytes) return;
    device_free(m->dev, m->fp8_scratch);
    m->fp8_scratch = device_alloc(m->dev, bytes);
    m->fp8_scratch_bytes = bytes;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int round_up(int a, int b) { return ceil_div(a, b) * b; }
static size_t pad_bytes(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static void check_quantised(int rc, const char *what, const char *err) {
    if (rc == 0) return;
    fprintf(stderr, "fp8moe: FP8 quantisation of %s failed: %s\n", what, err);
    exit(1);
}

// ---------------------------------------------------------------------------- FP8 weight cache
typedef struct {
    int64_t offset;   // of the weight (OC, C) in m->weights
    int OC, C;
    uint8_t *q, *qt;  // (Np, Kp) and its transpose (Kp, Np)
    float *s;         // (NB, KB4), kernels.h fp8_quantize_128x128
    int64_t version;  // the m->weights_version quantised (0: not yet)
} CachedWeight;

struct Fp8WeightCache {
    CachedWeight *entries;  // one per block Linear weight, sorted by offset
    int n;
    void *buf;              // one device allocation holding every q, qt and s
};

// The block Linears: 2-D parameters except the embedding, the output head and the routers.
static int is_block_linear(const ParamInfo *p) {
    return p->ndim == 2 && strcmp(p->name, "embed.weight") != 0 && strcmp(p->name, "head.weight") != 0 &&
           strstr(p->name, ".ffn.gate.weight") == NULL;
}

static int by_offset(const void *a, const void *b) {
    const int64_t x = ((const CachedWeight *)a)->offset, y = ((const CachedWeight *)b)->offset;
    return (x > y) - (x < y);
}

static void weight_cache_create(Model *m) {
    struct Fp8WeightCache *c = calloc(1, sizeof *c);
    int n = 0;
    for (int i = 0; i < m->n_params; i++) n += is_block_linear(&m->params[i]);
    c->entries = calloc((size_t)(n ? n : 1), sizeof *c->entries);
    if (!c || !c->entries) {
        fprintf(stderr, "fp8moe: train/linear.c: out of host memory for the FP8 weight cache\n");
        exit(1);
    }
    size_t bytes = 0;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        if (!is_block_linear(p)) continue;
        const int OC = p->shape[0], C = p->shape[1], NB = ceil_div(OC, FP8_TILE), KB = ceil_div(C, FP8_TILE);
        const size_t q = pad_bytes((size_t)NB * KB * FP8_TILE * FP8_TILE);
        c->entries[c->n++] = (CachedWeight){.offset = p->offset, .OC = OC, .C = C};
        bytes += 2 * q + pad_bytes((size_t)NB * (ceil_div(KB, 4) * 4) * sizeof(float));
    }
    c->buf = device_alloc(m->dev, bytes ? bytes : 1);
    char *at = c->buf;
    for (int i = 0; i < c->n; i++) {
        CachedWeight *e = &c->entries[i];
        const int NB = ceil_div(e->OC, FP8_TILE), KB = ceil_div(e->C, FP8_TILE);
        const size_t q = pad_bytes((size_t)NB * KB * FP8_TILE * FP8_TILE);
        e->q = (uint8_t *)at, at += q;
        e->qt = (uint8_t *)at, at += q;
        e->s = (float *)at, at += pad_bytes((size_t)NB * (ceil_div(KB, 4) * 4) * sizeof(float));
    }
    qsort(c->entries, (size_t)c->n, sizeof *c->entries, by_offset);
    m->fp8_weights = c;
}

// Stops the process: fp8 Linears are called only on the model's block Linear weights, after
// chunk_acts_create built the cache (linear_reserve_scratch); anything else is a bug in the caller.
_Noreturn static void not_cached(const real *weight, int OC, int C) {
    fprintf(stderr, "fp8moe: train/linear.c: internal error: weight %p (%d x %d) is not a cached block Linear "
                    "weight of the model (was chunk_acts_create called first?)\n", (const void *)weight, OC, C);
    exit(1);
}

// The cached quantisation of `weight` (OC, C), brought up to date with the weights first.
static const CachedWeight *cached_weight(Model *m, const real *weight, int OC, int C) {
    const struct Fp8WeightCache *c = m->fp8_weights;
    const uintptr_t w = (uintptr_t)weight, lo = (uintptr_t)m->weights;
    if (c == NULL || w < lo || w >= lo + (uintptr_t)(m->n_dense_elems + m->n_expert_elems) * sizeof(real))
        not_cached(weight, OC, C);
    const int64_t offset = weight - m->weights;
    int a = 0, b = c->n - 1;
    while (a <= b) {
        const int mid = (a + b) / 2;
        CachedWeight *e = &c->entries[mid];
        if (e->offset < offset) a = mid + 1;
        else if (e->offset > offset) b = mid - 1;
        else {
            if (e->OC != OC || e->C != C) not_cached(weight, OC, C);
            if (e->version != m->weights_version) {
                char err[256];
                profile_begin(PHASE_QUANTISE);
                check_quantised(fp8_quantize_128x128(m->dev, e->q, e->qt, e->s, weight, OC, C, err, sizeof err),
                                "a weight", err);
                profile_end(PHASE_QUANTISE);
                e->version = m->weights_version;
            }
            return e;
        }
    }
    not_cached(weight, OC, C);
}

static void weight_cache_free(Model *m) {
    if (m->fp8_weights == NULL) return;
    device_free(m->dev, m->fp8_weights->buf);
    free(m->fp8_weights->entries);
    free(m->fp8_weights);
    m->fp8_weights = NULL;
}

// ---------------------------------------------------------------------------- quantised operands
typedef struct {
    uint8_t *q;
    float *s;
} Fp8Operand;

// Scratch bytes of the two activation layouts of an (N, C) operand: 1x128 tiles (Fprop X, Dgrad dY;
// N padded to 16 rows by the quantiser) and 128x1 tiles transposed (Wgrad; N padded to 128).
static size_t bytes_1x128(int N, int C) {
    const int KB = ceil_div(C, FP8_TILE), T16 = round_up(N, 16);
    return pad_bytes((size_t)T16 * KB * FP8_TILE) + pad_bytes((size_t)KB * T16 * sizeof(float));
}
static size_t bytes_128x1(int N, int C) {
    const int TB = ceil_div(N, FP8_TILE);
    return pad_bytes((size_t)C * TB * FP8_TILE) + pad_bytes((size_t)TB * C * sizeof(float));
}

static Fp8Operand quantise_1x128(Model *m, size_t *used, const real *x, int N, int C, const char *what) {
    const int KB = ceil_div(C, FP8_TILE), T16 = round_up(N, 16);
    Fp8Operand o = {scratch_take(m, used, (size_t)T16 * KB * FP8_TILE),
                    scratch_take(m, used, (size_t)KB * T16 * sizeof(float))};
    char err[256];
    profile_begin(PHASE_QUANTISE);
    check_quantised(fp8_quantize_1x128(m->dev, o.q, o.s, x, N, C, err, sizeof err), what, err);
    profile_end(PHASE_QUANTISE);
    return o;
}

static Fp8Operand quantise_128x1(Model *m, size_t *used, const real *x, int N, int C, const char *what) {
    const int TB = ceil_div(N, FP8_TILE);
    Fp8Operand o = {scratch_take(m, used, (size_t)C * TB * FP8_TILE), scratch_take(m, used, (size_t)TB * C * sizeof(float))};
    char err[256];
    profile_begin(PHASE_QUANTISE);
    check_quantised(fp8_quantize_128x1_transposed(m->dev, o.q, o.s, x, N, C, err, sizeof err), what, err);
    profile_end(PHASE_QUANTISE);
    return o;
}

// The most scratch one forward (the input's 1x128 operand) or one backward (dY in both layouts and X in
// 128x1) of a Linear (OC, C) at N rows can hold at once; the weights' operands are in the cache.
static size_t fprop_bytes(int N, int C) { return bytes_1x128(N, C); }
static size_t backward_bytes(int N, int C, int OC) { return bytes_1x128(N, OC) + bytes_128x1(N, OC) + bytes_128x1(N, C); }

void linear_reserve_scratch(Model *m, int rows) {
    if (m->cfg.precision.mode != PRECISION_FP8) return;
    if (m->fp8_weights == NULL) weight_cache_create(m);
    size_t most = 0;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        if (!is_block_linear(p)) continue;
        size_t f = fprop_bytes(rows, p->shape[1]), b = backward_bytes(rows, p->shape[1], p->shape[0]);
        if (f > most) most = f;
        if (b > most) most = b;
    }
    scratch_reserve(m, most);
}

// fp8 Fprop of n_out Linears of the same input: the input is quantised once.
static void fp8_forward(Model *m, int n_out, real *const *out, const real *inp, const real *const *weight, int N,
                        int C, int OC) {
    scratch_reserve(m, fprop_bytes(N, C));
    size_t used = 0;
    const Fp8Operand x = quantise_1x128(m, &used, inp, N, C, "an activation (Fprop X)");
    for (int i = 0; i < n_out; i++) {
        const CachedWeight *cw = cached_weight(m, weight[i], OC, C);
        fp8_gemm_fprop(m->dev, out[i], x.q, x.s, cw->q, cw->s, N, OC, C);
        m->fp8_gemm_count++;
    }
}

// fp8 backward of n_out Linears of the same input, in order: Dgrad dinp += dY W (dY in 1x128 tiles along
// OC, W's 128x128 blocks transposed), then Wgrad dW += dY^T X (dY and X in 128x1 tiles along the N
// tokens, written transposed so N is the contraction axis); X's Wgrad operand is quantised once.
static void fp8_backward(Model *m, int n_out, real *dinp, real *const *dweight, const real *const *dout,
                         const real *inp, const real *const *weight, int N, int C, int OC) {
    scratch_reserve(m, backward_bytes(N, C, OC));
    size_t used = 0;
    Fp8Operand xt = {NULL, NULL};
    for (int i = 0; i < n_out; i++) {
        if (dweight[i] && xt.q == NULL) xt = quantise_128x1(m, &used, inp, N, C, "an activation (Wgrad X)");
    }
    const size_t used_by_x = used;
    for (int i = 0; i < n_out; i++) {
        used = used_by_x;  // dY's operands of the previous Linear are consumed (one stream, in order)
        Fp8Operand dy = {NULL, NULL}, dyt = {NULL, NULL};
        if (dinp && dweight[i]) {  // both layouts of dY in one pass
            const int NB = ceil_div(OC, FP8_TILE), T16 = round_up(N, 16), TB = ceil_div(N, FP8_TILE);
            dy = (Fp8Operand){scratch_take(m, &used, (size_t)T16 * NB * FP8_TILE),
                              scratch_take(m, &used, (size_t)NB * T16 * sizeof(float))};
            dyt = (Fp8Operand){scratch_take(m, &used, (size_t)OC * TB * FP8_TILE),
                               scratch_take(m, &used, (size_t)TB * OC * sizeof(float))};
            char err[256];
            profile_begin(PHASE_QUANTISE);
            check_quantised(fp8_quantize_both_layouts(m->dev, dy.q, dy.s, dyt.q, dyt.s, dout[i], N, OC, err, sizeof err),
                            "a gradient (Dgrad and Wgrad dY)", err);
            profile_end(PHASE_QUANTISE);
        } else if (dinp) {
            dy = quantise_1x128(m, &used, dout[i], N, OC, "a gradient (Dgrad dY)");
        } else if (dweight[i]) {
            dyt = quantise_128x1(m, &used, dout[i], N, OC, "a gradient (Wgrad dY)");
        }
        if (dinp) {
            const CachedWeight *cw = cached_weight(m, weight[i], OC, C);
            fp8_gemm_dgrad(m->dev, dinp, dy.q, dy.s, cw->qt, cw->s, N, OC, C);
            m->fp8_gemm_count++;
        }
        if (dweight[i]) {
            fp8_gemm_wgrad(m->dev, dweight[i], dyt.q, dyt.s, xt.q, xt.s, N, OC, C);
            m->fp8_gemm_count++;
        }
    }
}

void linear_forward(Model *m, real *out, const real *inp, const real *weight, int N, int C, int OC) {
    linear_forward_shared(m, 1, &out, inp, &weight, N, C, OC);
}

void linear_forward_shared(Model *m, int n_out, real *const *out, const real *inp, const real *const *weight, int N,
                           int C, int OC) {
    profile_begin(PHASE_OTHER_GEMM);  // the caller may make it an expert GEMM (kernels/profile.h)
    for (int i = 0; i < n_out && m->cfg.precision.mode != PRECISION_FP8; i++) {
        if (m->cfg.precision.mode == PRECISION_FP32) matmul_forward(m->dev, out[i], inp, weight[i], N, C, OC);
        else bf16_matmul_forward(m->dev, out[i], inp, weight[i], N, C, OC);
    }
    if (m->cfg.precision.mode == PRECISION_FP8) fp8_forward(m, n_out, out, inp, weight, N, C, OC);
    profile_end(PHASE_OTHER_GEMM);
}

void linear_backward(Model *m, real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                     int N, int C, int OC) {
    linear_backward_shared(m, 1, dinp, &dweight, &dout, inp, &weight, N, C, OC);
}

void linear_backward_shared(Model *m, int n_out, real *dinp, real *const *dweight, const real *const *dout,
                            const real *inp, const real *const *weight, int N, int C, int OC) {
    profile_begin(PHASE_OTHER_GEMM);
    for (int i = 0; i < n_out && m->cfg.precision.mode != PRECISION_FP8; i++) {
        if (m->cfg.precision.mode == PRECISION_FP32)
            matmul_backward(m->dev, dinp, dweight[i], dout[i], inp, weight[i], N, C, OC);
        else
            bf16_matmul_backward(m->dev, dinp, dweight[i], dout[i], inp, weight[i], N, C, OC);
    }
    if (m->cfg.precision.mode == PRECISION_FP8) fp8_backward(m, n_out, dinp, dweight, dout, inp, weight, N, C, OC);
    profile_end(PHASE_OTHER_GEMM);
}

void linear_free_scratch(Model *m) {
    weight_cache_free(m);
    device_free(m->dev, m->fp8_scratch);
    m->fp8_scratch = NULL;
    m->fp8_scratch_bytes = 0;
}
