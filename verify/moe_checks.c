/* MoE checks: routing agreement (marginal rule), permutation invariants, the naive per-token layer
 * and the golden cases. */
#include "verify/moe_checks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"

double upf_moe_tau(upf_dtype input_dtype) { return input_dtype == UPF_DTYPE_BF16 ? 1e-3 : 1e-5; }

static void softmax(const double *l, int64_t E, double *p) {
  double m = -INFINITY, s = 0.0;
  for (int64_t e = 0; e < E; e++)
    m = l[e] > m ? l[e] : m;
  for (int64_t e = 0; e < E; e++)
    s += (p[e] = exp(l[e] - m));
  for (int64_t e = 0; e < E; e++)
    p[e] /= s;
}

void upf_moe_compare_routing(const upf_moe_config *cfg, int64_t num_tokens, const double *ref_logits,
                             const int32_t *ref_index, const int32_t *got_index, double tau, uint8_t *agree,
                             upf_check *check) {
  const int64_t E = cfg->num_experts, K = cfg->top_k;
  double *p = malloc((size_t)E * sizeof *p);
  uint8_t *in_ref = malloc((size_t)E), *in_got = malloc((size_t)E);
  int64_t same = 0, marginal = 0, bad = 0, tie_order = 0;
  double worst = 0.0;
  char why[200] = "";
  for (int64_t t = 0; p && in_ref && in_got && t < num_tokens; t++) {
    const double *l = ref_logits + t * E;
    const int32_t *r = ref_index + t * K, *g = got_index + t * K;
    int ok = 1, same_set = 1;
    softmax(l, E, p);
    memset(in_ref, 0, (size_t)E), memset(in_got, 0, (size_t)E);
    for (int64_t k = 0; k < K; k++)
      in_ref[r[k]] = 1;
    for (int64_t k = 0; k < K && ok; k++) {
      if (g[k] < 0 || g[k] >= E || in_got[g[k]]) {
        ok = 0;
        if (!bad)
          snprintf(why, sizeof why, "token %lld rank %lld: expert %d out of range or chosen twice", (long long)t,
                   (long long)k, g[k]);
      } else {
        in_got[g[k]] = 1;
      }
    }
    if (ok) {
      double max_dropped = 0.0, min_added = INFINITY;
      for (int64_t e = 0; e < E; e++) {
        if (in_ref[e] == in_got[e])
          continue;
        same_set = 0;
        if (in_ref[e])
          max_dropped = p[e] > max_dropped ? p[e] : max_dropped;
        else
          min_added = p[e] < min_added ? p[e] : min_added;
      }
      if (!same_set) {
        double gap = (max_dropped - min_added) / max_dropped;
        if (gap <= tau) {
          marginal++;
          worst = gap > worst ? gap : worst;
        } else {
          ok = 0;
          if (!bad)
            snprintf(why, sizeof why,
                     "token %lld: experts differ from the reference beyond tau (probabilities %.9g dropped, %.9g "
                     "taken)",
                     (long long)t, max_dropped, min_added);
        }
      }
    }
    for (int64_t k = 1; k < K && ok; k++) {
      int32_t a = g[k - 1], b = g[k];
      if (p[b] > p[a] * (1.0 + tau)) {
        ok = 0;
        if (!bad)
          snprintf(why, sizeof why, "token %lld: rank %lld (expert %d, p=%.9g) above rank %lld (expert %d, p=%.9g)",
                   (long long)t, (long long)k, b, p[b], (long long)k - 1, a, p[a]);
      } else if (l[b] > l[a] || (l[b] == l[a] && b < a)) {
        tie_order++;
      }
    }
    if (!ok)
      bad++;
    else if (same_set)
      same++;
    if (agree)
      agree[t] = (uint8_t)(ok && same_set);
  }
  check->nmse = 0.0;
  check->max_abs_err = (double)bad;
  check->budget = bad ? INFINITY : worst / tau;
  check->passed = bad == 0 && p && in_ref && in_got;
  if (!p || !in_ref || !in_got)
    snprintf(check->detail, sizeof check->detail, "out of memory");
  else if (bad)
    snprintf(check->detail, sizeof check->detail, "%lld of %lld tokens routed wrongly; first: %s", (long long)bad,
             (long long)num_tokens, why);
  else
    snprintf(check->detail, sizeof check->detail,
             "%lld tokens: %lld same experts, %lld marginal (routing differs within tau), %lld ordered within tau",
             (long long)num_tokens, (long long)same, (long long)marginal, (long long)tie_order);
  free(p), free(in_ref), free(in_got);
}

