/* Verify cases of FlashPrefill V2 (uniprefill/sparse.h): sparse.block_means, sparse.index, attn.block_sparse.
 * On every backend: hand-computed golden cases (means of known keys, the scores and kept sets of tile layouts
 * worked out by hand, attention with a closed-form answer) and bad inputs that must come back as their status.
 * On the reference itself: a naive oracle written from the header's formulas on seeded inputs, the index
 * invariants, paged K/V equal to contiguous, alpha 0 equal to dense attn.prefill, and mean correction closer
 * to dense than none. On a backend under test: seeded batches against the reference, inputs rounded to the
 * dtype first; the index compared exactly except marginal decisions (reference S within relative tau of
 * alpha max S), the attention fed the reference's index and means so that it is compared alone.
 *
 * Seeded inputs have hot blocks: each KV head has a direction u; q = N(0,1) + c u, and the keys of 30% of
 * the blocks are N(0,1) + c u, the others N(0,1) - c u, with c such that a hot block's l sits about 4 (log2)
 * above a cold one's, so alpha 0.18 drops most cold blocks and the choice matters. V is N(0,1) plus a
 * per-block offset, so a dropped block takes mass the mean correction can give back. */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/attn.h"
#include "ref_cpu/sparse.h"
#include "uniprefill/bf16.h"
#include "uniprefill/fp8.h"
#include "uniprefill/rng.h"
#include "uniprefill/variant.h"
#include "verify/select_checks.h" /* upf_select_tau: the SPEC section 2 margin */
#include "verify/harness.h"
#include "verify/verify.h"

enum { SC_QUICK = 1 }; /* in the quick set (CI, the benchmarks' verify-before-timing) */

#define MAX_REQS 6
#define NCASES(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define LOG2E 1.4426950408889634

static const upf_dtype both_dtypes[2] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};

/* tau of the marginal rule (SPEC section 2), by input dtype. */
typedef struct {
  const char *name;
  int nreq;
  int32_t q_lens[MAX_REQS];
  int32_t kv_extra[MAX_REQS]; /* kv_len = q_len + extra (cached prefix) */
  int32_t hq, hkv, d;
  float alpha;
  int32_t block_m, block_n, sink, window, last_n, min_sparse;
  int32_t mean_correction;
  int32_t page; /* 0: contiguous K/V; else a paged cache of this page size, pages shuffled */
  unsigned flags;
} sparse_case;

/* Backend under test. Shape classes: ragged batches, q_len g not a multiple of block_m, cached prefixes, a
 * q_len 1 request and short requests whose tiles are all among the last_n (dense), min_sparse_q_len at
 * and around the boundary, GQA 1/4/8, D 64/128/256, block_n 64/128, block_m 64/128, mean correction on and
 * off, alpha 0 / 0.18 / 1, paged P 8 / 16 / 48 (gathered for the wgmma kernel) and P 64 / 128 (read in place);
 * the Llama-3.1-8B 16K and 32K cases take the long-reduction rule. */
static const sparse_case cases[] = {
    {"ragged GQA4 a.18", 4, {1, 300, 1000, 40}, {0}, 16, 4, 128, 0.18f, 128, 64, 2, 4, 2, 0, 0, 0, SC_QUICK},
    {"cached prefix, mean corr, paged P16", 3, {200, 513, 64}, {700, 300, 2000}, 8, 2, 128, 0.18f, 128, 64, 2, 4,
     2, 0, 1, 16, SC_QUICK},
    {"GQA1 D64 a1 window1 sink1", 2, {900, 130}, {0, 50}, 4, 4, 64, 1.0f, 64, 64, 1, 1, 1, 0, 0, 0, SC_QUICK},
    {"GQA8 D256 bn128 mean corr", 2, {1200, 1}, {0, 400}, 16, 2, 256, 0.18f, 128, 128, 1, 2, 2, 0, 1, 0, SC_QUICK},
    {"alpha 0 keeps all, mean corr", 2, {600, 33}, {100, 0}, 8, 2, 128, 0.0f, 128, 64, 2, 4, 2, 0, 1, 0, SC_QUICK},
    {"min_sparse_q_len 512", 4, {511, 512, 513, 1500}, {0}, 8, 2, 64, 0.18f, 128, 64, 2, 4, 2, 512, 0, 0, 0},
    {"paged P16 GQA4 bn128 a1 mean corr", 2, {1200, 17}, {500, 3000}, 16, 4, 128, 1.0f, 128, 128, 2, 4, 2, 0, 1,
     16, 0},
    {"gemma D256 GQA2 paged P16 cached", 1, {2000}, {1000}, 16, 8, 256, 0.18f, 128, 64, 2, 4, 2, 0, 0, 16, 0},
    {"GQA8 bm64 sink0 window1 last_n0", 2, {1000, 250}, {0, 0}, 8, 1, 128, 0.18f, 64, 64, 0, 1, 0, 0, 1, 0, 0},
    {"D64 bn128 window8 a.5 paged", 3, {3000, 7, 260}, {0, 200, 4000}, 8, 2, 64, 0.5f, 128, 128, 2, 8, 2, 0, 0, 16,
     0},
    /* P 48 puts a page boundary inside a 64-key block and P 8 a block over 8 pages: both gathered */
    {"paged P48 GQA4 cached", 2, {400, 90}, {800, 77}, 16, 4, 128, 0.18f, 128, 64, 2, 4, 2, 0, 1, 48, SC_QUICK},
    {"paged P8 cached", 2, {300, 20}, {500, 40}, 8, 2, 128, 0.18f, 128, 64, 2, 4, 2, 0, 0, 8, SC_QUICK},
    /* pages of whole 64-key blocks: the wgmma kernel reads them in place */
    {"paged P64 cached, mean corr", 3, {300, 17, 700}, {1000, 64, 129}, 8, 2, 128, 0.18f, 128, 64, 2, 4, 2, 0, 1, 64,
     SC_QUICK},
    {"paged P128 D256 bn128 GQA4", 2, {900, 40}, {2000, 300}, 16, 4, 256, 0.18f, 128, 128, 2, 4, 2, 0, 0, 128, 0},
    {"llama 16K a.18", 1, {16384}, {0}, 32, 8, 128, 0.18f, 128, 128, 2, 4, 2, 0, 0, 0, 0},
    {"llama 32K a.18 mean corr", 1, {32768}, {0}, 32, 8, 128, 0.18f, 128, 128, 2, 4, 2, 0, 1, 0, 0},
};

/* The reference's own checks (oracle, invariants, paged vs contiguous, dense, correction): small enough for
 * the CPU pass under Valgrind. Run contiguous and paged (P 16) alike. */
static const sparse_case ref_cases[] = {
    {"ragged cached GQA4 a.3", 4, {1, 70, 200, 20}, {0, 70, 120, 0}, 4, 1, 32, 0.3f, 64, 64, 1, 1, 1, 0, 1, 16, 0},
    {"GQA1 bn128 a1", 2, {300, 100}, {0, 300}, 2, 2, 32, 1.0f, 64, 128, 1, 1, 1, 0, 1, 16, 0},
    {"GQA4 sink0 window1 min_sparse 60", 3, {60, 61, 150}, {0, 0, 300}, 4, 1, 64, 0.18f, 128, 64, 0, 1, 2, 60, 0, 16,
     0},
};

static upf_sparse_params case_params(const sparse_case *c) {
  upf_sparse_params p = {c->alpha, c->block_m, c->block_n, c->sink, c->window, c->last_n, c->min_sparse,
                         c->mean_correction, 0.0f};
  return p;
}

static void record_failure(upf_verify_ctx *ctx, const char *op, const char *variant, upf_dtype dt, upf_status st,
                           const char *what) {
  upf_check check;
  upf_dense_check_init(&check, op, variant, dt, "-");
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, &check);
}

static void elem_put(void *buf, upf_dtype dt, int64_t i, double x) {
  if (dt == UPF_DTYPE_BF16)
    ((uint16_t *)buf)[i] = upf_bf16_from_f32((float)x);
  else
    ((float *)buf)[i] = (float)x;
}

static double elem_get(const void *buf, upf_dtype dt, int64_t i) {
  return dt == UPF_DTYPE_BF16 ? upf_bf16_to_f32(((const uint16_t *)buf)[i]) : ((const float *)buf)[i];
}

/* ================================================================================================ */
/* One seeded case on the host: inputs in the case's K/V form, the batch, the plan, and the reference's
 * means and index.                                                                                  */

typedef struct {
  const sparse_case *c;
  upf_dtype dt;
  upf_sparse_params p;
  int32_t nreq;
  int32_t cu_q[MAX_REQS + 1], cu_kv[MAX_REQS + 1], kv_lens[MAX_REQS];
  int64_t tq, tkv;             /* query rows; K/V rows of the contiguous form */
  int32_t page, max_blocks, num_pages;
  int32_t *block_table;        /* (B, max_blocks) host, paged only */
  int64_t kv_numel;            /* elements of k (and v) in the case's form */
  void *q, *k, *v;             /* host, dt: q (Tq, Hq, D); k, v (Tkv, Hkv, D) or (pages, P, Hkv, D) */
  upf_attn_varlen cont;        /* host copies of the index arrays */
  upf_attn_paged paged;
  upf_sparse_batch batch;
  upf_sparse_plan plan;
  upf_sparse_tile *tiles;      /* (total_q_tiles) the tile of every segment of a KV head */
  int64_t means_numel;         /* B * max_key_blocks * Hkv * D */
  void *kbar, *vbar;           /* reference means (B, max_key_blocks, Hkv, D), dt */
  int32_t *row_ptr, *blocks;   /* reference index: (S + 1), (S * max_key_blocks) */
  float *scores;               /* (S, max_key_blocks) */
  int64_t kept_total;
} sparse_run;

static void run_free(sparse_run *sr) {
  free(sr->block_table), free(sr->q), free(sr->k), free(sr->v), free(sr->tiles);
  free(sr->kbar), free(sr->vbar), free(sr->row_ptr), free(sr->blocks), free(sr->scores);
  upf_sparse_plan_free(&sr->plan);
  memset(sr, 0, sizeof *sr);
}

static int64_t run_segments(const sparse_run *sr) { return sr->plan.num_segments; }
static int32_t run_nkb(const sparse_run *sr) { return sr->plan.max_key_blocks; }

/* Token slot of key j of request r: its row in (Tkv, ...) or page * P + offset in the cache. */
static int64_t kv_slot(const sparse_run *sr, int32_t r, int64_t j) {
  if (!sr->page)
    return sr->cu_kv[r] + j;
  return (int64_t)sr->block_table[(int64_t)r * sr->max_blocks + j / sr->page] * sr->page + j % sr->page;
}

/* q, k, v, kbar, vbar tensors of the run over the given data pointers. */
static void run_qkv(const sparse_run *sr, void *q, void *k, void *v, upf_tensor *tq, upf_tensor *tk,
                    upf_tensor *tv) {
  const sparse_case *c = sr->c;
  const int64_t sq[3] = {sr->tq, c->hq, c->d};
  upf_tensor_init(tq, q, sr->dt, 3, sq);
  if (sr->page) {
    const int64_t sc[4] = {sr->num_pages, sr->page, c->hkv, c->d};
    upf_tensor_init(tk, k, sr->dt, 4, sc), upf_tensor_init(tv, v, sr->dt, 4, sc);
  } else {
    const int64_t skv[3] = {sr->tkv, c->hkv, c->d};
    upf_tensor_init(tk, k, sr->dt, 3, skv), upf_tensor_init(tv, v, sr->dt, 3, skv);
  }
}

static void run_means_tensor(const sparse_run *sr, void *data, upf_tensor *t) {
  const int64_t s[4] = {sr->nreq, run_nkb(sr), sr->c->hkv, sr->c->d};
  upf_tensor_init(t, data, sr->dt, 4, s);
}

/* 30% of the (request, KV head, block)s are hot: 3 of every 10 consecutive blocks (7 b runs through every
 * residue mod 10), at an offset of the seed, the request and the head, so that no short request is left
 * all cold or all hot. */
static int hot_block(uint64_t seed, int32_t r, int64_t h, int64_t b) {
  return (upf_mix64(seed ^ ((uint64_t)r << 48) ^ ((uint64_t)h << 32)) + (uint64_t)b * 7) % 10 < 3;
}

/* Normals from a pool by random index, one generator step each: the long cases hold 10^8 values. */
#define NORMAL_POOL 65521
typedef struct {
  upf_rng rng;
  float pool[NORMAL_POOL];
} normal_source;

static void normals_init(normal_source *n, uint64_t seed) {
  upf_rng_seed(&n->rng, seed);
  for (int i = 0; i < NORMAL_POOL; i++)
    n->pool[i] = upf_rng_normal(&n->rng);
}

static float normal(normal_source *n) { return n->pool[(upf_rng_next(&n->rng) >> 16) % NORMAL_POOL]; }

