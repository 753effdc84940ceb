/*
 * run_dir.h - the output locations of one training run, made safe before its first step.
 *
 * A run writes its weights and metrics into checkpoint.dir (and the metrics wherever log.jsonl says).
 * Checked only when the first write happens, a read-only directory, a second run sharing it, or a
 * log.jsonl that names the job file would cost the user the run or another file. So before the data
 * and the model are touched, run_dir_open:
 *   - creates the directory and takes an exclusive lock on DIR/.lock (flock; the file holds the pid):
 *     a second live run on the same directory is refused, naming the pid that holds it;
 *   - proves the directory writable by creating and removing a file in it;
 *   - removes the `<output>.tmp.<pid>` files that a killed run left (the lock says no live run owns them);
 *   - keeps an earlier run's outputs as `<stem>.prev<ext>` (weights.prev.h5), saying so, instead of
 *     replacing them without a word.
 * The lock is released when the process ends, whatever way it ends, so a crash never leaves the
 * directory locked.
 *
 * Every function prints what it did to stdout (the kept and removed files) and returns -1 with one
 * line in err, naming the path, what was found and what was expected, on failure.
 */
#ifndef FP8MOE_RUN_DIR_H
#define FP8MOE_RUN_DIR_H

#include <stddef.h>

typedef struct {
    int held;     // 1 while the lock is held (a zeroed RunDir holds nothing)
    int lock_fd;
    char dir[1024];
} RunDir;

// Opens dir for a run that will write the files named in outputs (plain names inside dir, e.g.
// "weights.h5"). Returns 0 with the lock held, or -1 (err set, nothing held).
int run_dir_open(RunDir *rd, const char *dir, const char *const *outputs, int n_outputs, char *err,
                 size_t err_size);
// Releases the lock; does nothing when none is held.
void run_dir_close(RunDir *rd);

// If path exists, renames it to `<stem>.prev<ext>` beside it (replacing an older .prev) and prints
// `what: kept the earlier run's PATH as PREV`. Returns 0 (also when path does not exist), or -1.
int run_dir_keep_previous(const char *path, const char *what, char *err, size_t err_size);
// The name run_dir_keep_previous keeps path under (`<stem>.prev<ext>`) into out. Returns 0, or -1 when it does not
// fit.
int run_dir_previous_name(const char *path, char *out, size_t size);

#endif
