/* Verify cases of the selection ops. For a backend under test other than the CPU, every stage and
 * the whole pipeline are run on a seeded shape set and compared with the CPU reference (SPEC 7);
 * for the CPU itself, the hand-computed golden cases, the invariants and the agreement of the
 * stage-by-stage chain (fp32 between stages) with the double pipeline. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/compact.h"
#include "ref_cpu/select.h"
#include "uniprefill/rng.h"
#include "verify/select_checks.h"
#include "verify/select_inputs.h"
#include "verify/verify.h"

enum { CASE_QUICK = 1, CASE_STAGES = 2, CASE_LARGE = 4 };

typedef struct {
  const char *name;
  int32_t lens[8];
  int32_t num_reqs;
  int32_t hq, hkv, d;
  upf_dist dist;
  int32_t block, sink, last_q, topk; /* 0: default */
  float p;                           /* 0: default */
  unsigned flags;
  int32_t gen_max; /* > 0: num_reqs (up to MAX_GEN_REQS) lengths made by case_lens, lens unused */
} select_case;

/* The shape set of the issue: n = 1, n <= sink+L, n not a multiple of G, ragged batches mixing
 * decode and prefill rows, GQA 1/4/8, D = 64/128/256, structured and random inputs. */
static const select_case select_cases[] = {
    {"decode row n=1", {1}, 1, 8, 8, 64, UPF_DIST_RANDOM, .flags = CASE_QUICK | CASE_STAGES},
    {"short n=sink+L", {256}, 1, 8, 2, 128, UPF_DIST_SINK, .flags = CASE_QUICK | CASE_STAGES},
    {"just scored n=sink+L+1", {257}, 1, 8, 2, 128, UPF_DIST_HEAVY, .flags = CASE_QUICK | CASE_STAGES},
    {"ragged decode+prefill", {1, 300, 1, 1000, 1, 777}, 6, 32, 8, 128, UPF_DIST_HEAVY, .flags = CASE_STAGES},
    {"gqa1 d64 sink", {2000}, 1, 4, 4, 64, UPF_DIST_SINK, .flags = CASE_STAGES},
    {"gqa8 d256 local", {1500, 1}, 2, 16, 2, 256, UPF_DIST_LOCAL, .flags = CASE_STAGES},
    {"gqa4 d128 random", {3000}, 1, 8, 2, 128, UPF_DIST_RANDOM, .flags = CASE_STAGES},
    {"odd head dim D=33", {700, 1, 300}, 3, 4, 2, 33, UPF_DIST_HEAVY, .flags = CASE_QUICK | CASE_STAGES},
    {"all keys tie", {1024, 640}, 2, 4, 1, 64, UPF_DIST_TIES, .flags = CASE_QUICK | CASE_STAGES},
    {"top-k K=8", {2048}, 1, 8, 2, 128, UPF_DIST_HEAVY, .topk = 8, .flags = CASE_STAGES},
    {"G=16 sink=16 L=32", {700, 45}, 2, 4, 1, 64, UPF_DIST_HEAVY, 16, 16, 32, .flags = CASE_QUICK | CASE_STAGES},
    {"G=256", {1500}, 1, 4, 2, 128, UPF_DIST_LOCAL, 256, .flags = CASE_STAGES},
    {"p=1 keeps all", {900}, 1, 4, 2, 64, UPF_DIST_RANDOM, .p = 1.0f, .flags = CASE_STAGES},
    {"p=0.5 heavy", {1800}, 1, 8, 2, 128, UPF_DIST_HEAVY, .p = 0.5f, .flags = CASE_STAGES},
    {"L=64 G=32", {4097, 1, 95}, 3, 8, 1, 128, UPF_DIST_SINK, 32, 64, 64},
    {"long n=8192 llama heads", {8192}, 1, 32, 8, 128, UPF_DIST_HEAVY},
    {"long n=16384 random", {16384}, 1, 8, 2, 128, UPF_DIST_RANDOM},
    {"batch of 8 mixed", {513, 1, 129, 2049, 1, 4096, 300, 1}, 8, 8, 2, 64, UPF_DIST_LOCAL},
    {"llama 128K one request", {131072}, 1, 32, 8, 128, UPF_DIST_HEAVY, .flags = CASE_LARGE},
    /* scale (issue 28): 2^20 tokens in one request (score and index arithmetic past 2^31 elements of the
     * keys' head-major view), and a batch of 256 requests of 1-2048 tokens */
    {"llama 1M one request", {1048576}, 1, 32, 8, 128, UPF_DIST_HEAVY, .flags = CASE_LARGE},
    {"256 requests of 1-2048", {0}, 256, 32, 8, 128, UPF_DIST_LOCAL, .flags = CASE_LARGE, .gen_max = 2048},
};
#define NUM_SELECT_CASES ((int)(sizeof select_cases / sizeof select_cases[0]))

static const upf_dtype case_dtypes[] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};

enum { MAX_GEN_REQS = 256 };

/* The case's lengths: its lens, or for a generated batch every fourth request a decode row (1) and the
 * others spread over 2 .. gen_max by a fixed stride (no randomness: the case is the same everywhere). */
static const int32_t *case_lens(const select_case *c, int32_t (*buf)[MAX_GEN_REQS]) {
  if (!c->gen_max)
    return c->lens;
  for (int32_t r = 0; r < c->num_reqs && r < MAX_GEN_REQS; r++)
    (*buf)[r] = r % 4 == 3 ? 1 : 2 + (int32_t)(((int64_t)r * 7919) % (c->gen_max - 1));
  return *buf;
}

