/*
 * linear.c - block Linear layers in the precision mode of the job (see linear.h). A weight's fp8 128x128
 * quantisation (q, its transpose and the scales) is a pure function of the FP32 master weight, so it is kept in a
 * cache and recomputed only when the weights changed (model_weights_changed): once per Linear per optimizer step
 * instead of twice per micro-batch, with the same bits; bf16 mode's copies are made by the optimizer step in its own
 * pass where it can (linear_bf16_copy_ranges). Activation operands are quantised once per call for every
 * Linear that shares the input (MLA's down-projections, the SwiGLU FFN's w1 and w3: linear_*_shared) and every
 * group of rows (the routed experts: linear_*_grouped, one launch for all experts' segments, kernels.h's *_grouped
 * layouts), and the Fprop and Dgrad of all groups of a weight are one grouped GEMM call (on CUDA one output
 * conversion instead of one per expert). fp8 mode also avoids FP32 reads where the bits allow: an input's Wgrad
 * operand is made in the forward's quantisation pass and kept by the block (KeptInput); the routed experts copy
 * their rows' Fprop operand from the shared expert's (SharedFprop); and the SwiGLU FFN leaves its gate's inputs,
 * the gradient of h and the routed experts' outputs as the GEMMs' BF16 products for the ops that read them
 * (SwigluGate). Any row count works: the quantisers pad the token axis themselves, so segments are used where
 * they lie. bf16 mode is built the same way: each weight's BF16 copy is cached per weights version, each
 * activation and dY is rounded to BF16 once per call, and a weight's groups are one grouped call (bitwise the
 * numbers of bf16_matmul_* group by group).
 */
#include "train/linear.h"

#include "kernels/profile.h"
#include "train/wgrad_ticket.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SHARED FP8_MAX_DGRAD_MATS  // Linears of one input: 2 in the SwiGLU FFN

// Scratch for quantised operands, grown on demand and kept with the model (no allocation per call
// once the largest shape has been seen).
static void *scratch_take(RunCtx *rc, size_t *used, size_t bytes) {
    size_t aligned = (bytes + 63) & ~(size_t)63;
    if (*used + aligned > rc->linear_scratch_bytes) {  // scratch_reserve was given the total beforehand
        fprintf(stderr, "fp8moe: train/linear.c: internal error: FP8 scratch too small\n");
        exit(1);
    }
    void *p = (char *)rc->linear_scratch + *used;
    *used += aligned;
    return p;
}

