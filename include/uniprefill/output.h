/* The one writer of every file the suite produces (.npy, GGUF, JSON records, token and mask dumps):
 * the outputs of a run form a set that lands together or not at all, and each target is treated by
 * the same rules whatever its format. */
#ifndef UNIPREFILL_OUTPUT_H
#define UNIPREFILL_OUTPUT_H

#include <stdio.h>

#include "uniprefill/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The rules, by what the path names when it is opened:
 * - nothing yet, or a regular file: the bytes go to a temporary in the same directory, renamed over
 *   the path at commit (a replaced file keeps its permission bits); a failed run leaves the old file;
 * - a symbolic link: followed; the file it names is replaced that way and the link kept;
 * - a FIFO or a character device (a pipe, /dev/stdout, /dev/null, /dev/full): written in place,
 *   never replaced; in a set of several outputs its bytes are staged in an unnamed temporary file and
 *   written at commit, after every other output is staged and before any rename;
 * - /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N: written through that descriptor at its
 *   offset (a shell's `>` or `>>` file is written, not replaced), staged like a device;
 * - a directory, a block device, a socket or a link to nothing: refused.
 * Messages name the output as "<what> <path>" (what: the flag, "--json"), or the path alone. */
typedef struct upf_outputs upf_outputs;

/* An empty set. `lone`: the set will hold one output, so a device or FIFO is written through at once
 * rather than staged (a GGUF export to a pipe needs no copy of itself on disk). */
upf_status upf_outputs_create(upf_outputs **out, int lone);

/* Opens the output `path` of the set: *f is the stream to write its bytes to (the set closes it).
 * Refuses a path whose target another output of the set already names. */
upf_status upf_outputs_open(upf_outputs *o, const char *path, const char *what, FILE **f);

/* Lands every output: each stream is flushed and closed (a write error fails the set), the staged
 * bytes of devices and FIFOs are written, then every temporary is renamed over its target. On a
 * failure every temporary left is removed, so no regular target has changed unless a rename itself
 * failed midway. The set is spent either way; free it. */
upf_status upf_outputs_commit(upf_outputs *o);

/* Frees the set; a set never committed has its temporaries removed. NULL is fine. */
void upf_outputs_free(upf_outputs *o);
/* The file `path` names, resolved through links, "." and "..": realpath of the path when it exists, else
 * realpath of its directory plus its last component (malloc'd). NULL when the directory does not exist
 * (errno says why). */
char *upf_path_canonical(const char *path);

/* Writes all n bytes to f: UPF_ERR_IO naming `what` and the reason on failure. */
upf_status upf_output_put(FILE *f, const void *bytes, size_t n, const char *what);

#ifdef __cplusplus
}
#endif
#endif
