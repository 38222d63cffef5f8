/*
 * client_io.c: the I/O thread of an rpc client channel (client_int.h; the
 * channel's threading and fork rules are in client.c).
 *
 * Map of this file:
 *   completion        io_finish / io_release: a call's end on this thread
 *   connection        conn_t: one socket + one HTTP/2 client engine
 *                     (rpc/h2c.h, which does no I/O), watched by a
 *                     uv_poll_t; read, flush, drop
 *   engine operations a stream closed (its result, sg__h2c_result), was
 *                     not sent, or the keepalive PING was acknowledged
 *   connect machine   IDLE -> CONNECTING -> HANDSHAKE -> CONNECTED
 *                     (-> DRAINING after GOAWAY), BACKOFF between attempts
 *   submission        drive (the one place that decides what happens next)
 *   deadlines         the timer that ends asynchronous calls on time
 *   the thread        wake_cb (submissions, cancels, abort, disconnect,
 *                     close), io_main, sg__rpcc_io_start
 *
 * Only this thread touches the socket, the loop's handles and the engine;
 * it takes the channel's mutex `mu` only around the fields it shares with
 * callers, never inside an engine operation.
 */
#include "rpc/client_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc/grpc.h"

static const char *const state_names[] = {
    "IDLE",      "BACKOFF",  "CONNECTING", "HANDSHAKE",
    "CONNECTED", "DRAINING", "CLOSED",
};

static void set_state(sg_rpc_channel_t *ch, conn_state_t st) {
  if (ch->state != st)
    sg_log(SG_LOG_TRACE, LOG, "%s: %s -> %s", ch->target,
           state_names[ch->state], state_names[st]);
  ch->state = st;
}

static uint64_t rng_next(sg_rpc_channel_t *ch) {
  uint64_t x = ch->rng;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  ch->rng = x;
  return x * 0x2545F4914F6CDD1DULL;
}

/* ---- completion ---------------------------------------------------------- */

/* I/O thread: complete `c` and wake its caller, or run its callback.
 * Both happen after mu is released, so that a woken caller does not wake
 * only to block on mu (and be woken a second time), and a callback may
 * start another call; the I/O thread's reference keeps `c` alive until
 * io_release. */
static void io_finish(sg_rpc_channel_t *ch, call_t *c, int rc, int grpc_status,
                      uint8_t *resp, size_t resp_len, const char *msg) {
  uint8_t *r = NULL;
  size_t rl = 0;
  pthread_mutex_lock(&ch->mu);
  int woke = sg__rpcc_complete_locked(c, rc, grpc_status, resp, resp_len, msg);
  if (woke && c->cb) { /* the callback owns the response */
    r = c->resp;
    rl = c->resp_len;
    c->resp = NULL;
    c->resp_len = 0;
  }
  pthread_mutex_unlock(&ch->mu);
  if (!woke)
    return;
  if (c->cb) /* rc, grpc_status and msg are final once done */
    c->cb(c->cb_ud, c->rc, c->grpc_status, r, rl, c->msg);
  else
    pthread_cond_signal(&c->cv);
}

/* I/O thread: unlink `c` from its I/O list (its stream has left the engine
 * already) and drop the I/O reference. */
static void io_release(sg_rpc_channel_t *ch, call_t *c) {
  link_del(&c->io);
  sg__h2c_stream_fini(&c->st);
  pthread_mutex_lock(&ch->mu);
  int last = sg__rpcc_unref_locked(c);
  pthread_mutex_unlock(&ch->mu);
  if (last)
    sg__rpcc_call_free(c);
}

/* I/O thread: complete and release every call in `list`. */
static void io_fail_list(sg_rpc_channel_t *ch, link_t *list, int rc,
                         const char *msg) {
  while (!link_empty(list)) {
    call_t *c = CONTAINER(list->next, call_t, io);
    io_finish(ch, c, rc, -1, NULL, 0, msg);
    io_release(ch, c);
  }
}

/* ---- connection ---------------------------------------------------------- */

static void drive(sg_rpc_channel_t *ch);
static void conn_fail(sg_rpc_channel_t *ch, int rc, const char *msg);
static void poll_cb(uv_poll_t *p, int status, int events);

