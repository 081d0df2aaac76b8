/* The continuous-batching engine (engine.h): request traces (seeded or JSON lines) and the scheduling
 * loop over a model step: decode rows of the running requests plus FCFS prefill admissions (whole
 * prompts, or with chunked prefill the next chunks of the prompts in progress and of new ones) within
 * the token and page budgets, greedy sampling, finishing and release, the simulated clock and the
 * statistics of the run. */
#include "uniprefill/engine.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "uniprefill/model.h"
#include "uniprefill/rng.h"
#include "uniprefill/session.h"

/* ---------------------------------------------------------------------------------------------- trace */

void upf_trace_free(upf_trace *t) {
  for (int32_t i = 0; t->reqs && i < t->num_reqs; i++)
    free(t->reqs[i].prompt);
  free(t->reqs);
  t->reqs = NULL, t->num_reqs = 0;
}

static upf_status seeded_prompt(upf_engine_request *r, uint64_t seed, int32_t vocab) {
  r->prompt = malloc((size_t)r->prompt_len * sizeof *r->prompt);
  if (!r->prompt)
    return upf_fail(UPF_ERR_NOMEM, "trace: prompt of %d tokens", r->prompt_len);
  upf_model_seeded_ids(seed, vocab, r->prompt_len, r->prompt);
  return UPF_OK;
}

upf_status upf_trace_seeded(upf_trace *t, const upf_trace_spec *s, int32_t vocab) {
  memset(t, 0, sizeof *t);
  if (s->num_reqs > UPF_TRACE_MAX_REQUESTS)
    return upf_fail(UPF_ERR_INVALID_ARG, "trace: %d requests: at most %d", s->num_reqs, UPF_TRACE_MAX_REQUESTS);
  if (s->num_reqs < 1 || s->len_min < 1 || s->len_max < s->len_min || s->max_new < 1 || vocab < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "trace: %d requests of %d..%d tokens, %d new each, vocab %d: want >= 1 "
                    "request, 1 <= min <= max, >= 1 new token", s->num_reqs, s->len_min, s->len_max, s->max_new, vocab);
  if (isnan(s->rate) || s->rate < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "trace: rate %g: want requests per second > 0 (0 or inf: all at t = 0)",
                    s->rate);
  t->reqs = calloc((size_t)s->num_reqs, sizeof *t->reqs);
  if (!t->reqs)
    return upf_fail(UPF_ERR_NOMEM, "trace: %d requests", s->num_reqs);
  t->num_reqs = s->num_reqs;
  upf_rng rng;
  upf_rng_seed(&rng, s->seed);
  const int all_at_once = s->rate == 0 || isinf(s->rate);
  double clock = 0;
  for (int32_t i = 0; i < s->num_reqs; i++) {
    upf_engine_request *r = &t->reqs[i];
    r->id = i;
    r->prompt_len = s->len_min + (int32_t)upf_rng_below(&rng, (uint64_t)(s->len_max - s->len_min) + 1);
    r->max_new = s->max_new;
    const uint64_t prompt_seed = upf_rng_next(&rng);
    /* u in [0, 1): the gap -ln(1 - u) / rate is finite */
    const double u = upf_rng_uniform(&rng);
    if (!all_at_once)
      clock += -log1p(-u) / s->rate;
    r->arrival = clock;
    if (!(clock <= UPF_TRACE_MAX_ARRIVAL)) {
      upf_trace_free(t);
      return upf_fail(UPF_ERR_INVALID_ARG, "trace: rate %g requests/s puts request %d at %g s, past the bound of %g s "
                      "(times that far out absorb the milliseconds measured from them); give a larger rate", s->rate, i,
                      clock, UPF_TRACE_MAX_ARRIVAL);
    }
    upf_status st = seeded_prompt(r, prompt_seed, vocab);
    if (st != UPF_OK) {
      upf_trace_free(t);
      return st;
    }
  }
  return UPF_OK;
}

/* A tiny reader for the flat objects of a trace line. */
typedef struct {
  const char *s, *line_start;
  const char *name;
  int64_t line;
  int64_t tokens; /* prompt tokens of the requests read so far */
} json_cursor;

static void skip_ws(json_cursor *c) {
  while (*c->s == ' ' || *c->s == '\t' || *c->s == '\r')
    c->s++;
}

static upf_status bad_line(const json_cursor *c, const char *what) {
  return upf_fail(UPF_ERR_FORMAT, "trace %s line %lld (column %lld): %s", c->name, (long long)c->line,
                  (long long)(c->s - c->line_start + 1), what);
}

static upf_status read_number(json_cursor *c, double *v) {
  skip_ws(c);
  char *end;
  errno = 0;
  *v = strtod(c->s, &end);
  /* JSON numbers only: no hex, inf or nan words */
  if (end == c->s || !(*c->s == '-' || (*c->s >= '0' && *c->s <= '9')) || errno == ERANGE || !isfinite(*v))
    return bad_line(c, "want a finite number");
  for (const char *p = c->s; p < end; p++)
    if (*p == 'x' || *p == 'X')
      return bad_line(c, "want a decimal number");
  c->s = end;
  return UPF_OK;
}

static upf_status read_int(json_cursor *c, int64_t lo, int64_t hi, const char *key, int64_t *v) {
  double d;
  UPF_TRY(read_number(c, &d));
  if (d != floor(d) || d < (double)lo || d > (double)hi) {
    char msg[160];
    snprintf(msg, sizeof msg, "\"%s\": %.17g is not an integer in [%lld, %lld]", key, d, (long long)lo, (long long)hi);
    return bad_line(c, msg);
  }
  *v = (int64_t)d;
  return UPF_OK;
}