static upf_select_params case_params(const select_case *c) {
  upf_select_params p = upf_select_params_default();
  if (c->block)
    p.block = c->block;
  if (c->sink)
    p.sink = c->sink;
  if (c->last_q)
    p.last_q = c->last_q;
  if (c->topk)
    p.topk = c->topk;
  if (c->p > 0.0f)
    p.p = c->p;
  return p;
}

static int case_selected(const upf_verify_ctx *ctx, const select_case *c, unsigned need) {
  if ((c->flags & need) != need)
    return 0;
  if (ctx->quick && !(c->flags & CASE_QUICK))
    return 0;
  if (ctx->case_filter && !strstr(c->name, ctx->case_filter))
    return 0;
  if ((c->flags & CASE_LARGE) && upf_verify_on_reference(ctx))
    return 0; /* the double reference at 128K only runs where a device is checked against it */
  return 1;
}

/* One case on the backend under test: the host problem, its copies in backend memory. */
typedef struct {
  const select_case *c;
  upf_select_params params;
  upf_select_problem pb;
  upf_select_inputs host, dev;
  int64_t num_tokens, num_blocks, num_scores;
  int64_t *block_offset, *score_offset;
  void *dev_q, *dev_k, *dev_cu;
} case_run;

static void case_check_init(const case_run *cr, const char *op, const char *variant, upf_check *check) {
  memset(check, 0, sizeof *check);
  snprintf(check->op, sizeof check->op, "%s", op);
  snprintf(check->variant, sizeof check->variant, "%s%s%s", cr->c->name, variant ? ": " : "", variant ? variant : "");
  snprintf(check->dtype, sizeof check->dtype, "%s", upf_dtype_name(cr->pb.q.dtype));
  snprintf(check->shape, sizeof check->shape, "T=%lld B=%d Hq=%d/%d D=%d", (long long)cr->num_tokens, cr->c->num_reqs,
           cr->c->hq, cr->c->hkv, cr->c->d);
}

static void record_status(upf_verify_ctx *ctx, upf_check *check, upf_status st, const char *what) {
  check->passed = 0;
  snprintf(check->detail, sizeof check->detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, check);
}


static upf_status case_setup(const upf_backend *be, const select_case *c, upf_dtype dtype, case_run *cr) {
  memset(cr, 0, sizeof *cr);
  cr->c = c;
  cr->params = case_params(c);
  uint64_t seed = 0x5e1ec7ull * 1315423911ull + (uint64_t)(c - select_cases) * 7919u + (uint64_t)dtype;
  int32_t gen[MAX_GEN_REQS];
  UPF_TRY(upf_select_problem_make(&cr->pb, case_lens(c, &gen), c->num_reqs, c->hq, c->hkv, c->d, dtype, c->dist,
                                  seed));
  cr->host = upf_select_problem_inputs(&cr->pb);
  cr->num_tokens = cr->pb.q.shape[0];
  cr->block_offset = malloc((size_t)(c->num_reqs + 1) * sizeof *cr->block_offset);
  cr->score_offset = malloc((size_t)(c->num_reqs + 1) * sizeof *cr->score_offset);
  if (!cr->block_offset || !cr->score_offset)
    return upf_fail(UPF_ERR_NOMEM, "verify: offsets");
  upf_select_block_offsets(cr->pb.cu_seqlens, c->num_reqs, cr->params.block, cr->block_offset);
  upf_select_score_offsets(cr->pb.cu_seqlens, c->num_reqs, c->hq, &cr->params, cr->score_offset);
  cr->num_blocks = cr->block_offset[c->num_reqs];
  cr->num_scores = cr->score_offset[c->num_reqs];
  size_t qb = (size_t)upf_tensor_numel(&cr->pb.q) * upf_dtype_size(dtype);
  size_t kb = (size_t)upf_tensor_numel(&cr->pb.k) * upf_dtype_size(dtype);
  size_t cb = (size_t)(c->num_reqs + 1) * sizeof(int32_t);
  UPF_TRY(be->alloc(&cr->dev_q, qb));
  UPF_TRY(be->alloc(&cr->dev_k, kb));
  UPF_TRY(be->alloc(&cr->dev_cu, cb));
  UPF_TRY(be->upload(cr->dev_q, cr->pb.q.data, qb));
  UPF_TRY(be->upload(cr->dev_k, cr->pb.k.data, kb));
  UPF_TRY(be->upload(cr->dev_cu, cr->pb.cu_seqlens, cb));
  cr->dev = cr->host;
  cr->dev.q.data = cr->dev_q;
  cr->dev.k.data = cr->dev_k;
  cr->dev.cu_seqlens = cr->dev_cu;
  return UPF_OK;
}

static void case_release(const upf_backend *be, case_run *cr) {
  if (cr->dev_q)
    be->release(cr->dev_q);
  if (cr->dev_k)
    be->release(cr->dev_k);
  if (cr->dev_cu)
    be->release(cr->dev_cu);
  free(cr->block_offset);
  free(cr->score_offset);
  upf_select_problem_free(&cr->pb);
}

/* Runs fn(ctx, case) over every selected case and dtype, handling setup failures as failed checks. */
typedef void (*case_fn)(upf_verify_ctx *ctx, case_run *cr, const char *op);

