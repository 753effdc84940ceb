/*
 * error.h - the project's one way to report a failure into a caller's buffer: set_err writes one line
 * into err (at most err_size bytes, always terminated, never overflowing) in printf's format. Every
 * function that returns -1 "with err set" fills it through here, so no file keeps its own copy.
 * Lives in kernels/, the lowest floor, so that every folder above may use it.
 */
#ifndef FP8MOE_ERROR_H
#define FP8MOE_ERROR_H

#include <stddef.h>

// Formats into err; does nothing when err is NULL or err_size is 0.
void set_err(char *err, size_t err_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
