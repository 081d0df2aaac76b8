/* End-to-end check of greedy generation through a session (`upf verify model.generate`): every tiny
 * config, f32 and bf16, dense and UniPrefill, on the backend under test against the CPU reference.
 * Both generate freely (prefill of every request in one step, then decode steps of one row per
 * request fed with its own greedy pick); in UniPrefill mode the backend's prefill replays the CPU's
 * masks, so the numerics are compared without decision noise.
 *
 * Logits of every step (the prefill's and each decode step's): the long-reduction rule of SPEC
 * section 7 against the fp64 truth of verify/model_truth.c, err(backend) <= 2 err(CPU of the same
 * dtype) + atol, where the truth of step i is a from-scratch pass over prompt + the first i generated
 * tokens with the CPU's drop masks extended by keep = 1 for the generated tokens (decode equals
 * recomputation). Tokens: where the rule holds, |backend - CPU| <= 3 err(CPU) + atol, so a greedy pick
 * can differ only where the CPU's top-2 margin is at most twice that; the backend's picks must equal
 * the CPU's wherever the margin exceeds it. A marginal pick that differs ends the comparison of that
 * run there (the two then decode different histories), and the detail says so. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/engine.h"
#include "uniprefill/session.h"
#include "verify/model_truth.h"
#include "verify/verify.h"
#include "verify/verify_model.h"

/* A long request that drops, one shorter than sink + last_q, a medium one. */
static const int32_t gen_lengths[] = {96, 20, 40};
#define GEN_REQS 3
#define GEN_STEPS 4 /* the prefill's pick and 3 decode steps */

typedef struct {
  float *logits;             /* (GEN_STEPS, B, V): step i's logits, after i generated tokens were fed */
  int32_t tokens[GEN_STEPS * GEN_REQS]; /* (GEN_STEPS, B) the greedy picks */
  upf_prefill_result prefill; /* the prefill step's result (its drop masks) */
} gen_run;

static void gen_run_free(gen_run *g) {
  free(g->logits);
  upf_prefill_result_free(&g->prefill);
  memset(g, 0, sizeof *g);
}

/* Generates GEN_STEPS tokens per request on be. replay: the CPU's prefill whose masks the prefill step
 * replays (NULL: select). */
static upf_status generate(const upf_model_config *cfg, const upf_backend *be, upf_dtype dt, uint64_t seed,
                           upf_prefill_mode mode, const upf_select_params *sel, const int32_t *ids, const int32_t *cu,
                           const upf_prefill_result *replay, gen_run *out) {
  memset(out, 0, sizeof *out);
  const int32_t V = cfg->vocab;
  out->logits = malloc(sizeof(float) * (size_t)GEN_STEPS * GEN_REQS * (size_t)V);
  if (!out->logits)
    return upf_fail(UPF_ERR_NOMEM, "generate check: logits");
  upf_model m;
  UPF_TRY(upf_model_init_seeded(&m, cfg, be, dt, seed, 0, cfg->num_layers));
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = mode, sc.select = *sel, sc.max_requests = GEN_REQS, sc.pages_per_group = 0;
  for (int r = 0; r < GEN_REQS; r++)
    sc.pages_per_group += (gen_lengths[r] + GEN_STEPS + sc.page_size - 1) / sc.page_size;
  upf_session *s = NULL;
  upf_status st = upf_session_create(&m, &sc, &s);
  upf_session_row rows[GEN_REQS];
  for (int r = 0; st == UPF_OK && r < GEN_REQS; r++) {
    rows[r] = (upf_session_row){-1, UPF_ROW_PREFILL, 0};
    st = upf_session_add_request(s, ids + cu[r], cu[r + 1] - cu[r], &rows[r].req);
  }
  const uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
  int64_t lens[UPF_MODEL_MAX_LAYERS] = {0};
  upf_session_step_options so = {0};
  if (replay) {
    for (int k = 0; k < replay->num_drops; k++)
      masks[k] = replay->drops[k].mask, lens[k] = replay->drops[k].tokens_in;
    so.replay_masks = masks, so.replay_mask_len = lens;
  }
  for (int i = 0; st == UPF_OK && i < GEN_STEPS; i++) {
    upf_prefill_result res;
    st = upf_session_step(s, rows, GEN_REQS, i == 0 ? &so : NULL, &res);
    if (st != UPF_OK)
      break;
    memcpy(out->logits + (size_t)i * GEN_REQS * V, res.logits, sizeof(float) * GEN_REQS * (size_t)V);
    for (int r = 0; r < GEN_REQS; r++) {
      out->tokens[i * GEN_REQS + r] = upf_engine_argmax(res.logits + (size_t)r * V, V);
      rows[r].kind = UPF_ROW_DECODE, rows[r].token = out->tokens[i * GEN_REQS + r];
    }
    if (i == 0)
      out->prefill = res;
    else
      upf_prefill_result_free(&res);
  }
  upf_session_free(s);
  upf_model_free(&m);
  return st;
}

