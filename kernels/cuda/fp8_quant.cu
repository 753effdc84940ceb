/*
 * fp8_quant.cu - CUDA FP8 (E4M3) block quantisers of DeepSeek-V3's recipe (kernels.h: fp8_quantize_1x128,
 * fp8_quantize_128x128, fp8_quantize_128x1_transposed, fp8_quantize_both_layouts, and the activation
 * quantisers' *_grouped forms, which run one launch over many segments through a segment table (SegTable,
 * common.cuh); the plain forms are one segment of the same kernels; the fp8_quantize_swiglu_* forms are the
 * same kernels reading a SwiGLU value computed on the fly instead of an array, and
 * fp8_quantize_swiglu_grads_both_layouts_grouped is the both-layouts kernel holding two values, da and db, per
 * element; the both-layouts calls of the SwiGLU output and gradients run pipelined through shared memory where the
 * columns are whole tiles). They feed the cuBLASLt block-scaled GEMMs of gemm.cu and must produce BIT-IDENTICAL
 * FP8 data and scales to the CPU reference (kernels/cpu/fp8.c), which tests/gpu/test_gpu_fp8.c checks.
 *
 * Why they match the CPU bit for bit: per tile, amax is a max (exact in any order), s = amax / 448 is one
 * IEEE division (__fdiv_rn, no reciprocal), s = 1 when that is 0, and q = E4M3(x / s) is the correctly rounded
 * quotient (fp8_div: the IEEE division's E4M3 code from a reciprocal made once per scale and an FMA correction, two
 * divisions per element having made the both-layouts kernels issue-bound) followed by the hardware conversion
 * cvt.rn.satfinite.e4m3 (round-to-nearest-even, saturating to +-448, sign kept), the same function as
 * fp8_e4m3_from_float. Elements outside the valid region (partial tiles, padding) are 0 and quantise to 0x00.
 *
 * NaN/Inf: a non-finite element is recorded by an integer atomicMin of (call number << 40 | its
 * row-major index) into one device word - an integer atomic that only finds the first bad element of the
 * first bad call, never a floating-point one. The quantisers do NOT wait for it: a host wait per call
 * synchronised the GPU thousands of times a training step (in the first step benchmark about a fifth of
 * the fp8 step was the GPU idling in quantisation). cuda_fp8_check_finite copies the word back once (the
 * trainer calls it once per step) and names the op, tensor, shape, row and column from a host log of the
 * calls since the last check. The log holds FP8_CALL_LOG calls; the call that would overflow it checks
 * first (one wait per FP8_CALL_LOG calls).
 * On error the outputs hold whatever the kernel wrote and must not be used.
 *
 * Memory traffic is the cost (read 4 bytes, write 1 or 2 bytes per element); every kernel reads and
 * writes whole 128-byte lines: 1x128 with one warp per (row, 4 x 128 columns), 128x128 with one block per
 * block (the transposed copy goes through shared memory), 128x1 and both activation layouts with one block per
 * 128 x 128 tile (transposed through shared memory, so each output row of 128 bytes is one coalesced store).
 * Vector (float4) loads are used when the row length is a multiple of 4 and every input is 16-byte aligned.
 */
#include <cuda_fp8.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/swiglu.cuh"

static const unsigned long long NO_BAD_ELEMENT = ~0ull;

// ---------------------------------------------------------------------------- shared pieces
// s = amax / 448, or 1 when that is 0 (amax = 0, or an amax so small that the quotient underflows: then
// every x / 1 encodes as 0, where x / 0 would give NaN codes) - as the CPU's scale_of_amax.
__device__ inline float fp8_scale_of(float amax) {
    const float s = __fdiv_rn(amax, FP8_E4M3_MAX);
    return s > 0.0f ? s : 1.0f;
}

// A tile's scale s and its correctly rounded reciprocal r = RN(1 / s), made once per scale so that each element's
// quotient x / s costs a multiply, two FMAs and a sign copy instead of an IEEE division (fp8_div); fast = s lies in
// the range where that gives the division's E4M3 code for every element of the tile.
struct Fp8Divisor {
    float s, r;
    bool fast;
};
__device__ inline bool fp8_fast_scale(float s) { return s >= 0x1p-90f && s <= 0x1p125f; }
__device__ inline Fp8Divisor fp8_divisor(float s) { return Fp8Divisor{s, __frcp_rn(s), fp8_fast_scale(s)}; }

// x / s for an element x of the tile whose scale is s (|x| <= 448 s, up to s's rounding), with d.fast: a quotient
// whose E4M3 code (cvt.rn.satfinite) is that of __fdiv_rn(x, s), the CPU's true division. With r = RN(1/s),
// q = RN(x r) is within one ulp of x / s, the remainder x - s q is exact in one FMA, and RN(q + (x - s q) r) is the
// correctly rounded quotient (Markstein's correction theorem). Scaling x and s by a power of two scales every step
// exactly, so that holds wherever r and q are normal and the remainder is representable: it is a multiple of
// 2^(e_s + e_q - 46) (e_s, e_q: the exponents of s and q), so with s >= 2^-90 and a quotient >= 2^-12 it is a
// multiple of 2^-148 (an FP32 subnormal at worst, exact), and s <= 2^125 keeps r normal. So every quotient >= 2^-12
// has the division's FP32 bits. A smaller one, true or computed (the latter within a few ulps of the former), lies
// below E4M3's half-subnormal 2^-10: both encode as a zero of x's sign, which copysignf keeps where the correction
// would lose it (x = -0 gives +0 from the FMAs). So no element needs a range test, only the tile's scale: the IEEE
// division serves tiles with s outside the range (amax below about 2^-81, or non-finite). The low end matters:
// gradients' tiles have scales far below 2^-20, where an earlier range stopped (docs/fp8.md has the measurement).
// tests/gpu/test_gpu_fp8.c compares the codes with __fdiv_rn's for every FP32 significand of s, on both sides of
// 2^-90 (cuda_fp8_division_mismatches).
__device__ inline float fp8_div_fast(float x, Fp8Divisor d) {
    const float q = __fmul_rn(x, d.r);
    return copysignf(__fmaf_rn(__fmaf_rn(-d.s, q, x), d.r, q), x);
}

__device__ inline float fp8_div(float x, Fp8Divisor d) { return d.fast ? fp8_div_fast(x, d) : __fdiv_rn(x, d.s); }

__device__ inline uint32_t fp8_byte(float x, Fp8Divisor d) {
    return (uint32_t)__nv_cvt_float_to_fp8(fp8_div(x, d), __NV_SATFINITE, __NV_E4M3);
}

// Four quantised values of one scale packed little-endian (element j in byte j), for one 4-byte store. One branch on
// the scale for the four (not one per element), and the conversion takes two values per instruction (the same
// rounding as one at a time).
__device__ inline uint32_t fp8_pack4(const float v[4], Fp8Divisor d) {
    float q[4];
    if (d.fast) {
        for (int j = 0; j < 4; j++) q[j] = fp8_div_fast(v[j], d);
    } else {
        for (int j = 0; j < 4; j++) q[j] = __fdiv_rn(v[j], d.s);
    }
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
    return (lo & 0xffffu) | (hi << 16);
}

// The self-check behind cuda_fp8_division_mismatches: for s = every significand (blockIdx, threadIdx) times 2^e,
// e in [-100, 118] (tiles on both sides of the fast range's lower end; 448 s overflows from 2^119 on), and
// `per_scale` pseudo-random elements x of either sign with |x| / s from 2^-71 to 448 (448 itself, and signed zeros,
// included; x subnormal for the smallest s), counts the elements whose E4M3 code differs from the IEEE division's,
// and those of the fast path with a quotient >= 2^-12 whose FP32 bits differ (the stronger claim, where it holds).
// Integer counts: the test's only use of an atomic.
__global__ void fp8_division_check_kernel(int per_scale, unsigned long long *mismatches) {
    const uint32_t m = blockIdx.x * blockDim.x + threadIdx.x;  // 23-bit significand
    if (m >= (1u << 23)) return;
    unsigned long long bad = 0;
    uint64_t z = 0x9E3779B97F4A7C15ull * (m + 1);
    for (int k = 0; k < per_scale; k++) {
        z ^= z >> 31, z *= 0xBF58476D1CE4E5B9ull, z ^= z >> 29;
        const int es = (int)((z >> 8) % 219) - 100, eu = (int)((z >> 16) % 80) - 71;  // u in [2^-71, 2^9)
        const float sv = __uint_as_float(((uint32_t)(127 + es) << 23) | m);
        const float u = (z & 0xff) == 1 ? 448.0f : (z & 0xff) == 2 ? 0.0f
                        : fminf(__uint_as_float(((uint32_t)(127 + eu) << 23) | (uint32_t)((z >> 32) & 0x7fffffu)),
                                448.0f);
        const float xv = (z >> 63) ? -__fmul_rn(sv, u) : __fmul_rn(sv, u);
        const Fp8Divisor d = fp8_divisor(sv);
        const float fast = fp8_div(xv, d), ieee = __fdiv_rn(xv, sv);
        bad += __nv_cvt_float_to_fp8(fast, __NV_SATFINITE, __NV_E4M3) !=
               __nv_cvt_float_to_fp8(ieee, __NV_SATFINITE, __NV_E4M3);
        bad += d.fast && fabsf(ieee) >= 0x1p-12f && __float_as_uint(fast) != __float_as_uint(ieee);
    }
    if (bad) atomicAdd(mismatches, bad);
}

