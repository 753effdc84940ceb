/*
 * durable.h - making a finished file survive a crash or power loss: fsync of a file named by path,
 * and rename(2) followed by an fsync of the directory that holds the new name; and the mkdir -p that
 * every writer runs first.
 *
 * The pattern every writer of this project follows: write to `name.tmp.<pid>`, fsync it (so its
 * blocks are on disk before it gets the final name), rename it over `name`, then fsync the directory
 * (so the rename itself is on disk). Used by data/shard.c, data/prep.c and train/weights_io.c.
 */
#ifndef FP8MOE_DURABLE_H
#define FP8MOE_DURABLE_H

#include <stddef.h>

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
