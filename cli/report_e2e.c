/* The end-to-end, serving and accuracy sections of `upf report`: each measurement is a run of the CLI's
 * own command (upf prefill / eval / serve-sim with --json, called in this process with its console output
 * sent to DIR/e2e.log), read back from its JSON, so the report times exactly what a user's command does. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/report.h"
#include "cli/report_json.h"
#include "uniprefill/model.h"

typedef int (*cli_entry)(int argc, char **argv);

typedef struct {
  const upf_report_e2e_options *o;
  upf_report_e2e *r;
  char log_path[1100];
  int step, steps; /* progress: runs done and planned */
} e2e_ctx;

static void note(upf_report_e2e *r, const char *fmt, ...) {
  size_t used = strlen(r->notes);
  va_list ap;
  va_start(ap, fmt);
  if (used < sizeof r->notes - 1)
    vsnprintf(r->notes + used, sizeof r->notes - used, fmt, ap);
  va_end(ap);
}

static void add_command(upf_report_e2e *r, const char *cmd) {
  char **c = realloc(r->commands, (size_t)(r->num_commands + 1) * sizeof *c);
  if (!c)
    return;
  r->commands = c;
  r->commands[r->num_commands] = strdup(cmd);
  if (r->commands[r->num_commands])
    r->num_commands++;
}

/* Runs `upf <sub> <args>` (args split at spaces; no argument here holds one) with stdout and stderr
 * appended to the log; returns its exit status, or -1 when the log cannot be opened. */
static int run_cli(e2e_ctx *c, cli_entry fn, const char *sub, const char *args) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "upf %s %s", sub, args);
  add_command(c->r, cmd);
  c->step++;
  fprintf(stderr, "upf report: [%d/%d] %s\n", c->step, c->steps, cmd);
  char *buf = strdup(args);
  char *argv[64];
  int argc = 0;
  for (char *tok = buf ? strtok(buf, " ") : NULL; tok && argc < 63; tok = strtok(NULL, " "))
    argv[argc++] = tok;
  argv[argc] = NULL;
  fflush(stdout);
  fflush(stderr);
  const int fd = open(c->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
  const int saved_out = dup(1), saved_err = dup(2);
  if (!buf || fd < 0 || saved_out < 0 || saved_err < 0) {
    fprintf(stderr, "upf report: cannot run %s: %s (%s)\n", cmd, strerror(errno), c->log_path);
    free(buf);
    if (fd >= 0)
      close(fd);
    if (saved_out >= 0)
      close(saved_out);
    if (saved_err >= 0)
      close(saved_err);
    return -1;
  }
  dprintf(fd, "\n$ %s\n", cmd);
  dup2(fd, 1);
  dup2(fd, 2);
  close(fd);
  const time_t start = time(NULL);
  const int rc = fn(argc, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(saved_out);
  close(saved_err);
  free(buf);
  if (rc != 0)
    fprintf(stderr, "upf report:   exit %d after %.0f s (its output: %s)\n", rc, difftime(time(NULL), start),
            c->log_path);
  return rc;
}

/* Reads a run's JSON; 0 (and the reason in err) when it cannot. */
static int read_json(const char *path, rj_value *doc, char *err, size_t cap) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, cap, "no JSON written (%s)", path);
    return 0;
  }
  char *text = NULL;
  size_t len = 0, got;
  char chunk[65536];
  while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
    char *t = realloc(text, len + got);
    if (!t)
      break;
    text = t;
    memcpy(text + len, chunk, got);
    len += got;
  }
  fclose(f);
  upf_status st = rj_parse(text ? text : "", len, path, doc);
  free(text);
  if (st != UPF_OK) {
    snprintf(err, cap, "%s", upf_last_error());
    rj_free(doc);
    return 0;
  }
  return 1;
}

static double array_at(const rj_value *a, int i) {
  return a && a->kind == RJ_ARRAY && i < a->count && a->items[i].kind == RJ_NUMBER ? a->items[i].number : NAN;
}

/* ---- end to end ---- */

typedef struct {
  const char *model;  /* a name of `upf models`, or a label for a GGUF file */
  const char *family; /* llama, gemma3, qwen3next */
  const char *source; /* "--model NAME [--layers A:B]" or "--gguf FILE" */
} e2e_model;

