/* `upf generate`: greedy decoding after a dense, UniPrefill or FlashPrefill prefill, through a session
 * (uniprefill/session.h): every request is prefilled in one step (or, with --chunk, in chunks over
 * several steps), then each decode step feeds one row per request (the token picked from its last
 * logits). Every input is checked before any work; the
 * outputs are written only once the whole run succeeded, and none is left behind when one fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/model_args.h"
#include "cli/select_args.h"
#include "uniprefill/npy.h"
#include "uniprefill/provenance.h"
#include "uniprefill/session.h"
#include "uniprefill/tokenizer.h"

const char upf_cli_generate_usage[] =
    "usage: upf generate (--model NAME | --gguf FILE) (--token-ids IDS.npy [--cu-seqlens CU.npy] | --text STR |\n"
    "                    --file F) --max-new N\n"
    "                    [--mode dense|uniprefill|flashprefill|compact] [--recent R] [--p P | --keep R]\n"
    "                    [--page-size P] [--seed S]\n"
    "                    [--alpha A] [--block-n 64|128] [--mean-correction on|off] [--sink S] [--window W]\n"
    "                    [--last-n N] [--chunk C]\n"
    "                    [--dtype f32|bf16] [--backend cpu|cuda] [--layers A:B] [--out-tokens OUT.npy]\n"
    "                    [--json R.json]\n"
    "  Greedy decoding (ties to the lowest id) of N tokens per request after a prefill of a built-in model\n"
    "  (upf models) on weights seeded by S: all requests prefill in one session step, then N - 1 decode\n"
    "  steps feed one token per request, attending over the paged KV cache the prefill left.\n"
    "  IDS <i4 (T,), CU <i4 (B+1) (one request when absent). OUT <i4 (B, N): the generated tokens.\n"
    "  --gguf: the model of a GGUF file; --text / --file: one request, the text through the file's\n"
    "  tokenizer (its BOS added, special tokens parsed); the generated text is printed.\n"
    "  --mode uniprefill drops tokens after each drop layer's attention: top-p with --p (default: the\n"
    "  model's), or --keep R: the ceil(R * blocks) best blocks of each request; decode then reads only\n"
    "  the kept tokens' KV. --mode flashprefill: the prefill's full-attention layers run FlashPrefill V2's\n"
    "  block-sparse attention (--alpha and the rest as upf prefill); decode is unchanged (dense over the\n"
    "  whole cache). --page-size: tokens per KV page (16).\n"
    "  --chunk C: chunked prefill: each prefill step holds the next chunk of at most C tokens of every\n"
    "  request not yet prefilled (a prompt of at most C tokens in one row); a chunk writes its KV into the\n"
    "  paged cache and attends to its earlier chunks' KV; a request's first token comes from its last\n"
    "  chunk, and decoding starts once every request has it. Dense and FlashPrefill give what they give\n"
    "  unchunked (FlashPrefill: a chunk block-sparse over its cached context); UniPrefill runs every chunk\n"
    "  of a prompt split in more than one chunk dense (chunks with cached context run dense, SPEC section\n"
    "  4), prompts of at most C tokens drop as usual. --mode compact (needs --chunk): CompactAttention, a\n"
    "  chunk with cached context attends over the union of its kept key blocks (upf prefill --help).\n"
    "  The JSON: per request the prompt length, the drops (layer, kept), the KV pages held against\n"
    "  dense, TTFT and the time of every token, and the tokens; the session's KV memory in total; with\n"
    "  --chunk the chunk size, each request's chunks and the prefill steps' times.\n";

typedef struct {
  upf_model_args sel;
  upf_select_args sa; /* --mode, --p, --keep */
  upf_sparse_args fa; /* --alpha, --block-n, --mean-correction, --sink, --window, --last-n */
  const char *ids_path, *cu_path, *text, *text_file, *out_tokens, *json;
  int32_t max_new, page_size, chunk;
} generate_args;

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The greedy pick: the largest logit, the lowest id among equals (a NaN is never picked over a number). */
static int32_t argmax(const float *logits, int32_t V) {
  int32_t best = 0;
  for (int32_t v = 1; v < V; v++)
    if (logits[v] > logits[best] || (isnan(logits[best]) && !isnan(logits[v])))
      best = v;
  return best;
}

