/* CUnit suite "tp": the pieces of tensor parallelism that one process can check (the multi-rank runs
 * are tests/tp/run.sh under mpirun): the head split, the single-rank communicator, the argument and
 * availability errors, the weight slices of every tiny family against the whole seeded model at the
 * indices each slice claims, and, on a GPU, NCCL with one rank bootstrapped through a unique-id file
 * (all-reduce identity, TP-path prefill equal to the plain path). */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/comm_impl.h"
#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/model.h"
#include "verify/select_inputs.h"

/* ---- head split ---- */

static void test_head_split(void) {
  upf_head_split h;
  /* 4 query heads over 2 kv heads (the tiny models) on 2 ranks: one kv head each */
  CU_ASSERT_EQUAL(upf_head_split_of(4, 2, 1, 2, &h), UPF_OK);
  CU_ASSERT(h.q0 == 2 && h.nq == 2 && h.kv0 == 1 && h.nkv == 1);
  /* on 4 ranks: kv head 1 replicated on ranks 2 and 3 */
  CU_ASSERT_EQUAL(upf_head_split_of(4, 2, 3, 4, &h), UPF_OK);
  CU_ASSERT(h.q0 == 3 && h.nq == 1 && h.kv0 == 1 && h.nkv == 1);
  CU_ASSERT_EQUAL(upf_head_split_of(4, 2, 1, 4, &h), UPF_OK);
  CU_ASSERT(h.q0 == 1 && h.kv0 == 0);
  /* Llama-3.1-8B on 8 ranks: 4 query heads, 1 kv head each */
  CU_ASSERT_EQUAL(upf_head_split_of(32, 8, 5, 8, &h), UPF_OK);
  CU_ASSERT(h.q0 == 20 && h.nq == 4 && h.kv0 == 5 && h.nkv == 1);
  /* Qwen3-Next on 8 ranks: 16/2 heads, kv heads replicated over 4 ranks each */
  CU_ASSERT_EQUAL(upf_head_split_of(16, 2, 5, 8, &h), UPF_OK);
  CU_ASSERT(h.q0 == 10 && h.nq == 2 && h.kv0 == 1 && h.nkv == 1);
  /* every query head of every rank finds its kv head among the rank's (all shapes, 1-8 ranks) */
  const int32_t shapes[][2] = {{4, 2}, {8, 2}, {8, 8}, {16, 2}, {32, 8}, {12, 4}};
  for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
    for (int32_t R = 1; R <= 8; R++)
      for (int32_t r = 0; r < R; r++) {
        const int32_t Hq = shapes[s][0], Hkv = shapes[s][1];
        if (upf_head_split_of(Hq, Hkv, r, R, &h) != UPF_OK) {
          CU_ASSERT(Hq % R != 0 || (Hkv % R != 0 && R % Hkv != 0));
          continue;
        }
        CU_ASSERT(h.nq * R == Hq && h.q0 == r * h.nq);
        for (int32_t q = h.q0; q < h.q0 + h.nq; q++)
          CU_ASSERT(q / (Hq / Hkv) >= h.kv0 && q / (Hq / Hkv) < h.kv0 + h.nkv);
      }
  CU_ASSERT_EQUAL(upf_head_split_of(4, 2, 0, 3, &h), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "3 ranks"));
  CU_ASSERT_EQUAL(upf_head_split_of(6, 3, 0, 2, &h), UPF_ERR_SHAPE); /* 3 kv heads over 2 ranks */
  CU_ASSERT_EQUAL(upf_head_split_of(4, 2, 2, 2, &h), UPF_ERR_INVALID_ARG);
}

/* ---- the single-rank communicator and argument errors ---- */

