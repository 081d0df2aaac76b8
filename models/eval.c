/* The accuracy metrics of upf eval (perplexity, top-1 agreement, KL, the greedy answer check), the
 * windows of a text, the needle prompt builder, the extension of recorded drop masks, and the runs they
 * read: whole prefills, and chunked prefills through a session. Softmax sums and KL terms accumulate in
 * double, over the float logits as the prefill wrote them. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/eval.h"
#include "uniprefill/session.h"

int32_t upf_eval_argmax(const float *x, int32_t V) {
  int32_t best = 0;
  for (int32_t i = 1; i < V; i++)
    if (x[i] > x[best])
      best = i;
  return best;
}

/* log sum_i exp(x_i), shifted by the maximum. */
static double log_sum_exp(const float *x, int32_t V) {
  double mx = x[0];
  for (int32_t i = 1; i < V; i++)
    mx = x[i] > mx ? x[i] : mx;
  double s = 0.0;
  for (int32_t i = 0; i < V; i++)
    s += exp((double)x[i] - mx);
  return mx + log(s);
}

double upf_eval_nll(const float *logits, int32_t V, int32_t target) {
  return log_sum_exp(logits, V) - (double)logits[target];
}

double upf_eval_kl(const float *p, const float *q, int32_t V) {
  const double lp = log_sum_exp(p, V), lq = log_sum_exp(q, V);
  double kl = 0.0;
  for (int32_t i = 0; i < V; i++) {
    const double a = (double)p[i] - lp; /* log P_i */
    kl += exp(a) * (a - ((double)q[i] - lq));
  }
  return kl > 0.0 ? kl : 0.0; /* rounding can leave -1e-17 where the rows are equal */
}

double upf_eval_ppl(const double *nll, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++)
    s += nll[i];
  return exp(s / (double)n);
}

upf_status upf_eval_agreement_add(upf_eval_agreement *acc, const float *ref, const float *approx, int64_t n, int32_t V) {
  for (int64_t r = 0; r < n; r++) {
    const float *a = ref + r * V, *b = approx + r * V;
    for (int32_t i = 0; i < V; i++)
      if (!isfinite(a[i]) || !isfinite(b[i]))
        return upf_fail(UPF_ERR_NONFINITE, "eval: %s logit %d of row %lld is not finite",
                        isfinite(a[i]) ? "approximation" : "reference", i, (long long)r);
    const double kl = upf_eval_kl(a, b, V);
    acc->positions++;
    acc->agree += upf_eval_argmax(a, V) == upf_eval_argmax(b, V);
    acc->kl_sum += kl;
    acc->kl_max = kl > acc->kl_max ? kl : acc->kl_max;
  }
  return UPF_OK;
}

int upf_eval_answer_correct(const int32_t *argmax, const int32_t *answer, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (argmax[i] != answer[i])
      return 0;
  return n > 0;
}

upf_status upf_eval_windows(int64_t text_len, int64_t window, int32_t count, int64_t min_stride, int64_t *starts) {
  if (window < 1 || count < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: windows of %lld tokens, %d of them: want both >= 1", (long long)window,
                    count);
  if (window > text_len)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: a window of %lld tokens is longer than the text (%lld tokens)",
                    (long long)window, (long long)text_len);
  const int64_t span = text_len - window;
  if (count > 1 && span / (count - 1) < min_stride)
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "eval: %d windows of %lld tokens in a text of %lld tokens would start less than %lld tokens apart "
                    "(at most %lld fit)",
                    count, (long long)window, (long long)text_len, (long long)min_stride,
                    (long long)(min_stride > 0 ? span / min_stride + 1 : 1));
  starts[0] = 0;
  for (int32_t i = 1; i < count; i++)
    starts[i] = (span * i + (count - 1) / 2) / (count - 1);
  return UPF_OK;
}

