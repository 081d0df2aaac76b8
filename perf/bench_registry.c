/* The one list of benchmark families. A new op's benchmark file exposes a register function and
 * adds one line here; bench_main and anything else that runs benchmarks call this. */
#include <stddef.h>

#include "perf/bench.h"

static void (*const families[])(void) = {
    upf_register_select_benchmarks, /* copy_bandwidth ceiling, select.pipeline on cpu and cuda */
    upf_register_dense_benchmarks,  /* gemm_ceiling, projections, FFN, norms, RoPE, gate, embed, logits */
    upf_register_moe_benchmarks,    /* moe.ffn vs the dense GEMM of the same FLOPs */
    upf_register_gdn_benchmarks,    /* gdn.scan at Qwen3-Next shapes: prefill, ragged, decode */
    upf_register_attn_benchmarks,   /* causal/window prefill, paged decode, cache write */
    upf_register_kv_benchmarks,     /* kv.slot_mapping, compact.scatter_rows, session decode step */
    upf_register_sparse_benchmarks, /* FlashPrefill V2: block means, index, block-sparse attention vs dense */
    upf_register_compact_benchmarks, /* CompactAttention: union, tables, selector, chunk attention vs dense */
};

void upf_register_all_benchmarks(void) {
  for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
    families[i]();
}
