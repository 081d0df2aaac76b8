/* `upf serve-sim` end to end on llama-tiny (CPU, f32): a run prints its statistics and writes the JSON
 * and the token dump; each request's dumped tokens equal those of a trace holding only that request;
 * every bad input exits non-zero naming it and leaves no output behind. Runs the upf binary that sits
 * beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/npy.h"

static cli_suite cli;

static int setup(void) { return cli_setup(&cli, "upf_serve"); }
static int teardown(void) { return cli_teardown(&cli); }

/* Runs upf serve-sim on llama-tiny (cpu, f32) with the arguments. */
static int serve(const char *args) {
  return cli_run(&cli, "serve-sim --model llama-tiny --backend cpu --dtype f32 %s", args);
}

/* Three requests of a JSON-lines trace in one continuous batch, then each alone: the dumped tokens
 * agree row for row; the JSON and stdout hold the statistics. */
static void test_serve_run(void) {
  const int quick = upf_test_quick();
  const char *trace = quick ? "{\"arrival\": 0, \"prompt_len\": 40, \"seed\": 1, \"max_new\": 3}\n"
                              "{\"arrival\": 0, \"prompt\": [5, 6, 7], \"max_new\": 2}\n"
                            : "{\"arrival\": 0, \"prompt_len\": 120, \"seed\": 1, \"max_new\": 5}\n"
                              "{\"arrival\": 0, \"prompt\": [5, 6, 7], \"max_new\": 3}\n"
                              "{\"arrival\": 0.001, \"prompt_len\": 60, \"seed\": 2, \"max_new\": 4, \"id\": 9}\n";
  const int n = quick ? 2 : 3;
  CU_ASSERT_FATAL(cli_write_text(&cli, "all.jsonl", trace));
  char args[1024];
  snprintf(args, sizeof args, "--mode uniprefill --p 0.5 --trace %s --token-budget 130 --json %s --dump-tokens %s",
           cli_path(&cli, "all.jsonl"), cli_path(&cli, "all.json"), cli_path(&cli, "all.npy"));
  CU_ASSERT_EQUAL_FATAL(serve(args), 0);
  CLI_ASSERT_STDOUT(&cli, "TTFT p50");
  CLI_ASSERT_STDOUT(&cli, "KV peak");
  CU_ASSERT(cli_file_contains(cli_path(&cli, "all.json"), "\"ttft_ms\": {\"p50\": "));
  CU_ASSERT(cli_file_contains(cli_path(&cli, "all.json"), "\"per_request\""));
  CU_ASSERT(cli_file_contains(cli_path(&cli, "all.json"), "\"saved_share\""));
  CU_ASSERT(cli_file_contains(cli_path(&cli, "all.json"), "\"command\": \"upf serve-sim --model llama-tiny"));
  upf_tensor all;
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "all.npy"), &all), UPF_OK);
  CU_ASSERT(all.dtype == UPF_DTYPE_I32 && all.ndim == 2 && all.shape[0] == n && all.shape[1] == (quick ? 3 : 5));
  const int32_t *tok = all.data;
  /* request 1 asked for fewer tokens than the widest: -1 after its last */
  CU_ASSERT(tok[1 * all.shape[1] + 2 + !quick] == -1);
  CU_ASSERT(tok[1 * all.shape[1] + 1 + !quick] >= 0);
  /* each line alone */
  const char *line = trace;
  for (int i = 0; i < n; i++) {
    const char *end = strchr(line, '\n');
    char one[256];
    snprintf(one, sizeof one, "%.*s\n", (int)(end - line), line);
    line = end + 1;
    CU_ASSERT_FATAL(cli_write_text(&cli, "one.jsonl", one));
    snprintf(args, sizeof args, "--mode uniprefill --p 0.5 --trace %s --dump-tokens %s", cli_path(&cli, "one.jsonl"),
             cli_path(&cli, "one.npy"));
    CU_ASSERT_EQUAL_FATAL(serve(args), 0);
    upf_tensor t;
    CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "one.npy"), &t), UPF_OK);
    const int64_t w = t.shape[1];
    for (int64_t k = 0; k < all.shape[1]; k++)
      CU_ASSERT_EQUAL(tok[i * all.shape[1] + k], k < w ? ((int32_t *)t.data)[k] : -1);
    upf_tensor_free(&t);
  }
  upf_tensor_free(&all);
}

