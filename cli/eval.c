/* `upf eval`: what UniPrefill (or FlashPrefill V2, or a chunked prefill: dense, CompactAttention or
 * FlashPrefill over chunks) costs in accuracy on a model. ppl: the dense
 * perplexity of a text; next-token: top-1 agreement and KL(dense || approximation) over the last
 * positions of windows of a text; needle: a pass key hidden at several depths of a filler text,
 * answered greedily by dense and by the approximation. Every input is checked before any model work; the JSON is written whole at the end. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/model_args.h"
#include "uniprefill/eval.h"
#include "uniprefill/output.h"
#include "uniprefill/provenance.h"
#include "uniprefill/rng.h"
#include "uniprefill/tokenizer.h"

const char upf_cli_eval_usage[] =
    "usage: upf eval (--gguf FILE | --model NAME [--seed S]) --task ppl|next-token|needle\n"
    "                [--tokens N1,N2,...] [--mode dense|uniprefill|flashprefill|compact] [--p P1,P2,...]\n"
    "                [--keep R1,R2,...] [--alpha A1,A2,...] [--block-n 64|128] [--mean-correction on|off]\n"
    "                [--sink S] [--window W] [--last-n N] [--chunk C] [--recent R]\n"
    "                [--backend cpu|cuda] [--dtype f32|bf16] [--text-file F1,F2,...] [--windows K]\n"
    "                [--last N] [--depths D1,D2,...] [--trials N] [--needle-seed S] [--dtype-floor]\n"
    "                [--allow-over-context] [--json R.json]\n"
    "  ppl: exp of the mean next-token NLL over every position of K windows of N tokens of the text\n"
    "    (dense). next-token: K windows of N tokens; top-1 agreement and mean KL(dense || UniPrefill) over\n"
    "    the last N positions of each (default 128, or the model's last-q when smaller; always kept: at\n"
    "    most the model's last-q), and the\n"
    "    kept share of the prompt after each drop layer. needle: a pass key (5-6 digits from the needle\n"
    "    seed) at each depth (default 0.1,0.3,0.5,0.7,0.9) of N tokens of filler text, then the question;\n"
    "    correct iff greedy decoding produces the key (checked by one prefill of prompt + answer; UniPrefill\n"
    "    replays the masks its prompt-only prefill chose).\n"
    "  UniPrefill runs at each --p (default: the model's) or, with --keep, at each top-k keep ratio;\n"
    "  --mode flashprefill: FlashPrefill V2 (block-sparse full attention, upf prefill --mode flashprefill)\n"
    "  in place of UniPrefill, at each --alpha (default 0.18; the other flags as upf prefill), reporting the\n"
    "  kept share of the visible key blocks per full-attention layer; it drops no token, so needle runs\n"
    "  the prompt + answer prefill in FlashPrefill mode directly.\n"
    "  --chunk C (next-token, needle): the approximation is a chunked prefill through a session's paged KV\n"
    "  cache, chunks of C tokens (the last may be shorter), against unchunked dense: --mode dense (chunked\n"
    "  dense, which equals dense up to rounding), compact (CompactAttention, SPEC section 9: a chunk with\n"
    "  cached context attends over the union of the key blocks its selector keeps, plus its own and the\n"
    "  --recent R blocks before it (default 2); --alpha and the selector flags as flashprefill's, last_n 0)\n"
    "  or flashprefill (each chunk block-sparse over its cached context); not uniprefill (a chunk never\n"
    "  drops: it would run chunked dense). next-token gathers the last N positions across chunks; needle\n"
    "  prefills the prompt in chunks, then feeds the answer as decode rows (dense, as served). --mode\n"
    "  compact needs --chunk.\n"
    "  --mode dense runs the dense side only (ppl is always dense). --dtype-floor (next-token): also the\n"
    "  dense run in the other dtype (f32 for bf16, and back) against dense: what precision alone changes.\n"
    "  --text-file: plain-text files joined in order (default: the licence texts Debian ships in\n"
    "  /usr/share/common-licenses). --model NAME (seeded weights, no tokenizer): ppl and next-token on\n"
    "  token ids from the seed. --tokens past the GGUF's context_length are refused unless\n"
    "  --allow-over-context.\n";

typedef struct {
  const char *gguf, *model, *task, *tokens, *mode, *p, *keep, *backend, *dtype, *text_files, *depths, *json;
  const char *alpha;  /* FlashPrefill: the list of alphas */
  upf_sparse_args fa; /* FlashPrefill: --block-n, --mean-correction, --sink, --window, --last-n */
  int32_t seed, windows, last, trials, needle_seed, floor;
  int32_t chunk; /* --chunk C: the approximation prefills in chunks of C (0: whole prompts) */
  int over_context; /* --allow-over-context */
} eval_args;

static const char default_text_files[] =
    "/usr/share/common-licenses/GPL-3,/usr/share/common-licenses/Apache-2.0,/usr/share/common-licenses/MPL-2.0,"
    "/usr/share/common-licenses/GFDL-1.3,/usr/share/common-licenses/LGPL-2.1,/usr/share/common-licenses/GPL-2,"
    "/usr/share/common-licenses/MPL-1.1,/usr/share/common-licenses/Artistic,/usr/share/common-licenses/CC0-1.0";

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Comma-separated numbers; 0 when a field is not a number. */
static int parse_doubles(const char *s, double **out, int *n) {
  *n = 0;
  *out = NULL;
  if (!s || !*s)
    return 0;
  int cap = 1;
  for (const char *c = s; *c; c++)
    cap += *c == ',';
  *out = malloc((size_t)cap * sizeof **out);
  const char *c = s;
  for (;;) {
    char *end;
    const double v = strtod(c, &end);
    if (end == c || (*end && *end != ',') || !isfinite(v))
      return 0;
    (*out)[(*n)++] = v;
    if (!*end)
      return 1;
    c = end + 1;
  }
}

/* One setting of the sweep: UniPrefill top-p at p or top-k at a keep ratio, or FlashPrefill at alpha; with
 * --chunk, a chunked prefill: dense (kind "chunk", value C), CompactAttention or FlashPrefill at alpha. */
typedef struct {
  upf_prefill_mode mode; /* UNIPREFILL, FLASHPREFILL, COMPACT, or DENSE (chunked) */
  upf_select_params sel;
  upf_sparse_params sparse;
  upf_compact_params compact; /* COMPACT: the union's recent blocks */
  int32_t chunk;              /* > 0: prefilled in chunks of this many tokens through a session */
  double value;
  const char *kind; /* "p", "keep", "alpha" or "chunk" */
} eval_arm;

/* The arm's kept share is over key blocks (FlashPrefill, CompactAttention), not tokens. */
static int arm_blocks(const eval_arm *arm) {
  return arm->mode == UPF_PREFILL_FLASHPREFILL || arm->mode == UPF_PREFILL_COMPACT;
}

/* The prefill of the arm, writing the logits of the last `last` positions (upf_eval_prefill_last, or its
 * chunked form). */
static upf_status arm_prefill_last(const upf_model *m, const eval_arm *arm, const int32_t *ids, int64_t n, int64_t last,
                                   float *logits, upf_prefill_result *res) {
  upf_prefill_options opt = {.mode = arm->mode, .select = arm->sel, .sparse = arm->sparse, .compact = arm->compact};
  return arm->chunk ? upf_eval_prefill_last_chunked(m, ids, n, &opt, arm->chunk, last, logits, res, NULL)
                    : upf_eval_prefill_last(m, ids, n, &opt, last, logits, res);
}

