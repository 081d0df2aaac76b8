/* CUDA selection pipeline of UniPrefill (SPEC.md section 2): the fused select_run and the
 * stage-alone kernels that exist for verification.
 *
 * Why one pass: at T = 128K, Hq = 32, Hkv = 8, D = 128, L = 128, bf16 (perf/NOTES.md "Selection"), one
 * pass of QK^T is 2*L*T*D*Hq = 137 GFLOP (0.17 ms at the cuBLAS bf16 rate) with L*T*Hq = 0.54 G
 * exponentials (0.13-0.14 ms of MUFU), while K is read once in 268 MB (0.06 ms): arithmetic-bound. The
 * two-pass design (softmax normaliser first) doubles both, so the score kernel keeps per row an online
 * max and writes per-segment partial sums that are rescaled after the fact.
 *
 * select_run, fused (no score tensor is materialised):
 *   1. sel_score_kernel<MmaBf16<D,NW,MT,PIPE> | Ffma<T>, MODE>: grid over (key chunk of KC keys, kv
 *      head, row group, scored request). A CTA owns RPC = NW*16*MT of the g*L query rows of its
 *      kv-head group and streams the chunk's K through shared memory in tiles of 64 keys (cp.async
 *      double buffer, 16-byte chunks XOR-swizzled per row, ldmatrix.x4; Q stays in registers as
 *      mma.sync m16n8k16 A fragments, fp32 accumulators). Per query row it keeps an online max and
 *      exp2(dot*scale*log2e - max) (one FFMA + ex2.approx) and writes per (row, segment) the pair
 *      (M = reference max, U = sum of exp2 over the segment); a segment is the part of a selection
 *      block inside one chunk. G < 64 (MODE 0) writes one max per 64-key tile and U per block. It
 *      also writes per (row, chunk) the online-softmax pair (MC, LC). KC is chosen from the batch
 *      shape to fill the device in few waves (plan_fused).
 *      MmaBf16 (bf16, D = 64/128/256, 16-byte aligned rows): 8 warps x 2 m-tiles (256 rows per CTA,
 *      1 CTA/SM; 8 x 1 for D = 256), PIPE = half-tile software pipeline for G >= 64 (the MMAs of the
 *      next 32 keys are issued before the exponentials of the current 32). Ffma<T>: fp32 FFMA (no
 *      TF32) for fp32 inputs, and the bf16 fallback for other D <= 256 or unaligned rows.
 *      Hopper (sm_90a build, G >= 64, bf16 D = 64/128/256; the default there, the fastest measured):
 *      sel_score_wgmma_kernel (section 1b of cuda/select_score.cu). CTA = 4 consumer warpgroups (D = 256:
 *      2) x 64 query rows (Q in registers as the wgmma A operand) + 1 producer warp streaming 64-key K
 *      tiles by cp.async into a 4-stage (D = 64: 8) ring in the 128-byte-swizzle layout, full/empty
 *      mbarriers; wgmma m64n64k16 (B = K tile from smem). With four warpgroups each holds one
 *      accumulator set and the others' wgmma runs during its exponentials; with two (D = 256) each holds
 *      two sets and issues tile t+1 before the exponentials of tile t (epi_big, same (M, U, MC, LC)
 *      outputs, a fixed per-thread order, so the same bits run to run). The mma.sync kernel is the
 *      fallback (sm_90 builds, G < 64).
 *   2. sel_row_stats_kernel: per row: m = max MC, l = sum LC*exp2(MC-m) over chunks (fixed order).
 *   3. sel_block_mass_kernel: one CTA per block: b = sum_rows sum_segments U*exp2(M-m)/l, threads
 *      strided over rows, then cub::BlockReduce. Every float reduction in 1-3 has a fixed order:
 *      results are bitwise identical run to run (no float atomics).
 *   4. sel_topp_fused_kernel: one CTA per scored request; keys (float bits of b << IB | block) sorted
 *      descending by cub::BlockRadixSort (ties: larger index first), then BlockReduce for the sum and
 *      BlockScan for the exclusive prefix of pi = b/sum. Requests with more than 4096 blocks go to
 *      the segmented form: cub::DeviceSegmentedSort over all scored requests, then
 *      sel_topp_decide_kernel walks each request's sorted keys 4096 at a time (same arithmetic, so
 *      both forms give the same bits where both apply).
 *   5. Expansion: sel_token_mask_kernel, cub::DeviceScan::ExclusiveSum of the 0/1 mask, scatter of
 *      kept_index, new cu_seqlens and counts; one 16-byte device-to-host read at the end (kept_total
 *      and the non-finite flags).
 * Non-finite inputs: the PIPE and wgmma kernels check their operands (x*0 + chk in bf16x2 over the q
 * fragments once and over each K tile once per kv group: exactly the rows SPEC's check reads); the
 * other kernels check every score. Only when flagged (slow path) sel_nonfinite_scan_kernel names the
 * tensor, token, head and dim, as the CPU reference does.
 *
 * Stage-alone entries (simple, correct on every shape, for verification): sel_part_gemm_kernel
 * (one thread per score, fp32 FMA over D), sel_softmax_rows_kernel + sel_token_mass_kernel,
 * sel_block_reduce_kernel; select_topp and select_expand share the kernels of steps 4 and 5.
 *
 * Files: this one holds the host plan, the set-up that select_run and select_block_scores share
 * (score_stage) and the entries; cuda/select_score.cu step 1 (both score kernels and the picker);
 * cuda/select_stages.cu steps 2-5, the stage-alone kernels and the non-finite scan, each with its
 * launch function; cuda/select_common.cuh what they share.
 */
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/select.cuh"
#include "cuda/select_common.cuh"

