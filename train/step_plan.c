/*
 * step_plan.c - a rank's op list of a training step and its activation slots (see step_plan.h).
 */
#include "train/step_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int plan_alloc(StepPlan *p, int max_ops, char *err, size_t err_size) {
    memset(p, 0, sizeof *p);
    p->ops = malloc((size_t)(max_ops > 0 ? max_ops : 1) * sizeof *p->ops);
    p->act_chunk = calloc((size_t)(max_ops > 0 ? max_ops : 1), sizeof *p->act_chunk);  // at most one set per op
    if (!p->ops || !p->act_chunk) {
        step_plan_free(p);
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
        p->ops[p->n_ops++] = (StepOp){STEP_FORWARD, 0, mb, 0, 0, -1, -1};
        p->ops[p->n_ops++] = (StepOp){STEP_BACKWARD, 0, mb, 0, 0, -1, -1};
    }
    p->n_slots = p->n_acts = 1;
    return 0;
}

int step_op_is_compute(StepOpKind k) {
    return k == STEP_FORWARD || k == STEP_BACKWARD || k == STEP_BACKWARD_INPUT || k == STEP_BACKWARD_WEIGHT;
}
static int is_message(StepOpKind k) { return !step_op_is_compute(k); }

// The schedule's ops of `rank` as StepOps without slots (FB -> F then B).
static void map_ops(StepPlan *p, const Schedule *s, int rank) {
    for (int i = 0; i < s->n_ops[rank]; i++) {
        const SchedOp *o = &s->ops[rank][i];
        StepOp op = {STEP_FORWARD, o->chunk, schedule_global_mb(s, rank, o->chunk, o->mb), -1, -1, -1, -1};
        switch (o->kind) {
        case SCHED_F: break;
        case SCHED_B: op.kind = STEP_BACKWARD; break;
        case SCHED_I: op.kind = STEP_BACKWARD_INPUT; break;
        case SCHED_W: op.kind = STEP_BACKWARD_WEIGHT; break;
        case SCHED_SEND:
            op.kind = o->msg == SCHED_ACT ? STEP_SEND_ACTIVATION : STEP_SEND_GRADIENT;
            op.peer = o->peer;
            break;
        case SCHED_RECV:
            op.kind = o->msg == SCHED_ACT ? STEP_RECV_ACTIVATION : STEP_RECV_GRADIENT;
            op.peer = o->peer;
            break;
        case SCHED_FB:
            p->ops[p->n_ops++] = op;
            op = (StepOp){STEP_BACKWARD, o->chunk_b, schedule_global_mb(s, rank, o->chunk_b, o->mb_b), -1, -1, -1, -1};
            break;
        }
        p->ops[p->n_ops++] = op;
    }
}

// The chunk of `rank` that holds the stage before chunk c's in its pipe, or -1 (another rank, or none).
static int local_previous_chunk(const Schedule *s, int rank, int c) {
    const SchedChunk *sc = &s->chunk[rank][c];
    int chunk = -1;
    if (sc->stage == 0 || schedule_stage_rank(s, sc->pipe, sc->stage - 1, &chunk) != rank) return -1;
    return chunk;
}

