/* CPU reference of the Qwen3-Next MoE FFN: plain loops and OpenBLAS dgemm, everything in double, one
 * expert (or one chunk of tokens) at a time so that memory stays at a few chunks of rows rather than
 * the (T*K, H) activations of the whole layer. */
#include "ref_cpu/moe.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"

/* Token rows converted to double at a time. */
enum { REF_MOE_CHUNK = 512 };

void ref_moe_load_f64(const void *src, upf_dtype dtype, int64_t n, double *dst) {
  if (dtype == UPF_DTYPE_BF16) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++)
      dst[i] = upf_bf16_to_f32(s[i]);
  } else {
    const float *s = src;
    for (int64_t i = 0; i < n; i++)
      dst[i] = s[i];
  }
}

/* Element `offset` of a contiguous f32/bf16 array. */
static const void *at(const void *base, upf_dtype dtype, int64_t offset) {
  return (const char *)base + (size_t)offset * upf_dtype_size(dtype);
}

static const void *x_row(const upf_tensor *x, int64_t t) { return at(x->data, x->dtype, t * x->stride[0]); }

static double silu(double v) { return v / (1.0 + exp(-v)); }
static double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

/* Rank order of the router: a before b iff its logit is larger, or equal with the lower index. */
static int ranks_before(const double *logits, int32_t a, int32_t b) {
  return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

void ref_moe_route_token(const double *logits, const upf_moe_config *cfg, int32_t *index, double *weight,
                         double *prob) {
  int32_t E = cfg->num_experts, K = cfg->top_k;
  double m = -INFINITY, s = 0.0, chosen = 0.0;
  for (int32_t e = 0; e < E; e++)
    m = logits[e] > m ? logits[e] : m;
  for (int32_t e = 0; e < E; e++)
    s += exp(logits[e] - m);
  if (prob)
    for (int32_t e = 0; e < E; e++)
      prob[e] = exp(logits[e] - m) / s;
  /* Pick k is the best expert ranked after pick k-1: K scans, no sort, no scratch. */
  for (int32_t k = 0; k < K; k++) {
    int32_t best = -1;
    for (int32_t e = 0; e < E; e++) {
      if (k > 0 && !ranks_before(logits, index[k - 1], e))
        continue;
      if (best < 0 || ranks_before(logits, e, best))
        best = e;
    }
    index[k] = best;
    weight[k] = exp(logits[best] - m) / s;
    chosen += weight[k];
  }
  if (cfg->norm_topk)
    for (int32_t k = 0; k < K; k++)
      weight[k] /= chosen;
}

upf_status ref_moe_logits(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits) {
  int64_t T = x->shape[0], H = cfg->hidden, E = cfg->num_experts;
  double *wr = malloc((size_t)(E * H) * sizeof *wr);
  double *xc = malloc((size_t)(REF_MOE_CHUNK * H) * sizeof *xc);
  if (!wr || !xc) {
    free(wr), free(xc);
    return upf_fail(UPF_ERR_NOMEM, "moe (cpu): cannot allocate the router in double");
  }
  ref_moe_load_f64(w->router, w->dtype, E * H, wr);
  for (int64_t t0 = 0; t0 < T; t0 += REF_MOE_CHUNK) {
    int64_t c = T - t0 < REF_MOE_CHUNK ? T - t0 : REF_MOE_CHUNK;
    for (int64_t j = 0; j < c; j++)
      ref_moe_load_f64(x_row(x, t0 + j), x->dtype, H, xc + j * H);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)E, (int)H, 1.0, xc, (int)H, wr, (int)H, 0.0,
                logits + t0 * E, (int)E);
  }
  free(wr), free(xc);
  for (int64_t t = 0; t < T; t++)
    for (int64_t e = 0; e < E; e++)
      if (!isfinite(logits[t * E + e]))
        return upf_fail(UPF_ERR_NONFINITE,
                        "moe: router logit %lld of token %lld is %s (NaN/Inf in x row %lld or in the router weights)",
                        (long long)e, (long long)t, isnan(logits[t * E + e]) ? "NaN" : "Inf", (long long)t);
  return UPF_OK;
}

upf_status ref_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits,
                         int32_t *topk_index, double *topk_weight) {
  UPF_TRY(ref_moe_logits(cfg, x, w, logits));
  int64_t E = cfg->num_experts, K = cfg->top_k;
  for (int64_t t = 0; t < x->shape[0]; t++)
    ref_moe_route_token(logits + t * E, cfg, topk_index + t * K, topk_weight + t * K, NULL);
  return UPF_OK;
}

