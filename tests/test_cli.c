/* The upf CLI end to end: a good `upf select` writes the mask the library computes; every bad
 * input exits non-zero with a message naming it and leaves no output file behind; every command
 * parses its flags alike; `upf report` and `upf ops` say what they ran. Runs the upf binary that
 * sits beside this test binary. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ref_cpu/select.h"
#include "tests/cli_harness.h"
#include "tests/test_util.h"
#include "uniprefill/npy.h"
#include "uniprefill/variant.h"
#include "verify/select_inputs.h"

static cli_suite cli;

static int setup(void) { return cli_setup(&cli, "upf_cli"); }
static int teardown(void) { return cli_teardown(&cli); }

static upf_select_problem problem;

static void write_inputs(void) {
  const int32_t lens[] = {1, 2000, 300};
  CU_ASSERT_FATAL(upf_select_problem_make(&problem, lens, 3, 4, 2, 64, UPF_DTYPE_BF16, UPF_DIST_HEAVY, 11) == UPF_OK);
  upf_tensor cu;
  int64_t shape[1] = {4};
  upf_tensor_init(&cu, problem.cu_seqlens, UPF_DTYPE_I32, 1, shape);
  CU_ASSERT_FATAL(upf_npy_write(cli_path(&cli, "q.npy"), &problem.q) == UPF_OK);
  CU_ASSERT_FATAL(upf_npy_write(cli_path(&cli, "k.npy"), &problem.k) == UPF_OK);
  CU_ASSERT_FATAL(upf_npy_write(cli_path(&cli, "cu.npy"), &cu) == UPF_OK);
}

static void test_select_writes_the_library_mask(void) {
  write_inputs();
  char args[2048];
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s --out-blocks %s --out-kept %s",
           cli_path(&cli, "q.npy"), cli_path(&cli, "k.npy"), cli_path(&cli, "cu.npy"), cli_path(&cli, "mask.npy"),
           cli_path(&cli, "blocks.npy"), cli_path(&cli, "kept.npy"));
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  CLI_ASSERT_STDERR(&cli, "of 2301 tokens"); /* the report line that failing runs must not print */
  upf_tensor mask = {0}, blocks = {0}, kept = {0};
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "mask.npy"), &mask), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "blocks.npy"), &blocks), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(cli_path(&cli, "kept.npy"), &kept), UPF_OK);
  CU_ASSERT_EQUAL(mask.dtype, UPF_DTYPE_U8);
  CU_ASSERT_EQUAL(mask.ndim, 1);
  CU_ASSERT_EQUAL(mask.shape[0], 2301);
  CU_ASSERT_EQUAL(blocks.shape[0], 1 + 32 + 5);
  /* Same answer as the library call. */
  uint8_t want[2301];
  int32_t idx[2301], ncu[4], cnt[3];
  upf_select_inputs in = upf_select_problem_inputs(&problem);
  upf_select_params p = upf_select_params_default();
  upf_select_outputs out = {.token_mask = want, .kept_index = idx, .new_cu_seqlens = ncu, .kept_count = cnt};
  CU_ASSERT_EQUAL_FATAL(cpu_select_run(&in, &p, &out), UPF_OK);
  CU_ASSERT(memcmp(mask.data, want, sizeof want) == 0);
  CU_ASSERT_EQUAL(kept.shape[0], out.kept_total);
  CU_ASSERT(out.kept_total < 2301); /* something was dropped, so the comparison means something */
  upf_tensor_free(&mask), upf_tensor_free(&blocks), upf_tensor_free(&kept);
  unlink(cli_path(&cli, "mask.npy")), unlink(cli_path(&cli, "blocks.npy")), unlink(cli_path(&cli, "kept.npy"));
}

/* Runs a select that must fail, then checks the exit code, that the message names `flag` (the
 * input at fault) and holds `message`, that it does not blame the mask output (unless that is at
 * fault), and that no output exists. */
