/*
 * weights_io.c - FP32 weights file in HDF5 (layout in weights_io.h).
 *
 * HDF5's own error printing is switched off while these functions run (and restored after), so the
 * user sees one message that names the file and dataset instead of a library stack dump. Every call
 * is checked; cleanup closes every handle that was opened, in reverse order.
 *
 * A save that fails to write (a full disk, an I/O error) must still close its file cleanly. HDF5
 * 1.10 (Debian 12 ships 1.10.8) does not survive a failed H5Fclose: H5F__dest frees the file's
 * state even when its final flush fails but leaves the id registered, so any later close of it, and
 * HDF5's own at exit (H5F__close_cb), touches freed memory (upstream: HDFGroup/hdf5 pull request
 * 2291); a failed H5Fflush is no way out either, as it leaves the metadata cache unable to flush
 * again. So weights_save never lets HDF5's flush fail on a write: it writes the file's first block
 * itself before HDF5 opens it (a disk with no room fails there, not inside H5Fcreate), allocates
 * the disk space of the whole file before closing it (the close writes the metadata HDF5 holds
 * into space the file then owns), and when a write or the allocation has failed it points the
 * file's descriptor at an anonymous memory file before closing, so the close flushes its leftovers
 * into memory, succeeds and releases every id; the temporary file is then removed. (On a
 * copy-on-write file system, btrfs or ZFS, allocated space does not promise that rewrites succeed,
 * so there a disk that fills during the close can still fail it.)
 */
#include "train/weights_io.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"

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

// HDF5's sec2 driver records the errno of a failed read or write in its error message ("..., errno
// = 28, error message = 'No space left on device', ..."); this finds it in the current error stack.
static herr_t find_errno(unsigned n, const H5E_error2_t *e, void *data) {
    (void)n;
    int *found = data;
    const char *p = e->desc ? strstr(e->desc, "errno = ") : NULL;
    if (p && *found == 0) *found = atoi(p + 8);
    return 0;
}

// ": <strerror>" for the I/O error behind the HDF5 call that has just failed (call it before any
// other HDF5 call, which would clear the stack), or `otherwise` when the stack records none.
static const char *io_cause(char *buf, size_t size, const char *otherwise) {
    int found = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, find_errno, &found);
    if (found > 0) snprintf(buf, size, ": %s", strerror(found));
    else snprintf(buf, size, "%s", otherwise);
    return buf;
}

int weights_router_bias_name(const Model *m, int moe_index, char *buf, size_t size) {
    if (moe_index < 0 || moe_index >= m->n_moe_layers) return -1;
    snprintf(buf, size, "%s", m->router_bias_names[moe_index]);
    return 0;
}