static const char *family_of(const char *model) {
  if (strstr(model, "gemma"))
    return "gemma3";
  if (strstr(model, "qwen"))
    return "qwen3next";
  return "llama";
}

/* One prefill run into a row: TTFT (median, half the min-max range as the spread, min), kept share, the
 * time by layer kind. */
static void e2e_prefill(e2e_ctx *c, const e2e_model *m, long length, const char *method, const char *mode_args,
                        int chunk) {
  upf_report_e2e *r = c->r;
  upf_report_e2e_row *rows = realloc(r->e2e, (size_t)(r->num_e2e + 1) * sizeof *rows);
  if (!rows)
    return;
  r->e2e = rows;
  upf_report_e2e_row *row = &r->e2e[r->num_e2e++];
  memset(row, 0, sizeof *row);
  snprintf(row->model, sizeof row->model, "%s", m->model);
  snprintf(row->family, sizeof row->family, "%s", m->family);
  snprintf(row->method, sizeof row->method, "%s", method);
  snprintf(row->id, sizeof row->id, "%s/%s/%ld", m->model, method, length);
  snprintf(row->backend, sizeof row->backend, "%s", c->o->on_device ? "cuda" : "cpu");
  row->length = length;
  row->ttft_ms = row->spread_ms = row->min_ms = row->kept_share = row->agreement = row->speedup = NAN;
  for (int k = 0; k < 4; k++)
    row->layer_ms[k] = NAN;
  for (int k = 0; k < 5; k++)
    row->work[k] = NAN;
  row->limit_ms = NAN;
  char json[1300], args[2048], chunk_arg[64] = "";
  snprintf(json, sizeof json, "%s/runs/prefill-%s-%s-%ld.json", c->o->dir, m->model, method, length);
  if (chunk)
    snprintf(chunk_arg, sizeof chunk_arg, " --chunk %d", chunk);
  /* repetitions for the spread; one run of the real file on the CPU (seconds each on 2 cores) and two at
   * 128K on a device, where one run is seconds too */
  const int real_cpu = !c->o->on_device && !strncmp(m->source, "--gguf", 6);
  const int iters = real_cpu ? 1 : c->o->on_device && length >= 131072 ? 2 : 3;
  snprintf(args, sizeof args, "%s --lengths %ld %s%s --backend %s --warmup %d --iters %d --json %s", m->source, length,
           mode_args, chunk_arg, row->backend, !real_cpu, iters, json);
  const int rc = run_cli(c, upf_cli_prefill, "prefill", args);
  rj_value doc;
  if (rc != 0) {
    row->failed = 1;
    snprintf(row->error, sizeof row->error, "upf prefill exited %d (e2e.log)", rc);
    return;
  }
  if (!read_json(json, &doc, row->error, sizeof row->error)) {
    row->failed = 1;
    return;
  }
  const rj_value *ttft = rj_get(&doc, "ttft_ms");
  row->ttft_ms = rj_number(ttft, "median");
  row->min_ms = rj_number(ttft, "min");
  row->spread_ms = (rj_number(ttft, "max") - row->min_ms) / 2.0;
  row->repetitions = (int)rj_number(ttft, "iters");
  const char *dtype = rj_string(&doc, "dtype");
  snprintf(row->dtype, sizeof row->dtype, "%s", dtype ? dtype : "?");
  const rj_value *kind = rj_get(&doc, "layer_kind"), *mixer = rj_get(&doc, "mixer_ms"), *ffn = rj_get(&doc, "ffn_ms");
  row->layer_ms[0] = row->layer_ms[1] = row->layer_ms[2] = row->layer_ms[3] = 0;
  for (int l = 0; kind && kind->kind == RJ_ARRAY && l < kind->count; l++) {
    const char *k = kind->items[l].kind == RJ_STRING ? kind->items[l].string : "";
    row->layer_ms[strcmp(k, "gdn") ? 0 : 1] += array_at(mixer, l);
    row->layer_ms[2] += array_at(ffn, l);
  }
  static const char *const work_keys[5] = {"gemm_flop", "moe_flop", "attn_flop", "gdn_scan_flop", "glue_bytes"};
  const rj_value *work = rj_get(&doc, "dense_work");
  for (int k = 0; work && k < 5; k++)
    row->work[k] = rj_number(work, work_keys[k]);
  const rj_value *drops = rj_get(&doc, "drops");
  for (int d = 0; drops && drops->kind == RJ_ARRAY && d < drops->count; d++)
    row->layer_ms[3] += rj_number(&drops->items[d], "select_ms");
  if (!isnan(rj_number(&doc, "sparse_index_ms")))
    row->layer_ms[3] += rj_number(&doc, "sparse_index_ms");
  /* kept share: the block share the sparse methods report; for UniPrefill the tokens left after the last
   * drop over the prompt */
  row->kept_share = rj_number(&doc, "kept_share");
  if (isnan(row->kept_share)) {
    const rj_value *tokens = rj_get(&doc, "layer_tokens");
    if (tokens && tokens->kind == RJ_ARRAY && tokens->count > 0)
      row->kept_share = array_at(tokens, tokens->count - 1) / (double)length;
  }
  rj_free(&doc);
}

