/*
 * prep.c - byte-level text -> llm.c shards and the SOURCE.txt stamp (interface and format in prep.h).
 *
 * The whole text is read into memory (byte-level corpora for this project are megabytes); shards are
 * written from it in pieces of at most DATA_PREP_SHARD_TOKENS tokens.
 */
#include "data/prep.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/durable.h"
#include "data/shard.h"
#include "kernels/error.h"

// ---------------------------------------------------------------------------- default text
// Plain fortune files of Debian's `fortunes` and `fortunes-min` (1:1.99.1), sorted by strcmp.
static const char *const fortune_names[] = {
    "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
    "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
    "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news",
    "paradoxum", "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science",
    "songs-poems", "sports", "startrek", "tao", "translate-me", "wisdom", "work", "zippy",
};
#define N_FORTUNES ((int)(sizeof fortune_names / sizeof fortune_names[0]))
#define DEFAULT_PATH_MAX 1024

const char *const *data_default_text_in(const char *dir, int *n, char *err, size_t errsz) {
    static char paths[N_FORTUNES][DEFAULT_PATH_MAX];
    static const char *found[N_FORTUNES];
    int count = 0;
    for (int i = 0; i < N_FORTUNES; i++) {
        int len = snprintf(paths[count], DEFAULT_PATH_MAX, "%s/%s", dir, fortune_names[i]);
        struct stat st;
        if (len < DEFAULT_PATH_MAX && stat(paths[count], &st) == 0 && S_ISREG(st.st_mode)) {
            found[count] = paths[count];
            count++;
        }
    }
    *n = count;
    if (count == 0) {
        set_err(err, errsz,
                "no text given (data.text is empty) and none of the English fortune files of Debian's "
                "`fortunes` package exist under %s: run `apt-get install fortunes` (or `make deps`), or set "
                "data.text to your own text files",
                dir);
        return NULL;
    }
    return found;
}

const char *const *data_default_text(int *n) { return data_default_text_in(DATA_FORTUNES_DIR, n, NULL, 0); }

// ---------------------------------------------------------------------------- reading sources
typedef struct {
    unsigned char *bytes;  // all texts concatenated (NULL when only hashing)
    int64_t total;
    int64_t *sizes;        // per source
    uint64_t *hashes;      // per source, FNV-1a 64 of its content
} SourceText;

static void source_free(SourceText *s) {
    free(s->bytes);
    free(s->sizes);
    free(s->hashes);
    memset(s, 0, sizeof *s);
}

static const char *file_kind(mode_t mode) {
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISDIR(mode)) return "a directory";
    return "a file of another kind";
}

// Opens a text file for reading, refusing anything but a regular file (a device such as /dev/zero
// never ends, a FIFO blocks). O_NONBLOCK keeps the open itself from blocking on a FIFO; the type is
// checked on the open descriptor, so a file swapped after a check cannot slip through.
static FILE *open_text(const char *path, char *err, size_t errsz) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errsz, "%s: cannot read text file: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        set_err(err, errsz, "%s: cannot read text file: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        set_err(err, errsz, "%s: not a regular file (it is %s); data.text and `fp8moe prep --text` take regular text "
                "files", path, file_kind(st.st_mode));
        close(fd);
        return NULL;
    }
    int flags = fcntl(fd, F_GETFL);
    FILE *f = flags >= 0 && fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        set_err(err, errsz, "%s: cannot read text file: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

// Read every source (keep_bytes: also keep the concatenated content). Returns 0 or -1 with err.
static int read_sources(const char *const *paths, int n, int keep_bytes, SourceText *s, char *err,
                        size_t errsz) {
    memset(s, 0, sizeof *s);
    s->sizes = calloc((size_t)n, sizeof *s->sizes);
    s->hashes = calloc((size_t)n, sizeof *s->hashes);
    if (!s->sizes || !s->hashes) {
        set_err(err, errsz, "out of memory reading %d text files", n);
        source_free(s);
        return -1;
    }
    size_t cap = 0;
    unsigned char chunk[1 << 16];
    for (int i = 0; i < n; i++) {
        if (strchr(paths[i], '\n')) {
            set_err(err, errsz, "text file name contains a newline (cannot be recorded in %s): %s", DATA_PREP_STAMP,
                    paths[i]);
            source_free(s);
            return -1;
        }
        FILE *f = open_text(paths[i], err, errsz);
        if (!f) {
            source_free(s);
            return -1;
        }
        uint64_t h = DATA_FNV1A64_INIT;
        int64_t size = 0;
        size_t got;
        while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
            h = data_fnv1a64(chunk, got, h);
            size += (int64_t)got;
            if (keep_bytes) {
                size_t need = (size_t)s->total + got;
                if (need > cap) {
                    size_t new_cap = cap ? cap : (1u << 20);
                    while (new_cap < need) new_cap *= 2;
                    unsigned char *nb = realloc(s->bytes, new_cap);
                    if (!nb) {
                        set_err(err, errsz, "%s: out of memory after %" PRId64 " bytes of text", paths[i], s->total);
                        fclose(f);
                        source_free(s);
                        return -1;
                    }
                    s->bytes = nb;
                    cap = new_cap;
                }
                memcpy(s->bytes + s->total, chunk, got);
            }
            s->total += (int64_t)got;
        }
        if (ferror(f)) {
            set_err(err, errsz, "%s: cannot read text file: %s", paths[i], strerror(errno));
            fclose(f);
            source_free(s);
            return -1;
        }
        fclose(f);
        s->sizes[i] = size;
        s->hashes[i] = h;
    }
    return 0;
}

