/* CPU reference of the last-token logits (see logits.h). */
#include "ref_cpu/logits.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/gemm.h"
#include "ref_cpu/norm.h"

upf_status cpu_logits_last(const upf_tensor *hidden, const int32_t *cu_seqlens_host, int32_t num_reqs,
                           const upf_tensor *norm_w, const upf_norm_params *p, const upf_tensor *w_lm,
                           const upf_tensor *logits) {
  UPF_TRY(upf_logits_last_check(hidden, cu_seqlens_host, num_reqs, norm_w, p, w_lm, logits));
  int64_t H = hidden->shape[1], V = w_lm->shape[1], B = num_reqs;
  double *row = malloc((size_t)H * sizeof *row);
  float *normed = malloc((size_t)(B * H) * sizeof *normed), *out = malloc((size_t)(B * V) * sizeof *out);
  float *wf = ref_matrix_to_f32(w_lm);
  if (!row || !normed || !out || !wf) {
    free(row), free(normed), free(out), free(wf);
    return upf_fail(UPF_ERR_NOMEM, "logits.last (cpu): cannot allocate scratch for B=%lld H=%lld V=%lld",
                    (long long)B, (long long)H, (long long)V);
  }
  for (int64_t r = 0; r < B; r++) {
    int64_t off = (int64_t)(cu_seqlens_host[r + 1] - 1) * hidden->stride[0];
    for (int64_t i = 0; i < H; i++)
      row[i] = ref_get(hidden, off + i);
    double inv = ref_rms_inv(row, H, p->eps);
    for (int64_t i = 0; i < H; i++)
      normed[r * H + i] =
          (float)ref_round_to(hidden->dtype, row[i] * inv * ref_norm_gain(p, ref_get(norm_w, i * norm_w->stride[0])));
  }
  ref_sgemm(normed, wf, out, B, H, V);
  ref_rows_from_f32(out, 0, B, logits);
  free(row), free(normed), free(out), free(wf);
  return UPF_OK;
}

/* Budget of one chunk's f32 logits (floats): 64 MB, so a chunk is at least one row and at most
 * 16M / V rows (Gemma-3's V = 262144: 64 rows). */
#define ROWS_CHUNK_FLOATS ((int64_t)16 << 20)

/* normed (n, H) f32 = rmsnorm(hidden[rows[i]]) rounded to the hidden dtype, as logits.last. */
static void norm_rows(const upf_tensor *hidden, const int32_t *rows, int64_t n, const upf_tensor *norm_w,
                      const upf_norm_params *p, double *row, float *normed) {
  const int64_t H = hidden->shape[1];
  for (int64_t r = 0; r < n; r++) {
    const int64_t off = (int64_t)rows[r] * hidden->stride[0];
    for (int64_t i = 0; i < H; i++)
      row[i] = ref_get(hidden, off + i);
    const double inv = ref_rms_inv(row, H, p->eps);
    for (int64_t i = 0; i < H; i++)
      normed[r * H + i] =
          (float)ref_round_to(hidden->dtype, row[i] * inv * ref_norm_gain(p, ref_get(norm_w, i * norm_w->stride[0])));
  }
}

void ref_logits_row_reduce(const float *x, int64_t V, int32_t target, int32_t *argmax, double *lse, double *tlogit) {
  int64_t arg = 0;
  double m = -INFINITY;
  for (int64_t j = 0; j < V; j++)
    if ((double)x[j] > m) /* strict: the first (lowest) id of equal maxima stays */
      m = x[j], arg = j;
  double sum = 0.0;
  for (int64_t j = 0; j < V; j++)
    sum += exp((double)x[j] - m);
  *argmax = (int32_t)arg;
  *lse = m + log(sum);
  if (tlogit)
    *tlogit = target >= 0 ? (double)x[target] : NAN;
}

upf_status cpu_logits_rows(const upf_tensor *hidden, const upf_logits_rows_sel *sel, const upf_tensor *norm_w,
                           const upf_norm_params *p, const upf_tensor *w_lm, const upf_logits_rows_out *out) {
  UPF_TRY(upf_logits_rows_check(hidden, sel, norm_w, p, w_lm, out));
  const int64_t H = hidden->shape[1], V = w_lm->shape[1], R = sel->num_rows;
  if (R == 0)
    return UPF_OK;
  int64_t chunk = ROWS_CHUNK_FLOATS / V;
  chunk = chunk < 1 ? 1 : chunk > R ? R : chunk;
  /* a contiguous f32 head is read in place; anything else is widened once */
  const int in_place = w_lm->dtype == UPF_DTYPE_F32 && w_lm->stride[0] == V && w_lm->stride[1] == 1;
  float *wf = in_place ? NULL : ref_matrix_to_f32(w_lm);
  double *row = malloc((size_t)H * sizeof *row);
  float *normed = malloc((size_t)(chunk * H) * sizeof *normed), *lg = malloc((size_t)(chunk * V) * sizeof *lg);
  if ((!in_place && !wf) || !row || !normed || !lg) {
    free(wf), free(row), free(normed), free(lg);
    return upf_fail(UPF_ERR_NOMEM, "logits.rows (cpu): cannot allocate scratch for a chunk of %lld rows, H=%lld V=%lld",
                    (long long)chunk, (long long)H, (long long)V);
  }
  const float *w = in_place ? (const float *)w_lm->data : wf;
  for (int64_t c0 = 0; c0 < R; c0 += chunk) {
    const int64_t n = R - c0 < chunk ? R - c0 : chunk;
    norm_rows(hidden, sel->rows_host + c0, n, norm_w, p, row, normed);
    ref_sgemm(normed, w, lg, n, H, V);
    for (int64_t i = 0; i < n; i++)
      ref_logits_row_reduce(lg + i * V, V, sel->targets_host ? sel->targets_host[c0 + i] : -1, &out->argmax[c0 + i],
                            &out->lse[c0 + i], sel->targets_host ? &out->target[c0 + i] : NULL);
    for (int64_t f = 0; f < sel->num_full; f++) /* full rows are few: a scan per chunk costs nothing */
      if (sel->full_host[f] >= c0 && sel->full_host[f] < c0 + n)
        memcpy(out->full + f * V, lg + (sel->full_host[f] - c0) * V, (size_t)V * sizeof(float));
  }
  free(wf), free(row), free(normed), free(lg);
  return UPF_OK;
}
