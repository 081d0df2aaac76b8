/* The accuracy metrics of upf eval on hand-computed cases (KL, NLL, perplexity, argmax ties,
 * agreement, the greedy answer check), the windows of a text, the needle prompt builder (the fact at
 * the requested depth, at sentence breaks), the mask extension, and on a tiny seeded model: a prefill
 * of prompt + answer replaying the prompt's masks extended with ones reproduces the prompt run's
 * logits at the prompt's last position. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/eval.h"

static void test_metrics_by_hand(void) {
  /* P = (1/2, 1/2), Q = (3/4, 1/4): KL = 1/2 log(2/3) + 1/2 log 2 = 1/2 log(4/3) */
  const float p[2] = {0.0f, 0.0f}, q[2] = {(float)log(3.0), 0.0f}, q_shift[2] = {(float)log(3.0) + 5.0f, 5.0f};
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_kl(p, q, 2), 0.5 * log(4.0 / 3.0), 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_kl(p, q_shift, 2), 0.5 * log(4.0 / 3.0), 1e-6);
  /* KL(Q || P) = 3/4 log(3/2) + 1/4 log(1/2): not symmetric */
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_kl(q, p, 2), 0.75 * log(1.5) + 0.25 * log(0.5), 1e-7);
  CU_ASSERT_EQUAL(upf_eval_kl(q, q, 2), 0.0);
  /* a row with one huge logit: no overflow, the softmax is one-hot */
  const float big[3] = {1000.0f, 0.0f, 0.0f}, flat[3] = {0.0f, 0.0f, 0.0f};
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_kl(big, flat, 3), log(3.0), 1e-9);

  const float four[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_nll(four, 4, 2), log(4.0), 1e-12);
  const float skew[3] = {2.0f, 0.0f, -1.0f}; /* -log(e^0 / (e^2 + 1 + e^-1)) */
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_nll(skew, 3, 1), log(exp(2.0) + 1.0 + exp(-1.0)), 1e-12);

  const double nll[2] = {log(2.0), log(8.0)};
  CU_ASSERT_DOUBLE_EQUAL(upf_eval_ppl(nll, 2), 4.0, 1e-12);

  const float ties[4] = {1.0f, 3.0f, 3.0f, 2.0f};
  CU_ASSERT_EQUAL(upf_eval_argmax(ties, 4), 1);
  const float last[3] = {-1.0f, -2.0f, 0.5f};
  CU_ASSERT_EQUAL(upf_eval_argmax(last, 3), 2);
}

static void test_agreement(void) {
  /* row 0: same argmax (0), KL(P || Q) of the case above with the logits swapped; row 1: argmax 0 vs 1 */
  const float ref[4] = {(float)log(3.0), 0.0f, 1.0f, 0.0f};
  const float app[4] = {0.0f, -1.0f, 0.0f, 1.0f};
  upf_eval_agreement acc = {0};
  CU_ASSERT_EQUAL(upf_eval_agreement_add(&acc, ref, app, 2, 2), UPF_OK);
  CU_ASSERT_EQUAL(acc.positions, 2);
  CU_ASSERT_EQUAL(acc.agree, 1);
  /* row 0: P = (3/4, 1/4), Q = softmax(0, -1) = (e/(e+1), 1/(e+1)); row 1: P = softmax(1, 0), Q = softmax(0, 1) */
  const double e = exp(1.0), q0 = e / (e + 1.0), p1 = e / (e + 1.0);
  const double kl0 = 0.75 * log(0.75 / q0) + 0.25 * log(0.25 / (1.0 - q0));
  const double kl1 = p1 * log(p1 / (1.0 - p1)) + (1.0 - p1) * log((1.0 - p1) / p1);
  CU_ASSERT_DOUBLE_EQUAL(acc.kl_sum, kl0 + kl1, 1e-7);
  CU_ASSERT_DOUBLE_EQUAL(acc.kl_max, kl1 > kl0 ? kl1 : kl0, 1e-7);
  /* accumulates over calls */
  CU_ASSERT_EQUAL(upf_eval_agreement_add(&acc, ref, ref, 2, 2), UPF_OK);
  CU_ASSERT_EQUAL(acc.positions, 4);
  CU_ASSERT_EQUAL(acc.agree, 3);
  CU_ASSERT_DOUBLE_EQUAL(acc.kl_sum, kl0 + kl1, 1e-7);
  float bad[4] = {0.0f, 1.0f, NAN, 0.0f};
  CU_ASSERT_EQUAL(upf_eval_agreement_add(&acc, ref, bad, 2, 2), UPF_ERR_NONFINITE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "row 1"));
}

