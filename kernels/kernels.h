/*
 * kernels.h - the op interface of fp8moe.
 *
 * Every numerical op the model, optimizer and trainer run goes through these functions. Each takes
 * the Device its pointers live on first and dispatches to kernels/cpu (the FP32 reference, which is
 * what tests and CI run) or kernels/cuda (same function, same layouts, checked against the CPU op).
 * The model code never touches a device pointer itself.
 *
 * Conventions, for every op below:
 *  - `real` is float, or double when built with -DFP8MOE_REAL_DOUBLE (the gradient-check build;
 *    that build has no CUDA). CUDA ops take float (real) pointers in the FP32 build.
 *  - Shapes are given in the comment of each op, row-major, last index fastest. N = rows (tokens).
 *  - Forward ops write their outputs. Backward ops ACCUMULATE (+=) into every gradient they produce
 *    (dinp, dweight, ...), so residual branches and shared weights need no extra adds; the caller
 *    zeroes gradient buffers. A NULL gradient pointer means "not needed" and is skipped.
 *    Exceptions WRITE their gradient (no zeroing; the old contents are never read) where one op is its
 *    only producer, and say so at the op: crossentropy_backward, attention_backward, swiglu_backward,
 *    rope_backward, moe_combine_backward's dexpert_out, and the grouped Dgrads with GRAD_WRITE (GradStore).
 *  - Token id arrays are int32. A target of -1 means "no target here" (masked).
 *  - Deterministic: no op uses floating-point atomics; reductions have a fixed order, so the same
 *    inputs give bitwise-identical outputs regardless of thread count.
 *  - Errors (e.g. a CUDA op asked for in a build without CUDA) stop the process with a message that
 *    names the op, the file and the line.
 */
#ifndef FP8MOE_KERNELS_H
#define FP8MOE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef FP8MOE_REAL_DOUBLE
typedef double real;
#else
typedef float real;
#endif

typedef enum { DEVICE_CPU = 0, DEVICE_CUDA = 1 } Device;

// How a backward op stores a gradient, where the op offers the choice (the grouped Dgrads below): GRAD_ADD
// adds it to the buffer (the convention above); GRAD_WRITE writes it over the buffer without reading it, so a
// buffer that one op fills needs no zeroing first (a routed-expert layer's input gradients are hundreds of
// MB per micro-batch). A written element is the value that op would have added (to zero; up to the sign of a
// zero result, which no later op can observe in a sum).
typedef enum { GRAD_ADD = 0, GRAD_WRITE = 1 } GradStore;

#define RMSNORM_EPS 1e-6

// ---------------------------------------------------------------------------- device memory
// Thin wrappers so model/optimizer code can allocate and move buffers without knowing the device.
// They abort with file/line on failure. device_alloc returns zeroed memory.
void *device_alloc(Device dev, size_t bytes);
void device_free(Device dev, void *p);
void device_memcpy_to_host(Device dev, void *dst_host, const void *src, size_t bytes);
void device_memcpy_from_host(Device dev, void *dst, const void *src_host, size_t bytes);
void device_memset_zero(Device dev, void *p, size_t bytes);
// dst (bytes on dev) = src (bytes on dev), both on the same device; the regions must not overlap. On the GPU a
// cudaMemcpy on the default stream: ordered after earlier kernels, no wait on the host.
void device_memcpy(Device dev, void *dst, const void *src, size_t bytes);
// Host memory that dev's copies to and from the host reach directly, without an intermediate copy: pinned
// (page-locked, cudaMallocHost) for DEVICE_CUDA, plain heap memory for DEVICE_CPU. Not zeroed; NULL for 0 bytes.
// The MPI backend stages device buffers through it (parallel/comm.c). Allocating pinned memory is slow (it
// maps pages for the driver): keep such a buffer. Free it with device_host_free and the same dev.
void *device_host_alloc(Device dev, size_t bytes);
void device_host_free(Device dev, void *p);
// Where p points: DEVICE_CUDA for GPU memory (cudaMalloc, device_alloc; any address inside such an allocation),
// DEVICE_CPU for host memory of any kind (heap, stack, static, pinned) and NULL. In a build without CUDA, and
// before the process' first cudaMalloc, DEVICE_CPU without asking the CUDA runtime, so a CPU run never starts a
// CUDA context through it. parallel/comm.c uses it to tell device buffers from host buffers.
Device device_of_pointer(const void *p);
int cuda_device_count(void); // 0 when built without CUDA or when no GPU is visible
// cudaMalloc calls made so far by the process (device_alloc and the kernels' scratch caches); 0 on a
// CPU-only build. The trainer checks that steps after the first allocate nothing.
int64_t device_allocation_count(void);
const char *device_name(Device dev);

// ---------------------------------------------------------------------------- dense algebra
// matmul (every Linear; DeepSeek-V3 Linears have no bias):
//   inp (N, C), weight (OC, C) -> out (N, OC) = inp @ weight^T
void matmul_forward(Device dev, real *out, const real *inp, const real *weight, int N, int C, int OC);
// in the forward pass this was out = inp @ weight^T, so:
//   dinp (N, C) += dout @ weight;   dweight (OC, C) += dout^T @ inp
void matmul_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp,
                     const real *weight, int N, int C, int OC);

// ---------------------------------------------------------------------------- embedding
// tokens (N) int32 in [0, V), table (V, C) -> out (N, C)
void embedding_forward(Device dev, real *out, const int *tokens, const real *table, int N, int C);
// dtable (V, C) += scatter of dout (N, C) by tokens, rows added in token order (deterministic)
void embedding_backward(Device dev, real *dtable, const real *dout, const int *tokens, int N, int C);

// ---------------------------------------------------------------------------- RMSNorm
// inp (N, C), weight (C) -> out (N, C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp^2) + 1e-6). out NULL:
// rstd only (an input that fp8 mode's quantisers normalise as they read it, fp8_quantize_rmsnorm_both_layouts).
void rmsnorm_forward(Device dev, real *out, real *rstd, const real *inp, const real *weight, int N, int C);
// dinp (N, C) += ..., dweight (C) += ...   (rstd from the forward pass)
void rmsnorm_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp,
                      const real *weight, const real *rstd, int N, int C);
