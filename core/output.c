/* The output set (include/uniprefill/output.h): every output staged to a temporary beside its target
 * (or, for a device or FIFO, to an unnamed temporary file), then all landed at commit, so a run that
 * fails halfway leaves none of its outputs behind and never replaces a device node with a file. */
#include "uniprefill/output.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
  char *label;  /* "--json r.json" or "r.json": the output in messages */
  char *target; /* the path written: renamed over, or opened in place */
  char *canon;  /* the target resolved through links and ".." (finds two outputs naming one file) */
  char *tmp;    /* the temporary renamed over target at commit; NULL for a device or once renamed */
  FILE *f;      /* the stream the caller writes; NULL once closed */
  int device;   /* FIFO or character device: written in place */
  int staged;   /* a device whose bytes wait in f (an unnamed temporary) until commit */
  int fd;       /* >= 0: the path names this process's descriptor (/dev/stdout): written through it */
} out_entry;

struct upf_outputs {
  out_entry *e;
  int n, cap;
  int lone;
  int spent; /* committed or failed at commit: no more opens */
};

upf_status upf_outputs_create(upf_outputs **out, int lone) {
  *out = calloc(1, sizeof **out);
  if (!*out)
    return upf_fail(UPF_ERR_NOMEM, "outputs: out of memory");
  (*out)->lone = lone;
  return UPF_OK;
}

static const char *file_kind(mode_t m) {
  return S_ISDIR(m) ? "a directory" : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

char *upf_path_canonical(const char *path) {
  char *whole = realpath(path, NULL);
  if (whole)
    return whole;
  const char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
  char *rdir = dir ? realpath(dir, NULL) : NULL;
  const int saved = errno;
  free(dir);
  if (!rdir) {
    errno = saved;
    return NULL;
  }
  size_t len = strlen(rdir) + strlen(base) + 2;
  char *s = malloc(len);
  if (s)
    snprintf(s, len, "%s/%s", strcmp(rdir, "/") ? rdir : "", base);
  free(rdir);
  return s;
}

static mode_t creation_mode(void) {
  /* what open(O_CREAT, 0666) would give; mkstemp makes 0600 */
  const mode_t mask = umask(0);
  umask(mask);
  return 0666 & ~mask;
}

/* A temporary beside target: hidden, with a short name (a long target name plus a suffix could pass
 * NAME_MAX). */
static upf_status make_temp(const out_entry *e, int *fd, char **tmp) {
  const char *slash = strrchr(e->target, '/');
  const char *base = slash ? slash + 1 : e->target;
  const int dir_len = slash ? (int)(slash - e->target) + 1 : 0;
  const size_t cap = (size_t)dir_len + 64 + 16;
  char *s = malloc(cap);
  if (!s)
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", e->label);
  snprintf(s, cap, "%.*s.%.48s.upf-XXXXXX", dir_len, e->target, base);
  *fd = mkstemp(s);
  if (*fd < 0) {
    const int err = errno;
    free(s);
    return upf_fail(UPF_ERR_IO, "%s: cannot create a temporary file beside it: %s", e->label, strerror(err));
  }
  *tmp = s;
  return UPF_OK;
}

/* The descriptor a path names: /dev/stdout, /dev/stderr, /dev/fd/N or /proc/self/fd/N; else -1.
 * Such a path is a link to whatever the descriptor holds (a terminal, a pipe, or the file a shell
 * redirected to): its bytes go through the descriptor, at its offset, as `>` and `>>` expect. */
static int named_fd(const char *path) {
  if (!strcmp(path, "/dev/stdout"))
    return 1;
  if (!strcmp(path, "/dev/stderr"))
    return 2;
  const char *num = !strncmp(path, "/dev/fd/", 8) ? path + 8 : !strncmp(path, "/proc/self/fd/", 14) ? path + 14 : NULL;
  if (!num || !*num)
    return -1;
  char *end;
  const long v = strtol(num, &end, 10);
  return *end || v < 0 || v > INT_MAX ? -1 : (int)v;
}

static upf_status resolve(out_entry *e, const char *path, mode_t *mode, int *keep_mode) {
  struct stat ls, st;
  *keep_mode = 0;
  e->fd = named_fd(path);
  if (e->fd >= 0) {
    if (fstat(e->fd, &st) != 0)
      return upf_fail(UPF_ERR_IO, "%s: descriptor %d is not open: %s", e->label, e->fd, strerror(errno));
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !S_ISCHR(st.st_mode) && !S_ISSOCK(st.st_mode))
      return upf_fail(UPF_ERR_IO, "%s: descriptor %d is %s; refusing to write to it", e->label, e->fd,
                      file_kind(st.st_mode));
    e->device = 1;
    e->target = strdup(path);
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", e->fd);
    e->canon = realpath(self, NULL);
    if (!e->canon)
      e->canon = strdup(path);
    return e->target && e->canon ? UPF_OK : upf_fail(UPF_ERR_NOMEM, "%s: out of memory", e->label);
  }
  if (lstat(path, &ls) != 0) {
    if (errno != ENOENT)
      return upf_fail(UPF_ERR_IO, "%s: cannot examine the output path: %s", e->label, strerror(errno));
    e->target = strdup(path);
  } else {
    const int is_link = S_ISLNK(ls.st_mode);
    if (is_link && stat(path, &st) != 0)
      return upf_fail(UPF_ERR_IO, "%s: a symbolic link that leads nowhere (%s); not writing through it", e->label,
                      strerror(errno));
    if (!is_link)
      st = ls;
    if (S_ISREG(st.st_mode)) {
      e->target = is_link ? realpath(path, NULL) : strdup(path);
      *keep_mode = 1, *mode = st.st_mode & 07777;
      if (!e->target && is_link)
        return upf_fail(UPF_ERR_IO, "%s: cannot resolve the symbolic link: %s", e->label, strerror(errno));
    } else if (S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode)) {
      e->target = strdup(path);
      e->device = 1;
    } else {
      return upf_fail(UPF_ERR_IO, "%s: the output path is %s%s; refusing to replace it", e->label,
                      is_link ? "a symbolic link to " : "", file_kind(st.st_mode));
    }
  }
  if (!e->target)
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", e->label);
  if (!(e->canon = upf_path_canonical(e->target)))
    return upf_fail(UPF_ERR_IO, "%s: its directory does not exist or cannot be searched: %s", e->label,
                    strerror(errno));
  return UPF_OK;
}

