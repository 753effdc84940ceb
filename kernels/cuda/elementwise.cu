/*
 * elementwise.cu - CUDA versions of the row-wise and element-wise glue ops of kernels.h: embedding lookup
 * and its scatter-add backward, interleaved RoPE, copy_block, add_inplace, scale_inplace and sum_squares.
 * Same functions as kernels/cpu/elementwise.c, copy.c and optim_ops.c; checked against them by
 * tests/gpu/test_gpu_model_ops.c.
 *
 * Numerics: every float operation is a __f*_rn intrinsic in the order of the CPU reference, so nvcc cannot
 * contract a multiply and an add into an FMA (the CPU builds with -ffp-contract=off). The RoPE cos/sin table
 * is built on the host by the same code as the CPU's. So embedding, RoPE, copy_block, add and scale give the
 * CPU's bits. sum_squares is a fixed-order tree in double (not the CPU's chunk order: the two differ at the
 * 1e-16 level, and the GPU result is the same on every run).
 *
 * Determinism: no floating-point atomics. The embedding backward adds the rows that share a token. It sorts
 * (token, row) pairs with CUB's radix sort, which is stable, so each token's rows come out in row order, and
 * one thread per (token, column) adds them in that order: the CPU's order, the CPU's bits.
 *
 * Bad token ids (negative; V is not passed, so only the lower bound can be checked, as on the CPU) never
 * cause an out-of-bounds access: embedding_forward writes a NaN row for them and embedding_backward skips
 * them. The first one is recorded in a device error slot (an integer atomicMin of its row: order-free) and
 * reported, stopping the process with the op, row and token, by embedding_forward itself (it copies the
 * slots back once per call, a few microseconds once per forward pass) and, for embedding_backward, right away
 * when FP8MOE_CUDA_SYNC=1, else by the next embedding_forward. The backward does not synchronise by default.
 *
 * Scratch buffers (sort keys and temp storage, the RoPE table, sum-of-squares partials) are process-wide
 * caches grown on demand; all ops run on the default stream, so reuse between calls is ordered (if ops ever
 * run on several streams or host threads these caches must become per stream).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static const int ELEMENTWISE_THREADS = 256;

// Stops with "elementwise.cu:<line>: <op>: <message>" for a call that breaks a documented precondition.
#define ELEMENTWISE_FAIL(...)                                                        \
    do {                                                                             \
        fprintf(stderr, "fp8moe: %s:%d: ", __FILE__, __LINE__);                      \
        fprintf(stderr, __VA_ARGS__);                                                \
        fputc('\n', stderr);                                                         \
        exit(1);                                                                     \
    } while (0)

// ---------------------------------------------------------------------------- error slots
// One slot per kind of input error (common.cuh ErrorSlots): the row and token of the first negative token.
enum { ERR_EMBEDDING_FORWARD, ERR_EMBEDDING_BACKWARD, N_ERR_SLOTS };
static ErrorSlots errors = {NULL, N_ERR_SLOTS};

// Reads the slots back (this synchronises) and stops the process on the first recorded error.
static void report_errors(void) {
    unsigned long long v[N_ERR_SLOTS];
    if (!error_slots_read(&errors, v)) return;
    static const char *const op[N_ERR_SLOTS] = {"embedding_forward", "embedding_backward"};
    for (int k = 0; k < N_ERR_SLOTS; k++) {
        if (v[k] == ERROR_SLOT_EMPTY) continue;
        ELEMENTWISE_FAIL("%s: token %d at row %lld is negative; expected an id in [0, vocab_size)", op[k],
                         error_value(v[k]), (long long)error_index(v[k]));
    }
}

// ---------------------------------------------------------------------------- embedding
// tokens (N) int32, table (V, C) -> out (N, C) = table[tokens[n]]. One block per row, threads over columns.
// A negative token gives a NaN row (and an error report), never an out-of-bounds read.
__global__ void embedding_forward_kernel(float *out, const int *tokens, const float *table, int C,
                                         unsigned long long *err) {
    const int64_t n = blockIdx.x;
    const int token = tokens[n];
    float *o = out + n * C;
    if (token < 0) {
        for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = NAN;
        if (threadIdx.x == 0) record_error(err, n, token);
        return;
    }
    const float *row = table + (int64_t)token * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = row[c];
}

extern "C" void cuda_embedding_forward(real *out, const int *tokens, const real *table, int N, int C) {
    if (N <= 0 || C <= 0) return;
    unsigned long long *err = error_slot_reset(&errors, ERR_EMBEDDING_FORWARD);
    embedding_forward_kernel<<<N, ELEMENTWISE_THREADS>>>(out, tokens, table, C, err);
    CUDA_CHECK_LAUNCH("embedding_forward_kernel");
    report_errors(); // this call's bad tokens, and any the last embedding_backward recorded
}

// rows (n) = 0, 1, ..., n-1: the values sorted along with the tokens.
__global__ void iota_kernel(int *rows, int n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        rows[i] = (int)i;
}

// In the forward pass this was out[n] = table[tokens[n]], so dtable[tokens[n]] += dout[n].
// sorted_tokens, sorted_rows (N): the (token, row) pairs sorted by token, rows of one token in row order.
// Block (i, column block): if position i starts a token's run, thread c adds that run's dout rows to
// dtable[token][c] in order, dtable first: ((dtable + dout[n1]) + dout[n2]) + ..., the CPU's sum.
// Each warp finds the run's end 32 positions at a time (a ballot of "same token"): one position at a time, a run of
// a frequent token (hundreds of rows in a 16,384-token batch of natural text) was a chain of that many dependent
// loads, and the whole kernel took 0.56 ms on an H100 for a 32,768-token vocabulary (2026-12-06).
__global__ void embedding_backward_kernel(float *dtable, const float *dout, const int *sorted_tokens,
                                          const int *sorted_rows, int N, int C, unsigned long long *err) {
    const int i = blockIdx.x;
    const int token = sorted_tokens[i];
    if (i > 0 && sorted_tokens[i - 1] == token) return; // not the first of its run
    if (token < 0) {
        if (threadIdx.x == 0 && blockIdx.y == 0) record_error(err, sorted_rows[i], token);
        return;
    }
    const int lane = threadIdx.x & 31;
    int end = i + 1;
    for (;; end += 32) {  // every lane of every warp ends with the same `end`
        const int j = end + lane;
        const unsigned same = __ballot_sync(0xffffffffu, j < N && sorted_tokens[j] == token);
        if (same != 0xffffffffu) {
            end += __ffs(~same) - 1;
            break;
        }
    }
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float *d = dtable + (int64_t)token * C + c;
    float acc = *d;
#pragma unroll 8
    for (int j = i; j < end; j++) acc = __fadd_rn(acc, dout[(int64_t)sorted_rows[j] * C + c]);
    *d = acc;
}

static Scratch emb_rows, emb_sorted_tokens, emb_sorted_rows, emb_sort_temp;

extern "C" void cuda_embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C) {
    if (dtable == NULL || N <= 0 || C <= 0) return;
    unsigned long long *err = error_slot_reset(&errors, ERR_EMBEDDING_BACKWARD);
    int *rows = (int *)cuda_scratch(&emb_rows, sizeof(int) * (size_t)N);
    int *sorted_tokens = (int *)cuda_scratch(&emb_sorted_tokens, sizeof(int) * (size_t)N);
    int *sorted_rows = (int *)cuda_scratch(&emb_sorted_rows, sizeof(int) * (size_t)N);
    iota_kernel<<<grid_for(N, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(rows, N);
    CUDA_CHECK_LAUNCH("iota_kernel");
    // All 32 key bits: CUB orders signed ints correctly, so a negative (bad) token sorts before every valid
    // one and can never split a valid token's run.
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, tokens, sorted_tokens, rows, sorted_rows, N));
    void *temp = cuda_scratch(&emb_sort_temp, temp_bytes);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tokens, sorted_tokens, rows, sorted_rows, N));
    CUDA_CHECK_LAUNCH("cub::DeviceRadixSort::SortPairs (embedding_backward)");
    const dim3 grid((unsigned int)N, (unsigned int)((C + ELEMENTWISE_THREADS - 1) / ELEMENTWISE_THREADS));
    embedding_backward_kernel<<<grid, ELEMENTWISE_THREADS>>>(dtable, dout, sorted_tokens, sorted_rows, N, C, err);
    CUDA_CHECK_LAUNCH("embedding_backward_kernel");
    if (cuda_sync_after_launch()) report_errors();
}

// ---------------------------------------------------------------------------- RoPE
// The cos/sin table (T, D/2) of angle t * theta^(-2j/D), built on the host in double and rounded once to
// float by the same expressions as the CPU's rope_table, so both sides rotate by the same float values.
// Cached for the last (T, D, theta): q and k of every layer use the same one. Also read by the attention
// forward's pre-pass, which rotates MLA's BF16 queries as it stages them (common.cuh cuda_rope_table).
static struct {
    float *table; // device: cos (T * half) then sin (T * half)
    size_t capacity_floats;
    int T, D;
    float theta;
    int valid;
} rope_cache;

const float *cuda_rope_table(int T, int D, float theta) {
    if (rope_cache.valid && rope_cache.T == T && rope_cache.D == D && rope_cache.theta == theta)
        return rope_cache.table;
    const int half = D / 2;
    const size_t n = (size_t)T * half;
    float *host = (float *)malloc(sizeof(float) * 2 * n);
    if (host == NULL) ELEMENTWISE_FAIL("rope: out of memory for a RoPE table of %d x %d", T, half);
    for (int j = 0; j < half; j++) {
        const double inv_freq = pow((double)theta, -2.0 * j / (double)D);
        for (int t = 0; t < T; t++) {
            const double angle = (double)t * inv_freq;
            host[(size_t)t * half + j] = (float)cos(angle);
            host[n + (size_t)t * half + j] = (float)sin(angle);
        }
    }
    if (2 * n > rope_cache.capacity_floats) {
        if (rope_cache.table != NULL) CUDA_CHECK(cudaFree(rope_cache.table));
        rope_cache.table = NULL;
        cuda_counted_malloc((void **)&rope_cache.table, sizeof(float) * 2 * n, __FILE__, __LINE__);
        rope_cache.capacity_floats = 2 * n;
    }
    // a pageable-memory copy on the legacy stream: ordered after earlier kernels that may read the old table
    CUDA_CHECK(cudaMemcpy(rope_cache.table, host, sizeof(float) * 2 * n, cudaMemcpyHostToDevice));
    free(host);
    rope_cache.T = T, rope_cache.D = D, rope_cache.theta = theta, rope_cache.valid = 1;
    return rope_cache.table;
}

// inp, out: (B, T, H) vectors of D at a stride of ld elements (ld >= D; ld = D is the packed (B, T, H, D)),
// position = t. One thread per pair (x0, x1) = (x[2j], x[2j+1]):
//   out = (x0 cos - x1 sin, x0 sin + x1 cos). Each thread reads its pair before writing it, so out may alias inp.
__global__ void rope_forward_kernel(float *out, const float *inp, int ld, const float *cs, const float *sn,
                                    int64_t n_pairs, int T, int H, int half) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_pairs; i += (int64_t)gridDim.x * blockDim.x) {
        const int j = (int)(i % half);
        const int64_t vec = i / half; // (b * T + t) * H + h
        const int t = (int)((vec / H) % T);
        const float c = cs[(int64_t)t * half + j], s = sn[(int64_t)t * half + j];
        const int64_t at = vec * ld + 2 * j;
        const float x0 = inp[at], x1 = inp[at + 1];
        out[at] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        out[at + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

// The forward rotation R(angle) is orthogonal, so its adjoint is R(-angle), written (dinp may alias dout):
//   dinp[2j] = d0 cos + d1 sin;   dinp[2j+1] = d1 cos - d0 sin.   Layout as the forward's.
__global__ void rope_backward_kernel(float *dinp, const float *dout, int ld, const float *cs, const float *sn,
                                     int64_t n_pairs, int T, int H, int half) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_pairs; i += (int64_t)gridDim.x * blockDim.x) {
        const int j = (int)(i % half);
        const int64_t vec = i / half;
        const int t = (int)((vec / H) % T);
        const float c = cs[(int64_t)t * half + j], s = sn[(int64_t)t * half + j];
        const int64_t at = vec * ld + 2 * j;
        const float d0 = dout[at], d1 = dout[at + 1];
        dinp[at] = __fadd_rn(__fmul_rn(d0, c), __fmul_rn(d1, s));
        dinp[at + 1] = __fsub_rn(__fmul_rn(d1, c), __fmul_rn(d0, s));
    }
}

static void check_rope_shape(const char *op, int ld, int D) {
    if (D % 2 != 0)
        ELEMENTWISE_FAIL("%s: head dimension D = %d is odd; interleaved RoPE rotates pairs (x[2j], x[2j+1]) and "
                         "needs an even D", op, D);
    if (ld < D) ELEMENTWISE_FAIL("%s: vector stride ld = %d is below the head dimension D = %d", op, ld, D);
}

extern "C" void cuda_rope_forward(real *out, const real *inp, int ld, int B, int T, int H, int D, real theta) {
    check_rope_shape("rope_forward", ld, D);
    const int half = D / 2;
    const int64_t n_pairs = (int64_t)B * T * H * half;
    if (n_pairs <= 0) return;
    const float *cs = cuda_rope_table(T, D, theta);
    rope_forward_kernel<<<grid_for(n_pairs, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(
        out, inp, ld, cs, cs + (size_t)T * half, n_pairs, T, H, half);
    CUDA_CHECK_LAUNCH("rope_forward_kernel");
}

extern "C" void cuda_rope_backward(real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta) {
    if (dinp == NULL) return;
    check_rope_shape("rope_backward", ld, D);
    const int half = D / 2;
    const int64_t n_pairs = (int64_t)B * T * H * half;
    if (n_pairs <= 0) return;
    const float *cs = cuda_rope_table(T, D, theta);
    rope_backward_kernel<<<grid_for(n_pairs, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(
        dinp, dout, ld, cs, cs + (size_t)T * half, n_pairs, T, H, half);
    CUDA_CHECK_LAUNCH("rope_backward_kernel");
}

// ---------------------------------------------------------------------------- copy_block, add, scale
// dst[r * dst_ld + c] = src[r * src_ld + c] (or +=) for r < rows, c < cols; regions must not overlap.
template <bool ACCUMULATE>
__global__ void copy_block_kernel(float *dst, int dst_ld, const float *src, int src_ld, int rows, int cols) {
    const int64_t n = (int64_t)rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i % cols;
        float *d = dst + r * dst_ld + c;
        const float s = src[r * src_ld + c];
        *d = ACCUMULATE ? __fadd_rn(*d, s) : s;
    }
}

extern "C" void cuda_copy_block(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate) {
    const int64_t n = (int64_t)rows * cols;
    if (rows <= 0 || cols <= 0) return;
    if (accumulate)
        copy_block_kernel<true><<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, dst_ld, src, src_ld, rows, cols);
    else
        copy_block_kernel<false><<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, dst_ld, src, src_ld, rows, cols);
    CUDA_CHECK_LAUNCH("copy_block_kernel");
}

// y (n) += x (n)
__global__ void add_inplace_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

extern "C" void cuda_add_inplace(real *y, const real *x, int64_t n) {
    if (n <= 0) return;
    add_inplace_kernel<<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(y, x, n);
    CUDA_CHECK_LAUNCH("add_inplace_kernel");
}

// x (n) *= s
__global__ void scale_inplace_kernel(float *x, float s, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

extern "C" void cuda_scale_inplace(real *x, real s, int64_t n) {
    if (n <= 0) return;
    scale_inplace_kernel<<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(x, s, n);
    CUDA_CHECK_LAUNCH("scale_inplace_kernel");
}

// ---------------------------------------------------------------------------- sum_squares
// sum of x[i]^2 (n) in double. Each block sums a fixed chunk of SUM_SQUARES_CHUNK elements (each thread a
// strided part, then a block tree) into partial[chunk]; one block then sums the partials (strided, then a
// tree). The order depends only on n, so the result is the same on every run. Each square of a float is
// exact in double, so only the additions round.
static const int64_t SUM_SQUARES_CHUNK = 16384;

__device__ inline double warp_sum_double(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// As block_sum of common.cuh, in double; scratch is __shared__ double[32]. Every thread gets the result.
__device__ inline double block_sum_double(double v, double *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum_double(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum_double(lane < n_warps ? scratch[lane] : 0.0);
}

__global__ void sum_squares_partial_kernel(double *partial, const float *x, int64_t n) {
    __shared__ double scratch[32];
    const int64_t begin = (int64_t)blockIdx.x * SUM_SQUARES_CHUNK;
    const int64_t end = begin + SUM_SQUARES_CHUNK < n ? begin + SUM_SQUARES_CHUNK : n;
    double s = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const double v = (double)x[i];
        s = __dadd_rn(s, __dmul_rn(v, v));
    }
    s = block_sum_double(s, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double *total, const double *partial, int64_t n_partials) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n_partials; i += blockDim.x) s = __dadd_rn(s, partial[i]);
    s = block_sum_double(s, scratch);
    if (threadIdx.x == 0) *total = s;
}

static Scratch sumsq_partials;

extern "C" double cuda_sum_squares(const real *x, int64_t n) {
    if (n <= 0) return 0.0;
    const int64_t n_chunks = (n + SUM_SQUARES_CHUNK - 1) / SUM_SQUARES_CHUNK;
    double *partial = (double *)cuda_scratch(&sumsq_partials, sizeof(double) * (size_t)(n_chunks + 1));
    double *total = partial + n_chunks;
    sum_squares_partial_kernel<<<(unsigned int)n_chunks, ELEMENTWISE_THREADS>>>(partial, x, n);
    CUDA_CHECK_LAUNCH("sum_squares_partial_kernel");
    sum_partials_kernel<<<1, ELEMENTWISE_THREADS>>>(total, partial, n_chunks);
    CUDA_CHECK_LAUNCH("sum_partials_kernel");
    double result = 0.0;
    CUDA_CHECK(cudaMemcpy(&result, total, sizeof result, cudaMemcpyDeviceToHost));
    return result;
}
