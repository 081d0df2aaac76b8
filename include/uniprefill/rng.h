/* Seeded random numbers that give the same tensors on every machine: integer generator
 * (splitmix64 + xoshiro256**), uniforms from the top 24 bits, and normals as a sum of 12 uniforms
 * (no libm calls, whose last bits differ between C libraries). */
#ifndef UNIPREFILL_RNG_H
#define UNIPREFILL_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  uint64_t s[4];
} upf_rng;

void upf_rng_seed(upf_rng *rng, uint64_t seed);
uint64_t upf_rng_next(upf_rng *rng);
/* Uniform in [0, 1), a multiple of 2^-24, so exactly representable in fp32. */
float upf_rng_uniform(upf_rng *rng);
/* Approximately standard normal (Irwin-Hall, 12 terms): mean 0, variance 1, |x| <= 6. */
float upf_rng_normal(upf_rng *rng);
/* Uniform integer in [0, n). */
uint64_t upf_rng_below(upf_rng *rng, uint64_t n);

/* A stateless 64-bit mix (MurmurHash3's finalizer): a well-spread hash of a key, for values that must
 * depend only on their coordinates (a hot block, a planted score), not on the order they are drawn in. */
uint64_t upf_mix64(uint64_t x);

void upf_rng_fill_normal(upf_rng *rng, float *x, int64_t n, float mean, float std);
void upf_rng_fill_uniform(upf_rng *rng, float *x, int64_t n, float lo, float hi);

#ifdef __cplusplus
}
#endif
#endif
