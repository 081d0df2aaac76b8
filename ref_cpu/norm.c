/* CPU reference of the RMSNorm family (see norm.h). */
#include "ref_cpu/norm.h"

#include <math.h>
#include <stdlib.h>

#include "ref_cpu/dense_util.h"

double ref_rms_inv(const double *x, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++)
    ss += x[i] * x[i];
  return 1.0 / sqrt(ss / (double)n + (double)eps);
}

/* y[y_off + i] = x[i] * inv * gain(w[i]) for i < n. */
static void norm_row(const double *x, int64_t n, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y,
                     int64_t y_off) {
  double inv = ref_rms_inv(x, n, p->eps);
  for (int64_t i = 0; i < n; i++)
    ref_put(y, y_off + i, x[i] * inv * ref_norm_gain(p, ref_get(w, i * w->stride[0])));
}

static upf_status row_scratch(int64_t n, double **row, const char *op) {
  *row = malloc((size_t)n * sizeof **row);
  return *row ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s (cpu): cannot allocate a row of %lld", op, (long long)n);
}

upf_status cpu_rmsnorm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_rmsnorm_check("norm.rms", x, NULL, w, p, y));
  int64_t T = x->shape[0], N = x->shape[1];
  double *row;
  UPF_TRY(row_scratch(N, &row, "norm.rms"));
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < N; i++)
      row[i] = ref_get(x, t * x->stride[0] + i);
    norm_row(row, N, w, p, y, t * y->stride[0]);
  }
  free(row);
  return UPF_OK;
}

upf_status cpu_rmsnorm_add(const upf_tensor *x, const upf_tensor *residual, const upf_tensor *w,
                           const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_rmsnorm_check("norm.rms_add", x, residual, w, p, y));
  int64_t T = x->shape[0], N = x->shape[1];
  double *row;
  UPF_TRY(row_scratch(N, &row, "norm.rms_add"));
  for (int64_t t = 0; t < T; t++) {
    int64_t xo = t * x->stride[0], ro = t * residual->stride[0];
    for (int64_t i = 0; i < N; i++) {
      /* The new residual is stored in its dtype and the norm reads it back as stored, so the fused
       * op equals an add followed by norm.rms. */
      row[i] = ref_round_to(residual->dtype, (double)ref_get(x, xo + i) + (double)ref_get(residual, ro + i));
      ref_put(residual, ro + i, row[i]);
    }
    norm_row(row, N, w, p, y, t * y->stride[0]);
  }
  free(row);
  return UPF_OK;
}

upf_status cpu_qk_norm(const upf_tensor *x, const upf_tensor *w, const upf_norm_params *p, const upf_tensor *y) {
  UPF_TRY(upf_qk_norm_check(x, w, p, y));
  int64_t T = x->shape[0], H = x->shape[1], D = x->shape[2];
  double *row;
  UPF_TRY(row_scratch(D, &row, "norm.qk"));
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      int64_t xo = t * x->stride[0] + h * x->stride[1];
      for (int64_t d = 0; d < D; d++)
        row[d] = ref_get(x, xo + d);
      norm_row(row, D, w, p, y, t * y->stride[0] + h * y->stride[1]);
    }
  free(row);
  return UPF_OK;
}
