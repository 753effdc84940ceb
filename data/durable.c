/*
 * durable.c - fsync by path and rename with a directory fsync (see durable.h).
 */
#include "data/durable.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
