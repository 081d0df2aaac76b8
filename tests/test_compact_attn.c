/* CompactAttention on the CPU reference (uniprefill/compact_attn.h): a hand-computed union table (recent
 * and chunk blocks forced, a chunk starting inside a block, the PackGQA tiles of a KV head merged),
 * union == an independent OR of the selector's CSR rows on real sparse.index outputs, block tables ==
 * the pages of the table's blocks, and zero-copy (attn.paged on head views) == copy (gather + attn.prefill)
 * == masked dense attention over the same table, f32 and bf16, ragged requests with a chunk at the start;
 * alpha 0 (every block kept) == dense attn.paged; upf_compact_attend (the whole chain) == the ops called
 * one by one. Bad inputs return their status naming the input. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"

#define CA_MAXR 4

/* ---- the hand-computed union ---- */

/* hq 4, hkv 1 (g 4), block_m 16 (4 positions a tile), block_n 64, recent 2 (default).
 * Request 0: q_len 8, kv_len 200: prefix 192 = block 3 exactly; 2 tiles. Forced: blocks 1, 2 (recent), 3
 * (chunk). Tile 0 keeps {0}, tile 1 keeps {0, 3}: union {0, 1, 2, 3} (all), count 4.
 * Request 1: q_len 30, kv_len 420: prefix 390 is inside block 6 (384..447), the chunk ends in block 6;
 * forced: 4, 5 (recent), 6. Tiles (8) keep {0}, {2}, nothing, ...: union {0, 2, 4, 5, 6}, count 5.
 * Request 2: q_len 5 = kv_len (a chunk at the start): forced block 0 only; its tiles keep {0}. */
static void test_union_by_hand(void) {
  const upf_backend *be = upf_backend_cpu();
  int32_t cu_q[4] = {0, 8, 38, 43}, cu_kv[4] = {0, 200, 620, 625};
  upf_attn_varlen vb = {3, cu_q, cu_q, cu_kv, cu_kv};
  upf_sparse_batch sb = {&vb, NULL};
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 16;
  upf_sparse_plan plan;
  CU_ASSERT_EQUAL_FATAL(upf_sparse_plan_make(&sb, 4, 1, &p, &plan), UPF_OK);
  CU_ASSERT_EQUAL(plan.total_q_tiles, 2 + 8 + 2);
  CU_ASSERT_EQUAL(plan.max_key_blocks, 7);
  upf_sparse_plan_free(&plan);
  /* segments: r0 t0-1, r1 t0-7, r2 t0-1 */
  int32_t row_ptr[13] = {0, 1, 3, 4, 5, 5, 5, 5, 5, 5, 5, 6, 7};
  int32_t blocks[7] = {0, 0, 3, 0, 2, 0, 0};
  upf_sparse_index idx = {row_ptr, blocks, NULL, 7};
  uint8_t table[21];
  int32_t counts[3];
  const int64_t shape[3] = {3, 1, 7};
  upf_tensor t = upf_test_view(table, UPF_DTYPE_U8, 3, shape);
  const upf_compact_params cp = upf_compact_params_default();
  CU_ASSERT_EQUAL(cp.recent, 2);
  CU_ASSERT_EQUAL_FATAL(be->compact_block_union(&sb, 4, &p, &idx, &cp, &t, counts), UPF_OK);
  const uint8_t want[21] = {1, 1, 1, 1, 0, 0, 0, /**/ 1, 0, 1, 0, 1, 1, 1, /**/ 1, 0, 0, 0, 0, 0, 0};
  CU_ASSERT_EQUAL(memcmp(table, want, sizeof want), 0);
  CU_ASSERT_EQUAL(counts[0], 4);
  CU_ASSERT_EQUAL(counts[1], 5);
  CU_ASSERT_EQUAL(counts[2], 1);
  /* recent 0: request 0 drops the recent blocks 1, 2; request 1 keeps only {0, 2, 6} */
  const upf_compact_params cp0 = {0};
  CU_ASSERT_EQUAL_FATAL(be->compact_block_union(&sb, 4, &p, &idx, &cp0, &t, counts), UPF_OK);
  const uint8_t want0[21] = {1, 0, 0, 1, 0, 0, 0, /**/ 1, 0, 1, 0, 0, 0, 1, /**/ 1, 0, 0, 0, 0, 0, 0};
  CU_ASSERT_EQUAL(memcmp(table, want0, sizeof want0), 0);
  CU_ASSERT_EQUAL(counts[0], 2);
  CU_ASSERT_EQUAL(counts[1], 3);
}

