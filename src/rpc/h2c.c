/*
 * h2c.c: gRPC unary calls over one client-side HTTP/2 session; no I/O.
 *
 *   streams      the engine's list of open streams (oldest first), linked
 *                on submit and unlinked before the owner hears of the end
 *   session      sg__h2c_init() builds an nghttp2 client session whose
 *                allocations go through sg_malloc (failure injection)
 *   requests     sg__h2c_submit(): fixed gRPC headers + the owner's, body
 *                pulled by body_read
 *   callbacks    on_header .. on_frame_not_send record what the server
 *                sent (:status, grpc-status, grpc-message, the body) and
 *                report closed / not-sent streams and PING ACKs
 *   result       sg__h2c_result(), a pure function over a closed stream
 *
 * Bounds: response headers are counted per stream and the stream is reset
 * past SG__H2C_MAX_RESP_HEADERS; the body buffer holds at most one prefix
 * plus max_message bytes, and the prefix is checked as soon as it is
 * complete, so an oversized message is refused before it arrives.
 */
#include "rpc/h2c.h"

#include <stdio.h>
#include <string.h>

#define STREAM_WINDOW (1 << 20) /* our SETTINGS_INITIAL_WINDOW_SIZE */
#define CONN_WINDOW (16 << 20)  /* our connection receive window */
#ifndef SG_VERSION_STRING
#define SG_VERSION_STRING "0.1.0"
#endif
#define USER_AGENT "grpc-c-stepguard/" SG_VERSION_STRING
#define FIXED_HEADERS 7 /* :method .. user-agent, see sg__h2c_submit */

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

/* ---- streams ------------------------------------------------------------- */

void sg__h2c_stream_init(sg__h2c_stream_t *s, size_t max_message) {
  memset(s, 0, sizeof(*s));
  s->path = "";
  s->status_hdr = -1;
  sg_buf_init(&s->rbuf, max_message + SG_GRPC_PREFIX_LEN);
}

void sg__h2c_stream_fini(sg__h2c_stream_t *s) { sg_buf_free(&s->rbuf); }

static void stream_link(sg__h2c_t *h, sg__h2c_stream_t *s) {
  s->next = NULL;
  s->prev = h->tail;
  if (h->tail)
    h->tail->next = s;
  else
    h->streams = s;
  h->tail = s;
  s->linked = 1;
  h->nstreams++;
}

static void stream_unlink(sg__h2c_t *h, sg__h2c_stream_t *s) {
  if (!s->linked)
    return;
  if (s->prev)
    s->prev->next = s->next;
  else
    h->streams = s->next;
  if (s->next)
    s->next->prev = s->prev;
  else
    h->tail = s->prev;
  s->prev = s->next = NULL;
  s->linked = 0;
  h->nstreams--;
}

static sg__h2c_stream_t *find_stream(sg__h2c_t *h, int32_t stream_id) {
  for (sg__h2c_stream_t *s = h->streams; s; s = s->next)
    if (s->stream_id == stream_id)
      return s;
  return NULL;
}

/* ---- nghttp2 callbacks (they record and report; never end the session) --- */

static int parse_small_int(const uint8_t *v, size_t n, int max) {
  if (n == 0 || n > 4)
    return -1;
  int x = 0;
  for (size_t i = 0; i < n; i++) {
    if (v[i] < '0' || v[i] > '9')
      return -1;
    x = x * 10 + (v[i] - '0');
  }
  return x <= max ? x : -1;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *frame,
                     const uint8_t *name, size_t namelen, const uint8_t *value,
                     size_t valuelen, uint8_t flags, void *ud) {
  (void)s;
  (void)flags;
  sg__h2c_t *h = ud;
  if (frame->hd.type != NGHTTP2_HEADERS)
    return 0;
  sg__h2c_stream_t *st = find_stream(h, frame->hd.stream_id);
  if (!st)
    return 0;
  st->hdr_bytes += namelen + valuelen + 32;
  if (st->hdr_bytes > SG__H2C_MAX_RESP_HEADERS) {
    /* nghttp2 resets the stream; sg__h2c_result reports SG_ETOOBIG. */
    st->local_rc = SG_ETOOBIG;
    st->rst_sent = 1;
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  if (namelen == 7 && memcmp(name, ":status", 7) == 0) {
    st->http_status = parse_small_int(value, valuelen, 999);
  } else if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0) {
    int gs = parse_small_int(value, valuelen, 9999);
    st->status_hdr = gs < 0 ? SG_GRPC_UNKNOWN : gs;
  } else if (namelen == 12 && memcmp(name, "grpc-message", 12) == 0) {
    sg__grpc_message_decode((const char *)value, valuelen, st->status_msg,
                            sizeof(st->status_msg));
  }
  return 0;
}

