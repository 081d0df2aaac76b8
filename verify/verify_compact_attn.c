/* Verify cases of CompactAttention's ops (uniprefill/compact_attn.h): compact.block_union and
 * compact.block_tables. On every backend: hand-computed golden cases (a union with the recent and chunk
 * blocks forced, GQA tiles of two KV heads, a chunk at the start of its request; block tables with a
 * clipped tail block and table columns past kv_len ignored) and bad inputs that must come back as their
 * status. On a backend under test: seeded batches against the reference, compared exactly (integer
 * outputs), with guard bytes after every output. */
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/compact_attn.h"
#include "uniprefill/rng.h"
#include "verify/verify.h"

#define MAX_REQS 6

/* ---- one call on a backend from host inputs, outputs back on the host ---- */

typedef struct {
  int B, hq, hkv;
  int32_t cu_q[MAX_REQS + 1], cu_kv[MAX_REQS + 1];
  upf_sparse_params p;
  upf_compact_params cp;
  int32_t *row_ptr, *blocks; /* host CSR (segments of upf_sparse_plan) */
} union_in;

static void union_batch(const union_in *in, upf_attn_varlen *vb, upf_sparse_batch *sb) {
  /* the op reads the host lengths only; the device arrays are never dereferenced */
  *vb = (upf_attn_varlen){in->B, in->cu_q, in->cu_q, in->cu_kv, in->cu_kv};
  *sb = (upf_sparse_batch){vb, NULL};
}

/* table (B, Hkv, nb) and counts (B, Hkv) into the host arrays; guard bytes checked. */
static upf_status union_run(const upf_backend *be, const union_in *in, int32_t nb, uint8_t *table, int32_t *counts) {
  upf_attn_varlen vb;
  upf_sparse_batch sb;
  union_batch(in, &vb, &sb);
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&sb, in->hq, in->hkv, &in->p, &plan));
  const int64_t segs = plan.num_segments, kept = in->row_ptr[segs];
  upf_sparse_plan_free(&plan);
  const size_t tbytes = (size_t)in->B * (size_t)in->hkv * (size_t)nb;
  upf_guarded rp = {0}, bl = {0}, tb = {0}, ct = {0};
  upf_status st = upf_guarded_alloc(be, (size_t)(segs + 1) * 4, &rp);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)(kept > 0 ? kept : 1) * 4, &bl);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, tbytes, &tb);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)in->B * (size_t)in->hkv * 4, &ct);
  if (st == UPF_OK)
    st = be->upload(rp.ptr, in->row_ptr, (size_t)(segs + 1) * 4);
  if (st == UPF_OK && kept > 0)
    st = be->upload(bl.ptr, in->blocks, (size_t)kept * 4);
  if (st == UPF_OK) {
    upf_tensor t;
    const int64_t shape[3] = {in->B, in->hkv, nb};
    upf_tensor_init(&t, tb.ptr, UPF_DTYPE_U8, 3, shape);
    upf_sparse_index idx = {rp.ptr, bl.ptr, NULL, kept};
    st = be->compact_block_union(&sb, in->hq, &in->p, &idx, &in->cp, &t, ct.ptr);
  }
  if (st == UPF_OK)
    st = be->synchronize();
  if (st == UPF_OK)
    st = be->download(table, tb.ptr, tbytes);
  if (st == UPF_OK)
    st = be->download(counts, ct.ptr, (size_t)in->B * (size_t)in->hkv * 4);
  if (st == UPF_OK)
    st = upf_guarded_check(&tb, "table");
  if (st == UPF_OK)
    st = upf_guarded_check(&ct, "counts");
  upf_guarded_free(&rp), upf_guarded_free(&bl), upf_guarded_free(&tb), upf_guarded_free(&ct);
  return st;
}

typedef struct {
  int B, hkv, P, block_n;
  int32_t cu_q[MAX_REQS + 1], kv_lens[MAX_REQS];
  int32_t *bt; /* (B, max_blocks) host */
  int32_t max_blocks, nb, out_max;
  uint8_t *table; /* (B, Hkv, nb) host */
} tables_in;

