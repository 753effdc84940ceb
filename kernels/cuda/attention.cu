/*
 * attention.cu - CUDA causal softmax attention core (kernels.h: attention_forward / attention_backward),
 * flash-style: the T x T score matrix of a head is never stored. Same function as the CPU reference
 * kernels/cpu/attention.c, checked against it (and a double-precision reference) by
 * tests/gpu/test_gpu_attention.c; timed by `fp8moe bench attention` (train/bench_attention.c). On an H100/H200,
 * for the head dims they serve (Dqk 128 or 192 and Dv 128 after padding), attention_wgmma.cu's Hopper kernels
 * replace the three mma.sync kernels below on the same staged operands (the dispatch is at the end of this file;
 * attention.cuh holds what both families share); everything else described here holds for both.
 *
 * Numerics (DESIGN.md section 4: the attention core stays BF16/FP32): q, k, v and dout are rounded to
 * BF16 (round-to-nearest-even) once by a conversion pre-pass; every product of two matrices
 * runs on the tensor cores (mma.sync m16n8k16, BF16 inputs, FP32 accumulation); the probabilities P
 * and the score gradients dS are rounded to BF16 only as MMA inputs; the softmax statistics (running
 * max m, running sum l, the log-sum-exp) and everything elementwise are FP32. The softmax works in
 * base 2: scores are scaled by scale * log2(e) and exponentiated with exp2f (the same function as
 * exp of the natural-log scores, one FP32 rounding of the folded constant apart).
 *
 * Backward state: instead of the (B, H, T, T) probabilities of the CPU reference, the forward writes
 * lse (B, H, T), the FP32 natural log-sum-exp of each query row's scaled scores (and keeps its BF16
 * operands after it, see the pre-pass); the backward
 * recomputes P = exp2(scale log2(e) q k^T - lse log2(e)) tile by tile. attention_backward is also
 * given the forward's output `out`, so D_i = sum_d dout_id out_id (the softmax backward's row term) is
 * one row-dot pass instead of a recomputation of the forward.
 *
 * Layouts (kernels.h): q (B, T, H, Dqk) and dq as they are; keys and values in MLA's layout, read and
 * written where MLA keeps them: kv (B, T, H, Dn + Dv) = [k_nope ; v] per token and head, k_rope (B, T, Dr)
 * shared by every head; key (t, h) = [k_nope[t, h] ; k_rope[t]], Dqk = Dn + Dr.
 *
 * Pre-pass (one launch in the forward, one in the backward): the forward copies q, k and v from FP32 (or, in
 * attention_forward_bf16, from MLA's BF16 products, rotating the queries' rope part on the way) into
 * BF16 in head-major layout (B, H, Tpad, DP): DP = D rounded up to 16 (the MMA's k step), Tpad = T rounded
 * up to 128 (the largest tile), zeros in the padding. q is read from (B, T, H, D); each key row is
 * assembled from kv's k_nope and the token's k_rope, each value row read from kv (Dn floats into its row):
 * the same BF16 values as per-head (B, T, H, D) copies of the keys and values would give, so the kernels
 * below see no difference. These copies live in the backward state, after lse (state_layout), and the
 * backward reads them there: q, kv and k_rope are converted once, not again in the backward, which does
 * not read them at all. The backward pre-pass copies dout the same way and writes D and lse * log2(e)
 * padded to (B, H, Tpad), into the counted grow-on-demand cuda_scratch of common.cuh (process-wide; all
 * ops run on the default stream, so consecutive calls cannot overlap on it). Every tile a kernel needs
 * is one contiguous block of BF16 rows, copied to shared memory with 16-byte cp.async and no bounds
 * checks.
 *
 * Kernels (each output element is written by exactly one thread, sums in a fixed order, no atomics,
 * so every result is bitwise reproducible run to run):
 *   forward   one block per (h, b, query tile of BM = 128 rows: 8 warps x 16 rows), the longest query
 *             tiles launched first; loop over key tiles of 64 up to the diagonal: S = Q K^T, online
 *             softmax, O += P V; writes out and lse.
 *   dq        one block per (h, b, query tile of BM rows, 8 warps): loop over key tiles of 64 up to the
 *             diagonal, recompute P from lse, dP = dO V^T, dS = P (dP - D), dq += scale dS K.
 *             BM = 128, or 64 (4 warps) when Q, dO and two K/V buffers of 128 rows do not fit the
 *             shared memory (padded head dims DQP + DVP above 432, e.g. 224/224 or 256/256).
 *   dkv       one block per (h, b, key tile of 64 keys), 8 warps in two groups of 4 x 16 keys, loop
 *             over query tiles of 64 from the diagonal on:
 *               value group (warps 4..7): X = K Q^T (S^T), P^T = exp2(X - lse) -> registers and shared
 *                                         Ps; dv += P^T dO
 *               key group   (warps 0..3): X = V dO^T (dP^T); after a barrier reads P^T from Ps,
 *                                         dS^T = P^T (dP^T - D); dk += (scale dS^T) Q
 *             The groups do equal work (one product over Dqk, one over Dv), and each keeps one
 *             accumulator (16 x max(Dqk, Dv) per warp), which keeps registers low enough for Dqk = 192.
 *             Stores: dv and dk's first Dn columns (the k_nope gradient) into d_kv (kv's layout), dk's
 *             last Dr columns (this head's gradient of the shared rope key) into an FP32 (B, T, H, Dr)
 *             cuda_scratch.
 *   rope sum  one thread per element of d_k_rope (B, T, Dr): the scratch summed over the heads in order
 *             h = 0 .. H-1 from 0.0f (the CPU reference's order and bits; no atomics).
 *   Accumulators are register arrays sized by a compile-time capacity of the head dim (64, 128, 192 or
 *   256 columns; dkv has one per group); a head dim below its capacity runs a predicated variant of the
 *   second product. At Dqk = 192, Dv = 128 (ptxas, sm_90): forward 168 registers, dq 242, dkv 212, no
 *   spills.
 *   Warps skip key tiles that lie wholly above the diagonal for their 16 rows, and the causal mask is
 *   applied only on tiles that cross the diagonal (or the end of the sequence).
 *
 * Pipelining: every main loop keeps two shared-memory buffers for the tiles it streams (K, V in the
 * forward and dq kernels; Q, dO, lse, D in dkv). At the top of iteration i a thread waits for its own
 * copies (cp.async.wait_group 0: tile i, issued one iteration earlier), then one __syncthreads makes
 * every thread's copies visible AND proves every warp has finished iteration i - 1, whose buffer is the
 * one tile i + 1 is then copied into while tile i is computed. So one barrier per iteration (two in
 * dkv, whose groups exchange P^T through Ps), and the next tile's load overlaps the current tile's math.
 *
 * Shared memory (bytes, Dqk = 192 and Dv = 128, padded rows of DP + 8 BF16):
 *   forward  Q 128 rows + 2 x (K 64 + V 64 rows)            = 137216  (1 block of 8 warps per SM)
 *   dq       Q, dO 128 rows + 2 x (K 64 + V 64 rows)        = 172032
 *   dkv      K, V 64 rows + 2 x (Q 64 + dO 64 rows) + Ps    = 147456
 * At head dims 256/256 the forward needs 202752 and dkv 221184 bytes (an H200 allows 232448 per block);
 * dq falls back to BM = 64 (202752).
 *
 * Determinism costs work here: a single-pass backward would add each (query tile, key tile) pair's
 * dq contribution with atomics. With dq and dk/dv in separate kernels, each computing its outputs in a
 * fixed order, P = exp(S - lse) and dP are recomputed twice (once per kernel): 4 + 3 = 7 tile-products
 * instead of 5 (1.4x the backward's MMA work). The old recomputation of O for D (2 more products) is
 * gone now that the forward's output is passed in.
 *
 * Shared memory tiles are row-major with 8 BF16 of padding per row: the row stride, 2 DP + 16 bytes, is
 * an odd multiple of 16 bytes, so the 8 rows of 16 bytes that one 8 x 8 matrix of an ldmatrix reads
 * fall in 8 different 16-byte bank groups (conflict-free), and every row starts 16-byte aligned for
 * cp.async.
 *
 * MMA fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), for
 * lane = 4 g + t (g = lane / 4 the group, t = lane % 4 the thread in the group):
 *   A (16 x 16, row): reg 0 = A[g][2t, 2t+1], reg 1 = A[g+8][2t, 2t+1], reg 2 = A[g][2t+8, 2t+9],
 *                     reg 3 = A[g+8][2t+8, 2t+9]         (two BF16 per register, lower k in the low half)
 *   B (16 x 8, col):  reg 0 = B[2t, 2t+1][g], reg 1 = B[2t+8, 2t+9][g]
 *   C (16 x 8, f32):  c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
 * Fragments come from shared memory with ldmatrix.x4: lane l gives the address of row (l % 16), column
 * 8 (l / 16) of a 16 x 16 block; matrix i (register i) is then rows 8 (i % 2).., columns 8 (i / 2)..
 * Read as A, that is the A fragment. For a B operand whose columns are the tile's rows (K in Q K^T) the
 * registers of n-tile 0 are {0, 2} and of n-tile 1 {1, 3}; with .trans, for a B operand that is the tile
 * itself (V in P V), {0, 1} and {2, 3}.
 * The C fragments of columns [16j, 16j+8) and [16j+8, 16j+16) of one product are, packed to BF16,
 * exactly the A fragment of k = [16j, 16j+16) of the next product (pack_a_from_c): P and dS go from
 * the softmax straight into the next MMA without shared memory. Each row of C is held by the 4 lanes of
 * one group, so row reductions are two butterfly shuffles (xor 1, xor 2).
 */
