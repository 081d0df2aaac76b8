/* CompactAttention's two execution paths over the block tables of compact.block_tables
 * (uniprefill/compact_attn.h): zero-copy, one attn.paged call per KV head on views of q, out and the
 * shared cache; and the comparison that gathers each head's kept K/V (compact.rows) before attn.prefill. */
#include "uniprefill/compact_attn.h"

#include <stdlib.h>

#include "uniprefill/backend.h"

/* The view of `count` heads from `h0` of t (dim `hdim` holds the heads); same strides, data moved. */
static upf_tensor head_view(const upf_tensor *t, int hdim, int64_t h0, int64_t count) {
  upf_tensor v = *t;
  v.data = (char *)t->data + h0 * t->stride[hdim] * (int64_t)upf_dtype_size(t->dtype);
  v.shape[hdim] = count;
  return v;
}

/* Shared checks of both paths; sets hkv and g. The ops called check the rest (per head). */
static upf_status paths_check(const char *path, const upf_backend *be, const upf_attn_paged *batch,
                              const upf_compact_tables *t, const upf_tensor *q, const upf_tensor *k_cache,
                              const upf_tensor *v_cache, const upf_tensor *out, int64_t *hkv, int64_t *g) {
  if (!be || !batch || !t || !q || !k_cache || !v_cache || !out)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL backend, batch, tables, q, k_cache, v_cache or out", path);
  if (!t->block_table || !t->kv_lens || !t->block_table_host || !t->kv_lens_host)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: tables need block_table, kv_lens and their host copies", path);
  if (q->ndim != 3 || out->ndim != 3 || k_cache->ndim != 4 || v_cache->ndim != 4)
    return upf_fail(UPF_ERR_SHAPE, "%s: q, out must be (Tq, Hq, D) and k_cache, v_cache (pages, P, Hkv, D)", path);
  *hkv = k_cache->shape[2];
  if (*hkv < 1 || q->shape[1] % *hkv != 0 || out->shape[1] != q->shape[1] || v_cache->shape[2] != *hkv)
    return upf_fail(UPF_ERR_SHAPE, "%s: Hq=%lld (q), %lld (out) must be one multiple of Hkv=%lld (k_cache), %lld "
                    "(v_cache)", path, (long long)q->shape[1], (long long)out->shape[1], (long long)*hkv,
                    (long long)v_cache->shape[2]);
  *g = q->shape[1] / *hkv;
  return UPF_OK;
}

upf_status upf_compact_attn_zero_copy(const upf_backend *be, const upf_attn_paged *batch,
                                      const upf_compact_tables *t, const upf_tensor *q, const upf_tensor *k_cache,
                                      const upf_tensor *v_cache, const upf_attn_params *p, const upf_tensor *out) {
  const char *path = "compact attention (zero-copy)";
  int64_t hkv, g;
  UPF_TRY(paths_check(path, be, batch, t, q, k_cache, v_cache, out, &hkv, &g));
  const int64_t B = batch->num_reqs;
  for (int64_t h = 0; h < hkv; h++) {
    const upf_attn_paged ph = {batch->num_reqs, batch->cu_seqlens_q, batch->cu_seqlens_q_host,
                               t->kv_lens + h * B, t->kv_lens_host + h * B,
                               t->block_table + h * B * t->max_blocks, t->block_table_host + h * B * t->max_blocks,
                               t->max_blocks, batch->page_size};
    const upf_tensor qh = head_view(q, 1, h * g, g), oh = head_view(out, 1, h * g, g);
    const upf_tensor kh = head_view(k_cache, 2, h, 1), vh = head_view(v_cache, 2, h, 1);
    const upf_status st = be->attn_paged(&ph, &qh, &kh, &vh, p, &oh, NULL);
    if (st != UPF_OK)
      return upf_fail_context(st, "compact attention (zero-copy): ");
  }
  return UPF_OK;
}

