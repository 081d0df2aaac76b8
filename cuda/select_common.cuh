/* Private header of the CUDA selection sources (cuda/select*.cu; C++ only, not part of the C API of
 * cuda/select.cuh): the per-call plan as the host builds it and as the kernels read it, the workspace
 * carver, the device helpers that more than one kernel family shares, the score kernel's argument
 * block, and the launch functions through which cuda/select.cu (the entries and their shared host
 * set-up) reaches the score kernels (cuda/select_score.cu) and the other stages (cuda/select_stages.cu). */
#ifndef UNIPREFILL_CUDA_SELECT_COMMON_CUH
#define UNIPREFILL_CUDA_SELECT_COMMON_CUH

#include <stddef.h>
#include <stdint.h>
#include <vector>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/select.cuh"
#include "uniprefill/status.h"

namespace upf_select {

/* ---------------------------------------------------------------------------------------------- */
/* Plan: per-request layout computed on the host from cu_seqlens_host, uploaded once per call.      */

struct sel_req {    /* one scored request */
  int64_t tok0;     /* first token in the packed batch */
  int64_t blk0;     /* first block in the batch's block arrays */
  int64_t sc0;      /* stage-1 score slab offset (upf_select_score_offsets) */
  int64_t u0;       /* U (nseg, Rn) offset */
  int64_t m0;       /* M (nunit, Rn) offset */
  int64_t c0;       /* MC, LC (nchunk, Rn) offset */
  int32_t n;        /* tokens */
  int32_t r;        /* request index */
  int32_t nb;       /* blocks */
  int32_t nseg, nunit, nchunk;
  int32_t cta0;     /* first CTA of this request in the score kernel's grid */
  int32_t pad;
};

struct sel_dev_plan {       /* device pointers into the uploaded plan */
  const sel_req *reqs;      /* (S) */
  const int64_t *blk_off;   /* (B+1) */
  const int32_t *sidx;      /* (B) scored index or -1 */
  const int64_t *seg_begin; /* (S) for the segmented sort */
  const int64_t *seg_end;   /* (S) */
};

struct sel_plan {
  int32_t B = 0, S = 0;
  int64_t T = 0, num_blocks = 0;
  int32_t Hq = 1, Hkv = 1, grp = 1, L = 1, D = 1, G = 1, sink = 0;
  int64_t Rn = 0; /* rows per request: Hq * L */
  int32_t max_nb = 0;
  /* fused geometry */
  int32_t KC = 0, SG = 0, UG = 0, RG = 0, RPC = 0, ctas = 0;
  int64_t u_len = 0, m_len = 0, c_len = 0, score_len = 0;
  std::vector<sel_req> reqs;
  std::vector<int64_t> blk_off;
  std::vector<int32_t> sidx;
  std::vector<int64_t> seg_begin, seg_end;
  size_t blob_bytes = 0;
};

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline unsigned grid_for(int64_t items, int per_cta) { return (unsigned)((items + per_cta - 1) / per_cta); }

/* Bump allocator over the grow-only workspace: first collect sizes, then carve. */
struct ws_carver {
  size_t at = 0;
  size_t take(size_t bytes) {
    size_t o = at;
    at += align_up(bytes ? bytes : 1, 256);
    return o;
  }
};

/* ---------------------------------------------------------------------------------------------- */
/* Device helpers                                                                                   */

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

/* First index i in [0, n) with a[i] > x (n if none). */
template <typename T>
__device__ __forceinline__ int upper_bound_dev(const T *a, int n, int64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if ((int64_t)a[mid] <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Scored request whose CTA range holds `cta`. */
__device__ __forceinline__ int find_req_by_cta(const sel_req *reqs, int S, int cta) {
  int lo = 0, hi = S;
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (reqs[mid].cta0 <= cta)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* ---------------------------------------------------------------------------------------------- */
/* Launch interface                                                                                 */

/* Argument block of every fused score kernel (stage 1), passed by value. */
struct score_args {
  const void *q;  /* (T, Hq, D) bf16 or f32 */
  const void *k;  /* (T, Hkv, D) */
  int64_t qs0, qs1, ks0, ks1; /* token and head strides, elements */
  int32_t Hq, Hkv, grp, L, D, G, SG, UG, KC, RG, RPC, S;
  int64_t Rn;
  float c; /* scale * log2(e) */
  const sel_req *reqs;
  float *M;  /* (m_len) per (unit, row) reference max, log2 units */
  float *U;  /* (u_len) per (segment, row) sum of exp2(s - M) */
  float *MC; /* (c_len) per (chunk, row) online max */
  float *LC; /* (c_len) per (chunk, row) online sum */
  unsigned *bad_req; /* (1) smallest scored index with a non-finite score */
};

/* The picked score kernel (cuda/select_score.cu), launched by cudaLaunchKernel with a score_args, and
 * for the wgmma kernel a tensor map of k too (encoded for its TMA form, zeros otherwise). */
struct kernel_cfg {
  const void *fn;
  int threads;
  size_t smem;
  int rows_per_cta;
  CUtensorMap kmap;
};

/* cuda/select_score.cu. The score kernel for this call and plan (bf16 rows that qualify: wgmma where
 * G >= 64 on an sm_90a build and device, else mma.sync; FFMA for everything else), its shared-memory
 * attribute set; cfg.rows_per_cta is what plan_fused lays the grid out with. */
upf_status choose_score_kernel(const upf_select_inputs *in, const sel_plan &p, kernel_cfg &cfg);

/* cuda/select_stages.cu. Every launch is on `stream` and checked; none waits for the device unless
 * it says so. */
/* Stages 2-3 of the fused path: row statistics from (MC, LC), then each block's mass from (M, U). */
upf_status launch_combine(const sel_plan &p, const sel_dev_plan &dp, const float *M, const float *U, const float *MC,
                          const float *LC, float *row_m, float *row_il, float *block_score, cudaStream_t stream);
/* Blocks of unscored requests: mask 1 and score 0 where the pointer is given (either may be NULL). */
upf_status launch_unscored_blocks(const sel_plan &p, const sel_dev_plan &dp, uint8_t *block_mask, float *block_score,
                                  cudaStream_t stream);
/* Stage 4 (top-p / top-k) in the topp_ws_bytes(p) bytes at ws_topp; bad_score (device) receives the
 * first (r << 32 | block) whose score is NaN, Inf or negative. */
size_t topp_ws_bytes(const sel_plan &p);
upf_status run_topp(const sel_plan &p, const sel_dev_plan &dp, const upf_select_params *params,
                    const float *block_score, uint8_t *block_mask, unsigned long long *bad_score, uint8_t *ws_topp,
                    cudaStream_t stream);
/* Stage 5 (expansion) in the expand_ws_bytes(p) bytes at ws_exp; kept_total to d_total (device). */
size_t expand_ws_bytes(const sel_plan &p);
upf_status run_expand(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp,
                      const upf_select_params *params, const uint8_t *block_mask, upf_select_outputs *out,
                      uint8_t *ws_exp, int32_t *d_total, cudaStream_t stream);
/* The slow path after a non-finite flag: names the first NaN/Inf of q or k as the CPU reference does
 * (synchronises the stream; uses the workspace). */
upf_status find_nonfinite(const upf_select_inputs *in, const sel_plan &p, cudaStream_t stream, const char *op,
                          bool *found);
/* The stage-alone kernels: part_gemm's scores (p.score_len), block_softmax's token mass (T) through
 * row_m and row_l (S * Rn each), block_reduce's block scores (num_blocks). */
upf_status launch_part_gemm(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp, float scale,
                            float *scores, cudaStream_t stream);
upf_status launch_block_softmax(const upf_select_inputs *in, const sel_plan &p, const sel_dev_plan &dp,
                                const float *scores, float *row_m, float *row_l, float *token_mass,
                                cudaStream_t stream);
upf_status launch_block_reduce(const sel_plan &p, const sel_dev_plan &dp, const float *token_mass, float *block_score,
                               cudaStream_t stream);

} // namespace upf_select

#endif
