/* Verify cases of the MoE ops (moe.route, moe.permute, moe.ffn). A backend under test other than the
 * CPU runs every case against the CPU reference (double, OpenBLAS): logits within the SPEC 7
 * tolerances of the input dtype, routing decisions under the marginal rule (moe_checks.h), weights
 * and layer outputs on the tokens whose routing agrees, permutations exactly, a second run bitwise;
 * upf verify runs the moe.ffn cases once per expert-GEMM variant (the T=32K case with the default). The CPU backend itself is checked against the golden cases
 * and against an independent per-token evaluation in plain loops (upf_moe_naive), on small layers.
 *
 * Shapes: Qwen3-Next (H=2048, E=512, K=10, I=Is=512) at T = 1, 17, 577, 4096 and 32K, plus small
 * layers with odd sizes, no shared expert, raw probabilities, K=1 and K=E (every expert receives
 * every token); routing random, skewed (experts that receive every token and experts that receive
 * none) and with exact router ties. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/moe.h"
#include "uniprefill/bf16.h"
#include "verify/moe_checks.h"
#include "verify/moe_inputs.h"
#include "verify/verify.h"

enum { CASE_QUICK = 1, CASE_LARGE = 2 };
enum { CFG_QWEN = 0, CFG_SMALL, CFG_ODD, CFG_ALL, CFG_MID, CFG_K1, CFG_WIDE_E, CFG_COUNT };

/* hidden, experts, top_k, inter, shared_inter, norm_topk */
static const upf_moe_config configs[CFG_COUNT] = {
    [CFG_QWEN] = {2048, 512, 10, 512, 512, 1},
    [CFG_SMALL] = {72, 12, 3, 40, 24, 1}, /* rows of 16-byte multiples: the vector paths */
    [CFG_ODD] = {33, 7, 2, 17, 0, 0},     /* odd sizes (scalar paths), no shared expert, raw probabilities */
    [CFG_ALL] = {64, 4, 4, 32, 32, 1},    /* K = E: every expert receives every token */
    [CFG_MID] = {256, 64, 6, 64, 64, 1},
    [CFG_K1] = {128, 32, 1, 64, 64, 1},
    [CFG_WIDE_E] = {64, 1000, 8, 32, 0, 1}, /* more than 512 experts: 32 logits a lane in the CUDA top-K */
};

typedef struct {
  const char *name;
  int cfg;
  int64_t T;
  upf_moe_dist dist;
  int out_f32;   /* bf16 inputs, f32 output (f32 inputs always give f32) */
  int64_t x_pad; /* row stride of x is H + x_pad (the padding holds NaN) */
  unsigned flags;
} moe_case;

static const moe_case moe_cases[] = {
    {"qwen T=1", CFG_QWEN, 1, UPF_MOE_DIST_RANDOM},
    {"qwen T=17", CFG_QWEN, 17, UPF_MOE_DIST_RANDOM},
    {"qwen T=577 skewed", CFG_QWEN, 577, UPF_MOE_DIST_SKEWED},
    {"qwen T=577 router ties", CFG_QWEN, 577, UPF_MOE_DIST_TIES},
    {"qwen T=4096 f32 out", CFG_QWEN, 4096, UPF_MOE_DIST_RANDOM, 1},
    {"qwen T=32768", CFG_QWEN, 32768, UPF_MOE_DIST_RANDOM, .flags = CASE_LARGE},
    {"small T=1", CFG_SMALL, 1, UPF_MOE_DIST_RANDOM, .flags = CASE_QUICK},
    {"small T=17 skewed", CFG_SMALL, 17, UPF_MOE_DIST_SKEWED, .flags = CASE_QUICK},
    {"small T=577 f32 out strided x", CFG_SMALL, 577, UPF_MOE_DIST_RANDOM, 1, 8, CASE_QUICK},
    {"odd T=17 strided x", CFG_ODD, 17, UPF_MOE_DIST_RANDOM, 0, 3, CASE_QUICK},
    {"K=E T=577", CFG_ALL, 577, UPF_MOE_DIST_RANDOM, .flags = CASE_QUICK},
    {"mid T=577 ties", CFG_MID, 577, UPF_MOE_DIST_TIES, .flags = CASE_QUICK},
    {"mid T=4096 skewed", CFG_MID, 4096, UPF_MOE_DIST_SKEWED},
    {"K=1 T=577", CFG_K1, 577, UPF_MOE_DIST_RANDOM},
    {"wide-E T=577", CFG_WIDE_E, 577, UPF_MOE_DIST_RANDOM, .flags = CASE_QUICK},
    {"wide-E T=97 ties", CFG_WIDE_E, 97, UPF_MOE_DIST_TIES, .flags = CASE_QUICK},
};
#define NUM_MOE_CASES ((int)(sizeof moe_cases / sizeof moe_cases[0]))

