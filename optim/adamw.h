/*
 * adamw.h - AdamW over one flat FP32 master-parameter buffer, with BF16 moments (DESIGN.md section 4).
 *
 * The trainer keeps the parameters of a chunk in one contiguous buffer (non-expert) and one for the
 * local experts; each gets its own AdamW. The optimizer owns the moments m and v (n BF16 values each,
 * on the buffer's device) and nothing else: params and grads belong to the model. Parameters are
 * split into groups by a table of (offset, count, decay flag), because RMSNorm weights (and any
 * other bias-like vector) get no weight decay while the matrices do.
 *
 * Ownership: adamw_init allocates m and v zeroed (Adam's m_0 = v_0 = 0) with device_alloc;
 * adamw_free releases them. The checkpoint code reads and writes opt->m / opt->v directly.
 * Misuse (bad groups, t < 1) stops the process with a message that names the function and the value.
 */
#ifndef FP8MOE_ADAMW_H
#define FP8MOE_ADAMW_H

#include <stdint.h>

#include "kernels/kernels.h"
#include "optim/optim_config.h"

typedef struct {
    Device dev;
    int64_t n;           // elements of the parameter buffer
    uint16_t *m;         // (n) first moment, BF16 bit patterns, on dev
    uint16_t *v;         // (n) second moment, BF16 bit patterns, on dev
    float beta1, beta2, eps, weight_decay;  // from OptimConfig, as the FP32 update uses them
} AdamW;

// A run of consecutive parameters that share the weight-decay choice: elements
// [offset, offset + count) of the flat buffer. apply_weight_decay = 0 for RMSNorm weights and other
// vectors that decay must not shrink.
typedef struct {
    int64_t offset;
    int64_t count;
    int apply_weight_decay;
} ParamGroup;

// Elements [offset, offset + n) of the buffer whose BF16 copy b (n) adamw_step writes as it updates them
// (kernels.h adamw_update_bf16_copy): bf16 mode's cached block Linear weights (train/linear.h
// linear_bf16_copy_ranges).
typedef struct {
    int64_t offset, n;
    uint16_t *b;
} AdamwCopyRange;

// n >= 0 elements on dev; hyperparameters from cfg (beta1, beta2, eps, weight_decay).
void adamw_init(AdamW *opt, Device dev, int64_t n, const OptimConfig *cfg);
void adamw_free(AdamW *opt);

// One AdamW step on params (n) with grads (n), both on opt->dev:
//   g = grads * grad_scale (grad_scale = the global-norm clip factor, 1 = no clipping),
//   then the update of kernels.h adamw_update with learning rate lr and bias correction for step t
//   (t >= 1, the 1-based count of optimizer steps taken including this one), weight decay
//   opt->weight_decay in groups with apply_weight_decay and 0 elsewhere.
// groups (n_groups) must tile [0, n) in order: groups[0].offset = 0, each group starts where the
// previous one ends, the last ends at n, every count >= 0. So every parameter is updated exactly once.
// copies (n_copies, sorted by offset, disjoint, each inside one group; NULL when 0): ranges whose BF16 copy is made
// in the same pass (AdamwCopyRange); the weights get the same bits either way.
void adamw_step(AdamW *opt, real *params, const real *grads, const ParamGroup *groups, int n_groups,
                const AdamwCopyRange *copies, int n_copies, float lr, float grad_scale, int t);

#endif
