/* The CLI side of tensor parallelism: --comm picks the communicator (auto: mpi when launched by
 * mpirun), --tp R must equal its size. Every rank checks the same facts, so a wrong --tp fails on
 * every rank with the same message, before any collective. */
#include <stdio.h>

#include "cli/cli.h"

int upf_cli_tp_open(const char *cmd, const char *kind, int32_t tp, const upf_backend *be, upf_comm **out) {
  *out = NULL;
  upf_comm *comm = NULL;
  const upf_status st = upf_comm_create(kind ? kind : "auto", be, NULL, &comm);
  if (st != UPF_OK) {
    char what[64];
    snprintf(what, sizeof what, "%s: --comm %s", cmd, kind ? kind : "auto");
    upf_cli_error(st, what);
    return 0;
  }
  const int32_t size = upf_comm_size(comm);
  if (tp != size) {
    fprintf(stderr,
            "upf %s: --tp %d, but the %s communicator has %d rank%s (rank %d here): launch with mpirun -np %d, or "
            "give --tp %d\n",
            cmd, tp, upf_comm_kind_name(upf_comm_kind_of(comm)), size, size == 1 ? "" : "s", upf_comm_rank(comm), tp,
            size);
    upf_comm_destroy(comm);
    return 0;
  }
  if (upf_comm_kind_of(comm) == UPF_COMM_SINGLE) /* one process, the plain path */
    upf_comm_destroy(comm);
  else
    *out = comm;
  return 1;
}