/* Fills the host inputs of case c in dtype dt with K/V in the form of page (0: contiguous); the values of a
 * (request, position, head) do not depend on the form, so the two forms of one seed hold the same problem. */
static upf_status run_inputs(sparse_run *sr, const sparse_case *c, upf_dtype dt, int32_t page, uint64_t seed) {
  memset(sr, 0, sizeof *sr);
  sr->c = c, sr->dt = dt, sr->p = case_params(c), sr->nreq = c->nreq, sr->page = page;
  int64_t max_kv = 0;
  for (int r = 0; r < c->nreq; r++) {
    sr->kv_lens[r] = c->q_lens[r] + c->kv_extra[r];
    sr->cu_q[r + 1] = sr->cu_q[r] + c->q_lens[r];
    sr->cu_kv[r + 1] = sr->cu_kv[r] + sr->kv_lens[r];
    max_kv = sr->kv_lens[r] > max_kv ? sr->kv_lens[r] : max_kv;
  }
  sr->tq = sr->cu_q[c->nreq], sr->tkv = sr->cu_kv[c->nreq];
  const int64_t D = c->d, hkv = c->hkv, hq = c->hq, g = hq / hkv, es = (int64_t)upf_dtype_size(dt);
  normal_source *ns = malloc(sizeof *ns);
  if (!ns)
    return upf_fail(UPF_ERR_NOMEM, "verify sparse: normal pool");
  normals_init(ns, seed);
  if (page) {
    int64_t used = 0;
    for (int r = 0; r < c->nreq; r++)
      used += (sr->kv_lens[r] + page - 1) / page;
    sr->max_blocks = (int32_t)((max_kv + page - 1) / page);
    sr->num_pages = (int32_t)(used + 3); /* spare pages: never read */
    sr->block_table = calloc((size_t)(c->nreq * (sr->max_blocks ? sr->max_blocks : 1)), sizeof(int32_t));
    int32_t *perm = malloc((size_t)sr->num_pages * sizeof *perm);
    if (!sr->block_table || !perm) {
      free(perm), free(ns);
      return upf_fail(UPF_ERR_NOMEM, "verify sparse: block table");
    }
    /* pages handed out shuffled, from a generator of their own so that the values match the contiguous form */
    upf_rng prng;
    upf_rng_seed(&prng, seed ^ 0x9a9e5ull);
    for (int32_t i = 0; i < sr->num_pages; i++)
      perm[i] = i;
    for (int32_t i = sr->num_pages - 1; i > 0; i--) {
      int32_t j = (int32_t)upf_rng_below(&prng, (uint64_t)i + 1), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    int64_t next = 0;
    for (int r = 0; r < c->nreq; r++)
      for (int64_t i = 0; i < (sr->kv_lens[r] + page - 1) / page; i++)
        sr->block_table[(int64_t)r * sr->max_blocks + i] = perm[next++];
    free(perm);
    sr->kv_numel = (int64_t)sr->num_pages * page * hkv * D;
  } else {
    sr->kv_numel = sr->tkv * hkv * D;
  }
  sr->q = malloc((size_t)(sr->tq * hq * D * es + 1));
  sr->k = malloc((size_t)(sr->kv_numel * es + 1));
  sr->v = malloc((size_t)(sr->kv_numel * es + 1));
  float *u = malloc((size_t)(hkv * D) * sizeof *u);
  float *w = malloc((size_t)((max_kv / c->block_n + 1) * hkv * D) * sizeof *w);
  if (!sr->q || !sr->k || !sr->v || !u || !w) {
    free(u), free(w), free(ns);
    return upf_fail(UPF_ERR_NOMEM, "verify sparse: inputs of %s", c->name);
  }
  /* every slot NaN, then each request's kv_len rows: a read through a wrong page or past kv_len shows */
  memset(sr->k, 0xFF, (size_t)(sr->kv_numel * es));
  memset(sr->v, 0xFF, (size_t)(sr->kv_numel * es));
  const double cu_mag = sqrt(2.0 / (LOG2E * sqrt((double)D)));
  for (int64_t i = 0; i < hkv * D; i++)
    u[i] = normal(ns);
  for (int64_t t = 0; t < sr->tq; t++)
    for (int64_t h = 0; h < hq; h++)
      for (int64_t e = 0; e < D; e++)
        elem_put(sr->q, dt, (t * hq + h) * D + e, normal(ns) + cu_mag * u[(h / g) * D + e]);
  for (int32_t r = 0; r < c->nreq; r++) {
    const int64_t nb = (sr->kv_lens[r] + c->block_n - 1) / c->block_n;
    for (int64_t i = 0; i < nb * hkv * D; i++)
      w[i] = normal(ns);
    for (int64_t j = 0; j < sr->kv_lens[r]; j++) {
      const int64_t b = j / c->block_n, slot = kv_slot(sr, r, j);
      for (int64_t h = 0; h < hkv; h++) {
        const double sign = hot_block(seed, r, h, b) ? 1.0 : -1.0;
        for (int64_t e = 0; e < D; e++) {
          elem_put(sr->k, dt, (slot * hkv + h) * D + e, normal(ns) + sign * cu_mag * u[h * D + e]);
          elem_put(sr->v, dt, (slot * hkv + h) * D + e, normal(ns) + w[(b * hkv + h) * D + e]);
        }
      }
    }
  }
  free(u), free(w), free(ns);
  sr->cont = (upf_attn_varlen){c->nreq, sr->cu_q, sr->cu_q, sr->cu_kv, sr->cu_kv};
  sr->paged = (upf_attn_paged){c->nreq,         sr->cu_q,       sr->cu_q,       sr->kv_lens, sr->kv_lens,
                               sr->block_table, sr->block_table, sr->max_blocks, page};
  sr->batch = page ? (upf_sparse_batch){NULL, &sr->paged} : (upf_sparse_batch){&sr->cont, NULL};
  UPF_TRY(upf_sparse_plan_make(&sr->batch, c->hq, c->hkv, &sr->p, &sr->plan));
  sr->tiles = malloc((size_t)sr->plan.total_q_tiles * sizeof *sr->tiles + 1);
  if (!sr->tiles)
    return upf_fail(UPF_ERR_NOMEM, "verify sparse: tiles");
  for (int32_t r = 0; r < c->nreq; r++)
    for (int32_t m = 0; m < sr->plan.cu_q_tiles[r + 1] - sr->plan.cu_q_tiles[r]; m++)
      sr->tiles[sr->plan.cu_q_tiles[r] + m] =
          upf_sparse_tile_at(r, m, c->q_lens[r], sr->kv_lens[r], (int32_t)g, &sr->p);
  sr->means_numel = (int64_t)sr->nreq * run_nkb(sr) * hkv * D;
  return UPF_OK;
}

/* The reference's means (both, whatever the case's mean correction) and, when want_index, its index. */
static upf_status run_reference(sparse_run *sr, int want_index) {
  const upf_backend *cpu = upf_backend_cpu();
  const size_t es = upf_dtype_size(sr->dt);
  sr->kbar = malloc((size_t)sr->means_numel * es + 1);
  sr->vbar = malloc((size_t)sr->means_numel * es + 1);
  if (!sr->kbar || !sr->vbar)
    return upf_fail(UPF_ERR_NOMEM, "verify sparse: means");
  upf_tensor tq, tk, tv, tkb, tvb;
  run_qkv(sr, sr->q, sr->k, sr->v, &tq, &tk, &tv);
  run_means_tensor(sr, sr->kbar, &tkb), run_means_tensor(sr, sr->vbar, &tvb);
  UPF_TRY(cpu->sparse_block_means(&sr->batch, &tk, &tv, &sr->p, &tkb, &tvb));
  if (!want_index)
    return UPF_OK;
  const int64_t S = run_segments(sr), cap = S * run_nkb(sr);
  sr->row_ptr = malloc((size_t)(S + 1) * sizeof(int32_t));
  sr->blocks = malloc((size_t)(cap ? cap : 1) * sizeof(int32_t));
  sr->scores = malloc((size_t)(cap ? cap : 1) * sizeof(float));
  if (!sr->row_ptr || !sr->blocks || !sr->scores)
    return upf_fail(UPF_ERR_NOMEM, "verify sparse: index of %lld segments", (long long)S);
  upf_sparse_index idx = {sr->row_ptr, sr->blocks, sr->scores, -1};
  UPF_TRY(cpu->sparse_index(&sr->batch, &tq, &tkb, &sr->p, &idx));
  sr->kept_total = idx.kept_total;
  return UPF_OK;
}

static void run_shape(const sparse_run *sr, char *buf, size_t cap) {
  const sparse_case *c = sr->c;
  int n = sr->page ? snprintf(buf, cap, "Hq/Hkv=%d/%d D=%d P=%d q/kv=", c->hq, c->hkv, c->d, sr->page)
                   : snprintf(buf, cap, "Hq/Hkv=%d/%d D=%d q/kv=", c->hq, c->hkv, c->d);
  for (int r = 0; r < c->nreq && n > 0 && (size_t)n < cap; r++)
    n += snprintf(buf + n, cap - (size_t)n, "%s%d/%d", r ? "," : "", c->q_lens[r], sr->kv_lens[r]);
}

static void run_check_init(const sparse_run *sr, const char *op, const char *what, upf_check *check) {
  char shape[96];
  run_shape(sr, shape, sizeof shape);
  upf_dense_check_init(check, op, "", sr->dt, "%s", shape);
  snprintf(check->variant, sizeof check->variant, "%s%s%s", sr->c->name, what ? ": " : "", what ? what : "");
}

/* ================================================================================================ */
/* The index: structure, the header's rules, and decisions against the reference.                  */

static int forced_keep(const upf_sparse_tile *t, const upf_sparse_params *p, int32_t b) {
  return t->dense || b < p->sink || b >= t->first_k - p->window + 1;
}

static double row_max(const float *s, int32_t n) {
  double m = 0.0;
  for (int32_t b = 0; b < n; b++)
    m = s[b] > m ? s[b] : m;
  return m;
}

/* Whether block b of a scored tile sits within relative tau of its segment's threshold alpha max S. */
static int marginal(const float *s_row, int32_t active, double alpha, int32_t b, double tau) {
  const double thr = alpha * row_max(s_row, active);
  return fabs((double)s_row[b] - thr) <= tau * thr;
}

static void fail_detail(upf_check *check, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail_detail(upf_check *check, const char *fmt, ...) {
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

/* "seg 17 (kv head 1, req 2, tile 3)" */
static void segment_name(const sparse_run *sr, int64_t s, char *buf, size_t cap) {
  const upf_sparse_tile *t = &sr->tiles[s % sr->plan.total_q_tiles];
  snprintf(buf, cap, "seg %lld (kv head %lld, req %d, tile %d)", (long long)s,
           (long long)(s / sr->plan.total_q_tiles), t->req, t->m);
}

/* A CSR index well formed: row_ptr from 0, non-decreasing, ending at kept_total; each segment's blocks
 * strictly ascending, >= 0 and never past the tile's last_k (no block a row cannot see). */
static int csr_valid(const sparse_run *sr, const int32_t *rp, const int32_t *bl, int64_t kept_total,
                     upf_check *check) {
  const int64_t S = run_segments(sr);
  char seg[96];
  if (rp[0] != 0)
    return fail_detail(check, "row_ptr[0]=%d, not 0", rp[0]), 0;
  if (rp[S] != kept_total)
    return fail_detail(check, "row_ptr[S]=%d but kept_total=%lld", rp[S], (long long)kept_total), 0;
  for (int64_t s = 0; s < S; s++) {
    const upf_sparse_tile *t = &sr->tiles[s % sr->plan.total_q_tiles];
    if (rp[s + 1] < rp[s] || rp[s + 1] - rp[s] > run_nkb(sr)) {
      segment_name(sr, s, seg, sizeof seg);
      return fail_detail(check, "%s: row_ptr %d..%d is not a count in [0, %d]", seg, rp[s], rp[s + 1], run_nkb(sr)),
             0;
    }
    for (int32_t i = rp[s]; i < rp[s + 1]; i++)
      if (bl[i] < 0 || bl[i] > t->last_k || (i > rp[s] && bl[i] <= bl[i - 1])) {
        segment_name(sr, s, seg, sizeof seg);
        return fail_detail(check, "%s: blocks[%d]=%d not ascending in [0, last_k=%d]", seg, i, bl[i], t->last_k), 0;
      }
  }
  return 1;
}

/* Marks the kept blocks of segment s in keep (max_key_blocks). */
static void segment_mask(const sparse_run *sr, const int32_t *rp, const int32_t *bl, int64_t s, uint8_t *keep) {
  memset(keep, 0, (size_t)run_nkb(sr));
  for (int32_t i = rp[s]; i < rp[s + 1]; i++)
    keep[bl[i]] = 1;
}

/* The rules of the header, judged with the index's own scores: dense tiles keep exactly 0..last_k and score
 * nothing; elsewhere sink and window kept, nothing in [active, last_k] kept but by them, no score at
 * b >= active, a scored block kept iff S >= alpha max S (within relative tau: marginal, counted). */
static void index_invariants(const sparse_run *sr, const int32_t *rp, const int32_t *bl, const float *scores,
                             int64_t kept_total, double tau, upf_check *check) {
  check_begin(check);
  if (!csr_valid(sr, rp, bl, kept_total, check))
    return;
  const int32_t nkb = run_nkb(sr);
  uint8_t *keep = malloc((size_t)nkb);
  if (!keep)
    return fail_detail(check, "no memory");
  int64_t marginal_n = 0, kept = 0;
  char seg[96];
  for (int64_t s = 0; s < run_segments(sr) && check->passed; s++) {
    const upf_sparse_tile *t = &sr->tiles[s % sr->plan.total_q_tiles];
    const float *srow = scores + s * nkb;
    segment_mask(sr, rp, bl, s, keep);
    segment_name(sr, s, seg, sizeof seg);
    for (int32_t b = 0; b < nkb && check->passed; b++) {
      kept += keep[b];
      const int scored = !t->dense && b < t->active;
      if (!scored && srow[b] != 0.0f)
        fail_detail(check, "%s block %d: score %g where nothing is scored (dense tile or b >= active=%d)", seg, b,
                    (double)srow[b], t->active);
      else if (b > t->last_k)
        continue; /* csr_valid: never kept */
      else if (forced_keep(t, &sr->p, b) && !keep[b])
        fail_detail(check, "%s block %d: dropped, but %s", seg, b,
                    t->dense ? "the tile is dense" : b < sr->p.sink ? "it is a sink block" : "it is in the window");
      else if (!forced_keep(t, &sr->p, b) && !scored && keep[b])
        fail_detail(check, "%s block %d: kept, but it is neither scored (active=%d), sink nor window", seg, b,
                    t->active);
      else if (scored && !forced_keep(t, &sr->p, b)) {
        const int want = srow[b] >= sr->p.alpha * row_max(srow, t->active);
        if (want != keep[b]) {
          if (marginal(srow, t->active, sr->p.alpha, b, tau))
            marginal_n++;
          else
            fail_detail(check, "%s block %d: %s with S=%g, alpha max S=%g", seg, b, keep[b] ? "kept" : "dropped",
                        (double)srow[b], sr->p.alpha * row_max(srow, t->active));
        }
      }
    }
  }
  free(keep);
  if (check->passed)
    snprintf(check->detail, sizeof check->detail, "%lld kept of %lld visible blocks, %lld marginal", (long long)kept,
             (long long)upf_sparse_visible_blocks(&sr->batch, &sr->plan, &sr->p), (long long)marginal_n);
}

/* got's decisions against the reference's, per segment and block: a difference passes only where the
 * reference's S is within relative tau of its segment's threshold. */
static void compare_decisions(const sparse_run *sr, const int32_t *rp, const int32_t *bl, int64_t kept_total,
                              double tau, upf_check *check) {
  check_begin(check);
  if (!csr_valid(sr, rp, bl, kept_total, check))
    return;
  const int32_t nkb = run_nkb(sr);
  uint8_t *want = malloc((size_t)nkb), *got = malloc((size_t)nkb);
  if (!want || !got) {
    free(want), free(got);
    return fail_detail(check, "no memory");
  }
  int64_t bad = 0, marginal_n = 0;
  char first[200] = "";
  for (int64_t s = 0; s < run_segments(sr); s++) {
    const upf_sparse_tile *t = &sr->tiles[s % sr->plan.total_q_tiles];
    const float *srow = sr->scores + s * nkb;
    segment_mask(sr, sr->row_ptr, sr->blocks, s, want);
    segment_mask(sr, rp, bl, s, got);
    for (int32_t b = 0; b < nkb; b++) {
      if (want[b] == got[b])
        continue;
      const int scored = !t->dense && b < t->active && !forced_keep(t, &sr->p, b);
      if (scored && marginal(srow, t->active, sr->p.alpha, b, tau)) {
        marginal_n++;
        continue;
      }
      if (bad++ == 0) {
        char seg[96];
        segment_name(sr, s, seg, sizeof seg);
        snprintf(first, sizeof first, "%s block %d: reference %s, got %s (S=%g, alpha max S=%g)", seg, b,
                 want[b] ? "keeps" : "drops", got[b] ? "keeps" : "drops", (double)srow[b],
                 sr->p.alpha * row_max(srow, t->active > 0 ? t->active : 0));
      }
    }
  }
  free(want), free(got);
  check->max_abs_err = (double)bad;
  check->budget = bad ? INFINITY : 0.0;
  if (bad)
    fail_detail(check, "%lld non-marginal differences (%lld marginal), first: %.150s", (long long)bad,
                (long long)marginal_n, first);
  else
    snprintf(check->detail, sizeof check->detail, "%lld kept (reference %lld), %lld marginal differences",
             (long long)kept_total, (long long)sr->kept_total, (long long)marginal_n);
}

/* ================================================================================================ */
/* The naive oracle: the header's formulas as plain loops in double (reference checks only).        */

static double *to_doubles(const void *x, upf_dtype dt, int64_t n) {
  double *y = malloc((size_t)(n ? n : 1) * sizeof *y);
  for (int64_t i = 0; y && i < n; i++)
    y[i] = elem_get(x, dt, i);
  return y;
}

static void oracle_means(const sparse_run *sr, double *kbar, double *vbar) {
  const sparse_case *c = sr->c;
  const int64_t D = c->d, hkv = c->hkv, nkb = run_nkb(sr);
  for (int32_t r = 0; r < sr->nreq; r++)
    for (int64_t b = 0; b < nkb; b++)
      for (int64_t h = 0; h < hkv; h++) {
        const int64_t j0 = b * c->block_n, j1 = j0 + c->block_n < sr->kv_lens[r] ? j0 + c->block_n : sr->kv_lens[r];
        double *kb = kbar + ((r * nkb + b) * hkv + h) * D, *vb = vbar + ((r * nkb + b) * hkv + h) * D;
        for (int64_t e = 0; e < D; e++) {
          double ks = 0.0, vs = 0.0;
          for (int64_t j = j0; j < j1; j++) {
            const int64_t at = (kv_slot(sr, r, j) * hkv + h) * D + e;
            ks += elem_get(sr->k, sr->dt, at), vs += elem_get(sr->v, sr->dt, at);
          }
          kb[e] = j1 > j0 ? ks / (double)(j1 - j0) : 0.0;
          vb[e] = j1 > j0 ? vs / (double)(j1 - j0) : 0.0;
        }
      }
}

static double dot_q_mean(const sparse_run *sr, const void *means, int32_t r, int64_t qrow, int64_t head, int64_t b) {
  const sparse_case *c = sr->c;
  const int64_t D = c->d, g = c->hq / c->hkv;
  double acc = 0.0;
  for (int64_t e = 0; e < D; e++)
    acc += elem_get(sr->q, sr->dt, (qrow * c->hq + head) * D + e) *
           elem_get(means, sr->dt, (((int64_t)r * run_nkb(sr) + b) * c->hkv + head / g) * D + e);
  return acc;
}

/* S (segments, max_key_blocks) and the kept mask of every segment, from the reference's kbar. */
static void oracle_index(const sparse_run *sr, double *S, uint8_t *keep) {
  const sparse_case *c = sr->c;
  const int64_t g = c->hq / c->hkv, nkb = run_nkb(sr), T = sr->plan.total_q_tiles;
  const double l2 = (double)upf_sparse_scale(&sr->p, c->d) * LOG2E;
  double *l = malloc((size_t)(c->block_m * nkb) * sizeof *l);
  for (int64_t s = 0; l && s < run_segments(sr); s++) {
    const upf_sparse_tile *t = &sr->tiles[s % T];
    const int64_t h = s / T, prefix = t->kv_len - t->q_len, p0 = (int64_t)t->m * c->block_m;
    const int64_t p1 = p0 + c->block_m < (int64_t)t->q_len * g ? p0 + c->block_m : (int64_t)t->q_len * g;
    double *srow = S + s * nkb, m_t = -INFINITY;
    uint8_t *krow = keep + s * nkb;
    for (int64_t b = 0; b < nkb; b++)
      srow[b] = 0.0, krow[b] = b <= t->last_k && forced_keep(t, &sr->p, (int32_t)b);
    if (t->dense)
      continue;
    for (int64_t p = p0; p < p1; p++)
      for (int64_t b = 0; b < t->active; b++) {
        const int64_t pos = p / g;
        if (prefix + pos >= b * c->block_n) {
          l[(p - p0) * nkb + b] = l2 * dot_q_mean(sr, sr->kbar, t->req, sr->cu_q[t->req] + pos, h * g + p % g, b);
          m_t = fmax(m_t, l[(p - p0) * nkb + b]);
        }
      }
    for (int64_t p = p0; p < p1; p++)
      for (int64_t b = 0; b < t->active; b++)
        if (prefix + p / g >= b * c->block_n)
          srow[b] += exp2(l[(p - p0) * nkb + b] - m_t);
    double mx = 0.0;
    for (int64_t b = 0; b < t->active; b++)
      mx = fmax(mx, srow[b]);
    for (int64_t b = 0; b < t->active; b++)
      krow[b] |= srow[b] >= sr->p.alpha * mx;
  }
  free(l);
}

/* out (Tq, Hq, D) of attention over the given index (host CSR) and means, in double. */
static upf_status oracle_attention(const sparse_run *sr, const upf_sparse_params *p, const int32_t *rp,
                                   const int32_t *bl, double *out) {
  const sparse_case *c = sr->c;
  const int64_t D = c->d, hq = c->hq, hkv = c->hkv, g = hq / hkv, T = sr->plan.total_q_tiles, nkb = run_nkb(sr);
  const double scale = upf_sparse_scale(p, D);
  int64_t max_kv = 0;
  for (int r = 0; r < sr->nreq; r++)
    max_kv = sr->kv_lens[r] > max_kv ? sr->kv_lens[r] : max_kv;
  double *logit = malloc((size_t)(max_kv + nkb) * sizeof *logit);
  int64_t *src = malloc((size_t)(max_kv + nkb) * sizeof *src); /* >= 0: key slot; < 0: -1 - mean block */
  uint8_t *keep = malloc((size_t)nkb);
  double *qd = to_doubles(sr->q, sr->dt, sr->tq * hq * D), *kd = to_doubles(sr->k, sr->dt, sr->kv_numel);
  double *vd = to_doubles(sr->v, sr->dt, sr->kv_numel);
  if (!logit || !src || !keep || !qd || !kd || !vd) {
    free(logit), free(src), free(keep), free(qd), free(kd), free(vd);
    return upf_fail(UPF_ERR_NOMEM, "oracle attention");
  }
  for (int32_t r = 0; r < sr->nreq; r++) {
    const int64_t q_len = sr->cu_q[r + 1] - sr->cu_q[r], prefix = sr->kv_lens[r] - q_len;
    for (int64_t i = 0; i < q_len; i++)
      for (int64_t head = 0; head < hq; head++) {
        const int64_t h = head / g, prow = i * g + head % g, s = h * T + sr->plan.cu_q_tiles[r] + prow / c->block_m;
        const upf_sparse_tile *t = &sr->tiles[s % T];
        const int64_t qrow = sr->cu_q[r] + i;
        int64_t n = 0;
        segment_mask(sr, rp, bl, s, keep);
        for (int64_t b = 0; b < nkb; b++) {
          if (keep[b]) {
            for (int64_t j = b * c->block_n; j < (b + 1) * c->block_n && j <= prefix + i && j < sr->kv_lens[r]; j++) {
              const int64_t slot = kv_slot(sr, r, j);
              const double *qv = qd + (qrow * hq + head) * D, *kv = kd + (slot * hkv + h) * D;
              double acc = 0.0;
              for (int64_t e = 0; e < D; e++)
                acc += qv[e] * kv[e];
              logit[n] = scale * acc, src[n++] = slot;
            }
          } else if (p->mean_correction && b < t->corr_hi) {
            logit[n] = scale * dot_q_mean(sr, sr->kbar, r, qrow, head, b) + log((double)c->block_n);
            src[n++] = -1 - b;
          }
        }
        double mx = -INFINITY, sum = 0.0;
        for (int64_t x = 0; x < n; x++)
          mx = fmax(mx, logit[x]);
        double *o = out + (qrow * hq + head) * D;
        for (int64_t e = 0; e < D; e++)
          o[e] = 0.0;
        for (int64_t x = 0; x < n; x++) {
          const double w = exp(logit[x] - mx);
          sum += w;
          if (src[x] >= 0) {
            const double *vv = vd + (src[x] * hkv + h) * D;
            for (int64_t e = 0; e < D; e++)
              o[e] += w * vv[e];
          } else {
            for (int64_t e = 0; e < D; e++)
              o[e] += w * elem_get(sr->vbar, sr->dt, (((int64_t)r * nkb + (-1 - src[x])) * hkv + h) * D + e);
          }
        }
        for (int64_t e = 0; e < D; e++)
          o[e] = n ? o[e] / sum : NAN; /* no key: the window keeps each row's own block, so never */
      }
  }
  free(logit), free(src), free(keep), free(qd), free(kd), free(vd);
  return UPF_OK;
}

/* ================================================================================================ */
/* Golden cases (every backend).                                                                    */

typedef struct {
  const upf_backend *be;
  void *ptr[16];
  int n;
} gmem;

static upf_status g_put(gmem *m, const void *host, size_t bytes, void **dev) {
  UPF_TRY(m->be->alloc(&m->ptr[m->n], bytes ? bytes : 1));
  *dev = m->ptr[m->n++];
  return host ? m->be->upload(*dev, host, bytes) : m->be->fill(*dev, 0xFF, bytes);
}

/* n values of dt (converted from doubles) in backend memory. */
static upf_status g_vals(gmem *m, upf_dtype dt, const double *vals, int64_t n, void **dev) {
  void *h = malloc((size_t)n * upf_dtype_size(dt) + 1);
  if (!h)
    return upf_fail(UPF_ERR_NOMEM, "golden values");
  for (int64_t i = 0; i < n; i++)
    elem_put(h, dt, i, vals[i]);
  upf_status st = g_put(m, h, (size_t)n * upf_dtype_size(dt), dev);
  free(h);
  return st;
}

static void g_free(gmem *m) {
  for (int i = 0; i < m->n; i++)
    m->be->release(m->ptr[i]);
  m->n = 0;
}

/* Downloads n values of dt and compares them with want (the dtype's tolerance). */
static void g_compare(upf_verify_ctx *ctx, gmem *m, upf_status st, const void *dev, upf_dtype dt, const double *want,
                      int64_t n, upf_check *check) {
  void *h = malloc((size_t)n * upf_dtype_size(dt) + 1);
  float *got = malloc((size_t)n * sizeof *got + 1);
  if (st == UPF_OK && (!h || !got))
    st = upf_fail(UPF_ERR_NOMEM, "golden download");
  if (st == UPF_OK)
    st = m->be->synchronize();
  if (st == UPF_OK)
    st = m->be->download(h, dev, (size_t)n * upf_dtype_size(dt));
  if (st != UPF_OK) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    for (int64_t i = 0; i < n; i++)
      got[i] = (float)elem_get(h, dt, i);
    upf_compare_f32(got, want, n, upf_tolerance_for(dt), check);
  }
  upf_verify_record(ctx, check);
  free(h), free(got);
}

#define GD 64 /* head dim of the golden cases (the CUDA kernels' smallest) */

/* Means: request 0 has 256 keys k_j = c_(j/64) e0 with c = (3, 0, 1, 2), values v_j = j e0 + (j % 2) e1;
 * request 1 has 70 keys k_j = j e0 (a tail block of 6), v_j = -e1. kbar (2, 4, 1, 64): request 0's blocks
 * c_b e0, request 1's 31.5 e0 and 66.5 e0 then two zero blocks (past kv_len); vbar: (64 b + 31.5) e0 +
 * 0.5 e1, and -e1, -e1, 0, 0. The paged form puts the 16-key pages in a shuffled order, NaN elsewhere. */
static void golden_means(upf_verify_ctx *ctx, upf_dtype dt, int paged) {
  gmem m = {.be = ctx->backend};
  const int32_t cu[3] = {0, 256, 326}, kv_lens[2] = {256, 70}, P = 16, npages = 16 + 5 + 2;
  static const int32_t req1_pages[5] = {4, 0, 6, 2, 5};
  int32_t bt[2 * 16];
  for (int i = 0; i < 32; i++) /* request 0: pages 22, 21, ..., 7; request 1: 4, 0, 6, 2, 5; 1 and 3 unused */
    bt[i] = i < 16 ? 22 - i : i - 16 < 5 ? req1_pages[i - 16] : 0;
  const int64_t rows = paged ? (int64_t)npages * P : 326;
  double *k = malloc((size_t)(rows * GD) * sizeof *k), *v = malloc((size_t)(rows * GD) * sizeof *v);
  double kw[2 * 4 * GD] = {0}, vw[2 * 4 * GD] = {0};
  upf_status st = k && v ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "golden means");
  for (int64_t i = 0; st == UPF_OK && i < rows * GD; i++)
    k[i] = v[i] = paged ? NAN : 0.0;
  for (int r = 0; st == UPF_OK && r < 2; r++)
    for (int j = 0; j < kv_lens[r]; j++) {
      const int64_t slot = paged ? (int64_t)bt[r * 16 + j / P] * P + j % P : cu[r] + j;
      for (int e = 0; e < GD; e++)
        k[slot * GD + e] = v[slot * GD + e] = 0.0;
      static const double c[4] = {3, 0, 1, 2};
      k[slot * GD] = r == 0 ? c[j / 64] : j;
      v[slot * GD] = r == 0 ? j : 0.0;
      v[slot * GD + 1] = r == 0 ? j % 2 : -1.0;
    }
  for (int b = 0; b < 4; b++) {
    static const double c[4] = {3, 0, 1, 2};
    kw[b * GD] = c[b], vw[b * GD] = 64.0 * b + 31.5, vw[b * GD + 1] = 0.5;
  }
  kw[4 * GD] = 31.5, kw[5 * GD] = 66.5, vw[4 * GD + 1] = vw[5 * GD + 1] = -1.0;
  void *dk = NULL, *dv = NULL, *dkb = NULL, *dvb = NULL, *dcu = NULL, *dcukv = NULL, *dkl = NULL, *dbt = NULL;
  if (st == UPF_OK)
    st = g_vals(&m, dt, k, rows * GD, &dk);
  if (st == UPF_OK)
    st = g_vals(&m, dt, v, rows * GD, &dv);
  if (st == UPF_OK)
    st = g_put(&m, NULL, 2 * 4 * GD * upf_dtype_size(dt), &dkb);
  if (st == UPF_OK)
    st = g_put(&m, NULL, 2 * 4 * GD * upf_dtype_size(dt), &dvb);
  if (st == UPF_OK)
    st = g_put(&m, cu, sizeof cu, &dcu);
  if (st == UPF_OK)
    st = g_put(&m, cu, sizeof cu, &dcukv);
  if (st == UPF_OK)
    st = g_put(&m, kv_lens, sizeof kv_lens, &dkl);
  if (st == UPF_OK)
    st = g_put(&m, bt, sizeof bt, &dbt);
  if (st == UPF_OK) {
    upf_sparse_params p = upf_sparse_params_default();
    upf_attn_varlen cb = {2, dcu, cu, dcukv, cu};
    upf_attn_paged pb = {2, dcu, cu, dkl, kv_lens, dbt, bt, 16, P};
    upf_sparse_batch b = paged ? (upf_sparse_batch){NULL, &pb} : (upf_sparse_batch){&cb, NULL};
    const int64_t sc[4] = {npages, P, 1, GD}, skv[3] = {326, 1, GD}, sm[4] = {2, 4, 1, GD};
    upf_tensor tk, tv, tkb, tvb;
    upf_tensor_init(&tk, dk, dt, paged ? 4 : 3, paged ? sc : skv);
    upf_tensor_init(&tv, dv, dt, paged ? 4 : 3, paged ? sc : skv);
    upf_tensor_init(&tkb, dkb, dt, 4, sm), upf_tensor_init(&tvb, dvb, dt, 4, sm);
    st = ctx->backend->sparse_block_means(&b, &tk, &tv, &p, &tkb, &tvb);
  }
  upf_check check;
  const char *variant = paged ? "golden: paged P16 shuffled" : "golden: contiguous";
  upf_dense_check_init(&check, "sparse.block_means", variant, dt, "hand-computed, kv 256/70 D=64 [kbar]");
  g_compare(ctx, &m, st, dkb, dt, kw, 2 * 4 * GD, &check);
  if (st == UPF_OK) {
    upf_dense_check_init(&check, "sparse.block_means", variant, dt, "hand-computed, kv 256/70 D=64 [vbar]");
    g_compare(ctx, &m, st, dvb, dt, vw, 2 * 4 * GD, &check);
  }
  g_free(&m);
  free(k), free(v);
}

/* Index: one request of 256 keys in 4 blocks of 64 whose means are c_b e0, c = (3, 0, 1, 2); two query heads
 * on one KV head (g = 2), head 0 q = e0, head 1 q = 0.5 e0; scale ln 2, so l = c_b (head 0) and c_b / 2
 * (head 1) in log2 units and m_t = 3 wherever block 0 is scored. A row of position p contributes to a
 * scored block b iff prefix + p >= 64 b. With x = 2^-1.5, y = 2^-2.5, a tile with n positions all seeing
 * block b has S = n (2^(c_b-3) + 2^(c_b/2-3)): block 0: n (1 + x), block 1: n/4, block 2: n (1/4 + y),
 * block 3: 3n/4. */
typedef struct {
  const char *name;
  int32_t q_len, kv_len, block_m, sink, window, last_n;
  float alpha;
  int ntiles;
  double S[4][4];     /* per tile and block; 0 where unscored */
  int32_t kept[4][5]; /* per tile: count, then the blocks */
} index_golden;

#define GA 86.627416997969522  /* 64 (1 + x) */
#define GB 27.313708498984759  /* 64 (1/4 + y) */
static const index_golden index_goldens[] = {
    /* block_m 128: 64 positions a tile, every row of tile t sees blocks 0..t; window 1 keeps block t */
    {"golden: 4 tiles, alpha 0.3", 256, 256, 128, 0, 1, 0, 0.3f, 4,
     {{GA}, {GA, 16}, {GA, 16, GB}, {GA, 16, GB, 48}},
     {{1, 0}, {2, 0, 1}, {2, 0, 2}, {3, 0, 2, 3}}},
    /* sink 1, window 2, the last tile dense; alpha 0.6 keeps block 0 alone by score */
    {"golden: sink 1 window 2 last_n 1", 256, 256, 128, 1, 2, 1, 0.6f, 4,
     {{GA}, {GA, 16}, {GA, 16, GB}, {0}},
     {{1, 0}, {2, 0, 1}, {3, 0, 1, 2}, {4, 0, 1, 2, 3}}},
    /* block_m 256: 128 positions a tile. Tile 0 scores blocks 0, 1 (block 1 from its 64 rows at p >= 64);
     * tile 1 scores 0..3, block 3 from its 64 rows at p >= 192 only: S = 48, under alpha max = 51.98, kept
     * by the window alone */
    {"golden: rows see a block's first key", 256, 256, 256, 0, 1, 0, 0.3f, 2,
     {{2 * GA, 16}, {2 * GA, 32, 2 * GB, 48}},
     {{2, 0, 1}, {3, 0, 2, 3}}},
    /* a cached prefix of 128: 128 queries at positions 128..255 of the keys */
    {"golden: cached prefix 128", 128, 256, 128, 0, 1, 0, 0.3f, 2,
     {{GA, 16, GB}, {GA, 16, GB, 48}},
     {{2, 0, 2}, {3, 0, 2, 3}}},
};

static void golden_index(upf_verify_ctx *ctx, upf_dtype dt, const index_golden *gc) {
  gmem m = {.be = ctx->backend};
  const int32_t Hq = 2, nkb = 4, cu_q[2] = {0, gc->q_len}, cu_kv[2] = {0, gc->kv_len};
  double *q = calloc((size_t)gc->q_len * Hq * GD, sizeof *q), kb[4 * GD] = {0};
  static const double c[4] = {3, 0, 1, 2};
  for (int b = 0; b < 4; b++)
    kb[b * GD] = c[b];
  for (int32_t i = 0; q && i < gc->q_len; i++)
    q[(i * Hq) * GD] = 1.0, q[(i * Hq + 1) * GD] = 0.5;
  void *dq = NULL, *dkb = NULL, *dcq = NULL, *dckv = NULL, *drp = NULL, *dbl = NULL, *dsc = NULL;
  upf_status st = q ? g_vals(&m, dt, q, (int64_t)gc->q_len * Hq * GD, &dq) : upf_fail(UPF_ERR_NOMEM, "golden q");
  if (st == UPF_OK)
    st = g_vals(&m, dt, kb, 4 * GD, &dkb);
  if (st == UPF_OK)
    st = g_put(&m, cu_q, sizeof cu_q, &dcq);
  if (st == UPF_OK)
    st = g_put(&m, cu_kv, sizeof cu_kv, &dckv);
  if (st == UPF_OK)
    st = g_put(&m, NULL, (size_t)(gc->ntiles + 1) * 4, &drp);
  if (st == UPF_OK)
    st = g_put(&m, NULL, (size_t)(gc->ntiles * nkb) * 4, &dbl);
  if (st == UPF_OK)
    st = g_put(&m, NULL, (size_t)(gc->ntiles * nkb) * 4, &dsc);
  upf_sparse_index idx = {drp, dbl, dsc, -1};
  if (st == UPF_OK) {
    upf_sparse_params p = {gc->alpha, gc->block_m, 64, gc->sink, gc->window, gc->last_n, 0, 0, (float)M_LN2};
    upf_attn_varlen cb = {1, dcq, cu_q, dckv, cu_kv};
    upf_sparse_batch b = {&cb, NULL};
    const int64_t sq[3] = {gc->q_len, Hq, GD}, sm[4] = {1, nkb, 1, GD};
    upf_tensor tq, tkb;
    upf_tensor_init(&tq, dq, dt, 3, sq), upf_tensor_init(&tkb, dkb, dt, 4, sm);
    st = ctx->backend->sparse_index(&b, &tq, &tkb, &p, &idx);
  }
  char shape[96];
  snprintf(shape, sizeof shape, "hand-computed, q/kv=%d/%d g=2 bm=%d", gc->q_len, gc->kv_len, gc->block_m);
  upf_check check;
  upf_dense_check_init(&check, "sparse.index", gc->name, dt, "%s [scores]", shape);
  double want[16];
  for (int t = 0; t < gc->ntiles; t++)
    for (int b = 0; b < nkb; b++)
      want[t * nkb + b] = gc->S[t][b];
  /* the scores of the same (f32 or bf16-exact) inputs: the f32 tolerance either way */
  g_compare(ctx, &m, st, dsc, UPF_DTYPE_F32, want, (int64_t)gc->ntiles * nkb, &check);
  upf_dense_check_init(&check, "sparse.index", gc->name, dt, "%s [kept]", shape);
  int32_t rp[5], bl[16];
  if (st == UPF_OK)
    st = m.be->download(rp, drp, (size_t)(gc->ntiles + 1) * 4);
  if (st == UPF_OK)
    st = m.be->download(bl, dbl, (size_t)(gc->ntiles * nkb) * 4);
  if (st != UPF_OK) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  } else {
    check_begin(&check);
    int32_t want_rp[5] = {0}, want_bl[16];
    for (int t = 0; t < gc->ntiles; t++) {
      want_rp[t + 1] = want_rp[t] + gc->kept[t][0];
      for (int i = 0; i < gc->kept[t][0]; i++)
        want_bl[want_rp[t] + i] = gc->kept[t][1 + i];
    }
    if (idx.kept_total != want_rp[gc->ntiles])
      fail_detail(&check, "kept_total %lld, want %d", (long long)idx.kept_total, want_rp[gc->ntiles]);
    else if (memcmp(rp, want_rp, (size_t)(gc->ntiles + 1) * 4))
      fail_detail(&check, "row_ptr %d %d %d %d %d, want %d %d %d %d %d", rp[0], rp[1], rp[2],
                  gc->ntiles > 2 ? rp[3] : 0, gc->ntiles > 3 ? rp[4] : 0, want_rp[0], want_rp[1], want_rp[2],
                  want_rp[3], want_rp[4]);
    else
      upf_compare_exact(bl, want_bl, want_rp[gc->ntiles], 4, &check);
  }
  upf_verify_record(ctx, &check);
  g_free(&m);
  free(q);
}

