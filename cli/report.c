/* `upf report`, the main job: verifies what this machine's backends can run (CUDA against the CPU
 * reference where a device is usable, else the CPU reference against its golden cases and
 * invariants), runs the benchmarks, and prints and writes a readable summary stamped with the
 * commit, date, host and device. Progress of the long steps goes to stderr. */
#define _GNU_SOURCE /* fopencookie: the verify log is teed to a progress line per op */
#include <errno.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "perf/bench.h"
#include "uniprefill/provenance.h"
#include "uniprefill/variant.h"
#include "verify/verify.h"

const char upf_cli_report_usage[] =
    "usage: upf report [--out DIR] [--quick] [--no-bench] [--bench-filter REGEX]\n"
    "  The main job: verify, benchmark, and write DIR/summary.md, verify.log, bench.json (DIR defaults\n"
    "  to build/report and is created; its parent must exist). --quick verifies the smaller case set;\n"
    "  --bench-filter runs the benchmarks whose name matches REGEX (bench_upf --benchmark_list_tests\n"
    "  lists them; a leading '-' excludes) instead of the default set; one that matches nothing is an\n"
    "  error. Results are stamped with commit, date, host, device and kernel variants. Without --quick, a\n"
    "  short check on real weights (SmolLM2-135M from $UPF_MODEL_DIR or ci/fetch-models.sh's cache:\n"
    "  dense perplexity over 1K tokens, UniPrefill next-token agreement over 2K, CPU) is added when the\n"
    "  file is present, and skipped with a line when it is not.\n";

typedef struct {
  const char *out_dir;
  const char *bench_filter;
  int quick, no_bench;
} report_args;

/* What the results are stamped with. */
typedef struct {
  char commit[64], date[40], host[256], device[512], variants[512];
} report_stamp;

static void make_stamp(report_stamp *s) {
  if (!upf_source_commit(s->commit, sizeof s->commit))
    snprintf(s->commit, sizeof s->commit, "unknown (not a git checkout, UPF_COMMIT unset)");
  time_t now = time(NULL);
  struct tm tm;
  if (!localtime_r(&now, &tm) || !strftime(s->date, sizeof s->date, "%Y-%m-%dT%H:%M:%S%z", &tm))
    snprintf(s->date, sizeof s->date, "unknown");
  if (gethostname(s->host, sizeof s->host) != 0)
    snprintf(s->host, sizeof s->host, "unknown");
  s->host[sizeof s->host - 1] = '\0';
  const upf_backend *cuda = upf_backend_cuda();
  if (cuda->probe() == UPF_OK)
    snprintf(s->device, sizeof s->device, "%s", cuda->describe());
  else
    snprintf(s->device, sizeof s->device, "none (%s)", upf_last_error());
  if (upf_variant_describe(s->variants, sizeof s->variants) != UPF_OK)
    snprintf(s->variants, sizeof s->variants, "invalid (%s)", upf_last_error());
  else if (!s->variants[0])
    snprintf(s->variants, sizeof s->variants, "none");
}

/* ---- verify, with a progress line per op on stderr ---- */

/* The verify log passes through here on its way to the file: one stderr line when an op starts. */
typedef struct {
  FILE *file;
  char line[256];
  size_t len;
  char op[64];
  int ops, checks, failed;
} progress_tee;

static void progress_line(progress_tee *t) {
  char verdict[8], op[64];
  t->line[t->len] = '\0';
  if (sscanf(t->line, "%7s %63s", verdict, op) != 2 || (strcmp(verdict, "PASS") && strcmp(verdict, "FAIL")))
    return;
  t->checks++;
  t->failed += !strcmp(verdict, "FAIL");
  if (strcmp(op, t->op)) {
    snprintf(t->op, sizeof t->op, "%s", op);
    fprintf(stderr, "upf report: verify %-22s (op %d of %d; %d checks so far, %d failed)\n", op, ++t->ops, UPF_OP_COUNT,
            t->checks - 1, t->failed - !strcmp(verdict, "FAIL"));
  }
}

static ssize_t progress_write(void *cookie, const char *buf, size_t n) {
  progress_tee *t = cookie;
  if (fwrite(buf, 1, n, t->file) != n)
    return -1;
  for (size_t i = 0; i < n; i++) {
    if (buf[i] == '\n') {
      progress_line(t);
      t->len = 0;
    } else if (t->len < sizeof t->line - 1) {
      t->line[t->len++] = buf[i];
    }
  }
  return (ssize_t)n;
}

static int progress_close(void *cookie) {
  progress_tee *t = cookie;
  return fclose(t->file);
}

