/* The backend ops table. layers/, models/, verify/ and perf/ are written once against this table,
 * so the same code runs on the CPU reference and on CUDA and can be compared whole. Every pointer
 * an entry takes lives in that backend's memory (host for cpu, device for cuda). The op entries are
 * generated from uniprefill/ops.def (be->gemm, be->select_run, ...). */
#ifndef UNIPREFILL_BACKEND_H
#define UNIPREFILL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "uniprefill/attn.h"
#include "uniprefill/compact_attn.h"
#include "uniprefill/dense.h"
#include "uniprefill/gdn.h"
#include "uniprefill/kv.h"
#include "uniprefill/moe.h"
#include "uniprefill/select.h"
#include "uniprefill/sparse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct upf_backend {
  const char *name; /* "cpu", "cuda" */

  /* UPF_OK when usable here; otherwise UPF_ERR_NO_DEVICE / UPF_ERR_UNSUPPORTED with the reason. */
  upf_status (*probe)(void);
  /* One line naming the device ("NVIDIA H200, driver 580.x, CUDA 13.0"), "" if unknown. */
  const char *(*describe)(void);

  upf_status (*alloc)(void **ptr, size_t bytes);
  void (*release)(void *ptr);
  upf_status (*upload)(void *dst, const void *src, size_t bytes);   /* host -> backend */
  upf_status (*download)(void *dst, const void *src, size_t bytes); /* backend -> host */
  upf_status (*fill)(void *dst, int byte, size_t bytes);
  upf_status (*synchronize)(void);
  /* Timing that leaves the host free to run ahead: a mark is a point in the backend's order of work (a
   * CUDA event on its stream; on the CPU, whose ops return when done, the clock). mark_elapsed waits
   * for `end` to be reached and gives the seconds from `start` to `end`. */
  upf_status (*mark_create)(void **mark);
  void (*mark_destroy)(void *mark);
  upf_status (*mark_record)(void *mark);
  upf_status (*mark_elapsed)(void *start, void *end, double *seconds);

  /* One entry per op of the op table; ops.def says what each computes, with its shapes. */
#define UPF_OP(id, name, summary, entry, params) upf_status(*entry) params;
#include "uniprefill/ops.def"
#undef UPF_OP
} upf_backend;

const upf_backend *upf_backend_cpu(void);
/* Always returns the table; in a CUDA=0 build every entry fails with UPF_ERR_UNSUPPORTED.
 * Setting UPF_BACKENDS=cpu in the environment makes probe() fail without touching CUDA. */
const upf_backend *upf_backend_cuda(void);
/* "cpu" or "cuda"; NULL (with a message) for anything else. */
const upf_backend *upf_backend_by_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif
