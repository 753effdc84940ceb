/*
 * schedule_sim.c - the pipeline schedule simulator (schedule_sim.h): op costs, the batch semantics of
 * messages with zero latency, makespan and per-rank bubble, Table 2's formulas and a text timeline.
 *
 * The ranks' times are found as a fixed point rather than by a global clock: a rank advances through
 * its compute ops on its own, and through a batch of messages once every peer it waits for has posted
 * the matching op, at the latest of those posting times. A validated schedule has no deadlock under
 * these semantics, so every rank reaches its end.
 */
#include "parallel/schedule_sim.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static void set_err(char *err, size_t size, const char *fmt, ...) {
    if (!err || !size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, size, fmt, ap);
    va_end(ap);
}

int schedule_costs_parse(const char *text, SchedCosts *c, char *err, size_t err_size) {
    double v[4] = {1, 2, 1, -1};
    int seen[4] = {0};
    static const char *const keys[4] = {"F", "B", "W", "FB"};
    const char *p = text ? text : "";
    if (!*p) {
        set_err(err, err_size, "--costs is empty - expected F=1,B=2,W=1,FB=3");
        return -1;
    }
    while (*p) {
        const char *eq = strchr(p, '='), *comma = strchr(p, ',');
        if (!comma) comma = p + strlen(p);
        if (!eq || eq > comma) {
            set_err(err, err_size, "--costs: '%.*s' - expected KEY=VALUE with KEY one of F, B, W, FB", (int)(comma - p), p);
            return -1;
        }
        int k = -1;
        for (int i = 0; i < 4; i++)
            if ((size_t)(eq - p) == strlen(keys[i]) && !strncasecmp(p, keys[i], (size_t)(eq - p))) k = i;
        if (k < 0) {
            set_err(err, err_size, "--costs: unknown key '%.*s' - expected F, B, W or FB", (int)(eq - p), p);
            return -1;
        }
        if (seen[k]) {
            set_err(err, err_size, "--costs: %s given twice", keys[k]);
            return -1;
        }
        char num[64], *end;
        size_t len = (size_t)(comma - eq - 1);
        if (len == 0 || len >= sizeof num) {
            set_err(err, err_size, "--costs: %s=%.*s - expected a number >= 0", keys[k], (int)len, eq + 1);
            return -1;
        }
        memcpy(num, eq + 1, len);
        num[len] = '\0';
        errno = 0;
        double x = strtod(num, &end);
        if (errno || end == num || *end || !(x >= 0) || !isfinite(x)) {
            set_err(err, err_size, "--costs: %s=%s - expected a number >= 0", keys[k], num);
            return -1;
        }
        v[k] = x;
        seen[k] = 1;
        p = *comma ? comma + 1 : comma;
    }
    if (v[2] > v[1]) {
        set_err(err, err_size, "--costs: W=%g > B=%g - expected W <= B (W is a part of the backward, I = B - W)",
                v[2], v[1]);
        return -1;
    }
    c->f = v[0];
    c->b = v[1];
    c->w = v[2];
    c->fb = seen[3] ? v[3] : v[0] + v[1];
    c->wait_sends = 0;
    return 0;
}

// Rank r's op under costs c (one SchedCosts, or with `stages` one per rank and chunk, c[2 r + chunk]).
static double op_cost(const SchedOp *op, int r, const SchedCosts *c, int stages) {
    const SchedCosts *k = stages ? &c[2 * r + op->chunk] : c;
    switch (op->kind) {
    case SCHED_F: return k->f;
    case SCHED_B: return k->b;
    case SCHED_I: return k->b - k->w;
    case SCHED_W: return k->w;
    case SCHED_FB: {  // the forward's chunk's overlapped pair, with the backward's own B in place of its chunk's
        const SchedCosts *kb = stages ? &c[2 * r + op->chunk_b] : c;
        return k->fb - k->b + kb->b;
    }
    default: return 0;
    }
}

static int is_message(SchedOpKind k) { return k == SCHED_SEND || k == SCHED_RECV; }

void schedule_sim_free(SchedSim *sim) {
    for (int r = 0; r < SCHED_MAX_PP; r++) {
        free(sim->start[r]);
        free(sim->end[r]);
    }
    memset(sim, 0, sizeof *sim);
}

