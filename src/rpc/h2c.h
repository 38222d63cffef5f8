/*
 * h2c.h: the client side of gRPC unary calls over one HTTP/2 connection, as
 * an engine that does no I/O: fed the bytes the server sent (sg__h2c_recv),
 * it yields the bytes to send (sg__h2c_send) and tells its owner about
 * streams through a small table of operations.  The client channel
 * (client.c; its I/O thread in client_io.c) owns the socket, the connect
 * state machine, timers and the channel mutex around it; the engine touches
 * none of them.  fuzz/fuzz_h2c.c drives it directly.
 *
 * The twin of h2s.h.  A stream (sg__h2c_stream_t) is owned by the caller,
 * usually embedded in its own request object; the engine links it into its
 * list of open streams from sg__h2c_submit until the stream closes, is not
 * sent, or is taken back with sg__h2c_take, and fills in what the server
 * answered.  sg__h2c_result turns that into the call's outcome.
 *
 * Not thread-safe: one engine and its streams belong to one thread.
 */
#ifndef SG_RPC_H2C_H
#define SG_RPC_H2C_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <nghttp2/nghttp2.h>

#include "rpc/grpc.h"
#include "stepguard/base.h"

/* Response header bytes per stream (RFC 9113 accounting: name + value + 32
 * for each header). */
#define SG__H2C_MAX_RESP_HEADERS 16384
#define SG__H2C_MAX_EXTRA_HEADERS 4 /* owner headers per request */
#define SG__H2C_MSG_MAX 256         /* result detail, with its NUL */

typedef struct sg__h2c_s sg__h2c_t;

/* One request/response exchange.  Fields are the engine's; the owner may
 * read them (rst_sent and stream_id in particular). */
typedef struct sg__h2c_stream_s {
  struct sg__h2c_stream_s *prev, *next; /* the engine's open streams */
  const char *path;     /* ":path" (borrowed from submit), for messages */
  const uint8_t *body;  /* request: 5-byte prefix + message (borrowed) */
  size_t body_len;      /* bytes in body */
  size_t body_off;      /* bytes of body handed to nghttp2 */
  int32_t stream_id;    /* > 0 once submitted */
  int linked;           /* in the engine's list */
  int rst_sent;         /* we reset the stream (or nghttp2 did for us) */
  int http_status;      /* :status, 0 until received, -1 when malformed */
  int status_hdr;       /* grpc-status, -1 until received */
  int local_rc;         /* an error we decided while receiving (ETOOBIG) */
  int prefix_checked;   /* the response message prefix was validated */
  size_t hdr_bytes;     /* response header bytes so far */
  char status_msg[200]; /* decoded grpc-message */
  sg_buf_t rbuf;        /* response body (prefix + message) */
} sg__h2c_stream_t;

/* A request header the owner adds after the fixed ones. */
typedef struct sg__h2c_header_s {
  const char *name;
  const char *value;
} sg__h2c_header_t;

/* What the engine tells its owner, from inside sg__h2c_recv or
 * sg__h2c_send.  None may be NULL. */
typedef struct sg__h2c_ops_s {
  /* s's stream closed with HTTP/2 `error_code` (NGHTTP2_NO_ERROR when it
   * ended normally).  s has left the engine and the owner may free it
   * here; what the server sent is still in s (sg__h2c_result). */
  void (*closed)(void *owner, sg__h2c_stream_t *s, uint32_t error_code);
  /* s's request HEADERS could not be sent (`why`: nghttp2's reason, e.g.
   * after GOAWAY).  s has left the engine; closed() is not called. */
  void (*not_sent)(void *owner, sg__h2c_stream_t *s, const char *why);
  /* the ACK of the PING from sg__h2c_ping arrived */
  void (*ping_acked)(void *owner);
} sg__h2c_ops_t;

typedef struct sg__h2c_config_s {
  const char *authority; /* ":authority" of each request; borrowed */
  size_t max_message;    /* largest response message accepted */
} sg__h2c_config_t;

struct sg__h2c_s {
  nghttp2_session *session;
  nghttp2_mem mem; /* routes nghttp2's allocations to sg_malloc */
  const sg__h2c_ops_t *ops;
  void *owner;
  sg__h2c_config_t cfg;
  sg__h2c_stream_t *streams, *tail; /* open streams, oldest first */
  size_t nstreams;
  int got_settings;         /* the server's first SETTINGS frame arrived */
  int goaway;               /* the server sent GOAWAY */
  uint32_t sent_goaway_err; /* our GOAWAY's error code (protocol error) */
  int ping_outstanding;     /* a PING awaits its ACK */
  int lib_error;            /* nghttp2 error behind the last failure */
};

