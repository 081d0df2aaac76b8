/* The tokenizer core: the vocabulary and merge tables (open-addressing hash tables over the token
 * texts), special tokens split out of the text, byte-level BPE and SentencePiece encoding, and
 * decoding, each following llama.cpp's llama-vocab.cpp step by step so that the ids agree with the
 * implementation the GGUF files are made for. */
#define _GNU_SOURCE /* memmem */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/tokenizer_internal.h"

/* llama.cpp's token attributes (llama_token_attr), one bit each. */
enum {
  ATTR_UNKNOWN = 1 << 0,
  ATTR_UNUSED = 1 << 1,
  ATTR_NORMAL = 1 << 2,
  ATTR_CONTROL = 1 << 3,
  ATTR_USER_DEFINED = 1 << 4,
  ATTR_BYTE = 1 << 5,
};

typedef struct {
  int32_t *slot; /* (mask + 1) entry index or -1 */
  uint64_t mask;
} hash_index;

struct upf_tokenizer {
  upf_tokenizer_model model;
  upf_tokenizer_pre pre;
  int32_t n_tokens;
  char *text;     /* every token text, each followed by a NUL */
  int64_t *off;   /* (n_tokens) offset of token i's text in `text` */
  int32_t *len;   /* (n_tokens) its byte length */
  float *score;   /* (n_tokens) */
  uint8_t *type;  /* (n_tokens) upf_token_type */
  uint8_t *attr;  /* (n_tokens) ATTR_* bits */
  hash_index tokens;
  int64_t n_merges;
  char *merge_text;   /* every merge string, each followed by a NUL */
  int64_t *merge_off; /* (n_merges) offset of merge i's left part; its right part follows one space later */
  int32_t *merge_l;   /* (n_merges) byte length of the left part (0 when the merge has no space) */
  int32_t *merge_r;   /* (n_merges) byte length of the right part */
  hash_index merges;
  int32_t *special; /* (n_special) control, user-defined and unknown ids, longest text first */
  int32_t n_special;
  int32_t bos, eos, unk, pad;
  int add_bos, add_eos, add_space_prefix, clean_spaces;
  int32_t byte_token[256]; /* SPM byte fallback: <0xXX>, else the one-byte text, else -1 */
  uint8_t byte_enc[256][2]; /* BPE: each byte as the UTF-8 of its GPT-2 printable codepoint */
  uint8_t byte_enc_len[256];
};

static uint32_t byte_to_cpt(uint8_t b);

/* ---- small helpers ---- */

static uint64_t fnv(uint64_t h, const void *p, int64_t n) {
  const uint8_t *b = p;
  for (int64_t i = 0; i < n; i++)
    h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}
#define FNV_BASIS 0xcbf29ce484222325ull

static uint64_t pair_hash(const char *l, int64_t ln, const char *r, int64_t rn) {
  uint64_t h = fnv(FNV_BASIS, l, ln);
  h = (h ^ 0x1ff) * 0x100000001b3ull; /* separates ("ab","c") from ("a","bc") */
  return fnv(h, r, rn);
}

static upf_status hash_init(hash_index *h, int64_t n, const char *what) {
  uint64_t cap = 16;
  while (cap < (uint64_t)n * 2)
    cap <<= 1;
  h->slot = malloc(cap * sizeof *h->slot);
  if (!h->slot)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: %s hash table of %llu slots", what, (unsigned long long)cap);
  memset(h->slot, 0xff, cap * sizeof *h->slot);
  h->mask = cap - 1;
  return UPF_OK;
}

typedef struct {
  int32_t *v;
  int64_t n, cap;
} ids_vec;

static upf_status ids_push(ids_vec *o, int32_t id) {
  if (o->n == o->cap) {
    int64_t cap = o->cap ? o->cap * 2 : 64;
    int32_t *v = realloc(o->v, (size_t)cap * sizeof *v);
    if (!v)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: output of %lld ids", (long long)cap);
    o->v = v, o->cap = cap;
  }
  o->v[o->n++] = id;
  return UPF_OK;
}

typedef struct {
  char *p;
  int64_t n, cap;
} bytes_vec;

static upf_status bytes_put(bytes_vec *b, const void *src, int64_t n) {
  if (b->n + n + 1 > b->cap) {
    int64_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1)
      cap *= 2;
    char *p = realloc(b->p, (size_t)cap);
    if (!p)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: text of %lld bytes", (long long)cap);
    b->p = p, b->cap = cap;
  }
  memcpy(b->p + b->n, src, (size_t)n);
  b->n += n;
  b->p[b->n] = 0;
  return UPF_OK;
}

/* ---- lookups ---- */

int32_t upf_tokenizer_find(const upf_tokenizer *t, const char *s, int64_t n) {
  uint64_t i = fnv(FNV_BASIS, s, n) & t->tokens.mask;
  for (;; i = (i + 1) & t->tokens.mask) {
    int32_t id = t->tokens.slot[i];
    if (id < 0)
      return -1;
    if (t->len[id] == n && !memcmp(t->text + t->off[id], s, (size_t)n))
      return id;
  }
}

