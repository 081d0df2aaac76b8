/* Seeded selection problems. Structure comes from one unit direction per kv head: queries lean on
 * it by D^(1/4) and keys by w * D^(1/4), w chosen per token by the distribution, so at scale
 * 1/sqrt(D) a key's score gains about w nats over N(0,1) noise. */
#include "verify/select_inputs.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"

const char *upf_dist_name(upf_dist dist) {
  static const char *const names[UPF_DIST_COUNT] = {"random", "sink", "heavy", "local", "ties"};
  return (unsigned)dist < UPF_DIST_COUNT ? names[dist] : "invalid";
}

/* Weight of key j (of n) on the shared direction. */
static float key_weight(upf_dist dist, int64_t j, int64_t n, uint64_t heavy_seed) {
  switch (dist) {
  case UPF_DIST_SINK:
    return j < 4 ? 10.0f : 0.0f;
  case UPF_DIST_HEAVY: {
    /* Roughly one block of 64 in 16 is heavy; which ones depends on the seed only. */
    uint64_t blk = (uint64_t)(j / 64) * 0x9e3779b97f4a7c15ull ^ heavy_seed;
    blk ^= blk >> 29;
    return (blk % 16) == 3 ? 10.0f : 0.0f;
  }
  case UPF_DIST_LOCAL:
    return 10.0f * (float)exp(-(double)(n - 1 - j) / 128.0);
  default:
    return 0.0f;
  }
}

static void store(const upf_tensor *t, int64_t at, float v) {
  if (t->dtype == UPF_DTYPE_BF16)
    ((uint16_t *)t->data)[at] = upf_bf16_from_f32(v);
  else
    ((float *)t->data)[at] = v;
}

upf_status upf_select_problem_make(upf_select_problem *pb, const int32_t *lens, int32_t num_reqs, int32_t hq,
                                   int32_t hkv, int32_t head_dim, upf_dtype dtype, upf_dist dist, uint64_t seed) {
  memset(pb, 0, sizeof *pb);
  if (num_reqs < 1 || hq < 1 || hkv < 1 || head_dim < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "problem: B=%d Hq=%d Hkv=%d D=%d must all be positive", num_reqs, hq, hkv,
                    head_dim);
  pb->num_reqs = num_reqs;
  pb->cu_seqlens = malloc((size_t)(num_reqs + 1) * sizeof *pb->cu_seqlens);
  if (!pb->cu_seqlens)
    return upf_fail(UPF_ERR_NOMEM, "problem: cu_seqlens");
  int64_t T = 0;
  pb->cu_seqlens[0] = 0;
  for (int32_t r = 0; r < num_reqs; r++) {
    T += lens[r];
    pb->cu_seqlens[r + 1] = (int32_t)T;
  }
  int64_t qshape[3] = {T, hq, head_dim}, kshape[3] = {T, hkv, head_dim};
  upf_status st = upf_tensor_alloc(&pb->q, dtype, 3, qshape);
  if (st == UPF_OK)
    st = upf_tensor_alloc(&pb->k, dtype, 3, kshape);
  float *u = malloc((size_t)hkv * head_dim * sizeof *u);
  if (st != UPF_OK || !u) {
    free(u);
    upf_select_problem_free(pb);
    return st != UPF_OK ? st : upf_fail(UPF_ERR_NOMEM, "problem: direction vectors");
  }
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  /* u has entries +-D^(-1/4): |u| = D^(1/4), so q.k * scale gains w |u|^2 / sqrt(D) = w. */
  float unorm = (float)pow((double)head_dim, -0.25);
  for (int64_t e = 0; e < (int64_t)hkv * head_dim; e++)
    u[e] = (upf_rng_uniform(&rng) < 0.5f ? -unorm : unorm);
  uint64_t heavy_seed = upf_rng_next(&rng);
  int32_t group = hq / hkv;
  for (int32_t r = 0; r < num_reqs; r++) {
    int64_t tok0 = pb->cu_seqlens[r], n = lens[r];
    for (int64_t j = 0; j < n; j++) {
      int64_t t = tok0 + j;
      float w = key_weight(dist, j, n, heavy_seed);
      for (int32_t h = 0; h < hkv; h++)
        for (int32_t d = 0; d < head_dim; d++) {
          float noise = dist == UPF_DIST_TIES ? 0.25f : upf_rng_normal(&rng);
          store(&pb->k, (t * hkv + h) * head_dim + d, noise + w * u[h * head_dim + d]);
        }
      for (int32_t h = 0; h < hq; h++)
        for (int32_t d = 0; d < head_dim; d++) {
          float lean = dist == UPF_DIST_RANDOM ? 0.0f : 1.0f;
          store(&pb->q, (t * hq + h) * head_dim + d, upf_rng_normal(&rng) + lean * u[(h / group) * head_dim + d]);
        }
    }
  }
  free(u);
  return UPF_OK;
}

void upf_select_problem_free(upf_select_problem *pb) {
  upf_tensor_free(&pb->q);
  upf_tensor_free(&pb->k);
  free(pb->cu_seqlens);
  pb->cu_seqlens = NULL;
}

upf_select_inputs upf_select_problem_inputs(const upf_select_problem *pb) {
  upf_select_inputs in = {.q = pb->q, .k = pb->k, .cu_seqlens = pb->cu_seqlens, .cu_seqlens_host = pb->cu_seqlens,
                          .num_reqs = pb->num_reqs};
  return in;
}