static void for_each_case(upf_verify_ctx *ctx, const char *op, unsigned need, case_fn fn) {
  for (int i = 0; i < NUM_SELECT_CASES; i++) {
    const select_case *c = &select_cases[i];
    if (!case_selected(ctx, c, need))
      continue;
    for (size_t d = 0; d < sizeof case_dtypes / sizeof case_dtypes[0]; d++) {
      case_run cr;
      upf_status st = case_setup(ctx->backend, c, case_dtypes[d], &cr);
      if (st != UPF_OK) {
        upf_check check;
        case_check_init(&cr, op, "setup", &check);
        record_status(ctx, &check, st, "setup");
      } else {
        fn(ctx, &cr, op);
      }
      case_release(ctx->backend, &cr);
    }
  }
}

static void run_goldens(upf_verify_ctx *ctx, const char *op, const upf_golden *goldens, int count) {
  for (int i = 0; i < count; i++) {
    upf_check check;
    upf_select_golden_run(ctx->backend, goldens[i], &check);
    snprintf(check.op, sizeof check.op, "%s", op);
    upf_verify_record(ctx, &check);
  }
}

/* Guarded output on the backend under test, downloaded into a host array. */
static upf_status fetch_guarded(upf_guarded *g, void *host, const char *name) {
  UPF_TRY(upf_guarded_check(g, name));
  return g->backend->download(host, g->ptr, g->bytes);
}

static double *to_double(const float *x, int64_t n) {
  double *y = malloc((size_t)(n ? n : 1) * sizeof *y);
  for (int64_t i = 0; y && i < n; i++)
    y[i] = x[i];
  return y;
}

/* ---- stage 1 ---- */

static void part_gemm_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  int64_t n = cr->num_scores;
  float *ref = malloc((size_t)(n ? n : 1) * sizeof *ref), *got = malloc((size_t)(n ? n : 1) * sizeof *got);
  upf_guarded g = {0};
  upf_status st = cpu_select_part_gemm(&cr->host, &cr->params, ref);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)n * sizeof(float), &g);
  if (st == UPF_OK)
    st = be->select_part_gemm(&cr->dev, &cr->params, g.ptr);
  if (st == UPF_OK)
    st = fetch_guarded(&g, got, "scores");
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "part_gemm");
  } else {
    double *refd = to_double(ref, n);
    upf_compare_f32(got, refd, n, upf_tolerance_for(UPF_DTYPE_F32), &check);
    free(refd);
    upf_verify_record(ctx, &check);
  }
  upf_guarded_free(&g);
  free(ref), free(got);
}

void upf_verify_select_part_gemm(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_PART_GEMM);
  static const upf_golden goldens[] = {UPF_GOLDEN_PART_GEMM};
  run_goldens(ctx, op, goldens, 1);
  if (!upf_verify_on_reference(ctx))
    for_each_case(ctx, op, CASE_STAGES, part_gemm_case);
}

/* ---- stage 2 ---- */

static void block_softmax_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  int64_t n = cr->num_scores, T = cr->num_tokens;
  float *scores = malloc((size_t)(n ? n : 1) * sizeof *scores);
  float *ref = malloc((size_t)T * sizeof *ref), *got = malloc((size_t)T * sizeof *got);
  void *dev_scores = NULL;
  upf_guarded g = {0};
  upf_status st = cpu_select_part_gemm(&cr->host, &cr->params, scores);
  if (st == UPF_OK)
    st = cpu_select_block_softmax(&cr->host, &cr->params, scores, ref);
  if (st == UPF_OK)
    st = be->alloc(&dev_scores, (size_t)(n ? n : 1) * sizeof(float));
  if (st == UPF_OK)
    st = be->upload(dev_scores, scores, (size_t)n * sizeof(float));
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)T * sizeof(float), &g);
  if (st == UPF_OK)
    st = be->select_block_softmax(&cr->dev, &cr->params, dev_scores, g.ptr);
  if (st == UPF_OK)
    st = fetch_guarded(&g, got, "token_mass");
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "block_softmax");
  } else {
    double *refd = to_double(ref, T);
    upf_compare_f32(got, refd, T, upf_tolerance_for(UPF_DTYPE_F32), &check);
    free(refd);
    upf_verify_record(ctx, &check);
  }
  if (dev_scores)
    be->release(dev_scores);
  upf_guarded_free(&g);
  free(scores), free(ref), free(got);
}

void upf_verify_select_block_softmax(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_BLOCK_SOFTMAX);
  static const upf_golden goldens[] = {UPF_GOLDEN_BLOCK_SOFTMAX};
  run_goldens(ctx, op, goldens, 1);
  if (!upf_verify_on_reference(ctx))
    for_each_case(ctx, op, CASE_STAGES, block_softmax_case);
}

/* ---- stage 3 ---- */

/* Reference token mass of a case, computed by the CPU pipeline stages (fp32 result). */
static upf_status reference_token_mass(case_run *cr, float *token_mass) {
  int64_t n = cr->num_scores;
  float *scores = malloc((size_t)(n ? n : 1) * sizeof *scores);
  if (!scores)
    return upf_fail(UPF_ERR_NOMEM, "verify: scores");
  upf_status st = cpu_select_part_gemm(&cr->host, &cr->params, scores);
  if (st == UPF_OK)
    st = cpu_select_block_softmax(&cr->host, &cr->params, scores, token_mass);
  free(scores);
  return st;
}

