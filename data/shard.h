/*
 * shard.h - token shards in llm.c's .bin format: the one on-disk form of training data.
 *
 * A shard is a header of 256 little-endian int32 followed by uint16 token ids:
 *   header[0] = 20240520 (magic), header[1] = 1 (version: uint16 tokens, GPT-2-sized vocabularies),
 *   header[2] = number of tokens N, header[3..255] = 0;  then N uint16 tokens;  file size = 1024 + 2N.
 * This is exactly what llm.c's dev/data scripts write (version 2, uint32 LLaMA-3 tokens, is not
 * supported), so shards made by those scripts (e.g. GPT-2 tokenised FineWeb) load unchanged, and the
 * byte-level shards made by data/prep.c load in llm.c.
 *
 * Reading validates everything a user could get wrong: magic, version, a file size that matches the
 * header (truncated or trailing bytes are errors, never silently used) and every token < vocab_size.
 * Errors are one line naming the file, what was found and what was expected.
 */
#ifndef FP8MOE_SHARD_H
#define FP8MOE_SHARD_H

#include <stddef.h>
#include <stdint.h>

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_INTS 256
#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)
#define SHARD_MAX_TOKENS INT32_MAX  // header[2] is an int32

// Write tokens (n) to `path` atomically and durably: a temporary file in the same directory, fsync,
// rename(2), fsync of the directory, so a reader never sees a half-written shard. Returns 0, or -1
// with a one-line message in err.
int shard_write(const char *path, const uint16_t *tokens, int64_t n, char *err, size_t errsz);

// 64-bit FNV-1a of data (n bytes), continuing from h (start with DATA_FNV1A64_INIT): the project's
// one checksum (prep stamps hash their texts and shards with it).
#define DATA_FNV1A64_INIT 0xcbf29ce484222325ULL
uint64_t data_fnv1a64(const void *data, size_t n, uint64_t h);

// Shard checksums: FNV-1a 64 of every byte of the shard file, header and tokens.
// shard_checksum: of the file shard_write writes for tokens (n), computed in memory.
uint64_t shard_checksum(const uint16_t *tokens, int64_t n);
// shard_file_checksum: of the file on disk; validates it like shard_open and sets *n_tokens. 0 or -1.
int shard_file_checksum(const char *path, int64_t *n_tokens, uint64_t *sum, char *err, size_t errsz);

// Check the header and the file size of `path` and set *n_tokens; reads no tokens. Returns 0 or -1.
int shard_open(const char *path, int64_t *n_tokens, char *err, size_t errsz);

// Read the whole shard: validates like shard_open, then every token against vocab_size (1..65536).
// On success *tokens is a malloc'd array of *n_tokens ids (the caller frees it; NULL when the shard is
// empty) and 0 is returned. On error returns -1, *tokens = NULL, *n_tokens = 0.
int shard_read(const char *path, int vocab_size, uint16_t **tokens, int64_t *n_tokens, char *err,
               size_t errsz);
// shard_read that also sets *sum (when not NULL) to the checksum of the bytes it read.
int shard_read_checksum(const char *path, int vocab_size, uint16_t **tokens, int64_t *n_tokens, uint64_t *sum,
                        char *err, size_t errsz);

#endif