upf_status upf_compact_attn_copy(const upf_backend *be, const upf_attn_paged *batch, const upf_compact_tables *t,
                                 const upf_tensor *q, const upf_tensor *k_cache, const upf_tensor *v_cache,
                                 const upf_attn_params *p, const upf_tensor *out) {
  const char *path = "compact attention (copy)";
  int64_t hkv, g;
  UPF_TRY(paths_check(path, be, batch, t, q, k_cache, v_cache, out, &hkv, &g));
  if (!upf_tensor_is_contiguous(k_cache) || !upf_tensor_is_contiguous(v_cache))
    return upf_fail(UPF_ERR_SHAPE, "%s: k_cache and v_cache must be contiguous (gathered as rows of D)", path);
  if (k_cache->dtype != v_cache->dtype)
    return upf_fail(UPF_ERR_DTYPE, "%s: k_cache and v_cache differ in dtype", path);
  const int64_t B = batch->num_reqs, P = batch->page_size, d = k_cache->shape[3];
  const int64_t rows = k_cache->shape[0] * k_cache->shape[1] * hkv; /* the cache as (pages P Hkv, D) rows */
  const size_t row_bytes = (size_t)d * upf_dtype_size(k_cache->dtype);
  if (rows > INT32_MAX)
    return upf_fail(UPF_ERR_SHAPE, "%s: the cache has %lld rows of D, past the int32 gather index", path,
                    (long long)rows);
  int64_t maxn = 1;
  for (int64_t h = 0; h < hkv; h++) {
    int64_t n = 0;
    for (int64_t r = 0; r < B; r++)
      n += t->kv_lens_host[h * B + r];
    maxn = n > maxn ? n : maxn;
  }
  int32_t *idx = malloc((size_t)maxn * sizeof *idx), *cu = malloc((size_t)(B + 1) * sizeof *cu);
  void *idx_d = NULL, *cu_d = NULL, *kbuf = NULL, *vbuf = NULL;
  upf_status st = idx && cu ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s: index of %lld keys", path, (long long)maxn);
  if (st == UPF_OK)
    st = be->alloc(&idx_d, (size_t)maxn * sizeof *idx);
  if (st == UPF_OK)
    st = be->alloc(&cu_d, (size_t)(B + 1) * sizeof *cu);
  if (st == UPF_OK)
    st = be->alloc(&kbuf, (size_t)maxn * row_bytes);
  if (st == UPF_OK)
    st = be->alloc(&vbuf, (size_t)maxn * row_bytes);
  for (int64_t h = 0; h < hkv && st == UPF_OK; h++) {
    int64_t n = 0;
    cu[0] = 0;
    for (int64_t r = 0; r < B; r++) {
      const int64_t kv = t->kv_lens_host[h * B + r];
      const int32_t *bt = t->block_table_host + (h * B + r) * t->max_blocks;
      for (int64_t j = 0; j < kv; j++) {
        const int64_t page = bt[j / P];
        if (page < 0 || page >= k_cache->shape[0]) {
          st = upf_fail(UPF_ERR_INVALID_ARG, "%s: block_table[%lld][%lld]=%lld outside [0, %lld) pages", path,
                        (long long)(h * B + r), (long long)(j / P), (long long)page, (long long)k_cache->shape[0]);
          break;
        }
        idx[n++] = (int32_t)((page * P + j % P) * hkv + h);
      }
      if (st != UPF_OK)
        break;
      cu[r + 1] = (int32_t)n;
    }
    if (st == UPF_OK)
      st = be->upload(idx_d, idx, (size_t)n * sizeof *idx);
    if (st == UPF_OK)
      st = be->upload(cu_d, cu, (size_t)(B + 1) * sizeof *cu);
    if (st == UPF_OK)
      st = be->compact_rows(k_cache->data, rows, (int64_t)row_bytes, idx_d, n, kbuf);
    if (st == UPF_OK)
      st = be->compact_rows(v_cache->data, rows, (int64_t)row_bytes, idx_d, n, vbuf);
    if (st != UPF_OK)
      break;
    upf_tensor kt, vt;
    const int64_t shape[3] = {n, 1, d};
    st = upf_tensor_init(&kt, kbuf, k_cache->dtype, 3, shape);
    if (st == UPF_OK)
      st = upf_tensor_init(&vt, vbuf, v_cache->dtype, 3, shape);
    const upf_attn_varlen vb = {batch->num_reqs, batch->cu_seqlens_q, batch->cu_seqlens_q_host, cu_d, cu};
    const upf_tensor qh = head_view(q, 1, h * g, g), oh = head_view(out, 1, h * g, g);
    if (st == UPF_OK)
      st = be->attn_prefill(&vb, &qh, &kt, &vt, p, &oh, NULL);
  }
  /* attn.prefill may still read the buffers on a device: wait before they go */
  if (be->synchronize) {
    const upf_status sync = be->synchronize();
    st = st == UPF_OK ? sync : st;
  }
  if (st != UPF_OK && st != UPF_ERR_NOMEM)
    st = upf_fail_context(st, "compact attention (copy): ");
  if (idx_d)
    be->release(idx_d);
  if (cu_d)
    be->release(cu_d);
  if (kbuf)
    be->release(kbuf);
  if (vbuf)
    be->release(vbuf);
  free(idx), free(cu);
  return st;
}