// max(a, b), NaN when either is (PTX max.NaN), where fmaxf would drop a NaN: a running maximum of |x| that is finite
// only when every x was.
__device__ inline float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Records element `index` (row-major in the input) of the call tagged `call` (call number << 40) as
// non-finite; the smallest (call, index) wins. The kernels issue all of a thread's loads before the first
// check: the compiler may not move a load of x across this atomic (the pointers might alias), so loads
// interleaved with checks run one at a time (the both-layouts kernel sat at 41% of DRAM bandwidth).
__device__ inline void note_if_bad(float v, unsigned long long index, unsigned long long call,
                                   unsigned long long *bad) {
    if (!isfinite(v)) atomicMin(bad, call | index);
}

// Loads x[0..3] of a row of `len` valid elements starting at column `col`; missing ones are 0.
template <bool VEC4>
__device__ inline void load4(float v[4], const float *row, int col, int len) {
    if (VEC4 && col + 3 < len) {
        const float4 f = *reinterpret_cast<const float4 *>(row + col);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
        for (int j = 0; j < 4; j++) v[j] = (col + j < len) ? row[col + j] : 0.0f;
    }
}

// The same for BF16 bits (8-byte loads), widened to the FP32 values they hold.
template <bool VEC4>
__device__ inline void load4(float v[4], const uint16_t *row, int col, int len) {
    if (VEC4 && col + 3 < len) {
        const float4 f = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(row + col));
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
        for (int j = 0; j < 4; j++) v[j] = (col + j < len) ? bf16_bits_to_float(row[col + j]) : 0.0f;
    }
}

static int is_aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

// What an activation quantiser reads: its load4 gives 4 values from `col` of row `row` of the segments' rows (of
// `len` valid elements; len = 0 for a padding row, which loads zeros without touching memory).
// An FP32 array of rows of C; row r read through rows[r] when rows is given (the routed experts' token rows).
struct ArrayRows {
    const float *x;
    const int *rows;
    int C;
    bool aligned16() const { return is_aligned(x, 16); }
    template <bool VEC4>
    __device__ void load4(float v[4], int64_t row, int col, int len) const {
        if (len == 0) {
            v[0] = v[1] = v[2] = v[3] = 0.0f;
            return;
        }
        ::load4<VEC4>(v, x + (rows ? (int64_t)rows[row] : row) * C, col, len);
    }
    // The same for a row and 4 columns inside the array, 16-byte aligned (the both-layouts kernel's full tiles).
    __device__ void load4_full(float v[4], int64_t row, int col) const {
        const float4 f = *reinterpret_cast<const float4 *>(x + (rows ? (int64_t)rows[row] : row) * C + col);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
};

// RMSNorm(x)'s rows computed as they are read (kernels.h fp8_quantize_rmsnorm_both_layouts), with rmsnorm.cu's
// arithmetic (common.cuh rmsnorm_element): the bits rmsnorm_forward would have stored. rstd as rmsnorm_forward
// wrote it.
struct NormRows {
    const float *x, *rstd, *weight;
    int C;
    bool aligned16() const { return is_aligned(x, 16) && is_aligned(weight, 16); }
    template <bool VEC4>
    __device__ void load4(float v[4], int64_t row, int col, int len) const {
        if (len == 0) {
            v[0] = v[1] = v[2] = v[3] = 0.0f;
            return;
        }
        float xv[4], wv[4];
        ::load4<VEC4>(xv, x + row * C, col, len);
        ::load4<VEC4>(wv, weight, col, len);
        const float r = rstd[row];
        for (int j = 0; j < 4; j++) v[j] = col + j < len ? rmsnorm_element(xv[j], r, wv[j]) : 0.0f;
    }
    // The same for 4 columns inside the rows (the both-layouts kernel's full tiles): no padding to clear.
    __device__ void load4_full(float v[4], int64_t row, int col) const {
        const float4 xv = *reinterpret_cast<const float4 *>(x + row * C + col);
        const float4 wv = *reinterpret_cast<const float4 *>(weight + col);
        const float r = rstd[row];
        v[0] = rmsnorm_element(xv.x, r, wv.x), v[1] = rmsnorm_element(xv.y, r, wv.y);
        v[2] = rmsnorm_element(xv.z, r, wv.z), v[3] = rmsnorm_element(xv.w, r, wv.w);
    }
};

// A SwiGLU value computed from its inputs as it is read (kernels.h fp8_quantize_swiglu_*), with swiglu.cuh's
// arithmetic: the bits swiglu_forward / swiglu_backward would have stored. a, b and dout are BF16 rows of stride
// round_up(C, 128) (the GEMMs' own outputs). A branch on `value` is the same for the whole grid.
struct SwigluRows {
    SwigluValue value;
    const uint16_t *dout;         // only for DA and DB
    const uint16_t *a, *b;        // b only for OUT and DA
    int C;
    int64_t ld;                   // bf16_rows_ld(C)
    bool aligned16() const { return is_aligned(dout, 16) && is_aligned(a, 16) && is_aligned(b, 16); }
    template <bool VEC4>
    __device__ void load4(float v[4], int64_t row, int col, int len) const {
        float av[4], bv[4] = {0.0f, 0.0f, 0.0f, 0.0f}, gv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t at = row * ld;
        ::load4<VEC4>(av, a + at, col, len);
        if (value != SWIGLU_DB) ::load4<VEC4>(bv, b + at, col, len);
        if (value != SWIGLU_OUT) ::load4<VEC4>(gv, dout + at, col, len);
        for (int j = 0; j < 4; j++) {
            float da, db;
            if (value == SWIGLU_OUT) v[j] = swiglu_element(av[j], bv[j]);
            else swiglu_backward_element(&da, &db, gv[j], av[j], bv[j]), v[j] = value == SWIGLU_DA ? da : db;
            if (col + j >= len) v[j] = 0.0f;  // padding is 0 whatever the gate gives for zero inputs
        }
    }
    // The same for 4 columns inside the rows (the both-layouts kernel's full tiles): no padding to clear.
    __device__ void load4_full(float v[4], int64_t row, int col) const {
        const int64_t at = row * ld + col;
        const float4 av = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(a + at));
        const float4 bv = value != SWIGLU_DB ? bf16x4_to_float4(*reinterpret_cast<const uint2 *>(b + at))
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4 gv = value != SWIGLU_OUT ? bf16x4_to_float4(*reinterpret_cast<const uint2 *>(dout + at))
                                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float as[4] = {av.x, av.y, av.z, av.w}, bs[4] = {bv.x, bv.y, bv.z, bv.w};
        const float gs[4] = {gv.x, gv.y, gv.z, gv.w};
        for (int j = 0; j < 4; j++) {
            float da, db;
            if (value == SWIGLU_OUT) v[j] = swiglu_element(as[j], bs[j]);
            else swiglu_backward_element(&da, &db, gs[j], as[j], bs[j]), v[j] = value == SWIGLU_DA ? da : db;
        }
    }
};

// Both SwiGLU gradients from one read of dout, a, b (kernels.h fp8_quantize_swiglu_grads_both_layouts_grouped): its
// load4x2 gives da and db of 4 elements - the values SwigluRows gives for SWIGLU_DA and SWIGLU_DB (db does not
// depend on b, which SwigluRows does not read for it), from one sigmoid per element.
struct SwigluGradRows {
    const uint16_t *dout, *a, *b;  // BF16 rows, as SwigluRows'
    int C;
    int64_t ld;
    bool aligned16() const { return is_aligned(dout, 16) && is_aligned(a, 16) && is_aligned(b, 16); }
    template <bool VEC4>
    __device__ void load4x2(float da[4], float db[4], int64_t row, int col, int len) const {
        float av[4], bv[4], gv[4];
        const int64_t at = row * ld;
        ::load4<VEC4>(av, a + at, col, len);
        ::load4<VEC4>(bv, b + at, col, len);
        ::load4<VEC4>(gv, dout + at, col, len);
        for (int j = 0; j < 4; j++) {
            swiglu_backward_element(&da[j], &db[j], gv[j], av[j], bv[j]);
            if (col + j >= len) da[j] = db[j] = 0.0f;  // padding is 0, as SwigluRows'
        }
    }
    // The same for 4 columns inside the rows (the both-layouts kernel's full tiles): no padding to clear.
    __device__ void load4x2_full(float da[4], float db[4], int64_t row, int col) const {
        const int64_t at = row * ld + col;
        const float4 av = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(a + at));
        const float4 bv = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(b + at));
        const float4 gv = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(dout + at));
        grads4(da, db, gv, av, bv);
    }
    // da and db of 4 elements from their dout, a and b (read from global memory above, from shared memory by the
    // pipelined kernel).
    static __device__ void grads4(float da[4], float db[4], float4 gv, float4 av, float4 bv) {
        swiglu_backward_element(&da[0], &db[0], gv.x, av.x, bv.x);
        swiglu_backward_element(&da[1], &db[1], gv.y, av.y, bv.y);
        swiglu_backward_element(&da[2], &db[2], gv.z, av.z, bv.z);
        swiglu_backward_element(&da[3], &db[3], gv.w, av.w, bv.w);
    }
};

