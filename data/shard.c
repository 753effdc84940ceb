/*
 * shard.c - reading and writing llm.c .bin token shards (format in shard.h).
 *
 * The format is little-endian and we write the host's int32/uint16 directly, as llm.c does; the build
 * refuses big-endian hosts rather than produce shards nobody else can read.
 */
#include "data/shard.h"

#include "data/durable.h"
#include "kernels/error.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "llm.c shards are little-endian; this build writes host byte order"
#endif

uint64_t data_fnv1a64(const void *data, size_t n, uint64_t h) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;  // the 64-bit FNV prime
    }
    return h;
}

static void make_header(int32_t header[SHARD_HEADER_INTS], int64_t n) {
    memset(header, 0, SHARD_HEADER_BYTES);
    header[0] = SHARD_MAGIC;
    header[1] = SHARD_VERSION;
    header[2] = (int32_t)n;
}

uint64_t shard_checksum(const uint16_t *tokens, int64_t n) {
    int32_t header[SHARD_HEADER_INTS];
    make_header(header, n);
    uint64_t h = data_fnv1a64(header, sizeof header, DATA_FNV1A64_INIT);
    return n > 0 ? data_fnv1a64(tokens, (size_t)n * sizeof *tokens, h) : h;
}

// ---------------------------------------------------------------------------- write
int shard_write(const char *path, const uint16_t *tokens, int64_t n, char *err, size_t errsz) {
    if (n < 0 || n > SHARD_MAX_TOKENS) {
        set_err(err, errsz, "%s: cannot write %" PRId64 " tokens (a shard holds 0..%d; its header count is an int32)",
                path, n, SHARD_MAX_TOKENS);
        return -1;
    }
    int32_t header[SHARD_HEADER_INTS];
    make_header(header, n);

    DurableFile d;
    if (durable_open(&d, path, err, errsz) != 0) return -1;
    fwrite(header, sizeof header, 1, d.f);
    if (n > 0) fwrite(tokens, sizeof(uint16_t), (size_t)n, d.f);
    return durable_commit(&d, err, errsz);  // a short fwrite sets the stream's error, which the commit reports
}

// ---------------------------------------------------------------------------- read
// Opens `path`, checks magic, version and size; leaves f positioned at the first token. When hsum is
// not NULL, *hsum = FNV-1a 64 of the header bytes as read (the start of the shard's checksum).
static FILE *open_checked(const char *path, int64_t *n_tokens, uint64_t *hsum, char *err, size_t errsz) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, errsz, "%s: cannot open token shard: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        set_err(err, errsz, "%s: not a regular file (expected an llm.c token shard)", path);
        fclose(f);
        return NULL;
    }
    int64_t size = (int64_t)st.st_size;
    int32_t header[SHARD_HEADER_INTS];
    if (size < SHARD_HEADER_BYTES || fread(header, sizeof header, 1, f) != 1) {
        set_err(err, errsz, "%s: file is %" PRId64 " bytes, shorter than the %d-byte header (not an llm.c token shard)",
                path, size, SHARD_HEADER_BYTES);
        fclose(f);
        return NULL;
    }
    if (header[0] != SHARD_MAGIC) {
        set_err(err, errsz, "%s: bad magic %d (expected %d; not an llm.c token shard)", path, header[0],
                SHARD_MAGIC);
        fclose(f);
        return NULL;
    }
    if (header[1] != SHARD_VERSION) {
        set_err(err, errsz, "%s: unsupported shard version %d (expected %d: uint16 tokens%s)", path, header[1],
                SHARD_VERSION, header[1] == 2 ? "; version 2 is llm.c's uint32 LLaMA-3 format" : "");
        fclose(f);
        return NULL;
    }
    if (header[2] < 0) {
        set_err(err, errsz, "%s: header token count is %d (expected >= 0)", path, header[2]);
        fclose(f);
        return NULL;
    }
    int64_t n = header[2];
    int64_t expected = SHARD_HEADER_BYTES + 2 * n;
    if (size != expected) {
        set_err(err, errsz,
                "%s: file is %" PRId64 " bytes but its header says %" PRId64 " tokens, i.e. %d + 2*%" PRId64
                " = %" PRId64 " bytes (%s)",
                path, size, n, SHARD_HEADER_BYTES, n, expected,
                size < expected ? "truncated file" : "trailing bytes after the last token");
        fclose(f);
        return NULL;
    }
    *n_tokens = n;
    if (hsum) *hsum = data_fnv1a64(header, sizeof header, DATA_FNV1A64_INIT);
    return f;
}