/* The key of a member: a plain string of letters and underscores. */
static upf_status read_key(json_cursor *c, char *key, size_t cap) {
  skip_ws(c);
  if (*c->s != '"')
    return bad_line(c, "want a key in double quotes");
  c->s++;
  size_t n = 0;
  while (*c->s && *c->s != '"' && *c->s != '\n') {
    if (n + 1 < cap)
      key[n++] = *c->s;
    c->s++;
  }
  key[n] = '\0';
  if (*c->s != '"')
    return bad_line(c, "unterminated key");
  c->s++;
  skip_ws(c);
  if (*c->s != ':')
    return bad_line(c, "want ':' after the key");
  c->s++;
  return UPF_OK;
}

/* "prompt": [ids]; stores a malloc'd array. */
static upf_status read_ids(json_cursor *c, int32_t vocab, int32_t **ids, int32_t *n) {
  skip_ws(c);
  if (*c->s != '[')
    return bad_line(c, "\"prompt\": want an array of token ids");
  c->s++;
  int64_t cap = 64, len = 0;
  int32_t *a = malloc((size_t)cap * sizeof *a);
  if (!a)
    return upf_fail(UPF_ERR_NOMEM, "trace: prompt ids");
  skip_ws(c);
  upf_status st = UPF_OK;
  if (*c->s == ']')
    st = bad_line(c, "\"prompt\": an empty prompt is not a request");
  while (st == UPF_OK) {
    int64_t v;
    st = read_int(c, 0, (int64_t)vocab - 1, "prompt", &v);
    if (st != UPF_OK)
      break;
    if (len == cap) {
      int32_t *b = len >= INT32_MAX / 2 ? NULL : realloc(a, (size_t)(cap *= 2) * sizeof *a);
      if (!b) {
        st = upf_fail(UPF_ERR_NOMEM, "trace: prompt ids");
        break;
      }
      a = b;
    }
    a[len++] = (int32_t)v;
    skip_ws(c);
    if (*c->s == ',') {
      c->s++;
      continue;
    }
    if (*c->s == ']') {
      c->s++;
      break;
    }
    st = bad_line(c, "\"prompt\": want ',' or ']'");
  }
  if (st != UPF_OK) {
    free(a);
    return st;
  }
  *ids = a, *n = (int32_t)len;
  return UPF_OK;
}

/* One line into r; *empty when the line is blank. */
static upf_status parse_line(json_cursor *c, int32_t vocab, int32_t default_max_new, upf_engine_request *r,
                             int *empty) {
  skip_ws(c);
  *empty = *c->s == '\n' || *c->s == '\0';
  if (*empty)
    return UPF_OK;
  if (*c->s != '{')
    return bad_line(c, "want a JSON object");
  c->s++;
  enum { K_ID, K_ARRIVAL, K_PROMPT, K_PROMPT_LEN, K_SEED, K_MAX_NEW, K_COUNT };
  static const char *const keys[K_COUNT] = {"id", "arrival", "prompt", "prompt_len", "seed", "max_new"};
  int seen[K_COUNT] = {0};
  int64_t seed = c->line, v;
  r->id = c->line, r->max_new = default_max_new;
  skip_ws(c);
  if (*c->s == '}')
    return bad_line(c, "\"arrival\" is required");
  for (;;) {
    char key[64];
    UPF_TRY(read_key(c, key, sizeof key));
    int k = 0;
    while (k < K_COUNT && strcmp(keys[k], key))
      k++;
    char msg[160];
    if (k == K_COUNT) {
      snprintf(msg, sizeof msg, "unknown key \"%.40s\" (keys: id, arrival, prompt, prompt_len, seed, max_new)", key);
      return bad_line(c, msg);
    }
    if (seen[k]++) {
      snprintf(msg, sizeof msg, "\"%s\" given twice", key);
      return bad_line(c, msg);
    }
    switch (k) {
    case K_ID:
      UPF_TRY(read_int(c, -((int64_t)1 << 53), (int64_t)1 << 53, key, &r->id));
      break;
    case K_ARRIVAL:
      UPF_TRY(read_number(c, &r->arrival));
      if (!(r->arrival >= 0 && r->arrival <= UPF_TRACE_MAX_ARRIVAL)) {
        snprintf(msg, sizeof msg, "\"arrival\": %g: want seconds in [0, %g] (times further out absorb the "
                 "milliseconds measured from them)", r->arrival, UPF_TRACE_MAX_ARRIVAL);
        return bad_line(c, msg);
      }
      break;
    case K_PROMPT:
      UPF_TRY(read_ids(c, vocab, &r->prompt, &r->prompt_len));
      break;
    case K_PROMPT_LEN:
      UPF_TRY(read_int(c, 1, INT32_MAX, key, &v));
      r->prompt_len = (int32_t)v;
      break;
    case K_SEED:
      UPF_TRY(read_int(c, 0, (int64_t)1 << 53, key, &seed));
      break;
    case K_MAX_NEW:
      UPF_TRY(read_int(c, 1, INT32_MAX, key, &v));
      r->max_new = (int32_t)v;
      break;
    }
    skip_ws(c);
    if (*c->s == ',') {
      c->s++;
      continue;
    }
    if (*c->s == '}') {
      c->s++;
      break;
    }
    return bad_line(c, "want ',' or '}'");
  }
  skip_ws(c);
  if (*c->s != '\n' && *c->s != '\0')
    return bad_line(c, "text after the object");
  if (!seen[K_ARRIVAL])
    return bad_line(c, "\"arrival\" is required");
  if (seen[K_PROMPT] == seen[K_PROMPT_LEN])
    return bad_line(c, "give exactly one of \"prompt\" and \"prompt_len\"");
  if (seen[K_SEED] && !seen[K_PROMPT_LEN])
    return bad_line(c, "\"seed\" goes with \"prompt_len\"");
  if (r->max_new < 1)
    return bad_line(c, "\"max_new\" is required (no default was given)");
  /* seeded prompts are made here: a few bytes of "prompt_len" must not ask for gigabytes */
  if (r->prompt_len > UPF_TRACE_MAX_TOKENS - c->tokens) {
    char msg[128];
    snprintf(msg, sizeof msg, "%lld prompt tokens up to this line: a trace holds at most %lld",
             (long long)(c->tokens + r->prompt_len), (long long)UPF_TRACE_MAX_TOKENS);
    return bad_line(c, msg);
  }
  c->tokens += r->prompt_len;
  if (seen[K_PROMPT_LEN])
    return seeded_prompt(r, (uint64_t)seed, vocab);
  return UPF_OK;
}

