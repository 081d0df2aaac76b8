/* Benchmarks of the paged-KV metadata ops and of a session's decode step (uniprefill/session.h).
 * kv.slot_mapping (backend->kv_slot_mapping) at Llama-3.1-8B serving shapes, P = 16: a prefill step
 * of 16 x 8K tokens, and decode steps of 64 and 256 one-token rows at 32K tokens of context (block
 * tables of 2048 pages); TB/s counts the slots written, the block-table entries read (one per page a
 * row touches) and cu_seqlens and starts. compact.scatter_rows (backend->scatter_rows) at Qwen3-Next's
 * Gated DeltaNet state rows (recurrent 32 x 128 x 128 f32 = 2 MiB, conv 3 x 8192 f32) of 64 requests
 * into a pool of 65 slots; TB/s counts each row read and written once. CUDA cases verify their op
 * against the CPU reference before any timing and are skipped by name without a device; the CPU cases
 * are small shapes, wall clock.
 *
 * session.decode_step: one decode step (one row per request, greedy token fed) of B requests that were
 * prefilled to a context of C tokens, through upf_session_step on llama3.1-8b's shapes, bf16, seeded
 * weights: wall clock of the whole step (host bookkeeping, the slot mapping of every cache group,
 * every layer, the logits copied to the host); the context grows by one token per iteration. Building
 * the model and prefilling the contexts happen once, before the timed runs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perf/bench.h"
#include "uniprefill/backend.h"
#include "uniprefill/engine.h"
#include "uniprefill/kv.h"
#include "uniprefill/session.h"

#define KV_CUDA_REPETITIONS 5
#define KV_CUDA_MIN_TIME_S 0.05
#define KV_WARMUP 3

/* ---- kv.slot_mapping ---- */

typedef struct {
  const char *name;
  int on_cuda;
  int32_t num_reqs, tokens_per_row, context; /* each row: tokens_per_row tokens starting at `context` */
  int32_t page_size;
  int64_t iterations; /* CPU: fixed */
  int ready;
  const upf_backend *be;
  int32_t max_blocks;
  int64_t T, num_pages;
  int32_t *cu_host, *start_host, *table_host;
  void *cu, *start, *table, *slots;
} slot_case;

static slot_case slot_cases[] = {
    {"kv.slot_mapping/cuda/llama8b_prefill16x8K", 1, 16, 8192, 0, 16, 0},
    {"kv.slot_mapping/cuda/llama8b_decode64_ctx32K", 1, 64, 1, 32768, 16, 0},
    {"kv.slot_mapping/cuda/llama8b_decode256_ctx32K", 1, 256, 1, 32768, 16, 0},
    {"kv.slot_mapping/cpu/decode64_ctx4K", 0, 64, 1, 4096, 16, 20},
};

static double slot_bytes(const slot_case *c) {
  const double pages_touched = (double)c->num_reqs * ((c->tokens_per_row + c->page_size - 1) / c->page_size + 1);
  return 4.0 * (double)c->T + 4.0 * pages_touched + 8.0 * c->num_reqs + 4.0;
}

static void slot_release(void *ctx) {
  slot_case *c = ctx;
  if (!c->ready)
    return;
  void *dev[] = {c->cu, c->start, c->table, c->slots};
  for (int i = 0; i < 4; i++)
    c->be->release(dev[i]);
  free(c->cu_host), free(c->start_host), free(c->table_host);
  c->ready = 0;
}

