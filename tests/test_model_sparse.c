/* FlashPrefill V2 as a model mode on the tiny configs (CPU): alpha 0 keeps every visible key block and
 * gives dense's logits; alpha 1 over enough tokens keeps fewer and changes them, finite; the records'
 * counts against the tile geometry worked by hand; the memory plan's bytes; session steps (prefill rows
 * sparse, decode rows dense); the eval answer check; and the CLI (printout, JSON, bad flags). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/eval.h"
#include "uniprefill/session.h"
#include "verify/verify_model.h"

static const char *const tiny[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
#define NUM_TINY 3
/* Under Valgrind (quick) a test runs one family, a different one per test, so the memory check sees
 * every family's code; the native run takes all three in every test. */
#define FAMILIES_OF(test_index) (upf_test_quick() ? (test_index) % NUM_TINY : 0), \
                                (upf_test_quick() ? (test_index) % NUM_TINY + 1 : NUM_TINY)

/* A long request, a short one and a one-token row; smaller under Valgrind (where a prefill costs some
 * 70 ms a token), and there long enough for sparsity (three 64-key blocks) only where a test needs it.
 * Parameters that make sparsity possible at these lengths: 64-key blocks, 16-row tiles, no sink, a
 * one-block window, no dense tail tiles. */
static const int32_t full_lengths[] = {400, 90, 1}, quick_lengths[] = {70, 20, 1}, quick_sparse_lengths[] = {140, 20, 1};
static const int32_t *lengths = full_lengths, *sparse_lengths = full_lengths;
#define NUM_REQS 3

static upf_sparse_params small_blocks(float alpha) {
  upf_sparse_params p = upf_prefill_sparse_default();
  p.alpha = alpha, p.block_n = 64, p.block_m = 16, p.sink = 0, p.window = 1, p.last_n = 0;
  return p;
}

static upf_prefill_options options(const upf_model_config *cfg, upf_prefill_mode mode, const upf_sparse_params *sp) {
  upf_prefill_options o = {.mode = mode, .select = cfg->select};
  if (sp)
    o.sparse = *sp;
  return o;
}

static int run_lengths(const upf_model_config *cfg, upf_dtype dt, const int32_t *lens, const upf_prefill_options *o,
                       upf_prefill_result *res) {
  const upf_status st = upf_model_run_seeded(cfg, upf_backend_cpu(), dt, 7, lens, NUM_REQS, o, res);
  if (st != UPF_OK)
    printf("\n%s: %s\n", cfg->name, upf_last_error());
  CU_ASSERT_EQUAL(st, UPF_OK);
  return st == UPF_OK;
}
static int run(const upf_model_config *cfg, upf_dtype dt, const upf_prefill_options *o, upf_prefill_result *res) {
  return run_lengths(cfg, dt, lengths, o, res);
}

static int full_layers(const upf_model_config *cfg) {
  int n = 0;
  for (int32_t l = 0; l < cfg->num_layers; l++)
    n += upf_model_mixer(cfg, l) == UPF_MIXER_FULL;
  return n;
}

/* max |a - b| over max(1, max |b|): logits of two runs. */
static double rel_diff(const float *a, const float *b, int64_t n) {
  double err = 0, mag = 1;
  for (int64_t i = 0; i < n; i++) {
    err = fmax(err, fabs((double)a[i] - (double)b[i]));
    mag = fmax(mag, fabs((double)b[i]));
    if (isnan(a[i]) != isnan(b[i]))
      return INFINITY;
  }
  return err / mag;
}

static int all_finite(const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(x[i]))
      return 0;
  return 1;
}

/* Visible key blocks of a batch worked from the tile geometry: per request, per tile of block_m packed
 * rows, last_k + 1 blocks, times the KV heads (self-attention: kv_len = q_len). */
