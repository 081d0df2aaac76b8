/* The SentencePiece vocabulary the fuzz harness and its seeds share: <unk>, <s>, </s>, the 256 byte-fallback
 * tokens <0x00>..<0xFF>, then `nw` words scored by rank (earlier is preferred); the last word gets
 * `last_type` (a control or user-defined special). */
#ifndef UNIPREFILL_FUZZ_SPM_VOCAB_H
#define UNIPREFILL_FUZZ_SPM_VOCAB_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/tokenizer.h"

#define FUZZ_SPM_FIXED 259 /* the specials and byte tokens before the words */

/* Fills texts (strdup'ed: free each), types and scores for FUZZ_SPM_FIXED + nw tokens. */
static inline void fuzz_spm_vocab(const char *const *words, int nw, int32_t last_type, char **texts, int32_t *types,
                                  float *scores) {
  const int n = FUZZ_SPM_FIXED + nw;
  for (int i = 0; i < n; i++) {
    char buf[32];
    if (i < 3)
      snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
    else if (i < FUZZ_SPM_FIXED)
      snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
    else
      snprintf(buf, sizeof buf, "%s", words[i - FUZZ_SPM_FIXED]);
    texts[i] = strdup(buf);
    types[i] = i == 0 ? UPF_TOKEN_UNKNOWN : i < 3 ? UPF_TOKEN_CONTROL : i < FUZZ_SPM_FIXED ? UPF_TOKEN_BYTE
               : i == n - 1 ? last_type : UPF_TOKEN_NORMAL;
    scores[i] = i < FUZZ_SPM_FIXED ? 0.0f : -(float)(i - FUZZ_SPM_FIXED);
  }
}

#endif