static void scratch_reserve(RunCtx *rc, size_t bytes) {
    if (bytes <= rc->linear_scratch_bytes) return;
    device_free(rc->dev, rc->linear_scratch);
    rc->linear_scratch = device_alloc(rc->dev, bytes);
    rc->linear_scratch_bytes = bytes;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int round_up(int a, int b) { return ceil_div(a, b) * b; }
static size_t pad_bytes(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static void check_quantised(int status, const char *what, const char *err) {
    if (status == 0) return;
    fprintf(stderr, "fp8moe: FP8 quantisation of %s failed: %s\n", what, err);
    exit(1);
}

// ---------------------------------------------------------------------------- weight cache
// fp8 mode keeps each block Linear weight's 128x128 quantisation, bf16 mode its BF16 copy.
typedef struct {
    int64_t offset;   // of the weight (OC, C) in rc->weights
    int OC, C;
    uint8_t *q, *qt;  // fp8: (Np, Kp) and its transpose (Kp, Np)
    float *s;         // fp8: (NB, KB4), kernels.h fp8_quantize_128x128
    uint16_t *b;      // bf16: (OC, C) BF16 bits
    int64_t version;  // the rc->weights_version converted (0: not yet)
    int fprop_bf16;   // fp8 mode: its Fprop runs in BF16 (linear_fprop_in_bf16)
} CachedWeight;

struct LinearWeightCache {
    CachedWeight *entries;  // one per block Linear weight, sorted by offset
    int n;
    void *buf;              // one device allocation holding every entry's arrays
    // Per-group arrays as the grouped GEMMs take them (group_weights), MAX_SHARED slots (the Dgrads of Linears
    // sharing an input run as one call) of max_groups entries, the most groups a call has (the local experts),
    // so the step allocates nothing on the host either.
    int max_groups;
    const uint8_t **q, **qt;
    const float **s;
    const uint16_t **b;
    AdamwCopyRange *ranges;  // (n) linear_bf16_copy_ranges' answer
};

// The block Linears, as the parameter table records them: every Linear inside a block or MTP module, the
// routed experts' included; not the embedding, the output head or the routers.
static int is_block_linear(const ParamInfo *p) {
    return p->role == PARAM_BLOCK_LINEAR || p->role == PARAM_ROUTED_EXPERT;
}

static int by_offset(const void *a, const void *b) {
    const int64_t x = ((const CachedWeight *)a)->offset, y = ((const CachedWeight *)b)->offset;
    return (x > y) - (x < y);
}

static void weight_cache_create(RunCtx *rc, const ParamInfo *params, int n_params) {
    int n = 0;
    for (int i = 0; i < n_params; i++) n += is_block_linear(&params[i]);
    const size_t groups = (size_t)(rc->max_groups > 1 ? rc->max_groups : 1);
    struct LinearWeightCache *c = calloc(1, sizeof *c);
    if (c != NULL) {
        c->max_groups = (int)groups;
        c->entries = calloc((size_t)(n ? n : 1), sizeof *c->entries);
        const size_t slots = groups * MAX_SHARED;
        c->q = calloc(slots, sizeof *c->q), c->qt = calloc(slots, sizeof *c->qt);
        c->s = calloc(slots, sizeof *c->s), c->b = calloc(slots, sizeof *c->b);
        c->ranges = calloc((size_t)(n ? n : 1), sizeof *c->ranges);
    }
    if (!c || !c->entries || !c->q || !c->qt || !c->s || !c->b || !c->ranges) {
        fprintf(stderr, "fp8moe: train/linear.c: out of host memory for the Linear weight cache\n");
        exit(1);
    }
    // One allocation in four regions (fp8: every q, then every qt, then every s; then, for bf16, every BF16 copy),
    // each in parameter order, so the weights of a routed-expert stack have their quantisations (q (E, Np, Kp), qt,
    // s (E, NB, KB4)) or BF16 copies stacked too and are converted in one call (refresh_stack). q sizes are
    // multiples of 128 x 128 bytes and s sizes of 16 bytes, so every array stays 16-byte aligned.
    const PrecisionConfig *pc = &rc->precision;
    const int fp8 = pc->mode == PRECISION_FP8;  // BF16 copies for bf16 mode and fp8 mode's BF16 Fprop or Dgrad
    const int bf16 = pc->mode == PRECISION_BF16 || (fp8 && (pc->bf16_fprop || pc->bf16_dgrad));
    size_t q_total = 0, s_total = 0, b_total = 0;
    for (int pass = 0; pass < 2; pass++) {  // sizes, then pointers into the one allocation
        size_t q_at = 0, s_at = 0, b_at = 0;
        char *base = pass ? c->buf : NULL;
        for (int i = 0; i < n_params; i++) {
            const ParamInfo *p = &params[i];
            if (!is_block_linear(p)) continue;
            const int OC = p->shape[0], C = p->shape[1], NB = ceil_div(OC, FP8_TILE), KB = ceil_div(C, FP8_TILE);
            const size_t q = fp8 ? (size_t)NB * KB * FP8_TILE * FP8_TILE : 0;
            const size_t sb = fp8 ? (size_t)NB * (ceil_div(KB, 4) * 4) * sizeof(float) : 0;
            const size_t b = bf16 ? pad_bytes((size_t)OC * C * sizeof(uint16_t)) : 0;
            if (pass == 1) {
                CachedWeight *e = &c->entries[c->n];
                if (fp8) {
                    e->q = (uint8_t *)(base + q_at);
                    e->qt = (uint8_t *)(base + q_total + q_at);
                    e->s = (float *)(base + 2 * q_total + s_at);
                }
                if (bf16) e->b = (uint16_t *)(base + 2 * q_total + s_total + b_at);
            } else {
                c->entries[c->n] = (CachedWeight){.offset = p->offset, .OC = OC, .C = C,
                                                  .fprop_bf16 = fp8 && linear_fprop_in_bf16(pc, p->name)};
            }
            c->n++;
            q_at += q, s_at += sb, b_at += b;
        }
        if (pass == 0) {
            q_total = q_at, s_total = s_at, b_total = b_at;
            const size_t bytes = 2 * q_total + s_total + b_total;
            c->buf = device_alloc(rc->dev, bytes ? bytes : 1), c->n = 0;
        }
    }
    qsort(c->entries, (size_t)c->n, sizeof *c->entries, by_offset);
    rc->weight_cache = c;
}

// Stops the process: fp8 Linears are called only on the model's block Linear weights, after
// chunk_acts_create built the cache (linear_reserve_scratch); anything else is a bug in the caller.
_Noreturn static void not_cached(const real *weight, int OC, int C) {
    fprintf(stderr, "fp8moe: train/linear.c: internal error: weight %p (%d x %d) is not a cached block Linear "
                    "weight of the model (was chunk_acts_create called first?)\n", (const void *)weight, OC, C);
    exit(1);
}

// The index of the cache entry of `weight` (OC, C).
static int find_entry(const RunCtx *rc, const real *weight, int OC, int C) {
    const struct LinearWeightCache *c = rc->weight_cache;
    const uintptr_t w = (uintptr_t)weight, lo = (uintptr_t)rc->weights;
    if (c == NULL || w < lo || w >= lo + (uintptr_t)rc->n_weights * sizeof(real))
        not_cached(weight, OC, C);
    const int64_t offset = weight - rc->weights;
    int a = 0, b = c->n - 1;
    while (a <= b) {
        const int mid = (a + b) / 2;
        const CachedWeight *e = &c->entries[mid];
        if (e->offset < offset) a = mid + 1;
        else if (e->offset > offset) b = mid - 1;
        else if (e->OC != OC || e->C != C) break;
        else return mid;
    }
    not_cached(weight, OC, C);
}

// Brings the n cache entries i0 .. i0 + n - 1, the stacked weights (n, OC, C) at `weight`, up to date with the
// weights in one call: fp8 one batched 128x128 quantisation, bf16 one rounding (a routed-expert Linear's 32
// weights were 32 launches of ~8 us). The entries' arrays must be stacked too (weight_cache_create lays a stack
// out so; stacked_entries checks it). The same bits as entry by entry.
static void refresh_entries(RunCtx *rc, int i0, int n, const real *weight, int OC, int C) {
    CachedWeight *e0 = &rc->weight_cache->entries[i0];
    if (e0->b != NULL)  // bf16 (inside the caller's GEMM phase)
        bf16_round_array(rc->dev, e0->b, weight, (int64_t)n * OC * C);
    if (e0->q != NULL) {
        char err[256];
        profile_begin(PHASE_QUANTISE);
        check_quantised(fp8_quantize_128x128_batched(rc->dev, e0->q, e0->qt, e0->s, weight, n, OC, C, err, sizeof err),
                        n > 1 ? "a stack of weights" : "a weight", err);
        profile_end(PHASE_QUANTISE);
    }
    for (int g = 0; g < n; g++) rc->weight_cache->entries[i0 + g].version = rc->weights_version;
}

// Whether entries i0 .. i0 + n - 1 are the stack (n, OC, C) with stacked arrays, all out of date.
static int stacked_stale_entries(const RunCtx *rc, int i0, int n, int OC, int C) {
    const struct LinearWeightCache *c = rc->weight_cache;
    if (i0 + n > c->n) return 0;
    const CachedWeight *e0 = &c->entries[i0];
    const size_t qn = (size_t)ceil_div(OC, FP8_TILE) * ceil_div(C, FP8_TILE) * FP8_TILE * FP8_TILE;
    const size_t sn = (size_t)ceil_div(OC, FP8_TILE) * (ceil_div(ceil_div(C, FP8_TILE), 4) * 4);
    const size_t bn = (size_t)OC * C;
    for (int g = 0; g < n; g++) {
        const CachedWeight *e = &c->entries[i0 + g];
        const int arrays = (e0->b == NULL || e->b == e0->b + g * bn) &&
                           (e0->q == NULL || (e->q == e0->q + g * qn && e->qt == e0->qt + g * qn && e->s == e0->s + g * sn));
        if (e->offset != e0->offset + (int64_t)g * OC * C || e->OC != OC || e->C != C || !arrays ||
            e->version == rc->weights_version)
            return 0;
    }
    return 1;
}

const AdamwCopyRange *linear_bf16_copy_ranges(RunCtx *rc, int64_t lo, int64_t n, int *count) {
    struct LinearWeightCache *c = rc->weight_cache;
    *count = 0;
    if (c == NULL) return NULL;
    for (int i = 0; i < c->n; i++) {
        const CachedWeight *e = &c->entries[i];
        const int64_t size = (int64_t)e->OC * e->C;
        if (e->b == NULL || e->q != NULL || size == 0 || e->offset < lo || e->offset + size > lo + n) continue;
        AdamwCopyRange *last = *count > 0 ? &c->ranges[*count - 1] : NULL;
        if (last != NULL && lo + last->offset + last->n == e->offset && last->b + last->n == e->b)
            last->n += size;  // the next weight and the next copy: one range (the update is elementwise)
        else c->ranges[(*count)++] = (AdamwCopyRange){.offset = e->offset - lo, .n = size, .b = e->b};
    }
    return c->ranges;
}

void linear_bf16_copies_written(RunCtx *rc, int64_t lo, const AdamwCopyRange *ranges, int n) {
    struct LinearWeightCache *c = rc->weight_cache;
    int i = 0;  // entries and ranges are both in offset order
    for (int k = 0; k < n; k++) {
        const int64_t from = lo + ranges[k].offset, to = from + ranges[k].n;
        while (i < c->n && c->entries[i].offset < from) i++;
        for (; i < c->n && c->entries[i].offset < to; i++) c->entries[i].version = rc->weights_version;
    }
}

// The cached quantisation (bf16: BF16 copy) of `weight` (OC, C), brought up to date with the weights first.
static const CachedWeight *cached_weight(RunCtx *rc, const real *weight, int OC, int C) {
    const int i = find_entry(rc, weight, OC, C);
    if (rc->weight_cache->entries[i].version != rc->weights_version) refresh_entries(rc, i, 1, weight, OC, C);
    return &rc->weight_cache->entries[i];
}

// The n stacked weights (n, OC, C) at `weight` refreshed in one call when all are out of date; otherwise
// cached_weight refreshes them one by one.
static void refresh_stack(RunCtx *rc, int n, const real *weight, int OC, int C) {
    if (n < 2) return;
    const int i0 = find_entry(rc, weight, OC, C);
    if (stacked_stale_entries(rc, i0, n, OC, C)) refresh_entries(rc, i0, n, weight, OC, C);
}

static void weight_cache_free(RunCtx *rc) {
    if (rc->weight_cache == NULL) return;
    struct LinearWeightCache *c = rc->weight_cache;
    device_free(rc->dev, c->buf);
    free(c->entries), free(c->q), free(c->qt), free(c->s), free(c->b), free(c->ranges);
    free(c);
    rc->weight_cache = NULL;
}

// ---------------------------------------------------------------------------- quantised operands
// Activation operands are quantised for all groups of a call at once (kernels.h's *_grouped layouts:
// the groups' operands one after another, each padded to 16 rows for 1x128 and to 128-row tiles for
// 128x1). A plain Linear is one group.
typedef struct {
    uint8_t *q;
    float *s;
} Fp8Operand;

typedef struct {
    int p16, tiles;  // rows of the groups' 1x128 operands, 128-row tiles of their 128x1 operands
} GroupSizes;

static GroupSizes group_sizes(int n_groups, const int *offsets) {
    GroupSizes z = {0, 0};
    for (int g = 0; g < n_groups; g++) {
        const int n = offsets[g + 1] - offsets[g];
        z.p16 += round_up(n, 16), z.tiles += ceil_div(n, FP8_TILE);
    }
    return z;
}

static size_t bytes_1x128(int p16, int C) {
    const int KB = ceil_div(C, FP8_TILE);
    return pad_bytes((size_t)p16 * KB * FP8_TILE) + pad_bytes((size_t)KB * p16 * sizeof(float));
}
static size_t bytes_128x1(int tiles, int C) {
    return pad_bytes((size_t)C * tiles * FP8_TILE) + pad_bytes((size_t)tiles * C * sizeof(float));
}
// The most scratch one forward (the input's 1x128 operand) or one backward of n_out Linears (OC, C) sharing an
// input (each dY in both layouts, X in 128x1) holds at once; the weights' operands are in the cache.
static size_t fprop_bytes(GroupSizes z, int C) { return bytes_1x128(z.p16, C); }
static size_t backward_bytes(GroupSizes z, int C, int OC, int n_out) {
    return (size_t)n_out * (bytes_1x128(z.p16, OC) + bytes_128x1(z.tiles, OC)) + bytes_128x1(z.tiles, C);
}

static Fp8Operand take_1x128(RunCtx *rc, size_t *used, GroupSizes z, int C) {
    const int KB = ceil_div(C, FP8_TILE);
    return (Fp8Operand){scratch_take(rc, used, (size_t)z.p16 * KB * FP8_TILE),
                        scratch_take(rc, used, (size_t)KB * z.p16 * sizeof(float))};
}
// A Wgrad operand: in scratch, or, while a W ticket is recording (rc->wgrad_ticket), in the ticket's storage, where
// it stays until the ticket runs its GEMM.
static Fp8Operand take_128x1(RunCtx *rc, size_t *used, GroupSizes z, int C) {
    const size_t q_bytes = (size_t)C * z.tiles * FP8_TILE, s_bytes = (size_t)z.tiles * C * sizeof(float);
    WgradTicket *t = rc->wgrad_ticket;
    if (t) return (Fp8Operand){wgrad_ticket_take(t, q_bytes), wgrad_ticket_take(t, s_bytes)};
    return (Fp8Operand){scratch_take(rc, used, q_bytes), scratch_take(rc, used, s_bytes)};
}

// A BF16 Wgrad operand of n elements: in scratch, or in a recording W ticket's storage (as take_128x1).
static uint16_t *take_wgrad_bf16(RunCtx *rc, size_t *used, size_t n) {
    WgradTicket *t = rc->wgrad_ticket;
    return t ? wgrad_ticket_take(t, n * sizeof(uint16_t)) : scratch_take(rc, used, n * sizeof(uint16_t));
}

// A copy of n FP32 elements in a recording W ticket's storage.
static const real *copy_for_ticket(RunCtx *rc, const real *src, size_t n) {
    real *dst = wgrad_ticket_take(rc->wgrad_ticket, n * sizeof(real));
    device_memcpy(rc->dev, dst, src, n * sizeof(real));
    return dst;
}

// A Wgrad GEMM: run now, or recorded in the W ticket (its operands are in the ticket's storage, or kept with the
// activations, which live until the ticket runs: train/step_plan.h).
static void run_or_record_wgrad(RunCtx *rc, const WgradGemm *g) {
    if (rc->wgrad_ticket) wgrad_ticket_add(rc->wgrad_ticket, g);
    else wgrad_gemm_run(g, rc);
}

int linear_kept_tiles(int64_t rows, int n_groups) {
    // ceil(a / 128) + ceil(b / 128) <= ceil((a + b) / 128) + 1: each group after the first adds at most one tile
    return (int)((rows + FP8_TILE - 1) / FP8_TILE) + (n_groups > 1 ? n_groups - 1 : 0);
}

// The operand `kept` holds for an input of groups z and C columns, or {NULL, NULL} when nothing is kept.
static Fp8Operand kept_operand(const KeptInput *kept, GroupSizes z, int C) {
    if (kept == NULL || kept->q == NULL) return (Fp8Operand){NULL, NULL};
    if (kept->C != C || kept->tiles < z.tiles) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: a kept input of %d tiles x %d columns given for %d "
                        "tiles x %d columns\n", kept->tiles, kept->C, z.tiles, C);
        exit(1);
    }
    return (Fp8Operand){kept->q, kept->s};
}