static void test_single_comm(void) {
  upf_comm *c = NULL;
  CU_ASSERT_EQUAL(upf_comm_create("single", upf_backend_cpu(), NULL, &c), UPF_OK);
  if (!c)
    return;
  CU_ASSERT(upf_comm_rank(c) == 0 && upf_comm_size(c) == 1 && upf_comm_kind_of(c) == UPF_COMM_SINGLE);
  float x[3] = {1.5f, -2.0f, 3.25f};
  CU_ASSERT_EQUAL(upf_comm_allreduce_sum(c, x, 3, UPF_DTYPE_F32), UPF_OK);
  CU_ASSERT(x[0] == 1.5f && x[1] == -2.0f && x[2] == 3.25f);
  char b[4] = "abc";
  CU_ASSERT_EQUAL(upf_comm_broadcast(c, b, 4, 0), UPF_OK);
  CU_ASSERT_STRING_EQUAL(b, "abc");
  CU_ASSERT_EQUAL(upf_comm_barrier(c), UPF_OK);
  upf_comm_stats s = upf_comm_get_stats(c);
  CU_ASSERT(s.calls == 1 && s.bytes == 12.0 && s.bcast_calls == 1 && s.bcast_bytes == 4.0);
  int32_t differing = -1;
  CU_ASSERT_EQUAL(upf_comm_broadcast_check(c, b, 4, 0, &differing), UPF_OK);
  CU_ASSERT(differing == 0 && !strcmp(b, "abc") && upf_comm_get_stats(c).bcast_calls == 2);
  CU_ASSERT_EQUAL(upf_comm_broadcast_check(c, b, 4, 1, &differing), UPF_ERR_INVALID_ARG);
  /* argument errors, each naming what is wrong */
  int32_t ints[2] = {0, 0};
  CU_ASSERT_EQUAL(upf_comm_allreduce_sum(c, ints, 2, UPF_DTYPE_I32), UPF_ERR_DTYPE);
  CU_ASSERT_EQUAL(upf_comm_allreduce_sum(c, NULL, 2, UPF_DTYPE_F32), UPF_ERR_INVALID_ARG);
  CU_ASSERT_EQUAL(upf_comm_broadcast(c, b, 4, 1), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "root 1 of 1"));
  upf_comm_reset_stats(c);
  CU_ASSERT_EQUAL(upf_comm_get_stats(c).calls, 0);
  upf_comm_destroy(c);

  CU_ASSERT_EQUAL(upf_comm_create("bogus", upf_backend_cpu(), NULL, &c), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NULL(c);
  CU_ASSERT_EQUAL(upf_comm_create("nccl", upf_backend_cpu(), NULL, &c), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "cuda backend"));
  /* not started by mpirun: auto is the single rank */
  if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMI_SIZE")) {
    CU_ASSERT_EQUAL(upf_comm_create("auto", upf_backend_cpu(), NULL, &c), UPF_OK);
    CU_ASSERT_EQUAL(upf_comm_kind_of(c), UPF_COMM_SINGLE);
    upf_comm_destroy(c);
  }
  /* a backend this build lacks says so by name (MPI's availability is not asked: that loads libmpi,
   * whose start-up allocations are not ours to check under Valgrind) */
  const char *why = NULL;
  if (!upf_comm_available(UPF_COMM_NCCL, &why))
    CU_ASSERT(strstr(why, "NCCL") || strstr(why, "nccl") || strstr(why, "CUDA"));
}

/* ---- select.block_scores, the partial scores of a rank ---- */

/* On be: block_scores equals select_run's block_score bit for bit, over all heads and over each rank's
 * heads of 4 ranks; the blocks of unscored requests are 0; the 4 ranks' partial scores sum to the
 * whole within fp32 rounding (softmax mass is additive over heads); a NaN in q is refused. */