/* ---- a chunk batch over a paged cache ---- */

typedef struct {
  int B;
  int64_t hq, hkv, d, P, Tq, npages;
  int32_t cu_q[CA_MAXR + 1], kv_lens[CA_MAXR], max_blocks;
  upf_dtype dt;
  void *q, *kc, *vc;
  int32_t *bt;
  upf_attn_paged pb;
  upf_sparse_batch sb;
  upf_tensor tq, tkc, tvc;
} ca_case;

static void ca_init(ca_case *c, int B, const int32_t *q_lens, const int32_t *kv_lens, int64_t hq, int64_t hkv,
                    int64_t d, int64_t P, upf_dtype dt, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->B = B, c->hq = hq, c->hkv = hkv, c->d = d, c->P = P, c->dt = dt;
  int32_t maxp = 0;
  for (int r = 0; r < B; r++) {
    c->cu_q[r + 1] = c->cu_q[r] + q_lens[r];
    c->kv_lens[r] = kv_lens[r];
    const int32_t pages = (kv_lens[r] + (int32_t)P - 1) / (int32_t)P;
    c->npages += pages;
    maxp = pages > maxp ? pages : maxp;
  }
  c->npages += 2; /* spare pages (NaN) that no table reaches */
  c->Tq = c->cu_q[B];
  c->max_blocks = maxp + 1;
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  const int64_t nq = c->Tq * hq * d, nc = c->npages * P * hkv * d;
  c->q = malloc((size_t)nq * upf_dtype_size(dt));
  c->kc = malloc((size_t)nc * upf_dtype_size(dt)), c->vc = malloc((size_t)nc * upf_dtype_size(dt));
  c->bt = malloc((size_t)B * c->max_blocks * sizeof *c->bt);
  /* q leans along dim 0, so the hot blocks below score far (about 2^6) above the cold ones */
  for (int64_t i = 0; i < nq; i++)
    upf_test_store(c->q, dt, i, 2.0f * (upf_rng_uniform(&rng) - 0.5f) + (i % d == 0 ? 4.0f : 0.0f));
  for (int64_t i = 0; i < nc; i++) {
    upf_test_store(c->kc, dt, i, NAN);
    upf_test_store(c->vc, dt, i, NAN);
  }
  /* pages handed out back to front, so the logical order differs from the physical */
  int32_t next = (int32_t)c->npages - 1;
  for (int r = 0; r < B; r++)
    for (int32_t j = 0; j < c->max_blocks; j++)
      c->bt[r * c->max_blocks + j] = j < (kv_lens[r] + P - 1) / P ? next-- : -1;
  /* keys with a per-block offset along a direction, so blocks differ in score and alpha drops some */
  for (int r = 0; r < B; r++)
    for (int32_t j = 0; j < kv_lens[r]; j++) {
      const int64_t page = c->bt[r * c->max_blocks + j / P];
      const float hot = ((j / 64) * 7 + r) % 3 == 0 ? 1.5f : -0.5f;
      for (int64_t h = 0; h < hkv; h++)
        for (int64_t e = 0; e < d; e++) {
          const int64_t at = ((page * P + j % P) * hkv + h) * d + e;
          upf_test_store(c->kc, dt, at, 2.0f * (upf_rng_uniform(&rng) - 0.5f) + (e == 0 ? hot * 3.0f : 0.0f));
          upf_test_store(c->vc, dt, at, 2.0f * (upf_rng_uniform(&rng) - 0.5f) + hot);
        }
    }
  c->pb = (upf_attn_paged){B, c->cu_q, c->cu_q, c->kv_lens, c->kv_lens, c->bt, c->bt, c->max_blocks, (int32_t)P};
  c->sb = (upf_sparse_batch){NULL, &c->pb};
  const int64_t qs[3] = {c->Tq, hq, d}, cs[4] = {c->npages, P, hkv, d};
  c->tq = upf_test_view(c->q, dt, 3, qs);
  c->tkc = upf_test_view(c->kc, dt, 4, cs), c->tvc = upf_test_view(c->vc, dt, 4, cs);
}

static void ca_free(ca_case *c) { free(c->q), free(c->kc), free(c->vc), free(c->bt); }

/* The selector over the chunk (block means, then the index), the union and the block tables. */
typedef struct {
  upf_sparse_plan plan;
  int32_t *row_ptr, *blocks;
  uint8_t *table; /* (B, Hkv, nb) */
  int32_t *counts, nb;
  int32_t *tbt, *tkv; /* (Hkv, B, max_blocks), (Hkv, B) */
  upf_compact_tables tables;
} ca_sel;

