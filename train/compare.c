/*
 * compare.c - `fp8moe compare` (see compare.h): a job trained in each precision mode over seeds, and the
 * relative loss gaps of every mode against the first one.
 *
 * Why child processes: a run is then exactly `fp8moe train JOB --set ...` (same code path, same
 * numbers, its own log and run directory, no state carried from one run to the next, CUDA set up fresh
 * in each), and up to --jobs of them can run side by side. The parent validates every run's config
 * before the first one starts (a typo costs nothing), then reads each run's metrics.jsonl.
 *
 * Order of the file: options, the runs (overrides, spawning, waiting, reading metrics), the statistics,
 * the outputs (compare.csv, compare_windows.csv, summary.txt, compare.gp -> compare.png), compare_main.
 * Gap of mode m at step s and seed k: (L_m - L_first) / L_first, L the training loss of that step or the
 * validation loss of an evaluation at that step; over seeds: mean and sample standard deviation.
 */
#include "train/cli.h"
#include "train/compare.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "data/durable.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/metrics.h"

#define MAX_ARMS 4         // fp32, bf16, fp8 and the null arm
#define MAX_SEEDS 1000
#define MAX_JOBS 64
#define NULL_LR_FACTOR 1.0001  // the null arm: the first mode with optim.lr changed by 1 in 10,000
#define PATHN (CONFIG_PATH_MAX + 64)

const char *const compare_usage =
    "  fp8moe compare JOB.ini [--modes bf16,fp8[,fp32]] [--seeds N] [--steps N] [--out DIR]\n"
    "                 [--null] [--fork STEP] [--jobs N] [--resume] [--no-plot] [--set section.key=value]...\n"
    "      Train JOB.ini once per mode (default bf16,fp8) and seed (train.seed, +1, ... N seeds; default\n"
    "      1), the same initial weights and data order in every mode, each run a child `fp8moe train`\n"
    "      into DIR/<mode>-seed<S>/ (DIR default <checkpoint.dir>-compare). Then writes DIR/compare.csv\n"
    "      (per step: each run's train and val loss, the relative gaps vs the first mode, their mean and\n"
    "      sd over seeds), DIR/compare.png (gnuplot) and DIR/summary.txt (printed too): the mean val gap\n"
    "      over the last 10% of steps +- sd over seeds, the max gap, the first step where the gap leaves\n"
    "      its seed spread. --steps overrides train.steps; --null adds the first mode with optim.lr x\n"
    "      1.0001 (the null spread); --jobs runs N trainings at once (CPU threads split between them);\n"
    "      --fork STEP trains the first mode alone to STEP (DIR/trunk-seed<S>/, train.stop_after) and starts\n"
    "      every mode, the first and the null arm included, from its checkpoint there, so that the runs part\n"
    "      only after STEP (docs/fp8.md: a shorter early phase in common lowers the run-to-run spread);\n"
    "      --resume keeps finished runs whose config is unchanged and continues unfinished ones from their\n"
    "      last checkpoint when the job writes them (checkpoint.every_steps); --no-plot skips compare.png.\n";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---------------------------------------------------------------------------- options

typedef struct {
    const char *job;
    const char *modes[3];
    int n_modes;
    int seeds;
    int steps;  // 0 = the job's train.steps
    int fork;   // --fork STEP; 0 = every run from step 0
    const char *out;
    int null_arm, jobs, resume, plot;
    const char **sets;
    int n_sets;
} Options;

static int parse_count(const char *opt, const char *v, int lo, int hi, int *out) {
    if (cli_parse_int(v, lo, hi, out)) {
        fprintf(stderr, "fp8moe compare: %s %s: expected an integer from %d to %d\nUsage:\n%s", opt, v, lo, hi,
                compare_usage);
        return -1;
    }
    return 0;
}

// "bf16,fp8" -> modes; each of fp32, bf16, fp8 at most once. Returns 0 or the usage status (printed).
static int parse_modes(const char *list, Options *o) {
    char err[160];
    o->n_modes = config_parse_mode_list(list, o->modes, err, sizeof err);
    if (o->n_modes < 0) {
        fprintf(stderr, "fp8moe compare: --modes %s: %s (e.g. bf16,fp8)\nUsage:\n%s", list, err, compare_usage);
        return EXIT_USAGE;
    }
    return 0;
}

// Returns 0, 1 when help was printed (exit 0), or the usage status (message printed).
static int parse_options(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    o->modes[0] = "bf16";
    o->modes[1] = "fp8";
    o->n_modes = 2;
    o->seeds = 1;
    o->jobs = 1;
    o->plot = 1;
    o->sets = calloc((size_t)argc + 1, sizeof *o->sets);
    if (!o->sets) return 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int takes_value = !strcmp(a, "--modes") || !strcmp(a, "--seeds") || !strcmp(a, "--steps") ||
                          !strcmp(a, "--out") || !strcmp(a, "--jobs") || !strcmp(a, "--set") || !strcmp(a, "--fork");
        if (takes_value && i + 1 >= argc) return cli_usage_error("compare", compare_usage, "%s needs a value", a);
        const char *v = takes_value ? argv[++i] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("Usage:\n%s", compare_usage);
            return 1;
        } else if (!strcmp(a, "--modes")) {
            int rc = parse_modes(v, o);
            if (rc) return rc;
        } else if (!strcmp(a, "--seeds")) {
            if (parse_count(a, v, 1, MAX_SEEDS, &o->seeds)) return EXIT_USAGE;
        } else if (!strcmp(a, "--steps")) {
            if (parse_count(a, v, 1, 100000000, &o->steps)) return EXIT_USAGE;
        } else if (!strcmp(a, "--fork")) {
            if (parse_count(a, v, 1, 100000000, &o->fork)) return EXIT_USAGE;
        } else if (!strcmp(a, "--jobs")) {
            if (parse_count(a, v, 1, MAX_JOBS, &o->jobs)) return EXIT_USAGE;
        } else if (!strcmp(a, "--out")) {
            if (!v[0]) return cli_usage_error("compare", compare_usage, "--out needs a directory; got an empty string%s", "");
            o->out = v;
        } else if (!strcmp(a, "--set") || !strncmp(a, "--set=", 6)) {
            const char *kv = v ? v : a + 6;
            if (!cli_is_override(kv)) return cli_usage_error("compare", compare_usage, "--set %s: expected section.key=value", kv);
            o->sets[o->n_sets++] = kv;
        } else if (!strcmp(a, "--null")) {
            o->null_arm = 1;
        } else if (!strcmp(a, "--resume")) {
            o->resume = 1;
        } else if (!strcmp(a, "--no-plot")) {
            o->plot = 0;
        } else if (a[0] == '-' && a[1] != '\0') {
            return cli_usage_error("compare", compare_usage, "unknown option %s", a);
        } else if (o->job) {
            return cli_usage_error("compare", compare_usage, "one job file expected; got a second one: %s", a);
        } else {
            o->job = a;
        }
    }
    if (!o->job) return cli_usage_error("compare", compare_usage, "missing the job file (JOB.ini)%s", "");
    if (o->n_modes + o->null_arm < 2)
        return cli_usage_error("compare", compare_usage, "--modes %s: a comparison needs at least two modes (or one mode and --null)",
                           o->modes[0]);
    return 0;
}

