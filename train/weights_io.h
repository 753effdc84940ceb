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

// Writes m's weights, router biases and config to `path` atomically and durably: the file is
// written as `path.tmp.<pid>`, fsync'ed, renamed over `path` only when complete, and the directory
// is fsync'ed after the rename. Returns 0 or -1 (err set). When a write fails (a full disk, an I/O
// error) the message says so with the system's reason ("No space left on device"), the temporary
// file is removed, `path` is untouched, and every HDF5 id is closed, so the process can go on or
// exit normally. One save at a time per process (the temporary name is kept for
// weights_remove_partial).
int weights_save(const Model *m, const char *path, char *err, size_t err_size);

// Removes the temporary file (`path.tmp.<pid>`) of a weights_save in progress in this process, for
// a save that will not be finished: call it from a SIGINT/SIGTERM handler just before _exit, so an
// interrupted save leaves nothing behind. Async-signal-safe (one unlink(2) of a name stored before
// the save began; errno is preserved). Returns 1 when it removed the file, 0 when no save is in
// progress (or its file is already gone), -1 when unlink failed. If the handler returns instead of
// exiting, the save goes on writing to the removed file and then fails with a message saying so.
int weights_remove_partial(void);

// Reads the "config" attribute of `path` into cfg (config_defaults, then the stored INI text).
// The "format" attribute must be WEIGHTS_FORMAT (the message names the file, the attribute, what
// was found and what was expected).
int weights_read_config(const char *path, Config *cfg, char *err, size_t err_size);

// Loads every tensor and router bias of `path` into m, which must have been built from the same
// model shape (normally from weights_read_config). The "format" attribute must be WEIGHTS_FORMAT,
// every dataset m expects must exist with the expected shape and hold only finite values (a NaN or
// infinity is refused, naming the dataset and the element), and the file must hold no dataset m
// does not expect. Returns 0 or -1 (err set).
int weights_load(Model *m, const char *path, char *err, size_t err_size);

// The dataset name of the router bias of MoE layer `moe_index` (0 .. m->n_moe_layers-1): the global name the
// model gives it (Model.router_bias_names: its gate weight's name with ".bias" for ".weight"). Returns 0, or
// -1 if the index is bad.
int weights_router_bias_name(const Model *m, int moe_index, char *buf, size_t size);

#endif
