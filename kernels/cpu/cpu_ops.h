/*
 * cpu_ops.h - the FP32/FP64 reference implementations behind kernels.h (one cpu_ function per op,
 * same arguments without the Device). Tests may call them directly.
 */
#ifndef FP8MOE_CPU_OPS_H
#define FP8MOE_CPU_OPS_H

#include "kernels/kernels.h"
void cpu_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cpu_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);
void cpu_embedding_forward(real *out, const int *tokens, const real *table, int N, int C);
void cpu_embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C);
// One row of RMSNorm's output (x * rstd) * weight: cpu_rmsnorm_forward's, and the rows that
// cpu_fp8_quantize_rmsnorm_both_layouts quantises.
void cpu_rmsnorm_row(real *out, const real *x, real rstd, const real *weight, int C);
void cpu_rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C);
void cpu_rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, const real *rstd, int N, int C);
void cpu_rmsnorm_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src, int64_t src_stride, const real *inp, const real *weight, const real *rstd, int N, int C);
void cpu_rope_forward(real *out, const real *inp, int ld, int B, int T, int H, int D, real theta);
void cpu_rope_backward(real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta);
int64_t cpu_attention_state_elems(int B, int T, int H, int Dn, int Dr, int Dv);
void cpu_attention_forward(real *out, real *state, const real *q, const real *kv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv);
void cpu_attention_forward_bf16(real *out, real *state, const uint16_t *q16, int64_t ldq, const uint16_t *kv16,
                                int64_t ldkv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv,
                                real rope_theta);
void cpu_attention_backward(real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *state, int B, int T, int H, int Dn, int Dr, int Dv);
void cpu_attention_backward_bf16(real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                                 const real *state, int B, int T, int H, int Dn, int Dr, int Dv);
void cpu_swiglu_forward(real *out, const real *a, const real *b, int64_t n);
void cpu_swiglu_backward(real *da, real *db, const real *dout, const real *a, const real *b, int64_t n);
void cpu_crossentropy_forward(real *losses, real *probs, const real *logits, const int *targets, int N, int V);
void cpu_crossentropy_backward(real *dlogits, const real *probs, const int *targets, real dloss, int N, int V);
void cpu_crossentropy_forward_bf16(real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                                   const int *targets, int N, int V);
void cpu_crossentropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                    const double *row_sum, const int *targets, real dloss, int N, int V);
void cpu_crossentropy_probs_bf16(real *probs, const uint16_t *logits, const real *row_max, const double *row_sum,
                                 int N, int V);
double cpu_sum_squares(const real *x, int64_t n);
void cpu_scale_inplace(real *x, real s, int64_t n);
void cpu_add_inplace(real *y, const real *x, int64_t n);
void cpu_copy_block(real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate);
void cpu_router_forward(int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias, int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze);
void cpu_router_backward(real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx, const real *scores, int N, int E, int K, real route_scale);
real cpu_balance_loss_forward(int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, int freeze);
void cpu_balance_loss_backward(real *dscores, const int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, real dloss);
void cpu_gather_rows(real *out, const real *inp, const int *src_row, int n_rows, int C);
void cpu_moe_unpermute_backward(real *dinp, const real *dseg, const int *slot_of, int N, int K, int C);
void cpu_moe_combine_forward(real *out, const real *expert_out, const int *slot_of, const real *topk_w, const real *residual, int N, int K, int C);
void cpu_moe_combine_forward_bf16(real *out, const uint16_t *base, const uint16_t *expert_out, const int *slot_of, const real *topk_w,
                                  const real *residual, int N, int K, int C);
void cpu_moe_combine_backward_bf16(real *dtopk_w, const real *dout, const uint16_t *expert_out, const int *slot_of,
                                   const real *topk_w, int N, int K, int C);
void cpu_moe_combine_backward(real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out, const int *slot_of, const real *topk_w, int N, int K, int C);
void cpu_adamw_update(real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t);

// FP8 block scaling (kernels/cpu/fp8.c) and the BF16 baseline GEMMs (kernels/cpu/bf16_gemm.c).
int cpu_fp8_quantize_1x128(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size);
int cpu_fp8_quantize_128x128_batched(uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N, int K, char *err,
                                     size_t err_size);
int cpu_fp8_quantize_128x128(uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err, size_t err_size);
int cpu_fp8_quantize_128x1_transposed(uint8_t *q, float *s, const real *x, int T, int C, char *err, size_t err_size);
int cpu_fp8_quantize_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T, int C, char *err,
                                  size_t err_size);
int cpu_fp8_quantize_rmsnorm_both_layouts(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                          const real *rstd, const real *weight, int T, int C, char *err,
                                          size_t err_size);