#include "kernels/cuda/attention.cuh"

constexpr int MAX_THREADS = 256;   // 8 warps
constexpr int ROW_PAD = 8;         // BF16 of padding per shared-memory row (see the file comment)
constexpr int P_LD = KT + 4;       // row stride (floats) of the dkv kernel's probability tile
constexpr int HEAD_DIM_MAX = 256;

// ---------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16 x 8) += a (16 x 16) b (16 x 8), BF16 inputs, FP32 accumulation.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// Byte offset of this lane's ldmatrix row address inside a 16 x 16 block of a tile with row stride ld.
__device__ __forceinline__ uint32_t ldsm_lane_offset(int ld, int lane) {
    return (uint32_t)(((lane & 15) * ld + (lane >> 4) * 8) * 2);
}

// ---------------------------------------------------------------------------- warp-level products
// x (16 x 64) = A (16 x DP) B^T: A = 16 rows of a row-major tile, B = 64 rows of another (same row
// stride ld_bytes), summed over DP columns (a multiple of 16) in increasing order. a and b are the
// tiles' ldmatrix addresses (first row, lane offset included). x[nt][e] is C element (row g or g+8,
// column 8 nt + 2t + e%2).
__device__ __forceinline__ void warp_abt(float x[8][4], uint32_t a, uint32_t b, int ld_bytes, int DP) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++) x[nt][0] = x[nt][1] = x[nt][2] = x[nt][3] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < DP; k0 += 16) {
        uint32_t af[4];
        ldsm_x4(af, a + k0 * 2);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t r[4];
            ldsm_x4(r, b + np * 16 * ld_bytes + k0 * 2);
            mma_bf16(x[2 * np], af, r[0], r[2]);
            mma_bf16(x[2 * np + 1], af, r[1], r[3]);
        }
    }
}

// acc (16 x NCAP) += x (16 x 64) tile (64 x DP): x in C layout (as warp_abt leaves it) becomes the A
// operand, the row-major tile (ldmatrix address s, row stride ld_bytes) the B operand; only the first DP
// columns (a multiple of 16, at most NCAP) are computed. Each element sums the 64 rows in increasing order.
// The B fragments of 4 column pairs are loaded before their 8 MMAs (and with FULL, DP == NCAP, nothing is
// predicated): ptxas does not hoist a predicated ldmatrix above the MMAs, so one load per MMA pair would
// expose the shared-memory latency on every pair.
template <int NCAP, bool FULL>
__device__ __forceinline__ void warp_c_times_tile_impl(float (*acc)[4], const float x[8][4], uint32_t s, int ld_bytes,
                                                       int DP) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t af[4];
        pack_a_from_c(af, x[2 * j], x[2 * j + 1]);
#pragma unroll
        for (int np0 = 0; np0 < NCAP / 16; np0 += 4) {
            if (!FULL && np0 * 16 >= DP) break;
            uint32_t r[4][4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (FULL || (np0 + u) * 16 < DP) ldsm_x4_trans(r[u], s + j * 16 * ld_bytes + (np0 + u) * 32);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (FULL || (np0 + u) * 16 < DP) {
                    mma_bf16(acc[2 * (np0 + u)], af, r[u][0], r[u][1]);
                    mma_bf16(acc[2 * (np0 + u) + 1], af, r[u][2], r[u][3]);
                }
            }
        }
    }
}
// acc has at least NCAP / 8 rows of 4.
template <int NCAP>
__device__ __forceinline__ void warp_c_times_tile(float (*acc)[4], const float x[8][4], uint32_t s, int ld_bytes,
                                                  int DP) {
    if (DP == NCAP) warp_c_times_tile_impl<NCAP, true>(acc, x, s, ld_bytes, DP);
    else warp_c_times_tile_impl<NCAP, false>(acc, x, s, ld_bytes, DP);
}

// rows x DP BF16 (contiguous rows of DP elements at g) -> shared tile s (row stride ld), by all threads.
__device__ __forceinline__ void load_tile_async(bf16 *s, int ld, const bf16 *g, int rows, int DP) {
    const int chunks = DP >> 3;  // 16-byte chunks per row
    const uint32_t base = smem_addr(s);
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i - r * chunks;
        cp_async16(base + (uint32_t)((r * ld + c * 8) * 2), g + (size_t)r * DP + c * 8);
    }
}




// ---------------------------------------------------------------------------- pre-pass kernels
// One operand -> BF16 (B, H, Tpad, DP), zeros for t >= T and d >= D. Row (b, t, h) of the operand is read in up to
// two parts: columns [0, D1) from src1 + tok tok_ld1 + h head_ld1 (tok = b T + t; q; kv's k_nope; kv's v, src1 =
// kv + Dn), then columns [D1, D) from the row of a (B, T, ld2) FP32 tensor at src2 that every head shares
// (k_rope, for the key; no second part when D1 = D). So the keys and values are staged from MLA's layout as
// they are, with the same BF16 values a per-head (B, T, H, D) copy of them would give. src1 holds FP32 values
// (attention_forward) or BF16 bits (attention_forward_bf16: MLA's BF16 products, whose rows are tokens at a stride
// of their own). Columns [rope_at, D1) of part 1 (the query's rope part in attention_forward_bf16; rope_at = D1
// elsewhere) are rotated first, pair (x[rope_at + 2j], x[rope_at + 2j + 1]) by the angle of position t and pair j
// with rope_forward_kernel's expressions and table (elementwise.cu), so the values are those of rope_forward.
template <typename Src>
struct ConvertJob {
    const Src *src1;
    const float *src2;
    bf16 *dst;
    int64_t tok_ld1;
    int head_ld1, ld2, D1, D, DP, rope_at;
    // a part's 8-column chunks can be read as whole 16-byte vectors: its rows start 16-byte aligned and, for
    // part 2, the chunks start at a multiple of 4 columns into its rows (D1 % 4 == 0)
    int vec1, vec2;
};
template <typename Src>
struct ConvertJobs {
    ConvertJob<Src> job[3];
    int n;
};