static void test_answer_check(void) {
  const int32_t answer[3] = {5, 6, 7}, good[3] = {5, 6, 7}, late[3] = {5, 6, 8}, early[3] = {4, 6, 7};
  CU_ASSERT_TRUE(upf_eval_answer_correct(good, answer, 3));
  CU_ASSERT_FALSE(upf_eval_answer_correct(late, answer, 3));
  CU_ASSERT_FALSE(upf_eval_answer_correct(early, answer, 3));
  CU_ASSERT_FALSE(upf_eval_answer_correct(good, answer, 0)); /* an empty answer is never "produced" */
}

static void test_windows(void) {
  int64_t s[4];
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 400, 3, 128, s), UPF_OK);
  CU_ASSERT_EQUAL(s[0], 0);
  CU_ASSERT_EQUAL(s[1], 300);
  CU_ASSERT_EQUAL(s[2], 600);
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 1000, 1, 128, s), UPF_OK);
  CU_ASSERT_EQUAL(s[0], 0);
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 400, 1, 128, s), UPF_OK); /* one window: the start of the text */
  CU_ASSERT_EQUAL(s[0], 0);
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 401, 4, 199, s), UPF_OK); /* span 599: 0, 200, 399, 599 */
  CU_ASSERT_EQUAL(s[1], 200);
  CU_ASSERT_EQUAL(s[2], 399);
  CU_ASSERT_EQUAL(s[3], 599);
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 400, 3, 301, s), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "at most 2 fit"));
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 1001, 1, 0, s), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "longer than the text"));
  CU_ASSERT_EQUAL(upf_eval_windows(1000, 0, 1, 0, s), UPF_ERR_INVALID_ARG);
}

static void test_needle_builder(void) {
  int32_t filler[100], ids[64];
  for (int i = 0; i < 100; i++)
    filler[i] = 100 + i;
  const int32_t head[1] = {1}, fact[2] = {7, 8}, question[1] = {9};
  upf_needle_parts parts = {head, 1, filler, 100, NULL, 0, fact, 2, question, 1};
  int64_t at = -1;
  /* 54 tokens: F = 50 filler tokens, depth 0.5 puts the fact after 25 of them */
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, 0.5, ids, &at), UPF_OK);
  CU_ASSERT_EQUAL(at, 26);
  CU_ASSERT_EQUAL(ids[0], 1);
  CU_ASSERT_EQUAL(ids[1], 100);
  CU_ASSERT_EQUAL(ids[25], 124);
  CU_ASSERT_EQUAL(ids[26], 7);
  CU_ASSERT_EQUAL(ids[27], 8);
  CU_ASSERT_EQUAL(ids[28], 125); /* the filler goes on where it stopped */
  CU_ASSERT_EQUAL(ids[52], 149);
  CU_ASSERT_EQUAL(ids[53], 9);
  for (int d = 0; d <= 10; d++) { /* every depth: the fact at head + round(depth * F) */
    CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, d / 10.0, ids, &at), UPF_OK);
    CU_ASSERT_EQUAL(at, 1 + (int64_t)floor(d * 5.0 + 0.5));
    CU_ASSERT_EQUAL(ids[at], 7);
    CU_ASSERT_EQUAL(ids[53], 9);
  }
  /* sentence breaks: depth 0.5 of 50 = 25 -> the nearest break, 22; a tie (20 / 30) goes to the lower */
  const int64_t breaks[4] = {0, 10, 22, 40}, tie[2] = {20, 30}, late[1] = {60};
  parts.breaks = breaks, parts.num_breaks = 4;
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, 0.5, ids, &at), UPF_OK);
  CU_ASSERT_EQUAL(at, 23);
  CU_ASSERT_EQUAL(ids[22], 121);
  CU_ASSERT_EQUAL(ids[23], 7);
  CU_ASSERT_EQUAL(ids[25], 122);
  parts.breaks = tie, parts.num_breaks = 2;
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, 0.5, ids, &at), UPF_OK);
  CU_ASSERT_EQUAL(at, 21);
  parts.breaks = late, parts.num_breaks = 1; /* beyond the filler that fits */
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, 0.5, ids, &at), UPF_ERR_INVALID_ARG);
  parts.breaks = NULL, parts.num_breaks = 0;
  /* too short for the fixed pieces; more filler than the text has; a depth outside [0, 1] */
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 3, 0.5, ids, &at), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "cannot hold"));
  int32_t *long_ids = malloc(200 * sizeof *long_ids);
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 105, 0.5, long_ids, &at), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "101 filler tokens"));
  free(long_ids);
  CU_ASSERT_EQUAL(upf_needle_build(&parts, 54, 1.5, ids, &at), UPF_ERR_INVALID_ARG);
}