static int64_t visible_by_hand(const upf_model_config *cfg, const int32_t *lens, int n, const upf_sparse_params *p) {
  const int64_t g = cfg->q_heads / cfg->kv_heads;
  int64_t total = 0;
  for (int r = 0; r < n; r++)
    for (int64_t row0 = 0; row0 < lens[r] * g; row0 += p->block_m) {
      const int64_t row1 = row0 + p->block_m < lens[r] * g ? row0 + p->block_m : lens[r] * g;
      total += (row1 - 1) / g / p->block_n + 1; /* the last row's position's block, and those before it */
    }
  return total * cfg->kv_heads;
}

/* alpha 0 keeps every visible block (every score is >= 0 times the best): the logits are dense's up to
 * the order of the attention's sums, in f32 and bf16; one record per full-attention layer, in order,
 * with kept = visible = the hand count. */
static void test_alpha0_equals_dense(void) {
  const upf_sparse_params sp = small_blocks(0.0f);
  const int fam[2] = {FAMILIES_OF(0)};
  for (int i = fam[0]; i < fam[1]; i++)
    for (int d = 0; d < (upf_test_quick() ? 1 : 2); d++) {
      const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
      const upf_dtype dt = d ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
      const upf_prefill_options dense = options(cfg, UPF_PREFILL_DENSE, NULL);
      const upf_prefill_options flash = options(cfg, UPF_PREFILL_FLASHPREFILL, &sp);
      upf_prefill_result a, b;
      if (!run(cfg, dt, &dense, &a))
        continue;
      if (run(cfg, dt, &flash, &b)) {
        const int64_t n = (int64_t)NUM_REQS * cfg->vocab;
        CU_ASSERT_EQUAL(a.num_sparse, 0);
        CU_ASSERT_EQUAL(b.num_sparse, full_layers(cfg));
        CU_ASSERT_EQUAL(b.num_drops, 0);
        const int64_t visible = visible_by_hand(cfg, lengths, NUM_REQS, &sp);
        for (int k = 0, l = 0; k < b.num_sparse; k++, l++) {
          while (upf_model_mixer(cfg, l) != UPF_MIXER_FULL)
            l++;
          CU_ASSERT_EQUAL(b.sparse[k].layer, l);
          CU_ASSERT_EQUAL(b.sparse[k].visible_blocks, visible);
          CU_ASSERT_EQUAL(b.sparse[k].kept_blocks, visible);
          CU_ASSERT(b.sparse[k].index_seconds >= 0 && b.sparse[k].attn_seconds >= 0);
        }
        CU_ASSERT_DOUBLE_EQUAL(upf_prefill_kept_share(&b), 1.0, 0);
        /* f32: one rounding of each attention output apart; bf16: a few bf16 ulps after 6-12 layers */
        const double err = rel_diff(b.logits, a.logits, n), tol = d ? 1e-2 : 1e-5;
        if (!(err <= tol))
          printf("\n%s %s: alpha 0 vs dense: max rel diff %g\n", cfg->name, upf_dtype_name(dt), err);
        CU_ASSERT(err <= tol);
        CU_ASSERT(all_finite(b.logits, n));
        upf_prefill_result_free(&b);
      }
      upf_prefill_result_free(&a);
    }
}

/* alpha 1 keeps, per tile, the best-scoring blocks (and the diagonal window): over a few hundred tokens
 * fewer than the visible blocks, at least the forced ones (each tile's diagonal block); the logits move
 * away from dense (native run) but stay finite; the kept share is the records' sum. Mean correction on
 * changes the logits again (the unkept blocks' mean terms) and keeps the same blocks. */