/* The fp64 truth of every step (GEN_STEPS, B, V): one batch of GEN_STEPS x B requests, request (i, r)
 * being prompt r + the CPU's first i picks, with the CPU's prefill drops extended by keep = 1. */
static upf_status truth_of_steps(const upf_model_config *cfg, uint64_t seed, const int32_t *ids, const int32_t *cu,
                                 const gen_run *cpu, int uni, double *truth) {
  enum { NB = GEN_STEPS * GEN_REQS };
  int32_t tcu[NB + 1] = {0};
  for (int i = 0; i < GEN_STEPS; i++)
    for (int r = 0; r < GEN_REQS; r++)
      tcu[i * GEN_REQS + r + 1] = tcu[i * GEN_REQS + r] + cu[r + 1] - cu[r] + i;
  int32_t *tids = malloc(sizeof(int32_t) * (size_t)tcu[NB]);
  upf_prefill_result drops;
  memset(&drops, 0, sizeof drops);
  upf_status st = tids ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "generate truth: ids");
  for (int i = 0; st == UPF_OK && i < GEN_STEPS; i++)
    for (int r = 0; r < GEN_REQS; r++) {
      int32_t *dst = tids + tcu[i * GEN_REQS + r];
      memcpy(dst, ids + cu[r], sizeof(int32_t) * (size_t)(cu[r + 1] - cu[r]));
      for (int j = 0; j < i; j++)
        dst[cu[r + 1] - cu[r] + j] = cpu->tokens[j * GEN_REQS + r];
    }
  /* drop d's mask over the batch: each request's part of the CPU prefill's mask, then i ones */
  const upf_prefill_result *pre = &cpu->prefill;
  if (uni) {
    drops.num_drops = pre->num_drops;
    int32_t part[GEN_REQS];
    for (int r = 0; r < GEN_REQS; r++)
      part[r] = cu[r + 1] - cu[r];
    for (int d = 0; st == UPF_OK && d < pre->num_drops; d++) {
      upf_drop_record *rec = &drops.drops[d];
      rec->layer = pre->drops[d].layer;
      int64_t in = 0;
      for (int i = 0; i < GEN_STEPS; i++)
        for (int r = 0; r < GEN_REQS; r++)
          in += part[r] + i;
      rec->tokens_in = in;
      rec->mask = malloc((size_t)in);
      if (!rec->mask) {
        st = upf_fail(UPF_ERR_NOMEM, "generate truth: masks");
        break;
      }
      int64_t off = 0;
      for (int i = 0; i < GEN_STEPS; i++) {
        int64_t src = 0;
        for (int r = 0; r < GEN_REQS; r++) {
          memcpy(rec->mask + off, pre->drops[d].mask + src, (size_t)part[r]);
          memset(rec->mask + off + part[r], 1, (size_t)i);
          off += part[r] + i, src += part[r];
        }
      }
      for (int r = 0; r < GEN_REQS; r++)
        part[r] = pre->drops[d].kept_per_req[r];
    }
  }
  upf_model m;
  if (st == UPF_OK)
    st = upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, seed, 0, cfg->num_layers);
  if (st == UPF_OK) {
    if (!upf_model_truth(&m, tids, tcu, NB, uni ? &drops : NULL, 0, truth))
      st = upf_fail(UPF_ERR_INVALID_ARG, "generate truth of %s: the drop records do not fit", cfg->name);
    upf_model_free(&m);
  }
  for (int d = 0; d < drops.num_drops; d++)
    free(drops.drops[d].mask);
  free(tids);
  return st;
}

