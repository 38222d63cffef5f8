/*
 * server.c: the gRPC server's sockets, timers and connection life cycle on
 * a libuv loop, around the I/O-free engine of h2s.c.
 *
 *   listener     a uv_poll_t on the registered listening socket from
 *                sg_sock_listen(); up to ACCEPT_BUDGET accepts per wakeup;
 *                over max_connections a socket is accepted and closed
 *   sniffing     a uv_poll_t per new socket and recv(MSG_PEEK): the HTTP/2
 *                preface -> uv_tcp_open + engine; an HTTP/1 request line ->
 *                on_http1(fd); else closed.  Partial bytes are re-peeked
 *                every SNIFF_RETRY_MS (the poll is level-triggered, so we
 *                stop it rather than spin) until sniff_timeout_ms
 *   connection   read -> sg__h2s_recv -> flush; flush pulls bytes from the
 *                engine into a shared scratch buffer, writes them with
 *                uv_try_write and copies only what the socket refused into
 *                the connection (one uv_write in flight, one pending buffer
 *                of about OUT_BATCH bytes; the rest waits in the engine)
 *   deadlines    one server-wide binary min-heap of calls keyed by deadline
 *                and one uv_timer armed for the earliest; no per-call timers
 *   deferred     a respond from outside the engine (a timer, another
 *                connection's call) marks the connection dirty; a uv_idle
 *                flushes dirty connections, so respond never calls back
 *   closing      conn_close() cancels the calls, reports on_conn_close and
 *                closes the handles; the conn is freed when the last handle
 *                close callback runs.  A conn inside the engine (busy) only
 *                records close_pending and closes when the engine returns.
 *
 * Connection states: SNIFF -> HANDOFF (poll closing) -> H2 -> CLOSING, or
 * SNIFF -> CLOSING; conn_set_state() is the one setter.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "rpc/h2s.h"

/* Budgets and limits (bounded work per wakeup, bounded memory per peer). */
#define ACCEPT_BUDGET 32          /* accepts per listener wakeup */
#define ACCEPT_RETRY_MS 100       /* pause after EMFILE and the like */
#define LISTEN_BACKLOG 1024       /* listen(2) backlog */
#define READ_CHUNK 65536          /* one read; libuv reads <= 32 per wakeup */
#define FLUSH_BUDGET (256 * 1024) /* bytes uv_try_write()n per flush */
#define OUT_BATCH 32768           /* output gathered per write; queued: pause */
#define OUT_MAX ((size_t)4 << 20) /* hard cap of one output buffer */
#define OUT_KEEP 16384            /* free a drained buffer larger than this */
#define EXPIRE_BUDGET 256         /* deadlines handled per timer firing */
#define DIRTY_BUDGET 64           /* connections flushed per idle callback */
#define SNIFF_RETRY_MS 5          /* re-peek interval for partial bytes */
#define NS_PER_MS INT64_C(1000000)

typedef enum conn_state_e {
  CONN_SNIFF,   /* waiting for the first bytes; poll active */
  CONN_HANDOFF, /* protocol known; poll handle closing */
  CONN_H2,      /* uv_tcp_t + engine */
  CONN_CLOSING, /* handles closing; freed by the last close callback */
} conn_state_t;

typedef enum handoff_e { HANDOFF_H2 = 1, HANDOFF_HTTP1 = 2 } handoff_t;

typedef struct conn_s conn_t;
struct conn_s {
  sg_rpc_server_t *srv;
  conn_state_t state;
  handoff_t handoff;
  int fd;        /* registered socket; -1 once handed away or closed */
  int fd_in_tcp; /* uv_tcp_t owns the descriptor (uv_close closes it) */
  uint64_t id;
  uv_poll_t poll;   /* sniffing */
  uv_tcp_t tcp;     /* HTTP/2 */
  uv_timer_t timer; /* sniff deadline / retry, then idle and write stall */
  unsigned poll_inited : 1, tcp_inited : 1, timer_inited : 1, h2_ready : 1,
      writing : 1, reading : 1, close_pending : 1, dirty : 1;
  int handles; /* initialised handles not yet closed */
  int busy;    /* nesting depth inside the engine; defers conn_close */
  sg__h2s_t h2;
  sg_buf_t inflight; /* bytes owned by the uv_write in flight */
  sg_buf_t pending;  /* bytes queued behind it */
  uv_write_t wreq;
  int64_t sniff_deadline_ns;
  int64_t last_read_ns, last_write_ns;
  conn_t *prev, *next;             /* server's connections */
  conn_t *dirty_prev, *dirty_next; /* server's dirty list */
};