/* Rows over disjoint pages, each row's pages in a scattered (but deterministic) order. */
static upf_status slot_prepare(slot_case *c, const upf_backend *be) {
  if (c->ready)
    return UPF_OK;
  c->be = be;
  const int32_t B = c->num_reqs, P = c->page_size;
  c->max_blocks = (c->context + c->tokens_per_row + P - 1) / P;
  c->T = (int64_t)B * c->tokens_per_row;
  c->num_pages = (int64_t)B * c->max_blocks;
  c->cu_host = malloc(sizeof(int32_t) * (size_t)(B + 1));
  c->start_host = malloc(sizeof(int32_t) * (size_t)B);
  c->table_host = malloc(sizeof(int32_t) * (size_t)c->num_pages);
  c->ready = 1; /* release frees what was allocated */
  if (!c->cu_host || !c->start_host || !c->table_host)
    return upf_fail(UPF_ERR_NOMEM, "bench kv: block tables of %lld pages", (long long)c->num_pages);
  c->cu_host[0] = 0;
  for (int32_t r = 0; r < B; r++)
    c->cu_host[r + 1] = c->cu_host[r] + c->tokens_per_row, c->start_host[r] = c->context;
  for (int64_t i = 0; i < c->num_pages; i++) /* a permutation of the pages: 7919 is prime to num_pages */
    c->table_host[i] = (int32_t)((i * 7919) % c->num_pages);
  if (c->num_pages % 7919 == 0)
    return upf_fail(UPF_ERR_INVALID_ARG, "bench kv: %lld pages", (long long)c->num_pages);
  UPF_TRY(be->alloc(&c->cu, sizeof(int32_t) * (size_t)(B + 1)));
  UPF_TRY(be->alloc(&c->start, sizeof(int32_t) * (size_t)B));
  UPF_TRY(be->alloc(&c->table, sizeof(int32_t) * (size_t)c->num_pages));
  UPF_TRY(be->alloc(&c->slots, sizeof(int32_t) * (size_t)c->T));
  UPF_TRY(be->upload(c->cu, c->cu_host, sizeof(int32_t) * (size_t)(B + 1)));
  UPF_TRY(be->upload(c->start, c->start_host, sizeof(int32_t) * (size_t)B));
  return be->upload(c->table, c->table_host, sizeof(int32_t) * (size_t)c->num_pages);
}

static upf_status slot_call(void *arg) {
  slot_case *c = arg;
  const upf_kv_slot_batch b = {c->num_reqs, c->cu,         c->cu_host,    c->start,   c->start_host,
                               c->table,    c->table_host, c->max_blocks, c->page_size, c->num_pages};
  return c->be->kv_slot_mapping(&b, c->slots);
}

/* ---- compact.scatter_rows ---- */

typedef struct {
  const char *name;
  int on_cuda;
  int32_t num_rows, pool_rows;
  int64_t row_bytes;
  int64_t iterations;
  int ready;
  const upf_backend *be;
  int32_t *index_host;
  void *index, *src, *dst;
} scatter_case;

static scatter_case scatter_cases[] = {
    {"compact.scatter_rows/cuda/qwen3next_gdn_state_64", 1, 64, 65, 32 * 128 * 128 * 4, 0},
    {"compact.scatter_rows/cuda/qwen3next_gdn_conv_64", 1, 64, 65, 3 * 8192 * 4, 0},
    {"compact.scatter_rows/cpu/gdn_state_8", 0, 8, 9, 32 * 128 * 128 * 4, 20},
};

static double scatter_bytes(const scatter_case *c) { return 2.0 * c->num_rows * (double)c->row_bytes; }

static void scatter_release(void *ctx) {
  scatter_case *c = ctx;
  if (!c->ready)
    return;
  c->be->release(c->index), c->be->release(c->src), c->be->release(c->dst);
  free(c->index_host);
  c->ready = 0;
}

