/* `upf serve-sim`: a request trace (seeded, or JSON lines) served by the continuous-batching engine
 * over a session of a built-in model on seeded weights, dense, UniPrefill or FlashPrefill; prints TTFT and TPOT
 * percentiles, throughput, batch composition and KV memory per point, and writes them with the
 * per-request records to a JSON file and the generated tokens to a .npy; --chunk C runs chunked
 * prefill (decode rows first, then prefill chunks up to the token budget). Every input is checked
 * before any work; outputs are written only once every point ran. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/model_args.h"
#include "cli/select_args.h"
#include "uniprefill/engine.h"
#include "uniprefill/model.h"
#include "uniprefill/npy.h"
#include "uniprefill/provenance.h"
#include "uniprefill/session.h"

const char upf_cli_serve_usage[] =
    "usage: upf serve-sim (--model NAME | --gguf FILE) [--backend cpu|cuda] [--dtype f32|bf16]\n"
    "                     [--mode dense|uniprefill|flashprefill|compact] [--recent R] [--p P | --keep R] [--alpha A]\n"
    "                     [--block-n 64|128]\n"
    "                     [--mean-correction on|off] [--sink S] [--window W] [--last-n N]\n"
    "                     [--requests N[,N...]] [--prompt-len A..B] [--decode-len N]\n"
    "                     [--rate R | --trace FILE.jsonl] [--seed S] [--token-budget N] [--chunk C] [--page-size P]\n"
    "                     [--kv-pages N | --kv-gib G] [--max-live N] [--eos ID] [--warmup N]\n"
    "                     [--json R.json] [--dump-tokens OUT.npy]\n"
    "  Serves a request trace with continuous batching on a built-in model (upf models, weights seeded by S) or a GGUF file:\n"
    "  each step holds one decode row per running request and the whole-prompt prefill rows of requests\n"
    "  admitted first come first served while the step's tokens (prefill tokens + decode rows) stay within\n"
    "  --token-budget (default 8192; a longer prompt runs alone in the next step, decodes pausing for it)\n"
    "  and the request's worst case (dense pages for prompt + decode-len - 1 tokens) fits every cache\n"
    "  group's pages. Requests wait for pages; none is preempted. Tokens are greedy (ties to the lowest\n"
    "  id); a request ends after N tokens or at --eos.\n"
    "  --chunk C: chunked prefill (the vLLM / SGLang policy): each step takes the decode rows first, then the\n"
    "  next chunk of every prompt in progress and of newly admitted ones, each at most C tokens and what\n"
    "  the --token-budget leaves (so no step exceeds the budget but by decode rows); a chunk writes its KV\n"
    "  into the paged cache and attends to its earlier chunks' KV; the last chunk gives the first token.\n"
    "  With --mode uniprefill a prompt split in more than one chunk runs dense in every chunk (chunks with\n"
    "  cached context run dense, SPEC section 4); prompts of at most C tokens drop as usual. With --mode\n"
    "  flashprefill a chunk runs block-sparse over its cached context and itself. --mode compact (needs\n"
    "  --chunk): CompactAttention, a chunk with cached context attends over the union of its kept key\n"
    "  blocks (upf prefill --help); --recent R blocks before the chunk always kept (default 2).\n"
    "  The clock is simulated: it advances by each step's measured time (the backend finished), arrivals\n"
    "  come by the trace; TTFT = first token - arrival, TPOT = mean gap between a request's later tokens.\n"
    "  Trace: --requests N (default 8; a list runs one seeded trace per count, on one model and session),\n"
    "  prompt lengths uniform in A..B (default 256..1024) of seeded ids, --decode-len N new tokens\n"
    "  (default 16), arriving as a Poisson process of R requests/s from the seed, or all at t = 0 when R\n"
    "  is 0 (the default) or inf. Or --trace FILE.jsonl, one request a line:\n"
    "    {\"arrival\": 0.5, \"prompt_len\": 8192, \"seed\": 3, \"max_new\": 32, \"id\": 7}\n"
    "    {\"arrival\": 0.7, \"prompt\": [1, 2, 3]}\n"
    "  (arrival required; prompt ids or prompt_len with an optional seed (default the line number);\n"
    "  max_new default --decode-len; id default the line number). A bad line is named by its number.\n"
    "  --mode uniprefill drops tokens at the drop layers of each prefill row: top-p with --p (default the\n"
    "  model's) or top-k --keep R. --mode flashprefill: the prefill rows' full-attention layers run\n"
    "  FlashPrefill V2's block-sparse attention (--alpha and the rest as upf prefill); decode rows and the\n"
    "  KV pages are as dense; the kept share of the key blocks is reported per point. KV pages: P tokens (--page-size, default 16) per attention layer, a\n"
    "  budget per cache group (the layers between two drop layers): --kv-pages N each, or --kv-gib G bytes\n"
    "  split over the groups (dense and top-p: the same pages each; top-k: each group one step's prefill\n"
    "  plus a share of the rest in proportion to the tokens --keep leaves there at the mean prompt); by\n"
    "  default every request of the trace fits at once. --max-live N: requests holding state at once\n"
    "  (default the trace's size). --warmup N: N one-request traces first, not reported (default 1 on cuda).\n"
    "  --json: the settings, per point the percentiles, throughput, batch composition, KV memory peaks (used,\n"
    "  dense-equivalent, saved), steps, and per request its times and tokens. --dump-tokens OUT.npy: <i4\n"
    "  (requests, max new) of one point, trace order, -1 after a request's last token.\n";

typedef struct {
  upf_model_args sel; /* --model | --gguf, --seed, --dtype, --backend */
  upf_select_args sa; /* --mode, --p, --keep */
  upf_sparse_args fa; /* --alpha, --block-n, --mean-correction, --sink, --window, --last-n */
  const char *requests, *prompt_len, *rate, *trace, *json, *dump;
  int32_t decode_len, budget, page, kv_pages, max_live, eos, warmup, chunk;
  float kv_gib;
} serve_args;