static void block_reduce_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  int64_t T = cr->num_tokens, nb = cr->num_blocks;
  float *t = malloc((size_t)T * sizeof *t), *ref = malloc((size_t)nb * sizeof *ref), *got = malloc((size_t)nb * sizeof *got);
  void *dev_t = NULL;
  upf_guarded g = {0};
  upf_status st = reference_token_mass(cr, t);
  if (st == UPF_OK)
    st = cpu_select_block_reduce(&cr->host, &cr->params, t, ref);
  if (st == UPF_OK)
    st = be->alloc(&dev_t, (size_t)T * sizeof(float));
  if (st == UPF_OK)
    st = be->upload(dev_t, t, (size_t)T * sizeof(float));
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)nb * sizeof(float), &g);
  if (st == UPF_OK)
    st = be->select_block_reduce(&cr->dev, &cr->params, dev_t, g.ptr);
  if (st == UPF_OK)
    st = fetch_guarded(&g, got, "block_score");
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "block_reduce");
  } else {
    double *refd = to_double(ref, nb);
    upf_compare_f32(got, refd, nb, upf_tolerance_for(UPF_DTYPE_F32), &check);
    free(refd);
    upf_verify_record(ctx, &check);
  }
  if (dev_t)
    be->release(dev_t);
  upf_guarded_free(&g);
  free(t), free(ref), free(got);
}

void upf_verify_select_block_reduce(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_BLOCK_REDUCE);
  static const upf_golden goldens[] = {UPF_GOLDEN_BLOCK_REDUCE};
  run_goldens(ctx, op, goldens, 1);
  if (!upf_verify_on_reference(ctx))
    for_each_case(ctx, op, CASE_STAGES, block_reduce_case);
}

/* ---- stage 4 ---- */

static void topp_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  int64_t nb = cr->num_blocks;
  double *bd = malloc((size_t)nb * sizeof *bd);
  float *b = malloc((size_t)nb * sizeof *b);
  uint8_t *ref = malloc((size_t)nb), *got = malloc((size_t)nb);
  upf_select_outputs out = {.block_score = b, .block_mask = ref};
  uint8_t *mask = malloc((size_t)cr->num_tokens);
  int32_t *idx = malloc((size_t)cr->num_tokens * sizeof *idx), *ncu = malloc((size_t)(cr->c->num_reqs + 1) * 4);
  int32_t *cnt = malloc((size_t)cr->c->num_reqs * 4);
  out.token_mask = mask, out.kept_index = idx, out.new_cu_seqlens = ncu, out.kept_count = cnt;
  void *dev_b = NULL;
  upf_guarded g = {0};
  /* The reference decides from the fp32-rounded scores the backend sees, so only ranking and
   * prefix arithmetic can differ. */
  upf_status st = ref_select_run(&cr->host, &cr->params, &out, bd);
  double *bf = to_double(b, nb);
  if (st == UPF_OK)
    st = cpu_select_topp(&cr->host, &cr->params, b, ref);
  if (st == UPF_OK)
    st = be->alloc(&dev_b, (size_t)nb * sizeof(float));
  if (st == UPF_OK)
    st = be->upload(dev_b, b, (size_t)nb * sizeof(float));
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)nb, &g);
  if (st == UPF_OK)
    st = be->select_topp(&cr->dev, &cr->params, dev_b, g.ptr);
  if (st == UPF_OK)
    st = fetch_guarded(&g, got, "block_mask");
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "topp");
  } else {
    upf_select_compare_decisions(&cr->host, &cr->params, bf, ref, got, upf_select_tau(UPF_DTYPE_F32), &check);
    upf_verify_record(ctx, &check);
  }
  if (dev_b)
    be->release(dev_b);
  upf_guarded_free(&g);
  free(bd), free(bf), free(b), free(ref), free(got), free(mask), free(idx), free(ncu), free(cnt);
}

void upf_verify_select_topp(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_TOPP);
  static const upf_golden goldens[] = {UPF_GOLDEN_TOPP, UPF_GOLDEN_TOPP_TIES, UPF_GOLDEN_TOPP_BOUNDARY,
                                       UPF_GOLDEN_TOPK};
  run_goldens(ctx, op, goldens, 4);
  if (!upf_verify_on_reference(ctx))
    for_each_case(ctx, op, CASE_STAGES, topp_case);
}

/* ---- expansion and the whole pipeline ---- */

/* Host copies of one selection's outputs. */
typedef struct {
  upf_select_outputs out; /* host arrays */
  float *block_score;
  uint8_t *block_mask;
} host_outputs;

static int host_outputs_alloc(host_outputs *h, const case_run *cr) {
  int64_t T = cr->num_tokens, B = cr->c->num_reqs, nb = cr->num_blocks;
  memset(h, 0, sizeof *h);
  h->out.block_score = h->block_score = malloc((size_t)(nb ? nb : 1) * sizeof(float));
  h->out.block_mask = h->block_mask = malloc((size_t)(nb ? nb : 1));
  h->out.token_mask = malloc((size_t)T);
  h->out.kept_index = malloc((size_t)T * sizeof(int32_t));
  h->out.new_cu_seqlens = malloc((size_t)(B + 1) * sizeof(int32_t));
  h->out.kept_count = malloc((size_t)B * sizeof(int32_t));
  return h->block_score && h->block_mask && h->out.token_mask && h->out.kept_index && h->out.new_cu_seqlens &&
         h->out.kept_count;
}

static void host_outputs_free(host_outputs *h) {
  free(h->block_score), free(h->block_mask), free(h->out.token_mask), free(h->out.kept_index);
  free(h->out.new_cu_seqlens), free(h->out.kept_count);
}

