/* The CI gate `upf report --compare OLD.json NEW.json` on hand-made report.json files (docs/report.md):
 * identical reports pass, a 10% slowdown with a tight spread fails, the same slowdown within the
 * repetitions' spread passes, a grown verify failure count or a fall in agreement fails, rows in one
 * file only are listed and not failed, and bad files or flags exit 2 naming them. Also the report
 * itself: its report.json reads back through the gate. Runs the upf binary beside this test binary. */
#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/cli_harness.h"
#include "tests/test_util.h"

static cli_suite cli;

static int setup(void) {
  if (cli_setup(&cli, "upf_report"))
    return 1;
  cli.run_in_dir = 1;
  return 0;
}

static int teardown(void) { return cli_teardown(&cli); }

/* One report: a kernel row (median and spread in ms), an end-to-end row with its agreement, a verify
 * row of rope with `rope_failed` failures, and one row of each named only-row id (NULL: none). The
 * strings carry an escape and the numbers an exponent and NaN, as Google Benchmark and Python write. */
typedef struct {
  double gemm_ms, gemm_spread;
  double e2e_ms, e2e_spread, agreement;
  int rope_failed;
  const char *only_kernel; /* a kernel row this side alone has */
  int version;
  const char *schema;
} fixture;

static fixture base(void) {
  return (fixture){.gemm_ms = 10.0, .gemm_spread = 0.02, .e2e_ms = 120.0, .e2e_spread = 0.5, .agreement = 0.95,
                   .version = 1, .schema = "uniprefill-report"};
}

static int write_report(const char *name, fixture f) {
  char only[256] = "";
  if (f.only_kernel)
    snprintf(only, sizeof only, ",\n {\"id\": \"%s\", \"median_ms\": 1.0, \"spread_ms\": 0.0}", f.only_kernel);
  char text[4096];
  snprintf(text, sizeof text,
           "{\"schema\": \"%s\", \"version\": %d,\n"
           " \"stamp\": {\"commit\": \"abc1234\", \"device\": \"none (\\\"test\\\")\", \"date\": \"2026-01-01\",\n"
           "           \"commands\": [\"upf report --quick\"], \"quick\": true, \"clocks\": null},\n"
           " \"verify\": [{\"id\": \"gemm\", \"passed\": 43, \"failed\": 0},\n"
           "            {\"id\": \"rope\", \"passed\": %d, \"failed\": %d}],\n"
           " \"kernels\": [{\"id\": \"gemm/cpu/f32/T:1024\", \"median_ms\": %.17g, \"spread_ms\": %.17g, \"cv\": NaN,\n"
           "               \"ceiling_share\": null, \"repetitions\": 5}%s],\n"
           " \"e2e\": [{\"id\": \"llama-tiny/uniprefill/512\", \"ttft_ms\": %.17g, \"spread_ms\": %.17g,\n"
           "           \"agreement\": %.17g, \"kept_share\": 3.5e-1, \"layers\": {\"attention\": 1.25e1}}],\n"
           " \"serving\": [], \"accuracy\": [], \"verdict\": \"\\u2713 ok\"}\n",
           f.schema, f.version, 67 - f.rope_failed, f.rope_failed, f.gemm_ms, f.gemm_spread, only, f.e2e_ms,
           f.e2e_spread, f.agreement);
  return cli_write_text(&cli, name, text);
}

static void test_identical_passes(void) {
  CU_ASSERT_FATAL(write_report("a.json", base()));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare a.json a.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "| kernels | gemm/cpu/f32/T:1024 | 10 ms | 10 ms | 1.000 |");
  CLI_ASSERT_STDOUT(&cli, "| e2e | llama-tiny/uniprefill/512 | 120 ms | 120 ms | 1.000 |");
  CLI_ASSERT_STDOUT(&cli, "gate: PASS: 4 rows compared, 0 slower");
  CLI_ASSERT_STDOUT(&cli, "commit abc1234");
}

/* 10 -> 11 ms with spreads of 0.02 ms: allowed 0.5 + 2 x 0.04 = 0.58 ms, so 1 ms is a slowdown; an e2e
 * slowdown counts the same. At a 15% threshold (1.58 ms allowed) it passes. */