/* "1,4,16" into counts, each in [1, 1e6]. */
static int parse_counts(const char *s, int32_t *out, int cap, int *n) {
  *n = 0;
  for (const char *c = s; *c;) {
    char *end;
    const long long v = strtoll(c, &end, 10);
    if (end == c || v < 1 || v > 1000000 || (*end && *end != ',') || *n == cap)
      return 0;
    out[(*n)++] = (int32_t)v;
    c = *end ? end + 1 : end;
    if (*end && !*c)
      return 0;
  }
  return *n > 0;
}

/* "A..B" (or "A") into 1 <= a <= b < 2^31. */
static int parse_len_range(const char *s, int32_t *a, int32_t *b) {
  char *end;
  const long long x = strtoll(s, &end, 10);
  long long y = x;
  if (end == s)
    return 0;
  if (!strncmp(end, "..", 2)) {
    const char *s2 = end + 2;
    y = strtoll(s2, &end, 10);
    if (end == s2)
      return 0;
  }
  if (*end || x < 1 || y < x || y > INT32_MAX)
    return 0;
  *a = (int32_t)x, *b = (int32_t)y;
  return 1;
}

/* "inf", or a finite number >= 0. */
static int parse_rate(const char *s, double *r) {
  if (!strcmp(s, "inf")) {
    *r = INFINITY;
    return 1;
  }
  char *end;
  *r = strtod(s, &end);
  return end != s && !*end && isfinite(*r) && *r >= 0;
}

/* The cache group of layer l (session.h): the number of drop layers before it. */
static int32_t group_of(const upf_model_config *c, int32_t l) {
  int32_t g = 0;
  while (g < c->num_drop_layers && c->drop_layers[g] < l)
    g++;
  return g;
}

/* Splits `bytes` of KV memory into per-group page budgets (see the usage). 0 with a message when
 * the budget cannot hold one step's prefill. */
static int split_kv(const upf_model *m, const upf_select_params *sel, int uniprefill, double bytes, int32_t page,
                    int64_t budget_tokens, int32_t max_live, double mean_prompt, int64_t *group_pages) {
  const upf_model_config *c = m->cfg;
  const int32_t G = c->num_drop_layers + 1;
  double bpp[UPF_SESSION_MAX_GROUPS] = {0}, share[UPF_SESSION_MAX_GROUPS];
  for (int32_t l = m->layer_begin; l < m->layer_end; l++)
    if (upf_model_mixer(c, l) != UPF_MIXER_GDN)
      bpp[group_of(c, l)] += 2.0 * page * c->kv_heads * c->head_dim * (double)upf_dtype_size(m->dtype);
  /* tokens left in each group at the mean prompt by top-k: ceil(R * blocks) blocks plus sink and last L */
  double len = mean_prompt;
  for (int32_t g = 0; g < G; g++) {
    if (g > 0 && uniprefill && sel->keep_ratio > 0) {
      const double blocks = ceil(len / sel->block), kept = ceil(sel->keep_ratio * blocks) * sel->block + sel->sink + sel->last_q;
      len = kept < len ? kept : len;
    }
    share[g] = len / mean_prompt;
  }
  const double transient = ceil((double)budget_tokens / page) + max_live;
  double fixed = 0, per_x = 0;
  for (int32_t g = 0; g < G; g++)
    fixed += bpp[g] * transient, per_x += bpp[g] * share[g];
  if (bytes < fixed || per_x <= 0) {
    fprintf(stderr, "upf serve-sim: --kv-gib %g: one step's prefill (--token-budget %lld tokens) needs %.4g GiB of "
                    "pages in the cache groups\n", bytes / (1 << 30), (long long)budget_tokens, fixed / (1 << 30));
    return 0;
  }
  const double x = (bytes - fixed) / per_x;
  for (int32_t g = 0; g < G; g++)
    group_pages[g] = bpp[g] > 0 ? (int64_t)floor(transient + x * share[g]) : 1;
  return 1;
}

