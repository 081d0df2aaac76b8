/* FlashPrefill V2 on the CPU reference (ref_cpu/sparse.c): a hand-computed index (kept blocks and
 * scores), hand-checked block means (tail block, bf16 rounding), and invariants on random varlen
 * batches (index == an independent loop recomputation, sink/window/causality/dense tiles, alpha 0 ==
 * dense attention, fast == naive oracle, paged == contiguous bit for bit, mean correction closer to
 * dense), plus bad inputs returning their status with a message naming the input. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/attn.h"
#include "ref_cpu/sparse.h"
#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/fp8.h"
#include "uniprefill/rng.h"

#define SP_MAXR 4
#define LOG2E 1.4426950408889634

/* A batch: f32 values (bf16-representable when dt is bf16), their storage in dt, and the same K/V in
 * a paged cache (pages handed out back to front, unused slots NaN so a stray read shows). */
typedef struct {
  int nreq;
  int32_t cu_q[SP_MAXR + 1], cu_kv[SP_MAXR + 1], kv_lens[SP_MAXR];
  int64_t hq, hkv, d, Tq, Tkv, P;
  upf_dtype dt;
  float *qf, *kf, *vf;
  void *q, *k, *v, *kc, *vc;
  int32_t *bt, max_blocks, npages;
  upf_attn_varlen vb;
  upf_attn_paged pb;
  upf_sparse_batch bc, bp;
  upf_tensor tq, tk, tv, tkc, tvc;
} sp_case;

/* Lengths and random normal values; sp_build makes the storage after any edits of qf, kf, vf. */
static void sp_alloc(sp_case *c, int nreq, const int32_t *q_lens, const int32_t *kv_lens, int64_t hq, int64_t hkv,
                     int64_t d, upf_dtype dt, int64_t P, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->nreq = nreq, c->hq = hq, c->hkv = hkv, c->d = d, c->dt = dt, c->P = P;
  for (int r = 0; r < nreq; r++) {
    c->kv_lens[r] = kv_lens[r];
    c->cu_q[r + 1] = c->cu_q[r] + q_lens[r];
    c->cu_kv[r + 1] = c->cu_kv[r] + kv_lens[r];
  }
  c->Tq = c->cu_q[nreq], c->Tkv = c->cu_kv[nreq];
  c->qf = malloc((size_t)(c->Tq * hq * d + 1) * sizeof(float));
  c->kf = malloc((size_t)(c->Tkv * hkv * d + 1) * sizeof(float));
  c->vf = malloc((size_t)(c->Tkv * hkv * d + 1) * sizeof(float));
  upf_rng rng;
  upf_rng_seed(&rng, seed);
  upf_rng_fill_normal(&rng, c->qf, c->Tq * hq * d, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, c->kf, c->Tkv * hkv * d, 0.0f, 1.0f);
  upf_rng_fill_normal(&rng, c->vf, c->Tkv * hkv * d, 0.0f, 1.0f);
}

static void sp_build(sp_case *c) {
  const int64_t nq = c->Tq * c->hq * c->d, nk = c->Tkv * c->hkv * c->d, row = c->hkv * c->d;
  c->q = malloc((size_t)(nq + 1) * upf_dtype_size(c->dt));
  c->k = malloc((size_t)(nk + 1) * upf_dtype_size(c->dt)), c->v = malloc((size_t)(nk + 1) * upf_dtype_size(c->dt));
  for (int64_t i = 0; i < nq; i++)
    upf_test_store(c->q, c->dt, i, c->qf[i]), c->qf[i] = (float)upf_test_value(c->q, c->dt, i);
  for (int64_t i = 0; i < nk; i++) {
    upf_test_store(c->k, c->dt, i, c->kf[i]), c->kf[i] = (float)upf_test_value(c->k, c->dt, i);
    upf_test_store(c->v, c->dt, i, c->vf[i]), c->vf[i] = (float)upf_test_value(c->v, c->dt, i);
  }
  c->max_blocks = 1, c->npages = 0;
  for (int r = 0; r < c->nreq; r++) {
    const int32_t n = (int32_t)((c->kv_lens[r] + c->P - 1) / c->P);
    c->max_blocks = n > c->max_blocks ? n : c->max_blocks;
    c->npages += n;
  }
  const int64_t cache = (c->npages + 1) * c->P * row;
  c->bt = calloc((size_t)(c->nreq * c->max_blocks), sizeof *c->bt);
  c->kc = malloc((size_t)cache * upf_dtype_size(c->dt)), c->vc = malloc((size_t)cache * upf_dtype_size(c->dt));
  for (int64_t i = 0; i < cache; i++)
    upf_test_store(c->kc, c->dt, i, NAN), upf_test_store(c->vc, c->dt, i, NAN);
  int32_t next = c->npages;
  for (int r = 0; r < c->nreq; r++)
    for (int32_t j = 0; j < c->kv_lens[r]; j++) {
      if (j % c->P == 0)
        c->bt[r * c->max_blocks + j / c->P] = next--;
      const int64_t dst = ((int64_t)c->bt[r * c->max_blocks + j / c->P] * c->P + j % c->P) * row;
      memcpy((char *)c->kc + dst * upf_dtype_size(c->dt), (char *)c->k + (c->cu_kv[r] + j) * row * upf_dtype_size(c->dt), (size_t)row * upf_dtype_size(c->dt));
      memcpy((char *)c->vc + dst * upf_dtype_size(c->dt), (char *)c->v + (c->cu_kv[r] + j) * row * upf_dtype_size(c->dt), (size_t)row * upf_dtype_size(c->dt));
    }
  const int64_t sq[3] = {c->Tq, c->hq, c->d}, sk[3] = {c->Tkv, c->hkv, c->d}, sc[4] = {c->npages + 1, c->P, c->hkv, c->d};
  c->tq = upf_test_view(c->q, c->dt, 3, sq);
  c->tk = upf_test_view(c->k, c->dt, 3, sk), c->tv = upf_test_view(c->v, c->dt, 3, sk);
  c->tkc = upf_test_view(c->kc, c->dt, 4, sc), c->tvc = upf_test_view(c->vc, c->dt, 4, sc);
  c->vb = (upf_attn_varlen){c->nreq, c->cu_q, c->cu_q, c->cu_kv, c->cu_kv};
  c->pb = (upf_attn_paged){c->nreq, c->cu_q, c->cu_q, c->kv_lens, c->kv_lens, c->bt, c->bt, c->max_blocks, (int32_t)c->P};
  c->bc = (upf_sparse_batch){&c->vb, NULL};
  c->bp = (upf_sparse_batch){NULL, &c->pb};
}

static void sp_free(sp_case *c) {
  free(c->qf), free(c->kf), free(c->vf), free(c->q), free(c->k), free(c->v), free(c->kc), free(c->vc), free(c->bt);
}

/* The outputs of the three ops on one batch form. */
typedef struct {
  upf_sparse_plan plan;
  void *kbar, *vbar, *out;
  upf_tensor tkb, tvb, tout;
  int32_t *row_ptr, *blocks;
  float *scores;
  upf_sparse_index idx;
} sp_res;