/* bf16 first: the dtype the layer is deployed in. */
static const upf_dtype case_dtypes[] = {UPF_DTYPE_BF16, UPF_DTYPE_F32};

static int case_selected(const upf_verify_ctx *ctx, const moe_case *c) {
  if (ctx->quick && !(c->flags & CASE_QUICK))
    return 0;
  if (ctx->case_filter && !strstr(c->name, ctx->case_filter))
    return 0;
  /* The naive per-token evaluation the CPU is checked against is plain loops: small layers only. */
  return !upf_verify_on_reference(ctx) || (c->cfg != CFG_QWEN && !(c->flags & CASE_LARGE));
}

/* ---- problems, with the expert weights of one (config, dtype) kept across cases ---- */

static struct {
  int valid, cfg;
  upf_dtype dtype;
  const upf_backend *be;
  upf_moe_problem pb;
  upf_moe_device_problem dev;
} experts_cache;

static void cache_drop(void) {
  if (experts_cache.valid) {
    upf_moe_device_problem_free(&experts_cache.dev);
    upf_moe_problem_free(&experts_cache.pb);
  }
  memset(&experts_cache, 0, sizeof experts_cache);
}

static upf_status cache_get(const upf_backend *be, int cfg, upf_dtype dtype) {
  if (experts_cache.valid && experts_cache.cfg == cfg && experts_cache.dtype == dtype && experts_cache.be == be)
    return UPF_OK;
  cache_drop();
  uint64_t seed = 0x3e7e55ull * 2654435761ull + (uint64_t)cfg * 104729u + (uint64_t)dtype;
  UPF_TRY(upf_moe_problem_make(&experts_cache.pb, &configs[cfg], 0, 0, dtype, UPF_MOE_DIST_RANDOM, seed, NULL));
  upf_status st = upf_moe_problem_upload(be, &experts_cache.pb, NULL, &experts_cache.dev);
  if (st != UPF_OK) {
    upf_moe_problem_free(&experts_cache.pb);
    return st;
  }
  experts_cache.valid = 1, experts_cache.cfg = cfg, experts_cache.dtype = dtype, experts_cache.be = be;
  return UPF_OK;
}

/* One case on the backend under test, with the reference routing. */
typedef struct {
  const moe_case *c;
  const upf_moe_config *cfg;
  upf_dtype dtype, out_dtype;
  int64_t T;
  upf_moe_problem pb;
  upf_moe_device_problem dev;
  double *logits;  /* (T, E) reference */
  int32_t *index;  /* (T, K) */
  double *weight;  /* (T, K) */
} case_run;

static void case_check_init(const case_run *cr, const char *op, const char *variant, upf_check *check) {
  memset(check, 0, sizeof *check);
  snprintf(check->op, sizeof check->op, "%s", op);
  snprintf(check->variant, sizeof check->variant, "%s%s%s", cr->c->name, variant ? ": " : "", variant ? variant : "");
  snprintf(check->dtype, sizeof check->dtype, "%s", upf_dtype_name(cr->dtype));
  snprintf(check->shape, sizeof check->shape, "T=%lld H=%d E=%d K=%d I=%d/%d", (long long)cr->T, cr->cfg->hidden,
           cr->cfg->num_experts, cr->cfg->top_k, cr->cfg->inter, cr->cfg->shared_inter);
}

static void record_status(upf_verify_ctx *ctx, upf_check *check, upf_status st, const char *what) {
  check->passed = 0;
  snprintf(check->detail, sizeof check->detail, "%s: %s: %.180s", what, upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, check);
}

static void case_release(case_run *cr) {
  upf_moe_device_problem_free(&cr->dev);
  upf_moe_problem_free(&cr->pb);
  free(cr->logits), free(cr->index), free(cr->weight);
}