/* The greedy answer check of the arm. */
static upf_status arm_check_answer(const upf_model *m, const eval_arm *arm, const int32_t *prompt, int64_t P,
                                   const int32_t *answer, int64_t A, upf_eval_answer *out) {
  if (arm->chunk) {
    const upf_prefill_options opt = {.mode = arm->mode, .select = arm->sel, .sparse = arm->sparse,
                                     .compact = arm->compact};
    return upf_eval_check_answer_chunked(m, prompt, P, answer, A, &opt, arm->chunk, out);
  }
  return arm->mode == UPF_PREFILL_FLASHPREFILL ? upf_eval_check_answer_sparse(m, prompt, P, answer, A, &arm->sparse, out)
                                               : upf_eval_check_answer(m, prompt, P, answer, A, &arm->sel, out);
}

/* The GGUF file's tokenizer (core/tokenizer.c): text in, ids out, specials added by the caller. */
typedef struct {
  upf_tokenizer *t;
  int32_t bos;
  int add_bos; /* the file asks for BOS at the start of a prompt */
} eval_tokenizer;

static upf_status eval_tokenizer_open(const char *gguf, eval_tokenizer *t) {
  upf_gguf *g = NULL;
  UPF_TRY(upf_gguf_open(gguf, &g));
  const upf_status st = upf_tokenizer_from_gguf(g, &t->t);
  upf_gguf_close(g);
  if (st == UPF_OK)
    t->bos = upf_tokenizer_bos(t->t), t->add_bos = upf_tokenizer_add_bos(t->t) && t->bos >= 0;
  return st;
}

static upf_status eval_tokenizer_encode(eval_tokenizer *t, const char *text, int64_t len, int32_t **ids, int64_t *n) {
  return upf_tokenizer_encode(t->t, text, len, 0, ids, n);
}

static void eval_tokenizer_close(eval_tokenizer *t) { upf_tokenizer_free(t->t), t->t = NULL; }

static upf_status eval_config_open(const char *gguf, upf_gguf_model_config *cfg) {
  upf_gguf *g = NULL;
  UPF_TRY(upf_gguf_open(gguf, &g));
  const upf_status st = upf_model_config_from_gguf(g, cfg);
  upf_gguf_close(g);
  return st;
}

/* cfg (the file's) must outlive the model. */
static upf_status eval_model_open(const char *gguf, const upf_backend *be, upf_dtype dtype, const upf_model_config *cfg,
                                  upf_model *m) {
  upf_gguf *g = NULL;
  UPF_TRY(upf_gguf_open(gguf, &g));
  const upf_status st = upf_model_load_gguf(m, g, cfg, be, dtype, 0, cfg->num_layers);
  upf_gguf_close(g);
  return st;
}

/* ---- what the runs read: the model, and for a GGUF file its tokenizer and the text ---- */

typedef struct {
  const char *gguf, *model; /* exactly one */
  uint64_t seed;
  const upf_backend *be;
  upf_dtype dtype;
  const char *text_files;   /* comma-separated (GGUF only) */
} eval_source_spec;

typedef struct {
  char path[1024];
  int64_t bytes;
} eval_file;

typedef struct {
  upf_model model;
  int have_model;
  upf_model other;         /* --dtype-floor: the same weights in the other dtype */
  int have_other;
  const upf_model_config *cfg;
  upf_gguf_model_config gguf_cfg; /* --gguf: the file's config */
  const char *stage;       /* the flag whose input failed, for the message */
  uint64_t seed;           /* --model: windows are seeded ids */
  eval_tokenizer tok;      /* --gguf */
  int64_t bos_len;         /* 1 when the model's prompts start with BOS */
  int32_t bos;
  int32_t *text;           /* (text_len) the joined text, tokenized whole (no BOS) */
  int64_t text_len;
  int32_t *filler;         /* (filler_len) the same text tokenized a paragraph at a time */
  int64_t filler_len;
  int64_t *breaks;         /* (num_breaks) where each paragraph starts in filler */
  int64_t num_breaks;
  eval_file files[64];
  int num_files;
} eval_source;

/* A needle's token pieces for one key value. */
typedef struct {
  int32_t *answer;
  int64_t answer_len;
} eval_needle;

static void eval_needle_free(eval_needle *n) { free(n->answer), n->answer = NULL; }

/* Reads every file of the comma-separated list, joined by a blank line. */
static upf_status read_text(const char *list, eval_source *s, char **text, size_t *len) {
  size_t cap = 1 << 16;
  *len = 0;
  *text = malloc(cap);
  const char *c = list;
  while (*c) {
    const char *e = strchr(c, ',');
    const size_t n = e ? (size_t)(e - c) : strlen(c);
    if (s->num_files == (int)(sizeof s->files / sizeof *s->files))
      return upf_fail(UPF_ERR_INVALID_ARG, "more than %d files", s->num_files);
    eval_file *f = &s->files[s->num_files];
    snprintf(f->path, sizeof f->path, "%.*s", (int)n, c);
    struct stat sb;
    if (stat(f->path, &sb) == 0 && S_ISDIR(sb.st_mode)) /* fopen takes a directory; its reads fail */
      return upf_fail(UPF_ERR_IO, "%s: is a directory, not a text file", f->path);
    FILE *in = fopen(f->path, "rb");
    if (!in)
      return upf_fail(UPF_ERR_IO, "%s: cannot open it (%s)", f->path, strerror(errno));
    char buf[1 << 16];
    size_t got;
    f->bytes = 0;
    if (s->num_files) {
      memcpy(*text + *len, "\n\n", 2);
      *len += 2;
    }
    while ((got = fread(buf, 1, sizeof buf, in)) > 0) {
      while (*len + got + 3 > cap)
        cap *= 2, *text = realloc(*text, cap);
      memcpy(*text + *len, buf, got);
      *len += got, f->bytes += (int64_t)got;
    }
    const int err = ferror(in) ? errno : 0;
    fclose(in);
    if (err)
      return upf_fail(UPF_ERR_IO, "%s: cannot read it (%s)", f->path, strerror(err));
    if (f->bytes == 0)
      return upf_fail(UPF_ERR_FORMAT, "%s: empty", f->path);
    s->num_files++;
    c = e ? e + 1 : c + n;
  }
  if (!s->num_files)
    return upf_fail(UPF_ERR_INVALID_ARG, "no file named");
  (*text)[*len] = '\0';
  return UPF_OK;
}

