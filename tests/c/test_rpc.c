/*
 * test_rpc.c: the gRPC unary server over real sockets on 127.0.0.1.
 *
 * Each test starts a server on its own loop, runs a client scenario on a
 * second thread (a blocking-socket nghttp2 client, or a "bad peer" that
 * writes raw bytes), runs the loop in the test thread with a hard deadline
 * until the scenario and the server-side expectations are met, then closes
 * the server and checks: closed_cb ran, the loop has no handle left, every
 * call completed exactly once (a response or a cancel), and no socket is
 * left in the fork registry.
 *
 * The client thread never calls cmocka (it longjmps); CHECK() records the
 * first failure and the test thread asserts it is empty.
 */
#include <errno.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>
#include <nghttp2/nghttp2.h>
#include <uv.h>

#include "rpc/grpc.h"
#include "rpc/h2s.h"
#include "stepguard/rpc.h"

/* ---- fixture: server side, on the test thread ----------------------------
 */

enum mode {
  MODE_ECHO,         /* respond at once with the request body */
  MODE_HOLD,         /* keep the call; never respond */
  MODE_ASYNC,        /* respond with the body from a 50 ms timer */
  MODE_REVERSE,      /* hold until `target` calls, answer newest first */
  MODE_BLOB,         /* hold until 3 calls, answer all with one blob */
  MODE_META,         /* respond with the authorization value */
  MODE_ERROR,        /* respond NOT_FOUND with a non-ASCII message */
  MODE_BIG,          /* respond with a 4 MiB body */
  MODE_CLOSE,        /* hold; close the server once `target` calls arrived */
  MODE_CLOSE_INLINE, /* close the server from inside on_call */
};

#define MAX_TRACK 256

typedef struct track_s {
  int done; /* responses + cancels: must end at exactly 1 */
} track_t;

typedef struct fx_s fx_t;
struct fx_s {
  uv_loop_t loop;
  uv_timer_t tick;  /* keeps the loop waking; publishes the conn count */
  uv_timer_t later; /* MODE_ASYNC / MODE_CLOSE */
  sg_rpc_server_t *srv;
  sg_rpc_server_opts_t opts;
  int port;
  enum mode mode;
  int target;
  int closed, close_called;
  int tolerant; /* respond may fail (allocation torture) */
  /* server-side observations */
  int calls, cancels, responds, conn_closes, http1s;
  char events[64]; /* 'C' call, 'X' cancel, 'K' connection closed */
  int nevents;
  sg_rpc_call_t *pending[64];
  int npending;
  track_t tracks[MAX_TRACK];
  int ntracks;
  char last_path[128];
  int64_t deadline_left_ms;
  int missing_meta_null;
  int http1_peek_ok, http1_registered;
  size_t sock_baseline;
  /* client thread */
  pthread_t th;
  void (*client)(fx_t *);
  atomic_int client_done;
  atomic_int calls_seen;
  atomic_int conn_count;
  atomic_int client_release; /* the test lets a waiting client go */
  /* test_stalled_reader_output_bounded */
  int64_t steady_at_ns;
  int steady_responds;
  size_t mem_base, mem_held;
  char client_err[256];
};

static void fx_event(fx_t *fx, char e) {
  if (fx->nevents < (int)sizeof(fx->events) - 1)
    fx->events[fx->nevents++] = e;
}

static void fx_drop_pending(fx_t *fx, sg_rpc_call_t *c) {
  for (int i = 0; i < fx->npending; i++) {
    if (fx->pending[i] == c) {
      fx->pending[i] = fx->pending[--fx->npending];
      return;
    }
  }
}

/* fx_respond: respond and count it against the call's track. */
static int fx_respond(fx_t *fx, sg_rpc_call_t *c, int status, const char *msg,
                      const uint8_t *body, size_t len) {
  track_t *t = sg_rpc_call_user(c);
  fx_drop_pending(fx, c);
  t->done++;
  fx->responds++;
  return sg_rpc_call_respond(c, status, msg, body, len);
}

static int fx_echo(fx_t *fx, sg_rpc_call_t *c) {
  size_t len;
  const uint8_t *b = sg_rpc_call_body(c, &len);
  return fx_respond(fx, c, SG_GRPC_OK, NULL, b, len);
}

static void on_closed(void *ud);

static void later_cb(uv_timer_t *t) {
  fx_t *fx = t->data;
  if (fx->mode == MODE_CLOSE) {
    fx->close_called = 1;
    sg_rpc_server_close(fx->srv, on_closed, fx);
    sg_rpc_server_close(fx->srv, NULL, NULL); /* a second close: no-op */
    return;
  }
  while (fx->npending)
    fx_echo(fx, fx->pending[0]);
}

static void on_closed(void *ud) {
  fx_t *fx = ud;
  fx->closed++;
}

static void on_call(void *ud, sg_rpc_call_t *c) {
  fx_t *fx = ud;
  assert_true(fx->ntracks < MAX_TRACK);
  track_t *t = &fx->tracks[fx->ntracks++];
  sg_rpc_call_set_user(c, t);
  fx->calls++;
  atomic_fetch_add(&fx->calls_seen, 1);
  fx_event(fx, 'C');
  snprintf(fx->last_path, sizeof(fx->last_path), "%s", sg_rpc_call_method(c));
  fx->pending[fx->npending++] = c;
  switch (fx->mode) {
  case MODE_ECHO: {
    int rc = fx_echo(fx, c);
    if (!fx->tolerant) /* allocation torture: SG_ENOMEM allowed */
      assert_int_equal(rc, 0);
    break;
  }
  case MODE_HOLD:
    break;
  case MODE_ASYNC:
    uv_timer_start(&fx->later, later_cb, 50, 0);
    break;
  case MODE_REVERSE:
    if (fx->npending == fx->target)
      while (fx->npending)
        fx_echo(fx, fx->pending[fx->npending - 1]);
    break;
  case MODE_BLOB:
    if (fx->npending == 3) {
      static const char shared[] = "one body for three calls";
      sg_rpc_blob_t *b =
          sg_rpc_blob_new((const uint8_t *)shared, sizeof(shared) - 1);
      assert_non_null(b);
      while (fx->npending) {
        sg_rpc_call_t *p = fx->pending[0];
        track_t *pt = sg_rpc_call_user(p);
        fx_drop_pending(fx, p);
        pt->done++;
        fx->responds++;
        assert_int_equal(sg_rpc_call_respond_blob(p, b), 0);
      }
      sg_rpc_blob_unref(b); /* the responses keep their own references */
    }
    break;
  case MODE_META: {
    const char *auth = sg_rpc_call_metadata(c, "authorization");
    fx->missing_meta_null = sg_rpc_call_metadata(c, "x-missing") == NULL;
    fx->deadline_left_ms = sg_deadline_left_ms(sg_rpc_call_deadline(c));
    assert_non_null(auth);
    fx_respond(fx, c, SG_GRPC_OK, NULL, (const uint8_t *)auth, strlen(auth));
    break;
  }
  case MODE_ERROR:
    fx_respond(fx, c, SG_GRPC_NOT_FOUND, "no such thing: \xc3\xbc 100%", NULL,
               0);
    break;
  case MODE_BIG: {
    size_t n = (size_t)4 << 20;
    uint8_t *big = malloc(n);
    memset(big, 'b', n);
    fx_respond(fx, c, SG_GRPC_OK, NULL, big, n);
    free(big);
    break;
  }
  case MODE_CLOSE:
    if (fx->npending == fx->target)
      uv_timer_start(&fx->later, later_cb, 0, 0);
    break;
  case MODE_CLOSE_INLINE:
    fx->close_called = 1;
    sg_rpc_server_close(fx->srv, on_closed, fx);
    /* the close waits for the engine to return: this still goes out */
    assert_int_equal(fx_respond(fx, c, SG_GRPC_OK, NULL, NULL, 0), 0);
    break;
  }
}

