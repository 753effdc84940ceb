/*
 * kernels.c - dispatch of every kernels.h op to its CPU or CUDA implementation by Device.
 * Ops that have no CUDA version yet stop with a message naming the op instead of silently running
 * on the CPU (no silent fallbacks).
 */
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#ifdef FP8MOE_CUDA
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"
#endif

static void no_cuda_op(const char *op) {
#ifdef FP8MOE_CUDA
    fprintf(stderr, "fp8moe: op %s has no CUDA implementation yet (kernels/kernels.c)\n", op);
#else
    fprintf(stderr, "fp8moe: op %s asked for on a CUDA device, but this build has no CUDA "
                    "(kernels/kernels.c); rebuild with CUDA >= 12.9 or use device = cpu\n", op);
#endif
    exit(1);
}

static double swiglu_backward_perturbation = 0;  // kernels_debug_perturb

void kernels_debug_perturb(const char *op, double rel) {
    if (op && strcmp(op, "swiglu_backward") != 0) {
        fprintf(stderr, "fp8moe: kernels_debug_perturb supports only swiglu_backward, not %s\n", op);
        exit(1);
    }
    swiglu_backward_perturbation = op ? rel : 0;
}

void matmul_forward(Device dev, real *out, const real *inp, const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_matmul_forward(out, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("matmul_forward");
    cpu_matmul_forward(out, inp, weight, N, C, OC);
}

void matmul_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_matmul_backward(dinp, dweight, dout, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("matmul_backward");
    cpu_matmul_backward(dinp, dweight, dout, inp, weight, N, C, OC);
}

void embedding_forward(Device dev, real *out, const int *tokens, const real *table, int N, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_embedding_forward(out, tokens, table, N, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("embedding_forward");
    cpu_embedding_forward(out, tokens, table, N, C);
}

void embedding_backward(Device dev, real *dtable, const real *dout, const int *tokens, int N, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_embedding_backward(dtable, dout, tokens, N, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("embedding_backward");
    cpu_embedding_backward(dtable, dout, tokens, N, C);
}

void rmsnorm_forward(Device dev, real *out, real *rstd, const real *inp, const real *weight, int N, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_rmsnorm_forward(out, rstd, inp, weight, N, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("rmsnorm_forward");
    cpu_rmsnorm_forward(out, rstd, inp, weight, N, C);
}

void rmsnorm_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, const real *rstd, int N, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("rmsnorm_backward");
    cpu_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}

void rmsnorm_backward_bf16(Device dev, real *dinp, real *dweight, const uint16_t *dout, int64_t ld, int n_src,
                           int64_t src_stride, const real *inp, const real *weight, const real *rstd, int N, int C) {
    if (ld < C) {
        fprintf(stderr, "fp8moe: rmsnorm_backward_bf16: row stride %lld - expected at least C = %d\n", (long long)ld,
                C);
        exit(1);
    }
    // the sources may not overlap: each holds N rows of stride ld
    if (n_src < 1 || (n_src > 1 && N > 0 && src_stride < (int64_t)(N - 1) * ld + C)) {
        fprintf(stderr, "fp8moe: rmsnorm_backward_bf16: %d sources %lld values apart - expected at least one, and "
                        "sources of %d rows of stride %lld at least %lld values apart\n", n_src,
                (long long)src_stride, N, (long long)ld, (long long)((int64_t)(N - 1) * ld + C));
        exit(1);
    }
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_rmsnorm_backward_bf16(dinp, dweight, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("rmsnorm_backward_bf16");
    cpu_rmsnorm_backward_bf16(dinp, dweight, dout, ld, n_src, src_stride, inp, weight, rstd, N, C);
}

void rope_forward(Device dev, real *out, const real *inp, int ld, int B, int T, int H, int D, real theta) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_rope_forward(out, inp, ld, B, T, H, D, theta); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("rope_forward");
    cpu_rope_forward(out, inp, ld, B, T, H, D, theta);
}

void rope_backward(Device dev, real *dinp, const real *dout, int ld, int B, int T, int H, int D, real theta) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_rope_backward(dinp, dout, ld, B, T, H, D, theta); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("rope_backward");
    cpu_rope_backward(dinp, dout, ld, B, T, H, D, theta);
}

int64_t attention_state_elems(Device dev, int B, int T, int H, int Dn, int Dr, int Dv) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_attention_state_elems(B, T, H, Dn, Dr, Dv);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("attention_state_elems");
    return cpu_attention_state_elems(B, T, H, Dn, Dr, Dv);
}

void attention_forward(Device dev, real *out, real *state, const real *q, const real *kv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_attention_forward(out, state, q, kv, k_rope, B, T, H, Dn, Dr, Dv); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("attention_forward");
    cpu_attention_forward(out, state, q, kv, k_rope, B, T, H, Dn, Dr, Dv);
}

void attention_forward_bf16(Device dev, real *out, real *state, const uint16_t *q16, int64_t ldq, const uint16_t *kv16,
                            int64_t ldkv, const real *k_rope, int B, int T, int H, int Dn, int Dr, int Dv,
                            real rope_theta) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_attention_forward_bf16(out, state, q16, ldq, kv16, ldkv, k_rope, B, T, H, Dn, Dr, Dv, rope_theta);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("attention_forward_bf16");
    cpu_attention_forward_bf16(out, state, q16, ldq, kv16, ldkv, k_rope, B, T, H, Dn, Dr, Dv, rope_theta);
}