/* What the run saw: per request its drops and pages, the step times, the tokens. */
typedef struct {
  int32_t B, N;
  const int32_t *cu;
  int32_t *tokens;       /* (B, N) */
  double *step_seconds;  /* (N): step 0 the prefill (TTFT; chunked: every prefill step), step i the decode
                          * step that produced token i */
  double *ttft;          /* (B) each request's first token: the prefill steps up to its last chunk */
  int32_t *chunks;       /* (B) prefill rows each request took */
  int32_t prefill_steps; /* steps of the prefill (1 unchunked) */
  double *prefill_step_seconds; /* (prefill_steps) */
  upf_kv_drop (*drops)[UPF_MODEL_MAX_LAYERS]; /* (B) */
  int32_t *num_drops;    /* (B) */
  int64_t *pages, *pages_dense; /* (B) KV pages each request holds at the end, and would hold dense */
  upf_session_memory mem;
  int32_t num_sparse;    /* FlashPrefill: the prefill's full-attention layers, summed over its steps */
  upf_sparse_record sparse[UPF_MODEL_MAX_LAYERS];
} run_record;

/* Adds a step's sparse records (one per full-attention layer, in layer order) to the record's. */
static void add_sparse(run_record *rec, const upf_prefill_result *res) {
  if (!rec->num_sparse) {
    rec->num_sparse = res->num_sparse;
    memcpy(rec->sparse, res->sparse, (size_t)res->num_sparse * sizeof *res->sparse);
    return;
  }
  for (int32_t k = 0; k < res->num_sparse && k < rec->num_sparse; k++) {
    upf_sparse_record *d = &rec->sparse[k];
    d->kept_blocks += res->sparse[k].kept_blocks, d->visible_blocks += res->sparse[k].visible_blocks;
    d->index_seconds += res->sparse[k].index_seconds, d->attn_seconds += res->sparse[k].attn_seconds;
  }
}

/* --chunk: the prefill in steps, each holding the next chunk of every request not yet prefilled (whole
 * prompts first, then chunks: the session's row order); a request's first token from its last chunk. */
static upf_status chunked_prefill(const generate_args *a, upf_session *s, const int32_t *req, run_record *rec, int32_t V) {
  const int32_t B = rec->B, N = rec->N;
  int32_t *done = calloc((size_t)B, sizeof *done), *who = malloc((size_t)B * sizeof *who);
  upf_session_row *rows = malloc((size_t)B * sizeof *rows);
  upf_status st = done && who && rows ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "generate: chunk rows");
  double clock = 0;
  for (int32_t left = B; st == UPF_OK && left > 0;) {
    int32_t n = 0;
    for (int pass = 0; pass < 2; pass++) /* whole prompts, then chunks */
      for (int32_t r = 0; r < B; r++) {
        const int32_t len = rec->cu[r + 1] - rec->cu[r];
        if (done[r] == len)
          continue;
        const int32_t k = len - done[r] < a->chunk ? len - done[r] : a->chunk;
        if ((k == len) != (pass == 0))
          continue;
        who[n] = r;
        rows[n++] = (upf_session_row){req[r], UPF_ROW_PREFILL, 0, k};
      }
    upf_prefill_result res;
    const double t0 = now_seconds();
    st = upf_session_step(s, rows, n, NULL, &res);
    if (st != UPF_OK)
      break;
    const double dt = now_seconds() - t0;
    clock += dt;
    double *grown = realloc(rec->prefill_step_seconds, (size_t)(rec->prefill_steps + 1) * sizeof *grown);
    if (!grown) {
      upf_prefill_result_free(&res);
      st = upf_fail(UPF_ERR_NOMEM, "generate: prefill step times");
      break;
    }
    rec->prefill_step_seconds = grown;
    rec->prefill_step_seconds[rec->prefill_steps++] = dt;
    add_sparse(rec, &res);
    for (int32_t j = 0; j < n; j++) {
      const int32_t r = who[j];
      done[r] += rows[j].num_tokens, rec->chunks[r]++;
      if (done[r] < rec->cu[r + 1] - rec->cu[r])
        continue;
      rec->tokens[(size_t)r * N] = argmax(res.logits + (size_t)j * V, V);
      rec->ttft[r] = clock;
      left--;
    }
    upf_prefill_result_free(&res);
  }
  rec->step_seconds[0] = clock;
  free(done), free(who), free(rows);
  return st;
}

