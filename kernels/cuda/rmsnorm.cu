/*
 * rmsnorm.cu - CUDA RMSNorm forward and backward (kernels.h: rmsnorm_forward / rmsnorm_backward / _bf16),
 * the same function as the CPU reference cpu_rmsnorm_* and checked against it by tests/gpu.
 *
 * Deterministic: every sum is a fixed-order tree (block_sum) or a fixed-order loop; no atomics.
 * The weight gradient is a sum over all N rows. It is done in two kernels: each block of the backward
 * kernel, besides its rows' input gradients, sums its chunk of RMSNORM_BWD_ROWS rows per column into a
 * scratch buffer of per-chunk partials; the second kernel adds the partials of each column in a fixed tree.
 * The chunking depends only on N (never on the GPU or timing), so results are bitwise reproducible, and a
 * call that asks for one gradient only gets the bits it gets beside the other. The scratch buffer is a
 * process-wide cache grown on demand with cudaMalloc and kept (ceil(N / 32) * C floats, 4 MiB at N = 16384,
 * C = 2048); all ops run on the default stream, so consecutive calls cannot overlap on it. (If ops ever run
 * on several streams or host threads, this cache must become per stream.)
 */
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

// ---------------------------------------------------------------------------- forward
// inp (N, C), weight (C) -> out (N, C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp^2) + eps); out NULL: rstd
// only (kernels.h). One block per row: the row's sum of squares is a block reduction, then the block writes the row.
// Thread t holds the row's columns t, t + 256, ... (PER of them, PER = ceil(C / 256)) in registers: all its loads
// are issued before the first add, so enough bytes are in flight to keep the memory busy (one load at a time per
// thread moved about half of the bandwidth), and the row is read once. PER = 0 is the loop form for rows too long
// for registers. Every form adds the same columns in the same order (per thread in column order, then block_sum),
// so they give the same bits.
static const int RMSNORM_THREADS = 256;
static const int RMSNORM_MAX_PER = 16;  // columns per thread held in registers: C <= 4096

template <int PER>
__global__ void __launch_bounds__(RMSNORM_THREADS)
    rmsnorm_forward_kernel(float *out, float *rstd, const float *inp, const float *weight, int C) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = inp + row * C;

    float sum_sq = 0.0f;
    float v[PER > 0 ? PER : 1];
    if constexpr (PER > 0) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            v[i] = c < C ? x[c] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (threadIdx.x + i * RMSNORM_THREADS < C) sum_sq = __fadd_rn(sum_sq, __fmul_rn(v[i], v[i]));
    } else {
        for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS) sum_sq = __fadd_rn(sum_sq, __fmul_rn(x[c], x[c]));
    }
    sum_sq = block_sum(sum_sq, scratch);

    const float r = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)C), (float)RMSNORM_EPS)));
    if (threadIdx.x == 0) rstd[row] = r;
    if (out == NULL) return;
    float *y = out + row * C;
    if constexpr (PER > 0) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            if (c < C) y[c] = rmsnorm_element(v[i], r, weight[c]);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS) y[c] = rmsnorm_element(x[c], r, weight[c]);
    }
}

// The kernels' PER for C columns on RMSNORM_THREADS threads: the smallest of {1, 2, 4, 8, 16} covering them, or 0
// (the loop form) past RMSNORM_MAX_PER.
static int columns_per_thread(int C) {
    const int per = (C + RMSNORM_THREADS - 1) / RMSNORM_THREADS;
    return per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : per <= 8 ? 8 : per <= RMSNORM_MAX_PER ? RMSNORM_MAX_PER : 0;
}

extern "C" void cuda_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C) {
    if (N <= 0 || C <= 0) return;
    switch (columns_per_thread(C)) {
    case 1: rmsnorm_forward_kernel<1><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C); break;
    case 2: rmsnorm_forward_kernel<2><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C); break;
    case 4: rmsnorm_forward_kernel<4><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C); break;
    case 8: rmsnorm_forward_kernel<8><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C); break;
    case RMSNORM_MAX_PER:
        rmsnorm_forward_kernel<RMSNORM_MAX_PER><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C);
        break;
    default: rmsnorm_forward_kernel<0><<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C); break;
    }
    CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out_c = inp_c * rstd * weight_c with rstd = (mean(inp^2) + eps)^-1/2,