static upf_status sp_res_init(sp_res *o, sp_case *c, const upf_sparse_params *p) {
  memset(o, 0, sizeof *o);
  UPF_TRY(upf_sparse_plan_make(&c->bc, (int32_t)c->hq, (int32_t)c->hkv, p, &o->plan));
  const int64_t mkb = o->plan.max_key_blocks, S = o->plan.num_segments;
  const int64_t sm[4] = {c->nreq, mkb, c->hkv, c->d}, so[3] = {c->Tq, c->hq, c->d};
  o->kbar = calloc((size_t)(c->nreq * mkb * c->hkv * c->d), upf_dtype_size(c->dt));
  o->vbar = calloc((size_t)(c->nreq * mkb * c->hkv * c->d), upf_dtype_size(c->dt));
  o->out = calloc((size_t)(c->Tq * c->hq * c->d + 1), upf_dtype_size(c->dt));
  o->row_ptr = calloc((size_t)(S + 1), sizeof(int32_t));
  o->blocks = calloc((size_t)(S * mkb + 1), sizeof(int32_t));
  o->scores = calloc((size_t)(S * mkb + 1), sizeof(float));
  o->tkb = upf_test_view(o->kbar, c->dt, 4, sm), o->tvb = upf_test_view(o->vbar, c->dt, 4, sm);
  o->tout = upf_test_view(o->out, c->dt, 3, so);
  o->idx = (upf_sparse_index){o->row_ptr, o->blocks, o->scores, 0};
  return UPF_OK;
}

static void sp_res_free(sp_res *o) {
  upf_sparse_plan_free(&o->plan);
  free(o->kbar), free(o->vbar), free(o->out), free(o->row_ptr), free(o->blocks), free(o->scores);
}

/* Means, index and fast attention on the contiguous (paged = 0) or paged form. */
static upf_status sp_run(sp_case *c, int paged, const upf_sparse_params *p, sp_res *o) {
  const upf_sparse_batch *b = paged ? &c->bp : &c->bc;
  const upf_tensor *k = paged ? &c->tkc : &c->tk, *v = paged ? &c->tvc : &c->tv;
  UPF_TRY(cpu_sparse_block_means(b, k, v, p, &o->tkb, &o->tvb));
  UPF_TRY(cpu_sparse_index(b, &c->tq, &o->tkb, p, &o->idx));
  return cpu_attn_block_sparse(b, &c->tq, k, v, p, &o->idx, &o->tkb, &o->tvb, &o->tout);
}

static double nmse(const double *a, const double *ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i++)
    num += (a[i] - ref[i]) * (a[i] - ref[i]), den += ref[i] * ref[i];
  return num / (den > 0.0 ? den : 1.0);
}

/* ---- a hand-computed index ---- */

/* g = 2 (Hq 2, Hkv 1), D = 2, block_m 160 (80 positions a tile), block_n 64; one request of q_len 240
 * and kv_len 428 (prefix 188; blocks 0..6, the last one 44 keys). Every key of block b is (x_b, y_b),
 * so kbar_b is exact; head 0 queries are (1, 0) (but see tile 0), head 1 queries (0, 1); scale = ln 2 so that l = x_b
 * (head 0) or y_b (head 1) up to float rounding of the scale.
 * Tile 0: positions 188..267, first_k 2, last_k 4, active 4: blocks 0..2 get all 160 rows, block 3
 * (first key 192) only the 152 rows of positions >= 192. Tile 1: 268..347, first_k 4, last_k 5,
 * active 5, all rows everywhere. Tile 2 (last_n 1) is dense. */
static void test_sparse_index_by_hand(void) {
  const float xs[7] = {2, 0, 1, 3, 0, 1, 0}, ys[7] = {0, 1, -1, 0, 0, 1, 0};
  const int32_t q_len = 240, kv_len = 428;
  sp_case c;
  sp_alloc(&c, 1, &q_len, &kv_len, 2, 1, 2, UPF_DTYPE_F32, 16, 1);
  for (int64_t j = 0; j < kv_len; j++)
    c.kf[j * 2] = xs[j / 64], c.kf[j * 2 + 1] = ys[j / 64];
  for (int64_t t = 0; t < q_len; t++)
    c.qf[t * 4 + 0] = t < 4 ? 2 : 1, c.qf[t * 4 + 1] = 0, c.qf[t * 4 + 2] = 0, c.qf[t * 4 + 3] = 1;
  sp_build(&c);
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 160, p.block_n = 64, p.sink = 1, p.window = 1, p.last_n = 1, p.scale = (float)log(2.0);
  /* Tile 0: the head 0 queries of positions 188..191 (4 rows, not contributing to block 3) are (2, 0):
   * l = 4, 0, 2 on blocks 0..2 (6 on block 3 would be the max, but it does not count), so m_t = 4.
   * S0 = 4 + 76/4 + 80/16 = 28, S1 = 4/16 + 76/16 + 80/8 = 15, S2 = 4/4 + 76/8 + 80/32 = 13,
   * S3 = 76/2 + 76/16 = 42.75. Tile 1 (m_t = 3): S = 80/2 + 80/8 = 50, 80/8 + 80/4 = 30, 80/4 + 80/16 =
   * 25, 80 + 80/8 = 90, 80/8 + 80/8 = 20. */
  const double S0[7] = {28, 15, 13, 42.75, 0, 0, 0}, S1[7] = {50, 30, 25, 90, 20, 0, 0};
  const float alphas[2] = {0.5f, 0.3f};
  /* alpha 0.5: tile 0 thresh 21.375 keeps 0, 3 (+ window 2..4); tile 1 thresh 45 keeps 0, 3 (+ 4, 5).
   * alpha 0.3: tile 0 thresh 12.825 keeps 0..3; tile 1 thresh 27 keeps 0, 1, 3. */
  const int32_t want[2][3][8] = {{{0, 2, 3, 4, -1}, {0, 3, 4, 5, -1}, {0, 1, 2, 3, 4, 5, 6, -1}},
                                 {{0, 1, 2, 3, 4, -1}, {0, 1, 3, 4, 5, -1}, {0, 1, 2, 3, 4, 5, 6, -1}}};
  for (int a = 0; a < 2; a++) {
    p.alpha = alphas[a];
    sp_res o;
    CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(o.plan.num_segments, 3);
    CU_ASSERT_EQUAL_FATAL(o.plan.max_key_blocks, 7);
    CU_ASSERT_EQUAL_FATAL(sp_run(&c, 0, &p, &o), UPF_OK);
    const float *kb = o.kbar;
    for (int b = 0; b < 7; b++) {
      CU_ASSERT_EQUAL(kb[b * 2], xs[b]);
      CU_ASSERT_EQUAL(kb[b * 2 + 1], ys[b]);
    }
    for (int b = 0; b < 7; b++) {
      CU_ASSERT_DOUBLE_EQUAL(o.scores[b], S0[b], 1e-5 * S0[b]);
      CU_ASSERT_DOUBLE_EQUAL(o.scores[7 + b], S1[b], 1e-5 * S1[b]);
      CU_ASSERT_EQUAL(o.scores[14 + b], 0.0f); /* dense tile: unscored */
    }
    int64_t n = 0;
    for (int s = 0; s < 3; s++) {
      CU_ASSERT_EQUAL(o.row_ptr[s], n);
      for (int i = 0; want[a][s][i] >= 0; i++, n++)
        CU_ASSERT_EQUAL(o.blocks[n], want[a][s][i]);
    }
    CU_ASSERT_EQUAL(o.row_ptr[3], n);
    CU_ASSERT_EQUAL(o.idx.kept_total, n);
    sp_res_free(&o);
  }
  sp_free(&c);
}

