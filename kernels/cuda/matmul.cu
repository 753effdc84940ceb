/*
 * matmul.cu - FP32 GEMMs behind matmul_forward / matmul_backward (kernels.h) on the GPU, through cuBLASLt:
 * the Linears that stay FP32 (the router gate, and every Linear when precision = fp32). Same function as
 * kernels/cpu/matmul.c; checked against it by tests/gpu/test_gpu_model_ops.c.
 *
 * Numerics: FP32 A, B, C, D with CUBLAS_COMPUTE_32F, i.e. true FP32 multiply-adds. cuBLASLt uses TF32 or
 * BF16x9 emulation only when asked (compute type CUBLAS_COMPUTE_32F_FAST_TF32 / _EMULATED_16BFX9, or an
 * emulation descriptor); none is set here, and the parity test's tolerance (sqrt(K)-sized FP32 rounding)
 * would catch TF32's 2^-11 errors. The result differs from the CPU's only by summation order and FMA.
 *
 * Determinism: the algorithm heuristic is asked only for algorithms with CUBLASLT_REDUCTION_SCHEME_NONE and
 * is given no workspace, which rules out split-K and stream-K (partial sums of one output element combined
 * across thread blocks, through the workspace or in place); each output element is then reduced inside one
 * thread block in a fixed order. The algorithm is chosen once per shape/alignment key and cached, so the same
 * call gives the same bits on every run. Narrow weight gradients (the router gate's) are split over token
 * chunks by this file instead, with a fixed-order sum of the chunks (dweight_in_chunks).
 *
 * Layouts: cuBLASLt is column-major; a row-major (R, C) matrix is a column-major (C, R) one. So
 *   forward  out (N, OC) = inp weight^T     is  out^T (OC, N)   = weight^T(op T) inp^T           m,n,k = OC, N, C
 *   dinp    (N, C)  += dout weight         is  dinp^T (C, N)  += weight^T(op N) dout^T          m,n,k = C, N, OC
 *   dweight (OC, C) += dout^T inp          is  dweight^T (C, OC) += inp^T(op N) dout(op T)      m,n,k = C, OC, N
 * with leading dimensions the row lengths of the row-major buffers. The backward adds with beta = 1 into the
 * gradient (C = D = the gradient buffer).
 *
 * Runtime context: its own cuBLASLt handle and plan cache (gemm.cu's context is private to that file and its
 * gemm.h interface offers BF16 operands only). Not thread-safe; all work on the default stream.
 */
#include <cublasLt.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/common.cuh"

static void lt_check_at(cublasStatus_t status, const char *call, const char *file, int line) {
    if (status == CUBLAS_STATUS_SUCCESS) return;
    fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", file, line, call, cublasLtGetStatusString(status),
            cublasLtGetStatusName(status));
    exit(1);
}
#define LT_CHECK(call) lt_check_at((call), #call, __FILE__, __LINE__)

// Largest power of two (at most 256) that divides the address: what the heuristic may assume.
static int alignment_of(const void *p) {
    int a = 256;
    while (a > 1 && (uintptr_t)p % (uintptr_t)a != 0) a >>= 1;
    return a;
}

// ---------------------------------------------------------------------------- plans
// Everything that selects the descriptors and the algorithm. Zeroed before filling (compared with memcmp).
typedef struct {
    int op_a, op_b; // cublasOperation_t
    int64_t m, n, k, lda, ldb, ldd;
    int64_t batch, stride_a, stride_b, stride_d; // batch = 0: one GEMM; else that many, strided (elements)
    int align_a, align_b, align_d; // bytes
} SgemmKey;

typedef struct {
    SgemmKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
} SgemmPlan;

enum { MAX_SGEMM_PLANS = 128 };
static struct {
    cublasLtHandle_t handle;
    SgemmPlan plans[MAX_SGEMM_PLANS];
    int n_plans;
} sgemm;

static void plan_destroy(SgemmPlan *p) {
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->a));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->b));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->d));
    LT_CHECK(cublasLtMatmulDescDestroy(p->desc));
}