int shard_open(const char *path, int64_t *n_tokens, char *err, size_t errsz) {
    int64_t n = 0;
    FILE *f = open_checked(path, &n, NULL, err, errsz);
    if (!f) return -1;
    fclose(f);
    *n_tokens = n;
    return 0;
}

int shard_file_checksum(const char *path, int64_t *n_tokens, uint64_t *sum, char *err, size_t errsz) {
    int64_t n = 0;
    uint64_t h = 0;
    FILE *f = open_checked(path, &n, &h, err, errsz);
    if (!f) return -1;
    unsigned char chunk[1 << 16];
    int64_t left = 2 * n;
    while (left > 0) {
        size_t want = left < (int64_t)sizeof chunk ? (size_t)left : sizeof chunk;
        size_t got = fread(chunk, 1, want, f);
        if (got != want) {
            set_err(err, errsz, "%s: read error after the header: %s", path,
                    ferror(f) ? strerror(errno) : "unexpected end of file (file changed while reading?)");
            fclose(f);
            return -1;
        }
        h = data_fnv1a64(chunk, got, h);
        left -= (int64_t)got;
    }
    fclose(f);
    *n_tokens = n;
    *sum = h;
    return 0;
}

int shard_read(const char *path, int vocab_size, uint16_t **tokens, int64_t *n_tokens, char *err,
               size_t errsz) {
    return shard_read_checksum(path, vocab_size, tokens, n_tokens, NULL, err, errsz);
}

int shard_read_checksum(const char *path, int vocab_size, uint16_t **tokens, int64_t *n_tokens, uint64_t *sum,
                        char *err, size_t errsz) {
    *tokens = NULL;
    *n_tokens = 0;
    if (vocab_size < 1 || vocab_size > 65536) {
        set_err(err, errsz, "%s: vocab_size %d cannot be checked against uint16 tokens (expected 1..65536)", path,
                vocab_size);
        return -1;
    }
    int64_t n = 0;
    uint64_t h = 0;
    FILE *f = open_checked(path, &n, sum ? &h : NULL, err, errsz);
    if (!f) return -1;
    uint16_t *buf = NULL;
    if (n > 0) {
        buf = malloc((size_t)n * sizeof(uint16_t));
        if (!buf) {
            set_err(err, errsz, "%s: out of memory for %" PRId64 " tokens", path, n);
            fclose(f);
            return -1;
        }
        if (fread(buf, sizeof(uint16_t), (size_t)n, f) != (size_t)n) {
            set_err(err, errsz, "%s: read error after the header: %s", path,
                    ferror(f) ? strerror(errno) : "unexpected end of file (file changed while reading?)");
            free(buf);
            fclose(f);
            return -1;
        }
    }
    fclose(f);
    for (int64_t i = 0; i < n; i++) {
        if (buf[i] >= vocab_size) {
            set_err(err, errsz, "%s: token at position %" PRId64 " is %u, not below vocab_size %d", path, i,
                    (unsigned)buf[i], vocab_size);
            free(buf);
            return -1;
        }
    }
    if (sum) *sum = n > 0 ? data_fnv1a64(buf, (size_t)n * sizeof *buf, h) : h;
    *tokens = buf;
    *n_tokens = n;
    return 0;
}