static upf_status scatter_prepare(scatter_case *c, const upf_backend *be) {
  if (c->ready)
    return UPF_OK;
  c->be = be;
  c->ready = 1;
  c->index_host = malloc(sizeof(int32_t) * (size_t)c->num_rows);
  if (!c->index_host)
    return upf_fail(UPF_ERR_NOMEM, "bench kv: scatter index");
  for (int32_t i = 0; i < c->num_rows; i++) /* slots in reverse: every row moves */
    c->index_host[i] = c->pool_rows - 2 - i;
  UPF_TRY(be->alloc(&c->index, sizeof(int32_t) * (size_t)c->num_rows));
  UPF_TRY(be->alloc(&c->src, (size_t)c->num_rows * (size_t)c->row_bytes));
  UPF_TRY(be->alloc(&c->dst, (size_t)c->pool_rows * (size_t)c->row_bytes));
  UPF_TRY(be->fill(c->src, 0x3c, (size_t)c->num_rows * (size_t)c->row_bytes));
  UPF_TRY(be->fill(c->dst, 0, (size_t)c->pool_rows * (size_t)c->row_bytes));
  return be->upload(c->index, c->index_host, sizeof(int32_t) * (size_t)c->num_rows);
}

static upf_status scatter_call(void *arg) {
  scatter_case *c = arg;
  return c->be->scatter_rows(c->src, c->num_rows, c->row_bytes, c->index, c->index_host, c->dst, c->pool_rows);
}

/* ---- the op cases' shared runners ---- */

typedef struct {
  int on_cuda;
  upf_op op;
  void *c;
  upf_status (*prepare)(void *c, const upf_backend *be);
  upf_status (*call)(void *c);
  double bytes;
  char label[96];
} op_case;

static upf_status slot_prepare_v(void *c, const upf_backend *be) { return slot_prepare(c, be); }
static upf_status scatter_prepare_v(void *c, const upf_backend *be) { return scatter_prepare(c, be); }

#define NUM_SLOT ((int)(sizeof slot_cases / sizeof *slot_cases))
#define NUM_SCATTER ((int)(sizeof scatter_cases / sizeof *scatter_cases))
static op_case op_cases[NUM_SLOT + NUM_SCATTER];

static void op_release(void *ctx) {
  op_case *o = ctx;
  if (o->op == UPF_OP_KV_SLOT_MAPPING)
    slot_release(o->c);
  else
    scatter_release(o->c);
}

