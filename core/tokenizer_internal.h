/* Pieces the tokenizer's source files share: UTF-8 as llama.cpp reads and writes it, the Unicode
 * classes of the BPE pre-tokenizer, and the pre-tokenizer itself. Not part of the public API. */
#ifndef UNIPREFILL_TOKENIZER_INTERNAL_H
#define UNIPREFILL_TOKENIZER_INTERNAL_H

#include <stdint.h>

#include "uniprefill/status.h"
#include "uniprefill/tokenizer.h"

typedef struct {
  uint32_t lo, hi; /* inclusive */
} upf_unicode_range;

/* core/tokenizer_unicode.c (generated): general categories L and N. */
extern const upf_unicode_range upf_unicode_letters[];
extern const int64_t upf_unicode_letters_count;
extern const upf_unicode_range upf_unicode_numbers[];
extern const int64_t upf_unicode_numbers_count;

/* Bytes of the UTF-8 sequence a lead byte announces, from its high nibble alone (1 for continuation
 * bytes and 0xF8..0xFF): llama.cpp's unicode_len_utf8, which both models use to cut text into symbols. */
static inline int upf_utf8_len(uint8_t lead) {
  static const uint8_t lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return lookup[lead >> 4];
}

/* Appends the UTF-8 form of a codepoint <= 0x10FFFF to out (1..4 bytes); returns the byte count. */
int upf_utf8_put(uint32_t cpt, uint8_t *out);

/* Decodes text into codepoints as llama.cpp's unicode_cpts_from_utf8: a sequence needs only the
 * right lead and continuation bits (overlong forms and surrogates pass), and a byte that starts no
 * such sequence becomes U+FFFD. cpts has room for len entries; returns the count, or -1 when a
 * sequence decodes above U+10FFFF (*bad_offset is then its byte offset). */
int64_t upf_utf8_decode(const uint8_t *text, int64_t len, uint32_t *cpts, int64_t *bad_offset);

/* Classes the gpt2 expression tests. */
enum { UPF_CPT_LETTER = 1, UPF_CPT_NUMBER = 2, UPF_CPT_SPACE = 4, UPF_CPT_OTHER = 8 };
/* Exactly one class bit: \s (llama.cpp's whitespace set), else \p{L}, else \p{N}, else other. */
int upf_cpt_class(uint32_t cpt);

/* Splits codepoints into pre-tokenizer words: the lengths (in codepoints) of the words, in order,
 * written to word_len (room for n entries); returns their count, or -1 when memory ran out. */
int64_t upf_pretokenize(upf_tokenizer_pre pre, const uint32_t *cpts, int64_t n, int64_t *word_len);

#endif
