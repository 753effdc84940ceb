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
 * (RunCtx.weights_version, bumped by model_weights_changed).
 * Each FP8 GEMM run is counted in RunCtx.fp8_gemm_count (3 per Linear per micro-batch: Fprop, Dgrad,
 * Wgrad), so the trainer can report it and a test can check that every block Linear is covered.
 */
#ifndef FP8MOE_LINEAR_H
#define FP8MOE_LINEAR_H

#include "kernels/kernels.h"
#include "optim/adamw.h"
#include "train/params.h"
#include "train/run_ctx.h"

typedef struct { real *w1, *w2, *w3; } FfnWeights;  // SwiGLU: w2(silu(w1 x) * w3 x)

// A Linear input's Wgrad operand kept from the forward for the backward (fp8 mode; DeepSeek-V3 keeps its
// Linear inputs in FP8 the same way). The forward quantises the input into its Fprop operand (1x128) and into
// this one (128x1 tiles along the tokens, transposed, kernels.h fp8_quantize_128x1_transposed_grouped) in one
// pass; the backward's Wgrad reads it instead of quantising the FP32 input again: 1 byte per element read instead
// of 4, the same bits. The buffers hold up to `tiles` 128-row tiles of C columns (linear_kept_tiles); a Linear
// given a KeptInput whose q is NULL (bf16, fp32: nothing is kept) or no KeptInput quantises in the backward. The
// backward reads the input only for what is not kept.
typedef struct {
    uint8_t *q;  // (C, tiles * 128)
    float *s;    // (tiles, C)
    int tiles, C;
} KeptInput;
// The tiles a KeptInput needs for an input of `rows` rows in at most n_groups groups of rows (each group's tiles
// are padded to 128 rows).
int linear_kept_tiles(int64_t rows, int n_groups);

// An input's Fprop operand (1x128, kernels.h fp8_quantize_1x128 layout) shared by two Linear calls of one forward
// (fp8 mode): the call that reads the input in token order writes it here instead of into scratch, and a later call
// that reads rows of the same input through a row index (the routed experts' token rows, after the shared expert)
// copies its rows' bytes and scales from here (kernels.h fp8_gather_1x128_grouped) instead of quantising the FP32
// rows: 1 byte read per element instead of 4, the same bits. Holds `rows` rows of C columns; q NULL (bf16, fp32):
// not used.
typedef struct {
    uint8_t *q;  // (round_up(rows, 16), round_up(C, 128))
    float *s;    // (ceil(C / 128), round_up(rows, 16))
    int rows, C;
} SharedFprop;

// Whether the job runs fp8 mode with its fused paths: the kept FP8 inputs (KeptInput), the shared Fprop operand
// (SharedFprop), the SwiGLU gate's BF16 inputs and the combine's gradient inside the quantisers. They all assume
// every GEMM kind in FP8, so a job that runs a kind in BF16 (precision.bf16_fprop / _dgrad / _wgrad) takes the
// plain paths instead, as bf16 mode does: FP32 activations, each GEMM kind through its own mode's functions.
int linear_fp8_fused(const RunCtx *rc);
// Whether Linears can leave their products in BF16 (linear_forward_bf16, linear_backward_bf16: MLA's queries,
// keys/values and gradients), the SwiGLU FFNs keep their gate's inputs as the Fprops' BF16 products (SwigluGate
// a16, b16) and w2's input gradient as its Dgrad's (SwigluScratch d_h16), and can leave the routed experts' outputs
// as w2's BF16 product and take their output gradient through the routing plan (CombineGrad): fp8 mode's fused
// paths and bf16 mode.
int linear_bf16_products(const RunCtx *rc);
// Whether pc runs the forward GEMM of the block Linear named tensor_name ("layers.2.attn.wq_b.weight") in BF16:
// precision.bf16_fprop, narrowed by bf16_fprop_only to the Linears whose names contain one of its parts.
int linear_fprop_in_bf16(const PrecisionConfig *pc, const char *tensor_name);
// Checks bf16_fprop_only against a whole model's tensors: every part is in some block Linear's name. Returns 0, or
// -1 with err naming the part.
int linear_check_fprop_only(const PrecisionConfig *pc, const ParamInfo *params, int n_params, char *err,
                            size_t err_size);

