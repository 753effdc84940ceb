/*
 * model_source.c - a checkpoint or a weights file into a one-process Model (see model_source.h).
 */
#include "train/model_source.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "train/checkpoint.h"
#include "train/h5io.h"
#include "train/weights_io.h"

int model_source_config(const char *path, const char *const *overrides, int n_overrides, ModelSource *src,
                        Config *cfg, char *err, size_t err_size) {
    memset(src, 0, sizeof *src);
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, err_size, "%s: %s (expected a checkpoint: DIR/step_NNNNNNNN, DIR/latest or DIR; or a weights "
                 "file written by fp8moe train)", path, strerror(errno));
        return -1;
    }
    if (S_ISREG(st.st_mode)) {
        src->is_checkpoint = 0;
        src->step = -1;
        snprintf(src->path, sizeof src->path, "%s", path);
        if (weights_read_config(path, &src->stored, err, err_size) != 0) return -1;
    } else {
        CheckpointInfo *info = malloc(sizeof *info);
        if (!info) {
            snprintf(err, err_size, "%s: out of memory", path);
            return -1;
        }
        const int rc = checkpoint_read_info(path, info, err, err_size);
        if (rc == 0) {
            src->is_checkpoint = 1;
            src->step = info->step;
            snprintf(src->path, sizeof src->path, "%s", info->dir);
            src->stored = info->cfg;
        }
        free(info);
        if (rc != 0) return -1;
    }
    // the stored INI text again, with the overrides: every key checked as `fp8moe train --set` checks it
    char *text = h5io_config_text(&src->stored);
    if (!text) {
        snprintf(err, err_size, "%s: out of memory for its config", src->path);
        return -1;
    }
    const int rc = config_load_string(cfg, src->path, text, overrides, n_overrides, err, err_size);
    free(text);
    if (rc != 0) return -1;
    char changes[1024];
    if (checkpoint_config_changes(&src->stored, cfg, 1, changes, sizeof changes) > 0) {
        snprintf(err, err_size, "--set changes the model that %s holds the weights of: %s (the keys of [model], [moe] "
                 "and [mtp] stay as trained, except the training-only ones)", src->path, changes);
        return -1;
    }
    cfg->parallel.pp = cfg->parallel.dp = cfg->parallel.ep = 1;
    cfg->parallel.zero1 = 0;
    return 0;
}

int model_source_load(const ModelSource *src, const Config *cfg, Device dev, Model *m, char *err, size_t err_size) {
    char merr[1024];
    if (model_create(m, cfg, dev, 1, merr, sizeof merr) != 0) {
        snprintf(err, err_size, "%s: cannot build the model of its config: %s", src->path, merr);
        return -1;
    }
    const int rc = src->is_checkpoint ? checkpoint_load_model(m, src->path, NULL, err, err_size)
                                      : weights_load(m, src->path, err, err_size);
    if (rc != 0) {
        model_free(m);
        return -1;
    }
    m->count_load = 0;  // nothing here trains: the balancer's counts stay untouched
    return 0;
}

void model_source_describe(const ModelSource *src, char *buf, size_t size) {
    if (src->is_checkpoint) snprintf(buf, size, "checkpoint %s (step %d)", src->path, src->step);
    else snprintf(buf, size, "weights file %s", src->path);
}
