/* CompactAttention as a model mode (UPF_PREFILL_COMPACT, SPEC section 9) on the tiny configs, CPU: at
 * alpha 0 (every block kept) a compact chunked prefill gives the dense chunked prefill's logits (llama
 * and qwen3-next); at alpha 1 it keeps fewer blocks than visible, never fewer than the forced ones, and
 * the logits stay finite; the union tables a step hands out have the chunk's own blocks set and as
 * many entries set as the layer's record counts; and `upf prefill --mode compact` (printout, JSON,
 * --dump-tables files, the flags it refuses); the eval runs over a chunked prefill (the last positions
 * gathered across chunks through the step's tail_logits, the answer check's decode rows). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/eval.h"
#include "uniprefill/npy.h"
#include "uniprefill/session.h"

/* Small enough for Valgrind: 3 key blocks of 64 in chunks of one block, so steps 1 and 2 have 1 and 2
 * blocks of context; the models are partial (llama's layers [0, 2), qwen3-next's [2, 4): a Gated
 * DeltaNet layer and a full one with its output gate, whose strided q the compact path reads), which
 * give logits all the same. */
#define PROMPT 192
#define CHUNK 64

static cli_suite cli;

/* The selector the tests run: 64-key blocks, no sink, a one-block window, so that at alpha 1 a tile of
 * the last chunk keeps its best block, its diagonal ones and nothing else of the context it scores. */
static upf_sparse_params test_sparse(float alpha) {
  upf_sparse_params sp = upf_prefill_sparse_default();
  sp.alpha = alpha, sp.block_n = 64, sp.sink = 0, sp.window = 1, sp.last_n = 0;
  return sp;
}

/* What a step's hook saw: per full-attention layer of the last step with tables, the table's shape and
 * the entries set; and whether every chunk's own blocks were set. */
typedef struct {
  int32_t calls, num_chunks, kv_heads, key_blocks;
  int64_t set[UPF_MODEL_MAX_LAYERS];
  int own_ok;
  int32_t kv_len, q_len; /* the step's single chunk */
} table_seen;

static void on_table(void *user, int32_t layer, const uint8_t *table, int32_t num_chunks, int32_t kv_heads,
                     int32_t key_blocks) {
  table_seen *t = user;
  t->calls++, t->num_chunks = num_chunks, t->kv_heads = kv_heads, t->key_blocks = key_blocks;
  t->set[layer] = 0;
  for (int64_t i = 0; i < (int64_t)num_chunks * kv_heads * key_blocks; i++)
    t->set[layer] += table[i] != 0;
  const int32_t first = (t->kv_len - t->q_len) / 64, last = (t->kv_len - 1) / 64;
  for (int32_t h = 0; h < kv_heads; h++)
    for (int32_t b = first; b <= last; b++)
      t->own_ok &= b < key_blocks && table[(int64_t)h * key_blocks + b] == 1;
}

/* One request of PROMPT seeded tokens prefilled in chunks of CHUNK under mode; the last logits into
 * last (V); per step the records' kept and visible blocks summed into kept/visible (may be NULL), the
 * records' count into records, and (seen) the tables of each step checked. 0 on a failed step. */
