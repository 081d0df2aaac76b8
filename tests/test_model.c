/* End-to-end prefill on the tiny configs: UniPrefill at p = 1 equals dense bit for bit, replayed
 * masks reproduce a selecting run, batch invariance, kept counts and the top-k keep ratio, the
 * positions a drop leaves, bad input, and (GPU) the model check of CUDA against the CPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers/layers.h"
#include "tests/test_util.h"
#include "uniprefill/moe.h"
#include "verify/verify_model.h"

static const char *const tiny[] = {"llama-tiny", "gemma3-tiny", "qwen3-next-tiny"};
/* Under Valgrind (quick) a test runs one family, a different one per test, so the memory check sees
 * every family's code in a few prefills; the native run takes all three in every test. */
#define FAMILIES_OF(test_index) (upf_test_quick() ? (test_index) % NUM_TINY : 0), \
                                (upf_test_quick() ? (test_index) % NUM_TINY + 1 : NUM_TINY)
#define NUM_TINY 3
/* A long request, one shorter than sink + L, a one-token row and a medium one (smaller under Valgrind). */
static const int32_t full_lengths[] = {200, 24, 1, 120}, quick_lengths[] = {72, 24, 1, 48};
static const int32_t *lengths = full_lengths;

static upf_prefill_options options(const upf_model_config *cfg, upf_prefill_mode mode) {
  upf_prefill_options o = {.mode = mode, .select = cfg->select};
  return o;
}

static int run(const upf_model_config *cfg, upf_dtype dt, const int32_t *lens, int32_t b, const upf_prefill_options *o,
               upf_prefill_result *res) {
  upf_status st = upf_model_run_seeded(cfg, upf_backend_cpu(), dt, 7, lens, b, o, res);
  if (st != UPF_OK)
    printf("\n%s: %s\n", cfg->name, upf_last_error());
  CU_ASSERT_EQUAL(st, UPF_OK);
  return st == UPF_OK;
}

static int finite_logits(const upf_prefill_result *r) {
  for (int64_t i = 0; i < (int64_t)r->num_reqs * r->vocab; i++)
    if (!isfinite(r->logits[i]))
      return 0;
  return 1;
}

/* p = 1 keeps every token: the same logits, bit for bit, as dense; every drop layer ran. */
static void test_p1_equals_dense(void) {
  const int fam[2] = {FAMILIES_OF(0)};
  for (int i = fam[0]; i < fam[1]; i++)
    for (int d = 0; d < 2; d++) {
      const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
      const upf_dtype dt = d ? UPF_DTYPE_BF16 : UPF_DTYPE_F32;
      upf_prefill_options dense = options(cfg, UPF_PREFILL_DENSE), uni = options(cfg, UPF_PREFILL_UNIPREFILL);
      uni.select.p = 1.0f;
      upf_prefill_result a, b;
      if (!run(cfg, dt, lengths, 4, &dense, &a))
        continue;
      if (run(cfg, dt, lengths, 4, &uni, &b)) {
        CU_ASSERT(finite_logits(&a));
        CU_ASSERT_EQUAL(b.num_drops, cfg->num_drop_layers);
        for (int k = 0; k < b.num_drops; k++)
          CU_ASSERT_EQUAL(b.drops[k].tokens_kept, b.drops[k].tokens_in);
        CU_ASSERT_EQUAL(memcmp(a.logits, b.logits, sizeof(float) * 4 * cfg->vocab), 0);
        upf_prefill_result_free(&b);
      }
      upf_prefill_result_free(&a);
    }
}

/* Top-p at p = 0.5 (random weights attend almost uniformly) drops tokens at every drop layer; kept counts equal the masks' sums and per-request
 * counts; chained drops see the survivors; decode and short rows keep every token; each request's
 * last token is kept; replaying the masks gives the same logits bit for bit. */
