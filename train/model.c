/*
 * model.c - the DeepSeek-V3 model: parameter table and flat buffers, initialisation, chunks, the output
 * head with its cross-entropy, the multi-token-prediction modules, and the loss
 *   L = L_main + (lambda / D) sum_k L_k + L_bal          (DESIGN.md section 3)
 * Blocks themselves are in block.c (MLA in mla.c, FFN and MoE in moe.c).
 */
#include "train/model.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/shard.h"
#include "kernels/profile.h"
#include "kernels/rng.h"
#include "optim/bias_balance.h"
#include "train/layers.h"
#include "train/linear.h"
#include "train/wgrad_ticket.h"

// ---------------------------------------------------------------------------- shapes
Dims dims_from_config(const Config *c, int B, int T) {
    Dims d;
    memset(&d, 0, sizeof d);
    d.B = B;
    d.T = T;
    // in 64 bits: train/config.c bounds micro_batch_size * seq_len so that the token rows fit an int
    const int64_t N = (int64_t)B * T;
    if (B < 0 || T < 0 || N > INT_MAX) {
        fprintf(stderr, "fp8moe: train/model.c: internal error: %d sequences of %d tokens are %lld token rows - "
                        "expected at most %d (the job check bounds train.micro_batch_size * train.seq_len)\n",
                B, T, (long long)N, INT_MAX);
        exit(1);
    }
    d.N = (int)N;
    d.D = c->model.dim;
    d.H = c->model.n_heads;
    d.dn = c->model.qk_nope_head_dim;
    d.dr = c->model.qk_rope_head_dim;
    d.dv = c->model.v_head_dim;
    d.dqk = d.dn + d.dr;
    d.qr = c->model.q_lora_rank;
    d.kvr = c->model.kv_lora_rank;
    d.inter = c->model.inter_dim;
    d.E = c->moe.n_routed_experts;
    d.K = c->moe.n_activated_experts;
    d.I = c->moe.moe_inter_dim;
    d.local_rows = (int64_t)d.N * d.K * c->parallel.ep;  // every rank of the EP group may route all its rows here
    d.shared_I = c->moe.n_shared_experts * c->moe.moe_inter_dim;
    d.n_groups = c->moe.n_expert_groups;
    d.n_limited = c->moe.n_limited_groups;
    d.route_scale = (real)c->moe.route_scale;
    d.rope_theta = (real)c->model.rope_theta;
    d.balance_alpha = (real)c->moe.balance_loss_alpha;
    return d;
}

// ---------------------------------------------------------------------------- placement
Placement placement_whole(const Config *cfg) {
    return (Placement){.n_chunks = 1, .chunk = {{0, cfg->model.n_layers, 1, 1}}, .has_embedding = 1, .has_head = 1,
                       .expert0 = 0, .n_experts = cfg->moe.n_routed_experts};
}

void placement_stage_layers(const Config *cfg, int s, int n_stages, int *first_layer, int *n_layers) {
    const ParallelConfig *p = &cfg->parallel;
    if (p->n_stage_layers == n_stages) {  // parallel.stage_layers (config_load checked it against the stages)
        *first_layer = 0;
        for (int k = 0; k < s; k++) *first_layer += p->stage_layer_count[k];
        *n_layers = p->stage_layer_count[s];
        return;
    }
    const int L = cfg->model.n_layers, base = L / n_stages, extra = L % n_stages;
    *first_layer = s * base + (s < extra ? s : extra);
    *n_layers = base + (s < extra);
}

int placement_stages(const Config *cfg, const int *stages, int n, int n_stages, Placement *p, char *err,
                     size_t err_size) {
    const int L = cfg->model.n_layers;
    if (n_stages < 1 || n_stages > L || n < 1 || n > PLACEMENT_MAX_CHUNKS) {
        snprintf(err, err_size, "%d stage(s) of %d: expected 1 <= stages <= model.n_layers = %d and 1..%d stages per "
                 "rank", n, n_stages, L, PLACEMENT_MAX_CHUNKS);
        return -1;
    }
    *p = placement_whole(cfg);
    p->n_chunks = n;
    p->has_embedding = p->has_head = 0;
    for (int c = 0; c < n; c++) {
        const int s = stages[c];
        if (s < 0 || s >= n_stages || (c > 0 && s == stages[0])) {
            snprintf(err, err_size, "stage %d of %d: expected a distinct stage in [0, %d)", s, n_stages, n_stages);
            return -1;
        }
        ChunkPlacement *cp = &p->chunk[c];
        placement_stage_layers(cfg, s, n_stages, &cp->first_layer, &cp->n_layers);
        cp->embeds_input = s == 0;
        cp->has_head = s == n_stages - 1;
        p->has_embedding |= cp->embeds_input || (cp->has_head && cfg->mtp.depth > 0);
        p->has_head |= cp->has_head;
    }
    return 0;
}

// Whether layer l is in one of the placement's chunks.
static int placement_holds_layer(const Placement *pl, int l) {
    for (int c = 0; c < pl->n_chunks; c++)
        if (l >= pl->chunk[c].first_layer && l < pl->chunk[c].first_layer + pl->chunk[c].n_layers) return 1;
    return 0;
}

int placement_set_experts(const Config *cfg, Placement *p, int expert0, int n_experts, char *err, size_t err_size) {
    const int E = cfg->moe.n_routed_experts;
    if (n_experts < 1 || expert0 < 0 || expert0 + n_experts > E) {
        snprintf(err, err_size, "experts [%d, %d): expected a non-empty range inside [0, moe.n_routed_experts = %d)",
                 expert0, expert0 + n_experts, E);
        return -1;
    }
    p->expert0 = expert0;
    p->n_experts = n_experts;
    return 0;
}

// ---------------------------------------------------------------------------- parameter table
// Built in two passes over the same description, restricted to the placement: non-expert tensors first,
// then routed-expert tensors, so the expert part of the flat buffer is contiguous. Each entry records its
// role, reduction group, layer and expert, and remembers where its weight and gradient pointers go; the
// pointers are bound once the buffers exist.
typedef struct {
    Model *m;
    int expert_pass;   // 0: collect non-expert tensors, 1: expert tensors
    int64_t offset;
    int cap;
    int layer;         // main-model layer of the tensors being added, or -1
    int expert;        // global expert index of the tensors being added, or -1
    int shares_input;  // the tensors being added are SwiGLU w1 / w3
    real ***wslots, ***gslots;  // per table entry: where to store the weight / gradient pointer
    double *init_std;           // per entry; 0 = ones (norm weights)
} TableBuilder;

static void add_param(TableBuilder *tb, ParamRole role, real **wslot, real **gslot, double init_std, int ndim,
                      int s0, int s1, int s2, const char *fmt, ...) __attribute__((format(printf, 10, 11)));