static size_t bf16_bytes(int rows, int cols) { return pad_bytes((size_t)rows * cols * sizeof(uint16_t)); }

// The most scratch one call of n_out Linears (OC, C) sharing an input on `rows` rows holds: bf16 the rounded
// input and the rounded dYs (unpadded), and for a SwiGLU FFN's w1 and w3 (n_out = 2: C = D, OC = I) its whole
// backward in bf16 mode (bf16_swiglu_backward: x and w2's dY, D wide, and h, da, db, I wide); fp8 the larger of a
// forward and a backward, its groups' padding adding at most 15 rows (1x128) and one tile (128x1) per group of the
// `padded_groups`.
static size_t call_scratch_bytes(const RunCtx *rc, int rows, int padded_groups, int C, int OC, int n_out) {
    const size_t bf16 = bf16_bytes(rows, C) + (size_t)n_out * bf16_bytes(rows, OC);
    if (rc->precision.mode == PRECISION_BF16)
        return n_out == 2 ? bf16 + bf16_bytes(rows, C) + bf16_bytes(rows, OC) : bf16;
    const GroupSizes z = {round_up(rows, 16) + 15 * padded_groups, ceil_div(rows, FP8_TILE) + padded_groups};
    const size_t f = fprop_bytes(z, C), b = backward_bytes(z, C, OC, n_out), fp8 = f > b ? f : b;
    return linear_fp8_fused(rc) || fp8 > bf16 ? fp8 : bf16;  // BF16 GEMM kinds use the bf16 mode's scratch
}

void linear_reserve_scratch(RunCtx *rc, const ParamInfo *params, int n_params, int rows, int routed_rows) {
    if (rc->precision.mode == PRECISION_FP32) return;
    if (rc->weight_cache == NULL) weight_cache_create(rc, params, n_params);
    // a plain Linear runs on `rows` rows; the routed experts on routed_rows rows in max_groups groups
    size_t most = 0;
    for (int i = 0; i < n_params; i++) {
        const ParamInfo *p = &params[i];
        if (!is_block_linear(p)) continue;
        const int expert = p->role == PARAM_ROUTED_EXPERT;
        // a SwiGLU FFN's w1 and w3 run their backward as one call (linear_backward_shared / _grouped)
        const int shared = p->shares_input ? 2 : 1;
        const size_t b = call_scratch_bytes(rc, expert ? routed_rows : rows, expert ? rc->max_groups : 0,
                                            p->shape[1], p->shape[0], shared);
        if (b > most) most = b;
    }
    scratch_reserve(rc, most);
}

// Calls f(part, n, arg) for each comma-separated part of list (n characters, not terminated) until f returns
// non-zero; returns that, or 0.
static int each_part(const char *list, int (*f)(const char *part, size_t n, const void *arg), const void *arg) {
    for (const char *p = list; *p;) {
        const size_t n = strcspn(p, ",");
        const int r = n ? f(p, n, arg) : 0;
        if (r) return r;
        p += n + (p[n] == ',');
    }
    return 0;
}

static int part_in_name(const char *part, size_t n, const void *name) {
    for (const char *s = name; (s = strchr(s, part[0])) != NULL; s++)
        if (strncmp(s, part, n) == 0) return 1;
    return 0;
}

int linear_fprop_in_bf16(const PrecisionConfig *pc, const char *tensor_name) {
    if (pc->mode != PRECISION_FP8 || !pc->bf16_fprop) return 0;
    return pc->bf16_fprop_only[0] == '\0' || each_part(pc->bf16_fprop_only, part_in_name, tensor_name);
}

typedef struct {
    const ParamInfo *params;
    int n;
    char *err;
    size_t err_size;
} PartCheck;

// 0 when the part is in some block Linear's name; else -1 with the error written.
static int part_unmatched(const char *part, size_t n, const void *arg) {
    const PartCheck *c = arg;
    const char *example = NULL;
    for (int i = 0; i < c->n; i++) {
        if (!is_block_linear(&c->params[i])) continue;
        if (part_in_name(part, n, c->params[i].name)) return 0;
        if (!example) example = c->params[i].name;
    }
    snprintf(c->err, c->err_size, "precision.bf16_fprop_only: \"%.*s\" is in no block Linear's tensor name - expected "
             "part of one, e.g. %s", (int)n, part, example ? example : "(the model has no block Linear)");
    return -1;
}

int linear_check_fprop_only(const PrecisionConfig *pc, const ParamInfo *params, int n_params, char *err,
                            size_t err_size) {
    const PartCheck c = {params, n_params, err, err_size};
    return each_part(pc->bf16_fprop_only, part_unmatched, &c);
}

int linear_fp8_fused(const RunCtx *rc) {
    const PrecisionConfig *p = &rc->precision;
    return p->mode == PRECISION_FP8 && !p->bf16_fprop && !p->bf16_dgrad && !p->bf16_wgrad;
}

int linear_bf16_products(const RunCtx *rc) { return linear_fp8_fused(rc) || rc->precision.mode == PRECISION_BF16; }

// The bf16 mode's Linears (below), which fp8 mode also runs for the GEMM kinds a job asks in BF16.
static void bf16_forward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out,
                         uint16_t *const *out_bf16, const real *inp,
                         const int *inp_rows, const real *const *weight, int C, const int *OC, const real *residual);
static void bf16_backward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *dinp, uint16_t *dinp_bf16,
                          GradStore dinp_store, const DgradUnpermute *unpermute, real *const *dweight,
                          const real *const *dout, const real *inp, const int *inp_rows, const real *const *weight,
                          int C, int OC);

// ---------------------------------------------------------------------------- fp8 Linears
// What the fp8 quantisers read for an activation operand (an input X or a gradient dY): an FP32 array, row r read
// through `rows` when given; one of the SwiGLU gate's values computed from dout, a, b as it is read (kernels.h
// fp8_quantize_swiglu_*); the MoE combine's gradient through the routing plan (a dY, both layouts only); or
// RMSNorm(x), normalised as it is read (an input X, both layouts only, one group: linear.h NormInput). The last three
// are never written in FP32 (linear_*_swiglu_grouped, linear_forward_norm).
typedef struct {
    enum { OPERAND_ARRAY, OPERAND_SWIGLU, OPERAND_COMBINE_GRAD, OPERAND_NORM } kind;
    const real *x;
    const int *rows;
    const real *rstd, *norm_w;     // RMSNorm(x)'s rstd and weight
    SwigluValue value;
    const uint16_t *dout, *a, *b;  // the SwiGLU gate's BF16 inputs (linear.h SwigluGate) and h's BF16 gradient
    const CombineGrad *combine;
} Operand;

static Operand array_operand(const real *x, const int *rows) {
    return (Operand){.kind = OPERAND_ARRAY, .x = x, .rows = rows};
}
static Operand swiglu_operand(SwigluValue value, const uint16_t *dout, const uint16_t *a, const uint16_t *b) {
    return (Operand){.kind = OPERAND_SWIGLU, .value = value, .dout = dout, .a = a, .b = b};
}

