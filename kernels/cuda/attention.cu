/*
 * attention.cu - CUDA causal softmax attention core (kernels.h: attention_forward / attention_backward),
 * flash-style: the T x T score matrix of a head is never stored. Same function as the CPU reference
 * kernels/cpu/attention.c, checked against it (and a double-precision reference) by
 * tests/gpu/test_gpu_attention.c.
 *
 * Numerics (DESIGN.md section 4: the attention core stays BF16/FP32): q, k, v and dout are rounded to
 * BF16 (round-to-nearest-even) when a tile is copied to shared memory; every product of two matrices
 * runs on the tensor cores (mma.sync m16n8k16, BF16 inputs, FP32 accumulation); the probabilities P
 * and the score gradients dS are rounded to BF16 only as MMA inputs; the softmax statistics (running
 * max m, running sum l, the log-sum-exp) and everything elementwise are FP32.
 *
 * Backward state: instead of the (B, H, T, T) probabilities of the CPU reference, the forward writes
 * lse (B, H, T), the FP32 log-sum-exp of each query row's scaled scores; the backward recomputes
 * P = exp(scale q k^T - lse) tile by tile.
 *
 * Tiling. Query and key tiles are 64 rows (TILE), aligned to multiples of 64, so query tile i needs key
 * tiles 0..i and key tile j is seen by query tiles j..last. A warp computes 16 rows of a tile product.
 * Head dims are padded with zeros to a multiple of 16 in shared memory (the MMA's k step); register
 * accumulators are sized by a compile-time capacity (64, 128, 192 or 256 columns, head_cap) so any head
 * dim from 1 to 256 runs, and 192 (DeepSeek-V3's 128 nope + 64 rope) wastes nothing.
 *
 * Kernels (each output element is written by exactly one thread, sums in a fixed order, no atomics,
 * so every result is bitwise reproducible):
 *   forward   one block per (query tile, h, b): loop over key tiles up to the diagonal, S = scale Q K^T,
 *             online softmax, O += P V; writes out and lse. Its ROWDOT variant recomputes O the same
 *             way and writes D_i = sum_d dout_id O_id instead (see the backward).
 *   dq        one block per (query tile, h, b): loop over key tiles up to the diagonal, recompute P from
 *             lse, dP = dO V^T, dS = P (dP - D), dq += scale dS K.
 *   dkv       one block per (key tile, h, b): loop over query tiles from the diagonal on, recompute P and
 *             dP, dv += P^T dO, dk += scale dS^T Q.
 * Determinism costs work here: a single-pass backward would add each (query tile, key tile) pair's
 * dq contribution with atomics. With dq and dk/dv in separate kernels, each computing its outputs in a
 * fixed order, P = exp(S - lse) and dP are recomputed twice (once per kernel): 4 + 3 = 7 tile-products
 * instead of 5. And attention_backward is not given the forward's output O (kernels.h), so D needs O
 * again: the ROWDOT forward recomputes it, 2 more tile-products (9 in all, about 4.5 forwards). If O is
 * ever passed to the backward, D becomes one cheap row-dot kernel and the cost falls to 7.
 *
 * Shared memory tiles are row-major with 8 BF16 of padding per row: the row stride in 32-bit words is
 * then 4 mod 8, so the 8 rows x 4 column pairs a warp reads for one MMA fragment hit 32 different banks.
 *
 * MMA fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), for
 * lane = 4 g + t (g = lane / 4 the group, t = lane % 4 the thread in the group):
 *   A (16 x 16, row): reg 0 = A[g][2t, 2t+1], reg 1 = A[g+8][2t, 2t+1], reg 2 = A[g][2t+8, 2t+9],
 *                     reg 3 = A[g+8][2t+8, 2t+9]         (two BF16 per register, lower k in the low half)
 *   B (16 x 8, col):  reg 0 = B[2t, 2t+1][g], reg 1 = B[2t+8, 2t+9][g]
 *   C (16 x 8, f32):  c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
 * So the C fragments of columns [16j, 16j+8) and [16j+8, 16j+16) of one product are, packed to BF16,
 * exactly the A fragment of k = [16j, 16j+16) of the next product (pack_a_from_c): P and dS go from
 * the softmax straight into the next MMA without shared memory. Each row of C is held by the 4 lanes of
 * one group, so row reductions are two butterfly shuffles (xor 1, xor 2).
 */
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

