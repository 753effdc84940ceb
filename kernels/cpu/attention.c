/*
 * attention.c - CPU reference of the causal softmax attention core (attention_forward / _backward in
 * kernels.h): out = softmax(q k^T / sqrt(Dqk), causal) v per batch row and head, with the probabilities
 * materialised in att (B, H, T, T) for the backward pass. att is the CPU form of kernels.h's backward
 * "state" (attention_state_elems(DEVICE_CPU, ...) = B*H*T*T); the CUDA op keeps only a (B, H, T)
 * log-sum-exp per query row and recomputes the probabilities (kernels/cuda/attention.cu).
 *
 * Each (b, h) pair is independent and writes only its own slices of out, att, dq, dk and dv, so OpenMP
 * splits over (b, h) and every output element is computed by one thread in a fixed order (sums over
 * the key/value position t2 or the head dimension in increasing order): bitwise identical for any
 * thread count. To let the compiler vectorise without reordering any sum, the score loop runs over
 * the key position t2 innermost against a transposed copy of k (and of v in the backward pass), so
 * each score is still summed over d in order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include "kernels/cpu/cpu_ops.h"

static real *alloc_or_die(size_t count, const char *what) {
    real *p = malloc(sizeof(real) * (count > 0 ? count : 1));
    if (!p) {
        fprintf(stderr, "fp8moe: kernels/cpu/attention.c:%d: out of memory allocating %zu values for %s\n",
                __LINE__, count, what);
        exit(1);
    }
    return p;
}

// Row (b, t, h) of a (B, T, H, D) tensor.
static inline size_t row_index(int b, int t, int h, int T, int H, int D) {
    return (((size_t)b * T + t) * H + h) * D;
}

// xT (D, T) = x[b, :, h, :] transposed, so that a loop over t2 reads contiguous memory.
static void transpose_head(real *xT, const real *x, int b, int h, int T, int H, int D) {
    for (int t2 = 0; t2 < T; t2++) {
        const real *row = x + row_index(b, t2, h, T, H, D);
        for (int d = 0; d < D; d++) xT[(size_t)d * T + t2] = row[d];
    }
}

// ---------------------------------------------------------------------------- forward
// q, k (B, T, H, Dqk), v (B, T, H, Dv) -> out (B, T, H, Dv), att (B, H, T, T).
// For each (b, h, t):
//   score[t2] = (sum_d q[t, d] * k[t2, d]) * scale,  scale = 1/sqrt(Dqk),  t2 <= t
//   att[t, t2] = exp(score[t2] - max) / sum_t2' exp(score[t2'] - max), 0 for t2 > t
//   out[t, :] = sum_{t2 <= t} att[t, t2] * v[t2, :]
void cpu_attention_forward(real *out, real *att, const real *q, const real *k, const real *v, int B, int T,
                           int H, int Dqk, int Dv) {
    const real scale = (real)1 / sqrt((real)Dqk);
#pragma omp parallel if ((double)B * H * T * T * (Dqk + Dv) > 65536.0)
    {
        real *kT = alloc_or_die((size_t)Dqk * T, "attention_forward transposed k");
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            const int b = bh / H, h = bh % H;
            transpose_head(kT, k, b, h, T, H, Dqk);
            for (int t = 0; t < T; t++) {
                const real *qt = q + row_index(b, t, h, T, H, Dqk);
                real *p = att + ((size_t)bh * T + t) * T;
                for (int t2 = 0; t2 <= t; t2++) p[t2] = 0;
                for (int d = 0; d < Dqk; d++) {
                    const real qd = qt[d];
                    const real *kd = kT + (size_t)d * T;
#pragma omp simd
                    for (int t2 = 0; t2 <= t; t2++) p[t2] += qd * kd[t2];
                }
                real maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    p[t2] *= scale;
                    if (p[t2] > maxval) maxval = p[t2];
                }
                real sum = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    p[t2] = exp(p[t2] - maxval);
                    sum += p[t2];
                }
#pragma omp simd
                for (int t2 = 0; t2 <= t; t2++) p[t2] = p[t2] / sum;
                for (int t2 = t + 1; t2 < T; t2++) p[t2] = 0;

                real *ot = out + row_index(b, t, h, T, H, Dv);
                for (int d = 0; d < Dv; d++) ot[d] = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const real a = p[t2];
                    const real *vt2 = v + row_index(b, t2, h, T, H, Dv);
#pragma omp simd
                    for (int d = 0; d < Dv; d++) ot[d] += a * vt2[d];
                }
            }
        }
        free(kT);
    }
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out[t] = sum_t2 att[t, t2] v[t2] with att = softmax(scale * q k^T), so
// for each (b, h, t), with g = dout[t]:
//   datt[t2]  = sum_d g[d] v[t2, d]                   dv[t2] += att[t, t2] * g
//   dscore[t2] = att[t, t2] * (datt[t2] - sum_j att[t, j] datt[j])      (softmax backward)
//   dq[t] += scale * sum_t2 dscore[t2] k[t2];        dk[t2] += scale * dscore[t2] q[t]
// dq, dk (B, T, H, Dqk), dv (B, T, H, Dv) are WRITTEN (kernels.h); any may be NULL. Gradients of one (b, h)
// are summed in thread-local buffers from 0 (dk and dv over t in increasing order) and stored once.
void cpu_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *att, const real *q,
                            const real *k, const real *v, int B, int T, int H, int Dqk, int Dv) {
    if (!dq && !dk && !dv) return;
    const real scale = (real)1 / sqrt((real)Dqk);
#pragma omp parallel if ((double)B * H * T * T * (Dqk + Dv) > 65536.0)
    {
        real *vT = alloc_or_die((size_t)Dv * T, "attention_backward transposed v");
        real *dscore = alloc_or_die((size_t)T, "attention_backward score gradient");
        real *dq_t = alloc_or_die((size_t)Dqk, "attention_backward dq row");
        real *dk_local = alloc_or_die((size_t)T * Dqk, "attention_backward dk");
        real *dv_local = alloc_or_die((size_t)T * Dv, "attention_backward dv");
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            const int b = bh / H, h = bh % H;
            transpose_head(vT, v, b, h, T, H, Dv);
            memset(dk_local, 0, sizeof(real) * (size_t)T * Dqk);
            memset(dv_local, 0, sizeof(real) * (size_t)T * Dv);
            for (int t = 0; t < T; t++) {
                const real *p = att + ((size_t)bh * T + t) * T;
                const real *g = dout + row_index(b, t, h, T, H, Dv);
                if (dv) {
                    for (int t2 = 0; t2 <= t; t2++) {
                        const real a = p[t2];
                        real *dvt2 = dv_local + (size_t)t2 * Dv;
#pragma omp simd
                        for (int d = 0; d < Dv; d++) dvt2[d] += a * g[d];
                    }
                }
                if (!dq && !dk) continue;
                // datt, kept in dscore
                for (int t2 = 0; t2 <= t; t2++) dscore[t2] = 0;
                for (int d = 0; d < Dv; d++) {
                    const real gd = g[d];
                    const real *vd = vT + (size_t)d * T;
#pragma omp simd
                    for (int t2 = 0; t2 <= t; t2++) dscore[t2] += gd * vd[t2];
                }
                real pdot = 0;
                for (int t2 = 0; t2 <= t; t2++) pdot += p[t2] * dscore[t2];
#pragma omp simd
                for (int t2 = 0; t2 <= t; t2++) dscore[t2] = (p[t2] * (dscore[t2] - pdot)) * scale;

                const real *qt = q + row_index(b, t, h, T, H, Dqk);
                if (dq) {
                    for (int d = 0; d < Dqk; d++) dq_t[d] = 0;
                    for (int t2 = 0; t2 <= t; t2++) {
                        const real s = dscore[t2];
                        const real *kt2 = k + row_index(b, t2, h, T, H, Dqk);
#pragma omp simd
                        for (int d = 0; d < Dqk; d++) dq_t[d] += s * kt2[d];
                    }
                    real *dqt = dq + row_index(b, t, h, T, H, Dqk);
#pragma omp simd
                    for (int d = 0; d < Dqk; d++) dqt[d] = dq_t[d];
                }
                if (dk) {
                    for (int t2 = 0; t2 <= t; t2++) {
                        const real s = dscore[t2];
                        real *dkt2 = dk_local + (size_t)t2 * Dqk;
#pragma omp simd
                        for (int d = 0; d < Dqk; d++) dkt2[d] += s * qt[d];
                    }
                }
            }
            for (int t2 = 0; t2 < T; t2++) {
                if (dk) {
                    real *dst = dk + row_index(b, t2, h, T, H, Dqk);
                    const real *src = dk_local + (size_t)t2 * Dqk;
#pragma omp simd
                    for (int d = 0; d < Dqk; d++) dst[d] = src[d];
                }
                if (dv) {
                    real *dst = dv + row_index(b, t2, h, T, H, Dv);
                    const real *src = dv_local + (size_t)t2 * Dv;
#pragma omp simd
                    for (int d = 0; d < Dv; d++) dst[d] = src[d];
                }
            }
        }
        free(vT);
        free(dscore);
        free(dq_t);
        free(dk_local);
        free(dv_local);
    }
}
