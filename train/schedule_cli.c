/*
 * schedule_cli.c - the `fp8moe schedule` command: a pipeline schedule built, checked, printed and
 * simulated from the command line, so that a schedule can be looked at (and its bubble compared with
 * Table 2 of the DeepSeek-V3 report) without starting a job. Argument parsing and output only; the
 * schedules, the validator and the simulator are parallel/schedule.c and parallel/schedule_sim.c.
 *
 * Output (one fact per line, key=value where a script reads it; docs/parallelism.md):
 *   schedule KIND pp=P microbatches=N pipes=D stages=S chunks=C
 *   valid: every static check passed (... ops, ... messages)
 *   memory: a stage is 1/S of the model; activations in live micro-batch sets of one stage, ...
 *   [--print-ops]  rank R: op op ...
 *   [--costs]      costs F=.. B=.. W=.. I=.. FB=.. sends=eager|wait
 *                  makespan=T
 *                  bubble formula=X simulated=Y      (Y: the largest rank's bubble)
 *   rank R: [busy=.. bubble=..] activations=A parameters=Cx
 *   [--timeline]   rank R |0F0 0F1 ...|
 */
#include "train/cli.h"
#include "train/schedule_cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"


const char *const schedule_cli_usage = SCHEDULE_CLI_USAGE;

// "--name VALUE" or "--name=VALUE": the value, advancing *i past it; NULL when a is not --name.
// *missing is set when --name has no value.
static const char *option_value(int argc, char **argv, int *i, const char *name, int *missing) {
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) {
        *missing = 1;
        return NULL;
    }
    return argv[++*i];
}

