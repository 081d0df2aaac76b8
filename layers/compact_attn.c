/* CompactAttention's two execution paths over the block tables of compact.block_tables
 * (uniprefill/compact_attn.h): zero-copy, one attn.paged call per KV head on views of q, out and the
 * shared cache; and the comparison that gathers each head's kept K/V (compact.rows) before attn.prefill.
 * Also the selector chain of one layer's chunks, and the grow-only workspace that keeps it allocation-free. */
#include "uniprefill/compact_attn.h"

#include <stdlib.h>
#include <string.h>

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

/* ---- The workspace ---- */

static upf_status ws_bind(const char *path, const upf_backend *be, upf_compact_workspace *ws) {
  if (!ws)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL workspace", path);
  if (!ws->be)
    ws->be = be;
  if (ws->be != be)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: the workspace holds %s memory, the call runs on %s", path,
                    ws->be->name, be->name);
  return UPF_OK;
}

/* b holds at least `bytes` (1 for 0) of backend memory; its contents are not kept when it grows. */
static upf_status ws_grow(upf_compact_workspace *ws, upf_compact_buf *b, size_t bytes) {
  bytes = bytes ? bytes : 1;
  if (b->bytes >= bytes)
    return UPF_OK;
  if (b->ptr)
    ws->be->release(b->ptr);
  b->ptr = NULL, b->bytes = 0;
  UPF_TRY(ws->be->alloc(&b->ptr, bytes));
  b->bytes = bytes;
  ws->allocations++;
  return UPF_OK;
}

static upf_status ws_grow_host(upf_compact_workspace *ws, upf_compact_buf *b, size_t bytes) {
  bytes = bytes ? bytes : 1;
  if (b->bytes >= bytes)
    return UPF_OK;
  free(b->ptr);
  b->bytes = 0;
  if (!(b->ptr = malloc(bytes)))
    return upf_fail(UPF_ERR_NOMEM, "compact attention: %zu bytes of host scratch", bytes);
  b->bytes = bytes;
  ws->allocations++;
  return UPF_OK;
}

void upf_compact_workspace_free(upf_compact_workspace *ws) {
  if (!ws)
    return;
  if (ws->be) {
    if (ws->be->synchronize)
      (void)ws->be->synchronize(); /* nothing to report to: the buffers go either way */
    upf_compact_buf *dev[] = {&ws->kbar,    &ws->row_ptr,     &ws->blocks,    &ws->table,     &ws->counts,
                              &ws->block_table, &ws->kv_lens, &ws->gather_index, &ws->gather_cu, &ws->k_rows,
                              &ws->v_rows};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
      if (dev[i]->ptr)
        ws->be->release(dev[i]->ptr);
  }
  free(ws->table_host.ptr), free(ws->block_table_host.ptr), free(ws->kv_lens_host.ptr);
  free(ws->gather_index_host.ptr), free(ws->gather_cu_host.ptr);
  memset(ws, 0, sizeof *ws);
}

/* ---- The copy path ---- */

