/* `upf eval` end to end: bad command lines exit non-zero naming the input at fault and leave no JSON
 * behind; next-token on a tiny seeded model at p = 1 agrees everywhere with KL 0 (every token kept),
 * and at a low p drops tokens; with the real SmolLM2 file (skipped by name when absent) --tokens
 * beyond the text is refused before any prefill. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"

static cli_suite cli;

static int setup(void) { return cli_setup(&cli, "upf_cli_eval"); }
static int teardown(void) { return cli_teardown(&cli); }

/* A failing run: exit status `code`, `needle` in stderr, no JSON left. */
static void expect_failure(const char *args, int code, const char *needle) {
  const char *json = cli_path(&cli, "r.json");
  CU_ASSERT_EQUAL(cli_run(&cli, "eval %s --json %s", args, json), code);
  CLI_ASSERT_STDERR(&cli, needle);
  CU_ASSERT_FALSE(cli_exists(json));
}

static void test_bad_command_lines(void) {
  expect_failure("--model llama-tiny --task perplexity", 2, "--task 'perplexity'");
  expect_failure("--model llama-tiny --task next-token --p 1.5", 2, "--p 1.5");
  expect_failure("--model llama-tiny --task next-token --p 0", 2, "--p 0");
  expect_failure("--model llama-tiny --task next-token --p 0.9,x", 2, "--p '0.9,x'");
  expect_failure("--model llama-tiny --task next-token --keep 0.5 --p 0.9", 2, "not both");
  expect_failure("--model llama-tiny --task next-token --tokens 1x", 2, "--tokens '1x'");
  expect_failure("--model llama-tiny --task next-token --last 17", 2, "--last 17"); /* the tiny last-q is 16 */
  expect_failure("--model llama-tiny --task next-token --mode dense", 2, "nothing to compare");
  expect_failure("--model llama-tiny --task ppl --mode uniprefill", 2, "dense only");
  expect_failure("--model llama-tiny --task needle", 2, "needs text and a tokenizer");
  expect_failure("--model no-such-model --task next-token", 2, "no-such-model");
  expect_failure("--task ppl", 2, "exactly one of --gguf");
  expect_failure("--model llama-tiny --task next-token --backend tpu", 2, "--backend");
  char args[1024];
  snprintf(args, sizeof args, "--gguf %s --task ppl", cli_path(&cli, "missing.gguf"));
  expect_failure(args, 2, "missing.gguf: no such file");
  /* a file that exists, with a text file that does not: the text is read first and named */
  CU_ASSERT_FATAL(cli_write_text(&cli, "empty.gguf", ""));
  snprintf(args, sizeof args, "--gguf %s --task ppl --text-file %s", cli_path(&cli, "empty.gguf"),
           cli_path(&cli, "missing.txt"));
  expect_failure(args, 1, "missing.txt: cannot open");
  snprintf(args, sizeof args, "--gguf %s --task ppl --text-file /usr/share/common-licenses/GPL-3",
           cli_path(&cli, "empty.gguf"));
  expect_failure(args, 1, "empty.gguf");
}

/* p = 1 keeps every token, so UniPrefill's logits are dense's bit for bit: 100% agreement, KL 0. A low p
 * drops tokens (keep ratios below 1) and the JSON records both runs. */
static void test_next_token_seeded(void) {
  const char *json = cli_path(&cli, "nt.json");
  const char *len = upf_test_quick() ? "72" : "200";
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "eval --model llama-tiny --task next-token --tokens %s --windows 2 --last 16 "
                                      "--p 1,0.5 --json %s", len, json), 0);
  CLI_ASSERT_STDOUT(&cli, "p 1: top-1 agreement 100.00% (32/32), mean KL 0, max KL 0");
  CU_ASSERT(cli_file_contains(json, "\"p\": 1, \"positions\": 32, \"agree\": 32, \"top1_agreement\": 1.000000"));
  CU_ASSERT(cli_file_contains(json, "\"keep_ratio\": [1.000000, 1.000000]"));
  CU_ASSERT(cli_file_contains(json, "\"p\": 0.5, \"positions\": 32"));
  CU_ASSERT(cli_file_contains(json, "\"command\": \"upf eval --model llama-tiny"));
  CU_ASSERT_FALSE(cli_file_contains(json, "\"p\": 0.5, \"positions\": 32, \"agree\": 32, \"top1_agreement\": 1.000000, \"kl_mean\": 0,"));
}

/* With the real SmolLM2 file: a window longer than the text is refused before the weights load. */
static void test_tokens_beyond_text(void) {
  char smollm[PATH_MAX];
  if (!upf_test_model_file(smollm, sizeof smollm, "SmolLM2-135M-Instruct.Q4_1.gguf", "eval cli", "tokens beyond the text"))
    return;
  CU_ASSERT_FATAL(cli_write_text(&cli, "short.txt", "A short text of a few words.\n"));
  char args[PATH_MAX + 512];
  snprintf(args, sizeof args, "--gguf %s --task next-token --tokens 2048 --text-file %s", smollm,
           cli_path(&cli, "short.txt"));
  expect_failure(args, 2, "longer than the text");
}

void upf_register_cli_eval_tests(void) {
  static const CU_TestInfo tests[] = {
      {"bad command lines", test_bad_command_lines},
      {"next-token on a seeded model", test_next_token_seeded},
      {"tokens beyond the text", test_tokens_beyond_text},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("eval cli", setup, teardown, tests);
}