static void test_drops_and_replay(void) {
  const int fam[2] = {FAMILIES_OF(1)};
  for (int i = fam[0]; i < fam[1]; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
    upf_prefill_options uni = options(cfg, UPF_PREFILL_UNIPREFILL);
    uni.select.p = 0.5f;
    upf_prefill_result a, b;
    if (!run(cfg, UPF_DTYPE_F32, lengths, 4, &uni, &a))
      continue;
    CU_ASSERT_EQUAL(a.num_drops, cfg->num_drop_layers);
    int64_t in = 0;
    for (int r = 0; r < 4; r++)
      in += lengths[r];
    const uint8_t *masks[UPF_MODEL_MAX_LAYERS];
    int64_t lens[UPF_MODEL_MAX_LAYERS];
    int32_t n_req[4] = {lengths[0], lengths[1], lengths[2], lengths[3]};
    for (int k = 0; k < a.num_drops; k++) {
      const upf_drop_record *d = &a.drops[k];
      CU_ASSERT_EQUAL(d->tokens_in, in);
      int64_t sum = 0, per = 0, start = 0;
      for (int64_t t = 0; t < d->tokens_in; t++)
        sum += d->mask[t];
      for (int r = 0; r < 4; r++) {
        per += d->kept_per_req[r];
        CU_ASSERT(d->mask[start + n_req[r] - 1] == 1); /* last token */
        if (n_req[r] <= cfg->select.sink + cfg->select.last_q)
          CU_ASSERT_EQUAL(d->kept_per_req[r], n_req[r]); /* not scored */
        start += n_req[r];
        n_req[r] = d->kept_per_req[r];
      }
      CU_ASSERT_EQUAL(sum, d->tokens_kept);
      CU_ASSERT_EQUAL(per, d->tokens_kept);
      masks[k] = d->mask, lens[k] = d->tokens_in;
      in = d->tokens_kept;
    }
    CU_ASSERT(a.drops[0].tokens_kept < a.drops[0].tokens_in); /* p < 1 on random weights drops blocks */
    uni.replay_masks = masks, uni.replay_mask_len = lens;
    if (run(cfg, UPF_DTYPE_F32, lengths, 4, &uni, &b)) {
      CU_ASSERT_EQUAL(memcmp(a.logits, b.logits, sizeof(float) * 4 * cfg->vocab), 0);
      upf_prefill_result_free(&b);
    }
    upf_prefill_result_free(&a);
  }
}

/* A request's logits in a mixed batch equal its logits run alone (long, short, shorter than sink + L,
 * one token), in both modes, f32. On the CPU the selection runs in both (it is exact per request); on
 * CUDA the alone runs replay the request's slice of the batch's masks, so a marginal decision cannot
 * turn a rounding difference of the batched GEMMs into a different drop. */
static void batch_invariance_on(const upf_backend *be, double rel_tol) {
  const int32_t cu[5] = {0, lengths[0], lengths[0] + lengths[1], lengths[0] + lengths[1] + lengths[2],
                         lengths[0] + lengths[1] + lengths[2] + lengths[3]};
  int32_t ids[400];
  const int replay = be != upf_backend_cpu();
  /* under Valgrind (quick) UniPrefill only: its runs take every code path of the dense ones */
  const int fam[2] = {FAMILIES_OF(2)};
  for (int i = fam[0]; i < fam[1]; i++)
    for (int mode = upf_test_quick(); mode < 2; mode++) {
      const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
      const upf_prefill_options o = options(cfg, mode ? UPF_PREFILL_UNIPREFILL : UPF_PREFILL_DENSE);
      upf_model_seeded_ids(3, cfg->vocab, cu[4], ids);
      upf_prefill_result all, one;
      if (upf_model_run_ids(cfg, be, UPF_DTYPE_F32, 7, ids, cu, 4, &o, &all) != UPF_OK) {
        CU_FAIL(upf_last_error());
        continue;
      }
      for (int r = 0; r < 4; r++) {
        const int32_t cu1[2] = {0, cu[r + 1] - cu[r]};
        upf_prefill_options alone = o;
        const uint8_t *masks[UPF_MODEL_MAX_LAYERS];
        int64_t mask_len[UPF_MODEL_MAX_LAYERS];
        if (replay && mode) { /* request r's tokens at drop k start after the others' counts there */
          int32_t counts[4] = {lengths[0], lengths[1], lengths[2], lengths[3]};
          for (int k = 0; k < all.num_drops; k++) {
            int64_t start = 0;
            for (int q = 0; q < r; q++)
              start += counts[q];
            masks[k] = all.drops[k].mask + start, mask_len[k] = counts[r];
            for (int q = 0; q < 4; q++)
              counts[q] = all.drops[k].kept_per_req[q];
          }
          alone.replay_masks = masks, alone.replay_mask_len = mask_len;
        }
        if (upf_model_run_ids(cfg, be, UPF_DTYPE_F32, 7, ids + cu[r], cu1, 1, &alone, &one) != UPF_OK) {
          CU_FAIL(upf_last_error());
          continue;
        }
        double err = 0, mag = 0;
        for (int v = 0; v < cfg->vocab; v++) {
          const double x = all.logits[(int64_t)r * cfg->vocab + v], y = one.logits[v];
          err = fmax(err, fabs(x - y)), mag = fmax(mag, fabs(y));
        }
        if (!(err <= rel_tol * (1 + mag)))
          printf("\n%s on %s, mode %d, request %d: max |batch - alone| = %g (max |logit| %g)\n", cfg->name, be->name,
                 mode, r, err, mag);
        CU_ASSERT(err <= rel_tol * (1 + mag));
        upf_prefill_result_free(&one);
      }
      upf_prefill_result_free(&all);
    }
}
static void test_batch_invariance(void) { batch_invariance_on(upf_backend_cpu(), 1e-5); }
/* cuBLAS may pick another GEMM algorithm for another row count: f32 rounding differences only */
static void test_batch_invariance_cuda(void) { batch_invariance_on(upf_backend_cuda(), 1e-4); }

