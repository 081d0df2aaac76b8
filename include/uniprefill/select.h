/* UniPrefill token selection (SPEC.md section 2): parameters, the varlen problem description, the
 * outputs of one drop layer, and the layout helpers every backend shares. The stage functions
 * themselves live in the backend ops table (uniprefill/backend.h). */
#ifndef UNIPREFILL_SELECT_H
#define UNIPREFILL_SELECT_H

#include <stdint.h>

#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t block;  /* G: tokens per selection block, a power of two */
  int32_t sink;   /* leading tokens always kept (attention sink) */
  int32_t last_q; /* L: observation window, the last L queries score the keys; always kept */
  float p;        /* top-p mass threshold, in (0, 1] */
  int32_t topk;   /* 0: top-p mode; K > 0: keep the K best-ranked blocks instead */
  float scale;    /* softmax scale; 0 means 1/sqrt(head_dim) */
  float keep_ratio; /* 0: off; R in (0, 1]: keep the ceil(R * nb) best-ranked blocks of each request
                     * (top-k per request, for controlled benchmarks); excludes topk */
} upf_select_params;

/* G=64, sink=128, L=128, p=0.99, top-p, scale 1/sqrt(D). */
upf_select_params upf_select_params_default(void);
upf_status upf_select_params_check(const upf_select_params *params);

/* One drop layer's inputs. Pointers live in the memory of the backend they are passed to, except
 * cu_seqlens_host, which every backend reads on the host to plan its launches. */
typedef struct {
  upf_tensor q;                   /* (T, Hq, D)  f32 or bf16, last dim contiguous; after RoPE/q-norm */
  upf_tensor k;                   /* (T, Hkv, D) same dtype, last dim contiguous */
  const int32_t *cu_seqlens;      /* (B+1) backend memory */
  const int32_t *cu_seqlens_host; /* (B+1) host copy of the same values */
  int32_t num_reqs;               /* B */
} upf_select_inputs;

/* Everything a drop layer produces. Arrays are in backend memory; block_score and block_mask may
 * be NULL when the caller does not want them. Requests that are not scored (decode rows and rows
 * with n <= sink + L) get block_score 0 and block_mask 1 on all their blocks. */
typedef struct {
  float *block_score;      /* (num_blocks) b = summed attention mass per block (fp32) */
  uint8_t *block_mask;     /* (num_blocks) 1 = block kept */
  uint8_t *token_mask;     /* (T) 1 = token kept */
  int32_t *kept_index;     /* (T) capacity; first kept_total entries valid, ascending */
  int32_t *new_cu_seqlens; /* (B+1) cu_seqlens of the compacted batch */
  int32_t *kept_count;     /* (B) kept tokens per request */
  int64_t kept_total;      /* set by the call (host value): T' */
} upf_select_outputs;

/* Shape and range checks shared by all backends; reads only descriptors and cu_seqlens_host.
 * Returns UPF_ERR_SHAPE / UPF_ERR_DTYPE / UPF_ERR_CU_SEQLENS / UPF_ERR_INVALID_ARG naming the input. */
upf_status upf_select_validate(const upf_select_inputs *in, const upf_select_params *params);
/* Validates a host cu_seqlens array: cu[0] == 0, non-decreasing, cu[B] == num_tokens. */
upf_status upf_cu_seqlens_check(const int32_t *cu, int32_t num_reqs, int64_t num_tokens);

/* Rule 1 of SPEC section 2: a request is scored unless n == 1 or n <= sink + L. */
static inline int upf_select_is_scored(int64_t n, const upf_select_params *params) {
  return n > 1 && n > (int64_t)params->sink + params->last_q;
}

static inline int64_t upf_select_blocks_of(int64_t n, int32_t block) { return (n + block - 1) / block; }
/* Blocks kept by rank in top-k mode for a request of nb blocks: ceil(keep_ratio * nb) or topk; 0 in
 * top-p mode. */
int64_t upf_select_topk_of(const upf_select_params *params, int64_t nb);

/* block_offset[r] = sum_{r' < r} ceil(n_r' / G), for r = 0..B (host arrays). Every request owns
 * blocks, scored or not, so block r of the batch maps to tokens by offset alone. */
void upf_select_block_offsets(const int32_t *cu_host, int32_t num_reqs, int32_t block, int64_t *block_offset);
/* score_offset[r] = sum_{r' < r, scored} Hq * L * n_r': layout of the stage-1 score tensor,
 * one (Hq, L, n_r) slab per scored request. */
void upf_select_score_offsets(const int32_t *cu_host, int32_t num_reqs, int32_t num_q_heads,
                              const upf_select_params *params, int64_t *score_offset);
/* Softmax scale in effect: params->scale, or 1/sqrt(D) when it is 0. */
float upf_select_scale(const upf_select_params *params, int32_t head_dim);

#ifdef __cplusplus
}
#endif
#endif
