/* The continuous-batching engine (issue 17): a request trace run step by step over a model step
 * (upf_engine_ops; the per-request model state with paged KV of session.h, or a fake in the
 * scheduler's tests). Each step holds one decode row per running request and the prefill rows of the
 * requests admitted at that step (or, with chunked prefill, the next chunks of the prompts in
 * progress and of new ones), within a token budget and the KV page budget; greedy sampling picks
 * each row's next token; a simulated clock advances by each step's measured duration, and the result
 * holds TTFT and TPOT percentiles, throughput, batch composition, KV memory and per-request records. */
#ifndef UNIPREFILL_ENGINE_H
#define UNIPREFILL_ENGINE_H

#include <stdint.h>

#include "uniprefill/model.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- The request trace ---- */

/* Bounds of a trace. Arrivals lie within UPF_TRACE_MAX_ARRIVAL seconds: beyond it a double's spacing
 * passes a microsecond and the times measured from an arrival (TTFT) absorb into it. A trace holds
 * at most UPF_TRACE_MAX_REQUESTS requests (its checks are n log n; the KV pool is sized by
 * --max-live, not by the trace). */
#define UPF_TRACE_MAX_ARRIVAL 1e9
#define UPF_TRACE_MAX_REQUESTS (1 << 22)
/* At most this many prompt tokens in a trace, all requests together (its seeded prompts are made when
 * it is read: 256 MiB of ids). */
#define UPF_TRACE_MAX_TOKENS ((int64_t)1 << 26)

typedef struct {
  int64_t id;         /* the trace's id of the request (reported; unique in a trace) */
  double arrival;     /* seconds on the simulated clock */
  int32_t prompt_len; /* n >= 1 */
  int32_t *prompt;    /* (n) token ids, owned by the trace */
  int32_t max_new;    /* tokens to generate, >= 1 (the first comes from the prefill) */
} upf_engine_request;

typedef struct {
  int32_t num_reqs;
  upf_engine_request *reqs; /* (num_reqs) by arrival, ties in the order given */
} upf_trace;

/* A seeded trace: num_reqs requests, prompt lengths uniform in [len_min, len_max], prompts of seeded
 * ids (upf_model_seeded_ids of a per-request seed), max_new each, arrivals a Poisson process of `rate`
 * requests per second (exponential gaps from the seed; the first request at its first gap), or all at
 * t = 0 when rate is 0 or infinite. Ids 0 .. num_reqs-1. */
typedef struct {
  int32_t num_reqs;
  int32_t len_min, len_max;
  int32_t max_new;
  double rate;
  uint64_t seed;
} upf_trace_spec;
upf_status upf_trace_seeded(upf_trace *t, const upf_trace_spec *spec, int32_t vocab);

/* A JSON-lines trace, one request per line, an object with the keys
 *   "arrival" (seconds >= 0, required),
 *   "prompt" (an array of token ids) or "prompt_len" (n >= 1) with an optional "seed" (default: the line
 *   number) for seeded ids,
 *   "max_new" (>= 1; default `default_max_new`), "id" (an integer; default the line number, from 1).
 * Blank lines are skipped. Requests are ordered by arrival (stable). A malformed line, an unknown key,
 * an id outside [0, vocab), a repeated id or a line that takes the trace past UPF_TRACE_MAX_TOKENS
 * prompt tokens fails naming the file and line. */
upf_status upf_trace_read_jsonl(upf_trace *t, const char *path, int32_t vocab, int32_t default_max_new);
/* The same from a string (the file's contents); `name` names it in messages. */
upf_status upf_trace_parse_jsonl(upf_trace *t, const char *text, const char *name, int32_t vocab,
                                 int32_t default_max_new);
void upf_trace_free(upf_trace *t);

/* ---- The model step the engine drives ---- */

/* One row of a step: the whole prompt of a request admitted at this step or a chunk of it (prefill),
 * or the last token a running request generated (decode, one token). */
