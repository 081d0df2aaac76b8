/* Accuracy of UniPrefill (and of FlashPrefill V2) against dense prefill: the metrics (perplexity from next-token NLLs, top-1
 * agreement and KL divergence between two rows of logits, the greedy answer check), the windows a
 * long text is cut into, the needle prompt builder, the extension of recorded drop masks to tokens
 * appended after a prompt, and the runs on a model that produce what the metrics read. The metric
 * and builder functions are pure functions of their inputs; the runs call upf_model_prefill. */
#ifndef UNIPREFILL_EVAL_H
#define UNIPREFILL_EVAL_H

#include <stdint.h>

#include "uniprefill/model.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Metrics (double accumulation throughout) ---- */

/* The index of the largest logit; ties go to the lowest id (as --out-argmax). */
int32_t upf_eval_argmax(const float *logits, int32_t V);
/* -log softmax(logits)[target]: the next-token NLL, nats. */
double upf_eval_nll(const float *logits, int32_t V, int32_t target);
/* KL(softmax(p) || softmax(q)) in nats: p the reference (dense), q the approximation. >= 0. */
double upf_eval_kl(const float *p, const float *q, int32_t V);
/* exp(mean of nll[0..n)); n >= 1. */
double upf_eval_ppl(const double *nll, int64_t n);

/* Agreement of n positions of an approximation with the reference, accumulated over calls. */
typedef struct {
  int64_t positions; /* positions compared */
  int64_t agree;     /* of which the two argmaxes are equal */
  double kl_sum;     /* sum over positions of KL(reference || approximation), nats */
  double kl_max;
} upf_eval_agreement;

/* Adds n positions: ref and approx (n, V) logits, row i of each at the same position. A non-finite
 * logit fails with UPF_ERR_NONFINITE naming the row. */
upf_status upf_eval_agreement_add(upf_eval_agreement *acc, const float *ref, const float *approx, int64_t n, int32_t V);

/* Greedy decoding produces `answer` (n tokens) after a prompt iff, with the prompt + answer[0..n-1)
 * prefilled, the argmax at the prompt's last position is answer[0] and at the position of
 * answer[i-1] is answer[i]. argmax (n): the argmax at those n positions, in order. */
int upf_eval_answer_correct(const int32_t *argmax, const int32_t *answer, int64_t n);

/* ---- Windows of a text ---- */

/* `count` windows of `window` tokens inside a text of `text_len` tokens, spread evenly from the
 * start to the end (the first at 0; with two or more, the last ending at text_len); starts (count)
 * ascending. Consecutive starts
 * differ by at least min_stride, so windows never share their last min_stride positions. Fails naming
 * the sizes when the text is too short. */
upf_status upf_eval_windows(int64_t text_len, int64_t window, int32_t count, int64_t min_stride, int64_t *starts);

/* ---- Needle in a haystack ---- */

/* The pieces of a needle prompt, each as token ids: head + filler[0, a) + fact + filler[a, F) +
 * question, F filler tokens so that the prompt has the requested length. */
typedef struct {
  const int32_t *head;   int64_t head_len;     /* (head_len) BOS and the task's instruction */
  const int32_t *filler; int64_t filler_len;   /* (filler_len) natural text */
  const int64_t *breaks; int64_t num_breaks;   /* (num_breaks) ascending offsets into filler where a
                                                * sentence starts; NULL: the fact may go anywhere */
  const int32_t *fact;   int64_t fact_len;     /* (fact_len) the sentence holding the value */
  const int32_t *question; int64_t question_len; /* (question_len) the question and the answer's lead-in */
} upf_needle_parts;

/* Builds a prompt of `length` tokens with the fact at relative depth `depth` in [0, 1] of the filler:
 * a = the break nearest depth * F (the lower one on a tie; depth * F itself, rounded, without breaks).
 * ids (length); *fact_at = head_len + a, the fact's first position. Fails when the pieces do not fit
 * in `length` or the filler is shorter than F. */
upf_status upf_needle_build(const upf_needle_parts *parts, int64_t length, double depth, int32_t *ids, int64_t *fact_at);

/* ---- Replayed masks over a longer input ---- */

/* The masks of a UniPrefill run over a prompt of one request, extended for `extra` tokens appended
 * after it: every drop layer's mask gets `extra` ones at its end (the appended tokens follow the
 * prompt's kept tokens in every compacted order, and each is kept, as a decoded token is). masks[k]
 * (res->drops[k].tokens_in + extra), malloc'd (free each); lens[k] its length. The drop records must
 * come from a one-request run. */
upf_status upf_eval_extend_masks(const upf_prefill_result *res, int64_t extra, uint8_t **masks, int64_t *lens);