static void expect_failure(const char *q, const char *k, const char *cu, const char *extra, const char *flag,
                           const char *message) {
  char args[2048];
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s %s", q, k, cu,
           cli_path(&cli, "mask.npy"),
           extra);
  int code = cli_run(&cli, "%s", args);
  CU_ASSERT_NOT_EQUAL(code, 0);
  CLI_ASSERT_STDERR(&cli, message);
  CLI_ASSERT_STDERR(&cli, flag);
  if (strcmp(flag, "--out-mask"))
    CU_ASSERT(!cli_stderr_has(&cli, "mask.npy"));
  CU_ASSERT(!cli_exists(cli_path(&cli, "mask.npy")));
  CU_ASSERT(!cli_exists(cli_path(&cli, "blocks.npy")));
}

static void test_bad_inputs_leave_no_file(void) {
  const char *q = cli_path(&cli, "q.npy"), *k = cli_path(&cli, "k.npy"), *cu = cli_path(&cli, "cu.npy");
  /* A truncated .npy. */
  FILE *f = fopen(cli_path(&cli, "bad.npy"), "wb");
  fwrite("\x93NUMPY\x01\x00\x10\x00{'descr'", 1, 20, f);
  fclose(f);
  expect_failure(cli_path(&cli, "bad.npy"), k, cu, "", "--q", "bad.npy");
  expect_failure(cli_path(&cli, "missing.npy"), k, cu, "", "--q", "missing.npy");
  expect_failure(q, cli_path(&cli, "missing.npy"), cu, "", "--k", "missing.npy");
  /* Non-monotone cu_seqlens. */
  int32_t bad_cu[4] = {0, 2001, 2000, 2301};
  upf_tensor t;
  int64_t shape[1] = {4};
  upf_tensor_init(&t, bad_cu, UPF_DTYPE_I32, 1, shape);
  upf_npy_write(cli_path(&cli, "cu_bad.npy"), &t);
  expect_failure(q, k, cli_path(&cli, "cu_bad.npy"), "", "--cu-seqlens", "monotone");
  /* cu_seqlens of the wrong dtype. */
  float cu_f[4] = {0, 1, 2001, 2301};
  upf_tensor_init(&t, cu_f, UPF_DTYPE_F32, 1, shape);
  upf_npy_write(cli_path(&cli, "cu_f32.npy"), &t);
  expect_failure(q, k, cli_path(&cli, "cu_f32.npy"), "", "--cu-seqlens", "<i4");
  /* k given as q: Hq=2 is not a multiple of Hkv=4; both inputs are named. */
  expect_failure(k, q, cu, "", "--k", "multiple of Hkv");
  CLI_ASSERT_STDERR(&cli, "--q");
  /* NaN in k (bf16 bits 0x7fc0). */
  uint16_t *kd = problem.k.data, saved = kd[1500 * 2 * 64 + 3];
  kd[1500 * 2 * 64 + 3] = 0x7fc0;
  upf_npy_write(cli_path(&cli, "k_nan.npy"), &problem.k);
  kd[1500 * 2 * 64 + 3] = saved;
  expect_failure(q, cli_path(&cli, "k_nan.npy"), cu, "", "--k", "NaN");
  CLI_ASSERT_STDERR(&cli, "k_nan.npy");
  expect_failure(q, k, cu, "--p 1.5", "--p", "p=1.5");
  expect_failure(q, k, cu, "--block 48", "--block", "power of two");
  expect_failure(q, k, cu, "--sink -1", "--sink", "negative");
  expect_failure(q, k, cu, "--p banana", "--p", "not a number");
  expect_failure(q, k, cu, "--backend tpu", "--backend", "unknown name");
  /* The second output cannot be written: it is found before anything is computed. */
  char extra[PATH_MAX + 32];
  snprintf(extra, sizeof extra, "--out-blocks %s/no/such/dir/b.npy", cli.dir);
  expect_failure(q, k, cu, extra, "--out-blocks", "b.npy");
  CU_ASSERT(!cli_stderr_has(&cli, "of 2301 tokens")); /* the selection's report line: it never ran */
  upf_select_problem_free(&problem);
}