int schedule_cli_main(int argc, char **argv) {
    const char *kind_s = NULL, *pp_s = NULL, *mb_s = NULL, *costs_s = NULL;
    int print_ops = 0, with_messages = 0, timeline_cols = 0, wait_sends = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v;
        int missing = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", schedule_cli_usage);
            return 0;
        } else if ((v = option_value(argc, argv, &i, "--kind", &missing)) || missing) {
            if (missing) return cli_usage_error("schedule", schedule_cli_usage, "%s needs a value: 1f1b, zb1p, dualpipe or dualpipev", a);
            kind_s = v;
        } else if ((v = option_value(argc, argv, &i, "--pp", &missing)) || missing) {
            if (missing) return cli_usage_error("schedule", schedule_cli_usage, "%s needs a number of pipeline ranks", a);
            pp_s = v;
        } else if ((v = option_value(argc, argv, &i, "--microbatches", &missing)) || missing) {
            if (missing) return cli_usage_error("schedule", schedule_cli_usage, "%s needs a number of micro-batches", a);
            mb_s = v;
        } else if ((v = option_value(argc, argv, &i, "--costs", &missing)) || missing) {
            if (missing) return cli_usage_error("schedule", schedule_cli_usage, "%s needs a value such as F=1,B=2,W=1,FB=3", a);
            costs_s = v;
        } else if (!strcmp(a, "--print-ops")) {
            print_ops = 1;
        } else if (!strcmp(a, "--print-ops=all")) {
            print_ops = with_messages = 1;
        } else if (!strncmp(a, "--print-ops=", 12)) {
            return cli_usage_error("schedule", schedule_cli_usage, "%s: expected --print-ops or --print-ops=all", a);
        } else if (!strcmp(a, "--timeline")) {
            timeline_cols = 4;
        } else if (!strncmp(a, "--timeline=", 11)) {
            if (cli_parse_int(a + 11, 1, 64, &timeline_cols) != 0)
                return cli_usage_error("schedule", schedule_cli_usage, "%s: expected --timeline=COLS, COLS an integer from 1 to 64 characters per unit", a);
        } else if (!strcmp(a, "--wait-sends")) {
            wait_sends = 1;
        } else if (a[0] == '-') {
            return cli_usage_error("schedule", schedule_cli_usage, "unknown option %s", a);
        } else {
            return cli_usage_error("schedule", schedule_cli_usage, "unexpected argument %s (every setting is an option, e.g. --pp 4)", a);
        }
    }
    if (!kind_s) return cli_usage_error("schedule", schedule_cli_usage, "missing --kind (1f1b, zb1p, dualpipe or dualpipev)%s", "");
    if (!pp_s) return cli_usage_error("schedule", schedule_cli_usage, "missing --pp P (pipeline ranks)%s", "");
    if (!mb_s) return cli_usage_error("schedule", schedule_cli_usage, "missing --microbatches N%s", "");
    SchedKind kind;
    if (schedule_kind_parse(kind_s, &kind) != 0)
        return cli_usage_error("schedule", schedule_cli_usage, "--kind %s: expected 1f1b, zb1p, dualpipe or dualpipev", kind_s);
    int pp, n_mb;
    char msg[256];
    if (cli_parse_int(pp_s, 1, SCHED_MAX_PP, &pp) != 0) {
        snprintf(msg, sizeof msg, "--pp %s: expected an integer from 1 to %d", pp_s, SCHED_MAX_PP);
        return cli_usage_error("schedule", schedule_cli_usage, "%s", msg);
    }
    if (cli_parse_int(mb_s, 1, SCHED_MAX_MB, &n_mb) != 0) {
        snprintf(msg, sizeof msg, "--microbatches %s: expected an integer from 1 to %d", mb_s, SCHED_MAX_MB);
        return cli_usage_error("schedule", schedule_cli_usage, "%s", msg);
    }
    char err[1024];
    SchedCosts costs;
    int simulate = costs_s || timeline_cols;
    // without --costs the defaults (F=1 is one of them)
    if (schedule_costs_parse(costs_s ? costs_s : "F=1", &costs, err, sizeof err) != 0) return cli_usage_error("schedule", schedule_cli_usage, "%s", err);
    costs.wait_sends = wait_sends;
    if (wait_sends && !simulate) return cli_usage_error("schedule", schedule_cli_usage, "%s needs --costs or --timeline (it changes the simulation)", "--wait-sends");

    Schedule s;
    if (schedule_build(&s, kind, pp, n_mb, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe schedule: %s\n", err);  // the constraint, with the numbers: bad usage
        return EXIT_USAGE;
    }
    int rc = 0;
    SchedSim sim = {0};
    printf("schedule %s pp=%d microbatches=%d pipes=%d stages=%d chunks=%d\n", schedule_kind_name(kind), pp, n_mb,
           s.n_pipes, s.n_stages, s.n_chunks);
    if (schedule_validate(&s, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe schedule: invalid schedule: %s\n", err);
        rc = 1;
        goto done;
    }
    long n_ops = 0, n_msgs = 0;
    for (int r = 0; r < pp; r++)
        for (int i = 0; i < s.n_ops[r]; i++) {
            n_ops++;
            n_msgs += s.ops[r][i].kind == SCHED_SEND;
        }
    printf("valid: every static check passed (%ld ops, %ld messages)\n", n_ops, n_msgs);
    printf("memory: a stage is 1/%d of the model; activations in live micro-batch sets of one stage, parameters in "
           "stages\n", s.n_stages);
    if (print_ops) schedule_print_ops(&s, stdout, with_messages);
    if (simulate) {
        if (schedule_simulate(&s, &costs, &sim, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe schedule: %s\n", err);
            rc = 1;
            goto done;
        }
        double worst = 0;
        for (int r = 0; r < pp; r++) worst = sim.bubble[r] > worst ? sim.bubble[r] : worst;
        printf("costs F=%g B=%g W=%g I=%g FB=%g sends=%s\n", costs.f, costs.b, costs.w, costs.b - costs.w, costs.fb,
               wait_sends ? "wait" : "eager");
        printf("makespan=%g\n", sim.makespan);
        printf("bubble formula=%g simulated=%g%s\n", schedule_bubble_formula(kind, pp, &costs), worst,
               n_mb < pp ? " (the formula assumes microbatches >= pp)" : "");
    }
    for (int r = 0; r < pp; r++) {
        int act, chunks;
        schedule_memory(&s, r, &act, &chunks);
        if (simulate) printf("rank %d: busy=%g bubble=%g activations=%d parameters=%dx\n", r, sim.busy[r],
                             sim.bubble[r], act, chunks);
        else printf("rank %d: activations=%d parameters=%dx\n", r, act, chunks);
    }
    if (timeline_cols) schedule_print_timeline(&s, &sim, timeline_cols, stdout);
done:
    schedule_sim_free(&sim);
    schedule_free(&s);
    return rc;
}
