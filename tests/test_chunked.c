/* Chunked prefill (SPEC section 9) on the tiny configs: a prompt prefilled in chunks through the paged
 * cache gives the logits of the unchunked prefill (every chunk those of its prefix), for chunks that
 * end mid-page, one-token chunks and one chunk holding the whole prompt; Gemma's window across a chunk
 * boundary; Qwen3-Next's Gated DeltaNet states across chunks (and a twin that drops them fails);
 * requests of several lengths chunking beside whole prompts and decode rows; UniPrefill dropping only
 * from whole prompts; FlashPrefill running a chunk block-sparse over its cached context; decoding after
 * a chunked prefill; the engine's chunked schedule (budget, decodes first, the tokens of the unchunked
 * run); and the --chunk flag of prefill, generate and serve-sim. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/engine.h"
#include "uniprefill/npy.h"
#include "uniprefill/session.h"
#include "verify/model_truth.h"
#include "verify/verify_model.h"

static const char *const tiny[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
#define NUM_TINY 3

/* The largest |a - r| / (atol + rtol |r|) over n values: <= 1 passes (SPEC section 7's elementwise rule). */
static double err_share(const float *a, const float *r, int64_t n, double atol, double rtol) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    const double share = fabs((double)a[i] - r[i]) / (atol + rtol * fabs((double)r[i]));
    worst = share > worst || isnan(share) ? share : worst;
  }
  return worst;
}

/* The backend under test and its elementwise tolerance against the CPU's unchunked prefill: f32 on
 * the CPU, where the paged and the contiguous attention differ in summation order only; CUDA's kernels
 * differ more (as in the decode suite). A comparison outside it may still pass SPEC section 7's
 * long-reduction rule (dense_ok). */
typedef struct {
  const upf_backend *be;
  double atol, rtol;
} target;

static target cpu_target(void) { return (target){upf_backend_cpu(), 1e-5, 1e-5}; }
static target cuda_target(void) { return (target){upf_backend_cuda(), 1e-4, 1e-4}; }

/* The seeded models (seed 11, f32) the suite's tests share, one per (backend, family), built on first
 * use and freed by the suite's clean-up: building one costs as much as a prefill under Valgrind. */
static struct {
  const upf_backend *be;
  const upf_model_config *cfg;
  upf_model m;
} cache[8];
static int num_cached;

static const upf_model *model_of(const upf_backend *be, const char *family) {
  const upf_model_config *cfg = upf_model_config_by_name(family);
  for (int i = 0; i < num_cached; i++)
    if (cache[i].be == be && cache[i].cfg == cfg)
      return &cache[i].m;
  if (!cfg || num_cached == (int)(sizeof cache / sizeof *cache))
    return NULL;
  const upf_status st = upf_model_init_seeded(&cache[num_cached].m, cfg, be, UPF_DTYPE_F32, 11, 0, cfg->num_layers);
  if (st != UPF_OK) {
    printf("\n%s on %s: %s\n", family, be->name, upf_last_error());
    return NULL;
  }
  cache[num_cached].be = be, cache[num_cached].cfg = cfg;
  return &cache[num_cached++].m;
}

static int suite_clean(void) {
  for (int i = 0; i < num_cached; i++)
    upf_model_free(&cache[i].m);
  num_cached = 0;
  return 0;
}

/* The model on the target's backend, and the same weights on the CPU (the baseline's and the fp64
 * truth's; the model itself when the target is the CPU). A twin of the CPU backend gets a model of
 * its own (own = 1), freed by models_free. */
typedef struct {
  const upf_model *m, *cpu;
  upf_model own_m;
  int own;
} models;

static int models_init(models *p, const target *t, const char *family) {
  memset(p, 0, sizeof *p);
  p->cpu = model_of(upf_backend_cpu(), family);
  if (t->be == upf_backend_cpu() || t->be == upf_backend_cuda()) {
    p->m = model_of(t->be, family);
    return p->m && p->cpu;
  }
  const upf_model_config *cfg = upf_model_config_by_name(family);
  p->own = upf_model_init_seeded(&p->own_m, cfg, t->be, UPF_DTYPE_F32, 11, 0, cfg->num_layers) == UPF_OK;
  p->m = p->own ? &p->own_m : NULL;
  return p->m && p->cpu;
}

static void models_free(models *p) {
  if (p->own)
    upf_model_free(&p->own_m);
}

/* The last-position logits of an unchunked prefill of ids (len) in the given mode: (V) malloc'd. */
static float *prefill_logits(const upf_model *m, upf_prefill_mode mode, const upf_select_params *sel,
                             const upf_sparse_params *sp, const int32_t *ids, int32_t len) {
  upf_prefill_options o = {.mode = mode, .select = sel ? *sel : m->cfg->select};
  if (sp)
    o.sparse = *sp;
  const int32_t cu[2] = {0, len};
  upf_prefill_result res;
  const upf_status st = upf_model_prefill(m, ids, cu, 1, &o, &res);
  if (st != UPF_OK) {
    printf("\nprefill of %d tokens: %s\n", len, upf_last_error());
    return NULL;
  }
  float *out = malloc(sizeof(float) * (size_t)m->cfg->vocab);
  memcpy(out, res.logits, sizeof(float) * (size_t)m->cfg->vocab);
  upf_prefill_result_free(&res);
  return out;
}

/* got (V): the logits after ids[0 .. len) of a chunked (or decoding) run of the target. It passes
 * against the unchunked dense prefill on the CPU (the f32 baseline) within the target's elementwise
 * tolerance, or within SPEC section 7's long-reduction rule: max |got - truth| <= 2 max |baseline -
 * truth| + atol (1e-5, f32), truth the fp64 forward pass of verify/model_truth.c. Says what failed. */
static int dense_ok_base(const target *t, const upf_model *cpu, const float *got, const float *given_base,
                         const int32_t *ids, int32_t len, const char *what, int quiet) {
  const int32_t V = cpu->cfg->vocab;
  float *base = given_base ? NULL : prefill_logits(cpu, UPF_PREFILL_DENSE, NULL, NULL, ids, len);
  if (!given_base && !base)
    return 0;
  if (given_base)
    base = (float *)given_base;
  const double share = err_share(got, base, V, t->atol, t->rtol);
  int ok = share <= 1;
  double err_got = 0, bound = 0;
  if (!ok) {
    double *truth = malloc(sizeof(double) * (size_t)V);
    const int32_t cu[2] = {0, len};
    if (truth && upf_model_truth(cpu, ids, cu, 1, NULL, 0, truth)) {
      err_got = upf_verify_max_abs_diff(got, truth, V);
      bound = 2.0 * upf_verify_max_abs_diff(base, truth, V) + 1e-5;
      ok = err_got <= bound;
    }
    free(truth);
  }
  if (!ok && !quiet)
    printf("\n%s %s (%d tokens): %.2f of the elementwise tolerance; err vs fp64 truth %.3g > bound %.3g\n",
           cpu->cfg->name, what, len, share, err_got, bound);
  if (!given_base)
    free(base);
  return ok;
}
static int dense_ok(const target *t, const upf_model *cpu, const float *got, const int32_t *ids, int32_t len,
                    const char *what, int quiet) {
  return dense_ok_base(t, cpu, got, NULL, ids, len, what, quiet);
}

