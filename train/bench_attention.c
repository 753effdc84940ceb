/*
 * bench_attention.c - `fp8moe bench attention`: how fast the CUDA causal attention core
 * (kernels/cuda/attention.cu and, on Hopper, attention_wgmma.cu, through kernels.h's attention_forward /
 * attention_backward) runs on this GPU,
 * at the shape of configs/bench-1gpu.ini by default (B = 2 sequences of T = 2048, H = 16 heads,
 * Dqk = 192 = Dn 128 nope + Dr 64 rope, Dv = 128), with the keys and values in MLA's layout as the model
 * passes them (kernels.h: kv (B, T, H, Dn + Dv), k_rope (B, T, Dr)). tests/gpu/attention_torch.py times
 * PyTorch's scaled_dot_product_attention the same way (its --dqk is Dn + Dr), as the comparison point.
 *
 * FLOPs (the usual flash-attention convention, stated in the output): the causal forward is
 * 2 B H (T (T + 1) / 2) (Dqk + Dv) (Q K^T and P V over the T (T + 1) / 2 unmasked pairs), the backward
 * 2.5 times that (five products instead of two). The CUDA backward executes 7 tile products because it
 * recomputes P and dP once more to stay atomic-free (attention.cu's file comment); that extra work is
 * not counted, so its TFLOPS are comparable with other implementations'.
 *
 * Timing: CUDA events around each of `runs` back-to-back calls (default 20) after 3 warm-up calls; the
 * median is reported, forward and backward separately. Each call includes the op's conversion pre-pass
 * (the forward: FP32 q, kv, k_rope -> BF16 head-major, kept in the state for the backward; the backward: dout),
 * and the backward the sum of the heads' rope-key gradients, as the model pays them. Inputs are random (q in
 * [-2, 2), kv, k_rope, dout in [-1, 1)), generated on the host once. After timing, forward and backward are run
 * twice more and compared bitwise (the op's determinism), and the outputs checked to be finite. All of this runs twice:
 * with the kernels the model uses (the Hopper wgmma ones where they serve the shape), then with the mma.sync
 * kernels forced (cuda_attention_wgmma(0)), the comparison point measured in the same run.
 */
#include "train/bench.h"
#include "train/cli.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

const char *const bench_attention_usage =
    "  fp8moe bench attention [--B N] [--T N] [--H N] [--dn N] [--dr N] [--dv N] [--runs N]\n"
    "      GPU causal attention core (kernels.h attention_forward / attention_backward): median time and\n"
    "      TFLOPS of the forward and of the backward over N runs (default 20) after 3 warm-up runs, then a\n"
    "      bitwise repeatability check; first as the model runs it (the Hopper wgmma kernels where they serve\n"
    "      the head dims), then on the mma.sync kernels as the comparison point. Head dims: dn (qk nope) +\n"
    "      dr (qk rope) = dqk, dv. Defaults: the shape of configs/bench-1gpu.ini, B = 2, T = 2048, H = 16,\n"
    "      dn = 128, dr = 64, dv = 128. Needs a CUDA build and a GPU.\n";

#ifndef FP8MOE_CUDA
int bench_attention_main(int argc, char **argv) {
    (void)argc, (void)argv;
    return bench_without_cuda("attention", __FILE__);
}
#else

#include "kernels/cuda/cuda_ops.h"
#include "train/bench_cuda.h"


enum { WARMUP = 3 };

typedef struct {
    int B, T, H, dn, dr, dv;
    size_t nq, nkv, nr, nv;            // elements of q (dq), kv (d_kv), k_rope (d_k_rope) and of out (dout)
    float *q, *kv, *k_rope, *dout, *out, *state, *dq, *d_kv, *d_k_rope;
} Problem;

static float *host_floats(size_t n) {
    float *h = malloc(n * sizeof(float));
    if (h == NULL) {
        fprintf(stderr, "%s:%d: out of host memory (%zu floats)\n", __FILE__, __LINE__, n);
        exit(1);
    }
    return h;
}

// Deterministic uniform [-amp, amp) noise, generated on the host and copied once.
static void fill_random(float *d, size_t n, uint64_t seed, float amp) {
    float *h = host_floats(n);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint64_t z = (uint64_t)i * 0x9E3779B97F4A7C15ull + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        h[i] = amp * (float)((double)(z >> 11) * 0x1p-52 - 1.0);
    }
    device_memcpy_from_host(DEVICE_CUDA, d, h, n * sizeof(float));
    free(h);
}

