/* The tokenizer: hand-built tiny vocabularies whose ids are worked out by hand (merge order, score
 * order, byte fallback, unknown characters, special tokens, the empty text, decoding), the gpt2
 * pre-tokenizer on hand-split texts, the GGUF glue on files written by the GGUF writer, and the two
 * real GGUF files against golden ids from llama.cpp and transformers (tests/data/tokenizer_golden.txt,
 * written by tests/tokenizer_golden.py). The real files are looked for in $UPF_MODEL_DIR, else
 * $UPF_MODEL_CACHE/models, else ~/.cache/uniprefill/models; a test whose file is absent is skipped
 * by name. */
#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/tokenizer_internal.h"
#include "tests/test_util.h"
#include "uniprefill/gguf.h"
#include "uniprefill/tokenizer.h"

/* ---- helpers ---- */

static int ids_equal(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
  return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a));
}

static void print_ids(const char *what, const int32_t *ids, int64_t n) {
  printf("\n  %s (%lld):", what, (long long)n);
  for (int64_t i = 0; i < n && i < 64; i++)
    printf(" %d", ids[i]);
  if (n > 64)
    printf(" ...");
}

/* Encodes text and asserts the ids; prints both on a mismatch. */
static void expect_encode(const upf_tokenizer *t, const char *text, int64_t len, int flags, const int32_t *want,
                          int64_t n_want) {
  int32_t *ids = NULL;
  int64_t n = -1;
  upf_status st = upf_tokenizer_encode(t, text, len, flags, &ids, &n);
  CU_ASSERT_EQUAL(st, UPF_OK);
  int ok = st == UPF_OK && ids_equal(ids, n, want, n_want);
  CU_ASSERT(ok);
  if (!ok) {
    printf("\n  text \"%.*s\" (%s)", (int)len, text, upf_last_error());
    print_ids("want", want, n_want);
    print_ids("got", ids, n);
  }
  free(ids);
}
#define EXPECT(t, text, flags, ...)                                                      \
  do {                                                                                   \
    static const int32_t want_[] = {__VA_ARGS__};                                        \
    expect_encode(t, text, (int64_t)strlen(text), flags, want_, sizeof want_ / sizeof *want_); \
  } while (0)

static void expect_decode(const upf_tokenizer *t, const int32_t *ids, int64_t n, int flags, const char *want,
                          int64_t want_len) {
  char *text = NULL;
  int64_t len = -1;
  upf_status st = upf_tokenizer_decode(t, ids, n, flags, &text, &len);
  CU_ASSERT_EQUAL(st, UPF_OK);
  int ok = st == UPF_OK && len == want_len && !memcmp(text, want, (size_t)want_len) && text[len] == 0;
  CU_ASSERT(ok);
  if (!ok)
    printf("\n  decode: want \"%.*s\" got \"%.*s\" (%s)", (int)want_len, want, text ? (int)len : 0, text ? text : "",
           upf_last_error());
  free(text);
}
#define EXPECT_DECODE(t, flags, want, ...)                                                            \
  do {                                                                                                \
    static const int32_t ids_[] = {__VA_ARGS__};                                                      \
    expect_decode(t, ids_, sizeof ids_ / sizeof *ids_, flags, want, (int64_t)strlen(want));           \
  } while (0)

static upf_tokenizer *make(const upf_tokenizer_vocab *v) {
  upf_tokenizer *t = NULL;
  upf_status st = upf_tokenizer_create(v, &t);
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  if (st != UPF_OK)
    printf("\n  create: %s", upf_last_error());
  return t;
}

/* ---- pre-tokenizer ---- */

/* Splits text and compares the words with `want`, a list of strings ended by NULL. */
static void expect_words(upf_tokenizer_pre pre, const char *text, const char *const *want) {
  int64_t len = (int64_t)strlen(text);
  uint32_t cpts[256];
  int64_t word_len[256], bad = 0;
  int64_t n = upf_utf8_decode((const uint8_t *)text, len, cpts, &bad);
  CU_ASSERT_FATAL(n >= 0 && n <= 256);
  int64_t nw = upf_pretokenize(pre, cpts, n, word_len);
  int64_t k = 0, ok = 1, pos = 0;
  for (; k < nw; k++) {
    if (!want[k]) {
      ok = 0;
      break;
    }
    /* the word's bytes: re-encode its codepoints */
    char buf[1024];
    int64_t b = 0;
    for (int64_t i = 0; i < word_len[k]; i++)
      b += upf_utf8_put(cpts[pos + i], (uint8_t *)buf + b);
    pos += word_len[k];
    if ((int64_t)strlen(want[k]) != b || memcmp(buf, want[k], (size_t)b)) {
      ok = 0;
      printf("\n  \"%s\": word %lld is \"%.*s\", want \"%s\"", text, (long long)k, (int)b, buf, want[k]);
    }
  }
  ok = ok && !want[nw];
  CU_ASSERT(ok);
  if (!ok)
    printf("\n  \"%s\": %lld words", text, (long long)nw);
}
#define WORDS(pre, text, ...)                                     \
  do {                                                            \
    static const char *const want_[] = {__VA_ARGS__, NULL};       \
    expect_words(pre, text, want_);                               \
  } while (0)

