/*
 * fault.h - fault injection for the crash tests: a process kills itself with SIGKILL at a named point of a
 * named step, so that "a SIGKILL during step 13" or "during the save at step 10" lands exactly there and the
 * tests of what survives it (tests/unit/resume.sh, tests/mpi/resume.sh) are deterministic. A signal sent from
 * outside cannot aim at a step of a few milliseconds, or inside a save.
 *
 * FP8MOE_FAULT=POINT:STEP[:RANK] in the environment arms it: POINT is "step" (in train_step after the step's
 * forwards and backwards, before its reductions and update) or "save" (in checkpoint_save after this rank's
 * shard is written, before the manifest and the rename), STEP the 1-based step, RANK the world rank (default
 * 0). Unset (every run but the tests), fault_point costs one getenv on its first call. The process prints one
 * line naming the point, then raises SIGKILL: nothing is flushed or cleaned up, as in a real crash.
 */
#ifndef FP8MOE_FAULT_H
#define FP8MOE_FAULT_H

// Kills this process (world rank `rank`) when FP8MOE_FAULT names this point, step and rank.
void fault_point(const char *point, int step, int rank);

#endif