/* A seeded trace of several counts writes one JSON with one point per count. */
static void test_serve_points(void) {
  if (upf_test_quick()) {
    printf("skipped under Valgrind (quick): test_serve_run covers the same code paths ");
    return;
  }
  char args[512];
  snprintf(args, sizeof args, "--requests 1,3 --prompt-len 20..60 --decode-len 3 --rate 50 --seed 4 --json %s",
           cli_path(&cli, "points.json"));
  CU_ASSERT_EQUAL_FATAL(serve(args), 0);
  CU_ASSERT(cli_file_contains(cli_path(&cli, "points.json"), "\"requests\": 1,"));
  CU_ASSERT(cli_file_contains(cli_path(&cli, "points.json"), "\"requests\": 3,"));
  CU_ASSERT(cli_file_contains(cli_path(&cli, "points.json"), "\"rate\": \"50\""));
  CLI_ASSERT_STDOUT(&cli, "llama-tiny dense on cpu: 3 requests");
}

/* Bad input: exit status, a message naming it, no output file. */
static void test_serve_bad_input(void) {
  CU_ASSERT_FATAL(cli_write_text(&cli, "bad.jsonl", "{\"arrival\": 0, \"prompt_len\": 10}\n"
                                                    "{\"arrival\": 0, \"prompt_len\": 10, \"colour\": 2}\n"));
  char args[1024];
  static const struct {
    const char *args, *want;
    int rc;
  } cases[] = {
      {"--trace %s --json %s", "line 2", 1},
      {"--p 0.5 --json %s%s", "--p and --keep need --mode uniprefill", 2},
      {"--mode uniprefill --p 0.5 --keep 0.3 --json %s%s", "one of --p", 2},
      {"--rate 2 --trace %s --json %s", "--trace gives the requests", 2},
      {"--prompt-len 9..3 --json %s%s", "--prompt-len '9..3'", 2},
      {"--rate -1 --json %s%s", "--rate '-1'", 2},
      {"--requests 2,0 --json %s%s", "--requests '2,0'", 2},
      {"--kv-pages 2 --prompt-len 100 --json %s%s", "could never run", 1},
      {"--kv-gib 0.000001 --json %s%s", "--kv-gib", 2},
      {"--eos 512 --json %s%s", "--eos 512", 2},
      {"--mode fast --json %s%s", "--mode 'fast'", 2},
      {"--requests 1,2 --dump-tokens %s%s", "one --requests count", 2},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    if (strstr(cases[i].args, "--trace"))
      snprintf(args, sizeof args, cases[i].args, cli_path(&cli, "bad.jsonl"), cli_path(&cli, "out.json"));
    else
      snprintf(args, sizeof args, cases[i].args, cli_path(&cli, "out.json"), "");
    const int rc = serve(args);
    const int named = cli_stderr_has(&cli, cases[i].want);
    if (rc != cases[i].rc || !named)
      printf("\ncase %zu (%s): exit %d, want %d and '%s'\n", i, args, rc, cases[i].rc, cases[i].want);
    CU_ASSERT_EQUAL(rc, cases[i].rc);
    CU_ASSERT(named);
    CU_ASSERT(!cli_exists(cli_path(&cli, "out.json")));
  }
  /* --help: the usage on stdout, exit 0, the trace format documented */
  CU_ASSERT_EQUAL(serve("--help"), 0);
  CLI_ASSERT_STDOUT(&cli, "usage: upf serve-sim");
  CU_ASSERT(cli_stdout_has(&cli, "\"prompt_len\""));
}

void upf_register_cli_serve_tests(void) {
  static const CU_TestInfo tests[] = {
      {"a batch's tokens equal each request alone; JSON and dump", test_serve_run},
      {"several request counts: one point each", test_serve_points},
      {"bad input named, nothing written", test_serve_bad_input},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("cli serve-sim", setup, teardown, tests);
}