void attention_backward(Device dev, real *dq, real *d_kv, real *d_k_rope, const real *dout, const real *out, const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_attention_backward(dq, d_kv, d_k_rope, dout, out, state, B, T, H, Dn, Dr, Dv); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("attention_backward");
    (void)out;  // the CPU reference takes D from its stored probabilities (kernels/cpu/attention.c)
    cpu_attention_backward(dq, d_kv, d_k_rope, dout, state, B, T, H, Dn, Dr, Dv);
}

void attention_backward_bf16(Device dev, real *dq, real *d_kv, real *d_k_rope, const uint16_t *dout16, int64_t ld,
                             const real *out, const real *state, int B, int T, int H, int Dn, int Dr, int Dv) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_attention_backward_bf16(dq, d_kv, d_k_rope, dout16, ld, out, state, B, T, H, Dn, Dr, Dv);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("attention_backward_bf16");
    (void)out;  // as attention_backward
    cpu_attention_backward_bf16(dq, d_kv, d_k_rope, dout16, ld, state, B, T, H, Dn, Dr, Dv);
}

void swiglu_forward(Device dev, real *out, const real *a, const real *b, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_swiglu_forward(out, a, b, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("swiglu_forward");
    cpu_swiglu_forward(out, a, b, n);
}

void swiglu_backward(Device dev, real *da, real *db, const real *dout, const real *a, const real *b, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_swiglu_backward(da, db, dout, a, b, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("swiglu_backward");
    cpu_swiglu_backward(da, db, dout, a, b, n);
    if (swiglu_backward_perturbation == 0) return;
    // the op writes its gradients, so scaling them in place perturbs exactly what it produced
    const real f = (real)(1 + swiglu_backward_perturbation);
    for (int64_t i = 0; i < n; i++) {
        if (da) da[i] *= f;
        if (db) db[i] *= f;
    }
}

void crossentropy_forward(Device dev, real *losses, real *probs, const real *logits, const int *targets, int N, int V) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_crossentropy_forward(losses, probs, logits, targets, N, V); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("crossentropy_forward");
    cpu_crossentropy_forward(losses, probs, logits, targets, N, V);
}

void crossentropy_backward(Device dev, real *dlogits, const real *probs, const int *targets, real dloss, int N, int V) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_crossentropy_backward(dlogits, probs, targets, dloss, N, V); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("crossentropy_backward");
    cpu_crossentropy_backward(dlogits, probs, targets, dloss, N, V);
}

void crossentropy_forward_bf16(Device dev, real *losses, real *row_max, double *row_sum, const uint16_t *logits,
                               const int *targets, int N, int V) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_crossentropy_forward_bf16(losses, row_max, row_sum, logits, targets, N, V); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("crossentropy_forward_bf16");
    cpu_crossentropy_forward_bf16(losses, row_max, row_sum, logits, targets, N, V);
}

void crossentropy_backward_bf16(Device dev, uint16_t *dlogits, const uint16_t *logits, const real *row_max,
                                const double *row_sum, const int *targets, real dloss, int N, int V) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_crossentropy_backward_bf16(dlogits, logits, row_max, row_sum, targets, dloss, N, V);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("crossentropy_backward_bf16");
    cpu_crossentropy_backward_bf16(dlogits, logits, row_max, row_sum, targets, dloss, N, V);
}

void crossentropy_probs_bf16(Device dev, real *probs, const uint16_t *logits, const real *row_max,
                             const double *row_sum, int N, int V) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_crossentropy_probs_bf16(probs, logits, row_max, row_sum, N, V); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("crossentropy_probs_bf16");
    cpu_crossentropy_probs_bf16(probs, logits, row_max, row_sum, N, V);
}

