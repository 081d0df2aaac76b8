/* `upf tokenize` end to end, on a tiny byte-level BPE GGUF written by the GGUF writer
 * (upf_test_tiny_tokenizer_gguf in tests/test_tokenizer.c: "hello world!" is <|im_start|> hello
 * Ġworld !, ids 1 13 18 19): the printed ids and the .npy agree with the library, --decode gives
 * the text back, and every bad input exits non-zero naming it and leaves no output file. Runs the
 * upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/gguf.h"
#include "uniprefill/npy.h"

upf_gguf_writer *upf_test_tiny_tokenizer_gguf(const char *pre);

static cli_suite cli;

/* The tiny tokenizer file, one without a tokenizer, and the texts; upf runs in the suite's directory,
 * so the tests name these files as they are. */
static int setup(void) {
  if (cli_setup(&cli, "upf_cli_tok"))
    return 1;
  cli.run_in_dir = 1;
  upf_gguf_writer *w = upf_test_tiny_tokenizer_gguf("smollm");
  upf_gguf_writer *bare = NULL;
  int bad = !w || upf_gguf_writer_write(w, cli_path(&cli, "tiny.gguf")) != UPF_OK;
  bad = bad || upf_gguf_writer_create(&bare) != UPF_OK || upf_gguf_set_str(bare, "general.architecture", "llama") ||
        upf_gguf_writer_write(bare, cli_path(&cli, "notok.gguf")) != UPF_OK;
  upf_gguf_writer_free(w);
  upf_gguf_writer_free(bare);
  bad = bad || !cli_write_text(&cli, "text.txt", "<|im_start|>hello world!") ||
        !cli_write_text(&cli, "plain.txt", "not a gguf\n") || !cli_write_text(&cli, "empty.txt", "");
  return bad;
}

static int teardown(void) { return cli_teardown(&cli); }

static int run(const char *args) { return cli_run(&cli, "tokenize %s", args); }

static void test_tokenize_text_and_file(void) {
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --text 'hello world!' --out ids.npy"), 0);
  CLI_ASSERT_STDOUT(&cli, "count: 4\nids: 1 13 18 19\n");
  upf_tensor t = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "ids.npy"), &t), UPF_OK);
  CU_ASSERT(t.dtype == UPF_DTYPE_I32 && t.ndim == 1 && t.shape[0] == 4);
  if (t.dtype == UPF_DTYPE_I32 && t.shape[0] == 4) {
    const int32_t *v = t.data;
    CU_ASSERT(v[0] == 1 && v[1] == 13 && v[2] == 18 && v[3] == 19);
  }
  upf_tensor_free(&t);
  /* the BOS the file asks for, left out; a special token in the file's text parsed, or not */
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --no-bos --file text.txt"), 0);
  CLI_ASSERT_STDOUT(&cli, "count: 4\nids: 1 13 18 19\n");
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --no-bos --no-parse-special --file text.txt"), 0);
  CLI_ASSERT_STDOUT(&cli, "ids: 8 13 18 19\n"); /* "<|im_start|>" as text: only its r is a token */
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --file empty.txt"), 0);
  CLI_ASSERT_STDOUT(&cli, "count: 1\nids: 1\n");
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --decode ids.npy"), 0);
  CLI_ASSERT_STDOUT(&cli, "<|im_start|>hello world!");
}

static void test_bad_inputs(void) {
  static const struct {
    const char *args;
    int code;
    const char *message;
  } bad[] = {
      {"--gguf missing.gguf --text hi --out out.npy", 1, "--gguf"},
      {"--gguf plain.txt --text hi --out out.npy", 1, "--gguf"},
      {"--gguf notok.gguf --text hi --out out.npy", 1, "no tokenizer"},
      {"--gguf tiny.gguf --file missing.txt --out out.npy", 1, "--file missing.txt"},
      {"--gguf tiny.gguf --file . --out out.npy", 1, "--file"},
      {"--gguf tiny.gguf --text hi --file text.txt --out out.npy", 2, "exactly one of --text, --file and --decode"},
      {"--gguf tiny.gguf --out out.npy", 2, "exactly one of"},
      {"--gguf tiny.gguf --decode ids.npy --out out.npy", 2, "--decode takes no --out"},
      {"--gguf tiny.gguf --decode bad_ids.npy", 1, "ids[1] = 20"},
      {"--gguf tiny.gguf --decode text.txt", 1, "--decode"},
      {"--gguf tiny.gguf --text hi --out nodir/out.npy", 2, "--out"},
      {"--text hi", 2, "--gguf"},
  };
  int32_t v[2] = {13, 20};
  int64_t shape[1] = {2};
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_tensor_init(&t, v, UPF_DTYPE_I32, 1, shape), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_write(cli_path(&cli, "bad_ids.npy"), &t), UPF_OK);
  CU_ASSERT_EQUAL(run("--gguf tiny.gguf --text 'hello' --out ids.npy"), 0);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int code = run(bad[i].args);
    CU_ASSERT_EQUAL(code, bad[i].code);
    if (code != bad[i].code)
      printf("\n  upf tokenize %s: exit %d, want %d", bad[i].args, code, bad[i].code);
    CLI_ASSERT_STDERR(&cli, bad[i].message);
    CU_ASSERT(!cli_exists(cli_path(&cli, "out.npy")));
  }
  CU_ASSERT_EQUAL(run("--help"), 0);
  CLI_ASSERT_STDOUT(&cli, "usage: upf tokenize");
}

static CU_TestInfo tests[] = {
    {"text, file, special tokens, .npy and --decode", test_tokenize_text_and_file},
    {"bad inputs exit non-zero, name the input and leave no file", test_bad_inputs},
    CU_TEST_INFO_NULL,
};

void upf_register_cli_tokenize_tests(void) { upf_test_suite("cli tokenize", setup, teardown, tests); }
