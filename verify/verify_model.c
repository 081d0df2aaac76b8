/* End-to-end check of the models (`upf verify model`): every tiny config, f32 and bf16, dense and
 * UniPrefill, on the backend under test against the CPU reference. UniPrefill runs twice on the
 * backend: once replaying the CPU's masks (numerics compared without decision noise), once selecting
 * by itself (kept counts compared; a difference is reported, as marginal decisions may differ).
 * Logits: the long-reduction rule of SPEC section 7 (a model is a chain of long reductions), against
 * the fp64 truth of verify/model_truth.c: err(backend) <= 2 err(CPU of the same dtype) + atol. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "verify/model_truth.h"
#include "verify/verify.h"
#include "verify/verify_model.h"

/* A long request, one shorter than sink + L, a decode-like row and a medium one. */
static const int32_t model_lengths[] = {300, 24, 1, 170};
#define MODEL_REQS 4

upf_status upf_model_run_ids(const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype, uint64_t seed,
                             const int32_t *ids, const int32_t *cu, int32_t num_reqs, const upf_prefill_options *opt,
                             upf_prefill_result *res) {
  upf_model m;
  UPF_TRY(upf_model_init_seeded(&m, cfg, be, dtype, seed, 0, cfg->num_layers));
  const upf_status st = upf_model_prefill(&m, ids, cu, num_reqs, opt, res);
  upf_model_free(&m);
  return st;
}

upf_status upf_model_run_seeded(const upf_model_config *cfg, const upf_backend *be, upf_dtype dtype, uint64_t seed,
                                const int32_t *lengths, int32_t num_reqs, const upf_prefill_options *opt,
                                upf_prefill_result *res) {
  memset(res, 0, sizeof *res);
  int32_t *cu = malloc((size_t)(num_reqs + 1) * sizeof *cu);
  if (!cu)
    return upf_fail(UPF_ERR_NOMEM, "model run: cu_seqlens");
  cu[0] = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    cu[r + 1] = cu[r] + lengths[r];
  int32_t *ids = malloc((size_t)(cu[num_reqs] > 0 ? cu[num_reqs] : 1) * sizeof *ids);
  upf_status st = ids ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "model run: ids");
  if (st == UPF_OK) {
    upf_model_seeded_ids(seed, cfg->vocab, cu[num_reqs], ids);
    st = upf_model_run_ids(cfg, be, dtype, seed, ids, cu, num_reqs, opt, res);
  }
  free(ids), free(cu);
  return st;
}

double upf_verify_max_abs_diff(const float *a, const double *truth, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)a[i] - truth[i]);
    m = d > m || isnan(d) ? d : m;
  }
  return m;
}

static void fill_check(upf_check *c, const upf_model_config *cfg, upf_dtype dt, const char *variant) {
  memset(c, 0, sizeof *c);
  snprintf(c->op, sizeof c->op, "model.prefill");
  snprintf(c->variant, sizeof c->variant, "%s %s", cfg->name, variant);
  snprintf(c->dtype, sizeof c->dtype, "%s", upf_dtype_name(dt));
  snprintf(c->shape, sizeof c->shape, "B=%d T=%d", MODEL_REQS, 300 + 24 + 1 + 170);
}

/* The long-reduction rule of SPEC section 7 on the logits: err(backend, fp64 truth) <= 2 err(CPU
 * reference of the same dtype, fp64 truth) + atol; nmse and the plain budget against the CPU are
 * reported beside it. */
static void compare_logits(upf_check *c, upf_dtype dt, const float *got, const float *cpu, const double *truth,
                           int64_t n) {
  double *ref = malloc((size_t)n * sizeof *ref);
  if (!ref) {
    c->passed = 0;
    snprintf(c->detail, sizeof c->detail, "out of memory");
    return;
  }
  for (int64_t i = 0; i < n; i++)
    ref[i] = cpu[i];
  const upf_tolerance tol = upf_tolerance_for(dt);
  upf_compare_f32(got, ref, n, tol, c);
  const double plain_budget = c->budget;
  const double err_got = upf_verify_max_abs_diff(got, truth, n), err_cpu = upf_verify_max_abs_diff(cpu, truth, n);
  const double bound = 2.0 * err_cpu + tol.atol;
  c->passed = err_got <= bound && !isnan(err_got);
  c->budget = err_got / bound;
  snprintf(c->detail, sizeof c->detail, "err vs fp64 truth %.3g <= 2 x CPU's %.3g + %.0e (plain budget vs CPU %.0f%%)",
           err_got, err_cpu, tol.atol, 100.0 * plain_budget);
  free(ref);
}

static void record_status(upf_verify_ctx *ctx, upf_check *c, upf_status st) {
  c->passed = 0;
  snprintf(c->detail, sizeof c->detail, "%s: %s", upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, c);
}

/* The fp64 truth (verify/model_truth.c) of the seeded batch through cfg's f32 weights on the CPU: dense,
 * or with the drops of uni. */