static void check_block_scores(const upf_backend *be) {
  const int32_t lens[] = {700, 30, 1, 333}, B = 4, Hq = 8, Hkv = 2, D = 32, R = 4;
  upf_select_params p = upf_select_params_default();
  p.block = 16, p.sink = 16, p.last_q = 16, p.p = 0.7f;
  upf_select_problem pb;
  CU_ASSERT_EQUAL_FATAL(upf_select_problem_make(&pb, lens, B, Hq, Hkv, D, UPF_DTYPE_F32, UPF_DIST_HEAVY, 5), UPF_OK);
  const upf_select_inputs host = upf_select_problem_inputs(&pb);
  const int64_t T = pb.cu_seqlens[B];
  int64_t off[5];
  upf_select_block_offsets(pb.cu_seqlens, B, p.block, off);
  const int64_t nb = off[B];
  const size_t qb = (size_t)upf_tensor_numel(&pb.q) * 4, kb = (size_t)upf_tensor_numel(&pb.k) * 4;
  void *dq = NULL, *dk = NULL, *dcu = NULL, *dscore = NULL, *drun = NULL, *dmask = NULL, *dtm = NULL;
  void *dki = NULL, *dncu = NULL, *dcnt = NULL;
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dq, qb), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dk, kb), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dcu, (size_t)(B + 1) * 4), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dscore, (size_t)nb * 4), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&drun, (size_t)nb * 4), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dmask, (size_t)nb), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dtm, (size_t)T), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dki, (size_t)T * 4), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dncu, (size_t)(B + 1) * 4), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&dcnt, (size_t)B * 4), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(dq, pb.q.data, qb), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(dk, pb.k.data, kb), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(dcu, pb.cu_seqlens, (size_t)(B + 1) * 4), UPF_OK);
  float *whole = calloc((size_t)nb, 4), *got = calloc((size_t)nb, 4), *run = calloc((size_t)nb, 4);
  double *sum = calloc((size_t)nb, sizeof *sum);
  for (int32_t r = -1; r < R; r++) { /* -1: every head; else rank r's heads */
    upf_select_inputs in = host;
    in.q.data = dq, in.k.data = dk, in.cu_seqlens = dcu;
    if (r >= 0) {
      upf_head_split hs;
      CU_ASSERT_EQUAL_FATAL(upf_head_split_of(Hq, Hkv, r, R, &hs), UPF_OK);
      in.q.data = (float *)dq + hs.q0 * D, in.q.shape[1] = hs.nq;
      in.k.data = (float *)dk + hs.kv0 * D, in.k.shape[1] = hs.nkv;
    }
    CU_ASSERT_EQUAL(be->fill(dscore, 0x7f, (size_t)nb * 4), UPF_OK); /* every block must be written */
    CU_ASSERT_EQUAL(be->select_block_scores(&in, &p, dscore), UPF_OK);
    upf_select_outputs out = {drun, dmask, dtm, dki, dncu, dcnt, 0};
    CU_ASSERT_EQUAL(be->select_run(&in, &p, &out), UPF_OK);
    CU_ASSERT_EQUAL(be->download(got, dscore, (size_t)nb * 4), UPF_OK);
    CU_ASSERT_EQUAL(be->download(run, drun, (size_t)nb * 4), UPF_OK);
    CU_ASSERT(!memcmp(got, run, (size_t)nb * 4));
    for (int64_t c = off[1]; c < off[3]; c++) /* requests 1 (30 <= sink + L tokens) and 2 (a decode row) are not scored */
      CU_ASSERT(got[c] == 0.0f);
    for (int64_t c = 0; c < nb; c++) {
      if (r < 0)
        whole[c] = got[c];
      else
        sum[c] += got[c];
    }
  }
  int close = 1;
  for (int64_t c = 0; c < nb; c++)
    close &= fabs(sum[c] - whole[c]) <= 1e-5 + 1e-5 * fabs(whole[c]);
  CU_ASSERT(close);
  CU_ASSERT(whole[0] > 0.0f && whole[off[3]] > 0.0f);
  /* a NaN in the last query row of request 0 */
  ((float *)pb.q.data)[(int64_t)(lens[0] - 1) * Hq * D + 3] = NAN;
  CU_ASSERT_EQUAL(be->upload(dq, pb.q.data, qb), UPF_OK);
  upf_select_inputs in = host;
  in.q.data = dq, in.k.data = dk, in.cu_seqlens = dcu;
  CU_ASSERT_EQUAL(be->select_block_scores(&in, &p, dscore), UPF_ERR_NONFINITE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "NaN"));
  void *bufs[] = {dq, dk, dcu, dscore, drun, dmask, dtm, dki, dncu, dcnt};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    be->release(bufs[i]);
  free(whole), free(got), free(run), free(sum);
  upf_select_problem_free(&pb);
}