static void op_bench(upf_bench_state *st, void *ctx) {
  op_case *o = ctx;
  const upf_backend *be = o->on_cuda ? upf_backend_cuda() : upf_backend_cpu();
  if (o->on_cuda) {
#ifndef UPF_HAVE_CUDA
    upf_bench_skip_no_device(st, "cuda backend unavailable (built with CUDA=0)");
    return;
#else
    if (be->probe() != UPF_OK) {
      upf_bench_skip_no_device(st, upf_last_error());
      return;
    }
    char why[160];
    if (!upf_bench_op_verified(o->op, why, sizeof why)) {
      upf_bench_skip_with_error(st, "not timed, verification against the CPU reference failed: %s", why);
      return;
    }
#endif
  }
  if (o->prepare(o->c, be) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing inputs: %s", upf_last_error());
    return;
  }
  if (o->on_cuda) {
    upf_bench_timing t;
    if (upf_bench_time_cuda(st, o->call, o->c, KV_WARMUP, o->bytes, &t) != UPF_OK) {
      upf_bench_skip_with_error(st, "%s: %s", upf_op_name(o->op), upf_last_error());
      return;
    }
  } else {
    while (upf_bench_keep_running(st))
      if (o->call(o->c) != UPF_OK) {
        upf_bench_skip_with_error(st, "%s: %s", upf_op_name(o->op), upf_last_error());
        return;
      }
  }
  upf_bench_set_counter(st, UPF_BENCH_BYTES, o->bytes, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_label(st, o->label);
}

/* ---- session.decode_step ---- */

typedef struct {
  const char *name;
  int32_t num_reqs, context;
  int64_t iterations;
  upf_session *s;
  upf_session_row *rows;
} decode_case;

static decode_case decode_cases[] = {
    {"session.decode_step/cuda/bf16/llama3.1-8b", 1, 8192, 50},
    {"session.decode_step/cuda/bf16/llama3.1-8b", 16, 8192, 50},
    {"session.decode_step/cuda/bf16/llama3.1-8b", 64, 8192, 50},
    {"session.decode_step/cuda/bf16/llama3.1-8b", 16, 32768, 50},
};

/* One model for every case (16 GB of weights), and one session at a time: a case's session lives
 * across its repetitions and is freed when the next case prepares (the KV of 64 x 8K tokens alone
 * takes tens of GB). */
static struct {
  int built;
  upf_status failed; /* building failed once: not retried */
  upf_model m;
  decode_case *current;
} decode_shared;

static void decode_case_free(decode_case *c) {
  upf_session_free(c->s);
  free(c->rows);
  c->s = NULL, c->rows = NULL;
}

static void decode_release(void *ctx) {
  decode_case *c = ctx;
  decode_case_free(c);
  if (decode_shared.current == c)
    decode_shared.current = NULL;
  if (decode_shared.built && !decode_shared.current) {
    int live = 0;
    for (size_t i = 0; i < sizeof decode_cases / sizeof *decode_cases; i++)
      live += decode_cases[i].s != NULL;
    if (!live) {
      upf_model_free(&decode_shared.m);
      decode_shared.built = 0;
    }
  }
}

/* The shared model, a session with room for the contexts and the timed tokens, and the contexts
 * prefilled (one request per step, so the prefill's activations stay those of one context). */
static upf_status decode_prepare(decode_case *c) {
  if (c->s)
    return UPF_OK;
  if (decode_shared.failed != UPF_OK)
    return upf_fail(decode_shared.failed, "bench session: building llama3.1-8b failed before");
  const upf_model_config *cfg = upf_model_config_by_name("llama3.1-8b");
  if (!cfg)
    return UPF_ERR_INVALID_ARG;
  if (!decode_shared.built) {
    decode_shared.failed =
        upf_model_init_seeded(&decode_shared.m, cfg, upf_backend_cuda(), UPF_DTYPE_BF16, 1, 0, cfg->num_layers);
    UPF_TRY(decode_shared.failed);
    decode_shared.built = 1;
  }
  if (decode_shared.current && decode_shared.current != c)
    decode_case_free(decode_shared.current);
  decode_shared.current = c;
  upf_session_config sc = upf_session_config_default(&decode_shared.m);
  sc.max_requests = c->num_reqs;
  /* the timed steps add at most a thousand tokens per request over all runs */
  sc.pages_per_group = (int64_t)c->num_reqs * ((c->context + 1024 + sc.page_size - 1) / sc.page_size);
  UPF_TRY(upf_session_create(&decode_shared.m, &sc, &c->s));
  c->rows = calloc((size_t)c->num_reqs, sizeof *c->rows);
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)c->context);
  upf_status st = c->rows && ids ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "bench session: rows");
  for (int32_t r = 0; st == UPF_OK && r < c->num_reqs; r++) {
    upf_model_seeded_ids((uint64_t)r + 1, cfg->vocab, c->context, ids);
    st = upf_session_add_request(c->s, ids, c->context, &c->rows[r].req);
    upf_prefill_result res;
    const upf_session_row row = {c->rows[r].req, UPF_ROW_PREFILL, 0};
    if (st == UPF_OK)
      st = upf_session_step(c->s, &row, 1, NULL, &res);
    if (st == UPF_OK) {
      c->rows[r].kind = UPF_ROW_DECODE, c->rows[r].token = upf_engine_argmax(res.logits, cfg->vocab);
      upf_prefill_result_free(&res);
    }
  }
  free(ids);
  if (st != UPF_OK)
    decode_case_free(c);
  return st;
}