static int32_t merge_rank(const upf_tokenizer *t, const char *l, int64_t ln, const char *r, int64_t rn) {
  if (!t->n_merges)
    return -1;
  uint64_t i = pair_hash(l, ln, r, rn) & t->merges.mask;
  for (;; i = (i + 1) & t->merges.mask) {
    int32_t m = t->merges.slot[i];
    if (m < 0)
      return -1;
    const char *ml = t->merge_text + t->merge_off[m];
    if (t->merge_l[m] == ln && t->merge_r[m] == rn && !memcmp(ml, l, (size_t)ln) &&
        !memcmp(ml + ln + (ln || rn ? 1 : 0), r, (size_t)rn))
      return m;
  }
}

/* ---- construction ---- */

static uint8_t attr_of_type(int32_t type) {
  switch (type) {
  case UPF_TOKEN_UNKNOWN: return ATTR_UNKNOWN;
  case UPF_TOKEN_UNUSED: return ATTR_UNUSED;
  case UPF_TOKEN_NORMAL: return ATTR_NORMAL;
  case UPF_TOKEN_CONTROL: return ATTR_CONTROL;
  case UPF_TOKEN_USER_DEFINED: return ATTR_USER_DEFINED;
  case UPF_TOKEN_BYTE: return ATTR_BYTE;
  default: return 0; /* undefined */
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static upf_status check_id(int32_t id, int32_t n, const char *name) {
  if (id < -1 || id >= n)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: %s = %d is outside [0, %d) (use -1 for none)", name, id, n);
  return UPF_OK;
}

static upf_status build(const upf_tokenizer_vocab *v, upf_tokenizer *t) {
  int32_t n = v->n_tokens;
  if (v->model != UPF_TOKENIZER_BPE && v->model != UPF_TOKENIZER_SPM)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: model %d is neither BPE nor SPM", (int)v->model);
  if (v->model == UPF_TOKENIZER_BPE && v->pre != UPF_TOKENIZER_PRE_GPT2 && v->pre != UPF_TOKENIZER_PRE_SMOLLM)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: a BPE model needs a pre-tokenizer (gpt2 or smollm), got %d",
                    (int)v->pre);
  if (v->model == UPF_TOKENIZER_SPM && v->pre != UPF_TOKENIZER_PRE_NONE)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: an SPM model takes no pre-tokenizer, got %d", (int)v->pre);
  if (n < 1 || !v->tokens)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: n_tokens = %d (tokens %s)", n, v->tokens ? "given" : "NULL");
  if (v->n_merges < 0 || (v->n_merges > 0 && !v->merges))
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: n_merges = %lld with merges %s", (long long)v->n_merges,
                    v->merges ? "given" : "NULL");
  if (v->model == UPF_TOKENIZER_SPM && v->n_merges)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: an SPM model has scores, not merges (n_merges = %lld)",
                    (long long)v->n_merges);
  UPF_TRY(check_id(v->bos_id, n, "bos_id"));
  UPF_TRY(check_id(v->eos_id, n, "eos_id"));
  UPF_TRY(check_id(v->unk_id, n, "unk_id"));
  UPF_TRY(check_id(v->pad_id, n, "pad_id"));
  if (v->add_bos && v->bos_id < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: add_bos is set but the vocabulary has no BOS");
  if (v->add_eos && v->eos_id < 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: add_eos is set but the vocabulary has no EOS");
  t->model = v->model, t->pre = v->pre, t->n_tokens = n;
  t->bos = v->bos_id, t->eos = v->eos_id, t->unk = v->unk_id, t->pad = v->pad_id;
  t->add_bos = !!v->add_bos, t->add_eos = !!v->add_eos;
  t->add_space_prefix = !!v->add_space_prefix; /* encode uses it for SPM only, decode for both */
  t->clean_spaces = v->model == UPF_TOKENIZER_BPE && v->clean_spaces;

  /* texts */
  int64_t total = 0;
  for (int32_t i = 0; i < n; i++) {
    if (!v->tokens[i])
      return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: tokens[%d] is NULL", i);
    int64_t l = v->token_lens ? v->token_lens[i] : (int64_t)strlen(v->tokens[i]);
    if (l < 0 || l > INT32_MAX / 2)
      return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: tokens[%d] has length %lld", i, (long long)l);
    total += (l ? l : 24) + 1;
  }
  t->text = malloc((size_t)total);
  t->off = malloc((size_t)n * sizeof *t->off);
  t->len = malloc((size_t)n * sizeof *t->len);
  t->score = malloc((size_t)n * sizeof *t->score);
  t->type = malloc((size_t)n);
  t->attr = malloc((size_t)n);
  if (!t->text || !t->off || !t->len || !t->score || !t->type || !t->attr)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: vocabulary of %d tokens (%lld bytes of text)", n, (long long)total);
  UPF_TRY(hash_init(&t->tokens, n, "token"));
  int64_t pos = 0;
  for (int32_t i = 0; i < n; i++) {
    int64_t l = v->token_lens ? v->token_lens[i] : (int64_t)strlen(v->tokens[i]);
    t->off[i] = pos;
    if (l == 0) /* llama.cpp's name for an empty entry, which no text could match */
      l = snprintf(t->text + pos, 24, "[EMPTY_%d]", i);
    else
      memcpy(t->text + pos, v->tokens[i], (size_t)l);
    t->text[pos + l] = 0;
    t->len[i] = (int32_t)l;
    pos += l + 1;
    t->score[i] = v->scores ? v->scores[i] : 0.0f;
    int32_t ty = v->types ? v->types[i] : UPF_TOKEN_NORMAL;
    t->type[i] = (uint8_t)(ty >= 0 && ty <= UPF_TOKEN_BYTE ? ty : UPF_TOKEN_UNDEFINED);
    t->attr[i] = attr_of_type(ty);
    const char *s = t->text + t->off[i];
    uint64_t h = fnv(FNV_BASIS, s, l) & t->tokens.mask;
    for (;; h = (h + 1) & t->tokens.mask) {
      int32_t o = t->tokens.slot[h];
      if (o < 0) {
        t->tokens.slot[h] = i;
        break;
      }
      if (t->len[o] == l && !memcmp(t->text + t->off[o], s, (size_t)l))
        return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: duplicate token text: tokens[%d] and tokens[%d] are both \"%.40s\"",
                        o, i, s);
    }
  }

  /* merges: "left right", split at the first space after the first byte; the first of two equal
   * pairs keeps its rank (llama.cpp's bpe_ranks.emplace) */
  t->n_merges = v->n_merges;
  if (t->n_merges) {
    int64_t mtotal = 0;
    for (int64_t i = 0; i < t->n_merges; i++) {
      if (!v->merges[i])
        return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: merges[%lld] is NULL", (long long)i);
      mtotal += (int64_t)strlen(v->merges[i]) + 1;
    }
    t->merge_text = malloc((size_t)mtotal);
    t->merge_off = malloc((size_t)t->n_merges * sizeof *t->merge_off);
    t->merge_l = malloc((size_t)t->n_merges * sizeof *t->merge_l);
    t->merge_r = malloc((size_t)t->n_merges * sizeof *t->merge_r);
    if (!t->merge_text || !t->merge_off || !t->merge_l || !t->merge_r)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: %lld merges", (long long)t->n_merges);
    UPF_TRY(hash_init(&t->merges, t->n_merges, "merge"));
    int64_t mpos = 0;
    for (int64_t i = 0; i < t->n_merges; i++) {
      int64_t l = (int64_t)strlen(v->merges[i]);
      memcpy(t->merge_text + mpos, v->merges[i], (size_t)l + 1);
      const char *sp = l > 1 ? memchr(v->merges[i] + 1, ' ', (size_t)l - 1) : NULL;
      t->merge_off[i] = mpos;
      t->merge_l[i] = sp ? (int32_t)(sp - v->merges[i]) : 0;
      t->merge_r[i] = sp ? (int32_t)(l - t->merge_l[i] - 1) : 0;
      mpos += l + 1;
      const char *ml = t->merge_text + t->merge_off[i];
      int64_t ln = t->merge_l[i], rn = t->merge_r[i];
      if (merge_rank(t, ml, ln, ml + ln + (ln || rn ? 1 : 0), rn) >= 0)
        continue;
      uint64_t h = pair_hash(ml, ln, ml + ln + (ln || rn ? 1 : 0), rn) & t->merges.mask;
      while (t->merges.slot[h] >= 0)
        h = (h + 1) & t->merges.mask;
      t->merges.slot[h] = (int32_t)i;
    }
  }

  /* special tokens, longest first (ties by id, so the order is reproducible) */
  uint64_t *key = malloc((size_t)n * sizeof *key); /* (INT32_MAX - length, id): sorts longest first */
  t->special = malloc((size_t)n * sizeof *t->special);
  if (!t->special || !key) {
    free(key);
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: special token list");
  }
  for (int32_t i = 0; i < n; i++)
    if (t->attr[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))
      key[t->n_special++] = (uint64_t)(INT32_MAX - t->len[i]) << 32 | (uint32_t)i;
  qsort(key, (size_t)t->n_special, sizeof *key, cmp_u64);
  for (int32_t k = 0; k < t->n_special; k++)
    t->special[k] = (int32_t)(key[k] & 0xffffffffu);
  free(key);
  for (int b = 0; b < 256; b++)
    t->byte_enc_len[b] = (uint8_t)upf_utf8_put(byte_to_cpt((uint8_t)b), t->byte_enc[b]);

  for (int b = 0; b < 256; b++) {
    char buf[8];
    snprintf(buf, sizeof buf, "<0x%02X>", b);
    t->byte_token[b] = upf_tokenizer_find(t, buf, 6);
    if (t->byte_token[b] < 0) {
      char one = (char)b;
      t->byte_token[b] = upf_tokenizer_find(t, &one, 1);
    }
  }
  return UPF_OK;
}

