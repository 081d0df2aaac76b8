/* `upf eval` end to end: bad command lines exit non-zero naming the input at fault and leave no JSON
 * behind; next-token on a tiny seeded model at p = 1 agrees everywhere with KL 0 (every token kept),
 * and at a low p drops tokens; --chunk: chunked dense and CompactAttention at alpha 0 agree with
 * unchunked dense over positions gathered across chunks, at alpha 1 it keeps fewer key blocks; with the
 * real SmolLM2 file (skipped by name when absent) --tokens beyond the text is refused before any
 * prefill and a chunked needle answers as dense does. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  /* --chunk and --mode compact */
  expect_failure("--model llama-tiny --task next-token --mode compact", 2, "--mode compact needs --chunk");
  expect_failure("--model llama-tiny --task next-token --chunk 0", 2, "--chunk");
  expect_failure("--model llama-tiny --task ppl --chunk 64", 2, "--chunk does not apply to --task ppl");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode uniprefill", 2,
                 "--chunk with --mode uniprefill");
  expect_failure("--model llama-tiny --task next-token --chunk 64", 2, "--chunk with --mode uniprefill"); /* the default mode */
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode dense --recent 1", 2,
                 "--recent needs --mode compact");
  expect_failure("--model llama-tiny --task next-token --mode flashprefill --recent 1", 2,
                 "--recent needs --mode compact");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode compact --recent -1", 2, "--recent -1");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode dense --p 0.9", 2, "--p and --keep");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode dense --alpha 0.1", 2, "--alpha");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode compact --last-n 1", 2, "--last-n");
  expect_failure("--model llama-tiny --task next-token --chunk 64 --mode compact --alpha 2", 2, "--alpha 2");
}

/* The file's text (its first 64 KiB) in a static buffer; "" when it cannot be read. */
static const char *json_text(const char *path) {
  static char buf[1 << 16];
  FILE *f = fopen(path, "rb");
  const size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  return buf;
}

/* The number after the first `key` at or after `from` in text, NAN when absent. */
static double json_number(const char *text, const char *from, const char *key) {
  const char *at = from ? strstr(text, from) : text;
  at = at ? strstr(at, key) : NULL;
  return at ? strtod(at + strlen(key), NULL) : NAN;
}

/* --chunk on a tiny seeded model, the prompt not a multiple of the chunk and --last reaching past the
 * final chunk (136 = 2 x 64 + 8, or 200 = 4 x 48 + 8; last 16), so the positions compared are gathered
 * from two chunks. Chunked dense agrees with unchunked dense (top-1 everywhere, KL within rounding: the
 * CPU's double-accumulated attention gives the same logits); CompactAttention at alpha 0 keeps every
 * block and so equals chunked dense; at alpha 1 it keeps fewer blocks than visible and the JSON says so. */
static void test_chunked_seeded(void) {
  const int quick = upf_test_quick();
  const char *len = quick ? "136" : "200", *chunk = quick ? "64" : "48";
  const char *json = cli_path(&cli, "chunk.json");
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "eval --model llama-tiny --task next-token --tokens %s --windows 2 --last 16 "
                                      "--chunk %s --mode dense --dtype f32 --backend cpu --json %s", len, chunk, json), 0);
  char want[256];
  snprintf(want, sizeof want, "chunk %s: top-1 agreement 100.00%% (32/32)", chunk);
  CLI_ASSERT_STDOUT(&cli, want);
  CU_ASSERT(cli_file_contains(json, "\"mode\": \"dense\",\n  \"chunk\": "));
  snprintf(want, sizeof want, "{\"chunk\": %s, \"positions\": 32, \"agree\": 32, ", chunk);
  CU_ASSERT(cli_file_contains(json, want));
  const double kl_dense = json_number(json_text(json), NULL, "\"kl_max\": ");
  CU_ASSERT(kl_dense >= 0 && kl_dense <= 1e-6);

  const char *sel = "--block-n 64 --window 1 --sink 0 --recent 0";
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "eval --model llama-tiny --task next-token --tokens %s --windows 2 --last 16 "
                                      "--chunk %s --mode compact --alpha 0,1 %s --dtype f32 --backend cpu --json %s",
                                len, chunk, sel, json), 0);
  CLI_ASSERT_STDOUT(&cli, "alpha 0: top-1 agreement 100.00% (32/32)");
  CLI_ASSERT_STDOUT(&cli, "kept share of the key blocks 1.0000, per full-attention layer (chunks with cached context)");
  CU_ASSERT(cli_file_contains(json, "\"compact\": {\"recent\": 0, \"selector\": {\"alpha\": "));
  CU_ASSERT(cli_file_contains(json, "\"block_n\": 64, \"sink\": 0, \"window\": 1, \"last_n\": 0"));
  CU_ASSERT(cli_file_contains(json, "{\"alpha\": 0, \"positions\": 32, \"agree\": 32,"));
  const char *text = json_text(json);
  const double kl_compact0 = json_number(text, "{\"alpha\": 0, ", "\"kl_max\": ");
  CU_ASSERT(kl_compact0 >= 0 && kl_compact0 <= 1e-6);
  CU_ASSERT(json_number(text, "{\"alpha\": 0, ", "\"kept_share\": ") == 1.0);
  /* alpha 1 drops context blocks: the comparison above is not vacuous */
  const double kept1 = json_number(text, "{\"alpha\": 1, ", "\"kept_share\": ");
  CU_ASSERT(kept1 > 0 && kept1 < 1);
}

/* With the real SmolLM2 file: a needle prompt of 256 tokens in chunks of 100 (the last 56) answers
 * through the session's decode rows as the unchunked dense check does. Natively only (seconds). */
static void test_needle_chunked(void) {
  char smollm[PATH_MAX];
  if (!upf_test_model_file(smollm, sizeof smollm, "SmolLM2-135M-Instruct.Q4_1.gguf", "eval cli", "chunked needle"))
    return;
  const char *json = cli_path(&cli, "needle.json");
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "eval --gguf %s --task needle --tokens 256 --depths 0.5 --chunk 100 --mode dense "
                                      "--backend cpu --json %s", smollm, json), 0);
  CU_ASSERT(cli_file_contains(json, "\"dense\": true, \"chunk_100\": true"));
  CU_ASSERT(cli_file_contains(json, "\"replay_first_token_mismatches\": 0"));
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
      {"--chunk: chunked dense and compact against dense", test_chunked_seeded},
      {"--chunk: needle on SmolLM2", test_needle_chunked},
      CU_TEST_INFO_NULL,
  };
  static const CU_TestInfo quick_tests[] = {
      {"bad command lines", test_bad_command_lines},
      {"next-token on a seeded model", test_next_token_seeded},
      {"tokens beyond the text", test_tokens_beyond_text},
      {"--chunk: chunked dense and compact against dense", test_chunked_seeded},
      CU_TEST_INFO_NULL,
  };
  /* Under Valgrind (quick) the SmolLM2 needle stays native: seconds of real-weight prefill */
  upf_test_suite("eval cli", setup, teardown, upf_test_quick() ? quick_tests : tests);
}
