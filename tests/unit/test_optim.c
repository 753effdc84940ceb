/*
 * test_optim.c - unit tests of the optimizer pieces: BF16 rounding, the AdamW update with BF16
 * moments, the LR schedules, grad-norm clipping, the aux-loss-free bias update and the flat-buffer
 * reductions (kernels/cpu/bf16.c, kernels/cpu/optim_ops.c, and the optim/ files).
 *
 * Every expected value is either worked by hand in the comment next to it or computed by an
 * independent reference written here: BF16 rounding via frexp/nearbyint arithmetic instead of bit
 * tricks, AdamW in double precision, sums of squares with a plain double loop.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fenv.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/kernels.h"
#include "optim/adamw.h"
#include "optim/bias_balance.h"
#include "optim/clip.h"
#include "optim/lr_schedule.h"

// ---------------------------------------------------------------------------- helpers
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) {  // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_uniform(double lo, double hi) {  // in [lo, hi)
    return lo + (hi - lo) * (double)(rng_next() >> 11) * 0x1.0p-53;
}
// random sign times a magnitude in [lo, hi): non-zero by construction
static double rng_signed(double lo, double hi) {
    double m = rng_uniform(lo, hi);
    return (rng_next() & 1) ? m : -m;
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Reference BF16 rounding of a finite float, by arithmetic rather than bit manipulation: BF16 keeps
// 8 significant bits, so the quantum of x = f * 2^e (f in [0.5, 1)) is 2^(e-8), but never below the
// BF16 subnormal spacing 2^-133 (= 2^-126 / 2^7). Round x / quantum to the nearest integer with ties
// to even (nearbyint in the default FE_TONEAREST mode), scale back; >= 2^128 overflows to infinity.
// Returns the rounded value as a double (exactly representable in BF16).
static double bf16_round_ref(double x) {
    if (x == 0) return x;
    int e;
    frexp(x, &e);
    double quantum = ldexp(1.0, e - 8 > -133 ? e - 8 : -133);
    double r = nearbyint(x / quantum) * quantum;
    if (fabs(r) >= 0x1.0p128) r = r > 0 ? INFINITY : -INFINITY;
    return r;
}
// The BF16 bit pattern of a double that bf16_round_ref produced (top half of its float bits).
static uint16_t bf16_bits_of(double exactly_bf16) {
    uint32_t u = float_bits((float)exactly_bf16);
    assert_int_equal(u & 0xFFFFu, 0);  // the reference result must already be a BF16 value
    return (uint16_t)(u >> 16);
}

// (double)(float)x: rounds a double to FP32. For +, -, * and / of two FP32 operands computed in
// double, this gives exactly the FP32 result (53 >= 2*24 + 2, so double rounding is harmless).
static double f32(double x) { return (double)(float)x; }

// ---------------------------------------------------------------------------- BF16
static void test_bf16_hand_cases(void **state) {
    (void)state;
    fesetround(FE_TONEAREST);
    struct { uint32_t in; uint16_t out; const char *why; } cases[] = {
        {0x3F800000u, 0x3F80, "1.0 is exact"},
        {0x3F808000u, 0x3F80, "tie, kept part 0x3F80 even: round down"},
        {0x3F818000u, 0x3F82, "tie, kept part 0x3F81 odd: round up"},
        {0x3F808001u, 0x3F81, "just above the tie: up"},
        {0x3F807FFFu, 0x3F80, "just below the tie: down"},
        {0xBF818000u, 0xBF82, "negative tie, odd: magnitude up"},
        {0xBF808000u, 0xBF80, "negative tie, even: magnitude down"},
        {0x3FFF8000u, 0x4000, "tie, odd, fraction carries into the exponent: 2.0"},
        {0x7F800000u, 0x7F80, "+inf"},
        {0xFF800000u, 0xFF80, "-inf"},
        {0x7F7FFFFFu, 0x7F80, "largest float rounds up past the largest BF16: +inf"},
        {0x7F7F7FFFu, 0x7F7F, "largest BF16 stays (below the tie)"},
        {0x00000000u, 0x0000, "+0"},
        {0x80000000u, 0x8000, "-0"},
        {0x00000001u, 0x0000, "smallest subnormal rounds to 0"},
        {0x00008000u, 0x0000, "subnormal tie, even: 0"},
        {0x00018000u, 0x0002, "subnormal tie, odd: up"},
        {0x0000C000u, 0x0001, "subnormal above the tie: smallest BF16 subnormal"},
        {0x007FFFFFu, 0x0080, "largest subnormal rounds up to the smallest normal"},
        {0x80018000u, 0x8002, "negative subnormal tie, odd"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = float_to_bf16(bits_float(cases[i].in));
        if (got != cases[i].out) {
            fail_msg("float_to_bf16(0x%08X) = 0x%04X, expected 0x%04X (%s)", cases[i].in, got, cases[i].out,
                     cases[i].why);
        }
        // and the independent reference agrees with the hand-worked answer
        assert_int_equal(bf16_bits_of(bf16_round_ref(bits_float(cases[i].in))), cases[i].out);
    }
    assert_true(bf16_to_float(0x3F80) == 1.0f);
    assert_true(bf16_to_float(0xC040) == -3.0f);
    assert_true(bf16_to_float(0x0001) == 0x1.0p-133f);
}

static void test_bf16_nan(void **state) {
    (void)state;
    // quiet, signalling (payload only in the low bits, which truncation alone would turn into inf)
    uint32_t nans[] = {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u, 0xFFC12345u, 0x7FFFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = float_to_bf16(bits_float(nans[i]));
        assert_true(isnan(bf16_to_float(h)));
        assert_int_equal(h & 0x0040, 0x0040);                  // quiet bit set
        assert_int_equal(h & 0x8000, (nans[i] >> 16) & 0x8000); // sign kept
    }
}

// Every finite BF16 value converts to float and back unchanged; a million random finite floats
// round as the arithmetic reference says.
static void test_bf16_against_reference(void **state) {
    (void)state;
    fesetround(FE_TONEAREST);
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = bf16_to_float((uint16_t)h);
        assert_int_equal(float_bits(f), h << 16);
        if (!isnan(f)) assert_int_equal(float_to_bf16(f), h);
    }
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 4 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  // force many exact ties
        float f = bits_float(u);
        if (!isfinite(f)) continue;
        uint16_t want = bf16_bits_of(bf16_round_ref(f));
        if (float_to_bf16(f) != want) {
            fail_msg("float_to_bf16(0x%08X) = 0x%04X, reference 0x%04X", u, float_to_bf16(f), want);
        }
    }
}

// ---------------------------------------------------------------------------- AdamW
// Independent reference of one AdamW step for one element, documented in kernels/cpu/optim_ops.c:
// the moment arithmetic is FP32 (emulated with f32() on each operation) because the BF16 store
// makes the rounding of the FP32 moment part of the result; the bias correction, the division and
// the parameter update are in double. p, m, v are the reference state (m, v hold BF16 values; p is
// rounded to FP32 after the update because the master weight is stored in FP32).
typedef struct {
    double beta1, beta2, eps;  // the FP32 values of the hyperparameters, as doubles
} RefHyper;
static void ref_adamw(double *p, double *m, double *v, float grad, double lr, double wd, float grad_scale,
                      int t, const RefHyper *h) {
    double g = f32((double)grad * (double)grad_scale);
    double m32 = f32(f32(h->beta1 * *m) + f32((1.0 - h->beta1) * g));
    double v32 = f32(f32(h->beta2 * *v) + f32((1.0 - h->beta2) * f32(g * g)));
    *m = bf16_round_ref(m32);
    *v = bf16_round_ref(v32);
    double mhat = m32 / (1.0 - pow(h->beta1, t));
    double vhat = v32 / (1.0 - pow(h->beta2, t));
    *p = f32(*p - lr * (mhat / (sqrt(vhat) + h->eps) + wd * *p));
}

static OptimConfig test_optim_config(void) {
    OptimConfig o;
    memset(&o, 0, sizeof o);
    o.lr = 1e-2;
    o.min_lr = 1e-3;
    o.beta1 = 0.9;
    o.beta2 = 0.95;
    o.eps = 1e-8;
    o.weight_decay = 0.1;
    return o;
}

// 20 steps on 1000 random parameters in three groups (decay, no decay, decay), random non-zero
// gradients of varying magnitude, a changing LR and a grad_scale != 1: parameters within 1e-6
// relative of the double reference, moments bit-identical to the reference's BF16 moments.
static void test_adamw_matches_reference(void **state) {
    (void)state;
    fesetround(FE_TONEAREST);
    enum { N = 1000, STEPS = 20 };
    OptimConfig cfg = test_optim_config();
    AdamW opt;
    adamw_init(&opt, DEVICE_CPU, N, &cfg);
    for (int i = 0; i < N; i++) assert_int_equal(opt.m[i] | opt.v[i], 0);
    ParamGroup groups[3] = {{0, 300, 1}, {300, 50, 0}, {350, 650, 1}};
    RefHyper h = {(float)cfg.beta1, (float)cfg.beta2, (float)cfg.eps};

    real *params = malloc(N * sizeof *params);
    real *grads = malloc(N * sizeof *grads);
    double *ref_p = malloc(N * sizeof *ref_p), *ref_m = calloc(N, sizeof *ref_m), *ref_v = calloc(N, sizeof *ref_v);
    for (int i = 0; i < N; i++) {
        params[i] = (real)rng_signed(0.5, 1.5);
        ref_p[i] = (double)params[i];
    }
    for (int t = 1; t <= STEPS; t++) {
        float lr = (float)(cfg.lr * (0.5 + 0.5 * t / STEPS));
        float grad_scale = t % 3 == 0 ? 1.0f : 0.37f;
        double grad_mag = (t % 5 == 0) ? 1e-3 : 1.0;  // some steps much smaller: v decays across them
        for (int i = 0; i < N; i++) grads[i] = (real)rng_signed(0.01 * grad_mag, grad_mag);
        adamw_step(&opt, params, grads, groups, 3, NULL, 0, lr, grad_scale, t);
        for (int i = 0; i < N; i++) {
            double wd = (i >= 300 && i < 350) ? 0.0 : (double)(float)cfg.weight_decay;
            ref_adamw(&ref_p[i], &ref_m[i], &ref_v[i], (float)grads[i], lr, wd, grad_scale, t, &h);
        }
    }
    for (int i = 0; i < N; i++) {
        double rel = fabs((double)params[i] - ref_p[i]) / fabs(ref_p[i]);
        if (rel > 1e-6) fail_msg("param %d: %.9g, reference %.9g (rel err %.3g)", i, (double)params[i], ref_p[i], rel);
        if (opt.m[i] != bf16_bits_of(ref_m[i]) || opt.v[i] != bf16_bits_of(ref_v[i])) {
            fail_msg("moments of %d: m 0x%04X v 0x%04X, reference m 0x%04X v 0x%04X", i, opt.m[i], opt.v[i],
                     bf16_bits_of(ref_m[i]), bf16_bits_of(ref_v[i]));
        }
    }
    free(params); free(grads); free(ref_p); free(ref_m); free(ref_v);
    adamw_free(&opt);
}

// Hand-worked first step: from m = v = 0 at t = 1, mhat = g and vhat = g^2 (bias correction undoes
// the (1 - beta) factors), so upd = g/(|g| + eps) = sign(g) up to 2e-8: every parameter moves by
// lr against its gradient's sign, whatever the gradient's size, plus lr*wd*p in decayed groups.
static void test_adamw_first_step_by_hand(void **state) {
    (void)state;
    OptimConfig cfg = test_optim_config();
    AdamW opt;
    adamw_init(&opt, DEVICE_CPU, 4, &cfg);
    ParamGroup groups[2] = {{0, 2, 0}, {2, 2, 1}};
    real params[4] = {1.0f, -0.5f, 1.0f, -0.5f};
    real grads[4] = {0.5f, -2.0f, 0.25f, 3.0f};
    adamw_step(&opt, params, grads, groups, 2, NULL, 0, 0.01f, 1.0f, 1);
    // no decay: 1 - 0.01 = 0.99;  -0.5 + 0.01 = -0.49
    assert_float_equal(params[0], 0.99, 1e-7);
    assert_float_equal(params[1], -0.49, 1e-7);
    // decay 0.1: 1 - 0.01*(1 + 0.1*1) = 0.989;  -0.5 - 0.01*(1 + 0.1*(-0.5)) = -0.5095
    assert_float_equal(params[2], 0.989, 1e-7);
    assert_float_equal(params[3], -0.5095, 1e-7);
    // stored moments: m = 0.1 g, v = 0.05 g^2, rounded to BF16: m[0] = 0.05 -> 0x3D4D (0.05004883),
    // v[1] = 0.05 * 4 = 0.2 -> 0x3E4D (0.20019531)
    assert_int_equal(opt.m[0], 0x3D4D);
    assert_int_equal(opt.v[1], 0x3E4D);
    adamw_free(&opt);
}

// Zero gradient: m, v stay 0, so a no-decay group is left bit-for-bit unchanged and a decayed group
// only shrinks: p - lr*(wd*p).
static void test_adamw_zero_grad_only_decay(void **state) {
    (void)state;
    OptimConfig cfg = test_optim_config();
    enum { N = 64 };
    AdamW opt;
    adamw_init(&opt, DEVICE_CPU, N, &cfg);
    ParamGroup groups[2] = {{0, 32, 1}, {32, 32, 0}};
    real params[N], grads[N];
    double before[N];
    for (int i = 0; i < N; i++) {
        params[i] = (real)rng_signed(0.1, 2.0);
        before[i] = (double)params[i];
        grads[i] = 0;
    }
    for (int t = 1; t <= 3; t++) {
        adamw_step(&opt, params, grads, groups, 2, NULL, 0, 0.01f, 1.0f, t);
        for (int i = 0; i < 32; i++) before[i] -= (double)0.01f * ((double)0.1f * before[i]);
    }
    for (int i = 0; i < 32; i++) assert_float_equal(params[i], before[i], 1e-7 * fabs(before[i]));
    for (int i = 32; i < N; i++) assert_true(params[i] == (real)before[i]);
    for (int i = 0; i < N; i++) assert_int_equal(opt.m[i] | opt.v[i], 0);
    adamw_free(&opt);
}

// grad_scale is applied to the gradient before anything else: scale s with gradients G gives the
// same bits as scale 1 with gradients fl(s*G) (the FP32 product is the first operation either way).
static void test_adamw_grad_scale_is_first(void **state) {
    (void)state;
    OptimConfig cfg = test_optim_config();
    enum { N = 257 };
    AdamW a, b;
    adamw_init(&a, DEVICE_CPU, N, &cfg);
    adamw_init(&b, DEVICE_CPU, N, &cfg);
    ParamGroup group = {0, N, 1};
    real pa[N], pb[N], ga[N], gb[N];
    for (int i = 0; i < N; i++) pa[i] = pb[i] = (real)rng_signed(0.5, 1.5);
    for (int t = 1; t <= 5; t++) {
        for (int i = 0; i < N; i++) {
            ga[i] = (real)rng_signed(0.01, 1.0);
            gb[i] = (real)((float)ga[i] * 0.25f);
        }
        adamw_step(&a, pa, ga, &group, 1, NULL, 0, 0.01f, 0.25f, t);
        adamw_step(&b, pb, gb, &group, 1, NULL, 0, 0.01f, 1.0f, t);
    }
    assert_memory_equal(pa, pb, sizeof pa);
    assert_memory_equal(a.m, b.m, N * sizeof(uint16_t));
    assert_memory_equal(a.v, b.v, N * sizeof(uint16_t));
    adamw_free(&a);
    adamw_free(&b);
}

// Copy ranges (train/linear.h linear_bf16_copy_ranges): the update that writes a range's BF16 copy in its pass
// (kernels.h adamw_update_bf16_copy) gives the weights and moments of the plain update bit for bit, and the copy is
// what bf16_round_array makes of the updated weights afterwards. The ranges lie in the two decayed groups, with plain
// runs beside and between them and an undecayed group in between, one of them at the start of its group.
static void test_adamw_copy_ranges(void **state) {
    (void)state;
    OptimConfig cfg = test_optim_config();
    enum { N = 40000 };
    ParamGroup groups[3] = {{0, 30000, 1}, {30000, 50, 0}, {30050, N - 30050, 1}};
    AdamwCopyRange r[3] = {{.offset = 100, .n = 18201}, {.offset = 18301, .n = 4000}, {.offset = 30050, .n = 8192}};
    for (int k = 0; k < 3; k++) r[k].b = malloc((size_t)r[k].n * sizeof(uint16_t));
    AdamW a, b;
    adamw_init(&a, DEVICE_CPU, N, &cfg);
    adamw_init(&b, DEVICE_CPU, N, &cfg);
    real *pa = malloc(N * sizeof *pa), *pb = malloc(N * sizeof *pb), *g = malloc(N * sizeof *g);
    uint16_t *copy = malloc(N * sizeof *copy);
    for (int i = 0; i < N; i++) pa[i] = pb[i] = (real)rng_signed(0.01, 1.5);
    for (int t = 1; t <= 3; t++) {
        for (int i = 0; i < N; i++) g[i] = (real)rng_signed(1e-4, 1.0);
        adamw_step(&a, pa, g, groups, 3, r, 3, 0.01f, 0.5f, t);
        adamw_step(&b, pb, g, groups, 3, NULL, 0, 0.01f, 0.5f, t);
        assert_memory_equal(pa, pb, N * sizeof *pa);
        assert_memory_equal(a.m, b.m, N * sizeof(uint16_t));
        assert_memory_equal(a.v, b.v, N * sizeof(uint16_t));
        for (int k = 0; k < 3; k++) {
            bf16_round_array(DEVICE_CPU, copy, pb + r[k].offset, r[k].n);
            assert_memory_equal(r[k].b, copy, (size_t)r[k].n * sizeof *copy);
        }
    }
    for (int k = 0; k < 3; k++) free(r[k].b);
    free(pa), free(pb), free(g), free(copy);
    adamw_free(&a);
    adamw_free(&b);
}

// ---------------------------------------------------------------------------- LR schedule
static void assert_rel(double got, double want, double tol) {
    if (fabs(got - want) > tol * fabs(want)) fail_msg("got %.17g, expected %.17g", got, want);
}

static void test_lr_cosine(void **state) {
    (void)state;
    OptimConfig o = test_optim_config();
    o.lr = 1e-3;
    o.min_lr = 1e-4;
    o.warmup_steps = 10;
    o.schedule = LR_COSINE;
    const int total = 111;  // decay over steps 10..110: 100 intervals
    assert_rel(lr_at(&o, 0, total), 1e-4, 1e-12);     // 1e-3 * 1/10
    assert_rel(lr_at(&o, 4, total), 5e-4, 1e-12);     // 1e-3 * 5/10
    assert_rel(lr_at(&o, 9, total), 1e-3, 1e-12);     // end of warm-up: peak
    assert_rel(lr_at(&o, 10, total), 1e-3, 1e-12);    // cosine starts at the peak
    assert_rel(lr_at(&o, 35, total), 8.6819805153394638e-4, 1e-12);  // p = 1/4: 1e-4 + 9e-4*(1+cos(pi/4))/2
    assert_rel(lr_at(&o, 60, total), 5.5e-4, 1e-12);  // p = 1/2: (1e-3 + 1e-4) / 2
    assert_rel(lr_at(&o, 110, total), 1e-4, 1e-12);   // last step: min_lr
    assert_rel(lr_at(&o, 500, total), 1e-4, 1e-12);   // past the end: clamped
    for (int s = 10; s < total - 1; s++) assert_true(lr_at(&o, s + 1, total) < lr_at(&o, s, total));
    o.warmup_steps = 0;
    assert_rel(lr_at(&o, 0, 101), 1e-3, 1e-12);       // no warm-up: the first step is the peak
    assert_rel(lr_at(&o, 50, 101), 5.5e-4, 1e-12);
}

static void test_lr_wsd(void **state) {
    (void)state;
    OptimConfig o = test_optim_config();
    o.lr = 1e-3;
    o.min_lr = 1e-4;
    o.warmup_steps = 10;
    o.schedule = LR_WSD;
    o.decay_frac = 0.2;
    const int total = 100;  // 20 decay steps: 80..99
    assert_rel(lr_at(&o, 0, total), 1e-4, 1e-12);
    assert_rel(lr_at(&o, 9, total), 1e-3, 1e-12);
    for (int s = 10; s < 80; s++) assert_true(lr_at(&o, s, total) == 1e-3);  // stable phase: exactly lr
    assert_rel(lr_at(&o, 80, total), 9.55e-4, 1e-12);  // 1e-3 - 9e-4 * 1/20
    assert_rel(lr_at(&o, 89, total), 5.5e-4, 1e-12);   // 1e-3 - 9e-4 * 10/20
    assert_rel(lr_at(&o, 99, total), 1e-4, 1e-12);     // last step: min_lr
    // linear: equal decrements of 9e-4/20 = 4.5e-5
    for (int s = 80; s < 99; s++) assert_rel(lr_at(&o, s, total) - lr_at(&o, s + 1, total), 4.5e-5, 1e-9);
    o.decay_frac = 0.0;
    assert_true(lr_at(&o, 99, total) == 1e-3);  // no decay phase
}

// ---------------------------------------------------------------------------- clipping
static void test_clip(void **state) {
    (void)state;
    real g[2] = {3.0f, -4.0f};
    assert_true(grad_global_norm(DEVICE_CPU, g, 2) == 5.0);
    assert_true(grad_norm_from_sum_squares(25.0) == 5.0);
    assert_true(clip_scale(2.0, 1.0) == (float)(1.0 / 2.000001));  // 1 / (2 + 1e-6)
    assert_true(clip_scale(10.0, 2.5) == (float)(2.5 / 10.000001));
    assert_true(clip_scale(0.5, 1.0) == 1.0f);   // under the limit: no change
    assert_true(clip_scale(1e9, 0.0) == 1.0f);   // 0 = clipping off
    assert_true(clip_scale(0.0, 1.0) == 1.0f);
    assert_true(isnan(clip_scale(INFINITY, 1.0)));  // never a silent 0 for a broken norm

    enum { N = 5000 };
    real *x = malloc(N * sizeof *x);
    double want = 0;
    for (int i = 0; i < N; i++) {
        x[i] = (real)rng_signed(0.001, 3.0);
        want += (double)x[i] * (double)x[i];
    }
    assert_rel(grad_global_norm(DEVICE_CPU, x, N), sqrt(want), 1e-13);
    free(x);
}

// ---------------------------------------------------------------------------- bias balance
static void test_bias_update_sign_rule(void **state) {
    (void)state;
    // loads 10, 30, 20, 20: mean 20. Expert 0 under-loaded -> +gamma, expert 1 over-loaded -> -gamma,
    // experts 2 and 3 exactly at the mean -> unchanged. gamma = 2^-10 keeps every sum exact.
    int64_t counts[4] = {10, 30, 20, 20};
    real bias[4] = {0.25f, 0.25f, -0.5f, 0.0f};
    bias_update(bias, counts, 4, 0x1.0p-10);
    assert_true(bias[0] == 0.25f + 0x1.0p-10f);
    assert_true(bias[1] == 0.25f - 0x1.0p-10f);
    assert_true(bias[2] == -0.5f);
    assert_true(bias[3] == 0.0f);
    // non-integer mean 5/3: load 1 goes up, loads 2 go down; gamma = 0.001 as in DeepSeek-V3
    int64_t c3[3] = {1, 2, 2};
    real b3[3] = {0.1f, 0.2f, -0.3f};
    bias_update(b3, c3, 3, 0.001);
    assert_float_equal(b3[0], 0.101, 3e-8);
    assert_float_equal(b3[1], 0.199, 3e-8);
    assert_float_equal(b3[2], -0.301, 3e-8);
    // max/mean load: 30 / 20
    assert_true(max_mean_load(counts, 4) == 1.5);
    int64_t zeros[2] = {0, 0};
    assert_true(max_mean_load(zeros, 2) == 0.0);
    int64_t one_hot[4] = {0, 0, 12, 0};
    assert_true(max_mean_load(one_hot, 4) == 4.0);  // all on one of E experts: E
}

// ---------------------------------------------------------------------------- reductions
static void test_sum_squares_and_helpers(void **state) {
    (void)state;
    enum { N = 100003 };  // several 16384-element chunks plus a partial one
    real *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y), *y0 = malloc(N * sizeof *y0);
    double want = 0;
    for (int i = 0; i < N; i++) {
        x[i] = (real)rng_signed(1e-3, 10.0);
        y[i] = y0[i] = (real)rng_signed(1e-3, 10.0);
        want += (double)x[i] * (double)x[i];
    }
    assert_rel(cpu_sum_squares(x, N), want, 1e-13);
    assert_rel(sum_squares(DEVICE_CPU, x, 7), (double)x[0] * x[0] + (double)x[1] * x[1] + (double)x[2] * x[2] +
               (double)x[3] * x[3] + (double)x[4] * x[4] + (double)x[5] * x[5] + (double)x[6] * x[6], 1e-15);
    assert_true(cpu_sum_squares(x, 0) == 0.0);
    // fixed order: the same bits with 1 thread and with 3
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    double one = cpu_sum_squares(x, N);
    omp_set_num_threads(3);
    double three = cpu_sum_squares(x, N);
    omp_set_num_threads(saved);
    assert_memory_equal(&one, &three, sizeof one);

    cpu_add_inplace(y, x, N);
    for (int i = 0; i < N; i++) assert_true(y[i] == (real)(y0[i] + x[i]));
    cpu_scale_inplace(y, (real)0.3, N);
    for (int i = 0; i < N; i++) assert_true(y[i] == (real)((real)(y0[i] + x[i]) * (real)0.3));
    free(x); free(y); free(y0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_hand_cases),
        cmocka_unit_test(test_bf16_nan),
        cmocka_unit_test(test_bf16_against_reference),
        cmocka_unit_test(test_adamw_matches_reference),
        cmocka_unit_test(test_adamw_first_step_by_hand),
        cmocka_unit_test(test_adamw_zero_grad_only_decay),
        cmocka_unit_test(test_adamw_grad_scale_is_first),
        cmocka_unit_test(test_adamw_copy_ranges),
        cmocka_unit_test(test_lr_cosine),
        cmocka_unit_test(test_lr_wsd),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_bias_update_sign_rule),
        cmocka_unit_test(test_sum_squares_and_helpers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
