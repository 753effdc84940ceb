/*
 * test_permute.c - unit tests of MoE token permutation (kernels/cpu/permute.c): the per-expert segment
 * plan on a hand-worked case and on random routings (checked against the plan's defining properties),
 * the gather / unpermute-backward adjoint pair, and the weighted combine with its backward.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cpu/cpu_ops.h"
#include "parallel/comm.h"
#include "parallel/ep.h"

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static double rand_uniform(double lo, double hi) {  // splitmix64 -> [lo, hi)
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * (1.0 / 9007199254740992.0);
}
static void fill_random(real *x, int n) {
    for (int i = 0; i < n; i++) x[i] = (real)rand_uniform(-1, 1);
}

#define ASSERT_NEAR(actual, expected, tol)                                                          \
    do {                                                                                            \
        double a_ = (double)(actual), e_ = (double)(expected);                                      \
        if (!(fabs(a_ - e_) <= (tol))) fail_msg("%s = %.9g, expected %.9g (tol %.2g)", #actual, a_, e_, \
                                                (double)(tol));                                     \
    } while (0)

// ---------------------------------------------------------------------------- plan
// N = 3 tokens, K = 2, E = 5; topk_idx = [[2, 0], [0, 4], [2, 4]]. Experts 1 and 3 get nothing.
//   segment 0: (t0,k1) (t1,k0)  -> rows 0, 1
//   segment 1: empty            -> [2, 2)
//   segment 2: (t0,k0) (t2,k0)  -> rows 2, 3
//   segment 3: empty            -> [4, 4)
//   segment 4: (t1,k1) (t2,k1)  -> rows 4, 5
//   seg_offsets = [0, 2, 2, 4, 4, 6]; seg_token (row -> t) = [0, 1, 0, 2, 1, 2]
//   slot_of ((t,k) -> row): t0k0 2, t0k1 0, t1k0 1, t1k1 4, t2k0 3, t2k1 5 = [2, 0, 1, 4, 3, 5]
static void test_plan_hand_case(void **state) {
    (void)state;
    const int topk_idx[6] = {2, 0, 0, 4, 2, 4};
    int seg_offsets[6], seg_token[6], slot_of[6];
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, 3, 2, 5);
    const int want_offsets[6] = {0, 2, 2, 4, 4, 6};
    const int want_token[6] = {0, 1, 0, 2, 1, 2};
    const int want_slot[6] = {2, 0, 1, 4, 3, 5};
    assert_memory_equal(seg_offsets, want_offsets, sizeof(want_offsets));
    assert_memory_equal(seg_token, want_token, sizeof(want_token));
    assert_memory_equal(slot_of, want_slot, sizeof(want_slot));
}

// Random routings (K distinct experts per token): the plan must satisfy its definition.
//   - segment sizes = number of (t, k) routed to each expert, offsets their prefix sum
//   - slot_of is a permutation of 0 .. N*K-1, seg_token[slot_of[t,k]] = t, and the row lies in the
//     segment of topk_idx[t,k]
//   - inside a segment, rows are in increasing (t, k) order
static void test_plan_random_properties(void **state) {
    (void)state;
    const int N = 50, K = 4, E = 16;
    int topk_idx[50 * 4], seg_offsets[17], seg_token[200], slot_of[200], count[16] = {0};
    int owner[200];  // (t*K + k) that landed on each row
    for (int t = 0; t < N; t++) {
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)rand_uniform(0, E);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= topk_idx[t * K + j] == e;
            } while (dup);
            topk_idx[t * K + k] = e;
            count[e]++;
        }
    }
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E);
    assert_int_equal(seg_offsets[0], 0);
    for (int e = 0; e < E; e++) assert_int_equal(seg_offsets[e + 1] - seg_offsets[e], count[e]);
    for (int r = 0; r < N * K; r++) owner[r] = -1;
    for (int i = 0; i < N * K; i++) {
        const int row = slot_of[i], e = topk_idx[i];
        assert_true(row >= 0 && row < N * K);
        assert_int_equal(owner[row], -1);  // no row used twice
        owner[row] = i;
        assert_int_equal(seg_token[row], i / K);
        assert_true(row >= seg_offsets[e] && row < seg_offsets[e + 1]);
    }
    for (int e = 0; e < E; e++)
        for (int r = seg_offsets[e] + 1; r < seg_offsets[e + 1]; r++) assert_true(owner[r - 1] < owner[r]);
}

// ---------------------------------------------------------------------------- gather and its adjoint
// gather_rows on a hand case: inp rows [10, 11], [20, 21], [30, 31]; src_row [2, 0, 2] ->
// out [30, 31], [10, 11], [30, 31].
static void test_gather_rows_hand_case(void **state) {
    (void)state;
    const real inp[6] = {10, 11, 20, 21, 30, 31};
    const int src[3] = {2, 0, 2};
    real out[6];
    cpu_gather_rows(out, inp, src, 3, 2);
    const real want[6] = {30, 31, 10, 11, 30, 31};
    assert_memory_equal(out, want, sizeof(want));
}

// <gather(x), y> == <x, unpermute_backward(y)> for a random plan: the backward is the adjoint of the
// forward gather (both sides summed in double). unpermute_backward also accumulates onto dinp.
static void test_gather_unpermute_adjoint(void **state) {
    (void)state;
    const int N = 20, K = 3, E = 7, C = 5;
    int topk_idx[20 * 3], seg_offsets[8], seg_token[60], slot_of[60];
    real x[20 * 5], y[60 * 5], gx[60 * 5], dx[20 * 5];
    for (int t = 0; t < N; t++)
        for (int k = 0; k < K; k++) topk_idx[t * K + k] = (t * 5 + k * 2 + (t % 3)) % E;  // distinct per t
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E);
    fill_random(x, N * C);
    fill_random(y, N * K * C);
    cpu_gather_rows(gx, x, seg_token, N * K, C);
    for (int i = 0; i < N * C; i++) dx[i] = 1.0f;
    cpu_moe_unpermute_backward(dx, y, slot_of, N, K, C);
    double lhs = 0, rhs = 0, scale = 0;
    for (int i = 0; i < N * K * C; i++) {
        lhs += (double)gx[i] * (double)y[i];
        scale += fabs((double)gx[i] * (double)y[i]);
    }
    for (int i = 0; i < N * C; i++) rhs += (double)x[i] * ((double)dx[i] - 1.0);
    // dx carries K-term float sums (~1e-7 relative each)
    ASSERT_NEAR(rhs, lhs, 1e-6 * scale);
    // and directly: dx[t] - 1 = sum_k y[slot_of[t,k]], summed here in double
    for (int t = 0; t < N; t++)
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)y[slot_of[t * K + k] * C + c];
            ASSERT_NEAR((double)dx[t * C + c] - 1.0, s, 1e-6);
        }
}

// ---------------------------------------------------------------------------- combine
// N = 2, K = 2, C = 2; expert_out rows (permuted): r0 [1, 2], r1 [3, 4], r2 [5, 6], r3 [7, 8];
// slot_of = [2, 0, 3, 1]; topk_w = [[0.5, 2], [0.25, -1]]; out starts at [1, 1], [0, 0] (+=).
//   out[0] = [1, 1] + 0.5 * r2 + 2 * r0 = [1 + 2.5 + 2, 1 + 3 + 4]     = [5.5, 8]
//   out[1] = [0, 0] + 0.25 * r3 - 1 * r1 = [1.75 - 3, 2 - 4]            = [-1.25, -2]
static void test_combine_forward_hand_case(void **state) {
    (void)state;
    const real expert_out[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const int slot_of[4] = {2, 0, 3, 1};
    const real topk_w[4] = {0.5f, 2.0f, 0.25f, -1.0f};
    real out[4] = {1, 1, 0, 0};
    cpu_moe_combine_forward(out, expert_out, slot_of, topk_w, NULL, 2, 2, 2);
    const real want[4] = {5.5f, 8.0f, -1.25f, -2.0f};
    for (int i = 0; i < 4; i++) ASSERT_NEAR(out[i], want[i], 0);
    // with a residual: added last, the bits of add_inplace after the combine
    const real residual[4] = {0.125f, -3.0f, 10.0f, 0.5f};
    real out2[4] = {1, 1, 0, 0};
    cpu_moe_combine_forward(out2, expert_out, slot_of, topk_w, residual, 2, 2, 2);
    for (int i = 0; i < 4; i++) assert_true(out2[i] == want[i] + residual[i]);
}

// L(expert_out, topk_w) = <dout, combine(expert_out, topk_w)>; the backward must match central
// differences. L is bilinear, so the difference quotient has no truncation error: eps 1e-2 keeps
// float rounding of L (~1e-6) at ~5e-5 in the quotient; tol 2e-4.
static double combine_objective(const real *expert_out, const int *slot_of, const real *topk_w,
                                const real *dout, int N, int K, int C) {
    real *out = calloc((size_t)N * C, sizeof(real));
    cpu_moe_combine_forward(out, expert_out, slot_of, topk_w, NULL, N, K, C);
    double L = 0;
    for (int i = 0; i < N * C; i++) L += (double)dout[i] * (double)out[i];
    free(out);
    return L;
}

// dexpert_out is written: each row of it is exactly w * dout[t] (one rounded product), whatever the buffer held
// before (NaN here: a backward that added to it, or skipped a row, leaves NaN). dtopk_w accumulates: each
// entry is its old value plus the dot product, summed in double in c order and rounded once.
static void check_combine_backward_exact(const real *deo, const real *dw, const real *dw0, const real *dout,
                                         const real *eo, const int *slot_of, const real *w, int N, int K, int C) {
    for (int t = 0; t < N; t++) {
        for (int k = 0; k < K; k++) {
            const int tk = t * K + k, slot = slot_of[tk];
            double dot = 0.0;
            for (int c = 0; c < C; c++) {
                const real want = w[tk] * dout[t * C + c];
                const real got = deo[slot * C + c];
                if (memcmp(&got, &want, sizeof(real)) != 0)
                    fail_msg("dexpert_out[%d, %d] (slot of t = %d, k = %d) = %.9g, expected w * dout = %.9g (written, "
                             "not added to the NaN it held)", slot, c, t, k, (double)got, (double)want);
                dot += (double)dout[t * C + c] * (double)eo[slot * C + c];
            }
            const real want_dw = dw0[tk] + (real)dot;
            if (memcmp(&dw[tk], &want_dw, sizeof(real)) != 0)
                fail_msg("dtopk_w[%d, %d] = %.9g, expected %.9g + dot %.9g = %.9g (accumulated)", t, k, (double)dw[tk],
                         (double)dw0[tk], dot, (double)want_dw);
        }
    }
}

static void test_combine_backward_finite_differences(void **state) {
    (void)state;
    const int N = 6, K = 2, E = 4, C = 3;
    int topk_idx[12], seg_offsets[5], seg_token[12], slot_of[12];
    real eo[12 * 3], w[12], dout[6 * 3], deo[12 * 3], dw[12], dw0[12], dw1[12];
    for (int t = 0; t < N; t++) {
        topk_idx[t * K] = t % E;
        topk_idx[t * K + 1] = (t + 1 + t / 2) % E == t % E ? (t + 2) % E : (t + 1 + t / 2) % E;
    }
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E);
    fill_random(eo, N * K * C);
    fill_random(w, N * K);
    fill_random(dout, N * C);
    for (int i = 0; i < N * K * C; i++) deo[i] = (real)NAN;  // backward writes every row over this
    for (int i = 0; i < N * K; i++) dw[i] = dw0[i] = -0.25f;  // and accumulates onto these
    cpu_moe_combine_backward(deo, dw, dout, eo, slot_of, w, N, K, C);
    check_combine_backward_exact(deo, dw, dw0, dout, eo, slot_of, w, N, K, C);
    const double eps = 1e-2, tol = 2e-4;
    for (int i = 0; i < N * K * C; i++) {
        real saved = eo[i];
        eo[i] = (real)(saved + eps);
        double lp = combine_objective(eo, slot_of, w, dout, N, K, C);
        eo[i] = (real)(saved - eps);
        double lm = combine_objective(eo, slot_of, w, dout, N, K, C);
        eo[i] = saved;
        double numeric = (lp - lm) / ((double)(real)(saved + eps) - (double)(real)(saved - eps));
        ASSERT_NEAR(deo[i], numeric, tol);
    }
    for (int i = 0; i < N * K; i++) {
        real saved = w[i];
        w[i] = (real)(saved + eps);
        double lp = combine_objective(eo, slot_of, w, dout, N, K, C);
        w[i] = (real)(saved - eps);
        double lm = combine_objective(eo, slot_of, w, dout, N, K, C);
        w[i] = saved;
        double numeric = (lp - lm) / ((double)(real)(saved + eps) - (double)(real)(saved - eps));
        ASSERT_NEAR((double)dw[i] + 0.25, numeric, tol);
    }
    // A NULL gradient pointer is skipped and its buffer left alone: without dexpert_out, deo keeps its rows and
    // dtopk_w gets the dot products once more; without dtopk_w, deo is written over NaN again and dw stays.
    memcpy(dw1, dw, sizeof dw);
    cpu_moe_combine_backward(NULL, dw, dout, eo, slot_of, w, N, K, C);
    check_combine_backward_exact(deo, dw, dw1, dout, eo, slot_of, w, N, K, C);
    for (int i = 0; i < N * K * C; i++) deo[i] = (real)NAN;
    cpu_moe_combine_backward(deo, NULL, dout, eo, slot_of, w, N, K, C);
    check_combine_backward_exact(deo, dw, dw1, dout, eo, slot_of, w, N, K, C);
}

// The *_bf16 combine ops (fp8 mode's routed experts keep their outputs as w2's BF16 product, row stride
// round_up(C, 128)): bitwise the FP32 ops on the same values; the rows' padding columns hold NaN, which would show in
// out or dtopk_w if read. C = 200: a partial last 128-column tile.
static void test_combine_bf16_rows(void **state) {
    (void)state;
    enum { N = 9, K = 3, E = 5, C = 200, LD = 256 };
    int topk_idx[N * K], seg_offsets[E + 1], seg_token[N * K], slot_of[N * K];
    for (int t = 0; t < N; t++)
        for (int k = 0; k < K; k++) topk_idx[t * K + k] = (t + 2 * k) % E;
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E);
    static real eo[N * K * C], w[N * K], dout[N * C], res[N * C], out[N * C], out_ref[N * C], dw[N * K], dw_ref[N * K];
    static uint16_t eo16[N * K * LD];
    fill_random(eo, N * K * C), fill_random(w, N * K), fill_random(dout, N * C), fill_random(res, N * C);
    fill_random(out, N * C);
    for (int r = 0; r < N * K; r++)
        for (int c = 0; c < LD; c++) {
            if (c < C) eo[r * C + c] = bf16_to_float(float_to_bf16((float)eo[r * C + c]));
            eo16[r * LD + c] = c < C ? float_to_bf16((float)eo[r * C + c]) : 0x7FC0;
        }
    memcpy(out_ref, out, sizeof out);
    for (int i = 0; i < N * K; i++) dw[i] = dw_ref[i] = (real)0.5;
    cpu_moe_combine_forward(out_ref, eo, slot_of, w, res, N, K, C);
    cpu_moe_combine_forward_bf16(out, NULL, eo16, slot_of, w, res, N, K, C);
    assert_memory_equal(out, out_ref, sizeof out);
    // from a base of BF16 rows (the shared expert's output): out written, the bits of widening base into out first
    static uint16_t base16[N * LD];
    for (int r = 0; r < N; r++)
        for (int c = 0; c < LD; c++) {
            base16[r * LD + c] = c < C ? float_to_bf16((float)dout[r * C + c] * 3.0f) : 0x7FC0;
            if (c < C) out_ref[r * C + c] = bf16_to_float(base16[r * LD + c]);
        }
    for (int i = 0; i < N * C; i++) out[i] = (real)NAN;
    cpu_moe_combine_forward(out_ref, eo, slot_of, w, res, N, K, C);
    cpu_moe_combine_forward_bf16(out, base16, eo16, slot_of, w, res, N, K, C);
    assert_memory_equal(out, out_ref, sizeof out);
    cpu_moe_combine_backward(NULL, dw_ref, dout, eo, slot_of, w, N, K, C);
    cpu_moe_combine_backward_bf16(dw, dout, eo16, slot_of, w, N, K, C);
    assert_memory_equal(dw, dw_ref, sizeof dw);
    for (int i = 0; i < N * K; i++) assert_true(dw[i] != (real)0.5 && isfinite(dw[i]));
}

// ---------------------------------------------------------------------------- EP seam, one rank
// With one rank the EP seam hands back views of the caller's buffers (no copy) and the collectives
// leave their buffers unchanged; the MoE layer calls through it either way.
static void test_ep_single_rank_is_identity(void **state) {
    (void)state;
    const int topk_idx[6] = {2, 0, 0, 4, 2, 4};
    int seg_offsets[6], seg_token[6], slot_of[6];
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, 3, 2, 5);
    real perm_rows[6 * 4], local_out[6 * 4], dperm_out[6 * 4], dlocal_rows[6 * 4];
    fill_random(perm_rows, 24);

    Comm *world = comm_world_single();
    assert_int_equal(world->rank, 0);
    assert_int_equal(world->size, 1);
    EpGroup g;
    ep_group_init(&g, world, 5, DEVICE_CPU);
    assert_int_equal(g.ep_size, 1);
    assert_int_equal(g.experts_per_rank, 5);
    assert_int_equal(ep_expert_owner(&g, 4), 0);
    assert_int_equal(ep_first_local_expert(&g), 0);

    EpBuffers buf = {0};  // zeroed before its first ep_dispatch (parallel/ep.h)
    ep_dispatch(&g, perm_rows, seg_offsets, 4, &buf);
    assert_ptr_equal(buf.rows, perm_rows);
    assert_ptr_equal(buf.seg_offsets, seg_offsets);
    assert_int_equal(buf.n_rows, 6);
    assert_int_equal(buf.C, 4);
    assert_int_equal(buf.n_perm_rows, 6);
    assert_ptr_equal(ep_combine(&g, &buf, local_out), local_out);
    assert_ptr_equal(ep_combine_backward(&g, &buf, dperm_out), dperm_out);
    assert_ptr_equal(ep_dispatch_backward(&g, &buf, dlocal_rows), dlocal_rows);
    ep_buffers_release(&buf);
    assert_null(buf.rows);

    double d[2] = {1.5, -2.0};
    int64_t c[2] = {3, 7};
    real r[2] = {0.25f, 4.0f};
    comm_allreduce_sum_double(world, d, 2);
    comm_allreduce_sum_i64(world, c, 2);
    comm_allreduce_sum_real(world, r, 2);
    comm_barrier(world);
    assert_true(d[0] == 1.5 && d[1] == -2.0 && c[0] == 3 && c[1] == 7 && r[0] == 0.25f && r[1] == 4.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_hand_case),
        cmocka_unit_test(test_plan_random_properties),
        cmocka_unit_test(test_gather_rows_hand_case),
        cmocka_unit_test(test_gather_unpermute_adjoint),
        cmocka_unit_test(test_combine_forward_hand_case),
        cmocka_unit_test(test_combine_backward_finite_differences),
        cmocka_unit_test(test_combine_bf16_rows),
        cmocka_unit_test(test_ep_single_rank_is_identity),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