// The routed experts' output gradient through the routing plan (kernels.h
// fp8_quantize_combine_grad_both_layouts_grouped): row s is w_s * dout[t], the product moe.cu's combine backward
// stores, for t = seg_token[s] and w_s = slot_w[s], the weight topk_w[t,k] of the k whose slot_of entry is s
// (combine_slot_weights_kernel, once per call). A row's two loads (its token, its weight) are independent, so only
// its dout load waits for one of them. Finding the weight among the token's K slots in every tile (two loads, a
// ballot and a shuffle per row, after the token's load) left the kernel at 54% of DRAM bandwidth, its warps waiting
// on loads 5.4 of every 14 cycles (ncu, H100, 2026-12-06); looked up once per call it is 27% faster.
struct CombineGradRows {
    const float *dout;
    const int *seg_token;
    const float *slot_w;
    int C;
    bool aligned16() const { return is_aligned(dout, 16); }
    template <bool VEC4>
    __device__ void load4(float v[4], int64_t row, int col, int len) const {
        if (len == 0) {
            v[0] = v[1] = v[2] = v[3] = 0.0f;
            return;
        }
        const int64_t t = seg_token[row];
        const float w = slot_w[row];
        ::load4<VEC4>(v, dout + t * C, col, len);
        for (int j = 0; j < 4; j++) v[j] = col + j < len ? __fmul_rn(w, v[j]) : 0.0f;  // padding: 0, as an array's
    }
    // The same for 4 columns of a row inside the array (the both-layouts kernel's full tiles).
    __device__ void load4_full(float v[4], int64_t row, int col) const {
        const int64_t t = seg_token[row];
        const float w = slot_w[row];
        const float4 f = *reinterpret_cast<const float4 *>(dout + t * C + col);
        v[0] = __fmul_rn(w, f.x), v[1] = __fmul_rn(w, f.y), v[2] = __fmul_rn(w, f.z), v[3] = __fmul_rn(w, f.w);
    }
};

// slot_w[s] for the rows s < rows of the plan: topk_w[t,k] for t = seg_token[s] and the k whose slot_of entry is s
// (the last such; 0 if none), one thread per row.
__global__ void combine_slot_weights_kernel(float *slot_w, const int *seg_token, const int *slot_of,
                                            const float *topk_w, int K, int rows) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= rows) return;
    const int64_t t = seg_token[s];
    float w = 0.0f;
    for (int k = 0; k < K; k++) w = slot_of[t * K + k] == s ? topk_w[t * K + k] : w;
    slot_w[s] = w;
}

// The per-process device word that the kernels report the first bad element into, and a pinned host
// word to read it back. The word holds NO_BAD_ELEMENT between checks: it is set once at allocation and
// reset only after a check that found a bad element.
static unsigned long long *bad_word_device = NULL, *bad_word_host = NULL;

// What each call since the last check quantised, so a bad element can be named; calls[i] is call i.
#define FP8_CALL_LOG 4096
static const int CALL_SHIFT = 40; // element indices below 2^40, call numbers above
typedef struct {
    const char *op, *tensor;
    int rows, cols;
} QuantCall;
static QuantCall calls[FP8_CALL_LOG];
static int n_calls = 0;

static unsigned long long *bad_word(void) {
    if (bad_word_device == NULL) {
        cuda_counted_malloc((void **)&bad_word_device, sizeof *bad_word_device, __FILE__, __LINE__);
        CUDA_CHECK(cudaMallocHost(&bad_word_host, sizeof *bad_word_host));
        CUDA_CHECK(cudaMemset(bad_word_device, 0xFF, sizeof *bad_word_device)); // = NO_BAD_ELEMENT
    }
    return bad_word_device;
}

// Waits for the GPU, then 0 if every element quantised since the last check was finite; else -1 and
// "op: tensor (rows, cols) has a non-finite value (NaN or Inf) at row r, column c" in err. Clears the log.
extern "C" int cuda_fp8_check_finite(char *err, size_t err_size) {
    if (bad_word_device == NULL) return 0;
    CUDA_CHECK(cudaMemcpyAsync(bad_word_host, bad_word_device, sizeof *bad_word_host, cudaMemcpyDeviceToHost, 0));
    CUDA_CHECK(cudaStreamSynchronize(0));
    const unsigned long long word = *bad_word_host;
    const int logged = n_calls;
    n_calls = 0;
    if (word == NO_BAD_ELEMENT) return 0;
    CUDA_CHECK(cudaMemset(bad_word_device, 0xFF, sizeof *bad_word_device));
    const unsigned long long call = word >> CALL_SHIFT, index = word & ((1ull << CALL_SHIFT) - 1);
    if (err == NULL || err_size == 0) return -1;
    if ((int)call >= logged) {  // cannot happen unless the word was written outside these functions
        snprintf(err, err_size, "fp8 quantisation: a non-finite value in call %llu of %d since the last check",
                 call, logged);
        return -1;
    }
    const QuantCall *c = &calls[call];
    snprintf(err, err_size, "%s: %s (%d, %d) has a non-finite value (NaN or Inf) at row %lld, column %lld - "
             "expected finite values", c->op, c->tensor, c->rows, c->cols,
             (long long)(index / (unsigned long long)c->cols), (long long)(index % (unsigned long long)c->cols));
    return -1;
}

// Logs a call about to be launched and returns its tag (call number << 40) for the kernel. The call
// that would overflow the log checks the earlier ones first; their error, if any, is its result (*rc).
static unsigned long long log_call(const char *op, const char *tensor, int rows, int cols, int *rc, char *err,
                                   size_t err_size) {
    *rc = n_calls == FP8_CALL_LOG ? cuda_fp8_check_finite(err, err_size) : 0;
    calls[n_calls] = (QuantCall){op, tensor, rows, cols};
    return (unsigned long long)n_calls++ << CALL_SHIFT;
}

// Output pointers are written with 4-byte stores and later read by cuBLASLt, which needs 16 bytes.
static void require_aligned16(const void *p, const char *op, const char *name) {
    if (p != NULL && !is_aligned(p, 16)) {
        fprintf(stderr, "%s:%d: %s: %s = %p is not 16-byte aligned - expected a 16-byte aligned device pointer "
                        "(cuBLASLt FP8 operands need it)\n", __FILE__, __LINE__, op, name, p);
        exit(1);
    }
}

static inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------- 1x128 along K
// x (rows, K) -> q (R16, Kp), s (KB, R16), R16 = rows rounded up to 16; the padding rows are quantised as
// zero rows (code 0, scale 1), so callers never copy a segment to pad it. One warp per row and 4 consecutive K-blocks: lane l holds
// columns 4l..4l+3 of each tile (all 4 tiles are loaded before the first reduction, so 2 KiB per warp
// are in flight), amax is a warp max per tile, lane 0 writes the scales. A block is 8 warps = 8
// consecutive rows, so the 8 scales of one K-block it writes are contiguous in s.
static const int Q1X128_ROWS_PER_BLOCK = 8;
static const int Q1X128_TILES_PER_WARP = 4;

template <bool VEC4, class Src>
__global__ void quantize_1x128_kernel(uint8_t *q, float *s, const __grid_constant__ Src src,
                                      const __grid_constant__ SegTable seg, int K, int KB, unsigned long long call,
                                      unsigned long long *bad) {
    const int lane = threadIdx.x & 31;
    const int prow = blockIdx.x * Q1X128_ROWS_PER_BLOCK + (threadIdx.x >> 5); // row of q, over all segments
    const int kb0 = blockIdx.y * Q1X128_TILES_PER_WARP;
    if (prow >= seg.p16[seg.n]) return; // the whole warp leaves together
    const int g = segment_of(seg.p16, seg.n, prow);
    const int r = prow - seg.p16[g], R16 = seg.p16[g + 1] - seg.p16[g];
    const int64_t row = seg.rows0[g] + r; // in x
    const int len = r < seg.rows0[g + 1] - seg.rows0[g] ? K : 0; // a padding row loads as zeros
    float v[Q1X128_TILES_PER_WARP][4];
    for (int i = 0; i < Q1X128_TILES_PER_WARP; i++)
        src.template load4<VEC4>(v[i], row, (kb0 + i) * FP8_TILE + lane * 4, len);
    for (int i = 0; i < Q1X128_TILES_PER_WARP && kb0 + i < KB; i++) {
        const int col = (kb0 + i) * FP8_TILE + lane * 4;
        float a = 0.0f;
        for (int j = 0; j < 4; j++) {
            note_if_bad(v[i][j], (unsigned long long)row * K + col + j, call, bad);
            a = fmaxf(a, fabsf(v[i][j]));
        }
        const float sc = fp8_scale_of(warp_max(a));
        *reinterpret_cast<uint32_t *>(q + (int64_t)prow * KB * FP8_TILE + col) = fp8_pack4(v[i], fp8_divisor(sc));
        if (lane == 0) s[(int64_t)KB * seg.p16[g] + (int64_t)(kb0 + i) * R16 + r] = sc;
    }
}