static upf_status eval_source_open(const eval_source_spec *spec, eval_source *s) {
  s->seed = spec->seed;
  if (spec->model) {
    s->cfg = upf_model_config_by_name(spec->model);
    return s->cfg ? UPF_OK : UPF_ERR_INVALID_ARG; /* the message lists the names */
  }
  s->stage = "eval: --text-file";
  char *text = NULL;
  size_t len = 0;
  upf_status st = read_text(spec->text_files, s, &text, &len);
  if (st == UPF_OK) {
    s->stage = "eval: --gguf";
    st = eval_tokenizer_open(spec->gguf, &s->tok);
  }
  if (st == UPF_OK) {
    s->bos = s->tok.bos;
    s->bos_len = s->tok.add_bos ? 1 : 0;
    s->stage = "eval: --text-file"; /* what fails now is the text's, not the model's */
    st = eval_tokenizer_encode(&s->tok, text, (int64_t)len, &s->text, &s->text_len);
  }
  /* the filler of needle prompts: paragraph by paragraph, so a fact can go in at a paragraph start */
  for (size_t i = 0; st == UPF_OK && i < len;) {
    size_t e = i;
    while (e < len && !(text[e] == '\n' && e + 1 < len && text[e + 1] == '\n'))
      e++;
    while (e < len && text[e] == '\n')
      e++;
    int32_t *ids = NULL;
    int64_t n = 0;
    st = eval_tokenizer_encode(&s->tok, text + i, (int64_t)(e - i), &ids, &n);
    if (st == UPF_OK && n > 0) {
      s->filler = realloc(s->filler, (size_t)(s->filler_len + n) * sizeof *s->filler);
      s->breaks = realloc(s->breaks, (size_t)(s->num_breaks + 1) * sizeof *s->breaks);
      memcpy(s->filler + s->filler_len, ids, (size_t)n * sizeof *ids);
      s->breaks[s->num_breaks++] = s->filler_len;
      s->filler_len += n;
    }
    free(ids);
    i = e;
  }
  free(text);
  if (st == UPF_OK) {
    s->stage = "eval: --gguf";
    st = eval_config_open(spec->gguf, &s->gguf_cfg);
    s->cfg = &s->gguf_cfg.cfg;
  }
  return st;
}

/* The weights (after every check of the command line against the config and the text). */
static upf_status eval_source_load(const eval_source_spec *spec, eval_source *s) {
  upf_status st = spec->model ? upf_model_init_seeded(&s->model, s->cfg, spec->be, spec->dtype, spec->seed, 0,
                                                      s->cfg->num_layers)
                              : eval_model_open(spec->gguf, spec->be, spec->dtype, s->cfg, &s->model);
  s->have_model = st == UPF_OK;
  return st;
}

/* The same weights in `dtype` into s->other (the dtype floor of next-token). */
static upf_status eval_source_load_other(const eval_source_spec *spec, upf_dtype dtype, eval_source *s) {
  upf_status st = spec->model ? upf_model_init_seeded(&s->other, s->cfg, spec->be, dtype, spec->seed, 0,
                                                      s->cfg->num_layers)
                              : eval_model_open(spec->gguf, spec->be, dtype, s->cfg, &s->other);
  s->have_other = st == UPF_OK;
  return st;
}

static void eval_source_close(eval_source *s) {
  if (s->have_model)
    upf_model_free(&s->model);
  if (s->have_other)
    upf_model_free(&s->other);
  eval_tokenizer_close(&s->tok);
  free(s->text), free(s->filler), free(s->breaks);
  memset(s, 0, sizeof *s);
}

/* Window starts over the text (a window holds BOS + L - 1 text tokens); seeded ids need none. */
static upf_status eval_source_windows(const eval_source *s, int64_t L, int32_t count, int64_t min_stride, int64_t *starts) {
  if (!s->text) {
    for (int32_t i = 0; i < count; i++)
      starts[i] = 0;
    return UPF_OK;
  }
  return upf_eval_windows(s->text_len, L - s->bos_len, count, min_stride, starts);
}

/* The ids of window w: BOS + text[start, start + L - 1), or seeded ids (seed + w). */
static void eval_source_window(const eval_source *s, int64_t start, int64_t L, int w, int32_t *ids) {
  if (!s->text) {
    upf_model_seeded_ids(s->seed + (uint64_t)w, s->model.cfg->vocab, L, ids);
    return;
  }
  if (s->bos_len)
    ids[0] = s->bos;
  memcpy(ids + s->bos_len, s->text + start, (size_t)(L - s->bos_len) * sizeof *ids);
}

static const char needle_head[] =
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n";
static const char needle_question[] = "\n\nWhat is the pass key? The pass key is";

/* A needle prompt of L tokens with the key `value` at `depth`, and the answer's tokens: those the
 * tokenizer gives the question followed by " value", after the question's own. */
static upf_status eval_source_needle(eval_source *s, uint32_t value, int64_t L, double depth, int32_t *prompt,
                                     int64_t *fact_at, eval_needle *out) {
  char fact[160], qa[256];
  snprintf(fact, sizeof fact, "The pass key is %u. Remember it. %u is the pass key.\n\n", value, value);
  snprintf(qa, sizeof qa, "%s %u", needle_question, value);
  int32_t *head = NULL, *f = NULL, *q = NULL, *full = NULL;
  int64_t hn = 0, fn = 0, qn = 0, an = 0;
  memset(out, 0, sizeof *out);
  upf_status st = eval_tokenizer_encode(&s->tok, needle_head, (int64_t)strlen(needle_head), &head, &hn);
  if (st == UPF_OK)
    st = eval_tokenizer_encode(&s->tok, fact, (int64_t)strlen(fact), &f, &fn);
  if (st == UPF_OK)
    st = eval_tokenizer_encode(&s->tok, needle_question, (int64_t)strlen(needle_question), &q, &qn);
  if (st == UPF_OK)
    st = eval_tokenizer_encode(&s->tok, qa, (int64_t)strlen(qa), &full, &an);
  if (st == UPF_OK && (an <= qn || memcmp(full, q, (size_t)qn * sizeof *q)))
    st = upf_fail(UPF_ERR_FORMAT, "needle: the tokenizer does not keep the question's tokens when the key follows it");
  if (st == UPF_OK) {
    out->answer_len = an - qn;
    out->answer = malloc((size_t)out->answer_len * sizeof *out->answer);
    memcpy(out->answer, full + qn, (size_t)out->answer_len * sizeof *out->answer);
    /* BOS, then the instruction */
    int32_t *h = malloc((size_t)(hn + 1) * sizeof *h);
    if (s->bos_len)
      h[0] = s->bos;
    memcpy(h + s->bos_len, head, (size_t)hn * sizeof *h);
    const upf_needle_parts parts = {h, hn + s->bos_len, s->filler, s->filler_len, s->breaks, s->num_breaks,
                                    f, fn, q, qn};
    st = upf_needle_build(&parts, L, depth, prompt, fact_at);
    free(h);
  }
  free(head), free(f), free(q), free(full);
  if (st != UPF_OK)
    eval_needle_free(out);
  return st;
}

/* ---- the JSON, built in memory and written in one piece ---- */

typedef struct {
  char *buf;
  size_t len;
  FILE *f;
} json_out;

static upf_status json_write_file(json_out *j, const char *path) {
  fclose(j->f);
  j->f = NULL;
  upf_outputs *o;
  UPF_TRY(upf_outputs_create(&o, 1));
  FILE *f;
  upf_status st = upf_outputs_open(o, path, "--json", &f);
  if (st == UPF_OK)
    st = upf_output_put(f, j->buf, j->len, path);
  if (st == UPF_OK)
    st = upf_outputs_commit(o);
  upf_outputs_free(o);
  return st;
}

/* Every file the run reads or writes, for upf_args_check_paths: --gguf, each file of the --text-file
 * list (or of the default list) and --json. 0 after the message on a clash. */
static int check_eval_paths(const eval_args *a) {
  const char *list = a->text_files ? a->text_files : a->gguf ? default_text_files : "";
  char *copy = strdup(list);
  upf_arg_path paths[2 + 64];
  int n = 0;
  paths[n++] = (upf_arg_path){"--gguf", a->gguf, 0, 0};
  for (char *save = NULL, *tok = copy ? strtok_r(copy, ",", &save) : NULL; tok && n < 1 + 64;
       tok = strtok_r(NULL, ",", &save))
    paths[n++] = (upf_arg_path){a->text_files ? "--text-file" : "--text-file (its default)", tok, 0, 0};
  paths[n++] = (upf_arg_path){"--json", a->json, 1, 0};
  const int ok = copy && upf_args_check_paths("upf eval", paths, n);
  free(copy);
  return ok;
}

