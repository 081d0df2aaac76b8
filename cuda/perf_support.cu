/* Device timing and ceilings for the benchmarks (see perf_support.cuh). Everything runs on the CUDA
 * backend's stream, so timers and flushes order with the kernels they measure. */
#include "cuda/perf_support.cuh"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <new>
#include <vector>

#include "cuda/cuda_backend.cuh"
#include "cuda/gemm.cuh"

#define PERF_CUDA_TRY(call)                                                                          \
  do {                                                                                               \
    cudaError_t perf_err_ = (call);                                                                  \
    if (perf_err_ != cudaSuccess)                                                                    \
      return upf_fail(UPF_ERR_CUDA, "perf_support: %s failed: %s (%s:%d)", #call,                    \
                      cudaGetErrorString(perf_err_), __FILE__, __LINE__);                            \
  } while (0)

struct upf_cuda_timer {
  cudaEvent_t start;
  cudaEvent_t stop;
};

/* The flush READS twice L2's worth of its own buffer. A write flush (a memset) would leave the L2
 * full of dirty lines, and the timed kernel that follows would pay their write-back (60 MB on an
 * H200: 14 us, a third of a 134 MB memory-bound op) on top of its own bytes; read lines are clean
 * and are dropped for free. */
struct upf_cuda_l2_flush {
  void *buf;    /* (bytes) device, set once */
  size_t bytes;
};

namespace {

/* XORs the buffer in 16-byte words; writes only if the XOR equals a value it never takes (the
 * buffer holds one repeated byte), so the loads stay and nothing is written. */
__global__ void l2_flush_read_kernel(const uint4 *__restrict__ buf, size_t words, uint4 *sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = buf[i];
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u)
    *sink = acc;
}

} // namespace

extern "C" {

upf_status upf_cuda_timer_create(upf_cuda_timer **timer) {
  *timer = nullptr;
  upf_cuda_timer *t = new (std::nothrow) upf_cuda_timer{nullptr, nullptr};
  if (!t)
    return upf_fail(UPF_ERR_NOMEM, "perf_support: cannot allocate a timer");
  cudaError_t err = cudaEventCreate(&t->start);
  if (err == cudaSuccess)
    err = cudaEventCreate(&t->stop);
  if (err != cudaSuccess) {
    upf_cuda_timer_destroy(t);
    return upf_fail(UPF_ERR_CUDA, "perf_support: cudaEventCreate failed: %s", cudaGetErrorString(err));
  }
  *timer = t;
  return UPF_OK;
}

upf_status upf_cuda_timer_start(upf_cuda_timer *timer) {
  PERF_CUDA_TRY(cudaEventRecord(timer->start, upf_cuda_stream()));
  return UPF_OK;
}

upf_status upf_cuda_timer_stop(upf_cuda_timer *timer, double *seconds) {
  float ms = 0.0f;
  PERF_CUDA_TRY(cudaEventRecord(timer->stop, upf_cuda_stream()));
  PERF_CUDA_TRY(cudaEventSynchronize(timer->stop));
  PERF_CUDA_TRY(cudaEventElapsedTime(&ms, timer->start, timer->stop));
  *seconds = 1e-3 * (double)ms;
  return UPF_OK;
}

void upf_cuda_timer_destroy(upf_cuda_timer *timer) {
  if (!timer)
    return;
  /* Errors while tearing down have nowhere useful to go. */
  if (timer->start)
    (void)cudaEventDestroy(timer->start);
  if (timer->stop)
    (void)cudaEventDestroy(timer->stop);
  delete timer;
}

upf_status upf_cuda_l2_bytes(int64_t *bytes) {
  int dev = 0, l2 = 0;
  PERF_CUDA_TRY(cudaGetDevice(&dev));
  PERF_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  *bytes = l2;
  return UPF_OK;
}

upf_status upf_cuda_l2_flush_create(upf_cuda_l2_flush **flush) {
  *flush = nullptr;
  int64_t l2 = 0;
  UPF_TRY(upf_cuda_l2_bytes(&l2));
  /* Twice L2: with the hashed, partitioned L2 of recent GPUs one L2's worth may leave lines behind. */
  size_t bytes = (size_t)std::max<int64_t>(2 * l2, 8 << 20);
  upf_cuda_l2_flush *f = new (std::nothrow) upf_cuda_l2_flush{nullptr, bytes};
  if (!f)
    return upf_fail(UPF_ERR_NOMEM, "perf_support: cannot allocate an L2 flush");
  cudaError_t err = cudaMalloc(&f->buf, bytes);
  if (err == cudaSuccess) /* defined contents for the reads; written once, here */
    err = cudaMemsetAsync(f->buf, 0x3c, bytes, upf_cuda_stream());
  if (err != cudaSuccess) {
    if (f->buf)
      (void)cudaFree(f->buf);
    delete f;
    return upf_fail(UPF_ERR_CUDA, "perf_support: allocating the %zu-byte L2 flush failed: %s", bytes,
                    cudaGetErrorString(err));
  }
  *flush = f;
  return UPF_OK;
}

upf_status upf_cuda_l2_flush_run(upf_cuda_l2_flush *flush) {
  const size_t words = flush->bytes / sizeof(uint4);
  int sms = 0, dev = 0;
  PERF_CUDA_TRY(cudaGetDevice(&dev));
  PERF_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  l2_flush_read_kernel<<<(unsigned)std::max(1, 8 * sms), 256, 0, upf_cuda_stream()>>>(
      static_cast<const uint4 *>(flush->buf), words, static_cast<uint4 *>(flush->buf));
  PERF_CUDA_TRY(cudaGetLastError());
  return UPF_OK;
}

void upf_cuda_l2_flush_destroy(upf_cuda_l2_flush *flush) {
  if (!flush)
    return;
  if (flush->buf)
    (void)cudaFree(flush->buf);
  delete flush;
}

upf_status upf_cuda_copy_async(void *dst, const void *src, size_t bytes) {
  PERF_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, upf_cuda_stream()));
  return UPF_OK;
}