upf_status upf_tokenizer_create(const upf_tokenizer_vocab *v, upf_tokenizer **out) {
  *out = NULL;
  if (!v)
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: vocabulary is NULL");
  upf_tokenizer *t = calloc(1, sizeof *t);
  if (!t)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: handle");
  upf_status st = build(v, t);
  if (st != UPF_OK) {
    upf_tokenizer_free(t);
    return st;
  }
  *out = t;
  return UPF_OK;
}

void upf_tokenizer_free(upf_tokenizer *t) {
  if (!t)
    return;
  free(t->text), free(t->off), free(t->len), free(t->score), free(t->type), free(t->attr);
  free(t->tokens.slot);
  free(t->merge_text), free(t->merge_off), free(t->merge_l), free(t->merge_r), free(t->merges.slot);
  free(t->special);
  free(t);
}

int32_t upf_tokenizer_n_tokens(const upf_tokenizer *t) { return t->n_tokens; }
int32_t upf_tokenizer_bos(const upf_tokenizer *t) { return t->bos; }
int32_t upf_tokenizer_eos(const upf_tokenizer *t) { return t->eos; }
int upf_tokenizer_add_bos(const upf_tokenizer *t) { return t->add_bos; }
upf_tokenizer_model upf_tokenizer_model_kind(const upf_tokenizer *t) { return t->model; }

