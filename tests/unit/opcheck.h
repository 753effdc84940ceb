/*
 * opcheck.h - small helpers for op unit tests: reproducible random inputs from a counter-based RNG,
 * error-ratio checks against double-precision references, and central finite differences of a
 * double-precision loss. Header-only (static inline) so any test binary can include it.
 *
 * Why counter-based: value i of a fill depends only on (seed, i), so a test's inputs do not change
 * when another fill is added before it, and a failing element can be regenerated on its own.
 */
#ifndef FP8MOE_TESTS_OPCHECK_H
#define FP8MOE_TESTS_OPCHECK_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/kernels.h"

// Unit roundoff of `real` (2^-24 for float, 2^-53 for double): the bound of one rounding.
#define OPCHECK_UNIT_ROUNDOFF (sizeof(real) == sizeof(float) ? 0x1p-24 : 0x1p-53)

// ---------------------------------------------------------------------------- random numbers
// splitmix64's finaliser: a bijective mix of 64 bits, good enough to turn (seed, counter) into noise.
static inline uint64_t opcheck_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Uniform in [0, 1) with 53 random bits, a pure function of (seed, counter).
static inline double opcheck_uniform(uint64_t seed, uint64_t counter) {
    return (double)(opcheck_mix64(opcheck_mix64(seed) ^ counter) >> 11) * 0x1p-53;
}

// x (n) uniform in [lo, hi).
static inline void opcheck_fill(real *x, size_t n, uint64_t seed, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = (real)(lo + (hi - lo) * opcheck_uniform(seed, i));
}

// x (n) with |x| uniform in [min_abs, max_abs) and a random sign: random and never zero.
static inline void opcheck_fill_nonzero(real *x, size_t n, uint64_t seed, double min_abs, double max_abs) {
    for (size_t i = 0; i < n; i++) {
        double u = opcheck_uniform(seed, 2 * i), sign = opcheck_uniform(seed, 2 * i + 1) < 0.5 ? -1.0 : 1.0;
        x[i] = (real)(sign * (min_abs + (max_abs - min_abs) * u));
    }
}

// Integers uniform in [lo, hi).
static inline void opcheck_fill_int(int *x, size_t n, uint64_t seed, int lo, int hi) {
    for (size_t i = 0; i < n; i++) x[i] = lo + (int)(opcheck_uniform(seed, i) * (double)(hi - lo));
}

static inline void opcheck_to_double(double *dst, const real *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = (double)src[i];
}

// ---------------------------------------------------------------------------- comparisons
// With OPCHECK_VERBOSE set in the environment every check prints its worst ratio, which shows how
// much room a tolerance leaves.
static inline void opcheck_report(const char *what, double worst) {
    if (getenv("OPCHECK_VERBOSE")) fprintf(stderr, "  %-44s worst ratio %.3g\n", what, worst);
}

// Largest |got - want| / bound[i] over n elements (a value <= 1 passes). Prints the worst element
// when it fails, so a test failure says where and by how much.
static inline double opcheck_ratio_bound(const char *what, const real *got, const double *want,
                                         const double *bound, size_t n) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs((double)got[i] - want[i]) / bound[i];
        if (!(r <= worst)) { worst = r; at = i; } // also catches NaN
    }
    opcheck_report(what, worst);
    if (!(worst <= 1.0)) {
        fprintf(stderr, "%s: element %zu: got %.9g, want %.9g, |diff| %.3g > bound %.3g (ratio %.3g)\n", what,
                at, (double)got[at], want[at], fabs((double)got[at] - want[at]), bound[at], worst);
    }
    return worst;
}

// As above with bound = atol + rtol * |want|.
static inline double opcheck_ratio(const char *what, const real *got, const double *want, size_t n,
                                   double atol, double rtol) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs((double)got[i] - want[i]) / (atol + rtol * fabs(want[i]));
        if (!(r <= worst)) { worst = r; at = i; }
    }
    opcheck_report(what, worst);
    if (!(worst <= 1.0)) {
        fprintf(stderr, "%s: element %zu: got %.9g, want %.9g, |diff| %.3g > %.3g + %.3g * |want| (ratio %.3g)\n",
                what, at, (double)got[at], want[at], fabs((double)got[at] - want[at]), atol, rtol, worst);
    }
    return worst;
}