__device__ __forceinline__ float value_of(float x) { return x; }
__device__ __forceinline__ float value_of(bf16 x) { return __bfloat162float(x); }

// The 8 values at p (16-byte aligned) as floats.
__device__ __forceinline__ void load8(float *x, const float *p) {
    const float4 lo = *reinterpret_cast<const float4 *>(p);
    const float4 hi = *reinterpret_cast<const float4 *>(p + 4);
    x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
}
__device__ __forceinline__ void load8(float *x, const bf16 *p) {
    const uint4 v = *reinterpret_cast<const uint4 *>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// rope_forward_kernel's rotation of the pair (x0, x1) by (c, s).
__device__ __forceinline__ float rope_first(float x0, float x1, float c, float s) {
    return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__device__ __forceinline__ float rope_second(float x0, float x1, float c, float s) {
    return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Grid (chunks, H, B): each thread makes one 16-byte chunk (8 BF16) of row t of head h of batch row b
// of every job. rope_cs, rope_sn: the (T, rope_half) cos and sin tables of the rotated columns (NULL if none).
template <typename Src>
__global__ void attention_to_bf16_kernel(ConvertJobs<Src> jobs, int T, int Tpad, int H, const float *rope_cs,
                                         const float *rope_sn, int rope_half) {
    const int h = blockIdx.y, b = blockIdx.z;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
    for (int j = 0; j < 3; j++) {
        if (j >= jobs.n) break;
        const ConvertJob<Src> J = jobs.job[j];
        const int chunks = J.DP >> 3;
        if (idx >= Tpad * chunks) continue;
        const int t = idx / chunks, c0 = (idx - t * chunks) * 8;
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = 0.0f;
        if (t < T) {
            const size_t tok = (size_t)b * T + t;
            const Src *row1 = J.src1 + (int64_t)tok * J.tok_ld1 + (int64_t)h * J.head_ld1;
            const int64_t row2 = (int64_t)tok * J.ld2 - J.D1;  // src2[row2 + c] is the operand's column c >= D1
            if (J.vec1 && c0 + 8 <= J.D1) load8(x, row1 + c0);
            else if (J.vec2 && c0 >= J.D1 && c0 + 8 <= J.D) load8(x, J.src2 + (row2 + c0));
            else {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int c = c0 + i;
                    if (c < J.D1) x[i] = value_of(row1[c]);
                    else if (c < J.D) x[i] = J.src2[row2 + c];
                }
            }
            if (J.rope_at < J.D1 && c0 + 8 > J.rope_at && c0 < J.D1) {  // the chunk holds rotated columns
                const float *cs = rope_cs + (int64_t)t * rope_half, *sn = rope_sn + (int64_t)t * rope_half;
                if (c0 >= J.rope_at && c0 + 8 <= J.D1 && (c0 - J.rope_at) % 2 == 0) {  // four whole pairs
#pragma unroll
                    for (int i = 0; i < 8; i += 2) {
                        const int p = (c0 + i - J.rope_at) >> 1;
                        const float x0 = x[i], x1 = x[i + 1];
                        x[i] = rope_first(x0, x1, cs[p], sn[p]);
                        x[i + 1] = rope_second(x0, x1, cs[p], sn[p]);
                    }
                } else {  // a chunk across the part's edges or pairs: each value from its pair, read again
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int c = c0 + i;
                        if (c < J.rope_at || c >= J.D1) continue;
                        const int p = (c - J.rope_at) >> 1, first = J.rope_at + 2 * p;
                        const float x0 = value_of(row1[first]), x1 = value_of(row1[first + 1]);
                        x[i] = (c - J.rope_at) % 2 == 0 ? rope_first(x0, x1, cs[p], sn[p])
                                                         : rope_second(x0, x1, cs[p], sn[p]);
                    }
                }
            }
        }
        uint4 packed;
        packed.x = pack_bf16(x[0], x[1]), packed.y = pack_bf16(x[2], x[3]);
        packed.z = pack_bf16(x[4], x[5]), packed.w = pack_bf16(x[6], x[7]);
        *reinterpret_cast<uint4 *>(J.dst + (((size_t)b * H + h) * Tpad + t) * J.DP + c0) = packed;
    }
}

// Backward pre-pass, one warp per row t < Tpad of head h of batch row b (grid (Tpad / 8, H, B), 8 warps):
//   dos (B, H, Tpad, DVP) = BF16(dout), zero padded;
//   D (B, H, Tpad)    = sum_d BF16(dout_d) out_d  (each lane sums its columns d = lane, lane + 32, ... in
//                       order, then a butterfly: a fixed order), 0 for t >= T;
//   lse2 (B, H, Tpad) = lse * log2(e), 0 for t >= T.
// D uses the BF16-rounded dout, the same values dP = dO V^T is computed from. dout's row (b, t) is at
// dout + (b T + t) tok_ld: FP32 values (attention_backward, tok_ld = H Dv) or BF16 bits (attention_backward_bf16:
// the output projection's Dgrad product at its own row stride), whose rounding to BF16 is exact.
template <typename Src>
__global__ void attention_backward_prep_kernel(bf16 *dos, float *Dg, float *lse2, const Src *dout, int64_t tok_ld,
                                               const float *out, const float *lse, int T, int Tpad, int H, int Dv,
                                               int DVP) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int h = blockIdx.y, b = blockIdx.z;
    const size_t bh = (size_t)b * H + h;
    bf16 *dst = dos + (bh * Tpad + t) * DVP;
    float dot = 0.0f;
    if (t < T) {
        const size_t at = (((size_t)b * T + t) * H + h) * Dv;  // out's row
        const Src *src = dout + ((int64_t)b * T + t) * tok_ld + (int64_t)h * Dv;
        for (int d = lane; d < DVP; d += 32) {
            const bf16 g = __float2bfloat16_rn(d < Dv ? value_of(src[d]) : 0.0f);
            dst[d] = g;
            if (d < Dv) dot += __bfloat162float(g) * out[at + d];
        }
    } else {
        for (int d = lane; d < DVP; d += 32) dst[d] = __float2bfloat16_rn(0.0f);
    }
    dot = warp_sum(dot);
    if (lane == 0) {
        Dg[bh * Tpad + t] = t < T ? dot : 0.0f;
        lse2[bh * Tpad + t] = t < T ? lse[bh * T + t] * LOG2E : 0.0f;
    }
}

