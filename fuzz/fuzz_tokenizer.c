/* libFuzzer target: tokenizer input (core/tokenizer*.c). Three small tokenizers are built once
 * (byte-level BPE with the gpt2 and smollm pre-tokenizers, every byte a token; SentencePiece with
 * byte fallback); the first input byte picks one and the encode flags, the rest is the text. Every id
 * must be in range, decoding the ids must succeed, and an SPM encode without specials of valid UTF-8
 * must decode back to the text with each U+2581 read as a space (in invalid UTF-8 a stray lead byte
 * takes the bytes after it into one symbol, as in llama.cpp, so a U+2581 there stays bytes). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/spm_vocab.h"
#include "uniprefill/tokenizer.h"

static upf_tokenizer *toks[3];

/* GPT-2's byte-to-codepoint table: printable bytes map to themselves, the rest to 256 + n. */
static int byte_cp(int b) {
  if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)
    return b;
  int n = 0;
  for (int c = 0; c < b; c++)
    n += !((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174);
  return 256 + n;
}

static char *utf8(int cp) {
  char *s = calloc(4, 1);
  if (s && cp < 0x80)
    s[0] = (char)cp;
  else if (s)
    s[0] = (char)(0xC0 | (cp >> 6)), s[1] = (char)(0x80 | (cp & 0x3F));
  return s;
}

static upf_tokenizer *build_bpe(upf_tokenizer_pre pre) {
  static const char *const extra[] = {"<|endoftext|>", "<|im_start|>", "he", "ll", "llo", "hello", "\xc4\xa0w", "or",
                                      "\xc4\xa0wor", "ld", "\xc4\xa0world", "\xc4\xa0\xc4\xa0"};
  static const char *const merges[] = {"h e", "l l", "ll o", "he llo", "\xc4\xa0 w", "o r", "\xc4\xa0w or", "l d",
                                       "\xc4\xa0wor ld", "\xc4\xa0 \xc4\xa0"};
  enum { NX = sizeof extra / sizeof *extra, N = 256 + NX };
  char *texts[N];
  int32_t types[N];
  for (int i = 0; i < 256; i++)
    texts[i] = utf8(byte_cp(i)), types[i] = UPF_TOKEN_NORMAL;
  for (int i = 0; i < NX; i++)
    texts[256 + i] = strdup(extra[i]), types[256 + i] = i < 2 ? UPF_TOKEN_CONTROL : UPF_TOKEN_NORMAL;
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_BPE, .pre = pre, .n_tokens = N, .tokens = (const char *const *)texts,
                           .types = types, .n_merges = sizeof merges / sizeof *merges, .merges = merges,
                           .bos_id = 256 + 1, .eos_id = 256, .unk_id = -1, .pad_id = -1, .add_bos = 1,
                           .clean_spaces = 1};
  upf_tokenizer *t = NULL;
  if (upf_tokenizer_create(&v, &t) != UPF_OK)
    fprintf(stderr, "fuzz_tokenizer: BPE: %s\n", upf_last_error()), abort();
  for (int i = 0; i < N; i++)
    free(texts[i]);
  return t;
}

static upf_tokenizer *build_spm(void) {
  static const char *const words[] = {"\xe2\x96\x81", "\xe2\x96\x81hello", "\xe2\x96\x81world", "h", "e", "l", "o",
                                      "\xe2\x96\x81w", "or", "ld", "ll", "he", "<|im_start|>"};
  enum { NW = sizeof words / sizeof *words, N = FUZZ_SPM_FIXED + NW };
  char *texts[N];
  int32_t types[N];
  float scores[N];
  fuzz_spm_vocab(words, NW, UPF_TOKEN_CONTROL, texts, types, scores);
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_SPM, .n_tokens = N, .tokens = (const char *const *)texts,
                           .scores = scores, .types = types, .bos_id = 1, .eos_id = 2, .unk_id = 0, .pad_id = -1,
                           .add_bos = 1, .add_space_prefix = 1};
  upf_tokenizer *t = NULL;
  if (upf_tokenizer_create(&v, &t) != UPF_OK)
    fprintf(stderr, "fuzz_tokenizer: SPM: %s\n", upf_last_error()), abort();
  for (int i = 0; i < N; i++)
    free(texts[i]);
  return t;
}

/* Well-formed UTF-8 in the sense of the tokenizers' splitting: each lead byte followed by its
 * continuation bytes. */
static int valid_utf8(const uint8_t *s, int64_t n) {
  for (int64_t i = 0; i < n;) {
    const int len = s[i] < 0x80 ? 1 : s[i] >= 0xC2 && s[i] < 0xE0 ? 2 : s[i] >= 0xE0 && s[i] < 0xF0 ? 3
                                    : s[i] >= 0xF0 && s[i] < 0xF5 ? 4 : 0;
    if (!len || i + len > n)
      return 0;
    for (int k = 1; k < len; k++)
      if ((s[i + k] & 0xC0) != 0x80)
        return 0;
    i += len;
  }
  return 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  toks[0] = build_bpe(UPF_TOKENIZER_PRE_GPT2);
  toks[1] = build_bpe(UPF_TOKENIZER_PRE_SMOLLM);
  toks[2] = build_spm();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  const upf_tokenizer *t = toks[(data[0] & 3) % 3];
  const int flags = (data[0] >> 2) & 3;
  const char *text = (const char *)data + 1;
  const int64_t len = (int64_t)size - 1;
  int32_t *ids = NULL;
  int64_t n = 0;
  if (upf_tokenizer_encode(t, text, len, flags, &ids, &n) != UPF_OK) {
    free(ids);
    return 0;
  }
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= upf_tokenizer_n_tokens(t))
      __builtin_trap();
  char *back = NULL;
  int64_t blen = 0;
  if (upf_tokenizer_decode(t, ids, n, (data[0] >> 4) & 3, &back, &blen) != UPF_OK || back[blen] != '\0')
    __builtin_trap();
  if (t == toks[2] && flags == 0 && !(data[0] & 0x30) && valid_utf8(data + 1, len)) {
    /* SPM keeps every byte (byte fallback), so the text comes back with U+2581 as ' ' */
    char *want = malloc((size_t)len + 1);
    int64_t w = 0;
    for (int64_t i = 0; want && i < len; i++) {
      if (i + 2 < len && !memcmp(text + i, "\xe2\x96\x81", 3))
        want[w++] = ' ', i += 2;
      else
        want[w++] = text[i];
    }
    /* decode drops the space the encoder prefixed (add_space_prefix) */
    if (want && (blen != w || memcmp(back, want, (size_t)w)))
      __builtin_trap();
    free(want);
  }
  free(back);
  free(ids);
  return 0;
}
