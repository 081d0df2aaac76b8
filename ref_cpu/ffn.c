/* CPU reference of the gated FFN and its activation-and-multiply (see ffn.h). */
#include "ref_cpu/ffn.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/gemm.h"

/* Tokens per pass: bounds the (chunk, 2I) fp32 intermediate to a few tens of MB at I = 15360. */
#define FFN_ROW_CHUNK 256

double ref_act(upf_act act, double x) {
  if (act == UPF_ACT_GELU_TANH) {
    const double k = 0.79788456080286535588; /* sqrt(2/pi) */
    return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
  }
  return x / (1.0 + exp(-x));
}

upf_status cpu_ffn_act_mul(const upf_tensor *gate_up, upf_act act, const upf_tensor *h) {
  UPF_TRY(upf_gated_act_check(gate_up, act, h));
  int64_t T = h->shape[0], I_ = h->shape[1];
  for (int64_t t = 0; t < T; t++) {
    int64_t in = t * gate_up->stride[0], out = t * h->stride[0];
    for (int64_t i = 0; i < I_; i++)
      ref_put(h, out + i, ref_act(act, ref_get(gate_up, in + i)) * (double)ref_get(gate_up, in + I_ + i));
  }
  return UPF_OK;
}

upf_status cpu_ffn_gated(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                         const upf_tensor *y) {
  UPF_TRY(upf_ffn_check(x, w_gate_up, w_down, act, y));
  int64_t T = x->shape[0], H = x->shape[1], I_ = w_down->shape[0];
  if (T == 0)
    return UPF_OK;
  int64_t chunk = T < FFN_ROW_CHUNK ? T : FFN_ROW_CHUNK;
  float *wgu = ref_matrix_to_f32(w_gate_up), *wd = ref_matrix_to_f32(w_down);
  float *xf = malloc((size_t)(chunk * H) * sizeof *xf), *gu = malloc((size_t)(chunk * 2 * I_) * sizeof *gu);
  float *hf = malloc((size_t)(chunk * I_) * sizeof *hf), *yf = malloc((size_t)(chunk * H) * sizeof *yf);
  if (!wgu || !wd || !xf || !gu || !hf || !yf) {
    free(wgu), free(wd), free(xf), free(gu), free(hf), free(yf);
    return upf_fail(UPF_ERR_NOMEM, "ffn.gated (cpu): cannot allocate fp32 scratch for H=%lld I=%lld", (long long)H,
                    (long long)I_);
  }
  upf_dtype mid = x->dtype; /* intermediates are stored in the input dtype */
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    int64_t rows = T - t0 < chunk ? T - t0 : chunk;
    ref_rows_to_f32(x, t0, rows, xf);
    ref_sgemm(xf, wgu, gu, rows, H, 2 * I_);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t i = 0; i < I_; i++) {
        double g = ref_round_to(mid, gu[r * 2 * I_ + i]), u = ref_round_to(mid, gu[r * 2 * I_ + I_ + i]);
        hf[r * I_ + i] = (float)ref_round_to(mid, ref_act(act, g) * u);
      }
    ref_sgemm(hf, wd, yf, rows, I_, H);
    ref_rows_from_f32(yf, t0, rows, y);
  }
  free(wgu), free(wd), free(xf), free(gu), free(hf), free(yf);
  return UPF_OK;
}

upf_status ref_ffn_f64(const upf_tensor *x, const upf_tensor *w_gate_up, const upf_tensor *w_down, upf_act act,
                       double *y) {
  int64_t T = x->shape[0], H = x->shape[1], I_ = w_down->shape[0];
  double *gu = malloc((size_t)(T * 2 * I_ > 0 ? T * 2 * I_ : 1) * sizeof *gu);
  double *h = malloc((size_t)(T * I_ > 0 ? T * I_ : 1) * sizeof *h), *wd = malloc((size_t)(I_ * H) * sizeof *wd);
  upf_status st = gu && h && wd ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "ffn (fp64 truth): cannot allocate T=%lld I=%lld",
                                                    (long long)T, (long long)I_);
  if (st == UPF_OK)
    st = ref_gemm_f64(x, w_gate_up, gu);
  if (st == UPF_OK && T > 0) {
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < I_; i++)
        h[t * I_ + i] = ref_act(act, gu[t * 2 * I_ + i]) * gu[t * 2 * I_ + I_ + i];
    for (int64_t i = 0; i < I_; i++)
      for (int64_t j = 0; j < H; j++)
        wd[i * H + j] = ref_get(w_down, i * w_down->stride[0] + j);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)H, (int)I_, 1.0, h, (int)I_, wd, (int)H, 0.0, y,
                (int)H);
  }
  free(gu), free(h), free(wd);
  return st;
}