// inp (N, C), weight (OC, C) -> out (N, OC) = inp @ weight^T; `kept` (or NULL) as above.
void linear_forward(RunCtx *rc, real *out, const real *inp, const real *weight, int N, int C, int OC, KeptInput *kept);
// linear_forward's product left in BF16, without its FP32 conversion (linear_bf16_products only): out_bf16 holds
// kernels.h fp8_gemm_fprop_grouped_bf16's (or bf16_gemm_fprop_grouped_bf16's) rows, N + 15 rows of bf16_rows_ld(OC)
// (bf16_rows_elems(N, OC) values), whose values are linear_forward's out exactly (MLA's queries and keys/values,
// which the attention core reads in BF16: kernels.h attention_forward_bf16).
void linear_forward_bf16(RunCtx *rc, uint16_t *out_bf16, const real *inp, const real *weight, int N, int C, int OC,
                         KeptInput *kept);
// The input RMSNorm(x) of linear_forward_norm's Linears (kernels.h rmsnorm_forward: xn = (x * rstd) * weight), by its
// parts. rstd is written (the norm's backward reads it). In fp8 mode's fused paths, where the Linears keep their Wgrad
// operand (`kept`), the quantisers normalise x's rows as they read them (kernels.h fp8_quantize_rmsnorm_both_layouts)
// and xn is not written (its values are then never read: the backward reads what was kept); elsewhere rmsnorm_forward
// writes xn and the Linears read it. The same bits either way.
typedef struct {
    const real *x, *weight;  // the norm's input (N, C) and weight (C)
    real *rstd;              // (N)
    real *xn;                // (N, C)
} NormInput;
// linear_forward_shared (out) or linear_forward_bf16 (out_bf16, n_out BF16 products) of RMSNorm(in->x), the norm
// computed here: MLA's down-projections of the block input and its up-projections of the normalised latents.
void linear_forward_norm(RunCtx *rc, int n_out, real *const *out, uint16_t *const *out_bf16, const NormInput *in,
                         const real *const *weight, int N, int C, const int *OC, KeptInput *kept);
// out = inp @ weight^T + residual (N, OC): the bits of linear_forward then add_inplace(out, residual); in fp8 and
// bf16 modes the residual is added in the GEMM output's conversion pass (a block's residual branch after MLA).
void linear_forward_residual(RunCtx *rc, real *out, const real *inp, const real *weight, const real *residual, int N,
                             int C, int OC, KeptInput *kept);
// dinp (N, C) += dout @ weight; dweight (OC, C) += dout^T @ inp   (either may be NULL). With dinp_store =
// GRAD_WRITE (kernels.h) dinp is written instead, its old contents never read: for an input gradient that only
// this Linear produces, with no memset before. Weight gradients always accumulate. `kept`: what the forward kept.
void linear_backward(RunCtx *rc, real *dinp, GradStore dinp_store, real *dweight, const real *dout, const real *inp,
                     const real *weight, int N, int C, int OC, const KeptInput *kept);
// linear_backward with dinp WRITTEN as the Dgrad's BF16 product, without its FP32 conversion (linear_bf16_products
// only): dinp_bf16 holds kernels.h fp8_gemm_dgrad_grouped_bf16's (or bf16_gemm_dgrad_grouped_bf16's) rows, N + 15
// rows of bf16_rows_ld(C), whose values are linear_backward's dinp exactly (MLA's output projection: the attention
// backward reads its input gradient in BF16, kernels.h attention_backward_bf16).
void linear_backward_bf16(RunCtx *rc, uint16_t *dinp_bf16, real *dweight, const real *dout, const real *inp,
                          const real *weight, int N, int C, int OC, const KeptInput *kept);
// n_out Linears of the same input inp (N, C), weights (OC[i], C): out[i] = inp @ weight[i]^T, the input quantised
// (bf16: rounded) once instead of n_out times (MLA's two down-projections of the normalised block input).
// The same numbers as n_out linear_forward calls. n_out is at most 4.
void linear_forward_shared(RunCtx *rc, int n_out, real *const *out, const real *inp, const real *const *weight, int N,
                           int C, const int *OC, KeptInput *kept);