void upf_moe_check_permutation(const upf_moe_config *cfg, int64_t num_tokens, const int32_t *topk_index,
                               const upf_moe_permutation *perm, upf_check *check) {
  const int64_t E = cfg->num_experts, n = num_tokens * cfg->top_k;
  int64_t *count = calloc((size_t)E, sizeof *count);
  uint8_t *seen = calloc((size_t)(n ? n : 1), 1);
  char why[200] = "";
  check->nmse = check->max_abs_err = check->budget = 0.0;
  if (!count || !seen)
    snprintf(why, sizeof why, "out of memory");
  for (int64_t p = 0; !why[0] && p < n; p++)
    count[topk_index[p]]++;
  if (!why[0] && perm->expert_offset[0] != 0)
    snprintf(why, sizeof why, "expert_offset[0] = %d", perm->expert_offset[0]);
  for (int64_t e = 0; !why[0] && e < E; e++) {
    if (perm->expert_count[e] != count[e])
      snprintf(why, sizeof why, "expert %lld: count %d, expected %lld", (long long)e, perm->expert_count[e],
               (long long)count[e]);
    else if (perm->expert_offset[e + 1] != perm->expert_offset[e] + count[e])
      snprintf(why, sizeof why, "expert_offset[%lld] = %d is not the prefix sum", (long long)e + 1,
               perm->expert_offset[e + 1]);
    for (int64_t i = perm->expert_offset[e]; !why[0] && i < perm->expert_offset[e] + count[e]; i++) {
      int32_t p = perm->sorted_pair[i];
      if (p < 0 || p >= n || seen[p])
        snprintf(why, sizeof why, "sorted_pair[%lld] = %d out of range or repeated", (long long)i, p);
      else if (topk_index[p] != e)
        snprintf(why, sizeof why, "sorted_pair[%lld] = %d belongs to expert %d, not %lld", (long long)i, p,
                 topk_index[p], (long long)e);
      else if (i > perm->expert_offset[e] && p <= perm->sorted_pair[i - 1])
        snprintf(why, sizeof why, "expert %lld: pairs not ascending at %lld (not a stable sort)", (long long)e,
                 (long long)i);
      else if (perm->pair_row[p] != i)
        snprintf(why, sizeof why, "pair_row[%d] = %d, sorted position %lld", p, perm->pair_row[p], (long long)i);
      if (!why[0])
        seen[p] = 1;
    }
  }
  check->passed = !why[0];
  snprintf(check->detail, sizeof check->detail, "%s", why);
  free(count), free(seen);
}

/* ---- naive layer ---- */