/* Guarded backend outputs: block_score, block_mask, token_mask, kept_index, new_cu, kept_count. */
typedef struct {
  upf_guarded g[6];
  upf_select_outputs out;
} dev_outputs;

static const char *const dev_output_names[6] = {"block_score", "block_mask", "token_mask", "kept_index",
                                                "new_cu_seqlens", "kept_count"};

static upf_status dev_outputs_alloc(const upf_backend *be, const case_run *cr, dev_outputs *d) {
  int64_t T = cr->num_tokens, B = cr->c->num_reqs, nb = cr->num_blocks;
  size_t sizes[6] = {(size_t)nb * 4, (size_t)nb, (size_t)T, (size_t)T * 4, (size_t)(B + 1) * 4, (size_t)B * 4};
  memset(d, 0, sizeof *d);
  for (int i = 0; i < 6; i++)
    UPF_TRY(upf_guarded_alloc(be, sizes[i], &d->g[i]));
  d->out.block_score = d->g[0].ptr, d->out.block_mask = d->g[1].ptr, d->out.token_mask = d->g[2].ptr;
  d->out.kept_index = d->g[3].ptr, d->out.new_cu_seqlens = d->g[4].ptr, d->out.kept_count = d->g[5].ptr;
  return UPF_OK;
}

static upf_status dev_outputs_fetch(dev_outputs *d, host_outputs *h) {
  void *dst[6] = {h->block_score, h->block_mask, h->out.token_mask, h->out.kept_index, h->out.new_cu_seqlens,
                  h->out.kept_count};
  for (int i = 0; i < 6; i++)
    UPF_TRY(fetch_guarded(&d->g[i], dst[i], dev_output_names[i]));
  h->out.kept_total = d->out.kept_total;
  return UPF_OK;
}

static void dev_outputs_free(dev_outputs *d) {
  for (int i = 0; i < 6; i++)
    upf_guarded_free(&d->g[i]);
}

static void compare_expansions(upf_verify_ctx *ctx, const case_run *cr, const host_outputs *ref,
                               const host_outputs *got, const char *op) {
  upf_check check;
  case_check_init(cr, op, "token_mask", &check);
  upf_compare_exact(got->out.token_mask, ref->out.token_mask, cr->num_tokens, 1, &check);
  upf_verify_record(ctx, &check);
  case_check_init(cr, op, "kept_index", &check);
  if (got->out.kept_total != ref->out.kept_total) {
    check.passed = 0;
    snprintf(check.detail, sizeof check.detail, "kept_total %lld, reference %lld", (long long)got->out.kept_total,
             (long long)ref->out.kept_total);
  } else {
    upf_compare_exact(got->out.kept_index, ref->out.kept_index, ref->out.kept_total, 4, &check);
  }
  upf_verify_record(ctx, &check);
  case_check_init(cr, op, "new_cu_seqlens+kept_count", &check);
  upf_compare_exact(got->out.new_cu_seqlens, ref->out.new_cu_seqlens, cr->c->num_reqs + 1, 4, &check);
  if (check.passed)
    upf_compare_exact(got->out.kept_count, ref->out.kept_count, cr->c->num_reqs, 4, &check);
  upf_verify_record(ctx, &check);
}

static void expand_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  host_outputs ref, got;
  dev_outputs dev;
  void *dev_bm = NULL;
  int ok = host_outputs_alloc(&ref, cr) & host_outputs_alloc(&got, cr);
  upf_status st = ok ? ref_select_run(&cr->host, &cr->params, &ref.out, NULL) : upf_fail(UPF_ERR_NOMEM, "verify");
  if (st == UPF_OK)
    st = dev_outputs_alloc(be, cr, &dev);
  if (st == UPF_OK)
    st = be->alloc(&dev_bm, (size_t)(cr->num_blocks ? cr->num_blocks : 1));
  if (st == UPF_OK)
    st = be->upload(dev_bm, ref.block_mask, (size_t)cr->num_blocks);
  if (st == UPF_OK)
    st = be->select_expand(&cr->dev, &cr->params, dev_bm, &dev.out);
  if (st == UPF_OK)
    st = dev_outputs_fetch(&dev, &got);
  if (st != UPF_OK)
    record_status(ctx, &check, st, "expand");
  else
    compare_expansions(ctx, cr, &ref, &got, op);
  if (dev_bm)
    be->release(dev_bm);
  dev_outputs_free(&dev);
  host_outputs_free(&ref), host_outputs_free(&got);
}

void upf_verify_select_expand(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_EXPAND);
  static const upf_golden goldens[] = {UPF_GOLDEN_EXPAND};
  run_goldens(ctx, op, goldens, 1);
  if (!upf_verify_on_reference(ctx))
    for_each_case(ctx, op, CASE_STAGES, expand_case);
}

/* ---- stages 1-3 fused ---- */

/* The backend's select.block_scores against its own select_run (bit for bit: one code path) and
 * against the double reference (SPEC 7 tolerance of the input dtype; on the CPU, the reference
 * itself, so fp32 rounding only). */