/* Top-k keep ratio R: in each scored request, ceil(R * blocks) blocks are kept, plus the sink and the
 * last L tokens; the blocks seen kept outside those are whole, and number between K minus the blocks
 * that lie wholly inside sink and last L, and K. */
static void test_keep_ratio(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  const float ratios[] = {0.5f, 0.3f, 0.2f};
  for (int ri = 0; ri < (upf_test_quick() ? 1 : 3); ri++) {
    upf_prefill_options o = options(cfg, UPF_PREFILL_UNIPREFILL);
    o.select.keep_ratio = ratios[ri];
    upf_prefill_result res;
    if (!run(cfg, UPF_DTYPE_F32, lengths, 4, &o, &res))
      continue;
    int32_t n_req[4] = {lengths[0], lengths[1], lengths[2], lengths[3]};
    const int32_t G = o.select.block, sink = o.select.sink, L = o.select.last_q;
    for (int k = 0; k < res.num_drops; k++) {
      const upf_drop_record *d = &res.drops[k];
      int64_t start = 0;
      for (int r = 0; r < 4; r++) {
        const int64_t n = n_req[r];
        if (upf_select_is_scored(n, &o.select)) {
          const int64_t nb = (n + G - 1) / G, K = (int64_t)ceil((double)ratios[ri] * (double)nb);
          int64_t seen = 0, hidden_blocks = 0, union_count = 0;
          for (int64_t c = 0; c < nb; c++) {
            int outside = 0, any_outside_kept = 0, all_kept = 1;
            for (int64_t j = c * G; j < (c + 1) * G && j < n; j++) {
              const int special = j < sink || j >= n - L;
              outside |= !special;
              any_outside_kept |= !special && d->mask[start + j];
              all_kept &= d->mask[start + j];
            }
            hidden_blocks += !outside;
            if (any_outside_kept) {
              seen++;
              CU_ASSERT(all_kept);
            }
          }
          for (int64_t j = 0; j < n; j++)
            union_count += d->mask[start + j];
          CU_ASSERT(seen <= K && seen >= K - hidden_blocks);
          CU_ASSERT_EQUAL(union_count, d->kept_per_req[r]);
        } else {
          CU_ASSERT_EQUAL(d->kept_per_req[r], n);
        }
        start += n;
        n_req[r] = d->kept_per_req[r];
      }
    }
    upf_prefill_result_free(&res);
  }
}

/* The drop step on a replayed mask: positions and origins follow their tokens, cu_seqlens is rebuilt,
 * and a mask that drops a request's last token, or a token of a short request, is refused. */
