/* MoE FFN on the CPU reference: hand-computed golden cases, the router's tie rule and weights, the
 * permutation's invariants over ragged token counts (experts with no pair, experts with every token),
 * the layer against the independent per-token evaluation, the marginal rule of the routing compare,
 * FLOP counts, and bad inputs each returning its status. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_cpu/moe.h"
#include "tests/test_util.h"
#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"
#include "verify/moe_checks.h"
#include "verify/moe_inputs.h"

static void run_golden(upf_moe_golden golden) {
  const upf_dtype dtypes[2] = {UPF_DTYPE_F32, UPF_DTYPE_BF16};
  for (int d = 0; d < 2; d++) {
    upf_check check;
    upf_moe_golden_run(upf_backend_cpu(), golden, dtypes[d], &check);
    if (!check.passed)
      printf("\n    %s (%s): %s\n", upf_moe_golden_name(golden), check.dtype, check.detail);
    CU_ASSERT(check.passed);
  }
}

static void test_golden_route(void) { run_golden(UPF_MOE_GOLDEN_ROUTE); }
static void test_golden_permute(void) {
  run_golden(UPF_MOE_GOLDEN_PERMUTE);
  run_golden(UPF_MOE_GOLDEN_PERMUTE_SKEW);
}
static void test_golden_ffn(void) { run_golden(UPF_MOE_GOLDEN_FFN); }

/* Ties go to the lower index; weights are the softmax renormalised over the K chosen. */
static void test_route_token_by_hand(void) {
  upf_moe_config cfg = {.hidden = 1, .num_experts = 6, .top_k = 3, .inter = 1, .shared_inter = 0, .norm_topk = 1};
  const double logits[6] = {0.0, 2.0, 1.0, 2.0, 2.0, -1.0};
  int32_t index[3];
  double weight[3], prob[6];
  ref_moe_route_token(logits, &cfg, index, weight, prob);
  CU_ASSERT(index[0] == 1 && index[1] == 3 && index[2] == 4);
  for (int k = 0; k < 3; k++)
    CU_ASSERT_DOUBLE_EQUAL(weight[k], 1.0 / 3.0, 1e-15);
  double z = 1.0 + 3.0 * exp(2.0) + exp(1.0) + exp(-1.0);
  CU_ASSERT_DOUBLE_EQUAL(prob[1], exp(2.0) / z, 1e-15);
  cfg.norm_topk = 0;
  cfg.top_k = 4;
  int32_t index4[4];
  double weight4[4];
  ref_moe_route_token(logits, &cfg, index4, weight4, NULL);
  CU_ASSERT(index4[3] == 2);
  CU_ASSERT_DOUBLE_EQUAL(weight4[3], exp(1.0) / z, 1e-15);
  /* K = E: every expert, in rank order. */
  cfg.top_k = 6;
  int32_t all[6];
  double wall[6];
  ref_moe_route_token(logits, &cfg, all, wall, NULL);
  const int32_t want[6] = {1, 3, 4, 2, 0, 5};
  CU_ASSERT(memcmp(all, want, sizeof want) == 0);
}

/* Permutations of random routings over ragged T, with a hot expert on every token and cold ones. */
static void test_permutation_invariants(void) {
  const upf_moe_config cfg = {.hidden = 8, .num_experts = 37, .top_k = 5, .inter = 4, .shared_inter = 0,
                              .norm_topk = 1};
  const int64_t lens[] = {0, 1, 17, 577, 4096};
  upf_rng rng;
  upf_rng_seed(&rng, 91);
  int rounds = upf_test_quick() ? 4 : 5;
  for (int i = 0; i < rounds; i++) {
    int64_t T = lens[i], n = T * cfg.top_k;
    int32_t *index = malloc((size_t)(n + 1) * sizeof *index);
    int32_t *count = malloc((size_t)cfg.num_experts * 4), *offset = malloc((size_t)(cfg.num_experts + 1) * 4);
    int32_t *sorted = malloc((size_t)(n + 1) * 4), *row = malloc((size_t)(n + 1) * 4);
    for (int64_t t = 0; t < T; t++) {
      index[t * cfg.top_k] = 30; /* expert 30 on every token; experts 31..36 never */
      for (int k = 1; k < cfg.top_k; k++)
        index[t * cfg.top_k + k] = (int32_t)upf_rng_below(&rng, 30);
    }
    upf_moe_permutation perm = {count, offset, sorted, row};
    CU_ASSERT_EQUAL_FATAL(ref_moe_permute(&cfg, T, index, &perm), UPF_OK);
    upf_check check;
    upf_moe_check_permutation(&cfg, T, index, &perm, &check);
    if (!check.passed)
      printf("\n    T=%lld: %s\n", (long long)T, check.detail);
    CU_ASSERT(check.passed);
    CU_ASSERT_EQUAL(count[30], T);
    CU_ASSERT_EQUAL(count[36], 0);
    CU_ASSERT_EQUAL(offset[cfg.num_experts], n);
    free(index), free(count), free(offset), free(sorted), free(row);
  }
}

