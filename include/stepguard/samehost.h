/*
 * stepguard/samehost.h: moving bytes between processes of one host without
 * the network stack.
 *
 * Two processes on one host can copy each other's memory with
 * process_vm_readv(2) (cross-memory attach): one copy at memory speed, where
 * loopback TCP costs two copies and the protocol stack.  The kernel allows it
 * when the reader may ptrace the target (same user, or CAP_SYS_PTRACE, and
 * whatever Yama or a seccomp filter adds), so it is never assumed: peers
 * exchange an sg_samehost_id during their handshake, and a reader proves the
 * path works with sg_samehost_probe() before relying on it.  Any failure means
 * "use TCP"; nothing here is required for correctness.
 *
 * The reader only ever reads ranges the target announced over an
 * authenticated connection, and the target keeps them stable until the reader
 * says it is done.  Reading grants nothing new: a process that may ptrace
 * another could already read all of its memory.
 *
 * $STEPGUARD_SAME_HOST=0 turns the path off (sg_samehost_self() then reports
 * SG_ESTATE, and peers fall back to TCP).
 */
#ifndef STEPGUARD_SAMEHOST_H
#define STEPGUARD_SAMEHOST_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wire size of an encoded sg_samehost_id. */
#define SG_SAMEHOST_ID_LEN 32

/*
 * Who a process is, as far as memory access goes: the kernel boot (so two
 * machines never match), the pid namespace (so the pid means the same
 * process to both) and the pid.
 */
typedef struct sg_samehost_id_s {
  uint8_t boot_id[16];
  uint64_t pid_ns; /* inode of /proc/self/ns/pid */
  uint32_t pid;
  uint32_t flags; /* 0; reserved */
} sg_samehost_id_t;

/*
 * sg_samehost_self: fill `out` for the calling process.  SG_ESTATE when the
 * path is turned off by the environment, SG_EIO when /proc does not tell.
 */
SG_EXPORT int sg_samehost_self(sg_samehost_id_t *out);

/* Fixed little-endian encoding, SG_SAMEHOST_ID_LEN bytes. */
SG_EXPORT void sg_samehost_encode(const sg_samehost_id_t *id, uint8_t *out);
SG_EXPORT void sg_samehost_decode(const uint8_t *in, sg_samehost_id_t *id);

/*
 * sg_samehost_match: nonzero when `peer` is another process that `self` may
 * address by pid: same boot, same pid namespace, different pid, nonzero.
 */
SG_EXPORT int sg_samehost_match(const sg_samehost_id_t *self,
                                const sg_samehost_id_t *peer);

/*
 * sg_samehost_read: copy `len` bytes at `remote_addr` in process `pid` to
 * `dst`.  Partial transfers are continued; returns 0, SG_EPERM-like errno
 * codes (-EPERM, -ESRCH, -EFAULT, -ENOSYS) as negative values, or SG_EIO if
 * the kernel stops making progress.  One call copies at most what it is
 * given: callers that must stay abortable split large ranges.
 */
SG_EXPORT int sg_samehost_read(uint32_t pid, void *dst, uint64_t remote_addr,
                               size_t len);

/* One range of a vectored read: `len` bytes at `remote` into `local`. */
typedef struct sg_samehost_piece_s {
  uint64_t remote;
  void *local;
  size_t len;
} sg_samehost_piece_t;

/* Pieces per process_vm_readv call (the kernel's IOV_MAX). */
#define SG_SAMEHOST_IOV_MAX 1024

/*
 * sg_samehost_readv: copy `n` pieces from process `pid`, up to
 * SG_SAMEHOST_IOV_MAX of them per process_vm_readv call, so many small
 * ranges cost one system call (and one pinning pass) per batch rather than
 * one each.  Empty pieces are skipped.  The kernel stops at the first remote
 * range it cannot read and reports what it copied before it; the read goes
 * on from exactly there, so a bad range fails the call with its errno (as a
 * negative value), SG_EIO if the kernel stops making progress.  On an error
 * the pieces before the failing one may have been copied, the rest not.
 * As with sg_samehost_read, callers that must stay abortable pass bounded
 * batches.
 */
SG_EXPORT int sg_samehost_readv(uint32_t pid, const sg_samehost_piece_t *pieces,
                                size_t n);

/*
 * sg_samehost_probe: read `len` (at most 64) bytes at `remote_addr` in `pid`
 * and compare them to `expect`; 0 when the path works and reads what the peer
 * announced, a negative code otherwise.
 */
SG_EXPORT int sg_samehost_probe(uint32_t pid, uint64_t remote_addr,
                                const void *expect, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_SAMEHOST_H */