static upf_status case_setup(const upf_verify_ctx *ctx, const moe_case *c, upf_dtype dtype, case_run *cr) {
  memset(cr, 0, sizeof *cr);
  cr->c = c;
  cr->cfg = &configs[c->cfg];
  cr->dtype = dtype;
  cr->out_dtype = dtype == UPF_DTYPE_BF16 && !c->out_f32 ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
  cr->T = c->T;
  UPF_TRY(cache_get(ctx->backend, c->cfg, dtype));
  uint64_t seed = 0x30e5eedull + (uint64_t)(c - moe_cases) * 7919u + (uint64_t)dtype * 31u;
  UPF_TRY(upf_moe_problem_make(&cr->pb, cr->cfg, c->T, cr->cfg->hidden + c->x_pad, dtype, c->dist, seed,
                               &experts_cache.pb));
  UPF_TRY(upf_moe_problem_upload(ctx->backend, &cr->pb, &experts_cache.dev, &cr->dev));
  int64_t T = c->T, E = cr->cfg->num_experts, K = cr->cfg->top_k;
  cr->logits = malloc((size_t)(T * E + 1) * sizeof *cr->logits);
  cr->index = malloc((size_t)(T * K + 1) * sizeof *cr->index);
  cr->weight = malloc((size_t)(T * K + 1) * sizeof *cr->weight);
  if (!cr->logits || !cr->index || !cr->weight)
    return upf_fail(UPF_ERR_NOMEM, "verify moe: reference routing");
  upf_moe_weights w = upf_moe_problem_weights(&cr->pb);
  if (upf_verify_on_reference(ctx)) {
    upf_moe_naive(cr->cfg, &cr->pb.x, &w, cr->logits, cr->index, cr->weight, NULL);
    return UPF_OK;
  }
  return ref_moe_route(cr->cfg, &cr->pb.x, &w, cr->logits, cr->index, cr->weight);
}

typedef void (*case_fn)(upf_verify_ctx *ctx, case_run *cr, const char *op);

/* skip_large: leave out the CASE_LARGE cases (their CPU reference takes longest). */
static void for_each_case(upf_verify_ctx *ctx, const char *op, case_fn fn, int skip_large) {
  for (size_t d = 0; d < sizeof case_dtypes / sizeof case_dtypes[0]; d++)
    for (int i = 0; i < NUM_MOE_CASES; i++) {
      const moe_case *c = &moe_cases[i];
      if (!case_selected(ctx, c) || (skip_large && (c->flags & CASE_LARGE)))
        continue;
      case_run cr;
      upf_status st = case_setup(ctx, c, case_dtypes[d], &cr);
      if (st != UPF_OK) {
        upf_check check;
        case_check_init(&cr, op, "setup", &check);
        record_status(ctx, &check, st, "setup");
      } else {
        fn(ctx, &cr, op);
      }
      case_release(&cr);
    }
  cache_drop();
}

static void run_goldens(upf_verify_ctx *ctx, const upf_moe_golden *goldens, int count) {
  for (int i = 0; i < count; i++)
    for (size_t d = 0; d < sizeof case_dtypes / sizeof case_dtypes[0]; d++) {
      upf_check check;
      upf_moe_golden_run(ctx->backend, goldens[i], case_dtypes[d], &check);
      upf_verify_record(ctx, &check);
    }
}

static upf_status fetch_guarded(upf_guarded *g, void *host, const char *name) {
  UPF_TRY(upf_guarded_check(g, name));
  return g->backend->download(host, g->ptr, g->bytes);
}

/* Weights of the tokens whose expert sets agree, matched by expert. */
static void compare_weights(const case_run *cr, const int32_t *got_index, const float *got_weight,
                            const uint8_t *agree, upf_check *check) {
  int64_t K = cr->cfg->top_k, m = 0;
  float *g = malloc((size_t)(cr->T * K + 1) * sizeof *g);
  double *r = malloc((size_t)(cr->T * K + 1) * sizeof *r);
  for (int64_t t = 0; g && r && t < cr->T; t++) {
    if (!agree[t])
      continue;
    for (int64_t k = 0; k < K; k++) {
      int64_t kk = 0;
      while (kk < K && cr->index[t * K + kk] != got_index[t * K + k])
        kk++;
      g[m] = got_weight[t * K + k];
      r[m++] = kk < K ? cr->weight[t * K + kk] : NAN;
    }
  }
  upf_compare_f32(g, r, m, upf_tolerance_for(cr->dtype), check);
  free(g), free(r);
}

