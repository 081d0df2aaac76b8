/* Status codes and the per-call error message.
 * Library code never prints or exits: it returns a upf_status and, on failure, leaves a message
 * naming the offending input in a thread-local buffer read with upf_last_error(). */
#ifndef UNIPREFILL_STATUS_H
#define UNIPREFILL_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  UPF_OK = 0,
  UPF_ERR_INVALID_ARG,  /* a parameter out of range (p, block size, sink, ...) */
  UPF_ERR_SHAPE,        /* tensor shapes disagree or are not what the op takes */
  UPF_ERR_DTYPE,        /* unsupported or mismatched element type */
  UPF_ERR_CU_SEQLENS,   /* cu_seqlens not starting at 0, not monotone, or not ending at T */
  UPF_ERR_NONFINITE,    /* NaN or Inf in an input */
  UPF_ERR_IO,           /* a file could not be opened, read or written */
  UPF_ERR_FORMAT,       /* a file is malformed (bad .npy header, truncated data, ...) */
  UPF_ERR_NOMEM,        /* host or device allocation failed */
  UPF_ERR_CUDA,         /* a CUDA runtime, driver or cuBLAS call failed */
  UPF_ERR_NO_DEVICE,    /* the backend is not available on this machine */
  UPF_ERR_UNSUPPORTED,  /* valid input this build cannot run (e.g. CUDA=0 build) */
  UPF_ERR_COMM,         /* a collective failed: ranks disagree, a rank timed out, MPI/NCCL error */
  UPF_STATUS_COUNT
} upf_status;

/* Stable upper-case name of a status, e.g. "UPF_ERR_SHAPE". */
const char *upf_status_name(upf_status status);

/* Message of the most recent failing call on this thread ("" if none). */
const char *upf_last_error(void);

/* Records a printf-style message for this thread and returns `status`, so that library code can
 * write `return upf_fail(UPF_ERR_SHAPE, "q: expected 3 dims, got %d", nd);`. */
upf_status upf_fail(upf_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prefixes the current message with context ("select: " + message) and returns `status`. */
upf_status upf_fail_context(upf_status status, const char *context);

void upf_clear_error(void);

#define UPF_TRY(expr)                      \
  do {                                     \
    upf_status upf_try_status_ = (expr);   \
    if (upf_try_status_ != UPF_OK)         \
      return upf_try_status_;              \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
