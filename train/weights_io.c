/*
 * weights_io.c - FP32 weights file in HDF5 (layout in weights_io.h).
 *
 * HDF5's own error printing is switched off while these functions run (and restored after), so the
 * user sees one message that names the file and dataset instead of a library stack dump. Every call
 * is checked; cleanup closes every handle that was opened, in reverse order.
 *
 * A save that fails to write (a full disk, an I/O error) must still close its file cleanly: weights_save
 * follows the save protocol of train/h5io.h (the file's first block written before HDF5 opens it, the
 * disk space of the whole file allocated before the close, and after a failed write a close into an
 * anonymous memory file), then removes the temporary file.
 */
#include "train/weights_io.h"

#include <errno.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/durable.h"
#include "train/h5io.h"

// ---------------------------------------------------------------------------- helpers

int weights_router_bias_name(const Model *m, int moe_index, char *buf, size_t size) {
    if (moe_index < 0 || moe_index >= m->n_moe_layers) return -1;
    snprintf(buf, size, "%s", m->router_bias_names[moe_index]);
    return 0;
}

// One FP32 dataset `name` of shape (ndim dims) from host data, contiguous.
static int write_dataset(hid_t file, const char *path, const char *name, int ndim, const int *shape,
                         const float *data, char *err, size_t err_size) {
    hsize_t dims[3];
    for (int d = 0; d < ndim; d++) dims[d] = (hsize_t)shape[d];
    return h5io_write_dataset(file, path, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, ndim, dims, H5P_DEFAULT, data, NULL,
                              0, err, err_size);
}

// The root attribute "format" must be WEIGHTS_FORMAT.
static int check_format(hid_t file, const char *path, char *err, size_t err_size) {
    char *format = NULL;
    if (h5io_read_string_attr(file, path, "format", &format, err, err_size) != 0) return -1;
    int ok = strcmp(format, WEIGHTS_FORMAT) == 0;
    if (!ok)
        snprintf(err, err_size, "%s: root attribute \"format\" is \"%.64s\", expected \"%s\" (not a weights file "
                 "this version of fp8moe can read)", path, format, WEIGHTS_FORMAT);
    free(format);
    return ok ? 0 : -1;
}

// Fails on the first NaN or infinity of v (the n values of dataset `name`, shape `shape`), naming
// its index and how many non-finite values the dataset holds.
static int check_finite(const char *path, const char *name, int ndim, const int *shape, const float *v, int64_t n,
                        char *err, size_t err_size) {
    int64_t first = -1, count = 0;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i])) {
            if (first < 0) first = i;
            count++;
        }
    if (first < 0) return 0;
    int64_t idx[8] = {0}, rest = first;
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] > 0 ? rest % shape[d] : 0;
        rest = shape[d] > 0 ? rest / shape[d] : 0;
    }
    char where[128] = "(";
    for (int d = 0; d < ndim && d < 8; d++)
        snprintf(where + strlen(where), sizeof where - strlen(where), "%s%lld", d ? ", " : "", (long long)idx[d]);
    snprintf(where + strlen(where), sizeof where - strlen(where), ")");
    float x = v[first];
    snprintf(err, err_size, "%s: dataset %s: element %s is %s (%lld of its %lld values %s not finite); a weights "
             "file must hold finite values (did the run that wrote it diverge?)", path, name, where,
             isnan(x) ? "NaN" : x > 0 ? "+Inf" : "-Inf", (long long)count, (long long)n, count == 1 ? "is" : "are");
    return -1;
}

// ---------------------------------------------------------------------------- save

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

// The temporary file of the save in progress, for weights_remove_partial (which may run in a signal
// handler: it reads only these two, and the path is complete before the flag is set).
static char partial_path[CONFIG_PATH_MAX + 32];
static volatile sig_atomic_t partial_active;

int weights_remove_partial(void) {
    if (!partial_active) return 0;
    int saved = errno;
    int rc = unlink(partial_path) == 0 ? 1 : errno == ENOENT ? 0 : -1;
    errno = saved;
    return rc;
}

