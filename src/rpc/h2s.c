/*
 * h2s.c: gRPC unary calls over one server-side HTTP/2 session; no I/O.
 *
 *   sniff        sg__rpc_sniff(): preface / HTTP/1 request line / other
 *   session      sg__h2s_init() builds an nghttp2 server session whose
 *                allocations go through sg_malloc (failure injection) with
 *                manual connection flow control (see "windows" below)
 *   callbacks    on_begin_headers .. on_stream_close turn frames into calls:
 *                HEADERS -> validate -> DATA -> prefix + message -> dispatch
 *   replies      call_reply() is the one place a response is submitted:
 *                OK = HEADERS, DATA (prefix + blob), trailers; errors =
 *                trailers-only HEADERS with grpc-status and grpc-message
 *   public API   sg_rpc_call_*() and sg_rpc_blob_*()
 *
 * Windows: nghttp2 would return DATA bytes to the peer's send window as soon
 * as it hands them to us, so a peer could make us buffer up to max_streams
 * partial messages.  Instead a call's bytes are returned to the connection
 * window only when its message is complete (or discarded).  Partial
 * messages on one connection are therefore bounded by the connection
 * window; the stream window (one message plus slack) bounds each stream.
 *
 * Every call completes exactly once from the handler's point of view: it
 * either calls sg_rpc_call_respond*() or receives ops->cancel, never both;
 * the state field (one setter) enforces it.
 */
#include "rpc/h2s.h"

#include <stdio.h>
#include <string.h>

#define STREAM_WINDOW_SLACK 4096          /* room above one message */
#define CONN_WINDOW_MIN ((size_t)1 << 20) /* connection window floor */
#define H2_WINDOW_MAX ((size_t)0x7fffffff)
#define GRPC_MESSAGE_MAX 1024 /* encoded grpc-message bytes we send */
#define RST_BURST 1000        /* incoming RST_STREAM token bucket */
#define RST_RATE 100          /* tokens per second */

#define NV(n, v, vl)                                                           \
  { (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl), NGHTTP2_NV_FLAG_NONE }

/* ---- sniffing ------------------------------------------------------------ */

sg__sniff_t sg__rpc_sniff(const uint8_t *p, size_t n) {
  size_t m = n < SG__H2_PREFACE_LEN ? n : SG__H2_PREFACE_LEN;
  if (memcmp(p, SG__H2_PREFACE, m) == 0)
    return n >= SG__H2_PREFACE_LEN ? SG__SNIFF_H2 : SG__SNIFF_MORE;
  for (size_t i = 0; i < n && i <= SG__HTTP1_METHOD_MAX; i++) {
    if (p[i] == ' ')
      return i > 0 ? SG__SNIFF_HTTP1 : SG__SNIFF_OTHER;
    if (p[i] < 'A' || p[i] > 'Z')
      return SG__SNIFF_OTHER;
  }
  return n > SG__HTTP1_METHOD_MAX ? SG__SNIFF_OTHER : SG__SNIFF_MORE;
}

/* ---- allocation hooks: nghttp2 allocates through sg_malloc -------------- */

static void *mem_malloc(size_t n, void *ud) {
  (void)ud;
  return sg_malloc(n);
}
static void mem_free(void *p, void *ud) {
  (void)ud;
  sg_free(p);
}
static void *mem_calloc(size_t n, size_t size, void *ud) {
  (void)ud;
  return sg_calloc(n, size);
}
static void *mem_realloc(void *p, size_t n, void *ud) {
  (void)ud;
  return sg_realloc(p, n);
}

/* ---- calls ------------------------------------------------------------- */

static void call_set_state(sg_rpc_call_t *c, sg__call_state_t s) {
  c->state = s;
}

static void call_free(sg_rpc_call_t *c) {
  sg_free(c->path);
  sg_buf_free(&c->meta);
  sg_buf_free(&c->body);
  sg_rpc_blob_unref(c->resp);
  sg_free(c);
}

static void call_unlink(sg__h2s_t *h, sg_rpc_call_t *c) {
  if (c->prev)
    c->prev->next = c->next;
  else
    h->calls = c->next;
  if (c->next)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
  h->ncalls--;
}

