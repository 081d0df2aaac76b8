/* Selection invariants, the marginal-decision rule and the hand-computed golden cases. */
#include "verify/select_checks.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/select.h"

double upf_select_tau(upf_dtype input_dtype) { return input_dtype == UPF_DTYPE_BF16 ? 1e-3 : 1e-5; }

static void fail(upf_check *check, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(check->detail, sizeof check->detail, fmt, ap);
  va_end(ap);
  check->passed = 0;
}

static void check_begin(upf_check *check) {
  check->passed = 1;
  check->detail[0] = '\0';
  check->nmse = check->max_abs_err = check->budget = 0.0;
}

/* Normalised scores pi (nb) of one request's block scores; returns the total. */
static double normalise(const float *b, int64_t nb, double *pi) {
  double total = 0.0;
  for (int64_t c = 0; c < nb; c++)
    total += b[c];
  for (int64_t c = 0; c < nb; c++)
    pi[c] = total > 0.0 ? b[c] / total : 0.0;
  return total;
}

static void check_request_blocks(const upf_select_params *params, int32_t r, const float *b, const uint8_t *bm,
                                 int64_t nb, double tau, double *pi, upf_check *check) {
  normalise(b, nb, pi);
  double kept_mass = 0.0, min_kept = INFINITY, max_dropped = -INFINITY;
  int64_t kept = 0;
  for (int64_t c = 0; c < nb; c++) {
    if (bm[c] > 1)
      return fail(check, "request %d: block_mask[%lld]=%d is not 0/1", r, (long long)c, bm[c]);
    if (bm[c]) {
      kept++;
      kept_mass += pi[c];
      min_kept = fmin(min_kept, pi[c]);
    } else {
      max_dropped = fmax(max_dropped, pi[c]);
    }
  }
  if (kept == 0)
    return fail(check, "request %d: no block kept (the top block is always kept)", r);
  if (kept < nb && min_kept < max_dropped - tau * max_dropped)
    return fail(check, "request %d: kept blocks are not the top of the ranking (kept pi %.9g < dropped pi %.9g)", r,
                min_kept, max_dropped);
  if (params->topk > 0) {
    int64_t want = params->topk < nb ? params->topk : nb;
    if (kept != want)
      return fail(check, "request %d: top-k kept %lld blocks, expected %lld", r, (long long)kept, (long long)want);
    return;
  }
  if (kept < nb && kept_mass < params->p - tau)
    return fail(check, "request %d: kept mass %.9g < p=%g", r, kept_mass, (double)params->p);
  if (kept > 1 && kept_mass - min_kept > params->p + tau)
    return fail(check, "request %d: not minimal: without its lowest block the kept mass %.9g still exceeds p=%g", r,
                kept_mass - min_kept, (double)params->p);
}

void upf_select_check_invariants(const upf_select_inputs *in, const upf_select_params *params,
                                 const upf_select_outputs *out, const float *block_score, double tau,
                                 upf_check *check) {
  check_begin(check);
  const int32_t *cu = in->cu_seqlens_host;
  int64_t block_base = 0, kept_total = 0;
  double *pi = NULL;
  for (int32_t r = 0; r < in->num_reqs && check->passed; r++) {
    int64_t tok0 = cu[r], n = cu[r + 1] - cu[r], nb = upf_select_blocks_of(n, params->block);
    const uint8_t *mask = out->token_mask + tok0;
    const uint8_t *bm = out->block_mask + block_base;
    int scored = upf_select_is_scored(n, params);
    int64_t kept = 0;
    for (int64_t j = 0; j < n && check->passed; j++) {
      if (mask[j] > 1) {
        fail(check, "request %d: token_mask[%lld]=%d is not 0/1", r, (long long)(tok0 + j), mask[j]);
      } else if (!scored && !mask[j]) {
        fail(check, "request %d (n=%lld, not scored) dropped token %lld", r, (long long)n, (long long)j);
      } else if (scored && (j < params->sink || j >= n - params->last_q) && !mask[j]) {
        fail(check, "request %d: %s token %lld dropped", r, j < params->sink ? "sink" : "last-L", (long long)j);
      } else if (scored && mask[j] != (bm[j / params->block] || j < params->sink || j >= n - params->last_q)) {
        fail(check, "request %d: token %lld mask %d disagrees with its block %lld decision %d", r, (long long)j,
             mask[j], (long long)(j / params->block), bm[j / params->block]);
      } else if (mask[j]) {
        if (kept_total + kept >= out->kept_total || out->kept_index[kept_total + kept] != tok0 + j)
          fail(check, "kept_index[%lld] should be token %lld", (long long)(kept_total + kept), (long long)(tok0 + j));
        kept++;
      }
    }
    if (check->passed && out->kept_count[r] != kept)
      fail(check, "kept_count[%d]=%d but the mask keeps %lld", r, out->kept_count[r], (long long)kept);
    kept_total += kept;
    if (check->passed && out->new_cu_seqlens[r + 1] != kept_total)
      fail(check, "new_cu_seqlens[%d]=%d, expected %lld", r + 1, out->new_cu_seqlens[r + 1], (long long)kept_total);
    if (check->passed && scored) {
      pi = realloc(pi, (size_t)nb * sizeof *pi);
      check_request_blocks(params, r, block_score + block_base, bm, nb, tau, pi, check);
    }
    block_base += nb;
  }
  if (check->passed && out->new_cu_seqlens[0] != 0)
    fail(check, "new_cu_seqlens[0]=%d, expected 0", out->new_cu_seqlens[0]);
  if (check->passed && out->kept_total != kept_total)
    fail(check, "kept_total=%lld but the mask keeps %lld", (long long)out->kept_total, (long long)kept_total);
  free(pi);
}

