/* CPU reference of the Gated DeltaNet ops (see gdn.h). The scan is the recurrence exactly as written
 * in the issue and in HF's torch_recurrent_gated_delta_rule, one token at a time:
 *   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = scale * S^T q
 * with q and k L2-normalised, S (Dk, Dv) per (request, value head) in double. */
#include "ref_cpu/gdn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/dense_util.h"
#include "ref_cpu/norm.h"

void ref_gdn_gates(double a, double b, double a_log, double dt_bias, double *g, double *beta) {
  *g = -exp(a_log) * upf_gdn_softplus(a + dt_bias);
  *beta = upf_gdn_sigmoid(b);
}

void ref_gdn_l2norm(double *x, int64_t n) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; i++)
    ss += x[i] * x[i];
  double inv = 1.0 / sqrt(ss + (double)UPF_GDN_L2_EPS);
  for (int64_t i = 0; i < n; i++)
    x[i] *= inv;
}

/* ---- conv1d ---- */

/* Input u of request r (tokens [s, s+n)) in channel c: a token, or for u < s one of the K-1 entries
 * of the initial conv state (0 without one). */
static double conv_in(const upf_tensor *x, const upf_tensor *state_in, int32_t r, int64_t s, int64_t K, int64_t u,
                      int64_t c) {
  if (u >= s)
    return ref_get(x, u * x->stride[0] + c);
  if (!state_in)
    return 0.0;
  int64_t C = state_in->shape[2], idx = (K - 1) + (u - s);
  return ((const float *)state_in->data)[((int64_t)r * (K - 1) + idx) * C + c];
}

upf_status cpu_gdn_conv(const upf_gdn_batch *batch, const upf_tensor *x, const upf_tensor *w,
                        const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y) {
  UPF_TRY(upf_gdn_conv_check(batch, x, w, state_in, state_out, y));
  int64_t C = x->shape[1], K = w->shape[1];
  for (int32_t r = 0; r < batch->num_reqs; r++) {
    int64_t s = batch->cu_seqlens_host[r], e = batch->cu_seqlens_host[r + 1], n = e - s;
    for (int64_t t = s; t < e; t++)
      for (int64_t c = 0; c < C; c++) {
        double acc = 0.0;
        for (int64_t j = 0; j < K; j++)
          acc += (double)ref_get(w, c * w->stride[0] + j) * conv_in(x, state_in, r, s, K, t - (K - 1) + j, c);
        ref_put(y, t * y->stride[0] + c, upf_gdn_silu(acc));
      }
    if (!state_out)
      continue;
    /* The last K-1 inputs of (initial state, tokens): the state a following step continues from. */
    float *so = (float *)state_out->data + (int64_t)r * (K - 1) * C;
    for (int64_t i = 0; i < K - 1; i++)
      for (int64_t c = 0; c < C; c++)
        so[i * C + c] = (float)conv_in(x, state_in, r, s, K, s + n - (K - 1) + i, c);
  }
  return UPF_OK;
}

upf_status cpu_gdn_conv_step(const upf_tensor *x, const upf_tensor *w, const upf_tensor *state, const upf_tensor *y) {
  UPF_TRY(upf_gdn_conv_step_check(x, w, state, y));
  int64_t B = x->shape[0], C = x->shape[1], K = w->shape[1];
  for (int64_t r = 0; r < B; r++) {
    float *st = (float *)state->data + r * (K - 1) * C;
    for (int64_t c = 0; c < C; c++) {
      double xv = ref_get(x, r * x->stride[0] + c), acc = 0.0;
      for (int64_t j = 0; j < K - 1; j++)
        acc += (double)ref_get(w, c * w->stride[0] + j) * st[j * C + c];
      acc += (double)ref_get(w, c * w->stride[0] + K - 1) * xv;
      ref_put(y, r * y->stride[0] + c, upf_gdn_silu(acc));
      for (int64_t j = 0; j + 1 < K - 1; j++)
        st[j * C + c] = st[(j + 1) * C + c];
      st[(K - 2) * C + c] = (float)xv;
    }
  }
  return UPF_OK;
}

/* ---- the delta-rule scan ---- */

