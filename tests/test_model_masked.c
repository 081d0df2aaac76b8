/* Suite "model masked path": UniPrefill computed without compaction equals the compacted path. A
 * naive forward pass of the tiny configs, written here from the definitions in include/uniprefill/
 * (plain loops, double accumulators, llama2.c style; it reads the seeded weights and calls no backend
 * op and no ref_cpu function), runs over the whole step at every layer and never gathers: a drop marks
 * the tokens it discards dead, and dead tokens are masked out of every later sub-layer. Its logits are
 * checked against upf_model_prefill on the CPU backend, dense (which checks the naive pass itself) and
 * UniPrefill with the masks that run selected. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/model.h"
#include "verify/model_truth.h"
#include "verify/verify_model.h"

#define NUM_REQS 4

/* A long request, one no longer than sink + L (never scored), a decode-like row and a medium one. The
 * quick set (Valgrind) keeps two scored requests of several blocks, so both drop layers still drop. */
static const int32_t lengths_full[NUM_REQS] = {200, 14, 1, 120};
static const int32_t lengths_quick[NUM_REQS] = {48, 14, 1, 32};

static const int32_t *batch_lengths(void) { return upf_test_quick() ? lengths_quick : lengths_full; }

/* The selection of the UniPrefill runs: blocks of 8 and top-k by keep ratio (a quarter of each scored
 * request's blocks by rank, plus sink and recent tokens), so every drop layer drops a known share even
 * of the quick set's short requests; the test is about propagating masks, not about which tokens the
 * selection picks. */
static upf_select_params masked_select(const upf_model_config *cfg) {
  upf_select_params p = cfg->select;
  p.block = 8, p.sink = 8, p.last_q = 8, p.p = 1.0f, p.keep_ratio = 0.25f;
  return p;
}

/* ---- the tests ---- */

/* The conv over a compacted sequence by hand: 1 channel, K = 3, w = (0.5, -1, 2) (oldest tap first),
 * x = (1, 2, 3, 4, 5) with token 2 dropped. Over the kept order (1, 2, 4, 5) the pre-activations are
 *   t0: 2*1 = 2;  t1: -1*1 + 2*2 = 3;  t3: 0.5*1 - 1*2 + 2*4 = 6.5;  t4: 0.5*2 - 1*4 + 2*5 = 7
 * and y = silu of them. A zero mask on the contiguous sequence would give t3 = 0.5*2 - 1*0 + 2*4 = 9
 * instead: the dropped token must leave the window, not sit in it as a zero. Checked on conv_alive
 * (the masked pass) and on the backend's gdn_conv over the compacted sequence (the compacted path). */
static void test_conv_compacted_hand(void) {
  static const float w[3] = {0.5f, -1.0f, 2.0f};
  static const double x[5] = {1, 2, 3, 4, 5};
  static const uint8_t alive[5] = {1, 1, 0, 1, 1};
  static const double want[5] = {1.7615941559557646, 2.8577223804672998, 0.0, 6.490242315331209, 6.993622641639196};
  double y[5] = {0};
  upf_truth_conv_alive(x, 1, alive, 0, 5, w, 1, 3, 0, y);
  for (int t = 0; t < 5; t++)
    if (alive[t])
      CU_ASSERT_DOUBLE_EQUAL(y[t], want[t], 1e-12);
  CU_ASSERT_EQUAL(y[2], 0.0); /* a dead token's row is not written */

  const upf_backend *cpu = upf_backend_cpu();
  float xc[4] = {1, 2, 4, 5}, yc[4] = {0};
  const int32_t cu[2] = {0, 4};
  upf_tensor tx, tw, ty;
  const int64_t sx[2] = {4, 1}, sw[2] = {1, 3};
  upf_tensor_init(&tx, xc, UPF_DTYPE_F32, 2, sx);
  upf_tensor_init(&tw, (void *)w, UPF_DTYPE_F32, 2, sw);
  upf_tensor_init(&ty, yc, UPF_DTYPE_F32, 2, sx);
  const upf_gdn_batch batch = {cu, cu, 1};
  CU_ASSERT_EQUAL_FATAL(cpu->gdn_conv(&batch, &tx, &tw, NULL, NULL, &ty), UPF_OK);
  static const int kept[4] = {0, 1, 3, 4};
  for (int i = 0; i < 4; i++)
    CU_ASSERT_DOUBLE_EQUAL(yc[i], want[kept[i]], 1e-6 * want[kept[i]]);
}

/* max |a - b| and max |b| over n. */
static void max_err(const double *a, const float *b, int64_t n, double *err, double *mag) {
  *err = 0.0, *mag = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs(a[i] - (double)b[i]);
    *err = d > *err || isnan(d) ? d : *err;
    *mag = fmax(*mag, fabs((double)b[i]));
  }
}

/* The tolerance of a naive (double) logit against the f32 prefill's. Every f32 op of the prefill
 * rounds its output once (relative 2^-24 = 6e-8) and a tiny model chains about a hundred of them
 * (projections, norms, softmax, the scan, the residual adds) with per-layer gains of order 1 on
 * unit-scale activations, so the f32 logits sit within a few 1e-6 of exact. 1e-4 (1 + max |logit|)
 * leaves a wide margin over that, while a token wrongly kept or dropped at one key of one layer moves
 * the logits by ~1e-2 or more. */
static double logit_tol(double mag) { return 1e-4 * (1.0 + mag); }

