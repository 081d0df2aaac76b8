/* The continuous-batching engine: the scheduler against a deterministic fake model step (budgets,
 * FCFS admission, release and re-admission, page exhaustion, determinism, hand-computed TTFT and TPOT),
 * the trace readers, and the engine over the real session on the tiny configs. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/engine.h"
#include "uniprefill/model.h"
#include "uniprefill/session.h"

/* ---- The fake: two cache groups of P-token pages; group 0 keeps the prompt, group 1 (after a "drop")
 * ceil(n / 2) of it when `drop` is set. Each request's next token is a function of its own context, so
 * the engine must feed back exactly the token it sampled. The step refuses, as the session does, a
 * step whose rows could run out of pages, and a row for an unknown, released or already prefilled
 * request. ---- */

#define FAKE_V 64
#define FAKE_G 2
#define FAKE_MAX 64

typedef struct {
  int live, prefilled, released;
  int64_t prompt, decoded, len[FAKE_G], held[FAKE_G];
  int32_t last, expect; /* the last token fed, and the token the fake said comes next */
  uint32_t hash;
} fake_req;

typedef struct {
  int32_t page, drop;
  int64_t total[FAKE_G], used[FAKE_G];
  double base_s, per_token_s; /* a step takes base + per_token * prefill tokens */
  fake_req r[FAKE_MAX];
  int64_t steps, violations;
  int64_t fail_at; /* the step that fails (an injected backend error), or -1 */
} fake_model;

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int32_t fake_next(const fake_req *q) { return (int32_t)((q->hash * 2654435761u >> 7) % FAKE_V); }

static upf_status fake_step(void *ctx, const upf_engine_row *rows, int32_t n, float *logits, double *seconds) {
  fake_model *f = ctx;
  int64_t need[FAKE_G] = {0}, prefill_tokens = 0;
  if (f->steps == f->fail_at)
    return upf_fail(UPF_ERR_CUDA, "fake: injected failure");
  for (int32_t k = 0; k < n; k++) {
    const upf_engine_row *w = &rows[k];
    if (w->req < 0 || w->req >= FAKE_MAX)
      return upf_fail(UPF_ERR_INVALID_ARG, "fake: request %d", w->req);
    fake_req *q = &f->r[w->req];
    for (int32_t j = 0; j < k; j++)
      if (rows[j].req == w->req)
        return upf_fail(UPF_ERR_INVALID_ARG, "fake: request %d twice in a step", w->req);
    if (w->prefill ? q->prefilled || q->released || w->num_tokens < 1
                   : !q->prefilled || q->released || w->num_tokens != 1 || w->ids[0] != q->expect)
      return upf_fail(UPF_ERR_INVALID_ARG, "fake: bad %s row for request %d", w->prefill ? "prefill" : "decode", w->req);
    for (int g = 0; g < FAKE_G; g++)
      need[g] += w->prefill ? cdiv(w->num_tokens, f->page) : q->len[g] % f->page == 0;
    prefill_tokens += w->prefill ? w->num_tokens : 0;
  }
  for (int g = 0; g < FAKE_G; g++)
    if (f->used[g] + need[g] > f->total[g]) {
      f->violations++;
      return upf_fail(UPF_ERR_NOMEM, "fake: group %d: %lld pages used + %lld needed > %lld", g, (long long)f->used[g],
                      (long long)need[g], (long long)f->total[g]);
    }
  for (int32_t k = 0; k < n; k++) {
    const upf_engine_row *w = &rows[k];
    fake_req *q = &f->r[w->req];
    if (w->prefill) {
      q->live = q->prefilled = 1, q->prompt = w->num_tokens;
      q->hash = 2166136261u;
      for (int32_t t = 0; t < w->num_tokens; t++)
        q->hash = (q->hash ^ (uint32_t)w->ids[t]) * 16777619u;
      q->len[0] = w->num_tokens, q->len[1] = f->drop ? cdiv(w->num_tokens, 2) : w->num_tokens;
    } else {
      q->hash = (q->hash ^ (uint32_t)w->ids[0]) * 16777619u;
      q->decoded++;
      for (int g = 0; g < FAKE_G; g++)
        q->len[g]++;
    }
    q->last = w->ids[w->num_tokens - 1];
    for (int g = 0; g < FAKE_G; g++) {
      const int64_t h = cdiv(q->len[g], f->page);
      f->used[g] += h - q->held[g], q->held[g] = h;
    }
    q->expect = fake_next(q);
    for (int32_t v = 0; v < FAKE_V; v++)
      logits[(int64_t)k * FAKE_V + v] = -(float)((v - q->expect + FAKE_V) % FAKE_V);
  }
  *seconds = f->base_s + f->per_token_s * (double)prefill_tokens;
  f->steps++;
  return UPF_OK;
}

static upf_status fake_release(void *ctx, int32_t req) {
  fake_model *f = ctx;
  fake_req *q = &f->r[req];
  if (!q->live || q->released)
    return upf_fail(UPF_ERR_INVALID_ARG, "fake: release of request %d that holds nothing", req);
  for (int g = 0; g < FAKE_G; g++)
    f->used[g] -= q->held[g], q->held[g] = 0;
  q->released = 1, q->live = 0;
  return UPF_OK;
}

