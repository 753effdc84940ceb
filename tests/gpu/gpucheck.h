/*
 * gpucheck.h - what the GPU parity tests (tests/gpu/test_gpu_*.c) share: the refusal to pass on a
 * machine without a visible GPU, host/device buffer helpers that stop on failure, and the scaled-error
 * and NaN scans their comparison tables are built on. Header-only (static inline) so each test stays
 * one binary from one source file.
 */
#ifndef FP8MOE_GPUCHECK_H
#define FP8MOE_GPUCHECK_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/kernels.h"

// malloc that stops the test binary with the size when it fails (a test has no way on without the buffer).
static inline void *gpucheck_malloc(size_t bytes) {
    void *p = malloc(bytes > 0 ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "%s:%d: malloc of %zu bytes failed\n", __FILE__, __LINE__, bytes);
        exit(1);
    }
    return p;
}
// A new device buffer holding host's bytes / a new host buffer holding the device buffer's bytes.
static inline void *gpucheck_to_device(const void *host, size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes);
    device_memcpy_from_host(DEVICE_CUDA, d, host, bytes);
    return d;
}
static inline void *gpucheck_to_host(const void *d, size_t bytes) {
    void *h = gpucheck_malloc(bytes);
    device_memcpy_to_host(DEVICE_CUDA, h, d, bytes);
    return h;
}

// The number of visible CUDA devices; when there is none, prints why "<binary>: FAIL: ..." and returns 0,
// so a GPU job can never pass by testing nothing.
static inline int gpucheck_devices(const char *binary) {
    const int n_gpu = cuda_device_count();
    if (n_gpu > 0) return n_gpu;
#ifdef FP8MOE_CUDA
    const char *why = "this binary has CUDA, but the runtime sees no device (no GPU, no driver, or "
                      "CUDA_VISIBLE_DEVICES hides it)";
#else
    const char *why = "this binary was built without CUDA (no FP8MOE_CUDA)";
#endif
    fprintf(stderr, "%s: FAIL: cuda_device_count() == 0: %s. These are GPU parity tests: run them on an NVIDIA "
                    "machine with tests/gpu/run.sh.\n", binary, why);
    return 0;
}

// Largest |x[i] - y[i]| / scale[i] (y from y32, or y64 when y32 is NULL), its index in *worst; a NaN
// counts as infinite.
static inline double max_scaled_err(const float *x, const float *y32, const double *y64, const double *scale,
                                    int64_t n, int64_t *worst) {
    double max_err = 0.0;
    *worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const double y = y32 != NULL ? (double)y32[i] : y64[i];
        double err = fabs((double)x[i] - y) / fmax(scale[i], (double)FLT_MIN);
        if (isnan(err)) err = INFINITY;
        if (err > max_err) {
            max_err = err;
            *worst = i;
        }
    }
    return max_err;
}

// NaNs in x, the first one's index in *first (-1 when none).
static inline int64_t count_nan(const float *x, int64_t n, int64_t *first) {
    int64_t count = 0;
    *first = -1;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i]) && count++ == 0) *first = i;
    }
    return count;
}

#endif