/* The shared flag parser, as every subcommand sees it. */
static void test_flags_every_command(void) {
  static const char *const commands[] = {"select",   "verify",   "report",    "ops",      "models", "prefill",
                                         "generate", "export",   "serve-sim", "tokenize", "eval"};
  char args[2048], want[64];
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
    snprintf(args, sizeof args, "%s --help", commands[i]);
    CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 0);
    snprintf(want, sizeof want, "usage: upf %s", commands[i]);
    CLI_ASSERT_STDOUT(&cli, want);
    snprintf(args, sizeof args, "%s --no-such-flag", commands[i]);
    CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
    CLI_ASSERT_STDERR(&cli, "unknown option --no-such-flag");
  }
  const char *q = cli_path(&cli, "q.npy"), *k = cli_path(&cli, "k.npy"), *cu = cli_path(&cli, "cu.npy");
  const char *mask = cli_path(&cli, "mask.npy");
  static const struct {
    const char *args, *message;
  } bad[] = {
      {"select --out-mask", "--out-mask needs a value"},
      {"select --q --k k.npy", "--q needs a value"},
      {"select --q= --k k.npy", "--q needs a value"},
      {"verify --log", "--log needs a value"},
      {"verify --variant", "--variant needs a value"},
      {"report --out", "--out needs a value"},
      {"report --bench-filter", "--bench-filter needs a value"},
      {"select --q a.npy --q b.npy", "--q given twice"},
      {"verify --quick --quick", "--quick given twice"},
      {"report --no-bench --no-bench", "--no-bench given twice"},
      {"select --p 1e40", "--p: 1e40 is out of range"},
      {"select --scale 1e-300", "out of range"},
      {"select --block 99999999999", "--block: 99999999999 is out of range"},
      {"select --topk 3x", "not an integer"},
      {"verify all cpu", "unexpected argument 'cpu'"},
      {"ops gemm", "unexpected argument 'gemm'"},
      {"select --q q.npy", "--k is required"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CU_ASSERT_EQUAL(cli_run(&cli, "%s", bad[i].args), 2);
    CLI_ASSERT_STDERR(&cli, bad[i].message);
  }
  /* Two outputs naming one file, also through "./"; an output naming an input; a missing output
   * directory: each refused before anything is computed (no "kept N of 2301 tokens" line) and no file written. */
  char dot[256];
  snprintf(dot, sizeof dot, "%s/./mask.npy", cli.dir);
  const char *const extras[][2] = {
      {"--out-blocks", dot},
      {"--out-kept", mask},
  };
  for (size_t i = 0; i < 2; i++) {
    snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s %s %s", q, k, cu, mask,
             extras[i][0], extras[i][1]);
    CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
    CLI_ASSERT_STDERR(&cli, "name one file");
    CLI_ASSERT_STDERR(&cli, extras[i][0]);
    CLI_ASSERT_STDERR(&cli, "--out-mask");
    CU_ASSERT(!cli_stderr_has(&cli, "of 2301 tokens"));
    CU_ASSERT(!cli_exists(mask));
  }
  struct stat before, after;
  CU_ASSERT_EQUAL_FATAL(stat(k, &before), 0);
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s", q, k, cu, k);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
  CLI_ASSERT_STDERR(&cli, "would overwrite the input");
  CU_ASSERT(stat(k, &after) == 0 && after.st_ino == before.st_ino && after.st_size == before.st_size);
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s/none/m.npy", q, k, cu, cli.dir);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
  CLI_ASSERT_STDERR(&cli, "--out-mask");
  CLI_ASSERT_STDERR(&cli, "does not exist");
  CU_ASSERT(!cli_stderr_has(&cli, "of 2301 tokens"));
  CU_ASSERT_EQUAL_FATAL(symlink("nowhere/m.npy", cli_path(&cli, "dangling.npy")), 0);
  snprintf(args, sizeof args, "select --q %s --k %s --cu-seqlens %s --out-mask %s", q, k, cu,
           cli_path(&cli, "dangling.npy"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
  CLI_ASSERT_STDERR(&cli, "leads nowhere");
  CU_ASSERT(!cli_stderr_has(&cli, "of 2301 tokens"));
  snprintf(args, sizeof args, "verify --quick --log %s/none/v.log", cli.dir);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
  CLI_ASSERT_STDERR(&cli, "--log");
  CU_ASSERT(!cli_stdout_has(&cli, "passed"));
  snprintf(args, sizeof args, "report --quick --out %s/none/report", cli.dir);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 2);
  CLI_ASSERT_STDERR(&cli, "--out");
  CU_ASSERT(!cli_stderr_has(&cli, "verifying"));
}

