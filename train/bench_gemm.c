/*
 * bench_gemm.c - `fp8moe bench gemm`: how fast the GEMMs of DeepSeek-V3's FP8 recipe run on this GPU,
 * next to the BF16 baseline, at fixed shapes (8192^3, 4096x7168x2048, 4096x2048x7168) and at every
 * Linear shape of a job file (default configs/bench-1gpu.ini), plus the quantisers' bandwidth against
 * a device-to-device copy. Results go to docs/gpu.md by hand, with date and machine.
 *
 * Every row is one GEMM written M x N x K: an (M, N) output and a contraction of length K;
 * TFLOPS = 2 M N K / time. Fprop y = X W^T is T x out x in, Dgrad dX = dY W is T x in x out, Wgrad
 * dW += dY^T X is out x in x T. Columns:
 *   fp8 gemm    the cuBLASLt block-scaled GEMM alone (operands already quantised; Fprop/Dgrad write
 *               BF16, gemm.h's *_bf16; Wgrad adds FP32 into dW);
 *   fp8 +quant  plus quantising the activation-side operand(s) from FP32 through kernels.h: X (1x128)
 *               for Fprop, dY (1x128) for Dgrad, dY and X (128x1, transposed) for Wgrad. Weights are
 *               quantised once per optimizer step (128x128 + transpose), so they are not in this column;
 *               each kernels.h quantiser call also waits for its NaN/Inf check (a device-to-host copy);
 *   fp8 api     the kernels.h path the model uses now: +quant and the FP32 (`real`) output of Fprop/Dgrad
 *               (the BF16 -> FP32 conversion kernel); for Wgrad the same as +quant;
 *   bf16 gemm   cuBLASLt BF16 x BF16 -> BF16 (Wgrad: -> FP32 +=) with FP32 accumulation, operands in BF16;
 *   bf16 +conv  plus rounding the activation-side operand(s) from FP32 to BF16;
 *   bf16 api    bf16_matmul_forward / bf16_matmul_backward of kernels.h (FP32 in and out).
 * Timing: CUDA events around each of `runs` back-to-back calls (default 50) after `warmup` calls
 * (default 5); the median is reported. Inputs are random (uniform in [-1, 1)), the two operands of a
 * GEMM different. An H200 running dense FP8 GEMMs back to back reaches its power limit and lowers its
 * clock, so sustained numbers (the default) are up to ~10% below those of a GPU that was idle a moment
 * before; --idle-ms N sleeps N ms before each measurement to show the latter (see docs/gpu.md).
 * The grouped section times the routed experts' BF16-output GEMMs (w1/w3 and w2 Fprop, w2 Dgrad) and their Wgrads
 * (FP32, added to) as the model calls them, every expert's segment in one call, through the cuBLASLt path (one GEMM
 * per segment) and fp8moe's own grouped kernel (kernels/cuda/fp8_grouped_gemm.cu; FP8MOE_GROUPED_GEMM=own for the
 * Fprops and Dgrads, the Wgrad form called directly), in the same run on the same operands (--grouped-only: that
 * section alone).
 */
#include "train/bench.h"
#include "train/cli.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"
#include "train/config.h"

const char *const bench_gemm_usage =
    "  fp8moe bench gemm [JOB.ini] [--runs N] [--warmup N] [--idle-ms N] [--fixed-only | --grouped-only]\n"
    "      GPU GEMM throughput: FP8 block-scaled (cuBLASLt) and BF16, GEMM alone, with quantisation and\n"
    "      through kernels.h, at 8192^3, 4096x7168x2048, 4096x2048x7168 and the Linear shapes of JOB.ini\n"
    "      (default configs/bench-1gpu.ini); then quantiser bandwidth vs a device-to-device copy.\n"
    "      Median of N (default 50) timed runs after the warm-up (default 5). --idle-ms N: leave the GPU idle\n"
    "      N ms before each measurement (default 0: back to back, the GPU at its sustained power and clock).\n"
    "      Then the routed experts' grouped GEMMs (w1/w3 and w2 Fprop, w2 Dgrad, w1 and w2 Wgrad; all experts in\n"
    "      one call): cuBLASLt per segment vs fp8moe's own grouped kernel. --fixed-only: only the fixed shapes;\n"
    "      --grouped-only: only the grouped GEMMs.\n"
    "      Needs a CUDA build and a GPU.\n";

#ifndef FP8MOE_CUDA
int bench_gemm_main(int argc, char **argv) {
    (void)argc, (void)argv;
    return bench_without_cuda("gemm", __FILE__);
}
#else

#include <cublasLt.h>
#include "train/bench_cuda.h"

#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/gemm.h"


typedef enum { OP_FPROP, OP_DGRAD, OP_WGRAD } GemmOp;
static const char *const op_names[] = {"Fprop", "Dgrad", "Wgrad"};

typedef struct {
    char name[40];
    GemmOp op;
    int M, N, K;  // output (M, N), contraction K
} GemmRow;

enum { MAX_ROWS = 96 };

static int ceil128(int x) { return (x + 127) / 128 * 128; }

// ---------------------------------------------------------------------------- buffers
// One set of device buffers, sized for the largest row, reused by every row.
typedef struct {
    float *src;          // random FP32 activation-side operands (each reads a prefix)
    float *src_b;        // random FP32 other operands (weights; Wgrad's X), different values
    float *out;          // FP32 outputs (Fprop/Dgrad real output, Wgrad dW)
    uint16_t *out_bf16;  // BF16 outputs
    uint16_t *bf_a, *bf_b;
    uint8_t *q_a, *q_b, *q_bt;
    float *s_a, *s_b;
} Buffers;

static void *dalloc(size_t bytes) {
    void *p = NULL;
    BENCH_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 16));
    return p;
}