static upf_status tables_run(const upf_backend *be, const tables_in *in, int32_t *bt_out, int32_t *kv_out) {
  const size_t btb = (size_t)in->B * (size_t)in->max_blocks * 4, tb_bytes = (size_t)in->B * in->hkv * in->nb;
  const size_t ob = (size_t)in->hkv * in->B * in->out_max * 4, kb = (size_t)in->hkv * in->B * 4;
  upf_guarded kl = {0}, bt = {0}, tb = {0}, o = {0}, ok = {0};
  upf_status st = upf_guarded_alloc(be, (size_t)in->B * 4, &kl);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, btb, &bt);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, tb_bytes, &tb);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, ob, &o);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, kb, &ok);
  if (st == UPF_OK)
    st = be->upload(kl.ptr, in->kv_lens, (size_t)in->B * 4);
  if (st == UPF_OK)
    st = be->upload(bt.ptr, in->bt, btb);
  if (st == UPF_OK)
    st = be->upload(tb.ptr, in->table, tb_bytes);
  if (st == UPF_OK) {
    const upf_attn_paged pb = {in->B, in->cu_q, in->cu_q, kl.ptr, in->kv_lens, bt.ptr, in->bt, in->max_blocks, in->P};
    upf_tensor t;
    const int64_t shape[3] = {in->B, in->hkv, in->nb};
    upf_tensor_init(&t, tb.ptr, UPF_DTYPE_U8, 3, shape);
    const upf_compact_tables out = {o.ptr, ok.ptr, NULL, NULL, in->out_max};
    st = be->compact_block_tables(&pb, &t, in->block_n, &out);
  }
  if (st == UPF_OK)
    st = be->synchronize();
  if (st == UPF_OK)
    st = be->download(bt_out, o.ptr, ob);
  if (st == UPF_OK)
    st = be->download(kv_out, ok.ptr, kb);
  if (st == UPF_OK)
    st = upf_guarded_check(&o, "block_table");
  if (st == UPF_OK)
    st = upf_guarded_check(&ok, "kv_lens");
  upf_guarded_free(&kl), upf_guarded_free(&bt), upf_guarded_free(&tb), upf_guarded_free(&o), upf_guarded_free(&ok);
  return st;
}

/* ---- checks ---- */

static void check_init(upf_check *c, const char *op, const char *variant, const char *shape) {
  memset(c, 0, sizeof *c);
  snprintf(c->op, sizeof c->op, "%s", op);
  snprintf(c->variant, sizeof c->variant, "%s", variant);
  snprintf(c->dtype, sizeof c->dtype, "%s", strcmp(op, "compact.block_tables") ? "u8" : "i32");
  snprintf(c->shape, sizeof c->shape, "%s", shape);
}

static void record_status(upf_verify_ctx *ctx, const char *op, const char *variant, upf_status st) {
  upf_check c;
  check_init(&c, op, variant, "-");
  snprintf(c.detail, sizeof c.detail, "%s: %.200s", upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, &c);
}

/* Two exact comparisons folded into one check line. */
static void record_exact2(upf_verify_ctx *ctx, const char *op, const char *variant, const char *shape,
                          const void *a, const void *ra, int64_t na, size_t ea, const char *name_a, const void *b,
                          const void *rb, int64_t nb, size_t eb, const char *name_b) {
  upf_check c, c2;
  check_init(&c, op, variant, shape);
  upf_compare_exact(a, ra, na, ea, &c);
  check_init(&c2, op, variant, shape);
  upf_compare_exact(b, rb, nb, eb, &c2);
  if (!c.passed) {
    char detail[sizeof c.detail];
    memcpy(detail, c.detail, sizeof detail);
    snprintf(c.detail, sizeof c.detail, "%s: %.200s", name_a, detail);
  } else if (!c2.passed) {
    c.passed = 0;
    snprintf(c.detail, sizeof c.detail, "%s: %.200s", name_b, c2.detail);
  }
  upf_verify_record(ctx, &c);
}

/* ---- compact.block_union ---- */

/* Hand case: hq 4, hkv 2 (g 2), block_m 16, block_n 64, recent 1. Request 0: q_len 8, kv_len 300 (one
 * tile; the chunk is in block 4, recent block 3). Request 1: q_len 20 = kv_len (a chunk at the start: 40
 * packed rows, three tiles; forced block 0 only). Segments h0: s0 (r0), s1-s3 (r1); h1: s4 (r0), s5-s7. */
