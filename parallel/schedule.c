/*
 * schedule.c - the pipeline schedules of fp8moe as op lists (1F1B, ZB1P, DualPipe, DualPipeV) and the
 * static validator that every list, generated or written by hand, must pass before an executor or the
 * simulator runs it. See schedule.h for the op model, the message semantics and the executor mapping.
 *
 * The generators emit through one small "emitter" whose helpers are the pipeline's verbs (receive a
 * forward input, run a forward, send its output, ...). Each helper looks up, from the chunk map, which
 * rank holds the neighbouring stage, so a message is emitted only between ranks and names its peer; the
 * DualPipe and DualPipeV phase structure (eight phases, DESIGN.md section 6) is then written once for
 * both, as the sequence of verbs of each phase, in the order the DualPipe reference posts them.
 */
#include "parallel/schedule.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void set_err(char *err, size_t size, const char *fmt, ...) {
    if (!err || !size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, size, fmt, ap);
    va_end(ap);
}

static const char *const kind_names[] = {"1f1b", "zb1p", "dualpipe", "dualpipev"};

const char *schedule_kind_name(SchedKind kind) {
    return (unsigned)kind < sizeof kind_names / sizeof kind_names[0] ? kind_names[kind] : "?";
}

int schedule_kind_parse(const char *name, SchedKind *kind) {
    for (int k = 0; k < (int)(sizeof kind_names / sizeof kind_names[0]); k++)
        if (name && !strcmp(name, kind_names[k])) {
            *kind = (SchedKind)k;
            return 0;
        }
    return -1;
}

void schedule_free(Schedule *s) {
    for (int r = 0; r < SCHED_MAX_PP; r++) free(s->ops[r]);
    memset(s, 0, sizeof *s);
}

int schedule_stage_rank(const Schedule *s, int pipe, int stage, int *chunk) {
    if (stage < 0 || stage >= s->n_stages) return -1;
    for (int r = 0; r < s->pp; r++)
        for (int c = 0; c < s->n_chunks; c++)
            if (s->chunk[r][c].pipe == pipe && s->chunk[r][c].stage == stage) {
                if (chunk) *chunk = c;
                return r;
            }
    return -1;
}

int schedule_global_mb(const Schedule *s, int rank, int chunk, int mb) {
    return s->chunk[rank][chunk].pipe * s->mb_per_pipe + mb;
}

// The (rank, chunk) of the stage before / after rank's chunk in its pipe; -1 at the pipe's ends.
static int neighbour(const Schedule *s, int rank, int chunk, int step, int *nchunk) {
    const SchedChunk *h = &s->chunk[rank][chunk];
    return schedule_stage_rank(s, h->pipe, h->stage + step, nchunk);
}

// ---------------------------------------------------------------------------- formatting

int schedule_op_format(const SchedOp *op, char *buf, size_t size) {
    switch (op->kind) {
    case SCHED_F: return snprintf(buf, size, "%dF%d", op->chunk, op->mb);
    case SCHED_B: return snprintf(buf, size, "%dB%d", op->chunk, op->mb);
    case SCHED_I: return snprintf(buf, size, "%dI%d", op->chunk, op->mb);
    case SCHED_W: return snprintf(buf, size, "W");
    case SCHED_FB: return snprintf(buf, size, "(%dF%d;%dB%d)", op->chunk, op->mb, op->chunk_b, op->mb_b);
    case SCHED_SEND:
        return snprintf(buf, size, "s%d%c%d>%d", op->chunk, op->msg == SCHED_ACT ? 'F' : 'B', op->mb, op->peer);
    case SCHED_RECV:
        return snprintf(buf, size, "r%d%c%d<%d", op->chunk, op->msg == SCHED_ACT ? 'F' : 'B', op->mb, op->peer);
    }
    return snprintf(buf, size, "?%d", (int)op->kind);
}

// The op as error messages name it: the compact form, and a W's ticket.
static const char *describe(const SchedOp *op, char *buf, size_t size) {
    int n = schedule_op_format(op, buf, size);
    if (op->kind == SCHED_W && n > 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, " (ticket %dI%d)", op->chunk, op->mb);
    return buf;
}

static int is_message(SchedOpKind k) { return k == SCHED_SEND || k == SCHED_RECV; }