static SgemmPlan *plan_for(const SgemmKey *key, const char *op) {
    if (sgemm.handle == NULL) LT_CHECK(cublasLtCreate(&sgemm.handle));
    for (int i = 0; i < sgemm.n_plans; i++)
        if (memcmp(&sgemm.plans[i].key, key, sizeof *key) == 0) return &sgemm.plans[i];
    if (sgemm.n_plans == MAX_SGEMM_PLANS) { // more shapes than any model has: start over
        for (int i = 0; i < sgemm.n_plans; i++) plan_destroy(&sgemm.plans[i]);
        sgemm.n_plans = 0;
    }
    SgemmPlan *p = &sgemm.plans[sgemm.n_plans];
    p->key = *key;
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t op_a = key->op_a, op_b = key->op_b;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    // stored shapes: op(A) is m x k, op(B) is k x n
    const int64_t a_rows = key->op_a == CUBLAS_OP_N ? key->m : key->k, a_cols = key->op_a == CUBLAS_OP_N ? key->k : key->m;
    const int64_t b_rows = key->op_b == CUBLAS_OP_N ? key->k : key->n, b_cols = key->op_b == CUBLAS_OP_N ? key->n : key->k;
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_32F, (uint64_t)a_rows, (uint64_t)a_cols, key->lda));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_32F, (uint64_t)b_rows, (uint64_t)b_cols, key->ldb));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, (uint64_t)key->m, (uint64_t)key->n, key->ldd));
    if (key->batch > 0) {
        const int32_t count = (int32_t)key->batch;
        const cublasLtMatrixLayout_t layouts[3] = {p->a, p->b, p->d};
        const int64_t strides[3] = {key->stride_a, key->stride_b, key->stride_d};
        for (int i = 0; i < 3; i++) {
            LT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
            LT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                                      sizeof strides[i]));
        }
    }

    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t no_workspace = 0;
    const uint32_t no_split_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    const uint32_t al_a = (uint32_t)key->align_a, al_b = (uint32_t)key->align_b, al_d = (uint32_t)key->align_d;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof no_workspace));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split_reduction, sizeof no_split_reduction));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d));
    cublasLtMatmulHeuristicResult_t result;
    memset(&result, 0, sizeof result);
    int n_results = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(sgemm.handle, p->desc, p->a, p->b, p->d, p->d, pref, 1, &result, &n_results);
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) LT_CHECK(status); // NOT_SUPPORTED: no algorithm, reported below
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || n_results == 0) {
        fprintf(stderr, "%s:%d: %s: cuBLASLt has no FP32 algorithm without split-K reduction and workspace for "
                        "m x n x k = %lld x %lld x %lld (ops %d %d, ld %lld %lld %lld, alignments %d %d %d bytes) - "
                        "expected every FP32 shape to have one\n", __FILE__, __LINE__, op, (long long)key->m,
                (long long)key->n, (long long)key->k, key->op_a, key->op_b, (long long)key->lda, (long long)key->ldb,
                (long long)key->ldd, key->align_a, key->align_b, key->align_d);
        exit(1);
    }
    p->algo = result.algo;
    sgemm.n_plans++;
    return p;
}

// Column-major D (m, n) = op(A) op(B) + beta D through the cached plan of this shape and alignment; with
// batch > 0, that many such GEMMs, operand i at a + i stride_a, b + i stride_b, d + i stride_d.
static void sgemm_run_batched(int op_a, int op_b, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                              const float *b, int64_t ldb, float *d, int64_t ldd, float beta, int64_t batch,
                              int64_t stride_a, int64_t stride_b, int64_t stride_d, const char *op) {
    SgemmKey key;
    memset(&key, 0, sizeof key);
    key.op_a = op_a, key.op_b = op_b, key.m = m, key.n = n, key.k = k, key.lda = lda, key.ldb = ldb, key.ldd = ldd;
    key.batch = batch, key.stride_a = stride_a, key.stride_b = stride_b, key.stride_d = stride_d;
    // every batch's operand must have the alignment the heuristic is told
    key.align_a = alignment_of(a + stride_a), key.align_b = alignment_of(b + stride_b), key.align_d = alignment_of(d + stride_d);
    if (alignment_of(a) < key.align_a) key.align_a = alignment_of(a);
    if (alignment_of(b) < key.align_b) key.align_b = alignment_of(b);
    if (alignment_of(d) < key.align_d) key.align_d = alignment_of(d);
    SgemmPlan *p = plan_for(&key, op);
    const float alpha = 1.0f;
    LT_CHECK(cublasLtMatmul(sgemm.handle, p->desc, &alpha, a, p->a, b, p->b, &beta, d, p->d, d, p->d, &p->algo, NULL,
                            0, 0));
}