static void check_layer(const upf_moe_config *cfg, int64_t T, int64_t x_pad, upf_dtype dtype, upf_dtype out_dtype,
                        upf_moe_dist dist, uint64_t seed) {
  upf_moe_problem pb;
  CU_ASSERT_FATAL(upf_moe_problem_make(&pb, cfg, T, cfg->hidden + x_pad, dtype, dist, seed, NULL) == UPF_OK);
  upf_moe_weights w = upf_moe_problem_weights(&pb);
  int64_t H = cfg->hidden, K = cfg->top_k, E = cfg->num_experts;
  double *naive = malloc((size_t)(T * H + 1) * sizeof *naive), *nl = malloc((size_t)(T * E + 1) * sizeof *nl);
  double *nw = malloc((size_t)(T * K + 1) * sizeof *nw);
  int32_t *ni = malloc((size_t)(T * K + 1) * sizeof *ni), *gi = malloc((size_t)(T * K + 1) * sizeof *gi);
  float *gw = malloc((size_t)(T * K + 1) * sizeof *gw), *gl = malloc((size_t)(T * E + 1) * sizeof *gl);
  float *got = malloc((size_t)(T * H + 1) * sizeof *got);
  void *raw = malloc((size_t)(T * H) * upf_dtype_size(out_dtype) + 1);
  upf_moe_naive(cfg, &pb.x, &w, nl, ni, nw, naive);
  int64_t shape[2] = {T, H};
  upf_tensor out;
  upf_tensor_init(&out, raw, out_dtype, 2, shape);
  upf_moe_routing rt = {gi, gw, gl};
  CU_ASSERT_EQUAL_FATAL(cpu_moe_ffn(cfg, &pb.x, &w, &out, &rt), UPF_OK);
  if (out_dtype == UPF_DTYPE_BF16)
    upf_bf16_to_f32_array(got, raw, T * H);
  else
    memcpy(got, raw, (size_t)(T * H) * sizeof(float));
  upf_check check;
  memset(&check, 0, sizeof check);
  /* Both evaluate in double; only the rounding of the output separates them. */
  upf_compare_f32(got, naive, T * H, upf_tolerance_for(out_dtype), &check);
  if (!check.passed)
    printf("\n    layer T=%lld %s: %s\n", (long long)T, upf_dtype_name(dtype), check.detail);
  CU_ASSERT(check.passed);
  CU_ASSERT(memcmp(gi, ni, (size_t)(T * K) * sizeof *gi) == 0);
  for (int64_t i = 0; i < T * K; i++)
    CU_ASSERT_DOUBLE_EQUAL(gw[i], nw[i], 1e-6);
  /* The layer's routing is the router's. */
  int32_t *ri = malloc((size_t)(T * K + 1) * sizeof *ri);
  float *rw = malloc((size_t)(T * K + 1) * sizeof *rw);
  upf_moe_routing rr = {ri, rw, NULL};
  CU_ASSERT_EQUAL(cpu_moe_route(cfg, &pb.x, &w, &rr), UPF_OK);
  CU_ASSERT(memcmp(ri, gi, (size_t)(T * K) * sizeof *ri) == 0);
  CU_ASSERT(memcmp(rw, gw, (size_t)(T * K) * sizeof *rw) == 0);
  free(ri), free(rw);
  free(naive), free(nl), free(nw), free(ni), free(gi), free(gw), free(gl), free(got), free(raw);
  upf_moe_problem_free(&pb);
}

static void test_layer_against_naive(void) {
  const upf_moe_config small = {48, 10, 3, 24, 16, 1}, odd = {19, 5, 2, 7, 0, 0}, all = {32, 3, 3, 16, 8, 1};
  int quick = upf_test_quick();
  check_layer(&small, 1, 0, UPF_DTYPE_F32, UPF_DTYPE_F32, UPF_MOE_DIST_RANDOM, 1);
  check_layer(&small, 17, 5, UPF_DTYPE_BF16, UPF_DTYPE_BF16, UPF_MOE_DIST_SKEWED, 2);
  check_layer(&odd, 17, 2, UPF_DTYPE_F32, UPF_DTYPE_F32, UPF_MOE_DIST_RANDOM, 3);
  check_layer(&all, quick ? 33 : 577, 0, UPF_DTYPE_BF16, UPF_DTYPE_F32, UPF_MOE_DIST_TIES, 4);
  if (!quick)
    check_layer(&small, 577, 0, UPF_DTYPE_F32, UPF_DTYPE_BF16, UPF_MOE_DIST_RANDOM, 5);
}