int cpu_fp8_quantize_1x128_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n, const int *rows0, int K, char *err,
                                   size_t err_size);
int cpu_fp8_quantize_128x1_transposed_grouped(uint8_t *q, float *s, const real *x, const int *x_rows, int n, const int *rows0, int C,
                                              char *err, size_t err_size);
int cpu_fp8_quantize_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int n,
                                          const int *rows0, int C, char *err, size_t err_size);
void cpu_fp8_gather_1x128_grouped(uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n, const int *x_rows,
                                  int n, const int *rows0, int K);
int cpu_fp8_quantize_combine_grad_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *dout,
                                                       const int *seg_token, const int *slot_of, const real *topk_w,
                                                       int K, int n, const int *rows0, int C, char *err,
                                                       size_t err_size);
int cpu_fp8_quantize_swiglu_1x128_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout, const uint16_t *a,
                                          const uint16_t *b, int n, const int *rows0, int C, char *err, size_t err_size);
int cpu_fp8_quantize_swiglu_128x1_transposed_grouped(uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                                     const uint16_t *a, const uint16_t *b, int n, const int *rows0, int C,
                                                     char *err, size_t err_size);
int cpu_fp8_quantize_swiglu_both_layouts_grouped(uint8_t *q1, float *s1, uint8_t *q2, float *s2, SwigluValue value,
                                                 const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n,
                                                 const int *rows0, int C, char *err, size_t err_size);
int cpu_fp8_quantize_swiglu_grads_both_layouts_grouped(uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                       uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                       const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n,
                                                       const int *rows0, int C, char *err, size_t err_size);
void cpu_fp8_gemm_fprop(real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw, int T, int N, int K);
void cpu_fp8_gemm_dgrad(real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw, int T, int N, int K);
void cpu_fp8_gemm_fprop_grouped_bf16(uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                     const float *const *sw, int n, const int *rows0, int N, int K);
void cpu_fp8_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint8_t *qdy, const float *sdy, const uint8_t *const *qwt,
                                     const float *const *sw, int n, const int *rows0, int N, int K);
void cpu_fp8_gemm_fprop_grouped(real *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw, const float *const *sw,
                                int n, const int *rows0, int N, int K);
void cpu_fp8_gemm_dgrad_grouped(real *dx, GradStore store, const uint8_t *qdy, const float *sdy, const uint8_t *const *qwt,
                                const float *const *sw, int n, const int *rows0, int N, int K);
void cpu_fp8_gemm_wgrad(real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt, int T, int N, int K);
// One FP8 GEMM output element under a model of the tensor core's accumulator (docs/fp8.md, "why promotion
// matters"): qa, qb (Kc) E4M3 along the contraction axis, Kc a multiple of 128, sa, sb (Kc/128) their
// block scales. acc_bits > 0: after every addition the running sum (in double) is truncated towards zero
// to acc_bits significant bits; 0: no truncation. promote != 0: the recipe (and what fp8_gemm_* compute
// when acc_bits = 0): each block's sum, promoted to FP32, acc = acc + (P * sa) * sb; promote = 0: one
// accumulator over all Kc of the products times sa * sb, rounded to FP32 at the end.
float cpu_fp8_dot_emulated(const uint8_t *qa, const float *sa, const uint8_t *qb, const float *sb, int Kc, int acc_bits, int promote);
// fp8.c's finiteness check ("op: input (rows x cols) has the non-finite value v at row r, column c ...", -1) and its
// encoder dst[i] = e4m3_rne_sat((float)src[i] / s), shared with fp8_pow2.c.
int cpu_fp8_check_finite(const char *op, const real *x, int rows, int cols, char *err, size_t err_size);
void cpu_fp8_encode_scaled(uint8_t *dst, const real *src, int n, float s);
// Power-of-2 tile scales for FP8 expert dispatch (kernels/cpu/fp8_pow2.c, docs/fp8.md "Power-of-2 scales for
// expert dispatch"); CPU reference only, not yet used by training. s = 2^clamp(ceil(log2(amax / 448)), -126, 119)
// in exact arithmetic (integer operations on amax's FP32 bits), s = 1 for amax = 0.
#define FP8_POW2_MIN_EXP (-126)
#define FP8_POW2_MAX_EXP 119
float cpu_fp8_pow2_scale_of_amax(float amax);
// The layouts of fp8_quantize_1x128 (x (rows, K) -> q (R16, Kp), s (KB, R16)) and fp8_quantize_128x1_transposed
// (x (T, C) -> q (C, Tp), s (TB, C)) with that rule; non-finite input refused as there (-1, err, nothing written).
int cpu_fp8_quantize_1x128_pow2(uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size);
int cpu_fp8_quantize_128x1_transposed_pow2(uint8_t *q, float *s, const real *x, int T, int C, char *err, size_t err_size);
// A 1x128 power-of-2 operand q1 (R16, Cp), s1 (CB, R16) of T rows (cpu_fp8_quantize_1x128_pow2 of x (T, C), e.g.
// dispatched rows) -> its 128x1 power-of-2 operand q2 (C, Tp), s2 (TB, C): the values q1 * s1 (exact in FP32)
// quantised by cpu_fp8_quantize_128x1_transposed_pow2, bit for bit. Lossless except where a value falls into the
// 128x1 tile's E4M3 subnormals with s2 > s1 (there |error| <= 2^-10 s2). -1 with err, nothing written, when a
// scale of rows < T is not a power of 2 in [2^-126, 2^119] or a code of the T x C values is a NaN code.
int cpu_fp8_1x128_to_128x1_transposed_pow2(uint8_t *q2, float *s2, const uint8_t *q1, const float *s1, int T, int C,
                                           char *err, size_t err_size);
