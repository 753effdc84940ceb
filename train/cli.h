/*
 * cli.h - what the option parsers of fp8moe's subcommands share: the usage error every command prints
 * ("fp8moe CMD: what was wrong", then the command's usage, on stderr, exit status 2) and whole-string integer
 * parsing. One place, so that every command words its errors alike and a fix reaches all of them.
 */
#ifndef FP8MOE_CLI_H
#define FP8MOE_CLI_H

#define EXIT_USAGE 2  // bad usage or an invalid job file / override (train/main.c lists the exit statuses)

// Prints "fp8moe CMD: " + fmt (with its one %s taking arg) and "Usage:" + usage to stderr; returns EXIT_USAGE.
int cli_usage_error(const char *cmd, const char *usage, const char *fmt, const char *arg);

// The whole of text as a decimal integer in [lo, hi]: 0 and *out, or -1 (nothing printed) for anything else
// (empty, trailing characters, out of range, NULL).
int cli_parse_int(const char *text, int lo, int hi, int *out);

// Whether an override has the shape section.key=value (the --set of every command that reads a job file).
int cli_is_override(const char *kv);

#endif