double sum_squares(Device dev, const real *x, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_sum_squares(x, n);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("sum_squares");
    return cpu_sum_squares(x, n);
}

void scale_inplace(Device dev, real *x, real s, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_scale_inplace(x, s, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("scale_inplace");
    cpu_scale_inplace(x, s, n);
}

void add_inplace(Device dev, real *y, const real *x, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_add_inplace(y, x, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("add_inplace");
    cpu_add_inplace(y, x, n);
}

void copy_block(Device dev, real *dst, int dst_ld, const real *src, int src_ld, int rows, int cols, int accumulate) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_copy_block(dst, dst_ld, src, src_ld, rows, cols, accumulate); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("copy_block");
    cpu_copy_block(dst, dst_ld, src, src_ld, rows, cols, accumulate);
}

void router_forward(Device dev, int *topk_idx, real *topk_w, real *scores, const real *logits, const real *bias, int N, int E, int K, int n_groups, int n_limited, real route_scale, int freeze) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_router_forward(topk_idx, topk_w, scores, logits, bias, N, E, K, n_groups, n_limited, route_scale, freeze); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("router_forward");
    cpu_router_forward(topk_idx, topk_w, scores, logits, bias, N, E, K, n_groups, n_limited, route_scale, freeze);
}

void router_backward(Device dev, real *dlogits, const real *dtopk_w, const real *dscores, const int *topk_idx, const real *scores, int N, int E, int K, real route_scale) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_router_backward(dlogits, dtopk_w, dscores, topk_idx, scores, N, E, K, route_scale); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("router_backward");
    cpu_router_backward(dlogits, dtopk_w, dscores, topk_idx, scores, N, E, K, route_scale);
}

real balance_loss_forward(Device dev, int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, int freeze) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_balance_loss_forward(plain_topk, scores, B, T, E, K, alpha, freeze);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("balance_loss_forward");
    return cpu_balance_loss_forward(plain_topk, scores, B, T, E, K, alpha, freeze);
}

void balance_loss_backward(Device dev, real *dscores, const int *plain_topk, const real *scores, int B, int T, int E, int K, real alpha, real dloss) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_balance_loss_backward(dscores, plain_topk, scores, B, T, E, K, alpha, dloss); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("balance_loss_backward");
    cpu_balance_loss_backward(dscores, plain_topk, scores, B, T, E, K, alpha, dloss);
}

void moe_permute_plan_device(Device dev, int *seg_offsets, int *seg_token, int *slot_of, const int *topk_idx, int N, int K, int E) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_permute_plan_device");
    moe_permute_plan(seg_offsets, seg_token, slot_of, topk_idx, N, K, E);
}