static void golden_union(upf_verify_ctx *ctx) {
  const char *op = "compact.block_union";
  union_in in = {.B = 2, .hq = 4, .hkv = 2, .cu_q = {0, 8, 28}, .cu_kv = {0, 300, 320}};
  in.p = upf_sparse_params_default();
  in.p.block_m = 16;
  in.cp.recent = 1;
  int32_t row_ptr[9] = {0, 2, 3, 4, 5, 6, 7, 8, 9}, blocks[9] = {0, 2, 0, 0, 0, 1, 0, 0, 0};
  in.row_ptr = row_ptr, in.blocks = blocks;
  const uint8_t want[20] = {1, 0, 1, 1, 1, /* r0 h0: index {0, 2}, recent 3, chunk 4 */
                            0, 1, 0, 1, 1, /* r0 h1: index {1} */
                            1, 0, 0, 0, 0, /* r1 h0: the chunk's block 0 */
                            1, 0, 0, 0, 0};
  const int32_t want_counts[4] = {4, 3, 1, 1};
  uint8_t got[20];
  int32_t counts[4];
  upf_status st = union_run(ctx->backend, &in, 5, got, counts);
  if (st != UPF_OK)
    return record_status(ctx, op, "golden recent+chunk, GQA", st);
  record_exact2(ctx, op, "golden recent+chunk, GQA", "B2 Hq4 Hkv2 nb5", got, want, 20, 1, "table", counts,
                want_counts, 4, 4, "counts");
  /* recent 0 and alpha-free: a request whose index keeps nothing but forced blocks */
  in.cp.recent = 3;
  int32_t none_ptr[9] = {0};
  in.row_ptr = none_ptr;
  const uint8_t want3[20] = {0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0};
  const int32_t want3_counts[4] = {4, 4, 1, 1};
  st = union_run(ctx->backend, &in, 5, got, counts);
  if (st != UPF_OK)
    return record_status(ctx, op, "golden empty index, recent 3", st);
  record_exact2(ctx, op, "golden empty index, recent 3", "B2 Hq4 Hkv2 nb5", got, want3, 20, 1, "table", counts,
                want3_counts, 4, 4, "counts");
}

static void errors_union(upf_verify_ctx *ctx) {
  const char *op = "compact.block_union";
  const upf_backend *be = ctx->backend;
  union_in in = {.B = 1, .hq = 2, .hkv = 1, .cu_q = {0, 4}, .cu_kv = {0, 100}};
  in.p = upf_sparse_params_default();
  in.cp = upf_compact_params_default();
  int32_t row_ptr[2] = {0, 1}, blocks[1] = {1};
  in.row_ptr = row_ptr, in.blocks = blocks;
  uint8_t tab[2];
  int32_t counts[1];
  /* an index block past the table */
  blocks[0] = 7;
  upf_verify_expect_status(ctx, op, "index block out of range", union_run(be, &in, 2, tab, counts),
                           UPF_ERR_INVALID_ARG);
  blocks[0] = 1;
  in.cp.recent = -1;
  upf_verify_expect_status(ctx, op, "recent < 0", union_run(be, &in, 2, tab, counts), UPF_ERR_INVALID_ARG);
  in.cp.recent = 2;
  upf_verify_expect_status(ctx, op, "table key_blocks != plan's", union_run(be, &in, 3, tab, counts), UPF_ERR_SHAPE);
  upf_attn_varlen vb;
  upf_sparse_batch sb;
  union_batch(&in, &vb, &sb);
  upf_tensor t;
  const int64_t shape[3] = {1, 1, 2};
  upf_tensor_init(&t, tab, UPF_DTYPE_U8, 3, shape);
  upf_sparse_index idx = {row_ptr, blocks, NULL, 1};
  upf_verify_expect_status(ctx, op, "NULL counts",
                           be->compact_block_union(&sb, 2, &in.p, &idx, &in.cp, &t, NULL), UPF_ERR_INVALID_ARG);
  t.dtype = UPF_DTYPE_I32;
  upf_verify_expect_status(ctx, op, "table not u8",
                           be->compact_block_union(&sb, 2, &in.p, &idx, &in.cp, &t, counts), UPF_ERR_DTYPE);
  t.dtype = UPF_DTYPE_U8;
  in.cu_kv[1] = 3; /* kv_len < q_len */
  union_batch(&in, &vb, &sb);
  upf_verify_expect_status(ctx, op, "kv_len < q_len",
                           be->compact_block_union(&sb, 2, &in.p, &idx, &in.cp, &t, counts), UPF_ERR_CU_SEQLENS);
}