/* call_release_window: return the call's DATA bytes to the peer. */
static void call_release_window(sg__h2s_t *h, sg_rpc_call_t *c) {
  if (c->unconsumed) {
    nghttp2_session_consume_connection(h->session, c->unconsumed);
    c->unconsumed = 0;
  }
}

/* call_done: the call leaves the handler and the deadline heap. */
static void call_done(sg__h2s_t *h, sg_rpc_call_t *c) {
  h->ops->deadline_clear(h->owner, c);
  call_release_window(h, c);
  call_set_state(c, SG__CALL_RESPONDED);
}

/* call_reset: give up on the stream (RST_STREAM INTERNAL_ERROR). */
static void call_reset(sg__h2s_t *h, sg_rpc_call_t *c) {
  call_done(h, c);
  if (h->closing)
    return;
  if (nghttp2_submit_rst_stream(h->session, NGHTTP2_FLAG_NONE, c->stream_id,
                                NGHTTP2_INTERNAL_ERROR) != 0)
    h->failed = 1;
  h->ops->wake(h->owner);
}

/* resp_read: nghttp2 pulls the prefix and the blob, then we add trailers. */
static ssize_t resp_read(nghttp2_session *s, int32_t stream_id, uint8_t *buf,
                         size_t length, uint32_t *flags,
                         nghttp2_data_source *src, void *ud) {
  (void)ud;
  sg_rpc_call_t *c = src->ptr;
  size_t total = SG_GRPC_PREFIX_LEN + c->resp->len, n = 0;
  while (n < length && c->resp_off < total) {
    size_t k;
    if (c->resp_off < SG_GRPC_PREFIX_LEN) {
      k = SG_GRPC_PREFIX_LEN - c->resp_off;
      k = k < length - n ? k : length - n;
      memcpy(buf + n, c->resp_prefix + c->resp_off, k);
    } else {
      k = total - c->resp_off;
      k = k < length - n ? k : length - n;
      memcpy(buf + n, c->resp->data + (c->resp_off - SG_GRPC_PREFIX_LEN), k);
    }
    n += k;
    c->resp_off += k;
  }
  if (c->resp_off == total) {
    nghttp2_nv tr[] = {NV("grpc-status", "0", 1)};
    *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    if (nghttp2_submit_trailer(s, stream_id, tr, 1) != 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  return (ssize_t)n;
}

/*
 * call_reply: submit the response of `c`: `blob` (OK) or trailers-only with
 * `grpc_status` and `msg` under HTTP status `http` ("200" normally).  The
 * call leaves the handler whatever happens.  Returns 0, SG_ECLOSED when the
 * connection is closing, SG_ENOMEM when the stream had to be reset.
 */
static int call_reply(sg__h2s_t *h, sg_rpc_call_t *c, const char *http,
                      int grpc_status, const char *msg, sg_rpc_blob_t *blob) {
  call_done(h, c);
  if (h->closing)
    return SG_ECLOSED;
  int rv;
  if (blob) {
    /* The deadline still bounds a response the peer does not read. */
    if (h->ops->deadline_set(h->owner, c) != 0)
      h->ops->deadline_clear(h->owner, c);
    nghttp2_nv nva[] = {NV(":status", "200", 3),
                        NV("content-type", "application/grpc", 16)};
    nghttp2_data_provider prd;
    blob->refs++;
    c->resp = blob;
    c->resp_off = 0;
    sg__grpc_prefix_write(c->resp_prefix, (uint32_t)blob->len);
    prd.source.ptr = c;
    prd.read_callback = resp_read;
    rv = nghttp2_submit_response(h->session, c->stream_id, nva, 2, &prd);
  } else {
    char st[16], enc[GRPC_MESSAGE_MAX];
    size_t elen = msg ? sg__grpc_message_encode(msg, enc, sizeof(enc)) : 0;
    snprintf(st, sizeof(st), "%d", grpc_status);
    nghttp2_nv nva[] = {NV(":status", http, strlen(http)),
                        NV("content-type", "application/grpc", 16),
                        NV("grpc-status", st, strlen(st)),
                        NV("grpc-message", enc, elen)};
    rv = nghttp2_submit_response(h->session, c->stream_id, nva, elen ? 4 : 3,
                                 NULL);
    if (grpc_status != SG_GRPC_OK && grpc_status != SG_GRPC_DEADLINE_EXCEEDED)
      sg_log(SG_LOG_DEBUG, "rpc", "conn %llu stream %d: %s: %s",
             (unsigned long long)h->cfg.conn_id, (int)c->stream_id,
             sg__grpc_status_name(grpc_status), msg ? msg : "");
  }
  h->ops->wake(h->owner);
  if (rv == 0)
    return 0;
  sg_log(SG_LOG_WARN, "rpc", "conn %llu stream %d: submit response: %s",
         (unsigned long long)h->cfg.conn_id, (int)c->stream_id,
         nghttp2_strerror(rv));
  if (nghttp2_submit_rst_stream(h->session, NGHTTP2_FLAG_NONE, c->stream_id,
                                NGHTTP2_INTERNAL_ERROR) != 0)
    h->failed = 1;
  return SG_ENOMEM;
}

static sg_rpc_call_t *stream_call(nghttp2_session *s, int32_t stream_id) {
  return nghttp2_session_get_stream_user_data(s, stream_id);
}

static int name_is(const uint8_t *name, size_t len, const char *lit) {
  size_t n = strlen(lit);
  return len == n && memcmp(name, lit, n) == 0;
}

/* ---- nghttp2 callbacks ----------------------------------------------------
 */

static int on_begin_headers(nghttp2_session *s, const nghttp2_frame *f,
                            void *ud) {
  sg__h2s_t *h = ud;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  sg_rpc_call_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets the stream */
  c->h2 = h;
  c->stream_id = f->hd.stream_id;
  c->timeout_ns = -1;
  c->heap_idx = SIZE_MAX;
  sg_buf_init(&c->meta, SG_RPC_MAX_HEADER_LIST);
  sg_buf_init(&c->body, h->cfg.max_message + SG_GRPC_PREFIX_LEN);
  call_set_state(c, SG__CALL_HEADERS);
  if (nghttp2_session_set_stream_user_data(s, c->stream_id, c) != 0) {
    call_free(c);
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  c->next = h->calls;
  if (h->calls)
    h->calls->prev = c;
  h->calls = c;
  h->ncalls++;
  return 0;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *f,
                     const uint8_t *name, size_t namelen, const uint8_t *value,
                     size_t valuelen, uint8_t flags, void *ud) {
  (void)flags;
  (void)ud;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0; /* trailers from the client carry nothing we use */
  sg_rpc_call_t *c = stream_call(s, f->hd.stream_id);
  if (!c || c->state != SG__CALL_HEADERS || c->hdr_too_big)
    return 0;
  c->hdr_bytes += namelen + valuelen + 32;
  if (c->hdr_bytes > SG_RPC_MAX_HEADER_LIST) {
    c->hdr_too_big = 1;
    return 0;
  }
  if (namelen > 0 && name[0] == ':') {
    if (name_is(name, namelen, ":method")) {
      c->post = valuelen == 4 && memcmp(value, "POST", 4) == 0;
    } else if (name_is(name, namelen, ":path")) {
      sg_free(c->path);
      c->path = sg_malloc(valuelen + 1);
      if (!c->path)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
      memcpy(c->path, value, valuelen);
      c->path[valuelen] = '\0';
    }
    return 0;
  }
  if (name_is(name, namelen, "content-type")) {
    c->ct_ok = valuelen >= 16 && memcmp(value, "application/grpc", 16) == 0 &&
               (valuelen == 16 || value[16] == '+' || value[16] == ';');
  } else if (name_is(name, namelen, "grpc-timeout")) {
    int64_t ns;
    if (sg__grpc_timeout_parse((const char *)value, valuelen, &ns) == 0)
      c->timeout_ns = ns;
    else
      c->bad_timeout = 1;
  }
  /* Keep it as metadata: "name\0value\0". */
  int rc = sg_buf_reserve(&c->meta, namelen + valuelen + 2);
  if (rc == SG_ETOOBIG) {
    c->hdr_too_big = 1;
    return 0;
  }
  if (rc)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  uint8_t *t = sg_buf_tail(&c->meta);
  memcpy(t, name, namelen);
  t[namelen] = '\0';
  memcpy(t + namelen + 1, value, valuelen);
  t[namelen + 1 + valuelen] = '\0';
  sg_buf_commit(&c->meta, namelen + valuelen + 2);
  return 0;
}

/* headers_done: the request header block is complete: validate it. */
static void headers_done(sg__h2s_t *h, sg_rpc_call_t *c) {
  if (c->hdr_too_big) {
    call_reply(h, c, "200", SG_GRPC_RESOURCE_EXHAUSTED,
               "request header list too large", NULL);
  } else if (!c->post) {
    call_reply(h, c, "405", SG_GRPC_UNIMPLEMENTED, "method must be POST", NULL);
  } else if (!c->ct_ok) {
    call_reply(h, c, "415", SG_GRPC_INTERNAL,
               "content-type must be application/grpc", NULL);
  } else if (!c->path || c->path[0] != '/') {
    call_reply(h, c, "200", SG_GRPC_UNIMPLEMENTED, "malformed :path", NULL);
  } else if (c->bad_timeout) {
    call_reply(h, c, "200", SG_GRPC_INVALID_ARGUMENT, "malformed grpc-timeout",
               NULL);
  } else {
    sg_deadline_t d = sg_deadline_in_ms(h->cfg.default_deadline_ms);
    if (c->timeout_ns >= 0) {
      int64_t now = sg_now_ns();
      sg_deadline_t t =
          c->timeout_ns > INT64_MAX - now ? INT64_MAX : now + c->timeout_ns;
      if (t < d)
        d = t;
    }
    c->deadline = d;
    call_set_state(c, SG__CALL_BODY);
    if (h->ops->deadline_set(h->owner, c) != 0)
      call_reset(h, c);
  }
}

/* end_stream: the peer finished the request: dispatch or reject it. */
static void end_stream(sg__h2s_t *h, sg_rpc_call_t *c) {
  c->remote_closed = 1;
  if (c->state != SG__CALL_BODY)
    return;
  if (!c->have_prefix) {
    call_reply(h, c, "200", SG_GRPC_INTERNAL,
               c->body.len ? "truncated message prefix"
                           : "missing request message",
               NULL);
  } else if (c->body.len < SG_GRPC_PREFIX_LEN + (size_t)c->msg_len) {
    call_reply(h, c, "200", SG_GRPC_INTERNAL, "truncated request message",
               NULL);
  } else if (h->closing) {
    call_done(h, c);
  } else {
    call_release_window(h, c);
    call_set_state(c, SG__CALL_DISPATCHED);
    h->ops->dispatch(h->owner, c);
  }
}

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  sg__h2s_t *h = ud;
  sg_rpc_call_t *c;
  switch (f->hd.type) {
  case NGHTTP2_HEADERS:
    c = stream_call(s, f->hd.stream_id);
    if (!c)
      return 0;
    if (f->headers.cat == NGHTTP2_HCAT_REQUEST && c->state == SG__CALL_HEADERS)
      headers_done(h, c);
    if (f->hd.flags & NGHTTP2_FLAG_END_STREAM)
      end_stream(h, c);
    return 0;
  case NGHTTP2_DATA:
    c = stream_call(s, f->hd.stream_id);
    if (c && (f->hd.flags & NGHTTP2_FLAG_END_STREAM))
      end_stream(h, c);
    return 0;
  default:
    return 0;
  }
}

/* on_data_chunk: bytes of the one request message: prefix, then message. */
static int on_data_chunk(nghttp2_session *s, uint8_t flags, int32_t stream_id,
                         const uint8_t *data, size_t len, void *ud) {
  (void)flags;
  sg__h2s_t *h = ud;
  sg_rpc_call_t *c = stream_call(s, stream_id);
  if (!c || c->state != SG__CALL_BODY) {
    nghttp2_session_consume_connection(s, len); /* discarded */
    return 0;
  }
  c->unconsumed += len;
  while (len) {
    if (!c->have_prefix) {
      size_t take = SG_GRPC_PREFIX_LEN - c->body.len;
      take = take < len ? take : len;
      if (sg_buf_append(&c->body, data, take) != 0) {
        call_reset(h, c);
        return 0;
      }
      data += take;
      len -= take;
      if (c->body.len < SG_GRPC_PREFIX_LEN)
        return 0;
      uint32_t ml;
      int compressed;
      int rc = sg__grpc_prefix_parse(sg_buf_head(&c->body), c->body.len,
                                     UINT32_MAX, &ml, &compressed);
      if (rc) {
        call_reply(h, c, "200", SG_GRPC_INTERNAL,
                   "invalid message compression flag", NULL);
        return 0;
      }
      if (compressed) {
        call_reply(h, c, "200", SG_GRPC_UNIMPLEMENTED,
                   "message compression is not supported", NULL);
        return 0;
      }
      if (ml > h->cfg.max_message) {
        char m[128];
        snprintf(m, sizeof(m),
                 "request message larger than max (%lu vs. %lu bytes)",
                 (unsigned long)ml, (unsigned long)h->cfg.max_message);
        call_reply(h, c, "200", SG_GRPC_RESOURCE_EXHAUSTED, m, NULL);
        return 0;
      }
      c->have_prefix = 1;
      c->msg_len = ml;
      continue;
    }
    size_t want = SG_GRPC_PREFIX_LEN + (size_t)c->msg_len - c->body.len;
    if (len > want) {
      call_reply(h, c, "200", SG_GRPC_INTERNAL,
                 "more than one request message in a unary call", NULL);
      return 0;
    }
    if (sg_buf_append(&c->body, data, len) != 0)
      call_reset(h, c);
    return 0;
  }
  return 0;
}

static int on_frame_send(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  (void)ud;
  if (f->hd.type != NGHTTP2_HEADERS || !(f->hd.flags & NGHTTP2_FLAG_END_STREAM))
    return 0;
  sg_rpc_call_t *c = stream_call(s, f->hd.stream_id);
  if (!c)
    return 0;
  c->local_closed = 1;
  /* We answered before the request ended: tell the peer to stop sending. */
  if (!c->remote_closed)
    nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, f->hd.stream_id,
                              NGHTTP2_NO_ERROR);
  return 0;
}

static int on_stream_close(nghttp2_session *s, int32_t stream_id,
                           uint32_t error_code, void *ud) {
  sg__h2s_t *h = ud;
  sg_rpc_call_t *c = stream_call(s, stream_id);
  if (!c)
    return 0;
  if (c->state == SG__CALL_DISPATCHED) {
    sg_log(SG_LOG_DEBUG, "rpc", "conn %llu stream %d: closed by peer (%s)",
           (unsigned long long)h->cfg.conn_id, (int)stream_id,
           nghttp2_http2_strerror(error_code));
    call_set_state(c, SG__CALL_CANCELLING);
    h->ops->deadline_clear(h->owner, c);
    h->ops->cancel(h->owner, c);
  }
  call_done(h, c);
  nghttp2_session_set_stream_user_data(s, stream_id, NULL);
  call_unlink(h, c);
  call_free(c);
  return 0;
}

static int on_invalid_frame(nghttp2_session *s, const nghttp2_frame *f,
                            int lib_error_code, void *ud) {
  (void)s;
  sg__h2s_t *h = ud;
  sg_log(SG_LOG_DEBUG, "rpc", "conn %llu: invalid frame type %d stream %d: %s",
         (unsigned long long)h->cfg.conn_id, (int)f->hd.type,
         (int)f->hd.stream_id, nghttp2_strerror(lib_error_code));
  return 0;
}

static int on_error(nghttp2_session *s, int lib_error_code, const char *msg,
                    size_t len, void *ud) {
  (void)s;
  (void)lib_error_code;
  sg__h2s_t *h = ud;
  sg_log(SG_LOG_WARN, "rpc", "conn %llu: %.*s",
         (unsigned long long)h->cfg.conn_id, (int)len, msg);
  return 0;
}

/* ---- engine -------------------------------------------------------------- */

int sg__h2s_init(sg__h2s_t *h, const sg__h2s_config_t *cfg,
                 const sg__h2s_ops_t *ops, void *owner) {
  nghttp2_session_callbacks *cbs = NULL;
  nghttp2_option *opt = NULL;
  int rc = SG_ENOMEM;
  memset(h, 0, sizeof(*h));
  h->cfg = *cfg;
  h->ops = ops;
  h->owner = owner;
  h->mem.malloc = mem_malloc;
  h->mem.free = mem_free;
  h->mem.calloc = mem_calloc;
  h->mem.realloc = mem_realloc;
  if (nghttp2_session_callbacks_new(&cbs) != 0 || nghttp2_option_new(&opt) != 0)
    goto out;
  nghttp2_session_callbacks_set_on_begin_headers_callback(cbs,
                                                          on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
  nghttp2_session_callbacks_set_on_frame_send_callback(cbs, on_frame_send);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_session_callbacks_set_on_invalid_frame_recv_callback(
      cbs, on_invalid_frame);
  nghttp2_session_callbacks_set_error_callback2(cbs, on_error);
  nghttp2_option_set_no_auto_window_update(opt, 1);
  nghttp2_option_set_stream_reset_rate_limit(opt, RST_BURST, RST_RATE);
  if (nghttp2_session_server_new3(&h->session, cbs, h, opt, &h->mem) != 0)
    goto out;

  size_t sw = cfg->max_message + SG_GRPC_PREFIX_LEN + STREAM_WINDOW_SLACK;
  if (sw > H2_WINDOW_MAX)
    sw = H2_WINDOW_MAX;
  size_t cw = sw > CONN_WINDOW_MIN / 4 ? sw * 4 : CONN_WINDOW_MIN;
  if (cw > H2_WINDOW_MAX)
    cw = H2_WINDOW_MAX;
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, cfg->max_streams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, (uint32_t)sw},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, SG_RPC_MAX_HEADER_LIST},
  };
  if (nghttp2_submit_settings(h->session, NGHTTP2_FLAG_NONE, iv,
                              sizeof(iv) / sizeof(iv[0])) != 0 ||
      nghttp2_session_set_local_window_size(h->session, NGHTTP2_FLAG_NONE, 0,
                                            (int32_t)cw) != 0) {
    nghttp2_session_del(h->session);
    h->session = NULL;
    goto out;
  }
  rc = 0;
