/*
 * lt_sweep.cu - a diagnostic for issue 3's sustained Wgrad and BF16 Dgrad: times every algorithm cuBLASLt's
 * heuristic offers (up to 32) for the Wgrad of kernels/cuda/gemm.cu at M x N x K (default 8192^3), in FP8 (E4M3,
 * 1x128 scales on both operands, FP32 D accumulated with beta = 1, as cuda_fp8_gemm_wgrad runs it) and in
 * BF16 (FP32 D, beta = 1, as the BF16 mode's Wgrad), and for the BF16 Dgrad (NN, BF16 D, as fp8moe runs
 * dy @ w; and TN, the same product from a transposed weight), and says for each whether its output has the
 * same bits as the heuristic's first choice (which fp8moe uses). Standalone on purpose: it asks cuBLASLt for
 * algorithms fp8moe never picks, so it does not belong in the library.
 *
 *   nvcc -O2 -arch=sm_90 -o lt_sweep tests/gpu/lt_sweep.cu -lcublasLt && ./lt_sweep [M N K] [runs]
 *
 * Method as `fp8moe bench gemm`: per algorithm 5 warm-ups then the median of `runs` (default 50) timed
 * with CUDA events, back to back (the GPU is never idle between algorithms, so clocks are the
 * sustained ones). Inputs are random (not zeros): FP8 bytes with the sign and exponent ranges of
 * typical data, scales near 1.
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d: %s: status %d\n", __FILE__, __LINE__, #x, (int)s_); exit(1); } } while (0)

static const size_t WS = (size_t)32 << 20;  // fp8moe's workspace (kernels/cuda/gemm.cu)
static const int MAX_ANSWERS = 32;         // more than fp8moe asks for (8): what else is there

__global__ void fill_bytes(uint8_t *p, size_t n, uint32_t seed, int fp8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        // FP8: exponent field 3..12 (no NaN); BF16 bytes: keep the high byte in a sane exponent range
        p[i] = fp8 ? (uint8_t)((h & 0x80) | (((h >> 8) % 10 + 3) << 3) | ((h >> 16) & 7))
                   : (i & 1) ? (uint8_t)((h & 0x80) | (0x3C + (h >> 8) % 4)) : (uint8_t)(h >> 16);
    }
}
__global__ void fill_scales(float *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = 0.5f + (float)(((uint32_t)i * 2654435761u ^ seed) % 1024) / 1024.0f;
}

static int attr(const cublasLtMatmulAlgo_t *algo, cublasLtMatmulAlgoConfigAttributes_t a) {
    int v = -1;
    size_t written = 0;
    uint32_t u = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(algo, a, &u, sizeof u, &written) == CUBLAS_STATUS_SUCCESS) v = (int)u;
    return v;
}

// D (M x N, column-major) = op(A) op(B); TN (op_a = T, op_b = N: A stored K x M, B stored K x N) is the Wgrad
// and Fprop layout of gemm.cu, NN (A stored M x K) the BF16 Dgrad's. D is FP32 accumulated with beta = 1, or
// BF16 written with beta = 0 (d_bf16, the Dgrad's output).
static void sweep(const char *name, int fp8, int op_a, int d_bf16, int64_t M, int64_t N, int64_t K, int runs,
                  cublasLtHandle_t h, void *ws) {
    const size_t ebytes = fp8 ? 1 : 2;
    uint8_t *a, *b;
    float *d, *d_ref, *d_try, *sa = NULL, *sb = NULL;
    CK(cudaMalloc(&a, (size_t)M * K * ebytes));
    CK(cudaMalloc(&b, (size_t)N * K * ebytes));
    CK(cudaMalloc(&d, (size_t)M * N * 4));
    CK(cudaMalloc(&d_ref, (size_t)M * N * 4));
    CK(cudaMalloc(&d_try, (size_t)M * N * 4));
    fill_bytes<<<1024, 256>>>(a, (size_t)M * K * ebytes, 1u, fp8);
    fill_bytes<<<1024, 256>>>(b, (size_t)N * K * ebytes, 2u, fp8);
    CK(cudaMemset(d, 0, (size_t)M * N * 4));
    cublasLtMatmulDesc_t desc;
    LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t op_t = op_a, op_n = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    if (fp8) {
        const size_t ns_a = (size_t)M * ((K + 127) / 128), ns_b = (size_t)N * ((K + 127) / 128);
        CK(cudaMalloc(&sa, ns_a * 4));
        CK(cudaMalloc(&sb, ns_b * 4));
        fill_scales<<<256, 256>>>(sa, ns_a, 3u);
        fill_scales<<<256, 256>>>(sb, ns_b, 4u);
        const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
    }
    const cudaDataType_t t = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    cublasLtMatrixLayout_t la, lb, ld;
    if (op_a == CUBLAS_OP_T) LK(cublasLtMatrixLayoutCreate(&la, t, K, M, K));
    else LK(cublasLtMatrixLayoutCreate(&la, t, M, K, M));
    LK(cublasLtMatrixLayoutCreate(&lb, t, K, N, K));
    LK(cublasLtMatrixLayoutCreate(&ld, d_bf16 ? CUDA_R_16BF : CUDA_R_32F, M, N, M));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t wsb = WS;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[MAX_ANSWERS];
    int n_res = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, MAX_ANSWERS, res, &n_res));
    printf("%s  M x N x K = %lld x %lld x %lld, %s, D %s: %d algorithms\n", name, (long long)M, (long long)N,
           (long long)K, op_a == CUBLAS_OP_T ? "TN" : "NN", d_bf16 ? "BF16 beta = 0" : "FP32 beta = 1", n_res);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float one = 1.0f, zero = 0.0f, beta = d_bf16 ? 0.0f : 1.0f;
    const size_t dbytes = d_bf16 ? 2 : 4;
    for (int i = 0; i < n_res; i++) {
        const cublasLtMatmulAlgo_t *al = &res[i].algo;
        // bits: beta = 0 into d_try, compared with the first algorithm's
        float *dst = i == 0 ? d_ref : d_try;
        if (cublasLtMatmul(h, desc, &one, a, la, b, lb, &zero, dst, ld, dst, ld, al, ws, WS, 0) != CUBLAS_STATUS_SUCCESS) {
            printf("  #%-2d fails to run\n", i);
            continue;
        }
        CK(cudaDeviceSynchronize());
        int same = 1;
        if (i > 0) {
            std::vector<uint8_t> x((size_t)M * N * dbytes), y((size_t)M * N * dbytes);
            CK(cudaMemcpy(x.data(), d_ref, x.size(), cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(y.data(), d_try, y.size(), cudaMemcpyDeviceToHost));
            same = memcmp(x.data(), y.data(), x.size()) == 0;
        }
        std::vector<float> ms(runs);
        for (int r = 0; r < 5 + runs; r++) {
            CK(cudaEventRecord(e0));
            LK(cublasLtMatmul(h, desc, &one, a, la, b, lb, &beta, d, ld, d, ld, al, ws, WS, 0));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            if (r >= 5) CK(cudaEventElapsedTime(&ms[r - 5], e0, e1));
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[runs / 2];
        printf("  #%-2d %7.1f TFLOPS  %.4f ms  id %d tile %d stages %d splitK %d red %d swizzle %d cluster %d waves %.2f ws %zu  %s\n",
               i, 2.0 * M * N * K / (med * 1e-3) / 1e12, med, attr(al, CUBLASLT_ALGO_CONFIG_ID),
               attr(al, CUBLASLT_ALGO_CONFIG_TILE_ID), attr(al, CUBLASLT_ALGO_CONFIG_STAGES_ID),
               attr(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), attr(al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
               attr(al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), attr(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
               (double)res[i].wavesCount, res[i].workspaceSize, i == 0 ? "(fp8moe's choice)" : same ? "same bits as #0" : "DIFFERENT bits");
    }
    LK(cublasLtMatmulPreferenceDestroy(pref));
    LK(cublasLtMatrixLayoutDestroy(la));
    LK(cublasLtMatrixLayoutDestroy(lb));
    LK(cublasLtMatrixLayoutDestroy(ld));
    LK(cublasLtMatmulDescDestroy(desc));
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(d)); CK(cudaFree(d_ref)); CK(cudaFree(d_try));
    if (sa) CK(cudaFree(sa));
    if (sb) CK(cudaFree(sb));
}

int main(int argc, char **argv) {
    int64_t M = 8192, N = 8192, K = 8192;
    int runs = 50;
    if (argc >= 4) M = atoll(argv[1]), N = atoll(argv[2]), K = atoll(argv[3]);
    if (argc >= 5) runs = atoi(argv[4]);
    if (M <= 0 || N <= 0 || K <= 0 || K % 128 != 0 || runs < 1) {
        fprintf(stderr, "usage: lt_sweep [M N K] [runs] - positive sizes, K a multiple of 128\n");
        return 2;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("lt_sweep: %s, cuBLASLt %zu, median of %d after 5 warm-ups, back to back\n", prop.name,
           cublasLtGetVersion(), runs);
    cublasLtHandle_t h;
    LK(cublasLtCreate(&h));
    void *ws;
    CK(cudaMalloc(&ws, WS));
    sweep("fp8 Wgrad", 1, CUBLAS_OP_T, 0, M, N, K, runs, h, ws);
    sweep("bf16 Wgrad", 0, CUBLAS_OP_T, 0, M, N, K, runs, h, ws);
    sweep("bf16 Dgrad", 0, CUBLAS_OP_N, 1, M, N, K, runs, h, ws);           // dy @ w, as fp8moe runs it
    sweep("bf16 Dgrad via W^T", 0, CUBLAS_OP_T, 1, M, N, K, runs, h, ws);  // the same product from a transposed W
    LK(cublasLtDestroy(h));
    CK(cudaFree(ws));
    return 0;
}
