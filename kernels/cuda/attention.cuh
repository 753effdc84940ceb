/*
 * attention.cuh - what the two implementations of the CUDA attention core share (kernels.h attention_forward /
 * attention_backward): attention.cu holds the BF16 staging pre-pass, the mma.sync kernels (any head dim) and the
 * host dispatch; attention_wgmma.cu the Hopper kernels (wgmma, sm_90a) for the head dims they support. Both read
 * the same staged BF16 operands (Staged below) and write the same outputs, so the dispatch can pick either per
 * call. The device helpers here are the ones both kernel families use (the cp.async copies are common.cuh's): the C -> A fragment
 * repacking that feeds P and dS into the second product, the quad reductions of the online softmax, and the row
 * stores of an accumulator (whose per-warp layout is the same for mma.sync m16n8 tiles and a wgmma m64 tile).
 */
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

typedef __nv_bfloat16 bf16;

constexpr int KT = 64;        // rows of a tile of the mma.sync kernels; query rows per tile of both dkv kernels
constexpr int T_ALIGN = 128;  // the scratch's rows are padded to a multiple of the largest tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------- device helpers
// Two floats rounded to BF16 (RNE) in one register, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

// The A fragment (k = [16j, 16j+16)) made of C fragments x[2j] (columns 16j..16j+7) and x[2j+1].
__device__ __forceinline__ void pack_a_from_c(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

// KT floats (64, 16-byte aligned) -> shared, by threads [first, first + 16).
__device__ __forceinline__ void load_row_stats_async(float *s, const float *g, int first) {
    const int i = (int)threadIdx.x - first;
    if (i >= 0 && i < KT / 4) cp_async16(smem_addr(s + 4 * i), g + 4 * i);
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

// The online softmax's rescaling of a warp's accumulator when its rows' running maxima grow: row g's columns
// (elements 0, 1 of each 8-column fragment) times alpha0, row g + 8's (elements 2, 3) times alpha1.
template <int NT> __device__ __forceinline__ void scale_rows(float (*acc)[4], float alpha0, float alpha1) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        acc[nt][0] *= alpha0;
        acc[nt][1] *= alpha0;
        acc[nt][2] *= alpha1;
        acc[nt][3] *= alpha1;
    }
}

// The columns [col0, col_end) of the C fragments of a warp's 16 rows (row0 = its row g, row0 + 8 the row g + 8):
// element (row, col) to dst + row * row_stride + (col - col0), only rows < n_rows. A window (col0 > 0, or
// col_end below the accumulator's columns) lets one accumulator go to two places: the dkv kernel's key gradient
// [dk_nope ; dk_rope] is stored to kv's layout and to the rope scratch. NORMALISE divides by the row's softmax
// sum l (the forward's out = o / l); the backward writes its gradients as they are.
template <int NCAP, bool NORMALISE>
__device__ __forceinline__ void store_rows(float *dst, size_t row_stride, int row0, int n_rows, int col0, int col_end,
                                           const float acc[NCAP / 8][4], float l0, float l1, int t) {
    // a thread's columns are the pairs (col, col + 1), col even: with col0, col_end and the row stride even and
    // dst 8-byte aligned, a pair is wholly inside the window or wholly outside, and 8-byte aligned
    const bool pairs = ((col0 | col_end | (int)row_stride) & 1) == 0 && ((uintptr_t)dst & 7) == 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + 8 * half;
        if (row >= n_rows) continue;
        float *p = dst + (size_t)row * row_stride;
        const float l = half ? l1 : l0;
#pragma unroll
        for (int nt = 0; nt < NCAP / 8; nt++) {
            const int col = nt * 8 + 2 * t;
            if (col >= col_end || col + 1 < col0) continue;  // neither column of the pair is in the window
            float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
            if (NORMALISE) v0 = v0 / l, v1 = v1 / l;
            if (pairs) {
                *reinterpret_cast<float2 *>(p + (col - col0)) = make_float2(v0, v1);
            } else {
                if (col >= col0) p[col - col0] = v0;
                if (col + 1 < col_end) p[col + 1 - col0] = v1;
            }
        }
    }
}

// ---------------------------------------------------------------------------- host side
// The opt-in shared memory per block of the current device (232448 bytes on an H200).
static size_t smem_limit(void) {
    int dev = 0, bytes = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return (size_t)bytes;
}

// Dynamic shared memory above 48 KiB must be allowed per kernel.
template <typename Kernel> static void allow_smem(Kernel kernel, size_t bytes, const char *name) {
    if (bytes > smem_limit()) {
        fprintf(stderr, "fp8moe: kernels/cuda/attention: %s needs %zu bytes of shared memory per block; this "
                        "GPU allows %zu (expected an H100/H200-class GPU)\n", name, bytes, smem_limit());
        exit(1);
    }
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// The staged BF16 operands (attention.cu stage_inputs): q, k, v, dout as (B, H, Tpad, DP) row-major, DP = the
// head dim rounded up to 16, zeros in the padding rows and columns; the backward's D and lse2 (B, H, Tpad).
typedef struct {
    int Tpad, DQP, DVP;
    bf16 *q, *k, *v, *dout;
    float *D, *lse2;
} Staged;

// The dkv kernel's destinations (its comment): dk_nope and dv in d_kv, dk_rope the per-head scratch; NULL = not wanted.
typedef struct {
    float *dk_nope, *dk_rope, *dv;
} DkvOut;

// attention_wgmma.cu: whether its kernels serve these padded head dims on the current device, and the three
// launches (each the same function as its mma.sync counterpart in attention.cu).
bool attention_wgmma_supported(int DQP, int DVP);
void attention_wgmma_forward(float *out, float *lse, const Staged *s, int B, int T, int H, int Dqk, int Dv);
void attention_wgmma_dq(float *dq, const Staged *s, int B, int T, int H, int Dqk);
void attention_wgmma_dkv(const DkvOut *o, const Staged *s, int B, int T, int H, int Dn, int Dr, int Dv);
