/*
 * stepguard/base.h: the conventions every libstepguard subsystem shares.
 *
 *   errors     one enum of negative codes, sg_strerror(), sg_err_t detail
 *   logging    sg_log() with a level and a replaceable sink
 *   clocks     monotonic nanoseconds and absolute deadlines
 *   buffers    sg_buf_t, a growable byte buffer with a hard maximum
 *   allocation sg_malloc()/sg_realloc()/sg_free(), with failure injection
 *   sockets    SOCK_CLOEXEC TCP helpers and the fork-safety registry
 *
 * Process-wide state is limited to three things that are process-wide by
 * nature: the log level and sink, the allocation failure injector used by
 * tests, and the registry of sockets that a forked child must drop.  Each is
 * protected by atomics or a mutex.  Everything else hangs off context objects.
 */
#ifndef STEPGUARD_BASE_H
#define STEPGUARD_BASE_H

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SG_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#define SG_EXPORT __attribute__((visibility("default")))
#else
#define SG_PRINTF(fmt, args)
#define SG_EXPORT
#endif

/* ---- errors ------------------------------------------------------------ */

/*
 * 0 is success.  errno-backed codes are -errno.  Project codes sit below
 * SG__EBASE, outside any errno range.  Codes for which sg_err_is_fatal() is
 * true poison the object that returned them (a communicator, a session);
 * the others fail one operation.
 */
enum {
  SG_OK = 0,
  SG_EINVAL = -EINVAL,
  SG_ENOMEM = -ENOMEM,
  SG_EAGAIN = -EAGAIN,
  SG_ETIMEDOUT = -ETIMEDOUT,
  SG_ECANCELED = -ECANCELED,
  SG_ECONNRESET = -ECONNRESET,
  SG_ECONNREFUSED = -ECONNREFUSED,
  SG_EPIPE = -EPIPE,
  SG_EADDRINUSE = -EADDRINUSE,
  SG_EIO = -EIO,

  SG__EBASE = -10000,
  SG_ETOOBIG = -10001,   /* a length over its limit; nothing was changed */
  SG_EAUTH = -10002,     /* missing or wrong authentication token */
  SG_ENOTFOUND = -10003, /* name, key or address does not resolve */
  SG_ESTATE = -10004,    /* call not allowed in the object's current state */
  SG_ECLOSED = -10005,   /* the object was closed */

  SG__EFATAL = -10100,  /* project codes below this one are fatal */
  SG_EABORTED = -10101, /* sg_*_abort() was called */
  SG_EPEER = -10102,    /* a peer failed (reset, EOF, deadline); see message */
  SG_EPROTO = -10103,   /* a peer broke the protocol */
};

/*
 * sg_strerror: a static, never NULL, human-readable name for `code`.
 * Thread-safe.  Unknown codes give "unknown error".
 */
SG_EXPORT const char *sg_strerror(int code);

/* sg_err_name: the symbolic name ("SG_ETIMEDOUT") or "SG_E?" if unknown. */
SG_EXPORT const char *sg_err_name(int code);

/*
 * sg_err_is_fatal: nonzero when `code` poisons the object that returned it:
 * the project's fatal codes and the connection-level errno codes.
 */
SG_EXPORT int sg_err_is_fatal(int code);

/* An error code with detail, for callers that show the error to a user. */
typedef struct sg_err_s {
  int code;      /* 0 or a negative SG_E* code */
  char msg[256]; /* NUL-terminated detail, "" when none */
} sg_err_t;

/*
 * sg_err_set: record `code` and a printf-style message in `err` (which may be
 * NULL) and return `code`, so that `return sg_err_set(err, SG_EINVAL, ...)`
 * reads as one step.  A message that does not fit is truncated.
 */
SG_EXPORT int sg_err_set(sg_err_t *err, int code, const char *fmt, ...)
    SG_PRINTF(3, 4);

/* sg_err_clear: reset `err` (may be NULL) to success. */
SG_EXPORT void sg_err_clear(sg_err_t *err);

/* ---- logging ----------------------------------------------------------- */

typedef enum sg_log_level_e {
  SG_LOG_ERROR = 0,
  SG_LOG_WARN = 1,
  SG_LOG_INFO = 2,
  SG_LOG_DEBUG = 3,
  SG_LOG_TRACE = 4,
} sg_log_level_t;

