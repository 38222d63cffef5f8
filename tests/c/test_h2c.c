/*
 * test_h2c.c: the client HTTP/2 engine (src/rpc/h2c.h) without sockets.
 *
 * The server is nghttp2's own server session in this process (plain malloc,
 * so allocation failure injection hits the engine only).  pump() moves
 * bytes between the two until both are quiet; the tests then script the
 * server's answer (a response, trailers-only status, RST_STREAM, GOAWAY,
 * garbage, a cut-off frame) and check what the engine reports: the
 * operations it ran and sg__h2c_result() of the closed stream.  Every test
 * ends with the engine freed and every stream finalised, so ASan sees any
 * leak.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <nghttp2/nghttp2.h>

#include "rpc/grpc.h"
#include "rpc/h2c.h"

#define PATH "/test.Echo/Echo"
#define MAX_MESSAGE 4096

/* ---- the scripted server ------------------------------------------------- */

typedef struct srv_s {
  nghttp2_session *s;
  int32_t sid;  /* the last request's stream */
  int requests; /* requests that ended (END_STREAM) */
  int nhdr;     /* headers of the last request */
  char hdr[16][2][96];
  uint8_t resp[64]; /* prefix + message of the DATA we answer with */
  size_t resp_len, resp_off;
  const char *trailer_status; /* grpc-status in trailers after the DATA */
} srv_t;

static int srv_on_header(nghttp2_session *s, const nghttp2_frame *f,
                         const uint8_t *name, size_t namelen,
                         const uint8_t *value, size_t valuelen, uint8_t flags,
                         void *ud) {
  (void)s;
  (void)f;
  (void)flags;
  srv_t *v = ud;
  if (v->nhdr < 16 && namelen < 96 && valuelen < 96) {
    memcpy(v->hdr[v->nhdr][0], name, namelen);
    v->hdr[v->nhdr][0][namelen] = '\0';
    memcpy(v->hdr[v->nhdr][1], value, valuelen);
    v->hdr[v->nhdr][1][valuelen] = '\0';
    v->nhdr++;
  }
  return 0;
}