upf_status upf_needle_build(const upf_needle_parts *p, int64_t length, double depth, int32_t *ids, int64_t *fact_at) {
  if (!(depth >= 0.0 && depth <= 1.0))
    return upf_fail(UPF_ERR_INVALID_ARG, "needle: depth %g: want a value in [0, 1]", depth);
  const int64_t fixed = p->head_len + p->fact_len + p->question_len;
  const int64_t F = length - fixed;
  if (F < 0)
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "needle: a prompt of %lld tokens cannot hold the head, fact and question (%lld tokens)",
                    (long long)length, (long long)fixed);
  if (F > p->filler_len)
    return upf_fail(UPF_ERR_INVALID_ARG, "needle: a prompt of %lld tokens needs %lld filler tokens; the text has %lld",
                    (long long)length, (long long)F, (long long)p->filler_len);
  const double target = depth * (double)F;
  int64_t a = (int64_t)floor(target + 0.5);
  if (p->breaks) {
    int64_t best = -1;
    double best_d = 0.0;
    for (int64_t i = 0; i < p->num_breaks && p->breaks[i] <= F; i++) {
      const double d = fabs((double)p->breaks[i] - target);
      if (best < 0 || d < best_d)
        best = p->breaks[i], best_d = d;
    }
    if (best < 0)
      return upf_fail(UPF_ERR_INVALID_ARG, "needle: no sentence break within the first %lld filler tokens",
                      (long long)F);
    a = best;
  }
  a = a < 0 ? 0 : a > F ? F : a;
  int32_t *o = ids;
  memcpy(o, p->head, (size_t)p->head_len * sizeof *o), o += p->head_len;
  memcpy(o, p->filler, (size_t)a * sizeof *o), o += a;
  memcpy(o, p->fact, (size_t)p->fact_len * sizeof *o), o += p->fact_len;
  memcpy(o, p->filler + a, (size_t)(F - a) * sizeof *o), o += F - a;
  memcpy(o, p->question, (size_t)p->question_len * sizeof *o);
  *fact_at = p->head_len + a;
  return UPF_OK;
}