// rmsnorm_backward with dout the sum of n_src >= 1 arrays of BF16 rows of stride ld >= C, the i-th at dout + i *
// src_stride (GEMMs' BF16 products, bf16_rows_ld below: MLA's latent gradients, and its input's gradient from its two
// down-projections, in the modes with BF16 products, linear.h linear_backward_bf16): the bits of rmsnorm_backward on
// the FP32 sum of the widened values, added in order (the first source's value, + the second's, ...).
void rmsnorm_backward_bf16(Device dev, real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src,
                           int64_t src_stride, const real *inp, const real *weight, const real *rstd, int N, int C);

// ---------------------------------------------------------------------------- RoPE
// Interleaved rotary embedding (DeepSeek's reference layout): pairs (x[2j], x[2j+1]) of each vector
// are rotated by angle pos * theta^(-2j/D). x is (B, T, H) vectors of D elements, vector (b, t, h) at
// ((b T + t) H + h) ld (ld >= D: ld = D is the packed (B, T, H, D); MLA rotates the rope part of its
// (B, T, H, dqk) queries in place with ld = dqk), position = t. D even. out may alias inp.
void rope_forward(Device dev, real *out, const real *inp, int ld, int B, int T, int H, int D, real theta);
// the inverse rotation applied to the gradient, WRITTEN: dinp = R(-angle) dout (same layout); dinp may alias
// dout (in place).
void rope_backward(Device dev, real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta);

// ---------------------------------------------------------------------------- attention core
// Causal softmax attention, per batch b and head h, on MLA's own layout (DESIGN.md section 3):
//   q (B, T, H, Dqk), Dqk = Dn + Dr: per token and head [q_nope (Dn) ; q_rope (Dr)];
//   kv (B, T, H, Dn + Dv): per token and head [k_nope (Dn) ; v (Dv)] (MLA's W_UKV output as it is);
//   k_rope (B, T, Dr): the rope key, one per token, shared by every head (not read when Dr = 0; may be NULL).
// The key of (token t, head h) is k[t,h] = [kv[t,h,0:Dn] ; k_rope[t,0:Dr]], its value v[t,h] = kv[t,h,Dn:Dn+Dv]:
// both are read where they lie, so MLA makes no per-head copies of them. Dn or Dr may be 0 (Dqk >= 1).
//   out (B, T, H, Dv):  out[t] = sum_{t2 <= t} softmax_t2(scale q[t] . k[t2]) v[t2], scale = 1/sqrt(Dqk).
// `state` is the backward state: written by attention_forward (or attention_forward_bf16), read by
// attention_backward, which reads nothing else of the forward's but `out`: the state holds the operands the
// backward needs, so a caller may reuse q's and kv's memory after the forward. Its size and contents depend on the
// device; allocate attention_state_elems(dev, B, T, H, Dn, Dr, Dv) reals:
//   DEVICE_CPU  (B, H, T, T): the softmax probabilities state[b,h,t,t2] (the reference materialises
//               them; entries above the diagonal are 0), then copies of q, kv and k_rope as given.
//   DEVICE_CUDA (B, H, T) first: FP32 log-sum-exp of each query row, state[b,h,t] = log sum_{t2 <= t}
//               exp(scale q[t] . k[t2]) (natural log, scores from BF16-rounded q and k); the backward
//               recomputes the probabilities from it (flash-style, T x T is never stored). Then the BF16 copies
//               of q, the keys and the values that the forward's tensor-core products read (attention.cu's
//               padded layout): the backward reads those instead of converting q, kv and k_rope again.
// CUDA numerics: q, k, v (and dout in the backward) are rounded to BF16 and multiplied on tensor cores
// with FP32 accumulation; softmax statistics are FP32; probabilities and score gradients are rounded to
// BF16 as inputs of the second product. CUDA results agree with the CPU to the BF16 tolerances stated in
// tests/gpu/test_gpu_attention.c, not to FP32 rounding. Head dims Dqk, Dv 1..256 on CUDA.
int64_t attention_state_elems(Device dev, int B, int T, int H, int Dn, int Dr, int Dv);
void attention_forward(Device dev, real *out, real *state, const real *q, const real *kv, const real *k_rope,
                       int B, int T, int H, int Dn, int Dr, int Dv);
// attention_forward on MLA's BF16 products (fp8 mode: kernels.h fp8_gemm_fprop_grouped_bf16's rows), without
// FP32 copies of them: q16 is the query projection's product BEFORE RoPE, row (b, t) = H heads of Dqk values at
// q16 + (b T + t) ldq; kv16 is W_UKV's, row (b, t) = H heads of [k_nope ; v] at kv16 + (b T + t) ldkv; k_rope (B,
// T, Dr) FP32 after RoPE, as above. The op rotates each head's last Dr query values as rope_forward (ld = Dqk,
// angle t theta^(-2j/Dr)) rotates the values of the BF16 bits, and then attends: the same out and state, bit for
// bit, as widening q16 and kv16 to FP32, rope_forward on the query and attention_forward.
void attention_forward_bf16(Device dev, real *out, real *state, const uint16_t *q16, int64_t ldq, const uint16_t *kv16,
                            int64_t ldkv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv,
                            real rope_theta);
// Gradients, each WRITTEN (old contents never read; a NULL one is skipped, d_k_rope also when Dr = 0):
//   dq (B,T,H,Dqk);  d_kv (B,T,H,Dn+Dv) = [dk_nope ; dv] per token and head, kv's layout;
//   d_k_rope (B,T,Dr) = the sum over heads of each head's rope-key gradient g_h (the last Dr columns of its
//   key's gradient), added in head order from zero, one rounded addition at a time: ((0 + g_0) + g_1) + ...
//   + g_{H-1}, as a zeroed buffer gets when the heads' gradients are added to it one at a time. Both devices form
//   every g_h in full before the sum (the CUDA op in an FP32 (B,T,H,Dr) scratch), so the order is fixed and no
//   atomics are used.
// dout (B,T,H,Dv). out (B,T,H,Dv) and state are what the forward wrote. The CUDA op takes the softmax backward's
// row term D[t] = dout[t] . out[t] from out (no recomputation of the forward); the CPU reference computes it from
// the stored probabilities (sum_t2 att[t,t2] (dout[t] . v[t2])), as before, and does not read out.
void attention_backward(Device dev, real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *out,
                        const real *state, int B, int T, int H, int Dn, int Dr, int Dv);