static int srv_on_frame_recv(nghttp2_session *s, const nghttp2_frame *f,
                             void *ud) {
  (void)s;
  srv_t *v = ud;
  if ((f->hd.type == NGHTTP2_HEADERS || f->hd.type == NGHTTP2_DATA) &&
      (f->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
    v->sid = f->hd.stream_id;
    v->requests++;
  }
  return 0;
}

static void srv_init(srv_t *v) {
  nghttp2_session_callbacks *cbs;
  memset(v, 0, sizeof(*v));
  assert_int_equal(nghttp2_session_callbacks_new(&cbs), 0);
  nghttp2_session_callbacks_set_on_header_callback(cbs, srv_on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, srv_on_frame_recv);
  assert_int_equal(nghttp2_session_server_new(&v->s, cbs, v), 0);
  nghttp2_session_callbacks_del(cbs);
  assert_int_equal(nghttp2_submit_settings(v->s, NGHTTP2_FLAG_NONE, NULL, 0),
                   0);
}

static const char *srv_header(const srv_t *v, const char *name) {
  for (int i = 0; i < v->nhdr; i++)
    if (strcmp(v->hdr[i][0], name) == 0)
      return v->hdr[i][1];
  return NULL;
}

#define NV(n, v)                                                               \
  {                                                                            \
    (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v),                  \
        NGHTTP2_NV_FLAG_NONE                                                   \
  }

/* srv_data: the response DATA, then trailers with v->trailer_status. */
static ssize_t srv_data(nghttp2_session *s, int32_t sid, uint8_t *buf,
                        size_t length, uint32_t *flags,
                        nghttp2_data_source *src, void *ud) {
  (void)ud;
  srv_t *v = src->ptr;
  size_t n = v->resp_len - v->resp_off;
  if (n > length)
    n = length;
  memcpy(buf, v->resp + v->resp_off, n);
  v->resp_off += n;
  if (v->resp_off == v->resp_len) {
    nghttp2_nv tr[] = {NV("grpc-status", v->trailer_status)};
    *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    if (nghttp2_submit_trailer(s, sid, tr, 1) != 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  return (ssize_t)n;
}

/* srv_respond: 200, DATA = prefix(len(msg)) + msg[0..cut), trailers. */
static void srv_respond(srv_t *v, const char *msg, size_t cut,
                        const char *grpc_status) {
  size_t n = strlen(msg);
  assert_true(SG_GRPC_PREFIX_LEN + cut <= sizeof(v->resp));
  sg__grpc_prefix_write(v->resp, (uint32_t)n);
  memcpy(v->resp + SG_GRPC_PREFIX_LEN, msg, cut);
  v->resp_len = SG_GRPC_PREFIX_LEN + cut;
  v->resp_off = 0;
  v->trailer_status = grpc_status;
  nghttp2_nv nva[] = {NV(":status", "200"),
                      NV("content-type", "application/grpc")};
  nghttp2_data_provider prd;
  prd.source.ptr = v;
  prd.read_callback = srv_data;
  assert_int_equal(nghttp2_submit_response(v->s, v->sid, nva, 2, &prd), 0);
}

/* srv_status: a trailers-only answer (grpc_status NULL: none). */
static void srv_status(srv_t *v, const char *http, const char *grpc_status,
                       const char *message) {
  nghttp2_nv nva[] = {NV(":status", http),
                      NV("content-type", "application/grpc"),
                      NV("grpc-status", grpc_status ? grpc_status : ""),
                      NV("grpc-message", message ? message : "")};
  size_t n = !grpc_status ? 2 : message ? 4 : 3;
  assert_int_equal(nghttp2_submit_response(v->s, v->sid, nva, n, NULL), 0);
}

/* ---- the engine's owner -------------------------------------------------- */

typedef struct owner_s {
  sg__h2c_t h;
  srv_t srv;
  sg__h2c_stream_t st;
  uint8_t body[SG_GRPC_PREFIX_LEN + 4];
  int closed, not_sent, pings;
  uint32_t error_code;
  char why[128];
  sg__h2c_result_t r; /* of the closed stream */
  uint8_t resp[MAX_MESSAGE];
} owner_t;

static void op_closed(void *owner, sg__h2c_stream_t *s, uint32_t error_code) {
  owner_t *o = owner;
  assert_ptr_equal(s, &o->st);
  assert_false(s->linked);
  o->closed++;
  o->error_code = error_code;
  sg__h2c_result(s, error_code, o->h.cfg.max_message, &o->r);
  if (o->r.resp_len) { /* copy out: the stream's buffer goes with it */
    assert_true(o->r.resp_len <= sizeof(o->resp));
    memcpy(o->resp, o->r.resp, o->r.resp_len);
    o->r.resp = o->resp;
  }
  sg__h2c_stream_fini(s);
}

static void op_not_sent(void *owner, sg__h2c_stream_t *s, const char *why) {
  owner_t *o = owner;
  assert_ptr_equal(s, &o->st);
  o->not_sent++;
  snprintf(o->why, sizeof(o->why), "%s", why);
}

static void op_ping_acked(void *owner) { ((owner_t *)owner)->pings++; }

static const sg__h2c_ops_t ops = {op_closed, op_not_sent, op_ping_acked};

/*
 * pump: move bytes both ways until neither side has any; returns the first
 * engine error (sg__h2c_send / sg__h2c_recv), else 0.
 */
static int pump(owner_t *o) {
  for (int round = 0; round < 64; round++) {
    int moved = 0;
    for (;;) {
      const uint8_t *p;
      ssize_t n = sg__h2c_send(&o->h, &p);
      if (n < 0)
        return (int)n;
      if (n == 0)
        break;
      moved = 1;
      assert_int_equal(nghttp2_session_mem_recv(o->srv.s, p, (size_t)n), n);
    }
    for (;;) {
      const uint8_t *p;
      ssize_t n = nghttp2_session_mem_send(o->srv.s, &p);
      assert_true(n >= 0);
      if (n == 0)
        break;
      moved = 1;
      int rc = sg__h2c_recv(&o->h, p, (size_t)n);
      if (rc)
        return rc;
    }
    if (!moved)
      return 0;
  }
  fail_msg("pump: no quiet after 64 rounds");
  return 0;
}

/* owner_new: engine + server, handshake done, one request submitted and
 * received by the server.  With `alloc_ok` 0 any step may fail (the
 * allocation torture); returns NULL if it did. */
static owner_t *owner_new_ex(size_t max_message, int alloc_ok) {
  owner_t *o = calloc(1, sizeof(*o));
  assert_non_null(o);
  srv_init(&o->srv);
  sg__h2c_config_t cfg = {.authority = "h2c.test:50051",
                          .max_message = max_message};
  int rc = sg__h2c_init(&o->h, &cfg, &ops, o);
  if (rc) {
    assert_false(alloc_ok);
    assert_int_equal(rc, SG_ENOMEM);
    nghttp2_session_del(o->srv.s);
    free(o);
    return NULL;
  }
  sg__h2c_stream_init(&o->st, max_message);
  sg__grpc_prefix_write(o->body, 4);
  memcpy(o->body + SG_GRPC_PREFIX_LEN, "ping", 4);
  sg__h2c_header_t extra[] = {{"grpc-timeout", "5S"},
                              {"authorization", "Bearer t0k"}};
  rc = sg__h2c_submit(&o->h, &o->st, PATH, extra, 2, o->body, sizeof(o->body));
  if (rc == 0)
    rc = pump(o);
  if (alloc_ok) {
    assert_int_equal(rc, 0);
    assert_true(o->h.got_settings);
    assert_int_equal(o->srv.requests, 1);
    assert_int_equal(o->st.stream_id, o->srv.sid);
  }
  return o;
}

static owner_t *owner_new(size_t max_message) {
  return owner_new_ex(max_message, 1);
}

/* owner_free: take back what is still open, free both sides. */
static void owner_free(owner_t *o) {
  sg__h2c_stream_t *s;
  while ((s = sg__h2c_take(&o->h)) != NULL) {
    assert_ptr_equal(s, &o->st); /* the only stream, and still open */
    assert_int_equal(o->closed + o->not_sent, 0);
  }
  assert_true(sg__h2c_idle(&o->h));
  sg__h2c_stream_fini(&o->st);
  sg__h2c_free(&o->h);
  sg__h2c_free(&o->h); /* idempotent */
  nghttp2_session_del(o->srv.s);
  free(o);
}

/* ---- tests --------------------------------------------------------------- */

static void test_unary_call_ok(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  /* The request as the server saw it. */
  assert_string_equal(srv_header(&o->srv, ":method"), "POST");
  assert_string_equal(srv_header(&o->srv, ":scheme"), "http");
  assert_string_equal(srv_header(&o->srv, ":path"), PATH);
  assert_string_equal(srv_header(&o->srv, ":authority"), "h2c.test:50051");
  assert_string_equal(srv_header(&o->srv, "content-type"), "application/grpc");
  assert_string_equal(srv_header(&o->srv, "te"), "trailers");
  assert_string_equal(srv_header(&o->srv, "grpc-timeout"), "5S");
  assert_string_equal(srv_header(&o->srv, "authorization"), "Bearer t0k");
  assert_non_null(srv_header(&o->srv, "user-agent"));
  assert_memory_equal(srv_header(&o->srv, "user-agent"), "grpc-c-stepguard/",
                      17);
  assert_false(sg__h2c_idle(&o->h));

  srv_respond(&o->srv, "pong", 4, "0");
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->error_code, NGHTTP2_NO_ERROR);
  assert_int_equal(o->r.rc, 0);
  assert_int_equal(o->r.grpc_status, 0);
  assert_int_equal(o->r.resp_len, 4);
  assert_memory_equal(o->r.resp, "pong", 4);
  assert_string_equal(o->r.msg, "");
  assert_true(sg__h2c_idle(&o->h));
  assert_true(sg__h2c_want_io(&o->h)); /* the session stays up */
  owner_free(o);
}

static void test_error_status_with_message(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_status(&o->srv, "200", "5", "no%20such%20thing");
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->r.grpc_status, SG_GRPC_NOT_FOUND);
  assert_int_equal(o->r.rc, sg__grpc_status_to_err(SG_GRPC_NOT_FOUND));
  assert_string_equal(o->r.msg,
                      "status: NOT_FOUND, message: \"no such thing\"");
  assert_null(o->r.resp);
  owner_free(o);
}

static void test_http_status_without_grpc_status(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_status(&o->srv, "503", NULL, NULL);
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->r.grpc_status, SG_GRPC_UNAVAILABLE);
  assert_string_equal(o->r.msg,
                      "status: UNAVAILABLE, message: \"HTTP status 503\"");
  owner_free(o);
}