static void test_alpha1_sparse(void) {
  const int fam[2] = {FAMILIES_OF(1)};
  const int32_t *lens = sparse_lengths;
  for (int i = fam[0]; i < fam[1]; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
    upf_sparse_params sp = small_blocks(1.0f);
    const upf_prefill_options dense = options(cfg, UPF_PREFILL_DENSE, NULL);
    upf_prefill_options flash = options(cfg, UPF_PREFILL_FLASHPREFILL, &sp);
    upf_prefill_result a = {0}, b, c;
    const int with_dense = !upf_test_quick(); /* under Valgrind the dense run is test_alpha0's */
    if (with_dense && !run_lengths(cfg, UPF_DTYPE_F32, lens, &dense, &a))
      continue;
    if (!run_lengths(cfg, UPF_DTYPE_F32, lens, &flash, &b)) {
      upf_prefill_result_free(&a);
      continue;
    }
    const int64_t n = (int64_t)NUM_REQS * cfg->vocab;
    /* forced: each tile's diagonal block (window 1, no sink, no dense tiles) */
    const upf_sparse_params one = {.block_m = sp.block_m, .block_n = 1 << 30};
    const int64_t forced = visible_by_hand(cfg, lens, NUM_REQS, &one);
    int64_t kept = 0, visible = 0;
    CU_ASSERT_EQUAL(b.num_sparse, full_layers(cfg));
    for (int k = 0; k < b.num_sparse; k++) {
      const upf_sparse_record *r = &b.sparse[k];
      CU_ASSERT_EQUAL(r->visible_blocks, visible_by_hand(cfg, lens, NUM_REQS, &sp));
      CU_ASSERT(r->kept_blocks >= forced);
      CU_ASSERT(r->kept_blocks < r->visible_blocks);
      kept += r->kept_blocks, visible += r->visible_blocks;
    }
    const double share = upf_prefill_kept_share(&b);
    CU_ASSERT(share > 0.0 && share < 1.0);
    CU_ASSERT_DOUBLE_EQUAL(share, (double)kept / (double)visible, 1e-12);
    CU_ASSERT(all_finite(b.logits, n));
    if (with_dense)
      CU_ASSERT(rel_diff(b.logits, a.logits, n) > 1e-4);
    sp.mean_correction = 1;
    flash.sparse = sp;
    if (run_lengths(cfg, UPF_DTYPE_F32, lens, &flash, &c)) {
      CU_ASSERT(all_finite(c.logits, n));
      CU_ASSERT(rel_diff(c.logits, b.logits, n) > 1e-6);
      for (int k = 0; k < c.num_sparse && k < b.num_sparse; k++)
        CU_ASSERT_EQUAL(c.sparse[k].kept_blocks, b.sparse[k].kept_blocks);
      upf_prefill_result_free(&c);
    }
    upf_prefill_result_free(&b);
    upf_prefill_result_free(&a);
  }
}

/* The plan's bytes worked by hand; refused parameters fail naming themselves, before any work. */
static void test_memory_plan_and_bad_params(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 0, cfg->num_layers), UPF_OK);
  const int32_t cu[3] = {0, 300, 400};
  upf_sparse_params sp = small_blocks(0.5f);
  upf_prefill_options o = options(cfg, UPF_PREFILL_FLASHPREFILL, &sp);
  upf_memory_plan plan;
  CU_ASSERT_EQUAL(upf_model_memory_plan_batch(&m, cu, 2, &o, &plan), UPF_OK);
  /* B 2, ceil(300/64) = 5 blocks, Hkv 2, D 32, f32: means 2560 bytes; tiles ceil(600/16) + ceil(200/16) =
   * 38 + 13, S = 102 segments: row_ptr 103 * 4, blocks 102 * 5 * 4 */
  CU_ASSERT_DOUBLE_EQUAL(plan.sparse, 2560 + 412 + 2040, 0);
  sp.mean_correction = 1, o.sparse = sp;
  CU_ASSERT_EQUAL(upf_model_memory_plan_batch(&m, cu, 2, &o, &plan), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(plan.sparse, 2 * 2560 + 412 + 2040, 0);
  o.mode = UPF_PREFILL_DENSE;
  CU_ASSERT_EQUAL(upf_model_memory_plan_batch(&m, cu, 2, &o, &plan), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(plan.sparse, 0, 0);

  const int32_t ids[4] = {1, 2, 3, 4}, cu1[2] = {0, 4};
  upf_prefill_result res;
  o = options(cfg, UPF_PREFILL_FLASHPREFILL, &sp);
  o.sparse.alpha = 2.0f;
  CU_ASSERT_EQUAL(upf_model_prefill(&m, ids, cu1, 1, &o, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "alpha=2"));
  o.sparse = sp, o.sparse.block_n = 32;
  CU_ASSERT_EQUAL(upf_model_prefill(&m, ids, cu1, 1, &o, &res), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "block_n=32"));
  /* options left zero (no parameters given) are refused, not run with a block of 0 keys */
  const upf_prefill_options zero = {.mode = UPF_PREFILL_FLASHPREFILL, .select = cfg->select};
  CU_ASSERT_EQUAL(upf_model_prefill(&m, ids, cu1, 1, &zero, &res), UPF_ERR_INVALID_ARG);
  upf_model_free(&m);
}

