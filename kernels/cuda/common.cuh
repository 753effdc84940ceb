/*
 * common.cuh - error checks and small launch helpers shared by kernels/device.c and the kernels/cuda .cu files.
 *
 * Every CUDA runtime call is wrapped in CUDA_CHECK, which stops the process with
 *   "<file>:<line>: <the call as written> failed: <cudaGetErrorString> (<error name>)"
 * so the happy path stays one line per call and every failure names where it happened.
 * Kernel launches are followed by CUDA_CHECK_LAUNCH("kernel name"). Launches are asynchronous, so an
 * error inside a kernel normally surfaces at the next synchronising call (a copy to the host); with
 * FP8MOE_CUDA_SYNC=1 in the environment every launch is followed by cudaDeviceSynchronize and the error
 * is reported at the kernel that caused it (tests/gpu/run.sh sets it; it costs speed, not results).
 *
 * The CUDA block also holds the segment table of the grouped (per-expert) FP8 calls, which the quantisers
 * (fp8_quant.cu) and the GEMMs' output conversion (gemm.cu) share, and the cp.async copies to shared memory that
 * the attention kernels and the pipelined quantiser use, and the deferred input-error slots (ErrorSlots) through
 * which elementwise.cu and moe.cu report bad token and expert indices without a sync per launch.
 *
 * This header is plain C outside the __CUDACC__ block, so device.c (compiled by gcc) can use it too.
 * All ops run on the legacy default stream, so consecutive ops are ordered without extra syncs.
 */
#ifndef FP8MOE_CUDA_COMMON_CUH
#define FP8MOE_CUDA_COMMON_CUH

#include <stdio.h>
#include <stdlib.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

static inline void cuda_check_at(cudaError_t err, const char *call, const char *file, int line) {
    if (err == cudaSuccess) return;
    fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", file, line, call, cudaGetErrorString(err),
            cudaGetErrorName(err));
    exit(1);
}

#define CUDA_CHECK(call) cuda_check_at((call), #call, __FILE__, __LINE__)

// ---------------------------------------------------------------------------- device allocations
// Every cudaMalloc of the project goes through device_alloc (kernels/device.c) or cuda_scratch below,
// and is counted, so the trainer can check that a step allocates nothing once the first step has
// sized every buffer (device_allocation_count in kernels.h).
#ifdef __cplusplus
extern "C" {
#endif
extern long long fp8moe_cuda_allocations;  // defined in kernels/device.c
#ifdef __cplusplus
}
#endif

static inline void cuda_counted_malloc(void **p, size_t bytes, const char *file, int line) {
    cuda_check_at(cudaMalloc(p, bytes), "cudaMalloc", file, line);
    fp8moe_cuda_allocations++;
}

// A process-wide device buffer of at least `bytes`, kept between calls and grown on demand. All ops
// run on the default stream, so reuse is ordered; cudaFree waits for earlier work that may still use it.
typedef struct {
    void *p;
    size_t bytes;
} Scratch;

static inline void *cuda_scratch_at(Scratch *s, size_t bytes, const char *file, int line) {
    if (bytes == 0) bytes = 1;
    if (bytes > s->bytes) {
        if (s->p != NULL) cuda_check_at(cudaFree(s->p), "cudaFree", file, line);
        s->p = NULL;
        cuda_counted_malloc(&s->p, bytes, file, line);
        s->bytes = bytes;
    }
    return s->p;
}
#define cuda_scratch(s, bytes) cuda_scratch_at((s), (bytes), __FILE__, __LINE__)

// Reads FP8MOE_CUDA_SYNC once; 1 = synchronise after every launch to pin errors to their kernel.
static inline int cuda_sync_after_launch(void) {
    static int cached = -1;
    if (cached < 0) {
        const char *s = getenv("FP8MOE_CUDA_SYNC");
        cached = (s != NULL && s[0] == '1');
    }
    return cached;
}

static inline void cuda_check_launch_at(const char *kernel, const char *file, int line) {
    cuda_check_at(cudaGetLastError(), kernel, file, line);
    if (cuda_sync_after_launch()) cuda_check_at(cudaDeviceSynchronize(), kernel, file, line);
}

#define CUDA_CHECK_LAUNCH(kernel_name) cuda_check_launch_at(kernel_name " launch", __FILE__, __LINE__)

#ifdef __CUDACC__
// ---------------------------------------------------------------------------- device helpers
#include <stdint.h>

#include "kernels/kernels.h"

// The CUDA ops take `real` pointers; they exist only in the FP32 build (the double build has no CUDA).
static_assert(sizeof(real) == sizeof(float), "CUDA ops are built for real = float only");