namespace {

using namespace upf_select;

/* ---------------------------------------------------------------------------------------------- */
/* Plan: per-request layout computed on the host from cu_seqlens_host, uploaded once per call.      */

/* Layout of the uploaded blob. */
struct blob_offsets {
  size_t reqs, blk_off, sidx, seg_begin, seg_end, total;
};

blob_offsets blob_layout(const sel_plan &p) {
  blob_offsets o;
  size_t at = 0;
  o.reqs = at;
  at = align_up(at + sizeof(sel_req) * (size_t)p.S, 16);
  o.blk_off = at;
  at = align_up(at + sizeof(int64_t) * (size_t)(p.B + 1), 16);
  o.sidx = at;
  at = align_up(at + sizeof(int32_t) * (size_t)p.B, 16);
  o.seg_begin = at;
  at = align_up(at + sizeof(int64_t) * (size_t)p.S, 16);
  o.seg_end = at;
  at = align_up(at + sizeof(int64_t) * (size_t)p.S, 16);
  o.total = at;
  return o;
}

void plan_build(const upf_select_inputs *in, const upf_select_params *params, sel_plan &p) {
  const int32_t *cu = in->cu_seqlens_host;
  p.B = in->num_reqs;
  p.T = cu[p.B];
  p.Hq = (int32_t)in->q.shape[1];
  p.Hkv = in->k.ndim == 3 && in->k.shape[1] > 0 ? (int32_t)in->k.shape[1] : 1;
  p.grp = p.Hq / p.Hkv > 0 ? p.Hq / p.Hkv : 1;
  p.D = (int32_t)in->q.shape[2];
  p.L = params->last_q;
  p.G = params->block;
  p.sink = params->sink;
  p.Rn = (int64_t)p.Hq * p.L;
  p.blk_off.assign((size_t)p.B + 1, 0);
  upf_select_block_offsets(cu, p.B, p.G, p.blk_off.data());
  p.num_blocks = p.blk_off[(size_t)p.B];
  p.sidx.assign((size_t)p.B, -1);
  p.reqs.clear();
  p.seg_begin.clear();
  p.seg_end.clear();
  p.max_nb = 0;
  int64_t sc = 0;
  for (int32_t r = 0; r < p.B; r++) {
    int64_t n = (int64_t)cu[r + 1] - cu[r];
    if (!upf_select_is_scored(n, params))
      continue;
    sel_req q;
    memset(&q, 0, sizeof q);
    q.tok0 = cu[r];
    q.blk0 = p.blk_off[(size_t)r];
    q.sc0 = sc;
    sc += p.Rn * n;
    q.n = (int32_t)n;
    q.r = r;
    q.nb = (int32_t)(p.blk_off[(size_t)r + 1] - p.blk_off[(size_t)r]);
    p.max_nb = std::max(p.max_nb, q.nb);
    p.sidx[(size_t)r] = (int32_t)p.reqs.size();
    p.reqs.push_back(q);
    p.seg_begin.push_back(q.blk0);
    p.seg_end.push_back(q.blk0 + q.nb);
  }
  p.S = (int32_t)p.reqs.size();
  p.score_len = sc;
  p.blob_bytes = blob_layout(p).total;
}

/* Chooses the key chunk and fills the fused-kernel layout. `slots` = CTAs resident on the device. */
void plan_fused(sel_plan &p, int32_t rows_per_cta, int64_t slots) {
  p.RPC = rows_per_cta;
  int64_t group_rows = (int64_t)p.grp * p.L;
  p.RG = (int32_t)((group_rows + rows_per_cta - 1) / rows_per_cta);
  int64_t max_n = 0;
  for (const sel_req &q : p.reqs)
    max_n = std::max<int64_t>(max_n, q.n);
  int32_t best = 1024;
  double best_cost = 0;
  for (int32_t kc = 256; kc <= 8192; kc *= 2) {
    int64_t ctas = 0;
    for (const sel_req &q : p.reqs)
      ctas += (q.n + kc - 1) / kc * (int64_t)p.Hkv * p.RG;
    int64_t waves = (ctas + slots - 1) / slots;
    double cost = (double)waves * (double)(std::min<int64_t>(kc, max_n) + 96);
    if (kc == 256 || cost <= best_cost) {
      best_cost = cost;
      best = kc;
    }
  }
  p.KC = best;
  p.SG = std::min(p.G, p.KC);
  p.UG = std::max(p.SG, 64);
  int64_t u = 0, m = 0, c = 0, cta = 0;
  for (sel_req &q : p.reqs) {
    q.nseg = (int32_t)((q.n + p.SG - 1) / p.SG);
    q.nunit = (int32_t)((q.n + p.UG - 1) / p.UG);
    q.nchunk = (int32_t)((q.n + p.KC - 1) / p.KC);
    q.u0 = u;
    q.m0 = m;
    q.c0 = c;
    q.cta0 = (int32_t)cta;
    u += (int64_t)q.nseg * p.Rn;
    m += (int64_t)q.nunit * p.Rn;
    c += (int64_t)q.nchunk * p.Rn;
    cta += (int64_t)q.nchunk * p.Hkv * p.RG;
  }
  p.u_len = u;
  p.m_len = m;
  p.c_len = c;
  p.ctas = (int32_t)cta;
}

void plan_pack(const sel_plan &p, std::vector<uint8_t> &blob) {
  blob_offsets o = blob_layout(p);
  blob.assign(o.total ? o.total : 16, 0);
  if (p.S)
    memcpy(blob.data() + o.reqs, p.reqs.data(), sizeof(sel_req) * (size_t)p.S);
  memcpy(blob.data() + o.blk_off, p.blk_off.data(), sizeof(int64_t) * (size_t)(p.B + 1));
  memcpy(blob.data() + o.sidx, p.sidx.data(), sizeof(int32_t) * (size_t)p.B);
  if (p.S) {
    memcpy(blob.data() + o.seg_begin, p.seg_begin.data(), sizeof(int64_t) * (size_t)p.S);
    memcpy(blob.data() + o.seg_end, p.seg_end.data(), sizeof(int64_t) * (size_t)p.S);
  }
}

sel_dev_plan plan_device(const sel_plan &p, const uint8_t *dev_blob) {
  blob_offsets o = blob_layout(p);
  sel_dev_plan d;
  d.reqs = (const sel_req *)(dev_blob + o.reqs);
  d.blk_off = (const int64_t *)(dev_blob + o.blk_off);
  d.sidx = (const int32_t *)(dev_blob + o.sidx);
  d.seg_begin = (const int64_t *)(dev_blob + o.seg_begin);
  d.seg_end = (const int64_t *)(dev_blob + o.seg_end);
  return d;
}

/* ---------------------------------------------------------------------------------------------- */
/* Host set-up shared by the entries                                                                */

upf_status check_head_dim(const upf_select_inputs *in, const char *op) {
  int64_t D = in->q.shape[2];
  if (D > 256)
    return upf_fail(UPF_ERR_UNSUPPORTED, "%s (cuda): head dim D=%lld is not supported (D <= 256)", op, (long long)D);
  return UPF_OK;
}

/* The checks the CPU backend's stage entries make when they read only the layout. */
upf_status check_layout(const upf_select_inputs *in, const upf_select_params *params) {
  UPF_TRY(upf_select_params_check(params));
  if (in->q.ndim != 3)
    return upf_fail(UPF_ERR_SHAPE, "q: the descriptor must give (T, Hq, D) even when only the layout is used");
  if (!in->cu_seqlens_host)
    return upf_fail(UPF_ERR_CU_SEQLENS, "cu_seqlens: host copy missing");
  return upf_cu_seqlens_check(in->cu_seqlens_host, in->num_reqs, in->q.shape[0]);
}

/* Small device results read back at the end of a call. */
struct sel_result {
  int32_t kept_total;
  unsigned bad_req;
  unsigned long long bad_score;
};

upf_status report_bad_score(const sel_plan &p, const float *block_score, unsigned long long code, const char *op) {
  int r = (int)(code >> 32);
  int64_t cl = (int64_t)(code & 0xffffffffu);
  float v = 0.f;
  UPF_TRY(upf_cuda_download_small(&v, block_score + p.blk_off[(size_t)r] + cl, sizeof v));
  if (!isfinite(v))
    return upf_fail(UPF_ERR_NONFINITE, "%s: block score %lld of request %d is %s", op, (long long)cl, r,
                    isnan(v) ? "NaN" : "Inf");
  return upf_fail(UPF_ERR_INVALID_ARG, "%s: block score %lld of request %d is negative (%g)", op, (long long)cl, r,
                  (double)v);
}

upf_status upload_plan(const sel_plan &p, uint8_t *dev_blob) {
  std::vector<uint8_t> blob;
  plan_pack(p, blob);
  return upf_cuda_upload_async(dev_blob, blob.data(), blob.size());
}

/* Stages 1-3 of select_run and select_block_scores, one code path for both: the score kernel picked
 * and the fused plan laid out (prepare), the workspace pieces carved after the caller's (take), the
 * score, row-stats and block-mass kernels launched (launch). */
struct score_stage {
  kernel_cfg cfg = {};
  size_t o_M = 0, o_U = 0, o_MC = 0, o_LC = 0, o_rm = 0, o_ri = 0;