static void block_scores_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  const int64_t nb = cr->num_blocks;
  double *ref = malloc((size_t)(nb ? nb : 1) * sizeof *ref);
  float *got = malloc((size_t)(nb ? nb : 1) * sizeof *got);
  host_outputs ref_out, run_out;
  dev_outputs dev;
  memset(&dev, 0, sizeof dev);
  upf_guarded g = {0};
  int ok = host_outputs_alloc(&ref_out, cr) & host_outputs_alloc(&run_out, cr) && ref && got;
  upf_status st = ok ? ref_select_run(&cr->host, &cr->params, &ref_out.out, ref) : upf_fail(UPF_ERR_NOMEM, "verify");
  const char *what = "reference";
  if (st == UPF_OK) {
    what = "block_scores";
    st = upf_guarded_alloc(be, (size_t)nb * sizeof(float), &g);
  }
  if (st == UPF_OK)
    st = be->select_block_scores(&cr->dev, &cr->params, g.ptr);
  if (st == UPF_OK)
    st = fetch_guarded(&g, got, "block_score");
  if (st == UPF_OK) {
    what = "select_run";
    st = dev_outputs_alloc(be, cr, &dev);
  }
  if (st == UPF_OK)
    st = be->select_run(&cr->dev, &cr->params, &dev.out);
  if (st == UPF_OK)
    st = dev_outputs_fetch(&dev, &run_out);
  if (st != UPF_OK) {
    case_check_init(cr, op, NULL, &check);
    record_status(ctx, &check, st, what);
  } else {
    case_check_init(cr, op, "reference", &check);
    upf_compare_f32(got, ref, nb, upf_tolerance_for(upf_verify_on_reference(ctx) ? UPF_DTYPE_F32 : cr->pb.q.dtype),
                    &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "equals select_run", &check);
    upf_compare_exact(got, run_out.block_score, nb, 4, &check);
    upf_verify_record(ctx, &check);
  }
  upf_guarded_free(&g);
  dev_outputs_free(&dev);
  host_outputs_free(&ref_out), host_outputs_free(&run_out);
  free(ref), free(got);
}

void upf_verify_select_block_scores(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_BLOCK_SCORES);
  for_each_case(ctx, op, upf_verify_on_reference(ctx) ? CASE_STAGES : 0, block_scores_case);
}

/* CPU stage chain with fp32 between stages, as a second code path to compare the pipeline with. */
static upf_status cpu_stage_chain(case_run *cr, host_outputs *h) {
  int64_t T = cr->num_tokens;
  float *t = malloc((size_t)T * sizeof *t);
  if (!t)
    return upf_fail(UPF_ERR_NOMEM, "verify: token mass");
  upf_status st = reference_token_mass(cr, t);
  if (st == UPF_OK)
    st = cpu_select_block_reduce(&cr->host, &cr->params, t, h->block_score);
  if (st == UPF_OK)
    st = cpu_select_topp(&cr->host, &cr->params, h->block_score, h->block_mask);
  if (st == UPF_OK)
    st = cpu_select_expand(&cr->host, &cr->params, h->block_mask, &h->out);
  free(t);
  return st;
}

static void pipeline_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  upf_check check;
  upf_dtype dtype = cr->pb.q.dtype;
  double tau = upf_select_tau(dtype);
  int64_t nb = cr->num_blocks;
  host_outputs ref, got;
  dev_outputs dev;
  memset(&dev, 0, sizeof dev);
  double *ref_score = malloc((size_t)(nb ? nb : 1) * sizeof *ref_score);
  int ok = host_outputs_alloc(&ref, cr) & host_outputs_alloc(&got, cr) && ref_score;
  upf_status st = ok ? ref_select_run(&cr->host, &cr->params, &ref.out, ref_score) : upf_fail(UPF_ERR_NOMEM, "verify");
  const char *what = "reference";
  if (st == UPF_OK && upf_verify_on_reference(ctx)) {
    what = "cpu stage chain";
    st = cpu_stage_chain(cr, &got);
  } else if (st == UPF_OK) {
    what = "select_run";
    st = dev_outputs_alloc(be, cr, &dev);
    if (st == UPF_OK)
      st = be->select_run(&cr->dev, &cr->params, &dev.out);
    if (st == UPF_OK)
      st = dev_outputs_fetch(&dev, &got);
  }
  if (st != UPF_OK) {
    case_check_init(cr, op, NULL, &check);
    record_status(ctx, &check, st, what);
  } else {
    /* Block scores: the stage chain rounds the token mass to fp32, the device accumulates in fp32. */
    case_check_init(cr, op, "block_score", &check);
    upf_compare_f32(got.block_score, ref_score, nb, upf_tolerance_for(upf_verify_on_reference(ctx) ? UPF_DTYPE_F32 : dtype), &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "block decisions", &check);
    upf_select_compare_decisions(&cr->host, &cr->params, ref_score, ref.block_mask, got.block_mask, tau, &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "token_mask", &check);
    upf_select_compare_token_masks(&cr->host, &cr->params, ref.block_mask, got.block_mask, ref.out.token_mask,
                                   got.out.token_mask, &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "invariants", &check);
    upf_select_check_invariants(&cr->host, &cr->params, &got.out, got.block_score, tau, &check);
    upf_verify_record(ctx, &check);
    if (!upf_verify_on_reference(ctx)) {
      /* Same inputs, same bits: run again and compare everything bitwise. */
      host_outputs again;
      case_check_init(cr, op, "deterministic", &check);
      st = host_outputs_alloc(&again, cr) ? be->select_run(&cr->dev, &cr->params, &dev.out)
                                          : upf_fail(UPF_ERR_NOMEM, "verify");
      if (st == UPF_OK)
        st = dev_outputs_fetch(&dev, &again);
      if (st != UPF_OK) {
        record_status(ctx, &check, st, "second select_run");
      } else {
        upf_compare_exact(again.block_score, got.block_score, nb, 4, &check);
        if (check.passed)
          upf_compare_exact(again.out.token_mask, got.out.token_mask, cr->num_tokens, 1, &check);
        upf_verify_record(ctx, &check);
      }
      host_outputs_free(&again);
    }
  }
  dev_outputs_free(&dev);
  host_outputs_free(&ref), host_outputs_free(&got);
  free(ref_score);
}