/* A bad --bench-filter is an error, before verify when the regex does not compile, and after it
 * when the filter matches no benchmark; neither passes with an empty benchmark table. */
static void test_report_bench_filter(void) {
  char args[1024];
  snprintf(args, sizeof args, "report --quick --bench-filter '(' --out %s", cli_path(&cli, "rep_paren"));
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "%s", args), 0);
  CLI_ASSERT_STDERR(&cli, "--bench-filter");
  CLI_ASSERT_STDERR(&cli, "not a valid regular expression");
  CU_ASSERT(!cli_exists(cli_path(&cli, "rep_paren/verify.log")));
  snprintf(args, sizeof args, "report --quick --no-e2e --bench-filter 'no_such_benchmark_x' --out %s",
           cli_path(&cli, "rep_none"));
  CU_ASSERT_NOT_EQUAL(cli_run(&cli, "%s", args), 0);
  CLI_ASSERT_STDERR(&cli, "--bench-filter 'no_such_benchmark_x' matches no benchmark");
  CU_ASSERT(cli_file_contains(cli_path(&cli, "rep_none/summary.md"), "no benchmark matched"));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --help"), 0);
  CLI_ASSERT_STDOUT(&cli, "--bench-filter REGEX");
}

/* The report says where it ran (commit, date, host, device) in summary.md and in bench.json's
 * context, shows progress on stderr, and leaves the rates of CPU rows empty. */
static void test_report_stamps(void) {
  char args[1024];
  snprintf(args, sizeof args, "report --quick --no-e2e --bench-filter 'rmsnorm/cpu/' --out %s", cli_path(&cli, "rep"));
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 0);
  const char *summary = cli_path(&cli, "rep/summary.md"), *json = cli_path(&cli, "rep/bench.json");
  CU_ASSERT(cli_file_contains(summary, "- commit: ") && !cli_file_contains(summary, "- commit: \n"));
  CU_ASSERT(cli_file_contains(summary, "- date: 20"));
  CU_ASSERT(cli_file_contains(summary, "- host: ") && !cli_file_contains(summary, "- host: \n"));
  CU_ASSERT(cli_file_contains(summary, "- device: "));
  CU_ASSERT(cli_file_contains(json, "\"commit\": \""));
  CU_ASSERT(cli_file_contains(json, "\"device\": \""));
  CU_ASSERT(cli_file_contains(json, "\"date\": \""));
  CU_ASSERT(cli_file_contains(json, "\"host_name\": \""));
  /* The CPU row: median, spread and min, then four empty cells (rates, share, and no peer without --peers). */
  CU_ASSERT(cli_file_contains(summary, "| rmsnorm/cpu/bf16/llama/T:4096 | "));
  CU_ASSERT(cli_file_contains(summary, " ms |  |  |  |  |\n"));
  CLI_ASSERT_STDERR(&cli, "upf report: verify gemm");
  CLI_ASSERT_STDERR(&cli, "upf report: benchmarks matching");
}

/* `upf ops` lists every variant of every op that has them, the default marked; `upf verify
 * --variant` selects one and refuses a name that is not one. */
