/*
 * attention_wgmma.cu - the attention core's Hopper kernels: the same three kernels as attention.cu (forward, dq,
 * dk/dv), with every matrix product on wgmma (sm_90a warpgroup MMA) instead of mma.sync. Same staged BF16 inputs
 * (attention.cuh Staged), same FP32 softmax statistics and BF16 roundings of P and dS, same fixed summation orders
 * and no atomics, so results are bitwise reproducible run to run; checked against the CPU reference by
 * tests/gpu/test_gpu_attention.c like the mma.sync kernels, timed by `fp8moe bench attention`. Each probability is
 * ex2.approx.ftz of one FFMA, 2^(s c - m c) with the running max m kept in raw score units (attention.cu: exp2f of
 * a scaled difference), so the two families' results differ in their last bits; both meet the same tolerances.
 *
 * Why: the mma.sync kernels give each warp 16 rows, so every warp streams the whole key (or query) tile from
 * shared memory through ldmatrix for each product, and run at about 110-150 TFLOPS. A wgmma instruction is issued
 * by a warpgroup (4 warps, 64 rows) and reads its B operand from shared memory itself, once for the 64 rows; A
 * comes from shared memory (Q, dO, K, V tiles) or from registers (P, dS: the accumulator of the first product,
 * repacked to BF16 as in attention.cu, whose per-warp fragment layout is the same). On an H200 at the benchmark
 * model's shape these kernels take 0.161 ms forward and 0.454 ms backward against the mma.sync kernels' 0.336 and
 * 1.086 (docs/benchmarks.md, eighth session). Each warpgroup overlaps its own softmax (or dS) work with a product:
 * it issues the first product of tile j together with the last product of tile j - 1, whose A operand it computed
 * in iteration j - 1, and works on tile j's scores while that product runs (FlashAttention-3's intra-warpgroup
 * pipelining; the accumulators see the same products in the same order, so the bits are those of one tile at a
 * time). Not done yet: the two warpgroups still meet at one barrier per tile, and tiles are copied by cp.async
 * rather than the tensor memory accelerator.
 *
 * Served head dims (attention_wgmma_supported): padded Dqk of 128 or 192 and padded Dv of 128 on a compute
 * capability 9.0 device; everything else runs the mma.sync kernels.
 *
 * Shared-memory tiles are in wgmma's 128-byte-swizzle canonical layout: a tile of R rows and D columns is D / 64
 * column blocks, each R rows of 128 bytes, and the 16-byte chunk c of row r of a block sits at chunk c ^ (r % 8)
 * (the copy below writes it there; blocks start 1024-byte aligned, which the swizzle's pattern requires).
 * A tile is read by a descriptor (sw128_desc) in one of two ways:
 *   K-major   (the contraction runs along the tile's columns: Q K^T, dO V^T and their transposes): start = the
 *             column block + 32 bytes per 16 columns into it; stride between 8-row groups (SBO) 1024 bytes.
 *   N-major   (the contraction runs along the tile's rows: P V, dS K, P^T dO, dS^T Q; wgmma's transpose-B flag):
 *             start = the tile + 16 rows x 128 bytes per step of 16; SBO 1024 (8 rows of the contraction), and
 *             the leading byte offset (LBO) = R x 128, the distance between column blocks of 64 output columns.
 * Tiles are copied with 16-byte cp.async by every thread; the async proxy (wgmma) reads shared memory written by
 * the generic proxy only after fence.proxy.async, issued by every thread before the barrier that publishes a tile.
 *
 * Kernels (256 threads = 2 warpgroups, one block per SM by shared memory):
 *   forward  128 query rows per block (64 per warpgroup), key tiles of 128 double-buffered (V one tile behind K):
 *            S = Q K^T (m64n128, over Dqk), the online softmax of attention.cu in registers, O += P V (m64nDv, A =
 *            P from registers).
 *   dq       128 query rows per block, key tiles of 64 (K in three buffers, V in two): S = Q K^T and dP = dO V^T
 *            (m64n64), dS = P (dP - D) scale, dq += dS K (m64nDqk, A = dS from registers).
 *   dkv      64 keys per block, query tiles of 64 in three buffers, the two groups of attention.cu as warpgroups:
 *              value warpgroup: S^T = K Q^T, P^T = exp2(S^T scale log2(e) - lse2) -> shared, dv += P^T dO
 *              key warpgroup:   dP^T = V dO^T, reads P^T, dS^T = P^T (dP^T - D) scale, dk += dS^T Q
 *            P^T passes through shared memory in the accumulator's own register order (each key-warpgroup thread
 *            reads the 32 values its value-warpgroup twin wrote), in FP32 as in attention.cu.
 * Each wgmma batch is: wgmma.fence (after the registers it reads were last written), the wgmmas, commit, and a
 * wait for the group whose results are read next; operand fences around it keep the compiler from moving
 * accumulator reads or writes across the asynchronous products. Branches around wgmma batches are on
 * warp-uniform values (the warpgroup index read through a shuffle), or ptxas serialises the products (C7520).
 */