static void test_ok_status_with_cut_message_is_eproto(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_respond(&o->srv, "pong", 2, "0"); /* prefix says 4, 2 arrive */
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->r.rc, SG_EPROTO);
  assert_int_equal(o->r.grpc_status, 0);
  assert_string_equal(o->r.msg,
                      PATH ": status OK but 7 body bytes are not one message");
  owner_free(o);
}

static void test_response_over_max_message_resets(void **state) {
  (void)state;
  owner_t *o = owner_new(8);
  srv_respond(&o->srv, "a message of 27 bytes total", 20, "0");
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->error_code, NGHTTP2_CANCEL); /* our RST_STREAM */
  assert_int_equal(o->r.rc, SG_ETOOBIG);
  assert_string_equal(o->r.msg, PATH ": response exceeds max_message 8");
  owner_free(o);
}

static void test_stream_reset_by_server(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  assert_int_equal(nghttp2_submit_rst_stream(o->srv.s, NGHTTP2_FLAG_NONE,
                                             o->srv.sid,
                                             NGHTTP2_INTERNAL_ERROR),
                   0);
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->error_code, NGHTTP2_INTERNAL_ERROR);
  assert_int_equal(o->r.rc, SG_ECONNRESET);
  assert_int_equal(o->r.grpc_status, -1);
  assert_string_equal(o->r.msg, PATH ": stream reset (INTERNAL_ERROR)");
  owner_free(o);
}