struct sg_rpc_server_s {
  uv_loop_t *loop;
  sg_rpc_server_opts_t o; /* with defaults applied; bind is not kept */
  int listen_fd;
  int port;
  uv_poll_t listen_poll;
  uv_timer_t accept_timer;   /* resumes accepting after a pause */
  uv_timer_t deadline_timer; /* fires at heap[0]->deadline */
  uv_idle_t flush_idle;      /* flushes dirty connections */
  int handles;               /* server handles not yet closed */
  conn_t *conns;
  size_t nconns; /* allocated connections, closing ones too */
  size_t nlive;  /* connections not closing */
  conn_t *dirty;
  sg_rpc_call_t **heap; /* deadline min-heap */
  size_t heap_len, heap_cap;
  int64_t timer_due; /* deadline the timer is armed for */
  uint64_t next_conn_id;
  int closing;
  int start_failed; /* freed without closed_cb */
  void (*closed_cb)(void *ud);
  void *closed_ud;
  sg_buf_t scratch;      /* gathered output on its way to uv_try_write (shared:
                            flushes run one at a time on the loop) */
  char rbuf[READ_CHUNK]; /* shared: reads are processed synchronously */
};

static void conn_close(conn_t *c);
static void conn_flush(conn_t *c);
static void conn_timer_cb(uv_timer_t *t);
static void sniff_cb(uv_poll_t *p, int status, int events);

static void conn_set_state(conn_t *c, conn_state_t s) { c->state = s; }

/* ---- deadline heap --------------------------------------------------------
 */

static void heap_put(sg_rpc_server_t *s, size_t i, sg_rpc_call_t *c) {
  s->heap[i] = c;
  c->heap_idx = i;
}

static void heap_sift_up(sg_rpc_server_t *s, size_t i) {
  sg_rpc_call_t *c = s->heap[i];
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (s->heap[p]->deadline <= c->deadline)
      break;
    heap_put(s, i, s->heap[p]);
    i = p;
  }
  heap_put(s, i, c);
}

static void heap_sift_down(sg_rpc_server_t *s, size_t i) {
  sg_rpc_call_t *c = s->heap[i];
  for (;;) {
    size_t l = 2 * i + 1, m = i;
    sg_deadline_t md = c->deadline;
    if (l < s->heap_len && s->heap[l]->deadline < md)
      m = l, md = s->heap[l]->deadline;
    if (l + 1 < s->heap_len && s->heap[l + 1]->deadline < md)
      m = l + 1;
    if (m == i)
      break;
    heap_put(s, i, s->heap[m]);
    i = m;
  }
  heap_put(s, i, c);
}

static void heap_remove(sg_rpc_server_t *s, sg_rpc_call_t *c) {
  size_t i = c->heap_idx;
  if (i == SIZE_MAX)
    return;
  c->heap_idx = SIZE_MAX;
  sg_rpc_call_t *last = s->heap[--s->heap_len];
  if (i == s->heap_len)
    return;
  heap_put(s, i, last);
  heap_sift_down(s, i);
  heap_sift_up(s, last->heap_idx);
}

static void deadline_cb(uv_timer_t *t);

/* deadline_arm: make the timer fire no later than the earliest deadline. */
static void deadline_arm(sg_rpc_server_t *s) {
  if (s->closing || s->heap_len == 0)
    return; /* a stale timer firing is harmless */
  sg_deadline_t due = s->heap[0]->deadline;
  if (uv_is_active((uv_handle_t *)&s->deadline_timer) && s->timer_due <= due)
    return;
  int64_t now = sg_now_ns();
  uint64_t ms =
      due <= now ? 0 : (uint64_t)((due - now + NS_PER_MS - 1) / NS_PER_MS);
  s->timer_due = due;
  uv_timer_start(&s->deadline_timer, deadline_cb, ms, 0);
}

static int heap_push(sg_rpc_server_t *s, sg_rpc_call_t *c) {
  if (c->heap_idx != SIZE_MAX)
    heap_remove(s, c);
  if (s->heap_len == s->heap_cap) {
    size_t cap = s->heap_cap ? s->heap_cap * 2 : 64;
    sg_rpc_call_t **h = sg_realloc(s->heap, cap * sizeof(*h));
    if (!h)
      return SG_ENOMEM;
    s->heap = h;
    s->heap_cap = cap;
  }
  heap_put(s, s->heap_len++, c);
  heap_sift_up(s, c->heap_idx);
  deadline_arm(s);
  return 0;
}