out:
  nghttp2_session_callbacks_del(cbs);
  nghttp2_option_del(opt);
  return rc;
}

int sg__h2s_recv(sg__h2s_t *h, const uint8_t *p, size_t n) {
  ssize_t rv = nghttp2_session_mem_recv(h->session, p, n);
  if (rv < 0) {
    sg_log(SG_LOG_WARN, "rpc", "conn %llu: protocol error: %s",
           (unsigned long long)h->cfg.conn_id, nghttp2_strerror((int)rv));
    return rv == NGHTTP2_ERR_NOMEM ? SG_ENOMEM : SG_EPROTO;
  }
  return h->failed ? SG_ENOMEM : 0;
}

ssize_t sg__h2s_send(sg__h2s_t *h, const uint8_t **out) {
  if (h->failed)
    return SG_ENOMEM;
  ssize_t n = nghttp2_session_mem_send(h->session, out);
  if (n < 0)
    return n == NGHTTP2_ERR_NOMEM ? SG_ENOMEM : SG_EPROTO;
  return h->failed ? SG_ENOMEM : n;
}

int sg__h2s_want_io(const sg__h2s_t *h) {
  return nghttp2_session_want_read(h->session) ||
         nghttp2_session_want_write(h->session);
}

int sg__h2s_idle(const sg__h2s_t *h) { return h->ncalls == 0; }