static void test_block_scores_cpu(void) { check_block_scores(upf_backend_cpu()); }
static void test_block_scores_cuda(void) { check_block_scores(upf_backend_cuda()); }

/* ---- weight slices ---- */

/* A communicator of rank r of R in this process whose collectives are the identity: enough to build a
 * rank's slice of a model (nothing is reduced). */
static upf_status fake_allreduce(upf_comm *c, void *buf, int64_t n, upf_dtype dt) { return UPF_OK; }
static upf_status fake_broadcast(upf_comm *c, void *buf, int64_t n, int32_t root) { return UPF_OK; }
static upf_status fake_broadcast_check(upf_comm *c, void *buf, int64_t n, int32_t root, int32_t *differing) {
  *differing = 0;
  return UPF_OK;
}
static upf_status fake_barrier(upf_comm *c) { return UPF_OK; }
static void fake_destroy(upf_comm *c) {}
static const upf_comm_ops fake_ops = {fake_allreduce, fake_broadcast, fake_broadcast_check, fake_barrier,
                                      fake_destroy};

static upf_comm fake_comm(int32_t rank, int32_t size) {
  upf_comm c;
  memset(&c, 0, sizeof c);
  c.kind = UPF_COMM_MPI, c.be = upf_backend_cpu(), c.rank = rank, c.size = size, c.timeout_s = 1, c.ops = &fake_ops;
  return c;
}

/* Segments (start, len) along one axis: the whole-tensor coordinate of local coordinate x. */
static int64_t seg_map(const int64_t *seg, int nseg, int64_t x) {
  for (int k = 0; k < nseg; k++) {
    if (x < seg[2 * k + 1])
      return seg[2 * k] + x;
    x -= seg[2 * k + 1];
  }
  return -1;
}

/* Every element of the slice s equals the whole tensor f at the coordinates the segments name. */
static int slice_matches(const upf_tensor *f, const upf_tensor *s, int axis, const int64_t *seg, int nseg) {
  if (s->ndim != f->ndim)
    return 0;
  int64_t want = 0;
  for (int k = 0; k < nseg; k++)
    want += seg[2 * k + 1];
  for (int d = 0; d < f->ndim; d++)
    if (s->shape[d] != (d == axis ? want : f->shape[d]))
      return 0;
  const int64_t n = upf_tensor_numel(s);
  for (int64_t i = 0; i < n; i++) {
    int64_t c[3] = {0, 0, 0}, rest = i, g = 0;
    for (int d = s->ndim - 1; d >= 0; d--)
      c[d] = rest % s->shape[d], rest /= s->shape[d];
    c[axis] = seg_map(seg, nseg, c[axis]);
    for (int d = 0; d < f->ndim; d++)
      g = g * f->shape[d] + c[d];
    if (((const float *)s->data)[i] != ((const float *)f->data)[g])
      return 0;
  }
  return 1;
}

