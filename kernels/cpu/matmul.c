/*
 * matmul.c - the CPU reference GEMMs behind matmul_forward / matmul_backward (kernels.h).
 *
 * Every Linear of the model runs through here when training on a CPU, so this file is written for
 * speed as well as for being the numerical reference: both operands are packed into small panels and
 * a register-blocked micro-kernel (GCC/Clang vector extensions, plain IEEE multiplies and adds, no FMA
 * contraction and no reassociation) computes MR x NR output tiles, with OpenMP over output tiles.
 *
 * Numerics and determinism: every output element is owned by exactly one thread and is the sum over
 * k = 0, 1, ..., K-1 in that order, started from 0 (the same value as the naive loop
 * `s = 0; for k: s += a[k] * b[k]`). Backward ops then add that sum to the gradient buffer once
 * (grad = grad + sum). Tiling and thread count decide only who computes an element, never how, so the
 * result is bitwise identical for any number of threads and any vector width.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

// ---------------------------------------------------------------------------- micro-kernel shape
// A 16-byte vector of `real` (4 floats or 2 doubles): the width every x86-64 (SSE2) and ARM64 (NEON)
// CPU has, so the default build vectorises without -march flags. Vector ops are element-wise, so the
// per-element arithmetic is exactly the scalar arithmetic.
typedef real rvec __attribute__((vector_size(16)));
#define VEC_LEN ((int)(sizeof(rvec) / sizeof(real)))
// MR x NR tile = 6 rows x 2 vectors: 12 accumulator registers + 2 for B + 1 for the broadcast A value
// fit the 16 vector registers of SSE2 without spilling.
#define MR 6
#define NR (2 * VEC_LEN)
// Output tiles handed to one thread at a time: MC_PANELS row panels x NC_PANELS column panels. The
// A block (MC_PANELS * MR rows x K) stays in L2 while the column panels stream past it; each B panel
// (K x NR) stays in L1 while the row panels of the block use it.
#define MC_PANELS 8
#define NC_PANELS 16
#define PACK_ALIGN 64

static void *alloc_or_die(size_t bytes, const char *what) {
    size_t rounded = (bytes + PACK_ALIGN - 1) / PACK_ALIGN * PACK_ALIGN;
    void *p = aligned_alloc(PACK_ALIGN, rounded > 0 ? rounded : PACK_ALIGN);
    if (!p) {
        fprintf(stderr, "fp8moe: kernels/cpu/matmul.c:%d: out of memory allocating %zu bytes for %s\n",
                __LINE__, bytes, what);
        exit(1);
    }
    return p;
}

// ---------------------------------------------------------------------------- packing
// A (M, K) is read through strides as A(m, k) = a[m * a_rs + k * a_cs]; it is packed into
// ceil(M / MR) row panels, panel p holding ap[(p * K + k) * MR + i] = A(p * MR + i, k), zero-padded
// past row M. B (K, Ncols) is read as B(k, j) = b[k * b_rs + j * b_cs] and packed into
// ceil(Ncols / NR) column panels, bp[(q * K + k) * NR + j] = B(k, q * NR + j), zero-padded past Ncols.
// Strides let the same code serve inp, weight, weight^T and dout^T without transposed copies.
static void pack_row_panel(real *dst, const real *a, ptrdiff_t a_rs, ptrdiff_t a_cs, int row0, int rows,
                           int K) {
    for (int k = 0; k < K; k++) {
        real *d = dst + (size_t)k * MR;
        for (int i = 0; i < MR; i++) {
            d[i] = i < rows ? a[(ptrdiff_t)(row0 + i) * a_rs + (ptrdiff_t)k * a_cs] : (real)0;
        }
    }
}

static void pack_col_panel(real *dst, const real *b, ptrdiff_t b_rs, ptrdiff_t b_cs, int col0, int cols,
                           int K) {
    for (int k = 0; k < K; k++) {
        real *d = dst + (size_t)k * NR;
        for (int j = 0; j < NR; j++) {
            d[j] = j < cols ? b[(ptrdiff_t)k * b_rs + (ptrdiff_t)(col0 + j) * b_cs] : (real)0;
        }
    }
}

// ---------------------------------------------------------------------------- micro-kernel
// out tile (rows x cols, at most MR x NR, row stride ldo) = (accumulate ? out + S : S), where
// S[i][j] = sum over k in order of ap[k][i] * bp[k][j].
static void micro_kernel(real *out, ptrdiff_t ldo, const real *ap, const real *bp, int K, int rows, int cols,
                         int accumulate) {
    rvec c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    rvec c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int k = 0; k < K; k++) {
        const rvec b0 = *(const rvec *)(bp + (size_t)k * NR);
        const rvec b1 = *(const rvec *)(bp + (size_t)k * NR + VEC_LEN);
        const real *a = ap + (size_t)k * MR;
        // a vector times a scalar broadcasts the scalar: c += b * a[i], one multiply and one add
        c00 += b0 * a[0]; c01 += b1 * a[0];
        c10 += b0 * a[1]; c11 += b1 * a[1];
        c20 += b0 * a[2]; c21 += b1 * a[2];
        c30 += b0 * a[3]; c31 += b1 * a[3];
        c40 += b0 * a[4]; c41 += b1 * a[4];
        c50 += b0 * a[5]; c51 += b1 * a[5];
    }
    real tile[MR][NR];
    memcpy(&tile[0][0], &c00, sizeof(rvec)); memcpy(&tile[0][VEC_LEN], &c01, sizeof(rvec));
    memcpy(&tile[1][0], &c10, sizeof(rvec)); memcpy(&tile[1][VEC_LEN], &c11, sizeof(rvec));
    memcpy(&tile[2][0], &c20, sizeof(rvec)); memcpy(&tile[2][VEC_LEN], &c21, sizeof(rvec));
    memcpy(&tile[3][0], &c30, sizeof(rvec)); memcpy(&tile[3][VEC_LEN], &c31, sizeof(rvec));
    memcpy(&tile[4][0], &c40, sizeof(rvec)); memcpy(&tile[4][VEC_LEN], &c41, sizeof(rvec));
    memcpy(&tile[5][0], &c50, sizeof(rvec)); memcpy(&tile[5][VEC_LEN], &c51, sizeof(rvec));
    for (int i = 0; i < rows; i++) {
        real *o = out + (ptrdiff_t)i * ldo;
        if (accumulate) {
            for (int j = 0; j < cols; j++) o[j] = o[j] + tile[i][j];
        } else {
            for (int j = 0; j < cols; j++) o[j] = tile[i][j];
        }
    }
}

// ---------------------------------------------------------------------------- blocked GEMM
// out (M, Ncols), row stride ldo: out = A @ B, or out += A @ B when accumulate, with A and B read
// through the strides described at the packing functions.
static void gemm(real *out, ptrdiff_t ldo, int accumulate, const real *a, ptrdiff_t a_rs, ptrdiff_t a_cs,
                 const real *b, ptrdiff_t b_rs, ptrdiff_t b_cs, int M, int K, int Ncols) {
    if (M <= 0 || Ncols <= 0) return;
    const int m_panels = (M + MR - 1) / MR;
    const int n_panels = (Ncols + NR - 1) / NR;
    real *ap = alloc_or_die((size_t)m_panels * MR * (size_t)K * sizeof(real), "packed matmul operand A");
    real *bp = alloc_or_die((size_t)n_panels * NR * (size_t)K * sizeof(real), "packed matmul operand B");
    const int m_blocks = (m_panels + MC_PANELS - 1) / MC_PANELS;
    const int n_blocks = (n_panels + NC_PANELS - 1) / NC_PANELS;
    const long n_tiles = (long)m_blocks * n_blocks;
    // Small products are not worth waking the thread team for.
    const int parallel = (double)M * K * Ncols > 32768.0;

#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int p = 0; p < m_panels; p++) {
            int rows = M - p * MR < MR ? M - p * MR : MR;
            pack_row_panel(ap + (size_t)p * MR * K, a, a_rs, a_cs, p * MR, rows, K);
        }
#pragma omp for schedule(static)
        for (int q = 0; q < n_panels; q++) {
            int cols = Ncols - q * NR < NR ? Ncols - q * NR : NR;
            pack_col_panel(bp + (size_t)q * NR * K, b, b_rs, b_cs, q * NR, cols, K);
        }
        // Consecutive tiles share their row block, so a thread's static share reuses its A block.
#pragma omp for schedule(static)
        for (long tile = 0; tile < n_tiles; tile++) {
            const int bm = (int)(tile / n_blocks), bn = (int)(tile % n_blocks);
            const int p_end = (bm + 1) * MC_PANELS < m_panels ? (bm + 1) * MC_PANELS : m_panels;
            const int q_end = (bn + 1) * NC_PANELS < n_panels ? (bn + 1) * NC_PANELS : n_panels;
            for (int q = bn * NC_PANELS; q < q_end; q++) {
                const int cols = Ncols - q * NR < NR ? Ncols - q * NR : NR;
                for (int p = bm * MC_PANELS; p < p_end; p++) {
                    const int rows = M - p * MR < MR ? M - p * MR : MR;
                    micro_kernel(out + (ptrdiff_t)p * MR * ldo + (ptrdiff_t)q * NR, ldo,
                                 ap + (size_t)p * MR * K, bp + (size_t)q * NR * K, K, rows, cols,
                                 accumulate);
                }
            }
        }
    }
    free(ap);
    free(bp);
}

// ---------------------------------------------------------------------------- matmul ops
// inp (N, C), weight (OC, C) -> out (N, OC) = inp @ weight^T.
// A = inp (row stride C), B(k = c, j = o) = weight[o * C + c].
void cpu_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC) {
    gemm(out, OC, 0, inp, C, 1, weight, 1, C, N, C, OC);
}

// In the forward pass this was out (N, OC) = inp (N, C) @ weight (OC, C)^T, so:
//   dinp (N, C)     += dout (N, OC) @ weight (OC, C)     A = dout, B(k = o, j = c) = weight[o * C + c]
//   dweight (OC, C) += dout^T (OC, N) @ inp (N, C)       A(m = o, k = n) = dout[n * OC + o], B = inp
// Each dinp element sums over OC in order and each dweight element over N in order (one thread each).
void cpu_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                         int N, int C, int OC) {
    if (dinp) gemm(dinp, C, 1, dout, OC, 1, weight, C, 1, N, OC, C);
    if (dweight) gemm(dweight, C, 1, dout, 1, OC, inp, C, 1, OC, N, C);
}