static void on_cancel(void *ud, sg_rpc_call_t *c) {
  fx_t *fx = ud;
  track_t *t = sg_rpc_call_user(c);
  t->done++;
  fx->cancels++;
  fx_event(fx, 'X');
  fx_drop_pending(fx, c);
  /* responding from inside its own cancel is refused */
  assert_int_equal(sg_rpc_call_respond(c, 0, NULL, NULL, 0), SG_ESTATE);
}

static void on_conn_close(void *ud, uint64_t conn_id) {
  fx_t *fx = ud;
  assert_true(conn_id > 0);
  fx->conn_closes++;
  fx_event(fx, 'K');
}

static void on_http1(void *ud, int fd) {
  fx_t *fx = ud;
  char buf[256];
  fx->http1s++;
  /* The peeked bytes are still there to read. */
  ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
  if (n > 0) {
    buf[n] = '\0';
    fx->http1_peek_ok = strncmp(buf, "GET / HTTP/1.1\r\n", 16) == 0;
  }
  static const char resp[] =
      "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
  n = send(fd, resp, sizeof(resp) - 1, MSG_NOSIGNAL);
  (void)n;
  fx->http1_registered = sg_sock_unregister(fd) == 0;
  close(fd);
}

static void tick_cb(uv_timer_t *t) {
  fx_t *fx = t->data;
  if (fx->srv && !fx->closed)
    atomic_store(&fx->conn_count, (int)sg_rpc_server_connection_count(fx->srv));
}

static fx_t *fx_new(enum mode mode) {
  fx_t *fx = calloc(1, sizeof(*fx));
  assert_non_null(fx);
  fx->sock_baseline = sg_sock_registered_count();
  assert_int_equal(uv_loop_init(&fx->loop), 0);
  uv_timer_init(&fx->loop, &fx->tick);
  fx->tick.data = fx;
  uv_timer_init(&fx->loop, &fx->later);
  fx->later.data = fx;
  fx->mode = mode;
  fx->opts.bind = "127.0.0.1:0";
  fx->opts.on_call = on_call;
  fx->opts.on_call_cancel = on_cancel;
  fx->opts.on_conn_close = on_conn_close;
  fx->opts.ud = fx;
  atomic_store(&fx->conn_count, -1);
  return fx;
}

static void fx_start(fx_t *fx) {
  sg_err_t err;
  assert_int_equal(sg_rpc_server_start(&fx->loop, &fx->opts, &fx->srv, &err),
                   0);
  fx->port = sg_rpc_server_port(fx->srv);
  assert_true(fx->port > 0);
  uv_timer_start(&fx->tick, tick_cb, 5, 5);
}

static void *client_main(void *arg) {
  fx_t *fx = arg;
  fx->client(fx);
  atomic_store(&fx->client_done, 1);
  return NULL;
}

/*
 * fx_run: run `client` on a thread and the loop here until the client is
 * done and pred(fx) holds (NULL: true), failing after timeout_ms.
 */
static void fx_run(fx_t *fx, void (*client)(fx_t *), int (*pred)(fx_t *),
                   int64_t timeout_ms) {
  sg_deadline_t d = sg_deadline_in_ms(timeout_ms);
  fx->client = client;
  assert_int_equal(pthread_create(&fx->th, NULL, client_main, fx), 0);
  while (!(atomic_load(&fx->client_done) && (!pred || pred(fx)))) {
    if (sg_deadline_passed(d))
      break;
    uv_run(&fx->loop, UV_RUN_ONCE);
  }
  int done = atomic_load(&fx->client_done);
  pthread_join(fx->th, NULL);
  assert_true(done);
  if (pred)
    assert_true(pred(fx));
  assert_string_equal(fx->client_err, "");
}