/* ---- moe.route ---- */

static void route_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  const int64_t T = cr->T, E = cr->cfg->num_experts, K = cr->cfg->top_k;
  upf_guarded gi = {0}, gw = {0}, gl = {0};
  int32_t *index = malloc((size_t)(T * K + 1) * sizeof *index);
  float *weight = malloc((size_t)(T * K + 1) * sizeof *weight), *logits = malloc((size_t)(T * E + 1) * sizeof *logits);
  uint8_t *agree = malloc((size_t)T + 1);
  upf_check check;
  case_check_init(cr, op, NULL, &check);
  upf_status st = index && weight && logits && agree ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "verify moe.route");
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)(T * K) * 4, &gi);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)(T * K) * 4, &gw);
  if (st == UPF_OK)
    st = upf_guarded_alloc(be, (size_t)(T * E) * 4, &gl);
  upf_moe_routing rt = {gi.ptr, gw.ptr, gl.ptr};
  if (st == UPF_OK)
    st = be->moe_route(cr->cfg, &cr->dev.x, &cr->dev.w, &rt);
  if (st == UPF_OK)
    st = fetch_guarded(&gi, index, "topk_index");
  if (st == UPF_OK)
    st = fetch_guarded(&gw, weight, "topk_weight");
  if (st == UPF_OK)
    st = fetch_guarded(&gl, logits, "logits");
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "moe_route");
  } else {
    case_check_init(cr, op, "logits", &check);
    upf_compare_f32(logits, cr->logits, T * E, upf_tolerance_for(cr->dtype), &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "decisions", &check);
    upf_moe_compare_routing(cr->cfg, T, cr->logits, cr->index, index, upf_moe_tau(cr->dtype), agree, &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "weights", &check);
    compare_weights(cr, index, weight, agree, &check);
    upf_verify_record(ctx, &check);
  }
  upf_guarded_free(&gi), upf_guarded_free(&gw), upf_guarded_free(&gl);
  free(index), free(weight), free(logits), free(agree);
}

/* NaN in one row of x must come back as UPF_ERR_NONFINITE from route and ffn. */
static void nonfinite_errors(upf_verify_ctx *ctx, const char *op, int ffn) {
  const moe_case c = {"error", CFG_SMALL, 17, UPF_MOE_DIST_RANDOM};
  case_run cr;
  upf_check check;
  upf_status st = case_setup(ctx, &c, UPF_DTYPE_F32, &cr);
  case_check_init(&cr, op, "NaN in x row 5", &check);
  const int64_t T = cr.T, K = cr.cfg->top_k, H = cr.cfg->hidden;
  upf_guarded gi = {0}, gw = {0}, go = {0};
  if (st == UPF_OK)
    st = upf_guarded_alloc(ctx->backend, (size_t)(T * K) * 4, &gi);
  if (st == UPF_OK)
    st = upf_guarded_alloc(ctx->backend, (size_t)(T * K) * 4, &gw);
  if (st == UPF_OK)
    st = upf_guarded_alloc(ctx->backend, (size_t)(T * H) * 4, &go);
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "setup");
  } else {
    float nan = NAN;
    upf_moe_routing rt = {gi.ptr, gw.ptr, NULL};
    int64_t shape[2] = {T, H};
    upf_tensor out;
    upf_tensor_init(&out, go.ptr, UPF_DTYPE_F32, 2, shape);
    upf_status got = ctx->backend->upload((float *)cr.dev.x.data + 5 * cr.dev.x.stride[0] + 7, &nan, sizeof nan);
    if (got == UPF_OK)
      got = ffn ? ctx->backend->moe_ffn(cr.cfg, &cr.dev.x, &cr.dev.w, &out, &rt)
                : ctx->backend->moe_route(cr.cfg, &cr.dev.x, &cr.dev.w, &rt);
    check.passed = got == UPF_ERR_NONFINITE;
    snprintf(check.detail, sizeof check.detail, "%s (%.170s)", upf_status_name(got), upf_last_error());
    upf_verify_record(ctx, &check);
  }
  upf_guarded_free(&gi), upf_guarded_free(&gw), upf_guarded_free(&go);
  case_release(&cr);
  cache_drop();
}

void upf_verify_moe_route(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_MOE_ROUTE);
  static const upf_moe_golden goldens[] = {UPF_MOE_GOLDEN_ROUTE};
  run_goldens(ctx, goldens, 1);
  for_each_case(ctx, op, route_case, 0);
  nonfinite_errors(ctx, op, 0);
}