static void test_slowdown_fails(void) {
  fixture f = base();
  CU_ASSERT_FATAL(write_report("old.json", f));
  f.gemm_ms = 11.0;
  CU_ASSERT_FATAL(write_report("slow.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare old.json slow.json --threshold 5%%"), 1);
  CLI_ASSERT_STDOUT(&cli, "| kernels | gemm/cpu/f32/T:1024 | 10 ms | 11 ms | 1.100 | +0.58 ms | SLOWER |");
  CLI_ASSERT_STDOUT(&cli, "gate: FAIL: 4 rows compared, 1 slower beyond threshold and noise, 0 correctness");
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare old.json slow.json"), 1); /* the default is 5% */
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare old.json slow.json --threshold 15"), 0);
  CLI_ASSERT_STDOUT(&cli, "ok (within noise)");
  /* the other way round it is faster, which passes */
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare slow.json old.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "| faster |");
  f = base();
  f.e2e_ms = 140.0; /* allowed 6 + 2 x 1 = 8 ms */
  CU_ASSERT_FATAL(write_report("slow_e2e.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare old.json slow_e2e.json"), 1);
  CLI_ASSERT_STDOUT(&cli, "| e2e | llama-tiny/uniprefill/512 | 120 ms | 140 ms | 1.167 | +8 ms | SLOWER |");
}

/* The same 10% with a spread of 0.3 ms a side: allowed 0.5 + 2 x 0.6 = 1.7 ms > 1 ms: noise. */
static void test_within_noise_passes(void) {
  fixture f = base();
  f.gemm_spread = 0.3;
  CU_ASSERT_FATAL(write_report("noisy_old.json", f));
  f.gemm_ms = 11.0;
  CU_ASSERT_FATAL(write_report("noisy_new.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare noisy_old.json noisy_new.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "| 1.100 | +1.7 ms | ok (within noise) |");
  CLI_ASSERT_STDOUT(&cli, "gate: PASS");
}

/* One more failed rope check fails the gate whatever the timings; an agreement 0.02 lower too. */
static void test_correctness_regression_fails(void) {
  fixture f = base();
  CU_ASSERT_FATAL(write_report("ok.json", f));
  f.rope_failed = 1;
  CU_ASSERT_FATAL(write_report("vfail.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare ok.json vfail.json"), 1);
  CLI_ASSERT_STDOUT(&cli, "| verify | rope | 67 passed, 0 failed | 66 passed, 1 failed | | | REGRESSED |");
  CLI_ASSERT_STDOUT(&cli, "1 correctness regressions");
  /* failing on both sides is not a regression, but it is shown */
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare vfail.json vfail.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "failing in both");
  f = base();
  f.agreement = 0.93;
  CU_ASSERT_FATAL(write_report("agree.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare ok.json agree.json"), 1);
  CLI_ASSERT_STDOUT(&cli, "| e2e agreement | llama-tiny/uniprefill/512 | 0.9500 | 0.9300 |");
  f.agreement = 0.945; /* within the 0.01 allowed */
  CU_ASSERT_FATAL(write_report("agree_ok.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare ok.json agree_ok.json"), 0);
}

/* A kernel that only OLD has and one only NEW has are listed; the gate still passes. */
static void test_rows_on_one_side_listed(void) {
  fixture f = base();
  f.only_kernel = "attn_prefill/cpu/retired";
  CU_ASSERT_FATAL(write_report("one_old.json", f));
  f.only_kernel = "attn_prefill/cpu/new";
  CU_ASSERT_FATAL(write_report("one_new.json", f));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare one_old.json one_new.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "- only in OLD: kernels attn_prefill/cpu/retired");
  CLI_ASSERT_STDOUT(&cli, "- only in NEW: kernels attn_prefill/cpu/new");
  CLI_ASSERT_STDOUT(&cli, "gate: PASS: 4 rows compared, 0 slower beyond threshold and noise, 0 correctness "
                          "regressions, 0 faster, 1 only in OLD, 1 only in NEW");
}