/* fx_free: close the server, drain the loop, check nothing leaked. */
static void fx_free(fx_t *fx) {
  if (!fx->close_called)
    sg_rpc_server_close(fx->srv, on_closed, fx);
  sg_deadline_t d = sg_deadline_in_ms(5000);
  while (!fx->closed && !sg_deadline_passed(d))
    uv_run(&fx->loop, UV_RUN_ONCE);
  assert_int_equal(fx->closed, 1);
  fx->srv = NULL;
  uv_close((uv_handle_t *)&fx->tick, NULL);
  uv_close((uv_handle_t *)&fx->later, NULL);
  assert_int_equal(uv_run(&fx->loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(uv_loop_close(&fx->loop), 0);
  for (int i = 0; i < fx->ntracks; i++)
    assert_int_equal(fx->tracks[i].done, 1); /* exactly once */
  assert_int_equal(fx->calls, fx->responds + fx->cancels);
  assert_int_equal(sg_sock_registered_count(), fx->sock_baseline);
  free(fx);
}

#define CHECK(fx, cond)                                                        \
  do {                                                                         \
    if (!(cond) && (fx)->client_err[0] == '\0') {                              \
      snprintf((fx)->client_err, sizeof((fx)->client_err), "%s:%d: %s",        \
               __FILE__, __LINE__, #cond);                                     \
    }                                                                          \
  } while (0)

/* ---- test client: nghttp2 client session over a blocking socket ---------
 */

typedef struct tstream_s {
  int32_t id;
  int http_status;
  int grpc_status; /* -1 until seen */
  char grpc_message[512];
  uint8_t body[8192]; /* response bytes, prefix included */
  size_t body_len;
  size_t body_total; /* counts bytes beyond body[] too */
  int closed;
  uint32_t close_code;
  uint8_t req[70000]; /* request DATA bytes */
  size_t req_len, req_off;
  int req_hold; /* don't end the stream after req[] */
} tstream_t;

typedef struct tcli_s {
  int fd;
  nghttp2_session *s;
  tstream_t *st[16];
  int nst;
  int eof;
  int goaway;
  uint32_t goaway_code;
} tcli_t;

static ssize_t cli_send(nghttp2_session *s, const uint8_t *data, size_t len,
                        int flags, void *ud) {
  (void)s;
  (void)flags;
  tcli_t *c = ud;
  ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL);
  if (n < 0)
    return errno == EAGAIN ? NGHTTP2_ERR_WOULDBLOCK
                           : NGHTTP2_ERR_CALLBACK_FAILURE;
  return n;
}

static tstream_t *cli_stream(tcli_t *c, int32_t id) {
  for (int i = 0; i < c->nst; i++)
    if (c->st[i]->id == id)
      return c->st[i];
  return NULL;
}

static int cli_header(nghttp2_session *s, const nghttp2_frame *f,
                      const uint8_t *name, size_t namelen, const uint8_t *value,
                      size_t valuelen, uint8_t flags, void *ud) {
  (void)s;
  (void)flags;
  tstream_t *t = cli_stream(ud, f->hd.stream_id);
  char v[512];
  if (!t)
    return 0;
  snprintf(v, sizeof(v), "%.*s", (int)valuelen, value);
  if (namelen == 7 && memcmp(name, ":status", 7) == 0)
    t->http_status = atoi(v);
  else if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0)
    t->grpc_status = atoi(v);
  else if (namelen == 12 && memcmp(name, "grpc-message", 12) == 0)
    sg__grpc_message_decode((const char *)value, valuelen, t->grpc_message,
                            sizeof(t->grpc_message));
  return 0;
}

static int cli_data(nghttp2_session *s, uint8_t flags, int32_t id,
                    const uint8_t *data, size_t len, void *ud) {
  (void)s;
  (void)flags;
  tstream_t *t = cli_stream(ud, id);
  if (!t)
    return 0;
  size_t room = sizeof(t->body) - t->body_len;
  memcpy(t->body + t->body_len, data, len < room ? len : room);
  t->body_len += len < room ? len : room;
  t->body_total += len;
  return 0;
}

static int cli_close(nghttp2_session *s, int32_t id, uint32_t code, void *ud) {
  (void)s;
  tstream_t *t = cli_stream(ud, id);
  if (t) {
    t->closed = 1;
    t->close_code = code;
  }
  return 0;
}

static int cli_frame(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  (void)s;
  tcli_t *c = ud;
  if (f->hd.type == NGHTTP2_GOAWAY) {
    c->goaway = 1;
    c->goaway_code = f->goaway.error_code;
  }
  return 0;
}

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static tcli_t *tcli_open(int port, uint32_t window) {
  tcli_t *c = calloc(1, sizeof(*c));
  nghttp2_session_callbacks *cb;
  c->fd = raw_connect(port);
  if (c->fd < 0) {
    free(c);
    return NULL;
  }
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_send_callback(cb, cli_send);
  nghttp2_session_callbacks_set_on_header_callback(cb, cli_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, cli_data);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, cli_close);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, cli_frame);
  nghttp2_session_client_new(&c->s, cb, c);
  nghttp2_session_callbacks_del(cb);
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, window ? window : 65535}};
  nghttp2_submit_settings(c->s, NGHTTP2_FLAG_NONE, iv, 1);
  if (window)
    nghttp2_session_set_local_window_size(c->s, NGHTTP2_FLAG_NONE, 0,
                                          (int32_t)window);
  return c;
}

static void tcli_free(tcli_t *c) {
  if (!c)
    return;
  nghttp2_session_del(c->s);
  if (c->fd >= 0)
    close(c->fd);
  for (int i = 0; i < c->nst; i++)
    free(c->st[i]);
  free(c);
}

static ssize_t req_read(nghttp2_session *s, int32_t id, uint8_t *buf,
                        size_t length, uint32_t *flags,
                        nghttp2_data_source *src, void *ud) {
  (void)s;
  (void)id;
  (void)ud;
  tstream_t *t = src->ptr;
  size_t n = t->req_len - t->req_off;
  if (n > length)
    n = length;
  memcpy(buf, t->req + t->req_off, n);
  t->req_off += n;
  if (t->req_off == t->req_len) {
    if (t->req_hold && n == 0)
      return NGHTTP2_ERR_DEFERRED;
    if (!t->req_hold)
      *flags |= NGHTTP2_DATA_FLAG_EOF;
  }
  return (ssize_t)n;
}

/*
 * tcli_start_raw: a request with `hdrs` (name, value, ..., NULL) after the
 * standard ones and DATA bytes `data` (prefix included; NULL: no DATA, the
 * HEADERS end the stream).  Returns the stream.
 */
static tstream_t *tcli_start_raw(tcli_t *c, const char *method,
                                 const char *path, const char *ctype,
                                 const char *const *hdrs, const uint8_t *data,
                                 size_t len, int hold) {
  tstream_t *t = calloc(1, sizeof(*t));
  nghttp2_nv nva[16];
  size_t n = 0;
#define ADD(nm, v)                                                             \
  nva[n++] = (nghttp2_nv){(uint8_t *)(nm), (uint8_t *)(v), strlen(nm),         \
                          strlen(v), NGHTTP2_NV_FLAG_NONE}
  ADD(":method", method);
  ADD(":scheme", "http");
  ADD(":authority", "localhost");
  ADD(":path", path);
  ADD("content-type", ctype);
  ADD("te", "trailers");
  for (; hdrs && hdrs[0] && n < 16; hdrs += 2)
    ADD(hdrs[0], hdrs[1]);
#undef ADD
  t->grpc_status = -1;
  if (len > sizeof(t->req))
    len = sizeof(t->req);
  if (data)
    memcpy(t->req, data, len);
  t->req_len = len;
  t->req_hold = hold;
  nghttp2_data_provider prd = {.source.ptr = t, .read_callback = req_read};
  t->id = nghttp2_submit_request(c->s, NULL, nva, n, data ? &prd : NULL, NULL);
  c->st[c->nst++] = t;
  return t;
}

/* tcli_start: a well-formed gRPC request with message `body`. */
static tstream_t *tcli_start(tcli_t *c, const char *path,
                             const char *const *hdrs, const void *body,
                             size_t len) {
  uint8_t *m = malloc(len + 5);
  sg__grpc_prefix_write(m, (uint32_t)len);
  if (len)
    memcpy(m + 5, body, len);
  tstream_t *t =
      tcli_start_raw(c, "POST", path, "application/grpc", hdrs, m, len + 5, 0);
  free(m);
  return t;
}

/* tcli_pump: exchange bytes until done(c, arg) or EOF or timeout. */
static int tcli_pump(tcli_t *c, int (*done)(tcli_t *, void *), void *arg,
                     int timeout_ms) {
  sg_deadline_t d = sg_deadline_in_ms(timeout_ms);
  while (!(done && done(c, arg))) {
    if (sg_deadline_passed(d))
      return -1;
    if (nghttp2_session_send(c->s) != 0)
      return -1;
    if (c->eof)
      return done ? -1 : 0;
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    if (poll(&p, 1, 10) == 1) {
      uint8_t buf[16384];
      ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
      if (n <= 0) {
        c->eof = 1;
        continue;
      }
      if (nghttp2_session_mem_recv(c->s, buf, (size_t)n) < 0)
        return -1;
    }
  }
  nghttp2_session_send(c->s);
  return 0;
}

static int all_closed(tcli_t *c, void *arg) {
  (void)arg;
  for (int i = 0; i < c->nst; i++)
    if (!c->st[i]->closed)
      return 0;
  return 1;
}

static int stream_closed(tcli_t *c, void *arg) {
  (void)c;
  return ((tstream_t *)arg)->closed;
}