/* One config, f32, on the CPU backend: the naive pass against upf_model_prefill dense (which checks
 * the naive pass), then, with the masks of a UniPrefill run, the masked pass against that run's
 * compacted logits. The masks must drop at every drop layer and move the logits far past the
 * tolerance, or agreement would say nothing; and a pass that breaks the window or conv rule where the
 * family has one must disagree, which shows the data exercises it. */
static void check_config(const char *name) {
  const upf_model_config *cfg = upf_model_config_by_name(name);
  CU_ASSERT_PTR_NOT_NULL_FATAL(cfg);
  const int32_t *len = batch_lengths();
  int32_t cu[NUM_REQS + 1] = {0};
  for (int r = 0; r < NUM_REQS; r++)
    cu[r + 1] = cu[r] + len[r];
  const int64_t n = (int64_t)NUM_REQS * cfg->vocab;
  int32_t *ids = malloc((size_t)cu[NUM_REQS] * sizeof *ids);
  double *naive = malloc((size_t)n * sizeof *naive);
  upf_model m;
  upf_prefill_result rd = {0}, ru = {0};
  const upf_prefill_options dense = {.mode = UPF_PREFILL_DENSE, .select = cfg->select};
  const upf_prefill_options uni = {.mode = UPF_PREFILL_UNIPREFILL, .select = masked_select(cfg)};
  upf_status st = ids && naive ? UPF_OK : UPF_ERR_NOMEM;
  if (st == UPF_OK) {
    upf_model_seeded_ids(3, cfg->vocab, cu[NUM_REQS], ids);
    st = upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, 0, cfg->num_layers);
  }
  if (st == UPF_OK) {
    st = upf_model_prefill(&m, ids, cu, NUM_REQS, &dense, &rd);
    if (st == UPF_OK)
      st = upf_model_prefill(&m, ids, cu, NUM_REQS, &uni, &ru);
    if (st != UPF_OK)
      upf_model_free(&m);
  }
  if (st != UPF_OK) {
    printf("\n%s: %s\n", name, upf_last_error());
    CU_FAIL("model init or prefill");
    upf_prefill_result_free(&rd), upf_prefill_result_free(&ru);
    free(ids), free(naive);
    return;
  }
  double err, mag;
  /* dense: the naive pass itself */
  CU_ASSERT(upf_model_truth(&m, ids, cu, NUM_REQS, NULL, 0, naive));
  max_err(naive, rd.logits, n, &err, &mag);
  if (!(err <= logit_tol(mag)))
    printf("\n%s dense: max |naive - prefill| = %.3g > tolerance %.3g (max |logit| %.3g)\n", name, err,
           logit_tol(mag), mag);
  CU_ASSERT(err <= logit_tol(mag));

  /* UniPrefill: masked against compacted */
  CU_ASSERT_EQUAL(ru.num_drops, cfg->num_drop_layers);
  for (int k = 0; k < ru.num_drops; k++)
    CU_ASSERT(ru.drops[k].tokens_kept < ru.drops[k].tokens_in);
  CU_ASSERT(upf_model_truth(&m, ids, cu, NUM_REQS, &ru, 0, naive));
  max_err(naive, ru.logits, n, &err, &mag);
  if (!(err <= logit_tol(mag)))
    printf("\n%s uniprefill: max |masked - compacted| = %.3g > tolerance %.3g (max |logit| %.3g)\n", name, err,
           logit_tol(mag), mag);
  CU_ASSERT(err <= logit_tol(mag));
  double moved, dmag;
  max_err(naive, rd.logits, n, &moved, &dmag);
  if (!(moved > 100 * logit_tol(mag)))
    printf("\n%s uniprefill: the drops moved the logits by only %.3g from dense\n", name, moved);
  CU_ASSERT(moved > 100 * logit_tol(mag));

  /* negative controls; not in the quick set (Valgrind), where two more passes would only rerun code
   * paths the pass under test already ran */
  int rule = 0;
  if (!upf_test_quick() && cfg->other_mixer == UPF_MIXER_SLIDING)
    rule = UPF_TRUTH_WINDOW_BY_POSITION;
  if (!upf_test_quick() && cfg->other_mixer == UPF_MIXER_GDN)
    rule = UPF_TRUTH_CONV_ZERO_HOLE;
  if (rule) {
    double wrong;
    CU_ASSERT(upf_model_truth(&m, ids, cu, NUM_REQS, &ru, rule, naive));
    max_err(naive, ru.logits, n, &wrong, &mag);
    if (!(wrong > 10 * logit_tol(mag)))
      printf("\n%s uniprefill: a pass with the %s rule broken is only %.3g from the compacted logits\n", name,
             rule == UPF_TRUTH_WINDOW_BY_POSITION ? "sliding-window" : "conv1d", wrong);
    CU_ASSERT(wrong > 10 * logit_tol(mag));
  }
  upf_prefill_result_free(&rd), upf_prefill_result_free(&ru);
  upf_model_free(&m);
  free(ids), free(naive);
}

static void test_llama(void) { check_config("llama-tiny"); }
static void test_gemma3(void) { check_config("gemma3-tiny"); }
static void test_qwen3_next(void) { check_config("qwen3-next-tiny"); }

static CU_TestInfo masked_tests[] = {
    {"conv1d over a compacted sequence, by hand", test_conv_compacted_hand},
    {"llama-tiny: naive = dense, masked = compacted", test_llama},
    {"gemma3-tiny: naive = dense, masked = compacted, window over kept keys", test_gemma3},
    {"qwen3-next-tiny: naive = dense, masked = compacted, conv over kept tokens", test_qwen3_next},
    CU_TEST_INFO_NULL,
};

void upf_register_model_masked_tests(void) { upf_test_suite("model masked path", NULL, NULL, masked_tests); }
