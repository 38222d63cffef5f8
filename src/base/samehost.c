/*
 * samehost.c: cross-memory attach between processes of one host.  See
 * stepguard/samehost.h.
 */
#include "stepguard/samehost.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* Parse "4495c13d-f3a5-4ddd-b8b2-f77247630bb2" into 16 bytes. */
static int parse_uuid(const char *s, uint8_t out[16]) {
  size_t n = 0;
  int hi = -1;
  for (; *s && *s != '\n'; s++) {
    if (*s == '-')
      continue;
    int v = sg_hex_digit(*s);
    if (v < 0 || n == 16)
      return SG_EIO;
    if (hi < 0) {
      hi = v;
    } else {
      out[n++] = (uint8_t)(hi << 4 | v);
      hi = -1;
    }
  }
  return n == 16 && hi < 0 ? 0 : SG_EIO;
}

int sg_samehost_self(sg_samehost_id_t *out) {
  memset(out, 0, sizeof *out);
  const char *env = getenv("STEPGUARD_SAME_HOST");
  if (env && (strcmp(env, "0") == 0 || strcmp(env, "false") == 0 ||
              strcmp(env, "off") == 0))
    return SG_ESTATE;

  char text[64] = {0};
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return SG_EIO;
  ssize_t got = read(fd, text, sizeof text - 1);
  close(fd);
  if (got <= 0 || parse_uuid(text, out->boot_id) != 0)
    return SG_EIO;

  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0)
    return SG_EIO;
  out->pid_ns = (uint64_t)st.st_ino;
  out->pid = (uint32_t)getpid();
  return 0;
}

void sg_samehost_encode(const sg_samehost_id_t *id, uint8_t *out) {
  memcpy(out, id->boot_id, 16);
  sg_put_le64(out + 16, id->pid_ns);
  sg_put_le32(out + 24, id->pid);
  sg_put_le32(out + 28, id->flags);
}

void sg_samehost_decode(const uint8_t *in, sg_samehost_id_t *id) {
  memcpy(id->boot_id, in, 16);
  id->pid_ns = sg_get_le64(in + 16);
  id->pid = (uint32_t)sg_get_le32(in + 24);
  id->flags = (uint32_t)sg_get_le32(in + 28);
}

int sg_samehost_match(const sg_samehost_id_t *self,
                      const sg_samehost_id_t *peer) {
  static const uint8_t zero[16];
  if (self->pid == 0 || peer->pid == 0 || self->pid == peer->pid)
    return 0;
  if (memcmp(self->boot_id, zero, 16) == 0)
    return 0;
  return memcmp(self->boot_id, peer->boot_id, 16) == 0 &&
         self->pid_ns == peer->pid_ns;
}

/* Bytes of one iovec at most: the kernel truncates larger totals. */
#define READV_ELEM_MAX ((size_t)1 << 30)

int sg_samehost_readv(uint32_t pid, const sg_samehost_piece_t *pieces,
                      size_t n) {
  struct iovec local[SG_SAMEHOST_IOV_MAX], remote[SG_SAMEHOST_IOV_MAX];
  size_t i = 0;    /* first piece not fully copied */
  size_t done = 0; /* bytes of piece i already copied */
  int stalls = 0;
  for (;;) {
    while (i < n && pieces[i].len == done) {
      i++;
      done = 0;
    }
    if (i == n)
      return 0;
    /* Batch: piece i from `done`, then whole pieces, at most IOV_MAX and
     * at most READV_ELEM_MAX per element (a longer piece goes on in the
     * next call). */
    int k = 0;
    for (size_t p = i; p < n && k < SG_SAMEHOST_IOV_MAX; p++) {
      size_t off = p == i ? done : 0;
      size_t left = pieces[p].len - off;
      if (left == 0)
        continue;
      if (left > READV_ELEM_MAX)
        left = READV_ELEM_MAX;
      local[k].iov_base = (uint8_t *)pieces[p].local + off;
      local[k].iov_len = left;
      remote[k].iov_base = (void *)(uintptr_t)(pieces[p].remote + off);
      remote[k].iov_len = left;
      k++;
      if (left != pieces[p].len - off)
        break; /* the rest of this piece comes first next time */
    }
    ssize_t got = process_vm_readv((pid_t)pid, local, (unsigned long)k, remote,
                                   (unsigned long)k, 0);
    if (got < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (got == 0) {
      if (++stalls > 2)
        return SG_EIO;
      continue;
    }
    stalls = 0;
    /* advance over what the kernel copied, possibly ending mid-piece */
    size_t g = (size_t)got;
    while (g > 0 && i < n) {
      size_t left = pieces[i].len - done;
      if (g < left) {
        done += g;
        g = 0;
      } else {
        g -= left;
        i++;
        done = 0;
      }
    }
  }
}

int sg_samehost_read(uint32_t pid, void *dst, uint64_t remote_addr,
                     size_t len) {
  sg_samehost_piece_t one = {.remote = remote_addr, .local = dst, .len = len};
  return sg_samehost_readv(pid, &one, 1);
}

int sg_samehost_probe(uint32_t pid, uint64_t remote_addr, const void *expect,
                      size_t len) {
  uint8_t got[64];
  if (len == 0 || len > sizeof got)
    return SG_EINVAL;
  int rc = sg_samehost_read(pid, got, remote_addr, len);
  if (rc != 0)
    return rc;
  return memcmp(got, expect, len) == 0 ? 0 : SG_EPROTO;
}
