/*
 * linear.c - block Linear layers in the precision mode of the job (see linear.h). In fp8 mode every
 * call quantises its operands afresh (activations per call; the weight per call too, which keeps the
 * CPU reference simple: the weight's 128x128 blocks are a pure function of the FP32 master weight, so
 * quantising once per step would give identical bits). Fprop and Dgrad run on row counts padded with
 * zero rows to a multiple of 16 (DESIGN.md section 4: per-expert segments have any length, the GPU
 * GEMMs need multiples of 16); zero rows quantise to zero with scale 1 and change no valid output.
 * Wgrad's 128x1 quantiser pads the token axis to a multiple of 128 itself.
 */
#include "train/linear.h"

#include "kernels/profile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Scratch for quantised operands, grown on demand and kept with the model (no allocation per call
// once the largest shape has been seen).
static void *scratch_take(Model *m, size_t *used, size_t bytes) {
    size_t aligned = (bytes + 63) & ~(size_t)63;
    if (*used + aligned > m->fp8_scratch_bytes) {  // scratch_reserve was given the total beforehand
        fprintf(stderr, "fp8moe: train/linear.c: internal error: FP8 scratch too small\n");
        exit(1);
    }
    void *p = (char *)m->fp8_scratch + *used;
    *used += aligned;
    return p;
}