/* ---- moe.permute ---- */

static void permute_arrays(const upf_moe_config *cfg, int64_t T, int32_t *buf[4]) {
  int64_t E = cfg->num_experts, n = T * cfg->top_k;
  buf[0] = malloc((size_t)E * 4), buf[1] = malloc((size_t)(E + 1) * 4);
  buf[2] = malloc((size_t)(n + 1) * 4), buf[3] = malloc((size_t)(n + 1) * 4);
}

/* Runs the backend's permutation of topk_index (host, (T, K)) and compares it exactly with the
 * reference and with the definition. */
static void permute_check(upf_verify_ctx *ctx, const upf_moe_config *cfg, int64_t T, const int32_t *topk_index,
                          upf_check *check) {
  const upf_backend *be = ctx->backend;
  const int64_t E = cfg->num_experts, n = T * cfg->top_k;
  size_t bytes[4] = {(size_t)E * 4, (size_t)(E + 1) * 4, (size_t)n * 4, (size_t)n * 4};
  static const char *const names[4] = {"expert_count", "expert_offset", "sorted_pair", "pair_row"};
  int32_t *ref[4], *got[4];
  upf_guarded g[4];
  void *dev_index = NULL;
  memset(g, 0, sizeof g);
  permute_arrays(cfg, T, ref);
  permute_arrays(cfg, T, got);
  upf_status st = UPF_OK;
  for (int i = 0; i < 4; i++)
    if (!ref[i] || !got[i])
      st = upf_fail(UPF_ERR_NOMEM, "verify moe.permute");
  upf_moe_permutation rp = {ref[0], ref[1], ref[2], ref[3]};
  if (st == UPF_OK)
    st = ref_moe_permute(cfg, T, topk_index, &rp);
  if (st == UPF_OK)
    st = be->alloc(&dev_index, n * 4 + 4);
  if (st == UPF_OK)
    st = be->upload(dev_index, topk_index, (size_t)n * 4);
  for (int i = 0; i < 4 && st == UPF_OK; i++)
    st = upf_guarded_alloc(be, bytes[i], &g[i]);
  upf_moe_permutation gp = {g[0].ptr, g[1].ptr, g[2].ptr, g[3].ptr};
  if (st == UPF_OK)
    st = be->moe_permute(cfg, T, dev_index, &gp);
  for (int i = 0; i < 4 && st == UPF_OK; i++)
    st = fetch_guarded(&g[i], got[i], names[i]);
  if (st != UPF_OK) {
    check->passed = 0;
    snprintf(check->detail, sizeof check->detail, "moe_permute: %s: %.180s", upf_status_name(st), upf_last_error());
  } else {
    upf_moe_permutation hp = {got[0], got[1], got[2], got[3]};
    upf_moe_check_permutation(cfg, T, topk_index, &hp, check);
    for (int i = 0; i < 4 && check->passed; i++) {
      upf_compare_exact(got[i], ref[i], (int64_t)(bytes[i] / 4), 4, check);
      if (!check->passed) {
        char detail[sizeof check->detail];
        snprintf(detail, sizeof detail, "%s: %.200s", names[i], check->detail);
        snprintf(check->detail, sizeof check->detail, "%s", detail);
      }
    }
  }
  if (dev_index)
    be->release(dev_index);
  for (int i = 0; i < 4; i++) {
    upf_guarded_free(&g[i]);
    free(ref[i]), free(got[i]);
  }
}

static void permute_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  upf_check check;
  case_check_init(cr, op, "reference routing", &check);
  permute_check(ctx, cr->cfg, cr->T, cr->index, &check);
  upf_verify_record(ctx, &check);
}

/* Index arrays made by hand: every pair on one expert; one token over all experts (K = E); and the
 * out-of-range indices that must be refused. */