const char *upf_tokenizer_token_text(const upf_tokenizer *t, int32_t id, int64_t *len) {
  if (id < 0 || id >= t->n_tokens)
    return NULL;
  if (len)
    *len = t->len[id];
  return t->text + t->off[id];
}

upf_token_type upf_tokenizer_token_type(const upf_tokenizer *t, int32_t id) {
  return id < 0 || id >= t->n_tokens ? UPF_TOKEN_UNDEFINED : (upf_token_type)t->type[id];
}

/* ---- merging: one symbol per UTF-8 character, adjacent pairs merged best first ---- */

typedef struct {
  int32_t prev, next; /* neighbours in the chain, -1 at the ends */
  int32_t start, n;   /* bytes [start, start + n) of the text; n = 0 once merged into its left neighbour */
} symbol;

typedef struct {
  int32_t left, right;
  int32_t size; /* bytes of the pair when it was queued: a pair whose symbols changed since is stale */
  float key;    /* BPE: the merge rank (lowest first); SPM: the token score (highest first) */
} bigram;

typedef struct {
  bigram *h;
  int64_t n, cap;
  int max_first; /* SPM */
} bigram_heap;

/* a comes before b: best key first, then the leftmost pair (llama.cpp's comparators) */
static int before(const bigram_heap *q, const bigram *a, const bigram *b) {
  if (a->key != b->key)
    return q->max_first ? a->key > b->key : a->key < b->key;
  return a->left < b->left;
}

static upf_status heap_push(bigram_heap *q, bigram b) {
  if (q->n == q->cap) {
    int64_t cap = q->cap ? q->cap * 2 : 64;
    bigram *h = realloc(q->h, (size_t)cap * sizeof *h);
    if (!h)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: merge queue of %lld pairs", (long long)cap);
    q->h = h, q->cap = cap;
  }
  int64_t i = q->n++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!before(q, &b, &q->h[p]))
      break;
    q->h[i] = q->h[p];
    i = p;
  }
  q->h[i] = b;
  return UPF_OK;
}

static bigram heap_pop(bigram_heap *q) {
  bigram top = q->h[0], last = q->h[--q->n];
  int64_t i = 0;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= q->n)
      break;
    if (c + 1 < q->n && before(q, &q->h[c + 1], &q->h[c]))
      c++;
    if (!before(q, &q->h[c], &last))
      break;
    q->h[i] = q->h[c];
    i = c;
  }
  if (q->n)
    q->h[i] = last;
  return top;
}

typedef struct {
  symbol *sym;
  int64_t n, cap;
} symbol_vec;

/* Cuts text into symbols of one UTF-8 character each (by the lead byte alone, cut short at the end). */
static upf_status symbols_init(symbol_vec *s, const char *text, int64_t len) {
  if (len > s->cap) {
    symbol *p = realloc(s->sym, (size_t)len * sizeof *p);
    if (!p)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: %lld symbols", (long long)len);
    s->sym = p, s->cap = len;
  }
  s->n = 0;
  for (int64_t off = 0; off < len;) {
    int64_t l = upf_utf8_len((uint8_t)text[off]);
    if (l > len - off)
      l = len - off;
    symbol *y = &s->sym[s->n];
    y->start = (int32_t)off, y->n = (int32_t)l;
    y->prev = (int32_t)s->n - 1;
    off += l;
    y->next = off == len ? -1 : (int32_t)s->n + 1;
    s->n++;
  }
  return UPF_OK;
}