static void scratch_reserve(Model *m, size_t bytes) {
    if (bytes <= m->fp8_scratch_bytes) return;
    device_free(m->dev, m->fp8_scratch);
    m->fp8_scratch = device_alloc(m->dev, bytes);
    m->fp8_scratch_bytes = bytes;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int round_up(int a, int b) { return ceil_div(a, b) * b; }

// x (rows, C) -> the same rows followed by zero rows up to padded_rows, in `buf` (or x itself when
// no padding is needed).
static const real *pad_rows(Model *m, real *buf, const real *x, int rows, int padded_rows, int C) {
    if (padded_rows == rows) return x;
    copy_block(m->dev, buf, C, x, C, rows, C, 0);
    device_memset_zero(m->dev, buf + (int64_t)rows * C, (size_t)(padded_rows - rows) * C * sizeof(real));
    return buf;
}
static size_t pad_bytes(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static void check_quantised(int rc, const char *what, const char *err) {
    if (rc == 0) return;
    fprintf(stderr, "fp8moe: FP8 quantisation of %s failed: %s\n", what, err);
    exit(1);
}

// Scratch bytes of one Linear's Fprop and of its backward (Dgrad + Wgrad) at N rows: the sums of the
// buffers the two functions below take, in the same order.
static size_t fprop_bytes(int N, int C, int OC) {
    int KB = ceil_div(C, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(OC, FP8_TILE), T16 = round_up(N, 16);
    size_t Kp = (size_t)KB * FP8_TILE, Np = (size_t)NB * FP8_TILE, R = sizeof(real);
    return pad_bytes((size_t)T16 * Kp) + pad_bytes((size_t)KB * T16 * sizeof(float)) + pad_bytes(Np * Kp) +
           pad_bytes((size_t)NB * KB4 * sizeof(float)) + pad_bytes((size_t)T16 * C * R) + pad_bytes((size_t)T16 * OC * R);
}

static size_t backward_bytes(int N, int C, int OC) {
    int KB = ceil_div(C, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(OC, FP8_TILE), TB = ceil_div(N, FP8_TILE);
    int T16 = round_up(N, 16);
    size_t Kp = (size_t)KB * FP8_TILE, Np = (size_t)NB * FP8_TILE, Tp = (size_t)TB * FP8_TILE, R = sizeof(real);
    return pad_bytes((size_t)T16 * Np) + pad_bytes((size_t)NB * T16 * sizeof(float)) + 2 * pad_bytes(Np * Kp) +
           pad_bytes((size_t)NB * KB4 * sizeof(float)) + pad_bytes((size_t)T16 * C * R) + pad_bytes((size_t)T16 * OC * R) +
           pad_bytes((size_t)OC * Tp) + pad_bytes((size_t)TB * OC * sizeof(float)) + pad_bytes((size_t)C * Tp) +
           pad_bytes((size_t)TB * C * sizeof(float));
}

void linear_reserve_scratch(Model *m, int rows) {
    if (m->cfg.precision.mode != PRECISION_FP8) return;
    size_t most = 0;
    for (int i = 0; i < m->n_params; i++) {  // every block Linear: 2-D tensors but the embedding, head, routers
        const ParamInfo *p = &m->params[i];
        if (p->ndim != 2 || strcmp(p->name, "embed.weight") == 0 || strcmp(p->name, "head.weight") == 0 ||
            strstr(p->name, ".ffn.gate.weight"))
            continue;
        size_t f = fprop_bytes(rows, p->shape[1], p->shape[0]), b = backward_bytes(rows, p->shape[1], p->shape[0]);
        if (f > most) most = f;
        if (b > most) most = b;
    }
    scratch_reserve(m, most);
}

void linear_forward(Model *m, real *out, const real *inp, const real *weight, int N, int C, int OC) {
    profile_begin(PHASE_OTHER_GEMM);  // the caller may make it an expert GEMM (kernels/profile.h)
    switch (m->cfg.precision.mode) {
    case PRECISION_FP32:
        matmul_forward(m->dev, out, inp, weight, N, C, OC);
        profile_end(PHASE_OTHER_GEMM);
        return;
    case PRECISION_BF16:
        bf16_matmul_forward(m->dev, out, inp, weight, N, C, OC);
        profile_end(PHASE_OTHER_GEMM);
        return;
    case PRECISION_FP8: break;
    }
    int KB = ceil_div(C, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(OC, FP8_TILE), T16 = round_up(N, 16);
    size_t Kp = (size_t)KB * FP8_TILE, Np = (size_t)NB * FP8_TILE, R = sizeof(real);
    scratch_reserve(m, fprop_bytes(N, C, OC));
    size_t used = 0;
    uint8_t *qx = scratch_take(m, &used, (size_t)T16 * Kp);
    float *sx = scratch_take(m, &used, (size_t)KB * T16 * sizeof(float));
    uint8_t *qw = scratch_take(m, &used, Np * Kp);
    float *sw = scratch_take(m, &used, (size_t)NB * KB4 * sizeof(float));
    real *x_pad = scratch_take(m, &used, (size_t)T16 * C * R);
    real *y_pad = scratch_take(m, &used, (size_t)T16 * OC * R);
    const real *x = pad_rows(m, x_pad, inp, N, T16, C);
    real *y = T16 == N ? out : y_pad;
    char err[256];
    profile_begin(PHASE_QUANTISE);
    check_quantised(fp8_quantize_1x128(m->dev, qx, sx, x, T16, C, err, sizeof err), "an activation (Fprop X)", err);
    check_quantised(fp8_quantize_128x128(m->dev, qw, NULL, sw, weight, OC, C, err, sizeof err), "a weight", err);
    profile_end(PHASE_QUANTISE);
    fp8_gemm_fprop(m->dev, y, qx, sx, qw, sw, T16, OC, C);
    if (y != out) copy_block(m->dev, out, OC, y, OC, N, OC, 0);  // the first N rows are the valid ones
    m->fp8_gemm_count++;
    profile_end(PHASE_OTHER_GEMM);
}

void linear_backward(Model *m, real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                     int N, int C, int OC) {
    profile_begin(PHASE_OTHER_GEMM);
    switch (m->cfg.precision.mode) {
    case PRECISION_FP32:
        matmul_backward(m->dev, dinp, dweight, dout, inp, weight, N, C, OC);
        profile_end(PHASE_OTHER_GEMM);
        return;
    case PRECISION_BF16:
        bf16_matmul_backward(m->dev, dinp, dweight, dout, inp, weight, N, C, OC);
        profile_end(PHASE_OTHER_GEMM);
        return;
    case PRECISION_FP8: break;
    }
    // Dgrad: dY in 1x128 tiles along OC, W's 128x128 blocks transposed; the BF16 result is added to dinp.
    // Wgrad: dY and X in 128x1 tiles along the N tokens, written transposed so N is the contraction axis.
    int KB = ceil_div(C, FP8_TILE), KB4 = ceil_div(KB, 4) * 4, NB = ceil_div(OC, FP8_TILE), TB = ceil_div(N, FP8_TILE);
    int T16 = round_up(N, 16);
    size_t Kp = (size_t)KB * FP8_TILE, Np = (size_t)NB * FP8_TILE, Tp = (size_t)TB * FP8_TILE, R = sizeof(real);
    scratch_reserve(m, backward_bytes(N, C, OC));
    size_t used = 0;
    uint8_t *qdy = scratch_take(m, &used, (size_t)T16 * Np);
    float *sdy = scratch_take(m, &used, (size_t)NB * T16 * sizeof(float));
    uint8_t *qw = scratch_take(m, &used, Np * Kp);
    uint8_t *qwt = scratch_take(m, &used, Np * Kp);
    float *sw = scratch_take(m, &used, (size_t)NB * KB4 * sizeof(float));
    real *dx = scratch_take(m, &used, (size_t)T16 * C * R);
    real *dy_pad = scratch_take(m, &used, (size_t)T16 * OC * R);
    uint8_t *qdyt = scratch_take(m, &used, (size_t)OC * Tp);
    float *sdyt = scratch_take(m, &used, (size_t)TB * OC * sizeof(float));
    uint8_t *qxt = scratch_take(m, &used, (size_t)C * Tp);
    float *sxt = scratch_take(m, &used, (size_t)TB * C * sizeof(float));
    char err[256];
    if (dinp) {
        const real *dy = pad_rows(m, dy_pad, dout, N, T16, OC);
        profile_begin(PHASE_QUANTISE);
        check_quantised(fp8_quantize_1x128(m->dev, qdy, sdy, dy, T16, OC, err, sizeof err), "a gradient (Dgrad dY)", err);
        check_quantised(fp8_quantize_128x128(m->dev, qw, qwt, sw, weight, OC, C, err, sizeof err), "a weight", err);
        profile_end(PHASE_QUANTISE);
        fp8_gemm_dgrad(m->dev, dx, qdy, sdy, qwt, sw, T16, OC, C);
        add_inplace(m->dev, dinp, dx, (int64_t)N * C);  // the first N rows are the valid ones
        m->fp8_gemm_count++;
    }
    if (dweight) {
        profile_begin(PHASE_QUANTISE);
        check_quantised(fp8_quantize_128x1_transposed(m->dev, qdyt, sdyt, dout, N, OC, err, sizeof err),
                        "a gradient (Wgrad dY)", err);
        check_quantised(fp8_quantize_128x1_transposed(m->dev, qxt, sxt, inp, N, C, err, sizeof err),
                        "an activation (Wgrad X)", err);
        profile_end(PHASE_QUANTISE);
        fp8_gemm_wgrad(m->dev, dweight, qdyt, sdyt, qxt, sxt, N, OC, C);
        m->fp8_gemm_count++;
    }
    profile_end(PHASE_OTHER_GEMM);
}

void linear_free_scratch(Model *m) {
    device_free(m->dev, m->fp8_scratch);
    m->fp8_scratch = NULL;
    m->fp8_scratch_bytes = 0;
}