// attention_backward with dout as a BF16 product (fp8 mode: MLA's output projection's Dgrad, kernels.h
// fp8_gemm_dgrad_grouped_bf16's rows): row (b, t) = H heads of Dv values at dout16 + (b T + t) ld. The same
// gradients, bit for bit, as attention_backward on the widened values.
void attention_backward_bf16(Device dev, real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                             const real *out, const real *state, int B, int T, int H, int Dn, int Dr, int Dv);

// ---------------------------------------------------------------------------- SwiGLU
// elementwise over n: out = silu(a) * b, silu(a) = a * sigmoid(a)   (a = w1 x, b = w3 x)
void swiglu_forward(Device dev, real *out, const real *a, const real *b, int64_t n);
// da = dout * b * silu'(a);  db = dout * silu(a), all (n). WRITES da and db (their old contents are
// never read, so they need no zeroing); either may be NULL (not needed).
void swiglu_backward(Device dev, real *da, real *db, const real *dout, const real *a, const real *b, int64_t n);

// ---------------------------------------------------------------------------- softmax cross-entropy
// logits (N, V), targets (N) with -1 = masked -> losses (N) (0 where masked), probs (N, V).
// probs may be logits (in place); so may dlogits be probs in the backward: the head keeps one (N, V)
// buffer for logits, probabilities and their gradient.
void crossentropy_forward(Device dev, real *losses, real *probs, const real *logits, const int *targets,
                          int N, int V);
// WRITES dlogits (N, V) = (probs - onehot(target)) * dloss for unmasked rows, 0 for masked rows.
// dloss is the same for every row (e.g. loss_weight / n_valid for a mean).
void crossentropy_backward(Device dev, real *dlogits, const real *probs, const int *targets, real dloss,
                           int N, int V);
// The same loss on BF16 logits (N, V) (the output head's rounded products in the bf16 and fp8 modes,
// bf16_matmul_forward_bf16), without an (N, V) FP32 buffer: the forward writes losses (N) and each row's
// statistics, row_max (N) and row_sum (N) = sum of exp(x - max) (double: the CPU sums in double); the backward
// recomputes each probability from them and WRITES dlogits (N, V) as BF16 = bf16((p - onehot) * dloss), 0 for
// masked rows; dlogits may be logits. crossentropy_probs_bf16 writes the probabilities (N, V) in FP32. On the
// logits' values, every result has the bits of crossentropy_forward / _backward on the same device (the
// probabilities, and the gradient then rounded to BF16 as bf16_matmul_backward rounds dout).
void crossentropy_forward_bf16(Device dev, real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                               const int *targets, int N, int V);
void crossentropy_backward_bf16(Device dev, uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                const double *row_sum, const int *targets, real dloss, int N, int V);
void crossentropy_probs_bf16(Device dev, real *probs, const uint16_t *logits, const real *row_max,
                             const double *row_sum, int N, int V);

// ---------------------------------------------------------------------------- reductions, helpers
// sum of squares of x (n), accumulated in double in a fixed order; returned as double
double sum_squares(Device dev, const real *x, int64_t n);
void scale_inplace(Device dev, real *x, real s, int64_t n);
// y (n) += x (n)
void add_inplace(Device dev, real *y, const real *x, int64_t n);
// Copy a (rows, cols) block between row-strided buffers: dst[r*dst_ld + c] = src[r*src_ld + c], or
// += when accumulate != 0 (the backward of a copy is an accumulating copy the other way).
// Used to slice the rope/nope parts of MLA vectors and MTP's concatenation. Regions must not overlap.
void copy_block(Device dev, real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols,
                int accumulate);

// ---------------------------------------------------------------------------- MoE routing
// DeepSeek-V3 router (DESIGN.md section 3). logits (N, E) = x W_g^T (computed by matmul_forward).
//   scores (N, E) = sigmoid(logits); biased = scores + bias (bias (E), only for selection)
//   group score = sum of the top-2 biased scores in each of n_groups groups of E/n_groups experts,
//   keep the top n_limited groups (ties: lower group index), others -inf;
//   topk_idx (N, K) = top-K experts of the masked biased scores (ties: lower expert index),
//   topk_w (N, K) = scores[idx] / sum_k scores[idx_k] * route_scale.
// If freeze != 0, topk_idx is an INPUT (routing held fixed, for gradient checks) and only scores and
// topk_w are recomputed.
void router_forward(Device dev, int *topk_idx, real *topk_w, real *scores, const real *logits,
                    const real *bias, int N, int E, int K, int n_groups, int n_limited, real route_scale,
                    int freeze);
// dlogits (N, E) += d/dlogits of (dtopk_w . topk_w) + (dscores . scores), through the sigmoid.
// dscores may be NULL (no balance loss); it is the gradient wrt scores from the balance loss.
void router_backward(Device dev, real *dlogits, const real *dtopk_w, const real *dscores,
                     const int *topk_idx, const real *scores, int N, int E, int K, real route_scale);

// Sequence-wise balance loss over B sequences of T tokens, scores (B*T, E):
//   per sequence: L = alpha * sum_i f_i P_i, f_i = E/(K T) * #{t : i in plain top-K of scores_t},
//   P_i = (1/T) sum_t scores_ti / sum_j scores_tj; returns the mean over the B sequences.
// plain_topk (B*T, K) receives the plain top-K (unbiased, no group limit, ties to the lower index),
// or is an input when freeze != 0.
real balance_loss_forward(Device dev, int *plain_topk, const real *scores, int B, int T, int E, int K,
                          real alpha, int freeze);