static void conn_close_cb(uv_handle_t *h) {
  conn_t *conn = h->data;
  sg_sock_close(conn->fd);
  sg_buf_free(&conn->wbuf);
  sg_free(conn);
}

/*
 * conn_drop: tear down ch->conn: every call on it completes with rc/msg,
 * the session is deleted, the socket is shut down at once (the peer sees it
 * close) and closed in the poll handle's close callback.  Never called from
 * inside an engine operation.
 */
static void conn_drop(sg_rpc_channel_t *ch, int rc, const char *msg) {
  conn_t *conn = ch->conn;
  if (!conn)
    return;
  ch->conn = NULL;
  uv_timer_stop(&ch->ka_timer);
  /* Not connected any more before any caller wakes up with the error. */
  atomic_store(&ch->connected, 0);
  pthread_mutex_lock(&ch->mu);
  ch->conn_up = 0;
  pthread_mutex_unlock(&ch->mu);
  if (conn->h2_live) {
    sg__h2c_stream_t *s;
    while ((s = sg__h2c_take(&conn->h2)) != NULL) {
      call_t *c = CONTAINER(s, call_t, st);
      io_finish(ch, c, rc, -1, NULL, 0, msg);
      io_release(ch, c);
    }
    sg__h2c_free(&conn->h2);
    conn->h2_live = 0;
  }
  shutdown(conn->fd, SHUT_RDWR);
  uv_poll_stop(&conn->poll);
  uv_close((uv_handle_t *)&conn->poll, conn_close_cb);
}

static int conn_set_events(conn_t *conn, unsigned events) {
  if (events == conn->events)
    return 0;
  int r = uv_poll_start(&conn->poll, (int)events, poll_cb);
  if (r == 0)
    conn->events = events;
  return r;
}

/*
 * conn_flush: write what the engine has to send.  Frames from
 * sg__h2c_send are gathered into the connection's buffer (up to
 * GATHER_MAX bytes) and go out with one send(), so a request's HEADERS and
 * DATA leave as one segment and wake the server once; repeats until the
 * socket is full, nothing is left, or WRITE_BUDGET sends went out.  Waits
 * for writability only when something is left.  Returns 0 or an SG_E* code
 * (the caller drops the connection).
 */
static int conn_flush(conn_t *conn) {
  int more = 0;
  for (int i = 0; i < WRITE_BUDGET; i++) {
    int drained = 0;
    while (conn->h2_live && conn->wbuf.len < GATHER_MAX) {
      const uint8_t *p;
      ssize_t len = sg__h2c_send(&conn->h2, &p);
      if (len < 0)
        return (int)len;
      if (len == 0) {
        drained = 1;
        break;
      }
      int rc = sg_buf_append(&conn->wbuf, p, (size_t)len);
      if (rc)
        return rc;
    }
    if (conn->wbuf.len == 0)
      break;
    ssize_t n =
        send(conn->fd, sg_buf_head(&conn->wbuf), conn->wbuf.len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        more = 1;
        break;
      }
      return -errno;
    }
    sg_buf_consume(&conn->wbuf, (size_t)n);
    if (conn->wbuf.len) {
      more = 1;
      break;
    }
    if (drained || !conn->h2_live)
      break;
    if (i == WRITE_BUDGET - 1)
      more = 1; /* budget spent: come back when writable */
  }
  int r = conn_set_events(conn, UV_READABLE | (more ? UV_WRITABLE : 0u));
  return r ? SG_EIO : 0;
}

/*
 * conn_after_io: flush, then decide whether the session is finished (both
 * sides done, or draining with no streams left) and drop it if so.
 */
static void conn_after_io(sg_rpc_channel_t *ch) {
  conn_t *conn = ch->conn;
  if (!conn || !conn->h2_live)
    return;
  int rc = conn_flush(conn);
  if (rc) {
    char m[128];
    snprintf(m, sizeof(m), "write to %s: %s", ch->target, sg_strerror(rc));
    conn_fail(ch, rc == SG_EPROTO ? SG_EPROTO : SG_ECONNRESET, m);
    return;
  }
  if (ch->state == ST_CONNECTED && conn->h2.goaway)
    set_state(ch, ST_DRAINING);
  int finished = !sg__h2c_want_io(&conn->h2) && conn->wbuf.len == 0;
  if (ch->state == ST_DRAINING && sg__h2c_idle(&conn->h2))
    finished = 1;
  if (finished) {
    char m[160];
    uint32_t sent = conn->h2.sent_goaway_err;
    if (sent)
      snprintf(m, sizeof(m), "HTTP/2 protocol error from %s (%s)", ch->target,
               nghttp2_http2_strerror(sent));
    else
      snprintf(m, sizeof(m), "connection to %s closed by the server",
               ch->target);
    conn_fail(ch, sent ? SG_EPROTO : SG_ECONNRESET, m);
  }
}