static int simulate(const Schedule *s, const SchedCosts *c, int stages, SchedSim *out, char *err, size_t err_size) {
    memset(out, 0, sizeof *out);
    if (schedule_validate(s, err, err_size) != 0) return -1;
    int *match[SCHED_MAX_PP];
    if (schedule_match_messages(s, match, err, err_size) != 0) return -1;
    int P = s->pp, pc[SCHED_MAX_PP] = {0};
    double t[SCHED_MAX_PP] = {0};
    for (int r = 0; r < P; r++) {
        size_t n = (size_t)(s->n_ops[r] ? s->n_ops[r] : 1);
        out->start[r] = malloc(n * sizeof(double));
        out->end[r] = malloc(n * sizeof(double));
        if (!out->start[r] || !out->end[r]) {
            set_err(err, err_size, "out of memory simulating %d ops of rank %d", s->n_ops[r], r);
            schedule_free_matches(s, match);
            schedule_sim_free(out);
            return -1;
        }
        for (int i = 0; i < s->n_ops[r]; i++) out->start[r][i] = -1;  // -1: not posted yet
    }
    for (int moved = 1; moved;) {
        moved = 0;
        for (int r = 0; r < P; r++)
            while (pc[r] < s->n_ops[r]) {
                const SchedOp *op = &s->ops[r][pc[r]];
                if (!is_message(op->kind)) {
                    double d = op_cost(op, r, c, stages);
                    out->start[r][pc[r]] = t[r];
                    out->end[r][pc[r]] = t[r] + d;
                    out->busy[r] += d;
                    t[r] += d;
                    pc[r]++;
                    moved = 1;
                    continue;
                }
                int e = pc[r];
                while (e < s->n_ops[r] && is_message(s->ops[r][e].kind)) e++;
                if (out->start[r][pc[r]] < 0) {
                    for (int i = pc[r]; i < e; i++) out->start[r][i] = t[r];
                    moved = 1;
                }
                double done = t[r];
                int ready = 1;
                for (int i = pc[r]; i < e && ready; i++) {
                    const SchedOp *m = &s->ops[r][i];
                    if (!c->wait_sends && m->kind == SCHED_SEND) continue;  // eager: a send never waits
                    double posted = out->start[m->peer][match[r][i]];
                    if (posted < 0) ready = 0;
                    else if (posted > done) done = posted;
                }
                if (!ready) break;
                for (int i = pc[r]; i < e; i++) out->end[r][i] = done;
                t[r] = done;
                pc[r] = e;
                moved = 1;
            }
    }
    schedule_free_matches(s, match);
    for (int r = 0; r < P; r++)
        if (pc[r] < s->n_ops[r]) {  // cannot happen after schedule_validate; kept as a guard
            set_err(err, err_size, "simulation: rank %d stopped at op %d of %d", r, pc[r], s->n_ops[r]);
            schedule_sim_free(out);
            return -1;
        }
    for (int r = 0; r < P; r++) {
        out->end_rank[r] = t[r];
        if (t[r] > out->makespan) out->makespan = t[r];
    }
    for (int r = 0; r < P; r++) out->bubble[r] = out->makespan - out->busy[r];
    return 0;
}

int schedule_simulate(const Schedule *s, const SchedCosts *c, SchedSim *out, char *err, size_t err_size) {
    return simulate(s, c, 0, out, err, err_size);
}

int schedule_simulate_stages(const Schedule *s, const SchedCosts *c, SchedSim *out, char *err, size_t err_size) {
    return simulate(s, c, 1, out, err, err_size);
}

double schedule_bubble_formula(SchedKind kind, int pp, const SchedCosts *c) {
    switch (kind) {
    case SCHED_1F1B: return (pp - 1) * (c->f + c->b);
    case SCHED_ZB1P: return (pp - 1) * (c->f + c->b - 2 * c->w);
    case SCHED_DUALPIPE: return (pp / 2.0 - 1) * (c->fb + c->b - 3 * c->w);
    case SCHED_DUALPIPEV: return (pp - 1) * (c->fb + c->b - 3 * c->w);
    }
    return NAN;
}

void schedule_print_timeline(const Schedule *s, const SchedSim *sim, int cols_per_unit, FILE *f) {
    int width = (int)ceil(sim->makespan * cols_per_unit - 1e-9);
    char *line = malloc((size_t)width + 1), label[64];
    if (!line) return;
    for (int r = 0; r < s->pp; r++) {
        memset(line, '.', (size_t)width);
        line[width] = '\0';
        for (int i = 0; i < s->n_ops[r]; i++) {
            const SchedOp *op = &s->ops[r][i];
            if (is_message(op->kind)) continue;
            int a = (int)lround(sim->start[r][i] * cols_per_unit), b = (int)lround(sim->end[r][i] * cols_per_unit);
            if (b > width) b = width;
            if (b <= a) continue;  // an op of zero cost
            int n = schedule_op_format(op, label, sizeof label);
            for (int x = a; x < b; x++) line[x] = x - a < n ? label[x - a] : ' ';
            if (b - a > 1 && n >= b - a) line[b - 1] = ' ';  // a truncated label keeps a gap to the next op
        }
        fprintf(f, "rank %*d |%s|\n", s->pp > 10 ? 2 : 1, r, line);
    }
    free(line);
}
