/* CUDA attention, the dispatch: the backend entries (varlen causal prefill, paged attention, the paged
 * cache write), the work plans the kernels read, and which kernel family takes which rows.
 *
 * The kernels, by family (each file opens with its design):
 *   cuda/attn_ffma.cu    FFMA, every dtype and head dim up to 256; split-KV parts and their merge.
 *   cuda/attn_fa2.cu     FlashAttention-2 on mma.sync: bf16 prefill at D = 64/128/256.
 *   cuda/attn_hopper.cu  FlashAttention-3 form on wgmma: bf16 D = 128 and 256 prefill over contiguous K/V.
 *   cuda/attn_decode.cu  decode rows on mma.sync: paged bf16 at D = 64/128/256.
 * What they share (the plan's structs, the mma.sync softmax step) is cuda/attn_kernels.cuh.
 *
 * Choice: bf16 rows with D = 64/128/256 and 16-byte rows (mma_ok) take the tensor cores, everything else
 * (f32, other head dims, unaligned views) the FFMA kernel. attn.prefill's bf16 D = 128 and D = 256 (D =
 * 256 without soft-cap: wgmma2_takes) over contiguous K/V goes to the attn.prefill variant in effect
 * (wgmma2-nopp, the default, or fa2); attn.paged sends
 * requests of at least MMA_MIN_Q_ROWS query rows (prefill against the cache: chunked prefill) to the
 * prefill kernels and the rest (decode steps, short runs) to the attn.paged variant in effect (mma, the
 * default, or ffma): launches writing disjoint rows. Where the wgmma kernel takes those long runs (its
 * shapes, attn.prefill=wgmma2-nopp), their visible K/V rows are first gathered from the pages into a
 * contiguous buffer (cuda/kv_gather.cuh: a copy at copy bandwidth, 1-2% of the attention it feeds), since
 * the wgmma producer reads contiguous rows; the FA2 kernel reads the pages in place at about a third of
 * the wgmma kernel's rate (perf/NOTES.md). Variants: include/uniprefill/variants.def (`upf ops`), selected with
 * UPF_VARIANT=op=name or --variant.
 * Plans: the prefill kernels take FA_BM-row tiles of one q head, sorted heaviest first, no split (a
 * prefill has rows enough to fill the GPU); the FFMA and decode kernels take ATT_BR-row tiles of
 * (token, group head) rows of one kv head, split along the keys when the tiles alone would leave the
 * GPU idle. */
#include <math.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/attn.cuh"
#include "cuda/attn_kernels.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/kv_gather.cuh"
#include "uniprefill/variant.h"

