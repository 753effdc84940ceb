/*
 * copy.c - CPU strided block copies (kernels.h copy_block, broadcast_rows, sum_row_groups): the glue that
 * slices MLA vectors into heads and rope/nope parts, and spreads the one rope key over every head (and sums
 * the heads' gradients back). Parallel over source rows; each element written by one thread, and each sum
 * taken in a fixed order, so the result does not depend on the thread count.
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

void cpu_broadcast_rows(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int repeat) {
    #pragma omp parallel for if ((long)rows * repeat * cols > 65536)
    for (int r = 0; r < rows; r++) {
        const real *s = src + (int64_t)r * src_ld;
        for (int j = 0; j < repeat; j++) {
            real *d = dst + ((int64_t)r * repeat + j) * dst_ld;
            for (int c = 0; c < cols; c++) d[c] = s[c];
        }
    }
}

// One rounded addition per source row, in j order: exactly what `repeat` accumulating copy_block calls give.
void cpu_sum_row_groups(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int repeat) {
    #pragma omp parallel for if ((long)rows * repeat * cols > 65536)
    for (int r = 0; r < rows; r++) {
        real *d = dst + (int64_t)r * dst_ld;
        for (int j = 0; j < repeat; j++) {
            const real *s = src + ((int64_t)r * repeat + j) * src_ld;
            for (int c = 0; c < cols; c++) d[c] += s[c];
        }
    }
}
