/*
 * hf_export.c - a trained fp8moe model as a Hugging Face DeepSeek-V3 checkpoint (see hf_export.h): the name
 * mapping, config.json, the tensors into model.safetensors (train/safetensors.c), and `fp8moe export`.
 *
 * Names follow transformers' DeepseekV3ForCausalLM (and DeepSeek's released checkpoints, which use the same
 * names): fp8moe's reference-code names (DESIGN.md section 3) map one to one, and nothing is reshaped. Linear
 * weights are (out, in) in both; MLA's q_b_proj rows are per head [nope ; rope], kv_a_proj_with_mqa's [c_KV ; k_R],
 * kv_b_proj's per head [k_nope ; v], in both; SwiGLU's w1, w3, w2 are gate_proj, up_proj, down_proj.
 */
#include "train/cli.h"
#include "train/hf_export.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/durable.h"
#include "train/model_source.h"

const char *const export_usage =
    "  fp8moe export CKPT --format hf --out DIR [--dtype bf16|fp32]\n"
    "      Write the model of CKPT (a checkpoint DIR/step_NNNNNNNN, DIR/latest or DIR, of any parallel layout;\n"
    "      or a weights.h5) as a Hugging Face DeepSeek-V3 checkpoint: DIR/config.json and DIR/model.safetensors,\n"
    "      loadable with transformers' AutoModelForCausalLM.from_pretrained(DIR). Tensors are BF16 (default) or\n"
    "      FP32 (--dtype fp32); router biases are FP32 either way (docs/checkpoints.md).\n";

// ---------------------------------------------------------------------------- names