#include <type_traits>

#include "kernels/cuda/attention.cuh"

namespace {

constexpr int SW = 128;  // bytes per row of a swizzled column block (64 BF16)
constexpr int THREADS = 256;

// ---------------------------------------------------------------------------- wgmma wrappers
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins n registers: the compiler may not move their reads or writes across this point.
__device__ __forceinline__ void fence_regs(float *r, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(r[i])::"memory");
}
// __syncthreads for code where the two warpgroups reach the barrier from different paths (each its own copy of a
// loop): bar.sync counts arriving warps, whatever instruction they are at.
__device__ __forceinline__ void block_barrier() { asm volatile("bar.sync 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Descriptor of a 128-byte-swizzled tile (file comment) at shared address addr.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
constexpr uint32_t K_MAJOR_LBO = 16;  // unused by K-major swizzled layouts ("assumed 1")

// The four products below differ only in N and in where A comes from (shared memory: ss; registers: rs, whose B is
// always N-major here); each writes its accumulator registers out one by one because an asm statement needs a
// literal operand list (a register's place in it is its place in wgmma's accumulator fragment: file comment).
// d (64 x 64) = (accumulate ? d : 0) + A B^T, A and B K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_ss_n64(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 128) = (accumulate ? d : 0) + A B^T, A and B K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_ss_n128(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 128) += A B, A (64 x 16) in registers, B (16 x 128) N-major in shared memory (descriptor db).
__device__ __forceinline__ void wgmma_rs_n128(float *d, const uint32_t a[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// d (64 x 192) += A B, A (64 x 16) in registers, B (16 x 192) N-major in shared memory (descriptor db).
__device__ __forceinline__ void wgmma_rs_n192(float *d, const uint32_t a[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d (64 x N) += A B over 16 rows of an N-major tile, N = 128 or 192.
template <int N> __device__ __forceinline__ void wgmma_rs(float *d, const uint32_t a[4], uint64_t db) {
    static_assert(N == 128 || N == 192, "wgmma_rs: N is 128 or 192");
    if constexpr (N == 128) wgmma_rs_n128(d, a, db);
    else wgmma_rs_n192(d, a, db);
}

// ---------------------------------------------------------------------------- tiles
// ROWS x DP BF16 (contiguous rows of DP elements at g) -> the swizzled tile at shared address s, by all 256
// threads. Thread i copies chunk i % 8 of rows i / 8, i / 8 + 32, ... of every column block: 32 rows apart, the
// rows share their swizzle (r % 8), so each copy's addresses are the first ones plus compile-time offsets.
template <int DP, int ROWS> __device__ __forceinline__ void load_tile_sw128(uint32_t s, const bf16 *g) {
    static_assert(DP % 64 == 0 && ROWS % 32 == 0, "load_tile_sw128: whole column blocks, rows in passes of 32");
    const int c = threadIdx.x & 7, r0 = threadIdx.x >> 3;
    const uint32_t dst = s + (uint32_t)(r0 * SW + ((c ^ (r0 & 7)) << 4));
    const bf16 *src = g + (size_t)r0 * DP + c * 8;
#pragma unroll
    for (int blk = 0; blk < DP / 64; blk++)
#pragma unroll
        for (int r = 0; r < ROWS; r += 32) cp_async16(dst + (uint32_t)((blk * ROWS + r) * SW), src + r * DP + blk * 64);
}

// 2^x in one MUFU instruction (subnormal results flush to zero: probabilities below 2^-126 become 0).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x (64 x N) = A B^T over DP columns: A = 64 rows of a swizzled tile of a_rows rows (first row a_row0), B = all
// N rows of a tile of N rows; both K-major.
template <int N, int DP>
__device__ __forceinline__ void product_k_major(float *x, uint32_t a_tile, int a_rows, int a_row0, uint32_t b_tile) {
#pragma unroll
    for (int kc = 0; kc < DP / 16; kc++) {
        const uint32_t col = (uint32_t)((kc & 3) * 32);  // 16 columns = 32 bytes into the column block
        const uint64_t da = sw128_desc(a_tile + (uint32_t)((kc >> 2) * a_rows * SW + a_row0 * SW) + col, K_MAJOR_LBO);
        const uint64_t db = sw128_desc(b_tile + (uint32_t)((kc >> 2) * N * SW) + col, K_MAJOR_LBO);
        if constexpr (N == 64) wgmma_ss_n64(x, da, db, kc > 0);
        else wgmma_ss_n128(x, da, db, kc > 0);
    }
}

// acc (64 x N) += X (64 x K) tile (K x N): X in registers as A fragments (a[j] = columns 16j .. 16j+15), the
// tile (K rows, N columns, swizzled) N-major.
template <int N, int K>
__device__ __forceinline__ void product_n_major(float *acc, const uint32_t (*a)[4], uint32_t tile) {
#pragma unroll
    for (int j = 0; j < K / 16; j++) wgmma_rs<N>(acc, a[j], sw128_desc(tile + (uint32_t)(j * 16 * SW), K * SW));
}

template <int NT> __device__ __forceinline__ void zero(float (*x)[4]) {
#pragma unroll
    for (int i = 0; i < NT; i++) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.0f;
}

// The shared-memory base rounded up to 1024 bytes (the launches ask for 1 KiB more than the tiles need).
__device__ __forceinline__ uint32_t smem_base_1024(const void *smem) { return (smem_addr(smem) + 1023u) & ~1023u; }

// ---------------------------------------------------------------------------- forward
constexpr int F_BM = 128, F_BN = 128;

// As attention_forward_kernel (attention.cu): the same online softmax, with the exponentials of the file comment;
// DQ, DV the padded head dims.
template <int DQ, int DV>
__global__ void __launch_bounds__(THREADS, 1)
    attention_forward_wgmma_kernel(float *out, float *lse, const bf16 *qs, const bf16 *ks, const bf16 *vs, int T,
                                   int Tpad, int H, int Dv, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t Qs = smem_base_1024(smem), Ks = Qs + F_BM * DQ * 2, Vs = Ks + 2 * F_BN * DQ * 2;
    constexpr uint32_t K_BUF = F_BN * DQ * 2, V_BUF = F_BN * DV * 2;

    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // grid_order below
    const int q0 = qt * F_BM;
    // warp-uniform to the compiler (a shuffle's result), so the branches on it are not divergent paths (dkv)
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + wg * 64;  // this warpgroup's first query row
    const int row0 = wq0 + warp * 16 + g, row1 = row0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *kg = ks + bh * Tpad * DQ, *vg = vs + bh * Tpad * DV;
    const int n_kt = (min(q0 + F_BM, T) - 1) / F_BN + 1;

    load_tile_sw128<DQ, F_BM>(Qs, qs + (bh * Tpad + q0) * DQ);
    load_tile_sw128<DQ, F_BN>(Ks, kg);
    cp_async_commit();

    float o[DV / 8][4];
    zero<DV / 8>(o);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    uint32_t p[F_BN / 16][4];  // the previous tile's probabilities, the A operand of its O += P V
    bool p_ready = false;      // p holds a tile this warpgroup has not yet multiplied into O
    auto add_pv = [&](int tile) {  // O += P V of a tile whose V is in shared memory, waited for
        fence_regs(&o[0][0], DV / 2);
        wgmma_fence();
        product_n_major<DV, F_BN>(&o[0][0], p, Vs + (tile & 1) * V_BUF);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(&o[0][0], DV / 2);
    };

    // Iteration kt has K tile kt and V tile kt - 1 in shared memory and loads K tile kt + 1 and V tile kt; it issues
    // S = Q K^T of tile kt and O += P V of tile kt - 1 together, takes tile kt's softmax while the second product
    // runs, and rescales O once that product is done. O sees the same rescales and products in the same order as
    // one tile at a time, so the results are those bits.
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();  // K tile kt and V tile kt - 1 are in; every warp is done with K tile kt - 1, V tile kt - 2
        if (kt + 1 < n_kt) load_tile_sw128<DQ, F_BN>(Ks + ((kt + 1) & 1) * K_BUF, kg + (size_t)(kt + 1) * F_BN * DQ);
        load_tile_sw128<DV, F_BN>(Vs + (kt & 1) * V_BUF, vg + (size_t)kt * F_BN * DV);
        cp_async_commit();
        const int k0 = kt * F_BN;
        if (k0 > wq0 + 63 || wq0 >= T) {  // every key of the tile is after every row of the warpgroup
            if (p_ready) add_pv(kt - 1);
            p_ready = false;
            continue;
        }

        float s[F_BN / 8][4];
        fence_regs(&o[0][0], DV / 2);
        wgmma_fence();
        product_k_major<F_BN, DQ>(&s[0][0], Qs, F_BM, wg * 64, Ks + (kt & 1) * K_BUF);
        wgmma_commit();
        if (p_ready) product_n_major<DV, F_BN>(&o[0][0], p, Vs + ((kt - 1) & 1) * V_BUF);
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(&s[0][0], F_BN / 2);

        // in raw score units (scale_log2 > 0 keeps the order): the max, then p = 2^(s c - m c) in one FFMA
        if (k0 + F_BN - 1 > wq0) {  // the tile crosses the diagonal of this warpgroup's rows
#pragma unroll
            for (int nt = 0; nt < F_BN / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + nt * 8 + 2 * t + (e & 1) > (e < 2 ? row0 : row1)) s[nt][e] = -INFINITY;
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < F_BN / 8; nt++) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        // every row processed here sees key 0 in tile 0 (its first), so the maxima are finite from then on and
        // alpha = 2^(-inf) = 0 on the first tile
        const float mn0 = quad_max(mx0), mn1 = quad_max(mx1);
        const float alpha0 = exp2_ftz((m0 - mn0) * scale_log2), alpha1 = exp2_ftz((m1 - mn1) * scale_log2);
        const float mc0 = mn0 * scale_log2, mc1 = mn1 * scale_log2;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < F_BN / 8; nt++) {
            s[nt][0] = exp2_ftz(fmaf(s[nt][0], scale_log2, -mc0));
            s[nt][1] = exp2_ftz(fmaf(s[nt][1], scale_log2, -mc0));
            s[nt][2] = exp2_ftz(fmaf(s[nt][2], scale_log2, -mc1));
            s[nt][3] = exp2_ftz(fmaf(s[nt][3], scale_log2, -mc1));
            sum0 += s[nt][0] + s[nt][1];
            sum1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * alpha0 + quad_sum(sum0);
        l1 = l1 * alpha1 + quad_sum(sum1);
        m0 = mn0;
        m1 = mn1;
        wgmma_wait<0>();  // the previous tile's O += P V has read p and written o
        fence_regs(&o[0][0], DV / 2);
        scale_rows<DV / 8>(o, alpha0, alpha1);
#pragma unroll
        for (int j = 0; j < F_BN / 16; j++) pack_a_from_c(p[j], s[2 * j], s[2 * j + 1]);
        p_ready = true;
    }
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // the last V tile is in
    if (p_ready) add_pv(n_kt - 1);  // the last tile's product

    store_rows<DV, true>(out + ((size_t)b * T * H + h) * Dv, (size_t)H * Dv, row0, T, 0, Dv, o, l0, l1, t);
    if (t == 0 && row0 < T) lse[bh * T + row0] = (m0 * scale_log2 + log2f(l0)) * LN2;
    if (t == 0 && row1 < T) lse[bh * T + row1] = (m1 * scale_log2 + log2f(l1)) * LN2;
}

// ---------------------------------------------------------------------------- dq
constexpr int Q_BM = 128, Q_BN = 64;

// As attention_backward_dq_kernel (attention.cu).
template <int DQ, int DV>
__global__ void __launch_bounds__(THREADS, 1)
    attention_dq_wgmma_kernel(float *dq, const float *Dg, const float *lse2, const bf16 *qs, const bf16 *ks,
                              const bf16 *vs, const bf16 *dos, int T, int Tpad, int H, int Dqk, float scale,
                              float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t Qs = smem_base_1024(smem), dOs = Qs + Q_BM * DQ * 2, Ks = dOs + Q_BM * DV * 2,
                   Vs = Ks + 3 * Q_BN * DQ * 2;
    constexpr uint32_t K_BUF = Q_BN * DQ * 2, V_BUF = Q_BN * DV * 2;

    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // grid_order below
    const int q0 = qt * Q_BM;
    // warp-uniform to the compiler (a shuffle's result), so the branches on it are not divergent paths (dkv)
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wq0 = q0 + wg * 64;
    const int row0 = wq0 + warp * 16 + g, row1 = row0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *kg = ks + bh * Tpad * DQ, *vg = vs + bh * Tpad * DV;
    const int n_kt = (min(q0 + Q_BM, T) - 1) / Q_BN + 1;
    const float lse0 = lse2[bh * Tpad + row0], lse1 = lse2[bh * Tpad + row1];  // rows < Tpad always
    const float D0 = Dg[bh * Tpad + row0], D1 = Dg[bh * Tpad + row1];

    load_tile_sw128<DQ, Q_BM>(Qs, qs + (bh * Tpad + q0) * DQ);
    load_tile_sw128<DV, Q_BM>(dOs, dos + (bh * Tpad + q0) * DV);
    load_tile_sw128<DQ, Q_BN>(Ks, kg);
    load_tile_sw128<DV, Q_BN>(Vs, vg);
    cp_async_commit();

    float acc[DQ / 8][4];
    zero<DQ / 8>(acc);
    uint32_t ds[Q_BN / 16][4];  // the previous tile's scale * dS, the A operand of its dq += dS K
    bool ds_ready = false;      // ds holds a tile this warpgroup has not yet multiplied into dq
    auto add_ds_k = [&](int tile) {  // dq += (scale dS) K of a tile whose K is still in shared memory, waited for
        fence_regs(&acc[0][0], DQ / 2);
        wgmma_fence();
        product_n_major<DQ, Q_BN>(&acc[0][0], ds, Ks + (tile % 3) * K_BUF);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(&acc[0][0], DQ / 2);
    };

    // Iteration kt issues S and dP of key tile kt and dq += dS K of tile kt - 1 together, and takes tile kt's dS
    // while the last product runs: K tiles stay in shared memory for two iterations (three buffers), V tiles for
    // one. dq sees the same products in the same order as one tile at a time, so the results are those bits.
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads();  // tile kt is in; every warp is done with K tile kt - 2 and V tile kt - 1
        if (kt + 1 < n_kt) {
            load_tile_sw128<DQ, Q_BN>(Ks + ((kt + 1) % 3) * K_BUF, kg + (size_t)(kt + 1) * Q_BN * DQ);
            load_tile_sw128<DV, Q_BN>(Vs + ((kt + 1) & 1) * V_BUF, vg + (size_t)(kt + 1) * Q_BN * DV);
        }
        cp_async_commit();
        const int k0 = kt * Q_BN;
        if (k0 > wq0 + 63 || wq0 >= T) {  // every key of the tile is after every row of the warpgroup
            if (ds_ready) add_ds_k(kt - 1);
            ds_ready = false;
            continue;
        }
        const uint32_t kb = Ks + (kt % 3) * K_BUF, vb = Vs + (kt & 1) * V_BUF;

        float s[Q_BN / 8][4], dp[Q_BN / 8][4];
        fence_regs(&acc[0][0], DQ / 2);
        wgmma_fence();
        product_k_major<Q_BN, DQ>(&s[0][0], Qs, Q_BM, wg * 64, kb);    // S = Q K^T
        product_k_major<Q_BN, DV>(&dp[0][0], dOs, Q_BM, wg * 64, vb);  // dP = dO V^T
        wgmma_commit();
        if (ds_ready) product_n_major<DQ, Q_BN>(&acc[0][0], ds, Ks + ((kt + 2) % 3) * K_BUF);  // dq += dS K, kt - 1
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(&s[0][0], Q_BN / 2);
        fence_regs(&dp[0][0], Q_BN / 2);

#pragma unroll
        for (int nt = 0; nt < Q_BN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool lo = e < 2;
                const float p = exp2_ftz(fmaf(s[nt][e], scale_log2, -(lo ? lse0 : lse1)));
                s[nt][e] = p * (dp[nt][e] - (lo ? D0 : D1)) * scale;  // scale * dS
            }
        }
        if (k0 + Q_BN - 1 > wq0) {  // the tile crosses the diagonal: dS = 0 above it
#pragma unroll
            for (int nt = 0; nt < Q_BN / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + nt * 8 + 2 * t + (e & 1) > (e < 2 ? row0 : row1)) s[nt][e] = 0.0f;
        }
        wgmma_wait<0>();  // the previous tile's product has read ds
        fence_regs(&acc[0][0], DQ / 2);
#pragma unroll
        for (int j = 0; j < Q_BN / 16; j++) pack_a_from_c(ds[j], s[2 * j], s[2 * j + 1]);
        ds_ready = true;
    }
    if (ds_ready) add_ds_k(n_kt - 1);  // the last tile's product (its K tile is still in)

    store_rows<DQ, false>(dq + ((size_t)b * T * H + h) * Dqk, (size_t)H * Dqk, row0, T, 0, Dqk, acc, 0.0f, 0.0f, t);
}

// ---------------------------------------------------------------------------- dk, dv
constexpr int KV_BK = 64;  // keys per block; query tiles are KT = 64 rows

// As attention_backward_dkv_kernel (attention.cu): warpgroup 0 the value group, warpgroup 1 the key group.
template <int DQ, int DV>
__global__ void __launch_bounds__(THREADS, 1)
    attention_dkv_wgmma_kernel(float *dk_nope, float *dk_rope, float *dv, const float *Dg, const float *lse2,
                               const bf16 *qs, const bf16 *ks, const bf16 *vs, const bf16 *dos, int T, int Tpad, int H,
                               int Dn, int Dr, int Dv, float scale, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t Ks = smem_base_1024(smem), Vs = Ks + KV_BK * DQ * 2, Qs = Vs + KV_BK * DV * 2,
                   dOs = Qs + 3 * KT * DQ * 2;
    constexpr uint32_t Q_BUF = KT * DQ * 2, DO_BUF = KT * DV * 2;
    // after the tiles: P^T (32 floats per value-warpgroup thread, [i][thread]), then lse2 and D, two buffers each
    unsigned char *tail = smem + (dOs + 3 * DO_BUF - smem_addr(smem));
    float *Ps = reinterpret_cast<float *>(tail), *lse_s = Ps + 32 * 128, *D_s = lse_s + 2 * KT;

    const int kt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // grid_order below
    const int k0 = kt * KV_BK;
    const int n_iter = (T + KT - 1) / KT - kt * (KV_BK / KT);  // query tiles from the diagonal on
    // the warpgroup index read through a shuffle is warp-uniform to the compiler, so the branches on it below are
    // not divergent paths (which would make ptxas serialise the wgmma instructions)
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3,
              slot = threadIdx.x & 127;
    const bool key_group = wg == 1;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
    const size_t bh = (size_t)b * H + h;
    const bf16 *qg = qs + bh * Tpad * DQ, *dog = dos + bh * Tpad * DV;
    const float *lse2g = lse2 + bh * Tpad, *Dgh = Dg + bh * Tpad;

    load_tile_sw128<DQ, KV_BK>(Ks, ks + (bh * Tpad + k0) * DQ);
    load_tile_sw128<DV, KV_BK>(Vs, vs + (bh * Tpad + k0) * DV);
    load_tile_sw128<DQ, KT>(Qs, qg + (size_t)k0 * DQ);
    load_tile_sw128<DV, KT>(dOs, dog + (size_t)k0 * DV);
    load_row_stats_async(lse_s, lse2g + k0, 0);
    load_row_stats_async(D_s, Dgh + k0, 32);
    cp_async_commit();

    const bool want_dk = dk_nope != NULL || dk_rope != NULL;
    const bool second_product = key_group ? want_dk : dv != NULL;

    constexpr int ACC = DQ > DV ? DQ : DV;
    float acc[ACC / 8][4];
    zero<ACC / 8>(acc);
    uint32_t a[KT / 16][4];  // the previous tile's P^T (value group) or scale dS^T (key group), A of its 2nd product
    bool a_ready = false;    // a holds a tile this warpgroup has not yet multiplied into its accumulator
    // The second product of a query tile still in shared memory: dv += P^T dO or dk += (scale dS^T) Q. Branches on
    // the warpgroup's role are compile-time (KEY), so every wgmma batch lies in one path (no injected arrives).
    // (Issued inside a batch whose wgmma_fence follows the last write of acc and a.)
    auto second = [&](auto key_c, int tile) {
        if constexpr (decltype(key_c)::value) product_n_major<DQ, KT>(&acc[0][0], a, Qs + (tile % 3) * Q_BUF);
        else product_n_major<DV, KT>(&acc[0][0], a, dOs + (tile % 3) * DO_BUF);
    };
    // Iteration it, before the exchange of P^T: the first product of query tile it (the value group's S^T = K Q^T,
    // the key group's dP^T = V dO^T) and the second product of tile it - 1 issued together; then the value group's
    // P^T into shared memory while the second product runs.
    auto before_exchange = [&](auto key_c, float (*x)[4], int it, bool need_mask) {
        constexpr bool KEY = decltype(key_c)::value;
        const int q0 = k0 + it * KT, buf = it % 3;
        if (!KEY || want_dk) {
            fence_regs(&acc[0][0], ACC / 2);
            wgmma_fence();
            if constexpr (KEY) product_k_major<KT, DV>(&x[0][0], Vs, KV_BK, 0, dOs + buf * DO_BUF);  // dP^T = V dO^T
            else product_k_major<KT, DQ>(&x[0][0], Ks, KV_BK, 0, Qs + buf * Q_BUF);                // S^T = K Q^T
            wgmma_commit();
            if (a_ready) second(key_c, it - 1);
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(&x[0][0], KT / 2);
        }
        if constexpr (!KEY) {
            const float *ls = lse_s + (it & 1) * KT;
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++) {
                const float2 l = *reinterpret_cast<const float2 *>(ls + nt * 8 + 2 * t);
                x[nt][0] = exp2_ftz(fmaf(x[nt][0], scale_log2, -l.x));
                x[nt][1] = exp2_ftz(fmaf(x[nt][1], scale_log2, -l.y));
                x[nt][2] = exp2_ftz(fmaf(x[nt][2], scale_log2, -l.x));
                x[nt][3] = exp2_ftz(fmaf(x[nt][3], scale_log2, -l.y));
            }
            if (need_mask) {
#pragma unroll
                for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int row = q0 + nt * 8 + 2 * t + (e & 1);
                        if ((e < 2 ? key0 : key1) > row || row >= T) x[nt][e] = 0.0f;
                    }
            }
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) Ps[(nt * 4 + e) * 128 + slot] = x[nt][e];
        }
    };
    // After the exchange: the key group's scale dS^T from P^T; then, once the second product of tile it - 1 is
    // done, this tile's A operand of its own.
    auto after_exchange = [&](auto key_c, float (*x)[4], int it) {
        if constexpr (decltype(key_c)::value) {
            const float *Ds = D_s + (it & 1) * KT;
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++) {
                const float2 d = *reinterpret_cast<const float2 *>(Ds + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    x[nt][e] = Ps[(nt * 4 + e) * 128 + slot] * (x[nt][e] - (e & 1 ? d.y : d.x)) * scale;  // scale dS^T
            }
        }
        wgmma_wait<0>();  // the previous tile's second product has read a and written acc
        fence_regs(&acc[0][0], ACC / 2);
#pragma unroll
        for (int j = 0; j < KT / 16; j++) pack_a_from_c(a[j], x[2 * j], x[2 * j + 1]);
        a_ready = true;
    };
    // Query tiles stay in shared memory for two iterations (three buffers): the second product of tile it - 1 runs
    // in iteration it. Each accumulator sees the same products in the same order as one tile at a time. Each role
    // runs the loop in its own copy (run below), so no wgmma batch spans a branch on the role; the two copies meet
    // at the same block barriers.
    auto run = [&](auto key_c) {
        for (int it = 0; it < n_iter; it++) {
            cp_async_wait_all();
            fence_proxy_async();
            block_barrier();  // tile it is in; every warp is done with query tile it - 2, statistics it - 1 and Ps
            if (it + 1 < n_iter) {
                const int qn = k0 + (it + 1) * KT, nb = (it + 1) % 3, sb = (it + 1) & 1;
                load_tile_sw128<DQ, KT>(Qs + nb * Q_BUF, qg + (size_t)qn * DQ);
                load_tile_sw128<DV, KT>(dOs + nb * DO_BUF, dog + (size_t)qn * DV);
                load_row_stats_async(lse_s + sb * KT, lse2g + qn, 0);
                load_row_stats_async(D_s + sb * KT, Dgh + qn, 32);
            }
            cp_async_commit();
            const bool need_mask = it == 0 || k0 + it * KT + KT > T;  // the diagonal tile, or rows beyond T

            float x[KT / 8][4];  // element (key warp*16 + g or +8, query 8 nt + 2t + e%2 of the tile)
            before_exchange(key_c, x, it, need_mask);
            block_barrier();  // Ps complete
            if (second_product) after_exchange(key_c, x, it);
        }
        if (a_ready) {  // the last tile's second product (its query tile is still in)
            fence_regs(&acc[0][0], ACC / 2);
            wgmma_fence();
            second(key_c, n_iter - 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(&acc[0][0], ACC / 2);
        }
    };
    if (key_group) run(std::true_type{});
    else run(std::false_type{});

    const size_t ld = (size_t)Dn + Dv, head0 = (size_t)b * T * H + h;  // row (b, 0, h) of a (B, T, H, .) tensor
    if (key_group) {
        if (dk_nope != NULL) store_rows<ACC, false>(dk_nope + head0 * ld, H * ld, key0, T, 0, Dn, acc, 0.0f, 0.0f, t);
        if (dk_rope != NULL)
            store_rows<ACC, false>(dk_rope + head0 * Dr, (size_t)H * Dr, key0, T, Dn, Dn + Dr, acc, 0.0f, 0.0f, t);
    } else if (dv != NULL) {
        store_rows<ACC, false>(dv + head0 * ld, H * ld, key0, T, 0, Dv, acc, 0.0f, 0.0f, t);
    }
}

}  // namespace