static int run_chunks(const upf_model *m, upf_prefill_mode mode, const upf_sparse_params *sp, int32_t recent,
                      float *last, int64_t *kept, int64_t *visible, int32_t *records, table_seen *seen) {
  upf_session_config sc = upf_session_config_default(m);
  sc.mode = mode, sc.max_requests = 2, sc.pages_per_group = 64;
  sc.sparse = *sp, sc.compact.recent = recent;
  upf_session *s = NULL;
  int32_t ids[PROMPT], req = -1;
  upf_model_seeded_ids(5, m->cfg->vocab, PROMPT, ids);
  upf_status st = upf_session_create(m, &sc, &s);
  if (st == UPF_OK)
    st = upf_session_add_request(s, ids, PROMPT, &req);
  upf_session_step_options so;
  memset(&so, 0, sizeof so);
  if (seen)
    so.on_compact_table = on_table, so.compact_user = seen;
  for (int32_t done = 0; st == UPF_OK && done < PROMPT; done += CHUNK) {
    const upf_session_row row = {req, UPF_ROW_PREFILL, 0, CHUNK};
    if (seen)
      seen->kv_len = done + CHUNK, seen->q_len = CHUNK;
    upf_prefill_result res;
    st = upf_session_step(s, &row, 1, &so, &res);
    if (st != UPF_OK)
      break;
    memcpy(last, res.logits, sizeof(float) * (size_t)m->cfg->vocab);
    for (int32_t i = 0; i < res.num_sparse; i++) {
      if (kept)
        *kept += res.sparse[i].kept_blocks;
      if (visible)
        *visible += res.sparse[i].visible_blocks;
      if (seen && seen->set[res.sparse[i].layer] != res.sparse[i].kept_blocks)
        seen->own_ok = 0; /* one chunk with context: the record counts every set entry */
    }
    if (records)
      *records += res.num_sparse;
    upf_prefill_result_free(&res);
  }
  if (st != UPF_OK)
    printf("\n%s %s: %s\n", m->cfg->name, upf_prefill_mode_name(mode), upf_last_error());
  upf_session_free(s);
  return st == UPF_OK;
}

static int32_t full_layers(const upf_model *m) {
  int32_t n = 0;
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    n += upf_model_mixer(m->cfg, l) == UPF_MIXER_FULL;
  return n;
}

static void alpha0_equals_dense(const char *family, int32_t begin, int32_t end) {
  const upf_model_config *cfg = upf_model_config_by_name(family);
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 11, begin, end), UPF_OK);
  const int32_t V = cfg->vocab;
  float *dense = malloc(sizeof(float) * (size_t)V), *compact = malloc(sizeof(float) * (size_t)V);
  const upf_sparse_params sp = test_sparse(0.0f);
  int64_t kept = 0, visible = 0;
  int32_t records = 0, dense_records = 0;
  CU_ASSERT_FATAL(run_chunks(&m, UPF_PREFILL_DENSE, &sp, 2, dense, NULL, NULL, &dense_records, NULL));
  CU_ASSERT_FATAL(run_chunks(&m, UPF_PREFILL_COMPACT, &sp, 0, compact, &kept, &visible, &records, NULL));
  double worst = 0;
  for (int32_t v = 0; v < V; v++) {
    const double e = fabs((double)compact[v] - dense[v]) / (1e-5 + 1e-5 * fabs((double)dense[v]));
    worst = e > worst || isnan(e) ? e : worst;
  }
  if (!(worst <= 1))
    printf("\n%s: compact at alpha 0 against dense chunked: worst error share %g\n", family, worst);
  CU_ASSERT(worst <= 1);
  CU_ASSERT_EQUAL(dense_records, 0);
  /* two steps with cached context, one record per full-attention layer each; all kept */
  CU_ASSERT(full_layers(&m) > 0);
  CU_ASSERT_EQUAL(records, 2 * full_layers(&m));
  CU_ASSERT(visible > 0);
  CU_ASSERT_EQUAL(kept, visible);
  /* by hand: chunks 1 and 2 see 2 and 3 blocks of 64 per KV head */
  CU_ASSERT_EQUAL(visible, (int64_t)full_layers(&m) * cfg->kv_heads * (2 + 3));
  free(dense), free(compact);
  upf_model_free(&m);
}

static void test_alpha0_llama(void) { alpha0_equals_dense("llama-tiny", 0, 2); }
static void test_alpha0_qwen(void) { alpha0_equals_dense("qwen3-next-tiny", 2, 4); }

