/* bf16 <-> fp32 conversion. Rounding is to nearest, ties to even; NaN stays NaN (quiet). */
#ifndef UNIPREFILL_BF16_H
#define UNIPREFILL_BF16_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

static inline uint16_t upf_bf16_from_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep sign, force quiet bit */
    return (uint16_t)((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;                            /* overflow to Inf is the correct RNE result */
  return (uint16_t)(u >> 16);
}

static inline float upf_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float upf_round_bf16(float f) { return upf_bf16_to_f32(upf_bf16_from_f32(f)); }

void upf_bf16_from_f32_array(uint16_t *dst, const float *src, int64_t n);
void upf_bf16_to_f32_array(float *dst, const uint16_t *src, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