/* ---- hand-checked block means ---- */

/* Two requests (kv_len 150 and 64) of one head, D = 2: key j = (j, [j % 3 == 0]), v = -k. Blocks of 64:
 * means (31.5, 22/64), (95.5, 21/64) and the tail block 128..149 (22 keys) (138.5, 7/22); request 1's
 * blocks 1 and 2 are past its kv_len: 0. In bf16: 138.5 is a tie between 138 and 139 (spacing 1),
 * rounded to even 138; 7/22 = 0.31818.. rounds to 163 * 2^-9 = 0.318359375. */
static void test_sparse_block_means_by_hand(void) {
  const upf_dtype dts[2] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};
  const int32_t q_lens[2] = {1, 1}, kv_lens[2] = {150, 64};
  for (int di = 0; di < 2; di++) {
    sp_case c;
    sp_alloc(&c, 2, q_lens, kv_lens, 1, 1, 2, dts[di], 16, 2);
    for (int r = 0; r < 2; r++)
      for (int32_t j = 0; j < kv_lens[r]; j++) {
        float *kr = c.kf + (c.cu_kv[r] + j) * 2, *vr = c.vf + (c.cu_kv[r] + j) * 2;
        kr[0] = (float)j, kr[1] = j % 3 == 0 ? 1.0f : 0.0f;
        vr[0] = -kr[0], vr[1] = -kr[1];
      }
    sp_build(&c);
    upf_sparse_params p = upf_sparse_params_default();
    sp_res o;
    CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(o.plan.max_key_blocks, 3);
    const int bf = dts[di] == UPF_DTYPE_BF16;
    const double want[2][3][2] = {{{31.5, 22.0 / 64}, {95.5, 21.0 / 64}, {bf ? 138.0 : 138.5, bf ? 0.318359375 : (double)(float)(7.0 / 22)}},
                                  {{31.5, 22.0 / 64}, {0, 0}, {0, 0}}};
    for (int paged = 0; paged < 2; paged++) {
      memset(o.kbar, 0x7f, (size_t)(2 * 3 * 2) * upf_dtype_size(c.dt)); /* garbage: every entry is written */
      memset(o.vbar, 0x7f, (size_t)(2 * 3 * 2) * upf_dtype_size(c.dt));
      CU_ASSERT_EQUAL_FATAL(cpu_sparse_block_means(paged ? &c.bp : &c.bc, paged ? &c.tkc : &c.tk,
                                                   paged ? &c.tvc : &c.tv, &p, &o.tkb, &o.tvb), UPF_OK);
      for (int r = 0; r < 2; r++)
        for (int b = 0; b < 3; b++)
          for (int e = 0; e < 2; e++) {
            CU_ASSERT_EQUAL(upf_test_value(o.kbar, c.dt, (r * 3 + b) * 2 + e), want[r][b][e]);
            CU_ASSERT_EQUAL(upf_test_value(o.vbar, c.dt, (r * 3 + b) * 2 + e), -want[r][b][e]);
          }
    }
    /* vbar NULL: v is not read, and may be NULL */
    memset(o.kbar, 0, (size_t)(2 * 3 * 2) * upf_dtype_size(c.dt));
    CU_ASSERT_EQUAL(cpu_sparse_block_means(&c.bc, &c.tk, NULL, &p, &o.tkb, NULL), UPF_OK);
    CU_ASSERT_EQUAL(upf_test_value(o.kbar, c.dt, 2 * 2), want[0][2][0]);
    /* block_n 128: block 0 = keys 0..127 (63.5, 43/128), the tail block 128..149 as above */
    p.block_n = 128;
    sp_res o2;
    CU_ASSERT_EQUAL_FATAL(sp_res_init(&o2, &c, &p), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(cpu_sparse_block_means(&c.bc, &c.tk, &c.tv, &p, &o2.tkb, &o2.tvb), UPF_OK);
    CU_ASSERT_EQUAL(upf_test_value(o2.kbar, c.dt, 0), 63.5);
    CU_ASSERT_EQUAL(upf_test_value(o2.kbar, c.dt, 1), 43.0 / 128);
    CU_ASSERT_EQUAL(upf_test_value(o2.kbar, c.dt, 2), want[0][2][0]);
    CU_ASSERT_EQUAL(upf_test_value(o2.kbar, c.dt, 4), 31.5); /* request 1: 64 keys, one partial block */
    CU_ASSERT_EQUAL(upf_test_value(o2.kbar, c.dt, 6), 0.0);
    sp_res_free(&o2);
    sp_res_free(&o);
    sp_free(&c);
  }
}

/* ---- invariants on random batches ---- */

/* The index recomputed by plain loops from q and the kbar the op produced (geometry from the header's
 * rules written out again here), compared with the op's: the same CSR, scores within fp32 rounding.
 * Also: every segment holds its sink and window blocks, nothing past last_k, and dense tiles hold
 * every block 0..last_k. Returns the number of failures. */
