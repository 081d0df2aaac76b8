/* C interface to Google Benchmark for the benchmark suite: benchmarks are C callbacks that register
 * here, run under the usual --benchmark_* flags, and get their results back as plain structs.
 * perf/bench.cc is the glue (the suite's only C++ file). Also declares the benchmark families and
 * the registry that lists them (perf/bench_registry.c). */
#ifndef UNIPREFILL_PERF_BENCH_H
#define UNIPREFILL_PERF_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/ops.h"
#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Registering ---- */

/* Handed to a callback for one run (one repetition) of its benchmark. */
typedef struct upf_bench_state upf_bench_state;

/* A benchmark. It must either loop `while (upf_bench_keep_running(st))` until that returns 0, or
 * call upf_bench_skip_with_error and return (breaking out of the loop is fine after the skip). */
typedef void (*upf_bench_fn)(upf_bench_state *st, void *ctx);

enum {
  /* The callback times each iteration itself (device events) and reports it with
   * upf_bench_set_iteration_time; rates are per second of that time. */
  UPF_BENCH_MANUAL_TIME = 1u << 0,
  /* Wall clock instead of this thread's CPU time: the CPU reference runs a multi-threaded BLAS. */
  UPF_BENCH_REAL_TIME = 1u << 1,
};

typedef enum { UPF_BENCH_NS = 0, UPF_BENCH_US, UPF_BENCH_MS, UPF_BENCH_S } upf_bench_unit;

#define UPF_BENCH_MAX_ARGS 4

typedef struct {
  const char *name;             /* family, e.g. "select/cuda/bf16"; each arg appends "/name:value" */
  upf_bench_fn fn;
  void *ctx;                    /* passed to fn and teardown; must outlive upf_bench_run */
  void (*teardown)(void *ctx);  /* NULL, or called once after all benchmarks ran: frees what fn cached */
  unsigned flags;               /* UPF_BENCH_MANUAL_TIME / UPF_BENCH_REAL_TIME */
  upf_bench_unit unit;          /* display unit of times */
  int64_t iterations;           /* > 0: exactly this many iterations per run (slow CPU cases) */
  double min_time_s;            /* > 0 (and iterations 0): Google Benchmark's minimum time per run */
  int repetitions;              /* runs whose median/spread/min are reported; 0 means 1.
                                   --benchmark_repetitions on the command line overrides it */
  int num_args;
  int64_t args[UPF_BENCH_MAX_ARGS];           /* read back with upf_bench_arg */
  const char *arg_names[UPF_BENCH_MAX_ARGS];  /* NULL: the value alone appears in the name */
} upf_bench_spec;

/* Copies the spec; the benchmark is handed to Google Benchmark by upf_bench_run. Fails with
 * UPF_ERR_INVALID_ARG on a missing name/fn, too many args, or a name already registered. */
upf_status upf_bench_register(const upf_bench_spec *spec);

/* Key/value pairs for the "context" section of the JSON output and the console header (GPU,
 * driver, commit, command line). Call before upf_bench_run. */
void upf_bench_add_context(const char *key, const char *value);

/* ---- Inside a callback ---- */

int upf_bench_keep_running(upf_bench_state *st);
int64_t upf_bench_arg(const upf_bench_state *st, int index);
/* Iterations of the current run so far (the total once the loop is over). */
int64_t upf_bench_iterations(const upf_bench_state *st);
/* Manual time of the iteration just finished, in seconds (UPF_BENCH_MANUAL_TIME only). */
void upf_bench_set_iteration_time(upf_bench_state *st, double seconds);