static upf_status ca_select(const ca_case *c, const upf_sparse_params *p, const upf_compact_params *cp, ca_sel *s) {
  const upf_backend *be = upf_backend_cpu();
  memset(s, 0, sizeof *s);
  UPF_TRY(upf_sparse_plan_make(&c->sb, (int32_t)c->hq, (int32_t)c->hkv, p, &s->plan));
  const int64_t S = s->plan.num_segments, nb = s->plan.max_key_blocks;
  s->nb = (int32_t)nb;
  void *kbar = malloc((size_t)(c->B * nb * c->hkv * c->d) * upf_dtype_size(c->dt));
  s->row_ptr = malloc((size_t)(S + 1) * 4), s->blocks = malloc((size_t)(S * nb + 1) * 4);
  s->table = malloc((size_t)(c->B * c->hkv * nb)), s->counts = malloc((size_t)(c->B * c->hkv) * 4);
  s->tbt = malloc((size_t)(c->hkv * c->B * c->max_blocks) * 4), s->tkv = malloc((size_t)(c->hkv * c->B) * 4);
  const int64_t ks[4] = {c->B, nb, c->hkv, c->d}, ts[3] = {c->B, c->hkv, nb};
  upf_tensor tk = upf_test_view(kbar, c->dt, 4, ks), tt = upf_test_view(s->table, UPF_DTYPE_U8, 3, ts);
  upf_status st = be->sparse_block_means(&c->sb, &c->tkc, NULL, p, &tk, NULL);
  upf_sparse_index idx = {s->row_ptr, s->blocks, NULL, 0};
  if (st == UPF_OK)
    st = be->sparse_index(&c->sb, &c->tq, &tk, p, &idx);
  if (st == UPF_OK)
    st = be->compact_block_union(&c->sb, (int32_t)c->hq, p, &idx, cp, &tt, s->counts);
  s->tables = (upf_compact_tables){s->tbt, s->tkv, s->tbt, s->tkv, c->max_blocks};
  if (st == UPF_OK)
    st = be->compact_block_tables(&c->pb, &tt, p->block_n, &s->tables);
  free(kbar);
  return st;
}

static void ca_sel_free(ca_sel *s) {
  upf_sparse_plan_free(&s->plan);
  free(s->row_ptr), free(s->blocks), free(s->table), free(s->counts), free(s->tbt), free(s->tkv);
}

/* The union recomputed from the CSR (OR over the request's tiles of a head) and the forced range. */
static int union_matches(const ca_case *c, const ca_sel *s, const upf_sparse_params *p, int32_t recent) {
  int ok = 1;
  uint8_t *want = calloc((size_t)s->nb, 1);
  for (int r = 0; r < c->B; r++)
    for (int64_t h = 0; h < c->hkv; h++) {
      memset(want, 0, (size_t)s->nb);
      for (int32_t m = s->plan.cu_q_tiles[r]; m < s->plan.cu_q_tiles[r + 1]; m++) {
        const int64_t seg = h * s->plan.total_q_tiles + m;
        for (int32_t i = s->row_ptr[seg]; i < s->row_ptr[seg + 1]; i++)
          want[s->blocks[i]] = 1;
      }
      const int32_t q_len = c->cu_q[r + 1] - c->cu_q[r], first = (c->kv_lens[r] - q_len) / p->block_n;
      for (int32_t b = first - recent < 0 ? 0 : first - recent; b <= (c->kv_lens[r] - 1) / p->block_n; b++)
        want[b] = 1;
      int32_t n = 0;
      for (int32_t b = 0; b < s->nb; b++)
        n += want[b];
      ok &= memcmp(want, s->table + (r * c->hkv + h) * s->nb, (size_t)s->nb) == 0;
      ok &= n == s->counts[r * c->hkv + h];
    }
  free(want);
  return ok;
}

/* Block tables == the pages of the kept blocks in order; kept kv_len == keys of the kept blocks. */
static int tables_match(const ca_case *c, const ca_sel *s, int32_t block_n) {
  int ok = 1;
  const int64_t per = block_n / c->P;
  for (int64_t h = 0; h < c->hkv; h++)
    for (int r = 0; r < c->B; r++) {
      const int32_t *row = s->tbt + (h * c->B + r) * c->max_blocks;
      int64_t pages = 0, keys = 0;
      for (int32_t b = 0; b * block_n < c->kv_lens[r]; b++) {
        if (!s->table[(r * c->hkv + h) * s->nb + b])
          continue;
        const int64_t left = c->kv_lens[r] - (int64_t)b * block_n, n = left < block_n ? left : block_n;
        for (int64_t i = 0; i < (n + c->P - 1) / c->P; i++)
          ok &= row[pages++] == c->bt[r * c->max_blocks + b * per + i];
        keys += n;
      }
      ok &= keys == s->tkv[h * c->B + r];
      for (int64_t i = pages; i < c->max_blocks; i++)
        ok &= row[i] == -1;
    }
  return ok;
}