typedef struct {
  ids_vec out;
  symbol_vec sym;
  bigram_heap q;
  bytes_vec word; /* the current word or fragment, as the model sees it */
  uint32_t *cpts;
  int64_t *word_len;
  int64_t cap_cpts;
} session;

static void session_free(session *s) {
  free(s->out.v), free(s->sym.sym), free(s->q.h), free(s->word.p), free(s->cpts), free(s->word_len);
}

/* Queues the pair (l, r) when the model knows it. */
static upf_status try_pair(const upf_tokenizer *t, session *s, const char *text, int32_t l, int32_t r) {
  if (l < 0 || r < 0)
    return UPF_OK;
  const symbol *a = &s->sym.sym[l], *b = &s->sym.sym[r];
  bigram g = {.left = l, .right = r, .size = a->n + b->n};
  if (t->model == UPF_TOKENIZER_BPE) {
    int32_t rank = merge_rank(t, text + a->start, a->n, text + b->start, b->n);
    if (rank < 0)
      return UPF_OK;
    g.key = (float)rank;
  } else {
    int32_t id = upf_tokenizer_find(t, text + a->start, a->n + b->n);
    if (id < 0)
      return UPF_OK;
    g.key = t->score[id];
  }
  return heap_push(&s->q, g);
}

/* Merges the symbols of `text` best pair first until no known pair is left. */
static upf_status merge_all(const upf_tokenizer *t, session *s, const char *text, int64_t len) {
  UPF_TRY(symbols_init(&s->sym, text, len));
  s->q.n = 0;
  s->q.max_first = t->model == UPF_TOKENIZER_SPM;
  for (int32_t i = 1; i < (int32_t)s->sym.n; i++)
    UPF_TRY(try_pair(t, s, text, i - 1, i));
  while (s->q.n) {
    bigram g = heap_pop(&s->q);
    symbol *a = &s->sym.sym[g.left], *b = &s->sym.sym[g.right];
    if (a->n == 0 || b->n == 0 || a->n + b->n != g.size)
      continue;
    a->n += b->n;
    b->n = 0;
    a->next = b->next;
    if (b->next >= 0)
      s->sym.sym[b->next].prev = g.left;
    UPF_TRY(try_pair(t, s, text, a->prev, g.left));
    UPF_TRY(try_pair(t, s, text, g.left, a->next));
  }
  return UPF_OK;
}

/* GPT-2's byte <-> printable codepoint map (bytes_to_unicode): the printable Latin-1 bytes stand for
 * themselves, the other 68 map to U+0100.. in byte order. */
static uint32_t byte_to_cpt(uint8_t b) {
  if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae))
    return b;
  int k = 0;
  for (int c = 0; c < b; c++)
    k += !((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae));
  return 0x100 + (uint32_t)k;
}

static int cpt_to_byte(uint32_t cpt) {
  if (cpt < 0x100)
    return (cpt >= 0x21 && cpt <= 0x7e) || (cpt >= 0xa1 && cpt <= 0xac) || cpt >= 0xae ? (int)cpt : -1;
  if (cpt >= 0x100 + 68)
    return -1;
  int k = (int)(cpt - 0x100);
  for (int c = 0; c < 256; c++)
    if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae)) && k-- == 0)
      return c;
  return -1;
}

static upf_status grow_cpts(session *s, int64_t n) {
  if (n <= s->cap_cpts)
    return UPF_OK;
  uint32_t *c = realloc(s->cpts, (size_t)n * sizeof *c);
  if (c)
    s->cpts = c;
  int64_t *w = realloc(s->word_len, (size_t)n * sizeof *w);
  if (w)
    s->word_len = w;
  if (!c || !w)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: %lld codepoints", (long long)n);
  s->cap_cpts = n;
  return UPF_OK;
}

/* Byte-level BPE on one stretch of text (llm_tokenizer_bpe_session::tokenize). `base` is the
 * stretch's offset in the input, for messages. */
