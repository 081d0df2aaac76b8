/* A timeline of the GPU's work: every kernel, copy and fill the device ran between a start and a stop,
 * with its device timestamps (CUPTI's activity records, read through libcupti opened at run time), and
 * the breakdown a kernel engineer asks of a whole prefill: how long the GPU was busy and idle over the
 * window, the time of each kind of kernel (cuBLAS GEMMs, attention, norms, ...), and the gaps between
 * kernels by length (launch gaps of a few microseconds against host waits). The timeline also writes as a
 * Chrome trace (chrome://tracing, ui.perfetto.dev). nsys does this and more; this needs nothing on the
 * machine but the CUDA toolkit's libcupti, and lands in the run's JSON record. */
#ifndef UNIPREFILL_TIMELINE_H
#define UNIPREFILL_TIMELINE_H

#include <stdint.h>
#include <stdio.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { UPF_TIMELINE_KERNEL, UPF_TIMELINE_MEMCPY, UPF_TIMELINE_MEMSET } upf_timeline_kind;

typedef struct {
  upf_timeline_kind kind;
  const char *name; /* a kernel's name as the driver gives it (mangled for C++), owned by the timeline;
                       copies and fills: "memcpy" / "memset" */
  uint64_t start_ns, end_ns; /* device timestamps, end >= start */
  uint32_t stream;
  uint32_t grid[3], block[3]; /* kernels */
  uint64_t bytes;             /* copies and fills */
} upf_timeline_event;

typedef struct {
  upf_timeline_event *events; /* in ascending start order */
  int64_t count;
  int64_t dropped; /* records CUPTI or the timeline's bound could not keep; the breakdown says so */
  char **names;    /* the distinct kernel names the events point at */
  int64_t num_names;
} upf_timeline;

/* Starts recording the device's kernels, copies and fills (CUDA builds: libcupti from $UPF_CUPTI_LIB,
 * the loader's path or the toolkit the build used). UPF_ERR_UNSUPPORTED in a build without CUDA or
 * where libcupti cannot be opened (the message says which files were tried); UPF_ERR_INVALID_ARG when
 * a recording is already running. */
upf_status upf_timeline_start(void);
/* What upf_timeline_start would find, without starting: UPF_OK where a recording can start (libcupti opens
 * and its release matches the build's), else its failure; for checking before a long run. */
upf_status upf_timeline_probe(void);
/* Waits for the device, stops recording and hands over what was recorded since the start. */
upf_status upf_timeline_stop(upf_timeline *out);
void upf_timeline_free(upf_timeline *t);

/* An event's kind of work for the breakdown ("GEMM (cuBLAS)", "attention", "norms", ..., "other"), from
 * its kernel's name (the suite's kernel names and cuBLAS's); copies and fills are "copies and fills". */
const char *upf_timeline_category(const upf_timeline_event *e);
/* A readable kernel name: the function's own identifier of a mangled C++ name ("bs_wgmma_kernel" of
 * "_ZN10upf_bsattn...15bs_wgmma_kernelILi128E..."), the name itself otherwise; truncated to fit n. */
void upf_timeline_short_name(const char *name, char *buf, size_t n);

#define UPF_TIMELINE_MAX_CATEGORIES 16
#define UPF_TIMELINE_TOP_GAPS 5
/* Gaps by length: under 10 us (launch latency between back-to-back kernels), 10 us to 1 ms (the host
 * late: a launch after host work, a small wait), over 1 ms (the host waiting for the device). */
#define UPF_TIMELINE_GAP_CLASSES 3
extern const double upf_timeline_gap_bounds_us[UPF_TIMELINE_GAP_CLASSES - 1];

/* The window opens at the first kernel: copies and fills before it (a run's upload of its inputs, before
 * its timer starts, and the host's time between them) are counted apart as the lead. Without a kernel,
 * the window opens at the first event. */
typedef struct {
  int64_t lead_events; /* copies and fills before the first kernel */
  double lead_ms;      /* from the first of them to the first kernel's start */
  double window_ms;    /* the first kernel's start to the last end */
  double busy_ms;    /* time some event ran (the union of the intervals) */
  double idle_ms;    /* window - busy: nothing ran */
  double overlap_ms; /* sum of the events' durations - busy: work that ran beside other work */
  int64_t kernels, copies, dropped;
  int32_t streams;
  int32_t num_categories; /* by time, largest first */
  struct {
    const char *name;
    double ms;
    int64_t count;
  } categories[UPF_TIMELINE_MAX_CATEGORIES];
  int64_t gaps; /* idle intervals between events */
  int64_t gap_count[UPF_TIMELINE_GAP_CLASSES];
  double gap_ms[UPF_TIMELINE_GAP_CLASSES];
  int32_t num_top_gaps; /* the longest gaps, longest first: from ms after the window's start, the
                           event that ended last before it and the first one after it (indices into
                           the timeline's events) */
  struct {
    double at_ms, ms;
    int64_t before, after; /* event indices */
  } top_gaps[UPF_TIMELINE_TOP_GAPS];
} upf_timeline_summary;

/* The breakdown of t. UPF_ERR_INVALID_ARG for events out of start order or ending before they start. */
upf_status upf_timeline_summarize(const upf_timeline *t, upf_timeline_summary *s);
/* The breakdown as lines on f, each starting with `indent`. */
void upf_timeline_print(FILE *f, const char *indent, const upf_timeline *t, const upf_timeline_summary *s);
/* The breakdown as one JSON object (no trailing newline). */
void upf_timeline_summary_json(FILE *f, const upf_timeline *t, const upf_timeline_summary *s);
/* The events as a Chrome trace (JSON object format: "X" events in microseconds from the window's start, a
 * row a stream, the category and the kernel's grid, block and full name as args). `what` names the output
 * in messages; UPF_ERR_IO on a write error. */
upf_status upf_timeline_write_chrome(FILE *f, const upf_timeline *t, const char *what);

#ifdef __cplusplus
}
#endif
#endif
