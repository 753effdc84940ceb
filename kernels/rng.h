/*
 * rng.h - counter-based random numbers: every draw is a pure function of (key, counter), so results
 * do not depend on thread count or call order, and a resumed run can recreate any stream from
 * (seed, step, rank, purpose) alone (DESIGN.md section 2).
 */
#ifndef FP8MOE_RNG_H
#define FP8MOE_RNG_H

#include <math.h>
#include <stdint.h>

static inline uint64_t rng_mix64(uint64_t z) {  // splitmix64 finaliser
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
// A stream key from up to four integers (seed, step, rank, purpose, ...).
static inline uint64_t rng_key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
    return rng_mix64(rng_mix64(rng_mix64(rng_mix64(seed) ^ a) ^ b) ^ c);
}
static inline uint64_t rng_u64(uint64_t key, uint64_t counter) { return rng_mix64(key ^ rng_mix64(counter)); }
// uniform in (0, 1): 53 random bits, never 0
static inline double rng_uniform(uint64_t key, uint64_t counter) {
    return ((double)(rng_u64(key, counter) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
// standard normal by Box-Muller from two uniforms of the counter pair (2*counter, 2*counter+1)
static inline double rng_normal(uint64_t key, uint64_t counter) {
    double u1 = rng_uniform(key, 2 * counter), u2 = rng_uniform(key, 2 * counter + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
