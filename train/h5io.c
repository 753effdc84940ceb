/*
 * h5io.c - the shared HDF5 helpers of the weights file and the checkpoint (see h5io.h, which explains
 * the save protocol for a full disk).
 */
#include "train/h5io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"

// ---------------------------------------------------------------------------- errors

void h5io_quiet(H5ErrorPrinting *saved) {
    saved->func = NULL;
    saved->data = NULL;
    H5Eget_auto2(H5E_DEFAULT, &saved->func, &saved->data);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

void h5io_restore(const H5ErrorPrinting *saved) { H5Eset_auto2(H5E_DEFAULT, saved->func, saved->data); }

void h5io_close(hid_t id, herr_t (*closer)(hid_t)) {
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

const char *h5io_cause(char *buf, size_t size, const char *otherwise) {
    int found = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, find_errno, &found);
    if (found > 0) snprintf(buf, size, ": %s", strerror(found));
    else snprintf(buf, size, "%s", otherwise);
    return buf;
}

static herr_t find_checksum(unsigned n, const H5E_error2_t *e, void *data) {
    (void)n;
    int *found = data;
    if (e->desc && (strstr(e->desc, "checksum") || strstr(e->desc, "Fletcher32"))) *found = 1;
    return 0;
}

int h5io_checksum_failed(void) {
    int found = 0;
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, find_checksum, &found);
    return found;
}

// ---------------------------------------------------------------------------- string attributes

int h5io_write_string_attr(hid_t obj, const char *path, const char *name, const char *text, char *err,
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
    attr = H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    char cause[160];
    if (attr < 0 || H5Awrite(attr, type, text) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot write it%s", path, name, h5io_cause(cause, sizeof cause, ""));
        goto done;
    }
    hid_t closing = attr;
    attr = -1;
    if (H5Aclose(closing) < 0) {
        snprintf(err, err_size, "%s: attribute %s: cannot write it%s", path, name, h5io_cause(cause, sizeof cause, ""));
        goto done;
    }
    rc = 0;
done:
    h5io_close(attr, H5Aclose);
    h5io_close(space, H5Sclose);
    h5io_close(type, H5Tclose);
    return rc;
}

int h5io_write_i64_attr(hid_t obj, const char *path, const char *what, const char *name, const int64_t *v, int n,
                        char *err, size_t err_size) {
    hsize_t dims = (hsize_t)n;
    char cause[160] = "";
    hid_t space = n == H5IO_SCALAR ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &dims, NULL), attr = -1;
    int ok = space >= 0 && (attr = H5Acreate2(obj, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT)) >= 0 &&
             H5Awrite(attr, H5T_NATIVE_INT64, v) >= 0;
    if (!ok) h5io_cause(cause, sizeof cause, "");
    if (attr >= 0 && H5Aclose(attr) < 0 && ok) ok = 0, h5io_cause(cause, sizeof cause, "");
    h5io_close(space, H5Sclose);
    if (!ok) snprintf(err, err_size, "%s: %s: attribute %s: cannot write it%s", path, what, name, cause);
    return ok ? 0 : -1;
}