static upf_status check_permute_args(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                                     const upf_moe_permutation *perm) {
  UPF_TRY(upf_moe_config_check(cfg));
  if (num_tokens < 0 || num_tokens * (int64_t)cfg->top_k > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "moe.permute: T=%lld tokens (T*K must fit in int32)", (long long)num_tokens);
  if (!perm || !perm->expert_count || !perm->expert_offset || !perm->sorted_pair || !perm->pair_row ||
      (num_tokens > 0 && !topk_index))
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.permute: topk_index and all four permutation outputs must be set");
  return UPF_OK;
}

upf_status ref_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                           upf_moe_permutation *perm) {
  UPF_TRY(check_permute_args(cfg, num_tokens, topk_index, perm));
  int64_t n = num_tokens * cfg->top_k;
  int32_t E = cfg->num_experts;
  for (int64_t p = 0; p < n; p++)
    if (topk_index[p] < 0 || topk_index[p] >= E)
      return upf_fail(UPF_ERR_INVALID_ARG, "moe.permute: topk_index[%lld] (token %lld, rank %lld) = %d outside [0, E=%d)",
                      (long long)p, (long long)(p / cfg->top_k), (long long)(p % cfg->top_k), topk_index[p], E);
  int32_t *cursor = malloc((size_t)E * sizeof *cursor);
  if (!cursor)
    return upf_fail(UPF_ERR_NOMEM, "moe.permute (cpu): cannot allocate %d counters", E);
  memset(perm->expert_count, 0, (size_t)E * sizeof *perm->expert_count);
  for (int64_t p = 0; p < n; p++)
    perm->expert_count[topk_index[p]]++;
  perm->expert_offset[0] = 0;
  for (int32_t e = 0; e < E; e++) {
    perm->expert_offset[e + 1] = perm->expert_offset[e] + perm->expert_count[e];
    cursor[e] = perm->expert_offset[e];
  }
  for (int64_t p = 0; p < n; p++) {
    int32_t pos = cursor[topk_index[p]]++;
    perm->sorted_pair[pos] = (int32_t)p;
    perm->pair_row[p] = pos;
  }
  free(cursor);
  return UPF_OK;
}

/* Rounds n values to what storing them in `dtype` keeps (f32, or bf16 to nearest even). */
static void store_round(double *v, int64_t n, upf_dtype dtype) {
  for (int64_t i = 0; i < n; i++)
    v[i] = dtype == UPF_DTYPE_BF16 ? (double)upf_round_bf16((float)v[i]) : (double)(float)v[i];
}

/* act (rows, inter) = silu(hg[:, :inter]) * hg[:, inter:], hg (rows, 2*inter). */
static void swiglu_rows(const double *hg, int64_t rows, int64_t inter, double *act) {
  for (int64_t j = 0; j < rows; j++)
    for (int64_t i = 0; i < inter; i++)
      act[j * inter + i] = silu(hg[j * 2 * inter + i]) * hg[j * 2 * inter + inter + i];
}

/* One SwiGLU FFN on c rows: y (c, H) = (silu(x g^T) * (x u^T)) down^T, from xr (c, H), gate_up
 * (2I, H) and down (H, I) in double; hg (c, 2I) and act (c, I) are scratch. The projections hg,
 * the activation and y are rounded to `store` (x's dtype), where every backend stores them. */
static void ffn_rows(const double *xr, int64_t c, int64_t H, int64_t In, const double *gate_up, const double *down,
                     upf_dtype store, double *hg, double *act, double *y) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)(2 * In), (int)H, 1.0, xr, (int)H, gate_up,
              (int)H, 0.0, hg, (int)(2 * In));
  store_round(hg, c * 2 * In, store);
  swiglu_rows(hg, c, In, act);
  store_round(act, c * In, store);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)H, (int)In, 1.0, act, (int)In, down, (int)In, 0.0,
              y, (int)H);
  store_round(y, c * H, store);
}

/* Scratch of one FFN of intermediate size I over chunks of REF_MOE_CHUNK rows. */
typedef struct {
  double *gate_up; /* (2I, H) */
  double *down;    /* (H, I) */
  double *xr;      /* (CHUNK, H) */
  double *hg;      /* (CHUNK, 2I) */
  double *act;     /* (CHUNK, I) */
  double *y;       /* (CHUNK, H) */
} ffn_scratch;