// ---------------------------------------------------------------------------- forward
// qs, ks (B, H, Tpad, DQP), vs (B, H, Tpad, DVP) BF16 -> out (B, T, H, Dv), lse (B, H, T). Grid
// (H, B, n_query_tiles), blockDim = 2 BM (BM / 16 warps), the query tile reversed so the longest rows
// start first. Per key tile, for query row i and key j <= i (x in log2 units, c = scale log2(e)):
//   x_ij = c q_i . k_j;  m_new = max(m, max_j x_ij);  alpha = exp2(m - m_new)
//   l = alpha l + sum_j exp2(x_ij - m_new);   o = alpha o + sum_j bf16(exp2(x_ij - m_new)) v_j
// then out_i = o / l and lse_i = (m + log2(l)) ln(2). Key tile 0 holds key 0, which every row sees, so m
// is finite after it and alpha is exp2(-inf) = 0 there.
template <int DV_CAP>
__global__ void __launch_bounds__(MAX_THREADS)
    attention_forward_kernel(float *out, float *lse, const bf16 *qs, const bf16 *ks, const bf16 *vs, int T, int Tpad,
                             int H, int Dv, int DQP, int DVP, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int BM = blockDim.x / 2, ldq = DQP + ROW_PAD, ldv = DVP + ROW_PAD;
    // buffer 1 of K (V) follows buffer 0 at KT rows, so buffer i is at Ks + i * KT * ldq
    bf16 *Qs = reinterpret_cast<bf16 *>(smem), *Ks = Qs + BM * ldq, *Vs = Ks + 2 * KT * ldq;

    const int h = blockIdx.x, b = blockIdx.y, qt = gridDim.z - 1 - blockIdx.z;
    const int q0 = qt * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + warp * 16;  // this warp's first query row
    const int row0 = wq0 + g, row1 = row0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *kg = ks + bh * Tpad * DQP, *vg = vs + bh * Tpad * DVP;
    const int n_kt = (min(q0 + BM, T) - 1) / KT + 1;  // key tiles up to the block's last real row

    load_tile_async(Qs, ldq, qs + (bh * Tpad + q0) * DQP, BM, DQP);
    load_tile_async(Ks, ldq, kg, KT, DQP);
    load_tile_async(Vs, ldv, vg, KT, DVP);
    cp_async_commit();

    const uint32_t q_addr = smem_addr(Qs + warp * 16 * ldq) + ldsm_lane_offset(ldq, lane);
    const uint32_t k_addr = smem_addr(Ks) + ldsm_lane_offset(ldq, lane), k_buf_bytes = KT * ldq * 2;
    const uint32_t v_addr = smem_addr(Vs) + ldsm_lane_offset(ldv, lane), v_buf_bytes = KT * ldv * 2;

    float o[DV_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < DV_CAP / 8; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait_all();
        __syncthreads();  // tile kt is in; every warp is done with tile kt - 1, whose buffers are refilled now
        if (kt + 1 < n_kt) {
            const int nb = (kt + 1) & 1;
            load_tile_async(Ks + nb * KT * ldq, ldq, kg + (size_t)(kt + 1) * KT * DQP, KT, DQP);
            load_tile_async(Vs + nb * KT * ldv, ldv, vg + (size_t)(kt + 1) * KT * DVP, KT, DVP);
        }
        cp_async_commit();
        const int k0 = kt * KT;
        if (k0 > wq0 + 15 || wq0 >= T) continue;  // every key of the tile is after every row of the warp
        const uint32_t buf = kt & 1;

        float s[8][4];
        warp_abt(s, q_addr, k_addr + buf * k_buf_bytes, ldq * 2, DQP);
        const bool need_mask = k0 + KT - 1 > wq0;  // the tile crosses the diagonal of this warp's rows
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e] * scale_log2;
                if (need_mask && k0 + nt * 8 + 2 * t + (e & 1) > (e < 2 ? row0 : row1)) x = -INFINITY;
                s[nt][e] = x;
                if (e < 2) mx0 = fmaxf(mx0, x);
                else mx1 = fmaxf(mx1, x);
            }
        }
        const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
        const float alpha0 = exp2f(m0 - mn0), alpha1 = exp2f(m1 - mn1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - mn0);
            s[nt][1] = exp2f(s[nt][1] - mn0);
            s[nt][2] = exp2f(s[nt][2] - mn1);
            s[nt][3] = exp2f(s[nt][3] - mn1);
            sum0 += s[nt][0] + s[nt][1];
            sum1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * alpha0 + quad_sum(sum0);
        l1 = l1 * alpha1 + quad_sum(sum1);
        m0 = mn0;
        m1 = mn1;
        scale_rows<DV_CAP / 8>(o, alpha0, alpha1);
        warp_c_times_tile<DV_CAP>(o, s, v_addr + buf * v_buf_bytes, ldv * 2, DVP);
    }

    store_rows<DV_CAP, true>(out + ((size_t)b * T * H + h) * Dv, (size_t)H * Dv, row0, T, 0, Dv, o, l0, l1, t);
    if (t == 0 && row0 < T) lse[bh * T + row0] = (m0 + log2f(l0)) * LN2;
    if (t == 0 && row1 < T) lse[bh * T + row1] = (m1 + log2f(l1)) * LN2;
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out_i = sum_j P_ij v_j, P_ij = exp(s_ij - lse_i), s_ij = scale q_i . k_j
// (j <= i), so with g_i = dout_i:
//   dP_ij = g_i . v_j;   D_i = sum_j P_ij dP_ij = g_i . out_i;   dS_ij = P_ij (dP_ij - D_i)
//   dq_i += scale sum_j dS_ij k_j;   dk_j += scale sum_i dS_ij q_i;   dv_j += sum_i P_ij g_i
// P_ij = exp2(c q_i . k_j - lse2_i), c = scale log2(e), lse2 = lse log2(e) (the pre-pass). The kernels
// fold scale into dS before it is rounded to BF16 for the MMA.

// dq (B, T, H, Dqk) written. Grid (H, B, n_query_tiles), query tiles reversed; blockDim = 2 BM.
template <int DQK_CAP>
__global__ void __launch_bounds__(MAX_THREADS)
    attention_backward_dq_kernel(float *dq, const float *Dg, const float *lse2, const bf16 *qs, const bf16 *ks,
                                 const bf16 *vs, const bf16 *dos, int T, int Tpad, int H, int Dqk, int DQP, int DVP,
                                 float scale, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int BM = blockDim.x / 2, ldq = DQP + ROW_PAD, ldv = DVP + ROW_PAD;
    bf16 *Qs = reinterpret_cast<bf16 *>(smem), *dOs = Qs + BM * ldq, *Ks = dOs + BM * ldv, *Vs = Ks + 2 * KT * ldq;

    const int h = blockIdx.x, b = blockIdx.y, qt = gridDim.z - 1 - blockIdx.z;
    const int q0 = qt * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + warp * 16;
    const int row0 = wq0 + g, row1 = row0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *kg = ks + bh * Tpad * DQP, *vg = vs + bh * Tpad * DVP;
    const int n_kt = (min(q0 + BM, T) - 1) / KT + 1;
    // rows < Tpad always (the padded statistics are 0 beyond T)
    const float lse0 = lse2[bh * Tpad + row0], lse1 = lse2[bh * Tpad + row1];
    const float D0 = Dg[bh * Tpad + row0], D1 = Dg[bh * Tpad + row1];

    load_tile_async(Qs, ldq, qs + (bh * Tpad + q0) * DQP, BM, DQP);
    load_tile_async(dOs, ldv, dos + (bh * Tpad + q0) * DVP, BM, DVP);
    load_tile_async(Ks, ldq, kg, KT, DQP);
    load_tile_async(Vs, ldv, vg, KT, DVP);
    cp_async_commit();

    const uint32_t q_addr = smem_addr(Qs + warp * 16 * ldq) + ldsm_lane_offset(ldq, lane);
    const uint32_t do_addr = smem_addr(dOs + warp * 16 * ldv) + ldsm_lane_offset(ldv, lane);
    const uint32_t k_addr = smem_addr(Ks) + ldsm_lane_offset(ldq, lane), k_buf_bytes = KT * ldq * 2;
    const uint32_t v_addr = smem_addr(Vs) + ldsm_lane_offset(ldv, lane), v_buf_bytes = KT * ldv * 2;

    float acc[DQK_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < DQK_CAP / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait_all();
        __syncthreads();  // as in the forward
        if (kt + 1 < n_kt) {
            const int nb = (kt + 1) & 1;
            load_tile_async(Ks + nb * KT * ldq, ldq, kg + (size_t)(kt + 1) * KT * DQP, KT, DQP);
            load_tile_async(Vs + nb * KT * ldv, ldv, vg + (size_t)(kt + 1) * KT * DVP, KT, DVP);
        }
        cp_async_commit();
        const int k0 = kt * KT;
        if (k0 > wq0 + 15 || wq0 >= T) continue;
        const uint32_t k_tile = k_addr + (kt & 1) * k_buf_bytes;

        float s[8][4], dp[8][4];
        warp_abt(s, q_addr, k_tile, ldq * 2, DQP);                                 // S = Q K^T
        warp_abt(dp, do_addr, v_addr + (kt & 1) * v_buf_bytes, ldv * 2, DVP);  // dP = dO V^T
        const bool need_mask = k0 + KT - 1 > wq0;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool lo = e < 2;
                float p = exp2f(s[nt][e] * scale_log2 - (lo ? lse0 : lse1));
                if (need_mask && k0 + nt * 8 + 2 * t + (e & 1) > (lo ? row0 : row1)) p = 0.0f;
                s[nt][e] = p * (dp[nt][e] - (lo ? D0 : D1)) * scale;  // scale * dS
            }
        }
        warp_c_times_tile<DQK_CAP>(acc, s, k_tile, ldq * 2, DQP);  // dq += (scale dS) K
    }

    store_rows<DQK_CAP, false>(dq + ((size_t)b * T * H + h) * Dqk, (size_t)H * Dqk, row0, T, 0, Dqk, acc, 0.0f, 0.0f,
                               t);
}

