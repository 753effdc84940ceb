/*
 * test_gradcheck.c - the model's analytic gradients against central finite differences.
 *
 * Built twice from the same sources (Makefile): $(BUILD)/gradcheck with real = double, which does the
 * finite-difference check, and $(BUILD)/gradcheck_f32 with real = float, which only dumps its analytic
 * gradients so the double build can compare them (tests/unit/gradcheck.sh runs both).
 *
 * Setup: configs/tiny.ini split into two chunks (so the hidden-state hand-off between chunks is
 * differentiated too), random tokens, weights with a larger init and randomised norm weights and router
 * biases so that every path is exercised. Routing is recorded once and then held fixed (top-K choices,
 * hence the group mask, and the balance loss' top-K indicators): with routing fixed the loss is smooth.
 * Each loss term is checked on its own (main CE, each MTP depth, the balance loss with alpha = 1):
 *   |g_a - g_n| <= 1e-5 * max(|g_a|, |g_n|) + 1e-8
 * on all entries of tensors with fewer than 256 and 32 random entries of the others. A tensor that the
 * term structurally cannot reach must have an exactly zero gradient; every other tensor's checked
 * gradient must have norm > 1e-6 (not vacuous). The negative control perturbs swiglu_backward by 0.1%
 * (kernels_debug_perturb) and requires the check to fail.
 *
 * Usage: gradcheck [--dump FILE] [--compare FILE]   (from the repository root)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/rng.h"
#include "train/config.h"
#include "train/model.h"

enum { B = 3, T = 8, N_SAMPLE = 32, ALL_BELOW = 256 };

typedef struct {
    Model m;
    ChunkActs *acts[2];
    real *hidden, *d_hidden;  // (B*T, D) hand-off between the two chunks
    int inputs[B * T], targets[B * T];
} Setup;

static int failures = 0, checks = 0;
#define EXPECT(cond, ...)                                \
    do {                                                 \
        checks++;                                        \
        if (!(cond)) {                                   \
            failures++;                                  \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);  \
            printf(__VA_ARGS__);                         \
            printf("\n");                                \
        }                                                \
    } while (0)

static real forward(Setup *s) {
    real loss = chunk_forward(&s->m, 0, s->acts[0], s->inputs, s->targets, NULL, s->hidden);
    loss += chunk_forward(&s->m, 1, s->acts[1], s->inputs, s->targets, s->hidden, NULL);
    return loss;
}

static void forward_backward(Setup *s) {
    model_zero_grads(&s->m);
    forward(s);
    chunk_backward(&s->m, 1, s->acts[1], NULL, s->d_hidden, 1);
    chunk_backward(&s->m, 0, s->acts[0], s->d_hidden, NULL, 1);
}

static void setup(Setup *s) {
    Config cfg;
    char err[1024];
    // a 64-token vocabulary keeps the head cheap: the check runs ~25,000 forward passes
    const char *overrides[] = {"moe.balance_loss_alpha=1", "train.seq_len=8", "train.micro_batch_size=3",
                               "model.vocab_size=64"};
    if (config_load(&cfg, "configs/tiny.ini", overrides, 4, err, sizeof err) != 0) {
        fprintf(stderr, "gradcheck: %s\n", err);
        exit(1);
    }
    cfg.model.init_std = 0.3;  // larger weights: nonlinearities matter, gradients well above FD noise
    if (model_create(&s->m, &cfg, DEVICE_CPU, 2, err, sizeof err) != 0) {
        fprintf(stderr, "gradcheck: %s\n", err);
        exit(1);
    }
    // seed 11: every expert of every MoE layer gets tokens from the model of configs/tiny.ini (seed 8 left
    // two experts empty once initial values were keyed by tensor name)
    uint64_t key = rng_key(11, 0x4752414443484bULL, 0, 0);
    uint64_t ctr = 0;
    for (int i = 0; i < s->m.n_params; i++) {  // norm weights away from 1
        const ParamInfo *p = &s->m.params[i];
        if (!p->no_decay) continue;
        for (int64_t j = 0; j < p->numel; j++) s->m.weights[p->offset + j] = (real)(1 + 0.3 * rng_normal(key, ctr++));
    }
    int E = cfg.moe.n_routed_experts;
    for (int j = 0; j < s->m.n_moe_layers * E; j++) s->m.router_bias[j] = (real)(0.05 * rng_normal(key, ctr++));
    for (int i = 0; i < B * T; i++) s->inputs[i] = (int)(rng_u64(key, ctr++) % (uint64_t)cfg.model.vocab_size);
    for (int b = 0; b < B; b++) {  // a sequence: targets are the inputs shifted by one
        for (int t = 0; t < T - 1; t++) s->targets[b * T + t] = s->inputs[b * T + t + 1];
        s->targets[b * T + T - 1] = (int)(rng_u64(key, ctr++) % (uint64_t)cfg.model.vocab_size);
    }
    for (int c = 0; c < 2; c++) s->acts[c] = chunk_acts_create(&s->m, c, B, T);
    s->hidden = calloc((size_t)B * T * cfg.model.dim, sizeof(real));
    s->d_hidden = calloc((size_t)B * T * cfg.model.dim, sizeof(real));
    // record the routing once, then hold it fixed; every expert must get tokens or its check is vacuous
    s->m.count_load = 1;
    forward(s);
    s->m.count_load = 0;
    s->m.freeze_routing = 1;
    for (int j = 0; j < s->m.n_moe_layers * E; j++)
        EXPECT(s->m.expert_load[j] > 0, "MoE layer %d expert %d got no tokens: change the seed", j / E, j % E);
}

// Can loss term `term` (0 = main, 1.. = MTP depth, -1 = balance) reach tensor `name` at all?
static int reachable(int term, const char *name) {
    int is_mtp = strncmp(name, "mtp.", 4) == 0;
    if (term == 0) return !is_mtp;  // the main CE never sees the MTP modules
    if (term > 0) return 1;         // MTP depth 1 sees everything (D = 1 in tiny.ini)
    // balance: only what feeds a router. The head, the last MTP norm and the MTP block's experts come
    // after the last router.
    if (strcmp(name, "head.weight") == 0 || strcmp(name, "mtp.0.norm.weight") == 0) return 0;
    if (strstr(name, "mtp.0.block.ffn.experts.") || strstr(name, "mtp.0.block.ffn.shared_experts.")) return 0;
    return 1;
}

// Checks one loss term; returns the number of entries that failed the tolerance.
static int check_term(Setup *s, int term, const char *label, int only_param, int verbose) {
    Model *m = &s->m;
    memset(&m->loss_weights, 0, sizeof m->loss_weights);
    if (term == 0) m->loss_weights.main = 1;
    else if (term > 0) m->loss_weights.mtp[term - 1] = 1;
    else m->loss_weights.balance = 1;
    forward_backward(s);
    int64_t n = model_num_params(m);
    real *ga = malloc((size_t)n * sizeof(real));
    memcpy(ga, m->grads, (size_t)n * sizeof(real));
    uint64_t key = rng_key(11, (uint64_t)(term + 5), 0, 0);
    int bad = 0, n_checked = 0;
    double worst = 0;
    for (int i = 0; i < m->n_params; i++) {
        if (only_param >= 0 && i != only_param) continue;
        const ParamInfo *p = &m->params[i];
        int count = p->numel < ALL_BELOW ? (int)p->numel : N_SAMPLE;
        double norm2 = 0, any = 0;
        for (int j = 0; j < count; j++) {
            int64_t idx = p->numel < ALL_BELOW ? j : (int64_t)(rng_u64(key, (uint64_t)(i * 1000 + j)) % (uint64_t)p->numel);
            real *w = &m->weights[p->offset + idx];
            real saved = *w, eps = (real)1e-5 * (fabs(saved) > 1 ? fabs(saved) : 1);
            *w = saved + eps;
            double lp = forward(s);
            *w = saved - eps;
            double lm = forward(s);
            *w = saved;
            double gn = (lp - lm) / (2 * (double)eps), g = ga[p->offset + idx];
            double err = fabs(g - gn), tol = 1e-5 * fmax(fabs(g), fabs(gn)) + 1e-8;
            if (err > tol) {
                bad++;
                if (verbose && bad <= 10)
                    printf("  %s %s[%ld]: analytic %.10e numeric %.10e\n", label, p->name, (long)idx, g, gn);
            }
            double rel = err / (fabs(gn) + 1e-8);
            if (rel > worst) worst = rel;
            norm2 += g * g;
            any = fmax(any, fabs(g));
            n_checked++;
        }
        if (only_param >= 0) continue;
        if (reachable(term, p->name))
            EXPECT(sqrt(norm2) > 1e-6, "%s: %s gradient is vacuous (norm %.3e)", label, p->name, sqrt(norm2));
        else
            EXPECT(any == 0, "%s: %s cannot reach this loss but has gradient %.3e", label, p->name, any);
    }
    if (verbose) printf("%-10s %6d entries checked, %d outside tolerance, max rel err %.2e\n", label, n_checked, bad, worst);
    free(ga);
    return bad;
}

// The full training objective's analytic gradient, as doubles.
static double *full_gradient(Setup *s) {
    Model *m = &s->m;
    m->loss_weights.main = 1;
    for (int k = 0; k < m->cfg.mtp.depth; k++) m->loss_weights.mtp[k] = (real)(m->cfg.mtp.loss_weight / m->cfg.mtp.depth);
    m->loss_weights.balance = 1;
    forward_backward(s);
    int64_t n = model_num_params(m);
    double *g = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) g[i] = (double)m->grads[i];
    return g;
}

int main(int argc, char **argv) {
    const char *dump = NULL, *compare = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dump") == 0 && i + 1 < argc) dump = argv[++i];
        else if (strcmp(argv[i], "--compare") == 0 && i + 1 < argc) compare = argv[++i];
        else { fprintf(stderr, "usage: gradcheck [--dump FILE] [--compare FILE]\n"); return 2; }
    }
    Setup s;
    memset(&s, 0, sizeof s);
    setup(&s);
    int64_t n = model_num_params(&s.m);
    if (dump) {  // the FP32 build: write the full objective's gradient
        double *g = full_gradient(&s);
        FILE *f = fopen(dump, "wb");
        EXPECT(f && fwrite(&n, sizeof n, 1, f) == 1 && fwrite(g, sizeof(double), (size_t)n, f) == (size_t)n,
               "cannot write %s", dump);
        if (f) fclose(f);
        free(g);
        printf("gradcheck (%s): wrote %ld gradients to %s\n", sizeof(real) == 8 ? "double" : "float", (long)n, dump);
    } else {
        if (sizeof(real) != 8) { fprintf(stderr, "gradcheck: the finite-difference check needs the double build\n"); return 2; }
        char label[32];
        EXPECT(check_term(&s, 0, "main", -1, 1) == 0, "main CE gradients outside tolerance");
        for (int k = 1; k <= s.m.cfg.mtp.depth; k++) {
            snprintf(label, sizeof label, "mtp%d", k);
            EXPECT(check_term(&s, k, label, -1, 1) == 0, "MTP depth %d gradients outside tolerance", k);
        }
        EXPECT(check_term(&s, -1, "balance", -1, 1) == 0, "balance loss gradients outside tolerance");
        // negative control: a 0.1% error in one backward op must be caught
        kernels_debug_perturb("swiglu_backward", 1e-3);
        const ParamInfo *p = model_find_param(&s.m, "layers.0.ffn.w1.weight");
        int bad = check_term(&s, 0, "perturbed", (int)(p - s.m.params), 0);
        kernels_debug_perturb(NULL, 0);
        printf("negative control: swiglu_backward perturbed by 0.1%% -> %d of %d entries of %s fail\n", bad,
               p->numel < ALL_BELOW ? (int)p->numel : N_SAMPLE, p->name);
        EXPECT(bad > 0, "the check did not notice a 0.1%% error in swiglu_backward");
        if (compare) {  // FP32 gradients against these double ones, tensor by tensor
            double *g64 = full_gradient(&s), *g32 = malloc((size_t)n * sizeof(double));
            int64_t n32 = 0;
            FILE *f = fopen(compare, "rb");
            int ok = f && fread(&n32, sizeof n32, 1, f) == 1 && n32 == n && fread(g32, sizeof(double), (size_t)n, f) == (size_t)n;
            EXPECT(ok, "cannot read %ld gradients from %s", (long)n, compare);
            if (f) fclose(f);
            double worst = 0;
            for (int i = 0; ok && i < s.m.n_params; i++) {
                const ParamInfo *pi = &s.m.params[i];
                double maxabs = 0, maxerr = 0;
                for (int64_t j = pi->offset; j < pi->offset + pi->numel; j++) {
                    maxabs = fmax(maxabs, fabs(g64[j]));
                    maxerr = fmax(maxerr, fabs(g64[j] - g32[j]));
                }
                double rel = maxabs > 0 ? maxerr / maxabs : maxerr;
                worst = fmax(worst, rel);
                EXPECT(rel <= 1e-3, "%s: FP32 gradient differs from double by %.2e (relative to its max)", pi->name, rel);
            }
            printf("float vs double: worst per-tensor max|g32 - g64| / max|g64| = %.2e (limit 1e-3)\n", worst);
            free(g64);
            free(g32);
        }
    }
    for (int c = 0; c < 2; c++) chunk_acts_free(s.acts[c]);
    free(s.hidden);
    free(s.d_hidden);
    model_free(&s.m);
    printf("gradcheck: %d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