/* deadline_cb: expire up to EXPIRE_BUDGET calls, then re-arm. */
static void deadline_cb(uv_timer_t *t) {
  sg_rpc_server_t *s = t->data;
  int64_t now = sg_now_ns();
  int n = 0;
  while (!s->closing && s->heap_len && s->heap[0]->deadline <= now) {
    if (n++ == EXPIRE_BUDGET) {
      s->timer_due = now;
      uv_timer_start(&s->deadline_timer, deadline_cb, 0, 0);
      return;
    }
    sg_rpc_call_t *c = s->heap[0];
    conn_t *conn = c->h2->owner;
    heap_remove(s, c);
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu stream %d: deadline exceeded",
           (unsigned long long)conn->id, (int)c->stream_id);
    conn->busy++;
    sg__h2s_expire(&conn->h2, c);
    conn->busy--;
    if (conn->close_pending)
      conn_close(conn);
  }
  deadline_arm(s);
}

/* ---- engine operations ----------------------------------------------------
 */

static void dirty_unlink(conn_t *c) {
  if (!c->dirty)
    return;
  if (c->dirty_prev)
    c->dirty_prev->dirty_next = c->dirty_next;
  else
    c->srv->dirty = c->dirty_next;
  if (c->dirty_next)
    c->dirty_next->dirty_prev = c->dirty_prev;
  c->dirty_prev = c->dirty_next = NULL;
  c->dirty = 0;
}

static void flush_idle_cb(uv_idle_t *idle) {
  sg_rpc_server_t *s = idle->data;
  for (int n = 0; n < DIRTY_BUDGET && s->dirty; n++) {
    conn_t *c = s->dirty;
    dirty_unlink(c);
    conn_flush(c);
  }
  if (!s->dirty)
    uv_idle_stop(&s->flush_idle);
}

static void op_wake(void *owner) {
  conn_t *c = owner;
  sg_rpc_server_t *s = c->srv;
  if (c->state != CONN_H2 || c->dirty || s->closing)
    return;
  c->dirty = 1;
  c->dirty_prev = NULL;
  c->dirty_next = s->dirty;
  if (s->dirty)
    s->dirty->dirty_prev = c;
  s->dirty = c;
  if (!uv_is_active((uv_handle_t *)&s->flush_idle))
    uv_idle_start(&s->flush_idle, flush_idle_cb);
}

static void op_dispatch(void *owner, sg_rpc_call_t *call) {
  conn_t *c = owner;
  c->srv->o.on_call(c->srv->o.ud, call);
}

static void op_cancel(void *owner, sg_rpc_call_t *call) {
  conn_t *c = owner;
  c->srv->o.on_call_cancel(c->srv->o.ud, call);
}

static int op_deadline_set(void *owner, sg_rpc_call_t *call) {
  conn_t *c = owner;
  return heap_push(c->srv, call);
}

static void op_deadline_clear(void *owner, sg_rpc_call_t *call) {
  conn_t *c = owner;
  heap_remove(c->srv, call);
}

static const sg__h2s_ops_t h2_ops = {
    .dispatch = op_dispatch,
    .cancel = op_cancel,
    .deadline_set = op_deadline_set,
    .deadline_clear = op_deadline_clear,
    .wake = op_wake,
};

/* ---- connection life cycle ------------------------------------------------
 */

static void srv_maybe_done(sg_rpc_server_t *s) {
  if (!s->closing || s->handles || s->nconns)
    return;
  if (!s->start_failed && s->closed_cb)
    s->closed_cb(s->closed_ud);
  sg_buf_free(&s->scratch);
  sg_free(s->heap);
  sg_free(s);
}

static void conn_free(conn_t *c) {
  sg_rpc_server_t *s = c->srv;
  if (c->h2_ready)
    sg__h2s_free(&c->h2);
  if (c->fd >= 0)
    sg_sock_close(c->fd);
  sg_buf_free(&c->inflight);
  sg_buf_free(&c->pending);
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  s->nconns--;
  sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: freed", (unsigned long long)c->id);
  sg_free(c);
  srv_maybe_done(s);
}

static void conn_handle_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  if (--c->handles == 0)
    conn_free(c);
}

static void close_handle(uv_handle_t *h, unsigned inited) {
  if (inited && !uv_is_closing(h))
    uv_close(h, conn_handle_closed);
}

/*
 * conn_close: end the connection: cancel its dispatched calls, report
 * on_conn_close (HTTP/2 connections only), close its handles.  Deferred while
 * the connection is inside the engine.  Idempotent.
 */