typedef __nv_bfloat16 bf16;

constexpr int TILE = 64;             // query and key rows per tile
constexpr int FWD_THREADS = 128;     // forward and dq: 4 warps x 16 query rows
constexpr int DKV_THREADS = 256;     // dkv: 8 warps, two groups of 4 x 16 key rows (see the dkv kernel)
constexpr int P_LD = TILE + 4;       // row stride (floats) of the dkv kernel's probability tile
constexpr int HEAD_DIM_MAX = 256;

// ---------------------------------------------------------------------------- MMA and fragments
__device__ __forceinline__ uint32_t load_u32(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }

__device__ __forceinline__ uint32_t pack_u16(const bf16 *lo, const bf16 *hi) {
    const uint32_t l = *reinterpret_cast<const uint16_t *>(lo), h = *reinterpret_cast<const uint16_t *>(hi);
    return l | (h << 16);
}

// Two floats rounded to BF16 (RNE) in one register, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

// c (16 x 8) += a (16 x 16) b (16 x 8), BF16 inputs, FP32 accumulation.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A fragment of A[m][kk] = s[(m0 + m) * ld + k0 + kk] (a row-major tile, rows m0..m0+15, columns k0..k0+15).
__device__ __forceinline__ void load_a(uint32_t a[4], const bf16 *s, int ld, int m0, int k0, int lane) {
    const bf16 *p = s + (m0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
    a[0] = load_u32(p);
    a[1] = load_u32(p + 8 * ld);
    a[2] = load_u32(p + 8);
    a[3] = load_u32(p + 8 * ld + 8);
}

// B fragment of B[kk][n] = s[(n0 + n) * ld + k0 + kk]: the tile's rows are B's columns (B = rows^T),
// e.g. K in S = Q K^T.
__device__ __forceinline__ void load_b_rows_as_cols(uint32_t b[2], const bf16 *s, int ld, int n0, int k0, int lane) {
    const bf16 *p = s + (n0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
    b[0] = load_u32(p);
    b[1] = load_u32(p + 8);
}

// B fragment of B[kk][n] = s[(k0 + kk) * ld + n0 + n]: the tile is B itself, e.g. V in O = P V.
__device__ __forceinline__ void load_b_rows_as_rows(uint32_t b[2], const bf16 *s, int ld, int k0, int n0, int lane) {
    const bf16 *p = s + (k0 + 2 * (lane & 3)) * ld + n0 + (lane >> 2);
    b[0] = pack_u16(p, p + ld);
    b[1] = pack_u16(p + 8 * ld, p + 9 * ld);
}

// The A fragment (k = [16j, 16j+16)) made of C fragments x[2j] (columns 16j..16j+7) and x[2j+1].
__device__ __forceinline__ void pack_a_from_c(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

// x (16 x 64) = a_rows (16 x DP) b_rows (64 x DP)^T: rows m0..m0+15 of tile `a` against all 64 rows of
// tile `b`, both row-major with stride ld, summed over DP columns (a multiple of 16) in increasing order.
// x[nt][e] is C element (row g or g+8, column 8 nt + 2t + e%2) of the warp's 16 x 64 result.
__device__ __forceinline__ void warp_a_bt(float x[8][4], const bf16 *a, const bf16 *b, int ld, int DP, int m0,
                                          int lane) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.0f;
    for (int k0 = 0; k0 < DP; k0 += 16) {
        uint32_t af[4];
        load_a(af, a, ld, m0, k0, lane);
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            uint32_t bfr[2];
            load_b_rows_as_cols(bfr, b, ld, nt * 8, k0, lane);
            mma_bf16(x[nt], af, bfr);
        }
    }
}

// acc (16 x NCAP) += x (16 x 64) tile (64 x DP): x in C layout (as warp_a_bt leaves it) becomes the A
// operand, the row-major tile `s` (stride ld) the B operand; only the first DP columns (a multiple of 16,
// at most NCAP) are computed. Sums over the 64 rows in increasing order.
template <int NCAP>
__device__ __forceinline__ void warp_c_times_tile(float acc[NCAP / 8][4], const float x[8][4], const bf16 *s, int ld,
                                                  int DP, int lane) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t af[4];
        pack_a_from_c(af, x[2 * j], x[2 * j + 1]);
#pragma unroll
        for (int nt = 0; nt < NCAP / 8; nt++) {
            if (nt * 8 < DP) {
                uint32_t bfr[2];
                load_b_rows_as_rows(bfr, s, ld, 16 * j, nt * 8, lane);
                mma_bf16(acc[nt], af, bfr);
            }
        }
    }
}

