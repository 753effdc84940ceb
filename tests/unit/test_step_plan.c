/*
 * test_step_plan.c - a rank's op list of a training step and its storage (train/step_plan.h), for every
 * schedule kind over the ranges of tests/unit/test_schedule.c:
 *   - the plan of every rank keeps the schedule's compute ops in order (F, B, I, W; FB as F then B) and its
 *     messages, with peers and micro-batches;
 *   - replaying the ops, no activation set or boundary slot is taken while another (chunk, micro-batch) holds
 *     it, a B or I finds its own forward's set, a W the set of its own I (which keeps it: the W ticket's operands),
 *     a W takes no slot, a set holds its own chunk, and a local hand-over names the previous stage's live slot;
 *   - the rank's activation sets equal the schedule's live bound (schedule_memory) for every kind;
 *   - the one-process plan is F0 B0 F1 B1 ... in set and slot 0.
 * Expected values come from the schedule (parallel/schedule.h) and its memory count, not from the planner.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "parallel/schedule.h"
#include "train/step_plan.h"

// The compute ops the plan must keep, in order: (kind, chunk, global micro-batch) from the schedule.
static int expected_compute(const Schedule *s, int r, int *kind, int *chunk, int *mb) {
    int n = 0;
    for (int i = 0; i < s->n_ops[r]; i++) {
        const SchedOp *o = &s->ops[r][i];
        if (o->kind == SCHED_F || o->kind == SCHED_FB)
            kind[n] = STEP_FORWARD, chunk[n] = o->chunk, mb[n++] = schedule_global_mb(s, r, o->chunk, o->mb);
        if (o->kind == SCHED_B || o->kind == SCHED_I || o->kind == SCHED_W)
            kind[n] = o->kind == SCHED_B ? STEP_BACKWARD : o->kind == SCHED_I ? STEP_BACKWARD_INPUT : STEP_BACKWARD_WEIGHT,
            chunk[n] = o->chunk, mb[n++] = schedule_global_mb(s, r, o->chunk, o->mb);
        if (o->kind == SCHED_FB)
            kind[n] = STEP_BACKWARD, chunk[n] = o->chunk_b, mb[n++] = schedule_global_mb(s, r, o->chunk_b, o->mb_b);
    }
    return n;
}

// The message kinds, listed here rather than taken from the planner (step_op_is_compute).
static int is_message_kind(StepOpKind k) {
    return k == STEP_SEND_ACTIVATION || k == STEP_RECV_ACTIVATION || k == STEP_SEND_GRADIENT || k == STEP_RECV_GRADIENT;
}

static void check_rank(const Schedule *s, int r) {
    char err[512];
    StepPlan p;
    if (step_plan_pipeline(&p, s, r, err, sizeof err) != 0) fail_msg("%s", err);
    const char *name = schedule_kind_name(s->kind);
    const int N = s->n_mb, cap = 2 * s->n_ops[r] + 1;
    int *kind = malloc((size_t)cap * sizeof *kind), *chunk = malloc((size_t)cap * sizeof *chunk);
    int *mb = malloc((size_t)cap * sizeof *mb);
    const int n_expected = expected_compute(s, r, kind, chunk, mb);
    // replay: who holds each set and slot (chunk * N + mb, or -1)
    int *set_holder = malloc((size_t)(p.n_acts + 1) * sizeof *set_holder);
    int *slot_holder = malloc((size_t)(p.n_slots + 1) * sizeof *slot_holder);
    int *awaits_w = calloc((size_t)(p.n_acts + 1), sizeof *awaits_w);
    for (int a = 0; a < p.n_acts; a++) set_holder[a] = -1;
    for (int k = 0; k < p.n_slots; k++) slot_holder[k] = -1;
    int n_compute = 0, n_messages = 0, n_sched_messages = 0;
    for (int i = 0; i < s->n_ops[r]; i++) n_sched_messages += s->ops[r][i].kind == SCHED_SEND || s->ops[r][i].kind == SCHED_RECV;
    for (int i = 0; i < p.n_ops; i++) {
        const StepOp *op = &p.ops[i];
        const int key = op->chunk * N + op->micro_batch;
        if (op->kind == STEP_BACKWARD_WEIGHT) {  // no slot; the set its I kept
            assert_true(n_compute < n_expected);
            if ((int)op->kind != kind[n_compute] || op->chunk != chunk[n_compute] || op->micro_batch != mb[n_compute])
                fail_msg("%s pp=%d N=%d rank %d: compute op %d differs from the schedule's", name, s->pp, N, r, n_compute);
            n_compute++;
            assert_int_equal(op->slot, -1);
            assert_int_equal(op->local_slot, -1);
            assert_true(op->act >= 0 && op->act < p.n_acts);
            assert_int_equal(set_holder[op->act], key);
            assert_int_equal(awaits_w[op->act], 1);
            set_holder[op->act] = -1, awaits_w[op->act] = 0;
            continue;
        }
        assert_true(op->slot >= 0 && op->slot < p.n_slots);
        // a slot is the key's from its first op to its release; a new key may take it only once it is free
        if (slot_holder[op->slot] != key) {
            if (slot_holder[op->slot] >= 0)
                fail_msg("%s pp=%d N=%d rank %d op %d: slot %d taken while micro-batch key %d holds it", name, s->pp, N,
                         r, i, op->slot, slot_holder[op->slot]);
            slot_holder[op->slot] = key;
        }
        const int backward = op->kind == STEP_BACKWARD || op->kind == STEP_BACKWARD_INPUT;
        if (op->kind == STEP_FORWARD || backward) {
            assert_true(n_compute < n_expected);
            if ((int)op->kind != kind[n_compute] || op->chunk != chunk[n_compute] || op->micro_batch != mb[n_compute])
                fail_msg("%s pp=%d N=%d rank %d: compute op %d differs from the schedule's", name, s->pp, N, r, n_compute);
            n_compute++;
            assert_true(op->act >= 0 && op->act < p.n_acts);
            assert_int_equal(p.act_chunk[op->act], op->chunk);
            if (op->kind == STEP_FORWARD) {
                assert_int_equal(set_holder[op->act], -1);
                set_holder[op->act] = key;
            } else {
                assert_int_equal(set_holder[op->act], key);
                assert_int_equal(awaits_w[op->act], 0);
                if (op->kind == STEP_BACKWARD) set_holder[op->act] = -1;
                else awaits_w[op->act] = 1;  // held until its W
            }
            if (op->local_slot >= 0) {  // the previous stage on this rank holds its slot for this micro-batch
                assert_true(op->local_slot < p.n_slots && op->local_slot != op->slot);
                assert_int_equal(slot_holder[op->local_slot] % N, op->micro_batch);
            }
        } else {
            assert_int_equal(op->act, -1);
            assert_true(op->peer >= 0 && op->peer < s->pp && op->peer != r);
            n_messages++;
        }
        // releases as the plan defines them: after a backward whose gradient is not sent, or after the message
        // batch that sends it (replayed from the ops themselves)
        int sends_later = 0;
        for (int j = i + 1; j < p.n_ops && backward; j++)
            sends_later |= p.ops[j].kind == STEP_SEND_GRADIENT && p.ops[j].chunk * N + p.ops[j].micro_batch == key;
        if (backward && !sends_later) slot_holder[op->slot] = -1;
        const int batch_end = is_message_kind(op->kind) && (i + 1 == p.n_ops || !is_message_kind(p.ops[i + 1].kind));
        if (batch_end)
            for (int j = i; j >= 0 && is_message_kind(p.ops[j].kind); j--)
                if (p.ops[j].kind == STEP_SEND_GRADIENT) slot_holder[p.ops[j].slot] = -1;
    }
    for (int a = 0; a < p.n_acts; a++) assert_int_equal(set_holder[a], -1);  // every W ran
    assert_int_equal(n_compute, n_expected);
    assert_int_equal(n_messages, n_sched_messages);
    int bound, param_chunks;
    schedule_memory(s, r, &bound, &param_chunks);
    if (p.n_acts != bound)
        fail_msg("%s pp=%d N=%d rank %d: %d activation sets, schedule bound %d", name, s->pp, N, r, p.n_acts, bound);
    free(kind), free(chunk), free(mb), free(set_holder), free(slot_holder), free(awaits_w);
    step_plan_free(&p);
}

static void check_kind(SchedKind kind, int p_lo, int p_hi, int p_step, int n_extra, int n_step, int n_min_factor) {
    int checked = 0;
    for (int P = p_lo; P <= p_hi; P += p_step)
        for (int N = n_min_factor * P; N <= n_min_factor * P + n_extra; N += n_step) {
            if (N < 1) continue;
            Schedule s;
            char err[512];
            if (schedule_build(&s, kind, P, N, err, sizeof err) != 0) fail_msg("%s", err);
            for (int r = 0; r < P; r++) check_rank(&s, r);
            schedule_free(&s);
            checked++;
        }
    print_message("%s: %d schedules, every rank's plan checked\n", schedule_kind_name(kind), checked);
}

static void test_1f1b(void **state) { (void)state; check_kind(SCHED_1F1B, 2, 16, 1, 6, 1, 1); }
static void test_zb1p(void **state) { (void)state; check_kind(SCHED_ZB1P, 2, 16, 1, 6, 1, 1); }
static void test_dualpipe(void **state) { (void)state; check_kind(SCHED_DUALPIPE, 2, 16, 2, 10, 2, 2); }
static void test_dualpipev(void **state) { (void)state; check_kind(SCHED_DUALPIPEV, 1, 9, 1, 8, 1, 2); }

static void test_one_process(void **state) {
    (void)state;
    StepPlan p;
    char err[256];
    assert_int_equal(step_plan_one_process(&p, 3, err, sizeof err), 0);
    assert_int_equal(p.n_ops, 6);
    assert_int_equal(p.n_acts, 1);
    assert_int_equal(p.n_slots, 1);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(p.ops[i].kind, i % 2 ? STEP_BACKWARD : STEP_FORWARD);
        assert_int_equal(p.ops[i].micro_batch, i / 2);
        assert_int_equal(p.ops[i].act, 0);
        assert_int_equal(p.ops[i].slot, 0);
    }
    step_plan_free(&p);
    assert_int_equal(step_plan_one_process(&p, 0, err, sizeof err), -1);
    assert_non_null(strstr(err, "train.grad_accum = 0"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_process), cmocka_unit_test(test_1f1b),      cmocka_unit_test(test_zb1p),
        cmocka_unit_test(test_dualpipe),    cmocka_unit_test(test_dualpipev),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