/* A random CSR over the plan's segments: each visible block (<= last_k) kept with probability 0.3. */
static upf_status random_index(union_in *in, upf_rng *rng) {
  upf_attn_varlen vb;
  upf_sparse_batch sb;
  union_batch(in, &vb, &sb);
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&sb, in->hq, in->hkv, &in->p, &plan));
  in->row_ptr = malloc((size_t)(plan.num_segments + 1) * 4);
  in->blocks = malloc((size_t)plan.num_segments * (size_t)plan.max_key_blocks * 4 + 4);
  if (!in->row_ptr || !in->blocks) {
    upf_sparse_plan_free(&plan);
    return upf_fail(UPF_ERR_NOMEM, "verify compact.block_union: index");
  }
  int32_t n = 0;
  in->row_ptr[0] = 0;
  for (int h = 0; h < in->hkv; h++)
    for (int r = 0; r < in->B; r++)
      for (int m = 0; m < plan.cu_q_tiles[r + 1] - plan.cu_q_tiles[r]; m++) {
        const upf_sparse_tile t = upf_sparse_tile_at(r, m, in->cu_q[r + 1] - in->cu_q[r],
                                                     in->cu_kv[r + 1] - in->cu_kv[r], plan.group, &in->p);
        for (int b = 0; b <= t.last_k; b++)
          if (upf_rng_uniform(rng) < 0.3f)
            in->blocks[n++] = b;
        in->row_ptr[(int64_t)h * plan.total_q_tiles + plan.cu_q_tiles[r] + m + 1] = n;
      }
  upf_sparse_plan_free(&plan);
  return UPF_OK;
}

static void seeded_union(upf_verify_ctx *ctx) {
  const char *op = "compact.block_union";
  const int ncases = ctx->quick ? 3 : 8;
  for (int i = 0; i < ncases; i++) {
    upf_rng rng;
    upf_rng_seed(&rng, upf_verify_case_seed(op, i, 0));
    union_in in = {0};
    in.B = 1 + (int)upf_rng_below(&rng, MAX_REQS);
    in.hkv = 1 + (int)upf_rng_below(&rng, 4);
    in.hq = in.hkv * (1 << upf_rng_below(&rng, 3));
    in.p = upf_sparse_params_default();
    in.p.block_m = 16 << upf_rng_below(&rng, 4);
    in.p.block_n = i % 2 ? 128 : 64;
    in.cp.recent = (int32_t)upf_rng_below(&rng, 4);
    int32_t max_kv = 0;
    for (int r = 0; r < in.B; r++) {
      const int32_t q = 1 + (int32_t)upf_rng_below(&rng, i < 2 ? 200 : 1500);
      const int32_t ctxlen = upf_rng_below(&rng, 3) == 0 ? 0 : (int32_t)upf_rng_below(&rng, i < 2 ? 400 : 6000);
      in.cu_q[r + 1] = in.cu_q[r] + q, in.cu_kv[r + 1] = in.cu_kv[r] + q + ctxlen;
      max_kv = q + ctxlen > max_kv ? q + ctxlen : max_kv;
    }
    const int32_t nb = (max_kv + in.p.block_n - 1) / in.p.block_n;
    char shape[96], variant[48];
    snprintf(shape, sizeof shape, "B%d Hq%d Hkv%d bm%d bn%d nb%d", in.B, in.hq, in.hkv, in.p.block_m, in.p.block_n, nb);
    snprintf(variant, sizeof variant, "seeded %d recent %d", i, in.cp.recent);
    const size_t n = (size_t)in.B * (size_t)in.hkv;
    uint8_t *t_ref = malloc(n * (size_t)nb), *t_got = malloc(n * (size_t)nb);
    int32_t *c_ref = malloc(n * 4), *c_got = malloc(n * 4);
    upf_status st = t_ref && t_got && c_ref && c_got ? random_index(&in, &rng) : UPF_ERR_NOMEM;
    if (st == UPF_OK)
      st = union_run(upf_backend_cpu(), &in, nb, t_ref, c_ref);
    if (st == UPF_OK)
      st = union_run(ctx->backend, &in, nb, t_got, c_got);
    if (st != UPF_OK)
      record_status(ctx, op, variant, st);
    else
      record_exact2(ctx, op, variant, shape, t_got, t_ref, (int64_t)n * nb, 1, "table", c_got, c_ref, (int64_t)n, 4,
                    "counts");
    free(in.row_ptr), free(in.blocks), free(t_ref), free(t_got), free(c_ref), free(c_got);
  }
}