static void test_drop_step_positions(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_model m = {.cfg = cfg, .be = upf_backend_cpu(), .dtype = UPF_DTYPE_F32};
  enum { T = 60 };
  const int32_t cu[3] = {0, 50, 60}; /* one scored request (50 > sink + L = 32), one short */
  static float residual[T * 128], hidden[T * 128], out[T * 128], spare[T * 128];
  int32_t pos[T], origin[T], spare_i32[T], kept_index[T], cu_dev[3], cu_host[3];
  uint8_t mask[T];
  for (int t = 0; t < T; t++) {
    pos[t] = t < 50 ? t : t - 50, origin[t] = t;
    for (int h = 0; h < 128; h++)
      residual[t * 128 + h] = (float)t, hidden[t * 128 + h] = (float)(-t);
    mask[t] = t < 50 ? (t % 3 != 1 || t == 49) : 1;
  }
  memcpy(cu_dev, cu, sizeof cu), memcpy(cu_host, cu, sizeof cu);
  upf_tokens tok = {T, T, 2, residual, hidden, pos, origin, cu_dev, cu_host};
  upf_layer_scratch s = {.out = out, .spare = spare, .spare_i32 = spare_i32, .kept_index = kept_index};
  upf_drop_record rec = {0};
  CU_ASSERT_EQUAL_FATAL(upf_layer_drop(&m, &cfg->select, NULL, mask, T, &tok, &s, &rec), UPF_OK);
  int64_t kept = 0;
  for (int t = 0; t < T; t++)
    if (mask[t]) {
      CU_ASSERT_EQUAL(tok.positions[kept], t < 50 ? t : t - 50);
      CU_ASSERT_EQUAL(tok.origin[kept], t);
      CU_ASSERT_EQUAL(((float *)tok.residual)[kept * 128 + 5], (float)t);
      CU_ASSERT_EQUAL(((float *)tok.hidden)[kept * 128 + 127], (float)(-t));
      kept++;
    }
  CU_ASSERT_EQUAL(tok.num_tokens, kept);
  CU_ASSERT_EQUAL(rec.tokens_kept, kept);
  CU_ASSERT_EQUAL(tok.cu_seqlens_host[1], kept - 10);
  CU_ASSERT_EQUAL(tok.cu_seqlens_host[2], kept);
  CU_ASSERT_EQUAL(tok.cu_seqlens[2], kept);
  CU_ASSERT_EQUAL(rec.kept_per_req[1], 10);
  free(rec.mask), free(rec.kept_per_req);
  /* refused: the last token of request 0 (now at kept - 11), then a token of the short request */
  uint8_t bad[T];
  memset(bad, 1, sizeof bad);
  bad[tok.cu_seqlens_host[1] - 1] = 0;
  CU_ASSERT_EQUAL(upf_layer_drop(&m, &cfg->select, NULL, bad, tok.num_tokens, &tok, &s, &rec), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "last token"));
  memset(bad, 1, sizeof bad);
  bad[tok.num_tokens - 3] = 0;
  CU_ASSERT_EQUAL(upf_layer_drop(&m, &cfg->select, NULL, bad, tok.num_tokens, &tok, &s, &rec), UPF_ERR_INVALID_ARG);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "not scored"));
  CU_ASSERT_EQUAL(upf_layer_drop(&m, &cfg->select, NULL, bad, tok.num_tokens + 1, &tok, &s, &rec), UPF_ERR_SHAPE);
}

/* The model check of verify (upf verify model) on a backend: the CPU twin in CI, CUDA on a GPU. */
static void model_verify_on(const upf_backend *be) {
  upf_verify_ctx ctx = {.backend = be, .log = NULL, .quick = 1};
  upf_verify_model(&ctx);
  if (ctx.failed) {
    ctx.log = stdout, ctx.passed = ctx.failed = 0;
    printf("\n");
    upf_verify_model(&ctx);
  }
  CU_ASSERT_EQUAL(ctx.failed, 0);
  CU_ASSERT(ctx.passed >= 18); /* 3 configs x 2 dtypes x (dense, replay, select) */
}
static void test_model_verify_twin(void) {
  if (upf_test_quick()) /* seconds natively, too long under Valgrind; the other model tests cover the path */
    return;
  model_verify_on(upf_test_cpu_twin());
}
static void test_model_verify_cuda(void) { model_verify_on(upf_backend_cuda()); }

static void test_bad_input(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  CU_ASSERT_PTR_NULL(upf_model_config_by_name("llama-huge"));
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "llama-tiny"));
  upf_prefill_options o = options(cfg, UPF_PREFILL_DENSE);
  upf_prefill_result res;
  const int32_t zero[] = {5, 0};
  CU_ASSERT_EQUAL(upf_model_run_seeded(cfg, upf_backend_cpu(), UPF_DTYPE_F32, 1, zero, 2, &o, &res),
                  UPF_ERR_CU_SEQLENS);
  CU_ASSERT_PTR_NOT_NULL(strstr(upf_last_error(), "request 1"));
}