// ---------------------------------------------------------------------------- host side
bool attention_wgmma_supported(int DQP, int DVP) {
    static int cc = -1;  // the device's compute capability, major * 10 + minor (one device per process)
    if (cc < 0) {
        int dev = 0, major = 0, minor = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        cc = major * 10 + minor;
    }
    return cc == 90 && (DQP == 128 || DQP == 192) && DVP == 128;
}

// Every kernel's grid: its row tiles of one head (x: the tiles, heaviest first, the kernel maps blockIdx.x so), then
// the heads (y), then the batch (z). Blocks start in that order, so the blocks resident at a time are the tiles of a
// few heads, and the key and value (dkv: query and output-gradient) tiles every block of a head streams come from L2
// after the first block's reads. With the heads first, the resident blocks were the same row tile of 128 different
// heads, each reading its own head's tiles: about 1.6 GB per forward at B = 8, from DRAM at 89% of its bandwidth
// (ncu, docs/benchmarks.md 2026-12-07 seventh session).
static dim3 grid_order(int tiles, int H, int B) {
    if (H > 65535 || B > 65535) {
        fprintf(stderr, "fp8moe: kernels/cuda/attention_wgmma.cu: %d heads x %d sequences - expected at most 65535 of "
                        "each (a grid's y and z)\n", H, B);
        exit(1);
    }
    return dim3((unsigned)tiles, (unsigned)H, (unsigned)B);
}