static upf_status bpe_fragment(const upf_tokenizer *t, session *s, const uint8_t *text, int64_t len, int64_t base) {
  UPF_TRY(grow_cpts(s, len));
  int64_t bad = 0;
  int64_t n = upf_utf8_decode(text, len, s->cpts, &bad);
  if (n < 0)
    return upf_fail(UPF_ERR_INVALID_ARG,
                    "tokenizer: text byte offset %lld: a 4-byte UTF-8 sequence above U+10FFFF (llama.cpp rejects it)",
                    (long long)(base + bad));
  int64_t n_words = upf_pretokenize(t->pre, s->cpts, n, s->word_len);
  if (n_words < 0)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: pre-tokenizer classes of %lld codepoints", (long long)n);
  const uint32_t *c = s->cpts;
  for (int64_t w = 0; w < n_words; c += s->word_len[w], w++) {
    s->word.n = 0;
    for (int64_t i = 0; i < s->word_len[w]; i++) {
      uint8_t u[4];
      int k = upf_utf8_put(c[i], u);
      for (int j = 0; j < k; j++)
        UPF_TRY(bytes_put(&s->word, t->byte_enc[u[j]], t->byte_enc_len[u[j]]));
    }
    UPF_TRY(merge_all(t, s, s->word.p, s->word.n));
    for (int64_t i = 0; i < s->sym.n; i++) {
      const symbol *y = &s->sym.sym[i];
      if (!y->n)
        continue;
      int32_t id = upf_tokenizer_find(t, s->word.p + y->start, y->n);
      if (id >= 0) {
        UPF_TRY(ids_push(&s->out, id));
        continue;
      }
      for (int32_t j = 0; j < y->n; j++) { /* llama.cpp's fallback: the single bytes that are tokens */
        id = upf_tokenizer_find(t, s->word.p + y->start + j, 1);
        if (id >= 0)
          UPF_TRY(ids_push(&s->out, id));
      }
    }
  }
  return UPF_OK;
}

/* SentencePiece on one stretch of text (llm_tokenizer_spm_session::tokenize), after the optional
 * space prefix and with ' ' written as U+2581. */
static upf_status spm_fragment(const upf_tokenizer *t, session *s, const char *text, int64_t len, int prefix,
                               int64_t base) {
  s->word.n = 0;
  if (prefix)
    UPF_TRY(bytes_put(&s->word, "\xe2\x96\x81", 3));
  for (int64_t i = 0; i < len;) {
    const char *sp = memchr(text + i, ' ', (size_t)(len - i));
    int64_t end = sp ? sp - text : len;
    UPF_TRY(bytes_put(&s->word, text + i, end - i));
    if (!sp)
      break;
    UPF_TRY(bytes_put(&s->word, "\xe2\x96\x81", 3));
    i = end + 1;
  }
  UPF_TRY(merge_all(t, s, s->word.p, s->word.n));
  for (int32_t i = s->sym.n ? 0 : -1; i != -1; i = s->sym.sym[i].next) {
    const symbol *y = &s->sym.sym[i];
    int32_t id = upf_tokenizer_find(t, s->word.p + y->start, y->n);
    if (id >= 0) {
      UPF_TRY(ids_push(&s->out, id));
      continue;
    }
    for (int32_t j = 0; j < y->n; j++) {
      uint8_t b = (uint8_t)s->word.p[y->start + j];
      id = t->byte_token[b] >= 0 ? t->byte_token[b] : t->unk;
      if (id < 0)
        return upf_fail(UPF_ERR_INVALID_ARG,
                        "tokenizer: text near byte offset %lld: byte 0x%02X has no token (no <0x%02X>, no unknown token)",
                        (long long)base, b, b);
      UPF_TRY(ids_push(&s->out, id));
    }
  }
  return UPF_OK;
}

/* ---- special tokens: split out of the text before the model runs (tokenizer_st_partition) ---- */

typedef struct {
  int64_t off, len; /* raw text [off, off + len) of the input */
  int32_t id;       /* >= 0: a special token; -1: raw text */
} fragment;

typedef struct {
  fragment *f;
  int64_t n, cap;
} frag_vec;

static upf_status frag_push(frag_vec *v, fragment f) {
  if (v->n == v->cap) {
    int64_t cap = v->cap ? v->cap * 2 : 16;
    fragment *p = realloc(v->f, (size_t)cap * sizeof *p);
    if (!p)
      return upf_fail(UPF_ERR_NOMEM, "tokenizer: %lld text fragments", (long long)cap);
    v->f = p, v->cap = cap;
  }
  v->f[v->n++] = f;
  return UPF_OK;
}

/* Each special token in turn, longest first, splits every raw fragment at each of its occurrences,
 * left to right. */
