/* core/dl.h: the candidate list and the symbol table of a library opened at run time. */
#include "core/dl.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

void *upf_dl_open_first(const char *const *names, size_t n, int flags, char *tried, size_t cap) {
  if (cap)
    tried[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    if (!names[i])
      continue;
    void *lib = dlopen(names[i], flags);
    if (lib)
      return lib;
    const size_t used = strlen(tried);
    const char *why = dlerror();
    if (used + 1 < cap)
      snprintf(tried + used, cap - used, "%s%s (%s)", used ? "; " : "", names[i], why ? why : "not opened");
  }
  return NULL;
}

const char *upf_dl_resolve(void *lib, const upf_dl_symbol *syms, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!(*syms[i].slot = dlsym(lib, syms[i].name)))
      return syms[i].name;
  return NULL;
}
