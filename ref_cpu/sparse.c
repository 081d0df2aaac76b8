/* PLACEHOLDER (being written) */
#include "ref_cpu/sparse.h"
upf_status cpu_sparse_block_means(const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v,
                                  const upf_sparse_params *p, const upf_tensor *kbar, const upf_tensor *vbar) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "sparse.block_means (cpu): not yet");
}
upf_status cpu_sparse_index(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *kbar,
                            const upf_sparse_params *p, upf_sparse_index *index) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "sparse.index (cpu): not yet");
}
upf_status cpu_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                 const upf_tensor *v, const upf_sparse_params *p, const upf_sparse_index *index,
                                 const upf_tensor *kbar, const upf_tensor *vbar, const upf_tensor *out) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "attn.block_sparse (cpu): not yet");
}