// Rows t0..t0+63 of head h of batch row b of x (B, T, H, D) -> tile (64, DP) in BF16, stride ld, zero
// beyond row T and column D.
__device__ void load_tile(bf16 *tile, int ld, const float *x, int b, int t0, int h, int T, int H, int D, int DP) {
    for (int i = threadIdx.x; i < TILE * DP; i += blockDim.x) {
        const int r = i / DP, c = i - r * DP, t = t0 + r;
        float val = 0.0f;
        if (t < T && c < D) val = x[(((int64_t)b * T + t) * H + h) * D + c];
        tile[r * ld + c] = __float2bfloat16_rn(val);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
// The 4 lanes of a group end with the same bits (each level adds the same two values, commuted).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---------------------------------------------------------------------------- forward
// q, k (B, T, H, Dqk), v (B, T, H, Dv) -> out (B, T, H, Dv), lse (B, H, T). Grid (n_tiles, H, B), the
// query tile reversed so the longest rows start first. Per key tile, for query row i and key j <= i:
//   s_ij = scale q_i . k_j;  m_new = max(m, max_j s_ij);  alpha = exp(m - m_new)
//   l = alpha l + sum_j exp(s_ij - m_new);   o = alpha o + sum_j bf16(exp(s_ij - m_new)) v_j
// then out_i = o / l and lse_i = m + log(l). Every key tile has at least one unmasked key per row
// (key tile kt <= query tile), so m is finite after the first tile and alpha is exp(-inf) = 0 there.
// ROWDOT: instead of out and lse, write rowdot (B, H, T) = sum_d dout_id out_id (the backward's D).
template <int DV_CAP, bool ROWDOT>
__global__ void __launch_bounds__(FWD_THREADS)
    attention_forward_kernel(float *out, float *lse, float *rowdot, const float *dout, const float *q,
                             const float *k, const float *v, int T, int H, int Dqk, int Dv, int DQP, int DVP,
                             float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int ldq = DQP + 8, ldv = DVP + 8;
    bf16 *Qs = reinterpret_cast<bf16 *>(smem), *Ks = Qs + TILE * ldq, *Vs = Ks + TILE * ldq;

    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int q0 = qt * TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // this thread's two query rows

    load_tile(Qs, ldq, q, b, q0, h, T, H, Dqk, DQP);
    float o[DV_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < DV_CAP / 8; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * TILE;
        __syncthreads();  // every warp is done with the previous K, V tiles
        load_tile(Ks, ldq, k, b, k0, h, T, H, Dqk, DQP);
        load_tile(Vs, ldv, v, b, k0, h, T, H, Dv, DVP);
        __syncthreads();

        float s[8][4];
        warp_a_bt(s, Qs, Ks, ldq, DQP, warp * 16, lane);
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
                float x = s[nt][e] * scale;
                if (key > row || key >= T) x = -INFINITY;  // causal mask (and padding keys)
                s[nt][e] = x;
                if (e < 2) mx0 = fmaxf(mx0, x);
                else mx1 = fmaxf(mx1, x);
            }
        }
        const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
        const float alpha0 = expf(m0 - mn0), alpha1 = expf(m1 - mn1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            s[nt][0] = expf(s[nt][0] - mn0);
            s[nt][1] = expf(s[nt][1] - mn0);
            s[nt][2] = expf(s[nt][2] - mn1);
            s[nt][3] = expf(s[nt][3] - mn1);
            sum0 += s[nt][0] + s[nt][1];
            sum1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * alpha0 + quad_sum(sum0);
        l1 = l1 * alpha1 + quad_sum(sum1);
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int nt = 0; nt < DV_CAP / 8; nt++) {
            o[nt][0] *= alpha0;
            o[nt][1] *= alpha0;
            o[nt][2] *= alpha1;
            o[nt][3] *= alpha1;
        }
        warp_c_times_tile<DV_CAP>(o, s, Vs, ldv, DVP, lane);
    }

    float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < DV_CAP / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int col = nt * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
            if (row >= T || col >= Dv) continue;
            const float val = o[nt][e] / (e < 2 ? l0 : l1);
            const int64_t idx = (((int64_t)b * T + row) * H + h) * Dv + col;
            if (ROWDOT) {
                if (e < 2) dot0 += val * dout[idx];
                else dot1 += val * dout[idx];
            } else {
                out[idx] = val;
            }
        }
    }
    const int64_t stat = ((int64_t)b * H + h) * T;  // (b, h) row of lse / rowdot
    if (ROWDOT) {
        dot0 = quad_sum(dot0);
        dot1 = quad_sum(dot1);
        if (t == 0 && row0 < T) rowdot[stat + row0] = dot0;
        if (t == 0 && row1 < T) rowdot[stat + row1] = dot1;
    } else {
        if (t == 0 && row0 < T) lse[stat + row0] = m0 + logf(l0);
        if (t == 0 && row1 < T) lse[stat + row1] = m1 + logf(l1);
    }
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out_i = sum_j P_ij v_j, P_ij = exp(s_ij - lse_i), s_ij = scale q_i . k_j
// (j <= i), so with g_i = dout_i:
//   dP_ij = g_i . v_j;   D_i = sum_j P_ij dP_ij = g_i . out_i;   dS_ij = P_ij (dP_ij - D_i)
//   dq_i += scale sum_j dS_ij k_j;   dk_j += scale sum_i dS_ij q_i;   dv_j += sum_i P_ij g_i
// The kernels fold scale into dS before it is rounded to BF16 for the MMA.