static void conn_close(conn_t *c) {
  sg_rpc_server_t *s = c->srv;
  if (c->state == CONN_CLOSING)
    return;
  if (c->busy) {
    c->close_pending = 1;
    return;
  }
  conn_set_state(c, CONN_CLOSING);
  s->nlive--;
  dirty_unlink(c);
  sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: closing", (unsigned long long)c->id);
  if (c->h2_ready) {
    c->busy++; /* a callback closing the server must not re-enter */
    sg__h2s_shutdown(&c->h2);
    if (s->o.on_conn_close)
      s->o.on_conn_close(s->o.ud, c->id);
    c->busy--;
  }
  close_handle((uv_handle_t *)&c->poll, c->poll_inited);
  close_handle((uv_handle_t *)&c->timer, c->timer_inited);
  if (c->tcp_inited && !uv_is_closing((uv_handle_t *)&c->tcp)) {
    if (c->fd_in_tcp) {
      sg_sock_unregister(c->fd); /* before libuv closes the number */
      c->fd_in_tcp = 0;
      c->fd = -1;
    }
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
  }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  conn_t *c = h->data;
  buf->base = c->srv->rbuf;
  buf->len = READ_CHUNK;
}

static void read_cb(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  conn_t *c = st->data;
  if (c->state != CONN_H2)
    return;
  if (n < 0) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: %s", (unsigned long long)c->id,
           n == UV_EOF ? "peer closed" : uv_strerror((int)n));
    conn_close(c);
    return;
  }
  if (n == 0)
    return;
  c->last_read_ns = sg_now_ns();
  c->busy++;
  int rc = sg__h2s_recv(&c->h2, (const uint8_t *)buf->base, (size_t)n);
  if (rc)
    sg__h2s_terminate(&c->h2, rc == SG_ENOMEM ? NGHTTP2_INTERNAL_ERROR
                                              : NGHTTP2_PROTOCOL_ERROR);
  c->busy--;
  if (rc)
    c->close_pending = 1; /* flush the GOAWAY, then close */
  conn_flush(c);
}

static void conn_reading(conn_t *c, int on) {
  if (on && !c->reading) {
    if (uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb) == 0)
      c->reading = 1;
    else
      c->close_pending = 1;
  } else if (!on && c->reading) {
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = 0;
  }
}

static void write_cb(uv_write_t *req, int status);

/* conn_write_start: hand the pending bytes to one uv_write. */
static int conn_write_start(conn_t *c) {
  if (c->writing || c->pending.len == 0)
    return 0;
  sg_buf_t t = c->inflight; /* empty */
  c->inflight = c->pending;
  c->pending = t;
  uv_buf_t b =
      uv_buf_init((char *)sg_buf_head(&c->inflight), (unsigned)c->inflight.len);
  int rc = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, write_cb);
  if (rc == 0)
    c->writing = 1;
  return rc;
}

static void write_cb(uv_write_t *req, int status) {
  conn_t *c = req->data;
  c->writing = 0;
  if (c->state != CONN_H2)
    return;
  if (status < 0) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: write: %s",
           (unsigned long long)c->id, uv_strerror(status));
    conn_close(c);
    return;
  }
  c->last_write_ns = sg_now_ns();
  sg_buf_consume(&c->inflight, c->inflight.len);
  if (c->inflight.cap > OUT_KEEP)
    sg_buf_free(&c->inflight);
  conn_flush(c);
}

/*
 * conn_pull: append the engine's next frames to `b` until it holds
 * OUT_BATCH bytes or the engine has nothing more.  Returns 1 when the engine
 * may have more, 0 when it is drained, or a negative error code.
 */
static int conn_pull(conn_t *c, sg_buf_t *b) {
  while (b->len < OUT_BATCH) {
    const uint8_t *p;
    ssize_t n = sg__h2s_send(&c->h2, &p);
    if (n <= 0)
      return (int)n;
    int rc = sg_buf_append(b, p, (size_t)n);
    if (rc)
      return rc;
  }
  return 1;
}

/* conn_try_write: uv_try_write `b`'s bytes and consume what the socket took;
 * returns the count (0 when the socket is full) or a negative libuv code. */
static int conn_try_write(conn_t *c, sg_buf_t *b) {
  uv_buf_t ub = uv_buf_init((char *)sg_buf_head(b), (unsigned)b->len);
  int w = uv_try_write((uv_stream_t *)&c->tcp, &ub, 1);
  if (w == UV_EAGAIN)
    return 0;
  if (w > 0) {
    sg_buf_consume(b, (size_t)w);
    c->last_write_ns = sg_now_ns();
  }
  return w;
}