int h5io_write_dataset(hid_t file, const char *path, const char *name, hid_t ftype, hid_t mtype, int ndim,
                       const hsize_t *dims, hid_t dcpl, const void *data, const H5I64Attr *attrs, int n_attrs,
                       char *err, size_t err_size) {
    int rc = -1;
    char cause[160], what[512];
    snprintf(what, sizeof what, "dataset /%s", name);
    hid_t space = H5Screate_simple(ndim, dims, NULL), dset = -1;
    if (space < 0) {
        snprintf(err, err_size, "%s: %s: cannot create its dataspace", path, what);
        goto done;
    }
    dset = H5Dcreate2(file, name, ftype, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (dset < 0) {
        snprintf(err, err_size, "%s: %s: cannot create it%s", path, what,
                 h5io_cause(cause, sizeof cause, " (duplicate name or disk full?)"));
        goto done;
    }
    if (H5Dwrite(dset, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        snprintf(err, err_size, "%s: %s: write failed%s", path, what,
                 h5io_cause(cause, sizeof cause, " (disk full or I/O error?)"));
        goto done;
    }
    for (int a = 0; a < n_attrs; a++)
        if (h5io_write_i64_attr(dset, path, what, attrs[a].name, attrs[a].v, attrs[a].n, err, err_size) != 0) goto done;
    hid_t closing = dset;
    dset = -1;
    if (H5Dclose(closing) < 0) {  // may write the dataset's last buffered bytes
        snprintf(err, err_size, "%s: %s: write failed%s", path, what,
                 h5io_cause(cause, sizeof cause, " (disk full or I/O error?)"));
        goto done;
    }
    rc = 0;
done:
    if (rc != 0) h5io_discard_writes(file);  // so the close below cannot fail on the full disk too
    h5io_close(dset, H5Dclose);
    h5io_close(space, H5Sclose);
    return rc;
}

int h5io_read_string_attr(hid_t obj, const char *path, const char *name, char **out, char *err, size_t err_size) {
    *out = NULL;
    htri_t exists = H5Aexists(obj, name);
    if (exists <= 0) {
        if (exists < 0 && h5io_checksum_failed())
            snprintf(err, err_size, "%s: root attribute \"%s\": its object header fails its checksum (the file is "
                     "corrupted)", path, name);
        else
            snprintf(err, err_size, "%s: root attribute \"%s\" is missing (expected a file written by fp8moe train)",
                     path, name);
        return -1;
    }
    int rc = -1;
    char *text = NULL;
    hid_t attr = H5Aopen(obj, name, H5P_DEFAULT), ftype = -1, mtype = -1;
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
    h5io_close(mtype, H5Tclose);
    h5io_close(ftype, H5Tclose);
    h5io_close(attr, H5Aclose);
    return rc;
}

// ---------------------------------------------------------------------------- config text

char *h5io_config_text(const Config *cfg) {
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

// ---------------------------------------------------------------------------- open for reading

hid_t h5io_open_for_reading(const char *path, const char *what, char *err, size_t err_size) {
    if (access(path, R_OK) != 0) {
        snprintf(err, err_size, "%s: cannot read the %s: %s", path, what, strerror(errno));
        return -1;
    }
    htri_t is_h5 = H5Fis_hdf5(path);
    if (is_h5 <= 0) {
        snprintf(err, err_size, "%s: not an HDF5 file (expected a %s written by fp8moe train)", path, what);
        return -1;
    }
    hid_t file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (file < 0)
        snprintf(err, err_size, "%s: HDF5 cannot open the file%s", path,
                 h5io_checksum_failed() ? ": its superblock fails its checksum (the file is corrupted)" : "");
    return file;
}

// ---------------------------------------------------------------------------- the save protocol

// Creates `path` and writes its first 4 KiB before HDF5 opens it: on a disk without room this fails
// with errno, whereas a failed write inside H5Fcreate leaves HDF5 1.10 unable to shut down cleanly.
// H5Fcreate then truncates the file and gets the block it frees for its superblock.
static int reserve_first_block(const char *path, char *err, size_t err_size) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        snprintf(err, err_size, "%s: cannot create the file: %s (does the directory exist and is it writable?)", path,
                 strerror(errno));
        return -1;
    }
    static const char block[4096];
    ssize_t n = write(fd, block, sizeof block);
    int write_errno = n < 0 ? errno : ENOSPC;  // a short write means the disk is full
    int closed = close(fd);
    if (n != (ssize_t)sizeof block || closed != 0) {
        snprintf(err, err_size, "%s: cannot write the file: %s", path,
                 strerror(n != (ssize_t)sizeof block ? write_errno : errno));
        return -1;
    }
    return 0;
}

hid_t h5io_create(const char *path, int checksummed_metadata, char *err, size_t err_size) {
    if (reserve_first_block(path, err, err_size) != 0) return -1;
    char cause[160];
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), file = -1;
    // h5io_abandon needs the POSIX driver's descriptor
    if (fapl < 0 || H5Pset_fapl_sec2(fapl) < 0 ||
        (checksummed_metadata && H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST) < 0)) {
        snprintf(err, err_size, "%s: cannot set up HDF5's file access properties", path);
        h5io_close(fapl, H5Pclose);
        return -1;
    }
    file = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    if (file < 0)
        snprintf(err, err_size, "%s: HDF5 cannot create the file%s", path, h5io_cause(cause, sizeof cause, ""));
    H5Pclose(fapl);
    return file;
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
static int allocate_file_space(hid_t file, const char *path, char *err, size_t err_size) {
    hsize_t size = 0;
    int *fd = file_descriptor(file);
    if (!fd || H5Fget_filesize(file, &size) < 0) {
        snprintf(err, err_size, "%s: cannot get the file's size and descriptor from HDF5", path);
        return -1;
    }
    if (fallocate(*fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)size + SAVE_SPACE_MARGIN) == 0 || errno == EOPNOTSUPP ||
        errno == ENOSYS || errno == EINVAL || errno == ENODEV)
        return 0;
    snprintf(err, err_size, "%s: cannot allocate disk space for the file's %llu bytes: %s", path,
             (unsigned long long)size, strerror(errno));
    return -1;
}

// Frees the blocks allocate_file_space reserved past the end of the closed file (truncating a file
// to its own length releases those on Linux file systems; the bytes are unchanged).
static int release_allocation(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && truncate(path, st.st_size) == 0 ? 0 : -1;
}

int h5io_finish(hid_t *file, const char *path, char *err, size_t err_size) {
    // The close writes all metadata; a failed write there cannot be recovered (see the top), so the
    // disk space it needs is allocated first, where running out can still be handled.
    if (allocate_file_space(*file, path, err, err_size) != 0) return -1;
    char cause[160];
    hid_t closing = *file;
    *file = -1;
    if (H5Fclose(closing) < 0) {
        snprintf(err, err_size, "%s: closing the file failed%s", path, h5io_cause(cause, sizeof cause, " (disk full?)"));
        return -1;
    }
    if (release_allocation(path) != 0 || durable_fsync_path(path) != 0) {
        if (errno == ENOENT)
            snprintf(err, err_size, "%s: the temporary file was removed before the save finished (interrupted?)", path);
        else
            snprintf(err, err_size, "%s: cannot finish the file (truncate and fsync): %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

// Points the descriptor of `file` (sec2 driver) at an anonymous memory file, so the close of a file
// whose writes have failed flushes what it still holds into memory and succeeds (see h5io.h).
static void redirect_to_memory(hid_t file) {
    int *fd = file_descriptor(file);
    if (!fd) return;
    int mem = memfd_create("fp8moe-discarded-hdf5", MFD_CLOEXEC);
    if (mem < 0) return;
    dup2(mem, *fd);
    close(mem);
}

void h5io_discard_writes(hid_t file) {
    if (file >= 0) redirect_to_memory(file);
}

void h5io_abandon(hid_t file) {
    if (file < 0) return;
    redirect_to_memory(file);
    H5Fclose(file);
}
