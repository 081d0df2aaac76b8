/* Verify cases of the paged KV metadata ops (uniprefill/kv.h). On every backend: a hand-computed
 * golden case (a prefill row across a page boundary, a decode row at the last offset of its second
 * page, a one-token prefill row, an empty row) and bad inputs that must come back as their status.
 * For a backend under test: seeded batches (ragged prefill rows, decode rows, rows starting and
 * ending on page boundaries, large batches) compared exactly with the CPU reference, guard bytes after
 * every output. */
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/kv.h"
#include "uniprefill/rng.h"
#include "verify/verify.h"

static void check_begin(upf_check *c, const char *op, const char *variant, const char *shape) {
  memset(c, 0, sizeof *c);
  snprintf(c->op, sizeof c->op, "%s", op);
  snprintf(c->variant, sizeof c->variant, "%s", variant);
  snprintf(c->dtype, sizeof c->dtype, "i32");
  snprintf(c->shape, sizeof c->shape, "%s", shape);
}

static void record_failure(upf_verify_ctx *ctx, upf_check *c, upf_status st, const char *what) {
  c->passed = 0;
  snprintf(c->detail, sizeof c->detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, c);
}

/* A host batch: rows with lengths and starts, block tables of distinct pages. */
typedef struct {
  int32_t B, P, max_blocks;
  int64_t num_pages;
  int32_t *cu, *start, *table; /* (B+1), (B), (B, max_blocks) */
} slot_problem;

/* Runs the op on ctx's backend and the reference; *want (T) is filled when want_ref is NULL. */
static upf_status slot_run(const upf_backend *be, const slot_problem *pb, int32_t *got) {
  const int64_t T = pb->cu[pb->B], nt = (int64_t)pb->B * pb->max_blocks;
  void *dcu = NULL, *dstart = NULL, *dtable = NULL;
  upf_guarded g = {0};
  upf_status st = be->alloc(&dcu, (size_t)(pb->B + 1) * 4);
  if (st == UPF_OK)
    st = be->alloc(&dstart, (size_t)pb->B * 4);
  if (st == UPF_OK)
    st = be->alloc(&dtable, (size_t)(nt ? nt : 1) * 4);
  if (st == UPF_OK)
    st = be->upload(dcu, pb->cu, (size_t)(pb->B + 1) * 4);
  if (st == UPF_OK)
    st = be->upload(dstart, pb->start, (size_t)pb->B * 4);
  if (st == UPF_OK && nt)
    st = be->upload(dtable, pb->table, (size_t)nt * 4);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)T * 4, &g);
  const upf_kv_slot_batch b = {pb->B, dcu, pb->cu, dstart, pb->start, dtable, pb->table, pb->max_blocks, pb->P,
                               pb->num_pages};
  if (st == UPF_OK)
    st = be->kv_slot_mapping(&b, g.ptr);
  if (st == UPF_OK)
    st = upf_guarded_check(&g, "slot_mapping");
  if (st == UPF_OK)
    st = be->download(got, g.ptr, (size_t)T * 4);
  if (dcu)
    be->release(dcu);
  if (dstart)
    be->release(dstart);
  if (dtable)
    be->release(dtable);
  upf_guarded_free(&g);
  return st;
}

static void slot_golden(upf_verify_ctx *ctx, const char *op) {
  /* P = 4. Row 0: prefill of 6 tokens, pages [5, 2] -> slots 20..23, 8, 9. Row 1: decode row at
   * logical index 7 (kv_len 7), pages [1, 3] -> page 3, offset 3: 15. Row 2: empty. Row 3: one-token
   * prefill row, page [0] -> 0. */
  int32_t cu[] = {0, 6, 7, 7, 8}, start[] = {0, 7, 0, 0}, table[] = {5, 2, 1, 3, 4, 4, 0, 4};
  const int32_t want[] = {20, 21, 22, 23, 8, 9, 15, 0};
  const slot_problem pb = {4, 4, 2, 6, cu, start, table};
  int32_t got[8];
  upf_check c;
  check_begin(&c, op, "golden", "B=4 P=4 T=8");
  upf_status st = slot_run(ctx->backend, &pb, got);
  if (st != UPF_OK)
    return record_failure(ctx, &c, st, "golden");
  upf_compare_exact(got, want, 8, 4, &c);
  upf_verify_record(ctx, &c);
}

/* Seeded cases: rows kinds mixed as the sessions run them. */
typedef struct {
  const char *name;
  int32_t B, P, decode_every; /* every decode_every-th row is a decode row (0: none) */
  int32_t max_len;            /* prefill rows: 1 .. max_len tokens */
  int32_t boundary;           /* 1: lengths and starts on multiples of P */
  int quick;
} slot_case;

static const slot_case slot_cases[] = {
    {"ragged prefill", 7, 16, 0, 300, 0, 1},
    {"mixed decode", 33, 16, 2, 200, 0, 1},
    {"page boundaries", 9, 8, 3, 64, 1, 0},
    {"decode only", 257, 16, 1, 1, 0, 0},
    {"P=1", 5, 1, 2, 40, 0, 0},
    {"large batch", 64, 16, 4, 4096, 0, 0},
};

