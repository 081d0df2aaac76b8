/* Text <-> token ids for the two tokenizers GGUF files describe: byte-level BPE with merges
 * (tokenizer.ggml.model "gpt2", pre-tokenizers "gpt2" and "smollm" and its aliases) and SentencePiece
 * with scores and byte fallback (model "llama"). The semantics are llama.cpp's (llama-vocab.cpp), the
 * implementation the files are made for: special tokens found in the text first (longest first),
 * then the model's own algorithm on each stretch of text between them.
 *
 * The core is built from plain arrays (upf_tokenizer_vocab), which it copies; upf_tokenizer_from_gguf
 * fills those arrays from a file's tokenizer.ggml.* metadata. Lookups are hash tables, so building
 * Gemma-3's 262144-token vocabulary takes milliseconds. A tokenizer is immutable once built and can be
 * shared between threads. */
#ifndef UNIPREFILL_TOKENIZER_H
#define UNIPREFILL_TOKENIZER_H

#include <stdint.h>

#include "uniprefill/gguf.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  UPF_TOKENIZER_BPE, /* "gpt2": byte-level BPE, merges ranked by their order */
  UPF_TOKENIZER_SPM, /* "llama": SentencePiece BPE by score, <0xXX> byte fallback, ' ' as U+2581 */
} upf_tokenizer_model;

/* The pre-tokenizer (tokenizer.ggml.pre) of a BPE model; SPM models have none (UPF_TOKENIZER_PRE_NONE). */
typedef enum {
  UPF_TOKENIZER_PRE_NONE,
  /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
  UPF_TOKENIZER_PRE_GPT2,
  /* every \p{N} codepoint on its own, then the gpt2 expression: "smollm", "starcoder", "refact",
   * "command-r", "codeshell", "exaone", "minerva-7b", "mellum2" */
  UPF_TOKENIZER_PRE_SMOLLM,
} upf_tokenizer_pre;

/* Token types, numbered as tokenizer.ggml.token_type stores them. */
typedef enum {
  UPF_TOKEN_UNDEFINED = 0,
  UPF_TOKEN_NORMAL = 1,
  UPF_TOKEN_UNKNOWN = 2,
  UPF_TOKEN_CONTROL = 3,      /* <bos>, <|im_end|>: matched in text only with UPF_TOKENIZE_PARSE_SPECIAL */
  UPF_TOKEN_USER_DEFINED = 4, /* always matched in text before the model runs */
  UPF_TOKEN_UNUSED = 5,
  UPF_TOKEN_BYTE = 6, /* SPM "<0xXX>" */
} upf_token_type;

typedef struct {
  upf_tokenizer_model model;
  upf_tokenizer_pre pre; /* BPE only */
  int32_t n_tokens;
  const char *const *tokens; /* (n_tokens) token texts, as the file stores them (Ġ for a BPE space, U+2581 for SPM) */
  const int64_t *token_lens; /* (n_tokens) byte lengths, or NULL: NUL-terminated */
  const float *scores;       /* (n_tokens) SPM merge scores, or NULL: all 0 */
  const int32_t *types;      /* (n_tokens) upf_token_type values, or NULL: all NORMAL */
  int64_t n_merges;
  const char *const *merges; /* (n_merges) BPE merges "left right", NUL-terminated; rank = index */
  int32_t bos_id, eos_id, unk_id, pad_id; /* -1 when the model has none */
  int add_bos, add_eos;   /* what UPF_TOKENIZE_ADD_SPECIAL adds */
  int add_space_prefix;   /* SPM: a space before text that starts the input or follows a special token;
                             decode (both models) drops the first piece's leading space */
  int clean_spaces;       /* BPE decode: llama.cpp's clean-up (" ," -> ",", " 's" -> "'s", ...) */
} upf_tokenizer_vocab;

typedef struct upf_tokenizer upf_tokenizer;

/* Builds a tokenizer from the arrays of `v` (copied: the caller may free them afterwards).
 * UPF_ERR_INVALID_ARG names the field at fault: a duplicate token text, an id out of range, a
 * BPE vocabulary without merges, an SPM one with merges. An empty token text becomes "[EMPTY_<id>]",
 * as in llama.cpp. */
upf_status upf_tokenizer_create(const upf_tokenizer_vocab *v, upf_tokenizer **out);

