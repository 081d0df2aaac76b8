/* CPU reference of the projections (cblas_sgemm, fp32 accumulation) and the fp64 truth (dgemm). */
#include "ref_cpu/gemm.h"

#include <cblas.h>
#include <stdlib.h>

#include "ref_cpu/dense_util.h"

/* Rows of `a` per sgemm call: bounds the fp32 copies of a and c to a few MB each. */
#define GEMM_ROW_CHUNK 512

void ref_rows_to_f32(const upf_tensor *t, int64_t row0, int64_t rows, float *dst) {
  int64_t cols = t->shape[1];
  for (int64_t r = 0; r < rows; r++) {
    int64_t base = (row0 + r) * t->stride[0];
    float *out = dst + r * cols;
    if (t->dtype == UPF_DTYPE_BF16)
      upf_bf16_to_f32_array(out, (const uint16_t *)t->data + base, cols);
    else
      memcpy(out, (const float *)t->data + base, (size_t)cols * sizeof(float));
  }
}

void ref_rows_from_f32(const float *src, int64_t row0, int64_t rows, const upf_tensor *t) {
  int64_t cols = t->shape[1];
  for (int64_t r = 0; r < rows; r++) {
    int64_t base = (row0 + r) * t->stride[0];
    const float *in = src + r * cols;
    if (t->dtype == UPF_DTYPE_BF16)
      upf_bf16_from_f32_array((uint16_t *)t->data + base, in, cols);
    else
      memcpy((float *)t->data + base, in, (size_t)cols * sizeof(float));
  }
}

float *ref_matrix_to_f32(const upf_tensor *t) {
  size_t n = (size_t)(t->shape[0] * t->shape[1]);
  float *m = malloc((n ? n : 1) * sizeof *m);
  if (m)
    ref_rows_to_f32(t, 0, t->shape[0], m);
  return m;
}

void ref_sgemm(const float *a, const float *b, float *c, int64_t M, int64_t K, int64_t N) {
  if (M == 0 || N == 0)
    return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, a, (int)K, b, (int)N, 0.0f,
              c, (int)N);
}

upf_status cpu_gemm(const upf_tensor *a, const upf_tensor *b, const upf_tensor *c) {
  UPF_TRY(upf_gemm_check(a, b, c));
  int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1];
  if (M == 0 || N == 0)
    return UPF_OK;
  int64_t chunk = M < GEMM_ROW_CHUNK ? M : GEMM_ROW_CHUNK;
  float *bf = ref_matrix_to_f32(b);
  float *af = malloc((size_t)(chunk * K) * sizeof *af), *cf = malloc((size_t)(chunk * N) * sizeof *cf);
  if (!bf || !af || !cf) {
    free(bf), free(af), free(cf);
    return upf_fail(UPF_ERR_NOMEM, "gemm (cpu): cannot allocate fp32 copies for M=%lld K=%lld N=%lld", (long long)M,
                    (long long)K, (long long)N);
  }
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    int64_t rows = M - r0 < chunk ? M - r0 : chunk;
    ref_rows_to_f32(a, r0, rows, af);
    ref_sgemm(af, bf, cf, rows, K, N);
    ref_rows_from_f32(cf, r0, rows, c);
  }
  free(bf), free(af), free(cf);
  return UPF_OK;
}

upf_status ref_gemm_f64(const upf_tensor *a, const upf_tensor *b, double *c) {
  int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1];
  double *ad = malloc((size_t)(M * K > 0 ? M * K : 1) * sizeof *ad);
  double *bd = malloc((size_t)(K * N > 0 ? K * N : 1) * sizeof *bd);
  if (!ad || !bd) {
    free(ad), free(bd);
    return upf_fail(UPF_ERR_NOMEM, "gemm (fp64 truth): cannot allocate M=%lld K=%lld N=%lld", (long long)M,
                    (long long)K, (long long)N);
  }
  for (int64_t i = 0; i < M; i++)
    for (int64_t k = 0; k < K; k++)
      ad[i * K + k] = ref_get(a, i * a->stride[0] + k);
  for (int64_t k = 0; k < K; k++)
    for (int64_t j = 0; j < N; j++)
      bd[k * N + j] = ref_get(b, k * b->stride[0] + j);
  if (M > 0 && N > 0)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0, ad, (int)K, bd, (int)N, 0.0,
                c, (int)N);
  free(ad), free(bd);
  return UPF_OK;
}
