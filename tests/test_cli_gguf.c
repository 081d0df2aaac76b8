/* `upf export` and `upf prefill --gguf` end to end: an exported seeded model prefills to the same
 * logits as the built-in one; every bad input exits non-zero naming the flag, and export leaves no
 * file behind. Runs the upf binary beside this test binary. */
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

static int setup(void) { return cli_setup(&cli, "upf_cli_gguf"); }
static int teardown(void) { return cli_teardown(&cli); }

/* llama: every transform of the file is a move (transpose, permutation), so the file prefills to the
 * built-in model's logits bit for bit, in bf16 and f32 (dense: UniPrefill on the file uses the drop
 * layers and selection scaled for a file, not the tiny config's). */
static void test_export_then_prefill(void) {
  const char *dtypes[] = {"bf16", "f32"};
  for (int d = 0; d < (upf_test_quick() ? 1 : 2); d++) {
    char file[128];
    snprintf(file, sizeof file, "%s", cli_path(&cli, d ? "llama-f32.gguf" : "llama-bf16.gguf"));
    CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "export --model llama-tiny --seed 4 --dtype %s --out %s", dtypes[d], file), 0);
    CU_ASSERT(cli_exists(file));
    for (int mode = 0; mode < 2; mode++) {
      const char *m = mode ? "--mode uniprefill" : "--mode dense";
      if (mode) { /* runs, with the file's drop layers */
        CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --lengths 150 --backend cpu --dtype %s %s --json %s", file,
                                dtypes[d], m, cli_path(&cli, "u.json")), 0);
        continue;
      }
      CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --seed 4 --lengths 150 --backend cpu --dtype %s %s "
                              "--out-logits %s", dtypes[d], m, cli_path(&cli, "a.npy")), 0);
      /* --seed draws the same ids for --lengths; the file's weights replace the seeded ones */
      CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --seed 4 --lengths 150 --backend cpu --dtype %s %s "
                              "--out-logits %s", file, dtypes[d], m, cli_path(&cli, "b.npy")), 0);
      CU_ASSERT(cli_same_npy(cli_path(&cli, "a.npy"), cli_path(&cli, "b.npy")));
    }
  }
}

static void test_export_bad_inputs(void) {
  char out[128];
  snprintf(out, sizeof out, "%s", cli_path(&cli, "bad.gguf"));
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model no-such-model --out %s", out), 2);
  CLI_ASSERT_STDERR(&cli, "--model");
  CLI_ASSERT_STDERR(&cli, "llama-tiny");
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --dtype f16 --out %s", out), 2);
  CLI_ASSERT_STDERR(&cli, "--dtype 'f16'");
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny"), 2);
  CLI_ASSERT_STDERR(&cli, "--out");
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --out %s/no/such/dir/x.gguf", cli.dir), 2);
  CLI_ASSERT_STDERR(&cli, "--out");
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --out %s", cli.dir), 2); /* a directory */
  CLI_ASSERT_STDERR(&cli, "--out");
  CU_ASSERT(!cli_exists(out));
  CU_ASSERT_EQUAL(cli_run(&cli, "export --model llama-tiny --seed -1 --out %s", out), 2);
  CLI_ASSERT_STDERR(&cli, "--seed");
  CU_ASSERT(!cli_exists(out));
}

static void test_prefill_gguf_bad_inputs(void) {
  char file[128];
  snprintf(file, sizeof file, "%s", cli_path(&cli, "ok.gguf"));
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "export --model gemma3-tiny --out %s", file), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model gemma3-tiny --gguf %s --lengths 10 --backend cpu", file), 2);
  CLI_ASSERT_STDERR(&cli, "exactly one of --model");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --lengths 10 --backend cpu"), 2);
  CLI_ASSERT_STDERR(&cli, "exactly one of --model");
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --gguf %s/none.gguf --lengths 10 --backend cpu", cli.dir), 0);
  CLI_ASSERT_STDERR(&cli, "prefill: --gguf");
  CLI_ASSERT_STDERR(&cli, "none.gguf");
  FILE *f = fopen(cli_path(&cli, "junk.gguf"), "w");
  CU_ASSERT_FATAL(f != NULL);
  fputs("GGUF but not really a model file", f);
  fclose(f);
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --gguf %s --lengths 10 --backend cpu", cli_path(&cli, "junk.gguf")), 0);
  CLI_ASSERT_STDERR(&cli, "prefill: --gguf");
  CLI_ASSERT_STDERR(&cli, "junk.gguf");
  /* a file of an architecture the loader does not take */
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "export --model qwen3-next-tiny --out %s", cli_path(&cli, "q.gguf")), 0);
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --gguf %s --lengths 10 --backend cpu", cli_path(&cli, "q.gguf")), 0);
  CLI_ASSERT_STDERR(&cli, "qwen3next");
  /* ids beyond the file's vocabulary (512), and a layer range beyond its layers (9) */
  int32_t ids[3] = {1, 600, 2};
  upf_tensor t;
  const int64_t shape[1] = {3};
  upf_tensor_init(&t, ids, UPF_DTYPE_I32, 1, shape);
  CU_ASSERT_FATAL(upf_npy_write(cli_path(&cli, "ids.npy"), &t) == UPF_OK);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --token-ids %s --backend cpu", file, cli_path(&cli, "ids.npy")), 2);
  CLI_ASSERT_STDERR(&cli, "id 600 at 1 is outside the vocabulary [0, 512)");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --lengths 10 --layers 0:12 --backend cpu", file), 2);
  CLI_ASSERT_STDERR(&cli, "0 <= A < B <= 9");
  /* and a good partial run of the file */
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --lengths 40 --layers 2:5 --backend cpu --json %s", file,
                          cli_path(&cli, "r.json")), 0);
  CU_ASSERT(cli_exists(cli_path(&cli, "r.json")));
}

