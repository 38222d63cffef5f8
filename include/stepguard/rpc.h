/*
 * stepguard/rpc.h: the gRPC unary server (HTTP/2 over cleartext TCP,
 * prior knowledge, as tonic clients speak it) on a libuv loop.
 *
 *   server   sg_rpc_server_start() binds, sniffs each accepted connection
 *            (HTTP/2 preface -> gRPC, HTTP/1.x request line -> on_http1,
 *            anything else -> closed) and serves unary calls
 *   calls    on_call() receives every complete request; the handler answers
 *            with sg_rpc_call_respond*() now or later, or sees
 *            on_call_cancel() once when the peer resets the stream, the
 *            connection closes, the deadline passes or the server closes
 *   blobs    refcounted immutable response bodies, so one encoded response
 *            can answer many waiting calls without a copy per call
 *
 * Threads: every function here, and every callback, runs on the thread that
 * runs the server's loop.  Nothing blocks.  Unknown methods are the
 * handler's business (answer SG_GRPC_UNIMPLEMENTED, see rpc/grpc.h); the
 * server itself answers malformed requests: INVALID_ARGUMENT for a bad
 * grpc-timeout, RESOURCE_EXHAUSTED for an over-limit message, UNIMPLEMENTED
 * for a compressed one, INTERNAL for a missing or truncated one,
 * DEADLINE_EXCEEDED when a call's deadline passes before its response.
 */
#ifndef STEPGUARD_RPC_H
#define STEPGUARD_RPC_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sg_rpc_server_s sg_rpc_server_t;
typedef struct sg_rpc_call_s sg_rpc_call_t;
typedef struct sg_rpc_blob_s sg_rpc_blob_t; /* refcounted immutable body */

/* Defaults applied to zero-valued options. */
#define SG_RPC_DEFAULT_MAX_MESSAGE ((size_t)4 << 20)
#define SG_RPC_DEFAULT_MAX_CONNECTIONS 4096u
#define SG_RPC_DEFAULT_MAX_STREAMS 128u
#define SG_RPC_DEFAULT_SNIFF_TIMEOUT_MS 10000
#define SG_RPC_DEFAULT_IDLE_TIMEOUT_MS 300000
#define SG_RPC_DEFAULT_DEADLINE_MS 3600000
#define SG_RPC_MAX_HEADER_LIST 16384 /* request header block, bytes */

typedef struct sg_rpc_server_opts_s {
  const char *bind;         /* "[::]:29510", "0.0.0.0:0", "localhost:1234" */
  size_t max_message;       /* request message limit; 0 = 4 MiB */
  unsigned max_connections; /* 0 = 4096; over it: accepted and closed */
  unsigned max_streams;     /* per connection; 0 = 128 */
  int64_t sniff_timeout_ms; /* first bytes must arrive within; 0 = 10 s */
  int64_t
      idle_timeout_ms; /* no streams, no bytes for this long: close; or a
                          peer that reads nothing for this long; 0 = 300 s */
  int64_t default_deadline_ms; /* calls without grpc-timeout; 0 = 1 h */
  /* A complete request arrived.  The call is the handler's until it calls
     sg_rpc_call_respond*() or on_call_cancel() runs.  Required. */
  void (*on_call)(void *ud, sg_rpc_call_t *call);
  /* The call ended before a response: RST_STREAM from the peer, connection
     closed, deadline passed (the peer then gets DEADLINE_EXCEEDED) or the
     server closed.  Exactly once; `call` is invalid after return and may not
     be responded to from inside.  Required. */
  void (*on_call_cancel)(void *ud, sg_rpc_call_t *call);
  /* An HTTP/2 connection closed, after the cancels of its calls.  May be
     NULL. */
  void (*on_conn_close)(void *ud, uint64_t conn_id);
  /* An HTTP/1.x connection: ownership of `fd` passes to the callee.  Its
     first bytes were only peeked (still readable); the fd is non-blocking,
     CLOEXEC and still in the fork registry (close it with sg_sock_close()).
     NULL: such connections are closed. */
  void (*on_http1)(void *ud, int fd);
  void *ud; /* passed to every callback */
} sg_rpc_server_opts_t;

/*
 * sg_rpc_server_start: bind `o->bind` and serve on `loop`.  `o` is copied
 * (`bind` need not outlive the call).  On success *out is the server, which
 * lives until sg_rpc_server_close() completes.  Returns 0, SG_EINVAL (bad
 * options or address), SG_ENOTFOUND, SG_EADDRINUSE, SG_ENOMEM or another
 * -errno, with detail in `err` (may be NULL); on error no callback is ever
 * called.  Loop thread only.
 */
SG_EXPORT int sg_rpc_server_start(uv_loop_t *loop,
                                  const sg_rpc_server_opts_t *o,
                                  sg_rpc_server_t **out, sg_err_t *err);