static void test_reset_by_us_is_sent_once(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  assert_int_equal(sg__h2c_reset(&o->h, &o->st, NGHTTP2_CANCEL), 0);
  assert_true(o->st.rst_sent);
  assert_int_equal(sg__h2c_reset(&o->h, &o->st, NGHTTP2_CANCEL), 0);
  assert_int_equal(o->closed, 0); /* reset runs no operation */
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->error_code, NGHTTP2_CANCEL);
  assert_int_equal(o->r.rc, SG_ECONNRESET);
  owner_free(o);
}

static void test_goaway_refuses_the_open_stream(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  assert_int_equal(nghttp2_submit_goaway(o->srv.s, NGHTTP2_FLAG_NONE, 0,
                                         NGHTTP2_NO_ERROR, NULL, 0),
                   0);
  assert_int_equal(pump(o), 0);
  assert_true(o->h.goaway);
  assert_int_equal(o->h.sent_goaway_err, 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->error_code, NGHTTP2_REFUSED_STREAM);
  assert_int_equal(o->r.rc, SG_ECONNRESET);
  assert_string_equal(o->r.msg, PATH ": stream reset (REFUSED_STREAM)");
  owner_free(o);
}

static void test_request_after_goaway_is_not_sent(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_respond(&o->srv, "pong", 4, "0");
  assert_int_equal(nghttp2_submit_goaway(o->srv.s, NGHTTP2_FLAG_NONE,
                                         o->srv.sid, NGHTTP2_NO_ERROR, NULL, 0),
                   0);
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->closed, 1);
  assert_int_equal(o->r.rc, 0);
  assert_true(o->h.goaway);
  /* A second request on the same engine: refused before it leaves. */
  sg__h2c_stream_init(&o->st, MAX_MESSAGE);
  o->closed = 0;
  assert_int_equal(
      sg__h2c_submit(&o->h, &o->st, PATH, NULL, 0, o->body, sizeof(o->body)),
      0); /* nghttp2 decides when the HEADERS would leave */
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->not_sent, 1);
  assert_int_equal(o->closed, 0);
  assert_false(o->st.linked);
  assert_true(sg__h2c_idle(&o->h));
  assert_string_equal(o->why, "request HEADERS is not allowed");
  assert_int_equal(o->srv.requests, 1);
  owner_free(o);
}

static void test_ping_ack_is_reported_once(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  assert_int_equal(sg__h2c_ping(&o->h), 0);
  assert_true(o->h.ping_outstanding);
  assert_int_equal(pump(o), 0);
  assert_int_equal(o->pings, 1);
  assert_false(o->h.ping_outstanding);
  owner_free(o);
}

static void test_garbage_ends_the_session_cleanly(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  /* DATA on stream 0 is a connection error: GOAWAY(PROTOCOL_ERROR). */
  const uint8_t bad[] = {0, 0, 4,   NGHTTP2_DATA, 0,   0,  0,
                         0, 0, 'j', 'u',          'n', 'k'};
  int rc = sg__h2c_recv(&o->h, bad, sizeof(bad));
  assert_true(rc == 0 || rc == SG_EPROTO);
  const uint8_t *p;
  while (sg__h2c_send(&o->h, &p) > 0)
    ;
  assert_int_equal(o->h.sent_goaway_err, NGHTTP2_PROTOCOL_ERROR);
  assert_false(sg__h2c_want_io(&o->h)); /* the owner ends the connection */
  assert_int_equal(o->closed, 0);       /* and fails the open stream */
  assert_ptr_equal(sg__h2c_take(&o->h), &o->st);
  assert_null(sg__h2c_take(&o->h));
  owner_free(o);
}

