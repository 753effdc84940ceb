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

void adamw_step(AdamW *opt, real *params, const real *grads, const ParamGroup *groups, int n_groups,
                float lr, float grad_scale, int t) {
    if (t < 1) {
        fprintf(stderr, "fp8moe: adamw_step (optim/adamw.c): step t = %d, expected t >= 1\n", t);
        exit(1);
    }
    check_groups(opt, groups, n_groups);
    for (int i = 0; i < n_groups; i++) {
        const ParamGroup *gr = &groups[i];
        if (gr->count == 0) continue;
        float wd = gr->apply_weight_decay ? opt->weight_decay : 0.0f;
        adamw_update(opt->dev, params + gr->offset, grads + gr->offset, opt->m + gr->offset,
                     opt->v + gr->offset, gr->count, lr, opt->beta1, opt->beta2, opt->eps, wd, grad_scale, t);
    }
}
