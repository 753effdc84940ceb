/*
 * prep.h - text files -> byte-level llm.c token shards, plus a stamp that says which text they hold.
 *
 * `fp8moe prep` and the trainer (when data.text is set, or nothing is set) turn plain text into shards
 * the loader reads. Tokenisation is byte-level: token = byte value, vocab 256, no tokenizer files
 * needed. All texts are concatenated in the order given; the last 10% of the bytes (floor, but at
 * least 1) is the validation split, the rest is training. Output, in llm.c's naming so the loader's
 * *_train_*.bin / *_val_*.bin patterns find it:
 *   out_dir/bytes_train_000000.bin (.. _000001 .. when training text exceeds 100M bytes, llm.c's shard size)
 *   out_dir/bytes_val_000000.bin
 *   out_dir/SOURCE.txt   the stamp: each source path with its byte size and 64-bit FNV-1a hash
 * Every file is written to a temporary name and renamed into place; SOURCE.txt is removed first and
 * written last, so an interrupted prep never looks current.
 */
#ifndef FP8MOE_PREP_H
#define FP8MOE_PREP_H

#include <stddef.h>
#include <stdint.h>

#define DATA_PREP_NAME "bytes"             // shard name prefix: bytes_train_000000.bin
#define DATA_PREP_VOCAB 256                // byte-level vocabulary
#define DATA_PREP_SHARD_TOKENS 100000000   // tokens per shard at most (llm.c's FineWeb shard size)
#define DATA_PREP_STAMP "SOURCE.txt"
#define DATA_FORTUNES_DIR "/usr/share/games/fortunes"

#define DATA_FNV1A64_INIT 0xcbf29ce484222325ULL
// 64-bit FNV-1a of data (n bytes), continuing from h (start with DATA_FNV1A64_INIT).
uint64_t data_fnv1a64(const void *data, size_t n, uint64_t h);

// Prepare shards in out_dir (created with its parents when missing) from text_paths (n_paths files,
// concatenated in order). n_paths == 0 means the default text (data_default_text below).
// Returns 0, or -1 with one line in err naming the file and the problem: a missing or unreadable text
// file, text shorter than 2 bytes in total (each split needs at least 1), no default text installed,
// or a write failure.
int data_prep(const char *const *text_paths, int n_paths, const char *out_dir, char *err, size_t errsz);

// 1 when out_dir/SOURCE.txt matches text_paths exactly (same paths in the same order, same sizes and
// content hashes) and the shards it lists exist with the token counts it lists; 0 otherwise
// (including when a text file cannot be read: data_prep then reports why). n_paths == 0: default text.
int data_prep_is_current(const char *const *text_paths, int n_paths, const char *out_dir);

// The default text: the English fortune files of Debian's `fortunes` package (and `fortunes-min`, which
// it depends on) that exist under /usr/share/games/fortunes, sorted by name. A fixed list of the
// package's file names rather than a directory scan, so other fortune packages installed on the same
// machine never change what the default run trains on; the offensive ones (off/) are not in it.
// Returns paths in static storage (valid until the next call) and sets *n; NULL and *n = 0 when none
// exist (data_prep with n_paths == 0 then says to run `apt-get install fortunes` or `make deps`).
const char *const *data_default_text(int *n);
// Same, looking in `dir` instead of /usr/share/games/fortunes; when none exist, err says what to install.
const char *const *data_default_text_in(const char *dir, int *n, char *err, size_t errsz);

#endif
