/* CPU reference of UniPrefill selection (SPEC.md section 2). Each stage is its own function working
 * on one request in double precision; ref_select_run chains them over a varlen batch. The cpu_*
 * functions are the CPU backend's ops-table entries (packed fp32 interface, see backend.h). */
#ifndef UNIPREFILL_REF_SELECT_H
#define UNIPREFILL_REF_SELECT_H

#include <stdint.h>

#include "uniprefill/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows [tok0, tok0+ntok) of head `head` of x (T, H, D), converted to double: dst (ntok, D). */
void ref_load_rows_f64(const upf_tensor *x, int64_t tok0, int64_t ntok, int64_t head, double *dst);

/* Stage 1 for one head of one request of n tokens: s (L, n) = scale * q_last (L, D) . k (n, D)^T,
 * -inf where key j is after query i's position n-L+i. Double accumulation (OpenBLAS dgemm). */
void ref_select_part_gemm_head(const double *q_last, const double *k, int64_t L, int64_t n, int64_t D,
                               double scale, double *s);

/* Stage 2 for one head: softmax of every row of s (L, n); adds each column's probability mass to
 * token_mass (n). Max and sum over all keys first, then normalise (the two passes of online softmax).
 * Heads of 4M scores and more run on ref_select_threads() threads, with the same bits as one. */
upf_status ref_select_block_softmax_head(const double *s, int64_t L, int64_t n, double *token_mass);
/* The same on `threads` threads (1-16): bitwise equal for every count (each row's statistics in key
 * order, each key's mass in row order). */
upf_status ref_select_block_softmax_head_threads(const double *s, int64_t L, int64_t n, double *token_mass,
                                                 int threads);
/* Threads of the reference's long loops: OPENBLAS_NUM_THREADS when set (the share of the cores a verify
 * process gets), else the online cores; at most 16. */
int ref_select_threads(void);

/* Stage 3: block_score (ceil(n/G)) = sum of token_mass (n) over each block of G tokens. */
void ref_select_block_reduce(const double *token_mass, int64_t n, int32_t block, double *block_score);

/* Stage 4: top-p (params->topk == 0) or top-k decisions over nb blocks. Ranking: pi descending,
 * ties to the larger block index. prefix (nb, may be NULL) receives, per block, the exclusive prefix
 * mass of the blocks ranked ahead of it, and pi (nb, may be NULL) its normalised score. */
void ref_select_topp(const double *block_score, int64_t nb, const upf_select_params *params, uint8_t *block_mask,
                     double *prefix, double *pi);

/* Mask expansion for one scored request: token j kept iff its block is kept, j < sink or j >= n-L. */
void ref_select_expand_request(const uint8_t *block_mask, int64_t n, const upf_select_params *params,
                               uint8_t *token_mask);

/* Stages 1-3 for one scored request [tok0, tok0+n): block_score (ceil(n/G)) in double. */
upf_status ref_select_request_scores(const upf_select_inputs *in, int64_t tok0, int64_t n,
                                     const upf_select_params *params, double *block_score);

/* Scans the q and k values selection reads (last L rows of q and all of k, for scored requests)
 * for NaN/Inf; UPF_ERR_NONFINITE names the tensor, token, head and dim. Host memory. */
upf_status ref_select_check_finite(const upf_select_inputs *in, const upf_select_params *params);

/* The whole selection in double. block_score_f64 (num_blocks, may be NULL) keeps the unrounded
 * scores for verification; out's arrays are host memory. */
upf_status ref_select_run(const upf_select_inputs *in, const upf_select_params *params, upf_select_outputs *out,
                          double *block_score_f64);

/* Expansion over a batch from a block mask (num_blocks): fills token_mask, kept_index,
 * new_cu_seqlens, kept_count, kept_total. */
upf_status ref_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                             const uint8_t *block_mask, upf_select_outputs *out);

/* CPU backend entries (host pointers). */
upf_status cpu_select_part_gemm(const upf_select_inputs *in, const upf_select_params *params, float *scores);
upf_status cpu_select_block_softmax(const upf_select_inputs *in, const upf_select_params *params,
                                    const float *scores, float *token_mass);
upf_status cpu_select_block_reduce(const upf_select_inputs *in, const upf_select_params *params,
                                   const float *token_mass, float *block_score);
upf_status cpu_select_block_scores(const upf_select_inputs *in, const upf_select_params *params,
                                   float *block_score);
upf_status cpu_select_topp(const upf_select_inputs *in, const upf_select_params *params, const float *block_score,
                           uint8_t *block_mask);
upf_status cpu_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                             const uint8_t *block_mask, upf_select_outputs *out);
upf_status cpu_select_run(const upf_select_inputs *in, const upf_select_params *params, upf_select_outputs *out);

#ifdef __cplusplus
}
#endif
#endif
