/*
 * durable.c - fsync by path, rename with a directory fsync, mkdir -p, and DurableFile, the stream written
 * to a temporary file and renamed into place (see durable.h).
 */
#include "data/durable.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int durable_fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc == 0 ? 0 : -1;
}

int durable_rename(const char *from, const char *to) {
    if (rename(from, to) != 0) return -1;
    const char *slash = strrchr(to, '/');
    char *dir = NULL;
    if (!slash) dir = strdup(".");
    else if (slash == to) dir = strdup("/");
    else dir = strndup(to, (size_t)(slash - to));
    if (!dir) {
        errno = ENOMEM;
        return -2;
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = fd >= 0 && fsync(fd) == 0 ? 0 : -2;
    int saved = errno;
    if (fd >= 0) close(fd);
    free(dir);
    errno = saved;
    return rc;
}

int durable_make_dirs(const char *dir, char *err, size_t err_size) {
    char path[1024];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path) {
        snprintf(err, err_size, "%s: path too long", dir);
        return -1;
    }
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST) {
            snprintf(err, err_size, "cannot create directory %s: %s", path, strerror(errno));
            return -1;
        }
        *p = saved;
        if (saved == '\0') break;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, err_size, "%s: exists but is not a directory", dir);
        return -1;
    }
    return 0;
}

static void durable_release(DurableFile *d) {
    free(d->path);
    free(d->tmp);
    d->path = d->tmp = NULL;
    d->f = NULL;
}

int durable_open(DurableFile *d, const char *path, char *err, size_t err_size) {
    d->f = NULL;
    d->path = strdup(path);
    const size_t tmp_len = strlen(path) + 32;
    d->tmp = malloc(tmp_len);
    if (!d->path || !d->tmp) {
        snprintf(err, err_size, "%s: out of memory", path);
        durable_release(d);
        return -1;
    }
    snprintf(d->tmp, tmp_len, "%s.tmp.%ld", path, (long)getpid());
    if (!(d->f = fopen(d->tmp, "wb"))) {
        snprintf(err, err_size, "%s: cannot create it: %s", d->tmp, strerror(errno));
        durable_release(d);
        return -1;
    }
    return 0;
}

int durable_commit(DurableFile *d, char *err, size_t err_size) {
    // fflush first: after a failed write glibc keeps the unwritten bytes, so the flush fails again and sets
    // errno to the reason (ferror alone would not say why)
    errno = 0;
    int failed = fflush(d->f) != 0 || ferror(d->f) || fsync(fileno(d->f)) != 0;
    int why = errno ? errno : EIO;
    if (fclose(d->f) != 0 && !failed) failed = 1, why = errno;
    d->f = NULL;
    if (failed) {
        snprintf(err, err_size, "%s: writing failed: %s", d->tmp, strerror(why));
        unlink(d->tmp);
        durable_release(d);
        return -1;
    }
    const int renamed = durable_rename(d->tmp, d->path);
    if (renamed == -1) {
        snprintf(err, err_size, "%s: cannot rename %s over it: %s", d->path, d->tmp, strerror(errno));
        unlink(d->tmp);
    } else if (renamed == -2) {
        snprintf(err, err_size, "%s: written, but the fsync of its directory failed: %s", d->path, strerror(errno));
    }
    durable_release(d);
    return renamed == 0 ? 0 : -1;
}

void durable_discard(DurableFile *d) {
    if (d->f) {
        fclose(d->f);
        unlink(d->tmp);
    }
    durable_release(d);
}

int durable_write_text(const char *path, const char *text, char *err, size_t err_size) {
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    fputs(text, d.f);
    return durable_commit(&d, err, err_size);
}