static void test_pretokenize(void) {
  /* contractions, letters, a space joining the run after it, \s+(?!\S), digits */
  WORDS(UPF_TOKENIZER_PRE_GPT2, "Hello world's  end 123", "Hello", " world", "'s", " ", " end", " 123");
  WORDS(UPF_TOKENIZER_PRE_SMOLLM, "Hello world's  end 123", "Hello", " world", "'s", " ", " end", " ", "1", "2", "3");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "  a", " ", " a");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "a  ", "a", "  ");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "a\t\tb", "a", "\t", "\t", "b"); /* only ' ' joins the word after it */
  WORDS(UPF_TOKENIZER_PRE_GPT2, "x!!?? y.", "x", "!!??", " y", ".");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "it'S 'll've", "it", "'", "S", " '", "ll", "'ve");
  /* \p{L} and \p{N} beyond ASCII: é and 日 are letters, ٣ (Arabic-Indic three) and ½ are numbers,
   * U+3000 is a space, 😀 is neither */
  WORDS(UPF_TOKENIZER_PRE_GPT2, "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac", "caf\xc3\xa9", " \xe6\x97\xa5\xe6\x9c\xac");
  WORDS(UPF_TOKENIZER_PRE_SMOLLM, "x\xd9\xa3\xc2\xbd", "x", "\xd9\xa3", "\xc2\xbd");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "a\xe3\x80\x80\xe3\x80\x80" "b", "a", "\xe3\x80\x80", "\xe3\x80\x80", "b");
  WORDS(UPF_TOKENIZER_PRE_GPT2, "hi \xf0\x9f\x98\x80!", "hi", " \xf0\x9f\x98\x80!");
  /* invalid bytes read as U+FFFD, which is "other" */
  WORDS(UPF_TOKENIZER_PRE_GPT2, "a\xff" "b", "a", "\xef\xbf\xbd", "b");
  CU_ASSERT_EQUAL(upf_cpt_class(0x0041), UPF_CPT_LETTER);
  CU_ASSERT_EQUAL(upf_cpt_class(0x4E2D), UPF_CPT_LETTER);  /* 中 */
  CU_ASSERT_EQUAL(upf_cpt_class(0xAC00), UPF_CPT_LETTER);  /* 가 */
  CU_ASSERT_EQUAL(upf_cpt_class(0x216B), UPF_CPT_NUMBER);  /* Ⅻ (Nl) */
  CU_ASSERT_EQUAL(upf_cpt_class(0x2460), UPF_CPT_NUMBER);  /* ① (No) */
  CU_ASSERT_EQUAL(upf_cpt_class(0x0301), UPF_CPT_OTHER);   /* combining acute (Mn) */
  CU_ASSERT_EQUAL(upf_cpt_class(0x00A0), UPF_CPT_SPACE);
  CU_ASSERT_EQUAL(upf_cpt_class(0x200B), UPF_CPT_OTHER);   /* zero-width space is not \s */
  CU_ASSERT_EQUAL(upf_cpt_class(0x1F600), UPF_CPT_OTHER);
  CU_ASSERT_EQUAL(upf_cpt_class(0x10FFFF), UPF_CPT_OTHER);
  /* Unicode 15.1, as llama.cpp's tables: the Garay digits (Nd since Unicode 16) are not numbers yet */
  CU_ASSERT_EQUAL(upf_cpt_class(0x10D40), UPF_CPT_OTHER);
  CU_ASSERT_EQUAL(upf_cpt_class(0x1E4F0), UPF_CPT_NUMBER); /* Nag Mundari digit zero (Unicode 15.0) */
}

static void test_utf8(void) {
  uint32_t c[16];
  int64_t bad = -1;
  /* overlong C0 AF and the surrogate ED A0 80 pass (llama.cpp checks the bit patterns only); a lone
   * continuation byte and a cut sequence become U+FFFD, one per byte */
  const char *s = "\xc0\xaf\xed\xa0\x80\x80\xe2\x82" "A";
  int64_t n = upf_utf8_decode((const uint8_t *)s, (int64_t)strlen(s), c, &bad);
  CU_ASSERT_EQUAL(n, 6);
  CU_ASSERT(n == 6 && c[0] == 0x2f && c[1] == 0xd800 && c[2] == 0xfffd && c[3] == 0xfffd && c[4] == 0xfffd &&
            c[5] == 'A');
  /* F4 90 80 80 is U+110000: rejected, with its offset */
  n = upf_utf8_decode((const uint8_t *)"ab\xf4\x90\x80\x80", 6, c, &bad);
  CU_ASSERT_EQUAL(n, -1);
  CU_ASSERT_EQUAL(bad, 2);
}