template <class Src>
static int quantize_1x128_segments(const char *op, const char *tensor, uint8_t *q, float *s, const Src &src, int n,
                                   const int *rows0, int K, char *err, size_t err_size) {
    const SegTable seg = seg_table(op, n, rows0);
    if (seg.p16[n] == 0 || K <= 0) return 0;
    require_aligned16(q, op, "q");
    require_aligned16(s, op, "s");
    const int KB = ceil_div(K, FP8_TILE);
    unsigned long long *bad = bad_word();
    int rc;
    const unsigned long long call = log_call(op, tensor, rows0[n], K, &rc, err, err_size);
    const dim3 grid((unsigned)ceil_div(seg.p16[n], Q1X128_ROWS_PER_BLOCK), (unsigned)ceil_div(KB, Q1X128_TILES_PER_WARP));
    const int threads = 32 * Q1X128_ROWS_PER_BLOCK;
    if (K % 4 == 0 && src.aligned16())
        quantize_1x128_kernel<true><<<grid, threads>>>(q, s, src, seg, K, KB, call, bad);
    else
        quantize_1x128_kernel<false><<<grid, threads>>>(q, s, src, seg, K, KB, call, bad);
    CUDA_CHECK_LAUNCH("quantize_1x128_kernel");
    return rc;
}

extern "C" int cuda_fp8_quantize_1x128(uint8_t *q, float *s, const real *x, int rows, int K, char *err,
                                       size_t err_size) {
    if (rows <= 0) return 0;
    const int rows0[2] = {0, rows};
    return quantize_1x128_segments("fp8_quantize_1x128", "x", q, s, ArrayRows{x, NULL, K}, 1, rows0, K, err, err_size);
}

extern "C" int cuda_fp8_quantize_1x128_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg,
                                               const int *rows0, int K, char *err, size_t err_size) {
    return quantize_1x128_segments("fp8_quantize_1x128_grouped", "x", q, s, ArrayRows{x, x_rows, K}, n_seg, rows0, K,
                                   err, err_size);
}

// ---------------------------------------------------------------------------- 1x128 rows gathered
// kernels.h fp8_gather_1x128_grouped: q (P16, Kp), s from qx (R16x, Kp), sx (KB, R16x). One warp per operand row:
// 16-byte copies of its Kp bytes (Kp is a multiple of 128) and lanes kb < KB copy its scales; a padding row is
// code 0 with scale 1, as the quantiser writes it.
static const int GATHER_ROWS_PER_BLOCK = 8;

__global__ void gather_1x128_kernel(uint8_t *q, float *s, const uint8_t *qx, const float *sx, int R16x,
                                    const int *x_rows, const __grid_constant__ SegTable seg, int Kp, int KB) {
    const int lane = threadIdx.x & 31;
    const int prow = blockIdx.x * GATHER_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (prow >= seg.p16[seg.n]) return;
    const int g = segment_of(seg.p16, seg.n, prow);
    const int r = prow - seg.p16[g], R16 = seg.p16[g + 1] - seg.p16[g];
    const bool valid = r < seg.rows0[g + 1] - seg.rows0[g];
    const int64_t src = valid ? x_rows[seg.rows0[g] + r] : 0;
    uint4 *dst = reinterpret_cast<uint4 *>(q + (int64_t)prow * Kp);
    const uint4 *from = reinterpret_cast<const uint4 *>(qx + src * Kp);
    for (int i = lane; i < Kp / 16; i += 32) dst[i] = valid ? from[i] : make_uint4(0, 0, 0, 0);
    for (int kb = lane; kb < KB; kb += 32)
        s[(int64_t)KB * seg.p16[g] + (int64_t)kb * R16 + r] = valid ? sx[(int64_t)kb * R16x + src] : 1.0f;
}

extern "C" void cuda_fp8_gather_1x128_grouped(uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n,
                                              const int *x_rows, int n_seg, const int *rows0, int K) {
    static const char op[] = "fp8_gather_1x128_grouped";
    const SegTable seg = seg_table(op, n_seg, rows0);
    if (seg.p16[n_seg] == 0 || K <= 0) return;
    require_aligned16(q, op, "q"), require_aligned16(s, op, "s");
    require_aligned16(qx, op, "qx"), require_aligned16(sx, op, "sx");
    const int KB = ceil_div(K, FP8_TILE);
    gather_1x128_kernel<<<ceil_div(seg.p16[n_seg], GATHER_ROWS_PER_BLOCK), 32 * GATHER_ROWS_PER_BLOCK>>>(
        q, s, qx, sx, ceil_div(x_n, 16) * 16, x_rows, seg, KB * FP8_TILE, KB);
    CUDA_CHECK_LAUNCH("gather_1x128_kernel");
}

// The transposed byte tiles ([column][row] of a 128 x 128 block in shared memory, filled by threads that each hold
// PASSES consecutive rows of 4 adjacent columns): chunk k of column cc (its rows k * PASSES ..) lies at chunk
// k ^ tile_swizzle(cc) of the column's 128 bytes, CHUNKS = 128 / PASSES per column. Then the 16 (8-byte chunks: a
// half-warp's accesses) or 32 (4-byte) columns 4 apart that a warp's chunk stores reach, and the chunks of one column
// that a warp's reads take for the global stores, all fall in distinct banks.
template <int CHUNKS>
__device__ inline int tile_swizzle(int cc) { return (cc >> 2) & (CHUNKS - 1); }

// ---------------------------------------------------------------------------- 128x128 blocks (+ transpose)
// w (N, K) -> q (Np, Kp), qt (Kp, Np), s (NB, KB4) with s[nb*KB4 + kb]; s[nb*KB4 + kb] for KB <= kb < KB4
// is padding, written 1 (the scale of an all-zero block, as the CPU writes). One block of 512 threads per
// 128x128 block: thread t holds columns 4*(t%32)..+3 of the 8 consecutive rows 8*(t/32) + p (p = 0..7), i.e. its
// 32 values stay in registers between the block max and the quantisation (at most 64 registers, so two blocks,
// 32 warps, fit on an SM and one block's loads overlap the other's arithmetic). qt is written from a byte copy of
// the block in shared memory: the thread's 4 x 8 codes, transposed in registers (byte permutes), are one 8-byte
// chunk per column (tile_swizzle).
#define Q128_THREADS 512
static const int Q128_PASSES = FP8_TILE / (Q128_THREADS / 32); // 8 rows per thread

// Matrix blockIdx.z of a stack (w (batch, N, K) -> q, qt (batch, Np*Kp), s (batch, NB*KB4)); a NaN's index is
// its row-major position in the stacked (batch * N, K).
template <bool VEC4>
__global__ void __launch_bounds__(Q128_THREADS, 2)
    quantize_128x128_kernel(uint8_t *q, uint8_t *qt, float *s, const float *w, int N, int K, int Np, int Kp, int KB,
                            int KB4, unsigned long long call, unsigned long long *bad) {
    constexpr int CHUNKS = FP8_TILE / Q128_PASSES;
    __shared__ float scratch[32];
    __shared__ __align__(16) uint8_t tile[FP8_TILE][FP8_TILE];  // [column][row], 8-byte chunks (tile_swizzle)
    const int kb = blockIdx.x, nb = blockIdx.y, z = blockIdx.z;
    w += (int64_t)z * N * K, q += (int64_t)z * Np * Kp, s += (int64_t)z * (Np / FP8_TILE) * KB4;
    if (qt != NULL) qt += (int64_t)z * Np * Kp;
    const unsigned long long matrix0 = (unsigned long long)z * N * K;
    const int c = (threadIdx.x & 31) * 4, rg = threadIdx.x >> 5, r0 = rg * Q128_PASSES;
    const int col = kb * FP8_TILE + c;

    float v[Q128_PASSES][4];
    float a = 0.0f;
    for (int p = 0; p < Q128_PASSES; p++) {  // every load first (see note_if_bad)
        const int row = nb * FP8_TILE + r0 + p;
        if (row < N) {
            load4<VEC4>(v[p], w + (int64_t)row * K, col, K);
        } else {
            for (int j = 0; j < 4; j++) v[p][j] = 0.0f;
        }
    }
    for (int p = 0; p < Q128_PASSES; p++) {
        const int row = nb * FP8_TILE + r0 + p;
        for (int j = 0; j < 4; j++) {
            if (row < N) note_if_bad(v[p][j], matrix0 + (unsigned long long)row * K + col + j, call, bad);
            a = fmaxf(a, fabsf(v[p][j]));
        }
    }
    const float sc = fp8_scale_of(block_max(a, scratch));
    const Fp8Divisor d = fp8_divisor(sc);

    uint32_t packed[Q128_PASSES];  // row r0 + p, columns c .. c + 3
    for (int p = 0; p < Q128_PASSES; p++) {
        packed[p] = fp8_pack4(v[p], d);
        *reinterpret_cast<uint32_t *>(q + (int64_t)(nb * FP8_TILE + r0 + p) * Kp + col) = packed[p];
    }
    if (threadIdx.x == 0) {
        s[(int64_t)nb * KB4 + kb] = sc;
        if (kb == KB - 1)
            for (int k = KB; k < KB4; k++) s[(int64_t)nb * KB4 + k] = 1.0f;
    }
    if (qt == NULL) return;
    // column[j][h]: column c + j, rows r0 + 4h .. r0 + 4h + 3, one byte each
    uint32_t column[4][2];
    for (int h = 0; h < 2; h++) {
        const uint32_t *x = &packed[4 * h];
        const uint32_t lo01 = __byte_perm(x[0], x[1], 0x5140), hi01 = __byte_perm(x[0], x[1], 0x7362);
        const uint32_t lo23 = __byte_perm(x[2], x[3], 0x5140), hi23 = __byte_perm(x[2], x[3], 0x7362);
        column[0][h] = __byte_perm(lo01, lo23, 0x5410), column[1][h] = __byte_perm(lo01, lo23, 0x7632);
        column[2][h] = __byte_perm(hi01, hi23, 0x5410), column[3][h] = __byte_perm(hi01, hi23, 0x7632);
    }
    for (int j = 0; j < 4; j++)
        *reinterpret_cast<uint2 *>(&tile[c + j][(rg ^ tile_swizzle<CHUNKS>(c + j)) * Q128_PASSES]) =
            make_uint2(column[j][0], column[j][1]);
    __syncthreads();
    // qt row kb*128 + cc, bytes nb*128 + k*8 ..: chunk k of the tile's column cc
    for (int i = threadIdx.x; i < FP8_TILE * CHUNKS; i += Q128_THREADS) {
        const int cc = i / CHUNKS, k = i % CHUNKS;
        *reinterpret_cast<uint2 *>(qt + (int64_t)(kb * FP8_TILE + cc) * Np + nb * FP8_TILE + k * Q128_PASSES) =
            *reinterpret_cast<const uint2 *>(&tile[cc][(k ^ tile_swizzle<CHUNKS>(cc)) * Q128_PASSES]);
    }
}