// Deterministic uniform [-1, 1) noise, generated on the host (OpenMP) and copied once.
static void fill_random(float *d, size_t n, uint64_t seed) {
    float *h = malloc(n * sizeof(float));
    if (h == NULL) {
        fprintf(stderr, "%s:%d: out of host memory (%zu floats)\n", __FILE__, __LINE__, n);
        exit(1);
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        h[i] = (float)((double)(z >> 11) * 0x1p-52 - 1.0);
    }
    BENCH_CHECK(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    free(h);
}

// ---------------------------------------------------------------------------- timing
typedef struct {
    int runs, warmup, idle_ms;
    cudaEvent_t *ev;
} Timer;

// Waits for the GPU, then leaves it idle for t->idle_ms (power and clock recover; see the file comment).
static void idle(const Timer *t) {
    if (t->idle_ms <= 0) return;
    BENCH_CHECK(cudaDeviceSynchronize());
    const struct timespec ts = {t->idle_ms / 1000, (long)(t->idle_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef void (*BenchFn)(const GemmRow *row, Buffers *B);

// Median milliseconds of one call of fn over t->runs back-to-back calls.
static double median_ms(const Timer *t, BenchFn fn, const GemmRow *row, Buffers *B) {
    idle(t);
    for (int i = 0; i < t->warmup; i++) fn(row, B);
    BENCH_CHECK(cudaEventRecord(t->ev[0], 0));
    for (int i = 0; i < t->runs; i++) {
        fn(row, B);
        BENCH_CHECK(cudaEventRecord(t->ev[i + 1], 0));
    }
    BENCH_CHECK(cudaEventSynchronize(t->ev[t->runs]));
    BENCH_CHECK(cudaGetLastError());
    float *ms = malloc(sizeof(float) * (size_t)t->runs);
    for (int i = 0; i < t->runs; i++) BENCH_CHECK(cudaEventElapsedTime(&ms[i], t->ev[i], t->ev[i + 1]));
    qsort(ms, (size_t)t->runs, sizeof(float), cmp_float);
    const double median = t->runs % 2 ? ms[t->runs / 2] : 0.5 * (ms[t->runs / 2 - 1] + ms[t->runs / 2]);
    free(ms);
    return median;
}

// ---------------------------------------------------------------------------- the timed operations
// kernels.h arguments of each op for a row M x N x K:
//   Fprop  T = M, N = N, K = K        x (T, K), w (N, K)        -> y (T, N)
//   Dgrad  T = M, N = K, K = N        dy (T, K_row), w (K_row, N_row) -> dx (T, N_row)
//   Wgrad  T = K, N = M, K = N        dy (T, M), x (T, N)        -> dw (M, N)
static void quantise_or_die(int rc, const char *what, const char *err) {
    if (rc != 0) {
        fprintf(stderr, "fp8moe bench gemm: quantising %s failed: %s\n", what, err);
        exit(1);
    }
}

static void fp8_quantise_activations(const GemmRow *r, Buffers *B) {
    char err[256];
    if (r->op == OP_FPROP) {
        quantise_or_die(fp8_quantize_1x128(DEVICE_CUDA, B->q_a, B->s_a, B->src, r->M, r->K, err, sizeof err), "X", err);
    } else if (r->op == OP_DGRAD) {
        quantise_or_die(fp8_quantize_1x128(DEVICE_CUDA, B->q_a, B->s_a, B->src, r->M, r->K, err, sizeof err), "dY", err);
    } else {
        quantise_or_die(fp8_quantize_128x1_transposed(DEVICE_CUDA, B->q_a, B->s_a, B->src, r->K, r->M, err, sizeof err),
                        "dY", err);
        quantise_or_die(fp8_quantize_128x1_transposed(DEVICE_CUDA, B->q_b, B->s_b, B->src_b, r->K, r->N, err, sizeof err),
                        "X", err);
    }
}

// The weight side, once per row (untimed): 128x128 blocks of W and their transpose.
static void fp8_quantise_weights(const GemmRow *r, Buffers *B) {
    char err[256];
    if (r->op == OP_FPROP)
        quantise_or_die(fp8_quantize_128x128(DEVICE_CUDA, B->q_b, NULL, B->s_b, B->src_b, r->N, r->K, err, sizeof err), "W", err);
    else if (r->op == OP_DGRAD)
        quantise_or_die(fp8_quantize_128x128(DEVICE_CUDA, B->q_b, B->q_bt, B->s_b, B->src_b, r->K, r->N, err, sizeof err), "W", err);
}

static void fp8_gemm_only(const GemmRow *r, Buffers *B) {
    if (r->op == OP_FPROP) cuda_fp8_gemm_fprop_bf16(B->out_bf16, B->q_a, B->s_a, B->q_b, B->s_b, r->M, r->N, r->K);
    else if (r->op == OP_DGRAD) cuda_fp8_gemm_dgrad_bf16(B->out_bf16, B->q_a, B->s_a, B->q_bt, B->s_b, r->M, r->K, r->N);
    else fp8_gemm_wgrad(DEVICE_CUDA, B->out, B->q_a, B->s_a, B->q_b, B->s_b, r->K, r->M, r->N);
}

static void fp8_quant_gemm(const GemmRow *r, Buffers *B) {
    fp8_quantise_activations(r, B);
    fp8_gemm_only(r, B);
}

static void fp8_api(const GemmRow *r, Buffers *B) {
    fp8_quantise_activations(r, B);
    if (r->op == OP_FPROP) fp8_gemm_fprop(DEVICE_CUDA, B->out, B->q_a, B->s_a, B->q_b, B->s_b, r->M, r->N, r->K);
    else if (r->op == OP_DGRAD) fp8_gemm_dgrad(DEVICE_CUDA, B->out, B->q_a, B->s_a, B->q_bt, B->s_b, r->M, r->K, r->N);
    else fp8_gemm_wgrad(DEVICE_CUDA, B->out, B->q_a, B->s_a, B->q_b, B->s_b, r->K, r->M, r->N);
}

// BF16 operands (bf_a: the activation side, bf_b: the other), as cuda_bf16_gemm wants them:
//   Fprop a = X (M, K), b = W (N, K) transposed;  Dgrad a = dY (M, K), b = W (K, N);
//   Wgrad a = dY (K, M) transposed, b = X (K, N), FP32 output += .
static void bf16_convert_activations(const GemmRow *r, Buffers *B) {
    cuda_float_to_bf16(B->bf_a, B->src, (int64_t)r->M * r->K);
    if (r->op == OP_WGRAD) cuda_float_to_bf16(B->bf_b, B->src_b, (int64_t)r->K * r->N);
}

static void bf16_gemm_only(const GemmRow *r, Buffers *B) {
    if (r->op == OP_FPROP) cuda_bf16_gemm(B->out_bf16, 0, 0.0f, B->bf_a, 0, B->bf_b, 1, r->M, r->N, r->K);
    else if (r->op == OP_DGRAD) cuda_bf16_gemm(B->out_bf16, 0, 0.0f, B->bf_a, 0, B->bf_b, 0, r->M, r->N, r->K);
    else cuda_bf16_gemm(B->out, 1, 1.0f, B->bf_a, 1, B->bf_b, 0, r->M, r->N, r->K);
}

static void bf16_convert_gemm(const GemmRow *r, Buffers *B) {
    bf16_convert_activations(r, B);
    bf16_gemm_only(r, B);
}

static void bf16_api(const GemmRow *r, Buffers *B) {
    if (r->op == OP_FPROP) bf16_matmul_forward(DEVICE_CUDA, B->out, B->src, B->src_b, r->M, r->K, r->N);
    else if (r->op == OP_DGRAD) bf16_matmul_backward(DEVICE_CUDA, B->out, NULL, B->src, NULL, B->src_b, r->M, r->N, r->K);
    else bf16_matmul_backward(DEVICE_CUDA, NULL, B->out, B->src, B->src_b, NULL, r->K, r->N, r->M);
}

// ---------------------------------------------------------------------------- shapes
static void add_row(GemmRow *rows, int *n, const char *name, GemmOp op, int M, int N, int K) {
    if (*n >= MAX_ROWS || M <= 0 || N <= 0 || K <= 0) return;
    GemmRow *r = &rows[(*n)++];
    snprintf(r->name, sizeof r->name, "%s", name);
    r->op = op, r->M = M, r->N = N, r->K = K;
}

// The three GEMMs of a Linear (in -> out) over T tokens.
static void add_linear(GemmRow *rows, int *n, const char *name, int T, int in, int out) {
    add_row(rows, n, name, OP_FPROP, T, out, in);
    add_row(rows, n, name, OP_DGRAD, T, in, out);
    add_row(rows, n, name, OP_WGRAD, out, in, T);
}

// Every FP8 Linear of the job's blocks (DESIGN.md section 3): MLA projections, dense FFN, shared and
// routed experts (T * top-k / E tokens each on average, rounded up to 16), MTP projection.
static void add_job_linears(GemmRow *rows, int *n, const Config *c) {
    const ModelConfig *m = &c->model;
    const MoeConfig *e = &c->moe;
    const int T = c->train.micro_batch_size * c->train.seq_len, d = m->dim, H = m->n_heads;
    const int qk = m->qk_nope_head_dim + m->qk_rope_head_dim;
    if (m->q_lora_rank > 0) {
        add_linear(rows, n, "mla W_DQ", T, d, m->q_lora_rank);
        add_linear(rows, n, "mla W_UQ", T, m->q_lora_rank, H * qk);
    } else {
        add_linear(rows, n, "mla W_Q", T, d, H * qk);
    }
    add_linear(rows, n, "mla W_DKV", T, d, m->kv_lora_rank + m->qk_rope_head_dim);
    add_linear(rows, n, "mla W_UKV", T, m->kv_lora_rank, H * (m->qk_nope_head_dim + m->v_head_dim));
    add_linear(rows, n, "mla W_O", T, H * m->v_head_dim, d);
    if (m->n_dense_layers > 0) {
        add_linear(rows, n, "dense w1,w3", T, d, m->inter_dim);
        add_linear(rows, n, "dense w2", T, m->inter_dim, d);
    }
    if (m->n_dense_layers < m->n_layers && e->n_routed_experts > 0) {
        const int shared = e->n_shared_experts * e->moe_inter_dim;
        if (shared > 0) {
            add_linear(rows, n, "shared w1,w3", T, d, shared);
            add_linear(rows, n, "shared w2", T, shared, d);
        }
        const int64_t routed = (int64_t)T * e->n_activated_experts / e->n_routed_experts;
        const int Te = (int)((routed + 15) / 16 * 16);
        add_linear(rows, n, "expert w1,w3", Te, d, e->moe_inter_dim);
        add_linear(rows, n, "expert w2", Te, e->moe_inter_dim, d);
    }
    if (c->mtp.depth > 0) add_linear(rows, n, "mtp proj", T, 2 * d, d);
}

// ---------------------------------------------------------------------------- quantiser bandwidth
static void bench_quantisers(const Timer *t, Buffers *B, int R, int C) {
    const double elems = (double)R * C;
    char err[256];
    float ms[6];
    cudaEvent_t *ev = t->ev;
    for (int k = 0; k < 6; k++) {
        for (int rep = -t->warmup; rep < t->runs; rep++) {
            if (rep == 0) BENCH_CHECK(cudaEventRecord(ev[0], 0));
            int rc = 0;
            switch (k) {
            case 0: BENCH_CHECK(cudaMemcpy(B->out, B->src, (size_t)R * C * sizeof(float), cudaMemcpyDeviceToDevice)); break;
            case 1: rc = fp8_quantize_1x128(DEVICE_CUDA, B->q_a, B->s_a, B->src, R, C, err, sizeof err); break;
            case 2: rc = fp8_quantize_128x128(DEVICE_CUDA, B->q_b, NULL, B->s_b, B->src, R, C, err, sizeof err); break;
            case 3: rc = fp8_quantize_128x128(DEVICE_CUDA, B->q_b, B->q_bt, B->s_b, B->src, R, C, err, sizeof err); break;
            case 4: rc = fp8_quantize_128x1_transposed(DEVICE_CUDA, B->q_a, B->s_a, B->src, R, C, err, sizeof err); break;
            default:
                rc = fp8_quantize_both_layouts(DEVICE_CUDA, B->q_a, B->s_a, B->q_b, B->s_b, B->src, R, C, err, sizeof err);
                break;
            }
            quantise_or_die(rc, "the bandwidth input", err);
            if (rep >= 0) BENCH_CHECK(cudaEventRecord(ev[rep + 1], 0));
        }
        BENCH_CHECK(cudaEventSynchronize(ev[t->runs]));
        float *v = malloc(sizeof(float) * (size_t)t->runs);
        for (int i = 0; i < t->runs; i++) BENCH_CHECK(cudaEventElapsedTime(&v[i], ev[i], ev[i + 1]));
        qsort(v, (size_t)t->runs, sizeof(float), cmp_float);
        ms[k] = v[t->runs / 2];
        free(v);
    }
    // bytes moved: read 4 per element; write 4 (copy), 1 (+1 for the transpose or the second layout) + scales
    const double bytes[6] = {8 * elems, 5 * elems + 4 * elems / 128, 5 * elems + 4 * elems / 16384,
                             6 * elems + 4 * elems / 16384, 5 * elems + 4 * elems / 128, 6 * elems + 8 * elems / 128};
    const char *names[6] = {"cudaMemcpy D2D (FP32)", "quantize_1x128", "quantize_128x128", "quantize_128x128 +qt",
                            "quantize_128x1_T", "quantize_both_layouts"};
    printf("\nquantisers, input %d x %d FP32 (GB/s = bytes read + written / median time; kernels.h calls; the\n"
           "NaN/Inf check is deferred to fp8_check_finite, not timed here)\n", R, C);
    printf("%-24s %10s %10s %10s\n", "", "ms", "GB/s", "vs copy");
    const double copy_gbs = bytes[0] / (ms[0] * 1e-3) * 1e-9;
    for (int k = 0; k < 6; k++) {
        const double gbs = bytes[k] / (ms[k] * 1e-3) * 1e-9;
        printf("%-24s %10.4f %10.1f %9.0f%%\n", names[k], ms[k], gbs, 100.0 * gbs / copy_gbs);
    }
}

// ---------------------------------------------------------------------------- grouped expert GEMMs
// The routed experts' BF16-output GEMMs of one micro-batch as the model calls them: T x top-k rows in E segments,
// every segment in one call: the Fprops of w1 (and w3: N = moe_inter_dim, K = dim) and of w2 (N = dim, K =
// moe_inter_dim), and w2's Dgrad (dx (rows, moe_inter_dim) from dy (rows, dim)), routed uniformly (T k / E rows per
// expert) and unevenly (lengths 0.4..1.6 x the mean, one expert empty, the same total). Columns: the cuBLASLt path
// (one GEMM per segment on 2 lanes), fp8moe's own kernel in its two forms (fp8_grouped_gemm.h: one CTA per 128 x 128
// tile, and per 128 x 256 tile - the default), each through kernels.h's call (the Dgrad's includes its scale
// transpose). TFLOPS = 2 rows N K / median time; "LT/1cta" and "LT/wide" are cuBLASLt's time over the single and
// wide forms', "=lt" the share of their output elements bitwise equal to cuBLASLt's and "max|d|" the larger of their
// largest differences over the largest |y|.
typedef struct {
    int n_seg, N, K, dgrad, wgrad;  // the weights are (N, K); the Fprop's output has N columns, the Dgrad's K
    int rows0[FP8_MAX_SEGMENTS + 1];
    const uint8_t *qx;
    const float *sx;
    const uint8_t *qw[FP8_MAX_SEGMENTS];  // the Dgrad's: the transposed codes
    const float *sw[FP8_MAX_SEGMENTS];
    uint16_t *y;
    const uint8_t *qdyt, *qxt;  // the Wgrad's 128x1 operands of dY (rows, N) and X (rows, K)
    const float *sdyt, *sxt;
    float *dw;                  // its gradients (E, N, K), added to
} GroupedRun;

// The Wgrad's own form is called directly (the model's Wgrads stay on cuBLASLt: gemm.cu).
static void grouped_call(const GroupedRun *g, int own) {
    const int previous = cuda_fp8_grouped_gemm_use_own(own);
    if (g->wgrad && own)
        cuda_fp8_grouped_wgrad(g->dw, g->qdyt, g->sdyt, g->qxt, g->sxt, g->n_seg, g->rows0, g->N, g->K);
    else if (g->wgrad)
        fp8_gemm_wgrad_grouped(DEVICE_CUDA, g->dw, GRAD_ADD, g->qdyt, g->sdyt, g->qxt, g->sxt, g->n_seg, g->rows0, g->N,
                               g->K);
    else if (g->dgrad)
        fp8_gemm_dgrad_grouped_bf16(DEVICE_CUDA, g->y, g->qx, g->sx, g->qw, g->sw, g->n_seg, g->rows0, g->N, g->K);
    else fp8_gemm_fprop_grouped_bf16(DEVICE_CUDA, g->y, g->qx, g->sx, g->qw, g->sw, g->n_seg, g->rows0, g->N, g->K);
    cuda_fp8_grouped_gemm_use_own(previous);
}
static void grouped_cublaslt(const GroupedRun *g) { grouped_call(g, 0); }
static void grouped_own(const GroupedRun *g) { grouped_call(g, 1); }

// Median milliseconds of one call of fn, as median_ms.
static double grouped_median_ms(const Timer *t, void (*fn)(const GroupedRun *), const GroupedRun *g) {
    idle(t);
    for (int i = 0; i < t->warmup; i++) fn(g);
    BENCH_CHECK(cudaEventRecord(t->ev[0], 0));
    for (int i = 0; i < t->runs; i++) {
        fn(g);
        BENCH_CHECK(cudaEventRecord(t->ev[i + 1], 0));
    }
    BENCH_CHECK(cudaEventSynchronize(t->ev[t->runs]));
    BENCH_CHECK(cudaGetLastError());
    float *ms = malloc(sizeof(float) * (size_t)t->runs);
    for (int i = 0; i < t->runs; i++) BENCH_CHECK(cudaEventElapsedTime(&ms[i], t->ev[i], t->ev[i + 1]));
    qsort(ms, (size_t)t->runs, sizeof(float), cmp_float);
    const double median = t->runs % 2 ? ms[t->runs / 2] : 0.5 * (ms[t->runs / 2 - 1] + ms[t->runs / 2]);
    free(ms);
    return median;
}

// Segment lengths of `rows` rows over n experts: uniform, or uneven (weights 0.4 + 1.2 u, expert n/2 empty, the
// rounding remainder on the last).
static void grouped_rows0(int *rows0, int n, int rows, int uneven) {
    double w[FP8_MAX_SEGMENTS], sum = 0;
    for (int g = 0; g < n; g++) {
        uint64_t z = (uint64_t)(g + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
        w[g] = !uneven ? 1.0 : g == n / 2 ? 0.0 : 0.4 + 1.2 * (double)(z >> 11) * 0x1p-53;
        sum += w[g];
    }
    rows0[0] = 0;
    for (int g = 0; g < n; g++) rows0[g + 1] = g == n - 1 ? rows : rows0[g] + (int)(rows * w[g] / sum);
}

// Share of the (rows, N) elements (row stride ld) of a equal to b's, and max |a - b| / max |b|.
static void grouped_compare(const uint16_t *a, const uint16_t *b, int rows, int N, int ld, double *equal, double *rel) {
    int64_t same = 0;
    double max_d = 0, max_b = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < N; j++) {
            const double x = bf16_to_float(a[r * ld + j]), y = bf16_to_float(b[r * ld + j]);
            same += a[r * ld + j] == b[r * ld + j];
            if (fabs(x - y) > max_d || isnan(x - y)) max_d = isnan(x - y) ? INFINITY : fabs(x - y);
            if (fabs(y) > max_b) max_b = fabs(y);
        }
    *equal = (double)same / ((double)rows * N);
    *rel = max_d / (max_b > 0 ? max_b : 1);
}

static void bench_grouped(const Timer *t, const Config *cfg) {
    const int E = cfg->moe.n_routed_experts, topk = cfg->moe.n_activated_experts, I = cfg->moe.moe_inter_dim;
    const int D = cfg->model.dim, T = cfg->train.micro_batch_size * cfg->train.seq_len;
    if (E < 1 || E > FP8_MAX_SEGMENTS || topk < 1 || I < 1) {
        printf("\ngrouped expert GEMMs: skipped (the job has %d routed experts, top-%d; expected 1..%d experts)\n", E,
               topk, FP8_MAX_SEGMENTS);
        return;
    }
    const int rows = T * topk, Kmax = D > I ? D : I, Kp = ceil128(Kmax), Np = ceil128(Kmax);
    const size_t P16 = (size_t)rows + 16 * (size_t)E;  // the most rows a segment split pads to
    float *x = dalloc((size_t)rows * Kmax * sizeof(float)), *w = dalloc((size_t)E * I * D * sizeof(float));
    uint8_t *qx = dalloc(P16 * Kp), *qw = dalloc((size_t)E * Np * Kp), *qwt = dalloc((size_t)E * Np * Kp);
    float *sx = dalloc(P16 * (Kp / 128) * sizeof(float)), *sw = dalloc((size_t)E * (Np / 128) * (Kp / 128 + 4) * sizeof(float));
    const size_t y_elems = (size_t)bf16_rows_elems(rows, Kmax);
    uint16_t *y = dalloc(y_elems * sizeof(uint16_t));
    uint16_t *h_lt = malloc(y_elems * sizeof(uint16_t)), *h_own = malloc(y_elems * sizeof(uint16_t));
    if (h_lt == NULL || h_own == NULL) {
        fprintf(stderr, "%s:%d: out of host memory (2 x %zu BF16 outputs)\n", __FILE__, __LINE__, y_elems);
        exit(1);
    }
    fill_random(x, (size_t)rows * Kmax, 24680);
    fill_random(w, (size_t)E * I * D, 13579);
    printf("\ngrouped expert GEMMs: %d experts of one micro-batch (%d tokens x top-%d = %d rows) in one call, BF16 "
           "output; TFLOPS = 2 rows N K / median time; the own kernel runs one CTA per SM\n", E, T, topk, rows);
    printf("%-17s %-8s %22s | %9s %9s %9s | %8s %8s %8s %8s %10s | %9s %9s %9s\n", "GEMM", "routing",
           "rows x N x K", "cuBLASLt", "own 1cta", "own wide", "LT/1cta", "LT/wide", "=lt 1cta", "=lt wide", "max|d|",
           "LT ms", "1cta ms", "wide ms");
    char err[256];
    static const char *names[3] = {"expert w1,w3", "expert w2", "expert w2 Dgrad"};
    for (int shape = 0; shape < 3; shape++) {
        GroupedRun g;
        memset(&g, 0, sizeof g);
        g.n_seg = E, g.N = shape == 0 ? I : D, g.K = shape == 0 ? D : I, g.dgrad = shape == 2;
        g.qx = qx, g.sx = sx, g.y = y;
        const int out_cols = g.dgrad ? g.K : g.N, contraction = g.dgrad ? g.N : g.K;
        const int NB = (g.N + 127) / 128, KB = (g.K + 127) / 128, KB4 = (KB + 3) / 4 * 4;
        const int64_t wq = (int64_t)NB * 128 * KB * 128, ws = (int64_t)NB * KB4;
        quantise_or_die(fp8_quantize_128x128_batched(DEVICE_CUDA, qw, g.dgrad ? qwt : NULL, sw, w, E, g.N, g.K, err,
                                                     sizeof err), "W", err);
        for (int e = 0; e < E; e++) g.qw[e] = (g.dgrad ? qwt : qw) + e * wq, g.sw[e] = sw + e * ws;
        for (int uneven = 0; uneven < 2; uneven++) {
            grouped_rows0(g.rows0, E, rows, uneven);
            quantise_or_die(fp8_quantize_1x128_grouped(DEVICE_CUDA, qx, sx, x, NULL, E, g.rows0, contraction, err,
                                                       sizeof err), "X", err);
            const double flop = 2.0 * rows * g.N * g.K;
            const double lt_ms = grouped_median_ms(t, grouped_cublaslt, &g);
            const size_t y_bytes = (size_t)bf16_rows_elems(rows, out_cols) * sizeof(uint16_t);
            BENCH_CHECK(cudaMemcpy(h_lt, y, y_bytes, cudaMemcpyDeviceToHost));
            // the own kernel's forms: [0] one CTA per 128 x 128 tile, [1] per 128 x 256 tile
            static const int forms[2] = {FP8_GROUPED_SINGLE, FP8_GROUPED_WIDE};
            double ms[2], equal[2], rel[2];
            const int previous = cuda_fp8_grouped_gemm_form(forms[0]);
            for (int f = 0; f < 2; f++) {
                cuda_fp8_grouped_gemm_form(forms[f]);
                ms[f] = grouped_median_ms(t, grouped_own, &g);
                BENCH_CHECK(cudaMemcpy(h_own, y, y_bytes, cudaMemcpyDeviceToHost));
                grouped_compare(h_own, h_lt, rows, out_cols, (int)bf16_rows_ld(out_cols), &equal[f], &rel[f]);
            }
            cuda_fp8_grouped_gemm_form(previous);
            char dims[40];
            snprintf(dims, sizeof dims, "%d x %d x %d", rows, out_cols, contraction);
            printf("%-17s %-8s %22s | %9.1f %9.1f %9.1f | %7.2fx %7.2fx %7.3f%% %7.3f%% %10.2e | %9.4f %9.4f %9.4f\n",
                   names[shape], uneven ? "uneven" : "uniform", dims, flop / (lt_ms * 1e-3) * 1e-12,
                   flop / (ms[0] * 1e-3) * 1e-12, flop / (ms[1] * 1e-3) * 1e-12, lt_ms / ms[0], lt_ms / ms[1],
                   100.0 * equal[0], 100.0 * equal[1], rel[0] > rel[1] ? rel[0] : rel[1], lt_ms, ms[0], ms[1]);
            fflush(stdout);
        }
    }
    free(h_lt), free(h_own);

    // The Wgrads (dW_e += dY_e^T X_e over each expert's tokens, FP32 added to), w1's (and w3's) and w2's, in the own
    // kernel's two forms as above: the columns as above, "=lt" from one call of each onto zeroed gradients, "max|d|"
    // over the largest |dW|.
    const size_t tiles = (size_t)rows / 128 + (size_t)E, qt_bytes = (size_t)Kmax * 128 * tiles;
    uint8_t *qdyt = dalloc(qt_bytes), *qxt = dalloc(qt_bytes);
    float *sdyt = dalloc(tiles * Kmax * sizeof(float)), *sxt = dalloc(tiles * Kmax * sizeof(float));
    const size_t dw_elems = (size_t)E * I * D;
    float *dw = dalloc(dw_elems * sizeof(float)), *h_dw_lt = malloc(dw_elems * sizeof(float)),
          *h_dw_own = malloc(dw_elems * sizeof(float));
    if (h_dw_lt == NULL || h_dw_own == NULL) {
        fprintf(stderr, "%s:%d: out of host memory (2 x %zu FP32 gradients)\n", __FILE__, __LINE__, dw_elems);
        exit(1);
    }
    static const char *wnames[2] = {"expert w1 Wgrad", "expert w2 Wgrad"};
    for (int shape = 0; shape < 2; shape++) {
        GroupedRun g;
        memset(&g, 0, sizeof g);
        g.n_seg = E, g.N = shape == 0 ? I : D, g.K = shape == 0 ? D : I, g.wgrad = 1;
        g.qdyt = qdyt, g.sdyt = sdyt, g.qxt = qxt, g.sxt = sxt, g.dw = dw;
        for (int uneven = 0; uneven < 2; uneven++) {
            grouped_rows0(g.rows0, E, rows, uneven);
            quantise_or_die(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, qdyt, sdyt, x, NULL, E, g.rows0, g.N, err,
                                                                  sizeof err), "dY", err);
            quantise_or_die(fp8_quantize_128x1_transposed_grouped(DEVICE_CUDA, qxt, sxt, x, NULL, E, g.rows0, g.K, err,
                                                                  sizeof err), "X", err);
            const double flop = 2.0 * rows * g.N * g.K;
            const double lt_ms = grouped_median_ms(t, grouped_cublaslt, &g);
            BENCH_CHECK(cudaMemset(dw, 0, dw_elems * sizeof(float)));
            grouped_call(&g, 0);
            BENCH_CHECK(cudaMemcpy(h_dw_lt, dw, dw_elems * sizeof(float), cudaMemcpyDeviceToHost));
            static const int forms[2] = {FP8_GROUPED_SINGLE, FP8_GROUPED_WIDE};
            double ms[2], equal[2], max_d = 0, max_b = 0;
            const int previous = cuda_fp8_grouped_gemm_form(forms[0]);
            for (int f = 0; f < 2; f++) {
                cuda_fp8_grouped_gemm_form(forms[f]);
                ms[f] = grouped_median_ms(t, grouped_own, &g);
                BENCH_CHECK(cudaMemset(dw, 0, dw_elems * sizeof(float)));
                grouped_call(&g, 1);
                BENCH_CHECK(cudaMemcpy(h_dw_own, dw, dw_elems * sizeof(float), cudaMemcpyDeviceToHost));
                int64_t same = 0;
                for (size_t i = 0; i < dw_elems; i++) {
                    same += memcmp(&h_dw_own[i], &h_dw_lt[i], sizeof(float)) == 0;
                    const double d = fabs((double)h_dw_own[i] - h_dw_lt[i]);
                    if (d > max_d || isnan(d)) max_d = isnan(d) ? INFINITY : d;
                    if (fabs(h_dw_lt[i]) > max_b) max_b = fabs(h_dw_lt[i]);
                }
                equal[f] = (double)same / (double)dw_elems;
            }
            cuda_fp8_grouped_gemm_form(previous);
            char dims[40];
            snprintf(dims, sizeof dims, "%d x %d x %d", g.N, g.K, rows);
            printf("%-17s %-8s %22s | %9.1f %9.1f %9.1f | %7.2fx %7.2fx %7.3f%% %7.3f%% %10.2e | %9.4f %9.4f %9.4f\n",
                   wnames[shape], uneven ? "uneven" : "uniform", dims, flop / (lt_ms * 1e-3) * 1e-12,
                   flop / (ms[0] * 1e-3) * 1e-12, flop / (ms[1] * 1e-3) * 1e-12, lt_ms / ms[0], lt_ms / ms[1],
                   100.0 * equal[0], 100.0 * equal[1], max_d / (max_b > 0 ? max_b : 1), lt_ms, ms[0], ms[1]);
            fflush(stdout);
        }
    }
    free(h_dw_lt), free(h_dw_own);
    void *wbufs[] = {qdyt, qxt, sdyt, sxt, dw};
    for (size_t i = 0; i < sizeof wbufs / sizeof wbufs[0]; i++) BENCH_CHECK(cudaFree(wbufs[i]));
    void *bufs[] = {x, w, qx, qw, qwt, sx, sw, y};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) BENCH_CHECK(cudaFree(bufs[i]));
}

// ---------------------------------------------------------------------------- main
int bench_gemm_main(int argc, char **argv) {
    const char *job = "configs/bench-1gpu.ini";
    int runs = 50, warmup = 5, idle_ms = 0, fixed_only = 0, grouped_only = 0, job_given = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--fixed-only")) {
            fixed_only = 1;
        } else if (!strcmp(a, "--grouped-only")) {
            grouped_only = 1;
        } else if ((!strcmp(a, "--runs") || !strcmp(a, "--warmup") || !strcmp(a, "--idle-ms")) && i + 1 < argc) {
            int v;
            if (cli_parse_int(argv[++i], 1, 100000, &v)) {
                fprintf(stderr, "fp8moe bench gemm: %s %s: expected an integer in [1, 100000]\nUsage:\n%s", a, argv[i],
                        bench_gemm_usage);
                return 2;
            }
            if (!strcmp(a, "--runs")) runs = v;
            else if (!strcmp(a, "--warmup")) warmup = v;
            else idle_ms = v;
        } else if (a[0] != '-' && !job_given) {
            job = a, job_given = 1;
        } else {
            fprintf(stderr, "fp8moe bench gemm: unexpected argument %s\nUsage:\n%s", a, bench_gemm_usage);
            return 2;
        }
    }
    Config cfg;
    char err[512];
    if (config_load(&cfg, job, NULL, 0, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe bench gemm: %s\n", err);
        return 2;
    }
    if (cuda_device_count() == 0) {
        fprintf(stderr, "fp8moe bench gemm: no CUDA device visible - expected a GPU (this benchmark times GPU GEMMs)\n");
        return 1;
    }
    if (fixed_only && grouped_only) {
        fprintf(stderr, "fp8moe bench gemm: --fixed-only and --grouped-only exclude each other\nUsage:\n%s",
                bench_gemm_usage);
        return 2;
    }
    if (grouped_only) {
        Timer t = {runs, warmup, idle_ms, malloc(sizeof(cudaEvent_t) * (size_t)(runs + 1))};
        for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventCreate(&t.ev[i]));
        struct cudaDeviceProp prop;
        int dev = 0;
        BENCH_CHECK(cudaGetDevice(&dev));
        BENCH_CHECK(cudaGetDeviceProperties(&prop, dev));
        printf("fp8moe bench gemm --grouped-only: %s (%d SMs), cuBLASLt %zu, job %s; median of %d runs after %d warm-up, "
               "%s\n", prop.name, prop.multiProcessorCount, cublasLtGetVersion(), job, runs, warmup,
               idle_ms > 0 ? "GPU idle before each measurement" : "back to back");
        bench_grouped(&t, &cfg);
        for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventDestroy(t.ev[i]));
        free(t.ev);
        return 0;
    }

    GemmRow rows[MAX_ROWS];
    int n_rows = 0;
    const int fixed[3][3] = {{8192, 8192, 8192}, {4096, 7168, 2048}, {4096, 2048, 7168}};
    for (int s = 0; s < 3; s++)
        for (int op = 0; op < 3; op++) {
            char name[40];
            snprintf(name, sizeof name, "%dx%dx%d", fixed[s][0], fixed[s][1], fixed[s][2]);
            add_row(rows, &n_rows, name, (GemmOp)op, fixed[s][0], fixed[s][1], fixed[s][2]);
        }
    const int n_fixed = n_rows;
    if (!fixed_only) add_job_linears(rows, &n_rows, &cfg);

    // sizes: activation side (M, K) [Wgrad: (K, M)], other side (N, K) [Dgrad, Wgrad: (K, N)], output (M, N),
    // padded to 128 in every dimension (quantised operands and BF16 outputs are padded)
    size_t side_a = 0, side_b = 0, side_out = 0;
    for (int i = 0; i < n_rows; i++) {
        const size_t Mp = (size_t)ceil128(rows[i].M), Np = (size_t)ceil128(rows[i].N), Kp = (size_t)ceil128(rows[i].K);
        if (Mp * Kp > side_a) side_a = Mp * Kp;
        if (Np * Kp > side_b) side_b = Np * Kp;
        if (Mp * Np > side_out) side_out = Mp * Np;
    }
    // the quantiser inputs: 8192 x 8192 and the job's (T, dim) activations
    const size_t quant_R = 8192, quant_C = 8192;
    const size_t job_T = (size_t)cfg.train.micro_batch_size * cfg.train.seq_len, job_C = (size_t)cfg.model.dim;
    const size_t quant_n[2] = {quant_R * quant_C, (size_t)ceil128((int)job_T) * (size_t)ceil128((int)job_C)};
    for (int k = 0; k < 2; k++) {
        if (quant_n[k] > side_a) side_a = quant_n[k];
        if (quant_n[k] > side_b) side_b = quant_n[k];
        if (quant_n[k] > side_out) side_out = quant_n[k];
    }
    Buffers B;
    B.src = dalloc(side_a * sizeof(float)), B.src_b = dalloc(side_b * sizeof(float));
    B.out = dalloc(side_out * sizeof(float));
    B.out_bf16 = dalloc(side_out * sizeof(uint16_t));
    B.bf_a = dalloc(side_a * sizeof(uint16_t)), B.bf_b = dalloc(side_b * sizeof(uint16_t));
    B.q_a = dalloc(side_a), B.q_b = dalloc(side_b), B.q_bt = dalloc(side_b);
    B.s_a = dalloc((side_a / 128 + 4096) * sizeof(float)), B.s_b = dalloc((side_b / 128 + 4096) * sizeof(float));
    fill_random(B.src, side_a, 12345);
    fill_random(B.src_b, side_b, 67890);
    BENCH_CHECK(cudaMemset(B.out, 0, side_out * sizeof(float)));

    Timer t = {runs, warmup, idle_ms, malloc(sizeof(cudaEvent_t) * (size_t)(runs + 1))};
    for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventCreate(&t.ev[i]));

    struct cudaDeviceProp prop;
    int dev = 0;
    BENCH_CHECK(cudaGetDevice(&dev));
    BENCH_CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("fp8moe bench gemm: %s (%d SMs), cuBLASLt %zu, job %s (T = %d tokens per micro-batch)\n", prop.name,
           prop.multiProcessorCount, cublasLtGetVersion(), job, cfg.train.micro_batch_size * cfg.train.seq_len);
    printf("M x N x K = (M, N) output, contraction K; TFLOPS = 2MNK / median time of %d runs after %d warm-up "
           "(CUDA events); %s\n", runs, warmup, idle_ms > 0 ? "GPU idle before each measurement" : "back to back");
    if (idle_ms > 0) printf("idle %d ms before each measurement\n", idle_ms);
    printf("fp8: block-scaled E4M3 (1x128 activations, 128x128 weights; Wgrad 1x128 along T), FP32 accumulation "
           "promoted every 128\n\n");
    printf("%-14s %-5s %20s | %9s %9s %9s | %9s %9s %9s | %7s %9s\n", "shape", "op", "M x N x K", "fp8 gemm",
           "fp8+quant", "fp8 api", "bf16 gemm", "bf16+conv", "bf16 api", "fp8/bf16", "fp8 ms");
    for (int i = 0; i < n_rows; i++) {
        const GemmRow *r = &rows[i];
        if (i == n_fixed) printf("-- Linear layers of %s --\n", job);
        fp8_quantise_weights(r, &B);
        fp8_quantise_activations(r, &B);
        cuda_float_to_bf16(B.bf_a, B.src, (int64_t)r->M * r->K);
        cuda_float_to_bf16(B.bf_b, B.src_b, (int64_t)r->N * r->K);
        const double flop = 2.0 * r->M * r->N * r->K;
        const double ms[6] = {median_ms(&t, fp8_gemm_only, r, &B), median_ms(&t, fp8_quant_gemm, r, &B),
                              median_ms(&t, fp8_api, r, &B), median_ms(&t, bf16_gemm_only, r, &B),
                              median_ms(&t, bf16_convert_gemm, r, &B), median_ms(&t, bf16_api, r, &B)};
        char shape[32];
        snprintf(shape, sizeof shape, "%d x %d x %d", r->M, r->N, r->K);
        printf("%-14s %-5s %20s |", r->name, op_names[r->op], shape);
        for (int k = 0; k < 6; k++) printf(" %9.1f%s", flop / (ms[k] * 1e-3) * 1e-12, k == 2 ? " |" : "");
        printf(" | %6.2fx %9.4f\n", ms[3] / ms[0], ms[0]);
        fflush(stdout);
    }
    if (!fixed_only) {
        bench_grouped(&t, &cfg);
        bench_quantisers(&t, &B, (int)quant_R, (int)quant_C);
        bench_quantisers(&t, &B, (int)job_T, (int)job_C);
    }

    for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventDestroy(t.ev[i]));
    free(t.ev);
    void *bufs[] = {B.src, B.src_b, B.out, B.out_bf16, B.bf_a, B.bf_b, B.q_a, B.q_b, B.q_bt, B.s_a, B.s_b};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) BENCH_CHECK(cudaFree(bufs[i]));
    return 0;
}
#endif
