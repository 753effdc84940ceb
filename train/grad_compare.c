/*
 * grad_compare.c - `fp8moe gradcompare` (see grad_compare.h): the first step's raw gradients of a job in each
 * precision mode, and per tensor their norms, cosines and norm ratios against the first mode's.
 *
 * Why one process and one train_step: the gradients are then exactly those the trainer's first step computes
 * (the same TrainState, the same step function, the same batch), and nothing else (an optimizer update, a
 * second batch, a reduction order of a parallel layout) differs between the modes. The modes run one after
 * the other, each mode's state freed before the next is built, so the memory is one model's plus two host
 * copies of the flat gradients: the reference's and the current mode's. Sums are in double.
 *
 * Order of the file: options, one mode's gradients, the statistics, the outputs, grad_compare_main.
 */
#include "train/cli.h"
#include "train/grad_compare.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data/durable.h"
#include "train/config.h"
#include "train/step.h"
#include "train/train_state.h"
#include "train/weights_io.h"

// The arms --modes takes: the three precision modes, and fp8 with one GEMM kind in BF16 (precision.bf16_fprop,
// bf16_dgrad, bf16_wgrad: docs/config.md), which tells which of the FP8 GEMMs a gradient difference comes from.
static const char *const mode_names[] = {"fp32",           "bf16",           "fp8",           "fp8+bf16_fprop",
                                         "fp8+bf16_dgrad", "fp8+bf16_wgrad", NULL};
#define MAX_MODES ((int)(sizeof mode_names / sizeof mode_names[0]) - 1)
#define PATHN (CONFIG_PATH_MAX + 64)

const char *const grad_compare_usage =
    "  fp8moe gradcompare JOB.ini [--modes fp32,bf16,fp8] [--weights FILE.h5] [--out FILE.csv]\n"
    "                     [--fprop-only PARTS] [--set section.key=value]...\n"
    "      One training step of JOB.ini's first global batch in each mode (default fp32,bf16,fp8; the\n"
    "      first is the reference, fp32 recommended), at the initial weights of train.seed or at FILE.h5's\n"
    "      (a weights.h5 of fp8moe train), in one process. Writes per parameter tensor and over all of\n"
    "      them the raw gradient's L2 norm in each mode, its cosine with the reference's and the norm\n"
    "      ratio to FILE.csv (default <checkpoint.dir>-gradcompare/grads.csv); prints each mode's global\n"
    "      norm, its overall cosine and ratio, and its worst tensor by cosine. Besides fp32, bf16 and fp8,\n"
    "      --modes takes fp8+bf16_fprop, fp8+bf16_dgrad and fp8+bf16_wgrad: fp8 with that GEMM kind in\n"
    "      BF16 (precision.bf16_*), to tell which FP8 GEMMs a difference comes from. --fprop-only PARTS\n"
    "      (with the fp8+bf16_fprop arm) puts only the Linears whose tensor names contain one of the\n"
    "      comma-separated PARTS (e.g. wq_b, or layers.2.attn.wq_a) in BF16 (precision.bf16_fprop_only).\n";

// ---------------------------------------------------------------------------- options

typedef struct {
    const char *job;
    const char *modes[MAX_MODES];
    int n_modes;
    const char *weights;  // NULL: the initial weights of train.seed
    const char *out;      // NULL: <checkpoint.dir>-gradcompare/grads.csv
    const char *fprop_only;  // NULL, or precision.bf16_fprop_only of the fp8+bf16_fprop arm
    const char **sets;
    int n_sets;
} Options;

// "fp32,bf16" -> modes, each of mode_names at most once, at least two. Returns 0 or the usage status (printed).
static int parse_modes(const char *list, Options *o) {
    char err[256];
    o->n_modes = config_parse_word_list(list, mode_names, o->modes, err, sizeof err);
    if (o->n_modes < 0) {
        fprintf(stderr, "fp8moe gradcompare: --modes %s: %s (e.g. fp32,bf16,fp8)\nUsage:\n%s", list, err, grad_compare_usage);
        return EXIT_USAGE;
    }
    if (o->n_modes < 2)
        return cli_usage_error("gradcompare", grad_compare_usage, "--modes %s: a comparison needs at least two modes (the first is the reference)", list);
    return 0;
}