static int quantize_128x128_stack(const char *op, uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N,
                                  int K, char *err, size_t err_size) {
    if (batch <= 0 || N <= 0 || K <= 0) return 0;
    require_aligned16(q, op, "q");
    require_aligned16(qt, op, "qt");
    require_aligned16(s, op, "s");
    if (batch > 65535) {  // gridDim.z
        fprintf(stderr, "%s:%d: %s: %d matrices in one call - expected at most 65535\n", __FILE__, __LINE__, op, batch);
        exit(1);
    }
    const int KB = ceil_div(K, FP8_TILE), NB = ceil_div(N, FP8_TILE);
    const int KB4 = (KB + 3) / 4 * 4;
    unsigned long long *bad = bad_word();
    int rc;
    const unsigned long long call = log_call(op, "w", batch * N, K, &rc, err, err_size);
    const dim3 grid((unsigned)KB, (unsigned)NB, (unsigned)batch);
    if (K % 4 == 0 && is_aligned(w, 16))
        quantize_128x128_kernel<true><<<grid, Q128_THREADS>>>(q, qt, s, w, N, K, NB * FP8_TILE, KB * FP8_TILE, KB,
                                                              KB4, call, bad);
    else
        quantize_128x128_kernel<false><<<grid, Q128_THREADS>>>(q, qt, s, w, N, K, NB * FP8_TILE, KB * FP8_TILE, KB,
                                                               KB4, call, bad);
    CUDA_CHECK_LAUNCH("quantize_128x128_kernel");
    return rc;
}

extern "C" int cuda_fp8_quantize_128x128(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err,
                                         size_t err_size) {
    return quantize_128x128_stack("fp8_quantize_128x128", q, qt, s, w, 1, N, K, err, err_size);
}

extern "C" int cuda_fp8_quantize_128x128_batched(uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N,
                                                 int K, char *err, size_t err_size) {
    return quantize_128x128_stack("fp8_quantize_128x128_batched", q, qt, s, w, batch, N, K, err, err_size);
}

// ---------------------------------------------------------------------------- both activation layouts
// x (T, C) -> the 1x128 operand q1 (R16, Kp), s1 (KB, R16) of the kernel above and the 128x1 transposed operand
// q2 (C, Tp), s2 (TB, C) (column tiles of 128 rows along T), in one pass over x (a gradient dY feeds both Dgrad and
// Wgrad: reading it once saves 4 of the 10 bytes moved per element). With ROWWISE = false the same kernel makes the
// 128x1 operand alone (kernels.h fp8_quantize_128x1_transposed*: an input's Wgrad operand, a dY without Dgrad).
// One block of 512 threads per 128 x 128 tile (rows tb, columns kb): thread t holds columns 4*(t%32)..+3 of the 8
// consecutive rows 8*(t/32) + p (p = 0..7), so warp w holds 8 whole rows (row maxima are warp maxima, as in the
// 1x128 kernel) and the column maxima go through shared memory. The transposed bytes go out through a shared tile
// [column][row]: a thread's 8 bytes of one column are consecutive rows, one 8-byte store, at a chunk position
// XOR-swizzled by the column so that neither those stores nor the row reads behind the global stores conflict.
// The same kernel quantises NV = 2 values of one element at once (the SwiGLU gradients da and db, read from
// dout, a, b once: SwigluGradRows): then the block is 1024 threads, thread t holding both values of columns
// 4*(t%32)..+3 of rows 4*(t/32) + p (p = 0..3) - the same 32 values per thread (at most 64 registers, and one
// such block fills an SM as two of 512 do), each warp still holding whole rows, 4-byte chunks. Each value has its
// own operands, column scales, byte tile and call tag (its non-finite elements are reported as its own call's).
// The values are checked, row-maxed and column-reduced one after the other (the loop over them unrolled): that
// keeps NV = 2 at about 60 registers with no spills (nvcc -Xptxas -v; interleaving them spilled).
#define QBOTH_THREADS 512  // per value

// The NV values' operands (q1, s1, q2, s2 as above, each value's at index i) and their call tags.
template <int NV>
struct BothOperands {
    uint8_t *q1[NV], *q2[NV];
    float *s1[NV], *s2[NV];
    unsigned long long call[NV];
};

// Where tile (tb, kb) - row tile tile_row of the grid's, column tile kb - lies: its segment g, that segment's rows T
// (R16 rounded up to 16, Tp to 128) and first row row0 of the input, and where the segment's operands start.
struct BothTile {
    int g, tb, kb, T, R16, Tp;
    int64_t row0, at_q1, at_s1, at_q2, at_s2;
};

__device__ inline BothTile both_tile(const SegTable &seg, int tile_row, int kb, int C, int Kp) {
    BothTile t;
    t.g = segment_of(seg.tiles0, seg.n, tile_row), t.tb = tile_row - seg.tiles0[t.g], t.kb = kb;
    t.T = seg.rows0[t.g + 1] - seg.rows0[t.g], t.R16 = seg.p16[t.g + 1] - seg.p16[t.g];
    t.Tp = (seg.tiles0[t.g + 1] - seg.tiles0[t.g]) * FP8_TILE;
    t.row0 = seg.rows0[t.g];
    t.at_q1 = (int64_t)Kp * seg.p16[t.g], t.at_s1 = (int64_t)(Kp / FP8_TILE) * seg.p16[t.g];
    t.at_q2 = (int64_t)C * FP8_TILE * seg.tiles0[t.g], t.at_s2 = (int64_t)C * seg.tiles0[t.g];
    return t;
}

// The shared memory of one tile of NV values. The column partials are dead once the column scales are taken (a
// barrier before the byte tiles are written), so they share memory with the tiles: two values' separate arrays
// would exceed 48 KiB.
template <int NV, int ROW_GROUPS_ = QBOTH_THREADS * NV / 32>
struct BothSmem {
    static constexpr int ROW_GROUPS = ROW_GROUPS_;  // warps of the block
    union {
        float partial[NV][ROW_GROUPS][FP8_TILE + 1];
        uint8_t tile[NV][FP8_TILE][FP8_TILE];  // [column][row], PASSES-byte chunks at swizzled positions
    } u;
    float col_scale[NV][FP8_TILE], col_recip[NV][FP8_TILE];  // and their reciprocals (Fp8Divisor)
};

