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
 *   out_dir/SOURCE.txt   the stamp: each source path with its byte size and 64-bit FNV-1a hash, then
 *                        each shard's name with the FNV-1a 64 of its file (header and tokens):
 *                          # shards: FNV-1a 64 of each shard file (header and tokens), then its name
 *                          shard 05ba1a5b5b10d6f2 bytes_train_000000.bin
 * Every file is written to a temporary name, fsync'ed and renamed into place (then its directory is
 * fsync'ed); SOURCE.txt is removed first and written last, so an interrupted prep never looks current.
 * Text inputs must be regular files: a device, FIFO, socket or directory is refused by name (reading
 * /dev/zero or a FIFO would never end).
 */
#ifndef FP8MOE_PREP_H
#define FP8MOE_PREP_H

#include <stddef.h>
#include <stdint.h>

#include "data/shard.h"  // data_fnv1a64, DATA_FNV1A64_INIT

#define DATA_PREP_NAME "bytes"             // shard name prefix: bytes_train_000000.bin
#define DATA_PREP_VOCAB 256                // byte-level vocabulary
#define DATA_PREP_SHARD_TOKENS 100000000   // tokens per shard at most (llm.c's FineWeb shard size)
#define DATA_PREP_STAMP "SOURCE.txt"
#define DATA_FORTUNES_DIR "/usr/share/games/fortunes"

// Prepare shards in out_dir (created with its parents when missing) from text_paths (n_paths files,
// concatenated in order). n_paths == 0 means the default text (data_default_text below).
// Returns 0, or -1 with one line in err naming the file and the problem: a missing or unreadable text
// file, text shorter than 2 bytes in total (each split needs at least 1), no default text installed,
// or a write failure.
int data_prep(const char *const *text_paths, int n_paths, const char *out_dir, char *err, size_t errsz);

// 1 when out_dir/SOURCE.txt matches text_paths exactly (same paths in the same order, same sizes and
// content hashes) and every shard it lists exists with its token count and the checksum it records
// (each shard is read whole); 0 otherwise (including when a text file cannot be read: data_prep then
// reports why). n_paths == 0: default text. `why` gets "" when out_dir simply holds no preparation
// of these texts (none yet, or of other texts), and one line when the stamp matches the texts but
// the shards cannot be trusted: a shard missing, invalid, or with a checksum that differs from the
// stamp's (corrupted or edited after preparation), or a stamp without shard checksums (written by an
// older fp8moe). Either way data_prep makes the directory current again.
int data_prep_check(const char *const *text_paths, int n_paths, const char *out_dir, char *why, size_t whysz);

// data_prep_check that prints its non-empty reason to stderr ("fp8moe: warning: ...; preparing the
// text again"), so a caller that then runs data_prep tells the user why the work is redone.
int data_prep_is_current(const char *const *text_paths, int n_paths, const char *out_dir);

// The stamp of a prepared directory (dir/SOURCE.txt) as one malloc'd NUL-terminated string, or NULL
// when there is none (or it cannot be read, or is over 16 MiB).
char *data_stamp_load(const char *dir);
// 1 and *sum when the stamp text lists shard `name` (a file name, no directory) with a checksum, else 0.
int data_stamp_shard_sum(const char *stamp, const char *name, uint64_t *sum);

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