/* A session of one or a few requests: dense unless given, pages for 4 requests of 256 tokens. */
static upf_session *session_new(const upf_model *m, upf_prefill_mode mode, const upf_select_params *sel,
                                const upf_sparse_params *sp) {
  upf_session_config sc = upf_session_config_default(m);
  sc.mode = mode, sc.max_requests = 8, sc.pages_per_group = 96;
  if (sel)
    sc.select = *sel;
  if (sp)
    sc.sparse = *sp;
  upf_session *s = NULL;
  if (upf_session_create(m, &sc, &s) != UPF_OK) {
    printf("\nsession: %s\n", upf_last_error());
    return NULL;
  }
  return s;
}

/* Prefills request req (len prompt tokens) alone in chunks of C; each chunk's logits into
 * chunk_logits (num_chunks, V) when given; the last into last (V). Returns the chunks run, -1 on a
 * failed step. sparse_kept/visible (may be NULL) sum the steps' sparse records. */
static int chunked_prefill(upf_session *s, const upf_model *m, int32_t req, int32_t len, int32_t C, float *chunk_logits,
                           float *last, int64_t *sparse_kept, int64_t *sparse_visible) {
  const int32_t V = m->cfg->vocab;
  int n = 0;
  for (int32_t done = 0; done < len; n++) {
    const int32_t k = len - done < C ? len - done : C;
    const upf_session_row row = {req, UPF_ROW_PREFILL, 0, k};
    upf_prefill_result res;
    if (upf_session_step(s, &row, 1, NULL, &res) != UPF_OK) {
      printf("\nchunk %d (%d tokens at %d): %s\n", n, k, done, upf_last_error());
      return -1;
    }
    if (chunk_logits)
      memcpy(chunk_logits + (size_t)n * V, res.logits, sizeof(float) * (size_t)V);
    memcpy(last, res.logits, sizeof(float) * (size_t)V);
    for (int32_t i = 0; i < res.num_sparse; i++) {
      if (sparse_kept)
        *sparse_kept += res.sparse[i].kept_blocks;
      if (sparse_visible)
        *sparse_visible += res.sparse[i].visible_blocks;
    }
    upf_prefill_result_free(&res);
    done += k;
  }
  return n;
}

/* One family, one prompt, the given chunk sizes: the last chunk's logits equal the unchunked prefill's
 * and (all_chunks) every chunk's equal those of its prefix; the request's state after it (prefilled,
 * chunks, kv_len at every attention layer, pages) by hand. */
static void check_chunk_sizes(const target *t, const char *family, int32_t len, const int32_t *sizes, int num_sizes,
                              int all_chunks) {
  models p;
  CU_ASSERT_FATAL(models_init(&p, t, family));
  const upf_model_config *cfg = p.m->cfg;
  const int32_t V = cfg->vocab;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)len);
  upf_model_seeded_ids(3, V, len, ids);
  float *base = prefill_logits(p.cpu, UPF_PREFILL_DENSE, NULL, NULL, ids, len);
  CU_ASSERT_FATAL(base != NULL);
  for (int k = 0; k < num_sizes; k++) {
    const int32_t C = sizes[k], chunks = (len + C - 1) / C;
    upf_session *s = session_new(p.m, UPF_PREFILL_DENSE, NULL, NULL);
    CU_ASSERT_FATAL(s != NULL);
    int32_t req = -1;
    CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, ids, len, &req), UPF_OK);
    float *per = malloc(sizeof(float) * (size_t)chunks * V), *last = malloc(sizeof(float) * (size_t)V);
    CU_ASSERT_EQUAL(chunked_prefill(s, p.m, req, len, C, per, last, NULL, NULL), chunks);
    char what[64];
    snprintf(what, sizeof what, "in chunks of %d, the last", C);
    CU_ASSERT(dense_ok_base(t, p.cpu, last, base, ids, len, what, 0));
    for (int32_t c = 0; all_chunks && c + 1 < chunks; c++) {
      snprintf(what, sizeof what, "in chunks of %d, chunk %d", C, c);
      CU_ASSERT(dense_ok(t, p.cpu, per + (size_t)c * V, ids, (c + 1) * C, what, 0));
    }
    upf_session_request_info info;
    CU_ASSERT_EQUAL(upf_session_request(s, req, &info), UPF_OK);
    CU_ASSERT(info.prefilled == 1 && info.prefill_done == len && info.chunks == chunks && info.num_drops == 0);
    int32_t groups_with_attn = 0;
    for (int32_t l = 0; l < cfg->num_layers; l++) {
      int64_t kv = -1;
      if (upf_session_group_of_layer(s, l) >= 0)
        CU_ASSERT(upf_session_kv_len(s, req, l, &kv) == UPF_OK && kv == len);
    }
    for (int32_t g = 0; g < upf_session_num_groups(s); g++)
      groups_with_attn += upf_session_pages_total(s, g) > 0;
    upf_session_memory mem;
    upf_session_memory_usage(s, &mem);
    CU_ASSERT_EQUAL(mem.pages_in_use, groups_with_attn * upf_session_pages_for(s, len));
    CU_ASSERT_EQUAL(mem.pages_dense, mem.pages_in_use);
    free(per), free(last);
    upf_session_free(s);
  }
  free(ids), free(base);
  models_free(&p);
}

/* Every family: chunks of 13 (ending mid-page: P = 16), of 16 (on the page), of one token, one chunk of
 * the whole prompt, and one longer than it. Under Valgrind (quick) shorter prompts, fewer sizes, and
 * only the last chunk checked against a prefill. */
static void dense_chunked_equals_unchunked(const target *t) {
  const int quick = upf_test_quick();
  const int32_t len = quick ? 30 : 70;
  const int32_t full[] = {13, 16, 1, 70, 100}, short_sizes[] = {13, 30, 1};
  /* Under Valgrind llama alone: gemma3's and qwen3-next's chunks have their own tests below */
  for (int f = 0; f < (quick ? 1 : NUM_TINY); f++) {
    if (quick) /* one-token chunks too: each step costs what a prompt does under Valgrind */
      check_chunk_sizes(t, tiny[f], len, short_sizes, 3, 0);
    else
      check_chunk_sizes(t, tiny[f], len, full, 5, 1);
  }
}
static void test_dense_chunked_equals_unchunked(void) {
  const target t = cpu_target();
  dense_chunked_equals_unchunked(&t);
}
static void test_cuda_dense_chunked_equals_unchunked(void) {
  const target t = cuda_target();
  dense_chunked_equals_unchunked(&t);
}

