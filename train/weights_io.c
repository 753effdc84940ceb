/*
 * weights_io.c - FP32 weights file in HDF5 (layout in weights_io.h).
 *
 * HDF5's own error printing is switched off while these functions run (and restored after), so the
 * user sees one message that names the file and dataset instead of a library stack dump. Every call
 * is checked; cleanup closes every handle that was opened, in reverse order.
 */
#include "train/weights_io.h"

#include <errno.h>
#include <hdf5.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// ---------------------------------------------------------------------------- helpers

// Silences HDF5's automatic error stack printing for the lifetime of one public call.
typedef struct {
    H5E_auto2_t func;
    void *data;
} H5ErrorPrinting;

static void h5_quiet(H5ErrorPrinting *saved) {
    saved->func = NULL;
    saved->data = NULL;
    H5Eget_auto2(H5E_DEFAULT, &saved->func, &saved->data);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}
static void h5_restore(const H5ErrorPrinting *saved) { H5Eset_auto2(H5E_DEFAULT, saved->func, saved->data); }

static void close_id(hid_t id, herr_t (*closer)(hid_t)) {
    if (id >= 0) closer(id);
}

int weights_router_bias_name(const Model *m, int moe_index, char *buf, size_t size) {
    if (moe_index < 0 || moe_index >= m->n_moe_layers) return -1;
    const ModelConfig *mc = &m->cfg.model;
    // Find the block that owns this MoE layer and name its bias after its gate weight, so the names
    // follow whatever the model calls its tensors.
    const BlockWeights *blk = NULL;
    for (int i = 0; m->w.blocks && i < mc->n_layers && !blk; i++)
        if (m->w.blocks[i].is_moe && m->w.blocks[i].moe_index == moe_index) blk = &m->w.blocks[i];
    for (int k = 0; m->w.mtp && k < m->cfg.mtp.depth && !blk; k++)
        if (m->w.mtp[k].block.is_moe && m->w.mtp[k].block.moe_index == moe_index) blk = &m->w.mtp[k].block;
    if (blk && blk->moe.gate) {
        int64_t offset = blk->moe.gate - m->weights;
        for (int p = 0; p < m->n_params; p++) {
            const ParamInfo *pi = &m->params[p];
            size_t len = strlen(pi->name);
            if (pi->offset != offset || len < 7 || strcmp(pi->name + len - 7, ".weight") != 0) continue;
            snprintf(buf, size, "%.*s.bias", (int)(len - 7), pi->name);
            return 0;
        }
    }
    // No pointer view to consult: MoE layer l is main block n_dense + l, then one per MTP module.
    int n_main_moe = mc->n_layers - mc->n_dense_layers;
    if (moe_index < n_main_moe) snprintf(buf, size, "layers.%d.ffn.gate.bias", mc->n_dense_layers + moe_index);
    else snprintf(buf, size, "mtp.%d.block.ffn.gate.bias", moe_index - n_main_moe);
    return 0;
}