/* The measurement proper; the caller owns and frees the buffers and the timer. */
static upf_status time_copies(void *dst, const void *src, size_t bytes, int reps, upf_cuda_timer *timer,
                              double *median_s) {
  const int warmup = 2; /* first touch and clock ramp-up */
  for (int i = 0; i < warmup; i++)
    UPF_TRY(upf_cuda_copy_async(dst, src, bytes));
  std::vector<double> times;
  for (int i = 0; i < reps; i++) {
    double s = 0.0;
    UPF_TRY(upf_cuda_timer_start(timer));
    UPF_TRY(upf_cuda_copy_async(dst, src, bytes));
    UPF_TRY(upf_cuda_timer_stop(timer, &s));
    times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  size_t h = times.size() / 2;
  *median_s = times.size() % 2 ? times[h] : 0.5 * (times[h - 1] + times[h]);
  return UPF_OK;
}

upf_status upf_cuda_copy_bandwidth(size_t bytes, int reps, double *bytes_per_second) {
  *bytes_per_second = 0.0;
  if (bytes == 0 || reps < 1)
    return upf_fail(UPF_ERR_INVALID_ARG, "perf_support: copy bandwidth needs bytes > 0 and reps >= 1");
  void *src = nullptr, *dst = nullptr;
  upf_cuda_timer *timer = nullptr;
  double median = 0.0;
  upf_status st = UPF_OK;
  cudaError_t err = cudaMalloc(&src, bytes);
  if (err == cudaSuccess)
    err = cudaMalloc(&dst, bytes);
  if (err == cudaSuccess) /* commit the pages and give the copy defined data */
    err = cudaMemsetAsync(src, 0x3c, bytes, upf_cuda_stream());
  if (err != cudaSuccess)
    st = upf_fail(UPF_ERR_CUDA, "perf_support: allocating two %zu-byte copy buffers failed: %s", bytes,
                  cudaGetErrorString(err));
  if (st == UPF_OK)
    st = upf_cuda_timer_create(&timer);
  if (st == UPF_OK)
    st = time_copies(dst, src, bytes, reps, timer, &median);
  if (st == UPF_OK && !(median > 0.0))
    st = upf_fail(UPF_ERR_CUDA, "perf_support: a %zu-byte copy timed at %g s", bytes, median);
  if (st == UPF_OK)
    *bytes_per_second = 2.0 * (double)bytes / median;
  upf_cuda_timer_destroy(timer);
  cudaError_t free_src = src ? cudaFree(src) : cudaSuccess;
  cudaError_t free_dst = dst ? cudaFree(dst) : cudaSuccess;
  if (st == UPF_OK && (free_src != cudaSuccess || free_dst != cudaSuccess))
    st = upf_fail(UPF_ERR_CUDA, "perf_support: cudaFree of a copy buffer failed: %s",
                  cudaGetErrorString(free_src != cudaSuccess ? free_src : free_dst));
  return st;
}

} /* extern "C" */

extern "C" upf_status upf_cuda_gemm_bf16_nt(int64_t M, int64_t N, int64_t K, const void *A, const void *B, void *C) {
  UPF_TRY(upf_cuda_init());
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return upf_fail(UPF_ERR_UNSUPPORTED, "gemm ceiling: extent beyond int32 (%lld x %lld x %lld)", (long long)M,
                    (long long)N, (long long)K);
  cublasHandle_t h = upf_cuda_cublas();
  if (!h)
    return UPF_ERR_CUDA; /* upf_cuda_cublas recorded why */
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, B, CUDA_R_16BF,
                                         (int)K, A, CUDA_R_16BF, (int)K, &zero, C, CUDA_R_16BF, (int)N,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return upf_fail(UPF_ERR_CUDA, "gemm ceiling: cublasGemmEx failed: %s (%d)", cublasGetStatusString(st), (int)st);
  return UPF_OK;
}