upf_status upf_outputs_open(upf_outputs *o, const char *path, const char *what, FILE **f) {
  *f = NULL;
  if (!o || !path || !*path)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s: an output needs a path", what ? what : "outputs");
  if (o->spent)
    return upf_fail(UPF_ERR_INVALID_ARG, "%s %s: the output set was already committed", what ? what : "", path);
  if (o->n == o->cap) {
    const int cap = o->cap ? 2 * o->cap : 8;
    out_entry *e = realloc(o->e, (size_t)cap * sizeof *e);
    if (!e)
      return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", path);
    o->e = e, o->cap = cap;
  }
  out_entry *e = &o->e[o->n];
  memset(e, 0, sizeof *e);
  e->fd = -1;
  const size_t len = strlen(path) + (what ? strlen(what) + 2 : 1);
  if (!(e->label = malloc(len)))
    return upf_fail(UPF_ERR_NOMEM, "%s: out of memory", path);
  snprintf(e->label, len, "%s%s%s", what ? what : "", what ? " " : "", path);
  o->n++; /* from here the entry is the set's: freed (and its temporary removed) with it */
  mode_t mode = 0;
  int keep_mode = 0;
  UPF_TRY(resolve(e, path, &mode, &keep_mode));
  for (int i = 0; i < o->n - 1; i++)
    if (!strcmp(o->e[i].canon, e->canon))
      return upf_fail(UPF_ERR_INVALID_ARG, "%s and %s name one file: a run writes each file once", o->e[i].label,
                      e->label);
  if (e->device) {
    if (o->lone) {
      /* no O_CREAT: should the node vanish after the check, this fails instead of leaving a partial
       * regular file in its place */
      const int fd = e->fd >= 0 ? dup(e->fd) : open(e->target, O_WRONLY | O_TRUNC | O_NOCTTY);
      if (fd < 0 || !(e->f = fdopen(fd, "wb"))) {
        const int err = errno;
        if (fd >= 0)
          close(fd);
        return upf_fail(UPF_ERR_IO, "%s: cannot open it for writing: %s", e->label, strerror(err));
      }
    } else {
      e->staged = 1;
      if (!(e->f = tmpfile()))
        return upf_fail(UPF_ERR_IO, "%s: cannot create a temporary file to stage it: %s", e->label, strerror(errno));
    }
  } else {
    int fd = -1;
    UPF_TRY(make_temp(e, &fd, &e->tmp));
    if (fchmod(fd, keep_mode ? mode : creation_mode()) != 0 || !(e->f = fdopen(fd, "wb"))) {
      const int err = errno;
      close(fd);
      return upf_fail(UPF_ERR_IO, "%s: cannot prepare %s: %s", e->label, e->tmp, strerror(err));
    }
  }
  *f = e->f;
  return UPF_OK;
}

