/* `upf eval` end to end: bad command lines exit non-zero naming the input at fault and leave no JSON
 * behind; next-token on a tiny seeded model at p = 1 agrees everywhere with KL 0 (every token kept),
 * and at a low p drops tokens; with the real SmolLM2 file (skipped by name when absent) --tokens
 * beyond the text is refused before any prefill. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_util.h"

static char upf_path[PATH_MAX];
static char dir[64];
static char smollm[PATH_MAX];

static int setup(void) {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return 1;
  self[n] = '\0';
  snprintf(upf_path, sizeof upf_path, "%s/upf", dirname(self));
  const char *d = getenv("UPF_MODEL_DIR"), *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  if (d && *d)
    snprintf(smollm, sizeof smollm, "%s/SmolLM2-135M-Instruct.Q4_1.gguf", d);
  else if (cache && *cache)
    snprintf(smollm, sizeof smollm, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", cache);
  else
    snprintf(smollm, sizeof smollm, "%s/.cache/uniprefill/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : "/root");
  snprintf(dir, sizeof dir, "/tmp/upf_eval_XXXXXX");
  return mkdtemp(dir) ? 0 : 1;
}

static int teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : 1;
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

static int run_upf(const char *args) {
  char cmd[PATH_MAX + 8192];
  snprintf(cmd, sizeof cmd, "'%s' eval %s 2>%s/stderr.txt >%s/stdout.txt", upf_path, args, dir, dir);
  const int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static int contains(const char *name, const char *needle) {
  static char buf[1 << 16];
  char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "r");
  const size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

/* A failing run: exit status `code`, `needle` in stderr, no JSON left. */
static void expect_failure(const char *args, int code, const char *needle) {
  char full[4096], json[128];
  snprintf(json, sizeof json, "%s/r.json", dir);
  snprintf(full, sizeof full, "%s --json %s", args, json);
  const int rc = run_upf(full);
  if (rc != code || !contains("stderr.txt", needle))
    printf("\n    upf eval %s: exit %d (want %d), stderr lacks '%s'?\n", full, rc, code, needle);
  CU_ASSERT_EQUAL(rc, code);
  CU_ASSERT(contains("stderr.txt", needle));
  CU_ASSERT_FALSE(exists(json));
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
  expect_failure("--model no-such-model --task next-token", 1, "no-such-model");
  expect_failure("--task ppl", 2, "exactly one of --gguf");
  expect_failure("--model llama-tiny --task next-token --backend tpu", 1, "--backend");
  char args[1024];
  snprintf(args, sizeof args, "--gguf %s/missing.gguf --task ppl", dir);
  expect_failure(args, 2, "missing.gguf: no such file");
  /* a file that exists, with a text file that does not: the text is read first and named */
  snprintf(args, sizeof args, "touch %s/empty.gguf", dir);
  CU_ASSERT_EQUAL(system(args), 0);
  snprintf(args, sizeof args, "--gguf %s/empty.gguf --task ppl --text-file %s/missing.txt", dir, dir);
  expect_failure(args, 1, "missing.txt: cannot open");
  snprintf(args, sizeof args, "--gguf %s/empty.gguf --task ppl --text-file /usr/share/common-licenses/GPL-3", dir);
  expect_failure(args, 1, "empty.gguf");
}

/* p = 1 keeps every token, so UniPrefill's logits are dense's bit for bit: 100% agreement, KL 0. A low p
 * drops tokens (keep ratios below 1) and the JSON records both runs. */
static void test_next_token_seeded(void) {
  char args[1024], json[128];
  snprintf(json, sizeof json, "%s/nt.json", dir);
  const char *len = upf_test_quick() ? "72" : "200";
  snprintf(args, sizeof args, "--model llama-tiny --task next-token --tokens %s --windows 2 --last 16 --p 1,0.5 --json %s",
           len, json);
  const int rc = run_upf(args);
  CU_ASSERT_EQUAL_FATAL(rc, 0);
  CU_ASSERT(contains("stdout.txt", "p 1: top-1 agreement 100.00% (32/32), mean KL 0, max KL 0"));
  CU_ASSERT(contains("nt.json", "\"p\": 1, \"positions\": 32, \"agree\": 32, \"top1_agreement\": 1.000000"));
  CU_ASSERT(contains("nt.json", "\"keep_ratio\": [1.000000, 1.000000]"));
  CU_ASSERT(contains("nt.json", "\"p\": 0.5, \"positions\": 32"));
  CU_ASSERT(contains("nt.json", "\"command\": \"upf eval --model llama-tiny"));
  CU_ASSERT_FALSE(contains("nt.json", "\"p\": 0.5, \"positions\": 32, \"agree\": 32, \"top1_agreement\": 1.000000, \"kl_mean\": 0,"));
}

/* With the real SmolLM2 file: a window longer than the text is refused before the weights load. */
static void test_tokens_beyond_text(void) {
  if (!exists(smollm)) {
    printf("SKIPPED eval cli/tokens beyond the text: %s absent (ci/fetch-models.sh; UPF_MODEL_DIR / UPF_MODEL_CACHE)\n", smollm);
    return;
  }
  char args[PATH_MAX + 512];
  snprintf(args, sizeof args, "echo 'A short text of a few words.' > %s/short.txt", dir);
  CU_ASSERT_EQUAL(system(args), 0);
  snprintf(args, sizeof args, "--gguf %s --task next-token --tokens 2048 --text-file %s/short.txt", smollm, dir);
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