upf_status upf_compact_attn_copy_ws(const upf_backend *be, const upf_attn_paged *batch, const upf_compact_tables *t,
                                    const upf_tensor *q, const upf_tensor *k_cache, const upf_tensor *v_cache,
                                    const upf_attn_params *p, const upf_tensor *out, upf_compact_workspace *ws) {
  const char *path = "compact attention (copy)";
  int64_t hkv, g;
  UPF_TRY(paths_check(path, be, batch, t, q, k_cache, v_cache, out, &hkv, &g));
  UPF_TRY(ws_bind(path, be, ws));
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
  upf_status st = ws_grow_host(ws, &ws->gather_index_host, (size_t)maxn * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow_host(ws, &ws->gather_cu_host, (size_t)(B + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->gather_index, (size_t)maxn * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->gather_cu, (size_t)(B + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->k_rows, (size_t)maxn * row_bytes);
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->v_rows, (size_t)maxn * row_bytes);
  if (st != UPF_OK)
    return st;
  int32_t *idx = ws->gather_index_host.ptr, *cu = ws->gather_cu_host.ptr;
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
    /* the uploads return once the host arrays are read, so the next head may rewrite them */
    if (st == UPF_OK)
      st = be->upload(ws->gather_index.ptr, idx, (size_t)n * sizeof *idx);
    if (st == UPF_OK)
      st = be->upload(ws->gather_cu.ptr, cu, (size_t)(B + 1) * sizeof *cu);
    if (st == UPF_OK)
      st = be->compact_rows(k_cache->data, rows, (int64_t)row_bytes, ws->gather_index.ptr, n, ws->k_rows.ptr);
    if (st == UPF_OK)
      st = be->compact_rows(v_cache->data, rows, (int64_t)row_bytes, ws->gather_index.ptr, n, ws->v_rows.ptr);
    if (st != UPF_OK)
      break;
    upf_tensor kt, vt;
    const int64_t shape[3] = {n, 1, d};
    st = upf_tensor_init(&kt, ws->k_rows.ptr, k_cache->dtype, 3, shape);
    if (st == UPF_OK)
      st = upf_tensor_init(&vt, ws->v_rows.ptr, v_cache->dtype, 3, shape);
    const upf_attn_varlen vb = {batch->num_reqs, batch->cu_seqlens_q, batch->cu_seqlens_q_host, ws->gather_cu.ptr, cu};
    const upf_tensor qh = head_view(q, 1, h * g, g), oh = head_view(out, 1, h * g, g);
    if (st == UPF_OK)
      st = be->attn_prefill(&vb, &qh, &kt, &vt, p, &oh, NULL);
  }
  if (st != UPF_OK && st != UPF_ERR_NOMEM)
    st = upf_fail_context(st, "compact attention (copy): ");
  return st;
}

upf_status upf_compact_attn_copy(const upf_backend *be, const upf_attn_paged *batch, const upf_compact_tables *t,
                                 const upf_tensor *q, const upf_tensor *k_cache, const upf_tensor *v_cache,
                                 const upf_attn_params *p, const upf_tensor *out) {
  upf_compact_workspace ws;
  memset(&ws, 0, sizeof ws);
  const upf_status st = upf_compact_attn_copy_ws(be, batch, t, q, k_cache, v_cache, p, out, &ws);
  upf_compact_workspace_free(&ws);
  return st;
}

/* ---- The selector chain and the whole layer ---- */

upf_status upf_compact_select(const upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                              const upf_tensor *k_cache, const upf_sparse_params *sp, const upf_compact_params *cp,
                              upf_compact_workspace *ws) {
  const char *path = "compact attention";
  if (!be || !chunks || !q || !k_cache || !sp || !cp || q->ndim != 3 || k_cache->ndim != 4)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: NULL or misshapen backend, chunks, q (Tq, Hq, D), k_cache (pages, P, "
                    "Hkv, D) or parameters", path);
  UPF_TRY(ws_bind(path, be, ws));
  const upf_sparse_batch sb = {NULL, chunks};
  upf_sparse_plan plan;
  UPF_TRY(upf_sparse_plan_make(&sb, (int32_t)q->shape[1], (int32_t)k_cache->shape[2], sp, &plan));
  const int64_t B = plan.num_reqs, hkv = plan.hkv, nb = plan.max_key_blocks, S = plan.num_segments;
  const int64_t d = k_cache->shape[3], mb = chunks->max_blocks;
  upf_sparse_plan_free(&plan);
  ws->num_reqs = 0, ws->hkv = 0, ws->key_blocks = 0, ws->kept_blocks = 0;
  memset(&ws->tables, 0, sizeof ws->tables);
  const size_t tab_bytes = (size_t)(B * hkv * nb), bt_bytes = (size_t)(hkv * B * mb) * sizeof(int32_t);
  const size_t kv_bytes = (size_t)(hkv * B) * sizeof(int32_t);
  upf_status st = ws_grow(ws, &ws->kbar, (size_t)(B * nb * hkv * d) * upf_dtype_size(k_cache->dtype));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->row_ptr, (size_t)(S + 1) * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->blocks, (size_t)(S * nb) * sizeof(int32_t));
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->table, tab_bytes);
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->counts, kv_bytes);
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->block_table, bt_bytes);
  if (st == UPF_OK)
    st = ws_grow(ws, &ws->kv_lens, kv_bytes);
  if (st == UPF_OK)
    st = ws_grow_host(ws, &ws->table_host, tab_bytes);
  if (st == UPF_OK)
    st = ws_grow_host(ws, &ws->block_table_host, bt_bytes);
  if (st == UPF_OK)
    st = ws_grow_host(ws, &ws->kv_lens_host, kv_bytes);
  if (st != UPF_OK)
    return st;
  upf_tensor tk, tt, th;
  const int64_t ks[4] = {B, nb, hkv, d}, ts[3] = {B, hkv, nb};
  st = upf_tensor_init(&tk, ws->kbar.ptr, k_cache->dtype, 4, ks);
  if (st == UPF_OK)
    st = upf_tensor_init(&tt, ws->table.ptr, UPF_DTYPE_U8, 3, ts);
  if (st == UPF_OK)
    st = upf_tensor_init(&th, ws->table_host.ptr, UPF_DTYPE_U8, 3, ts);
  upf_sparse_index idx = {ws->row_ptr.ptr, ws->blocks.ptr, NULL, 0};
  if (st == UPF_OK)
    st = be->sparse_block_means(&sb, k_cache, NULL, sp, &tk, NULL);
  if (st == UPF_OK)
    st = be->sparse_index(&sb, q, &tk, sp, &idx);
  if (st == UPF_OK)
    st = be->compact_block_union(&sb, (int32_t)q->shape[1], sp, &idx, cp, &tt, ws->counts.ptr);
  upf_compact_tables t = {ws->block_table.ptr, ws->kv_lens.ptr, NULL, NULL, (int32_t)mb};
  if (st == UPF_OK)
    st = be->compact_block_tables(chunks, &tt, sp->block_n, &t);
  /* The host copies attn.paged checks and plans from: the union table comes down (the smallest of the
   * three arrays), and the CPU reference of compact.block_tables, the same integer logic as the backend's,
   * rebuilds the block tables from it over the chunks' host block table. */
  if (st == UPF_OK)
    st = be->download(ws->table_host.ptr, ws->table.ptr, tab_bytes);
  const upf_attn_paged host = {chunks->num_reqs,       chunks->cu_seqlens_q_host, chunks->cu_seqlens_q_host,
                               chunks->kv_lens_host,   chunks->kv_lens_host,      chunks->block_table_host,
                               chunks->block_table_host, chunks->max_blocks,      chunks->page_size};
  upf_compact_tables th_out = {ws->block_table_host.ptr, ws->kv_lens_host.ptr, NULL, NULL, (int32_t)mb};
  if (st == UPF_OK)
    st = upf_backend_cpu()->compact_block_tables(&host, &th, sp->block_n, &th_out);
  if (st != UPF_OK)
    return st;
  const uint8_t *tab = ws->table_host.ptr;
  for (size_t i = 0; i < tab_bytes; i++)
    ws->kept_blocks += tab[i] != 0;
  t.block_table_host = ws->block_table_host.ptr, t.kv_lens_host = ws->kv_lens_host.ptr;
  ws->tables = t;
  ws->num_reqs = (int32_t)B, ws->hkv = (int32_t)hkv, ws->key_blocks = (int32_t)nb;
  return UPF_OK;
}