/* Gemma-3's sliding window (32 on the tiny config) across chunk boundaries: a 60-token prompt in chunks
 * of 20, so every query of the later chunks reaches keys of the chunk before; every chunk's logits
 * equal its prefix's (quick: 45 tokens, the last chunk's). */
static void gemma_window(const target *t) {
  const upf_model_config *cfg = upf_model_config_by_name("gemma3-tiny");
  CU_ASSERT_FATAL(cfg->window == 32 && cfg->window < 60 && 20 < cfg->window);
  const int32_t sizes[] = {20};
  check_chunk_sizes(t, "gemma3-tiny", upf_test_quick() ? 45 : 60, sizes, 1, !upf_test_quick());
}
static void test_gemma_window(void) {
  const target t = cpu_target();
  gemma_window(&t);
}
static void test_cuda_gemma_window(void) {
  const target t = cuda_target();
  gemma_window(&t);
}

/* A twin of the CPU backend whose recurrent scan forgets the state it is given: every chunk after the
 * first starts from zeros. */
static upf_status scan_without_state(const upf_gdn_batch *b, const upf_gdn_scan_inputs *in, const upf_tensor *o,
                                     const upf_tensor *state_out) {
  upf_gdn_scan_inputs cut = *in;
  cut.state_in = NULL;
  return upf_backend_cpu()->gdn_scan(b, &cut, o, state_out);
}
/* ... and one whose conv forgets the last inputs of the chunk before. */
static upf_status conv_without_state(const upf_gdn_batch *b, const upf_tensor *x, const upf_tensor *w,
                                     const upf_tensor *state_in, const upf_tensor *state_out, const upf_tensor *y) {
  return upf_backend_cpu()->gdn_conv(b, x, w, NULL, state_out, y);
}

/* Qwen3-Next: the Gated DeltaNet conv (kernel 4: three inputs of state) and recurrent states carry
 * across chunks of 2 (shorter than the conv's state), 5 and 13; every chunk's logits equal its
 * prefix's. On the CPU, twins that forget either state fail the same check: the test sees the carry.
 * Quick: 12 tokens in chunks of 2, the last chunk's logits. */
static void qwen_states(const target *t) {
  const int quick = upf_test_quick();
  const int32_t sizes[] = {2, 5, 13};
  check_chunk_sizes(t, "qwen3-next-tiny", quick ? 12 : 40, sizes, quick ? 1 : 3, !quick);
  if (t->be != upf_backend_cpu() || quick) /* the negative controls: natively, on the CPU */
    return;
  for (int which = 0; which < 2; which++) {
    upf_backend broken = *upf_test_cpu_twin();
    if (which == 0)
      broken.gdn_scan = scan_without_state;
    else
      broken.gdn_conv = conv_without_state;
    const target bt = {&broken, t->atol, t->rtol};
    models p;
    CU_ASSERT_FATAL(models_init(&p, &bt, "qwen3-next-tiny"));
    const int32_t V = p.m->cfg->vocab, len = 20;
    int32_t ids[20];
    upf_model_seeded_ids(3, V, len, ids);
    float last[512];
    upf_session *s = session_new(p.m, UPF_PREFILL_DENSE, NULL, NULL);
    int32_t req = -1;
    CU_ASSERT_FATAL(s && upf_session_add_request(s, ids, len, &req) == UPF_OK);
    CU_ASSERT_EQUAL(chunked_prefill(s, p.m, req, len, 7, NULL, last, NULL, NULL), 3);
    const int ok = dense_ok(t, p.cpu, last, ids, len, "twin", 1);
    if (ok)
      printf("\na twin that forgets the %s state passed\n", which ? "conv" : "recurrent");
    CU_ASSERT(!ok);
    upf_session_free(s);
    models_free(&p);
  }
}
static void test_qwen_states(void) {
  const target t = cpu_target();
  qwen_states(&t);
}
static void test_cuda_qwen_states(void) {
  const target t = cuda_target();
  qwen_states(&t);
}

/* ---- several requests: whole prompts, chunks and decode rows in one step ---- */

typedef struct {
  int32_t req, prompt_len, num_tokens, done;
  int32_t tokens[160];   /* prompt, then generated */
  int32_t num_events;
  float *logits[8];      /* the logits after tokens[0 .. prompt_len + e) */
} tracked;

static int greedy(const float *l, int32_t V) { return upf_engine_argmax(l, V); }

static void track(tracked *t, const float *logits, int32_t V) {
  float *l = malloc(sizeof(float) * (size_t)V);
  memcpy(l, logits, sizeof(float) * (size_t)V);
  t->logits[t->num_events++] = l;
  t->tokens[t->num_tokens++] = greedy(l, V);
}

/* A step over (request, kind, chunk tokens) triples in that order; records the logits of every row that
 * ended its prompt or decoded. */
typedef struct {
  tracked *t;
  int chunk; /* 0: decode row; n > 0: prefill row of n tokens (the rest of the prompt when it is all) */
} step_row;

static upf_status run_step(upf_session *s, int32_t V, const step_row *rows, int n, upf_prefill_result *keep) {
  upf_session_row r[8] = {{0}};
  for (int i = 0; i < n; i++) {
    tracked *t = rows[i].t;
    r[i] = rows[i].chunk ? (upf_session_row){t->req, UPF_ROW_PREFILL, 0, rows[i].chunk}
                         : (upf_session_row){t->req, UPF_ROW_DECODE, t->tokens[t->num_tokens - 1], 0};
  }
  upf_prefill_result res;
  UPF_TRY(upf_session_step(s, r, n, NULL, &res));
  for (int i = 0; i < n; i++) {
    tracked *t = rows[i].t;
    if (rows[i].chunk)
      t->done += rows[i].chunk;
    if (!rows[i].chunk || t->done == t->prompt_len)
      track(t, res.logits + (size_t)i * V, V);
  }
  if (keep)
    *keep = res;
  else
    upf_prefill_result_free(&res);
  return UPF_OK;
}

static void add_tracked(upf_session *s, const upf_model *m, tracked *t, int32_t len, uint64_t seed) {
  memset(t, 0, sizeof *t);
  t->prompt_len = t->num_tokens = len;
  upf_model_seeded_ids(seed, m->cfg->vocab, len, t->tokens);
  CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, t->tokens, len, &t->req), UPF_OK);
}

/* Every recorded event of t (dense throughout) against an unchunked dense prefill of its tokens so far
 * (quick: the first and the last). */
static void check_events(const target *tg, const upf_model *cpu, const tracked *t, const char *what) {
  for (int e = 0; e < t->num_events; e++) {
    if (upf_test_quick() && e > 0 && e + 1 < t->num_events)
      continue;
    char w[64];
    snprintf(w, sizeof w, "%s, event %d", what, e);
    CU_ASSERT(dense_ok(tg, cpu, t->logits[e], t->tokens, t->prompt_len + e, w, 0));
  }
}

