/*
 * compare.h - `fp8moe compare`: one job trained in several precision modes over several seeds, and the
 * relative loss gaps between the modes, written as a CSV, a gnuplot plot and a summary (issue 22).
 *
 * Each (mode, seed) run is a child process of this binary (`fp8moe train` with --set overrides), so a
 * run is exactly what `train` would do with the same overrides, its log goes to its own directory, and
 * the runs share nothing but the job: the same seed gives the same initial weights and data order in
 * every mode. The numbers are read back from each run's metrics.jsonl. docs/training.md, "Comparing
 * precision modes", describes the outputs and the statistics.
 */
#ifndef FP8MOE_COMPARE_H
#define FP8MOE_COMPARE_H

extern const char *const compare_usage;

// argv holds the arguments after `compare`. Returns the process exit status: 0, 1 (a run or an output
// failed), 2 (bad usage or an invalid job / override), 130 (interrupted twice).
int compare_main(int argc, char **argv);

#endif