/* Bad inputs must come back as the right status on the backend under test. */
static void pipeline_errors(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_PIPELINE);
  const select_case c = {"errors", {300, 1, 400}, 3, 8, 2, 64, UPF_DIST_RANDOM};
  case_run cr;
  upf_status st = case_setup(ctx->backend, &c, UPF_DTYPE_F32, &cr);
  host_outputs h;
  dev_outputs dev;
  memset(&dev, 0, sizeof dev);
  int ok = st == UPF_OK && host_outputs_alloc(&h, &cr) && dev_outputs_alloc(ctx->backend, &cr, &dev) == UPF_OK;
  struct {
    const char *name;
    upf_status want;
  } cases[] = {{"NaN in q (last L rows)", UPF_ERR_NONFINITE},
               {"Inf in k", UPF_ERR_NONFINITE},
               {"cu_seqlens not monotone", UPF_ERR_CU_SEQLENS},
               {"Hq not a multiple of Hkv", UPF_ERR_SHAPE},
               {"G not a power of two", UPF_ERR_INVALID_ARG},
               {"p outside (0,1]", UPF_ERR_INVALID_ARG}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    upf_check check;
    memset(&check, 0, sizeof check);
    snprintf(check.op, sizeof check.op, "%s", op);
    snprintf(check.variant, sizeof check.variant, "error: %s", cases[i].name);
    snprintf(check.dtype, sizeof check.dtype, "f32");
    snprintf(check.shape, sizeof check.shape, "T=701 B=3 Hq=8/2 D=64");
    if (!ok) {
      record_status(ctx, &check, st, "setup");
      continue;
    }
    upf_select_inputs in = cr.dev;
    upf_select_params params = cr.params;
    int32_t bad_cu[4] = {0, 300, 299, 701};
    float poison = i == 0 ? NAN : INFINITY;
    /* q row 299 is in the last L of request 0; k row 500 belongs to request 2. */
    int64_t at = i == 0 ? (299 * 8 + 3) * 64 + 5 : (500 * 2 + 1) * 64 + 7;
    void *target = i == 0 ? cr.dev_q : cr.dev_k;
    if (i <= 1)
      ctx->backend->upload((float *)target + at, &poison, sizeof poison);
    if (i == 2)
      in.cu_seqlens_host = bad_cu;
    if (i == 3)
      in.k.shape[1] = 3;
    if (i == 4)
      params.block = 48;
    if (i == 5)
      params.p = 1.5f;
    upf_status got = ctx->backend->select_run(&in, &params, &dev.out);
    check.passed = got == cases[i].want;
    snprintf(check.detail, sizeof check.detail, "%s (%.170s)", upf_status_name(got), upf_last_error());
    upf_verify_record(ctx, &check);
    if (i <= 1) /* restore the clean value */
      ctx->backend->upload((float *)target + at, (i == 0 ? (float *)cr.pb.q.data : (float *)cr.pb.k.data) + at,
                           sizeof(float));
  }
  if (ok)
    host_outputs_free(&h);
  dev_outputs_free(&dev);
  case_release(ctx->backend, &cr);
}

/* A scored request's last key tile reaches past its end into the next request's keys (300 = 4 x 64 + 44):
 * a kernel that reads those rows (the TMA does; cp.async zero-fills them) must mask them. Inf in the keys
 * of the unscored request that follows (37 tokens <= sink + L) must change nothing: status OK and every
 * output equal, bit for bit, to the clean run's. bf16, D 128, G 128: the Hopper kernel where there is one. */
static void pipeline_foreign_rows(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_PIPELINE);
  const select_case c = {"Inf in an unscored neighbour's keys", {300, 37, 400}, 3, 8, 2, 128, UPF_DIST_HEAVY};
  const upf_backend *be = ctx->backend;
  case_run cr;
  host_outputs clean, got;
  dev_outputs dev;
  memset(&dev, 0, sizeof dev);
  memset(&clean, 0, sizeof clean);
  memset(&got, 0, sizeof got);
  upf_check check;
  upf_status st = case_setup(be, &c, UPF_DTYPE_BF16, &cr);
  case_check_init(&cr, op, NULL, &check);
  if (st == UPF_OK && !(host_outputs_alloc(&clean, &cr) & host_outputs_alloc(&got, &cr)))
    st = upf_fail(UPF_ERR_NOMEM, "verify");
  if (st == UPF_OK)
    st = dev_outputs_alloc(be, &cr, &dev);
  if (st == UPF_OK)
    st = be->select_run(&cr.dev, &cr.params, &dev.out);
  if (st == UPF_OK)
    st = dev_outputs_fetch(&dev, &clean);
  /* +Inf (bf16 0x7F80) in request 1's first and twentieth key rows (rows 300 and 319, both KV heads). */
  const uint16_t inf_bits = 0x7F80;
  const int64_t rows[2] = {300, 319};
  for (int i = 0; i < 2 && st == UPF_OK; i++)
    for (int h = 0; h < 2 && st == UPF_OK; h++)
      st = be->upload((uint16_t *)cr.dev_k + (rows[i] * 2 + h) * 128 + 5 * h, &inf_bits, sizeof inf_bits);
  if (st == UPF_OK)
    st = be->select_run(&cr.dev, &cr.params, &dev.out);
  if (st == UPF_OK)
    st = dev_outputs_fetch(&dev, &got);
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "select_run");
  } else {
    upf_compare_exact(got.block_score, clean.block_score, cr.num_blocks, 4, &check);
    if (check.passed)
      upf_compare_exact(got.out.token_mask, clean.out.token_mask, cr.num_tokens, 1, &check);
    upf_verify_record(ctx, &check);
  }
  host_outputs_free(&clean);
  host_outputs_free(&got);
  dev_outputs_free(&dev);
  case_release(be, &cr);
}

