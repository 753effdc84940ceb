/*
 * safetensors.h - a writer of the safetensors format (Hugging Face's tensor file), for `fp8moe export --format hf`.
 *
 * The format, all of it: an unsigned 64-bit little-endian N, then N bytes of a UTF-8 JSON object, then the tensors'
 * raw bytes. The JSON maps every tensor name to {"dtype": "BF16" | "F32", "shape": [...], "data_offsets": [begin,
 * end]}, offsets in bytes from the start of the data, and may hold "__metadata__", an object of string values
 * ({"format": "pt"}, which transformers expects). The tensors tile the data with no gap and no overlap; values are
 * little-endian and row-major. The header is padded with spaces to a multiple of 8 bytes, so every tensor starts
 * 8-aligned when its predecessors' sizes are multiples of 8 (what safetensors' own writer does).
 *
 * Use: st_add every tensor (name, dtype, shape) in the order of the file; st_begin opens the file and writes the
 * header; st_write gives each tensor's values in that order, as FP32 (converted here: BF16 rounds to nearest even,
 * NaN stays NaN); st_finish checks that every tensor was written, flushes, fsyncs and renames the file into place.
 * The file is written as `path.tmp.<pid>` and renamed over `path` only when complete (then the directory is
 * fsync'd), so a crash or a full disk never leaves a half file under `path`; st_abort removes the temporary file.
 *
 * Errors: -1 with one line in err naming the file (and the tensor) and the system's reason. This is a writer only:
 * fp8moe reads its own formats (HDF5), and the test reads the files back with Python's standard library.
 */
#ifndef FP8MOE_SAFETENSORS_H
#define FP8MOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "data/durable.h"

#define ST_MAX_DIMS 4
#define ST_PATH_MAX 2048

typedef enum { ST_BF16 = 0, ST_F32 = 1 } StDtype;

typedef struct {
    char *name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t begin, end;  // bytes from the start of the data
} StTensor;

typedef struct {
    StTensor *t;
    int n, cap;
    int next;           // the tensor st_write fills next
    char *metadata;     // the "__metadata__" object's members as JSON text ("\"format\":\"pt\"")
    DurableFile out;    // the file being written (st_begin .. st_finish); out.f NULL otherwise
    char path[ST_PATH_MAX];
    void *buf;          // conversion buffer
    size_t buf_bytes;
} StWriter;

// An empty writer; metadata pairs are added with st_metadata.
void st_init(StWriter *w);
// Adds "key": "value" to __metadata__ (both escaped here). Returns 0 or -1 (out of memory).
int st_metadata(StWriter *w, const char *key, const char *value, char *err, size_t err_size);
// Declares the next tensor of the file. ndim 0..ST_MAX_DIMS, every dimension >= 0; names must be unique (not
// checked here: the caller's table is). Returns 0 or -1.
int st_add(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape, char *err, size_t err_size);
// Creates path's temporary file and writes the header. Returns 0 or -1 (nothing is left behind on failure).
int st_begin(StWriter *w, const char *path, char *err, size_t err_size);
// Writes the next declared tensor from n FP32 values (n must be its element count). Returns 0 or -1.
int st_write(StWriter *w, const float *values, int64_t n, char *err, size_t err_size);
// Every tensor written: flush, fsync, close, rename to path, fsync the directory. Returns 0 or -1 (the temporary
// file is then removed).
int st_finish(StWriter *w, char *err, size_t err_size);
// Closes and removes the temporary file of a write that will not be finished (no-op when none is open).
void st_abort(StWriter *w);
// Frees the table (and aborts an unfinished write).
void st_free(StWriter *w);

// Writes s to f as a JSON string with its quotes (", \ and control characters escaped). Shared with the
// config.json writer.
void st_json_string(FILE *f, const char *s);

#endif