static void test_extend_masks(void) {
  uint8_t m0[6] = {1, 0, 1, 1, 0, 1}, m1[4] = {1, 1, 0, 1};
  int32_t kept0 = 4, kept1 = 3;
  upf_prefill_result res;
  memset(&res, 0, sizeof res);
  res.num_reqs = 1, res.num_drops = 2;
  res.drops[0] = (upf_drop_record){.layer = 2, .tokens_in = 6, .tokens_kept = 4, .kept_per_req = &kept0, .mask = m0};
  res.drops[1] = (upf_drop_record){.layer = 5, .tokens_in = 4, .tokens_kept = 3, .kept_per_req = &kept1, .mask = m1};
  uint8_t *masks[2] = {0};
  int64_t lens[2];
  CU_ASSERT_EQUAL(upf_eval_extend_masks(&res, 3, masks, lens), UPF_OK);
  CU_ASSERT_EQUAL(lens[0], 9);
  CU_ASSERT_EQUAL(lens[1], 7);
  const uint8_t want0[9] = {1, 0, 1, 1, 0, 1, 1, 1, 1}, want1[7] = {1, 1, 0, 1, 1, 1, 1};
  CU_ASSERT_EQUAL(memcmp(masks[0], want0, 9), 0);
  CU_ASSERT_EQUAL(memcmp(masks[1], want1, 7), 0);
  free(masks[0]), free(masks[1]);
  double r[2];
  upf_eval_keep_ratios(&res, 6, r);
  CU_ASSERT_DOUBLE_EQUAL(r[0], 4.0 / 6.0, 1e-15);
  CU_ASSERT_DOUBLE_EQUAL(r[1], 3.0 / 6.0, 1e-15);
  res.num_reqs = 2;
  CU_ASSERT_EQUAL(upf_eval_extend_masks(&res, 3, masks, lens), UPF_ERR_INVALID_ARG);
}


/* A tiny seeded model (f32): the masks of a UniPrefill prefill of a prompt, extended with a kept entry per
 * appended token and replayed over prompt + answer, reproduce the prompt run at the prompt's last
 * position (the same logits within rounding: only the batch is longer) and keep the appended tokens at
 * every drop layer. The dense answer check agrees with a decode loop of whole prefills. */