/*
 * sg__h2c_stream_init: an empty stream that accepts response messages of up
 * to max_message bytes.  Allocates nothing.
 */
void sg__h2c_stream_init(sg__h2c_stream_t *s, size_t max_message);

/*
 * sg__h2c_stream_fini: free what the stream received.  The stream must not
 * be in an engine.  Idempotent.
 */
void sg__h2c_stream_fini(sg__h2c_stream_t *s);

/*
 * sg__h2c_init: a client session that has queued the preface, SETTINGS
 * (no push, a 1 MiB stream window) and a 16 MiB connection window.  `cfg`
 * is copied; the authority it names, `ops` and `owner` are borrowed and
 * must outlive the engine.  Returns 0 or SG_ENOMEM (nothing to free then;
 * sg__h2c_error says what failed).
 */
int sg__h2c_init(sg__h2c_t *h, const sg__h2c_config_t *cfg,
                 const sg__h2c_ops_t *ops, void *owner);

/*
 * sg__h2c_submit: open a stream for a POST of `path` with `body` (prefix +
 * message), sending the fixed gRPC headers and then `extra` (at most
 * SG__H2C_MAX_EXTRA_HEADERS).  path, extra's strings and body are
 * borrowed: path and body until the stream leaves the engine, extra for
 * the call.  On 0, s is in the engine's list; otherwise it is untouched
 * but for its path.  Returns 0, SG_EINVAL (too many headers), SG_ENOMEM,
 * or SG_ECONNRESET (the session takes no new stream); sg__h2c_error says
 * why.
 */
int sg__h2c_submit(sg__h2c_t *h, sg__h2c_stream_t *s, const char *path,
                   const sg__h2c_header_t *extra, size_t nextra,
                   const uint8_t *body, size_t body_len);

/*
 * sg__h2c_reset: queue RST_STREAM(error_code) for s unless we reset it
 * already.  The stream stays in the engine until its close arrives.  Calls
 * no operation.  Returns 0 or SG_ENOMEM.
 */
int sg__h2c_reset(sg__h2c_t *h, sg__h2c_stream_t *s, uint32_t error_code);

/*
 * sg__h2c_ping: queue a PING and mark it outstanding; ops->ping_acked runs
 * when its ACK arrives.  Returns 0 or SG_ENOMEM.
 */
int sg__h2c_ping(sg__h2c_t *h);

/*
 * sg__h2c_recv: process n bytes from the server; calls the operations from
 * inside.  Returns 0, or SG_EPROTO / SG_ENOMEM when the connection must end
 * (sg__h2c_error says why).
 */
int sg__h2c_recv(sg__h2c_t *h, const uint8_t *p, size_t n);

/*
 * sg__h2c_send: the next bytes to write, valid until the next call into the
 * engine; may call ops->not_sent.  Returns their count, 0 when nothing is
 * pending, or SG_ENOMEM / SG_EPROTO when the connection must end.
 */
ssize_t sg__h2c_send(sg__h2c_t *h, const uint8_t **out);

/* sg__h2c_want_io: nonzero while the session still wants to read or write. */
int sg__h2c_want_io(const sg__h2c_t *h);

/* sg__h2c_idle: nonzero when no stream is open. */
int sg__h2c_idle(const sg__h2c_t *h);

/*
 * sg__h2c_take: unlink and return the oldest open stream, or NULL.  For an
 * owner that ends the connection: the session is not told.
 */
sg__h2c_stream_t *sg__h2c_take(sg__h2c_t *h);

/* sg__h2c_error: text for the nghttp2 error behind the last failure. */
const char *sg__h2c_error(const sg__h2c_t *h);

/* sg__h2c_free: delete the session; streams still open are unlinked (no
 * operations run).  Safe on an engine whose init failed.  Idempotent. */
void sg__h2c_free(sg__h2c_t *h);

/* The outcome of one closed stream. */
typedef struct sg__h2c_result_s {
  int rc;                    /* 0 or an SG_E* code */
  int grpc_status;           /* -1 when none came */
  const uint8_t *resp;       /* rc == 0: the response message, in the */
  size_t resp_len;           /*   stream's buffer (NULL, 0 when empty) */
  char msg[SG__H2C_MSG_MAX]; /* error detail, "" on success */
} sg__h2c_result_t;

/*
 * sg__h2c_result: what a stream that closed with `error_code` delivered,
 * as the call's result: a local error (oversized headers or message, bad
 * prefix), the grpc-status with grpc-message, a reset, an HTTP status
 * mapped to gRPC, or a missing status.  Pure; r->resp points into s.
 */
void sg__h2c_result(const sg__h2c_stream_t *s, uint32_t error_code,
                    size_t max_message, sg__h2c_result_t *r);

#endif /* SG_RPC_H2C_H */