static void test_alpha1_sparser(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 11, 0, 2), UPF_OK);
  float *logits = malloc(sizeof(float) * (size_t)cfg->vocab);
  const upf_sparse_params sp = test_sparse(1.0f);
  int64_t kept = 0, visible = 0;
  table_seen seen;
  memset(&seen, 0, sizeof seen);
  seen.own_ok = 1;
  CU_ASSERT_FATAL(run_chunks(&m, UPF_PREFILL_COMPACT, &sp, 0, logits, &kept, &visible, NULL, &seen));
  CU_ASSERT(kept < visible);
  /* forced: the chunk's own block per KV head, per layer and step with context (2 steps) */
  CU_ASSERT(kept >= (int64_t)full_layers(&m) * cfg->kv_heads * 1 * 2);
  for (int32_t v = 0; v < cfg->vocab; v++)
    if (!isfinite(logits[v])) {
      CU_FAIL("compact at alpha 1: a logit is not finite");
      break;
    }
  /* the tables: one call per full-attention layer and step with context, (1 chunk, Hkv, 3 blocks) in
   * the last, the chunk's own block set, the records counting the set entries */
  CU_ASSERT_EQUAL(seen.calls, 2 * full_layers(&m));
  CU_ASSERT_EQUAL(seen.num_chunks, 1);
  CU_ASSERT_EQUAL(seen.kv_heads, cfg->kv_heads);
  CU_ASSERT_EQUAL(seen.key_blocks, PROMPT / 64);
  CU_ASSERT(seen.own_ok);
  free(logits);
  upf_model_free(&m);
}

/* ---- eval over a chunked prefill ---- */

/* max |got - want| / (1e-5 + 1e-5 |want|) over n values (NaN counts as failing). */
static double worst_share(const float *got, const float *want, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    const double e = fabs((double)got[i] - want[i]) / (1e-5 + 1e-5 * fabs((double)want[i]));
    worst = e > worst || isnan(e) ? e : worst;
  }
  return worst;
}

/* The last 60 positions of a 192-token prompt in chunks of 50 (50, 50, 50, 42: the positions come from the
 * last two chunks) equal the unchunked dense prefill's, position by position, in dense mode and in compact
 * mode at alpha 0; compact at alpha 1 records fewer kept blocks than visible over the steps with context;
 * a step asking more tail logits than a row holds is refused naming tail_logits; the chunked answer check
 * (prompt in chunks, answer as decode rows) finds the greedy answer the dense one finds. */
