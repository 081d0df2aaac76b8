/* `upf report`, the main job: verifies what this machine's backends can run (CUDA against the CPU
 * reference where a device is usable, else the CPU reference against its golden cases and invariants),
 * runs the kernel benchmarks, the end-to-end, serving and accuracy runs (cli/report_e2e.c), and writes
 * report.md, report.json (docs/report.md) and plots into one stamped folder. `--compare` is the gate. */
#define _GNU_SOURCE /* fopencookie: the verify log is teed to a progress line per op */
#include <errno.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/report.h"
#include "cli/report_json.h"
#include "perf/bench.h"
#include "uniprefill/model.h"
#include "uniprefill/provenance.h"
#include "uniprefill/variant.h"
#include "verify/verify.h"

const char upf_cli_report_usage[] =
    "usage: upf report [--out DIR | --root DIR] [--quick] [--no-bench] [--bench-filter REGEX] [--peers FILE] [--no-e2e]\n"
    "                  [--models M1,M2,...] [--lengths N1,N2,...] [--backend cpu|cuda]\n"
    "       upf report --compare OLD.json NEW.json [--threshold P%]\n"
    "  The main job: verify, kernel benchmarks, end to end (TTFT of dense, UniPrefill, FlashPrefill V2,\n"
    "  dense chunked and CompactAttention for each family; on a device at 8K / 32K / 128K, without one the\n"
    "  tiny configs and the real SmolLM2 file on the CPU, with top-1 agreement), serving (serve-sim) and\n"
    "  accuracy on the real-weight files where present ($UPF_MODEL_DIR or ci/fetch-models.sh's cache).\n"
    "  Writes report.md, report.json, plots (perf/report_plots.py, matplotlib; skipped with a line when\n"
    "  absent), verify.log, bench.json, e2e.log and runs/ into ROOT/<device>-<date>-<commit>/ (ROOT\n"
    "  defaults to build/report, created with its parent) or into --out DIR (created; its parent must\n"
    "  exist), and prints the path. Stamped with commit, date, host, device, driver, clocks, kernel\n"
    "  variants and every command. --quick: the quick verify set and CI sizes (8K on a device, 512 tokens\n"
    "  on the CPU), no accuracy runs. --bench-filter runs the benchmarks whose name matches REGEX\n"
    "  (bench_upf --benchmark_list_tests lists them; a leading '-' excludes); one matching nothing is an\n"
    "  error. --peers FILE: published implementations' times on the same shapes (perf/peers/peer_rows.py\n"
    "  writes the file from the peer scripts' JSON, run in the same device call), each beside the benchmark\n"
    "  its id names: the peer's time / ours. --models / --lengths replace the end-to-end models (upf models)\n"
    "  and lengths. --backend: the backend under test (default cuda when usable, else cpu).\n"
    "  --compare: the CI gate. A table of new/old for every verify, kernel, end-to-end, serving and\n"
    "  accuracy row present in both files; exit 1 when a verify row's failures grew, a top-1 agreement\n"
    "  fell by more than 0.01, or a row slowed by more than P% (default 5) beyond noise: new - old >\n"
    "  P% x old + 2 x (old spread + new spread); rows in one file only are listed. Exit 2 for a bad file.\n";

typedef struct {
  const char *out_dir, *root;
  const char *bench_filter;
  const char *peers; /* --peers FILE: perf/peers/peer_rows.py's rows */
  const char *models, *lengths;
  const char *backend;
  int quick, no_bench, no_e2e;
} report_args;

/* What the results are stamped with. */
typedef struct {
  char commit[64], date[40], host[256], device[512], variants[512];
  char driver[128], clocks[256]; /* from nvidia-smi where it runs; "" otherwise */
  char folder[160];              /* <device>-<date>-<commit> */
} report_stamp;

/* The first line nvidia-smi prints for a query, or "" without it. */
static void smi_query(const char *fields, char *buf, size_t cap) {
  char cmd[256];
  buf[0] = '\0';
  snprintf(cmd, sizeof cmd, "nvidia-smi --query-gpu=%s --format=csv,noheader -i 0 2>/dev/null", fields);
  FILE *p = popen(cmd, "r");
  if (!p)
    return;
  if (!fgets(buf, (int)cap, p))
    buf[0] = '\0';
  buf[strcspn(buf, "\n")] = '\0';
  pclose(p);
}