static int check_index(const sp_case *c, const upf_sparse_params *p, const sp_res *o) {
  const int64_t g = c->hq / c->hkv, mkb = o->plan.max_key_blocks, bm = p->block_m, bn = p->block_n;
  const double c2 = (double)upf_sparse_scale(p, c->d) * LOG2E;
  int fails = 0;
  int64_t kept = 0, seg_base = 0;
  double *S = malloc((size_t)mkb * sizeof *S);
  for (int r = 0; r < c->nreq; r++) {
    const int64_t q_len = c->cu_q[r + 1] - c->cu_q[r], kv_len = c->kv_lens[r], prefix = kv_len - q_len;
    const int64_t rows = q_len * g, tiles = (rows + bm - 1) / bm;
    for (int64_t m = 0; m < tiles; m++) {
      const int64_t pb = m * bm, pe = pb + bm < rows ? pb + bm : rows;
      const int64_t qf = pb / g, ql = (pe - 1) / g, fk = (prefix + qf) / bn, lk = (prefix + ql) / bn;
      const int64_t act = (prefix + ql + 1) / bn;
      const int dense = q_len <= p->min_sparse_q_len || m >= tiles - p->last_n;
      for (int64_t h = 0; h < c->hkv; h++) {
        const int64_t s = h * o->plan.total_q_tiles + seg_base + m;
        double mt = -INFINITY, smax = 0.0;
        for (int pass = 0; pass < 2; pass++) {
          for (int64_t b = 0; b < mkb; b++)
            S[b] = 0.0;
          for (int64_t b = 0; !dense && b < act; b++)
            for (int64_t i = pb; i < pe; i++) {
              if (prefix + i / g < b * bn)
                continue;
              double dot = 0.0;
              for (int64_t e = 0; e < c->d; e++)
                dot += (double)c->qf[((c->cu_q[r] + i / g) * c->hq + h * g + i % g) * c->d + e] *
                       upf_test_value(o->kbar, c->dt, ((r * mkb + b) * c->hkv + h) * c->d + e);
              const double l = c2 * dot;
              if (pass == 0)
                mt = l > mt ? l : mt;
              else
                S[b] += exp2(l - mt);
            }
        }
        for (int64_t b = 0; b < mkb; b++) {
          smax = S[b] > smax ? S[b] : smax;
          if (fabs(o->scores[s * mkb + b] - S[b]) > 2e-6 * S[b] + 1e-30)
            fails++;
        }
        /* segments are KV-head major: this one's blocks start at row_ptr[s], checked to chain below */
        int64_t at = o->row_ptr[s];
        for (int64_t b = 0; b <= lk; b++) {
          const int keep = dense || (b < act && S[b] >= (double)p->alpha * smax) || b < p->sink || b >= fk - p->window + 1;
          if (keep && (at >= o->row_ptr[s + 1] || o->blocks[at++] != b))
            fails++;
        }
        kept += at - o->row_ptr[s];
        if (o->row_ptr[s + 1] != at)
          fails++;
        /* the rules themselves, read off the op's output */
        for (int32_t i = o->row_ptr[s]; i < o->row_ptr[s + 1]; i++)
          fails += o->blocks[i] > lk || (i > o->row_ptr[s] && o->blocks[i] <= o->blocks[i - 1]);
        int64_t need = 0; /* sink and window blocks present */
        for (int64_t b = 0; b <= lk; b++)
          if (b < p->sink || b >= fk - p->window + 1 || dense)
            for (int32_t i = o->row_ptr[s]; i < o->row_ptr[s + 1]; i++)
              need += o->blocks[i] == b;
        int64_t want_need = 0;
        for (int64_t b = 0; b <= lk; b++)
          want_need += b < p->sink || b >= fk - p->window + 1 || dense;
        fails += need != want_need;
      }
    }
    seg_base += tiles;
  }
  if (o->idx.kept_total != kept || o->row_ptr[0] != 0 || o->row_ptr[o->plan.num_segments] != kept)
    fails++;
  free(S);
  return fails;
}

typedef struct {
  const char *name;
  int nreq;
  int32_t q_lens[SP_MAXR], kv_lens[SP_MAXR];
  int64_t hq, hkv, d, P;
  upf_dtype dt;
  int32_t block_m, block_n, sink, window, last_n, min_sparse_q_len;
  float alpha;
} sp_config;

/* Ragged varlen with cached prefixes, q_len * g not a multiple of block_m, g = 1, 2, 3, 4, block_n 64
 * and 128, D = 8 .. 256, f32 and bf16, one request run dense by min_sparse_q_len. */
static const sp_config configs[] = {
    {"g2 D16 bn64 varlen", 3, {37, 130, 5}, {37, 700, 70}, 4, 2, 16, 16, UPF_DTYPE_F32, 32, 64, 1, 2, 1, 0, 0.97f},
    {"g1 D128 bn128", 1, {64}, {700}, 2, 2, 128, 64, UPF_DTYPE_F32, 16, 128, 1, 1, 1, 0, 0.99f},
    {"g3 D8 bf16 min_sparse", 3, {100, 1, 20}, {600, 129, 200}, 3, 1, 8, 32, UPF_DTYPE_BF16, 48, 64, 2, 1, 1, 20, 1.0f},
    {"g4 D256 bn64", 1, {24}, {400}, 4, 1, 256, 16, UPF_DTYPE_F32, 64, 64, 0, 2, 1, 0, 0.98f},
    {"g2 D32 bn128 bf16", 2, {80, 64}, {700, 64}, 4, 2, 32, 8, UPF_DTYPE_BF16, 64, 128, 2, 1, 0, 0, 1.0f},
};

static upf_sparse_params config_params(const sp_config *k) {
  upf_sparse_params p = upf_sparse_params_default();
  p.alpha = k->alpha, p.block_m = k->block_m, p.block_n = k->block_n, p.sink = k->sink, p.window = k->window;
  p.last_n = k->last_n, p.min_sparse_q_len = k->min_sparse_q_len;
  return p;
}

static void config_case(sp_case *c, const sp_config *k, uint64_t seed) {
  sp_alloc(c, k->nreq, k->q_lens, k->kv_lens, k->hq, k->hkv, k->d, k->dt, k->P, seed);
  sp_build(c);
}

static int64_t nout(const sp_case *c) { return c->Tq * c->hq * c->d; }

/* Rounded out vs a double truth: within one rounding of the output dtype (plus the sum-order noise). */
static int out_matches(const sp_case *c, const void *out, const double *truth, double *worst) {
  const double ulp = c->dt == UPF_DTYPE_BF16 ? 1.0 / 128 : 1.2e-7;
  int bad = 0;
  for (int64_t i = 0; i < nout(c); i++) {
    const double err = fabs(upf_test_value(out, c->dt, i) - truth[i]), tol = ulp * fabs(truth[i]) + 1e-12;
    bad += !(err <= tol);
    if (worst && err > *worst)
      *worst = err;
  }
  return bad;
}

static void test_sparse_index_invariants(void) {
  for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++) {
    const sp_config *k = &configs[ci];
    sp_case c;
    config_case(&c, k, 100 + ci);
    const upf_sparse_params p = config_params(k);
    sp_res o;
    CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(cpu_sparse_block_means(&c.bc, &c.tk, NULL, &p, &o.tkb, NULL), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(cpu_sparse_index(&c.bc, &c.tq, &o.tkb, &p, &o.idx), UPF_OK);
    const int fails = check_index(&c, &p, &o);
    CU_ASSERT_EQUAL(fails, 0);
    if (fails)
      printf("\n  %s: %d index mismatches\n", k->name, fails);
    sp_res_free(&o);
    sp_free(&c);
  }
}

/* alpha = 0 keeps every visible block, and then block-sparse attention is dense attention (quick mode:
 * the configurations of D <= 32). */