#include <stdarg.h>
static void add_param(TableBuilder *tb, ParamRole role, real **wslot, real **gslot, double init_std, int ndim,
                      int s0, int s1, int s2, const char *fmt, ...) {
    const int is_expert = role == PARAM_ROUTED_EXPERT;
    if (is_expert != tb->expert_pass) return;
    Model *m = tb->m;
    if (m->n_params == tb->cap) {
        tb->cap = tb->cap ? 2 * tb->cap : 256;
        m->params = realloc(m->params, (size_t)tb->cap * sizeof(ParamInfo));
        tb->wslots = realloc(tb->wslots, (size_t)tb->cap * sizeof(real **));
        tb->gslots = realloc(tb->gslots, (size_t)tb->cap * sizeof(real **));
        tb->init_std = realloc(tb->init_std, (size_t)tb->cap * sizeof(double));
        if (!m->params || !tb->wslots || !tb->gslots || !tb->init_std) {
            fprintf(stderr, "fp8moe: out of host memory building the parameter table\n");
            exit(1);
        }
    }
    ParamInfo *p = &m->params[m->n_params];
    memset(p, 0, sizeof *p);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->name, sizeof p->name, fmt, ap);
    va_end(ap);
    p->ndim = ndim;
    p->shape[0] = s0;
    p->shape[1] = s1;
    p->shape[2] = s2;
    p->numel = (int64_t)s0 * (ndim > 1 ? s1 : 1) * (ndim > 2 ? s2 : 1);
    p->offset = tb->offset;
    p->role = role;
    p->reduce = is_expert ? REDUCE_EDP : role == PARAM_EMBEDDING ? REDUCE_TIED_EMBEDDING : REDUCE_DP;
    p->layer = tb->layer;
    p->expert = is_expert ? tb->expert : -1;
    p->is_expert = is_expert;
    p->no_decay = role == PARAM_NORM;
    p->shares_input = tb->shares_input;
    tb->wslots[m->n_params] = wslot;
    tb->gslots[m->n_params] = gslot;
    tb->init_std[m->n_params] = init_std;
    tb->offset += p->numel;
    m->n_params++;
}

// a Linear weight (out, in) of the given role / a norm weight (n)
#define LINEAR(role, field, out_dim, in_dim, std, ...) \
    add_param(tb, (role), &(w->field), &(g->field), (std), 2, (out_dim), (in_dim), 0, __VA_ARGS__)
#define NORM(field, n, ...) add_param(tb, PARAM_NORM, &(w->field), &(g->field), 0.0, 1, (n), 0, 0, __VA_ARGS__)

static void add_ffn(TableBuilder *tb, FfnWeights *w, FfnWeights *g, int D, int width, double std,
                    double out_std, const char *prefix) {
    tb->shares_input = 1;
    LINEAR(PARAM_BLOCK_LINEAR, w1, width, D, std, "%s.w1.weight", prefix);
    tb->shares_input = 0;
    LINEAR(PARAM_BLOCK_LINEAR, w2, D, width, out_std, "%s.w2.weight", prefix);
    tb->shares_input = 1;
    LINEAR(PARAM_BLOCK_LINEAR, w3, width, D, std, "%s.w3.weight", prefix);
    tb->shares_input = 0;
}

static void add_block(TableBuilder *tb, BlockWeights *w, BlockWeights *g, const Config *c, const char *prefix) {
    const ModelConfig *mc = &c->model;
    const Placement *pl = &tb->m->placement;
    int D = mc->dim, H = mc->n_heads, dqk = mc->qk_nope_head_dim + mc->qk_rope_head_dim;
    double std = mc->init_std, out_std = mc->init_std / sqrt(2.0 * (mc->n_layers + c->mtp.depth));
    char name[MODEL_NAME_MAX];
    NORM(attn_norm, D, "%s.attn_norm.weight", prefix);
    if (mc->q_lora_rank > 0) {
        LINEAR(PARAM_BLOCK_LINEAR, attn.wq_a, mc->q_lora_rank, D, std, "%s.attn.wq_a.weight", prefix);
        NORM(attn.q_norm, mc->q_lora_rank, "%s.attn.q_norm.weight", prefix);
        LINEAR(PARAM_BLOCK_LINEAR, attn.wq_b, H * dqk, mc->q_lora_rank, std, "%s.attn.wq_b.weight", prefix);
    } else {
        LINEAR(PARAM_BLOCK_LINEAR, attn.wq, H * dqk, D, std, "%s.attn.wq.weight", prefix);
    }
    LINEAR(PARAM_BLOCK_LINEAR, attn.wkv_a, mc->kv_lora_rank + mc->qk_rope_head_dim, D, std, "%s.attn.wkv_a.weight",
           prefix);
    NORM(attn.kv_norm, mc->kv_lora_rank, "%s.attn.kv_norm.weight", prefix);
    LINEAR(PARAM_BLOCK_LINEAR, attn.wkv_b, H * (mc->qk_nope_head_dim + mc->v_head_dim), mc->kv_lora_rank, std,
           "%s.attn.wkv_b.weight", prefix);
    LINEAR(PARAM_BLOCK_LINEAR, attn.wo, D, H * mc->v_head_dim, out_std, "%s.attn.wo.weight", prefix);
    NORM(ffn_norm, D, "%s.ffn_norm.weight", prefix);
    if (!w->is_moe) {
        snprintf(name, sizeof name, "%s.ffn", prefix);
        add_ffn(tb, &w->ffn, &g->ffn, D, mc->inter_dim, std, out_std, name);
        return;
    }
    const MoeConfig *e = &c->moe;
    LINEAR(PARAM_ROUTER, moe.gate, e->n_routed_experts, D, std, "%s.ffn.gate.weight", prefix);
    snprintf(name, sizeof name, "%s.ffn.shared_experts", prefix);
    add_ffn(tb, &w->moe.shared, &g->moe.shared, D, e->n_shared_experts * e->moe_inter_dim, std, out_std, name);
    // Routed experts of the placement: one table entry per expert and matrix (global names, as in DeepSeek's
    // checkpoints), laid out so that each matrix is stacked over the local experts; only the first local
    // expert's entry binds the stacked pointer.
    int I = e->moe_inter_dim;
    for (int which = 0; which < 3; which++) {
        tb->shares_input = which != 1;
        for (int x = pl->expert0; x < pl->expert0 + pl->n_experts; x++) {
            real **ws = NULL, **gs = NULL;
            if (x == pl->expert0) {
                ws = which == 0 ? &w->moe.experts.w1 : which == 1 ? &w->moe.experts.w2 : &w->moe.experts.w3;
                gs = which == 0 ? &g->moe.experts.w1 : which == 1 ? &g->moe.experts.w2 : &g->moe.experts.w3;
            }
            int out_dim = which == 1 ? D : I, in_dim = which == 1 ? I : D;
            tb->expert = x;
            add_param(tb, PARAM_ROUTED_EXPERT, ws, gs, which == 1 ? out_std : std, 2, out_dim, in_dim, 0,
                      "%s.ffn.experts.%d.w%d.weight", prefix, x, which + 1);
        }
        tb->expert = -1;
        tb->shares_input = 0;
    }
}

