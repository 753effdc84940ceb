/*
 * durable.c - fsync by path, rename with a directory fsync, mkdir -p (see durable.h).
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
