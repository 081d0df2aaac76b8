/* Shared libraries that no binary links (libnccl, libcupti, the MPI plugin), opened at run time, so that
 * a machine without one fails only the feature that needs it, with the files tried named. */
#ifndef UNIPREFILL_CORE_DL_H
#define UNIPREFILL_CORE_DL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  void **slot; /* receives the symbol's address */
  const char *name;
} upf_dl_symbol;

/* The first of names[0, n) that dlopen opens with `flags` (NULL entries are skipped); NULL when none does,
 * with "name (dlerror's reason); ..." of each one tried in tried[0, cap). */
void *upf_dl_open_first(const char *const *names, size_t n, int flags, char *tried, size_t cap);
/* Fills every slot from lib: NULL when all resolve, else the name of the first that does not. */
const char *upf_dl_resolve(void *lib, const upf_dl_symbol *syms, size_t n);

#ifdef __cplusplus
}
#endif
#endif
