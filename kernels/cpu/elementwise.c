/*
 * elementwise.c - CPU reference of the row-wise and element-wise ops of kernels.h: embedding lookup,
 * RMSNorm, SwiGLU and interleaved RoPE, forward and backward.
 *
 * These are memory-bound and cheap next to the matmuls, so the code stays close to the maths: one
 * OpenMP loop over rows (or elements), and where a gradient sums over rows (embedding table, RMSNorm
 * weight) the loop is split over columns instead, so each gradient element is summed by one thread over
 * the rows in order. Results are therefore bitwise identical for any thread count. Arithmetic is in
 * `real` (tgmath picks expf/sqrtf in the FP32 build), except the RoPE angles, which are computed in
 * double so that large positions keep their phase.
 */
#include <stdio.h>
#include <stdlib.h>
#include <tgmath.h>

#include "kernels/cpu/cpu_ops.h"

// Below this many elements an op runs on the calling thread: waking the team would cost more.
#define PARALLEL_MIN_ELEMENTS 16384
// Column chunk for gradients that are reductions over rows (one thread owns a chunk of columns).
#define COLUMN_CHUNK 64

// ---------------------------------------------------------------------------- embedding
// tokens (N) int32, table (V, C) -> out (N, C) = table[tokens[n]]. V is not passed, so only the lower
// bound of a token id can be checked here; the data loader validates ids against the vocabulary.
static void check_tokens(const char *op, const int *tokens, int N) {
    for (int n = 0; n < N; n++) {
        if (tokens[n] < 0) {
            fprintf(stderr, "fp8moe: kernels/cpu/elementwise.c:%d: %s: token %d at row %d is negative; "
                            "expected an id in [0, vocab_size)\n", __LINE__, op, tokens[n], n);
            exit(1);
        }
    }
}

void cpu_embedding_forward(real *out, const int *tokens, const real *table, int N, int C) {
    check_tokens("embedding_forward", tokens, N);
#pragma omp parallel for schedule(static) if ((int64_t)N * C >= PARALLEL_MIN_ELEMENTS)
    for (int n = 0; n < N; n++) {
        const real *row = table + (size_t)tokens[n] * C;
        real *o = out + (size_t)n * C;
#pragma omp simd
        for (int c = 0; c < C; c++) o[c] = row[c];
    }
}

// In the forward pass this was out[n] = table[tokens[n]], so dtable[tokens[n]] += dout[n].
// dtable (V, C), dout (N, C). Two rows may share a token, so threads split the columns, not the rows;
// within a column chunk rows are added in token order n = 0..N-1.
void cpu_embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C) {
    if (!dtable) return;
    check_tokens("embedding_backward", tokens, N);
    const int n_chunks = (C + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
#pragma omp parallel for schedule(static) if ((int64_t)N * C >= PARALLEL_MIN_ELEMENTS)
    for (int chunk = 0; chunk < n_chunks; chunk++) {
        const int c0 = chunk * COLUMN_CHUNK;
        const int c1 = c0 + COLUMN_CHUNK < C ? c0 + COLUMN_CHUNK : C;
        for (int n = 0; n < N; n++) {
            real *d = dtable + (size_t)tokens[n] * C;
            const real *g = dout + (size_t)n * C;
#pragma omp simd
            for (int c = c0; c < c1; c++) d[c] += g[c];
        }
    }
}

// ---------------------------------------------------------------------------- RMSNorm
// inp (N, C), weight (C) -> out (N, C) = (inp * rstd) * weight, rstd (N) = 1 / sqrt(mean(inp^2) + eps).
// The sum of squares runs over c in order in `real`.
void cpu_rmsnorm_row(real *out, const real *x, real rstd, const real *weight, int C) {
#pragma omp simd
    for (int c = 0; c < C; c++) out[c] = (x[c] * rstd) * weight[c];
}

void cpu_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C >= PARALLEL_MIN_ELEMENTS)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        real sumsq = 0;
        for (int c = 0; c < C; c++) sumsq += x[c] * x[c];
        const real r = (real)1 / sqrt(sumsq / (real)C + (real)RMSNORM_EPS);
        if (out) cpu_rmsnorm_row(out + (size_t)n * C, x, r, weight, C);
        rstd[n] = r;
    }
}

