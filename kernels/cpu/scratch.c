/*
 * scratch.c - the CPU reference ops' temporary arrays (transposed operands, widened BF16 rows, per-row
 * partials): one allocation helper that stops the process with a message naming the array when memory runs
 * out, so no op carries its own copy of that check.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_ops.h"

real *cpu_values_or_die(size_t count, const char *what) {
    real *p = malloc((count > 0 ? count : 1) * sizeof(real));
    if (p == NULL) {
        fprintf(stderr, "fp8moe: kernels/cpu: out of memory allocating %zu values for %s\n", count, what);
        exit(1);
    }
    return p;
}