namespace {

using namespace upf_attn;

/* One CTA a token row: its k and v rows to their slot (slot < 0: a padding row, skipped). */
template <typename T> __global__ void kv_cache_write_kernel(const T *k, int64_t k_s0, int64_t k_s1, const T *v,
                                                            int64_t v_s0, int64_t v_s1, const int32_t *slots,
                                                            T *kc, int64_t kc_s0, int64_t kc_s1, int64_t kc_s2,
                                                            T *vc, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2,
                                                            int hkv, int d, int page_size) {
  const int64_t t = blockIdx.x;
  const int s = slots[t];
  if (s < 0)
    return;
  const int64_t page = s / page_size, off = s % page_size;
  for (int i = threadIdx.x; i < hkv * d; i += blockDim.x) {
    const int h = i / d, e = i - h * d;
    kc[page * kc_s0 + off * kc_s1 + (int64_t)h * kc_s2 + e] = k[t * k_s0 + (int64_t)h * k_s1 + e];
    vc[page * vc_s0 + off * vc_s1 + (int64_t)h * vc_s2 + e] = v[t * v_s0 + (int64_t)h * v_s1 + e];
  }
}

/* Per-request facts the planner needs. */
struct req_info {
  int32_t q0, q_len, kv_len, kv_base;
  int32_t req; /* block-table row (paged) */
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* The kernel that takes bf16 D = 128 and 256 prefill over contiguous K/V (attn.prefill's variants). */
enum prefill_kernel { PREFILL_WGMMA, PREFILL_FA2 };
/* The kernel that takes the paged rows of short query runs (attn.paged's variants). */
enum decode_kernel { DECODE_MMA, DECODE_FFMA };

/* The attn.prefill variant in effect. wgmma2-nopp is the default: about 2x the FA2 kernel's rate on
 * Hopper at Llama shapes (D = 128; perf/NOTES.md). */
upf_status prefill_kernel_chosen(prefill_kernel *k) {
  upf_variant v;
  UPF_TRY(upf_variant_current(UPF_OP_ATTN_PREFILL, &v));
  if (v == UPF_VARIANT_ATTN_PREFILL_WGMMA2_NOPP)
    *k = PREFILL_WGMMA;
  else if (v == UPF_VARIANT_ATTN_PREFILL_FA2)
    *k = PREFILL_FA2;
  else
    return upf_fail(UPF_ERR_INVALID_ARG, "attn.prefill (cuda): variant %s has no kernel", upf_variant_name(v));
  return UPF_OK;
}

/* The attn.paged variant in effect. mma is the default: 0.83-0.93 of copy bandwidth on Llama decode
 * against the FFMA kernel's 0.2 (perf/NOTES.md). */
upf_status decode_kernel_chosen(decode_kernel *k) {
  upf_variant v;
  UPF_TRY(upf_variant_current(UPF_OP_ATTN_PAGED, &v));
  if (v == UPF_VARIANT_ATTN_PAGED_MMA)
    *k = DECODE_MMA;
  else if (v == UPF_VARIANT_ATTN_PAGED_FFMA)
    *k = DECODE_FFMA;
  else
    return upf_fail(UPF_ERR_INVALID_ARG, "attn.paged (cuda): variant %s has no kernel", upf_variant_name(v));
  return UPF_OK;
}

/* Tiles every request's (token, group head) rows in ATT_BR blocks, splits long KV ranges when the
 * tiles alone would leave the GPU idle, uploads the plan and launches the FFMA kernel, or (decode =
 * DECODE_MMA: paged bf16 with D = 64/128/256 and 16-byte rows) attn_decode_mma_kernel, then the merge
 * of the split tiles. `a` has everything but the plan pointers. */
upf_status attn_plan_and_run(attn_args &a, const req_info *reqs, int32_t num_reqs, upf_dtype dtype, bool paged,
                             decode_kernel decode) {
  if (decode == DECODE_MMA && !md_strides_ok(a))
    decode = DECODE_FFMA;
  const int G = a.group;
  int64_t nbase = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    nbase += ((int64_t)reqs[r].q_len * G + ATT_BR - 1) / ATT_BR;
  if (nbase == 0)
    return UPF_OK;
  /* Split only when fewer than ATT_SPLIT_WAVES waves of CTAs would run (decode: memory-bound, and several
   * resident CTAs per SM overlap one's loads with another's math); a chunk keeps at least ATT_SPLIT_MIN
   * keys. */
  /* The mma decode kernel: MD_SPLIT_WAVES rounds of its resident CTAs (2 per SM at D <= 128), rounded
   * down, so that the CTAs of equal parts never spill a fraction of a round past the target. */
  const int64_t sms = upf_cuda_num_sms();
  int64_t want_split = 1;
  if (decode == DECODE_MMA) {
    const int64_t target = MD_SPLIT_WAVES * md_ctas_per_sm(a.d) * sms;
    want_split = nbase * a.hkv < target ? target / (nbase * a.hkv) : 1;
  } else {
    const int64_t target = ATT_SPLIT_WAVES * sms;
    want_split = nbase * a.hkv < target ? (target + nbase * a.hkv - 1) / (nbase * a.hkv) : 1;
  }
  /* Pass 1 counts, pass 2 fills. */
  attn_tile *tiles = NULL;
  attn_group *groups = NULL;
  int64_t ntiles = 0, ngroups = 0, nparts = 0;
  for (int pass = 0; pass < 2; pass++) {
    ntiles = ngroups = nparts = 0;
    for (int32_t r = 0; r < num_reqs; r++) {
      const req_info &q = reqs[r];
      const int32_t rows = q.q_len * G, off = q.kv_len - q.q_len;
      for (int32_t row0 = 0; row0 < rows; row0 += ATT_BR) {
        const int32_t row_last = (row0 + ATT_BR < rows ? row0 + ATT_BR : rows) - 1;
        const int32_t hi = row_last / G + off + 1;
        int32_t lo = a.window > 0 ? row0 / G + off - a.window + 1 : 0;
        lo = lo < 0 ? 0 : lo;
        const int32_t span = hi - lo;
        int64_t nsplit = 1;
        if (want_split > 1 && span >= 2 * ATT_SPLIT_MIN) {
          nsplit = want_split < span / ATT_SPLIT_MIN ? want_split : span / ATT_SPLIT_MIN;
          nsplit = nsplit > 64 ? 64 : nsplit;
        }
        int32_t chunk = (int32_t)((span + nsplit - 1) / nsplit);
        chunk = (chunk + ATT_KT - 1) / ATT_KT * ATT_KT;
        nsplit = (span + chunk - 1) / chunk;
        attn_tile base = {q.q0, q.q_len, q.kv_len, q.kv_base, q.req, row0, lo, hi, -1};
        if (nsplit <= 1) {
          if (pass)
            tiles[ntiles] = base;
          ntiles++;
          continue;
        }
        if (pass)
          groups[ngroups] = attn_group{q.q0, q.q_len, row0, (int32_t)nparts, (int32_t)nsplit};
        ngroups++;
        for (int64_t s = 0; s < nsplit; s++) {
          if (pass) {
            attn_tile t = base;
            t.kv_lo = lo + (int32_t)s * chunk;
            t.kv_hi = t.kv_lo + chunk < hi ? t.kv_lo + chunk : hi;
            t.part = (int32_t)(nparts + s);
            tiles[ntiles] = t;
          }
          ntiles++;
        }
        nparts += nsplit;
      }
    }
    if (pass == 0) {
      if (ntiles > INT32_MAX)
        return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %lld tiles exceed the grid", (long long)ntiles);
      tiles = (attn_tile *)malloc((size_t)ntiles * sizeof *tiles);
      groups = (attn_group *)malloc((size_t)(ngroups ? ngroups : 1) * sizeof *groups);
      if (!tiles || !groups) {
        free(tiles), free(groups);
        return upf_fail(UPF_ERR_NOMEM, "attn (cuda): plan of %lld tiles", (long long)ntiles);
      }
    }
  }
  const size_t tiles_bytes = align256((size_t)ntiles * sizeof(attn_tile));
  const size_t groups_bytes = align256((size_t)ngroups * sizeof(attn_group));
  const size_t part_rows = (size_t)nparts * a.hkv * ATT_BR;
  const size_t part_o_bytes = align256(part_rows * a.d * sizeof(float));
  const size_t part_lse_bytes = align256(part_rows * sizeof(float));
  void *ws = NULL;
  upf_status st = upf_cuda_workspace(tiles_bytes + groups_bytes + part_o_bytes + part_lse_bytes, &ws);
  if (st == UPF_OK) {
    char *p = (char *)ws;
    a.tiles = (const attn_tile *)p;
    a.groups = (const attn_group *)(p + tiles_bytes);
    a.part_o = (float *)(p + tiles_bytes + groups_bytes);
    a.part_lse = (float *)(p + tiles_bytes + groups_bytes + part_o_bytes);
    st = upf_cuda_upload_async(p, tiles, (size_t)ntiles * sizeof(attn_tile));
    if (st == UPF_OK && ngroups)
      st = upf_cuda_upload_async(p + tiles_bytes, groups, (size_t)ngroups * sizeof(attn_group));
  }
  free(tiles), free(groups);
  UPF_TRY(st);
  UPF_TRY(decode == DECODE_MMA ? launch_decode_mma(a, (int)ntiles) : launch_ffma(a, dtype, paged, (int)ntiles));
  return launch_combine(a, dtype, (int)ngroups);
}

/* Heaviest tiles (longest key span) first, ties in plan order: the last wave holds short tiles. */
int tile_heavier_first(const void *x, const void *y) {
  const attn_tile *p = (const attn_tile *)x, *q = (const attn_tile *)y;
  const int32_t sp = p->kv_hi - p->kv_lo, sq = q->kv_hi - q->kv_lo;
  if (sp != sq)
    return sp > sq ? -1 : 1;
  if (p->q0 != q->q0)
    return p->q0 < q->q0 ? -1 : 1;
  return p->row0 < q->row0 ? -1 : p->row0 > q->row0;
}

/* The prefill plan: tiles of FA_BM query rows per (request, q head), no split (a prefill has rows enough
 * to fill the GPU), heaviest first, on the FA2 kernel or (contiguous, kernel = PREFILL_WGMMA, the shapes
 * of wgmma2_takes: bf16 D = 128, D = 256 without soft-cap) the wgmma kernel. */
upf_status mma_plan_and_run(attn_args &a, const req_info *reqs, int32_t num_reqs, bool paged, prefill_kernel kernel) {
  constexpr int32_t bm = FA_BM;
  int64_t ntiles = 0;
  for (int32_t r = 0; r < num_reqs; r++)
    ntiles += (reqs[r].q_len + bm - 1) / bm;
  if (ntiles == 0)
    return UPF_OK;
  if (ntiles > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "attn (cuda): %lld tiles exceed the grid", (long long)ntiles);
  attn_tile *tiles = (attn_tile *)malloc((size_t)ntiles * sizeof *tiles);
  if (!tiles)
    return upf_fail(UPF_ERR_NOMEM, "attn (cuda): plan of %lld tiles", (long long)ntiles);
  int64_t n = 0;
  for (int32_t r = 0; r < num_reqs; r++) {
    const req_info &q = reqs[r];
    const int32_t off = q.kv_len - q.q_len;
    for (int32_t row0 = 0; row0 < q.q_len; row0 += bm) {
      const int32_t last = (row0 + bm < q.q_len ? row0 + bm : q.q_len) - 1;
      int32_t lo = a.window > 0 ? row0 + off - a.window + 1 : 0;
      lo = lo < 0 ? 0 : lo;
      tiles[n++] = attn_tile{q.q0, q.q_len, q.kv_len, q.kv_base, q.req, row0, lo, last + off + 1, -1};
    }
  }
  qsort(tiles, (size_t)ntiles, sizeof *tiles, tile_heavier_first);
  const size_t tiles_bytes = (size_t)ntiles * sizeof(attn_tile);
  void *ws = NULL;
  upf_status st = upf_cuda_workspace(tiles_bytes, &ws);
  if (st == UPF_OK)
    st = upf_cuda_upload_async(ws, tiles, tiles_bytes);
  free(tiles);
  UPF_TRY(st);
  a.tiles = (const attn_tile *)ws;
  if (kernel == PREFILL_WGMMA && !paged && wgmma2_takes(a))
    return launch_wgmma2(a, (int)ntiles);
  return launch_fa2(a, paged, (int)ntiles);
}

/* The long paged runs `reqs` (paged args `pa`) on the wgmma kernel: in the groups of kv_gather_plan, each
 * request's visible keys (from the window's first for a windowed layer) gathered into contiguous rows
 * (cuda/kv_gather.cuh), then one prefill launch over the group. */
upf_status gathered_plan_and_run(const attn_args &pa, const req_info *reqs, int32_t num_reqs) {
  std::vector<int32_t> row(num_reqs), start(num_reqs), len(num_reqs);
  for (int32_t r = 0; r < num_reqs; r++) {
    const req_info &q = reqs[r];
    row[r] = q.req;
    start[r] = pa.window > 0 ? std::max(0, q.kv_len - q.q_len - pa.window + 1) : 0;
    len[r] = q.kv_len - start[r];
  }
  const kv_paged_view src = {pa.k,           pa.v,          pa.k_s0,   pa.k_s1,   pa.k_s2, pa.v_s0, pa.v_s1,
                             pa.v_s2,        pa.block_table, pa.max_blocks, pa.page_size, pa.hkv, pa.d};
  const size_t row_bytes = (size_t)pa.hkv * pa.d * sizeof(bf16_t);
  for (int32_t r = 0; r < num_reqs;) {
    kv_gather_group g;
    const int n = kv_gather_plan(row.data(), start.data(), len.data(), r, num_reqs, row_bytes, &g);
    void *k = nullptr, *v = nullptr;
    UPF_TRY(kv_gather(src, g, &k, &v));
    /* the kernel reads key kj of a request at row kv_base + kj: the gathered rows begin at key `start` */
    std::vector<req_info> group(reqs + r, reqs + r + n);
    for (int i = 0; i < n; i++)
      group[i].kv_base = g.base[i] - g.start[i];
    attn_args a = pa;
    a.k = k, a.k_s0 = (int64_t)pa.hkv * pa.d, a.k_s1 = pa.d, a.k_s2 = 0;
    a.v = v, a.v_s0 = (int64_t)pa.hkv * pa.d, a.v_s1 = pa.d, a.v_s2 = 0;
    a.block_table = nullptr, a.max_blocks = 0, a.page_size = 0;
    UPF_TRY(mma_plan_and_run(a, group.data(), n, false, PREFILL_WGMMA));
    r += n;
  }
  return UPF_OK;
}

/* The mma path takes bf16 with D = 64/128/256 and 16-byte rows: every base pointer 16-byte aligned,
 * every stride a multiple of 8 elements. */
bool mma_ok(const upf_tensor *q, const upf_tensor *k, const upf_tensor *v, const upf_tensor *out) {
  if (q->dtype != UPF_DTYPE_BF16 || (q->shape[2] != 64 && q->shape[2] != 128 && q->shape[2] != 256))
    return false;
  if (q->shape[1] > 65535)
    return false;
  const upf_tensor *ts[4] = {q, k, v, out};
  for (int i = 0; i < 4; i++) {
    if ((uintptr_t)ts[i]->data % 16 != 0)
      return false;
    for (int j = 0; j < ts[i]->ndim - 1; j++) /* every outer stride: the paged caches have three */
      if (ts[i]->stride[j] % 8 != 0)
        return false;
  }
  return true;
}

/* Paged requests with at least this many query rows (prefill against the cache) take the prefill kernels
 * when the mma path applies; decode rows and short chunks take the GQA-packed ATT_BR-row tiles. */
constexpr int MMA_MIN_Q_ROWS = 16;

void args_common(attn_args &a, const upf_tensor *q, const upf_attn_params *p, const upf_tensor *out,
                 const upf_tensor *lse, int64_t hkv) {
  a.q = q->data, a.q_s0 = q->stride[0], a.q_s1 = q->stride[1];
  a.out = out->data, a.o_s0 = out->stride[0], a.o_s1 = out->stride[1];
  a.lse = lse ? (float *)lse->data : nullptr;
  a.hq = (int)q->shape[1], a.hkv = (int)hkv, a.group = (int)(q->shape[1] / hkv), a.d = (int)q->shape[2];
  a.scale = (float)upf_attn_scale(p, q->shape[2]);
  a.softcap = p->softcap;
  a.window = p->window;
}

/* Every K/V row of the FFMA kernel starts 16-byte aligned and holds whole runs of 8 bf16. */
bool kv_vec8(const upf_tensor *k, const upf_tensor *v) {
  if (k->dtype != UPF_DTYPE_BF16 || k->shape[k->ndim - 1] % 8 != 0)
    return false;
  const upf_tensor *ts[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    if ((uintptr_t)ts[i]->data % 16 != 0 || ts[i]->stride[ts[i]->ndim - 1] != 1)
      return false;
    for (int j = 0; j < ts[i]->ndim - 1; j++)
      if (ts[i]->stride[j] % 8 != 0)
        return false;
  }
  return true;
}

upf_status check_dims(const char *op, const upf_tensor *q, int64_t hkv) {
  if (q->shape[2] > UPF_CUDA_ATTN_MAX_D)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): head dim D=%lld above the kernel's %d", op,
                    (long long)q->shape[2], UPF_CUDA_ATTN_MAX_D);
  if (hkv > 65535)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): Hkv=%lld exceeds the grid", op, (long long)hkv);
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_attn_prefill(const upf_attn_varlen *b, const upf_tensor *q, const upf_tensor *k,
                                            const upf_tensor *v, const upf_attn_params *p, const upf_tensor *out,
                                            const upf_tensor *lse) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_attn_prefill_check(b, q, k, v, p, out, lse));
  UPF_TRY(check_dims("attn.prefill", q, k->shape[1]));
  if (q->shape[0] == 0)
    return UPF_OK;
  req_info *reqs = (req_info *)malloc((size_t)b->num_reqs * sizeof *reqs);
  if (!reqs)
    return upf_fail(UPF_ERR_NOMEM, "attn.prefill (cuda): %d requests", b->num_reqs);
  for (int32_t r = 0; r < b->num_reqs; r++) {
    const int32_t *cq = b->cu_seqlens_q_host, *ck = b->cu_seqlens_kv_host;
    reqs[r] = req_info{cq[r], cq[r + 1] - cq[r], ck[r + 1] - ck[r], ck[r], r};
  }
  attn_args a = {};
  args_common(a, q, p, out, lse, k->shape[1]);
  a.k = k->data, a.k_s0 = k->stride[0], a.k_s1 = k->stride[1];
  a.v = v->data, a.v_s0 = v->stride[0], a.v_s1 = v->stride[1];
  a.vec8 = kv_vec8(k, v);
  upf_status st = UPF_OK;
  if (mma_ok(q, k, v, out)) {
    prefill_kernel kernel = PREFILL_FA2;
    if (wgmma2_takes(a))
      st = prefill_kernel_chosen(&kernel);
    if (st == UPF_OK)
      st = mma_plan_and_run(a, reqs, b->num_reqs, false, kernel);
  } else {
    st = attn_plan_and_run(a, reqs, b->num_reqs, q->dtype, false, DECODE_FFMA);
  }
  free(reqs);
  return st;
}