// Each key's gradient dk = [dk_nope ; dk_rope] (Dqk = Dn + Dr) and dv written, in kv's layout where kv has them:
// dk_nope (B, T, H, ld) columns 0..Dn-1 and dv (B, T, H, ld) columns 0..Dv-1, ld = Dn + Dv (the host passes
// d_kv and d_kv + Dn); dk_rope (B, T, H, Dr), this head's gradient of the shared rope key, which the host then
// sums over the heads. Any of the three may be NULL (not wanted). Grid (H, B, n_key_tiles), 256 threads: one key
// tile per block (key tile 0, the longest loop, first), looping over query tiles from the diagonal on; the two
// warp groups of the file comment. DK_CAP and DV_CAP are the register capacities of Dqk and Dv; each warp's
// accumulator has the larger.
template <int DK_CAP, int DV_CAP>
__global__ void __launch_bounds__(MAX_THREADS)
    attention_backward_dkv_kernel(float *dk_nope, float *dk_rope, float *dv, const float *Dg, const float *lse2,
                                  const bf16 *qs, const bf16 *ks, const bf16 *vs, const bf16 *dos, int T, int Tpad,
                                  int H, int Dn, int Dr, int Dv, int DQP, int DVP, float scale, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int ldq = DQP + ROW_PAD, ldv = DVP + ROW_PAD;
    // buffer i of Q (dO, lse_s, D_s) is at Qs + i * KT * ldq (dOs + i * KT * ldv, lse_s + i * KT, D_s + i * KT)
    float *Ps = reinterpret_cast<float *>(smem);  // (KT, P_LD): P^T of the current tile pair, [key][query]
    float *lse_s = Ps + KT * P_LD, *D_s = lse_s + 2 * KT;
    bf16 *Ks = reinterpret_cast<bf16 *>(D_s + 2 * KT), *Vs = Ks + KT * ldq, *Qs = Vs + KT * ldv,
         *dOs = Qs + 2 * KT * ldq;

    const int h = blockIdx.x, b = blockIdx.y, kt = blockIdx.z;
    const int k0 = kt * KT;
    const int n_iter = (T + KT - 1) / KT - kt;  // query tiles kt .. last
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool key_group = warp < 4;
    const int wrow = (warp & 3) * 16;  // first key of this warp within the tile
    const int key0 = k0 + wrow + g, key1 = key0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *qg = qs + bh * Tpad * DQP, *dog = dos + bh * Tpad * DVP;
    const float *lse2g = lse2 + bh * Tpad, *Dgh = Dg + bh * Tpad;

    load_tile_async(Ks, ldq, ks + (bh * Tpad + k0) * DQP, KT, DQP);
    load_tile_async(Vs, ldv, vs + (bh * Tpad + k0) * DVP, KT, DVP);
    load_tile_async(Qs, ldq, qg + (size_t)k0 * DQP, KT, DQP);
    load_tile_async(dOs, ldv, dog + (size_t)k0 * DVP, KT, DVP);
    load_row_stats_async(lse_s, lse2g + k0, 0);
    load_row_stats_async(D_s, Dgh + k0, 32);
    cp_async_commit();

    // Key group: first product V dO^T (over Dv), then times Q (Dqk columns out). Value group: K Q^T (over
    // Dqk), then times dO (Dv columns out). x_* are the first product's operands, y_* the second's.
    const int x_ld = key_group ? ldv : ldq, x_dp = key_group ? DVP : DQP;
    const int y_ld = key_group ? ldq : ldv, y_dp = key_group ? DQP : DVP;
    const uint32_t xa = smem_addr((key_group ? Vs : Ks) + wrow * x_ld) + ldsm_lane_offset(x_ld, lane);
    const uint32_t xb = smem_addr(key_group ? dOs : Qs) + ldsm_lane_offset(x_ld, lane), xb_buf_bytes = KT * x_ld * 2;
    const uint32_t ys = smem_addr(key_group ? Qs : dOs) + ldsm_lane_offset(y_ld, lane), ys_buf_bytes = KT * y_ld * 2;
    // A group whose gradient is not wanted skips its products (the value group still makes P^T for dk).
    const bool want_dk = dk_nope != NULL || dk_rope != NULL;
    const bool first_product = key_group ? want_dk : true;
    const bool second_product = key_group ? want_dk : dv != NULL;

    constexpr int ACC_CAP = DK_CAP > DV_CAP ? DK_CAP : DV_CAP;
    float acc[ACC_CAP / 8][4];
#pragma unroll
    for (int nt = 0; nt < ACC_CAP / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    for (int it = 0; it < n_iter; it++) {
        cp_async_wait_all();
        __syncthreads();  // tile it is in; every warp is done with tile it - 1 (its buffers and Ps)
        if (it + 1 < n_iter) {
            const int qn = k0 + (it + 1) * KT, nb = (it + 1) & 1;
            load_tile_async(Qs + nb * KT * ldq, ldq, qg + (size_t)qn * DQP, KT, DQP);
            load_tile_async(dOs + nb * KT * ldv, ldv, dog + (size_t)qn * DVP, KT, DVP);
            load_row_stats_async(lse_s + nb * KT, lse2g + qn, 0);
            load_row_stats_async(D_s + nb * KT, Dgh + qn, 32);
        }
        cp_async_commit();
        const int q0 = k0 + it * KT, buf = it & 1;
        // the diagonal tile, or rows beyond T in the last tile
        const bool need_mask = it == 0 || q0 + KT > T;

        float x[8][4];  // C element (key wrow+g or +8, query 8 nt + 2t + e%2 of the tile)
        if (first_product) warp_abt(x, xa, xb + buf * xb_buf_bytes, x_ld * 2, x_dp);
        if (!key_group) {
            const float *ls = lse_s + buf * KT;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = nt * 8 + 2 * t + (e & 1), row = q0 + ql;
                    float p = exp2f(x[nt][e] * scale_log2 - ls[ql]);
                    if (need_mask && ((e < 2 ? key0 : key1) > row || row >= T)) p = 0.0f;
                    x[nt][e] = p;
                    Ps[(wrow + g + (e < 2 ? 0 : 8)) * P_LD + ql] = p;
                }
            }
        }
        __syncthreads();  // Ps complete
        if (!second_product) continue;
        if (key_group) {
            const float *Ds = D_s + buf * KT;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = nt * 8 + 2 * t + (e & 1);
                    const float p = Ps[(wrow + g + (e < 2 ? 0 : 8)) * P_LD + ql];
                    x[nt][e] = p * (x[nt][e] - Ds[ql]) * scale;  // scale * dS^T
                }
            }
        }
        // dk += (scale dS^T) Q, dv += P^T dO
        if (key_group) warp_c_times_tile<DK_CAP>(acc, x, ys + buf * ys_buf_bytes, y_ld * 2, y_dp);
        else warp_c_times_tile<DV_CAP>(acc, x, ys + buf * ys_buf_bytes, y_ld * 2, y_dp);
    }

    const size_t ld = (size_t)Dn + Dv, head0 = (size_t)b * T * H + h;  // row (b, 0, h) of a (B, T, H, .) tensor
    if (key_group) {
        if (dk_nope != NULL)
            store_rows<ACC_CAP, false>(dk_nope + head0 * ld, H * ld, key0, T, 0, Dn, acc, 0.0f, 0.0f, t);
        if (dk_rope != NULL)
            store_rows<ACC_CAP, false>(dk_rope + head0 * Dr, (size_t)H * Dr, key0, T, Dn, Dn + Dr, acc, 0.0f, 0.0f, t);
    } else if (dv != NULL) {
        store_rows<ACC_CAP, false>(dv + head0 * ld, H * ld, key0, T, 0, Dv, acc, 0.0f, 0.0f, t);
    }
}