// The combine's gradient and a norm's output are quantised in both layouts at once, never one layout alone.
static void check_one_layout(const Operand *x, const char *layout) {
    if (x->kind != OPERAND_COMBINE_GRAD && x->kind != OPERAND_NORM) return;
    fprintf(stderr, "fp8moe: train/linear.c: internal error: %s is quantised in both layouts at once, not as a %s "
                    "operand alone\n", x->kind == OPERAND_NORM ? "a norm's output" : "the combine's gradient", layout);
    exit(1);
}

// x's 1x128 operand (Fprop X, Dgrad dY), its 128x1 operand (Wgrad X, dY) or both (a dY feeding Dgrad and Wgrad),
// for all groups in one call. `what` names the operand in an error.
static void quantize_1x128(RunCtx *rc, Fp8Operand o, const Operand *x, int n_groups, const int *offsets, int C,
                           const char *what) {
    check_one_layout(x, "1x128");
    char err[256];
    profile_begin(PHASE_QUANTISE);
    const int status = x->kind == OPERAND_SWIGLU
                       ? fp8_quantize_swiglu_1x128_grouped(rc->dev, o.q, o.s, x->value, x->dout, x->a, x->b, n_groups,
                                                           offsets, C, err, sizeof err)
                       : fp8_quantize_1x128_grouped(rc->dev, o.q, o.s, x->x, x->rows, n_groups, offsets, C, err,
                                                    sizeof err);
    check_quantised(status, what, err);
    profile_end(PHASE_QUANTISE);
}

static void quantize_128x1(RunCtx *rc, Fp8Operand o, const Operand *x, int n_groups, const int *offsets, int C,
                           const char *what) {
    check_one_layout(x, "128x1");
    char err[256];
    profile_begin(PHASE_QUANTISE);
    const int status = x->kind == OPERAND_SWIGLU
                       ? fp8_quantize_swiglu_128x1_transposed_grouped(rc->dev, o.q, o.s, x->value, x->dout, x->a, x->b,
                                                                      n_groups, offsets, C, err, sizeof err)
                       : fp8_quantize_128x1_transposed_grouped(rc->dev, o.q, o.s, x->x, x->rows, n_groups, offsets, C,
                                                               err, sizeof err);
    check_quantised(status, what, err);
    profile_end(PHASE_QUANTISE);
}

// Both layouts in one pass; the array form reads rows in order (neither a dY nor a kept input is gathered: the
// routed experts' token rows are not kept, linear.h).
static void quantize_both(RunCtx *rc, Fp8Operand o1, Fp8Operand o2, const Operand *x, int n_groups, const int *offsets,
                          int C, const char *what) {
    if ((x->kind == OPERAND_ARRAY && x->rows != NULL) || (x->kind == OPERAND_NORM && n_groups != 1)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: both layouts of %s read through a row index, or of a "
                        "norm's output in %d groups (one only)\n", what, n_groups);
        exit(1);
    }
    char err[256];
    int status;
    profile_begin(PHASE_QUANTISE);
    if (x->kind == OPERAND_SWIGLU)
        status = fp8_quantize_swiglu_both_layouts_grouped(rc->dev, o1.q, o1.s, o2.q, o2.s, x->value, x->dout, x->a, x->b,
                                                      n_groups, offsets, C, err, sizeof err);
    else if (x->kind == OPERAND_NORM)
        status = fp8_quantize_rmsnorm_both_layouts(rc->dev, o1.q, o1.s, o2.q, o2.s, x->x, x->rstd, x->norm_w,
                                                   offsets[1], C, err, sizeof err);
    else if (x->kind == OPERAND_COMBINE_GRAD)
        status = fp8_quantize_combine_grad_both_layouts_grouped(rc->dev, o1.q, o1.s, o2.q, o2.s, x->combine->d_out,
                                                            x->combine->seg_token, x->combine->slot_of,
                                                            x->combine->topk_w, x->combine->topk, n_groups, offsets, C,
                                                            err, sizeof err);
    else
        status = fp8_quantize_both_layouts_grouped(rc->dev, o1.q, o1.s, o2.q, o2.s, x->x, n_groups, offsets, C, err,
                                               sizeof err);
    check_quantised(status, what, err);
    profile_end(PHASE_QUANTISE);
}

// The n_out dYs of a backward into the layouts their GEMMs need (1x128 dy[i] for the Dgrad when dgrad, 128x1 dyt[i]
// for the Wgrad when dweight[i]), each in one pass; the SwiGLU gradients da and db of one (dout, a, b) - the FFN's
// w1 and w3 - in one pass for both.
static void quantize_gradients(RunCtx *rc, int n_out, const Fp8Operand *dy, const Fp8Operand *dyt, const Operand *dout,
                               int dgrad, real *const *dweight, int n_groups, const int *offsets, int OC) {
    const int swiglu_pair = n_out == 2 && dgrad && dweight[0] && dweight[1] &&
                            dout[0].kind == OPERAND_SWIGLU && dout[0].value == SWIGLU_DA &&
                            dout[1].kind == OPERAND_SWIGLU && dout[1].value == SWIGLU_DB &&
                            dout[0].dout == dout[1].dout && dout[0].a == dout[1].a;
    if (swiglu_pair) {
        char err[256];
        profile_begin(PHASE_QUANTISE);
        check_quantised(fp8_quantize_swiglu_grads_both_layouts_grouped(rc->dev, dy[0].q, dy[0].s, dyt[0].q, dyt[0].s,
                                                                        dy[1].q, dy[1].s, dyt[1].q, dyt[1].s,
                                                                        dout[0].dout, dout[0].a, dout[0].b, n_groups,
                                                                        offsets, OC, err, sizeof err),
                        "the SwiGLU gradients (Dgrad and Wgrad dY)", err);
        profile_end(PHASE_QUANTISE);
        return;
    }
    for (int i = 0; i < n_out; i++) {
        if (dgrad && dweight[i])
            quantize_both(rc, dy[i], dyt[i], &dout[i], n_groups, offsets, OC, "a gradient (Dgrad and Wgrad dY)");
        else if (dgrad) quantize_1x128(rc, dy[i], &dout[i], n_groups, offsets, OC, "a gradient (Dgrad dY)");
        else if (dweight[i]) quantize_128x1(rc, dyt[i], &dout[i], n_groups, offsets, OC, "a gradient (Wgrad dY)");
    }
}

// Stops the process: a job with GEMM kinds in BF16 runs the plain paths (linear_fp8_fused), so every operand is
// an FP32 array and every output FP32; anything else is a bug in the caller.
_Noreturn static void not_plain(const char *what) {
    fprintf(stderr, "fp8moe: train/linear.c: internal error: %s with a fused operand or a BF16 output in a job that "
                    "runs GEMM kinds in BF16 (expected the plain paths: linear_fp8_fused)\n", what);
    exit(1);
}

_Noreturn static void too_many_shared(int n_out) {
    fprintf(stderr, "fp8moe: train/linear.c: internal error: %d Linears share an input (at most %d)\n", n_out,
            MAX_SHARED);
    exit(1);
}

// The cached arrays of slice g of the stacked weight (n_groups, OC, C) for every group g into slot `slot` of the
// cache's per-call arrays (fp8: q, qt, s; bf16: b; at slot * max_groups; NULL for empty groups). Returns the
// number of non-empty groups.
static int group_weights(RunCtx *rc, int slot, int n_groups, const int *offsets, const real *weight, int OC, int C) {
    struct LinearWeightCache *c = rc->weight_cache;
    if (n_groups > c->max_groups) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: %d groups in one Linear call (at most %d, the "
                        "local experts)\n", n_groups, c->max_groups);
        exit(1);
    }
    refresh_stack(rc, n_groups, weight, OC, C);
    const int at = slot * c->max_groups;
    int used = 0;
    for (int g = 0; g < n_groups; g++) {
        const CachedWeight *e =
            offsets[g + 1] == offsets[g] ? NULL : cached_weight(rc, weight + (int64_t)g * OC * C, OC, C);
        c->q[at + g] = e ? e->q : NULL, c->qt[at + g] = e ? e->qt : NULL;
        c->s[at + g] = e ? e->s : NULL, c->b[at + g] = e ? e->b : NULL;
        used += e != NULL;
    }
    return used;
}

// The Fprop operand `fprop` (linear.h SharedFprop) holds for an input of C columns in n_groups groups of `rows` rows
// in all, or {NULL, NULL} when none is given. A call that writes it (`writes`: the input in token order) is one group
// of all its rows.
static Fp8Operand shared_fprop_operand(const SharedFprop *fprop, int writes, int n_groups, int rows, int C) {
    if (fprop == NULL || fprop->q == NULL) return (Fp8Operand){NULL, NULL};
    if (fprop->C != C || (writes && (n_groups != 1 || fprop->rows != rows))) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: a shared Fprop operand of %d rows x %d columns given "
                        "for %d groups of %d rows x %d columns\n", fprop->rows, fprop->C, n_groups, rows, C);
        exit(1);
    }
    return (Fp8Operand){fprop->q, fprop->s};
}