static void test_sparse_alpha0_is_dense(void) {
  for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++) {
    const sp_config *k = &configs[ci];
    if (upf_test_quick() && k->d > 32)
      continue;
    sp_case c;
    config_case(&c, k, 200 + ci);
    upf_sparse_params p = config_params(k);
    p.alpha = 0.0f, p.mean_correction = 1; /* nothing unkept: the correction adds nothing */
    sp_res o;
    CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
    CU_ASSERT_EQUAL_FATAL(sp_run(&c, 0, &p, &o), UPF_OK);
    CU_ASSERT_EQUAL(o.idx.kept_total, upf_sparse_visible_blocks(&c.bc, &o.plan, &p));
    CU_ASSERT_EQUAL(check_index(&c, &p, &o), 0);
    double *dense = malloc((size_t)nout(&c) * sizeof *dense), *sparse = malloc((size_t)nout(&c) * sizeof *sparse);
    const upf_attn_params ap = {upf_sparse_scale(&p, c.d), 0.0f, 0};
    CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_f64(&c.vb, &c.tq, &c.tk, &c.tv, &ap, dense), UPF_OK);
    if (!upf_test_quick()) { /* the oracle too (the fast path is held to it below) */
      CU_ASSERT_EQUAL_FATAL(ref_attn_block_sparse_naive(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb,
                                                        &o.tout, sparse), UPF_OK);
      double worst = 0.0;
      for (int64_t i = 0; i < nout(&c); i++)
        worst = fabs(dense[i] - sparse[i]) > worst ? fabs(dense[i] - sparse[i]) : worst;
      CU_ASSERT(worst < 1e-12);
    }
    CU_ASSERT_EQUAL(out_matches(&c, o.out, dense, NULL), 0);
    /* the FLOPs of the full index are those of dense attention */
    int32_t *ql = malloc((size_t)c.nreq * sizeof *ql);
    for (int r = 0; r < c.nreq; r++)
      ql[r] = c.cu_q[r + 1] - c.cu_q[r];
    CU_ASSERT_DOUBLE_EQUAL(upf_sparse_attn_flops(&c.bc, &o.plan, &p, c.d, o.row_ptr, o.blocks),
                           upf_attn_flops(ql, c.kv_lens, c.nreq, c.hq, c.d, 0), 1e-6);
    free(ql), free(dense), free(sparse);
    sp_res_free(&o);
    sp_free(&c);
  }
}

/* The dgemm path equals the naive loops (with and without mean correction), and the paged form equals
 * the contiguous one bit for bit for all three ops. */