/* ---- byte-level BPE ---- */

/* "a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa", "!", specials; merges in the order given. */
static upf_tokenizer *tiny_bpe(const char *const *merges, int64_t n_merges, upf_tokenizer_pre pre) {
  static const char *const toks[] = {"<s>", "<u>", "a", "b", "c", "ab", "bc", "abc", "\xc4\xa0", "\xc4\xa0" "a", "!",
                                     "aa", "1", "2", "\xc3\xaf", "\xc2\xbf", "\xc2\xbd", "<a>", "<a><b>"};
  static const int32_t types[] = {UPF_TOKEN_CONTROL, UPF_TOKEN_USER_DEFINED, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                  1, UPF_TOKEN_USER_DEFINED, UPF_TOKEN_CONTROL};
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_BPE, .pre = pre, .n_tokens = 19, .tokens = toks, .types = types,
                           .n_merges = n_merges, .merges = merges, .bos_id = 0, .eos_id = -1, .unk_id = -1,
                           .pad_id = -1, .add_bos = 1};
  return make(&v);
}

static void test_bpe_merge_order(void) {
  static const char *const bc_first[] = {"b c", "a b", "a bc", "\xc4\xa0 a", "a a"};
  static const char *const ab_first[] = {"a b", "b c", "ab c", "\xc4\xa0 a", "a a"};
  upf_tokenizer *t1 = tiny_bpe(bc_first, 5, UPF_TOKENIZER_PRE_GPT2);
  upf_tokenizer *t2 = tiny_bpe(ab_first, 5, UPF_TOKENIZER_PRE_GPT2);
  /* "abc": rank 0 decides the first merge, then "a bc" / "ab c" finish the word */
  EXPECT(t1, "abc", 0, 7);
  EXPECT(t2, "abc", 0, 7);
  /* without the last merge the first one shows: a|bc against ab|c */
  EXPECT(t1, "abcb", 0, 7, 3);
  static const char *const bc_only[] = {"b c", "a b"};
  static const char *const ab_only[] = {"a b", "b c"};
  upf_tokenizer *t3 = tiny_bpe(bc_only, 2, UPF_TOKENIZER_PRE_GPT2);
  upf_tokenizer *t4 = tiny_bpe(ab_only, 2, UPF_TOKENIZER_PRE_GPT2);
  EXPECT(t3, "abc", 0, 2, 6);
  EXPECT(t4, "abc", 0, 5, 4);
  /* equal ranks: the leftmost pair first, so "aaa" is aa|a */
  EXPECT(t1, "aaa", 0, 11, 2);
  /* a space is byte-encoded as Ġ and joins the letters after it; the model's BOS with ADD_SPECIAL */
  EXPECT(t1, "a a!", UPF_TOKENIZE_ADD_SPECIAL, 0, 2, 9, 10);
  /* smollm splits digits; a byte with no token is dropped (llama.cpp); "12" has no merge anyway */
  upf_tokenizer *t5 = tiny_bpe(ab_only, 2, UPF_TOKENIZER_PRE_SMOLLM);
  EXPECT(t5, "12x", 0, 12, 13);
  /* an invalid byte reads as U+FFFD, bytes EF BF BD, byte-encoded as ï ¿ ½ */
  EXPECT(t1, "\xff", 0, 14, 15, 16);
  /* above U+10FFFF: an error naming the offset (llama.cpp throws) */
  int32_t *ids = NULL;
  int64_t n = 0;
  CU_ASSERT_EQUAL(upf_tokenizer_encode(t1, "ab\xf4\x90\x80\x80", 6, 0, &ids, &n), UPF_ERR_INVALID_ARG);
  CU_ASSERT(ids == NULL && n == 0 && strstr(upf_last_error(), "offset 2") != NULL);
  upf_tokenizer_free(t1), upf_tokenizer_free(t2), upf_tokenizer_free(t3), upf_tokenizer_free(t4);
  upf_tokenizer_free(t5);
}

static void test_special_tokens(void) {
  static const char *const merges[] = {"a b"};
  upf_tokenizer *t = tiny_bpe(merges, 1, UPF_TOKENIZER_PRE_GPT2);
  /* control <s> only with PARSE_SPECIAL; user-defined <u> always */
  EXPECT(t, "a<s>b<u>", UPF_TOKENIZE_PARSE_SPECIAL, 2, 0, 3, 1);
  /* without it "<s>" is text: '<' 's' '>' have no tokens and drop */
  EXPECT(t, "a<s>b<u>", 0, 2, 3, 1);
  /* the longest special first: "<a><b>" (control) before "<a>" (user-defined) */
  EXPECT(t, "<a><b><a>ab", UPF_TOKENIZE_PARSE_SPECIAL, 18, 17, 5);
  EXPECT(t, "<a><b><a>ab", 0, 17, 3, 17, 5); /* "<b>" as text: only b has a token */
  /* the empty text: nothing, or just the BOS */
  int32_t *ids = (int32_t *)1;
  int64_t n = -1;
  CU_ASSERT_EQUAL(upf_tokenizer_encode(t, "", 0, 0, &ids, &n), UPF_OK);
  CU_ASSERT(n == 0 && ids == NULL);
  EXPECT(t, "", UPF_TOKENIZE_ADD_SPECIAL, 0);
  upf_tokenizer_free(t);
}