/* Attention: one request of 128 queries and keys (g = 1, D = 64, scale 1), block_m 64: tile 0 keeps block 0,
 * tile 1 block 1 only (the index given by hand). q = e0; keys of block 0 are e0 (logit 1), of block 1 zero
 * (logit 0); v_j = j e0 + e1. Row p < 64 averages keys 0..p: (p/2, 1). Row p >= 64 without correction
 * averages keys 64..p: ((64 + p)/2, 1). With correction block 0 returns as one term of logit 1 + ln 64 and
 * value vbar_0 = 31.5 e0 + e1, which for constant keys is the dense answer exactly:
 * ((2016 e + (p - 63)(64 + p)/2) / (64 e + p - 63), 1). */
static void golden_attention(upf_verify_ctx *ctx, upf_dtype dt, int mean_correction) {
  gmem m = {.be = ctx->backend};
  enum { N = 128 };
  const int32_t cu[2] = {0, N}, rp[3] = {0, 1, 2}, bl[2] = {0, 1};
  double *q = calloc(N * GD, sizeof *q), *k = calloc(N * GD, sizeof *k), *v = calloc(N * GD, sizeof *v);
  double *want = calloc(N * GD, sizeof *want), kb[2 * GD] = {0}, vb[2 * GD] = {0};
  const double e = exp(1.0);
  for (int j = 0; q && k && v && want && j < N; j++) {
    q[j * GD] = 1.0, k[j * GD] = j < 64 ? 1.0 : 0.0, v[j * GD] = j, v[j * GD + 1] = 1.0;
    want[j * GD + 1] = 1.0;
    if (j < 64)
      want[j * GD] = j / 2.0;
    else if (!mean_correction)
      want[j * GD] = (64.0 + j) / 2.0;
    else
      want[j * GD] = (2016.0 * e + (j - 63.0) * (64.0 + j) / 2.0) / (64.0 * e + j - 63.0);
  }
  kb[0] = 1.0, vb[0] = 31.5, vb[1] = 1.0, vb[GD] = 95.5, vb[GD + 1] = 1.0;
  void *dq = NULL, *dk = NULL, *dv = NULL, *dkb = NULL, *dvb = NULL, *dcu = NULL, *drp = NULL, *dbl = NULL;
  void *dout = NULL;
  upf_status st = q && k && v && want ? g_vals(&m, dt, q, N * GD, &dq) : upf_fail(UPF_ERR_NOMEM, "golden attention");
  if (st == UPF_OK)
    st = g_vals(&m, dt, k, N * GD, &dk);
  if (st == UPF_OK)
    st = g_vals(&m, dt, v, N * GD, &dv);
  if (st == UPF_OK)
    st = g_vals(&m, dt, kb, 2 * GD, &dkb);
  if (st == UPF_OK)
    st = g_vals(&m, dt, vb, 2 * GD, &dvb);
  if (st == UPF_OK)
    st = g_put(&m, cu, sizeof cu, &dcu);
  if (st == UPF_OK)
    st = g_put(&m, rp, sizeof rp, &drp);
  if (st == UPF_OK)
    st = g_put(&m, bl, sizeof bl, &dbl);
  if (st == UPF_OK)
    st = g_put(&m, NULL, N * GD * upf_dtype_size(dt), &dout);
  if (st == UPF_OK) {
    upf_sparse_params p = {1.0f, 64, 64, 0, 1, 0, 0, mean_correction, 1.0f};
    upf_attn_varlen cb = {1, dcu, cu, dcu, cu};
    upf_sparse_batch b = {&cb, NULL};
    upf_sparse_index idx = {drp, dbl, NULL, 2};
    const int64_t s3[3] = {N, 1, GD}, sm[4] = {1, 2, 1, GD};
    upf_tensor tq, tk, tv, tkb, tvb, to;
    upf_tensor_init(&tq, dq, dt, 3, s3), upf_tensor_init(&tk, dk, dt, 3, s3), upf_tensor_init(&tv, dv, dt, 3, s3);
    upf_tensor_init(&tkb, dkb, dt, 4, sm), upf_tensor_init(&tvb, dvb, dt, 4, sm), upf_tensor_init(&to, dout, dt, 3, s3);
    st = ctx->backend->attn_block_sparse(&b, &tq, &tk, &tv, &p, &idx, mean_correction ? &tkb : NULL,
                                         mean_correction ? &tvb : NULL, &to);
  }
  upf_check check;
  upf_dense_check_init(&check, "attn.block_sparse",
                       mean_correction ? "golden: block 0 dropped, mean corr = dense" : "golden: block 0 dropped",
                       dt, "hand-computed, T=128 D=64 bm=bn=64");
  g_compare(ctx, &m, st, dout, dt, want, N * GD, &check);
  g_free(&m);
  free(q), free(k), free(v), free(want);
}

