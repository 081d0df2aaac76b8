/* Sessions (uniprefill/session.h) on the tiny configs: decoding equals recomputation (dense, and after
 * drops, where the recomputation replays the prefill's masks extended with keep = 1 for the generated
 * tokens), in one scenario that mixes decode rows with a dropping prefill, a prompt shorter than
 * sink + L beside long ones, and a request finishing (its pages reused) while others decode; the KV
 * memory accounting and kv_len by hand; bad steps refused with nothing changed; the slot mapping by
 * hand. GPU variants run the scenario on CUDA and the two paged-KV ops' verify sets. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/kv.h"
#include "tests/test_util.h"
#include "uniprefill/session.h"
#include "verify/verify_model.h"

static const char *const tiny[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};

static int greedy(const float *logits, int32_t V) {
  int best = 0;
  for (int v = 1; v < V; v++)
    if (logits[v] > logits[best])
      best = v;
  return best;
}

/* What the scenario saw of one request: its tokens (prompt then generated), its prefill masks, and
 * the logits of every step it was in. */
#define MAX_EVENTS 8
typedef struct {
  int32_t req, prompt_len, num_tokens;
  int32_t tokens[256];
  uint8_t *masks[UPF_MODEL_MAX_LAYERS]; /* per drop layer index: over the prompt's tokens entering it */
  int64_t mask_len[UPF_MODEL_MAX_LAYERS];
  int num_events;
  float *logits[MAX_EVENTS]; /* after tokens[0 .. prompt_len + e) */
} tracked;

/* Records one step: each row's logits, its greedy token, and (prefill rows) its masks. */
static void record_step(const upf_model_config *cfg, const upf_session_row *rows, int32_t B, const upf_prefill_result *res,
                        tracked **who) {
  for (int32_t r = 0; r < B; r++) {
    tracked *t = who[r];
    float *l = malloc(sizeof(float) * (size_t)cfg->vocab);
    memcpy(l, res->logits + (size_t)r * cfg->vocab, sizeof(float) * (size_t)cfg->vocab);
    t->logits[t->num_events++] = l;
    t->tokens[t->num_tokens++] = greedy(l, cfg->vocab);
  }
  /* row lengths entering each drop, to find each prefill row's part of the masks */
  int32_t len[64];
  for (int32_t r = 0; r < B; r++)
    len[r] = rows[r].kind == UPF_ROW_PREFILL ? who[r]->prompt_len : 1;
  for (int d = 0; d < res->num_drops; d++) {
    int k = 0;
    while (cfg->drop_layers[k] != res->drops[d].layer)
      k++;
    int64_t off = 0;
    for (int32_t r = 0; r < B; r++) {
      if (rows[r].kind == UPF_ROW_PREFILL) {
        who[r]->masks[k] = malloc((size_t)len[r]);
        memcpy(who[r]->masks[k], res->drops[d].mask + off, (size_t)len[r]);
        who[r]->mask_len[k] = len[r];
      }
      off += len[r];
      len[r] = res->drops[d].kept_per_req[r];
    }
  }
}

/* Every recorded logits row against a from-scratch prefill of the tokens so far (masks replayed and
 * extended with 1 for the generated tokens). Returns the worst error share of the tolerance. */
static double check_recompute(const upf_model *m, upf_prefill_mode mode, const upf_select_params *sel, const tracked *t,
                              double atol, double rtol) {
  const upf_model_config *cfg = m->cfg;
  double worst = 0;
  for (int e = 0; e < t->num_events; e++) {
    const int32_t n = t->prompt_len + e;
    int32_t cu[2] = {0, n};
    uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
    int64_t mlen[UPF_MODEL_MAX_LAYERS] = {0};
    for (int k = 0; k < cfg->num_drop_layers; k++)
      if (t->masks[k]) {
        mlen[k] = t->mask_len[k] + e;
        masks[k] = malloc((size_t)mlen[k]);
        memcpy(masks[k], t->masks[k], (size_t)t->mask_len[k]);
        memset(masks[k] + t->mask_len[k], 1, (size_t)e);
      }
    /* the kept count entering drop k+1 follows from drop k's mask */
    for (int k = 1; k < cfg->num_drop_layers; k++)
      if (masks[k] && masks[k - 1]) {
        int64_t kept = 0;
        for (int64_t i = 0; i < mlen[k - 1]; i++)
          kept += masks[k - 1][i];
        CU_ASSERT_EQUAL(kept, mlen[k]);
      }
    upf_prefill_options o = {.mode = mode, .select = *sel};
    o.replay_masks = (const uint8_t *const *)masks, o.replay_mask_len = mlen;
    upf_prefill_result res;
    upf_status st = upf_model_prefill(m, t->tokens, cu, 1, &o, &res);
    if (st != UPF_OK)
      printf("\nrecompute of request %d at event %d: %s\n", t->req, e, upf_last_error());
    CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
    for (int v = 0; v < cfg->vocab; v++) {
      const double r = res.logits[v], a = t->logits[e][v];
      const double share = fabs(a - r) / (atol + rtol * fabs(r));
      worst = share > worst ? share : worst;
    }
    /* greedy agrees wherever the top-2 margin exceeds the tolerance */
    const int want = greedy(res.logits, cfg->vocab), got = greedy(t->logits[e], cfg->vocab);
    float second = -INFINITY;
    for (int v = 0; v < cfg->vocab; v++)
      if (v != want && res.logits[v] > second)
        second = res.logits[v];
    if (res.logits[want] - second > 2 * (atol + rtol * fabs(res.logits[want])))
      CU_ASSERT_EQUAL(got, want);
    upf_prefill_result_free(&res);
    for (int k = 0; k < cfg->num_drop_layers; k++)
      free(masks[k]);
  }
  return worst;
}