static double value_at(const void *base, upf_dtype dtype, int64_t i) {
  return dtype == UPF_DTYPE_BF16 ? (double)upf_bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static double silu(double v) { return v / (1.0 + exp(-v)); }

/* What storing v in dtype keeps (the intermediates of moe.h's Numerics). */
static double stored(double v, upf_dtype dtype) {
  return dtype == UPF_DTYPE_BF16 ? (double)upf_round_bf16((float)v) : (double)(float)v;
}

/* y (H) += scale * down (H, I) . (silu(gate . x) * (up . x)), gate_up (2I, H); the projections, the
 * activation and the down projection rounded to the weights' dtype. */
static void naive_expert(const upf_moe_weights *w, const void *gate_up, const void *down, int64_t H, int64_t In,
                         const double *x, double scale, double *act, double *y) {
  for (int64_t i = 0; i < In; i++) {
    double g = 0.0, u = 0.0;
    for (int64_t h = 0; h < H; h++) {
      g += value_at(gate_up, w->dtype, i * H + h) * x[h];
      u += value_at(gate_up, w->dtype, (In + i) * H + h) * x[h];
    }
    g = stored(g, w->dtype), u = stored(u, w->dtype);
    act[i] = stored(silu(g) * u, w->dtype);
  }
  for (int64_t h = 0; h < H; h++) {
    double s = 0.0;
    for (int64_t i = 0; i < In; i++)
      s += value_at(down, w->dtype, h * In + i) * act[i];
    y[h] += scale * stored(s, w->dtype);
  }
}

void upf_moe_naive(const upf_moe_config *cfg, const upf_tensor *x, const upf_moe_weights *w, double *logits,
                   int32_t *topk_index, double *topk_weight, double *out) {
  const int64_t T = x->shape[0], H = cfg->hidden, E = cfg->num_experts, K = cfg->top_k, In = cfg->inter;
  const int64_t Is = cfg->shared_inter, es = (int64_t)upf_dtype_size(w->dtype);
  int64_t wide = In > Is ? In : Is;
  double *xr = malloc((size_t)H * sizeof *xr), *l = malloc((size_t)E * sizeof *l), *p = malloc((size_t)E * sizeof *p);
  double *act = malloc((size_t)(wide ? wide : 1) * sizeof *act);
  int32_t *order = malloc((size_t)E * sizeof *order);
  if (!xr || !l || !p || !act || !order) {
    free(xr), free(l), free(p), free(act), free(order);
    return;
  }
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++)
      xr[h] = value_at(x->data, x->dtype, t * x->stride[0] + h);
    for (int64_t e = 0; e < E; e++) {
      double s = 0.0;
      for (int64_t h = 0; h < H; h++)
        s += value_at(w->router, w->dtype, e * H + h) * xr[h];
      l[e] = s;
    }
    softmax(l, E, p);
    /* Insertion sort by (logit descending, index ascending). */
    for (int64_t e = 0; e < E; e++) {
      int64_t j = e;
      while (j > 0 && l[order[j - 1]] < l[e])
        order[j] = order[j - 1], j--;
      order[j] = (int32_t)e;
    }
    double chosen = 0.0;
    for (int64_t k = 0; k < K; k++)
      chosen += p[order[k]];
    if (logits)
      memcpy(logits + t * E, l, (size_t)E * sizeof *l);
    for (int64_t k = 0; k < K; k++) {
      if (topk_index)
        topk_index[t * K + k] = order[k];
      if (topk_weight)
        topk_weight[t * K + k] = cfg->norm_topk ? p[order[k]] / chosen : p[order[k]];
    }
    if (!out)
      continue;
    double *o = out + t * H;
    memset(o, 0, (size_t)H * sizeof *o);
    for (int64_t k = 0; k < K; k++) {
      int64_t e = order[k];
      double wk = cfg->norm_topk ? p[e] / chosen : p[e];
      naive_expert(w, (const char *)w->gate_up + (size_t)(e * 2 * In * H * es),
                   (const char *)w->down + (size_t)(e * H * In * es), H, In, xr, wk, act, o);
    }
    if (Is > 0) {
      double dot = 0.0;
      for (int64_t h = 0; h < H; h++)
        dot += value_at(w->shared_gate, w->dtype, h) * xr[h];
      naive_expert(w, w->shared_gate_up, w->shared_down, H, Is, xr, 1.0 / (1.0 + exp(-dot)), act, o);
    }
  }
  free(xr), free(l), free(p), free(act), free(order);
}