/*
 * A log sink receives one formatted line without its trailing newline.
 * It may be called from any libstepguard thread, concurrently.
 */
typedef void (*sg_log_cb)(void *ud, sg_log_level_t level, const char *subsystem,
                          const char *line);

/*
 * sg_log: format and emit a line if `level` is enabled.  The default sink
 * writes "2026-01-31T12:00:00.123Z [INFO] [stepguard::subsystem] - message"
 * to stderr in one write(2).  Never blocks on anything but that write.
 * The initial level comes from $STEPGUARD_LOG (error, warn, info, debug,
 * trace), else $RUST_LOG's level word, else info.
 */
SG_EXPORT void sg_log(sg_log_level_t level, const char *subsystem,
                      const char *fmt, ...) SG_PRINTF(3, 4);
SG_EXPORT void sg_logv(sg_log_level_t level, const char *subsystem,
                       const char *fmt, va_list ap);

/* sg_log_enabled: nonzero if a line at `level` would be emitted. */
SG_EXPORT int sg_log_enabled(sg_log_level_t level);

/* sg_log_set_level: set the process-wide level; thread-safe. */
SG_EXPORT void sg_log_set_level(sg_log_level_t level);

/*
 * sg_log_set_sink: route lines to `cb` (NULL restores the stderr sink).
 * `ud` is borrowed and must outlive the registration.  Thread-safe.
 */
SG_EXPORT void sg_log_set_sink(sg_log_cb cb, void *ud);

/* sg_log_level_parse: "warn" -> SG_LOG_WARN; returns -1 when unknown. */
SG_EXPORT int sg_log_level_parse(const char *s);

/* sg_thread_name: name the calling thread (cut to 15 bytes), as the
 * library's own threads do: sg-rpc-client, sg-mgr-loop, sg-mgr-quorum,
 * sg-mgr-hbeat, sg-lighthouse, sg-comm, sg-ckpt-serve, sg-ckpt-fetch,
 * sg-blocking. */
SG_EXPORT void sg_thread_name(const char *name);

/* ---- clocks and deadlines ------------------------------------------------ */

/* sg_now_ns: CLOCK_MONOTONIC in nanoseconds.  Never goes backwards. */
SG_EXPORT int64_t sg_now_ns(void);

/* sg_wall_ns: CLOCK_REALTIME in nanoseconds since the Unix epoch. */
SG_EXPORT int64_t sg_wall_ns(void);

/*
 * A deadline is an absolute sg_now_ns() value.  There is no "forever":
 * every wait inside libstepguard is given one of these.
 */
typedef int64_t sg_deadline_t;

/* sg_deadline_in_ms: now + ms (ms < 0 is treated as 0; saturates). */
SG_EXPORT sg_deadline_t sg_deadline_in_ms(int64_t ms);

/* sg_deadline_left_ms: whole milliseconds left, rounded up, never < 0. */
SG_EXPORT int64_t sg_deadline_left_ms(sg_deadline_t d);

/* sg_deadline_passed: nonzero once the deadline is reached. */
SG_EXPORT int sg_deadline_passed(sg_deadline_t d);

/* ---- allocation ---------------------------------------------------------- */

/*
 * All library allocation goes through these so that tests can fail any
 * allocation.  sg_free(NULL) is a no-op.  No function in libstepguard aborts
 * on out-of-memory: it returns SG_ENOMEM.
 */
SG_EXPORT void *sg_malloc(size_t n);
SG_EXPORT void *sg_calloc(size_t n, size_t size);
SG_EXPORT void *sg_realloc(void *p, size_t n);
SG_EXPORT void sg_free(void *p);
SG_EXPORT char *sg_strdup(const char *s);

/*
 * sg_test_fail_alloc: make the `nth` allocation from now fail (1 = the next
 * one) and every later one too when `sticky`; 0 disarms.  For tests only.
 * Returns the number of allocations that were failed since the last call.
 */
SG_EXPORT long sg_test_fail_alloc(long nth, int sticky);

/* ---- bounded buffer ------------------------------------------------------ */

/*
 * A byte buffer that never grows past `max`.  Readable bytes are
 * data[off, off + len).  Appending past `max` fails with SG_ETOOBIG and
 * leaves the buffer unchanged.  Not thread-safe; owned by one object.
 */
