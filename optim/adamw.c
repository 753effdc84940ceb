/*
 * adamw.c - AdamW state (BF16 m, v) and the per-group step over a flat parameter buffer.
 * The arithmetic lives in the adamw_update op (kernels/cpu/optim_ops.c, kernels/cuda); this file
 * owns the state, checks the group table and picks the weight decay of each group.
 */
#include "optim/adamw.h"

#include <stdio.h>
#include <stdlib.h>

void adamw_init(AdamW *opt, Device dev, int64_t n, const OptimConfig *cfg) {
    if (n < 0) {
        fprintf(stderr, "fp8moe: adamw_init (optim/adamw.c): n = %lld parameters, expected n >= 0\n",
                (long long)n);
        exit(1);
    }
    opt->dev = dev;
    opt->n = n;
    // device_alloc returns zeroed memory, and BF16 0x0000 is +0.0: m_0 = v_0 = 0 as Adam starts.
    size_t bytes = (size_t)(n > 0 ? n : 1) * sizeof(uint16_t);
    opt->m = device_alloc(dev, bytes);
    opt->v = device_alloc(dev, bytes);
    opt->beta1 = (float)cfg->beta1;
    opt->beta2 = (float)cfg->beta2;
    opt->eps = (float)cfg->eps;
    opt->weight_decay = (float)cfg->weight_decay;
}

void adamw_free(AdamW *opt) {
    if (opt->m) device_free(opt->dev, opt->m);
    if (opt->v) device_free(opt->dev, opt->v);
    opt->m = NULL;
    opt->v = NULL;
    opt->n = 0;
}

// Stops with a message naming the first group that breaks the tiling rule of adamw.h.
static void check_groups(const AdamW *opt, const ParamGroup *groups, int n_groups) {
    int64_t expected_offset = 0;
    for (int i = 0; i < n_groups; i++) {
        if (groups[i].offset != expected_offset || groups[i].count < 0) {
            fprintf(stderr, "fp8moe: adamw_step (optim/adamw.c): parameter group %d is (offset %lld, "
                            "count %lld); expected offset %lld and count >= 0 (groups must tile the "
                            "%lld-element buffer in order)\n", i, (long long)groups[i].offset,
                    (long long)groups[i].count, (long long)expected_offset, (long long)opt->n);
            exit(1);
        }
        expected_offset += groups[i].count;
    }
    if (expected_offset != opt->n) {
        fprintf(stderr, "fp8moe: adamw_step (optim/adamw.c): %d parameter groups cover %lld elements; "
                        "expected exactly the %lld of the buffer\n", n_groups, (long long)expected_offset,
                (long long)opt->n);
        exit(1);
    }
}

// Stops with a message naming the first copy range that is out of order or not inside one group.
static void check_copies(const ParamGroup *groups, int n_groups, const AdamwCopyRange *copies, int n_copies) {
    int g = 0;
    int64_t prev_end = 0;
    for (int i = 0; i < n_copies; i++) {
        const AdamwCopyRange *c = &copies[i];
        while (g < n_groups && groups[g].offset + groups[g].count <= c->offset) g++;
        if (c->offset < prev_end || c->n < 1 || g == n_groups || c->offset < groups[g].offset ||
            c->offset + c->n > groups[g].offset + groups[g].count) {
            fprintf(stderr, "fp8moe: adamw_step (optim/adamw.c): copy range %d (offset %lld, %lld elements) is not "
                            "inside one parameter group after the previous range (which ends at %lld)\n", i,
                    (long long)c->offset, (long long)c->n, (long long)prev_end);
            exit(1);
        }
        prev_end = c->offset + c->n;
    }
}

void adamw_step(AdamW *opt, real *params, const real *grads, const ParamGroup *groups, int n_groups,
                const AdamwCopyRange *copies, int n_copies, float lr, float grad_scale, int t) {
    if (t < 1) {
        fprintf(stderr, "fp8moe: adamw_step (optim/adamw.c): step t = %d, expected t >= 1\n", t);
        exit(1);
    }
    check_groups(opt, groups, n_groups);
    check_copies(groups, n_groups, copies, n_copies);
    int k = 0;  // the next copy range
    for (int i = 0; i < n_groups; i++) {
        const ParamGroup *gr = &groups[i];
        const float wd = gr->apply_weight_decay ? opt->weight_decay : 0.0f;
        // the group's elements in order: plain runs between its copy ranges, each range with its copy
        int64_t at = gr->offset;
        const int64_t end = gr->offset + gr->count;
        while (at < end) {
            const AdamwCopyRange *c = k < n_copies && copies[k].offset < end ? &copies[k] : NULL;
            const int64_t run_end = c ? c->offset : end;
            if (run_end > at)
                adamw_update(opt->dev, params + at, grads + at, opt->m + at, opt->v + at, run_end - at, lr, opt->beta1,
                             opt->beta2, opt->eps, wd, grad_scale, t);
            if (c == NULL) break;
            adamw_update_bf16_copy(opt->dev, params + c->offset, grads + c->offset, opt->m + c->offset,
                                   opt->v + c->offset, c->b, c->n, lr, opt->beta1, opt->beta2, opt->eps, wd, grad_scale,
                                   t);
            at = c->offset + c->n;
            k++;
        }
    }
}