static void permute_synthetic(upf_verify_ctx *ctx, const char *op) {
  static const upf_moe_config one = {64, 16, 1, 8, 0, 1}, all = {64, 16, 16, 8, 0, 1};
  struct {
    const char *name;
    const upf_moe_config *cfg;
    int64_t T;
    int bad; /* 0: valid; 1: an index of E; 2: a negative index */
  } cases[] = {{"all pairs on expert 9", &one, 5000, 0}, {"K=E one token", &all, 1, 0},
               {"K=E 300 tokens", &all, 300, 0},        {"error: index == E", &one, 50, 1},
               {"error: negative index", &one, 50, 2}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const upf_moe_config *cfg = cases[i].cfg;
    int64_t n = cases[i].T * cfg->top_k;
    int32_t *index = malloc((size_t)n * sizeof *index);
    upf_check check;
    memset(&check, 0, sizeof check);
    snprintf(check.op, sizeof check.op, "%s", op);
    snprintf(check.variant, sizeof check.variant, "synthetic: %s", cases[i].name);
    snprintf(check.dtype, sizeof check.dtype, "i32");
    snprintf(check.shape, sizeof check.shape, "T=%lld E=%d K=%d", (long long)cases[i].T, cfg->num_experts,
             cfg->top_k);
    for (int64_t p = 0; index && p < n; p++)
      index[p] = cfg->top_k == 1 ? 9 : (int32_t)((p * 7 + p / cfg->top_k) % cfg->num_experts);
    if (!index) {
      record_status(ctx, &check, upf_fail(UPF_ERR_NOMEM, "index"), "setup");
      continue;
    }
    if (!cases[i].bad) {
      permute_check(ctx, cfg, cases[i].T, index, &check);
      upf_verify_record(ctx, &check);
    } else {
      index[37] = cases[i].bad == 1 ? cfg->num_experts : -3;
      const upf_backend *be = ctx->backend;
      int32_t *outs[4] = {NULL, NULL, NULL, NULL};
      void *dev_index = NULL;
      upf_status got = be->alloc(&dev_index, (size_t)n * 4);
      size_t bytes[4] = {(size_t)cfg->num_experts * 4, (size_t)(cfg->num_experts + 1) * 4, (size_t)n * 4,
                         (size_t)n * 4};
      for (int j = 0; j < 4 && got == UPF_OK; j++)
        got = be->alloc((void **)&outs[j], bytes[j]);
      if (got == UPF_OK)
        got = be->upload(dev_index, index, (size_t)n * 4);
      upf_moe_permutation perm = {outs[0], outs[1], outs[2], outs[3]};
      if (got == UPF_OK)
        got = be->moe_permute(cfg, cases[i].T, dev_index, &perm);
      check.passed = got == UPF_ERR_INVALID_ARG && strstr(upf_last_error(), "[37]") != NULL;
      snprintf(check.detail, sizeof check.detail, "%s (%.170s)", upf_status_name(got), upf_last_error());
      upf_verify_record(ctx, &check);
      if (dev_index)
        be->release(dev_index);
      for (int j = 0; j < 4; j++)
        if (outs[j])
          be->release(outs[j]);
    }
    free(index);
  }
}

void upf_verify_moe_permute(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_MOE_PERMUTE);
  static const upf_moe_golden goldens[] = {UPF_MOE_GOLDEN_PERMUTE, UPF_MOE_GOLDEN_PERMUTE_SKEW};
  for (int i = 0; i < 2; i++) {
    upf_check check;
    upf_moe_golden_run(ctx->backend, goldens[i], UPF_DTYPE_F32, &check);
    snprintf(check.dtype, sizeof check.dtype, "i32");
    upf_verify_record(ctx, &check);
  }
  permute_synthetic(ctx, op);
  for_each_case(ctx, op, permute_case, 0);
}

/* ---- moe.ffn ---- */

typedef struct {
  upf_guarded out, index, weight;
  float *host_out;   /* (T, H) as f32 */
  void *raw_out;     /* (T, H) in the out dtype */
  int32_t *host_index;
  float *host_weight;
} ffn_outputs;

static upf_status ffn_outputs_alloc(const upf_backend *be, const case_run *cr, ffn_outputs *o) {
  const int64_t T = cr->T, H = cr->cfg->hidden, K = cr->cfg->top_k;
  size_t es = upf_dtype_size(cr->out_dtype);
  memset(o, 0, sizeof *o);
  o->host_out = malloc((size_t)(T * H + 1) * sizeof(float));
  o->raw_out = malloc((size_t)(T * H) * es + 1);
  o->host_index = malloc((size_t)(T * K + 1) * sizeof(int32_t));
  o->host_weight = malloc((size_t)(T * K + 1) * sizeof(float));
  if (!o->host_out || !o->raw_out || !o->host_index || !o->host_weight)
    return upf_fail(UPF_ERR_NOMEM, "verify moe.ffn: host outputs");
  UPF_TRY(upf_guarded_alloc(be, (size_t)(T * H) * es, &o->out));
  UPF_TRY(upf_guarded_alloc(be, (size_t)(T * K) * 4, &o->index));
  return upf_guarded_alloc(be, (size_t)(T * K) * 4, &o->weight);
}

