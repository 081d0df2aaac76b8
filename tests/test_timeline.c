/* The timeline (uniprefill/timeline.h): the breakdown on hand-built event lists whose busy and idle time,
 * gaps, overlap and categories are counted by hand; kernel names to categories and readable names; the
 * Chrome trace; on a GPU, a recording of real backend work. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "uniprefill/backend.h"
#include "uniprefill/timeline.h"

static upf_timeline_event kernel(const char *name, uint64_t start, uint64_t end, uint32_t stream) {
  upf_timeline_event e;
  memset(&e, 0, sizeof e);
  e.kind = UPF_TIMELINE_KERNEL, e.name = name, e.start_ns = start, e.end_ns = end, e.stream = stream;
  e.grid[0] = e.grid[1] = e.grid[2] = e.block[0] = e.block[1] = e.block[2] = 1;
  return e;
}

#define NEAR(a, b) (fabs((a) - (b)) < 1e-9)

/* Times in ns; 1 us = 1000. Events: a GEMM [0, 100 us) on stream 7; norms [102, 200 us) on 7; attention
 * [150, 300 us) on 9 (50 us beside the norms); a copy [2300, 2301 us) on 7; RoPE [2301.005, 2301.015 us).
 * Busy: 100 + 98 + 100 (200..300) + 1 + 0.010 = 299.010 us; window 2301.015 us; idle 2002.005 us in
 * three gaps: 2 us (100..102), 2000 us (300..2300) and 0.005 us (2301..2301.005); overlap 50 us. */
