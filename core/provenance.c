#include "uniprefill/provenance.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* First line a shell command prints, without the newline; "" when it prints nothing or fails. */
static void first_line_of(const char *cmd, char *buf, size_t cap) {
  buf[0] = '\0';
  FILE *p = popen(cmd, "r");
  if (!p)
    return;
  if (!fgets(buf, (int)cap, p))
    buf[0] = '\0';
  buf[strcspn(buf, "\n")] = '\0';
  if (pclose(p) != 0)
    buf[0] = '\0';
}

int upf_source_commit(char *buf, size_t cap) {
  if (cap == 0)
    return 0;
  const char *env = getenv("UPF_COMMIT");
  if (env && *env) { /* the caller knows the binaries' commit (a staged bundle run from another checkout) */
    snprintf(buf, cap, "%s", env);
    return 1;
  }
  first_line_of("git rev-parse --short HEAD 2>/dev/null", buf, cap);
  if (buf[0]) {
    char dirty[8];
    first_line_of("git status --porcelain --untracked-files=no 2>/dev/null | head -c 1", dirty, sizeof dirty);
    if (dirty[0] && strlen(buf) + 7 < cap)
      strcat(buf, "-dirty");
    return 1;
  }
  return 0;
}