// One block's tensors: fp8moe suffix -> Hugging Face suffix (after "layers.N." / "model.layers.N.").
static const char *const BLOCK_NAMES[][2] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attn.q_norm.weight", "self_attn.q_a_layernorm.weight"},
    {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attn.wq.weight", "self_attn.q_proj.weight"},
    {"attn.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    {"attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
    {"attn.wkv_b.weight", "self_attn.kv_b_proj.weight"},
    {"attn.wo.weight", "self_attn.o_proj.weight"},
    {"ffn.gate.weight", "mlp.gate.weight"},
    {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
};
static const char *const FFN_NAMES[3] = {"gate_proj", "down_proj", "up_proj"};  // w1, w2, w3

// "wN.weight" -> the SwiGLU projection's name, or NULL.
static const char *ffn_name(const char *s) {
    if (s[0] != 'w' || s[1] < '1' || s[1] > '3' || strcmp(s + 2, ".weight") != 0) return NULL;
    return FFN_NAMES[s[1] - '1'];
}

// Parses "<digits>." at *s into *n and moves *s past it. Returns 0 or -1.
static int take_index(const char **s, int *n) {
    char *end;
    errno = 0;
    long v = strtol(*s, &end, 10);
    if (errno || end == *s || *end != '.' || v < 0 || v > 1000000) return -1;
    *n = (int)v;
    *s = end + 1;
    return 0;
}

// A block tensor's suffix (fp8moe) -> Hugging Face suffix, after prefix (written into out).
static int block_name(const char *s, const char *prefix, char *out, size_t size) {
    for (size_t i = 0; i < sizeof BLOCK_NAMES / sizeof BLOCK_NAMES[0]; i++)
        if (!strcmp(s, BLOCK_NAMES[i][0])) return snprintf(out, size, "%s%s", prefix, BLOCK_NAMES[i][1]) < (int)size ? 0 : -1;
    const char *f;
    if (!strncmp(s, "ffn.shared_experts.", 19) && (f = ffn_name(s + 19)))
        return snprintf(out, size, "%smlp.shared_experts.%s.weight", prefix, f) < (int)size ? 0 : -1;
    int e;
    const char *rest = s + 12;
    if (!strncmp(s, "ffn.experts.", 12) && take_index(&rest, &e) == 0 && (f = ffn_name(rest)))
        return snprintf(out, size, "%smlp.experts.%d.%s.weight", prefix, e, f) < (int)size ? 0 : -1;
    if (!strncmp(s, "ffn.", 4) && (f = ffn_name(s + 4)))
        return snprintf(out, size, "%smlp.%s.weight", prefix, f) < (int)size ? 0 : -1;
    return -1;
}

int hf_name(const char *name, int n_layers, char *out, size_t size) {
    if (!strcmp(name, "embed.weight")) return snprintf(out, size, "model.embed_tokens.weight") < (int)size ? 0 : -1;
    if (!strcmp(name, "norm.weight")) return snprintf(out, size, "model.norm.weight") < (int)size ? 0 : -1;
    if (!strcmp(name, "head.weight")) return snprintf(out, size, "lm_head.weight") < (int)size ? 0 : -1;
    char prefix[64];
    const char *s;
    int l;
    if (!strncmp(name, "layers.", 7) && (s = name + 7, take_index(&s, &l) == 0)) {
        snprintf(prefix, sizeof prefix, "model.layers.%d.", l);
        return block_name(s, prefix, out, size);
    }
    if (!strncmp(name, "mtp.", 4) && (s = name + 4, take_index(&s, &l) == 0)) {
        snprintf(prefix, sizeof prefix, "model.layers.%d.", n_layers + l);  // DeepSeek's layer 61 of 61 layers
        if (!strncmp(s, "block.", 6)) return block_name(s + 6, prefix, out, size);
        static const char *const own[][2] = {{"enorm.weight", "enorm.weight"},
                                             {"hnorm.weight", "hnorm.weight"},
                                             {"eh_proj.weight", "eh_proj.weight"},
                                             {"norm.weight", "shared_head.norm.weight"}};
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
            if (!strcmp(s, own[i][0])) return snprintf(out, size, "%s%s", prefix, own[i][1]) < (int)size ? 0 : -1;
    }
    return -1;
}

// ---------------------------------------------------------------------------- config.json

// A JSON number that reads back as x and, being a float field, has a point or an exponent ("1.0", "1e-06").
static void json_double(FILE *f, double x) {
    char buf[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    fputs(buf, f);
    if (!strpbrk(buf, ".eEn")) fputs(".0", f);
}

// The fields of transformers' DeepseekV3Config (and of DeepSeek's own config.json, whose remote code reads
// scoring_func, topk_method, moe_layer_freq, aux_loss_alpha, seq_aux) that fp8moe's config fixes. The routing is
// sigmoid scores, an FP32 selection bias outside the weights' update (noaux_tc: "no auxiliary loss, top-k with
// correction"), group-limited top-k over the top-2 sum of each group, then the chosen unbiased scores normalised
// and scaled: norm_topk_prob true, routed_scaling_factor = moe.route_scale.
static void write_config_json(FILE *f, const Config *c, StDtype dtype) {
    const ModelConfig *mc = &c->model;
    const MoeConfig *e = &c->moe;
    // fp8moe limits groups only when n_limited_groups < n_expert_groups; transformers always takes each group's top 2,
    // which needs 2 experts per group: without a limit one group of every expert is the same routing
    const int limited = e->n_limited_groups < e->n_expert_groups;
    fprintf(f, "{\n");
    fprintf(f, "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n");
    fprintf(f, "  \"model_type\": \"deepseek_v3\",\n");
    fprintf(f, "  \"vocab_size\": %d,\n", mc->vocab_size);
    fprintf(f, "  \"hidden_size\": %d,\n", mc->dim);
    fprintf(f, "  \"intermediate_size\": %d,\n", mc->inter_dim);
    fprintf(f, "  \"moe_intermediate_size\": %d,\n", e->moe_inter_dim);
    fprintf(f, "  \"num_hidden_layers\": %d,\n", mc->n_layers);
    fprintf(f, "  \"first_k_dense_replace\": %d,\n", mc->n_dense_layers);
    fprintf(f, "  \"moe_layer_freq\": 1,\n");
    fprintf(f, "  \"num_attention_heads\": %d,\n", mc->n_heads);
    fprintf(f, "  \"num_key_value_heads\": %d,\n", mc->n_heads);
    fprintf(f, "  \"n_routed_experts\": %d,\n", e->n_routed_experts);
    fprintf(f, "  \"n_shared_experts\": %d,\n", e->n_shared_experts);
    fprintf(f, "  \"num_experts_per_tok\": %d,\n", e->n_activated_experts);
    fprintf(f, "  \"n_group\": %d,\n", limited ? e->n_expert_groups : 1);
    fprintf(f, "  \"topk_group\": %d,\n", limited ? e->n_limited_groups : 1);
    fprintf(f, "  \"routed_scaling_factor\": ");
    json_double(f, e->route_scale);
    fprintf(f, ",\n  \"norm_topk_prob\": true,\n");
    fprintf(f, "  \"scoring_func\": \"sigmoid\",\n");
    fprintf(f, "  \"topk_method\": \"noaux_tc\",\n");
    fprintf(f, "  \"aux_loss_alpha\": ");
    json_double(f, e->balance_loss_alpha);
    fprintf(f, ",\n  \"seq_aux\": true,\n");
    fprintf(f, "  \"ep_size\": 1,\n");
    if (mc->q_lora_rank > 0) fprintf(f, "  \"q_lora_rank\": %d,\n", mc->q_lora_rank);
    else fprintf(f, "  \"q_lora_rank\": null,\n");
    fprintf(f, "  \"kv_lora_rank\": %d,\n", mc->kv_lora_rank);
    fprintf(f, "  \"qk_nope_head_dim\": %d,\n", mc->qk_nope_head_dim);
    fprintf(f, "  \"qk_rope_head_dim\": %d,\n", mc->qk_rope_head_dim);
    fprintf(f, "  \"v_head_dim\": %d,\n", mc->v_head_dim);
    fprintf(f, "  \"hidden_act\": \"silu\",\n");
    fprintf(f, "  \"max_position_embeddings\": %d,\n", c->train.seq_len);
    fprintf(f, "  \"rms_norm_eps\": ");
    json_double(f, RMSNORM_EPS);
    fprintf(f, ",\n  \"rope_theta\": ");
    json_double(f, mc->rope_theta);
    fprintf(f, ",\n  \"rope_scaling\": null,\n");
    fprintf(f, "  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": ");
    json_double(f, mc->rope_theta);
    fprintf(f, "},\n  \"rope_interleave\": true,\n");
    fprintf(f, "  \"attention_bias\": false,\n");
    fprintf(f, "  \"attention_dropout\": 0.0,\n");
    fprintf(f, "  \"initializer_range\": ");
    json_double(f, mc->init_std);
    fprintf(f, ",\n  \"num_nextn_predict_layers\": %d,\n", c->mtp.depth);
    fprintf(f, "  \"tie_word_embeddings\": false,\n");
    fprintf(f, "  \"use_cache\": true,\n");
    // byte-level tokens: no special token (DeepseekV3Config's defaults 0 and 1 would make bytes 0 and 1 special)
    fprintf(f, "  \"bos_token_id\": null,\n");
    fprintf(f, "  \"eos_token_id\": null,\n");
    fprintf(f, "  \"pad_token_id\": null,\n");
    fprintf(f, "  \"torch_dtype\": \"%s\",\n", dtype == ST_BF16 ? "bfloat16" : "float32");
    fprintf(f, "  \"dtype\": \"%s\"\n", dtype == ST_BF16 ? "bfloat16" : "float32");
    fprintf(f, "}\n");
}

// out_dir/config.json, written the durable way (data/durable.h).
static int save_config_json(const Config *c, StDtype dtype, const char *path, char *err, size_t err_size) {
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    write_config_json(d.f, c, dtype);
    return durable_commit(&d, err, err_size);
}

// ---------------------------------------------------------------------------- the tensors

typedef struct {
    char name[HF_NAME_MAX];
    const real *src;  // on m's device
    int64_t numel;
    int ndim;
    int64_t shape[3];
    StDtype dtype;
} ExportItem;

static int add_item(ExportItem *items, int *n, const char *name, const real *src, int ndim, const int *shape,
                    StDtype dtype) {
    ExportItem *it = &items[(*n)++];
    if (snprintf(it->name, sizeof it->name, "%s", name) >= (int)sizeof it->name) return -1;
    it->src = src;
    it->ndim = ndim;
    it->numel = 1;
    for (int d = 0; d < ndim; d++) it->shape[d] = shape[d], it->numel *= shape[d];
    it->dtype = dtype;
    return 0;
}

// Every tensor of the export in file order: the parameter table's order, each router bias after its gate, and
// each MTP module's copies of the head and the embedding after its other tensors.
static ExportItem *export_items(const Model *m, StDtype dtype, int *n_items, char *err, size_t err_size) {
    const int L = m->cfg.model.n_layers, E = m->cfg.moe.n_routed_experts, depth = m->cfg.mtp.depth;
    ExportItem *items = calloc((size_t)(m->n_params + m->n_moe_layers + 2 * depth + 1), sizeof *items);
    const ParamInfo *embed = model_find_param(m, "embed.weight"), *head = model_find_param(m, "head.weight");
    int n = 0;
    if (!items) {
        snprintf(err, err_size, "out of memory for the table of %d tensors", m->n_params);
        return NULL;
    }
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i];
        char hf[HF_NAME_MAX];
        if (hf_name(p->name, L, hf, sizeof hf) != 0 ||
            add_item(items, &n, hf, m->weights + p->offset, p->ndim, p->shape, dtype) != 0) {
            snprintf(err, err_size, "tensor %s: no Hugging Face name for it (train/hf_export.c knows every tensor of "
                     "the model's table; a new one needs a name there)", p->name);
            free(items);
            return NULL;
        }
        if (p->role == PARAM_ROUTER) {  // "....ffn.gate.weight" -> its bias "....ffn.gate.bias", kept in FP32
            char bias[MODEL_NAME_MAX];
            snprintf(bias, sizeof bias, "%.*s.bias", (int)(strlen(p->name) - strlen(".weight")), p->name);
            const int l = model_find_router_bias(m, bias);
            if (l < 0 || hf_name(bias, L, hf, sizeof hf) != 0 ||
                add_item(items, &n, hf, m->router_bias + (int64_t)l * E, 1, &E, ST_F32) != 0) {
                snprintf(err, err_size, "router bias %s of gate %s: not in the model, or no Hugging Face name", bias,
                         p->name);
                free(items);
                return NULL;
            }
        }
    }
    for (int k = 0; k < depth; k++) {  // DeepSeek's MTP layer carries its own copies of the shared head and embedding
        char hf[HF_NAME_MAX];
        if (!embed || !head) {
            snprintf(err, err_size, "the model has MTP modules but no %s", embed ? "head.weight" : "embed.weight");
            free(items);
            return NULL;
        }
        snprintf(hf, sizeof hf, "model.layers.%d.shared_head.head.weight", L + k);
        add_item(items, &n, hf, m->weights + head->offset, head->ndim, head->shape, dtype);
        snprintf(hf, sizeof hf, "model.layers.%d.embed_tokens.weight", L + k);
        add_item(items, &n, hf, m->weights + embed->offset, embed->ndim, embed->shape, dtype);
    }
    *n_items = n;
    return items;
}

int hf_export(const Model *m, const char *out_dir, StDtype dtype, const char *source, int *n_tensors, long long *bytes,
              char *err, size_t err_size) {
    if (m->placement.n_chunks != 1 || !m->placement.has_embedding || !m->placement.has_head ||
        m->placement.n_experts != m->cfg.moe.n_routed_experts) {
        snprintf(err, err_size, "internal error: the export needs the whole model in one process");
        return -1;
    }
    char derr[1024], path[ST_PATH_MAX];
    if (durable_make_dirs(out_dir, derr, sizeof derr) != 0) {
        snprintf(err, err_size, "--out %s: %s", out_dir, derr);
        return -1;
    }
    int n = 0, rc = -1;
    ExportItem *items = export_items(m, dtype, &n, err, err_size);
    if (!items) return -1;
    StWriter w;
    st_init(&w);
    int64_t max_numel = 1;
    for (int i = 0; i < n; i++) max_numel = items[i].numel > max_numel ? items[i].numel : max_numel;
    real *host = malloc((size_t)max_numel * sizeof *host);
    float *f32 = malloc((size_t)max_numel * sizeof *f32);
    if (!host || !f32) {
        snprintf(err, err_size, "out of memory for a tensor of %lld elements", (long long)max_numel);
        goto done;
    }
    if (st_metadata(&w, "format", "pt", err, err_size) != 0 ||
        st_metadata(&w, "producer", "fp8moe export", err, err_size) != 0 ||
        st_metadata(&w, "source", source, err, err_size) != 0)
        goto done;
    for (int i = 0; i < n; i++)
        if (st_add(&w, items[i].name, items[i].dtype, items[i].ndim, items[i].shape, err, err_size) != 0) goto done;
    snprintf(path, sizeof path, "%s/model.safetensors", out_dir);
    if (st_begin(&w, path, err, err_size) != 0) goto done;
    for (int i = 0; i < n; i++) {
        const ExportItem *it = &items[i];
        device_memcpy_to_host(m->rc.dev, host, it->src, (size_t)it->numel * sizeof *host);
        for (int64_t j = 0; j < it->numel; j++) f32[j] = (float)host[j];
        if (st_write(&w, f32, it->numel, err, err_size) != 0) goto done;
    }
    if (st_finish(&w, err, err_size) != 0) goto done;
    snprintf(path, sizeof path, "%s/config.json", out_dir);
    if (save_config_json(&m->cfg, dtype, path, err, err_size) != 0) goto done;
    if (n_tensors) *n_tensors = n;
    if (bytes) *bytes = n ? (long long)w.t[n - 1].end : 0;
    rc = 0;
done:
    st_free(&w);
    free(host);
    free(f32);
    free(items);
    return rc;
}

// ---------------------------------------------------------------------------- fp8moe export

int export_main(int argc, char **argv) {
    const char *ckpt = NULL, *format = NULL, *out = NULL, *dtype_arg = "bf16";
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", export_usage);
            return 0;
        }
        const int takes_value = !strcmp(a, "--format") || !strcmp(a, "--out") || !strcmp(a, "--dtype");
        if (takes_value && i + 1 >= argc) return cli_usage_error("export", export_usage, "%s needs a value", a);
        if (!strcmp(a, "--format")) format = argv[++i];
        else if (!strcmp(a, "--out")) out = argv[++i];
        else if (!strcmp(a, "--dtype")) dtype_arg = argv[++i];
        else if (a[0] == '-' && a[1] != '\0') return cli_usage_error("export", export_usage, "unknown option %s", a);
        else if (ckpt) return cli_usage_error("export", export_usage, "one checkpoint expected; got a second one: %s", a);
        else ckpt = a;
    }
    if (!ckpt) return cli_usage_error("export", export_usage, "missing the checkpoint (CKPT: a checkpoint directory or a weights.h5)%s", "");
    if (!format) return cli_usage_error("export", export_usage, "missing --format (hf is the one format)%s", "");
    if (strcmp(format, "hf") != 0) return cli_usage_error("export", export_usage, "--format %s: expected hf (a Hugging Face DeepSeek-V3 checkpoint)", format);
    if (!out || !out[0]) return cli_usage_error("export", export_usage, "missing --out DIR%s", "");
    StDtype dtype;
    if (!strcmp(dtype_arg, "bf16")) dtype = ST_BF16;
    else if (!strcmp(dtype_arg, "fp32")) dtype = ST_F32;
    else return cli_usage_error("export", export_usage, "--dtype %s: expected bf16 or fp32", dtype_arg);

    char err[2048], what[CONFIG_PATH_MAX + 128];
    ModelSource *src = malloc(sizeof *src);
    Config *cfg = malloc(sizeof *cfg);
    Model m;
    int rc = 1;
    if (!src || !cfg) {
        fprintf(stderr, "fp8moe export: out of memory\n");
        goto done;
    }
    if (model_source_config(ckpt, NULL, 0, src, cfg, err, sizeof err) != 0 ||
        model_source_load(src, cfg, DEVICE_CPU, &m, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe export: %s\n", err);
        goto done;
    }
    model_source_describe(src, what, sizeof what);
    int n_tensors = 0;
    long long bytes = 0;
    if (hf_export(&m, out, dtype, what, &n_tensors, &bytes, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe export: %s\n", err);
    } else {
        printf("exported %s to %s: config.json, model.safetensors (%d tensors, %s, %lld bytes of data)\n", what, out,
               n_tensors, dtype == ST_BF16 ? "bf16 with fp32 router biases" : "fp32", bytes);
        rc = 0;
    }
    model_free(&m);
done:
    free(src);
    free(cfg);
    return rc;
}
