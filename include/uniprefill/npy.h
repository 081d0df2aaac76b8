/* NumPy .npy read and write (format versions 1.0, 2.0 and 3.0 headers; C order only).
 * Element types: '<f4' f32, '<f8' f64, '<i4' i32, '<i8' i64, '|u1' u8, '|b1' bool, and '<u2',
 * which the suite reads and writes as bf16 bit patterns. Malformed files give UPF_ERR_FORMAT with a
 * message that names the file and what is wrong; they never crash the reader. */
#ifndef UNIPREFILL_NPY_H
#define UNIPREFILL_NPY_H

#include <stdio.h>

#include "uniprefill/output.h"
#include "uniprefill/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads a whole .npy file into a newly allocated contiguous host tensor (free with
 * upf_tensor_free). On failure `out` is left empty (data NULL). */
upf_status upf_npy_read(const char *path, upf_tensor *out);

/* Parses an in-memory .npy image (the same rules as upf_npy_read). `what` names the source in
 * error messages. */
upf_status upf_npy_parse(const void *bytes, size_t size, const char *what, upf_tensor *out);

/* Writes a contiguous host tensor; picks format 1.0 unless the header needs 2.0. The file is an
 * output set of one (uniprefill/output.h): a new path or a regular file is written to a temporary
 * beside it and renamed into place, so a failed write never leaves a partial file; through a
 * symbolic link, the regular file it names is replaced that way and the link kept. A FIFO or
 * character device (a pipe, /dev/stdout) is written through in place, never replaced. A directory,
 * block device, socket or dangling link gives UPF_ERR_IO. */
upf_status upf_npy_write(const char *path, const upf_tensor *t);

/* The same as one output of the set o (landed by upf_outputs_commit with the others); `what` names
 * the output in messages (the flag, "--out-logits"; NULL for the path alone). */
upf_status upf_npy_write_to(upf_outputs *o, const char *path, const char *what, const upf_tensor *t);

/* The .npy image of t (header, then data) to an open stream; `what` names it in messages. */
upf_status upf_npy_write_stream(FILE *f, const char *what, const upf_tensor *t);

#ifdef __cplusplus
}
#endif
#endif
