/*
 * scratch.c - the CPU reference ops' temporary arrays (transposed operands, widened BF16 rows, per-row
 * partials): one allocation helper that stops the process with a message naming the array when memory runs
 * out, so no op carries its own copy of that check; and the errors found inside OpenMP parallel regions
 * (CpuRegionError, cpu_ops.h), which are recorded there and reported once after the region.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

real *cpu_values_or_die(size_t count, const char *what) {
    real *p = malloc((count > 0 ? count : 1) * sizeof(real));
    if (p == NULL) {
        fprintf(stderr, "fp8moe: kernels/cpu: out of memory allocating %zu values for %s\n", count, what);
        exit(1);
    }
    return p;
}

// ---------------------------------------------------------------------------- errors inside parallel regions
// exit() on a worker thread runs the process's exit handlers while the other threads still compute, and two
// threads that each find an error run them twice at once (glibc's "double free or corruption", a SIGSEGV in a
// library's handler). So a thread only records what it found, under a lock; the kept error is the one at the
// lowest `at` (a row or element index), which is the same error whatever the thread count, and the thread that
// called the op reports it after the region, once.

void cpu_region_fail(CpuRegionError *e, int64_t at, const char *fmt, ...) {
    char msg[sizeof e->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
#pragma omp critical(fp8moe_cpu_region_error)
    {
        if (!e->failed || at < e->at) {
            e->failed = 1;
            e->at = at;
            memcpy(e->msg, msg, sizeof msg);
        }
    }
}

void *cpu_region_alloc(CpuRegionError *e, size_t bytes, size_t align, const char *what) {
    void *p;
    if (align > 0) {
        const size_t rounded = (bytes + align - 1) / align * align;
        p = aligned_alloc(align, rounded > 0 ? rounded : align);
    } else {
        p = malloc(bytes > 0 ? bytes : 1);
    }
    // ahead of every error a thread finds in its rows: without its scratch a thread computes nothing
    if (p == NULL) cpu_region_fail(e, INT64_MIN, "kernels/cpu: out of memory allocating %zu bytes for %s", bytes, what);
    return p;
}

void cpu_region_check(const CpuRegionError *e) {
    if (!e->failed) return;
    fprintf(stderr, "fp8moe: %s\n", e->msg);
    exit(1);
}
