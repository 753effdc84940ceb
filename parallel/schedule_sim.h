/*
 * schedule_sim.h - times any validated pipeline schedule (parallel/schedule.h) with fixed op costs and
 * zero message latency, to measure its makespan and every rank's bubble against Table 2 of the
 * DeepSeek-V3 report, and draws the result as a text timeline (docs/parallelism.md, `fp8moe schedule`).
 *
 * Model. Every rank runs its ops in order, one at a time: F costs f, B costs b, I costs b - w, W costs
 * w, FB costs fb (the overlapped pair). A batch of messages (schedule.h) is posted when the rank reaches
 * it; with latency 0 its receives complete when the peer posts the matching sends, and its sends at
 * once (the data leaves; the executor waits for a send only before it reuses the buffer). A stage's
 * forward thus starts once the previous stage's forward has run and sent, a backward once the next
 * stage's backward has: the dependencies, nothing more. With SchedCosts.wait_sends a send also waits
 * until its receive is posted (rendezvous, the validator's deadlock semantics), which costs some
 * schedules time: ZB1P's gradient sends wait for the receiver's next forward.
 *
 * Bubble. bubble(r) = makespan - busy(r), busy(r) the sum of rank r's op costs: the time rank r is
 * idle while the step runs. This is what Table 2 counts: in 1F1B every rank computes N (F + B) and is
 * idle (PP-1)(F+B) of the makespan; in DualPipe every rank computes N F and N B (FB pairs counted at
 * their overlapped cost) and is idle (PP/2-1)(F&B+B-3W). Formula and simulation part where the formula's
 * assumptions fail (schedule_bubble_formula, docs/parallelism.md).
 */
#ifndef FP8MOE_SCHEDULE_SIM_H
#define FP8MOE_SCHEDULE_SIM_H

#include <stddef.h>
#include <stdio.h>

#include "parallel/schedule.h"

typedef struct {
    double f, b, w, fb;  // forward, full backward, weight-gradient part, overlapped forward + backward
    int wait_sends;      // 0: sends complete at once (default); 1: a send waits until its receive is posted
} SchedCosts;

typedef struct {
    double makespan;
    double busy[SCHED_MAX_PP];    // sum of the rank's op costs
    double bubble[SCHED_MAX_PP];  // makespan - busy
    double end_rank[SCHED_MAX_PP];  // when the rank's last op completes
    double *start[SCHED_MAX_PP];  // per op: compute start, or when a message's batch was posted
    double *end[SCHED_MAX_PP];    // per op: compute end, or when its batch completed
} SchedSim;

// Parses "F=1,B=2,W=1,FB=3" (keys F, B, W, FB in any order and case; each at most once) into *c. Keys
// not given: F=1, B=2, W=1, FB=F+B. Every value a number >= 0 and W <= B (I = B - W). Returns 0, or -1
// with err naming the key and what was expected.
int schedule_costs_parse(const char *text, SchedCosts *c, char *err, size_t err_size);

// Validates s (schedule_validate's error on failure) and simulates it into *out (per-op arrays owned by
// out: schedule_sim_free). Returns 0 or -1 with err.
int schedule_simulate(const Schedule *s, const SchedCosts *c, SchedSim *out, char *err, size_t err_size);
void schedule_sim_free(SchedSim *sim);
// schedule_simulate with costs of their own for every rank and chunk (the stages of a real model differ: the
// last holds the head and the losses): rank r's ops of chunk k cost as c[2 r + k] says (2 s->pp entries; a rank
// with one chunk reads only its first), an FB that chunk's fb with its backward chunk's b in place of the
// forward chunk's (fb - b + b'); wait_sends is c[0]'s. With every entry the same, schedule_simulate's times.
int schedule_simulate_stages(const Schedule *s, const SchedCosts *c, SchedSim *out, char *err, size_t err_size);

// Table 2's bubble for kind at pp ranks: 1f1b (PP-1)(F+B), zb1p (PP-1)(F+B-2W), dualpipe
// (PP/2-1)(F&B+B-3W), dualpipev the same with PP = 2 pp stages, i.e. (pp-1)(F&B+B-3W).
double schedule_bubble_formula(SchedKind kind, int pp, const SchedCosts *c);

// Each rank as one line of cols_per_unit characters per unit of time: an op's compact form padded with
// spaces over its duration, '.' where the rank is idle.
void schedule_print_timeline(const Schedule *s, const SchedSim *sim, int cols_per_unit, FILE *f);

#endif