static void test_sparse_fast_naive_paged(void) {
  for (size_t ci = 0; ci < sizeof configs / sizeof *configs; ci++) {
    const sp_config *k = &configs[ci];
    sp_case c;
    config_case(&c, k, 300 + ci);
    for (int mc = upf_test_quick(); mc < 2; mc++) { /* quick: the corrected path only (a superset) */
      upf_sparse_params p = config_params(k);
      p.mean_correction = mc;
      sp_res a, b;
      CU_ASSERT_EQUAL_FATAL(sp_res_init(&a, &c, &p), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(sp_res_init(&b, &c, &p), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(sp_run(&c, 0, &p, &a), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(sp_run(&c, 1, &p, &b), UPF_OK);
      const int64_t S = a.plan.num_segments, mkb = a.plan.max_key_blocks;
      const size_t nm = (size_t)(c.nreq * mkb * c.hkv * c.d) * upf_dtype_size(c.dt);
      CU_ASSERT(memcmp(a.kbar, b.kbar, nm) == 0);
      CU_ASSERT(memcmp(a.vbar, b.vbar, nm) == 0);
      CU_ASSERT(memcmp(a.row_ptr, b.row_ptr, (size_t)(S + 1) * sizeof(int32_t)) == 0);
      CU_ASSERT(memcmp(a.blocks, b.blocks, (size_t)a.row_ptr[S] * sizeof(int32_t)) == 0);
      CU_ASSERT(memcmp(a.scores, b.scores, (size_t)(S * mkb) * sizeof(float)) == 0);
      CU_ASSERT(memcmp(a.out, b.out, (size_t)nout(&c) * upf_dtype_size(c.dt)) == 0);
      /* the index is sparse (else the comparisons below prove little about it) */
      CU_ASSERT(a.idx.kept_total < upf_sparse_visible_blocks(&c.bc, &a.plan, &p));
      double *truth = malloc((size_t)nout(&c) * sizeof *truth);
      CU_ASSERT_EQUAL_FATAL(ref_attn_block_sparse_naive(&c.bc, &c.tq, &c.tk, &c.tv, &p, &a.idx, &a.tkb, &a.tvb,
                                                        &a.tout, truth), UPF_OK);
      double worst = 0.0;
      const int bad = out_matches(&c, a.out, truth, &worst);
      CU_ASSERT_EQUAL(bad, 0);
      if (bad)
        printf("\n  %s mc=%d: %d outputs off the naive truth (worst %g)\n", k->name, mc, bad, worst);
      /* the naive path through the paged cache and rounded into out: the same rounded values */
      if (!upf_test_quick()) {
        void *o2 = malloc((size_t)nout(&c) * upf_dtype_size(c.dt));
        upf_tensor t2 = a.tout;
        t2.data = o2;
        CU_ASSERT_EQUAL_FATAL(ref_attn_block_sparse_naive(&c.bp, &c.tq, &c.tkc, &c.tvc, &p, &a.idx, &a.tkb, &a.tvb,
                                                          &t2, NULL), UPF_OK);
        CU_ASSERT_EQUAL(out_matches(&c, o2, truth, NULL), 0);
        free(o2);
      }
      free(truth);
      sp_res_free(&a), sp_res_free(&b);
    }
    sp_free(&c);
  }
}

/* Requests whose every tile is dense never read kbar (NaN there changes nothing). */
static void test_sparse_dense_requests_skip_kbar(void) {
  const int32_t q_lens[2] = {40, 64}, kv_lens[2] = {300, 64};
  sp_case c;
  sp_alloc(&c, 2, q_lens, kv_lens, 4, 2, 8, UPF_DTYPE_F32, 16, 5);
  sp_build(&c);
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 16, p.min_sparse_q_len = 64, p.last_n = 0, p.alpha = 0.7f;
  sp_res o;
  CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
  float *kb = o.kbar;
  for (int64_t i = 0; i < 2 * o.plan.max_key_blocks * 2 * 8; i++)
    kb[i] = NAN;
  CU_ASSERT_EQUAL_FATAL(cpu_sparse_index(&c.bc, &c.tq, &o.tkb, &p, &o.idx), UPF_OK);
  CU_ASSERT_EQUAL(o.idx.kept_total, upf_sparse_visible_blocks(&c.bc, &o.plan, &p));
  for (int64_t i = 0; i < o.plan.num_segments * o.plan.max_key_blocks; i++)
    CU_ASSERT_EQUAL(o.scores[i], 0.0f);
  /* scores NULL is allowed */
  o.idx.scores = NULL;
  CU_ASSERT_EQUAL(cpu_sparse_index(&c.bc, &c.tq, &o.tkb, &p, &o.idx), UPF_OK);
  sp_res_free(&o);
  sp_free(&c);
}

/* Mean correction on inputs where the unkept blocks carry mass: the corrected output is closer to dense
 * attention than plain sparse. On plain random data (flat attention: the unkept blocks hold most of the
 * mass, and a block's mean term stands for it well) by far; with hot blocks (K of ~30% of the blocks
 * scaled by 3, as the published test does) by less, since a mean term underestimates a block whose
 * logits spread widely, but still in both measures. The fast path agrees with the oracle throughout. */
static void mean_correction_errors(int hot_blocks, double *nmse_plain, double *nmse_corr, double *mae_plain,
                                   double *mae_corr) {
  const int32_t q_lens[2] = {128, 100}, kv_lens[2] = {640, 700};
  sp_case c;
  sp_alloc(&c, 2, q_lens, kv_lens, 2, 1, 16, UPF_DTYPE_F32, 16, 7);
  if (hot_blocks) {
    upf_rng rng;
    upf_rng_seed(&rng, 77);
    int hot[16];
    for (int b = 0; b < 16; b++)
      hot[b] = upf_rng_uniform(&rng) < 0.3f;
    for (int r = 0; r < 2; r++)
      for (int32_t j = 0; j < kv_lens[r]; j++)
        if (hot[j / 64])
          for (int64_t e = 0; e < 16; e++)
            c.kf[(c.cu_kv[r] + j) * 16 + e] *= 3.0f;
  }
  sp_build(&c);
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 64, p.alpha = 1.0f, p.sink = 2, p.window = 2, p.last_n = 1;
  const int64_t n = nout(&c);
  double *dense = malloc((size_t)n * sizeof *dense), *plain = malloc((size_t)n * sizeof *plain);
  double *corr = malloc((size_t)n * sizeof *corr);
  const upf_attn_params ap = {upf_sparse_scale(&p, c.d), 0.0f, 0};
  CU_ASSERT_EQUAL_FATAL(ref_attn_prefill_f64(&c.vb, &c.tq, &c.tk, &c.tv, &ap, dense), UPF_OK);
  sp_res o;
  CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(sp_run(&c, 0, &p, &o), UPF_OK);
  CU_ASSERT(o.idx.kept_total < upf_sparse_visible_blocks(&c.bc, &o.plan, &p) * 4 / 5);
  CU_ASSERT_EQUAL(out_matches(&c, o.out, dense, NULL) > 0, 1);
  CU_ASSERT_EQUAL_FATAL(ref_attn_block_sparse_naive(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout,
                                                    plain), UPF_OK);
  CU_ASSERT_EQUAL(out_matches(&c, o.out, plain, NULL), 0);
  p.mean_correction = 1;
  CU_ASSERT_EQUAL_FATAL(ref_attn_block_sparse_naive(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout,
                                                    corr), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout),
                        UPF_OK);
  CU_ASSERT_EQUAL(out_matches(&c, o.out, corr, NULL), 0);
  *nmse_plain = nmse(plain, dense, n), *nmse_corr = nmse(corr, dense, n);
  *mae_plain = *mae_corr = 0.0;
  for (int64_t i = 0; i < n; i++)
    *mae_plain += fabs(plain[i] - dense[i]) / (double)n, *mae_corr += fabs(corr[i] - dense[i]) / (double)n;
  sp_res_free(&o);
  free(dense), free(plain), free(corr);
  sp_free(&c);
}

static void test_sparse_mean_correction(void) {
  double np, nc, ap, ac;
  mean_correction_errors(0, &np, &nc, &ap, &ac);
  CU_ASSERT(np > 0.1); /* the unkept blocks matter */
  CU_ASSERT(nc < 0.5 * np);
  CU_ASSERT(ac < 0.75 * ap);
  if (!(nc < 0.5 * np && ac < 0.75 * ap))
    printf("\n  random: nmse corrected %g vs plain %g, mae %g vs %g\n", nc, np, ac, ap);
  mean_correction_errors(1, &np, &nc, &ap, &ac);
  CU_ASSERT(np > 0.01);
  CU_ASSERT(nc < 0.95 * np);
  CU_ASSERT(ac < 0.95 * ap);
  if (!(nc < 0.95 * np && ac < 0.95 * ap))
    printf("\n  hot blocks: nmse corrected %g vs plain %g, mae %g vs %g\n", nc, np, ac, ap);
}

/* One row written out: kv_len 192, q_len 1 (prefix 191), g = 1, D = 2, block_n 64, an index holding
 * only block 2 (the row's own): blocks 0 and 1 are corrected. q = (1, 0), scale 1; K of block b all
 * (a_b, 0), V all (b + 1, 0) except key 191 in block 2 whose V is (10, 1). Visible keys: 128..191 of
 * block 2, all logits a_2; corrected terms logits a_b + ln 64, values vbar_b = (b + 1, 0). */
static void test_sparse_mean_correction_by_hand(void) {
  const int32_t q_len = 1, kv_len = 192;
  const float a[3] = {0.5f, -1.0f, 0.25f};
  sp_case c;
  sp_alloc(&c, 1, &q_len, &kv_len, 1, 1, 2, UPF_DTYPE_F32, 64, 9);
  for (int32_t j = 0; j < kv_len; j++) {
    c.kf[j * 2] = a[j / 64], c.kf[j * 2 + 1] = 0.0f;
    c.vf[j * 2] = (float)(j / 64 + 1), c.vf[j * 2 + 1] = 0.0f;
  }
  c.vf[191 * 2] = 10.0f, c.vf[191 * 2 + 1] = 1.0f;
  c.qf[0] = 1.0f, c.qf[1] = 0.0f;
  sp_build(&c);
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 16, p.sink = 0, p.window = 1, p.last_n = 0, p.scale = 1.0f, p.mean_correction = 1;
  sp_res o;
  CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &p), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(cpu_sparse_block_means(&c.bc, &c.tk, &c.tv, &p, &o.tkb, &o.tvb), UPF_OK);
  o.row_ptr[0] = 0, o.row_ptr[1] = 1, o.blocks[0] = 2;
  /* weights: 64 keys of block 2 at e^a2 (63 of value 3, one of (10, 1)), then 64 e^a0 (value 1) and
   * 64 e^a1 (value 2) */
  const double w2 = exp(a[2]), w0 = 64 * exp(a[0]), w1 = 64 * exp(a[1]), den = 64 * w2 + w0 + w1;
  const double want0 = (63 * 3 * w2 + 10 * w2 + w0 * 1 + w1 * 2) / den, want1 = w2 / den;
  for (int naive = 0; naive < 2; naive++) {
    memset(o.out, 0, 2 * sizeof(float));
    const upf_status st =
        naive ? ref_attn_block_sparse_naive(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout, NULL)
              : cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout);
    CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
    const float *out = o.out;
    CU_ASSERT_DOUBLE_EQUAL(out[0], want0, 1e-6 * want0);
    CU_ASSERT_DOUBLE_EQUAL(out[1], want1, 1e-6 * want1);
  }
  /* without correction: block 2 alone */
  p.mean_correction = 0;
  CU_ASSERT_EQUAL_FATAL(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, NULL, NULL, &o.tout), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(((float *)o.out)[0], (63 * 3 + 10) / 64.0, 1e-6);
  CU_ASSERT_DOUBLE_EQUAL(((float *)o.out)[1], 1 / 64.0, 1e-7);
  sp_res_free(&o);
  sp_free(&c);
}

/* ---- bad inputs ---- */

