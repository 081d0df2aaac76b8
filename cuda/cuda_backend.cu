/* The CUDA backend's ops table (upf_backend_cuda) and its shared state: one lazily created stream,
 * a grow-only device workspace, pinned staging for host<->device copies of small plans and results.
 * No kernels here; the select entries live in cuda/select.cu and compaction in cuda/compact.cu. */
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include "cuda/attn.cuh"
#include "cuda/compact.cuh"
#include "cuda/compact_attn.cuh"
#include "cuda/cuda_backend.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/embed.cuh"
#include "cuda/ffn.cuh"
#include "cuda/gated_out.cuh"
#include "cuda/gdn.cuh"
#include "cuda/gemm.cuh"
#include "cuda/kv.cuh"
#include "cuda/logits.cuh"
#include "cuda/moe.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/select.cuh"
#include "cuda/sparse.cuh"
#include "uniprefill/backend.h"

namespace {

/* 32 MiB: the cublasSetWorkspace size that cuBLAS's documentation recommends for Hopper. */
#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)

struct cuda_state {
  std::mutex lock;
  bool inited = false;
  upf_status init_status = UPF_OK;
  char init_message[512] = "";
  cudaStream_t stream = nullptr;
  int device = 0;
  int num_sms = 0;
  size_t smem_optin = 0;
  char description[384] = "";

  void *workspace = nullptr; /* device, grow-only */
  size_t workspace_bytes = 0;

  void *staging = nullptr; /* pinned host, grow-only; guarded by staging_done */
  size_t staging_bytes = 0;
  cudaEvent_t staging_done = nullptr;

  void *result = nullptr; /* pinned host, 4096 bytes, for small device->host reads */

  cublasHandle_t cublas = nullptr; /* created on first use, bound to `stream` */
  void *cublas_workspace = nullptr;  /* CUBLAS_WORKSPACE_BYTES for `cublas`, kept for the process */
};

cuda_state g;

/* UPF_BACKENDS lists the backends a run may use ("cpu", "cpu,cuda"); unset means all. Checked with
 * getenv only, so a run with UPF_BACKENDS=cpu never touches the CUDA driver (valgrind runs). */
bool cuda_disabled_by_env(const char **value) {
  const char *v = getenv("UPF_BACKENDS");
  *value = v;
  if (!v || !*v)
    return false;
  return strstr(v, "cuda") == nullptr;
}

upf_status init_locked(void) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  /* Without an NVIDIA driver the runtime says "CUDA driver version is insufficient", which sends a
   * user looking for a driver upgrade on a machine that simply has no GPU: say that instead. A
   * loaded driver (/proc/driver/nvidia) that is too old keeps the runtime's message. */
  if (err == cudaErrorNoDevice ||
      (err == cudaErrorInsufficientDriver && access("/proc/driver/nvidia/version", F_OK) != 0))
    return upf_fail(UPF_ERR_NO_DEVICE, "cuda: no CUDA device present (%s)",
                    err == cudaErrorNoDevice ? "the driver reports none" : "no NVIDIA driver is loaded");
  if (err != cudaSuccess)
    return upf_fail(UPF_ERR_NO_DEVICE, "cuda: no usable device: cudaGetDeviceCount failed: %s (%s)",
                    cudaGetErrorString(err), cudaGetErrorName(err));
  if (count == 0)
    return upf_fail(UPF_ERR_NO_DEVICE, "cuda: no CUDA device on this machine");
  UPF_CUDA_TRY(cudaGetDevice(&g.device));
  cudaDeviceProp prop;
  UPF_CUDA_TRY(cudaGetDeviceProperties(&prop, g.device));
  if (prop.major < 9)
    return upf_fail(UPF_ERR_NO_DEVICE, "cuda: device %d (%s) is sm_%d%d; this build holds sm_90 code only",
                    g.device, prop.name, prop.major, prop.minor);
  g.num_sms = prop.multiProcessorCount;
  g.smem_optin = prop.sharedMemPerBlockOptin;
  int driver = 0, runtime = 0;
  UPF_CUDA_TRY(cudaDriverGetVersion(&driver));
  UPF_CUDA_TRY(cudaRuntimeGetVersion(&runtime));
  snprintf(g.description, sizeof g.description, "%.200s, %d SMs, driver %d.%d, runtime %d.%d, sm_%d%d", prop.name,
           prop.multiProcessorCount, driver / 1000, (driver % 1000) / 10, runtime / 1000, (runtime % 1000) / 10,
           prop.major, prop.minor);
  UPF_CUDA_TRY(cudaStreamCreate(&g.stream));
  UPF_CUDA_TRY(cudaEventCreateWithFlags(&g.staging_done, cudaEventDisableTiming));
  UPF_CUDA_TRY(cudaMallocHost(&g.result, 4096));
  return UPF_OK;
}

} // namespace