/* Runs every (request, value head): o (rounded into the tensor) and/or o64 (double), state_out. */
static upf_status scan_core(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                            double *o64, const upf_tensor *state_out) {
  const upf_tensor *q = in->q, *k = in->k, *v = in->v;
  int64_t Hk = q->shape[1], Dk = q->shape[2], Hv = v->shape[1], Dv = v->shape[2], ratio = Hv / Hk;
  double *S = malloc((size_t)(Dk * Dv) * sizeof *S), *qv = malloc((size_t)Dk * sizeof *qv);
  double *kv = malloc((size_t)Dk * sizeof *kv), *delta = malloc((size_t)Dv * sizeof *delta);
  if (!S || !qv || !kv || !delta) {
    free(S), free(qv), free(kv), free(delta);
    return upf_fail(UPF_ERR_NOMEM, "gdn.scan (cpu): cannot allocate a %lld x %lld state", (long long)Dk,
                    (long long)Dv);
  }
  const float *a_log = in->a_log->data, *dt_bias = in->dt_bias->data;
  for (int32_t r = 0; r < batch->num_reqs; r++)
    for (int64_t h = 0; h < Hv; h++) {
      int64_t kh = h / ratio, soff = ((int64_t)r * Hv + h) * Dk * Dv;
      for (int64_t i = 0; i < Dk * Dv; i++)
        S[i] = in->state_in ? (double)((const float *)in->state_in->data)[soff + i] : 0.0;
      for (int64_t t = batch->cu_seqlens_host[r]; t < batch->cu_seqlens_host[r + 1]; t++) {
        int64_t qo = t * q->stride[0] + kh * q->stride[1], ko = t * k->stride[0] + kh * k->stride[1];
        int64_t vo = t * v->stride[0] + h * v->stride[1];
        for (int64_t i = 0; i < Dk; i++)
          qv[i] = ref_get(q, qo + i), kv[i] = ref_get(k, ko + i);
        ref_gdn_l2norm(qv, Dk);
        ref_gdn_l2norm(kv, Dk);
        double g, beta;
        ref_gdn_gates(ref_get(in->a, t * in->a->stride[0] + h), ref_get(in->b, t * in->b->stride[0] + h), a_log[h],
                      dt_bias[h], &g, &beta);
        double decay = exp(g);
        for (int64_t i = 0; i < Dk * Dv; i++)
          S[i] *= decay;
        for (int64_t j = 0; j < Dv; j++) {
          double m = 0.0; /* (S^T k)_j: what the memory already returns for k */
          for (int64_t i = 0; i < Dk; i++)
            m += S[i * Dv + j] * kv[i];
          delta[j] = beta * ((double)ref_get(v, vo + j) - m);
        }
        for (int64_t i = 0; i < Dk; i++)
          for (int64_t j = 0; j < Dv; j++)
            S[i * Dv + j] += kv[i] * delta[j];
        for (int64_t j = 0; j < Dv; j++) {
          double acc = 0.0;
          for (int64_t i = 0; i < Dk; i++)
            acc += S[i * Dv + j] * qv[i];
          acc *= (double)in->scale;
          if (o)
            ref_put(o, t * o->stride[0] + h * o->stride[1] + j, acc);
          if (o64)
            o64[(t * Hv + h) * Dv + j] = acc;
        }
      }
      if (state_out)
        for (int64_t i = 0; i < Dk * Dv; i++)
          ((float *)state_out->data)[soff + i] = (float)S[i];
    }
  free(S), free(qv), free(kv), free(delta);
  return UPF_OK;
}

upf_status cpu_gdn_scan(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                        const upf_tensor *state_out) {
  UPF_TRY(upf_gdn_scan_check(batch, in, o, state_out));
  return scan_core(batch, in, o, NULL, state_out);
}

upf_status ref_gdn_scan_f64(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, double *o) {
  /* o's descriptor only carries the shape for the check; nothing is written through it. */
  upf_tensor shape_only;
  const int64_t so[3] = {in && in->q ? in->q->shape[0] : 0, in && in->v ? in->v->shape[1] : 0,
                         in && in->v ? in->v->shape[2] : 0};
  UPF_TRY(upf_tensor_init(&shape_only, o, UPF_DTYPE_F32, 3, so));
  UPF_TRY(upf_gdn_scan_check(batch, in, &shape_only, NULL));
  return scan_core(batch, in, NULL, o, NULL);
}

/* ---- gated RMSNorm ---- */