static void json_header(FILE *f, const eval_args *a, const eval_source *src, const upf_backend *be, int argc,
                        char **argv) {
  const upf_model_config *c = src->model.cfg;
  fprintf(f, "{\n  \"task\": \"%s\",\n  \"model\": {\"name\": ", a->task);
  upf_json_string(f, c->name);
  fprintf(f, ", \"gguf\": ");
  if (a->gguf)
    upf_json_string(f, a->gguf);
  else
    fprintf(f, "null, \"seed\": %d", a->seed);
  fprintf(f, ", \"layers\": %d, \"vocab\": %d, \"drop_layers\": [", c->num_layers, c->vocab);
  for (int k = 0; k < c->num_drop_layers; k++)
    fprintf(f, "%s%d", k ? ", " : "", c->drop_layers[k]);
  fprintf(f, "], \"select\": {\"block\": %d, \"sink\": %d, \"last_q\": %d, \"p\": %g}, \"drop_min_step_tokens\": %lld},\n",
          c->select.block, c->select.sink, c->select.last_q, (double)c->select.p, (long long)c->drop_min_step_tokens);
  fprintf(f, "  \"mode\": \"%s\",\n  \"chunk\": %d,\n", a->mode, a->chunk);
  if (!strcmp(a->mode, "flashprefill")) { /* alpha: the sweep's, per run */
    fprintf(f, "  \"flashprefill\": ");
    upf_sparse_args_json(f, &a->fa.params);
    fprintf(f, ",\n");
  } else if (!strcmp(a->mode, "compact")) {
    fprintf(f, "  \"compact\": {\"recent\": %d, \"selector\": ", a->fa.compact.recent);
    upf_sparse_args_json(f, &a->fa.params);
    fprintf(f, "},\n");
  }
  fprintf(f, "  \"backend\": \"%s\",\n  \"device\": ", be->name);
  upf_json_string(f, be->describe());
  fprintf(f, ",\n  \"dtype\": \"%s\",\n  \"text\": ", upf_dtype_name(src->model.dtype));
  if (src->num_files) {
    fprintf(f, "{\"files\": [");
    for (int i = 0; i < src->num_files; i++) {
      fprintf(f, "%s{\"path\": ", i ? ", " : "");
      upf_json_string(f, src->files[i].path);
      fprintf(f, ", \"bytes\": %lld}", (long long)src->files[i].bytes);
    }
    fprintf(f, "], \"tokens\": %lld},\n", (long long)src->text_len);
  } else {
    fprintf(f, "null,\n");
  }
  char commit[64] = "";
  upf_source_commit(commit, sizeof commit);
  fprintf(f, "  \"commit\": \"%s\",\n  \"command\": ", commit[0] ? commit : "unknown");
  upf_json_command(f, "upf eval", argc, argv);
  fprintf(f, ",\n");
}

static void json_doubles(FILE *f, const double *x, int n) {
  fputc('[', f);
  for (int i = 0; i < n; i++)
    fprintf(f, "%s%.6f", i ? ", " : "", x[i]);
  fputc(']', f);
}

/* ---- ppl ---- */

static upf_status run_ppl(const eval_args *a, eval_source *src, const int64_t *lengths, int nlen, FILE *j) {
  fprintf(j, "  \"lengths\": [");
  for (int li = 0; li < nlen; li++) {
    const int64_t L = lengths[li];
    int64_t *starts = malloc((size_t)a->windows * sizeof *starts);
    int32_t *ids = malloc((size_t)L * sizeof *ids);
    double *nll = malloc((size_t)L * sizeof *nll), *all = malloc((size_t)a->windows * (size_t)L * sizeof *all);
    upf_status st = eval_source_windows(src, L, a->windows, 1, starts);
    int64_t count = 0;
    const double t0 = now_seconds();
    for (int w = 0; st == UPF_OK && w < a->windows; w++) {
      eval_source_window(src, starts[w], L, w, ids);
      const double w0 = now_seconds();
      st = upf_eval_prefill_nll(&src->model, ids, L, nll);
      if (st == UPF_OK) {
        memcpy(all + count, nll, (size_t)(L - 1) * sizeof *nll);
        count += L - 1;
        fprintf(stderr, "upf eval: ppl, %lld tokens, window %d/%d: ppl %.4f (%.1f s)\n", (long long)L, w + 1,
                a->windows, upf_eval_ppl(nll, L - 1), now_seconds() - w0);
      }
    }
    if (st == UPF_OK) {
      const double ppl = upf_eval_ppl(all, count);
      printf("ppl over %d window(s) of %lld tokens (%lld predicted positions): %.4f\n", a->windows, (long long)L,
             (long long)count, ppl);
      fprintf(j, "%s\n    {\"tokens\": %lld, \"windows\": %d, \"window_starts\": [", li ? "," : "", (long long)L,
              a->windows);
      for (int w = 0; w < a->windows; w++)
        fprintf(j, "%s%lld", w ? ", " : "", (long long)starts[w]);
      fprintf(j, "], \"positions\": %lld, \"mean_nll\": %.6f, \"ppl\": %.6f, \"seconds\": %.2f}", (long long)count,
              log(ppl), ppl, now_seconds() - t0);
    }
    free(starts), free(ids), free(nll), free(all);
    if (st != UPF_OK)
      return st;
  }
  fprintf(j, "\n  ]\n}\n");
  return UPF_OK;
}

/* ---- next-token ---- */