/* Masked dense attention over the table, in double from the stored (rounded) values: out (Tq, Hq, D). */
static void oracle(const ca_case *c, const ca_sel *s, int32_t block_n, double scale, double *out) {
  const int64_t g = c->hq / c->hkv, d = c->d;
  int64_t maxkv = 1;
  for (int r = 0; r < c->B; r++)
    maxkv = c->kv_lens[r] > maxkv ? c->kv_lens[r] : maxkv;
  double *w = malloc((size_t)maxkv * sizeof *w);
  for (int r = 0; r < c->B; r++) {
    const int32_t q_len = c->cu_q[r + 1] - c->cu_q[r], prefix = c->kv_lens[r] - q_len;
    for (int32_t t = 0; t < q_len; t++)
      for (int64_t hh = 0; hh < c->hq; hh++) {
        const int64_t h = hh / g, qo = ((c->cu_q[r] + t) * c->hq + hh) * d;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j <= prefix + t; j++) {
          w[j] = -INFINITY;
          if (!s->table[(r * c->hkv + h) * s->nb + j / block_n])
            continue;
          const int64_t ko = ((c->bt[r * c->max_blocks + j / c->P] * c->P + j % c->P) * c->hkv + h) * d;
          double dot = 0.0;
          for (int64_t e = 0; e < d; e++)
            dot += upf_test_value(c->q, c->dt, qo + e) * upf_test_value(c->kc, c->dt, ko + e);
          w[j] = scale * dot;
          mx = w[j] > mx ? w[j] : mx;
        }
        for (int64_t e = 0; e < d; e++)
          out[qo + e] = 0.0;
        for (int64_t j = 0; j <= prefix + t; j++) {
          if (w[j] == -INFINITY)
            continue;
          const double pj = exp(w[j] - mx);
          sum += pj;
          const int64_t vo = ((c->bt[r * c->max_blocks + j / c->P] * c->P + j % c->P) * c->hkv + h) * d;
          for (int64_t e = 0; e < d; e++)
            out[qo + e] += pj * upf_test_value(c->vc, c->dt, vo + e);
        }
        for (int64_t e = 0; e < d; e++)
          out[qo + e] /= sum;
      }
  }
  free(w);
}

/* max |a - b| / (atol + rtol |b|) over n elements of a (dt) against b (double) */
static double budget(const void *a, upf_dtype dt, const double *b, int64_t n, double rtol, double atol) {
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double x = upf_test_value(a, dt, i), e = fabs(x - b[i]) / (atol + rtol * fabs(b[i]));
    worst = e > worst || isnan(e) ? (isnan(e) ? INFINITY : e) : worst;
  }
  return worst;
}