// and d rstd / d inp_c = -rstd^3 inp_c / C. So, per row:
//   dinp_c  += rstd * (dout_c weight_c - inp_c * rstd^2 * (sum_j dout_j weight_j inp_j) / C)
//   dweight_c += sum over rows of dout_c * inp_c * rstd
// (the same expressions, in the same order, as cpu_rmsnorm_backward; only the sums' order differs).
// One pass over dout and inp gives both: each block takes RMSNORM_BWD_ROWS consecutive rows, one after the other.
// For each row it computes dinp as the forward computes out (the dot product a block reduction; the row's dout,
// inp and dinp in registers, PER columns per thread; the weight loaded once per block), and each thread adds the
// row's dout * inp * rstd of its columns to its running sums: the block's chunk of the weight gradient's sum,
// written as one row of partial (n_chunks, C). A second kernel adds the chunks per column (file comment). A
// separate weight-gradient kernel read dout and inp a second time: 8 of the 24 bytes per element the backward
// moved. The loop form (PER = 0) keeps its running sums in its partial row instead of registers. Four blocks per SM
// (at most 64 registers) for PER <= 8: at the bench model's 16,384 rows its 512 blocks are then one wave.
// dout is FP32 or BF16 bits (rmsnorm_backward_bf16: GEMMs' BF16 products, rows of stride ld), widened exactly, the
// sum in order of n_src such arrays src_stride values apart (FP32 dout: one).
static const int RMSNORM_BWD_ROWS = 32;

__device__ inline float dout_value(float v) { return v; }
__device__ inline float dout_value(uint16_t v) { return bf16_bits_to_float(v); }
template <typename Dout>
__device__ inline float dout_at(const Dout *dy, int c, int n_src, int64_t src_stride) {
    float v = dout_value(dy[c]);
    for (int i = 1; i < n_src; i++) v = __fadd_rn(v, dout_value(dy[c + i * src_stride]));
    return v;
}

template <int PER, bool DINP, bool DWEIGHT, typename Dout>
__global__ void __launch_bounds__(RMSNORM_THREADS, PER <= 8 ? 4 : 2)
    rmsnorm_backward_kernel(float *dinp, float *partial, const Dout *dout, int64_t ld, int n_src, int64_t src_stride,
                            const float *inp, const float *weight, const float *rstd, int N, int C) {
    __shared__ float scratch[32];
    const int row0 = blockIdx.x * RMSNORM_BWD_ROWS, row1 = min(N, row0 + RMSNORM_BWD_ROWS);
    float *part = DWEIGHT ? partial + (int64_t)blockIdx.x * C : NULL;
    if constexpr (PER > 0) {
        float vw[PER], acc[PER];
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            vw[i] = DINP && c < C ? weight[c] : 0.0f;
            acc[i] = 0.0f;
        }
        for (int row = row0; row < row1; row++) {
            const float *x = inp + (int64_t)row * C;
            const Dout *dy = dout + (int64_t)row * ld;
            const float r = rstd[row];
            float vx[PER], vdy[PER], vdx[PER];
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int c = threadIdx.x + i * RMSNORM_THREADS;
                const bool in = c < C;
                vx[i] = in ? x[c] : 0.0f, vdy[i] = in ? dout_value(dy[c]) : 0.0f;
                if constexpr (DINP) vdx[i] = in ? dinp[(int64_t)row * C + c] : 0.0f;
            }
            // dout's other sources, added in order: each source's PER loads in flight together (dout_at per column
            // waited for each load before issuing the next)
            for (int src = 1; src < n_src; src++) {
                float more[PER];
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int c = threadIdx.x + i * RMSNORM_THREADS;
                    more[i] = c < C ? dout_value(dy[c + src * src_stride]) : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < PER; i++) vdy[i] = __fadd_rn(vdy[i], more[i]);
            }
            if constexpr (DWEIGHT) {
#pragma unroll
                for (int i = 0; i < PER; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(vdy[i], __fmul_rn(vx[i], r)));
            }
            if constexpr (DINP) {
                float dot = 0.0f;  // sum_j dout_j weight_j inp_j
#pragma unroll
                for (int i = 0; i < PER; i++)
                    if (threadIdx.x + i * RMSNORM_THREADS < C)
                        dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(vdy[i], vw[i]), vx[i]));
                dot = block_sum(dot, scratch);
                const float coef = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(dot, (float)C));
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int c = threadIdx.x + i * RMSNORM_THREADS;
                    const float term = __fsub_rn(__fmul_rn(vdy[i], vw[i]), __fmul_rn(vx[i], coef));
                    if (c < C) dinp[(int64_t)row * C + c] = __fadd_rn(vdx[i], __fmul_rn(r, term));
                }
            }
        }
        if constexpr (DWEIGHT) {
#pragma unroll
            for (int i = 0; i < PER; i++)
                if (threadIdx.x + i * RMSNORM_THREADS < C) part[threadIdx.x + i * RMSNORM_THREADS] = acc[i];
        }
    } else {
        for (int row = row0; row < row1; row++) {
            const float *x = inp + (int64_t)row * C;
            const Dout *dy = dout + (int64_t)row * ld;
            const float r = rstd[row];
            if constexpr (DWEIGHT) {
                for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS)
                    part[c] = __fadd_rn(row == row0 ? 0.0f : part[c],
                                        __fmul_rn(dout_at(dy, c, n_src, src_stride), __fmul_rn(x[c], r)));
            }
            if constexpr (DINP) {
                float *dx = dinp + (int64_t)row * C;
                float dot = 0.0f;
                for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS)
                    dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(dout_at(dy, c, n_src, src_stride), weight[c]), x[c]));
                dot = block_sum(dot, scratch);
                const float coef = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(dot, (float)C));
                for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS) {
                    const float term =
                        __fsub_rn(__fmul_rn(dout_at(dy, c, n_src, src_stride), weight[c]), __fmul_rn(x[c], coef));
                    dx[c] = __fadd_rn(dx[c], __fmul_rn(r, term));
                }
            }
        }
    }
}

