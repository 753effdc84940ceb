/*
 * fp8_grouped_gemm.cu - fp8moe's own grouped FP8 GEMM for the routed experts: Y_g = X_g W_g^T for every expert
 * segment g in one persistent Hopper kernel, with DeepSeek-V3's promotion (each 128-deep K block's tensor-core sum
 * is scaled by its 1x128 activation scale and its 128x128 weight-block scale as it is added to FP32 accumulators
 * held in registers). The interface is fp8_grouped_gemm.h; the operands and the BF16 products are exactly those of
 * kernels.h's grouped Fprops and, with the transposed weights, Dgrads, whose GEMMs gemm.cu runs here (unless
 * FP8MOE_GROUPED_GEMM=cublaslt: one cuBLASLt GEMM per expert).
 *
 * Why: cuBLASLt has no grouped block-scaled FP8 GEMM, so the experts' GEMMs were one GEMM per expert and Linear
 * (issue 23). One launch over all segments' tiles keeps every SM busy across segment boundaries and pays no launch
 * per segment. With 128 x 128 tiles it ran at 0.88-1.07x cuBLASLt's per-segment path (docs/benchmarks.md,
 * 2026-12-01 to 2026-12-05; ncu: the tensor pipe active about half the time); the wide form's 128 x 256 tiles run at
 * 1,090-1,180 TFLOPS on an H100, 1.17-1.32x cuBLASLt (2026-12-06), bitwise equal to it in every form.
 * Tried and slower: 256-row tiles, products split into two m64n64 halves per block, the two consumers issuing each
 * block's products in turn (named barriers) so that one would promote while the other's products run.
 *
 * The Wgrad form (WGRAD; cuda_fp8_grouped_wgrad): dW_g += dY_g^T X_g, the contraction over segment g's own 128-token
 * tiles (k-grouped), both operands 128x1-scaled, so each output column has its own X scale per block: the producer
 * bulk-loads the block's 128 X scales into the stage beside the 128 dY scales, and the promotion is
 * fma(P, s_dy[row] s_x[col], acc) (twice the Fprop's FP32 work per block; the stage is released after it). The
 * epilogue adds acc to dW with TMA reduce-adds (cp.reduce.async.bulk.tensor .add: each consumer stages its rows in
 * FP32 boxes of 64 x 32 in the 128-byte swizzle, one thread issues the adds, which the L2 performs while the
 * consumers go on; every element gets one FP32 add, so the result is the read-add-write's, deterministic). It has
 * the wide form too (256 output columns: the stage holds 256 X scales, each half's promotion reads its 128). On an
 * H200 at the expert shapes the wide form ran at 0.98-0.99x cuBLASLt's per-segment Wgrads (0.91-0.96x with each
 * thread's own read-add-write of dW), and the model's step 1.3% slower with the experts' Wgrads on it
 * (docs/benchmarks.md, 2026-12-06), so the model's Wgrads stay on cuBLASLt.
 *
 * Tiles: 128 output rows (tokens of one segment) x 128 output columns (one weight block row nb; two in the wide
 * form below) x the whole K, in
 * K blocks of 128 (one scale of each operand per row and block). A segment's last row tile may run past its rows:
 * those rows are read (the next segment's rows or TMA's zero fill past the operand's end) and computed but never
 * stored. Units of work are output tiles, numbered segment by segment, row tile by row tile (column tiles within);
 * the persistent grid takes them round-robin (CTA c takes c, c + CTAs, ...). Each output
 * element is computed by one thread in one fixed order, so results are bitwise reproducible and independent of the
 * grid size; no atomics.
 *
 * Block: 384 threads = 3 warpgroups, one CTA per SM (shared memory). Warpgroup 2 is the producer: one thread issues,
 * per K block, the TMA loads of the X tile (128 rows x 128 bytes, 128-byte swizzle) and the W tile (the same) and a
 * bulk copy of the 128 X scales (kernels.h's 1x128 layout: [KB][T16_g] per segment, so a row tile's scales of one
 * block are contiguous) into one of STAGES shared-memory stages, all completing on that stage's "full" mbarrier
 * (transaction bytes). Warpgroups 0 and 1 are consumers, 64 rows each: per K block four wgmma m64n128k32 (E4M3,
 * K-major, both operands from shared memory) into a fresh FP32 accumulator, wait, release the stage (one arrival
 * per warp on its "empty" mbarrier), then fin = fma(acc, s_x * s_w, fin); the weight scale of the next block is
 * loaded one block ahead (the next tile's first one during this tile's epilogue). After the last block each consumer
 * writes its 64 x 128 BF16 tile into two 64 x 64 boxes of shared memory in the 128-byte swizzle (conflict-free) and
 * one thread stores them with TMA through the segment's own output tensor map, whose row count drops the rows past
 * the segment's end; the stores run while the next tile's products start (the staging is reused once they have read
 * it).
 * A form in which clusters of two CTAs shared each X tile through TMA multicast (each loading half of it into both)
 * ran at the single-CTA speed and was removed once the wide form below was faster (docs/benchmarks.md).
 * The wide form (TN = 256, weights with an even number of column blocks) gives each CTA a 128 x 256 output tile: the
 * stage holds the X tile and 256 weight rows (two blocks, one TMA box), and each consumer runs the four products and
 * the promotion of the first 128 columns, then of the second, into one acc[64] and the two halves of fin[128], so
 * each X tile is read from L2 once per 256 output columns and each stage's barrier wait serves twice the products.
 * Its consumers need about 228 registers: they take 240 and the producer warpgroup gives up all but 24 (setmaxnreg;
 * ptxas honours it only if no trap is inlined into the kernel: hang_trap). 3 stages of 48 KB and 64 KB of output
 * staging fill the shared memory.
 *
 * Tensor maps (cuTensorMapEncodeTiled, reached through cudaGetDriverEntryPointByVersion: no -lcuda) are built on the
 * host per call - Fprop/Dgrad: one for X and two per non-empty segment (its weight, its rows of y); Wgrad: three
 * per non-empty segment (its dY and X codes, its dW) - and passed in the kernel's __grid_constant__ parameter (about
 * 27 KB, room for the Wgrad's per-segment A maps; the Fprop uses a[0] of them); up to MAX_GROUPS segments per
 * launch, more segments take more launches.
 *
 * Numerics against the CPU reference (kernels/cpu/fp8.c: P exact, then acc = acc + ((float)P s_x) s_w): the
 * tensor cores add a block's products in reduced precision (DESIGN.md section 4: within 2^-10 sum |a s_a b s_b|),
 * and the promotion here multiplies the two scales first and fuses the add (a few FP32 roundings per block), so
 * results agree within that bound plus BF16 output rounding, not bit for bit (tests/gpu/test_gpu_grouped_gemm.c).
 * A wait on an mbarrier that has not completed after 10 s (a bug) traps instead of hanging the GPU.
 *
 * The BF16 forms (OPS; cuda_bf16_grouped_gemm: bf16 mode's routed experts): the same tiles, stages and epilogue on
 * BF16 operands. A K block is 64 BF16 values, the same 128 bytes of a row, and wgmma's m64n128k16 BF16 slice is 32
 * bytes of K like the E4M3 k32 slice, so the boxes, the swizzle and the descriptors are unchanged. No scales: the
 * products accumulate straight into fin over the whole K, and each block's products are issued while the previous
 * block's run (wgmma.wait_group 1), the stage released once they are done. The Dgrad form (OPS_BF16_B_MN) reads the
 * (N, K) weight as it is, MN-major: each stage's B is TN / 64 column blocks of 64 contraction rows x 64 output
 * columns (one TMA box each), read with wgmma's transposed B. About 690 TFLOPS on an H100 at the expert Fprop shapes
 * against about 630 for cuBLASLt per expert (docs/benchmarks.md, 2026-12-07).
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_grouped_gemm.h"

namespace {

constexpr int BM = 128, BN = 128, BK = 128;  // output rows, weight block columns, K block (= the scaling granularity)
constexpr int THREADS = 384;  // two consumer warpgroups (warps 0-7) + the producer warpgroup (warps 8-11)
constexpr int MAX_GROUPS = 64;                 // non-empty segments per launch (tensor maps in the parameter)
constexpr uint32_t A_BYTES = BM * BK, SA_BYTES = BM * 4;
constexpr uint32_t OUT_BOX_BYTES = 64 * 128;  // BF16 staging of 64 rows x 64 columns, 128-byte swizzle
constexpr uint64_t WAIT_TRAP_NS = 10000000000ull;  // 10 s
// The wide form's registers per thread (setmaxnreg; the launch gives each 168): its consumers hold acc[64] and
// fin[128] (about 228 in all), its producer thread a few; 2 x 128 x 240 + 128 x 24 <= 65536.
constexpr int CONSUMER_REGS = 240, PRODUCER_REGS = 24;

// Shared memory of a CTA whose output tiles are TN (128 or 256: the wide form) columns wide: STAGES stages of the A
// tile, the B tile (TN rows of the weight), A's scales (and the Wgrad's B scales), the BF16 staging of the output
// tile, the stages' full and empty barriers.
template <int TN> struct Smem {
    static constexpr int STAGES = TN == 256 ? 3 : 5;
    static constexpr uint32_t B_BYTES = TN * BK, OUT_BYTES = 2 * (TN / 64) * OUT_BOX_BYTES;
    static constexpr uint32_t SB_BYTES = TN * 4;  // Wgrad: the TN X scales of a column tile and K block
    static constexpr uint32_t A = 0, B = A + STAGES * A_BYTES, OUT = B + STAGES * B_BYTES;
    static constexpr uint32_t SA = OUT + OUT_BYTES, SB = SA + STAGES * SA_BYTES, BAR = SB + STAGES * SB_BYTES;
    static constexpr uint32_t BYTES = BAR + 2 * STAGES * 8 + 1024;  // + the round-up of the base to 1024 bytes
    static_assert(B % 1024 == 0 && OUT % 1024 == 0 && SA % 16 == 0 && SB % 16 == 0 && BAR % 8 == 0, "stage alignment");
    static_assert(BYTES <= 232448, "shared memory of one SM");
};

// One launch's segments (the non-empty ones, in order). Everything the kernel reads besides the operands. The Fprop
// form (Y_g = X_g W_g^T, X_g a segment's rows of one 1x128 operand) and the Wgrad form (dW_g += dY_g^T X_g, both 128x1
// operands of segment g: the contraction runs over its tokens) differ in where A comes from, how many K blocks a
// segment has, how B is scaled and what the epilogue does.
struct GroupedParams {
    CUtensorMap a[MAX_GROUPS];      // Fprop: a[0] = qx (P16 rows, Kp) bytes, box 128 (K) x BM rows;
                                    // Wgrad: segment g's dY^T codes (N rows, 128 tiles_g) bytes, box 128 x BM
    CUtensorMap b[MAX_GROUPS];      // Fprop: weight g (Np, Kp) bytes; Wgrad: segment g's X^T codes (K rows, 128
                                    // tiles_g); box 128 x 128
    CUtensorMap out_map[MAX_GROUPS];  // the output, 128-byte swizzle: Fprop segment g's rows of y (rows[g], Np) BF16,
                                      // box 64 x 64; Wgrad segment g's dW (N, K) FP32, box 32 x 64
    const float *sa[MAX_GROUPS];    // A's scales of segment g: Fprop [KB][t16[g]], Wgrad [tiles_g][N]
    const float *sb[MAX_GROUPS];    // B's: Fprop weight g's block scales (NB, KB4); Wgrad [tiles_g][K]
    int units0[MAX_GROUPS + 1];     // first unit (output tile) of each segment
    int a_row0[MAX_GROUPS];         // Fprop: P16_g, the segment's first row in qx; Wgrad: 0
    int sa_ld[MAX_GROUPS];          // floats from one K block's A scales to the next: Fprop t16[g] (the segment's
                                    // rows rounded up to 16), Wgrad N
    int kblocks[MAX_GROUPS];        // K blocks: Fprop KB, Wgrad the segment's token tiles
    int rows[MAX_GROUPS];           // Fprop: the segment's true rows
    int n_groups, units_n, kb4;     // units per row tile (column tiles), Fprop's KB4
    int out_rows, out_cols;         // Wgrad: N, K
};
static_assert(sizeof(GroupedParams) <= 32000, "kernel parameter limit (32764 bytes)");

// ---------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {  // arrive (count 1) + expect bytes
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return ok != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
// A trap out of line: an inlined one makes ptxas hold the whole function to the launch's register count (168 at 384
// threads), ignoring the consumers' setmaxnreg, and the wide form's accumulators then spill.
__device__ __noinline__ void hang_trap() { __trap(); }

// Waits for the phase of the given parity; traps (an error at the next synchronising call) if it has not completed
// after WAIT_TRAP_NS, which in this kernel means a bug, instead of hanging the GPU. The clock is read only once the
// first poll has failed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t t0 = global_ns();
    while (!mbar_try_wait(bar, parity))
        if (global_ns() - t0 > WAIT_TRAP_NS) hang_trap();
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// TMA: the box at (c0 = K byte, c1 = row) of tensor map `map` into shared dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// Contiguous bytes (a multiple of 16, 16-byte aligned both sides) global -> shared, completing on bar.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// TMA store of the box at shared src to (c0 = column, c1 = row) of tensor map `map` (rows past its end are not
// written), committed as one bulk group of this thread.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have read their shared memory (READ) or are complete.
// Adds the box at shared address src into the tensor at (c0, c1), in L2 (one FP32 add per element, RN).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap *map, uint32_t src, int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
template <bool READ> __device__ __forceinline__ void bulk_wait() {
    if constexpr (READ) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most one committed group is still running (the one just committed).
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Pins n registers: the compiler may not move their reads or writes across this point.
__device__ __forceinline__ void fence_regs(float *r, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// Descriptor of a K-major tile with 128-byte swizzle at shared address addr: rows of 128 bytes, 8-row groups 1024
// bytes apart (SBO); the leading byte offset is unused by this layout. A K step of 32 bytes (one k32 slice of E4M3)
// advances the start address by 32, as in attention_wgmma.cu's sw128_desc.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// Descriptor of an MN-major tile with 128-byte swizzle (the BF16 Dgrad's weight: the contraction runs along the
// tile's rows): column blocks of 64 BF16 output columns, each `rows` rows of 128 bytes; a K step of 16 rows advances
// the start by 16 x 128 bytes; LBO = the distance between column blocks, SBO 1024 (8 rows), as attention_wgmma.cu's
// N-major descriptor.
__device__ __forceinline__ uint64_t sw128_desc_mn(uint32_t addr, uint32_t lbo_bytes) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// d (64 x 128, FP32) = (accumulate ? d : 0) + A B^T over 32 E4M3 values of K; A (64 rows) and B (128 rows) K-major
// in shared memory. Register d[4j + e] holds row (warp in group) * 16 + lane / 4 + 8 (e / 2), column 8j + 2 (lane % 4)
// + e % 2.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

// The same for BF16 operands: d (64 x 128, FP32) += A B^T over 16 BF16 values of K (32 bytes, so a K-major
// descriptor advances as for a k32 slice of E4M3); A K-major, B K-major or (B_MN) MN-major (wgmma's transpose-B).
template <bool B_MN> __device__ __forceinline__ void wgmma_m64n128k16_bf16(float *d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %66;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(B_MN ? 1 : 0));
}

// Unit u of the launch -> segment g (advanced from the previous value: a CTA's units increase), row tile mb, column
// tile nb (TN columns).
__device__ __forceinline__ void unit_coords(const GroupedParams &p, int u, int &g, int &mb, int &nb) {
    while (u >= p.units0[g + 1]) g++;
    const int local = u - p.units0[g];
    mb = local / p.units_n;
    nb = local - mb * p.units_n;
}

// The weight scales of K block 0 of column tile nb of segment g's weight, one per 128-column half (Fprop).
template <int HALVES>
__device__ __forceinline__ void first_weight_scales(const GroupedParams &p, int g, int nb, float *sb) {
#pragma unroll
    for (int h = 0; h < HALVES; h++) sb[h] = __ldg(p.sb[g] + (nb * HALVES + h) * p.kb4);
}

// ---------------------------------------------------------------------------- the kernel
// WGRAD: the Wgrad form (file comment). TN: the output tile's columns, 128, or 256 for the wide form (two weight
// blocks per tile: the products of each 128-column half are summed and promoted in turn into acc[64] and fin[128], so
// its consumers take more registers with setmaxnreg). OPS: the operands (Operands), FP8 or the BF16 forms (file
// comment): no scales, K blocks of 64 BF16 values (the same 128 bytes a row), the products accumulated straight into
// fin.
enum Operands { OPS_FP8 = 0, OPS_BF16 = 1, OPS_BF16_B_MN = 2 };  // BF16_B_MN: the weight read MN-major (Dgrad)
template <bool WGRAD, int TN, int OPS = OPS_FP8>
__global__ void __launch_bounds__(THREADS, 1) fp8_grouped_gemm_kernel(const __grid_constant__ GroupedParams p) {
    static_assert(TN == BN || TN == 2 * BN, "tiles of 128 or 256 columns");
    constexpr bool BF16 = OPS != OPS_FP8, B_MN = OPS == OPS_BF16_B_MN;
    static_assert(!(WGRAD && BF16), "no BF16 Wgrad form");
    using L = Smem<TN>;
    constexpr int STAGES = L::STAGES, HALVES = TN / BN;
    constexpr int KE = BF16 ? BK / 2 : BK;  // elements of a K block (128 bytes of a row)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    unsigned char *smem = smem_raw + (base - raw);
    const uint32_t full = base + L::BAR, empty = full + STAGES * 8;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;  // wg 2: the producer

    if (threadIdx.x == 256) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int n_units = p.units0[p.n_groups];
    const int first = blockIdx.x, step = gridDim.x;
    if (wg == 2) {
        // ------------------------------------------------------------------ producer: one thread
        if constexpr (HALVES > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
        if (threadIdx.x == 256) {
            int g = 0;
            uint32_t it = 0;
            for (int u = first; u < n_units; u += step) {
                int mb, nb;
                unit_coords(p, u, g, mb, nb);
                // A's scales: a multiple of 16 (Fprop) or 4 (Wgrad) rows, so 16-byte multiples; none in BF16
                const int sa_rows = BF16 ? 0 : min(BM, p.sa_ld[g] - mb * BM);
                const float *sa = BF16 ? NULL : p.sa[g] + mb * BM;
                const int a_row = p.a_row0[g] + mb * BM;
                const CUtensorMap *a_map = WGRAD ? &p.a[g] : &p.a[0];
                const int sb_cols = WGRAD ? min(TN, p.out_cols - nb * TN) : 0;  // a multiple of 4
                const float *sb = WGRAD ? p.sb[g] + nb * TN : NULL;
                for (int kb = 0; kb < p.kblocks[g]; kb++, it++) {
                    const uint32_t s = it % STAGES, phase = (it / STAGES) & 1;
                    mbar_wait(empty + 8 * s, phase ^ 1);
                    const uint32_t bar = full + 8 * s;
                    mbar_expect_tx(bar, A_BYTES + L::B_BYTES + (uint32_t)(sa_rows + sb_cols) * 4);
                    tma_load_2d(base + L::A + s * A_BYTES, a_map, kb * KE, a_row, bar);
                    if constexpr (B_MN) {  // TN / 64 column blocks of 64 contraction rows x 64 output columns
#pragma unroll
                        for (int b = 0; b < TN / 64; b++)
                            tma_load_2d(base + L::B + s * L::B_BYTES + b * (KE * 128), &p.b[g], nb * TN + 64 * b,
                                        kb * KE, bar);
                    } else {
                        tma_load_2d(base + L::B + s * L::B_BYTES, &p.b[g], kb * KE, nb * TN, bar);
                    }
                    if constexpr (!BF16)
                        bulk_load(base + L::SA + s * SA_BYTES, sa + (size_t)kb * p.sa_ld[g], (uint32_t)sa_rows * 4,
                                  bar);
                    if constexpr (WGRAD)
                        bulk_load(base + L::SB + s * L::SB_BYTES, sb + (size_t)kb * p.out_cols, (uint32_t)sb_cols * 4,
                                  bar);
                }
            }
        }
    } else {
        // ------------------------------------------------------------------ consumers: rows wg * 64 ..
        if constexpr (HALVES > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
        const int cw = wg, r0 = warp * 16 + (lane >> 2);  // this thread's rows r0 and r0 + 8 of the 64
        const int c0 = 2 * (lane & 3);                       // and columns 8j + c0, 8j + c0 + 1 of each 128
        const bool issuer = (threadIdx.x & 127) == 0;        // issues the warpgroup's output stores (Fprop)
        constexpr uint32_t WG_OUT = (TN / 64) * OUT_BOX_BYTES;
        const uint32_t out = base + L::OUT + cw * WG_OUT;
        unsigned char *out_ptr = smem + L::OUT + cw * WG_OUT;
        float acc[64], fin[64 * HALVES];
        int g = 0, mb = 0, nb = 0;
        uint32_t it = 0;
        // Fprop: the next K block's weight scales (one per 128-column half), loaded one block ahead (across tiles too)
        float sb_next[HALVES] = {};
        if (first < n_units) {
            unit_coords(p, first, g, mb, nb);
            if constexpr (!WGRAD && !BF16) first_weight_scales<HALVES>(p, g, nb, sb_next);
        }
        for (int u = first; u < n_units; u += step) {
            const int tile_nb = nb, kblocks = p.kblocks[g];
#pragma unroll
            for (int i = 0; i < 64 * HALVES; i++) fin[i] = 0.0f;
            if constexpr (BF16) {
                // each block's products straight into fin; the next block's are issued while they run, and a
                // block's stage is released once its products are done (at most one group in flight)
                fence_regs(fin, 64 * HALVES);
                for (int kb = 0; kb < kblocks; kb++, it++) {
                    const uint32_t s = it % STAGES, phase = (it / STAGES) & 1;
                    mbar_wait(full + 8 * s, phase);
                    const uint32_t a_tile = base + L::A + s * A_BYTES + cw * 64 * BK,
                                   b_tile = base + L::B + s * L::B_BYTES;
                    wgmma_fence();
#pragma unroll
                    for (int h = 0; h < HALVES; h++)
#pragma unroll
                        for (int j = 0; j < BK / 32; j++) {
                            constexpr uint32_t MN_BLOCK = KE * 128;  // bytes of a 64-column block (B_MN)
                            const uint64_t db = B_MN ? sw128_desc_mn(b_tile + h * 2 * MN_BLOCK + j * 16 * 128, MN_BLOCK)
                                                     : sw128_desc(b_tile + h * BN * BK + 32 * j);
                            wgmma_m64n128k16_bf16<B_MN>(fin + 64 * h, sw128_desc(a_tile + 32 * j), db);
                        }
                    wgmma_commit();
                    wgmma_wait_one();
                    if (kb > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
                }
                wgmma_wait_all();
                fence_regs(fin, 64 * HALVES);
                if (kblocks > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
            } else {  // FP8: each block's products into acc, promoted into fin with the blocks' scales
                const float *sbp = WGRAD ? NULL : p.sb[g] + tile_nb * HALVES * p.kb4;
                for (int kb = 0; kb < kblocks; kb++, it++) {
                    const uint32_t s = it % STAGES, phase = (it / STAGES) & 1;
                    float sb[HALVES];
#pragma unroll
                    for (int h = 0; h < HALVES; h++) {
                        sb[h] = sb_next[h];
                        if (!WGRAD && kb + 1 < kblocks) sb_next[h] = __ldg(sbp + h * p.kb4 + kb + 1);
                    }
                    mbar_wait(full + 8 * s, phase);
                    const float *sa = reinterpret_cast<const float *>(smem + L::SA + s * SA_BYTES) + cw * 64;
                    const float sa0 = sa[r0], sa1 = sa[r0 + 8];  // read before the stage is released
                    const uint32_t a_tile = base + L::A + s * A_BYTES + cw * 64 * BK,
                                   b_tile = base + L::B + s * L::B_BYTES;
#pragma unroll
                    for (int h = 0; h < HALVES; h++) {
                        fence_regs(acc, 64);
                        wgmma_fence();
#pragma unroll
                        for (int j = 0; j < BK / 32; j++)
                            wgmma_m64n128k32_e4m3(acc, sw128_desc(a_tile + 32 * j),
                                                  sw128_desc(b_tile + h * BN * BK + 32 * j), j > 0);
                        wgmma_commit();
                        wgmma_wait_all();
                        fence_regs(acc, 64);
                        float *f = fin + 64 * h;
                        if constexpr (WGRAD) {
                            // each column has its own X scale: read from the stage, released after the promotion
                            const float *sbs =
                                reinterpret_cast<const float *>(smem + L::SB + s * L::SB_BYTES) + h * BN + c0;
#pragma unroll
                            for (int j = 0; j < 16; j++) {
                                const float2 b2 = *reinterpret_cast<const float2 *>(sbs + 8 * j);
                                f[4 * j + 0] = fmaf(acc[4 * j + 0], sa0 * b2.x, f[4 * j + 0]);
                                f[4 * j + 1] = fmaf(acc[4 * j + 1], sa0 * b2.y, f[4 * j + 1]);
                                f[4 * j + 2] = fmaf(acc[4 * j + 2], sa1 * b2.x, f[4 * j + 2]);
                                f[4 * j + 3] = fmaf(acc[4 * j + 3], sa1 * b2.y, f[4 * j + 3]);
                            }
                            __syncwarp();
                            if (h == HALVES - 1 && lane == 0) mbar_arrive(empty + 8 * s);
                        } else {
                            if (h == HALVES - 1 && lane == 0) mbar_arrive(empty + 8 * s);  // the stage's last products
                            const float s0 = sa0 * sb[h], s1 = sa1 * sb[h];
#pragma unroll
                            for (int j = 0; j < 16; j++) {
                                f[4 * j + 0] = fmaf(acc[4 * j + 0], s0, f[4 * j + 0]);
                                f[4 * j + 1] = fmaf(acc[4 * j + 1], s0, f[4 * j + 1]);
                                f[4 * j + 2] = fmaf(acc[4 * j + 2], s1, f[4 * j + 2]);
                                f[4 * j + 3] = fmaf(acc[4 * j + 3], s1, f[4 * j + 3]);
                            }
                        }
                    }
                }
            }
            const int tile_g = g, row_in_seg = mb * BM + cw * 64;
            if (u + step < n_units) {  // the next tile's first weight scales, in flight during the epilogue
                unit_coords(p, u + step, g, mb, nb);
                if constexpr (!WGRAD && !BF16) first_weight_scales<HALVES>(p, g, nb, sb_next);
            }
            if constexpr (WGRAD) {
                // dW += fin through TMA reduce-adds: the warpgroup's 64 rows in passes of PW columns staged in FP32
                // boxes of 64 rows x 32 columns (128-byte swizzle), each added into dW in L2 while the next pass (or
                // the next tile's products) runs; TMA drops what lies past dW's rows and columns
                constexpr int PW = (int)(WG_OUT / (64 * 4)), PASSES = TN / PW;
#pragma unroll
                for (int pass = 0; pass < PASSES; pass++) {
                    if (issuer) bulk_wait<true>();  // the previous adds have read the staging boxes
                    named_barrier(1 + cw, 128);
#pragma unroll
                    for (int jj = 0; jj < PW / 8; jj++) {
                        const int j = pass * (PW / 8) + jj, bc = 8 * (jj & 3) + c0;  // column within its box
                        unsigned char *box = out_ptr + (jj >> 2) * OUT_BOX_BYTES;  // 64 rows of 128 bytes too
                        const int chunk = bc >> 2, off = (bc & 3) * 4;
                        *reinterpret_cast<float2 *>(box + r0 * 128 + ((chunk ^ (r0 & 7)) << 4) + off) =
                            make_float2(fin[4 * j + 0], fin[4 * j + 1]);
                        *reinterpret_cast<float2 *>(box + (r0 + 8) * 128 + ((chunk ^ ((r0 + 8) & 7)) << 4) + off) =
                            make_float2(fin[4 * j + 2], fin[4 * j + 3]);
                    }
                    fence_proxy_async();
                    named_barrier(1 + cw, 128);
                    if (issuer) {
#pragma unroll
                        for (int b = 0; b < PW / 32; b++)
                            tma_reduce_add_2d(&p.out_map[tile_g], out + b * OUT_BOX_BYTES,
                                              tile_nb * TN + pass * PW + 32 * b, row_in_seg);
                        bulk_commit();
                    }
                }
                continue;
            }
            // epilogue: BF16 into TN / 64 boxes of 64 x 64 in TMA's 128-byte swizzle (chunk c of row r at c ^ (r % 8):
            // conflict-free), then TMA stores, which drop the rows past the segment's end
            if (issuer) bulk_wait<true>();  // the previous tile's stores have read the staging boxes
            named_barrier(1 + cw, 128);
            const int t4 = 4 * (lane & 3);
#pragma unroll
            for (int j = 0; j < 16 * HALVES; j++) {
                unsigned char *box = out_ptr + (j >> 3) * OUT_BOX_BYTES;
                const int chunk = j & 7;
                *reinterpret_cast<uint32_t *>(box + r0 * 128 + ((chunk ^ (r0 & 7)) << 4) + t4) =
                    bf16x2_bits(fin[4 * j + 0], fin[4 * j + 1]);
                *reinterpret_cast<uint32_t *>(box + (r0 + 8) * 128 + ((chunk ^ ((r0 + 8) & 7)) << 4) + t4) =
                    bf16x2_bits(fin[4 * j + 2], fin[4 * j + 3]);
            }
            fence_proxy_async();  // the generic-proxy writes above, before the TMA (async proxy) reads them
            named_barrier(1 + cw, 128);
            if (issuer && row_in_seg < p.rows[tile_g]) {
#pragma unroll
                for (int b = 0; b < TN / 64; b++)
                    tma_store_2d(&p.out_map[tile_g], out + b * OUT_BOX_BYTES, tile_nb * TN + 64 * b,
                                 row_in_seg);
                bulk_commit();
            }
        }
        if (issuer) bulk_wait<false>();  // the last stores (adds) done before the CTA's shared memory goes
    }
}

// ---------------------------------------------------------------------------- host side
static int form_chosen = FP8_GROUPED_WIDE;  // cuda_fp8_grouped_gemm_form

// Stops with "fp8_grouped_gemm.cu:<line>: <op>: <message>" for a call that breaks a documented precondition.
static void grouped_fail(int line, const char *op, const char *fmt, ...) {
    fprintf(stderr, "%s:%d: %s: ", __FILE__, line, op);
    va_list args;
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fprintf(stderr, "\n");
    exit(1);
}

static void require_aligned16(const void *p, const char *op, const char *name) {
    if ((uintptr_t)p % 16 != 0)
        grouped_fail(__LINE__, op, "%s = %p is not 16-byte aligned - expected a 16-byte aligned device pointer (TMA "
                                   "and the 16-byte output stores need it)", name, p);
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// What the launches need once per process: the driver's tensor-map encoder, the SM count, the kernels' shared memory
// limit raised.
static struct {
    int ready;
    EncodeTiledFn encode;
    int sms;
} rt;

// Raises the shared-memory limit of both tile forms (128 and 256 columns) of one kernel instance.
template <bool WGRAD, int OPS> static void allow_smem() {
    CUDA_CHECK(cudaFuncSetAttribute(fp8_grouped_gemm_kernel<WGRAD, BN, OPS>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<BN>::BYTES));
    CUDA_CHECK(cudaFuncSetAttribute(fp8_grouped_gemm_kernel<WGRAD, 2 * BN, OPS>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<2 * BN>::BYTES));
}

static void runtime_init(const char *op) {
    if (rt.ready) return;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major != 9 || prop.minor != 0)
        grouped_fail(__LINE__, op, "the GPU %s has compute capability %d.%d - expected 9.0 (Hopper: the kernel is "
                                   "sm_90a code, wgmma and TMA)", prop.name, prop.major, prop.minor);
    rt.sms = cuda_sm_count();
    void *fn = NULL;
    cudaDriverEntryPointQueryResult found;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == NULL)
        grouped_fail(__LINE__, op, "the driver has no cuTensorMapEncodeTiled (query result %d) - expected a CUDA 12+ "
                                   "driver", (int)found);
    rt.encode = (EncodeTiledFn)fn;
    allow_smem<false, OPS_FP8>();  // Fprop / Dgrad
    allow_smem<true, OPS_FP8>();   // Wgrad
    allow_smem<false, OPS_BF16>();
    allow_smem<false, OPS_BF16_B_MN>();
    rt.ready = 1;
}

// A 2D tensor map of rows x cols elements of `type` (elem_bytes each, row stride ld elements), boxes of box_cols x
// box_rows with 128-byte swizzle (box_cols x elem_bytes = 128: wgmma's layout for the operands, the staging layout
// for the output); loads past the end fill zeros, stores past the end are dropped.
static void encode_map(CUtensorMap *map, CUtensorMapDataType type, int elem_bytes, const void *base, int64_t rows,
                       int64_t cols, int64_t ld, int box_cols, int box_rows, const char *op, const char *what) {
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)(ld * elem_bytes)};
    const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows}, elem_strides[2] = {1, 1};
    const CUresult r = rt.encode(map, type, 2, const_cast<void *>(base), dims, strides, box, elem_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        grouped_fail(__LINE__, op, "cuTensorMapEncodeTiled for %s (%lld rows x %lld elements at %p) failed with "
                                   "CUresult %d", what, (long long)rows, (long long)cols, base, (int)r);
}

// One launch of the kernel instance (WGRAD, OPS) in the tile form `wide` (128 x 256) or not (128 x 128).
template <bool WGRAD, int OPS> static void launch_form(const GroupedParams &p, bool wide, dim3 grid) {
    if (wide) fp8_grouped_gemm_kernel<WGRAD, 2 * BN, OPS><<<grid, THREADS, Smem<2 * BN>::BYTES>>>(p);
    else fp8_grouped_gemm_kernel<WGRAD, BN, OPS><<<grid, THREADS, Smem<BN>::BYTES>>>(p);
}

// One launch of the kernel of `form` (FP8_GROUPED_*), the Fprop/Dgrad, (wgrad) the Wgrad or (ops) a BF16 form: one CTA
// per SM, or per unit when there are fewer.
static void launch(const GroupedParams &p, int form, bool wgrad, int ops = OPS_FP8) {
    const int n_units = p.units0[p.n_groups];
    if (n_units == 0) return;
    const bool wide = form == FP8_GROUPED_WIDE;
    const dim3 grid((unsigned)(n_units < rt.sms ? n_units : rt.sms));
    if (ops == OPS_BF16) launch_form<false, OPS_BF16>(p, wide, grid);
    else if (ops == OPS_BF16_B_MN) launch_form<false, OPS_BF16_B_MN>(p, wide, grid);
    else if (wgrad) launch_form<true, OPS_FP8>(p, wide, grid);
    else launch_form<false, OPS_FP8>(p, wide, grid);
    CUDA_CHECK_LAUNCH("fp8_grouped_gemm_kernel");
}

}  // namespace

// The form a call runs for an output of `blocks` 128-column blocks: the chosen one, or the 128 x 128 form for an odd
// count (the two-block form needs pairs of blocks).
static int form_for(int blocks) { return blocks % 2 == 0 ? form_chosen : FP8_GROUPED_SINGLE; }

extern "C" int cuda_fp8_grouped_gemm_form(int form) {
    if (form != FP8_GROUPED_SINGLE && form != FP8_GROUPED_WIDE)
        grouped_fail(__LINE__, "cuda_fp8_grouped_gemm_form",
                     "form %d - expected FP8_GROUPED_SINGLE or FP8_GROUPED_WIDE", form);
    const int previous = form_chosen;
    form_chosen = form;
    return previous;
}

extern "C" void cuda_fp8_grouped_gemm_bf16(uint16_t *y, int y_rows_padded, const uint8_t *qx, const float *sx,
                                           const uint8_t *const *qw, const float *const *sw, int n_seg,
                                           const int *rows0, int N, int K) {
    static const char op[] = "cuda_fp8_grouped_gemm_bf16";
    const SegTable seg = seg_table(op, n_seg, rows0);
    if (seg.rows0[n_seg] == 0 || N <= 0 || K <= 0) return;
    runtime_init(op);
    require_aligned16(y, op, "y"), require_aligned16(qx, op, "qx"), require_aligned16(sx, op, "sx");
    const int KB = (K + BK - 1) / BK, Kp = KB * BK, NB = (N + BN - 1) / BN, KB4 = (KB + 3) / 4 * 4;
    const int form = form_for(NB), tn = form == FP8_GROUPED_WIDE ? 2 * BN : BN;
    static GroupedParams p;  // 27 KB: not on the stack; one host thread drives the GPU (gemm.cu's rule too)
    memset(&p, 0, sizeof p);
    encode_map(&p.a[0], CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, qx, seg.p16[n_seg], Kp, Kp, BK, BM, op, "qx");
    const int Np = NB * BN;
    p.units_n = NB * BN / tn, p.kb4 = KB4;
    int n = 0;
    for (int g = 0; g < n_seg; g++) {
        const int rows = rows0[g + 1] - rows0[g];
        if (rows == 0) continue;
        if (qw[g] == NULL || sw[g] == NULL)
            grouped_fail(__LINE__, op, "segment %d has %d rows but qw[%d] = %p, sw[%d] = %p - expected its weight", g,
                         rows, g, (const void *)qw[g], g, (const void *)sw[g]);
        require_aligned16(qw[g], op, "qw[g]");
        encode_map(&p.b[n], CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, qw[g], Np, Kp, Kp, BK, tn, op, "a weight qw[g]");
        const int y_row = y_rows_padded ? seg.p16[g] : rows0[g];
        encode_map(&p.out_map[n], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, y + (size_t)y_row * Np, rows, Np, Np, 64, 64,
                   op, "a segment's rows of y");
        p.sa[n] = sx + (size_t)KB * seg.p16[g], p.sb[n] = sw[g];
        p.a_row0[n] = seg.p16[g], p.sa_ld[n] = seg.p16[g + 1] - seg.p16[g], p.kblocks[n] = KB, p.rows[n] = rows;
        p.units0[n + 1] = p.units0[n] + (rows + BM - 1) / BM * p.units_n;
        if (++n == MAX_GROUPS) {
            p.n_groups = n;
            launch(p, form, false);
            n = 0;
        }
    }
    if (n > 0) {
        p.n_groups = n;
        launch(p, form, false);
    }
}

extern "C" void cuda_fp8_grouped_wgrad(float *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt,
                                       const float *sxt, int n_seg, const int *rows0, int N, int K) {
    static const char op[] = "cuda_fp8_grouped_wgrad";
    const SegTable seg = seg_table(op, n_seg, rows0);
    if (seg.rows0[n_seg] == 0 || N <= 0 || K <= 0) return;
    runtime_init(op);
    if (N % 4 != 0 || K % 4 != 0)
        grouped_fail(__LINE__, op, "dw (N, K) = (%d, %d) - expected N and K multiples of 4 (16-byte rows of scales)",
                     N, K);
    require_aligned16(dw, op, "dw"), require_aligned16(qdyt, op, "qdyt"), require_aligned16(sdyt, op, "sdyt");
    require_aligned16(qxt, op, "qxt"), require_aligned16(sxt, op, "sxt");
    const int MB = (N + BM - 1) / BM, NB = (K + BN - 1) / BN;
    const int form = form_for(NB), tn = form == FP8_GROUPED_WIDE ? 2 * BN : BN;
    static GroupedParams p;  // 27 KB: not on the stack; one host thread drives the GPU (gemm.cu's rule too)
    memset(&p, 0, sizeof p);
    p.units_n = NB * BN / tn, p.out_rows = N, p.out_cols = K;
    int n = 0;
    for (int g = 0; g < n_seg; g++) {
        const int t0 = seg.tiles0[g], tiles = seg.tiles0[g + 1] - t0, Tp = tiles * BK;
        if (tiles == 0) continue;
        encode_map(&p.a[n], CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, qdyt + (size_t)N * BK * t0, N, Tp, Tp, BK, BM, op,
                   "a segment's dY codes qdyt");
        encode_map(&p.b[n], CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, qxt + (size_t)K * BK * t0, K, Tp, Tp, BK, tn, op,
                   "a segment's X codes qxt");
        p.sa[n] = sdyt + (size_t)N * t0, p.sb[n] = sxt + (size_t)K * t0;
        encode_map(&p.out_map[n], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, dw + (size_t)g * N * K, N, K, K, 32, 64, op,
                   "a segment's dw");
        p.a_row0[n] = 0, p.sa_ld[n] = N, p.kblocks[n] = tiles;
        p.units0[n + 1] = p.units0[n] + MB * p.units_n;
        if (++n == MAX_GROUPS) {
            p.n_groups = n;
            launch(p, form, true);
            n = 0;
        }
    }
    if (n > 0) {
        p.n_groups = n;
        launch(p, form, true);
    }
}

extern "C" void cuda_bf16_grouped_gemm(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int w_kn, int n_seg,
                                       const int *rows0, int N, int K) {
    static const char op[] = "cuda_bf16_grouped_gemm";
    if (seg_table(op, n_seg, rows0).rows0[n_seg] == 0 || N <= 0 || K <= 0) return;  // (which checks rows0)
    runtime_init(op);
    if (K % 8 != 0 || (w_kn && N % 8 != 0))
        grouped_fail(__LINE__, op, "N = %d, K = %d - expected K%s a multiple of 8 (16-byte rows of x and of the "
                                   "weights for TMA)", N, K, w_kn ? " and N" : "");
    require_aligned16(y, op, "y"), require_aligned16(x, op, "x");
    const int KE = BK / 2, KB = (K + KE - 1) / KE, NB = (N + BN - 1) / BN, Np = NB * BN;
    const int form = form_for(NB), tn = form == FP8_GROUPED_WIDE ? 2 * BN : BN;
    static GroupedParams p;  // 27 KB: not on the stack; one host thread drives the GPU (gemm.cu's rule too)
    memset(&p, 0, sizeof p);
    encode_map(&p.a[0], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, rows0[n_seg], K, K, KE, BM, op, "x");
    p.units_n = NB * BN / tn;
    int n = 0;
    for (int g = 0; g < n_seg; g++) {
        const int rows = rows0[g + 1] - rows0[g];
        if (rows == 0) continue;
        if (w[g] == NULL)
            grouped_fail(__LINE__, op, "segment %d has %d rows but w[%d] = NULL - expected its weight", g, rows, g);
        require_aligned16(w[g], op, "w[g]");
        // (N, K): boxes of 64 K x tn rows; (K, N), read MN-major: boxes of 64 output columns x 64 K rows
        if (w_kn) encode_map(&p.b[n], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w[g], K, N, N, 64, KE, op, "a weight w[g]");
        else encode_map(&p.b[n], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w[g], N, K, K, KE, tn, op, "a weight w[g]");
        // N columns of rows Np apart: TMA drops the stores past column N, so the padding columns stay untouched
        encode_map(&p.out_map[n], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, y + (size_t)rows0[g] * Np, rows, N, Np, 64, 64,
                   op, "a segment's rows of y");
        p.a_row0[n] = rows0[g], p.kblocks[n] = KB, p.rows[n] = rows;
        p.units0[n + 1] = p.units0[n] + (rows + BM - 1) / BM * p.units_n;
        if (++n == MAX_GROUPS) {
            p.n_groups = n;
            launch(p, form, false, w_kn ? OPS_BF16_B_MN : OPS_BF16);
            n = 0;
        }
    }
    if (n > 0) {
        p.n_groups = n;
        launch(p, form, false, w_kn ? OPS_BF16_B_MN : OPS_BF16);
    }
}