typedef struct {
  int32_t req;        /* the request's index in the trace */
  int32_t prefill;    /* 1: prefill row; 0: decode row */
  int32_t num_tokens; /* prefill: the prompt length, or the chunk's; decode: 1 */
  const int32_t *ids; /* (num_tokens) host: prefill, prompt tokens [start, start + num_tokens) */
  int32_t start;      /* prefill: prompt tokens prefilled before this row (0: the row starts the prompt) */
  int32_t prompt_len; /* prefill: the whole prompt's length (ids - start holds it); a row with
                       * num_tokens < prompt_len is a chunk */
} upf_engine_row;

/* KV memory of the live requests: the pages they hold, the pages the same requests would hold
 * without drops (dense), the same in bytes, and the bytes of the whole page budget. */
typedef struct {
  int64_t pages_in_use, pages_dense;
  double bytes_in_use, bytes_dense, bytes_capacity;
} upf_engine_memory;

/* The seam between the scheduler and the model (upf_engine_session_ops over a session.h session, or a
 * fake in the scheduler's tests). KV pages come in cache groups, each with its own page budget; a
 * request holds pages in every group. */
typedef struct {
  void *ctx;
  int32_t vocab;
  int32_t num_groups;
  int32_t max_live; /* requests holding state at once; 0: no limit */
  /* Runs the rows (a request's prefill row first, or its first chunk; the model registers it then);
   * fills logits (n, vocab) host f32 with each row's last-position logits (a chunk that does not end
   * its prompt: not sampled) and *seconds with the step's duration. */
  upf_status (*step)(void *ctx, const upf_engine_row *rows, int32_t n, float *logits, double *seconds);
  /* Frees a request's state and pages (a finished one, or one left running when a step failed). */
  upf_status (*release)(void *ctx, int32_t req);
  int64_t (*pages_free)(void *ctx, int32_t group);
  /* Pages `tokens` KV entries take in one group (dense: the most a request of that length holds). */
  int64_t (*pages_for)(void *ctx, int64_t tokens);
  /* The pages a request still needs in `group` to append `tokens` tokens there (from its lengths after
   * its drops; during a chunked prefill, from the prompt tokens its chunks wrote). */
  int64_t (*pages_append)(void *ctx, int32_t req, int32_t group, int64_t tokens);
  /* Pages request req holds now, every group together. */
  int64_t (*pages_of)(void *ctx, int32_t req);
  void (*memory)(void *ctx, upf_engine_memory *mem);
} upf_engine_ops;

/* The ops over a session (session.h) of model m created with cfg, for a trace of num_reqs requests:
 * a prefill row registers its request (upf_session_add_request) and the trace index maps to the
 * session's id from then on; a step's seconds are the step result's total_seconds (embedding to
 * logits, on the host clock after the backend finished); max_live is cfg's max_requests. Free with
 * upf_engine_session_ops_free; the session and the model must outlive them. */
struct upf_session;
upf_status upf_engine_session_ops(struct upf_session *s, const upf_model *m, int32_t max_requests, int32_t num_reqs,
                                  upf_engine_ops *ops);
void upf_engine_session_ops_free(upf_engine_ops *ops);
/* Wall seconds of the session steps the ops ran (the whole upf_session_step calls, host work included). */
double upf_engine_session_wall_seconds(const upf_engine_ops *ops);
/* FlashPrefill mode: the kept and visible key blocks (upf_sparse_record) summed over every full-attention
 * layer of every step the ops ran; both 0 in the other modes. */
void upf_engine_session_sparse_blocks(const upf_engine_ops *ops, int64_t *kept, int64_t *visible);

/* ---- The engine ---- */

typedef struct {
  int64_t token_budget; /* per step: prefill tokens + decode rows (>= 1) */
  int32_t eos;          /* a token that ends a request, or -1 */
  int32_t keep_steps;   /* 1: the result keeps one record per step (result.steps) */
  int32_t chunk;        /* 0: a prompt prefills in one row; C >= 1: chunked prefill, chunks of at most C
                         * tokens (and what the token budget leaves) */
} upf_engine_options;

typedef struct {
  int64_t id;
  int32_t prompt_len, max_new;
  int32_t num_generated;
  int32_t *tokens;      /* (num_generated) the greedy tokens, first from the prefill */
  double arrival, admitted, first_token, finished; /* simulated clock, seconds */
  double ttft;          /* first_token - arrival */
  double tpot;          /* (finished - first_token) / (num_generated - 1); 0 with one token */
  int64_t admit_step, finish_step;
  int64_t pages_after_prefill, dense_pages_after_prefill;
  int32_t num_chunks;   /* prefill rows the request took (1 without chunking) */
} upf_engine_record;