void upf_select_compare_decisions(const upf_select_inputs *in, const upf_select_params *params,
                                  const double *ref_score, const uint8_t *ref, const uint8_t *got, double tau,
                                  upf_check *check) {
  check_begin(check);
  const int32_t *cu = in->cu_seqlens_host;
  int64_t block_base = 0, marginal = 0, differ = 0;
  double *prefix = NULL, *pi = NULL;
  uint8_t *scratch = NULL;
  for (int32_t r = 0; r < in->num_reqs && check->passed; r++) {
    int64_t n = cu[r + 1] - cu[r], nb = upf_select_blocks_of(n, params->block);
    const uint8_t *rb = ref + block_base, *gb = got + block_base;
    if (!upf_select_is_scored(n, params)) {
      for (int64_t c = 0; c < nb; c++)
        if (gb[c] != 1)
          fail(check, "request %d is not scored but block %lld is dropped", r, (long long)c);
      block_base += nb;
      continue;
    }
    prefix = realloc(prefix, (size_t)nb * sizeof *prefix);
    pi = realloc(pi, (size_t)nb * sizeof *pi);
    scratch = realloc(scratch, (size_t)nb);
    ref_select_topp(ref_score + block_base, nb, params, scratch, prefix, pi);
    double min_kept = INFINITY, max_dropped = -INFINITY;
    for (int64_t c = 0; c < nb; c++) {
      if (rb[c])
        min_kept = fmin(min_kept, pi[c]);
      else
        max_dropped = fmax(max_dropped, pi[c]);
    }
    for (int64_t c = 0; c < nb && check->passed; c++) {
      if (rb[c] == gb[c])
        continue;
      differ++;
      int near_p = params->topk == 0 && fabs(prefix[c] - params->p) <= tau;
      double other = rb[c] ? max_dropped : min_kept; /* closest pi decided the other way */
      int near_other = isfinite(other) && fabs(pi[c] - other) <= tau * fmax(pi[c], other);
      if (near_p || near_other)
        marginal++;
      else
        fail(check, "request %d block %lld: got %d, reference %d (pi=%.9g, prefix=%.9g, p=%g) is not marginal", r,
             (long long)c, gb[c], rb[c], pi[c], prefix[c], (double)params->p);
    }
    block_base += nb;
  }
  check->max_abs_err = (double)differ;
  if (check->passed && marginal)
    snprintf(check->detail, sizeof check->detail, "%lld marginal block decision(s) differ", (long long)marginal);
  free(prefix), free(pi), free(scratch);
}