void schedule_print_ops(const Schedule *s, FILE *f, int with_messages) {
    char buf[64];
    for (int r = 0; r < s->pp; r++) {
        fprintf(f, "rank %d:", r);
        for (int i = 0; i < s->n_ops[r]; i++) {
            const SchedOp *op = &s->ops[r][i];
            if (is_message(op->kind) && !with_messages) continue;
            schedule_op_format(op, buf, sizeof buf);
            int first = is_message(op->kind) && (i == 0 || !is_message(s->ops[r][i - 1].kind));
            int last = is_message(op->kind) && (i + 1 == s->n_ops[r] || !is_message(s->ops[r][i + 1].kind));
            fprintf(f, " %s%s%s", first ? "[" : "", buf, last ? "]" : "");
        }
        fputc('\n', f);
    }
}

// ---------------------------------------------------------------------------- emitter

typedef struct {
    Schedule *s;
    int r;
    int f_next[2], b_next[2];          // next micro-batch to forward / backward, per chunk
    int recv_f[2], recv_b[2];          // next micro-batch whose input / output-gradient is received
    int send_f[2], send_b[2];          // next micro-batch whose output / input-gradient is sent
    int *wq_chunk, *wq_mb, wq_head, wq_tail;  // W tickets of the I's, oldest first
    int failed;                        // out of memory
} Emitter;

static void emit(Emitter *e, SchedOp op) {
    Schedule *s = e->s;
    int r = e->r;
    if (e->failed) return;
    if (s->n_ops[r] == s->cap_ops[r]) {
        int cap = s->cap_ops[r] ? 2 * s->cap_ops[r] : 64;
        SchedOp *p = realloc(s->ops[r], (size_t)cap * sizeof *p);
        if (!p) {
            e->failed = 1;
            return;
        }
        s->ops[r] = p;
        s->cap_ops[r] = cap;
    }
    s->ops[r][s->n_ops[r]++] = op;
}

static SchedOp make_op(SchedOpKind kind, int chunk, int mb) {
    return (SchedOp){.kind = kind, .chunk = chunk, .mb = mb, .chunk_b = -1, .mb_b = -1, .peer = -1, .msg = SCHED_ACT};
}

static void message(Emitter *e, SchedOpKind kind, SchedMsg msg, int chunk, int mb, int peer) {
    SchedOp op = make_op(kind, chunk, mb);
    op.msg = msg;
    op.peer = peer;
    emit(e, op);
}

// The rank of chunk c's neighbouring stage when it is another rank (a message is needed), else -1.
static int remote(const Emitter *e, int c, int step) {
    int nc, nr = neighbour(e->s, e->r, c, step, &nc);
    return nr >= 0 && nr != e->r ? nr : -1;
}

static void recv_forward(Emitter *e, int c) {
    int p = remote(e, c, -1);
    if (p >= 0) message(e, SCHED_RECV, SCHED_ACT, c, e->recv_f[c]++, p);
}
static void send_forward(Emitter *e, int c) {
    int p = remote(e, c, +1);
    if (p >= 0) message(e, SCHED_SEND, SCHED_ACT, c, e->send_f[c]++, p);
}
static void recv_backward(Emitter *e, int c) {
    int p = remote(e, c, +1);
    if (p >= 0) message(e, SCHED_RECV, SCHED_GRAD, c, e->recv_b[c]++, p);
}
static void send_backward(Emitter *e, int c) {
    int p = remote(e, c, -1);
    if (p >= 0) message(e, SCHED_SEND, SCHED_GRAD, c, e->send_b[c]++, p);
}

static void forward(Emitter *e, int c) { emit(e, make_op(SCHED_F, c, e->f_next[c]++)); }

// zero_bubble: I (the weight gradients wait in the FIFO for a W) instead of B.
static void backward(Emitter *e, int c, int zero_bubble) {
    int mb = e->b_next[c]++;
    emit(e, make_op(zero_bubble ? SCHED_I : SCHED_B, c, mb));
    if (zero_bubble) {
        e->wq_chunk[e->wq_tail] = c;
        e->wq_mb[e->wq_tail++] = mb;
    }
}

static void weight(Emitter *e) {
    if (e->wq_head == e->wq_tail) {  // a generator bug; the validator names it
        emit(e, make_op(SCHED_W, -1, -1));
        return;
    }
    int c = e->wq_chunk[e->wq_head], mb = e->wq_mb[e->wq_head++];
    emit(e, make_op(SCHED_W, c, mb));
}

static void forward_backward(Emitter *e, int cf, int cb) {
    SchedOp op = make_op(SCHED_FB, cf, e->f_next[cf]++);
    op.chunk_b = cb;
    op.mb_b = e->b_next[cb]++;
    emit(e, op);
}