/* One batch end to end: selector, union, tables, both paths, the oracle. Returns the kept share. */
static double run_paths(int B, const int32_t *q_lens, const int32_t *kv_lens, int64_t hq, int64_t hkv, int64_t P,
                        upf_dtype dt, float alpha, uint64_t seed) {
  const upf_backend *be = upf_backend_cpu();
  ca_case c;
  ca_init(&c, B, q_lens, kv_lens, hq, hkv, 32, P, dt, seed);
  upf_sparse_params p = upf_sparse_params_default();
  p.alpha = alpha, p.block_m = 32, p.last_n = 0, p.window = 1, p.sink = 1;
  const upf_compact_params cp = upf_compact_params_default();
  ca_sel s;
  upf_status st = ca_select(&c, &p, &cp, &s);
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  CU_ASSERT(union_matches(&c, &s, &p, cp.recent));
  CU_ASSERT(tables_match(&c, &s, p.block_n));
  const int64_t n = c.Tq * hq * c.d;
  void *o1 = malloc((size_t)n * upf_dtype_size(dt)), *o2 = malloc((size_t)n * upf_dtype_size(dt));
  double *truth = malloc((size_t)n * sizeof *truth);
  const int64_t os[3] = {c.Tq, hq, c.d};
  upf_tensor t1 = upf_test_view(o1, dt, 3, os), t2 = upf_test_view(o2, dt, 3, os);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  CU_ASSERT_EQUAL(upf_compact_attn_zero_copy(be, &c.pb, &s.tables, &c.tq, &c.tkc, &c.tvc, &ap, &t1), UPF_OK);
  CU_ASSERT_EQUAL(upf_compact_attn_copy(be, &c.pb, &s.tables, &c.tq, &c.tkc, &c.tvc, &ap, &t2), UPF_OK);
  oracle(&c, &s, p.block_n, 1.0 / sqrt((double)c.d), truth);
  /* the two paths read the same keys in the same order: equal to the last f32 ulp or so */
  double *d1 = malloc((size_t)n * sizeof *d1);
  for (int64_t i = 0; i < n; i++)
    d1[i] = upf_test_value(o1, dt, i);
  CU_ASSERT(budget(o2, dt, d1, n, dt == UPF_DTYPE_BF16 ? 8e-3 : 1e-6, 1e-7) <= 1.0);
  CU_ASSERT(budget(o1, dt, truth, n, dt == UPF_DTYPE_BF16 ? 8e-3 : 2e-6, 1e-6) <= 1.0);
  CU_ASSERT(budget(o2, dt, truth, n, dt == UPF_DTYPE_BF16 ? 8e-3 : 2e-6, 1e-6) <= 1.0);
  /* upf_compact_attend runs the same ops end to end: the same bits, the same table */
  void *o3 = malloc((size_t)n * upf_dtype_size(dt));
  uint8_t *tab = malloc((size_t)(B * hkv * s.nb));
  upf_tensor t3 = upf_test_view(o3, dt, 3, os);
  int64_t kept_sum = -1, want_sum = 0;
  for (int64_t i = 0; i < B * hkv; i++)
    want_sum += s.counts[i];
  CU_ASSERT_EQUAL(upf_compact_attend(be, &c.pb, &c.tq, &c.tkc, &c.tvc, &p, &cp, &ap, 0, &t3, tab, &kept_sum), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(o3, o1, (size_t)n * upf_dtype_size(dt)), 0);
  CU_ASSERT_EQUAL(memcmp(tab, s.table, (size_t)(B * hkv * s.nb)), 0);
  CU_ASSERT_EQUAL(kept_sum, want_sum);
  CU_ASSERT_EQUAL(upf_compact_attend(be, &c.pb, &c.tq, &c.tkc, &c.tvc, &p, &cp, &ap, 1, &t3, NULL, NULL), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(o3, o2, (size_t)n * upf_dtype_size(dt)), 0);
  /* a kept workspace: the same bits and table on every call, and no allocation after the first call of
   * each path (the copy path's gather buffers come with its first call) */
  upf_compact_workspace ws;
  memset(&ws, 0, sizeof ws);
  for (int path = 0; path < 2; path++)
    for (int rep = 0; rep < 2; rep++) {
      const int64_t before = ws.allocations;
      memset(o3, 0xff, (size_t)n * upf_dtype_size(dt));
      CU_ASSERT_EQUAL(upf_compact_attend_ws(be, &c.pb, &c.tq, &c.tkc, &c.tvc, &p, &cp, &ap, path, &t3, &ws), UPF_OK);
      CU_ASSERT_EQUAL(memcmp(o3, path ? o2 : o1, (size_t)n * upf_dtype_size(dt)), 0);
      CU_ASSERT_EQUAL(memcmp(ws.table_host.ptr, s.table, (size_t)(B * hkv * s.nb)), 0);
      CU_ASSERT_EQUAL(ws.kept_blocks, want_sum);
      CU_ASSERT(rep == 0 ? ws.allocations > before || path == 1 : ws.allocations == before);
    }
  CU_ASSERT(ws.num_reqs == B && ws.hkv == hkv && ws.key_blocks == s.nb);
  upf_compact_workspace_free(&ws);
  CU_ASSERT_PTR_NULL(ws.be);
  free(o3), free(tab);
  if (alpha == 0.0f) { /* every visible block kept: dense attn.paged over the whole batch */
    CU_ASSERT_EQUAL(be->attn_paged(&c.pb, &c.tq, &c.tkc, &c.tvc, &ap, &t2, NULL), UPF_OK);
    CU_ASSERT(budget(o2, dt, d1, n, dt == UPF_DTYPE_BF16 ? 8e-3 : 1e-6, 1e-7) <= 1.0);
  }
  int64_t kept = 0, visible = 0;
  for (int r = 0; r < B; r++)
    for (int64_t h = 0; h < hkv; h++) {
      kept += s.counts[r * hkv + h];
      visible += (kv_lens[r] + p.block_n - 1) / p.block_n;
    }
  free(o1), free(o2), free(truth), free(d1);
  ca_sel_free(&s);
  ca_free(&c);
  return (double)kept / (double)visible;
}