/* A session in FlashPrefill mode: the prefill step gives the plain FlashPrefill prefill's logits and
 * records; a step of decode rows only runs dense (no record); a step mixing a decode row with a new
 * prefill row records the prefill row's blocks alone and gives that row the logits of its own prefill.
 * At alpha 0 the decode rows' tokens are dense's. */
static void test_session_steps(void) {
  const upf_model_config *cfg = upf_model_config_by_name(tiny[upf_test_quick() ? 2 : 1]);
  const upf_sparse_params sp = small_blocks(1.0f);
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 5, 0, cfg->num_layers), UPF_OK);
  const int32_t la = lengths[0], lb = lengths[1];
  int32_t *ids = malloc((size_t)(la + lb) * sizeof *ids);
  upf_model_seeded_ids(9, cfg->vocab, la + lb, ids);
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = UPF_PREFILL_FLASHPREFILL, sc.sparse = sp;
  upf_session *s = NULL;
  CU_ASSERT_EQUAL_FATAL(upf_session_create(&m, &sc, &s), UPF_OK);
  int32_t ra, rb;
  CU_ASSERT_EQUAL(upf_session_add_request(s, ids, la, &ra), UPF_OK);
  CU_ASSERT_EQUAL(upf_session_add_request(s, ids + la, lb, &rb), UPF_OK);
  const upf_prefill_options flash = options(cfg, UPF_PREFILL_FLASHPREFILL, &sp);
  upf_prefill_result step, alone;
  const int32_t V = cfg->vocab;

  upf_session_row rows[2] = {{ra, UPF_ROW_PREFILL, 0}};
  CU_ASSERT_EQUAL_FATAL(upf_session_step(s, rows, 1, NULL, &step), UPF_OK);
  const int32_t cua[2] = {0, la};
  CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&m, ids, cua, 1, &flash, &alone), UPF_OK);
  CU_ASSERT_EQUAL(step.num_sparse, full_layers(cfg));
  for (int k = 0; k < step.num_sparse; k++)
    CU_ASSERT_EQUAL(step.sparse[k].kept_blocks, alone.sparse[k].kept_blocks);
  CU_ASSERT(rel_diff(step.logits, alone.logits, V) <= 1e-5);
  const int32_t next = upf_eval_argmax(step.logits, V);
  upf_prefill_result_free(&step), upf_prefill_result_free(&alone);

  rows[0] = (upf_session_row){ra, UPF_ROW_DECODE, next};
  CU_ASSERT_EQUAL_FATAL(upf_session_step(s, rows, 1, NULL, &step), UPF_OK);
  CU_ASSERT_EQUAL(step.num_sparse, 0);
  CU_ASSERT(all_finite(step.logits, V));
  const int32_t next2 = upf_eval_argmax(step.logits, V);
  upf_prefill_result_free(&step);

  rows[0] = (upf_session_row){rb, UPF_ROW_PREFILL, 0}, rows[1] = (upf_session_row){ra, UPF_ROW_DECODE, next2};
  CU_ASSERT_EQUAL_FATAL(upf_session_step(s, rows, 2, NULL, &step), UPF_OK);
  const int32_t cub[2] = {0, lb};
  CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&m, ids + la, cub, 1, &flash, &alone), UPF_OK);
  CU_ASSERT_EQUAL(step.num_sparse, full_layers(cfg));
  for (int k = 0; k < step.num_sparse; k++) {
    CU_ASSERT_EQUAL(step.sparse[k].visible_blocks, visible_by_hand(cfg, &lb, 1, &sp));
    CU_ASSERT_EQUAL(step.sparse[k].kept_blocks, alone.sparse[k].kept_blocks);
  }
  CU_ASSERT(rel_diff(step.logits, alone.logits, V) <= 1e-5);
  upf_prefill_result_free(&step), upf_prefill_result_free(&alone);
  upf_session_free(s);
  free(ids);
  upf_model_free(&m);
}

