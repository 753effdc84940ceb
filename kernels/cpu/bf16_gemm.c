/*
 * bf16_gemm.c - the BF16 baseline GEMMs (bf16_matmul_forward / bf16_matmul_backward in kernels.h):
 * what every FP8 GEMM of the recipe becomes in precision = bf16 mode (DESIGN.md section 4).
 *
 * The operands are rounded to BF16 (round-to-nearest-even, float_to_bf16) into scratch copies and the
 * product runs through the CPU reference matmul (kernels/cpu/matmul.c), which sums over the contraction
 * axis in increasing order, one output element per thread. A product of two BF16 values (8 significant
 * bits each) is exact in FP32, so in the FP32 build this is exactly "BF16 products, FP32 accumulation
 * in a fixed order"; Fprop and Dgrad outputs are then rounded to BF16, Wgrad's FP32 sum is added to
 * dweight. (In the gradient-check build, real = double, the accumulation is in double.)
 */
#include <stdlib.h>

#include "kernels/cpu/cpu_ops.h"

static real bf16_round(real x) { return (real)bf16_to_float(float_to_bf16((float)x)); }

// dst (n) = bf16(src); src may be NULL (operand not needed), then dst is NULL.
static real *bf16_copy(const real *src, size_t n, const char *what) {
    if (!src) return NULL;
    real *dst = cpu_values_or_die(n, what);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) dst[i] = bf16_round(src[i]);
    return dst;
}

// inp (N, C), weight (OC, C) -> out (N, OC) = bf16(bf16(inp) @ bf16(weight)^T).
void cpu_bf16_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC) {
    real *inp_b = bf16_copy(inp, (size_t)N * C, "BF16 copy of inp");
    real *weight_b = bf16_copy(weight, (size_t)OC * C, "BF16 copy of weight");
    cpu_matmul_forward(out, inp_b, weight_b, N, C, OC);
    const size_t n = (size_t)N * OC;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) out[i] = bf16_round(out[i]);
    free(inp_b);
    free(weight_b);
}

// In the forward pass this was out = inp @ weight^T, so with all operands rounded to BF16:
//   dinp (N, C)     += bf16(bf16(dout) @ bf16(weight))     (the BF16 Dgrad output is added once)
//   dweight (OC, C) += bf16(dout)^T @ bf16(inp)            (FP32 sum over N, added once)
// store = GRAD_WRITE writes dinp = bf16(...) instead (cpu_bf16_gemm_dgrad_grouped).
static void bf16_backward(real *dinp, GradStore store, real *dweight, const real *dout, const real *inp,
                          const real *weight, int N, int C, int OC) {
    real *dout_b = bf16_copy(dout, (size_t)N * OC, "BF16 copy of dout");
    if (dinp) {
        real *weight_b = bf16_copy(weight, (size_t)OC * C, "BF16 copy of weight");
        real *dx = cpu_values_or_die((size_t)N * C, "BF16 Dgrad result");
        const size_t n = (size_t)N * C;
        for (size_t i = 0; i < n; i++) dx[i] = 0;
        cpu_matmul_backward(dx, NULL, dout_b, NULL, weight_b, N, C, OC);  // dx = 0 + sum: the plain sum
#pragma omp parallel for schedule(static) if (n > 65536)
        for (size_t i = 0; i < n; i++) dinp[i] = store == GRAD_WRITE ? bf16_round(dx[i]) : dinp[i] + bf16_round(dx[i]);
        free(dx);
        free(weight_b);
    }
    if (dweight) {
        real *inp_b = bf16_copy(inp, (size_t)N * C, "BF16 copy of inp");
        cpu_matmul_backward(NULL, dweight, dout_b, inp_b, NULL, N, C, OC);
        free(inp_b);
    }
    free(dout_b);
}

void cpu_bf16_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                              int N, int C, int OC) {
    bf16_backward(dinp, GRAD_ADD, dweight, dout, inp, weight, N, C, OC);
}

// ---------------------------------------------------------------------------- pre-rounded operands
// The same GEMMs on operands already rounded to BF16 (uint16_t bits, kernels.h bf16_gemm_*): train/linear.c
// rounds an activation once for every Linear and group that reads it, and keeps each weight's BF16 copy
// per weights version. Expanding BF16 to real is exact, and rounding a BF16 value again changes nothing,
// so these give the bits of bf16_matmul_forward / _backward on the unrounded operands.
void cpu_bf16_round_array(uint16_t *dst, const real *src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16((float)src[i]);
}

void cpu_bf16_widen_array(real *dst, const uint16_t *src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dst[i] = (real)bf16_to_float(src[i]);
}

