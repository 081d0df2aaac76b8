/* Planted-block attention inputs (perf/bench_planted.h). */
#include "perf/bench_planted.h"

#include <math.h>
#include <stdlib.h>

#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"

#define POOL 65521

/* The pool and the directions of the last seed asked for. */
static struct {
  int ready;
  uint64_t seed;
  float pool[POOL];
  float u[8 * 256]; /* (Hkv <= 8, D <= 256) */
} gen;

static void gen_init(uint64_t seed) {
  if (gen.ready && gen.seed == seed)
    return;
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  upf_rng_fill_normal(&rng, gen.pool, POOL, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, gen.u, 8 * 256, 0.0f, 1.0f);
  gen.ready = 1, gen.seed = seed;
}

void upf_planted_rows(const upf_planted *p, upf_planted_kind kind, int64_t t0, int64_t t1, void *dst) {
  gen_init(p->seed);
  const int64_t heads = kind == UPF_PLANTED_Q ? p->hq : p->hkv, g = p->hq / p->hkv, D = p->d;
  const double mag = sqrt(2.0 / (1.4426950408889634 * sqrt((double)D)));
  for (int64_t t = t0; t < t1; t++)
    for (int64_t h = 0; h < heads; h++) {
      const int64_t kvh = kind == UPF_PLANTED_Q ? h / g : h;
      double sign = kind == UPF_PLANTED_Q ? 1.0 : 0.0;
      if (kind == UPF_PLANTED_K)
        sign = upf_mix64(p->seed ^ ((uint64_t)kvh << 40) ^ (uint64_t)(t / p->block_n)) % 10 < 3 ? 1.0 : -1.0;
      for (int64_t e = 0; e < D; e++) {
        const int64_t i = (t * heads + h) * D + e, o = ((t - t0) * heads + h) * D + e;
        const float noise = gen.pool[(uint64_t)(i + 7 * kind) * 40503u % POOL];
        const float x = noise + (float)(sign * mag) * gen.u[kvh * D + e];
        if (p->dt == UPF_DTYPE_BF16)
          ((uint16_t *)dst)[o] = upf_bf16_from_f32(x);
        else
          ((float *)dst)[o] = x;
      }
    }
}

upf_status upf_planted_upload(const upf_planted *p, const upf_backend *be, upf_planted_kind kind, int64_t n,
                              void **dst, const char *who) {
  const int64_t heads = kind == UPF_PLANTED_Q ? p->hq : p->hkv, row = heads * p->d;
  const int64_t es = (int64_t)upf_dtype_size(p->dt), step = 1024;
  UPF_TRY(be->alloc(dst, (size_t)((n ? n : 1) * row * es)));
  void *host = malloc((size_t)(step * row * es));
  if (!host)
    return upf_fail(UPF_ERR_NOMEM, "%s: host staging", who);
  upf_status st = UPF_OK;
  for (int64_t t0 = 0; st == UPF_OK && t0 < n; t0 += step) {
    const int64_t t1 = t0 + step < n ? t0 + step : n;
    upf_planted_rows(p, kind, t0, t1, host);
    st = be->upload((char *)*dst + t0 * row * es, host, (size_t)((t1 - t0) * row * es));
  }
  free(host);
  return st;
}
