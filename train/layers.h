/*
 * layers.h - internal to train/: the activations each layer keeps for its backward pass and the
 * per-layer forward/backward functions that model.c composes into blocks, chunks and MTP modules.
 *
 * N = B*T tokens of one micro-batch. Every layer reads its weights from a BlockWeights view and
 * accumulates parameter gradients into the matching view of the gradient buffer. Backward functions
 * take the gradient of the layer's output and ACCUMULATE into the gradient of its input (kernels.h
 * convention); scratch gradients live in a LayerScratch shared by all blocks of a chunk and are zeroed
 * by the layer that uses them.
 */
#ifndef FP8MOE_LAYERS_H
#define FP8MOE_LAYERS_H

#include "train/linear.h"
#include "train/model.h"

// Bump allocator for one ChunkActs: every buffer is zeroed device memory freed together.
typedef struct {
    Device dev;
    void **ptrs;
    int n, cap;
    void **host_ptrs;  // host buffers freed with the arena
    int n_host;
} ActsArena;
void *arena_alloc(ActsArena *a, size_t bytes);
void arena_free_all(ActsArena *a);
#define ARENA_REALS(arena, n) ((real *)arena_alloc((arena), (size_t)(n) * sizeof(real)))
#define ARENA_INTS(arena, n) ((int *)arena_alloc((arena), (size_t)(n) * sizeof(int)))

// Model shape numbers that every layer needs, derived once from the config.
typedef struct {
    int B, T, N;
    int D, H, dn, dr, dv, dqk;  // dim, heads, qk_nope, qk_rope, v, qk = nope + rope
    int qr, kvr;                // q_lora_rank, kv_lora_rank
    int inter;                  // dense FFN width
    int E, K, I, shared_I;      // experts, top-K, moe_inter_dim, shared expert width
    int64_t local_rows;         // the most routed rows this rank's experts can receive: N x K x parallel.ep
    int n_groups, n_limited;
    real route_scale, rope_theta, balance_alpha;
} Dims;
Dims dims_from_config(const Config *c, int B, int T);

// ---------------------------------------------------------------------------- MLA
// Pointers marked (transient) are needed only inside the forward pass: they point into the chunk's
// LayerScratch (shared by all blocks), not into per-block storage (see layer_scratch_alloc).
typedef struct {
    real *cq, *cq_rstd, *cqn;      // (N, qr), (N), (N, qr)     q_lora_rank > 0 only; cqn and ckvn NULL in fp8
                                   // mode's fused paths, which never write them (linear.h NormInput)
    real *qf;                      // (N*H, dqk) = [q_nope ; RoPE(q_rope)] per head (the projection output, rope
                                   // part rotated in place; transient, in d_qf's memory: the attention state
                                   // keeps what the backward reads)
    real *kva;                     // (N, kvr + dr) = W_DKV x (transient)
    real *ckv, *ckv_rstd, *ckvn;   // (N, kvr) compressed kv, its rstd, normalised
    real *k_rope_raw;              // (N, dr) the rope key before RoPE (transient)
    real *k_rope;                  // (N, dr) after RoPE, shared by all heads
    real *kv;                      // (N, H*(dn+dv)) = W_UKV ckvn = [k_nope ; v] per head; with k_rope, the attention
                                   // core's keys and values as it reads them (kernels.h; transient as qf, in d_kv's
                                   // memory)
    uint16_t *q16, *kv16;          // fp8 mode's fused paths with q_lora_rank > 0, instead of qf and kv: the
                                   // projections' BF16 products, q16 before RoPE (linear_forward_bf16, kernels.h
                                   // attention_forward_bf16; transient); NULL elsewhere
    real *att;                     // attention backward state: attention_state_elems(dev, B, T, H, dn, dr, dv) reals
    real *o;                       // (N, H*dv) attention output before W_O
    // fp8 mode: the Linear inputs' Wgrad operands kept from the forward (linear.h KeptInput; q NULL in other
    // modes): the normalised block input (both down-projections), cqn, ckvn and o
    KeptInput xn_kept, cqn_kept, ckvn_kept, o_kept;
} MlaActs;