// dscores (B*T, E) += dloss * d(returned loss)/d(scores), f held constant
void balance_loss_backward(Device dev, real *dscores, const int *plain_topk, const real *scores, int B,
                           int T, int E, int K, real alpha, real dloss);

// ---------------------------------------------------------------------------- MoE token permutation
// Contiguous per-expert segments. For topk_idx (N, K) over E experts:
//   seg_offsets (E+1): segment e holds rows [seg_offsets[e], seg_offsets[e+1]) of the permuted buffer;
//   seg_token (N*K): the source token of each permuted row; rows within a segment are in (t, k) order;
//   slot_of (N*K): for each (t, k), the permuted row that holds it.
// Host-side integer plan; moe_permute_plan_device below builds it where topk_idx lives.
void moe_permute_plan(int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx, int N, int K,
                      int E);
// The same plan where topk_idx lives: on DEVICE_CPU this is moe_permute_plan (host arrays); on DEVICE_CUDA
// every array is a device array and the plan is built on the GPU, bitwise equal to the CPU plan (a stable
// sort of the N*K slots by expert). The CUDA branch synchronises (it copies back an error flag: an expert
// index outside [0, E) stops the process, as on the CPU); callers copy seg_offsets to the host anyway.
void moe_permute_plan_device(Device dev, int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx,
                             int N, int K, int E);
// out (n_rows, C) = inp[src_row[r]] for each row r
void gather_rows(Device dev, real *out, const real *inp, const int *src_row, int n_rows, int C);
// Adjoint of gathering token rows into slots: dinp (N, C) += sum_k dseg[slot_of[t,k]], k in order.
void moe_unpermute_backward(Device dev, real *dinp, const real *dseg, const int *slot_of, int N, int K, int C);
// out (N, C) += sum_k topk_w[t,k] * expert_out[slot_of[t,k]]   (k in order), then += residual (N, C) when given
// (the block's residual branch, in the same pass: the bits of add_inplace(out, residual) after)
void moe_combine_forward(Device dev, real *out, const real *expert_out, const int *slot_of,
                         const real *topk_w, const real *residual, int N, int K, int C);
// dexpert_out (N*K, C) row slot_of[t,k] = topk_w[t,k] * dout[t]: WRITTEN, not accumulated (slot_of is a
// permutation of the N*K rows, so every row is written exactly once and needs no zeroing; one rounded
// product, the same bits on CPU and CUDA). dtopk_w (N, K) += dot(dout[t], expert_out[slot_of[t,k]]):
// ACCUMULATED (the dot in double, rounded to real, then one add). Either gradient may be NULL;
// expert_out is read only for dtopk_w. The gradients must not overlap the inputs.
void moe_combine_backward(Device dev, real *dexpert_out, real *dtopk_w, const real *dout,
                          const real *expert_out, const int *slot_of, const real *topk_w, int N, int K,
                          int C);
// The same two ops on expert outputs left as the routed experts' w2 Fprop made them in fp8 mode: BF16 bits with row
// stride round_up(C, 128) (fp8_gemm_fprop_grouped_bf16), read as the FP32 values they are - the bits of the ops
// above on an FP32 array of those values, with half the bytes read and no conversion pass before. The backward
// computes dtopk_w only (fp8 mode's w2 dY quantiser computes dexpert_out's rows itself). With base (N rows of BF16
// bits, the same stride: the shared expert's w2 product) the forward WRITES out = base's values + the same sum (+
// residual): the bits of widening base into out first, without that pass; base NULL: out's own values, as above.
void moe_combine_forward_bf16(Device dev, real *out, const uint16_t *base, const uint16_t *expert_out,
                              const int *slot_of, const real *topk_w, const real *residual, int N, int K, int C);
void moe_combine_backward_bf16(Device dev, real *dtopk_w, const real *dout, const uint16_t *expert_out,
                               const int *slot_of, const real *topk_w, int N, int K, int C);

// ---------------------------------------------------------------------------- FP8 (E4M3) block scaling
// DESIGN.md section 4. Every FP8 value is E4M3 (bias 7, max 448, no inf; 0x7F/0xFF are NaN), stored as
// uint8_t bit patterns; scales are FP32. For a tile or block: amax over its valid elements,
// s = amax / 448 in FP32 (s = 1 when amax = 0, or when amax / 448 underflows to 0), q = e4m3_rne_saturate(x / s)
// by true FP32 division, on the FP32 value of x (real may be double); value = q * s. Negative zero and tiny
// negatives encode as 0x80. Partial tiles and blocks are zero-padded (code 0x00). NaN/Inf input is an error:
// the quantisers return -1, write nothing to q/s, and put a message naming the op and the first bad element
// in row-major order ("row R, column C" of the input x) into err.
//
// Padded sizes: KB = ceil(K/128) K-blocks, Kp = 128*KB; KB4 = KB rounded up to a multiple of 4;
// NB = ceil(N/128), Np = 128*NB; TB = ceil(T/128), Tp = 128*TB; T16 = 16*ceil(T/16). The quantisers pad
// the token axis themselves, so callers pass any length (a per-expert segment is just its rows): 1x128
// operands have T16 rows (cuBLASLt's FP8 kernels want a multiple of 16), rows T..T16-1 code 0 with
// scale 1; 128x1 operands have Tp columns, the padding coded 0. The GEMMs take the true T and touch
// only the T valid output rows.
#define FP8_E4M3_MAX 448.0f
#define FP8_TILE 128
uint8_t fp8_e4m3_from_float(float x);  // round-to-nearest-even, saturating to +-448; NaN -> 0x7F
float fp8_e4m3_to_float(uint8_t q);    // exact

// Non-finite input (NaN, Inf) is reported, never quantised. DEVICE_CPU: the quantiser returns -1 with "op:
// tensor (rows, cols) has <value> at row r, column c" in err. DEVICE_CUDA: the quantiser does not wait for
// its kernel (a wait per call stalled the GPU thousands of times a training step); it returns 0 and the
// device records the first bad element of the first bad call, which fp8_check_finite reports (-1 and the
// message, naming op, tensor, shape, row and column; it waits for the GPU). Outputs of a bad call must not
// be used. The trainer checks once per step. (Exception: every 4096th CUDA call checks the ones before it
// and may return their -1.) On DEVICE_CPU fp8_check_finite returns 0.
int fp8_check_finite(Device dev, char *err, size_t err_size);