/* ================================================================================================ */
/* Bad inputs: each must come back as its status on the backend under test.                         */

static void errors_for(upf_verify_ctx *ctx, upf_op op) {
  const upf_backend *be = ctx->backend;
  const char *name = upf_op_name(op);
  void *buf = NULL;
  if (be->alloc(&buf, 65536 * sizeof(float)) != UPF_OK) {
    record_failure(ctx, name, "errors", UPF_DTYPE_F32, UPF_ERR_NOMEM, "setup");
    return;
  }
  be->fill(buf, 0, 65536 * sizeof(float));
  int32_t *dev = buf; /* zeros: only the host copies are read before the checks fail */
  const int64_t sq[3] = {4, 4, 64}, skv[3] = {4, 2, 64}, sk3[3] = {4, 3, 64}, sm[4] = {2, 1, 2, 64},
                sm2[4] = {2, 2, 2, 64}, sm3[4] = {2, 1, 3, 64}, so[3] = {4, 4, 32}, sc[4] = {4, 2, 2, 64};
  upf_tensor q, k, v, kb, vb, o, kc, vc;
  upf_tensor_init(&q, buf, UPF_DTYPE_F32, 3, sq), upf_tensor_init(&o, buf, UPF_DTYPE_F32, 3, sq);
  upf_tensor_init(&k, buf, UPF_DTYPE_F32, 3, skv), upf_tensor_init(&v, buf, UPF_DTYPE_F32, 3, skv);
  upf_tensor_init(&kb, buf, UPF_DTYPE_F32, 4, sm), upf_tensor_init(&vb, buf, UPF_DTYPE_F32, 4, sm);
  upf_tensor_init(&kc, buf, UPF_DTYPE_F32, 4, sc), upf_tensor_init(&vc, buf, UPF_DTYPE_F32, 4, sc);
  const int32_t cu[3] = {0, 2, 4}, cu_bad[3] = {0, 3, 2}, cu_short[3] = {0, 1, 4}, kv_lens[2] = {2, 4};
  const int32_t bt_bad[4] = {0, 1, 3, 4};
  upf_attn_varlen cb = {2, dev, cu, dev, cu};
  upf_attn_paged pb = {2, dev, cu, dev, kv_lens, dev, bt_bad, 2, 2};
  upf_sparse_batch b = {&cb, NULL}, both = {&cb, &pb}, bp = {NULL, &pb};
  upf_sparse_params p = upf_sparse_params_default();
  upf_sparse_index idx = {dev, dev, NULL, 0};
  switch (op) {
  case UPF_OP_SPARSE_BLOCK_MEANS: {
    p.block_n = 96;
    upf_verify_expect_status(ctx, name, "block_n 96", be->sparse_block_means(&b, &k, &v, &p, &kb, &vb),
                             UPF_ERR_INVALID_ARG);
    p = upf_sparse_params_default();
    upf_tensor kb2, kbh;
    upf_tensor_init(&kb2, buf, UPF_DTYPE_F32, 4, sm2), upf_tensor_init(&kbh, buf, UPF_DTYPE_BF16, 4, sm);
    upf_verify_expect_status(ctx, name, "kbar of 2 key blocks, the plan has 1",
                             be->sparse_block_means(&b, &k, &v, &p, &kb2, &vb), UPF_ERR_SHAPE);
    upf_verify_expect_status(ctx, name, "kbar bf16, k f32", be->sparse_block_means(&b, &k, &v, &p, &kbh, NULL),
                             UPF_ERR_DTYPE);
    upf_verify_expect_status(ctx, name, "both contiguous and paged K/V",
                             be->sparse_block_means(&both, &k, &v, &p, &kb, &vb), UPF_ERR_INVALID_ARG);
    cb.cu_seqlens_kv_host = cu_bad;
    upf_verify_expect_status(ctx, name, "cu_seqlens_kv not monotone", be->sparse_block_means(&b, &k, &v, &p, &kb, &vb),
                             UPF_ERR_CU_SEQLENS);
    cb.cu_seqlens_kv_host = cu;
    upf_verify_expect_status(ctx, name, "block_table[1][1]=4 outside 4 pages",
                             be->sparse_block_means(&bp, &kc, &vc, &p, &kb, &vb), UPF_ERR_INVALID_ARG);
    break;
  }
  case UPF_OP_SPARSE_INDEX: {
    p.alpha = 1.5f;
    upf_verify_expect_status(ctx, name, "alpha 1.5", be->sparse_index(&b, &q, &kb, &p, &idx), UPF_ERR_INVALID_ARG);
    p.alpha = 0.5f, p.block_m = 24;
    upf_verify_expect_status(ctx, name, "block_m 24", be->sparse_index(&b, &q, &kb, &p, &idx), UPF_ERR_INVALID_ARG);
    p.block_m = 128, p.window = 0;
    upf_verify_expect_status(ctx, name, "window 0", be->sparse_index(&b, &q, &kb, &p, &idx), UPF_ERR_INVALID_ARG);
    p.window = 4;
    upf_tensor kb3;
    upf_tensor_init(&kb3, buf, UPF_DTYPE_F32, 4, sm3);
    upf_verify_expect_status(ctx, name, "Hq=4 not a multiple of Hkv=3 (kbar)", be->sparse_index(&b, &q, &kb3, &p, &idx),
                             UPF_ERR_SHAPE);
    cb.cu_seqlens_q_host = cu_bad;
    upf_verify_expect_status(ctx, name, "cu_seqlens_q not monotone", be->sparse_index(&b, &q, &kb, &p, &idx),
                             UPF_ERR_CU_SEQLENS);
    cb.cu_seqlens_q_host = cu, cb.cu_seqlens_kv_host = cu_short;
    upf_verify_expect_status(ctx, name, "kv_len 1 < q_len 2", be->sparse_index(&b, &q, &kb, &p, &idx),
                             UPF_ERR_CU_SEQLENS);
    break;
  }
  case UPF_OP_ATTN_BLOCK_SPARSE: {
    p.mean_correction = 1;
    upf_verify_expect_status(ctx, name, "mean correction without kbar, vbar",
                             be->attn_block_sparse(&b, &q, &k, &v, &p, &idx, NULL, NULL, &o), UPF_ERR_INVALID_ARG);
    p.mean_correction = 0;
    upf_tensor k3, vh, o2;
    upf_tensor_init(&k3, buf, UPF_DTYPE_F32, 3, sk3), upf_tensor_init(&vh, buf, UPF_DTYPE_BF16, 3, skv);
    upf_tensor_init(&o2, buf, UPF_DTYPE_F32, 3, so);
    upf_verify_expect_status(ctx, name, "Hq=4 not a multiple of Hkv=3",
                             be->attn_block_sparse(&b, &q, &k3, &k3, &p, &idx, NULL, NULL, &o), UPF_ERR_SHAPE);
    upf_verify_expect_status(ctx, name, "v bf16, k f32",
                             be->attn_block_sparse(&b, &q, &k, &vh, &p, &idx, NULL, NULL, &o), UPF_ERR_DTYPE);
    upf_verify_expect_status(ctx, name, "out (Tq, Hq, 32) with D=64",
                             be->attn_block_sparse(&b, &q, &k, &v, &p, &idx, NULL, NULL, &o2), UPF_ERR_SHAPE);
    p.scale = NAN;
    upf_verify_expect_status(ctx, name, "scale NaN", be->attn_block_sparse(&b, &q, &k, &v, &p, &idx, NULL, NULL, &o),
                             UPF_ERR_INVALID_ARG);
    p.scale = 0.0f, cb.cu_seqlens_kv_host = cu_short;
    upf_verify_expect_status(ctx, name, "kv_len 1 < q_len 2",
                             be->attn_block_sparse(&b, &q, &k, &v, &p, &idx, NULL, NULL, &o), UPF_ERR_CU_SEQLENS);
    cb.cu_seqlens_kv_host = cu;
    upf_verify_expect_status(ctx, name, "NULL index", be->attn_block_sparse(&b, &q, &k, &v, &p, NULL, NULL, NULL, &o),
                             UPF_ERR_INVALID_ARG);
    break;
  }
  default:
    break;
  }
  be->release(buf);
}

