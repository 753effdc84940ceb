/*
 * attention.c - CPU reference of the causal softmax attention core (attention_forward / _forward_bf16 /
 * _backward / _backward_bf16 in kernels.h): out = softmax(q k^T / sqrt(Dqk), causal) v per batch row and head, with the
 * probabilities materialised in att (B, H, T, T) for the backward pass. The CPU form of kernels.h's backward
 * "state" is att followed by copies of q, kv and k_rope (cpu_state_layout), so the backward needs nothing of the
 * forward's but the state, as on CUDA; the CUDA op keeps only a (B, H, T) log-sum-exp per query row and BF16
 * copies of its operands, and recomputes the probabilities (kernels/cuda/attention.cu).
 *
 * Keys and values are read in MLA's layout (kernels.h): the key of (t, h) is [kv[t,h,0:Dn] ; k_rope[t]],
 * its value kv[t,h,Dn:]. Each head's key is assembled only in the transposed copy below (the forward) or
 * read in its two parts (the backward's dq), element for element the same values and operations as on a
 * per-head (B, T, H, Dqk) key array.
 *
 * Each (b, h) pair is independent and writes only its own slices of out, att, dq and d_kv, and its own
 * rope-key gradient into a (B, T, H, Dr) scratch, so OpenMP splits over (b, h) and every output element
 * is computed by one thread in a fixed order (sums over the key/value position t2 or the head dimension
 * in increasing order). d_k_rope then sums the scratch over the heads in order h = 0, 1, ... from zero.
 * Bitwise identical for any thread count. To let the compiler vectorise without reordering any sum, the
 * score loop runs over the key position t2 innermost against a transposed copy of k (and of v in the
 * backward pass), so each score is still summed over d in order.
 */
#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include "kernels/cpu/cpu_ops.h"

// Start of row (b, t, h) of a (B, T, H, ld) tensor.
static inline size_t row_index(int b, int t, int h, int T, int H, int ld) {
    return (((size_t)b * T + t) * H + h) * ld;
}

// xT (D, T) = the first D columns of rows (b, :, h) of x, a (B, T, H, ld) tensor, transposed so that a loop
// over t2 reads contiguous memory. Nothing is read when D = 0 (x may then be NULL).
static void transpose_head(real *xT, const real *x, int ld, int b, int h, int T, int H, int D) {
    if (D <= 0) return;
    for (int t2 = 0; t2 < T; t2++) {
        const real *row = x + row_index(b, t2, h, T, H, ld);
        for (int d = 0; d < D; d++) xT[(size_t)d * T + t2] = row[d];
    }
}

// kT (Dn + Dr, T) = the keys of head h of batch row b transposed: rows 0..Dn-1 from kv's k_nope, rows Dn.. from
// the shared k_rope (a (B, T, 1, Dr) tensor).
static void transpose_keys(real *kT, const real *kv, const real *k_rope, int b, int h, int T, int H, int Dn, int Dr,
                           int Dv) {
    transpose_head(kT, kv, Dn + Dv, b, h, T, H, Dn);
    transpose_head(kT + (size_t)Dn * T, k_rope, Dr, b, 0, T, 1, Dr);
}

// ---------------------------------------------------------------------------- state
// The state's parts: att (B, H, T, T), then q (B, T, H, Dqk), kv (B, T, H, Dn + Dv), k_rope (B, T, Dr).
typedef struct {
    real *att, *q, *kv, *k_rope;
} CpuState;

static CpuState cpu_state_layout(const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
    CpuState s;
    s.att = (real *)state;
    s.q = s.att + (size_t)B * H * T * T;
    s.kv = s.q + (size_t)B * T * H * (Dn + Dr);
    s.k_rope = s.kv + (size_t)B * T * H * (Dn + Dv);
    return s;
}

int64_t cpu_attention_state_elems(int B, int T, int H, int Dn, int Dr, int Dv) {
    return (int64_t)B * H * T * T + (int64_t)B * T * H * (Dn + Dr) + (int64_t)B * T * H * (Dn + Dv) +
           (int64_t)B * T * Dr;
}

// dst = src (n values) unless they are the same array (attention_forward_bf16 widens into the state itself).
static void copy_into_state(real *dst, const real *src, size_t n) {
    if (n > 0 && dst != src) memcpy(dst, src, n * sizeof(real));
}