// In the forward pass this was y_c = x_c * r * w_c with r = (mean(x^2) + eps)^(-1/2), and
// dr/dx_c = -r^3 x_c / C, so:
//   dweight_c += sum_n dout_nc * x_nc * r_n
//   dinp_c    += r * (w_c dout_c - x_c * r^2 * (sum_j dout_j w_j x_j) / C)
// dinp is parallel over rows; dweight over column chunks, each summing its rows in order into a local
// buffer that is added to dweight once.
void cpu_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                          const real *rstd, int N, int C) {
    const int parallel = (int64_t)N * C >= PARALLEL_MIN_ELEMENTS;
    if (dinp) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int n = 0; n < N; n++) {
            const real *x = inp + (size_t)n * C;
            const real *g = dout + (size_t)n * C;
            real *dx = dinp + (size_t)n * C;
            const real r = rstd[n];
            real dot = 0; // sum_j dout_j w_j x_j
            for (int c = 0; c < C; c++) dot += (g[c] * weight[c]) * x[c];
            const real coef = (r * r) * (dot / (real)C);
#pragma omp simd
            for (int c = 0; c < C; c++) dx[c] += r * (g[c] * weight[c] - x[c] * coef);
        }
    }
    if (dweight) {
        const int n_chunks = (C + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
#pragma omp parallel for schedule(static) if (parallel)
        for (int chunk = 0; chunk < n_chunks; chunk++) {
            const int c0 = chunk * COLUMN_CHUNK;
            const int width = c0 + COLUMN_CHUNK < C ? COLUMN_CHUNK : C - c0;
            real sum[COLUMN_CHUNK] = {0};
            for (int n = 0; n < N; n++) {
                const real *x = inp + (size_t)n * C + c0;
                const real *g = dout + (size_t)n * C + c0;
                const real r = rstd[n];
#pragma omp simd
                for (int c = 0; c < width; c++) sum[c] += g[c] * (x[c] * r);
            }
            for (int c = 0; c < width; c++) dweight[c0 + c] += sum[c];
        }
    }
}

// dout as n_src sources of BF16 rows of stride ld: widened (exactly) into a scratch array and added in order, then
// the FP32 backward.
void cpu_rmsnorm_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src,
                               int64_t src_stride, const real *inp, const real *weight, const real *rstd, int N,
                               int C) {
    if (N <= 0 || C <= 0) return;
    real *wide = cpu_bf16_rows_widened(dout, ld, N, C);
    for (int i = 1; i < n_src; i++) cpu_bf16_rows_add(wide, dout + i * src_stride, ld, N, C);
    cpu_rmsnorm_backward(dinp, dweight, wide, inp, weight, rstd, N, C);
    free(wide);
}

// ---------------------------------------------------------------------------- SwiGLU
// a, b (n) -> out (n) = silu(a) * b, silu(a) = a * sigmoid(a) = a / (1 + exp(-a)).
void cpu_swiglu_forward(real *out, const real *a, const real *b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < n; i++) {
        const real sig = (real)1 / ((real)1 + exp(-a[i]));
        out[i] = (a[i] * sig) * b[i];
    }
}

// In the forward pass this was out = silu(a) * b, so with s = sigmoid(a):
//   db = dout * silu(a);   da = dout * b * silu'(a),  silu'(a) = s * (1 + a * (1 - s)).
// WRITES da and db (either may be NULL): a and b feed only this product, so nothing else adds to their
// gradients and the callers need neither a memset nor a read of the old values.
void cpu_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < n; i++) {
        const real sig = (real)1 / ((real)1 + exp(-a[i]));
        if (da) da[i] = (dout[i] * b[i]) * (sig * ((real)1 + a[i] * ((real)1 - sig)));
        if (db) db[i] = dout[i] * (a[i] * sig);
    }
}

// kernels.h swiglu_forward_bf16 / swiglu_backward_bf16: the ops above on the widened rows, the results rounded.
void cpu_swiglu_forward_bf16(uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width) {
    const int64_t n = (int64_t)rows * width, ld = bf16_rows_ld(width);
    if (n <= 0) return;
    real *av = cpu_bf16_rows_widened(a, ld, rows, width), *bv = cpu_bf16_rows_widened(b, ld, rows, width);
    real *hv = cpu_values_or_die((size_t)n, "SwiGLU h");
    cpu_swiglu_forward(hv, av, bv, n);
    cpu_bf16_round_array(h, hv, n);
    free(av);
    free(bv);
    free(hv);
}