typedef struct sg_buf_s {
  uint8_t *data;
  size_t off; /* start of unread bytes */
  size_t len; /* number of unread bytes */
  size_t cap; /* allocated size of data */
  size_t max; /* hard limit on off + len after compaction, i.e. on len */
} sg_buf_t;

/* sg_buf_init: empty buffer with limit `max` (> 0).  Allocates nothing. */
SG_EXPORT void sg_buf_init(sg_buf_t *b, size_t max);

/* sg_buf_free: release memory; the buffer is empty and reusable after. */
SG_EXPORT void sg_buf_free(sg_buf_t *b);

/*
 * sg_buf_reserve: make room for `n` more bytes after the unread ones.
 * Returns 0, SG_ETOOBIG (len + n > max, checked without overflow) or
 * SG_ENOMEM.  The buffer is unchanged on error.
 */
SG_EXPORT int sg_buf_reserve(sg_buf_t *b, size_t n);

/* sg_buf_append: copy `n` bytes in; errors as sg_buf_reserve. */
SG_EXPORT int sg_buf_append(sg_buf_t *b, const void *p, size_t n);

/* sg_buf_tail: where the next sg_buf_reserve()d bytes go; see commit. */
SG_EXPORT uint8_t *sg_buf_tail(sg_buf_t *b);

/* sg_buf_commit: mark `n` bytes written at sg_buf_tail() as readable. */
SG_EXPORT void sg_buf_commit(sg_buf_t *b, size_t n);

/* sg_buf_head: first unread byte (valid for sg_buf_t.len bytes). */
SG_EXPORT const uint8_t *sg_buf_head(const sg_buf_t *b);

/* sg_buf_consume: drop `n` <= len bytes from the front. */
SG_EXPORT void sg_buf_consume(sg_buf_t *b, size_t n);

/* ---- string-keyed hash map ------------------------------------------------
 */

/*
 * sg_map_t maps NUL-terminated string keys (copied) to void * values
 * (borrowed).  Open addressing with a per-map random SipHash key, so keys
 * chosen by a peer cannot force collisions.  Not thread-safe.
 */
typedef struct sg_map_s {
  struct sg_map_slot_s *slots;
  size_t cap;  /* power of two or 0 */
  size_t len;  /* live entries */
  size_t used; /* live + deleted slots */
  uint64_t k0, k1;
} sg_map_t;

/* sg_map_init: an empty map (allocates nothing).  sg_map_free frees keys
 * and slots, not values. */
SG_EXPORT void sg_map_init(sg_map_t *m);
SG_EXPORT void sg_map_free(sg_map_t *m);

/* sg_map_get: the value for `key`, or NULL when absent. */
SG_EXPORT void *sg_map_get(const sg_map_t *m, const char *key);

/*
 * sg_map_put: set `key` to `value` (non-NULL).  *old (may be NULL) gets the
 * previous value or NULL.  Returns 0 or SG_ENOMEM (map unchanged).
 */
SG_EXPORT int sg_map_put(sg_map_t *m, const char *key, void *value, void **old);

/* sg_map_del: remove `key`; returns its value or NULL when absent. */
SG_EXPORT void *sg_map_del(sg_map_t *m, const char *key);

/*
 * sg_map_next: iterate.  Start with *pos = 0; returns 1 and sets *key and
 * *value for each live entry, 0 at the end.  The map must not change while
 * iterating, except by sg_map_del of the entry just returned.
 */
SG_EXPORT int sg_map_next(const sg_map_t *m, size_t *pos, const char **key,
                          void **value);

/* ---- sockets and fork safety --------------------------------------------- */

/*
 * Every socket libstepguard opens is SOCK_CLOEXEC | SOCK_NONBLOCK and is
 * entered in a process-wide registry.  A pthread_atfork() child handler
 * replaces each registered descriptor in the child with /dev/null (dup2), so
 * the child holds no reference to the parent's connections: when the parent
 * dies its peers see the connection close even while forked children (for
 * example DataLoader workers) live on.  Descriptor numbers stay occupied, so a
 * later sg_sock_close() in the child closes /dev/null and nothing else.
 */