void sg__h2s_terminate(sg__h2s_t *h, uint32_t error_code) {
  if (nghttp2_session_terminate_session(h->session, error_code) != 0)
    h->failed = 1;
}

void sg__h2s_expire(sg__h2s_t *h, sg_rpc_call_t *c) {
  if (c->state == SG__CALL_RESPONDED) {
    /* Our response is still unsent at the deadline: give up on it. */
    h->ops->deadline_clear(h->owner, c);
    if (!h->closing && !c->local_closed) {
      if (nghttp2_submit_rst_stream(h->session, NGHTTP2_FLAG_NONE, c->stream_id,
                                    NGHTTP2_CANCEL) != 0)
        h->failed = 1;
      h->ops->wake(h->owner);
    }
    return;
  }
  if (c->state == SG__CALL_DISPATCHED) {
    call_set_state(c, SG__CALL_CANCELLING);
    h->ops->deadline_clear(h->owner, c);
    h->ops->cancel(h->owner, c);
  } else if (c->state != SG__CALL_BODY) {
    return;
  }
  call_reply(h, c, "200", SG_GRPC_DEADLINE_EXCEEDED, "Deadline Exceeded", NULL);
}

void sg__h2s_shutdown(sg__h2s_t *h) {
  if (h->closing)
    return;
  h->closing = 1;
  /* Cancels cannot change the list: nothing runs the session meanwhile. */
  for (sg_rpc_call_t *c = h->calls; c; c = c->next) {
    if (c->state == SG__CALL_DISPATCHED) {
      call_set_state(c, SG__CALL_CANCELLING);
      h->ops->deadline_clear(h->owner, c);
      h->ops->cancel(h->owner, c);
    }
    h->ops->deadline_clear(h->owner, c);
    call_set_state(c, SG__CALL_RESPONDED);
  }
}