static void test_bpe_decode(void) {
  static const char *const merges[] = {"a b"};
  upf_tokenizer *t = tiny_bpe(merges, 1, UPF_TOKENIZER_PRE_GPT2);
  EXPECT_DECODE(t, 0, "ab a!", 5, 9, 10);
  /* control tokens render only when asked; user-defined ones always */
  EXPECT_DECODE(t, 0, "a<u>", 0, 2, 1);
  EXPECT_DECODE(t, UPF_DETOKENIZE_RENDER_SPECIAL, "<s>a<u>", 0, 2, 1);
  /* REMOVE_SPECIAL drops the leading BOS the model adds */
  EXPECT_DECODE(t, UPF_DETOKENIZE_RENDER_SPECIAL | UPF_DETOKENIZE_REMOVE_SPECIAL, "a", 0, 2);
  /* ï ¿ ½ decode to the bytes of U+FFFD */
  EXPECT_DECODE(t, 0, "\xef\xbf\xbd", 14, 15, 16);
  char *piece = NULL;
  int64_t len = 0;
  CU_ASSERT_EQUAL(upf_tokenizer_piece(t, 9, &piece, &len), UPF_OK);
  CU_ASSERT(len == 2 && !strcmp(piece, " a"));
  free(piece);
  /* ids out of range name their position */
  static const int32_t bad[] = {2, 19};
  char *text = NULL;
  CU_ASSERT_EQUAL(upf_tokenizer_decode(t, bad, 2, 0, &text, &len), UPF_ERR_INVALID_ARG);
  CU_ASSERT(text == NULL && strstr(upf_last_error(), "ids[1] = 19"));
  CU_ASSERT_EQUAL(upf_tokenizer_piece(t, -1, &piece, &len), UPF_ERR_INVALID_ARG);
  upf_tokenizer_free(t);

  /* llama.cpp's clean-up of spaces, for pre-tokenizers that ask for it */
  static const char *const toks[] = {"a", "\xc4\xa0,", "\xc4\xa0'", "s", "\xc4\xa0"};
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_BPE, .pre = UPF_TOKENIZER_PRE_GPT2, .n_tokens = 5, .tokens = toks,
                           .bos_id = -1, .eos_id = -1, .unk_id = -1, .pad_id = -1, .clean_spaces = 1};
  t = make(&v);
  EXPECT_DECODE(t, 0, "a,'s a", 0, 1, 2, 3, 4, 0);
  upf_tokenizer_free(t);
}

/* ---- SentencePiece ---- */

/* ▁ is E2 96 81. Scores decide the merges; byte tokens for 0xC3 and 0xA9 only. */
static upf_tokenizer *tiny_spm(float ab, float bc, int with_unk, int with_bytes, int prefix) {
  static const char *const toks[] = {"<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "\xe2\x96\x81",
                                     "\xe2\x96\x81" "a", "<0xC3>", "<0xA9>", "<nl>", "\n\n"};
  int32_t types[] = {UPF_TOKEN_UNKNOWN, UPF_TOKEN_CONTROL, UPF_TOKEN_CONTROL, 1, 1, 1, 1, 1, 1, 1, UPF_TOKEN_BYTE,
                     UPF_TOKEN_BYTE, UPF_TOKEN_CONTROL, UPF_TOKEN_USER_DEFINED};
  float scores[] = {0, 0, 0, -10, -10, -10, ab, bc, -5, -3, 0, 0, 0, 0};
  if (!with_bytes)
    types[10] = types[11] = UPF_TOKEN_NORMAL;
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_SPM, .n_tokens = with_bytes ? 14 : 10, .tokens = toks,
                           .scores = scores, .types = types, .bos_id = 1, .eos_id = 2, .unk_id = with_unk ? 0 : -1,
                           .pad_id = -1, .add_bos = 1, .add_space_prefix = prefix};
  return make(&v);
}

