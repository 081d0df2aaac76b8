/* The all-reduce of a row-parallel projection's output under tensor parallelism: each rank holds the
 * partial sum over its heads (or its intermediate columns); the sum over ranks is the whole layer's
 * output, before any norm or residual add. A model without a communicator skips it. The communicator
 * orders itself after the backend's queued work (NCCL on the backend's stream, MPI after a download). */
#include "layers/layers.h"

upf_status upf_layer_allreduce(const upf_model *m, const upf_tensor *out) {
  if (!m->comm)
    return UPF_OK;
  if (!upf_tensor_is_contiguous(out))
    return upf_fail(UPF_ERR_SHAPE, "layer all-reduce: the output is not contiguous");
  return upf_comm_allreduce_sum(m->comm, out->data, upf_tensor_numel(out), out->dtype);
}