/* Copies every tensor of layer `from` into layer `to` of the same model (same mixer kind, same shapes) but
 * the MoE router, which a shared-weights layer keeps its own of. */
static void copy_layer(const upf_model *m, int32_t from, int32_t to) {
  const upf_tensor *src = (const upf_tensor *)&m->layers[from];
  upf_tensor *dst = (upf_tensor *)&m->layers[to];
  for (size_t i = 0; i < sizeof m->layers[0] / sizeof *src; i++) {
    CU_ASSERT_EQUAL(!src[i].data, !dst[i].data);
    if (!src[i].data || !dst[i].data || &src[i] == &m->layers[from].moe_router)
      continue;
    const size_t bytes = (size_t)upf_tensor_numel(&src[i]) * upf_dtype_size(src[i].dtype);
    void *host = malloc(bytes);
    CU_ASSERT_EQUAL(m->be->download(host, src[i].data, bytes), UPF_OK);
    CU_ASSERT_EQUAL(m->be->upload(dst[i].data, host, bytes), UPF_OK);
    free(host);
  }
}

/* --shared-weights: the layers of one mixer kind point at the first such layer's tensors (one copy:
 * fewer bytes) but for their own MoE routers, and the prefill equals, bit for bit, that of a model with distinct tensors holding the
 * same values, dense and UniPrefill, for every family; a range starts its sharing at its own first
 * layer of each kind. */
static void test_shared_weights(void) {
  const int32_t cu[] = {0, 60, 61, 94};
  int32_t ids[94];
  const int fam[2] = {FAMILIES_OF(1)};
  for (int i = fam[0]; i < fam[1]; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
    upf_model shared, distinct;
    upf_model_seeded_ids(3, cfg->vocab, 94, ids);
    const int32_t lb = 1, le = cfg->num_layers;
    if (upf_model_init_seeded_shared(&shared, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, lb, le) != UPF_OK) {
      CU_FAIL(upf_last_error());
      continue;
    }
    CU_ASSERT_EQUAL(upf_model_init_seeded(&distinct, cfg, upf_backend_cpu(), UPF_DTYPE_F32, 7, lb, le), UPF_OK);
    int kinds = 0;
    for (int32_t l = lb; l < le; l++) {
      const int32_t o = shared.weights_of[l];
      CU_ASSERT(o >= lb && o <= l);
      CU_ASSERT_EQUAL(upf_model_mixer(cfg, o), upf_model_mixer(cfg, l));
      CU_ASSERT_PTR_EQUAL(shared.layers[l].attn_norm.data, shared.layers[o].attn_norm.data);
      CU_ASSERT_PTR_EQUAL(shared.layers[l].ffn_down.data, shared.layers[o].ffn_down.data);
      kinds += o == l;
      if (o != l && cfg->ffn == UPF_FFN_MOE) /* its own router, the distinct model's values */
        CU_ASSERT(shared.layers[l].moe_router.data != shared.layers[o].moe_router.data);
      if (o != l)
        copy_layer(&distinct, o, l);
    }
    CU_ASSERT(kinds >= 1 && kinds < le - lb);
    CU_ASSERT(shared.weight_bytes < distinct.weight_bytes);
    for (int mode = 0; mode < 2; mode++) {
      upf_prefill_options o = options(cfg, mode ? UPF_PREFILL_UNIPREFILL : UPF_PREFILL_DENSE);
      o.select.p = 0.6f;
      upf_prefill_result a, b;
      CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&shared, ids, cu, 3, &o, &a), UPF_OK);
      CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&distinct, ids, cu, 3, &o, &b), UPF_OK);
      CU_ASSERT(finite_logits(&a));
      CU_ASSERT_EQUAL(memcmp(a.logits, b.logits, sizeof(float) * 3 * cfg->vocab), 0);
      CU_ASSERT_EQUAL(a.num_drops, b.num_drops);
      upf_prefill_result_free(&a);
      upf_prefill_result_free(&b);
    }
    upf_model_free(&shared);
    upf_model_free(&distinct);
  }
}