// d_k_rope (N, Dr) = the sum over heads of dk_rope (N, H, Dr), N = B T: one thread per output element, the heads
// added in order h = 0 .. H-1 from 0.0f, one rounded addition each (__fadd_rn, which is never contracted): the
// bits of the CPU reference's loop. Consecutive threads read consecutive columns of each head's row.
__global__ void attention_rope_grad_sum_kernel(float *d_k_rope, const float *dk_rope, int64_t n, int H, int Dr) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t tok = i / Dr;
    const float *g = dk_rope + tok * H * Dr + (i - tok * Dr);
    float sum = 0.0f;
    for (int h = 0; h < H; h++) sum = __fadd_rn(sum, g[(int64_t)h * Dr]);
    d_k_rope[i] = sum;
}

// ---------------------------------------------------------------------------- host side
// Register capacity (columns) of a head dim: the accumulator arrays are sized at compile time.
static int head_cap(int D) { return D <= 64 ? 64 : D <= 128 ? 128 : D <= 192 ? 192 : 256; }
static int pad16(int D) { return (D + 15) / 16 * 16; }

static void check_shape(const char *op, int B, int T, int H, int Dn, int Dr, int Dv) {
    const int64_t max_t = (int64_t)65535 * KT;  // query/key tiles go in gridDim.z
    const int Dqk = Dn + Dr;
    if (Dn < 0 || Dr < 0 || Dqk < 1 || Dqk > HEAD_DIM_MAX || Dv < 1 || Dv > HEAD_DIM_MAX || H > 65535 || B > 65535 ||
        T > max_t) {
        fprintf(stderr, "fp8moe: %s (kernels/cuda/attention.cu): got B = %d, T = %d, H = %d, Dn = %d, Dr = %d, "
                        "Dv = %d; the CUDA attention core supports Dn, Dr >= 0, head dims Dqk = Dn + Dr and Dv 1 .. %d, "
                        "B, H <= 65535 and T <= %lld\n",
                op, B, T, H, Dn, Dr, Dv, HEAD_DIM_MAX, (long long)max_t);
        exit(1);
    }
}

static size_t bf16_rows(int rows, int DP) { return sizeof(bf16) * (size_t)rows * (size_t)(DP + ROW_PAD); }
static size_t forward_smem(int BM, int DQP, int DVP) {
    return bf16_rows(BM, DQP) + 2 * (bf16_rows(KT, DQP) + bf16_rows(KT, DVP));
}
static size_t dq_smem(int BM, int DQP, int DVP) {
    return bf16_rows(BM, DQP) + bf16_rows(BM, DVP) + 2 * (bf16_rows(KT, DQP) + bf16_rows(KT, DVP));
}
static size_t dkv_smem(int DQP, int DVP) {
    return sizeof(float) * (size_t)KT * (P_LD + 4) + 3 * (bf16_rows(KT, DQP) + bf16_rows(KT, DVP));
}
// 128 query rows per block when they fit in shared memory, else 64.
static int pick_bm(size_t (*smem)(int, int, int), int DQP, int DVP) {
    return smem(128, DQP, DVP) <= smem_limit() ? 128 : 64;
}

// The backward's BF16 copy of dout (B, H, Tpad, DVP), its D and lse2 (B, H, Tpad), and the per-head rope-key
// gradients (B, T, H, Dr) that it sums over the heads into d_k_rope.
static Scratch dout_scratch, stats_scratch, rope_grad_scratch;

static int wgmma_enabled = 1;  // cuda_attention_wgmma
extern "C" int cuda_attention_wgmma(int enable) {
    const int previous = wgmma_enabled;
    wgmma_enabled = enable != 0;
    return previous;
}
static bool use_wgmma(const Staged *s) { return wgmma_enabled && attention_wgmma_supported(s->DQP, s->DVP); }

// The state (kernels.h): lse (B, H, T) FP32, then the forward's staged BF16 q, k (B, H, Tpad, DQP) and v (B, H,
// Tpad, DVP), each starting STATE_ALIGN bytes aligned (cudaMalloc's alignment, which the arena's state has).
// Keeping them there spares the backward the conversion of q, kv and k_rope (a pass over about 370 MB per layer
// at 8 x 2048 tokens), and lets MLA reuse q's and kv's FP32 memory after the forward (train/block.c).
static const size_t STATE_ALIGN = 256;
static size_t align_up(size_t n) { return (n + STATE_ALIGN - 1) / STATE_ALIGN * STATE_ALIGN; }

struct StateLayout {
    int Tpad, DQP, DVP;
    size_t q_at, k_at, v_at, bytes;  // byte offsets in the state, and its size
};

static StateLayout state_layout(int B, int T, int H, int Dn, int Dr, int Dv) {
    StateLayout l;
    l.Tpad = (T + T_ALIGN - 1) / T_ALIGN * T_ALIGN, l.DQP = pad16(Dn + Dr), l.DVP = pad16(Dv);
    const size_t nq = (size_t)B * H * l.Tpad * l.DQP, nv = (size_t)B * H * l.Tpad * l.DVP;
    l.q_at = align_up(sizeof(float) * (size_t)B * H * T);
    l.k_at = align_up(l.q_at + sizeof(bf16) * nq);
    l.v_at = align_up(l.k_at + sizeof(bf16) * nq);
    l.bytes = l.v_at + sizeof(bf16) * nv;
    return l;
}

extern "C" int64_t cuda_attention_state_elems(int B, int T, int H, int Dn, int Dr, int Dv) {
    if (B <= 0 || T <= 0 || H <= 0) return 0;
    return (int64_t)((state_layout(B, T, H, Dn, Dr, Dv).bytes + sizeof(float) - 1) / sizeof(float));
}

