/*
 * safetensors.c - the safetensors writer (see safetensors.h): a JSON header built in memory, then the tensors
 * streamed one by one through a conversion buffer, into a temporary file that is renamed into place when complete.
 */
#include "train/safetensors.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "data/durable.h"
#include "kernels/kernels.h"  // float_to_bf16

static size_t dtype_bytes(StDtype d) { return d == ST_BF16 ? 2 : 4; }

void st_init(StWriter *w) { memset(w, 0, sizeof *w); }

void st_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') fprintf(f, "\\%c", *c);
        else if (*c < 0x20) fprintf(f, "\\u%04x", *c);
        else fputc(*c, f);
    }
    fputc('"', f);
}

int st_metadata(StWriter *w, const char *key, const char *value, char *err, size_t err_size) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) goto oom;
    if (w->metadata) fprintf(f, "%s,", w->metadata);
    st_json_string(f, key);
    fputc(':', f);
    st_json_string(f, value);
    if (fclose(f) != 0) goto oom;
    free(w->metadata);
    w->metadata = text;
    return 0;
oom:
    free(text);
    snprintf(err, err_size, "safetensors header: out of memory");
    return -1;
}

int st_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape, char *err, size_t err_size) {
    if (ndim < 0 || ndim > ST_MAX_DIMS) {
        snprintf(err, err_size, "safetensors: tensor %s: %d dimensions, expected 0 to %d", name, ndim, ST_MAX_DIMS);
        return -1;
    }
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 256;
        StTensor *t = realloc(w->t, (size_t)cap * sizeof *t);
        if (!t) {
            snprintf(err, err_size, "safetensors: out of memory for %d tensors", cap);
            return -1;
        }
        w->t = t;
        w->cap = cap;
    }
    StTensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) {
        snprintf(err, err_size, "safetensors: out of memory");
        return -1;
    }
    t->dtype = dtype;
    t->ndim = ndim;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) {
            snprintf(err, err_size, "safetensors: tensor %s: dimension %d is %lld", name, d, (long long)shape[d]);
            free(t->name);
            return -1;
        }
        t->shape[d] = shape[d];
        numel *= shape[d];
    }
    t->begin = w->n ? w->t[w->n - 1].end : 0;
    t->end = t->begin + numel * (int64_t)dtype_bytes(dtype);
    w->n++;
    return 0;
}

// The header's JSON text, padded with spaces to make 8 + its length a multiple of 8. Returns a malloc'd string.
static char *header_text(const StWriter *w, size_t *len) {
    char *text = NULL;
    FILE *f = open_memstream(&text, len);
    if (!f) return NULL;
    fputc('{', f);
    if (w->metadata) fprintf(f, "\"__metadata__\":{%s}", w->metadata);
    for (int i = 0; i < w->n; i++) {
        const StTensor *t = &w->t[i];
        if (i > 0 || w->metadata) fputc(',', f);
        st_json_string(f, t->name);
        fprintf(f, ":{\"dtype\":\"%s\",\"shape\":[", t->dtype == ST_BF16 ? "BF16" : "F32");
        for (int d = 0; d < t->ndim; d++) fprintf(f, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        fprintf(f, "],\"data_offsets\":[%lld,%lld]}", (long long)t->begin, (long long)t->end);
    }
    fputc('}', f);
    long pos = ftell(f);
    while (pos >= 0 && (8 + pos) % 8 != 0) fputc(' ', f), pos++;
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

// fwrite that reports the system's reason.
static int write_bytes(StWriter *w, const void *p, size_t n, const char *what, char *err, size_t err_size) {
    if (n == 0 || fwrite(p, 1, n, w->out.f) == n) return 0;
    snprintf(err, err_size, "%s: writing %s failed: %s", w->out.tmp, what, strerror(errno ? errno : EIO));
    return -1;
}

int st_begin(StWriter *w, const char *path, char *err, size_t err_size) {
    if (snprintf(w->path, sizeof w->path, "%s", path) >= (int)sizeof w->path) {
        snprintf(err, err_size, "%s: path too long", path);
        return -1;
    }
    size_t len = 0;
    char *header = header_text(w, &len);
    if (!header) {
        snprintf(err, err_size, "%s: out of memory for the header", path);
        return -1;
    }
    if (durable_open(&w->out, path, err, err_size) != 0) {
        free(header);
        return -1;
    }
    unsigned char n8[8];
    for (int i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)len >> (8 * i));
    errno = 0;
    int rc = write_bytes(w, n8, 8, "the header", err, err_size) || write_bytes(w, header, len, "the header", err, err_size)
                 ? -1 : 0;
    free(header);
    if (rc != 0) st_abort(w);
    w->next = 0;
    return rc;
}

int st_write(StWriter *w, const float *values, int64_t n, char *err, size_t err_size) {
    if (!w->out.f || w->next >= w->n) {
        snprintf(err, err_size, "%s: internal error: st_write past the %d declared tensors", w->path, w->n);
        return -1;
    }
    const StTensor *t = &w->t[w->next];
    const size_t eb = dtype_bytes(t->dtype);
    if ((t->end - t->begin) != n * (int64_t)eb) {
        snprintf(err, err_size, "%s: internal error: tensor %s has %lld elements, %lld given", w->path, t->name,
                 (long long)((t->end - t->begin) / (int64_t)eb), (long long)n);
        return -1;
    }
    const int64_t chunk = 1 << 20;  // elements converted at a time
    if (w->buf_bytes < (size_t)chunk * 4) {
        void *b = realloc(w->buf, (size_t)chunk * 4);
        if (!b) {
            snprintf(err, err_size, "%s: out of memory", w->path);
            return -1;
        }
        w->buf = b;
        w->buf_bytes = (size_t)chunk * 4;
    }
    for (int64_t at = 0; at < n; at += chunk) {
        const int64_t k = n - at < chunk ? n - at : chunk;
        unsigned char *out = w->buf;
        for (int64_t j = 0; j < k; j++) {  // little-endian whatever the host
            uint32_t bits;
            if (t->dtype == ST_BF16) bits = float_to_bf16(values[at + j]);
            else memcpy(&bits, &values[at + j], 4);
            for (size_t b = 0; b < eb; b++) out[(size_t)j * eb + b] = (unsigned char)(bits >> (8 * b));
        }
        errno = 0;
        if (write_bytes(w, out, (size_t)k * eb, t->name, err, err_size) != 0) return -1;
    }
    w->next++;
    return 0;
}

int st_finish(StWriter *w, char *err, size_t err_size) {
    if (!w->out.f) {
        snprintf(err, err_size, "%s: internal error: st_finish without st_begin", w->path);
        return -1;
    }
    if (w->next != w->n) {
        snprintf(err, err_size, "%s: internal error: %d of %d tensors written", w->path, w->next, w->n);
        st_abort(w);
        return -1;
    }
    return durable_commit(&w->out, err, err_size);
}

void st_abort(StWriter *w) { durable_discard(&w->out); }

void st_free(StWriter *w) {
    st_abort(w);
    for (int i = 0; i < w->n; i++) free(w->t[i].name);
    free(w->t);
    free(w->metadata);
    free(w->buf);
    memset(w, 0, sizeof *w);
}