upf_status upf_compact_attend(const upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                              const upf_tensor *k_cache, const upf_tensor *v_cache, const upf_sparse_params *sp,
                              const upf_compact_params *cp, const upf_attn_params *p, int copy_path,
                              const upf_tensor *out, uint8_t *table_host, int64_t *kept_blocks) {
  const char *path = "compact attention";
  if (!be || !chunks || !q || !k_cache || !v_cache || !out || q->ndim != 3 || k_cache->ndim != 4)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL or misshapen backend, chunks, q (Tq, Hq, D), k_cache (pages, P, "
                    "Hkv, D), v_cache or out", path);
  const upf_sparse_batch sb = {NULL, chunks};
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&sb, (int32_t)q->shape[1], (int32_t)k_cache->shape[2], sp, &plan));
  const int64_t B = plan.num_reqs, hkv = plan.hkv, nb = plan.max_key_blocks, S = plan.num_segments;
  const int64_t d = k_cache->shape[3], mb = chunks->max_blocks;
  void *kbar = NULL, *row_ptr = NULL, *blocks = NULL, *table = NULL, *counts = NULL, *tbt = NULL, *tkv = NULL;
  int32_t *tbt_host = malloc((size_t)(hkv * B * mb + 1) * sizeof *tbt_host);
  int32_t *tkv_host = malloc((size_t)(hkv * B) * sizeof *tkv_host);
  int32_t *counts_host = malloc((size_t)(hkv * B) * sizeof *counts_host);
  upf_status st = tbt_host && tkv_host && counts_host ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s: host tables", path);
  if (st == UPF_OK)
    st = be->alloc(&kbar, (size_t)(B * nb * hkv * d) * upf_dtype_size(k_cache->dtype));
  if (st == UPF_OK)
    st = be->alloc(&row_ptr, (size_t)(S + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc(&blocks, (size_t)(S * nb) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc(&table, (size_t)(B * hkv * nb));
  if (st == UPF_OK)
    st = be->alloc(&counts, (size_t)(B * hkv) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc(&tbt, (size_t)(hkv * B * mb + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = be->alloc(&tkv, (size_t)(hkv * B) * sizeof(int32_t));
  upf_tensor tk, tt;
  const int64_t ks[4] = {B, nb, hkv, d}, ts[3] = {B, hkv, nb};
  if (st == UPF_OK)
    st = upf_tensor_init(&tk, kbar, k_cache->dtype, 4, ks);
  if (st == UPF_OK)
    st = upf_tensor_init(&tt, table, UPF_DTYPE_U8, 3, ts);
  upf_sparse_index idx = {row_ptr, blocks, NULL, 0};
  if (st == UPF_OK)
    st = be->sparse_block_means(&sb, k_cache, NULL, sp, &tk, NULL);
  if (st == UPF_OK)
    st = be->sparse_index(&sb, q, &tk, sp, &idx);
  if (st == UPF_OK)
    st = be->compact_block_union(&sb, (int32_t)q->shape[1], sp, &idx, cp, &tt, counts);
  upf_compact_tables t = {tbt, tkv, NULL, NULL, (int32_t)mb};
  if (st == UPF_OK)
    st = be->compact_block_tables(chunks, &tt, sp->block_n, &t);
  if (st == UPF_OK)
    st = be->synchronize();
  if (st == UPF_OK)
    st = be->download(tbt_host, tbt, (size_t)(hkv * B * mb) * sizeof *tbt_host);
  if (st == UPF_OK)
    st = be->download(tkv_host, tkv, (size_t)(hkv * B) * sizeof *tkv_host);
  if (st == UPF_OK && kept_blocks) {
    st = be->download(counts_host, counts, (size_t)(hkv * B) * sizeof *counts_host);
    *kept_blocks = 0;
    for (int64_t i = 0; st == UPF_OK && i < hkv * B; i++)
      *kept_blocks += counts_host[i];
  }
  if (st == UPF_OK && table_host)
    st = be->download(table_host, table, (size_t)(B * hkv * nb));
  t.block_table_host = tbt_host, t.kv_lens_host = tkv_host;
  if (st == UPF_OK)
    st = copy_path ? upf_compact_attn_copy(be, chunks, &t, q, k_cache, v_cache, p, out)
                   : upf_compact_attn_zero_copy(be, chunks, &t, q, k_cache, v_cache, p, out);
  /* the attention may still read the tables on a device */
  if (be->synchronize) {
    const upf_status sync = be->synchronize();
    st = st == UPF_OK ? sync : st;
  }
  void *bufs[7] = {kbar, row_ptr, blocks, table, counts, tbt, tkv};
  for (int i = 0; i < 7; i++)
    if (bufs[i])
      be->release(bufs[i]);
  free(tbt_host), free(tkv_host), free(counts_host);
  upf_sparse_plan_free(&plan);
  return st;
}