static upf_status run(const generate_args *a, const upf_model *m, const upf_session_config *sc, const int32_t *ids,
                      run_record *rec) {
  const int32_t B = rec->B, N = rec->N, V = m->cfg->vocab;
  upf_session *s = NULL;
  UPF_TRY(upf_session_create(m, sc, &s));
  int32_t *req = malloc((size_t)B * sizeof *req);
  upf_session_row *rows = malloc((size_t)B * sizeof *rows);
  upf_status st = req && rows ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "generate: rows");
  for (int32_t r = 0; st == UPF_OK && r < B; r++) {
    st = upf_session_add_request(s, ids + rec->cu[r], rec->cu[r + 1] - rec->cu[r], &req[r]);
    rows[r] = (upf_session_row){req[r], UPF_ROW_PREFILL, 0, 0};
  }
  if (st == UPF_OK && a->chunk) {
    st = chunked_prefill(a, s, req, rec, V);
    for (int32_t r = 0; r < B; r++)
      rows[r] = (upf_session_row){req[r], UPF_ROW_DECODE, rec->tokens[(size_t)r * N], 0};
  }
  for (int32_t i = a->chunk ? 1 : 0; st == UPF_OK && i < N; i++) {
    upf_prefill_result res;
    const double t0 = now_seconds();
    st = upf_session_step(s, rows, B, NULL, &res);
    if (st != UPF_OK)
      break;
    rec->step_seconds[i] = now_seconds() - t0;
    if (i == 0) {
      add_sparse(rec, &res);
      rec->prefill_steps = 1;
      for (int32_t r = 0; r < B; r++)
        rec->ttft[r] = rec->step_seconds[0], rec->chunks[r] = 1;
    }
    for (int32_t r = 0; r < B; r++) {
      const int32_t tok = argmax(res.logits + (size_t)r * V, V);
      rec->tokens[(size_t)r * N + i] = tok;
      rows[r] = (upf_session_row){req[r], UPF_ROW_DECODE, tok};
    }
    upf_prefill_result_free(&res);
  }
  for (int32_t r = 0; st == UPF_OK && r < B; r++) {
    upf_session_request_info info;
    st = upf_session_request(s, req[r], &info);
    if (st != UPF_OK)
      break;
    rec->num_drops[r] = info.num_drops;
    memcpy(rec->drops[r], info.drops, (size_t)info.num_drops * sizeof *info.drops);
    /* pages per group from kv_len at the group's first attention layer (session.h: every layer of a
     * group holds the same entries) */
    int32_t seen[UPF_SESSION_MAX_GROUPS] = {0};
    rec->pages[r] = rec->pages_dense[r] = 0;
    for (int32_t l = m->layer_begin; st == UPF_OK && l < m->layer_end; l++) {
      const int32_t g = upf_session_group_of_layer(s, l);
      if (g < 0 || seen[g])
        continue;
      seen[g] = 1;
      int64_t len = 0;
      st = upf_session_kv_len(s, req[r], l, &len);
      rec->pages[r] += upf_session_pages_for(s, len);
      rec->pages_dense[r] += upf_session_pages_for(s, (int64_t)info.prompt_len + info.decoded);
    }
  }
  if (st == UPF_OK)
    upf_session_memory_usage(s, &rec->mem);
  free(req), free(rows);
  upf_session_free(s);
  return st;
}