static void test_spm(void) {
  upf_tokenizer *t1 = tiny_spm(-1, -2, 1, 1, 0), *t2 = tiny_spm(-2, -1, 1, 1, 0);
  /* the higher score merges first */
  EXPECT(t1, "abc", 0, 6, 5);
  EXPECT(t2, "abc", 0, 3, 7);
  /* equal scores: the leftmost pair */
  upf_tokenizer *t3 = tiny_spm(-1, -1, 1, 1, 0);
  EXPECT(t3, "abc", 0, 6, 5);
  /* ' ' is ▁; "▁a" beats "▁" + "a" */
  EXPECT(t1, "a a", UPF_TOKENIZE_ADD_SPECIAL, 1, 3, 9);
  /* é (C3 A9) has no token: its bytes; ü (C3 BC): byte C3, then no byte token for BC: the unknown token */
  EXPECT(t1, "\xc3\xa9", 0, 10, 11);
  EXPECT(t1, "\xc3\xbc", 0, 10, 0);
  /* user-defined "\n\n" is split out first; the control "<nl>" only with PARSE_SPECIAL */
  EXPECT(t1, "a\n\nb<nl>", UPF_TOKENIZE_PARSE_SPECIAL, 3, 13, 4, 12);
  /* the space prefix goes before the first text and the text after a special token */
  upf_tokenizer *tp = tiny_spm(-1, -2, 1, 1, 1);
  EXPECT(tp, "a<nl>a", UPF_TOKENIZE_ADD_SPECIAL | UPF_TOKENIZE_PARSE_SPECIAL, 1, 9, 12, 9);
  EXPECT(tp, "", UPF_TOKENIZE_ADD_SPECIAL, 1);
  /* decode: ▁ -> ' ', bytes back, the prefix space dropped again, BOS rendered on request */
  EXPECT_DECODE(tp, 0, "a\xc3\xa9 a", 9, 10, 11, 9);
  EXPECT_DECODE(tp, UPF_DETOKENIZE_RENDER_SPECIAL, "<s> a", 1, 9);
  EXPECT_DECODE(tp, UPF_DETOKENIZE_RENDER_SPECIAL | UPF_DETOKENIZE_REMOVE_SPECIAL, " a", 1, 9);
  /* no byte tokens and no unknown token: an error naming the byte */
  upf_tokenizer *tn = tiny_spm(-1, -2, 0, 0, 0);
  int32_t *ids = NULL;
  int64_t n = 0;
  CU_ASSERT_EQUAL(upf_tokenizer_encode(tn, "a\xc3\xa9", 3, 0, &ids, &n), UPF_ERR_INVALID_ARG);
  CU_ASSERT(ids == NULL && strstr(upf_last_error(), "0xC3"));
  /* without byte tokens the unknown token stands for each byte */
  upf_tokenizer *tu = tiny_spm(-1, -2, 1, 0, 0);
  EXPECT(tu, "\xc3\xa9", 0, 0, 0);
  upf_tokenizer_free(t1), upf_tokenizer_free(t2), upf_tokenizer_free(t3), upf_tokenizer_free(tp);
  upf_tokenizer_free(tn), upf_tokenizer_free(tu);
}

static void test_create_errors(void) {
  static const char *const dup[] = {"a", "b", "a"};
  upf_tokenizer_vocab v = {.model = UPF_TOKENIZER_SPM, .n_tokens = 3, .tokens = dup, .bos_id = -1, .eos_id = -1,
                           .unk_id = -1, .pad_id = -1};
  upf_tokenizer *t = NULL;
  CU_ASSERT_EQUAL(upf_tokenizer_create(&v, &t), UPF_ERR_INVALID_ARG);
  CU_ASSERT(t == NULL && strstr(upf_last_error(), "tokens[0] and tokens[2]"));
  v.n_tokens = 2, v.bos_id = 5;
  CU_ASSERT_EQUAL(upf_tokenizer_create(&v, &t), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "bos_id = 5") != NULL);
  v.bos_id = -1, v.add_bos = 1;
  CU_ASSERT_EQUAL(upf_tokenizer_create(&v, &t), UPF_ERR_INVALID_ARG);
  v.add_bos = 0, v.model = UPF_TOKENIZER_BPE; /* BPE without a pre-tokenizer */
  CU_ASSERT_EQUAL(upf_tokenizer_create(&v, &t), UPF_ERR_INVALID_ARG);
  /* an empty text gets llama.cpp's placeholder and matches nothing */
  static const char *const empty[] = {"a", ""};
  v.model = UPF_TOKENIZER_SPM, v.tokens = empty;
  CU_ASSERT_EQUAL_FATAL(upf_tokenizer_create(&v, &t), UPF_OK);
  CU_ASSERT_STRING_EQUAL(upf_tokenizer_token_text(t, 1, NULL), "[EMPTY_1]");
  CU_ASSERT_EQUAL(upf_tokenizer_find(t, "", 0), -1);
  upf_tokenizer_free(t);
}

/* ---- GGUF glue ---- */

/* A byte-level BPE tokenizer written by the GGUF writer: "hello world!" is hello|Ġworld|! (worked
 * out in tests/test_cli_tokenize.c too, which uses this file). Returns the writer (caller frees). */
