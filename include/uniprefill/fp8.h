/* FP8 E4M3 on the host: the rounding the CUDA conversions do (to nearest, ties to even, saturating at the
 * largest finite 448; NaN stays NaN) and the power-of-two per-tensor scale of attn.block_sparse's fp8 variant.
 * A power-of-two scale makes x / scale exact, so a tensor already on the FP8 grid of its scale quantises
 * without loss (verify relies on it). The CUDA kernels use the same scale function. */
#ifndef UNIPREFILL_FP8_H
#define UNIPREFILL_FP8_H

#include <math.h>

#ifdef __cplusplus
extern "C" {
#endif

#define UPF_FP8_E4M3_MAX 448.0f
#ifdef __CUDACC__
#define UPF_FP8_HD __host__ __device__
#else
#define UPF_FP8_HD
#endif

/* x rounded to the nearest E4M3 value (3 mantissa bits; normals from 2^-6, subnormals in steps of 2^-9). */
UPF_FP8_HD static inline float upf_fp8_e4m3_round(float x) {
  if (isnan(x))
    return x;
  const float a = fabsf(x);
  if (a >= UPF_FP8_E4M3_MAX)
    return copysignf(UPF_FP8_E4M3_MAX, x);
  int e;
  (void)frexpf(a, &e); /* a = f 2^e, f in [0.5, 1): the leading bit is 2^(e - 1) */
  const int lead = a > 0.0f && e - 1 >= -6 ? e - 1 : -6;
  const float quantum = ldexpf(1.0f, lead - 3);
  const float r = rintf(a / quantum) * quantum;
  return copysignf(r > UPF_FP8_E4M3_MAX ? UPF_FP8_E4M3_MAX : r, x);
}

/* The smallest power of two s with amax <= 448 s; 1 for an amax that is 0 or not finite. */
UPF_FP8_HD static inline float upf_fp8_pow2_scale(float amax) {
  if (!(amax > 0.0f) || isinf(amax))
    return 1.0f;
  int e;
  (void)frexpf(amax / UPF_FP8_E4M3_MAX, &e);
  float s = ldexpf(1.0f, e);
  while (UPF_FP8_E4M3_MAX * s < amax)
    s *= 2.0f;
  while (UPF_FP8_E4M3_MAX * (s * 0.5f) >= amax)
    s *= 0.5f;
  return s;
}

#ifdef __cplusplus
}
#endif
#endif