/*
 * conn_flush: move the engine's output to the socket.  While nothing is
 * queued, frames are gathered into the server's scratch buffer (OUT_BATCH
 * at a time) and handed to the kernel with one uv_try_write, so a burst of
 * small frames costs one system call, not one each; only what the socket
 * does not take is copied into the connection's pending buffer.  Once bytes
 * are queued, the engine is pulled only until OUT_BATCH bytes wait behind
 * the write in flight: the rest of a response stays in the engine (often a
 * blob shared by many calls) instead of being copied per connection, and
 * reading the peer pauses until its socket drains.  Writes up to
 * FLUSH_BUDGET bytes per call.  Closes the connection on error, on a
 * pending close, or when the session is over.
 */
static void conn_flush(conn_t *c) {
  if (c->state != CONN_H2)
    return;
  dirty_unlink(c);
  c->busy++;
  sg_buf_t *scratch = &c->srv->scratch;
  size_t budget = FLUSH_BUDGET;
  int err = 0;
  while (budget > 0) {
    if (c->writing) { /* queue behind the write in flight */
      int more = conn_pull(c, &c->pending);
      err = more < 0 ? more : 0;
      break;
    }
    sg_buf_t *b = c->pending.len ? &c->pending : scratch;
    int more = 1;
    if (b == scratch) {
      more = conn_pull(c, scratch);
      if (more < 0) {
        err = more;
        break;
      }
      if (scratch->len == 0)
        break;
    }
    int w = conn_try_write(c, b);
    if (w < 0) {
      err = w;
      break;
    }
    budget = (size_t)w >= budget ? 0 : budget - (size_t)w;
    if (b->len > 0) { /* the socket is full: keep the rest */
      if (b == scratch) {
        err = sg_buf_append(&c->pending, sg_buf_head(scratch), scratch->len);
        sg_buf_consume(scratch, scratch->len);
      }
      break;
    }
    if (!more)
      break; /* the engine has nothing more */
  }
  sg_buf_consume(scratch, scratch->len); /* after an error, too */
  if (!err && budget == 0 && !c->writing && c->pending.len == 0) {
    int more = conn_pull(c, &c->pending); /* uv_write carries on */
    err = more < 0 ? more : 0;
  }
  if (c->pending.len == 0 && c->pending.cap > OUT_KEEP)
    sg_buf_free(&c->pending);
  if (!err)
    err = conn_write_start(c);
  c->busy--;
  if (err) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: flush: %s",
           (unsigned long long)c->id,
           err > SG__EBASE ? uv_strerror(err) : sg_strerror(err));
    c->close_pending = 1;
  }
  if (!c->close_pending && !sg__h2s_want_io(&c->h2) && !c->writing &&
      c->pending.len == 0) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: session over",
           (unsigned long long)c->id);
    c->close_pending = 1;
  }
  if (!c->close_pending)
    conn_reading(c, c->pending.len + c->inflight.len < OUT_BATCH);
  if (c->close_pending)
    conn_close(c);
}

/* conn_timer_arm_h2: next idle / write-stall check. */
static void conn_timer_arm_h2(conn_t *c) {
  int64_t idle = c->srv->o.idle_timeout_ms * NS_PER_MS, now = sg_now_ns();
  int64_t due = c->last_read_ns + idle;
  if ((c->writing || c->pending.len) && c->last_write_ns + idle < due)
    due = c->last_write_ns + idle;
  if (due <= now)
    due = now + idle;
  uv_timer_start(&c->timer, conn_timer_cb, (uint64_t)((due - now) / NS_PER_MS),
                 0);
}

static void conn_timer_cb(uv_timer_t *t) {
  conn_t *c = t->data;
  int64_t now = sg_now_ns();
  if (c->state == CONN_SNIFF) {
    if (now >= c->sniff_deadline_ns) {
      sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: no protocol within %lld ms",
             (unsigned long long)c->id, (long long)c->srv->o.sniff_timeout_ms);
      conn_close(c);
      return;
    }
    if (uv_poll_start(&c->poll, UV_READABLE, sniff_cb) != 0) {
      conn_close(c);
      return;
    }
    uv_timer_start(
        &c->timer, conn_timer_cb,
        (uint64_t)((c->sniff_deadline_ns - now + NS_PER_MS - 1) / NS_PER_MS),
        0);
    return;
  }
  if (c->state != CONN_H2)
    return;
  int64_t idle = c->srv->o.idle_timeout_ms * NS_PER_MS;
  if ((c->writing || c->pending.len) && now - c->last_write_ns >= idle) {
    sg_log(SG_LOG_WARN, "rpc", "conn %llu: peer reads nothing; closing",
           (unsigned long long)c->id);
    conn_close(c);
    return;
  }
  if (sg__h2s_idle(&c->h2) && now - c->last_read_ns >= idle) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: idle; closing",
           (unsigned long long)c->id);
    sg__h2s_terminate(&c->h2, NGHTTP2_NO_ERROR);
    c->close_pending = 1;
    conn_flush(c);
    return;
  }
  conn_timer_arm_h2(c);
}