static void slot_case_run(upf_verify_ctx *ctx, const char *op, const slot_case *sc, int index) {
  upf_rng rng;
  upf_rng_seed(&rng, upf_verify_case_seed(op, index, (uint64_t)sc->P));
  slot_problem pb = {sc->B, sc->P, 0, 0, NULL, NULL, NULL};
  pb.cu = malloc((size_t)(sc->B + 1) * 4), pb.start = malloc((size_t)sc->B * 4);
  pb.cu[0] = 0;
  for (int32_t r = 0; r < sc->B; r++) {
    const int decode = sc->decode_every && r % sc->decode_every == 0;
    int32_t n = decode ? 1 : 1 + (int32_t)upf_rng_below(&rng, (uint64_t)sc->max_len);
    int32_t s = decode ? (int32_t)upf_rng_below(&rng, 3000) : 0;
    if (sc->boundary) {
      n = decode ? 1 : (n + sc->P - 1) / sc->P * sc->P;
      s = decode ? s / sc->P * sc->P + (r % 2 ? sc->P - 1 : 0) : 0; /* first or last offset of a page */
    }
    pb.cu[r + 1] = pb.cu[r] + n, pb.start[r] = s;
    const int32_t pages = (s + n + sc->P - 1) / sc->P;
    pb.max_blocks = pages > pb.max_blocks ? pages : pb.max_blocks;
  }
  pb.num_pages = (int64_t)sc->B * pb.max_blocks + 3;
  const int64_t T = pb.cu[sc->B], nt = (int64_t)sc->B * pb.max_blocks;
  /* distinct pages: a shuffled identity */
  int32_t *perm = malloc((size_t)pb.num_pages * 4);
  for (int64_t i = 0; i < pb.num_pages; i++)
    perm[i] = (int32_t)i;
  for (int64_t i = pb.num_pages - 1; i > 0; i--) {
    const int64_t j = (int64_t)upf_rng_below(&rng, (uint64_t)i + 1);
    const int32_t t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  pb.table = malloc((size_t)nt * 4);
  memcpy(pb.table, perm, (size_t)nt * 4);
  int32_t *want = malloc((size_t)T * 4), *got = malloc((size_t)T * 4);
  upf_check c;
  char shape[96];
  snprintf(shape, sizeof shape, "B=%d P=%d T=%lld max_blocks=%d", sc->B, sc->P, (long long)T, pb.max_blocks);
  check_begin(&c, op, sc->name, shape);
  const upf_kv_slot_batch hb = {pb.B, pb.cu, pb.cu, pb.start, pb.start, pb.table, pb.table, pb.max_blocks, pb.P,
                                pb.num_pages};
  upf_status st = cpu_kv_slot_mapping(&hb, want);
  if (st == UPF_OK)
    st = slot_run(ctx->backend, &pb, got);
  if (st != UPF_OK) {
    record_failure(ctx, &c, st, sc->name);
  } else {
    upf_compare_exact(got, want, T, 4, &c);
    upf_verify_record(ctx, &c);
  }
  free(perm), free(pb.table), free(pb.cu), free(pb.start), free(want), free(got);
}

static void slot_errors(upf_verify_ctx *ctx, const char *op) {
  const upf_backend *be = ctx->backend;
  int32_t cu[] = {0, 5}, start[] = {0}, table[] = {0, 9}, bad_start[] = {-1}, late_start[] = {4};
  int32_t *out = NULL;
  if (be->alloc((void **)&out, 64) != UPF_OK)
    return;
  /* host copies only matter for the checks, which run before any device access */
  upf_kv_slot_batch b = {1, cu, cu, start, start, table, table, 2, 4, 3};
  upf_verify_expect_status(ctx, op, "page 9 of 3", be->kv_slot_mapping(&b, out), UPF_ERR_INVALID_ARG);
  b.start = b.start_host = bad_start;
  upf_verify_expect_status(ctx, op, "negative start", be->kv_slot_mapping(&b, out), UPF_ERR_INVALID_ARG);
  b.start = b.start_host = late_start, b.num_pages = 10;
  upf_verify_expect_status(ctx, op, "index 8 past 2 blocks of 4", be->kv_slot_mapping(&b, out), UPF_ERR_INVALID_ARG);
  b.start = b.start_host = start, b.page_size = 0;
  upf_verify_expect_status(ctx, op, "page size 0", be->kv_slot_mapping(&b, out), UPF_ERR_INVALID_ARG);
  be->release(out);
}

void upf_verify_kv_slot_mapping(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_KV_SLOT_MAPPING);
  slot_golden(ctx, op);
  slot_errors(ctx, op);
  for (int i = 0; i < (int)(sizeof slot_cases / sizeof *slot_cases); i++)
    if (upf_verify_case_wanted(ctx, slot_cases[i].name, slot_cases[i].quick))
      slot_case_run(ctx, op, &slot_cases[i], i);
}