// The pipeline's compound steps: receive, compute, send.
static void forward_step(Emitter *e, int c) {
    recv_forward(e, c);
    forward(e, c);
    send_forward(e, c);
}
static void backward_step(Emitter *e, int c, int zero_bubble) {
    recv_backward(e, c);
    backward(e, c, zero_bubble);
    send_backward(e, c);
}
// recv_f: whether the forward's input is still to be received (it may have been posted earlier).
static void forward_backward_step(Emitter *e, int cf, int cb, int recv_f) {
    if (recv_f) recv_forward(e, cf);
    recv_backward(e, cb);
    forward_backward(e, cf, cb);
    send_forward(e, cf);
    send_backward(e, cb);
}

// ---------------------------------------------------------------------------- generators

// 1F1B (Megatron's non-interleaved schedule): rank r runs P-1-r warm-up forwards, then alternates one
// forward and one backward, then the P-1-r remaining backwards.
static void gen_1f1b(Emitter *e) {
    int P = e->s->pp, N = e->s->n_mb, r = e->r;
    int warm = P - 1 - r < N ? P - 1 - r : N;
    for (int i = 0; i < warm; i++) forward_step(e, 0);
    for (int i = 0; i < N - warm; i++) {
        forward_step(e, 0);
        backward_step(e, 0, 0);
    }
    for (int i = 0; i < warm; i++) backward_step(e, 0, 0);
}

// ZB1P, the ZB-H1 schedule of the zero-bubble paper: 1F1B with the backward split into I and W, where in
// step x rank r runs forward x, input-gradient x-(P-1-r) and weight-gradient x-(P-1) (those that exist).
// The I's keep 1F1B's critical path minus W; the W's, P-1-r steps later than on the last rank, fill the
// cool-down. Every rank keeps at most P micro-batches between forward and W, as rank 0 does in 1F1B.
static void gen_zb1p(Emitter *e) {
    int P = e->s->pp, N = e->s->n_mb, r = e->r;
    for (int x = 0; x < N + P - 1; x++) {
        if (x < N) forward_step(e, 0);
        int i = x - (P - 1 - r), w = x - (P - 1);
        if (i >= 0 && i < N) backward_step(e, 0, 1);
        if (w >= 0 && w < N) weight(e);
    }
}

// DualPipe and DualPipeV, one rank: R = P/2 (DualPipe) or P (DualPipeV), h = the rank's distance from
// the nearer end (DualPipe: min(r, P-1-r); DualPipeV: r), n = micro-batches per pipe. Phase p's chunk is
// p ^ flip: DualPipe's second half of ranks meets direction B first (its phase 0 is chunk 1). middle:
// the rank where the two directions turn round (DualPipe: ranks P/2-1 and P/2; DualPipeV: P-1).
static void gen_dual(Emitter *e, int R, int h, int n, int flip, int middle) {
    int c0 = 0 ^ flip, c1 = 1 ^ flip;
    // 1: forwards of the near direction until the far one arrives
    for (int i = 0; i < (R - h - 1) * 2; i++) forward_step(e, c0);
    // 2: forwards of both directions, interleaved (the next near input is posted ahead)
    recv_forward(e, c0);
    for (int i = 0; i < h + 1; i++) {
        forward(e, c0);
        if (middle) send_forward(e, c0);
        recv_forward(e, c0);
        recv_forward(e, c1);
        forward(e, c1);
        if (!middle || i < h) send_forward(e, c1);  // the middle rank's last one goes out in phase 4
        if (!middle) send_forward(e, c0);
    }
    // 3: zero-bubble backwards of the far direction, each with a W, and its forwards
    for (int i = 0; i < R - h - 1; i++) {
        backward_step(e, c1, 1);
        recv_forward(e, c1);
        weight(e);
        forward(e, c1);
        send_forward(e, c1);
    }
    // 4: the steady state, forward of one direction overlapped with backward of the other
    for (int i = 0; i < n - 2 * R + h + 1; i++) {
        if (i == 0 && middle) {  // the turn: not overlapped, which shortens the bubble
            forward(e, c0);
            send_forward(e, c1);
            recv_backward(e, c1);
            backward(e, c1, 0);
            send_forward(e, c0);
            send_backward(e, c1);
        } else {
            forward_backward_step(e, c0, c1, i > 0);
        }
        forward_backward_step(e, c1, c0, 1);
    }
    // 5: backwards of the far direction and the last overlapped pairs
    for (int i = 0; i < R - h - 1; i++) {
        backward_step(e, c1, 0);
        forward_backward_step(e, c1, c0, 1);
    }
    // 6: backwards of both directions; the second half of them zero-bubble
    int zb = 0;
    for (int i = 0; i < h + 1; i++) {
        if (i == (h + 1) / 2 && h % 2 == 1) zb = 1;
        backward_step(e, c1, zb);
        if (i == (h + 1) / 2 && h % 2 == 0) zb = 1;
        backward_step(e, c0, zb);
    }
    // 7: W's interleaved with the near direction's last zero-bubble backwards
    for (int i = 0; i < R - h - 1; i++) {
        weight(e);
        backward_step(e, c0, 1);
    }
    // 8: drain the W FIFO
    for (int i = 0; i < h + 1; i++) weight(e);
}