static void run_forward(Problem *p) {
    attention_forward(DEVICE_CUDA, p->out, p->state, p->q, p->kv, p->k_rope, p->B, p->T, p->H, p->dn, p->dr, p->dv);
}
static void run_backward(Problem *p) {
    attention_backward(DEVICE_CUDA, p->dq, p->d_kv, p->d_k_rope, p->dout, p->out, p->state, p->B, p->T, p->H, p->dn,
                       p->dr, p->dv);
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// Median milliseconds of one call of fn over `runs` back-to-back calls after WARMUP calls.
static double median_ms(void (*fn)(Problem *), Problem *p, int runs, cudaEvent_t *ev) {
    for (int i = 0; i < WARMUP; i++) fn(p);
    BENCH_CHECK(cudaEventRecord(ev[0], 0));
    for (int i = 0; i < runs; i++) {
        fn(p);
        BENCH_CHECK(cudaEventRecord(ev[i + 1], 0));
    }
    BENCH_CHECK(cudaEventSynchronize(ev[runs]));
    BENCH_CHECK(cudaGetLastError());
    float *ms = host_floats((size_t)runs);
    for (int i = 0; i < runs; i++) BENCH_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
    qsort(ms, (size_t)runs, sizeof(float), cmp_float);
    const double median = runs % 2 ? ms[runs / 2] : 0.5 * (ms[runs / 2 - 1] + ms[runs / 2]);
    free(ms);
    return median;
}

// Copies of the device buffers' contents, for the repeatability check.
static float *snapshot(const float *d, size_t n) {
    float *h = host_floats(n);
    device_memcpy_to_host(DEVICE_CUDA, h, d, n * sizeof(float));
    return h;
}
static int all_finite(const float *h, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!(h[i] - h[i] == 0.0f)) return 0;  // false for NaN and +-Inf
    return 1;
}

// Forward and backward twice from the same state (gradients zeroed before each backward): bitwise equal?
// Also reports whether every output is finite.
static void check_repeatability(Problem *p, int *same, int *finite) {
    const size_t ns = (size_t)p->B * p->H * p->T;
    float *first[5], *second[5];
    const size_t n[5] = {p->nv, p->nq, p->nkv, p->nr, ns};
    for (int rep = 0; rep < 2; rep++) {
        float **snap = rep == 0 ? first : second;
        run_forward(p);
        run_backward(p);
        const float *bufs[5] = {p->out, p->dq, p->d_kv, p->d_k_rope, p->state};
        for (int i = 0; i < 5; i++) snap[i] = snapshot(bufs[i], n[i]);
    }
    *same = 1, *finite = 1;
    for (int i = 0; i < 5; i++) {
        *same &= memcmp(first[i], second[i], n[i] * sizeof(float)) == 0;
        *finite &= all_finite(first[i], n[i]);
        free(first[i]), free(second[i]);
    }
}

// "--name N" with N an integer in [lo, hi]; returns 0 and sets *out, or prints the error and returns -1.
static int parse_int(const char *name, const char *text, int lo, int hi, int *out) {
    if (cli_parse_int(text, lo, hi, out)) {
        fprintf(stderr, "fp8moe bench attention: %s %s: expected an integer in [%d, %d]\nUsage:\n%s", name, text, lo,
                hi, bench_attention_usage);
        return -1;
    }
    return 0;
}