/* ================================================================================================ */
/* The reference's own checks: oracle, invariants, paged == contiguous, dense, correction.          */

static void record_run_failure(upf_verify_ctx *ctx, const sparse_run *sr, const char *op, const char *what,
                               upf_status st) {
  upf_check check;
  run_check_init(sr, op, NULL, &check);
  check.passed = 0;
  snprintf(check.detail, sizeof check.detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, &check);
}

/* The reference's attention over the run's own index into out (dt). */
static upf_status ref_attention(const sparse_run *sr, const upf_sparse_params *p, void *out) {
  upf_tensor tq, tk, tv, tkb, tvb, to;
  run_qkv(sr, sr->q, sr->k, sr->v, &tq, &tk, &tv);
  run_means_tensor(sr, sr->kbar, &tkb), run_means_tensor(sr, sr->vbar, &tvb);
  upf_tensor_init(&to, out, sr->dt, 3, tq.shape);
  upf_sparse_index idx = {sr->row_ptr, sr->blocks, NULL, sr->kept_total};
  return upf_backend_cpu()->attn_block_sparse(&sr->batch, &tq, &tk, &tv, p, &idx, p->mean_correction ? &tkb : NULL,
                                              p->mean_correction ? &tvb : NULL, &to);
}

static float *to_floats(const void *x, upf_dtype dt, int64_t n) {
  float *y = malloc((size_t)(n ? n : 1) * sizeof *y);
  for (int64_t i = 0; y && i < n; i++)
    y[i] = (float)elem_get(x, dt, i);
  return y;
}