int schedule_build(Schedule *s, SchedKind kind, int pp, int n_mb, char *err, size_t err_size) {
    memset(s, 0, sizeof *s);
    const char *name = schedule_kind_name(kind);
    if ((unsigned)kind > SCHED_DUALPIPEV) {
        set_err(err, err_size, "unknown schedule kind %d - expected 1f1b, zb1p, dualpipe or dualpipev", (int)kind);
        return -1;
    }
    if (pp < 1 || pp > SCHED_MAX_PP) {
        set_err(err, err_size, "%s: pp = %d - expected 1 to %d ranks", name, pp, SCHED_MAX_PP);
        return -1;
    }
    if (n_mb < 1 || n_mb > SCHED_MAX_MB) {
        set_err(err, err_size, "%s: microbatches = %d - expected 1 to %d", name, n_mb, SCHED_MAX_MB);
        return -1;
    }
    if (kind == SCHED_DUALPIPE && pp % 2) {
        set_err(err, err_size, "dualpipe: pp = %d is odd - expected an even number of ranks (half of them meet "
                               "each direction first); dualpipev takes any pp", pp);
        return -1;
    }
    if (kind == SCHED_DUALPIPE && n_mb % 2) {
        set_err(err, err_size, "dualpipe: microbatches = %d is odd - expected an even number (half enter at "
                               "each end)", n_mb);
        return -1;
    }
    if ((kind == SCHED_DUALPIPE || kind == SCHED_DUALPIPEV) && n_mb < 2 * pp) {
        set_err(err, err_size, "%s: microbatches = %d < 2 x pp = 2 x %d = %d - expected at least %d", name, n_mb,
                pp, 2 * pp, 2 * pp);
        return -1;
    }
    s->kind = kind;
    s->pp = pp;
    s->n_mb = n_mb;
    s->n_pipes = kind == SCHED_DUALPIPE ? 2 : 1;
    s->mb_per_pipe = n_mb / s->n_pipes;
    s->n_stages = kind == SCHED_DUALPIPEV ? 2 * pp : pp;
    s->n_chunks = kind == SCHED_DUALPIPE || kind == SCHED_DUALPIPEV ? 2 : 1;
    for (int r = 0; r < pp; r++) {
        s->chunk[r][0] = (SchedChunk){.pipe = 0, .stage = r};
        if (kind == SCHED_DUALPIPE) s->chunk[r][1] = (SchedChunk){.pipe = 1, .stage = pp - 1 - r};
        if (kind == SCHED_DUALPIPEV) s->chunk[r][1] = (SchedChunk){.pipe = 0, .stage = 2 * pp - 1 - r};
    }
    int *wq = malloc(2 * (size_t)n_mb * 2 * sizeof *wq);
    if (!wq) {
        set_err(err, err_size, "%s: out of memory for the W FIFO of %d micro-batches", name, n_mb);
        return -1;
    }
    int failed = 0;
    for (int r = 0; r < pp && !failed; r++) {
        Emitter e = {.s = s, .r = r, .wq_chunk = wq, .wq_mb = wq + 2 * n_mb};
        switch (kind) {
        case SCHED_1F1B: gen_1f1b(&e); break;
        case SCHED_ZB1P: gen_zb1p(&e); break;
        case SCHED_DUALPIPE: {
            int h = r < pp - 1 - r ? r : pp - 1 - r;
            gen_dual(&e, pp / 2, h, s->mb_per_pipe, r >= pp / 2, r == pp / 2 - 1 || r == pp / 2);
            break;
        }
        case SCHED_DUALPIPEV: gen_dual(&e, pp, r, n_mb, 0, r == pp - 1); break;
        }
        failed = e.failed;
    }
    free(wq);
    if (failed) {
        set_err(err, err_size, "%s: out of memory for the op lists (pp = %d, microbatches = %d)", name, pp, n_mb);
        schedule_free(s);
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------- validation: one rank

typedef struct {
    int *fwd, *bwd, *wdone, *act_in, *grad_in, *act_out, *grad_out;  // op index per (chunk, mb), -1 none
    int *wq, wq_head, wq_tail;                                     // op indices of the pending I's
} RankState;

#define OPF "rank %d op %d (%s)"

// Checks the ops of rank r in order, alone: each op is possible where it stands.
static int check_rank(const Schedule *s, int r, RankState *st, char *err, size_t err_size) {
    int C = s->n_chunks, M = s->mb_per_pipe, n = C * M;
    int *all[] = {st->fwd, st->bwd, st->wdone, st->act_in, st->grad_in, st->act_out, st->grad_out};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
        for (int i = 0; i < n; i++) all[k][i] = -1;
    st->wq_head = st->wq_tail = 0;
    char d[96];
    for (int i = 0; i < s->n_ops[r]; i++) {
        const SchedOp *op = &s->ops[r][i];
        describe(op, d, sizeof d);
        if ((unsigned)op->kind > SCHED_RECV) {
            set_err(err, err_size, OPF ": unknown op kind %d", r, i, d, (int)op->kind);
            return -1;
        }
        if (op->kind != SCHED_W && (op->chunk < 0 || op->chunk >= C || op->mb < 0 || op->mb >= M)) {
            set_err(err, err_size, OPF ": chunk %d, micro-batch %d - expected chunk 0..%d, micro-batch 0..%d", r,
                    i, d, op->chunk, op->mb, C - 1, M - 1);
            return -1;
        }
        if (op->kind == SCHED_FB && (op->chunk_b < 0 || op->chunk_b >= C || op->mb_b < 0 || op->mb_b >= M)) {
            set_err(err, err_size, OPF ": backward chunk %d, micro-batch %d - expected chunk 0..%d, micro-batch 0..%d",
                    r, i, d, op->chunk_b, op->mb_b, C - 1, M - 1);
            return -1;
        }
        if (is_message(op->kind) && (op->peer < 0 || op->peer >= s->pp || op->peer == r)) {
            set_err(err, err_size, OPF ": peer %d - expected another rank of 0..%d", r, i, d, op->peer, s->pp - 1);
            return -1;
        }
        // what a forward / a backward of (c, m) needs before it starts, checked on the state before the op
        int fc[2], fm[2], nf = 0, bc[2], bm[2], nb = 0;
        if (op->kind == SCHED_F || op->kind == SCHED_FB) fc[nf] = op->chunk, fm[nf++] = op->mb;
        if (op->kind == SCHED_B || op->kind == SCHED_I) bc[nb] = op->chunk, bm[nb++] = op->mb;
        if (op->kind == SCHED_FB) bc[nb] = op->chunk_b, bm[nb++] = op->mb_b;
        for (int k = 0; k < nf; k++) {
            int c = fc[k], m = fm[k], x = c * M + m, pc, pr = neighbour(s, r, c, -1, &pc);
            if (st->fwd[x] >= 0) {
                set_err(err, err_size, OPF ": %dF%d was already forwarded at op %d - expected every micro-batch "
                        "forwarded once per chunk", r, i, d, c, m, st->fwd[x]);
                return -1;
            }
            if (pr == r && st->fwd[pc * M + m] < 0) {
                set_err(err, err_size, OPF ": its input is the output of %dF%d on this rank, which has not run yet",
                        r, i, d, pc, m);
                return -1;
            }
            if (pr >= 0 && pr != r && st->act_in[x] < 0) {
                set_err(err, err_size, OPF ": its input from rank %d has not been received (no r%dF%d<%d before it)",
                        r, i, d, pr, c, m, pr);
                return -1;
            }
        }
        for (int k = 0; k < nb; k++) {
            int c = bc[k], m = bm[k], x = c * M + m, nc, nr = neighbour(s, r, c, +1, &nc);
            if (st->fwd[x] < 0) {
                set_err(err, err_size, OPF ": the backward of %dB%d before its forward %dF%d", r, i, d, c, m, c, m);
                return -1;
            }
            if (st->bwd[x] >= 0) {
                set_err(err, err_size, OPF ": %dB%d already ran its backward at op %d - expected one B or I per "
                        "micro-batch and chunk", r, i, d, c, m, st->bwd[x]);
                return -1;
            }
            if (nr == r && st->bwd[nc * M + m] < 0) {
                set_err(err, err_size, OPF ": its output-gradient comes from %dB%d on this rank, which has not run yet",
                        r, i, d, nc, m);
                return -1;
            }
            if (nr >= 0 && nr != r && st->grad_in[x] < 0) {
                set_err(err, err_size, OPF ": its output-gradient from rank %d has not been received (no r%dB%d<%d "
                        "before it)", r, i, d, nr, c, m, nr);
                return -1;
            }
        }
        if (op->kind == SCHED_FB && op->chunk == op->chunk_b && op->mb == op->mb_b) {
            set_err(err, err_size, OPF ": overlaps a micro-batch's forward with its own backward", r, i, d);
            return -1;
        }
        for (int k = 0; k < nf; k++) st->fwd[fc[k] * M + fm[k]] = i;
        for (int k = 0; k < nb; k++) {
            int x = bc[k] * M + bm[k];
            st->bwd[x] = i;
            if (op->kind == SCHED_I) st->wq[st->wq_tail++] = i;
            else st->wdone[x] = i;
        }
        if (op->kind == SCHED_W) {
            if (st->wq_head == st->wq_tail) {
                set_err(err, err_size, OPF ": no I is waiting for its W (the FIFO of weight-gradient tickets is "
                        "empty)", r, i, d);
                return -1;
            }
            const SchedOp *front = &s->ops[r][st->wq[st->wq_head]];
            if (op->chunk != front->chunk || op->mb != front->mb) {
                set_err(err, err_size, OPF ": the oldest waiting ticket is %dI%d of op %d - W runs the tickets in "
                        "FIFO order", r, i, d, front->chunk, front->mb, st->wq[st->wq_head]);
                return -1;
            }
            st->wdone[front->chunk * M + front->mb] = i;
            st->wq_head++;
        }
        if (is_message(op->kind)) {
            int c = op->chunk, m = op->mb, x = c * M + m;
            int send = op->kind == SCHED_SEND, act = op->msg == SCHED_ACT;
            // an activation goes forward (to the next stage), a gradient backward (to the previous one)
            int step = (send == act) ? +1 : -1, oc, want = neighbour(s, r, c, step, &oc);
            const char *what = act ? (send ? "output" : "input") : (send ? "input-gradient" : "output-gradient");
            if (want < 0 || want == r) {
                set_err(err, err_size, OPF ": chunk %d's %s %s - nothing to %s", r, i, d, c,
                        act == send ? "next stage" : "previous stage",
                        want < 0 ? (step > 0 ? "is the loss" : "is the data") : "is on this rank", send ? "send" : "receive");
                return -1;
            }
            if (op->peer != want) {
                set_err(err, err_size, OPF ": the %s of %d%c%d %s rank %d, not rank %d", r, i, d, what, c,
                        act ? 'F' : 'B', m, send ? "goes to" : "comes from", want, op->peer);
                return -1;
            }
            int *slot = act ? (send ? st->act_out : st->act_in) : (send ? st->grad_out : st->grad_in);
            if (slot[x] >= 0) {
                set_err(err, err_size, OPF ": the %s of %d%c%d was already %s at op %d", r, i, d, what, c,
                        act ? 'F' : 'B', m, send ? "sent" : "received", slot[x]);
                return -1;
            }
            if (send && act && st->fwd[x] < 0) {
                set_err(err, err_size, OPF ": sends the output of %dF%d before that forward ran", r, i, d, c, m);
                return -1;
            }
            if (send && !act && st->bwd[x] < 0) {
                set_err(err, err_size, OPF ": sends the input-gradient of %dB%d before that backward ran", r, i, d,
                        c, m);
                return -1;
            }
            slot[x] = i;
        }
    }
    // completeness
    for (int c = 0; c < C; c++)
        for (int m = 0; m < M; m++) {
            int x = c * M + m, pc, nc, pr = neighbour(s, r, c, -1, &pc), nr = neighbour(s, r, c, +1, &nc);
            if (st->fwd[x] < 0) {
                set_err(err, err_size, "rank %d: %dF%d never runs - expected every micro-batch forwarded once per "
                        "chunk (%d ops)", r, c, m, s->n_ops[r]);
                return -1;
            }
            if (st->bwd[x] < 0) {
                set_err(err, err_size, "rank %d op %d (%dF%d): its backward never runs", r, st->fwd[x], c, m);
                return -1;
            }
            if (nr >= 0 && nr != r && st->act_out[x] < 0) {
                set_err(err, err_size, "rank %d op %d (%dF%d): its output is never sent to rank %d", r, st->fwd[x],
                        c, m, nr);
                return -1;
            }
            if (pr >= 0 && pr != r && st->grad_out[x] < 0) {
                set_err(err, err_size, OPF ": the input-gradient of %dB%d is never sent to rank %d", r, st->bwd[x],
                        describe(&s->ops[r][st->bwd[x]], d, sizeof d), c, m, pr);
                return -1;
            }
        }
    if (st->wq_head != st->wq_tail) {
        int i = st->wq[st->wq_head];
        set_err(err, err_size, "rank %d op %d (%dI%d): its W never runs - expected a W for every I (%d tickets "
                "left in the FIFO)", r, i, s->ops[r][i].chunk, s->ops[r][i].mb, st->wq_tail - st->wq_head);
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------- validation: messages

void schedule_free_matches(const Schedule *s, int **match) {
    for (int r = 0; r < s->pp; r++) {
        free(match[r]);
        match[r] = NULL;
    }
}

// Whether a message from rank a's op x arriving as rank b's op y is the same tensor.
static int same_tensor(const Schedule *s, int a, const SchedOp *x, int b, const SchedOp *y) {
    const SchedChunk *hx = &s->chunk[a][x->chunk], *hy = &s->chunk[b][y->chunk];
    int step = x->msg == SCHED_ACT ? +1 : -1;
    return x->msg == y->msg && x->mb == y->mb && hx->pipe == hy->pipe && hy->stage == hx->stage + step;
}

int schedule_match_messages(const Schedule *s, int **match, char *err, size_t err_size) {
    int P = s->pp;
    for (int r = 0; r < P; r++) match[r] = NULL;
    // the ops of every (src, dst) pair in posting order: sends on src, receives on dst
    int *n_send = calloc((size_t)P * P, sizeof(int)), *n_recv = calloc((size_t)P * P, sizeof(int));
    int *off_s = calloc((size_t)P * P + 1, sizeof(int)), *off_r = calloc((size_t)P * P + 1, sizeof(int));
    int *list_s = NULL, *list_r = NULL, rc = -1;
    if (!n_send || !n_recv || !off_s || !off_r) goto oom;
    for (int r = 0; r < P; r++) {
        if (!(match[r] = malloc((size_t)(s->n_ops[r] ? s->n_ops[r] : 1) * sizeof(int)))) goto oom;
        for (int i = 0; i < s->n_ops[r]; i++) {
            const SchedOp *op = &s->ops[r][i];
            char d[96];
            match[r][i] = -1;
            if (is_message(op->kind) && (op->peer < 0 || op->peer >= P || op->peer == r)) {
                set_err(err, err_size, OPF ": peer %d - expected another rank of 0..%d", r, i,
                        describe(op, d, sizeof d), op->peer, P - 1);
                rc = -1;
                goto done;
            }
            if (op->kind == SCHED_SEND) n_send[r * P + op->peer]++;
            if (op->kind == SCHED_RECV) n_recv[op->peer * P + r]++;
        }
    }
    for (int k = 0; k < P * P; k++) off_s[k + 1] = off_s[k] + n_send[k], off_r[k + 1] = off_r[k] + n_recv[k];
    list_s = malloc((size_t)(off_s[P * P] + 1) * sizeof(int));
    list_r = malloc((size_t)(off_r[P * P] + 1) * sizeof(int));
    if (!list_s || !list_r) goto oom;
    memset(n_send, 0, (size_t)P * P * sizeof(int));
    memset(n_recv, 0, (size_t)P * P * sizeof(int));
    for (int r = 0; r < P; r++)
        for (int i = 0; i < s->n_ops[r]; i++) {
            const SchedOp *op = &s->ops[r][i];
            if (op->kind == SCHED_SEND) list_s[off_s[r * P + op->peer] + n_send[r * P + op->peer]++] = i;
            if (op->kind == SCHED_RECV) list_r[off_r[op->peer * P + r] + n_recv[op->peer * P + r]++] = i;
        }
    char d1[96], d2[96];
    for (int a = 0; a < P; a++)
        for (int b = 0; b < P; b++) {
            int k = a * P + b, ns = n_send[k], nr = n_recv[k];
            for (int q = 0; q < ns && q < nr; q++) {
                int x = list_s[off_s[k] + q], y = list_r[off_r[k] + q];
                const SchedOp *ox = &s->ops[a][x], *oy = &s->ops[b][y];
                if (!same_tensor(s, a, ox, b, oy)) {
                    set_err(err, err_size, OPF " is message %d from rank %d to rank %d, but rank %d's receive %d from "
                            "rank %d is op %d (%s) - sends and receives of a pair must be posted in the same order",
                            a, x, describe(ox, d1, sizeof d1), q + 1, a, b, b, q + 1, a, y, describe(oy, d2, sizeof d2));
                    goto done;
                }
                match[a][x] = y;
                match[b][y] = x;
            }
            if (ns > nr) {
                int x = list_s[off_s[k] + nr];
                set_err(err, err_size, OPF " is message %d from rank %d to rank %d, but rank %d receives only %d from "
                        "rank %d", a, x, describe(&s->ops[a][x], d1, sizeof d1), nr + 1, a, b, b, nr, a);
                goto done;
            }
            if (nr > ns) {
                int y = list_r[off_r[k] + ns];
                set_err(err, err_size, OPF " is receive %d from rank %d, but rank %d sends only %d messages to rank %d",
                        b, y, describe(&s->ops[b][y], d1, sizeof d1), ns + 1, a, a, ns, b);
                goto done;
            }
        }
    rc = 0;
    goto done;
oom:
    set_err(err, err_size, "out of memory matching the messages of %d ranks", P);
done:
    free(n_send), free(n_recv), free(off_s), free(off_r), free(list_s), free(list_r);
    if (rc) schedule_free_matches(s, match);
    return rc;
}

// ---------------------------------------------------------------------------- validation: deadlock

// Runs the ranks under the batch semantics of schedule.h (compute ops always complete; a batch completes
// once every op's match is posted) until all have finished or none can move.
static int check_deadlock(const Schedule *s, int **match, char *err, size_t err_size) {
    int P = s->pp, pc[SCHED_MAX_PP] = {0}, posted_to[SCHED_MAX_PP];  // ops [0, posted_to) are posted
    for (int r = 0; r < P; r++) posted_to[r] = 0;
    for (int moved = 1; moved;) {
        moved = 0;
        for (int r = 0; r < P; r++)
            while (pc[r] < s->n_ops[r]) {
                if (!is_message(s->ops[r][pc[r]].kind)) {
                    pc[r]++;
                    posted_to[r] = pc[r] > posted_to[r] ? pc[r] : posted_to[r];
                    moved = 1;
                    continue;
                }
                int e = pc[r];
                while (e < s->n_ops[r] && is_message(s->ops[r][e].kind)) e++;
                if (posted_to[r] < e) posted_to[r] = e, moved = 1;
                int ready = 1;
                for (int i = pc[r]; i < e && ready; i++) ready = match[r][i] < posted_to[s->ops[r][i].peer];
                if (!ready) break;
                pc[r] = e;
                moved = 1;
            }
    }
    for (int r = 0; r < P; r++) {
        if (pc[r] == s->n_ops[r]) continue;
        int i = pc[r];
        while (match[r][i] < posted_to[s->ops[r][i].peer]) i++;
        int p = s->ops[r][i].peer, j = match[r][i];
        char d1[96], d2[96], d3[96];
        set_err(err, err_size, "deadlock: " OPF " waits for rank %d op %d (%s), which rank %d never posts: it waits "
                "at op %d (%s)", r, i, describe(&s->ops[r][i], d1, sizeof d1), p, j,
                describe(&s->ops[p][j], d2, sizeof d2), p, pc[p],
                pc[p] < s->n_ops[p] ? describe(&s->ops[p][pc[p]], d3, sizeof d3) : "end");
        return -1;
    }
    return 0;
}

int schedule_validate(const Schedule *s, char *err, size_t err_size) {
    if (s->pp < 1 || s->pp > SCHED_MAX_PP || s->n_chunks < 1 || s->n_chunks > 2 || s->mb_per_pipe < 1) {
        set_err(err, err_size, "schedule of pp = %d, %d chunks, %d micro-batches per pipe - expected pp 1..%d, 1 or "
                "2 chunks, at least one micro-batch", s->pp, s->n_chunks, s->mb_per_pipe, SCHED_MAX_PP);
        return -1;
    }
    size_t n = (size_t)s->n_chunks * s->mb_per_pipe;
    int *mem = malloc((7 * n + 2 * n + 1) * sizeof(int));
    if (!mem) {
        set_err(err, err_size, "out of memory validating %zu chunk micro-batches", n);
        return -1;
    }
    RankState st = {mem, mem + n, mem + 2 * n, mem + 3 * n, mem + 4 * n, mem + 5 * n, mem + 6 * n, mem + 7 * n, 0, 0};
    int rc = 0;
    for (int r = 0; r < s->pp && !rc; r++) rc = check_rank(s, r, &st, err, err_size);
    free(mem);
    if (rc) return -1;
    int *match[SCHED_MAX_PP];
    if (schedule_match_messages(s, match, err, err_size) != 0) return -1;
    rc = check_deadlock(s, match, err, err_size);
    schedule_free_matches(s, match);
    return rc;
}

// ---------------------------------------------------------------------------- memory

void schedule_memory(const Schedule *s, int rank, int *act_peak, int *param_chunks) {
    int live = 0, peak = 0;
    for (int i = 0; i < s->n_ops[rank]; i++) {
        SchedOpKind k = s->ops[rank][i].kind;
        if (k == SCHED_F || k == SCHED_FB) live++;
        if (live > peak) peak = live;
        if (k == SCHED_B || k == SCHED_W || k == SCHED_FB) live--;
    }
    *act_peak = peak;
    *param_chunks = s->n_chunks;
}