// ---------------------------------------------------------------------------- layout of a prep
// val = floor(total / 10), but at least 1 so both splits hold a token (hence total >= 2).
static int64_t val_tokens_for(int64_t total) {
    int64_t val = total / 10;
    return val < 1 ? 1 : val;
}
static int64_t shards_for(int64_t tokens) {
    int64_t k = (tokens + DATA_PREP_SHARD_TOKENS - 1) / DATA_PREP_SHARD_TOKENS;
    return k < 1 ? 1 : k;
}
static char *join_path(const char *dir, const char *name) {
    size_t dl = strlen(dir), nl = strlen(name);
    char *p = malloc(dl + nl + 2);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    p[dl] = '/';
    memcpy(p + dl + 1, name, nl + 1);
    return p;
}
static char *shard_path(const char *dir, const char *split, int64_t index) {
    char name[128];
    snprintf(name, sizeof name, "%s_%s_%06" PRId64 ".bin", DATA_PREP_NAME, split, index);
    return join_path(dir, name);
}

// The stamp's full text (malloc'd). Any change to the tokenisation must change the "format" line.
static char *stamp_text(const char *const *paths, int n, const SourceText *s) {
    int64_t val = val_tokens_for(s->total), train = s->total - val;
    size_t cap = 512;
    for (int i = 0; i < n; i++) cap += strlen(paths[i]) + 64;
    char *t = malloc(cap);
    if (!t) return NULL;
    size_t len = (size_t)snprintf(t, cap,
                                  "# fp8moe prep stamp: the shards in this directory hold these text files,\n"
                                  "# concatenated in this order. Columns: bytes, FNV-1a 64 of the content, path.\n"
                                  "format bytes-v1 vocab %d val last 10%% floor min 1\n"
                                  "train %" PRId64 " tokens in %" PRId64 " shards\n"
                                  "val %" PRId64 " tokens in %" PRId64 " shards\n",
                                  DATA_PREP_VOCAB, train, shards_for(train), val, shards_for(val));
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(t + len, cap - len, "%" PRId64 " %016" PRIx64 " %s\n", s->sizes[i], s->hashes[i],
                                paths[i]);
    return t;
}

// The stamp's shard section: this line, then one "shard <16 hex digits> <file name>" line per shard.
#define STAMP_SHARDS_LINE "# shards: FNV-1a 64 of each shard file (header and tokens), then its name\n"

// Write tokens [begin, begin+count) of the text as shards <split>_000000.., print each one's stamp
// line to `lines`, and remove stale higher-numbered shards of the same split left by an earlier,
// larger prep.
static int write_split(const char *dir, const char *split, const unsigned char *bytes, int64_t count, FILE *lines,
                       char *err, size_t errsz) {
    int64_t n_shards = shards_for(count);
    int64_t piece = count < DATA_PREP_SHARD_TOKENS ? count : DATA_PREP_SHARD_TOKENS;
    uint16_t *tokens = malloc((size_t)(piece > 0 ? piece : 1) * sizeof(uint16_t));
    if (!tokens) {
        set_err(err, errsz, "%s: out of memory for %" PRId64 " tokens", dir, piece);
        return -1;
    }
    for (int64_t k = 0; k < n_shards; k++) {
        int64_t start = k * DATA_PREP_SHARD_TOKENS;
        int64_t n = count - start < DATA_PREP_SHARD_TOKENS ? count - start : DATA_PREP_SHARD_TOKENS;
        for (int64_t i = 0; i < n; i++) tokens[i] = bytes[start + i];  // byte-level: token = byte value
        char *path = shard_path(dir, split, k);
        int rc = path ? shard_write(path, tokens, n, err, errsz) : -1;
        if (!path) set_err(err, errsz, "%s: out of memory", dir);
        if (rc == 0) fprintf(lines, "shard %016" PRIx64 " %s\n", shard_checksum(tokens, n), strrchr(path, '/') + 1);
        free(path);
        if (rc != 0) {
            free(tokens);
            return -1;
        }
    }
    free(tokens);
    for (int64_t k = n_shards;; k++) {
        char *path = shard_path(dir, split, k);
        if (!path) break;
        int gone = unlink(path) != 0;
        free(path);
        if (gone) break;
    }
    return 0;
}

