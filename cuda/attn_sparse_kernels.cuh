/* Private header of the CUDA block-sparse attention (attn.block_sparse: cuda/attn_sparse.cu, the entry,
 * the plan and the generic kernel; cuda/attn_sparse_hopper.cu, the wgmma kernel): the plan's tile, the
 * argument block every kernel reads, and the launch functions. C++ only.
 *
 * Rows are PackGQA packed rows (uniprefill/sparse.h): packed row P of a request is query position P / g
 * and q head h g + P % g of KV head h; a query tile holds block_m packed rows and a CTA takes `rows_cta`
 * consecutive packed rows of one tile and one KV head ("a chunk"), so the group's q heads share each
 * K/V read. The CTA walks its segment's CSR list (index->row_ptr, index->blocks) and, with mean
 * correction, the unkept blocks b < corr_hi as extra keys kbar_b (logit + ln block_n) with values vbar_b. */
#ifndef UNIPREFILL_CUDA_ATTN_SPARSE_KERNELS_CUH
#define UNIPREFILL_CUDA_ATTN_SPARSE_KERNELS_CUH

#include <stdint.h>

#include "uniprefill/status.h"
#include "uniprefill/tensor.h"

namespace upf_bsattn {

/* One query tile of the plan (sorted heaviest first on the host). */
struct bs_tile {
  int32_t tile;     /* the tile's index among the batch's tiles: segment s = h * total_q_tiles + tile */
  int32_t q0;       /* first query token of the request in q and out */
  int32_t q_len, kv_len;
  int32_t kv_base;  /* contiguous K/V: first kv row of the request */
  int32_t req;      /* request (block-table row; kbar, vbar row) */
  int32_t row0;     /* first packed row of the tile (m block_m) */
  int32_t row_end;  /* one past its last packed row: min((m + 1) block_m, q_len g) */
  int32_t corr_hi;  /* mean correction over unkept b < corr_hi (0 without correction) */
};

/* The FP8 variant (attn.block_sparse=fp8; bf16 in and out, D = 128): cuda/attn_sparse_fp8.cu quantises q, k,
 * v and the means to E4M3 copies with power-of-two per-tensor scales (uniprefill/fp8.h) and V transposed
 * (FP8 wgmma takes only K-major operands), then the wgmma kernel's FP8 form (cuda/attn_sparse_hopper.cu,
 * bs_wgmma_kernel<128, false, true>) runs both products in E4M3. P is rounded to E4M3 after scaling by
 * BS_FP8_P_SCALE (the small probabilities keep their bits); the row sums stay in f32. */
struct bs_fp8_args {
  const uint8_t *q8;     /* (Tq, Hq, 128) */
  const uint8_t *k8;     /* (KVP, Hkv, 128): request r's keys from its tile's kv_base (a multiple of 64), zero padded */
  const uint8_t *vt8;    /* (Hkv, 128, KVP): V transposed, each aligned 16 keys in bs_fp8_key_at order */
  const uint8_t *kbar8;  /* (B, MKBP, Hkv, 128) */
  const uint8_t *vbart8; /* (B, Hkv, 128, MKBP): the same order; zero past a request's key blocks */
  const uint32_t *amax;  /* float bits of max |x|: [0] q, [1] k and kbar, [2] v and vbar */
  int64_t kvp;           /* rows of k8 */
  int32_t mkbp;          /* max_key_blocks rounded up to 128 (one mean tile) */
};

struct bs_args {
  const void *q;       /* (Tq, Hq, D) */
  int64_t q_s0, q_s1;
  const void *k, *v;   /* contiguous (Tkv, Hkv, D): s0 row, s1 head; paged (pages, P, Hkv, D): s0, s1, s2 */
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
  void *out;           /* (Tq, Hq, D) */
  int64_t o_s0, o_s1;
  const int32_t *block_table; /* paged: (B, max_blocks) */
  int32_t max_blocks, page_size;
  const void *kbar, *vbar;    /* (B, max_key_blocks, Hkv, D) contiguous, or NULL without correction */
  int32_t max_key_blocks;
  const int32_t *row_ptr;     /* (S + 1) */
  const int32_t *blocks;      /* kept block ids, ascending within a segment */
  const bs_tile *tiles;       /* (ntiles) */
  int32_t total_q_tiles;
  int32_t chunks;             /* CTAs a (tile, KV head): ceil(block_m / rows_cta) */
  int32_t hq, hkv, group, d, block_n;
  float scale;
  int32_t vec8;               /* bf16 K/V (and means) in 16-byte aligned runs of 8: vector loads (generic kernel) */
  bs_fp8_args f8;             /* the FP8 form's copies (zero otherwise) */
};

/* cuda/attn_sparse.cu: the generic FFMA kernel, ATT-style 16-row chunks, every dtype and D <= 256. */
constexpr int BS_GEN_ROWS = 16;
upf_status bs_launch_generic(const bs_args &a, upf_dtype dtype, bool paged, int ntiles);

/* cuda/attn_sparse_hopper.cu: the wgmma kernel, 128-row chunks, bf16, D = 128 and 256. */
constexpr int BS_WG_ROWS = 128;
bool bs_hopper_takes(int d);
upf_status bs_launch_hopper(const bs_args &a, bool paged, int ntiles);

constexpr float BS_FP8_P_SCALE = 256.0f;
/* The key (0..15 in its aligned 16) whose value sits at byte `slot` of a transposed row: the order in which
 * a thread's accumulator columns (2t, 2t + 1, 8 + 2t, 9 + 2t) become its E4M3 A-operand bytes (4t .. 4t + 3),
 * so P goes from the S accumulator to the P V operand without a shuffle. */
__host__ __device__ inline int bs_fp8_key_at(int slot) { return 2 * (slot >> 2) + (slot & 1) + 8 * ((slot >> 1) & 1); }
bool bs_fp8_takes(int d);
upf_status bs_launch_fp8(const bs_args &a, int ntiles); /* bs_wgmma_kernel<128, false, true> over a.f8 */
/* cuda/attn_sparse_fp8.cu: quantise and run; tiles (host, kv_base rewritten) uploaded with the rest. */
upf_status bs_run_fp8(bs_args a, bool paged, bs_tile *tiles, int ntiles, int32_t nreq, const int32_t *kv_len,
                      const int32_t *kv_start, int64_t tq);

} // namespace upf_bsattn
#endif