// dweight[c] += the sum of partial[0..n_chunks)[c]. A block takes 32 columns; warp w sums chunks w, w + 8, ... in
// order, then warp 0 adds the 8 warps' sums in warp order: a fixed tree for a given n_chunks, which depends on N
// only.
static const int FINISH_WARPS = 8;
__global__ void __launch_bounds__(FINISH_WARPS * 32)
    rmsnorm_backward_dweight_finish_kernel(float *dweight, const float *partial, int n_chunks, int C) {
    __shared__ float warp_sums[FINISH_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (c < C)
        for (int k = warp; k < n_chunks; k += FINISH_WARPS) sum = __fadd_rn(sum, partial[(int64_t)k * C + c]);
    warp_sums[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && c < C) {
        float total = warp_sums[0][lane];
        for (int w = 1; w < FINISH_WARPS; w++) total = __fadd_rn(total, warp_sums[w][lane]);
        dweight[c] = __fadd_rn(dweight[c], total);
    }
}

// The process-wide scratch for dweight partials (see the file comment).
static Scratch dweight_scratch;

template <int PER, typename Dout>
static void launch_rmsnorm_backward(int n_chunks, float *dinp, float *partial, const Dout *dout, int64_t ld, int n_src,
                                    int64_t src_stride, const float *inp, const float *weight, const float *rstd, int N,
                                    int C) {
    if (dinp != NULL && partial != NULL)
        rmsnorm_backward_kernel<PER, true, true>
            <<<n_chunks, RMSNORM_THREADS>>>(dinp, partial, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
    else if (dinp != NULL)
        rmsnorm_backward_kernel<PER, true, false>
            <<<n_chunks, RMSNORM_THREADS>>>(dinp, partial, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
    else
        rmsnorm_backward_kernel<PER, false, true>
            <<<n_chunks, RMSNORM_THREADS>>>(dinp, partial, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
    CUDA_CHECK_LAUNCH("rmsnorm_backward_kernel");
}

template <typename Dout>
static void rmsnorm_backward(float *dinp, float *dweight, const Dout *dout, int64_t ld, int n_src, int64_t src_stride,
                             const float *inp, const float *weight, const float *rstd, int N, int C) {
    if (N <= 0 || C <= 0 || (dinp == NULL && dweight == NULL)) return;
    const int n_chunks = (N + RMSNORM_BWD_ROWS - 1) / RMSNORM_BWD_ROWS;
    float *partial = dweight != NULL
                         ? (float *)cuda_scratch(&dweight_scratch, (size_t)n_chunks * (size_t)C * sizeof(float))
                         : NULL;
#define RMSNORM_BACKWARD(PER) \
    launch_rmsnorm_backward<PER>(n_chunks, dinp, partial, dout, ld, n_src, src_stride, inp, weight, rstd, N, C)
    switch (columns_per_thread(C)) {
    case 1: RMSNORM_BACKWARD(1); break;
    case 2: RMSNORM_BACKWARD(2); break;
    case 4: RMSNORM_BACKWARD(4); break;
    case 8: RMSNORM_BACKWARD(8); break;
    case RMSNORM_MAX_PER: RMSNORM_BACKWARD(RMSNORM_MAX_PER); break;
    default: RMSNORM_BACKWARD(0); break;
    }
#undef RMSNORM_BACKWARD
    if (dweight != NULL) {
        rmsnorm_backward_dweight_finish_kernel<<<(C + 31) / 32, FINISH_WARPS * 32>>>(dweight, partial, n_chunks, C);
        CUDA_CHECK_LAUNCH("rmsnorm_backward_dweight_finish_kernel");
    }
}

extern "C" void cuda_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp,
                                      const real *weight, const real *rstd, int N, int C) {
    rmsnorm_backward(dinp, dweight, dout, C, 1, 0, inp, weight, rstd, N, C);
}

extern "C" void cuda_rmsnorm_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src,
                                           int64_t src_stride, const real *inp, const real *weight, const real *rstd,
                                           int N, int C) {
    rmsnorm_backward(dinp, dweight, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
}