// dq (B, T, H, Dqk) +=. Grid (n_tiles, H, B), query tiles reversed; 4 warps x 16 query rows.
template <int DQK_CAP>
__global__ void __launch_bounds__(FWD_THREADS)
    attention_backward_dq_kernel(float *dq, const float *dout, const float *lse, const float *rowdot,
                                 const float *q, const float *k, const float *v, int T, int H, int Dqk, int Dv,
                                 int DQP, int DVP, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int ldq = DQP + 8, ldv = DVP + 8;
    bf16 *Qs = reinterpret_cast<bf16 *>(smem), *Ks = Qs + TILE * ldq, *dOs = Ks + TILE * ldq, *Vs = dOs + TILE * ldv;

    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int q0 = qt * TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    const int64_t stat = ((int64_t)b * H + h) * T;
    const float lse0 = row0 < T ? lse[stat + row0] : 0.0f, lse1 = row1 < T ? lse[stat + row1] : 0.0f;
    const float D0 = row0 < T ? rowdot[stat + row0] : 0.0f, D1 = row1 < T ? rowdot[stat + row1] : 0.0f;

    load_tile(Qs, ldq, q, b, q0, h, T, H, Dqk, DQP);
    load_tile(dOs, ldv, dout, b, q0, h, T, H, Dv, DVP);
    float acc[DQK_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < DQK_CAP / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * TILE;
        __syncthreads();
        load_tile(Ks, ldq, k, b, k0, h, T, H, Dqk, DQP);
        load_tile(Vs, ldv, v, b, k0, h, T, H, Dv, DVP);
        __syncthreads();

        float s[8][4], dp[8][4];
        warp_a_bt(s, Qs, Ks, ldq, DQP, warp * 16, lane);    // S = Q K^T
        warp_a_bt(dp, dOs, Vs, ldv, DVP, warp * 16, lane);  // dP = dO V^T
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
                const float p = (key <= row && key < T) ? expf(s[nt][e] * scale - (e < 2 ? lse0 : lse1)) : 0.0f;
                s[nt][e] = p * (dp[nt][e] - (e < 2 ? D0 : D1)) * scale;  // scale * dS
            }
        }
        warp_c_times_tile<DQK_CAP>(acc, s, Ks, ldq, DQP, lane);  // dq += (scale dS) K
    }