// fp8 Fprop: out[i] rows of group g = inp rows of g @ (slice g of weight[i] (OC[i], C))^T. The input is quantised
// once, for every group and every weight, and into its kept Wgrad operand in the same pass (`kept`), or its rows
// are copied from the operand a call in token order shared (`fprop`, inp read through rows); each weight's groups
// are one grouped GEMM call (one output conversion on CUDA; with out_bf16 instead of out, none: the BF16 products
// are the outputs, kernels.h fp8_gemm_fprop_grouped_bf16).
static void fp8_forward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out,
                        uint16_t *const *out_bf16, const Operand *inp, const real *const *weight, int C, const int *OC,
                        const real *residual, KeptInput *kept, SharedFprop *fprop) {
    if (rc->precision.bf16_fprop) {  // the plain paths (linear_fp8_fused): an FP32 array in, FP32 out
        if (inp->kind != OPERAND_ARRAY || out_bf16 != NULL) not_plain("an Fprop");
        // which Fprops run in BF16 (precision.bf16_fprop_only; a stack of experts goes by its first expert's name)
        int n_bf16 = 0;
        for (int i = 0; i < n_out; i++)
            n_bf16 += rc->weight_cache->entries[find_entry(rc, weight[i], OC[i], C)].fprop_bf16;
        if (n_bf16 == n_out) {
            bf16_forward(rc, n_groups, offsets, n_out, out, NULL, inp->x, inp->rows, weight, C, OC, residual);
            return;
        }
        if (n_bf16 > 0) {  // some of each: Linear by Linear (the input quantised or rounded for each, the same bits)
            for (int i = 0; i < n_out; i++)
                fp8_forward(rc, n_groups, offsets, 1, &out[i], NULL, inp, &weight[i], C, &OC[i], residual, kept, fprop);
            return;
        }
    }
    const GroupSizes z = group_sizes(n_groups, offsets);
    scratch_reserve(rc, fprop_bytes(z, C));
    size_t used = 0;
    const int gathers = inp->kind == OPERAND_ARRAY && inp->rows != NULL;
    const Fp8Operand shared = shared_fprop_operand(fprop, !gathers, n_groups, offsets[n_groups], C);
    // a call in token order writes the shared operand instead of scratch; a gathering call copies its rows from it
    const Fp8Operand x = shared.q != NULL && !gathers ? shared : take_1x128(rc, &used, z, C);
    const Fp8Operand xt = kept_operand(kept, z, C);
    if (shared.q != NULL && gathers) {
        profile_begin(PHASE_QUANTISE);
        fp8_gather_1x128_grouped(rc->dev, x.q, x.s, shared.q, shared.s, fprop->rows, inp->rows, n_groups, offsets, C);
        profile_end(PHASE_QUANTISE);
    } else if (xt.q != NULL) {
        quantize_both(rc, x, xt, inp, n_groups, offsets, C, "an activation (Fprop X, kept Wgrad X)");
    } else {
        quantize_1x128(rc, x, inp, n_groups, offsets, C, "an activation (Fprop X)");
    }
    const struct LinearWeightCache *c = rc->weight_cache;
    for (int i = 0; i < n_out; i++) {
        rc->fp8_gemm_count += group_weights(rc, 0, n_groups, offsets, weight[i], OC[i], C);
        if (out_bf16 != NULL)
            fp8_gemm_fprop_grouped_bf16(rc->dev, out_bf16[i], x.q, x.s, c->q, c->s, n_groups, offsets, OC[i], C);
        else fp8_gemm_fprop_grouped(rc->dev, out[i], residual, x.q, x.s, c->q, c->s, n_groups, offsets, OC[i], C);
    }
}

// fp8 backward of the n_out Linears sharing inp. Each dY is quantised once (1x128 tiles along OC for Dgrad,
// 128x1 tiles along the tokens for Wgrad, both layouts in one pass when both GEMMs need them); all Dgrads are
// one call, dinp += sum_i dY_i W_i in order of i (W's 128x128 blocks transposed, all groups, one output
// conversion on CUDA); then Wgrad dW_i += dY_i^T X group by group (dY and X written transposed so the tokens
// are the contraction axis). Groups write disjoint rows of dinp and slices of dW, so this gives the bits of
// group-by-group, Linear-by-Linear calls. X's Wgrad operand is the forward's (`kept`) or quantised once. With
// dinp_bf16 instead of dinp (written, in group order), the input gradient is left as the Dgrads' BF16 products
// (kernels.h fp8_gemm_dgrad_grouped_bf16), Linear i's at dinp_bf16 + i bf16_rows_elems(rows, C).
static void fp8_backward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *dinp, uint16_t *dinp_bf16,
                         GradStore dinp_store, const DgradUnpermute *unpermute, real *const *dweight,
                         const Operand *dout, const Operand *inp, const real *const *weight, int C, int OC,
                         const KeptInput *kept) {
    const PrecisionConfig *pc = &rc->precision;
    real *no_dweight[MAX_SHARED] = {NULL};
    if (pc->bf16_dgrad || pc->bf16_wgrad) {  // those GEMMs as bf16 mode runs them, on the plain paths' FP32 arrays
        const real *dys[MAX_SHARED];
        for (int i = 0; i < n_out; i++) {
            if (dout[i].kind != OPERAND_ARRAY || dout[i].rows != NULL) not_plain("a gradient dY");
            dys[i] = dout[i].x;
        }
        if (inp->kind != OPERAND_ARRAY || dinp_bf16 != NULL) not_plain("a backward");
        bf16_backward(rc, n_groups, offsets, n_out, pc->bf16_dgrad ? dinp : NULL, NULL, dinp_store,
                      pc->bf16_dgrad ? unpermute : NULL, pc->bf16_wgrad ? dweight : no_dweight, dys, inp->x,
                      inp->rows, weight, C, OC);
        if (pc->bf16_dgrad) dinp = NULL, unpermute = NULL;
        if (pc->bf16_wgrad) dweight = no_dweight;
    }
    const int dgrad = dinp != NULL || dinp_bf16 != NULL;
    if (dinp_bf16 != NULL && (dinp != NULL || unpermute != NULL || dinp_store != GRAD_WRITE)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: a BF16 input gradient is written, in group order\n");
        exit(1);
    }
    const GroupSizes z = group_sizes(n_groups, offsets);
    scratch_reserve(rc, backward_bytes(z, C, OC, n_out));
    size_t used = 0;
    Fp8Operand xt = kept_operand(kept, z, C);
    for (int i = 0; i < n_out && xt.q == NULL; i++) {
        if (dweight[i] == NULL) continue;
        xt = take_128x1(rc, &used, z, C);
        quantize_128x1(rc, xt, inp, n_groups, offsets, C, "an activation (Wgrad X)");
    }
    Fp8Operand dy[MAX_SHARED], dyt[MAX_SHARED];
    for (int i = 0; i < n_out; i++) {
        dy[i] = dgrad ? take_1x128(rc, &used, z, OC) : (Fp8Operand){NULL, NULL};
        dyt[i] = dweight[i] ? take_128x1(rc, &used, z, OC) : (Fp8Operand){NULL, NULL};
    }
    quantize_gradients(rc, n_out, dy, dyt, dout, dgrad, dweight, n_groups, offsets, OC);
    if (dgrad) {
        const struct LinearWeightCache *c = rc->weight_cache;
        const uint8_t *qdy[MAX_SHARED], *const *qwt[MAX_SHARED];
        const float *sdy[MAX_SHARED], *const *sw[MAX_SHARED];
        for (int i = 0; i < n_out; i++) {
            rc->fp8_gemm_count += group_weights(rc, i, n_groups, offsets, weight[i], OC, C);
            qdy[i] = dy[i].q, sdy[i] = dy[i].s, qwt[i] = c->qt + i * c->max_groups, sw[i] = c->s + i * c->max_groups;
        }
        if (dinp_bf16 != NULL)
            for (int i = 0; i < n_out; i++)
                fp8_gemm_dgrad_grouped_bf16(rc->dev, dinp_bf16 + i * bf16_rows_elems(offsets[n_groups], C), qdy[i],
                                            sdy[i], qwt[i], sw[i], n_groups, offsets, OC, C);
        else
            fp8_gemm_dgrad_grouped(rc->dev, dinp, dinp_store, unpermute, n_out, qdy, sdy, qwt, sw, n_groups, offsets, OC,
                                   C);
    }
    for (int i = 0; i < n_out; i++) {
        if (dweight[i] == NULL) continue;
        const WgradGemm g = {WGRAD_FP8, profile_current_phase(), dweight[i], dyt[i].q, xt.q, dyt[i].s, xt.s, n_groups,
                             OC, C, offsets};
        run_or_record_wgrad(rc, &g);
    }
}

// ---------------------------------------------------------------------------- bf16 Linears
// The BF16 baseline on operands rounded once: the input for every Linear and group that reads it, each dY
// once, each weight from the cache (its BF16 copy, made once per weights version). Bitwise what
// bf16_matmul_forward / _backward give group by group; on CUDA each weight's groups are one call with one
// output conversion.