// ---------------------------------------------------------------------------- runs

typedef struct {
    char name[16];       // "bf16", "fp8", "bf16-null"
    const char *mode;
    int is_null;
} Arm;

typedef struct Run Run;
struct Run {
    int arm, seed_index; // arm -1: a --fork trunk
    int last_step;       // the step the run ends at: the comparison's steps, or --fork's for a trunk
    Run *trunk;          // --fork: the run whose checkpoint this one starts from (NULL: from step 0)
    uint64_t seed;
    char dir[PATHN];
    char **args;         // argv of the child: fp8moe train JOB --set ... (NULL-terminated)
    char *config_text;   // the resolved config, as DIR/<run>/compare-job.ini holds it
    pid_t pid;
    double t0;
    int state;           // 0 pending, 1 running, 2 finished (complete), 3 ended without finishing
    int continues;       // --resume: the child continues from the run's checkpoint (train --resume latest)
    double *train, *val; // [steps + 1], NaN where the run has no record
    int n_train, last_val_step;
};

// The running children, for the signal handler (which forwards SIGTERM: a terminal's Ctrl-C reaches
// them anyway, a `kill` or `timeout` of this process does not).
static volatile sig_atomic_t stop_requested = 0;
static pid_t running_pids[MAX_JOBS];

static void on_stop_signal(int sig) {
    if (stop_requested) {
        for (int i = 0; i < MAX_JOBS; i++)
            if (running_pids[i] > 0) kill(running_pids[i], SIGKILL);
        static const char msg[] = "\nfp8moe compare: second interrupt, stopping the runs now\n";
        ssize_t r = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)r;
        _exit(130);
    }
    stop_requested = 1;
    if (sig == SIGTERM)
        for (int i = 0; i < MAX_JOBS; i++)
            if (running_pids[i] > 0) kill(running_pids[i], SIGTERM);
    static const char msg[] = "\nfp8moe compare: interrupt: the running trainings finish their step and stop; "
                              "no further run starts (interrupt again to quit now)\n";
    ssize_t r = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)r;
}

static char *xstrdup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xstrdup_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0) s = NULL;
    va_end(ap);
    if (!s) {
        fprintf(stderr, "fp8moe compare: out of memory\n");
        exit(1);
    }
    return s;
}

// The resolved config as config_print writes it (malloc'd).
static char *config_text(const Config *c) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return xstrdup_printf("%s", "");
    config_print(c, f);
    fclose(f);
    return buf;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    if (!m) {
        fclose(f);
        return NULL;
    }
    char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) fwrite(chunk, 1, n, m);
    fclose(f);
    fclose(m);
    return buf;
}

// Value of "key": in a JSON line (key given with its quotes and colon); NaN when absent or null.
static double json_number(const char *line, const char *key) {
    const char *p = strstr(line, key);
    if (!p) return NAN;
    p += strlen(key);
    if (!strncmp(p, "null", 4)) return NAN;
    char *end;
    double v = strtod(p, &end);
    return end == p ? NAN : v;
}

// Reads a run's metrics.jsonl into r->train / r->val (steps 1..steps). Returns 0, or -1 with err set.
static int read_metrics(Run *r, int steps, char *err, size_t err_size) {
    char path[PATHN + 16];
    snprintf(path, sizeof path, "%s/metrics.jsonl", r->dir);
    for (int s = 0; s <= steps; s++) r->train[s] = r->val[s] = NAN;
    r->n_train = 0;
    r->last_val_step = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_size, "%s: cannot read: %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        int is_step = strstr(line, "\"type\":\"step\"") != NULL, is_eval = strstr(line, "\"type\":\"eval\"") != NULL;
        if (!is_step && !is_eval) continue;
        double st = json_number(line, "\"step\":");
        if (!(st >= 1 && st <= steps)) continue;
        int s = (int)st;
        if (is_step) {
            r->train[s] = json_number(line, "\"loss\":");
            r->n_train++;
        } else {
            r->val[s] = json_number(line, "\"val_loss\":");
            if (s > r->last_val_step) r->last_val_step = s;
        }
    }
    free(line);
    fclose(f);
    return 0;
}

// 1 when the run holds the step records up to its last step and the evaluation there.
static int run_complete(const Run *r) { return r->n_train == r->last_step && r->last_val_step == r->last_step; }

// The checkpoint a --fork trunk ends with (the one its forks resume from).
static void trunk_checkpoint(const Run *trunk, char *path, size_t size) {
    snprintf(path, size, "%s/step_%08d", trunk->dir, trunk->last_step);
}