/* on_data: response body bytes; the prefix is checked once complete. */
static int on_data(nghttp2_session *s, uint8_t flags, int32_t stream_id,
                   const uint8_t *data, size_t len, void *ud) {
  (void)flags;
  sg__h2c_t *h = ud;
  sg__h2c_stream_t *st = find_stream(h, stream_id);
  if (!st || st->local_rc || st->rst_sent)
    return 0;
  int rc = sg_buf_append(&st->rbuf, data, len);
  if (rc == 0 && !st->prefix_checked && st->rbuf.len >= SG_GRPC_PREFIX_LEN) {
    uint32_t mlen;
    int compressed;
    rc = sg__grpc_prefix_parse(sg_buf_head(&st->rbuf), st->rbuf.len,
                               h->cfg.max_message, &mlen, &compressed);
    if (rc == 0 && compressed)
      rc = SG_EPROTO;
    st->prefix_checked = 1;
  }
  if (rc) {
    st->local_rc = rc;
    sg_buf_free(&st->rbuf);
    st->rst_sent = 1;
    nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, stream_id, NGHTTP2_CANCEL);
  }
  return 0;
}

static int on_stream_close(nghttp2_session *s, int32_t stream_id,
                           uint32_t error_code, void *ud) {
  (void)s;
  sg__h2c_t *h = ud;
  sg__h2c_stream_t *st = find_stream(h, stream_id);
  if (!st)
    return 0;
  stream_unlink(h, st);
  h->ops->closed(h->owner, st, error_code);
  return 0;
}

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *frame,
                         void *ud) {
  (void)s;
  sg__h2c_t *h = ud;
  if (frame->hd.type == NGHTTP2_SETTINGS &&
      !(frame->hd.flags & NGHTTP2_FLAG_ACK))
    h->got_settings = 1;
  else if (frame->hd.type == NGHTTP2_GOAWAY)
    h->goaway = 1;
  else if (frame->hd.type == NGHTTP2_PING &&
           (frame->hd.flags & NGHTTP2_FLAG_ACK) && h->ping_outstanding) {
    h->ping_outstanding = 0;
    h->ops->ping_acked(h->owner);
  }
  return 0;
}

static int on_frame_send(nghttp2_session *s, const nghttp2_frame *frame,
                         void *ud) {
  (void)s;
  sg__h2c_t *h = ud;
  if (frame->hd.type == NGHTTP2_GOAWAY &&
      frame->goaway.error_code != NGHTTP2_NO_ERROR)
    h->sent_goaway_err = frame->goaway.error_code;
  return 0;
}

/* A request whose HEADERS could not be sent (e.g. after GOAWAY). */
static int on_frame_not_send(nghttp2_session *s, const nghttp2_frame *frame,
                             int lib_error_code, void *ud) {
  (void)s;
  sg__h2c_t *h = ud;
  if (frame->hd.type != NGHTTP2_HEADERS)
    return 0;
  sg__h2c_stream_t *st = find_stream(h, frame->hd.stream_id);
  if (!st)
    return 0;
  stream_unlink(h, st);
  h->ops->not_sent(h->owner, st, nghttp2_strerror(lib_error_code));
  return 0;
}

static ssize_t body_read(nghttp2_session *s, int32_t stream_id, uint8_t *buf,
                         size_t length, uint32_t *data_flags,
                         nghttp2_data_source *source, void *ud) {
  (void)s;
  (void)stream_id;
  (void)ud;
  sg__h2c_stream_t *st = source->ptr;
  size_t n = st->body_len - st->body_off;
  if (n > length)
    n = length;
  memcpy(buf, st->body + st->body_off, n);
  st->body_off += n;
  if (st->body_off == st->body_len)
    *data_flags |= NGHTTP2_DATA_FLAG_EOF;
  return (ssize_t)n;
}

/* ---- engine -------------------------------------------------------------- */

int sg__h2c_init(sg__h2c_t *h, const sg__h2c_config_t *cfg,
                 const sg__h2c_ops_t *ops, void *owner) {
  nghttp2_session_callbacks *cbs = NULL;
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW},
  };
  memset(h, 0, sizeof(*h));
  h->cfg = *cfg;
  h->ops = ops;
  h->owner = owner;
  h->mem.malloc = mem_malloc;
  h->mem.free = mem_free;
  h->mem.calloc = mem_calloc;
  h->mem.realloc = mem_realloc;
  int r = nghttp2_session_callbacks_new(&cbs);
  if (r != 0)
    goto out;
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_frame_send_callback(cbs, on_frame_send);
  nghttp2_session_callbacks_set_on_frame_not_send_callback(cbs,
                                                           on_frame_not_send);
  r = nghttp2_session_client_new3(&h->session, cbs, h, NULL, &h->mem);
  if (r != 0)
    goto out;
  r = nghttp2_submit_settings(h->session, NGHTTP2_FLAG_NONE, iv,
                              sizeof(iv) / sizeof(iv[0]));
  if (r == 0)
    r = nghttp2_session_set_local_window_size(h->session, NGHTTP2_FLAG_NONE, 0,
                                              CONN_WINDOW);