static void test_breakdown_by_hand(void) {
  upf_timeline_event ev[5] = {
      kernel("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 100000, 7),
      kernel("_ZN12_GLOBAL__N_115rms_rows_kernelI13__nv_bfloat16Li8ELb1ELb0ELi1EEEvNS_9norm_argsE", 102000, 200000, 7),
      kernel("_ZN10upf_bsattn15bs_wgmma_kernelILi128ELb0ELb0EEEvNS_7bs_argsE", 150000, 300000, 9),
      {0},
      kernel("_Z11rope_kernel9rope_argsl", 2301005, 2301015, 7),
  };
  ev[3].kind = UPF_TIMELINE_MEMCPY, ev[3].name = "memcpy", ev[3].start_ns = 2300000, ev[3].end_ns = 2301000;
  ev[3].stream = 7, ev[3].bytes = 4096;
  upf_timeline t = {ev, 5, 0, NULL, 0};
  upf_timeline_summary s;
  CU_ASSERT_EQUAL_FATAL(upf_timeline_summarize(&t, &s), UPF_OK);
  CU_ASSERT(NEAR(s.window_ms, 2.301015));
  CU_ASSERT(NEAR(s.busy_ms, 0.299010));
  CU_ASSERT(NEAR(s.idle_ms, 2.002005));
  CU_ASSERT(NEAR(s.overlap_ms, 0.050));
  CU_ASSERT_EQUAL(s.kernels, 4);
  CU_ASSERT_EQUAL(s.copies, 1);
  CU_ASSERT_EQUAL(s.streams, 2);
  CU_ASSERT_EQUAL(s.gaps, 3);
  CU_ASSERT_EQUAL(s.gap_count[0], 2); /* 2 us and 5 ns: under 10 us */
  CU_ASSERT(NEAR(s.gap_ms[0], 0.002005));
  CU_ASSERT_EQUAL(s.gap_count[1], 0);
  CU_ASSERT_EQUAL(s.gap_count[2], 1); /* 2 ms */
  CU_ASSERT(NEAR(s.gap_ms[2], 2.0));
  /* the longest gaps, longest first, with the events around them */
  CU_ASSERT_EQUAL_FATAL(s.num_top_gaps, 3);
  CU_ASSERT(NEAR(s.top_gaps[0].ms, 2.0) && NEAR(s.top_gaps[0].at_ms, 0.3));
  CU_ASSERT_EQUAL(s.top_gaps[0].before, 2); /* attention ended last */
  CU_ASSERT_EQUAL(s.top_gaps[0].after, 3);
  CU_ASSERT(NEAR(s.top_gaps[1].ms, 0.002) && s.top_gaps[1].before == 0 && s.top_gaps[1].after == 1);
  CU_ASSERT(NEAR(s.top_gaps[2].ms, 0.000005));
  /* categories by time, largest first: attention 150 us, the GEMM 100, the norms 98, the copy 1, RoPE 0.01 */
  CU_ASSERT_EQUAL_FATAL(s.num_categories, 5);
  CU_ASSERT_STRING_EQUAL(s.categories[0].name, "attention");
  CU_ASSERT(NEAR(s.categories[0].ms, 0.150));
  CU_ASSERT_STRING_EQUAL(s.categories[1].name, "GEMM (cuBLAS)");
  CU_ASSERT_STRING_EQUAL(s.categories[2].name, "norms");
  CU_ASSERT(NEAR(s.categories[2].ms, 0.098));
  CU_ASSERT_STRING_EQUAL(s.categories[3].name, "copies and fills");
  CU_ASSERT_STRING_EQUAL(s.categories[4].name, "RoPE");
  CU_ASSERT_EQUAL(s.categories[4].count, 1);
  /* the printout names the longest gap's neighbours by their readable names */
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  CU_ASSERT_FATAL(f != NULL);
  upf_timeline_print(f, "  ", &t, &s);
  fclose(f);
  CU_ASSERT(strstr(text, "gap 2.000 ms at 0.300 ms, after bs_wgmma_kernel, before memcpy") != NULL);
  CU_ASSERT(strstr(text, "GPU busy 0.299 ms (13.0%)") != NULL);
  free(text);
}

static upf_timeline_event copy(uint64_t start, uint64_t end) {
  upf_timeline_event e = kernel("memcpy", start, end, 1);
  e.kind = UPF_TIMELINE_MEMCPY, e.bytes = 8;
  return e;
}

/* Copies before the first kernel (a run's upload before its timer) are the lead, not the window: uploads at
 * 0 and 5000 us, kernels at [5010, 5020) and [5040, 5050) us, a fill at [5030, 5031) between them. */
static void test_window_opens_at_first_kernel(void) {
  upf_timeline_event ev[5] = {copy(0, 1000), copy(5000000, 5001000), kernel("k1", 5010000, 5020000, 1),
                              copy(5030000, 5031000), kernel("k2", 5040000, 5050000, 1)};
  ev[3].kind = UPF_TIMELINE_MEMSET;
  upf_timeline t = {ev, 5, 0, NULL, 0};
  upf_timeline_summary s;
  CU_ASSERT_EQUAL_FATAL(upf_timeline_summarize(&t, &s), UPF_OK);
  CU_ASSERT_EQUAL(s.lead_events, 2);
  CU_ASSERT(NEAR(s.lead_ms, 5.010));
  CU_ASSERT(NEAR(s.window_ms, 0.040));
  CU_ASSERT(NEAR(s.busy_ms, 0.021));
  CU_ASSERT(NEAR(s.idle_ms, 0.019));
  CU_ASSERT_EQUAL(s.kernels, 2);
  CU_ASSERT_EQUAL(s.copies, 1);
  CU_ASSERT_EQUAL(s.gaps, 2);
  CU_ASSERT_EQUAL(s.gap_count[0], 1); /* 9 us */
  CU_ASSERT_EQUAL(s.gap_count[1], 1); /* 10 us: the class's lower bound */
  CU_ASSERT(NEAR(s.top_gaps[0].ms, 0.010) && NEAR(s.top_gaps[0].at_ms, 0.010));
  CU_ASSERT_EQUAL(s.top_gaps[0].before, 2);
  /* without a kernel, the window is the events' own */
  t.events = ev, t.count = 2;
  CU_ASSERT_EQUAL_FATAL(upf_timeline_summarize(&t, &s), UPF_OK);
  CU_ASSERT_EQUAL(s.lead_events, 0);
  CU_ASSERT(NEAR(s.window_ms, 5.001));
  CU_ASSERT_EQUAL(s.gap_count[2], 1);
}

static void test_breakdown_rejects_disorder(void) {
  upf_timeline_event ev[2] = {kernel("a", 10, 20, 0), kernel("b", 5, 30, 0)};
  upf_timeline t = {ev, 2, 0, NULL, 0};
  upf_timeline_summary s;
  CU_ASSERT_EQUAL(upf_timeline_summarize(&t, &s), UPF_ERR_INVALID_ARG);
  ev[0] = kernel("a", 10, 9, 0), t.count = 1;
  CU_ASSERT_EQUAL(upf_timeline_summarize(&t, &s), UPF_ERR_INVALID_ARG);
  t.count = 0; /* nothing recorded: an empty breakdown */
  CU_ASSERT_EQUAL(upf_timeline_summarize(&t, &s), UPF_OK);
  CU_ASSERT_EQUAL(s.kernels + s.copies + s.gaps, 0);
  CU_ASSERT_EQUAL(s.window_ms, 0.0);
}

static void test_categories_and_names(void) {
  const struct {
    const char *name, *category, *short_name;
  } cases[] = {
      /* the selection's part GEMM is selection, not cuBLAS; MoE's scan is not Gated DeltaNet's */
      {"_ZN10upf_select20sel_part_gemm_kernelEv", "selection", "sel_part_gemm_kernel"},
      {"_Z20moe_scan_rows_kernelPKjiPjS1_", "MoE routing and combine", "moe_scan_rows_kernel"},
      {"_ZN7upf_gdn11scan_kernelENS_9scan_argsE", "Gated DeltaNet", "scan_kernel"},
      {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM (cuBLAS)",
       "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"},
      {"_ZL14act_mul_kernelI13__nv_bfloat16EvPKT_llPS1_l", "activation and gates", "act_mul_kernel"},
      {"_ZN6upf_kv21kv_cache_write_kernelI13__nv_bfloat16EEvPKT_", "KV cache and compaction", "kv_cache_write_kernel"},
      {"_ZN10upf_sparse14idx_mma_kernelILi128EEEvNS_8idx_argsE", "FlashPrefill means and index", "idx_mma_kernel"},
      {"_Z12embed_kernel10embed_args", "embedding and logits", "embed_kernel"},
      {"some_other_library_kernel", "other", "some_other_library_kernel"},
      /* a name that only looks mangled: kept whole */
      {"_Z99short", "other", "_Z99short"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const upf_timeline_event e = kernel(cases[i].name, 0, 1, 0);
    CU_ASSERT_STRING_EQUAL(upf_timeline_category(&e), cases[i].category);
    char buf[128];
    upf_timeline_short_name(cases[i].name, buf, sizeof buf);
    CU_ASSERT_STRING_EQUAL(buf, cases[i].short_name);
  }
  char tiny[5];
  upf_timeline_short_name("_ZN10upf_bsattn15bs_wgmma_kernelILi128EEEvv", tiny, sizeof tiny);
  CU_ASSERT_STRING_EQUAL(tiny, "bs_w");
  upf_timeline_event fill = kernel("memset", 0, 1, 0);
  fill.kind = UPF_TIMELINE_MEMSET;
  CU_ASSERT_STRING_EQUAL(upf_timeline_category(&fill), "copies and fills");
}

static int count_of(const char *text, const char *needle) {
  int n = 0;
  for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
    n++;
  return n;
}

static void test_chrome_trace(void) {
  upf_timeline_event ev[2] = {kernel("_Z11rope_kernel9rope_args", 1000, 3500, 3), kernel("quote\"name", 4000, 4001, 4)};
  ev[1].kind = UPF_TIMELINE_MEMSET, ev[1].bytes = 64;
  upf_timeline t = {ev, 2, 0, NULL, 0};
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  CU_ASSERT_FATAL(f != NULL);
  CU_ASSERT_EQUAL(upf_timeline_write_chrome(f, &t, "test"), UPF_OK);
  fclose(f);
  /* microseconds from the window's start, a row a stream, readable name, category, the full name */
  CU_ASSERT(strstr(text, "\"tid\": 3, \"ts\": 0.000, \"dur\": 2.500, \"name\": \"rope_kernel\", \"cat\": \"RoPE\"") != NULL);
  CU_ASSERT(strstr(text, "\"kernel\": \"_Z11rope_kernel9rope_args\"") != NULL);
  CU_ASSERT(strstr(text, "\"tid\": 4, \"ts\": 3.000, \"dur\": 0.001, \"name\": \"quote\\\"name\"") != NULL);
  CU_ASSERT(strstr(text, "\"args\": {\"bytes\": 64}") != NULL);
  CU_ASSERT_EQUAL(count_of(text, "\"ph\": \"X\""), 2);
  CU_ASSERT_EQUAL(count_of(text, "{"), count_of(text, "}"));
  free(text);
}

/* On a GPU: a recording of backend work holds its kernels and copies, in order, inside the window. */
static void test_cuda_recording(void) {
  const upf_backend *be = upf_backend_cuda();
  if (be->probe() != UPF_OK)
    return;
  void *buf = NULL;
  const size_t bytes = 1 << 20;
  CU_ASSERT_EQUAL_FATAL(be->alloc(&buf, bytes), UPF_OK);
  upf_status st = upf_timeline_start();
  if (st == UPF_ERR_UNSUPPORTED) { /* no libcupti on this machine: the message says which files */
    printf("\n  (no libcupti: %s) ", upf_last_error());
    be->release(buf);
    return;
  }
  CU_ASSERT_EQUAL_FATAL(st, UPF_OK);
  CU_ASSERT_EQUAL(upf_timeline_start(), UPF_ERR_INVALID_ARG); /* one recording at a time */
  char *host = calloc(1, bytes);
  CU_ASSERT_EQUAL(be->fill(buf, 0x5a, bytes), UPF_OK);
  CU_ASSERT_EQUAL(be->upload(buf, host, bytes), UPF_OK);
  CU_ASSERT_EQUAL(be->synchronize(), UPF_OK);
  upf_timeline t;
  CU_ASSERT_EQUAL_FATAL(upf_timeline_stop(&t), UPF_OK);
  CU_ASSERT(t.count >= 2);
  int copies = 0;
  for (int64_t i = 0; i < t.count; i++) {
    CU_ASSERT(t.events[i].end_ns >= t.events[i].start_ns);
    if (i > 0)
      CU_ASSERT(t.events[i].start_ns >= t.events[i - 1].start_ns);
    copies += t.events[i].kind != UPF_TIMELINE_KERNEL;
  }
  CU_ASSERT(copies >= 1);
  upf_timeline_summary s;
  CU_ASSERT_EQUAL(upf_timeline_summarize(&t, &s), UPF_OK);
  CU_ASSERT(s.busy_ms > 0 && s.busy_ms <= s.window_ms + 1e-9);
  upf_timeline_free(&t);
  upf_timeline empty;
  CU_ASSERT_EQUAL(upf_timeline_stop(&empty), UPF_ERR_INVALID_ARG); /* nothing running */
  free(host);
  be->release(buf);
}

static CU_TestInfo timeline_tests[] = {
    {"breakdown counted by hand: busy, idle, gaps, overlap, categories", test_breakdown_by_hand},
    {"the window opens at the first kernel; earlier copies are the lead", test_window_opens_at_first_kernel},
    {"breakdown refuses events out of order", test_breakdown_rejects_disorder},
    {"kernel names to categories and readable names", test_categories_and_names},
    {"Chrome trace", test_chrome_trace},
    CU_TEST_INFO_NULL,
};

void upf_register_timeline_tests(void) {
  CU_pSuite suite = upf_test_suite("timeline", NULL, NULL, timeline_tests);
  upf_test_add_gpu(suite, "CUDA recording of backend work", test_cuda_recording);
}