static int fails_with(upf_status st, upf_status want, const char *needle) {
  const int ok = st == want && strstr(upf_last_error(), needle) != NULL;
  if (!ok)
    printf("\n  want %s naming '%s', got %s: %s\n", upf_status_name(want), needle, upf_status_name(st),
           upf_last_error());
  return ok;
}

static void test_sparse_bad_inputs(void) {
  const int32_t q_lens[2] = {20, 8}, kv_lens[2] = {100, 8};
  sp_case c;
  sp_alloc(&c, 2, q_lens, kv_lens, 4, 2, 8, UPF_DTYPE_F32, 16, 11);
  sp_build(&c);
  const upf_sparse_params good = upf_sparse_params_default();
  sp_res o;
  CU_ASSERT_EQUAL_FATAL(sp_res_init(&o, &c, &good), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(sp_run(&c, 0, &good, &o), UPF_OK);
  upf_sparse_params p = good;
  p.alpha = 1.5f;
  CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &c.tq, &o.tkb, &p, &o.idx), UPF_ERR_INVALID_ARG, "alpha"));
  CU_ASSERT(fails_with(cpu_sparse_block_means(&c.bc, &c.tk, &c.tv, &p, &o.tkb, &o.tvb), UPF_ERR_INVALID_ARG, "alpha"));
  p = good, p.alpha = NAN;
  CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout),
                       UPF_ERR_INVALID_ARG, "alpha"));
  p = good, p.block_n = 96;
  CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &c.tq, &o.tkb, &p, &o.idx), UPF_ERR_INVALID_ARG, "block_n"));
  p = good, p.window = 0;
  CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, &o.tvb, &o.tout),
                       UPF_ERR_INVALID_ARG, "window"));
  /* Hq % Hkv != 0: q of 3 heads over kbar / k of 2 */
  {
    const int64_t s3[3] = {c.Tq, 3, c.d};
    upf_tensor q3 = upf_test_view(c.q, UPF_DTYPE_F32, 3, s3);
    CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &q3, &o.tkb, &good, &o.idx), UPF_ERR_SHAPE, "Hq"));
    CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &q3, &c.tk, &c.tv, &good, &o.idx, NULL, NULL, &o.tout),
                         UPF_ERR_SHAPE, "Hq"));
  }
  /* kv_len < q_len */
  {
    int32_t cu_kv[3] = {0, 100, 104};
    upf_attn_varlen vb = {2, c.cu_q, c.cu_q, cu_kv, cu_kv};
    const upf_sparse_batch bb = {&vb, NULL};
    const int64_t sk[3] = {104, c.hkv, c.d};
    upf_tensor tk = upf_test_view(c.k, UPF_DTYPE_F32, 3, sk), tv = upf_test_view(c.v, UPF_DTYPE_F32, 3, sk);
    CU_ASSERT(fails_with(cpu_sparse_index(&bb, &c.tq, &o.tkb, &good, &o.idx), UPF_ERR_CU_SEQLENS, "kv_len"));
    CU_ASSERT(fails_with(cpu_sparse_block_means(&bb, &tk, &tv, &good, &o.tkb, &o.tvb), UPF_ERR_CU_SEQLENS, "kv_len"));
    CU_ASSERT(fails_with(cpu_attn_block_sparse(&bb, &c.tq, &tk, &tv, &good, &o.idx, NULL, NULL, &o.tout),
                         UPF_ERR_CU_SEQLENS, "kv_len"));
  }
  /* wrong kbar shape: one key block too few, and a D that is not q's */
  {
    const int64_t sm[4] = {c.nreq, o.plan.max_key_blocks - 1, c.hkv, c.d}, sd[4] = {c.nreq, o.plan.max_key_blocks, c.hkv, 4};
    upf_tensor kb = upf_test_view(o.kbar, UPF_DTYPE_F32, 4, sm), kd = upf_test_view(o.kbar, UPF_DTYPE_F32, 4, sd);
    CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &c.tq, &kb, &good, &o.idx), UPF_ERR_SHAPE, "kbar"));
    CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &c.tq, &kd, &good, &o.idx), UPF_ERR_SHAPE, "kbar"));
    CU_ASSERT(fails_with(cpu_sparse_block_means(&c.bc, &c.tk, &c.tv, &good, &kb, NULL), UPF_ERR_SHAPE, "kbar"));
    p = good, p.mean_correction = 1;
    CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &kb, &o.tvb, &o.tout),
                         UPF_ERR_SHAPE, "kbar"));
  }
  /* mean correction without vbar */
  p = good, p.mean_correction = 1;
  CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &p, &o.idx, &o.tkb, NULL, &o.tout),
                       UPF_ERR_INVALID_ARG, "vbar"));
  CU_ASSERT(fails_with(cpu_sparse_block_means(&c.bc, &c.tk, NULL, &good, &o.tkb, &o.tvb), UPF_ERR_INVALID_ARG, "v"));
  /* both and neither K/V form */
  {
    const upf_sparse_batch both = {&c.vb, &c.pb}, none = {NULL, NULL};
    CU_ASSERT(fails_with(cpu_sparse_index(&both, &c.tq, &o.tkb, &good, &o.idx), UPF_ERR_INVALID_ARG, "exactly one"));
    CU_ASSERT(fails_with(cpu_sparse_block_means(&none, &c.tk, &c.tv, &good, &o.tkb, NULL), UPF_ERR_INVALID_ARG,
                         "exactly one"));
  }
  /* an index naming a block past the tile's last_k, or out of order */
  {
    const int32_t saved = o.blocks[0];
    o.blocks[0] = 100;
    CU_ASSERT(fails_with(cpu_attn_block_sparse(&c.bc, &c.tq, &c.tk, &c.tv, &good, &o.idx, NULL, NULL, &o.tout),
                         UPF_ERR_INVALID_ARG, "index"));
    o.blocks[0] = saved;
  }
  /* bf16 kbar under f32 q */
  {
    const int64_t sm[4] = {c.nreq, o.plan.max_key_blocks, c.hkv, c.d};
    upf_tensor kb = upf_test_view(o.kbar, UPF_DTYPE_BF16, 4, sm);
    CU_ASSERT(fails_with(cpu_sparse_index(&c.bc, &c.tq, &kb, &good, &o.idx), UPF_ERR_DTYPE, "kbar"));
  }
  /* the good call still passes */
  CU_ASSERT_EQUAL(sp_run(&c, 1, &good, &o), UPF_OK);
  sp_res_free(&o);
  sp_free(&c);
}

/* Scale: the plan's arithmetic in 64 bits, with nothing allocated. One request of 512K tokens at
 * Llama-3.1-8B's heads (Hq 32, Hkv 8, block_m 128, block_n 64): 16384 query tiles, 131072 segments,
 * 8192 key blocks, 2^30 index cells; 1M tokens would need 2^32 cells and is refused naming them, as is
 * block_n 128 there (2^31 cells, one past INT32_MAX). Only host lengths are read. */