// Returns 0, 1 when help was printed (exit 0), or the usage status (message printed).
static int parse_options(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    o->modes[0] = mode_names[0], o->modes[1] = mode_names[1], o->modes[2] = mode_names[2];  // fp32, bf16, fp8
    o->n_modes = 3;
    o->sets = calloc((size_t)argc + 1, sizeof *o->sets);
    if (!o->sets) {
        fprintf(stderr, "fp8moe gradcompare: out of memory\n");
        return EXIT_USAGE;
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const int takes_value = !strcmp(a, "--modes") || !strcmp(a, "--weights") || !strcmp(a, "--out") ||
                                !strcmp(a, "--fprop-only") || !strcmp(a, "--set");
        if (takes_value && i + 1 >= argc) return cli_usage_error("gradcompare", grad_compare_usage, "%s needs a value", a);
        const char *v = takes_value ? argv[++i] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", grad_compare_usage);
            return 1;
        } else if (!strcmp(a, "--modes")) {
            const int rc = parse_modes(v, o);
            if (rc) return rc;
        } else if (!strcmp(a, "--weights")) {
            struct stat st;
            if (stat(v, &st) != 0) {
                fprintf(stderr, "fp8moe gradcompare: --weights %s: %s; expected a weights.h5 that fp8moe train "
                        "wrote\nUsage:\n%s", v, strerror(errno), grad_compare_usage);
                return EXIT_USAGE;
            }
            if (!S_ISREG(st.st_mode)) return cli_usage_error("gradcompare", grad_compare_usage, "--weights %s: not a regular file; expected a weights.h5", v);
            o->weights = v;
        } else if (!strcmp(a, "--fprop-only")) {
            if (!v[0]) return cli_usage_error("gradcompare", grad_compare_usage, "--fprop-only needs tensor-name parts; got an empty string%s", "");
            o->fprop_only = v;
        } else if (!strcmp(a, "--out")) {
            if (!v[0]) return cli_usage_error("gradcompare", grad_compare_usage, "--out needs a file name; got an empty string%s", "");
            o->out = v;
        } else if (!strcmp(a, "--set") || !strncmp(a, "--set=", 6)) {
            const char *kv = v ? v : a + 6;
            if (!cli_is_override(kv)) return cli_usage_error("gradcompare", grad_compare_usage, "--set %s: expected section.key=value", kv);
            if (!strncmp(kv, "precision.mode=", 15))  // each mode's run sets it: the override would be lost
                return cli_usage_error("gradcompare", grad_compare_usage, "--set %s: precision.mode is set by --modes; give the modes there", kv);
            o->sets[o->n_sets++] = kv;
        } else if (a[0] == '-' && a[1] != '\0') {
            return cli_usage_error("gradcompare", grad_compare_usage, "unknown option %s", a);
        } else if (o->job) {
            return cli_usage_error("gradcompare", grad_compare_usage, "one job file expected; got a second one: %s", a);
        } else {
            o->job = a;
        }
    }
    if (!o->job) return cli_usage_error("gradcompare", grad_compare_usage, "missing the job file (JOB.ini)%s", "");
    return 0;
}

// ---------------------------------------------------------------------------- one mode's gradients

// One mode's step: the gradients' host copy and what the step itself reported.
typedef struct {
    real *grads;  // (n) the flat gradient buffer, on the host
    double loss;  // the step's loss (StepResult.loss)
} ModeGrads;

// The parameter table of the reference mode, kept after its state is freed: every mode must lay the flat
// buffer out the same way (the precision changes no shape).
typedef struct {
    ParamInfo *params;
    int n_params;
    int64_t n;  // elements of the flat buffer
    int64_t n_weights;
} GradLayout;

static int same_layout(const GradLayout *l, const Model *m) {
    if (m->n_params != l->n_params || m->n_dense_elems + m->n_expert_elems != l->n) return 0;
    for (int p = 0; p < l->n_params; p++)
        if (strcmp(m->params[p].name, l->params[p].name) || m->params[p].offset != l->params[p].offset ||
            m->params[p].numel != l->params[p].numel)
            return 0;
    return 1;
}

