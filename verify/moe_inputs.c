/* Seeded MoE problems. Small tensors are drawn value by value from the suite's RNG; tensors of more
 * than POOL_MIN values walk a pool of normals with a prime stride (see moe_inputs.h). */
#include "verify/moe_inputs.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "uniprefill/bf16.h"
#include "uniprefill/rng.h"

#define POOL_SIZE 1048573u /* 2^20 - 3, prime */
#define POOL_STEP 7919u    /* prime, so the walk visits the whole pool before it repeats */
#define POOL_STEP_X 104729u /* x walks with another stride: no x row lines up with a weight row */
#define POOL_MIN ((int64_t)1 << 18)

const char *upf_moe_dist_name(upf_moe_dist dist) {
  static const char *const names[UPF_MOE_DIST_COUNT] = {"random", "skewed", "ties"};
  return (unsigned)dist < UPF_MOE_DIST_COUNT ? names[dist] : "invalid";
}

typedef struct {
  upf_rng rng;
  float *pool; /* (POOL_SIZE) N(0, 1), only when a large tensor is drawn */
} generator;

static void store(void *dst, upf_dtype dtype, int64_t at, float v) {
  if (dtype == UPF_DTYPE_BF16)
    ((uint16_t *)dst)[at] = upf_bf16_from_f32(v);
  else
    ((float *)dst)[at] = v;
}

/* dst[0..n) = shift + scale * N(0, 1), from the pool (walked with `step`) when use_pool. */
static void fill_step(generator *g, void *dst, upf_dtype dtype, int64_t n, float scale, float shift, int use_pool,
                      uint32_t step) {
  if (!use_pool || !g->pool) {
    for (int64_t i = 0; i < n; i++)
      store(dst, dtype, i, shift + scale * upf_rng_normal(&g->rng));
    return;
  }
  uint32_t at = (uint32_t)upf_rng_below(&g->rng, POOL_SIZE);
  for (int64_t i = 0; i < n; i++) {
    store(dst, dtype, i, shift + scale * g->pool[at]);
    at += step;
    if (at >= POOL_SIZE)
      at -= POOL_SIZE;
  }
}

static void fill(generator *g, void *dst, upf_dtype dtype, int64_t n, float scale, float shift, int use_pool) {
  fill_step(g, dst, dtype, n, scale, shift, use_pool, POOL_STEP);
}

static void *element(void *base, upf_dtype dtype, int64_t offset) {
  return (char *)base + (size_t)offset * upf_dtype_size(dtype);
}

void upf_moe_problem_free(upf_moe_problem *pb) {
  free(pb->x.data);
  free(pb->router);
  if (!pb->borrowed) {
    free(pb->gate_up), free(pb->down);
    free(pb->shared_gate_up), free(pb->shared_down), free(pb->shared_gate);
  }
  memset(pb, 0, sizeof *pb);
}

static void fill_router(generator *g, upf_moe_problem *pb, upf_moe_dist dist) {
  const upf_moe_config *c = &pb->cfg;
  int64_t H = c->hidden, E = c->num_experts;
  int use_pool = E * H >= POOL_MIN;
  float sd = 1.0f / sqrtf((float)H);
  int32_t hot = c->top_k > 2 ? c->top_k - 2 : 1;
  for (int64_t e = 0; e < E; e++) {
    void *row = element(pb->router, pb->dtype, e * H);
    if (dist == UPF_MOE_DIST_SKEWED && e < hot)
      fill(g, row, pb->dtype, H, 0.0f, 16.0f / (float)H, 0);
    else if (dist == UPF_MOE_DIST_TIES && e % 2 == 1)
      memcpy(row, element(pb->router, pb->dtype, (e - 1) * H), (size_t)H * upf_dtype_size(pb->dtype));
    else
      fill(g, row, pb->dtype, H, sd, 0.0f, use_pool);
  }
}

