/* Kernel-variant switches read from the environment (UPF_GDN_*, UPF_MOE_*; the list is README's "Kernel
 * variants"). */
#ifndef UNIPREFILL_ENV_H
#define UNIPREFILL_ENV_H

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The index in `choices` (count entries) of environment variable `name`'s value; unset or empty gives
 * `fallback`. Any other value fails with UPF_ERR_INVALID_ARG and a message that names the variable,
 * the value and the accepted ones, so that a mistyped switch never runs (and times) the default under
 * the variant's name. `*index` is written only on success. */
upf_status upf_env_choice(const char *name, const char *const *choices, int count, int fallback, int *index);

/* upf_env_choice read once per process: *cache (a static set to -1 by the caller) keeps the index after
 * the first success, and a bad value fails again on every call. Concurrent first calls at worst read
 * the variable twice and store the same index. */
static inline upf_status upf_env_choice_once(const char *name, const char *const *choices, int count, int fallback,
                                             int *cache, int *index) {
  if (*cache < 0) {
    int i = 0;
    upf_status s = upf_env_choice(name, choices, count, fallback, &i);
    if (s != UPF_OK)
      return s;
    *cache = i;
  }
  *index = *cache;
  return UPF_OK;
}

#ifdef __cplusplus
}
#endif

#endif