static void make_stamp(report_stamp *s, int on_device) {
  memset(s, 0, sizeof *s);
  if (!upf_source_commit(s->commit, sizeof s->commit))
    snprintf(s->commit, sizeof s->commit, "unknown (not a git checkout, UPF_COMMIT unset)");
  time_t now = time(NULL);
  struct tm tm;
  char stamp_date[32] = "nodate";
  if (!localtime_r(&now, &tm) || !strftime(s->date, sizeof s->date, "%Y-%m-%dT%H:%M:%S%z", &tm))
    snprintf(s->date, sizeof s->date, "unknown");
  else
    strftime(stamp_date, sizeof stamp_date, "%Y%m%d-%H%M%S", &tm);
  if (gethostname(s->host, sizeof s->host) != 0)
    snprintf(s->host, sizeof s->host, "unknown");
  s->host[sizeof s->host - 1] = '\0';
  const upf_backend *cuda = upf_backend_cuda();
  if (on_device)
    snprintf(s->device, sizeof s->device, "%s", cuda->describe());
  else
    snprintf(s->device, sizeof s->device, "none (%s)", upf_last_error());
  if (upf_variant_describe(s->variants, sizeof s->variants) != UPF_OK)
    snprintf(s->variants, sizeof s->variants, "invalid (%s)", upf_last_error());
  else if (!s->variants[0])
    snprintf(s->variants, sizeof s->variants, "none");
  if (on_device) {
    smi_query("driver_version", s->driver, sizeof s->driver);
    smi_query("clocks.sm,clocks.max.sm,clocks.mem,power.limit", s->clocks, sizeof s->clocks);
  }
  /* the folder: the device's name (up to its first comma) in lower case, letters and digits only */
  char dev[64] = "cpu";
  if (on_device) {
    size_t n = 0;
    for (const char *c = s->device; *c && *c != ',' && n < sizeof dev - 1; c++)
      dev[n++] = (char)((*c >= 'A' && *c <= 'Z') ? *c - 'A' + 'a' : ((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9')) ? *c : '-');
    dev[n] = '\0';
  }
  char commit[24];
  snprintf(commit, sizeof commit, "%.20s", strncmp(s->commit, "unknown", 7) ? s->commit : "nocommit");
  for (char *c = commit; *c; c++)
    if (*c == ' ' || *c == '/')
      *c = '-';
  snprintf(s->folder, sizeof s->folder, "%s-%s-%s", dev, stamp_date, commit);
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
  int failed = upf_cli_verify(be, "all", quick, NULL, log);
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


/* Whether benchmark `name` is family `family` on backend `be` ("family/be/..."). */
static int bench_of(const char *name, const char *family, const char *be) {
  char prefix[96];
  snprintf(prefix, sizeof prefix, "%s/%s/", family, be);
  return !strncmp(name, prefix, strlen(prefix));
}

/* The ceilings of this run's benchmarks on backend `be` (device kernels only: the CPU reference's rates
 * are a baseline, not a ceiling): the best cuBLAS GEMM rate (gemm_ceiling's 8192^3 and the model shapes
 * of gemm and gemm_lt_best: a real projection can run faster than the square case, and a limit must not
 * be above a time reached), the best attn_prefill rate, copy_bandwidth's. */
static void measured_ceilings(const upf_bench_result *res, int nres, const char *be, upf_report_ceilings *c) {
  c->gemm_flops = c->attn_flops = c->copy_bytes = NAN;
  if (!strcmp(be, "cpu"))
    return;
  for (int i = 0; i < nres; i++) {
    const upf_bench_result *r = &res[i];
    if (r->error)
      continue;
    const double flops = upf_bench_result_counter(r, UPF_BENCH_FLOPS);
    double *best = NULL;
    if (bench_of(r->name, "gemm_ceiling", be) || bench_of(r->name, "gemm", be) || bench_of(r->name, "gemm_lt_best", be))
      best = &c->gemm_flops;
    else if (bench_of(r->name, "attn_prefill", be))
      best = &c->attn_flops;
    if (best && flops > 0 && !(flops <= *best))
      *best = flops;
    if (!strncmp(r->name, "copy_bandwidth", 14))
      c->copy_bytes = upf_bench_result_counter(r, UPF_BENCH_BYTES);
  }
}

/* ---- peers (--peers FILE: {"schema": "uniprefill-peers", "version": 1, "rows": [{"id", "peer",
 * "median_ms"}]}, perf/peers/peer_rows.py) ---- */

typedef struct {
  char id[200], name[120];
  double ms;
  int used;
} peer_row;

typedef struct {
  peer_row *rows;
  int n;
  const char *path;
} peer_table;

/* Reads --peers FILE; 0 with a message naming the file and what is wrong. */
static int load_peers(const char *path, peer_table *t) {
  char *text = NULL;
  int64_t len = 0;
  t->rows = NULL, t->n = 0, t->path = path;
  if (!upf_args_read_file("upf report", "--peers", path, &text, &len))
    return 0;
  rj_value doc;
  upf_status st = rj_parse(text, (size_t)len, path, &doc);
  free(text);
  if (st != UPF_OK) {
    fprintf(stderr, "upf report: --peers: %s\n", upf_last_error());
    rj_free(&doc);
    return 0;
  }
  const char *schema = rj_string(&doc, "schema");
  const rj_value *rows = rj_get(&doc, "rows");
  int ok = schema && !strcmp(schema, "uniprefill-peers") && rj_number(&doc, "version") == 1 && rows &&
           rows->kind == RJ_ARRAY;
  if (!ok)
    fprintf(stderr, "upf report: --peers %s: not a peer table (want \"schema\": \"uniprefill-peers\", \"version\": "
                    "1 and a \"rows\" array: perf/peers/peer_rows.py writes one)\n", path);
  if (ok && rows->count > 0 && !(t->rows = calloc((size_t)rows->count, sizeof *t->rows))) {
    fprintf(stderr, "upf report: --peers %s: out of memory\n", path);
    ok = 0;
  }
  for (int i = 0; ok && i < rows->count; i++) {
    const rj_value *r = &rows->items[i];
    const char *id = rj_string(r, "id"), *name = rj_string(r, "peer");
    const double ms = rj_number(r, "median_ms");
    if (!id || !*id || !name || !(ms > 0) || isinf(ms) || strlen(id) >= sizeof t->rows[0].id) {
      fprintf(stderr, "upf report: --peers %s: row %d needs an \"id\" (a benchmark name), a \"peer\" and a positive "
                      "\"median_ms\"\n", path, i);
      ok = 0;
      break;
    }
    snprintf(t->rows[t->n].id, sizeof t->rows[0].id, "%s", id);
    snprintf(t->rows[t->n].name, sizeof t->rows[0].name, "%s", name);
    t->rows[t->n++].ms = ms;
  }
  rj_free(&doc);
  if (!ok) {
    free(t->rows);
    t->rows = NULL, t->n = 0;
  }
  return ok;
}

/* The peer row standing beside benchmark `name`: its id is the name, or a prefix of it ending where a
 * '/' of the name begins (T:8192 does not match T:81920). */
static peer_row *peer_of(const peer_table *t, const char *name) {
  for (int i = 0; t && i < t->n; i++) {
    const size_t n = strlen(t->rows[i].id);
    if (!strncmp(name, t->rows[i].id, n) && (name[n] == '\0' || name[n] == '/'))
      return &t->rows[i];
  }
  return NULL;
}

/* ---- report.md ---- */

static void print_kernels(FILE *out, const upf_bench_result *res, int nres, const report_args *a,
                          const peer_table *peers) {
  fprintf(out, "## kernels (median over repetitions; spread = coefficient of variation)\n\n");
  if (a->no_bench) {
    fprintf(out, "skipped (--no-bench)\n\n");
    return;
  }
  if (nres == 0) {
    fprintf(out, "no benchmark matched '%s'\n\n", a->bench_filter ? a->bench_filter : "");
    return;
  }
  fprintf(out, "Rates and shares are given for device kernels only: the CPU reference is timed as a baseline,\n"
               "and its rates against a device's ceilings mean nothing. The ceilings are measured in the same run\n"
               "(copy bandwidth, cuBLAS bf16 GEMM); vs: the benchmark's own yardstick (dense equivalent or limit).\n");
  if (peers)
    fprintf(out, "peer: a published implementation on the same shapes, run in the same device call (--peers %s); "
                 "its time / ours (above 1: ours faster).\n", peers->path);
  fprintf(out, "\n| benchmark | median | spread | min | TFLOP/s | TB/s | share of ceiling; vs yardstick | peer: its time "
               "/ ours |\n");
  fprintf(out, "|---|---:|---:|---:|---:|---:|---:|---|\n");
  for (int i = 0; i < nres; i++) {
    const upf_bench_result *r = &res[i];
    if (r->error) {
      fprintf(out, "| %s | %s | | | | | | |\n", r->name, r->no_device ? "skipped (no device)" : r->error);
      continue;
    }
    char pc[200] = "";
    const peer_row *pr = peer_of(peers, r->name);
    if (pr)
      snprintf(pc, sizeof pc, "%s: %.3f", pr->name, pr->ms / (r->median_s * 1e3));
    char f[32] = "", b[32] = "", s[128] = "";
    if (!strstr(r->name, "/cpu/")) {
      double flops = upf_bench_result_counter(r, UPF_BENCH_FLOPS), bytes = upf_bench_result_counter(r, UPF_BENCH_BYTES);
      if (!isnan(flops))
        snprintf(f, sizeof f, "%.3g", flops / 1e12);
      if (!isnan(bytes))
        snprintf(b, sizeof b, "%.3g", bytes / 1e12);
      share_cell(r, s, sizeof s);
    }
    static const char *const peers[] = {"vs_dense", "vs_limit"};
    for (int k = 0; k < 2; k++)
      if (!isnan(upf_bench_result_counter(r, peers[k]))) {
        const size_t used = strlen(s);
        snprintf(s + used, sizeof s - used, "%s%.3fx %s", used ? "; " : "", upf_bench_result_counter(r, peers[k]),
                 peers[k] + 3);
        break;
      }
    fprintf(out, "| %s | %.4g ms | %.1f%% | %.4g ms | %s | %s | %s | %s |\n", r->name, r->median_s * 1e3,
            r->cv * 100.0, r->min_s * 1e3, f, b, s, pc);
  }
  int unused = 0;
  for (int i = 0; peers && i < peers->n; i++)
    if (!peers->rows[i].used)
      fprintf(out, "%speer row with no benchmark in this run: %s (%s)\n", unused++ ? "" : "\n", peers->rows[i].id,
              peers->rows[i].name);
  fprintf(out, "\nfull results: bench.json\n\n");
}

typedef struct {
  const upf_backend *be;
  const report_stamp *stamp;
  const verify_tally *tally;
  int verify_failed, verify_checks;
  const upf_bench_result *res;
  int nres, bench_failed;
  const upf_report_e2e *e2e;
  const report_args *a;
  char **commands;
  int num_commands;
  const char *plots; /* the plots section's text */
  const peer_table *peers; /* --peers, or NULL */
  char verdict[512];
} report_data;

static void print_report(FILE *out, const report_data *d) {
  const report_stamp *st = d->stamp;
  fprintf(out, "# uniprefill report: %s\n\n", st->folder);
  fprintf(out, "%s\n\n", d->verdict);
  fprintf(out, "- commit: %s\n- date: %s\n- host: %s\n- device: %s\n", st->commit, st->date, st->host, st->device);
  if (st->driver[0])
    fprintf(out, "- driver: %s\n", st->driver);
  if (st->clocks[0])
    fprintf(out, "- clocks (SM, max SM, memory, power limit): %s\n", st->clocks);
  fprintf(out, "- kernel variants: %s\n- backend under test: %s (%s)\n", st->variants, d->be->name, d->be->describe());
  fprintf(out, "- size set: %s\n\n", d->a->quick ? "quick" : "full");
  fprintf(out, "## verify (%s)\n\n", d->be == upf_backend_cpu() ? "CPU reference: golden cases, invariants, stage chain"
                                                                  : "against the CPU reference, SPEC section 7");
  fprintf(out, "| op | passed | failed |\n|---|---:|---:|\n");
  for (int op = 0; op < UPF_OP_COUNT; op++)
    if (d->tally->passed[op] || d->tally->failed[op])
      fprintf(out, "| %s | %d | %d |\n", upf_op_name((upf_op)op), d->tally->passed[op], d->tally->failed[op]);
  fprintf(out, "\nverify: %s, %d checks (log: verify.log; ops without a check on this backend are left out)\n\n",
          d->verify_failed ? "FAILED" : "all checks passed", d->verify_checks);
  print_kernels(out, d->res, d->nres, d->a, d->peers);
  if (d->e2e)
    upf_report_e2e_markdown(out, d->e2e);
  else
    fprintf(out, "## end to end\n\nskipped (--no-e2e)\n\n");
  fprintf(out, "## plots\n\n%s\n", d->plots);
  fprintf(out, "## commands\n\n```\n");
  for (int i = 0; i < d->num_commands; i++)
    fprintf(out, "%s\n", d->commands[i]);
  fprintf(out, "```\n\n%s\n", d->verdict);
}

/* ---- report.json (docs/report.md) ---- */

static void json_num(FILE *f, double v) {
  if (isnan(v) || isinf(v))
    fprintf(f, "null");
  else
    fprintf(f, "%.10g", v);
}

static void print_json(FILE *f, const report_data *d) {
  const report_stamp *st = d->stamp;
  fprintf(f, "{\"schema\": \"%s\", \"version\": %d,\n\"stamp\": {", UPF_REPORT_SCHEMA, UPF_REPORT_VERSION);
  const char *keys[] = {"folder", "commit", "date", "host", "device", "driver", "clocks", "variants"};
  const char *vals[] = {st->folder, st->commit, st->date, st->host, st->device, st->driver, st->clocks, st->variants};
  for (int i = 0; i < 8; i++) {
    fprintf(f, "\"%s\": ", keys[i]);
    upf_json_string(f, vals[i]);
    fprintf(f, ", ");
  }
  fprintf(f, "\"backend\": ");
  upf_json_string(f, d->be->name);
  fprintf(f, ", \"quick\": %s,\n  \"commands\": [", d->a->quick ? "true" : "false");
  for (int i = 0; i < d->num_commands; i++) {
    fprintf(f, "%s", i ? ", " : "");
    upf_json_string(f, d->commands[i]);
  }
  fprintf(f, "]},\n\"verify\": [");
  int first = 1;
  for (int op = 0; op < UPF_OP_COUNT; op++) {
    if (!d->tally->passed[op] && !d->tally->failed[op])
      continue;
    fprintf(f, "%s\n  {\"id\": \"%s\", \"passed\": %d, \"failed\": %d}", first ? "" : ",", upf_op_name((upf_op)op),
            d->tally->passed[op], d->tally->failed[op]);
    first = 0;
  }
  fprintf(f, "\n],\n\"kernels\": [");
  for (int i = 0; i < d->nres; i++) {
    const upf_bench_result *r = &d->res[i];
    fprintf(f, "%s\n  {\"id\": ", i ? "," : "");
    upf_json_string(f, r->name);
    if (r->error) {
      fprintf(f, ", \"median_ms\": null, \"error\": ");
      upf_json_string(f, r->error);
      fprintf(f, "}");
      continue;
    }
    const int device = !strstr(r->name, "/cpu/");
    fprintf(f, ", \"median_ms\": ");
    json_num(f, r->median_s * 1e3);
    fprintf(f, ", \"spread_ms\": ");
    json_num(f, r->stddev_s * 1e3);
    fprintf(f, ", \"cv\": ");
    json_num(f, r->cv);
    fprintf(f, ", \"min_ms\": ");
    json_num(f, r->min_s * 1e3);
    fprintf(f, ", \"repetitions\": %lld, \"tflops\": ", (long long)r->repetitions);
    json_num(f, device ? upf_bench_result_counter(r, UPF_BENCH_FLOPS) / 1e12 : NAN);
    fprintf(f, ", \"tbps\": ");
    json_num(f, device ? upf_bench_result_counter(r, UPF_BENCH_BYTES) / 1e12 : NAN);
    const double gemm = upf_bench_result_counter(r, UPF_BENCH_CUBLAS_SHARE), copy = upf_bench_result_counter(r, UPF_BENCH_COPY_SHARE);
    fprintf(f, ", \"ceiling_share\": ");
    json_num(f, !device ? NAN : !isnan(gemm) ? gemm : copy);
    fprintf(f, ", \"ceiling\": %s", !device || (isnan(gemm) && isnan(copy)) ? "null" : !isnan(gemm) ? "\"cuBLAS\"" : "\"copy BW\"");
    const double vs_dense = upf_bench_result_counter(r, "vs_dense"), vs_limit = upf_bench_result_counter(r, "vs_limit");
    fprintf(f, ", \"peer\": %s, \"peer_ratio\": ", !isnan(vs_dense) ? "\"dense\"" : !isnan(vs_limit) ? "\"limit\"" : "null");
    json_num(f, !isnan(vs_dense) ? vs_dense : vs_limit);
    const peer_row *pr = peer_of(d->peers, r->name);
    fprintf(f, ", \"vs_peer\": ");
    if (pr) {
      fprintf(f, "{\"name\": ");
      upf_json_string(f, pr->name);
      fprintf(f, ", \"median_ms\": ");
      json_num(f, pr->ms);
      fprintf(f, ", \"speedup\": ");
      json_num(f, pr->ms / (r->median_s * 1e3));
      fprintf(f, "}");
    } else {
      fprintf(f, "null");
    }
    fprintf(f, "}");
  }
  fprintf(f, "\n],\n");
  if (d->e2e)
    upf_report_e2e_json(f, d->e2e);
  else
    fprintf(f, "\"e2e\": [], \"serving\": [], \"accuracy\": []");
  fprintf(f, ",\n\"verdict\": ");
  upf_json_string(f, d->verdict);
  fprintf(f, "}\n");
}

/* Writes one file through a temporary renamed into place, so that no partial report is left. */
static int write_file(const char *dir, const char *name, void (*fn)(FILE *, const report_data *), const report_data *d) {
  char path[1200], tmp[1220];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, "upf report: cannot write %s: %s\n", tmp, strerror(errno));
    return 0;
  }
  fn(f, d);
  if (fclose(f) != 0 || rename(tmp, path) != 0) {
    fprintf(stderr, "upf report: cannot write %s: %s\n", path, strerror(errno));
    remove(tmp);
    return 0;
  }
  return 1;
}

/* ---- plots ---- */

/* perf/report_plots.py over report.json: 0 when it drew them; the section's text either way. */
static void make_plots(const char *dir, char *text, size_t cap) {
  const char *py = getenv("UPF_PLOT_PYTHON"), *home = getenv("HOME");
  char venv[600], cmd[3000];
  snprintf(venv, sizeof venv, "%s/.cache/uniprefill/venv-plot/bin/python", home ? home : ".");
  /* the first python that has matplotlib: a venv of our own, the one on PATH, the system's (Debian's
   * python3-matplotlib, which ci/install-deps.sh --report installs) */
  const char *candidates[] = {venv, "python3", "/usr/bin/python3"};
  for (size_t i = 0; (!py || !*py) && i < sizeof candidates / sizeof *candidates; i++) {
    snprintf(cmd, sizeof cmd, "'%s' -c 'import matplotlib' >/dev/null 2>&1", candidates[i]);
    if ((i > 0 || access(venv, X_OK) == 0) && system(cmd) == 0)
      py = candidates[i];
  }
  if (!py || !*py)
    py = "python3"; /* its error says what is missing */
  if (access("perf/report_plots.py", R_OK) != 0) {
    snprintf(text, cap, "skipped: perf/report_plots.py is not here (run upf report from the repository root)\n");
    return;
  }
  snprintf(cmd, sizeof cmd, "'%s' perf/report_plots.py '%s' >'%s/plots.log' 2>&1", py, dir, dir);
  fprintf(stderr, "upf report: plots (%s perf/report_plots.py) ...\n", py);
  const int rc = system(cmd);
  const int code = rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  char listing[1200] = "", path[1200];
  snprintf(path, sizeof path, "%s/plots.log", dir);
  FILE *log = fopen(path, "r");
  size_t used = 0;
  char line[512];
  while (log && fgets(line, sizeof line, log) && used < sizeof listing - 1)
    used += (size_t)snprintf(listing + used, sizeof listing - used, "%s", line);
  if (log)
    fclose(log);
  if (code == 0)
    snprintf(text, cap, "%s", listing);
  else if (code == 3)
    snprintf(text, cap, "skipped: %s", listing[0] ? listing : "matplotlib is absent\n");
  else
    snprintf(text, cap, "skipped: perf/report_plots.py failed (exit %d; plots.log):\n%s", code, listing);
}

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

/* ---- the command ---- */

/* A real-weight file: $UPF_MODEL_DIR/name, else the models/ of ci/fetch-models.sh's cache
 * ($UPF_MODEL_CACHE, default ~/.cache/uniprefill). */
static void model_file(const char *name, char *buf, size_t cap) {
  const char *dir = getenv("UPF_MODEL_DIR"), *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  if (dir && *dir)
    snprintf(buf, cap, "%s/%s", dir, name);
  else if (cache && *cache)
    snprintf(buf, cap, "%s/models/%s", cache, name);
  else
    snprintf(buf, cap, "%s/.cache/uniprefill/models/%s", home ? home : ".", name);
}

/* mkdir that accepts an existing directory; 0 after a message naming the flag when it fails. */
static int make_dir(const char *flag, const char *dir) {
  struct stat st;
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "upf report: %s %s: cannot create: %s\n", flag, dir, strerror(errno));
    return 0;
  }
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "upf report: %s %s is not a directory\n", flag, dir);
    return 0;
  }
  return 1;
}