// 1x128 tiles along K (Fprop X, Dgrad dY): x (rows, K) -> q (R16, Kp), s (KB, R16) with R16 =
// 16*ceil(rows/16) (outer-dimension major, as cuBLASLt's VEC128_32F wants; rows >= `rows` are zero).
int fp8_quantize_1x128(Device dev, uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size);
// 128x128 blocks of a weight: w (N, K) -> q (Np, Kp) and its transpose qt (Kp, Np) with the same blocks,
// s (NB, KB4) K-major, K-block count padded to 4 (cuBLASLt BLK128x128_32F), padding entries kb >= KB are 1.0f;
// the transpose's scale of block (kb, nb) is s[nb*KB4 + kb]. qt may be NULL when no Dgrad follows.
int fp8_quantize_128x128(Device dev, uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err,
                         size_t err_size);
// The same for `batch` weights stacked (a routed-expert Linear's weights, one launch on CUDA): w (batch, N, K)
// -> q (batch, Np, Kp), qt (batch, Kp, Np) (or NULL), s (batch, NB, KB4), each matrix what fp8_quantize_128x128
// gives it. A non-finite element is reported at its row of the stacked (batch * N, K).
int fp8_quantize_128x128_batched(Device dev, uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N, int K,
                                 char *err, size_t err_size);
// 128x1 tiles along T (Wgrad operands X and dY), written transposed so T is the contraction axis:
// x (T, C) -> q (C, Tp), s (TB, C).
int fp8_quantize_128x1_transposed(Device dev, uint8_t *q, float *s, const real *x, int T, int C, char *err,
                                  size_t err_size);
// Both activation layouts of one operand (a gradient dY feeds Dgrad and Wgrad): q1, s1 as
// fp8_quantize_1x128(x, T, C) and q2, s2 as fp8_quantize_128x1_transposed(x, T, C) write them, bit for
// bit; the GPU reads x once instead of twice.
int fp8_quantize_both_layouts(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T, int C,
                              char *err, size_t err_size);
// Both layouts of RMSNorm(x) (T, C), the out of rmsnorm_forward(x, weight) with rstd as it wrote it, as
// fp8_quantize_both_layouts quantises that array, bit for bit, without the array: the rows are normalised as they are
// read (fp8 mode's Linears of a norm's output, linear.h NormInput). Non-finite values are reported as RMSNorm(x)'s.
int fp8_quantize_rmsnorm_both_layouts(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                      const real *rstd, const real *weight, int T, int C, char *err, size_t err_size);
// Grouped forms (the routed experts: every segment in one launch): segment g is rows [rows0[g], rows0[g+1])
// of x (rows0 a host array of n_seg + 1 entries, rows0[0] = 0, non-decreasing; 1 <= n_seg <=
// FP8_MAX_SEGMENTS) and gets the operand the plain quantiser would write for those rows, the segments'
// operands one after another: with P16_g = sum_{h<g} 16*ceil(T_h/16) and TB_g = sum_{h<g} ceil(T_h/128),
// segment g's 1x128 operand is at q + Kp*P16_g, scales at s + KB*P16_g; its 128x1 operand at
// q + C*128*TB_g, scales at s + C*TB_g. Empty segments take no space. The same bits as the plain calls.
// With x_rows (an array on dev of rows0[n_seg] row numbers) the rows are gathered as they are read: row r of
// the segments is row x_rows[r] of x, so the routed experts' inputs are quantised straight from the token
// rows (the same bits as gather_rows then the call without x_rows; errors name row r). NULL: row r of x.
#define FP8_MAX_SEGMENTS 256
int fp8_quantize_1x128_grouped(Device dev, uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg,
                               const int *rows0, int K, char *err, size_t err_size);
int fp8_quantize_128x1_transposed_grouped(Device dev, uint8_t *q, float *s, const real *x, const int *x_rows,
                                          int n_seg, const int *rows0, int C, char *err, size_t err_size);
int fp8_quantize_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                      int n_seg, const int *rows0, int C, char *err, size_t err_size);
// The grouped 1x128 operand of x's rows x_rows[r] (as fp8_quantize_1x128_grouped(x, x_rows) writes it) taken from
// x's own 1x128 operand qx (R16x, Kp), sx (KB, R16x) of x_n rows (fp8_quantize_1x128 or the 1x128 half of
// fp8_quantize_both_layouts): a row's 1x128 tiles depend on that row alone, so copying its bytes and scales gives
// the same bits while reading 1 byte per element instead of 4 (the routed experts' top-K token rows, from the
// operand the shared expert made of the same rows). Padding rows as the quantiser writes them; x was checked for
// non-finite values when qx was made. x_rows (on dev) must lie in [0, x_n); the CPU checks it.
void fp8_gather_1x128_grouped(Device dev, uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n,
                              const int *x_rows, int n_seg, const int *rows0, int K);
// SwiGLU values quantised as they are computed (fp8 mode's FFNs): `value` of (dout,) a, b (rows0[n_seg], C) -
// SWIGLU_OUT, h = silu(a) * b as swiglu_forward computes it; SWIGLU_DA / SWIGLU_DB, da / db as swiglu_backward
// computes them from dout - goes through the grouped quantiser of the same name as an array holding it would,
// bit for bit. On CUDA no such array is written: the FFN gate's output (w2's Fprop and Wgrad input) and
// gradients (w1's and w3's dY) never exist in FP32 (the CPU reference computes the array, then quantises it).
// a and b are the gate's inputs as w1's and w3's Fprops leave them and dout the gradient of h as w2's Dgrad leaves
// it, all BF16 (fp8_gemm_fprop_grouped_bf16, fp8_gemm_dgrad_grouped_bf16: row stride round_up(C, 128)), read as the
// FP32 values they are. All in segment order (no row index); dout is read only for DA and DB, b only for OUT and DA
// (pass NULL otherwise). A non-finite value is
// reported at its row and column, as the plain quantiser reports it.
typedef enum { SWIGLU_OUT, SWIGLU_DA, SWIGLU_DB } SwigluValue;
// The routed experts' output gradient (w2's dY, fp8 mode with the experts reading token rows) read through the
// routing plan: row s of the segments is topk_w[t,k] * dout[t] (one FP32 product) for the token t = seg_token[s]
// and the k with slot_of[t*K + k] = s - the row s that moe_combine_backward writes into dexpert_out - quantised in
// both layouts as fp8_quantize_both_layouts_grouped quantises that array, bit for bit, without the array (the
// combine backward then computes dtopk_w only). rows0[n_seg] is the N*K slots.
int fp8_quantize_combine_grad_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                                   const real *dout, const int *seg_token, const int *slot_of,
                                                   const real *topk_w, int K, int n_seg, const int *rows0, int C,
                                                   char *err, size_t err_size);