/* One check: cfg, dt, one mode. */
static void check_generate(upf_verify_ctx *ctx, const upf_model_config *cfg, upf_dtype dt, uint64_t seed,
                           upf_prefill_mode mode, const upf_select_params *sel) {
  const int uni = mode == UPF_PREFILL_UNIPREFILL;
  const int32_t V = cfg->vocab;
  upf_check c;
  memset(&c, 0, sizeof c);
  snprintf(c.op, sizeof c.op, "model.generate");
  snprintf(c.variant, sizeof c.variant, "%s %s", cfg->name, uni ? "uniprefill replay" : "dense");
  snprintf(c.dtype, sizeof c.dtype, "%s", upf_dtype_name(dt));
  snprintf(c.shape, sizeof c.shape, "B=%d prompts %d,%d,%d; %d tokens each", GEN_REQS, gen_lengths[0],
           gen_lengths[1], gen_lengths[2], GEN_STEPS);
  int32_t cu[GEN_REQS + 1] = {0};
  for (int r = 0; r < GEN_REQS; r++)
    cu[r + 1] = cu[r] + gen_lengths[r];
  int32_t ids[96 + 20 + 40];
  upf_model_seeded_ids(seed, V, cu[GEN_REQS], ids);
  gen_run cpu, got;
  memset(&got, 0, sizeof got);
  double *truth = malloc(sizeof(double) * (size_t)GEN_STEPS * GEN_REQS * (size_t)V);
  upf_status st = generate(cfg, upf_backend_cpu(), dt, seed, mode, sel, ids, cu, NULL, &cpu);
  if (st == UPF_OK)
    st = generate(cfg, ctx->backend, dt, seed, mode, sel, ids, cu, uni ? &cpu.prefill : NULL, &got);
  if (st == UPF_OK)
    st = truth ? truth_of_steps(cfg, seed, ids, cu, &cpu, uni, truth) : upf_fail(UPF_ERR_NOMEM, "generate truth");
  if (st != UPF_OK) {
    c.passed = 0;
    snprintf(c.detail, sizeof c.detail, "%s: %s", upf_status_name(st), upf_last_error());
    upf_verify_record(ctx, &c);
    gen_run_free(&cpu), gen_run_free(&got), free(truth);
    return;
  }
  const double atol = upf_tolerance_for(dt).atol;
  const int64_t n = (int64_t)GEN_REQS * V;
  double worst = 0;
  int worst_step = 0, steps = 0, picks = 0, marginal = 0, stopped = -1;
  c.passed = 1;
  for (int i = 0; i < GEN_STEPS && stopped < 0; i++) {
    const float *lb = got.logits + (size_t)i * n, *lc = cpu.logits + (size_t)i * n;
    const double *lt = truth + (size_t)i * n;
    const double err_b = upf_verify_max_abs_diff(lb, lt, n), err_c = upf_verify_max_abs_diff(lc, lt, n);
    const double bound = 2 * err_c + atol;
    const double share = isnan(err_b) ? INFINITY : err_b / bound;
    if (share > worst || steps == 0)
      worst = share, worst_step = i;
    c.passed &= share <= 1;
    c.max_abs_err = err_b > c.max_abs_err || isnan(err_b) ? err_b : c.max_abs_err;
    steps++;
    const double tol = 2 * (3 * err_c + atol);
    for (int r = 0; r < GEN_REQS; r++) {
      const float *row = lc + (size_t)r * V;
      const int32_t want = cpu.tokens[i * GEN_REQS + r], pick = got.tokens[i * GEN_REQS + r];
      float second = -INFINITY;
      for (int32_t v = 0; v < V; v++)
        if (v != want && row[v] > second)
          second = row[v];
      const int clear = (double)row[want] - (double)second > tol;
      picks += clear, marginal += !clear;
      if (pick != want) {
        c.passed &= !clear;
        stopped = i; /* the histories differ from here on */
      }
    }
  }
  c.budget = worst;
  int kept = 0, in = 0;
  for (int r = 0; r < GEN_REQS; r++)
    in += gen_lengths[r], kept += cpu.prefill.num_drops ? cpu.prefill.drops[cpu.prefill.num_drops - 1].kept_per_req[r] : 0;
  char kept_text[64] = "";
  if (uni)
    snprintf(kept_text, sizeof kept_text, ", %d of %d prompt tokens kept", kept, in);
  if (uni && (cpu.prefill.num_drops != cfg->num_drop_layers || kept == in)) {
    c.passed = 0;
    snprintf(c.detail, sizeof c.detail, "the CPU's prefill ran %d drops of %d, keeping %d of %d tokens",
             cpu.prefill.num_drops, cfg->num_drop_layers, kept, in);
  } else {
    snprintf(c.detail, sizeof c.detail,
             "%d steps%s: worst err vs fp64 truth at step %d, %.2f of 2 x CPU's + %.0e; %d picks clear of the margin, "
             "%d marginal%s",
             steps, kept_text, worst_step, worst, atol, picks, marginal,
             stopped >= 0 ? "; a marginal pick differed and ended the comparison" : "");
  }
  upf_verify_record(ctx, &c);
  gen_run_free(&cpu), gen_run_free(&got), free(truth);
}

void upf_verify_generate_config(upf_verify_ctx *ctx, const upf_model_config *cfg, upf_dtype dt) {
  const uint64_t seed = upf_verify_case_seed("model.generate", 0, (uint64_t)cfg->family);
  upf_select_params sel = cfg->select;
  sel.p = 0.5f; /* random weights attend almost uniformly: p = 0.5 drops about half the blocks */
  check_generate(ctx, cfg, dt, seed, UPF_PREFILL_DENSE, &sel);
  check_generate(ctx, cfg, dt, seed, UPF_PREFILL_UNIPREFILL, &sel);
}

void upf_verify_generate(upf_verify_ctx *ctx) {
  for (int i = 0; i < upf_model_config_count(); i++) {
    const upf_model_config *cfg = upf_model_config_at(i);
    if (upf_verify_model_wanted(ctx, cfg)) {
      upf_verify_generate_config(ctx, cfg, UPF_DTYPE_F32);
      upf_verify_generate_config(ctx, cfg, UPF_DTYPE_BF16);
    }
  }
}