/* A routing that differs from the reference passes only on probabilities within tau. */
static void test_routing_marginal_rule(void) {
  const upf_moe_config cfg = {.hidden = 1, .num_experts = 4, .top_k = 2, .inter = 1, .shared_inter = 0,
                              .norm_topk = 1};
  /* Token 0: experts 1 and 2 nearly tie for the second slot; token 1: clear winners. */
  const double logits[8] = {3.0, 1.0, 1.0 - 1e-7, -2.0, 0.0, 5.0, 4.0, -1.0};
  const int32_t ref[4] = {0, 1, 5 - 4, 6 - 4};
  const int32_t swapped[4] = {0, 2, 1, 2}, wrong[4] = {0, 1, 1, 3}, reordered[4] = {0, 1, 2, 1};
  uint8_t agree[2];
  upf_check check;
  upf_moe_compare_routing(&cfg, 2, logits, ref, ref, 1e-5, agree, &check);
  CU_ASSERT(check.passed && agree[0] && agree[1]);
  upf_moe_compare_routing(&cfg, 2, logits, ref, swapped, 1e-5, agree, &check);
  CU_ASSERT(check.passed && !agree[0] && agree[1]);
  CU_ASSERT(strstr(check.detail, "1 marginal") != NULL);
  upf_moe_compare_routing(&cfg, 2, logits, ref, swapped, 1e-9, agree, &check);
  CU_ASSERT(!check.passed);
  upf_moe_compare_routing(&cfg, 2, logits, ref, wrong, 1e-3, agree, &check);
  CU_ASSERT(!check.passed);
  upf_moe_compare_routing(&cfg, 2, logits, ref, reordered, 1e-3, agree, &check);
  CU_ASSERT(!check.passed);
}

static void test_flops(void) {
  upf_moe_config q = upf_moe_config_qwen3_next();
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_flops(&q, 1), 71307264.0, 0.5);
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_weight_bytes(&q, UPF_DTYPE_BF16), 2.0 * (512.0 * 2048 * (1 + 3 * 512) + 3 * 512 * 2048 + 2048),
                         0.5);
}

/* The unfused traffic model by hand for H=16, E=6, K=2, I=8, Is=4, T=4 (8 pairs), bf16, in bytes:
 * router 128 + 192 + 96 = 416; top-K 96 + 64 = 160; sort 8 * 16 = 128; gather 128 + 256 = 384;
 * GEMM 1 3072 + 256 + 256 = 3584; SwiGLU 256 + 128 = 384; GEMM 2 1536 + 128 + 256 = 1920;
 * combine 256 + 64 + 128 = 448; shared expert: gate 32 + 16, x 128, weights 384, hs 128, as 64,
 * ys 256, gate read 16 = 1024. */
static void test_unfused_traffic(void) {
  upf_moe_config cfg = {16, 6, 2, 8, 4, 1};
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_unfused_traffic_bytes(&cfg, 4, UPF_DTYPE_BF16, UPF_DTYPE_BF16), 8448.0, 0.5);
  /* f32 out: only the 4 x 16 outputs grow, by 2 bytes each */
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_unfused_traffic_bytes(&cfg, 4, UPF_DTYPE_BF16, UPF_DTYPE_F32), 8576.0, 0.5);
  cfg.shared_inter = 0;
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_unfused_traffic_bytes(&cfg, 4, UPF_DTYPE_BF16, UPF_DTYPE_BF16), 7424.0, 0.5);
  CU_ASSERT_DOUBLE_EQUAL(upf_moe_unfused_traffic_bytes(&cfg, 0, UPF_DTYPE_BF16, UPF_DTYPE_BF16),
                         upf_moe_weight_bytes(&cfg, UPF_DTYPE_BF16), 0.5); /* T = 0: the weights alone */
}