/* The answer check in FlashPrefill mode at alpha 0 agrees with dense's (the same argmax at every answer
 * position, so the same verdict), with a kept share of 1 and prompt_first = first (one run). Natively
 * the answer is dense's greedy continuation (so both are right) and alpha 1 keeps a share below 1. */
static void test_eval_answer(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m;
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 3, 0, cfg->num_layers), UPF_OK);
  const int quick = upf_test_quick();
  const int64_t P = quick ? 60 : 300;
  int32_t *ids = malloc((size_t)(P + 3) * sizeof *ids);
  upf_model_seeded_ids(4, cfg->vocab, P, ids);
  int32_t answer[3] = {1, 2, 3};
  const upf_prefill_options o = options(cfg, UPF_PREFILL_DENSE, NULL);
  for (int i = 0; !quick && i < 3; i++) { /* dense greedy decoding, one prefill a token */
    const int32_t cu[2] = {0, (int32_t)(P + i)};
    upf_prefill_result r;
    CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&m, ids, cu, 1, &o, &r), UPF_OK);
    answer[i] = ids[P + i] = upf_eval_argmax(r.logits, cfg->vocab);
    upf_prefill_result_free(&r);
  }
  upf_eval_answer dense, flash;
  CU_ASSERT_EQUAL(upf_eval_check_answer(&m, ids, P, answer, 3, NULL, &dense), UPF_OK);
  CU_ASSERT(quick || dense.correct);
  const upf_sparse_params sp = small_blocks(0.0f);
  CU_ASSERT_EQUAL(upf_eval_check_answer_sparse(&m, ids, P, answer, 3, &sp, &flash), UPF_OK);
  CU_ASSERT_EQUAL(flash.correct, dense.correct);
  CU_ASSERT_EQUAL(flash.first, dense.first);
  CU_ASSERT_EQUAL(flash.prompt_first, flash.first);
  CU_ASSERT_EQUAL(flash.num_sparse, full_layers(cfg));
  CU_ASSERT_DOUBLE_EQUAL(flash.kept_share, 1.0, 0);
  const upf_sparse_params sparse1 = small_blocks(1.0f);
  if (!quick) {
    CU_ASSERT_EQUAL(upf_eval_check_answer_sparse(&m, ids, P, answer, 3, &sparse1, &flash), UPF_OK);
    CU_ASSERT(flash.kept_share > 0 && flash.kept_share < 1);
  }
  CU_ASSERT_EQUAL(upf_eval_check_answer_sparse(&m, ids, P, answer, 3, NULL, &flash), UPF_ERR_INVALID_ARG);
  free(ids);
  upf_model_free(&m);
}

/* ---- the CLI ---- */

static cli_suite cli;
static int cli_up(void) { return cli_setup(&cli, "upf_model_sparse"); }
static int cli_down(void) { return cli_teardown(&cli); }