/* One point of the run: its trace, what the engine made of it, and the session's wall time. */
typedef struct {
  upf_trace trace;
  upf_engine_result res;
  double wall;
  int64_t sparse_kept, sparse_visible; /* FlashPrefill: key blocks over the point's prefill steps */
} serve_point;

static void json_ms3(FILE *f, const char *key, const double *p, double mean) {
  fprintf(f, "\"%s\": {\"p50\": %.4f, \"p90\": %.4f, \"p99\": %.4f, \"mean\": %.4f}", key, p[0] * 1e3, p[1] * 1e3,
          p[2] * 1e3, mean * 1e3);
}

static void json_point(FILE *f, const serve_point *pt, const serve_args *a) {
  const upf_engine_result *r = &pt->res;
  const double gib = 1.0 / (1 << 30);
  fprintf(f, "    {\n      \"requests\": %d,\n      \"steps\": %lld,\n", r->num_reqs, (long long)r->num_steps);
  fprintf(f, "      \"start_s\": %.6f, \"end_s\": %.6f, \"busy_s\": %.6f, \"step_wall_s\": %.6f,\n", r->start, r->end,
          r->busy_seconds, pt->wall);
  fprintf(f, "      ");
  json_ms3(f, "ttft_ms", r->ttft_p, r->ttft_mean);
  fprintf(f, ",\n      ");
  json_ms3(f, "tpot_ms", r->tpot_p, r->tpot_mean);
  fprintf(f, ",\n      \"prompt_tokens\": %lld, \"output_tokens\": %lld,\n", (long long)r->prompt_tokens,
          (long long)r->output_tokens);
  fprintf(f, "      \"output_tokens_per_s\": %.4f, \"total_tokens_per_s\": %.4f,\n", r->output_tokens_per_s,
          r->total_tokens_per_s);
  fprintf(f, "      \"batch\": {\"mean_prefill_rows\": %.4f, \"mean_decode_rows\": %.4f, \"mean_prefill_tokens\": %.2f, "
             "\"max_running\": %d},\n", r->mean_prefill_rows, r->mean_decode_rows, r->mean_prefill_tokens, r->max_running);
  if (a->chunk) {
    int64_t chunk_rows = 0, chunked = 0;
    for (int64_t k = 0; k < r->num_steps; k++)
      chunk_rows += r->steps[k].prefill_chunks;
    for (int32_t i = 0; i < r->num_reqs; i++)
      chunked += r->reqs[i].num_chunks > 1;
    fprintf(f, "      \"chunked_prefill\": {\"chunk_rows\": %lld, \"chunked_requests\": %lld},\n", (long long)chunk_rows,
            (long long)chunked);
  }
  if (a->sa.prefill_mode == UPF_PREFILL_FLASHPREFILL || a->sa.prefill_mode == UPF_PREFILL_COMPACT)
    fprintf(f, "      \"sparse\": {\"kept_blocks\": %lld, \"visible_blocks\": %lld, \"kept_share\": %.6f},\n",
            (long long)pt->sparse_kept, (long long)pt->sparse_visible,
            pt->sparse_visible ? (double)pt->sparse_kept / (double)pt->sparse_visible : 1.0);
  fprintf(f, "      \"kv\": {\"pages_peak\": %lld, \"pages_dense_peak\": %lld, \"gib_peak\": %.6f, \"gib_dense_peak\": %.6f, "
             "\"gib_saved\": %.6f, \"saved_share\": %.6f, \"gib_capacity\": %.6f},\n",
          (long long)r->pages_peak, (long long)r->pages_dense_peak, r->kv_bytes_peak * gib, r->kv_dense_bytes_peak * gib,
          r->kv_saved_bytes * gib, r->kv_saved_share, r->kv_bytes_capacity * gib);
  fprintf(f, "      \"step_log\": {\"columns\": [\"start_ms\", \"ms\", \"prefill_rows\", \"decode_rows\", \"prefill_tokens\", "
             "\"running\", \"pages_used\", \"pages_dense\", \"prefill_chunks\"], \"rows\": [");
  for (int64_t s = 0; s < r->num_steps; s++) {
    const upf_engine_step_record *st = &r->steps[s];
    fprintf(f, "%s\n        [%.4f, %.4f, %d, %d, %lld, %d, %lld, %lld, %d]", s ? "," : "", st->start * 1e3,
            st->seconds * 1e3, st->prefill_rows, st->decode_rows, (long long)st->prefill_tokens, st->running,
            (long long)st->pages_used, (long long)st->pages_dense, st->prefill_chunks);
  }
  fprintf(f, "]},\n      \"per_request\": [");
  for (int32_t i = 0; i < r->num_reqs; i++) {
    const upf_engine_record *q = &r->reqs[i];
    fprintf(f, "%s\n        {\"id\": %lld, \"arrival_s\": %.6f, \"prompt_len\": %d, \"max_new\": %d, \"generated\": %d, "
               "\"admitted_s\": %.6f, \"first_token_s\": %.6f, \"finished_s\": %.6f, \"ttft_ms\": %.4f, \"tpot_ms\": %.4f, "
               "\"admit_step\": %lld, \"finish_step\": %lld, \"pages_after_prefill\": %lld, \"dense_pages_after_prefill\": "
               "%lld, \"prefill_chunks\": %d, \"tokens\": [",
            i ? "," : "", (long long)q->id, q->arrival, q->prompt_len, q->max_new, q->num_generated, q->admitted,
            q->first_token, q->finished, q->ttft * 1e3, q->tpot * 1e3, (long long)q->admit_step, (long long)q->finish_step,
            (long long)q->pages_after_prefill, (long long)q->dense_pages_after_prefill, q->num_chunks);
    for (int32_t k = 0; k < q->num_generated; k++)
      fprintf(f, "%s%d", k ? ", " : "", q->tokens[k]);
    fprintf(f, "]}");
  }
  fprintf(f, "\n      ]\n    }");
  (void)a;
}