// The staged operands that live in the state; dout, D and lse2 are the backward's to set.
static Staged staged_in_state(const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
    const StateLayout l = state_layout(B, T, H, Dn, Dr, Dv);
    unsigned char *base = (unsigned char *)state;  // the kernels only read q, k, v in the backward
    if ((uintptr_t)base % STATE_ALIGN != 0) {
        fprintf(stderr, "fp8moe: attention (kernels/cuda/attention.cu): the state at %p is not %zu-byte aligned - "
                        "expected a buffer of its own from device_alloc\n", (const void *)state, STATE_ALIGN);
        exit(1);
    }
    Staged s;
    s.Tpad = l.Tpad, s.DQP = l.DQP, s.DVP = l.DVP;
    s.q = (bf16 *)(base + l.q_at), s.k = (bf16 *)(base + l.k_at), s.v = (bf16 *)(base + l.v_at);
    s.dout = NULL, s.D = s.lse2 = NULL;
    return s;
}

// The three jobs of the forward's pre-pass: q as it is (its rope part rotated from rope_at on); the key [k_nope
// from kv ; k_rope]; the value from kv (its rows Dn values in). q_tok, kv_tok: the row strides of a token (head
// strides Dqk and Dn + Dv), rope_at = Dqk for no rotation. Launches attention_to_bf16_kernel<Src>.
template <typename Src>
static void stage_jobs(const Staged &s, const Src *q, int64_t q_tok, const Src *kv, int64_t kv_tok,
                       const float *k_rope, int B, int T, int H, int Dn, int Dr, int Dv, int rope_at,
                       const float *rope_cs) {
    const int Dqk = Dn + Dr;
    const int vec_elems = 16 / (int)sizeof(Src);  // a 16-byte load's values
    ConvertJobs<Src> jobs;
    const Src *src1[3] = {q, kv, kv + Dn};
    const float *src2[3] = {NULL, k_rope, NULL};
    bf16 *dst[3] = {s.q, s.k, s.v};
    const int64_t tok_ld1[3] = {q_tok, kv_tok, kv_tok};
    const int head_ld1[3] = {Dqk, Dn + Dv, Dn + Dv}, ld2[3] = {0, Dr, 0};
    const int D1[3] = {Dqk, Dn, Dv}, D[3] = {Dqk, Dqk, Dv}, rope[3] = {rope_at, Dn, Dv};
    int max_chunks = 0;
    for (int j = 0; j < 3; j++) {
        ConvertJob<Src> *J = &jobs.job[j];
        J->src1 = src1[j], J->src2 = D[j] > D1[j] ? src2[j] : NULL, J->dst = dst[j];
        J->tok_ld1 = tok_ld1[j], J->head_ld1 = head_ld1[j], J->ld2 = ld2[j];
        J->D1 = D1[j], J->D = D[j], J->DP = pad16(D[j]), J->rope_at = rope[j];
        J->vec1 = tok_ld1[j] % vec_elems == 0 && head_ld1[j] % vec_elems == 0 && (uintptr_t)src1[j] % 16 == 0;
        J->vec2 = J->src2 != NULL && ld2[j] % 4 == 0 && D1[j] % 4 == 0 && (uintptr_t)J->src2 % 16 == 0;
        if (J->DP / 8 > max_chunks) max_chunks = J->DP / 8;
    }
    jobs.n = 3;
    const int threads = 256;
    const dim3 grid((unsigned)(((size_t)s.Tpad * max_chunks + threads - 1) / threads), (unsigned)H, (unsigned)B);
    const int half = Dr / 2;
    attention_to_bf16_kernel<Src><<<grid, threads>>>(jobs, T, s.Tpad, H, rope_cs,
                                                     rope_cs != NULL ? rope_cs + (size_t)T * half : NULL, half);
    CUDA_CHECK_LAUNCH("attention_to_bf16_kernel");
}

