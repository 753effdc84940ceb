/*
 * bench_a2a.c - `fp8moe bench a2a`: the expert-parallel dispatch and combine of parallel/ep.h, timed over
 * the ranks of the job at a job's token shapes, beside the backend's raw all-to-all-v
 * (comm_alltoallv_bytes) of the same byte counts in the same run (issue 19 item 8). It answers "what does
 * the EP seam cost above the bytes it has to move": the counts step and the reordering copies of
 * ep_dispatch / ep_combine against the exchange alone.
 *
 * Shapes come from the job (default configs/bench-1gpu.ini): every rank holds micro_batch_size x seq_len
 * tokens (one micro-batch, as each GPU of an EP group would), each routed to top-K of
 * moe.n_routed_experts experts within moe.n_limited_groups of moe.n_expert_groups groups, rows of
 * model.dim values. The EP group is the whole world (mpirun -np P; P divides the experts). No model runs:
 * the routing is drawn at random, twice: uniform, and skewed (expert i of a fixed random order drawn with
 * weight 1 / (i + 1)^S), so that some ranks receive more than others, as a real router's hot experts make
 * them. The experts are the identity (combine sends the received rows back). Before the timing, one
 * dispatch and combine are checked: every received row belongs to a local expert, and combine returns
 * every row to its place.
 *
 * Timing: each run is barrier, dispatch, barrier, combine, barrier, raw dispatch-way exchange, barrier,
 * raw combine-way exchange; an operation's time in a run is the slowest rank's, its reported time the
 * median over the runs. The payload is what ep.c sends today (rows of `real`, FP32); the typed FP8 / BF16
 * payload of DESIGN.md section 5 will change the bytes, not this benchmark.
 *
 * Not here: GPU buffers (the MPI backend takes host buffers today) and NCCL; both will go through the same
 * calls.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/rng.h"
#include "parallel/comm.h"
#include "parallel/ep.h"
#include "parallel/topology.h"
#include "train/bench.h"
#include "train/cli.h"
#include "train/config.h"

const char *const bench_a2a_usage =
    "  fp8moe bench a2a [JOB.ini] [--tokens N] [--runs N] [--warmup N] [--skew S] [--seed N]\n"
    "                   [--set section.key=value]...\n"
    "      Expert-parallel dispatch + combine (parallel/ep.h) over the job's ranks (mpirun -np P, P dividing\n"
    "      moe.n_routed_experts; one process also runs) at JOB.ini's shapes (default configs/bench-1gpu.ini:\n"
    "      micro_batch_size x seq_len tokens per rank, or N, top-K, model.dim), routing drawn at random, uniform\n"
    "      and skewed (expert weights 1/i^S, default S = 1), beside the backend's raw all-to-all-v of the same\n"
    "      byte counts in the same run: bytes per rank, median ms of N runs (default 10 after 2 warm-up),\n"
    "      GB/s and the ratio to raw.\n";

enum { OP_DISPATCH, OP_COMBINE, OP_RAW_DISPATCH, OP_RAW_COMBINE, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"dispatch", "combine", "raw a2a (dispatch way)", "raw a2a (combine way)"};

typedef struct {
    int tokens, K, C, E, n_groups, n_limited;  // per rank
    int runs, warmup;
    double skew;
    uint64_t seed;
} A2aShape;

// What one rank reports for one routing, gathered to rank 0 (doubles only: comm_allgather_bytes of a
// plain array).
typedef struct {
    double rows_sent, rows_recv;            // all rows, this rank's block included
    double off_sent_bytes, off_recv_bytes;  // bytes to / from other ranks
    double ms[OP_COUNT];                    // this rank's own median
} RankReport;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *x, int n) {  // sorts x
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// ---------------------------------------------------------------------------- routing

// Draws one index of w (n entries, weights >= 0, at least one > 0 among !taken) with probability
// proportional to w, skipping taken entries; marks it taken.
static int draw_weighted(const double *w, unsigned char *taken, int n, double u) {
    double total = 0;
    for (int i = 0; i < n; i++)
        if (!taken[i]) total += w[i];
    double at = u * total;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        last = i;
        if (at < w[i]) break;
        at -= w[i];
    }
    taken[last] = 1;
    return last;
}

// expert (tokens x K): each token's K distinct experts, drawn without replacement with weights
// 1 / (1 + order[e])^skew from n_limited groups drawn first (weighted by their experts' sum), as
// group-limited routing allows. order: a random permutation of the experts from the seed alone (the same
// on every rank), so the hot experts fall on any rank. Each rank draws from its own stream.
static void draw_routing(const A2aShape *s, double skew, int rank, int *expert) {
    const int E = s->E, G = s->n_groups, per_group = E / G;
    double *w = malloc((size_t)E * sizeof *w), *gw = malloc((size_t)G * sizeof *gw);
    int *order = malloc((size_t)E * sizeof *order);
    unsigned char *taken = malloc((size_t)E + (size_t)G);
    if (!w || !gw || !order || !taken) {
        fprintf(stderr, "fp8moe bench a2a: out of host memory for the routing of %d experts\n", E);
        exit(1);
    }
    const uint64_t order_key = rng_key(s->seed, 1, 0, 0);
    for (int e = 0; e < E; e++) order[e] = e;
    for (int e = E - 1; e > 0; e--) {  // Fisher-Yates
        const int j = (int)(rng_u64(order_key, (uint64_t)e) % (uint64_t)(e + 1));
        const int t = order[e];
        order[e] = order[j], order[j] = t;
    }
    for (int e = 0; e < E; e++) w[order[e]] = 1.0 / pow(1.0 + e, skew);
    for (int g = 0; g < G; g++) {
        gw[g] = 0;
        for (int e = g * per_group; e < (g + 1) * per_group; e++) gw[g] += w[e];
    }
    const uint64_t key = rng_key(s->seed, 2, (uint64_t)rank, (uint64_t)llround(skew * 1000));
    double *wt = malloc((size_t)E * sizeof *wt);
    if (!wt) exit(1);
    uint64_t ctr = 0;
    for (int t = 0; t < s->tokens; t++) {
        unsigned char *gtaken = taken + E;
        memset(taken, 0, (size_t)E + (size_t)G);
        for (int e = 0; e < E; e++) wt[e] = 0;
        for (int m = 0; m < s->n_limited; m++) {  // the token's groups, then its experts inside them
            const int g = draw_weighted(gw, gtaken, G, rng_uniform(key, ctr++));
            for (int e = g * per_group; e < (g + 1) * per_group; e++) wt[e] = w[e];
        }
        for (int e = 0; e < E; e++)
            if (wt[e] == 0) taken[e] = 1;
        for (int k = 0; k < s->K; k++) expert[(int64_t)t * s->K + k] = draw_weighted(wt, taken, E, rng_uniform(key, ctr++));
    }
    free(wt);
    free(w);
    free(gw);
    free(order);
    free(taken);
}

// ---------------------------------------------------------------------------- one routing

// The value a permuted row carries in its first three columns: its expert, its source rank and its row
// index, so that the check after dispatch and combine can tell where each row came from.
static void fill_rows(real *rows, const int *seg, int E, int C, int rank) {
    for (int e = 0; e < E; e++)
        for (int i = seg[e]; i < seg[e + 1]; i++) {
            real *r = rows + (int64_t)i * C;
            for (int c = 0; c < C; c++) r[c] = (real)0.25;
            r[0] = (real)e;
            if (C > 1) r[1] = (real)rank;
            if (C > 2) r[2] = (real)i;
        }
}

// Runs one routing; fills *mine (this rank) and med (the slowest rank's median per op). Returns 0, or 1
// when the check of the exchange failed on some rank (every rank agrees).
static int bench_routing(Comm *ep, const A2aShape *s, double skew, RankReport *mine, double *med, int64_t *loads) {
    const int P = ep->size, me = ep->rank, E = s->E, C = s->C;
    const int64_t n_rows = (int64_t)s->tokens * s->K;
    int *expert = malloc((size_t)n_rows * sizeof *expert), *seg = calloc((size_t)E + 1, sizeof *seg);
    int64_t *send_b = calloc((size_t)P, sizeof *send_b), *recv_b = calloc((size_t)P, sizeof *recv_b);
    real *perm = malloc((size_t)n_rows * (size_t)C * sizeof(real));
    double *t = calloc((size_t)OP_COUNT * (size_t)s->runs, sizeof *t);
    real *raw_recv = NULL;
    int failed = !expert || !seg || !send_b || !recv_b || !perm || !t;
    if (!failed) {
        draw_routing(s, skew, me, expert);
        for (int64_t i = 0; i < n_rows; i++) seg[expert[i] + 1]++;
        for (int e = 0; e < E; e++) seg[e + 1] += seg[e];
        for (int e = 0; e < E; e++) loads[e] = seg[e + 1] - seg[e];
        fill_rows(perm, seg, E, C, me);
    }
    // the raw exchange's byte counts: the same rows the dispatch sends to each rank
    EpGroup g;  // rows on the host, which is what the benchmark's buffers are (E % P was checked by the caller)
    ep_group_init(&g, ep, E, DEVICE_CPU);
    const int J = g.experts_per_rank;
    for (int q = 0; q < P && !failed; q++)
        send_b[q] = (int64_t)(seg[(q + 1) * J] - seg[q * J]) * C * (int64_t)sizeof(real);
    double fail_any = failed;
    comm_allreduce_max_double(ep, &fail_any, 1);
    if (fail_any > 0) {
        if (failed) fprintf(stderr, "fp8moe bench a2a: rank %d: out of host memory for %lld rows of %d\n", me,
                            (long long)n_rows, C);
        goto done;
    }
    comm_alltoall_counts(ep, send_b, recv_b);
    int64_t recv_total = 0;
    for (int q = 0; q < P; q++) recv_total += recv_b[q];
    raw_recv = calloc((size_t)(recv_total > 0 ? recv_total : 1), 1);
    fail_any = raw_recv == NULL;
    comm_allreduce_max_double(ep, &fail_any, 1);
    if (fail_any > 0) {
        if (!raw_recv) fprintf(stderr, "fp8moe bench a2a: rank %d: out of host memory for %lld bytes\n", me,
                               (long long)recv_total);
        goto done;
    }

    // the check: dispatch once, every received row is of a local expert; combine returns every row
    EpBuffers buf;
    memset(&buf, 0, sizeof buf);
    ep_dispatch(&g, perm, seg, C, &buf);
    int bad = buf.n_rows != recv_total / (C * (int64_t)sizeof(real));
    const int first = ep_first_local_expert(&g);
    for (int j = 0; j < J && !bad; j++)
        for (int i = buf.seg_offsets[j]; i < buf.seg_offsets[j + 1]; i++)
            if (buf.rows[(int64_t)i * C] != (real)(first + j)) bad = 1;
    const real *back = ep_combine(&g, &buf, buf.rows);
    bad = bad || memcmp(back, perm, (size_t)n_rows * C * sizeof(real)) != 0;
    fail_any = bad;
    comm_allreduce_max_double(ep, &fail_any, 1);
    if (fail_any > 0) {
        if (bad) fprintf(stderr, "fp8moe bench a2a: rank %d: the dispatch or combine moved a row to the wrong "
                                 "place (skew %g) - a bug in parallel/ep.c\n", me, skew);
        ep_buffers_release(&buf);
        goto done;
    }

    for (int run = 0; run < s->warmup + s->runs; run++) {
        double d[OP_COUNT];
        for (int op = 0; op < OP_COUNT; op++) {
            comm_barrier(ep);
            const double t0 = now_s();
            switch (op) {
            case OP_DISPATCH: ep_dispatch(&g, perm, seg, C, &buf); break;
            case OP_COMBINE: ep_combine(&g, &buf, buf.rows); break;
            case OP_RAW_DISPATCH: comm_alltoallv_bytes(ep, perm, send_b, raw_recv, recv_b); break;
            case OP_RAW_COMBINE: comm_alltoallv_bytes(ep, raw_recv, recv_b, perm, send_b); break;
            }
            d[op] = now_s() - t0;
        }
        if (run < s->warmup) continue;
        for (int op = 0; op < OP_COUNT; op++) t[(int64_t)op * s->runs + (run - s->warmup)] = d[op];
    }
    ep_buffers_release(&buf);

    // this rank's medians, then the slowest rank's time of each run
    double *tmp = malloc((size_t)s->runs * sizeof *tmp);
    if (!tmp) exit(1);
    for (int op = 0; op < OP_COUNT; op++) {
        memcpy(tmp, t + (int64_t)op * s->runs, (size_t)s->runs * sizeof *tmp);
        mine->ms[op] = 1e3 * median(tmp, s->runs);
    }
    comm_allreduce_max_double(ep, t, (int64_t)OP_COUNT * s->runs);
    for (int op = 0; op < OP_COUNT; op++) med[op] = 1e3 * median(t + (int64_t)op * s->runs, s->runs);
    free(tmp);
    mine->rows_sent = (double)n_rows;
    mine->rows_recv = (double)(recv_total / (C * (int64_t)sizeof(real)));
    mine->off_sent_bytes = mine->off_recv_bytes = 0;
    for (int q = 0; q < P; q++)
        if (q != me) mine->off_sent_bytes += (double)send_b[q], mine->off_recv_bytes += (double)recv_b[q];
done:
    ep_group_free(&g);
    free(expert);
    free(seg);
    free(send_b);
    free(recv_b);
    free(perm);
    free(raw_recv);
    free(t);
    return fail_any > 0;
}

// ---------------------------------------------------------------------------- report

static void print_report(const char *what, double skew, const A2aShape *s, int P, const RankReport *all,
                         const double *med, const int64_t *loads) {
    int64_t max_load = 0, sum_load = 0;
    for (int e = 0; e < s->E; e++) max_load = loads[e] > max_load ? loads[e] : max_load, sum_load += loads[e];
    double busiest = 0, mean_sent = 0, max_recv_rows = 0, mean_recv_rows = 0;
    for (int r = 0; r < P; r++) {
        const double b = fmax(all[r].off_sent_bytes, all[r].off_recv_bytes);
        if (b > busiest) busiest = b;
        mean_sent += all[r].off_sent_bytes / P;
        max_recv_rows = fmax(max_recv_rows, all[r].rows_recv);
        mean_recv_rows += all[r].rows_recv / P;
    }
    printf("\n%s routing (skew %g): expert load max/mean %.2f, rows received per rank max/mean %.2f\n", what, skew,
           (double)max_load * s->E / (double)(sum_load ? sum_load : 1), max_recv_rows / fmax(mean_recv_rows, 1));
    printf("  %-4s %10s %10s %12s %12s %12s %12s %12s %12s\n", "rank", "rows out", "rows in", "MB to others",
           "MB from oth.", "dispatch ms", "combine ms", "raw d. ms", "raw c. ms");
    for (int r = 0; r < P; r++)
        printf("  %-4d %10.0f %10.0f %12.2f %12.2f %12.3f %12.3f %12.3f %12.3f\n", r, all[r].rows_sent,
               all[r].rows_recv, all[r].off_sent_bytes / 1e6, all[r].off_recv_bytes / 1e6, all[r].ms[0],
               all[r].ms[1], all[r].ms[2], all[r].ms[3]);
    printf("  slowest rank, median of %d runs; GB/s = the busiest rank's bytes to or from other ranks (%.2f MB; "
           "mean sent %.2f MB) / time\n", s->runs, busiest / 1e6, mean_sent / 1e6);
    printf("  %-24s %10s %10s %14s\n", "op", "ms", "GB/s", "/ raw (time)");
    for (int op = 0; op < OP_COUNT; op++) {
        const double raw = med[op < OP_RAW_DISPATCH ? op + OP_RAW_DISPATCH : op];
        char ratio[32] = "-";
        if (op < OP_RAW_DISPATCH && raw > 0) snprintf(ratio, sizeof ratio, "%.2f", med[op] / raw);
        printf("  %-24s %10.3f %10.2f %14s\n", op_names[op], med[op], med[op] > 0 ? busiest / 1e6 / med[op] : 0.0,
               ratio);
    }
    printf("  dispatch + combine %.3f ms, raw %.3f ms: %.2f x raw\n", med[0] + med[1], med[2] + med[3],
           med[2] + med[3] > 0 ? (med[0] + med[1]) / (med[2] + med[3]) : 0.0);
}

// ---------------------------------------------------------------------------- command

static int usage_fail(Comm *world, const char *fmt, const char *arg) {
    if (world->rank == 0) {
        fprintf(stderr, "fp8moe bench a2a: ");
        fprintf(stderr, fmt, arg);
        fprintf(stderr, "\n\nUsage:\n%s", bench_a2a_usage);
    }
    return 2;
}

static int run_bench(int argc, char **argv, Comm *world) {
    const char *job = NULL;
    A2aShape s = {.runs = 10, .warmup = 2, .skew = 1.0, .seed = 1234};
    int tokens = 0;
    const char **overrides = calloc((size_t)argc + 1, sizeof *overrides);
    int n_overrides = 0, rc = 2;
    if (!overrides) return 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            if (world->rank == 0) printf("Usage:\n%s", bench_a2a_usage);
            rc = 0;
            goto done;
        } else if (!strcmp(a, "--tokens") || !strcmp(a, "--runs") || !strcmp(a, "--warmup") || !strcmp(a, "--seed")) {
            int x;
            const int lo = !strcmp(a, "--warmup") ? 0 : 1;
            if (cli_parse_int(v, lo, 100000000, &x) != 0) {
                char m[96];
                snprintf(m, sizeof m, "%s %%s: expected an integer from %d to 100000000", a, lo);
                rc = usage_fail(world, m, v ? v : "(missing)");
                goto done;
            }
            if (!strcmp(a, "--tokens")) tokens = x;
            else if (!strcmp(a, "--runs")) s.runs = x;
            else if (!strcmp(a, "--warmup")) s.warmup = x;
            else s.seed = (uint64_t)x;
            i++;
        } else if (!strcmp(a, "--skew")) {
            char *end = NULL;
            const double x = v ? strtod(v, &end) : 0;
            if (!v || end == v || *end || !(x >= 0) || x > 100) {
                rc = usage_fail(world, "--skew %s: expected a number from 0 to 100", v ? v : "(missing)");
                goto done;
            }
            s.skew = x;
            i++;
        } else if (!strcmp(a, "--set")) {
            if (!v || !strchr(v, '=') || !strchr(v, '.')) {
                rc = usage_fail(world, "--set %s: expected section.key=value", v ? v : "(missing)");
                goto done;
            }
            overrides[n_overrides++] = argv[++i];
        } else if (a[0] == '-' && a[1] != '\0') {
            rc = usage_fail(world, "unknown option %s", a);
            goto done;
        } else if (job) {
            rc = usage_fail(world, "one job file expected; got a second one: %s", a);
            goto done;
        } else {
            job = a;
        }
    }
    if (!job) job = "configs/bench-1gpu.ini";
    Config *cfg = malloc(sizeof *cfg);
    char err[2048];
    if (!cfg) {
        rc = 1;
        goto done;
    }
    if (config_load(cfg, job, overrides, n_overrides, err, sizeof err) != 0) {
        if (world->rank == 0) fprintf(stderr, "fp8moe bench a2a: %s\n", err);
        free(cfg);
        goto done;
    }
    s.tokens = tokens > 0 ? tokens : cfg->train.micro_batch_size * cfg->train.seq_len;
    s.K = cfg->moe.n_activated_experts, s.C = cfg->model.dim, s.E = cfg->moe.n_routed_experts;
    s.n_groups = cfg->moe.n_expert_groups, s.n_limited = cfg->moe.n_limited_groups;
    free(cfg);
    const int P = world->size;
    if (s.E % P != 0) {
        if (world->rank == 0)
            fprintf(stderr, "fp8moe bench a2a: %d ranks do not divide moe.n_routed_experts = %d of %s - expected "
                    "mpirun -np P with P dividing %d (the experts are split evenly over the ranks)\n", P, s.E, job, s.E);
        goto done;
    }
    if ((int64_t)s.tokens * s.K > INT32_MAX / 2) {
        if (world->rank == 0)
            fprintf(stderr, "fp8moe bench a2a: %d tokens x top-%d = %lld rows: more than ep.h's int row offsets "
                    "hold - expected fewer --tokens\n", s.tokens, s.K, (long long)s.tokens * s.K);
        goto done;
    }
    const double row_bytes = (double)s.C * sizeof(real), perm_mb = (double)s.tokens * s.K * row_bytes / 1e6;
    if (world->rank == 0) {
        printf("# bench a2a: %s, %d rank(s) (%s), EP group = the world\n", job, P, comm_kind_name(world->kind));
        printf("per rank: %d tokens x top-%d = %lld rows of %d x %zu-byte values (%.0f bytes, FP32 as ep.c sends "
               "them; BF16 would be %d, FP8 + 1x128 scales %d)\n", s.tokens, s.K, (long long)s.tokens * s.K, s.C,
               sizeof(real), row_bytes, 2 * s.C, s.C + 4 * ((s.C + 127) / 128));
        printf("experts: %d (%d per rank) in %d groups, %d per token; %d timed runs after %d warm-up; host memory "
               "about %.1f MB per rank\n", s.E, s.E / P, s.n_groups, s.n_limited, s.runs, s.warmup, 6 * perm_mb);
        topology_print(stdout);  // the host's RDMA devices: what an inter-node exchange would run over
        if (P == 1) printf("one rank: dispatch and combine are views of the caller's rows (no copy), the raw "
                           "exchange is one copy to itself\n");
        fflush(stdout);
    }
    RankReport mine, *all = malloc((size_t)P * sizeof *all);
    int64_t *loads = malloc((size_t)s.E * sizeof *loads);
    if (!all || !loads) {
        free(all), free(loads);
        rc = 1;
        goto done;
    }
    static const char *const what[2] = {"uniform", "skewed"};
    rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        const double skew = i == 0 ? 0.0 : s.skew;
        double med[OP_COUNT];
        memset(&mine, 0, sizeof mine);
        if (bench_routing(world, &s, skew, &mine, med, loads) != 0) {
            rc = 1;
            break;
        }
        comm_allreduce_sum_i64(world, loads, s.E);
        comm_allgather_bytes(world, &mine, all, sizeof mine);
        if (world->rank == 0) print_report(what[i], skew, &s, P, all, med, loads);
        fflush(stdout);
    }
    free(all);
    free(loads);
done:
    free(overrides);
    return rc;
}

int bench_a2a_main(int argc, char **argv) {
    const int mpi = comm_launched_by_mpi();
    if (mpi) comm_init(NULL, NULL);
    Comm *world = comm_world();
    Comm *ep = comm_split(world, 0, world->rank, "ep");  // named "ep" in any message of the exchange
    const int rc = run_bench(argc, argv, ep);
    comm_free(ep);
    if (mpi) comm_finalize();
    return rc;
}