/* Top-1 agreement of UniPrefill with dense over the last positions (upf eval next-token), onto the row. */
static void e2e_agreement(e2e_ctx *c, const e2e_model *m, long length, upf_report_e2e_row *row, int last) {
  char json[1300], args[2048], err[256];
  snprintf(json, sizeof json, "%s/runs/eval-%s-%ld.json", c->o->dir, m->model, length);
  snprintf(args, sizeof args, "%s --task next-token --tokens %ld --windows 1 --last %d --mode uniprefill --backend %s "
                              "--json %s", m->source, length, last, row->backend, json);
  if (run_cli(c, upf_cli_eval, "eval", args) != 0)
    return;
  rj_value doc;
  if (!read_json(json, &doc, err, sizeof err))
    return;
  const rj_value *lengths = rj_get(&doc, "lengths");
  if (lengths && lengths->kind == RJ_ARRAY && lengths->count > 0) {
    const rj_value *runs = rj_get(&lengths->items[0], "runs");
    if (runs && runs->kind == RJ_ARRAY && runs->count > 0)
      row->agreement = rj_number(&runs->items[0], "top1_agreement");
  }
  rj_free(&doc);
}

static int split_list(const char *list, char items[][64], int cap) {
  int n = 0;
  char buf[512];
  snprintf(buf, sizeof buf, "%s", list);
  for (char *tok = strtok(buf, ","); tok && n < cap; tok = strtok(NULL, ","))
    snprintf(items[n++], 64, "%s", tok);
  return n;
}

/* The speedup of each row against its baseline at the same model and length: dense, and dense chunked
 * for CompactAttention (it only differs from chunked prefill). */
static void fill_speedups(upf_report_e2e *r) {
  for (int i = 0; i < r->num_e2e; i++) {
    upf_report_e2e_row *row = &r->e2e[i];
    const char *base = !strcmp(row->method, "compact") ? "dense-chunked" : "dense";
    for (int j = 0; j < r->num_e2e; j++)
      if (!strcmp(r->e2e[j].model, row->model) && r->e2e[j].length == row->length &&
          !strcmp(r->e2e[j].method, base) && !r->e2e[j].failed && !row->failed)
        row->speedup = r->e2e[j].ttft_ms / row->ttft_ms;
  }
}

void upf_report_e2e_limits(upf_report_e2e *r, const upf_report_ceilings *c) {
  r->ceilings = *c;
  for (int i = 0; i < r->num_e2e; i++) {
    upf_report_e2e_row *row = &r->e2e[i];
    row->limit_ms = NAN;
    if (row->failed || strcmp(row->method, "dense"))
      continue;
    const double *w = row->work;
    const upf_prefill_work work = {w[0], w[1], w[2], w[3], w[4]};
    row->limit_ms = 1e3 * upf_prefill_work_limit(&work, c->gemm_flops, c->attn_flops, c->copy_bytes);
  }
}

/* ---- serving and accuracy ---- */