  upf_status prepare(const upf_select_inputs *in, sel_plan &p) {
    if (p.S > 0) {
      UPF_TRY(choose_score_kernel(in, p, cfg));
      int occ = 1;
      UPF_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, cfg.fn, cfg.threads, cfg.smem));
      plan_fused(p, cfg.rows_per_cta, (int64_t)upf_cuda_num_sms() * std::max(occ, 1));
    }
    return UPF_OK;
  }

  void take(ws_carver &wc, const sel_plan &p) {
    o_M = wc.take(sizeof(float) * (size_t)p.m_len);
    o_U = wc.take(sizeof(float) * (size_t)p.u_len);
    o_MC = wc.take(sizeof(float) * (size_t)p.c_len);
    o_LC = wc.take(sizeof(float) * (size_t)p.c_len);
    o_rm = wc.take(sizeof(float) * (size_t)p.S * (size_t)p.Rn);
    o_ri = wc.take(sizeof(float) * (size_t)p.S * (size_t)p.Rn);
  }

  /* block_score (num_blocks) on the stream; bad_req (device) receives the first scored request whose
   * scores were not finite. */
  upf_status launch(const upf_select_inputs *in, const upf_select_params *params, const sel_plan &p,
                    const sel_dev_plan &dp, uint8_t *base, float *block_score, unsigned *bad_req,
                    cudaStream_t stream) const {
    if (p.S > 0) {
      score_args x;
      x.q = in->q.data;
      x.k = in->k.data;
      x.qs0 = in->q.stride[0];
      x.qs1 = in->q.stride[1];
      x.ks0 = in->k.stride[0];
      x.ks1 = in->k.stride[1];
      x.Hq = p.Hq;
      x.Hkv = p.Hkv;
      x.grp = p.grp;
      x.L = p.L;
      x.D = p.D;
      x.G = p.G;
      x.SG = p.SG;
      x.UG = p.UG;
      x.KC = p.KC;
      x.RG = p.RG;
      x.RPC = p.RPC;
      x.S = p.S;
      x.Rn = p.Rn;
      x.c = (float)((double)upf_select_scale(params, p.D) * 1.4426950408889634);
      x.reqs = dp.reqs;
      x.M = (float *)(base + o_M);
      x.U = (float *)(base + o_U);
      x.MC = (float *)(base + o_MC);
      x.LC = (float *)(base + o_LC);
      x.bad_req = bad_req;
      /* the kernel's signature says how many of these it reads: the map is the wgmma kernel's second */
      CUtensorMap kmap = cfg.kmap;
      void *args[] = {&x, &kmap};
      UPF_CUDA_TRY(cudaLaunchKernel(cfg.fn, dim3((unsigned)p.ctas), dim3(cfg.threads), args, cfg.smem, stream));
      UPF_CUDA_LAUNCH_TRY("sel_score_kernel");
      return launch_combine(p, dp, x.M, x.U, x.MC, x.LC, (float *)(base + o_rm), (float *)(base + o_ri), block_score,
                            stream);
    }
    return launch_unscored_blocks(p, dp, nullptr, block_score, stream);
  }
};