static upf_status add(upf_session *s, const upf_model_config *cfg, tracked *t, int32_t len, uint64_t seed) {
  memset(t, 0, sizeof *t);
  t->prompt_len = len;
  upf_model_seeded_ids(seed, cfg->vocab, len, t->tokens);
  t->num_tokens = len;
  return upf_session_add_request(s, t->tokens, len, &t->req);
}

static upf_status step(upf_session *s, const upf_model_config *cfg, tracked **who, const upf_row_kind *kinds, int32_t B) {
  upf_session_row rows[8];
  for (int32_t r = 0; r < B; r++)
    rows[r] = (upf_session_row){who[r]->req, kinds[r], who[r]->tokens[who[r]->num_tokens - 1]};
  upf_prefill_result res;
  UPF_TRY(upf_session_step(s, rows, B, NULL, &res));
  record_step(cfg, rows, B, &res, who);
  upf_prefill_result_free(&res);
  return UPF_OK;
}

/* The scenario: A (long) prefills alone; then B (long, dropping) and C (shorter than sink + L) prefill
 * beside A's decode row; then all three decode; A finishes and releases its pages, D prefills (reusing
 * them) beside B's and C's decode rows; then B, C, D decode. */
static void scenario(const upf_backend *be, const char *family, upf_prefill_mode mode, double atol, double rtol) {
  const upf_model_config *cfg = upf_model_config_by_name(family);
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, be, UPF_DTYPE_F32, 11, 0, cfg->num_layers), UPF_OK);
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = mode, sc.select.p = 0.5f, sc.max_requests = 4, sc.pages_per_group = 24;
  upf_session *s = NULL;
  CU_ASSERT_EQUAL_FATAL(upf_session_create(&m, &sc, &s), UPF_OK);
  const int32_t la = upf_test_quick() ? 56 : 90, lb = upf_test_quick() ? 60 : 130, lc = 20, ld = 70;
  tracked A, B, C, D;
  const upf_row_kind P = UPF_ROW_PREFILL, Dk = UPF_ROW_DECODE;
  upf_status st = add(s, cfg, &A, la, 1);
  if (st == UPF_OK)
    st = step(s, cfg, (tracked *[]){&A}, (upf_row_kind[]){P}, 1);
  if (st == UPF_OK)
    st = add(s, cfg, &B, lb, 2);
  if (st == UPF_OK)
    st = add(s, cfg, &C, lc, 3);
  if (st == UPF_OK)
    st = step(s, cfg, (tracked *[]){&B, &C, &A}, (upf_row_kind[]){P, P, Dk}, 3);
  if (st == UPF_OK)
    st = step(s, cfg, (tracked *[]){&C, &A, &B}, (upf_row_kind[]){Dk, Dk, Dk}, 3);
  const int64_t free_before = upf_session_pages_free(s, 0);
  if (st == UPF_OK)
    st = upf_session_release(s, A.req);
  CU_ASSERT(upf_session_pages_free(s, 0) == free_before + upf_session_pages_for(s, la + 2));
  if (st == UPF_OK)
    st = add(s, cfg, &D, ld, 4);
  if (st == UPF_OK)
    st = step(s, cfg, (tracked *[]){&D, &B, &C}, (upf_row_kind[]){P, Dk, Dk}, 3);
  if (st == UPF_OK)
    st = step(s, cfg, (tracked *[]){&B, &C, &D}, (upf_row_kind[]){Dk, Dk, Dk}, 3);
  if (st != UPF_OK)
    printf("\n%s: %s\n", family, upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  if (mode == UPF_PREFILL_UNIPREFILL) { /* the long prompts really dropped */
    upf_session_request_info info;
    CU_ASSERT_EQUAL(upf_session_request(s, B.req, &info), UPF_OK);
    CU_ASSERT(info.num_drops >= 1 && info.drops[0].kept_len < lb);
  }
  tracked *all[] = {&A, &B, &C, &D};
  for (int i = 0; i < 4; i++) {
    const double worst = check_recompute(&m, mode, &sc.select, all[i], atol, rtol);
    if (worst > 1)
      printf("\n%s %s request %c: error %.2f of the tolerance\n", family, mode ? "uniprefill" : "dense", 'A' + i, worst);
    CU_ASSERT(worst <= 1);
    for (int e = 0; e < all[i]->num_events; e++)
      free(all[i]->logits[e]);
    for (int k = 0; k < UPF_MODEL_MAX_LAYERS; k++)
      free(all[i]->masks[k]);
  }
  upf_session_free(s);
  upf_model_free(&m);
}