extern "C" upf_status upf_cuda_init(void) {
  const char *env;
  if (cuda_disabled_by_env(&env))
    return upf_fail(UPF_ERR_NO_DEVICE, "cuda: disabled by UPF_BACKENDS=%s", env);
  std::lock_guard<std::mutex> guard(g.lock);
  if (!g.inited) {
    g.inited = true;
    g.init_status = init_locked();
    if (g.init_status != UPF_OK)
      snprintf(g.init_message, sizeof g.init_message, "%s", upf_last_error());
  }
  if (g.init_status != UPF_OK)
    return upf_fail(g.init_status, "%s", g.init_message);
  return UPF_OK;
}

extern "C" cudaStream_t upf_cuda_stream(void) {
  if (upf_cuda_init() != UPF_OK)
    return nullptr;
  return g.stream;
}

extern "C" cublasHandle_t upf_cuda_cublas(void) {
  if (upf_cuda_init() != UPF_OK)
    return nullptr;
  std::lock_guard<std::mutex> guard(g.lock);
  if (!g.cublas) {
    cublasHandle_t h = nullptr;
    cublasStatus_t st = cublasCreate(&h);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasSetStream(h, g.stream);
    /* A workspace of our own, as PyTorch gives its handles, so that cuBLAS may pick the kernels
     * that need a large one; where it cannot be allocated, cuBLAS's own default stays. */
    if (st == CUBLAS_STATUS_SUCCESS && !g.cublas_workspace &&
        cudaMalloc(&g.cublas_workspace, CUBLAS_WORKSPACE_BYTES) != cudaSuccess) {
      g.cublas_workspace = nullptr;
      cudaGetLastError(); /* fall back to cuBLAS's own default workspace */
    }
    if (st == CUBLAS_STATUS_SUCCESS && g.cublas_workspace) {
      st = cublasSetWorkspace(h, g.cublas_workspace, CUBLAS_WORKSPACE_BYTES);
      /* cuBLAS's split-K reduction reads what its GEMM kernel stored there, out of initcheck's sight */
      upf_cuda_mark_written(g.stream, g.cublas_workspace, 1, CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_BYTES);
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
      if (h)
        cublasDestroy(h);
      upf_fail(UPF_ERR_CUDA, "cuda: cannot create the cuBLAS handle: %s (%d)", cublasGetStatusString(st), (int)st);
      return nullptr;
    }
    g.cublas = h;
  }
  return g.cublas;
}

extern "C" void *upf_cuda_cublas_workspace(size_t *bytes) {
  std::lock_guard<std::mutex> guard(g.lock);
  *bytes = g.cublas_workspace ? CUBLAS_WORKSPACE_BYTES : 0;
  return g.cublas_workspace;
}