/* T = 0 is valid and writes nothing; bad inputs come back as their status, naming the input. */
static void test_errors_and_empty(void) {
  const upf_moe_config cfg = {16, 6, 2, 8, 4, 1};
  upf_moe_problem pb;
  CU_ASSERT_FATAL(upf_moe_problem_make(&pb, &cfg, 4, 0, UPF_DTYPE_F32, UPF_MOE_DIST_RANDOM, 7, NULL) == UPF_OK);
  upf_moe_weights w = upf_moe_problem_weights(&pb);
  float out_data[4 * 16];
  int32_t index[8];
  float weight[8];
  int64_t shape[2] = {4, 16};
  upf_tensor out;
  upf_tensor_init(&out, out_data, UPF_DTYPE_F32, 2, shape);
  upf_moe_routing rt = {index, weight, NULL};
  /* Empty batch. */
  upf_tensor x0 = pb.x, out0 = out;
  x0.shape[0] = out0.shape[0] = 0;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &x0, &w, &out0, &rt), UPF_OK);
  int32_t count[6] = {9, 9, 9, 9, 9, 9}, offset[7] = {9, 9, 9, 9, 9, 9, 9}, s[1], r[1];
  upf_moe_permutation perm = {count, offset, s, r};
  CU_ASSERT_EQUAL(cpu_moe_permute(&cfg, 0, NULL, &perm), UPF_OK);
  CU_ASSERT(count[0] == 0 && count[5] == 0 && offset[6] == 0);
  /* NaN in x row 2. */
  ((float *)pb.x.data)[2 * 16 + 3] = NAN;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &pb.x, &w, &out, &rt), UPF_ERR_NONFINITE);
  CU_ASSERT(strstr(upf_last_error(), "token 2") != NULL);
  CU_ASSERT_EQUAL(cpu_moe_route(&cfg, &pb.x, &w, &rt), UPF_ERR_NONFINITE);
  ((float *)pb.x.data)[2 * 16 + 3] = 0.0f;
  /* Configuration, dtypes, shapes, missing outputs. */
  upf_moe_config bad = cfg;
  bad.top_k = 7;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&bad, &pb.x, &w, &out, NULL), UPF_ERR_INVALID_ARG);
  bad = cfg;
  bad.norm_topk = 2;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&bad, &pb.x, &w, &out, NULL), UPF_ERR_INVALID_ARG);
  upf_moe_weights wb = w;
  wb.dtype = UPF_DTYPE_BF16;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &pb.x, &wb, &out, NULL), UPF_ERR_DTYPE);
  upf_tensor xi = pb.x;
  xi.dtype = UPF_DTYPE_I32;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &xi, &w, &out, NULL), UPF_ERR_DTYPE);
  upf_tensor xs = pb.x;
  xs.shape[1] = 15;
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &xs, &w, &out, NULL), UPF_ERR_SHAPE);
  CU_ASSERT(strstr(upf_last_error(), "x:") != NULL);
  CU_ASSERT_EQUAL(cpu_moe_ffn(&cfg, &pb.x, &w, NULL, NULL), UPF_ERR_INVALID_ARG);
  upf_moe_routing partial = {index, NULL, NULL};
  CU_ASSERT_EQUAL(cpu_moe_route(&cfg, &pb.x, &w, &partial), UPF_ERR_INVALID_ARG);
  /* Permutation of an index outside [0, E): refused before anything is written. */
  int32_t idx[8] = {0, 1, 2, 3, 4, 6, 1, 0};
  int32_t c2[6] = {-5, -5, -5, -5, -5, -5}, o2[7], s2[8], r2[8];
  upf_moe_permutation p2 = {c2, o2, s2, r2};
  CU_ASSERT_EQUAL(cpu_moe_permute(&cfg, 4, idx, &p2), UPF_ERR_INVALID_ARG);
  CU_ASSERT(strstr(upf_last_error(), "topk_index[5]") != NULL);
  CU_ASSERT_EQUAL(c2[0], -5);
  upf_moe_problem_free(&pb);
}

static CU_TestInfo moe_tests[] = {
    {"golden route: tie to the lower index, renormalised weights", test_golden_route},
    {"golden permutations: empty and full experts", test_golden_permute},
    {"golden layer with the shared expert", test_golden_ffn},
    {"router rank order and weights by hand", test_route_token_by_hand},
    {"permutation invariants over ragged T", test_permutation_invariants},
    {"layer equals the per-token evaluation", test_layer_against_naive},
    {"routing compare applies the marginal rule", test_routing_marginal_rule},
    {"FLOP and weight counts of Qwen3-Next", test_flops},
    {"unfused traffic model by hand", test_unfused_traffic},
    {"empty batch and bad inputs", test_errors_and_empty},
    CU_TEST_INFO_NULL,
};

void upf_register_moe_tests(void) { upf_test_suite("moe (cpu reference)", NULL, NULL, moe_tests); }