void upf_verify_compact_block_union(upf_verify_ctx *ctx) {
  golden_union(ctx);
  errors_union(ctx);
  if (upf_verify_case_wanted(ctx, NULL, 1))
    seeded_union(ctx);
}

/* ---- compact.block_tables ---- */

/* Hand case: P 16, block_n 32 (two pages a block), Hkv 2. Request 0: kv_len 100 (7 pages 10..16, tail
 * block 3 holds 4 keys in page 16); request 1: kv_len 40 (pages 20..22, block 1 holds 8 keys in page 22).
 * Table columns past a request's kv_len (r1, blocks 2 and 3) are set and must be ignored. */
static void golden_tables(upf_verify_ctx *ctx) {
  const char *op = "compact.block_tables";
  int32_t bt[14] = {10, 11, 12, 13, 14, 15, 16, 20, 21, 22, -1, -1, -1, -1};
  uint8_t table[16] = {1, 0, 1, 1, /* r0 h0 */ 0, 1, 0, 1, /* r0 h1 */ 1, 1, 0, 0, /* r1 h0 */ 0, 1, 1, 1};
  tables_in in = {.B = 2, .hkv = 2, .P = 16, .block_n = 32, .cu_q = {0, 10, 50}, .kv_lens = {100, 40},
                  .bt = bt, .max_blocks = 7, .nb = 4, .out_max = 7, .table = table};
  /* rows h * B + r: (r0, h0), (r1, h0), (r0, h1), (r1, h1) */
  const int32_t want_bt[28] = {10, 11, 14, 15, 16, -1, -1, 20, 21, 22, -1, -1, -1, -1,
                               12, 13, 16, -1, -1, -1, -1, 22, -1, -1, -1, -1, -1, -1};
  const int32_t want_kv[4] = {68, 40, 36, 8};
  int32_t got_bt[28], got_kv[4];
  upf_status st = tables_run(ctx->backend, &in, got_bt, got_kv);
  if (st != UPF_OK)
    return record_status(ctx, op, "golden tail clip", st);
  record_exact2(ctx, op, "golden tail clip", "B2 Hkv2 P16 bn32", got_bt, want_bt, 28, 4, "block_table", got_kv,
                want_kv, 4, 4, "kv_lens");
}

static void errors_tables(upf_verify_ctx *ctx) {
  const char *op = "compact.block_tables";
  int32_t bt[14] = {10, 11, 12, 13, 14, 15, 16, 20, 21, 22, -1, -1, -1, -1};
  uint8_t table[16] = {1};
  tables_in in = {.B = 2, .hkv = 2, .P = 16, .block_n = 32, .cu_q = {0, 10, 50}, .kv_lens = {100, 40},
                  .bt = bt, .max_blocks = 7, .nb = 4, .out_max = 7, .table = table};
  int32_t got_bt[28], got_kv[4];
  in.block_n = 24;
  upf_verify_expect_status(ctx, op, "block_n not a multiple of page_size",
                           tables_run(ctx->backend, &in, got_bt, got_kv), UPF_ERR_INVALID_ARG);
  in.block_n = 32, in.out_max = 6;
  upf_verify_expect_status(ctx, op, "out max_blocks too small", tables_run(ctx->backend, &in, got_bt, got_kv),
                           UPF_ERR_INVALID_ARG);
  in.out_max = 7, in.nb = 3;
  upf_verify_expect_status(ctx, op, "table narrower than kv_len", tables_run(ctx->backend, &in, got_bt, got_kv),
                           UPF_ERR_SHAPE);
  in.nb = 4, in.kv_lens[1] = 30;
  upf_verify_expect_status(ctx, op, "kv_len < q_len", tables_run(ctx->backend, &in, got_bt, got_kv),
                           UPF_ERR_CU_SEQLENS);
}