/* start_h2: the poll handle is gone; the socket becomes a uv_tcp_t. */
static void start_h2(conn_t *c) {
  sg_rpc_server_t *s = c->srv;
  if (s->closing) {
    conn_close(c);
    return;
  }
  uv_tcp_init(s->loop, &c->tcp);
  c->tcp.data = c;
  c->tcp_inited = 1;
  c->handles++;
  int rc = uv_tcp_open(&c->tcp, c->fd);
  if (rc) {
    sg_log(SG_LOG_WARN, "rpc", "conn %llu: uv_tcp_open: %s",
           (unsigned long long)c->id, uv_strerror(rc));
    conn_close(c);
    return;
  }
  c->fd_in_tcp = 1;
  sg__h2s_config_t cfg = {
      .max_message = s->o.max_message,
      .max_streams = s->o.max_streams,
      .default_deadline_ms = s->o.default_deadline_ms,
      .conn_id = c->id,
  };
  if (sg__h2s_init(&c->h2, &cfg, &h2_ops, c) != 0) {
    sg_log(SG_LOG_WARN, "rpc", "conn %llu: out of memory",
           (unsigned long long)c->id);
    conn_close(c);
    return;
  }
  c->h2_ready = 1;
  conn_set_state(c, CONN_H2);
  c->last_read_ns = c->last_write_ns = sg_now_ns();
  sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: HTTP/2", (unsigned long long)c->id);
  conn_timer_arm_h2(c);
  conn_flush(c); /* our SETTINGS; starts reading */
}

static void poll_closed_cb(uv_handle_t *h) {
  conn_t *c = h->data;
  c->handles--;
  if (c->state == CONN_HANDOFF) {
    if (c->handoff == HANDOFF_H2) {
      start_h2(c);
    } else {
      sg_rpc_server_t *s = c->srv;
      int fd = c->fd;
      c->fd = -1;
      sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: HTTP/1 handed off",
             (unsigned long long)c->id);
      conn_close(c); /* closes the timer; the conn is freed after */
      s->o.on_http1(s->o.ud, fd);
      return; /* the timer's close callback frees c */
    }
  }
  if (c->handles == 0)
    conn_free(c);
}

static void conn_handoff(conn_t *c, handoff_t to) {
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->timer);
  c->handoff = to;
  conn_set_state(c, CONN_HANDOFF);
  uv_close((uv_handle_t *)&c->poll, poll_closed_cb);
}

/* sniff_cb: peek at the first bytes and decide what the peer speaks. */
static void sniff_cb(uv_poll_t *p, int status, int events) {
  (void)events;
  conn_t *c = p->data;
  uint8_t b[SG__H2_PREFACE_LEN];
  ssize_t n;
  if (status < 0) {
    conn_close(c);
    return;
  }
  do
    n = recv(c->fd, b, sizeof(b), MSG_PEEK);
  while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
    return;
  if (n <= 0) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: %s before any byte",
           (unsigned long long)c->id, n == 0 ? "EOF" : strerror(errno));
    conn_close(c);
    return;
  }
  switch (sg__rpc_sniff(b, (size_t)n)) {
  case SG__SNIFF_MORE: {
    /* The poll is level-triggered: wait a little instead of spinning. */
    int64_t left = c->sniff_deadline_ns - sg_now_ns();
    uint64_t ms = SNIFF_RETRY_MS;
    if (left < SNIFF_RETRY_MS * NS_PER_MS)
      ms = left > 0 ? (uint64_t)((left + NS_PER_MS - 1) / NS_PER_MS) : 0;
    uv_poll_stop(&c->poll);
    uv_timer_start(&c->timer, conn_timer_cb, ms, 0);
    return;
  }
  case SG__SNIFF_H2:
    conn_handoff(c, HANDOFF_H2);
    return;
  case SG__SNIFF_HTTP1:
    if (c->srv->o.on_http1) {
      conn_handoff(c, HANDOFF_HTTP1);
      return;
    }
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: HTTP/1 not served",
           (unsigned long long)c->id);
    conn_close(c);
    return;
  case SG__SNIFF_OTHER:
  default:
    sg_log(SG_LOG_WARN, "rpc", "conn %llu: neither HTTP/2 nor HTTP/1; closing",
           (unsigned long long)c->id);
    conn_close(c);
    return;
  }
}

