/*
 * h5io.h - the HDF5 habits that every fp8moe file writer and reader shares (train/weights_io.c, the
 * weights export, and train/checkpoint.c, the resumable checkpoint): quiet error stacks, the system's
 * reason behind a failed write, string and integer attributes, datasets written with their attributes, a checked
 * open, and a save protocol that survives a full disk.
 *
 * Why a save protocol at all: HDF5 1.10 (Debian 12 ships 1.10.8) does not survive a failed H5Fclose.
 * H5F__dest frees the file's state even when its final flush fails but leaves the id registered, so a
 * later close of it, and HDF5's own at exit (H5F__close_cb), touches freed memory (upstream:
 * HDFGroup/hdf5 pull request 2291); a failed H5Fflush is no way out either, as it leaves the metadata
 * cache unable to flush again. So a writer never lets HDF5's flush fail on a write:
 *   h5io_create   writes the file's first block itself before HDF5 opens it (a disk with no room fails
 *                 there, not inside H5Fcreate), then creates the file with the POSIX (sec2) driver;
 *   h5io_finish   allocates the disk space of the whole file before closing it (the close writes the
 *                 metadata HDF5 holds into space the file then owns), closes it, gives back the unused
 *                 allocation and fsyncs the file;
 *   h5io_abandon  after a failed write or allocation: points the file's descriptor at an anonymous
 *                 memory file, so the close flushes its leftovers into memory, succeeds and releases
 *                 every id; the caller then removes the file.
 * (On a copy-on-write file system, btrfs or ZFS, allocated space does not promise that rewrites
 * succeed, so there a disk that fills during the close can still fail it.)
 *
 * Errors: every function returns -1 (or a negative id) with one line in err naming the file and the
 * object (dataset or attribute) and, for I/O, the system's reason ("No space left on device").
 * Callers run between h5io_quiet and h5io_restore, so HDF5 prints no stack of its own.
 */
#ifndef FP8MOE_H5IO_H
#define FP8MOE_H5IO_H

#include <stddef.h>
#include <stdint.h>

#include <hdf5.h>

#include "train/config.h"

// HDF5's automatic error printing, saved by h5io_quiet and put back by h5io_restore around one public call.
typedef struct {
    H5E_auto2_t func;
    void *data;
} H5ErrorPrinting;

void h5io_quiet(H5ErrorPrinting *saved);
void h5io_restore(const H5ErrorPrinting *saved);

// closer(id) when id is valid (>= 0); for cleanup paths.
void h5io_close(hid_t id, herr_t (*closer)(hid_t));

// ": <strerror>" for the I/O error behind the HDF5 call that has just failed (HDF5's sec2 driver records
// the errno in its message), or `otherwise` when the stack records none. Call it before any other HDF5
// call, which would clear the stack. Returns buf.
const char *h5io_cause(char *buf, size_t size, const char *otherwise);

// Whether the current error stack says a checksum failed: Fletcher32 on a dataset's chunk ("data error
// detected by Fletcher32 checksum") or the checksum of a metadata block ("incorrect metadata checksum").
// Call it right after the failed call, like h5io_cause.
int h5io_checksum_failed(void);

// A fixed-length string attribute `name` on object obj (a file, group or dataset) of the file at path.
int h5io_write_string_attr(hid_t obj, const char *path, const char *name, const char *text, char *err,
                           size_t err_size);
// An integer attribute `name` on obj (`what` names obj in messages: "root group", "dataset /embed.weight"): n values
// as an array, or with n = H5IO_SCALAR one value as a scalar.
#define H5IO_SCALAR 0
int h5io_write_i64_attr(hid_t obj, const char *path, const char *what, const char *name, const int64_t *v, int n,
                        char *err, size_t err_size);
typedef struct {
    const char *name;
    const int64_t *v;
    int n;  // h5io_write_i64_attr's
} H5I64Attr;
// Dataset `name` (e.g. "weights/embed.weight") of file type ftype and shape dims (ndim of them), written from data of
// memory type mtype with the creation properties dcpl (H5P_DEFAULT: contiguous; the caller's chunked, checksummed
// ones) and the integer attributes attrs (n_attrs of them, may be 0). After a failure the file's writes are
// discarded (h5io_discard_writes), so the dataset's close cannot fail on a full disk too; the file is then only fit
// for h5io_abandon.
int h5io_write_dataset(hid_t file, const char *path, const char *name, hid_t ftype, hid_t mtype, int ndim,
                       const hsize_t *dims, hid_t dcpl, const void *data, const H5I64Attr *attrs, int n_attrs,
                       char *err, size_t err_size);
// Reads the fixed-length string attribute `name` of obj into a malloc'd string *out (the caller frees it).
// A missing attribute is reported as "root attribute "name" is missing (expected a file written by fp8moe
// train)".
int h5io_read_string_attr(hid_t obj, const char *path, const char *name, char **out, char *err, size_t err_size);

// The resolved config as INI text (config_print), as both files store it in their "config" attribute: a
// malloc'd string, or NULL when out of memory.
char *h5io_config_text(const Config *cfg);

// Opens `path` read-only after checking that it is readable and an HDF5 file at all (clearer than HDF5's
// own error). `what` names the kind of file in the messages ("weights file", "checkpoint file"). Returns
// the file id, or -1 with err.
hid_t h5io_open_for_reading(const char *path, const char *what, char *err, size_t err_size);

// Creates `path` for writing (the save protocol above). checksummed_metadata: the file's superblock and
// object headers are the versions that carry a checksum (HDF5 1.8 format and later: H5F_LIBVER_V18), so a
// flipped byte in an attribute or a group is found on reading too, not only in a Fletcher32 dataset.
// Returns the file id, or -1 with err (the file may exist: the caller removes it).
hid_t h5io_create(const char *path, int checksummed_metadata, char *err, size_t err_size);
// Allocates the file's disk space, closes it (*file becomes -1 whether or not the close succeeds), gives back
// the unused allocation and fsyncs it. Returns 0, or -1 with err; after a failure before the close, *file is
// still open and the caller passes it to h5io_abandon.
int h5io_finish(hid_t *file, const char *path, char *err, size_t err_size);
// Closes a file whose writes have failed without letting the close fail (see the top). file < 0: nothing.
void h5io_abandon(hid_t file);
// After a failed write into `file`, before closing any of its objects: points the file's descriptor at an
// anonymous memory file, so the closes that flush buffered data (a chunked dataset's chunk cache: H5Dclose)
// succeed and release their ids instead of failing on the full disk again, which would keep the file open.
// The file is then only fit for h5io_abandon.
void h5io_discard_writes(hid_t file);

#endif