// The backward of n_out Linears of one input with weights (OC, C) each: dinp += sum_i dout[i] @ weight[i] (in order
// of i; with GRAD_WRITE the first is written, the rest added), dweight[i] += dout[i]^T @ inp (dweight[i] may be
// NULL). The same numbers as n_out linear_backward calls.
void linear_backward_shared(RunCtx *rc, int n_out, real *dinp, GradStore dinp_store, real *const *dweight,
                            const real *const *dout, const real *inp, const real *const *weight, int N, int C, int OC,
                            const KeptInput *kept);
// Grouped Linears (the routed experts): rows [offsets[g], offsets[g+1]) of inp (offsets[0] = 0) go through
// weight g of each stacked weight[i] (n_groups, OC, C), into the same rows of out[i]; in the backward
// dinp's rows get sum_i dout[i] W_i,g and dweight[i]'s slice g gets dout[i]^T inp over the group's rows.
// The same numbers as the *_shared calls above group by group, in order; empty groups are skipped.
// inp_rows (fp8 and bf16 modes; NULL in fp32): an array on the model's device of offsets[n_groups] row numbers,
// row r of the groups' input being row inp_rows[r] of inp: the quantisers (bf16: the BF16 rounding) gather the
// rows as they read them (the routed experts' token rows, with no gathered FP32 copy). The same numbers as a
// gathered inp. An input read through inp_rows is never kept (`kept` NULL). fprop (or NULL): a SharedFprop of inp,
// written by a call without inp_rows (one group), read by a call with inp_rows.
void linear_forward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *const *out, const real *inp,
                            const int *inp_rows, const real *const *weight, int C, int OC, KeptInput *kept,
                            SharedFprop *fprop);
// unpermute (with inp_rows; else NULL): dinp is then the gradient of inp itself, (unpermute->n_tok, C) in token
// order (added to, or with GRAD_WRITE written as if added to zeros): row t gets the groups' input-gradient rows
// unpermute->slot_of[t * topk + j] in order of j - what a slot-order dinp followed by moe_unpermute_backward gives,
// without the slot-order buffer.
void linear_backward_grouped(RunCtx *rc, int n_groups, const int *offsets, int n_out, real *dinp, GradStore dinp_store,
                             const DgradUnpermute *unpermute, real *const *dweight, const real *const *dout,
                             const real *inp, const int *inp_rows, const real *const *weight, int C, int OC,
                             const KeptInput *kept);
// The SwiGLU FFN (moe.c: the dense FFN, shared and routed experts): a = x w1^T and b = x w3^T (w1, w3 (I, D)),
// h = silu(a) * b, y = h w2^T (w2 (D, I)), per group as linear_forward_grouped, x's row r read through x_rows when
// given. The gate's inputs a and b (rows, I), kept for the backward in a SwigluGate, are FP32 (a, b) in fp32 mode
// (and fp8 mode's plain paths); with linear_bf16_products (fp8 and bf16 modes) they are the Fprops' BF16 products
// themselves (a16, b16: kernels.h fp8_gemm_fprop_grouped_bf16's layout, rows + 15 rows of round_up(I, 128)): half
// the bytes of FP32 and no conversion pass, the same values. The gate's values are operands: fp8 mode computes h,
// and in the backward da and db, inside the quantisers that read them (kernels.h fp8_quantize_swiglu_*), bf16 mode
// in the passes that round them (kernels.h swiglu_*_bf16), so they never exist in FP32; fp32 mode writes them to
// the caller's buffers with swiglu_forward / swiglu_backward first and runs the Linears above. The same numbers
// either way.
typedef struct {
    real *a, *b;         // fp32 (fp8 mode's plain paths)
    uint16_t *a16, *b16; // linear_bf16_products
} SwigluGate;
// y (rows, D); h (rows, I) is written in fp32 mode (and fp8 mode's plain paths) only. x_kept, h_kept (or NULL) keep
// x's and h's Wgrad operands (h's computed from a and b in the pass that makes its Fprop operand); x_fprop (or NULL)
// as linear_forward_grouped's fprop. y_bf16 (linear_bf16_products only, else NULL; y is then NULL): y is left as w2's
// BF16 product in y_bf16 (fp8_gemm_fprop_grouped_bf16's layout: the routed experts' outputs, which only the combine
// reads).
void linear_forward_swiglu_grouped(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w, const real *x,
                                   const int *x_rows, const SwigluGate *gate, real *h, real *y, uint16_t *y_bf16,
                                   int D, int I, KeptInput *x_kept, KeptInput *h_kept, SharedFprop *x_fprop);