static int calls_seen_at_least(tcli_t *c, void *arg) {
  (void)c;
  void **a = arg;
  return atomic_load(&((fx_t *)a[0])->calls_seen) >= *(int *)a[1];
}

static void wait_calls_seen(fx_t *fx, tcli_t *c, int n) {
  void *a[2] = {fx, &n};
  CHECK(fx, tcli_pump(c, calls_seen_at_least, a, 5000) == 0);
}

/* body_is: the response is exactly one message equal to s[0..n). */
static int body_is(const tstream_t *t, const void *s, size_t n) {
  uint8_t p[5];
  sg__grpc_prefix_write(p, (uint32_t)n);
  return t->body_len == n + 5 && memcmp(t->body, p, 5) == 0 &&
         memcmp(t->body + 5, s, n) == 0;
}

/* one_echo: a fresh connection does one good call. */
static int one_echo(fx_t *fx, const char *text) {
  tcli_t *c = tcli_open(fx->port, 0);
  if (!c)
    return 0;
  tstream_t *t = tcli_start(c, "/test.Echo/Echo", NULL, text, strlen(text));
  int ok = tcli_pump(c, stream_closed, t, 5000) == 0 && t->grpc_status == 0 &&
           t->http_status == 200 && body_is(t, text, strlen(text));
  tcli_free(c);
  return ok;
}

/* raw_wait_closed: read (and keep) bytes until EOF/reset or timeout. */
static int raw_wait_closed(int fd, int timeout_ms, uint8_t *keep, size_t cap,
                           size_t *kept) {
  sg_deadline_t d = sg_deadline_in_ms(timeout_ms);
  size_t k = 0;
  while (!sg_deadline_passed(d)) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 10) != 1)
      continue;
    uint8_t buf[16384];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      if (kept)
        *kept = k;
      return 1;
    }
    if (keep && k < cap) {
      size_t m = (size_t)n < cap - k ? (size_t)n : cap - k;
      memcpy(keep + k, buf, m);
      k += m;
    }
  }
  if (kept)
    *kept = k;
  return 0;
}

/* frames_have: some complete frame in b[0..n) has type `type`. */
static int frames_have(const uint8_t *b, size_t n, int type) {
  size_t off = 0;
  while (off + 9 <= n) {
    size_t len = (size_t)b[off] << 16 | (size_t)b[off + 1] << 8 | b[off + 2];
    if (b[off + 3] == type)
      return 1;
    off += 9 + len;
  }
  return 0;
}

/* ---- tests ---------------------------------------------------------------
 */

static void test_sniff_classifies_first_bytes(void **state) {
  (void)state;
  const uint8_t *pre = (const uint8_t *)SG__H2_PREFACE;
  assert_int_equal(sg__rpc_sniff(pre, 0), SG__SNIFF_MORE);
  assert_int_equal(sg__rpc_sniff(pre, 3), SG__SNIFF_MORE);
  assert_int_equal(sg__rpc_sniff(pre, 23), SG__SNIFF_MORE);
  assert_int_equal(sg__rpc_sniff(pre, 24), SG__SNIFF_H2);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"GET / HTTP/1.1", 14),
                   SG__SNIFF_HTTP1);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"GE", 2), SG__SNIFF_MORE);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"PRI * HTTP/1.1", 14),
                   SG__SNIFF_HTTP1);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"get / ", 6),
                   SG__SNIFF_OTHER);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)" GET", 4), SG__SNIFF_OTHER);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"\x16\x03\x01", 3),
                   SG__SNIFF_OTHER);
  assert_int_equal(
      sg__rpc_sniff((const uint8_t *)"ABCDEFGHIJKLMNOPQRSTUVWX", 24),
      SG__SNIFF_OTHER);
  assert_int_equal(sg__rpc_sniff((const uint8_t *)"ABCDEFGHIJKLMNOP ", 17),
                   SG__SNIFF_HTTP1);
}

static void test_start_rejects_bad_options(void **state) {
  (void)state;
  uv_loop_t loop;
  sg_rpc_server_t *s = NULL;
  sg_err_t err;
  uv_loop_init(&loop);
  sg_rpc_server_opts_t o = {.bind = "127.0.0.1:0"};
  assert_int_equal(sg_rpc_server_start(&loop, &o, &s, &err), SG_EINVAL);
  o.on_call = on_call;
  o.on_call_cancel = on_cancel;
  const char *bad[] = {"127.0.0.1", "[::1:80", "h:", "h:99999", "h:12x"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    o.bind = bad[i];
    assert_int_equal(sg_rpc_server_start(&loop, &o, &s, &err), SG_EINVAL);
  }
  int fd, port;
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 8, &fd, &port, &err), 0);
  char bind[64];
  snprintf(bind, sizeof(bind), "127.0.0.1:%d", port);
  o.bind = bind;
  assert_int_equal(sg_rpc_server_start(&loop, &o, &s, &err), SG_EADDRINUSE);
  assert_null(s);
  sg_sock_close(fd);
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void client_echo(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  CHECK(fx, c != NULL);
  if (!c)
    return;
  tstream_t *a = tcli_start(c, "/test.Echo/Echo", NULL, "hello", 5);
  tstream_t *e = tcli_start(c, "/test.Echo/Empty", NULL, "", 0);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  CHECK(fx, a->http_status == 200 && a->grpc_status == 0);
  CHECK(fx, body_is(a, "hello", 5));
  CHECK(fx, e->grpc_status == 0 && body_is(e, "", 0));
  CHECK(fx, a->close_code == 0);
  tcli_free(c);
}

static void test_unary_echo(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx_start(fx);
  fx_run(fx, client_echo, NULL, 10000);
  assert_int_equal(fx->calls, 2);
  assert_true(strncmp(fx->last_path, "/test.Echo/", 11) == 0);
  fx_free(fx);
}

static void test_bind_forms(void **state) {
  (void)state;
  const char *binds[] = {"0.0.0.0:0", "localhost:0", "[::]:0", ":0"};
  for (size_t i = 0; i < sizeof(binds) / sizeof(binds[0]); i++) {
    fx_t *fx = fx_new(MODE_ECHO);
    fx->opts.bind = binds[i];
    fx_start(fx);
    fx_run(fx, client_echo, NULL, 10000);
    fx_free(fx);
  }
}

static void client_concurrent(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t[8];
  char msg[8][16];
  for (int i = 0; i < 8; i++) {
    snprintf(msg[i], sizeof(msg[i]), "message-%d", i);
    t[i] = tcli_start(c, "/test.Echo/Echo", NULL, msg[i], strlen(msg[i]));
  }
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  for (int i = 0; i < 8; i++) {
    CHECK(fx, t[i]->grpc_status == 0);
    CHECK(fx, body_is(t[i], msg[i], strlen(msg[i])));
  }
  tcli_free(c);
}

static void test_concurrent_streams_answered_out_of_order(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_REVERSE);
  fx->target = 8;
  fx_start(fx);
  fx_run(fx, client_concurrent, NULL, 10000);
  assert_int_equal(fx->calls, 8);
  fx_free(fx);
}