// The routed experts' gradient stacks (RunCtx.grad_stacks): each starts at its first local expert's entry and holds
// the local experts' matrices one after another. Registered only when they tile the buffer's experts' part exactly
// (model_zero_grads_for_step leaves that part to the Wgrads, so nothing in it may lie outside a stack).
static void register_grad_stacks(Model *m) {
    const Placement *pl = &m->placement;
    int n = 0;
    for (int i = 0; i < m->n_params; i++) n += m->params[i].is_expert && m->params[i].expert == pl->expert0;
    if (n == 0) return;
    struct GradStack *st = calloc((size_t)n, sizeof *st);
    if (!st) { fprintf(stderr, "fp8moe: out of host memory (train/model.c gradient stacks)\n"); exit(1); }
    const int64_t lo = m->n_dense_elems, hi = m->n_dense_elems + m->n_expert_elems;
    int64_t covered = 0;
    int ok = 1;
    for (int i = 0, k = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        if (!p->is_expert || p->expert != pl->expert0) continue;
        st[k] = (struct GradStack){m->grads + p->offset, (int64_t)pl->n_experts * p->numel, 0};
        ok &= p->offset >= lo && p->offset + st[k].n <= hi;
        covered += st[k++].n;
    }
    if (!ok || covered != m->n_expert_elems) {  // (stacks never overlap: each expert entry is its own range)
        free(st);
        return;
    }
    m->rc.grad_stacks = st, m->rc.n_grad_stacks = n;
}

static void build_table(TableBuilder *tb, const Config *c) {
    Model *m = tb->m;
    const Placement *pl = &m->placement;
    ModelWeights *w = &m->w, *g = &m->g;
    const ModelConfig *mc = &c->model;
    int D = mc->dim, V = mc->vocab_size;
    char prefix[64];
    tb->layer = -1;
    tb->expert = -1;
    if (pl->has_embedding) LINEAR(PARAM_EMBEDDING, embed, V, D, mc->init_std, "embed.weight");
    for (int l = 0; l < mc->n_layers; l++) {  // in the whole model's order (model.h Placement)
        if (!placement_holds_layer(pl, l)) continue;
        snprintf(prefix, sizeof prefix, "layers.%d", l);
        tb->layer = l;
        add_block(tb, &w->blocks[l], &g->blocks[l], c, prefix);
    }
    tb->layer = -1;
    if (!pl->has_head) return;
    NORM(norm, D, "norm.weight");
    LINEAR(PARAM_HEAD, head, V, D, mc->init_std, "head.weight");
    for (int k = 0; k < c->mtp.depth; k++) {
        MtpWeights *mw = &w->mtp[k], *mg = &g->mtp[k];
        snprintf(prefix, sizeof prefix, "mtp.%d", k);
        add_param(tb, PARAM_NORM, &mw->enorm, &mg->enorm, 0.0, 1, D, 0, 0, "%s.enorm.weight", prefix);
        add_param(tb, PARAM_NORM, &mw->hnorm, &mg->hnorm, 0.0, 1, D, 0, 0, "%s.hnorm.weight", prefix);
        add_param(tb, PARAM_BLOCK_LINEAR, &mw->eh_proj, &mg->eh_proj, mc->init_std, 2, D, 2 * D, 0, "%s.eh_proj.weight",
                  prefix);
        snprintf(prefix, sizeof prefix, "mtp.%d.block", k);
        add_block(tb, &mw->block, &mg->block, c, prefix);
        add_param(tb, PARAM_NORM, &mw->norm, &mg->norm, 0.0, 1, D, 0, 0, "mtp.%d.norm.weight", k);
    }
}
#undef LINEAR
#undef NORM

// ---------------------------------------------------------------------------- create / free
static void init_weights(Model *m, const double *init_std) {
    // Drawn on the host from a counter-based stream per tensor, keyed by the tensor's global name
    // ("layers.3.ffn.experts.5.w1.weight" names expert 5 of layer 3 whatever rank holds it), so a
    // tensor gets the same values under every placement and thread count; then copied to the device.
    uint64_t seed = m->cfg.train.seed;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        real *host = malloc((size_t)p->numel * sizeof(real));
        if (!host) { fprintf(stderr, "fp8moe: out of host memory initialising %s\n", p->name); exit(1); }
        uint64_t name_hash = data_fnv1a64(p->name, strlen(p->name), DATA_FNV1A64_INIT);
        uint64_t key = rng_key(seed, 0x5041524dULL /* "PARM" */, name_hash, 0);
        double std = init_std[i];
        // element j depends only on (key, j): threads change the speed (billions of draws for a large
        // model), never the values
        #pragma omp parallel for schedule(static) if (p->numel > 65536)
        for (int64_t j = 0; j < p->numel; j++) host[j] = std == 0.0 ? (real)1 : (real)(std * rng_normal(key, (uint64_t)j));
        device_memcpy_from_host(m->rc.dev, m->weights + p->offset, host, (size_t)p->numel * sizeof(real));
        free(host);
    }
}