static void test_ops_and_variants(void) {
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "ops"), 0);
  int listed = 0;
  char want[128];
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    for (int i = 0; i < upf_variant_count((upf_op)op); i++) {
      const char *name = upf_variant_name(upf_variant_of((upf_op)op, i));
      snprintf(want, sizeof want, "  variant %-14s %s", name, i == 0 ? "(default)" : "");
      CLI_ASSERT_STDOUT(&cli, want);
      listed++;
    }
  }
  CU_ASSERT(listed >= 2); /* variants.def has entries, so the loop checked something */
  CU_ASSERT_EQUAL(cli_run(&cli, "verify --help"), 0);
  CLI_ASSERT_STDOUT(&cli, "--variant op=name[,op=name");
  CU_ASSERT_EQUAL(cli_run(&cli, "verify --backend cpu --variant attn.prefill=no-such-kernel"), 2);
  CLI_ASSERT_STDERR(&cli, "--variant");
  CLI_ASSERT_STDERR(&cli, "no variant 'no-such-kernel'");
  const upf_variant second = upf_variant_of(UPF_OP_ATTN_PAGED, 1);
  if (second != UPF_VARIANT_COUNT) {
    char args[256];
    snprintf(args, sizeof args, "verify attn.paged --quick --backend cpu --variant attn.paged=%s",
             upf_variant_name(second));
    CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 0);
    CLI_ASSERT_STDOUT(&cli, "0 failed");
  }
}

/* upf prefill on a tiny model: outputs, dumped masks replayed to the same logits, and bad input that
 * exits non-zero, names the input and writes no output. */