static void client_async(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  int64_t t0 = sg_now_ns();
  tstream_t *t = tcli_start(c, "/test.Echo/Later", NULL, "later", 5);
  CHECK(fx, tcli_pump(c, stream_closed, t, 5000) == 0);
  CHECK(fx, sg_now_ns() - t0 >= 40 * 1000000LL);
  CHECK(fx, t->grpc_status == 0 && body_is(t, "later", 5));
  tcli_free(c);
}

static void test_async_respond_from_timer(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ASYNC);
  fx_start(fx);
  fx_run(fx, client_async, NULL, 10000);
  fx_free(fx);
}

static void client_deadline(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  const char *h[] = {"grpc-timeout", "200m", NULL};
  int64_t t0 = sg_now_ns();
  tstream_t *t = tcli_start(c, "/test.Slow/Never", h, "x", 1);
  /* a second call whose body never ends: the deadline covers it too */
  uint8_t part[5];
  sg__grpc_prefix_write(part, 100);
  tstream_t *u = tcli_start_raw(c, "POST", "/test.Slow/Body",
                                "application/grpc", h, part, 5, 1);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  int64_t ms = (sg_now_ns() - t0) / 1000000;
  CHECK(fx, ms >= 150 && ms < 3000);
  CHECK(fx, t->grpc_status == SG_GRPC_DEADLINE_EXCEEDED);
  CHECK(fx, u->grpc_status == SG_GRPC_DEADLINE_EXCEEDED);
  tcli_free(c);
}

static int one_cancel(fx_t *fx) { return fx->cancels >= 1; }

static int conn_closed(fx_t *fx) { return fx->conn_closes >= 1; }

static void test_deadline_exceeded_cancels_once(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_HOLD);
  fx_start(fx);
  fx_run(fx, client_deadline, one_cancel, 10000);
  assert_int_equal(fx->calls, 1);
  assert_int_equal(fx->cancels, 1);
  assert_int_equal(fx->responds, 0);
  fx_free(fx);
  /* teardown did not cancel it a second time (fx_free checks tracks) */
}

static void client_rst(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t = tcli_start(c, "/test.Slow/Never", NULL, "x", 1);
  wait_calls_seen(fx, c, 1);
  nghttp2_submit_rst_stream(c->s, NGHTTP2_FLAG_NONE, t->id, NGHTTP2_CANCEL);
  tcli_pump(c, NULL, NULL, 100);
  /* the connection is still good */
  tstream_t *u = tcli_start(c, "/test.Slow/Two", NULL, "y", 1);
  wait_calls_seen(fx, c, 2);
  nghttp2_submit_rst_stream(c->s, NGHTTP2_FLAG_NONE, u->id, NGHTTP2_CANCEL);
  tcli_pump(c, NULL, NULL, 100);
  tcli_free(c);
}

static int two_cancels(fx_t *fx) { return fx->cancels >= 2; }

static void test_client_reset_cancels_once(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_HOLD);
  fx_start(fx);
  fx_run(fx, client_rst, two_cancels, 10000);
  assert_int_equal(fx->cancels, 2);
  assert_int_equal(fx->npending, 0);
  fx_free(fx);
}

static void client_close_pending(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tcli_start(c, "/test.Slow/Never", NULL, "x", 1);
  tcli_start(c, "/test.Slow/Never", NULL, "y", 1);
  wait_calls_seen(fx, c, 2);
  tcli_free(c); /* closes the socket */
}

static void test_connection_close_cancels_then_reports(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_HOLD);
  fx_start(fx);
  fx_run(fx, client_close_pending, conn_closed, 10000);
  assert_string_equal(fx->events, "CCXXK");
  fx_free(fx);
}

static void client_blob(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t[3];
  for (int i = 0; i < 3; i++)
    t[i] = tcli_start(c, "/test.Quorum/Wait", NULL, "q", 1);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  for (int i = 0; i < 3; i++) {
    CHECK(fx, t[i]->grpc_status == 0);
    CHECK(fx, body_is(t[i], "one body for three calls", 24));
  }
  tcli_free(c);
}

static void test_blob_shared_by_three_calls(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_BLOB);
  fx_start(fx);
  fx_run(fx, client_blob, NULL, 10000);
  assert_int_equal(fx->responds, 3);
  fx_free(fx);
}

static void client_meta(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  const char *h[] = {"authorization", "Bearer s3cret", "grpc-timeout", "10S",
                     NULL};
  tstream_t *t = tcli_start(c, "/test.Auth/Who", h, "", 0);
  CHECK(fx, tcli_pump(c, stream_closed, t, 5000) == 0);
  CHECK(fx, body_is(t, "Bearer s3cret", 13));
  tcli_free(c);
}

static void test_metadata_and_deadline_visible(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_META);
  fx_start(fx);
  fx_run(fx, client_meta, NULL, 10000);
  assert_true(fx->missing_meta_null);
  /* the header's 10 s, less the trip (loose for sanitizers) */
  assert_true(fx->deadline_left_ms > 5000 && fx->deadline_left_ms <= 10000);
  fx_free(fx);
}

static void client_error_message(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t = tcli_start(c, "/test.Err/NotFound", NULL, "", 0);
  CHECK(fx, tcli_pump(c, stream_closed, t, 5000) == 0);
  CHECK(fx, t->http_status == 200);
  CHECK(fx, t->grpc_status == SG_GRPC_NOT_FOUND);
  CHECK(fx, strcmp(t->grpc_message, "no such thing: \xc3\xbc 100%") == 0);
  CHECK(fx, t->body_len == 0);
  tcli_free(c);
}

static void test_error_status_trailers_only(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ERROR);
  fx_start(fx);
  fx_run(fx, client_error_message, NULL, 10000);
  fx_free(fx);
}

static void client_oversized(fx_t *fx) {
  static uint8_t big[4096];
  memset(big, 'z', sizeof(big));
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t = tcli_start(c, "/test.Echo/Echo", NULL, big, sizeof(big));
  CHECK(fx, tcli_pump(c, stream_closed, t, 5000) == 0);
  CHECK(fx, t->grpc_status == SG_GRPC_RESOURCE_EXHAUSTED);
  CHECK(fx, strstr(t->grpc_message, "larger than max") != NULL);
  /* exactly at the limit, then small: the connection is still usable */
  tstream_t *u = tcli_start(c, "/test.Echo/Echo", NULL, big, 1024);
  tstream_t *v = tcli_start(c, "/test.Echo/Echo", NULL, "ok", 2);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  CHECK(fx, u->grpc_status == 0 && u->body_total == 1029);
  CHECK(fx, v->grpc_status == 0 && body_is(v, "ok", 2));
  CHECK(fx, !c->eof);
  tcli_free(c);
}

static void test_oversized_message_resource_exhausted(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx->opts.max_message = 1024;
  fx_start(fx);
  fx_run(fx, client_oversized, NULL, 10000);
  assert_int_equal(fx->calls, 2);
  fx_free(fx);
}