/* ---- golden cases ----
 * H=2, E=4, K=2, I=Is=1, renormalised. x = [[1, 0], [0, 1]]; router rows e0..e3 = [1, 2], [3, 0],
 * [2, 1], [3, -1], so token 0's logits are [1, 3, 2, 3] (experts 1 and 3 tie: 1 ranks first) and
 * token 1's are [2, 0, 1, -1]. Expert e: gate row [e+1, e+1], up row [1, 2], down [1, 2]^T, so on
 * token 0 it gives silu(e+1) [1, 2] and on token 1 2 silu(e+1) [1, 2]. Shared expert: gate row [1, 1],
 * up row [1, 1], down [1, -1]^T, sigmoid gate weights [0, 0] (sigmoid = 1/2): 1/2 silu(1) [1, -1].
 *   token 0: top-2 (1, 3), weights (1/2, 1/2):
 *            out = 1/2 silu(2) [1,2] + 1/2 silu(4) [1,2] + 1/2 silu(1) [1,-1]
 *   token 1: top-2 (0, 2), weights (e/(1+e), 1/(1+e)):
 *            out = e/(1+e) 2 silu(1) [1,2] + 1/(1+e) 2 silu(3) [1,2] + 1/2 silu(1) [1,-1]
 * Pairs p = t*K + k route to experts [1, 3, 0, 2]: counts [1, 1, 1, 1], offsets [0, 1, 2, 3, 4],
 * sorted_pair [2, 0, 3, 1], pair_row [1, 3, 0, 2]. */
static const upf_moe_config golden_cfg = {.hidden = 2, .num_experts = 4, .top_k = 2, .inter = 1, .shared_inter = 1,
                                          .norm_topk = 1};
static const float g_x[4] = {1, 0, 0, 1};
static const float g_router[8] = {1, 2, 3, 0, 2, 1, 3, -1};
static const float g_gate_up[16] = {1, 1, 1, 2, 2, 2, 1, 2, 3, 3, 1, 2, 4, 4, 1, 2};
static const float g_down[8] = {1, 2, 1, 2, 1, 2, 1, 2};
static const float g_shared_gate_up[4] = {1, 1, 1, 1};
static const float g_shared_down[2] = {1, -1};
static const float g_shared_gate[2] = {0, 0};
static const int32_t g_index[4] = {1, 3, 0, 2};
static const int32_t g_sorted[4] = {2, 0, 3, 1}, g_pair_row[4] = {1, 3, 0, 2};
static const int32_t g_count[4] = {1, 1, 1, 1}, g_offset[5] = {0, 1, 2, 3, 4};
/* Skewed permutation: T=3, K=2 over E=4; expert 1 gets nothing, expert 2 every token. */
static const int32_t s_index[6] = {2, 0, 2, 3, 2, 0};
static const int32_t s_count[4] = {2, 0, 3, 1}, s_offset[5] = {0, 2, 2, 5, 6};
static const int32_t s_sorted[6] = {1, 5, 0, 2, 4, 3}, s_pair_row[6] = {2, 0, 3, 5, 4, 1};

static void golden_expected(double *logits, double *weight, double *out) {
  const double e = exp(1.0);
  const double s1 = silu(1.0), s2 = silu(2.0), s3 = silu(3.0), s4 = silu(4.0);
  const double l[8] = {1, 3, 2, 3, 2, 0, 1, -1};
  memcpy(logits, l, sizeof l);
  weight[0] = weight[1] = 0.5;
  weight[2] = e / (1.0 + e), weight[3] = 1.0 / (1.0 + e);
  out[0] = 0.5 * s2 + 0.5 * s4 + 0.5 * s1;
  out[1] = 2.0 * (0.5 * s2 + 0.5 * s4) - 0.5 * s1;
  out[2] = weight[2] * 2.0 * s1 + weight[3] * 2.0 * s3 + 0.5 * s1;
  out[3] = 2.0 * (weight[2] * 2.0 * s1 + weight[3] * 2.0 * s3) - 0.5 * s1;
}

const char *upf_moe_golden_name(upf_moe_golden golden) {
  static const char *const names[UPF_MOE_GOLDEN_COUNT] = {"golden route (tie to lower index)", "golden permutation",
                                                          "golden permutation: empty and full experts",
                                                          "golden layer"};
  return (unsigned)golden < UPF_MOE_GOLDEN_COUNT ? names[golden] : "invalid";
}

/* Backend buffers of one golden run, released together. */
typedef struct {
  const upf_backend *be;
  void *in[8];
  int n_in;
  upf_guarded out[4];
} golden_bufs;

static upf_status put(golden_bufs *b, const void *host, size_t bytes, const void **dev) {
  void *p = NULL;
  UPF_TRY(b->be->alloc(&p, bytes));
  b->in[b->n_in++] = p;
  *dev = p;
  return b->be->upload(p, host, bytes);
}