static void ffn_outputs_free(ffn_outputs *o) {
  upf_guarded_free(&o->out), upf_guarded_free(&o->index), upf_guarded_free(&o->weight);
  free(o->host_out), free(o->raw_out), free(o->host_index), free(o->host_weight);
}

/* One moe_ffn call into o, and its outputs on the host. */
static upf_status ffn_run(const upf_backend *be, const case_run *cr, ffn_outputs *o) {
  int64_t shape[2] = {cr->T, cr->cfg->hidden};
  upf_tensor out;
  UPF_TRY(upf_tensor_init(&out, o->out.ptr, cr->out_dtype, 2, shape));
  upf_moe_routing rt = {o->index.ptr, o->weight.ptr, NULL};
  UPF_TRY(be->moe_ffn(cr->cfg, &cr->dev.x, &cr->dev.w, &out, &rt));
  UPF_TRY(fetch_guarded(&o->out, o->raw_out, "out"));
  UPF_TRY(fetch_guarded(&o->index, o->host_index, "topk_index"));
  UPF_TRY(fetch_guarded(&o->weight, o->host_weight, "topk_weight"));
  int64_t n = cr->T * cr->cfg->hidden;
  if (cr->out_dtype == UPF_DTYPE_BF16)
    upf_bf16_to_f32_array(o->host_out, o->raw_out, n);
  else
    memcpy(o->host_out, o->raw_out, (size_t)n * sizeof(float));
  return UPF_OK;
}

/* Output rows of the tokens whose routing agrees, against the reference. */
static void compare_outputs(const case_run *cr, const float *got, const double *ref, const uint8_t *agree,
                            upf_check *check) {
  const int64_t T = cr->T, H = cr->cfg->hidden;
  int64_t m = 0;
  float *g = malloc((size_t)(T * H + 1) * sizeof *g);
  double *r = malloc((size_t)(T * H + 1) * sizeof *r);
  for (int64_t t = 0; g && r && t < T; t++)
    if (agree[t]) {
      memcpy(g + m * H, got + t * H, (size_t)H * sizeof *g);
      memcpy(r + m * H, ref + t * H, (size_t)H * sizeof *r);
      m++;
    }
  upf_compare_f32(g, r, m * H, upf_tolerance_for(cr->dtype), check);
  char detail[sizeof check->detail];
  snprintf(detail, sizeof detail, "%lld of %lld tokens compared (routing agrees)%s%.160s", (long long)m, (long long)T,
           check->detail[0] ? "; " : "", check->detail);
  snprintf(check->detail, sizeof check->detail, "%s", detail);
  free(g), free(r);
}