/* FlashPrefill: kept key blocks over visible ones in the prefill steps, over their full-attention layers. */
static double kept_share(const run_record *rec) {
  int64_t kept = 0, visible = 0;
  for (int32_t i = 0; i < rec->num_sparse; i++)
    kept += rec->sparse[i].kept_blocks, visible += rec->sparse[i].visible_blocks;
  return visible > 0 ? (double)kept / (double)visible : 1.0;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The JSON record, into f. */
static void print_json(FILE *f, const generate_args *a, const upf_model *m, const upf_session_config *sc,
                       const run_record *rec, int argc, char **argv) {
  const upf_model_config *c = m->cfg;
  char commit[64];
  if (!upf_source_commit(commit, sizeof commit))
    snprintf(commit, sizeof commit, "unknown");
  const int32_t N = rec->N;
  fprintf(f, "{\n  \"model\": \"%s\",\n  \"layers\": [%d, %d],\n  \"partial_model\": %s,\n  \"shared_weights\": %s,\n",
          c->name, m->layer_begin, m->layer_end, upf_model_args_partial(&a->sel) ? "true" : "false",
          m->shared_weights ? "true" : "false");
  fprintf(f, "  \"mode\": \"%s\",\n  \"dtype\": \"%s\",\n  \"backend\": \"%s\",\n  \"device\": \"%s\",\n", a->sa.mode,
          upf_dtype_name(m->dtype), m->be->name, m->be->describe());
  fprintf(f, "  \"select\": {\"block\": %d, \"sink\": %d, \"last_q\": %d, \"p\": %g, \"keep_ratio\": %g},\n",
          sc->select.block, sc->select.sink, sc->select.last_q, (double)sc->select.p, (double)sc->select.keep_ratio);
  if (sc->mode == UPF_PREFILL_FLASHPREFILL || sc->mode == UPF_PREFILL_COMPACT) {
    if (sc->mode == UPF_PREFILL_COMPACT)
      fprintf(f, "  \"compact\": {\"recent\": %d, \"selector\": ", sc->compact.recent);
    else
      fprintf(f, "  \"flashprefill\": ");
    upf_sparse_args_json(f, &sc->sparse);
    if (sc->mode == UPF_PREFILL_COMPACT)
      fprintf(f, "}");
    fprintf(f, ",\n  \"kept_share\": %.6f,\n  \"sparse_layers\": [", kept_share(rec));
    for (int32_t i = 0; i < rec->num_sparse; i++) {
      const upf_sparse_record *r = &rec->sparse[i];
      fprintf(f, "%s{\"layer\": %d, \"kept_blocks\": %lld, \"visible_blocks\": %lld, \"index_ms\": %.4f, "
                 "\"attn_ms\": %.4f}",
              i ? ", " : "", r->layer, (long long)r->kept_blocks, (long long)r->visible_blocks, r->index_seconds * 1e3,
              r->attn_seconds * 1e3);
    }
    fprintf(f, "],\n");
  }
  fprintf(f, "  \"max_new\": %d,\n  \"page_size\": %d,\n  \"chunk\": %d,\n", N, sc->page_size, a->chunk);
  if (a->chunk) {
    fprintf(f, "  \"prefill_step_ms\": [");
    for (int32_t i = 0; i < rec->prefill_steps; i++)
      fprintf(f, "%s%.4f", i ? ", " : "", rec->prefill_step_seconds[i] * 1e3);
    fprintf(f, "],\n");
    if (sc->mode == UPF_PREFILL_UNIPREFILL)
      fprintf(f, "  \"chunked_uniprefill\": \"chunks with cached context ran dense: every chunk of a prompt split in "
                 "more than one chunk ran dense; prompts of at most %d tokens dropped as usual\",\n", a->chunk);
  }
  fprintf(f, "  \"requests\": [");
  for (int32_t r = 0; r < rec->B; r++) {
    fprintf(f, "%s\n    {\"prompt_len\": %d, \"drops\": [", r ? "," : "", rec->cu[r + 1] - rec->cu[r]);
    for (int32_t k = 0; k < rec->num_drops[r]; k++)
      fprintf(f, "%s{\"layer\": %d, \"kept\": %d}", k ? ", " : "", rec->drops[r][k].layer, rec->drops[r][k].kept_len);
    fprintf(f, "], \"kv_pages\": %lld, \"kv_pages_dense\": %lld, \"prefill_chunks\": %d, \"ttft_ms\": %.4f, "
               "\"token_ms\": [",
            (long long)rec->pages[r], (long long)rec->pages_dense[r], rec->chunks[r], rec->ttft[r] * 1e3);
    for (int32_t i = 0; i < N; i++)
      fprintf(f, "%s%.4f", i ? ", " : "", (i ? rec->step_seconds[i] : rec->ttft[r]) * 1e3);
    fprintf(f, "], \"tokens\": [");
    for (int32_t i = 0; i < N; i++)
      fprintf(f, "%s%d", i ? ", " : "", rec->tokens[(size_t)r * N + i]);
    fprintf(f, "]}");
  }
  double median = 0;
  if (N > 1) {
    double *d = malloc((size_t)(N - 1) * sizeof *d);
    if (d) {
      memcpy(d, rec->step_seconds + 1, (size_t)(N - 1) * sizeof *d);
      qsort(d, (size_t)(N - 1), sizeof *d, cmp_double);
      median = d[(N - 1) / 2];
      free(d);
    }
  }
  const upf_session_memory *mem = &rec->mem;
  fprintf(f, "\n  ],\n  \"ttft_ms\": %.4f,\n  \"decode_step_ms_median\": %.4f,\n", rec->step_seconds[0] * 1e3,
          median * 1e3);
  fprintf(f, "  \"kv\": {\"pages_in_use\": %lld, \"pages_dense\": %lld, \"bytes_in_use\": %.0f, \"bytes_dense\": %.0f, "
             "\"bytes_saved\": %.0f, \"bytes_capacity\": %.0f},\n",
          (long long)mem->pages_in_use, (long long)mem->pages_dense, mem->bytes_in_use, mem->bytes_dense,
          mem->bytes_saved, mem->bytes_capacity);
  fprintf(f, "  \"commit\": \"%s\",\n  \"command\": ", commit);
  upf_json_command(f, "upf generate", argc, argv);
  fprintf(f, "\n}\n");
}

/* The outputs, all or none (uniprefill/output.h): both staged, then landed together. */
static int write_outputs(const generate_args *a, const upf_model *m, const upf_session_config *sc,
                         const run_record *rec, int argc, char **argv) {
  upf_outputs *o;
  upf_status st = upf_outputs_create(&o, 0);
  if (st == UPF_OK && a->json) {
    FILE *f;
    st = upf_outputs_open(o, a->json, "--json", &f);
    if (st == UPF_OK)
      print_json(f, a, m, sc, rec, argc, argv);
  }
  if (st == UPF_OK && a->out_tokens) {
    upf_tensor t;
    const int64_t shape[2] = {rec->B, rec->N};
    upf_tensor_init(&t, rec->tokens, UPF_DTYPE_I32, 2, shape);
    st = upf_npy_write_to(o, a->out_tokens, "--out-tokens", &t);
  }
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  return st == UPF_OK ? 0 : upf_cli_error(st, "generate");
}

/* With a GGUF model: each request's generated text, through the file's tokenizer (a failure to decode
 * is reported and leaves the outputs alone: the tokens are the result). */
static void print_texts(const char *gguf, const run_record *rec) {
  upf_gguf *g = NULL;
  upf_tokenizer *tok = NULL;
  upf_status st = upf_gguf_open(gguf, &g);
  if (st == UPF_OK)
    st = upf_tokenizer_from_gguf(g, &tok);
  for (int32_t r = 0; st == UPF_OK && r < rec->B; r++) {
    char *text = NULL;
    int64_t len = 0;
    st = upf_tokenizer_decode(tok, rec->tokens + (size_t)r * rec->N, rec->N, 0, &text, &len);
    if (st == UPF_OK)
      printf("  request %d: %.*s\n", r, (int)len, text);
    free(text);
  }
  if (st != UPF_OK)
    upf_cli_error(st, "generate: decoding the text");
  upf_tokenizer_free(tok), upf_gguf_close(g);
}

int upf_cli_generate(int argc, char **argv) {
  generate_args a = {.sel = UPF_MODEL_ARGS_DEFAULT, .sa = UPF_SELECT_ARGS_DEFAULT, .fa = UPF_SPARSE_ARGS_DEFAULT,
                     .page_size = 16};
  upf_arg args[] = {
      UPF_MODEL_ARG_FLAGS(a.sel),
      {"--token-ids", UPF_ARG_STRING, &a.ids_path},
      {"--text", UPF_ARG_STRING, &a.text},
      {"--file", UPF_ARG_STRING, &a.text_file},
      {"--cu-seqlens", UPF_ARG_STRING, &a.cu_path},
      {"--max-new", UPF_ARG_INT, &a.max_new, 1, 1, 1 << 20},
      UPF_SELECT_ARG_FLAGS(a.sa),
      UPF_SPARSE_ARG_FLAGS(a.fa),
      {"--page-size", UPF_ARG_INT, &a.page_size, 0, 1, 1 << 16},
      {"--chunk", UPF_ARG_INT, &a.chunk, 0, 1, INT32_MAX},
      {"--out-tokens", UPF_ARG_STRING, &a.out_tokens},
      {"--json", UPF_ARG_STRING, &a.json},
  };
  upf_arg_parser p = {"upf generate", upf_cli_generate_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result pr = upf_args_parse(&p, argc, argv);
  if (pr != UPF_ARGS_OK)
    return upf_args_exit_code(pr);
  const int rc_sel = upf_model_args_resolve("generate", &a.sel);
  if (rc_sel)
    return rc_sel;
  const upf_model_config *cfg = a.sel.cfg;
  if (!!a.ids_path + !!a.text + !!a.text_file != 1) {
    fprintf(stderr, "upf generate: give exactly one of --token-ids, --text and --file\n");
    return 2;
  }
  if (a.cu_path && !a.ids_path) {
    fprintf(stderr, "upf generate: --cu-seqlens goes with --token-ids\n");
    return 2;
  }
  if (!upf_model_args_check_seed("generate", &a.sel, upf_args_find(&p, "--seed")->seen,
                                 a.sel.gguf ? "the weights are --gguf's, the prompt is given and decoding is greedy"
                                            : NULL))
    return 2;
  const int rc_mode = upf_mode_args_resolve("generate", &p, &a.sa, &a.fa);
  if (rc_mode)
    return rc_mode;
  if (a.sa.prefill_mode == UPF_PREFILL_COMPACT && !a.chunk) {
    fprintf(stderr, "upf generate: --mode compact needs --chunk C (CompactAttention runs the chunks of a chunked "
                    "prefill over their cached context)\n");
    return 2;
  }
  const upf_arg_path paths[] = {{"--token-ids", a.ids_path, 0},   {"--cu-seqlens", a.cu_path, 0},
                                {"--file", a.text_file, 0},       {"--gguf", a.sel.gguf, 0},
                                {"--out-tokens", a.out_tokens, 1}, {"--json", a.json, 1}};
  if (!upf_args_check_paths("upf generate", paths, (int)(sizeof paths / sizeof *paths)))
    return 2;

  int32_t *ids = NULL, *cu = NULL, B = 0;
  if (!upf_model_args_batch("generate", &a.sel, a.ids_path, a.cu_path, a.text, a.text_file, &ids, &cu, &B))
    return 2;
  if (!upf_model_args_check_context("generate", &a.sel, a.ids_path ? "--token-ids" : a.text ? "--text" : "--file", cu,
                                    B, a.max_new - 1)) {
    free(ids), free(cu);
    return 2;
  }
  upf_model m;
  upf_status st = upf_model_args_build("generate", &a.sel, &m);
  if (st != UPF_OK) {
    free(ids), free(cu);
    return upf_cli_error(st, "generate: building the model");
  }
  upf_session_config sc = upf_session_config_default(&m);
  sc.mode = a.sa.prefill_mode, sc.page_size = a.page_size, sc.max_requests = B, sc.sparse = a.fa.params;
  sc.compact = a.fa.compact;
  upf_select_args_apply(&a.sa, &sc.select);
  /* every group holds each request at its dense length at most: prompt + N - 1 fed tokens */
  sc.pages_per_group = 0;
  for (int32_t r = 0; r < B; r++)
    sc.pages_per_group += ((int64_t)cu[r + 1] - cu[r] + a.max_new - 1 + a.page_size - 1) / a.page_size;

  const int32_t N = a.max_new;
  run_record rec = {.B = B, .N = N, .cu = cu};
  rec.tokens = calloc((size_t)B * (size_t)N, sizeof *rec.tokens);
  rec.step_seconds = calloc((size_t)N, sizeof *rec.step_seconds);
  rec.drops = calloc((size_t)B, sizeof *rec.drops);
  rec.num_drops = calloc((size_t)B, sizeof *rec.num_drops);
  rec.pages = calloc((size_t)B, sizeof *rec.pages);
  rec.pages_dense = calloc((size_t)B, sizeof *rec.pages_dense);
  rec.ttft = calloc((size_t)B, sizeof *rec.ttft);
  rec.chunks = calloc((size_t)B, sizeof *rec.chunks);
  st = rec.tokens && rec.step_seconds && rec.drops && rec.num_drops && rec.pages && rec.pages_dense && rec.ttft && rec.chunks
           ? run(&a, &m, &sc, ids, &rec)
           : upf_fail(UPF_ERR_NOMEM, "generate: %d x %d tokens", B, N);
  int rc = st == UPF_OK ? 0 : upf_cli_error(st, "generate");
  if (rc == 0) {
    printf("%s%s, %s, %s on %s: %d requests, %d prompt tokens, %d new tokens each\n", cfg->name,
           upf_model_args_label(&a.sel), a.sa.mode, upf_dtype_name(m.dtype), m.be->name, B,
           cu[B], N);
    double decode = 0;
    for (int32_t i = 1; i < N; i++)
      decode += rec.step_seconds[i];
    printf("  TTFT %.3f ms; %d decode steps of %d rows, %.3f ms each on average\n", rec.step_seconds[0] * 1e3, N - 1,
           B, N > 1 ? decode / (N - 1) * 1e3 : 0.0);
    if (a.chunk) {
      int32_t chunked = 0;
      for (int32_t r = 0; r < B; r++)
        chunked += rec.chunks[r] > 1;
      printf("  chunked prefill: chunks of at most %d tokens over %d steps; %d of %d requests in more than one chunk%s\n",
             a.chunk, rec.prefill_steps, chunked, B,
             sc.mode == UPF_PREFILL_UNIPREFILL ? "; chunks with cached context ran dense (every chunk of a prompt split "
                                                 "in more than one chunk)" : "");
    }
    if (sc.mode == UPF_PREFILL_FLASHPREFILL) {
      char params[256];
      upf_sparse_args_describe(&sc.sparse, params, sizeof params);
      printf("  flashprefill (%s): the prefill kept share %.4f of the visible key blocks over %d full-attention "
             "layers\n", params, kept_share(&rec), rec.num_sparse);
    }
    if (sc.mode == UPF_PREFILL_COMPACT) {
      char params[256];
      upf_sparse_args_describe(&sc.sparse, params, sizeof params);
      printf("  compact (%s, recent %d): the chunks with cached context kept share %.4f of their visible key "
             "blocks over %d full-attention layers\n", params, sc.compact.recent, kept_share(&rec), rec.num_sparse);
    }
    printf("  KV pages %lld of %lld dense (%.1f%% of the dense bytes)\n", (long long)rec.mem.pages_in_use,
           (long long)rec.mem.pages_dense,
           rec.mem.bytes_dense > 0 ? 100.0 * rec.mem.bytes_in_use / rec.mem.bytes_dense : 100.0);
    if (a.sel.gguf)
      print_texts(a.sel.gguf, &rec);
    rc = write_outputs(&a, &m, &sc, &rec, argc, argv);
  }
  free(rec.tokens), free(rec.step_seconds), free(rec.drops), free(rec.num_drops), free(rec.pages),
      free(rec.pages_dense), free(rec.ttft), free(rec.chunks), free(rec.prefill_step_seconds);
  free(ids), free(cu);
  upf_model_free(&m);
  return rc;
}
