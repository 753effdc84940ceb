/*
 * fault.c - FP8MOE_FAULT fault injection (see fault.h).
 */
#include "train/fault.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fault_point(const char *point, int step, int rank) {
    static int parsed, armed, want_step, want_rank;
    static char want_point[16];
    if (!parsed) {
        parsed = 1;
        const char *spec = getenv("FP8MOE_FAULT");
        if (spec && spec[0]) {
            want_rank = 0;
            const int n = sscanf(spec, "%15[a-z]:%d:%d", want_point, &want_step, &want_rank);
            if (n < 2) {
                fprintf(stderr, "fp8moe: FP8MOE_FAULT=%s: expected POINT:STEP[:RANK] (POINT step or save); "
                        "ignored\n", spec);
            } else {
                armed = 1;
            }
        }
    }
    if (!armed || step != want_step || rank != want_rank || strcmp(point, want_point) != 0) return;
    fprintf(stderr, "fp8moe: rank %d: FP8MOE_FAULT: SIGKILL at %s of step %d\n", rank, point, step);
    fflush(stderr);
    raise(SIGKILL);
}