upf_status cpu_gdn_gated_norm(const upf_tensor *o, const upf_tensor *z, const upf_tensor *w, const upf_norm_params *p,
                              const upf_tensor *y) {
  UPF_TRY(upf_gdn_gated_norm_check(o, z, w, p, y));
  int64_t T = o->shape[0], H = o->shape[1], D = o->shape[2];
  double *row = malloc((size_t)D * sizeof *row);
  if (!row)
    return upf_fail(UPF_ERR_NOMEM, "gdn.gated_norm (cpu): cannot allocate a row of %lld", (long long)D);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      int64_t oo = t * o->stride[0] + h * o->stride[1], zo = t * z->stride[0] + h * z->stride[1];
      int64_t yo = t * y->stride[0] + h * y->stride[1];
      for (int64_t d = 0; d < D; d++)
        row[d] = ref_get(o, oo + d);
      double inv = ref_rms_inv(row, D, p->eps);
      for (int64_t d = 0; d < D; d++)
        ref_put(y, yo + d, row[d] * inv * ref_norm_gain(p, ref_get(w, d)) * upf_gdn_silu(ref_get(z, zo + d)));
    }
  free(row);
  return UPF_OK;
}

/* ---- the chunked (WY / UT-transform) form ---- */

/* Within a chunk of L tokens with cumulative log decays G (G_t = g_1 + ... + g_t), normalised k, scaled
 * q and the state S entering the chunk, the recurrence is (HF torch_chunk_gated_delta_rule, FLA's
 * chunk_gated_delta_rule):
 *   A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1        (the UT transform, by forward
 *   U = A diag(beta) V,  W = A diag(beta exp(G)) K                       substitution on the rows)
 *   V' = U - W S                                                         (the chunk's new values)
 *   O = (Q * exp(G)) S + causal(Q K^T * exp(G_i - G_j)) V'
 *   S <- exp(G_L) S + (K * exp(G_L - G))^T V'
 * G <= 0 and G_i - G_j <= 0 for j <= i, so nothing overflows; exp(G) underflowing to 0 is the true value. */