static void serve_point(e2e_ctx *c, const char *model, const char *method, const char *mode_args, const char *load) {
  upf_report_e2e *r = c->r;
  upf_report_serve_row *rows = realloc(r->serve, (size_t)(r->num_serve + 1) * sizeof *rows);
  if (!rows)
    return;
  r->serve = rows;
  upf_report_serve_row *row = &r->serve[r->num_serve++];
  memset(row, 0, sizeof *row);
  snprintf(row->model, sizeof row->model, "%s", model);
  snprintf(row->method, sizeof row->method, "%s", method);
  snprintf(row->backend, sizeof row->backend, "%s", c->o->on_device ? "cuda" : "cpu");
  row->ttft_p50_ms = row->ttft_p99_ms = row->tpot_ms = row->tokens_per_s = row->kv_saved = NAN;
  char json[1300], args[2048];
  snprintf(json, sizeof json, "%s/runs/serve-%s-%s.json", c->o->dir, model, method);
  snprintf(args, sizeof args, "--model %s %s %s --backend %s --json %s", model, load, mode_args, row->backend, json);
  const int rc = run_cli(c, upf_cli_serve, "serve-sim", args);
  rj_value doc;
  if (rc != 0 || !read_json(json, &doc, row->error, sizeof row->error)) {
    row->failed = 1;
    if (rc != 0)
      snprintf(row->error, sizeof row->error, "upf serve-sim exited %d (e2e.log)", rc);
    snprintf(row->id, sizeof row->id, "%s/%s", model, method);
    return;
  }
  const rj_value *points = rj_get(&doc, "points");
  const rj_value *p = points && points->kind == RJ_ARRAY && points->count > 0 ? &points->items[0] : NULL;
  row->requests = (int)rj_number(p, "requests");
  row->ttft_p50_ms = rj_number(rj_get(p, "ttft_ms"), "p50");
  row->ttft_p99_ms = rj_number(rj_get(p, "ttft_ms"), "p99");
  row->tpot_ms = rj_number(rj_get(p, "tpot_ms"), "p50");
  row->tokens_per_s = rj_number(p, "output_tokens_per_s");
  row->kv_saved = rj_number(rj_get(p, "kv"), "saved_share");
  snprintf(row->id, sizeof row->id, "%s/%s/%d", model, method, row->requests);
  rj_free(&doc);
}

/* upf eval next-token over a p sweep on a real-weight file: one row per p. */
static void accuracy_sweep(e2e_ctx *c, const char *label, const char *gguf, long tokens, const char *ps) {
  upf_report_e2e *r = c->r;
  char json[1300], args[2048], err[256] = "";
  snprintf(json, sizeof json, "%s/runs/accuracy-%s-%ld.json", c->o->dir, label, tokens);
  snprintf(args, sizeof args, "--gguf %s --task next-token --tokens %ld --windows 1 --mode uniprefill --p %s "
                              "--backend %s --json %s", gguf, tokens, ps, c->o->on_device ? "cuda" : "cpu", json);
  const int rc = run_cli(c, upf_cli_eval, "eval", args);
  rj_value doc;
  const int ok = rc == 0 && read_json(json, &doc, err, sizeof err);
  const rj_value *lengths = ok ? rj_get(&doc, "lengths") : NULL;
  const rj_value *runs = lengths && lengths->kind == RJ_ARRAY && lengths->count ? rj_get(&lengths->items[0], "runs") : NULL;
  const int n = runs && runs->kind == RJ_ARRAY ? runs->count : 0;
  upf_report_accuracy_row *rows = realloc(r->accuracy, (size_t)(r->num_accuracy + (n ? n : 1)) * sizeof *rows);
  if (!rows) {
    if (ok)
      rj_free(&doc);
    return;
  }
  r->accuracy = rows;
  for (int i = 0; i < (n ? n : 1); i++) {
    upf_report_accuracy_row *row = &r->accuracy[r->num_accuracy++];
    memset(row, 0, sizeof *row);
    snprintf(row->model, sizeof row->model, "%s", label);
    snprintf(row->task, sizeof row->task, "next-token");
    snprintf(row->method, sizeof row->method, "uniprefill");
    row->tokens = tokens;
    row->p = row->agreement = row->kept_share = row->ppl = NAN;
    if (!n) {
      row->failed = 1;
      snprintf(row->error, sizeof row->error, "%s", rc ? "upf eval failed (e2e.log)" : err[0] ? err : "no runs in its JSON");
      snprintf(row->id, sizeof row->id, "%s/next-token/%ld", label, tokens);
      continue;
    }
    const rj_value *run = &runs->items[i];
    row->p = rj_number(run, "p");
    row->agreement = rj_number(run, "top1_agreement");
    const rj_value *keep = rj_get(run, "keep_ratio");
    row->kept_share = keep && keep->kind == RJ_ARRAY && keep->count ? array_at(keep, keep->count - 1) : NAN;
    snprintf(row->id, sizeof row->id, "%s/next-token/%ld/p%g", label, tokens, row->p);
  }
  if (ok)
    rj_free(&doc);
}