static void test_text_instead_of_settings(void **state) {
  (void)state;
  owner_t *o = calloc(1, sizeof(*o));
  assert_non_null(o);
  srv_init(&o->srv);
  sg__h2c_config_t cfg = {.authority = "x:1", .max_message = 16};
  assert_int_equal(sg__h2c_init(&o->h, &cfg, &ops, o), 0);
  const char *text = "HTTP/1.1 400 Bad Request\r\n\r\n";
  int rc = sg__h2c_recv(&o->h, (const uint8_t *)text, strlen(text));
  assert_true(rc == 0 || rc == SG_EPROTO);
  const uint8_t *p;
  while (sg__h2c_send(&o->h, &p) > 0)
    ;
  assert_false(o->h.got_settings);
  assert_true(o->h.sent_goaway_err != 0);
  assert_false(sg__h2c_want_io(&o->h));
  owner_free(o);
}

static void test_truncated_frame_keeps_waiting(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_respond(&o->srv, "pong", 4, "0");
  uint8_t all[512];
  size_t len = 0;
  for (;;) {
    const uint8_t *p;
    ssize_t n = nghttp2_session_mem_send(o->srv.s, &p);
    assert_true(n >= 0 && len + (size_t)n <= sizeof(all));
    if (n == 0)
      break;
    memcpy(all + len, p, (size_t)n);
    len += (size_t)n;
  }
  assert_true(len > 12);
  /* All but the last byte: HEADERS, DATA and most of the trailers. */
  assert_int_equal(sg__h2c_recv(&o->h, all, len - 1), 0);
  assert_int_equal(o->closed, 0);
  assert_false(sg__h2c_idle(&o->h));
  assert_true(sg__h2c_want_io(&o->h));
  owner_free(o); /* the owner gives up: take() returns the stream */
}

static void test_too_many_extra_headers(void **state) {
  (void)state;
  owner_t *o = owner_new(MAX_MESSAGE);
  srv_respond(&o->srv, "pong", 4, "0");
  assert_int_equal(pump(o), 0);
  sg__h2c_header_t extra[SG__H2C_MAX_EXTRA_HEADERS + 1];
  for (size_t i = 0; i < SG__H2C_MAX_EXTRA_HEADERS + 1; i++)
    extra[i] = (sg__h2c_header_t){"x-h", "v"};
  sg__h2c_stream_t s2;
  sg__h2c_stream_init(&s2, MAX_MESSAGE);
  assert_int_equal(sg__h2c_submit(&o->h, &s2, PATH, extra,
                                  SG__H2C_MAX_EXTRA_HEADERS + 1, o->body,
                                  sizeof(o->body)),
                   SG_EINVAL);
  assert_false(s2.linked);
  assert_true(sg__h2c_idle(&o->h));
  sg__h2c_stream_fini(&s2);
  owner_free(o);
}

/*
 * Allocation failure injection: fail the n-th engine allocation of a whole
 * OK exchange, for each n until a run sees no failure.  Every step reports
 * SG_ENOMEM or completes the stream with an error; nothing crashes or
 * leaks (ASan), and the stream completes at most once.
 */
static void test_allocation_failures(void **state) {
  (void)state;
  long n;
  for (n = 1; n < 1000; n++) {
    sg_test_fail_alloc(n, 0);
    owner_t *o = owner_new_ex(MAX_MESSAGE, 0);
    if (o && o->st.linked && o->srv.requests == 1) {
      srv_respond(&o->srv, "pong", 4, "0");
      (void)pump(o);
    }
    long failed = sg_test_fail_alloc(0, 0);
    if (o) {
      assert_true(o->closed + o->not_sent <= 1);
      if (o->closed && o->r.rc == 0)
        assert_memory_equal(o->r.resp, "pong", 4);
      if (failed == 0) {
        assert_int_equal(o->closed, 1);
        assert_int_equal(o->r.rc, 0);
      }
      owner_free(o); /* a stream still open must not have completed */
    }
    if (failed == 0)
      break;
  }
  assert_true(n > 5 && n < 1000);
  print_message("allocation torture: %ld runs\n", n);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_unary_call_ok),
      cmocka_unit_test(test_error_status_with_message),
      cmocka_unit_test(test_http_status_without_grpc_status),
      cmocka_unit_test(test_ok_status_with_cut_message_is_eproto),
      cmocka_unit_test(test_response_over_max_message_resets),
      cmocka_unit_test(test_stream_reset_by_server),
      cmocka_unit_test(test_reset_by_us_is_sent_once),
      cmocka_unit_test(test_goaway_refuses_the_open_stream),
      cmocka_unit_test(test_request_after_goaway_is_not_sent),
      cmocka_unit_test(test_ping_ack_is_reported_once),
      cmocka_unit_test(test_garbage_ends_the_session_cleanly),
      cmocka_unit_test(test_text_instead_of_settings),
      cmocka_unit_test(test_truncated_frame_keeps_waiting),
      cmocka_unit_test(test_too_many_extra_headers),
      cmocka_unit_test(test_allocation_failures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
