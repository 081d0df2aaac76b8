/* CPU reference of the last-token logits (see logits.h). */
#include "ref_cpu/logits.h"

#include <stdlib.h>

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
