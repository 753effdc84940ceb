/*
 * hf_export.h - `fp8moe export CKPT --format hf --out DIR`: a trained model as a Hugging Face DeepSeek-V3
 * checkpoint, written by fp8moe itself (no Python): DIR/config.json and DIR/model.safetensors.
 *
 * config.json has model_type "deepseek_v3", architectures ["DeepseekV3ForCausalLM"] and every field of
 * transformers' DeepseekV3Config that fp8moe's config determines (docs/checkpoints.md has the table and where the
 * two differ). model.safetensors holds every tensor under its Hugging Face name, BF16 by default (--dtype fp32 for
 * FP32), the router biases (mlp.gate.e_score_correction_bias) always in FP32 as DeepSeek's released weights keep
 * them; the MTP modules as DeepSeek lays them out, module k as layer num_hidden_layers + k with its enorm, hnorm,
 * eh_proj, shared_head.norm, its own copies of the output head (shared_head.head) and the embedding (embed_tokens),
 * and its block under the usual block names. fp8moe's RoPE rotates interleaved pairs, which is DeepSeek's layout:
 * config.json says rope_interleave = true and the q/k rows are written as they are, unpermuted.
 *
 * Both files are written under temporary names, fsync'd and renamed into place (model.safetensors first,
 * config.json last), so DIR never holds a half file under either name.
 */
#ifndef FP8MOE_HF_EXPORT_H
#define FP8MOE_HF_EXPORT_H

#include <stddef.h>

#include "train/model.h"
#include "train/safetensors.h"

#define HF_NAME_MAX 160

// The Hugging Face name of fp8moe tensor `name` (a name of Model.params, or a router bias name) in a model of
// n_layers main layers: "layers.3.attn.wq_a.weight" -> "model.layers.3.self_attn.q_a_proj.weight",
// "mtp.0.norm.weight" -> "model.layers.<n_layers>.shared_head.norm.weight". Returns 0, or -1 for a name it does not
// know (a tensor fp8moe added without teaching the export).
int hf_name(const char *name, int n_layers, char *out, size_t size);

// Writes out_dir/config.json and out_dir/model.safetensors of m (whole, one process: placement_whole), creating
// out_dir and its parents when missing. dtype: ST_BF16 or ST_F32 for every tensor but the router biases (F32).
// source: a description for the safetensors metadata ("checkpoint runs/x/step_00000020 (step 20)"). On success
// *n_tensors and *bytes (may be NULL) say what model.safetensors holds. Returns 0, or -1 with err naming the file.
int hf_export(const Model *m, const char *out_dir, StDtype dtype, const char *source, int *n_tensors, long long *bytes,
              char *err, size_t err_size);

// The command line (train/main.c dispatches `fp8moe export` here). Exit status as main.c's: 0, 1 a failure while
// running, 2 bad usage.
extern const char *const export_usage;
int export_main(int argc, char **argv);

#endif
