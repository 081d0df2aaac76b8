/* Seeded MoE problems for verify, tests and benchmarks: hidden states and weights of a layer at any
 * configuration (Qwen3-Next's 3.2 GB of bf16 weights included), with plain random routing, routing
 * skewed so that some experts receive every token and most receive none, or exact router ties. */
#ifndef UNIPREFILL_VERIFY_MOE_INPUTS_H
#define UNIPREFILL_VERIFY_MOE_INPUTS_H

#include <stdint.h>

#include "uniprefill/backend.h"
#include "uniprefill/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  UPF_MOE_DIST_RANDOM = 0, /* x ~ N(0, 1); router rows ~ N(0, 1/H): logits ~ N(0, 1), whose fp32
                              rounding over H terms stays well inside the f32 tolerance of logits */
  UPF_MOE_DIST_SKEWED,     /* x ~ 1 + N(0, 1); the first max(K-2, 1) experts' router rows are 16/H: every
                              token picks them, the remaining slots spread thinly (experts with no token) */
  UPF_MOE_DIST_TIES,       /* router rows in identical pairs (2j, 2j+1): every logit ties with its twin */
  UPF_MOE_DIST_COUNT
} upf_moe_dist;

const char *upf_moe_dist_name(upf_moe_dist dist);

/* A host-side problem. Expert weights (gate_up, down and the shared expert) may be borrowed from
 * another problem of the same configuration and dtype, so that a verify run draws Qwen3-Next's
 * 1.6 G expert weights once and varies only x and the router. */
typedef struct {
  upf_moe_config cfg;
  upf_dtype dtype;
  upf_tensor x;         /* (T, H) rows of stride x_ld >= H; the x_ld - H padding values are NaN */
  void *router;         /* (E, H) */
  void *gate_up;        /* (E, 2I, H) */
  void *down;           /* (E, H, I) */
  void *shared_gate_up; /* (2Is, H); NULL when Is == 0 */
  void *shared_down;    /* (H, Is) */
  void *shared_gate;    /* (H) */
  int borrowed;         /* the expert weights belong to another problem */
} upf_moe_problem;

/* Values are drawn in fp32 (N(0,1) scaled: gate_up and the shared gate by 1/sqrt(H), down by
 * 1/sqrt(I), the shared down by 1/sqrt(Is)) and rounded to dtype. Large tensors take their values
 * from a pool of 2^20 - 3 normals walked with a prime stride from a random start per row or
 * matrix, which keeps 1.6 G weights to seconds. experts_from (may be NULL): borrow its expert
 * weights (same cfg and dtype). x_ld 0 means H. */
upf_status upf_moe_problem_make(upf_moe_problem *pb, const upf_moe_config *cfg, int64_t num_tokens, int64_t x_ld,
                                upf_dtype dtype, upf_moe_dist dist, uint64_t seed, const upf_moe_problem *experts_from);
void upf_moe_problem_free(upf_moe_problem *pb);
/* Host weights view of the problem. */
upf_moe_weights upf_moe_problem_weights(const upf_moe_problem *pb);

/* The same weights and x in a backend's memory. */
typedef struct {
  const upf_backend *backend;
  upf_tensor x; /* backend memory, same shape and strides as the problem's */
  upf_moe_weights w;
  void *buf[7]; /* x, router, gate_up, down, shared_gate_up, shared_down, shared_gate */
} upf_moe_device_problem;

/* Copies pb to `be`. reuse_experts (may be NULL): a copy of a problem whose expert weights pb
 * borrows; its device expert weights are then referenced, not copied. */
upf_status upf_moe_problem_upload(const upf_backend *be, const upf_moe_problem *pb,
                                  const upf_moe_device_problem *reuse_experts, upf_moe_device_problem *dev);
/* Releases what this copy owns (not the expert weights it references). */
void upf_moe_device_problem_free(upf_moe_device_problem *dev);

#ifdef __cplusplus
}
#endif
#endif