template <int DV_CAP>
static void launch_forward(float *out, float *lse, const Staged *s, int B, int T, int H, int Dqk, int Dv) {
    const int BM = pick_bm(forward_smem, s->DQP, s->DVP);
    const size_t smem = forward_smem(BM, s->DQP, s->DVP);
    allow_smem(attention_forward_kernel<DV_CAP>, smem, "attention_forward_kernel");
    const dim3 grid((unsigned)H, (unsigned)B, (unsigned)((T + BM - 1) / BM));
    const float scale = 1.0f / sqrtf((float)Dqk);
    attention_forward_kernel<DV_CAP><<<grid, 2 * BM, smem>>>(out, lse, s->q, s->k, s->v, T, s->Tpad, H, Dv, s->DQP,
                                                             s->DVP, scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

// The forward's kernels on the staged operands: out and the lse (the state's first part).
static void run_forward(float *out, float *state, const Staged &s, int B, int T, int H, int Dqk, int Dv) {
    if (use_wgmma(&s)) {
        attention_wgmma_forward(out, state, &s, B, T, H, Dqk, Dv);
        return;
    }
    switch (head_cap(Dv)) {
    case 64: launch_forward<64>(out, state, &s, B, T, H, Dqk, Dv); break;
    case 128: launch_forward<128>(out, state, &s, B, T, H, Dqk, Dv); break;
    case 192: launch_forward<192>(out, state, &s, B, T, H, Dqk, Dv); break;
    default: launch_forward<256>(out, state, &s, B, T, H, Dqk, Dv); break;
    }
}

// state = lse (B, H, T) and the staged q, k, v (state_layout), see kernels.h.
extern "C" void cuda_attention_forward(real *out, real *state, const real *q, const real *kv, const real *k_rope,
                                       int B, int T, int H, int Dn, int Dr, int Dv) {
    check_shape("attention_forward", B, T, H, Dn, Dr, Dv);
    if (B <= 0 || T <= 0 || H <= 0) return;
    const int Dqk = Dn + Dr;
    const Staged s = staged_in_state(state, B, T, H, Dn, Dr, Dv);
    stage_jobs<float>(s, q, (int64_t)H * Dqk, kv, (int64_t)H * (Dn + Dv), k_rope, B, T, H, Dn, Dr, Dv, Dqk, NULL);
    run_forward(out, state, s, B, T, H, Dqk, Dv);
}

// The same on MLA's BF16 products (kernels.h attention_forward_bf16): q16's rope part rotated in the pre-pass.
extern "C" void cuda_attention_forward_bf16(real *out, real *state, const uint16_t *q16, int64_t ldq,
                                            const uint16_t *kv16, int64_t ldkv, const real *k_rope, int B, int T,
                                            int H, int Dn, int Dr, int Dv, real rope_theta) {
    check_shape("attention_forward_bf16", B, T, H, Dn, Dr, Dv);
    const int Dqk = Dn + Dr;
    if (Dr % 2 != 0 || ldq < (int64_t)H * Dqk || ldkv < (int64_t)H * (Dn + Dv)) {
        fprintf(stderr, "fp8moe: attention_forward_bf16 (kernels/cuda/attention.cu): got Dr = %d, ldq = %lld, ldkv = "
                        "%lld for H = %d heads of Dqk = %d and Dn + Dv = %d; expected an even Dr (RoPE rotates pairs) "
                        "and row strides of at least H Dqk and H (Dn + Dv)\n",
                Dr, (long long)ldq, (long long)ldkv, H, Dqk, Dn + Dv);
        exit(1);
    }
    if (B <= 0 || T <= 0 || H <= 0) return;
    const Staged s = staged_in_state(state, B, T, H, Dn, Dr, Dv);
    const float *rope_cs = Dr > 0 ? cuda_rope_table(T, Dr, rope_theta) : NULL;
    stage_jobs<bf16>(s, (const bf16 *)q16, ldq, (const bf16 *)kv16, ldkv, k_rope, B, T, H, Dn, Dr, Dv, Dn, rope_cs);
    run_forward(out, state, s, B, T, H, Dqk, Dv);
}

template <int DQK_CAP> static void launch_dq(float *dq, const Staged *s, int B, int T, int H, int Dqk) {
    const int BM = pick_bm(dq_smem, s->DQP, s->DVP);
    const size_t smem = dq_smem(BM, s->DQP, s->DVP);
    allow_smem(attention_backward_dq_kernel<DQK_CAP>, smem, "attention_backward_dq_kernel");
    const dim3 grid((unsigned)H, (unsigned)B, (unsigned)((T + BM - 1) / BM));
    const float scale = 1.0f / sqrtf((float)Dqk);
    attention_backward_dq_kernel<DQK_CAP><<<grid, 2 * BM, smem>>>(dq, s->D, s->lse2, s->q, s->k, s->v, s->dout, T,
                                                                  s->Tpad, H, Dqk, s->DQP, s->DVP, scale,
                                                                  scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_backward_dq_kernel");
}


template <int DK_CAP, int DV_CAP>
static void launch_dkv(const DkvOut *o, const Staged *s, int B, int T, int H, int Dn, int Dr, int Dv) {
    const size_t smem = dkv_smem(s->DQP, s->DVP);
    allow_smem(attention_backward_dkv_kernel<DK_CAP, DV_CAP>, smem, "attention_backward_dkv_kernel");
    const dim3 grid((unsigned)H, (unsigned)B, (unsigned)((T + KT - 1) / KT));
    const float scale = 1.0f / sqrtf((float)(Dn + Dr));
    attention_backward_dkv_kernel<DK_CAP, DV_CAP><<<grid, MAX_THREADS, smem>>>(
        o->dk_nope, o->dk_rope, o->dv, s->D, s->lse2, s->q, s->k, s->v, s->dout, T, s->Tpad, H, Dn, Dr, Dv, s->DQP,
        s->DVP, scale, scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_backward_dkv_kernel");
}

template <int DK_CAP>
static void launch_dkv_any_dv(const DkvOut *o, const Staged *s, int B, int T, int H, int Dn, int Dr, int Dv) {
    switch (head_cap(Dv)) {
    case 64: launch_dkv<DK_CAP, 64>(o, s, B, T, H, Dn, Dr, Dv); break;
    case 128: launch_dkv<DK_CAP, 128>(o, s, B, T, H, Dn, Dr, Dv); break;
    case 192: launch_dkv<DK_CAP, 192>(o, s, B, T, H, Dn, Dr, Dv); break;
    default: launch_dkv<DK_CAP, 256>(o, s, B, T, H, Dn, Dr, Dv); break;
    }
}

// out = the forward's output, state its lse (B, H, T) and staged q, k, v, both from cuda_attention_forward(_bf16);
// dout's row (b, t) at dout + (b T + t) tok_ld (attention_backward_prep_kernel).
template <typename Src>
static void attention_backward_from(const char *op, real *dq, real *d_kv, real *d_k_rope, const Src *dout,
                                    int64_t tok_ld, const real *out, const real *state, int B, int T, int H, int Dn,
                                    int Dr, int Dv) {
    check_shape(op, B, T, H, Dn, Dr, Dv);
    const int Dqk = Dn + Dr;
    const bool want_rope = d_k_rope != NULL && Dr > 0;
    DkvOut o = {d_kv != NULL && Dn > 0 ? d_kv : NULL, NULL, d_kv != NULL ? d_kv + Dn : NULL};
    if (B <= 0 || T <= 0 || H <= 0 || (dq == NULL && o.dk_nope == NULL && !want_rope && o.dv == NULL)) return;
    const int64_t n_rope = (int64_t)B * T * Dr;
    if (want_rope) o.dk_rope = (float *)cuda_scratch(&rope_grad_scratch, sizeof(float) * (size_t)n_rope * H);
    Staged s = staged_in_state(state, B, T, H, Dn, Dr, Dv);
    const size_t ns = (size_t)B * H * s.Tpad;
    s.dout = (bf16 *)cuda_scratch(&dout_scratch, sizeof(bf16) * ns * s.DVP);
    s.D = (float *)cuda_scratch(&stats_scratch, sizeof(float) * 2 * ns);
    s.lse2 = s.D + ns;
    const int threads = 256;  // 8 rows (warps) per block; Tpad is a multiple of 8
    const dim3 prep_grid((unsigned)(s.Tpad / 8), (unsigned)H, (unsigned)B);
    attention_backward_prep_kernel<Src><<<prep_grid, threads>>>(s.dout, s.D, s.lse2, dout, tok_ld, out, state, T,
                                                                s.Tpad, H, Dv, s.DVP);
    CUDA_CHECK_LAUNCH("attention_backward_prep_kernel");
    const bool wgmma = use_wgmma(&s);
    if (dq != NULL && wgmma) attention_wgmma_dq(dq, &s, B, T, H, Dqk);
    else if (dq != NULL) {
        switch (head_cap(Dqk)) {
        case 64: launch_dq<64>(dq, &s, B, T, H, Dqk); break;
        case 128: launch_dq<128>(dq, &s, B, T, H, Dqk); break;
        case 192: launch_dq<192>(dq, &s, B, T, H, Dqk); break;
        default: launch_dq<256>(dq, &s, B, T, H, Dqk); break;
        }
    }
    if ((o.dk_nope != NULL || o.dk_rope != NULL || o.dv != NULL) && wgmma) {
        attention_wgmma_dkv(&o, &s, B, T, H, Dn, Dr, Dv);
    } else if (o.dk_nope != NULL || o.dk_rope != NULL || o.dv != NULL) {
        switch (head_cap(Dqk)) {
        case 64: launch_dkv_any_dv<64>(&o, &s, B, T, H, Dn, Dr, Dv); break;
        case 128: launch_dkv_any_dv<128>(&o, &s, B, T, H, Dn, Dr, Dv); break;
        case 192: launch_dkv_any_dv<192>(&o, &s, B, T, H, Dn, Dr, Dv); break;
        default: launch_dkv_any_dv<256>(&o, &s, B, T, H, Dn, Dr, Dv); break;
        }
    }
    if (want_rope) {  // after the dkv kernel, on the same stream: every head's gradient is in the scratch
        const int sum_threads = 256;
        const unsigned blocks = (unsigned)((n_rope + sum_threads - 1) / sum_threads);
        attention_rope_grad_sum_kernel<<<blocks, sum_threads>>>(d_k_rope, o.dk_rope, n_rope, H, Dr);
        CUDA_CHECK_LAUNCH("attention_rope_grad_sum_kernel");
    }
}

extern "C" void cuda_attention_backward(real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *out,
                                        const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
    attention_backward_from<float>("attention_backward", dq, d_kv, d_k_rope, dout, (int64_t)H * Dv, out, state, B, T,
                                   H, Dn, Dr, Dv);
}

extern "C" void cuda_attention_backward_bf16(real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                                             const real *out, const real *state, int B, int T, int H, int Dn, int Dr,
                                             int Dv) {
    if (ld < (int64_t)H * Dv) {
        fprintf(stderr, "fp8moe: attention_backward_bf16 (kernels/cuda/attention.cu): row stride ld = %lld is below "
                        "the H Dv = %d values of a token's row\n", (long long)ld, H * Dv);
        exit(1);
    }
    attention_backward_from<bf16>("attention_backward_bf16", dq, d_kv, d_k_rope, (const bf16 *)dout16, ld, out, state,
                                  B, T, H, Dn, Dr, Dv);
}