static upf_status run_next_token(const eval_args *a, eval_source *src, const int64_t *lengths, int nlen,
                                 const eval_arm *arms, int narms, FILE *j) {
  const upf_model *m = &src->model;
  const int32_t V = m->cfg->vocab;
  const int64_t last = a->last;
  float *dense = malloc((size_t)last * V * sizeof *dense), *uni = malloc((size_t)last * V * sizeof *uni);
  upf_eval_agreement floor_acc;
  upf_eval_agreement *acc = calloc((size_t)narms, sizeof *acc);
  double *keep = calloc((size_t)narms * UPF_MODEL_MAX_LAYERS, sizeof *keep), *secs = calloc((size_t)narms, sizeof *secs);
  double *share = calloc((size_t)narms, sizeof *share); /* FlashPrefill: kept share over all layers */
  int32_t sparse_layers[UPF_MODEL_MAX_LAYERS];
  upf_status st = dense && uni && acc && keep && secs && share
                      ? UPF_OK
                      : upf_fail(UPF_ERR_NOMEM, "eval: logits of %lld positions", (long long)last);
  fprintf(j, "  \"last\": %lld,\n  \"lengths\": [", (long long)last);
  for (int li = 0; st == UPF_OK && li < nlen; li++) {
    const int64_t L = lengths[li];
    memset(acc, 0, (size_t)narms * sizeof *acc);
    memset(&floor_acc, 0, sizeof floor_acc);
    memset(keep, 0, (size_t)narms * UPF_MODEL_MAX_LAYERS * sizeof *keep);
    memset(secs, 0, (size_t)narms * sizeof *secs);
    memset(share, 0, (size_t)narms * sizeof *share);
    int64_t *starts = malloc((size_t)a->windows * sizeof *starts);
    int32_t *ids = malloc((size_t)L * sizeof *ids);
    double dense_s = 0;
    int drops_seen = 0;
    st = eval_source_windows(src, L, a->windows, last, starts);
    for (int w = 0; st == UPF_OK && w < a->windows; w++) {
      eval_source_window(src, starts[w], L, w, ids);
      upf_prefill_options opt = {.mode = UPF_PREFILL_DENSE, .select = m->cfg->select};
      upf_prefill_result res;
      double t0 = now_seconds();
      st = upf_eval_prefill_last(m, ids, L, &opt, last, dense, &res);
      upf_prefill_result_free(&res);
      dense_s += now_seconds() - t0;
      fprintf(stderr, "upf eval: next-token, %lld tokens, window %d/%d: dense %.1f s", (long long)L, w + 1, a->windows,
              now_seconds() - t0);
      if (st == UPF_OK && src->have_other) { /* the same windows, dense, in the other dtype */
        t0 = now_seconds();
        st = upf_eval_prefill_last(&src->other, ids, L, &opt, last, uni, &res);
        upf_prefill_result_free(&res);
        if (st == UPF_OK)
          st = upf_eval_agreement_add(&floor_acc, dense, uni, last, V);
        fprintf(stderr, ", dense %s %.1f s", upf_dtype_name(src->other.dtype), now_seconds() - t0);
      }
      for (int r = 0; st == UPF_OK && r < narms; r++) {
        t0 = now_seconds();
        st = arm_prefill_last(m, &arms[r], ids, L, last, uni, &res);
        if (st == UPF_OK) {
          const double prefill_s = now_seconds() - t0; /* the prefill alone, as dense's time above */
          secs[r] += prefill_s;
          double ratios[UPF_MODEL_MAX_LAYERS];
          if (arm_blocks(&arms[r])) { /* per layer: kept key blocks / visible ones */
            drops_seen = res.num_sparse;
            share[r] += upf_prefill_kept_share(&res) / a->windows;
            for (int k = 0; k < res.num_sparse; k++) {
              sparse_layers[k] = res.sparse[k].layer;
              ratios[k] = res.sparse[k].visible_blocks
                              ? (double)res.sparse[k].kept_blocks / (double)res.sparse[k].visible_blocks
                              : 1.0;
            }
          } else {
            drops_seen = res.num_drops;
            upf_eval_keep_ratios(&res, L, ratios);
          }
          for (int k = 0; k < drops_seen; k++)
            keep[r * UPF_MODEL_MAX_LAYERS + k] += ratios[k] / a->windows;
          st = upf_eval_agreement_add(&acc[r], dense, uni, last, V);
          fprintf(stderr, ", %s %g %.1f s", arms[r].kind, arms[r].value, prefill_s);
        }
        upf_prefill_result_free(&res);
      }
      fprintf(stderr, "\n");
    }
    if (st == UPF_OK) {
      fprintf(j, "%s\n    {\"tokens\": %lld, \"windows\": %d, \"window_starts\": [", li ? "," : "", (long long)L,
              a->windows);
      for (int w = 0; w < a->windows; w++)
        fprintf(j, "%s%lld", w ? ", " : "", (long long)starts[w]);
      fprintf(j, "], \"dense_seconds\": %.3f, ", dense_s / a->windows);
      if (src->have_other) {
        const double agree = (double)floor_acc.agree / (double)floor_acc.positions;
        printf("%s %lld tokens x %d windows, dense %s vs dense %s: top-1 agreement %.2f%% (%lld/%lld), mean KL %.3g, "
               "max KL %.3g\n", m->cfg->name, (long long)L, a->windows, upf_dtype_name(src->other.dtype),
               upf_dtype_name(m->dtype), 100.0 * agree, (long long)floor_acc.agree, (long long)floor_acc.positions,
               floor_acc.kl_sum / (double)floor_acc.positions, floor_acc.kl_max);
        fprintf(j, "\"dtype_floor\": {\"dtype\": \"%s\", \"positions\": %lld, \"agree\": %lld, \"top1_agreement\": %.6f, "
                   "\"kl_mean\": %.6g, \"kl_max\": %.6g}, ",
                upf_dtype_name(src->other.dtype), (long long)floor_acc.positions, (long long)floor_acc.agree, agree,
                floor_acc.kl_sum / (double)floor_acc.positions, floor_acc.kl_max);
      }
      fprintf(j, "\"runs\": [");
      for (int r = 0; r < narms; r++) {
        const double agree = (double)acc[r].agree / (double)acc[r].positions;
        const double kl = acc[r].kl_sum / (double)acc[r].positions;
        const int flash = arm_blocks(&arms[r]);
        printf("%s %lld tokens x %d windows, %s %g: top-1 agreement %.2f%% (%lld/%lld), mean KL %.3g, max KL %.3g; ",
               m->cfg->name, (long long)L, a->windows, arms[r].kind, arms[r].value, 100.0 * agree,
               (long long)acc[r].agree, (long long)acc[r].positions, kl, acc[r].kl_max);
        if (flash)
          printf("kept share of the key blocks %.4f, per full-attention layer%s:", share[r],
                 arms[r].mode == UPF_PREFILL_COMPACT ? " (chunks with cached context)" : "");
        else if (arms[r].mode == UPF_PREFILL_DENSE)
          printf("dense in chunks of %d", arms[r].chunk);
        else
          printf("kept after each drop layer:");
        for (int k = 0; k < drops_seen; k++)
          printf(" %.3f", keep[r * UPF_MODEL_MAX_LAYERS + k]);
        printf("\n");
        fprintf(j, "%s\n      {\"%s\": %g, \"positions\": %lld, \"agree\": %lld, \"top1_agreement\": %.6f, "
                   "\"kl_mean\": %.6g, \"kl_max\": %.6g, \"seconds\": %.3f, \"keep_ratio\": ",
                r ? "," : "", arms[r].kind, arms[r].value, (long long)acc[r].positions, (long long)acc[r].agree, agree,
                kl, acc[r].kl_max, secs[r] / a->windows);
        json_doubles(j, keep + r * UPF_MODEL_MAX_LAYERS, drops_seen);
        if (flash) { /* keep_ratio holds the per-layer kept shares of the key blocks */
          fprintf(j, ", \"kept_share\": %.6f, \"sparse_layers\": [", share[r]);
          for (int k = 0; k < drops_seen; k++)
            fprintf(j, "%s%d", k ? ", " : "", sparse_layers[k]);
          fprintf(j, "]");
        }
        fprintf(j, "}");
      }
      fprintf(j, "\n    ]}");
    }
    free(starts), free(ids);
  }
  fprintf(j, "\n  ]\n}\n");
  free(dense), free(uni), free(acc), free(keep), free(secs), free(share);
  return st;
}

/* ---- needle ---- */

