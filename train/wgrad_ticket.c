/*
 * wgrad_ticket.c - a backward's weight-gradient GEMMs held for later (see wgrad_ticket.h).
 */
#include "train/wgrad_ticket.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MAX_BLOCKS 48  // blocks of at least the capacity so far: 2^48 times the first block

typedef struct {
    WgradGemm gemm;
    size_t offsets_at;  // its offsets in the ticket's int pool (which may move as it grows)
} Recorded;

struct WgradTicket {
    Device dev;
    void *block[MAX_BLOCKS];
    size_t cap[MAX_BLOCKS];
    int n_blocks;
    size_t held;  // the blocks' capacities together
    size_t used;  // in the last block
    Recorded *gemms;
    int n_gemms, cap_gemms;
    int *offsets;
    size_t n_offsets, cap_offsets;
};

static void out_of_host_memory(const char *what) {
    fprintf(stderr, "fp8moe: train/wgrad_ticket.c: out of host memory for %s\n", what);
    exit(1);
}

WgradTicket *wgrad_ticket_create(Device dev) {
    WgradTicket *t = calloc(1, sizeof *t);
    if (!t) out_of_host_memory("a W ticket");
    t->dev = dev;
    return t;
}

static void free_blocks(WgradTicket *t) {
    for (int i = 0; i < t->n_blocks; i++) device_free(t->dev, t->block[i]);
    t->n_blocks = 0;
    t->held = 0;
    t->used = 0;
}

void wgrad_ticket_free(WgradTicket *t) {
    if (!t) return;
    free_blocks(t);
    free(t->gemms);
    free(t->offsets);
    free(t);
}

void *wgrad_ticket_take(WgradTicket *t, size_t bytes) {
    const size_t need = (bytes + 255) & ~(size_t)255;
    if (t->n_blocks == 0 || t->used + need > t->cap[t->n_blocks - 1]) {
        if (t->n_blocks == MAX_BLOCKS) {
            fprintf(stderr, "fp8moe: train/wgrad_ticket.c: internal error: a W ticket ran out of blocks\n");
            exit(1);
        }
        const size_t cap = need > t->held ? need : t->held;
        t->block[t->n_blocks] = device_alloc(t->dev, cap);
        t->cap[t->n_blocks++] = cap;
        t->held += cap;
        t->used = 0;
    }
    void *p = (char *)t->block[t->n_blocks - 1] + t->used;
    t->used += need;
    return p;
}

void wgrad_ticket_add(WgradTicket *t, const WgradGemm *g) {
    if (t->n_gemms == t->cap_gemms) {
        t->cap_gemms = t->cap_gemms ? 2 * t->cap_gemms : 64;
        t->gemms = realloc(t->gemms, (size_t)t->cap_gemms * sizeof *t->gemms);
        if (!t->gemms) out_of_host_memory("the GEMMs of a W ticket");
    }
    const size_t n = (size_t)g->n_groups + 1;
    if (t->n_offsets + n > t->cap_offsets) {
        t->cap_offsets = 2 * (t->n_offsets + n);
        t->offsets = realloc(t->offsets, t->cap_offsets * sizeof *t->offsets);
        if (!t->offsets) out_of_host_memory("the group offsets of a W ticket");
    }
    for (size_t i = 0; i < n; i++) t->offsets[t->n_offsets + i] = g->offsets[i];
    t->gemms[t->n_gemms++] = (Recorded){*g, t->n_offsets};
    t->n_offsets += n;
}

int wgrad_ticket_pending(const WgradTicket *t) { return t->n_gemms; }

// GRAD_WRITE for the step's first Wgrad into a fresh gradient stack (RunCtx.grad_stacks), which it then no longer is;
// GRAD_ADD for any other.
static GradStore wgrad_store(RunCtx *rc, const WgradGemm *g) {
    for (int i = 0; i < rc->n_grad_stacks; i++) {
        struct GradStack *st = &rc->grad_stacks[i];
        if (st->grad != g->dw || !st->fresh) continue;  // (a test's Linear may take one expert of a stack)
        if (st->n != (int64_t)g->n_groups * g->OC * g->C) {
            fprintf(stderr, "fp8moe: train/wgrad_ticket.c: internal error: a Wgrad of %d x %d x %d values into a "
                            "gradient stack of %lld\n", g->n_groups, g->OC, g->C, (long long)st->n);
            exit(1);
        }
        st->fresh = 0;
        return GRAD_WRITE;
    }
    return GRAD_ADD;
}

void wgrad_gemm_run(const WgradGemm *g, RunCtx *rc) {
    profile_begin(g->phase);
    const GradStore store = wgrad_store(rc, g);
    switch (g->form) {
    case WGRAD_FP8:
        fp8_gemm_wgrad_grouped(rc->dev, g->dw, store, g->dy, g->dy_s, g->x, g->x_s, g->n_groups, g->offsets, g->OC,
                               g->C);
        for (int k = 0; k < g->n_groups; k++) rc->fp8_gemm_count += g->offsets[k + 1] > g->offsets[k];
        break;
    case WGRAD_BF16:
        bf16_gemm_wgrad_grouped(rc->dev, g->dw, store, g->dy, g->x, g->n_groups, g->offsets, g->OC, g->C);
        break;
    case WGRAD_FP32:  // (a written stack: cleared, then added to)
        if (store == GRAD_WRITE) device_memset_zero(rc->dev, g->dw, (size_t)g->n_groups * g->OC * g->C * sizeof(real));
        for (int k = 0; k < g->n_groups; k++) {
            const int r0 = g->offsets[k], n = g->offsets[k + 1] - r0;
            if (n > 0)
                matmul_backward(rc->dev, NULL, g->dw + (int64_t)k * g->OC * g->C,
                                (const real *)g->dy + (int64_t)r0 * g->OC, (const real *)g->x + (int64_t)r0 * g->C, NULL,
                                n, g->C, g->OC);
        }
        break;
    }
    profile_end(g->phase);
}

void wgrad_ticket_run(WgradTicket *t, RunCtx *rc) {
    for (int i = 0; i < t->n_gemms; i++) {
        WgradGemm g = t->gemms[i].gemm;
        g.offsets = t->offsets + t->gemms[i].offsets_at;
        wgrad_gemm_run(&g, rc);
    }
    t->n_gemms = 0;
    t->n_offsets = 0;
    t->used = 0;
    if (t->n_blocks > 1) {  // one block from now on (device_free waits for the GEMMs above), a quarter more than the
                            // blocks held: the next micro-batch's routed experts may pad their rows to more tiles
        const size_t total = t->held + t->held / 4;
        free_blocks(t);
        t->block[0] = device_alloc(t->dev, total);
        t->cap[0] = total;
        t->held = total;
        t->n_blocks = 1;
    }
}