/* Reads up to READ_BUDGET chunks and feeds them to the engine. */
static void conn_read(sg_rpc_channel_t *ch, conn_t *conn) {
  for (int i = 0; i < READ_BUDGET; i++) {
    ssize_t n = recv(conn->fd, conn->rdbuf, sizeof(conn->rdbuf), 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return;
      char m[128];
      int rc = -errno;
      snprintf(m, sizeof(m), "read from %s: %s", ch->target, sg_strerror(rc));
      conn_fail(ch, SG_ECONNRESET, m);
      return;
    }
    if (n == 0) {
      char m[128];
      snprintf(m, sizeof(m), "connection to %s closed by the server",
               ch->target);
      conn_fail(ch, SG_ECONNRESET, m);
      return;
    }
    int rv = sg__h2c_recv(&conn->h2, conn->rdbuf, (size_t)n);
    if (rv) {
      char m[160];
      snprintf(m, sizeof(m), "HTTP/2 error from %s: %s", ch->target,
               sg__h2c_error(&conn->h2));
      conn_fail(ch, rv, m);
      return;
    }
    if ((size_t)n < sizeof(conn->rdbuf))
      return;
  }
}

/* ---- engine operations (never drop the connection; they only complete) --- */

static void ka_cb(uv_timer_t *t);

/*
 * complete_stream: the call's result from what its stream delivered
 * (sg__h2c_result, pure) plus a copy of the response message.
 */
static void complete_stream(sg_rpc_channel_t *ch, call_t *c,
                            uint32_t error_code) {
  sg__h2c_result_t r;
  uint8_t *resp = NULL;
  sg__h2c_result(&c->st, error_code, ch->max_message, &r);
  if (r.rc == 0 && r.resp_len > 0) {
    resp = sg_malloc(r.resp_len);
    if (!resp) {
      r.rc = SG_ENOMEM;
      r.resp_len = 0;
      snprintf(r.msg, sizeof(r.msg), "out of memory");
    } else {
      memcpy(resp, r.resp, r.resp_len);
    }
  }
  io_finish(ch, c, r.rc, r.grpc_status, resp, r.resp_len, r.msg);
}

/* The stream of a call closed: complete the call and release it. */
static void h2_closed(void *owner, sg__h2c_stream_t *s, uint32_t error_code) {
  conn_t *conn = owner;
  call_t *c = CONTAINER(s, call_t, st);
  complete_stream(conn->ch, c, error_code);
  io_release(conn->ch, c);
}

/* A request whose HEADERS could not be sent (e.g. after GOAWAY). */
static void h2_not_sent(void *owner, sg__h2c_stream_t *s, const char *why) {
  conn_t *conn = owner;
  call_t *c = CONTAINER(s, call_t, st);
  char m[128];
  snprintf(m, sizeof(m), "%s: request not sent (%s)", c->path, why);
  io_finish(conn->ch, c, SG_ECONNRESET, -1, NULL, 0, m);
  io_release(conn->ch, c);
}

/* The keepalive PING was answered: the next one is due an interval later. */
static void h2_ping_acked(void *owner) {
  conn_t *conn = owner;
  sg_rpc_channel_t *ch = conn->ch;
  uv_timer_start(&ch->ka_timer, ka_cb, (uint64_t)ch->ka_interval_ms, 0);
}

static const sg__h2c_ops_t h2_ops = {h2_closed, h2_not_sent, h2_ping_acked};

/* ---- connect machine ----------------------------------------------------- */

static void timer_cb(uv_timer_t *t);