/* Runs verify into `path`; returns the number of failed checks, or -1 when the log cannot be written. */
static int verify_with_progress(const upf_backend *be, int quick, const char *path) {
  progress_tee tee = {.file = fopen(path, "w")};
  if (!tee.file) {
    fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  cookie_io_functions_t io = {.write = progress_write, .close = progress_close};
  FILE *log = fopencookie(&tee, "w", io);
  if (!log) {
    fclose(tee.file);
    fprintf(stderr, "upf report: cannot open the verify log stream: %s\n", strerror(errno));
    return -1;
  }
  fprintf(stderr, "upf report: verifying %s (%s)%s ...\n", be->name, be->describe(), quick ? ", quick set" : "");
  time_t start = time(NULL);
  int failed = upf_cli_verify(be, "all", quick, log);
  if (fclose(log) != 0) {
    fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  fprintf(stderr, "upf report: verify done in %.0f s: %d checks, %d failed\n", difftime(time(NULL), start), tee.checks,
          failed);
  return failed;
}

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

/* ---- summary ---- */

/* The share cell: each ceiling the benchmark measured itself against. */
static void share_cell(const upf_bench_result *r, char *buf, size_t cap) {
  double copy = upf_bench_result_counter(r, UPF_BENCH_COPY_SHARE);
  double gemm = upf_bench_result_counter(r, UPF_BENCH_CUBLAS_SHARE);
  size_t used = 0;
  buf[0] = '\0';
  if (!isnan(gemm))
    used += (size_t)snprintf(buf, cap, "%.2f of cuBLAS", gemm);
  if (!isnan(copy) && used < cap)
    snprintf(buf + used, cap - used, "%s%.2f of copy BW", used ? ", " : "", copy);
}

static void print_summary(FILE *out, const upf_backend *be, const report_stamp *stamp, const verify_tally *t,
                          int verify_failed, const upf_bench_result *res, int nres, const report_args *a,
                          const char *real_weights) {
  fprintf(out, "# uniprefill report\n\n");
  fprintf(out, "- commit: %s\n- date: %s\n- host: %s\n- device: %s\n- kernel variants: %s\n", stamp->commit,
          stamp->date, stamp->host, stamp->device, stamp->variants);
  fprintf(out, "- backend under test: %s (%s)\n\n", be->name, be->describe());
  fprintf(out, "## verify (%s)\n\n", be == upf_backend_cpu() ? "CPU reference: golden cases, invariants, stage chain"
                                                              : "against the CPU reference, SPEC section 7");
  fprintf(out, "| op | passed | failed |\n|---|---:|---:|\n");
  for (int op = 0; op < UPF_OP_COUNT; op++)
    fprintf(out, "| %s | %d | %d |\n", upf_op_name((upf_op)op), t->passed[op], t->failed[op]);
  fprintf(out, "\nverify: %s (log: %s/verify.log)\n\n", verify_failed ? "FAILED" : "all checks passed", a->out_dir);
  fputs(real_weights, out);
  if (a->no_bench)
    return;
  fprintf(out, "## benchmarks (median over repetitions; spread = coefficient of variation)\n\n");
  if (nres == 0) {
    fprintf(out, "no benchmark matched '%s'\n", a->bench_filter ? a->bench_filter : "");
    return;
  }
  fprintf(out, "Rates and shares are given for device kernels only: the CPU reference is timed as a baseline,\n"
               "and its rates against a device's ceilings mean nothing.\n\n");
  fprintf(out, "| benchmark | median | spread | min | TFLOP/s | TB/s | share of ceiling |\n");
  fprintf(out, "|---|---:|---:|---:|---:|---:|---:|\n");
  for (int i = 0; i < nres; i++) {
    const upf_bench_result *r = &res[i];
    if (r->error) {
      fprintf(out, "| %s | %s | | | | | |\n", r->name, r->no_device ? "skipped (no device)" : r->error);
      continue;
    }
    char f[32] = "", b[32] = "", s[64] = "";
    if (!strstr(r->name, "/cpu/")) {
      double flops = upf_bench_result_counter(r, UPF_BENCH_FLOPS), bytes = upf_bench_result_counter(r, UPF_BENCH_BYTES);
      if (!isnan(flops))
        snprintf(f, sizeof f, "%.3g", flops / 1e12);
      if (!isnan(bytes))
        snprintf(b, sizeof b, "%.3g", bytes / 1e12);
      share_cell(r, s, sizeof s);
    }
    fprintf(out, "| %s | %.4g ms | %.1f%% | %.4g ms | %s | %s | %s |\n", r->name, r->median_s * 1e3, r->cv * 100.0,
            r->min_s * 1e3, f, b, s);
  }
  fprintf(out, "\nfull results: %s/bench.json\n", a->out_dir);
}

/* ---- the command ---- */

/* A filter Google Benchmark can use: an extended regular expression, optionally after one '-'. */
static int filter_compiles(const char *filter) {
  regex_t re;
  const char *pattern = filter[0] == '-' ? filter + 1 : filter;
  int rc = regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB);
  if (rc != 0) {
    char why[256];
    regerror(rc, &re, why, sizeof why);
    fprintf(stderr, "upf report: --bench-filter '%s' is not a valid regular expression: %s\n", filter, why);
    return 0;
  }
  regfree(&re);
  return 1;
}

int upf_cli_report(int argc, char **argv) {
  report_args a = {.out_dir = "build/report"};
  upf_arg args[] = {
      {"--out", UPF_ARG_STRING, &a.out_dir},
      {"--bench-filter", UPF_ARG_STRING, &a.bench_filter},
      {"--quick", UPF_ARG_SWITCH, &a.quick},
      {"--no-bench", UPF_ARG_SWITCH, &a.no_bench},
  };
  upf_arg_parser p = {"upf report", upf_cli_report_usage, args, (int)(sizeof args / sizeof args[0])};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  if (a.bench_filter && a.no_bench) {
    fprintf(stderr, "upf report: --bench-filter and --no-bench contradict each other\n");
    return 2;
  }
  if (a.bench_filter && !filter_compiles(a.bench_filter))
    return 2;
  struct stat st;
  if (mkdir(a.out_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "upf report: --out %s: cannot create: %s\n", a.out_dir, strerror(errno));
    return 2;
  }
  if (stat(a.out_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "upf report: --out %s is not a directory\n", a.out_dir);
    return 2;
  }
  const upf_backend *be = upf_cli_default_backend();
  report_stamp stamp;
  make_stamp(&stamp);
  char path[1024];
  snprintf(path, sizeof path, "%s/verify.log", a.out_dir);
  int verify_failed = verify_with_progress(be, a.quick, path);
  if (verify_failed < 0)
    return 1;
  verify_tally tally;
  tally_log(path, &tally);

  upf_bench_result *res = NULL;
  int nres = 0, bench_failed = 0;
  if (!a.no_bench) {
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
    upf_bench_add_context("commit", stamp.commit);
    upf_bench_add_context("device", stamp.device);
    upf_bench_add_context("backend", be->name);
    upf_bench_add_context("variants", stamp.variants);
    upf_register_all_benchmarks();
    fprintf(stderr, "upf report: benchmarks matching '%s' (each line below as it finishes) ...\n", filter);
    time_t start = time(NULL);
    upf_status st = upf_bench_run(4, bargv, &res, &nres);
    if (st != UPF_OK) {
      upf_cli_error(st, "report: benchmarks");
      bench_failed = 1;
    } else if (nres == 0) {
      fprintf(stderr, "upf report: --bench-filter '%s' matches no benchmark (bench_upf --benchmark_list_tests "
                      "lists them)\n", filter);
      bench_failed = 1;
    } else {
      fprintf(stderr, "upf report: %d benchmarks done in %.0f s\n", nres, difftime(time(NULL), start));
    }
    for (int i = 0; i < nres; i++)
      bench_failed |= res[i].error && !res[i].no_device;
  }
  /* the real-weight check: SmolLM2 from $UPF_MODEL_DIR, else the models/ of ci/fetch-models.sh's cache
   * ($UPF_MODEL_CACHE, default ~/.cache/uniprefill) */
  char *real_weights;
  if (a.quick) {
    real_weights = strdup("## real weights\n\nskipped (--quick)\n\n");
  } else {
    const char *dir = getenv("UPF_MODEL_DIR"), *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
    char gguf[1200];
    if (dir && *dir)
      snprintf(gguf, sizeof gguf, "%s/SmolLM2-135M-Instruct.Q4_1.gguf", dir);
    else if (cache && *cache)
      snprintf(gguf, sizeof gguf, "%s/models/SmolLM2-135M-Instruct.Q4_1.gguf", cache);
    else
      snprintf(gguf, sizeof gguf, "%s/.cache/uniprefill/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : ".");
    real_weights = upf_cli_eval_report(gguf);
  }
  const int eval_failed = strstr(real_weights, "FAILED") != NULL;
  snprintf(path, sizeof path, "%s/summary.md", a.out_dir);
  FILE *summary = fopen(path, "w");
  printf("\n");
  print_summary(stdout, be, &stamp, &tally, verify_failed, res, nres, &a, real_weights);
  if (summary) {
    print_summary(summary, be, &stamp, &tally, verify_failed, res, nres, &a, real_weights);
    if (fclose(summary) == 0) {
      printf("\nsummary written to %s\n", path);
    } else {
      fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
      bench_failed = 1;
    }
  } else {
    fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
    bench_failed = 1;
  }
  upf_bench_results_free(res, nres);
  free(real_weights);
  return verify_failed || bench_failed || eval_failed ? 1 : 0;
}