// Builds cfg's state (its precision.mode set), loads o->weights into its model when given, runs one step and
// copies the raw gradients to out->grads (allocated here). The first call fills *layout; later calls check
// against it. Returns 0, or 1 with the message printed.
static int mode_gradients(const Options *o, const Config *cfg, const char *mode, GradLayout *layout, ModeGrads *out) {
    char err[4096];
    int rc = 1;
    TrainState ts;
    memset(&ts, 0, sizeof ts);
    Device dev;
    printf("\n# gradcompare: precision %s\n", mode);
    if (train_state_pick_device(cfg, &dev) != 0) goto done;
    if (train_state_create(&ts, cfg, dev, NULL, cfg->train.steps, 0, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe gradcompare: %s: %s\n", mode, err);
        goto done;
    }
    Model *m = &ts.model;
    if (o->weights && weights_load(m, o->weights, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe gradcompare: %s\n", err);
        goto done;
    }
    if (!layout->params) {
        layout->n_params = m->n_params;
        layout->n = m->n_dense_elems + m->n_expert_elems;
        layout->n_weights = model_num_params(m);
        layout->params = malloc((size_t)m->n_params * sizeof *layout->params);
        if (!layout->params) goto done;
        memcpy(layout->params, m->params, (size_t)m->n_params * sizeof *layout->params);
    } else if (!same_layout(layout, m)) {
        fprintf(stderr, "fp8moe gradcompare: %s: the parameter table differs from the %s mode's; expected the same "
                "tensors at the same offsets in every mode\n", mode, o->modes[0]);
        goto done;
    }
    model_zero_load(m);  // as the trainer does before its first step
    StepResult sr;
    if (train_step(&ts, &sr, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe gradcompare: %s: %s\n", mode, err);
        goto done;
    }
    // train_step leaves the step's gradients as they were before the clip (the clip is AdamW's grad_scale)
    out->grads = malloc((size_t)layout->n * sizeof *out->grads);
    if (!out->grads) {
        fprintf(stderr, "fp8moe gradcompare: %s: out of memory for a host copy of %lld gradients\n", mode,
                (long long)layout->n);
        goto done;
    }
    device_memcpy_to_host(dev, out->grads, m->grads, (size_t)layout->n * sizeof *out->grads);
    out->loss = sr.loss;
    printf("gradcompare: %s: loss %.6f, gradient norm %.9g\n", mode, sr.loss, sr.grad_norm);
    rc = 0;
done:
    train_state_free(&ts);
    return rc;
}

// ---------------------------------------------------------------------------- statistics

// Of one mode against the reference over a range of the flat buffer: the squared norms and the dot product.
typedef struct {
    double ref_sq, sq, dot;
} Sums;

// Over [lo, lo + n): blocks of SUM_BLOCK elements summed one by one, in parallel, then the blocks' sums in order,
// so the numbers do not depend on the thread count. part: scratch of at least ceil(n / SUM_BLOCK) sums.
#define SUM_BLOCK 65536
static Sums range_sums(const real *ref, const real *g, int64_t lo, int64_t n, Sums *part) {
    const int64_t n_blocks = (n + SUM_BLOCK - 1) / SUM_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t end = lo + (b + 1) * SUM_BLOCK < lo + n ? lo + (b + 1) * SUM_BLOCK : lo + n;
        Sums s = {0, 0, 0};
        for (int64_t i = lo + b * SUM_BLOCK; i < end; i++) {
            const double x = (double)ref[i], y = (double)g[i];
            s.ref_sq += x * x, s.sq += y * y, s.dot += x * y;
        }
        part[b] = s;
    }
    Sums t = {0, 0, 0};
    for (int64_t b = 0; b < n_blocks; b++) t.ref_sq += part[b].ref_sq, t.sq += part[b].sq, t.dot += part[b].dot;
    return t;
}

// The cosine (NaN when the reference gradient is zero: undefined; 0 when only this mode's is) and the norm
// ratio (NaN when the reference's is zero).
static double sums_cosine(Sums s) {
    if (s.ref_sq == 0) return NAN;
    return s.sq == 0 ? 0.0 : s.dot / (sqrt(s.ref_sq) * sqrt(s.sq));
}
static double sums_ratio(Sums s) { return s.ref_sq == 0 ? NAN : sqrt(s.sq) / sqrt(s.ref_sq); }

// ---------------------------------------------------------------------------- outputs

// The role column, so that a reader can group the rows as the model does (routed experts and routers move most
// between modes: a token whose top-K choice flips takes its whole gradient from one expert to another).
static const char *role_name(ParamRole r) {
    switch (r) {
    case PARAM_BLOCK_LINEAR: return "block_linear";
    case PARAM_ROUTED_EXPERT: return "routed_expert";
    case PARAM_EMBEDDING: return "embedding";
    case PARAM_HEAD: return "head";
    case PARAM_ROUTER: return "router";
    case PARAM_NORM: return "norm";
    }
    return "?";
}

static void put_num(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, ",%.9g", x);
    else fputs(",", f);
}

// sums[k * rows + r]: mode k (k >= 1; k = 0 is unused) on row r (the tensors, then "all"). Returns 0, or -1
// with err.
static int write_csv(const char *path, const Options *o, const GradLayout *l, const Sums *sums, const double *ref_sq,
                     char *err, size_t err_size) {
    const int rows = l->n_params + 1;
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    FILE *f = d.f;
    fprintf(f, "tensor,role,numel,%s_norm", o->modes[0]);
    for (int k = 1; k < o->n_modes; k++) fprintf(f, ",%s_norm,%s_cos,%s_ratio", o->modes[k], o->modes[k], o->modes[k]);
    fputc('\n', f);
    for (int r = 0; r < rows; r++) {
        const int all = r == l->n_params;
        fprintf(f, "%s,%s,%lld", all ? "all" : l->params[r].name, all ? "all" : role_name(l->params[r].role),
                (long long)(all ? l->n : l->params[r].numel));
        put_num(f, sqrt(ref_sq[r]));
        for (int k = 1; k < o->n_modes; k++) {
            const Sums s = sums[k * rows + r];
            put_num(f, sqrt(s.sq));
            put_num(f, sums_cosine(s));
            put_num(f, sums_ratio(s));
        }
        fputc('\n', f);
    }
    return durable_commit(&d, err, err_size);
}

// The directory part of path made (mkdir -p). Returns 0, or -1 with err.
static int make_parent_dirs(const char *path, char *err, size_t err_size) {
    char dir[PATHN];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return 0;
    *slash = '\0';
    return durable_make_dirs(dir, err, err_size);
}

static void print_summary(const Options *o, const GradLayout *l, const Sums *sums, const double *ref_sq,
                          const ModeGrads *mg, const char *csv) {
    const int rows = l->n_params + 1;
    printf("\ngradcompare: %s, the first step's gradients at %s%s: %d tensors, %lld parameters; reference %s\n",
           o->job, o->weights ? "the weights of " : "the initial weights of train.seed", o->weights ? o->weights : "",
           l->n_params, (long long)l->n_weights, o->modes[0]);
    printf("  %-14s %10s %14s %10s %10s  %s\n", "mode", "loss", "grad norm", "cos(all)", "ratio(all)",
           "worst tensor by cosine");
    printf("  %-14s %10.6f %14.9g %10s %10s\n", o->modes[0], mg[0].loss, sqrt(ref_sq[l->n_params]), "-", "-");
    for (int k = 1; k < o->n_modes; k++) {
        int worst = -1;
        double worst_cos = INFINITY;
        for (int r = 0; r < l->n_params; r++) {
            const double c = sums_cosine(sums[k * rows + r]);
            if (isfinite(c) && c < worst_cos) worst = r, worst_cos = c;
        }
        const Sums all = sums[k * rows + l->n_params];
        printf("  %-14s %10.6f %14.9g %10.6f %10.6f  ", o->modes[k], mg[k].loss, sqrt(all.sq), sums_cosine(all),
               sums_ratio(all));
        if (worst >= 0)
            printf("%s: cos %.6f, ratio %.6f\n", l->params[worst].name, worst_cos, sums_ratio(sums[k * rows + worst]));
        else
            printf("(no tensor with a nonzero %s gradient)\n", o->modes[0]);
    }
    printf("wrote %s\n", csv);
}

// ---------------------------------------------------------------------------- command

int grad_compare_main(int argc, char **argv) {
    Options o;
    int rc = parse_options(argc, argv, &o);
    if (rc) {
        free(o.sets);
        return rc == 1 ? 0 : rc;
    }
    rc = 1;
    char err[4096];
    Config *cfgs[MAX_MODES] = {NULL};
    ModeGrads mg[MAX_MODES];
    memset(mg, 0, sizeof mg);
    GradLayout layout = {0};
    Sums *sums = NULL, *part = NULL;
    double *ref_sq = NULL;
    const char **ov = calloc((size_t)o.n_sets + 3, sizeof *ov);
    if (!ov) goto done;

    // Every mode's config first (the user's overrides, then precision.mode and for an fp8+bf16_<kind> arm
    // precision.bf16_<kind> = true), so that a bad key costs nothing.
    for (int i = 0; i < o.n_sets; i++) ov[i] = o.sets[i];
    char mode_set[MAX_MODES][2][40], only_set[CONFIG_PATH_MAX + 40] = "";
    int has_fprop_arm = 0;
    for (int k = 0; k < o.n_modes; k++) has_fprop_arm |= !strcmp(o.modes[k], "fp8+bf16_fprop");
    if (o.fprop_only && !has_fprop_arm) {
        rc = cli_usage_error("gradcompare", grad_compare_usage, "--fprop-only %s: expected with the fp8+bf16_fprop arm in "
                             "--modes (it narrows that arm's BF16 Fprops)", o.fprop_only);
        goto done;
    }
    if (o.fprop_only) snprintf(only_set, sizeof only_set, "precision.bf16_fprop_only=%s", o.fprop_only);
    for (int k = 0; k < o.n_modes; k++) {
        const char *plus = strchr(o.modes[k], '+');
        snprintf(mode_set[k][0], sizeof mode_set[k][0], "precision.mode=%.*s",
                 plus ? (int)(plus - o.modes[k]) : (int)strlen(o.modes[k]), o.modes[k]);
        ov[o.n_sets] = mode_set[k][0];
        int n_ov = o.n_sets + 1;
        if (plus) {
            snprintf(mode_set[k][1], sizeof mode_set[k][1], "precision.%s=true", plus + 1);
            ov[n_ov++] = mode_set[k][1];
            if (o.fprop_only && !strcmp(plus + 1, "bf16_fprop")) ov[n_ov++] = only_set;
        }
        cfgs[k] = malloc(sizeof *cfgs[k]);
        if (!cfgs[k]) goto done;
        if (config_load(cfgs[k], o.job, ov, n_ov, err, sizeof err) != 0) {
            fprintf(stderr, "%s\n", err);
            rc = EXIT_USAGE;
            goto done;
        }
    }
    const Config *cfg = cfgs[0];
    if (cfg->parallel.pp > 1 || cfg->parallel.dp > 1 || cfg->parallel.ep > 1) {
        fprintf(stderr, "fp8moe gradcompare: %s: parallel.pp = %d, dp = %d, ep = %d: gradcompare runs one process; "
                "expected 1, 1, 1 (--set parallel.pp=1 --set parallel.dp=1 --set parallel.ep=1; with dp = 1 the "
                "global batch is one rank's)\n", cfg->path, cfg->parallel.pp, cfg->parallel.dp, cfg->parallel.ep);
        rc = EXIT_USAGE;
        goto done;
    }
    char csv[PATHN];
    if (o.out) snprintf(csv, sizeof csv, "%s", o.out);
    else snprintf(csv, sizeof csv, "%s-gradcompare/grads.csv", cfg->checkpoint.dir);
    if (make_parent_dirs(csv, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe gradcompare: %s\n", err);
        goto done;
    }
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);

    // The reference, then each other mode against it: only the reference's host copy is kept.
    for (int k = 0; k < o.n_modes; k++) {
        if (mode_gradients(&o, cfgs[k], o.modes[k], &layout, &mg[k]) != 0) goto done;
        const int rows = layout.n_params + 1;
        if (k == 0) {
            sums = calloc((size_t)(o.n_modes * rows), sizeof *sums);
            ref_sq = calloc((size_t)rows, sizeof *ref_sq);
            part = malloc((size_t)(layout.n / SUM_BLOCK + 1) * sizeof *part);
            if (!sums || !ref_sq || !part) goto done;
            const real *g = mg[0].grads;
            for (int r = 0; r < layout.n_params; r++)
                ref_sq[r] = range_sums(g, g, layout.params[r].offset, layout.params[r].numel, part).ref_sq;
            ref_sq[layout.n_params] = range_sums(g, g, 0, layout.n, part).ref_sq;
            continue;
        }
        for (int r = 0; r < layout.n_params; r++)
            sums[k * rows + r] = range_sums(mg[0].grads, mg[k].grads, layout.params[r].offset, layout.params[r].numel,
                                            part);
        sums[k * rows + layout.n_params] = range_sums(mg[0].grads, mg[k].grads, 0, layout.n, part);
        free(mg[k].grads);
        mg[k].grads = NULL;
    }
    if (write_csv(csv, &o, &layout, sums, ref_sq, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe gradcompare: %s\n", err);
        goto done;
    }
    print_summary(&o, &layout, sums, ref_sq, mg, csv);
    rc = 0;
done:
    for (int k = 0; k < MAX_MODES; k++) {
        free(cfgs[k]);
        free(mg[k].grads);
    }
    free(layout.params);
    free(sums);
    free(part);
    free(ref_sq);
    free(ov);
    free(o.sets);
    return rc;
}