static void free_tracked(tracked *t) {
  for (int e = 0; e < t->num_events; e++)
    free(t->logits[e]);
}

/* A (whole, 20) prefills alone; then D (whole) beside the first chunks of B (45 in 16s) and C (30 in
 * 11s) and A's decode row; then the next chunks beside A's and D's decode rows; then B's and C's last
 * chunks; then everyone decodes. Each request's prefill logits equal its unchunked prefill and every
 * decode step a recomputation; mid-prefill a request holds its chunks' pages and kv_len; bad rows
 * are refused with nothing changed. */
static void several_requests(const target *tg, const char *family) {
  models p;
  CU_ASSERT_FATAL(models_init(&p, tg, family));
  const int32_t V = p.m->cfg->vocab;
  upf_session *s = session_new(p.m, UPF_PREFILL_DENSE, NULL, NULL);
  CU_ASSERT_FATAL(s != NULL);
  tracked A, B, C, D;
  add_tracked(s, p.m, &A, 20, 1);
  add_tracked(s, p.m, &B, 45, 2);
  add_tracked(s, p.m, &C, 30, 3);
  add_tracked(s, p.m, &D, 18, 4);
  upf_status st = run_step(s, V, (step_row[]){{&A, 20}}, 1, NULL);
  if (st == UPF_OK)
    st = run_step(s, V, (step_row[]){{&D, 18}, {&B, 16}, {&C, 11}, {&A, 0}}, 4, NULL);
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  /* mid-prefill: B holds 16 tokens (one page per group), is not prefilled, cannot decode */
  int64_t kv = -1;
  const int32_t attn_layer = upf_model_mixer(p.m->cfg, 0) == UPF_MIXER_GDN ? 3 : 0;
  CU_ASSERT(upf_session_kv_len(s, B.req, attn_layer, &kv) == UPF_OK && kv == 16);
  CU_ASSERT(upf_session_kv_len(s, C.req, attn_layer, &kv) == UPF_OK && kv == 11);
  upf_session_request_info info;
  CU_ASSERT(upf_session_request(s, B.req, &info) == UPF_OK && !info.prefilled && info.prefill_done == 16 &&
            info.chunks == 1);
  upf_prefill_result res;
  const int64_t free0 = upf_session_pages_free(s, 0);
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){B.req, UPF_ROW_DECODE, 1, 0}, 1, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "not prefilled yet") != NULL);
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){B.req, UPF_ROW_PREFILL, 0, 30}, 1, NULL, &res),
                  UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "29 of its 45 prompt tokens left") != NULL);
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){B.req, UPF_ROW_PREFILL, 0, -2}, 1, NULL, &res),
                  UPF_ERR_INVALID_ARG);
  /* the order: whole prompts, then chunks, then decode rows */
  int32_t E = -1;
  CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, B.tokens, 10, &E), UPF_OK);
  const upf_session_row bad_order[2] = {{B.req, UPF_ROW_PREFILL, 0, 5}, {E, UPF_ROW_PREFILL, 0, 0}};
  CU_ASSERT_EQUAL(upf_session_step(s, bad_order, 2, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "a whole-prompt prefill row after a prefill chunk") != NULL);
  const upf_session_row bad_order2[2] = {{A.req, UPF_ROW_DECODE, 1, 0}, {B.req, UPF_ROW_PREFILL, 0, 5}};
  CU_ASSERT_EQUAL(upf_session_step(s, bad_order2, 2, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "a prefill chunk after a decode row") != NULL);
  CU_ASSERT_EQUAL(upf_session_release(s, E), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 0), free0);
  CU_ASSERT(upf_session_request(s, B.req, &info) == UPF_OK && info.prefill_done == 16 && info.chunks == 1);

  st = run_step(s, V, (step_row[]){{&B, 16}, {&C, 11}, {&A, 0}, {&D, 0}}, 4, NULL);
  if (st == UPF_OK) /* the rest of each prompt: 13 and 8 tokens */
    st = run_step(s, V, (step_row[]){{&B, 13}, {&C, 8}, {&A, 0}, {&D, 0}}, 4, NULL);
  if (st == UPF_OK)
    st = run_step(s, V, (step_row[]){{&A, 0}, {&B, 0}, {&C, 0}, {&D, 0}}, 4, NULL);
  if (st != UPF_OK)
    printf("\n%s: %s\n", family, upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  CU_ASSERT(upf_session_request(s, B.req, &info) == UPF_OK && info.prefilled && info.chunks == 3 && info.decoded == 1);
  CU_ASSERT(upf_session_kv_len(s, B.req, attn_layer, &kv) == UPF_OK && kv == 46);
  tracked *all[] = {&A, &B, &C, &D};
  const int want_events[] = {5, 2, 2, 4};
  for (int i = 0; i < 4; i++) {
    CU_ASSERT_EQUAL(all[i]->num_events, want_events[i]);
    char what[32];
    snprintf(what, sizeof what, "request %c", 'A' + i);
    check_events(tg, p.cpu, all[i], what);
    free_tracked(all[i]);
  }
  for (int i = 0; i < 4; i++)
    CU_ASSERT_EQUAL(upf_session_release(s, all[i]->req), UPF_OK);
  for (int32_t g = 0; g < upf_session_num_groups(s); g++)
    CU_ASSERT_EQUAL(upf_session_pages_free(s, g), upf_session_pages_total(s, g));
  upf_session_free(s);
  models_free(&p);
}
static void several_requests_all(const target *t) {
  if (upf_test_quick()) { /* Qwen3-Next's state slots beside decode rows: the engine test, quick */
    several_requests(t, tiny[0]);
    return;
  }
  for (int f = 0; f < NUM_TINY; f++)
    several_requests(t, tiny[f]);
}
static void test_several_requests(void) {
  const target t = cpu_target();
  several_requests_all(&t);
}
static void test_cuda_several_requests(void) {
  const target t = cuda_target();
  several_requests_all(&t);
}

/* UniPrefill: a whole prompt long enough to drop (64 tokens at p 0.5) beside the chunks of another
 * prompt. The whole prompt drops as it does alone (its logits those of its own UniPrefill prefill,
 * its kept count the same); the chunked one runs dense in every chunk (its logits a dense prefill's,
 * no drop in its history, every group holding its whole prompt); a replayed mask that drops a chunk
 * token is refused. */