/* A scored request whose fp32 scores were not finite: the input that is NaN/Inf, else an overflow. */
upf_status report_bad_scores(const upf_select_inputs *in, const sel_plan &p, int r, const char *op) {
  bool found = false;
  UPF_TRY(find_nonfinite(in, p, upf_cuda_stream(), op, &found));
  return upf_fail(UPF_ERR_NONFINITE, "%s (cuda): request %d: scores overflowed fp32 (q and k are finite)", op, r);
}

} // namespace

/* ---------------------------------------------------------------------------------------------- */
/* Entries                                                                                          */

extern "C" upf_status upf_cuda_select_run(const upf_select_inputs *in, const upf_select_params *params,
                                          upf_select_outputs *out) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(check_head_dim(in, "select"));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  score_stage sc;
  UPF_TRY(sc.prepare(in, p));

  ws_carver wc;
  size_t o_blob = wc.take(p.blob_bytes);
  size_t o_res = wc.take(sizeof(sel_result));
  sc.take(wc, p);
  size_t o_bs = wc.take(out->block_score ? 0 : sizeof(float) * (size_t)p.num_blocks);
  size_t o_bm = wc.take(out->block_mask ? 0 : (size_t)p.num_blocks);
  size_t o_tp = wc.take(topp_ws_bytes(p));
  size_t o_ex = wc.take(expand_ws_bytes(p));
  void *ws;
  UPF_TRY(upf_cuda_workspace(wc.at, &ws));
  uint8_t *base = (uint8_t *)ws;
  sel_result *d_res = (sel_result *)(base + o_res);
  float *block_score = out->block_score ? out->block_score : (float *)(base + o_bs);
  uint8_t *block_mask = out->block_mask ? out->block_mask : base + o_bm;

  UPF_TRY(upload_plan(p, base + o_blob));
  sel_dev_plan dp = plan_device(p, base + o_blob);
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), stream));

  UPF_TRY(sc.launch(in, params, p, dp, base, block_score, &d_res->bad_req, stream));
  UPF_TRY(run_topp(p, dp, params, block_score, block_mask, &d_res->bad_score, base + o_tp, stream));
  UPF_TRY(run_expand(in, p, dp, params, block_mask, out, base + o_ex, &d_res->kept_total, stream));

  sel_result res;
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_req != ~0u || res.bad_score != ~0ull)
    return report_bad_scores(in, p, res.bad_req != ~0u ? p.reqs[res.bad_req].r : (int)(res.bad_score >> 32), "select");
  out->kept_total = res.kept_total;
  return UPF_OK;
}

