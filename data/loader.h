/*
 * loader.h - deterministic, resumable micro-batches of token windows from llm.c shards.
 *
 * The loader opens every shard of one split in a directory (*_train_*.bin or *_val_*.bin, sorted by
 * name with strcmp, so the order never depends on the locale) and reads them whole into memory:
 * shards here are small (a byte-level corpus is megabytes). Streaming shards is future work for
 * FineWeb-sized data; the window/order rules below would not change.
 *
 * Windows. Each shard is cut into windows of T+1 consecutive tokens starting at 0, T, 2T, ... (llm.c's
 * stride T: window k's last token is window k+1's first); only windows that fit whole count, and no
 * window crosses a shard boundary. Window ids run over the shards in name order. A window is one row:
 * inputs = row[0..T-1], main targets = row[1..T]; the model derives its MTP targets from the same row
 * (depth k at position i predicts row[i+k+1], masked when i+k+1 > T).
 *
 * Order.
 *  - train: epoch e visits the W windows in a permutation made by Fisher-Yates driven by the
 *    counter-based RNG keyed by (seed, e) (kernels/rng.h), so the same seed gives the same batches on
 *    any machine and thread count, and any epoch's order can be recreated from (seed, e) alone.
 *  - val: windows in id order, the same every epoch (no shuffle).
 * Data parallelism: one micro-batch of all dp ranks together is the next dp*B entries of the order,
 * and rank r takes the B of them at [r*B, r*B + B): the micro-batch that one process with B rows
 * would read as its micro-batch (step's micro-batch a) * dp + r. So dp ranks with grad_accum A read,
 * micro-batch for micro-batch, what one process with grad_accum dp*A reads (the same rows in the same
 * 128-token FP8 tiles), and the union of a step's micro-batches is that of one process with
 * micro_batch_size dp*B. Ranks stay in lockstep: an epoch uses floor(W/dp)*dp entries, and its last
 * W mod dp entries (different windows each epoch, since the order changes) are skipped. When the
 * entries run out mid-batch, the batch continues with the next epoch's order (epochs roll over
 * forever; no batch is ever short).
 *
 * Cursor. {epoch, position}: position = entries of the epoch's order consumed by all ranks together
 * (a multiple of dp_size). It is the same on every rank. Because one micro-batch consumes a
 * contiguous range of the order, a run resumed with another dp_size (same global batch) trains on
 * the same windows per step, except that epoch boundaries move with floor(W/dp)*dp.
 *
 * Evaluation pass (loader_next_eval): covers a split completely. Each shard of n tokens is cut into
 * ceil((n-1)/T) eval windows at 0, T, 2T, ...; the last may be short (fewer than T+1 tokens) and is
 * padded. Every token except the first of each shard (which has no context) is a main target exactly
 * once over the pass, summed over the dp ranks. Eval batch i of rank r holds eval windows
 * [(i*dp + r)*B, (i*dp + r)*B + B) (past the last window: padding); the number
 * of eval batches is the same on every rank, and rows past the last window are pure padding.
 *
 * Errors (a missing directory, no matching shard, an invalid shard, too little data, a cursor from
 * another dataset) are one line naming the directory or file, what was found and what was expected.
 */
#ifndef FP8MOE_LOADER_H
#define FP8MOE_LOADER_H

#include <stddef.h>
#include <stdint.h>

typedef enum { LOADER_TRAIN = 0, LOADER_VAL = 1 } LoaderSplit;

typedef struct {
    const char *dir;    // directory holding the shards
    LoaderSplit split;  // TRAIN: *_train_*.bin, shuffled; VAL: *_val_*.bin, in order
    int vocab_size;     // every token is checked to be below it (1..65536)
    int B;              // rows (sequences) per micro-batch
    int T;              // sequence length; a row holds T+1 tokens
    uint64_t seed;      // train order; unused for VAL
    int dp_rank;        // 0 .. dp_size-1
    int dp_size;        // data-parallel ranks sharing this split
} LoaderOptions;