// ---------------------------------------------------------------------------- forward
// q (B, T, H, Dqk), kv (B, T, H, Dn + Dv), k_rope (B, T, Dr) -> out (B, T, H, Dv), att (B, H, T, T); Dqk = Dn + Dr,
// k[t2] = [kv[t2, h, 0:Dn] ; k_rope[t2]], v[t2] = kv[t2, h, Dn:]. For each (b, h, t):
//   score[t2] = (sum_d q[t, d] * k[t2, d]) * scale,  scale = 1/sqrt(Dqk),  t2 <= t
//   att[t, t2] = exp(score[t2] - max) / sum_t2' exp(score[t2'] - max), 0 for t2 > t
//   out[t, :] = sum_{t2 <= t} att[t, t2] * v[t2, :]
// The operands are copied into the state first and read there.
void cpu_attention_forward(real *out, real *state, const real *q_in, const real *kv_in, const real *k_rope_in, int B,
                           int T, int H, int Dn, int Dr, int Dv) {
    const int Dqk = Dn + Dr, kv_ld = Dn + Dv;
    const CpuState st = cpu_state_layout(state, B, T, H, Dn, Dr, Dv);
    copy_into_state(st.q, q_in, (size_t)B * T * H * Dqk);
    copy_into_state(st.kv, kv_in, (size_t)B * T * H * kv_ld);
    if (Dr > 0) copy_into_state(st.k_rope, k_rope_in, (size_t)B * T * Dr);
    real *att = st.att;
    const real *q = st.q, *kv = st.kv, *k_rope = st.k_rope;
    const real scale = (real)1 / sqrt((real)Dqk);
    CpuRegionError err = {0};  // a thread's scratch that cannot be allocated (scratch.c)
#pragma omp parallel if ((double)B * H * T * T * (Dqk + Dv) > 65536.0)
    {
        real *kT = cpu_region_alloc(&err, sizeof(real) * (size_t)Dqk * T, 0, "attention_forward transposed k");
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            if (kT == NULL) continue;
            const int b = bh / H, h = bh % H;
            transpose_keys(kT, kv, k_rope, b, h, T, H, Dn, Dr, Dv);
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
                    const real *vt2 = kv + row_index(b, t2, h, T, H, kv_ld) + Dn;
#pragma omp simd
                    for (int d = 0; d < Dv; d++) ot[d] += a * vt2[d];
                }
            }
        }
        free(kT);
    }
    cpu_region_check(&err);
}