extern "C" void upf_cuda_mark_written(cudaStream_t stream, const void *ptr, int64_t rows, int64_t row_bytes,
                                      int64_t ld_bytes) {
  static nvtxDomainHandle_t domain = nvtxDomainCreateA("uniprefill"); /* after upf_cuda_init: the runtime is up */
  if (rows <= 0 || row_bytes <= 0)
    return;
  if (ld_bytes == row_bytes) /* contiguous: one range */
    row_bytes *= rows, rows = 1;
  enum { BATCH = 256 };
  nvtxMemVirtualRangeDesc_t ranges[BATCH];
  for (int64_t r0 = 0; r0 < rows; r0 += BATCH) {
    const int64_t n = rows - r0 < BATCH ? rows - r0 : BATCH;
    for (int64_t i = 0; i < n; i++)
      ranges[i].ptr = (const char *)ptr + (r0 + i) * ld_bytes, ranges[i].size = (size_t)row_bytes;
    nvtxMemMarkInitializedBatch_t batch;
    memset(&batch, 0, sizeof batch);
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof batch;
    batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    batch.regionDescCount = (size_t)n;
    batch.regionDescElementSize = sizeof ranges[0];
    batch.regionDescElements = ranges;
    nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
  }
}

extern "C" int upf_cuda_num_sms(void) { return g.num_sms; }
extern "C" size_t upf_cuda_smem_optin(void) { return g.smem_optin; }

extern "C" upf_status upf_cuda_workspace(size_t bytes, void **ptr) {
  UPF_TRY(upf_cuda_init());
  if (bytes > g.workspace_bytes) {
    size_t grow = g.workspace_bytes + g.workspace_bytes / 2;
    size_t want = bytes > grow ? bytes : grow;
    want = (want + 0xFFFFF) & ~(size_t)0xFFFFF; /* whole MiB */
    UPF_CUDA_TRY(cudaStreamSynchronize(g.stream));
    if (g.workspace) {
      UPF_CUDA_TRY(cudaFree(g.workspace));
      g.workspace = nullptr;
      g.workspace_bytes = 0;
    }
    cudaError_t err = cudaMalloc(&g.workspace, want);
    if (err != cudaSuccess) {
      g.workspace = nullptr;
      return upf_fail(err == cudaErrorMemoryAllocation ? UPF_ERR_NOMEM : UPF_ERR_CUDA,
                      "cuda: cannot allocate a workspace of %zu bytes: %s", want, cudaGetErrorString(err));
    }
    g.workspace_bytes = want;
  }
  *ptr = g.workspace;
  return UPF_OK;
}

extern "C" upf_status upf_cuda_upload_async(void *dst, const void *src, size_t bytes) {
  UPF_TRY(upf_cuda_init());
  if (bytes == 0)
    return UPF_OK;
  /* The previous staged copy must have left the pinned buffer before it is overwritten. */
  UPF_CUDA_TRY(cudaEventSynchronize(g.staging_done));
  if (bytes > g.staging_bytes) {
    if (g.staging)
      UPF_CUDA_TRY(cudaFreeHost(g.staging));
    g.staging = nullptr;
    g.staging_bytes = 0;
    size_t want = (bytes + 0xFFFF) & ~(size_t)0xFFFF;
    UPF_CUDA_TRY(cudaMallocHost(&g.staging, want));
    g.staging_bytes = want;
  }
  memcpy(g.staging, src, bytes);
  UPF_CUDA_TRY(cudaMemcpyAsync(dst, g.staging, bytes, cudaMemcpyHostToDevice, g.stream));
  UPF_CUDA_TRY(cudaEventRecord(g.staging_done, g.stream));
  return UPF_OK;
}

extern "C" upf_status upf_cuda_download_small(void *dst, const void *src, size_t bytes) {
  UPF_TRY(upf_cuda_init());
  if (bytes > 4096)
    return upf_fail(UPF_ERR_INVALID_ARG, "cuda: small download of %zu bytes exceeds 4096", bytes);
  if (bytes == 0)
    return UPF_OK;
  UPF_CUDA_TRY(cudaMemcpyAsync(g.result, src, bytes, cudaMemcpyDeviceToHost, g.stream));
  UPF_CUDA_TRY(cudaStreamSynchronize(g.stream));
  memcpy(dst, g.result, bytes);
  return UPF_OK;
}

/* ---- ops-table entries ---- */