// ---------------------------------------------------------------------------- FFN and MoE
// a = w1 x, b = w3 x (rows, width), kept for the backward (linear.h SwigluGate: FP32, or BF16 in fp8 and bf16 modes);
// h = silu(a) * b (rows, width) is transient: it points into the chunk's LayerScratch and ffn_backward recomputes it
// from a and b (fp8 and bf16 modes compute it as an operand, in their quantisers or rounding, and do not write it).
// fp8 mode keeps the Wgrad operands of x (not for the routed experts, whose rows are read through the routing plan)
// and of h (linear.h KeptInput; q NULL where nothing is kept).
// A MoE layer's shared and routed experts also share x's Fprop operand (fp8 with the experts reading token rows;
// linear.h SharedFprop, a transient in the chunk's LayerScratch; q NULL otherwise): the shared expert writes it,
// the routed experts copy their rows from it.
typedef struct {
    SwigluGate gate;
    real *h;
    KeptInput x_kept, h_kept;
    SharedFprop x_fprop;
} FfnActs;

typedef struct {
    real *logits, *scores;    // (N, E)
    int *topk_idx;            // (N, K) chosen experts (input when routing is frozen)
    int *topk_idx_host;       // (N, K) host copy, for the node count of expert parallel (ep_count_token_nodes)
    real *topk_w;             // (N, K) gate weights
    int *plain_topk;          // (N, K) balance loss indicators (input when routing is frozen)
    real balance_loss;
    int *seg_offsets;         // (E+1) on the device
    int *seg_offsets_host;    // (E+1) host copy: the expert loop and the EP seam run on the host
    int *seg_token;           // (N*K) source token of each permuted row
    int *slot_of;             // (N*K) permuted row of each (t, k)
    real *xp;                 // (N*K, D) permuted expert inputs (transient: re-gathered in the backward; NULL
                              // where the experts read the token rows, moe_experts_read_tokens)
    EpBuffers ep_buf;         // the local experts' rows after ep_dispatch
    FfnActs experts;          // (N*K, I)
    real *eout;               // (N*K, D) local expert outputs (NULL where eout_bf16 holds them)
    uint16_t *eout_bf16;      // fp8, bf16 with one EP rank: w2's BF16 product (N*K + 15 rows of round_up(D, 128))
    const real *eout_perm;    // expert outputs back in this rank's permuted order (after ep_combine)
    FfnActs shared;           // (N, shared_I)
    uint16_t *shared_out16;   // where eout_bf16 is used, with a shared expert: its output as w2's BF16 product, which
                              // the combine starts from (kernels.h moe_combine_forward_bf16); a forward transient
                              // (LayerScratch t_shared16)
} MoeActs;

typedef struct {
    real *x_in;               // (N, D) block input (points into the chunk's residual stream)
    real *xn1, *rstd1;        // attention RMSNorm; xn1 is transient (recomputed from x_in in the backward, unless
                              // MLA kept its Wgrad operand: mla.xn_kept)
    MlaActs mla;
    real *x_mid;              // (N, D) after the attention residual
    real *xn2, *rstd2;        // FFN RMSNorm; xn2 is transient (recomputed from x_mid), the same buffer as xn1
    FfnActs ffn;              // dense
    MoeActs moe;
} BlockActs;

