/*
 * copy.c - CPU strided block copies (kernels.h copy_block): the glue that slices MLA vectors into their
 * rope/nope parts and assembles MTP's concatenated inputs. Parallel over source rows; each element written by
 * one thread, so the result does not depend on the thread count.
 */
#include "kernels/cpu/cpu_ops.h"

void cpu_copy_block(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate) {
    #pragma omp parallel for if ((long)rows * cols > 65536)
    for (int r = 0; r < rows; r++) {
        real *d = dst + (int64_t)r * dst_ld;
        const real *s = src + (int64_t)r * src_ld;
        if (accumulate) {
            for (int c = 0; c < cols; c++) d[c] += s[c];
        } else {
            for (int c = 0; c < cols; c++) d[c] = s[c];
        }
    }
}