void sg__h2s_free(sg__h2s_t *h) {
  sg_rpc_call_t *c = h->calls, *next;
  for (; c; c = next) {
    next = c->next;
    h->ops->deadline_clear(h->owner, c);
    call_free(c);
  }
  h->calls = NULL;
  h->ncalls = 0;
  nghttp2_session_del(h->session);
  h->session = NULL;
}

/* ---- public call API ----------------------------------------------------- */

const char *sg_rpc_call_method(const sg_rpc_call_t *c) { return c->path; }

const uint8_t *sg_rpc_call_body(const sg_rpc_call_t *c, size_t *len) {
  *len = c->msg_len;
  return sg_buf_head(&c->body) + SG_GRPC_PREFIX_LEN;
}

sg_deadline_t sg_rpc_call_deadline(const sg_rpc_call_t *c) {
  return c->deadline;
}

const char *sg_rpc_call_metadata(const sg_rpc_call_t *c, const char *key) {
  if (!c->meta.len)
    return NULL;
  const char *p = (const char *)sg_buf_head(&c->meta);
  const char *end = p + c->meta.len;
  while (p < end) {
    const char *v = p + strlen(p) + 1;
    if (strcmp(p, key) == 0)
      return v;
    p = v + strlen(v) + 1;
  }
  return NULL;
}