void upf_verify_select_run(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_SELECT_PIPELINE);
  static const upf_golden goldens[] = {UPF_GOLDEN_PIPELINE};
  run_goldens(ctx, op, goldens, 1);
  for_each_case(ctx, op, upf_verify_on_reference(ctx) ? CASE_STAGES : 0, pipeline_case);
  pipeline_errors(ctx);
  if (!ctx->case_filter)
    pipeline_foreign_rows(ctx);
}

/* ---- compaction ---- */

void upf_verify_compact_rows(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_COMPACT_ROWS);
  static const upf_golden goldens[] = {UPF_GOLDEN_COMPACT};
  run_goldens(ctx, op, goldens, 1);
  if (upf_verify_on_reference(ctx) || ctx->case_filter) /* nameless seeded sets: not under --case */
    return;
  /* Row sizes that exercise the vector and the byte paths: hidden states (bf16 4096), fp32 rows,
   * odd byte counts. */
  /* The last (full set only): 2^20 rows of 4096 bytes, 4 GiB, byte offsets past 2^32 (issue 28's scale). */
  static const int64_t row_bytes_set[] = {8192, 4 * 128, 6, 1, 4096};
  const int nsets = ctx->quick ? 4 : 5;
  const upf_backend *be = ctx->backend;
  upf_rng rng;
  upf_rng_seed(&rng, 77);
  for (int s = 0; s < nsets; s++) {
    int64_t rows = s == 4 ? (int64_t)1 << 20 : 3001, row_bytes = row_bytes_set[s], kept = 0;
    unsigned char *src = malloc((size_t)(rows * row_bytes)), *ref = malloc((size_t)(rows * row_bytes));
    unsigned char *got = malloc((size_t)(rows * row_bytes));
    int32_t *idx = malloc((size_t)rows * sizeof *idx);
    if (!src || !ref || !got || !idx) {
      upf_check check;
      memset(&check, 0, sizeof check);
      snprintf(check.op, sizeof check.op, "%s", op);
      snprintf(check.variant, sizeof check.variant, "setup");
      record_status(ctx, &check, upf_fail(UPF_ERR_NOMEM, "host buffers of %lld rows", (long long)rows), "compact_rows");
      free(src), free(ref), free(got), free(idx);
      continue;
    }
    for (int64_t i = 0; i < rows * row_bytes; i++) /* 4 GiB: a hash of the byte's offset, cheaper than the generator */
      src[i] = s < 4 ? (unsigned char)upf_rng_next(&rng) : (unsigned char)(((uint64_t)i * 0x9E3779B97F4A7C15ull) >> 56);
    for (int64_t i = 0; i < rows; i++)
      if (upf_rng_uniform(&rng) < 0.4f || i == rows - 1)
        idx[kept++] = (int32_t)i;
    upf_check check;
    memset(&check, 0, sizeof check);
    snprintf(check.op, sizeof check.op, "%s", op);
    snprintf(check.variant, sizeof check.variant, "random 40%% kept");
    snprintf(check.dtype, sizeof check.dtype, "u8");
    snprintf(check.shape, sizeof check.shape, "rows=%lld bytes=%lld kept=%lld", (long long)rows, (long long)row_bytes,
             (long long)kept);
    void *dsrc = NULL, *didx = NULL;
    upf_guarded g = {0};
    upf_status st = cpu_compact_rows(src, rows, row_bytes, idx, kept, ref);
    if (st == UPF_OK)
      st = be->alloc(&dsrc, (size_t)(rows * row_bytes));
    if (st == UPF_OK)
      st = be->alloc(&didx, (size_t)rows * 4);
    if (st == UPF_OK)
      st = be->upload(dsrc, src, (size_t)(rows * row_bytes));
    if (st == UPF_OK)
      st = be->upload(didx, idx, (size_t)rows * 4);
    if (st == UPF_OK)
      st = upf_guarded_alloc(be, (size_t)(kept * row_bytes), &g);
    if (st == UPF_OK)
      st = be->compact_rows(dsrc, rows, row_bytes, didx, kept, g.ptr);
    if (st == UPF_OK)
      st = fetch_guarded(&g, got, "compacted rows");
    if (st != UPF_OK) {
      record_status(ctx, &check, st, "compact_rows");
    } else {
      upf_compare_exact(got, ref, kept * row_bytes, 1, &check);
      upf_verify_record(ctx, &check);
    }
    if (dsrc)
      be->release(dsrc);
    if (didx)
      be->release(didx);
    upf_guarded_free(&g);
    free(src), free(ref), free(got), free(idx);
  }
}
