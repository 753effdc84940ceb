/*
 * test_gpu_attention.c - the CUDA causal attention core (kernels/cuda/attention.cu) against the CPU
 * reference (kernels/cpu/attention.c) and a double-precision reference computed here. Runs only on a
 * machine with an NVIDIA GPU (tests/gpu/run.sh); with no visible GPU it FAILS, so a GPU job can never
 * pass by testing nothing.
 *
 * For each shape: random non-zero q, k, v, dout (q up to 3 in magnitude so the softmax is neither flat
 * nor one-hot), forward and backward through the kernels.h dispatch on DEVICE_CPU and DEVICE_CUDA,
 * output and state poisoned with NaN before the forward (an element the kernel does not write fails),
 * gradients poisoned with NaN before the backward (it writes them; an element it reads or skips fails). Checked:
 *   out, dq, dk, dv   against the f64 reference on BF16-ROUNDED inputs (tight: only the kernel's own
 *                     roundings remain) and against the CPU op on the FP32 inputs (looser: adds the
 *                     effect of rounding the inputs to BF16);
 *   state             = (B, H, T) log-sum-exp (kernels.h), against the f64 reference; nothing beyond it
 *                     is written; attention_state_elems gives the documented sizes;
 *   determinism       forward and backward run twice: bitwise identical;
 *   NULL gradients    dq alone, dk and dv alone, dv alone: bitwise the same as in the full call;
 *   causality         k and v of one position t* changed: out, lse and dq of every row t < t* bitwise
 *                     unchanged (and out at t* changed, so the perturbation was seen).
 *
 * Tolerances. u_b = 2^-8 is the unit roundoff of BF16 (8 significant bits), u = 2^-24 that of FP32; a
 * tensor-core or FP32 sum of n terms is within n * 2^-23 of the sum of |terms| (e_sum(n); a worst case,
 * allowing truncation in the tensor core's adds). For query row i, E_i = max_{j <= i} scale sum_d |q_id k_jd|
 * bounds |scores|, and an error of at most x in every score changes log p_ij by at most 2x. Magnitudes (the
 * size of what an element is computed from, so cancellation cannot make a right answer look wrong):
 *   out:  M_id = sum_j p_ij |v_jd|
 *   dv:   Mdv_jd = sum_i p_ij |dout_id|
 *   dS:   A_ij = p_ij (sum_d |dout_id v_jd| + G_i), G_i = sum_j p_ij sum_d |dout_id v_jd| (bounds |dP|, |D|)
 *   dq:   Mdq_id = scale sum_j A_ij |k_jd|;   dk: Mdk_jd = scale sum_i A_ij |q_id|
 * GPU vs f64 on BF16-rounded inputs (first-order worst-case bounds, then a factor 2 of margin):
 *   e_s(E) = 2 Dqk 2^-23 E        (log p error from the FP32 sums of the scores)
 *   out:   eps_f = u_b (P rounded to BF16 for P V) + e_s(E_i) + e_sum(T) + 16u;  tol = 2 eps_f M
 *   lse:   tol = 2 (3 Dqk 2^-23 E_i + e_sum(T) + 16u (|lse| + 1))
 *   dv:    eps_b = u_b + 2 e_s(E_max) (score and lse) + e_sum(T + Dv) + 16u;  tol = 2 eps_b Mdv + 2u |dv|
 *   dq/dk: dS is within 2 eps_b A (p, dP, D = dout . out with dout rounded to BF16 and out the forward's
 *          FP32 output, computed from the BF16 P; and dS rounded to BF16),
 *          tol = 2 (2 eps_b + e_sum(T)) Mdq + 2u |dq|  (same for dk)
 * GPU vs CPU adds the BF16 rounding of the inputs: scores move by at most 2 u_b E, so log p by 4 u_b E;
 * v (and dout) by u_b each: eps_in = 4 u_b E + u_b for out (E = E_i), 4 u_b E_max + 3 u_b for the
 * gradients, added to eps_f / eps_b in the formulas above. These are loose (E is about 12 here); the
 * tight check is the one against f64.
 * One table row per output; ratios are the worst |difference| / tolerance (<= 1 passes).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "tests/gpu/gpucheck.h"
#include "unit/opcheck.h"

#define U_FP32 0x1p-24 // unit roundoff of FP32
#define U_BF16 0x1p-8  // unit roundoff of BF16 (8 significant bits)
#define U_ACC 0x1p-23  // per-term bound of an FP32 / tensor-core accumulation

static double e_sum(int64_t n) { return (double)n * U_ACC; }

typedef struct {
    int B, T, H, Dqk, Dv;
} AttCase;

// ---------------------------------------------------------------------------- buffers
static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes > 0 ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "%s:%d: malloc of %zu bytes failed\n", __FILE__, __LINE__, bytes);
        exit(1);
    }
    return p;
}
static float *floats(int64_t n) { return xmalloc((size_t)n * sizeof(float)); }
static double *doubles_zero(int64_t n) {
    double *x = xmalloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) x[i] = 0.0;
    return x;
}
static float *copy_floats(const float *x, int64_t n) {
    float *y = floats(n);
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}
static float *gpu_copy_of(const float *host, int64_t n) {
    float *d = device_alloc(DEVICE_CUDA, (size_t)n * sizeof(float));
    device_memcpy_from_host(DEVICE_CUDA, d, host, (size_t)n * sizeof(float));
    return d;
}
static float *gpu_nan_floats(int64_t n) {
    float *h = floats(n);
    for (int64_t i = 0; i < n; i++) h[i] = NAN;
    float *d = gpu_copy_of(h, n);
    free(h);
    return d;
}
static float *host_copy_of(const float *d, int64_t n) {
    float *h = floats(n);
    device_memcpy_to_host(DEVICE_CUDA, h, d, (size_t)n * sizeof(float));
    return h;
}
static void upload(float *d, const float *h, int64_t n) {
    device_memcpy_from_host(DEVICE_CUDA, d, h, (size_t)n * sizeof(float));
}

static float bf16_round(float x) { return bf16_to_float(float_to_bf16(x)); }

// ---------------------------------------------------------------------------- f64 reference
// Exact attention in double on the given (already BF16-rounded) inputs, with the magnitudes of the
// file comment.
typedef struct {
    double *out, *m_out, *lse, *e_row;               // (B,T,H,Dv), (B,T,H,Dv), (B,H,T), (B,H,T)
    double *dq, *m_dq, *dk, *m_dk, *dv, *m_dv;       // gradients and their magnitudes
    double e_max;                                    // max of e_row
} Reference;

static size_t at4(const AttCase *c, int b, int t, int h, int D) { return (((size_t)b * c->T + t) * c->H + h) * D; }

static void reference(Reference *r, const AttCase *c, const float *q, const float *k, const float *v,
                      const float *dout) {
    const int B = c->B, T = c->T, H = c->H, Dqk = c->Dqk, Dv = c->Dv;
    const double scale = (double)(1.0f / sqrtf((float)Dqk));  // the float value both ops use
    const int64_t nq = (int64_t)B * T * H * Dqk, nv = (int64_t)B * T * H * Dv, ns = (int64_t)B * H * T;
    r->out = doubles_zero(nv), r->m_out = doubles_zero(nv), r->lse = doubles_zero(ns), r->e_row = doubles_zero(ns);
    r->dq = doubles_zero(nq), r->m_dq = doubles_zero(nq), r->dk = doubles_zero(nq), r->m_dk = doubles_zero(nq);
    r->dv = doubles_zero(nv), r->m_dv = doubles_zero(nv);
    r->e_max = 0.0;
    double *s = doubles_zero(T), *p = doubles_zero(T), *dp = doubles_zero(T), *adp = doubles_zero(T);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < T; i++) {
                const float *qi = q + at4(c, b, i, h, Dqk), *gi = dout + at4(c, b, i, h, Dv);
                double mx = -INFINITY, e = 0.0;
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + at4(c, b, j, h, Dqk), *vj = v + at4(c, b, j, h, Dv);
                    double dot = 0.0, adot = 0.0, g = 0.0, ag = 0.0;
                    for (int d = 0; d < Dqk; d++) dot += (double)qi[d] * kj[d], adot += fabs((double)qi[d] * kj[d]);
                    for (int d = 0; d < Dv; d++) g += (double)gi[d] * vj[d], ag += fabs((double)gi[d] * vj[d]);
                    s[j] = scale * dot, dp[j] = g, adp[j] = ag;
                    if (scale * adot > e) e = scale * adot;
                    if (s[j] > mx) mx = s[j];
                }
                double l = 0.0;
                for (int j = 0; j <= i; j++) l += exp(s[j] - mx);
                double D = 0.0, G = 0.0;
                for (int j = 0; j <= i; j++) {
                    p[j] = exp(s[j] - mx) / l;
                    D += p[j] * dp[j], G += p[j] * adp[j];
                }
                const size_t si = ((size_t)b * H + h) * T + i;
                r->lse[si] = mx + log(l), r->e_row[si] = e;
                if (e > r->e_max) r->e_max = e;
                double *oi = r->out + at4(c, b, i, h, Dv), *moi = r->m_out + at4(c, b, i, h, Dv);
                double *dqi = r->dq + at4(c, b, i, h, Dqk), *mdqi = r->m_dq + at4(c, b, i, h, Dqk);
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + at4(c, b, j, h, Dqk), *vj = v + at4(c, b, j, h, Dv);
                    const double ds = p[j] * (dp[j] - D) * scale, a = p[j] * (adp[j] + G) * scale;
                    double *dkj = r->dk + at4(c, b, j, h, Dqk), *mdkj = r->m_dk + at4(c, b, j, h, Dqk);
                    double *dvj = r->dv + at4(c, b, j, h, Dv), *mdvj = r->m_dv + at4(c, b, j, h, Dv);
                    for (int d = 0; d < Dv; d++) {
                        oi[d] += p[j] * vj[d], moi[d] += p[j] * fabs((double)vj[d]);
                        dvj[d] += p[j] * gi[d], mdvj[d] += p[j] * fabs((double)gi[d]);
                    }
                    for (int d = 0; d < Dqk; d++) {
                        dqi[d] += ds * kj[d], mdqi[d] += a * fabs((double)kj[d]);
                        dkj[d] += ds * qi[d], mdkj[d] += a * fabs((double)qi[d]);
                    }
                }
            }
        }
    }
    free(s), free(p), free(dp), free(adp);
}

static void free_reference(Reference *r) {
    double *all[] = {r->out, r->m_out, r->lse, r->e_row, r->dq, r->m_dq, r->dk, r->m_dk, r->dv, r->m_dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

// ---------------------------------------------------------------------------- comparisons
// Largest |x - y| / tol over n elements (y from y32, or y64 when y32 is NULL); NaN counts as infinite.
static double worst_ratio(const float *x, const float *y32, const double *y64, const double *tol, int64_t n,
                          int64_t *at) {
    double worst = 0.0;
    *at = 0;
    for (int64_t i = 0; i < n; i++) {
        const double y = y32 != NULL ? (double)y32[i] : y64[i];
        double rr = fabs((double)x[i] - y) / tol[i];
        if (isnan(rr)) rr = INFINITY;
        if (rr > worst) worst = rr, *at = i;
    }
    return worst;
}

static void print_header(void) {
    printf("\n%-24s %-6s %12s %12s %12s %9s  %s\n", "shape (B,T,H,Dqk,Dv)", "output", "gpu-f64/tol", "gpu-cpu/tol",
           "max|g-f64|", "bitwise", "result");
    printf("%-24s %-6s %12s %12s %12s %9s  %s\n", "", "", "(<= 1)", "(<= 1)", "/mag in u_b", "=cpu", "");
}

// gpu against the f64 reference (tol_ref) and, when cpu != NULL, against the CPU op (tol_cpu). mag is
// the element's magnitude, printed as max |gpu - f64| / mag in units of u_b for information.
static int check_output(const char *shape, const char *output, const float *gpu, const float *cpu, const double *ref,
                        const double *tol_ref, const double *tol_cpu, const double *mag, int64_t n) {
    int64_t w_ref, w_cpu = 0, bitwise = 0;
    const double r_ref = worst_ratio(gpu, NULL, ref, tol_ref, n, &w_ref);
    const double r_cpu = cpu != NULL ? worst_ratio(gpu, cpu, NULL, tol_cpu, n, &w_cpu) : 0.0;
    double rel = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)gpu[i] - ref[i]) / mag[i];
        if (e > rel || isnan(e)) rel = e;
        if (cpu != NULL && memcmp(&gpu[i], &cpu[i], sizeof(float)) == 0) bitwise++;
    }
    const int pass = r_ref <= 1.0 && r_cpu <= 1.0;
    char cpu_col[32] = "-", bit_col[32] = "-";
    if (cpu != NULL) {
        snprintf(cpu_col, sizeof cpu_col, "%.3g", r_cpu);
        snprintf(bit_col, sizeof bit_col, "%.2f%%", 100.0 * (double)bitwise / (double)n);
    }
    printf("%-24s %-6s %12.3g %12s %12.3g %9s  %s\n", shape, output, r_ref, cpu_col, rel / U_BF16, bit_col,
           pass ? "ok" : "FAIL");
    if (r_ref > 1.0)
        printf("    worst vs f64 at [%lld]: gpu %.9g, f64 %.12g, tol %.3g, mag %.3g%s\n", (long long)w_ref, gpu[w_ref],
               ref[w_ref], tol_ref[w_ref], mag[w_ref], isnan(gpu[w_ref]) ? " (NaN: not written by the kernel?)" : "");
    if (cpu != NULL && r_cpu > 1.0)
        printf("    worst vs cpu at [%lld]: gpu %.9g, cpu %.9g, f64 %.12g, tol %.3g\n", (long long)w_cpu, gpu[w_cpu],
               cpu[w_cpu], ref[w_cpu], tol_cpu[w_cpu]);
    fflush(stdout);
    return pass;
}

// a and b bitwise equal over n elements; prints a row and returns 1 when they are.
static int check_bitwise(const char *shape, const char *what, const float *a, const float *b, int64_t n) {
    int64_t differ = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0 && differ++ == 0) first = i;
    }
    printf("%-24s %-30s %28s  %s\n", shape, what, differ == 0 ? "bitwise equal" : "differs",
           differ == 0 ? "ok" : "FAIL");
    if (differ > 0)
        printf("    %lld elements differ, first [%lld]: %.9g vs %.9g\n", (long long)differ, (long long)first, a[first],
               b[first]);
    fflush(stdout);
    return differ == 0;
}

// Rows t < t_limit of x (B, T, H, D) [or (B, H, T) when D == 0] bitwise equal in a and b.
static int check_rows_before(const char *shape, const char *what, const float *a, const float *b, const AttCase *c,
                             int D, int t_limit) {
    int64_t differ = 0, checked = 0;
    for (int bb = 0; bb < c->B; bb++)
        for (int t = 0; t < t_limit; t++)
            for (int h = 0; h < c->H; h++) {
                const int width = D > 0 ? D : 1;
                const size_t base = D > 0 ? at4(c, bb, t, h, D) : ((size_t)bb * c->H + h) * c->T + t;
                for (int d = 0; d < width; d++) {
                    checked++;
                    if (memcmp(&a[base + d], &b[base + d], sizeof(float)) != 0) differ++;
                }
            }
    printf("%-24s %-30s %28s  %s\n", shape, what, differ == 0 ? "unchanged (bitwise)" : "CHANGED",
           differ == 0 ? "ok" : "FAIL");
    if (differ > 0) printf("    %lld of %lld elements before t* changed: a future key leaked\n", (long long)differ,
                           (long long)checked);
    fflush(stdout);
    return differ == 0;
}

// ---------------------------------------------------------------------------- the test
static void test_attention(void **state) {
    const AttCase *c = *state;
    const int B = c->B, T = c->T, H = c->H, Dqk = c->Dqk, Dv = c->Dv;
    char shape[64];
    snprintf(shape, sizeof shape, "(%d,%d,%d,%d,%d)", B, T, H, Dqk, Dv);
    const int64_t nq = (int64_t)B * T * H * Dqk, nv = (int64_t)B * T * H * Dv, ns = (int64_t)B * H * T;
    const uint64_t seed = (uint64_t)B * 1000003u + (uint64_t)T * 1009u + (uint64_t)Dqk * 31u + (uint64_t)Dv;

    // the documented state sizes
    assert_int_equal(attention_state_elems(DEVICE_CUDA, B, T, H), ns);
    assert_int_equal(attention_state_elems(DEVICE_CPU, B, T, H), ns * T);

    float *q = floats(nq), *k = floats(nq), *v = floats(nv), *dout = floats(nv);
    float *dq0 = floats(nq), *dk0 = floats(nq), *dv0 = floats(nv);
    opcheck_fill_nonzero(q, (size_t)nq, seed + 1, 0.1, 3.0);
    opcheck_fill_nonzero(k, (size_t)nq, seed + 2, 0.1, 1.0);
    opcheck_fill_nonzero(v, (size_t)nv, seed + 3, 0.1, 1.0);
    opcheck_fill_nonzero(dout, (size_t)nv, seed + 4, 0.1, 1.0);
    // the backward writes its gradients: they start as NaN (poison), never read
    for (int64_t i = 0; i < nq; i++) dq0[i] = dk0[i] = NAN;
    for (int64_t i = 0; i < nv; i++) dv0[i] = NAN;

    // CPU reference op on the FP32 inputs
    float *c_out = floats(nv), *c_att = floats(ns * T);
    float *c_dq = copy_floats(dq0, nq), *c_dk = copy_floats(dk0, nq), *c_dv = copy_floats(dv0, nv);
    attention_forward(DEVICE_CPU, c_out, c_att, q, k, v, B, T, H, Dqk, Dv);
    attention_backward(DEVICE_CPU, c_dq, c_dk, c_dv, dout, c_out, c_att, q, k, v, B, T, H, Dqk, Dv);

    // f64 reference on the BF16-rounded inputs
    float *qr = floats(nq), *kr = floats(nq), *vr = floats(nv), *dor = floats(nv);
    for (int64_t i = 0; i < nq; i++) qr[i] = bf16_round(q[i]), kr[i] = bf16_round(k[i]);
    for (int64_t i = 0; i < nv; i++) vr[i] = bf16_round(v[i]), dor[i] = bf16_round(dout[i]);
    Reference r;
    reference(&r, c, qr, kr, vr, dor);

    // GPU: out and state (with a tail that must stay untouched) poisoned
    const int64_t tail = 64;
    float *d_q = gpu_copy_of(q, nq), *d_k = gpu_copy_of(k, nq), *d_v = gpu_copy_of(v, nv);
    float *d_dout = gpu_copy_of(dout, nv), *d_out = gpu_nan_floats(nv), *d_state = gpu_nan_floats(ns + tail);
    float *d_dq = gpu_copy_of(dq0, nq), *d_dk = gpu_copy_of(dk0, nq), *d_dv = gpu_copy_of(dv0, nv);
    attention_forward(DEVICE_CUDA, d_out, d_state, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    attention_backward(DEVICE_CUDA, d_dq, d_dk, d_dv, d_dout, d_out, d_state, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    float *g_out = host_copy_of(d_out, nv), *g_state = host_copy_of(d_state, ns + tail);
    float *g_dq = host_copy_of(d_dq, nq), *g_dk = host_copy_of(d_dk, nq), *g_dv = host_copy_of(d_dv, nv);

    // tolerances (file comment)
    double *tol_out_ref = doubles_zero(nv), *tol_out_cpu = doubles_zero(nv), *tol_lse = doubles_zero(ns);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                const size_t si = ((size_t)b * H + h) * T + t;
                const double E = r.e_row[si];
                const double eps_f = U_BF16 + 2.0 * Dqk * U_ACC * E + e_sum(T) + 16 * U_FP32;
                const double eps_in = 4 * U_BF16 * E + U_BF16;
                tol_lse[si] = 2 * (3.0 * Dqk * U_ACC * E + e_sum(T) + 16 * U_FP32 * (fabs(r.lse[si]) + 1));
                for (int d = 0; d < Dv; d++) {
                    const size_t i = at4(c, b, t, h, Dv);
                    tol_out_ref[i + d] = 2 * eps_f * r.m_out[i + d];
                    tol_out_cpu[i + d] = 2 * (eps_f + eps_in) * r.m_out[i + d];
                }
            }
    const double eps_b = U_BF16 + 4.0 * Dqk * U_ACC * r.e_max + e_sum(T + Dv) + 16 * U_FP32;
    const double eps_b_in = 4 * U_BF16 * r.e_max + 3 * U_BF16;
    double *tol_dq_ref = doubles_zero(nq), *tol_dq_cpu = doubles_zero(nq);
    double *tol_dk_ref = doubles_zero(nq), *tol_dk_cpu = doubles_zero(nq);
    double *tol_dv_ref = doubles_zero(nv), *tol_dv_cpu = doubles_zero(nv);
    for (int64_t i = 0; i < nq; i++) {
        tol_dq_ref[i] = 2 * ((2 * eps_b + e_sum(T)) * r.m_dq[i] + U_FP32 * fabs(r.dq[i]));
        tol_dq_cpu[i] = 2 * ((2 * (eps_b + eps_b_in) + e_sum(T)) * r.m_dq[i] + U_FP32 * fabs(r.dq[i]));
        tol_dk_ref[i] = 2 * ((2 * eps_b + e_sum(T)) * r.m_dk[i] + U_FP32 * fabs(r.dk[i]));
        tol_dk_cpu[i] = 2 * ((2 * (eps_b + eps_b_in) + e_sum(T)) * r.m_dk[i] + U_FP32 * fabs(r.dk[i]));
    }
    for (int64_t i = 0; i < nv; i++) {
        tol_dv_ref[i] = 2 * (eps_b * r.m_dv[i] + U_FP32 * fabs(r.dv[i]));
        tol_dv_cpu[i] = 2 * ((eps_b + eps_b_in) * r.m_dv[i] + U_FP32 * fabs(r.dv[i]));
    }
    double *lse_mag = doubles_zero(ns);
    for (int64_t i = 0; i < ns; i++) lse_mag[i] = fabs(r.lse[i]) + 1.0;

    int ok = 1;
    ok &= check_output(shape, "out", g_out, c_out, r.out, tol_out_ref, tol_out_cpu, r.m_out, nv);
    ok &= check_output(shape, "lse", g_state, NULL, r.lse, tol_lse, NULL, lse_mag, ns);
    ok &= check_output(shape, "dq", g_dq, c_dq, r.dq, tol_dq_ref, tol_dq_cpu, r.m_dq, nq);
    ok &= check_output(shape, "dk", g_dk, c_dk, r.dk, tol_dk_ref, tol_dk_cpu, r.m_dk, nq);
    ok &= check_output(shape, "dv", g_dv, c_dv, r.dv, tol_dv_ref, tol_dv_cpu, r.m_dv, nv);
    int64_t tail_written = 0;
    for (int64_t i = ns; i < ns + tail; i++) tail_written += !isnan(g_state[i]);
    printf("%-24s %-30s %28s  %s\n", shape, "state beyond (B,H,T)", tail_written ? "WRITTEN" : "untouched",
           tail_written ? "FAIL" : "ok");
    ok &= tail_written == 0;

    // determinism: the same calls again, bitwise
    float *d_out2 = gpu_nan_floats(nv), *d_state2 = gpu_nan_floats(ns);
    attention_forward(DEVICE_CUDA, d_out2, d_state2, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    upload(d_dq, dq0, nq), upload(d_dk, dk0, nq), upload(d_dv, dv0, nv);
    attention_backward(DEVICE_CUDA, d_dq, d_dk, d_dv, d_dout, d_out2, d_state2, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    float *h_out2 = host_copy_of(d_out2, nv), *h_state2 = host_copy_of(d_state2, ns);
    float *h_dq2 = host_copy_of(d_dq, nq), *h_dk2 = host_copy_of(d_dk, nq), *h_dv2 = host_copy_of(d_dv, nv);
    ok &= check_bitwise(shape, "repeat: out", g_out, h_out2, nv);
    ok &= check_bitwise(shape, "repeat: lse", g_state, h_state2, ns);
    ok &= check_bitwise(shape, "repeat: dq", g_dq, h_dq2, nq);
    ok &= check_bitwise(shape, "repeat: dk", g_dk, h_dk2, nq);
    ok &= check_bitwise(shape, "repeat: dv", g_dv, h_dv2, nv);

    // NULL gradients: the others are computed exactly as in the full call
    upload(d_dq, dq0, nq), upload(d_dk, dk0, nq), upload(d_dv, dv0, nv);
    attention_backward(DEVICE_CUDA, d_dq, NULL, NULL, d_dout, d_out, d_state, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    attention_backward(DEVICE_CUDA, NULL, d_dk, NULL, d_dout, d_out, d_state, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    attention_backward(DEVICE_CUDA, NULL, NULL, d_dv, d_dout, d_out, d_state, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    float *h_dq3 = host_copy_of(d_dq, nq), *h_dk3 = host_copy_of(d_dk, nq), *h_dv3 = host_copy_of(d_dv, nv);
    ok &= check_bitwise(shape, "dq alone (dk = dv = NULL)", g_dq, h_dq3, nq);
    ok &= check_bitwise(shape, "dk alone (dq = dv = NULL)", g_dk, h_dk3, nq);
    ok &= check_bitwise(shape, "dv alone (dq = dk = NULL)", g_dv, h_dv3, nv);

    // causality: change k and v at t*, rows before t* must not move
    const int t_star = 2 * T / 3;
    float *kp = copy_floats(k, nq), *vp = copy_floats(v, nv);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            for (int d = 0; d < Dqk; d++) kp[at4(c, b, t_star, h, Dqk) + d] += 0.75f;
            for (int d = 0; d < Dv; d++) vp[at4(c, b, t_star, h, Dv) + d] -= 0.5f;
        }
    upload(d_k, kp, nq), upload(d_v, vp, nv), upload(d_dq, dq0, nq);
    attention_forward(DEVICE_CUDA, d_out2, d_state2, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    attention_backward(DEVICE_CUDA, d_dq, NULL, NULL, d_dout, d_out2, d_state2, d_q, d_k, d_v, B, T, H, Dqk, Dv);
    float *h_out4 = host_copy_of(d_out2, nv), *h_state4 = host_copy_of(d_state2, ns), *h_dq4 = host_copy_of(d_dq, nq);
    char what[64];
    snprintf(what, sizeof what, "k,v at t*=%d changed: out", t_star);
    ok &= check_rows_before(shape, what, g_out, h_out4, c, Dv, t_star);
    ok &= check_rows_before(shape, "  ... lse", g_state, h_state4, c, 0, t_star);
    ok &= check_rows_before(shape, "  ... dq", g_dq, h_dq4, c, Dqk, t_star);
    int seen = 0;
    const size_t row_star = at4(c, 0, t_star, 0, Dv);
    for (int d = 0; d < Dv; d++) seen |= memcmp(&g_out[row_star + d], &h_out4[row_star + d], sizeof(float)) != 0;
    printf("%-24s %-30s %28s  %s\n", shape, "  ... out at t* itself", seen ? "changed" : "NOT changed",
           seen ? "ok" : "FAIL");
    ok &= seen;

    void *host[] = {q, k, v, dout, dq0, dk0, dv0, c_out, c_att, c_dq, c_dk, c_dv, qr, kr, vr, dor, g_out, g_state,
                    g_dq, g_dk, g_dv, tol_out_ref, tol_out_cpu, tol_lse, tol_dq_ref, tol_dq_cpu, tol_dk_ref,
                    tol_dk_cpu, tol_dv_ref, tol_dv_cpu, lse_mag, h_out2, h_state2, h_dq2, h_dk2, h_dv2, h_dq3,
                    h_dk3, h_dv3, kp, vp, h_out4, h_state4, h_dq4};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    free_reference(&r);
    void *dev[] = {d_q, d_k, d_v, d_dout, d_out, d_state, d_dq, d_dk, d_dv, d_out2, d_state2};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) device_free(DEVICE_CUDA, dev[i]);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- cases
// Query tiles are 128 rows in the forward and dq kernels (64 in dq when head dims are so large that 128
// rows do not fit in shared memory, e.g. 256/256), key tiles 64 rows, dk/dv blocks 64 keys; head dims are
// padded to 16 and accumulators sized 64/128/192/256. The shapes: one partial tile with tiny odd head
// dims (most warps of the block beyond T); several tiles with T not a multiple of 64; odd head dims in the
// 256 class with T = 129 (a second query tile of one row, and Dqk != Dv capacities in dk/dv); the
// largest head dims (dq's 64-row fallback, full 256 accumulators); the model's head dims (192 = 128 nope
// + 64 rope, Dv 128) over 4 query tiles of 128.
static AttCase case_tiny = {2, 37, 3, 12, 8};
static AttCase case_mid = {1, 200, 2, 48, 32};
static AttCase case_odd = {3, 129, 2, 200, 72};
static AttCase case_wide = {1, 300, 1, 256, 256};
static AttCase case_model = {1, 512, 2, 192, 128};

int main(void) {
    const int n_gpu = gpucheck_devices("test_gpu_attention");
    if (n_gpu == 0) return 1;
    printf("test_gpu_attention: %d CUDA device(s) visible; CUDA attention vs f64 on BF16-rounded inputs and vs "
           "the CPU op; u_b = 2^-8.\n", n_gpu);
    print_header();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_attention, &case_tiny),
        cmocka_unit_test_prestate(test_attention, &case_mid),
        cmocka_unit_test_prestate(test_attention, &case_odd),
        cmocka_unit_test_prestate(test_attention, &case_wide),
        cmocka_unit_test_prestate(test_attention, &case_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