/* ---- scatter ---- */

static upf_status scatter_run(const upf_backend *be, const unsigned char *src, int64_t n, int64_t row_bytes,
                              const int32_t *index, const unsigned char *dst0, int64_t dst_rows, unsigned char *got) {
  void *dsrc = NULL, *didx = NULL;
  upf_guarded g = {0};
  upf_status st = be->alloc(&dsrc, (size_t)(n * row_bytes + 1));
  if (st == UPF_OK)
    st = be->alloc(&didx, (size_t)(n + 1) * 4);
  if (st == UPF_OK)
    st = be->upload(dsrc, src, (size_t)(n * row_bytes));
  if (st == UPF_OK)
    st = be->upload(didx, index, (size_t)n * 4);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)(dst_rows * row_bytes), &g);
  if (st == UPF_OK)
    st = be->upload(g.ptr, dst0, (size_t)(dst_rows * row_bytes));
  if (st == UPF_OK)
    st = be->scatter_rows(dsrc, n, row_bytes, didx, index, g.ptr, dst_rows);
  if (st == UPF_OK)
    st = upf_guarded_check(&g, "scatter destination");
  if (st == UPF_OK)
    st = be->download(got, g.ptr, (size_t)(dst_rows * row_bytes));
  if (dsrc)
    be->release(dsrc);
  if (didx)
    be->release(didx);
  upf_guarded_free(&g);
  return st;
}

void upf_verify_scatter_rows(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SCATTER_ROWS);
  const upf_backend *be = ctx->backend;
  { /* golden: rows "ab", "cd" to rows 2 and 0 of "..", "..", ".." */
    const unsigned char src[] = "abcd", dst0[] = "......";
    const int32_t index[] = {2, 0};
    unsigned char got[6];
    upf_check c;
    check_begin(&c, op, "golden", "n=2 rows=3 bytes=2");
    upf_status st = scatter_run(be, src, 2, 2, index, dst0, 3, got);
    if (st != UPF_OK) {
      record_failure(ctx, &c, st, "golden");
    } else {
      upf_compare_exact(got, "cd..ab", 6, 1, &c);
      upf_verify_record(ctx, &c);
    }
  }
  {
    int32_t dup[] = {1, 1}, out_of_range[] = {0, 3};
    unsigned char buf[16];
    upf_verify_expect_status(ctx, op, "two rows into row 1", be->scatter_rows(buf, 2, 2, dup, dup, buf + 8, 3),
                             UPF_ERR_INVALID_ARG);
    upf_verify_expect_status(ctx, op, "row 3 of 3", be->scatter_rows(buf, 2, 2, out_of_range, out_of_range, buf + 8, 3),
                             UPF_ERR_INVALID_ARG);
  }
  /* seeded: Gated DeltaNet state rows (fp32 conv and recurrent states), odd byte counts */
  static const int64_t row_bytes_set[] = {4 * 3 * 2 * 1024, 4 * 4 * 32 * 32, 6, 1};
  for (int s = 0; s < 4; s++) {
    if (!upf_verify_case_wanted(ctx, NULL, s < 2))
      continue;
    upf_rng rng;
    upf_rng_seed(&rng, upf_verify_case_seed(op, s, (uint64_t)row_bytes_set[s]));
    const int64_t rows = 65, rb = row_bytes_set[s];
    int64_t n = 0;
    int32_t index[65];
    for (int64_t i = 0; i < rows; i++)
      if (upf_rng_uniform(&rng) < 0.5f)
        index[n++] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) { /* destinations in random order */
      const int64_t j = (int64_t)upf_rng_below(&rng, (uint64_t)i + 1);
      const int32_t t = index[i];
      index[i] = index[j], index[j] = t;
    }
    unsigned char *src = malloc((size_t)(n * rb + 1)), *dst0 = malloc((size_t)(rows * rb));
    unsigned char *want = malloc((size_t)(rows * rb)), *got = malloc((size_t)(rows * rb));
    for (int64_t i = 0; i < n * rb; i++)
      src[i] = (unsigned char)upf_rng_next(&rng);
    for (int64_t i = 0; i < rows * rb; i++)
      dst0[i] = (unsigned char)upf_rng_next(&rng);
    memcpy(want, dst0, (size_t)(rows * rb));
    upf_check c;
    char shape[96];
    snprintf(shape, sizeof shape, "n=%lld rows=%lld bytes=%lld", (long long)n, (long long)rows, (long long)rb);
    check_begin(&c, op, "random half", shape);
    upf_status st = cpu_scatter_rows(src, n, rb, index, index, want, rows);
    if (st == UPF_OK)
      st = scatter_run(be, src, n, rb, index, dst0, rows, got);
    if (st != UPF_OK) {
      record_failure(ctx, &c, st, "random half");
    } else {
      upf_compare_exact(got, want, rows * rb, 1, &c);
      upf_verify_record(ctx, &c);
    }
    free(src), free(dst0), free(want), free(got);
  }
}