static int want_connection(sg_rpc_channel_t *ch) {
  return !link_empty(&ch->pending) ||
         (ch->ctor_until && sg_now_ns() < ch->ctor_until);
}

static void free_addrs(sg_rpc_channel_t *ch) {
  if (ch->ai)
    freeaddrinfo(ch->ai);
  ch->ai = ch->ai_cur = NULL;
}

/*
 * attempt_failed: one connect attempt (all addresses) failed with rc/msg:
 * remember the error for callers (on a fail_fast channel, fail the queued
 * calls with it), then back off if someone still wants a connection (delay
 * = backoff + jitter in [0, 100 ms); backoff grows x1.5 up to 10 s), else go
 * idle.  A fail_fast channel therefore only backs off while it is being
 * constructed: a later call finds it idle and starts an attempt at once.
 */
static void attempt_failed(sg_rpc_channel_t *ch, int rc, const char *msg) {
  uv_timer_stop(&ch->timer);
  free_addrs(ch);
  pthread_mutex_lock(&ch->mu);
  sg_err_set(&ch->last_err, rc, "%s", msg);
  pthread_mutex_unlock(&ch->mu);
  sg_log(SG_LOG_DEBUG, LOG, "connect attempt failed: %s", msg);
  if (ch->fail_fast)
    io_fail_list(ch, &ch->pending, rc, msg);
  if (!want_connection(ch)) {
    set_state(ch, ST_IDLE);
    return;
  }
  int64_t delay = ch->backoff_ms + (int64_t)(rng_next(ch) % BACKOFF_JITTER_MS);
  ch->backoff_ms = ch->backoff_ms * 3 / 2;
  if (ch->backoff_ms > BACKOFF_MAX_MS)
    ch->backoff_ms = BACKOFF_MAX_MS;
  set_state(ch, ST_BACKOFF);
  uv_timer_start(&ch->timer, timer_cb, (uint64_t)delay, 0);
}

static void handshake_done(sg_rpc_channel_t *ch) {
  uv_timer_stop(&ch->timer);
  free_addrs(ch);
  ch->backoff_ms = BACKOFF_INITIAL_MS;
  ch->ctor_until = 0;
  set_state(ch, ST_CONNECTED);
  if (ch->ka_interval_ms > 0)
    uv_timer_start(&ch->ka_timer, ka_cb, (uint64_t)ch->ka_interval_ms, 0);
  atomic_store(&ch->connected, 1);
  pthread_mutex_lock(&ch->mu);
  ch->conn_up = 1;
  sg_err_clear(&ch->last_err);
  pthread_mutex_unlock(&ch->mu);
  pthread_cond_broadcast(&ch->cv);
  sg_log(SG_LOG_DEBUG, LOG, "connected to %s", ch->target);
}

/* TCP is up: start the HTTP/2 session (preface + SETTINGS). */
static void tcp_connected(sg_rpc_channel_t *ch) {
  conn_t *conn = ch->conn;
  sg__h2c_config_t cfg = {.authority = ch->tg[ch->cur_tg].authority,
                          .max_message = ch->max_message};
  if (sg__h2c_init(&conn->h2, &cfg, &h2_ops, conn) != 0) {
    char m[128];
    snprintf(m, sizeof(m), "HTTP/2 session setup: %s",
             sg__h2c_error(&conn->h2));
    conn_drop(ch, SG_ENOMEM, m);
    attempt_failed(ch, SG_ENOMEM, m);
    return;
  }
  conn->h2_live = 1;
  set_state(ch, ST_HANDSHAKE);
  conn_after_io(ch);
}