/* The real SmolLM2 file (upf_test_model_file), NULL after the skip line when absent or in quick mode. */
static const char *smollm2_file(const char *test) {
  static char path[PATH_MAX];
  if (upf_test_skip_quick("cli gguf", test, "the real file runs in the native pass"))
    return NULL;
  return upf_test_model_file(path, sizeof path, "SmolLM2-135M-Instruct.Q4_1.gguf", "cli gguf", test);
}

/* --text / --file: the file's tokenizer then the model, equal to `upf tokenize` then --token-ids, for
 * prefill and generate; every misuse named. */
static void test_text_prompts(void) {
  char file[128];
  snprintf(file, sizeof file, "%s", cli_path(&cli, "tiny.gguf"));
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "export --model llama-tiny --out %s", file), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --model llama-tiny --text hello --backend cpu"), 2);
  CLI_ASSERT_STDERR(&cli, "--text needs --gguf");
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --text hello --lengths 4 --backend cpu", file), 2);
  CLI_ASSERT_STDERR(&cli, "exactly one of --lengths, --token-ids, --text and --file");
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --text hello --file %s --max-new 2 --backend cpu", file, file), 2);
  CLI_ASSERT_STDERR(&cli, "exactly one of --token-ids, --text and --file");
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "prefill --gguf %s --file %s/none.txt --backend cpu", file, cli.dir), 0);
  CLI_ASSERT_STDERR(&cli, "--file");
  CLI_ASSERT_STDERR(&cli, "none.txt");
  /* an exported seeded model has no usable tokenizer */
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "generate --gguf %s --text hello --max-new 2 --backend cpu --out-tokens %s", file,
                              cli_path(&cli, "t.npy")), 0);
  CLI_ASSERT_STDERR(&cli, "tokenizer");
  CU_ASSERT(!cli_exists(cli_path(&cli, "t.npy")));

  const char *real = smollm2_file("text prompts");
  if (!real)
    return;
  const char *text = "The capital of France is";
  FILE *f = fopen(cli_path(&cli, "prompt.txt"), "w");
  CU_ASSERT_FATAL(f != NULL);
  fputs(text, f);
  fclose(f);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "tokenize --gguf %s --text '%s' --out %s", real, text, cli_path(&cli, "ids.npy")),
                        0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --text '%s' --backend cpu --dtype f32 --out-logits %s", real, text,
                          cli_path(&cli, "l1.npy")), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --file %s --backend cpu --dtype f32 --out-logits %s", real,
                          cli_path(&cli, "prompt.txt"), cli_path(&cli, "l2.npy")), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "prefill --gguf %s --token-ids %s --backend cpu --dtype f32 --out-logits %s", real,
                          cli_path(&cli, "ids.npy"), cli_path(&cli, "l3.npy")), 0);
  CU_ASSERT(cli_same_npy(cli_path(&cli, "l1.npy"), cli_path(&cli, "l3.npy")));
  CU_ASSERT(cli_same_npy(cli_path(&cli, "l2.npy"), cli_path(&cli, "l3.npy")));
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --text '%s' --max-new 4 --backend cpu --dtype f32 --out-tokens %s",
                          real, text, cli_path(&cli, "g1.npy")), 0);
  CU_ASSERT_EQUAL(cli_run(&cli, "generate --gguf %s --token-ids %s --max-new 4 --backend cpu --dtype f32 "
                          "--out-tokens %s", real, cli_path(&cli, "ids.npy"), cli_path(&cli, "g2.npy")), 0);
  CU_ASSERT(cli_same_npy(cli_path(&cli, "g1.npy"), cli_path(&cli, "g2.npy")));
}

void upf_register_cli_gguf_tests(void) {
  static const CU_TestInfo tests[] = {
      {"export then prefill --gguf", test_export_then_prefill},
      {"export bad inputs", test_export_bad_inputs},
      {"prefill --gguf bad inputs", test_prefill_gguf_bad_inputs},
      {"--text and --file prompts", test_text_prompts},
      CU_TEST_INFO_NULL,
  };
  upf_test_suite("cli gguf", setup, teardown, tests);
}
