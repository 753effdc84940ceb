/*
 * token_batch.h - a reproducible random micro-batch of byte tokens for the model tests: B sequences of T + 1
 * tokens in [0, 256), token t of sequence b drawn from kernels/rng.h's counter RNG as rng_u64(key, 100 b + t),
 * split into inputs and next-token targets as the loader splits its rows. Header-only (static inline), so every
 * test that runs the model draws its batches one way.
 */
#ifndef FP8MOE_TESTS_TOKEN_BATCH_H
#define FP8MOE_TESTS_TOKEN_BATCH_H

#include <stdint.h>

#include "kernels/rng.h"

// inputs and targets (B*T each): token t and token t + 1 of each sequence.
static inline void token_batch(int *inputs, int *targets, int B, int T, uint64_t key) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = (int)(rng_u64(key, (uint64_t)(b * 100 + t)) % 256);
            targets[b * T + t] = (int)(rng_u64(key, (uint64_t)(b * 100 + t + 1)) % 256);
        }
}

#endif