// As opcheck_ratio, for two double arrays (e.g. an analytic reference against finite differences).
static inline double opcheck_ratio_d(const char *what, const double *got, const double *want, size_t n,
                                     double atol, double rtol) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs(got[i] - want[i]) / (atol + rtol * fabs(want[i]));
        if (!(r <= worst)) { worst = r; at = i; }
    }
    opcheck_report(what, worst);
    if (!(worst <= 1.0)) {
        fprintf(stderr, "%s: element %zu: got %.17g, want %.17g (ratio %.3g)\n", what, at, got[at], want[at],
                worst);
    }
    return worst;
}

// gamma_n = n u / (1 - n u): a sum of n products computed in `real` in any order is within
// gamma_n * sum |terms| of the exact sum (Higham, Accuracy and Stability, section 3.1).
static inline double opcheck_gamma(int n) {
    double nu = (double)n * OPCHECK_UNIT_ROUNDOFF;
    return nu / (1.0 - nu);
}

// ---------------------------------------------------------------------------- finite differences
// grad[i] = (loss(param[i] + h) - loss(param[i] - h)) / (2h) for i < n, where loss(ctx) is a
// double-precision function that reads param through ctx. param is restored after each element.
// With double arithmetic and h ~ 1e-5 on O(1) inputs the error is ~1e-10 (truncation h^2) plus
// ~1e-11 |loss| (rounding eps/h), far below the float errors being tested.
static inline void opcheck_fd_grad(double *grad, double *param, size_t n, double h, double (*loss)(void *ctx),
                                   void *ctx) {
    for (size_t i = 0; i < n; i++) {
        const double saved = param[i];
        param[i] = saved + h;
        const double up = loss(ctx);
        param[i] = saved - h;
        const double down = loss(ctx);
        param[i] = saved;
        grad[i] = (up - down) / (2 * h);
    }
}

// ---------------------------------------------------------------------------- routing
// topk_idx (N, K): per token K distinct experts out of E, never expert `empty` (so its segment is empty; -1: none
// left out), drawn with a skew towards low ids (expert floor(E u^4), u uniform), so segment lengths range from a few
// rows to many 128-row tiles.
static inline void opcheck_routing(int *topk_idx, int N, int K, int E, int empty, uint64_t seed) {
    uint64_t ctr = 0;
    for (int t = 0; t < N; t++) {
        for (int k = 0; k < K; k++) {
            int e, taken;
            do {
                const double u = opcheck_uniform(seed, ctr++);
                e = (int)(E * (u * u) * (u * u));
                taken = e == empty;
                for (int j = 0; j < k; j++) taken |= topk_idx[(size_t)t * K + j] == e;
            } while (taken);
            topk_idx[(size_t)t * K + k] = e;
        }
    }
}

// ---------------------------------------------------------------------------- BF16 sources
// Two arrays of N rows of C BF16 values at row stride ld, the second `stride` values after the first: the operand of
// an op that adds two BF16 sources in order (kernels.h rmsnorm_backward_bf16). Value (r, c) of the first is
// BF16(0.75 x), of the second BF16(-1.5 x + c % 3), for x = src[r C + c]; the padding columns and the gap hold NaN
// (0x7FC0), which the op must not read. sum (N, C) = the first's value + the second's, the sum the op takes. The
// arrays are a new allocation, freed by the caller.
static inline uint16_t *opcheck_two_bf16_sources(real *sum, const real *src, int64_t N, int C, int64_t ld,
                                                 int64_t stride) {
    uint16_t *two = malloc(sizeof(uint16_t) * (size_t)(2 * stride));
    if (two == NULL) {
        fprintf(stderr, "opcheck_two_bf16_sources: out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < 2 * stride; i++) two[i] = 0x7FC0;
    for (int64_t r = 0; r < N; r++)
        for (int64_t c = 0; c < C; c++) {
            const float x = (float)src[r * C + c];
            two[r * ld + c] = float_to_bf16(x * 0.75f);
            two[stride + r * ld + c] = float_to_bf16(x * -1.5f + (float)(c % 3));
            sum[r * C + c] = (real)bf16_to_float(two[r * ld + c]) + (real)bf16_to_float(two[stride + r * ld + c]);
        }
    return two;
}

#endif