void cpu_bf16_round_rows(uint16_t *dst, const real *src, const int *rows, int n_rows, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)n_rows * C > 65536)
    for (int r = 0; r < n_rows; r++) {
        const real *x = src + (size_t)rows[r] * C;
        for (int c = 0; c < C; c++) dst[(size_t)r * C + c] = float_to_bf16((float)x[c]);
    }
}

static real *bf16_expand(const uint16_t *src, size_t n, const char *what) {
    real *dst = cpu_values_or_die(n, what);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) dst[i] = (real)bf16_to_float(src[i]);
    return dst;
}

// bf16_matmul_* with the (N, OC) side in BF16 bits (the output head): the forward's result is BF16-valued, so
// storing its bits is exact; dout's values are BF16 already, so bf16_backward's rounding of them changes nothing.
void cpu_bf16_matmul_forward_bf16(uint16_t *out, const real *inp, const real *weight, int N, int C, int OC) {
    real *v = cpu_values_or_die((size_t)N * OC, "BF16 Fprop output");
    cpu_bf16_matmul_forward(v, inp, weight, N, C, OC);
    cpu_bf16_round_array(out, v, (int64_t)N * OC);
    free(v);
}

void cpu_bf16_matmul_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                                   const real *weight, int N, int C, int OC) {
    real *g = bf16_expand(dout, (size_t)N * OC, "BF16 output gradient");
    bf16_backward(dinp, GRAD_ADD, dweight, g, inp, weight, N, C, OC);
    free(g);
}

void cpu_bf16_gemm_fprop_grouped(real *y, const uint16_t *x, const uint16_t *const *w, int n_seg, const int *rows0,
                                 int N, int K) {
    for (int g = 0; g < n_seg; g++) {
        const int r0 = rows0[g], n = rows0[g + 1] - rows0[g];
        if (n <= 0) continue;
        real *xf = bf16_expand(x + (size_t)r0 * K, (size_t)n * K, "BF16 Fprop input");
        real *wf = bf16_expand(w[g], (size_t)N * K, "BF16 Fprop weight");
        cpu_bf16_matmul_forward(y + (size_t)r0 * N, xf, wf, n, K, N);
        free(xf);
        free(wf);
    }
}

void cpu_bf16_gemm_dgrad_grouped(real *dx, GradStore store, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                 const int *rows0, int N, int K) {
    for (int g = 0; g < n_seg; g++) {
        const int r0 = rows0[g], n = rows0[g + 1] - rows0[g];
        if (n <= 0) continue;
        real *dyf = bf16_expand(dy + (size_t)r0 * N, (size_t)n * N, "BF16 Dgrad dY");
        real *wf = bf16_expand(w[g], (size_t)N * K, "BF16 Dgrad weight");
        bf16_backward(dx + (size_t)r0 * K, store, NULL, dyf, NULL, wf, n, K, N);
        free(dyf);
        free(wf);
    }
}

void cpu_bf16_gemm_wgrad(real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K) {
    if (T <= 0) return;
    real *dyf = bf16_expand(dy, (size_t)T * N, "BF16 Wgrad dY");
    real *xf = bf16_expand(x, (size_t)T * K, "BF16 Wgrad X");
    cpu_bf16_matmul_backward(NULL, dw, dyf, xf, NULL, T, K, N);
    free(dyf);
    free(xf);
}

// kernels.h's *_grouped_bf16 forms: the FP32-output GEMMs above, their (BF16-valued) results stored as BF16 bits in
// rows of stride bf16_rows_ld.
void cpu_bf16_gemm_fprop_grouped_bf16(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                      const int *rows0, int N, int K) {
    const int rows = n_seg > 0 ? rows0[n_seg] : 0;
    if (rows <= 0 || N <= 0) return;
    real *v = cpu_values_or_die((size_t)rows * N, "BF16 Fprop output");
    cpu_bf16_gemm_fprop_grouped(v, x, w, n_seg, rows0, N, K);
    cpu_bf16_rows_round(y, bf16_rows_ld(N), v, rows, N);
    free(v);
}

void cpu_bf16_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                      const int *rows0, int N, int K) {
    const int rows = n_seg > 0 ? rows0[n_seg] : 0;
    if (rows <= 0 || K <= 0) return;
    real *v = cpu_values_or_die((size_t)rows * K, "BF16 Dgrad output");
    cpu_bf16_gemm_dgrad_grouped(v, GRAD_WRITE, dy, w, n_seg, rows0, N, K);
    cpu_bf16_rows_round(dx, bf16_rows_ld(K), v, rows, K);
    free(v);
}
