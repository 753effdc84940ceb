/*
 * run_dir.c - locking, checking and tidying a run's output directory before the first step (see
 * run_dir.h for what and why).
 *
 * The lock is flock(2) on DIR/.lock: the kernel drops it when the process ends, however it ends, so
 * no stale-lock logic is needed; the pid written into the file only makes the refusal message useful.
 */
#include "train/run_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"

// "a/weights.h5" -> "a/weights.prev.h5"; "a/metrics" -> "a/metrics.prev". The extension is the part
// after the last '.' of the file name (not of a directory).
int run_dir_previous_name(const char *path, char *out, size_t size) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *dot = strrchr(base, '.');
    int n;
    if (dot && dot != base) n = snprintf(out, size, "%.*s.prev%s", (int)(dot - path), path, dot);
    else n = snprintf(out, size, "%s.prev", path);
    return n < 0 || (size_t)n >= size ? -1 : 0;
}

int run_dir_keep_previous(const char *path, const char *what, char *err, size_t err_size) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0;  // nothing earlier to keep
    if (!S_ISREG(st.st_mode)) return 0;   // devices (/dev/null) and the like are written, not kept
    if (st.st_size == 0) return 0;        // an empty file holds nothing to lose
    char prev[1100];
    if (run_dir_previous_name(path, prev, sizeof prev) != 0) {
        snprintf(err, err_size, "%s: path too long to keep the earlier run's file beside it", path);
        return -1;
    }
    if (rename(path, prev) != 0) {
        snprintf(err, err_size, "%s: cannot keep the earlier run's file as %s: %s", path, prev, strerror(errno));
        return -1;
    }
    printf("%s: kept the earlier run's %s as %s (replacing any older one)\n", what, path, prev);
    return 0;
}

// Removes DIR/<output>.tmp.* left by a run that was killed while writing output. Called with the
// directory's lock held, so no live run is writing them.
static void remove_stale_temps(const char *dir, const char *const *outputs, int n_outputs) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        for (int i = 0; i < n_outputs; i++) {
            size_t len = strlen(outputs[i]);
            if (strncmp(e->d_name, outputs[i], len) != 0 || strncmp(e->d_name + len, ".tmp.", 5) != 0) continue;
            char path[1400];
            if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
            if (unlink(path) == 0) printf("checkpoint.dir: removed %s, left by an interrupted earlier run\n", path);
        }
    }
    closedir(d);
}

int run_dir_open(RunDir *rd, const char *dir, const char *const *outputs, int n_outputs, char *err,
                 size_t err_size) {
    memset(rd, 0, sizeof *rd);
    rd->lock_fd = -1;
    if (snprintf(rd->dir, sizeof rd->dir, "%s", dir) >= (int)sizeof rd->dir) {
        snprintf(err, err_size, "%s: path too long", dir);
        return -1;
    }
    if (durable_make_dirs(dir, err, err_size) != 0) return -1;

    char lock_path[1100];
    snprintf(lock_path, sizeof lock_path, "%s/.lock", dir);
    int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, err_size, "%s: cannot create the run's lock file %s: %s (expected a writable directory)",
                 dir, lock_path, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int saved = errno;
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        if (n > 0) pid[n] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        close(fd);
        if (saved == EWOULDBLOCK)
            snprintf(err, err_size, "%s is in use by another fp8moe run (pid %s holds %s); wait for it to end or "
                     "choose another checkpoint.dir", dir, pid[0] ? pid : "unknown", lock_path);
        else snprintf(err, err_size, "%s: cannot lock %s: %s", dir, lock_path, strerror(saved));
        return -1;
    }
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
        snprintf(err, err_size, "%s: cannot write %s: %s (expected a writable directory with free space)", dir,
                 lock_path, strerror(errno));
        close(fd);
        return -1;
    }
    // The lock file may have existed already: creating a new file proves the directory itself is
    // writable (the final rename of weights.h5 needs that), not only that one file.
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/.write-test.%ld", dir, (long)getpid());
    int pfd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (pfd < 0) {
        snprintf(err, err_size, "%s: the directory is not writable: creating %s failed: %s", dir, probe,
                 strerror(errno));
        close(fd);
        return -1;
    }
    close(pfd);
    unlink(probe);
    rd->lock_fd = fd;
    rd->held = 1;
    remove_stale_temps(dir, outputs, n_outputs);
    return 0;
}

void run_dir_close(RunDir *rd) {
    if (!rd->held) return;
    close(rd->lock_fd);  // releases the flock
    rd->held = 0;
    rd->lock_fd = -1;
}