static int readable(const char *path) { return path && access(path, R_OK) == 0; }

void upf_report_e2e_run(const upf_report_e2e_options *o, upf_report_e2e *out) {
  memset(out, 0, sizeof *out);
  e2e_ctx c = {.o = o, .r = out};
  snprintf(c.log_path, sizeof c.log_path, "%s/e2e.log", o->dir);
  char runs[1200];
  snprintf(runs, sizeof runs, "%s/runs", o->dir);
  if (mkdir(runs, 0755) != 0 && errno != EEXIST) {
    note(out, "end to end skipped: cannot create %s: %s\n", runs, strerror(errno));
    return;
  }
  /* Models and lengths. On a device: each family's real shapes (Qwen3-Next at full depth on shared
   * weights: its distinct weights do not fit one card); on the CPU: the tiny configs, which run in seconds. */
  char names[8][64], lens[8][64];
  int nm = split_list(o->models ? o->models
                      : o->on_device ? "llama3.1-8b,gemma3-12b,qwen3-next-80b-a3b"
                                     : "llama-tiny,gemma3-tiny,qwen3-next-tiny",
                      names, 8);
  int nl = split_list(o->lengths ? o->lengths
                      : o->on_device ? (o->quick ? "8192" : "8192,32768,131072")
                                     : (o->quick ? "512" : "512,1024"),
                      lens, 8);
  e2e_model models[9];
  char sources[9][1300];
  int shared = 0;
  for (int i = 0; i < nm; i++) {
    const int big = !strcmp(names[i], "qwen3-next-80b-a3b");
    snprintf(sources[i], sizeof sources[i], "--model %s%s", names[i], big ? " --shared-weights" : "");
    shared |= big;
    models[i] = (e2e_model){names[i], family_of(names[i]), sources[i]};
  }
  if (shared)
    note(out, "Qwen3-Next-80B-A3B runs all 48 layers on shared weights (--shared-weights: one layer's weights per "
              "mixer kind, real shapes, routing and KV sizes; docs/shared-weights.md): its 148 GiB of distinct "
              "weights do not fit one card.\n");
  const int real_smollm = !o->on_device && !o->quick && readable(o->smollm2);
  if (real_smollm) {
    snprintf(sources[nm], sizeof sources[nm], "--gguf %s", o->smollm2);
    models[nm] = (e2e_model){"smollm2-135m-gguf", "llama", sources[nm]};
    nm++;
  }
  static const struct {
    const char *method, *args;
    int chunked;
  } methods[] = {
      {"dense", "--mode dense", 0},
      {"uniprefill", "--mode uniprefill", 0},
      {"flashprefill", "--mode flashprefill", 0},
      {"dense-chunked", "--mode dense", 1},
      {"compact", "--mode compact", 1},
  };
  const int nmeth = (int)(sizeof methods / sizeof methods[0]);
  /* the runs planned, for the progress lines: per (model, length) the methods (the real file: dense and
   * UniPrefill) and on the CPU one agreement run; two serving points; the accuracy sweeps */
  const char *files[2] = {o->smollm2, o->gemma270m}, *labels[2] = {"smollm2-135m", "gemma3-270m"};
  const int nfiles = o->on_device ? 2 : 1; /* the CPU: SmolLM2 at 2K, a few minutes on 2 cores */
  for (int i = 0; i < nm; i++)
    for (int j = 0; j < nl; j++) {
      const int gguf = !strcmp(models[i].model, "smollm2-135m-gguf");
      const long length = strtol(lens[j], NULL, 10);
      if (length >= 64 && (!gguf || length <= 1024))
        c.steps += gguf ? 2 : nmeth + !o->on_device;
    }
  c.steps += 2;
  for (int f = 0; f < nfiles && !o->quick; f++)
    c.steps += readable(files[f]) ? 1 + o->on_device : 0;
  for (int i = 0; i < nm; i++) {
    const int gguf = !strcmp(models[i].model, "smollm2-135m-gguf");
    for (int j = 0; j < nl; j++) {
      long length = strtol(lens[j], NULL, 10);
      if (gguf && length > 1024) /* the real file at 1K: its CPU prefill takes seconds a run */
        continue;
      if (length < 64) {
        if (i == 0)
          note(out, "length %s skipped: not a token count of at least 64\n", lens[j]);
        continue;
      }
      const int chunk = (int)(length / 4);
      int dense_row = -1;
      for (int k = 0; k < nmeth; k++) {
        if (gguf && k >= 2) /* the real file: dense against UniPrefill only */
          continue;
        if (k == 0)
          dense_row = out->num_e2e;
        e2e_prefill(&c, &models[i], length, methods[k].method, methods[k].args, methods[k].chunked ? chunk : 0);
      }
      /* agreement with dense of the tiny configs on the CPU (the real file's is the accuracy section's) */
      const upf_model_config *cfg = upf_model_config_by_name(models[i].model);
      if (!o->on_device && !gguf && cfg && dense_row >= 0 && dense_row + 1 < out->num_e2e)
        e2e_agreement(&c, &models[i], length, &out->e2e[dense_row + 1], (int)cfg->select.last_q);
    }
  }
  fill_speedups(out);
  /* serving: dense against UniPrefill top-k 0.5 and chunked prefill (dense, CompactAttention), every request
   * at t = 0 */
  const char *serve_model = o->on_device ? "llama3.1-8b" : "llama-tiny";
  const char *load = o->on_device ? (o->quick ? "--requests 4 --prompt-len 8192..16384 --decode-len 16"
                                              : "--requests 16 --prompt-len 8192..32768 --decode-len 32")
                                  : "--requests 8 --prompt-len 256..512 --decode-len 8";
  serve_point(&c, serve_model, "dense", "--mode dense", load);
  serve_point(&c, serve_model, "uniprefill-keep0.5", "--mode uniprefill --keep 0.5", load);
  /* chunked prefill as serving stacks run it: dense, and CompactAttention on the chunks with cached context */
  const char *chunk = o->on_device ? "--chunk 2048" : "--chunk 128";
  char args[64];
  snprintf(args, sizeof args, "--mode dense %s", chunk);
  serve_point(&c, serve_model, "dense-chunked", args, load);
  snprintf(args, sizeof args, "--mode compact %s", chunk);
  serve_point(&c, serve_model, "compact-chunked", args, load);
  /* accuracy on the real weights, where the files are */
  if (o->quick) {
    note(out, "accuracy on real weights skipped (--quick)\n");
  } else {
    for (int f = 0; f < nfiles; f++) {
      if (!readable(files[f])) {
        note(out, "accuracy of %s skipped: %s is absent (ci/fetch-models.sh fetches it)\n", labels[f],
             files[f] ? files[f] : "the file");
        continue;
      }
      accuracy_sweep(&c, labels[f], files[f], 2048, o->on_device ? "0.9,0.95,0.99" : "0.9,0.99");
      if (o->on_device)
        accuracy_sweep(&c, labels[f], files[f], 8192, "0.9,0.95,0.99");
    }
  }
  if (!o->on_device && !real_smollm && !o->quick)
    note(out, "the real SmolLM2 file is absent (%s): the CPU runs are the tiny configs only\n",
         o->smollm2 ? o->smollm2 : "?");
}