void cpu_bf16_matmul_forward(real *out, const real *inp, const real *weight, int N, int C, int OC);
void cpu_bf16_matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC);
void cpu_bf16_matmul_forward_bf16(uint16_t *out, const real *inp, const real *weight, int N, int C, int OC);
void cpu_bf16_matmul_backward_bf16(real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                                   const real *weight, int N, int C, int OC);
void cpu_bf16_round_array(uint16_t *dst, const real *src, int64_t n);
void cpu_bf16_widen_array(real *dst, const uint16_t *src, int64_t n);
void cpu_bf16_rows_widen(real *v, const uint16_t *x, int64_t ld, int64_t rows, int cols);
real *cpu_bf16_rows_widened(const uint16_t *x, int64_t ld, int64_t rows, int cols);
void cpu_bf16_rows_add(real *v, const uint16_t *x, int64_t ld, int64_t rows, int cols);
void cpu_bf16_rows_round(uint16_t *x, int64_t ld, const real *v, int64_t rows, int cols);
// `count` reals (at least one) from malloc, freed by the caller, or a message naming `what` and exit (scratch.c).
// Not inside an OpenMP parallel region: there, use cpu_region_alloc.
real *cpu_values_or_die(size_t count, const char *what);
// An error found inside an OpenMP parallel region (a NaN input, a thread's scratch that could not be allocated):
// exit() there would run the exit handlers on every thread that finds one, at once (a double free, a crash). A
// thread records it instead (cpu_region_fail: "file:line: op: what was found; expected what", of all the errors
// recorded the one at the lowest `at` is kept, so the message does not depend on the thread count) and goes on
// or skips its rows; after the region the calling thread reports it once and exits 1 (cpu_region_check):
//     CpuRegionError err = {0};
//     #pragma omp parallel { ... cpu_region_fail(&err, row, "kernels/cpu/x.c:%d: ...", __LINE__, ...); ... }
//     cpu_region_check(&err);
typedef struct {
    int failed;
    int64_t at;
    char msg[512];
} CpuRegionError;
void cpu_region_fail(CpuRegionError *e, int64_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// malloc (align 0) or aligned_alloc (align > 0, bytes rounded up to it) inside a region: NULL, with the failure
// recorded in e (ahead of any other error), when out of memory. Freed with free().
void *cpu_region_alloc(CpuRegionError *e, size_t bytes, size_t align, const char *what);
// After the region: when an error was recorded, prints "fp8moe: <message>" to stderr once and exits 1.
void cpu_region_check(const CpuRegionError *e);
void cpu_bf16_round_rows(uint16_t *dst, const real *src, const int *rows, int n_rows, int C);
void cpu_bf16_gemm_fprop_grouped(real *y, const uint16_t *x, const uint16_t *const *w, int n_seg, const int *rows0, int N, int K);
void cpu_bf16_gemm_dgrad_grouped(real *dx, GradStore store, const uint16_t *dy, const uint16_t *const *w, int n_seg, const int *rows0, int N, int K);
void cpu_bf16_gemm_wgrad(real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K);
void cpu_bf16_gemm_fprop_grouped_bf16(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                      const int *rows0, int N, int K);
void cpu_bf16_gemm_dgrad_grouped_bf16(uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                      const int *rows0, int N, int K);
void cpu_swiglu_forward_bf16(uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width);
void cpu_swiglu_backward_bf16(uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh, const uint16_t *a,
                              const uint16_t *b, int rows, int width);
void cpu_moe_combine_grad_bf16(uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of, int N, int K,
                               int C);

#endif