/* Layers [0, layers) of the model (at least one of each kind in every tiny family from 4 on). */
static void check_slices(const char *name, int32_t R, int32_t layers) {
  const upf_model_config *cfg = upf_model_config_by_name(name);
  upf_model full, part;
  CU_ASSERT_FATAL(upf_model_init_seeded(&full, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 9, 0, layers) == UPF_OK);
  for (int32_t r = 0; r < R; r++) {
    upf_comm comm = fake_comm(r, R);
    const upf_status st = upf_model_init_seeded_tp(&part, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 9, 0, layers, &comm);
    CU_ASSERT_EQUAL(st, UPF_OK);
    if (st != UPF_OK) {
      printf("\n%s tp %d: %s\n", name, R, upf_last_error());
      continue;
    }
    CU_ASSERT(part.cfg != cfg && part.full_cfg == cfg && part.tp_rank == r && part.tp_size == R);
    CU_ASSERT(part.weight_bytes < full.weight_bytes);
    upf_head_split hs, gs = {0, 0, 0, 0};
    upf_head_split_of(cfg->q_heads, cfg->kv_heads, r, R, &hs);
    const int64_t D = cfg->head_dim, qs = D * (1 + cfg->attn_gate), Hq = cfg->q_heads, Hkv = cfg->kv_heads;
    int ok = 1;
    for (int32_t l = 0; l < layers; l++) {
      const upf_layer_weights *F = &full.layers[l], *S = &part.layers[l];
      ok &= slice_matches(&F->attn_norm, &S->attn_norm, 0, (int64_t[]){0, cfg->hidden}, 1);
      if (upf_model_mixer(cfg, l) == UPF_MIXER_GDN) {
        upf_head_split_of(cfg->gdn_value_heads, cfg->gdn_key_heads, r, R, &gs);
        const int64_t Hk = cfg->gdn_key_heads, Dk = cfg->gdn_key_dim, Dv = cfg->gdn_value_dim;
        const int64_t C = upf_model_gdn_conv_dim(cfg), Hv = cfg->gdn_value_heads;
        const int64_t conv[6] = {gs.kv0 * Dk, Dk * gs.nkv, (Hk + gs.kv0) * Dk, Dk * gs.nkv, 2 * Hk * Dk + gs.q0 * Dv,
                                 gs.nq * Dv};
        const int64_t in[8] = {conv[0], conv[1], conv[2], conv[3], conv[4], conv[5], C + gs.q0 * Dv, gs.nq * Dv};
        ok &= slice_matches(&F->ssm_in, &S->ssm_in, 1, in, 4);
        ok &= slice_matches(&F->ssm_conv1d, &S->ssm_conv1d, 0, conv, 3);
        ok &= slice_matches(&F->ssm_ba, &S->ssm_ba, 1, (int64_t[]){gs.q0, gs.nq, Hv + gs.q0, gs.nq}, 2);
        ok &= slice_matches(&F->ssm_a, &S->ssm_a, 0, (int64_t[]){gs.q0, gs.nq}, 1);
        ok &= slice_matches(&F->ssm_dt, &S->ssm_dt, 0, (int64_t[]){gs.q0, gs.nq}, 1);
        ok &= slice_matches(&F->ssm_norm, &S->ssm_norm, 0, (int64_t[]){0, Dv}, 1);
        ok &= slice_matches(&F->ssm_out, &S->ssm_out, 0, (int64_t[]){gs.q0 * Dv, gs.nq * Dv}, 1);
      } else {
        const int64_t qkv[6] = {hs.q0 * qs, hs.nq * qs, Hq * qs + hs.kv0 * D, hs.nkv * D, Hq * qs + (Hkv + hs.kv0) * D,
                                hs.nkv * D};
        ok &= slice_matches(&F->attn_qkv, &S->attn_qkv, 1, qkv, 3);
        ok &= slice_matches(&F->attn_output, &S->attn_output, 0, (int64_t[]){hs.q0 * D, hs.nq * D}, 1);
      }
      if (cfg->ffn == UPF_FFN_MOE) {
        const int64_t I = cfg->moe.inter, Ir = I / R, Is = cfg->moe.shared_inter, Isr = Is / R;
        ok &= slice_matches(&F->moe_router, &S->moe_router, 0, (int64_t[]){0, cfg->moe.num_experts}, 1);
        ok &= slice_matches(&F->moe_gate_up, &S->moe_gate_up, 1, (int64_t[]){r * Ir, Ir, I + r * Ir, Ir}, 2);
        ok &= slice_matches(&F->moe_down, &S->moe_down, 2, (int64_t[]){r * Ir, Ir}, 1);
        ok &= slice_matches(&F->moe_shared_gate_up, &S->moe_shared_gate_up, 0, (int64_t[]){r * Isr, Isr, Is + r * Isr, Isr},
                            2);
        ok &= slice_matches(&F->moe_shared_down, &S->moe_shared_down, 1, (int64_t[]){r * Isr, Isr}, 1);
      } else {
        const int64_t I = cfg->inter, Ir = I / R;
        ok &= slice_matches(&F->ffn_gate_up, &S->ffn_gate_up, 1, (int64_t[]){r * Ir, Ir, I + r * Ir, Ir}, 2);
        ok &= slice_matches(&F->ffn_down, &S->ffn_down, 0, (int64_t[]){r * Ir, Ir}, 1);
      }
    }
    ok &= slice_matches(&full.output, &part.output, 0, (int64_t[]){0, cfg->hidden}, 1);
    ok &= slice_matches(&full.token_embd, &part.token_embd, 0, (int64_t[]){0, cfg->vocab}, 1);
    if (!ok)
      printf("\n%s: rank %d of %d holds a slice that is not the whole model's values at its indices\n", name, r, R);
    CU_ASSERT(ok);
    upf_model_free(&part);
    CU_ASSERT_PTR_NULL(part.tp_cfg);
  }
  upf_model_free(&full);
}

