/* Element access for the dense CPU reference: read an f32/bf16 element at an element offset, and
 * store a double rounded once (round to nearest even) to the tensor's dtype. */
#ifndef UNIPREFILL_REF_DENSE_UTIL_H
#define UNIPREFILL_REF_DENSE_UTIL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "uniprefill/bf16.h"
#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

static inline float ref_get(const upf_tensor *t, int64_t off) {
  if (t->dtype == UPF_DTYPE_BF16)
    return upf_bf16_to_f32(((const uint16_t *)t->data)[off]);
  return ((const float *)t->data)[off];
}

/* double -> bf16 with a single rounding: (float)v alone would round twice when v lies just off a
 * bf16 midpoint that fp32 can represent exactly. */
static inline uint16_t ref_bf16_from_f64(double v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0xffffu) == 0x8000u && isfinite(f) && (double)f != v) {
    int away = f > 0.0f ? v > (double)f : v < (double)f; /* true value beyond the midpoint */
    u = away ? u + 1u : u - 1u;
    memcpy(&f, &u, sizeof f);
  }
  return upf_bf16_from_f32(f);
}

static inline void ref_put(const upf_tensor *t, int64_t off, double v) {
  if (t->dtype == UPF_DTYPE_BF16)
    ((uint16_t *)t->data)[off] = ref_bf16_from_f64(v);
  else
    ((float *)t->data)[off] = (float)v;
}

/* v as stored in `dtype` (the rounding ref_put applies), back as a double. */
static inline double ref_round_to(upf_dtype dtype, double v) {
  return dtype == UPF_DTYPE_BF16 ? (double)upf_bf16_to_f32(ref_bf16_from_f64(v)) : (double)(float)v;
}

#ifdef __cplusplus
}
#endif
#endif
