/* End-to-end check of the models (`upf verify model`): every tiny config, f32 and bf16, dense and
 * UniPrefill, on the backend under test against the CPU reference. UniPrefill runs twice on the
 * backend: once replaying the CPU's masks (numerics compared without decision noise), once selecting
 * by itself (kept counts compared; a difference is reported, as marginal decisions may differ).
 * Logits: f32 models under the fp32 tolerance; bf16 models under the long-reduction rule against the
 * f32 model on the CPU (err(backend) <= 2 err(CPU bf16) + atol). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static double max_abs_diff(const float *a, const float *b, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)a[i] - (double)b[i]);
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

/* Logits of the backend against the CPU's, by the rule of the dtype (see the file comment). */
static void compare_logits(upf_check *c, upf_dtype dt, const float *got, const float *cpu, const float *truth,
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
  if (dt == UPF_DTYPE_BF16 && truth) {
    const double err_got = max_abs_diff(got, truth, n), err_cpu = max_abs_diff(cpu, truth, n);
    const double bound = 2.0 * err_cpu + tol.atol;
    c->passed = err_got <= bound && !isnan(err_got);
    c->budget = bound > 0 ? err_got / bound : 0.0;
    snprintf(c->detail, sizeof c->detail, "long-reduction rule: err vs f32 CPU %.3g <= 2 x %.3g + %.0e", err_got,
             err_cpu, tol.atol);
  }
  free(ref);
}

static void record_status(upf_verify_ctx *ctx, upf_check *c, upf_status st) {
  c->passed = 0;
  snprintf(c->detail, sizeof c->detail, "%s: %s", upf_status_name(st), upf_last_error());
  upf_verify_record(ctx, c);
}

static void verify_config(upf_verify_ctx *ctx, const upf_model_config *cfg) {
  const upf_backend *cpu = upf_backend_cpu(), *be = ctx->backend;
  const uint64_t seed = upf_verify_case_seed("model.prefill", 0, (uint64_t)cfg->family);
  upf_prefill_options dense = {.mode = UPF_PREFILL_DENSE, .select = cfg->select};
  upf_prefill_options uni = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select};
  upf_prefill_result truth;
  upf_status st = upf_model_run_seeded(cfg, cpu, UPF_DTYPE_F32, seed, model_lengths, MODEL_REQS, &dense, &truth);
  for (int d = 0; d < 2; d++) {
    const upf_dtype dt = d ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
    upf_check c;
    upf_prefill_result ref = {0}, got = {0}, ref_u = {0}, got_u = {0}, got_sel = {0};
    /* dense */
    fill_check(&c, cfg, dt, "dense");
    if (st != UPF_OK) {
      record_status(ctx, &c, st);
      return;
    }
    upf_status s = upf_model_run_seeded(cfg, cpu, dt, seed, model_lengths, MODEL_REQS, &dense, &ref);
    if (s == UPF_OK)
      s = upf_model_run_seeded(cfg, be, dt, seed, model_lengths, MODEL_REQS, &dense, &got);
    if (s != UPF_OK)
      record_status(ctx, &c, s);
    else {
      compare_logits(&c, dt, got.logits, ref.logits, truth.logits, (int64_t)MODEL_REQS * cfg->vocab);
      upf_verify_record(ctx, &c);
    }
    /* UniPrefill, the CPU's masks replayed on the backend */
    fill_check(&c, cfg, dt, "uniprefill replay");
    s = upf_model_run_seeded(cfg, cpu, dt, seed, model_lengths, MODEL_REQS, &uni, &ref_u);
    const uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
    int64_t lens[UPF_MODEL_MAX_LAYERS] = {0};
    for (int i = 0; s == UPF_OK && i < ref_u.num_drops; i++)
      masks[i] = ref_u.drops[i].mask, lens[i] = ref_u.drops[i].tokens_in;
    upf_prefill_options replay = uni;
    replay.replay_masks = masks, replay.replay_mask_len = lens;
    if (s == UPF_OK)
      s = upf_model_run_seeded(cfg, be, dt, seed, model_lengths, MODEL_REQS, &replay, &got_u);
    if (s != UPF_OK)
      record_status(ctx, &c, s);
    else {
      /* bf16: the same rule as dense, against the f32 CPU model with the same masks replayed */
      upf_prefill_result truth_u = {0};
      const upf_status ts = dt == UPF_DTYPE_BF16 ? upf_model_run_seeded(cfg, cpu, UPF_DTYPE_F32, seed, model_lengths,
                                                                        MODEL_REQS, &replay, &truth_u)
                                                 : UPF_OK;
      compare_logits(&c, dt, got_u.logits, ref_u.logits, ts == UPF_OK ? truth_u.logits : NULL,
                     (int64_t)MODEL_REQS * cfg->vocab);
      upf_prefill_result_free(&truth_u);
      int64_t kept_ref = 0;
      for (int i = 0; i < ref_u.num_drops; i++)
        kept_ref += ref_u.drops[i].tokens_kept;
      if (ref_u.num_drops != cfg->num_drop_layers || kept_ref == 0) {
        c.passed = 0;
        snprintf(c.detail, sizeof c.detail, "%d drops of %d expected", ref_u.num_drops, cfg->num_drop_layers);
      }
      upf_verify_record(ctx, &c);
    }
    /* UniPrefill selecting on the backend: the kept counts, by drop layer */
    fill_check(&c, cfg, dt, "uniprefill select");
    if (s == UPF_OK)
      s = upf_model_run_seeded(cfg, be, dt, seed, model_lengths, MODEL_REQS, &uni, &got_sel);
    if (s != UPF_OK)
      record_status(ctx, &c, s);
    else {
      c.passed = got_sel.num_drops == ref_u.num_drops;
      int differ = 0;
      for (int i = 0; c.passed && i < got_sel.num_drops; i++)
        differ += got_sel.drops[i].tokens_kept != ref_u.drops[i].tokens_kept;
      snprintf(c.detail, sizeof c.detail, "%d drop layers, %d with kept counts other than the CPU's%s",
               got_sel.num_drops, differ, differ ? " (marginal decisions)" : "");
      upf_verify_record(ctx, &c);
    }
    upf_prefill_result_free(&ref), upf_prefill_result_free(&got), upf_prefill_result_free(&ref_u);
    upf_prefill_result_free(&got_u), upf_prefill_result_free(&got_sel);
  }
  upf_prefill_result_free(&truth);
}

void upf_verify_model(upf_verify_ctx *ctx) {
  for (int i = 0; i < upf_model_config_count(); i++) {
    const upf_model_config *cfg = upf_model_config_at(i);
    if (strstr(cfg->name, "tiny"))
      verify_config(ctx, cfg);
  }
}