int upf_cli_report(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (!strcmp(argv[i], "--compare"))
      return upf_cli_report_compare(argc, argv);
  report_args a = {.root = "build/report"};
  upf_arg args[] = {
      {"--out", UPF_ARG_STRING, &a.out_dir},
      {"--root", UPF_ARG_STRING, &a.root},
      {"--bench-filter", UPF_ARG_STRING, &a.bench_filter},
      {"--peers", UPF_ARG_STRING, &a.peers},
      {"--models", UPF_ARG_STRING, &a.models},
      {"--lengths", UPF_ARG_STRING, &a.lengths},
      {"--backend", UPF_ARG_STRING, &a.backend},
      {"--quick", UPF_ARG_SWITCH, &a.quick},
      {"--no-bench", UPF_ARG_SWITCH, &a.no_bench},
      {"--no-e2e", UPF_ARG_SWITCH, &a.no_e2e},
  };
  upf_arg_parser p = {"upf report", upf_cli_report_usage, args, (int)(sizeof args / sizeof args[0])};
  upf_args_result r = upf_args_parse(&p, argc, argv);
  if (r != UPF_ARGS_OK)
    return upf_args_exit_code(r);
  if (a.bench_filter && a.no_bench) {
    fprintf(stderr, "upf report: --bench-filter and --no-bench contradict each other\n");
    return 2;
  }
  if (a.out_dir && args[1].seen) {
    fprintf(stderr, "upf report: --out and --root contradict each other (--out names the folder itself)\n");
    return 2;
  }
  if (a.no_e2e && (a.models || a.lengths)) {
    fprintf(stderr, "upf report: --%s and --no-e2e contradict each other\n", a.models ? "models" : "lengths");
    return 2;
  }
  if (a.bench_filter && !filter_compiles(a.bench_filter))
    return 2;
  if (a.peers && a.no_bench) {
    fprintf(stderr, "upf report: --peers and --no-bench contradict each other (peers stand beside benchmarks)\n");
    return 2;
  }
  peer_table peers = {0};
  if (a.peers) { /* checked before any work; read again beside the benchmarks */
    if (!load_peers(a.peers, &peers))
      return 2;
    free(peers.rows);
    peers.rows = NULL, peers.n = 0;
  }
  for (const char *list = a.models; list && *list;) { /* every model named must exist, before any work */
    char name[64];
    size_t n = strcspn(list, ",");
    snprintf(name, sizeof name, "%.*s", (int)(n < 63 ? n : 63), list);
    if (!upf_model_config_by_name(name)) {
      fprintf(stderr, "upf report: --models: '%s' is not a model (upf models lists them)\n", name);
      return 2;
    }
    list += n + (list[n] == ',');
  }
  for (const char *list = a.lengths; list && *list;) {
    char *end;
    long v = strtol(list, &end, 10);
    if (end == list || (*end && *end != ',') || v < 64 || v > (1L << 24)) {
      fprintf(stderr, "upf report: --lengths '%s': each length is a token count in [64, 16777216]\n", a.lengths);
      return 2;
    }
    list = *end ? end + 1 : end;
  }
  const upf_backend *be = a.backend ? upf_backend_by_name(a.backend) : upf_cli_default_backend();
  if (!be || be->probe() != UPF_OK) {
    fprintf(stderr, "upf report: --backend '%s': %s\n", a.backend,
            be ? upf_last_error() : "want cpu or cuda");
    return be ? 1 : 2;
  }
  const int on_device = be != upf_backend_cpu();
  report_stamp stamp;
  make_stamp(&stamp, on_device);
  char dir[1100];
  if (a.out_dir) {
    if (!make_dir("--out", a.out_dir))
      return 2;
    snprintf(dir, sizeof dir, "%s", a.out_dir);
  } else {
    /* the default root's parent (build/) may not exist on a fresh checkout */
    char parent[1024];
    snprintf(parent, sizeof parent, "%s", a.root);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent && !args[1].seen) {
      *slash = '\0';
      if (!make_dir("--root", parent))
        return 2;
    }
    if (!make_dir("--root", a.root))
      return 2;
    snprintf(dir, sizeof dir, "%s/%s", a.root, stamp.folder);
    if (!make_dir("--root", dir))
      return 2;
  }
  fprintf(stderr, "upf report: writing into %s\n", dir);
  char path[1200];
  snprintf(path, sizeof path, "%s/verify.log", dir);
  int verify_failed = verify_with_progress(be, a.quick, path);
  if (verify_failed < 0)
    return 1;
  verify_tally tally;
  tally_log(path, &tally);
  int checks = 0;
  for (int op = 0; op < UPF_OP_COUNT; op++)
    checks += tally.passed[op] + tally.failed[op];

  char **commands = NULL;
  int num_commands = 0;
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "upf verify all --backend %s%s", be->name, a.quick ? " --quick" : "");
  commands = realloc(commands, sizeof *commands * 2);
  commands[num_commands++] = strdup(cmd);

  upf_bench_result *res = NULL;
  int nres = 0, bench_failed = 0;
  if (a.peers && !load_peers(a.peers, &peers))
    bench_failed = 1; /* the file changed since the start: said on stderr */
  if (!a.no_bench) {
    /* Without a device the CPU reference at 128K takes tens of seconds a run; the default keeps the
     * main job to a few minutes there. */
    const char *filter = a.bench_filter ? a.bench_filter
                         : be == upf_backend_cpu() ? (a.quick ? "copy|select/cpu/bf16/T:8192/"
                                                              : "copy|select/cpu/bf16/T:(8192|32768)/|"
                                                                "(gemm|ffn|rmsnorm|rope|moe.ffn)/cpu/")
                                                   : ".";
    char out_arg[1300], filter_arg[512];
    snprintf(out_arg, sizeof out_arg, "--benchmark_out=%s/bench.json", dir);
    snprintf(filter_arg, sizeof filter_arg, "--benchmark_filter=%s", filter);
    snprintf(cmd, sizeof cmd, "bench_upf '--benchmark_filter=%s'", filter);
    commands[num_commands++] = strdup(cmd);
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

  upf_report_e2e e2e;
  memset(&e2e, 0, sizeof e2e);
  int e2e_failed = 0, e2e_runs = 0;
  if (!a.no_e2e) {
    char smollm[1200], gemma[1200];
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf", smollm, sizeof smollm);
    model_file("gemma-3-270m-q4_k_m.gguf", gemma, sizeof gemma);
    const upf_report_e2e_options eo = {on_device, a.quick, dir, smollm, gemma, a.models, a.lengths};
    fprintf(stderr, "upf report: end to end, serving and accuracy (each command's output: %s/e2e.log) ...\n", dir);
    const time_t start = time(NULL);
    upf_report_e2e_run(&eo, &e2e);
    fprintf(stderr, "upf report: end to end done in %.0f s\n", difftime(time(NULL), start));
    upf_report_ceilings ceilings;
    measured_ceilings(res, nres, be->name, &ceilings);
    upf_report_e2e_limits(&e2e, &ceilings);
    for (int i = 0; i < e2e.num_e2e; i++)
      e2e_failed += e2e.e2e[i].failed;
    for (int i = 0; i < e2e.num_serve; i++)
      e2e_failed += e2e.serve[i].failed;
    for (int i = 0; i < e2e.num_accuracy; i++)
      e2e_failed += e2e.accuracy[i].failed;
    e2e_runs = e2e.num_e2e + e2e.num_serve + e2e.num_accuracy;
    char **more = realloc(commands, sizeof *commands * (size_t)(num_commands + e2e.num_commands));
    if (more) {
      commands = more;
      for (int i = 0; i < e2e.num_commands; i++)
        commands[num_commands++] = strdup(e2e.commands[i]);
    }
  }

  for (int i = 0; a.peers && i < nres; i++) {
    peer_row *pr = peer_of(&peers, res[i].name);
    if (pr && !res[i].error)
      pr->used = 1;
  }
  report_data d = {be, &stamp, &tally, verify_failed, checks, res, nres, bench_failed, a.no_e2e ? NULL : &e2e, &a,
                   commands, num_commands, "", a.peers ? &peers : NULL, ""};
  const int failed = verify_failed || bench_failed || e2e_failed;
  /* the best UniPrefill speedup of the longest length, the one number the report is for */
  char best[160] = "";
  for (int i = 0; i < e2e.num_e2e; i++) {
    const upf_report_e2e_row *row = &e2e.e2e[i];
    if (!strcmp(row->method, "uniprefill") && !isnan(row->speedup))
      snprintf(best, sizeof best, "; UniPrefill %.2fx dense at %s %ld", row->speedup, row->model, row->length);
  }
  snprintf(d.verdict, sizeof d.verdict, "verdict: %s: verify %d/%d passed, %d benchmarks%s, %d end-to-end/serving/accuracy runs (%d failed)%s",
           failed ? "FAILED" : "OK", checks - verify_failed, checks, nres, bench_failed ? " (some failed)" : "", e2e_runs,
           e2e_failed, best);
  int write_failed = !write_file(dir, "report.json", print_json, &d);
  char plots[2048];
  if (write_failed)
    snprintf(plots, sizeof plots, "skipped: report.json could not be written\n");
  else
    make_plots(dir, plots, sizeof plots);
  d.plots = plots;
  write_failed |= !write_file(dir, "report.md", print_report, &d);
  /* summary.md: the same page under the name of earlier reports, for scripts that read it */
  write_failed |= !write_file(dir, "summary.md", print_report, &d);
  printf("\n");
  print_report(stdout, &d);
  printf("\nreport written to %s/report.md (report.json beside it)\n%s\n", dir, d.verdict);
  upf_bench_results_free(res, nres);
  free(peers.rows);
  upf_report_e2e_free(&e2e);
  for (int i = 0; i < num_commands; i++)
    free(commands[i]);
  free(commands);
  return failed || write_failed ? 1 : 0;
}