static void test_eval_chunked(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 11, 0, 2), UPF_OK);
  const int32_t V = cfg->vocab;
  const int64_t last = 60, chunk = 50;
  int32_t ids[PROMPT + 3];
  upf_model_seeded_ids(5, V, PROMPT, ids);
  float *dense = malloc(sizeof(float) * (size_t)(last * V)), *got = malloc(sizeof(float) * (size_t)(last * V));
  upf_prefill_options opt = {.mode = UPF_PREFILL_DENSE, .select = cfg->select, .sparse = test_sparse(0.0f),
                             .compact = upf_compact_params_default()};
  upf_prefill_result res;
  CU_ASSERT_EQUAL_FATAL(upf_eval_prefill_last(&m, ids, PROMPT, &opt, last, dense, &res), UPF_OK);
  upf_prefill_result_free(&res);
  int32_t steps = 0;
  CU_ASSERT_EQUAL(upf_eval_prefill_last_chunked(&m, ids, PROMPT, &opt, chunk, last, got, &res, &steps), UPF_OK);
  CU_ASSERT_EQUAL(steps, 4);
  CU_ASSERT(worst_share(got, dense, last * V) <= 1);
  CU_ASSERT(worst_share(res.logits, dense + (last - 1) * V, V) <= 1); /* the final chunk's last logits */
  CU_ASSERT_EQUAL(res.num_sparse, 0);
  upf_prefill_result_free(&res);
  opt.mode = UPF_PREFILL_COMPACT;
  CU_ASSERT_EQUAL(upf_eval_prefill_last_chunked(&m, ids, PROMPT, &opt, chunk, last, got, &res, NULL), UPF_OK);
  CU_ASSERT(worst_share(got, dense, last * V) <= 1);
  CU_ASSERT_EQUAL(res.num_sparse, full_layers(&m)); /* one record per layer, summed over the steps */
  CU_ASSERT(res.num_sparse > 0 && upf_prefill_kept_share(&res) == 1.0);
  upf_prefill_result_free(&res);
  opt.sparse = test_sparse(1.0f), opt.compact.recent = 0;
  CU_ASSERT_EQUAL(upf_eval_prefill_last_chunked(&m, ids, PROMPT, &opt, chunk, last, got, &res, NULL), UPF_OK);
  CU_ASSERT(upf_prefill_kept_share(&res) < 1.0);
  upf_prefill_result_free(&res);
  CU_ASSERT_NOT_EQUAL(upf_eval_prefill_last_chunked(&m, ids, PROMPT, &opt, chunk, PROMPT + 1, got, &res, NULL), UPF_OK);

  /* the step's own check: a chunk of 50 asked for 51 tail logits */
  upf_session_config sc = upf_session_config_default(&m);
  sc.max_requests = 1, sc.pages_per_group = 16;
  upf_session *s = NULL;
  int32_t req = -1;
  CU_ASSERT_EQUAL_FATAL(upf_session_create(&m, &sc, &s), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_add_request(s, ids, PROMPT, &req), UPF_OK);
  upf_session_step_options so;
  memset(&so, 0, sizeof so);
  so.tail_logits = 51;
  const upf_session_row row = {req, UPF_ROW_PREFILL, 0, 50};
  CU_ASSERT_EQUAL(upf_session_step(s, &row, 1, &so, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "tail_logits 51") != NULL);
  upf_session_request_info info;
  CU_ASSERT_EQUAL(upf_session_request(s, req, &info), UPF_OK);
  CU_ASSERT_EQUAL(info.prefill_done, 0); /* refused before any work */
  upf_session_free(s);

  /* the greedy answer of three tokens, by dense prefills of the prompt and what it produced */
  int32_t answer[3];
  for (int i = 0; i < 3; i++) {
    opt.mode = UPF_PREFILL_DENSE;
    CU_ASSERT_EQUAL_FATAL(upf_eval_prefill_last(&m, ids, PROMPT + i, &opt, 1, got, &res), UPF_OK);
    upf_prefill_result_free(&res);
    answer[i] = ids[PROMPT + i] = upf_eval_argmax(got, V);
  }
  upf_eval_answer a;
  CU_ASSERT_EQUAL(upf_eval_check_answer_chunked(&m, ids, PROMPT, answer, 3, &opt, chunk, &a), UPF_OK);
  CU_ASSERT(a.correct);
  CU_ASSERT_EQUAL(a.first, answer[0]);
  answer[2] = (answer[2] + 1) % V; /* one wrong token: not the greedy answer */
  CU_ASSERT_EQUAL(upf_eval_check_answer_chunked(&m, ids, PROMPT, answer, 3, &opt, chunk, &a), UPF_OK);
  CU_ASSERT_FALSE(a.correct);
  free(dense), free(got);
  upf_model_free(&m);
}

/* ---- the CLI ---- */

