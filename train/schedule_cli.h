/*
 * schedule_cli.h - `fp8moe schedule`: builds a pipeline schedule (parallel/schedule.h), validates it,
 * prints its ops, memory per rank and, with costs, its simulated bubble against Table 2
 * (parallel/schedule_sim.h). Implemented in train/schedule_cli.c.
 */
#ifndef FP8MOE_SCHEDULE_CLI_H
#define FP8MOE_SCHEDULE_CLI_H

// The usage text, a string literal (no '%'), so that main.c's usage can take it into its format.
#define SCHEDULE_CLI_USAGE                                                                                      \
    "  fp8moe schedule --kind 1f1b|zb1p|dualpipe|dualpipev --pp P --microbatches N [--print-ops[=all]]\n"       \
    "                  [--costs F=1,B=2,W=1,FB=3] [--timeline[=COLS]] [--wait-sends]\n"                        \
    "      Build a pipeline schedule for P ranks and N micro-batches, check it (every micro-batch forwarded\n"   \
    "      and backwarded once per stage, every I with its W, sends and receives matched in order, no\n"        \
    "      deadlock) and print each rank's activation and parameter memory in stages. --print-ops: each\n"      \
    "      rank's ops (0F3 forward of chunk 0, micro-batch 3; 1B2 backward; 1I2 input-gradient part; W\n"       \
    "      weight-gradient part; (0F7;1B3) forward and backward overlapped; =all adds sends s0F3>1 and\n"       \
    "      receives r0F3<0, a batch in brackets). --costs: simulate with these op costs (I = B - W; keys\n"     \
    "      not given: F=1, B=2, W=1, FB=F+B) and print `bubble formula=X simulated=Y` (Table 2 of the\n"       \
    "      DeepSeek-V3 report; bubble = makespan - a rank's busy time; Y the largest) and each rank's busy\n"  \
    "      time and bubble. --timeline: draw the simulation, COLS characters per unit of time (default 4).\n"   \
    "      --wait-sends: a send also waits until its receive is posted. dualpipe needs P and N even and\n"      \
    "      N >= 2P; dualpipev N >= 2P.\n"

// Takes the arguments after "schedule"; returns the exit status (0 ok, 1 an invalid schedule, 2 bad usage).
int schedule_cli_main(int argc, char **argv);
extern const char *const schedule_cli_usage;

#endif