// Both layouts of one tile from the values v this thread holds (rows t0 + p of columns col..col + 3, as the kernels
// below load them), by all 32 x 128 / PASSES threads of the block; the block's barriers are inside.
template <int NV, bool ROWWISE, int PASSES>
__device__ __forceinline__ void quantize_tile(const BothOperands<NV> &out, float (&v)[NV][PASSES][4],
                                              const BothTile &tt, BothSmem<NV, FP8_TILE / PASSES> &sm, int C, int Kp,
                                              unsigned long long *bad) {
    constexpr int ROW_GROUPS = FP8_TILE / PASSES, THREADS = 32 * ROW_GROUPS;
    static_assert(PASSES % 4 == 0, "a thread packs its rows of a column 4 to a word");
    const int kb = tt.kb, T = tt.T;
    const int lane = threadIdx.x & 31, c = lane * 4, rg = threadIdx.x >> 5;
    const int col = kb * FP8_TILE + c, t0 = tt.tb * FP8_TILE + rg * PASSES;  // this thread's rows: t0 + p
#pragma unroll
    for (int i = 0; i < NV; i++) {
        // a[j]: the maximum of this thread's part of column c + j, NaN if one of them is (max_nan)
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int p = 0; p < PASSES; p++)
            for (int j = 0; j < 4; j++) a[j] = max_nan(a[j], fabsf(v[i][p][j]));
        // non-finite elements are rare: the four column maxima tell, the per-element report only if one is not finite
        if (!(a[0] <= FLT_MAX && a[1] <= FLT_MAX && a[2] <= FLT_MAX && a[3] <= FLT_MAX)) {
            for (int p = 0; p < PASSES; p++)
                for (int j = 0; j < 4; j++)
                    if (t0 + p < T)
                        note_if_bad(v[i][p][j], (unsigned long long)(tt.row0 + t0 + p) * C + col + j, out.call[i], bad);
        }
        if constexpr (ROWWISE) {
            // 1x128: this warp holds all 128 columns of its PASSES rows (m[p]: this lane's part of row t0 + p). Lane l
            // takes the scale of row l / LANES_PER_ROW (warp_rows_max: one reduction for all the rows, one division
            // per lane) and passes it and its reciprocal to the other lanes.
            constexpr int LANES_PER_ROW = 32 / PASSES;
            float m[PASSES];
            for (int p = 0; p < PASSES; p++) {
                m[p] = 0.0f;
                for (int j = 0; j < 4; j++) m[p] = fmaxf(m[p], fabsf(v[i][p][j]));
            }
            const float my_scale = fp8_scale_of(warp_rows_max<PASSES>(m)), my_recip = __frcp_rn(my_scale);
            const int my_row = t0 + lane / LANES_PER_ROW;
            if (lane % LANES_PER_ROW == 0 && my_row < tt.R16)
                out.s1[i][tt.at_s1 + (int64_t)kb * tt.R16 + my_row] = my_scale;
            for (int p = 0; p < PASSES; p++) {
                const int t = t0 + p;
                const float sc = __shfl_sync(0xffffffffu, my_scale, p * LANES_PER_ROW);
                const Fp8Divisor d = {sc, __shfl_sync(0xffffffffu, my_recip, p * LANES_PER_ROW), fp8_fast_scale(sc)};
                if (t < tt.R16)
                    *reinterpret_cast<uint32_t *>(out.q1[i] + tt.at_q1 + (int64_t)t * Kp + col) = fp8_pack4(v[i][p], d);
            }
        }
        // 128x1: this thread's column maxima, one partial of the row groups'
        for (int j = 0; j < 4; j++) sm.u.partial[i][rg][c + j] = a[j];
    }
    __syncthreads();
    if (threadIdx.x < NV * FP8_TILE) {
        const int i = threadIdx.x / FP8_TILE, cc = threadIdx.x % FP8_TILE;
        float m = 0.0f;
        for (int grp = 0; grp < ROW_GROUPS; grp++) m = fmaxf(m, sm.u.partial[i][grp][cc]);
        const float sc = fp8_scale_of(m);
        sm.col_scale[i][cc] = sc, sm.col_recip[i][cc] = __frcp_rn(sc);
        if (kb * FP8_TILE + cc < C) out.s2[i][tt.at_s2 + (int64_t)tt.tb * C + kb * FP8_TILE + cc] = sc;
    }
    __syncthreads();
    // 128x1 bytes: column c + j of this thread's rows, packed 4 rows to a word
    for (int i = 0; i < NV; i++)
        for (int j = 0; j < 4; j++) {
            const float sc = sm.col_scale[i][c + j];
            const Fp8Divisor d = {sc, sm.col_recip[i][c + j], fp8_fast_scale(sc)};
            uint32_t word[PASSES / 4];
            for (int h = 0; h < PASSES / 4; h++) {
                const float rows4[4] = {v[i][4 * h][j], v[i][4 * h + 1][j], v[i][4 * h + 2][j], v[i][4 * h + 3][j]};
                word[h] = fp8_pack4(rows4, d);
            }
            uint8_t *chunk = &sm.u.tile[i][c + j][(rg ^ tile_swizzle<ROW_GROUPS>(c + j)) * PASSES];
            if constexpr (PASSES == 8) *reinterpret_cast<uint2 *>(chunk) = make_uint2(word[0], word[1]);
            else *reinterpret_cast<uint32_t *>(chunk) = word[0];
        }
    __syncthreads();
    // q2 row kb * 128 + cc, bytes tb * 128 + k * PASSES ..: chunk k of the tile's column cc
    for (int i = 0; i < NV; i++) {
        for (int w = threadIdx.x; w < FP8_TILE * ROW_GROUPS; w += THREADS) {
            const int cc = w / ROW_GROUPS, k = w % ROW_GROUPS;
            if (kb * FP8_TILE + cc >= C) continue;
            const uint8_t *chunk = &sm.u.tile[i][cc][(k ^ tile_swizzle<ROW_GROUPS>(cc)) * PASSES];
            uint8_t *dst = out.q2[i] + tt.at_q2 + (int64_t)(kb * FP8_TILE + cc) * tt.Tp + tt.tb * FP8_TILE + k * PASSES;
            if constexpr (PASSES == 8) *reinterpret_cast<uint2 *>(dst) = *reinterpret_cast<const uint2 *>(chunk);
            else *reinterpret_cast<uint32_t *>(dst) = *reinterpret_cast<const uint32_t *>(chunk);
        }
    }
}

template <bool VEC4, int NV, bool ROWWISE, class Src>
__global__ void __launch_bounds__(QBOTH_THREADS * NV, 2 / NV)
    quantize_both_kernel(const __grid_constant__ BothOperands<NV> out, const __grid_constant__ Src src,
                         const __grid_constant__ SegTable seg, int C, int Kp, unsigned long long *bad) {
    constexpr int PASSES = FP8_TILE / BothSmem<NV>::ROW_GROUPS;  // rows per thread
    __shared__ __align__(16) BothSmem<NV> sm;
    const BothTile tt = both_tile(seg, blockIdx.y, blockIdx.x, C, Kp);
    const int lane = threadIdx.x & 31, rg = threadIdx.x >> 5;
    const int col = tt.kb * FP8_TILE + lane * 4, t0 = tt.tb * FP8_TILE + rg * PASSES;  // this thread's rows: t0 + p
    float v[NV][PASSES][4];
    // A full tile (every row < T, every column < C, vector loads) loads without the per-row checks; the branch is the
    // same for the whole block. Every load first (see note_if_bad).
    if (VEC4 && (tt.tb + 1) * FP8_TILE <= tt.T && (tt.kb + 1) * FP8_TILE <= C) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            if constexpr (NV == 1) src.load4_full(v[0][p], tt.row0 + t0 + p, col);
            else src.load4x2_full(v[0][p], v[1][p], tt.row0 + t0 + p, col);
        }
    } else {
        for (int p = 0; p < PASSES; p++) {
            const int len = t0 + p < tt.T ? C : 0;  // rows past T load as zeros
            if constexpr (NV == 1) src.template load4<VEC4>(v[0][p], tt.row0 + t0 + p, col, len);
            else src.template load4x2<VEC4>(v[0][p], v[1][p], tt.row0 + t0 + p, col, len);
        }
    }
    quantize_tile<NV, ROWWISE>(out, v, tt, sm, C, Kp, bad);
}

// ---------------------------------------------------------------------------- both layouts, pipelined
// The kernel above holds a tile's values in registers, so while a block computes, reduces and stores, its SM reads
// nothing for it. Where the values cost arithmetic (the SwiGLU values), at whole column tiles and 16-byte aligned
// rows, this kernel runs instead: one persistent 1024-thread block per SM takes tiles blockIdx.x, + gridDim.x, ...
// (row tile by row tile, the column tiles of a row tile in turn) and copies the next tile's raw inputs into shared
// memory with cp.async while it quantises the current one from the other copy. A staged source (below) says what a
// tile's inputs are (STAGE_BYTES of them), copies them (stage) and gives each thread its values (values);
// quantize_tile then does what it does for the kernel above, so the bytes and scales are the same. Rows past the
// segment's end are zero-filled, and every staged source gives +0 for them, the value the kernel above pads with.
// Measured on an H100 (docs/benchmarks.md, 2026-12-06): the SwiGLU gradients 9% and the SwiGLU output 7% faster than
// the kernel above, and then bound by their instruction issue (the gradients: 0.79 warps issued per scheduler and
// cycle, DRAM at 38%; the sigmoid and the divisions per element are what is left). Not for sources that only read:
// a plain array is at bandwidth from registers (two blocks per SM keep the memory busy; its pipelined form was
// slower), and the combine's gradient, whose rows are gathered, was 22% slower staged (one 64 KiB tile in flight per
// SM against two blocks' registers' worth).
constexpr int PIPE_THREADS = 1024;
constexpr int PIPE_PASSES = FP8_TILE / (PIPE_THREADS / 32);  // rows per thread: 4
constexpr uint32_t BF16_TILE_BYTES = FP8_TILE * FP8_TILE * sizeof(uint16_t);

