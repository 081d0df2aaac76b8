#include "uniprefill/env.h"

#include <stdlib.h>
#include <string.h>

upf_status upf_env_choice(const char *name, const char *const *choices, int count, int fallback, int *index) {
  const char *value = getenv(name);
  if (!value || !*value) {
    *index = fallback;
    return UPF_OK;
  }
  for (int i = 0; i < count; i++)
    if (strcmp(value, choices[i]) == 0) {
      *index = i;
      return UPF_OK;
    }
  char accepted[256] = "";
  size_t used = 0;
  for (int i = 0; i < count && used + 1 < sizeof accepted; i++) {
    size_t len = strlen(choices[i]);
    if (used + len + 3 >= sizeof accepted)
      break;
    if (i > 0)
      accepted[used++] = '|';
    memcpy(accepted + used, choices[i], len);
    used += len;
    accepted[used] = '\0';
  }
  return upf_fail(UPF_ERR_INVALID_ARG, "%s=%.64s: unknown value (accepted: %s, or unset for %s)", name, value,
                  accepted, choices[fallback]);
}