// Deferred input errors: a file's kernels record the first bad element of each kind of error in a device slot
// of its own ErrorSlots, and the host reads the slots back at its next sync point (one copy, not one per
// launch). A slot holds (index << 32) | (uint32)value of the bad element with the smallest index (the op's input
// index), or ERROR_SLOT_EMPTY; kernels lower it with an integer atomicMin, so what is recorded does not depend on
// timing.
static const unsigned long long ERROR_SLOT_EMPTY = ~0ull;
typedef struct {
    unsigned long long *slots; // device, n of them; NULL until the first reset
    int n;
} ErrorSlots;

// Slot `which` of e, emptied (ordered before the kernel that follows on the stream).
static inline unsigned long long *error_slot_reset_at(ErrorSlots *e, int which, const char *file, int line) {
    if (e->slots == NULL) {
        cuda_counted_malloc((void **)&e->slots, sizeof(unsigned long long) * (size_t)e->n, file, line);
        cuda_check_at(cudaMemset(e->slots, 0xFF, sizeof(unsigned long long) * (size_t)e->n), "cudaMemset", file, line);
    }
    cuda_check_at(cudaMemset(e->slots + which, 0xFF, sizeof(unsigned long long)), "cudaMemset", file, line);
    return e->slots + which;
}
#define error_slot_reset(e, which) error_slot_reset_at((e), (which), __FILE__, __LINE__)

__device__ inline void record_error(unsigned long long *slot, int64_t index, int value) {
    const unsigned long long i = index < 0xFFFFFFFFll ? (unsigned long long)index : 0xFFFFFFFEull;
    atomicMin(slot, (i << 32) | (unsigned long long)(uint32_t)value);
}

// Copies e's slots into v (n of them; this synchronises); 0 when no slot was ever reset (v untouched).
static inline int error_slots_read_at(const ErrorSlots *e, unsigned long long *v, const char *file, int line) {
    if (e->slots == NULL) return 0;
    cuda_check_at(cudaMemcpy(v, e->slots, sizeof(unsigned long long) * (size_t)e->n, cudaMemcpyDeviceToHost),
                  "cudaMemcpy", file, line);
    return 1;
}
#define error_slots_read(e, v) error_slots_read_at((e), (v), __FILE__, __LINE__)
static inline int64_t error_index(unsigned long long slot) { return (int64_t)(slot >> 32); }
static inline int error_value(unsigned long long slot) { return (int)(uint32_t)(slot & 0xFFFFFFFFull); }

// Grid for grid-stride loops over n elements: enough blocks to fill the GPU, never more than needed.
static inline unsigned int grid_for(int64_t n, int threads) {
    int64_t blocks = (n + threads - 1) / threads;
    const int64_t max_blocks = 132 * 32; // H200 has 132 SMs; grid-stride loops cover the rest
    if (blocks > max_blocks) blocks = max_blocks;
    if (blocks < 1) blocks = 1;
    return (unsigned int)blocks;
}

// Two floats rounded to BF16 (round to nearest even), lo in the low half: the bits of a BF16 pair in memory.
__device__ inline uint32_t bf16x2_bits(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo in the low half
    return *reinterpret_cast<const uint32_t *>(&v);
}
// One float rounded to BF16: its 16 bits.
__device__ inline uint16_t bf16_bits(float v) { return (uint16_t)(bf16x2_bits(v, 0.0f) & 0xFFFFu); }

// A BF16 value (its 16 bits, in the low half) widened to the FP32 value it is; four of them (8 bytes) at once.
__device__ inline float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
__device__ inline float4 bf16x4_to_float4(uint2 raw) {
    return make_float4(bf16_bits_to_float(raw.x & 0xFFFFu), bf16_bits_to_float(raw.x >> 16),
                       bf16_bits_to_float(raw.y & 0xFFFFu), bf16_bits_to_float(raw.y >> 16));
}

// One element of RMSNorm's output, (x * rstd) * weight, two roundings: rmsnorm_forward's, and the values the
// quantisers of a norm's output compute as they read its input (fp8_quant.cu NormRows), so the two agree bit for bit.
__device__ inline float rmsnorm_element(float x, float rstd, float weight) {
    return __fmul_rn(__fmul_rn(x, rstd), weight);
}

// Butterfly reductions inside a warp. Every lane ends with the same value, bit for bit (float
// addition is commutative, and every lane combines the same pairs at each level).
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ inline float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// The maxima of P rows at once (P a power of two, 2..32): lane l holds m[p], its part of row p, for every p, and
// gets the whole of row l / (32 / P). Each of the first log2(P) butterfly steps halves the rows a lane carries
// (one shuffle per row kept instead of one per row per step), the last steps combine lanes of the same row: P - 1
// + log2(32 / P) shuffles for P rows where P warp_max calls take 5P. A max is exact in any order, so each row's
// result is warp_max's.
template <int P>
__device__ inline float warp_rows_max(float m[P]) {
    static_assert(P >= 2 && P <= 32 && (P & (P - 1)) == 0, "P rows, a power of two up to 32");
    const int lane = threadIdx.x & 31;
    int offset = 16;
#pragma unroll
    for (int n = P; n > 1; n /= 2, offset >>= 1) {
        const bool upper = (lane & offset) != 0;  // keeps rows n/2 .. n-1 of the n it carries
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            const float send = upper ? m[i] : m[i + n / 2], keep = upper ? m[i + n / 2] : m[i];
            m[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, offset));
        }
    }
    float v = m[0];