static void scenario_all(const upf_backend *be, upf_prefill_mode mode, double atol, double rtol) {
  const int n = upf_test_quick() ? 1 : 3;
  for (int i = 0; i < n; i++)
    scenario(be, tiny[upf_test_quick() ? (int)mode % 3 : i], mode, atol, rtol);
}

/* Under Valgrind (quick) the UniPrefill scenario alone: it runs the dense path's every step and the drops. */
static void test_dense_decode_recompute(void) {
  if (upf_test_quick()) {
    printf("skipped in quick mode (the UniPrefill scenario runs the same session steps) ");
    return;
  }
  scenario_all(upf_backend_cpu(), UPF_PREFILL_DENSE, 1e-5, 1e-5);
}
static void test_uniprefill_decode_recompute(void) {
  scenario_all(upf_backend_cpu(), UPF_PREFILL_UNIPREFILL, 1e-5, 1e-5);
}
/* CUDA against its own recomputation: fp32, the attention kernels differ between the paged decode and
 * the prefill, so the long-reduction slack of SPEC section 7 applies: 1e-4. */
static void test_cuda_dense_decode(void) { scenario_all(upf_backend_cuda(), UPF_PREFILL_DENSE, 1e-4, 1e-4); }
static void test_cuda_uniprefill_decode(void) { scenario_all(upf_backend_cuda(), UPF_PREFILL_UNIPREFILL, 1e-4, 1e-4); }

/* llama-tiny, P = 16, f32: groups {0,1,2}, {3,4}, {5} (3, 2 and 1 attention layers); one page of one
 * layer is 2 * 16 * 2 * 32 * 4 = 8192 bytes. A 72-token prompt whose replayed masks keep 40 then 32:
 * pages 5 + 3 + 2 = 10 in use, 15 dense; bytes 8192 * (5*3 + 3*2 + 2*1) = 188416, dense 8192 * 5 * 6 =
 * 245760. */