static int64_t fake_pages_free(void *ctx, int32_t g) {
  const fake_model *f = ctx;
  return f->total[g] - f->used[g];
}
static int64_t fake_pages_for(void *ctx, int64_t tokens) { return cdiv(tokens, ((fake_model *)ctx)->page); }
static int64_t fake_pages_append(void *ctx, int32_t req, int32_t g, int64_t tokens) {
  const fake_model *f = ctx;
  const int64_t len = f->r[req].len[g];
  return cdiv(len + tokens, f->page) - cdiv(len, f->page);
}
static int64_t fake_pages_of(void *ctx, int32_t req) {
  const fake_req *q = &((fake_model *)ctx)->r[req];
  return q->held[0] + q->held[1];
}
static void fake_memory(void *ctx, upf_engine_memory *m) {
  const fake_model *f = ctx;
  memset(m, 0, sizeof *m);
  for (int i = 0; i < FAKE_MAX; i++)
    if (f->r[i].live)
      m->pages_dense += FAKE_G * cdiv(f->r[i].prompt + f->r[i].decoded, f->page);
  m->pages_in_use = f->used[0] + f->used[1];
  m->bytes_in_use = 100.0 * (double)m->pages_in_use, m->bytes_dense = 100.0 * (double)m->pages_dense;
  m->bytes_capacity = 100.0 * (double)(f->total[0] + f->total[1]);
}

static upf_engine_ops fake_ops(fake_model *f, int32_t page, int64_t pages, double base_s, double per_token_s) {
  memset(f, 0, sizeof *f);
  f->page = page, f->fail_at = -1, f->total[0] = f->total[1] = pages, f->base_s = base_s, f->per_token_s = per_token_s;
  upf_engine_ops o = {f, FAKE_V, FAKE_G, 0, fake_step, fake_release, fake_pages_free, fake_pages_for,
                      fake_pages_append, fake_pages_of, fake_memory};
  return o;
}

/* A trace of n requests with the given lengths (cycled), arrivals and max_new. */
static void make_trace(upf_trace *t, int32_t n, const int32_t *lens, int32_t nl, const double *arrivals,
                       const int32_t *max_new, int32_t nm) {
  t->num_reqs = n;
  t->reqs = calloc((size_t)n, sizeof *t->reqs);
  for (int32_t i = 0; i < n; i++) {
    upf_engine_request *r = &t->reqs[i];
    r->id = 100 + i, r->prompt_len = lens[i % nl], r->max_new = max_new[i % nm], r->arrival = arrivals ? arrivals[i] : 0;
    r->prompt = malloc((size_t)r->prompt_len * sizeof *r->prompt);
    for (int32_t j = 0; j < r->prompt_len; j++)
      r->prompt[j] = (int32_t)((i * 31 + j * 7) % FAKE_V);
  }
}