static void test_replay_extension(void) {
  const char *names[2] = {"llama-tiny", "gemma3-tiny"};
  const int nmodels = upf_test_quick() ? 1 : 2;
  const int64_t P = upf_test_quick() ? 72 : 200, A = 4;
  for (int i = 0; i < nmodels; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(names[i]);
    upf_model m;
    CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 5, 0, cfg->num_layers), UPF_OK);
    const int32_t V = cfg->vocab;
    int32_t *ids = malloc((size_t)(P + A) * sizeof *ids);
    float *first = malloc((size_t)V * sizeof *first), *rows = malloc((size_t)(A + 1) * V * sizeof *rows);
    upf_model_seeded_ids(9, V, P + A, ids);
    upf_prefill_options opt = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select};
    opt.select.p = 0.5f;
    upf_prefill_result a, b;
    CU_ASSERT_EQUAL_FATAL(upf_eval_prefill_last(&m, ids, P, &opt, 1, first, &a), UPF_OK);
    CU_ASSERT_EQUAL(a.num_drops, cfg->num_drop_layers);
    uint8_t *masks[UPF_MODEL_MAX_LAYERS] = {0};
    int64_t lens[UPF_MODEL_MAX_LAYERS];
    CU_ASSERT_EQUAL_FATAL(upf_eval_extend_masks(&a, A, masks, lens), UPF_OK);
    opt.replay_masks = (const uint8_t *const *)masks, opt.replay_mask_len = lens;
    CU_ASSERT_EQUAL_FATAL(upf_eval_prefill_last(&m, ids, P + A, &opt, A + 1, rows, &b), UPF_OK);
    CU_ASSERT_EQUAL(b.num_drops, a.num_drops);
    CU_ASSERT(a.num_drops > 0 && a.drops[0].tokens_kept < a.drops[0].tokens_in); /* the replay means something */
    for (int k = 0; k < a.num_drops && k < b.num_drops; k++) {
      CU_ASSERT_EQUAL(b.drops[k].tokens_in, a.drops[k].tokens_in + A);
      CU_ASSERT_EQUAL(b.drops[k].tokens_kept, a.drops[k].tokens_kept + A);
    }
    double worst = 0.0, scale = 0.0;
    for (int32_t v = 0; v < V; v++) {
      worst = fmax(worst, fabs((double)rows[v] - first[v]));
      scale = fmax(scale, fabs((double)first[v]));
    }
    if (worst > 1e-4 * scale)
      printf("\n%s: replayed logits differ by %g (largest logit %g)\n", names[i], worst, scale);
    CU_ASSERT(worst <= 1e-4 * scale);
    CU_ASSERT_EQUAL(upf_eval_argmax(rows, V), upf_eval_argmax(first, V));
    for (int k = 0; k < UPF_MODEL_MAX_LAYERS; k++)
      free(masks[k]);
    upf_prefill_result_free(&a), upf_prefill_result_free(&b);

    /* dense: the greedy continuation by a decode loop of whole prefills is what the check accepts */
    int32_t answer[4];
    upf_prefill_options dense = {.mode = UPF_PREFILL_DENSE, .select = cfg->select};
    for (int64_t t = 0; t < A; t++) {
      CU_ASSERT_EQUAL_FATAL(upf_eval_prefill_last(&m, ids, P + t, &dense, 1, first, &a), UPF_OK);
      upf_prefill_result_free(&a);
      answer[t] = upf_eval_argmax(first, V);
      ids[P + t] = answer[t];
    }
    upf_eval_answer out;
    CU_ASSERT_EQUAL(upf_eval_check_answer(&m, ids, P, answer, A, NULL, &out), UPF_OK);
    CU_ASSERT_TRUE(out.correct);
    answer[A - 1] = (answer[A - 1] + 1) % V;
    CU_ASSERT_EQUAL(upf_eval_check_answer(&m, ids, P, answer, A, NULL, &out), UPF_OK);
    CU_ASSERT_FALSE(out.correct);
    /* UniPrefill: the answer run and the prompt run agree on the first answer token; keep ratios recorded */
    CU_ASSERT_EQUAL(upf_eval_check_answer(&m, ids, P, answer, A, &opt.select, &out), UPF_OK);
    CU_ASSERT_EQUAL(out.first, out.prompt_first);
    CU_ASSERT_EQUAL(out.num_drops, cfg->num_drop_layers);
    CU_ASSERT(out.keep[0] > 0.0 && out.keep[0] < 1.0);
    free(ids), free(first), free(rows);
    upf_model_free(&m);
  }
}

void upf_register_eval_tests(void) {
  static const CU_TestInfo tests[] = {
      {"metrics by hand", test_metrics_by_hand},
      {"agreement and KL over rows", test_agreement},
      {"greedy answer check", test_answer_check},
      {"windows of a text", test_windows},
      {"needle prompt builder", test_needle_builder},
      {"mask extension and keep ratios", test_extend_masks},
      {"replayed masks over prompt + answer", test_replay_extension},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("eval", NULL, NULL, tests);
}