// A finished trunk also needs its checkpoint at the fork step, which the forks start from.
static int trunk_usable(const Run *trunk) {
    char path[PATHN + 32];
    struct stat st;
    trunk_checkpoint(trunk, path, sizeof path);
    return run_complete(trunk) && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

// 1 when the run has nothing left to train: an arm complete, a trunk complete with its checkpoint.
static int run_finished(const Run *r) { return r->arm < 0 ? trunk_usable(r) : run_complete(r); }

// Starts the run's child; one that continues from its checkpoint appends to its train.log and gets
// `--resume latest`, a fork that starts gets `--resume` of its trunk's checkpoint (args holds two free
// slots for it before the terminating NULL).
static pid_t spawn_run(Run *r, char *err, size_t err_size) {
    char log[PATHN + 16];
    snprintf(log, sizeof log, "%s/train.log", r->dir);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(err, err_size, "cannot start a training process: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | (r->continues ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
        if (fd < 0) {
            fprintf(stderr, "fp8moe compare: %s: cannot write: %s\n", log, strerror(errno));
            _exit(127);
        }
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        char from[PATHN + 32] = CHECKPOINT_LATEST;
        if (r->continues || r->trunk) {
            if (!r->continues) trunk_checkpoint(r->trunk, from, sizeof from);
            int k = 0;
            while (r->args[k]) k++;
            r->args[k] = "--resume", r->args[k + 1] = from;  // the child's copy of args
        }
        execv("/proc/self/exe", r->args);
        fprintf(stderr, "fp8moe compare: cannot run /proc/self/exe (this fp8moe binary): %s\n", strerror(errno));
        _exit(127);
    }
    return pid;
}

// Last `n` lines of a file to stderr, indented (a failed run's reason).
static void print_tail(const char *path, int n) {
    char *text = read_file(path);
    if (!text) return;
    size_t len = strlen(text);
    const char *p = text + len;
    int lines = 0;
    while (p > text && lines <= n) {
        p--;
        if (*p == '\n' && p != text + len - 1) lines++;
    }
    if (*p == '\n') p++;
    for (const char *q = p; *q;) {
        const char *e = strchr(q, '\n');
        int l = e ? (int)(e - q) : (int)strlen(q);
        fprintf(stderr, "    %.*s\n", l, q);
        q += l + (e ? 1 : 0);
    }
    free(text);
}

// ---------------------------------------------------------------------------- statistics

typedef struct {
    double mean, sd;  // sd: sample standard deviation; NaN when fewer than 2 values
    int n;
} Stat;

static Stat stat_of(const double *x, int n) {
    Stat s = {NAN, NAN, 0};
    double sum = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(x[i])) {
            sum += x[i];
            s.n++;
        }
    if (s.n == 0) return s;
    s.mean = sum / s.n;
    if (s.n > 1) {
        double ss = 0;
        for (int i = 0; i < n; i++)
            if (isfinite(x[i])) ss += (x[i] - s.mean) * (x[i] - s.mean);
        s.sd = sqrt(ss / (s.n - 1));
    }
    return s;
}

static double rel_gap(double a, double base) {
    return isfinite(a) && isfinite(base) && base != 0 ? (a - base) / base : NAN;
}

// Gap of the mean loss over steps [s0, s1] of run a against run b: only steps where both have a value
// (val = 1: evaluations, else training steps). NaN when there is none.
static double window_gap(const Run *a, const Run *b, int s0, int s1, int val, int *count) {
    double sa = 0, sb = 0;
    int c = 0;
    for (int s = s0; s <= s1; s++) {
        double x = val ? a->val[s] : a->train[s], y = val ? b->val[s] : b->train[s];
        if (isfinite(x) && isfinite(y)) {
            sa += x;
            sb += y;
            c++;
        }
    }
    if (count) *count = c;
    return c ? rel_gap(sa / c, sb / c) : NAN;
}

static void fmt_pct(char *buf, size_t n, double x) {
    if (isfinite(x)) snprintf(buf, n, "%+.3f%%", 100 * x);
    else snprintf(buf, n, "n/a");
}

// "+0.123% +- 0.045% (3 seeds; standard error 0.026%)" or "+0.123% (1 seed: no spread)"
static void fmt_stat(char *buf, size_t n, Stat s) {
    char m[32], d[32], e[32];
    fmt_pct(m, sizeof m, s.mean);
    if (s.n >= 2) {
        snprintf(d, sizeof d, "%.3f%%", 100 * s.sd);
        snprintf(e, sizeof e, "%.3f%%", 100 * s.sd / sqrt(s.n));
        snprintf(buf, n, "%s +- %s (sd over %d seeds; standard error %s)", m, d, s.n, e);
    } else {
        snprintf(buf, n, "%s (%d seed: no spread)", m, s.n);
    }
}

// ---------------------------------------------------------------------------- outputs

typedef struct {
    const Options *o;
    const char *out;
    Arm arms[MAX_ARMS];
    int n_arms, n_seeds, steps, win;  // win: the smoothing window of the train-loss gaps, in steps
    uint64_t seed0;
    Run *runs;  // [seed_index * n_arms + arm]
} Compare;

static Run *run_at(const Compare *c, int arm, int k) { return &c->runs[k * c->n_arms + arm]; }

// --resume: the run's directory holds a compare-job.ini equal to the run's config now.
static int run_unchanged(const Run *r) {
    char job_path[PATHN + 32];
    snprintf(job_path, sizeof job_path, "%s/compare-job.ini", r->dir);
    char *old = read_file(job_path);
    int same = old && !strcmp(old, r->config_text);
    free(old);
    return same;
}

// --resume: every arm of seed k is finished and unchanged (its records are read into the runs).
static int seed_finished(const Compare *c, int k) {
    char err[512];
    for (int a = 0; a < c->n_arms; a++) {
        Run *r = run_at(c, a, k);
        if (!run_unchanged(r) || read_metrics(r, c->steps, err, sizeof err) != 0 || !run_complete(r)) return 0;
    }
    return 1;
}

static const char *run_name(const Compare *c, const Run *r) { return r->arm < 0 ? "trunk" : c->arms[r->arm].name; }

// compare.csv, with the column numbers (1-based) the plot script needs.
typedef struct {
    int train_mean[MAX_ARMS], val_mean[MAX_ARMS];
    int gap_train_mean[MAX_ARMS], gap_train_sd[MAX_ARMS], gap_val_mean[MAX_ARMS], gap_val_sd[MAX_ARMS];
} CsvColumns;

static void put_num(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, ",%.9g", x);
    else fputs(",", f);
}