static upf_status partition(const upf_tokenizer *t, const char *text, int64_t len, int parse_special, frag_vec *cur) {
  cur->n = 0;
  if (len == 0)
    return UPF_OK;
  UPF_TRY(frag_push(cur, (fragment){0, len, -1}));
  /* a token can only occur if its first two bytes do: one bit per byte pair of the text */
  uint8_t *pairs = calloc(65536 / 8, 1), present[256] = {0};
  if (!pairs)
    return upf_fail(UPF_ERR_NOMEM, "tokenizer: byte-pair filter");
  for (int64_t i = 0; i < len; i++) {
    present[(uint8_t)text[i]] = 1;
    if (i + 1 < len) {
      unsigned p = (unsigned)(uint8_t)text[i] << 8 | (uint8_t)text[i + 1];
      pairs[p >> 3] |= (uint8_t)(1u << (p & 7));
    }
  }
  frag_vec next = {0};
  upf_status st = UPF_OK;
  for (int32_t k = 0; k < t->n_special && st == UPF_OK; k++) {
    int32_t id = t->special[k];
    if (!parse_special && (t->attr[id] & (ATTR_CONTROL | ATTR_UNKNOWN)))
      continue;
    const char *tok = t->text + t->off[id];
    int64_t tl = t->len[id];
    if (tl > len || !present[(uint8_t)tok[0]])
      continue;
    if (tl >= 2) {
      unsigned p = (unsigned)(uint8_t)tok[0] << 8 | (uint8_t)tok[1];
      if (!(pairs[p >> 3] >> (p & 7) & 1))
        continue;
    }
    int found = 0;
    for (int64_t i = 0; i < cur->n && !found; i++)
      found = cur->f[i].id < 0 && memmem(text + cur->f[i].off, (size_t)cur->f[i].len, tok, (size_t)tl);
    if (!found)
      continue;
    next.n = 0;
    for (int64_t i = 0; i < cur->n && st == UPF_OK; i++) {
      fragment f = cur->f[i];
      if (f.id >= 0) {
        st = frag_push(&next, f);
        continue;
      }
      while (f.len > 0 && st == UPF_OK) {
        const char *m = memmem(text + f.off, (size_t)f.len, tok, (size_t)tl);
        if (!m) {
          st = frag_push(&next, f);
          break;
        }
        int64_t at = m - text;
        if (at > f.off)
          st = frag_push(&next, (fragment){f.off, at - f.off, -1});
        if (st == UPF_OK)
          st = frag_push(&next, (fragment){0, 0, id});
        f.len -= at + tl - f.off;
        f.off = at + tl;
      }
    }
    frag_vec swap = *cur;
    *cur = next;
    next = swap;
  }
  free(next.f);
  free(pairs);
  return st;
}

upf_status upf_tokenizer_encode(const upf_tokenizer *t, const char *text, int64_t len, int flags, int32_t **ids,
                                int64_t *n_ids) {
  *ids = NULL, *n_ids = 0;
  if (len < 0 || (len > 0 && !text))
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: text of %lld bytes at %p", (long long)len, (const void *)text);
  frag_vec frags = {0};
  session s = {0};
  int add_special = (flags & UPF_TOKENIZE_ADD_SPECIAL) != 0;
  upf_status st = partition(t, text, len, (flags & UPF_TOKENIZE_PARSE_SPECIAL) != 0, &frags);
  if (st == UPF_OK && add_special && t->add_bos)
    st = ids_push(&s.out, t->bos);
  int prev_special = 1; /* SPM: the first stretch of text gets the space prefix */
  for (int64_t i = 0; i < frags.n && st == UPF_OK; i++) {
    const fragment *f = &frags.f[i];
    if (f->id >= 0) {
      st = ids_push(&s.out, f->id);
      prev_special = 1;
    } else if (t->model == UPF_TOKENIZER_BPE) {
      st = bpe_fragment(t, &s, (const uint8_t *)text + f->off, f->len, f->off);
    } else {
      st = spm_fragment(t, &s, text + f->off, f->len, t->add_space_prefix && prev_special, f->off);
      prev_special = 0;
    }
  }
  if (st == UPF_OK && add_special && t->add_eos)
    st = ids_push(&s.out, t->eos);
  free(frags.f);
  if (st == UPF_OK && s.out.n) {
    *ids = s.out.v, *n_ids = s.out.n;
    s.out.v = NULL;
  }
  session_free(&s);
  return st;
}

/* ---- decoding (token_to_piece and detokenize) ---- */

/* Appends token id's piece; `lstrip` drops up to that many leading spaces. */
static upf_status put_piece(const upf_tokenizer *t, int32_t id, int special, int lstrip, bytes_vec *o) {
  uint8_t a = t->attr[id];
  const char *s = t->text + t->off[id];
  int64_t n = t->len[id];
  if (!special && (a & (ATTR_UNKNOWN | ATTR_CONTROL)))
    return UPF_OK;
  int64_t start = o->n;
  if (a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED)) {
    UPF_TRY(bytes_put(o, s, n));
  } else if (a & ATTR_NORMAL) {
    if (t->model == UPF_TOKENIZER_SPM) {
      for (int64_t i = 0; i < n;) {
        if (i + 3 <= n && !memcmp(s + i, "\xe2\x96\x81", 3)) {
          UPF_TRY(bytes_put(o, " ", 1));
          i += 3;
        } else {
          UPF_TRY(bytes_put(o, s + i, 1));
          i++;
        }
      }
    } else { /* each codepoint back to its byte (llama_decode_text) */
      uint32_t stack[64], *c = n <= 64 ? stack : malloc((size_t)n * sizeof *c);
      if (!c)
        return upf_fail(UPF_ERR_NOMEM, "tokenizer: decoding token %d", id);
      int64_t bad, m = upf_utf8_decode((const uint8_t *)s, n, c, &bad);
      upf_status st = UPF_OK;
      for (int64_t i = 0; i < m && st == UPF_OK; i++) {
        int b = cpt_to_byte(c[i]);
        if (b >= 0) {
          char ch = (char)b;
          st = bytes_put(o, &ch, 1);
        } else { /* llama.cpp's marker for a codepoint outside the byte map */
          uint8_t u[4];
          int k = upf_utf8_put(c[i], u);
          char hex[16];
          st = bytes_put(o, "[UNK_BYTE_0x", 12);
          for (int j = 0; j < k && st == UPF_OK; j++) {
            snprintf(hex, sizeof hex, "%02x", u[j]);
            st = bytes_put(o, hex, 2);
          }
          if (st == UPF_OK)
            st = bytes_put(o, s, n);
          if (st == UPF_OK)
            st = bytes_put(o, "]", 1);
        }
      }
      if (m < 0) /* not reachable from a vocabulary of valid UTF-8; kept whole */
        st = bytes_put(o, s, n);
      if (c != stack)
        free(c);
      UPF_TRY(st);
    }
  } else if (a & ATTR_BYTE) {
    char hex[3] = {n > 3 ? s[3] : 0, n > 4 ? s[4] : 0, 0};
    char ch = (char)strtol(hex, NULL, 16);
    UPF_TRY(bytes_put(o, &ch, 1));
  }
  int64_t drop = 0;
  while (drop < lstrip && start + drop < o->n && o->p[start + drop] == ' ')
    drop++;
  if (drop) {
    memmove(o->p + start, o->p + start + drop, (size_t)(o->n - start - drop) + 1);
    o->n -= drop;
  }
  return UPF_OK;
}