upf_gguf_writer *upf_test_tiny_tokenizer_gguf(const char *pre) {
  static const char *const toks[] = {"<|endoftext|>", "<|im_start|>", "h", "e", "l", "o", "\xc4\xa0", "w", "r", "d",
                                     "he", "ll", "llo", "hello", "\xc4\xa0w", "or", "\xc4\xa0wor", "ld",
                                     "\xc4\xa0world", "!"};
  static const char *const merges[] = {"h e", "l l", "ll o", "he llo", "\xc4\xa0 w", "o r", "\xc4\xa0w or", "l d",
                                       "\xc4\xa0wor ld"};
  int32_t types[20];
  for (int i = 0; i < 20; i++)
    types[i] = i < 2 ? UPF_TOKEN_CONTROL : UPF_TOKEN_NORMAL;
  upf_gguf_writer *w = NULL;
  if (upf_gguf_writer_create(&w) != UPF_OK)
    return NULL;
  upf_status st = upf_gguf_set_str(w, "general.architecture", "llama");
  if (st == UPF_OK)
    st = upf_gguf_set_str(w, "tokenizer.ggml.model", "gpt2");
  if (st == UPF_OK && pre)
    st = upf_gguf_set_str(w, "tokenizer.ggml.pre", pre);
  if (st == UPF_OK)
    st = upf_gguf_set_arr_str(w, "tokenizer.ggml.tokens", toks, 20);
  if (st == UPF_OK)
    st = upf_gguf_set_arr(w, "tokenizer.ggml.token_type", UPF_GGUF_TYPE_INT32, types, 20);
  if (st == UPF_OK)
    st = upf_gguf_set_arr_str(w, "tokenizer.ggml.merges", merges, 9);
  if (st == UPF_OK)
    st = upf_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
  if (st == UPF_OK)
    st = upf_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 0);
  if (st == UPF_OK)
    st = upf_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", 1);
  if (st != UPF_OK) {
    upf_gguf_writer_free(w);
    return NULL;
  }
  return w;
}

static upf_status tokenizer_of(upf_gguf_writer *w, upf_tokenizer **t) {
  void *bytes = NULL;
  uint64_t size = 0;
  upf_gguf *g = NULL;
  upf_status st = upf_gguf_writer_to_memory(w, &bytes, &size);
  if (st == UPF_OK)
    st = upf_gguf_open_memory(bytes, size, "tiny.gguf", &g);
  if (st == UPF_OK)
    st = upf_tokenizer_from_gguf(g, t);
  upf_gguf_close(g);
  free(bytes);
  return st;
}

static void test_from_gguf(void) {
  upf_gguf_writer *w = upf_test_tiny_tokenizer_gguf("smollm");
  CU_ASSERT_PTR_NOT_NULL_FATAL(w);
  upf_tokenizer *t = NULL;
  CU_ASSERT_EQUAL_FATAL(tokenizer_of(w, &t), UPF_OK);
  CU_ASSERT_EQUAL(upf_tokenizer_n_tokens(t), 20);
  CU_ASSERT_EQUAL(upf_tokenizer_bos(t), 1);
  CU_ASSERT_EQUAL(upf_tokenizer_eos(t), 0);
  EXPECT(t, "hello world!", UPF_TOKENIZE_ADD_SPECIAL, 1, 13, 18, 19);
  EXPECT(t, "<|im_start|>hello", UPF_TOKENIZE_PARSE_SPECIAL, 1, 13);
  EXPECT_DECODE(t, UPF_DETOKENIZE_RENDER_SPECIAL, "<|im_start|>hello world!", 1, 13, 18, 19);
  upf_tokenizer_free(t);

  /* no tokenizer at all; an unknown model; a pre-tokenizer not implemented; a wrong key type */
  upf_gguf_writer *bare = NULL;
  CU_ASSERT_EQUAL_FATAL(upf_gguf_writer_create(&bare), UPF_OK);
  upf_gguf_set_str(bare, "general.architecture", "llama");
  CU_ASSERT_EQUAL(tokenizer_of(bare, &t), UPF_ERR_FORMAT);
  CU_ASSERT(t == NULL && strstr(upf_last_error(), "tiny.gguf: no tokenizer"));
  upf_gguf_set_str(bare, "tokenizer.ggml.model", "rwkv");
  CU_ASSERT_EQUAL(tokenizer_of(bare, &t), UPF_ERR_UNSUPPORTED);
  CU_ASSERT(strstr(upf_last_error(), "\"rwkv\"") != NULL);
  upf_gguf_writer_free(bare);
  upf_gguf_set_str(w, "tokenizer.ggml.pre", "llama-bpe");
  CU_ASSERT_EQUAL(tokenizer_of(w, &t), UPF_ERR_UNSUPPORTED);
  CU_ASSERT(strstr(upf_last_error(), "\"llama-bpe\"") != NULL);
  upf_gguf_set_str(w, "tokenizer.ggml.pre", "gpt-2");
  upf_gguf_set_str(w, "tokenizer.ggml.bos_token_id", "one");
  CU_ASSERT_EQUAL(tokenizer_of(w, &t), UPF_ERR_FORMAT);
  CU_ASSERT(strstr(upf_last_error(), "bos_token_id") != NULL);
  upf_gguf_writer_free(w);
}