// One FP32 dataset `name` of shape (ndim dims) from host data.
static int write_dataset(hid_t file, const char *path, const char *name, int ndim, const int *shape,
                         const float *data, char *err, size_t err_size) {
    hsize_t dims[3];
    for (int d = 0; d < ndim; d++) dims[d] = (hsize_t)shape[d];
    int rc = -1;
    char cause[160];
    hid_t space = H5Screate_simple(ndim, dims, NULL), dset = -1;
    if (space < 0) {
        snprintf(err, err_size, "%s: dataset %s: cannot create its dataspace", path, name);
        goto done;
    }
    dset = H5Dcreate2(file, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (dset < 0) {
        snprintf(err, err_size, "%s: dataset %s: cannot create it%s", path, name,
                 io_cause(cause, sizeof cause, " (duplicate name or disk full?)"));
        goto done;
    }
    if (H5Dwrite(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        snprintf(err, err_size, "%s: dataset %s: write failed%s", path, name,
                 io_cause(cause, sizeof cause, " (disk full or I/O error?)"));
        goto done;
    }
    hid_t closing = dset;
    dset = -1;
    if (H5Dclose(closing) < 0) {  // may write the dataset's last buffered bytes
        snprintf(err, err_size, "%s: dataset %s: write failed%s", path, name,
                 io_cause(cause, sizeof cause, " (disk full or I/O error?)"));
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
    char cause[160];
    if (attr < 0 || H5Awrite(attr, type, text) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot write it%s", path, name, io_cause(cause, sizeof cause, ""));
        goto done;
    }
    hid_t closing = attr;
    attr = -1;
    if (H5Aclose(closing) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot write it%s", path, name, io_cause(cause, sizeof cause, ""));
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

// The root attribute "format" must be WEIGHTS_FORMAT.
static int check_format(hid_t file, const char *path, char *err, size_t err_size) {
    char *format = NULL;
    if (read_string_attr(file, path, "format", &format, err, err_size) != 0) return -1;
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

// Creates `tmp` and writes its first 4 KiB before HDF5 opens it: on a disk without room this fails
// with errno, whereas a failed write inside H5Fcreate leaves HDF5 1.10 unable to shut down cleanly.
// H5Fcreate then truncates the file and gets the block it frees for its superblock.
static int reserve_first_block(const char *tmp, char *err, size_t err_size) {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        snprintf(err, err_size, "%s: cannot create the file: %s (does the directory exist and is it writable?)", tmp,
                 strerror(errno));
        return -1;
    }
    static const char block[4096];
    ssize_t n = write(fd, block, sizeof block);
    int write_errno = n < 0 ? errno : ENOSPC;  // a short write means the disk is full
    int closed = close(fd);
    if (n != (ssize_t)sizeof block || closed != 0) {
        snprintf(err, err_size, "%s: cannot write the file: %s", tmp,
                 strerror(n != (ssize_t)sizeof block ? write_errno : errno));
        return -1;
    }
    return 0;
}

// The POSIX descriptor HDF5's sec2 driver holds for `file`, or NULL.
static int *file_descriptor(hid_t file) {
    int *fd = NULL;
    if (H5Fget_vfd_handle(file, H5P_DEFAULT, (void **)&fd) < 0 || !fd || *fd < 0) return NULL;
    return fd;
}

#define SAVE_SPACE_MARGIN 4096  // bytes allocated past the file's current end (see below)

// Allocates disk blocks for the whole file as it stands (all datasets written, metadata still in
// HDF5's cache) and SAVE_SPACE_MARGIN bytes more, so the writes of the final flush land on space
// the file already owns. FALLOC_FL_KEEP_SIZE leaves the file's length alone (HDF5 tracks it), so
// the file's bytes are the same as without this; release_allocation gives back what is unused.
// Fails when the disk lacks the room; a file system that cannot preallocate is not an error.
static int allocate_file_space(hid_t file, const char *tmp, char *err, size_t err_size) {
    hsize_t size = 0;
    int *fd = file_descriptor(file);
    if (!fd || H5Fget_filesize(file, &size) < 0) {
        snprintf(err, err_size, "%s: cannot get the file's size and descriptor from HDF5", tmp);
        return -1;
    }
    if (fallocate(*fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)size + SAVE_SPACE_MARGIN) == 0 || errno == EOPNOTSUPP ||
        errno == ENOSYS || errno == EINVAL || errno == ENODEV)
        return 0;
    snprintf(err, err_size, "%s: cannot allocate disk space for the file's %llu bytes: %s", tmp,
             (unsigned long long)size, strerror(errno));
    return -1;
}

// Frees the blocks allocate_file_space reserved past the end of the closed file (truncating a file
// to its own length releases those on Linux file systems; the bytes are unchanged).
static int release_allocation(const char *tmp) {
    struct stat st;
    return stat(tmp, &st) == 0 && truncate(tmp, st.st_size) == 0 ? 0 : -1;
}

// Points the descriptor of `file` (sec2 driver) at an anonymous memory file, so the close of a file
// whose writes have failed flushes what it still holds into memory and succeeds (see the top).
static void redirect_to_memory(hid_t file) {
    int *fd = file_descriptor(file);
    if (!fd) return;
    int mem = memfd_create("fp8moe-discarded-weights", MFD_CLOEXEC);
    if (mem < 0) return;
    dup2(mem, *fd);
    close(mem);
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
    if (reserve_first_block(tmp, err, err_size) != 0) {
        if (unlink(tmp) == 0 && strlen(err) + 40 < err_size) strcat(err, "; the partial file was removed");
        partial_active = 0;
        return -1;
    }
    H5ErrorPrinting saved;
    h5_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    char *text = NULL, cause[160];
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), file = -1;
    if (fapl < 0 || H5Pset_fapl_sec2(fapl) < 0) {  // redirect_to_memory needs the POSIX driver's descriptor
        snprintf(err, err_size, "%s: cannot set up HDF5's file access properties", tmp);
        goto done;
    }
    file = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    if (file < 0) {
        snprintf(err, err_size, "%s: HDF5 cannot create the file%s", tmp, io_cause(cause, sizeof cause, ""));
        goto done;
    }
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
    if (!(text = config_text(&m->cfg))) {
        snprintf(err, err_size, "%s: out of memory formatting the config", path);
        goto done;
    }
    if (write_string_attr(file, tmp, "config", text, err, err_size) != 0) goto done;
    if (write_string_attr(file, tmp, "format", WEIGHTS_FORMAT, err, err_size) != 0) goto done;
    // The close writes all metadata; a failed write there cannot be recovered (see the top), so the
    // disk space it needs is allocated first, where running out can still be handled.
    if (allocate_file_space(file, tmp, err, err_size) != 0) goto done;
    hid_t closing = file;
    file = -1;
    if (H5Fclose(closing) < 0) {
        snprintf(err, err_size, "%s: closing the file failed%s", tmp, io_cause(cause, sizeof cause, " (disk full?)"));
        goto done;
    }
    if (release_allocation(tmp) != 0 || durable_fsync_path(tmp) != 0) {
        if (errno == ENOENT)
            snprintf(err, err_size, "%s: the temporary file was removed before the save finished (interrupted?)", tmp);
        else
            snprintf(err, err_size, "%s: cannot finish the file (truncate and fsync): %s", tmp, strerror(errno));
        goto done;
    }
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
    if (file >= 0) {  // a write failed: close without letting the close fail
        redirect_to_memory(file);
        H5Fclose(file);
    }
    close_id(fapl, H5Pclose);
    if (rc != 0 && unlink(tmp) == 0 && strlen(err) + 40 < err_size)
        strcat(err, "; the partial file was removed");
    partial_active = 0;
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
    h5_quiet(&saved);
    int rc = -1;
    float *stage = NULL;
    real *host = NULL;
    hid_t file = open_for_reading(path, err, err_size);
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
    h5_restore(&saved);
    return rc;
}