/* Sort keys of a trace's requests: by (id, line) for the repeat check, by (arrival, line) for the
 * order (the line breaks ties, which makes qsort stable). */
typedef struct {
  int64_t id;
  double arrival;
  int32_t index;
} trace_key;

static int cmp_id(const void *a, const void *b) {
  const trace_key *x = a, *y = b;
  return x->id != y->id ? (x->id > y->id) - (x->id < y->id) : (x->index > y->index) - (x->index < y->index);
}

static int cmp_arrival(const void *a, const void *b) {
  const trace_key *x = a, *y = b;
  return x->arrival != y->arrival ? (x->arrival > y->arrival) - (x->arrival < y->arrival)
                                  : (x->index > y->index) - (x->index < y->index);
}

upf_status upf_trace_parse_jsonl(upf_trace *t, const char *text, const char *name, int32_t vocab,
                                 int32_t default_max_new) {
  memset(t, 0, sizeof *t);
  int64_t lines = 1;
  for (const char *p = text; *p; p++)
    lines += *p == '\n';
  if (lines > UPF_TRACE_MAX_REQUESTS)
    return upf_fail(UPF_ERR_INVALID_ARG, "trace %s: %lld lines: a trace holds at most %d requests", name,
                    (long long)lines, UPF_TRACE_MAX_REQUESTS);
  t->reqs = calloc((size_t)lines, sizeof *t->reqs);
  int64_t *line_of = calloc((size_t)lines, sizeof *line_of);
  if (!t->reqs || !line_of) {
    free(line_of), free(t->reqs);
    t->reqs = NULL;
    return upf_fail(UPF_ERR_NOMEM, "trace %s: %lld lines", name, (long long)lines);
  }
  json_cursor c = {text, text, name, 1, 0};
  upf_status st = UPF_OK;
  for (; st == UPF_OK && *c.s; c.line++) {
    upf_engine_request r = {0};
    int empty;
    c.line_start = c.s;
    st = parse_line(&c, vocab, default_max_new, &r, &empty);
    if (st != UPF_OK) {
      free(r.prompt);
      break;
    }
    if (!empty) {
      line_of[t->num_reqs] = c.line;
      t->reqs[t->num_reqs++] = r;
    }
    while (*c.s && *c.s != '\n')
      c.s++;
    if (*c.s == '\n')
      c.s++;
  }
  if (st == UPF_OK && t->num_reqs == 0)
    st = upf_fail(UPF_ERR_FORMAT, "trace %s: no requests", name);
  trace_key *k = st == UPF_OK ? malloc((size_t)t->num_reqs * sizeof *k) : NULL;
  if (st == UPF_OK && !k)
    st = upf_fail(UPF_ERR_NOMEM, "trace %s: sorting", name);
  if (st == UPF_OK) {
    /* repeated ids: sorted by (id, line), a repeat sits next to its first; the earliest repeat named */
    for (int32_t i = 0; i < t->num_reqs; i++)
      k[i].id = t->reqs[i].id, k[i].arrival = 0, k[i].index = i;
    qsort(k, (size_t)t->num_reqs, sizeof *k, cmp_id);
    int32_t worst = -1;
    for (int32_t i = 1; i < t->num_reqs; i++)
      if (k[i].id == k[i - 1].id && (worst < 0 || k[i].index < k[worst].index))
        worst = i;
    if (worst >= 0)
      st = upf_fail(UPF_ERR_FORMAT, "trace %s line %lld: id %lld is also the id of line %lld", name,
                    (long long)line_of[k[worst].index], (long long)k[worst].id, (long long)line_of[k[worst - 1].index]);
  }
  if (st == UPF_OK) {
    /* a stable sort by arrival: qsort is not stable, so sort (arrival, original index) pairs */
    upf_engine_request *sorted = malloc((size_t)t->num_reqs * sizeof *sorted);
    if (!sorted)
      st = upf_fail(UPF_ERR_NOMEM, "trace %s: sorting", name);
    for (int32_t i = 0; st == UPF_OK && i < t->num_reqs; i++)
      k[i].arrival = t->reqs[i].arrival, k[i].index = i;
    if (st == UPF_OK)
      qsort(k, (size_t)t->num_reqs, sizeof *k, cmp_arrival);
    for (int32_t i = 0; st == UPF_OK && i < t->num_reqs; i++)
      sorted[i] = t->reqs[k[i].index];
    if (st == UPF_OK) {
      free(t->reqs);
      t->reqs = sorted;
    } else
      free(sorted);
  }
  free(k);
  free(line_of);
  if (st != UPF_OK)
    upf_trace_free(t);
  return st;
}

