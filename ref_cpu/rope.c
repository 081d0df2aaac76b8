/* CPU reference of RoPE (see rope.h). */
#include "ref_cpu/rope.h"

#include <math.h>
#include <stdlib.h>

#include "ref_cpu/dense_util.h"

void ref_rope_row(double *x, int32_t rot, const double *inv_freq, int64_t pos) {
  int32_t half = rot / 2;
  for (int32_t i = 0; i < half; i++) {
    double a = (double)pos * inv_freq[i], c = cos(a), s = sin(a);
    double x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

/* Rotates the heads of token t of x with the token's cos/sin (rot/2 each). */
static void rope_token(const upf_tensor *x, int64_t t, int32_t rot, const double *c, const double *s, double *row) {
  int32_t half = rot / 2;
  for (int64_t h = 0; h < x->shape[1]; h++) {
    int64_t off = t * x->stride[0] + h * x->stride[1];
    for (int32_t d = 0; d < rot; d++)
      row[d] = ref_get(x, off + d);
    for (int32_t i = 0; i < half; i++) {
      double x1 = row[i], x2 = row[i + half];
      ref_put(x, off + i, x1 * c[i] - x2 * s[i]);
      ref_put(x, off + i + half, x2 * c[i] + x1 * s[i]);
    }
  }
}

upf_status cpu_rope(const upf_tensor *q, const upf_tensor *k, const int32_t *positions, const upf_rope_params *p) {
  UPF_TRY(upf_rope_check(q, k, positions, p));
  int32_t rot = upf_rope_rotary_dim(p, q->shape[2]);
  int32_t half = rot / 2;
  double *inv_freq = malloc((size_t)(3 * half + rot) * sizeof *inv_freq);
  if (!inv_freq)
    return upf_fail(UPF_ERR_NOMEM, "rope (cpu): cannot allocate scratch for rotary_dim %d", rot);
  double *c = inv_freq + half, *s = c + half, *row = s + half;
  upf_rope_inv_freq(p, rot, inv_freq);
  for (int64_t t = 0; t < q->shape[0]; t++) {
    /* the angle, its cosine and sine in double, once per token for every head of q and k */
    for (int32_t i = 0; i < half; i++) {
      double a = (double)positions[t] * inv_freq[i];
      c[i] = cos(a), s[i] = sin(a);
    }
    rope_token(q, t, rot, c, s, row);
    if (k)
      rope_token(k, t, rot, c, s, row);
  }
  free(inv_freq);
  return UPF_OK;
}