static void test_cli_prefill(void) {
  const char *json = cli_path(&cli, "fp.json");
  const int L = upf_test_quick() ? 260 : 400;
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --dtype f32 --lengths %d,50 "
                                      "--mode flashprefill --alpha 1 --block-n 64 --sink 0 --window 1 --last-n 0 "
                                      "--json %s", L, json), 0);
  CLI_ASSERT_STDOUT(&cli, "llama-tiny, flashprefill, f32 on cpu: 2 requests");
  CLI_ASSERT_STDOUT(&cli, "flashprefill (alpha 1, block_m 128, block_n 64, sink 0, window 1, last_n 0, mean "
                          "correction off): kept share 0.");
  CLI_ASSERT_STDOUT(&cli, "full layer  5: kept ");
  CLI_ASSERT_STDERR(&cli, "FlashPrefill block means + index");
  CU_ASSERT(cli_file_contains(json, "\"mode\": \"flashprefill\""));
  CU_ASSERT(cli_file_contains(json, "\"flashprefill\": {\"alpha\": 1, \"block_m\": 128, \"block_n\": 64"));
  CU_ASSERT(cli_file_contains(json, "\"kept_share\": 0."));
  CU_ASSERT(cli_file_contains(json, "\"sparse_layers\": ["));
  CU_ASSERT(cli_file_contains(json, "{\"layer\": 5, \"kept_blocks\": "));
  CU_ASSERT(cli_file_contains(json, "\"index_ms\": "));
  CU_ASSERT(cli_file_contains(json, "\"ttft_ms\": {\"median\": ")); /* the existing keys stay */
  /* --index-sharing at alpha 0 (every visible block kept): a tile keeps its predecessor's blocks and the new
   * ones, so per KV head (2) the counts are sums of the visible counts v_m = (min(64 (m + 1), L) - 1) / 64 + 1
   * (block_m 128 packed rows of g 2 = 64 positions, block_n 64): total sum of v_m, shared sum of v_{m-1}, m >= 1 */
  const char *sj = cli_path(&cli, "share.json");
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --dtype f32 --lengths %d --mode "
                                      "flashprefill --alpha 0 --block-n 64 --sink 0 --window 1 --last-n 0 "
                                      "--index-sharing --json %s", L, sj), 0);
  long long total = 0, shared = 0;
  for (int m = 1; 64 * m < L; m++) {
    const int end = 64 * (m + 1) < L ? 64 * (m + 1) : L;
    total += 2 * ((end - 1) / 64 + 1), shared += 2 * ((64 * m - 1) / 64 + 1);
  }
  char want[128];
  snprintf(want, sizeof want, "\"neighbour_blocks\": %lld, \"neighbour_shared\": %lld}", total, shared);
  CU_ASSERT(cli_file_contains(sj, want));
  snprintf(want, sizeof want, "shared with the previous query tile: %lld of %lld kept blocks", shared, total);
  CLI_ASSERT_STDOUT(&cli, want);
  /* without the flag the keys are absent; the flag needs flashprefill on one rank, unchunked */
  CU_ASSERT_FALSE(cli_file_contains(json, "neighbour_blocks"));
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 64 --index-sharing"), 2);
  CLI_ASSERT_STDERR(&cli, "--index-sharing needs --mode flashprefill on one rank, without --chunk");
  /* the defaults: alpha 0.18 at block_n 128, mean correction off */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model gemma3-tiny --backend cpu --lengths 64 --mode flashprefill"), 0);
  CLI_ASSERT_STDOUT(&cli, "flashprefill (alpha 0.18, block_m 128, block_n 128, sink 2, window 4, last_n 2, mean "
                          "correction off): kept share 1.0000 of the visible key blocks over 3 full-attention layers");
  /* every position reaches the head: --out-argmax works */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --backend cpu --lengths 40 --mode flashprefill "
                                "--mean-correction on --out-argmax %s", cli_path(&cli, "a.npy")), 0);
  CU_ASSERT(cli_exists(cli_path(&cli, "a.npy")));
}