extern "C" upf_status upf_cuda_attn_paged(const upf_attn_paged *b, const upf_tensor *q, const upf_tensor *k_cache,
                                          const upf_tensor *v_cache, const upf_attn_params *p,
                                          const upf_tensor *out, const upf_tensor *lse) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_attn_paged_check(b, q, k_cache, v_cache, p, out, lse));
  UPF_TRY(check_dims("attn.paged", q, k_cache->shape[2]));
  if (q->shape[0] == 0)
    return UPF_OK;
  req_info *reqs = (req_info *)malloc((size_t)b->num_reqs * sizeof *reqs);
  if (!reqs)
    return upf_fail(UPF_ERR_NOMEM, "attn.paged (cuda): %d requests", b->num_reqs);
  /* Long query runs first (when the mma path applies: the wgmma kernel over their gathered K/V, or the FA2
   * kernel), then the rest (the decode kernel of the attn.paged variant, or the FFMA kernel): the launches
   * write disjoint rows. The plans share the workspace; the stream orders each upload after the kernel
   * before it. */
  const bool mma = mma_ok(q, k_cache, v_cache, out);
  const int32_t *cq = b->cu_seqlens_q_host;
  int32_t n_long = 0, n = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int32_t r = 0; r < b->num_reqs; r++) {
      const bool is_long = mma && cq[r + 1] - cq[r] >= MMA_MIN_Q_ROWS;
      if (is_long == (pass == 0))
        reqs[n++] = req_info{cq[r], cq[r + 1] - cq[r], b->kv_lens_host[r], 0, r};
      n_long += is_long && pass == 0;
    }
  attn_args a = {};
  args_common(a, q, p, out, lse, k_cache->shape[2]);
  a.k = k_cache->data, a.k_s0 = k_cache->stride[0], a.k_s1 = k_cache->stride[1], a.k_s2 = k_cache->stride[2];
  a.v = v_cache->data, a.v_s0 = v_cache->stride[0], a.v_s1 = v_cache->stride[1], a.v_s2 = v_cache->stride[2];
  a.block_table = b->block_table, a.max_blocks = b->max_blocks, a.page_size = b->page_size;
  a.vec8 = kv_vec8(k_cache, v_cache);
  decode_kernel decode = DECODE_FFMA;
  upf_status st = mma ? decode_kernel_chosen(&decode) : UPF_OK;
  prefill_kernel long_kernel = PREFILL_FA2;
  if (st == UPF_OK && n_long && wgmma2_takes(a))
    st = prefill_kernel_chosen(&long_kernel);
  if (st == UPF_OK && n_long)
    st = long_kernel == PREFILL_WGMMA ? gathered_plan_and_run(a, reqs, n_long)
                                      : mma_plan_and_run(a, reqs, n_long, true, PREFILL_FA2);
  if (st == UPF_OK && n_long < b->num_reqs)
    st = attn_plan_and_run(a, reqs + n_long, b->num_reqs - n_long, q->dtype, true, decode);
  free(reqs);
  return st;
}