upf_status ref_gdn_scan_chunked(const upf_gdn_batch *batch, const upf_gdn_scan_inputs *in, int64_t chunk, double *o,
                                double *state_out) {
  upf_tensor shape_only;
  const int64_t so[3] = {in && in->q ? in->q->shape[0] : 0, in && in->v ? in->v->shape[1] : 0,
                         in && in->v ? in->v->shape[2] : 0};
  UPF_TRY(upf_tensor_init(&shape_only, o, UPF_DTYPE_F32, 3, so));
  UPF_TRY(upf_gdn_scan_check(batch, in, &shape_only, NULL));
  if (chunk < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "gdn.scan chunked: chunk=%lld must be >= 1", (long long)chunk);
  const upf_tensor *q = in->q, *k = in->k, *v = in->v;
  int64_t Hk = q->shape[1], Dk = q->shape[2], Hv = v->shape[1], Dv = v->shape[2], ratio = Hv / Hk, C = chunk;
  double *S = malloc((size_t)(Dk * Dv) * sizeof *S), *Q = malloc((size_t)(C * Dk) * sizeof *Q);
  double *K = malloc((size_t)(C * Dk) * sizeof *K), *V = malloc((size_t)(C * Dv) * sizeof *V);
  double *A = malloc((size_t)(C * C) * sizeof *A), *W = malloc((size_t)(C * Dk) * sizeof *W);
  double *U = malloc((size_t)(C * Dv) * sizeof *U), *G = malloc((size_t)C * sizeof *G);
  double *beta = malloc((size_t)C * sizeof *beta);
  upf_status st = UPF_OK;
  if (!S || !Q || !K || !V || !A || !W || !U || !G || !beta)
    st = upf_fail(UPF_ERR_NOMEM, "gdn.scan chunked (cpu): chunk buffers of %lld tokens", (long long)C);
  const float *a_log = st == UPF_OK ? in->a_log->data : NULL, *dt_bias = st == UPF_OK ? in->dt_bias->data : NULL;
  for (int32_t r = 0; st == UPF_OK && r < batch->num_reqs; r++)
    for (int64_t h = 0; h < Hv; h++) {
      int64_t kh = h / ratio, soff = ((int64_t)r * Hv + h) * Dk * Dv;
      for (int64_t i = 0; i < Dk * Dv; i++)
        S[i] = in->state_in ? (double)((const float *)in->state_in->data)[soff + i] : 0.0;
      for (int64_t c0 = batch->cu_seqlens_host[r]; c0 < batch->cu_seqlens_host[r + 1]; c0 += C) {
        int64_t L = batch->cu_seqlens_host[r + 1] - c0 < C ? batch->cu_seqlens_host[r + 1] - c0 : C;
        double cum = 0.0;
        for (int64_t t = 0; t < L; t++) {
          int64_t tok = c0 + t;
          for (int64_t i = 0; i < Dk; i++) {
            Q[t * Dk + i] = ref_get(q, tok * q->stride[0] + kh * q->stride[1] + i);
            K[t * Dk + i] = ref_get(k, tok * k->stride[0] + kh * k->stride[1] + i);
          }
          ref_gdn_l2norm(Q + t * Dk, Dk);
          ref_gdn_l2norm(K + t * Dk, Dk);
          for (int64_t i = 0; i < Dk; i++)
            Q[t * Dk + i] *= (double)in->scale;
          for (int64_t j = 0; j < Dv; j++)
            V[t * Dv + j] = ref_get(v, tok * v->stride[0] + h * v->stride[1] + j);
          double g;
          ref_gdn_gates(ref_get(in->a, tok * in->a->stride[0] + h), ref_get(in->b, tok * in->b->stride[0] + h),
                        a_log[h], dt_bias[h], &g, &beta[t]);
          cum += g;
          G[t] = cum;
        }
        /* A = (I + N)^-1 with N strictly lower: row i of A is e_i - sum_{j<i} N_ij A_j (A_j earlier rows). */
        for (int64_t i = 0; i < L; i++) {
          for (int64_t j = 0; j < L; j++)
            A[i * C + j] = i == j ? 1.0 : 0.0;
          for (int64_t j = 0; j < i; j++) {
            double kk = 0.0;
            for (int64_t d = 0; d < Dk; d++)
              kk += K[i * Dk + d] * K[j * Dk + d];
            double n = beta[i] * kk * exp(G[i] - G[j]);
            for (int64_t m = 0; m <= j; m++)
              A[i * C + m] -= n * A[j * C + m];
          }
        }
        for (int64_t i = 0; i < L; i++) {
          for (int64_t j = 0; j < Dv; j++) {
            double u = 0.0;
            for (int64_t m = 0; m <= i; m++)
              u += A[i * C + m] * beta[m] * V[m * Dv + j];
            U[i * Dv + j] = u;
          }
          for (int64_t d = 0; d < Dk; d++) {
            double w = 0.0;
            for (int64_t m = 0; m <= i; m++)
              w += A[i * C + m] * beta[m] * exp(G[m]) * K[m * Dk + d];
            W[i * Dk + d] = w;
          }
        }
        /* V' = U - W S (into U), then the outputs from the old S, then the new S. */
        for (int64_t i = 0; i < L; i++)
          for (int64_t j = 0; j < Dv; j++) {
            double ws = 0.0;
            for (int64_t d = 0; d < Dk; d++)
              ws += W[i * Dk + d] * S[d * Dv + j];
            U[i * Dv + j] -= ws;
          }
        for (int64_t i = 0; i < L; i++) {
          double eg = exp(G[i]);
          for (int64_t j = 0; j < Dv; j++) {
            double acc = 0.0;
            for (int64_t d = 0; d < Dk; d++)
              acc += Q[i * Dk + d] * eg * S[d * Dv + j];
            for (int64_t m = 0; m <= i; m++) {
              double qk = 0.0;
              for (int64_t d = 0; d < Dk; d++)
                qk += Q[i * Dk + d] * K[m * Dk + d];
              acc += qk * exp(G[i] - G[m]) * U[m * Dv + j];
            }
            o[((c0 + i) * Hv + h) * Dv + j] = acc;
          }
        }
        double eL = exp(G[L - 1]);
        for (int64_t d = 0; d < Dk; d++)
          for (int64_t j = 0; j < Dv; j++) {
            double acc = eL * S[d * Dv + j];
            for (int64_t m = 0; m < L; m++)
              acc += K[m * Dk + d] * exp(G[L - 1] - G[m]) * U[m * Dv + j];
            S[d * Dv + j] = acc;
          }
      }
      if (state_out)
        for (int64_t i = 0; i < Dk * Dv; i++)
          state_out[soff + i] = S[i];
    }
  free(S), free(Q), free(K), free(V), free(A), free(W), free(U), free(G), free(beta);
  return st;
}