void cpu_swiglu_backward_bf16(uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh, const uint16_t *a,
                              const uint16_t *b, int rows, int width) {
    const int64_t n = (int64_t)rows * width, ld = bf16_rows_ld(width);
    if (n <= 0) return;
    real *av = cpu_bf16_rows_widened(a, ld, rows, width), *bv = cpu_bf16_rows_widened(b, ld, rows, width);
    real *g = cpu_bf16_rows_widened(dh, ld, rows, width);
    real *ga = cpu_values_or_die((size_t)n, "SwiGLU da"), *gb = cpu_values_or_die((size_t)n, "SwiGLU db");
    if (h != NULL) {  // from the same widened a and b, in ga before da is written there
        cpu_swiglu_forward(ga, av, bv, n);
        cpu_bf16_round_array(h, ga, n);
    }
    cpu_swiglu_backward(ga, gb, g, av, bv, n);
    cpu_bf16_round_array(da, ga, n);
    cpu_bf16_round_array(db, gb, n);
    free(av);
    free(bv);
    free(g);
    free(ga);
    free(gb);
}

// ---------------------------------------------------------------------------- RoPE
// cos/sin table (T, D/2) for angle t * theta^(-2j/D), computed in double and rounded once to `real`.
// Shared by every batch row and head. Caller frees both.
static void rope_table(real **cos_out, real **sin_out, int T, int D, real theta) {
    const int half = D / 2;
    real *cs = malloc(sizeof(real) * ((size_t)T * half + 1));
    real *sn = malloc(sizeof(real) * ((size_t)T * half + 1));
    if (!cs || !sn) {
        fprintf(stderr, "fp8moe: kernels/cpu/elementwise.c:%d: out of memory for a RoPE table of %d x %d\n",
                __LINE__, T, half);
        exit(1);
    }
    for (int j = 0; j < half; j++) {
        const double inv_freq = pow((double)theta, -2.0 * j / (double)D);
        for (int t = 0; t < T; t++) {
            const double angle = (double)t * inv_freq;
            cs[(size_t)t * half + j] = (real)cos(angle);
            sn[(size_t)t * half + j] = (real)sin(angle);
        }
    }
    *cos_out = cs;
    *sin_out = sn;
}

static void check_rope_shape(const char *op, int ld, int D) {
    if (D % 2 != 0) {
        fprintf(stderr, "fp8moe: kernels/cpu/elementwise.c:%d: %s: head dimension D = %d is odd; interleaved "
                        "RoPE rotates pairs (x[2j], x[2j+1]) and needs an even D\n", __LINE__, op, D);
        exit(1);
    }
    if (ld < D) {
        fprintf(stderr, "fp8moe: kernels/cpu/elementwise.c:%d: %s: vector stride ld = %d is below the head "
                        "dimension D = %d\n", __LINE__, op, ld, D);
        exit(1);
    }
}

// Every pair (x0, x1) = (x[2j], x[2j+1]) of the (B, T, H) vectors of D at stride ld, position = t, turned by
// sign * angle: (x0 cos - x1 sin', x0 sin' + x1 cos) with sin' = sign * sin (exact: sign is +1 or -1).
// out may alias inp: each pair is read before it is written.
static void rope_rotate(const char *op, real *out, const real *inp, int ld, int B, int T, int H, int D, real theta,
                        real sign) {
    check_rope_shape(op, ld, D);
    const int half = D / 2;
    real *cs, *sn;
    rope_table(&cs, &sn, T, D, theta);
#pragma omp parallel for schedule(static) if ((int64_t)B * T * H * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
        const real *c = cs + (size_t)(bt % T) * half;
        const real *s = sn + (size_t)(bt % T) * half;
        for (int h = 0; h < H; h++) {
            const real *x = inp + ((size_t)bt * H + h) * ld;
            real *o = out + ((size_t)bt * H + h) * ld;
            for (int j = 0; j < half; j++) {
                const real x0 = x[2 * j], x1 = x[2 * j + 1], sj = sign * s[j];
                o[2 * j] = x0 * c[j] - x1 * sj;
                o[2 * j + 1] = x0 * sj + x1 * c[j];
            }
        }
    }
    free(cs);
    free(sn);
}

// inp, out: (B, T, H) vectors of D at stride ld (kernels.h): each pair becomes the complex product
// (x0 + i x1) e^(i angle). out may alias inp.
void cpu_rope_forward(real *out, const real *inp, int ld, int B, int T, int H, int D, real theta) {
    rope_rotate("rope_forward", out, inp, ld, B, T, H, D, theta, 1);
}

// The forward rotation R(angle) is orthogonal, so its adjoint is R(-angle), written (dinp may alias dout):
//   dinp[2j] = d0 cos + d1 sin;   dinp[2j+1] = -d0 sin + d1 cos.   Layout as the forward's.
void cpu_rope_backward(real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta) {
    if (dinp) rope_rotate("rope_backward", dinp, dout, ld, B, T, H, D, theta, -1);
}
