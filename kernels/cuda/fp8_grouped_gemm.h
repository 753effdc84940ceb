/*
 * fp8_grouped_gemm.h - fp8moe's own grouped FP8 GEMM for the routed experts (kernels/cuda/fp8_grouped_gemm.cu):
 * every expert's Y_g = X_g W_g^T in one persistent Hopper kernel (wgmma, TMA), instead of one cuBLASLt GEMM per
 * expert. gemm.cu runs kernels.h's grouped Fprops (W_g the weight) and Dgrads (W_g the weight's transposed codes,
 * its scales transposed), and bf16 mode's grouped Fprops and Dgrads (cuda_bf16_grouped_gemm), with more than one
 * segment on it unless FP8MOE_GROUPED_GEMM=cublaslt (cuda_fp8_grouped_gemm_use_own, gemm.h); `fp8moe bench gemm`
 * times it beside cuBLASLt and tests/gpu/test_gpu_grouped_gemm.c checks both forms against the CPU reference and
 * cuBLASLt. Its Wgrad form (cuda_fp8_grouped_wgrad) is run only by those two: slower than cuBLASLt so far.
 *
 * All pointers are device pointers except the host arrays qw, sw and rows0; everything runs on the default stream.
 */
#ifndef FP8MOE_CUDA_FP8_GROUPED_GEMM_H
#define FP8MOE_CUDA_FP8_GROUPED_GEMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// y (row stride round_up(N, 128), BF16 bits): for each segment g, its rows0[g+1] - rows0[g] rows of X_g W_g^T rounded
// to BF16 (RNE), columns N .. round_up(N, 128)-1 of those rows 0, at row rows0[g] of y (y_rows_padded = 0: kernels.h's
// *_grouped_bf16 layout) or at row P16_g, the segment's first row in qx (y_rows_padded = 1: gemm.cu's conversion
// scratch). Only those rows are written (the padding rows between segments and the 15 scratch rows that kernels.h's
// *_grouped_bf16 contract allows a GEMM to write are left alone).
//   qx, sx: the grouped 1x128 operand of x (rows0[n_seg], K) (fp8_quantize_1x128_grouped): segment g's rows at
//           qx + Kp P16_g (T16_g rows of Kp bytes), its scales at sx + KB P16_g as [KB][T16_g]
//           (P16_g = sum_{h<g} 16 ceil(T_h / 16), KB = ceil(K / 128), Kp = 128 KB);
//   qw[g], sw[g]: weight g (N, K) as fp8_quantize_128x128 writes it: (Np, Kp) bytes, scales (NB, KB4) K-major
//           (NULL for empty segments);
//   rows0: host array of n_seg + 1 row offsets, rows0[0] = 0, non-decreasing, 1 <= n_seg <= FP8_MAX_SEGMENTS.
// Arithmetic: per 128-row x 128-column output tile and 128-deep K block kb, the block's sum P of E4M3 products on the
// tensor cores (FP32 accumulation inside the block), then acc = fma(P, s_x[row][kb] * s_w[kb], acc) in FP32 registers,
// kb = 0, 1, ... in order from acc = 0; y = bf16(acc). Deterministic: every element has one owner and one order, no
// atomics. Needs a compute capability 9.0 GPU (sm_90a code) and 16-byte aligned qx, sx, y, qw[g], sw[g]; stops the
// process naming the argument otherwise.
void cuda_fp8_grouped_gemm_bf16(uint16_t *y, int y_rows_padded, const uint8_t *qx, const float *sx,
                                const uint8_t *const *qw, const float *const *sw, int n_seg, const int *rows0, int N,
                                int K);

// dw + g N K (N, K) += dY_g^T X_g for every non-empty segment g (T_g = rows0[g+1] - rows0[g] tokens), in one launch
// for all segments (up to MAX_GROUPS non-empty ones; more take more launches): kernels.h's fp8_gemm_wgrad_grouped on
// the same operands, the 128x1 operands of all segments one after another as fp8_quantize_128x1_transposed_grouped
// writes them (segment g's from tile t_g: qdyt + N 128 t_g, sdyt + N t_g, qxt + K 128 t_g, sxt + K t_g; rows0 a host
// array, 1 <= n_seg <= FP8_MAX_SEGMENTS). The contraction runs over each segment's own 128-token tiles.
// Arithmetic: per output tile (128 x 256 in the wide form where K / 128 is even, else 128 x 128: the same bits) and
// token tile kb, the tile's sum P of E4M3 products on the tensor cores,
// then acc = fma(P, s_dy[n][kb] * s_x[k][kb], acc) in FP32 registers, kb in order from acc = 0; dw = dw + acc (one
// FP32 add per element, made in L2 by a TMA reduce-add of the tile that owns it: deterministic, no atomics). N and
// K must be multiples of 4 (16-byte rows of scales) and every pointer 16-byte aligned; stops the process naming the
// argument otherwise.
void cuda_fp8_grouped_wgrad(float *dw, const uint8_t *qdyt, const float *sdyt, const uint8_t *qxt, const float *sxt,
                            int n_seg, const int *rows0, int N, int K);

// The BF16 forms of the same kernel (bf16 mode's routed experts, kernels.h bf16_gemm_fprop_grouped* and
// bf16_gemm_dgrad_grouped*): for each segment g, its rows0[g+1] - rows0[g] rows of X_g W_g^T (w_kn = 0: w[g] is (N,
// K), the Fprop) or of X_g W_g (w_kn = 1: w[g] is (K, N), read MN-major: the Dgrad, dX = dY W), rounded to BF16 (RNE),
// at row rows0[g] of y, N columns in rows of round_up(N, 128) (kernels.h bf16_rows_ld: the padding columns and every
// other row are left alone). x (rows0[n_seg], K) and each w[g] are packed BF16 rows; w[g] may be NULL for an empty
// segment. Arithmetic: the tensor cores' sums of BF16 products accumulated in FP32 over K blocks of 64 in order from
// 0, then one rounding. Deterministic (one owner and order per element; the bits depend on neither the grid nor the
// form), but not cuBLASLt's order, so not its bits. Needs K (and with w_kn, N) a multiple of 8 and 16-byte aligned y,
// x and w[g] (TMA); stops the process naming the argument otherwise (gemm.cu runs a call that does not fit on
// cuBLASLt instead).
void cuda_bf16_grouped_gemm(uint16_t *y, const uint16_t *x, const uint16_t *const *w, int w_kn, int n_seg,
                            const int *rows0, int N, int K);

// The forms of the kernel, both giving the same bits (the same products summed and promoted in the same order):
//   FP8_GROUPED_WIDE    one CTA per 128 x 256 output tile (two weight blocks: each X tile is read once per 256 output
//                       columns), for weights with an even number of 128-column blocks; the default;
//   FP8_GROUPED_SINGLE  one CTA per 128 x 128 tile: what weights with an odd number of blocks always run.
enum { FP8_GROUPED_SINGLE = 0, FP8_GROUPED_WIDE = 1 };

// Chooses the form of the following calls; returns the previous one. For the test's and the benchmark's comparison.
int cuda_fp8_grouped_gemm_form(int form);

#ifdef __cplusplus
}
#endif
#endif
