/* CPU reference of the embedding lookup. */
#include "ref_cpu/embed.h"

#include "ref_cpu/dense_util.h"

upf_status cpu_embed(const int32_t *ids, int64_t num_tokens, const upf_tensor *table, float scale,
                     const upf_tensor *y) {
  UPF_TRY(upf_embed_check(ids, num_tokens, table, scale, y));
  int64_t V = table->shape[0], H = table->shape[1];
  for (int64_t t = 0; t < num_tokens; t++)
    if (ids[t] < 0 || ids[t] >= V)
      return upf_fail(UPF_ERR_INVALID_ARG, "embed: ids[%lld]=%d outside [0, V=%lld)", (long long)t, ids[t],
                      (long long)V);
  for (int64_t t = 0; t < num_tokens; t++) {
    int64_t src = (int64_t)ids[t] * table->stride[0], dst = t * y->stride[0];
    for (int64_t i = 0; i < H; i++) /* the product of two floats is exact in double: one rounding */
      ref_put(y, dst + i, (double)ref_get(table, src + i) * (double)scale);
  }
  return UPF_OK;
}
