/*
 * bench_matmul.c - GFLOP/s of the CPU reference matmul (forward, and backward dinp + dweight) at the
 * shapes of the default job, so the step benchmark can state how close the model gets to its own
 * GEMM speed on this machine. Median of repeated runs after a warm-up.
 *
 * Usage: bench_matmul [N C OC]...   (defaults: the default job's largest Linear shapes)
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/kernels.h"
#include "kernels/rng.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_seconds(int which, real *out, real *dinp, real *dw, const real *inp, const real *w, int N, int C,
                             int OC) {
    enum { RUNS = 15 };
    double t[RUNS];
    for (int r = -2; r < RUNS; r++) {  // two warm-up runs
        double t0 = omp_get_wtime();
        if (which == 0) matmul_forward(DEVICE_CPU, out, inp, w, N, C, OC);
        else matmul_backward(DEVICE_CPU, dinp, dw, out, inp, w, N, C, OC);
        if (r >= 0) t[r] = omp_get_wtime() - t0;
    }
    qsort(t, RUNS, sizeof t[0], cmp_double);
    return t[RUNS / 2];
}

int main(int argc, char **argv) {
    // default job (configs/shakespeare.ini, 16 x 128 tokens): the dense FFN and the vocabulary head
    int shapes[8][3] = {{2048, 128, 384}, {2048, 384, 128}, {2048, 128, 256}};
    int n_shapes = 3;
    if (argc > 1) {
        n_shapes = 0;
        for (int i = 1; i + 2 < argc && n_shapes < 8; i += 3, n_shapes++)
            for (int j = 0; j < 3; j++) shapes[n_shapes][j] = atoi(argv[i + j]);
    }
    printf("matmul (CPU, %d threads)      N      C     OC   forward GFLOP/s   backward GFLOP/s\n", omp_get_max_threads());
    for (int s = 0; s < n_shapes; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        real *inp = malloc(sizeof(real) * N * C), *w = malloc(sizeof(real) * OC * C);
        real *out = malloc(sizeof(real) * N * OC), *dinp = calloc((size_t)N * C, sizeof(real));
        real *dw = calloc((size_t)OC * C, sizeof(real));
        uint64_t key = rng_key(1, 2, 3, 4);
        for (int i = 0; i < N * C; i++) inp[i] = (real)rng_normal(key, (uint64_t)i);
        for (int i = 0; i < OC * C; i++) w[i] = (real)rng_normal(key, (uint64_t)(N * C + i));
        double flops = 2.0 * N * C * OC;
        double tf = median_seconds(0, out, dinp, dw, inp, w, N, C, OC);
        double tb = median_seconds(1, out, dinp, dw, inp, w, N, C, OC);
        printf("%28s %6d %6d %6d %17.1f %18.1f\n", "", N, C, OC, flops / tf * 1e-9, 2 * flops / tb * 1e-9);
        free(inp); free(w); free(out); free(dinp); free(dw);
    }
    return 0;
}
