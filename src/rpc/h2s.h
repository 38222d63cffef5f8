/*
 * h2s.h: the server side of gRPC unary calls over one HTTP/2 connection, as
 * an engine that does no I/O: fed the bytes a peer sent (sg__h2s_recv), it
 * yields the bytes to send back (sg__h2s_send) and tells its owner about
 * calls through a small table of operations.  server.c owns the sockets,
 * timers and the deadline heap around it; fuzz/fuzz_grpc.c drives it
 * directly.  Also: sg__rpc_sniff(), the pure protocol classifier for the
 * first bytes of an accepted connection.
 *
 * Not thread-safe: one engine belongs to one loop thread.
 */
#ifndef SG_RPC_H2S_H
#define SG_RPC_H2S_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <nghttp2/nghttp2.h>

#include "rpc/grpc.h"
#include "stepguard/rpc.h"

/* ---- protocol sniffing ----------------------------------------------------
 */

typedef enum sg__sniff_e {
  SG__SNIFF_MORE = 0,  /* a prefix of something we accept: wait for bytes */
  SG__SNIFF_H2 = 1,    /* the complete HTTP/2 client preface */
  SG__SNIFF_HTTP1 = 2, /* "METHOD " request line (uppercase token, space) */
  SG__SNIFF_OTHER = 3, /* anything else: close */
} sg__sniff_t;

#define SG__H2_PREFACE "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define SG__H2_PREFACE_LEN 24
#define SG__HTTP1_METHOD_MAX 16 /* longest method token we wait for */

/* sg__rpc_sniff: classify the first n bytes a client sent.  Pure. */
sg__sniff_t sg__rpc_sniff(const uint8_t *p, size_t n);

/* ---- calls -----------------------------------------------------------------
 */

/* Call states; one setter (call_set_state in h2s.c) moves between them. */
typedef enum sg__call_state_e {
  SG__CALL_HEADERS,    /* request header block arriving */
  SG__CALL_BODY,       /* headers valid, message arriving */
  SG__CALL_DISPATCHED, /* handed to on_call; the handler owns it */
  SG__CALL_CANCELLING, /* inside on_call_cancel */
  SG__CALL_RESPONDED,  /* response submitted (or dropped); awaiting close */
} sg__call_state_t;

struct sg_rpc_blob_s {
  size_t refs;
  size_t len;
  uint8_t data[];
};

typedef struct sg__h2s_s sg__h2s_t;

struct sg_rpc_call_s {
  sg__h2s_t *h2;
  int32_t stream_id;
  sg__call_state_t state;
  struct sg_rpc_call_s *prev, *next; /* the engine's list of calls */
  char *path;                        /* ":path", NUL-terminated */
  sg_buf_t meta;            /* "key\0value\0" pairs of regular headers */
  size_t hdr_bytes;         /* header list size so far (RFC 9113 accounting) */
  unsigned post : 1;        /* :method is POST */
  unsigned ct_ok : 1;       /* content-type is application/grpc[+;...] */
  unsigned bad_timeout : 1; /* grpc-timeout present but malformed */
  unsigned hdr_too_big : 1; /* header list over SG_RPC_MAX_HEADER_LIST */
  unsigned have_prefix : 1; /* the 5-byte prefix has been parsed */
  unsigned remote_closed : 1; /* peer sent END_STREAM */
  unsigned local_closed : 1;  /* our END_STREAM went out */
  int64_t timeout_ns;         /* from grpc-timeout, -1 when absent */
  sg_buf_t body;              /* prefix + message, at most 5 + max_message */
  uint32_t msg_len;           /* from the prefix */
  size_t unconsumed;          /* DATA bytes not yet returned to the window */
  sg_deadline_t deadline;
  size_t heap_idx; /* position in the owner's deadline heap, SIZE_MAX: none */
  void *user;
  sg_rpc_blob_t *resp; /* OK response body, or NULL */
  size_t resp_off;     /* bytes of prefix + body handed to nghttp2 */
  uint8_t resp_prefix[SG_GRPC_PREFIX_LEN];
};

/* What the engine needs from its owner.  None may be NULL. */
typedef struct sg__h2s_ops_s {
  void (*dispatch)(void *owner, sg_rpc_call_t *c); /* -> on_call */
  void (*cancel)(void *owner, sg_rpc_call_t *c);   /* -> on_call_cancel */
  /* start tracking c->deadline (0 or SG_ENOMEM: the call is reset) / stop
     tracking it (idempotent) */
  int (*deadline_set)(void *owner, sg_rpc_call_t *c);
  void (*deadline_clear)(void *owner, sg_rpc_call_t *c);
  /* output became pending outside sg__h2s_recv (a respond from a timer) */
  void (*wake)(void *owner);
} sg__h2s_ops_t;

typedef struct sg__h2s_config_s {
  size_t max_message;
  unsigned max_streams;
  int64_t default_deadline_ms;
  uint64_t conn_id;
} sg__h2s_config_t;

struct sg__h2s_s {
  nghttp2_session *session;
  nghttp2_mem mem; /* routes nghttp2's allocations to sg_malloc */
  const sg__h2s_ops_t *ops;
  void *owner;
  sg__h2s_config_t cfg;
  sg_rpc_call_t *calls; /* every call with a live stream */
  size_t ncalls;
  int closing; /* sg__h2s_shutdown ran: no more output, no dispatch */
  int failed;  /* a fatal error (nghttp2 out of memory): owner must close */
};

/*
 * sg__h2s_init: a server session that has queued its SETTINGS and window
 * update.  `ops` and `owner` are borrowed and must outlive the engine.
 * Returns 0 or SG_ENOMEM (nothing to free then).
 */
int sg__h2s_init(sg__h2s_t *h, const sg__h2s_config_t *cfg,
                 const sg__h2s_ops_t *ops, void *owner);

/*
 * sg__h2s_recv: process n bytes from the peer; calls ops->dispatch and
 * ops->cancel from inside.  Returns 0, or SG_EPROTO / SG_ENOMEM when the
 * connection must end (call sg__h2s_terminate, flush, close).
 */
int sg__h2s_recv(sg__h2s_t *h, const uint8_t *p, size_t n);

/*
 * sg__h2s_send: the next bytes to write, valid until the next call into the
 * engine.  Returns their count, 0 when nothing is pending, or SG_ENOMEM /
 * SG_EPROTO when the connection must end.
 */
ssize_t sg__h2s_send(sg__h2s_t *h, const uint8_t **out);

/* sg__h2s_want_io: nonzero while the session still wants to read or write. */
int sg__h2s_want_io(const sg__h2s_t *h);

/* sg__h2s_idle: nonzero when no stream is open. */
int sg__h2s_idle(const sg__h2s_t *h);

/* sg__h2s_terminate: queue GOAWAY(error_code); the session ends after it. */
void sg__h2s_terminate(sg__h2s_t *h, uint32_t error_code);

/*
 * sg__h2s_expire: c's deadline passed: cancel it if dispatched (ops->cancel)
 * and answer DEADLINE_EXCEEDED.
 */
void sg__h2s_expire(sg__h2s_t *h, sg_rpc_call_t *c);

/*
 * sg__h2s_shutdown: the connection is closing: cancel every dispatched call
 * (ops->cancel), stop all output.  Idempotent.
 */
void sg__h2s_shutdown(sg__h2s_t *h);

/* sg__h2s_free: free every call and the session (no callbacks). */
void sg__h2s_free(sg__h2s_t *h);

#endif /* SG_RPC_H2S_H */