// The input rounded to BF16, read through inp_rows when given (row r of the groups is row inp_rows[r] of inp).
static void bf16_round_input(RunCtx *rc, uint16_t *x, const real *inp, const int *inp_rows, int rows, int C) {
    if (inp_rows) bf16_round_rows(rc->dev, x, inp, inp_rows, rows, C);
    else bf16_round_array(rc->dev, x, inp, (int64_t)rows * C);
}

// With out_bf16 (out NULL) the products are left in BF16 (kernels.h bf16_gemm_fprop_grouped_bf16).
static void bf16_forward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out,
                         uint16_t *const *out_bf16, const real *inp, const int *inp_rows, const real *const *weight,
                         int C, const int *OC, const real *residual) {
    const int rows = offsets[n_groups];
    scratch_reserve(rc, bf16_bytes(rows, C));
    size_t used = 0;
    uint16_t *x = scratch_take(rc, &used, (size_t)rows * C * sizeof(uint16_t));
    bf16_round_input(rc, x, inp, inp_rows, rows, C);
    for (int i = 0; i < n_out; i++) {
        group_weights(rc, 0, n_groups, offsets, weight[i], OC[i], C);
        if (out_bf16) bf16_gemm_fprop_grouped_bf16(rc->dev, out_bf16[i], x, rc->weight_cache->b, n_groups, offsets,
                                                   OC[i], C);
        else bf16_gemm_fprop_grouped(rc->dev, out[i], residual, x, rc->weight_cache->b, n_groups, offsets, OC[i], C);
    }
}

// Each dY rounded once; all Dgrads one call (dinp += sum_i bf16(dY_i W_i) in order of i, all groups), then
// Wgrad Linear by Linear, group by group; groups write disjoint rows of dinp and slices of dW, so this is the
// order of group-by-group, Linear-by-Linear calls. With dinp_bf16 instead of dinp (one Linear, written), the input
// gradient is left as the Dgrad's BF16 product (kernels.h bf16_gemm_dgrad_grouped_bf16).
static void bf16_backward(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *dinp, uint16_t *dinp_bf16,
                          GradStore dinp_store, const DgradUnpermute *unpermute, real *const *dweight,
                          const real *const *dout, const real *inp, const int *inp_rows, const real *const *weight,
                          int C, int OC) {
    const int rows = offsets[n_groups];
    scratch_reserve(rc, bf16_bytes(rows, C) + (size_t)n_out * bf16_bytes(rows, OC));
    size_t used = 0;
    uint16_t *x = NULL;
    for (int i = 0; i < n_out && x == NULL; i++) {
        if (dweight[i] == NULL) continue;
        x = take_wgrad_bf16(rc, &used, (size_t)rows * C);
        bf16_round_input(rc, x, inp, inp_rows, rows, C);
    }
    uint16_t *dy[MAX_SHARED];
    for (int i = 0; i < n_out; i++) {
        dy[i] = NULL;
        if (dinp == NULL && dinp_bf16 == NULL && dweight[i] == NULL) continue;
        dy[i] = dweight[i] ? take_wgrad_bf16(rc, &used, (size_t)rows * OC)
                           : scratch_take(rc, &used, (size_t)rows * OC * sizeof(uint16_t));
        bf16_round_array(rc->dev, dy[i], dout[i], (int64_t)rows * OC);
    }
    if (dinp) {
        const struct LinearWeightCache *c = rc->weight_cache;
        const uint16_t *dys[MAX_SHARED], *const *w[MAX_SHARED];
        for (int i = 0; i < n_out; i++) {
            group_weights(rc, i, n_groups, offsets, weight[i], OC, C);
            dys[i] = dy[i], w[i] = c->b + i * c->max_groups;
        }
        bf16_gemm_dgrad_grouped(rc->dev, dinp, dinp_store, unpermute, n_out, dys, w, n_groups, offsets, OC, C);
    }
    if (dinp_bf16) {
        group_weights(rc, 0, n_groups, offsets, weight[0], OC, C);
        bf16_gemm_dgrad_grouped_bf16(rc->dev, dinp_bf16, dy[0], rc->weight_cache->b, n_groups, offsets, OC, C);
    }
    for (int i = 0; i < n_out; i++) {
        if (dweight[i] == NULL) continue;
        const WgradGemm g = {WGRAD_BF16, profile_current_phase(), dweight[i], dy[i], x, NULL, NULL, n_groups, OC, C,
                             offsets};
        run_or_record_wgrad(rc, &g);
    }
}

// ---------------------------------------------------------------------------- bf16 SwiGLU FFNs
// bf16 mode's FFNs in the form of fp8 mode's fused paths (linear_bf16_products): a and b stay their Fprops' BF16
// products, h, da and db are rounded in the passes that compute them (kernels.h swiglu_*_bf16), d_h stays w2's Dgrad
// product, and the routed experts' output gradient is rounded as it is computed from the combine's (CombineGrad).
// The GEMMs and their rounded operands are those bf16_forward / bf16_backward run on the FP32 arrays of
// swiglu_forward / swiglu_backward, so the bits are theirs, without those arrays and their conversion passes.
static void bf16_swiglu_forward(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w, const real *x,
                                const int *x_rows, const SwigluGate *gate, real *y, uint16_t *y_bf16, int D, int I) {
    const int rows = offsets[n_groups];
    const uint16_t *const *b = rc->weight_cache->b;
    scratch_reserve(rc, bf16_bytes(rows, D) + bf16_bytes(rows, I));
    size_t used = 0;
    uint16_t *x16 = scratch_take(rc, &used, (size_t)rows * D * sizeof(uint16_t));
    uint16_t *h16 = scratch_take(rc, &used, (size_t)rows * I * sizeof(uint16_t));
    bf16_round_input(rc, x16, x, x_rows, rows, D);
    group_weights(rc, 0, n_groups, offsets, w->w1, I, D);
    bf16_gemm_fprop_grouped_bf16(rc->dev, gate->a16, x16, b, n_groups, offsets, I, D);
    group_weights(rc, 0, n_groups, offsets, w->w3, I, D);
    bf16_gemm_fprop_grouped_bf16(rc->dev, gate->b16, x16, b, n_groups, offsets, I, D);
    swiglu_forward_bf16(rc->dev, h16, gate->a16, gate->b16, rows, I);
    group_weights(rc, 0, n_groups, offsets, w->w2, D, I);
    if (y_bf16) bf16_gemm_fprop_grouped_bf16(rc->dev, y_bf16, h16, b, n_groups, offsets, D, I);
    else bf16_gemm_fprop_grouped(rc->dev, y, NULL, h16, b, n_groups, offsets, D, I);
}

static void bf16_swiglu_backward(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w,
                                 const FfnWeights *g, const SwigluGate *gate, const real *dy,
                                 const CombineGrad *dy_combine, const real *x, const int *x_rows, real *dx,
                                 uint16_t *dx_bf16, GradStore dx_store, const DgradUnpermute *unpermute,
                                 uint16_t *d_h16, int D, int I) {
    const int rows = offsets[n_groups];
    const struct LinearWeightCache *c = rc->weight_cache;
    scratch_reserve(rc, 2 * bf16_bytes(rows, D) + 3 * bf16_bytes(rows, I));
    size_t used = 0;
    // w2: its dY rounded (the routed experts': computed from the combine's gradient), its Dgrad left in BF16 (d_h)
    uint16_t *dy16 = take_wgrad_bf16(rc, &used, (size_t)rows * D);
    if (dy_combine) {
        if (rows % dy_combine->topk != 0) {
            fprintf(stderr, "fp8moe: train/linear.c: internal error: %d routed rows are not %d slots per token\n",
                    rows, dy_combine->topk);
            exit(1);
        }
        moe_combine_grad_bf16(rc->dev, dy16, dy_combine->d_out, dy_combine->topk_w, dy_combine->slot_of,
                              rows / dy_combine->topk, dy_combine->topk, D);
    } else {
        bf16_round_array(rc->dev, dy16, dy, (int64_t)rows * D);
    }
    group_weights(rc, 0, n_groups, offsets, w->w2, D, I);
    bf16_gemm_dgrad_grouped_bf16(rc->dev, d_h16, dy16, c->b, n_groups, offsets, D, I);
    // h (w2's Wgrad operand), da and db (w1's and w3's dYs) in one pass over a, b and d_h
    uint16_t *h16 = g->w2 ? take_wgrad_bf16(rc, &used, (size_t)rows * I) : NULL;
    uint16_t *d_ab[2] = {take_wgrad_bf16(rc, &used, (size_t)rows * I), take_wgrad_bf16(rc, &used, (size_t)rows * I)};
    swiglu_backward_bf16(rc->dev, h16, d_ab[0], d_ab[1], d_h16, gate->a16, gate->b16, rows, I);
    if (g->w2) {
        const WgradGemm w2 = {WGRAD_BF16, profile_current_phase(), g->w2, dy16, h16, NULL, NULL, n_groups, D, I,
                              offsets};
        run_or_record_wgrad(rc, &w2);
    }
    // w1 and w3: one Dgrad call, then their Wgrads
    real *const g13[2] = {g->w1, g->w3};
    const real *const w13[2] = {w->w1, w->w3};
    uint16_t *x16 = NULL;
    if (g13[0] || g13[1]) {
        x16 = take_wgrad_bf16(rc, &used, (size_t)rows * D);
        bf16_round_input(rc, x16, x, x_rows, rows, D);
    }
    if (dx || dx_bf16) {
        const uint16_t *dys[2] = {d_ab[0], d_ab[1]}, *const *ws[2];
        for (int i = 0; i < 2; i++) {
            group_weights(rc, i, n_groups, offsets, w13[i], I, D);
            ws[i] = c->b + i * c->max_groups;
        }
        if (dx_bf16)  // each product as it is (linear.h)
            for (int i = 0; i < 2; i++)
                bf16_gemm_dgrad_grouped_bf16(rc->dev, dx_bf16 + i * bf16_rows_elems(rows, D), dys[i], ws[i], n_groups,
                                             offsets, I, D);
        else
            bf16_gemm_dgrad_grouped(rc->dev, dx, dx_store, unpermute, 2, dys, ws, n_groups, offsets, I, D);
    }
    for (int i = 0; i < 2; i++) {
        if (g13[i] == NULL) continue;
        const WgradGemm wi = {WGRAD_BF16, profile_current_phase(), g13[i], d_ab[i], x16, NULL, NULL, n_groups, I, D,
                              offsets};
        run_or_record_wgrad(rc, &wi);
    }
}