/* sg_rpc_server_port: the bound TCP port (useful with port 0). */
SG_EXPORT int sg_rpc_server_port(const sg_rpc_server_t *s);

/*
 * sg_rpc_server_connection_count: connections open now, counting those whose
 * protocol is not known yet and not counting those being closed.
 */
SG_EXPORT size_t sg_rpc_server_connection_count(const sg_rpc_server_t *s);

/*
 * sg_rpc_server_close: stop listening, cancel every open call (on_call_cancel
 * for each dispatched one, before this returns unless called from inside a
 * callback of the same connection), close every connection (on_conn_close),
 * then call closed_cb(ud) (may be NULL) from the loop, never from inside this
 * function.  The server is freed after closed_cb returns.  Calling it twice is
 * a no-op.  Loop thread only; may be called from any server callback.
 */
SG_EXPORT void sg_rpc_server_close(sg_rpc_server_t *s,
                                   void (*closed_cb)(void *ud), void *ud);

/* ---- calls: valid from on_call() until respond or on_call_cancel ------- */

/* sg_rpc_call_method: the ":path", e.g. "/torchft.LighthouseService/Quorum".
 */
SG_EXPORT const char *sg_rpc_call_method(const sg_rpc_call_t *c);

/* sg_rpc_call_body: the request message without its 5-byte prefix; the
   bytes stay valid while the call is.  *len may be 0 (an empty message). */
SG_EXPORT const uint8_t *sg_rpc_call_body(const sg_rpc_call_t *c, size_t *len);

/* sg_rpc_call_deadline: absolute sg_now_ns() deadline (grpc-timeout, else
   default_deadline_ms, whichever is sooner). */
SG_EXPORT sg_deadline_t sg_rpc_call_deadline(const sg_rpc_call_t *c);

/* sg_rpc_call_metadata: the value of request header `key` (lower case, e.g.
   "authorization"), or NULL if absent; the first one if repeated.  Values of
   "-bin" keys are returned as sent (base64). */
SG_EXPORT const char *sg_rpc_call_metadata(const sg_rpc_call_t *c,
                                           const char *key);

/* sg_rpc_call_conn_id: the connection's id, unique for the server's life. */
SG_EXPORT uint64_t sg_rpc_call_conn_id(const sg_rpc_call_t *c);

/* sg_rpc_call_set_user / sg_rpc_call_user: one pointer for the handler. */
SG_EXPORT void sg_rpc_call_set_user(sg_rpc_call_t *c, void *p);
SG_EXPORT void *sg_rpc_call_user(const sg_rpc_call_t *c);

/*
 * sg_rpc_call_respond: finish `c`.  grpc_status SG_GRPC_OK sends `body`
 * (copied; may be NULL when len is 0) then trailers with grpc-status 0; any
 * other status sends trailers-only with grpc-status and the percent-encoded
 * `message` (may be NULL; truncated to 1 KiB).  The call is consumed whatever
 * this returns: it is invalid after, and on_call_cancel() is not called for
 * it.  Returns 0; SG_ECLOSED when the connection is going away (nothing is
 * sent); SG_ETOOBIG when len > 4 GiB - 1 or SG_ENOMEM (the stream is reset
 * instead); SG_EINVAL when `c` is NULL; SG_ESTATE from inside its own
 * on_call_cancel().  Bytes go out from the loop shortly after (never
 * from inside this function).  Loop thread only.
 */
SG_EXPORT int sg_rpc_call_respond(sg_rpc_call_t *c, int grpc_status,
                                  const char *message, const uint8_t *body,
                                  size_t len);

/*
 * sg_rpc_blob_new: an immutable copy of body[0..len) with one reference.
 * Returns NULL on SG_ENOMEM or when len > 4 GiB - 1.
 */
SG_EXPORT sg_rpc_blob_t *sg_rpc_blob_new(const uint8_t *body, size_t len);

/*
 * sg_rpc_blob_alloc: a blob of `len` bytes with one reference, for the
 * caller to fill through *data before it first responds with it (so a
 * body can be written in place instead of copied).  Returns NULL on
 * SG_ENOMEM or when len > 4 GiB - 1.
 */
SG_EXPORT sg_rpc_blob_t *sg_rpc_blob_alloc(size_t len, uint8_t **data);

/* sg_rpc_blob_unref: drop one reference (NULL is a no-op).  Loop thread. */
SG_EXPORT void sg_rpc_blob_unref(sg_rpc_blob_t *b);

/*
 * sg_rpc_call_respond_blob: sg_rpc_call_respond(c, SG_GRPC_OK, ...) with the
 * shared body `b`; takes its own reference (the caller keeps its own).
 * Returns as sg_rpc_call_respond; SG_EINVAL when `b` is NULL (the call is
 * still consumed, the stream reset).
 */
SG_EXPORT int sg_rpc_call_respond_blob(sg_rpc_call_t *c, sg_rpc_blob_t *b);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_RPC_H */
