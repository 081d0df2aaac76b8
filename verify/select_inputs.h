/* Seeded selection problems for verify, tests and benchmarks: ragged batches of q/k with plain
 * random values or with the structure real attention has (sinks, heavy-hitter blocks, local bands). */
#ifndef UNIPREFILL_VERIFY_SELECT_INPUTS_H
#define UNIPREFILL_VERIFY_SELECT_INPUTS_H

#include <stdint.h>

#include "uniprefill/select.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  UPF_DIST_RANDOM = 0, /* q, k ~ N(0, 1) */
  UPF_DIST_SINK,       /* the first tokens' keys align with every query: an attention sink */
  UPF_DIST_HEAVY,      /* a few scattered blocks align with the queries: heavy hitters */
  UPF_DIST_LOCAL,      /* alignment grows toward the end: a local band */
  UPF_DIST_TIES,       /* every key identical: all block scores tie (tie-breaking) */
  UPF_DIST_COUNT
} upf_dist;

const char *upf_dist_name(upf_dist dist);

/* A host-side problem: owns q (T, Hq, D), k (T, Hkv, D) in `dtype` and cu_seqlens (B+1). */
typedef struct {
  upf_tensor q, k;
  int32_t *cu_seqlens; /* (B+1) */
  int32_t num_reqs;
} upf_select_problem;

/* Builds lens[0..num_reqs) as one batch. Values are drawn in fp32 and rounded to dtype. */
upf_status upf_select_problem_make(upf_select_problem *pb, const int32_t *lens, int32_t num_reqs, int32_t hq,
                                   int32_t hkv, int32_t head_dim, upf_dtype dtype, upf_dist dist, uint64_t seed);
void upf_select_problem_free(upf_select_problem *pb);
/* Host inputs view of the problem (pointers into pb). */
upf_select_inputs upf_select_problem_inputs(const upf_select_problem *pb);

#ifdef __cplusplus
}
#endif
#endif