static void test_paths_f32(void) {
  /* ragged: a chunk with a long context, one at the start of its request, one inside a block */
  const int32_t q_lens[3] = {40, 70, 25}, kv_lens[3] = {600, 70, 345};
  const double share = run_paths(3, q_lens, kv_lens, 4, 2, 16, UPF_DTYPE_F32, 0.6f, 11);
  CU_ASSERT(share < 1.0); /* some blocks were dropped, so the mask matters */
  CU_ASSERT(share > 0.0);
  const int32_t q1[1] = {33}, kv1[1] = {33};
  run_paths(1, q1, kv1, 2, 2, 64, UPF_DTYPE_F32, 0.9f, 12); /* a lone first chunk, g 1 */
}

static void test_paths_bf16(void) {
  const int32_t q_lens[2] = {50, 17}, kv_lens[2] = {50, 530};
  const double share = run_paths(2, q_lens, kv_lens, 8, 2, 32, UPF_DTYPE_BF16, 0.6f, 21);
  CU_ASSERT(share < 1.0);
}

static void test_alpha0_dense(void) {
  const int32_t q_lens[2] = {20, 9}, kv_lens[2] = {300, 9};
  const double share = run_paths(2, q_lens, kv_lens, 4, 1, 16, UPF_DTYPE_F32, 0.0f, 31);
  CU_ASSERT_DOUBLE_EQUAL(share, 1.0, 1e-12);
}

/* Bad inputs of the execution paths and of the two ops: each returns its status and names the input. */
static void test_bad_inputs(void) {
  const upf_backend *be = upf_backend_cpu();
  const int32_t q_lens[1] = {8}, kv_lens[1] = {100};
  ca_case c;
  ca_init(&c, 1, q_lens, kv_lens, 2, 1, 32, 16, UPF_DTYPE_F32, 41);
  upf_sparse_params p = upf_sparse_params_default();
  upf_compact_params cp = upf_compact_params_default();
  ca_sel s;
  CU_ASSERT_EQUAL_FATAL(ca_select(&c, &p, &cp, &s), UPF_OK);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  float out[8 * 2 * 32];
  const int64_t os[3] = {8, 2, 32};
  upf_tensor to = upf_test_view(out, UPF_DTYPE_F32, 3, os);
  upf_compact_tables nohost = s.tables;
  nohost.kv_lens_host = NULL;
  CU_ASSERT_EQUAL(upf_compact_attn_zero_copy(be, &c.pb, &nohost, &c.tq, &c.tkc, &c.tvc, &ap, &to),
                  UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "host copies"));
  upf_tensor tk3 = c.tkc;
  tk3.shape[2] = 3; /* Hq 2 is not a multiple of 3 */
  CU_ASSERT_EQUAL(upf_compact_attn_copy(be, &c.pb, &s.tables, &c.tq, &tk3, &c.tvc, &ap, &to), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "k_cache"));
  /* union: recent < 0 names recent; tables: block_n not a multiple of the page size names block_n */
  cp.recent = -1;
  upf_sparse_index idx = {s.row_ptr, s.blocks, NULL, 0};
  const int64_t ts[3] = {1, 1, s.nb};
  upf_tensor tt = upf_test_view(s.table, UPF_DTYPE_U8, 3, ts);
  CU_ASSERT_EQUAL(be->compact_block_union(&c.sb, 2, &p, &idx, &cp, &tt, s.counts), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "recent=-1"));
  CU_ASSERT_EQUAL(be->compact_block_tables(&c.pb, &tt, 40, &s.tables), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "block_n=40"));
  const int64_t wide[3] = {1, 1, s.nb + 1};
  upf_tensor tw = upf_test_view(s.table, UPF_DTYPE_U8, 3, wide);
  cp.recent = 2;
  CU_ASSERT_EQUAL(be->compact_block_union(&c.sb, 2, &p, &idx, &cp, &tw, s.counts), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "table"));
  ca_sel_free(&s);
  ca_free(&c);
}

/* The verify entries' seeded cases, CPU against its twin (a backend under test to the harness). */
static void test_verify_twin(void) {
  upf_test_verify_op(UPF_OP_COMPACT_BLOCK_UNION, upf_test_cpu_twin(), 8);
  upf_test_verify_op(UPF_OP_COMPACT_BLOCK_TABLES, upf_test_cpu_twin(), 6);
}