static void expect_failure(const char *cmd, const char *flags, const char *needle) {
  const char *json = cli_path(&cli, "bad.json");
  CU_ASSERT_EQUAL(cli_run(&cli, "%s --model llama-tiny --backend cpu %s --json %s", cmd, flags, json), 2);
  CLI_ASSERT_STDERR(&cli, needle);
  CU_ASSERT_FALSE(cli_exists(json));
}

static void test_cli_bad_flags(void) {
  static const char *const cmds[] = {"prefill --lengths 8", "generate --token-ids NONE --max-new 2", "serve-sim"};
  for (int i = 0; i < 3; i++) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s", cmds[i]);
    if (i == 1) { /* generate reads its ids before the flags are checked: a real file */
      const int32_t v[4] = {1, 2, 3, 4};
      CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "ids.npy"), v, 4));
      snprintf(cmd, sizeof cmd, "generate --token-ids %s --max-new 2", cli_path(&cli, "ids.npy"));
    }
    expect_failure(cmd, "--mode flashprefill --alpha 2", "--alpha 2: want a value in [0, 1]");
    expect_failure(cmd, "--mode flashprefill --alpha -0.5", "--alpha -0.5");
    expect_failure(cmd, "--mode flashprefill --mean-correction maybe", "--mean-correction 'maybe': want on or off");
    expect_failure(cmd, "--mode flashprefill --block-n 32", "--block-n 32: want 64 or 128");
    expect_failure(cmd, "--mode flashprefill --window 0", "--window 0: want >= 1");
    expect_failure(cmd, "--mode flashprefill --sink -1", "--sink -1: want >= 0");
    expect_failure(cmd, "--mode flashprefill --p 0.9", "--p and --keep need --mode uniprefill");
    expect_failure(cmd, "--alpha 0.5", "--alpha needs --mode flashprefill");
    expect_failure(cmd, "--mode uniprefill --mean-correction on", "--mean-correction needs --mode flashprefill");
    expect_failure(cmd, "--mode sparse", "--mode 'sparse': want dense, uniprefill or flashprefill");
  }
  expect_failure("prefill --lengths 8", "--mode flashprefill --ideal", "need --mode uniprefill");
  expect_failure("eval --task next-token", "--mode flashprefill --alpha 0.5,2", "--alpha 2: want a value in [0, 1]");
  expect_failure("eval --task next-token", "--mode flashprefill --p 0.9", "--p and --keep go with --mode uniprefill");
  expect_failure("eval --task next-token", "--alpha 0.5", "--alpha needs --mode flashprefill");
  expect_failure("eval --task next-token", "--mode flashprefill --block-n 100", "--block-n 100");
}

/* eval next-token at alpha 0 (every block kept) agrees with dense everywhere, and at alpha 1 keeps a
 * share below 1, both in the JSON; --last is not bounded by the UniPrefill observation window. */
static void test_cli_eval(void) {
  const char *json = cli_path(&cli, "ev.json");
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "eval --model llama-tiny --backend cpu --dtype f32 --task next-token --tokens %d "
                                      "--windows 1 --last 20 --mode flashprefill --alpha 0,1 --block-n 64 --sink 0 "
                                      "--window 1 --last-n 0 --json %s", upf_test_quick() ? 200 : 300, json), 0);
  CLI_ASSERT_STDOUT(&cli, "alpha 0: top-1 agreement 100.00% (20/20)");
  CLI_ASSERT_STDOUT(&cli, "kept share of the key blocks 1.0000, per full-attention layer: 1.000");
  CLI_ASSERT_STDOUT(&cli, "alpha 1: top-1 agreement");
  CU_ASSERT(cli_file_contains(json, "\"mode\": \"flashprefill\""));
  CU_ASSERT(cli_file_contains(json, "{\"alpha\": 0, \"positions\": 20, \"agree\": 20"));
  CU_ASSERT(cli_file_contains(json, "\"kept_share\": 1.000000, \"sparse_layers\": [0, 1, 2, 3, 4, 5]"));
  CU_ASSERT(cli_file_contains(json, "{\"alpha\": 1, "));
}