/*
 * sg_sock_listen: bind and listen on TCP `host`:`port` ("" or NULL host =
 * all interfaces, IPv6 dual-stack when available; port 0 = ephemeral).
 * On success *fd is a registered listening socket and *bound_port its port.
 * Returns 0, SG_ENOTFOUND, SG_EADDRINUSE or another -errno; detail in err.
 */
SG_EXPORT int sg_sock_listen(const char *host, int port, int backlog, int *fd,
                             int *bound_port, sg_err_t *err);

/*
 * sg_sock_connect: connect to `host`:`port` before `deadline`.  Blocks the
 * calling thread (poll with the deadline).  On success *fd is a registered,
 * non-blocking, connected socket with TCP_NODELAY.  Returns 0,
 * SG_ETIMEDOUT, SG_ECONNREFUSED, SG_ENOTFOUND or another -errno.
 */
SG_EXPORT int sg_sock_connect(const char *host, int port,
                              sg_deadline_t deadline, int *fd, sg_err_t *err);

/*
 * sg_sock_accept: accept one connection from a registered listening socket;
 * the new socket is registered.  Returns 0 or -errno (SG_EAGAIN when none is
 * pending).
 */
SG_EXPORT int sg_sock_accept(int listen_fd, int *fd);

/*
 * sg_sock_register: enter a socket created elsewhere (for example by libuv)
 * in the fork registry and set FD_CLOEXEC on it.  sg_sock_unregister removes
 * it without closing.  Both return 0, SG_ENOMEM or SG_EINVAL.
 */
SG_EXPORT int sg_sock_register(int fd);
SG_EXPORT int sg_sock_unregister(int fd);

/* sg_sock_close: unregister and close `fd`; fd < 0 is a no-op. */
SG_EXPORT void sg_sock_close(int fd);

/* sg_sock_registered_count: how many descriptors the registry holds. */
SG_EXPORT size_t sg_sock_registered_count(void);

/*
 * sg_sock_fork_count: how many forks this process is removed from its
 * original parent's libstepguard (0 in the original process).  Lets objects
 * that were inherited across fork() refuse to do I/O.
 */
SG_EXPORT unsigned sg_sock_fork_count(void);

/* ---- byte order ---------------------------------------------------------- */

/*
 * Little-endian codecs for the binary wire formats (checkpoint, comm
 * handshake, same-host identity): one copy, byte by byte, so they are right
 * on any host and at any alignment.
 */
static inline void sg_put_le16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void sg_put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline void sg_put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t sg_get_le16(const uint8_t *p) {
  return (uint16_t)(p[0] | (uint16_t)(p[1] << 8));
}
static inline uint32_t sg_get_le32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}
static inline uint64_t sg_get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

/* ---- addresses ------------------------------------------------------------
 */

/* The longest "host:port" any address parser accepts. */
#define SG_ADDR_MAX 300

/*
 * sg_addr_split: "host:port" or "[v6]:port" into `host` (brackets removed,
 * NUL-terminated, at most hostcap bytes with the NUL) and *port (0..65535:
 * a caller that dials refuses 0 itself).  The one address parser of the
 * library: an IPv6 address needs brackets, the host is visible ASCII, the
 * port one to five digits.  Returns 0 or SG_EINVAL with the reason in err
 * (which may be NULL).  Pure.
 */
SG_EXPORT int sg_addr_split(const char *addr, char *host, size_t hostcap,
                            int *port, sg_err_t *err);

/*
 * sg_addr_advertised: the host peers should use to reach this process, by
 * the one rule every server follows: $STEPGUARD_ADVERTISE_HOST, else
 * `option`, else `fallback`, else gethostname().  The variable wins over the
 * option because training code usually passes socket.gethostname() by
 * default, and the operator who sets the variable knows which network must
 * carry the traffic.  A name that is a network interface ("eth1") becomes
 * that interface's first IPv4 (else IPv6) address; an IPv6 address (found
 * or given) comes in brackets, ready to be followed by ":port".
 * Writes a NUL-terminated host of at most cap bytes into `host`.
 */
SG_EXPORT void sg_addr_advertised(const char *option, const char *fallback,
                                  char *host, size_t cap);

/* sg_hex_digit: the value of hexadecimal digit `c` (either case), or -1. */
SG_EXPORT int sg_hex_digit(char c);

/* sg_version: the library version string, "0.1.0". */
SG_EXPORT const char *sg_version(void);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_BASE_H */