static upf_status run_needle(const eval_args *a, eval_source *src, const int64_t *lengths, int nlen,
                             const double *depths, int ndepths, const eval_arm *arms, int narms, FILE *j) {
  const upf_model *m = &src->model;
  const int uni = strcmp(a->mode, "dense") != 0 || a->chunk; /* the arms run: any but unchunked dense */
  int *correct = calloc((size_t)(narms + 1), sizeof *correct);
  double *keep = calloc((size_t)narms * UPF_MODEL_MAX_LAYERS, sizeof *keep);
  double *share = calloc((size_t)narms, sizeof *share); /* FlashPrefill: kept share over all layers */
  upf_status st = correct && keep && share ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "eval: needle tallies");
  int mismatches = 0;
  fprintf(j, "  \"needle_seed\": %d,\n  \"trials\": %d,\n  \"depths\": ", a->needle_seed, a->trials);
  json_doubles(j, depths, ndepths);
  fprintf(j, ",\n  \"lengths\": [");
  for (int li = 0; st == UPF_OK && li < nlen; li++) {
    const int64_t L = lengths[li];
    int32_t *prompt = malloc((size_t)L * sizeof *prompt);
    fprintf(j, "%s\n    {\"tokens\": %lld, \"cases\": [", li ? "," : "", (long long)L);
    int cases = 0, drops_seen = 0;
    int *cell = calloc((size_t)ndepths * (narms + 1), sizeof *cell); /* correct per depth and side */
    memset(correct, 0, (size_t)(narms + 1) * sizeof *correct);
    memset(keep, 0, (size_t)narms * UPF_MODEL_MAX_LAYERS * sizeof *keep);
    memset(share, 0, (size_t)narms * sizeof *share);
    for (int di = 0; st == UPF_OK && di < ndepths; di++)
      for (int t = 0; st == UPF_OK && t < a->trials; t++) {
        /* the case's seed: a function of the needle seed, the length, the depth's index and the trial */
        const uint64_t seed = (uint64_t)a->needle_seed * 1000003u + (uint64_t)L * 131u + (uint64_t)di * 17u + (uint64_t)t;
        upf_rng rng;
        upf_rng_seed(&rng, seed);
        const uint32_t value = 10000u + (uint32_t)upf_rng_below(&rng, 990000u);
        eval_needle nd;
        int64_t fact_at = 0;
        st = eval_source_needle(src, value, L, depths[di], prompt, &fact_at, &nd);
        if (st != UPF_OK)
          break;
        const double t0 = now_seconds();
        upf_eval_answer dense;
        st = upf_eval_check_answer(m, prompt, L, nd.answer, nd.answer_len, NULL, &dense);
        fprintf(j, "%s\n      {\"depth\": %g, \"trial\": %d, \"seed\": %llu, \"value\": %u, \"fact_at\": %lld, "
                   "\"answer_tokens\": %lld, \"dense\": %s",
                cases++ ? "," : "", depths[di], t, (unsigned long long)seed, value, (long long)fact_at,
                (long long)nd.answer_len, st == UPF_OK && dense.correct ? "true" : "false");
        correct[0] += st == UPF_OK && dense.correct;
        cell[di * (narms + 1)] += st == UPF_OK && dense.correct;
        fprintf(stderr, "upf eval: needle, %lld tokens, depth %g, key %u: dense %s (%.1f s)", (long long)L, depths[di],
                value, dense.correct ? "right" : "wrong", now_seconds() - t0);
        for (int r = 0; uni && st == UPF_OK && r < narms; r++) {
          upf_eval_answer u;
          const double r0 = now_seconds();
          const int flash = arm_blocks(&arms[r]);
          st = arm_check_answer(m, &arms[r], prompt, L, nd.answer, nd.answer_len, &u);
          if (st != UPF_OK)
            break;
          correct[r + 1] += u.correct;
          cell[di * (narms + 1) + r + 1] += u.correct;
          mismatches += u.first != u.prompt_first;
          drops_seen = flash ? u.num_sparse : u.num_drops;
          share[r] += u.kept_share;
          for (int k = 0; k < drops_seen; k++)
            keep[r * UPF_MODEL_MAX_LAYERS + k] += flash ? u.layer_kept_share[k] : u.keep[k];
          fprintf(j, ", \"%s_%g\": %s", arms[r].kind, arms[r].value, u.correct ? "true" : "false");
          fprintf(stderr, ", %s %g %s (%.1f s)", arms[r].kind, arms[r].value, u.correct ? "right" : "wrong",
                  now_seconds() - r0);
        }
        fprintf(stderr, "\n");
        fprintf(j, "}");
        eval_needle_free(&nd);
      }
    free(prompt);
    if (st == UPF_OK) {
      const int n = ndepths * a->trials;
      fprintf(j, "\n    ], \"dense_accuracy\": %.6f, \"dense_by_depth\": [", (double)correct[0] / n);
      printf("%s needle %lld tokens, %d cases: dense %.1f%%", m->cfg->name, (long long)L, n, 100.0 * correct[0] / n);
      for (int di = 0; di < ndepths; di++)
        fprintf(j, "%s%.4f", di ? ", " : "", (double)cell[di * (narms + 1)] / a->trials);
      fprintf(j, "], \"runs\": [");
      for (int r = 0; uni && r < narms; r++) {
        printf(", %s %g %.1f%%", arms[r].kind, arms[r].value, 100.0 * correct[r + 1] / n);
        fprintf(j, "%s\n      {\"%s\": %g, \"accuracy\": %.6f, \"by_depth\": [", r ? "," : "", arms[r].kind,
                arms[r].value, (double)correct[r + 1] / n);
        for (int di = 0; di < ndepths; di++)
          fprintf(j, "%s%.4f", di ? ", " : "", (double)cell[di * (narms + 1) + r + 1] / a->trials);
        double kr[UPF_MODEL_MAX_LAYERS];
        for (int k = 0; k < drops_seen; k++)
          kr[k] = keep[r * UPF_MODEL_MAX_LAYERS + k] / n;
        fprintf(j, "], \"keep_ratio\": ");
        json_doubles(j, kr, drops_seen);
        if (arm_blocks(&arms[r])) { /* keep_ratio: the per-layer kept shares of key blocks */
          printf(" (kept share %.4f)", share[r] / n);
          fprintf(j, ", \"kept_share\": %.6f", share[r] / n);
        }
        fprintf(j, "}");
      }
      printf("\n");
      fprintf(j, "\n    ]}");
    }
    free(cell);
  }
  /* the answer run's argmax at the prompt's last position must be the prompt-only run's: the replay
   * reproduces that run exactly there (a nonzero count means the replay is not what decode would see) */
  fprintf(j, "\n  ],\n  \"replay_first_token_mismatches\": %d\n}\n", mismatches);
  if (mismatches)
    fprintf(stderr, "upf eval: needle: %d replayed runs disagree with their prompt run at the prompt's last position\n",
            mismatches);
  free(correct), free(keep), free(share);
  return st;
}