out:
  nghttp2_session_callbacks_del(cbs);
  if (r == 0)
    return 0;
  h->lib_error = r;
  nghttp2_session_del(h->session);
  h->session = NULL;
  return SG_ENOMEM;
}

int sg__h2c_submit(sg__h2c_t *h, sg__h2c_stream_t *s, const char *path,
                   const sg__h2c_header_t *extra, size_t nextra,
                   const uint8_t *body, size_t body_len) {
  nghttp2_nv nva[FIXED_HEADERS + SG__H2C_MAX_EXTRA_HEADERS];
  const char *fixed[FIXED_HEADERS][2] = {
      {":method", "POST"},
      {":scheme", "http"},
      {":path", path},
      {":authority", h->cfg.authority},
      {"content-type", "application/grpc"},
      {"te", "trailers"},
      {"user-agent", USER_AGENT},
  };
  s->path = path;
  if (nextra > SG__H2C_MAX_EXTRA_HEADERS) {
    h->lib_error = NGHTTP2_ERR_INVALID_ARGUMENT;
    return SG_EINVAL;
  }
  size_t n = 0;
  for (size_t i = 0; i < FIXED_HEADERS + nextra; i++, n++) {
    const char *k =
        i < FIXED_HEADERS ? fixed[i][0] : extra[i - FIXED_HEADERS].name;
    const char *v =
        i < FIXED_HEADERS ? fixed[i][1] : extra[i - FIXED_HEADERS].value;
    nva[n].name = (uint8_t *)(uintptr_t)k;
    nva[n].namelen = strlen(k);
    nva[n].value = (uint8_t *)(uintptr_t)v;
    nva[n].valuelen = strlen(v);
    nva[n].flags = NGHTTP2_NV_FLAG_NONE;
  }
  s->body = body;
  s->body_len = body_len;
  s->body_off = 0;
  nghttp2_data_provider prd;
  prd.source.ptr = s;
  prd.read_callback = body_read;
  int32_t id = nghttp2_submit_request(h->session, NULL, nva, n, &prd, NULL);
  if (id < 0) {
    h->lib_error = id;
    return id == NGHTTP2_ERR_NOMEM ? SG_ENOMEM : SG_ECONNRESET;
  }
  s->stream_id = id;
  stream_link(h, s);
  return 0;
}

int sg__h2c_reset(sg__h2c_t *h, sg__h2c_stream_t *s, uint32_t error_code) {
  if (s->rst_sent)
    return 0;
  s->rst_sent = 1;
  int r = nghttp2_submit_rst_stream(h->session, NGHTTP2_FLAG_NONE, s->stream_id,
                                    error_code);
  if (r == 0)
    return 0;
  h->lib_error = r;
  return SG_ENOMEM;
}

int sg__h2c_ping(sg__h2c_t *h) {
  int r = nghttp2_submit_ping(h->session, NGHTTP2_FLAG_NONE, NULL);
  if (r != 0) {
    h->lib_error = r;
    return SG_ENOMEM;
  }
  h->ping_outstanding = 1;
  return 0;
}

int sg__h2c_recv(sg__h2c_t *h, const uint8_t *p, size_t n) {
  ssize_t rv = nghttp2_session_mem_recv(h->session, p, n);
  if (rv >= 0)
    return 0;
  h->lib_error = (int)rv;
  return rv == NGHTTP2_ERR_NOMEM ? SG_ENOMEM : SG_EPROTO;
}

ssize_t sg__h2c_send(sg__h2c_t *h, const uint8_t **out) {
  ssize_t n = nghttp2_session_mem_send(h->session, out);
  if (n >= 0)
    return n;
  h->lib_error = (int)n;
  return n == NGHTTP2_ERR_NOMEM ? SG_ENOMEM : SG_EPROTO;
}

int sg__h2c_want_io(const sg__h2c_t *h) {
  return nghttp2_session_want_read(h->session) ||
         nghttp2_session_want_write(h->session);
}

int sg__h2c_idle(const sg__h2c_t *h) { return h->nstreams == 0; }