// q16 and kv16 widened into the state (exactly), the query's rope part rotated there by cpu_rope_forward, then
// the forward above on the state's own copies: the bits of widening, rope_forward and attention_forward.
void cpu_attention_forward_bf16(real *out, real *state, const uint16_t *q16, int64_t ldq, const uint16_t *kv16,
                                int64_t ldkv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv,
                                real rope_theta) {
    const int Dqk = Dn + Dr, kv_ld = Dn + Dv;
    const CpuState st = cpu_state_layout(state, B, T, H, Dn, Dr, Dv);
    const int64_t N = (int64_t)B * T;
    for (int64_t n = 0; n < N; n++) {
        cpu_bf16_widen_array(st.q + n * H * Dqk, q16 + n * ldq, (int64_t)H * Dqk);
        cpu_bf16_widen_array(st.kv + n * H * kv_ld, kv16 + n * ldkv, (int64_t)H * kv_ld);
    }
    if (Dr > 0) cpu_rope_forward(st.q + Dn, st.q + Dn, Dqk, B, T, H, Dr, rope_theta);
    cpu_attention_forward(out, state, st.q, st.kv, k_rope, B, T, H, Dn, Dr, Dv);
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out[t] = sum_t2 att[t, t2] v[t2] with att = softmax(scale * q k^T), so
// for each (b, h, t), with g = dout[t]:
//   datt[t2]  = sum_d g[d] v[t2, d]                   dv[t2] += att[t, t2] * g
//   dscore[t2] = att[t, t2] * (datt[t2] - sum_j att[t, j] datt[j])      (softmax backward)
//   dq[t] += scale * sum_t2 dscore[t2] k[t2];        dk[t2] += scale * dscore[t2] q[t]
// dq (B, T, H, Dqk), d_kv (B, T, H, Dn + Dv) = [dk_nope ; dv] and d_k_rope (B, T, Dr) are WRITTEN (kernels.h); any
// may be NULL. Gradients of one (b, h) are summed in thread-local buffers from 0 (dk and dv over t in increasing
// order) and stored once: dk's first Dn columns and dv into d_kv, its last Dr columns (the head's gradient of
// the shared rope key) into rope_g (B, T, H, Dr), which is then summed over the heads in order from 0.
// q, kv and k_rope are the forward's copies in the state.
void cpu_attention_backward(real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *state, int B, int T,
                            int H, int Dn, int Dr, int Dv) {
    const int Dqk = Dn + Dr, kv_ld = Dn + Dv;
    const CpuState st = cpu_state_layout(state, B, T, H, Dn, Dr, Dv);
    const real *att = st.att, *q = st.q, *kv = st.kv, *k_rope = st.k_rope;
    real *rope_g = d_k_rope && Dr > 0 ? cpu_values_or_die((size_t)B * T * H * Dr, "attention_backward rope-key gradients")
                                      : NULL;
    const int want_dk = (d_kv && Dn > 0) || rope_g, want_dv = d_kv != NULL;
    if (!dq && !want_dk && !want_dv) return;
    const real scale = (real)1 / sqrt((real)Dqk);
    CpuRegionError err = {0};  // a thread's scratch that cannot be allocated (scratch.c)
#pragma omp parallel if ((double)B * H * T * T * (Dqk + Dv) > 65536.0)
    {
        real *vT = cpu_region_alloc(&err, sizeof(real) * (size_t)Dv * T, 0, "attention_backward transposed v");
        real *dscore = cpu_region_alloc(&err, sizeof(real) * (size_t)T, 0, "attention_backward score gradient");
        real *dq_t = cpu_region_alloc(&err, sizeof(real) * (size_t)Dqk, 0, "attention_backward dq row");
        real *dk_local = cpu_region_alloc(&err, sizeof(real) * (size_t)T * Dqk, 0, "attention_backward dk");
        real *dv_local = cpu_region_alloc(&err, sizeof(real) * (size_t)T * Dv, 0, "attention_backward dv");
        const int have_scratch = vT && dscore && dq_t && dk_local && dv_local;
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            if (!have_scratch) continue;
            const int b = bh / H, h = bh % H;
            transpose_head(vT, kv + Dn, kv_ld, b, h, T, H, Dv);
            memset(dk_local, 0, sizeof(real) * (size_t)T * Dqk);
            memset(dv_local, 0, sizeof(real) * (size_t)T * Dv);
            for (int t = 0; t < T; t++) {
                const real *p = att + ((size_t)bh * T + t) * T;
                const real *g = dout + row_index(b, t, h, T, H, Dv);
                if (want_dv) {
                    for (int t2 = 0; t2 <= t; t2++) {
                        const real a = p[t2];
                        real *dvt2 = dv_local + (size_t)t2 * Dv;
#pragma omp simd
                        for (int d = 0; d < Dv; d++) dvt2[d] += a * g[d];
                    }
                }
                if (!dq && !want_dk) continue;
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
                        // the key of t2 in its two parts: each dq_t[d] gets the same product as from [k_nope ; k_rope]
                        const real s = dscore[t2];
                        const real *knope = kv + row_index(b, t2, h, T, H, kv_ld);
#pragma omp simd
                        for (int d = 0; d < Dn; d++) dq_t[d] += s * knope[d];
                        if (Dr > 0) {
                            const real *krope = k_rope + row_index(b, t2, 0, T, 1, Dr);
                            real *dq_rope = dq_t + Dn;
#pragma omp simd
                            for (int d = 0; d < Dr; d++) dq_rope[d] += s * krope[d];
                        }
                    }
                    real *dqt = dq + row_index(b, t, h, T, H, Dqk);
#pragma omp simd
                    for (int d = 0; d < Dqk; d++) dqt[d] = dq_t[d];
                }
                if (want_dk) {
                    for (int t2 = 0; t2 <= t; t2++) {
                        const real s = dscore[t2];
                        real *dkt2 = dk_local + (size_t)t2 * Dqk;
#pragma omp simd
                        for (int d = 0; d < Dqk; d++) dkt2[d] += s * qt[d];
                    }
                }
            }
            for (int t2 = 0; t2 < T; t2++) {
                const real *dk_row = dk_local + (size_t)t2 * Dqk;
                if (d_kv && Dn > 0) {
                    real *dst = d_kv + row_index(b, t2, h, T, H, kv_ld);
#pragma omp simd
                    for (int d = 0; d < Dn; d++) dst[d] = dk_row[d];
                }
                if (rope_g) {
                    real *dst = rope_g + row_index(b, t2, h, T, H, Dr);
                    const real *src = dk_row + Dn;
#pragma omp simd
                    for (int d = 0; d < Dr; d++) dst[d] = src[d];
                }
                if (want_dv) {
                    real *dst = d_kv + row_index(b, t2, h, T, H, kv_ld) + Dn;
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
    cpu_region_check(&err);
    if (!rope_g) return;
    // d_k_rope[n, c] = ((0 + g_0) + g_1) + ... + g_{H-1}: one rounded addition per head, in head order
    const int64_t NR = (int64_t)B * T * Dr;
#pragma omp parallel for if ((double)NR * H > 65536.0) schedule(static)
    for (int64_t i = 0; i < NR; i++) {
        const int64_t n = i / Dr, c = i % Dr;
        const real *g = rope_g + n * H * Dr + c;
        real sum = 0;
        for (int h = 0; h < H; h++) sum += g[(int64_t)h * Dr];
        d_k_rope[i] = sum;
    }
    free(rope_g);
}

// dout widened from its BF16 rows (exactly) into a buffer of its own, then the backward above.
void cpu_attention_backward_bf16(real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                                 const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
    real *dout = cpu_bf16_rows_widened(dout16, ld, (int64_t)B * T, H * Dv);
    cpu_attention_backward(dq, d_kv, d_k_rope, dout, state, B, T, H, Dn, Dr, Dv);
    free(dout);
}