static void compare_to_double(upf_verify_ctx *ctx, const sparse_run *sr, const char *op, const char *what,
                              const void *got, const double *want, int64_t n) {
  upf_check check;
  run_check_init(sr, op, what, &check);
  float *g = to_floats(got, sr->dt, n);
  if (!g) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "no memory");
  } else {
    upf_compare_f32(g, want, n, upf_tolerance_for(sr->dt), &check);
  }
  upf_verify_record(ctx, &check);
  free(g);
}

static void ref_means_checks(upf_verify_ctx *ctx, const sparse_run *sr, const sparse_run *cont) {
  const char *op = "sparse.block_means";
  double *kb = malloc((size_t)sr->means_numel * sizeof *kb + 1), *vb = malloc((size_t)sr->means_numel * sizeof *vb + 1);
  if (kb && vb && !cont) {
    oracle_means(sr, kb, vb);
    compare_to_double(ctx, sr, op, "oracle [kbar]", sr->kbar, kb, sr->means_numel);
    compare_to_double(ctx, sr, op, "oracle [vbar]", sr->vbar, vb, sr->means_numel);
  }
  free(kb), free(vb);
  if (cont) {
    upf_check check;
    run_check_init(sr, op, "paged == contiguous", &check);
    const size_t bytes = (size_t)sr->means_numel * upf_dtype_size(sr->dt);
    upf_compare_exact(sr->kbar, cont->kbar, (int64_t)bytes, 1, &check);
    if (check.passed)
      upf_compare_exact(sr->vbar, cont->vbar, (int64_t)bytes, 1, &check);
    upf_verify_record(ctx, &check);
  }
}

static void ref_index_checks(upf_verify_ctx *ctx, const sparse_run *sr, const sparse_run *cont) {
  const char *op = "sparse.index";
  const int64_t S = run_segments(sr), nkb = run_nkb(sr);
  const double tau = upf_select_tau(sr->dt);
  upf_check check;
  run_check_init(sr, op, "invariants", &check);
  index_invariants(sr, sr->row_ptr, sr->blocks, sr->scores, sr->kept_total, tau, &check);
  upf_verify_record(ctx, &check);
  double *S_or = malloc((size_t)(S * nkb) * sizeof *S_or + 1);
  uint8_t *keep = malloc((size_t)(S * nkb) + 1);
  float *sc = malloc((size_t)(S * nkb) * sizeof *sc + 1);
  if (S_or && keep && sc && !cont) {
    oracle_index(sr, S_or, keep);
    run_check_init(sr, op, "oracle [scores]", &check);
    for (int64_t i = 0; i < S * nkb; i++)
      sc[i] = sr->scores[i];
    upf_compare_f32(sc, S_or, S * nkb, upf_tolerance_for(UPF_DTYPE_F32), &check);
    upf_verify_record(ctx, &check);
    /* the oracle's decisions as a CSR, compared like a backend's */
    int32_t *rp = malloc((size_t)(S + 1) * sizeof *rp), *bl = malloc((size_t)(S * nkb) * sizeof *bl + 1);
    run_check_init(sr, op, "oracle [decisions]", &check);
    if (rp && bl) {
      rp[0] = 0;
      for (int64_t s = 0; s < S; s++) {
        rp[s + 1] = rp[s];
        for (int64_t b = 0; b < nkb; b++)
          if (keep[s * nkb + b])
            bl[rp[s + 1]++] = (int32_t)b;
      }
      compare_decisions(sr, rp, bl, rp[S], tau, &check);
      upf_verify_record(ctx, &check);
    }
    free(rp), free(bl);
  }
  free(S_or), free(keep), free(sc);
  if (cont) {
    run_check_init(sr, op, "paged == contiguous", &check);
    if (sr->kept_total != cont->kept_total) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "kept_total %lld, contiguous %lld", (long long)sr->kept_total,
               (long long)cont->kept_total);
    } else {
      upf_compare_exact(sr->row_ptr, cont->row_ptr, S + 1, 4, &check);
      if (check.passed)
        upf_compare_exact(sr->blocks, cont->blocks, sr->kept_total, 4, &check);
      if (check.passed)
        upf_compare_exact(sr->scores, cont->scores, S * nkb, 4, &check);
    }
    upf_verify_record(ctx, &check);
  }
}

/* alpha 0 (every visible block kept, so nothing to correct) equals dense attn.prefill; mean correction
 * brings the output of an index that drops blocks closer to dense than the same index without it. */
static void ref_attention_checks(upf_verify_ctx *ctx, sparse_run *sr, const sparse_run *cont) {
  const char *op = "attn.block_sparse";
  const sparse_case *c = sr->c;
  const int64_t n = sr->tq * c->hq * c->d;
  const size_t bytes = (size_t)n * upf_dtype_size(sr->dt);
  void *out = malloc(bytes + 1), *out2 = malloc(bytes + 1), *out3 = malloc(bytes + 1);
  double *want = malloc((size_t)n * sizeof *want + 1);
  upf_status st = out && out2 && out3 && want ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "attention outputs");
  upf_sparse_params p = sr->p;
  if (st == UPF_OK)
    st = ref_attention(sr, &p, out);
  if (st == UPF_OK && !cont)
    st = oracle_attention(sr, &p, sr->row_ptr, sr->blocks, want);
  if (st != UPF_OK) {
    record_run_failure(ctx, sr, op, "reference", st);
    free(out), free(out2), free(out3), free(want);
    return;
  }
  if (cont) {
    upf_check check;
    run_check_init(sr, op, "paged == contiguous", &check);
    st = ref_attention(cont, &p, out2);
    if (st == UPF_OK)
      upf_compare_exact(out, out2, (int64_t)bytes, 1, &check);
    else
      check.passed = 0, snprintf(check.detail, sizeof check.detail, "contiguous: %.200s", upf_last_error());
    upf_verify_record(ctx, &check);
    free(out), free(out2), free(out3), free(want);
    return;
  }
  compare_to_double(ctx, sr, op, p.mean_correction ? "oracle, mean corr" : "oracle", out, want, n);
  /* dense: attn.prefill over the contiguous K/V (the run is contiguous here) against alpha 0 */
  upf_check check;
  {
    sparse_run dense = *sr;
    int32_t *rp = malloc((size_t)(run_segments(sr) + 1) * sizeof *rp);
    int32_t *bl = malloc((size_t)(run_segments(sr) * run_nkb(sr)) * sizeof *bl + 1);
    run_check_init(sr, op, "alpha 0 == dense attn.prefill", &check);
    st = rp && bl ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "index");
    dense.p.alpha = 0.0f, dense.row_ptr = rp, dense.blocks = bl;
    if (st == UPF_OK) {
      upf_tensor tq, tk, tv, tkb, to;
      run_qkv(sr, sr->q, sr->k, sr->v, &tq, &tk, &tv);
      run_means_tensor(sr, sr->kbar, &tkb);
      upf_sparse_index idx = {rp, bl, NULL, -1};
      st = upf_backend_cpu()->sparse_index(&sr->batch, &tq, &tkb, &dense.p, &idx);
      dense.kept_total = idx.kept_total;
      if (st == UPF_OK && idx.kept_total != upf_sparse_visible_blocks(&sr->batch, &sr->plan, &dense.p))
        st = upf_fail(UPF_ERR_INVALID_ARG, "alpha 0 kept %lld of %lld visible blocks", (long long)idx.kept_total,
                      (long long)upf_sparse_visible_blocks(&sr->batch, &sr->plan, &dense.p));
      if (st == UPF_OK)
        st = ref_attention(&dense, &dense.p, out3);
      upf_tensor_init(&to, out2, sr->dt, 3, tq.shape);
      upf_attn_params ap = {0.0f, 0.0f, 0};
      if (st == UPF_OK)
        st = upf_backend_cpu()->attn_prefill(&sr->cont, &tq, &tk, &tv, &ap, &to, NULL);
    }
    if (st == UPF_OK) {
      float *a = to_floats(out3, sr->dt, n);
      for (int64_t i = 0; a && i < n; i++)
        want[i] = elem_get(out2, sr->dt, i);
      if (a)
        upf_compare_f32(a, want, n, upf_tolerance_for(sr->dt), &check);
      else
        check.passed = 0;
      free(a);
    } else {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
    }
    upf_verify_record(ctx, &check);
    free(rp), free(bl);
  }
  /* correction: the run's own index (alpha > 0 drops cold blocks), with and without, against dense (out2);
   * the run's own setting is out already, the other goes to out3 */
  if (st == UPF_OK && sr->p.alpha > 0.0f) {
    void *corr = sr->p.mean_correction ? out : out3, *none = sr->p.mean_correction ? out3 : out;
    upf_sparse_params other = sr->p;
    other.mean_correction = !sr->p.mean_correction;
    run_check_init(sr, op, "mean corr closer to dense", &check);
    st = ref_attention(sr, &other, out3);
    if (st == UPF_OK) {
      double ec = 0.0, en = 0.0, d2 = 0.0;
      for (int64_t i = 0; i < n; i++) {
        const double d = elem_get(out2, sr->dt, i);
        ec += pow(elem_get(corr, sr->dt, i) - d, 2), en += pow(elem_get(none, sr->dt, i) - d, 2), d2 += d * d;
      }
      check.nmse = ec / d2, check.max_abs_err = 0.0, check.budget = en > 0.0 ? ec / en : INFINITY;
      check.passed = ec < en;
      snprintf(check.detail, sizeof check.detail,
               "nmse vs dense: corrected %.3g, uncorrected %.3g (%lld of %lld blocks kept)", ec / d2, en / d2,
               (long long)sr->kept_total, (long long)upf_sparse_visible_blocks(&sr->batch, &sr->plan, &sr->p));
    } else {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
    }
    upf_verify_record(ctx, &check);
  }
  free(out), free(out2), free(out3), free(want);
}