int weights_save(const Model *m, const char *path, char *err, size_t err_size) {
    char tmp[sizeof partial_path];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        snprintf(err, err_size, "%s: path too long", path);
        return -1;
    }
    memcpy(partial_path, tmp, sizeof tmp);
    atomic_signal_fence(memory_order_seq_cst);
    partial_active = 1;
    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    char *text = NULL;
    hid_t file = h5io_create(tmp, 0, err, err_size);
    if (file < 0) goto done;
    if (alloc_staging(m, path, &stage, &host, err, err_size) != 0) goto done;
    for (int p = 0; p < m->n_params; p++) {
        const ParamInfo *pi = &m->params[p];
        device_memcpy_to_host(m->rc.dev, host, m->weights + pi->offset, (size_t)pi->numel * sizeof *host);
        for (int64_t i = 0; i < pi->numel; i++) stage[i] = (float)host[i];
        if (write_dataset(file, tmp, pi->name, pi->ndim, pi->shape, stage, err, err_size) != 0) goto done;
    }
    int E = m->cfg.moe.n_routed_experts;
    for (int l = 0; l < m->n_moe_layers; l++) {
        char name[MODEL_NAME_MAX + 8];
        weights_router_bias_name(m, l, name, sizeof name);
        device_memcpy_to_host(m->rc.dev, host, m->router_bias + (int64_t)l * E, (size_t)E * sizeof *host);
        for (int e = 0; e < E; e++) stage[e] = (float)host[e];
        if (write_dataset(file, tmp, name, 1, &E, stage, err, err_size) != 0) goto done;
    }
    if (!(text = h5io_config_text(&m->cfg))) {
        snprintf(err, err_size, "%s: out of memory formatting the config", path);
        goto done;
    }
    if (h5io_write_string_attr(file, tmp, "config", text, err, err_size) != 0) goto done;
    if (h5io_write_string_attr(file, tmp, "format", WEIGHTS_FORMAT, err, err_size) != 0) goto done;
    if (h5io_finish(&file, tmp, err, err_size) != 0) goto done;
    int renamed = durable_rename(tmp, path);
    if (renamed == -1) {
        snprintf(err, err_size, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        goto done;
    }
    if (renamed == -2) {
        snprintf(err, err_size, "%s: written, but the fsync of its directory failed: %s (the file may not survive a "
                 "crash)", path, strerror(errno));
        goto done;
    }
    rc = 0;
done:
    h5io_abandon(file);  // a write failed (file still open): close without letting the close fail
    if (rc != 0 && unlink(tmp) == 0 && strlen(err) + 40 < err_size)
        strcat(err, "; the partial file was removed");
    partial_active = 0;
    free(text);
    free(host);
    free(stage);
    h5io_restore(&saved);
    return rc;
}

// ---------------------------------------------------------------------------- load

int weights_read_config(const char *path, Config *cfg, char *err, size_t err_size) {
    H5ErrorPrinting saved;
    h5io_quiet(&saved);
    int rc = -1;
    char *text = NULL;
    hid_t file = h5io_open_for_reading(path, "weights file", err, err_size);
    if (file < 0) goto done;
    if (h5io_read_string_attr(file, path, "config", &text, err, err_size) != 0) goto done;
    if (check_format(file, path, err, err_size) != 0) goto done;
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
    h5io_restore(&saved);
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
    h5io_close(type, H5Tclose);
    h5io_close(space, H5Sclose);
    h5io_close(dset, H5Dclose);
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
        int known = model_find_param(m, name) != NULL || model_find_router_bias(m, name) >= 0;
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
    h5io_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    hid_t file = h5io_open_for_reading(path, "weights file", err, err_size);
    if (file < 0) goto done;
    if (check_format(file, path, err, err_size) != 0) goto done;
    if (alloc_staging(m, path, &stage, &host, err, err_size) != 0) goto done;
    for (int p = 0; p < m->n_params; p++) {
        const ParamInfo *pi = &m->params[p];
        if (read_dataset(file, path, pi->name, pi->ndim, pi->shape, stage, err, err_size) != 0) goto done;
        if (check_finite(path, pi->name, pi->ndim, pi->shape, stage, pi->numel, err, err_size) != 0) goto done;
        for (int64_t i = 0; i < pi->numel; i++) host[i] = (real)stage[i];
        device_memcpy_from_host(m->rc.dev, m->weights + pi->offset, host, (size_t)pi->numel * sizeof *host);
    }
    model_weights_changed(m);
    int E = m->cfg.moe.n_routed_experts;
    for (int l = 0; l < m->n_moe_layers; l++) {
        char name[MODEL_NAME_MAX + 8];
        weights_router_bias_name(m, l, name, sizeof name);
        if (read_dataset(file, path, name, 1, &E, stage, err, err_size) != 0) goto done;
        if (check_finite(path, name, 1, &E, stage, E, err, err_size) != 0) goto done;
        for (int e = 0; e < E; e++) host[e] = (real)stage[e];
        device_memcpy_from_host(m->rc.dev, m->router_bias + (int64_t)l * E, host, (size_t)E * sizeof *host);
    }
    if (check_no_unknown_datasets(m, file, path, err, err_size) != 0) goto done;
    rc = 0;
done:
    free(host);
    free(stage);
    if (file >= 0) H5Fclose(file);
    h5io_restore(&saved);
    return rc;
}
