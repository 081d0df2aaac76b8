/* Where a result came from: the source commit that `upf report` and the benchmark JSON are stamped
 * with. */
#ifndef UNIPREFILL_PROVENANCE_H
#define UNIPREFILL_PROVENANCE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* $UPF_COMMIT when set (perf/device.sh sets it to the staged bundle's commit: the binaries' source,
 * whatever checkout they run in); else the commit of the git checkout the process runs in (`git
 * rev-parse --short HEAD`), with "-dirty" appended when tracked files differ from it (numbers then
 * cannot be reproduced from the hash alone). Returns 0 with buf "" when neither is known. */
int upf_source_commit(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
