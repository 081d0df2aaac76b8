/* `upf report`, the main job: verifies what this machine's backends can run (CUDA against the CPU
 * reference where a device is usable, else the CPU reference against its golden cases and
 * invariants), runs the benchmarks, and prints and writes a readable summary. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "perf/bench.h"
#include "verify/verify.h"

typedef struct {
  const char *out_dir;
  const char *bench_filter;
  int quick, bench;
} report_args;

/* Per-op verify tallies, read back from the log so the summary can say which op failed. */
typedef struct {
  int passed[UPF_OP_COUNT], failed[UPF_OP_COUNT];
} verify_tally;

static void tally_log(const char *path, verify_tally *t) {
  memset(t, 0, sizeof *t);
  FILE *f = fopen(path, "r");
  char line[1024], verdict[8], op[64];
  while (f && fgets(line, sizeof line, f)) {
    if (sscanf(line, "%7s %63s", verdict, op) != 2)
      continue;
    upf_op id = upf_op_by_name(op);
    if (id == UPF_OP_COUNT)
      continue;
    if (!strcmp(verdict, "PASS"))
      t->passed[id]++;
    else if (!strcmp(verdict, "FAIL"))
      t->failed[id]++;
  }
  if (f)
    fclose(f);
}

static void print_summary(FILE *out, const upf_backend *be, const verify_tally *t, int verify_failed,
                          const upf_bench_result *res, int nres, const report_args *a) {
  fprintf(out, "# uniprefill report\n\n");
  fprintf(out, "backend under test: %s (%s)\n\n", be->name, be->describe());
  fprintf(out, "## verify (%s)\n\n", be == upf_backend_cpu() ? "CPU reference: golden cases, invariants, stage chain"
                                                              : "against the CPU reference, SPEC section 7");
  fprintf(out, "| op | passed | failed |\n|---|---:|---:|\n");
  for (int op = 0; op < UPF_OP_COUNT; op++)
    fprintf(out, "| %s | %d | %d |\n", upf_op_name((upf_op)op), t->passed[op], t->failed[op]);
  fprintf(out, "\nverify: %s (log: %s/verify.log)\n\n", verify_failed ? "FAILED" : "all checks passed", a->out_dir);
  if (!a->bench)
    return;
  fprintf(out, "## benchmarks (median over repetitions; spread = coefficient of variation)\n\n");
  fprintf(out, "| benchmark | median | spread | min | TFLOP/s | TB/s | share of copy BW |\n");
  fprintf(out, "|---|---:|---:|---:|---:|---:|---:|\n");
  for (int i = 0; i < nres; i++) {
    const upf_bench_result *r = &res[i];
    if (r->error) {
      fprintf(out, "| %s | %s | | | | | |\n", r->name, r->no_device ? "skipped (no device)" : r->error);
      continue;
    }
    double flops = upf_bench_result_counter(r, UPF_BENCH_FLOPS), bytes = upf_bench_result_counter(r, UPF_BENCH_BYTES);
    double share = upf_bench_result_counter(r, UPF_BENCH_COPY_SHARE);
    char f[32] = "", b[32] = "", s[32] = "";
    if (!isnan(flops))
      snprintf(f, sizeof f, "%.3g", flops / 1e12);
    if (!isnan(bytes))
      snprintf(b, sizeof b, "%.3g", bytes / 1e12);
    if (!isnan(share))
      snprintf(s, sizeof s, "%.2f", share);
    fprintf(out, "| %s | %.4g ms | %.1f%% | %.4g ms | %s | %s | %s |\n", r->name, r->median_s * 1e3, r->cv * 100.0,
            r->min_s * 1e3, f, b, s);
  }
  fprintf(out, "\nfull results: %s/bench.json\n", a->out_dir);
}

int upf_cli_report(int argc, char **argv) {
  report_args a = {.out_dir = "build/report", .bench = 1};
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--out") && i + 1 < argc)
      a.out_dir = argv[++i];
    else if (!strcmp(argv[i], "--bench-filter") && i + 1 < argc)
      a.bench_filter = argv[++i];
    else if (!strcmp(argv[i], "--quick"))
      a.quick = 1;
    else if (!strcmp(argv[i], "--no-bench"))
      a.bench = 0;
    else {
      fprintf(stderr, "upf report: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (mkdir(a.out_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "upf report: cannot create %s: %s\n", a.out_dir, strerror(errno));
    return 1;
  }
  const upf_backend *be = upf_cli_default_backend();
  char path[1024];
  snprintf(path, sizeof path, "%s/verify.log", a.out_dir);
  FILE *log = fopen(path, "w");
  if (!log) {
    fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
    return 1;
  }
  printf("upf report: verifying %s (%s) ...\n", be->name, be->describe());
  fflush(stdout);
  int verify_failed = upf_cli_verify(be, "all", a.quick, log);
  fclose(log);
  verify_tally tally;
  tally_log(path, &tally);

  upf_bench_result *res = NULL;
  int nres = 0, bench_failed = 0;
  if (a.bench) {
    /* Without a device the CPU reference at 128K takes tens of seconds a run; the default keeps the
     * main job to a few minutes there. */
    const char *filter = a.bench_filter ? a.bench_filter
                         : be == upf_backend_cpu() ? (a.quick ? "copy|select/cpu/bf16/T:8192/"
                                                              : "copy|select/cpu/bf16/T:(8192|32768)/|"
                                                                "(gemm|ffn|rmsnorm|rope|moe.ffn)/cpu/")
                                                   : ".";
    char out_arg[1100], filter_arg[512];
    snprintf(out_arg, sizeof out_arg, "--benchmark_out=%s/bench.json", a.out_dir);
    snprintf(filter_arg, sizeof filter_arg, "--benchmark_filter=%s", filter);
    char *bargv[] = {"upf", out_arg, "--benchmark_out_format=json", filter_arg, NULL};
    upf_bench_add_context("command", "upf report");
    upf_register_all_benchmarks();
    upf_status st = upf_bench_run(4, bargv, &res, &nres);
    if (st != UPF_OK) {
      upf_cli_error(st, "benchmarks");
      bench_failed = 1;
    }
    for (int i = 0; i < nres; i++)
      bench_failed |= res[i].error && !res[i].no_device;
  }
  snprintf(path, sizeof path, "%s/summary.md", a.out_dir);
  FILE *summary = fopen(path, "w");
  printf("\n");
  print_summary(stdout, be, &tally, verify_failed, res, nres, &a);
  if (summary) {
    print_summary(summary, be, &tally, verify_failed, res, nres, &a);
    fclose(summary);
    printf("\nsummary written to %s\n", path);
  }
  upf_bench_results_free(res, nres);
  return verify_failed || bench_failed ? 1 : 0;
}
