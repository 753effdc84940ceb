/*
 * profile.c - the phase profiler of profile.h: a stack of open phases and, at every push and pop, a
 * timestamp (host clock on the CPU, a cudaEvent on the GPU) that closes the interval of the phase
 * that was innermost until then. One process-wide state: the marks sit deep inside the model code,
 * which has no profiler argument to pass around.
 */
#include "kernels/profile.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#ifdef FP8MOE_CUDA
#include "kernels/cuda/common.cuh"
#endif

// Events per step before the pool grows (a bench-1gpu step marks a few thousand boundaries).
#define PROFILE_EVENT_POOL 8192

static const char *const phase_names[PHASE_COUNT] = {"attention", "expert GEMM", "other GEMM",   "quantisation",
                                                     "permute",   "optimizer",   "EP all-to-all", "pipeline wait",
                                                     "grad sync"};

static struct {
    int on;
    Device dev;
    int depth;
    Phase declared[PROFILE_MAX_DEPTH];  // what profile_begin was given
    Phase charged[PROFILE_MAX_DEPTH];   // what the time goes to (other GEMM inside expert -> expert)
    double seconds[PHASE_COUNT];
    double last_s;  // CPU: host time of the last boundary
    double peak_bytes;
    int op_open;            // the open op's index (op_index), -1 for none
    double op_start_s;      // CPU: when it opened
    double op_seconds[PROFILE_MAX_CHUNKS * PROFILE_OP_COUNT];  // by op_index
    int64_t op_counts[PROFILE_MAX_CHUNKS * PROFILE_OP_COUNT];
#ifdef FP8MOE_CUDA
    cudaEvent_t *events;
    int *event_phase;  // event_phase[i]: phase of the interval (events[i-1], events[i]), -1 for none
    int n_events, cap_events;
    int op_start_event;     // the event that opened the open op
    int *op_events;         // (start event, end event, op_index) per op ended since the last collect
    int n_ops, cap_ops;
#endif
} prof = {.op_open = -1};

const char *profile_phase_name(Phase p) { return (p >= 0 && p < PHASE_COUNT) ? phase_names[p] : "?"; }

static void misuse(const char *what, Phase p) {
    fprintf(stderr, "fp8moe: kernels/profile.c: %s (phase %s, depth %d): the profile_begin/profile_end marks "
            "are unbalanced\n", what, profile_phase_name(p), prof.depth);
    exit(1);
}

#ifdef FP8MOE_CUDA
static void events_grow(int cap) {
    prof.events = realloc(prof.events, (size_t)cap * sizeof *prof.events);
    prof.event_phase = realloc(prof.event_phase, (size_t)cap * sizeof *prof.event_phase);
    if (!prof.events || !prof.event_phase) {
        fprintf(stderr, "fp8moe: kernels/profile.c: out of host memory for %d timing events\n", cap);
        exit(1);
    }
    for (int i = prof.cap_events; i < cap; i++) CUDA_CHECK(cudaEventCreate(&prof.events[i]));
    prof.cap_events = cap;
}

static void events_free(void) {
    for (int i = 0; i < prof.cap_events; i++) CUDA_CHECK(cudaEventDestroy(prof.events[i]));
    free(prof.events);
    free(prof.event_phase);
    free(prof.op_events);
    prof.events = NULL;
    prof.event_phase = NULL;
    prof.op_events = NULL;
    prof.n_events = prof.cap_events = 0;
    prof.n_ops = prof.cap_ops = 0;
}
#endif

// A push or pop boundary: closes the interval of the phase innermost until now.
static void boundary(void) {
    int open = prof.depth > 0 ? (int)prof.charged[prof.depth - 1] : -1;
    if (prof.dev == DEVICE_CPU) {
        double t = omp_get_wtime();
        if (open >= 0) prof.seconds[open] += t - prof.last_s;
        prof.last_s = t;
        return;
    }
#ifdef FP8MOE_CUDA
    if (prof.n_events == prof.cap_events) events_grow(2 * prof.cap_events);
    prof.event_phase[prof.n_events] = prof.n_events > 0 ? open : -1;
    CUDA_CHECK(cudaEventRecord(prof.events[prof.n_events], 0));
    prof.n_events++;
#endif
}

void profile_enable(Device dev, int on) {
#ifdef FP8MOE_CUDA
    if (prof.cap_events) events_free();
#else
    if (on && dev == DEVICE_CUDA) {
        fprintf(stderr, "fp8moe: profile_enable asked for DEVICE_CUDA, but this build has no CUDA "
                "(kernels/profile.c)\n");
        exit(1);
    }
#endif
    memset(prof.seconds, 0, sizeof prof.seconds);
    memset(prof.op_seconds, 0, sizeof prof.op_seconds);
    memset(prof.op_counts, 0, sizeof prof.op_counts);
    prof.op_open = -1;
    prof.depth = 0;
    prof.peak_bytes = 0;
    prof.dev = dev;
    prof.on = on;
#ifdef FP8MOE_CUDA
    if (on && dev == DEVICE_CUDA) events_grow(PROFILE_EVENT_POOL);
#endif
}

int profile_enabled(void) { return prof.on; }