/* Every reference case, contiguous (against the oracle) then paged (bit for bit the contiguous run), both
 * dtypes. */
static void reference_checks(upf_verify_ctx *ctx, upf_op op) {
  const char *name = upf_op_name(op);
  for (int i = 0; i < NCASES(ref_cases); i++)
    for (int d = 0; d < (ctx->quick ? 1 : 2); d++) { /* quick (Valgrind): f32 only; bf16 in the full set */
      const sparse_case *c = &ref_cases[i];
      const uint64_t seed = upf_verify_case_seed("sparse.reference", i, (uint64_t)both_dtypes[d]);
      sparse_run cont, paged;
      upf_status st = run_inputs(&cont, c, both_dtypes[d], 0, seed);
      if (st == UPF_OK)
        st = run_reference(&cont, op != UPF_OP_SPARSE_BLOCK_MEANS);
      if (st != UPF_OK) {
        record_run_failure(ctx, &cont, name, "reference", st);
        run_free(&cont);
        continue;
      }
      st = run_inputs(&paged, c, both_dtypes[d], c->page, seed);
      if (st == UPF_OK)
        st = run_reference(&paged, op != UPF_OP_SPARSE_BLOCK_MEANS);
      if (op == UPF_OP_SPARSE_BLOCK_MEANS) {
        ref_means_checks(ctx, &cont, NULL);
        if (st == UPF_OK)
          ref_means_checks(ctx, &paged, &cont);
      } else if (op == UPF_OP_SPARSE_INDEX) {
        ref_index_checks(ctx, &cont, NULL);
        if (st == UPF_OK)
          ref_index_checks(ctx, &paged, &cont);
      } else {
        ref_attention_checks(ctx, &cont, NULL);
        if (st == UPF_OK)
          ref_attention_checks(ctx, &paged, &cont);
      }
      if (st != UPF_OK)
        record_run_failure(ctx, &paged, name, "reference (paged)", st);
      run_free(&cont), run_free(&paged);
    }
}

/* ================================================================================================ */
/* Seeded cases on a backend under test.                                                            */

/* The dcase buffers of a run: q, k, v, ints (cu_q and cu_kv, or cu_q and kv_lens), the block table when
 * paged, the index (row_ptr, blocks), the means (kbar, vbar), the output(s). -1: absent. */
typedef struct {
  const sparse_run *sr;
  upf_sparse_params p;
  int q, k, v, ints, bt, index, means, kbar, vbar, out;
} dcase_map;

static void view_batch(const dcase_map *x, upf_dviews v, upf_attn_varlen *cont, upf_attn_paged *paged,
                       upf_sparse_batch *b) {
  const sparse_run *sr = x->sr;
  if (sr->page) {
    *paged = (upf_attn_paged){sr->nreq,    v[x->ints][0].data, sr->cu_q, v[x->ints][1].data, sr->kv_lens,
                              v[x->bt][0].data, sr->block_table, sr->max_blocks, sr->page};
    *b = (upf_sparse_batch){NULL, paged};
  } else {
    *cont = (upf_attn_varlen){sr->nreq, v[x->ints][0].data, sr->cu_q, v[x->ints][1].data, sr->cu_kv};
    *b = (upf_sparse_batch){cont, NULL};
  }
}

static upf_status means_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const dcase_map *x = ctx;
  upf_attn_varlen cont;
  upf_attn_paged paged;
  upf_sparse_batch b;
  view_batch(x, v, &cont, &paged, &b);
  return be->sparse_block_means(&b, &v[x->k][0], &v[x->v][0], &x->p, &v[x->kbar][0],
                                x->vbar >= 0 ? &v[x->vbar][0] : NULL);
}

static upf_status attn_fn(const upf_backend *be, upf_dviews v, const void *ctx) {
  const dcase_map *x = ctx;
  upf_attn_varlen cont;
  upf_attn_paged paged;
  upf_sparse_batch b;
  view_batch(x, v, &cont, &paged, &b);
  upf_sparse_index idx = {v[x->index][0].data, v[x->index][1].data, NULL, x->sr->kept_total};
  return be->attn_block_sparse(&b, &v[x->q][0], &v[x->k][0], &v[x->v][0], &x->p, &idx,
                               x->means >= 0 ? &v[x->means][0] : NULL, x->means >= 0 ? &v[x->means][1] : NULL,
                               &v[x->out][0]);
}

/* The fp64 truth of the long-reduction rule: the reference (double inside, one rounding at the end) on the
 * same values held as f32, so the truth carries f32's rounding (2^-24) instead of the dtype's. */
static upf_status attn_truth(upf_dviews v, const void *ctx, double *truth) {
  const dcase_map *x = ctx;
  upf_dviews w;
  memcpy(w, v, sizeof w);
  float *copies[5] = {0};
  const int bufs[5][2] = {{x->q, 0}, {x->k, 0}, {x->v, 0}, {x->means, 0}, {x->means, 1}};
  upf_status st = UPF_OK;
  for (int i = 0; st == UPF_OK && i < 5; i++) {
    if (bufs[i][0] < 0)
      continue;
    upf_tensor *t = &w[bufs[i][0]][bufs[i][1]];
    const int64_t n = upf_tensor_numel(t);
    copies[i] = to_floats(t->data, t->dtype, n);
    if (!copies[i])
      st = upf_fail(UPF_ERR_NOMEM, "truth copies");
    else
      t->data = copies[i], t->dtype = UPF_DTYPE_F32;
  }
  upf_tensor *o = &w[x->out][0];
  const int64_t n = upf_tensor_numel(o);
  float *out = malloc((size_t)n * sizeof *out + 1);
  if (st == UPF_OK && !out)
    st = upf_fail(UPF_ERR_NOMEM, "truth output");
  if (st == UPF_OK) {
    o->data = out, o->dtype = UPF_DTYPE_F32;
    st = attn_fn(upf_backend_cpu(), w, ctx);
  }
  for (int64_t i = 0; st == UPF_OK && i < n; i++)
    truth[i] = out[i];
  for (int i = 0; i < 5; i++)
    free(copies[i]);
  free(out);
  return st;
}

static void set_ints(upf_dbuf *b, int64_t at, const int32_t *vals, int64_t n) {
  memcpy((int32_t *)b->host + at, vals, (size_t)n * sizeof *vals);
}

/* Adds q (when want_q), k, v, the ints and the block table of the run to dc; fills x. 0: out of memory. */
static int add_inputs(upf_dcase *dc, const sparse_run *sr, int want_q, dcase_map *x) {
  const sparse_case *c = sr->c;
  const size_t es = upf_dtype_size(sr->dt);
  memset(x, -1, sizeof *x);
  x->sr = sr, x->p = sr->p;
  upf_tensor tq, tk, tv;
  run_qkv(sr, NULL, NULL, NULL, &tq, &tk, &tv);
  upf_dbuf *b;
  if (want_q) {
    x->q = dc->nbufs;
    if (!(b = upf_dcase_add(dc, "q", sr->dt, sr->tq * c->hq * c->d, 0)))
      return 0;
    upf_dbuf_view(b, 0, "q", 3, tq.shape, NULL, 0);
    memcpy(b->host, sr->q, (size_t)b->numel * es);
  }
  x->k = dc->nbufs;
  if (!(b = upf_dcase_add(dc, sr->page ? "k_cache" : "k", sr->dt, sr->kv_numel, 0)))
    return 0;
  upf_dbuf_view(b, 0, b->name, tk.ndim, tk.shape, NULL, 0);
  memcpy(b->host, sr->k, (size_t)b->numel * es);
  x->v = dc->nbufs;
  if (!(b = upf_dcase_add(dc, sr->page ? "v_cache" : "v", sr->dt, sr->kv_numel, 0)))
    return 0;
  upf_dbuf_view(b, 0, b->name, tv.ndim, tv.shape, NULL, 0);
  memcpy(b->host, sr->v, (size_t)b->numel * es);
  x->ints = dc->nbufs;
  const int64_t B = sr->nreq, n0 = B + 1, n1 = sr->page ? B : B + 1;
  if (!(b = upf_dcase_add(dc, "cu_seqlens", UPF_DTYPE_I32, n0 + n1, 0)))
    return 0;
  upf_dbuf_view(b, 0, "cu_seqlens_q", 1, &n0, NULL, 0);
  upf_dbuf_view(b, 1, sr->page ? "kv_lens" : "cu_seqlens_kv", 1, &n1, NULL, n0);
  set_ints(b, 0, sr->cu_q, n0);
  set_ints(b, n0, sr->page ? sr->kv_lens : sr->cu_kv, n1);
  if (sr->page) {
    const int64_t n = B * (sr->max_blocks ? sr->max_blocks : 1);
    x->bt = dc->nbufs;
    if (!(b = upf_dcase_add(dc, "block_table", UPF_DTYPE_I32, n, 0)))
      return 0;
    set_ints(b, 0, sr->block_table, n);
  }
  return 1;
}

static void means_case(upf_verify_ctx *ctx, sparse_run *sr) {
  const char *op = "sparse.block_means";
  upf_dcase dc;
  upf_dcase_init(&dc, sr->dt);
  dcase_map x;
  upf_tensor tm;
  run_means_tensor(sr, NULL, &tm);
  int ok = add_inputs(&dc, sr, 0, &x);
  upf_dbuf *b = NULL;
  if (ok) {
    x.kbar = dc.nbufs;
    ok = (b = upf_dcase_add(&dc, "kbar", sr->dt, sr->means_numel, 1)) != NULL;
    if (ok)
      upf_dbuf_view(b, 0, "kbar", 4, tm.shape, NULL, 0), upf_dbuf_fill_poison(b);
  }
  if (ok && sr->c->mean_correction) { /* vbar only where the case corrects: the NULL path otherwise */
    x.vbar = dc.nbufs;
    ok = (b = upf_dcase_add(&dc, "vbar", sr->dt, sr->means_numel, 1)) != NULL;
    if (ok)
      upf_dbuf_view(b, 0, "vbar", 4, tm.shape, NULL, 0), upf_dbuf_fill_poison(b);
  }
  upf_check proto;
  run_check_init(sr, op, x.vbar >= 0 ? "kbar+vbar" : "kbar alone", &proto);
  if (!ok)
    record_run_failure(ctx, sr, op, "setup", upf_fail(UPF_ERR_NOMEM, "case buffers"));
  else
    upf_dcase_verify(ctx, &dc, means_fn, NULL, &x, &proto);
  upf_dcase_free(&dc);
}

/* The fp8 variant's kernel takes the case (bf16, D = 128, attn.block_sparse=fp8 in effect). */
static int fp8_case(const sparse_run *sr) {
  upf_variant v;
  return sr->dt == UPF_DTYPE_BF16 && sr->c->d == 128 && upf_variant_current(UPF_OP_ATTN_BLOCK_SPARSE, &v) == UPF_OK &&
         v == UPF_VARIANT_ATTN_BLOCK_SPARSE_FP8;
}

/* max |x| of n bf16 values from x, stride 1, NaN (the cache's unowned slots) skipped. */
static float bf16_amax(const uint16_t *x, int64_t n, float m) {
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(upf_bf16_to_f32(x[i]));
    m = a > m ? a : m;
  }
  return m;
}

static void bf16_snap(uint16_t *x, int64_t n, float s) {
  for (int64_t i = 0; i < n; i++)
    x[i] = upf_bf16_from_f32(s * upf_fp8_e4m3_round(upf_bf16_to_f32(x[i]) / s));
}

/* Puts the case's q, k, v and means on the E4M3 grid of the power-of-two scales the fp8 kernel will take
 * (q; k with the means of each request's blocks; v with theirs): its quantisation then loses nothing, and
 * the check sees the FP8 products alone. */