// Scratch for one chunk, reused block after block (sized for the largest block): the gradients of
// the backward pass, and the forward pass's transients (t_*), which the blocks' activation structs
// point at. A chunk's forward and backward never run at the same time, and each block consumes its
// transients before the next block writes them.
typedef struct {
    real *t_xn, *t_rstd;                  // BlockActs' normalised inputs (N, D), and an rstd (N) to recompute them
    real *t_kva, *t_k_rope_raw;           // MlaActs' transients
    uint16_t *t_q16, *t_kv16;             // and its q16 and kv16 (bf16_products, q_lora_rank > 0): in d_qf's and d_kv's
                                          // memory where they fit; NULL elsewhere
    uint16_t *d_o16;                      // bf16_products: d_o as W_O's Dgrad product in BF16 (linear_backward_bf16,
                                          // kernels.h attention_backward_bf16), in d_o's memory where it fits; NULL
                                          // elsewhere
    uint16_t *d_ckvn16, *d_cqn16;         // bf16_products: d_ckvn and d_cqn (q_lora_rank > 0) as W_UKV's and W_UQ's
                                          // Dgrad products in BF16 (kernels.h rmsnorm_backward_bf16), likewise
    real *t_h;                            // FfnActs' h, sized for the largest FFN (dense, shared, N*K x I); NULL
                                          // with bf16_products, as d_a, d_b and d_h (linear.h SwigluScratch)
    real *t_xp;                           // MoeActs' xp (N*K, D), MoE chunks that gather it only
    uint16_t *t_shared16;                 // MoeActs' shared_out16, in d_xn's memory where it fits; NULL elsewhere
    uint16_t *d_shared16;                 // with t_shared16: the shared expert's w1 and w3 Dgrad products, which the
                                          // routed experts' unpermute adds (moe.c), in d_kv's memory where they fit
    real *d_xn;                           // (N, D)
    real *d_cq, *d_cqn, *d_qf;
    real *d_kva, *d_ckv, *d_ckvn, *d_k_rope, *d_k_rope_raw, *d_kv, *d_o;
    real *d_a, *d_b, *d_h;                // FFN gradients: dense / shared (N, width), all routed experts (N*K, I);
                                          // without bf16_products only
    uint16_t *d_h16;                      // bf16_products: d_h in BF16 (linear.h SwigluScratch), the same rows + 15
    uint16_t *d_xn16;                     // bf16_products: MLA's input gradient as its Dgrads' BF16 products
                                          // (mla_backward), in d_h16's memory: the FFN's backward is done with it
    real *d_logits, *d_scores, *d_topk_w; // router
    real *d_xp, *d_eout;                  // routed experts, (N*K, D); d_xp only where xp is gathered, d_eout
                                          // only where the combine backward writes it
    SharedFprop t_x_fprop;                // FfnActs' x_fprop of MoE blocks (N, D), where shares_fprop
} LayerScratch;

// The chunk's scratch first, then each block's activations, whose transients point into it. The scratch's flags:
// has_moe, any block of the chunk is a MoE block; needs_xp, its MoE blocks gather their experts' inputs
// (!moe_experts_read_tokens); bf16_products, the chunk's Linears leave BF16 products (linear_bf16_products: fp8
// mode's fused paths and bf16 mode): MLA keeps its queries and keys/values as their projections' BF16 products
// (t_q16, t_kv16), the attention output's and the latents' gradients as their Dgrads' (d_o16, d_ckvn16,
// d_cqn16) and its input's as its two down-projections' (d_xn16), and the FFNs compute their gate's h, d_a and d_b as operands and keep d_h in BF16 (d_h16; linear.h;
// fp32 writes them in FP32: t_h, d_a, d_b, d_h); needs_d_eout, the combine
// backward writes the experts' output gradient (!moe_combine_grad_in_operand); shares_fprop, the MoE blocks'
// experts share their input's Fprop operand (FfnActs). keep_inputs (fp8 mode): the blocks keep their Linear inputs'
// Wgrad operands (MlaActs, FfnActs); bf16_products: their FFN gates' inputs in BF16 (FfnActs). bf16_expert_outputs
// (moe_combine_grad_in_operand): the MoE blocks keep their routed experts' outputs as w2's BF16 product (eout_bf16)
// instead of in FP32 (eout), and their shared expert's too (shared_out16, in t_shared16).
void layer_scratch_alloc(ActsArena *arena, LayerScratch *s, const Dims *d, int has_moe, int needs_xp,
                         int bf16_products, int needs_d_eout, int shares_fprop);
void block_acts_alloc(ActsArena *arena, BlockActs *a, const Dims *d, int is_moe, const LayerScratch *s,
                      int keep_inputs, int bf16_products, int bf16_expert_outputs);