static int write_csv(const Compare *c, CsvColumns *col, char *err, size_t err_size) {
    char path[PATHN];
    snprintf(path, sizeof path, "%s/compare.csv", c->out);
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    FILE *f = d.f;
    int ci = 1;
    fputs("step", f);
    for (int a = 0; a < c->n_arms; a++)
        for (int k = 0; k < c->n_seeds; k++) {
            unsigned long long sd = (unsigned long long)run_at(c, a, k)->seed;
            fprintf(f, ",%s_s%llu_train,%s_s%llu_val", c->arms[a].name, sd, c->arms[a].name, sd);
            ci += 2;
        }
    for (int a = 0; a < c->n_arms; a++) {
        fprintf(f, ",%s_train_mean,%s_val_mean", c->arms[a].name, c->arms[a].name);
        col->train_mean[a] = ++ci;
        col->val_mean[a] = ++ci;
    }
    for (int a = 1; a < c->n_arms; a++) {
        for (int k = 0; k < c->n_seeds; k++) {
            unsigned long long sd = (unsigned long long)run_at(c, a, k)->seed;
            fprintf(f, ",gap_%s_s%llu_train,gap_%s_s%llu_val", c->arms[a].name, sd, c->arms[a].name, sd);
            ci += 2;
        }
        const char *n = c->arms[a].name;
        fprintf(f, ",gap_%s_train_mean,gap_%s_train_sd,gap_%s_val_mean,gap_%s_val_sd", n, n, n, n);
        col->gap_train_mean[a] = ++ci;
        col->gap_train_sd[a] = ++ci;
        col->gap_val_mean[a] = ++ci;
        col->gap_val_sd[a] = ++ci;
    }
    fputs("\n", f);
    double *tmp = malloc(sizeof(double) * (size_t)c->n_seeds * 2);
    if (!tmp) {
        durable_discard(&d);
        snprintf(err, err_size, "out of memory");
        return -1;
    }
    double *tmp2 = tmp + c->n_seeds;
    for (int s = 1; s <= c->steps; s++) {
        fprintf(f, "%d", s);
        for (int a = 0; a < c->n_arms; a++)
            for (int k = 0; k < c->n_seeds; k++) {
                put_num(f, run_at(c, a, k)->train[s]);
                put_num(f, run_at(c, a, k)->val[s]);
            }
        for (int a = 0; a < c->n_arms; a++) {
            for (int k = 0; k < c->n_seeds; k++) {
                tmp[k] = run_at(c, a, k)->train[s];
                tmp2[k] = run_at(c, a, k)->val[s];
            }
            put_num(f, stat_of(tmp, c->n_seeds).mean);
            put_num(f, stat_of(tmp2, c->n_seeds).mean);
        }
        for (int a = 1; a < c->n_arms; a++) {
            for (int k = 0; k < c->n_seeds; k++) {
                const Run *r = run_at(c, a, k), *b = run_at(c, 0, k);
                tmp[k] = rel_gap(r->train[s], b->train[s]);
                tmp2[k] = rel_gap(r->val[s], b->val[s]);
                put_num(f, tmp[k]);
                put_num(f, tmp2[k]);
            }
            Stat t = stat_of(tmp, c->n_seeds), v = stat_of(tmp2, c->n_seeds);
            put_num(f, t.mean);
            put_num(f, t.sd);
            put_num(f, v.mean);
            put_num(f, v.sd);
        }
        fputs("\n", f);
    }
    free(tmp);
    return durable_commit(&d, err, err_size);
}

// Gap of each seed's mean training loss over windows of c->win steps: Stat over seeds per window.
static Stat window_stat(const Compare *c, int arm, int s0, int s1, int val, double *per_seed) {
    for (int k = 0; k < c->n_seeds; k++)
        per_seed[k] = window_gap(run_at(c, arm, k), run_at(c, 0, k), s0, s1, val, NULL);
    return stat_of(per_seed, c->n_seeds);
}

static int write_windows_csv(const Compare *c, char *err, size_t err_size) {
    char path[PATHN];
    snprintf(path, sizeof path, "%s/compare_windows.csv", c->out);
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    FILE *f = d.f;
    double *tmp = malloc(sizeof(double) * (size_t)c->n_seeds);
    fputs("first_step,last_step", f);
    for (int a = 1; a < c->n_arms; a++)
        fprintf(f, ",gap_%s_train_mean,gap_%s_train_sd", c->arms[a].name, c->arms[a].name);
    fputs("\n", f);
    for (int s0 = 1; tmp && s0 <= c->steps; s0 += c->win) {
        int s1 = s0 + c->win - 1 < c->steps ? s0 + c->win - 1 : c->steps;
        fprintf(f, "%d,%d", s0, s1);
        for (int a = 1; a < c->n_arms; a++) {
            Stat st = window_stat(c, a, s0, s1, 0, tmp);
            put_num(f, st.mean);
            put_num(f, st.sd);
        }
        fputs("\n", f);
    }
    if (!tmp) {
        durable_discard(&d);
        snprintf(err, err_size, "%s: out of memory", path);
        return -1;
    }
    free(tmp);
    return durable_commit(&d, err, err_size);
}

