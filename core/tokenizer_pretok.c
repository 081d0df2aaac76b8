/* UTF-8 and the byte-level BPE pre-tokenizers, written out by hand after llama.cpp's unicode.cpp:
 * its reading of UTF-8, its whitespace set, and its hand-coded form of the gpt2 expression
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with "smollm" first putting every \p{N} codepoint in a piece of its own. */
#include <stdlib.h>

#include "core/tokenizer_internal.h"

int upf_utf8_put(uint32_t cpt, uint8_t *out) {
  if (cpt <= 0x7f) {
    out[0] = (uint8_t)cpt;
    return 1;
  }
  if (cpt <= 0x7ff) {
    out[0] = (uint8_t)(0xc0 | (cpt >> 6));
    out[1] = (uint8_t)(0x80 | (cpt & 0x3f));
    return 2;
  }
  if (cpt <= 0xffff) {
    out[0] = (uint8_t)(0xe0 | (cpt >> 12));
    out[1] = (uint8_t)(0x80 | ((cpt >> 6) & 0x3f));
    out[2] = (uint8_t)(0x80 | (cpt & 0x3f));
    return 3;
  }
  out[0] = (uint8_t)(0xf0 | ((cpt >> 18) & 0x07));
  out[1] = (uint8_t)(0x80 | ((cpt >> 12) & 0x3f));
  out[2] = (uint8_t)(0x80 | ((cpt >> 6) & 0x3f));
  out[3] = (uint8_t)(0x80 | (cpt & 0x3f));
  return 4;
}

static int is_cont(const uint8_t *t, int64_t len, int64_t i) {
  return i < len && (t[i] & 0xc0) == 0x80;
}

int64_t upf_utf8_decode(const uint8_t *t, int64_t len, uint32_t *cpts, int64_t *bad_offset) {
  int64_t n = 0;
  for (int64_t i = 0; i < len;) {
    uint8_t c = t[i];
    uint32_t cpt = 0xFFFD;
    int step = 1;
    if (c < 0x80) {
      cpt = c;
    } else if ((c & 0xe0) == 0xc0) {
      if (is_cont(t, len, i + 1))
        cpt = ((uint32_t)(c & 0x1f) << 6) | (t[i + 1] & 0x3f), step = 2;
    } else if ((c & 0xf0) == 0xe0) {
      if (is_cont(t, len, i + 1) && is_cont(t, len, i + 2))
        cpt = ((uint32_t)(c & 0x0f) << 12) | ((uint32_t)(t[i + 1] & 0x3f) << 6) | (t[i + 2] & 0x3f), step = 3;
    } else if ((c & 0xf8) == 0xf0) {
      if (is_cont(t, len, i + 1) && is_cont(t, len, i + 2) && is_cont(t, len, i + 3)) {
        cpt = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(t[i + 1] & 0x3f) << 12) | ((uint32_t)(t[i + 2] & 0x3f) << 6) |
              (t[i + 3] & 0x3f);
        step = 4;
        if (cpt > 0x10FFFF) {
          *bad_offset = i;
          return -1;
        }
      }
    }
    cpts[n++] = cpt;
    i += step;
  }
  return n;
}

static int in_ranges(const upf_unicode_range *r, int64_t count, uint32_t cpt) {
  int64_t lo = 0, hi = count - 1;
  while (lo <= hi) {
    int64_t mid = (lo + hi) / 2;
    if (cpt < r[mid].lo)
      hi = mid - 1;
    else if (cpt > r[mid].hi)
      lo = mid + 1;
    else
      return 1;
  }
  return 0;
}

static int is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) ||
         c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

int upf_cpt_class(uint32_t c) {
  if (is_space(c))
    return UPF_CPT_SPACE;
  if (c < 0x80) {
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')
      return UPF_CPT_LETTER;
    return c >= '0' && c <= '9' ? UPF_CPT_NUMBER : UPF_CPT_OTHER;
  }
  if (in_ranges(upf_unicode_letters, upf_unicode_letters_count, c))
    return UPF_CPT_LETTER;
  if (in_ranges(upf_unicode_numbers, upf_unicode_numbers_count, c))
    return UPF_CPT_NUMBER;
  return UPF_CPT_OTHER;
}

/* The gpt2 expression over cpts[ini, end); cls holds the classes of the same codepoints. Positions
 * outside the piece have class 0 (llama.cpp's "out of range" flags), which no branch takes. */
static int64_t split_gpt2(const uint32_t *cpts, const uint8_t *cls, int64_t ini, int64_t end, int64_t *word_len) {
  int64_t n_words = 0, prev_end = ini;
#define CLS(p) ((p) >= ini && (p) < end ? cls[p] : 0)
#define ADD(e)                             \
  do {                                     \
    if ((e) > prev_end)                    \
      word_len[n_words++] = (e)-prev_end;  \
    prev_end = (e);                        \
  } while (0)
  for (int64_t pos = ini; pos < end;) {
    uint32_t c = cpts[pos];
    if (c == '\'' && pos + 1 < end) {
      uint32_t c1 = cpts[pos + 1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        ADD(pos + 2);
        pos += 2;
        continue;
      }
      if (pos + 2 < end) {
        uint32_t c2 = cpts[pos + 2];
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          ADD(pos + 3);
          pos += 3;
          continue;
        }
      }
    }
    /* " ?X+" for the three classes: a leading space joins the run that follows it */
    int k2 = c == ' ' ? CLS(pos + 1) : cls[pos];
    if (k2 == UPF_CPT_LETTER || k2 == UPF_CPT_NUMBER || k2 == UPF_CPT_OTHER) {
      pos += c == ' ';
      while (CLS(pos) == k2)
        pos++;
      ADD(pos);
      continue;
    }
    int64_t ws = 0;
    while (CLS(pos + ws) == UPF_CPT_SPACE)
      ws++;
    if (ws > 1 && pos + ws < end) { /* \s+(?!\S): leave the last space to the word after it */
      pos += ws - 1;
      ADD(pos);
      continue;
    }
    if (ws > 0) {
      pos += ws;
      ADD(pos);
      continue;
    }
    ADD(pos + 1); /* no branch matched (cannot happen inside the piece; kept as llama.cpp has it) */
    pos++;
  }
#undef CLS
#undef ADD
  return n_words;
}

int64_t upf_pretokenize(upf_tokenizer_pre pre, const uint32_t *cpts, int64_t n, int64_t *word_len) {
  if (n == 0)
    return 0;
  uint8_t stack_cls[1024]; /* each codepoint's class, looked up once */
  uint8_t *cls = n <= (int64_t)sizeof stack_cls ? stack_cls : malloc((size_t)n);
  if (!cls)
    return -1;
  for (int64_t i = 0; i < n; i++)
    cls[i] = (uint8_t)upf_cpt_class(cpts[i]);
  int64_t n_words = 0;
  if (pre == UPF_TOKENIZER_PRE_SMOLLM) {
    /* \p{N} pieces of one codepoint, the stretches between them whole */
    int64_t start = 0;
    for (int64_t i = 0; i <= n; i++) {
      if (i < n && cls[i] != UPF_CPT_NUMBER)
        continue;
      if (i > start)
        n_words += split_gpt2(cpts, cls, start, i, word_len + n_words);
      if (i < n)
        word_len[n_words++] = 1;
      start = i + 1;
    }
  } else {
    n_words = split_gpt2(cpts, cls, 0, n, word_len);
  }
  if (cls != stack_cls)
    free(cls);
  return n_words;
}