static int run_ok(const upf_engine_ops *ops, const upf_trace *t, const upf_engine_options *o, upf_engine_result *res) {
  const upf_status st = upf_engine_run(ops, t, o, res);
  if (st != UPF_OK)
    printf("\nengine: %s\n", upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  return 1;
}

/* The tokens each request gets alone: its own trace of one request. */
static void check_alone(const upf_trace *t, const upf_engine_result *res, int32_t page, int64_t pages) {
  for (int32_t i = 0; i < t->num_reqs; i++) {
    fake_model f;
    upf_engine_ops ops = fake_ops(&f, page, pages, 1.0, 0.0);
    upf_trace one = {1, &t->reqs[i]};
    upf_engine_options o = {.token_budget = 1 << 20, .eos = -1};
    upf_engine_result r1;
    run_ok(&ops, &one, &o, &r1);
    CU_ASSERT_EQUAL(r1.reqs[0].num_generated, res->reqs[i].num_generated);
    CU_ASSERT_EQUAL(memcmp(r1.reqs[0].tokens, res->reqs[i].tokens, sizeof(int32_t) * (size_t)r1.reqs[0].num_generated), 0);
    upf_engine_result_free(&r1);
  }
}

/* Every step holds at most token_budget tokens (prefill tokens + decode rows), or is one oversized
 * prompt alone; every request ends with max_new tokens equal to its tokens alone; all pages return. */
static void test_budget(void) {
  const int32_t lens[] = {3, 9, 20, 5, 14, 1, 17, 8, 11, 30}, max_new[] = {5, 1, 7, 3};
  upf_trace t;
  make_trace(&t, 12, lens, 10, NULL, max_new, 4);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 1000, 0.01, 0.001);
  upf_engine_options o = {.token_budget = 24, .eos = -1, .keep_steps = 1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  int alone_steps = 0, mixed = 0;
  for (int64_t s = 0; s < res.num_steps; s++) {
    const upf_engine_step_record *st = &res.steps[s];
    const int64_t tokens = st->prefill_tokens + st->decode_rows;
    if (tokens > o.token_budget) {
      alone_steps++;
      CU_ASSERT(st->prefill_rows == 1 && st->decode_rows == 0);
    }
    mixed += st->prefill_rows > 0 && st->decode_rows > 0;
    CU_ASSERT(st->prefill_rows + st->decode_rows >= 1);
  }
  CU_ASSERT_EQUAL(alone_steps, 1); /* the 30-token prompt */
  CU_ASSERT(mixed > 0);            /* prefill and decode rows shared steps */
  for (int32_t i = 0; i < t.num_reqs; i++)
    CU_ASSERT_EQUAL(res.reqs[i].num_generated, res.reqs[i].max_new);
  CU_ASSERT_EQUAL(f.used[0] + f.used[1], 0);
  CU_ASSERT_EQUAL(f.violations, 0);
  check_alone(&t, &res, 4, 1000);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

/* A prompt longer than the budget, arriving while requests decode, takes the next step alone (their
 * decode rows pause for it) instead of waiting for every decode to finish; the decodes resume after it
 * and end with their tokens as if alone. */
static void test_long_prompt_pauses_decodes(void) {
  const int32_t lens[] = {4, 4, 4, 40}, max_new[] = {20, 20, 20, 3};
  const double arrivals[] = {0, 0, 0, 0.001};
  upf_trace t;
  make_trace(&t, 4, lens, 4, arrivals, max_new, 4);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 1000, 0.01, 0.0);
  upf_engine_options o = {.token_budget = 16, .eos = -1, .keep_steps = 1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  /* step 0: the three short prompts (12 tokens); the long one arrives during it and runs in step 1 */
  CU_ASSERT_EQUAL(res.reqs[0].admit_step, 0);
  CU_ASSERT_EQUAL(res.reqs[3].admit_step, 1);
  CU_ASSERT_EQUAL_FATAL(res.num_steps > 2, 1);
  CU_ASSERT_EQUAL(res.steps[1].prefill_rows, 1);
  CU_ASSERT_EQUAL(res.steps[1].prefill_tokens, 40);
  CU_ASSERT_EQUAL(res.steps[1].decode_rows, 0); /* paused */
  CU_ASSERT_EQUAL(res.steps[2].decode_rows, 4);  /* the three again, and the long one's first decode */
  for (int32_t i = 0; i < 3; i++) /* a request decodes in every step after its prefill but the paused one */
    CU_ASSERT_EQUAL(res.reqs[i].finish_step, 20);
  for (int32_t i = 0; i < t.num_reqs; i++)
    CU_ASSERT_EQUAL(res.reqs[i].num_generated, res.reqs[i].max_new);
  CU_ASSERT_EQUAL(f.violations, 0);
  check_alone(&t, &res, 4, 1000);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

/* Strict FCFS: admission follows trace order; a short request behind one that does not fit waits. */
static void test_fcfs(void) {
  const int32_t lens[] = {20, 20, 2}, max_new[] = {4};
  upf_trace t;
  make_trace(&t, 3, lens, 3, NULL, max_new, 1);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 1000, 0.01, 0.0);
  upf_engine_options o = {.token_budget = 30, .eos = -1, .keep_steps = 1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  /* step 0: request 0 alone (20 + 20 > 30); step 1: request 0 decodes (1) + request 1 (20) + request 2 (2) */
  CU_ASSERT_EQUAL(res.reqs[0].admit_step, 0);
  CU_ASSERT_EQUAL(res.reqs[1].admit_step, 1);
  CU_ASSERT_EQUAL(res.reqs[2].admit_step, 1);
  CU_ASSERT_EQUAL(res.steps[0].prefill_rows, 1);
  CU_ASSERT_EQUAL(res.steps[1].prefill_rows, 2);
  CU_ASSERT_EQUAL(res.steps[1].decode_rows, 1);
  for (int32_t i = 1; i < t.num_reqs; i++)
    CU_ASSERT(res.reqs[i].admit_step >= res.reqs[i - 1].admit_step);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

/* Pages for two requests at a time: a third waits (no preemption), is admitted in the step after one
 * finishes and releases its pages; the model never sees a step it lacks pages for; the UniPrefill-like
 * drop of group 1 shows as KV saved against dense. */
static void test_pages_release_and_wait(void) {
  const int32_t lens[] = {16}, max_new[] = {5, 9, 5, 5};
  upf_trace t;
  make_trace(&t, 4, lens, 1, NULL, max_new, 4);
  fake_model f;
  /* worst case of a request: ceil((16 + 4) / 4) = 5 pages (request 1: 6); 12 pages hold two */
  upf_engine_ops ops = fake_ops(&f, 4, 12, 0.01, 0.0);
  f.drop = 1;
  upf_engine_options o = {.token_budget = 100, .eos = -1, .keep_steps = 1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  CU_ASSERT_EQUAL(f.violations, 0);
  CU_ASSERT_EQUAL(res.max_running, 2);
  CU_ASSERT_EQUAL(res.reqs[0].admit_step, 0);
  CU_ASSERT_EQUAL(res.reqs[1].admit_step, 0);
  /* request 0 finishes at step 4 (5 tokens: prefill + 4 decodes), request 2 enters at step 5 */
  CU_ASSERT_EQUAL(res.reqs[0].finish_step, 4);
  CU_ASSERT_EQUAL(res.reqs[2].admit_step, 5);
  /* request 3 waits for request 1 (finishes at step 8) */
  CU_ASSERT_EQUAL(res.reqs[1].finish_step, 8);
  CU_ASSERT_EQUAL(res.reqs[3].admit_step, 9);
  for (int64_t s = 0; s < res.num_steps; s++)
    CU_ASSERT(res.steps[s].running <= 2);
  /* after its prefill a request holds 4 pages in group 0 and 2 in group 1, against 8 dense */
  CU_ASSERT_EQUAL(res.reqs[0].pages_after_prefill, 6);
  CU_ASSERT_EQUAL(res.reqs[0].dense_pages_after_prefill, 8);
  CU_ASSERT(res.kv_saved_bytes > 0);
  CU_ASSERT(fabs(res.kv_saved_share - (res.kv_dense_bytes_peak - res.kv_bytes_peak) / res.kv_dense_bytes_peak) < 1e-12);
  CU_ASSERT_EQUAL(f.used[0] + f.used[1], 0);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

/* A request whose worst case exceeds a group's budget fails before any step, naming it; so does a bad
 * budget. */
static void test_page_exhaustion(void) {
  const int32_t lens[] = {8, 40}, max_new[] = {4};
  upf_trace t;
  make_trace(&t, 2, lens, 2, NULL, max_new, 1);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 10, 0.01, 0.0);
  upf_engine_options o = {.token_budget = 100, .eos = -1};
  upf_engine_result res;
  CU_ASSERT_EQUAL(upf_engine_run(&ops, &t, &o, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "request 101"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "could never run"));
  CU_ASSERT_EQUAL(f.steps, 0);
  o.token_budget = 0;
  CU_ASSERT_EQUAL(upf_engine_run(&ops, &t, &o, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "token budget"));
  upf_trace_free(&t);
}

/* A failing step: the engine names the step and releases every request that holds state. */
static void test_step_failure_releases(void) {
  const int32_t lens[] = {8}, max_new[] = {6};
  upf_trace t;
  make_trace(&t, 3, lens, 1, NULL, max_new, 1);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 100, 0.01, 0.0);
  f.fail_at = 2;
  upf_engine_options o = {.token_budget = 100, .eos = -1};
  upf_engine_result res;
  CU_ASSERT_EQUAL(upf_engine_run(&ops, &t, &o, &res), UPF_ERR_CUDA);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "engine step 2 (0 prefill, 3 decode rows)"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "injected"));
  CU_ASSERT_EQUAL(f.used[0] + f.used[1], 0);
  CU_ASSERT_PTR_NULL(res.reqs);
  upf_trace_free(&t);
}

/* The same trace twice: the same tokens and the same schedule (step records equal bit for bit). */
static void test_determinism(void) {
  const int32_t lens[] = {7, 13, 2, 25, 9}, max_new[] = {6, 2, 9};
  const double arrivals[] = {0, 0.002, 0.002, 0.01, 0.05, 0.051, 0.3, 0.31};
  upf_trace t;
  make_trace(&t, 8, lens, 5, arrivals, max_new, 3);
  upf_engine_result res[2];
  for (int k = 0; k < 2; k++) {
    fake_model f;
    upf_engine_ops ops = fake_ops(&f, 4, 40, 0.004, 0.0005);
    f.drop = 1;
    upf_engine_options o = {.token_budget = 32, .eos = -1, .keep_steps = 1};
    run_ok(&ops, &t, &o, &res[k]);
  }
  CU_ASSERT_EQUAL(res[0].num_steps, res[1].num_steps);
  for (int64_t s = 0; s < res[0].num_steps && s < res[1].num_steps; s++) {
    const upf_engine_step_record *x = &res[0].steps[s], *y = &res[1].steps[s];
    CU_ASSERT(x->start == y->start && x->seconds == y->seconds && x->prefill_rows == y->prefill_rows &&
              x->decode_rows == y->decode_rows && x->prefill_tokens == y->prefill_tokens && x->running == y->running &&
              x->pages_used == y->pages_used && x->pages_dense == y->pages_dense);
  }
  /* the arrivals were staggered: some step both decoded and admitted */
  int mixed = 0;
  for (int64_t s = 0; s < res[0].num_steps; s++)
    mixed += res[0].steps[s].prefill_rows > 0 && res[0].steps[s].decode_rows > 0;
  CU_ASSERT(mixed > 0);
  for (int32_t i = 0; i < t.num_reqs; i++) {
    CU_ASSERT_EQUAL(res[0].reqs[i].num_generated, res[1].reqs[i].num_generated);
    CU_ASSERT_EQUAL(memcmp(res[0].reqs[i].tokens, res[1].reqs[i].tokens, sizeof(int32_t) * (size_t)res[0].reqs[i].num_generated), 0);
    CU_ASSERT_EQUAL(res[0].reqs[i].ttft, res[1].reqs[i].ttft);
  }
  check_alone(&t, &res[0], 4, 40);
  upf_engine_result_free(&res[0]);
  upf_engine_result_free(&res[1]);
  upf_trace_free(&t);
}

/* A tiny trace with hand-computed times: a step takes 0.5 s + 0.25 s per prefill token.
 *   A: arrives 0, prompt 4, 3 tokens; B: arrives 0.5, prompt 4, 2 tokens; C: arrives 10, prompt 2, 1 token.
 *   step 0 [0, 1.5]: A prefill (4)           -> A token 1 at 1.5
 *   step 1 [1.5, 3]: A decode, B prefill (4) -> A token 2, B token 1 at 3
 *   step 2 [3, 3.5]: A decode, B decode      -> A token 3, B token 2 at 3.5: both finish
 *   (nothing runs: the clock jumps to 10)
 *   step 3 [10, 11]: C prefill (2)           -> C token 1 at 11, finishes
 * TTFT: A 1.5, B 2.5, C 1; TPOT: A (3.5 - 1.5) / 2 = 1, B 0.5. Nearest rank over [1, 1.5, 2.5]: p50 1.5,
 * p90 2.5, p99 2.5; over [0.5, 1]: p50 0.5, p90 1. Throughput: 6 tokens over [0, 11]; with the 10
 * prompt tokens 16 / 11. */
static void test_hand_computed_times(void) {
  const int32_t lens[] = {4, 4, 2}, max_new[] = {3, 2, 1};
  const double arrivals[] = {0, 0.5, 10};
  upf_trace t;
  make_trace(&t, 3, lens, 3, arrivals, max_new, 3);
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 100, 0.5, 0.25);
  upf_engine_options o = {.token_budget = 100, .eos = -1, .keep_steps = 1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  const double eps = 1e-12;
  CU_ASSERT_EQUAL(res.num_steps, 4);
  CU_ASSERT(fabs(res.reqs[0].ttft - 1.5) < eps && fabs(res.reqs[1].ttft - 2.5) < eps && fabs(res.reqs[2].ttft - 1) < eps);
  CU_ASSERT(fabs(res.reqs[0].tpot - 1.0) < eps && fabs(res.reqs[1].tpot - 0.5) < eps && res.reqs[2].tpot == 0);
  CU_ASSERT(fabs(res.reqs[0].finished - 3.5) < eps && fabs(res.reqs[2].first_token - 11) < eps);
  CU_ASSERT(fabs(res.steps[3].start - 10) < eps);
  CU_ASSERT(fabs(res.ttft_p[0] - 1.5) < eps && fabs(res.ttft_p[1] - 2.5) < eps && fabs(res.ttft_p[2] - 2.5) < eps);
  CU_ASSERT(fabs(res.tpot_p[0] - 0.5) < eps && fabs(res.tpot_p[1] - 1.0) < eps);
  CU_ASSERT(fabs(res.ttft_mean - 5.0 / 3) < eps && fabs(res.tpot_mean - 0.75) < eps);
  CU_ASSERT_EQUAL(res.output_tokens, 6);
  CU_ASSERT_EQUAL(res.prompt_tokens, 10);
  CU_ASSERT(fabs(res.output_tokens_per_s - 6.0 / 11) < eps && fabs(res.total_tokens_per_s - 16.0 / 11) < eps);
  CU_ASSERT(fabs(res.busy_seconds - 4.5) < eps);
  CU_ASSERT(fabs(res.mean_prefill_rows - 0.75) < eps && fabs(res.mean_decode_rows - 0.75) < eps);
  CU_ASSERT(fabs(res.mean_prefill_tokens - 2.5) < eps);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

/* A request ends at eos, before max_new: its tokens end with eos and its pages return. */
static void test_eos(void) {
  const int32_t lens[] = {6, 11}, max_new[] = {40};
  upf_trace t;
  make_trace(&t, 2, lens, 2, NULL, max_new, 1);
  /* the eos: the third token request 0 generates without one */
  fake_model f;
  upf_engine_ops ops = fake_ops(&f, 4, 100, 0.01, 0.0);
  upf_engine_options o = {.token_budget = 100, .eos = -1};
  upf_engine_result res;
  run_ok(&ops, &t, &o, &res);
  const int32_t eos = res.reqs[0].tokens[2];
  int first = 0;
  while (res.reqs[0].tokens[first] != eos)
    first++;
  upf_engine_result_free(&res);
  ops = fake_ops(&f, 4, 100, 0.01, 0.0);
  o.eos = eos;
  run_ok(&ops, &t, &o, &res);
  CU_ASSERT_EQUAL(res.reqs[0].num_generated, first + 1);
  CU_ASSERT_EQUAL(res.reqs[0].tokens[first], eos);
  for (int32_t i = 0; i < 2; i++)
    for (int32_t k = 0; k + 1 < res.reqs[i].num_generated; k++)
      CU_ASSERT_NOT_EQUAL(res.reqs[i].tokens[k], eos);
  CU_ASSERT_EQUAL(f.used[0] + f.used[1], 0);
  upf_engine_result_free(&res);
  upf_trace_free(&t);
}

static void test_argmax(void) {
  const float a[5] = {1, 3, 3, -2, 3}, b[3] = {-INFINITY, -INFINITY, -INFINITY}, c[3] = {0, NAN, 1};
  CU_ASSERT_EQUAL(upf_engine_argmax(a, 5), 1);
  CU_ASSERT_EQUAL(upf_engine_argmax(b, 3), 0);
  CU_ASSERT_EQUAL(upf_engine_argmax(c, 3), -1);
}

/* ---- traces ---- */

static void test_trace_seeded(void) {
  upf_trace a, b;
  const upf_trace_spec spec = {200, 5, 9, 3, 4.0, 11};
  CU_ASSERT_EQUAL_FATAL(upf_trace_seeded(&a, &spec, 512), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_trace_seeded(&b, &spec, 512), UPF_OK);
  int lens_seen[10] = {0};
  for (int32_t i = 0; i < a.num_reqs; i++) {
    CU_ASSERT(a.reqs[i].prompt_len >= 5 && a.reqs[i].prompt_len <= 9);
    lens_seen[a.reqs[i].prompt_len]++;
    CU_ASSERT_EQUAL(a.reqs[i].prompt_len, b.reqs[i].prompt_len);
    CU_ASSERT_EQUAL(a.reqs[i].arrival, b.reqs[i].arrival);
    CU_ASSERT_EQUAL(memcmp(a.reqs[i].prompt, b.reqs[i].prompt, sizeof(int32_t) * (size_t)a.reqs[i].prompt_len), 0);
    CU_ASSERT(i == 0 || a.reqs[i].arrival > a.reqs[i - 1].arrival);
  }
  for (int l = 5; l <= 9; l++)
    CU_ASSERT(lens_seen[l] > 10);
  /* 200 exponential gaps of mean 1/4 s: the mean within 4 standard errors (0.25 / sqrt(200) each) */
  const double mean_gap = a.reqs[199].arrival / 200;
  CU_ASSERT(fabs(mean_gap - 0.25) < 4 * 0.25 / sqrt(200.0));
  upf_trace_free(&a), upf_trace_free(&b);
  const upf_trace_spec now = {3, 4, 4, 2, 0, 1}, inf = {3, 4, 4, 2, INFINITY, 1};
  CU_ASSERT_EQUAL_FATAL(upf_trace_seeded(&a, &now, 512), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_trace_seeded(&b, &inf, 512), UPF_OK);
  for (int32_t i = 0; i < 3; i++)
    CU_ASSERT(a.reqs[i].arrival == 0 && b.reqs[i].arrival == 0);
  upf_trace_free(&a), upf_trace_free(&b);
  const upf_trace_spec bad = {3, 9, 4, 2, 0, 1};
  CU_ASSERT_EQUAL(upf_trace_seeded(&a, &bad, 512), UPF_ERR_INVALID_ARG);
}

static void test_trace_jsonl(void) {
  upf_trace t;
  const char *good = "{\"arrival\": 0.5, \"prompt\": [1, 2, 3], \"max_new\": 4, \"id\": 7}\n"
                     "\n"
                     "  {\"id\": 3, \"arrival\": 0.25, \"prompt_len\": 5, \"seed\": 9}\r\n"
                     "{\"arrival\": 0.5, \"prompt_len\": 2}";
  CU_ASSERT_EQUAL_FATAL(upf_trace_parse_jsonl(&t, good, "good", 512, 6), UPF_OK);
  CU_ASSERT_EQUAL(t.num_reqs, 3);
  /* by arrival, ties in line order: id 3 (0.25), id 7 (0.5), the line-4 request (0.5, id 4) */
  CU_ASSERT_EQUAL(t.reqs[0].id, 3);
  CU_ASSERT_EQUAL(t.reqs[1].id, 7);
  CU_ASSERT_EQUAL(t.reqs[2].id, 4);
  CU_ASSERT_EQUAL(t.reqs[1].prompt_len, 3);
  CU_ASSERT(t.reqs[1].prompt[0] == 1 && t.reqs[1].prompt[2] == 3);
  CU_ASSERT_EQUAL(t.reqs[1].max_new, 4);
  CU_ASSERT_EQUAL(t.reqs[0].max_new, 6);
  CU_ASSERT_EQUAL(t.reqs[0].prompt_len, 5);
  upf_trace again;
  CU_ASSERT_EQUAL_FATAL(upf_trace_parse_jsonl(&again, good, "good", 512, 6), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(t.reqs[0].prompt, again.reqs[0].prompt, 5 * sizeof(int32_t)), 0);
  upf_trace_free(&again);
  upf_trace_free(&t);
  static const struct {
    const char *text, *want;
  } bad[] = {
      {"{\"arrival\": 0, \"prompt_len\": 3}\n{\"arrival\": 1, \"prompt_len\": 3, \"colour\": 1}", "line 2"},
      {"{\"arrival\": 0, \"prompt_len\": 3}\n\n{\"prompt_len\": 3}", "line 3"},
      {"{\"arrival\": 0, \"prompt_len\": 3, \"prompt\": [1]}", "exactly one of"},
      {"{\"arrival\": 0, \"prompt\": [1, 512]}", "[0, 511]"},
      {"{\"arrival\": 0, \"prompt\": []}", "empty prompt"},
      {"{\"arrival\": -1, \"prompt_len\": 3}", "arrival"},
      {"{\"arrival\": 0, \"prompt_len\": 3} x", "text after"},
      {"{\"arrival\": 0, \"prompt_len\": 2.5}", "not an integer"},
      {"{\"arrival\": 0, \"prompt_len\": 3, \"id\": 1}\n{\"arrival\": 0, \"prompt_len\": 3, \"id\": 1}",
       "also the id of line 1"},
      {"{\"arrival\": 0, \"arrival\": 1, \"prompt_len\": 3}", "given twice"},
      {"{\"arrival\": nan, \"prompt_len\": 3}", "finite number"},
      {"[1, 2]", "JSON object"},
      {"\n\n", "no requests"},
      {"{\"arrival\": 0, \"prompt\": [1, 2}", "line 1"},
      {"{\"arrival\": 0, \"prompt\": [1], \"seed\": 3}", "\"seed\" goes with"},
      /* refused before its ids are made (the fuzzer's 3.9 GB line; the bound plus one) */
      {"{\"arrival\": 0, \"prompt_len\": 965882184}", "a trace holds at most 67108864"},
      {"{\"arrival\": 0, \"prompt\": [1]}\n{\"arrival\": 0, \"prompt_len\": 67108864}", "line 2 (column 39): "
       "67108865 prompt tokens up to this line"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    const upf_status st = upf_trace_parse_jsonl(&t, bad[i].text, "t.jsonl", 512, 4);
    CU_ASSERT_EQUAL(st, UPF_ERR_FORMAT);
    const int named = strstr(upf_last_error(), bad[i].want) && strstr(upf_last_error(), "t.jsonl");
    if (!named)
      printf("\ncase %zu: '%s'\n", i, upf_last_error());
    CU_ASSERT(named);
    CU_ASSERT_PTR_NULL(t.reqs);
  }
  CU_ASSERT_EQUAL(upf_trace_read_jsonl(&t, "/nonexistent/trace.jsonl", 512, 4), UPF_ERR_IO);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "/nonexistent/trace.jsonl"));
}

/* ---- The engine over the real session (CPU, tiny configs, f32) ---- */

/* A long prompt that drops, one shorter than sink + last_q, a one-token prompt and a medium one; each
 * stops after its own count of tokens. With a budget of 160 tokens and every arrival at 0 the schedule
 * is fixed: step 0 prefills request 0 alone (24 + 150 > 160); step 1 decodes it beside the prefills of
 * requests 1 and 2 (1 + 150 + 1; + 90 would not fit); step 2 decodes three and prefills request 3
 * (3 + 90), and request 0 finishes there while the others go on decoding. Quick: 90 tokens over
 * 24, 72, 1, 40. */
static const int32_t mixed_lens[] = {24, 150, 1, 90}, mixed_lens_quick[] = {24, 72, 1, 40};
static const int32_t mixed_new[] = {3, 6, 4, 5};
#define MIXED_BUDGET (upf_test_quick() ? 90 : 160)

static void mixed_trace(upf_trace *t, int32_t vocab) {
  const int32_t *lens = upf_test_quick() ? mixed_lens_quick : mixed_lens;
  t->num_reqs = 4;
  t->reqs = calloc(4, sizeof *t->reqs);
  for (int32_t i = 0; i < 4; i++) {
    upf_engine_request *r = &t->reqs[i];
    r->id = i, r->prompt_len = lens[i], r->max_new = mixed_new[i];
    r->prompt = malloc((size_t)lens[i] * sizeof *r->prompt);
    upf_model_seeded_ids(40 + (uint64_t)i, vocab, lens[i], r->prompt);
  }
}

static upf_status run_on_session(const upf_model *m, upf_prefill_mode mode, const upf_trace *t, upf_engine_result *res) {
  upf_session_config sc = upf_session_config_default(m);
  sc.mode = mode, sc.select.p = 0.5f, sc.max_requests = t->num_reqs, sc.pages_per_group = 64;
  upf_session *s = NULL;
  UPF_TRY(upf_session_create(m, &sc, &s));
  upf_engine_ops ops;
  upf_status st = upf_engine_session_ops(s, m, sc.max_requests, t->num_reqs, &ops);
  const upf_engine_options o = {.token_budget = MIXED_BUDGET, .eos = -1, .keep_steps = 1};
  if (st == UPF_OK) {
    st = upf_engine_run(&ops, t, &o, res);
    upf_engine_session_ops_free(&ops);
  }
  /* every page returned to the session */
  for (int32_t g = 0; st == UPF_OK && g < upf_session_num_groups(s); g++)
    CU_ASSERT_EQUAL(upf_session_pages_free(s, g), upf_session_pages_total(s, g));
  upf_session_free(s);
  return st;
}

/* Batch invariance through the engine, and the deployment's failure cases: each request's tokens in
 * the mixed continuous batch equal its tokens run alone, dense and UniPrefill at p = 0.5, where decode
 * rows share a step with a dropping prefill, a prompt shorter than sink + last_q and a one-token prompt
 * sit beside the long one, and a request finishes while the others decode. */
static void test_session_batch_invariance(void) {
  static const char *const families[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
  const int nf = upf_test_quick() ? 1 : 3;
  for (int fi = 0; fi < nf; fi++) {
    const upf_model_config *cfg = upf_model_config_by_name(families[fi]);
    upf_model m;
    if (upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 5, 0, cfg->num_layers) != UPF_OK) {
      CU_FAIL(upf_last_error());
      continue;
    }
    upf_trace t;
    mixed_trace(&t, cfg->vocab);
    for (int mode = upf_test_quick(); mode < 2; mode++) {
      const upf_prefill_mode pm = mode ? UPF_PREFILL_UNIPREFILL : UPF_PREFILL_DENSE;
      upf_engine_result all;
      upf_status st = run_on_session(&m, pm, &t, &all);
      if (st != UPF_OK) {
        printf("\n%s mode %d: %s\n", cfg->name, mode, upf_last_error());
        CU_FAIL("engine over the session");
        continue;
      }
      /* the schedule the trace was built for */
      CU_ASSERT(all.num_steps >= 3);
      CU_ASSERT(all.steps[1].prefill_rows == 2 && all.steps[1].decode_rows == 1);
      CU_ASSERT(all.steps[2].prefill_rows == 1 && all.steps[2].decode_rows == 3);
      CU_ASSERT_EQUAL(all.reqs[0].finish_step, 2);
      CU_ASSERT(all.reqs[1].finish_step > 2 && all.reqs[2].finish_step > 2 && all.reqs[3].finish_step > 2);
      /* UniPrefill: the long prompt really dropped (fewer pages than dense right after its prefill) */
      if (mode) {
        CU_ASSERT(all.reqs[1].pages_after_prefill < all.reqs[1].dense_pages_after_prefill);
      } else {
        CU_ASSERT_EQUAL(all.reqs[1].pages_after_prefill, all.reqs[1].dense_pages_after_prefill);
      }
      for (int32_t i = 0; i < t.num_reqs; i++) {
        upf_trace one = {1, &t.reqs[i]};
        upf_engine_result alone;
        if (run_on_session(&m, pm, &one, &alone) != UPF_OK) {
          CU_FAIL(upf_last_error());
          continue;
        }
        CU_ASSERT_EQUAL(alone.reqs[0].num_generated, all.reqs[i].num_generated);
        const int same = alone.reqs[0].num_generated == all.reqs[i].num_generated &&
                         !memcmp(alone.reqs[0].tokens, all.reqs[i].tokens, sizeof(int32_t) * (size_t)alone.reqs[0].num_generated);
        if (!same)
          printf("\n%s mode %d request %d: tokens in the batch differ from alone\n", cfg->name, mode, i);
        CU_ASSERT(same);
        CU_ASSERT_EQUAL(alone.reqs[0].pages_after_prefill, all.reqs[i].pages_after_prefill);
        upf_engine_result_free(&alone);
      }
      upf_engine_result_free(&all);
    }
    upf_trace_free(&t);
    upf_model_free(&m);
  }
}

/* Pages for two of the requests at a time on the real session: the others wait, are admitted as pages
 * return, and produce the same tokens as with pages for all. */
static void test_session_page_wait(void) {
  if (upf_test_quick()) {
    printf("skipped under Valgrind (quick): the batch-invariance test runs the same session code ");
    return;
  }
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  if (upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 5, 0, cfg->num_layers) != UPF_OK) {
    CU_FAIL(upf_last_error());
    return;
  }
  upf_trace t;
  mixed_trace(&t, cfg->vocab);
  upf_engine_result wide, tight;
  upf_session_config sc = upf_session_config_default(&m);
  sc.max_requests = 4;
  const upf_engine_options o = {.token_budget = MIXED_BUDGET, .eos = -1, .keep_steps = 1};
  for (int k = 0; k < 2; k++) {
    /* worst cases in pages of 16: 2, 10 (5 quick), 1, 6 (3 quick); 12 pages hold requests 0 and 1 only */
    sc.pages_per_group = k ? 12 : 64;
    upf_session *s = NULL;
    upf_engine_ops ops;
    upf_status st = upf_session_create(&m, &sc, &s);
    if (st == UPF_OK)
      st = upf_engine_session_ops(s, &m, sc.max_requests, t.num_reqs, &ops);
    if (st == UPF_OK) {
      st = upf_engine_run(&ops, &t, &o, k ? &tight : &wide);
      upf_engine_session_ops_free(&ops);
    }
    if (s)
      upf_session_free(s);
    if (st != UPF_OK) {
      printf("\n%s\n", upf_last_error());
      CU_FAIL("engine over the session");
      upf_trace_free(&t);
      upf_model_free(&m);
      if (k)
        upf_engine_result_free(&wide);
      return;
    }
  }
  CU_ASSERT(tight.num_steps > wide.num_steps || upf_test_quick());
  for (int32_t i = 0; i < t.num_reqs; i++) {
    CU_ASSERT_EQUAL(memcmp(wide.reqs[i].tokens, tight.reqs[i].tokens, sizeof(int32_t) * (size_t)wide.reqs[i].max_new), 0);
    CU_ASSERT(tight.reqs[i].admit_step >= wide.reqs[i].admit_step);
  }
  CU_ASSERT(tight.pages_peak <= 3 * 12);
  upf_engine_result_free(&wide), upf_engine_result_free(&tight);
  upf_trace_free(&t);
  upf_model_free(&m);
}

void upf_register_engine_tests(void) {
  static const CU_TestInfo tests[] = {
      {"budget respected every step, outputs equal alone", test_budget},
      {"FCFS admission", test_fcfs},
      {"a prompt over the budget pauses the decodes for one step", test_long_prompt_pauses_decodes},
      {"finishing frees pages and admits the waiting", test_pages_release_and_wait},
      {"page exhaustion: a request that can never fit", test_page_exhaustion},
      {"a failing step is named", test_step_failure_releases},
      {"determinism: same tokens, same schedule", test_determinism},
      {"hand-computed TTFT, TPOT and throughput", test_hand_computed_times},
      {"eos ends a request early", test_eos},
      {"greedy argmax: ties to the lowest id, NaN refused", test_argmax},
      {"seeded trace: lengths, Poisson arrivals, all at t = 0", test_trace_seeded},
      {"JSON-lines trace: order, defaults, bad lines named", test_trace_jsonl},
      {"session: mixed batches equal alone (dense, UniPrefill), failure cases", test_session_batch_invariance},
      {"session: requests wait for pages, same tokens", test_session_page_wait},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("engine", NULL, NULL, tests);
}