static void decode_bench(upf_bench_state *st, void *ctx) {
  decode_case *c = ctx;
  if (upf_backend_cuda()->probe() != UPF_OK) { /* also the answer of a CUDA=0 build */
    upf_bench_skip_no_device(st, upf_last_error());
    return;
  }
  if (decode_prepare(c) != UPF_OK) {
    upf_bench_skip_with_error(st, "preparing the session: %s", upf_last_error());
    return;
  }
  const int32_t V = decode_shared.m.cfg->vocab;
  while (upf_bench_keep_running(st)) {
    upf_prefill_result res;
    if (upf_session_step(c->s, c->rows, c->num_reqs, NULL, &res) != UPF_OK) {
      upf_bench_skip_with_error(st, "decode step: %s", upf_last_error());
      return;
    }
    for (int32_t r = 0; r < c->num_reqs; r++)
      c->rows[r].token = upf_engine_argmax(res.logits + (size_t)r * V, V);
    upf_prefill_result_free(&res);
  }
  upf_session_memory mem;
  upf_session_memory_usage(c->s, &mem);
  upf_bench_set_counter(st, "tokens_per_second", (double)c->num_reqs, UPF_BENCH_COUNTER_RATE);
  upf_bench_set_counter(st, "kv_gib", mem.bytes_in_use / (1 << 30), UPF_BENCH_COUNTER_VALUE);
  char label[96];
  snprintf(label, sizeof label, "B=%d context=%d P=16", c->num_reqs, c->context);
  upf_bench_set_label(st, label);
}

void upf_register_kv_benchmarks(void) {
  for (int i = 0; i < NUM_SLOT + NUM_SCATTER; i++) {
    op_case *o = &op_cases[i];
    const char *name;
    int64_t iterations, arg;
    if (i < NUM_SLOT) {
      slot_case *c = &slot_cases[i];
      const int32_t P = c->page_size;
      const int64_t T = (int64_t)c->num_reqs * c->tokens_per_row;
      *o = (op_case){c->on_cuda, UPF_OP_KV_SLOT_MAPPING, c, slot_prepare_v, slot_call, 0, ""};
      c->T = T; /* for the byte count before preparation */
      o->bytes = slot_bytes(c);
      snprintf(o->label, sizeof o->label, "B=%d T=%lld context=%d P=%d", c->num_reqs, (long long)T, c->context, P);
      name = c->name, iterations = c->iterations, arg = T;
    } else {
      scatter_case *c = &scatter_cases[i - NUM_SLOT];
      *o = (op_case){c->on_cuda, UPF_OP_SCATTER_ROWS, c, scatter_prepare_v, scatter_call, scatter_bytes(c), ""};
      snprintf(o->label, sizeof o->label, "rows=%d row_bytes=%lld pool=%d", c->num_rows, (long long)c->row_bytes,
               c->pool_rows);
      name = c->name, iterations = c->iterations, arg = c->num_rows;
    }
    upf_bench_spec spec = {.name = name, .fn = op_bench, .ctx = o, .teardown = op_release, .num_args = 1};
    spec.args[0] = arg;
    spec.arg_names[0] = i < NUM_SLOT ? "T" : "rows";
    upf_bench_spec_timing(&spec, o->on_cuda, KV_CUDA_MIN_TIME_S, KV_CUDA_REPETITIONS, iterations);
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench kv: %s\n", upf_last_error());
  }
  for (size_t i = 0; i < sizeof decode_cases / sizeof *decode_cases; i++) {
    decode_case *c = &decode_cases[i];
    upf_bench_spec spec = {.name = c->name, .fn = decode_bench, .ctx = c, .teardown = decode_release, .num_args = 2};
    spec.args[0] = c->num_reqs, spec.arg_names[0] = "B";
    spec.args[1] = c->context, spec.arg_names[1] = "context";
    spec.flags = UPF_BENCH_REAL_TIME, spec.unit = UPF_BENCH_MS, spec.iterations = c->iterations;
    spec.repetitions = 3;
    if (upf_bench_register(&spec) != UPF_OK)
      fprintf(stderr, "bench kv: %s\n", upf_last_error());
  }
}