static void fp8_snap(upf_dcase *dc, const dcase_map *x, const sparse_run *sr) {
  const sparse_case *c = sr->c;
  const int64_t nq = sr->tq * c->hq * c->d, row = (int64_t)c->hkv * c->d, nkb = run_nkb(sr);
  uint16_t *q = dc->buf[x->q].host, *k = dc->buf[x->k].host, *v = dc->buf[x->v].host;
  uint16_t *kb = x->means >= 0 ? dc->buf[x->means].host : NULL, *vb = kb ? kb + sr->means_numel : NULL;
  float mk = bf16_amax(k, sr->kv_numel, 0.0f), mv = bf16_amax(v, sr->kv_numel, 0.0f);
  for (int r = 0; kb && r < sr->nreq; r++) {
    const int64_t at = (int64_t)r * nkb * row, n = (sr->kv_lens[r] + c->block_n - 1) / c->block_n * row;
    mk = bf16_amax(kb + at, n, mk), mv = bf16_amax(vb + at, n, mv);
  }
  bf16_snap(q, nq, upf_fp8_pow2_scale(bf16_amax(q, nq, 0.0f)));
  bf16_snap(k, sr->kv_numel, upf_fp8_pow2_scale(mk)), bf16_snap(v, sr->kv_numel, upf_fp8_pow2_scale(mv));
  if (kb)
    bf16_snap(kb, sr->means_numel, upf_fp8_pow2_scale(mk)), bf16_snap(vb, sr->means_numel, upf_fp8_pow2_scale(mv));
}

static void attention_case(upf_verify_ctx *ctx, sparse_run *sr) {
  const char *op = "attn.block_sparse";
  const sparse_case *c = sr->c;
  upf_dcase dc;
  upf_dcase_init(&dc, sr->dt);
  dcase_map x;
  int ok = add_inputs(&dc, sr, 1, &x);
  upf_dbuf *b = NULL;
  const int64_t S = run_segments(sr), nrp = S + 1, nbl = sr->kept_total;
  if (ok) {
    x.index = dc.nbufs;
    ok = (b = upf_dcase_add(&dc, "index", UPF_DTYPE_I32, nrp + nbl, 0)) != NULL;
    if (ok) {
      upf_dbuf_view(b, 0, "row_ptr", 1, &nrp, NULL, 0);
      upf_dbuf_view(b, 1, "blocks", 1, &nbl, NULL, nrp);
      set_ints(b, 0, sr->row_ptr, nrp), set_ints(b, nrp, sr->blocks, nbl);
    }
  }
  if (ok && c->mean_correction) {
    upf_tensor tm;
    run_means_tensor(sr, NULL, &tm);
    x.means = dc.nbufs;
    ok = (b = upf_dcase_add(&dc, "means", sr->dt, 2 * sr->means_numel, 0)) != NULL;
    if (ok) {
      upf_dbuf_view(b, 0, "kbar", 4, tm.shape, NULL, 0);
      upf_dbuf_view(b, 1, "vbar", 4, tm.shape, NULL, sr->means_numel);
      const size_t bytes = (size_t)sr->means_numel * upf_dtype_size(sr->dt);
      memcpy(b->host, sr->kbar, bytes), memcpy((char *)b->host + bytes, sr->vbar, bytes);
    }
  }
  if (ok) {
    x.out = dc.nbufs;
    const int64_t so[3] = {sr->tq, c->hq, c->d};
    ok = (b = upf_dcase_add(&dc, "out", sr->dt, sr->tq * c->hq * c->d, 1)) != NULL;
    if (ok)
      upf_dbuf_view(b, 0, "out", 3, so, NULL, 0), upf_dbuf_fill_poison(b);
  }
  char what[64];
  snprintf(what, sizeof what, "kept %.2f", (double)sr->kept_total /
                                               (double)upf_sparse_visible_blocks(&sr->batch, &sr->plan, &sr->p));
  upf_check proto;
  run_check_init(sr, op, what, &proto);
  int64_t max_kv = 0;
  for (int r = 0; r < sr->nreq; r++)
    max_kv = sr->kv_lens[r] > max_kv ? sr->kv_lens[r] : max_kv;
  /* fp8: inputs on the E4M3 grid, the FP8 tolerance, no long-reduction rule (P's rounding dominates) */
  const int fp8 = ok && fp8_case(sr);
  const upf_tolerance fp8_tol = upf_tolerance_fp8_attention();
  if (fp8) {
    fp8_snap(&dc, &x, sr);
    dc.tol = &fp8_tol;
  }
  if (!ok)
    record_run_failure(ctx, sr, op, "setup", upf_fail(UPF_ERR_NOMEM, "case buffers"));
  else
    upf_dcase_verify(ctx, &dc, attn_fn, max_kv >= 4096 && !fp8 ? attn_truth : NULL, &x, &proto);
  upf_dcase_free(&dc);
}

/* The index on the backend from the reference's kbar: scores within the dtype's tolerance, decisions
 * exactly but for marginal ones, the header's rules on its own scores, and a second run bit for bit. */
static void index_case(upf_verify_ctx *ctx, sparse_run *sr) {
  const char *op = "sparse.index";
  const upf_backend *be = ctx->backend;
  const sparse_case *c = sr->c;
  const int64_t S = run_segments(sr), cap = S * run_nkb(sr);
  const size_t es = upf_dtype_size(sr->dt);
  gmem m = {.be = be};
  upf_guarded g[3];
  memset(g, 0, sizeof g);
  int32_t *rp = malloc((size_t)(S + 1) * 4), *bl = malloc((size_t)cap * 4 + 1);
  float *sc = malloc((size_t)cap * 4 + 1);
  int32_t *rp2 = malloc((size_t)(S + 1) * 4), *bl2 = malloc((size_t)cap * 4 + 1);
  float *sc2 = malloc((size_t)cap * 4 + 1);
  void *dq = NULL, *dkb = NULL, *dcq = NULL, *dckv = NULL, *dbt = NULL;
  upf_status st = rp && bl && sc && rp2 && bl2 && sc2 ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "index outputs");
  const char *what = "setup";
  if (st == UPF_OK)
    st = g_put(&m, sr->q, (size_t)(sr->tq * c->hq * c->d) * es, &dq);
  if (st == UPF_OK)
    st = g_put(&m, sr->kbar, (size_t)sr->means_numel * es, &dkb);
  if (st == UPF_OK)
    st = g_put(&m, sr->cu_q, (size_t)(sr->nreq + 1) * 4, &dcq);
  if (st == UPF_OK)
    st = g_put(&m, sr->page ? sr->kv_lens : sr->cu_kv, (size_t)(sr->nreq + !sr->page) * 4, &dckv);
  if (st == UPF_OK && sr->page)
    st = g_put(&m, sr->block_table, (size_t)(sr->nreq * (sr->max_blocks ? sr->max_blocks : 1)) * 4, &dbt);
  const size_t sizes[3] = {(size_t)(S + 1) * 4, (size_t)cap * 4, (size_t)cap * 4};
  for (int i = 0; st == UPF_OK && i < 3; i++)
    st = upf_guarded_alloc(be, sizes[i], &g[i]);
  upf_attn_varlen cont = {sr->nreq, dcq, sr->cu_q, dckv, sr->cu_kv};
  upf_attn_paged paged = {sr->nreq, dcq, sr->cu_q, dckv, sr->kv_lens, dbt, sr->block_table, sr->max_blocks, sr->page};
  upf_sparse_batch b = sr->page ? (upf_sparse_batch){NULL, &paged} : (upf_sparse_batch){&cont, NULL};
  upf_tensor tq, tk, tv, tkb;
  run_qkv(sr, dq, NULL, NULL, &tq, &tk, &tv);
  run_means_tensor(sr, dkb, &tkb);
  upf_sparse_index idx = {g[0].ptr, g[1].ptr, g[2].ptr, -1}, idx2 = idx;
  void *host[3] = {rp, bl, sc}, *host2[3] = {rp2, bl2, sc2};
  static const char *const names[3] = {"row_ptr", "blocks", "scores"};
  for (int run = 0; run < 2 && st == UPF_OK; run++) {
    what = be->name;
    st = be->sparse_index(&b, &tq, &tkb, &sr->p, run ? &idx2 : &idx);
    if (st == UPF_OK)
      st = be->synchronize();
    for (int i = 0; st == UPF_OK && i < 3; i++) {
      what = "guard bytes";
      st = upf_guarded_check(&g[i], names[i]);
      if (st == UPF_OK)
        what = "download", st = be->download(run ? host2[i] : host[i], g[i].ptr, sizes[i]);
    }
  }
  upf_check check;
  if (st != UPF_OK) {
    record_run_failure(ctx, sr, op, what, st);
  } else {
    run_check_init(sr, op, "[scores]", &check);
    double *ref = malloc((size_t)cap * sizeof *ref + 1);
    for (int64_t i = 0; ref && i < cap; i++)
      ref[i] = sr->scores[i];
    if (ref)
      upf_compare_f32(sc, ref, cap, upf_tolerance_for(sr->dt), &check);
    else
      check.passed = 0;
    free(ref);
    upf_verify_record(ctx, &check);
    run_check_init(sr, op, "[decisions]", &check);
    compare_decisions(sr, rp, bl, idx.kept_total, upf_select_tau(sr->dt), &check);
    upf_verify_record(ctx, &check);
    run_check_init(sr, op, "[invariants]", &check);
    index_invariants(sr, rp, bl, sc, idx.kept_total, upf_select_tau(sr->dt), &check);
    upf_verify_record(ctx, &check);
    run_check_init(sr, op, "[deterministic]", &check);
    if (idx2.kept_total != idx.kept_total) {
      check.passed = 0;
      snprintf(check.detail, sizeof check.detail, "kept_total %lld then %lld", (long long)idx.kept_total,
               (long long)idx2.kept_total);
    } else {
      upf_compare_exact(rp2, rp, S + 1, 4, &check);
      if (check.passed)
        upf_compare_exact(bl2, bl, idx.kept_total, 4, &check);
      if (check.passed)
        upf_compare_exact(sc2, sc, cap, 4, &check);
    }
    upf_verify_record(ctx, &check);
  }
  for (int i = 0; i < 3; i++)
    upf_guarded_free(&g[i]);
  g_free(&m);
  free(rp), free(bl), free(sc), free(rp2), free(bl2), free(sc2);
}

static void seeded_cases(upf_verify_ctx *ctx, upf_op op) {
  const char *name = upf_op_name(op);
  for (int i = 0; i < NCASES(cases); i++) {
    if (!upf_verify_case_wanted(ctx, cases[i].name, cases[i].flags & SC_QUICK))
      continue;
    for (int d = 0; d < 2; d++) {
      sparse_run sr;
      upf_status st = run_inputs(&sr, &cases[i], both_dtypes[d], cases[i].page,
                                 upf_verify_case_seed("sparse", i, (uint64_t)both_dtypes[d]));
      if (st == UPF_OK && op != UPF_OP_SPARSE_BLOCK_MEANS) /* the means' reference runs inside the harness */
        st = run_reference(&sr, 1);
      if (st != UPF_OK)
        record_run_failure(ctx, &sr, name, "reference", st);
      else if (op == UPF_OP_SPARSE_BLOCK_MEANS)
        means_case(ctx, &sr);
      else if (op == UPF_OP_SPARSE_INDEX)
        index_case(ctx, &sr);
      else
        attention_case(ctx, &sr);
      run_free(&sr);
    }
  }
}

void upf_verify_sparse_block_means(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++)
    for (int paged = 0; paged < 2; paged++)
      golden_means(ctx, both_dtypes[d], paged);
  errors_for(ctx, UPF_OP_SPARSE_BLOCK_MEANS);
  if (upf_verify_on_reference(ctx))
    reference_checks(ctx, UPF_OP_SPARSE_BLOCK_MEANS);
  seeded_cases(ctx, UPF_OP_SPARSE_BLOCK_MEANS);
}

void upf_verify_sparse_index(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < NCASES(index_goldens); i++)
      golden_index(ctx, both_dtypes[d], &index_goldens[i]);
  errors_for(ctx, UPF_OP_SPARSE_INDEX);
  if (upf_verify_on_reference(ctx))
    reference_checks(ctx, UPF_OP_SPARSE_INDEX);
  seeded_cases(ctx, UPF_OP_SPARSE_INDEX);
}

void upf_verify_attn_block_sparse(upf_verify_ctx *ctx) {
  for (int d = 0; d < 2; d++)
    for (int mc = 0; mc < 2; mc++)
      golden_attention(ctx, both_dtypes[d], mc);
  errors_for(ctx, UPF_OP_ATTN_BLOCK_SPARSE);
  if (upf_verify_on_reference(ctx))
    reference_checks(ctx, UPF_OP_ATTN_BLOCK_SPARSE);
  seeded_cases(ctx, UPF_OP_ATTN_BLOCK_SPARSE);
}