typedef struct {
  double start, seconds;
  int32_t prefill_rows, decode_rows;
  int64_t prefill_tokens;
  int32_t running;                 /* requests holding state during the step */
  int64_t pages_used, pages_dense; /* after the step, before finished requests release theirs */
  int32_t prefill_chunks;          /* prefill rows that hold part of their prompt (chunked prefill) */
} upf_engine_step_record;

typedef struct {
  int32_t num_reqs;
  upf_engine_record *reqs; /* (num_reqs) in trace order */
  int64_t num_steps;
  upf_engine_step_record *steps; /* (num_steps) when options.keep_steps */
  double start, end;             /* first arrival and last finish, simulated clock */
  double busy_seconds;           /* the steps' durations summed */
  /* percentiles (nearest rank) over requests: [p50, p90, p99], seconds; TPOT over requests with
   * two or more tokens (0 when there is none) */
  double ttft_p[3], tpot_p[3];
  double ttft_mean, tpot_mean;
  int64_t prompt_tokens, output_tokens;
  double output_tokens_per_s, total_tokens_per_s; /* over end - start */
  double mean_prefill_rows, mean_decode_rows, mean_prefill_tokens; /* per step */
  int32_t max_running;                                             /* most requests holding state at once */
  /* KV memory, the peaks over the steps (after each step, before its finished requests release);
   * dense: what the same requests would hold without drops; saved = dense peak - peak */
  int64_t pages_peak, pages_dense_peak;
  double kv_bytes_peak, kv_dense_bytes_peak, kv_saved_bytes, kv_saved_share, kv_bytes_capacity;
} upf_engine_result;

/* Runs the trace to the end. Scheduling, per step, in this order:
 *  - every running request that has its first token contributes one decode row (its last token);
 *  - chunked prefill (chunk C >= 1, the vLLM / SGLang policy: decodes first, then prefill chunks up to
 *    the budget): every running request still prefilling, in admission order, contributes its next
 *    chunk of min(C, prompt tokens left, budget left) tokens while budget is left;
 *  - waiting requests that have arrived are admitted first come first served (arrival, then trace
 *    order), each as one prefill row of its whole prompt (with chunking: of its first chunk, as above),
 *    while the step's tokens (prefill tokens plus decode rows) stay within token_budget, the live
 *    requests within max_live, and the request's worst-case pages fit in every cache group: its dense
 *    pages for prompt + max_new - 1 tokens, beside the pages held and those every running request may
 *    still append. The first request that does not fit stops admission (strict FCFS: none overtakes it).
 *    Without chunking a prompt longer than the budget runs alone, in a step with no other row: at the
 *    head of the queue it takes the next step, and the running requests' decode rows pause for that
 *    step (prefill first, as vLLM schedules without chunked prefill, so steady decodes cannot starve
 *    it); with chunking no step exceeds the budget but for decode rows beyond it.
 *  - a chunk that does not end its prompt is not sampled; the last one gives the first token.
 *  - when pages run short, requests wait; nothing is preempted: the reservation guarantees every
 *    admitted request can decode to max_new.
 * Each row's token is the argmax of its logits (ties to the lowest id); a request finishes at max_new
 * tokens or at eos and releases its pages at once. The clock starts at the first arrival, jumps to the
 * next arrival when nothing runs, and advances by each step's duration; a token's time is its step's
 * end. With every arrival at one time the schedule depends on the trace alone; with staggered
 * arrivals it also depends on the measured step times (the tokens do not: each request's tokens are
 * its own, batch invariance). A request whose worst case exceeds a group's whole budget fails before any step. */
upf_status upf_engine_run(const upf_engine_ops *ops, const upf_trace *trace, const upf_engine_options *opt,
                          upf_engine_result *res);
void upf_engine_result_free(upf_engine_result *res);

/* Greedy choice from one row's logits (vocab): the largest, ties to the lowest id; -1 if any is NaN. */
int32_t upf_engine_argmax(const float *logits, int32_t vocab);

#ifdef __cplusplus
}
#endif
#endif