namespace {

upf_status cuda_probe(void) { return upf_cuda_init(); }

const char *cuda_describe(void) {
  const char *env;
  if (cuda_disabled_by_env(&env) || upf_cuda_init() != UPF_OK)
    return "";
  return g.description;
}

upf_status cuda_alloc(void **ptr, size_t bytes) {
  *ptr = nullptr;
  UPF_TRY(upf_cuda_init());
  cudaError_t err = cudaMalloc(ptr, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    *ptr = nullptr;
    return upf_fail(err == cudaErrorMemoryAllocation ? UPF_ERR_NOMEM : UPF_ERR_CUDA,
                    "cuda: cannot allocate %zu bytes: %s", bytes, cudaGetErrorString(err));
  }
  return UPF_OK;
}

void cuda_release(void *ptr) {
  if (ptr)
    UPF_CUDA_NOTE(cudaFree(ptr));
}

upf_status cuda_upload(void *dst, const void *src, size_t bytes) {
  UPF_TRY(upf_cuda_init());
  if (bytes == 0)
    return UPF_OK;
  UPF_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
  UPF_CUDA_TRY(cudaStreamSynchronize(g.stream));
  return UPF_OK;
}

upf_status cuda_download(void *dst, const void *src, size_t bytes) {
  UPF_TRY(upf_cuda_init());
  if (bytes == 0)
    return UPF_OK;
  UPF_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
  UPF_CUDA_TRY(cudaStreamSynchronize(g.stream));
  return UPF_OK;
}

upf_status cuda_fill(void *dst, int byte, size_t bytes) {
  UPF_TRY(upf_cuda_init());
  if (bytes == 0)
    return UPF_OK;
  UPF_CUDA_TRY(cudaMemsetAsync(dst, byte, bytes, g.stream));
  return UPF_OK;
}

upf_status cuda_synchronize(void) {
  UPF_TRY(upf_cuda_init());
  UPF_CUDA_TRY(cudaStreamSynchronize(g.stream));
  return UPF_OK;
}

/* Marks are CUDA events (a cudaEvent_t is a pointer) recorded on the backend's stream. */
upf_status cuda_mark_create(void **mark) {
  *mark = NULL;
  UPF_TRY(upf_cuda_init());
  cudaEvent_t ev;
  UPF_CUDA_TRY(cudaEventCreate(&ev));
  *mark = (void *)ev;
  return UPF_OK;
}

void cuda_mark_destroy(void *mark) {
  if (mark)
    cudaEventDestroy((cudaEvent_t)mark); /* nothing to report: the handle is gone either way */
}

upf_status cuda_mark_record(void *mark) {
  UPF_CUDA_TRY(cudaEventRecord((cudaEvent_t)mark, g.stream));
  return UPF_OK;
}

upf_status cuda_mark_elapsed(void *start, void *end, double *seconds) {
  float ms = 0;
  UPF_CUDA_TRY(cudaEventSynchronize((cudaEvent_t)end));
  UPF_CUDA_TRY(cudaEventElapsedTime(&ms, (cudaEvent_t)start, (cudaEvent_t)end));
  *seconds = 1e-3 * (double)ms;
  return UPF_OK;
}

/* Filled by field name, not position: several entries share a signature, so a positional table
 * could swap two of them without a compile error. The op entries are upf_cuda_<entry> of ops.def,
 * declared by the cuda/<op>.cuh headers above. */
upf_backend make_cuda_table(void) {
  upf_backend b = {};
  b.name = "cuda";
  b.probe = cuda_probe;
  b.describe = cuda_describe;
  b.alloc = cuda_alloc;
  b.release = cuda_release;
  b.upload = cuda_upload;
  b.download = cuda_download;
  b.fill = cuda_fill;
  b.synchronize = cuda_synchronize;
  b.mark_create = cuda_mark_create;
  b.mark_destroy = cuda_mark_destroy;
  b.mark_record = cuda_mark_record;
  b.mark_elapsed = cuda_mark_elapsed;
#define UPF_OP(id, name, summary, entry, params) b.entry = upf_cuda_##entry;
#include "uniprefill/ops.def"
#undef UPF_OP
  return b;
}

} // namespace

extern "C" const upf_backend *upf_backend_cuda(void) {
  static const upf_backend table = make_cuda_table();
  return &table;
}