static void uniprefill_beside_chunks(const target *tg) {
  models p;
  CU_ASSERT_FATAL(models_init(&p, tg, "llama-tiny"));
  const int32_t V = p.m->cfg->vocab;
  upf_select_params sel = p.m->cfg->select;
  sel.p = 0.5f;
  upf_session *s = session_new(p.m, UPF_PREFILL_UNIPREFILL, &sel, NULL);
  CU_ASSERT_FATAL(s != NULL);
  tracked W, K;
  add_tracked(s, p.m, &W, 64, 5);
  add_tracked(s, p.m, &K, 44, 6);
  upf_prefill_result res;
  upf_status st = run_step(s, V, (step_row[]){{&W, 64}, {&K, 24}}, 2, &res);
  if (st != UPF_OK)
    printf("\n%s\n", upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  CU_ASSERT(res.num_drops >= 1);
  for (int d = 0; d < res.num_drops; d++)
    CU_ASSERT_EQUAL(res.drops[d].kept_per_req[1], 24); /* the chunk whole */
  const int32_t cu[2] = {0, 64};
  upf_prefill_options o = {.mode = UPF_PREFILL_UNIPREFILL, .select = sel};
  upf_prefill_result alone;
  CU_ASSERT_EQUAL_FATAL(upf_model_prefill(p.m, W.tokens, cu, 1, &o, &alone), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(alone.num_drops, res.num_drops);
  for (int d = 0; d < res.num_drops; d++)
    CU_ASSERT_EQUAL(res.drops[d].kept_per_req[0], alone.drops[d].kept_per_req[0]);
  CU_ASSERT(alone.drops[0].kept_per_req[0] < 64);
  upf_prefill_result_free(&res), upf_prefill_result_free(&alone);
  st = run_step(s, V, (step_row[]){{&K, 20}, {&W, 0}}, 2, NULL);
  if (st == UPF_OK)
    st = run_step(s, V, (step_row[]){{&W, 0}, {&K, 0}}, 2, NULL);
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  upf_session_request_info info;
  CU_ASSERT(upf_session_request(s, K.req, &info) == UPF_OK && info.num_drops == 0 && info.chunks == 2);
  for (int32_t l = 0; l < p.m->cfg->num_layers; l++) {
    int64_t kv = -1;
    CU_ASSERT(upf_session_kv_len(s, K.req, l, &kv) == UPF_OK && kv == 45);
  }
  CU_ASSERT(upf_session_request(s, W.req, &info) == UPF_OK && info.num_drops >= 1);
  /* W's prefill against its UniPrefill prefill alone (the same path: a whole prompt over its own K/V);
   * K's every event against dense */
  float *w0 = prefill_logits(p.cpu, UPF_PREFILL_UNIPREFILL, &sel, NULL, W.tokens, 64);
  CU_ASSERT_FATAL(w0 != NULL);
  CU_ASSERT(err_share(W.logits[0], w0, V, tg->atol, tg->rtol) <= 1);
  free(w0);
  check_events(tg, p.cpu, &K, "chunked request");
  /* a replayed mask over a step of a whole prompt and a chunk may not drop from the chunk */
  tracked X, Y;
  add_tracked(s, p.m, &X, 40, 7);
  add_tracked(s, p.m, &Y, 40, 8);
  uint8_t m0[40 + 20], m1[40 + 20];
  memset(m0, 1, sizeof m0), memset(m1, 1, sizeof m1);
  m0[45] = 0;
  const uint8_t *masks[2] = {m0, m1};
  const int64_t lens[2] = {60, 60};
  const upf_session_step_options so = {masks, lens, NULL, NULL};
  const upf_session_row rows[2] = {{X.req, UPF_ROW_PREFILL, 0, 0}, {Y.req, UPF_ROW_PREFILL, 0, 20}};
  CU_ASSERT_EQUAL(upf_session_step(s, rows, 2, &so, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "prefill chunk") != NULL);
  free_tracked(&W), free_tracked(&K);
  upf_session_free(s);
  models_free(&p);
}
static void test_uniprefill_beside_chunks(void) {
  const target t = cpu_target();
  uniprefill_beside_chunks(&t);
}
static void test_cuda_uniprefill_beside_chunks(void) {
  const target t = cuda_target();
  uniprefill_beside_chunks(&t);
}

/* FlashPrefill: a chunk runs block-sparse over its cached context (sparse.h's paged batch). At alpha 0
 * every visible block is kept, so the chunked logits are dense's; the records count the chunk tiles'
 * visible blocks (worked by hand below) in every full-attention layer. At alpha 1 fewer blocks are kept
 * and the logits stay finite. One chunk holding the whole prompt is the unchunked FlashPrefill prefill.
 * Quick: alpha 0 only. */
static void flashprefill_chunks(const target *tg) {
  const int quick = upf_test_quick();
  models p;
  CU_ASSERT_FATAL(models_init(&p, tg, "llama-tiny"));
  const int32_t V = p.m->cfg->vocab, len = quick ? 130 : 200, C = quick ? 65 : 80;
  upf_sparse_params sp = upf_prefill_sparse_default();
  sp.alpha = 0.0f, sp.block_n = 64, sp.block_m = 16, sp.sink = 0, sp.window = 1, sp.last_n = 0;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)len);
  upf_model_seeded_ids(12, V, len, ids);
  float last[512];
  int full_layers = 0;
  for (int32_t l = 0; l < p.m->cfg->num_layers; l++)
    full_layers += upf_model_mixer(p.m->cfg, l) == UPF_MIXER_FULL;
  /* visible blocks of a chunk [a, b) of a request: per query tile (16 packed rows = 8 positions at
   * g = 2), the key blocks up to its last row's block (b ... positions / 64), times Hkv = 2 */
  int64_t want_visible = 0;
  for (int32_t a = 0; a < len; a += C) {
    const int32_t b = a + C < len ? a + C : len;
    for (int32_t q = a; q < b; q += 8) {
      const int32_t q_last = q + 8 < b ? q + 8 - 1 : b - 1;
      want_visible += 2 * (q_last / 64 + 1);
    }
  }
  for (int pass = 0; pass < (quick ? 1 : 2); pass++) {
    sp.alpha = pass ? 1.0f : 0.0f;
    upf_session *s = session_new(p.m, UPF_PREFILL_FLASHPREFILL, NULL, &sp);
    int32_t req = -1;
    CU_ASSERT_FATAL(s && upf_session_add_request(s, ids, len, &req) == UPF_OK);
    int64_t kept = 0, visible = 0;
    CU_ASSERT_EQUAL(chunked_prefill(s, p.m, req, len, C, NULL, last, &kept, &visible), (len + C - 1) / C);
    CU_ASSERT_EQUAL(visible, want_visible * full_layers);
    for (int32_t v = 0; v < V; v++)
      CU_ASSERT_FATAL(isfinite(last[v]));
    if (pass == 0) {
      CU_ASSERT_EQUAL(kept, visible);
      CU_ASSERT(dense_ok(tg, p.cpu, last, ids, len, "flashprefill at alpha 0 in chunks", 0));
    } else {
      CU_ASSERT(kept < visible);
    }
    upf_session_free(s);
  }
  if (quick) { /* Valgrind: the paged sparse path ran; the rest is the whole-prompt path of other suites */
    free(ids);
    models_free(&p);
    return;
  }
  /* one chunk = the whole prompt: the unchunked FlashPrefill prefill (alpha 1) */
  float *flash = prefill_logits(p.cpu, UPF_PREFILL_FLASHPREFILL, NULL, &sp, ids, len);
  upf_session *s = session_new(p.m, UPF_PREFILL_FLASHPREFILL, NULL, &sp);
  int32_t req = -1;
  CU_ASSERT_FATAL(flash && s && upf_session_add_request(s, ids, len, &req) == UPF_OK);
  CU_ASSERT_EQUAL(chunked_prefill(s, p.m, req, len, len, NULL, last, NULL, NULL), 1);
  CU_ASSERT(err_share(last, flash, V, tg->atol, tg->rtol) <= 1);
  upf_session_free(s);
  free(flash), free(ids);
  models_free(&p);
}
static void test_flashprefill_chunks(void) {
  const target t = cpu_target();
  flashprefill_chunks(&t);
}
static void test_cuda_flashprefill_chunks(void) {
  const target t = cuda_target();
  flashprefill_chunks(&t);
}