// The summary (see docs/training.md, "Comparing precision modes") into f.
static void write_summary(const Compare *c, FILE *f) {
    const int N = c->steps, last = (N + 9) / 10, s_from = N - last + 1;
    double *per_seed = malloc(sizeof(double) * (size_t)c->n_seeds);
    if (!per_seed) return;
    char buf[256], b2[64];
    fprintf(f, "fp8moe compare: %s, %d steps, modes", c->o->job, N);
    for (int a = 0; a < c->n_arms; a++)
        fprintf(f, "%s %s%s", a ? "," : "", c->arms[a].name, a == 0 ? " (baseline)" : "");
    fprintf(f, "; %d seed%s (", c->n_seeds, c->n_seeds == 1 ? "" : "s");
    for (int k = 0; k < c->n_seeds; k++)
        fprintf(f, "%s%llu", k ? " " : "", (unsigned long long)run_at(c, 0, k)->seed);
    fprintf(f, "); runs in %s/<mode>-seed<S>/\n", c->out);
    if (c->o->null_arm)
        fprintf(f, "%s = %s with optim.lr x %.4f (a null perturbation: its gap is the run-to-run spread)\n",
                c->arms[c->n_arms - 1].name, c->arms[0].name, NULL_LR_FACTOR);
    fprintf(f, "gap = (loss - %s's loss) / %s's loss, per seed at the same step; +- = sample standard deviation "
            "over seeds\n", c->arms[0].name, c->arms[0].name);
    for (int a = 1; a < c->n_arms; a++) {
        fprintf(f, "\n%s vs %s%s:\n", c->arms[a].name, c->arms[0].name, c->arms[a].is_null ? " (null spread)" : "");
        // the headline: validation gap over the last 10% of steps (training loss when no evaluation is there)
        int evals = 0, val = 1;
        for (int k = 0; k < c->n_seeds; k++) {
            int cnt = 0;
            window_gap(run_at(c, a, k), run_at(c, 0, k), s_from, N, 1, &cnt);
            if (cnt == 0) val = 0;
            if (k == 0) evals = cnt;
        }
        Stat head = window_stat(c, a, s_from, N, val, per_seed);
        fmt_stat(buf, sizeof buf, head);
        if (val)
            fprintf(f, "  mean val gap over the last 10%% of steps (%d-%d, %d evaluation%s per run): %s\n", s_from, N,
                    evals, evals == 1 ? "" : "s", buf);
        else
            fprintf(f, "  mean gap over the last 10%% of steps (%d-%d): %s\n  (training loss: the runs have no "
                    "validation evaluation in these steps)\n", s_from, N, buf);
        fprintf(f, "    per seed:");
        for (int k = 0; k < c->n_seeds; k++) {
            fmt_pct(b2, sizeof b2, per_seed[k]);
            fprintf(f, " %llu %s", (unsigned long long)run_at(c, a, k)->seed, b2);
        }
        fprintf(f, "\n");
        if (val) {
            Stat tr = window_stat(c, a, s_from, N, 0, per_seed);
            fmt_stat(buf, sizeof buf, tr);
            fprintf(f, "  mean training-loss gap over the same steps: %s\n", buf);
        }
        // max gap: of the seed-mean train gap over windows, and of the seed-mean val gap at evaluations
        Stat best = {NAN, NAN, 0};
        // first_out: the first window outside the spread; out_from: the window after the last one inside
        int best_s0 = 0, best_s1 = 0, first_out = 0, first_out_s1 = 0, out_from = 1;
        for (int s0 = 1; s0 <= N; s0 += c->win) {
            int s1 = s0 + c->win - 1 < N ? s0 + c->win - 1 : N;
            Stat st = window_stat(c, a, s0, s1, 0, per_seed);
            if (isfinite(st.mean) && !(fabs(st.mean) <= fabs(best.mean))) {
                best = st;
                best_s0 = s0;
                best_s1 = s1;
            }
            int out = isfinite(st.sd) && fabs(st.mean) > st.sd;
            if (out && !first_out) {
                first_out = s0;
                first_out_s1 = s1;
            }
            if (!out) out_from = s1 + 1;
        }
        fmt_pct(b2, sizeof b2, best.mean);
        fprintf(f, "  max gap: %s (training loss, steps %d-%d", b2, best_s0, best_s1);
        if (best.n >= 2) fprintf(f, ", sd over seeds %.3f%%", 100 * best.sd);
        fprintf(f, ")");
        double vbest = NAN;
        int vstep = 0;
        for (int s = 1; s <= N; s++) {
            for (int k = 0; k < c->n_seeds; k++)
                per_seed[k] = rel_gap(run_at(c, a, k)->val[s], run_at(c, 0, k)->val[s]);
            Stat st = stat_of(per_seed, c->n_seeds);
            if (isfinite(st.mean) && !(fabs(st.mean) <= fabs(vbest))) {
                vbest = st.mean;
                vstep = s;
            }
        }
        fmt_pct(b2, sizeof b2, vbest);
        if (vstep) fprintf(f, "; validation: %s at step %d", b2, vstep);
        fprintf(f, "\n");
        if (c->n_seeds < 2)
            fprintf(f, "  gap leaves its seed spread: n/a (1 seed; --seeds 2 or more measures the spread)\n");
        else if (!first_out)
            fprintf(f, "  gap leaves its seed spread: never (|mean| <= sd over seeds in every %d-step window)\n",
                    c->win);
        else if (out_from <= N)
            fprintf(f, "  gap leaves its seed spread: first at steps %d-%d (|mean| > sd over seeds); outside in every "
                    "%d-step window from step %d to the end\n", first_out, first_out_s1, c->win, out_from);
        else
            fprintf(f, "  gap leaves its seed spread: first at steps %d-%d (|mean| > sd over seeds); back inside in "
                    "the last %d-step window\n", first_out, first_out_s1, c->win);
    }
    fprintf(f, "\nper-step and per-window numbers: %s/compare.csv, %s/compare_windows.csv (%d-step windows of the "
            "training loss)\n", c->out, c->out, c->win);
    free(per_seed);
}

// compare.gp (run in DIR: `cd DIR && gnuplot compare.gp` redraws compare.png).
static int write_plot_script(const Compare *c, const CsvColumns *col, char *err, size_t err_size) {
    char path[PATHN];
    snprintf(path, sizeof path, "%s/compare.gp", c->out);
    DurableFile d;
    if (durable_open(&d, path, err, err_size) != 0) return -1;
    FILE *f = d.f;
    static const char *const colors[MAX_ARMS] = {"#000000", "#d62728", "#1f77b4", "#2ca02c"};
    fprintf(f, "# compare.gp - written by fp8moe compare; `gnuplot compare.gp` in this directory redraws compare.png\n"
               "set terminal pngcairo size 1200,900 font ',10'\nset output 'compare.png'\n"
               "set datafile separator ','\nset datafile missing ''\nset grid\nset key top right\n"
               "set multiplot layout 2,1 title '%s: %d steps, %d seed%s'\n", c->o->job, c->steps, c->n_seeds,
            c->n_seeds == 1 ? "" : "s");
    fprintf(f, "set title 'loss, mean over seeds (lines: training loss per step; points: validation loss)'\n"
               "set xlabel 'step'\nset ylabel 'loss (nats/token)'\nset logscale y\nplot ");
    for (int a = 0; a < c->n_arms; a++)
        fprintf(f, "%s'compare.csv' skip 1 using 1:%d with lines lw 1 lc rgb '%s' title '%s train', "
                   "'compare.csv' skip 1 using 1:%d with points pt 7 ps 1 lc rgb '%s' title '%s val'",
                a ? ", \\\n     " : "", col->train_mean[a], colors[a], c->arms[a].name, col->val_mean[a], colors[a],
                c->arms[a].name);
    fprintf(f, "\nunset logscale y\n");
    fprintf(f, "set title 'relative gap vs %s in %%: thin = per step, thick = %d-step windows%s; points: validation'\n"
               "set ylabel 'gap (%%)'\nplot 0 with lines dt 2 lc rgb '#808080' notitle", c->arms[0].name, c->win,
            c->n_seeds >= 2 ? ", band = +- sd over seeds" : "");
    for (int a = 1; a < c->n_arms; a++) {
        int m = 3 + 2 * (a - 1), sd = m + 1;  // columns of compare_windows.csv
        if (c->n_seeds >= 2)
            fprintf(f, ", \\\n     'compare_windows.csv' skip 1 using (($1+$2)/2):(100*($%d-$%d)):(100*($%d+$%d)) "
                       "with filledcurves fs transparent solid 0.2 noborder lc rgb '%s' notitle",
                    m, sd, m, sd, colors[a]);
        fprintf(f, ", \\\n     'compare.csv' skip 1 using 1:(100*$%d) with lines lw 0.5 lc rgb '%s' notitle",
                col->gap_train_mean[a], colors[a]);
        fprintf(f, ", \\\n     'compare_windows.csv' skip 1 using (($1+$2)/2):(100*$%d) with lines lw 2.5 lc rgb '%s' "
                   "title '%s train'", m, colors[a], c->arms[a].name);
        if (c->n_seeds >= 2)
            fprintf(f, ", \\\n     'compare.csv' skip 1 using 1:(100*$%d):(100*$%d) with yerrorbars pt 7 lc rgb '%s' "
                       "title '%s val (+- sd)'", col->gap_val_mean[a], col->gap_val_sd[a], colors[a], c->arms[a].name);
        else
            fprintf(f, ", \\\n     'compare.csv' skip 1 using 1:(100*$%d) with points pt 7 lc rgb '%s' title '%s val'",
                    col->gap_val_mean[a], colors[a], c->arms[a].name);
    }
    fprintf(f, "\nunset multiplot\n");
    return durable_commit(&d, err, err_size);
}