/* Reads tokenizer.ggml.{model, pre, tokens, scores, token_type, merges, bos_token_id, eos_token_id,
 * unknown_token_id, padding_token_id, add_bos_token, add_eos_token, add_space_prefix} with llama.cpp's
 * defaults for absent keys. UPF_ERR_FORMAT names the file and key when the file has no tokenizer or
 * a key has the wrong type; UPF_ERR_UNSUPPORTED names a model or pre-tokenizer this code lacks. */
upf_status upf_tokenizer_from_gguf(const upf_gguf *g, upf_tokenizer **out);

void upf_tokenizer_free(upf_tokenizer *t); /* NULL is fine */

enum {
  /* the model's default specials: BOS when add_bos, EOS when add_eos (llama.cpp's add_special) */
  UPF_TOKENIZE_ADD_SPECIAL = 1 << 0,
  /* control and unknown tokens written in the text ("<|im_start|>") become their ids (llama.cpp's
   * parse_special); without it they are tokenized as text. User-defined tokens always match. */
  UPF_TOKENIZE_PARSE_SPECIAL = 1 << 1,
};

/* Tokenizes `len` bytes of UTF-8 text (no NUL needed). *ids is malloc'd ((*n_ids) ids; free with
 * free(); NULL when *n_ids is 0).
 * Invalid UTF-8 is handled as llama.cpp does: BPE reads each byte that does not start a well-formed
 * sequence as U+FFFD (so it tokenizes as the bytes EF BF BD); SPM keeps the bytes, which reach the
 * model as <0xXX> byte tokens. For BPE, a 4-byte sequence above U+10FFFF (where llama.cpp throws)
 * gives UPF_ERR_INVALID_ARG naming its offset. An SPM byte that has no byte token gives the unknown token
 * (SentencePiece's rule; llama.cpp aborts), or UPF_ERR_INVALID_ARG when the vocabulary has none. */
upf_status upf_tokenizer_encode(const upf_tokenizer *t, const char *text, int64_t len, int flags, int32_t **ids,
                                int64_t *n_ids);

enum {
  /* control and unknown tokens are written as their text ("<bos>"); without it they give nothing */
  UPF_DETOKENIZE_RENDER_SPECIAL = 1 << 0,
  /* a leading BOS and a trailing EOS the model adds by default are dropped (llama.cpp's remove_special) */
  UPF_DETOKENIZE_REMOVE_SPECIAL = 1 << 1,
};

/* Turns ids back into text (llama.cpp's llama_detokenize): BPE pieces are mapped back to their
 * bytes, SPM pieces have U+2581 replaced by ' ' and byte tokens give their byte; with
 * add_space_prefix the leading space of the first piece is dropped. *text is malloc'd and
 * NUL-terminated (*len bytes before the NUL). An id outside [0, n_tokens) gives UPF_ERR_INVALID_ARG
 * naming its position and value. */
upf_status upf_tokenizer_decode(const upf_tokenizer *t, const int32_t *ids, int64_t n_ids, int flags, char **text,
                                int64_t *len);

/* The bytes one token decodes to, control tokens rendered (llama.cpp's token_to_piece with special):
 * malloc'd and NUL-terminated. UPF_ERR_INVALID_ARG for an id out of range. */
upf_status upf_tokenizer_piece(const upf_tokenizer *t, int32_t id, char **piece, int64_t *len);

int32_t upf_tokenizer_n_tokens(const upf_tokenizer *t);
int32_t upf_tokenizer_bos(const upf_tokenizer *t); /* -1 when none */
int32_t upf_tokenizer_eos(const upf_tokenizer *t); /* -1 when none */
int upf_tokenizer_add_bos(const upf_tokenizer *t); /* whether UPF_TOKENIZE_ADD_SPECIAL adds a BOS */
upf_tokenizer_model upf_tokenizer_model_kind(const upf_tokenizer *t);
/* The token text as the vocabulary stores it and its type; NULL / UPF_TOKEN_UNDEFINED out of range. */
const char *upf_tokenizer_token_text(const upf_tokenizer *t, int32_t id, int64_t *len);
upf_token_type upf_tokenizer_token_type(const upf_tokenizer *t, int32_t id);
/* The id of an exact token text, or -1. */
int32_t upf_tokenizer_find(const upf_tokenizer *t, const char *text, int64_t len);

#ifdef __cplusplus
}
#endif
#endif