static void seeded_tables(upf_verify_ctx *ctx) {
  const char *op = "compact.block_tables";
  const int ncases = ctx->quick ? 3 : 8;
  for (int i = 0; i < ncases; i++) {
    upf_rng rng;
    upf_rng_seed(&rng, upf_verify_case_seed(op, i, 0));
    tables_in in = {0};
    in.B = 1 + (int)upf_rng_below(&rng, MAX_REQS);
    in.hkv = 1 + (int)upf_rng_below(&rng, 8);
    in.P = 16 << upf_rng_below(&rng, 3);
    in.block_n = in.P * (1 << upf_rng_below(&rng, 3));
    int32_t max_kv = 1, pages_total = 0;
    for (int r = 0; r < in.B; r++) {
      const int32_t q = 1 + (int32_t)upf_rng_below(&rng, 300);
      in.kv_lens[r] = q + (upf_rng_below(&rng, 3) == 0 ? 0 : (int32_t)upf_rng_below(&rng, i < 2 ? 500 : 9000));
      in.cu_q[r + 1] = in.cu_q[r] + q;
      max_kv = in.kv_lens[r] > max_kv ? in.kv_lens[r] : max_kv;
      pages_total += (in.kv_lens[r] + in.P - 1) / in.P;
    }
    in.max_blocks = (max_kv + in.P - 1) / in.P + 1;
    in.out_max = in.max_blocks + 1;
    in.nb = (max_kv + in.block_n - 1) / in.block_n + (int32_t)upf_rng_below(&rng, 2);
    const size_t nrow = (size_t)in.hkv * in.B;
    in.bt = malloc((size_t)in.B * in.max_blocks * 4);
    in.table = malloc(nrow * in.nb);
    int32_t *perm = malloc((size_t)pages_total * 4 + 4);
    int32_t *bt_ref = malloc(nrow * in.out_max * 4), *bt_got = malloc(nrow * in.out_max * 4);
    int32_t *kv_ref = malloc(nrow * 4), *kv_got = malloc(nrow * 4);
    upf_status st = in.bt && in.table && perm && bt_ref && bt_got && kv_ref && kv_got ? UPF_OK : UPF_ERR_NOMEM;
    if (st == UPF_OK) {
      /* pages handed out in a shuffled order, -1 in the unused columns */
      for (int32_t j = 0; j < pages_total; j++)
        perm[j] = j;
      for (int32_t j = pages_total - 1; j > 0; j--) {
        const int32_t k = (int32_t)upf_rng_below(&rng, (uint64_t)j + 1), x = perm[j];
        perm[j] = perm[k], perm[k] = x;
      }
      int32_t next = 0;
      for (int r = 0; r < in.B; r++)
        for (int32_t j = 0; j < in.max_blocks; j++)
          in.bt[r * in.max_blocks + j] = j < (in.kv_lens[r] + in.P - 1) / in.P ? perm[next++] : -1;
      for (size_t j = 0; j < nrow * in.nb; j++)
        in.table[j] = upf_rng_uniform(&rng) < 0.4f;
      for (int r = 0; r < in.B; r++) /* the tail block is always kept, as compact.block_union makes it */
        for (int h = 0; h < in.hkv; h++)
          in.table[((size_t)r * in.hkv + h) * in.nb + (in.kv_lens[r] - 1) / in.block_n] = 1;
      st = tables_run(upf_backend_cpu(), &in, bt_ref, kv_ref);
    }
    if (st == UPF_OK)
      st = tables_run(ctx->backend, &in, bt_got, kv_got);
    char shape[96], variant[48];
    snprintf(shape, sizeof shape, "B%d Hkv%d P%d bn%d nb%d", in.B, in.hkv, in.P, in.block_n, in.nb);
    snprintf(variant, sizeof variant, "seeded %d", i);
    if (st != UPF_OK)
      record_status(ctx, op, variant, st);
    else
      record_exact2(ctx, op, variant, shape, bt_got, bt_ref, (int64_t)nrow * in.out_max, 4, "block_table", kv_got,
                    kv_ref, (int64_t)nrow, 4, "kv_lens");
    free(in.bt), free(in.table), free(perm), free(bt_ref), free(bt_got), free(kv_ref), free(kv_got);
  }
}

void upf_verify_compact_block_tables(upf_verify_ctx *ctx) {
  golden_tables(ctx);
  errors_tables(ctx);
  if (upf_verify_case_wanted(ctx, NULL, 1))
    seeded_tables(ctx);
}