static void test_memory_accounting(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 5, 0, cfg->num_layers), UPF_OK);
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = UPF_PREFILL_UNIPREFILL, sc.pages_per_group = 8;
  sc.group_pages[2] = 5; /* the step checks the dense bound, ceil(72 / 16), in every group */
  upf_session *s = NULL;
  CU_ASSERT_EQUAL_FATAL(upf_session_create(&m, &sc, &s), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_num_groups(s), 3);
  CU_ASSERT_EQUAL(upf_session_group_of_layer(s, 2), 0);
  CU_ASSERT_EQUAL(upf_session_group_of_layer(s, 3), 1);
  CU_ASSERT_EQUAL(upf_session_group_of_layer(s, 5), 2);
  CU_ASSERT_EQUAL(upf_session_pages_total(s, 2), 5);
  int32_t ids[72], req = -1;
  upf_model_seeded_ids(9, cfg->vocab, 72, ids);
  CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, ids, 72, &req), UPF_OK);
  uint8_t m0[72], m1[72 + 1];
  for (int i = 0; i < 72; i++)
    m0[i] = i < 24 || i >= 56; /* 40 kept: the sink 16 and the last 16 among them */
  int j = 0;
  for (int i = 0; i < 72; i++)
    if (m0[i])
      m1[j] = j < 16 || j >= 24, j++; /* 32 of the 40 */
  const uint8_t *masks[2] = {m0, m1};
  const int64_t lens[2] = {72, 40};
  upf_session_step_options so = {masks, lens, NULL, NULL};
  upf_session_row row = {req, UPF_ROW_PREFILL, 0};
  upf_prefill_result res;
  CU_ASSERT_EQUAL_FATAL(upf_session_step(s, &row, 1, &so, &res), UPF_OK);
  const int next = greedy(res.logits, cfg->vocab);
  upf_prefill_result_free(&res);
  upf_session_memory mem;
  upf_session_memory_usage(s, &mem);
  CU_ASSERT_EQUAL(mem.pages_in_use, 10);
  CU_ASSERT_EQUAL(mem.pages_dense, 15);
  CU_ASSERT_DOUBLE_EQUAL(mem.bytes_in_use, 188416.0, 0.5);
  CU_ASSERT_DOUBLE_EQUAL(mem.bytes_dense, 245760.0, 0.5);
  CU_ASSERT_DOUBLE_EQUAL(mem.bytes_saved, 245760.0 - 188416.0, 0.5);
  CU_ASSERT_DOUBLE_EQUAL(mem.bytes_capacity, 8192.0 * (8 * 3 + 8 * 2 + 5 * 1), 0.5);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 0), 3);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 1), 5);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 2), 3);
  int64_t kv = 0;
  CU_ASSERT(upf_session_kv_len(s, req, 0, &kv) == UPF_OK && kv == 72);
  CU_ASSERT(upf_session_kv_len(s, req, 2, &kv) == UPF_OK && kv == 72);
  CU_ASSERT(upf_session_kv_len(s, req, 4, &kv) == UPF_OK && kv == 40);
  CU_ASSERT(upf_session_kv_len(s, req, 5, &kv) == UPF_OK && kv == 32);
  upf_session_request_info info;
  CU_ASSERT_EQUAL(upf_session_request(s, req, &info), UPF_OK);
  CU_ASSERT_EQUAL(info.num_drops, 2);
  CU_ASSERT(info.drops[0].layer == 2 && info.drops[0].kept_len == 40);
  CU_ASSERT(info.drops[1].layer == 4 && info.drops[1].kept_len == 32);
  /* one decode row: 73, 41, 33 entries; groups 0 and 1 have room (73 <= 80, 41 <= 48), group 2's
   * token 32 opens a third page */
  row = (upf_session_row){req, UPF_ROW_DECODE, next};
  CU_ASSERT_EQUAL_FATAL(upf_session_step(s, &row, 1, NULL, &res), UPF_OK);
  upf_prefill_result_free(&res);
  CU_ASSERT(upf_session_kv_len(s, req, 5, &kv) == UPF_OK && kv == 33);
  upf_session_memory_usage(s, &mem);
  CU_ASSERT_EQUAL(mem.pages_in_use, 11);
  CU_ASSERT_EQUAL(mem.pages_dense, 15);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 2), 2);
  /* bad steps: refused, nothing changed */
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){req + 7, UPF_ROW_DECODE, 1}, 1, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "request 7 is unknown") != NULL);
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){req, UPF_ROW_PREFILL, 0}, 1, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "already prefilled") != NULL);
  int32_t other = -1;
  CU_ASSERT_EQUAL_FATAL(upf_session_add_request(s, ids, 72, &other), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){other, UPF_ROW_DECODE, 1}, 1, NULL, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "not prefilled yet") != NULL);
  /* 72 tokens need 5 pages at their dense length; group 0 has 3 */
  CU_ASSERT_EQUAL(upf_session_step(s, &(upf_session_row){other, UPF_ROW_PREFILL, 0}, 1, NULL, &res), UPF_ERR_NOMEM);
  CU_ASSERT(strstr(upf_last_error(), "cache group 0 has 3 free pages") != NULL);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 0), 3);
  CU_ASSERT_EQUAL(upf_session_release(s, req), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 0), 8);
  CU_ASSERT_EQUAL(upf_session_pages_free(s, 2), 5);
  CU_ASSERT_EQUAL(upf_session_release(s, req), UPF_ERR_INVALID_ARG);
  upf_session_free(s);
  upf_model_free(&m);
}

/* The slot mapping by hand: P = 4; a 6-token prefill row over pages [5, 2], a decode row at logical
 * index 7 over [1, 3], a one-token prefill row over [0]. */