// A staged tile's rows: the input row of its first row, how many of its 128 rows lie in the segment, its first column.
struct TileRows {
    int64_t row0;
    int valid, col0;
};

__device__ inline TileRows tile_rows(const BothTile &t) {
    return TileRows{t.row0 + (int64_t)t.tb * FP8_TILE, t.T - t.tb * FP8_TILE, t.kb * FP8_TILE};
}

// One BF16 input's tile (rows of stride ld) -> [row][column] at `at`, by all PIPE_THREADS threads.
__device__ inline void stage_bf16_tile(uint32_t at, const uint16_t *in, int64_t ld, const TileRows &r) {
    constexpr int CHUNKS = FP8_TILE * (int)sizeof(uint16_t) / 16;  // 16-byte chunks of a tile row
#pragma unroll
    for (int k = 0; k < FP8_TILE * CHUNKS / PIPE_THREADS; k++) {
        const int i = threadIdx.x + k * PIPE_THREADS, row = i / CHUNKS, ch = i % CHUNKS;
        const bool inside = row < r.valid;
        const uint16_t *from = inside ? in + (r.row0 + row) * ld + r.col0 + ch * 8 : in;
        cp_async16_zfill(at + (uint32_t)((row * FP8_TILE + ch * 8) * sizeof(uint16_t)), from, inside ? 16 : 0);
    }
}

// Columns c..c+3 of row r of a staged BF16 tile, widened.
__device__ inline float4 staged_bf16x4(const unsigned char *tile, int r, int c) {
    return bf16x4_to_float4(*reinterpret_cast<const uint2 *>(tile + (r * FP8_TILE + c) * sizeof(uint16_t)));
}

// The SwiGLU output h = silu(a) * b (SwigluRows' SWIGLU_OUT: w2's Fprop and Wgrad input): a and b staged.
struct SwigluOutStaged {
    static constexpr int NV = 1;
    static constexpr uint32_t STAGE_BYTES = 2 * BF16_TILE_BYTES;
    const uint16_t *a, *b;
    int64_t ld;
    __device__ void stage(unsigned char *st, const TileRows &r) const {
        stage_bf16_tile(smem_addr(st), a, ld, r);
        stage_bf16_tile(smem_addr(st + BF16_TILE_BYTES), b, ld, r);
    }
    __device__ void values(float (&v)[1][PIPE_PASSES][4], const unsigned char *st, int r0, int c) const {
#pragma unroll
        for (int p = 0; p < PIPE_PASSES; p++) {
            const float4 av = staged_bf16x4(st, r0 + p, c), bv = staged_bf16x4(st + BF16_TILE_BYTES, r0 + p, c);
            v[0][p][0] = swiglu_element(av.x, bv.x), v[0][p][1] = swiglu_element(av.y, bv.y);
            v[0][p][2] = swiglu_element(av.z, bv.z), v[0][p][3] = swiglu_element(av.w, bv.w);
        }
    }
};

// Both SwiGLU gradients da, db (SwigluGradRows): dout, a and b staged.
struct SwigluGradStaged {
    static constexpr int NV = 2;
    static constexpr uint32_t STAGE_BYTES = 3 * BF16_TILE_BYTES;
    const uint16_t *dout, *a, *b;
    int64_t ld;
    __device__ void stage(unsigned char *st, const TileRows &r) const {
        stage_bf16_tile(smem_addr(st), dout, ld, r);
        stage_bf16_tile(smem_addr(st + BF16_TILE_BYTES), a, ld, r);
        stage_bf16_tile(smem_addr(st + 2 * BF16_TILE_BYTES), b, ld, r);
    }
    __device__ void values(float (&v)[2][PIPE_PASSES][4], const unsigned char *st, int r0, int c) const {
#pragma unroll
        for (int p = 0; p < PIPE_PASSES; p++)
            SwigluGradRows::grads4(v[0][p], v[1][p], staged_bf16x4(st, r0 + p, c),
                                   staged_bf16x4(st + BF16_TILE_BYTES, r0 + p, c),
                                   staged_bf16x4(st + 2 * BF16_TILE_BYTES, r0 + p, c));
    }
};

template <class Staged>
__global__ void __launch_bounds__(PIPE_THREADS, 1)
    quantize_both_pipelined_kernel(const __grid_constant__ BothOperands<Staged::NV> out,
                                   const __grid_constant__ Staged src, const __grid_constant__ SegTable seg, int C,
                                   int n_tiles, unsigned long long *bad) {
    constexpr int NV = Staged::NV;
    extern __shared__ __align__(16) unsigned char staged[];  // two stages of Staged::STAGE_BYTES
    __shared__ __align__(16) BothSmem<NV, PIPE_THREADS / 32> sm;
    const int KB = C / FP8_TILE, step = gridDim.x;
    const int lane = threadIdx.x & 31, rg = threadIdx.x >> 5;
    // the copies of tile t's rows into stage st (t: blockIdx.x or a later tile's number, each in its own type)
    const auto stage_tile = [&](auto t, unsigned char *st) {
        src.stage(st, tile_rows(both_tile(seg, t / KB, t % KB, C, C)));
    };
    if (blockIdx.x < n_tiles) stage_tile(blockIdx.x, staged);
    cp_async_commit();
    int s = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += step, s ^= 1) {
        // the next tile's copies go into the stage the previous iteration read (its reads ended before that
        // iteration's first barrier in quantize_tile); an empty group when there is none, so the wait below is always
        // for this tile's
        const int next = tile + step;
        if (next < n_tiles) stage_tile(next, staged + (s ^ 1) * Staged::STAGE_BYTES);
        cp_async_commit();
        cp_async_wait_all_but_last();
        __syncthreads();
        const BothTile tt = both_tile(seg, tile / KB, tile % KB, C, C);
        float v[NV][PIPE_PASSES][4];
        src.values(v, staged + s * Staged::STAGE_BYTES, rg * PIPE_PASSES, lane * 4);
        quantize_tile<NV, true>(out, v, tt, sm, C, C, bad);
    }
}

// The pipelined kernel over a call's tiles, one block per SM at most.
template <class Staged>
static void quantize_both_pipelined(const BothOperands<Staged::NV> &out, const Staged &src, const SegTable &seg,
                                    int n, int C, unsigned long long *bad) {
    static bool smem_raised = false;  // once per staged source
    if (!smem_raised) {
        CUDA_CHECK(cudaFuncSetAttribute(quantize_both_pipelined_kernel<Staged>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(2 * Staged::STAGE_BYTES)));
        smem_raised = true;
    }
    const int n_tiles = C / FP8_TILE * seg.tiles0[n], sms = cuda_sm_count();
    quantize_both_pipelined_kernel<Staged><<<n_tiles < sms ? n_tiles : sms, PIPE_THREADS, 2 * Staged::STAGE_BYTES>>>(
        out, src, seg, C, n_tiles, bad);
    CUDA_CHECK_LAUNCH("quantize_both_pipelined_kernel");
}

// Whether a call of the both-layouts kernel runs pipelined, and then its launch: sources with a staged form, at whole
// column tiles and 16-byte aligned rows. ArrayRows has none (above).
template <int NV, class Src>
static bool pipelined(const BothOperands<NV> &, const Src &, const SegTable &, int, int, unsigned long long *) {
    return false;
}
static bool pipelined(const BothOperands<1> &out, const SwigluRows &src, const SegTable &seg, int n, int C,
                      unsigned long long *bad) {
    if (src.value != SWIGLU_OUT || C % FP8_TILE != 0 || !src.aligned16()) return false;
    quantize_both_pipelined(out, SwigluOutStaged{src.a, src.b, src.ld}, seg, n, C, bad);
    return true;
}
static bool pipelined(const BothOperands<2> &out, const SwigluGradRows &src, const SegTable &seg, int n, int C,
                      unsigned long long *bad) {
    if (C % FP8_TILE != 0 || !src.aligned16()) return false;
    quantize_both_pipelined(out, SwigluGradStaged{src.dout, src.a, src.b, src.ld}, seg, n, C, bad);
    return true;
}

// One value of a both-layouts call: its operands, and the op and tensor that its non-finite elements are reported as.
struct BothValue {
    const char *op, *tensor;
    uint8_t *q1;
    float *s1;
    uint8_t *q2;
    float *s2;
};