static int ffn_scratch_alloc(ffn_scratch *s, int64_t H, int64_t In) {
  size_t ch = REF_MOE_CHUNK;
  s->gate_up = malloc((size_t)(2 * In * H) * sizeof(double));
  s->down = malloc((size_t)(H * In) * sizeof(double));
  s->xr = malloc(ch * (size_t)H * sizeof(double));
  s->hg = malloc(ch * (size_t)(2 * In) * sizeof(double));
  s->act = malloc(ch * (size_t)In * sizeof(double));
  s->y = malloc(ch * (size_t)H * sizeof(double));
  return s->gate_up && s->down && s->xr && s->hg && s->act && s->y;
}

static void ffn_scratch_free(ffn_scratch *s) {
  free(s->gate_up), free(s->down), free(s->xr), free(s->hg), free(s->act), free(s->y);
  memset(s, 0, sizeof *s);
}

static upf_status routed_experts(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                                 const upf_moe_permutation *perm, const double *topk_weight, double *out) {
  int64_t H = cfg->hidden, In = cfg->inter, K = cfg->top_k;
  ffn_scratch s;
  if (!ffn_scratch_alloc(&s, H, In)) {
    ffn_scratch_free(&s);
    return upf_fail(UPF_ERR_NOMEM, "moe (cpu): cannot allocate expert scratch");
  }
  for (int64_t e = 0; e < cfg->num_experts; e++) {
    int64_t n = perm->expert_count[e], first = perm->expert_offset[e];
    if (n == 0)
      continue;
    ref_moe_load_f64(at(w->gate_up, w->dtype, e * 2 * In * H), w->dtype, 2 * In * H, s.gate_up);
    ref_moe_load_f64(at(w->down, w->dtype, e * H * In), w->dtype, H * In, s.down);
    for (int64_t j0 = 0; j0 < n; j0 += REF_MOE_CHUNK) {
      int64_t c = n - j0 < REF_MOE_CHUNK ? n - j0 : REF_MOE_CHUNK;
      for (int64_t j = 0; j < c; j++)
        ref_moe_load_f64(x_row(x, perm->sorted_pair[first + j0 + j] / K), x->dtype, H, s.xr + j * H);
      ffn_rows(s.xr, c, H, In, s.gate_up, s.down, x->dtype, s.hg, s.act, s.y);
      for (int64_t j = 0; j < c; j++) {
        int64_t p = perm->sorted_pair[first + j0 + j];
        double wt = topk_weight[p];
        double *o = out + (p / K) * H;
        for (int64_t h = 0; h < H; h++)
          o[h] += wt * s.y[j * H + h];
      }
    }
  }
  ffn_scratch_free(&s);
  return UPF_OK;
}

static upf_status shared_expert(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *out) {
  int64_t T = x->shape[0], H = cfg->hidden, Is = cfg->shared_inter;
  ffn_scratch s;
  double *gate = malloc((size_t)H * sizeof *gate);
  if (!ffn_scratch_alloc(&s, H, Is) || !gate) {
    ffn_scratch_free(&s), free(gate);
    return upf_fail(UPF_ERR_NOMEM, "moe (cpu): cannot allocate shared-expert scratch");
  }
  ref_moe_load_f64(w->shared_gate_up, w->dtype, 2 * Is * H, s.gate_up);
  ref_moe_load_f64(w->shared_down, w->dtype, H * Is, s.down);
  ref_moe_load_f64(w->shared_gate, w->dtype, H, gate);
  for (int64_t t0 = 0; t0 < T; t0 += REF_MOE_CHUNK) {
    int64_t c = T - t0 < REF_MOE_CHUNK ? T - t0 : REF_MOE_CHUNK;
    for (int64_t j = 0; j < c; j++)
      ref_moe_load_f64(x_row(x, t0 + j), x->dtype, H, s.xr + j * H);
    ffn_rows(s.xr, c, H, Is, s.gate_up, s.down, x->dtype, s.hg, s.act, s.y);
    for (int64_t j = 0; j < c; j++) {
      double dot = 0.0;
      for (int64_t h = 0; h < H; h++)
        dot += s.xr[j * H + h] * gate[h];
      double g = sigmoid(dot);
      double *o = out + (t0 + j) * H;
      for (int64_t h = 0; h < H; h++)
        o[h] += g * s.y[j * H + h];
    }
  }
  ffn_scratch_free(&s), free(gate);
  return UPF_OK;
}