int fp8_quantize_swiglu_1x128_grouped(Device dev, uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                      const uint16_t *a, const uint16_t *b, int n_seg, const int *rows0, int C, char *err,
                                      size_t err_size);
int fp8_quantize_swiglu_128x1_transposed_grouped(Device dev, uint8_t *q, float *s, SwigluValue value,
                                                 const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                 const int *rows0, int C, char *err, size_t err_size);
int fp8_quantize_swiglu_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                             SwigluValue value, const uint16_t *dout, const uint16_t *a, const uint16_t *b,
                                             int n_seg, const int *rows0, int C, char *err, size_t err_size);
// Both SwiGLU gradients in one pass (the FFN backward's w1 and w3 dY): da into (qa1, sa1, qa2, sa2) and db into
// (qb1, sb1, qb2, sb2), each exactly what fp8_quantize_swiglu_both_layouts_grouped(SWIGLU_DA / SWIGLU_DB, dout, a,
// b) writes, bit for bit. dout, a and b are all read. On CUDA they are read once (12 bytes an element instead of the
// two calls' 20) and the sigmoid is computed once per element. A non-finite value is reported exactly as the two calls, DA's first,
// would report it: the first bad da, else the first bad db, with the message those calls give (it names
// fp8_quantize_swiglu_both_layouts_grouped; on CUDA the tensor "da of swiglu_backward" or "db of
// swiglu_backward"), and as two calls in the CUDA call log. On the CPU a bad da returns before db is written.
int fp8_quantize_swiglu_grads_both_layouts_grouped(Device dev, uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                   uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                   const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                   const int *rows0, int C, char *err, size_t err_size);

// FP8 GEMMs, partial sums promoted to FP32 every 128 elements of the contraction axis (each 128-block's
// sum, times its two scales, is added to an FP32 accumulator). M x N x K order: M output rows.
// CPU reference arithmetic (docs/fp8.md): P = exact sum of the block's 128 products of E4M3 values,
// acc = acc + ((float)P * s_a) * s_b in FP32, K-blocks in increasing order from acc = 0, where s_a is the
// scale of the operand that gives the output row (X, dY, dY^T) and s_b the other's. CUDA matches this to
// 2^-10 * sum_k |a_k s_a b_k s_b| (a_k, b_k the E4M3 values) plus the output rounding (DESIGN.md section 4),
// not bit for bit.
// Fprop  y (T, N) = X W^T:   qx, sx from fp8_quantize_1x128(x, T, K); qw, sw from fp8_quantize_128x128(w, N, K).
//        y is written rounded to BF16 (stored as real).
void fp8_gemm_fprop(Device dev, real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw,
                    int T, int N, int K);
// Dgrad  dx (T, K) += dY W:   qdy, sdy from fp8_quantize_1x128(dy, T, N); qwt, sw of the same weight blocks.
//        The product is rounded to BF16 and added to dx (each element: dx = dx + bf16(acc), once), as a
//        Linear's backward accumulates into its input gradient; clear dx first for the product alone.
void fp8_gemm_dgrad(Device dev, real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt,
                    const float *sw, int T, int N, int K);
// Grouped Fprop and Dgrad (the routed experts: one call per Linear for all experts): segment g is rows
// [rows0[g], rows0[g+1]) of y (N columns) or dx (K columns), rows0 a host array of n_seg + 1 entries as for
// the grouped quantisers (rows0[0] = 0, non-decreasing, 1 <= n_seg <= FP8_MAX_SEGMENTS). Its activation
// operand is its part of the *_grouped 1x128 layout (qx, sx from fp8_quantize_1x128_grouped(x, K); qdy, sdy
// from fp8_quantize_1x128_grouped or fp8_quantize_both_layouts_grouped(dy, N)): with P16_g as there and CB
// the contraction's block count (KB for Fprop, NB for Dgrad), rows at q + CB*128*P16_g, scales at
// s + CB*P16_g. Its weight is qw[g] / qwt[g], sw[g] (host arrays of n_seg pointers; NULL for empty segments).
// Empty segments are skipped. Each segment gets exactly what fp8_gemm_fprop / fp8_gemm_dgrad (dx += BF16
// product) give for its rows. The Dgrad takes n_mats (1..FP8_MAX_DGRAD_MATS) Linears that share their input
// (the SwiGLU FFN's w1 and w3): dY_i (qdy[i], sdy[i]) through weight i (qwt[i][g], sw[i][g]); their BF16
// products are added to dx in order of i, the first written over dx instead with store = GRAD_WRITE: the bits
// of n_mats single calls. On CUDA the GEMMs are the same and all their outputs are converted to `real` in one
// launch for all segments and matrices instead of one per segment and matrix.
// With unpermute (else NULL) the Dgrad's rows go back to token order instead (the routed experts: the adjoint of
// reading their token rows through the routing plan): dx is (n_tok, K), and row t gets, added in order of j to
// its old value (GRAD_ADD) or to zero (GRAD_WRITE), the summed products of rows slot_of[t * topk + j] (j < topk):
// the bits of a GRAD_WRITE Dgrad into a (rows, K) buffer followed by moe_unpermute_backward, without that buffer.
// Then, in the same pass, row t of each of n_post BF16 arrays (rows of stride bf16_rows_ld(K), the i-th at post + i *
// post_stride: the shared expert's Dgrad products) is added in order: the bits of adding them after (a GRAD_ADD
// Dgrad of those matrices), without a pass over dx.
#define FP8_MAX_DGRAD_MATS 4
typedef struct {
    const int *slot_of;     // (n_tok, topk) on the device: the Dgrad row of each (token, j)
    int n_tok, topk;
    const uint16_t *post;   // NULL, or n_post (0..FP8_MAX_DGRAD_MATS) arrays of n_tok BF16 rows added after the sum
    int n_post;
    int64_t post_stride;
} DgradUnpermute;
// residual (rows0[n_seg], N) or NULL: added to y after the product's rounding, y = bf16(product) + residual - the bits
// of the call without it followed by add_inplace(y, residual); on CUDA in the output conversion's pass (a block's
// residual branch after MLA's output projection).
void fp8_gemm_fprop_grouped(Device dev, real *y, const real *residual, const uint8_t *qx, const float *sx,
                            const uint8_t *const *qw, const float *const *sw, int n_seg, const int *rows0, int N, int K);