#pragma unroll
    for (int nt = 0; nt < DQK_CAP / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int col = nt * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
            if (row < T && col < Dqk) dq[(((int64_t)b * T + row) * H + h) * Dqk + col] += acc[nt][e];
        }
    }
}

// dk (B, T, H, Dqk) +=, dv (B, T, H, Dv) += (either may be NULL). Grid (n_tiles, H, B), one key tile
// per block, looping over query tiles from the diagonal on. 8 warps in two groups, each warp owning 16
// keys of the tile over all 64 queries of a query tile (so each group covers the tile's 64 keys):
//   value group (warps 4..7): x = K Q^T (S^T), P^T = exp(scale x - lse) -> registers and shared Ps;
//                             dv += P^T dO
//   key group   (warps 0..3): x = V dO^T (dP^T); after a barrier reads P^T from Ps,
//                             dS^T = P^T (dP^T - D); dk += (scale dS^T) Q
// The groups do equal work (one product over Dqk and one over Dv each), and each keeps only its own
// accumulator (16 x max(Dqk, Dv) per warp, the same registers acc[] serve as dk or dv), which keeps
// the register count low enough for Dqk = 192 without spilling.
template <int ACC_CAP>
__global__ void __launch_bounds__(DKV_THREADS)
    attention_backward_dkv_kernel(float *dk, float *dv, const float *dout, const float *lse, const float *rowdot,
                                  const float *q, const float *k, const float *v, int T, int H, int Dqk, int Dv,
                                  int DQP, int DVP, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int ldq = DQP + 8, ldv = DVP + 8;
    float *Ps = reinterpret_cast<float *>(smem);  // (TILE, P_LD): P^T of the current tile pair, [key][query]
    float *lse_s = Ps + TILE * P_LD, *D_s = lse_s + TILE;
    bf16 *Ks = reinterpret_cast<bf16 *>(D_s + TILE), *Qs = Ks + TILE * ldq, *Vs = Qs + TILE * ldq,
         *dOs = Vs + TILE * ldv;

    const int kt = blockIdx.x, n_tiles = gridDim.x, h = blockIdx.y, b = blockIdx.z;
    const int k0 = kt * TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool key_group = warp < 4;
    const int wrow = (warp & 3) * 16;  // first key of this warp within the tile
    const int key0 = k0 + wrow + g, key1 = key0 + 8;
    const int64_t stat = ((int64_t)b * H + h) * T;

    // The key group's first product is V dO^T over Dv, then it multiplies by Q (Dqk columns out);
    // the value group's is K Q^T over Dqk, then it multiplies by dO (Dv columns out).
    const bf16 *xa = key_group ? Vs : Ks, *xb = key_group ? dOs : Qs, *ys = key_group ? Qs : dOs;
    const int x_ld = key_group ? ldv : ldq, x_dp = key_group ? DVP : DQP;
    const int y_ld = key_group ? ldq : ldv, y_dp = key_group ? DQP : DVP;

    load_tile(Ks, ldq, k, b, k0, h, T, H, Dqk, DQP);
    load_tile(Vs, ldv, v, b, k0, h, T, H, Dv, DVP);
    float acc[ACC_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < ACC_CAP / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    for (int qt = kt; qt < n_tiles; qt++) {
        const int q0 = qt * TILE;
        __syncthreads();  // every warp is done with the previous Q, dO, Ps, lse_s, D_s
        load_tile(Qs, ldq, q, b, q0, h, T, H, Dqk, DQP);
        load_tile(dOs, ldv, dout, b, q0, h, T, H, Dv, DVP);
        for (int r = threadIdx.x; r < TILE; r += blockDim.x) {
            const int row = q0 + r;
            lse_s[r] = row < T ? lse[stat + row] : 0.0f;
            D_s[r] = row < T ? rowdot[stat + row] : 0.0f;
        }
        __syncthreads();

        float x[8][4];  // C element (key wrow+g or +8, query 8 nt + 2t + e%2 of the tile)
        warp_a_bt(x, xa, xb, x_ld, x_dp, wrow, lane);
        if (!key_group) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = e < 2 ? key0 : key1, ql = nt * 8 + 2 * t + (e & 1), row = q0 + ql;
                    const float p = (key <= row && row < T) ? expf(x[nt][e] * scale - lse_s[ql]) : 0.0f;
                    x[nt][e] = p;
                    Ps[(wrow + g + (e < 2 ? 0 : 8)) * P_LD + ql] = p;
                }
            }
        }
        __syncthreads();  // Ps complete
        if (key_group) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = nt * 8 + 2 * t + (e & 1);
                    const float p = Ps[(wrow + g + (e < 2 ? 0 : 8)) * P_LD + ql];
                    x[nt][e] = p * (x[nt][e] - D_s[ql]) * scale;  // scale * dS^T
                }
            }
        }
        warp_c_times_tile<ACC_CAP>(acc, x, ys, y_ld, y_dp, lane);  // dk += (scale dS^T) Q, dv += P^T dO
    }

    float *grad = key_group ? dk : dv;
    const int D = key_group ? Dqk : Dv;
    if (grad == NULL) return;