void upf_select_compare_token_masks(const upf_select_inputs *in, const upf_select_params *params,
                                    const uint8_t *ref_block, const uint8_t *got_block, const uint8_t *ref_mask,
                                    const uint8_t *got_mask, upf_check *check) {
  check_begin(check);
  const int32_t *cu = in->cu_seqlens_host;
  int64_t block_base = 0, excused = 0;
  for (int32_t r = 0; r < in->num_reqs && check->passed; r++) {
    int64_t tok0 = cu[r], n = cu[r + 1] - cu[r];
    for (int64_t j = 0; j < n; j++) {
      int64_t c = block_base + j / params->block;
      if (ref_mask[tok0 + j] == got_mask[tok0 + j])
        continue;
      if (ref_block[c] != got_block[c] && j >= params->sink && j < n - params->last_q) {
        excused++;
        continue;
      }
      fail(check, "token %lld (request %d): got %d, reference %d", (long long)(tok0 + j), r, got_mask[tok0 + j],
           ref_mask[tok0 + j]);
      break;
    }
    block_base += upf_select_blocks_of(n, params->block);
  }
  if (check->passed && excused)
    snprintf(check->detail, sizeof check->detail, "%lld tokens of marginal blocks differ", (long long)excused);
}

/* ---- Golden cases ---- */

const char *upf_golden_name(upf_golden golden) {
  static const char *const names[UPF_GOLDEN_COUNT] = {
      "part_gemm 1x3 hand", "block_softmax 2 heads hand", "block_reduce ragged hand", "topp p=0.5 hand",
      "topp ties to larger index", "topp prefix == p keeps", "topk K=2 hand", "expand ragged hand",
      "pipeline D=1 hand", "compact rows hand"};
  return (unsigned)golden < UPF_GOLDEN_COUNT ? names[golden] : "invalid";
}

/* Backend copies of golden inputs; everything is freed by golden_free. */
typedef struct {
  const upf_backend *be;
  void *ptrs[16];
  int count;
  upf_status status;
} golden_mem;

static void *golden_put(golden_mem *m, const void *host, size_t bytes) {
  void *p = NULL;
  if (m->status != UPF_OK)
    return NULL;
  m->status = m->be->alloc(&p, bytes ? bytes : 1);
  if (m->status == UPF_OK) {
    m->ptrs[m->count++] = p;
    if (host)
      m->status = m->be->upload(p, host, bytes);
    else
      m->status = m->be->fill(p, 0xFF, bytes);
  }
  return p;
}

static void golden_get(golden_mem *m, void *host, const void *dev, size_t bytes) {
  if (m->status == UPF_OK)
    m->status = m->be->download(host, dev, bytes);
}

static void golden_free(golden_mem *m) {
  for (int i = 0; i < m->count; i++)
    m->be->release(m->ptrs[i]);
}

static upf_select_inputs golden_inputs(golden_mem *m, const float *q, const float *k, int64_t T, int64_t hq,
                                       int64_t hkv, int64_t D, const int32_t *cu, int32_t B) {
  upf_select_inputs in = {.cu_seqlens_host = cu, .num_reqs = B};
  int64_t qs[3] = {T, hq, D}, ks[3] = {T, hkv, D};
  upf_tensor_init(&in.q, q ? golden_put(m, q, (size_t)(T * hq * D) * 4) : NULL, UPF_DTYPE_F32, 3, qs);
  upf_tensor_init(&in.k, k ? golden_put(m, k, (size_t)(T * hkv * D) * 4) : NULL, UPF_DTYPE_F32, 3, ks);
  in.cu_seqlens = golden_put(m, cu, (size_t)(B + 1) * sizeof *cu);
  return in;
}

static void expect_floats(upf_check *check, const float *got, const double *want, int64_t n) {
  upf_compare_f32(got, want, n, upf_tolerance_for(UPF_DTYPE_F32), check);
}

static void expect_bytes(upf_check *check, const void *got, const void *want, int64_t n, size_t size,
                         const char *what) {
  upf_compare_exact(got, want, n, size, check);
  if (!check->passed) {
    char detail[sizeof check->detail];
    memcpy(detail, check->detail, sizeof detail);
    snprintf(check->detail, sizeof check->detail, "%s: %.200s", what, detail);
  }
}