// The NV values val[0..NV-1] of src (NV = 1, or 2 for a Src with load4x2) quantised in one launch. Each value is
// logged as its own call, in order, so a bad element of value i is reported before any of value i + 1 (the log is
// checked first when the NV calls would not all fit in it); op names the launch in errors of its arguments.
template <int NV, bool ROWWISE, class Src>
static int quantize_both_segments(const char *op, const BothValue *val, const Src &src, int n, const int *rows0, int C,
                                  char *err, size_t err_size) {
    const SegTable seg = seg_table(op, n, rows0);
    if (seg.tiles0[n] == 0 || C <= 0) return 0;
    BothOperands<NV> out;
    for (int i = 0; i < NV; i++) {
        require_aligned16(val[i].q1, op, "q1"), require_aligned16(val[i].s1, op, "s1");
        require_aligned16(val[i].q2, op, "q2"), require_aligned16(val[i].s2, op, "s2");
        out.q1[i] = val[i].q1, out.s1[i] = val[i].s1, out.q2[i] = val[i].q2, out.s2[i] = val[i].s2;
    }
    const int KB = ceil_div(C, FP8_TILE);
    unsigned long long *bad = bad_word();
    const int rc = n_calls > FP8_CALL_LOG - NV ? cuda_fp8_check_finite(err, err_size) : 0;
    for (int i = 0; i < NV; i++) {
        int rc_log;  // 0: the log has room
        out.call[i] = log_call(val[i].op, val[i].tensor, rows0[n], C, &rc_log, err, err_size);
    }
    if constexpr (ROWWISE) {
        if (pipelined(out, src, seg, n, C, bad)) return rc;
    }
    const dim3 grid((unsigned)KB, (unsigned)seg.tiles0[n]);
    if (C % 4 == 0 && src.aligned16())
        quantize_both_kernel<true, NV, ROWWISE><<<grid, QBOTH_THREADS * NV>>>(out, src, seg, C, KB * FP8_TILE, bad);
    else
        quantize_both_kernel<false, NV, ROWWISE><<<grid, QBOTH_THREADS * NV>>>(out, src, seg, C, KB * FP8_TILE, bad);
    CUDA_CHECK_LAUNCH("quantize_both_kernel");
    return rc;
}

// One value (x, or one SwiGLU value or the combine's gradient): op names it in errors and in the log.
template <class Src>
static int quantize_both_segments(const char *op, const char *tensor, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                  const Src &src, int n, const int *rows0, int C, char *err, size_t err_size) {
    const BothValue val = {op, tensor, q1, s1, q2, s2};
    return quantize_both_segments<1, true>(op, &val, src, n, rows0, C, err, err_size);
}

// The 128x1 operand alone (x (T, C) -> q (C, Tp), s (TB, C)): the kernel without its 1x128 pass.
template <class Src>
static int quantize_128x1_segments(const char *op, const char *tensor, uint8_t *q, float *s, const Src &src, int n,
                                   const int *rows0, int C, char *err, size_t err_size) {
    const BothValue val = {op, tensor, NULL, NULL, q, s};
    return quantize_both_segments<1, false>(op, &val, src, n, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T,
                                              int C, char *err, size_t err_size) {
    if (T <= 0) return 0;
    const int rows0[2] = {0, T};
    return quantize_both_segments("fp8_quantize_both_layouts", "x", q1, s1, q2, s2, ArrayRows{x, NULL, C}, 1, rows0, C,
                                  err, err_size);
}

extern "C" int cuda_fp8_quantize_rmsnorm_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                                      const real *rstd, const real *weight, int T, int C, char *err,
                                                      size_t err_size) {
    if (T <= 0) return 0;
    const int rows0[2] = {0, T};
    return quantize_both_segments("fp8_quantize_rmsnorm_both_layouts", "rmsnorm(x)", q1, s1, q2, s2,
                                  NormRows{x, rstd, weight, C}, 1, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                                      int n_seg, const int *rows0, int C, char *err, size_t err_size) {
    return quantize_both_segments("fp8_quantize_both_layouts_grouped", "x", q1, s1, q2, s2, ArrayRows{x, NULL, C},
                                  n_seg, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_combine_grad_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                                                   const real *dout, const int *seg_token,
                                                                   const int *slot_of, const real *topk_w, int K,
                                                                   int n_seg, const int *rows0, int C, char *err,
                                                                   size_t err_size) {
    static Scratch slot_w_scratch;
    const int rows = n_seg >= 1 && n_seg <= FP8_MAX_SEGMENTS ? rows0[n_seg] : 0;  // seg_table reports a bad n_seg
    float *slot_w = (float *)cuda_scratch(&slot_w_scratch, (size_t)(rows > 0 ? rows : 1) * sizeof(float));
    if (rows > 0) {
        combine_slot_weights_kernel<<<ceil_div(rows, 256), 256>>>(slot_w, seg_token, slot_of, topk_w, K, rows);
        CUDA_CHECK_LAUNCH("combine_slot_weights_kernel");
    }
    return quantize_both_segments("fp8_quantize_combine_grad_both_layouts_grouped", "topk_w * dout", q1, s1, q2, s2,
                                  CombineGradRows{dout, seg_token, slot_w, C}, n_seg, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_128x1_transposed(uint8_t *q, float *s, const real *x, int T, int C, char *err,
                                                  size_t err_size) {
    if (T <= 0) return 0;
    const int rows0[2] = {0, T};
    return quantize_128x1_segments("fp8_quantize_128x1_transposed", "x", q, s, ArrayRows{x, NULL, C}, 1, rows0, C, err,
                                   err_size);
}

extern "C" int cuda_fp8_quantize_128x1_transposed_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg,
                                                          const int *rows0, int C, char *err, size_t err_size) {
    return quantize_128x1_segments("fp8_quantize_128x1_transposed_grouped", "x", q, s, ArrayRows{x, x_rows, C}, n_seg,
                                   rows0, C, err, err_size);
}

// ---------------------------------------------------------------------------- SwiGLU values
// The three activation kernels above on SwigluRows: the FFN gate's output h (w2's Fprop and Wgrad input) and its
// gradients da, db (w1's and w3's dY) are computed where they are quantised, so fp8 mode never writes them in
// FP32 nor reads them back (kernels.h fp8_quantize_swiglu_*).
static const char *swiglu_tensor(SwigluValue value) {
    return value == SWIGLU_OUT ? "silu(a) * b" : value == SWIGLU_DA ? "da of swiglu_backward" : "db of swiglu_backward";
}

extern "C" int cuda_fp8_quantize_swiglu_1x128_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                                      const uint16_t *a, const uint16_t *b, int n_seg, const int *rows0, int C,
                                                      char *err, size_t err_size) {
    return quantize_1x128_segments("fp8_quantize_swiglu_1x128_grouped", swiglu_tensor(value), q, s,
                                   SwigluRows{value, dout, a, b, C, bf16_rows_ld(C)}, n_seg, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_swiglu_128x1_transposed_grouped(uint8_t *q, float *s, SwigluValue value,
                                                                 const uint16_t *dout, const uint16_t *a, const uint16_t *b,
                                                                 int n_seg, const int *rows0, int C, char *err,
                                                                 size_t err_size) {
    return quantize_128x1_segments("fp8_quantize_swiglu_128x1_transposed_grouped", swiglu_tensor(value), q, s,
                                   SwigluRows{value, dout, a, b, C, bf16_rows_ld(C)}, n_seg, rows0, C, err, err_size);
}

extern "C" int cuda_fp8_quantize_swiglu_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                                             SwigluValue value, const uint16_t *dout, const uint16_t *a,
                                                             const uint16_t *b, int n_seg, const int *rows0, int C,
                                                             char *err, size_t err_size) {
    return quantize_both_segments("fp8_quantize_swiglu_both_layouts_grouped", swiglu_tensor(value), q1, s1, q2, s2,
                                  SwigluRows{value, dout, a, b, C, bf16_rows_ld(C)}, n_seg, rows0, C, err, err_size);
}

// The two calls fp8_quantize_swiglu_both_layouts_grouped(SWIGLU_DA), (SWIGLU_DB) in one launch: logged as those two
// calls, DA's first, so a bad da is reported before any bad db and with the message its call would give.
extern "C" int cuda_fp8_quantize_swiglu_grads_both_layouts_grouped(uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                                   uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                                   const uint16_t *dout, const uint16_t *a, const uint16_t *b,
                                                                   int n_seg, const int *rows0, int C, char *err,
                                                                   size_t err_size) {
    static const char logged[] = "fp8_quantize_swiglu_both_layouts_grouped";
    const BothValue val[2] = {{logged, swiglu_tensor(SWIGLU_DA), qa1, sa1, qa2, sa2},
                              {logged, swiglu_tensor(SWIGLU_DB), qb1, sb1, qb2, sb2}};
    return quantize_both_segments<2, true>("fp8_quantize_swiglu_grads_both_layouts_grouped", val,
                                     SwigluGradRows{dout, a, b, C, bf16_rows_ld(C)}, n_seg, rows0, C, err, err_size);
}

// The mismatches of fp8_div against __fdiv_rn in 2^23 x per_scale quotients (fp8_division_check_kernel).
extern "C" unsigned long long cuda_fp8_division_mismatches(int per_scale) {
    static Scratch count;
    unsigned long long *d = (unsigned long long *)cuda_scratch(&count, sizeof(unsigned long long)), h = 0;
    CUDA_CHECK(cudaMemset(d, 0, sizeof h));
    fp8_division_check_kernel<<<(1u << 23) / 256, 256>>>(per_scale, d);
    CUDA_CHECK_LAUNCH("fp8_division_check_kernel");
    CUDA_CHECK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    return h;
}