static void fill_experts(generator *g, upf_moe_problem *pb) {
  const upf_moe_config *c = &pb->cfg;
  int64_t H = c->hidden, E = c->num_experts, In = c->inter, Is = c->shared_inter;
  int use_pool = E * 2 * In * H >= POOL_MIN;
  for (int64_t e = 0; e < E; e++) {
    fill(g, element(pb->gate_up, pb->dtype, e * 2 * In * H), pb->dtype, 2 * In * H, 1.0f / sqrtf((float)H), 0.0f,
         use_pool);
    fill(g, element(pb->down, pb->dtype, e * H * In), pb->dtype, H * In, 1.0f / sqrtf((float)In), 0.0f, use_pool);
  }
  if (Is > 0) {
    fill(g, pb->shared_gate_up, pb->dtype, 2 * Is * H, 1.0f / sqrtf((float)H), 0.0f, use_pool);
    fill(g, pb->shared_down, pb->dtype, H * Is, 1.0f / sqrtf((float)Is), 0.0f, use_pool);
    fill(g, pb->shared_gate, pb->dtype, H, 1.0f / sqrtf((float)H), 0.0f, 0);
  }
}

upf_status upf_moe_problem_make(upf_moe_problem *pb, const upf_moe_config *cfg, int64_t num_tokens, int64_t x_ld,
                                upf_dtype dtype, upf_moe_dist dist, uint64_t seed, const upf_moe_problem *experts_from) {
  memset(pb, 0, sizeof *pb);
  UPF_TRY(upf_moe_config_check(cfg));
  int64_t T = num_tokens, H = cfg->hidden, E = cfg->num_experts, In = cfg->inter, Is = cfg->shared_inter;
  if (x_ld == 0)
    x_ld = H;
  if (T < 0 || x_ld < H)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe problem: T=%lld, x_ld=%lld (must be >= 0 and >= H=%lld)", (long long)T,
                    (long long)x_ld, (long long)H);
  if (dtype != UPF_DTYPE_F32 && dtype != UPF_DTYPE_BF16)
    return upf_fail(UPF_ERR_DTYPE, "moe problem: dtype %s (f32 or bf16)", upf_dtype_name(dtype));
  if ((unsigned)dist >= UPF_MOE_DIST_COUNT)
    return upf_fail(UPF_ERR_INVALID_ARG, "moe problem: unknown distribution %d", (int)dist);
  if (experts_from && (memcmp(&experts_from->cfg, cfg, sizeof *cfg) != 0 || experts_from->dtype != dtype))
    return upf_fail(UPF_ERR_INVALID_ARG, "moe problem: cannot borrow experts of another configuration or dtype");
  pb->cfg = *cfg;
  pb->dtype = dtype;
  size_t es = upf_dtype_size(dtype);
  int64_t xshape[2] = {T, H};
  void *xdata = malloc((size_t)(T * x_ld) * es + 1);
  upf_tensor_init(&pb->x, xdata, dtype, 2, xshape);
  pb->x.stride[0] = x_ld;
  pb->router = malloc((size_t)(E * H) * es);
  if (experts_from) {
    pb->borrowed = 1;
    pb->gate_up = experts_from->gate_up, pb->down = experts_from->down;
    pb->shared_gate_up = experts_from->shared_gate_up, pb->shared_down = experts_from->shared_down;
    pb->shared_gate = experts_from->shared_gate;
  } else {
    pb->gate_up = malloc((size_t)(E * 2 * In * H) * es);
    pb->down = malloc((size_t)(E * H * In) * es);
    if (Is > 0) {
      pb->shared_gate_up = malloc((size_t)(2 * Is * H) * es);
      pb->shared_down = malloc((size_t)(H * Is) * es);
      pb->shared_gate = malloc((size_t)H * es);
    }
  }
  generator g = {.pool = NULL};
  upf_rng_seed(&g.rng, seed);
  int big = T * H >= POOL_MIN || E * H >= POOL_MIN || (!experts_from && E * 2 * In * H >= POOL_MIN);
  if (big)
    g.pool = malloc((size_t)POOL_SIZE * sizeof *g.pool);
  if (!xdata || !pb->router || !pb->gate_up || !pb->down || (Is > 0 && (!pb->shared_gate_up || !pb->shared_down ||
                                                                        !pb->shared_gate)) || (big && !g.pool)) {
    free(g.pool);
    upf_moe_problem_free(pb);
    return upf_fail(UPF_ERR_NOMEM, "moe problem: cannot allocate T=%lld, H=%lld, E=%lld, I=%lld", (long long)T,
                    (long long)H, (long long)E, (long long)In);
  }
  if (g.pool)
    upf_rng_fill_normal(&g.rng, g.pool, POOL_SIZE, 0.0f, 1.0f);
  for (int64_t t = 0; t < T; t++) {
    void *row = element(pb->x.data, dtype, t * x_ld);
    fill_step(&g, row, dtype, H, 1.0f, dist == UPF_MOE_DIST_SKEWED ? 1.0f : 0.0f, T * H >= POOL_MIN, POOL_STEP_X);
    for (int64_t j = H; j < x_ld; j++)
      store(row, dtype, j, NAN);
  }
  fill_router(&g, pb, dist);
  if (!experts_from)
    fill_experts(&g, pb);
  free(g.pool);
  return UPF_OK;
}