static void client_bad_requests(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  const char *bad_to[] = {"grpc-timeout", "abc", NULL};
  const char *long_to[] = {"grpc-timeout", "123456789S", NULL};
  uint8_t comp[] = {1, 0, 0, 0, 1, 'x'};
  uint8_t flag2[] = {2, 0, 0, 0, 1, 'x'};
  uint8_t trunc[] = {0, 0, 0, 0, 10, 'a', 'b', 'c'};
  uint8_t trunc_prefix[] = {0, 0, 0};
  uint8_t two[] = {0, 0, 0, 0, 1, 'a', 0, 0, 0, 0, 1, 'b'};
  const char *ct = "application/grpc";
  struct {
    tstream_t *t;
    int http, grpc;
  } cases[] = {
      {tcli_start(c, "/t/BadTimeout", bad_to, "x", 1), 200,
       SG_GRPC_INVALID_ARGUMENT},
      {tcli_start(c, "/t/LongTimeout", long_to, "x", 1), 200,
       SG_GRPC_INVALID_ARGUMENT},
      {tcli_start_raw(c, "POST", "/t/Compressed", ct, NULL, comp, 6, 0), 200,
       SG_GRPC_UNIMPLEMENTED},
      {tcli_start_raw(c, "POST", "/t/Flag2", ct, NULL, flag2, 6, 0), 200,
       SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "POST", "/t/Truncated", ct, NULL, trunc, 8, 0), 200,
       SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "POST", "/t/TruncPrefix", ct, NULL, trunc_prefix, 3,
                      0),
       200, SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "POST", "/t/NoBody", ct, NULL, NULL, 0, 0), 200,
       SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "POST", "/t/Two", ct, NULL, two, 12, 0), 200,
       SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "GET", "/t/Get", ct, NULL, NULL, 0, 0), 405,
       SG_GRPC_UNIMPLEMENTED},
      {tcli_start_raw(c, "POST", "/t/Text", "text/plain", NULL, trunc, 8, 0),
       415, SG_GRPC_INTERNAL},
      {tcli_start_raw(c, "POST", "/t/Json", "application/grpcx", NULL, trunc, 8,
                      0),
       415, SG_GRPC_INTERNAL},
  };
  size_t n = sizeof(cases) / sizeof(cases[0]);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  for (size_t i = 0; i < n; i++) {
    if (cases[i].t->http_status != cases[i].http ||
        cases[i].t->grpc_status != cases[i].grpc) {
      snprintf(fx->client_err, sizeof(fx->client_err),
               "case %zu: http %d grpc %d (want %d %d) %.100s", i,
               cases[i].t->http_status, cases[i].t->grpc_status, cases[i].http,
               cases[i].grpc, cases[i].t->grpc_message);
      break;
    }
  }
  /* a header list over the limit */
  static char huge[20000];
  memset(huge, 'h', sizeof(huge) - 1);
  const char *hh[] = {"x-huge", huge, NULL};
  tstream_t *h = tcli_start(c, "/t/Huge", hh, "x", 1);
  tstream_t *ok = tcli_start(c, "/test.Echo/Echo", NULL, "fine", 4);
  CHECK(fx, tcli_pump(c, all_closed, NULL, 5000) == 0);
  CHECK(fx, h->grpc_status == SG_GRPC_RESOURCE_EXHAUSTED || h->close_code != 0);
  CHECK(fx, ok->grpc_status == 0 && body_is(ok, "fine", 4));
  tcli_free(c);
}

static void test_malformed_requests_get_statuses(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx_start(fx);
  fx_run(fx, client_bad_requests, NULL, 10000);
  assert_int_equal(fx->calls, 1); /* only the good one reached on_call */
  fx_free(fx);
}

static void client_garbage(fx_t *fx) {
  static const char *const garbage[] = {
      "\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", /* TLS ClientHello */
      "hello world\r\n",                              /* lower case */
      "PRI * HTTP/2.1\r\n\r\nSM\r\n\r\n",             /* near-preface */
  };
  for (size_t i = 0; i < sizeof(garbage) / sizeof(garbage[0]); i++) {
    int fd = raw_connect(fx->port);
    CHECK(fx, fd >= 0);
    CHECK(fx, send(fd, garbage[i], strlen(garbage[i]), MSG_NOSIGNAL) > 0);
    CHECK(fx, raw_wait_closed(fd, 2000, NULL, 0, NULL));
    close(fd);
  }
  CHECK(fx, one_echo(fx, "after garbage"));
}

static void test_garbage_instead_of_preface_closed(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx_start(fx);
  fx_run(fx, client_garbage, conn_closed, 15000);
  assert_int_equal(fx->http1s, 0);
  assert_int_equal(fx->conn_closes, 1); /* only the good one was HTTP/2 */
  fx_free(fx);
}

static void client_http1(fx_t *fx) {
  int fd = raw_connect(fx->port);
  static const char req[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  uint8_t buf[512];
  size_t n = 0;
  CHECK(fx, send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL) > 0);
  CHECK(fx, raw_wait_closed(fd, 3000, buf, sizeof(buf) - 1, &n));
  buf[n] = '\0';
  CHECK(fx, strstr((char *)buf, "200 OK") != NULL);
  CHECK(fx, n >= 2 && memcmp(buf + n - 2, "ok", 2) == 0);
  close(fd);
  CHECK(fx, one_echo(fx, "h2 still"));
}

static void test_http1_handed_off_with_bytes_unread(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx->opts.on_http1 = on_http1;
  fx_start(fx);
  fx_run(fx, client_http1, NULL, 10000);
  assert_int_equal(fx->http1s, 1);
  assert_true(fx->http1_peek_ok);
  assert_true(fx->http1_registered);
  fx_free(fx);
}