template <int DQ, int DV>
static void launch_forward(float *out, float *lse, const Staged *s, int B, int T, int H, int Dqk, int Dv) {
    const size_t smem = 1024 + 2 * ((size_t)F_BM * DQ + 2 * (size_t)F_BN * (DQ + DV));
    allow_smem(attention_forward_wgmma_kernel<DQ, DV>, smem, "attention_forward_wgmma_kernel");
    const dim3 grid = grid_order((T + F_BM - 1) / F_BM, H, B);
    const float scale = 1.0f / sqrtf((float)Dqk);
    attention_forward_wgmma_kernel<DQ, DV><<<grid, THREADS, smem>>>(out, lse, s->q, s->k, s->v, T, s->Tpad, H, Dv,
                                                                    scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_forward_wgmma_kernel");
}

template <int DQ, int DV> static void launch_dq(float *dq, const Staged *s, int B, int T, int H, int Dqk) {
    const size_t smem = 1024 + 2 * ((size_t)Q_BM * (DQ + DV) + (size_t)Q_BN * (3 * DQ + 2 * DV));
    allow_smem(attention_dq_wgmma_kernel<DQ, DV>, smem, "attention_dq_wgmma_kernel");
    const dim3 grid = grid_order((T + Q_BM - 1) / Q_BM, H, B);
    const float scale = 1.0f / sqrtf((float)Dqk);
    attention_dq_wgmma_kernel<DQ, DV><<<grid, THREADS, smem>>>(dq, s->D, s->lse2, s->q, s->k, s->v, s->dout, T,
                                                               s->Tpad, H, Dqk, scale, scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_dq_wgmma_kernel");
}

template <int DQ, int DV>
static void launch_dkv(const DkvOut *o, const Staged *s, int B, int T, int H, int Dn, int Dr, int Dv) {
    const size_t smem = 1024 + 2 * ((size_t)KV_BK * (DQ + DV) + 3 * (size_t)KT * (DQ + DV)) +
                        sizeof(float) * (32 * 128 + 4 * KT);
    allow_smem(attention_dkv_wgmma_kernel<DQ, DV>, smem, "attention_dkv_wgmma_kernel");
    const dim3 grid = grid_order((T + KV_BK - 1) / KV_BK, H, B);
    const float scale = 1.0f / sqrtf((float)(Dn + Dr));
    attention_dkv_wgmma_kernel<DQ, DV><<<grid, THREADS, smem>>>(o->dk_nope, o->dk_rope, o->dv, s->D, s->lse2, s->q,
                                                                s->k, s->v, s->dout, T, s->Tpad, H, Dn, Dr, Dv, scale,
                                                                scale * LOG2E);
    CUDA_CHECK_LAUNCH("attention_dkv_wgmma_kernel");
}

void attention_wgmma_forward(float *out, float *lse, const Staged *s, int B, int T, int H, int Dqk, int Dv) {
    if (s->DQP == 192) launch_forward<192, 128>(out, lse, s, B, T, H, Dqk, Dv);
    else launch_forward<128, 128>(out, lse, s, B, T, H, Dqk, Dv);
}
void attention_wgmma_dq(float *dq, const Staged *s, int B, int T, int H, int Dqk) {
    if (s->DQP == 192) launch_dq<192, 128>(dq, s, B, T, H, Dqk);
    else launch_dq<128, 128>(dq, s, B, T, H, Dqk);
}
void attention_wgmma_dkv(const DkvOut *o, const Staged *s, int B, int T, int H, int Dn, int Dr, int Dv) {
    if (s->DQP == 192) launch_dkv<192, 128>(o, s, B, T, H, Dn, Dr, Dv);
    else launch_dkv<128, 128>(o, s, B, T, H, Dn, Dr, Dv);
}