upf_status upf_eval_extend_masks(const upf_prefill_result *res, int64_t extra, uint8_t **masks, int64_t *lens) {
  if (res->num_reqs != 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: extending drop masks needs a one-request run, got %d requests",
                    res->num_reqs);
  if (extra < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: %lld appended tokens", (long long)extra);
  for (int k = 0; k < res->num_drops; k++) {
    const int64_t n = res->drops[k].tokens_in;
    masks[k] = malloc((size_t)(n + extra > 0 ? n + extra : 1));
    if (!masks[k]) {
      for (int j = 0; j < k; j++)
        free(masks[j]), masks[j] = NULL;
      return upf_fail(UPF_ERR_NOMEM, "eval: drop mask of layer %d (%lld tokens)", res->drops[k].layer,
                      (long long)(n + extra));
    }
    memcpy(masks[k], res->drops[k].mask, (size_t)n);
    memset(masks[k] + n, 1, (size_t)extra);
    lens[k] = n + extra;
  }
  return UPF_OK;
}

void upf_eval_keep_ratios(const upf_prefill_result *res, int64_t tokens, double *ratios) {
  for (int k = 0; k < res->num_drops; k++)
    ratios[k] = (double)res->drops[k].tokens_kept / (double)tokens;
}

upf_status upf_eval_prefill_last(const upf_model *m, const int32_t *ids, int64_t n, const upf_prefill_options *opt,
                                 int64_t last, float *logits, upf_prefill_result *res) {
  memset(res, 0, sizeof *res);
  if (last < 1 || last > n)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: the last %lld positions of a %lld-token input", (long long)last,
                    (long long)n);
  if (n > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: %lld tokens in one request", (long long)n);
  const int32_t cu[2] = {0, (int32_t)n};
  upf_prefill_options o = *opt;
  o.tail_logits = (int32_t)last;
  UPF_TRY(upf_model_prefill(m, ids, cu, 1, &o, res));
  memcpy(logits, res->tail_logits, (size_t)last * m->cfg->vocab * sizeof *logits);
  return UPF_OK;
}

upf_status upf_eval_prefill_nll(const upf_model *m, const int32_t *ids, int64_t n, double *nll) {
  if (n < 2)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: perplexity needs at least 2 tokens, got %lld", (long long)n);
  if (n > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: %lld tokens in one request", (long long)n);
  int32_t *targets = malloc((size_t)n * sizeof *targets);
  if (!targets)
    return upf_fail(UPF_ERR_NOMEM, "eval: targets of %lld positions", (long long)n);
  memcpy(targets, ids + 1, (size_t)(n - 1) * sizeof *targets);
  targets[n - 1] = -1;
  const int32_t cu[2] = {0, (int32_t)n};
  upf_prefill_options o = {.mode = UPF_PREFILL_DENSE, .select = m->cfg->select, .targets = targets};
  upf_prefill_result res;
  upf_status st = upf_model_prefill(m, ids, cu, 1, &o, &res);
  free(targets);
  if (st != UPF_OK)
    return st;
  if (res.num_positions != n)
    st = upf_fail(UPF_ERR_SHAPE, "eval: the dense prefill gave %lld positions of %lld", (long long)res.num_positions,
                  (long long)n);
  for (int64_t t = 0; st == UPF_OK && t < n - 1; t++) {
    if (res.position_origin[t] != t || !isfinite(res.nll[t]))
      st = upf_fail(UPF_ERR_NONFINITE, "eval: NLL at position %lld is %g (origin %d)", (long long)t, res.nll[t],
                    res.position_origin[t]);
    nll[t] = res.nll[t];
  }
  upf_prefill_result_free(&res);
  return st;
}

/* The answer check of upf_eval_check_answer (sel: UniPrefill) and upf_eval_check_answer_sparse (sparse:
 * FlashPrefill); both NULL: dense. */
/* The run's kept share of key blocks, overall and per sparse layer (1 where a layer saw none). */
static void sparse_shares(const upf_prefill_result *res, upf_eval_answer *out) {
  out->kept_share = upf_prefill_kept_share(res);
  out->num_sparse = res->num_sparse;
  for (int32_t i = 0; i < res->num_sparse; i++) {
    const upf_sparse_record *l = &res->sparse[i];
    out->layer_kept_share[i] = l->visible_blocks ? (double)l->kept_blocks / (double)l->visible_blocks : 1.0;
  }
}

static upf_status check_answer(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer, int64_t A,
                               const upf_select_params *sel, const upf_sparse_params *sparse, upf_eval_answer *out) {
  memset(out, 0, sizeof *out);
  if (P < 1 || A < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: answer check of a %lld-token prompt and a %lld-token answer",
                    (long long)P, (long long)A);
  const int32_t V = m->cfg->vocab;
  const int64_t n = P + A - 1;
  int32_t *ids = malloc((size_t)n * sizeof *ids);
  float *logits = malloc((size_t)A * V * sizeof *logits);
  int32_t *argmax = malloc((size_t)A * sizeof *argmax);
  uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
  int64_t lens[UPF_MODEL_MAX_LAYERS] = {0};
  upf_prefill_result res;
  memset(&res, 0, sizeof res);
  upf_status st = ids && logits && argmax ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "eval: answer check buffers");
  if (st == UPF_OK) {
    memcpy(ids, prompt, (size_t)P * sizeof *ids);
    memcpy(ids + P, answer, (size_t)(A - 1) * sizeof *ids);
  }
  upf_prefill_options opt = {.mode = UPF_PREFILL_DENSE, .select = m->cfg->select};
  if (sparse) /* no token is dropped: the answer run is the FlashPrefill prefill itself */
    opt.mode = UPF_PREFILL_FLASHPREFILL, opt.sparse = *sparse;
  if (st == UPF_OK && sel) {
    /* the prompt alone: its drop layers choose the masks */
    opt.mode = UPF_PREFILL_UNIPREFILL, opt.select = *sel;
    st = upf_eval_prefill_last(m, prompt, P, &opt, 1, logits, &res);
    if (st == UPF_OK) {
      out->prompt_first = upf_eval_argmax(logits, V);
      out->num_drops = res.num_drops;
      upf_eval_keep_ratios(&res, P, out->keep);
      st = upf_eval_extend_masks(&res, A - 1, masks, lens);
    }
    /* a prompt too short to drop leaves nothing to replay: the answer run is dense, as decode is */
    if (out->num_drops == 0)
      opt.mode = UPF_PREFILL_DENSE;
    upf_prefill_result_free(&res);
    opt.replay_masks = (const uint8_t *const *)masks, opt.replay_mask_len = lens;
  }
  if (st == UPF_OK)
    st = upf_eval_prefill_last(m, ids, n, &opt, A, logits, &res);
  if (st == UPF_OK) {
    for (int64_t i = 0; i < A; i++)
      argmax[i] = upf_eval_argmax(logits + i * V, V);
    out->first = argmax[0];
    out->correct = upf_eval_answer_correct(argmax, answer, A);
    if (sparse) {
      out->prompt_first = out->first; /* one run: nothing to disagree with */
      sparse_shares(&res, out);
    }
  }
  upf_prefill_result_free(&res);
  for (int k = 0; k < UPF_MODEL_MAX_LAYERS; k++)
    free(masks[k]);
  free(ids), free(logits), free(argmax);
  return st;
}

upf_status upf_eval_check_answer(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer, int64_t A,
                                 const upf_select_params *sel, upf_eval_answer *out) {
  return check_answer(m, prompt, P, answer, A, sel, NULL, out);
}

upf_status upf_eval_check_answer_sparse(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer,
                                        int64_t A, const upf_sparse_params *sparse, upf_eval_answer *out) {
  if (!sparse)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: FlashPrefill answer check without parameters");
  return check_answer(m, prompt, P, answer, A, NULL, sparse, out);
}

/* ---- chunked prefill through a session ---- */

/* A one-request session in opt's mode with pages for `tokens`, holding the prompt ids (n). */
static upf_status chunk_session_open(const upf_model *m, const upf_prefill_options *opt, const int32_t *ids, int64_t n,
                                     int64_t tokens, upf_session **s, int32_t *req) {
  *s = NULL;
  if (n < 1 || tokens > INT32_MAX)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: a chunked prefill of %lld tokens (%lld with what follows)",
                    (long long)n, (long long)tokens);
  upf_session_config sc = upf_session_config_default(m);
  sc.mode = opt->mode, sc.select = opt->select, sc.sparse = opt->sparse, sc.compact = opt->compact;
  sc.max_requests = 1;
  sc.pages_per_group = (tokens + sc.page_size - 1) / sc.page_size;
  UPF_TRY(upf_session_create(m, &sc, s));
  const upf_status st = upf_session_add_request(*s, ids, (int32_t)n, req);
  if (st != UPF_OK)
    upf_session_free(*s), *s = NULL;
  return st;
}

