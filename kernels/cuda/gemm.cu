/*
 * gemm.cu - cuBLASLt GEMMs: DeepSeek-V3's block-scaled FP8 GEMMs (kernels.h: fp8_gemm_fprop, fp8_gemm_dgrad,
 * fp8_gemm_wgrad) and the BF16 baseline (bf16_matmul_forward / bf16_matmul_backward), plus the BF16-output
 * lower level of gemm.h. DESIGN.md section 4 has the recipe; tests/gpu/test_gpu_fp8.c checks every GEMM
 * here against the CPU reference.
 *
 * cuBLASLt is column-major; a row-major (R, C) matrix is a column-major (C, R) one. So a row-major
 * Y (T, N) = X W^T is computed as the column-major Y^T (N, T) = W X^T: cuBLASLt's A is our weight-like
 * operand, B our token-like operand. On Hopper the block-scaled FP8 kernels need the "TN" layout (both
 * operands contiguous along the contraction axis, which is what the quantisers write), M and N multiples
 * of 4, and 16-byte aligned pointers. Scale layouts (cuBLASLt's, which the quantisers write):
 *   VEC128_32F    (1x128 along the contraction axis) of an operand with R rows: [ceil(K/128)][R], i.e.
 *                 outer-dimension-major;
 *   BLK128x128_32F of an operand with R rows: [ceil(R/128)][KB4], contraction-block-major, the
 *                 contraction-block count rounded up to a multiple of 4.
 * BLK x VEC (Fprop, Dgrad) and VEC x VEC (Wgrad) are supported; BLK x BLK is not.
 *
 *   GEMM   cuBLASLt A (op T), scale      cuBLASLt B (op N), scale     m x n x k      D
 *   Fprop  qw  (Np, Kp), BLK sw          qx  (T16, Kp), VEC sx        Np x T16 x Kp  BF16 (T16, Np)
 *   Dgrad  qwt (Kp, Np), BLK swt         qdy (T16, Np), VEC sdy       Kp x T16 x Np  BF16 (T16, Kp)
 *   Wgrad  qxt (K, Tp),  VEC sxt         qdyt (N, Tp), VEC sdyt       K x N x Tp     FP32 dw (N, K) +=
 * Fprop and Dgrad run on the zero-padded sizes (Np, Kp multiples of 128, T16 = T rounded up to 16, the
 * rows the 1x128 quantiser pads with zeros) so any N, K, T work. Dgrad's weight is the transposed copy qwt,
 * whose BLK scales cuBLASLt wants as [KB][NB4]; kernels.h keeps one scale array s (NB, KB4) for both
 * copies, so Dgrad first writes the transposed scales into a small scratch buffer (KB x NB4 floats) - for a
 * grouped Dgrad those of all its weights in one launch.
 *
 * Outputs: kernels.h's Fprop writes and Dgrad adds into `real` (float). cuBLASLt writes BF16 into a scratch
 * buffer and a conversion kernel copies (Dgrad: adds) the valid rows and columns to float: it reads 2 and writes 4 bytes per output element
 * (0.09 ms for an 8192 x 8192 output, 11% of the 8192^3 FP8 Fprop, measured by `fp8moe bench gemm`). The
 * grouped forms (the routed experts) run one GEMM per segment into one scratch and convert every segment in
 * one launch (the plain calls are their one-segment case);
 * gemm.h's *_bf16 functions skip it for code that keeps activations in BF16 (a later issue).
 * Wgrad writes FP32 with beta = 1 straight into the FP32 gradient (D = C = dw), or beta = 0 for a grouped Wgrad
 * with GRAD_WRITE (the step's first into a stack of gradients: no read of it); when dw is not 16-byte aligned (a
 * slice of a flat buffer) it goes to a scratch buffer and is added by a kernel (same FP32 sum, same bits).
 *
 * Runtime context: one per process (STYLE.md allows one): the cuBLASLt handle, a 32 MiB workspace per stream, a
 * cache of plans (descriptors, layouts and the heuristic's algorithm) and scratch buffers grown on demand.
 * The heuristic is asked about SIZE CLASSES, not exact sizes: m, n and k rounded up to 4 significant bits
 * (1536 stays, 1600 -> 1664; at most 8 classes per octave). A routed expert's token count changes every
 * step, so asking per exact shape meant a fresh heuristic query (tens of microseconds of host time) for
 * most expert GEMMs of every step - and a cache flush when the shapes outgrew it. A new exact shape costs
 * one cublasLtMatmulAlgoCheck of its class's algorithm (kept if supported, else the exact shape gets its
 * own heuristic query); per call the plan's layouts get the exact rows, columns and leading dimensions
 * (operands are packed: ld = stored rows). A new plan of a large GEMM times the heuristic's answers once and
 * keeps the fastest of those that compute the same bits as its first answer (tune_plan). The numbers are
 * thus a function of the shape alone, never of which shapes came first or of timing, so a resumed run
 * matches an uninterrupted one. Every call is one step of
 * the default stream: the grouped calls' GEMMs may run on several streams ("lanes", below) between a fork from and
 * a join into it, so the reuse of scratch buffers between calls is ordered; not thread-safe (one host thread drives
 * the GPU). The same algorithm for the same shape makes results bitwise
 * reproducible (no atomics: split-K variants reduce in a fixed order through the workspace).
 * Every cuBLASLt status is checked: a failure stops with file:line, the call, and the status name.
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/gemm.h"

static void lt_check_at(cublasStatus_t status, const char *call, const char *file, int line) {
    if (status == CUBLAS_STATUS_SUCCESS) return;
    fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", file, line, call, cublasLtGetStatusString(status),
            cublasLtGetStatusName(status));
    exit(1);
}
#define LT_CHECK(call) lt_check_at((call), #call, __FILE__, __LINE__)

// Stops with "gemm.cu:<line>: <op>: <message>" for a call that breaks a documented precondition.
static void gemm_fail(int line, const char *op, const char *fmt, ...) {
    fprintf(stderr, "%s:%d: %s: ", __FILE__, line, op);
    va_list args;
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fprintf(stderr, "\n");
    exit(1);
}

static inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
static inline int round_up(int a, int b) { return ceil_div(a, b) * b; }

// Largest power of two (at most 256) that divides the address: what cuBLASLt's heuristic may assume.
static int alignment_of(const void *p) {
    int a = 256;
    while (a > 1 && (uintptr_t)p % (uintptr_t)a != 0) a >>= 1;
    return a;
}

static void require_aligned16(const void *p, const char *op, const char *name) {
    if (alignment_of(p) < 16) {
        fprintf(stderr, "%s:%d: %s: %s = %p is not 16-byte aligned - expected a 16-byte aligned device pointer "
                        "(cuBLASLt block-scaled FP8 GEMMs need it)\n", __FILE__, __LINE__, op, name, p);
        exit(1);
    }
}

// ---------------------------------------------------------------------------- runtime context
static const size_t LT_WORKSPACE_BYTES = (size_t)32 << 20;
static const int NO_SCALE = -1; // scale mode of non-FP8 operands
static const int ELEMENTWISE_THREADS = 256;

// Everything that selects descriptors and an algorithm. Zero-initialised before filling (memcmp keys).
// m, n, k are the exact sizes of a call; the cache compares their size classes (size_class).
typedef struct {
    int a_type, b_type, d_type;         // cudaDataType_t; C has D's type
    int op_a, op_b;                     // cublasOperation_t
    int64_t m, n, k;                    // D is m x n (column-major), contraction k; A and B packed
    int64_t ldd;                        // D's leading dimension where it is not m (BF16 rows of bf16_rows_ld), else 0
    int a_scale_mode, b_scale_mode;     // cublasLtMatmulMatrixScale_t, or NO_SCALE
    int align_a, align_b, align_d;      // bytes
} PlanKey;

// x rounded up to 4 significant bits: the plan cache's size class of a dimension.
static int64_t size_class(int64_t x) {
    int64_t unit = 1;
    while ((x + unit - 1) / unit > 15) unit *= 2;
    return (x + unit - 1) / unit * unit;
}

static PlanKey class_of(const PlanKey *key) {
    PlanKey c = *key;
    c.m = size_class(key->m), c.n = size_class(key->n), c.k = size_class(key->k);
    c.ldd = 0;  // the class's plan is asked about packed sizes; set_exact_shape gives it the call's ld
    return c;
}

// Stored shape of A (op(A) is m x k) and B (op(B) is k x n), column-major.
static void stored_a(const PlanKey *key, uint64_t *rows, uint64_t *cols) {
    *rows = (uint64_t)(key->op_a == CUBLAS_OP_N ? key->m : key->k);
    *cols = (uint64_t)(key->op_a == CUBLAS_OP_N ? key->k : key->m);
}
static void stored_b(const PlanKey *key, uint64_t *rows, uint64_t *cols) {
    *rows = (uint64_t)(key->op_b == CUBLAS_OP_N ? key->k : key->n);
    *cols = (uint64_t)(key->op_b == CUBLAS_OP_N ? key->n : key->k);
}

static int64_t ld_of_d(const PlanKey *key) { return key->ldd != 0 ? key->ldd : key->m; }

// Gives a layout the rows, columns and leading dimension of one call.
static void set_layout_shape(cublasLtMatrixLayout_t layout, uint64_t rows, uint64_t cols, int64_t ld) {
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows));
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols));
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld));
}

typedef struct {
    PlanKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
} Plan;

// A stream and the cuBLASLt workspace that only GEMMs on that stream use (split-K algorithms keep partial sums
// there, so two streams must not share one).
typedef struct {
    cudaStream_t stream;
    void *workspace;
} Lane;

enum { MAX_PLANS = 1024, MAX_LANES = 4 };
static struct {
    cublasLtHandle_t handle;
    void *workspace;
    int n_lanes;                       // FP8MOE_GEMM_LANES (lanes_init)
    Lane lanes[MAX_LANES];             // created streams; unused when n_lanes == 1
    cudaEvent_t fork, joined[MAX_LANES];
    Scratch edge[MAX_LANES];           // a lane's segment whose padding rows would reach another lane's rows
    Plan plans[MAX_PLANS];
    int n_plans;
    Scratch out_bf16, out_f32, scale_t, operand_a, operand_b;
    Scratch tune_ref, tune_out;  // LT_TUNE_BYTES each, allocated at the first tuning (tune_plan)
    unsigned int *tune_mismatches;
} ctx;

static void lanes_init(void);

static void ctx_init(void) {
    if (ctx.handle != NULL) return;
    LT_CHECK(cublasLtCreate(&ctx.handle));
    cuda_counted_malloc(&ctx.workspace, LT_WORKSPACE_BYTES, __FILE__, __LINE__);
    lanes_init();
}

static Lane default_lane(void) { return (Lane){0, ctx.workspace}; }

static void plan_destroy(Plan *p) {
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->a));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->b));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->d));
    LT_CHECK(cublasLtMatmulDescDestroy(p->desc));
}

static void set_exact_shape(Plan *p, const PlanKey *key) {
    uint64_t rows, cols;
    stored_a(key, &rows, &cols);
    set_layout_shape(p->a, rows, cols, (int64_t)rows);
    stored_b(key, &rows, &cols);
    set_layout_shape(p->b, rows, cols, (int64_t)rows);
    set_layout_shape(p->d, (uint64_t)key->m, (uint64_t)key->n, ld_of_d(key));
}

// ---------------------------------------------------------------------------- algorithm choice
// The heuristic's first answer is not always its fastest: at 8192^3 the BF16 Wgrad's first choice ran at 694
// TFLOPS where its third ran at 785 (tests/gpu/lt_sweep.cu, 2026-11-30, H200). So a new plan of a large enough
// GEMM times the heuristic's answers once, on the call that created it (its operands, its exact shape), and
// keeps the fastest whose output has exactly the bits of the first answer's. The choice is timing, so it may
// differ between runs; the numbers may not: every candidate kept computes the same output, bit for bit, as
// the heuristic's first answer (all of lt_sweep's did: they differ in tile shape, not in summation order),
// so a resumed run still matches an uninterrupted one. (Timing while other lanes run makes the choice noisier, not the
// numbers different.) Small GEMMs (a chance agreement of a short output is
// conceivable there, and they have little to gain) and outputs above LT_TUNE_BYTES keep the first answer.
static const int LT_CANDIDATES = 8;
static const double LT_TUNE_MIN_WORK = 1073741824.0;   // m x n x k at which tuning starts (2 GFLOP)
static const size_t LT_TUNE_BYTES = (size_t)256 << 20;  // the largest output tuned (8192 x 8192 FP32)
static const int LT_TUNE_RUNS = 3;                       // timed runs per candidate (the fastest counts)

__global__ void count_differing_kernel(const uint16_t *x, const uint16_t *y, int64_t n, unsigned int *count) {
    unsigned int differ = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        differ += x[i] != y[i];
    if (differ) atomicAdd(count, differ);  // an integer count: order does not matter
}

// Runs `algo` on the plan (beta = 0, output d); returns 0, or nonzero when cuBLASLt declines it.
static int run_candidate(Plan *p, const cublasLtMatmulAlgo_t *algo, const void *a, const void *b, void *d) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(ctx.handle, p->desc, &alpha, a, p->a, b, p->b, &beta, d, p->d, d, p->d, algo, ctx.workspace,
                          LT_WORKSPACE_BYTES, 0) != CUBLAS_STATUS_SUCCESS;
}

static void tune_plan(Plan *p, const PlanKey *exact, const void *a, const void *b,
                      const cublasLtMatmulHeuristicResult_t *results, int n_results) {
    const size_t d_bytes = (size_t)exact->m * (size_t)exact->n * (exact->d_type == CUDA_R_32F ? 4 : 2);
    // (an output with gaps between its columns, ldd, would need them cleared for the comparison: not tuned; the
    // model's BF16 rows have none, their widths being multiples of 128)
    if (n_results < 2 || (double)exact->m * (double)exact->n * (double)exact->k < LT_TUNE_MIN_WORK ||
        d_bytes > LT_TUNE_BYTES || exact->ldd != 0)
        return;
    set_exact_shape(p, exact);
    void *ref = cuda_scratch(&ctx.tune_ref, LT_TUNE_BYTES), *out = cuda_scratch(&ctx.tune_out, LT_TUNE_BYTES);
    if (ctx.tune_mismatches == NULL) cuda_counted_malloc((void **)&ctx.tune_mismatches, sizeof(unsigned int), __FILE__, __LINE__);
    if (run_candidate(p, &results[0].algo, a, b, ref) != 0) return;  // the call itself will report why
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    const int64_t n16 = (int64_t)(d_bytes / 2);
    float best_ms = 0.0f, first_ms = 0.0f;
    int best = -1;
    for (int i = 0; i < n_results; i++) {
        cublasLtMatmulHeuristicResult_t check;
        memset(&check, 0, sizeof check);
        if (cublasLtMatmulAlgoCheck(ctx.handle, p->desc, p->a, p->b, p->d, p->d, &results[i].algo, &check) !=
                CUBLAS_STATUS_SUCCESS || check.workspaceSize > LT_WORKSPACE_BYTES)
            continue;
        if (i > 0) {  // the same bits as the first answer, or not a candidate
            if (run_candidate(p, &results[i].algo, a, b, out) != 0) continue;
            unsigned int differing = 0;
            CUDA_CHECK(cudaMemsetAsync(ctx.tune_mismatches, 0, sizeof differing));
            count_differing_kernel<<<grid_for(n16, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(
                (const uint16_t *)ref, (const uint16_t *)out, n16, ctx.tune_mismatches);
            CUDA_CHECK_LAUNCH("count_differing_kernel");
            CUDA_CHECK(cudaMemcpy(&differing, ctx.tune_mismatches, sizeof differing, cudaMemcpyDeviceToHost));
            if (differing != 0) continue;
        }
        float fastest = 0.0f;
        for (int r = 0; r < LT_TUNE_RUNS; r++) {
            CUDA_CHECK(cudaEventRecord(start, 0));
            if (run_candidate(p, &results[i].algo, a, b, out) != 0) break;
            CUDA_CHECK(cudaEventRecord(stop, 0));
            CUDA_CHECK(cudaEventSynchronize(stop));
            float ms = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (r == 0 || ms < fastest) fastest = ms;
        }
        if (i == 0) first_ms = fastest;
        if (fastest > 0.0f && (best < 0 || fastest < best_ms)) best = i, best_ms = fastest;
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    if (best >= 0) p->algo = results[best].algo;
    static int log_choices = -1;  // FP8MOE_GEMM_TUNE_LOG=1: one line per tuned plan on stderr (docs/gpu.md)
    if (log_choices < 0) log_choices = getenv("FP8MOE_GEMM_TUNE_LOG") != NULL && atoi(getenv("FP8MOE_GEMM_TUNE_LOG")) > 0;
    if (log_choices)
        fprintf(stderr, "gemm tune: m x n x k = %lld x %lld x %lld, types A %d D %d, ops %d %d: %d answers, kept #%d "
                        "(%.4f ms; #0 %.4f ms)\n", (long long)exact->m, (long long)exact->n, (long long)exact->k,
                exact->a_type, exact->d_type, exact->op_a, exact->op_b, n_results, best, (double)best_ms,
                (double)first_ms);
}

// The block-scaled FP8 modes need their scale pointers set on the descriptor before the heuristic query
// (it answers CUBLAS_STATUS_INVALID_VALUE otherwise), and again before each call (they change per call).
static void set_scale_pointers(cublasLtMatmulDesc_t desc, const float *a_scale, const float *b_scale) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
    LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
}

// The plan of key's sizes (created, with the heuristic asked about those sizes, when new).
static Plan *plan_for(const PlanKey *key, const PlanKey *exact, const void *a, const void *b, const float *a_scale,
                      const float *b_scale, const char *op) {
    for (int i = 0; i < ctx.n_plans; i++)
        if (memcmp(&ctx.plans[i].key, key, sizeof *key) == 0) return &ctx.plans[i];
    if (ctx.n_plans == MAX_PLANS) { // more shapes than any model has: start over
        for (int i = 0; i < ctx.n_plans; i++) plan_destroy(&ctx.plans[i]);
        ctx.n_plans = 0;
    }
    Plan *p = &ctx.plans[ctx.n_plans];
    p->key = *key;
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t op_a = key->op_a, op_b = key->op_b;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    if (key->a_scale_mode != NO_SCALE) {
        const int32_t mode_a = key->a_scale_mode, mode_b = key->b_scale_mode;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof mode_a));
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof mode_b));
        set_scale_pointers(p->desc, a_scale, b_scale);
    }
    uint64_t a_rows, a_cols, b_rows, b_cols;
    stored_a(key, &a_rows, &a_cols);
    stored_b(key, &b_rows, &b_cols);
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, (cudaDataType_t)key->a_type, a_rows, a_cols, (int64_t)a_rows));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, (cudaDataType_t)key->b_type, b_rows, b_cols, (int64_t)b_rows));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->d, (cudaDataType_t)key->d_type, (uint64_t)key->m, (uint64_t)key->n,
                                        ld_of_d(key)));

    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = LT_WORKSPACE_BYTES;
    const uint32_t al_a = (uint32_t)key->align_a, al_b = (uint32_t)key->align_b, al_d = (uint32_t)key->align_d;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d));
    cublasLtMatmulHeuristicResult_t results[LT_CANDIDATES];
    memset(results, 0, sizeof results);
    int n_results = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.handle, p->desc, p->a, p->b, p->d, p->d, pref, LT_CANDIDATES, results,
                                            &n_results));
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0) {
        fprintf(stderr, "%s:%d: %s: cuBLASLt has no algorithm for m x n x k = %lld x %lld x %lld (types A %d B %d D %d, "
                        "ops %d %d, scale modes %d %d, alignments %d %d %d) - expected a shape DESIGN.md section 4 "
                        "lists as supported\n", __FILE__, __LINE__, op, (long long)key->m, (long long)key->n,
                (long long)key->k, key->a_type, key->b_type, key->d_type, key->op_a, key->op_b, key->a_scale_mode,
                key->b_scale_mode, key->align_a, key->align_b, key->align_d);
        exit(1);
    }
    p->algo = results[0].algo;
    ctx.n_plans++;
    tune_plan(p, exact, a, b, results, n_results);
    return p;
}

// D = A B (+ beta D) through the cached plan of `key`; a_scale/b_scale are the block-scale tensors (FP8).
// Exact call shapes seen so far -> the plan that runs them: the size class's plan when its algorithm
// supports the exact shape (cublasLtMatmulAlgoCheck), else a plan of the exact shape. Either way a
// function of the shape alone. Open addressing; cleared when 3/4 full (entries are recomputable).
enum { SHAPE_SLOTS = 8192 };
static struct {
    PlanKey key[SHAPE_SLOTS];
    Plan *plan[SHAPE_SLOTS];
    int used;
} shapes;

static uint64_t key_hash(const PlanKey *key) {
    const unsigned char *b = (const unsigned char *)key;
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < sizeof *key; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static Plan *plan_for_shape(const PlanKey *key, const void *a, const void *b, const float *a_scale, const float *b_scale,
                            const char *op) {
    size_t slot = (size_t)(key_hash(key) % SHAPE_SLOTS);
    while (shapes.plan[slot] != NULL) {
        if (memcmp(&shapes.key[slot], key, sizeof *key) == 0) return shapes.plan[slot];
        slot = (slot + 1) % SHAPE_SLOTS;
    }
    const int n_plans_before = ctx.n_plans;
    const PlanKey class_key = class_of(key);
    Plan *p = plan_for(&class_key, key, a, b, a_scale, b_scale, op);
    if (memcmp(&class_key, key, sizeof *key) != 0) {
        set_exact_shape(p, key);
        cublasLtMatmulHeuristicResult_t check;
        memset(&check, 0, sizeof check);
        const cublasStatus_t status = cublasLtMatmulAlgoCheck(ctx.handle, p->desc, p->a, p->b, p->d, p->d, &p->algo,
                                                              &check);
        if (status != CUBLAS_STATUS_SUCCESS || check.workspaceSize > LT_WORKSPACE_BYTES) p = plan_for(key, key, a, b, a_scale, b_scale, op);
    }
    if (ctx.n_plans < n_plans_before || shapes.used >= SHAPE_SLOTS * 3 / 4) {  // plans flushed, or table full
        memset(&shapes, 0, sizeof shapes);
        slot = (size_t)(key_hash(key) % SHAPE_SLOTS);
    }
    shapes.key[slot] = *key;
    shapes.plan[slot] = p;
    shapes.used++;
    return p;
}

// D = A B (+ beta D) through the plan of key's shape on `lane`; a_scale/b_scale are the block-scale tensors (FP8).
static void lt_matmul(Lane lane, PlanKey *key, const void *a, const void *b, void *d, const float *a_scale,
                      const float *b_scale, float beta, const char *op) {
    ctx_init();
    key->align_a = alignment_of(a), key->align_b = alignment_of(b), key->align_d = alignment_of(d);
    Plan *p = plan_for_shape(key, a, b, a_scale, b_scale, op);
    if (key->a_scale_mode != NO_SCALE) set_scale_pointers(p->desc, a_scale, b_scale);
    set_exact_shape(p, key);
    const float alpha = 1.0f;
    LT_CHECK(cublasLtMatmul(ctx.handle, p->desc, &alpha, a, p->a, b, p->b, &beta, d, p->d, d, p->d, &p->algo,
                            lane.workspace, LT_WORKSPACE_BYTES, lane.stream));
}

// ---------------------------------------------------------------------------- lanes
// A routed-expert Linear is one GEMM per expert, each small (bench-1gpu.ini: about 3072 x 1024 x 2048, 10-30 us),
// so run one after another on one stream each GEMM's last partial wave of tiles leaves SMs idle. The grouped
// calls below therefore spread their segments over FP8MOE_GEMM_LANES streams (default DEFAULT_LANES; 1 = all on
// the default stream), each with its own workspace: the lanes wait for the default stream's work so far (fork)
// and the default stream waits for the lanes (join), so to everything else a grouped call is still one step of the
// default stream. Each GEMM writes its own rows (or its own expert's gradient) with the algorithm its shape
// selects, so the bits do not depend on the lanes or their timing. Two lanes took the expert GEMM phases of
// `fp8moe bench step` from 128 to 115 ms per step in fp8 and 232 to 222 in bf16 (H200, docs/benchmarks.md); three
// were no faster.
static const int DEFAULT_LANES = 2;

static void lanes_init(void) {
    const char *env = getenv("FP8MOE_GEMM_LANES");
    ctx.n_lanes = DEFAULT_LANES;
    if (env != NULL) {
        char *end = NULL;
        const long n = strtol(env, &end, 10);
        if (end == env || *end != '\0' || n < 1 || n > MAX_LANES) {
            fprintf(stderr, "%s:%d: FP8MOE_GEMM_LANES = '%s' - expected an integer from 1 to %d (streams for the "
                            "GEMMs of a grouped call; docs/gpu.md)\n", __FILE__, __LINE__, env, MAX_LANES);
            exit(1);
        }
        ctx.n_lanes = (int)n;
    }
    if (ctx.n_lanes == 1) return;
    CUDA_CHECK(cudaEventCreateWithFlags(&ctx.fork, cudaEventDisableTiming));
    for (int l = 0; l < ctx.n_lanes; l++) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.lanes[l].stream, cudaStreamNonBlocking));
        cuda_counted_malloc(&ctx.lanes[l].workspace, LT_WORKSPACE_BYTES, __FILE__, __LINE__);
        CUDA_CHECK(cudaEventCreateWithFlags(&ctx.joined[l], cudaEventDisableTiming));
    }
}

// The lanes a call with these segments uses: all of them when at least two segments have rows, else none (the
// call runs on the default stream: a fork and join would only add latency). lane_of says which segment goes where.
static int lanes_for(const int *prefix, int n_seg) {
    int busy = 0;
    for (int g = 0; g < n_seg && busy < 2; g++) busy += prefix[g + 1] > prefix[g];
    return busy < 2 ? 1 : ctx.n_lanes;
}

// The lane of segment g: segments go to lanes in order, in contiguous runs of about equal rows (by the midpoint of
// each segment's rows in prefix), so a lane runs its segments in row order.
static Lane lane_of(const int *prefix, int n_seg, int g, int n_lanes) {
    if (n_lanes == 1) return default_lane();
    const int64_t total = prefix[n_seg], mid2 = (int64_t)prefix[g] + prefix[g + 1];  // twice the midpoint
    const int l = (int)(mid2 * n_lanes / (2 * total));
    return ctx.lanes[l < n_lanes ? l : n_lanes - 1];
}

static int lane_index(Lane lane) {
    for (int l = 0; l < ctx.n_lanes; l++)
        if (ctx.lanes[l].stream == lane.stream) return l;
    return 0;
}

// The first output row (rows0) of the segments after g that another lane than g's runs; INT_MAX when none.
static int next_lane_row(const SegTable &seg, int g, int n_lanes) {
    const cudaStream_t mine = lane_of(seg.p16, seg.n, g, n_lanes).stream;
    for (int h = g + 1; h < seg.n; h++)
        if (seg.p16[h + 1] > seg.p16[h] && lane_of(seg.p16, seg.n, h, n_lanes).stream != mine) return seg.rows0[h];
    return INT_MAX;
}

static void lanes_fork(int n_lanes) {
    if (n_lanes == 1) return;
    CUDA_CHECK(cudaEventRecord(ctx.fork, 0));
    for (int l = 0; l < n_lanes; l++) CUDA_CHECK(cudaStreamWaitEvent(ctx.lanes[l].stream, ctx.fork, 0));
}

static void lanes_join(int n_lanes) {
    if (n_lanes == 1) return;
    for (int l = 0; l < n_lanes; l++) {
        CUDA_CHECK(cudaEventRecord(ctx.joined[l], ctx.lanes[l].stream));
        CUDA_CHECK(cudaStreamWaitEvent(0, ctx.joined[l], 0));
    }
}

static PlanKey fp8_key(int64_t m, int64_t n, int64_t k, cudaDataType_t d_type, int a_scale_mode, int b_scale_mode) {
    PlanKey key;
    memset(&key, 0, sizeof key);
    key.a_type = CUDA_R_8F_E4M3, key.b_type = CUDA_R_8F_E4M3, key.d_type = d_type;
    key.op_a = CUBLAS_OP_T, key.op_b = CUBLAS_OP_N;
    key.m = m, key.n = n, key.k = k;
    key.a_scale_mode = a_scale_mode, key.b_scale_mode = b_scale_mode;
    return key;
}

// ---------------------------------------------------------------------------- small kernels

// These are memory-bound: with VEC4 each thread moves 4 elements per step (16-byte FP32, 8-byte BF16
// accesses); the callers pick it when the sizes are multiples of 4 and the pointers aligned.

// y (rows0[n], cols) float = (or, with ADD, +=) the valid rows of x, the BF16 output of one GEMM per segment
// with row stride ld: row rows0[g] + r of y is row p16[g] + r of x (each segment's GEMM ran on its rows
// padded to 16, one after another). One segment with rows0 = {0, rows} is a plain (rows, cols) conversion.
// n_src outputs of that layout may lie one after another, src_stride elements apart (the Dgrads of Linears
// sharing an input): they are added in order after the first, y = ((y +) x_0 + x_1) + ..., the bits of one
// conversion per output. With res (rows0[n], cols) FP32 (a Fprop's residual branch), res is added last: the bits of
// add_inplace(y, res) after the conversion, without that pass.
// One warp per output row and chunk of CONV_STEPS x 32 x (1 or 4) columns: the row's segment is looked up
// once per warp (a binary search of the table, the same for all lanes) and no element index is divided.
static const int CONV_ROWS_PER_BLOCK = 8;
static const int CONV_STEPS = 4;

// v + the elements at r + c of n BF16 arrays (stride apart), added in order; 4 or 1 of them.
__device__ inline float4 add_rows4(float4 v, const uint16_t *r, int n, int64_t stride, int c) {
    for (int k = 0; k < n; k++) {
        const float4 u = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(r + k * stride + c));
        v.x = __fadd_rn(v.x, u.x), v.y = __fadd_rn(v.y, u.y), v.z = __fadd_rn(v.z, u.z), v.w = __fadd_rn(v.w, u.w);
    }
    return v;
}
__device__ inline float add_rows1(float v, const uint16_t *r, int n, int64_t stride, int c) {
    for (int k = 0; k < n; k++) v = __fadd_rn(v, bf16_bits_to_float(r[k * stride + c]));
    return v;
}
// v + the elements at xr + c of outputs 1 .. n_src - 1 (src_stride apart), added in order.
__device__ inline float4 add_sources4(float4 v, const uint16_t *xr, int n_src, int64_t src_stride, int c) {
    return add_rows4(v, xr + src_stride, n_src - 1, src_stride, c);
}
__device__ inline float add_sources1(float v, const uint16_t *xr, int n_src, int64_t src_stride, int c) {
    return add_rows1(v, xr + src_stride, n_src - 1, src_stride, c);
}

template <bool VEC4, bool ADD>
__global__ void bf16_to_float_rows_kernel(float *__restrict__ y, const uint16_t *__restrict__ x, int n_src,
                                          int64_t src_stride, const __grid_constant__ SegTable seg, int cols, int ld,
                                          const float *__restrict__ res) {
    const int per = VEC4 ? 4 : 1;
    const int row = blockIdx.x * CONV_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= seg.rows0[seg.n]) return;
    const int g = segment_of(seg.rows0, seg.n, row);
    const uint16_t *xr = x + (int64_t)(seg.p16[g] + row - seg.rows0[g]) * ld;
    float *yr = y + (int64_t)row * cols;
    const float *rr = res ? res + (int64_t)row * cols : NULL;
    const int c0 = blockIdx.y * (CONV_STEPS * 32 * per) + (threadIdx.x & 31) * per;
#pragma unroll
    for (int i = 0; i < CONV_STEPS; i++) {
        const int c = c0 + i * 32 * per;
        if (c >= cols) break;
        // ((y +) x_0) + x_1 + ... (+ res): with ADD the old value first, then the outputs in order, the residual last
        if (VEC4) {
            float4 *out = reinterpret_cast<float4 *>(yr + c);
            float4 v = bf16x4_to_float4(*reinterpret_cast<const uint2 *>(xr + c));
            if (ADD) {
                const float4 o = *out;
                v.x = __fadd_rn(o.x, v.x), v.y = __fadd_rn(o.y, v.y), v.z = __fadd_rn(o.z, v.z), v.w = __fadd_rn(o.w, v.w);
            }
            v = add_sources4(v, xr, n_src, src_stride, c);
            if (rr) {
                const float4 r = *reinterpret_cast<const float4 *>(rr + c);
                v.x = __fadd_rn(v.x, r.x), v.y = __fadd_rn(v.y, r.y), v.z = __fadd_rn(v.z, r.z), v.w = __fadd_rn(v.w, r.w);
            }
            *out = v;
        } else {
            float v = bf16_bits_to_float(xr[c]);
            if (ADD) v = __fadd_rn(yr[c], v);
            v = add_sources1(v, xr, n_src, src_stride, c);
            yr[c] = rr ? __fadd_rn(v, rr[c]) : v;
        }
    }
}

// The token-order form (kernels.h DgradUnpermute): y (n_tok, cols) row t += sum over j < topk, in order, of the
// n_src outputs' sum (in order) at row slot_of[t * topk + j] of x (bf16_to_float_rows_kernel's layout): the bits
// of that kernel writing a (rows, cols) FP32 buffer and moe_unpermute_backward reading it, without the buffer; then
// + row t of each of n_post BF16 arrays (rows of stride post_ld, post_stride apart), in order.
// One warp per token row and chunk of columns; the token's slots are looked up side by side, one lane per slot.
template <bool VEC4, bool ADD>
__global__ void bf16_unpermute_rows_kernel(float *__restrict__ y, const uint16_t *__restrict__ x, int n_src,
                                           int64_t src_stride, const __grid_constant__ SegTable seg, int cols, int ld,
                                           const int *__restrict__ slot_of, int n_tok, int topk,
                                           const uint16_t *__restrict__ post, int n_post, int64_t post_stride,
                                           int64_t post_ld) {
    const int per = VEC4 ? 4 : 1;
    const int t = blockIdx.x * CONV_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (t >= n_tok) return;
    float *yr = y + (int64_t)t * cols;
    const int c0 = blockIdx.y * (CONV_STEPS * 32 * per) + (threadIdx.x & 31) * per;
    float acc[CONV_STEPS][4];
#pragma unroll
    for (int i = 0; i < CONV_STEPS; i++) {
        const int c = c0 + i * 32 * per;
        if (c >= cols) break;
        if (!ADD) {  // GRAD_WRITE: the sum starts from zero, as on a cleared buffer
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        } else if (VEC4) {
            const float4 o = *reinterpret_cast<const float4 *>(yr + c);
            acc[i][0] = o.x, acc[i][1] = o.y, acc[i][2] = o.z, acc[i][3] = o.w;
        } else {
            acc[i][0] = yr[c];
        }
    }
    // Lane l finds slot j0 + l's row of x (its slot_of entry, then its segment), so the token's slots are looked up
    // side by side instead of one chain of loads per slot; the rows go to every lane by shuffles, and with them
    // known the data loads of consecutive slots do not wait for each other (x and y do not alias).
    const int lane = threadIdx.x & 31;
    for (int j0 = 0; j0 < topk; j0 += 32) {
        int64_t my_row = 0;
        if (j0 + lane < topk) {
            const int s = slot_of[(int64_t)t * topk + j0 + lane];
            const int g = segment_of(seg.rows0, seg.n, s);
            my_row = seg.p16[g] + s - seg.rows0[g];
        }
        const int n_j = topk - j0 < 32 ? topk - j0 : 32;
#pragma unroll 4
        for (int j = 0; j < n_j; j++) {
            const uint16_t *xr = x + __shfl_sync(0xffffffffu, my_row, j) * ld;
#pragma unroll
            for (int i = 0; i < CONV_STEPS; i++) {
                const int c = c0 + i * 32 * per;
                if (c >= cols) break;
                if (VEC4) {
                    const float4 v = add_sources4(bf16x4_to_float4(*reinterpret_cast<const uint2 *>(xr + c)), xr,
                                                  n_src, src_stride, c);
                    acc[i][0] = __fadd_rn(acc[i][0], v.x), acc[i][1] = __fadd_rn(acc[i][1], v.y);
                    acc[i][2] = __fadd_rn(acc[i][2], v.z), acc[i][3] = __fadd_rn(acc[i][3], v.w);
                } else {
                    acc[i][0] =
                        __fadd_rn(acc[i][0], add_sources1(bf16_bits_to_float(xr[c]), xr, n_src, src_stride, c));
                }
            }
        }
    }
    const uint16_t *pr = post != NULL ? post + (int64_t)t * post_ld : NULL;  // read only when n_post > 0
#pragma unroll
    for (int i = 0; i < CONV_STEPS; i++) {
        const int c = c0 + i * 32 * per;
        if (c >= cols) break;
        if (VEC4) {
            const float4 v = add_rows4(make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), pr, n_post,
                                       post_stride, c);
            *reinterpret_cast<float4 *>(yr + c) = v;
        } else {
            yr[c] = add_rows1(acc[i][0], pr, n_post, post_stride, c);
        }
    }
}

__global__ void add_float_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

// y (n) = BF16(x (n)), round-to-nearest-even.
template <bool VEC4>
__global__ void float_to_bf16_kernel(uint16_t *y, const float *x, int64_t n) {
    const int per = VEC4 ? 4 : 1;
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * per; i < n;
         i += (int64_t)gridDim.x * blockDim.x * per) {
        if (VEC4) {
            const float4 v = *reinterpret_cast<const float4 *>(x + i);
            *reinterpret_cast<uint2 *>(y + i) = make_uint2(bf16x2_bits(v.x, v.y), bf16x2_bits(v.z, v.w));
        } else {
            y[i] = bf16_bits(x[i]);
        }
    }
}

// y (n_rows, C) row r = BF16(x row rows[r]) (x (any, C)), round-to-nearest-even: a grouped call's input read
// through its row index (the routed experts' token rows), the bits of gathering then rounding.
template <bool VEC4>
__global__ void float_rows_to_bf16_kernel(uint16_t *y, const float *x, const int *rows, int64_t n_rows, int C) {
    const int per = VEC4 ? 4 : 1, units = C / per;
    const int64_t n = n_rows * units;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / units;
        const int c = (int)(i - r * units) * per;
        const float *src = x + (int64_t)rows[r] * C + c;
        uint16_t *dst = y + r * C + c;
        if (VEC4) {
            const float4 v = *reinterpret_cast<const float4 *>(src);
            *reinterpret_cast<uint2 *>(dst) = make_uint2(bf16x2_bits(v.x, v.y), bf16x2_bits(v.z, v.w));
        } else {
            *dst = bf16_bits(*src);
        }
    }
}

// The block scales of up to SCALE_T_BATCH weights of one shape, transposed in one launch. A routed-expert
// Linear's grouped Dgrad has a weight per expert and matrix, and a launch each (2-3 us apiece) came to thousands
// of launches per training step. The pointers travel in a __grid_constant__ parameter (2 KB, read from the
// constant bank; the classic 4 KB parameter limit bounds it); more weights take several launches.
enum { SCALE_T_BATCH = 256 };
struct ScaleBatch {
    int n;
    const float *sw[SCALE_T_BATCH];
};

// For w < batch.n: swt + w * stride, as (KB, NB4), [kb][nb] = batch.sw[w] (NB, KB4) [nb][kb]; columns
// NB..NB4-1 are padding, 0.
__global__ void transpose_block_scales_kernel(float *swt, int64_t stride, const __grid_constant__ ScaleBatch batch,
                                              int NB, int KB, int KB4, int NB4) {
    const int64_t per = (int64_t)KB * NB4, n = per * batch.n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int w = (int)(i / per);
        const int64_t r = i - w * per;
        const int kb = (int)(r / NB4), nb = (int)(r % NB4);
        swt[w * stride + r] = nb < NB ? batch.sw[w][(int64_t)nb * KB4 + kb] : 0.0f;
    }
}

static int vec4_ok(int64_t a, const void *p16, const void *p8) {
    return a % 4 == 0 && (uintptr_t)p16 % 16 == 0 && (uintptr_t)p8 % 8 == 0;
}

// One launch for every segment of seg and every one of n_src outputs (see bf16_to_float_rows_kernel).
template <bool ADD>
static void bf16_to_float_rows(float *y, const uint16_t *x, const SegTable &seg, int cols, int ld, int n_src = 1,
                               int64_t src_stride = 0, const float *res = NULL) {
    const int rows = seg.rows0[seg.n];
    if (rows == 0 || cols <= 0) return;
    const int per = vec4_ok(cols, y, x) && ld % 4 == 0 && src_stride % 4 == 0 && (uintptr_t)res % 16 == 0 ? 4 : 1;
    const dim3 grid((unsigned)ceil_div(rows, CONV_ROWS_PER_BLOCK), (unsigned)ceil_div(cols, CONV_STEPS * 32 * per));
    if (grid.y > 65535)
        gemm_fail(__LINE__, "bf16_to_float_rows", "%d columns - expected at most %d", cols, 65535 * CONV_STEPS * 32 * per);
    const int threads = 32 * CONV_ROWS_PER_BLOCK;
    if (per == 4) bf16_to_float_rows_kernel<true, ADD><<<grid, threads>>>(y, x, n_src, src_stride, seg, cols, ld, res);
    else bf16_to_float_rows_kernel<false, ADD><<<grid, threads>>>(y, x, n_src, src_stride, seg, cols, ld, res);
    CUDA_CHECK_LAUNCH("bf16_to_float_rows_kernel");
}

// One launch for every token (see bf16_unpermute_rows_kernel).
static void bf16_unpermute_rows(float *y, bool add, const uint16_t *x, const SegTable &seg, int cols, int ld,
                                int n_src, int64_t src_stride, const DgradUnpermute *u) {
    if (u->n_tok <= 0 || cols <= 0) return;
    if (seg.rows0[seg.n] != u->n_tok * u->topk)
        gemm_fail(__LINE__, "dgrad unpermute", "the segments hold %d rows; %d tokens x %d need exactly %d",
                  seg.rows0[seg.n], u->n_tok, u->topk, u->n_tok * u->topk);
    const int64_t post_ld = bf16_rows_ld(cols);
    const int per = vec4_ok(cols, y, x) && ld % 4 == 0 && src_stride % 4 == 0 &&
                            (u->n_post == 0 || ((uintptr_t)u->post % 8 == 0 && u->post_stride % 4 == 0))
                        ? 4
                        : 1;
    const dim3 grid((unsigned)ceil_div(u->n_tok, CONV_ROWS_PER_BLOCK), (unsigned)ceil_div(cols, CONV_STEPS * 32 * per));
    if (grid.y > 65535)
        gemm_fail(__LINE__, "bf16_unpermute_rows", "%d columns - expected at most %d", cols, 65535 * CONV_STEPS * 32 * per);
    const int threads = 32 * CONV_ROWS_PER_BLOCK;
#define UNPERMUTE_LAUNCH(V, A)                                                                                  \
    bf16_unpermute_rows_kernel<V, A><<<grid, threads>>>(y, x, n_src, src_stride, seg, cols, ld, u->slot_of, u->n_tok, \
                                                        u->topk, u->post, u->n_post, u->post_stride, post_ld)
    if (per == 4 && add) UNPERMUTE_LAUNCH(true, true);
    else if (per == 4) UNPERMUTE_LAUNCH(true, false);
    else if (add) UNPERMUTE_LAUNCH(false, true);
    else UNPERMUTE_LAUNCH(false, false);
#undef UNPERMUTE_LAUNCH
    CUDA_CHECK_LAUNCH("bf16_unpermute_rows_kernel");
}

// One segment of `rows` rows: a plain (rows, cols) conversion of x (rows, ld).
template <bool ADD>
static void bf16_to_float_plain(const char *op, float *y, const uint16_t *x, int rows, int cols, int ld) {
    const int rows0[2] = {0, rows};
    bf16_to_float_rows<ADD>(y, x, seg_table(op, 1, rows0), cols, ld);
}

extern "C" void cuda_float_to_bf16(uint16_t *dst, const float *src, int64_t n) {
    if (n <= 0) return;
    if (vec4_ok(n, src, dst))
        float_to_bf16_kernel<true><<<grid_for(n / 4, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, src, n);
    else
        float_to_bf16_kernel<false><<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, src, n);
    CUDA_CHECK_LAUNCH("float_to_bf16_kernel");
}

// y (n) = the FP32 values of the BF16 bits x (n): exact.
__global__ void bf16_widen_kernel(float *y, const uint16_t *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __uint_as_float((unsigned int)x[i] << 16);
}

extern "C" void cuda_bf16_to_float(float *dst, const uint16_t *src, int64_t n) {
    if (n <= 0) return;
    bf16_widen_kernel<<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, src, n);
    CUDA_CHECK_LAUNCH("bf16_widen_kernel");
}

extern "C" void cuda_float_rows_to_bf16(uint16_t *dst, const float *src, const int *rows, int n_rows, int C) {
    if (n_rows <= 0 || C <= 0) return;
    const int64_t n = (int64_t)n_rows * C;
    if (C % 4 == 0 && vec4_ok(n, src, dst))
        float_rows_to_bf16_kernel<true><<<grid_for(n / 4, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, src, rows,
                                                                                                       n_rows, C);
    else
        float_rows_to_bf16_kernel<false><<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dst, src, rows,
                                                                                                    n_rows, C);
    CUDA_CHECK_LAUNCH("float_rows_to_bf16_kernel");
}

// ---------------------------------------------------------------------------- FP8 GEMMs
static void check_rows16(const char *op, int T) {
    if (T % 16 != 0)
        gemm_fail(__LINE__, op, "T = %d rows is not a multiple of 16 - expected per-expert segments padded with "
                                "zero rows to a multiple of 16 (DESIGN.md section 4)", T);
}

static void fp8_gemm_fprop_bf16_on(Lane lane, uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *qw,
                                   const float *sw, int T, int N, int K) {
    static const char op[] = "fp8_gemm_fprop";
    if (T <= 0 || N <= 0 || K <= 0) return;
    check_rows16(op, T);
    require_aligned16(qx, op, "qx"), require_aligned16(sx, op, "sx"), require_aligned16(qw, op, "qw");
    require_aligned16(sw, op, "sw"), require_aligned16(y, op, "y");
    const int Np = round_up(N, FP8_TILE), Kp = round_up(K, FP8_TILE);
    PlanKey key = fp8_key(Np, T, Kp, CUDA_R_16BF, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                          CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    lt_matmul(lane, &key, qw, qx, y, sw, sx, 0.0f, op);
}

extern "C" void cuda_fp8_gemm_fprop_bf16(uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *qw,
                                         const float *sw, int T, int N, int K) {
    ctx_init();
    fp8_gemm_fprop_bf16_on(default_lane(), y, qx, sx, qw, sw, T, N, K);
}

// Floats between consecutive transposed scale arrays of (N, K) weights in one scratch: KB x NB4, a multiple of
// 4 (NB4 is), so every array starts 16-byte aligned as cuBLASLt needs of a scale pointer; the round_up keeps
// that true should the layout change.
static int64_t scale_t_stride(int N, int K) {
    return round_up(ceil_div(K, FP8_TILE) * round_up(ceil_div(N, FP8_TILE), 4), 4);
}

// swt + w * scale_t_stride(N, K) (w < n) = the transposes, as cuBLASLt's Dgrad wants them, of the block scales
// sw[w] (NB, KB4) of n (N, K) weights: ceil(n / SCALE_T_BATCH) launches.
static void transpose_block_scales(float *swt, const float *const *sw, int n, int N, int K) {
    if (n <= 0 || N <= 0 || K <= 0) return;
    const int NB = ceil_div(N, FP8_TILE), KB = ceil_div(K, FP8_TILE), KB4 = round_up(KB, 4), NB4 = round_up(NB, 4);
    const int64_t stride = scale_t_stride(N, K);
    for (int w0 = 0; w0 < n; w0 += SCALE_T_BATCH) {
        ScaleBatch batch;
        batch.n = n - w0 < SCALE_T_BATCH ? n - w0 : SCALE_T_BATCH;
        for (int w = 0; w < batch.n; w++) batch.sw[w] = sw[w0 + w];
        transpose_block_scales_kernel<<<grid_for((int64_t)KB * NB4 * batch.n, ELEMENTWISE_THREADS),
                                        ELEMENTWISE_THREADS>>>(swt + w0 * stride, stride, batch, NB, KB, KB4, NB4);
        CUDA_CHECK_LAUNCH("transpose_block_scales_kernel");
    }
}

// The Dgrad GEMM alone, on scales swt already transposed to (KB, NB4) (transpose_block_scales); otherwise
// cuda_fp8_gemm_dgrad_bf16. The grouped Dgrad transposes all its weights' scales at once and calls this.
static void fp8_gemm_dgrad_bf16_t(Lane lane, uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                                  const float *swt, int T, int N, int K) {
    static const char op[] = "fp8_gemm_dgrad";
    if (T <= 0 || N <= 0 || K <= 0) return;
    check_rows16(op, T);
    require_aligned16(qdy, op, "qdy"), require_aligned16(sdy, op, "sdy"), require_aligned16(qwt, op, "qwt");
    require_aligned16(swt, op, "swt"), require_aligned16(dx, op, "dx");
    const int Np = round_up(N, FP8_TILE), Kp = round_up(K, FP8_TILE);
    PlanKey key = fp8_key(Kp, T, Np, CUDA_R_16BF, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                          CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    lt_matmul(lane, &key, qwt, qdy, dx, swt, sdy, 0.0f, op);
}

extern "C" void cuda_fp8_gemm_dgrad_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                                         const float *sw, int T, int N, int K) {
    if (T <= 0 || N <= 0 || K <= 0) return;
    ctx_init();
    float *swt = (float *)cuda_scratch(&ctx.scale_t, sizeof(float) * (size_t)scale_t_stride(N, K));
    transpose_block_scales(swt, &sw, 1, N, K);
    fp8_gemm_dgrad_bf16_t(default_lane(), dx, qdy, sdy, qwt, swt, T, N, K);
}

// ---------------------------------------------------------------------------- the grouped GEMMs' kernel
// The grouped calls with more than one segment (the routed experts: kernels.h's fp8_gemm_fprop_grouped*,
// fp8_gemm_dgrad_grouped*) run each matrix's GEMMs over all segments as one launch of fp8moe's own grouped kernel
// (fp8_grouped_gemm.cu), or, with FP8MOE_GROUPED_GEMM=cublaslt, as one cuBLASLt GEMM per segment on the lanes.
// The Wgrads (fp8_gemm_wgrad_grouped) stay on cuBLASLt either way: the own kernel's Wgrad form
// (cuda_fp8_grouped_wgrad) measured 0.98-0.99x cuBLASLt on an H200 in its wide form, and the model's step was 1.3%
// slower with the routed experts' Wgrads on it, 3.9% with every Wgrad (docs/benchmarks.md, 2026-12-06); it is run
// only by its test and `fp8moe bench gemm`.
// Both compute each 128-deep block's tensor-core sum and promote it as fma(P, s_x s_w, acc) in block order and should
// give the same bits (tests/gpu/test_gpu_grouped_gemm.c requires it, and it held for every form on an H200 and an
// H100). The own kernel is the default: it pays no launch per segment, keeps the SMs busy across segments and, in
// its wide form (128 x 256 tiles), ran at 1.17-1.32x cuBLASLt at the bench-1gpu expert shapes, which made the fp8
// step 4.2% faster on an H100 (docs/benchmarks.md, 2026-12-06).
// One-segment calls (every other Linear) stay on cuBLASLt: on the own kernel the step was no faster (H200,
// docs/benchmarks.md, 2026-12-06).
// The BF16 grouped Fprops and Dgrads with more than one segment (bf16 mode's routed experts:
// bf16_gemm_fprop_grouped*, bf16_gemm_dgrad_grouped*) run on the kernel's BF16 forms under the same switch
// (bf16_segment_gemms); they sum in their own order, so their bits are not cuBLASLt's. The BF16 Wgrads stay one
// cuBLASLt GEMM per segment.
static int own_grouped = -1;  // -1: not yet read from FP8MOE_GROUPED_GEMM

static bool grouped_gemm_is_own(void) {
    if (own_grouped >= 0) return own_grouped;
    const char *env = getenv("FP8MOE_GROUPED_GEMM");
    if (env == NULL || !strcmp(env, "own")) own_grouped = 1;
    else if (!strcmp(env, "cublaslt")) own_grouped = 0;
    else {
        fprintf(stderr, "%s:%d: FP8MOE_GROUPED_GEMM = '%s' - expected own (the default) or cublaslt (which kernel runs "
                        "the routed experts' grouped FP8 and BF16 GEMMs; docs/gpu.md)\n", __FILE__, __LINE__, env);
        exit(1);
    }
    return own_grouped;
}

extern "C" int cuda_fp8_grouped_gemm_use_own(int enable) {
    const int previous = grouped_gemm_is_own();
    own_grouped = enable != 0;
    return previous;
}

// The BF16-output Fprop (fp8_gemm_fprop_bf16_on) or Dgrad (on transposed scales: fp8_gemm_dgrad_bf16_t) on a
// lane: out (T, ld) BF16 from a (T rows of a 1x128 operand) and b (a weight).
typedef void (*Fp8GemmBf16)(Lane lane, uint16_t *out, const uint8_t *qa, const float *sa, const uint8_t *qb,
                            const float *sb, int T, int N, int K);

// fp8_gemm_segments' GEMMs as one cuBLASLt GEMM per segment and matrix, spread over the lanes; scales[i][g] is the
// weight scale array matrix i's GEMM of segment g reads.
static void segments_on_lanes(const SegTable &seg, bool dgrad, uint16_t *tmp, int64_t per_mat, uint16_t *out_bf16,
                              int ld, int CB, int n_mats, const uint8_t *const *qa, const float *const *sa,
                              const uint8_t *const *const *qb, const float *const (*scales)[FP8_MAX_SEGMENTS],
                              int n_seg, const int *rows0, int N, int K) {
    const Fp8GemmBf16 gemm = dgrad ? fp8_gemm_dgrad_bf16_t : fp8_gemm_fprop_bf16_on;
    // Into tmp each segment writes its own padded rows p16[g].. (the lanes cannot collide); into out_bf16 a segment's
    // padding rows land on the next segment's first rows, which the next GEMM on the same lane writes later, so a
    // segment whose padding would reach the rows of a later lane writes into its lane's edge scratch, and the copy of
    // its valid rows follows it on that lane.
    const int n_lanes = lanes_for(seg.p16, n_seg);
    lanes_fork(n_lanes);
    for (int i = 0; i < n_mats; i++) {
        for (int g = 0; g < n_seg; g++) {
            const int p16 = seg.p16[g], T16 = seg.p16[g + 1] - p16;
            if (T16 == 0) continue;
            const Lane lane = lane_of(seg.p16, n_seg, g, n_lanes);
            uint16_t *dst = out_bf16 ? out_bf16 + (size_t)rows0[g] * ld : tmp + i * per_mat + (size_t)p16 * ld;
            const bool edge = out_bf16 && n_lanes > 1 && rows0[g] + T16 > next_lane_row(seg, g, n_lanes);
            uint16_t *into = edge ? (uint16_t *)cuda_scratch(&ctx.edge[lane_index(lane)], sizeof(uint16_t) * (size_t)T16 * ld)
                                  : dst;
            gemm(lane, into, qa[i] + (size_t)p16 * CB * FP8_TILE, sa[i] + (size_t)CB * p16, qb[i][g], scales[i][g], T16,
                 N, K);
            if (edge)
                CUDA_CHECK(cudaMemcpyAsync(dst, into, sizeof(uint16_t) * (size_t)(rows0[g + 1] - rows0[g]) * ld,
                                           cudaMemcpyDeviceToDevice, lane.stream));
        }
    }
    lanes_join(n_lanes);
}

// kernels.h's Fprop and Dgrad take any T and any number of segments (the routed experts: *_grouped), and the
// Dgrad several matrices. Segment g's 1x128 operand is T16_g rows (the padding rows are zero) at row p16[g]
// of qa[i], its scales at CB * p16[g] (CB = contraction blocks); matrix i's GEMM of segment g runs on all
// T16_g rows into rows p16[g].. of BF16 scratch i (row stride `out_cols` rounded up to 128, the n_mats
// scratches one after another), and ONE conversion launch keeps (adds, with `add`) the valid rows of every
// segment, summing the matrices in order. A conversion per segment cost a routed-expert Linear one launch per
// expert (about 675 launches of 9-52 us per step of a 2-layer model, ~10% of the GPU time), and one per
// matrix a full extra pass over the FP32 gradient; the GEMMs are the same, so are the bits.
// The Dgrad (`dgrad`) first transposes the block scales of every weight it uses (matrix i, non-empty segment g,
// in that order) in one launch into one scratch, at scale_t_stride apart, instead of one launch per GEMM.
// With out_bf16 (one matrix; out NULL) each segment's GEMM writes its BF16 product straight into out_bf16 at row
// rows0[g] (row stride ld), its rows padded to 16 spilling onto the next segment's first rows, which that segment's
// GEMM, later on the stream, writes over (kernels.h *_grouped_bf16: 15 rows of scratch follow the last segment), and
// nothing is converted. That is the cuBLASLt form (segments_on_lanes, FP8MOE_GROUPED_GEMM=cublaslt); by default a
// call with more than one segment runs on the own kernel instead, one launch per matrix, which writes only each
// segment's valid rows (of scratch i at p16[g], or of out_bf16 at rows0[g]), the same values.
static void fp8_gemm_segments(const char *op, bool dgrad, real *out, bool add, const DgradUnpermute *unpermute,
                              int out_cols, int contraction, int n_mats, const uint8_t *const *qa, const float *const *sa,
                              const uint8_t *const *const *qb, const float *const *const *sb, int n_seg,
                              const int *rows0, int N, int K, const real *residual = NULL, uint16_t *out_bf16 = NULL) {
    const SegTable seg = seg_table(op, n_seg, rows0);
    if (seg.rows0[n_seg] == 0 || out_cols <= 0) return;
    if (n_mats < 1 || n_mats > FP8_MAX_DGRAD_MATS || (out_bf16 != NULL && n_mats != 1))
        gemm_fail(__LINE__, op, "%d matrices - expected 1 to %d (FP8_MAX_DGRAD_MATS, kernels.h), 1 with a BF16 output",
                  n_mats, FP8_MAX_DGRAD_MATS);
    const int ld = round_up(out_cols, FP8_TILE), CB = ceil_div(contraction, FP8_TILE);
    const int64_t per_mat = (int64_t)seg.p16[n_seg] * ld;
    ctx_init();
    uint16_t *tmp = out_bf16 ? NULL : (uint16_t *)cuda_scratch(&ctx.out_bf16, sizeof(uint16_t) * (size_t)(per_mat * n_mats));
    // The Dgrad's transposed scales live in ctx.scale_t, a buffer other than tmp's; nothing below asks for
    // ctx.scale_t again (the GEMMs get fp8_gemm_dgrad_bf16_t, not the wrapper that uses it), so swt stays valid.
    float *swt = NULL;
    const int64_t swt_stride = dgrad ? scale_t_stride(N, K) : 0;
    if (dgrad) {
        const float *sw[FP8_MAX_DGRAD_MATS * FP8_MAX_SEGMENTS];
        int n_w = 0;
        for (int i = 0; i < n_mats; i++)
            for (int g = 0; g < n_seg; g++)
                if (seg.p16[g + 1] > seg.p16[g]) sw[n_w++] = sb[i][g];  // empty segments' pointers may be NULL
        swt = (float *)cuda_scratch(&ctx.scale_t, sizeof(float) * (size_t)(swt_stride * n_w));
        transpose_block_scales(swt, sw, n_w, N, K);
    }
    // The weight scales each GEMM reads: the weight's own, or the Dgrad's transposed ones (which are the scales of
    // the (K, N) weight its transposed codes form), in the order transpose_block_scales wrote them.
    const float *scales[FP8_MAX_DGRAD_MATS][FP8_MAX_SEGMENTS];
    for (int i = 0, w = 0; i < n_mats; i++)
        for (int g = 0; g < n_seg; g++)
            scales[i][g] = !dgrad ? sb[i][g] : seg.p16[g + 1] > seg.p16[g] ? swt + w++ * swt_stride : NULL;
    if (n_seg > 1 && grouped_gemm_is_own()) {
        // each matrix's segments in one launch of the own kernel, into out_bf16 at rows rows0[g] or into tmp at the
        // operand's padded rows p16[g] (where the conversion below reads them)
        for (int i = 0; i < n_mats; i++)
            cuda_fp8_grouped_gemm_bf16(out_bf16 ? out_bf16 : tmp + i * per_mat, out_bf16 == NULL, qa[i], sa[i], qb[i],
                                       scales[i], n_seg, rows0, out_cols, contraction);
    } else {
        segments_on_lanes(seg, dgrad, tmp, per_mat, out_bf16, ld, CB, n_mats, qa, sa, qb, scales, n_seg, rows0, N, K);
    }
    if (out_bf16) return;
    if (unpermute) bf16_unpermute_rows(out, add, tmp, seg, out_cols, ld, n_mats, per_mat, unpermute);
    else if (add) bf16_to_float_rows<true>(out, tmp, seg, out_cols, ld, n_mats, per_mat);
    else bf16_to_float_rows<false>(out, tmp, seg, out_cols, ld, n_mats, per_mat, residual);
}

extern "C" void cuda_fp8_gemm_fprop_grouped(real *y, const real *residual, const uint8_t *qx, const float *sx,
                                            const uint8_t *const *qw, const float *const *sw, int n_seg,
                                            const int *rows0, int N, int K) {
    fp8_gemm_segments("fp8_gemm_fprop_grouped", false, y, false, NULL, N, K, 1, &qx, &sx, &qw, &sw, n_seg, rows0, N, K,
                      residual);
}

// kernels.h fp8_gemm_fprop_grouped_bf16 and fp8_gemm_dgrad_grouped_bf16: the GEMMs straight into the BF16 array
// (fp8_gemm_segments' out_bf16; cuBLASLt's pointers stay 16-byte aligned, the row stride being a multiple of 128).
extern "C" void cuda_fp8_gemm_fprop_grouped_bf16(uint16_t *y, const uint8_t *qx, const float *sx,
                                                 const uint8_t *const *qw, const float *const *sw, int n_seg,
                                                 const int *rows0, int N, int K) {
    fp8_gemm_segments("fp8_gemm_fprop_grouped_bf16", false, NULL, false, NULL, N, K, 1, &qx, &sx, &qw, &sw, n_seg,
                      rows0, N, K, NULL, y);
}

extern "C" void cuda_fp8_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy,
                                                 const uint8_t *const *qwt, const float *const *sw, int n_seg,
                                                 const int *rows0, int N, int K) {
    fp8_gemm_segments("fp8_gemm_dgrad_grouped_bf16", true, NULL, false, NULL, K, N, 1, &qdy, &sdy, &qwt, &sw, n_seg,
                      rows0, N, K, NULL, dx);
}

extern "C" void cuda_fp8_gemm_dgrad_grouped(real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                                            const uint8_t *const *qdy, const float *const *sdy,
                                            const uint8_t *const *const *qwt, const float *const *const *sw, int n_seg,
                                            const int *rows0, int N, int K) {
    fp8_gemm_segments("fp8_gemm_dgrad_grouped", true, dx, store == GRAD_ADD, unpermute, K, N, n_mats, qdy, sdy, qwt,
                      sw, n_seg, rows0, N, K);
}

extern "C" void cuda_fp8_gemm_fprop(real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw,
                                    int T, int N, int K) {
    if (T <= 0) return;
    const int rows0[2] = {0, T};
    const uint8_t *const *qws = &qw;
    const float *const *sws = &sw;
    fp8_gemm_segments("fp8_gemm_fprop", false, y, false, NULL, N, K, 1, &qx, &sx, &qws, &sws, 1, rows0, N, K);
}

extern "C" void cuda_fp8_gemm_dgrad(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                                    const float *sw, int T, int N, int K) {
    if (T <= 0) return;
    const int rows0[2] = {0, T};
    const uint8_t *const *qwts = &qwt;
    const float *const *sws = &sw;
    fp8_gemm_segments("fp8_gemm_dgrad", true, dx, true, NULL, K, N, 1, &qdy, &sdy, &qwts, &sws, 1, rows0, N, K);
}

// On `lane`; a dw that is not 16-byte aligned goes through the shared out_f32 scratch, so only the default lane
// may be given one (cuda_fp8_gemm_wgrad_grouped checks). beta 1: dw += the product; 0: dw = the product.
static void fp8_gemm_wgrad_on(Lane lane, real *dw, float beta, const uint8_t *qdyt, const float *sdyt,
                              const uint8_t *qxt, const float *sxt, int T, int N, int K) {
    static const char op[] = "fp8_gemm_wgrad";
    if (T <= 0 || N <= 0 || K <= 0) return;
    if (N % 4 != 0 || K % 4 != 0)
        gemm_fail(__LINE__, op, "dw (N, K) = (%d, %d) - expected N and K multiples of 4 (cuBLASLt block-scaled "
                                "GEMM limit)", N, K);
    require_aligned16(qdyt, op, "qdyt"), require_aligned16(sdyt, op, "sdyt"), require_aligned16(qxt, op, "qxt");
    require_aligned16(sxt, op, "sxt");
    const int Tp = round_up(T, FP8_TILE);
    PlanKey key = fp8_key(K, N, Tp, CUDA_R_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                          CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    if (alignment_of(dw) >= 16) {
        lt_matmul(lane, &key, qxt, qdyt, dw, sxt, sdyt, beta, op);
        return;
    }
    if (lane.stream != 0) gemm_fail(__LINE__, op, "internal error: an unaligned dw on a lane other than the default");
    const int64_t n = (int64_t)N * K;
    float *tmp = (float *)cuda_scratch(&ctx.out_f32, sizeof(float) * (size_t)n);
    lt_matmul(lane, &key, qxt, qdyt, tmp, sxt, sdyt, 0.0f, op);
    if (beta == 0.0f) CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * (size_t)n, 0));  // then dw = 0 + product
    add_float_kernel<<<grid_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS>>>(dw, tmp, n);
    CUDA_CHECK_LAUNCH("add_float_kernel");
}

extern "C" void cuda_fp8_gemm_wgrad(real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt,
                                    const float *sxt, int T, int N, int K) {
    ctx_init();
    fp8_gemm_wgrad_on(default_lane(), dw, 1.0f, qdyt, sdyt, qxt, sxt, T, N, K);
}

// write (kernels.h GRAD_WRITE): the empty segments' gradients cleared on the default stream before the lanes fork,
// the others written by their GEMMs (beta 0).
static void clear_empty_segments(real *dw, const int *rows0, int n_seg, int64_t seg_elems) {
    for (int g = 0; g < n_seg; g++)
        if (rows0[g + 1] == rows0[g])
            CUDA_CHECK(cudaMemsetAsync(dw + (int64_t)g * seg_elems, 0, sizeof(float) * (size_t)seg_elems, 0));
}

// kernels.h fp8_gemm_wgrad_grouped: one Wgrad per non-empty segment, spread over the lanes (every segment has its
// own gradient, dw + g N K); all on the default stream when an expert's gradient is not 16-byte aligned.
extern "C" void cuda_fp8_gemm_wgrad_grouped(real *dw, int write, const uint8_t *qdyt, const float *sdyt,
                                            const uint8_t *qxt, const float *sxt, int n_seg, const int *rows0, int N,
                                            int K) {
    const SegTable seg = seg_table("fp8_gemm_wgrad_grouped", n_seg, rows0);
    ctx_init();
    const int n_lanes = alignment_of(dw) >= 16 && ((int64_t)N * K) % 4 == 0 ? lanes_for(seg.rows0, n_seg) : 1;
    if (write) clear_empty_segments(dw, rows0, n_seg, (int64_t)N * K);
    lanes_fork(n_lanes);
    for (int g = 0; g < n_seg; g++) {
        const int T = rows0[g + 1] - rows0[g], tiles = seg.tiles0[g];
        if (T == 0) continue;
        fp8_gemm_wgrad_on(lane_of(seg.rows0, n_seg, g, n_lanes), dw + (int64_t)g * N * K, write ? 0.0f : 1.0f,
                          qdyt + (size_t)N * FP8_TILE * tiles, sdyt + (size_t)N * tiles,
                          qxt + (size_t)K * FP8_TILE * tiles, sxt + (size_t)K * tiles, T, N, K);
    }
    lanes_join(n_lanes);
}

// ---------------------------------------------------------------------------- BF16 GEMMs
// C (M, N) row-major, its rows ldc elements apart (0: N).
static void bf16_gemm_on(Lane lane, void *c, int c_fp32, float beta, const uint16_t *a, int a_trans,
                         const uint16_t *b, int b_trans, int M, int N, int K, int ldc = 0) {
    static const char op[] = "cuda_bf16_gemm";
    if (M <= 0 || N <= 0) return;
    if (!c_fp32 && beta != 0.0f)
        gemm_fail(__LINE__, op, "beta = %g with a BF16 output (M, N, K = %d, %d, %d) - expected beta = 0 or an FP32 "
                                "output", (double)beta, M, N, K);
    if (ldc != 0 && ldc < N) gemm_fail(__LINE__, op, "ldc = %d for %d columns - expected ldc >= N (or 0)", ldc, N);
    const size_t elem = c_fp32 ? 4 : 2;
    if (K <= 0) { // empty contraction: C = beta C
        if (beta == 0.0f)
            CUDA_CHECK(cudaMemset2DAsync(c, (size_t)(ldc ? ldc : N) * elem, 0, (size_t)N * elem, (size_t)M,
                                         lane.stream));
        return;
    }
    // column-major view: C^T (N, M) = op(B)^T (N, K) op(A)^T (K, M); cuBLASLt's A is our B
    PlanKey key;
    memset(&key, 0, sizeof key);
    key.a_type = CUDA_R_16BF, key.b_type = CUDA_R_16BF, key.d_type = c_fp32 ? CUDA_R_32F : CUDA_R_16BF;
    key.op_a = b_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    key.op_b = a_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    key.m = N, key.n = M, key.k = K;
    key.ldd = ldc != 0 && ldc != N ? ldc : 0;
    key.a_scale_mode = NO_SCALE, key.b_scale_mode = NO_SCALE;
    lt_matmul(lane, &key, b, a, c, NULL, NULL, beta, op);
}

extern "C" void cuda_bf16_gemm(void *c, int c_fp32, float beta, const uint16_t *a, int a_trans, const uint16_t *b,
                               int b_trans, int M, int N, int K) {
    ctx_init();
    bf16_gemm_on(default_lane(), c, c_fp32, beta, a, a_trans, b, b_trans, M, N, K);
}

// inp (N, C), weight (OC, C) -> o (N, OC) BF16 = bf16(bf16(inp) bf16(weight)^T), FP32 accumulation.
static void bf16_matmul_forward_into(uint16_t *o, const real *inp, const real *weight, int N, int C, int OC) {
    uint16_t *a = (uint16_t *)cuda_scratch(&ctx.operand_a, sizeof(uint16_t) * (size_t)N * C);
    uint16_t *b = (uint16_t *)cuda_scratch(&ctx.operand_b, sizeof(uint16_t) * (size_t)OC * C);
    cuda_float_to_bf16(a, inp, (int64_t)N * C);
    cuda_float_to_bf16(b, weight, (int64_t)OC * C);
    cuda_bf16_gemm(o, 0, 0.0f, a, 0, b, 1, N, OC, C);
}

extern "C" void cuda_bf16_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    ctx_init();
    uint16_t *o = (uint16_t *)cuda_scratch(&ctx.out_bf16, sizeof(uint16_t) * (size_t)N * OC);
    bf16_matmul_forward_into(o, inp, weight, N, C, OC);
    bf16_to_float_plain<false>("bf16_matmul_forward", out, o, N, OC, OC);
}

// The same product left in BF16 (kernels.h bf16_matmul_forward_bf16: the output head's logits).
extern "C" void cuda_bf16_matmul_forward_bf16(uint16_t *out, const real *inp, const real *weight, int N, int C,
                                              int OC) {
    if (N <= 0 || OC <= 0) return;
    ctx_init();
    require_aligned16(out, "bf16_matmul_forward_bf16", "out");
    bf16_matmul_forward_into(out, inp, weight, N, C, OC);
}

// In the forward pass this was out = inp weight^T, so, with g = bf16(dout):
//   dinp (N, C) += bf16(g bf16(weight));  dweight (OC, C) += FP32 g^T bf16(inp).
static void bf16_matmul_backward_from(real *dinp, real *dweight, const uint16_t *g, const real *inp,
                                      const real *weight, int N, int C, int OC) {
    if (dinp != NULL) {
        uint16_t *w = (uint16_t *)cuda_scratch(&ctx.operand_b, sizeof(uint16_t) * (size_t)OC * C);
        uint16_t *o = (uint16_t *)cuda_scratch(&ctx.out_bf16, sizeof(uint16_t) * (size_t)N * C);
        cuda_float_to_bf16(w, weight, (int64_t)OC * C);
        cuda_bf16_gemm(o, 0, 0.0f, g, 0, w, 0, N, C, OC);
        bf16_to_float_plain<true>("bf16_matmul_backward", dinp, o, N, C, C);
    }
    if (dweight != NULL) {
        uint16_t *x = (uint16_t *)cuda_scratch(&ctx.operand_b, sizeof(uint16_t) * (size_t)N * C);
        cuda_float_to_bf16(x, inp, (int64_t)N * C);
        cuda_bf16_gemm(dweight, 1, 1.0f, g, 1, x, 0, OC, C, N);
    }
}

extern "C" void cuda_bf16_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp,
                                          const real *weight, int N, int C, int OC) {
    if (N <= 0 || C <= 0 || OC <= 0 || (dinp == NULL && dweight == NULL)) return;
    ctx_init();
    uint16_t *g = (uint16_t *)cuda_scratch(&ctx.operand_a, sizeof(uint16_t) * (size_t)N * OC);
    cuda_float_to_bf16(g, dout, (int64_t)N * OC);
    bf16_matmul_backward_from(dinp, dweight, g, inp, weight, N, C, OC);
}

// dout already BF16 (kernels.h bf16_matmul_backward_bf16: the output head's logits' gradient).
extern "C" void cuda_bf16_matmul_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                                               const real *weight, int N, int C, int OC) {
    if (N <= 0 || C <= 0 || OC <= 0 || (dinp == NULL && dweight == NULL)) return;
    ctx_init();
    require_aligned16(dout, "bf16_matmul_backward_bf16", "dout");
    bf16_matmul_backward_from(dinp, dweight, dout, inp, weight, N, C, OC);
}

// kernels.h's BF16 GEMMs on pre-rounded operands (train/linear.c's bf16 mode): segment g's rows of a[i] (packed,
// one segment after another) through weight w[i][g], one GEMM per non-empty segment and matrix, over the lanes, into
// the same rows of BF16 array i (n_mats arrays per_mat elements apart, rows of bf16_rows_ld(out_cols): the layout
// of kernels.h's *_grouped_bf16, so the FP32 forms below and the BF16 ones run the same GEMMs, the same bits). The
// segments cover rows [0, rows0[n_seg]). The GEMM calls are those of bf16_matmul_forward / _backward.
static int segment_rows(const char *op, int n_seg, const int *rows0) {
    for (int g = 0; g < n_seg; g++)  // any number of segments: no table reaches the GPU here
        if (rows0[0] != 0 || rows0[g + 1] < rows0[g])
            gemm_fail(__LINE__, op, "rows0[0] = %d, segment %d has rows %d..%d - expected rows0[0] = 0 and rows0 "
                                    "non-decreasing", rows0[0], g, rows0[g], rows0[g + 1]);
    return n_seg > 0 ? rows0[n_seg] : 0;
}

// Whether the own kernel can run a BF16 Fprop or Dgrad of several segments (fp8_grouped_gemm.h
// cuda_bf16_grouped_gemm: TMA needs 16-byte rows and 16-byte aligned operands).
static bool bf16_segments_fit_own(const uint16_t *out, int64_t per_mat, int n_mats, const uint16_t *const *a,
                                  const uint16_t *const *const *w, int n_seg, const int *rows0, int N, int K) {
    if (n_seg < 2 || !grouped_gemm_is_own() || N % 8 != 0 || K % 8 != 0) return false;
    for (int i = 0; i < n_mats; i++) {
        if (alignment_of(a[i]) < 16 || alignment_of(out + i * per_mat) < 16) return false;
        for (int g = 0; g < n_seg; g++)
            if (rows0[g + 1] > rows0[g] && alignment_of(w[i][g]) < 16) return false;
    }
    return true;
}

// By default a call of several segments runs on the own grouped kernel (one launch for all segments per matrix, its
// own summation order: fp8_grouped_gemm.h; the Dgrad reads the (N, K) weight MN-major), everything else one cuBLASLt
// GEMM per segment over the lanes. Both forms of kernels.h (FP32 and *_bf16) come through here, so they get the
// same bits.
static void bf16_segment_gemms(bool dgrad, uint16_t *out, int64_t per_mat, int n_mats, const uint16_t *const *a,
                               const uint16_t *const *const *w, int n_seg, const int *rows0, int N, int K) {
    const int out_cols = dgrad ? K : N, in_cols = dgrad ? N : K, ld = (int)bf16_rows_ld(out_cols);
    if (bf16_segments_fit_own(out, per_mat, n_mats, a, w, n_seg, rows0, N, K)) {
        for (int i = 0; i < n_mats; i++)
            cuda_bf16_grouped_gemm(out + i * per_mat, a[i], w[i], dgrad, n_seg, rows0, out_cols, in_cols);
        return;
    }
    const int n_lanes = lanes_for(rows0, n_seg);  // each segment writes its own rows
    lanes_fork(n_lanes);
    for (int i = 0; i < n_mats; i++) {
        for (int g = 0; g < n_seg; g++) {
            const int r0 = rows0[g], n = rows0[g + 1] - rows0[g];
            if (n <= 0) continue;
            bf16_gemm_on(lane_of(rows0, n_seg, g, n_lanes), out + i * per_mat + (size_t)r0 * ld, 0, 0.0f,
                         a[i] + (size_t)r0 * in_cols, 0, w[i][g], dgrad ? 0 : 1, n, out_cols, in_cols, ld);
        }
    }
    lanes_join(n_lanes);
}

// The FP32 forms: the GEMMs into BF16 scratch, then ONE conversion (Dgrad with GRAD_ADD: one add) of all rows and
// matrices, summed in order of i.
template <bool DGRAD>
static void bf16_gemm_segments(const char *op, real *out, bool add, const DgradUnpermute *unpermute, int n_mats,
                               const uint16_t *const *a, const uint16_t *const *const *w, int n_seg, const int *rows0,
                               int N, int K, const real *residual = NULL) {
    const int rows = segment_rows(op, n_seg, rows0), out_cols = DGRAD ? K : N;
    if (rows == 0 || out_cols <= 0) return;
    const int ld = (int)bf16_rows_ld(out_cols);
    const int64_t per_mat = ((int64_t)rows * ld + 7) / 8 * 8;  // each scratch 16-byte aligned
    ctx_init();
    uint16_t *tmp = (uint16_t *)cuda_scratch(&ctx.out_bf16, sizeof(uint16_t) * (size_t)(per_mat * n_mats));
    bf16_segment_gemms(DGRAD, tmp, per_mat, n_mats, a, w, n_seg, rows0, N, K);
    const int rows0_all[2] = {0, rows};
    const SegTable seg = seg_table(op, 1, rows0_all);
    if (unpermute) bf16_unpermute_rows(out, add, tmp, seg, out_cols, ld, n_mats, per_mat, unpermute);
    else if (add) bf16_to_float_rows<true>(out, tmp, seg, out_cols, ld, n_mats, per_mat);
    else bf16_to_float_rows<false>(out, tmp, seg, out_cols, ld, n_mats, per_mat, residual);
}

extern "C" void cuda_bf16_gemm_fprop_grouped(real *y, const real *residual, const uint16_t *x, const uint16_t *const *w,
                                             int n_seg, const int *rows0, int N, int K) {
    bf16_gemm_segments<false>("bf16_gemm_fprop_grouped", y, false, NULL, 1, &x, &w, n_seg, rows0, N, K, residual);
}

extern "C" void cuda_bf16_gemm_dgrad_grouped(real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                                             const uint16_t *const *dy, const uint16_t *const *const *w, int n_seg,
                                             const int *rows0, int N, int K) {
    bf16_gemm_segments<true>("bf16_gemm_dgrad_grouped", dx, store == GRAD_ADD, unpermute, n_mats, dy, w, n_seg, rows0,
                             N, K);
}

// The BF16 forms: straight into the caller's array, nothing converted.
extern "C" void cuda_bf16_gemm_fprop_grouped_bf16(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                                  const int *rows0, int N, int K) {
    if (segment_rows("bf16_gemm_fprop_grouped_bf16", n_seg, rows0) == 0 || N <= 0) return;
    ctx_init();
    bf16_segment_gemms(false, y, 0, 1, &x, &w, n_seg, rows0, N, K);
}

extern "C" void cuda_bf16_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                                  const int *rows0, int N, int K) {
    if (segment_rows("bf16_gemm_dgrad_grouped_bf16", n_seg, rows0) == 0 || K <= 0) return;
    ctx_init();
    bf16_segment_gemms(true, dx, 0, 1, &dy, &w, n_seg, rows0, N, K);
}

extern "C" void cuda_bf16_gemm_wgrad(real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K) {
    if (T <= 0 || N <= 0 || K <= 0) return;
    cuda_bf16_gemm(dw, 1, 1.0f, dy, 1, x, 0, N, K, T);
}

// kernels.h bf16_gemm_wgrad_grouped: one Wgrad per non-empty segment (its own gradient dw + g N K), over the lanes.
extern "C" void cuda_bf16_gemm_wgrad_grouped(real *dw, int write, const uint16_t *dy, const uint16_t *x, int n_seg,
                                             const int *rows0, int N, int K) {
    if (N <= 0 || K <= 0) return;
    ctx_init();
    const int n_lanes = lanes_for(rows0, n_seg);
    if (write) clear_empty_segments(dw, rows0, n_seg, (int64_t)N * K);
    lanes_fork(n_lanes);
    for (int g = 0; g < n_seg; g++) {
        const int r0 = rows0[g], T = rows0[g + 1] - rows0[g];
        if (T > 0)
            bf16_gemm_on(lane_of(rows0, n_seg, g, n_lanes), dw + (int64_t)g * N * K, 1, write ? 0.0f : 1.0f,
                         dy + (size_t)r0 * N, 1, x + (size_t)r0 * K, 0, N, K, T);
    }
    lanes_join(n_lanes);
}