// ---------------------------------------------------------------------------- prep
int data_prep(const char *const *text_paths, int n_paths, const char *out_dir, char *err, size_t errsz) {
    if (n_paths == 0) {
        text_paths = data_default_text_in(DATA_FORTUNES_DIR, &n_paths, err, errsz);
        if (!text_paths) return -1;
    }
    SourceText s;
    if (read_sources(text_paths, n_paths, 1, &s, err, errsz) != 0) return -1;
    if (s.total < 2) {
        set_err(err, errsz,
                "%s%s: the text is %" PRId64 " bytes in total (%d file%s); need at least 2 (1 for training, 1 for "
                "validation)",
                text_paths[0], n_paths > 1 ? " ..." : "", s.total, n_paths, n_paths > 1 ? "s" : "");
        source_free(&s);
        return -1;
    }
    char *stamp = stamp_text(text_paths, n_paths, &s);
    char *stamp_path = join_path(out_dir, DATA_PREP_STAMP);
    char *section = NULL;
    size_t section_len = 0;
    FILE *lines = NULL;
    int rc = -1;
    if (!stamp || !stamp_path) {
        set_err(err, errsz, "%s: out of memory", out_dir);
        goto done;
    }
    if (durable_make_dirs(out_dir, err, errsz) != 0) goto done;
    if (unlink(stamp_path) != 0 && errno != ENOENT) {  // a crash below must not leave an old stamp
        set_err(err, errsz, "%s: cannot remove the old stamp: %s", stamp_path, strerror(errno));
        goto done;
    }
    int64_t val = val_tokens_for(s.total), train = s.total - val;
    lines = open_memstream(&section, &section_len);
    if (!lines) {
        set_err(err, errsz, "%s: out of memory", out_dir);
        goto done;
    }
    fputs(STAMP_SHARDS_LINE, lines);
    if (write_split(out_dir, "train", s.bytes, train, lines, err, errsz) != 0) goto done;
    if (write_split(out_dir, "val", s.bytes + train, val, lines, err, errsz) != 0) goto done;
    int closed = fclose(lines);
    lines = NULL;
    char *full = closed == 0 ? malloc(strlen(stamp) + section_len + 1) : NULL;
    if (!full) {
        set_err(err, errsz, "%s: out of memory", out_dir);
        goto done;
    }
    memcpy(full, stamp, strlen(stamp));
    memcpy(full + strlen(stamp), section, section_len + 1);
    free(stamp);
    stamp = full;
    if (durable_write_text(stamp_path, stamp, err, errsz) != 0) goto done;
    rc = 0;
done:
    if (lines) fclose(lines);
    free(section);
    free(stamp);
    free(stamp_path);
    source_free(&s);
    return rc;
}

// ---------------------------------------------------------------------------- checking a prep
char *data_stamp_load(const char *dir) {
    char *path = join_path(dir, DATA_PREP_STAMP);
    FILE *f = path ? fopen(path, "rb") : NULL;
    free(path);
    if (!f) return NULL;
    struct stat st;
    char *text = NULL;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= (16 << 20) &&
        (text = malloc((size_t)st.st_size + 1)) != NULL) {
        size_t got = fread(text, 1, (size_t)st.st_size, f);
        if (got != (size_t)st.st_size || memchr(text, '\0', got)) {
            free(text);
            text = NULL;
        } else {
            text[got] = '\0';
        }
    }
    fclose(f);
    return text;
}

// Parses "shard <16 lowercase hex> " at p; returns the name's start, or NULL.
static const char *parse_shard_line(const char *p, uint64_t *sum) {
    if (strncmp(p, "shard ", 6) != 0) return NULL;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = p[6 + i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return NULL;
        v = v << 4 | (uint64_t)d;
    }
    if (p[22] != ' ') return NULL;
    *sum = v;
    return p + 23;
}