static void test_prefill(void) {
  char args[2048];
  const char *logits = cli_path(&cli, "logits.npy"), *replayed = cli_path(&cli, "logits-replayed.npy");
  const char *json = cli_path(&cli, "prefill.json");
  const char *masks = cli_path(&cli, "masks");
  CU_ASSERT_EQUAL_FATAL(mkdir(masks, 0755), 0);
  const char *base = "prefill --model llama-tiny --backend cpu --dtype f32 --mode uniprefill --lengths 120,20,1";
  snprintf(args, sizeof args, "%s --out-logits %s --dump-masks %s --json %s", base, logits, masks, json);
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "%s", args), 0);
  CLI_ASSERT_STDOUT(&cli, "drop layer  2: 141 ->");
  CU_ASSERT(cli_file_contains(json, "\"tokens_kept\""));
  CU_ASSERT(cli_file_contains(json, "\"partial_model\": false"));
  upf_tensor t;
  CU_ASSERT_EQUAL_FATAL(upf_npy_read(logits, &t), UPF_OK);
  CU_ASSERT(t.ndim == 2 && t.shape[0] == 3 && t.shape[1] == 512 && t.dtype == UPF_DTYPE_F32);
  upf_tensor_free(&t);
  CU_ASSERT(cli_exists(cli_path(&cli, "masks/layer2.npy")) && cli_exists(cli_path(&cli, "masks/layer4.npy")));
  snprintf(args, sizeof args, "%s --out-logits %s --replay-masks %s", base, replayed, masks);
  CU_ASSERT_EQUAL(cli_run(&cli, "%s", args), 0);
  CU_ASSERT(cli_same_npy(logits, replayed));

  /* a mask of the wrong length for its layer */
  upf_tensor short_mask;
  const int64_t shape[1] = {7};
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&short_mask, UPF_DTYPE_U8, 1, shape), UPF_OK);
  memset(short_mask.data, 1, 7);
  const char *bad_masks = cli_path(&cli, "bad-masks");
  CU_ASSERT_EQUAL_FATAL(mkdir(bad_masks, 0755), 0);
  CU_ASSERT_EQUAL(upf_npy_write(cli_path(&cli, "bad-masks/layer2.npy"), &short_mask), UPF_OK);
  CU_ASSERT_EQUAL(upf_npy_write(cli_path(&cli, "bad-masks/layer4.npy"), &short_mask), UPF_OK);
  upf_tensor_free(&short_mask);
  /* ids outside the vocabulary */
  upf_tensor ids;
  const int64_t ids_shape[1] = {3};
  CU_ASSERT_EQUAL_FATAL(upf_tensor_alloc(&ids, UPF_DTYPE_I32, 1, ids_shape), UPF_OK);
  ((int32_t *)ids.data)[0] = 1, ((int32_t *)ids.data)[1] = 512, ((int32_t *)ids.data)[2] = 3;
  CU_ASSERT_EQUAL(upf_npy_write(cli_path(&cli, "ids-bad.npy"), &ids), UPF_OK);
  upf_tensor_free(&ids);

  const char *out = cli_path(&cli, "must-not-exist.npy");
  char bad_replay[512], bad_ids[512];
  snprintf(bad_replay, sizeof bad_replay, "--mode uniprefill --lengths 120,20,1 --replay-masks %s", bad_masks);
  snprintf(bad_ids, sizeof bad_ids, "--token-ids %s", cli_path(&cli, "ids-bad.npy"));
  const struct {
    const char *args, *message;
  } bad[] = {
      {"--model llama-huge --lengths 10", "is not one of"},
      {"--model llama-tiny --lengths 100,0", "--lengths '100,0'"},
      {"--model llama-tiny --lengths 10 --token-ids x.npy", "exactly one of --lengths, --token-ids, --text and --file"},
      {"--model llama-tiny --mode uniprefill --lengths 100 --select topk --keep 1.5", "--keep 1.5"},
      {"--model llama-tiny --mode uniprefill --lengths 100 --select topk --keep 0", "--keep 0"},
      {"--model llama-tiny --mode uniprefill --lengths 100 --p 1.5", "--p 1.5"},
      {"--model llama-tiny --lengths 100 --p 0.5", "need --mode uniprefill"},
      {"--model llama-tiny --lengths 100 --layers 3:2", "--layers '3:2'"},
      {"--model llama-tiny --lengths 100 --dtype f16", "--dtype 'f16'"},
      {"--model llama-tiny --mode fast --lengths 100", "--mode 'fast'"},
      {"--model llama-tiny --lengths 100 --timeline trace.json", "--timeline records CUDA kernels: it needs --backend cuda"},
      {bad_ids, "outside the vocabulary"},
      {bad_replay, "replay mask: 7 entries, the layer has 141 tokens"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(args, sizeof args, "prefill %s%s --backend cpu --dtype f32 --out-logits %s",
             strstr(bad[i].args, "--model") ? "" : "--model llama-tiny ", bad[i].args, out);
    if (strstr(bad[i].args, "--dtype"))
      snprintf(args, sizeof args, "prefill %s --backend cpu --out-logits %s", bad[i].args, out);
    CU_ASSERT_NOT_EQUAL(cli_run(&cli, "%s", args), 0);
    CLI_ASSERT_STDERR(&cli, bad[i].message);
    CU_ASSERT(!cli_exists(out));
  }
  CU_ASSERT_EQUAL(cli_run(&cli, "models"), 0);
  CU_ASSERT(cli_stdout_has(&cli, "qwen3-next-tiny") && cli_stdout_has(&cli, "drop layers: 7 11 15 19 23 27"));
}

static CU_TestInfo cli_tests[] = {
    {"select writes the library's mask", test_select_writes_the_library_mask},
    {"bad inputs exit non-zero, name the input and leave no file", test_bad_inputs_leave_no_file},
    {"flags of every command: help, values, repeats, ranges, paths", test_flags_every_command},
    {"report: a bad or empty --bench-filter is an error", test_report_bench_filter},
    {"report: stamps, progress, no CPU rates", test_report_stamps},
    {"ops lists variants; verify --variant selects", test_ops_and_variants},
    {"prefill: outputs, masks dumped and replayed, bad input", test_prefill},
    CU_TEST_INFO_NULL,
};

void upf_register_cli_tests(void) { upf_test_suite("cli", setup, teardown, cli_tests); }