/* Decoding after a chunked prefill: the greedy tokens and every step's logits equal those after an
 * unchunked prefill, per family (two requests, chunks of 13 and 7 side by side). */
static void generate_equal(const target *tg, const char *family) {
  models p;
  CU_ASSERT_FATAL(models_init(&p, tg, family));
  const int32_t V = p.m->cfg->vocab, N = upf_test_quick() ? 3 : 4;
  tracked run[2][2];
  const int32_t lens[2] = {upf_test_quick() ? 30 : 52, 23}, chunk[2] = {13, 7};
  for (int chunked = 0; chunked < 2; chunked++) {
    upf_session *s = session_new(p.m, UPF_PREFILL_DENSE, NULL, NULL);
    CU_ASSERT_FATAL(s != NULL);
    tracked *a = &run[chunked][0], *b = &run[chunked][1];
    add_tracked(s, p.m, a, lens[0], 21);
    add_tracked(s, p.m, b, lens[1], 22);
    upf_status st = UPF_OK;
    if (!chunked)
      st = run_step(s, V, (step_row[]){{a, lens[0]}, {b, lens[1]}}, 2, NULL);
    while (st == UPF_OK && chunked && (a->done < lens[0] || b->done < lens[1])) {
      step_row rows[2];
      int n = 0;
      for (int i = 0; i < 2; i++) {
        tracked *t = i ? b : a;
        if (t->done < lens[i]) {
          const int32_t k = lens[i] - t->done < chunk[i] ? lens[i] - t->done : chunk[i];
          rows[n++] = (step_row){t, k};
        }
      }
      st = run_step(s, V, rows, n, NULL);
    }
    for (int i = 1; st == UPF_OK && i < N; i++)
      st = run_step(s, V, (step_row[]){{a, 0}, {b, 0}}, 2, NULL);
    if (st != UPF_OK)
      printf("\n%s: %s\n", family, upf_last_error());
    CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
    upf_session_free(s);
  }
  /* the tokens agree wherever the unchunked run's top-2 margin is clear of the tolerance (on the CPU
   * they all do); every event of the chunked run passes against a dense prefill of its tokens */
  for (int i = 0; i < 2; i++) {
    CU_ASSERT_EQUAL(run[1][i].num_tokens, lens[i] + N);
    for (int e = 0; e < N; e++) {
      const float *l = run[0][i].logits[e];
      const int32_t top = greedy(l, V);
      float second = -INFINITY;
      for (int32_t v = 0; v < V; v++)
        second = v != top && l[v] > second ? l[v] : second;
      const int clear = l[top] - second > 2 * (tg->atol + tg->rtol * fabs(l[top]));
      if (tg->be == upf_backend_cpu() || clear)
        CU_ASSERT_EQUAL(run[1][i].tokens[lens[i] + e], run[0][i].tokens[lens[i] + e]);
      if (run[1][i].tokens[lens[i] + e] != run[0][i].tokens[lens[i] + e])
        break; /* the runs part: later steps feed different tokens */
      if (upf_test_quick() && e + 1 < N)
        continue; /* quick: the last step's logits */
      char what[64];
      snprintf(what, sizeof what, "request %d after chunks, event %d", i, e);
      CU_ASSERT(dense_ok(tg, p.cpu, run[1][i].logits[e], run[1][i].tokens, lens[i] + e, what, 0));
    }
    free_tracked(&run[0][i]), free_tracked(&run[1][i]);
  }
  models_free(&p);
}
static void generate_equal_all(const target *t) {
  for (int f = upf_test_quick() ? 1 : 0; f < (upf_test_quick() ? 2 : NUM_TINY); f++)
    generate_equal(t, tiny[f]);
}
static void test_generate_equal(void) {
  const target t = cpu_target();
  generate_equal_all(&t);
}
static void test_cuda_generate_equal(void) {
  const target t = cuda_target();
  generate_equal_all(&t);
}

/* ---- the engine ---- */

static void make_trace(upf_trace *t, const int32_t *lens, int32_t n, int32_t max_new, int32_t vocab) {
  t->num_reqs = n;
  t->reqs = calloc((size_t)n, sizeof *t->reqs);
  for (int32_t i = 0; i < n; i++) {
    upf_engine_request *r = &t->reqs[i];
    r->id = i, r->prompt_len = lens[i], r->max_new = max_new, r->arrival = 0;
    r->prompt = malloc(sizeof(int32_t) * (size_t)lens[i]);
    upf_model_seeded_ids(40 + (uint64_t)i, vocab, lens[i], r->prompt);
  }
}

static upf_status engine_on_session(const upf_model *m, upf_prefill_mode mode, const upf_trace *t,
                                    const upf_engine_options *o, upf_engine_result *res) {
  upf_session *s = session_new(m, mode, NULL, NULL);
  if (!s)
    return UPF_ERR_INVALID_ARG;
  upf_engine_ops ops;
  upf_status st = upf_engine_session_ops(s, m, 8, t->num_reqs, &ops);
  if (st == UPF_OK) {
    st = upf_engine_run(&ops, t, o, res);
    upf_engine_session_ops_free(&ops);
  }
  for (int32_t g = 0; st == UPF_OK && g < upf_session_num_groups(s); g++)
    CU_ASSERT_EQUAL(upf_session_pages_free(s, g), upf_session_pages_total(s, g));
  upf_session_free(s);
  return st;
}

/* The engine with chunked prefill over the session: five requests (prompts of 45, 12, 30, 70 and 8; quick 30, 12, 20)
 * at once, token budget 24, chunks of 13. Every step holds at most 24 tokens; once a request has its
 * first token it decodes in every step until it ends (decodes first); long prompts take several
 * chunks, some beside decode rows; the tokens are those of the unchunked run with one budget for all
 * (dense), and in UniPrefill mode a request split in chunks still gets dense's tokens. */