int upf_cli_eval(int argc, char **argv) {
  eval_args a = {.mode = "uniprefill", .dtype = "bf16", .fa = UPF_SPARSE_ARGS_DEFAULT, .seed = 1, .windows = 0,
                 .last = 128, .trials = 1, .needle_seed = 16};
  upf_arg args[] = {
      {"--gguf", UPF_ARG_STRING, &a.gguf},           {"--model", UPF_ARG_STRING, &a.model},
      {"--seed", UPF_ARG_INT, &a.seed, 0, 0, INT32_MAX}, {"--task", UPF_ARG_STRING, &a.task, 1},
      {"--tokens", UPF_ARG_STRING, &a.tokens},       {"--mode", UPF_ARG_STRING, &a.mode},
      {"--p", UPF_ARG_STRING, &a.p},                 {"--keep", UPF_ARG_STRING, &a.keep},
      {"--backend", UPF_ARG_STRING, &a.backend},     {"--dtype", UPF_ARG_STRING, &a.dtype},
      {"--text-file", UPF_ARG_STRING, &a.text_files}, {"--windows", UPF_ARG_INT, &a.windows, 0, 1, 100000},
      {"--last", UPF_ARG_INT, &a.last, 0, 1, 1 << 20}, {"--depths", UPF_ARG_STRING, &a.depths},
      {"--allow-over-context", UPF_ARG_SWITCH, &a.over_context},
      {"--trials", UPF_ARG_INT, &a.trials, 0, 1, 100000}, {"--needle-seed", UPF_ARG_INT, &a.needle_seed, 0, 0, INT32_MAX},
      {"--json", UPF_ARG_STRING, &a.json},           {"--dtype-floor", UPF_ARG_SWITCH, &a.floor},
      {"--alpha", UPF_ARG_STRING, &a.alpha},         UPF_SPARSE_SHAPE_ARG_FLAGS(a.fa),
      {"--chunk", UPF_ARG_INT, &a.chunk, 0, 1, INT32_MAX},
  };
  upf_arg_parser p = {"upf eval", upf_cli_eval_usage, args, (int)(sizeof args / sizeof *args), NULL, 0, 0};
  const upf_args_result pr = upf_args_parse(&p, argc, argv);
  if (pr != UPF_ARGS_OK)
    return upf_args_exit_code(pr);

  /* the command line alone */
  if (!a.gguf == !a.model) {
    fprintf(stderr, "upf eval: give exactly one of --gguf FILE and --model NAME\n");
    return 2;
  }
  if (a.gguf && upf_args_find(&p, "--seed")->seen) {
    fprintf(stderr, "upf eval: --seed %d means nothing with --gguf: the weights are the file's and the windows are "
                    "its text (--needle-seed draws the needles); leave it out\n", a.seed);
    return 2;
  }
  const int task_ppl = !strcmp(a.task, "ppl"), task_next = !strcmp(a.task, "next-token"),
            task_needle = !strcmp(a.task, "needle");
  if (!task_ppl && !task_next && !task_needle) {
    fprintf(stderr, "upf eval: --task '%s': want ppl, next-token or needle\n", a.task);
    return 2;
  }
  if (strcmp(a.mode, "dense") && strcmp(a.mode, "uniprefill") && strcmp(a.mode, "flashprefill") &&
      strcmp(a.mode, "compact")) {
    fprintf(stderr, "upf eval: --mode '%s': want dense, uniprefill, flashprefill or compact (compact with --chunk)\n",
            a.mode);
    return 2;
  }
  const int compact = !strcmp(a.mode, "compact");
  /* flash: the arms sweep --alpha over key blocks (FlashPrefill, or CompactAttention's selector) */
  const int flash = !strcmp(a.mode, "flashprefill") || compact;
  if (compact && !a.chunk) {
    fprintf(stderr, "upf eval: --mode compact needs --chunk C (CompactAttention runs the chunks of a chunked "
                    "prefill)\n");
    return 2;
  }
  if (a.chunk && task_ppl) {
    fprintf(stderr, "upf eval: --chunk does not apply to --task ppl (dense only; next-token and needle take it)\n");
    return 2;
  }
  if (a.chunk && !strcmp(a.mode, "uniprefill")) {
    fprintf(stderr, "upf eval: --chunk with --mode uniprefill: a chunk never drops (SPEC section 4), so it would "
                    "measure chunked dense; give --mode dense, compact or flashprefill with --chunk\n");
    return 2;
  }
  if (task_ppl && upf_args_find(&p, "--mode")->seen && strcmp(a.mode, "dense")) {
    fprintf(stderr, "upf eval: --task ppl is dense only: UniPrefill drops positions, so it has no NLL at every "
                    "position (next-token compares it, and FlashPrefill, with dense)\n");
    return 2;
  }
  if (task_next && !strcmp(a.mode, "dense") && !a.chunk) {
    fprintf(stderr, "upf eval: --task next-token compares UniPrefill or FlashPrefill with dense: --mode dense leaves "
                    "nothing to compare\n");
    return 2;
  }
  if (task_needle && a.model) {
    fprintf(stderr, "upf eval: --task needle needs text and a tokenizer: give --gguf FILE\n");
    return 2;
  }
  if (a.model && a.text_files) {
    fprintf(stderr, "upf eval: --text-file needs a tokenizer: give --gguf FILE (--model runs on seeded token ids)\n");
    return 2;
  }
  if (a.p && a.keep) {
    fprintf(stderr, "upf eval: give --p (top-p) or --keep (top-k keep ratios), not both\n");
    return 2;
  }
  if (a.chunk && !flash && (a.p || a.keep)) {
    fprintf(stderr, "upf eval: --p and --keep go with --mode uniprefill, which --chunk does not take\n");
    return 2;
  }
  if (flash && (a.p || a.keep)) {
    fprintf(stderr, "upf eval: --p and --keep go with --mode uniprefill (%s sweeps --alpha)\n", a.mode);
    return 2;
  }
  /* --alpha and the other FlashPrefill flags only with --mode flashprefill, each in range */
  const int rc_sparse = upf_sparse_args_resolve("eval", &p, compact ? 2 : flash, &a.fa);
  if (rc_sparse)
    return rc_sparse;
  if (a.alpha && task_ppl) {
    fprintf(stderr, "upf eval: --alpha does not apply to --task ppl\n");
    return 2;
  }
  if ((a.p || a.keep || a.depths || upf_args_find(&p, "--last")->seen) && task_ppl) {
    fprintf(stderr, "upf eval: --p, --keep, --depths and --last do not apply to --task ppl\n");
    return 2;
  }
  if ((a.depths || upf_args_find(&p, "--trials")->seen || upf_args_find(&p, "--needle-seed")->seen) && !task_needle) {
    fprintf(stderr, "upf eval: --depths, --trials and --needle-seed go with --task needle\n");
    return 2;
  }
  if (a.floor && !task_next) {
    fprintf(stderr, "upf eval: --dtype-floor goes with --task next-token\n");
    return 2;
  }
  if (a.windows && task_needle) {
    fprintf(stderr, "upf eval: --windows goes with --task ppl or next-token (needle: --depths and --trials)\n");
    return 2;
  }
  if (!a.windows)
    a.windows = task_ppl ? 1 : 4;
  double *lengths_d = NULL, *values = NULL, *depths = NULL;
  int nlen = 0, nval = 0, ndepths = 0;
  int rc = 0;
  const char *len_text = a.tokens ? a.tokens : task_ppl ? "1024" : "2048";
  if (!parse_doubles(len_text, &lengths_d, &nlen))
    nlen = 0;
  int64_t *lengths = malloc((size_t)(nlen ? nlen : 1) * sizeof *lengths);
  for (int i = 0; i < nlen; i++) {
    /* the range first: converting a double past int64 is undefined */
    if (!(lengths_d[i] >= 2 && lengths_d[i] <= INT32_MAX) || (lengths[i] = (int64_t)lengths_d[i]) != lengths_d[i]) {
      nlen = 0;
      break;
    }
  }
  if (!nlen) {
    fprintf(stderr, "upf eval: --tokens '%s': want whole token counts in [2, 2147483647] separated by commas\n",
            len_text);
    rc = 2;
  }
  const char *sweep = flash ? a.alpha : a.keep ? a.keep : a.p;
  const char *sweep_flag = flash ? "--alpha" : a.keep ? "--keep" : "--p";
  if (rc == 0 && sweep && (!parse_doubles(sweep, &values, &nval) || nval < 1)) {
    fprintf(stderr, "upf eval: %s '%s': want numbers in %s separated by commas\n", sweep_flag, sweep,
            flash ? "[0, 1]" : "(0, 1]");
    rc = 2;
  }
  for (int i = 0; rc == 0 && i < nval; i++)
    if (!((flash ? values[i] >= 0.0 : values[i] > 0.0) && values[i] <= 1.0)) {
      fprintf(stderr, "upf eval: %s %g: want a value in %s\n", sweep_flag, values[i], flash ? "[0, 1]" : "(0, 1]");
      rc = 2;
    }
  if (rc == 0 && task_needle) {
    if (!parse_doubles(a.depths ? a.depths : "0.1,0.3,0.5,0.7,0.9", &depths, &ndepths))
      ndepths = 0;
    for (int i = 0; i < ndepths; i++)
      if (!(depths[i] >= 0.0 && depths[i] <= 1.0))
        ndepths = 0;
    if (!ndepths) {
      fprintf(stderr, "upf eval: --depths '%s': want depths in [0, 1] separated by commas\n", a.depths);
      rc = 2;
    }
  }
  upf_dtype dtype = UPF_DTYPE_BF16;
  if (rc == 0 && (upf_dtype_parse(a.dtype, &dtype) != UPF_OK || (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16))) {
    fprintf(stderr, "upf eval: --dtype '%s': want f32 or bf16\n", a.dtype);
    rc = 2;
  }
  if (rc == 0 && !check_eval_paths(&a))
    rc = 2;
  struct stat sb;
  if (rc == 0 && a.gguf && (stat(a.gguf, &sb) != 0 || !S_ISREG(sb.st_mode))) {
    fprintf(stderr, "upf eval: --gguf %s: no such file\n", a.gguf);
    rc = 2;
  }
  const upf_backend *be = NULL;
  if (rc == 0) {
    be = a.backend ? upf_backend_by_name(a.backend) : upf_cli_default_backend();
    if (!be)
      rc = upf_cli_error(UPF_ERR_INVALID_ARG, "eval: --backend"), rc = 2;
    else if (be->probe() != UPF_OK)
      rc = upf_cli_error(UPF_ERR_NO_DEVICE, "eval: --backend");
  }

  /* the model, its tokenizer and the text: every file is read and every size checked before a prefill */
  eval_source src;
  memset(&src, 0, sizeof src);
  const eval_source_spec spec = {a.gguf, a.model, (uint64_t)a.seed, be, dtype,
                                 a.gguf ? (a.text_files ? a.text_files : default_text_files) : NULL};
  if (rc == 0) {
    upf_status st = eval_source_open(&spec, &src);
    if (st != UPF_OK)
      rc = a.gguf ? upf_cli_error(st, src.stage ? src.stage : "eval: --gguf")
                  : (upf_cli_error(st, "eval: --model"), 2); /* an unknown name, as a bad value: 2 */
  }
  eval_arm *arms = NULL;
  int narms = 0;
  if (rc == 0) {
    const upf_model_config *c = src.cfg;
    narms = nval ? nval : 1;
    arms = calloc((size_t)narms, sizeof *arms);
    for (int i = 0; i < narms; i++) {
      arms[i].mode = compact ? UPF_PREFILL_COMPACT : flash ? UPF_PREFILL_FLASHPREFILL : UPF_PREFILL_UNIPREFILL;
      arms[i].sel = c->select;
      arms[i].sparse = a.fa.params;
      arms[i].compact = a.fa.compact;
      arms[i].chunk = a.chunk;
      arms[i].kind = flash ? "alpha" : a.keep ? "keep" : "p";
      arms[i].value = nval ? values[i] : flash ? (double)a.fa.params.alpha : (double)c->select.p;
      if (a.chunk && !flash) /* chunked dense: one arm, named by its chunk */
        arms[i].mode = UPF_PREFILL_DENSE, arms[i].kind = "chunk", arms[i].value = a.chunk;
      if (flash)
        arms[i].sparse.alpha = (float)arms[i].value;
      else if (a.keep)
        arms[i].sel.keep_ratio = (float)values[i];
      else
        arms[i].sel.p = (float)arms[i].value;
    }
    /* FlashPrefill has logits at every position; UniPrefill only at those it keeps */
    /* the default fits the model: a tiny one observes fewer than 128 positions */
    const int drops = !strcmp(a.mode, "uniprefill");
    if (!upf_args_find(&p, "--last")->seen && drops && a.last > c->select.last_q)
      a.last = c->select.last_q;
    if (task_next && drops && a.last > c->select.last_q) {
      fprintf(stderr, "upf eval: --last %d: at most the model's last-q (%d): positions before the observation window "
                      "can be dropped, and dropped positions have no logits\n", a.last, c->select.last_q);
      rc = 2;
    }
    const int64_t ctx = c->context_length;
    for (int i = 0; rc == 0 && ctx > 0 && i < nlen; i++) {
      if (lengths[i] <= ctx)
        continue;
      if (a.over_context) {
        fprintf(stderr, "upf eval: --tokens %lld: past the context_length %lld of %s (--allow-over-context: the model "
                        "is used beyond what it was trained for)\n", (long long)lengths[i], (long long)ctx,
                a.gguf ? a.gguf : c->name);
        break;
      }
      fprintf(stderr, "upf eval: --tokens %lld: past the context_length %lld that %s states; shorten it, or pass "
                      "--allow-over-context to run it anyway\n", (long long)lengths[i], (long long)ctx,
              a.gguf ? a.gguf : c->name);
      rc = 2;
    }
    for (int i = 0; rc == 0 && i < nlen; i++) {
      const int64_t need = task_next ? a.last + (int64_t)c->select.sink : 2;
      if (lengths[i] < need) {
        fprintf(stderr, "upf eval: --tokens %lld: too short (at least %lld)\n", (long long)lengths[i], (long long)need);
        rc = 2;
      } else if (src.num_files && !task_needle && lengths[i] - src.bos_len > src.text_len) {
        fprintf(stderr, "upf eval: --tokens %lld: longer than the text (%lld tokens from --text-file)\n",
                (long long)lengths[i], (long long)src.text_len);
        rc = 2;
      } else if (src.num_files && task_needle && lengths[i] > src.filler_len) {
        fprintf(stderr, "upf eval: --tokens %lld: longer than the filler text (%lld tokens from --text-file)\n",
                (long long)lengths[i], (long long)src.filler_len);
        rc = 2;
      }
    }
  }
  if (rc == 0) {
    upf_status st = eval_source_load(&spec, &src);
    if (st == UPF_OK && a.floor)
      st = eval_source_load_other(&spec, dtype == UPF_DTYPE_BF16 ? UPF_DTYPE_F32 : UPF_DTYPE_BF16, &src);
    if (st != UPF_OK)
      rc = upf_cli_error(st, a.gguf ? "eval: --gguf" : "eval: --model");
  }
  if (rc == 0) {
    json_out j = {0};
    j.f = open_memstream(&j.buf, &j.len);
    json_header(j.f, &a, &src, be, argc, argv);
    upf_status st;
    if (task_ppl)
      st = run_ppl(&a, &src, lengths, nlen, j.f);
    else if (task_next)
      st = run_next_token(&a, &src, lengths, nlen, arms, narms, j.f);
    else
      st = run_needle(&a, &src, lengths, nlen, depths, ndepths, arms, narms, j.f);
    if (st != UPF_OK)
      rc = upf_cli_error(st, "eval");
    else if (a.json && (st = json_write_file(&j, a.json)) != UPF_OK)
      rc = upf_cli_error(st, "eval");
    if (j.f)
      fclose(j.f);
    free(j.buf);
  }
  eval_source_close(&src);
  free(arms), free(lengths), free(lengths_d), free(values), free(depths);
  return rc;
}