int bench_attention_main(int argc, char **argv) {
    Problem p;
    memset(&p, 0, sizeof p);
    p.B = 2, p.T = 2048, p.H = 16, p.dn = 128, p.dr = 64, p.dv = 128;
    int runs = 20;
    enum { N_OPTIONS = 7 };
    const char *names[N_OPTIONS] = {"--B", "--T", "--H", "--dn", "--dr", "--dv", "--runs"};
    int *targets[N_OPTIONS] = {&p.B, &p.T, &p.H, &p.dn, &p.dr, &p.dv, &runs};
    const int lo[N_OPTIONS] = {1, 1, 1, 0, 0, 1, 1}, hi[N_OPTIONS] = {65535, 1 << 20, 65535, 256, 256, 256, 100000};
    for (int i = 0; i < argc; i++) {
        int matched = 0;
        for (int j = 0; j < N_OPTIONS && !matched; j++) {
            if (strcmp(argv[i], names[j]) != 0) continue;
            if (i + 1 >= argc) {
                fprintf(stderr, "fp8moe bench attention: %s needs a value\nUsage:\n%s", names[j],
                        bench_attention_usage);
                return 2;
            }
            if (parse_int(names[j], argv[++i], lo[j], hi[j], targets[j]) != 0) return 2;
            matched = 1;
        }
        if (!matched) {
            fprintf(stderr, "fp8moe bench attention: unexpected argument %s\nUsage:\n%s", argv[i],
                    bench_attention_usage);
            return 2;
        }
    }
    const int dqk = p.dn + p.dr;
    if (dqk < 1 || dqk > 256) {
        fprintf(stderr, "fp8moe bench attention: --dn %d --dr %d: expected 1 <= dn + dr <= 256 (the key's head dim)\n"
                        "Usage:\n%s", p.dn, p.dr, bench_attention_usage);
        return 2;
    }
    if (cuda_device_count() == 0) {
        fprintf(stderr, "fp8moe bench attention: no CUDA device visible - expected a GPU (this benchmark times the "
                        "CUDA attention kernels)\n");
        return 1;
    }

    const size_t rows = (size_t)p.B * p.T;
    p.nq = rows * p.H * dqk, p.nkv = rows * p.H * (p.dn + p.dv), p.nr = rows * p.dr, p.nv = rows * p.H * p.dv;
    const size_t ns = (size_t)attention_state_elems(DEVICE_CUDA, p.B, p.T, p.H, p.dn, p.dr, p.dv);
    enum { N_BUFS = 8 };
    float **bufs[N_BUFS] = {&p.q, &p.dq, &p.kv, &p.d_kv, &p.k_rope, &p.d_k_rope, &p.dout, &p.out};
    const size_t sizes[N_BUFS] = {p.nq, p.nq, p.nkv, p.nkv, p.nr, p.nr, p.nv, p.nv};
    for (int i = 0; i < N_BUFS; i++) *bufs[i] = device_alloc(DEVICE_CUDA, sizes[i] * sizeof(float));
    p.state = device_alloc(DEVICE_CUDA, ns * sizeof(float));
    fill_random(p.q, p.nq, 1, 2.0f);
    fill_random(p.kv, p.nkv, 2, 1.0f);
    fill_random(p.k_rope, p.nr, 3, 1.0f);
    fill_random(p.dout, p.nv, 4, 1.0f);

    cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * (size_t)(runs + 1));
    if (ev == NULL) {
        fprintf(stderr, "%s:%d: out of host memory\n", __FILE__, __LINE__);
        return 1;
    }
    for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventCreate(&ev[i]));

    struct cudaDeviceProp prop;
    int dev = 0;
    BENCH_CHECK(cudaGetDevice(&dev));
    BENCH_CHECK(cudaGetDeviceProperties(&prop, dev));
    const double fwd_flop = 2.0 * p.B * p.H * ((double)p.T * (p.T + 1) / 2.0) * (dqk + p.dv);
    const double bwd_flop = 2.5 * fwd_flop;
    printf("fp8moe bench attention: %s (%d SMs); causal, B = %d, T = %d, H = %d, dqk = %d (dn %d + dr %d), dv = %d; "
           "FP32 in and out, BF16 tensor-core math\n", prop.name, prop.multiProcessorCount, p.B, p.T, p.H, dqk, p.dn,
           p.dr, p.dv);
    printf("FLOPs: forward = 2 B H (T (T+1) / 2) (dqk + dv) = %.4g, backward = 2.5 x forward = %.4g (the extra "
           "recomputation of the deterministic backward is not counted)\n", fwd_flop, bwd_flop);
    printf("time: median of %d back-to-back runs after %d warm-up (CUDA events), each including the op's BF16 "
           "conversion pre-pass (the forward's of q, kv, k_rope; the backward's of dout)\n\n", runs, WARMUP);

    // the op as the model runs it, then with the Hopper kernels switched off: the mma.sync kernels on the same
    // shape, the comparison point (both rows show the same kernels where the Hopper ones do not serve the shape)
    const char *kernels[2] = {"default", "mma.sync"};
    int all_same = 1, all_finite_ = 1;
    printf("%-10s %-10s %10s %10s\n", "kernels", "pass", "ms", "TFLOPS");
    for (int k = 0; k < 2; k++) {
        const int before = cuda_attention_wgmma(k == 0);
        run_forward(&p);  // the backward needs out and state
        const double fwd_ms = median_ms(run_forward, &p, runs, ev);
        const double bwd_ms = median_ms(run_backward, &p, runs, ev);
        int same = 0, finite = 0;
        check_repeatability(&p, &same, &finite);
        cuda_attention_wgmma(before);
        printf("%-10s %-10s %10.3f %10.1f\n", kernels[k], "forward", fwd_ms, fwd_flop / (fwd_ms * 1e-3) * 1e-12);
        printf("%-10s %-10s %10.3f %10.1f\n", kernels[k], "backward", bwd_ms, bwd_flop / (bwd_ms * 1e-3) * 1e-12);
        printf("%-10s %-10s %10.3f %10.1f\n", kernels[k], "fwd+bwd", fwd_ms + bwd_ms,
               (fwd_flop + bwd_flop) / ((fwd_ms + bwd_ms) * 1e-3) * 1e-12);
        printf("%-10s repeat (forward + backward twice): %s; outputs finite: %s\n", kernels[k],
               same ? "bitwise identical" : "DIFFERENT (determinism broken)", finite ? "yes" : "NO");
        all_same &= same, all_finite_ &= finite;
    }

    for (int i = 0; i <= runs; i++) BENCH_CHECK(cudaEventDestroy(ev[i]));
    free(ev);
    for (int i = 0; i < N_BUFS; i++) device_free(DEVICE_CUDA, *bufs[i]);
    device_free(DEVICE_CUDA, p.state);
    return all_same && all_finite_ ? 0 : 1;
}
#endif