// 1 when an executable `name` is on PATH.
static int on_path(const char *name) {
    const char *path = getenv("PATH");
    if (!path) path = "/usr/bin:/bin";
    while (*path) {
        const char *e = strchr(path, ':');
        size_t len = e ? (size_t)(e - path) : strlen(path);
        char full[PATHN];
        snprintf(full, sizeof full, "%.*s/%s", (int)len, len ? path : ".", name);
        if (access(full, X_OK) == 0) return 1;
        if (!e) break;
        path = e + 1;
    }
    return 0;
}

// Runs gnuplot compare.gp in DIR (its messages go to DIR/gnuplot.log). Returns 0, or -1 (printed).
static int run_gnuplot(const char *out) {
    char log[PATHN], png[PATHN];
    snprintf(log, sizeof log, "%s/gnuplot.log", out);
    snprintf(png, sizeof png, "%s/compare.png", out);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "fp8moe compare: cannot start gnuplot: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0 || chdir(out) != 0) _exit(127);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        execlp("gnuplot", "gnuplot", "compare.gp", (char *)NULL);
        fprintf(stderr, "cannot run gnuplot: %s\n", strerror(errno));
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    struct stat st;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || stat(png, &st) != 0 || st.st_size == 0) {
        fprintf(stderr, "fp8moe compare: gnuplot failed to draw %s (exit status %d); its messages (%s):\n", png,
                WIFEXITED(status) ? WEXITSTATUS(status) : -1, log);
        print_tail(log, 10);
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------- compare_main

static void free_runs(Run *runs, int n) {
    for (int i = 0; runs && i < n; i++) {
        if (runs[i].args)
            for (char **p = runs[i].args; *p; p++) free(*p);
        free(runs[i].args);
        free(runs[i].config_text);
        free(runs[i].train);
        free(runs[i].val);
    }
    free(runs);
}

// The child's arguments and the run's identity for --resume: its resolved config with the job's own
// train.threads (the threads --jobs chooses do not change the numbers, so a finished run is reused whatever
// --jobs), and for a fork the checkpoint it starts from. Returns 0, EXIT_USAGE (an invalid config, named) or 1.
static int prepare_run(Run *r, const char *job, const char **ov, int n, int threads, int steps, const char *name) {
    char err[4096];
    Config *cfg = malloc(sizeof *cfg);
    r->train = malloc(sizeof(double) * (size_t)(steps + 1));
    r->val = malloc(sizeof(double) * (size_t)(steps + 1));
    if (!cfg || !r->train || !r->val) {
        fprintf(stderr, "fp8moe compare: out of memory for %d steps\n", steps);
        free(cfg);
        return 1;
    }
    if (config_load(cfg, job, ov, n, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe compare: the %s run of seed %llu: %s\n", name, (unsigned long long)r->seed, err);
        free(cfg);
        return EXIT_USAGE;
    }
    cfg->train.threads = threads;
    char *text = config_text(cfg);
    free(cfg);
    if (r->trunk) {
        char from[PATHN + 32];
        trunk_checkpoint(r->trunk, from, sizeof from);
        r->config_text = xstrdup_printf("%s# compare --fork: starts from %s\n", text, from);
        free(text);
    } else {
        r->config_text = text;
    }
    r->args = calloc((size_t)(2 * n + 6), sizeof *r->args);  // + --resume FROM + NULL
    if (!r->args) return 1;
    int j = 0;
    r->args[j++] = xstrdup_printf("fp8moe");
    r->args[j++] = xstrdup_printf("train");
    r->args[j++] = xstrdup_printf("%s", job);
    for (int i = 0; i < n; i++) {
        r->args[j++] = xstrdup_printf("--set");
        r->args[j++] = xstrdup_printf("%s", ov[i]);
    }
    return 0;
}

int compare_main(int argc, char **argv) {
    Options o;
    int rc = parse_options(argc, argv, &o);
    if (rc) {
        free(o.sets);
        return rc == 1 ? 0 : rc;
    }
    Compare c;
    memset(&c, 0, sizeof c);
    c.o = &o;
    char err[4096];
    Config *cfg = malloc(sizeof *cfg);
    const char **ov = calloc((size_t)o.n_sets + 16, sizeof *ov);
    char *out_default = NULL;
    int n_runs = 0, n_trunks = 0;
    Run *trunks = NULL, **queue = NULL;
    rc = 1;
    if (!cfg || !ov) goto done;

    // The job with the user's overrides: the seed, learning rate and run directory the runs derive from.
    for (int i = 0; i < o.n_sets; i++) ov[i] = o.sets[i];
    int n_ov = o.n_sets;
    char steps_set[64];
    if (o.steps) {
        snprintf(steps_set, sizeof steps_set, "train.steps=%d", o.steps);
        ov[n_ov++] = steps_set;
    }
    if (config_load(cfg, o.job, ov, n_ov, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        rc = EXIT_USAGE;
        goto done;
    }
    if (o.plot && !on_path("gnuplot")) {
        fprintf(stderr, "fp8moe compare: gnuplot is not on PATH, and it draws compare.png: install Debian's "
                "gnuplot-nox (`make deps` does, or `apt-get install gnuplot-nox`), or pass --no-plot to do without "
                "the plot\n");
        goto done;
    }
    c.steps = cfg->train.steps;
    c.win = c.steps >= 20 ? c.steps / 20 : 1;
    c.seed0 = cfg->train.seed;
    c.n_seeds = o.seeds;
    const double lr = cfg->optim.lr;
    const int threads = cfg->train.threads;
    if (!o.out) o.out = out_default = xstrdup_printf("%s-compare", cfg->checkpoint.dir);
    c.out = o.out;
    for (int i = 0; i < o.n_modes; i++) {
        snprintf(c.arms[c.n_arms].name, sizeof c.arms[0].name, "%s", o.modes[i]);
        c.arms[c.n_arms++].mode = o.modes[i];
    }
    if (o.null_arm) {
        snprintf(c.arms[c.n_arms].name, sizeof c.arms[0].name, "%s-null", o.modes[0]);
        c.arms[c.n_arms].mode = o.modes[0];
        c.arms[c.n_arms++].is_null = 1;
    }
    if (c.seed0 > UINT64_MAX - (uint64_t)o.seeds) {
        fprintf(stderr, "fp8moe compare: train.seed = %llu: the seeds train.seed .. train.seed + %d overflow 64 "
                "bits; expected a smaller train.seed\n", (unsigned long long)c.seed0, o.seeds - 1);
        rc = EXIT_USAGE;
        goto done;
    }

    if (o.fork && o.fork >= c.steps) {
        fprintf(stderr, "fp8moe compare: --fork %d: expected a step before the last one (train.steps = %d)\n", o.fork,
                c.steps);
        rc = EXIT_USAGE;
        goto done;
    }

    // Every run's overrides, checked now: an invalid combination stops before any training. With --fork,
    // each seed's trunk runs first (queue order: trunk, then the seed's arms), so a fork never waits long.
    n_runs = c.n_arms * c.n_seeds;
    n_trunks = o.fork ? c.n_seeds : 0;
    const int n_queue = n_runs + n_trunks;
    c.runs = calloc((size_t)n_runs, sizeof *c.runs);
    trunks = calloc((size_t)n_trunks + 1, sizeof *trunks);
    queue = calloc((size_t)n_queue, sizeof *queue);
    if (!c.runs || !trunks || !queue) goto done;
    int jobs = o.jobs < n_queue ? o.jobs : n_queue;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n_queued = 0;
    for (int k = 0; k < c.n_seeds; k++)
        for (int a = n_trunks ? -1 : 0; a < c.n_arms; a++) {
            Run *r = a < 0 ? &trunks[k] : run_at(&c, a, k);
            queue[n_queued++] = r;
            r->arm = a;
            r->seed_index = k;
            r->seed = c.seed0 + (uint64_t)k;
            r->last_step = a < 0 ? o.fork : c.steps;
            r->trunk = a >= 0 && n_trunks ? &trunks[k] : NULL;
            const Arm *arm = &c.arms[a < 0 ? 0 : a];
            if (snprintf(r->dir, sizeof r->dir, "%s/%s-seed%llu", c.out, a < 0 ? "trunk" : arm->name,
                         (unsigned long long)r->seed) >= (int)sizeof r->dir - 32) {
                fprintf(stderr, "fp8moe compare: --out %s: path too long\n", c.out);
                rc = EXIT_USAGE;
                goto done;
            }
            int n = n_ov;
            ov[n++] = xstrdup_printf("precision.mode=%s", arm->mode);
            ov[n++] = xstrdup_printf("train.seed=%llu", (unsigned long long)r->seed);
            ov[n++] = xstrdup_printf("checkpoint.dir=%s", r->dir);
            ov[n++] = xstrdup_printf("log.jsonl=");
            if (a < 0) ov[n++] = xstrdup_printf("train.stop_after=%d", o.fork);
            if (arm->is_null) ov[n++] = xstrdup_printf("optim.lr=%.17g", lr * NULL_LR_FACTOR);
            if (jobs > 1 && threads == 0)  // CPU runs side by side share the cores (no effect on the numbers)
                ov[n++] = xstrdup_printf("train.threads=%ld", ncpu / jobs > 1 ? ncpu / jobs : 1);
            int bad = prepare_run(r, o.job, ov, n, threads, c.steps, a < 0 ? "trunk" : arm->name);
            for (int i = n_ov; i < n; i++) free((void *)ov[i]);
            if (bad) {
                rc = bad;
                goto done;
            }
        }
    if (durable_make_dirs(c.out, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe compare: --out: %s\n", err);
        goto done;
    }

    // ---- the runs: up to `jobs` at a time, seed by seed (so an interrupted compare has whole pairs first)
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    stop_requested = 0;
    printf("compare: %s, %d steps, %d run%s (%d mode%s x %d seed%s), %d at a time, into %s\n", o.job, c.steps, n_runs,
           n_runs == 1 ? "" : "s", c.n_arms, c.n_arms == 1 ? "" : "s", c.n_seeds, c.n_seeds == 1 ? "" : "s", jobs,
           c.out);
    if (o.fork)
        printf("compare: --fork %d: each seed's %s run trains to step %d in %s/trunk-seed<S>/, and every run of the "
               "seed starts from its checkpoint there\n", o.fork, c.arms[0].name, o.fork, c.out);
    int next = 0, running = 0, failed = 0, finished = 0;
    const double t_start = now_s();
    while ((next < n_queue && !stop_requested && !failed) || running > 0) {
        while (next < n_queue && running < jobs && !stop_requested && !failed) {
            Run *r = queue[next];
            if (r->trunk && r->trunk->state != 2) break;  // a fork waits for its trunk
            next++;
            char job_path[PATHN + 32];
            snprintf(job_path, sizeof job_path, "%s/compare-job.ini", r->dir);
            if (durable_make_dirs(r->dir, err, sizeof err) != 0) {
                fprintf(stderr, "fp8moe compare: %s\n", err);
                failed = 1;
                break;
            }
            if (o.resume && r->arm < 0 && seed_finished(&c, r->seed_index)) {
                r->state = 2;  // every fork of the seed is reused, so its trunk (and its checkpoint) is not needed
                printf("compare: trunk seed %llu: not needed (--resume reuses every run of the seed)\n",
                       (unsigned long long)r->seed);
                continue;
            }
            if (o.resume) {
                int same = run_unchanged(r);
                if (same && read_metrics(r, c.steps, err, sizeof err) == 0 && run_finished(r)) {
                    r->state = 2;
                    finished += r->arm >= 0;
                    char done_at[24];
                    snprintf(done_at, sizeof done_at, "[%d/%d] ", finished, n_runs);
                    printf("compare: %s%s seed %llu: reusing the finished run in %s (--resume)\n",
                           r->arm < 0 ? "" : done_at, run_name(&c, r), (unsigned long long)r->seed, r->dir);
                    continue;
                }
                // an unfinished run of the same config that wrote a checkpoint (checkpoint.every_steps) continues
                // from it: the trainer's resume is bitwise, and its metrics.jsonl keeps the steps before
                char latest[PATHN + 16];
                struct stat st;
                snprintf(latest, sizeof latest, "%s/%s", r->dir, CHECKPOINT_LATEST);
                r->continues = same && lstat(latest, &st) == 0;
            }
            if (r->trunk && !r->continues) {
                // the fork's metrics start as the trunk's: the trainer's resume keeps the records up to the fork step
                char from[PATHN + 16], to[PATHN + 16];
                snprintf(from, sizeof from, "%s/metrics.jsonl", r->trunk->dir);
                snprintf(to, sizeof to, "%s/metrics.jsonl", r->dir);
                char *text = read_file(from);
                if (!text || durable_write_text(to, text, err, sizeof err) != 0) {
                    fprintf(stderr, "fp8moe compare: %s\n", text ? err : "cannot read the trunk's metrics.jsonl");
                    free(text);
                    failed = 1;
                    break;
                }
                free(text);
            }
            if (durable_write_text(job_path, r->config_text, err, sizeof err) != 0) {
                fprintf(stderr, "fp8moe compare: %s\n", err);
                failed = 1;
                break;
            }
            r->pid = spawn_run(r, err, sizeof err);
            if (r->pid < 0) {
                fprintf(stderr, "fp8moe compare: %s\n", err);
                failed = 1;
                break;
            }
            for (int i = 0; i < MAX_JOBS; i++)
                if (running_pids[i] <= 0) {
                    running_pids[i] = r->pid;
                    break;
                }
            r->state = 1;
            r->t0 = now_s();
            running++;
            printf("compare: %s seed %llu: %s (log %s/train.log)\n", run_name(&c, r), (unsigned long long)r->seed,
                   r->continues ? "continuing from its checkpoint (--resume)"
                                : r->trunk ? "training from the trunk's checkpoint" : "training", r->dir);
        }
        if (running == 0) break;
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "fp8moe compare: waitpid: %s\n", strerror(errno));
            break;
        }
        Run *r = NULL;
        for (int i = 0; i < n_queue; i++)
            if (queue[i]->state == 1 && queue[i]->pid == pid) r = queue[i];
        if (!r) continue;
        for (int i = 0; i < MAX_JOBS; i++)
            if (running_pids[i] == pid) running_pids[i] = 0;
        running--;
        char took[32], log[PATHN + 16];
        format_duration(took, sizeof took, now_s() - r->t0);
        snprintf(log, sizeof log, "%s/train.log", r->dir);
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code == 0 && read_metrics(r, c.steps, err, sizeof err) == 0 && run_finished(r)) {
            r->state = 2;
            finished += r->arm >= 0;
            char done_at[24];
            snprintf(done_at, sizeof done_at, "[%d/%d] ", finished, n_runs);
            printf("compare: %s%s seed %llu done in %s: step %d loss %.4f, val_loss %.4f\n", r->arm < 0 ? "" : done_at,
                   run_name(&c, r), (unsigned long long)r->seed, took, r->last_step, r->train[r->last_step],
                   r->val[r->last_step]);
        } else if (code == 0 || stop_requested) {
            r->state = 3;
            fprintf(stderr, "fp8moe compare: %s seed %llu stopped before its last step (interrupted; %s)\n",
                    run_name(&c, r), (unsigned long long)r->seed, log);
            failed = 1;
        } else {
            r->state = 3;
            fprintf(stderr, "fp8moe compare: the %s run of seed %llu failed (exit status %d) after %s; the end of "
                    "%s:\n", run_name(&c, r), (unsigned long long)r->seed, code, took, log);
            print_tail(log, 6);
            failed = 1;
        }
        fflush(stdout);
    }
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (failed || stop_requested || finished < n_runs) {
        fprintf(stderr, "fp8moe compare: %s; no comparison written. Finished runs are kept in %s (`--resume` reuses "
                "them)\n", stop_requested ? "interrupted" : "a run did not finish", c.out);
        goto done;
    }
    char took[32];
    format_duration(took, sizeof took, now_s() - t_start);
    printf("compare: %d runs in %s\n\n", n_runs, took);

    // ---- outputs
    CsvColumns col;
    memset(&col, 0, sizeof col);
    if (write_csv(&c, &col, err, sizeof err) != 0 || write_windows_csv(&c, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe compare: %s\n", err);
        goto done;
    }
    char *summary = NULL;
    size_t summary_len = 0;
    FILE *sf = open_memstream(&summary, &summary_len);
    if (!sf) goto done;
    write_summary(&c, sf);
    fclose(sf);
    fputs(summary, stdout);
    char path[PATHN];
    snprintf(path, sizeof path, "%s/summary.txt", c.out);
    int bad = durable_write_text(path, summary, err, sizeof err) != 0;
    free(summary);
    if (bad) {
        fprintf(stderr, "fp8moe compare: %s\n", err);
        goto done;
    }
    if (o.plot) {
        if (write_plot_script(&c, &col, err, sizeof err) != 0) {
            fprintf(stderr, "fp8moe compare: %s\n", err);
            goto done;
        }
        if (run_gnuplot(c.out) != 0) goto done;
    }
    printf("wrote %s/compare.csv, %s/summary.txt%s%s%s\n", c.out, c.out, o.plot ? ", " : "", o.plot ? c.out : "",
           o.plot ? "/compare.png" : " (no plot: --no-plot)");
    rc = 0;
done:
    free_runs(c.runs, n_runs);
    free_runs(trunks, n_trunks);
    free(queue);
    free(out_default);
    free(ov);
    free(cfg);
    free(o.sets);
    return rc;
}
