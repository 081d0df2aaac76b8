/* bench_upf: runs every registered benchmark under Google Benchmark (all --benchmark_* flags apply),
 * stamps the results with device, commit, the kernel variants in effect and command line, and ends
 * with a one-line-per-benchmark summary. `--variant op=name[,op=name...]` (or `--variant=...`, any
 * number of times) selects kernel variants before the run (uniprefill/variant.h). Exits 1 if a
 * benchmark failed, 2 on a bad argument; a benchmark skipped for want of a device is not a failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/provenance.h"
#include "uniprefill/variant.h"

/* argv as a shell would need it to run the same thing again (single quotes where needed). */
static char *command_line(int argc, char **argv) {
  size_t cap = 1;
  for (int i = 0; i < argc; i++)
    cap += 4 * strlen(argv[i]) + 3;
  char *out = malloc(cap), *w = out;
  if (!out)
    return NULL;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    int plain = *a != '\0' && strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") ==
                                  strlen(a);
    if (i)
      *w++ = ' ';
    if (plain) {
      w += sprintf(w, "%s", a);
      continue;
    }
    *w++ = '\'';
    for (; *a; a++)
      w += *a == '\'' ? sprintf(w, "'\\''") : sprintf(w, "%c", *a);
    *w++ = '\'';
  }
  *w = '\0';
  return out;
}

/* Selects the variants that --variant arguments name and removes those arguments from argv (Google
 * Benchmark rejects flags it does not know). */
static upf_status take_variant_args(int *argc, char **argv) {
  int kept = 1;
  for (int i = 1; i < *argc; i++) {
    const char *spec = NULL;
    if (!strcmp(argv[i], "--variant")) {
      if (i + 1 >= *argc)
        return upf_fail(UPF_ERR_INVALID_ARG, "--variant needs a value: op=name[,op=name...] (see upf ops)");
      spec = argv[++i];
    } else if (!strncmp(argv[i], "--variant=", 10)) {
      spec = argv[i] + 10;
    } else {
      argv[kept++] = argv[i];
      continue;
    }
    UPF_TRY(upf_variant_select_spec(spec));
  }
  *argc = kept;
  argv[kept] = NULL;
  return UPF_OK;
}

/* full_argc, full_argv: the command line as given (the repro command keeps its --variant). */
static upf_status add_context(int full_argc, char **full_argv) {
  char buf[1024];
  const upf_backend *cuda = upf_backend_cuda();
  if (cuda->probe() == UPF_OK)
    upf_bench_add_context("gpu", cuda->describe());
  else {
    snprintf(buf, sizeof buf, "none (%s)", upf_last_error());
    upf_bench_add_context("gpu", buf);
  }
#ifdef UPF_HAVE_CUDA
  upf_bench_add_context("build", "CUDA=1");
#else
  upf_bench_add_context("build", "CUDA=0");
#endif
  if (!upf_source_commit(buf, sizeof buf))
    snprintf(buf, sizeof buf, "unknown");
  upf_bench_add_context("commit", buf);
  /* Which kernel of every op with variants ran: "attn.prefill=wgmma2-nopp,moe.ffn=bucketed". A case
   * that times a variant by name says so in its name and label. */
  UPF_TRY(upf_variant_describe(buf, sizeof buf));
  upf_bench_add_context("variants", buf);
  char *cmd = command_line(full_argc, full_argv);
  upf_bench_add_context("command", cmd ? cmd : full_argv[0]);
  free(cmd);
  return UPF_OK;
}

static const char *format_time(double s, char *buf, size_t cap) {
  if (!isfinite(s))
    snprintf(buf, cap, "-");
  else if (s >= 1.0)
    snprintf(buf, cap, "%.3f s", s);
  else if (s >= 1e-3)
    snprintf(buf, cap, "%.3f ms", s * 1e3);
  else
    snprintf(buf, cap, "%.2f us", s * 1e6);
  return buf;
}

static const char *format_value(double v, double scale, const char *fmt, char *buf, size_t cap) {
  if (isfinite(v))
    snprintf(buf, cap, fmt, v / scale);
  else
    snprintf(buf, cap, "-");
  return buf;
}

static void print_summary(const upf_bench_result *results, int count) {
  if (count == 0)
    return;
  int width = 4;
  for (int i = 0; i < count; i++)
    width = (int)strlen(results[i].name) > width ? (int)strlen(results[i].name) : width;
  printf("\nsummary: median over repetitions; share = TB/s over the measured device copy bandwidth\n");
  printf("%-*s %12s %9s %9s %6s\n", width, "name", "median", "TFLOP/s", "TB/s", "share");
  for (int i = 0; i < count; i++) {
    const upf_bench_result *r = &results[i];
    if (r->error) {
      printf("%-*s %s: %s\n", width, r->name, r->no_device ? "skipped" : "FAILED", r->error);
      continue;
    }
    char t[32], f[32], b[32], s[32];
    printf("%-*s %12s %9s %9s %6s\n", width, r->name, format_time(r->median_s, t, sizeof t),
           format_value(upf_bench_result_counter(r, UPF_BENCH_FLOPS), 1e12, "%.4g", f, sizeof f),
           format_value(upf_bench_result_counter(r, UPF_BENCH_BYTES), 1e12, "%.4g", b, sizeof b),
           format_value(upf_bench_result_counter(r, UPF_BENCH_COPY_SHARE), 0.01, "%.1f%%", s, sizeof s));
  }
}

int main(int argc, char **argv) {
  char **args = malloc((size_t)(argc + 1) * sizeof *args);
  if (!args) {
    fprintf(stderr, "bench_upf: out of memory\n");
    return 2;
  }
  memcpy(args, argv, (size_t)argc * sizeof *args);
  int nargs = argc;
  if (take_variant_args(&nargs, args) != UPF_OK || add_context(argc, argv) != UPF_OK) {
    fprintf(stderr, "bench_upf: %s\n", upf_last_error());
    free(args);
    return 2;
  }
  argc = nargs, argv = args;
  upf_register_all_benchmarks();
  upf_bench_result *results = NULL;
  int count = 0;
  if (upf_bench_run(argc, argv, &results, &count) != UPF_OK) {
    fprintf(stderr, "bench_upf: %s\n", upf_last_error());
    free(args);
    return 2;
  }
  print_summary(results, count);
  int failed = 0;
  for (int i = 0; i < count; i++)
    failed += results[i].error && !results[i].no_device;
  upf_bench_results_free(results, count);
  free(args);
  return failed ? 1 : 0;
}
