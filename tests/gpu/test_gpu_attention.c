/*
 * test_gpu_attention.c - the CUDA causal attention core (kernels/cuda/attention.cu) against the CPU
 * reference (kernels/cpu/attention.c) and a double-precision reference computed here. Runs only on a
 * machine with an NVIDIA GPU (tests/gpu/run.sh); with no visible GPU it FAILS, so a GPU job can never
 * pass by testing nothing.
 *
 * The op takes MLA's layout (kernels.h): q (B, T, H, Dqk), kv (B, T, H, Dn + Dv) = [k_nope ; v] per head,
 * k_rope (B, T, Dr) shared by the heads; it writes dq, d_kv = [dk_nope ; dv] and d_k_rope = the heads'
 * rope-key gradients summed in head order. The f64 reference works per head on the keys and values kv and
 * k_rope stand for, and its gradients are gathered back into that layout here.
 *
 * For each shape: random non-zero q, kv, k_rope, dout (q up to 3 in magnitude so the softmax is neither
 * flat nor one-hot), forward and backward through the kernels.h dispatch on DEVICE_CPU and DEVICE_CUDA,
 * output and state poisoned with NaN before the forward (an element the kernel does not write fails),
 * gradients poisoned with NaN before the backward (it writes them; an element it reads or skips fails).
 * Checked:
 *   out, dq, d_kv,    against the f64 reference on BF16-ROUNDED inputs (tight: only the kernel's own
 *   d_k_rope          roundings remain) and against the CPU op on the FP32 inputs (looser: adds the
 *                     effect of rounding the inputs to BF16);
 *   state             starts with the (B, H, T) log-sum-exp (kernels.h), against the f64 reference; nothing
 *                     beyond attention_state_elems is written, which gives the documented sizes;
 *   determinism       forward and backward run twice: bitwise identical;
 *   NULL gradients    dq alone, d_kv alone, d_k_rope alone: bitwise the same as in the full call;
 *   inputs gone       the backward with q, kv and k_rope overwritten by NaN after the forward: the same
 *                     gradients bitwise (it reads the BF16 copies in the state: kernels.h);
 *   BF16 products     attention_forward_bf16 on q's and kv's BF16 values at padded row strides (the query before
 *                     RoPE): out, the whole state and the gradients bitwise those of rope_forward and
 *                     attention_forward on the widened values, with vector-aligned and odd strides; and
 *                     attention_backward_bf16 on a BF16 dout the gradients of attention_backward on its widened values;
 *   one head at a time  H = 1 calls on each head's q, kv, dout (the same k_rope): out and d_kv bitwise the
 *                     H-head call's head h, and d_k_rope bitwise ((0 + g_0) + g_1) + ... + g_{H-1} of the
 *                     single-head calls' rope gradients, added on the host: the reduction's head order;
 *   causality         kv and k_rope of one position t* changed: out, lse and dq of every row t < t*
 *                     bitwise unchanged (and out at t* changed, so the perturbation was seen).
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
 *          tol = 2 (2 eps_b + e_sum(T)) Mdq + 2u |dq|  (same for dk, per head)
 *   d_kv:  dk's tolerance for its k_nope columns, dv's for its v columns.
 *   d_k_rope: the sum over heads of the heads' dk tolerances (rope columns), plus 2 e_sum(H) sum_h Mdk for
 *          the FP32 sum over the H heads (on each side of a comparison).
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

#include "kernels/cuda/cuda_ops.h"
#include "kernels/kernels.h"
#include "tests/gpu/gpucheck.h"
#include "unit/opcheck.h"

#define U_FP32 0x1p-24 // unit roundoff of FP32
#define U_BF16 0x1p-8  // unit roundoff of BF16 (8 significant bits)
#define U_ACC 0x1p-23  // per-term bound of an FP32 / tensor-core accumulation

static double e_sum(int64_t n) { return (double)n * U_ACC; }

typedef struct {
    int B, T, H, Dn, Dr, Dv;  // Dqk = Dn + Dr
    int mma_only;             // 1: the mma.sync kernels even where the Hopper (wgmma) kernels serve the shape
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
// Exact attention in double on the given (already BF16-rounded) inputs, per head: k (B, T, H, Dqk) and v
// (B, T, H, Dv) are the per-head keys and values (expand_kv below), with the magnitudes of the file comment.
typedef struct {
    double *out, *m_out, *lse, *e_row;               // (B,T,H,Dv), (B,T,H,Dv), (B,H,T), (B,H,T)
    double *dq, *m_dq, *dk, *m_dk, *dv, *m_dv;       // gradients and their magnitudes
    double e_max;                                    // max of e_row
} Reference;

static size_t at4(const AttCase *c, int b, int t, int h, int D) { return (((size_t)b * c->T + t) * c->H + h) * D; }

static void reference(Reference *r, const AttCase *c, const float *q, const float *k, const float *v,
                      const float *dout) {
    const int B = c->B, T = c->T, H = c->H, Dqk = c->Dn + c->Dr, Dv = c->Dv;
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
    printf("\n%-24s %-8s %12s %12s %12s %9s  %s\n", "shape (B,T,H,Dn+Dr,Dv)", "output", "gpu-f64/tol", "gpu-cpu/tol",
           "max|g-f64|", "bitwise", "result");
    printf("%-24s %-8s %12s %12s %12s %9s  %s\n", "", "", "(<= 1)", "(<= 1)", "/mag in u_b", "=cpu", "");
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
    printf("%-24s %-8s %12.3g %12s %12.3g %9s  %s\n", shape, output, r_ref, cpu_col, rel / U_BF16, bit_col,
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

// ---------------------------------------------------------------------------- MLA layout
// The per-head keys (B, T, H, Dqk) and values (B, T, H, Dv) that kv and k_rope stand for (kernels.h):
// k[t,h] = [kv[t,h,0:Dn] ; k_rope[t]], v[t,h] = kv[t,h,Dn:]. Only the references below use them.
static void expand_kv(float *k, float *v, const float *kv, const float *k_rope, const AttCase *c) {
    const int N = c->B * c->T, H = c->H, Dn = c->Dn, Dr = c->Dr, Dv = c->Dv, Dqk = Dn + Dr, ld = Dn + Dv;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const float *row = kv + ((size_t)n * H + h) * ld;
            float *kr = k + ((size_t)n * H + h) * Dqk, *vr = v + ((size_t)n * H + h) * Dv;
            for (int d = 0; d < Dn; d++) kr[d] = row[d];
            for (int d = 0; d < Dr; d++) kr[Dn + d] = k_rope[(size_t)n * Dr + d];
            for (int d = 0; d < Dv; d++) vr[d] = row[Dn + d];
        }
}

// Per-head values x_k (B, T, H, Dqk) and x_v (B, T, H, Dv) (gradients, their magnitudes or tolerances) in the
// op's layout: kv_out (B, T, H, Dn + Dv) = [x_k's first Dn ; x_v]; rope_out (B, T, Dr) = sum over heads of x_k's
// last Dr columns, plus, when sum_slack > 0, sum_slack times the sum over heads of rope_mag's last Dr columns (the
// rounding of the op's FP32 sum over the heads, in tolerances).
static void gather_kv(double *kv_out, double *rope_out, const double *x_k, const double *x_v, const double *rope_mag,
                      double sum_slack, const AttCase *c) {
    const int N = c->B * c->T, H = c->H, Dn = c->Dn, Dr = c->Dr, Dv = c->Dv, Dqk = Dn + Dr, ld = Dn + Dv;
    for (int n = 0; n < N; n++) {
        for (int d = 0; d < Dr; d++) rope_out[(size_t)n * Dr + d] = 0.0;
        for (int h = 0; h < H; h++) {
            const double *k = x_k + ((size_t)n * H + h) * Dqk, *v = x_v + ((size_t)n * H + h) * Dv;
            double *row = kv_out + ((size_t)n * H + h) * ld;
            for (int d = 0; d < Dn; d++) row[d] = k[d];
            for (int d = 0; d < Dv; d++) row[Dn + d] = v[d];
            for (int d = 0; d < Dr; d++) {
                double *out = rope_out + (size_t)n * Dr + d;
                *out += k[Dn + d];
                if (sum_slack > 0) *out += sum_slack * rope_mag[((size_t)n * H + h) * Dqk + Dn + d];
            }
        }
    }
}

// Head h of x (B, T, H, D) -> out (B, T, 1, D).
static void take_head(float *out, const float *x, const AttCase *c, int h, int D) {
    for (int n = 0; n < c->B * c->T; n++)
        memcpy(out + (size_t)n * D, x + ((size_t)n * c->H + h) * D, sizeof(float) * (size_t)D);
}

// ---------------------------------------------------------------------------- the test
static void test_attention(void **state) {
    const AttCase *c = *state;
    const int B = c->B, T = c->T, H = c->H, Dn = c->Dn, Dr = c->Dr, Dv = c->Dv, Dqk = Dn + Dr, ld = Dn + Dv;
    char shape[64];
    snprintf(shape, sizeof shape, "(%d,%d,%d,%d+%d,%d)%s", B, T, H, Dn, Dr, Dv, c->mma_only ? " mma" : "");
    const int wgmma_before = cuda_attention_wgmma(!c->mma_only);
    const int64_t N = (int64_t)B * T, nq = N * H * Dqk, nkv = N * H * ld, nr = N * Dr, nv = N * H * Dv;
    const int64_t ns = (int64_t)B * H * T;  // the state's lse
    const int64_t n_state = attention_state_elems(DEVICE_CUDA, B, T, H, Dn, Dr, Dv);
    const uint64_t seed = (uint64_t)B * 1000003u + (uint64_t)T * 1009u + (uint64_t)Dn * 131u + (uint64_t)Dr * 31u +
                          (uint64_t)Dv;

    // the documented state sizes: CUDA's lse and, after it, the BF16 q, k (B, H, Tpad, DQP) and v (B, H, Tpad, DVP)
    // at 256-byte boundaries (Tpad = T up to 128, DQP and DVP up to 16; counted here from kernels.h's layout)
    {
        const int64_t Tpad = (T + 127) / 128 * 128, DQP = (Dqk + 15) / 16 * 16, DVP = (Dv + 15) / 16 * 16;
        const int64_t nq = (int64_t)B * H * Tpad * DQP * 2, nvb = (int64_t)B * H * Tpad * DVP * 2;
        const int64_t q_at = (ns * 4 + 255) / 256 * 256, k_at = (q_at + nq + 255) / 256 * 256;
        const int64_t v_at = (k_at + nq + 255) / 256 * 256;
        assert_int_equal(n_state, (v_at + nvb + 3) / 4);
    }
    const int64_t n_cpu_state = ns * T + nq + nkv + nr;  // the probabilities, then q, kv and k_rope (kernels.h)
    assert_int_equal(attention_state_elems(DEVICE_CPU, B, T, H, Dn, Dr, Dv), n_cpu_state);

    float *q = floats(nq), *kv = floats(nkv), *k_rope = floats(nr), *dout = floats(nv);
    float *dq0 = floats(nq), *dkv0 = floats(nkv), *dkr0 = floats(nr);
    opcheck_fill_nonzero(q, (size_t)nq, seed + 1, 0.1, 3.0);
    opcheck_fill_nonzero(kv, (size_t)nkv, seed + 2, 0.1, 1.0);
    opcheck_fill_nonzero(k_rope, (size_t)nr, seed + 5, 0.1, 1.0);
    opcheck_fill_nonzero(dout, (size_t)nv, seed + 4, 0.1, 1.0);
    // the backward writes its gradients: they start as NaN (poison), never read
    for (int64_t i = 0; i < nq; i++) dq0[i] = NAN;
    for (int64_t i = 0; i < nkv; i++) dkv0[i] = NAN;
    for (int64_t i = 0; i < nr; i++) dkr0[i] = NAN;
    const float *kr_in = Dr > 0 ? k_rope : NULL;  // kernels.h: k_rope is not read when Dr = 0

    // CPU reference op on the FP32 inputs
    float *c_out = floats(nv), *c_att = floats(n_cpu_state);
    float *c_dq = copy_floats(dq0, nq), *c_dkv = copy_floats(dkv0, nkv), *c_dkr = copy_floats(dkr0, nr);
    attention_forward(DEVICE_CPU, c_out, c_att, q, kv, kr_in, B, T, H, Dn, Dr, Dv);
    attention_backward(DEVICE_CPU, c_dq, c_dkv, c_dkr, dout, c_out, c_att, B, T, H, Dn, Dr, Dv);

    // f64 reference on the BF16-rounded inputs, per head, gathered into the op's layout
    float *qr = floats(nq), *kvr = floats(nkv), *krr = floats(nr), *dor = floats(nv);
    float *kh = floats(nq), *vh = floats(nv);
    for (int64_t i = 0; i < nq; i++) qr[i] = bf16_round(q[i]);
    for (int64_t i = 0; i < nkv; i++) kvr[i] = bf16_round(kv[i]);
    for (int64_t i = 0; i < nr; i++) krr[i] = bf16_round(k_rope[i]);
    for (int64_t i = 0; i < nv; i++) dor[i] = bf16_round(dout[i]);
    expand_kv(kh, vh, kvr, krr, c);
    Reference r;
    reference(&r, c, qr, kh, vh, dor);
    double *ref_dkv = doubles_zero(nkv), *ref_dkr = doubles_zero(nr), *mag_dkv = doubles_zero(nkv);
    double *mag_dkr = doubles_zero(nr);
    gather_kv(ref_dkv, ref_dkr, r.dk, r.dv, NULL, 0.0, c);
    gather_kv(mag_dkv, mag_dkr, r.m_dk, r.m_dv, NULL, 0.0, c);

    // GPU: out and state (with a tail that must stay untouched) poisoned
    const int64_t tail = 64;
    float *d_q = gpu_copy_of(q, nq), *d_kv = gpu_copy_of(kv, nkv), *d_kr = Dr > 0 ? gpu_copy_of(k_rope, nr) : NULL;
    float *d_dout = gpu_copy_of(dout, nv), *d_out = gpu_nan_floats(nv), *d_state = gpu_nan_floats(n_state + tail);
    float *d_dq = gpu_copy_of(dq0, nq), *d_dkv = gpu_copy_of(dkv0, nkv), *d_dkr = Dr > 0 ? gpu_copy_of(dkr0, nr) : NULL;
    attention_forward(DEVICE_CUDA, d_out, d_state, d_q, d_kv, d_kr, B, T, H, Dn, Dr, Dv);
    attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out, d_state, B, T, H, Dn, Dr, Dv);
    float *g_out = host_copy_of(d_out, nv), *g_state = host_copy_of(d_state, n_state + tail);
    float *g_dq = host_copy_of(d_dq, nq), *g_dkv = host_copy_of(d_dkv, nkv), *g_dkr = host_copy_of(d_dkr, nr);

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
    // d_kv takes dk's and dv's tolerances element for element; d_k_rope the sum of the heads' dk tolerances plus
    // 2 e_sum(H) sum_h Mdk (the FP32 sum over H heads, on the GPU and the CPU side alike)
    double *tol_dkv_ref = doubles_zero(nkv), *tol_dkv_cpu = doubles_zero(nkv);
    double *tol_dkr_ref = doubles_zero(nr), *tol_dkr_cpu = doubles_zero(nr);
    gather_kv(tol_dkv_ref, tol_dkr_ref, tol_dk_ref, tol_dv_ref, r.m_dk, 2 * e_sum(H), c);
    gather_kv(tol_dkv_cpu, tol_dkr_cpu, tol_dk_cpu, tol_dv_cpu, r.m_dk, 2 * e_sum(H), c);
    double *lse_mag = doubles_zero(ns);
    for (int64_t i = 0; i < ns; i++) lse_mag[i] = fabs(r.lse[i]) + 1.0;

    int ok = 1;
    ok &= check_output(shape, "out", g_out, c_out, r.out, tol_out_ref, tol_out_cpu, r.m_out, nv);
    ok &= check_output(shape, "lse", g_state, NULL, r.lse, tol_lse, NULL, lse_mag, ns);
    ok &= check_output(shape, "dq", g_dq, c_dq, r.dq, tol_dq_ref, tol_dq_cpu, r.m_dq, nq);
    ok &= check_output(shape, "d_kv", g_dkv, c_dkv, ref_dkv, tol_dkv_ref, tol_dkv_cpu, mag_dkv, nkv);
    if (Dr > 0) ok &= check_output(shape, "d_k_rope", g_dkr, c_dkr, ref_dkr, tol_dkr_ref, tol_dkr_cpu, mag_dkr, nr);
    int64_t tail_written = 0;
    for (int64_t i = n_state; i < n_state + tail; i++) tail_written += !isnan(g_state[i]);
    printf("%-24s %-30s %28s  %s\n", shape, "beyond attention_state_elems", tail_written ? "WRITTEN" : "untouched",
           tail_written ? "FAIL" : "ok");
    ok &= tail_written == 0;

    // determinism: the same calls again, bitwise
    float *d_out2 = gpu_nan_floats(nv), *d_state2 = gpu_nan_floats(n_state);
    attention_forward(DEVICE_CUDA, d_out2, d_state2, d_q, d_kv, d_kr, B, T, H, Dn, Dr, Dv);
    upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
    attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out2, d_state2, B, T, H, Dn, Dr, Dv);
    float *h_out2 = host_copy_of(d_out2, nv), *h_state2 = host_copy_of(d_state2, ns);
    float *h_dq2 = host_copy_of(d_dq, nq), *h_dkv2 = host_copy_of(d_dkv, nkv), *h_dkr2 = host_copy_of(d_dkr, nr);
    ok &= check_bitwise(shape, "repeat: out", g_out, h_out2, nv);
    ok &= check_bitwise(shape, "repeat: lse", g_state, h_state2, ns);
    ok &= check_bitwise(shape, "repeat: dq", g_dq, h_dq2, nq);
    ok &= check_bitwise(shape, "repeat: d_kv", g_dkv, h_dkv2, nkv);
    if (Dr > 0) ok &= check_bitwise(shape, "repeat: d_k_rope", g_dkr, h_dkr2, nr);

    // NULL gradients: the others are computed exactly as in the full call
    upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
    attention_backward(DEVICE_CUDA, d_dq, NULL, NULL, d_dout, d_out, d_state, B, T, H, Dn, Dr, Dv);
    attention_backward(DEVICE_CUDA, NULL, d_dkv, NULL, d_dout, d_out, d_state, B, T, H, Dn, Dr, Dv);
    attention_backward(DEVICE_CUDA, NULL, NULL, d_dkr, d_dout, d_out, d_state, B, T, H, Dn, Dr, Dv);
    float *h_dq3 = host_copy_of(d_dq, nq), *h_dkv3 = host_copy_of(d_dkv, nkv), *h_dkr3 = host_copy_of(d_dkr, nr);
    ok &= check_bitwise(shape, "dq alone", g_dq, h_dq3, nq);
    ok &= check_bitwise(shape, "d_kv alone", g_dkv, h_dkv3, nkv);
    if (Dr > 0) ok &= check_bitwise(shape, "d_k_rope alone", g_dkr, h_dkr3, nr);

    // The backward does not read q, kv and k_rope (kernels.h: the state holds what it needs, and MLA reuses their
    // memory): with them overwritten by NaN after the forward, the same gradients, bitwise.
    {
        float *nan_h = floats(nq > nkv ? nq : nkv);
        for (int64_t i = 0; i < (nq > nkv ? nq : nkv); i++) nan_h[i] = NAN;
        upload(d_q, nan_h, nq), upload(d_kv, nan_h, nkv);
        if (Dr > 0) upload(d_kr, nan_h, nr);
        upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
        attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out, d_state, B, T, H, Dn, Dr, Dv);
        float *h_dq4 = host_copy_of(d_dq, nq), *h_dkv4 = host_copy_of(d_dkv, nkv), *h_dkr4 = host_copy_of(d_dkr, nr);
        ok &= check_bitwise(shape, "inputs gone: dq", g_dq, h_dq4, nq);
        ok &= check_bitwise(shape, "inputs gone: d_kv", g_dkv, h_dkv4, nkv);
        if (Dr > 0) ok &= check_bitwise(shape, "inputs gone: d_k_rope", g_dkr, h_dkr4, nr);
        upload(d_q, q, nq), upload(d_kv, kv, nkv);
        if (Dr > 0) upload(d_kr, k_rope, nr);
        free(nan_h), free(h_dq4), free(h_dkv4), free(h_dkr4);
    }

    // BF16 products (MLA in fp8 mode): q (before RoPE) and kv as BF16 at padded row strides; the fused op must give
    // the bits of widening them, rope_forward on the query's rope part and attention_forward - out, every element
    // of the state (lse and the staged copies) and the gradients - with strides that allow 16-byte loads (pad 8)
    // and strides that do not (pad 3). k_rope is the (already rotated) FP32 one.
    for (int pad = 8; pad >= 3; pad -= 5) {
        const int64_t ldq = (int64_t)H * Dqk + pad, ldkv = (int64_t)H * ld + pad;
        const float theta = 10000.0f;
        uint16_t *q16 = malloc(sizeof(uint16_t) * (size_t)(N * ldq));
        uint16_t *kv16 = malloc(sizeof(uint16_t) * (size_t)(N * ldkv));
        float *qw = floats(nq), *kvw = floats(nkv);
        assert_non_null(q16), assert_non_null(kv16);
        for (int64_t n = 0; n < N; n++) {
            for (int64_t i = 0; i < ldq; i++) q16[n * ldq + i] = float_to_bf16(i < H * Dqk ? q[n * H * Dqk + i] : 7.0f);
            for (int64_t i = 0; i < ldkv; i++)
                kv16[n * ldkv + i] = float_to_bf16(i < H * ld ? kv[n * H * ld + i] : 7.0f);
            for (int64_t i = 0; i < H * Dqk; i++) qw[n * H * Dqk + i] = bf16_to_float(q16[n * ldq + i]);
            for (int64_t i = 0; i < H * ld; i++) kvw[n * H * ld + i] = bf16_to_float(kv16[n * ldkv + i]);
        }
        // the unfused path on the GPU: widened values, RoPE in place, the FP32 op
        upload(d_q, qw, nq), upload(d_kv, kvw, nkv);
        if (Dr > 0) rope_forward(DEVICE_CUDA, d_q + Dn, d_q + Dn, Dqk, B, T, H, Dr, theta);
        float *d_out5 = gpu_nan_floats(nv), *d_state5 = gpu_nan_floats(n_state);
        attention_forward(DEVICE_CUDA, d_out5, d_state5, d_q, d_kv, d_kr, B, T, H, Dn, Dr, Dv);
        upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
        attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out5, d_state5, B, T, H, Dn, Dr, Dv);
        float *w_out = host_copy_of(d_out5, nv), *w_state = host_copy_of(d_state5, n_state);
        float *w_dq = host_copy_of(d_dq, nq), *w_dkv = host_copy_of(d_dkv, nkv), *w_dkr = host_copy_of(d_dkr, nr);
        // the fused op
        uint16_t *d_q16 = device_alloc(DEVICE_CUDA, sizeof(uint16_t) * (size_t)(N * ldq));
        uint16_t *d_kv16 = device_alloc(DEVICE_CUDA, sizeof(uint16_t) * (size_t)(N * ldkv));
        device_memcpy_from_host(DEVICE_CUDA, d_q16, q16, sizeof(uint16_t) * (size_t)(N * ldq));
        device_memcpy_from_host(DEVICE_CUDA, d_kv16, kv16, sizeof(uint16_t) * (size_t)(N * ldkv));
        float *d_out6 = gpu_nan_floats(nv), *d_state6 = gpu_nan_floats(n_state);
        attention_forward_bf16(DEVICE_CUDA, d_out6, d_state6, d_q16, ldq, d_kv16, ldkv, d_kr, B, T, H, Dn, Dr, Dv,
                               theta);
        // and dout as BF16 at a padded stride too, against the FP32 backward on its widened values
        const int64_t ldo = (int64_t)H * Dv + pad;
        uint16_t *do16 = malloc(sizeof(uint16_t) * (size_t)(N * ldo));
        float *dow = floats(nv);
        assert_non_null(do16);
        for (int64_t n = 0; n < N; n++) {
            for (int64_t i = 0; i < ldo; i++)
                do16[n * ldo + i] = float_to_bf16(i < H * Dv ? dout[n * H * Dv + i] : 7.0f);
            for (int64_t i = 0; i < H * Dv; i++) dow[n * H * Dv + i] = bf16_to_float(do16[n * ldo + i]);
        }
        uint16_t *d_do16 = device_alloc(DEVICE_CUDA, sizeof(uint16_t) * (size_t)(N * ldo));
        device_memcpy_from_host(DEVICE_CUDA, d_do16, do16, sizeof(uint16_t) * (size_t)(N * ldo));
        upload(d_dout, dow, nv);
        upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
        attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out6, d_state6, B, T, H, Dn, Dr, Dv);
        float *v_dq = host_copy_of(d_dq, nq), *v_dkv = host_copy_of(d_dkv, nkv), *v_dkr = host_copy_of(d_dkr, nr);
        upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
        attention_backward_bf16(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_do16, ldo, d_out6, d_state6, B, T, H, Dn, Dr, Dv);
        float *b_dq = host_copy_of(d_dq, nq), *b_dkv = host_copy_of(d_dkv, nkv), *b_dkr = host_copy_of(d_dkr, nr);
        ok &= check_bitwise(shape, "  ... BF16 dout: dq", v_dq, b_dq, nq);
        ok &= check_bitwise(shape, "  ... BF16 dout: d_kv", v_dkv, b_dkv, nkv);
        if (Dr > 0) ok &= check_bitwise(shape, "  ... BF16 dout: d_k_rope", v_dkr, b_dkr, nr);
        upload(d_dout, dout, nv);
        device_free(DEVICE_CUDA, d_do16);
        free(do16), free(dow), free(v_dq), free(v_dkv), free(v_dkr), free(b_dq), free(b_dkv), free(b_dkr);
        upload(d_dq, dq0, nq), upload(d_dkv, dkv0, nkv), upload(d_dkr, dkr0, nr);
        attention_backward(DEVICE_CUDA, d_dq, d_dkv, d_dkr, d_dout, d_out6, d_state6, B, T, H, Dn, Dr, Dv);
        float *f_out = host_copy_of(d_out6, nv), *f_state = host_copy_of(d_state6, n_state);
        float *f_dq = host_copy_of(d_dq, nq), *f_dkv = host_copy_of(d_dkv, nkv), *f_dkr = host_copy_of(d_dkr, nr);
        char what5[40];
        snprintf(what5, sizeof what5, "BF16 products, pad %d: out", pad);
        ok &= check_bitwise(shape, what5, w_out, f_out, nv);
        ok &= check_bitwise(shape, "  ... state (lse, q, k, v)", w_state, f_state, n_state);
        ok &= check_bitwise(shape, "  ... dq", w_dq, f_dq, nq);
        ok &= check_bitwise(shape, "  ... d_kv", w_dkv, f_dkv, nkv);
        if (Dr > 0) ok &= check_bitwise(shape, "  ... d_k_rope", w_dkr, f_dkr, nr);
        upload(d_q, q, nq), upload(d_kv, kv, nkv);
        void *dev[] = {d_out5, d_state5, d_out6, d_state6, d_q16, d_kv16};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) device_free(DEVICE_CUDA, dev[i]);
        free(q16), free(kv16), free(qw), free(kvw), free(w_out), free(w_state), free(w_dq), free(w_dkv), free(w_dkr);
        free(f_out), free(f_state), free(f_dq), free(f_dkv), free(f_dkr);
    }

    // One head at a time (H = 1 calls on head h's q, kv and dout, the same k_rope): each head's blocks compute
    // exactly what they compute among H heads, so out and d_kv must match the H-head call's head h bitwise, and
    // d_k_rope must be the heads' rope-key gradients added on the host in head order from 0.0f - the kernels.h
    // contract, which pins the reduction's order (a single-head call's d_k_rope is 0 + g_h = g_h).
    {
        float *qh = floats(N * Dqk), *kvh = floats(N * ld), *doh = floats(N * Dv), *sum = floats(nr);
        float *d_qh = gpu_nan_floats(N * Dqk), *d_kvh = gpu_nan_floats(N * ld), *d_doh = gpu_nan_floats(N * Dv);
        float *d_oh = gpu_nan_floats(N * Dv), *d_dkvh = gpu_nan_floats(N * ld);
        float *d_sh = gpu_nan_floats(attention_state_elems(DEVICE_CUDA, B, T, 1, Dn, Dr, Dv));
        float *d_dkrh = Dr > 0 ? gpu_nan_floats(nr) : NULL;
        for (int64_t i = 0; i < nr; i++) sum[i] = 0.0f;
        int64_t differ_out = 0, differ_kv = 0;
        for (int h = 0; h < H; h++) {
            take_head(qh, q, c, h, Dqk), take_head(kvh, kv, c, h, ld), take_head(doh, dout, c, h, Dv);
            upload(d_qh, qh, N * Dqk), upload(d_kvh, kvh, N * ld), upload(d_doh, doh, N * Dv);
            attention_forward(DEVICE_CUDA, d_oh, d_sh, d_qh, d_kvh, d_kr, B, T, 1, Dn, Dr, Dv);
            attention_backward(DEVICE_CUDA, NULL, d_dkvh, d_dkrh, d_doh, d_oh, d_sh, B, T, 1, Dn, Dr, Dv);
            float *oh = host_copy_of(d_oh, N * Dv), *dkvh = host_copy_of(d_dkvh, N * ld);
            float *gh = host_copy_of(d_dkrh, nr);
            float *want_o = floats(N * Dv), *want_kv = floats(N * ld);
            take_head(want_o, g_out, c, h, Dv), take_head(want_kv, g_dkv, c, h, ld);
            for (int64_t i = 0; i < N * Dv; i++) differ_out += memcmp(&oh[i], &want_o[i], sizeof(float)) != 0;
            for (int64_t i = 0; i < N * ld; i++) differ_kv += memcmp(&dkvh[i], &want_kv[i], sizeof(float)) != 0;
            for (int64_t i = 0; i < nr; i++) sum[i] += gh[i];
            free(oh), free(dkvh), free(gh), free(want_o), free(want_kv);
        }
        printf("%-24s %-30s %28s  %s\n", shape, "per head: out", differ_out ? "differs" : "bitwise equal",
               differ_out ? "FAIL" : "ok");
        printf("%-24s %-30s %28s  %s\n", shape, "per head: d_kv", differ_kv ? "differs" : "bitwise equal",
               differ_kv ? "FAIL" : "ok");
        ok &= differ_out == 0 && differ_kv == 0;
        if (Dr > 0) ok &= check_bitwise(shape, "d_k_rope = sum of heads, in order", g_dkr, sum, nr);
        free(qh), free(kvh), free(doh), free(sum);
        void *dev[] = {d_qh, d_kvh, d_doh, d_oh, d_sh, d_dkvh, d_dkrh};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) device_free(DEVICE_CUDA, dev[i]);
    }

    // causality: change the key and value of position t* (kv at t*, every head, and k_rope at t*), rows before
    // t* must not move
    const int t_star = 2 * T / 3;
    float *kvp = copy_floats(kv, nkv), *krp = copy_floats(k_rope, nr);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            float *row = kvp + at4(c, b, t_star, h, ld);
            for (int d = 0; d < Dn; d++) row[d] += 0.75f;
            for (int d = 0; d < Dv; d++) row[Dn + d] -= 0.5f;
        }
        for (int d = 0; d < Dr; d++) krp[((size_t)b * T + t_star) * Dr + d] += 0.75f;
    }
    upload(d_kv, kvp, nkv), upload(d_kr, krp, nr), upload(d_dq, dq0, nq);
    attention_forward(DEVICE_CUDA, d_out2, d_state2, d_q, d_kv, d_kr, B, T, H, Dn, Dr, Dv);
    attention_backward(DEVICE_CUDA, d_dq, NULL, NULL, d_dout, d_out2, d_state2, B, T, H, Dn, Dr, Dv);
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

    void *host[] = {q, kv, k_rope, dout, dq0, dkv0, dkr0, c_out, c_att, c_dq, c_dkv, c_dkr, qr, kvr, krr, dor, kh, vh,
                    ref_dkv, ref_dkr, mag_dkv, mag_dkr, g_out, g_state, g_dq, g_dkv, g_dkr, tol_out_ref, tol_out_cpu,
                    tol_lse, tol_dq_ref, tol_dq_cpu, tol_dk_ref, tol_dk_cpu, tol_dv_ref, tol_dv_cpu, tol_dkv_ref,
                    tol_dkv_cpu, tol_dkr_ref, tol_dkr_cpu, lse_mag, h_out2, h_state2, h_dq2, h_dkv2, h_dkr2, h_dq3,
                    h_dkv3, h_dkr3, kvp, krp, h_out4, h_state4, h_dq4};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    free_reference(&r);
    void *dev[] = {d_q, d_kv, d_kr, d_dout, d_out, d_state, d_dq, d_dkv, d_dkr, d_out2, d_state2};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) device_free(DEVICE_CUDA, dev[i]);
    cuda_attention_wgmma(wgmma_before);
    assert_true(ok);
}

// ---------------------------------------------------------------------------- cases
// Query tiles are 128 rows in the forward and dq kernels (64 in dq when head dims are so large that 128
// rows do not fit in shared memory, e.g. 256/256), key tiles 64 rows, dk/dv blocks 64 keys; head dims are
// padded to 16 and accumulators sized 64/128/192/256. The shapes (B, T, H, Dn + Dr, Dv): one partial tile with
// tiny head dims (most warps of the block beyond T); several tiles with T not a multiple of 64; odd head dims in
// the 256 class with T = 129 (a second query tile of one row, and Dqk != Dv capacities in dk/dv); the largest
// head dims (dq's 64-row fallback, full 256 accumulators); the model's head dims (192 = 128 nope + 64 rope,
// Dv 128) over 4 query tiles of 128 with 16 heads summed into d_k_rope; head dims that are not multiples of 8 or
// 4 (Dn = 24, Dr = 8, Dv = 40: pre-pass chunks of 8 that are whole in each part; Dn = 13, Dr = 6, Dv = 20:
// chunks that straddle k_nope and k_rope, scalar reads of kv's unaligned v rows and element-wise stores of the
// odd windows of dk); no nope part (Dn = 0: every key the shared rope key) and no rope part (Dr = 0: k_rope NULL).
// On an H100/H200 the Hopper kernels (attention_wgmma.cu) serve padded head dims Dqk 128 or 192 with Dv 128: the
// model's shape, run a second time on the mma.sync kernels ("mma"); Dqk = 96 + 32 over partial query and key
// tiles (T = 300, B = 2); and Dqk = 190, Dv = 120, zero-padded to 192 and 128 inside the staged operands, over
// T = 333 with 3 heads. Every other shape runs the mma.sync kernels.
static AttCase case_tiny = {2, 37, 3, 8, 4, 8, 0};
static AttCase case_mid = {1, 200, 2, 32, 16, 32, 0};
static AttCase case_odd = {3, 129, 2, 136, 64, 72, 0};
static AttCase case_wide = {1, 300, 1, 192, 64, 256, 0};
static AttCase case_model = {1, 512, 16, 128, 64, 128, 0};
static AttCase case_split = {2, 100, 3, 24, 8, 40, 0};
static AttCase case_ragged = {2, 70, 5, 13, 6, 20, 0};
static AttCase case_no_nope = {1, 90, 4, 0, 32, 24, 0};
static AttCase case_no_rope = {1, 90, 3, 40, 0, 24, 0};
static AttCase case_model_mma = {1, 512, 16, 128, 64, 128, 1};
static AttCase case_wgmma_128 = {2, 300, 2, 96, 32, 128, 0};
static AttCase case_wgmma_padded = {2, 333, 3, 126, 64, 120, 0};

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
        cmocka_unit_test_prestate(test_attention, &case_split),
        cmocka_unit_test_prestate(test_attention, &case_ragged),
        cmocka_unit_test_prestate(test_attention, &case_no_nope),
        cmocka_unit_test_prestate(test_attention, &case_no_rope),
        cmocka_unit_test_prestate(test_attention, &case_model_mma),
        cmocka_unit_test_prestate(test_attention, &case_wgmma_128),
        cmocka_unit_test_prestate(test_attention, &case_wgmma_padded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