/* Bad files and flags exit 2 with a message naming them, and print no table. */
static void test_bad_inputs(void) {
  fixture f = base();
  CU_ASSERT_FATAL(write_report("good.json", f));
  f.version = 2;
  CU_ASSERT_FATAL(write_report("v2.json", f));
  f = base();
  f.schema = "something-else";
  CU_ASSERT_FATAL(write_report("other.json", f));
  CU_ASSERT_FATAL(cli_write_text(&cli, "broken.json", "{\"schema\": \"uniprefill-report\", \"version\": 1,\n \"kernels\": [}"));
  CU_ASSERT_FATAL(cli_write_text(&cli, "trailing.json", "{\"schema\": \"uniprefill-report\", \"version\": 1} x"));
  static const struct {
    const char *args, *message;
  } bad[] = {
      {"report --compare good.json", "--compare takes two files"},
      {"report --compare good.json good.json good.json", "--compare takes two files, OLD.json NEW.json (got 3)"},
      {"report --compare good.json missing.json", "missing.json"},
      {"report --compare good.json broken.json", "broken.json: not valid JSON at byte 59: expected a value"},
      {"report --compare trailing.json good.json", "trailing.json: not valid JSON at byte 46: text after the document"},
      {"report --compare good.json v2.json", "v2.json has \"version\" 2"},
      {"report --compare other.json good.json", "other.json is not a upf report.json"},
      {"report --compare good.json good.json --threshold x", "--threshold 'x' is not a percentage"},
      {"report --compare good.json good.json --threshold -1%", "--threshold '-1%' is not a percentage"},
      {"report --compare good.json good.json --quick", "--quick"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const int code = cli_run(&cli, "%s", bad[i].args);
    CU_ASSERT_EQUAL(code, 2);
    if (code != 2)
      printf("\n  upf %s: exit %d, want 2", bad[i].args, code);
    CLI_ASSERT_STDERR(&cli, bad[i].message);
    CU_ASSERT(!cli_stdout_has(&cli, "gate:"));
  }
}

/* The report itself on this machine, one tiny model at one length: report.md has every section and ends
 * with the verdict, report.json reads back through the gate (against itself: PASS), and every run's
 * command is recorded. On the CPU backend (a device's report is minutes); tens of seconds on 2 cores: native
 * runs only. */
static void test_report_writes_json_the_gate_reads(void) {
  if (upf_test_skip_quick("report", "report_writes_json", "a report run takes tens of seconds"))
    return;
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "report --quick --no-bench --backend cpu --models llama-tiny --lengths 256 --out rep"), 0);
  const char *md = cli_path(&cli, "rep/report.md"), *json = cli_path(&cli, "rep/report.json");
  CU_ASSERT(cli_file_contains(md, "## verify"));
  CU_ASSERT(cli_file_contains(md, "### llama-tiny (cpu, bf16)"));
  CU_ASSERT(cli_file_contains(md, "| 256 | uniprefill |"));
  CU_ASSERT(cli_file_contains(md, "| 256 | compact |"));
  CU_ASSERT(cli_file_contains(md, "## serving"));
  CU_ASSERT(cli_file_contains(md, "| llama-tiny | compact-chunked | 8 |")); /* every serving method served its 8 */
  CU_ASSERT(cli_file_contains(md, "| llama-tiny | dense-chunked | 8 |"));
  CU_ASSERT(cli_file_contains(md, "upf serve-sim --model llama-tiny --requests 8 --prompt-len 256..512 --decode-len 8 "
                                  "--mode compact --chunk 128"));
  CU_ASSERT(cli_file_contains(md, "## plots"));
  CU_ASSERT(cli_file_contains(md, "upf prefill --model llama-tiny --lengths 256 --mode flashprefill"));
  CU_ASSERT(cli_file_contains(md, "\nverdict: OK: verify "));
  CU_ASSERT(cli_file_contains(json, "\"schema\": \"uniprefill-report\", \"version\": 1"));
  CU_ASSERT(cli_file_contains(json, "\"id\": \"llama-tiny/dense/256\""));
  /* the dense work by hand (llama-tiny, 256 tokens: 6 layers of 2 x 256 x 128 x (256 + 128 + 768) GEMM FLOPs
   * and the head's 2 x 128 x 512; 6 x 4 x 32 x 4 x 256 x 257 / 2 attention FLOPs); no limit on the CPU */
  CU_ASSERT(cli_file_contains(json, "\"dense_work\": {\"gemm_flop\": 453115904, \"moe_flop\": 0, \"attn_flop\": 101056512,"));
  CU_ASSERT(cli_file_contains(md, "limit: not computed"));
  CU_ASSERT(cli_exists(cli_path(&cli, "rep/runs/prefill-llama-tiny-uniprefill-256.json")));
  CLI_ASSERT_STDOUT(&cli, "report written to rep/report.md");
  CLI_ASSERT_STDERR(&cli, "upf report: [1/");
  CU_ASSERT_EQUAL(cli_run(&cli, "report --compare rep/report.json rep/report.json"), 0);
  CLI_ASSERT_STDOUT(&cli, "| e2e | llama-tiny/uniprefill/256 |");
  CLI_ASSERT_STDOUT(&cli, "gate: PASS");
}