/* Per drop layer: the share of the request's tokens still held after the layer (kept / prompt). */
void upf_eval_keep_ratios(const upf_prefill_result *res, int64_t tokens, double *ratios);

/* ---- Runs on a model (one request) ---- */

/* Prefill of ids (n) under opt, writing the logits of the last `last` positions (last, V), in order;
 * res keeps the run's drop records (free with upf_prefill_result_free). In UniPrefill mode those
 * positions must be kept: last <= the selection's last_q, which every drop layer keeps. */
upf_status upf_eval_prefill_last(const upf_model *m, const int32_t *ids, int64_t n, const upf_prefill_options *opt,
                                 int64_t last, float *logits, upf_prefill_result *res);
/* Dense prefill of ids (n >= 2): nll (n - 1), nll[t] = -log p(ids[t + 1] | ids[0..t]). */
upf_status upf_eval_prefill_nll(const upf_model *m, const int32_t *ids, int64_t n, double *nll);

/* What one greedy answer check found. */
typedef struct {
  int correct;            /* greedy decoding after the prompt produces the answer */
  int32_t first;          /* argmax at the prompt's last position in the prompt + answer run */
  int32_t prompt_first;   /* UniPrefill: the same argmax in the prompt-only run that chose the masks */
  int num_drops;
  double keep[UPF_MODEL_MAX_LAYERS]; /* UniPrefill: kept share of the prompt after each drop layer */
  /* FlashPrefill: kept key blocks over visible ones in the run, over all its full-attention layers and
   * per layer (num_sparse of them, in layer order) */
  double kept_share;
  int32_t num_sparse;
  double layer_kept_share[UPF_MODEL_MAX_LAYERS];
} upf_eval_answer;

/* Checks whether greedy decoding after `prompt` (P tokens) produces `answer` (A tokens), without a
 * decode loop: one prefill of prompt + answer[0..A-1) and the argmax at its last A positions.
 * sel NULL: dense. sel given: UniPrefill as deployed: the prompt is prefilled first (its drop layers
 * select), then prompt + answer replays those masks, each extended with a kept entry per answer
 * token (as decoding appends kept tokens), so every answer token sees exactly the prompt tokens a
 * decode step after that prefill would see. */
upf_status upf_eval_check_answer(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer, int64_t A,
                                 const upf_select_params *sel, upf_eval_answer *out);
/* The same check under FlashPrefill V2 with `sparse` (upf_prefill_options.sparse): it drops no token,
 * so there are no masks to replay; the one prefill of prompt + answer[0..A-1) runs in FlashPrefill
 * mode (the answer positions sit in the request's last, dense, query tiles unless A exceeds them).
 * out->first == out->prompt_first; kept_share and layer_kept_share are the run's. */
upf_status upf_eval_check_answer_sparse(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer,
                                        int64_t A, const upf_sparse_params *sparse, upf_eval_answer *out);

/* ---- Chunked prefill through a session (SPEC section 9) ---- */

/* upf_eval_prefill_last over a prefill in chunks of `chunk` tokens through a one-request session
 * (uniprefill/session.h) in opt->mode with opt->select, opt->sparse and opt->compact (COMPACT: the
 * chunks with cached context run CompactAttention). The last `last` positions are gathered across
 * chunks when they reach past the final one: each chunk hands back the part of them it holds (the
 * session step's tail_logits). res sums the steps: the final chunk's logits, the layer times and
 * tokens, the sparse records per layer (kept and visible blocks, times) over every step that had them;
 * the drop records of a prompt of at most `chunk` tokens (one whole-prompt row). chunks (may be NULL):
 * the steps run. */
upf_status upf_eval_prefill_last_chunked(const upf_model *m, const int32_t *ids, int64_t n,
                                         const upf_prefill_options *opt, int64_t chunk, int64_t last, float *logits,
                                         upf_prefill_result *res, int32_t *chunks);

/* The greedy answer check as a chunked-prefill server runs it: the prompt prefilled in chunks of `chunk`
 * through a session as upf_eval_prefill_last_chunked does, then answer[0..A-1) fed as decode rows (dense,
 * over the whole cache). correct iff the final chunk's argmax is answer[0] and the decode row fed
 * answer[i-1] has argmax answer[i]. out->first == out->prompt_first; kept_share and layer_kept_share are
 * the prefill's sparse records (COMPACT, FLASHPREFILL), num_drops / keep a one-row UniPrefill prompt's. */
upf_status upf_eval_check_answer_chunked(const upf_model *m, const int32_t *prompt, int64_t P, const int32_t *answer,
                                         int64_t A, const upf_prefill_options *opt, int64_t chunk,
                                         upf_eval_answer *out);

#ifdef __cplusplus
}
#endif
#endif