upf_status upf_compact_attend_ws(const upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                                 const upf_tensor *k_cache, const upf_tensor *v_cache, const upf_sparse_params *sp,
                                 const upf_compact_params *cp, const upf_attn_params *p, int copy_path,
                                 const upf_tensor *out, upf_compact_workspace *ws) {
  if (!v_cache || !out)
    return upf_fail(UPF_ERR_INVALID_ARG, "compact attention: NULL v_cache or out");
  UPF_TRY(upf_compact_select(be, chunks, q, k_cache, sp, cp, ws));
  return copy_path ? upf_compact_attn_copy_ws(be, chunks, &ws->tables, q, k_cache, v_cache, p, out, ws)
                   : upf_compact_attn_zero_copy(be, chunks, &ws->tables, q, k_cache, v_cache, p, out);
}

upf_status upf_compact_attend(const upf_backend *be, const upf_attn_paged *chunks, const upf_tensor *q,
                              const upf_tensor *k_cache, const upf_tensor *v_cache, const upf_sparse_params *sp,
                              const upf_compact_params *cp, const upf_attn_params *p, int copy_path,
                              const upf_tensor *out, uint8_t *table_host, int64_t *kept_blocks) {
  upf_compact_workspace ws;
  memset(&ws, 0, sizeof ws);
  upf_status st = upf_compact_attend_ws(be, chunks, q, k_cache, v_cache, sp, cp, p, copy_path, out, &ws);
  if (st == UPF_OK && table_host)
    memcpy(table_host, ws.table_host.ptr, (size_t)ws.num_reqs * (size_t)ws.hkv * (size_t)ws.key_blocks);
  if (st == UPF_OK && kept_blocks)
    *kept_blocks = ws.kept_blocks;
  upf_compact_workspace_free(&ws);
  return st;
}
