/*
 * model_source.h - a trained model in one process, from whatever fp8moe wrote: a resumable checkpoint (any parallel
 * layout it was written under) or a weights file. Shared by `fp8moe export` and `fp8moe eval`.
 *
 * The path may be a checkpoint DIR/step_NNNNNNNN, DIR/latest, a checkpoint directory DIR (its latest is taken), or
 * a weights file (weights.h5, train/weights_io.h). The model is rebuilt from the config stored with the weights
 * (the checkpoint's manifest, or the weights file's "config" attribute), after `overrides` ("section.key=value",
 * applied in order as --set does), as the whole model in one process: parallel.pp, dp and ep are set to 1 and
 * ZeRO-1 off, whatever the run used. checkpoint.c reassembles the tensors from every rank file
 * (checkpoint_load_model), so experts and stages spread over ranks come back whole.
 *
 * An override may change how the model runs (precision.mode, train.device, train.micro_batch_size, ...), but not
 * the model: keys of [model], [moe] and [mtp] that the weights depend on are refused with the keys named, as
 * checkpoint_load refuses a checkpoint of another model.
 */
#ifndef FP8MOE_MODEL_SOURCE_H
#define FP8MOE_MODEL_SOURCE_H

#include <stddef.h>

#include "train/config.h"
#include "train/model.h"

typedef struct {
    int is_checkpoint;   // 1: a checkpoint directory; 0: a weights file
    char path[CONFIG_PATH_MAX + 64];  // the checkpoint's step directory (DIR/latest resolved), or the file
    int step;            // the checkpoint's step; -1 for a weights file (it records none)
    Config stored;       // the config stored with the weights, before the overrides
} ModelSource;

// Reads the stored config of `path` and applies the overrides into *cfg (then the one-process layout). Prints
// nothing. Returns 0, or -1 with err naming the path (missing, neither a checkpoint nor a weights file, a config
// that does not parse) or the override (a bad key or value, or a model key).
int model_source_config(const char *path, const char *const *overrides, int n_overrides, ModelSource *src,
                        Config *cfg, char *err, size_t err_size);

// Builds the whole model of cfg (from model_source_config) on dev and loads its weights and router biases from
// src. Returns 0, or -1 with err (the model is then freed).
int model_source_load(const ModelSource *src, const Config *cfg, Device dev, Model *m, char *err, size_t err_size);

// "checkpoint runs/x/step_00000020 (step 20)" or "weights file runs/x/weights.h5", for messages.
void model_source_describe(const ModelSource *src, char *buf, size_t size);

#endif
