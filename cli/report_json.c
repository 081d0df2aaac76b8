/* The JSON reader of cli/report_json.h: recursive descent over the text, every failure naming the
 * file and the byte offset where the text stopped making sense. Depth is bounded so that a hostile
 * file cannot exhaust the stack. */
#include "cli/report_json.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RJ_MAX_DEPTH 64

typedef struct {
  const char *text;
  size_t len, pos;
  const char *name;
} rj_parser;

static upf_status rj_error(const rj_parser *p, const char *what) {
  return upf_fail(UPF_ERR_FORMAT, "%s: not valid JSON at byte %zu: %s", p->name, p->pos, what);
}

static void skip_space(rj_parser *p) {
  while (p->pos < p->len && (p->text[p->pos] == ' ' || p->text[p->pos] == '\t' || p->text[p->pos] == '\n' ||
                             p->text[p->pos] == '\r'))
    p->pos++;
}

static int match(rj_parser *p, const char *word) {
  size_t n = strlen(word);
  if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0)
    return 0;
  p->pos += n;
  return 1;
}

static int hex4(const char *s, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    char c = s[i];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f')
      v |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      v |= (unsigned)(c - 'A' + 10);
    else
      return 0;
  }
  *out = v;
  return 1;
}

static size_t put_utf8(char *dst, unsigned cp) {
  if (cp < 0x80) {
    dst[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    dst[0] = (char)(0xC0 | (cp >> 6));
    dst[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    dst[0] = (char)(0xE0 | (cp >> 12));
    dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  dst[0] = (char)(0xF0 | (cp >> 18));
  dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  dst[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* At the opening quote; the decoded string is never longer than its escaped form. */
static upf_status parse_string(rj_parser *p, char **out) {
  p->pos++;
  size_t start = p->pos;
  while (p->pos < p->len && p->text[p->pos] != '"')
    p->pos += p->text[p->pos] == '\\' ? 2 : 1;
  if (p->pos >= p->len)
    return rj_error(p, "unterminated string");
  size_t end = p->pos;
  char *s = malloc(end - start + 1);
  if (!s)
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory for a string of %zu bytes", p->name, end - start);
  size_t n = 0;
  for (size_t i = start; i < end; i++) {
    char c = p->text[i];
    if ((unsigned char)c < 0x20) {
      free(s);
      p->pos = i;
      return rj_error(p, "control character in a string");
    }
    if (c != '\\') {
      s[n++] = c;
      continue;
    }
    char e = p->text[++i];
    const char *simple = strchr("\"\\/bfnrt", e);
    if (e && simple) {
      static const char plain[] = "\"\\/\b\f\n\r\t";
      s[n++] = plain[simple - "\"\\/bfnrt"];
      continue;
    }
    unsigned cp = 0, lo = 0;
    if (e != 'u' || end - i < 5 || !hex4(p->text + i + 1, &cp) || cp == 0) {
      free(s);
      p->pos = i;
      return rj_error(p, e == 'u' ? "bad or NUL \\u escape" : "bad escape");
    }
    i += 4;
    if (cp >= 0xD800 && cp < 0xDC00 && end - i >= 7 && p->text[i + 1] == '\\' && p->text[i + 2] == 'u' &&
        hex4(p->text + i + 3, &lo) && lo >= 0xDC00 && lo < 0xE000) {
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      i += 6;
    }
    n += put_utf8(s + n, cp);
  }
  s[n] = '\0';
  p->pos = end + 1;
  *out = s;
  return UPF_OK;
}

static upf_status parse_value(rj_parser *p, rj_value *v, int depth);

static upf_status append(rj_parser *p, rj_value *v, int with_keys) {
  if ((v->count & (v->count - 1)) == 0) { /* grow at powers of two */
    int cap = v->count ? v->count * 2 : 4;
    rj_value *items = realloc(v->items, (size_t)cap * sizeof *items);
    if (items)
      v->items = items;
    char **keys = with_keys ? realloc(v->keys, (size_t)cap * sizeof *keys) : NULL;
    if (keys)
      v->keys = keys;
    if (!items || (with_keys && !keys))
      return upf_fail(UPF_ERR_NOMEM, "%s: out of memory at byte %zu", p->name, p->pos);
  }
  memset(&v->items[v->count], 0, sizeof v->items[0]);
  if (with_keys)
    v->keys[v->count] = NULL;
  v->count++;
  return UPF_OK;
}

static upf_status parse_container(rj_parser *p, rj_value *v, int depth) {
  const int object = p->text[p->pos] == '{';
  const char close = object ? '}' : ']';
  v->kind = object ? RJ_OBJECT : RJ_ARRAY;
  p->pos++;
  skip_space(p);
  if (p->pos < p->len && p->text[p->pos] == close) {
    p->pos++;
    return UPF_OK;
  }
  for (;;) {
    UPF_TRY(append(p, v, object));
    if (object) {
      skip_space(p);
      if (p->pos >= p->len || p->text[p->pos] != '"')
        return rj_error(p, "expected a member name");
      UPF_TRY(parse_string(p, &v->keys[v->count - 1]));
      skip_space(p);
      if (p->pos >= p->len || p->text[p->pos] != ':')
        return rj_error(p, "expected ':'");
      p->pos++;
    }
    UPF_TRY(parse_value(p, &v->items[v->count - 1], depth + 1));
    skip_space(p);
    if (p->pos < p->len && p->text[p->pos] == ',') {
      p->pos++;
      continue;
    }
    if (p->pos < p->len && p->text[p->pos] == close) {
      p->pos++;
      return UPF_OK;
    }
    return rj_error(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
  }
}

static upf_status parse_number(rj_parser *p, rj_value *v) {
  const size_t start = p->pos;
  size_t i = p->pos;
  if (i < p->len && p->text[i] == '-')
    i++;
  if (i < p->len && p->text[i] == '0') {
    i++;
  } else {
    if (i >= p->len || p->text[i] < '0' || p->text[i] > '9')
      return rj_error(p, "expected a value");
    while (i < p->len && p->text[i] >= '0' && p->text[i] <= '9')
      i++;
  }
  if (i < p->len && p->text[i] == '.') {
    if (++i >= p->len || p->text[i] < '0' || p->text[i] > '9')
      return rj_error(p, "digits must follow '.'");
    while (i < p->len && p->text[i] >= '0' && p->text[i] <= '9')
      i++;
  }
  if (i < p->len && (p->text[i] == 'e' || p->text[i] == 'E')) {
    i++;
    if (i < p->len && (p->text[i] == '+' || p->text[i] == '-'))
      i++;
    if (i >= p->len || p->text[i] < '0' || p->text[i] > '9')
      return rj_error(p, "digits must follow the exponent");
    while (i < p->len && p->text[i] >= '0' && p->text[i] <= '9')
      i++;
  }
  char buf[64];
  if (i - start >= sizeof buf)
    return rj_error(p, "number too long");
  memcpy(buf, p->text + start, i - start);
  buf[i - start] = '\0';
  v->kind = RJ_NUMBER;
  v->number = strtod(buf, NULL);
  p->pos = i;
  return UPF_OK;
}

static upf_status parse_value(rj_parser *p, rj_value *v, int depth) {
  if (depth > RJ_MAX_DEPTH)
    return rj_error(p, "nested too deeply");
  skip_space(p);
  if (p->pos >= p->len)
    return rj_error(p, "unexpected end");
  const char c = p->text[p->pos];
  if (c == '{' || c == '[')
    return parse_container(p, v, depth);
  if (c == '"') {
    v->kind = RJ_STRING;
    return parse_string(p, &v->string);
  }
  if (match(p, "null")) {
    v->kind = RJ_NULL;
    return UPF_OK;
  }
  if (match(p, "true") || match(p, "false")) {
    v->kind = RJ_BOOL;
    v->number = p->text[p->pos - 1] == 'e' && p->text[p->pos - 2] == 'u';
    return UPF_OK;
  }
  if (match(p, "NaN")) {
    v->kind = RJ_NUMBER;
    v->number = NAN;
    return UPF_OK;
  }
  if (match(p, "Infinity")) {
    v->kind = RJ_NUMBER;
    v->number = INFINITY;
    return UPF_OK;
  }
  if (match(p, "-Infinity")) {
    v->kind = RJ_NUMBER;
    v->number = -INFINITY;
    return UPF_OK;
  }
  return parse_number(p, v);
}

upf_status rj_parse(const char *text, size_t len, const char *name, rj_value *out) {
  memset(out, 0, sizeof *out);
  rj_parser p = {text, len, 0, name};
  UPF_TRY(parse_value(&p, out, 0));
  skip_space(&p);
  if (p.pos != p.len)
    return rj_error(&p, "text after the document");
  return UPF_OK;
}

void rj_free(rj_value *v) {
  if (!v)
    return;
  for (int i = 0; i < v->count; i++) {
    rj_free(&v->items[i]);
    if (v->keys)
      free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v->string);
  memset(v, 0, sizeof *v);
}

const rj_value *rj_get(const rj_value *v, const char *key) {
  if (!v || v->kind != RJ_OBJECT)
    return NULL;
  for (int i = 0; i < v->count; i++)
    if (v->keys[i] && !strcmp(v->keys[i], key))
      return &v->items[i];
  return NULL;
}

double rj_number(const rj_value *v, const char *key) {
  const rj_value *m = rj_get(v, key);
  return m && m->kind == RJ_NUMBER ? m->number : NAN;
}

const char *rj_string(const rj_value *v, const char *key) {
  const rj_value *m = rj_get(v, key);
  return m && m->kind == RJ_STRING ? m->string : NULL;
}
