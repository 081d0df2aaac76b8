/* PLACEHOLDER (being written) */
#include "cuda/sparse.cuh"
upf_status upf_cuda_sparse_block_means(const upf_sparse_batch *b, const upf_tensor *k, const upf_tensor *v,
                                       const upf_sparse_params *p, const upf_tensor *kbar, const upf_tensor *vbar) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "sparse.block_means (cuda): not yet");
}
upf_status upf_cuda_sparse_index(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *kbar,
                                 const upf_sparse_params *p, upf_sparse_index *index) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "sparse.index (cuda): not yet");
}
upf_status upf_cuda_attn_block_sparse(const upf_sparse_batch *b, const upf_tensor *q, const upf_tensor *k,
                                      const upf_tensor *v, const upf_sparse_params *p, const upf_sparse_index *index,
                                      const upf_tensor *kbar, const upf_tensor *vbar, const upf_tensor *out) {
  return upf_fail(UPF_ERR_UNSUPPORTED, "attn.block_sparse (cuda): not yet");
}