sg__h2c_stream_t *sg__h2c_take(sg__h2c_t *h) {
  sg__h2c_stream_t *s = h->streams;
  if (s)
    stream_unlink(h, s);
  return s;
}

const char *sg__h2c_error(const sg__h2c_t *h) {
  return nghttp2_strerror(h->lib_error);
}

void sg__h2c_free(sg__h2c_t *h) {
  while (sg__h2c_take(h))
    ;
  nghttp2_session_del(h->session);
  h->session = NULL;
}

/* ---- the result of a closed stream --------------------------------------- */

static int http_to_grpc(int http) {
  switch (http) {
  case 400:
    return SG_GRPC_INTERNAL;
  case 401:
    return SG_GRPC_UNAUTHENTICATED;
  case 403:
    return SG_GRPC_PERMISSION_DENIED;
  case 404:
    return SG_GRPC_UNIMPLEMENTED;
  case 429:
  case 502:
  case 503:
  case 504:
    return SG_GRPC_UNAVAILABLE;
  default:
    return SG_GRPC_UNKNOWN;
  }
}

/* ok_result: grpc-status 0: the body must be exactly one message. */
static void ok_result(const sg__h2c_stream_t *s, size_t max_message,
                      sg__h2c_result_t *r) {
  uint32_t mlen = 0;
  int compressed = 0;
  const sg_buf_t *b = &s->rbuf;
  int rc = b->len < SG_GRPC_PREFIX_LEN
               ? SG_EAGAIN
               : sg__grpc_prefix_parse(sg_buf_head(b), b->len, max_message,
                                       &mlen, &compressed);
  if (rc == SG_EAGAIN ||
      (rc == 0 && (compressed || b->len != SG_GRPC_PREFIX_LEN + mlen))) {
    r->rc = SG_EPROTO;
    snprintf(r->msg, sizeof(r->msg),
             "%s: status OK but %zu body bytes are not one message", s->path,
             b->len);
  } else if (rc) {
    r->rc = rc;
    snprintf(r->msg, sizeof(r->msg), "%s: bad response message (%s)", s->path,
             sg_strerror(rc));
  } else if (mlen > 0) {
    r->resp = sg_buf_head(b) + SG_GRPC_PREFIX_LEN;
    r->resp_len = mlen;
  }
}

void sg__h2c_result(const sg__h2c_stream_t *s, uint32_t error_code,
                    size_t max_message, sg__h2c_result_t *r) {
  r->rc = 0;
  r->grpc_status = -1;
  r->resp = NULL;
  r->resp_len = 0;
  r->msg[0] = '\0';
  if (s->local_rc == SG_ETOOBIG) {
    r->rc = SG_ETOOBIG;
    if (s->hdr_bytes > SG__H2C_MAX_RESP_HEADERS)
      snprintf(r->msg, sizeof(r->msg),
               "%.100s: response headers exceed %d bytes", s->path,
               SG__H2C_MAX_RESP_HEADERS);
    else
      snprintf(r->msg, sizeof(r->msg),
               "%.100s: response exceeds max_message %zu", s->path,
               max_message);
  } else if (s->local_rc) {
    r->rc = s->local_rc;
    snprintf(r->msg, sizeof(r->msg), "%s: bad response message (%s)", s->path,
             sg_strerror(r->rc));
  } else if (s->status_hdr >= 0) {
    r->grpc_status = s->status_hdr;
    if (s->status_hdr == SG_GRPC_OK) {
      ok_result(s, max_message, r);
    } else {
      r->rc = sg__grpc_status_to_err(s->status_hdr);
      snprintf(r->msg, sizeof(r->msg), "status: %s, message: \"%s\"",
               sg__grpc_status_name(s->status_hdr), s->status_msg);
    }
  } else if (error_code != NGHTTP2_NO_ERROR) {
    r->rc = error_code == NGHTTP2_PROTOCOL_ERROR ? SG_EPROTO : SG_ECONNRESET;
    snprintf(r->msg, sizeof(r->msg), "%s: stream reset (%s)", s->path,
             nghttp2_http2_strerror(error_code));
  } else if (s->http_status != 200) {
    r->grpc_status = http_to_grpc(s->http_status);
    r->rc = sg__grpc_status_to_err(r->grpc_status);
    snprintf(r->msg, sizeof(r->msg), "status: %s, message: \"HTTP status %d\"",
             sg__grpc_status_name(r->grpc_status), s->http_status);
  } else {
    r->rc = SG_EPROTO;
    snprintf(r->msg, sizeof(r->msg), "%s: response without grpc-status",
             s->path);
  }
}
