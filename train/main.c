/*
 * main.c - the fp8moe command line: train, compare, gradcompare, prep, sample, export, eval, bench,
 * config-doc, help.
 *
 * Only argument parsing lives here; each subcommand is one call into the library (trainer_run,
 * compare_main, grad_compare_main, data_prep, sample_run, export_main, eval_main, config_print_reference).
 * Exit status: 0 success, 1 a failure while running, 2 bad usage or an invalid job file / override (the
 * message names the argument, file, line or key).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data/prep.h"
#include "parallel/comm.h"
#include "train/bench.h"
#include "train/cli.h"
#include "train/compare.h"
#include "train/config.h"
#include "train/eval.h"
#include "train/grad_compare.h"
#include "train/hf_export.h"
#include "train/sample.h"
#include "train/schedule_cli.h"
#include "train/trainer.h"


static const char *const usage_train =
    "  fp8moe train JOB.ini [--set section.key=value]... [--resume [DIR|latest]]\n"
    "      Train the job described by JOB.ini. Each --set overrides one key after the file is read,\n"
    "      e.g. --set train.steps=100 --set checkpoint.dir=runs/try1. Prints the resolved config, a\n"
    "      line per log.every steps and val_loss=... at each evaluation; writes\n"
    "      <checkpoint.dir>/metrics.jsonl and <checkpoint.dir>/weights.h5. Ctrl-C stops after the\n"
    "      current step and saves the weights; a second Ctrl-C quits at once unless the save has\n"
    "      begun. An earlier run's files in checkpoint.dir are kept as weights.prev.h5 and\n"
    "      metrics.prev.jsonl; a checkpoint.dir that another live run holds is refused.\n"
    "      With checkpoint.every_steps = N a resumable checkpoint goes to checkpoint.dir/step_NNNNNNNN every N\n"
    "      steps and at the end; --resume continues from DIR (a step_NNNNNNNN directory, or the newest one in\n"
    "      DIR), or with `latest` or no value from the newest in checkpoint.dir, under any data / expert\n"
    "      parallel layout (docs/checkpoints.md).\n";
static const char *const usage_prep =
    "  fp8moe prep [--text FILE...] --out DIR\n"
    "      Turn text files (concatenated in order; the last 10% is validation) into byte-level token\n"
    "      shards in DIR. Without --text, the default text (Debian's fortunes) is used.\n";
static const char *const usage_sample =
    "  fp8moe sample WEIGHTS.h5 --prompt TEXT [--steps N] [--temperature X] [--seed S]\n"
    "      Generate N bytes (default 400) after TEXT from a byte-level model trained by fp8moe train.\n"
    "      temperature (default 0.8) > 0 samples, 0 takes the most likely byte; seed default 1337.\n";
static const char *const usage_config_doc =
    "  fp8moe config-doc\n"
    "      Print the reference of every job-file key (Markdown, as docs/config.md).\n";

static void print_usage(FILE *f) {
    fprintf(f, "fp8moe - FP8 mixture-of-experts training (DeepSeek-V3 architecture)\n\nUsage:\n%s%s%s%s%s%s%s%s%s%s%s%s"
               SCHEDULE_CLI_USAGE
               "  fp8moe help | --help\n      Show this text. `fp8moe help COMMAND` shows one command.\n",
            usage_train, compare_usage, grad_compare_usage, usage_prep, usage_sample, export_usage, eval_usage,
            usage_config_doc, bench_gemm_usage,
            bench_step_usage, bench_attention_usage, bench_a2a_usage);
}

static int is_help(const char *a) { return !strcmp(a, "--help") || !strcmp(a, "-h"); }

// ---------------------------------------------------------------------------- train

static int cmd_train(int argc, char **argv) {
    const char *job = NULL, *resume = NULL;
    const char **overrides = calloc((size_t)argc + 1, sizeof *overrides);
    int n_overrides = 0;
    if (!overrides) return 1;
    int rc = EXIT_USAGE;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (is_help(a)) {
            printf("Usage:\n%s", usage_train);
            rc = 0;
            goto done;
        } else if (!strcmp(a, "--set")) {
            if (i + 1 >= argc) {
                rc = cli_usage_error("train", usage_train, "%s needs a value: --set section.key=value", a);
                goto done;
            }
            overrides[n_overrides++] = argv[++i];
        } else if (!strncmp(a, "--set=", 6)) {
            overrides[n_overrides++] = a + 6;
        } else if (!strcmp(a, "--resume")) {
            // an optional value: "latest" or an existing directory; without one, the job's checkpoint.dir
            struct stat st;
            if (i + 1 < argc && (!strcmp(argv[i + 1], "latest") || (stat(argv[i + 1], &st) == 0 && S_ISDIR(st.st_mode))))
                resume = argv[++i];
            else
                resume = "latest";
        } else if (!strncmp(a, "--resume=", 9)) {
            resume = a + 9;
        } else if (a[0] == '-' && a[1] != '\0') {
            rc = cli_usage_error("train", usage_train, "unknown option %s", a);
            goto done;
        } else if (job) {
            rc = cli_usage_error("train", usage_train, "one job file expected; got a second one: %s", a);
            goto done;
        } else {
            job = a;
        }
    }
    if (!job) {
        rc = cli_usage_error("train", usage_train, "missing the job file (JOB.ini)%s", "");
        goto done;
    }
    for (int i = 0; i < n_overrides; i++)
        if (!cli_is_override(overrides[i])) {
            rc = cli_usage_error("train", usage_train, "--set %s: expected section.key=value", overrides[i]);
            goto done;
        }
    Config *cfg = malloc(sizeof *cfg);
    if (!cfg) {
        rc = 1;
        goto done;
    }
    // Under mpirun or srun every rank runs this and MPI starts; without a launcher the process is the whole
    // job and MPI is not started at all (a singleton MPI start costs time and fails under some resource
    // limits, e.g. ulimit -f, for nothing a one-process run needs).
    if (comm_launched_by_mpi()) comm_init(NULL, NULL);
    char err[2048];
    if (config_load(cfg, job, overrides, n_overrides, err, sizeof err) != 0) {
        if (comm_world()->rank == 0) fprintf(stderr, "%s\n", err);  // the same message on every rank
        free(cfg);
        comm_finalize();
        goto done;  // rc = EXIT_USAGE: the job is invalid
    }
    comm_set_timeout(cfg->parallel.timeout_s);
    // --resume / --resume latest: the newest checkpoint of the job's checkpoint.dir
    char resume_path[CONFIG_PATH_MAX + 16];
    if (resume && !strcmp(resume, "latest")) snprintf(resume_path, sizeof resume_path, "%s", cfg->checkpoint.dir);
    else if (resume) snprintf(resume_path, sizeof resume_path, "%s", resume);
    rc = trainer_run(cfg, resume ? resume_path : NULL);
    free(cfg);
    comm_finalize();
done:
    free(overrides);
    return rc;
}

// ---------------------------------------------------------------------------- prep

static int cmd_prep(int argc, char **argv) {
    const char **texts = calloc((size_t)argc + 1, sizeof *texts);
    int n_texts = 0;
    const char *out = NULL;
    if (!texts) return 1;
    int rc = EXIT_USAGE;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (is_help(a)) {
            printf("Usage:\n%s", usage_prep);
            rc = 0;
            goto done;
        } else if (!strcmp(a, "--text")) {
            int first = n_texts;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) texts[n_texts++] = argv[++i];
            if (n_texts == first) {
                rc = cli_usage_error("prep", usage_prep, "%s needs at least one FILE", a);
                goto done;
            }
        } else if (!strcmp(a, "--out")) {
            if (i + 1 >= argc) {
                rc = cli_usage_error("prep", usage_prep, "%s needs a directory", a);
                goto done;
            }
            out = argv[++i];
        } else {
            rc = cli_usage_error("prep", usage_prep, "unexpected argument %s", a);
            goto done;
        }
    }
    if (!out) {
        rc = cli_usage_error("prep", usage_prep, "missing --out DIR%s", "");
        goto done;
    }
    char err[2048];
    if (data_prep(texts, n_texts, out, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe prep: %s\n", err);
        rc = 1;
        goto done;
    }
    printf("prepared %s into %s\n", n_texts ? "the text" : "the default text", out);
    rc = 0;
done:
    free(texts);
    return rc;
}

// ---------------------------------------------------------------------------- sample

static int cmd_sample(int argc, char **argv) {
    SampleOptions opt = {.weights_path = NULL, .prompt = NULL, .steps = 400, .temperature = 0.8, .seed = 1337};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (is_help(a)) {
            printf("Usage:\n%s", usage_sample);
            return 0;
        }
        int takes_value = !strcmp(a, "--prompt") || !strcmp(a, "--steps") || !strcmp(a, "--temperature") ||
                          !strcmp(a, "--seed");
        if (takes_value && i + 1 >= argc) return cli_usage_error("sample", usage_sample, "%s needs a value", a);
        const char *v = takes_value ? argv[i + 1] : NULL;
        if (!strcmp(a, "--prompt")) {
            opt.prompt = v;
        } else if (!strcmp(a, "--steps")) {
            if (cli_parse_int(v, 0, 100000000, &opt.steps) != 0)
                return cli_usage_error("sample", usage_sample, "--steps %s: expected an integer from 0 to 100000000", v);
        } else if (!strcmp(a, "--temperature")) {
            char *end;
            errno = 0;
            double x = strtod(v, &end);
            if (errno || end == v || *end || !(x >= 0) || x > 1e6)
                return cli_usage_error("sample", usage_sample, "--temperature %s: expected a number >= 0", v);
            opt.temperature = x;
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            unsigned long long x = strtoull(v, &end, 10);
            if (errno || end == v || *end || v[0] == '-')
                return cli_usage_error("sample", usage_sample, "--seed %s: expected a non-negative integer", v);
            opt.seed = x;
        } else if (a[0] == '-' && a[1] != '\0') {
            return cli_usage_error("sample", usage_sample, "unknown option %s", a);
        } else if (opt.weights_path) {
            return cli_usage_error("sample", usage_sample, "one weights file expected; got a second one: %s", a);
        } else {
            opt.weights_path = a;
        }
        if (takes_value) i++;
    }
    if (!opt.weights_path) return cli_usage_error("sample", usage_sample, "missing the weights file (WEIGHTS.h5)%s", "");
    if (!opt.prompt) return cli_usage_error("sample", usage_sample, "missing --prompt TEXT%s", "");
    if (!opt.prompt[0])
        return cli_usage_error("sample", usage_sample, "--prompt is empty; give at least one character%s", "");
    char err[2048];
    if (sample_run(&opt, stdout, err, sizeof err) != 0) {
        fprintf(stderr, "fp8moe sample: %s\n", err);
        return 1;
    }
    return 0;
}

// ---------------------------------------------------------------------------- dispatch

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);  // logs are read line by line (tail -f, a killed run keeps its lines)
    if (argc < 2) {
        fprintf(stderr, "fp8moe: missing a command\n");
        print_usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "compare")) return compare_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "gradcompare")) return grad_compare_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "prep")) return cmd_prep(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(cmd, "export")) return export_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return eval_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "schedule")) return schedule_cli_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) {
        if (argc > 2 && !strcmp(argv[2], "gemm")) return bench_gemm_main(argc - 3, argv + 3);
        if (argc > 2 && !strcmp(argv[2], "step")) return bench_step_main(argc - 3, argv + 3);
        if (argc > 2 && !strcmp(argv[2], "attention")) return bench_attention_main(argc - 3, argv + 3);
        if (argc > 2 && !strcmp(argv[2], "a2a")) return bench_a2a_main(argc - 3, argv + 3);
        fprintf(stderr, "fp8moe bench: expected a benchmark name (gemm, step, attention, a2a)\n\nUsage:\n%s%s%s%s",
                bench_gemm_usage, bench_step_usage, bench_attention_usage, bench_a2a_usage);
        return EXIT_USAGE;
    }
    if (!strcmp(cmd, "config-doc")) {
        if (argc > 2 && !is_help(argv[2]))
            return cli_usage_error("config-doc", usage_config_doc, "unexpected argument %s", argv[2]);
        if (argc > 2) {
            printf("Usage:\n%s", usage_config_doc);
            return 0;
        }
        config_print_reference(stdout);
        return 0;
    }
    if (!strcmp(cmd, "help") || is_help(cmd)) {
        if (argc > 2) {
            const char *topic = argv[2];
            const char *u = !strcmp(topic, "train") ? usage_train : !strcmp(topic, "compare") ? compare_usage
                          : !strcmp(topic, "gradcompare") ? grad_compare_usage
                          : !strcmp(topic, "prep") ? usage_prep
                          : !strcmp(topic, "sample") ? usage_sample : !strcmp(topic, "config-doc") ? usage_config_doc
                          : !strcmp(topic, "export") ? export_usage : !strcmp(topic, "eval") ? eval_usage
                          : !strcmp(topic, "bench") ? bench_gemm_usage : NULL;
            if (!u) {
                fprintf(stderr, "fp8moe help: unknown command '%s'\n", topic);
                print_usage(stderr);
                return EXIT_USAGE;
            }
            printf("Usage:\n%s%s%s%s", u, u == bench_gemm_usage ? bench_step_usage : "",
                   u == bench_gemm_usage ? bench_attention_usage : "", u == bench_gemm_usage ? bench_a2a_usage : "");
            return 0;
        }
        print_usage(stdout);
        return 0;
    }
    fprintf(stderr, "fp8moe: unknown command '%s' (expected train, compare, gradcompare, prep, sample, export, eval, bench, config-doc or help)\n",
            cmd);
    print_usage(stderr);
    return EXIT_USAGE;
}