/* Stages 1-3 of select_run alone: the same plan, kernels and workspace layout up to block_score. */
extern "C" upf_status upf_cuda_select_block_scores(const upf_select_inputs *in, const upf_select_params *params,
                                                   float *block_score) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  UPF_TRY(check_head_dim(in, "select.block_scores"));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  score_stage sc;
  UPF_TRY(sc.prepare(in, p));
  ws_carver wc;
  size_t o_blob = wc.take(p.blob_bytes);
  size_t o_res = wc.take(sizeof(sel_result));
  sc.take(wc, p);
  void *ws;
  UPF_TRY(upf_cuda_workspace(wc.at, &ws));
  uint8_t *base = (uint8_t *)ws;
  sel_result *d_res = (sel_result *)(base + o_res);
  UPF_TRY(upload_plan(p, base + o_blob));
  sel_dev_plan dp = plan_device(p, base + o_blob);
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), stream));
  UPF_TRY(sc.launch(in, params, p, dp, base, block_score, &d_res->bad_req, stream));
  sel_result res;
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_req != ~0u)
    return report_bad_scores(in, p, p.reqs[res.bad_req].r, "select.block_scores");
  return UPF_OK;
}

/* The frame of the stage-alone entries that read only the layout: begin (the device, the layout checks,
 * the host plan, and the plan blob as the workspace's first piece), the entry's own pieces by wc.take,
 * then map (the workspace, with the plan uploaded into it). */