// Builds the part of the model that *pl holds, as n_chunks chunks over its layers.
static int model_build(Model *m, const Config *cfg, Device dev, const Placement *pl, int n_chunks, char *err,
                       size_t err_size) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->rc.dev = dev;
    m->placement = *pl;
    const ModelConfig *mc = &cfg->model;
    int L = mc->n_layers, depth = cfg->mtp.depth;
    int fits = pl->n_chunks >= 1 && pl->n_chunks <= PLACEMENT_MAX_CHUNKS && pl->expert0 >= 0 && pl->n_experts >= 1 &&
               pl->expert0 + pl->n_experts <= cfg->moe.n_routed_experts;
    for (int c = 0; fits && c < pl->n_chunks; c++) {
        const ChunkPlacement *cp = &pl->chunk[c];
        fits = cp->first_layer >= 0 && cp->n_layers >= 1 && cp->first_layer + cp->n_layers <= L &&
               pl->has_embedding >= cp->embeds_input && pl->has_head >= cp->has_head;
        for (int o = 0; fits && o < c; o++)  // chunks do not overlap
            fits = cp->first_layer >= pl->chunk[o].first_layer + pl->chunk[o].n_layers ||
                   pl->chunk[o].first_layer >= cp->first_layer + cp->n_layers;
    }
    if (!fits) {
        snprintf(err, err_size, "placement of %d chunk(s) (layers [%d, %d) first) and experts [%d, %d) does not fit the "
                 "model's %d layers and %d experts", pl->n_chunks, pl->chunk[0].first_layer,
                 pl->chunk[0].first_layer + pl->chunk[0].n_layers, pl->expert0, pl->expert0 + pl->n_experts, L,
                 cfg->moe.n_routed_experts);
        return -1;
    }
    if (pl->n_chunks == 1 ? n_chunks < 1 || n_chunks > pl->chunk[0].n_layers : n_chunks != pl->n_chunks) {
        snprintf(err, err_size, "cannot split %d layers into %d chunks", pl->chunk[0].n_layers, n_chunks);
        return -1;
    }
    if (depth > MTP_MAX_DEPTH) {
        snprintf(err, err_size, "mtp.depth = %d: at most %d supported", depth, MTP_MAX_DEPTH);
        return -1;
    }
    int has_moe = L > mc->n_dense_layers;
    m->w.blocks = calloc((size_t)L, sizeof(BlockWeights));
    m->g.blocks = calloc((size_t)L, sizeof(BlockWeights));
    m->w.mtp = calloc((size_t)depth + 1, sizeof(MtpWeights));
    m->g.mtp = calloc((size_t)depth + 1, sizeof(MtpWeights));
    for (int l = 0; l < L; l++) {
        int moe = l >= mc->n_dense_layers;
        m->w.blocks[l].is_moe = m->g.blocks[l].is_moe = moe;
        m->w.blocks[l].moe_index = m->g.blocks[l].moe_index = moe ? m->n_moe_layers++ : -1;
    }
    for (int k = 0; k < depth; k++) {  // an MTP block is MoE when the model has MoE layers
        BlockWeights *bw = &m->w.mtp[k].block, *bg = &m->g.mtp[k].block;
        bw->is_moe = bg->is_moe = has_moe;
        bw->moe_index = bg->moe_index = has_moe ? m->n_moe_layers++ : -1;
    }

    TableBuilder tb = {.m = m};
    build_table(&tb, cfg);
    m->n_dense_elems = tb.offset;
    tb.expert_pass = 1;
    build_table(&tb, cfg);
    m->n_expert_elems = tb.offset - m->n_dense_elems;
    int64_t total = tb.offset;
    m->weights = device_alloc(dev, (size_t)total * sizeof(real));
    m->grads = device_alloc(dev, (size_t)total * sizeof(real));
    m->rc.precision = cfg->precision;
    m->rc.weights = m->weights;
    m->rc.n_weights = total;
    m->rc.max_groups = pl->n_experts;  // a grouped Linear call runs over the local experts
    for (int i = 0; i < m->n_params; i++) {
        if (tb.wslots[i]) *tb.wslots[i] = m->weights + m->params[i].offset;
        if (tb.gslots[i]) *tb.gslots[i] = m->grads + m->params[i].offset;
    }
    init_weights(m, tb.init_std);
    model_weights_changed(m);
    register_grad_stacks(m);
    free(tb.wslots);
    free(tb.gslots);
    free(tb.init_std);
    // precision.bf16_fprop_only names Linears of the whole model: checked where the whole model is (one process)
    const int whole = pl->n_chunks == 1 && pl->chunk[0].first_layer == 0 && pl->chunk[0].n_layers == L &&
                      pl->expert0 == 0 && pl->n_experts == cfg->moe.n_routed_experts;
    if (whole && linear_check_fprop_only(&cfg->precision, m->params, m->n_params, err, err_size) != 0) {
        model_free(m);
        return -1;
    }

    int E = cfg->moe.n_routed_experts;
    m->router_bias = device_alloc(dev, (size_t)(m->n_moe_layers ? m->n_moe_layers : 1) * E * sizeof(real));
    // the biases' global names: MoE layer l is main block n_dense + l, then one per MTP module (as their gates)
    m->router_bias_names = calloc((size_t)(m->n_moe_layers ? m->n_moe_layers : 1), sizeof *m->router_bias_names);
    for (int l = 0; l < L; l++)
        if (m->w.blocks[l].is_moe)
            snprintf(m->router_bias_names[m->w.blocks[l].moe_index], MODEL_NAME_MAX, "layers.%d.ffn.gate.bias", l);
    for (int k = 0; k < depth; k++)
        if (m->w.mtp[k].block.is_moe)
            snprintf(m->router_bias_names[m->w.mtp[k].block.moe_index], MODEL_NAME_MAX, "mtp.%d.block.ffn.gate.bias", k);
    m->expert_load = calloc((size_t)(m->n_moe_layers ? m->n_moe_layers : 1) * E, sizeof(int64_t));
    m->loss_weights.main = 1;
    for (int k = 0; k < depth; k++) m->loss_weights.mtp[k] = (real)(cfg->mtp.loss_weight / depth);
    m->loss_weights.balance = 1;

    // the placement's chunks; or one chunk split evenly into n_chunks (model_create, for tests)
    m->n_chunks = n_chunks;
    m->chunks = calloc((size_t)n_chunks, sizeof(ChunkSpec));
    for (int c = 0; c < n_chunks; c++) {
        if (pl->n_chunks > 1) {
            const ChunkPlacement *cp = &pl->chunk[c];
            m->chunks[c] = (ChunkSpec){cp->first_layer, cp->n_layers, cp->embeds_input, cp->has_head};
            continue;
        }
        const ChunkPlacement *cp = &pl->chunk[0];
        const int PL = cp->n_layers;
        int first = (int)((int64_t)PL * c / n_chunks), last = (int)((int64_t)PL * (c + 1) / n_chunks);
        m->chunks[c] = (ChunkSpec){cp->first_layer + first, last - first, c == 0 && cp->embeds_input,
                                   c == n_chunks - 1 && cp->has_head};
    }
    ep_group_init(&m->ep, comm_world_single(), E, m->rc.dev);
    return 0;
}

int model_create(Model *m, const Config *cfg, Device dev, int n_chunks, char *err, size_t err_size) {
    const Placement whole = placement_whole(cfg);
    return model_build(m, cfg, dev, &whole, n_chunks, err, err_size);
}

int model_create_placement(Model *m, const Config *cfg, Device dev, const Placement *p, char *err, size_t err_size) {
    return model_build(m, cfg, dev, p, p->n_chunks, err, err_size);
}

int model_set_ep_group(Model *m, Comm *ep, char *err, size_t err_size) {
    const int E = m->cfg.moe.n_routed_experts;
    if (E % ep->size != 0 || m->placement.n_experts != E / ep->size ||
        m->placement.expert0 != ep->rank * (E / ep->size)) {
        snprintf(err, err_size, "EP group of %d ranks (this one %d) over %d experts: expected this placement's experts "
                 "[%d, %d) to be its share, but it holds [%d, %d)", ep->size, ep->rank, E,
                 ep->rank * (E / (ep->size ? ep->size : 1)), (ep->rank + 1) * (E / (ep->size ? ep->size : 1)),
                 m->placement.expert0, m->placement.expert0 + m->placement.n_experts);
        return -1;
    }
    ep_group_init(&m->ep, ep, E, m->rc.dev);
    // bf16 mode's expert GEMMs round their token rows and output-gradient rows to BF16: they travel so
    ep_group_set_bf16_rows(&m->ep, m->cfg.precision.mode == PRECISION_BF16);
    return 0;
}

