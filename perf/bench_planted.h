/* Planted-block attention inputs of the block-sparse benchmarks (perf/bench_sparse.c, perf/bench_compact.c).
 * Each KV head has a direction u; q = noise + c u; the keys of 30% of a head's key blocks (a pseudo-random
 * choice from the seed) noise + c u, the others noise - c u, c putting a hot block's score about 4 log2 units
 * above a cold one's; v = noise. The noise comes from a pool indexed by element, because fresh normals for
 * 10^9 elements would take minutes of host time. */
#ifndef UNIPREFILL_PERF_BENCH_PLANTED_H
#define UNIPREFILL_PERF_BENCH_PLANTED_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/rng.h" /* upf_mix64: the benchmarks' deterministic choices */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { UPF_PLANTED_Q, UPF_PLANTED_K, UPF_PLANTED_V } upf_planted_kind;

typedef struct {
  int64_t hq, hkv, d; /* heads and head dim (hkv <= 8, d <= 256) */
  int64_t block_n;    /* keys per block: the unit of hot and cold */
  upf_dtype dt;       /* f32 or bf16 */
  uint64_t seed;
} upf_planted;

/* Rows [t0, t1) of `kind` into dst ((t1 - t0), heads, d) in p->dt: q rows have hq heads, k and v rows hkv;
 * key row t is key position t (block t / block_n). */
void upf_planted_rows(const upf_planted *p, upf_planted_kind kind, int64_t t0, int64_t t1, void *dst);
/* Rows [0, n) of `kind` into *dst, allocated on be and uploaded 1024 rows at a time; `who` names the
 * benchmark in an error. */
upf_status upf_planted_upload(const upf_planted *p, const upf_backend *be, upf_planted_kind kind, int64_t n,
                              void **dst, const char *who);

#ifdef __cplusplus
}
#endif
#endif