static void ffn_case(upf_verify_ctx *ctx, case_run *cr, const char *op) {
  const upf_backend *be = ctx->backend;
  const int64_t T = cr->T, H = cr->cfg->hidden;
  upf_check check;
  ffn_outputs o, again;
  memset(&o, 0, sizeof o), memset(&again, 0, sizeof again);
  double *ref = malloc((size_t)(T * H + 1) * sizeof *ref);
  uint8_t *agree = malloc((size_t)T + 1);
  upf_moe_weights w = upf_moe_problem_weights(&cr->pb);
  upf_status st = ref && agree ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "verify moe.ffn: reference");
  if (st == UPF_OK && upf_verify_on_reference(ctx))
    upf_moe_naive(cr->cfg, &cr->pb.x, &w, NULL, NULL, NULL, ref);
  else if (st == UPF_OK)
    st = ref_moe_ffn(cr->cfg, &cr->pb.x, &w, cr->index, cr->weight, ref);
  if (st == UPF_OK)
    st = ffn_outputs_alloc(be, cr, &o);
  if (st != UPF_OK) {
    case_check_init(cr, op, "setup", &check);
    record_status(ctx, &check, st, "setup");
    free(ref), free(agree);
    ffn_outputs_free(&o);
    return;
  }
  st = ffn_run(be, cr, &o);
  case_check_init(cr, op, "out", &check);
  if (st != UPF_OK) {
    record_status(ctx, &check, st, "moe_ffn");
  } else {
    case_check_init(cr, op, "routing", &check);
    upf_moe_compare_routing(cr->cfg, T, cr->logits, cr->index, o.host_index, upf_moe_tau(cr->dtype), agree, &check);
    upf_verify_record(ctx, &check);
    case_check_init(cr, op, "out", &check);
    compare_outputs(cr, o.host_out, ref, agree, &check);
    upf_verify_record(ctx, &check);
    /* Same inputs, same bits: a second run is compared bytewise. */
    case_check_init(cr, op, "deterministic", &check);
    st = ffn_outputs_alloc(be, cr, &again);
    if (st == UPF_OK)
      st = ffn_run(be, cr, &again);
    if (st != UPF_OK) {
      record_status(ctx, &check, st, "second moe_ffn");
    } else {
      upf_compare_exact(again.raw_out, o.raw_out, T * H, upf_dtype_size(cr->out_dtype), &check);
      if (check.passed)
        upf_compare_exact(again.host_index, o.host_index, T * cr->cfg->top_k, 4, &check);
      if (check.passed)
        upf_compare_exact(again.host_weight, o.host_weight, T * cr->cfg->top_k, 4, &check);
      upf_verify_record(ctx, &check);
    }
  }
  ffn_outputs_free(&o), ffn_outputs_free(&again);
  free(ref), free(agree);
}

/* Bad inputs must come back as the right status on the backend under test. */
static void ffn_errors(upf_verify_ctx *ctx, const char *op) {
  const moe_case c = {"errors", CFG_SMALL, 17, UPF_MOE_DIST_RANDOM};
  case_run cr;
  upf_status st = case_setup(ctx, &c, UPF_DTYPE_F32, &cr);
  const int64_t T = cr.T, H = cr.cfg->hidden;
  upf_guarded go = {0};
  if (st == UPF_OK)
    st = upf_guarded_alloc(ctx->backend, (size_t)(T * H) * 4, &go);
  struct {
    const char *name;
    upf_status want;
  } cases[] = {{"weights dtype differs from x", UPF_ERR_DTYPE},
               {"out has T-1 rows", UPF_ERR_SHAPE},
               {"top_k > num_experts", UPF_ERR_INVALID_ARG},
               {"x columns strided", UPF_ERR_SHAPE},
               {"no shared expert weights", UPF_ERR_INVALID_ARG}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    upf_check check;
    case_check_init(&cr, op, NULL, &check);
    snprintf(check.variant, sizeof check.variant, "error: %s", cases[i].name);
    if (st != UPF_OK) {
      record_status(ctx, &check, st, "setup");
      continue;
    }
    upf_moe_config cfg = *cr.cfg;
    upf_tensor x = cr.dev.x, out;
    upf_moe_weights w = cr.dev.w;
    int64_t shape[2] = {T, H};
    upf_tensor_init(&out, go.ptr, UPF_DTYPE_F32, 2, shape);
    if (i == 0)
      w.dtype = UPF_DTYPE_BF16;
    if (i == 1)
      out.shape[0] = T - 1;
    if (i == 2)
      cfg.top_k = cfg.num_experts + 1;
    if (i == 3)
      x.stride[1] = 2;
    if (i == 4)
      w.shared_down = NULL;
    upf_status got = ctx->backend->moe_ffn(&cfg, &x, &w, &out, NULL);
    check.passed = got == cases[i].want;
    snprintf(check.detail, sizeof check.detail, "%s (%.170s)", upf_status_name(got), upf_last_error());
    upf_verify_record(ctx, &check);
  }
  upf_guarded_free(&go);
  case_release(&cr);
  cache_drop();
  nonfinite_errors(ctx, op, 1);
}

void upf_verify_moe_ffn(upf_verify_ctx *ctx) {
  const char *op = upf_op_name(UPF_OP_MOE_FFN);
  static const upf_moe_golden goldens[] = {UPF_MOE_GOLDEN_FFN};
  run_goldens(ctx, goldens, 1);
  upf_variant v;
  const int default_variant = upf_variant_current(UPF_OP_MOE_FFN, &v) != UPF_OK || v == upf_variant_of(UPF_OP_MOE_FFN, 0);
  for_each_case(ctx, op, ffn_case, !default_variant);
  ffn_errors(ctx, op);
}
