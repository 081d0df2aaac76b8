/* Status names and the thread-local message of the last failing call. */
#include "uniprefill/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define UPF_MESSAGE_CAP 1024

static _Thread_local char upf_message[UPF_MESSAGE_CAP];

const char *upf_status_name(upf_status status) {
  static const char *const names[UPF_STATUS_COUNT] = {
      [UPF_OK] = "UPF_OK",
      [UPF_ERR_INVALID_ARG] = "UPF_ERR_INVALID_ARG",
      [UPF_ERR_SHAPE] = "UPF_ERR_SHAPE",
      [UPF_ERR_DTYPE] = "UPF_ERR_DTYPE",
      [UPF_ERR_CU_SEQLENS] = "UPF_ERR_CU_SEQLENS",
      [UPF_ERR_NONFINITE] = "UPF_ERR_NONFINITE",
      [UPF_ERR_IO] = "UPF_ERR_IO",
      [UPF_ERR_FORMAT] = "UPF_ERR_FORMAT",
      [UPF_ERR_NOMEM] = "UPF_ERR_NOMEM",
      [UPF_ERR_CUDA] = "UPF_ERR_CUDA",
      [UPF_ERR_NO_DEVICE] = "UPF_ERR_NO_DEVICE",
      [UPF_ERR_UNSUPPORTED] = "UPF_ERR_UNSUPPORTED",
      [UPF_ERR_COMM] = "UPF_ERR_COMM",
  };
  if ((unsigned)status >= UPF_STATUS_COUNT)
    return "UPF_ERR_UNKNOWN";
  return names[status];
}

const char *upf_last_error(void) { return upf_message; }

void upf_clear_error(void) { upf_message[0] = '\0'; }

upf_status upf_fail(upf_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(upf_message, sizeof upf_message, fmt, ap);
  va_end(ap);
  return status;
}

upf_status upf_fail_context(upf_status status, const char *context) {
  char previous[UPF_MESSAGE_CAP];
  memcpy(previous, upf_message, sizeof previous);
  snprintf(upf_message, sizeof upf_message, "%s%s", context, previous);
  return status;
}