// One FP32 dataset `name` of shape (ndim dims) from host data.
static int write_dataset(hid_t file, const char *path, const char *name, int ndim, const int *shape,
                         const float *data, char *err, size_t err_size) {
    hsize_t dims[3];
    for (int d = 0; d < ndim; d++) dims[d] = (hsize_t)shape[d];
    int rc = -1;
    hid_t space = H5Screate_simple(ndim, dims, NULL), dset = -1;
    if (space < 0) {
        snprintf(err, err_size, "%s: dataset %s: cannot create its dataspace", path, name);
        goto done;
    }
    dset = H5Dcreate2(file, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (dset < 0) {
        snprintf(err, err_size, "%s: dataset %s: cannot create it (duplicate name or disk full?)", path, name);
        goto done;
    }
    if (H5Dwrite(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        snprintf(err, err_size, "%s: dataset %s: write failed", path, name);
        goto done;
    }
    rc = 0;
done:
    close_id(dset, H5Dclose);
    close_id(space, H5Sclose);
    return rc;
}

static int write_string_attr(hid_t file, const char *path, const char *name, const char *text, char *err,
                             size_t err_size) {
    int rc = -1;
    hid_t type = H5Tcopy(H5T_C_S1), space = -1, attr = -1;
    if (type < 0 || H5Tset_size(type, strlen(text) + 1) < 0 || H5Tset_strpad(type, H5T_STR_NULLTERM) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot make its string type", path, name);
        goto done;
    }
    space = H5Screate(H5S_SCALAR);
    if (space < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot create its dataspace", path, name);
        goto done;
    }
    attr = H5Acreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    if (attr < 0 || H5Awrite(attr, type, text) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot write it", path, name);
        goto done;
    }
    rc = 0;
done:
    close_id(attr, H5Aclose);
    close_id(space, H5Sclose);
    close_id(type, H5Tclose);
    return rc;
}

// Reads a fixed-length string attribute of the root group into a malloc'd string (*out).
static int read_string_attr(hid_t file, const char *path, const char *name, char **out, char *err,
                            size_t err_size) {
    *out = NULL;
    htri_t exists = H5Aexists(file, name);
    if (exists <= 0) {
        snprintf(err, err_size, "%s: root attribute \"%s\" is missing (expected a file written by fp8moe train)",
                 path, name);
        return -1;
    }
    int rc = -1;
    char *text = NULL;
    hid_t attr = H5Aopen(file, name, H5P_DEFAULT), ftype = -1, mtype = -1;
    if (attr < 0 || (ftype = H5Aget_type(attr)) < 0) {
        snprintf(err, err_size, "%s: root attribute \"%s\": cannot open it", path, name);
        goto done;
    }
    if (H5Tget_class(ftype) != H5T_STRING || H5Tis_variable_str(ftype) != 0) {
        snprintf(err, err_size, "%s: root attribute \"%s\": expected a fixed-length string", path, name);
        goto done;
    }
    size_t size = H5Tget_size(ftype);
    if (size == 0 || !(text = calloc(size + 1, 1))) {
        snprintf(err, err_size, "%s: root attribute \"%s\": bad size %zu", path, name, size);
        goto done;
    }
    mtype = H5Tcopy(H5T_C_S1);
    if (mtype < 0 || H5Tset_size(mtype, size) < 0 || H5Aread(attr, mtype, text) < 0) {
        snprintf(err, err_size, "%s: root attribute \"%s\": read failed", path, name);
        goto done;
    }
    *out = text;
    text = NULL;
    rc = 0;
done:
    free(text);
    close_id(mtype, H5Tclose);
    close_id(ftype, H5Tclose);
    close_id(attr, H5Aclose);
    return rc;
}

// Opens `path` read-only after checking it is an HDF5 file at all (clearer than HDF5's error).
static hid_t open_for_reading(const char *path, char *err, size_t err_size) {
    if (access(path, R_OK) != 0) {
        snprintf(err, err_size, "%s: cannot read the weights file: %s", path, strerror(errno));
        return -1;
    }
    htri_t is_h5 = H5Fis_hdf5(path);
    if (is_h5 <= 0) {
        snprintf(err, err_size, "%s: not an HDF5 file (expected weights written by fp8moe train)", path);
        return -1;
    }
    hid_t file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (file < 0) snprintf(err, err_size, "%s: HDF5 cannot open the file", path);
    return file;
}

// ---------------------------------------------------------------------------- save

static char *config_text(const Config *cfg) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    config_print(cfg, f);
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

// FP32 staging buffers (file side) and `real` buffers (model side) large enough for any one tensor.
static int alloc_staging(const Model *m, const char *path, float **stage, real **host, char *err, size_t err_size) {
    int64_t max_numel = m->cfg.moe.n_routed_experts;  // the router biases
    for (int p = 0; p < m->n_params; p++)
        if (m->params[p].numel > max_numel) max_numel = m->params[p].numel;
    *stage = malloc((size_t)max_numel * sizeof **stage);
    *host = malloc((size_t)max_numel * sizeof **host);
    if (!*stage || !*host) {
        snprintf(err, err_size, "%s: out of memory staging %lld values", path, (long long)max_numel);
        return -1;
    }
    return 0;
}

int weights_save(const Model *m, const char *path, char *err, size_t err_size) {
    char tmp[CONFIG_PATH_MAX + 32];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        snprintf(err, err_size, "%s: path too long", path);
        return -1;
    }
    H5ErrorPrinting saved;
    h5_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    char *text = NULL;
    hid_t file = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (file < 0) {
        snprintf(err, err_size, "%s: cannot create the file (does the directory exist and is it writable?)", tmp);
        goto done;
    }
    if (alloc_staging(m, path, &stage, &host, err, err_size) != 0) goto done;
    for (int p = 0; p < m->n_params; p++) {
        const ParamInfo *pi = &m->params[p];
        device_memcpy_to_host(m->dev, host, m->weights + pi->offset, (size_t)pi->numel * sizeof *host);
        for (int64_t i = 0; i < pi->numel; i++) stage[i] = (float)host[i];
        if (write_dataset(file, tmp, pi->name, pi->ndim, pi->shape, stage, err, err_size) != 0) goto done;
    }
    int E = m->cfg.moe.n_routed_experts;
    for (int l = 0; l < m->n_moe_layers; l++) {
        char name[MODEL_NAME_MAX + 8];
        weights_router_bias_name(m, l, name, sizeof name);
        device_memcpy_to_host(m->dev, host, m->router_bias + (int64_t)l * E, (size_t)E * sizeof *host);
        for (int e = 0; e < E; e++) stage[e] = (float)host[e];
        if (write_dataset(file, tmp, name, 1, &E, stage, err, err_size) != 0) goto done;
    }
    if (!(text = config_text(&m->cfg))) {
        snprintf(err, err_size, "%s: out of memory formatting the config", path);
        goto done;
    }
    if (write_string_attr(file, tmp, "config", text, err, err_size) != 0) goto done;
    if (write_string_attr(file, tmp, "format", WEIGHTS_FORMAT, err, err_size) != 0) goto done;
    hid_t closing = file;
    file = -1;
    if (H5Fclose(closing) < 0) {
        snprintf(err, err_size, "%s: closing the file failed (disk full?)", tmp);
        goto done;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, err_size, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        goto done;
    }
    rc = 0;
done:
    if (file >= 0) H5Fclose(file);
    if (rc != 0) unlink(tmp);
    free(text);
    free(host);
    free(stage);
    h5_restore(&saved);
    return rc;
}

// ---------------------------------------------------------------------------- load

int weights_read_config(const char *path, Config *cfg, char *err, size_t err_size) {
    H5ErrorPrinting saved;
    h5_quiet(&saved);
    int rc = -1;
    char *text = NULL;
    hid_t file = open_for_reading(path, err, err_size);
    if (file < 0) goto done;
    if (read_string_attr(file, path, "config", &text, err, err_size) != 0) goto done;
    char cerr[1024];
    config_defaults(cfg);
    if (config_load_string(cfg, path, text, NULL, 0, cerr, sizeof cerr) != 0) {
        snprintf(err, err_size, "%s: root attribute \"config\" does not parse: %s", path, cerr);
        goto done;
    }
    rc = 0;
done:
    free(text);
    if (file >= 0) H5Fclose(file);
    h5_restore(&saved);
    return rc;
}

// Reads dataset `name` (FP32 of exactly `shape`) into host floats `out`.
static int read_dataset(hid_t file, const char *path, const char *name, int ndim, const int *shape, float *out,
                        char *err, size_t err_size) {
    htri_t exists = H5Lexists(file, name, H5P_DEFAULT);
    if (exists <= 0) {
        snprintf(err, err_size, "%s: dataset %s is missing (the file was written for another model shape?)",
                 path, name);
        return -1;
    }
    int rc = -1;
    hid_t dset = H5Dopen2(file, name, H5P_DEFAULT), space = -1, type = -1;
    if (dset < 0 || (space = H5Dget_space(dset)) < 0 || (type = H5Dget_type(dset)) < 0) {
        snprintf(err, err_size, "%s: dataset %s: cannot open it (is it a dataset?)", path, name);
        goto done;
    }
    if (H5Tget_class(type) != H5T_FLOAT) {
        snprintf(err, err_size, "%s: dataset %s: expected floating-point values", path, name);
        goto done;
    }
    hsize_t dims[H5S_MAX_RANK];
    int got_ndim = H5Sget_simple_extent_dims(space, dims, NULL);
    int same = got_ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = dims[d] == (hsize_t)shape[d];
    if (!same) {
        char want[64] = "", got[64] = "";
        for (int d = 0; d < ndim; d++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%d", d ? ", " : "", shape[d]);
        for (int d = 0; d < got_ndim && d < H5S_MAX_RANK; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%llu", d ? ", " : "",
                     (unsigned long long)dims[d]);
        snprintf(err, err_size, "%s: dataset %s has shape (%s), expected (%s)", path, name, got, want);
        goto done;
    }
    if (H5Dread(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) {
        snprintf(err, err_size, "%s: dataset %s: read failed", path, name);
        goto done;
    }
    rc = 0;
done:
    close_id(type, H5Tclose);
    close_id(space, H5Sclose);
    close_id(dset, H5Dclose);
    return rc;
}

// Fails if the root group holds a link that is neither a parameter nor a router bias of m.
static int check_no_unknown_datasets(const Model *m, hid_t file, const char *path, char *err, size_t err_size) {
    H5G_info_t info;
    if (H5Gget_info(file, &info) < 0) {
        snprintf(err, err_size, "%s: cannot list the root group", path);
        return -1;
    }
    for (hsize_t i = 0; i < info.nlinks; i++) {
        char name[256];
        ssize_t len = H5Lget_name_by_idx(file, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
        if (len < 0) {
            snprintf(err, err_size, "%s: cannot read the name of root link %llu", path, (unsigned long long)i);
            return -1;
        }
        int known = model_find_param(m, name) != NULL;
        for (int l = 0; !known && l < m->n_moe_layers; l++) {
            char bias[MODEL_NAME_MAX + 8];
            weights_router_bias_name(m, l, bias, sizeof bias);
            known = strcmp(bias, name) == 0;
        }
        if (!known) {
            snprintf(err, err_size, "%s: dataset %s is not a tensor of this model (the file was written for "
                     "another model shape?)", path, name);
            return -1;
        }
    }
    return 0;
}

int weights_load(Model *m, const char *path, char *err, size_t err_size) {
    H5ErrorPrinting saved;
    h5_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    hid_t file = open_for_reading(path, err, err_size);
    if (file < 0) goto done;
    if (alloc_staging(m, path, &stage, &host, err, err_size) != 0) goto done;
    for (int p = 0; p < m->n_params; p++) {
        const ParamInfo *pi = &m->params[p];
        if (read_dataset(file, path, pi->name, pi->ndim, pi->shape, stage, err, err_size) != 0) goto done;
        for (int64_t i = 0; i < pi->numel; i++) host[i] = (real)stage[i];
        device_memcpy_from_host(m->dev, m->weights + pi->offset, host, (size_t)pi->numel * sizeof *host);
    }
    model_weights_changed(m);
    int E = m->cfg.moe.n_routed_experts;
    for (int l = 0; l < m->n_moe_layers; l++) {
        char name[MODEL_NAME_MAX + 8];
        weights_router_bias_name(m, l, name, sizeof name);
        if (read_dataset(file, path, name, 1, &E, stage, err, err_size) != 0) goto done;
        for (int e = 0; e < E; e++) host[e] = (real)stage[e];
        device_memcpy_from_host(m->dev, m->router_bias + (int64_t)l * E, host, (size_t)E * sizeof *host);
    }
    if (check_no_unknown_datasets(m, file, path, err, err_size) != 0) goto done;
    rc = 0;
done:
    free(host);
    free(stage);
    if (file >= 0) H5Fclose(file);
    h5_restore(&saved);
    return rc;
}