uint64_t sg_rpc_call_conn_id(const sg_rpc_call_t *c) {
  return c->h2->cfg.conn_id;
}

void sg_rpc_call_set_user(sg_rpc_call_t *c, void *p) { c->user = p; }

void *sg_rpc_call_user(const sg_rpc_call_t *c) { return c->user; }

int sg_rpc_call_respond(sg_rpc_call_t *c, int grpc_status, const char *message,
                        const uint8_t *body, size_t len) {
  if (!c)
    return SG_EINVAL;
  if (c->state != SG__CALL_DISPATCHED)
    return SG_ESTATE;
  sg__h2s_t *h = c->h2;
  if (grpc_status < 0)
    grpc_status = SG_GRPC_UNKNOWN;
  if (grpc_status != SG_GRPC_OK)
    return call_reply(h, c, "200", grpc_status, message, NULL);
  if (len > UINT32_MAX) {
    call_reset(h, c);
    return SG_ETOOBIG;
  }
  sg_rpc_blob_t *b = sg_rpc_blob_new(body, len);
  if (!b) {
    call_reset(h, c);
    return SG_ENOMEM;
  }
  int rc = call_reply(h, c, "200", SG_GRPC_OK, NULL, b);
  sg_rpc_blob_unref(b);
  return rc;
}

int sg_rpc_call_respond_blob(sg_rpc_call_t *c, sg_rpc_blob_t *b) {
  if (!c)
    return SG_EINVAL;
  if (c->state != SG__CALL_DISPATCHED)
    return SG_ESTATE;
  if (!b) {
    call_reset(c->h2, c);
    return SG_EINVAL;
  }
  return call_reply(c->h2, c, "200", SG_GRPC_OK, NULL, b);
}

sg_rpc_blob_t *sg_rpc_blob_alloc(size_t len, uint8_t **data) {
  if (len > UINT32_MAX)
    return NULL;
  sg_rpc_blob_t *b = sg_malloc(sizeof(*b) + len);
  if (!b)
    return NULL;
  b->refs = 1;
  b->len = len;
  if (data)
    *data = b->data;
  return b;
}

sg_rpc_blob_t *sg_rpc_blob_new(const uint8_t *body, size_t len) {
  uint8_t *p;
  sg_rpc_blob_t *b = sg_rpc_blob_alloc(len, &p);
  if (b && len)
    memcpy(p, body, len);
  return b;
}

void sg_rpc_blob_unref(sg_rpc_blob_t *b) {
  if (b && --b->refs == 0)
    sg_free(b);
}