void gather_rows(Device dev, real *out, const real *inp, const int *src_row, int n_rows, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_gather_rows(out, inp, src_row, n_rows, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("gather_rows");
    cpu_gather_rows(out, inp, src_row, n_rows, C);
}

void moe_unpermute_backward(Device dev, real *dinp, const real *dseg, const int *slot_of, int N, int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_unpermute_backward(dinp, dseg, slot_of, N, K, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_unpermute_backward");
    cpu_moe_unpermute_backward(dinp, dseg, slot_of, N, K, C);
}

void moe_combine_forward(Device dev, real *out, const real *expert_out, const int *slot_of, const real *topk_w,
                         const real *residual, int N, int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_combine_forward(out, expert_out, slot_of, topk_w, residual, N, K, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_combine_forward");
    cpu_moe_combine_forward(out, expert_out, slot_of, topk_w, residual, N, K, C);
}

void moe_combine_forward_bf16(Device dev, real *out, const uint16_t *base, const uint16_t *expert_out,
                              const int *slot_of, const real *topk_w, const real *residual, int N, int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_moe_combine_forward_bf16(out, base, expert_out, slot_of, topk_w, residual, N, K, C);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_combine_forward_bf16");
    cpu_moe_combine_forward_bf16(out, base, expert_out, slot_of, topk_w, residual, N, K, C);
}

void moe_combine_backward_bf16(Device dev, real *dtopk_w, const real *dout, const uint16_t *expert_out,
                               const int *slot_of, const real *topk_w, int N, int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_combine_backward_bf16(dtopk_w, dout, expert_out, slot_of, topk_w, N, K, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_combine_backward_bf16");
    cpu_moe_combine_backward_bf16(dtopk_w, dout, expert_out, slot_of, topk_w, N, K, C);
}

void moe_combine_backward(Device dev, real *dexpert_out, real *dtopk_w, const real *dout, const real *expert_out, const int *slot_of, const real *topk_w, int N, int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_combine_backward(dexpert_out, dtopk_w, dout, expert_out, slot_of, topk_w, N, K, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_combine_backward");
    cpu_moe_combine_backward(dexpert_out, dtopk_w, dout, expert_out, slot_of, topk_w, N, K, C);
}

void adamw_update(Device dev, real *param, const real *grad, uint16_t *m, uint16_t *v, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("adamw_update");
    cpu_adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
}

void adamw_update_bf16_copy(Device dev, real *param, const real *grad, uint16_t *m, uint16_t *v, uint16_t *b, int64_t n,
                            float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int t) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_adamw_update_bf16_copy(param, grad, m, v, b, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("adamw_update_bf16_copy");
    cpu_adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
    cpu_bf16_round_array(b, param, n);
}

int fp8_check_finite(Device dev, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_check_finite(err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_check_finite");
    (void)err, (void)err_size;
    return 0;  // the CPU quantisers report at once
}

int fp8_quantize_1x128(Device dev, uint8_t *q, float *s, const real *x, int rows, int K, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_1x128(q, s, x, rows, K, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_1x128");
    return cpu_fp8_quantize_1x128(q, s, x, rows, K, err, err_size);
}

int fp8_quantize_128x128(Device dev, uint8_t *q, uint8_t *qt, float *s, const real *w, int N, int K, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_128x128(q, qt, s, w, N, K, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_128x128");
    return cpu_fp8_quantize_128x128(q, qt, s, w, N, K, err, err_size);
}

int fp8_quantize_128x128_batched(Device dev, uint8_t *q, uint8_t *qt, float *s, const real *w, int batch, int N, int K,
                                 char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_128x128_batched(q, qt, s, w, batch, N, K, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_128x128_batched");
    return cpu_fp8_quantize_128x128_batched(q, qt, s, w, batch, N, K, err, err_size);
}

int fp8_quantize_both_layouts(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x, int T, int C,
                              char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_both_layouts(q1, s1, q2, s2, x, T, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_both_layouts");
    return cpu_fp8_quantize_both_layouts(q1, s1, q2, s2, x, T, C, err, err_size);
}

int fp8_quantize_rmsnorm_both_layouts(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                      const real *rstd, const real *weight, int T, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_rmsnorm_both_layouts(q1, s1, q2, s2, x, rstd, weight, T, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_rmsnorm_both_layouts");
    return cpu_fp8_quantize_rmsnorm_both_layouts(q1, s1, q2, s2, x, rstd, weight, T, C, err, err_size);
}

int fp8_quantize_1x128_grouped(Device dev, uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg, const int *rows0, int K,
                               char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_1x128_grouped(q, s, x, x_rows, n_seg, rows0, K, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_1x128_grouped");
    return cpu_fp8_quantize_1x128_grouped(q, s, x, x_rows, n_seg, rows0, K, err, err_size);
}

int fp8_quantize_128x1_transposed_grouped(Device dev, uint8_t *q, float *s, const real *x, const int *x_rows, int n_seg, const int *rows0,
                                          int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_128x1_transposed_grouped(q, s, x, x_rows, n_seg, rows0, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_128x1_transposed_grouped");
    return cpu_fp8_quantize_128x1_transposed_grouped(q, s, x, x_rows, n_seg, rows0, C, err, err_size);
}

void fp8_gather_1x128_grouped(Device dev, uint8_t *q, float *s, const uint8_t *qx, const float *sx, int x_n,
                              const int *x_rows, int n_seg, const int *rows0, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gather_1x128_grouped(q, s, qx, sx, x_n, x_rows, n_seg, rows0, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gather_1x128_grouped");
    cpu_fp8_gather_1x128_grouped(q, s, qx, sx, x_n, x_rows, n_seg, rows0, K);
}

int fp8_quantize_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2, const real *x,
                                      int n_seg, const int *rows0, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_both_layouts_grouped(q1, s1, q2, s2, x, n_seg, rows0, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_both_layouts_grouped");
    return cpu_fp8_quantize_both_layouts_grouped(q1, s1, q2, s2, x, n_seg, rows0, C, err, err_size);
}

int fp8_quantize_combine_grad_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                                   const real *dout, const int *seg_token, const int *slot_of,
                                                   const real *topk_w, int K, int n_seg, const int *rows0, int C,
                                                   char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_combine_grad_both_layouts_grouped(q1, s1, q2, s2, dout, seg_token, slot_of, topk_w, K,
                                                                   n_seg, rows0, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_combine_grad_both_layouts_grouped");
    return cpu_fp8_quantize_combine_grad_both_layouts_grouped(q1, s1, q2, s2, dout, seg_token, slot_of, topk_w, K, n_seg,
                                                              rows0, C, err, err_size);
}

int fp8_quantize_swiglu_1x128_grouped(Device dev, uint8_t *q, float *s, SwigluValue value, const uint16_t *dout,
                                      const uint16_t *a, const uint16_t *b, int n_seg, const int *rows0, int C, char *err,
                                      size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_swiglu_1x128_grouped(q, s, value, dout, a, b, n_seg, rows0, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_swiglu_1x128_grouped");
    return cpu_fp8_quantize_swiglu_1x128_grouped(q, s, value, dout, a, b, n_seg, rows0, C, err, err_size);
}

int fp8_quantize_swiglu_128x1_transposed_grouped(Device dev, uint8_t *q, float *s, SwigluValue value,
                                                 const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                 const int *rows0, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_swiglu_128x1_transposed_grouped(q, s, value, dout, a, b, n_seg, rows0, C, err,
                                                                 err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_swiglu_128x1_transposed_grouped");
    return cpu_fp8_quantize_swiglu_128x1_transposed_grouped(q, s, value, dout, a, b, n_seg, rows0, C, err, err_size);
}

int fp8_quantize_swiglu_both_layouts_grouped(Device dev, uint8_t *q1, float *s1, uint8_t *q2, float *s2,
                                             SwigluValue value, const uint16_t *dout, const uint16_t *a, const uint16_t *b,
                                             int n_seg, const int *rows0, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_swiglu_both_layouts_grouped(q1, s1, q2, s2, value, dout, a, b, n_seg, rows0, C, err,
                                                             err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_swiglu_both_layouts_grouped");
    return cpu_fp8_quantize_swiglu_both_layouts_grouped(q1, s1, q2, s2, value, dout, a, b, n_seg, rows0, C, err,
                                                        err_size);
}

int fp8_quantize_swiglu_grads_both_layouts_grouped(Device dev, uint8_t *qa1, float *sa1, uint8_t *qa2, float *sa2,
                                                   uint8_t *qb1, float *sb1, uint8_t *qb2, float *sb2,
                                                   const uint16_t *dout, const uint16_t *a, const uint16_t *b, int n_seg,
                                                   const int *rows0, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA)
        return cuda_fp8_quantize_swiglu_grads_both_layouts_grouped(qa1, sa1, qa2, sa2, qb1, sb1, qb2, sb2, dout, a, b,
                                                                   n_seg, rows0, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_swiglu_grads_both_layouts_grouped");
    return cpu_fp8_quantize_swiglu_grads_both_layouts_grouped(qa1, sa1, qa2, sa2, qb1, sb1, qb2, sb2, dout, a, b, n_seg,
                                                              rows0, C, err, err_size);
}

int fp8_quantize_128x1_transposed(Device dev, uint8_t *q, float *s, const real *x, int T, int C, char *err, size_t err_size) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) return cuda_fp8_quantize_128x1_transposed(q, s, x, T, C, err, err_size);
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_quantize_128x1_transposed");
    return cpu_fp8_quantize_128x1_transposed(q, s, x, T, C, err, err_size);
}

void fp8_gemm_fprop(Device dev, real *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw, int T, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_fprop(y, qx, sx, qw, sw, T, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_fprop");
    cpu_fp8_gemm_fprop(y, qx, sx, qw, sw, T, N, K);
}

void fp8_gemm_dgrad(Device dev, real *dx, const uint8_t *qdy, const float *sdy, const uint8_t *qwt, const float *sw, int T, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_dgrad(dx, qdy, sdy, qwt, sw, T, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_dgrad");
    cpu_fp8_gemm_dgrad(dx, qdy, sdy, qwt, sw, T, N, K);
}

// The residual of the grouped Fprops: on the CPU the reference's own order, the product then add_inplace.
static void add_residual(real *y, const real *residual, int n_seg, const int *rows0, int N) {
    if (residual != NULL && n_seg > 0) cpu_add_inplace(y, residual, (int64_t)rows0[n_seg] * N);
}

void fp8_gemm_fprop_grouped_bf16(Device dev, uint16_t *y, const uint8_t *qx, const float *sx, const uint8_t *const *qw,
                                 const float *const *sw, int n_seg, const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_fprop_grouped_bf16(y, qx, sx, qw, sw, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_fprop_grouped_bf16");
    cpu_fp8_gemm_fprop_grouped_bf16(y, qx, sx, qw, sw, n_seg, rows0, N, K);
}

void fp8_gemm_dgrad_grouped_bf16(Device dev, uint16_t *dx, const uint8_t *qdy, const float *sdy,
                                 const uint8_t *const *qwt, const float *const *sw, int n_seg, const int *rows0, int N,
                                 int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_dgrad_grouped_bf16(dx, qdy, sdy, qwt, sw, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_dgrad_grouped_bf16");
    cpu_fp8_gemm_dgrad_grouped_bf16(dx, qdy, sdy, qwt, sw, n_seg, rows0, N, K);
}

void fp8_gemm_fprop_grouped(Device dev, real *y, const real *residual, const uint8_t *qx, const float *sx,
                            const uint8_t *const *qw, const float *const *sw, int n_seg, const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_fprop_grouped(y, residual, qx, sx, qw, sw, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_fprop_grouped");
    cpu_fp8_gemm_fprop_grouped(y, qx, sx, qw, sw, n_seg, rows0, N, K);
    add_residual(y, residual, n_seg, rows0, N);
}

static void check_dgrad_args(const char *op, int n_mats) {
    if (n_mats < 1 || n_mats > FP8_MAX_DGRAD_MATS) {
        fprintf(stderr, "fp8moe: %s: %d matrices - expected 1 .. %d Linears sharing an input\n", op, n_mats,
                FP8_MAX_DGRAD_MATS);
        exit(1);
    }
}

// An unpermuted Dgrad's post arrays (kernels.h DgradUnpermute): at most FP8_MAX_DGRAD_MATS, given when any, and
// apart by at least one array of n_tok rows of stride bf16_rows_ld(K). On either device (a caller's mistake).
static void check_unpermute_post(const DgradUnpermute *u, int K, const char *op) {
    const int64_t span = u->n_tok > 0 ? (int64_t)(u->n_tok - 1) * bf16_rows_ld(K) + K : 0;
    if (u->n_post < 0 || u->n_post > FP8_MAX_DGRAD_MATS || (u->n_post > 0 && u->post == NULL) ||
        (u->n_post > 1 && u->post_stride < span)) {
        fprintf(stderr, "fp8moe: %s: %d post arrays at %p, %lld values apart - expected 0 to %d, given, and at least "
                        "%lld values apart (%d rows of stride %lld)\n", op, u->n_post, (const void *)u->post,
                (long long)u->post_stride, FP8_MAX_DGRAD_MATS, (long long)span, u->n_tok, (long long)bf16_rows_ld(K));
        exit(1);
    }
}

// The CPU's unpermuted Dgrad: the slot-order rows into a buffer, then moe_unpermute_backward and the post rows
// (kernels.h, unpermute_finish). The segments must cover the n_tok x topk slots exactly.
static real *unpermute_buffer(const DgradUnpermute *u, int n_seg, const int *rows0, int K, const char *op) {
    if (n_seg < 1 || rows0[n_seg] != u->n_tok * u->topk) {
        fprintf(stderr, "fp8moe: %s: the segments hold %d rows; unpermuting %d tokens x %d needs exactly %d\n", op,
                n_seg < 1 ? 0 : rows0[n_seg], u->n_tok, u->topk, u->n_tok * u->topk);
        exit(1);
    }
    real *rows = malloc(sizeof(real) * (size_t)u->n_tok * u->topk * (size_t)K + 1);
    if (rows == NULL) {
        fprintf(stderr, "fp8moe: %s: out of memory for the %d x %d slot-order rows\n", op, u->n_tok * u->topk, K);
        exit(1);
    }
    return rows;
}

// dx (n_tok, K) = (GRAD_WRITE: zeros, GRAD_ADD: dx) + the unpermuted rows, then + each post array's row, in order;
// frees rows.
static void unpermute_finish(real *dx, GradStore store, real *rows, const DgradUnpermute *u, int K) {
    if (store == GRAD_WRITE) memset(dx, 0, sizeof(real) * (size_t)u->n_tok * K);
    cpu_moe_unpermute_backward(dx, rows, u->slot_of, u->n_tok, u->topk, K);
    free(rows);
    for (int i = 0; i < u->n_post; i++)
        cpu_bf16_rows_add(dx, u->post + i * u->post_stride, bf16_rows_ld(K), u->n_tok, K);
}

void fp8_gemm_dgrad_grouped(Device dev, real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                            const uint8_t *const *qdy, const float *const *sdy, const uint8_t *const *const *qwt,
                            const float *const *const *sw, int n_seg, const int *rows0, int N, int K) {
    check_dgrad_args("fp8_gemm_dgrad_grouped", n_mats);
    if (unpermute) check_unpermute_post(unpermute, K, "fp8_gemm_dgrad_grouped");
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_fp8_gemm_dgrad_grouped(dx, store, unpermute, n_mats, qdy, sdy, qwt, sw, n_seg, rows0, N, K);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_dgrad_grouped");
    real *rows = unpermute ? unpermute_buffer(unpermute, n_seg, rows0, K, "fp8_gemm_dgrad_grouped") : dx;
    for (int i = 0; i < n_mats; i++)
        cpu_fp8_gemm_dgrad_grouped(rows, i == 0 && !unpermute ? store : i == 0 ? GRAD_WRITE : GRAD_ADD, qdy[i], sdy[i],
                                   qwt[i], sw[i], n_seg, rows0, N, K);
    if (unpermute) unpermute_finish(dx, store, rows, unpermute, K);
}

void fp8_gemm_wgrad(Device dev, real *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt, int T, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_fp8_gemm_wgrad(dw, qdyt, sdyt, qxt, sxt, T, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_wgrad");
    cpu_fp8_gemm_wgrad(dw, qdyt, sdyt, qxt, sxt, T, N, K);
}

void fp8_gemm_wgrad_grouped(Device dev, real *dw, GradStore store, const uint8_t *qdyt, const float *sdyt,
                            const uint8_t *qxt, const float *sxt, int n_seg, const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_fp8_gemm_wgrad_grouped(dw, store == GRAD_WRITE, qdyt, sdyt, qxt, sxt, n_seg, rows0, N, K);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("fp8_gemm_wgrad_grouped");
    if (store == GRAD_WRITE) memset(dw, 0, (size_t)n_seg * N * K * sizeof(real));  // the definition
    for (int g = 0, tiles = 0; g < n_seg; g++) {
        const int T = rows0[g + 1] - rows0[g];
        if (T == 0) continue;
        cpu_fp8_gemm_wgrad(dw + (int64_t)g * N * K, qdyt + (size_t)N * FP8_TILE * tiles, sdyt + (size_t)N * tiles,
                           qxt + (size_t)K * FP8_TILE * tiles, sxt + (size_t)K * tiles, T, N, K);
        tiles += (T + FP8_TILE - 1) / FP8_TILE;
    }
}

void bf16_matmul_forward(Device dev, real *out, const real *inp, const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_matmul_forward(out, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_matmul_forward");
    cpu_bf16_matmul_forward(out, inp, weight, N, C, OC);
}

void bf16_matmul_backward(Device dev, real *dinp, real *dweight, const real *dout, const real *inp, const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_matmul_backward(dinp, dweight, dout, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_matmul_backward");
    cpu_bf16_matmul_backward(dinp, dweight, dout, inp, weight, N, C, OC);
}

void bf16_matmul_forward_bf16(Device dev, uint16_t *out, const real *inp, const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_matmul_forward_bf16(out, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_matmul_forward_bf16");
    cpu_bf16_matmul_forward_bf16(out, inp, weight, N, C, OC);
}

void bf16_matmul_backward_bf16(Device dev, real *dinp, real *dweight, const uint16_t *dout, const real *inp,
                               const real *weight, int N, int C, int OC) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_matmul_backward_bf16(dinp, dweight, dout, inp, weight, N, C, OC); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_matmul_backward_bf16");
    cpu_bf16_matmul_backward_bf16(dinp, dweight, dout, inp, weight, N, C, OC);
}

void bf16_round_array(Device dev, uint16_t *dst, const real *src, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_float_to_bf16(dst, src, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_round_array");
    cpu_bf16_round_array(dst, src, n);
}

void bf16_widen_array(Device dev, real *dst, const uint16_t *src, int64_t n) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_to_float(dst, src, n); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_widen_array");
    cpu_bf16_widen_array(dst, src, n);
}

void bf16_round_rows(Device dev, uint16_t *dst, const real *src, const int *rows, int n_rows, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_float_rows_to_bf16(dst, src, rows, n_rows, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_round_rows");
    cpu_bf16_round_rows(dst, src, rows, n_rows, C);
}

void bf16_gemm_fprop_grouped(Device dev, real *y, const real *residual, const uint16_t *x, const uint16_t *const *w,
                             int n_seg, const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_gemm_fprop_grouped(y, residual, x, w, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_fprop_grouped");
    cpu_bf16_gemm_fprop_grouped(y, x, w, n_seg, rows0, N, K);
    add_residual(y, residual, n_seg, rows0, N);
}

void bf16_gemm_dgrad_grouped(Device dev, real *dx, GradStore store, const DgradUnpermute *unpermute, int n_mats,
                             const uint16_t *const *dy, const uint16_t *const *const *w, int n_seg, const int *rows0,
                             int N, int K) {
    check_dgrad_args("bf16_gemm_dgrad_grouped", n_mats);
    if (unpermute) check_unpermute_post(unpermute, K, "bf16_gemm_dgrad_grouped");
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_bf16_gemm_dgrad_grouped(dx, store, unpermute, n_mats, dy, w, n_seg, rows0, N, K);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_dgrad_grouped");
    real *rows = unpermute ? unpermute_buffer(unpermute, n_seg, rows0, K, "bf16_gemm_dgrad_grouped") : dx;
    for (int i = 0; i < n_mats; i++)
        cpu_bf16_gemm_dgrad_grouped(rows, i == 0 && !unpermute ? store : i == 0 ? GRAD_WRITE : GRAD_ADD, dy[i], w[i],
                                    n_seg, rows0, N, K);
    if (unpermute) unpermute_finish(dx, store, rows, unpermute, K);
}

void bf16_gemm_fprop_grouped_bf16(Device dev, uint16_t *y, const uint16_t *x, const uint16_t *const *w, int n_seg,
                                  const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_gemm_fprop_grouped_bf16(y, x, w, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_fprop_grouped_bf16");
    cpu_bf16_gemm_fprop_grouped_bf16(y, x, w, n_seg, rows0, N, K);
}

void bf16_gemm_dgrad_grouped_bf16(Device dev, uint16_t *dx, const uint16_t *dy, const uint16_t *const *w, int n_seg,
                                  const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_gemm_dgrad_grouped_bf16(dx, dy, w, n_seg, rows0, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_dgrad_grouped_bf16");
    cpu_bf16_gemm_dgrad_grouped_bf16(dx, dy, w, n_seg, rows0, N, K);
}

void swiglu_forward_bf16(Device dev, uint16_t *h, const uint16_t *a, const uint16_t *b, int rows, int width) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_swiglu_forward_bf16(h, a, b, rows, width); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("swiglu_forward_bf16");
    cpu_swiglu_forward_bf16(h, a, b, rows, width);
}

void swiglu_backward_bf16(Device dev, uint16_t *h, uint16_t *da, uint16_t *db, const uint16_t *dh, const uint16_t *a,
                          const uint16_t *b, int rows, int width) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_swiglu_backward_bf16(h, da, db, dh, a, b, rows, width); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("swiglu_backward_bf16");
    cpu_swiglu_backward_bf16(h, da, db, dh, a, b, rows, width);
}

void moe_combine_grad_bf16(Device dev, uint16_t *dy, const real *dout, const real *topk_w, const int *slot_of, int N,
                           int K, int C) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_moe_combine_grad_bf16(dy, dout, topk_w, slot_of, N, K, C); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("moe_combine_grad_bf16");
    cpu_moe_combine_grad_bf16(dy, dout, topk_w, slot_of, N, K, C);
}

void bf16_gemm_wgrad(Device dev, real *dw, const uint16_t *dy, const uint16_t *x, int T, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) { cuda_bf16_gemm_wgrad(dw, dy, x, T, N, K); return; }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_wgrad");
    cpu_bf16_gemm_wgrad(dw, dy, x, T, N, K);
}

void bf16_gemm_wgrad_grouped(Device dev, real *dw, GradStore store, const uint16_t *dy, const uint16_t *x, int n_seg,
                             const int *rows0, int N, int K) {
#ifdef FP8MOE_CUDA
    if (dev == DEVICE_CUDA) {
        cuda_bf16_gemm_wgrad_grouped(dw, store == GRAD_WRITE, dy, x, n_seg, rows0, N, K);
        return;
    }
#endif
    if (dev != DEVICE_CPU) no_cuda_op("bf16_gemm_wgrad_grouped");
    if (store == GRAD_WRITE) memset(dw, 0, (size_t)n_seg * N * K * sizeof(real));  // the definition
    for (int g = 0; g < n_seg; g++) {
        const int r0 = rows0[g], T = rows0[g + 1] - rows0[g];
        if (T > 0) cpu_bf16_gemm_wgrad(dw + (int64_t)g * N * K, dy + (size_t)r0 * N, x + (size_t)r0 * K, T, N, K);
    }
}