static void engine_chunked(const target *tg, const char *family, upf_prefill_mode mode) {
  models p;
  CU_ASSERT_FATAL(models_init(&p, tg, family));
  const int32_t lens[] = {45, 12, 30, 70, 8}, quick_lens[] = {30, 12, 20};
  upf_trace t;
  make_trace(&t, upf_test_quick() ? quick_lens : lens, upf_test_quick() ? 3 : 5, 4, p.m->cfg->vocab);
  upf_engine_result ref, got;
  const upf_engine_options whole = {.token_budget = 1 << 20, .eos = -1, .keep_steps = 1};
  const upf_engine_options chunked = {.token_budget = 24, .eos = -1, .keep_steps = 1, .chunk = 13};
  upf_status st = engine_on_session(p.m, UPF_PREFILL_DENSE, &t, &whole, &ref);
  if (st == UPF_OK)
    st = engine_on_session(p.m, mode, &t, &chunked, &got);
  if (st != UPF_OK)
    printf("\n%s: %s\n", family, upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  int mixed = 0, chunk_rows = 0;
  for (int64_t k = 0; k < got.num_steps; k++) {
    const upf_engine_step_record *sr = &got.steps[k];
    CU_ASSERT(sr->prefill_tokens + sr->decode_rows <= 24);
    mixed += sr->prefill_chunks > 0 && sr->decode_rows > 0;
    chunk_rows += sr->prefill_chunks;
  }
  CU_ASSERT(mixed > 0);
  int64_t decode_rows = 0, generated = 0;
  for (int64_t k = 0; k < got.num_steps; k++)
    decode_rows += got.steps[k].decode_rows;
  for (int32_t i = 0; i < t.num_reqs; i++) {
    const upf_engine_record *r = &got.reqs[i], *w = &ref.reqs[i];
    CU_ASSERT(r->num_chunks >= (r->prompt_len + 12) / 13);
    CU_ASSERT_EQUAL(w->num_chunks, 1);
    CU_ASSERT_EQUAL(r->num_generated, 4);
    generated += r->num_generated - 1;
    /* the step of the first token, then one decode row a step */
    int64_t first = -1;
    for (int64_t k = 0; k < got.num_steps; k++)
      if (got.steps[k].start + got.steps[k].seconds == r->first_token)
        first = k;
    CU_ASSERT(first >= 0 && r->finish_step - first == r->num_generated - 1);
    if (mode == UPF_PREFILL_DENSE || r->num_chunks > 1)
      CU_ASSERT_EQUAL(memcmp(r->tokens, w->tokens, sizeof(int32_t) * 4), 0);
  }
  CU_ASSERT_EQUAL(decode_rows, generated);
  CU_ASSERT(chunk_rows >= 2);
  upf_engine_result_free(&ref), upf_engine_result_free(&got);
  upf_trace_free(&t);
  models_free(&p);
}
static void test_engine_chunked(void) {
  const target t = cpu_target();
  if (upf_test_quick()) {
    engine_chunked(&t, tiny[2], UPF_PREFILL_DENSE);
    return;
  }
  for (int f = 0; f < NUM_TINY; f++)
    engine_chunked(&t, tiny[f], UPF_PREFILL_DENSE);
  engine_chunked(&t, tiny[0], UPF_PREFILL_UNIPREFILL);
}
static void test_cuda_engine_chunked(void) {
  const target t = cuda_target();
  for (int f = 0; f < NUM_TINY; f++)
    engine_chunked(&t, tiny[f], UPF_PREFILL_DENSE);
}

/* ---- the CLI: --chunk on prefill, generate and serve-sim (llama-tiny, CPU, f32) ---- */

static cli_suite cli;

static int suite_setup(void) { return cli_setup(&cli, "upf_chunk"); }
static int suite_teardown(void) {
  suite_clean();
  return cli_teardown(&cli);
}

/* The logits files of two runs: the same shape, within the elementwise rule of the CPU target (the
 * chunked run's logits against the unchunked run's). */
static void same_logits(const char *a, const char *b, int64_t rows) {
  upf_tensor x = {0}, y = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(a, &x), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(b, &y), UPF_OK);
  CU_ASSERT(x.ndim == 2 && y.ndim == 2 && x.shape[0] == rows && y.shape[0] == rows && x.shape[1] == y.shape[1]);
  if (x.ndim == 2 && y.ndim == 2 && x.shape[0] == y.shape[0] && x.shape[1] == y.shape[1])
    CU_ASSERT(err_share(y.data, x.data, x.shape[0] * x.shape[1], 1e-5, 1e-5) <= 1);
  upf_tensor_free(&x), upf_tensor_free(&y);
}

/* upf prefill --chunk: the logits of the unchunked run; the printout and the JSON say how it chunked
 * (and, in UniPrefill mode, that chunks with cached context ran dense); bad combinations refused. */
static void test_cli_prefill(void) {
  const char *base = "prefill --model llama-tiny --backend cpu --dtype f32 --lengths 45,12";
  const char *a = cli_path(&cli, "p-whole.npy"), *b = cli_path(&cli, "p-chunk.npy"), *json = cli_path(&cli, "p.json");
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --out-logits %s", base, a), 0);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --chunk 13 --out-logits %s --json %s", base, b, json), 0);
  same_logits(a, b, 2);
  CLI_ASSERT_STDOUT(&cli, "chunked prefill: chunks of at most 13 tokens over 4 steps");
  CU_ASSERT(cli_file_contains(json, "\"chunk\": 13,"));
  CU_ASSERT(cli_file_contains(json, "\"request_chunks\": [4, 1]"));
  CU_ASSERT(cli_file_contains(json, "\"layer_tokens\": [57, 57, 57, 57, 57, 57]"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --mode uniprefill --p 0.5 --chunk 13 --json %s", base, json), 0);
  CLI_ASSERT_STDOUT(&cli, "chunks with cached context ran dense");
  CU_ASSERT(cli_file_contains(json, "\"uniprefill\": \"chunks with cached context ran dense"));
  CU_ASSERT(cli_file_contains(json, "\"kept_per_request\": [45, 12]"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --mode flashprefill --block-n 64 --chunk 13", base), 0);
  CLI_ASSERT_STDOUT(&cli, "kept share");
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --chunk 0", base), 2);
  CLI_ASSERT_STDERR(&cli, "--chunk");
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --chunk 13 --out-argmax %s", base, cli_path(&cli, "argmax.npy")), 2);
  CLI_ASSERT_STDERR(&cli, "--chunk runs through a session");
  CU_ASSERT(!cli_exists(cli_path(&cli, "argmax.npy")));
}

/* upf generate --chunk: the tokens of the unchunked run; the JSON has each request's chunks. */
static void test_cli_generate(void) {
  int32_t ids[45 + 12], cu[3] = {0, 45, 57};
  upf_model_seeded_ids(31, 512, 57, ids);
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "g-ids.npy"), ids, 57));
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "g-cu.npy"), cu, 3));
  const char *a = cli_path(&cli, "g-whole.npy"), *b = cli_path(&cli, "g-chunk.npy"), *json = cli_path(&cli, "g.json");
  const char *base = "generate --model llama-tiny --backend cpu --dtype f32 --max-new 4";
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --token-ids %s --cu-seqlens %s --out-tokens %s", base,
                                cli_path(&cli, "g-ids.npy"), cli_path(&cli, "g-cu.npy"), a), 0);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --token-ids %s --cu-seqlens %s --chunk 13 --out-tokens %s --json %s", base,
                                cli_path(&cli, "g-ids.npy"), cli_path(&cli, "g-cu.npy"), b, json), 0);
  CU_ASSERT(cli_same_npy(a, b));
  CLI_ASSERT_STDOUT(&cli, "chunked prefill: chunks of at most 13 tokens over 4 steps; 1 of 2 requests");
  CU_ASSERT(cli_file_contains(json, "\"chunk\": 13,"));
  CU_ASSERT(cli_file_contains(json, "\"prefill_chunks\": 4,"));
  CU_ASSERT(cli_file_contains(json, "\"prefill_step_ms\": ["));
}