// ---------------------------------------------------------------------------- entry points (linear.h)
void linear_forward(RunCtx *rc, real *out, const real *inp, const real *weight, int N, int C, int OC, KeptInput *kept) {
    linear_forward_shared(rc, 1, &out, inp, &weight, N, C, &OC, kept);
}

static void forward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out,
                            uint16_t *const *out_bf16, const Operand *x, const real *const *weight, int C,
                            const int *OC, const real *residual, KeptInput *kept, SharedFprop *fprop);

void linear_forward_bf16(RunCtx *rc, uint16_t *out_bf16, const real *inp, const real *weight, int N, int C, int OC,
                         KeptInput *kept) {
    const int offsets[2] = {0, N};
    const Operand x = array_operand(inp, NULL);
    forward_grouped(rc, 1, offsets, 1, NULL, &out_bf16, &x, &weight, C, &OC, NULL, kept, NULL);
}

void linear_forward_norm(RunCtx *rc, int n_out, real *const *out, uint16_t *const *out_bf16, const NormInput *in,
                         const real *const *weight, int N, int C, const int *OC, KeptInput *kept) {
    const int offsets[2] = {0, N};
    const int fused = linear_fp8_fused(rc) && kept != NULL && kept->q != NULL;
    rmsnorm_forward(rc->dev, fused ? NULL : in->xn, in->rstd, in->x, in->weight, N, C);
    const Operand x = fused ? (Operand){.kind = OPERAND_NORM, .x = in->x, .rstd = in->rstd, .norm_w = in->weight}
                            : array_operand(in->xn, NULL);
    forward_grouped(rc, 1, offsets, n_out, out, out_bf16, &x, weight, C, OC, NULL, kept, NULL);
}

// inp_rows is for the FP8 quantisers and the BF16 rounding; fp32 mode gets its rows gathered by the caller.
static void check_inp_rows(const RunCtx *rc, const int *inp_rows) {
    if (inp_rows == NULL || rc->precision.mode != PRECISION_FP32) return;
    fprintf(stderr, "fp8moe: train/linear.c: internal error: gathered input rows given to a Linear in precision mode "
                    "fp32 (only fp8 and bf16 read rows through an index)\n");
    exit(1);
}

// linear_forward_grouped with Linear i's own output width OC[i] and a residual (n_out = 1 then; else NULL) added to
// the output (linear_forward_residual); with out_bf16 instead of out, the BF16 products (linear_forward_bf16).
static void forward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out,
                            uint16_t *const *out_bf16, const Operand *x, const real *const *weight, int C,
                            const int *OC, const real *residual, KeptInput *kept, SharedFprop *fprop) {
    if (n_out > MAX_SHARED) too_many_shared(n_out);
    const real *inp = x->x;  // (bf16 and fp32 modes: an array; only fp8 mode's fused paths make other operands)
    const int *inp_rows = x->rows;
    if (out_bf16 != NULL && (!linear_bf16_products(rc) || residual != NULL)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: BF16 products asked of a Linear %s (only fp8 mode's "
                        "fused paths and bf16 mode leave them, without a residual: linear_bf16_products)\n",
                residual != NULL ? "with a residual" : "outside linear_bf16_products");
        exit(1);
    }
    if (residual != NULL && n_out != 1) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: a residual with %d Linears (only one takes it)\n",
                n_out);
        exit(1);
    }
    check_inp_rows(rc, inp_rows);
    profile_begin(PHASE_OTHER_GEMM);  // the caller may make it an expert GEMM (kernels/profile.h)
    if (rc->precision.mode == PRECISION_FP8) {
        fp8_forward(rc, n_groups, offsets, n_out, out, out_bf16, x, weight, C, OC, residual, kept, fprop);
    } else if (rc->precision.mode == PRECISION_BF16) {
        bf16_forward(rc, n_groups, offsets, n_out, out, out_bf16, inp, inp_rows, weight, C, OC, residual);
    } else {
        for (int g = 0; g < n_groups; g++) {
            const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
            for (int i = 0; i < n_out && n > 0; i++)
                matmul_forward(rc->dev, out[i] + (int64_t)r0 * OC[i], inp + (int64_t)r0 * C,
                               weight[i] + (int64_t)g * OC[i] * C, n, C, OC[i]);
        }
        if (residual != NULL) add_inplace(rc->dev, out[0], residual, (int64_t)offsets[n_groups] * OC[0]);
    }
    profile_end(PHASE_OTHER_GEMM);
}

void linear_forward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out, const real *inp,
                            const int *inp_rows, const real *const *weight, int C, int OC, KeptInput *kept,
                            SharedFprop *fprop) {
    int widths[MAX_SHARED];
    if (n_out > MAX_SHARED) too_many_shared(n_out);
    for (int i = 0; i < n_out; i++) widths[i] = OC;
    const Operand x = array_operand(inp, inp_rows);
    forward_grouped(rc, n_groups, offsets, n_out, out, NULL, &x, weight, C, widths, NULL, kept, fprop);
}

void linear_forward_shared(RunCtx *rc, int n_out, real *const *out, const real *inp, const real *const *weight, int N,
                           int C, const int *OC, KeptInput *kept) {
    const int offsets[2] = {0, N};
    const Operand x = array_operand(inp, NULL);
    forward_grouped(rc, 1, offsets, n_out, out, NULL, &x, weight, C, OC, NULL, kept, NULL);
}

void linear_forward_residual(RunCtx *rc, real *out, const real *inp, const real *weight, const real *residual, int N,
                             int C, int OC, KeptInput *kept) {
    const int offsets[2] = {0, N};
    const Operand x = array_operand(inp, NULL);
    forward_grouped(rc, 1, offsets, 1, &out, NULL, &x, &weight, C, &OC, residual, kept, NULL);
}

void linear_backward(RunCtx *rc, real *dinp, GradStore dinp_store, real *dweight, const real *dout, const real *inp,
                     const real *weight, int N, int C, int OC, const KeptInput *kept) {
    linear_backward_shared(rc, 1, dinp, dinp_store, &dweight, &dout, inp, &weight, N, C, OC, kept);
}

void linear_backward_bf16(RunCtx *rc, uint16_t *dinp_bf16, real *dweight, const real *dout, const real *inp,
                          const real *weight, int N, int C, int OC, const KeptInput *kept) {
    if (!linear_bf16_products(rc)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: a BF16 input gradient asked of a Linear outside fp8 "
                        "mode's fused paths and bf16 mode (linear_bf16_products)\n");
        exit(1);
    }
    const int offsets[2] = {0, N};
    profile_begin(PHASE_OTHER_GEMM);
    if (rc->precision.mode == PRECISION_BF16) {
        bf16_backward(rc, 1, offsets, 1, NULL, dinp_bf16, GRAD_WRITE, NULL, &dweight, &dout, inp, NULL, &weight, C,
                      OC);
    } else {
        const Operand x = array_operand(inp, NULL), dy = array_operand(dout, NULL);
        fp8_backward(rc, 1, offsets, 1, NULL, dinp_bf16, GRAD_WRITE, NULL, &dweight, &dy, &x, &weight, C, OC, kept);
    }
    profile_end(PHASE_OTHER_GEMM);
}

void linear_backward_shared(RunCtx *rc, int n_out, real *dinp, GradStore dinp_store, real *const *dweight,
                            const real *const *dout, const real *inp, const real *const *weight, int N, int C, int OC,
                            const KeptInput *kept) {
    const int offsets[2] = {0, N};
    linear_backward_grouped(rc, 1, offsets, n_out, dinp, dinp_store, NULL, dweight, dout, inp, NULL, weight, C, OC,
                            kept);
}