/* Adds a later step's times, tokens and sparse records (matched by layer) to acc, and takes its logits. */
static void chunk_step_add(const upf_model *m, upf_prefill_result *acc, const upf_prefill_result *step) {
  for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
    acc->layer_seconds[l] += step->layer_seconds[l], acc->mixer_seconds[l] += step->mixer_seconds[l];
    acc->ffn_seconds[l] += step->ffn_seconds[l], acc->layer_tokens[l] += step->layer_tokens[l];
  }
  acc->total_seconds += step->total_seconds;
  for (int32_t i = 0; i < step->num_sparse; i++) {
    int32_t j = 0;
    while (j < acc->num_sparse && acc->sparse[j].layer != step->sparse[i].layer)
      j++;
    if (j == acc->num_sparse) {
      if (j == UPF_MODEL_MAX_LAYERS)
        continue; /* one record per full-attention layer: never more than the layers */
      memset(&acc->sparse[j], 0, sizeof acc->sparse[j]);
      acc->sparse[j].layer = step->sparse[i].layer, acc->num_sparse++;
    }
    acc->sparse[j].kept_blocks += step->sparse[i].kept_blocks;
    acc->sparse[j].visible_blocks += step->sparse[i].visible_blocks;
    acc->sparse[j].index_seconds += step->sparse[i].index_seconds;
    acc->sparse[j].attn_seconds += step->sparse[i].attn_seconds;
  }
  memcpy(acc->logits, step->logits, (size_t)m->cfg->vocab * sizeof *acc->logits);
}

/* The request's prompt (n tokens) in chunks of C; the logits of its last `last` positions into logits
 * (last, V) as the chunks holding them run (a suffix of the prompt meets every chunk in a suffix of the
 * chunk, so each step asks its row's tail). res: as upf_eval_prefill_last_chunked. */