/* upf serve-sim --chunk: the tokens of the unchunked run at a budget (20) that splits every prompt
 * (45: 13 + 13 + ...; 9: 7 + 2 beside the first chunk; 30: its first 5 where the budget ends), some
 * chunks beside decode rows; the printout and the JSON say so. */
static void test_cli_serve(void) {
  const char *trace = "{\"arrival\": 0, \"prompt_len\": 45, \"seed\": 1, \"max_new\": 4}\n"
                      "{\"arrival\": 0, \"prompt_len\": 9, \"seed\": 2, \"max_new\": 5}\n"
                      "{\"arrival\": 0, \"prompt_len\": 30, \"seed\": 3, \"max_new\": 3}\n";
  CU_ASSERT_FATAL(cli_write_text(&cli, "t.jsonl", trace));
  const char *a = cli_path(&cli, "s-whole.npy"), *b = cli_path(&cli, "s-chunk.npy"), *json = cli_path(&cli, "s.json");
  const char *base = "serve-sim --model llama-tiny --backend cpu --dtype f32";
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --trace %s --dump-tokens %s", base, cli_path(&cli, "t.jsonl"), a), 0);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s --trace %s --token-budget 20 --chunk 13 --dump-tokens %s --json %s", base,
                                cli_path(&cli, "t.jsonl"), b, json), 0);
  CU_ASSERT(cli_same_npy(a, b));
  CLI_ASSERT_STDOUT(&cli, "chunked prefill: 3 of 3 requests in more than one chunk");
  CLI_ASSERT_STDERR(&cli, "decode rows first, then prefill chunks up to the token budget of 20");
  CU_ASSERT(cli_file_contains(json, "\"chunk\": 13,"));
  CU_ASSERT(cli_file_contains(json, "\"chunked_requests\": 3"));
  CU_ASSERT(cli_file_contains(json, "\"prefill_chunks\"]"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --trace %s --mode uniprefill --chunk 13 --json %s", base, cli_path(&cli, "t.jsonl"),
                          json), 0);
  CLI_ASSERT_STDOUT(&cli, "chunks with cached context ran dense");
  CU_ASSERT(cli_file_contains(json, "\"chunked_uniprefill\": \"chunks with cached context ran dense"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --trace %s --mode flashprefill --block-n 64 --chunk 13", base,
                          cli_path(&cli, "t.jsonl")), 0);
  CLI_ASSERT_STDOUT(&cli, "flashprefill: kept share");
}

void upf_register_chunked_tests(void) {
  static CU_TestInfo tests[] = {
      {"dense chunked prefill equals unchunked (mid-page, one-token and whole-prompt chunks)",
       test_dense_chunked_equals_unchunked},
      {"gemma3: the sliding window across chunk boundaries", test_gemma_window},
      {"qwen3-next: Gated DeltaNet states across chunks; twins that drop them fail", test_qwen_states},
      {"several requests: whole prompts, chunks and decode rows in one step; bad rows refused",
       test_several_requests},
      {"uniprefill: whole prompts drop, chunks run dense", test_uniprefill_beside_chunks},
      {"flashprefill: a chunk block-sparse over its cached context", test_flashprefill_chunks},
      {"decoding after a chunked prefill equals the unchunked run", test_generate_equal},
      {"engine: chunked prefill within the budget, decodes first, same tokens", test_engine_chunked},
      {"upf prefill --chunk: unchunked logits, printout, JSON, bad flags", test_cli_prefill},
      {"upf generate --chunk: unchunked tokens, JSON", test_cli_generate},
      {"upf serve-sim --chunk: unchunked tokens, printout, JSON", test_cli_serve},
      CU_TEST_INFO_NULL,
  };
  /* Under Valgrind (quick) the single-request, window, Qwen3-Next state, UniPrefill, decode-after-chunks
   * and engine tests stay native (make test's Valgrind pass has a time budget): the mixed step and
   * FlashPrefill's chunks run the same session paths under it, and the CLI tests the engine's. */
  static CU_TestInfo quick_tests[] = {
      {"several requests: whole prompts, chunks and decode rows in one step; bad rows refused",
       test_several_requests},
      {"flashprefill: a chunk block-sparse over its cached context", test_flashprefill_chunks},
      {"upf prefill --chunk: unchunked logits, printout, JSON, bad flags", test_cli_prefill},
      {"upf generate --chunk: unchunked tokens, JSON", test_cli_generate},
      {"upf serve-sim --chunk: unchunked tokens, printout, JSON", test_cli_serve},
      CU_TEST_INFO_NULL,
  };
  CU_pSuite suite = upf_test_suite("chunked", suite_setup, suite_teardown, upf_test_quick() ? quick_tests : tests);
  if (!suite)
    return;
  upf_test_add_gpu(suite, "CUDA dense chunked prefill equals unchunked", test_cuda_dense_chunked_equals_unchunked);
  upf_test_add_gpu(suite, "CUDA gemma3 window across chunk boundaries", test_cuda_gemma_window);
  upf_test_add_gpu(suite, "CUDA qwen3-next Gated DeltaNet states across chunks", test_cuda_qwen_states);
  upf_test_add_gpu(suite, "CUDA several requests with chunks and decode rows", test_cuda_several_requests);
  upf_test_add_gpu(suite, "CUDA uniprefill beside chunks", test_cuda_uniprefill_beside_chunks);
  upf_test_add_gpu(suite, "CUDA flashprefill chunks", test_cuda_flashprefill_chunks);
  upf_test_add_gpu(suite, "CUDA decoding after a chunked prefill", test_cuda_generate_equal);
  upf_test_add_gpu(suite, "CUDA engine chunked prefill", test_cuda_engine_chunked);
}
