/*
 * run_ctx.h - the runtime context the layers run in, apart from the weights they run on: the device,
 * the precision mode, the block Linears' scratch and weight cache (train/linear.c) and the FP8 GEMM
 * counter. The Model holds one (Model.rc) and hands it to every Linear call, so train/linear.h needs
 * no Model: a layer takes its RunCtx beside the Stage's weights (DESIGN.md section 2).
 *
 * The weight cache is keyed by a weight's offset in the flat master weights `weights`
 * (n_weights elements) and is valid for one weights_version: whoever writes the weights bumps it
 * (model_weights_changed) and the cache converts each weight again at its next use, unless the writer made its
 * converted forms itself (bf16 mode's optimizer step: train/linear.h linear_bf16_copy_ranges).
 */
#ifndef FP8MOE_RUN_CTX_H
#define FP8MOE_RUN_CTX_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "train/config.h"

typedef struct {
    Device dev;
    PrecisionConfig precision;         // the job's precision mode and its ablation knobs
    const real *weights;               // flat master weights the block Linear weights lie in
    int64_t n_weights;
    int max_groups;                    // the most groups a grouped Linear call has (the local experts)
    int64_t weights_version;           // bumped by model_weights_changed
    struct LinearWeightCache *weight_cache;  // block Linear weights, 128x128-quantised (fp8) or BF16 (bf16)
    void *linear_scratch;              // quantised (fp8) or rounded (bf16) operands of the current Linear
    size_t linear_scratch_bytes;
    int64_t fp8_gemm_count;            // FP8 GEMMs run so far (precision = fp8), see train/linear.h
    struct WgradTicket *wgrad_ticket;  // while set, the block Linears' Wgrads go into it (train/wgrad_ticket.h)
    // The routed experts' gradient stacks (one per MoE layer and matrix, n_groups x OC x C each): while one is
    // fresh (a step's gradients are cleared by model_zero_grads_for_step, which does not clear these), the first
    // Wgrad into it writes the whole stack instead of adding to it (train/wgrad_ticket.c).
    struct GradStack {
        real *grad;
        int64_t n;
        int fresh;
    } *grad_stacks;
    int n_grad_stacks;
} RunCtx;

#endif