int step_plan_pipeline(StepPlan *p, const Schedule *s, int rank, char *err, size_t err_size) {
    if (rank < 0 || rank >= s->pp) {
        snprintf(err, err_size, "pp rank %d is outside the schedule's %d ranks", rank, s->pp);
        return -1;
    }
    if (plan_alloc(p, 2 * s->n_ops[rank], err, err_size) != 0) return -1;
    const int N = s->n_mb, C = s->n_chunks, keys = C * N;  // key of (chunk c, micro-batch m): c * N + m
    int *slot_of = malloc((size_t)keys * sizeof *slot_of), *act_of = malloc((size_t)keys * sizeof *act_of);
    int *grad_sent = calloc((size_t)keys, sizeof *grad_sent);
    // busy[k]: boundary slot k is in use; act_busy[a]: activation set a; a chunk takes its lowest free set of its
    // own (act_chunk), else a new one
    int *busy = calloc((size_t)keys + 1, sizeof *busy), *release = calloc((size_t)keys + 1, sizeof *release);
    int *act_busy = calloc((size_t)keys + 1, sizeof *act_busy);
    int ok = slot_of && act_of && grad_sent && busy && release && act_busy;
    if (!ok) {
        snprintf(err, err_size, "out of memory for the slots of %d micro-batches", N);
        goto done;
    }
    map_ops(p, s, rank);
    for (int k = 0; k < keys; k++) slot_of[k] = act_of[k] = -1;
    for (int i = 0; i < p->n_ops; i++)
        if (p->ops[i].kind == STEP_SEND_GRADIENT) grad_sent[p->ops[i].chunk * N + p->ops[i].micro_batch] = 1;
    // Walk the ops: a (chunk, micro-batch) takes the lowest free boundary slot at its first op; a backward (B or
    // I) frees it, or marks it to be freed after the message batch that sends its input-gradient. Its forward
    // takes an activation set, its B or W frees it. A W uses no slot.
    int n_release = 0;
    for (int i = 0; i < p->n_ops; i++) {
        StepOp *op = &p->ops[i];
        const int key = op->chunk * N + op->micro_batch;
        if (op->kind == STEP_BACKWARD_WEIGHT) {
            op->act = act_of[key];
            act_busy[op->act] = 0;
            continue;
        }
        if (slot_of[key] < 0) {
            int k = 0;
            while (busy[k]) k++;
            busy[k] = 1;
            slot_of[key] = k;
            if (k + 1 > p->n_slots) p->n_slots = k + 1;
        }
        op->slot = slot_of[key];
        if (op->kind == STEP_FORWARD) {
            int a = 0;
            while (a < p->n_acts && (act_busy[a] || p->act_chunk[a] != op->chunk)) a++;
            if (a == p->n_acts) p->act_chunk[p->n_acts++] = op->chunk;
            act_busy[a] = 1;
            act_of[key] = a;
        }
        const int backward = op->kind == STEP_BACKWARD || op->kind == STEP_BACKWARD_INPUT;
        if (op->kind == STEP_FORWARD || backward) op->act = act_of[key];
        const int prev = op->kind == STEP_FORWARD || backward ? local_previous_chunk(s, rank, op->chunk) : -1;
        // the previous stage's slot: held from its forward (before this one's) to its backward (after this one's)
        if (prev >= 0) op->local_slot = slot_of[prev * N + op->micro_batch];
        if (backward) {
            if (op->kind == STEP_BACKWARD) act_busy[op->act] = 0;
            if (!grad_sent[key]) busy[op->slot] = 0;
        }
        if (op->kind == STEP_SEND_GRADIENT) release[n_release++] = op->slot;
        const int batch_ends = is_message(op->kind) && (i + 1 == p->n_ops || !is_message(p->ops[i + 1].kind));
        if (batch_ends) {
            for (int j = 0; j < n_release; j++) busy[release[j]] = 0;
            n_release = 0;
        }
    }
done:
    free(slot_of);
    free(act_of);
    free(act_busy);
    free(grad_sent);
    free(busy);
    free(release);
    if (!ok) step_plan_free(p);
    return ok ? 0 : -1;
}

void step_plan_free(StepPlan *p) {
    free(p->ops);
    free(p->act_chunk);
    memset(p, 0, sizeof *p);
}

void step_op_format(const StepOp *op, char *buf, size_t size) {
    const int c = op->chunk, m = op->micro_batch, q = op->peer;
    switch (op->kind) {
    case STEP_FORWARD: snprintf(buf, size, "%dF%d", c, m); break;
    case STEP_BACKWARD: snprintf(buf, size, "%dB%d", c, m); break;
    case STEP_BACKWARD_INPUT: snprintf(buf, size, "%dI%d", c, m); break;
    case STEP_BACKWARD_WEIGHT: snprintf(buf, size, "%dW%d", c, m); break;
    case STEP_SEND_ACTIVATION: snprintf(buf, size, "s%dA%d>%d", c, m, q); break;
    case STEP_RECV_ACTIVATION: snprintf(buf, size, "r%dA%d<%d", c, m, q); break;
    case STEP_SEND_GRADIENT: snprintf(buf, size, "s%dG%d>%d", c, m, q); break;
    case STEP_RECV_GRADIENT: snprintf(buf, size, "r%dG%d<%d", c, m, q); break;
    }
}