static void client_http1_refused(fx_t *fx) {
  int fd = raw_connect(fx->port);
  CHECK(fx, send(fd, "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL) > 0);
  CHECK(fx, raw_wait_closed(fd, 3000, NULL, 0, NULL));
  close(fd);
}

static void test_http1_without_handler_closed(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx_start(fx);
  fx_run(fx, client_http1_refused, NULL, 10000);
  fx_free(fx);
}

static void client_bad_frames(fx_t *fx) {
  uint8_t keep[4096];
  size_t kept;
  /* truncated frame header, then EOF */
  int fd = raw_connect(fx->port);
  CHECK(fx, send(fd, SG__H2_PREFACE "\x00\x00\x06\x04", 28, MSG_NOSIGNAL) > 0);
  shutdown(fd, SHUT_WR);
  CHECK(fx, raw_wait_closed(fd, 3000, NULL, 0, NULL));
  close(fd);
  /* huge frame length: FRAME_SIZE_ERROR */
  fd = raw_connect(fx->port);
  static const uint8_t settings[] = {0, 0, 0, 4, 0, 0, 0, 0, 0};
  static const uint8_t huge[] = {0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1};
  CHECK(fx, send(fd, SG__H2_PREFACE, 24, MSG_NOSIGNAL) == 24);
  CHECK(fx, send(fd, settings, 9, MSG_NOSIGNAL) == 9);
  CHECK(fx, send(fd, huge, 9, MSG_NOSIGNAL) == 9);
  CHECK(fx, raw_wait_closed(fd, 3000, keep, sizeof(keep), &kept));
  CHECK(fx, frames_have(keep, kept, NGHTTP2_GOAWAY));
  close(fd);
  /* garbage after the preface */
  fd = raw_connect(fx->port);
  uint8_t junk[512];
  for (size_t i = 0; i < sizeof(junk); i++)
    junk[i] = (uint8_t)(i * 131 + 7);
  CHECK(fx, send(fd, SG__H2_PREFACE, 24, MSG_NOSIGNAL) == 24);
  CHECK(fx, send(fd, junk, sizeof(junk), MSG_NOSIGNAL) > 0);
  CHECK(fx, raw_wait_closed(fd, 3000, keep, sizeof(keep), &kept));
  close(fd);
  /* a HEADERS frame on stream 0 after a valid SETTINGS */
  fd = raw_connect(fx->port);
  static const uint8_t hdr0[] = {0, 0, 1, 1, 5, 0, 0, 0, 0, 0x82};
  CHECK(fx, send(fd, SG__H2_PREFACE, 24, MSG_NOSIGNAL) == 24);
  CHECK(fx, send(fd, settings, 9, MSG_NOSIGNAL) == 9);
  CHECK(fx, send(fd, hdr0, sizeof(hdr0), MSG_NOSIGNAL) > 0);
  CHECK(fx, raw_wait_closed(fd, 3000, keep, sizeof(keep), &kept));
  CHECK(fx, frames_have(keep, kept, NGHTTP2_GOAWAY));
  close(fd);
  CHECK(fx, one_echo(fx, "after bad frames"));
}

static void test_bad_frames_get_goaway_and_close(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx_start(fx);
  fx_run(fx, client_bad_frames, NULL, 20000);
  fx_free(fx);
}

static void client_silent(fx_t *fx) {
  int fd = raw_connect(fx->port);
  int fd2 = raw_connect(fx->port);
  int64_t t0 = sg_now_ns();
  CHECK(fx, send(fd2, "PRI * HT", 8, MSG_NOSIGNAL) == 8); /* slowloris */
  CHECK(fx, raw_wait_closed(fd, 3000, NULL, 0, NULL));
  CHECK(fx, raw_wait_closed(fd2, 3000, NULL, 0, NULL));
  int64_t ms = (sg_now_ns() - t0) / 1000000;
  CHECK(fx, ms >= 200 && ms < 2500);
  close(fd);
  close(fd2);
  CHECK(fx, one_echo(fx, "after silence"));
}

static void test_silent_client_closed_after_sniff_timeout(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx->opts.sniff_timeout_ms = 300;
  fx_start(fx);
  fx_run(fx, client_silent, NULL, 10000);
  fx_free(fx);
}

static int conn_count_is(tcli_t *c, void *arg) {
  (void)c;
  void **a = arg;
  return atomic_load(&((fx_t *)a[0])->conn_count) == *(int *)a[1];
}

static void client_max_conns(fx_t *fx) {
  tcli_t *a = tcli_open(fx->port, 0), *b = tcli_open(fx->port, 0);
  tstream_t *ta = tcli_start(a, "/test.Echo/Echo", NULL, "a", 1);
  tstream_t *tb = tcli_start(b, "/test.Echo/Echo", NULL, "b", 1);
  CHECK(fx, tcli_pump(a, stream_closed, ta, 5000) == 0);
  CHECK(fx, tcli_pump(b, stream_closed, tb, 5000) == 0);
  int fd = raw_connect(fx->port);
  CHECK(fx, raw_wait_closed(fd, 3000, NULL, 0, NULL)); /* the third */
  close(fd);
  tstream_t *ta2 = tcli_start(a, "/test.Echo/Echo", NULL, "a2", 2);
  CHECK(fx, tcli_pump(a, stream_closed, ta2, 5000) == 0);
  CHECK(fx, body_is(ta2, "a2", 2));
  tcli_free(a);
  int one = 1;
  void *arg[2] = {fx, &one};
  CHECK(fx, tcli_pump(b, conn_count_is, arg, 5000) == 0);
  CHECK(fx, one_echo(fx, "room again"));
  tcli_free(b);
}

static void test_max_connections_extra_closed(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx->opts.max_connections = 2;
  fx_start(fx);
  fx_run(fx, client_max_conns, NULL, 15000);
  fx_free(fx);
}

static void client_idle(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tstream_t *t = tcli_start(c, "/test.Echo/Echo", NULL, "i", 1);
  CHECK(fx, tcli_pump(c, stream_closed, t, 5000) == 0);
  int64_t t0 = sg_now_ns();
  tcli_pump(c, NULL, NULL, 3000); /* returns at EOF */
  int64_t ms = (sg_now_ns() - t0) / 1000000;
  CHECK(fx, c->eof);
  CHECK(fx, c->goaway && c->goaway_code == NGHTTP2_NO_ERROR);
  CHECK(fx, ms >= 200 && ms < 2500);
  tcli_free(c);
}

static void test_idle_connection_closed(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_ECHO);
  fx->opts.idle_timeout_ms = 300;
  fx_start(fx);
  fx_run(fx, client_idle, conn_closed, 10000);
  fx_free(fx);
}

static void client_stalled_reader(fx_t *fx) {
  /* big windows, then never read: the server must give up on us */
  tcli_t *c = tcli_open(fx->port, 0x7fffffff);
  for (int i = 0; i < 4; i++)
    tcli_start(c, "/test.Big/Get", NULL, "", 0);
  nghttp2_session_send(c->s);
  sleep(2);
  uint8_t buf[65536];
  size_t total = 0;
  for (;;) {
    ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
    if (n <= 0)
      break;
    total += (size_t)n;
  }
  CHECK(fx, total < (size_t)16 << 20); /* it did not get everything */
  tcli_free(c);
}

static void test_stalled_reader_closed(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_BIG);
  fx->opts.idle_timeout_ms = 300;
  fx_start(fx);
  fx_run(fx, client_stalled_reader, conn_closed, 15000);
  /* past OUT_HIGH the server stops reading, so maybe not all 4 arrived */
  assert_true(fx->responds >= 1);
  fx_free(fx);
}

/* in_use_bytes: glibc's count of malloc'd bytes in use (0 when the
 * allocator is replaced, as under the sanitizers). */