/* The distinct weights a shared run stands for: Llama-3.1-8B's published 8,030,261,248 parameters in
 * bf16, and in FP8 its projections at a byte plus a 4-byte scale per output channel (q|k|v 6144, o 4096,
 * gate|up 28672, down 4096 a layer), embedding, head and norms at two bytes. */
static void test_weight_bytes(void) {
  upf_weight_bytes b;
  const upf_model_config *cfg = upf_model_config_by_name("llama3.1-8b");
  CU_ASSERT_EQUAL_FATAL(upf_model_config_weight_bytes(cfg, 0, 32, &b), UPF_OK);
  CU_ASSERT_DOUBLE_EQUAL(b.bf16, 2.0 * 8030261248.0, 0.5);
  const double proj = 4096.0 * 6144 + 4096.0 * 4096 + 4096.0 * 28672 + 14336.0 * 4096;
  const double fp8 = 32 * (proj + 4.0 * (6144 + 4096 + 28672 + 4096)) + 2 * 2 * 128256.0 * 4096 +
                     2 * (32 * 2 * 4096.0 + 4096);
  CU_ASSERT_DOUBLE_EQUAL(b.fp8_e4m3, fp8, 0.5);
  CU_ASSERT_EQUAL_FATAL(upf_model_config_weight_bytes(cfg, 4, 6, &b), UPF_OK); /* two layers, embedding and head */
  CU_ASSERT_DOUBLE_EQUAL(b.bf16, 2.0 * (2 * 218112000.0 + 2 * 525336576.0 + 4096), 0.5);
  CU_ASSERT_EQUAL(upf_model_config_weight_bytes(cfg, 6, 4, &b), UPF_ERR_INVALID_ARG);
}

/* The dense work by ceiling, by hand: Llama-3.1-8B at 8192 tokens (projections 6144 + 4096 + 3 x 14336
 * columns of 4096 rows a layer, the head on one row; causal pairs 8192 x 8193 / 2 a layer; glue per layer:
 * two add-norms of 4 rows, RoPE over q and k, the cache write, activation-and-multiply; the embedding
 * and the last row's norm); a second request adds its own pairs only; Gemma-3-12B's 40 sliding layers
 * see min(i + 1, 1024) keys; Qwen3-Next's MoE is upf_moe_flops a layer and its scan counts on the 36
 * Gated DeltaNet layers only. */
static void test_prefill_work(void) {
  upf_prefill_work w, w2;
  const upf_model_config *llama = upf_model_config_by_name("llama3.1-8b");
  const int32_t one[1] = {8192}, two[2] = {8192, 100};
  upf_model_prefill_work(llama, 0, 32, one, 1, UPF_DTYPE_BF16, &w);
  const double T = 8192, H = 4096;
  CU_ASSERT_DOUBLE_EQUAL(w.gemm_flop, 32 * 2 * T * H * (6144 + 4096 + 3 * 14336.0) + 2 * H * 128256, 1);
  CU_ASSERT_DOUBLE_EQUAL(w.attn_flop, 32 * 4.0 * 128 * 32 * (T * (T + 1) / 2), 1);
  CU_ASSERT_DOUBLE_EQUAL(w.glue_bytes,
                         32 * (8 * T * H * 2 + 2 * T * (4096 + 1024) * 2 + 4 * T * 1024 * 2 + 3 * T * 14336 * 2) +
                             T * H * 2 + 2 * H * 2,
                         1);
  CU_ASSERT_EQUAL(w.moe_flop, 0);
  CU_ASSERT_EQUAL(w.gdn_scan_flop, 0);
  upf_model_prefill_work(llama, 0, 32, two, 2, UPF_DTYPE_BF16, &w2);
  CU_ASSERT_DOUBLE_EQUAL(w2.attn_flop - w.attn_flop, 32 * 4.0 * 128 * 32 * (100 * 101 / 2), 1);

  const upf_model_config *gemma = upf_model_config_by_name("gemma3-12b");
  const int32_t g[1] = {4096};
  upf_model_prefill_work(gemma, 0, 48, g, 1, UPF_DTYPE_BF16, &w);
  const double full = 4096.0 * 4097 / 2, windowed = 1024.0 * 1025 / 2 + (4096.0 - 1024) * 1024;
  CU_ASSERT_DOUBLE_EQUAL(w.attn_flop, 4.0 * 256 * 16 * (8 * full + 40 * windowed), 1);

  const upf_model_config *qwen = upf_model_config_by_name("qwen3-next-80b-a3b");
  upf_model_prefill_work(qwen, 0, 48, g, 1, UPF_DTYPE_BF16, &w);
  CU_ASSERT_DOUBLE_EQUAL(w.moe_flop, 48 * upf_moe_flops(&qwen->moe, 4096), 1);
  upf_model_prefill_work(qwen, 3, 4, g, 1, UPF_DTYPE_BF16, &w2); /* layer 3: full attention */
  CU_ASSERT_EQUAL(w2.gdn_scan_flop, 0);
  CU_ASSERT(w2.attn_flop > 0);
  upf_model_prefill_work(qwen, 0, 1, g, 1, UPF_DTYPE_BF16, &w2); /* layer 0: Gated DeltaNet */
  CU_ASSERT_DOUBLE_EQUAL(w.gdn_scan_flop, 36 * w2.gdn_scan_flop, 1);
  CU_ASSERT_EQUAL(w2.attn_flop, 0);
  /* the limit: 1e12 GEMM+MoE FLOP at 500 TFLOP/s (2 ms), 3e11 attention at 600 (0.5), 6e9 bytes at 3 TB/s (2); the
   * GDN scan left out; no limit without every ceiling */
  const upf_prefill_work lw = {6e11, 4e11, 3e11, 1e15, 6e9};
  CU_ASSERT_DOUBLE_EQUAL(upf_prefill_work_limit(&lw, 500e12, 600e12, 3e12), 4.5e-3, 1e-12);
  CU_ASSERT(isnan(upf_prefill_work_limit(&lw, 500e12, NAN, 3e12)));
  CU_ASSERT(isnan(upf_prefill_work_limit(&lw, 500e12, 600e12, 0)));
  CU_ASSERT(isnan(upf_prefill_work_limit(&lw, INFINITY, 600e12, 3e12)));
}