void linear_backward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *dinp, GradStore dinp_store,
                             const DgradUnpermute *unpermute, real *const *dweight, const real *const *dout,
                             const real *inp, const int *inp_rows, const real *const *weight, int C, int OC,
                             const KeptInput *kept) {
    if (n_out > MAX_SHARED) too_many_shared(n_out);
    check_inp_rows(rc, inp_rows);
    if (unpermute != NULL && inp_rows == NULL) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: an unpermuted input gradient needs input rows read "
                        "through an index\n");
        exit(1);
    }
    profile_begin(PHASE_OTHER_GEMM);
    if (rc->precision.mode == PRECISION_FP8) {
        const Operand x = array_operand(inp, inp_rows);
        Operand dy[MAX_SHARED];
        for (int i = 0; i < n_out; i++) dy[i] = array_operand(dout[i], NULL);
        fp8_backward(rc, n_groups, offsets, n_out, dinp, NULL, dinp_store, unpermute, dweight, dy, &x, weight, C, OC,
                     kept);
    } else if (rc->precision.mode == PRECISION_BF16) {
        bf16_backward(rc, n_groups, offsets, n_out, dinp, NULL, dinp_store, unpermute, dweight, dout, inp, inp_rows,
                      weight, C, OC);
    } else {
        // the FP32 reference matmul only accumulates: a written dinp is cleared first
        if (dinp != NULL && dinp_store == GRAD_WRITE)
            device_memset_zero(rc->dev, dinp, (size_t)offsets[n_groups] * (size_t)C * sizeof(real));
        for (int g = 0; g < n_groups && dinp != NULL; g++) {
            const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
            for (int i = 0; i < n_out && n > 0; i++)
                matmul_backward(rc->dev, dinp + (int64_t)r0 * C, NULL, dout[i] + (int64_t)r0 * OC, inp + (int64_t)r0 * C,
                                weight[i] + (int64_t)g * OC * C, n, C, OC);
        }
        // the Wgrads, each of its own slices: a W ticket keeps copies of X and dY (the caller's buffers may be reused
        // before it runs)
        const size_t rows = (size_t)offsets[n_groups];
        const real *x = inp;
        for (int i = 0; i < n_out; i++) {
            if (dweight[i] == NULL) continue;
            const real *dy = dout[i];
            if (rc->wgrad_ticket) {
                if (x == inp) x = copy_for_ticket(rc, inp, rows * C);
                dy = copy_for_ticket(rc, dout[i], rows * OC);
            }
            const WgradGemm g = {WGRAD_FP32, profile_current_phase(), dweight[i], dy, x, NULL, NULL, n_groups, OC, C,
                                 offsets};
            run_or_record_wgrad(rc, &g);
        }
    }
    profile_end(PHASE_OTHER_GEMM);
}

void linear_forward_swiglu_grouped(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w, const real *x,
                                   const int *x_rows, const SwigluGate *gate, real *h, real *y, uint16_t *y_bf16,
                                   int D, int I, KeptInput *x_kept, KeptInput *h_kept, SharedFprop *x_fprop) {
    const real *const w13[2] = {w->w1, w->w3};
    if ((y_bf16 != NULL) == (y != NULL) || (y_bf16 != NULL && !linear_bf16_products(rc))) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: an FFN's output goes to an FP32 array, or with its "
                        "gate in BF16 (linear_bf16_products) to a BF16 one\n");
        exit(1);
    }
    if (!linear_bf16_products(rc)) {
        real *const ab[2] = {gate->a, gate->b};
        linear_forward_grouped(rc, n_groups, offsets, 2, ab, x, x_rows, w13, D, I, x_kept, x_fprop);
        swiglu_forward(rc->dev, h, gate->a, gate->b, (int64_t)offsets[n_groups] * I);
        const real *const w2[1] = {w->w2};
        linear_forward_grouped(rc, n_groups, offsets, 1, &y, h, NULL, w2, I, D, h_kept, NULL);
        return;
    }
    check_inp_rows(rc, x_rows);
    profile_begin(PHASE_OTHER_GEMM);
    if (rc->precision.mode == PRECISION_BF16) {
        bf16_swiglu_forward(rc, n_groups, offsets, w, x, x_rows, gate, y, y_bf16, D, I);
        profile_end(PHASE_OTHER_GEMM);
        return;
    }
    // a and b stay the Fprops' BF16 products; h is computed from them by w2's quantisers
    const Operand xin = array_operand(x, x_rows), hin = swiglu_operand(SWIGLU_OUT, NULL, gate->a16, gate->b16);
    uint16_t *const ab16[2] = {gate->a16, gate->b16};
    const int widths[2] = {I, I};
    fp8_forward(rc, n_groups, offsets, 2, NULL, ab16, &xin, w13, D, widths, NULL, x_kept, x_fprop);
    const real *const w2[1] = {w->w2};
    fp8_forward(rc, n_groups, offsets, 1, y_bf16 ? NULL : &y, y_bf16 ? &y_bf16 : NULL, &hin, w2, I, &D, NULL, h_kept,
                NULL);
    profile_end(PHASE_OTHER_GEMM);
}

void linear_backward_swiglu_grouped(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w,
                                    const FfnWeights *g, const SwigluGate *gate, const real *dy,
                                    const CombineGrad *dy_combine, const real *x, const int *x_rows, real *dx,
                                    uint16_t *dx_bf16, GradStore dx_store, const DgradUnpermute *unpermute,
                                    const SwigluScratch *s, int D, int I, const KeptInput *x_kept,
                                    const KeptInput *h_kept) {
    real *const g13[2] = {g->w1, g->w3};
    const real *const w13[2] = {w->w1, w->w3}, *const w2[1] = {w->w2};
    if ((dy_combine != NULL) != (linear_bf16_products(rc) && dy == NULL)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: an FFN's output gradient must be an array, or with "
                        "its gate in BF16 (linear_bf16_products) the combine's gradient through the routing plan\n");
        exit(1);
    }
    if (dx_bf16 != NULL && (!linear_bf16_products(rc) || dx != NULL || dx_store != GRAD_WRITE || unpermute != NULL)) {
        fprintf(stderr, "fp8moe: train/linear.c: internal error: an FFN's input gradient left in BF16 is written, "
                        "in token order, with its gate in BF16 (linear_bf16_products)\n");
        exit(1);
    }
    if (!linear_bf16_products(rc)) {
        const int64_t n = (int64_t)offsets[n_groups] * I;
        swiglu_forward(rc->dev, s->h, gate->a, gate->b, n);
        linear_backward_grouped(rc, n_groups, offsets, 1, s->d_h, GRAD_WRITE, NULL, &g->w2, &dy, s->h, NULL, w2, I, D,
                                h_kept);
        swiglu_backward(rc->dev, s->d_a, s->d_b, s->d_h, gate->a, gate->b, n);
        const real *const d_ab[2] = {s->d_a, s->d_b};
        linear_backward_grouped(rc, n_groups, offsets, 2, dx, dx_store, unpermute, g13, d_ab, x, x_rows, w13, D, I,
                                x_kept);
        return;
    }
    check_inp_rows(rc, x_rows);
    profile_begin(PHASE_OTHER_GEMM);
    if (rc->precision.mode == PRECISION_BF16) {
        bf16_swiglu_backward(rc, n_groups, offsets, w, g, gate, dy, dy_combine, x, x_rows, dx, dx_bf16, dx_store,
                             unpermute, s->d_h16, D, I);
        profile_end(PHASE_OTHER_GEMM);
        return;
    }
    // w2: X is h, computed in its Wgrad quantiser; d_h is left as the Dgrad's BF16 product (the only producer)
    const Operand h = swiglu_operand(SWIGLU_OUT, NULL, gate->a16, gate->b16);
    const Operand dy_w2 = dy_combine ? (Operand){.kind = OPERAND_COMBINE_GRAD, .combine = dy_combine}
                                     : array_operand(dy, NULL);
    fp8_backward(rc, n_groups, offsets, 1, NULL, s->d_h16, GRAD_WRITE, NULL, &g->w2, &dy_w2, &h, w2, I, D, h_kept);
    // w1 and w3: their dYs are swiglu_backward's da and db, computed in their quantisers from d_h
    const Operand d_ab[2] = {swiglu_operand(SWIGLU_DA, s->d_h16, gate->a16, gate->b16),
                             swiglu_operand(SWIGLU_DB, s->d_h16, gate->a16, NULL)};
    const Operand xin = array_operand(x, x_rows);
    fp8_backward(rc, n_groups, offsets, 2, dx, dx_bf16, dx_store, unpermute, g13, d_ab, &xin, w13, D, I, x_kept);
    profile_end(PHASE_OTHER_GEMM);
}

void linear_free_scratch(RunCtx *rc) {
    weight_cache_free(rc);
    device_free(rc->dev, rc->linear_scratch);
    rc->linear_scratch = NULL;
    rc->linear_scratch_bytes = 0;
}
