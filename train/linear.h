/*
 * linear.h - the Linear layers inside Transformer blocks, in the job's precision mode
 * (DESIGN.md section 4): MLA projections, dense FFN, shared and routed experts, MTP projection.
 *
 *   fp32: the FP32 reference matmul.
 *   bf16: operands rounded to BF16, FP32 accumulation, BF16 outputs (the convergence baseline).
 *   fp8:  E4M3 with 1x128 activation tiles and 128x128 weight blocks, partial sums promoted to FP32
 *         every 128 elements: Fprop Y = X W^T, Dgrad dX = dY W (dY in 1x128 tiles, the same W blocks
 *         transposed), Wgrad dW += dY^T X (X and dY in 128x1 tiles along the tokens).
 * The embedding, output head, router, norms, attention core and losses never come through here.
 * In fp8 mode the weights' quantisation, in bf16 mode their BF16 copy, is cached per weights version
 * (model_weights_changed).
 * Each FP8 GEMM run is counted in Model.fp8_gemm_count (3 per Linear per micro-batch: Fprop, Dgrad,
 * Wgrad), so the trainer can report it and a test can check that every block Linear is covered.
 */
#ifndef FP8MOE_LINEAR_H
#define FP8MOE_LINEAR_H

#include "train/model.h"

// inp (N, C), weight (OC, C) -> out (N, OC) = inp @ weight^T
void linear_forward(Model *m, real *out, const real *inp, const real *weight, int N, int C, int OC);
// dinp (N, C) += dout @ weight; dweight (OC, C) += dout^T @ inp   (either may be NULL). With dinp_store =
// GRAD_WRITE (kernels.h) dinp is written instead, its old contents never read: for an input gradient that only
// this Linear produces, with no memset before. Weight gradients always accumulate.
void linear_backward(Model *m, real *dinp, GradStore dinp_store, real *dweight, const real *dout, const real *inp,
                     const real *weight, int N, int C, int OC);
// n_out Linears of the same input inp (N, C), weights (OC, C) each: out[i] = inp @ weight[i]^T, and in the
// backward dinp += sum_i dout[i] @ weight[i] (in order of i; with GRAD_WRITE the first is written, the rest
// added), dweight[i] += dout[i]^T @ inp (dweight[i] may be NULL). The same numbers as n_out calls of the functions above; in fp8 mode the input is quantised
// once instead of n_out times (the SwiGLU FFN's w1 and w3). n_out is at most 4.
void linear_forward_shared(Model *m, int n_out, real *const *out, const real *inp, const real *const *weight, int N,
                           int C, int OC);
void linear_backward_shared(Model *m, int n_out, real *dinp, GradStore dinp_store, real *const *dweight,
                            const real *const *dout, const real *inp, const real *const *weight, int N, int C, int OC);
// Grouped Linears (the routed experts): rows [offsets[g], offsets[g+1]) of inp (offsets[0] = 0) go through
// weight g of each stacked weight[i] (n_groups, OC, C), into the same rows of out[i]; in the backward
// dinp's rows get sum_i dout[i] W_i,g and dweight[i]'s slice g gets dout[i]^T inp over the group's rows.
// The same numbers as the *_shared calls above group by group, in order; empty groups are skipped.
// inp_rows (fp8 and bf16 modes; NULL in fp32): an array on the model's device of offsets[n_groups] row numbers,
// row r of the groups' input being row inp_rows[r] of inp: the quantisers (bf16: the BF16 rounding) gather the
// rows as they read them (the routed experts' token rows, with no gathered FP32 copy). The same numbers as a
// gathered inp.
void linear_forward_grouped(Model *m, int n_groups, const int *offsets, int n_out, real *const *out, const real *inp,
                            const int *inp_rows, const real *const *weight, int C, int OC);
// unpermute (with inp_rows; else NULL): dinp is then the gradient of inp itself, (unpermute->n_tok, C) in token
// order (added to, or with GRAD_WRITE written as if added to zeros): row t gets the groups' input-gradient rows
// unpermute->slot_of[t * topk + j] in order of j - what a slot-order dinp followed by moe_unpermute_backward gives,
// without the slot-order buffer.
void linear_backward_grouped(Model *m, int n_groups, const int *offsets, int n_out, real *dinp, GradStore dinp_store,
                             const DgradUnpermute *unpermute, real *const *dweight, const real *const *dout,
                             const real *inp, const int *inp_rows, const real *const *weight, int C, int OC);
// Builds the weight cache and sizes the Linear scratch (fp8: quantised operands, bf16: rounded ones) for
// every block Linear at `rows` tokens (a micro-batch) and for the routed experts' grouped calls (rows x top-K
// rows over the local experts), so no step allocates device memory; a no-op in fp32 mode.
void linear_reserve_scratch(Model *m, int rows);
void linear_free_scratch(Model *m);

#endif