int data_stamp_shard_sum(const char *stamp, const char *name, uint64_t *sum) {
    size_t nl = strlen(name);
    for (const char *line = stamp; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
        uint64_t v;
        const char *at = parse_shard_line(line, &v);
        if (at && strncmp(at, name, nl) == 0 && (at[nl] == '\n' || at[nl] == '\0')) {
            *sum = v;
            return 1;
        }
    }
    return 0;
}

// Checks the shard lines of a split at *rest (advanced past them) against the files in dir: each
// expected shard in order, with its token count and checksum. Returns 1, or 0 with why set.
static int check_split(const char *dir, const char *split, int64_t count, const char *stamp_path, const char **rest,
                       char *why, size_t whysz) {
    int64_t n_shards = shards_for(count);
    for (int64_t k = 0; k < n_shards; k++) {
        int64_t want = count - k * DATA_PREP_SHARD_TOKENS;
        if (want > DATA_PREP_SHARD_TOKENS) want = DATA_PREP_SHARD_TOKENS;
        char *path = shard_path(dir, split, k);
        if (!path) {
            set_err(why, whysz, "%s: out of memory", dir);
            return 0;
        }
        const char *name = strrchr(path, '/') + 1;
        uint64_t recorded = 0, actual = 0;
        const char *at = parse_shard_line(*rest, &recorded);
        size_t nl = strlen(name);
        if (!at || strncmp(at, name, nl) != 0 || at[nl] != '\n') {
            set_err(why, whysz, "%s: no checksum line for %s where expected (stamp edited?)", stamp_path, name);
            free(path);
            return 0;
        }
        *rest = at + nl + 1;
        int64_t n = -1;
        char err[512];
        if (shard_file_checksum(path, &n, &actual, err, sizeof err) != 0) {
            set_err(why, whysz, "%s", err);
        } else if (n != want) {
            set_err(why, whysz, "%s: holds %" PRId64 " tokens, %s says %" PRId64, path, n, stamp_path, want);
        } else if (actual != recorded) {
            set_err(why, whysz, "%s: checksum %016" PRIx64 " differs from %016" PRIx64 " recorded in %s (the shard was "
                    "corrupted or changed after it was prepared)", path, actual, recorded, stamp_path);
        } else {
            free(path);
            continue;
        }
        free(path);
        return 0;
    }
    return 1;
}

int data_prep_check(const char *const *text_paths, int n_paths, const char *out_dir, char *why, size_t whysz) {
    set_err(why, whysz, "%s", "");
    if (n_paths == 0) {
        text_paths = data_default_text(&n_paths);
        if (!text_paths) return 0;
    }
    SourceText s;
    if (read_sources(text_paths, n_paths, 0, &s, NULL, 0) != 0) return 0;
    int current = 0;
    char *expected = stamp_text(text_paths, n_paths, &s);
    char *stamp_path = join_path(out_dir, DATA_PREP_STAMP);
    char *stamp = data_stamp_load(out_dir);
    if (expected && stamp_path && stamp && s.total >= 2 && strncmp(stamp, expected, strlen(expected)) == 0) {
        // the stamp is of these texts; now the shards must be what it says
        const char *rest = stamp + strlen(expected);
        int64_t val = val_tokens_for(s.total);
        if (strncmp(rest, STAMP_SHARDS_LINE, strlen(STAMP_SHARDS_LINE)) != 0) {
            set_err(why, whysz, "%s: lists no shard checksums (written by an older fp8moe, or edited)", stamp_path);
        } else {
            rest += strlen(STAMP_SHARDS_LINE);
            current = check_split(out_dir, "train", s.total - val, stamp_path, &rest, why, whysz) &&
                      check_split(out_dir, "val", val, stamp_path, &rest, why, whysz);
            if (current && *rest) {
                set_err(why, whysz, "%s: unexpected lines after the shard checksums (stamp edited?)", stamp_path);
                current = 0;
            }
        }
    }
    free(stamp);
    free(expected);
    free(stamp_path);
    source_free(&s);
    return current;
}

int data_prep_is_current(const char *const *text_paths, int n_paths, const char *out_dir) {
    char why[1024];
    int current = data_prep_check(text_paths, n_paths, out_dir, why, sizeof why);
    if (!current && why[0]) {
        fprintf(stderr, "fp8moe: warning: %s; preparing the text again\n", why);
        fflush(stderr);
    }
    return current;
}