upf_status upf_trace_read_jsonl(upf_trace *t, const char *path, int32_t vocab, int32_t default_max_new) {
  memset(t, 0, sizeof *t);
  FILE *f = fopen(path, "rb");
  if (!f)
    return upf_fail(UPF_ERR_IO, "trace %s: cannot open (%s)", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (!buf)
      break;
    if (n + 1 >= cap) {
      char *b = realloc(buf, cap *= 2);
      if (!b) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = b;
    }
    const size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0)
      break;
  }
  const int err = ferror(f) ? (errno ? errno : EIO) : 0;
  fclose(f);
  if (!buf)
    return upf_fail(UPF_ERR_NOMEM, "trace %s: reading", path);
  if (err) {
    free(buf);
    return upf_fail(UPF_ERR_IO, "trace %s: cannot read it: %s", path, strerror(err));
  }
  buf[n] = '\0';
  if (strlen(buf) != n) {
    free(buf);
    return upf_fail(UPF_ERR_FORMAT, "trace %s: holds a NUL byte (not a text file)", path);
  }
  upf_status st = upf_trace_parse_jsonl(t, buf, path, vocab, default_max_new);
  free(buf);
  return st;
}

/* --------------------------------------------------------------------------------------------- engine */

int32_t upf_engine_argmax(const float *logits, int32_t vocab) {
  int32_t best = 0;
  for (int32_t v = 0; v < vocab; v++) {
    if (isnan(logits[v]))
      return -1;
    if (logits[v] > logits[best])
      best = v;
  }
  return best;
}