/* Per-layer times come from backend marks, not host clocks around synchronisations: each layer's
 * mixer and FFN times are positive and fit inside its layer time, the layers fit inside the TTFT, and
 * the same holds with the host waiting after every sub-layer (UPF_PREFILL_SYNC_LAYERS=1), with the same
 * logits. */
static void test_layer_times(void) {
  const upf_model_config *cfg = upf_model_config_by_name(tiny[upf_test_quick() ? 2 : 0]);
  upf_prefill_options o = options(cfg, UPF_PREFILL_UNIPREFILL);
  upf_prefill_result r[2];
  for (int sync = 0; sync < 2; sync++) {
    if (sync)
      setenv("UPF_PREFILL_SYNC_LAYERS", "1", 1);
    const int ok = run(cfg, UPF_DTYPE_F32, lengths, 4, &o, &r[sync]);
    unsetenv("UPF_PREFILL_SYNC_LAYERS");
    if (!ok)
      return;
    double sum = 0;
    for (int32_t l = 0; l < cfg->num_layers; l++) {
      const double mix = r[sync].mixer_seconds[l], ffn = r[sync].ffn_seconds[l], lay = r[sync].layer_seconds[l];
      CU_ASSERT(mix > 0 && ffn > 0);
      CU_ASSERT(mix + ffn <= lay * (1 + 1e-9));
      sum += lay;
    }
    CU_ASSERT(sum <= r[sync].total_seconds * (1 + 1e-9));
  }
  CU_ASSERT_EQUAL(memcmp(r[0].logits, r[1].logits, sizeof(float) * 4 * cfg->vocab), 0);
  upf_prefill_result_free(&r[0]);
  upf_prefill_result_free(&r[1]);
}

/* upf_prefill_result_identical: two runs of one batch agree; a flipped logit bit and a flipped mask
 * entry are each found and named. */
