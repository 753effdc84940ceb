/*
 * durable.h - making a finished file survive a crash or power loss: fsync of a file named by path,
 * and rename(2) followed by an fsync of the directory that holds the new name; and the mkdir -p that
 * every writer runs first.
 *
 * The pattern every writer of this project follows: write to `name.tmp.<pid>`, fsync it (so its
 * blocks are on disk before it gets the final name), rename it over `name`, then fsync the directory
 * (so the rename itself is on disk). A file written through a stdio stream takes DurableFile, which does
 * all of it: data/shard.c, data/prep.c, train/safetensors.c, train/hf_export.c, train/compare.c,
 * train/grad_compare.c. HDF5 files (train/h5io.c) and the checkpoint's directories and latest link
 * (train/checkpoint.c) use the functions below it directly.
 */
#ifndef FP8MOE_DURABLE_H
#define FP8MOE_DURABLE_H

#include <stddef.h>
#include <stdio.h>

// A file being written the durable way. durable_open creates path.tmp.<pid> (unique per process, so two
// writers of one path never share a file) and sets f, the stream to write it through; durable_commit
// flushes, fsyncs and closes it, then renames it over path and syncs the directory; durable_discard closes
// and removes it. A write error on f anywhere before the commit is caught there (ferror), so the writer
// need not check each fprintf: the commit then fails, removes the temporary file and leaves path as it was.
typedef struct {
    FILE *f;
    char *path, *tmp;  // owned
} DurableFile;

// Returns 0, or -1 with one line in err naming the temporary file and why it could not be created.
int durable_open(DurableFile *d, const char *path, char *err, size_t err_size);
// Returns 0 (path holds what was written), or -1 with one line in err: the write, the fsync, the rename
// (temporary file removed, path unchanged) or, after the rename, the directory's fsync (path in place, its
// durability unknown). Either way d is released.
int durable_commit(DurableFile *d, char *err, size_t err_size);
// Abandons the file: closes and removes the temporary, path unchanged. Safe on a released or zeroed d.
void durable_discard(DurableFile *d);
// path holds exactly text, written the durable way. Returns 0, or -1 with err as durable_commit's.
int durable_write_text(const char *path, const char *text, char *err, size_t err_size);

// fsync(2) of the file at `path` (opened read-only, which is enough on Linux and POSIX). Returns 0,
// or -1 with errno set.
int durable_fsync_path(const char *path);

// rename(from, to), then fsync of the directory that holds `to` ("." when `to` has no slash).
// Returns 0; -1 with errno set when the rename failed (nothing changed); -2 with errno set when the
// rename succeeded but the directory could not be synced (`to` is in place, its durability unknown).
int durable_rename(const char *from, const char *to);

// mkdir -p: creates dir and its missing parents (mode 0755). Returns 0, or -1 with one line in err that
// names the directory that could not be made and why, or says that dir exists but is not a directory.
int durable_make_dirs(const char *dir, char *err, size_t err_size);

#endif