// The backward of w2, then of w1 and w3, from dy (rows, D): weight gradients +=, and x's gradient dx as
// linear_backward_grouped gives it (dx_store, x_rows and unpermute as there), or with dx_bf16 (linear_bf16_products; dx
// NULL, GRAD_WRITE, no unpermute) left as w1's and w3's Dgrad products, w3's bf16_rows_elems(rows, D) values after w1's
// (rows of bf16_rows_ld(D): the shared expert's, which the routed experts' unpermute adds). Buffers (rows, I): h, d_h,
// d_a and d_b are written in fp32 mode (and fp8 mode's plain paths), d_h16 (rows + 15 rows of round_up(I, 128)) with
// linear_bf16_products. dy_combine (linear_bf16_products only, else NULL; dy is then NULL): dy is the routed experts'
// output gradient read through the routing plan - row s = topk_w[t,k] * d_out[t] for slot s = slot_of[t*K + k] - the
// rows moe_combine_backward would write, computed in w2's dY quantiser instead (kernels.h
// fp8_quantize_combine_grad_both_layouts_grouped; bf16 mode: rounded as computed, moe_combine_grad_bf16).
// x_kept and h_kept (or NULL): what the forwards kept of x (linear_forward_grouped) and of h.
typedef struct {
    real *h, *d_h, *d_a, *d_b;  // fp32 (fp8 mode's plain paths)
    uint16_t *d_h16;            // linear_bf16_products: w2's Dgrad product in BF16 (kernels.h *_dgrad_grouped_bf16)
} SwigluScratch;
typedef struct {
    const real *d_out, *topk_w;
    const int *seg_token, *slot_of;
    int topk;
} CombineGrad;
void linear_backward_swiglu_grouped(RunCtx *rc, int n_groups, const int *offsets, const FfnWeights *w,
                                    const FfnWeights *g, const SwigluGate *gate, const real *dy,
                                    const CombineGrad *dy_combine, const real *x, const int *x_rows, real *dx,
                                    uint16_t *dx_bf16, GradStore dx_store, const DgradUnpermute *unpermute,
                                    const SwigluScratch *s, int D, int I, const KeptInput *x_kept,
                                    const KeptInput *h_kept);
// Builds the weight cache and sizes the Linear scratch (fp8: quantised operands, bf16: rounded ones) for
// every block Linear of the parameter table (PARAM_BLOCK_LINEAR, PARAM_ROUTED_EXPERT) at `rows` tokens (a
// micro-batch) and for the routed experts' grouped calls (routed_rows = rows x top-K rows over rc->max_groups
// local experts), so no step allocates device memory; a no-op in fp32 mode. The table's offsets are into
// rc->weights.
void linear_reserve_scratch(RunCtx *rc, const ParamInfo *params, int n_params, int rows, int routed_rows);
// bf16 mode's cached BF16 copies of the block Linear weights that lie wholly inside elements [lo, lo + n) of the
// flat weights, as adamw_step's copy ranges (offsets relative to lo; neighbouring weights with neighbouring copies
// one range), *count of them; NULL and 0 before the cache exists. Why: the cache makes each copy from the FP32
// weights at its first use after an update, which reads every weight once more per step (10.4 GB on
// configs/bench-1gpu.ini); made by the update itself (kernels.h adamw_update_bf16_copy), a copy costs only its
// writes. (fp8 mode's 128x128 quantisation made in the update's pass was measured slower than the two passes:
// docs/benchmarks.md, 2026-12-07 seventh session.) The answer lives in the cache until the next call.
const AdamwCopyRange *linear_bf16_copy_ranges(RunCtx *rc, int64_t lo, int64_t n, int *count);
// Marks the weights of those ranges current (rc->weights_version), their copies written by adamw_step: so bump the
// version (model_weights_changed) before the update, not after.
void linear_bf16_copies_written(RunCtx *rc, int64_t lo, const AdamwCopyRange *ranges, int n);
void linear_free_scratch(RunCtx *rc);

#endif