static void test_slot_mapping_by_hand(void) {
  int32_t cu[] = {0, 6, 7, 8}, start[] = {0, 7, 0}, table[] = {5, 2, 1, 3, 0, 4}, got[8];
  const int32_t want[] = {20, 21, 22, 23, 8, 9, 15, 0};
  const upf_kv_slot_batch b = {3, cu, cu, start, start, table, table, 2, 4, 6};
  CU_ASSERT_EQUAL_FATAL(cpu_kv_slot_mapping(&b, got), UPF_OK);
  CU_ASSERT_EQUAL(memcmp(got, want, sizeof want), 0);
  upf_test_verify_op(UPF_OP_KV_SLOT_MAPPING, upf_test_cpu_twin(), 3);
  upf_test_verify_op(UPF_OP_SCATTER_ROWS, upf_test_cpu_twin(), 3);
}

/* The generate check of verify (upf verify model.generate) on a backend: the CPU twin here, CUDA on a
 * GPU. On the twin every run equals the CPU's bit for bit, so it checks the check's plumbing: the fp64
 * truth of every decode step (replayed drops extended over the generated tokens) fits the CPU within
 * the rule, and every configuration dropped. */
static void generate_verify_on(const upf_backend *be) {
  upf_verify_ctx ctx = {.backend = be, .log = NULL, .quick = 1};
  upf_verify_generate(&ctx);
  if (ctx.failed) {
    ctx.log = stdout, ctx.passed = ctx.failed = 0;
    printf("\n");
    upf_verify_generate(&ctx);
  }
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT_EQUAL(ctx.passed, 12); /* 3 configs x 2 dtypes x (dense, uniprefill) */
}
static void test_generate_verify_twin(void) {
  if (upf_test_quick()) { /* seconds natively, minutes under Valgrind; the scenarios above cover the path */
    printf("skipped in quick mode (the decode scenarios cover the session path) ");
    return;
  }
  generate_verify_on(upf_test_cpu_twin());
}
static void test_generate_verify_cuda(void) { generate_verify_on(upf_backend_cuda()); }

/* The negative control of that check: a twin whose slot mapping swaps the slots of the first and the
 * last token of every step writes two tokens' K/V into each other's places, which only decode reads
 * (prefill rows attend over the step's own K/V): both of llama-tiny's f32 checks must fail. */
static upf_status swapped_slots(const upf_kv_slot_batch *b, int32_t *slots) {
  UPF_TRY(upf_backend_cpu()->kv_slot_mapping(b, slots));
  const int32_t T = b->cu_seqlens_host[b->num_reqs];
  const int32_t first = slots[0];
  slots[0] = slots[T - 1], slots[T - 1] = first;
  return UPF_OK;
}
static void test_generate_verify_negative(void) {
  if (upf_test_quick()) {
    printf("skipped in quick mode (seconds natively) ");
    return;
  }
  upf_backend broken = *upf_test_cpu_twin();
  broken.kv_slot_mapping = swapped_slots;
  upf_verify_ctx ctx = {.backend = &broken, .log = NULL, .quick = 1};
  upf_verify_generate_config(&ctx, upf_model_config_by_name("llama-tiny"), UPF_DTYPE_F32);
  CU_ASSERT_EQUAL(ctx.failed, 2);
  CU_ASSERT_EQUAL(ctx.passed, 0);
}

static void test_cuda_kv_ops(void) {
  upf_test_verify_op(UPF_OP_KV_SLOT_MAPPING, upf_backend_cuda(), 5);
  upf_test_verify_op(UPF_OP_SCATTER_ROWS, upf_backend_cuda(), 4);
}

void upf_register_decode_tests(void) {
  static CU_TestInfo tests[] = {
      {"slot mapping by hand and against the reference", test_slot_mapping_by_hand},
      {"KV memory accounting, kv_len and bad steps by hand", test_memory_accounting},
      {"dense decoding equals recomputation (mixed steps, releases)", test_dense_decode_recompute},
      {"decode after drops equals replayed recomputation", test_uniprefill_decode_recompute},
      {"generate verify on the CPU twin", test_generate_verify_twin},
      {"generate verify fails on a twin that swaps two slots", test_generate_verify_negative},
      CU_TEST_INFO_NULL,
  };
  CU_pSuite suite = upf_test_suite("decode", NULL, NULL, tests);
  if (!suite)
    return;
  upf_test_add_gpu(suite, "CUDA kv.slot_mapping and compact.scatter_rows verify", test_cuda_kv_ops);
  upf_test_add_gpu(suite, "CUDA dense decoding equals recomputation", test_cuda_dense_decode);
  upf_test_add_gpu(suite, "CUDA decode after drops equals replayed recomputation", test_cuda_uniprefill_decode);
  upf_test_add_gpu(suite, "CUDA generate verify (model.generate)", test_generate_verify_cuda);
}