static upf_status write_json(upf_outputs *o, const char *path, const serve_args *a, const upf_model *m, const upf_session_config *sc,
                             int32_t num_groups, const serve_point *pts, int n, int argc, char **argv) {
  FILE *f;
  UPF_TRY(upf_outputs_open(o, path, "--json", &f));
  char commit[80];
  if (!upf_source_commit(commit, sizeof commit))
    snprintf(commit, sizeof commit, "unknown");
  const upf_model_config *c = m->cfg;
  fprintf(f, "{\n  \"model\": \"%s\",\n  \"mode\": \"%s\",\n  \"dtype\": \"%s\",\n  \"backend\": \"%s\",\n  \"device\": ",
          c->name, a->sa.mode, upf_dtype_name(m->dtype), m->be->name);
  upf_json_string(f, m->be->describe());
  fprintf(f, ",\n  \"select\": {\"kind\": \"%s\", \"p\": %g, \"keep_ratio\": %g, \"block\": %d, \"sink\": %d, \"last_q\": %d},\n",
          sc->select.keep_ratio > 0 ? "topk" : "topp", (double)sc->select.p, (double)sc->select.keep_ratio,
          sc->select.block, sc->select.sink, sc->select.last_q);
  if (sc->mode == UPF_PREFILL_FLASHPREFILL) {
    fprintf(f, "  \"flashprefill\": ");
    upf_sparse_args_json(f, &sc->sparse);
    fprintf(f, ",\n");
  }
  if (sc->mode == UPF_PREFILL_COMPACT) { /* each point's "sparse": the chunks' kept / visible key blocks */
    fprintf(f, "  \"compact\": {\"recent\": %d, \"selector\": ", sc->compact.recent);
    upf_sparse_args_json(f, &sc->sparse);
    fprintf(f, "},\n");
  }
  fprintf(f, "  \"trace\": {\"source\": ");
  upf_json_string(f, a->trace ? a->trace : "seeded");
  fprintf(f, ", \"rate\": \"%s\", \"prompt_len\": \"%s\", \"decode_len\": %d, \"seed\": %d},\n", a->rate ? a->rate : "0",
          a->prompt_len, a->decode_len, a->sel.seed);
  fprintf(f, "  \"token_budget\": %d,\n  \"page_size\": %d,\n  \"max_live\": %d,\n  \"eos\": %d,\n", a->budget,
          sc->page_size, sc->max_requests, a->eos);
  fprintf(f, "  \"chunk\": %d,\n", a->chunk);
  if (a->chunk && sc->mode == UPF_PREFILL_UNIPREFILL)
    fprintf(f, "  \"chunked_uniprefill\": \"chunks with cached context ran dense: every chunk of a prompt split in more "
               "than one chunk ran dense; prompts of at most %d tokens dropped as usual\",\n", a->chunk);
  fprintf(f, "  \"group_pages\": [");
  for (int32_t g = 0; g < num_groups; g++)
    fprintf(f, "%s%lld", g ? ", " : "", (long long)(sc->group_pages[g] > 0 ? sc->group_pages[g] : sc->pages_per_group));
  fprintf(f, "],\n  \"shared_weights\": %s,\n  \"weights_gib\": %.4f,\n  \"commit\": \"%s\",\n  \"command\": ",
          m->shared_weights ? "true" : "false", m->weight_bytes / (1 << 30), commit);
  upf_json_command(f, "upf serve-sim", argc, argv);
  fprintf(f, ",\n  \"points\": [\n");
  for (int i = 0; i < n; i++) {
    json_point(f, &pts[i], a);
    fprintf(f, "%s\n", i + 1 < n ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  return UPF_OK; /* a write error shows when the set is committed */
}

static upf_status dump_tokens(upf_outputs *o, const char *path, const upf_engine_result *r) {
  int32_t width = 1;
  for (int32_t i = 0; i < r->num_reqs; i++)
    width = r->reqs[i].max_new > width ? r->reqs[i].max_new : width;
  int32_t *out = malloc((size_t)r->num_reqs * width * sizeof *out);
  if (!out)
    return upf_fail(UPF_ERR_NOMEM, "tokens (%d x %d)", r->num_reqs, width);
  for (int32_t i = 0; i < r->num_reqs; i++)
    for (int32_t k = 0; k < width; k++)
      out[(int64_t)i * width + k] = k < r->reqs[i].num_generated ? r->reqs[i].tokens[k] : -1;
  upf_tensor t;
  const int64_t shape[2] = {r->num_reqs, width};
  upf_status st = upf_tensor_init(&t, out, UPF_DTYPE_I32, 2, shape);
  if (st == UPF_OK)
    st = upf_npy_write_to(o, path, "--dump-tokens", &t);
  free(out);
  return st;
}

static void print_point(const upf_model *m, const char *mode, const serve_point *pt, int32_t chunk) {
  const upf_engine_result *r = &pt->res;
  const double gib = 1.0 / (1 << 30);
  printf("%s %s on %s: %d requests (%lld prompt, %lld output tokens), %lld steps over %.3f s\n", m->cfg->name, mode,
         m->be->name, r->num_reqs, (long long)r->prompt_tokens, (long long)r->output_tokens, (long long)r->num_steps,
         r->end - r->start);
  printf("  TTFT p50 %.3f  p90 %.3f  p99 %.3f ms;  TPOT p50 %.3f  p90 %.3f  p99 %.3f ms\n", r->ttft_p[0] * 1e3,
         r->ttft_p[1] * 1e3, r->ttft_p[2] * 1e3, r->tpot_p[0] * 1e3, r->tpot_p[1] * 1e3, r->tpot_p[2] * 1e3);
  printf("  throughput %.2f output tok/s, %.2f total tok/s; per step %.2f prefill rows (%.1f tokens) + %.2f decode rows; "
         "at most %d running\n", r->output_tokens_per_s, r->total_tokens_per_s, r->mean_prefill_rows,
         r->mean_prefill_tokens, r->mean_decode_rows, r->max_running);
  if (chunk) {
    int64_t chunk_rows = 0, chunked = 0;
    for (int64_t k = 0; k < r->num_steps; k++)
      chunk_rows += r->steps[k].prefill_chunks;
    for (int32_t i = 0; i < r->num_reqs; i++)
      chunked += r->reqs[i].num_chunks > 1;
    printf("  chunked prefill: %lld of %d requests in more than one chunk, %lld chunk rows%s\n", (long long)chunked,
           r->num_reqs, (long long)chunk_rows,
           !strcmp(mode, "uniprefill") ? "; chunks with cached context ran dense (every chunk of a prompt split in more "
                                         "than one chunk)" : "");
  }
  if (pt->sparse_visible)
    printf("  %s: kept share %.4f of the visible key blocks (%lld of %lld over every prefill step's "
           "full-attention layers)\n", mode, (double)pt->sparse_kept / (double)pt->sparse_visible,
           (long long)pt->sparse_kept, (long long)pt->sparse_visible);
  printf("  KV peak %.4f GiB (%lld pages) against %.4f GiB dense-equivalent: %.4f GiB saved (%.1f%%), of %.4f GiB\n",
         r->kv_bytes_peak * gib, (long long)r->pages_peak, r->kv_dense_bytes_peak * gib, r->kv_saved_bytes * gib,
         100 * r->kv_saved_share, r->kv_bytes_capacity * gib);
}

/* Runs one trace on the session; ws is the point (trace filled, result and wall filled here). */
static upf_status run_point(upf_session *s, const upf_model *m, int32_t max_live, const upf_engine_options *eo,
                            serve_point *pt) {
  upf_engine_ops ops;
  UPF_TRY(upf_engine_session_ops(s, m, max_live, pt->trace.num_reqs, &ops));
  const upf_status st = upf_engine_run(&ops, &pt->trace, eo, &pt->res);
  pt->wall = upf_engine_session_wall_seconds(&ops);
  upf_engine_session_sparse_blocks(&ops, &pt->sparse_kept, &pt->sparse_visible);
  upf_engine_session_ops_free(&ops);
  return st;
}

#define MAX_POINTS 32

int upf_cli_serve(int argc, char **argv) {
  serve_args a = {.sel = UPF_MODEL_ARGS_DEFAULT, .sa = UPF_SELECT_ARGS_DEFAULT, .fa = UPF_SPARSE_ARGS_DEFAULT,
                  .requests = "8",
                  .prompt_len = "256..1024", .decode_len = 16, .budget = 8192, .page = 16, .eos = -1, .warmup = -1};
  upf_arg args[] = {
      UPF_MODEL_ARG_FLAGS(a.sel),
      UPF_SELECT_ARG_FLAGS(a.sa),
      UPF_SPARSE_ARG_FLAGS(a.fa),
      {"--requests", UPF_ARG_STRING, &a.requests},
      {"--prompt-len", UPF_ARG_STRING, &a.prompt_len},
      {"--decode-len", UPF_ARG_INT, &a.decode_len, 0, 1, 1 << 20},
      {"--rate", UPF_ARG_STRING, &a.rate},
      {"--trace", UPF_ARG_STRING, &a.trace},
      {"--token-budget", UPF_ARG_INT, &a.budget, 0, 1, INT32_MAX},
      {"--chunk", UPF_ARG_INT, &a.chunk, 0, 1, INT32_MAX},
      {"--page-size", UPF_ARG_INT, &a.page, 0, 1, 1 << 16},
      {"--kv-pages", UPF_ARG_INT, &a.kv_pages, 0, 1, INT32_MAX},
      {"--kv-gib", UPF_ARG_FLOAT, &a.kv_gib},
      {"--max-live", UPF_ARG_INT, &a.max_live, 0, 1, 1 << 20},
      {"--eos", UPF_ARG_INT, &a.eos, 0, 0, INT32_MAX},
      {"--warmup", UPF_ARG_INT, &a.warmup, 0, 0, 100},
      {"--json", UPF_ARG_STRING, &a.json},
      {"--dump-tokens", UPF_ARG_STRING, &a.dump},
  };
  upf_arg_parser p = {"upf serve-sim", upf_cli_serve_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result pr = upf_args_parse(&p, argc, argv);
  if (pr != UPF_ARGS_OK)
    return upf_args_exit_code(pr);
#define SEEN(flag) (upf_args_find(&p, flag)->seen)
  const int rc_sel = upf_model_args_resolve("serve-sim", &a.sel);
  if (rc_sel)
    return rc_sel;
  if (upf_model_args_partial(&a.sel)) {
    fprintf(stderr, "upf serve-sim: --layers %s: serving runs the whole model\n", a.sel.layers);
    return 2;
  }
  const upf_model_config *cfg = a.sel.cfg;
  const upf_backend *be = a.sel.be;
  const int rc_mode = upf_mode_args_resolve("serve-sim", &p, &a.sa, &a.fa);
  if (rc_mode)
    return rc_mode;
  if (a.sa.prefill_mode == UPF_PREFILL_COMPACT && !a.chunk) {
    fprintf(stderr, "upf serve-sim: --mode compact needs --chunk C (CompactAttention runs the chunks of a chunked "
                    "prefill over their cached context)\n");
    return 2;
  }
  if (!upf_model_args_check_seed("serve-sim", &a.sel, SEEN("--seed"),
                                 a.sel.gguf && a.trace ? "the weights are --gguf's and --trace gives the requests (a "
                                                         "line's own \"seed\" draws its ids)" : NULL))
    return 2;
  if (a.trace && (SEEN("--rate") || SEEN("--requests") || SEEN("--prompt-len"))) {
    fprintf(stderr, "upf serve-sim: --trace gives the requests: --rate, --requests and --prompt-len go without it\n");
    return 2;
  }
  if (SEEN("--kv-pages") && SEEN("--kv-gib")) {
    fprintf(stderr, "upf serve-sim: give one of --kv-pages and --kv-gib\n");
    return 2;
  }
  if (SEEN("--kv-gib") && !(a.kv_gib > 0.0f)) {
    fprintf(stderr, "upf serve-sim: --kv-gib %g: want GiB > 0\n", (double)a.kv_gib);
    return 2;
  }
  int32_t counts[MAX_POINTS];
  int num_points = 1;
  if (!a.trace && !parse_counts(a.requests, counts, MAX_POINTS, &num_points)) {
    fprintf(stderr, "upf serve-sim: --requests '%s': want request counts in [1, 1000000] separated by commas "
                    "(at most %d)\n", a.requests, MAX_POINTS);
    return 2;
  }
  int32_t len_min = 0, len_max = 0;
  if (!parse_len_range(a.prompt_len, &len_min, &len_max)) {
    fprintf(stderr, "upf serve-sim: --prompt-len '%s': want A..B (or A) with 1 <= A <= B <= 2147483647 (2^31-1)\n", a.prompt_len);
    return 2;
  }
  double rate = 0;
  if (a.rate && !parse_rate(a.rate, &rate)) {
    fprintf(stderr, "upf serve-sim: --rate '%s': want requests per second >= 0, or inf (0 and inf: all at t = 0)\n",
            a.rate);
    return 2;
  }
  if (a.dump && num_points > 1) {
    fprintf(stderr, "upf serve-sim: --dump-tokens writes one point's tokens: give one --requests count\n");
    return 2;
  }
  if (a.eos >= cfg->vocab) {
    fprintf(stderr, "upf serve-sim: --eos %d is outside the vocabulary [0, %d) of %s\n", a.eos, cfg->vocab, cfg->name);
    return 2;
  }
  const upf_dtype dtype = a.sel.dt;
  const upf_arg_path paths[] = {{"--trace", a.trace, 0}, {"--gguf", a.sel.gguf, 0}, {"--json", a.json, 1},
                                {"--dump-tokens", a.dump, 1}};
  if (!upf_args_check_paths("upf serve-sim", paths, (int)(sizeof paths / sizeof *paths)))
    return 2;
  upf_status st = UPF_OK;

  /* the traces, before the weights */
  serve_point *pts = calloc((size_t)num_points, sizeof *pts);
  if (!pts)
    return upf_cli_error(upf_fail(UPF_ERR_NOMEM, "points"), "serve-sim");
  int rc = 0;
  for (int i = 0; i < num_points && rc == 0; i++) {
    if (a.trace)
      st = upf_trace_read_jsonl(&pts[i].trace, a.trace, cfg->vocab, a.decode_len);
    else {
      const upf_trace_spec spec = {counts[i], len_min, len_max, a.decode_len, rate, (uint64_t)a.sel.seed};
      st = upf_trace_seeded(&pts[i].trace, &spec, cfg->vocab);
    }
    if (st != UPF_OK)
      rc = upf_cli_error(st, a.trace ? "serve-sim: --trace" : "serve-sim: the seeded trace (--requests, --rate, --prompt-len)");
    /* every request, prompt and generated tokens, within the model's context */
    const int64_t ctx = cfg->context_length;
    for (int32_t r = 0; rc == 0 && ctx > 0 && r < pts[i].trace.num_reqs; r++) {
      const upf_engine_request *q = &pts[i].trace.reqs[r];
      const int64_t need = (int64_t)q->prompt_len + q->max_new - 1;
      if (need > ctx && !a.sel.allow_over_context) {
        fprintf(stderr, "upf serve-sim: %s: request id %lld runs %lld positions (prompt %d + %d new - 1), past the "
                        "context_length %lld that %s states; shorten it, or pass --allow-over-context\n",
                a.trace ? "--trace" : "--prompt-len", (long long)q->id, (long long)need, q->prompt_len, q->max_new,
                (long long)ctx, a.sel.gguf ? a.sel.gguf : cfg->name);
        rc = 2;
      }
    }
  }
  int32_t most = 0;
  int64_t worst_all = 0;
  double mean_prompt = 0;
  int64_t prompts = 0;
  for (int i = 0; i < num_points && rc == 0; i++) {
    const upf_trace *t = &pts[i].trace;
    most = t->num_reqs > most ? t->num_reqs : most;
    int64_t worst = 0;
    for (int32_t r = 0; r < t->num_reqs; r++) {
      worst += ((int64_t)t->reqs[r].prompt_len + t->reqs[r].max_new - 1 + a.page - 1) / a.page;
      mean_prompt += t->reqs[r].prompt_len, prompts++;
    }
    worst_all = worst > worst_all ? worst : worst_all;
  }
  mean_prompt /= prompts ? (double)prompts : 1;
  const int32_t max_live = a.max_live ? a.max_live : most;

  upf_model m;
  memset(&m, 0, sizeof m);
  int have_model = 0;
  upf_session *sess = NULL;
  upf_session_config sc;
  if (rc == 0) {
    st = upf_model_args_build("serve-sim", &a.sel, &m);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "serve-sim: building the model");
    have_model = st == UPF_OK;
  }
  if (rc == 0) {
    sc = upf_session_config_default(&m);
    sc.mode = a.sa.prefill_mode, sc.sparse = a.fa.params, sc.compact = a.fa.compact;
    upf_select_args_apply(&a.sa, &sc.select);
    sc.page_size = a.page, sc.max_requests = max_live;
    sc.pages_per_group = a.kv_pages ? a.kv_pages : worst_all;
    const int uniprefill = a.sa.prefill_mode == UPF_PREFILL_UNIPREFILL;
    if (SEEN("--kv-gib") && !split_kv(&m, &sc.select, uniprefill, (double)a.kv_gib * (1 << 30),
                                      a.page, a.budget, max_live, mean_prompt, sc.group_pages))
      rc = 2;
  }
  if (rc == 0) {
    st = upf_session_create(&m, &sc, &sess);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "serve-sim: creating the session (--kv-pages / --kv-gib, --max-live)");
  }
  const int32_t num_groups = sess ? upf_session_num_groups(sess) : 0;
  if (rc == 0) {
    upf_session_memory mem;
    upf_session_memory_usage(sess, &mem);
    fprintf(stderr, "serve-sim: %s%s %s %s on %s: weights %.2f GiB, KV pages %.2f GiB in %d cache groups (pages:", cfg->name,
            upf_model_args_label(&a.sel), a.sa.mode, upf_dtype_name(dtype), be->name, m.weight_bytes / (1 << 30), mem.bytes_capacity / (1 << 30),
            num_groups);
    for (int32_t g = 0; g < num_groups; g++)
      fprintf(stderr, " %lld", (long long)upf_session_pages_total(sess, g));
    fprintf(stderr, "), token budget %d, at most %d live\n", a.budget, max_live);
    if (a.chunk)
      fprintf(stderr, "serve-sim: chunked prefill: chunks of at most %d tokens; per step the decode rows first, then "
                      "prefill chunks up to the token budget of %d%s\n", a.chunk, a.budget,
              sc.mode == UPF_PREFILL_UNIPREFILL ? "; uniprefill: chunks with cached context run dense (every chunk of a "
                                                  "prompt split in more than one chunk)" : "");
    if (sc.mode == UPF_PREFILL_FLASHPREFILL) {
      char params[256];
      upf_sparse_args_describe(&sc.sparse, params, sizeof params);
      fprintf(stderr, "serve-sim: flashprefill: %s\n", params);
    }
    if (sc.mode == UPF_PREFILL_COMPACT) {
      char params[256];
      upf_sparse_args_describe(&sc.sparse, params, sizeof params);
      fprintf(stderr, "serve-sim: compact: %s, recent %d (chunks with cached context)\n", params, sc.compact.recent);
    }
  }
  const upf_engine_options eo = {.token_budget = a.budget, .eos = a.eos, .keep_steps = 1, .chunk = a.chunk};
  /* warm-up: one-request traces of the shortest prompt (cuBLAS plans, workspace growth) */
  const int warmups = a.warmup >= 0 ? a.warmup : be != upf_backend_cpu();
  for (int w = 0; w < warmups && rc == 0; w++) {
    serve_point wp = {0};
    const upf_trace_spec spec = {1, pts[0].trace.reqs[0].prompt_len, pts[0].trace.reqs[0].prompt_len, 2, 0,
                                 (uint64_t)a.sel.seed + 1000 + (uint64_t)w};
    st = upf_trace_seeded(&wp.trace, &spec, cfg->vocab);
    if (st == UPF_OK)
      st = run_point(sess, &m, max_live, &eo, &wp);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "serve-sim: warm-up");
    upf_engine_result_free(&wp.res);
    upf_trace_free(&wp.trace);
  }
  for (int i = 0; i < num_points && rc == 0; i++) {
    st = run_point(sess, &m, max_live, &eo, &pts[i]);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "serve-sim");
    else
      print_point(&m, a.sa.mode, &pts[i], a.chunk);
  }
  /* the outputs land together or not at all */
  upf_outputs *outs = NULL;
  if (rc == 0 && (a.dump || a.json) && (st = upf_outputs_create(&outs, 0)) != UPF_OK)
    rc = upf_cli_error(st, "serve-sim");
  if (rc == 0 && a.dump && (st = dump_tokens(outs, a.dump, &pts[0].res)) != UPF_OK)
    rc = upf_cli_error(st, "serve-sim");
  if (rc == 0 && a.json && (st = write_json(outs, a.json, &a, &m, &sc, num_groups, pts, num_points, argc, argv)) != UPF_OK)
    rc = upf_cli_error(st, "serve-sim");
  if (rc == 0 && outs && (st = upf_outputs_commit(outs)) != UPF_OK)
    rc = upf_cli_error(st, "serve-sim");
  upf_outputs_free(outs);
  for (int i = 0; i < num_points; i++)
    upf_engine_result_free(&pts[i].res), upf_trace_free(&pts[i].trace);
  free(pts);
  if (sess)
    upf_session_free(sess);
  if (have_model)
    upf_model_free(&m);
  return rc;
#undef SEEN
}