/* generate and serve-sim run their prefill steps in FlashPrefill mode and report the kept share. */
static void test_cli_generate_serve(void) {
  const int32_t n = upf_test_quick() ? 200 : 300;
  int32_t *v = malloc((size_t)n * sizeof *v);
  for (int32_t i = 0; i < n; i++)
    v[i] = (i * 37 + 11) % 512;
  CU_ASSERT_FATAL(cli_write_i32(cli_path(&cli, "prompt.npy"), v, n));
  free(v);
  const char *json = cli_path(&cli, "gen.json");
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --model llama-tiny --backend cpu --token-ids %s --max-new 3 --mode "
                                "flashprefill --alpha 1 --block-n 64 --sink 0 --window 1 --last-n 0 --json %s",
                          cli_path(&cli, "prompt.npy"), json), 0);
  CLI_ASSERT_STDOUT(&cli, "llama-tiny, flashprefill, bf16 on cpu");
  CLI_ASSERT_STDOUT(&cli, "the prefill kept share 0.");
  CU_ASSERT(cli_file_contains(json, "\"kept_share\": 0."));
  CU_ASSERT(cli_file_contains(json, "\"sparse_layers\": [{\"layer\": 0, "));
  json = cli_path(&cli, "serve.json");
  CU_ASSERT_EQUAL(cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --requests 2 --prompt-len %d --decode-len "
                                "2 --mode flashprefill --alpha 1 --block-n 64 --sink 0 --window 1 --last-n 0 --json %s",
                          upf_test_quick() ? 150 : 250, json), 0);
  CLI_ASSERT_STDOUT(&cli, "llama-tiny flashprefill on cpu: 2 requests");
  CLI_ASSERT_STDOUT(&cli, "flashprefill: kept share 0.");
  CU_ASSERT(cli_file_contains(json, "\"sparse\": {\"kept_blocks\": "));
  CU_ASSERT(cli_file_contains(json, "\"flashprefill\": {\"alpha\": 1, "));
}

static CU_TestInfo model_sparse_tests[] = {
    {"alpha 0 equals dense, every visible block kept", test_alpha0_equals_dense},
    {"alpha 1 keeps fewer blocks, finite logits", test_alpha1_sparse},
    {"memory plan and refused parameters", test_memory_plan_and_bad_params},
    {"session steps: prefill rows sparse, decode rows dense", test_session_steps},
    {"eval answer check", test_eval_answer},
    {"upf prefill --mode flashprefill", test_cli_prefill},
    {"bad flags name themselves", test_cli_bad_flags},
    {"upf eval --mode flashprefill", test_cli_eval},
    {"upf generate and serve-sim --mode flashprefill", test_cli_generate_serve},
    CU_TEST_INFO_NULL,
};

/* Under Valgrind (quick) the alpha-0, session and eval-answer tests stay native (make test's Valgrind
 * pass has a time budget): alpha 1 runs the same layer code, the chunked suite the session's sparse path. */
static CU_TestInfo model_sparse_quick_tests[] = {
    {"alpha 1 keeps fewer blocks, finite logits", test_alpha1_sparse},
    {"memory plan and refused parameters", test_memory_plan_and_bad_params},
    {"upf prefill --mode flashprefill", test_cli_prefill},
    {"bad flags name themselves", test_cli_bad_flags},
    {"upf eval --mode flashprefill", test_cli_eval},
    {"upf generate and serve-sim --mode flashprefill", test_cli_generate_serve},
    CU_TEST_INFO_NULL,
};

void upf_register_model_sparse_tests(void) {
  if (upf_test_quick())
    lengths = quick_lengths, sparse_lengths = quick_sparse_lengths;
  upf_test_suite("model_sparse", cli_up, cli_down, upf_test_quick() ? model_sparse_quick_tests : model_sparse_tests);
}
