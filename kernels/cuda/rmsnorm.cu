/*
 * rmsnorm.cu - CUDA RMSNorm forward and backward (kernels.h: rmsnorm_forward / rmsnorm_backward),
 * the same function as the CPU reference cpu_rmsnorm_* and checked against it by tests/gpu.
 *
 * Deterministic: every sum is a fixed-order tree (block_sum) or a fixed-order loop; no atomics.
 * The weight gradient is a sum over all N rows. It is done in two kernels: each block of the first
 * sums a fixed chunk of rows per column into a scratch buffer of per-chunk partials, the second adds
 * the partials of each column in chunk order. The chunking depends only on N (never on the GPU or
 * timing), so results are bitwise reproducible. The scratch buffer is a process-wide cache grown on
 * demand with cudaMalloc and kept (at most RMSNORM_MAX_CHUNKS * C floats, 256 KiB at C = 1024); all
 * ops run on the default stream, so consecutive calls cannot overlap on it. (If ops ever run on
 * several streams or host threads, this cache must become per stream.)
 */
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

// ---------------------------------------------------------------------------- forward
// inp (N, C), weight (C) -> out (N, C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp^2) + eps).
// One block per row: the row's sum of squares is a block reduction, then the block writes the row.
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
    float *y = out + row * C;

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
    if constexpr (PER > 0) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            if (c < C) y[c] = __fmul_rn(__fmul_rn(v[i], r), weight[c]);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS) y[c] = __fmul_rn(__fmul_rn(x[c], r), weight[c]);
    }
    if (threadIdx.x == 0) rstd[row] = r;
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
// dinp: one block per row (the dot product is a block reduction), the row's dout, inp and dinp in registers as in
// the forward (PER). dweight: see the file comment.

template <int PER>
__global__ void __launch_bounds__(RMSNORM_THREADS)
    rmsnorm_backward_dinp_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                 const float *rstd, int C) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = inp + row * C, *dy = dout + row * C;
    float *dx = dinp + row * C;
    const float r = rstd[row];

    float dot = 0.0f; // sum_j dout_j weight_j inp_j
    if constexpr (PER > 0) {
        float vx[PER], vdy[PER], vw[PER], vdx[PER];
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            const bool in = c < C;
            vx[i] = in ? x[c] : 0.0f, vdy[i] = in ? dy[c] : 0.0f, vw[i] = in ? weight[c] : 0.0f;
            vdx[i] = in ? dx[c] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (threadIdx.x + i * RMSNORM_THREADS < C) dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(vdy[i], vw[i]), vx[i]));
        dot = block_sum(dot, scratch);
        const float coef = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(dot, (float)C));
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * RMSNORM_THREADS;
            const float term = __fsub_rn(__fmul_rn(vdy[i], vw[i]), __fmul_rn(vx[i], coef));
            if (c < C) dx[c] = __fadd_rn(vdx[i], __fmul_rn(r, term));
        }
    } else {
        for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS)
            dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(dy[c], weight[c]), x[c]));
        dot = block_sum(dot, scratch);
        const float coef = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(dot, (float)C));
        for (int c = threadIdx.x; c < C; c += RMSNORM_THREADS) {
            const float term = __fsub_rn(__fmul_rn(dy[c], weight[c]), __fmul_rn(x[c], coef));
            dx[c] = __fadd_rn(dx[c], __fmul_rn(r, term));
        }
    }
}

// Columns per block of the dweight kernels, and the most row chunks (bounds the scratch size).
static const int DWEIGHT_THREADS = 256;
static const int RMSNORM_MAX_CHUNKS = 64;
static const int RMSNORM_MIN_ROWS_PER_CHUNK = 32;

// Thread (column c, chunk blockIdx.y) sums dout * norm over rows [row0, row1) in row order.
// With one chunk the sum goes straight into dweight; otherwise into partial (n_chunks, C).
__global__ void rmsnorm_backward_dweight_partial_kernel(float *dweight, float *partial, const float *dout,
                                                        const float *inp, const float *rstd, int N, int C,
                                                        int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int chunk = blockIdx.y;
    const int row0 = chunk * rows_per_chunk;
    const int row1 = min(N, row0 + rows_per_chunk);
    float sum = 0.0f;
    for (int row = row0; row < row1; row++) {
        const int64_t i = (int64_t)row * C + c;
        sum = __fadd_rn(sum, __fmul_rn(dout[i], __fmul_rn(inp[i], rstd[row])));
    }
    if (partial == NULL) dweight[c] = __fadd_rn(dweight[c], sum);
    else partial[(int64_t)chunk * C + c] = sum;
}

// dweight[c] += partial[0][c] + partial[1][c] + ... in chunk order.
__global__ void rmsnorm_backward_dweight_finish_kernel(float *dweight, const float *partial, int n_chunks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sum = 0.0f;
    for (int chunk = 0; chunk < n_chunks; chunk++) sum = __fadd_rn(sum, partial[(int64_t)chunk * C + c]);
    dweight[c] = __fadd_rn(dweight[c], sum);
}

// The process-wide scratch for dweight partials (see the file comment).
static Scratch dweight_scratch;

static float *get_dweight_scratch(size_t floats) {
    return (float *)cuda_scratch(&dweight_scratch, floats * sizeof(float));
}

extern "C" void cuda_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp,
                                      const real *weight, const real *rstd, int N, int C) {
    if (N <= 0 || C <= 0) return;
    if (dinp != NULL) {
        switch (columns_per_thread(C)) {
        case 1: rmsnorm_backward_dinp_kernel<1><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C); break;
        case 2: rmsnorm_backward_dinp_kernel<2><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C); break;
        case 4: rmsnorm_backward_dinp_kernel<4><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C); break;
        case 8: rmsnorm_backward_dinp_kernel<8><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C); break;
        case RMSNORM_MAX_PER:
            rmsnorm_backward_dinp_kernel<RMSNORM_MAX_PER><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C);
            break;
        default: rmsnorm_backward_dinp_kernel<0><<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C); break;
        }
        CUDA_CHECK_LAUNCH("rmsnorm_backward_dinp_kernel");
    }
    if (dweight != NULL) {
        // Chunks of at least 32 rows, at most 64 chunks: enough blocks to fill the GPU for typical
        // C (thousands) and N (thousands of tokens), and a small scratch.
        int rows_per_chunk = (N + RMSNORM_MAX_CHUNKS - 1) / RMSNORM_MAX_CHUNKS;
        if (rows_per_chunk < RMSNORM_MIN_ROWS_PER_CHUNK) rows_per_chunk = RMSNORM_MIN_ROWS_PER_CHUNK;
        const int n_chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
        const unsigned int col_blocks = (unsigned int)((C + DWEIGHT_THREADS - 1) / DWEIGHT_THREADS);
        float *partial = n_chunks > 1 ? get_dweight_scratch((size_t)n_chunks * (size_t)C) : NULL;
        rmsnorm_backward_dweight_partial_kernel<<<dim3(col_blocks, (unsigned int)n_chunks), DWEIGHT_THREADS>>>(
            dweight, partial, dout, inp, rstd, N, C, rows_per_chunk);
        CUDA_CHECK_LAUNCH("rmsnorm_backward_dweight_partial_kernel");
        if (partial != NULL) {
            rmsnorm_backward_dweight_finish_kernel<<<col_blocks, DWEIGHT_THREADS>>>(dweight, partial, n_chunks, C);
            CUDA_CHECK_LAUNCH("rmsnorm_backward_dweight_finish_kernel");
        }
    }
}