static void test_weight_slices(void) {
  static const char *const names[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
  for (int i = 0; i < 3; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(names[i]);
    if (upf_test_quick()) { /* under Valgrind: the family with every kind of slice, 4 ranks, 4 layers */
      if (i == 2)
        check_slices(names[i], 4, 4);
      continue;
    }
    check_slices(names[i], 2, cfg->num_layers);
    check_slices(names[i], 4, cfg->num_layers);
  }
  /* a split that does not divide is refused with the reason */
  upf_comm three = fake_comm(0, 3);
  upf_model m;
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  CU_ASSERT_EQUAL(upf_model_init_seeded_tp(&m, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, 0, 1, &three), UPF_ERR_SHAPE);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "3 ranks"));
  upf_model_config sliced;
  CU_ASSERT_EQUAL(upf_model_config_tp_slice(cfg, 1, 2, &sliced), UPF_OK);
  CU_ASSERT(sliced.q_heads == 2 && sliced.kv_heads == 1 && sliced.inter == cfg->inter / 2 &&
            sliced.hidden == cfg->hidden && sliced.num_drop_layers == cfg->num_drop_layers);
}

/* ---- NCCL, one rank, on a GPU ---- */

static void nccl_id_path(char *buf, size_t cap) {
  snprintf(buf, cap, "%s/upf-test-nccl-%d.id", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
}

static void test_nccl_one_rank(void) {
  const upf_backend *be = upf_backend_cuda();
  const char *why;
  if (!upf_comm_available(UPF_COMM_NCCL, &why)) { /* perf/device.sh finds libnccl for its runs */
    printf("\nSKIPPED tp/nccl one rank: %s\n", why);
    return;
  }
  char path[512];
  nccl_id_path(path, sizeof path);
  const upf_comm_options opt = {30.0, path, 0, 1};
  upf_comm *c = NULL;
  upf_status st = upf_comm_create("nccl", be, &opt, &c);
  if (st != UPF_OK)
    printf("\n  nccl: %s\n", upf_last_error());
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  CU_ASSERT(access(path, R_OK) == 0); /* rank 0 wrote the id file */
  unlink(path);
  CU_ASSERT(upf_comm_rank(c) == 0 && upf_comm_size(c) == 1 && upf_comm_kind_of(c) == UPF_COMM_NCCL);
  enum { N = 4097 };
  float host[N], back[N];
  uint16_t h16[8], b16[8];
  for (int i = 0; i < N; i++)
    host[i] = 0.25f * (float)(i % 97) - 3.0f;
  for (int i = 0; i < 8; i++)
    h16[i] = upf_bf16_from_f32((float)i - 2.5f);
  void *d = NULL, *d16 = NULL;
  CU_ASSERT_EQUAL_FATAL(be->alloc(&d, sizeof host), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(be->alloc(&d16, sizeof h16), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(d, host, sizeof host), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(d16, h16, sizeof h16), UPF_OK);
  CU_ASSERT_EQUAL(upf_comm_allreduce_sum(c, d, N, UPF_DTYPE_F32), UPF_OK);
  CU_ASSERT_EQUAL(upf_comm_allreduce_sum(c, d16, 8, UPF_DTYPE_BF16), UPF_OK);
  CU_ASSERT_EQUAL(upf_comm_broadcast(c, d, 16, 0), UPF_OK);
  CU_ASSERT_EQUAL(upf_comm_barrier(c), UPF_OK);
  int32_t differing = -1; /* one rank: its own bytes back, none differs */
  CU_ASSERT_EQUAL(upf_comm_broadcast_check(c, d, 33, 0, &differing), UPF_OK);
  CU_ASSERT_EQUAL(differing, 0);
  CU_ASSERT_EQUAL(be->download(back, d, sizeof back), UPF_OK);
  CU_ASSERT_EQUAL(be->download(b16, d16, sizeof b16), UPF_OK);
  CU_ASSERT(!memcmp(host, back, sizeof host)); /* one rank: the sum is the identity */
  CU_ASSERT(!memcmp(h16, b16, sizeof h16));
  be->release(d), be->release(d16);

  /* the TP path (fused block scores, all-reduce, mask check) with one NCCL rank against the plain path */
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  const int32_t lens[] = {200, 24, 1, 96}, B = 4;
  int32_t cu[5] = {0};
  for (int r = 0; r < B; r++)
    cu[r + 1] = cu[r] + lens[r];
  int32_t *ids = malloc((size_t)cu[B] * sizeof *ids);
  upf_model_seeded_ids(3, cfg->vocab, cu[B], ids);
  upf_prefill_options o = {.mode = UPF_PREFILL_UNIPREFILL, .select = cfg->select};
  o.select.p = 0.6f;
  upf_model plain, tp;
  upf_prefill_result rp, rt;
  memset(&rp, 0, sizeof rp), memset(&rt, 0, sizeof rt);
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded(&plain, cfg, be, UPF_DTYPE_F32, 4, 0, cfg->num_layers), UPF_OK);
  CU_ASSERT_EQUAL_FATAL(upf_model_init_seeded_tp(&tp, cfg, be, UPF_DTYPE_F32, 4, 0, cfg->num_layers, c), UPF_OK);
  CU_ASSERT_PTR_NOT_NULL(tp.comm);
  CU_ASSERT_EQUAL(upf_model_prefill(&plain, ids, cu, B, &o, &rp), UPF_OK);
  CU_ASSERT_EQUAL(upf_model_prefill(&tp, ids, cu, B, &o, &rt), UPF_OK);
  CU_ASSERT(rt.num_drops == rp.num_drops && rt.num_drops == 2 && rt.comm_calls > 0);
  int same = rt.num_drops == rp.num_drops;
  for (int k = 0; same && k < rt.num_drops; k++)
    same = rt.drops[k].tokens_in == rp.drops[k].tokens_in &&
           !memcmp(rt.drops[k].mask, rp.drops[k].mask, (size_t)rt.drops[k].tokens_in);
  CU_ASSERT(same);
  double worst = 0;
  for (int64_t i = 0; same && i < (int64_t)B * cfg->vocab; i++) {
    const double e = fabs((double)rt.logits[i] - rp.logits[i]) / (1e-5 + 1e-5 * fabs((double)rp.logits[i]));
    worst = e > worst ? e : worst;
  }
  CU_ASSERT(worst <= 1.0);
  upf_prefill_result_free(&rp), upf_prefill_result_free(&rt);
  upf_model_free(&plain), upf_model_free(&tp);
  free(ids);
  upf_comm_destroy(c);
}

static CU_TestInfo tp_tests[] = {
    {"head split (kv heads replicated when Hkv < R)", test_head_split},
    {"single-rank communicator, argument errors", test_single_comm},
    {"weight slices equal the whole model at their indices", test_weight_slices},
    {"select.block_scores equals select_run's block scores (cpu), per rank too", test_block_scores_cpu},
    CU_TEST_INFO_NULL,
};

void upf_register_tp_tests(void) {
  CU_pSuite suite = upf_test_suite("tp", NULL, NULL, tp_tests);
  upf_test_add_gpu(suite, "select.block_scores equals select_run's block scores (cuda), per rank too",
                   test_block_scores_cuda);
  upf_test_add_gpu(suite, "nccl one rank: identity, TP path equals plain path", test_nccl_one_rank);
}