void upf_report_e2e_free(upf_report_e2e *r) {
  for (int i = 0; i < r->num_commands; i++)
    free(r->commands[i]);
  free(r->commands);
  free(r->e2e);
  free(r->serve);
  free(r->accuracy);
  memset(r, 0, sizeof *r);
}

/* ---- output ---- */

static void cell(FILE *f, const char *fmt, double v) {
  if (isnan(v))
    fprintf(f, " - |");
  else {
    fputc(' ', f);
    fprintf(f, fmt, v);
    fprintf(f, " |");
  }
}

void upf_report_e2e_markdown(FILE *f, const upf_report_e2e *r) {
  fprintf(f, "## end to end (TTFT of one request; median of the runs, +- half their range)\n\n");
  if (r->num_e2e == 0)
    fprintf(f, "no end-to-end run\n\n");
  const char *family = "";
  for (int i = 0; i < r->num_e2e; i++) {
    const upf_report_e2e_row *row = &r->e2e[i];
    if (strcmp(row->model, family)) {
      family = row->model;
      fprintf(f, "%s### %s (%s, %s)\n\n", i ? "\n" : "", row->model, row->backend, row->dtype[0] ? row->dtype : "?");
      fprintf(f, "| length | method | TTFT ms | +- | limit ms | limit / TTFT | speedup | kept share | top-1 agreement "
                 "| attention ms | GDN ms | FFN/MoE ms | selection/index ms |\n"
                 "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    if (row->failed) {
      fprintf(f, "| %ld | %s | FAILED: %s | | | | | | | | | | |\n", row->length, row->method, row->error);
      continue;
    }
    fprintf(f, "| %ld | %s |", row->length, row->method);
    cell(f, "%.1f", row->ttft_ms);
    cell(f, "%.1f", row->spread_ms);
    cell(f, "%.1f", row->limit_ms);
    cell(f, "%.3f", row->limit_ms / row->ttft_ms);
    cell(f, "%.2fx", row->speedup);
    cell(f, "%.3f", row->kept_share);
    cell(f, "%.4f", row->agreement);
    for (int k = 0; k < 4; k++)
      cell(f, "%.1f", row->layer_ms[k]);
    fputc('\n', f);
  }
  fprintf(f, "\nspeedup: dense TTFT / this TTFT at the same model and length (compact: against dense chunked, the "
             "same chunks); kept share: tokens after the last drop (UniPrefill), key blocks kept (FlashPrefill, "
             "CompactAttention); agreement: upf eval next-token over the observation window.\n");
  const upf_report_ceilings *c = &r->ceilings;
  if (c->gemm_flops > 0 && c->attn_flops > 0 && c->copy_bytes > 0)
    fprintf(f, "limit (dense rows): the run's dense work (upf prefill's dense_work) at this run's ceilings: GEMM and "
               "MoE FLOPs at %.1f TFLOP/s (the best cuBLAS GEMM), attention FLOPs at %.1f TFLOP/s (the best attn_prefill), "
               "glue bytes at %.2f TB/s (copy_bandwidth); the Gated DeltaNet scan has no single ceiling and is left "
               "out, so a GDN model's limit is lower still. limit / TTFT: the share of the limit reached.\n\n",
            c->gemm_flops / 1e12, c->attn_flops / 1e12, c->copy_bytes / 1e12);
  else
    fprintf(f, "limit: not computed (this run measured no device ceilings: gemm_ceiling, attn_prefill and "
               "copy_bandwidth on the backend under test).\n\n");
  fprintf(f, "## serving (upf serve-sim, every request at t = 0)\n\n");
  fprintf(f, "| model | method | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | KV saved |\n"
             "|---|---|---:|---:|---:|---:|---:|---:|\n");
  for (int i = 0; i < r->num_serve; i++) {
    const upf_report_serve_row *s = &r->serve[i];
    if (s->failed) {
      fprintf(f, "| %s | %s | FAILED: %s | | | | | |\n", s->model, s->method, s->error);
      continue;
    }
    fprintf(f, "| %s | %s | %d |", s->model, s->method, s->requests);
    cell(f, "%.1f", s->ttft_p50_ms);
    cell(f, "%.1f", s->ttft_p99_ms);
    cell(f, "%.2f", s->tpot_ms);
    cell(f, "%.1f", s->tokens_per_s);
    cell(f, "%.3f", s->kv_saved);
    fputc('\n', f);
  }
  fprintf(f, "\n## accuracy on real weights (upf eval next-token: UniPrefill against dense)\n\n");
  if (r->num_accuracy == 0)
    fprintf(f, "none run\n");
  else
    fprintf(f, "| model | tokens | p | top-1 agreement | kept share after the last drop |\n|---|---:|---:|---:|---:|\n");
  for (int i = 0; i < r->num_accuracy; i++) {
    const upf_report_accuracy_row *a = &r->accuracy[i];
    if (a->failed) {
      fprintf(f, "| %s | %ld | FAILED: %s | | |\n", a->model, a->tokens, a->error);
      continue;
    }
    fprintf(f, "| %s | %ld |", a->model, a->tokens);
    cell(f, "%g", a->p);
    cell(f, "%.4f", a->agreement);
    cell(f, "%.3f", a->kept_share);
    fputc('\n', f);
  }
  if (r->notes[0])
    fprintf(f, "\n%s", r->notes);
  fputc('\n', f);
}

static void num(FILE *f, const char *key, double v, int last) {
  fprintf(f, "\"%s\": ", key);
  if (isnan(v) || isinf(v))
    fprintf(f, "null");
  else
    fprintf(f, "%.10g", v);
  fputs(last ? "" : ", ", f);
}

static void str(FILE *f, const char *key, const char *v) {
  fprintf(f, "\"%s\": ", key);
  upf_json_string(f, v);
  fputs(", ", f);
}

void upf_report_e2e_json(FILE *f, const upf_report_e2e *r) {
  static const char *const kinds[4] = {"attention", "gdn", "ffn", "selection"};
  fprintf(f, "\"e2e\": [");
  for (int i = 0; i < r->num_e2e; i++) {
    const upf_report_e2e_row *e = &r->e2e[i];
    fprintf(f, "%s\n  {", i ? "," : "");
    str(f, "id", e->id);
    str(f, "model", e->model);
    str(f, "family", e->family);
    str(f, "method", e->method);
    str(f, "backend", e->backend);
    str(f, "dtype", e->dtype);
    num(f, "length", (double)e->length, 0);
    num(f, "repetitions", e->repetitions, 0);
    num(f, "ttft_ms", e->failed ? NAN : e->ttft_ms, 0);
    num(f, "spread_ms", e->spread_ms, 0);
    num(f, "min_ms", e->min_ms, 0);
    num(f, "speedup", e->speedup, 0);
    num(f, "kept_share", e->kept_share, 0);
    num(f, "agreement", e->agreement, 0);
    num(f, "limit_ms", e->limit_ms, 0);
    fprintf(f, "\"dense_work\": {");
    static const char *const work_keys[5] = {"gemm_flop", "moe_flop", "attn_flop", "gdn_scan_flop", "glue_bytes"};
    for (int k = 0; k < 5; k++)
      num(f, work_keys[k], e->work[k], k == 4);
    fprintf(f, "}, \"layers_ms\": {");
    for (int k = 0; k < 4; k++)
      num(f, kinds[k], e->layer_ms[k], k == 3);
    fprintf(f, "}, \"error\": ");
    if (e->failed)
      upf_json_string(f, e->error);
    else
      fprintf(f, "null");
    fprintf(f, "}");
  }
  fprintf(f, "\n],\n\"serving\": [");
  for (int i = 0; i < r->num_serve; i++) {
    const upf_report_serve_row *s = &r->serve[i];
    fprintf(f, "%s\n  {", i ? "," : "");
    str(f, "id", s->id);
    str(f, "model", s->model);
    str(f, "method", s->method);
    str(f, "backend", s->backend);
    num(f, "requests", s->requests, 0);
    num(f, "ttft_p50_ms", s->failed ? NAN : s->ttft_p50_ms, 0);
    num(f, "ttft_p99_ms", s->ttft_p99_ms, 0);
    num(f, "tpot_ms", s->tpot_ms, 0);
    num(f, "output_tokens_per_s", s->tokens_per_s, 0);
    num(f, "kv_saved", s->kv_saved, 0);
    fprintf(f, "\"error\": ");
    if (s->failed)
      upf_json_string(f, s->error);
    else
      fprintf(f, "null");
    fprintf(f, "}");
  }
  fprintf(f, "\n],\n\"accuracy\": [");
  for (int i = 0; i < r->num_accuracy; i++) {
    const upf_report_accuracy_row *a = &r->accuracy[i];
    fprintf(f, "%s\n  {", i ? "," : "");
    str(f, "id", a->id);
    str(f, "model", a->model);
    str(f, "task", a->task);
    str(f, "method", a->method);
    num(f, "tokens", (double)a->tokens, 0);
    num(f, "p", a->p, 0);
    num(f, "agreement", a->agreement, 0);
    num(f, "kept_share", a->kept_share, 0);
    fprintf(f, "\"error\": ");
    if (a->failed)
      upf_json_string(f, a->error);
    else
      fprintf(f, "null");
    fprintf(f, "}");
  }
  fprintf(f, "\n]");
}
