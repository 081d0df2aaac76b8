/* Portable seeded RNG: xoshiro256** seeded through splitmix64. Only integer arithmetic and exact
 * float operations, so every machine produces the same bits. */
#include "uniprefill/rng.h"

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void upf_rng_seed(upf_rng *rng, uint64_t seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++)
    rng->s[i] = splitmix64(&x);
}

uint64_t upf_rng_next(upf_rng *rng) {
  uint64_t *s = rng->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

float upf_rng_uniform(upf_rng *rng) { return (float)(upf_rng_next(rng) >> 40) * 0x1.0p-24f; }

float upf_rng_normal(upf_rng *rng) {
  /* Each uniform is k * 2^-24; the sum of 12 is exact in double, and the final rounding to float is
   * correctly rounded everywhere. */
  double sum = 0.0;
  for (int i = 0; i < 12; i++)
    sum += (double)upf_rng_uniform(rng);
  return (float)(sum - 6.0);
}

uint64_t upf_rng_below(upf_rng *rng, uint64_t n) {
  if (n == 0)
    return 0;
  /* Rejection keeps it unbiased and still machine independent. */
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = upf_rng_next(rng);
  } while (x >= limit);
  return x % n;
}

void upf_rng_fill_normal(upf_rng *rng, float *x, int64_t n, float mean, float std) {
  for (int64_t i = 0; i < n; i++)
    x[i] = mean + std * upf_rng_normal(rng);
}

void upf_rng_fill_uniform(upf_rng *rng, float *x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++)
    x[i] = lo + (hi - lo) * upf_rng_uniform(rng);
}

uint64_t upf_mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}
