/*
 * step_plan.c - a rank's op list of a training step and its activation slots (see step_plan.h).
 */
#include "train/step_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int plan_alloc(StepPlan *p, int max_ops, char *err, size_t err_size) {
    memset(p, 0, sizeof *p);
    if (!(p->ops = malloc((size_t)(max_ops > 0 ? max_ops : 1) * sizeof *p->ops))) {
        snprintf(err, err_size, "out of memory for a step plan of %d ops", max_ops);
        return -1;
    }
    return 0;
}

int step_plan_one_process(StepPlan *p, int grad_accum, char *err, size_t err_size) {
    if (grad_accum < 1) {
        snprintf(err, err_size, "a step needs at least one micro-batch (train.grad_accum = %d)", grad_accum);
        return -1;
    }
    if (plan_alloc(p, 2 * grad_accum, err, err_size) != 0) return -1;
    for (int mb = 0; mb < grad_accum; mb++) {
        p->ops[p->n_ops++] = (StepOp){STEP_FORWARD, 0, mb, 0, -1};
        p->ops[p->n_ops++] = (StepOp){STEP_BACKWARD, 0, mb, 0, -1};
    }
    p->n_slots = 1;
    return 0;
}

static int is_message(StepOpKind k) { return k != STEP_FORWARD && k != STEP_BACKWARD; }

// The schedule's ops of `rank` as StepOps without slots (I -> a full backward, W -> nothing).
static int map_ops(StepPlan *p, const Schedule *s, int rank, char *err, size_t err_size) {
    for (int i = 0; i < s->n_ops[rank]; i++) {
        const SchedOp *o = &s->ops[rank][i];
        StepOp op = {STEP_FORWARD, o->chunk, schedule_global_mb(s, rank, o->chunk, o->mb), -1, -1};
        switch (o->kind) {
        case SCHED_F: break;
        case SCHED_B:
        case SCHED_I: op.kind = STEP_BACKWARD; break;
        case SCHED_W: continue;
        case SCHED_SEND:
            op.kind = o->msg == SCHED_ACT ? STEP_SEND_ACTIVATION : STEP_SEND_GRADIENT;
            op.peer = o->peer;
            break;
        case SCHED_RECV:
            op.kind = o->msg == SCHED_ACT ? STEP_RECV_ACTIVATION : STEP_RECV_GRADIENT;
            op.peer = o->peer;
            break;
        case SCHED_FB:
            snprintf(err, err_size, "the %s schedule pairs a forward with a backward (FB), which this executor does not "
                     "run - expected 1f1b or zb1p", schedule_kind_name(s->kind));
            return -1;
        }
        p->ops[p->n_ops++] = op;
    }
    return 0;
}

int step_plan_pipeline(StepPlan *p, const Schedule *s, int rank, char *err, size_t err_size) {
    if (s->n_chunks != 1) {
        snprintf(err, err_size, "the %s schedule puts %d chunks on every rank; this executor runs one chunk per rank "
                 "- expected 1f1b or zb1p", schedule_kind_name(s->kind), s->n_chunks);
        return -1;
    }
    if (rank < 0 || rank >= s->pp) {
        snprintf(err, err_size, "pp rank %d is outside the schedule's %d ranks", rank, s->pp);
        return -1;
    }
    if (plan_alloc(p, s->n_ops[rank], err, err_size) != 0) return -1;
    const int N = s->n_mb;
    int *slot_of = malloc((size_t)N * sizeof *slot_of), *grad_sent = calloc((size_t)N, sizeof *grad_sent);
    int *busy = calloc((size_t)N + 1, sizeof *busy), *release = calloc((size_t)N + 1, sizeof *release);
    int ok = slot_of && grad_sent && busy && release;
    if (!ok) snprintf(err, err_size, "out of memory for the slots of %d micro-batches", N);
    if (!ok || map_ops(p, s, rank, err, err_size) != 0) {
        ok = 0;
        goto done;
    }
    for (int m = 0; m < N; m++) slot_of[m] = -1;
    for (int i = 0; i < p->n_ops; i++)
        if (p->ops[i].kind == STEP_SEND_GRADIENT) grad_sent[p->ops[i].micro_batch] = 1;
    // Walk the ops: a (chunk 0, micro-batch) takes the lowest free slot at its first op; a backward frees it,
    // or marks it to be freed after the message batch that sends its input-gradient.
    int n_release = 0;
    for (int i = 0; i < p->n_ops; i++) {
        StepOp *op = &p->ops[i];
        const int m = op->micro_batch;
        if (slot_of[m] < 0) {
            int k = 0;
            while (busy[k]) k++;
            busy[k] = 1;
            slot_of[m] = k;
            if (k + 1 > p->n_slots) p->n_slots = k + 1;
        }
        op->slot = slot_of[m];
        if (op->kind == STEP_BACKWARD && !grad_sent[m]) busy[op->slot] = 0;
        if (op->kind == STEP_SEND_GRADIENT) release[n_release++] = op->slot;
        const int batch_ends = is_message(op->kind) && (i + 1 == p->n_ops || !is_message(p->ops[i + 1].kind));
        if (batch_ends) {
            for (int j = 0; j < n_release; j++) busy[release[j]] = 0;
            n_release = 0;
        }
    }
done:
    free(slot_of);
    free(grad_sent);
    free(busy);
    free(release);
    if (!ok) step_plan_free(p);
    return ok ? 0 : -1;
}

void step_plan_free(StepPlan *p) {
    free(p->ops);
    memset(p, 0, sizeof *p);
}

void step_op_format(const StepOp *op, char *buf, size_t size) {
    switch (op->kind) {
    case STEP_FORWARD: snprintf(buf, size, "F%d", op->micro_batch); break;
    case STEP_BACKWARD: snprintf(buf, size, "B%d", op->micro_batch); break;
    case STEP_SEND_ACTIVATION: snprintf(buf, size, "sA%d>%d", op->micro_batch, op->peer); break;
    case STEP_RECV_ACTIVATION: snprintf(buf, size, "rA%d<%d", op->micro_batch, op->peer); break;
    case STEP_SEND_GRADIENT: snprintf(buf, size, "sG%d>%d", op->micro_batch, op->peer); break;
    case STEP_RECV_GRADIENT: snprintf(buf, size, "rG%d<%d", op->micro_batch, op->peer); break;
    }
}