/* llama.cpp's clean_up_tokenization_spaces, its three passes as written there. */
static int64_t clean_spaces(char *text, int64_t total) {
  int64_t total1 = total;
  total = total ? 1 : 0;
  for (int64_t i = 1; i < total1; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ','))
      total--;
    text[total++] = x;
  }
  int64_t total2 = total;
  total = total ? 1 : 0;
  for (int64_t i = 1; i < total2; ++i) {
    const char x = text[i];
    if (x == '\'' && i + 1 < total2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
      total--;
      text[++i] = '\0';
    }
    text[total++] = x;
  }
  int64_t total3 = total;
  total = total ? 1 : 0;
  for (int64_t i = 1; i < total3; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
      const char x1 = text[i + 1];
      if (x1 == 's' || x1 == 'm')
        total--;
      else if (i + 2 < total3 && ((x1 == 'r' && text[i + 2] == 'e') || (x1 == 'v' && text[i + 2] == 'e')))
        total--;
    }
    text[total++] = x;
  }
  return total;
}

static upf_status check_ids(const upf_tokenizer *t, const int32_t *ids, int64_t n) {
  if (n < 0 || (n > 0 && !ids))
    return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: %lld ids at %p", (long long)n, (const void *)ids);
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= t->n_tokens)
      return upf_fail(UPF_ERR_INVALID_ARG, "tokenizer: ids[%lld] = %d is outside the vocabulary [0, %d)", (long long)i,
                      ids[i], t->n_tokens);
  return UPF_OK;
}

upf_status upf_tokenizer_decode(const upf_tokenizer *t, const int32_t *ids, int64_t n, int flags, char **text,
                                int64_t *len) {
  *text = NULL;
  if (len)
    *len = 0;
  UPF_TRY(check_ids(t, ids, n));
  int remove_space = t->add_space_prefix;
  if ((flags & UPF_DETOKENIZE_REMOVE_SPECIAL) && t->add_bos && n > 0 && ids[0] == t->bos) {
    remove_space = 0;
    ids++, n--;
  }
  if ((flags & UPF_DETOKENIZE_REMOVE_SPECIAL) && t->add_eos && n > 0 && ids[n - 1] == t->eos)
    n--;
  bytes_vec o = {0};
  upf_status st = bytes_put(&o, "", 0);
  for (int64_t i = 0; i < n && st == UPF_OK; i++) {
    st = put_piece(t, ids[i], (flags & UPF_DETOKENIZE_RENDER_SPECIAL) != 0, remove_space, &o);
    remove_space = 0;
  }
  if (st != UPF_OK) {
    free(o.p);
    return st;
  }
  if (t->clean_spaces) {
    o.n = clean_spaces(o.p, o.n);
    o.p[o.n] = 0;
  }
  *text = o.p;
  if (len)
    *len = o.n;
  return UPF_OK;
}

upf_status upf_tokenizer_piece(const upf_tokenizer *t, int32_t id, char **piece, int64_t *len) {
  *piece = NULL;
  if (len)
    *len = 0;
  UPF_TRY(check_ids(t, &id, 1));
  bytes_vec o = {0};
  upf_status st = bytes_put(&o, "", 0);
  if (st == UPF_OK)
    st = put_piece(t, id, 1, 0, &o);
  if (st != UPF_OK) {
    free(o.p);
    return st;
  }
  *piece = o.p;
  if (len)
    *len = o.n;
  return UPF_OK;
}