/* Host array of n golden floats in dtype (bf16 holds them exactly). */
static void to_dtype(const float *src, int64_t n, upf_dtype dtype, void *dst) {
  if (dtype == UPF_DTYPE_BF16)
    upf_bf16_from_f32_array(dst, src, n);
  else
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static upf_status golden_inputs(golden_bufs *b, upf_dtype dtype, upf_tensor *x, upf_moe_weights *w) {
  unsigned char tmp[64];
  const void *dev = NULL;
  const struct {
    const float *v;
    int64_t n;
  } parts[7] = {{g_x, 4}, {g_router, 8}, {g_gate_up, 16}, {g_down, 8}, {g_shared_gate_up, 4}, {g_shared_down, 2},
                {g_shared_gate, 2}};
  const void **slots[7] = {NULL, &w->router, &w->gate_up, &w->down, &w->shared_gate_up, &w->shared_down,
                           &w->shared_gate};
  size_t es = upf_dtype_size(dtype);
  w->dtype = dtype;
  for (int i = 0; i < 7; i++) {
    to_dtype(parts[i].v, parts[i].n, dtype, tmp);
    UPF_TRY(put(b, tmp, (size_t)parts[i].n * es, i == 0 ? &dev : slots[i]));
  }
  int64_t shape[2] = {2, 2};
  return upf_tensor_init(x, (void *)dev, dtype, 2, shape);
}

static void golden_free(golden_bufs *b) {
  for (int i = 0; i < b->n_in; i++)
    b->be->release(b->in[i]);
  for (int i = 0; i < 4; i++)
    upf_guarded_free(&b->out[i]);
}

/* Downloads guarded output i into host. */
static upf_status fetch(golden_bufs *b, int i, void *host, const char *name) {
  UPF_TRY(upf_guarded_check(&b->out[i], name));
  return b->be->download(host, b->out[i].ptr, b->out[i].bytes);
}

static int exact(const void *got, const void *want, size_t bytes, const char *what, upf_check *check) {
  if (!memcmp(got, want, bytes))
    return 1;
  check->passed = 0;
  snprintf(check->detail, sizeof check->detail, "%s differs from the hand-computed value", what);
  return 0;
}

static upf_status golden_permute(golden_bufs *b, const int32_t *index, int64_t T, const int32_t *count,
                                 const int32_t *offset, const int32_t *sorted, const int32_t *pair_row,
                                 upf_check *check) {
  const upf_moe_config *c = &golden_cfg;
  int64_t n = T * c->top_k, E = c->num_experts;
  const void *dev_index = NULL;
  int32_t got[4][8];
  UPF_TRY(put(b, index, (size_t)n * 4, &dev_index));
  size_t bytes[4] = {(size_t)E * 4, (size_t)(E + 1) * 4, (size_t)n * 4, (size_t)n * 4};
  for (int i = 0; i < 4; i++)
    UPF_TRY(upf_guarded_alloc(b->be, bytes[i], &b->out[i]));
  upf_moe_permutation perm = {b->out[0].ptr, b->out[1].ptr, b->out[2].ptr, b->out[3].ptr};
  UPF_TRY(b->be->moe_permute(c, T, dev_index, &perm));
  static const char *const names[4] = {"expert_count", "expert_offset", "sorted_pair", "pair_row"};
  for (int i = 0; i < 4; i++)
    UPF_TRY(fetch(b, i, got[i], names[i]));
  const void *want[4] = {count, offset, sorted, pair_row};
  check->passed = 1;
  for (int i = 0; i < 4; i++)
    if (!exact(got[i], want[i], bytes[i], names[i], check))
      break;
  return UPF_OK;
}

static upf_status golden_route_or_ffn(golden_bufs *b, upf_dtype dtype, int ffn, upf_check *check) {
  const upf_moe_config *c = &golden_cfg;
  upf_tensor x;
  upf_moe_weights w;
  memset(&w, 0, sizeof w);
  UPF_TRY(golden_inputs(b, dtype, &x, &w));
  double logits[8], weight[4], out[4];
  golden_expected(logits, weight, out);
  UPF_TRY(upf_guarded_alloc(b->be, 4 * sizeof(int32_t), &b->out[0]));
  UPF_TRY(upf_guarded_alloc(b->be, 4 * sizeof(float), &b->out[1]));
  UPF_TRY(upf_guarded_alloc(b->be, 8 * sizeof(float), &b->out[2]));
  upf_moe_routing rt = {b->out[0].ptr, b->out[1].ptr, b->out[2].ptr};
  upf_tensor y;
  if (ffn) {
    int64_t shape[2] = {2, 2};
    UPF_TRY(upf_guarded_alloc(b->be, 4 * upf_dtype_size(dtype), &b->out[3]));
    UPF_TRY(upf_tensor_init(&y, b->out[3].ptr, dtype, 2, shape));
    UPF_TRY(b->be->moe_ffn(c, &x, &w, &y, &rt));
  } else {
    UPF_TRY(b->be->moe_route(c, &x, &w, &rt));
  }
  int32_t got_index[4];
  float got_weight[4], got_logits[8], got_out[4];
  UPF_TRY(fetch(b, 0, got_index, "topk_index"));
  UPF_TRY(fetch(b, 1, got_weight, "topk_weight"));
  UPF_TRY(fetch(b, 2, got_logits, "logits"));
  upf_tolerance tol = upf_tolerance_for(dtype);
  check->passed = 1;
  if (!exact(got_index, g_index, sizeof g_index, "topk_index", check))
    return UPF_OK;
  upf_compare_f32(got_logits, logits, 8, upf_tolerance_for(UPF_DTYPE_F32), check);
  if (!check->passed) {
    snprintf(check->detail, sizeof check->detail, "logits differ from the hand-computed value");
    return UPF_OK;
  }
  upf_compare_f32(got_weight, weight, 4, upf_tolerance_for(UPF_DTYPE_F32), check);
  if (!check->passed || !ffn)
    return UPF_OK;
  if (dtype == UPF_DTYPE_BF16) {
    uint16_t raw[4];
    UPF_TRY(fetch(b, 3, raw, "out"));
    upf_bf16_to_f32_array(got_out, raw, 4);
  } else {
    UPF_TRY(fetch(b, 3, got_out, "out"));
  }
  upf_compare_f32(got_out, out, 4, tol, check);
  return UPF_OK;
}

void upf_moe_golden_run(const upf_backend *be, upf_moe_golden golden, upf_dtype dtype, upf_check *check) {
  memset(check, 0, sizeof *check);
  const char *op = golden == UPF_MOE_GOLDEN_ROUTE ? "moe.route" : golden == UPF_MOE_GOLDEN_FFN ? "moe.ffn" : "moe.permute";
  snprintf(check->op, sizeof check->op, "%s", op);
  snprintf(check->variant, sizeof check->variant, "%s", upf_moe_golden_name(golden));
  snprintf(check->dtype, sizeof check->dtype, "%s", upf_dtype_name(dtype));
  snprintf(check->shape, sizeof check->shape, "T=%d H=2 E=4 K=2", golden == UPF_MOE_GOLDEN_PERMUTE_SKEW ? 3 : 2);
  golden_bufs b;
  memset(&b, 0, sizeof b);
  b.be = be;
  upf_status st = UPF_OK;
  switch (golden) {
  case UPF_MOE_GOLDEN_ROUTE:
    st = golden_route_or_ffn(&b, dtype, 0, check);
    break;
  case UPF_MOE_GOLDEN_FFN:
    st = golden_route_or_ffn(&b, dtype, 1, check);
    break;
  case UPF_MOE_GOLDEN_PERMUTE:
    st = golden_permute(&b, g_index, 2, g_count, g_offset, g_sorted, g_pair_row, check);
    break;
  case UPF_MOE_GOLDEN_PERMUTE_SKEW:
    st = golden_permute(&b, s_index, 3, s_count, s_offset, s_sorted, s_pair_row, check);
    break;
  default:
    st = upf_fail(UPF_ERR_INVALID_ARG, "unknown golden case %d", (int)golden);
  }
  if (st != UPF_OK) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  }
  golden_free(&b);
}