void model_weights_changed(Model *m) { m->rc.weights_version++; }

void model_free(Model *m) {
    linear_free_scratch(&m->rc);
    free(m->rc.grad_stacks);
    ep_group_free(&m->ep);
    device_free(m->rc.dev, m->weights);
    device_free(m->rc.dev, m->grads);
    free(m->params);
    free(m->w.blocks);
    free(m->g.blocks);
    free(m->w.mtp);
    free(m->g.mtp);
    device_free(m->rc.dev, m->router_bias);
    free(m->router_bias_names);
    free(m->expert_load);
    free(m->chunks);
    memset(m, 0, sizeof *m);
}

int64_t model_num_params(const Model *m) { return m->n_dense_elems + m->n_expert_elems; }

int64_t model_active_params(const Model *m) {
    // A token passes through every non-expert tensor except the embedding table, and through K of the
    // E routed experts of each MoE layer.
    double active = 0;
    const MoeConfig *e = &m->cfg.moe;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        if (p->role == PARAM_EMBEDDING) continue;
        active += p->is_expert ? (double)p->numel * e->n_activated_experts / e->n_routed_experts : (double)p->numel;
    }
    return (int64_t)llround(active);
}

const ParamInfo *model_find_param(const Model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

int model_find_router_bias(const Model *m, const char *name) {
    for (int l = 0; l < m->n_moe_layers; l++)
        if (strcmp(m->router_bias_names[l], name) == 0) return l;
    return -1;
}

void model_zero_grads(Model *m) {
    device_memset_zero(m->rc.dev, m->grads, (size_t)model_num_params(m) * sizeof(real));
    for (int i = 0; i < m->rc.n_grad_stacks; i++) m->rc.grad_stacks[i].fresh = 0;
}

void model_zero_grads_for_step(Model *m) {
    if (m->rc.n_grad_stacks == 0) {
        model_zero_grads(m);
        return;
    }
    device_memset_zero(m->rc.dev, m->grads, (size_t)m->n_dense_elems * sizeof(real));
    for (int i = 0; i < m->rc.n_grad_stacks; i++) m->rc.grad_stacks[i].fresh = 1;
}

void model_finish_step_grads(Model *m) {
    for (int i = 0; i < m->rc.n_grad_stacks; i++) {
        struct GradStack *st = &m->rc.grad_stacks[i];
        if (st->fresh) device_memset_zero(m->rc.dev, st->grad, (size_t)st->n * sizeof(real));
        st->fresh = 0;
    }
}

void model_zero_load(Model *m) {
    memset(m->expert_load, 0, (size_t)m->n_moe_layers * m->cfg.moe.n_routed_experts * sizeof(int64_t));
}

void model_reduce_load(Model *m, Comm *group) {
    comm_allreduce_sum_i64(group, m->expert_load, (int64_t)m->n_moe_layers * m->cfg.moe.n_routed_experts);
}

double model_update_router_bias(Model *m) {
    int E = m->cfg.moe.n_routed_experts;
    size_t bytes = (size_t)m->n_moe_layers * E * sizeof(real);
    if (m->n_moe_layers == 0) return 0;
    real *bias = malloc(bytes);  // E x layers values: the update runs on the host
    if (!bias) { fprintf(stderr, "fp8moe: out of host memory (router bias update)\n"); exit(1); }
    device_memcpy_to_host(m->rc.dev, bias, m->router_bias, bytes);
    double worst = 0;
    for (int l = 0; l < m->n_moe_layers; l++) {
        const int64_t *counts = m->expert_load + (int64_t)l * E;
        double ratio = max_mean_load(counts, E);
        if (ratio > worst) worst = ratio;
        bias_update(bias + (int64_t)l * E, counts, E, m->cfg.moe.bias_update_speed);
    }
    device_memcpy_from_host(m->rc.dev, m->router_bias, bias, bytes);
    free(bias);
    model_zero_load(m);
    return worst;
}

double model_flops_per_token(const Model *m, int T) {
    const ModelConfig *c = &m->cfg.model;
    double attention = 6.0 * c->n_layers * c->n_heads * (double)T *
                       (c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim) / 2.0;
    return 6.0 * (double)model_active_params(m) + attention;
}

// ---------------------------------------------------------------------------- activations
// One output head's (N, V) buffer. fp32 mode: FP32 logits, then in place their probabilities and their gradient
// (crossentropy_forward / _backward). bf16 and fp8 modes: the BF16 logits (the head GEMM's rounded products), then
// in place their BF16 gradient, with each row's max and sum of exponentials in between (crossentropy_*_bf16): half
// the bytes, and no FP32 copy of the logits to convert, normalise and convert back (about 7 GB of traffic per 8192
// tokens at V = 32768, docs/benchmarks.md).
typedef struct {
    real *logits;              // fp32 mode, else NULL
    uint16_t *logits16;        // bf16 and fp8 modes, else NULL
    real *row_max;             // (N), BF16 form
    double *row_sum;           // (N), BF16 form
    real *losses;              // (N)
} HeadActs;

typedef struct {
    int *tok, *tgt;            // (N) host: input token t_{i+k} and target t_{i+k+1} (-1 = masked)
    int *d_tok, *d_tgt;        // the same on the device
    real *e, *en, *en_rstd;    // embedding of tok, its RMSNorm
    real *hn, *hn_rstd;        // RMSNorm of the previous depth's hidden state
    real *cat;                 // (N, 2D) = [en ; hn]
    real *x0, *x1;             // block input (projection output) and output
    BlockActs block;
    real *ho, *ho_rstd;        // h^k = RMSNorm(x1)
    HeadActs head;
    real *d_h;                 // (N, D) gradient into h^k from depth k+1
    int64_t n_valid;
} MtpActs;

struct ChunkActs {
    ActsArena arena;
    WgradTicket *wgrad;        // the block Linears' weight gradients between chunk_backward_input and _weights
    int chunk;
    Dims d;
    int V;                     // vocabulary size
    int *targets;              // (N) host copy of this micro-batch's targets (loss counts, MTP tokens)
    real *host_losses;         // (N) host copy of a head's per-row losses
    int *d_inputs, *d_targets; // the micro-batch's tokens on the device
    real *resid;               // (n_blocks + 1, N, D) residual stream at block boundaries
    BlockActs *blocks;
    int n_blocks, n_mtp;       // blocks and MTP modules with activations (their EP buffers are freed with them)
    LayerScratch scratch;
    real *d_cur;               // (N, D) gradient of the residual stream
    // last chunk
    real *hn, *hn_rstd;        // h^0 = final RMSNorm of the residual stream
    HeadActs head;
    real *probs_row;                // (V) host: chunk_probs_at's probabilities in the BF16 form
    real *d_hn, *d_tmp, *d_cat;     // (N, D), (N, D), (N, 2D)
    MtpActs *mtp;
    LossTerms terms;
};

static void head_acts_alloc(ActsArena *ar, HeadActs *h, const Model *m, int N, int V) {
    *h = (HeadActs){0};
    if (m->cfg.precision.mode == PRECISION_FP32) {
        h->logits = ARENA_REALS(ar, (int64_t)N * V);
    } else {
        h->logits16 = arena_alloc(ar, (size_t)N * V * sizeof(uint16_t));
        h->row_max = ARENA_REALS(ar, N);
        h->row_sum = arena_alloc(ar, (size_t)N * sizeof(double));
    }
    h->losses = ARENA_REALS(ar, N);
}

ChunkActs *chunk_acts_create(Model *m, int chunk, int B, int T) {
    ChunkActs *a = calloc(1, sizeof *a);
    const ChunkSpec *cs = &m->chunks[chunk];
    const Config *c = &m->cfg;
    a->arena.dev = m->rc.dev;
    a->wgrad = wgrad_ticket_create(m->rc.dev);  // no storage until a first chunk_backward_input
    a->chunk = chunk;
    a->d = dims_from_config(c, B, T);
    a->V = c->model.vocab_size;
    const Dims *d = &a->d;
    ActsArena *ar = &a->arena;
    int64_t N = d->N, D = d->D, V = c->model.vocab_size;
    a->targets = calloc((size_t)N, sizeof(int));
    a->host_losses = calloc((size_t)N, sizeof(real));
    a->d_inputs = ARENA_INTS(ar, N);
    a->d_targets = ARENA_INTS(ar, N);
    a->resid = ARENA_REALS(ar, (cs->n_blocks + 1) * N * D);
    a->blocks = calloc((size_t)cs->n_blocks, sizeof(BlockActs));
    a->n_blocks = cs->n_blocks;
    int has_moe = 0;  // the scratch first: the blocks' forward transients point into it
    for (int i = 0; i < cs->n_blocks; i++) has_moe |= m->w.blocks[cs->first_block + i].is_moe;
    if (cs->has_head)
        for (int k = 0; k < c->mtp.depth; k++) has_moe |= m->w.mtp[k].block.is_moe;
    if (has_moe && (m->placement.n_experts != m->ep.experts_per_rank ||
                    m->placement.expert0 != ep_first_local_expert(&m->ep))) {
        fprintf(stderr, "fp8moe: train/model.c: chunk_acts_create: this placement holds experts [%d, %d) of %d, but "
                        "its EP group (%d ranks, this one %d) gives it [%d, %d); its MoE layers need the group that "
                        "holds the other experts (model_set_ep_group)\n", m->placement.expert0,
                m->placement.expert0 + m->placement.n_experts, c->moe.n_routed_experts, m->ep.ep_size, m->ep.ep_rank,
                ep_first_local_expert(&m->ep), ep_first_local_expert(&m->ep) + m->ep.experts_per_rank);
        chunk_acts_free(a);
        return NULL;
    }
    const int keep = linear_fp8_fused(&m->rc);               // the Linears' Wgrad operands (linear.h KeptInput)
    const int bf16_products = linear_bf16_products(&m->rc);  // MLA's and the FFNs' BF16 products (linear.h)
    const int eout16 = moe_combine_grad_in_operand(m);
    layer_scratch_alloc(ar, &a->scratch, d, has_moe, has_moe && !moe_experts_read_tokens(m), bf16_products,
                        has_moe && !eout16, has_moe && keep && moe_experts_read_tokens(m));
    for (int i = 0; i < cs->n_blocks; i++)
        block_acts_alloc(ar, &a->blocks[i], d, m->w.blocks[cs->first_block + i].is_moe, &a->scratch, keep,
                         bf16_products, eout16);
    a->d_cur = ARENA_REALS(ar, N * D);
    if (cs->has_head) {
        a->hn = ARENA_REALS(ar, N * D);
        a->hn_rstd = ARENA_REALS(ar, N);
        head_acts_alloc(ar, &a->head, m, N, V);
        a->d_hn = ARENA_REALS(ar, N * D);
        a->d_tmp = ARENA_REALS(ar, N * D);
        a->d_cat = ARENA_REALS(ar, 2 * N * D);
        a->mtp = calloc((size_t)c->mtp.depth + 1, sizeof(MtpActs));
        a->n_mtp = c->mtp.depth;
        for (int k = 0; k < c->mtp.depth; k++) {
            MtpActs *t = &a->mtp[k];
            t->tok = calloc((size_t)N, sizeof(int));
            t->tgt = calloc((size_t)N, sizeof(int));
            t->d_tok = ARENA_INTS(ar, N);
            t->d_tgt = ARENA_INTS(ar, N);
            t->e = ARENA_REALS(ar, N * D);
            t->en = ARENA_REALS(ar, N * D);
            t->en_rstd = ARENA_REALS(ar, N);
            t->hn = ARENA_REALS(ar, N * D);
            t->hn_rstd = ARENA_REALS(ar, N);
            t->cat = ARENA_REALS(ar, 2 * N * D);
            t->x0 = ARENA_REALS(ar, N * D);
            t->x1 = ARENA_REALS(ar, N * D);
            block_acts_alloc(ar, &t->block, d, m->w.mtp[k].block.is_moe, &a->scratch, keep, bf16_products, eout16);
            t->ho = ARENA_REALS(ar, N * D);
            t->ho_rstd = ARENA_REALS(ar, N);
            head_acts_alloc(ar, &t->head, m, N, V);
            t->d_h = ARENA_REALS(ar, N * D);
        }
    }
    linear_reserve_scratch(&m->rc, m->params, m->n_params, d->N, (int)d->local_rows);
    return a;
}

void chunk_acts_free(ChunkActs *a) {
    if (!a) return;
    for (int i = 0; a->blocks && i < a->n_blocks; i++) ep_buffers_release(&a->blocks[i].moe.ep_buf);
    for (int k = 0; a->mtp && k < a->n_mtp; k++) ep_buffers_release(&a->mtp[k].block.moe.ep_buf);
    if (a->mtp) {
        for (int k = 0; k < MTP_MAX_DEPTH && (a->mtp[k].tok || a->mtp[k].tgt); k++) {
            free(a->mtp[k].tok);
            free(a->mtp[k].tgt);
        }
    }
    free(a->mtp);
    free(a->blocks);
    free(a->targets);
    free(a->host_losses);
    free(a->probs_row);
    arena_free_all(&a->arena);
    wgrad_ticket_free(a->wgrad);
    free(a);
}

// The output head, logits (N, V) = h (N, D) head^T, shared by the main head and the MTP modules. It
// stays out of FP8 (DESIGN.md section 4); in the bf16 and fp8 modes it is a BF16 GEMM with FP32
// accumulation and BF16-rounded logits, as DeepSeek-V3 keeps it, and in fp32 mode the FP32 reference.
// On an H200 the FP32 head (CUDA cores, no TF32) took 21 ms forward + 46 ms backward per 8192 tokens at
// V = 32768, D = 2048: a quarter of the fp8 step of configs/bench-1gpu.ini.
// Then the mean cross-entropy against targets (d_targets on the device, the same on the host), the per-row
// losses copied into the host buffer host_losses (N); returns the mean over valid rows.
static double head_forward(Model *m, HeadActs *o, const real *h, const int *d_targets, const int *targets, int N,
                           int D, int V, real *host_losses, int64_t *n_valid) {
    Device dev = m->rc.dev;
    profile_begin(PHASE_OTHER_GEMM);
    if (o->logits) matmul_forward(dev, o->logits, h, m->w.head, N, D, V);
    else bf16_matmul_forward_bf16(dev, o->logits16, h, m->w.head, N, D, V);
    profile_end(PHASE_OTHER_GEMM);
    if (o->logits) crossentropy_forward(dev, o->losses, o->logits, o->logits, d_targets, N, V);
    else crossentropy_forward_bf16(dev, o->losses, o->row_max, o->row_sum, o->logits16, d_targets, N, V);
    device_memcpy_to_host(dev, host_losses, o->losses, (size_t)N * sizeof(real));
    double sum = 0;
    int64_t n = 0;
    for (int i = 0; i < N; i++) {
        if (targets[i] < 0) continue;
        sum += host_losses[i];
        n++;
    }
    *n_valid = n;
    return n ? sum / (double)n : 0.0;
}

// The loss's gradient dloss per valid row back through the head: dh (N, D) +=, the head's gradient +=. The
// logits' buffer becomes their gradient.
static void head_backward(Model *m, HeadActs *o, real *dh, const real *h, const int *d_targets, real dloss, int N,
                          int D, int V) {
    Device dev = m->rc.dev;
    if (o->logits) crossentropy_backward(dev, o->logits, o->logits, d_targets, dloss, N, V);
    else crossentropy_backward_bf16(dev, o->logits16, o->logits16, o->row_max, o->row_sum, d_targets, dloss, N, V);
    profile_begin(PHASE_OTHER_GEMM);
    if (o->logits) matmul_backward(dev, dh, m->g.head, o->logits, h, m->w.head, N, D, V);
    else bf16_matmul_backward_bf16(dev, dh, m->g.head, o->logits16, h, m->w.head, N, D, V);
    profile_end(PHASE_OTHER_GEMM);
}

// ---------------------------------------------------------------------------- head and MTP
// MTP depth k (1-based) at position i of a sequence takes token t_{i+k} as input and predicts t_{i+k+1}.
// With targets[i] = t_{i+1}: t_{i+k} = targets[i+k-1] and t_{i+k+1} = targets[i+k], inside the sequence.
// Positions whose input or target falls off the sequence are masked (input token 0, target -1); being the
// last positions, they cannot influence valid ones through causal attention.
void model_mtp_tokens(int *tok, int *tgt, const int *targets, int B, int T, int k) {
    for (int b = 0; b < B; b++) {
        const int *row = targets + (int64_t)b * T;
        for (int i = 0; i < T; i++) {
            int in = i + k - 1 < T ? row[i + k - 1] : -1;
            int out = i + k < T ? row[i + k] : -1;
            tok[b * T + i] = in >= 0 && out >= 0 ? in : 0;
            tgt[b * T + i] = in >= 0 ? out : -1;
        }
    }
}

static double mtp_forward(Model *m, ChunkActs *a, int k) {
    Device dev = m->rc.dev;
    const Dims *d = &a->d;
    int N = d->N, D = d->D, V = m->cfg.model.vocab_size;
    const MtpWeights *w = &m->w.mtp[k];
    MtpActs *t = &a->mtp[k];
    const real *h_prev = k == 0 ? a->hn : a->mtp[k - 1].ho;
    model_mtp_tokens(t->tok, t->tgt, a->targets, d->B, d->T, k + 1);
    device_memcpy_from_host(dev, t->d_tok, t->tok, (size_t)N * sizeof(int));
    device_memcpy_from_host(dev, t->d_tgt, t->tgt, (size_t)N * sizeof(int));
    embedding_forward(dev, t->e, t->d_tok, m->w.embed, N, D);
    rmsnorm_forward(dev, t->en, t->en_rstd, t->e, w->enorm, N, D);
    rmsnorm_forward(dev, t->hn, t->hn_rstd, h_prev, w->hnorm, N, D);
    copy_block(dev, t->cat, 2 * D, t->en, D, N, D, 0);  // embedding first, as in released weights
    copy_block(dev, t->cat + D, 2 * D, t->hn, D, N, D, 0);
    linear_forward(&m->rc, t->x0, t->cat, w->eh_proj, N, 2 * D, D, NULL);
    block_forward(m, &w->block, &t->block, d, t->x0, t->x1);
    rmsnorm_forward(dev, t->ho, t->ho_rstd, t->x1, w->norm, N, D);
    return head_forward(m, &t->head, t->ho, t->d_tgt, t->tgt, N, D, V, a->host_losses, &t->n_valid);
}

// Backward of MTP depth k: the gradient into h^{k-1} is added to d_h_prev.
static void mtp_backward(Model *m, ChunkActs *a, int k, real *d_h_prev, real loss_scale) {
    Device dev = m->rc.dev;
    const Dims *d = &a->d;
    int N = d->N, D = d->D, V = m->cfg.model.vocab_size;
    const MtpWeights *w = &m->w.mtp[k], *g = &m->g.mtp[k];
    MtpActs *t = &a->mtp[k];
    size_t bytes = (size_t)N * D * sizeof(real);
    const real *h_prev = k == 0 ? a->hn : a->mtp[k - 1].ho;
    // d h^k = (from this depth's head) + (from depth k+1, already in t->d_h)
    real dloss = t->n_valid ? loss_scale * m->loss_weights.mtp[k] / (real)t->n_valid : 0;
    head_backward(m, &t->head, t->d_h, t->ho, t->d_tgt, dloss, N, D, V);
    device_memset_zero(dev, a->d_cur, bytes);
    rmsnorm_backward(dev, a->d_cur, g->norm, t->d_h, t->x1, w->norm, t->ho_rstd, N, D);
    block_backward(m, &w->block, &g->block, &t->block, d, &a->scratch, a->d_cur, loss_scale * m->loss_weights.balance);
    linear_backward(&m->rc, a->d_cat, GRAD_WRITE, g->eh_proj, a->d_cur, t->cat, w->eh_proj, N, 2 * D, D, NULL);
    // split d_cat = [d_en ; d_hn] and go back through the two norms
    copy_block(dev, a->d_tmp, D, a->d_cat, 2 * D, N, D, 0);
    device_memset_zero(dev, a->d_cur, bytes);
    rmsnorm_backward(dev, a->d_cur, g->enorm, a->d_tmp, t->e, w->enorm, t->en_rstd, N, D);
    embedding_backward(dev, m->g.embed, a->d_cur, t->d_tok, N, D);
    copy_block(dev, a->d_tmp, D, a->d_cat + D, 2 * D, N, D, 0);
    rmsnorm_backward(dev, d_h_prev, g->hnorm, a->d_tmp, h_prev, w->hnorm, t->hn_rstd, N, D);
}

// ---------------------------------------------------------------------------- chunk forward / backward
static double block_balance(const BlockWeights *w, const BlockActs *a) {
    return w->is_moe ? (double)a->moe.balance_loss : 0.0;
}

real chunk_forward(Model *m, int chunk, ChunkActs *a, const int *inputs, const int *targets,
                   const real *in_hidden, real *out_hidden) {
    Device dev = m->rc.dev;
    const ChunkSpec *cs = &m->chunks[chunk];
    const Dims *d = &a->d;
    int N = d->N, D = d->D, V = m->cfg.model.vocab_size;
    memcpy(a->targets, targets, (size_t)N * sizeof(int));
    device_memcpy_from_host(dev, a->d_inputs, inputs, (size_t)N * sizeof(int));
    device_memcpy_from_host(dev, a->d_targets, targets, (size_t)N * sizeof(int));
    memset(&a->terms, 0, sizeof a->terms);
    if (cs->has_embedding)
        embedding_forward(dev, a->resid, a->d_inputs, m->w.embed, N, D);
    else
        copy_block(dev, a->resid, D, in_hidden, D, N, D, 0);  // a device buffer (model.h)
    double balance = 0;
    for (int i = 0; i < cs->n_blocks; i++) {
        const BlockWeights *w = &m->w.blocks[cs->first_block + i];
        block_forward(m, w, &a->blocks[i], d, a->resid + (int64_t)i * N * D, a->resid + (int64_t)(i + 1) * N * D);
        balance += block_balance(w, &a->blocks[i]);
    }
    real *x_last = a->resid + (int64_t)cs->n_blocks * N * D;
    LossTerms *lt = &a->terms;
    if (!cs->has_head) {
        copy_block(dev, out_hidden, D, x_last, D, N, D, 0);
        lt->balance = balance;
        return (real)(m->loss_weights.balance * balance);
    }
    rmsnorm_forward(dev, a->hn, a->hn_rstd, x_last, m->w.norm, N, D);
    lt->main = head_forward(m, &a->head, a->hn, a->d_targets, targets, N, D, V, a->host_losses, &lt->n_valid);
    double total = m->loss_weights.main * lt->main;
    int depth = m->cfg.mtp.depth;
    for (int k = 0; k < depth; k++) {
        lt->mtp[k] = mtp_forward(m, a, k);
        balance += block_balance(&m->w.mtp[k].block, &a->mtp[k].block);
        lt->mtp_mean += lt->mtp[k] / depth;
        total += m->loss_weights.mtp[k] * lt->mtp[k];
    }
    lt->balance = balance;
    total += m->loss_weights.balance * balance;
    return (real)total;
}

void chunk_backward(Model *m, int chunk, ChunkActs *a, const real *dout_hidden, real *din_hidden,
                    real loss_scale) {
    Device dev = m->rc.dev;
    const ChunkSpec *cs = &m->chunks[chunk];
    const Dims *d = &a->d;
    int N = d->N, D = d->D, V = m->cfg.model.vocab_size;
    size_t bytes = (size_t)N * D * sizeof(real);
    real d_balance = loss_scale * m->loss_weights.balance;
    if (cs->has_head) {
        // MTP depths last to first: depth k+1 feeds the gradient of h^k to depth k
        int depth = m->cfg.mtp.depth;
        device_memset_zero(dev, a->d_hn, bytes);
        for (int k = 0; k < depth; k++) device_memset_zero(dev, a->mtp[k].d_h, bytes);
        for (int k = depth - 1; k >= 0; k--)
            mtp_backward(m, a, k, k == 0 ? a->d_hn : a->mtp[k - 1].d_h, loss_scale);
        real dloss = a->terms.n_valid ? loss_scale * m->loss_weights.main / (real)a->terms.n_valid : 0;
        head_backward(m, &a->head, a->d_hn, a->hn, a->d_targets, dloss, N, D, V);
        device_memset_zero(dev, a->d_cur, bytes);
        rmsnorm_backward(dev, a->d_cur, m->g.norm, a->d_hn, a->resid + (int64_t)cs->n_blocks * N * D, m->w.norm,
                         a->hn_rstd, N, D);
    } else {
        copy_block(dev, a->d_cur, D, dout_hidden, D, N, D, 0);
    }
    for (int i = cs->n_blocks - 1; i >= 0; i--) {
        int l = cs->first_block + i;
        block_backward(m, &m->w.blocks[l], &m->g.blocks[l], &a->blocks[i], d, &a->scratch, a->d_cur, d_balance);
    }
    if (cs->has_embedding)
        embedding_backward(dev, m->g.embed, a->d_cur, a->d_inputs, N, D);
    else
        copy_block(dev, din_hidden, D, a->d_cur, D, N, D, 0);
}

void chunk_backward_input(Model *m, int chunk, ChunkActs *a, const real *dout_hidden, real *din_hidden,
                          real loss_scale) {
    if (wgrad_ticket_pending(a->wgrad)) {
        fprintf(stderr, "fp8moe: train/model.c: internal error: chunk_backward_input on an activation set whose W "
                        "ticket has not run\n");
        exit(1);
    }
    m->rc.wgrad_ticket = a->wgrad;
    chunk_backward(m, chunk, a, dout_hidden, din_hidden, loss_scale);
    m->rc.wgrad_ticket = NULL;
}

void chunk_backward_weights(Model *m, ChunkActs *a) { wgrad_ticket_run(a->wgrad, &m->rc); }

int chunk_weights_pending(const ChunkActs *a) { return wgrad_ticket_pending(a->wgrad) > 0; }

LossTerms chunk_losses(const ChunkActs *a) { return a->terms; }

const real *chunk_probs_at(ChunkActs *a, int b, int t) {
    const HeadActs *o = &a->head;
    const int64_t row = (int64_t)b * a->d.T + t;
    if (o->logits) return o->logits + row * a->V;
    if (!o->logits16) return NULL;
    if (a->arena.dev != DEVICE_CPU) {  // the row is made on the host from the statistics
        fprintf(stderr, "fp8moe: train/model.c: chunk_probs_at: the BF16 head's probabilities are made on the CPU "
                        "device only (sampling runs there)\n");
        exit(1);
    }
    if (!a->probs_row && !(a->probs_row = malloc((size_t)a->V * sizeof(real)))) {
        fprintf(stderr, "fp8moe: train/model.c: chunk_probs_at: out of host memory for a row of %d probabilities\n",
                a->V);
        exit(1);
    }
    crossentropy_probs_bf16(DEVICE_CPU, a->probs_row, o->logits16 + row * a->V, o->row_max + row, o->row_sum + row, 1,
                            a->V);
    return a->probs_row;
}
