/*
 * test_profile.c - the phase profiler (kernels/profile.h) on the CPU: off means all zeros; nested
 * phases charge each interval to the innermost phase only, checked against busy-waits of known length
 * measured by an independent clock (CLOCK_MONOTONIC); an other-GEMM phase inside an expert-GEMM phase
 * is charged to the expert phase; collect resets the times; the op timers (profile_op_begin/end) time
 * whole ops beside the phases inside them, count them by chunk and kind, and start from zero at enable;
 * profile_current_phase names the phase time accrues to.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <cmocka.h>

#include "kernels/profile.h"

static double clock_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Spins for ms milliseconds of wall time (sleeping could overshoot by a scheduler tick).
static void busy_wait_ms(double ms) {
    double end = clock_s() + 1e-3 * ms;
    volatile double sink = 0;
    while (clock_s() < end) sink += 1.0;
}

static void test_off_gives_zeros(void **state) {
    (void)state;
    profile_enable(DEVICE_CPU, 0);
    profile_begin(PHASE_ATTENTION);
    busy_wait_ms(5);
    profile_end(PHASE_ATTENTION);
    double s[PHASE_COUNT];
    for (int p = 0; p < PHASE_COUNT; p++) s[p] = 123.0;
    profile_step_collect(s);
    for (int p = 0; p < PHASE_COUNT; p++) assert_true(s[p] == 0.0);
    assert_true(profile_peak_memory_bytes() == 0.0);
}

// expert GEMM [ 30 ms | quantisation 20 ms | 10 ms ], then attention 15 ms, with 10 ms outside any
// phase: expert 40 ms (its quantisation excluded), quantisation 20 ms, attention 15 ms, the rest 0.
static void test_nested_innermost(void **state) {
    (void)state;
    profile_enable(DEVICE_CPU, 1);
    double t0 = clock_s();
    profile_begin(PHASE_EXPERT_GEMM);
    busy_wait_ms(30);
    profile_begin(PHASE_QUANTISE);
    busy_wait_ms(20);
    profile_end(PHASE_QUANTISE);
    busy_wait_ms(10);
    profile_end(PHASE_EXPERT_GEMM);
    busy_wait_ms(10);  // no phase open: charged to nobody
    profile_begin(PHASE_ATTENTION);
    busy_wait_ms(15);
    profile_end(PHASE_ATTENTION);
    double wall_ms = 1e3 * (clock_s() - t0);
    double s[PHASE_COUNT];
    profile_step_collect(s);
    double ms[PHASE_COUNT], sum = 0;
    for (int p = 0; p < PHASE_COUNT; p++) {
        ms[p] = 1e3 * s[p];
        sum += ms[p];
    }
    assert_true(ms[PHASE_EXPERT_GEMM] >= 0.8 * 40 && ms[PHASE_EXPERT_GEMM] < 40 + 0.8 * 20);  // excludes inner
    assert_true(ms[PHASE_QUANTISE] >= 0.8 * 20 && ms[PHASE_QUANTISE] < 20 + 0.8 * 10);
    assert_true(ms[PHASE_ATTENTION] >= 0.8 * 15 && ms[PHASE_ATTENTION] < 15 + 0.8 * 10);
    assert_true(ms[PHASE_OTHER_GEMM] == 0 && ms[PHASE_PERMUTE] == 0 && ms[PHASE_OPTIMIZER] == 0);
    assert_true(sum <= wall_ms - 0.8 * 10);  // the unmarked 10 ms is in no phase, nothing counted twice
    assert_true(profile_peak_memory_bytes() > 0);  // peak RSS of this process
    // collect reset the times
    profile_step_collect(s);
    for (int p = 0; p < PHASE_COUNT; p++) assert_true(s[p] == 0.0);
    profile_enable(DEVICE_CPU, 0);
}

// linear.c opens an other-GEMM phase for every Linear; under moe.c's expert phase it is an expert GEMM.
static void test_other_gemm_inside_expert(void **state) {
    (void)state;
    profile_enable(DEVICE_CPU, 1);
    profile_begin(PHASE_OTHER_GEMM);
    busy_wait_ms(10);
    profile_end(PHASE_OTHER_GEMM);
    profile_begin(PHASE_EXPERT_GEMM);
    profile_begin(PHASE_OTHER_GEMM);
    busy_wait_ms(20);
    profile_begin(PHASE_QUANTISE);
    busy_wait_ms(10);
    profile_end(PHASE_QUANTISE);
    profile_end(PHASE_OTHER_GEMM);
    profile_end(PHASE_EXPERT_GEMM);
    double s[PHASE_COUNT];
    profile_step_collect(s);
    assert_true(1e3 * s[PHASE_OTHER_GEMM] >= 0.8 * 10 && 1e3 * s[PHASE_OTHER_GEMM] < 10 + 0.8 * 20);
    assert_true(1e3 * s[PHASE_EXPERT_GEMM] >= 0.8 * 20 && 1e3 * s[PHASE_EXPERT_GEMM] < 20 + 0.8 * 10);
    assert_true(1e3 * s[PHASE_QUANTISE] >= 0.8 * 10 && 1e3 * s[PHASE_QUANTISE] < 10 + 0.8 * 10);
    profile_enable(DEVICE_CPU, 0);
}

// forward of chunk 0 [ attention 10 ms | 10 ms ], 10 ms outside, backward of chunk 1 20 ms, forward of chunk 0
// 10 ms, W of chunk 1 10 ms: chunk 0's forwards 2 ops of 30 ms in all, chunk 1's backward 1 op of 20 ms and its W
// 1 op of 10 ms, nothing else; the attention phase inside the first forward still 10 ms.
static void test_op_timers(void **state) {
    (void)state;
    profile_enable(DEVICE_CPU, 1);
    profile_op_begin(PROFILE_OP_FORWARD, 0);
    profile_begin(PHASE_ATTENTION);
    busy_wait_ms(10);
    profile_end(PHASE_ATTENTION);
    busy_wait_ms(10);
    profile_op_end(PROFILE_OP_FORWARD);
    busy_wait_ms(10);
    profile_op_begin(PROFILE_OP_BACKWARD, 1);
    busy_wait_ms(20);
    profile_op_end(PROFILE_OP_BACKWARD);
    profile_op_begin(PROFILE_OP_FORWARD, 0);
    busy_wait_ms(10);
    profile_op_end(PROFILE_OP_FORWARD);
    profile_op_begin(PROFILE_OP_BACKWARD_WEIGHT, 1);
    busy_wait_ms(10);
    profile_op_end(PROFILE_OP_BACKWARD_WEIGHT);
    double s[PHASE_COUNT], op_s[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT];
    int64_t op_n[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT];
    profile_step_collect(s);
    profile_op_totals(op_s, op_n);
    const int64_t want_n[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT] = {{[PROFILE_OP_FORWARD] = 2},
                                                                  {[PROFILE_OP_BACKWARD] = 1,
                                                                   [PROFILE_OP_BACKWARD_WEIGHT] = 1}};
    for (int c = 0; c < PROFILE_MAX_CHUNKS; c++)
        for (int k = 0; k < PROFILE_OP_COUNT; k++) {
            assert_int_equal(op_n[c][k], want_n[c][k]);
            if (want_n[c][k] == 0) assert_true(op_s[c][k] == 0);
        }
    assert_true(1e3 * op_s[0][PROFILE_OP_FORWARD] >= 0.8 * 30 && 1e3 * op_s[0][PROFILE_OP_FORWARD] < 30 + 0.8 * 10);
    assert_true(1e3 * op_s[1][PROFILE_OP_BACKWARD] >= 0.8 * 20 && 1e3 * op_s[1][PROFILE_OP_BACKWARD] < 20 + 0.8 * 10);
    assert_true(1e3 * op_s[1][PROFILE_OP_BACKWARD_WEIGHT] >= 0.8 * 10 &&
                1e3 * op_s[1][PROFILE_OP_BACKWARD_WEIGHT] < 10 + 0.8 * 10);
    assert_true(1e3 * s[PHASE_ATTENTION] >= 0.8 * 10 && 1e3 * s[PHASE_ATTENTION] < 10 + 0.8 * 10);
    profile_enable(DEVICE_CPU, 1);  // enable starts the totals from zero
    profile_op_totals(op_s, op_n);
    for (int c = 0; c < PROFILE_MAX_CHUNKS; c++)
        for (int k = 0; k < PROFILE_OP_COUNT; k++) assert_true(op_s[c][k] == 0 && op_n[c][k] == 0);
    profile_enable(DEVICE_CPU, 0);
}

// profile_current_phase: the innermost open phase as charged; other-GEMM when none is open or the profiler is off.
static void test_current_phase(void **state) {
    (void)state;
    profile_enable(DEVICE_CPU, 0);
    profile_begin(PHASE_ATTENTION);  // off: no phase is open
    assert_int_equal(profile_current_phase(), PHASE_OTHER_GEMM);
    profile_end(PHASE_ATTENTION);
    profile_enable(DEVICE_CPU, 1);
    assert_int_equal(profile_current_phase(), PHASE_OTHER_GEMM);
    profile_begin(PHASE_PERMUTE);
    assert_int_equal(profile_current_phase(), PHASE_PERMUTE);
    profile_end(PHASE_PERMUTE);
    profile_begin(PHASE_EXPERT_GEMM);
    profile_begin(PHASE_OTHER_GEMM);
    assert_int_equal(profile_current_phase(), PHASE_EXPERT_GEMM);
    profile_begin(PHASE_QUANTISE);
    assert_int_equal(profile_current_phase(), PHASE_QUANTISE);
    profile_end(PHASE_QUANTISE);
    profile_end(PHASE_OTHER_GEMM);
    profile_end(PHASE_EXPERT_GEMM);
    profile_enable(DEVICE_CPU, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_off_gives_zeros),
        cmocka_unit_test(test_nested_innermost),
        cmocka_unit_test(test_other_gemm_inside_expert),
        cmocka_unit_test(test_op_timers),
        cmocka_unit_test(test_current_phase),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