void upf_engine_result_free(upf_engine_result *res) {
  for (int32_t i = 0; res->reqs && i < res->num_reqs; i++)
    free(res->reqs[i].tokens);
  free(res->reqs), free(res->steps);
  memset(res, 0, sizeof *res);
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Nearest rank: the smallest value with at least q of the values at or below it. */
static double percentile(const double *sorted, int32_t n, double q) {
  if (n == 0)
    return 0;
  int64_t k = (int64_t)ceil(q * (double)n) - 1;
  k = k < 0 ? 0 : k >= n ? n - 1 : k;
  return sorted[k];
}

static void summarise(upf_engine_result *res) {
  const int32_t n = res->num_reqs;
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  if (!v)
    return; /* the statistics stay 0; the records are whole */
  double sum = 0;
  res->start = n ? res->reqs[0].arrival : 0, res->end = res->start;
  for (int32_t i = 0; i < n; i++) {
    const upf_engine_record *r = &res->reqs[i];
    v[i] = r->ttft, sum += r->ttft;
    res->start = r->arrival < res->start ? r->arrival : res->start;
    res->end = r->finished > res->end ? r->finished : res->end;
    res->prompt_tokens += r->prompt_len, res->output_tokens += r->num_generated;
  }
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  const double q[3] = {0.5, 0.9, 0.99};
  for (int k = 0; k < 3; k++)
    res->ttft_p[k] = percentile(v, n, q[k]);
  res->ttft_mean = n ? sum / n : 0;
  int32_t m = 0;
  sum = 0;
  for (int32_t i = 0; i < n; i++)
    if (res->reqs[i].num_generated >= 2)
      v[m++] = res->reqs[i].tpot, sum += res->reqs[i].tpot;
  qsort(v, (size_t)m, sizeof *v, cmp_double);
  for (int k = 0; k < 3; k++)
    res->tpot_p[k] = percentile(v, m, q[k]);
  res->tpot_mean = m ? sum / m : 0;
  free(v);
  const double span = res->end - res->start;
  if (span > 0) {
    res->output_tokens_per_s = (double)res->output_tokens / span;
    res->total_tokens_per_s = (double)(res->output_tokens + res->prompt_tokens) / span;
  }
  res->kv_saved_bytes = res->kv_dense_bytes_peak - res->kv_bytes_peak;
  res->kv_saved_share = res->kv_dense_bytes_peak > 0 ? res->kv_saved_bytes / res->kv_dense_bytes_peak : 0;
}

typedef struct {
  int64_t *free_pages; /* (groups) what admission may still take this step */
  int32_t *running; /* (num_reqs) indices of the running requests in admission order */
  int32_t num_running;
  int32_t *prefilled; /* (num_reqs) prompt tokens prefilled so far (chunked prefill) */
  upf_engine_row *rows;
  float *logits;    /* (rows, vocab) */
  int32_t rows_cap;
} engine_state;

static upf_status grow_rows(engine_state *s, int32_t need, int32_t vocab) {
  if (need <= s->rows_cap)
    return UPF_OK;
  int32_t cap = s->rows_cap ? s->rows_cap : 16;
  while (cap < need)
    cap *= 2;
  upf_engine_row *rows = realloc(s->rows, (size_t)cap * sizeof *rows);
  if (rows)
    s->rows = rows;
  float *logits = rows ? realloc(s->logits, (size_t)cap * vocab * sizeof *logits) : NULL;
  if (!logits)
    return upf_fail(UPF_ERR_NOMEM, "engine: %d rows of %d logits", cap, vocab);
  s->logits = logits, s->rows_cap = cap;
  return UPF_OK;
}

/* A request's worst case in every group: its dense pages for the prompt and every token it may feed back
 * (the last generated token is never fed). */
static int64_t worst_pages(const upf_engine_ops *ops, const upf_engine_request *r) {
  return ops->pages_for(ops->ctx, (int64_t)r->prompt_len + r->max_new - 1);
}

/* The prefill row of request i over prompt tokens [start, start + n). */
static upf_engine_row prefill_row(const upf_trace *tr, int32_t i, int32_t start, int32_t n) {
  const upf_engine_request *r = &tr->reqs[i];
  return (upf_engine_row){i, 1, n, r->prompt + start, start, r->prompt_len};
}

static upf_status run_loop(const upf_engine_ops *ops, const upf_trace *tr, const upf_engine_options *opt,
                           engine_state *s, upf_engine_result *res) {
  const int32_t N = tr->num_reqs, V = ops->vocab, G = ops->num_groups;
  const int64_t C = opt->chunk; /* 0: whole prompts */
  int32_t next_wait = 0; /* requests before it are admitted (FCFS: admission follows trace order) */
  int32_t done = 0;
  int64_t steps_cap = 0;
  double clock = tr->reqs[0].arrival;
  double sum_prefill_rows = 0, sum_decode_rows = 0, sum_prefill_tokens = 0;
  while (done < N) {
    if (s->num_running == 0 && next_wait < N && tr->reqs[next_wait].arrival > clock)
      clock = tr->reqs[next_wait].arrival;
    /* decode rows: every running request's last token; the pages each may still append (a request
     * still prefilling: the rest of its prompt, then its tokens) */
    int32_t n = 0;
    int64_t tokens = 0;
    UPF_TRY(grow_rows(s, s->num_running + 1, V));
    for (int32_t g = 0; g < G; g++)
      s->free_pages[g] = ops->pages_free(ops->ctx, g);
    for (int32_t k = 0; k < s->num_running; k++) {
      const int32_t i = s->running[k];
      upf_engine_record *rec = &res->reqs[i];
      const int64_t left = (int64_t)tr->reqs[i].prompt_len - s->prefilled[i] + rec->max_new - 1 -
                           (rec->num_generated > 0 ? rec->num_generated - 1 : 0);
      for (int32_t g = 0; g < G; g++)
        s->free_pages[g] -= ops->pages_append(ops->ctx, i, g, left);
      if (rec->num_generated == 0)
        continue; /* still prefilling: its next chunk comes after the decode rows */
      s->rows[n++] = (upf_engine_row){i, 0, 1, &rec->tokens[rec->num_generated - 1], 0, 0};
      tokens++;
    }
    int32_t decode_rows = n;
    /* chunked prefill: the next chunk of each request still prefilling, in admission order, within the
     * budget the decode rows left */
    for (int32_t k = 0; C > 0 && k < s->num_running && tokens < opt->token_budget; k++) {
      const int32_t i = s->running[k];
      if (res->reqs[i].num_generated > 0)
        continue;
      int64_t len = tr->reqs[i].prompt_len - s->prefilled[i];
      len = len < C ? len : C;
      len = len < opt->token_budget - tokens ? len : opt->token_budget - tokens;
      s->rows[n++] = prefill_row(tr, i, s->prefilled[i], (int32_t)len);
      tokens += len;
    }
    /* admissions, first come first served */
    while (next_wait < N && tr->reqs[next_wait].arrival <= clock) {
      const upf_engine_request *r = &tr->reqs[next_wait];
      const int alone = !C && r->prompt_len > opt->token_budget;
      int64_t len = r->prompt_len;
      if (C) { /* a first chunk: what the budget and the chunk size allow */
        len = len < C ? len : C;
        len = len < opt->token_budget - tokens ? len : opt->token_budget - tokens;
        if (len < 1)
          break;
      } else if (alone ? n > decode_rows : tokens + r->prompt_len > opt->token_budget) {
        break; /* a longer prompt goes first in a step of its own, not after this step's admissions */
      }
      if (ops->max_live > 0 && s->num_running >= ops->max_live)
        break;
      const int64_t need = worst_pages(ops, r);
      int fits = 1;
      for (int32_t g = 0; g < G; g++)
        fits &= need <= s->free_pages[g];
      if (!fits)
        break;
      if (alone) { /* the decodes pause for this step (prefill first, as vLLM schedules without chunks) */
        n = decode_rows = 0;
        tokens = 0;
      }
      UPF_TRY(grow_rows(s, n + 1, V));
      s->rows[n++] = prefill_row(tr, next_wait, 0, (int32_t)len);
      tokens += len;
      for (int32_t g = 0; g < G; g++)
        s->free_pages[g] -= need;
      s->running[s->num_running++] = next_wait;
      res->reqs[next_wait].admitted = clock, res->reqs[next_wait].admit_step = res->num_steps;
      next_wait++;
      if (alone)
        break;
    }
    if (n == 0)
      return upf_fail(UPF_ERR_INVALID_ARG, "engine: step %lld has no row (request %lld waits for pages it cannot get)",
                      (long long)res->num_steps, (long long)tr->reqs[next_wait].id);
    double seconds = 0;
    upf_status st = ops->step(ops->ctx, s->rows, n, s->logits, &seconds);
    if (st != UPF_OK) {
      char ctx[96];
      snprintf(ctx, sizeof ctx, "engine step %lld (%d prefill, %d decode rows): ", (long long)res->num_steps,
               n - decode_rows, decode_rows);
      return upf_fail_context(st, ctx);
    }
    const double start = clock;
    clock += seconds;
    res->busy_seconds += seconds;
    /* sample, record: a prefill row gives the request's first token only when it ends the prompt */
    int32_t chunk_rows = 0;
    for (int32_t k = 0; k < n; k++) {
      const upf_engine_row *w = &s->rows[k];
      const int32_t i = w->req;
      upf_engine_record *rec = &res->reqs[i];
      if (w->prefill) {
        rec->num_chunks++;
        chunk_rows += w->num_tokens < w->prompt_len;
        s->prefilled[i] = w->start + w->num_tokens;
        if (s->prefilled[i] < w->prompt_len)
          continue;
      }
      const int32_t tok = upf_engine_argmax(s->logits + (int64_t)k * V, V);
      if (tok < 0)
        return upf_fail(UPF_ERR_NONFINITE, "engine step %lld: request %lld's logits hold NaN",
                        (long long)res->num_steps, (long long)rec->id);
      rec->tokens[rec->num_generated++] = tok;
      if (w->prefill) {
        rec->first_token = clock;
        rec->pages_after_prefill = ops->pages_of(ops->ctx, i);
        rec->dense_pages_after_prefill = (int64_t)G * ops->pages_for(ops->ctx, rec->prompt_len);
      }
    }
    /* KV memory after the step, before the finished requests release */
    upf_engine_memory mem;
    ops->memory(ops->ctx, &mem);
    res->pages_peak = mem.pages_in_use > res->pages_peak ? mem.pages_in_use : res->pages_peak;
    res->pages_dense_peak = mem.pages_dense > res->pages_dense_peak ? mem.pages_dense : res->pages_dense_peak;
    res->kv_bytes_peak = mem.bytes_in_use > res->kv_bytes_peak ? mem.bytes_in_use : res->kv_bytes_peak;
    res->kv_dense_bytes_peak = mem.bytes_dense > res->kv_dense_bytes_peak ? mem.bytes_dense : res->kv_dense_bytes_peak;
    res->kv_bytes_capacity = mem.bytes_capacity;
    if (opt->keep_steps) {
      if (res->num_steps == steps_cap) {
        steps_cap = steps_cap ? 2 * steps_cap : 64;
        upf_engine_step_record *sr = realloc(res->steps, (size_t)steps_cap * sizeof *sr);
        if (!sr)
          return upf_fail(UPF_ERR_NOMEM, "engine: step records");
        res->steps = sr;
      }
      res->steps[res->num_steps] = (upf_engine_step_record){start, seconds, n - decode_rows, decode_rows,
                                                            tokens - decode_rows, s->num_running, mem.pages_in_use,
                                                            mem.pages_dense, chunk_rows};
    }
    sum_prefill_rows += n - decode_rows, sum_decode_rows += decode_rows;
    sum_prefill_tokens += (double)(tokens - decode_rows);
    res->max_running = s->num_running > res->max_running ? s->num_running : res->max_running;
    /* finish and release, keeping the running list in admission order */
    int32_t kept = 0;
    for (int32_t k = 0; k < s->num_running; k++) {
      const int32_t i = s->running[k];
      upf_engine_record *rec = &res->reqs[i];
      const int finished = rec->num_generated > 0 &&
                           (rec->num_generated == rec->max_new ||
                            (opt->eos >= 0 && rec->tokens[rec->num_generated - 1] == opt->eos));
      if (!finished) {
        s->running[kept++] = i;
        continue;
      }
      st = ops->release(ops->ctx, i);
      if (st != UPF_OK) {
        /* the ones not looked at yet still hold their state: the caller releases them */
        for (int32_t j = k + 1; j < s->num_running; j++)
          s->running[kept++] = s->running[j];
        s->num_running = kept;
        return upf_fail_context(st, "engine: releasing a finished request: ");
      }
      rec->finished = clock, rec->finish_step = res->num_steps;
      rec->ttft = rec->first_token - rec->arrival;
      rec->tpot = rec->num_generated > 1 ? (rec->finished - rec->first_token) / (rec->num_generated - 1) : 0;
      done++;
    }
    s->num_running = kept;
    res->num_steps++;
  }
  res->mean_prefill_rows = sum_prefill_rows / (double)res->num_steps;
  res->mean_decode_rows = sum_decode_rows / (double)res->num_steps;
  res->mean_prefill_tokens = sum_prefill_tokens / (double)res->num_steps;
  return UPF_OK;
}

upf_status upf_engine_run(const upf_engine_ops *ops, const upf_trace *tr, const upf_engine_options *opt,
                          upf_engine_result *res) {
  memset(res, 0, sizeof *res);
  if (opt->token_budget < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "engine: token budget %lld: want >= 1", (long long)opt->token_budget);
  if (opt->chunk < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "engine: chunk %d: want 0 (whole prompts) or >= 1 tokens", opt->chunk);
  if (tr->num_reqs < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "engine: the trace holds no request");
  if (opt->eos >= ops->vocab)
    return upf_fail(UPF_ERR_INVALID_ARG, "engine: eos %d is outside the vocabulary [0, %d)", opt->eos, ops->vocab);
  for (int32_t i = 0; i < tr->num_reqs; i++) {
    const upf_engine_request *r = &tr->reqs[i];
    if (r->prompt_len < 1 || r->max_new < 1 || !r->prompt || !(r->arrival >= 0) || !isfinite(r->arrival) ||
        (i > 0 && r->arrival < tr->reqs[i - 1].arrival))
      return upf_fail(UPF_ERR_INVALID_ARG, "engine: request %lld: prompt %d tokens, max_new %d, arrival %g (want "
                      ">= 1, >= 1, finite, >= 0 and in arrival order)", (long long)r->id, r->prompt_len, r->max_new,
                      r->arrival);
    for (int32_t t = 0; t < r->prompt_len; t++)
      if (r->prompt[t] < 0 || r->prompt[t] >= ops->vocab)
        return upf_fail(UPF_ERR_INVALID_ARG, "engine: request %lld: token %d at %d is outside the vocabulary [0, %d)",
                        (long long)r->id, r->prompt[t], t, ops->vocab);
    const int64_t need = worst_pages(ops, r);
    for (int32_t g = 0; g < ops->num_groups; g++)
      if (need > ops->pages_free(ops->ctx, g))
        return upf_fail(UPF_ERR_INVALID_ARG, "engine: request %lld (%d prompt + %d new tokens) needs up to %lld KV "
                        "pages in cache group %d, which has %lld free: it could never run", (long long)r->id,
                        r->prompt_len, r->max_new, (long long)need, g, (long long)ops->pages_free(ops->ctx, g));
  }
  res->num_reqs = tr->num_reqs;
  res->reqs = calloc((size_t)tr->num_reqs, sizeof *res->reqs);
  engine_state s = {0};
  s.free_pages = calloc((size_t)(ops->num_groups > 0 ? ops->num_groups : 1), sizeof *s.free_pages);
  s.running = calloc((size_t)tr->num_reqs, sizeof *s.running);
  s.prefilled = calloc((size_t)tr->num_reqs, sizeof *s.prefilled);
  upf_status st = res->reqs && s.free_pages && s.running && s.prefilled ? UPF_OK
                                                                        : upf_fail(UPF_ERR_NOMEM, "engine: request records");
  for (int32_t i = 0; st == UPF_OK && i < tr->num_reqs; i++) {
    upf_engine_record *rec = &res->reqs[i];
    const upf_engine_request *r = &tr->reqs[i];
    rec->id = r->id, rec->prompt_len = r->prompt_len, rec->max_new = r->max_new, rec->arrival = r->arrival;
    rec->tokens = malloc((size_t)r->max_new * sizeof *rec->tokens);
    if (!rec->tokens)
      st = upf_fail(UPF_ERR_NOMEM, "engine: tokens of request %lld", (long long)r->id);
  }
  if (st == UPF_OK)
    st = run_loop(ops, tr, opt, &s, res);
  /* on failure the requests still holding state release it, so the session is reusable */
  for (int32_t k = 0; st != UPF_OK && k < s.num_running; k++)
    ops->release(ops->ctx, s.running[k]);
  free(s.free_pages), free(s.running), free(s.prefilled), free(s.rows), free(s.logits);
  if (st != UPF_OK) {
    upf_engine_result_free(res);
    return st;
  }
  summarise(res);
  return UPF_OK;
}

/* ------------------------------------------------------------------------------ the ops over a session */

typedef struct {
  upf_session *s;
  int32_t num_reqs, page;
  int32_t *sid;          /* (num_reqs) the session's id of each trace request, -1 before its prefill */
  int32_t num_groups;
  int32_t group_layer[UPF_SESSION_MAX_GROUPS]; /* an attention layer of each group, -1 if it has none */
  upf_session_row *rows; /* (rows_cap) */
  int32_t *order;        /* (rows_cap) the engine row of each session row */
  int32_t rows_cap;
  int32_t vocab;
  double wall;
  int64_t sparse_kept, sparse_visible; /* FlashPrefill: key blocks over every step's sparse layers */
} session_ctx;

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static upf_status session_step(void *ctx, const upf_engine_row *rows, int32_t n, float *logits, double *seconds) {
  session_ctx *c = ctx;
  if (n > c->rows_cap) {
    upf_session_row *r = realloc(c->rows, (size_t)n * sizeof *r);
    if (r)
      c->rows = r;
    int32_t *o = r ? realloc(c->order, (size_t)n * sizeof *o) : NULL;
    if (!o)
      return upf_fail(UPF_ERR_NOMEM, "engine: %d session rows", n);
    c->order = o, c->rows_cap = n;
  }
  /* the session packs whole-prompt rows, then chunks, then decode rows: order[j] is the engine row of
   * session row j; a row that starts its prompt registers the request with the whole prompt */
  int32_t j = 0;
  for (int pass = 0; pass < 3; pass++)
    for (int32_t k = 0; k < n; k++) {
      const upf_engine_row *w = &rows[k];
      const int32_t prompt_len = w->prompt_len > 0 ? w->prompt_len : w->num_tokens;
      const int whole = w->prefill && w->start == 0 && w->num_tokens == prompt_len;
      if ((whole ? 0 : w->prefill ? 1 : 2) != pass)
        continue;
      const int starts = w->prefill && w->start == 0;
      if (w->req < 0 || w->req >= c->num_reqs || (starts != (c->sid[w->req] < 0)))
        return upf_fail(UPF_ERR_INVALID_ARG, "engine: row %d: request %d %s", k, w->req,
                        starts ? "is already registered" : w->prefill ? "has no first chunk" : "has no prefill");
      if (starts)
        UPF_TRY(upf_session_add_request(c->s, w->ids, prompt_len, &c->sid[w->req]));
      c->order[j] = k;
      c->rows[j] = (upf_session_row){c->sid[w->req], w->prefill ? UPF_ROW_PREFILL : UPF_ROW_DECODE,
                                     w->prefill ? 0 : w->ids[0], whole ? 0 : w->num_tokens};
      j++;
    }
  upf_prefill_result res;
  const double t0 = wall_now();
  upf_status st = upf_session_step(c->s, c->rows, n, NULL, &res);
  c->wall += wall_now() - t0;
  if (st != UPF_OK)
    return st;
  if (res.num_reqs != n || res.vocab != c->vocab) {
    upf_prefill_result_free(&res);
    return upf_fail(UPF_ERR_SHAPE, "engine: the step returned %d rows of %d logits for %d rows of %d", res.num_reqs,
                    res.vocab, n, c->vocab);
  }
  for (int32_t k = 0; k < n; k++)
    memcpy(logits + (int64_t)c->order[k] * c->vocab, res.logits + (int64_t)k * c->vocab, (size_t)c->vocab * sizeof *logits);
  *seconds = res.total_seconds;
  for (int32_t i = 0; i < res.num_sparse; i++)
    c->sparse_kept += res.sparse[i].kept_blocks, c->sparse_visible += res.sparse[i].visible_blocks;
  upf_prefill_result_free(&res);
  return UPF_OK;
}

static upf_status session_release(void *ctx, int32_t req) {
  session_ctx *c = ctx;
  if (req < 0 || req >= c->num_reqs || c->sid[req] < 0)
    return UPF_OK; /* admitted in a step that failed before it registered: nothing held */
  const upf_status st = upf_session_release(c->s, c->sid[req]);
  c->sid[req] = -1;
  return st;
}

static int64_t session_pages_free(void *ctx, int32_t g) {
  const session_ctx *c = ctx;
  return c->group_layer[g] < 0 ? INT64_MAX / 4 : upf_session_pages_free(c->s, g);
}

static int64_t session_pages_for(void *ctx, int64_t tokens) {
  return upf_session_pages_for(((session_ctx *)ctx)->s, tokens);
}

/* kv_len of the request in group g (0 for a group without attention layers or an unknown request). */
static int64_t session_len(const session_ctx *c, int32_t req, int32_t g) {
  int64_t len = 0;
  if (c->group_layer[g] < 0 || c->sid[req] < 0 ||
      upf_session_kv_len(c->s, c->sid[req], c->group_layer[g], &len) != UPF_OK)
    return 0;
  return len;
}

static int64_t session_pages_append(void *ctx, int32_t req, int32_t g, int64_t tokens) {
  const session_ctx *c = ctx;
  if (c->group_layer[g] < 0)
    return 0;
  const int64_t len = session_len(c, req, g), P = c->page;
  return (len + tokens + P - 1) / P - (len + P - 1) / P;
}

static int64_t session_pages_of(void *ctx, int32_t req) {
  const session_ctx *c = ctx;
  int64_t pages = 0;
  for (int32_t g = 0; g < c->num_groups; g++)
    pages += (session_len(c, req, g) + c->page - 1) / c->page;
  return pages;
}

static void session_memory(void *ctx, upf_engine_memory *mem) {
  upf_session_memory m;
  upf_session_memory_usage(((session_ctx *)ctx)->s, &m);
  mem->pages_in_use = m.pages_in_use, mem->pages_dense = m.pages_dense;
  mem->bytes_in_use = m.bytes_in_use, mem->bytes_dense = m.bytes_dense, mem->bytes_capacity = m.bytes_capacity;
}

upf_status upf_engine_session_ops(upf_session *s, const upf_model *m, int32_t max_requests, int32_t num_reqs,
                                  upf_engine_ops *ops) {
  memset(ops, 0, sizeof *ops);
  session_ctx *c = calloc(1, sizeof *c);
  if (!c || num_reqs < 1 || !(c->sid = malloc((size_t)num_reqs * sizeof *c->sid))) {
    free(c);
    return num_reqs < 1 ? upf_fail(UPF_ERR_INVALID_ARG, "engine: %d requests", num_reqs)
                        : upf_fail(UPF_ERR_NOMEM, "engine: session ops for %d requests", num_reqs);
  }
  for (int32_t i = 0; i < num_reqs; i++)
    c->sid[i] = -1;
  c->s = s, c->num_reqs = num_reqs, c->page = upf_session_page_size(s), c->vocab = m->cfg->vocab;
  c->num_groups = upf_session_num_groups(s);
  for (int32_t g = 0; g < c->num_groups; g++)
    c->group_layer[g] = -1;
  for (int32_t l = m->layer_begin; l < m->layer_end; l++) {
    const int32_t g = upf_session_group_of_layer(s, l);
    if (g >= 0 && g < c->num_groups && c->group_layer[g] < 0)
      c->group_layer[g] = l;
  }
  *ops = (upf_engine_ops){c, c->vocab, c->num_groups, max_requests, session_step, session_release,
                          session_pages_free, session_pages_for, session_pages_append, session_pages_of,
                          session_memory};
  return UPF_OK;
}

void upf_engine_session_ops_free(upf_engine_ops *ops) {
  session_ctx *c = ops->ctx;
  if (c) {
    free(c->sid), free(c->rows), free(c->order);
    free(c);
  }
  memset(ops, 0, sizeof *ops);
}

double upf_engine_session_wall_seconds(const upf_engine_ops *ops) { return ((const session_ctx *)ops->ctx)->wall; }

void upf_engine_session_sparse_blocks(const upf_engine_ops *ops, int64_t *kept, int64_t *visible) {
  const session_ctx *c = ops->ctx;
  *kept = c->sparse_kept, *visible = c->sparse_visible;
}