/* conn_new: take ownership of accepted socket `fd` and start sniffing. */
static int conn_new(sg_rpc_server_t *s, int fd) {
  conn_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return SG_ENOMEM;
  int rc = uv_poll_init_socket(s->loop, &c->poll, fd);
  if (rc) {
    sg_free(c);
    return rc;
  }
  c->srv = s;
  c->fd = fd;
  c->id = ++s->next_conn_id;
  c->poll.data = c;
  c->timer.data = c;
  c->wreq.data = c;
  c->poll_inited = 1;
  c->handles = 2;
  uv_timer_init(s->loop, &c->timer);
  c->timer_inited = 1;
  sg_buf_init(&c->inflight, OUT_MAX);
  sg_buf_init(&c->pending, OUT_MAX);
  conn_set_state(c, CONN_SNIFF);
  c->next = s->conns;
  if (s->conns)
    s->conns->prev = c;
  s->conns = c;
  s->nconns++;
  s->nlive++;
  c->sniff_deadline_ns = sg_now_ns() + s->o.sniff_timeout_ms * NS_PER_MS;
  sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: accepted", (unsigned long long)c->id);
  if (uv_poll_start(&c->poll, UV_READABLE, sniff_cb) != 0) {
    conn_close(c); /* the fd is closed when the conn is freed */
    return 0;
  }
  uv_timer_start(&c->timer, conn_timer_cb, (uint64_t)s->o.sniff_timeout_ms, 0);
  return 0;
}

/* ---- listener ---------------------------------------------------------- */

static void listen_cb(uv_poll_t *p, int status, int events);

static void accept_retry_cb(uv_timer_t *t) {
  sg_rpc_server_t *s = t->data;
  if (!s->closing)
    uv_poll_start(&s->listen_poll, UV_READABLE, listen_cb);
}

static void listen_cb(uv_poll_t *p, int status, int events) {
  (void)events;
  sg_rpc_server_t *s = p->data;
  if (status < 0) {
    sg_log(SG_LOG_WARN, "rpc", "listener: %s", uv_strerror(status));
    return;
  }
  for (int i = 0; i < ACCEPT_BUDGET && !s->closing; i++) {
    int fd;
    int rc = sg_sock_accept(s->listen_fd, &fd);
    if (rc == SG_EAGAIN)
      break;
    if (rc == -ECONNABORTED || rc == -EPROTO || rc == -EPERM)
      continue;
    if (rc) {
      sg_log(SG_LOG_WARN, "rpc", "accept: %s; pausing %d ms", strerror(-rc),
             ACCEPT_RETRY_MS);
      uv_poll_stop(&s->listen_poll);
      uv_timer_start(&s->accept_timer, accept_retry_cb, ACCEPT_RETRY_MS, 0);
      break;
    }
    if (s->nlive >= s->o.max_connections) {
      sg_log(SG_LOG_WARN, "rpc", "over %u connections; closing a new one",
             s->o.max_connections);
      sg_sock_close(fd);
      continue;
    }
    if (conn_new(s, fd) != 0)
      sg_sock_close(fd);
  }
}

/* ---- server -------------------------------------------------------------- */

/* parse_bind: "host:port", "[v6]:port", ":port"; host may be empty. */
static int parse_bind(const char *bind, char *host, size_t cap, int *port,
                      sg_err_t *err) {
  const char *colon, *h = bind, *he;
  if (bind[0] == '[') {
    he = strchr(bind, ']');
    if (!he || he[1] != ':')
      return sg_err_set(err, SG_EINVAL, "bad bind address '%s'", bind);
    h = bind + 1;
    colon = he + 1;
  } else {
    colon = strrchr(bind, ':');
    if (!colon)
      return sg_err_set(err, SG_EINVAL, "bad bind address '%s'", bind);
    he = colon;
  }
  size_t hl = (size_t)(he - h);
  if (hl >= cap)
    return sg_err_set(err, SG_EINVAL, "bind host too long");
  memcpy(host, h, hl);
  host[hl] = '\0';
  const char *ps = colon + 1;
  long v = 0;
  if (!*ps)
    return sg_err_set(err, SG_EINVAL, "bad port in '%s'", bind);
  for (; *ps; ps++) {
    if (*ps < '0' || *ps > '9' || (v = v * 10 + (*ps - '0')) > 65535)
      return sg_err_set(err, SG_EINVAL, "bad port in '%s'", bind);
  }
  *port = (int)v;
  return 0;
}