extern "C" upf_status upf_cuda_kv_cache_write(const upf_tensor *k, const upf_tensor *v, const int32_t *slot_mapping,
                                              const int32_t *slot_mapping_host, const upf_tensor *k_cache,
                                              const upf_tensor *v_cache) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_kv_cache_write_check(k, v, slot_mapping_host, k_cache, v_cache));
  const int64_t T = k->shape[0];
  if (T == 0)
    return UPF_OK;
  if (T > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "kv_cache.write (cuda): T=%lld exceeds the grid", (long long)T);
  cudaStream_t stream = upf_cuda_stream();
  const int hkv = (int)k->shape[1], d = (int)k->shape[2], P = (int)k_cache->shape[1];
  const int threads = hkv * d >= 256 ? 256 : hkv * d <= 32 ? 32 : (hkv * d + 31) / 32 * 32;
  if (k->dtype == UPF_DTYPE_BF16)
    kv_cache_write_kernel<bf16_t><<<(unsigned)T, threads, 0, stream>>>(
        (const bf16_t *)k->data, k->stride[0], k->stride[1], (const bf16_t *)v->data, v->stride[0], v->stride[1],
        slot_mapping, (bf16_t *)k_cache->data, k_cache->stride[0], k_cache->stride[1], k_cache->stride[2],
        (bf16_t *)v_cache->data, v_cache->stride[0], v_cache->stride[1], v_cache->stride[2], hkv, d, P);
  else
    kv_cache_write_kernel<float><<<(unsigned)T, threads, 0, stream>>>(
        (const float *)k->data, k->stride[0], k->stride[1], (const float *)v->data, v->stride[0], v->stride[1],
        slot_mapping, (float *)k_cache->data, k_cache->stride[0], k_cache->stride[1], k_cache->stride[2],
        (float *)v_cache->data, v_cache->stride[0], v_cache->stride[1], v_cache->stride[2], hkv, d, P);
  UPF_CUDA_LAUNCH_TRY("kv_cache_write_kernel");
  return UPF_OK;
}