static upf_status truth_logits(const upf_model_config *cfg, uint64_t seed, const upf_prefill_result *uni,
                               double *logits) {
  int32_t cu[MODEL_REQS + 1] = {0};
  for (int r = 0; r < MODEL_REQS; r++)
    cu[r + 1] = cu[r] + model_lengths[r];
  int32_t *ids = malloc((size_t)cu[MODEL_REQS] * sizeof *ids);
  if (!ids)
    return upf_fail(UPF_ERR_NOMEM, "model truth: ids");
  upf_model_seeded_ids(seed, cfg->vocab, cu[MODEL_REQS], ids);
  upf_model m;
  upf_status st = upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, seed, 0, cfg->num_layers);
  if (st == UPF_OK) {
    if (!upf_model_truth(&m, ids, cu, MODEL_REQS, uni, 0, logits))
      st = upf_fail(UPF_ERR_INVALID_ARG, "model truth of %s: the drop records do not fit", cfg->name);
    upf_model_free(&m);
  }
  free(ids);
  return st;
}

/* One check of the backend against the CPU in one mode: both run with opt (the backend replaying the
 * CPU's masks in UniPrefill mode), and the logits meet the rule against the fp64 truth. */
static void check_mode(upf_verify_ctx *ctx, const upf_model_config *cfg, upf_dtype dt, uint64_t seed,
                       const upf_prefill_options *opt, const char *variant, upf_prefill_result *cpu_res) {
  const int64_t n = (int64_t)MODEL_REQS * cfg->vocab;
  upf_check c;
  fill_check(&c, cfg, dt, variant);
  upf_prefill_result got = {0};
  double *truth = malloc((size_t)n * sizeof *truth);
  upf_status s = truth ? upf_model_run_seeded(cfg, upf_backend_cpu(), dt, seed, model_lengths, MODEL_REQS, opt, cpu_res)
                       : upf_fail(UPF_ERR_NOMEM, "model check: truth");
  const uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
  int64_t lens[UPF_MODEL_MAX_LAYERS] = {0};
  upf_prefill_options replay = *opt;
  const int uni = opt->mode == UPF_PREFILL_UNIPREFILL;
  if (s == UPF_OK && uni) {
    for (int i = 0; i < cpu_res->num_drops; i++)
      masks[i] = cpu_res->drops[i].mask, lens[i] = cpu_res->drops[i].tokens_in;
    replay.replay_masks = masks, replay.replay_mask_len = lens;
  }
  if (s == UPF_OK)
    s = upf_model_run_seeded(cfg, ctx->backend, dt, seed, model_lengths, MODEL_REQS, &replay, &got);
  if (s == UPF_OK)
    s = truth_logits(cfg, seed, uni ? cpu_res : NULL, truth);
  if (s != UPF_OK)
    record_status(ctx, &c, s);
  else {
    compare_logits(&c, dt, got.logits, cpu_res->logits, truth, n);
    if (uni && (cpu_res->num_drops != cfg->num_drop_layers || cpu_res->drops[0].tokens_kept == cpu_res->drops[0].tokens_in)) {
      c.passed = 0;
      snprintf(c.detail, sizeof c.detail, "%d drops of %d expected, the first keeping %lld of %lld tokens",
               cpu_res->num_drops, cfg->num_drop_layers, (long long)cpu_res->drops[0].tokens_kept,
               (long long)cpu_res->drops[0].tokens_in);
    }
    upf_verify_record(ctx, &c);
  }
  upf_prefill_result_free(&got);
  free(truth);
}

static void verify_config(upf_verify_ctx *ctx, const upf_model_config *cfg) {
  const uint64_t seed = upf_verify_case_seed("model.prefill", 0, (uint64_t)cfg->family);
  const upf_prefill_options dense = {.mode = UPF_PREFILL_DENSE, .select = cfg->select};
  upf_prefill_options uni = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select};
  uni.select.p = 0.5f; /* random weights attend almost uniformly: p = 0.5 drops about half the blocks */
  for (int d = 0; d < 2; d++) {
    const upf_dtype dt = d ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
    upf_prefill_result cpu_dense = {0}, cpu_uni = {0}, got_sel = {0};
    check_mode(ctx, cfg, dt, seed, &dense, "dense", &cpu_dense);
    check_mode(ctx, cfg, dt, seed, &uni, "uniprefill replay", &cpu_uni);
    /* UniPrefill selecting on the backend: the kept counts, by drop layer */
    upf_check c;
    fill_check(&c, cfg, dt, "uniprefill select");
    const upf_status s = upf_model_run_seeded(cfg, ctx->backend, dt, seed, model_lengths, MODEL_REQS, &uni, &got_sel);
    if (s != UPF_OK)
      record_status(ctx, &c, s);
    else {
      c.passed = got_sel.num_drops == cpu_uni.num_drops;
      int differ = 0;
      for (int i = 0; c.passed && i < got_sel.num_drops; i++)
        differ += got_sel.drops[i].tokens_kept != cpu_uni.drops[i].tokens_kept;
      snprintf(c.detail, sizeof c.detail, "%d drop layers, %d with kept counts other than the CPU's%s",
               got_sel.num_drops, differ, differ ? " (marginal decisions)" : "");
      upf_verify_record(ctx, &c);
    }
    upf_prefill_result_free(&cpu_dense), upf_prefill_result_free(&cpu_uni), upf_prefill_result_free(&got_sel);
  }
}

int upf_verify_model_wanted(const upf_verify_ctx *ctx, const upf_model_config *cfg) {
  return strstr(cfg->name, "tiny") && (!ctx->case_filter || strstr(cfg->name, ctx->case_filter));
}

void upf_verify_model(upf_verify_ctx *ctx) {
  for (int i = 0; i < upf_model_config_count(); i++) {
    const upf_model_config *cfg = upf_model_config_at(i);
    if (upf_verify_model_wanted(ctx, cfg))
      verify_config(ctx, cfg);
  }
}