static size_t in_use_bytes(void) {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

#define HELD_CALLS 8

static void client_stalled_holds(fx_t *fx) {
  /* every window open, HELD_CALLS big answers asked for, nothing read */
  tcli_t *c = tcli_open(fx->port, 0x7fffffff);
  for (int i = 0; i < HELD_CALLS; i++)
    tcli_start(c, "/test.Big/Get", NULL, "", 0);
  nghttp2_session_send(c->s);
  sg_deadline_t d = sg_deadline_in_ms(10000);
  while (!atomic_load(&fx->client_release) && !sg_deadline_passed(d))
    usleep(10000);
  CHECK(fx, atomic_load(&fx->client_release));
  tcli_free(c);
}

/* measure_cb (every 10 ms): once calls are answered and no more were for
 * 500 ms (the server has filled the socket and stopped reading), record
 * what is allocated and let the client go. */
static void measure_cb(uv_timer_t *t) {
  fx_t *fx = t->data;
  int64_t now = sg_now_ns();
  if (fx->responds == 0 || fx->responds != fx->steady_responds) {
    fx->steady_responds = fx->responds;
    fx->steady_at_ns = now + INT64_C(500000000);
    return;
  }
  if (now < fx->steady_at_ns)
    return;
  fx->mem_held = in_use_bytes();
  atomic_store(&fx->client_release, 1);
  uv_timer_stop(t);
}

static void test_stalled_reader_output_bounded(void **state) {
  /* A peer that reads nothing while big answers wait for it costs the
   * answers themselves, not per-connection copies of them: the server
   * queues about one batch (tens of KiB) behind the full socket and leaves
   * the rest in the engine.  Copying up to a megabyte before the first
   * write (as it once did) holds several MiB here. */
  (void)state;
  fx_t *fx = fx_new(MODE_BIG);
  fx_start(fx);
  fx->mem_base = in_use_bytes();
  uv_timer_start(&fx->later, measure_cb, 10, 10);
  fx_run(fx, client_stalled_holds, NULL, 20000);
  /* it may stop reading before every request is in */
  assert_true(fx->steady_responds >= 1 && fx->steady_responds <= HELD_CALLS);
  size_t answers = (size_t)fx->steady_responds << 22; /* 4 MiB each */
  if (fx->mem_held < answers) {
    printf("# no bound checked: malloc statistics unavailable (replaced "
           "allocator: %zu bytes reported in use)\n",
           fx->mem_held);
  } else {
    /* the test client's own structures are counted too */
    size_t client = sizeof(tcli_t) + HELD_CALLS * sizeof(tstream_t);
    size_t extra = fx->mem_held - fx->mem_base - answers - client;
    printf("# %d answers held, and %zu KiB more by the server\n",
           fx->steady_responds, extra >> 10);
    assert_true(extra < ((size_t)1 << 20));
  }
  fx_free(fx);
}

static void client_server_close(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tcli_start(c, "/test.Slow/A", NULL, "a", 1);
  tcli_start(c, "/test.Slow/B", NULL, "b", 1);
  tcli_pump(c, NULL, NULL, 5000); /* until EOF */
  CHECK(fx, c->eof);
  tcli_free(c);
}

static int server_closed(fx_t *fx) { return fx->closed == 1; }

static void test_server_close_with_pending_calls(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_CLOSE);
  fx->target = 2;
  fx_start(fx);
  fx_run(fx, client_server_close, server_closed, 10000);
  assert_int_equal(fx->cancels, 2);
  assert_int_equal(fx->conn_closes, 1);
  assert_string_equal(fx->events, "CCXXK");
  fx_free(fx);
}

static void client_server_close_inline(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  tcli_start(c, "/test.Slow/A", NULL, "a", 1);
  tcli_pump(c, NULL, NULL, 5000);
  CHECK(fx, c->eof);
  tcli_free(c);
}

static void test_server_close_from_inside_on_call(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_CLOSE_INLINE);
  fx_start(fx);
  fx_run(fx, client_server_close_inline, server_closed, 10000);
  assert_int_equal(fx->calls, 1);
  assert_int_equal(fx->responds, 1);
  assert_int_equal(fx->cancels, 0);
  assert_int_equal(fx->conn_closes, 1);
  fx_free(fx);
}

/* Server close while a peer is mid-sniff and one is mid-call. */
static void client_close_mixed(fx_t *fx) {
  int fd = raw_connect(fx->port);
  tcli_t *c = tcli_open(fx->port, 0);
  tcli_start(c, "/test.Slow/A", NULL, "a", 1);
  tcli_start(c, "/test.Slow/B", NULL, "b", 1);
  tcli_pump(c, NULL, NULL, 5000);
  CHECK(fx, c->eof);
  CHECK(fx, raw_wait_closed(fd, 3000, NULL, 0, NULL));
  close(fd);
  tcli_free(c);
}

static void test_server_close_mid_sniff(void **state) {
  (void)state;
  fx_t *fx = fx_new(MODE_CLOSE);
  fx->target = 2;
  fx_start(fx);
  fx_run(fx, client_close_mixed, NULL, 10000);
  assert_int_equal(fx->cancels, 2);
  fx_free(fx);
}

/*
 * Allocation failure injection: fail the n-th allocation after the server
 * started, for each n until a run sees no failure.  Nothing may crash or
 * leak, and every call that reached on_call still completes exactly once.
 */
static void client_torture(fx_t *fx) {
  tcli_t *c = tcli_open(fx->port, 0);
  if (!c)
    return;
  tcli_start(c, "/test.Echo/Echo", NULL, "t1", 2);
  tcli_start(c, "/test.Echo/Echo", NULL, "t2", 2);
  tcli_pump(c, all_closed, NULL, 400);
  tcli_free(c);
}

static void test_allocation_failures(void **state) {
  (void)state;
  sg_log_set_level(SG_LOG_ERROR);
  for (long n = 1; n < 400; n++) {
    fx_t *fx = fx_new(MODE_ECHO);
    fx->tolerant = 1;
    fx_start(fx);
    sg_test_fail_alloc(n, 0);
    fx_run(fx, client_torture, NULL, 5000);
    long failed = sg_test_fail_alloc(0, 0);
    fx_free(fx);
    if (failed == 0) {
      print_message("allocation torture: %ld runs\n", n);
      break;
    }
  }
  sg_log_set_level(SG_LOG_WARN);
}

int main(void) {
  sg_log_set_level(SG_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sniff_classifies_first_bytes),
      cmocka_unit_test(test_start_rejects_bad_options),
      cmocka_unit_test(test_unary_echo),
      cmocka_unit_test(test_bind_forms),
      cmocka_unit_test(test_concurrent_streams_answered_out_of_order),
      cmocka_unit_test(test_async_respond_from_timer),
      cmocka_unit_test(test_deadline_exceeded_cancels_once),
      cmocka_unit_test(test_client_reset_cancels_once),
      cmocka_unit_test(test_connection_close_cancels_then_reports),
      cmocka_unit_test(test_blob_shared_by_three_calls),
      cmocka_unit_test(test_metadata_and_deadline_visible),
      cmocka_unit_test(test_error_status_trailers_only),
      cmocka_unit_test(test_oversized_message_resource_exhausted),
      cmocka_unit_test(test_malformed_requests_get_statuses),
      cmocka_unit_test(test_garbage_instead_of_preface_closed),
      cmocka_unit_test(test_http1_handed_off_with_bytes_unread),
      cmocka_unit_test(test_http1_without_handler_closed),
      cmocka_unit_test(test_bad_frames_get_goaway_and_close),
      cmocka_unit_test(test_silent_client_closed_after_sniff_timeout),
      cmocka_unit_test(test_max_connections_extra_closed),
      cmocka_unit_test(test_idle_connection_closed),
      cmocka_unit_test(test_stalled_reader_closed),
      cmocka_unit_test(test_stalled_reader_output_bounded),
      cmocka_unit_test(test_server_close_with_pending_calls),
      cmocka_unit_test(test_server_close_from_inside_on_call),
      cmocka_unit_test(test_server_close_mid_sniff),
      cmocka_unit_test(test_allocation_failures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