static upf_status chunk_prefill(const upf_model *m, upf_session *s, int32_t req, int64_t n, int64_t C, int64_t last,
                                float *logits, upf_prefill_result *res, int32_t *chunks) {
  const int32_t V = m->cfg->vocab;
  int32_t steps = 0;
  upf_status st = UPF_OK;
  for (int64_t done = 0; st == UPF_OK && done < n; steps++) {
    const int64_t k = n - done < C ? n - done : C, from = done > n - last ? done : n - last;
    const upf_session_row row = {req, UPF_ROW_PREFILL, 0, (int32_t)k};
    upf_session_step_options so;
    memset(&so, 0, sizeof so);
    so.tail_logits = done + k > from ? (int32_t)(done + k - from) : 0;
    upf_prefill_result step;
    st = upf_session_step(s, &row, 1, &so, &step);
    if (st != UPF_OK)
      break;
    if (so.tail_logits)
      memcpy(logits + (from - (n - last)) * V, step.tail_logits, (size_t)so.tail_logits * V * sizeof *logits);
    free(step.tail_logits), step.tail_logits = NULL, step.tail_n = 0;
    if (!steps) {
      *res = step; /* the first step's records (a whole prompt's drops among them) are the result's */
    } else {
      chunk_step_add(m, res, &step);
      upf_prefill_result_free(&step);
    }
    done += k;
  }
  if (chunks)
    *chunks = steps;
  return st;
}

upf_status upf_eval_prefill_last_chunked(const upf_model *m, const int32_t *ids, int64_t n,
                                         const upf_prefill_options *opt, int64_t chunk, int64_t last, float *logits,
                                         upf_prefill_result *res, int32_t *chunks) {
  memset(res, 0, sizeof *res);
  if (chunks)
    *chunks = 0;
  if (last < 1 || last > n)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: the last %lld positions of a %lld-token input", (long long)last,
                    (long long)n);
  if (chunk < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: chunks of %lld tokens (want >= 1)", (long long)chunk);
  upf_session *s = NULL;
  int32_t req = -1;
  UPF_TRY(chunk_session_open(m, opt, ids, n, n, &s, &req));
  const upf_status st = chunk_prefill(m, s, req, n, chunk, last, logits, res, chunks);
  upf_session_free(s);
  if (st != UPF_OK)
    upf_prefill_result_free(res);
  return st;
}

upf_status upf_eval_check_answer_chunked(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer,
                                         int64_t A, const upf_prefill_options *opt, int64_t chunk,
                                         upf_eval_answer *out) {
  memset(out, 0, sizeof *out);
  if (P < 1 || A < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: answer check of a %lld-token prompt and a %lld-token answer",
                    (long long)P, (long long)A);
  if (chunk < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "eval: chunks of %lld tokens (want >= 1)", (long long)chunk);
  for (int64_t i = 0; i < A; i++)
    if (answer[i] < 0 || answer[i] >= m->cfg->vocab)
      return upf_fail(UPF_ERR_INVALID_ARG, "eval: answer token %lld is %d, outside the vocabulary [0, %d)",
                      (long long)i, answer[i], m->cfg->vocab);
  const int32_t V = m->cfg->vocab;
  float *last = malloc((size_t)V * sizeof *last);
  int32_t *argmax = malloc((size_t)A * sizeof *argmax);
  upf_session *s = NULL;
  int32_t req = -1;
  upf_prefill_result res;
  memset(&res, 0, sizeof res);
  upf_status st = last && argmax ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "eval: answer check buffers");
  if (st == UPF_OK)
    st = chunk_session_open(m, opt, prompt, P, P + A - 1, &s, &req);
  if (st == UPF_OK)
    st = chunk_prefill(m, s, req, P, chunk, 1, last, &res, NULL);
  if (st == UPF_OK) {
    argmax[0] = upf_eval_argmax(last, V);
    out->first = out->prompt_first = argmax[0];
    out->num_drops = res.num_drops;
    upf_eval_keep_ratios(&res, P, out->keep);
    sparse_shares(&res, out);
  }
  /* teacher forcing, as decode would run it: each answer token fed after the prompt's cache */
  for (int64_t i = 1; st == UPF_OK && i < A; i++) {
    const upf_session_row row = {req, UPF_ROW_DECODE, answer[i - 1], 0};
    upf_prefill_result step;
    st = upf_session_step(s, &row, 1, NULL, &step);
    if (st == UPF_OK)
      argmax[i] = upf_eval_argmax(step.logits, V);
    upf_prefill_result_free(&step);
  }
  if (st == UPF_OK)
    out->correct = upf_eval_answer_correct(argmax, answer, A);
  upf_prefill_result_free(&res);
  upf_session_free(s);
  free(last), free(argmax);
  return st;
}