#pragma unroll
    for (int nt = 0; nt < ACC_CAP / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int col = nt * 8 + 2 * t + (e & 1), key = e < 2 ? key0 : key1;
            if (key < T && col < D) grad[(((int64_t)b * T + key) * H + h) * D + col] += acc[nt][e];
        }
    }
}

// ---------------------------------------------------------------------------- host side
// Register capacity (columns) of a head dim: the accumulator arrays are sized at compile time.
static int head_cap(int D) { return D <= 64 ? 64 : D <= 128 ? 128 : D <= 192 ? 192 : 256; }
static int pad16(int D) { return (D + 15) / 16 * 16; }

static void check_shape(const char *op, int B, int T, int H, int Dqk, int Dv) {
    if (Dqk < 1 || Dqk > HEAD_DIM_MAX || Dv < 1 || Dv > HEAD_DIM_MAX || H > 65535 || B > 65535) {
        fprintf(stderr, "fp8moe: %s (kernels/cuda/attention.cu): got B = %d, T = %d, H = %d, Dqk = %d, Dv = %d; "
                        "the CUDA attention core supports head dims 1 .. %d and B, H <= 65535\n",
                op, B, T, H, Dqk, Dv, HEAD_DIM_MAX);
        exit(1);
    }
}

// Dynamic shared memory above 48 KiB must be allowed per kernel; H200 has up to 227 KiB per block.
template <typename Kernel> static void allow_smem(Kernel kernel, size_t bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

template <int DV_CAP, bool ROWDOT>
static void launch_forward(float *out, float *lse, float *rowdot, const float *dout, const float *q, const float *k,
                           const float *v, int B, int T, int H, int Dqk, int Dv) {
    const int DQP = pad16(Dqk), DVP = pad16(Dv);
    const size_t smem = sizeof(bf16) * (size_t)TILE * (2 * (DQP + 8) + (DVP + 8));
    allow_smem(attention_forward_kernel<DV_CAP, ROWDOT>, smem);
    const dim3 grid((unsigned)((T + TILE - 1) / TILE), (unsigned)H, (unsigned)B);
    attention_forward_kernel<DV_CAP, ROWDOT><<<grid, FWD_THREADS, smem>>>(out, lse, rowdot, dout, q, k, v, T, H, Dqk,
                                                                          Dv, DQP, DVP, 1.0f / sqrtf((float)Dqk));
    CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

template <bool ROWDOT>
static void forward_any_dv(float *out, float *lse, float *rowdot, const float *dout, const float *q, const float *k,
                           const float *v, int B, int T, int H, int Dqk, int Dv) {
    switch (head_cap(Dv)) {
    case 64: launch_forward<64, ROWDOT>(out, lse, rowdot, dout, q, k, v, B, T, H, Dqk, Dv); break;
    case 128: launch_forward<128, ROWDOT>(out, lse, rowdot, dout, q, k, v, B, T, H, Dqk, Dv); break;
    case 192: launch_forward<192, ROWDOT>(out, lse, rowdot, dout, q, k, v, B, T, H, Dqk, Dv); break;
    default: launch_forward<256, ROWDOT>(out, lse, rowdot, dout, q, k, v, B, T, H, Dqk, Dv); break;
    }
}

// state = lse (B, H, T), see kernels.h.
extern "C" void cuda_attention_forward(real *out, real *state, const real *q, const real *k, const real *v, int B,
                                       int T, int H, int Dqk, int Dv) {
    check_shape("attention_forward", B, T, H, Dqk, Dv);
    if (B <= 0 || T <= 0 || H <= 0) return;
    forward_any_dv<false>(out, state, NULL, NULL, q, k, v, B, T, H, Dqk, Dv);
}

template <int DQK_CAP>
static void launch_dq(float *dq, const float *dout, const float *lse, const float *rowdot, const float *q,
                      const float *k, const float *v, int B, int T, int H, int Dqk, int Dv) {
    const int DQP = pad16(Dqk), DVP = pad16(Dv);
    const size_t smem = sizeof(bf16) * (size_t)TILE * (2 * (DQP + 8) + 2 * (DVP + 8));
    allow_smem(attention_backward_dq_kernel<DQK_CAP>, smem);
    const dim3 grid((unsigned)((T + TILE - 1) / TILE), (unsigned)H, (unsigned)B);
    attention_backward_dq_kernel<DQK_CAP><<<grid, FWD_THREADS, smem>>>(dq, dout, lse, rowdot, q, k, v, T, H, Dqk, Dv,
                                                                       DQP, DVP, 1.0f / sqrtf((float)Dqk));
    CUDA_CHECK_LAUNCH("attention_backward_dq_kernel");
}

template <int ACC_CAP>
static void launch_dkv(float *dk, float *dv, const float *dout, const float *lse, const float *rowdot, const float *q,
                       const float *k, const float *v, int B, int T, int H, int Dqk, int Dv) {
    const int DQP = pad16(Dqk), DVP = pad16(Dv);
    const size_t smem = sizeof(float) * (size_t)TILE * (P_LD + 2)  // Ps, lse_s, D_s
                        + sizeof(bf16) * (size_t)TILE * (2 * (DQP + 8) + 2 * (DVP + 8));
    allow_smem(attention_backward_dkv_kernel<ACC_CAP>, smem);
    const dim3 grid((unsigned)((T + TILE - 1) / TILE), (unsigned)H, (unsigned)B);
    attention_backward_dkv_kernel<ACC_CAP><<<grid, DKV_THREADS, smem>>>(dk, dv, dout, lse, rowdot, q, k, v, T, H, Dqk,
                                                                        Dv, DQP, DVP, 1.0f / sqrtf((float)Dqk));
    CUDA_CHECK_LAUNCH("attention_backward_dkv_kernel");
}

// The process-wide scratch for D (B, H, T), grown on demand and kept; all ops run on the default stream,
// so consecutive calls cannot overlap on it (as the rmsnorm.cu scratch).
static Scratch rowdot_scratch;

static float *get_rowdot_scratch(size_t floats) {
    return (float *)cuda_scratch(&rowdot_scratch, floats * sizeof(float));
}

// state = lse (B, H, T) from cuda_attention_forward on the same q, k, v.
extern "C" void cuda_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *state,
                                        const real *q, const real *k, const real *v, int B, int T, int H, int Dqk,
                                        int Dv) {
    check_shape("attention_backward", B, T, H, Dqk, Dv);
    if (B <= 0 || T <= 0 || H <= 0 || (dq == NULL && dk == NULL && dv == NULL)) return;
    // D_i = dout_i . out_i, with out recomputed (attention_backward is not given it)
    float *rowdot = get_rowdot_scratch((size_t)B * H * T);
    forward_any_dv<true>(NULL, NULL, rowdot, dout, q, k, v, B, T, H, Dqk, Dv);
    if (dq != NULL) {
        switch (head_cap(Dqk)) {
        case 64: launch_dq<64>(dq, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        case 128: launch_dq<128>(dq, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        case 192: launch_dq<192>(dq, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        default: launch_dq<256>(dq, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        }
    }
    if (dk != NULL || dv != NULL) {
        const int cap = head_cap(Dqk > Dv ? Dqk : Dv);
        switch (cap) {
        case 64: launch_dkv<64>(dk, dv, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        case 128: launch_dkv<128>(dk, dv, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        case 192: launch_dkv<192>(dk, dv, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        default: launch_dkv<256>(dk, dv, dout, state, rowdot, q, k, v, B, T, H, Dqk, Dv); break;
        }
    }
}