static void test_cli(void) {
  const char *base = "prefill --model llama-tiny --lengths 384,200 --dtype f32 --chunk 128";
  const char *json = cli_path(&cli, "c.json"), *dir = cli_path(&cli, "tables");
  char mk[512];
  snprintf(mk, sizeof mk, "mkdir -p %s", dir);
  CU_ASSERT_EQUAL_FATAL(system(mk), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --mode compact --alpha 1 --block-n 64 --window 1 --sink 0 --recent 1 --json %s "
                                "--dump-tables %s", base, json, dir), 0);
  CU_ASSERT(cli_stdout_has(&cli, "llama-tiny, compact,"));
  CU_ASSERT(cli_stdout_has(&cli, "compact (alpha 1, block_m 128, block_n 64, sink 0, window 1, last_n 0"));
  CU_ASSERT(cli_stdout_has(&cli, "recent 1): kept share"));
  CU_ASSERT(cli_stdout_has(&cli, "full layer  5: kept"));
  CU_ASSERT(cli_file_contains(json, "\"mode\": \"compact\""));
  CU_ASSERT(cli_file_contains(json, "\"compact\": {\"recent\": 1, \"selector\": {\"alpha\": 1"));
  CU_ASSERT(cli_file_contains(json, "\"compact_layers\": ["));
  CU_ASSERT(cli_file_contains(json, "\"kept_share\": "));
  CU_ASSERT(cli_file_contains(json, "{\"layer\": 0, \"kept_blocks\": "));
  /* steps 1 and 2 ran compact (step 0: first chunks, no context): step 1 holds both requests' second
   * chunks (kv 256 and 200: 4 blocks), step 2 the first request's last (kv 384: 6 blocks) */
  char path[512];
  snprintf(path, sizeof path, "%s/layer0/chunk0.npy", dir);
  CU_ASSERT(!cli_exists(path));
  const struct {
    int step;
    int64_t rows, blocks;
    int32_t kv[2], q[2];
  } want[2] = {{1, 2, 4, {256, 200}, {128, 72}}, {2, 1, 6, {384, 0}, {128, 0}}};
  for (int i = 0; i < 2; i++)
    for (int32_t l = 0; l < 6; l += 5) {
      snprintf(path, sizeof path, "%s/layer%d/chunk%d.npy", dir, l, want[i].step);
      upf_tensor t;
      const upf_status st = upf_npy_read(path, &t);
      CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
      CU_ASSERT_EQUAL(t.dtype, UPF_DTYPE_U8);
      CU_ASSERT_EQUAL(t.ndim, 3);
      if (t.ndim == 3) {
        CU_ASSERT_EQUAL(t.shape[0], want[i].rows);
        CU_ASSERT_EQUAL(t.shape[1], 2);
        CU_ASSERT_EQUAL(t.shape[2], want[i].blocks);
      }
      const uint8_t *u = t.data;
      for (int64_t r = 0; t.ndim == 3 && r < t.shape[0] && r < 2; r++)
        for (int64_t h = 0; h < t.shape[1]; h++)
          for (int32_t b = (want[i].kv[r] - want[i].q[r]) / 64; b <= (want[i].kv[r] - 1) / 64; b++)
            CU_ASSERT_EQUAL(u[(r * t.shape[1] + h) * t.shape[2] + b], 1);
      upf_tensor_free(&t);
    }
  /* refusals */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --lengths 384 --mode compact"), 2);
  CU_ASSERT(cli_stderr_has(&cli, "--chunk"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --mode compact --dump-tables %s/none", base, dir), 2);
  CU_ASSERT(cli_stderr_has(&cli, "--dump-tables"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --dump-tables %s", base, dir), 2);
  CU_ASSERT(cli_stderr_has(&cli, "needs --mode compact"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --mode flashprefill --recent 1", base), 2);
  CU_ASSERT(cli_stderr_has(&cli, "--recent needs --mode compact"));
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --model llama-tiny --text x --max-new 1 --mode compact"), 2);
  CU_ASSERT(cli_stderr_has(&cli, "--mode compact needs --chunk"));
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --mode compact"), 2);
  CU_ASSERT(cli_stderr_has(&cli, "--mode compact needs --chunk"));
}

static int suite_setup(void) { return cli_setup(&cli, "upf_compact"); }
static int suite_teardown(void) { return cli_teardown(&cli); }

void upf_register_model_compact_tests(void) {
  static CU_TestInfo tests[] = {
      {"llama: compact at alpha 0 equals dense chunked prefill", test_alpha0_llama},
      {"qwen3-next: compact at alpha 0 equals dense chunked prefill", test_alpha0_qwen},
      {"alpha 1: fewer blocks than visible, forced ones kept, finite logits, tables", test_alpha1_sparser},
      {"upf prefill --mode compact: printout, JSON, --dump-tables, refusals", test_cli},
      {"eval over a chunked prefill: tail gathered across chunks, compact, answer check", test_eval_chunked},
      CU_TEST_INFO_NULL,
  };
  /* Under Valgrind (quick) the alpha-0 equalities stay native (make test's Valgrind pass has a time budget) */
  static CU_TestInfo quick_tests[] = {
      {"alpha 1: fewer blocks than visible, forced ones kept, finite logits, tables", test_alpha1_sparser},
      {"upf prefill --mode compact: printout, JSON, --dump-tables, refusals", test_cli},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("model_compact", suite_setup, suite_teardown, upf_test_quick() ? quick_tests : tests);
}