// The BF16 arrays of the *_grouped_bf16 GEMMs below (and of the ops that read them: fp8_quantize_swiglu_*,
// moe_combine_*_bf16): rows of `cols` values at a stride of round_up(cols, 128), and, as the GEMMs write them,
// 15 rows of scratch after the last; bf16_rows_elems is the size to allocate for `rows` rows.
static inline int64_t bf16_rows_ld(int cols) { return ((int64_t)cols + 127) / 128 * 128; }
static inline int64_t bf16_rows_elems(int64_t rows, int cols) { return (rows + 15) * bf16_rows_ld(cols); }
// The same Fprop with its BF16 product left as it is (the SwiGLU gate's a and b, which only the
// fp8_quantize_swiglu_* quantisers read): y BF16 bits with row stride round_up(N, 128), row rows0[g] + r of
// segment g = the BF16 value fp8_gemm_fprop_grouped converts, columns N.. of a row 0. y holds rows0[n_seg] + 15 rows:
// on CUDA each segment's GEMM writes straight into y, all its rows padded to 16, so its padding rows land on the next
// segment's first rows before that segment's GEMM (later on the stream) writes them, and past the last segment on
// 15 rows of scratch. No conversion pass, and half the bytes of FP32.
void fp8_gemm_fprop_grouped_bf16(Device dev, uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                 const float *const *sw, int n_seg, const int *rows0, int N, int K);
void fp8_gemm_dgrad_grouped(Device dev, real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                            const uint8_t *const *qdy, const float *const *sdy, const uint8_t *const *const *qwt,
                            const float *const *const *sw, int n_seg, const int *rows0, int N, int K);
// One matrix's Dgrad product left in BF16 as fp8_gemm_fprop_grouped_bf16 leaves the Fprop's: dx (rows0[n_seg] + 15
// rows, row stride round_up(K, 128)) = the BF16 bits of what fp8_gemm_dgrad_grouped with GRAD_WRITE writes, columns
// K.. 0 (w2's input gradient d_h, which only the SwiGLU gradient quantisers read).
void fp8_gemm_dgrad_grouped_bf16(Device dev, uint16_t *dx, const uint8_t *qdy, const float *sdy,
                                 const uint8_t *const *qwt, const float *const *sw, int n_seg, const int *rows0, int N,
                                 int K);
// Wgrad  dw (N, K) += dY^T X: qdyt, sdyt from fp8_quantize_128x1_transposed(dy, T, N); qxt, sxt from
//        fp8_quantize_128x1_transposed(x, T, K). FP32 result added to the FP32 gradient.
void fp8_gemm_wgrad(Device dev, real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt,
                    const float *sxt, int T, int N, int K);
// The Wgrads of n_seg segments (the routed experts), segment g's T_g = rows0[g+1] - rows0[g] rows: dw + g N K (N, K)
// += dY_g^T X_g, on the 128x1 operands of all segments one after another as fp8_quantize_128x1_transposed_grouped writes them
// (segment g's from tile t_g = sum over h < g of ceil(T_h / 128): qdyt + N 128 t_g, sdyt + N t_g, qxt + K 128 t_g,
// sxt + K t_g); empty segments skipped. The bits of fp8_gemm_wgrad per segment; on CUDA the GEMMs may run
// concurrently (kernels/cuda/gemm.cu, lanes). With store = GRAD_WRITE every segment's dw is written instead, its old
// contents never read (an empty segment's with zeros): the bits of the call on a cleared dw (a zero's sign aside:
// 0 + -0 is +0), for a stack of gradients that the step's first Wgrad into it writes (train/wgrad_ticket.c).
void fp8_gemm_wgrad_grouped(Device dev, real *dw, GradStore store, const uint8_t *qdyt, const float *sdyt,
                            const uint8_t *qxt, const float *sxt, int n_seg, const int *rows0, int N, int K);

// BF16 baseline GEMMs: operands rounded to BF16 (RNE), products accumulated in FP32.
//   bf16_matmul_forward: out (N, OC) = bf16(inp) bf16(weight)^T, written rounded to BF16.
//   bf16_matmul_backward: dinp += bf16(bf16(dout) bf16(weight)); dweight += FP32 bf16(dout)^T bf16(inp).
void bf16_matmul_forward(Device dev, real *out, const real *inp, const real *weight, int N, int C, int OC);
void bf16_matmul_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp,
                          const real *weight, int N, int C, int OC);
