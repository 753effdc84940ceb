/*
 * cli.c - the usage error and integer parsing that every fp8moe subcommand's option parser shares (cli.h).
 */
#include "train/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cli_usage_error(const char *cmd, const char *usage, const char *fmt, const char *arg) {
    fprintf(stderr, "fp8moe %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nUsage:\n%s", usage);
    return EXIT_USAGE;
}

int cli_parse_int(const char *text, int lo, int hi, int *out) {
    if (!text) return -1;
    char *end;
    errno = 0;
    const long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

int cli_is_override(const char *kv) {
    const char *eq = strchr(kv, '=');
    const char *dot = strchr(kv, '.');
    return eq && dot && dot < eq && dot > kv && eq > dot + 1;
}