static void test_results_identical(void) {
  const upf_model_config *cfg = upf_model_config_by_name("llama-tiny");
  upf_prefill_options o = options(cfg, UPF_PREFILL_UNIPREFILL);
  o.select.p = 0.6f;
  upf_prefill_result a, b;
  char where[200];
  if (!run(cfg, UPF_DTYPE_F32, lengths, 4, &o, &a))
    return;
  if (run(cfg, UPF_DTYPE_F32, lengths, 4, &o, &b)) {
    CU_ASSERT(b.num_drops > 0 && b.drops[0].tokens_kept < b.drops[0].tokens_in);
    CU_ASSERT(upf_prefill_result_identical(&a, &b, where, sizeof where));
    uint32_t bits;
    memcpy(&bits, &b.logits[cfg->vocab + 17], 4);
    bits ^= 1;
    memcpy(&b.logits[cfg->vocab + 17], &bits, 4);
    CU_ASSERT(!upf_prefill_result_identical(&a, &b, where, sizeof where));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "logits of request 1 at id 17"));
    memcpy(b.logits, a.logits, sizeof(float) * 4 * cfg->vocab);
    b.drops[0].mask[5] ^= 1;
    CU_ASSERT(!upf_prefill_result_identical(&a, &b, where, sizeof where));
    char want[64];
    snprintf(want, sizeof want, "drop 0 (layer %d): mask entry 5", b.drops[0].layer);
    CU_ASSERT_PTR_NOT_NULL(strstr(where, want));
    upf_prefill_result_free(&b);
  }
  upf_prefill_result_free(&a);
}

/* Determinism on the device: 100 UniPrefill prefills of one ragged batch on each family's tiny model
 * give bitwise-identical logits and drop masks (the GPU kernels reduce in a fixed order). */
static void test_determinism_cuda(void) {
  for (int i = 0; i < NUM_TINY; i++) {
    const upf_model_config *cfg = upf_model_config_by_name(tiny[i]);
    upf_model m;
    if (upf_model_init_seeded(&m, cfg, upf_backend_cuda(), UPF_DTYPE_BF16, 7, 0, cfg->num_layers) != UPF_OK) {
      CU_FAIL(upf_last_error());
      continue;
    }
    const int32_t cu[5] = {0, 200, 224, 225, 345};
    int32_t ids[345];
    upf_model_seeded_ids(5, cfg->vocab, 345, ids);
    upf_prefill_options o = options(cfg, UPF_PREFILL_UNIPREFILL);
    o.select.p = 0.6f;
    upf_prefill_result first, r;
    char where[200] = "";
    CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&m, ids, cu, 4, &o, &first), UPF_OK);
    int same = 1;
    for (int k = 1; k < 100 && same; k++) {
      CU_ASSERT_EQUAL_FATAL(upf_model_prefill(&m, ids, cu, 4, &o, &r), UPF_OK);
      same = upf_prefill_result_identical(&first, &r, where, sizeof where);
      if (!same)
        printf("\n%s run %d: %s\n", cfg->name, k + 1, where);
      upf_prefill_result_free(&r);
    }
    CU_ASSERT(same);
    upf_prefill_result_free(&first);
    upf_model_free(&m);
  }
}

static CU_TestInfo model_tests[] = {
    {"uniprefill at p=1 equals dense bit for bit", test_p1_equals_dense},
    {"drops: kept counts, chained drops, replay", test_drops_and_replay},
    {"batch invariance", test_batch_invariance},
    {"top-k keep ratio", test_keep_ratio},
    {"drop step: positions, cu_seqlens, refused masks", test_drop_step_positions},
    {"bad input", test_bad_input},
    {"model verify on the CPU twin", test_model_verify_twin},
    {"shared weights: one copy per mixer kind, the same prefill as distinct copies", test_shared_weights},
    {"distinct weight bytes in bf16 and FP8 (Llama-3.1-8B by hand)", test_weight_bytes},
    {"dense prefill work by ceiling (Llama, Gemma windows, Qwen3-Next MoE and GDN by hand)", test_prefill_work},
    {"per-layer times from backend marks, with and without the host waiting", test_layer_times},
    {"two runs compared bit for bit: a flipped logit or mask entry is named", test_results_identical},
    CU_TEST_INFO_NULL,
};

void upf_register_model_tests(void) {
  if (upf_test_quick())
    lengths = quick_lengths;
  CU_pSuite suite = upf_test_suite("model", NULL, NULL, model_tests);
  upf_test_add_gpu(suite, "model verify on CUDA", test_model_verify_cuda);
  upf_test_add_gpu(suite, "batch invariance on CUDA", test_batch_invariance_cuda);
  upf_test_add_gpu(suite, "determinism on CUDA: 100 runs, bitwise-identical logits and masks", test_determinism_cuda);
}
