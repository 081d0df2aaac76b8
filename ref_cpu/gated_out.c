/* CPU reference of the gated attention output: sigmoid and product in double, rounded once. */
#include "ref_cpu/gated_out.h"

#include <math.h>

#include "ref_cpu/dense_util.h"

upf_status cpu_gated_output(const upf_tensor *o, const upf_tensor *gate, const upf_tensor *y) {
  UPF_TRY(upf_gated_output_check(o, gate, y));
  int64_t T = o->shape[0], H = o->shape[1], D = o->shape[2];
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      int64_t oo = t * o->stride[0] + h * o->stride[1], go = t * gate->stride[0] + h * gate->stride[1];
      int64_t yo = t * y->stride[0] + h * y->stride[1];
      for (int64_t d = 0; d < D; d++) {
        double g = ref_get(gate, go + d);
        ref_put(y, yo + d, (double)ref_get(o, oo + d) / (1.0 + exp(-g)));
      }
    }
  return UPF_OK;
}