/* ---- the real files against the golden ids ---- */

typedef struct {
  char model[128], name[64];
  int roundtrip, parse_special;
  char *text;
  int64_t len;
  int32_t *ids;
  int64_t n;
} golden_case;

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

/* Reads tests/data/tokenizer_golden.txt (see tests/tokenizer_golden.py). */
static golden_case *read_golden(int *count) {
  FILE *f = fopen("tests/data/tokenizer_golden.txt", "r");
  if (!f)
    return NULL;
  golden_case *c = NULL;
  int n = 0;
  char *line = NULL;
  size_t cap = 0;
  ssize_t got;
  while ((got = getline(&line, &cap, f)) > 0) {
    if (line[got - 1] == '\n')
      line[--got] = 0;
    if (!strncmp(line, "case ", 5)) {
      golden_case *p = realloc(c, (size_t)(n + 1) * sizeof *c);
      if (!p)
        break;
      c = p;
      memset(&c[n], 0, sizeof c[n]);
      char hf[16];
      c[n].parse_special = 1;
      sscanf(line, "case %127s %63s roundtrip=%d hf=%15s parse_special=%d", c[n].model, c[n].name, &c[n].roundtrip, hf,
             &c[n].parse_special);
      n++;
    } else if (n && !strncmp(line, "text ", 5)) {
      int64_t hl = (int64_t)strlen(line + 5);
      c[n - 1].text = malloc((size_t)hl / 2 + 1);
      for (int64_t i = 0; i + 1 < hl; i += 2)
        c[n - 1].text[i / 2] = (char)(hexval(line[5 + i]) << 4 | hexval(line[6 + i]));
      c[n - 1].len = hl / 2;
    } else if (n && !strncmp(line, "ids ", 4)) {
      char *p = line + 4;
      long long k = strtoll(p, &p, 10);
      c[n - 1].ids = malloc((size_t)(k ? k : 1) * sizeof(int32_t));
      for (long long i = 0; i < k; i++)
        c[n - 1].ids[i] = (int32_t)strtol(p, &p, 10);
      c[n - 1].n = k;
    }
  }
  free(line);
  fclose(f);
  *count = n;
  return c;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void golden_for(const char *model) {
  if (upf_test_quick()) {
    printf("\n  SKIPPED tokenizer/%s: quick mode (Valgrind): the real vocabularies are covered natively", model);
    return;
  }
  /* as ci/fetch-models.sh and the gguf suite: UPF_MODEL_DIR, else $UPF_MODEL_CACHE/models, else
   * ~/.cache/uniprefill/models */
  const char *dir = getenv("UPF_MODEL_DIR"), *cache = getenv("UPF_MODEL_CACHE"), *home = getenv("HOME");
  char path[1024];
  if (dir && *dir)
    snprintf(path, sizeof path, "%s/%s", dir, model);
  else if (cache && *cache)
    snprintf(path, sizeof path, "%s/models/%s", cache, model);
  else
    snprintf(path, sizeof path, "%s/.cache/uniprefill/models/%s", home ? home : "", model);
  FILE *probe = fopen(path, "rb");
  if (!probe) {
    printf("\n  SKIPPED tokenizer/%s: %s is absent (ci/fetch-models.sh fetches it; UPF_MODEL_DIR or UPF_MODEL_CACHE "
           "choose the directory)",
           model, path);
    return;
  }
  fclose(probe);
  int count = 0;
  golden_case *c = read_golden(&count);
  CU_ASSERT_FATAL(c != NULL && count > 0);
  double t0 = now();
  upf_gguf *g = NULL;
  upf_tokenizer *t = NULL;
  upf_status st = upf_gguf_open(path, &g);
  if (st == UPF_OK)
    st = upf_tokenizer_from_gguf(g, &t);
  upf_gguf_close(g);
  double t_load = now() - t0;
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  int cases = 0, trips = 0;
  double t_enc = 0;
  for (int i = 0; i < count; i++) {
    if (strcmp(c[i].model, model))
      continue;
    cases++;
    int32_t *ids = NULL;
    int64_t n = 0;
    double t1 = now();
    int flags = UPF_TOKENIZE_ADD_SPECIAL | (c[i].parse_special ? UPF_TOKENIZE_PARSE_SPECIAL : 0);
    st = upf_tokenizer_encode(t, c[i].text, c[i].len, flags, &ids, &n);
    t_enc += now() - t1;
    int ok = st == UPF_OK && ids_equal(ids, n, c[i].ids, c[i].n);
    CU_ASSERT(ok);
    if (!ok) {
      printf("\n  %s/%s: %s", model, c[i].name, st == UPF_OK ? "ids differ" : upf_last_error());
      print_ids("want", c[i].ids, c[i].n);
      print_ids("got", ids, n);
    }
    free(ids);
    if (!c[i].roundtrip)
      continue;
    trips++;
    st = upf_tokenizer_encode(t, c[i].text, c[i].len, UPF_TOKENIZE_PARSE_SPECIAL, &ids, &n);
    char *text = NULL;
    int64_t len = 0;
    if (st == UPF_OK)
      st = upf_tokenizer_decode(t, ids, n, UPF_DETOKENIZE_RENDER_SPECIAL, &text, &len);
    ok = st == UPF_OK && len == c[i].len && !memcmp(text, c[i].text, (size_t)len);
    CU_ASSERT(ok);
    if (!ok)
      printf("\n  %s/%s: decode(encode(x)) != x: \"%.*s\"", model, c[i].name, text ? (int)len : 0, text ? text : "");
    free(ids);
    free(text);
  }
  CU_ASSERT(cases >= 20);
  printf("\n  %s: %d tokens loaded in %.3f s; %d cases encoded in %.3f s, %d round trips", model,
         upf_tokenizer_n_tokens(t), t_load, cases, t_enc, trips);
  upf_tokenizer_free(t);
  for (int i = 0; i < count; i++)
    free(c[i].text), free(c[i].ids);
  free(c);
}

static void test_golden_smollm2(void) { golden_for("SmolLM2-135M-Instruct.Q4_1.gguf"); }
static void test_golden_gemma3(void) { golden_for("gemma-3-270m-q4_k_m.gguf"); }

/* Random bytes through both tiny models: every call succeeds (the SPM one has an unknown token; no
 * sequence here decodes above U+10FFFF), the ids are in range and decode. */
static void test_random_bytes(void) {
  static const char *const merges[] = {"a b", "b c", "ab c", "\xc4\xa0 a", "a a"};
  upf_tokenizer *bpe = tiny_bpe(merges, 5, UPF_TOKENIZER_PRE_SMOLLM);
  upf_tokenizer *spm = tiny_spm(-1, -2, 1, 1, 1);
  static const char alphabet[] = "abc !<>s/u1\n\xc3\xa9\xe2\x96\x81\x80\xf0";
  uint64_t x = 0x9e3779b97f4a7c15ull;
  int iters = upf_test_quick() ? 40 : 2000;
  for (int it = 0; it < iters; it++) {
    char text[48];
    int len = (int)(it % 48);
    for (int i = 0; i < len; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      text[i] = alphabet[x % (sizeof alphabet - 1)];
    }
    for (int m = 0; m < 2; m++) {
      const upf_tokenizer *t = m ? spm : bpe;
      int32_t *ids = NULL;
      int64_t n = 0;
      upf_status st = upf_tokenizer_encode(t, text, len, UPF_TOKENIZE_PARSE_SPECIAL | (it & 1), &ids, &n);
      CU_ASSERT_EQUAL(st, UPF_OK);
      for (int64_t i = 0; i < n; i++)
        CU_ASSERT(ids[i] >= 0 && ids[i] < upf_tokenizer_n_tokens(t));
      char *back = NULL;
      int64_t blen = 0;
      CU_ASSERT_EQUAL(upf_tokenizer_decode(t, ids, n, UPF_DETOKENIZE_RENDER_SPECIAL, &back, &blen), UPF_OK);
      free(ids);
      free(back);
    }
  }
  upf_tokenizer_free(bpe);
  upf_tokenizer_free(spm);
}

static CU_TestInfo tokenizer_tests[] = {
    {"utf-8 as llama.cpp reads it", test_utf8},
    {"gpt2 and smollm pre-tokenizers split by hand", test_pretokenize},
    {"bpe: merge rank order, leftmost ties, bytes, dropped bytes", test_bpe_merge_order},
    {"special tokens: control, user-defined, longest first, empty text", test_special_tokens},
    {"bpe decode: pieces, specials, out-of-range ids, clean-up", test_bpe_decode},
    {"spm: score order, byte fallback, unknown, space prefix, decode", test_spm},
    {"create: duplicate, range and empty-text checks", test_create_errors},
    {"random bytes through both models", test_random_bytes},
    {"from_gguf: a written file, and files without a usable tokenizer", test_from_gguf},
    {"golden: SmolLM2-135M (byte-level BPE)", test_golden_smollm2},
    {"golden: Gemma-3-270M (SentencePiece)", test_golden_gemma3},
    CU_TEST_INFO_NULL,
};

void upf_register_tokenizer_tests(void) { upf_test_suite("tokenizer", NULL, NULL, tokenizer_tests); }
