/*
 * metrics.c - step/eval log lines and the JSON Lines metrics file (see metrics.h).
 *
 * Plain snprintf formatting; numbers that are not finite print as "nan"/"inf" in the human line (so
 * a diverging run is visible) and as null in JSON (which has no NaN).
 */
#include "train/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/run_dir.h"

// ---------------------------------------------------------------------------- human-readable pieces

void format_duration(char *buf, size_t size, double seconds) {
    if (!isfinite(seconds) || seconds < 0) {
        snprintf(buf, size, "-");
        return;
    }
    long s = (long)(seconds + 0.5);
    if (s < 60) snprintf(buf, size, "%lds", s);
    else if (s < 3600) snprintf(buf, size, "%ldm%02lds", s / 60, s % 60);
    else snprintf(buf, size, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
}

void format_thousands(char *buf, size_t size, double x) {
    if (size == 0) return;
    if (!isfinite(x) || x < 0) x = 0;
    char digits[32];
    snprintf(digits, sizeof digits, "%.0f", floor(x));
    size_t n = strlen(digits), out = 0;
    for (size_t i = 0; i < n && out + 1 < size; i++) {
        // a comma before every group of three digits counted from the right, except at the start
        if (i > 0 && (n - i) % 3 == 0) {
            buf[out++] = ',';
            if (out + 1 >= size) break;
        }
        buf[out++] = digits[i];
    }
    buf[out] = '\0';
}

void format_step_line(char *buf, size_t size, const StepMetrics *s) {
    char mtp[48] = "", load[48] = "", fp8[128] = "", tok[32], elapsed[32], eta[32];
    if (s->has_mtp) snprintf(mtp, sizeof mtp, " | mtp %.4f", s->mtp);
    int at = 0;
    if (s->has_fp8) at = snprintf(fp8, sizeof fp8, " | fp8 gemms %lld", (long long)s->fp8_gemms);
    if (s->has_nodes)
        snprintf(fp8 + at, sizeof fp8 - (size_t)at, " | a2a rows %lld in-node %lld cross-node, <= %d nodes/token",
                 (long long)s->rows_within_node, (long long)s->rows_across_nodes, s->max_nodes_per_token);
    if (s->has_moe) snprintf(load, sizeof load, " | load max/mean %.2f", s->load_max_mean);
    format_thousands(tok, sizeof tok, s->tokens_per_s);
    format_duration(elapsed, sizeof elapsed, s->elapsed_s);
    format_duration(eta, sizeof eta, s->eta_s);
    snprintf(buf, size,
             "step %d/%d | loss %.4f%s | bal %.2e%s | lr %.2e | gnorm %.3f | %s tok/s | %.3g TFLOPS | elapsed %s | "
             "eta %s%s",
             s->step, s->total_steps, s->loss, mtp, s->balance, load, s->lr, s->grad_norm, tok, s->model_tflops, elapsed,
             eta, fp8);
}

void format_eval_line(char *buf, size_t size, const EvalMetrics *e) {
    snprintf(buf, size, "eval step %d | val_loss=%.4f | %.1fs", e->step, e->val_loss, e->seconds);
}

// ---------------------------------------------------------------------------- JSON Lines

static int write_line(MetricsLog *log, const char *line, char *err, size_t err_size) {
    if (!log->f) {
        snprintf(err, err_size, "metrics file is not open");
        return -1;
    }
    if (fprintf(log->f, "%s}\n", line) < 0 || fflush(log->f) != 0) {
        snprintf(err, err_size, "%s: cannot write metrics: %s", log->path, strerror(errno));
        return -1;
    }
    return 0;
}

// 1 when the first bytes are those of a metrics file this program wrote (any of its record types).
static int looks_like_metrics(const char *head) {
    return !strncmp(head, "{\"type\":\"run\"", 13) || !strncmp(head, "{\"type\":\"step\"", 14) ||
           !strncmp(head, "{\"type\":\"eval\"", 14);
}

// Refuses to truncate a path that holds something other than an earlier metrics file (the job file,
// a weights file: a typo in log.jsonl must not destroy it), or that a live run is writing (it holds
// an exclusive flock on the file).
static int check_replaceable(const char *path, char *err, size_t err_size) {
    struct stat st;
    if (stat(path, &st) != 0) return 0;  // a new file
    if (S_ISDIR(st.st_mode)) {
        snprintf(err, err_size, "%s is a directory; expected a metrics file path (log.jsonl)", path);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) return 0;  // /dev/null and the like: written, never replaced
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;  // unreadable: fopen for writing below reports what is wrong
    int rc = 0;
    char head[32] = "";
    if (flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
        snprintf(err, err_size, "%s is being written by another fp8moe run; choose another log.jsonl", path);
        rc = -1;
    } else if (st.st_size > 0) {
        ssize_t n = pread(fd, head, sizeof head - 1, 0);
        head[n > 0 ? n : 0] = '\0';
        if (!looks_like_metrics(head)) {
            for (char *c = head; *c; c++)
                if (*c < 32 || *c > 126) *c = '.';
            snprintf(err, err_size, "%s exists and is not an fp8moe metrics file (it starts with \"%.16s\"); "
                     "refusing to overwrite it: set log.jsonl to another path or remove the file", path, head);
            rc = -1;
        }
    }
    close(fd);
    return rc;
}

// The step of a record line ("step":N), or -1 for a record without one (the run records).
static int64_t record_step(const char *line) {
    const char *at = strstr(line, "\"step\":");
    return at ? strtoll(at + 7, NULL, 10) : -1;
}

// Copies the records of `from` that a run resumed at step `after` continues (metrics_open) into f.
static int copy_records_through(FILE *f, const char *from, int64_t after, char *err, size_t err_size) {
    FILE *in = fopen(from, "r");
    if (!in) return 0;  // nothing earlier (a first run into this directory)
    char line[8192];
    int rc = 0;
    while (fgets(line, sizeof line, in)) {
        if (line[0] != '{') continue;  // (a line cut by a crash mid-write)
        if (!strchr(line, '\n')) continue;
        if (record_step(line) <= after && fputs(line, f) == EOF) {
            snprintf(err, err_size, "cannot copy the earlier records of %s: %s", from, strerror(errno));
            rc = -1;
            break;
        }
    }
    fclose(in);
    return rc;
}

int metrics_open(MetricsLog *log, const char *path, const char *job, int64_t continue_after, char *err,
                 size_t err_size) {
    memset(log, 0, sizeof *log);
    snprintf(log->path, sizeof log->path, "%s", path);
    if (check_replaceable(path, err, err_size) != 0) return -1;
    struct stat st;  // an earlier metrics file that run_dir_keep_previous keeps (the one a resume continues)
    const int earlier = stat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
    if (run_dir_keep_previous(path, "log.jsonl", err, err_size) != 0) return -1;
    log->f = fopen(path, "w");
    if (!log->f) {
        snprintf(err, err_size, "%s: cannot open the metrics file for writing: %s", path, strerror(errno));
        return -1;
    }
    flock(fileno(log->f), LOCK_EX | LOCK_NB);  // tells a second run (check_replaceable) the file is live
    if (continue_after >= 0 && earlier) {
        char prev[sizeof log->path + 16];
        if (run_dir_previous_name(path, prev, sizeof prev) != 0 ||
            copy_records_through(log->f, prev, continue_after, err, err_size) != 0) {
            if (!err[0]) snprintf(err, err_size, "%s: its earlier file's name is too long", path);
            metrics_close(log);
            return -1;
        }
    }
    // The first record is written now, so an output that cannot take data (/dev/full, a full disk)
    // stops the run before its first step instead of after it.
    char line[1400];
    snprintf(line, sizeof line, "{\"type\":\"run\",\"format\":\"%s\",\"pid\":%ld,\"job\":\"", METRICS_FORMAT,
             (long)getpid());
    size_t len = strlen(line);
    for (const char *c = job; *c && len + 8 < sizeof line; c++) {  // JSON string escaping of the job path
        if (*c == '"' || *c == '\\') line[len++] = '\\';
        if ((unsigned char)*c < 32) len += (size_t)snprintf(line + len, sizeof line - len, "\\u%04x", *c);
        else line[len++] = *c;
    }
    snprintf(line + len, sizeof line - len, "\"");
    if (write_line(log, line, err, err_size) != 0) {
        metrics_close(log);
        return -1;
    }
    return 0;
}

// Appends `"key":value` to buf (JSON number, or null when not finite).
static void json_number(char *buf, size_t size, const char *key, double x) {
    size_t len = strlen(buf);
    if (len >= size) return;
    if (isfinite(x)) snprintf(buf + len, size - len, ",\"%s\":%.9g", key, x);
    else snprintf(buf + len, size - len, ",\"%s\":null", key);
}

int metrics_write_step(MetricsLog *log, const StepMetrics *s, char *err, size_t err_size) {
    char line[1024];
    snprintf(line, sizeof line, "{\"type\":\"step\",\"step\":%d,\"total_steps\":%d", s->step, s->total_steps);
    json_number(line, sizeof line, "loss", s->loss);
    if (s->has_mtp) json_number(line, sizeof line, "mtp_loss", s->mtp);
    json_number(line, sizeof line, "balance_loss", s->balance);
    if (s->has_moe) json_number(line, sizeof line, "load_max_mean", s->load_max_mean);
    json_number(line, sizeof line, "lr", s->lr);
    json_number(line, sizeof line, "grad_norm", s->grad_norm);
    json_number(line, sizeof line, "tokens_per_s", s->tokens_per_s);
    json_number(line, sizeof line, "model_tflops", s->model_tflops);
    json_number(line, sizeof line, "elapsed_s", s->elapsed_s);
    if (s->has_fp8) {
        size_t len = strlen(line);
        snprintf(line + len, sizeof line - len, ",\"fp8_gemms\":%lld", (long long)s->fp8_gemms);
    }
    if (s->has_nodes) {
        size_t len = strlen(line);
        snprintf(line + len, sizeof line - len,
                 ",\"a2a_rows_within_node\":%lld,\"a2a_rows_across_nodes\":%lld,\"nodes_per_token_max\":%d",
                 (long long)s->rows_within_node, (long long)s->rows_across_nodes, s->max_nodes_per_token);
    }
    return write_line(log, line, err, err_size);
}

int metrics_write_eval(MetricsLog *log, const EvalMetrics *e, char *err, size_t err_size) {
    char line[512];
    snprintf(line, sizeof line, "{\"type\":\"eval\",\"step\":%d", e->step);
    json_number(line, sizeof line, "val_loss", e->val_loss);
    size_t len = strlen(line);
    snprintf(line + len, sizeof line - len, ",\"tokens\":%lld", (long long)e->tokens);
    json_number(line, sizeof line, "seconds", e->seconds);
    return write_line(log, line, err, err_size);
}

void metrics_close(MetricsLog *log) {
    if (log->f) fclose(log->f);
    log->f = NULL;
}