static void test_sparse_plan_scale(void) {
  upf_sparse_params p = upf_sparse_params_default();
  p.block_m = 128, p.block_n = 64;
  int32_t cu[2] = {0, 1 << 19};
  const upf_attn_varlen v = {1, NULL, cu, NULL, cu};
  const upf_sparse_batch b = {&v, NULL};
  upf_sparse_plan plan;
  CU_ASSERT_EQUAL_FATAL(upf_sparse_plan_make(&b, 32, 8, &p, &plan), UPF_OK);
  CU_ASSERT_EQUAL(plan.total_q_tiles, 16384);
  CU_ASSERT_EQUAL(plan.num_segments, 131072);
  CU_ASSERT_EQUAL(plan.max_key_blocks, 8192);
  CU_ASSERT_EQUAL(plan.cu_q_tiles[1], 16384);
  upf_sparse_plan_free(&plan);
  cu[1] = 1 << 20;
  CU_ASSERT_EQUAL(upf_sparse_plan_make(&b, 32, 8, &p, &plan), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "4294967296 (segment, key block) cells"));
  p.block_n = 128;
  CU_ASSERT_EQUAL(upf_sparse_plan_make(&b, 32, 8, &p, &plan), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "2147483648"));
  p.block_m = 256; /* half the segments: 2^30 cells fit */
  CU_ASSERT_EQUAL(upf_sparse_plan_make(&b, 32, 8, &p, &plan), UPF_OK);
  upf_sparse_plan_free(&plan);
}

/* Neighbour sharing by hand: two requests (3 and 2 tiles), 2 KV heads; a request's first tile has no
 * predecessor, and the first tile of request 1 is not request 0's last tile's successor. */
static void test_sparse_neighbour_blocks_by_hand(void) {
  int32_t cu_tiles[3] = {0, 3, 5};
  const upf_sparse_plan plan = {2, 1, 2, 5, 8, 10, cu_tiles};
  /* segments h * 5 + m: head 0 tiles 0-4, head 1 tiles 0-4 */
  const int32_t lists[10][4] = {
      {0, 1, -1},    {0, 1, 2, -1}, {0, 2, 3, -1}, /* head 0, request 0: tile 1 shares 2 of 3, tile 2 2 of 3 */
      {0, 5, 6, -1}, {4, -1},                      /* request 1: tile 4 shares 0 of 1 (not tile 2's successor) */
      {7, -1},       {6, -1},       {-1},          /* head 1, request 0: 0 of 1, then 0 of 0 */
      {1, 2, -1},    {1, 2, -1},                   /* request 1: 2 of 2 */
  };
  int32_t row_ptr[11], blocks[32], n = 0;
  for (int s = 0; s < 10; s++) {
    row_ptr[s] = n;
    for (int i = 0; lists[s][i] >= 0; i++)
      blocks[n++] = lists[s][i];
  }
  row_ptr[10] = n;
  int64_t shared = -1, total = -1;
  upf_sparse_neighbour_blocks(&plan, row_ptr, blocks, &shared, &total);
  CU_ASSERT_EQUAL(total, 3 + 3 + 1 + 1 + 0 + 2);
  CU_ASSERT_EQUAL(shared, 2 + 2 + 0 + 0 + 0 + 2);
}

/* The fp8 variant's host rounding and scales (uniprefill/fp8.h), by hand: E4M3 has 3 mantissa bits, normals
 * from 2^-6, subnormals in steps of 2^-9, 448 the largest finite value; ties go to the even mantissa. */
static void test_fp8_e4m3_by_hand(void) {
  const struct {
    float x, want;
  } cases[] = {
      {0.0f, 0.0f},          {1.0f, 1.0f},           {1.0625f, 1.0f} /* tie: 1.000 even */,
      {1.1875f, 1.25f} /* tie: 1.010 even */,        {-3.3f, -3.25f} /* step 1/4 in [2, 4) */,
      {448.0f, 448.0f},      {470.0f, 448.0f} /* saturates */, {-1e9f, -448.0f},
      {0x1p-9f, 0x1p-9f} /* smallest subnormal */,    {0x1p-10f, 0.0f} /* tie with 0: even */,
      {0x3p-10f, 0x1p-8f} /* 1.5 steps: tie to 2 */,  {0x1.1p-6f, 0x1p-6f} /* 8.5 steps of 2^-9 */,
      {0x1.3p-6f, 0x1.4p-6f} /* 9.5 steps: 10 */,     {240.0f, 240.0f} /* step 16 in [128, 256) */,
      {232.0f, 224.0f} /* tie between 224 and 240: 224 (mantissa 110) */,
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const float got = upf_fp8_e4m3_round(cases[i].x);
    if (got != cases[i].want)
      printf("\n  e4m3(%a) = %a, want %a\n", cases[i].x, got, cases[i].want);
    CU_ASSERT_EQUAL(got, cases[i].want);
  }
  CU_ASSERT(isnan(upf_fp8_e4m3_round(NAN)));
  /* the scale: the least power of two s with amax <= 448 s */
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(448.0f), 1.0f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(448.5f), 2.0f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(224.0f), 0.5f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(224.5f), 1.0f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(1.0f), 0x1p-8f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(0.0f), 1.0f);
  CU_ASSERT_EQUAL(upf_fp8_pow2_scale(INFINITY), 1.0f);
  /* a value on the grid of scale s is on the grid of s / 2 as well (x / s doubled stays E4M3): lossless */
  for (float m = 0x1p-9f; m <= 224.0f; m = upf_fp8_e4m3_round(m * 1.07f) > m ? upf_fp8_e4m3_round(m * 1.07f) : m * 2)
    CU_ASSERT_EQUAL(upf_fp8_e4m3_round(2.0f * m), 2.0f * m);
}

static CU_TestInfo sparse_tests[] = {
    {"index by hand: kept blocks and S (g 2, D 2, partial contribution, sink, window, dense tile)",
     test_sparse_index_by_hand},
    {"block means by hand: tail block, past kv_len, bf16 rounding, block_n 128, paged", test_sparse_block_means_by_hand},
    {"index == loop recomputation; sink, window, causality, dense tiles (varlen, g 1-4, bn 64/128)",
     test_sparse_index_invariants},
    {"alpha 0 keeps every visible block and equals dense attention", test_sparse_alpha0_is_dense},
    {"dgemm path == naive oracle; paged == contiguous bit for bit (all three ops)", test_sparse_fast_naive_paged},
    {"all-dense requests never read kbar; scores may be NULL", test_sparse_dense_requests_skip_kbar},
    {"mean correction by hand (one row)", test_sparse_mean_correction_by_hand},
    {"mean correction is closer to dense than plain sparse (hot blocks)", test_sparse_mean_correction},
    {"bad inputs: status and a message naming the input", test_sparse_bad_inputs},
    {"scale: 512K tokens planned in 64 bits, 1M refused naming the index cells", test_sparse_plan_scale},
    {"fp8 variant: E4M3 rounding and power-of-two scales by hand", test_fp8_e4m3_by_hand},
    {"neighbour sharing of an index by hand (requests and heads apart)", test_sparse_neighbour_blocks_by_hand},
    CU_TEST_INFO_NULL,
};

void upf_register_sparse_tests(void) { upf_test_suite("sparse", NULL, NULL, sparse_tests); }