typedef struct {
    uint64_t epoch;
    uint64_t position;  // entries of the epoch's order consumed by all ranks (multiple of dp_size)
} LoaderCursor;

// Plain struct: fields are read-only to callers; use the functions below.
typedef struct {
    LoaderOptions opt;         // dir is copied into dir_copy
    char *dir_copy;
    int n_shards;
    char **shard_paths;        // sorted by name
    uint16_t *tokens;          // every shard's tokens, concatenated in shard order
    int64_t n_tokens;
    int64_t n_windows;         // W: full windows of T+1 tokens
    int64_t *window_start;     // (W) index into tokens of each window's first token
    int64_t n_eval_windows;    // windows of the evaluation pass, including short last ones
    int64_t *eval_start;       // (n_eval_windows) first token of each eval window
    int32_t *eval_len;         // (n_eval_windows) tokens in it, 2..T+1
    int64_t eval_targets;      // main targets in a whole evaluation pass = sum over shards of (n-1)
    int64_t per_epoch;         // floor(W/dp)*dp entries of the order used per epoch
    LoaderCursor cursor;
    int64_t *order;            // (W) the permutation of the cursor's epoch (train) or identity (val)
    uint64_t order_epoch;      // which epoch `order` holds
    int64_t eval_next;         // next evaluation batch
} DataLoader;

// Open the split: find, read and validate the shards. Returns 0, or -1 with err (e.g. no shard
// matching `<dir>/*_train_*.bin`, fewer than dp_size full windows of T+1 tokens for training, a
// token >= vocab_size). A VAL split only needs one token pair (an eval window), not a full window.
int loader_open(DataLoader *L, const LoaderOptions *opt, char *err, size_t errsz);
void loader_close(DataLoader *L);

// Next micro-batch of this rank: tokens (B, T+1) int32, row b = one window; advances the cursor.
// A VAL split with fewer full windows than dp_size leaves tokens untouched and returns -1; else 0.
int loader_next(DataLoader *L, int *tokens);

// Full micro-batches per epoch on each rank: floor(W / (dp_size * B)). For VAL, the batches of
// loader_next that stay within one pass over the split (the final partial batch is dropped).
int64_t loader_num_batches(const DataLoader *L);

LoaderCursor loader_get_cursor(const DataLoader *L);
// Continue from a cursor saved by loader_get_cursor. Returns 0, or -1 with err when the cursor does
// not fit this split and layout (position beyond the epoch, or not a multiple of dp_size).
int loader_set_cursor(DataLoader *L, LoaderCursor c, char *err, size_t errsz);
// Back to the start: cursor {0, 0} and the evaluation pass restarted.
void loader_reset(DataLoader *L);

// ---------------------------------------------------------------------------- evaluation pass
// Eval windows of the split (all ranks together), and batches per rank per pass:
// ceil(n_eval_windows / (dp_size * B)), the same on every rank.
int64_t loader_eval_windows(const DataLoader *L);
int64_t loader_eval_batches(const DataLoader *L);
// Main targets in a whole pass, over all ranks: the denominator of the mean validation loss.
int64_t loader_eval_targets(const DataLoader *L);

// Next evaluation batch of this rank. Fills
//   tokens (B, T+1): the window's tokens, 0 past its end (a valid id, so embedding stays in range);
//   labels (B, T+1): the same tokens, but -1 past the window's end (also for rows with no window).
// Derive inputs from tokens[0..T-1] and every target (main and MTP) from labels with the usual
// shift (main target at i = labels[i+1]); a -1 label is a masked target (kernels.h convention).
// *n_targets (may be NULL) = main targets in this batch (labels[1..T] != -1 over its rows).
// Returns 1 when a batch was produced, 0 when this rank's pass is over (after loader_eval_batches
// batches; loader_reset starts a new pass). Independent of the loader_next cursor.
int loader_next_eval(DataLoader *L, int *tokens, int *labels, int64_t *n_targets);

#endif