/* Tries the remaining addresses of this attempt, one at a time. */
static void connect_next(sg_rpc_channel_t *ch, int rc) {
  while (ch->ai_cur) {
    struct addrinfo *ai = ch->ai_cur;
    ch->ai_cur = ai->ai_next;
    int fd =
        socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      rc = -errno;
      continue;
    }
    int r = sg_sock_register(fd);
    if (r) {
      close(fd);
      rc = r;
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int cr;
    do
      cr = connect(fd, ai->ai_addr, ai->ai_addrlen);
    while (cr < 0 && errno == EINTR);
    if (cr < 0 && errno != EINPROGRESS) {
      rc = -errno;
      sg_sock_close(fd);
      continue;
    }
    conn_t *conn = sg_calloc(1, sizeof(*conn));
    if (!conn || uv_poll_init(&ch->loop, &conn->poll, fd) != 0) {
      sg_free(conn);
      sg_sock_close(fd);
      rc = SG_ENOMEM;
      continue;
    }
    conn->poll.data = conn;
    conn->ch = ch;
    conn->fd = fd;
    sg_buf_init(&conn->wbuf, WBUF_MAX);
    ch->conn = conn;
    if (cr == 0) {
      tcp_connected(ch);
      return;
    }
    if (conn_set_events(conn, UV_WRITABLE) != 0) {
      conn_drop(ch, SG_EIO, "poll failed");
      rc = SG_EIO;
      continue;
    }
    return;
  }
  char m[256];
  snprintf(m, sizeof(m), "connect to %s: %s", ch->target, sg_strerror(rc));
  attempt_failed(ch, rc, m);
}

/* Starts one connect attempt: resolve, then try each address in turn. */
static void attempt_start(sg_rpc_channel_t *ch) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  free_addrs(ch);
  /* several targets (replicated lighthouses): every attempt after the first
   * (the last one failed, or its connection was dropped: a dead or demoted
   * server) goes to the next target */
  if (ch->attempts++ > 0 && ch->n_tg > 1)
    ch->cur_tg = (ch->cur_tg + 1) % ch->n_tg;
  set_state(ch, ST_CONNECTING);
  uv_timer_start(&ch->timer, timer_cb, (uint64_t)ch->connect_timeout_ms, 0);
  int r = getaddrinfo(ch->tg[ch->cur_tg].host, ch->tg[ch->cur_tg].port_str,
                      &hints, &ch->ai);
  if (r != 0) {
    char m[256];
    ch->ai = NULL;
    snprintf(m, sizeof(m), "resolve %s: %s", ch->target, gai_strerror(r));
    attempt_failed(ch, SG_ENOTFOUND, m);
    return;
  }
  ch->ai_cur = ch->ai;
  connect_next(ch, SG_ENOTFOUND);
}

/* The timer: the backoff delay ended, or the attempt timed out. */
static void timer_cb(uv_timer_t *t) {
  sg_rpc_channel_t *ch = t->data;
  char m[160];
  switch (ch->state) {
  case ST_BACKOFF:
    if (want_connection(ch))
      attempt_start(ch);
    else
      set_state(ch, ST_IDLE);
    break;
  case ST_CONNECTING:
  case ST_HANDSHAKE:
    snprintf(m, sizeof(m), "connect to %s: %s after %lld ms", ch->target,
             ch->state == ST_CONNECTING ? "timed out"
                                        : "no HTTP/2 SETTINGS from server",
             (long long)ch->connect_timeout_ms);
    conn_drop(ch, SG_ETIMEDOUT, m);
    attempt_failed(ch, SG_ETIMEDOUT, m);
    break;
  default:
    break;
  }
}

/*
 * conn_fail: the connection broke with rc/msg.  During CONNECTING that
 * fails one address; during HANDSHAKE the attempt; later it fails the calls
 * on it and lets drive() reconnect for the queued ones.
 */
static void conn_fail(sg_rpc_channel_t *ch, int rc, const char *msg) {
  conn_state_t st = ch->state;
  conn_drop(ch, rc, msg);
  if (st == ST_CONNECTING) {
    connect_next(ch, rc);
  } else if (st == ST_HANDSHAKE) {
    attempt_failed(ch, rc, msg);
  } else if (st == ST_CONNECTED || st == ST_DRAINING) {
    sg_log(SG_LOG_DEBUG, LOG, "connection lost: %s", msg);
    set_state(ch, ST_IDLE);
    drive(ch);
  }
}

/*
 * ka_cb: keepalive.  Sends a PING every ka_interval_ms while connected (like
 * tonic's keep-alive-while-idle); if its ACK has not come ka_timeout_ms
 * later, the peer is presumed gone (a partition or a dead host sends no
 * RST) and the connection is dropped so that the next call reconnects.
 */