void profile_begin(Phase p) {
    if (!prof.on) return;
    if (p < 0 || p >= PHASE_COUNT) misuse("profile_begin of an unknown phase", p);
    if (prof.depth == PROFILE_MAX_DEPTH) misuse("phases nested deeper than PROFILE_MAX_DEPTH", p);
    Phase charged = p;
    for (int i = 0; i < prof.depth && p == PHASE_OTHER_GEMM; i++)
        if (prof.declared[i] == PHASE_EXPERT_GEMM) charged = PHASE_EXPERT_GEMM;
    boundary();
    prof.declared[prof.depth] = p;
    prof.charged[prof.depth] = charged;
    prof.depth++;
}

void profile_end(Phase p) {
    if (!prof.on) return;
    if (prof.depth == 0 || prof.declared[prof.depth - 1] != p)
        misuse("profile_end does not match the innermost profile_begin", p);
    boundary();
    prof.depth--;
}

Phase profile_current_phase(void) {
    return prof.on && prof.depth > 0 ? prof.charged[prof.depth - 1] : PHASE_OTHER_GEMM;
}

static void op_misuse(const char *what, ProfileOp k) {
    fprintf(stderr, "fp8moe: kernels/profile.c: %s (op kind %d, open %d): the profile_op marks are unbalanced\n", what,
            (int)k, prof.op_open);
    exit(1);
}

// An op of kind k on chunk `chunk` in the per-op arrays.
static int op_index(ProfileOp k, int chunk) { return chunk * PROFILE_OP_COUNT + (int)k; }

void profile_op_begin(ProfileOp k, int chunk) {
    if (!prof.on) return;
    if (k < 0 || k >= PROFILE_OP_COUNT || prof.op_open >= 0) op_misuse("profile_op_begin inside an op", k);
    if (chunk < 0 || chunk >= PROFILE_MAX_CHUNKS) op_misuse("profile_op_begin of a chunk out of range", k);
    boundary();
    prof.op_open = op_index(k, chunk);
    prof.op_start_s = prof.last_s;
#ifdef FP8MOE_CUDA
    prof.op_start_event = prof.n_events - 1;
#endif
}

void profile_op_end(ProfileOp k) {
    if (!prof.on) return;
    if (prof.op_open < 0 || prof.op_open % PROFILE_OP_COUNT != (int)k)
        op_misuse("profile_op_end without its profile_op_begin", k);
    boundary();
    const int index = prof.op_open;
    prof.op_open = -1;
    if (prof.dev == DEVICE_CPU) {
        prof.op_seconds[index] += prof.last_s - prof.op_start_s;
        prof.op_counts[index]++;
        return;
    }
#ifdef FP8MOE_CUDA
    if (prof.n_ops == prof.cap_ops) {
        prof.cap_ops = prof.cap_ops ? 2 * prof.cap_ops : 256;
        prof.op_events = realloc(prof.op_events, (size_t)prof.cap_ops * 3 * sizeof *prof.op_events);
        if (!prof.op_events) {
            fprintf(stderr, "fp8moe: kernels/profile.c: out of host memory for %d op timings\n", prof.cap_ops);
            exit(1);
        }
    }
    int *e = prof.op_events + 3 * prof.n_ops++;
    e[0] = prof.op_start_event, e[1] = prof.n_events - 1, e[2] = index;
#endif
}

void profile_op_totals(double seconds[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT],
                       int64_t counts[PROFILE_MAX_CHUNKS][PROFILE_OP_COUNT]) {
    memcpy(seconds, prof.op_seconds, sizeof prof.op_seconds);
    memcpy(counts, prof.op_counts, sizeof prof.op_counts);
}

static void sample_memory(void) {
    double used = 0;
    if (prof.dev == DEVICE_CPU) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) == 0) used = (double)ru.ru_maxrss * 1024.0;  // Linux: kilobytes
    } else {
#ifdef FP8MOE_CUDA
        size_t free_b = 0, total_b = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
        used = (double)(total_b - free_b);
#endif
    }
    if (used > prof.peak_bytes) prof.peak_bytes = used;
}

void profile_step_collect(double seconds_out[PHASE_COUNT]) {
    memset(seconds_out, 0, PHASE_COUNT * sizeof *seconds_out);
    if (!prof.on) return;
    if (prof.depth != 0) misuse("profile_step_collect with phases still open", prof.declared[prof.depth - 1]);
    if (prof.op_open >= 0)
        op_misuse("profile_step_collect with an op still open", (ProfileOp)(prof.op_open % PROFILE_OP_COUNT));
#ifdef FP8MOE_CUDA
    if (prof.dev == DEVICE_CUDA) {
        CUDA_CHECK(cudaDeviceSynchronize());
        for (int i = 1; i < prof.n_events; i++) {
            if (prof.event_phase[i] < 0) continue;
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, prof.events[i - 1], prof.events[i]));
            prof.seconds[prof.event_phase[i]] += 1e-3 * (double)ms;
        }
        for (int i = 0; i < prof.n_ops; i++) {
            const int *e = prof.op_events + 3 * i;
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, prof.events[e[0]], prof.events[e[1]]));
            prof.op_seconds[e[2]] += 1e-3 * (double)ms;
            prof.op_counts[e[2]]++;
        }
        prof.n_events = prof.n_ops = 0;
    }
#endif
    sample_memory();
    memcpy(seconds_out, prof.seconds, sizeof prof.seconds);
    memset(prof.seconds, 0, sizeof prof.seconds);
}

double profile_peak_memory_bytes(void) {
    if (!prof.on) return 0;
    sample_memory();
    return prof.peak_bytes;
}