upf_status ref_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                       const int32_t *topk_index, const double *topk_weight, double *out) {
  UPF_TRY(upf_moe_validate(cfg, x, w, NULL));
  int64_t T = x->shape[0], H = cfg->hidden, E = cfg->num_experts, n = T * cfg->top_k;
  memset(out, 0, (size_t)(T * H) * sizeof *out);
  if (T == 0)
    return UPF_OK;
  upf_moe_permutation perm = {
      .expert_count = malloc((size_t)E * sizeof(int32_t)), .expert_offset = malloc((size_t)(E + 1) * sizeof(int32_t)),
      .sorted_pair = malloc((size_t)n * sizeof(int32_t)), .pair_row = malloc((size_t)n * sizeof(int32_t))};
  upf_status st = perm.expert_count && perm.expert_offset && perm.sorted_pair && perm.pair_row
                      ? UPF_OK
                      : upf_fail(UPF_ERR_NOMEM, "moe (cpu): cannot allocate the permutation of %lld pairs", (long long)n);
  if (st == UPF_OK)
    st = ref_moe_permute(cfg, T, topk_index, &perm);
  if (st == UPF_OK)
    st = routed_experts(cfg, x, w, &perm, topk_weight, out);
  if (st == UPF_OK && cfg->shared_inter > 0)
    st = shared_expert(cfg, x, w, out);
  free(perm.expert_count), free(perm.expert_offset), free(perm.sorted_pair), free(perm.pair_row);
  return st;
}

/* ---- CPU backend entries ---- */

/* The double routing of x into host buffers the caller frees: logits (T, E), index and weight (T, K). */
static upf_status route_f64(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double **logits,
                            int32_t **index, double **weight) {
  int64_t T = x->shape[0], n = T * cfg->top_k;
  *logits = malloc((size_t)(T * cfg->num_experts + 1) * sizeof **logits);
  *index = malloc((size_t)(n + 1) * sizeof **index);
  *weight = malloc((size_t)(n + 1) * sizeof **weight);
  if (!*logits || !*index || !*weight)
    return upf_fail(UPF_ERR_NOMEM, "moe (cpu): cannot allocate the routing of %lld tokens", (long long)T);
  return ref_moe_route(cfg, x, w, *logits, *index, *weight);
}

static void store_routing(const upf_moe_config *cfg, int64_t T, const double *logits, const int32_t *index,
                          const double *weight, upf_moe_routing *routing) {
  int64_t n = T * cfg->top_k;
  if (routing->topk_index)
    memcpy(routing->topk_index, index, (size_t)n * sizeof *index);
  if (routing->topk_weight)
    for (int64_t i = 0; i < n; i++)
      routing->topk_weight[i] = (float)weight[i];
  if (routing->logits)
    for (int64_t i = 0; i < T * cfg->num_experts; i++)
      routing->logits[i] = (float)logits[i];
}

upf_status cpu_moe_route(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                         upf_moe_routing *routing) {
  UPF_TRY(upf_moe_validate(cfg, x, w, NULL));
  if (!routing || !routing->topk_index || !routing->topk_weight)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.route: routing->topk_index and topk_weight must be set");
  double *logits = NULL, *weight = NULL;
  int32_t *index = NULL;
  upf_status st = route_f64(cfg, x, w, &logits, &index, &weight);
  if (st == UPF_OK)
    store_routing(cfg, x->shape[0], logits, index, weight, routing);
  free(logits), free(index), free(weight);
  return st;
}

upf_status cpu_moe_permute(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                           upf_moe_permutation *perm) {
  return ref_moe_permute(cfg, num_tokens, topk_index, perm);
}

upf_status cpu_moe_ffn(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w,
                       const upf_tensor *out, upf_moe_routing *routing) {
  if (!out)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe.ffn: out must be set");
  UPF_TRY(upf_moe_validate(cfg, x, w, out));
  int64_t T = x->shape[0], H = cfg->hidden;
  double *logits = NULL, *weight = NULL, *y = NULL;
  int32_t *index = NULL;
  upf_status st = route_f64(cfg, x, w, &logits, &index, &weight);
  if (st == UPF_OK) {
    y = malloc((size_t)(T * H + 1) * sizeof *y);
    st = y ? ref_moe_ffn(cfg, x, w, index, weight, y) : upf_fail(UPF_ERR_NOMEM, "moe.ffn (cpu): output scratch");
  }
  if (st == UPF_OK) {
    for (int64_t t = 0; t < T; t++) {
      const double *src = y + t * H;
      if (out->dtype == UPF_DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)out->data + t * out->stride[0];
        for (int64_t h = 0; h < H; h++)
          dst[h] = upf_bf16_from_f32((float)src[h]);
      } else {
        float *dst = (float *)out->data + t * out->stride[0];
        for (int64_t h = 0; h < H; h++)
          dst[h] = (float)src[h];
      }
    }
    if (routing)
      store_routing(cfg, T, logits, index, weight, routing);
  }
  free(logits), free(index), free(weight), free(y);
  return st;
}
