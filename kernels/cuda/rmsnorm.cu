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
static const int RMSNORM_THREADS = 256;

__global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *inp, const float *weight, int C) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = inp + row * C;
    float *y = out + row * C;

    float sum_sq = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) sum_sq = __fadd_rn(sum_sq, __fmul_rn(x[c], x[c]));
    sum_sq = block_sum(sum_sq, scratch);

    const float r = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)C), (float)RMSNORM_EPS)));
    for (int c = threadIdx.x; c < C; c += blockDim.x) y[c] = __fmul_rn(__fmul_rn(x[c], r), weight[c]);
    if (threadIdx.x == 0) rstd[row] = r;
}

extern "C" void cuda_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C) {
    if (N <= 0 || C <= 0) return;
    rmsnorm_forward_kernel<<<N, RMSNORM_THREADS>>>(out, rstd, inp, weight, C);
    CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

// ---------------------------------------------------------------------------- backward
// In the forward pass this was out_c = inp_c * rstd * weight_c with rstd = (mean(inp^2) + eps)^-1/2,
// and d rstd / d inp_c = -rstd^3 inp_c / C. So, per row:
//   dinp_c  += rstd * (dout_c weight_c - inp_c * rstd^2 * (sum_j dout_j weight_j inp_j) / C)
//   dweight_c += sum over rows of dout_c * inp_c * rstd
// (the same expressions, in the same order, as cpu_rmsnorm_backward; only the sums' order differs).
// dinp: one block per row (the dot product is a block reduction). dweight: see the file comment.

__global__ void rmsnorm_backward_dinp_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                             const float *rstd, int C) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float *x = inp + row * C, *dy = dout + row * C;
    float *dx = dinp + row * C;
    const float r = rstd[row];

    float dot = 0.0f; // sum_j dout_j weight_j inp_j
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(dy[c], weight[c]), x[c]));
    dot = block_sum(dot, scratch);
    const float coef = __fmul_rn(__fmul_rn(r, r), __fdiv_rn(dot, (float)C));

    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float term = __fsub_rn(__fmul_rn(dy[c], weight[c]), __fmul_rn(x[c], coef));
        dx[c] = __fadd_rn(dx[c], __fmul_rn(r, term));
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
        rmsnorm_backward_dinp_kernel<<<N, RMSNORM_THREADS>>>(dinp, dout, inp, weight, rstd, C);
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