static void golden_stage(golden_mem *m, upf_golden golden, upf_check *check) {
  const upf_backend *be = m->be;
  upf_status st = UPF_OK;
  switch (golden) {
  case UPF_GOLDEN_PART_GEMM: {
    /* n=3, L=2, D=2, scale 0.5: queries are tokens 1 and 2. */
    const float q[] = {9, 9, 1, 0, 0, 1}, k[] = {1, 1, 2, 0, 0, 3};
    const int32_t cu[] = {0, 3};
    upf_select_params p = {.block = 2, .sink = 0, .last_q = 2, .p = 0.9f, .scale = 0.5f};
    upf_select_inputs in = golden_inputs(m, q, k, 3, 1, 1, 2, cu, 1);
    float *s = golden_put(m, NULL, 6 * sizeof(float));
    float got[6];
    if (m->status == UPF_OK && (st = be->select_part_gemm(&in, &p, s)) == UPF_OK)
      golden_get(m, got, s, sizeof got);
    const double want[] = {0.5, 1.0, -INFINITY, 0.5, 0.0, 1.5};
    if (m->status == UPF_OK && st == UPF_OK)
      expect_floats(check, got, want, 6);
    break;
  }
  case UPF_GOLDEN_BLOCK_SOFTMAX: {
    /* Hq=2, L=2, n=3. Head 0 rows: [0, ln2, -inf] -> [1/3, 2/3, 0]; [ln3, 0, 0] -> [3/5, 1/5, 1/5].
     * Head 1 rows: [0, 0, -inf] -> [1/2, 1/2, 0]; [0, 0, 0] -> [1/3, 1/3, 1/3]. */
    const float s_host[] = {0, (float)M_LN2, -INFINITY, (float)log(3.0), 0, 0, 0, 0, -INFINITY, 0, 0, 0};
    const int32_t cu[] = {0, 3};
    upf_select_params p = {.block = 2, .sink = 0, .last_q = 2, .p = 0.9f};
    upf_select_inputs in = golden_inputs(m, NULL, NULL, 3, 2, 1, 4, cu, 1);
    float *s = golden_put(m, s_host, sizeof s_host), *t = golden_put(m, NULL, 3 * sizeof(float));
    float got[3];
    if (m->status == UPF_OK && (st = be->select_block_softmax(&in, &p, s, t)) == UPF_OK)
      golden_get(m, got, t, sizeof got);
    const double want[] = {1.0 / 3 + 3.0 / 5 + 0.5 + 1.0 / 3, 2.0 / 3 + 1.0 / 5 + 0.5 + 1.0 / 3, 1.0 / 5 + 1.0 / 3};
    if (m->status == UPF_OK && st == UPF_OK)
      expect_floats(check, got, want, 3);
    break;
  }
  case UPF_GOLDEN_BLOCK_REDUCE: {
    /* Request 0: n=5, G=2 -> blocks [1+2, 3+4, 5]; request 1 is a decode row -> 0. */
    const float t_host[] = {1, 2, 3, 4, 5, 7};
    const int32_t cu[] = {0, 5, 6};
    upf_select_params p = {.block = 2, .sink = 0, .last_q = 1, .p = 0.9f};
    upf_select_inputs in = golden_inputs(m, NULL, NULL, 6, 1, 1, 1, cu, 2);
    float *t = golden_put(m, t_host, sizeof t_host), *b = golden_put(m, NULL, 4 * sizeof(float));
    float got[4];
    if (m->status == UPF_OK && (st = be->select_block_reduce(&in, &p, t, b)) == UPF_OK)
      golden_get(m, got, b, sizeof got);
    const double want[] = {3, 7, 5, 0};
    if (m->status == UPF_OK && st == UPF_OK)
      expect_floats(check, got, want, 4);
    break;
  }
  case UPF_GOLDEN_TOPP:
  case UPF_GOLDEN_TOPP_TIES:
  case UPF_GOLDEN_TOPP_BOUNDARY:
  case UPF_GOLDEN_TOPK: {
    /* G=1 so blocks are tokens. p=0.5 on pi [.1 .4 .2 .3]: ranks 1,3,2,0 with exclusive prefixes
     * 0, .4, .7, .9 -> keep 1 and 3. Ties [2 2 2 2], p=0.3: ranks 3,2,1,0, prefixes 0, .25 -> keep
     * 3 and 2. Boundary [1 1 2], p=0.5: ranks 2,1,0 with prefixes 0, .5 (== p: kept), .75. Top-k
     * K=2 on [1 4 2 3] and [2 2 2 2]: {1,3} and {3,2}. */
    static const float b_plain[] = {1, 4, 2, 3}, b_ties[] = {2, 2, 2, 2}, b_boundary[] = {1, 1, 2};
    static const float b_topk[] = {1, 4, 2, 3, 2, 2, 2, 2};
    static const uint8_t w_plain[] = {0, 1, 0, 1}, w_ties[] = {0, 0, 1, 1}, w_boundary[] = {0, 1, 1};
    static const uint8_t w_topk[] = {0, 1, 0, 1, 0, 0, 1, 1};
    const float *bh = b_plain;
    const uint8_t *want = w_plain;
    int32_t nb = 4, B = 1;
    int32_t cu[3] = {0, 4, 8};
    upf_select_params p = {.block = 1, .sink = 0, .last_q = 1, .p = 0.5f};
    if (golden == UPF_GOLDEN_TOPP_TIES)
      bh = b_ties, want = w_ties, p.p = 0.3f;
    if (golden == UPF_GOLDEN_TOPP_BOUNDARY)
      bh = b_boundary, want = w_boundary, nb = 3, cu[1] = 3;
    if (golden == UPF_GOLDEN_TOPK)
      bh = b_topk, want = w_topk, nb = 8, B = 2, p.topk = 2;
    upf_select_inputs in = golden_inputs(m, NULL, NULL, nb, 1, 1, 1, cu, B);
    float *b = golden_put(m, bh, (size_t)nb * sizeof(float));
    uint8_t *bm = golden_put(m, NULL, (size_t)nb), got[8];
    if (m->status == UPF_OK && (st = be->select_topp(&in, &p, b, bm)) == UPF_OK)
      golden_get(m, got, bm, (size_t)nb);
    if (m->status == UPF_OK && st == UPF_OK)
      expect_bytes(check, got, want, nb, 1, "block_mask");
    break;
  }
  case UPF_GOLDEN_EXPAND: {
    /* n=10, G=4, sink=1, L=2, blocks [0 1 0] -> tokens 0, 4..7, 8, 9; then a decode row and a short
     * row (n=3 <= sink+L) whose (deliberately 0) block decisions must be ignored. */
    const uint8_t bm_host[] = {0, 1, 0, 0, 0};
    const int32_t cu[] = {0, 10, 11, 14};
    upf_select_params p = {.block = 4, .sink = 1, .last_q = 2, .p = 0.9f};
    upf_select_inputs in = golden_inputs(m, NULL, NULL, 14, 1, 1, 1, cu, 3);
    uint8_t *bm = golden_put(m, bm_host, sizeof bm_host);
    upf_select_outputs out = {.token_mask = golden_put(m, NULL, 14),
                              .kept_index = golden_put(m, NULL, 14 * sizeof(int32_t)),
                              .new_cu_seqlens = golden_put(m, NULL, 4 * sizeof(int32_t)),
                              .kept_count = golden_put(m, NULL, 3 * sizeof(int32_t))};
    uint8_t mask[14];
    int32_t idx[11], ncu[4], cnt[3];
    if (m->status == UPF_OK && (st = be->select_expand(&in, &p, bm, &out)) == UPF_OK) {
      golden_get(m, mask, out.token_mask, sizeof mask);
      golden_get(m, idx, out.kept_index, sizeof idx);
      golden_get(m, ncu, out.new_cu_seqlens, sizeof ncu);
      golden_get(m, cnt, out.kept_count, sizeof cnt);
    }
    const uint8_t w_mask[] = {1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const int32_t w_idx[] = {0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, w_cu[] = {0, 7, 8, 11}, w_cnt[] = {7, 1, 3};
    if (m->status != UPF_OK || st != UPF_OK)
      break;
    if (out.kept_total != 11) {
      fail(check, "kept_total=%lld, expected 11", (long long)out.kept_total);
      break;
    }
    expect_bytes(check, mask, w_mask, 14, 1, "token_mask");
    if (check->passed)
      expect_bytes(check, idx, w_idx, 11, 4, "kept_index");
    if (check->passed)
      expect_bytes(check, ncu, w_cu, 4, 4, "new_cu_seqlens");
    if (check->passed)
      expect_bytes(check, cnt, w_cnt, 3, 4, "kept_count");
    break;
  }
  case UPF_GOLDEN_PIPELINE: {
    /* D=1, scale 1, q_last=1, k=[0, 0, ln 8]: P=[.1 .1 .8]. p=0.85, G=1, sink=0, L=1: ranks 2, 1
     * (tie with 0 goes to the larger index), 0; prefixes 0, .8, .9 -> keep 2 and 1. Then a decode row. */
    const float q[] = {5, 5, 1, 3}, k[] = {0, 0, (float)log(8.0), 7};
    const int32_t cu[] = {0, 3, 4};
    upf_select_params p = {.block = 1, .sink = 0, .last_q = 1, .p = 0.85f, .scale = 1.0f};
    upf_select_inputs in = golden_inputs(m, q, k, 4, 1, 1, 1, cu, 2);
    upf_select_outputs out = {.block_score = golden_put(m, NULL, 4 * sizeof(float)),
                              .block_mask = golden_put(m, NULL, 4),
                              .token_mask = golden_put(m, NULL, 4),
                              .kept_index = golden_put(m, NULL, 4 * sizeof(int32_t)),
                              .new_cu_seqlens = golden_put(m, NULL, 3 * sizeof(int32_t)),
                              .kept_count = golden_put(m, NULL, 2 * sizeof(int32_t))};
    float b[4];
    uint8_t mask[4];
    int32_t idx[3], ncu[3];
    if (m->status == UPF_OK && (st = be->select_run(&in, &p, &out)) == UPF_OK) {
      golden_get(m, b, out.block_score, sizeof b);
      golden_get(m, mask, out.token_mask, sizeof mask);
      golden_get(m, idx, out.kept_index, sizeof idx);
      golden_get(m, ncu, out.new_cu_seqlens, sizeof ncu);
    }
    if (m->status != UPF_OK || st != UPF_OK)
      break;
    const double w_b[] = {0.1, 0.1, 0.8, 0.0};
    const uint8_t w_mask[] = {0, 1, 1, 1};
    const int32_t w_idx[] = {1, 2, 3}, w_cu[] = {0, 2, 3};
    expect_floats(check, b, w_b, 4);
    if (check->passed && out.kept_total != 3)
      fail(check, "kept_total=%lld, expected 3", (long long)out.kept_total);
    if (check->passed)
      expect_bytes(check, mask, w_mask, 4, 1, "token_mask");
    if (check->passed)
      expect_bytes(check, idx, w_idx, 3, 4, "kept_index");
    if (check->passed)
      expect_bytes(check, ncu, w_cu, 3, 4, "new_cu_seqlens");
    break;
  }
  case UPF_GOLDEN_COMPACT: {
    const float rows[] = {0, 0.5f, 1, 10, 10.5f, 11, 20, 20.5f, 21, 30, 30.5f, 31, 40, 40.5f, 41};
    const int32_t idx_host[] = {0, 2, 4};
    const float want_f[] = {0, 0.5f, 1, 20, 20.5f, 21, 40, 40.5f, 41};
    const float *src = golden_put(m, rows, sizeof rows);
    const int32_t *idx = golden_put(m, idx_host, sizeof idx_host);
    float *dst = golden_put(m, NULL, sizeof want_f), got[9];
    if (m->status == UPF_OK && (st = be->compact_rows(src, 5, 3 * sizeof(float), idx, 3, dst)) == UPF_OK)
      golden_get(m, got, dst, sizeof got);
    if (m->status == UPF_OK && st == UPF_OK)
      expect_bytes(check, got, want_f, 9, sizeof(float), "rows");
    break;
  }
  default:
    fail(check, "unknown golden case %d", (int)golden);
  }
  if (st != UPF_OK)
    fail(check, "%s: %s", upf_status_name(st), upf_last_error());
  else if (m->status != UPF_OK)
    fail(check, "%s: %s", upf_status_name(m->status), upf_last_error());
}

void upf_select_golden_run(const upf_backend *backend, upf_golden golden, upf_check *check) {
  golden_mem m = {.be = backend, .status = UPF_OK};
  check_begin(check);
  snprintf(check->variant, sizeof check->variant, "golden: %s", upf_golden_name(golden));
  snprintf(check->dtype, sizeof check->dtype, "f32");
  snprintf(check->shape, sizeof check->shape, "hand");
  golden_stage(&m, golden, check);
  golden_free(&m);
}