#pragma unroll
    for (; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Block-wide reductions; blockDim.x must be a multiple of 32 (at most 1024). Every thread gets the
// result. The order (per-warp tree, then a tree over the warp partials) depends only on blockDim.x,
// so a fixed launch configuration gives bitwise-identical sums on every run. `scratch` is a
// __shared__ float[32]; it may be reused by consecutive calls (the first __syncthreads protects it).
__device__ inline float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < n_warps ? scratch[lane] : 0.0f);
}
__device__ inline float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < n_warps ? scratch[lane] : -INFINITY);
}

// ---------------------------------------------------------------------------- segment tables
// The segments of a grouped call (the routed experts' token segments in one launch; one segment for the
// plain calls): segment g is rows [rows0[g], rows0[g+1]) of the token-major input or output, its 1x128
// operand (and its Fprop/Dgrad GEMM's BF16 output) starts at row p16[g] (every segment padded to a
// multiple of 16 rows) and its 128x1 operand at 128-row tile tiles0[g] (kernels.h, the *_grouped layouts).
// Shared by the quantisers (fp8_quant.cu) and the GEMMs' output conversion (gemm.cu). Passed by value as
// a __grid_constant__ kernel parameter (3 KB, read from the constant bank, no copy per thread).
struct SegTable {
    int n;
    int rows0[FP8_MAX_SEGMENTS + 1], p16[FP8_MAX_SEGMENTS + 1], tiles0[FP8_MAX_SEGMENTS + 1];
};

// The table of n segments given by the host array rows0 (n + 1 entries); stops the process, naming op,
// when n is outside 1..FP8_MAX_SEGMENTS or rows0 does not start at 0 and never decrease.
static inline SegTable seg_table(const char *op, int n, const int *rows0) {
    if (n < 1 || n > FP8_MAX_SEGMENTS) {
        fprintf(stderr, "%s:%d: %s: %d segments - expected 1 to %d (FP8_MAX_SEGMENTS, kernels.h)\n", __FILE__, __LINE__,
                op, n, FP8_MAX_SEGMENTS);
        exit(1);
    }
    SegTable t;
    t.n = n;
    t.rows0[0] = t.p16[0] = t.tiles0[0] = 0;
    for (int g = 0; g < n; g++) {
        const int rows = rows0[g + 1] - rows0[g];
        if (rows0[0] != 0 || rows < 0) {
            fprintf(stderr, "%s:%d: %s: rows0[0] = %d, segment %d has rows %d..%d - expected rows0[0] = 0 and rows0 "
                            "non-decreasing\n", __FILE__, __LINE__, op, rows0[0], g, rows0[g], rows0[g + 1]);
            exit(1);
        }
        t.rows0[g + 1] = rows0[g + 1];
        t.p16[g + 1] = t.p16[g] + (rows + 15) / 16 * 16;
        t.tiles0[g + 1] = t.tiles0[g] + (rows + FP8_TILE - 1) / FP8_TILE;
    }
    return t;
}

// The segment holding position v of a prefix array (rows0, p16 or tiles0): the largest g < n with
// prefix[g] <= v. Empty segments (prefix[g] == prefix[g + 1]) are never returned for a v below prefix[n].
__device__ inline int segment_of(const int *prefix, int n, int v) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (prefix[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The current device's SM count, asked once per process (a process uses one device): the persistent kernels'
// grid size.
static inline int cuda_sm_count(void) {
    static int sms = 0;
    if (sms == 0) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    return sms;
}

// RoPE's cos table (T, D/2) then its sin table (T, D/2) for angle t theta^(-2j/D), on the device, cached for the
// last (T, D, theta) (elementwise.cu): valid until the next call with other arguments.
const float *cuda_rope_table(int T, int D, float theta);

// ---------------------------------------------------------------------------- asynchronous copies to shared memory
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronous (completes at the next cp_async_wait_all of this thread).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// The same, reading src_bytes (0 or 16) of src and zero-filling the rest: 0 writes 16 zero bytes, reading nothing.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits for all but the most recently committed group of this thread's copies.
__device__ __forceinline__ void cp_async_wait_all_but_last() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

#endif // __CUDACC__

#endif