upf_moe_weights upf_moe_problem_weights(const upf_moe_problem *pb) {
  upf_moe_weights w = {.dtype = pb->dtype,
                       .router = pb->router,
                       .gate_up = pb->gate_up,
                       .down = pb->down,
                       .shared_gate_up = pb->shared_gate_up,
                       .shared_down = pb->shared_down,
                       .shared_gate = pb->shared_gate};
  return w;
}

void upf_moe_device_problem_free(upf_moe_device_problem *dev) {
  for (int i = 0; i < 7; i++)
    if (dev->buf[i])
      dev->backend->release(dev->buf[i]);
  memset(dev, 0, sizeof *dev);
}

static upf_status copy_to(upf_moe_device_problem *dev, int slot, const void *src, size_t bytes, const void **dst) {
  UPF_TRY(dev->backend->alloc(&dev->buf[slot], bytes ? bytes : 1));
  *dst = dev->buf[slot];
  return dev->backend->upload(dev->buf[slot], src, bytes);
}

upf_status upf_moe_problem_upload(const upf_backend *be, const upf_moe_problem *pb,
                                  const upf_moe_device_problem *reuse_experts, upf_moe_device_problem *dev) {
  memset(dev, 0, sizeof *dev);
  dev->backend = be;
  const upf_moe_config *c = &pb->cfg;
  size_t es = upf_dtype_size(pb->dtype);
  int64_t H = c->hidden, E = c->num_experts, In = c->inter, Is = c->shared_inter;
  const void *xdev = NULL;
  dev->w = upf_moe_problem_weights(pb);
  upf_status st = copy_to(dev, 0, pb->x.data, (size_t)(pb->x.shape[0] * pb->x.stride[0]) * es, &xdev);
  if (st == UPF_OK)
    st = copy_to(dev, 1, pb->router, (size_t)(E * H) * es, &dev->w.router);
  if (st == UPF_OK && pb->borrowed && reuse_experts) {
    dev->w.gate_up = reuse_experts->w.gate_up, dev->w.down = reuse_experts->w.down;
    dev->w.shared_gate_up = reuse_experts->w.shared_gate_up, dev->w.shared_down = reuse_experts->w.shared_down;
    dev->w.shared_gate = reuse_experts->w.shared_gate;
  } else {
    if (st == UPF_OK)
      st = copy_to(dev, 2, pb->gate_up, (size_t)(E * 2 * In * H) * es, &dev->w.gate_up);
    if (st == UPF_OK)
      st = copy_to(dev, 3, pb->down, (size_t)(E * H * In) * es, &dev->w.down);
    if (st == UPF_OK && Is > 0)
      st = copy_to(dev, 4, pb->shared_gate_up, (size_t)(2 * Is * H) * es, &dev->w.shared_gate_up);
    if (st == UPF_OK && Is > 0)
      st = copy_to(dev, 5, pb->shared_down, (size_t)(H * Is) * es, &dev->w.shared_down);
    if (st == UPF_OK && Is > 0)
      st = copy_to(dev, 6, pb->shared_gate, (size_t)H * es, &dev->w.shared_gate);
  }
  dev->x = pb->x;
  dev->x.data = (void *)xdev;
  if (st != UPF_OK)
    upf_moe_device_problem_free(dev);
  return st;
}