static void ka_cb(uv_timer_t *t) {
  sg_rpc_channel_t *ch = t->data;
  conn_t *conn = ch->conn;
  if (!conn || !conn->h2_live ||
      (ch->state != ST_CONNECTED && ch->state != ST_DRAINING))
    return;
  if (conn->h2.ping_outstanding) {
    char m[160];
    snprintf(m, sizeof(m), "connection to %s: no keepalive PING ACK in %lld ms",
             ch->target, (long long)ch->ka_timeout_ms);
    conn_fail(ch, SG_ECONNRESET, m);
    return;
  }
  if (sg__h2c_ping(&conn->h2) != 0)
    return;
  uv_timer_start(&ch->ka_timer, ka_cb, (uint64_t)ch->ka_timeout_ms, 0);
  conn_after_io(ch);
}

static void poll_cb(uv_poll_t *p, int status, int events) {
  conn_t *conn = p->data;
  sg_rpc_channel_t *ch = conn->ch;
  if (ch->conn != conn)
    return;
  /* libuv reports POLLERR as a failed status: SO_ERROR says what it was. */
  int soerr = 0;
  if (status < 0 || ch->state == ST_CONNECTING) {
    socklen_t sl = sizeof(soerr);
    if (getsockopt(conn->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
      soerr = errno;
    if (!soerr && status < 0)
      soerr = ECONNRESET;
  }
  if (status < 0 && ch->state != ST_CONNECTING) {
    char m[128];
    snprintf(m, sizeof(m), "connection to %s: %s", ch->target,
             sg_strerror(-soerr));
    conn_fail(ch, SG_ECONNRESET, m);
    return;
  }
  if (ch->state == ST_CONNECTING) {
    if (soerr) {
      conn_drop(ch, -soerr, "connect failed");
      connect_next(ch, -soerr);
    } else {
      tcp_connected(ch);
    }
    return;
  }
  if (events & (UV_READABLE | UV_DISCONNECT)) {
    conn_read(ch, conn);
    if (ch->conn != conn)
      return;
    if (ch->state == ST_HANDSHAKE && conn->h2.got_settings)
      handshake_done(ch);
  }
  drive(ch);
}

/* ---- submission ---------------------------------------------------------- */

/* Opens a stream for each queued call (CONNECTED only). */
static void submit_pending(sg_rpc_channel_t *ch) {
  conn_t *conn = ch->conn;
  while (!link_empty(&ch->pending)) {
    call_t *c = CONTAINER(ch->pending.next, call_t, io);
    int64_t left = c->deadline - sg_now_ns();
    if (left <= 0) {
      io_finish(ch, c, SG_ETIMEDOUT, -1, NULL, 0, "deadline exceeded");
      io_release(ch, c);
      continue;
    }
    char tmo[16];
    sg__grpc_timeout_format(left, tmo);
    sg__h2c_header_t extra[] = {{"grpc-timeout", tmo},
                                {"authorization", ch->auth_value}};
    int rc = sg__h2c_submit(&conn->h2, &c->st, c->path, extra,
                            ch->auth_value ? 2 : 1, c->body, c->body_len);
    if (rc) {
      char m[128];
      snprintf(m, sizeof(m), "%s: cannot submit: %s", c->path,
               sg__h2c_error(&conn->h2));
      io_finish(ch, c, rc == SG_ENOMEM ? SG_ENOMEM : SG_ECONNRESET, -1, NULL, 0,
                m);
      io_release(ch, c);
      continue;
    }
    link_del(&c->io);
    pthread_mutex_lock(&ch->mu);
    c->on_wire = 1;
    pthread_mutex_unlock(&ch->mu);
  }
}

/*
 * drive: the one place that decides the next step: open streams and flush
 * when connected, start a connect sequence when idle and wanted (a fresh
 * sequence starts with no delay), stop backing off when nobody waits.
 */
static void drive(sg_rpc_channel_t *ch) {
  switch (ch->state) {
  case ST_IDLE:
    if (want_connection(ch)) {
      ch->backoff_ms = BACKOFF_INITIAL_MS;
      attempt_start(ch);
    }
    break;
  case ST_BACKOFF:
    if (!want_connection(ch)) {
      uv_timer_stop(&ch->timer);
      set_state(ch, ST_IDLE);
    }
    break;
  case ST_CONNECTED:
    submit_pending(ch);
    conn_after_io(ch);
    break;
  case ST_DRAINING:
  case ST_HANDSHAKE:
    conn_after_io(ch);
    break;
  default:
    break;
  }
}

/* ---- deadlines of asynchronous calls --------------------------------------
 */
/* deadline_msg: sg__rpcc_deadline_locked, taking mu. */
static int deadline_msg(sg_rpc_channel_t *ch, const call_t *c, char *m,
                        size_t cap) {
  pthread_mutex_lock(&ch->mu);
  int code = sg__rpcc_deadline_locked(ch, c, m, cap);
  pthread_mutex_unlock(&ch->mu);
  return code;
}

static void dl_cb(uv_timer_t *t);

/* dl_arm: (re)arm the deadline timer for the earliest asynchronous call
 * still running (queued, or on the wire and not reset), or stop it. */
static void dl_arm(sg_rpc_channel_t *ch) {
  sg_deadline_t next = INT64_MAX;
  for (link_t *l = ch->pending.next; l != &ch->pending; l = l->next) {
    call_t *c = CONTAINER(l, call_t, io);
    if (c->cb && c->deadline < next)
      next = c->deadline;
  }
  if (ch->conn)
    for (sg__h2c_stream_t *s = ch->conn->h2.streams; s; s = s->next) {
      call_t *c = CONTAINER(s, call_t, st);
      if (c->cb && !s->rst_sent && c->deadline < next)
        next = c->deadline;
    }
  if (ch->state == ST_CLOSED || next == INT64_MAX) {
    uv_timer_stop(&ch->dl_timer);
    return;
  }
  int64_t left = next - sg_now_ns();
  uint64_t ms = left <= 0 ? 0 : (uint64_t)((left + 999999) / 1000000);
  uv_timer_start(&ch->dl_timer, dl_cb, ms, 0);
}

/* dl_cb: end every asynchronous call whose deadline passed: a queued one
 * leaves the queue, one on the wire is reset with CANCEL (its stream's
 * close then releases it), and each completes with its deadline error. */
static void dl_cb(uv_timer_t *t) {
  sg_rpc_channel_t *ch = t->data;
  sg_deadline_t now = sg_now_ns();
  char m[sizeof(((call_t *)0)->msg)];
  link_t expired;
  link_init(&expired);
  for (link_t *l = ch->pending.next, *nx; l != &ch->pending; l = nx) {
    nx = l->next;
    call_t *c = CONTAINER(l, call_t, io);
    if (c->cb && c->deadline <= now) {
      link_del(&c->io);
      link_push(&expired, &c->io);
    }
  }
  while (!link_empty(&expired)) {
    call_t *c = CONTAINER(expired.next, call_t, io);
    int code = deadline_msg(ch, c, m, sizeof(m));
    io_finish(ch, c, code, -1, NULL, 0, m);
    io_release(ch, c);
  }
  if (ch->conn && ch->conn->h2_live) {
    for (sg__h2c_stream_t *s = ch->conn->h2.streams; s; s = s->next) {
      call_t *c = CONTAINER(s, call_t, st);
      if (!c->cb || s->rst_sent || c->deadline > now)
        continue;
      (void)sg__h2c_reset(&ch->conn->h2, s, NGHTTP2_CANCEL);
      int code = deadline_msg(ch, c, m, sizeof(m));
      io_finish(ch, c, code, -1, NULL, 0, m);
    }
  }
  drive(ch);
  dl_arm(ch);
}

/* Closing: drop everything and close the loop's handles so uv_run returns. */
static void io_shutdown(sg_rpc_channel_t *ch) {
  conn_drop(ch, SG_EABORTED, "channel closed");
  io_fail_list(ch, &ch->pending, SG_EABORTED, "channel closed");
  free_addrs(ch);
  uv_timer_stop(&ch->timer);
  uv_timer_stop(&ch->ka_timer);
  uv_timer_stop(&ch->dl_timer);
  set_state(ch, ST_CLOSED);
  uv_close((uv_handle_t *)&ch->timer, NULL);
  uv_close((uv_handle_t *)&ch->ka_timer, NULL);
  uv_close((uv_handle_t *)&ch->dl_timer, NULL);
  uv_close((uv_handle_t *)&ch->wake, NULL);
}

/*
 * wake_cb: take new submissions, prune cancelled calls (reset their streams
 * with CANCEL), and carry out abort, disconnect and close requests.
 */
static void wake_cb(uv_async_t *a) {
  sg_rpc_channel_t *ch = a->data;
  link_t dead;
  link_init(&dead);
  if (ch->state == ST_CLOSED)
    return;
  pthread_mutex_lock(&ch->mu);
  while (!link_empty(&ch->submitq)) {
    call_t *c = CONTAINER(ch->submitq.next, call_t, sq);
    link_del(&c->sq);
    link_push(&ch->pending, &c->io);
  }
  int closing = ch->closing, aborted = ch->aborted;
  if (ch->cancel_pending || aborted) {
    ch->cancel_pending = 0;
    for (link_t *l = ch->pending.next, *nx; l != &ch->pending; l = nx) {
      nx = l->next;
      call_t *c = CONTAINER(l, call_t, io);
      if (c->cancelled) {
        link_del(&c->io);
        link_push(&dead, &c->io);
      }
    }
    if (ch->conn && ch->conn->h2_live) {
      for (sg__h2c_stream_t *s = ch->conn->h2.streams; s; s = s->next) {
        call_t *c = CONTAINER(s, call_t, st);
        if (c->cancelled) /* resets once; calls no operation */
          (void)sg__h2c_reset(&ch->conn->h2, s, NGHTTP2_CANCEL);
      }
    }
  }
  uint64_t disc = ch->disc_req;
  pthread_mutex_unlock(&ch->mu);
  io_fail_list(ch, &dead, SG_ECANCELED, "cancelled");

  if (closing) {
    io_shutdown(ch);
    return;
  }
  if (aborted) {
    conn_drop(ch, SG_EABORTED, "channel aborted");
    io_fail_list(ch, &ch->pending, SG_EABORTED, "channel aborted");
    free_addrs(ch);
    uv_timer_stop(&ch->timer);
    ch->ctor_until = 0;
    set_state(ch, ST_IDLE);
  } else if (disc != ch->disc_handled) {
    conn_drop(ch, SG_ECONNRESET, "disconnected by sg_rpc_channel_disconnect");
    free_addrs(ch);
    uv_timer_stop(&ch->timer);
    set_state(ch, ST_IDLE);
  }
  if (disc != ch->disc_handled) {
    ch->disc_handled = disc;
    pthread_mutex_lock(&ch->mu);
    ch->disc_done = disc;
    pthread_mutex_unlock(&ch->mu);
    pthread_cond_broadcast(&ch->cv);
  }
  if (!aborted)
    drive(ch);
  dl_arm(ch);
}

static void *io_main(void *arg) {
  sg_rpc_channel_t *ch = arg;
  sg_thread_name("sg-rpc-client");
  drive(ch);
  uv_run(&ch->loop, UV_RUN_DEFAULT);
  return NULL;
}

int sg__rpcc_io_start(sg_rpc_channel_t *ch, sg_err_t *err) {
  if (uv_loop_init(&ch->loop) != 0)
    return sg_err_set(err, SG_ENOMEM, "uv_loop_init");
  uv_async_init(&ch->loop, &ch->wake, wake_cb);
  uv_timer_init(&ch->loop, &ch->timer);
  uv_timer_init(&ch->loop, &ch->ka_timer);
  uv_timer_init(&ch->loop, &ch->dl_timer);
  ch->dl_timer.data = ch;
  ch->wake.data = ch;
  ch->timer.data = ch;
  ch->ka_timer.data = ch;

  /* The I/O thread takes no signals: they belong to the embedding program. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int tr = pthread_create(&ch->thread, NULL, io_main, ch);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (tr != 0) {
    uv_close((uv_handle_t *)&ch->wake, NULL);
    uv_close((uv_handle_t *)&ch->timer, NULL);
    uv_close((uv_handle_t *)&ch->ka_timer, NULL);
    uv_close((uv_handle_t *)&ch->dl_timer, NULL);
    uv_run(&ch->loop, UV_RUN_DEFAULT);
    uv_loop_close(&ch->loop);
    return sg_err_set(err, SG_ENOMEM, "pthread_create: %s", strerror(tr));
  }
  ch->thread_started = 1;
  return 0;
}
