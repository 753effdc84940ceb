/*
 * test_schedule.c - the pipeline schedules (parallel/schedule.h) and their simulator
 * (parallel/schedule_sim.h), against the Done-when list of issue 20 and Table 2 of the DeepSeek-V3 report:
 *   - DualPipe for P = 2, 4, ..., 16 and N = 2P ... 2P+10 (even), DualPipeV for P = 1 ... 9 and
 *     N = 2P ... 2P+8, 1F1B and ZB1P for P = 1 ... 16 and N from 1 to 3P+1 pass every static check;
 *   - an op list with a swapped send order, a missing W, a W out of FIFO order, a backward before its
 *     forward, a lost receive or a deadlock is rejected with the rank, op index and op named;
 *   - the bubble (makespan - a rank's busy time): 1F1B at PP=16, F=1, B=2 is 45 on every rank; ZB1P
 *     (PP-1)(F+B-2W); DualPipe at F=1, B=2, W=1, F&B=3 is 2(PP/2-1) on every rank for PP = 4, 8, 16 and
 *     every N of the range; DualPipeV (P-1)(F&B+B-3W);
 *   - costs per rank and chunk (schedule_simulate_stages): uniform ones give schedule_simulate's times, a slow
 *     last stage of 1F1B the hand-worked bubbles, and every rank's busy time its ops' costs;
 *   - activation memory per rank PP (1F1B's rank 0, ZB1P's every rank), PP+1 (DualPipe), 2P+1 stages of
 *     2P (DualPipeV); parameters 1x, 1x, 2x, 2x;
 *   - constraint errors name the numbers; cost strings are parsed or refused by key.
 * Everything is integer arithmetic on small lists: the file runs in well under a second.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"

static void build(Schedule *s, SchedKind kind, int pp, int n_mb) {
    char err[1024];
    if (schedule_build(s, kind, pp, n_mb, err, sizeof err) != 0) fail_msg("%s pp=%d N=%d: %s", schedule_kind_name(kind), pp, n_mb, err);
}

static void expect_valid(const Schedule *s) {
    char err[1024];
    if (schedule_validate(s, err, sizeof err) != 0)
        fail_msg("%s pp=%d N=%d: %s", schedule_kind_name(s->kind), s->pp, s->n_mb, err);
}

// The validator refuses s and its message contains every one of the NULL-terminated strings.
static void expect_invalid(const Schedule *s, ...) {
    char err[1024];
    if (schedule_validate(s, err, sizeof err) == 0) fail_msg("an invalid op list passed validation");
    va_list ap;
    va_start(ap, s);
    for (const char *want; (want = va_arg(ap, const char *));)
        if (!strstr(err, want)) fail_msg("error lacks '%s': %s", want, err);
    va_end(ap);
}

static SchedCosts costs(const char *text) {
    SchedCosts c;
    char err[256];
    if (schedule_costs_parse(text, &c, err, sizeof err) != 0) fail_msg("%s", err);
    return c;
}

// Simulates s and checks every rank's bubble against want.
static void expect_bubble_every_rank(const Schedule *s, const char *cost_text, double want) {
    SchedCosts c = costs(cost_text);
    SchedSim sim;
    char err[1024];
    if (schedule_simulate(s, &c, &sim, err, sizeof err) != 0) fail_msg("%s", err);
    for (int r = 0; r < s->pp; r++)
        if (fabs(sim.bubble[r] - want) > 1e-9)
            fail_msg("%s pp=%d N=%d %s: rank %d bubble %g, expected %g (makespan %g, busy %g)",
                     schedule_kind_name(s->kind), s->pp, s->n_mb, cost_text, r, sim.bubble[r], want, sim.makespan,
                     sim.busy[r]);
    schedule_sim_free(&sim);
}

static int find_op(const Schedule *s, int r, SchedOpKind kind, int chunk, int mb, int from) {
    for (int i = from; i < s->n_ops[r]; i++)
        if (s->ops[r][i].kind == kind && s->ops[r][i].chunk == chunk && s->ops[r][i].mb == mb) return i;
    fail_msg("rank %d has no op of kind %d chunk %d mb %d", r, (int)kind, chunk, mb);
    return -1;
}

static void remove_op(Schedule *s, int r, int i) {
    memmove(&s->ops[r][i], &s->ops[r][i + 1], (size_t)(s->n_ops[r] - i - 1) * sizeof(SchedOp));
    s->n_ops[r]--;
}

// ---------------------------------------------------------------------------- generators pass the validator

static void test_dualpipe_valid(void **state) {
    (void)state;
    for (int P = 2; P <= 16; P += 2)
        for (int N = 2 * P; N <= 2 * P + 10; N += 2) {
            Schedule s;
            build(&s, SCHED_DUALPIPE, P, N);
            assert_int_equal(s.n_chunks, 2);
            assert_int_equal(s.n_pipes, 2);
            expect_valid(&s);
            schedule_free(&s);
        }
}

static void test_dualpipev_valid(void **state) {
    (void)state;
    for (int P = 1; P <= 9; P++)
        for (int N = 2 * P; N <= 2 * P + 8; N++) {
            Schedule s;
            build(&s, SCHED_DUALPIPEV, P, N);
            assert_int_equal(s.n_stages, 2 * P);
            expect_valid(&s);
            schedule_free(&s);
        }
}

static void test_1f1b_zb1p_valid(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++)
        for (int P = 1; P <= 16; P++)
            for (int N = 1; N <= 3 * P + 1; N++) {
                Schedule s;
                build(&s, k ? SCHED_ZB1P : SCHED_1F1B, P, N);
                expect_valid(&s);
                schedule_free(&s);
            }
}

// The ops of one rank in the compact form, as `fp8moe schedule --print-ops` prints them.
static void test_compact_form(void **state) {
    (void)state;
    Schedule s;
    build(&s, SCHED_DUALPIPE, 8, 20);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    schedule_print_ops(&s, f, 0);
    fclose(f);
    assert_non_null(strstr(buf, "rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 1F0 1I0 W 1F1 "));
    assert_non_null(strstr(buf, "(0F7;1B3)"));  // the example pair
    assert_null(strstr(buf, "s0F"));            // messages only with with_messages
    free(buf);
    f = open_memstream(&buf, &len);
    schedule_print_ops(&s, f, 1);
    fclose(f);
    assert_non_null(strstr(buf, "rank 0: 0F0 [s0F0>1] 0F1"));
    assert_non_null(strstr(buf, "r0F"));
    free(buf);
    SchedOp ops[] = {{SCHED_F, 0, 3, -1, -1, -1, SCHED_ACT},   {SCHED_I, 1, 2, -1, -1, -1, SCHED_ACT},
                     {SCHED_W, 1, 2, -1, -1, -1, SCHED_ACT},   {SCHED_FB, 0, 7, 1, 3, -1, SCHED_ACT},
                     {SCHED_SEND, 1, 2, -1, -1, 0, SCHED_GRAD}, {SCHED_RECV, 0, 3, -1, -1, 2, SCHED_ACT}};
    const char *want[] = {"0F3", "1I2", "W", "(0F7;1B3)", "s1B2>0", "r0F3<2"};
    char out[64];
    for (int i = 0; i < 6; i++) {
        schedule_op_format(&ops[i], out, sizeof out);
        assert_string_equal(out, want[i]);
    }
    schedule_free(&s);
}

// ---------------------------------------------------------------------------- broken lists are rejected

// 1F1B rank 0 begins 0F0 s0F0>1 0F1 s0F1>1; reordered to 0F0 0F1 s0F1>1 s0F0>1 every op is still possible
// on rank 0 alone, but rank 1 receives 0F0 first: the pair check names the op.
static void test_swapped_sends_rejected(void **state) {
    (void)state;
    Schedule s;
    build(&s, SCHED_1F1B, 4, 8);
    SchedOp *o = s.ops[0];
    assert_int_equal(o[0].kind, SCHED_F);
    assert_int_equal(o[1].kind, SCHED_SEND);
    assert_int_equal(o[2].kind, SCHED_F);
    assert_int_equal(o[3].kind, SCHED_SEND);
    SchedOp f1 = o[2], s0 = o[1], s1 = o[3];
    o[1] = f1, o[2] = s1, o[3] = s0;
    expect_invalid(&s, "rank 0 op 2 (s0F1>1)", "message 1 from rank 0 to rank 1", "op 0 (r0F0<0)", NULL);
    schedule_free(&s);

    // in DualPipe: two sends of rank 3's direction-A outputs to rank 4 exchanged (the first now precedes
    // the forward it sends, or breaks the pair order: either way that op is named)
    build(&s, SCHED_DUALPIPE, 8, 20);
    int a = find_op(&s, 3, SCHED_SEND, 0, 4, 0), b = find_op(&s, 3, SCHED_SEND, 0, 5, 0);
    SchedOp t = s.ops[3][a];
    s.ops[3][a] = s.ops[3][b];
    s.ops[3][b] = t;
    expect_invalid(&s, "rank 3 op", "s0F5>4", NULL);
    schedule_free(&s);
}

static void test_missing_w_rejected(void **state) {
    (void)state;
    Schedule s;
    // the last W of ZB1P rank 2: its I is named
    build(&s, SCHED_ZB1P, 4, 8);
    int last = s.n_ops[2] - 1;
    assert_int_equal(s.ops[2][last].kind, SCHED_W);
    remove_op(&s, 2, last);
    expect_invalid(&s, "rank 2 op", "(0I7): its W never runs", NULL);
    schedule_free(&s);

    // a W in the middle: the next W runs the wrong ticket
    build(&s, SCHED_ZB1P, 4, 8);
    int w = -1;
    for (int i = 0; i < s.n_ops[1] && w < 0; i++)
        if (s.ops[1][i].kind == SCHED_W && s.ops[1][i].mb == 2) w = i;
    remove_op(&s, 1, w);
    expect_invalid(&s, "rank 1 op", "W (ticket 0I3)", "the oldest waiting ticket is 0I2", NULL);
    schedule_free(&s);

    // DualPipe: a W of the drain phase
    build(&s, SCHED_DUALPIPE, 4, 8);
    last = s.n_ops[0] - 1;
    assert_int_equal(s.ops[0][last].kind, SCHED_W);
    remove_op(&s, 0, last);
    expect_invalid(&s, "rank 0 op", "its W never runs", NULL);
    schedule_free(&s);
}

static void test_other_errors_rejected(void **state) {
    (void)state;
    Schedule s;
    // a backward moved before its forward
    build(&s, SCHED_1F1B, 2, 2);
    int b = find_op(&s, 1, SCHED_B, 0, 0, 0), f = find_op(&s, 1, SCHED_F, 0, 0, 0);
    SchedOp t = s.ops[1][b];
    s.ops[1][b] = s.ops[1][f];
    s.ops[1][f] = t;
    expect_invalid(&s, "rank 1 op", "(0B0)", "before its forward", NULL);
    schedule_free(&s);

    // a receive removed: the forward that needs it is named
    build(&s, SCHED_DUALPIPEV, 3, 6);
    int r = find_op(&s, 1, SCHED_RECV, 1, 2, 0);
    remove_op(&s, 1, r);
    expect_invalid(&s, "rank 1 op", "(1F2)", "has not been received", NULL);
    schedule_free(&s);

    // a forward twice
    build(&s, SCHED_1F1B, 1, 2);
    s.ops[0][2] = s.ops[0][0];  // 0F0 0B0 0F0 0B1
    expect_invalid(&s, "rank 0 op 2 (0F0)", "already forwarded at op 0", NULL);
    schedule_free(&s);

    // a send to the wrong peer
    build(&s, SCHED_1F1B, 3, 3);
    s.ops[0][1].peer = 2;
    expect_invalid(&s, "rank 0 op 1 (s0F0>2)", "goes to rank 1, not rank 2", NULL);
    schedule_free(&s);
}

// 1F1B pp=2 with rank 0's first gradient receive moved before its first send: rank 0 waits for rank 1's
// gradient, rank 1 for rank 0's activation. Each rank alone is consistent, the pairs match; only the
// blocking semantics find it.
static void test_deadlock_rejected(void **state) {
    (void)state;
    Schedule s;
    build(&s, SCHED_1F1B, 2, 2);
    // rank 0: 0F0 s0F0>1 0F1 s0F1>1 r0B0<1 0B0 r0B1<1 0B1 -> 0F0 r0B0<1 0F1 s0F0>1 s0F1>1 0B0 r0B1<1 0B1
    SchedOp *o = s.ops[0];
    assert_int_equal(o[4].kind, SCHED_RECV);
    SchedOp f0 = o[0], s0 = o[1], f1 = o[2], s1 = o[3], r0 = o[4];
    o[0] = f0, o[1] = r0, o[2] = f1, o[3] = s0, o[4] = s1;
    expect_invalid(&s, "deadlock: rank 0 op 1 (r0B0<1) waits for rank 1 op", "(s0B0>0)", NULL);
    schedule_free(&s);
}

// ---------------------------------------------------------------------------- constraints

static void expect_refused(SchedKind kind, int pp, int n_mb, const char *want) {
    Schedule s;
    char err[512];
    if (schedule_build(&s, kind, pp, n_mb, err, sizeof err) == 0) fail_msg("%s pp=%d N=%d was built", schedule_kind_name(kind), pp, n_mb);
    if (!strstr(err, want)) fail_msg("error lacks '%s': %s", want, err);
}

static void test_constraints(void **state) {
    (void)state;
    expect_refused(SCHED_DUALPIPE, 3, 12, "dualpipe: pp = 3 is odd");
    expect_refused(SCHED_DUALPIPE, 4, 9, "microbatches = 9 is odd");
    expect_refused(SCHED_DUALPIPE, 4, 6, "microbatches = 6 < 2 x pp = 2 x 4 = 8");
    expect_refused(SCHED_DUALPIPEV, 5, 9, "dualpipev: microbatches = 9 < 2 x pp = 2 x 5 = 10");
    expect_refused(SCHED_1F1B, 0, 4, "1f1b: pp = 0");
    expect_refused(SCHED_ZB1P, 2, 0, "zb1p: microbatches = 0");
    expect_refused(SCHED_1F1B, SCHED_MAX_PP + 1, 4, "expected 1 to 128 ranks");
    SchedKind k;
    assert_int_equal(schedule_kind_parse("dualpipev", &k), 0);
    assert_int_equal(k, SCHED_DUALPIPEV);
    assert_int_equal(schedule_kind_parse("gpipe", &k), -1);
}

static void test_costs_parse(void **state) {
    (void)state;
    SchedCosts c = costs("F=1,B=2,W=1,FB=3");
    assert_true(c.f == 1 && c.b == 2 && c.w == 1 && c.fb == 3 && !c.wait_sends);
    c = costs("b=4,f=2");  // any case, any order; W defaults to 1, FB to F+B
    assert_true(c.f == 2 && c.b == 4 && c.w == 1 && c.fb == 6);
    const char *bad[][2] = {{"F=1,Q=2", "unknown key 'Q'"},   {"F=x", "F=x - expected a number >= 0"},
                            {"F=-1", "expected a number >= 0"}, {"W=3", "W=3 > B=2"},
                            {"F=1,F=2", "F given twice"},       {"F", "expected KEY=VALUE"},
                            {"", "--costs is empty"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[256];
        if (schedule_costs_parse(bad[i][0], &c, err, sizeof err) == 0) fail_msg("'%s' was accepted", bad[i][0]);
        if (!strstr(err, bad[i][1])) fail_msg("'%s': error lacks '%s': %s", bad[i][0], bad[i][1], err);
    }
}

// ---------------------------------------------------------------------------- bubbles (Table 2)

static void test_1f1b_bubble(void **state) {
    (void)state;
    int Ns[] = {16, 32, 48};
    for (size_t i = 0; i < 3; i++) {
        Schedule s;
        build(&s, SCHED_1F1B, 16, Ns[i]);
        expect_bubble_every_rank(&s, "F=1,B=2", 45);
        schedule_free(&s);
    }
    for (int P = 2; P <= 9; P++) {
        Schedule s;
        build(&s, SCHED_1F1B, P, 2 * P + 3);
        SchedCosts c = costs("F=1.5,B=2.5");
        expect_bubble_every_rank(&s, "F=1.5,B=2.5", schedule_bubble_formula(SCHED_1F1B, P, &c));
        schedule_free(&s);
    }
}

static void test_zb1p_bubble(void **state) {
    (void)state;
    const char *cs[] = {"F=1,B=2,W=1", "F=1,B=2,W=0.5", "F=2,B=4,W=1"};
    for (int P = 2; P <= 16; P += 3)
        for (size_t i = 0; i < 3; i++) {
            Schedule s;
            build(&s, SCHED_ZB1P, P, 2 * P + 1);
            SchedCosts c = costs(cs[i]);
            expect_bubble_every_rank(&s, cs[i], (P - 1) * (c.f + c.b - 2 * c.w));
            schedule_free(&s);
        }
}

static void test_dualpipe_bubble(void **state) {
    (void)state;
    for (int P = 4; P <= 16; P *= 2)
        for (int N = 2 * P; N <= 2 * P + 10; N += 2) {
            Schedule s;
            build(&s, SCHED_DUALPIPE, P, N);
            expect_bubble_every_rank(&s, "F=1,B=2,W=1,FB=3", 2 * (P / 2 - 1));
            schedule_free(&s);
        }
    // any F&B at the report's proportions: the largest rank's bubble is the formula (the middle ranks run
    // one pair unoverlapped, so they are busier and idle less)
    Schedule s;
    build(&s, SCHED_DUALPIPE, 8, 20);
    SchedCosts c = costs("F=1,B=2,W=1,FB=2.5");
    SchedSim sim;
    char err[512];
    assert_int_equal(schedule_simulate(&s, &c, &sim, err, sizeof err), 0);
    double worst = 0;
    for (int r = 0; r < 8; r++) worst = fmax(worst, sim.bubble[r]);
    assert_true(fabs(worst - schedule_bubble_formula(SCHED_DUALPIPE, 8, &c)) < 1e-9);
    assert_true(fabs(worst - 4.5) < 1e-9);
    schedule_sim_free(&sim);
    schedule_free(&s);
}

static void test_dualpipev_bubble(void **state) {
    (void)state;
    for (int P = 1; P <= 9; P++)
        for (int N = 2 * P; N <= 2 * P + 8; N += 4) {
            Schedule s;
            build(&s, SCHED_DUALPIPEV, P, N);
            expect_bubble_every_rank(&s, "F=1,B=2,W=1,FB=3", 2 * (P - 1));
            schedule_free(&s);
        }
}

// Where the formula does not hold: W < F in DualPipe (measured: below the formula by
// min((PP/2-1)(F-W), F)), W > B-W in ZB1P (the last rank's start-up wait (PP-1)F stays).
static void test_formula_limits(void **state) {
    (void)state;
    struct { SchedKind k; int P; const char *c; double want; } cases[] = {
        {SCHED_DUALPIPE, 4, "F=1,B=2,W=0.5,FB=3", 3.0},  // formula 3.5
        {SCHED_DUALPIPE, 8, "F=1,B=2,W=0.9,FB=3", 6.6},  // formula 6.9
        {SCHED_DUALPIPE, 8, "F=1,B=2,W=0.5,FB=3", 9.5},  // formula 10.5
        {SCHED_ZB1P, 4, "F=1,B=2,W=1.5", 3.0},           // formula 0
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Schedule s;
        build(&s, cases[i].k, cases[i].P, 2 * cases[i].P + 4);
        expect_bubble_every_rank(&s, cases[i].c, cases[i].want);
        schedule_free(&s);
    }
}

// With sends that wait for their receive, DualPipe keeps its bubble; ZB1P's gradient sends wait for the
// receiver's next forward and lose most of the gain.
static void test_wait_sends(void **state) {
    (void)state;
    Schedule s;
    build(&s, SCHED_DUALPIPE, 8, 20);
    SchedCosts c = costs("F=1,B=2,W=1,FB=3");
    c.wait_sends = 1;
    SchedSim sim;
    char err[512];
    assert_int_equal(schedule_simulate(&s, &c, &sim, err, sizeof err), 0);
    for (int r = 0; r < 8; r++) assert_true(fabs(sim.bubble[r] - 6) < 1e-9);
    schedule_sim_free(&sim);
    schedule_free(&s);
    build(&s, SCHED_ZB1P, 4, 8);
    assert_int_equal(schedule_simulate(&s, &c, &sim, err, sizeof err), 0);
    assert_true(sim.bubble[0] > 3 + 1e-9);
    schedule_sim_free(&sim);
    schedule_free(&s);
}

// Costs per rank and chunk (schedule_simulate_stages): with every entry the same, schedule_simulate's makespan and
// bubbles for every kind; a slow last stage of 1F1B at PP = 2, N = 2 (rank 0 F=1, B=2; rank 1 F=2, B=3), worked by
// hand: rank 0 F0 [0,1] F1 [1,2], rank 1 F0 [1,3] B0 [3,6] F1 [6,8] B1 [8,11], rank 0 B0 [6,8] B1 [11,13]: makespan
// 13, bubbles 13 - 6 = 7 and 13 - 10 = 3; and each rank's busy time, under DualPipe's two chunks of different
// costs, the sum of its ops' costs with an FB at fb - b + b' (its backward chunk's b').
static void test_stage_costs(void **state) {
    (void)state;
    char err[512];
    const struct { SchedKind k; int P, N; } kinds[] = {
        {SCHED_1F1B, 4, 8}, {SCHED_ZB1P, 4, 9}, {SCHED_DUALPIPE, 4, 10}, {SCHED_DUALPIPEV, 3, 8}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        Schedule s;
        build(&s, kinds[i].k, kinds[i].P, kinds[i].N);
        SchedCosts c = costs("F=1,B=2.5,W=0.75,FB=3"), per[2 * SCHED_MAX_PP];
        for (int k = 0; k < 2 * kinds[i].P; k++) per[k] = c;
        SchedSim a, b;
        assert_int_equal(schedule_simulate(&s, &c, &a, err, sizeof err), 0);
        assert_int_equal(schedule_simulate_stages(&s, per, &b, err, sizeof err), 0);
        assert_true(a.makespan == b.makespan);
        for (int r = 0; r < kinds[i].P; r++) assert_true(a.bubble[r] == b.bubble[r] && a.busy[r] == b.busy[r]);
        schedule_sim_free(&a);
        schedule_sim_free(&b);
        schedule_free(&s);
    }
    Schedule s;
    build(&s, SCHED_1F1B, 2, 2);
    SchedCosts per[4] = {costs("F=1,B=2"), costs("F=1,B=2"), costs("F=2,B=3"), costs("F=2,B=3")};
    SchedSim sim;
    assert_int_equal(schedule_simulate_stages(&s, per, &sim, err, sizeof err), 0);
    assert_true(fabs(sim.makespan - 13) < 1e-12);
    assert_true(fabs(sim.bubble[0] - 7) < 1e-12 && fabs(sim.bubble[1] - 3) < 1e-12);
    schedule_sim_free(&sim);
    schedule_free(&s);
    build(&s, SCHED_DUALPIPE, 4, 8);
    SchedCosts dp[8];
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < 2; k++) {
            char text[64];
            snprintf(text, sizeof text, "F=%d,B=%d,W=1,FB=%d", 1 + r + k, 3 + 2 * r + k, 3 + 3 * r + 2 * k);
            dp[2 * r + k] = costs(text);
        }
    assert_int_equal(schedule_simulate_stages(&s, dp, &sim, err, sizeof err), 0);
    for (int r = 0; r < 4; r++) {
        double busy = 0;
        for (int i = 0; i < s.n_ops[r]; i++) {
            const SchedOp *o = &s.ops[r][i];
            const SchedCosts *k = &dp[2 * r + o->chunk];
            if (o->kind == SCHED_F) busy += k->f;
            if (o->kind == SCHED_B) busy += k->b;
            if (o->kind == SCHED_I) busy += k->b - k->w;
            if (o->kind == SCHED_W) busy += k->w;
            if (o->kind == SCHED_FB) busy += k->fb - k->b + dp[2 * r + o->chunk_b].b;
        }
        assert_true(fabs(sim.busy[r] - busy) < 1e-9);
        assert_true(fabs(sim.bubble[r] - (sim.makespan - busy)) < 1e-9);
    }
    schedule_sim_free(&sim);
    schedule_free(&s);
}

// ---------------------------------------------------------------------------- memory (Table 2)

static void test_memory(void **state) {
    (void)state;
    for (int P = 2; P <= 16; P += 2) {
        int N = 2 * P + 2, act, chunks;
        Schedule s;
        build(&s, SCHED_1F1B, P, N);
        for (int r = 0; r < P; r++) {
            schedule_memory(&s, r, &act, &chunks);
            assert_int_equal(act, P - r);  // 1F1B: rank r holds P - r; Table 2's PP is rank 0
            assert_int_equal(chunks, 1);
        }
        schedule_free(&s);
        build(&s, SCHED_ZB1P, P, N);
        for (int r = 0; r < P; r++) {
            schedule_memory(&s, r, &act, &chunks);
            assert_int_equal(act, P);
            assert_int_equal(chunks, 1);
        }
        schedule_free(&s);
        build(&s, SCHED_DUALPIPE, P, N);
        for (int r = 0; r < P; r++) {
            schedule_memory(&s, r, &act, &chunks);
            assert_int_equal(act, P + 1);
            assert_int_equal(chunks, 2);
        }
        schedule_free(&s);
        build(&s, SCHED_DUALPIPEV, P, N);
        for (int r = 0; r < P; r++) {
            schedule_memory(&s, r, &act, &chunks);
            assert_int_equal(act, 2 * P + 1);  // PP + 1 of PP = 2P stages, each half a DualPipe stage
            assert_int_equal(chunks, 2);
        }
        schedule_free(&s);
    }
}

static void test_timeline(void **state) {
    (void)state;
    Schedule s;
    build(&s, SCHED_1F1B, 2, 2);
    SchedCosts c = costs("F=1,B=2");
    SchedSim sim;
    char err[512];
    assert_int_equal(schedule_simulate(&s, &c, &sim, err, sizeof err), 0);
    assert_true(sim.makespan == 9);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    schedule_print_timeline(&s, &sim, 4, f);
    fclose(f);
    // every rank idles (P-1)(F+B) = 3: rank 0 waits for rank 1's backwards, rank 1 for the first forward and the end
    assert_string_equal(buf, "rank 0 |0F0 0F1 ........0B0     ....0B1     |\n"
                             "rank 1 |....0F0 0B0     0F1 0B1     ........|\n");
    free(buf);
    schedule_sim_free(&sim);
    schedule_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dualpipe_valid),       cmocka_unit_test(test_dualpipev_valid),
        cmocka_unit_test(test_1f1b_zb1p_valid),      cmocka_unit_test(test_compact_form),
        cmocka_unit_test(test_swapped_sends_rejected), cmocka_unit_test(test_missing_w_rejected),
        cmocka_unit_test(test_other_errors_rejected), cmocka_unit_test(test_deadlock_rejected),
        cmocka_unit_test(test_constraints),          cmocka_unit_test(test_costs_parse),
        cmocka_unit_test(test_1f1b_bubble),          cmocka_unit_test(test_zb1p_bubble),
        cmocka_unit_test(test_dualpipe_bubble),      cmocka_unit_test(test_dualpipev_bubble),
        cmocka_unit_test(test_formula_limits),       cmocka_unit_test(test_wait_sends),
        cmocka_unit_test(test_stage_costs),
        cmocka_unit_test(test_memory),               cmocka_unit_test(test_timeline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