/* --peers: a bad table exits 2 naming the file before any work; a good one puts each row beside the
 * benchmark its id names (a '/'-bounded prefix of the name: decode64_ctx4 is not decode64_ctx4K), in
 * report.md (the peer's time / ours) and report.json (vs_peer), and lists the rows no benchmark took. */
static void test_peers(void) {
  CU_ASSERT_FATAL(cli_write_text(&cli, "notpeers.json", "{\"schema\": \"uniprefill-report\", \"version\": 1}"));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --peers notpeers.json --out nothing"), 2);
  CLI_ASSERT_STDERR(&cli, "--peers notpeers.json: not a peer table");
  CU_ASSERT_FALSE(cli_exists(cli_path(&cli, "nothing")));
  CU_ASSERT_FATAL(cli_write_text(&cli, "badrow.json", "{\"schema\": \"uniprefill-peers\", \"version\": 1, "
                                                      "\"rows\": [{\"id\": \"x\", \"peer\": \"p\", \"median_ms\": 0}]}"));
  CU_ASSERT_EQUAL(cli_run(&cli, "report --peers badrow.json --out nothing"), 2);
  CLI_ASSERT_STDERR(&cli, "row 0 needs");
  CU_ASSERT_EQUAL(cli_run(&cli, "report --peers badrow.json --no-bench --out nothing"), 2);
  CLI_ASSERT_STDERR(&cli, "--peers and --no-bench contradict");
  if (upf_test_skip_quick("report", "peers", "a report run takes tens of seconds"))
    return;
  CU_ASSERT_FATAL(
      cli_write_text(&cli, "peers.json",
                     "{\"schema\": \"uniprefill-peers\", \"version\": 1, \"rows\": [\n"
                     " {\"id\": \"kv.slot_mapping/cpu/decode64_ctx4\", \"peer\": \"not a boundary\", \"median_ms\": 1},\n"
                     " {\"id\": \"kv.slot_mapping/cpu/decode64_ctx4K\", \"peer\": \"hand peer\", \"median_ms\": 2.5e3},\n"
                     " {\"id\": \"gemm/cuda/bf16/none\", \"peer\": \"absent\", \"median_ms\": 3}]}\n"));
  CU_ASSERT_EQUAL_FATAL(cli_run(&cli, "report --quick --no-e2e --backend cpu --bench-filter '^kv[.]slot_mapping/cpu/' "
                                      "--peers peers.json --out peered"), 0);
  const char *md = cli_path(&cli, "peered/report.md"), *json = cli_path(&cli, "peered/report.json");
  CU_ASSERT(cli_file_contains(md, "| peer: its time / ours |"));
  CU_ASSERT(cli_file_contains(md, " | hand peer: ")); /* 2.5 s against microseconds: a large ratio */
  CU_ASSERT(cli_file_contains(md, "peer row with no benchmark in this run: kv.slot_mapping/cpu/decode64_ctx4 (not a boundary)"));
  CU_ASSERT(cli_file_contains(md, "peer row with no benchmark in this run: gemm/cuda/bf16/none (absent)"));
  CU_ASSERT(cli_file_contains(json, "\"vs_peer\": {\"name\": \"hand peer\", \"median_ms\": 2500, \"speedup\": "));
}

static CU_TestInfo tests[] = {
    {"identical reports pass", test_identical_passes},
    {"a 10% slowdown with a tight spread fails", test_slowdown_fails},
    {"a slowdown within the spread passes", test_within_noise_passes},
    {"a verify failure or an agreement fall fails", test_correctness_regression_fails},
    {"rows in one file only are listed, not failed", test_rows_on_one_side_listed},
    {"bad files and flags exit 2 naming them", test_bad_inputs},
    {"the report's JSON reads back through the gate", test_report_writes_json_the_gate_reads},
    {"--peers: each peer row beside its benchmark, bad tables refused", test_peers},
    CU_TEST_INFO_NULL,
};

void upf_register_report_tests(void) { upf_test_suite("report", setup, teardown, tests); }