struct stage_call {
  sel_plan p;
  cudaStream_t stream = nullptr;
  ws_carver wc;
  uint8_t *base = nullptr;
  sel_dev_plan dp = {};

  upf_status begin(const upf_select_inputs *in, const upf_select_params *params) {
    UPF_TRY(upf_cuda_init());
    UPF_TRY(check_layout(in, params));
    stream = upf_cuda_stream();
    plan_build(in, params, p);
    wc.take(p.blob_bytes);
    return UPF_OK;
  }
  upf_status map() {
    void *ws;
    UPF_TRY(upf_cuda_workspace(wc.at, &ws));
    base = (uint8_t *)ws;
    UPF_TRY(upload_plan(p, base));
    dp = plan_device(p, base);
    return UPF_OK;
  }
};

extern "C" upf_status upf_cuda_select_part_gemm(const upf_select_inputs *in, const upf_select_params *params,
                                                float *scores) {
  UPF_TRY(upf_cuda_init());
  UPF_TRY(upf_select_validate(in, params));
  cudaStream_t stream = upf_cuda_stream();
  sel_plan p;
  plan_build(in, params, p);
  if (p.S == 0)
    return UPF_OK;
  bool found = false;
  UPF_TRY(find_nonfinite(in, p, stream, "select.part_gemm", &found));
  void *ws; /* after the scan, which uses the workspace too */
  UPF_TRY(upf_cuda_workspace(p.blob_bytes, &ws));
  UPF_TRY(upload_plan(p, (uint8_t *)ws));
  sel_dev_plan dp = plan_device(p, (const uint8_t *)ws);
  return launch_part_gemm(in, p, dp, upf_select_scale(params, p.D), scores, stream);
}

extern "C" upf_status upf_cuda_select_block_softmax(const upf_select_inputs *in, const upf_select_params *params,
                                                    const float *scores, float *token_mass) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  const sel_plan &p = c.p;
  if (p.T == 0)
    return UPF_OK;
  const int64_t rows = (int64_t)p.S * p.Rn;
  const size_t o_m = c.wc.take(sizeof(float) * (size_t)rows), o_l = c.wc.take(sizeof(float) * (size_t)rows);
  UPF_TRY(c.map());
  return launch_block_softmax(in, p, c.dp, scores, (float *)(c.base + o_m), (float *)(c.base + o_l), token_mass,
                              c.stream);
}

extern "C" upf_status upf_cuda_select_block_reduce(const upf_select_inputs *in, const upf_select_params *params,
                                                   const float *token_mass, float *block_score) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  if (c.p.num_blocks == 0)
    return UPF_OK;
  UPF_TRY(c.map());
  return launch_block_reduce(c.p, c.dp, token_mass, block_score, c.stream);
}

extern "C" upf_status upf_cuda_select_topp(const upf_select_inputs *in, const upf_select_params *params,
                                           const float *block_score, uint8_t *block_mask) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  if (c.p.num_blocks == 0)
    return UPF_OK;
  const size_t o_res = c.wc.take(sizeof(sel_result)), o_tp = c.wc.take(topp_ws_bytes(c.p));
  UPF_TRY(c.map());
  sel_result *d_res = (sel_result *)(c.base + o_res), res;
  UPF_CUDA_TRY(cudaMemsetAsync(d_res, 0xFF, sizeof(sel_result), c.stream));
  UPF_TRY(run_topp(c.p, c.dp, params, block_score, block_mask, &d_res->bad_score, c.base + o_tp, c.stream));
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  if (res.bad_score != ~0ull)
    return report_bad_score(c.p, block_score, res.bad_score, "select.topp");
  return UPF_OK;
}

extern "C" upf_status upf_cuda_select_expand(const upf_select_inputs *in, const upf_select_params *params,
                                             const uint8_t *block_mask, upf_select_outputs *out) {
  stage_call c;
  UPF_TRY(c.begin(in, params));
  const size_t o_res = c.wc.take(sizeof(sel_result)), o_ex = c.wc.take(expand_ws_bytes(c.p));
  UPF_TRY(c.map());
  sel_result *d_res = (sel_result *)(c.base + o_res), res;
  UPF_TRY(run_expand(in, c.p, c.dp, params, block_mask, out, c.base + o_ex, &d_res->kept_total, c.stream));
  UPF_TRY(upf_cuda_download_small(&res, d_res, sizeof res));
  out->kept_total = res.kept_total;
  return UPF_OK;
}