// x_out (N, D) = block(x_in); a->x_in is set to x_in.
void block_forward(Model *m, const BlockWeights *w, BlockActs *a, const Dims *d, const real *x_in,
                   real *x_out);
// d_x (N, D): the gradient of the block's output on entry, of its input on return - the residual stream's
// gradient, to which each branch's input gradient is added in place (no copy of it per branch).
// d_balance is the weight of the balance loss' gradient (0 = none).
void block_backward(Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, const Dims *d,
                    LayerScratch *s, real *d_x, real d_balance);

// out = residual + MLA(RMSNorm(x)), the norm given as xn's parts (linear.h NormInput, which computes it): the block's
// residual is added by the output projection (linear_forward_residual).
void mla_forward(Model *m, const MlaWeights *w, MlaActs *a, const Dims *d, const NormInput *xn, const real *residual,
                 real *out);
// d_xn (N, D) is written (not added to); parameter gradients are added to. With s->d_xn16 (bf16_products) d_xn is not
// touched: the input's gradient is left as the MLA_INPUT_GRAD_PARTS BF16 products of its Dgrads in s->d_xn16, part i
// at d_xn16 + i bf16_rows_elems(N, D) (rows of stride bf16_rows_ld(D)), for the RMSNorm backward to add as it reads
// them (kernels.h rmsnorm_backward_bf16): the bits of the FP32 form, without two passes over an FP32 d_xn.
enum { MLA_INPUT_GRAD_PARTS = 2 };
void mla_backward(Model *m, const MlaWeights *w, const MlaWeights *g, MlaActs *a, const Dims *d,
                  LayerScratch *s, const real *xn, const real *d_out, real *d_xn);

// out (rows, D), or with out_bf16 (linear_bf16_products; out NULL then) the output left as w2's BF16 product there
// (rows + 15 rows of bf16_rows_ld(D)).
void ffn_forward(Model *m, const FfnWeights *w, FfnActs *a, int rows, int D, int width, const real *x,
                 real *out, uint16_t *out_bf16);
// d_x (rows, D) added to or written (d_x_store), or with d_x_bf16 (linear_bf16_products; d_x NULL, GRAD_WRITE) left as
// w1's and w3's BF16 Dgrad products there (linear.h linear_backward_swiglu_grouped); parameter gradients are added to.
void ffn_backward(Model *m, const FfnWeights *w, const FfnWeights *g, FfnActs *a, LayerScratch *s,
                  int rows, int D, int width, const real *x, const real *d_out, real *d_x, uint16_t *d_x_bf16,
                  GradStore d_x_store);

// out (N, D) = shared(x) + sum_k w_k expert_k(x); routing per DESIGN.md section 3.
// In fp8 and bf16 modes with one EP rank the routed experts' quantisers (bf16: BF16 rounding) read their rows
// straight from the token rows through the routing plan's seg_token (linear.h inp_rows), so the gathered FP32
// copy xp (top-K rows per token) is never written, in the forward or the backward, nor allocated. fp32 mode,
// and EP, gather xp.
int moe_experts_read_tokens(const Model *m);
// Where the experts read the token rows in fp8 and bf16 modes (linear_bf16_products), their output gradient is read
// through the plan too (w2's dY quantiser or rounding, linear.h CombineGrad): the combine backward's (N*K, D) d_eout
// is neither written nor allocated.
int moe_combine_grad_in_operand(const Model *m);
// residual (N, D) (or NULL) is added to out last, in the combine's pass: out = (shared + routed) + residual.
void moe_forward(Model *m, const BlockWeights *w, MoeActs *a, const Dims *d, const real *x, const real *residual,
                 real *out);
// d_x (N, D) is written (not added to); parameter gradients are added to.
void moe_backward(Model *m, const BlockWeights *w, const BlockWeights *g, MoeActs *a, const Dims *d,
                  LayerScratch *s, const real *x, const real *d_out, real *d_x, real d_balance);

#endif
