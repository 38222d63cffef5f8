/*
 * stepguard/rpc_client.h: a blocking, thread-safe, abortable gRPC unary
 * client over one persistent HTTP/2 (h2c, prior knowledge) connection.
 *
 *   sg_rpc_channel_new         connect (with retry and backoff) and return
 *   sg_rpc_channel_call        one unary call; many threads may call at once
 *   sg_rpc_channel_abort       fail every in-flight and later call
 *   sg_rpc_channel_disconnect  drop the connection; the next call reconnects
 *   sg_rpc_channel_connected   whether the connection is up
 *   sg_rpc_channel_free        abort, close, join, free
 *
 * Each channel owns one I/O thread running a private libuv loop.  Calls are
 * request objects handed to that thread; the calling thread waits on a
 * condition variable until its call completes, its deadline passes or the
 * channel is aborted, whichever comes first.  Wire-compatible with tonic
 * (torchft's gRPC servers).  Messages are opaque bytes (serialized protobuf).
 */
#ifndef STEPGUARD_RPC_CLIENT_H
#define STEPGUARD_RPC_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sg_rpc_channel_s sg_rpc_channel_t;

typedef struct sg_rpc_channel_opts_s {
  const char *target;         /* "http://host:port", "host:port", "[::1]:port",
                                 or up to 16 of them comma-separated (replicated
                                 servers): each connect attempt after the first,
                                 after a failed one or a dropped connection, goes
                                 to the next */
  int64_t connect_timeout_ms; /* <= 0: 10000.  Bounds construction's connect
                                 and each later connect attempt */
  const char *auth_token;     /* NULL or "": none; else every call sends
                                 "authorization: Bearer <token>" */
  size_t max_message;         /* response message limit; 0: 64 MiB */
  int64_t keepalive_interval_ms; /* HTTP/2 PING this often while connected
                                    (idle or not); 0: 60000; < 0: never */
  int64_t keepalive_timeout_ms;  /* no PING ACK within this: the connection
                                    is dropped (calls on it fail with
                                    SG_ECONNRESET); <= 0: 20000 */
  int fail_fast; /* 0: a call made while the connection is down waits for a
                    reconnect (with backoff) until its deadline.  1: it
                    waits for one connect attempt (started at once) and
                    fails with that attempt's error
                    if it fails, as gRPC calls that are not wait-for-ready
                    (and tonic's) do: an unreachable server costs a call at
                    most connect_timeout_ms */
} sg_rpc_channel_opts_t;

/*
 * sg_rpc_channel_new: parse o->target, start the I/O thread and connect
 * before returning.  Connect attempts are retried with backoff (100 ms,
 * x1.5, capped at 10 s, plus jitter in [0, 100 ms)) until
 * o->connect_timeout_ms has passed; the channel counts as connected once the
 * server's HTTP/2 SETTINGS arrived.  `o` and its strings are copied.  Blocks
 * up to the connect timeout.  Any thread.  On success *out owns the channel
 * (free with sg_rpc_channel_free).  Returns 0, SG_EINVAL (bad target or
 * token), SG_ENOMEM, or the last connect error: SG_ECONNREFUSED,
 * SG_ENOTFOUND, SG_ETIMEDOUT, SG_EPROTO (the peer does not speak HTTP/2),
 * SG_ECONNRESET, or another -errno; detail in err.
 */
SG_EXPORT int sg_rpc_channel_new(const sg_rpc_channel_opts_t *o,
                                 sg_rpc_channel_t **out, sg_err_t *err);

/*
 * sg_rpc_channel_call: send `req` (req_len bytes, borrowed for the call
 * only) to method `path` ("/pkg.Service/Method") and wait for the response
 * until `deadline`.  Blocks; thread-safe: calls from several threads are
 * multiplexed as concurrent streams on the one connection.  The request
 * carries grpc-timeout for the time left when it is sent.  If the
 * connection is down the call waits for a reconnect (with backoff) within
 * its deadline, or, on a fail_fast channel, for one connect attempt.  A
 * call that was sent is never retried.
 *
 * On return *resp is NULL or an sg_malloc'd copy of the response message
 * (*resp_len bytes; the caller sg_free's it; NULL for 0 bytes and on
 * error).  *grpc_status (may be NULL) is the received grpc-status, or -1
 * when none came.  Returns 0 on grpc-status OK.  Otherwise:
 *   - a non-OK grpc-status s: sg__grpc_status_to_err(s) (SG_EPEER for most,
 *     SG_ETIMEDOUT for DEADLINE_EXCEEDED/CANCELLED, ...) with err->msg
 *     'status: NAME, message: "..."';
 *   - SG_ETIMEDOUT: the deadline passed (the stream is reset with CANCEL);
 *   - SG_EABORTED: sg_rpc_channel_abort() was called;
 *   - SG_ECONNRESET: the connection was lost (or the stream reset) while
 *     the call was in flight;
 *   - SG_ECONNREFUSED (or the last connect error) when the deadline passed
 *     before any connection could be made, or (fail_fast) when the connect
 *     attempt it waited for failed;
 *   - SG_ETOOBIG: the response exceeds max_message (the stream is reset), or
 *     req_len does not fit a gRPC frame;
 *   - SG_EPROTO: a malformed response; SG_EINVAL: bad arguments;
 *   - SG_ESTATE: called in a forked child (nothing is touched);
 *   - SG_ECLOSED: the channel is being freed; SG_ENOMEM.
 */
SG_EXPORT int sg_rpc_channel_call(sg_rpc_channel_t *ch, const char *path,
                                  const uint8_t *req, size_t req_len,
                                  sg_deadline_t deadline, uint8_t **resp,
                                  size_t *resp_len, int *grpc_status,
                                  sg_err_t *err);

/*
 * sg_rpc_channel_abort: from any thread, fail every in-flight call and every
 * later one with SG_EABORTED; waiting callers wake at once.  The I/O thread
 * then resets the streams and closes the connection.  Idempotent.  Never
 * blocks beyond the channel's mutex.  A no-op in a forked child.
 */
SG_EXPORT void sg_rpc_channel_abort(sg_rpc_channel_t *ch);

/*
 * sg_rpc_channel_free: abort, close the connection, join the I/O thread and
 * free `ch` (NULL is a no-op).  Must not run concurrently with any other
 * function on `ch`: every sg_rpc_channel_call must have returned (they
 * return promptly once aborted, so "abort, then wait for the callers, then
 * free" is the shutdown order).  In a forked child it only releases memory:
 * the parent's thread and sockets are left alone.
 */
SG_EXPORT void sg_rpc_channel_free(sg_rpc_channel_t *ch);

/*
 * sg_rpc_channel_connected: nonzero when the connection is currently
 * established (HTTP/2 handshake done); 0 in a forked child.  Any thread;
 * never blocks.
 */
SG_EXPORT int sg_rpc_channel_connected(const sg_rpc_channel_t *ch);

/*
 * sg_rpc_channel_disconnect: drop the current connection now; calls in
 * flight on it fail with SG_ECONNRESET; the next call reconnects.  Waits
 * (at most 1 s) until the I/O thread has shut the socket down, so the server
 * sees the connection close.  Any thread.  A no-op in a forked child or
 * after abort.
 */
SG_EXPORT void sg_rpc_channel_disconnect(sg_rpc_channel_t *ch);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_RPC_CLIENT_H */