struct upf_gemm_lt_plan {
  const upf_gemm_lt_choice *choice; /* owned by the lt-tuned variant's cache (cuda/gemm.cu) */
  const void *a, *b;
  void *c;
  int64_t M, K, N;
};

static float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Verify before timing: the chosen algorithm's c against cublasGemmEx's, element by element, within two
 * bf16 roundings of fp32 sums taken in another order (|d| <= 2^-7 (1 + |c|)). */
static upf_status lt_plan_check(const upf_gemm_lt_plan *p) {
  const size_t n = (size_t)p->M * (size_t)p->N;
  std::vector<uint16_t> want, got;
  try {
    want.resize(n), got.resize(n);
  } catch (const std::bad_alloc &) {
    return upf_fail(UPF_ERR_NOMEM, "perf_support: host copies of a %lld x %lld product", (long long)p->M,
                    (long long)p->N);
  }
  cublasHandle_t h = upf_cuda_cublas();
  if (!h)
    return UPF_ERR_CUDA;
  const float one = 1.0f, zero = 0.0f;
  UPF_CUBLAS_TRY(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)p->N, (int)p->M, (int)p->K, &one, p->b, CUDA_R_16BF,
                           (int)p->N, p->a, CUDA_R_16BF, (int)p->K, &zero, p->c, CUDA_R_16BF, (int)p->N,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  PERF_CUDA_TRY(cudaMemcpyAsync(want.data(), p->c, n * 2, cudaMemcpyDeviceToHost, upf_cuda_stream()));
  UPF_TRY(upf_cuda_gemm_lt_run(p->choice, p->a, p->b, p->c));
  PERF_CUDA_TRY(cudaMemcpyAsync(got.data(), p->c, n * 2, cudaMemcpyDeviceToHost, upf_cuda_stream()));
  PERF_CUDA_TRY(cudaStreamSynchronize(upf_cuda_stream()));
  for (size_t i = 0; i < n; i++) {
    const float w = bf16_bits_to_float(want[i]), g = bf16_bits_to_float(got[i]);
    if (!(fabsf(g - w) <= 0x1p-7f * (1.0f + fabsf(w))))
      return upf_fail(UPF_ERR_CUDA, "perf_support: the chosen cublasLt algorithm gives c[%zu] = %g, cublasGemmEx %g", i,
                      (double)g, (double)w);
  }
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gemm_lt_plan_create(int64_t M, int64_t K, int64_t N, const void *a, const void *b,
                                                   void *c, upf_gemm_lt_plan **plan) {
  *plan = nullptr;
  const upf_gemm_lt_choice *choice = nullptr;
  UPF_TRY(upf_cuda_gemm_lt_choose(a, K, b, N, c, N, M, K, N, UPF_DTYPE_BF16, &choice));
  if (!choice)
    return upf_fail(UPF_ERR_NOMEM, "perf_support: the lt-tuned cache is full");
  int algos = 0, rank = -1;
  double lt_s = 0.0, gemmex_s = 0.0;
  upf_cuda_gemm_lt_describe(choice, &algos, &rank, &lt_s, &gemmex_s);
  if (rank < 0)
    return upf_fail(UPF_ERR_CUDA, "perf_support: none of cublasLt's algorithms ran for %lld x %lld x %lld",
                    (long long)M, (long long)K, (long long)N);
  upf_gemm_lt_plan *p = new (std::nothrow) upf_gemm_lt_plan();
  if (!p)
    return upf_fail(UPF_ERR_NOMEM, "perf_support: gemm plan");
  p->choice = choice, p->a = a, p->b = b, p->c = c, p->M = M, p->K = K, p->N = N;
  upf_status st = lt_plan_check(p);
  if (st != UPF_OK) {
    delete p;
    return st;
  }
  *plan = p;
  return UPF_OK;
}

extern "C" upf_status upf_cuda_gemm_lt_plan_run(const upf_gemm_lt_plan *plan) {
  return upf_cuda_gemm_lt_run(plan->choice, plan->a, plan->b, plan->c);
}

extern "C" void upf_cuda_gemm_lt_plan_stats(const upf_gemm_lt_plan *plan, int *algos, int *best_rank, double *best_s,
                                            double *gemmex_s) {
  upf_cuda_gemm_lt_describe(plan->choice, algos, best_rank, best_s, gemmex_s);
}

extern "C" void upf_cuda_gemm_lt_plan_destroy(upf_gemm_lt_plan *plan) { delete plan; }