static void sgemm_run(int op_a, int op_b, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                      int64_t ldb, float *d, int64_t ldd, float beta, const char *op) {
    sgemm_run_batched(op_a, op_b, m, n, k, a, lda, b, ldb, d, ldd, beta, 0, 0, 0, 0, op);
}

// ---------------------------------------------------------------------------- narrow weight gradients
// The router gate's weight gradient, (E, D) = 32 x 2048 from N = 16384 tokens, has few output tiles and a
// long contraction: each tile's thread block runs through all N tokens while most SMs idle (0.57 ms for
// 2 GFLOP on an H200, ncu, tests/gpu/kernel_profile.sh). Split-K would fill the GPU, but cuBLASLt's is ruled
// out above. So the tokens are split here instead, a function of the shape alone: SPLIT_CHUNKS strided
// GEMMs write partial gradients over consecutive token chunks (the last CHUNK_REMAINDER rows go to one more
// partial), and one kernel adds them to the gradient in chunk order. Deterministic; the sum order differs
// from one long contraction only as any blocking does (the parity test's FP32 tolerance).
static const int64_t SPLIT_MAX_OUTPUT = (int64_t)1 << 18;  // at most this many gradient elements
static const int64_t SPLIT_MIN_TOKENS = 4096;              // and at least this many tokens
static const int SPLIT_CHUNKS = 16;
static Scratch split_partials;

__global__ void add_partials_kernel(float *dw, const float *partials, int n_partials, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float acc = dw[i];
        for (int s = 0; s < n_partials; s++) acc = __fadd_rn(acc, partials[(int64_t)s * n + i]);
        dw[i] = acc;
    }
}

// dweight (OC, C) += dout^T (OC, N) @ inp (N, C) in token chunks (column-major: dweight^T (C, OC)).
static void dweight_in_chunks(real *dweight, const real *dout, const real *inp, int N, int C, int OC) {
    const int64_t chunk = N / SPLIT_CHUNKS, rest = N - chunk * SPLIT_CHUNKS, n = (int64_t)C * OC;
    const int n_partials = SPLIT_CHUNKS + (rest > 0);
    float *partials = (float *)cuda_scratch(&split_partials, sizeof(float) * (size_t)n * n_partials);
    sgemm_run_batched(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, chunk, inp, C, dout, OC, partials, C, 0.0f, SPLIT_CHUNKS,
                      chunk * C, chunk * OC, n, "matmul_backward (dweight, token chunks)");
    if (rest > 0)
        sgemm_run(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, rest, inp + SPLIT_CHUNKS * chunk * C, C,
                  dout + SPLIT_CHUNKS * chunk * OC, OC, partials + SPLIT_CHUNKS * n, C, 0.0f,
                  "matmul_backward (dweight, last tokens)");
    add_partials_kernel<<<grid_for(n, 256), 256>>>(dweight, partials, n_partials, n);
    CUDA_CHECK_LAUNCH("add_partials_kernel");
}

// ---------------------------------------------------------------------------- ops
// inp (N, C), weight (OC, C) -> out (N, OC) = inp @ weight^T.
extern "C" void cuda_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    if (C <= 0) { // empty contraction
        CUDA_CHECK(cudaMemset(out, 0, sizeof(float) * (size_t)N * OC));
        return;
    }
    sgemm_run(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, OC, 0.0f, "matmul_forward");
}

// In the forward pass this was out (N, OC) = inp (N, C) @ weight (OC, C)^T, so:
//   dinp (N, C) += dout (N, OC) @ weight (OC, C);   dweight (OC, C) += dout^T (OC, N) @ inp (N, C).
// Either gradient may be NULL (skipped).
extern "C" void cuda_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                                     int N, int C, int OC) {
    if (N <= 0 || C <= 0 || OC <= 0) return; // every gradient is empty or receives an empty sum
    if (dinp != NULL) sgemm_run(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C, 1.0f, "matmul_backward (dinp)");
    if (dweight == NULL) return;
    if ((int64_t)C * OC <= SPLIT_MAX_OUTPUT && N >= SPLIT_MIN_TOKENS) dweight_in_chunks(dweight, dout, inp, N, C, OC);
    else sgemm_run(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, C, 1.0f, "matmul_backward (dweight)");
}