/* Marks the benchmark failed with a message (printf-style); it is reported, not timed. */
void upf_bench_skip_with_error(upf_bench_state *st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* The message that marks "this machine has no device for it": such skips do not fail a run. */
#define UPF_BENCH_NO_DEVICE "no CUDA device: "
/* upf_bench_skip_with_error(st, UPF_BENCH_NO_DEVICE "%s", reason). */
void upf_bench_skip_no_device(upf_bench_state *st, const char *reason);

typedef enum {
  UPF_BENCH_COUNTER_VALUE = 0, /* reported as given (shares, fractions, sizes) */
  UPF_BENCH_COUNTER_RATE,      /* an amount per iteration (bytes, FLOPs), reported per second of
                                  measured time: value * iterations / seconds */
} upf_bench_counter_kind;

/* Set after the loop (a rate needs the final iteration count). */
void upf_bench_set_counter(upf_bench_state *st, const char *name, double value, upf_bench_counter_kind kind);
void upf_bench_set_label(upf_bench_state *st, const char *label);

/* ---- Shared timing of the benchmark families ---- */

/* Fills the timing fields of a spec. Device-timed (on_cuda): manual time in us, min_time_s per run,
 * cuda_repetitions runs where a CUDA device is usable and one elsewhere (so the skip prints once).
 * CPU: wall clock in ms, exactly cpu_iterations iterations, 3 runs. */
void upf_bench_spec_timing(upf_bench_spec *spec, int on_cuda, double min_time_s, int cuda_repetitions,
                           int64_t cpu_iterations);

typedef struct {
  double total_s;     /* device time of the timed iterations */
  int64_t iterations; /* timed iterations */
} upf_bench_timing;

/* Times call(arg) once per benchmark iteration on the CUDA backend's stream: `warmup` untimed calls,
 * then each call between two device events. When working_bytes is under three L2 sizes, an untimed
 * L2 flush is enqueued before each start event, so memory-bound cases read from HBM. Returns the
 * first failing status (the caller skips the benchmark with its message); UPF_ERR_UNSUPPORTED in a
 * CUDA=0 build. */
upf_status upf_bench_time_cuda(upf_bench_state *st, upf_status (*call)(void *arg), void *arg, int warmup,
                               double working_bytes, upf_bench_timing *timing);

/* The median of v[0..n) (the upper one of an even n; NAN when n is 0); sorts v in place. */
double upf_bench_median(double *v, int n);

/* The median device time of call(arg) in its steady state: call back to back on the backend's
 * stream for warm_s of device time, then `reps` (1..UPF_BENCH_STEADY_MAX_REPS) calls each between two
 * device events. A GEMM timed after idle runs at boost clocks, up to 17% faster than under sustained
 * load; the ceilings that rates are compared with are taken in the sustained state. */
#define UPF_BENCH_STEADY_MAX_REPS 256
upf_status upf_bench_steady_median(upf_status (*call)(void *arg), void *arg, double warm_s, int reps,
                                   double *median_s);

/* The CUDA backend's copy bandwidth (bytes read + written per second, a 1 GiB device-to-device copy,
 * 20 repetitions), measured once per process and shared by every family's bandwidth shares. */
upf_status upf_bench_copy_ceiling(double *bytes_per_second);

/* Whether the quick verify set of `op` passes on the CUDA backend against the CPU
 * reference; run once per op and process, so that an unverified kernel is never timed. When it does
 * not, `why` says how many checks failed and how to see them. */
int upf_bench_op_verified(upf_op op, char *why, size_t cap);

/* ---- Running ---- */

typedef struct {
  char *name;   /* counter name */
  double value; /* median over repetitions (rates are already per second) */
} upf_bench_counter;

typedef struct {
  char *name;          /* registered name with args, "select/cuda/bf16/T:8192" */
  char *run_name;      /* Google Benchmark's name (adds repeats/manual_time), as in the JSON */
  char *label;         /* "" when none */
  char *error;         /* NULL when it ran; otherwise the skip message */
  int no_device;       /* error starts with UPF_BENCH_NO_DEVICE */
  int64_t iterations;  /* per run */
  int64_t repetitions; /* runs summarised */
  double median_s;     /* seconds per iteration: median over repetitions */
  double mean_s;
  double stddev_s;     /* spread; 0 with one repetition */
  double cv;           /* stddev / mean, a fraction */
  double min_s;
  int num_counters;
  upf_bench_counter *counters;
} upf_bench_result;

/* Runs the registered benchmarks under Google Benchmark with these command-line arguments
 * (--benchmark_filter, --benchmark_out=FILE --benchmark_out_format=json, --benchmark_repetitions,
 * ...; argv[0] is the program), printing its usual console output, and returns one result per
 * benchmark that ran, in run order (free with upf_bench_results_free). Registrations are consumed:
 * teardowns run and the list is empty afterwards. UPF_ERR_INVALID_ARG on an unknown argument. */
upf_status upf_bench_run(int argc, char **argv, upf_bench_result **results, int *count);
void upf_bench_results_free(upf_bench_result *results, int count);

/* A counter of a result by name; NaN when it has none. */
double upf_bench_result_counter(const upf_bench_result *result, const char *name);

/* ---- Benchmark families and their registry ---- */

/* Counter names shared by the families and the summary table of bench_main. */
#define UPF_BENCH_FLOPS "flop_per_second"
#define UPF_BENCH_BYTES "bytes_per_second"
#define UPF_BENCH_COPY_SHARE "copy_bw_share" /* bytes_per_second / measured device copy bandwidth */
#define UPF_BENCH_CUBLAS_SHARE "cublas_share" /* flop_per_second / measured cuBLAS bf16 GEMM rate */

/* perf/bench_select.c: "copy_bandwidth" (the ceiling) and select/... (backend->select_run). */
void upf_register_select_benchmarks(void);
/* perf/bench_dense.c: "gemm_ceiling" (the cuBLAS ceiling), gemm/ffn/act_mul/rmsnorm/.../logits_last
 * on cpu and cuda at Llama-3.1-8B, Gemma-3-12B and Qwen3-Next shapes. */
void upf_register_dense_benchmarks(void);
/* perf/bench_moe.c: moe.ffn (Qwen3-Next, cuda per expert-GEMM variant, cpu small) and moe.dense_equiv. */
void upf_register_moe_benchmarks(void);
/* perf/bench_gdn.c: gdn.scan at Qwen3-Next shapes (prefill 4K/32K, ragged, decode) on cuda, cpu small. */
void upf_register_gdn_benchmarks(void);
/* Attention: prefill (causal, sliding window, cached), paged decode, cache write (perf/bench_attn.c). */
void upf_register_attn_benchmarks(void);
/* perf/bench_kv.c: kv.slot_mapping and compact.scatter_rows (cuda at Llama-3.1-8B / Qwen3-Next serving
 * shapes, cpu small) and session.decode_step (a session's decode step of B requests at a context, cuda). */
void upf_register_kv_benchmarks(void);
/* perf/bench_sparse.c: FlashPrefill V2's sparse.block_means, sparse.index, attn.block_sparse (vs dense). */
void upf_register_sparse_benchmarks(void);
/* perf/bench_compact.c: CompactAttention on a chunked prefill's last chunk: compact.block_union,
 * compact.block_tables, the selector, and chunk attention dense vs zero-copy vs copy (kept share, vs_limit). */
void upf_register_compact_benchmarks(void);

/* perf/bench_registry.c: every family above; a new op's benchmarks add one line there. */
void upf_register_all_benchmarks(void);

#ifdef __cplusplus
}
#endif
#endif