/* Flushes and closes a caller's stream: the error of a write that failed shows here (ENOSPC). */
static upf_status close_stream(out_entry *e) {
  FILE *f = e->f;
  e->f = NULL;
  int ok = fflush(f) == 0 && !ferror(f);
  int err = errno;
  if (fclose(f) != 0 && ok)
    ok = 0, err = errno;
  return ok ? UPF_OK : upf_fail(UPF_ERR_IO, "%s: cannot write it: %s", e->label, strerror(err ? err : EIO));
}

/* Copies a device's staged bytes (f, an unnamed temporary) to the device, closing f. */
static upf_status land_device(out_entry *e) {
  FILE *f = e->f;
  e->f = NULL;
  upf_status st = UPF_OK;
  const int fd = fflush(f) != 0 || ferror(f) ? -2 : e->fd >= 0 ? dup(e->fd) : open(e->target, O_WRONLY | O_TRUNC | O_NOCTTY);
  if (fd == -2)
    st = upf_fail(UPF_ERR_IO, "%s: cannot stage it: %s", e->label, strerror(errno));
  else if (fd < 0)
    st = upf_fail(UPF_ERR_IO, "%s: cannot open it for writing: %s", e->label, strerror(errno));
  else {
    rewind(f);
    char buf[1 << 15];
    size_t got;
    while (st == UPF_OK && (got = fread(buf, 1, sizeof buf, f)) > 0)
      for (size_t done = 0; st == UPF_OK && done < got;) {
        const ssize_t w = write(fd, buf + done, got - done);
        if (w < 0 && errno == EINTR)
          continue;
        if (w <= 0)
          st = upf_fail(UPF_ERR_IO, "%s: cannot write it: %s", e->label, strerror(w < 0 ? errno : EIO));
        else
          done += (size_t)w;
      }
    if (st == UPF_OK && ferror(f))
      st = upf_fail(UPF_ERR_IO, "%s: cannot read back its staged bytes: %s", e->label, strerror(errno));
    if (close(fd) != 0 && st == UPF_OK)
      st = upf_fail(UPF_ERR_IO, "%s: cannot write it: %s", e->label, strerror(errno));
  }
  fclose(f);
  return st;
}

/* Closes every stream and removes every temporary still there. */
static void discard(upf_outputs *o) {
  for (int i = 0; i < o->n; i++) {
    out_entry *e = &o->e[i];
    if (e->f)
      fclose(e->f), e->f = NULL;
    if (e->tmp)
      unlink(e->tmp), free(e->tmp), e->tmp = NULL;
  }
}

upf_status upf_outputs_commit(upf_outputs *o) {
  if (!o || o->spent)
    return upf_fail(UPF_ERR_INVALID_ARG, "outputs: commit of a set already committed");
  o->spent = 1;
  upf_status st = UPF_OK;
  for (int i = 0; st == UPF_OK && i < o->n; i++)
    if (!o->e[i].staged && o->e[i].f)
      st = close_stream(&o->e[i]);
  for (int i = 0; st == UPF_OK && i < o->n; i++)
    if (o->e[i].staged)
      st = land_device(&o->e[i]);
  for (int i = 0; st == UPF_OK && i < o->n; i++) {
    out_entry *e = &o->e[i];
    if (!e->tmp)
      continue;
    if (rename(e->tmp, e->target) != 0)
      st = upf_fail(UPF_ERR_IO, "%s: cannot rename %s into place: %s", e->label, e->tmp, strerror(errno));
    else
      free(e->tmp), e->tmp = NULL;
  }
  if (st != UPF_OK)
    discard(o);
  return st;
}

void upf_outputs_free(upf_outputs *o) {
  if (!o)
    return;
  discard(o);
  for (int i = 0; i < o->n; i++)
    free(o->e[i].label), free(o->e[i].target), free(o->e[i].canon);
  free(o->e);
  free(o);
}

upf_status upf_output_put(FILE *f, const void *bytes, size_t n, const char *what) {
  if (n && fwrite(bytes, 1, n, f) != n)
    return upf_fail(UPF_ERR_IO, "%s: cannot write it: %s", what, strerror(errno));
  return UPF_OK;
}