/* ---- CUDA: both paths on the device over tables selected on the CPU ---- */

typedef struct {
  const upf_backend *be;
  void *ptr[12];
  int n;
} dev_bufs;

static void *dev_put(dev_bufs *m, const void *host, size_t bytes) {
  void *p = NULL;
  if (m->n >= 12 || m->be->alloc(&p, bytes ? bytes : 1) != UPF_OK)
    return NULL;
  m->ptr[m->n++] = p;
  if (host && m->be->upload(p, host, bytes) != UPF_OK)
    return NULL;
  return p;
}

static void dev_free(dev_bufs *m) {
  for (int i = 0; i < m->n; i++)
    m->be->release(m->ptr[i]);
}

static void cuda_paths(int64_t hq, int64_t hkv, int64_t d, int64_t P, upf_dtype dt, uint64_t seed) {
  const upf_backend *be = upf_backend_cuda();
  const int32_t q_lens[3] = {200, 64, 7}, kv_lens[3] = {2000, 64, 1100};
  ca_case c;
  ca_init(&c, 3, q_lens, kv_lens, hq, hkv, d, P, dt, seed);
  upf_sparse_params p = upf_sparse_params_default();
  p.alpha = 0.6f, p.last_n = 0, p.window = 1, p.sink = 1;
  const upf_compact_params cp = upf_compact_params_default();
  ca_sel s;
  CU_ASSERT_EQUAL_FATAL(ca_select(&c, &p, &cp, &s), UPF_OK);
  const int64_t n = c.Tq * hq * d, es = (int64_t)upf_dtype_size(dt), nc = c.npages * P * hkv * d;
  dev_bufs m = {be, {0}, 0};
  void *q = dev_put(&m, c.q, (size_t)(n * es)), *kc = dev_put(&m, c.kc, (size_t)(nc * es));
  void *vc = dev_put(&m, c.vc, (size_t)(nc * es)), *cu = dev_put(&m, c.cu_q, (size_t)(c.B + 1) * 4);
  void *kl = dev_put(&m, c.kv_lens, (size_t)c.B * 4);
  void *tbt = dev_put(&m, s.tbt, (size_t)(hkv * c.B * c.max_blocks) * 4);
  void *tkv = dev_put(&m, s.tkv, (size_t)(hkv * c.B) * 4);
  void *o = dev_put(&m, NULL, (size_t)(2 * n * es));
  CU_ASSERT_FATAL(q && kc && vc && cu && kl && tbt && tkv && o);
  /* the chunk batch's own block table is only read through the compact tables here */
  const upf_attn_paged pb = {c.B, cu, c.cu_q, kl, c.kv_lens, NULL, c.bt, c.max_blocks, (int32_t)P};
  const upf_compact_tables t = {tbt, tkv, s.tbt, s.tkv, c.max_blocks};
  const int64_t qs[3] = {c.Tq, hq, d}, cs[4] = {c.npages, P, hkv, d};
  const upf_tensor tq = upf_test_view(q, dt, 3, qs), tkc = upf_test_view(kc, dt, 4, cs), tvc = upf_test_view(vc, dt, 4, cs);
  const upf_tensor o1 = upf_test_view(o, dt, 3, qs), o2 = upf_test_view((char *)o + n * es, dt, 3, qs);
  const upf_attn_params ap = {0.0f, 0.0f, 0};
  CU_ASSERT_EQUAL(upf_compact_attn_zero_copy(be, &pb, &t, &tq, &tkc, &tvc, &ap, &o1), UPF_OK);
  CU_ASSERT_EQUAL(upf_compact_attn_copy(be, &pb, &t, &tq, &tkc, &tvc, &ap, &o2), UPF_OK);
  void *host = malloc((size_t)(2 * n * es));
  double *truth = malloc((size_t)n * sizeof *truth), *d1 = malloc((size_t)n * sizeof *d1);
  CU_ASSERT_EQUAL(be->synchronize(), UPF_OK);
  CU_ASSERT_EQUAL(be->download(host, o, (size_t)(2 * n * es)), UPF_OK);
  oracle(&c, &s, p.block_n, 1.0 / sqrt((double)d), truth);
  const double rtol = dt == UPF_DTYPE_BF16 ? 1.6e-2 : 1e-4, atol = dt == UPF_DTYPE_BF16 ? 1e-2 : 1e-5;
  for (int64_t i = 0; i < n; i++)
    d1[i] = upf_test_value(host, dt, i);
  CU_ASSERT(budget(host, dt, truth, n, rtol, atol) <= 1.0);
  CU_ASSERT(budget((char *)host + n * es, dt, truth, n, rtol, atol) <= 1.0);
  CU_ASSERT(budget((char *)host + n * es, dt, d1, n, rtol, atol) <= 1.0);
  /* the whole chain on the device (its own selector), against the oracle over the table it reports */
  void *bt = dev_put(&m, c.bt, (size_t)(c.B * c.max_blocks) * 4);
  CU_ASSERT_FATAL(bt != NULL);
  const upf_attn_paged pbt = {c.B, cu, c.cu_q, kl, c.kv_lens, bt, c.bt, c.max_blocks, (int32_t)P};
  uint8_t *tab = malloc((size_t)(c.B * hkv * s.nb));
  CU_ASSERT_EQUAL(upf_compact_attend(be, &pbt, &tq, &tkc, &tvc, &p, &cp, &ap, 0, &o1, tab, NULL), UPF_OK);
  CU_ASSERT_EQUAL(be->download(host, o, (size_t)(n * es)), UPF_OK);
  uint8_t *cpu_table = s.table;
  s.table = tab;
  oracle(&c, &s, p.block_n, 1.0 / sqrt((double)d), truth);
  s.table = cpu_table;
  CU_ASSERT(budget(host, dt, truth, n, rtol, atol) <= 1.0);
  /* a kept workspace: the host copies it derives are the device's tables, the output is the one-shot
   * call's bits, and a second call allocates nothing */
  upf_compact_workspace ws;
  memset(&ws, 0, sizeof ws);
  void *again = malloc((size_t)(n * es));
  for (int rep = 0; rep < 2; rep++) {
    const int64_t before = ws.allocations;
    CU_ASSERT_EQUAL(upf_compact_attend_ws(be, &pbt, &tq, &tkc, &tvc, &p, &cp, &ap, 0, &o2, &ws), UPF_OK);
    CU_ASSERT(rep == 0 || ws.allocations == before);
  }
  CU_ASSERT_EQUAL(memcmp(ws.table_host.ptr, tab, (size_t)(c.B * hkv * s.nb)), 0);
  const size_t bt_bytes = (size_t)(hkv * c.B * c.max_blocks) * 4, kv_bytes = (size_t)(hkv * c.B) * 4;
  int32_t *dev_bt = malloc(bt_bytes), *dev_kv = malloc(kv_bytes);
  CU_ASSERT_EQUAL(be->download(dev_bt, ws.tables.block_table, bt_bytes), UPF_OK);
  CU_ASSERT_EQUAL(be->download(dev_kv, ws.tables.kv_lens, kv_bytes), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(dev_bt, ws.tables.block_table_host, bt_bytes), 0);
  CU_ASSERT_EQUAL(memcmp(dev_kv, ws.tables.kv_lens_host, kv_bytes), 0);
  CU_ASSERT_EQUAL(be->download(again, (char *)o + n * es, (size_t)(n * es)), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(again, host, (size_t)(n * es)), 0);
  upf_compact_workspace_free(&ws);
  free(dev_bt), free(dev_kv), free(again);
  free(tab);
  free(host), free(truth), free(d1);
  dev_free(&m);
  ca_sel_free(&s);
  ca_free(&c);
}

static void test_cuda_paths(void) {
  cuda_paths(32, 8, 128, 64, UPF_DTYPE_BF16, 51); /* Llama-3.1-8B heads: the mma paths */
  cuda_paths(8, 2, 64, 16, UPF_DTYPE_F32, 52);
}

static CU_TestInfo compact_attn_tests[] = {
    {"union by hand: recent, chunk inside a block, GQA tiles merged, chunk at the start", test_union_by_hand},
    {"f32: union == OR of the CSR, tables == kept pages, zero-copy == copy == masked dense", test_paths_f32},
    {"bf16: the same, ragged, a chunk at the start", test_paths_bf16},
    {"alpha 0 keeps every block and equals dense attn.paged", test_alpha0_dense},
    {"bad inputs: status and a message naming the input", test_bad_inputs},
    {"verify entries: seeded cases on the CPU twin", test_verify_twin},
    CU_TEST_INFO_NULL,
};

void upf_register_compact_attn_tests(void) {
  CU_pSuite suite = upf_test_suite("compact_attn", NULL, NULL, compact_attn_tests);
  upf_test_add_gpu(suite, "CUDA zero-copy == copy == masked dense (bf16 D 128, f32 D 64)", test_cuda_paths);
}
