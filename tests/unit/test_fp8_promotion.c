/*
 * test_fp8_promotion.c - "why promotion matters": the experiment behind the FP8 recipe's rule that
 * partial sums are promoted to FP32 every 128 elements of K (DESIGN.md section 4, docs/fp8.md).
 *
 * The DeepSeek-V3 report says H800 tensor cores keep only about 14 bits when they add aligned FP8
 * products, which for K = 4096 gives errors near 2%. cpu_fp8_dot_emulated (kernels/cpu/fp8.c) models
 * that accumulator: after every addition the running sum is truncated towards zero to 14 significant
 * bits. On the same quantised operands (X in 1x128 tiles, W in 128x128 blocks, as in Fprop), for
 * K = 4096 dot products over many random rows, this test measures max |error| / sum |a b| against the
 * exact (double) product of the dequantised operands:
 *   - without promotion: one limited accumulator over all 4096 products (each carrying its scales);
 *   - with promotion every 128: the limited accumulator inside each 128-block, then the block sum
 *     promoted to FP32, times its scales, into an FP32 accumulator (the recipe's arithmetic).
 * It asserts the first is at least 10x the second, prints both, and runs a negative control: the
 * promoted path with its promotion flag off must fail the same assertion. A last check ties the
 * emulation to the real GEMM: with exact block sums it equals fp8_gemm_wgrad bit for bit.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "opcheck.h"

enum { ROWS = 32, COLS = 16, K = 4096, KB = K / 128, KB4 = KB, ACC_BITS = 14 };
#define REQUIRED_GAIN 10.0

typedef struct {
    uint8_t *qx, *qw;  // (ROWS, K), (128, K): X in 1x128 tiles, W (COLS rows used) in 128x128 blocks
    float *sx, *sw;    // (KB, ROWS), (1, KB4)
} Operands;

// X (ROWS, K) and W (COLS, K) random: zero-mean values in (-1, 1), or, with positive != 0, values in
// (0, 1) (like activations after a ReLU-type function: the sum then grows steadily with K).
static Operands make_operands(uint64_t seed, int positive) {
    Operands o;
    real *x = malloc(sizeof(real) * ROWS * K), *w = malloc(sizeof(real) * COLS * K);
    o.qx = malloc((size_t)ROWS * K);
    o.qw = malloc((size_t)128 * K);
    o.sx = malloc(sizeof(float) * KB * ROWS);
    o.sw = malloc(sizeof(float) * KB4);
    assert_true(x && w && o.qx && o.qw && o.sx && o.sw);
    const double lo = positive ? 0.0 : -1.0;
    opcheck_fill(x, (size_t)ROWS * K, seed, lo, 1.0);
    opcheck_fill(w, (size_t)COLS * K, seed + 1, lo, 1.0);
    char err[256];
    assert_int_equal(fp8_quantize_1x128(DEVICE_CPU, o.qx, o.sx, x, ROWS, K, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x128(DEVICE_CPU, o.qw, NULL, o.sw, w, COLS, K, err, sizeof err), 0);
    free(x);
    free(w);
    return o;
}

static void free_operands(Operands *o) {
    free(o->qx);
    free(o->qw);
    free(o->sx);
    free(o->sw);
}

// max over the ROWS x COLS dot products of |emulated - exact| / sum_k |a_k b_k|, where a, b are the
// dequantised values q * s and exact is their dot product in double.
static double max_relative_error(const Operands *o, int acc_bits, int promote) {
    double worst = 0;
    for (int t = 0; t < ROWS; t++) {
        float sa[KB], sb[KB];
        for (int kb = 0; kb < KB; kb++) {
            sa[kb] = o->sx[kb * ROWS + t];
            sb[kb] = o->sw[kb];  // block row 0 of W
        }
        const uint8_t *qa = o->qx + (size_t)t * K;
        for (int n = 0; n < COLS; n++) {
            const uint8_t *qb = o->qw + (size_t)n * K;
            double exact = 0, abs_sum = 0;
            for (int k = 0; k < K; k++) {
                const double p = (double)fp8_e4m3_to_float(qa[k]) * sa[k / 128] *
                                 ((double)fp8_e4m3_to_float(qb[k]) * sb[k / 128]);
                exact += p;
                abs_sum += fabs(p);
            }
            const double got = cpu_fp8_dot_emulated(qa, sa, qb, sb, K, acc_bits, promote);
            worst = fmax(worst, fabs(got - exact) / abs_sum);
        }
    }
    return worst;
}

// The claim under test: promotion every 128 elements cuts the worst error at least REQUIRED_GAIN-fold.
static int promotion_helps(double error_unpromoted, double error_promoted) {
    return error_unpromoted >= REQUIRED_GAIN * error_promoted;
}

// The recipe's path, with its promotion switched by a flag (the negative control turns it off).
static double promoted_path_error(const Operands *o, int promotion_enabled) {
    return max_relative_error(o, ACC_BITS, promotion_enabled);
}

static void run_experiment(const char *data, uint64_t seed, int positive) {
    Operands o = make_operands(seed, positive);
    const double unpromoted = max_relative_error(&o, ACC_BITS, 0);
    const double promoted = promoted_path_error(&o, 1);
    const double exact_blocks = max_relative_error(&o, 0, 1);  // exact block sums: the CPU GEMM itself
    printf("  promotion, K = %d, %s data, %d-bit accumulator, max |err| / sum|ab| over %d dot products:\n"
           "    without promotion %.3e   promoted every 128 %.3e   (ratio %.0f)   exact block sums %.3e\n",
           K, data, ACC_BITS, ROWS * COLS, unpromoted, promoted, unpromoted / promoted, exact_blocks);
    assert_true(promotion_helps(unpromoted, promoted));
    // The exact-block path only rounds in FP32: (KB + 3) 2^-24 relative (docs/fp8.md).
    assert_true(exact_blocks <= (KB + 3) * 0x1p-24);
    // Negative control: the same assertion fails when the promoted path does not promote.
    const double control = promoted_path_error(&o, 0);
    printf("    negative control (promotion off in the promoted path) %.3e: ratio %.2f, assertion fails as it must\n",
           control, unpromoted / control);
    assert_false(promotion_helps(unpromoted, control));
    free_operands(&o);
}

static void test_promotion_zero_mean(void **state) {
    (void)state;
    run_experiment("zero-mean", 71, 0);
}

static void test_promotion_positive(void **state) {
    (void)state;
    run_experiment("positive", 73, 1);
}

// The emulation with exact block sums (acc_bits = 0, promote = 1) is the GEMMs' arithmetic: it equals
// fp8_gemm_wgrad (whose operands are contiguous along the contraction axis) bit for bit.
static void test_emulation_matches_gemm(void **state) {
    (void)state;
    enum { T = 512, N = 8, C = 12, TB = T / 128 };
    real *dy = malloc(sizeof(real) * T * N), *x = malloc(sizeof(real) * T * C);
    real *dw = calloc((size_t)N * C, sizeof(real));
    uint8_t *qdyt = malloc((size_t)N * T), *qxt = malloc((size_t)C * T);
    float *sdyt = malloc(sizeof(float) * TB * N), *sxt = malloc(sizeof(float) * TB * C);
    assert_true(dy && x && dw && qdyt && qxt && sdyt && sxt);
    opcheck_fill_nonzero(dy, (size_t)T * N, 81, 0.001, 1.0);
    opcheck_fill_nonzero(x, (size_t)T * C, 82, 0.001, 3.0);
    char err[256];
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, qdyt, sdyt, dy, T, N, err, sizeof err), 0);
    assert_int_equal(fp8_quantize_128x1_transposed(DEVICE_CPU, qxt, sxt, x, T, C, err, sizeof err), 0);
    fp8_gemm_wgrad(DEVICE_CPU, dw, qdyt, sdyt, qxt, sxt, T, N, C);
    for (int n = 0; n < N; n++) {
        for (int c = 0; c < C; c++) {
            float sa[TB], sb[TB];
            for (int tb = 0; tb < TB; tb++) {
                sa[tb] = sdyt[tb * N + n];
                sb[tb] = sxt[tb * C + c];
            }
            const float e = cpu_fp8_dot_emulated(qdyt + (size_t)n * T, sa, qxt + (size_t)c * T, sb, T, 0, 1);
            assert_memory_equal(&e, &dw[n * C + c], sizeof e);
        }
    }
    free(dy); free(x); free(dw); free(qdyt); free(qxt); free(sdyt); free(sxt);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_promotion_zero_mean),
        cmocka_unit_test(test_promotion_positive),
        cmocka_unit_test(test_emulation_matches_gemm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