static void srv_handle_closed(uv_handle_t *h) {
  sg_rpc_server_t *s = h->data;
  if (h == (uv_handle_t *)&s->listen_poll) {
    sg_sock_close(s->listen_fd);
    s->listen_fd = -1;
  }
  s->handles--;
  srv_maybe_done(s);
}

static void srv_close_handles(sg_rpc_server_t *s) {
  uv_close((uv_handle_t *)&s->listen_poll, srv_handle_closed);
  uv_close((uv_handle_t *)&s->accept_timer, srv_handle_closed);
  uv_close((uv_handle_t *)&s->deadline_timer, srv_handle_closed);
  uv_close((uv_handle_t *)&s->flush_idle, srv_handle_closed);
}

int sg_rpc_server_start(uv_loop_t *loop, const sg_rpc_server_opts_t *o,
                        sg_rpc_server_t **out, sg_err_t *err) {
  char host[256];
  int port = 0, fd = -1, rc;
  if (!loop || !o || !out || !o->bind || !o->on_call || !o->on_call_cancel)
    return sg_err_set(err, SG_EINVAL, "missing server option");
  rc = parse_bind(o->bind, host, sizeof(host), &port, err);
  if (rc)
    return rc;
  sg_rpc_server_t *s = sg_calloc(1, sizeof(*s));
  if (!s)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  s->o = *o;
  s->o.bind = NULL;
  if (!s->o.max_message)
    s->o.max_message = SG_RPC_DEFAULT_MAX_MESSAGE;
  if (s->o.max_message > UINT32_MAX - SG_GRPC_PREFIX_LEN)
    s->o.max_message = UINT32_MAX - SG_GRPC_PREFIX_LEN;
  if (!s->o.max_connections)
    s->o.max_connections = SG_RPC_DEFAULT_MAX_CONNECTIONS;
  if (!s->o.max_streams)
    s->o.max_streams = SG_RPC_DEFAULT_MAX_STREAMS;
  if (s->o.sniff_timeout_ms <= 0)
    s->o.sniff_timeout_ms = SG_RPC_DEFAULT_SNIFF_TIMEOUT_MS;
  if (s->o.idle_timeout_ms <= 0)
    s->o.idle_timeout_ms = SG_RPC_DEFAULT_IDLE_TIMEOUT_MS;
  if (s->o.default_deadline_ms <= 0)
    s->o.default_deadline_ms = SG_RPC_DEFAULT_DEADLINE_MS;
  s->loop = loop;
  s->timer_due = INT64_MAX;
  sg_buf_init(&s->scratch, OUT_MAX);
  rc = sg_sock_listen(host, port, LISTEN_BACKLOG, &fd, &s->port, err);
  if (rc) {
    sg_free(s);
    return rc;
  }
  s->listen_fd = fd;
  rc = uv_poll_init_socket(loop, &s->listen_poll, fd);
  if (rc) {
    sg_sock_close(fd);
    sg_free(s);
    return sg_err_set(err, rc, "uv_poll_init_socket: %s", uv_strerror(rc));
  }
  s->listen_poll.data = s;
  uv_timer_init(loop, &s->accept_timer);
  s->accept_timer.data = s;
  uv_timer_init(loop, &s->deadline_timer);
  s->deadline_timer.data = s;
  uv_idle_init(loop, &s->flush_idle);
  s->flush_idle.data = s;
  s->handles = 4;
  rc = uv_poll_start(&s->listen_poll, UV_READABLE, listen_cb);
  if (rc) {
    sg_err_set(err, rc, "uv_poll_start: %s", uv_strerror(rc));
    s->closing = 1;
    s->start_failed = 1;
    srv_close_handles(s); /* freed from the loop; no callback */
    return rc;
  }
  sg_log(SG_LOG_DEBUG, "rpc", "listening on %s (port %d)", o->bind, s->port);
  *out = s;
  return 0;
}

int sg_rpc_server_port(const sg_rpc_server_t *s) { return s->port; }

size_t sg_rpc_server_connection_count(const sg_rpc_server_t *s) {
  return s->nlive;
}

void sg_rpc_server_close(sg_rpc_server_t *s, void (*closed_cb)(void *ud),
                         void *ud) {
  if (!s || s->closing)
    return;
  s->closing = 1;
  s->closed_cb = closed_cb;
  s->closed_ud = ud;
  srv_close_handles(s);
  for (conn_t *c = s->conns, *next; c; c = next) {
    next = c->next;
    conn_close(c);
  }
}