// The same two with the (N, OC) side in BF16 bits: out is bf16_matmul_forward's result as BF16, dout is taken as
// it is (rounding it again would change nothing). The output head's logits and their gradient.
void bf16_matmul_forward_bf16(Device dev, uint16_t *out, const real *inp, const real *weight, int N, int C, int OC);
void bf16_matmul_backward_bf16(Device dev, real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                               const real *weight, int N, int C, int OC);
// The same GEMMs on operands rounded once by the caller (train/linear.c rounds an activation once for every
// Linear and group that reads it, and keeps each weight's BF16 copy per weights version, as the FP8 path
// keeps its quantisation): uint16_t BF16 bits, rows packed.
//   bf16_round_array:        dst (n) = bf16(src (n)), RNE.
//   bf16_widen_array:        dst (n) = the values of the BF16 bits src (n), exactly (the EP exchange's BF16 rows
//                            back in FP32, parallel/ep.c).
//   bf16_round_rows:         dst (n_rows, C) row r = bf16(src row rows[r]) (rows on the device): the routed
//                            experts' token rows read through the routing plan, with no gathered FP32 copy.
//   bf16_gemm_fprop_grouped: rows [rows0[g], rows0[g+1]) of y (N columns) = bf16(x_g w[g]^T), x (rows, K),
//                            w[g] (N, K); rows0[0] = 0; empty groups skipped (w[g] may be NULL there);
//                            residual as for fp8_gemm_fprop_grouped.
//   bf16_gemm_dgrad_grouped: those rows of dx (K columns) += bf16(dy_g w[g]), dy (rows, N), for n_mats
//                            (dy[i], w[i]) in order of i (as fp8_gemm_dgrad_grouped, one conversion on CUDA);
//                            with store = GRAD_WRITE the first product is written over them instead;
//                            unpermute as for fp8_gemm_dgrad_grouped.
//   bf16_gemm_wgrad:         dw (N, K) += FP32 dy^T x over T rows.
//   bf16_gemm_wgrad_grouped: for every non-empty segment g, bf16_gemm_wgrad(dw + g N K, rows [rows0[g], rows0[g+1])
//                            of dy (N columns) and x (K columns)); on CUDA the GEMMs may run concurrently; store as
//                            for fp8_gemm_wgrad_grouped.
// Bitwise the numbers of bf16_matmul_forward / _backward, group by group, on the unrounded operands.
void bf16_round_array(Device dev, uint16_t *dst, const real *src, int64_t n);
void bf16_widen_array(Device dev, real *dst, const uint16_t *src, int64_t n);
void bf16_round_rows(Device dev, uint16_t *dst, const real *src, const int *rows, int n_rows, int C);
void bf16_gemm_fprop_grouped(Device dev, real *y, const real *residual, const uint16_t *x, const uint16_t *const *w,
                             int n_seg, const int *rows0, int N, int K);
void bf16_gemm_dgrad_grouped(Device dev, real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                             const uint16_t *const *dy,
                             const uint16_t *const *const *w, int n_seg, const int *rows0, int N, int K);
void bf16_gemm_wgrad(Device dev, real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K);
void bf16_gemm_wgrad_grouped(Device dev, real *dw, GradStore store, const uint16_t *dy, const uint16_t *x, int n_seg,
                             const int *rows0, int N, int K);
// The bf16 mode's SwiGLU FFNs (train/linear.c) keep their BF16 products as they are, in the layout of the
// *_grouped_bf16 GEMMs above (bf16_rows_ld: rows of round_up(cols, 128), 15 rows of scratch after the last), and
// round each GEMM operand in the pass that computes it:
//   bf16_gemm_fprop_grouped_bf16: y (that layout, N columns) row rows0[g] + r = the BF16 value bf16_gemm_fprop_grouped
//                                 writes there (columns N.. are not written): the gate's a and b, the routed experts'
//                                 outputs.
//   bf16_gemm_dgrad_grouped_bf16: one matrix's Dgrad, dx (that layout, K columns) = the BF16 value
//                                 bf16_gemm_dgrad_grouped writes with GRAD_WRITE: w2's input gradient d_h.
//   swiglu_forward_bf16:          h (rows, width) packed = bf16(swiglu_forward(a, b)), a and b in that layout.
//   swiglu_backward_bf16:         da, db (rows, width) packed = bf16 of swiglu_backward(dh, a, b)'s da and db, and,
//                                 when h is not NULL, h as swiglu_forward_bf16 writes it (w2's Wgrad operand, from
//                                 the same read of a and b); dh, a, b in that layout.
//   moe_combine_grad_bf16:        dy (N K, C) packed row slot_of[t K + k] = bf16(topk_w[t K + k] dout[t]): the rows
//                                 moe_combine_backward writes into dexpert_out, rounded (w2's dY of the routed
//                                 experts).
// Each the bits of the FP32 op followed by bf16_round_array.
void bf16_gemm_fprop_grouped_bf16(Device dev, uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                  const int *rows0, int N, int K);
void bf16_gemm_dgrad_grouped_bf16(Device dev, uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                  const int *rows0, int N, int K);
void swiglu_forward_bf16(Device dev, uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width);
void swiglu_backward_bf16(Device dev, uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh, const uint16_t *a,
                          const uint16_t *b, int rows, int width);
void moe_combine_grad_bf16(Device dev, uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of, int N,
                           int K, int C);

// ---------------------------------------------------------------------------- optimizer
// AdamW on n elements with BF16 moments m, v (uint16 bit patterns, round-to-nearest-even on store).
// step t >= 1 (bias correction). Update in FP32:
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; mhat = m/(1-b1^t); vhat = v/(1-b2^t)
//   p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p)       (decoupled weight decay)
// grad_scale multiplies g first (global-norm clipping factor).
void adamw_update(Device dev, real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);
// The same update, then b (n) = the updated param rounded to BF16 (bf16_round_array's bits): bf16 mode's cached
// weight copies made in the update's pass (train/linear.h linear_bf16_copy_ranges says why).
void adamw_update_bf16_copy(Device dev, real *param, const real *grad, uint16_t *m, uint16_t *v, uint16_t *b, int64_t n,
                            float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);

// Fault injection for the gradient check's negative control: scales the gradients the named backward
// op writes by (1 + rel), on the CPU device. NULL switches it off. Only "swiglu_backward" is supported;
// other names stop the process. Never used in training.
void kernels_debug_perturb(const char *op, double rel);

// BF16 conversion, round-to-nearest-even (NaN stays NaN). Host helpers, used by CPU ops and tests.
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);

#endif
