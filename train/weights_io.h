/*
 * weights_io.h - the FP32 weights file (HDF5) that `fp8moe train` writes and `fp8moe sample` reads.
 *
 * This is the final-weights export, not the resumable checkpoint of DESIGN.md section 7 (that one
 * also holds optimizer moments, loader cursor and RNG state, one file per rank). Layout, flat at the
 * root group so any HDF5 tool can list it:
 *   /<param name>             one FP32 dataset per tensor of m->params ("layers.3.attn.wq_a.weight"),
 *                             with the tensor's shape (e.g. (n_heads*(qk_nope+qk_rope), q_lora_rank))
 *   /<gate name>.bias         one FP32 dataset (E) per MoE layer: the router's selection bias, named
 *                             after that layer's gate weight ("layers.3.ffn.gate.bias",
 *                             "mtp.0.block.ffn.gate.bias")
 *   attribute "config"        the resolved job as INI text (config_print), so the model can be
 *                             rebuilt from this file alone
 *   attribute "format"        "fp8moe-weights-1"
 * Values are FP32 whatever `real` is (the double build converts on write and read).
 *
 * Every function checks every HDF5 return code, prints nothing and returns -1 with one line in err
 * that names the file and, where one is involved, the dataset, what was found and what was expected.
 * Router biases and expert loads are host memory; parameter tensors live on m->dev.
 */
#ifndef FP8MOE_WEIGHTS_IO_H
#define FP8MOE_WEIGHTS_IO_H

#include <stddef.h>

#include "train/config.h"
#include "train/model.h"

#define WEIGHTS_FORMAT "fp8moe-weights-1"

// Writes m's weights, router biases and config to `path` atomically: the file is written as
// `path.tmp.<pid>` and renamed over `path` only when complete. Returns 0 or -1 (err set).
int weights_save(const Model *m, const char *path, char *err, size_t err_size);

// Reads the "config" attribute of `path` into cfg (config_defaults, then the stored INI text).
int weights_read_config(const char *path, Config *cfg, char *err, size_t err_size);

// Loads every tensor and router bias of `path` into m, which must have been built from the same
// model shape (normally from weights_read_config). Every dataset m expects must exist with the
// expected shape, and the file must hold no dataset m does not expect. Returns 0 or -1 (err set).
int weights_load(Model *m, const char *path, char *err, size_t err_size);

// The dataset name of the router bias of MoE layer `moe_index` (0 .. m->n_moe_layers-1): the name of
// that layer's gate weight with ".weight" replaced by ".bias". Returns 0, or -1 if the index is bad.
int weights_router_bias_name(const Model *m, int moe_index, char *buf, size_t size);

#endif
