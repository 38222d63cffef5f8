/*
 * test_rpc_client.c: the blocking gRPC channel (stepguard/rpc_client.h)
 * and its asynchronous call (rpc/client_async.h).
 *
 * Two kinds of server:
 *   - torchft's real Rust lighthouse (tonic), spawned as a process; tests
 *     that need it are skipped when the binary cannot be found (set
 *     SG_TORCHFT_LIGHTHOUSE to its path);
 *   - a "bad peer" in a thread of this process that speaks just enough
 *     HTTP/2 by hand to answer in scripted ways: correct responses, error
 *     statuses, oversized bodies, RST_STREAM, GOAWAY, garbage, closing, or
 *     silence.  It also decodes the request headers (HPACK) so the test can
 *     check what the client sends.
 * Every call has a deadline and every test bounds its elapsed time.
 */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <nghttp2/nghttp2.h>

#include "rpc/client_async.h"
#include "rpc/grpc.h"
#include "stepguard/rpc_client.h"

static int64_t ms_since(int64_t t0) { return (sg_now_ns() - t0) / 1000000; }

/* ---- the bad peer -------------------------------------------------------- */

typedef enum peer_mode_e {
  P_CLOSE,   /* close each connection at once */
  P_GARBAGE, /* answer the preface with bytes that are not HTTP/2 */
  P_SILENT,  /* accept and say nothing */
  P_H2,      /* send SETTINGS, then answer each request with `resp` */
} peer_mode_t;

typedef enum peer_resp_e {
  R_ECHO,    /* 200, the request message echoed, grpc-status 0 */
  R_STATUS,  /* trailers-only grpc-status 5 with a percent-encoded message */
  R_BIG,     /* a 1000-byte message */
  R_RST,     /* RST_STREAM INTERNAL_ERROR */
  R_GARBAGE, /* bytes that are not a frame */
  R_CLOSE,   /* close the connection */
  R_SILENT,  /* never answer */
  R_HTTP404, /* :status 404 without grpc-status */
  R_GOAWAY,  /* GOAWAY(last stream 0): the request was not processed */
  R_HEADER_FLOOD, /* 120 headers of 110 bytes (over the client's limit) */
} peer_resp_t;

#define PEER_CONNS 8
#define PEER_BUF 65536

typedef struct pconn_s {
  int fd;
  int preface_done;
  size_t len;
  uint8_t buf[PEER_BUF];
  nghttp2_hd_inflater *inf;
  uint8_t body[1024]; /* last request message (after the 5-byte prefix) */
  size_t body_len;
} pconn_t;

typedef struct peer_s {
  int lfd, port;
  atomic_int mode; /* a peer_mode_t; read by the peer for each accept */
  pthread_t th;
  atomic_int stop;
  atomic_int accepts;
  atomic_int closes; /* connections the client closed */
  atomic_int rsts;   /* RST_STREAM frames received */
  pthread_mutex_t mu;
  peer_resp_t resp; /* under mu */
  int requests;     /* under mu */
  int nhdr;         /* under mu: headers of the last request */
  char hdr[24][2][160];
  pconn_t conns[PEER_CONNS];
} peer_t;

static peer_t *g_peer; /* torn down by teardown() if a test fails */

static void write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      poll(&pf, 1, 100);
      continue;
    }
    if (w <= 0)
      return;
    b += w;
    n -= (size_t)w;
  }
}

static void put_frame(int fd, uint8_t type, uint8_t flags, uint32_t sid,
                      const uint8_t *payload, size_t len) {
  uint8_t h[9] = {(uint8_t)(len >> 16),
                  (uint8_t)(len >> 8),
                  (uint8_t)len,
                  type,
                  flags,
                  (uint8_t)(sid >> 24 & 0x7f),
                  (uint8_t)(sid >> 16),
                  (uint8_t)(sid >> 8),
                  (uint8_t)sid};
  write_all(fd, h, 9);
  if (len)
    write_all(fd, payload, len);
}

/* HPACK "literal without indexing, new name", no Huffman (lengths < 127). */
static size_t hp_lit(uint8_t *out, const char *name, const char *value) {
  size_t n = 0, nl = strlen(name), vl = strlen(value);
  out[n++] = 0;
  out[n++] = (uint8_t)nl;
  memcpy(out + n, name, nl);
  n += nl;
  out[n++] = (uint8_t)vl;
  memcpy(out + n, value, vl);
  return n + vl;
}

static void respond(peer_t *p, pconn_t *c, uint32_t sid, peer_resp_t r) {
  uint8_t hb[16384], data[1100];
  size_t n = 0;
  switch (r) {
  case R_ECHO:
    n = hp_lit(hb, ":status", "200");
    n += hp_lit(hb + n, "content-type", "application/grpc");
    put_frame(c->fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
    sg__grpc_prefix_write(data, (uint32_t)c->body_len);
    memcpy(data + 5, c->body, c->body_len);
    put_frame(c->fd, NGHTTP2_DATA, 0, sid, data, 5 + c->body_len);
    n = hp_lit(hb, "grpc-status", "0");
    put_frame(c->fd, NGHTTP2_HEADERS,
              NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, sid, hb, n);
    break;
  case R_STATUS:
    n = hp_lit(hb, ":status", "200");
    n += hp_lit(hb + n, "content-type", "application/grpc");
    n += hp_lit(hb + n, "grpc-status", "5");
    n += hp_lit(hb + n, "grpc-message", "no%20such%20thing");
    put_frame(c->fd, NGHTTP2_HEADERS,
              NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, sid, hb, n);
    break;
  case R_BIG:
    n = hp_lit(hb, ":status", "200");
    n += hp_lit(hb + n, "content-type", "application/grpc");
    put_frame(c->fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
    sg__grpc_prefix_write(data, 1000);
    memset(data + 5, 'x', 1000);
    put_frame(c->fd, NGHTTP2_DATA, 0, sid, data, 1005);
    n = hp_lit(hb, "grpc-status", "0");
    put_frame(c->fd, NGHTTP2_HEADERS,
              NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, sid, hb, n);
    break;
  case R_RST: {
    uint8_t code[4] = {0, 0, 0, NGHTTP2_INTERNAL_ERROR};
    put_frame(c->fd, NGHTTP2_RST_STREAM, 0, sid, code, 4);
    break;
  }
  case R_GARBAGE:
    memset(data, 0xff, 64);
    write_all(c->fd, data, 64);
    break;
  case R_CLOSE:
    sg_sock_close(c->fd);
    c->fd = -1;
    nghttp2_hd_inflate_del(c->inf);
    c->inf = NULL;
    break;
  case R_SILENT:
    break;
  case R_HTTP404:
    n = hp_lit(hb, ":status", "404");
    put_frame(c->fd, NGHTTP2_HEADERS,
              NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, sid, hb, n);
    break;
  case R_HEADER_FLOOD: {
    char name[16], value[101];
    memset(value, 'v', 100);
    value[100] = '\0';
    n = hp_lit(hb, ":status", "200");
    for (int i = 0; i < 120; i++) {
      snprintf(name, sizeof(name), "x-flood-%03d", i);
      n += hp_lit(hb + n, name, value);
    }
    put_frame(c->fd, NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, sid, hb, n);
    break;
  }
  case R_GOAWAY: {
    uint8_t ga[8] = {0};
    put_frame(c->fd, NGHTTP2_GOAWAY, 0, 0, ga, 8);
    break;
  }
  }
  (void)p;
}

/* Decodes one HEADERS block (no padding/priority/continuation expected). */
static void inflate_headers(peer_t *p, pconn_t *c, const uint8_t *in,
                            size_t len) {
  pthread_mutex_lock(&p->mu);
  p->nhdr = 0;
  for (;;) {
    nghttp2_nv nv;
    int fl = 0;
    ssize_t r = nghttp2_hd_inflate_hd2(c->inf, &nv, &fl, in, len, 1);
    if (r < 0)
      break;
    in += r;
    len -= (size_t)r;
    if ((fl & NGHTTP2_HD_INFLATE_EMIT) && p->nhdr < 24) {
      snprintf(p->hdr[p->nhdr][0], 160, "%.*s", (int)nv.namelen, nv.name);
      snprintf(p->hdr[p->nhdr][1], 160, "%.*s", (int)nv.valuelen, nv.value);
      p->nhdr++;
    }
    if (fl & NGHTTP2_HD_INFLATE_FINAL) {
      nghttp2_hd_inflate_end_headers(c->inf);
      break;
    }
    if (r == 0 && len == 0)
      break;
  }
  p->requests++;
  pthread_mutex_unlock(&p->mu);
}

static void pconn_close(peer_t *p, pconn_t *c) {
  if (c->fd >= 0) {
    sg_sock_close(c->fd);
    atomic_fetch_add(&p->closes, 1);
  }
  c->fd = -1;
  if (c->inf)
    nghttp2_hd_inflate_del(c->inf);
  c->inf = NULL;
}

/* Parses whatever frames are complete in c->buf and reacts to them. */
static void pconn_process(peer_t *p, pconn_t *c) {
  static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  size_t off = 0;
  if (!c->preface_done) {
    if (c->len < 24)
      return;
    c->preface_done = 1;
    off = 24;
    if (memcmp(c->buf, preface, 24) != 0) {
      pconn_close(p, c);
      return;
    }
  }
  while (c->fd >= 0 && c->len - off >= 9) {
    const uint8_t *h = c->buf + off;
    size_t plen = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
    if (c->len - off < 9 + plen)
      break;
    uint8_t type = h[3], flags = h[4];
    uint32_t sid = ((uint32_t)h[5] << 24 | (uint32_t)h[6] << 16 |
                    (uint32_t)h[7] << 8 | h[8]) &
                   0x7fffffff;
    const uint8_t *pl = h + 9;
    if (type == NGHTTP2_SETTINGS && !(flags & NGHTTP2_FLAG_ACK))
      put_frame(c->fd, NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, NULL, 0);
    else if (type == NGHTTP2_HEADERS)
      inflate_headers(p, c, pl, plen);
    else if (type == NGHTTP2_RST_STREAM)
      atomic_fetch_add(&p->rsts, 1);
    else if (type == NGHTTP2_DATA && plen >= 5) {
      c->body_len = plen - 5 < sizeof(c->body) ? plen - 5 : sizeof(c->body);
      memcpy(c->body, pl + 5, c->body_len);
    }
    if ((type == NGHTTP2_HEADERS || type == NGHTTP2_DATA) &&
        (flags & NGHTTP2_FLAG_END_STREAM)) {
      if (type == NGHTTP2_HEADERS)
        c->body_len = 0;
      pthread_mutex_lock(&p->mu);
      peer_resp_t r = p->resp;
      pthread_mutex_unlock(&p->mu);
      respond(p, c, sid, r);
    }
    off += 9 + plen;
  }
  if (c->fd < 0)
    return;
  memmove(c->buf, c->buf + off, c->len - off);
  c->len -= off;
}

static void *peer_main(void *arg) {
  peer_t *p = arg;
  while (!atomic_load(&p->stop)) {
    struct pollfd pf[PEER_CONNS + 1];
    pf[0].fd = p->lfd;
    pf[0].events = POLLIN;
    for (int i = 0; i < PEER_CONNS; i++) {
      pf[i + 1].fd = p->conns[i].fd;
      pf[i + 1].events = POLLIN;
    }
    if (poll(pf, PEER_CONNS + 1, 20) <= 0)
      continue;
    if (pf[0].revents & POLLIN) {
      int fd;
      if (sg_sock_accept(p->lfd, &fd) == 0) {
        atomic_fetch_add(&p->accepts, 1);
        pconn_t *c = NULL;
        for (int i = 0; i < PEER_CONNS && !c; i++)
          if (p->conns[i].fd < 0)
            c = &p->conns[i];
        if (!c || p->mode == P_CLOSE) {
          sg_sock_close(fd);
        } else {
          memset(c, 0, sizeof(*c));
          c->fd = fd;
          nghttp2_hd_inflate_new(&c->inf);
          if (p->mode == P_GARBAGE) {
            const char *g = "HTTP/1.1 400 Bad Request\r\n\r\nnot http/2 at all";
            write_all(fd, g, strlen(g));
          } else if (p->mode == P_H2) {
            put_frame(fd, NGHTTP2_SETTINGS, 0, 0, NULL, 0);
          }
        }
      }
    }
    for (int i = 0; i < PEER_CONNS; i++) {
      pconn_t *c = &p->conns[i];
      if (c->fd < 0 || !(pf[i + 1].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      ssize_t n = recv(c->fd, c->buf + c->len, PEER_BUF - c->len, 0);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR))
          pconn_close(p, c);
        continue;
      }
      c->len += (size_t)n;
      if (p->mode == P_H2)
        pconn_process(p, c);
      else
        c->len = 0;
      if (c->len == PEER_BUF)
        pconn_close(p, c);
    }
  }
  for (int i = 0; i < PEER_CONNS; i++)
    pconn_close(p, &p->conns[i]);
  return NULL;
}

static peer_t *peer_start(peer_mode_t mode, peer_resp_t resp) {
  peer_t *p = calloc(1, sizeof(*p));
  assert_non_null(p);
  p->mode = mode;
  p->resp = resp;
  for (int i = 0; i < PEER_CONNS; i++)
    p->conns[i].fd = -1;
  pthread_mutex_init(&p->mu, NULL);
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 16, &p->lfd, &p->port, NULL),
                   0);
  assert_int_equal(pthread_create(&p->th, NULL, peer_main, p), 0);
  g_peer = p;
  return p;
}

static void peer_set_mode(peer_t *p, peer_mode_t m) {
  atomic_store(&p->mode, m);
}

static void peer_set_resp(peer_t *p, peer_resp_t r) {
  pthread_mutex_lock(&p->mu);
  p->resp = r;
  pthread_mutex_unlock(&p->mu);
}

static void peer_stop(peer_t *p) {
  if (!p)
    return;
  atomic_store(&p->stop, 1);
  pthread_join(p->th, NULL);
  sg_sock_close(p->lfd);
  pthread_mutex_destroy(&p->mu);
  if (g_peer == p)
    g_peer = NULL;
  free(p);
}

/* The value of request header `name` from the last request, or NULL. */
static const char *peer_hdr(peer_t *p, const char *name, char *out,
                            size_t cap) {
  const char *r = NULL;
  pthread_mutex_lock(&p->mu);
  for (int i = 0; i < p->nhdr; i++)
    if (strcmp(p->hdr[i][0], name) == 0) {
      snprintf(out, cap, "%s", p->hdr[i][1]);
      r = out;
    }
  pthread_mutex_unlock(&p->mu);
  return r;
}

static sg_rpc_channel_t *open_ka(int port, const char *token, size_t max_msg,
                                 int64_t ka_interval, int64_t ka_timeout) {
  char target[64];
  snprintf(target, sizeof(target), "http://127.0.0.1:%d", port);
  sg_rpc_channel_opts_t o = {.target = target,
                             .connect_timeout_ms = 5000,
                             .auth_token = token,
                             .max_message = max_msg,
                             .keepalive_interval_ms = ka_interval,
                             .keepalive_timeout_ms = ka_timeout};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  int rc = sg_rpc_channel_new(&o, &ch, &err);
  if (rc)
    fail_msg("channel to %s: %s (%s)", target, sg_err_name(rc), err.msg);
  return ch;
}

static sg_rpc_channel_t *open_to(int port, const char *token, size_t max_msg) {
  return open_ka(port, token, max_msg, 0, 0);
}

/* One call with `ms` deadline; returns rc, fills err/status/resp. */
static int call_ms(sg_rpc_channel_t *ch, const char *path, const void *req,
                   size_t len, int64_t ms, uint8_t **resp, size_t *resp_len,
                   int *gs, sg_err_t *err) {
  uint8_t *r = NULL;
  size_t rl = 0;
  int st;
  int rc = sg_rpc_channel_call(ch, path, req, len, sg_deadline_in_ms(ms), &r,
                               &rl, &st, err);
  if (gs)
    *gs = st;
  if (resp) {
    *resp = r;
    *resp_len = rl;
  } else {
    sg_free(r);
  }
  return rc;
}

/* ---- the real lighthouse ------------------------------------------------- */

typedef struct lh_s {
  pid_t pid;
  int port;
  char log[64];
} lh_t;

static lh_t g_lh1 = {-1, 0, ""}; /* min_replicas 1, shared */
static lh_t g_lh2 = {-1, 0, ""}; /* min_replicas 2, shared */

static const char *lh_bin(void) {
  static char path[4096];
  const char *e = getenv("SG_TORCHFT_LIGHTHOUSE");
  if (e && *e)
    return access(e, X_OK) == 0 ? e : NULL;
  const char *f = __FILE__, *suf = "tests/c/test_rpc_client.c";
  size_t n = strlen(f), m = strlen(suf);
  if (n < m || strcmp(f + n - m, suf) != 0)
    return NULL;
  snprintf(path, sizeof(path), "%.*s.venv/bin/torchft_lighthouse", (int)(n - m),
           f);
  if (access(path, X_OK) == 0)
    return path;
  if (f[0] != '/') { /* relative to the build root: <build>/tests/c/exe */
    char exe[2048];
    ssize_t l = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (l > 0) {
      exe[l] = '\0';
      char *s = strstr(exe, "/tests/c/");
      if (s) {
        *s = '\0';
        snprintf(path, sizeof(path), "%s/%.*s.venv/bin/torchft_lighthouse", exe,
                 (int)(n - m), f);
        if (access(path, X_OK) == 0)
          return path;
      }
    }
  }
  return NULL;
}

static void lh_stop(lh_t *lh) {
  if (lh->pid > 0) {
    kill(lh->pid, SIGKILL);
    waitpid(lh->pid, NULL, 0);
  }
  lh->pid = -1;
  if (lh->log[0])
    unlink(lh->log);
  lh->log[0] = '\0';
}

/* Starts a lighthouse on 127.0.0.1:port (0: any) and reads its port from
 * its "listening on" log line.  Returns 0, or -1 if it cannot start. */
static int lh_start(lh_t *lh, int min_replicas, int port) {
  const char *bin = lh_bin();
  if (!bin)
    return -1;
  for (int attempt = 0; attempt < 20; attempt++) {
    if (lh->log[0])
      unlink(lh->log); /* a previous instance's */
    snprintf(lh->log, sizeof(lh->log), "/tmp/sg_test_rpc_client_XXXXXX");
    int fd = mkstemp(lh->log);
    if (fd < 0)
      return -1;
    char bind[64], minr[16];
    snprintf(bind, sizeof(bind), "127.0.0.1:%d", port);
    snprintf(minr, sizeof(minr), "%d", min_replicas);
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(fd, 1);
      dup2(fd, 2);
      execl(bin, bin, "--min_replicas", minr, "--bind", bind,
            "--quorum_tick_ms", "100", "--join_timeout_ms", "100",
            (char *)NULL);
      _exit(127);
    }
    close(fd);
    if (pid < 0)
      return -1;
    lh->pid = pid;
    int64_t t0 = sg_now_ns();
    while (ms_since(t0) < 60000) {
      char buf[8192];
      int lf = open(lh->log, O_RDONLY | O_CLOEXEC);
      ssize_t n = lf >= 0 ? read(lf, buf, sizeof(buf) - 1) : -1;
      if (lf >= 0)
        close(lf);
      if (n > 0) {
        buf[n] = '\0';
        char *s = strstr(buf, "listening on: ");
        char *eol = s ? strchr(s, '\n') : NULL;
        if (eol) {
          *eol = '\0';
          char *colon = strrchr(s, ':');
          lh->port = atoi(colon + 1);
          return 0;
        }
      }
      if (waitpid(pid, NULL, WNOHANG) == pid) {
        lh->pid = -1;
        break; /* died (port still busy?): retry */
      }
      usleep(20000);
    }
    lh_stop(lh);
    usleep(200000);
  }
  return -1;
}

/* protobuf by hand: field `f` length-delimited. */
static size_t pb_bytes(uint8_t *out, int f, const void *p, size_t n) {
  out[0] = (uint8_t)(f << 3 | 2);
  out[1] = (uint8_t)n; /* n < 128 here */
  memcpy(out + 2, p, n);
  return n + 2;
}
static size_t pb_varint(uint8_t *out, int f, uint64_t v) {
  size_t n = 0;
  out[n++] = (uint8_t)(f << 3);
  do {
    out[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

static size_t heartbeat_req(uint8_t *out, const char *rid) {
  return pb_bytes(out, 1, rid, strlen(rid));
}

static size_t quorum_req(uint8_t *out, const char *rid) {
  uint8_t m[256];
  size_t n = pb_bytes(m, 1, rid, strlen(rid));
  n += pb_bytes(m + n, 2, "http://127.0.0.1:1", 18);
  n += pb_bytes(m + n, 3, "127.0.0.1:2", 11);
  n += pb_varint(m + n, 4, 7);
  n += pb_varint(m + n, 5, 1);
  return pb_bytes(out, 1, m, n);
}

#define HEARTBEAT "/torchft.LighthouseService/Heartbeat"
#define QUORUM "/torchft.LighthouseService/Quorum"

#define NEED_LH(lh)                                                            \
  do {                                                                         \
    if ((lh)->pid < 0) {                                                       \
      const char *ci = getenv("CI");                                           \
      if (ci && strcmp(ci, "true") == 0)                                       \
        fail_msg("torchft_lighthouse (the interop peer) is missing under CI"); \
      print_message("torchft_lighthouse not available; skipped\n");            \
      skip();                                                                  \
    }                                                                          \
  } while (0)

/* ---- fixtures ------------------------------------------------------------ */

static int group_setup(void **state) {
  (void)state;
  signal(SIGPIPE, SIG_IGN);
  if (lh_start(&g_lh1, 1, 0) != 0 || lh_start(&g_lh2, 2, 0) != 0) {
    lh_stop(&g_lh1);
    lh_stop(&g_lh2);
  }
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  lh_stop(&g_lh1);
  lh_stop(&g_lh2);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  peer_stop(g_peer);
  return 0;
}

/* ---- tests: arguments and connecting ------------------------------------- */

static void test_bad_targets_are_rejected(void **state) {
  (void)state;
  const char *bad[] = {
      "",      "localhost", "https://h:1",  "h:0",  "h:65536", "h:x1",
      "::1:5", "[::1]5",    "http://h:1/x", "h :1", "[::1]:",  ":80"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    sg_rpc_channel_opts_t o = {.target = bad[i], .connect_timeout_ms = 100};
    sg_rpc_channel_t *ch = (sg_rpc_channel_t *)1;
    sg_err_t err;
    int rc = sg_rpc_channel_new(&o, &ch, &err);
    if (rc != SG_EINVAL)
      fail_msg("target '%s': %s", bad[i], sg_err_name(rc));
    assert_null(ch);
    assert_true(err.msg[0] != '\0');
  }
  sg_rpc_channel_opts_t o = {.target = "127.0.0.1:1", .auth_token = "a\r\nb"};
  sg_rpc_channel_t *ch = NULL;
  assert_int_equal(sg_rpc_channel_new(&o, &ch, NULL), SG_EINVAL);
  assert_int_equal(sg_rpc_channel_new(NULL, &ch, NULL), SG_EINVAL);
}

static void test_connect_refused_fails_within_timeout(void **state) {
  (void)state;
  int lfd, port;
  /* A port that nobody listens on: bind it, then close it. */
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 1, &lfd, &port, NULL), 0);
  sg_sock_close(lfd);
  char target[64];
  snprintf(target, sizeof(target), "127.0.0.1:%d", port);
  sg_rpc_channel_opts_t o = {.target = target, .connect_timeout_ms = 500};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = sg_rpc_channel_new(&o, &ch, &err);
  int64_t el = ms_since(t0);
  assert_int_equal(rc, SG_ECONNREFUSED);
  assert_null(ch);
  assert_non_null(strstr(err.msg, target));
  assert_true(el >= 400 && el < 10000); /* retried until the timeout */
}

static void test_peer_that_closes_fails_connect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_CLOSE, R_ECHO);
  char target[64];
  snprintf(target, sizeof(target), "127.0.0.1:%d", p->port);
  sg_rpc_channel_opts_t o = {.target = target, .connect_timeout_ms = 600};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = sg_rpc_channel_new(&o, &ch, &err);
  assert_true(rc == SG_ECONNRESET || rc == SG_EPIPE);
  assert_true(ms_since(t0) < 3000);
  assert_true(atomic_load(&p->accepts) >= 2); /* it retried */
  peer_stop(p);
}

static void test_peer_that_sends_garbage_fails_connect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_GARBAGE, R_ECHO);
  char target[64];
  snprintf(target, sizeof(target), "127.0.0.1:%d", p->port);
  sg_rpc_channel_opts_t o = {.target = target, .connect_timeout_ms = 500};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = sg_rpc_channel_new(&o, &ch, &err);
  assert_int_equal(rc, SG_EPROTO);
  assert_true(ms_since(t0) < 3000);
  peer_stop(p);
}

static void test_peer_that_never_answers_fails_connect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_SILENT, R_ECHO);
  char target[64];
  snprintf(target, sizeof(target), "127.0.0.1:%d", p->port);
  sg_rpc_channel_opts_t o = {.target = target, .connect_timeout_ms = 400};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = sg_rpc_channel_new(&o, &ch, &err);
  int64_t el = ms_since(t0);
  assert_int_equal(rc, SG_ETIMEDOUT);
  assert_true(el >= 350 && el < 10000);
  peer_stop(p);
}

/* ---- tests: the scripted HTTP/2 peer ------------------------------------- */

static void test_request_headers_and_echo(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, "tok123", 0);
  assert_true(sg_rpc_channel_connected(ch));
  uint8_t *resp = NULL;
  size_t rl = 0;
  int gs = -2;
  sg_err_t err;
  int rc =
      call_ms(ch, "/pkg.Svc/Echo", "hello", 5, 5000, &resp, &rl, &gs, &err);
  assert_int_equal(rc, 0);
  assert_int_equal(gs, 0);
  assert_int_equal(rl, 5);
  assert_memory_equal(resp, "hello", 5);
  sg_free(resp);

  char v[160], want[64];
  assert_string_equal(peer_hdr(p, ":method", v, sizeof(v)), "POST");
  assert_string_equal(peer_hdr(p, ":scheme", v, sizeof(v)), "http");
  assert_string_equal(peer_hdr(p, ":path", v, sizeof(v)), "/pkg.Svc/Echo");
  snprintf(want, sizeof(want), "127.0.0.1:%d", p->port);
  assert_string_equal(peer_hdr(p, ":authority", v, sizeof(v)), want);
  assert_string_equal(peer_hdr(p, "content-type", v, sizeof(v)),
                      "application/grpc");
  assert_string_equal(peer_hdr(p, "te", v, sizeof(v)), "trailers");
  assert_string_equal(peer_hdr(p, "authorization", v, sizeof(v)),
                      "Bearer tok123");
  assert_non_null(peer_hdr(p, "user-agent", v, sizeof(v)));
  assert_non_null(strstr(v, "stepguard"));
  assert_non_null(peer_hdr(p, "grpc-timeout", v, sizeof(v)));
  int64_t ns = 0;
  assert_int_equal(sg__grpc_timeout_parse(v, strlen(v), &ns), 0);
  /* the call's 5 s, less what sending took (loose for sanitizers) */
  assert_true(ns > 2500000000LL && ns <= 5000000000LL);

  /* An empty request and an empty response. */
  rc = call_ms(ch, "/pkg.Svc/Echo", NULL, 0, 5000, &resp, &rl, &gs, &err);
  assert_int_equal(rc, 0);
  assert_null(resp);
  assert_int_equal(rl, 0);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_error_status_and_message(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_STATUS);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  uint8_t *resp = (uint8_t *)1;
  size_t rl = 1;
  int gs;
  sg_err_t err;
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, &resp, &rl, &gs, &err);
  assert_int_equal(rc, SG_ENOTFOUND);
  assert_int_equal(gs, SG_GRPC_NOT_FOUND);
  assert_null(resp);
  assert_string_equal(err.msg, "status: NOT_FOUND, message: \"no such thing\"");
  char v[160];
  assert_null(peer_hdr(p, "authorization", v, sizeof(v)));

  peer_set_resp(p, R_HTTP404);
  rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_EPEER);
  assert_int_equal(gs, SG_GRPC_UNIMPLEMENTED);
  assert_non_null(strstr(err.msg, "UNIMPLEMENTED"));
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_response_over_max_message(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_BIG);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 100);
  int gs;
  sg_err_t err;
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ETOOBIG);
  assert_int_equal(gs, -1);
  /* The stream was reset, the connection is still good. */
  peer_set_resp(p, R_ECHO);
  rc = call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, 0);
  assert_int_equal(atomic_load(&p->accepts), 1);
  assert_true(atomic_load(&p->rsts) >= 1);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_response_header_flood_is_bounded(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_HEADER_FLOOD);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  sg_err_t err;
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, NULL, &err);
  assert_int_equal(rc, SG_ETOOBIG);
  assert_non_null(strstr(err.msg, "headers"));
  peer_set_resp(p, R_ECHO);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, NULL, &err),
                   0);
  assert_int_equal(atomic_load(&p->accepts), 1);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_stream_reset_by_server(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_RST);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ECONNRESET);
  assert_int_equal(gs, -1);
  assert_true(ms_since(t0) < 2000);
  peer_set_resp(p, R_ECHO);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_garbage_mid_call_then_reconnect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_GARBAGE);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_EPROTO);
  assert_true(ms_since(t0) < 2000);
  peer_set_resp(p, R_ECHO);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&p->accepts), 2);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_close_mid_call_then_reconnect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_CLOSE);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ECONNRESET);
  assert_true(ms_since(t0) < 2000);
  peer_set_resp(p, R_ECHO);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&p->accepts), 2);
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_silent_server_call_deadline_resets_stream(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_SILENT);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 300, NULL, NULL, &gs, &err);
  int64_t el = ms_since(t0);
  assert_int_equal(rc, SG_ETIMEDOUT);
  assert_int_equal(gs, -1);
  assert_true(el >= 290 && el < 10000); /* loose: sanitizers */
  for (int i = 0; i < 100 && atomic_load(&p->rsts) == 0; i++)
    usleep(10000);
  assert_int_equal(atomic_load(&p->rsts), 1); /* CANCEL reached the server */
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_goaway_then_reconnect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_GOAWAY);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int gs;
  sg_err_t err;
  int rc = call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ECONNRESET);
  peer_set_resp(p, R_ECHO);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&p->accepts), 2);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_disconnect_then_reconnect(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_disconnect(ch);
  assert_false(sg_rpc_channel_connected(ch));
  for (int i = 0; i < 100 && atomic_load(&p->closes) == 0; i++)
    usleep(10000);
  assert_int_equal(atomic_load(&p->closes), 1); /* the server saw it close */
  int gs;
  sg_err_t err;
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&p->accepts), 2);
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

/* Several targets (replicated servers): a dead first one is skipped; a
 * dropped connection makes the next attempt go to the next target. */
static void test_targets_rotate_on_failure_and_drop(void **state) {
  (void)state;
  int lfd, dead;
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 1, &lfd, &dead, NULL), 0);
  sg_sock_close(lfd); /* nobody listens there */
  peer_t *a = peer_start(P_H2, R_ECHO), *b = peer_start(P_H2, R_ECHO);
  char target[160];
  snprintf(target, sizeof(target),
           "127.0.0.1:%d,http://127.0.0.1:%d,127.0.0.1:%d", dead, a->port,
           b->port);
  sg_rpc_channel_opts_t o = {.target = target, .connect_timeout_ms = 5000};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  assert_int_equal(sg_rpc_channel_new(&o, &ch, &err), 0);
  int gs;
  assert_int_equal(call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&a->accepts), 1);
  assert_int_equal(atomic_load(&b->accepts), 0);
  sg_rpc_channel_disconnect(ch);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&a->accepts), 1);
  assert_int_equal(atomic_load(&b->accepts), 1);
  sg_rpc_channel_disconnect(ch); /* wraps around: dead, then a */
  assert_int_equal(call_ms(ch, "/a/b", "z", 1, 5000, NULL, NULL, &gs, &err), 0);
  assert_int_equal(atomic_load(&a->accepts), 2);
  sg_rpc_channel_free(ch);
  peer_stop(a);
  peer_stop(b);
  /* a list with an empty or bad member is rejected whole */
  const char *bad[] = {"127.0.0.1:1,", ",127.0.0.1:1", "127.0.0.1:1,,h:2",
                       "127.0.0.1:1,h"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    sg_rpc_channel_opts_t ob = {.target = bad[i], .connect_timeout_ms = 100};
    ch = NULL;
    if (sg_rpc_channel_new(&ob, &ch, &err) != SG_EINVAL)
      fail_msg("target '%s' accepted", bad[i]);
    assert_null(ch);
  }
}

typedef struct abort_arg_s {
  sg_rpc_channel_t *ch;
  int delay_ms;
} abort_arg_t;

static void *abort_later(void *arg) {
  abort_arg_t *a = arg;
  usleep((useconds_t)a->delay_ms * 1000);
  sg_rpc_channel_abort(a->ch);
  return NULL;
}

static void test_abort_wakes_waiter_and_fails_later_calls(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_SILENT);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  abort_arg_t a = {ch, 200};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, abort_later, &a), 0);
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 30000, NULL, NULL, &gs, &err);
  int64_t el = ms_since(t0);
  pthread_join(th, NULL);
  assert_int_equal(rc, SG_EABORTED);
  /* the abort (200 ms), not the 30 s deadline; loose for sanitizers */
  assert_true(el >= 150 && el < 15000);
  t0 = sg_now_ns();
  assert_int_equal(call_ms(ch, "/a/b", "x", 1, 30000, NULL, NULL, &gs, &err),
                   SG_EABORTED);
  assert_true(ms_since(t0) < 100);
  sg_rpc_channel_abort(ch); /* idempotent */
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

typedef struct echo_arg_s {
  sg_rpc_channel_t *ch;
  int n, ok, id;
} echo_arg_t;

static void *echo_loop(void *arg) {
  echo_arg_t *a = arg;
  for (int i = 0; i < a->n; i++) {
    char msg[32];
    int len = snprintf(msg, sizeof(msg), "t%d-%d", a->id, i);
    uint8_t *resp = NULL;
    size_t rl = 0;
    sg_err_t err;
    int rc =
        sg_rpc_channel_call(a->ch, "/a/echo", (const uint8_t *)msg, (size_t)len,
                            sg_deadline_in_ms(10000), &resp, &rl, NULL, &err);
    if (rc == 0 && rl == (size_t)len && memcmp(resp, msg, rl) == 0)
      a->ok++;
    sg_free(resp);
  }
  return NULL;
}

static void test_concurrent_calls_on_one_connection(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  pthread_t th[4];
  echo_arg_t a[4];
  for (int i = 0; i < 4; i++) {
    a[i] = (echo_arg_t){ch, 50, 0, i};
    assert_int_equal(pthread_create(&th[i], NULL, echo_loop, &a[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(a[i].ok, 50);
  }
  assert_int_equal(atomic_load(&p->accepts), 1);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

static void test_forked_child_fails_fast(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  pid_t pid = fork();
  if (pid == 0) {
    sg_err_t err;
    int ok = 1;
    int64_t t0 = sg_now_ns();
    if (call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, NULL, &err) != SG_ESTATE)
      ok = 0;
    if (sg_rpc_channel_connected(ch))
      ok = 0;
    sg_rpc_channel_abort(ch);
    sg_rpc_channel_disconnect(ch);
    sg_rpc_channel_free(ch);
    if (ms_since(t0) > 1000)
      ok = 0;
    _exit(ok ? 0 : 1);
  }
  assert_true(pid > 0);
  int status = -1;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  /* The parent's channel is untouched. */
  sg_err_t err;
  assert_int_equal(call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, NULL, &err),
                   0);
  assert_int_equal(atomic_load(&p->accepts), 1);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

/* ---- asynchronous calls ---------------------------------------------------
 */

/* What an asynchronous call's callback saw (and how often it ran). */
typedef struct done_s {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int runs, rc, gs;
  uint8_t resp[64];
  size_t resp_len;
  char msg[256];
  pthread_t thread; /* the thread it ran on */
  int64_t at_ns;
  sg_rpc_channel_t *chain; /* start one more call from the callback */
  struct done_s *next;     /* ... recorded here */
} done_t;

static void done_init(done_t *d) {
  memset(d, 0, sizeof(*d));
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
  d->rc = 1;
}

static void done_destroy(done_t *d) {
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->cv);
}

static void done_cb(void *ud, int rc, int gs, uint8_t *resp, size_t len,
                    const char *msg) {
  done_t *d = ud;
  if (d->chain) {
    sg_err_t err;
    int src = sg__rpc_channel_call_start(d->chain, "/a/b", (const uint8_t *)"2",
                                         1, sg_deadline_in_ms(5000), done_cb,
                                         d->next, &err);
    if (src)
      d->next->rc = src; /* seen as a failure: no callback will run */
  }
  pthread_mutex_lock(&d->mu);
  d->runs++;
  d->rc = rc;
  d->gs = gs;
  d->resp_len = len;
  if (resp && len <= sizeof(d->resp))
    memcpy(d->resp, resp, len);
  snprintf(d->msg, sizeof(d->msg), "%s", msg ? msg : "(null)");
  d->thread = pthread_self();
  d->at_ns = sg_now_ns();
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
  sg_free(resp);
}

/* done_wait: wait (at most 10 s) until the callback ran; its run count. */
static int done_wait(done_t *d) {
  int64_t until = sg_now_ns() + 10000000000LL;
  pthread_mutex_lock(&d->mu);
  while (!d->runs && sg_now_ns() < until) {
    pthread_mutex_unlock(&d->mu);
    usleep(1000);
    pthread_mutex_lock(&d->mu);
  }
  int runs = d->runs;
  pthread_mutex_unlock(&d->mu);
  return runs;
}

static int start_ms(sg_rpc_channel_t *ch, const char *req, int64_t ms,
                    done_t *d, sg_err_t *err) {
  return sg__rpc_channel_call_start(ch, "/a/b", (const uint8_t *)req,
                                    strlen(req), sg_deadline_in_ms(ms), done_cb,
                                    d, err);
}

static void test_async_call_runs_callback_once_on_io_thread(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  done_t d, d2;
  done_init(&d);
  done_init(&d2);
  d.chain = ch; /* the callback starts a second call */
  d.next = &d2;
  sg_err_t err;
  assert_int_equal(start_ms(ch, "hello", 5000, &d, &err), 0);
  assert_int_equal(done_wait(&d), 1);
  assert_int_equal(done_wait(&d2), 1);
  assert_int_equal(d.rc, 0);
  assert_int_equal(d.gs, 0);
  assert_int_equal(d.resp_len, 5);
  assert_memory_equal(d.resp, "hello", 5);
  assert_false(pthread_equal(d.thread, pthread_self()));
  assert_int_equal(d2.rc, 0);
  assert_int_equal(d2.resp_len, 1);
  assert_memory_equal(d2.resp, "2", 1);
  /* a blocking call still works beside them, and nothing runs twice */
  assert_int_equal(call_ms(ch, "/a/b", "x", 1, 5000, NULL, NULL, NULL, &err),
                   0);
  sg_rpc_channel_free(ch);
  assert_int_equal(d.runs, 1);
  assert_int_equal(d2.runs, 1);
  done_destroy(&d);
  done_destroy(&d2);
  peer_stop(p);
}

static void test_async_call_error_status_and_bad_arguments(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_STATUS);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  done_t d;
  done_init(&d);
  sg_err_t err;
  assert_int_equal(start_ms(ch, "x", 5000, &d, &err), 0);
  assert_int_equal(done_wait(&d), 1);
  assert_int_equal(d.rc, SG_ENOTFOUND);
  assert_int_equal(d.gs, SG_GRPC_NOT_FOUND);
  assert_int_equal(d.resp_len, 0);
  assert_string_equal(d.msg, "status: NOT_FOUND, message: \"no such thing\"");
  /* refused at once: the callback never runs */
  done_t bad;
  done_init(&bad);
  assert_int_equal(sg__rpc_channel_call_start(ch, "no-slash", NULL, 0,
                                              sg_deadline_in_ms(5000), done_cb,
                                              &bad, &err),
                   SG_EINVAL);
  assert_int_equal(sg__rpc_channel_call_start(ch, "/a/b", NULL, 0,
                                              sg_deadline_in_ms(5000), NULL,
                                              &bad, &err),
                   SG_EINVAL);
  sg_rpc_channel_free(ch);
  assert_int_equal(bad.runs, 0);
  assert_int_equal(d.runs, 1);
  done_destroy(&d);
  done_destroy(&bad);
  peer_stop(p);
}

static void test_async_call_deadline_resets_stream(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_SILENT);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  done_t d;
  done_init(&d);
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  assert_int_equal(start_ms(ch, "x", 300, &d, &err), 0);
  assert_int_equal(done_wait(&d), 1);
  int64_t el = (d.at_ns - t0) / 1000000;
  assert_int_equal(d.rc, SG_ETIMEDOUT);
  assert_int_equal(d.gs, -1);
  assert_non_null(strstr(d.msg, "deadline exceeded"));
  assert_true(el >= 290 && el < 10000); /* loose: sanitizers */
  for (int i = 0; i < 100 && atomic_load(&p->rsts) == 0; i++)
    usleep(10000);
  assert_int_equal(atomic_load(&p->rsts), 1); /* CANCEL reached the server */
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_free(ch);
  assert_int_equal(d.runs, 1);
  done_destroy(&d);
  peer_stop(p);
}

static void test_async_call_deadline_before_connecting(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  peer_stop(p); /* the next connect is refused */
  sg_rpc_channel_disconnect(ch);
  done_t d;
  done_init(&d);
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  assert_int_equal(start_ms(ch, "x", 300, &d, &err), 0);
  assert_int_equal(done_wait(&d), 1);
  int64_t el = (d.at_ns - t0) / 1000000;
  assert_true(el >= 290 && el < 10000); /* loose: sanitizers */
  assert_int_not_equal(d.rc, 0);
  assert_int_equal(d.gs, -1);
  assert_non_null(strstr(d.msg, "before connecting"));
  sg_rpc_channel_free(ch);
  assert_int_equal(d.runs, 1);
  done_destroy(&d);
}

/* A fail_fast channel: a call made while the connection is down waits for
 * one connect attempt, not for its (60 s) deadline, and fails with that
 * attempt's error; the channel still reconnects for the next call. */
static void test_fail_fast_call_fails_after_one_attempt(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  char target[64];
  snprintf(target, sizeof(target), "http://127.0.0.1:%d", p->port);
  sg_rpc_channel_opts_t o = {
      .target = target, .connect_timeout_ms = 300, .fail_fast = 1};
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  assert_int_equal(sg_rpc_channel_new(&o, &ch, &err), 0);
  int gs;

  /* The server accepts but never completes the HTTP/2 handshake. */
  peer_set_mode(p, P_SILENT);
  sg_rpc_channel_disconnect(ch);
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, "/a/b", "x", 1, 60000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ETIMEDOUT);
  assert_int_equal(gs, -1);
  assert_non_null(strstr(err.msg, "SETTINGS"));
  assert_true(ms_since(t0) < 10000);
  assert_int_equal(atomic_load(&p->accepts), 2); /* one attempt */

  /* The same for an asynchronous call. */
  done_t d;
  done_init(&d);
  t0 = sg_now_ns();
  assert_int_equal(start_ms(ch, "x", 60000, &d, &err), 0);
  assert_int_equal(done_wait(&d), 1);
  assert_int_equal(d.rc, SG_ETIMEDOUT);
  assert_true((d.at_ns - t0) / 1000000 < 10000);
  assert_int_equal(atomic_load(&p->accepts), 3);
  done_destroy(&d);

  /* A healthy server again: the next call reconnects. */
  peer_set_mode(p, P_H2);
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 10000, NULL, NULL, &gs, &err),
                   0);
  assert_true(sg_rpc_channel_connected(ch));

  /* The server is gone: refused at once, not retried until the deadline. */
  peer_stop(p);
  t0 = sg_now_ns();
  rc = call_ms(ch, "/a/b", "z", 1, 60000, NULL, NULL, &gs, &err);
  assert_true(rc == SG_ECONNREFUSED || rc == SG_ECONNRESET);
  assert_true(ms_since(t0) < 10000);
  if (rc == SG_ECONNRESET) /* sent before the channel saw the close */
    rc = call_ms(ch, "/a/b", "z", 1, 60000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_ECONNREFUSED);
  assert_true(ms_since(t0) < 10000);
  sg_rpc_channel_free(ch);
}

static void test_async_call_abort_and_free_complete_it(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_SILENT);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  done_t d, later, at_free;
  done_init(&d);
  done_init(&later);
  done_init(&at_free);
  sg_err_t err;
  assert_int_equal(start_ms(ch, "x", 30000, &d, &err), 0);
  int64_t t0 = sg_now_ns();
  sg_rpc_channel_abort(ch);
  assert_int_equal(done_wait(&d), 1);
  assert_int_equal(d.rc, SG_EABORTED);
  assert_true(ms_since(t0) < 2000);
  /* refused after the abort, without a callback */
  assert_int_equal(start_ms(ch, "x", 30000, &later, &err), SG_EABORTED);
  sg_rpc_channel_free(ch);
  assert_int_equal(later.runs, 0);
  assert_int_equal(d.runs, 1);

  /* freeing a channel with a call in flight runs its callback first */
  ch = open_to(p->port, NULL, 0);
  assert_int_equal(start_ms(ch, "x", 30000, &at_free, &err), 0);
  sg_rpc_channel_free(ch);
  assert_int_equal(at_free.runs, 1);
  assert_int_equal(at_free.rc, SG_EABORTED);
  done_destroy(&d);
  done_destroy(&later);
  done_destroy(&at_free);
  peer_stop(p);
}

static void test_allocation_failures_never_crash(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_to(p->port, NULL, 0);
  int failures = 0;
  for (long nth = 1; nth <= 40; nth++) {
    sg_err_t err;
    sg_test_fail_alloc(nth, 0);
    int rc = call_ms(ch, "/a/b", "x", 1, 2000, NULL, NULL, NULL, &err);
    sg_test_fail_alloc(0, 0);
    if (rc)
      failures++;
    /* Whatever failed, the channel recovers. */
    assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, NULL, &err),
                     0);
  }
  assert_true(failures > 0);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

/* The peer never answers PINGs: keepalive must drop the connection. */
static void test_keepalive_drops_unresponsive_peer(void **state) {
  (void)state;
  peer_t *p = peer_start(P_H2, R_ECHO);
  sg_rpc_channel_t *ch = open_ka(p->port, NULL, 0, 100, 200);
  int64_t t0 = sg_now_ns();
  while (sg_rpc_channel_connected(ch) && ms_since(t0) < 8000)
    usleep(10000);
  int64_t el = ms_since(t0);
  assert_false(sg_rpc_channel_connected(ch));
  assert_true(el >= 250 && el < 8000);
  for (int i = 0; i < 100 && atomic_load(&p->closes) == 0; i++)
    usleep(10000);
  assert_int_equal(atomic_load(&p->closes), 1);
  sg_err_t err;
  assert_int_equal(call_ms(ch, "/a/b", "y", 1, 5000, NULL, NULL, NULL, &err),
                   0);
  assert_int_equal(atomic_load(&p->accepts), 2);
  sg_rpc_channel_free(ch);
  peer_stop(p);
}

/* ---- tests: torchft's lighthouse ----------------------------------------- */

/* tonic answers PINGs: a fast keepalive keeps the one connection up. */
static void test_lh_keepalive_is_answered(void **state) {
  (void)state;
  NEED_LH(&g_lh1);
  sg_rpc_channel_t *ch = open_ka(g_lh1.port, NULL, 0, 50, 500);
  int64_t t0 = sg_now_ns();
  while (ms_since(t0) < 1000) {
    assert_true(sg_rpc_channel_connected(ch));
    usleep(20000);
  }
  uint8_t req[64];
  size_t n = heartbeat_req(req, "rep-a");
  sg_err_t err;
  assert_int_equal(call_ms(ch, HEARTBEAT, req, n, 5000, NULL, NULL, NULL, &err),
                   0);
  sg_rpc_channel_free(ch);
}

static void test_lh_heartbeat_and_quorum(void **state) {
  (void)state;
  NEED_LH(&g_lh1);
  sg_rpc_channel_t *ch = open_to(g_lh1.port, NULL, 0);
  assert_true(sg_rpc_channel_connected(ch));
  uint8_t req[512], *resp = NULL;
  size_t n = heartbeat_req(req, "rep-a"), rl = 0;
  int gs = -2;
  sg_err_t err;
  int rc = call_ms(ch, HEARTBEAT, req, n, 5000, &resp, &rl, &gs, &err);
  if (rc)
    fail_msg("heartbeat: %s %s", sg_err_name(rc), err.msg);
  assert_int_equal(gs, 0);
  assert_int_equal(rl, 0);
  assert_null(resp);

  n = quorum_req(req, "rep-a");
  rc = call_ms(ch, QUORUM, req, n, 10000, &resp, &rl, &gs, &err);
  if (rc)
    fail_msg("quorum: %s %s", sg_err_name(rc), err.msg);
  assert_int_equal(gs, 0);
  assert_true(rl > 10);
  assert_int_equal(resp[0], 0x0a); /* field 1: quorum */
  assert_non_null(memmem(resp, rl, "rep-a", 5));
  assert_non_null(memmem(resp, rl, "127.0.0.1:2", 11));
  sg_free(resp);
  sg_rpc_channel_free(ch);
}

static void test_lh_unknown_method_is_unimplemented(void **state) {
  (void)state;
  NEED_LH(&g_lh1);
  sg_rpc_channel_t *ch = open_to(g_lh1.port, NULL, 0);
  int gs;
  sg_err_t err;
  int rc = call_ms(ch, "/torchft.LighthouseService/Nope", "", 0, 5000, NULL,
                   NULL, &gs, &err);
  assert_int_equal(rc, SG_EPEER);
  assert_int_equal(gs, SG_GRPC_UNIMPLEMENTED);
  assert_non_null(strstr(err.msg, "status: UNIMPLEMENTED"));
  rc = call_ms(ch, "/no.Such/Service", "", 0, 5000, NULL, NULL, &gs, &err);
  assert_int_equal(rc, SG_EPEER);
  assert_int_equal(gs, SG_GRPC_UNIMPLEMENTED);
  /* A malformed request message: tonic fails to decode it. */
  rc = call_ms(ch, HEARTBEAT, "\xff\xff", 2, 5000, NULL, NULL, &gs, &err);
  assert_int_not_equal(rc, 0);
  assert_true(gs > 0);
  sg_rpc_channel_free(ch);
}

typedef struct hb_arg_s {
  sg_rpc_channel_t *ch;
  int n, ok;
  char rid[16];
} hb_arg_t;

static void *hb_loop(void *arg) {
  hb_arg_t *a = arg;
  uint8_t req[64];
  size_t n = heartbeat_req(req, a->rid);
  for (int i = 0; i < a->n; i++) {
    sg_err_t err;
    if (call_ms(a->ch, HEARTBEAT, req, n, 5000, NULL, NULL, NULL, &err) == 0)
      a->ok++;
  }
  return NULL;
}

static void test_lh_concurrent_calls(void **state) {
  (void)state;
  NEED_LH(&g_lh1);
  sg_rpc_channel_t *ch = open_to(g_lh1.port, NULL, 0);
  pthread_t th[4];
  hb_arg_t a[4];
  for (int i = 0; i < 4; i++) {
    a[i] = (hb_arg_t){ch, 25, 0, ""};
    snprintf(a[i].rid, sizeof(a[i].rid),
             "rep-a"); /* one replica: see split-brain rule */
    assert_int_equal(pthread_create(&th[i], NULL, hb_loop, &a[i]), 0);
  }
  /* A quorum call in the middle of the heartbeats. */
  uint8_t req[512], *resp = NULL;
  size_t n = quorum_req(req, "rep-a"), rl = 0;
  sg_err_t err;
  int rc = call_ms(ch, QUORUM, req, n, 10000, &resp, &rl, NULL, &err);
  assert_int_equal(rc, 0);
  assert_true(rl > 0);
  sg_free(resp);
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(a[i].ok, 25);
  }
  sg_rpc_channel_free(ch);
}

static void test_lh_response_over_max_message(void **state) {
  (void)state;
  NEED_LH(&g_lh1);
  sg_rpc_channel_t *ch = open_to(g_lh1.port, NULL, 8);
  uint8_t req[512];
  size_t n = quorum_req(req, "rep-a");
  sg_err_t err;
  assert_int_equal(call_ms(ch, QUORUM, req, n, 10000, NULL, NULL, NULL, &err),
                   SG_ETOOBIG);
  n = heartbeat_req(req, "rep-a");
  assert_int_equal(call_ms(ch, HEARTBEAT, req, n, 5000, NULL, NULL, NULL, &err),
                   0);
  sg_rpc_channel_free(ch);
}

static void test_lh_quorum_deadline_then_channel_still_works(void **state) {
  (void)state;
  NEED_LH(&g_lh2);
  sg_rpc_channel_t *ch = open_to(g_lh2.port, NULL, 0);
  uint8_t req[512];
  size_t n = quorum_req(req, "solo");
  int gs;
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, QUORUM, req, n, 500, NULL, NULL, &gs, &err);
  int64_t el = ms_since(t0);
  assert_int_equal(rc, SG_ETIMEDOUT);
  assert_true(el >= 400 && el < 10000);
  n = heartbeat_req(req, "solo");
  assert_int_equal(call_ms(ch, HEARTBEAT, req, n, 5000, NULL, NULL, NULL, &err),
                   0);
  sg_rpc_channel_free(ch);
}

static void test_lh_abort_wakes_quorum_waiter(void **state) {
  (void)state;
  NEED_LH(&g_lh2);
  sg_rpc_channel_t *ch = open_to(g_lh2.port, NULL, 0);
  abort_arg_t a = {ch, 300};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, abort_later, &a), 0);
  uint8_t req[512];
  size_t n = quorum_req(req, "solo");
  sg_err_t err;
  int64_t t0 = sg_now_ns();
  int rc = call_ms(ch, QUORUM, req, n, 60000, NULL, NULL, NULL, &err);
  int64_t el = ms_since(t0);
  pthread_join(th, NULL);
  assert_int_equal(rc, SG_EABORTED);
  assert_true(el < 5000);
  sg_rpc_channel_free(ch);
}

typedef struct quorum_arg_s {
  sg_rpc_channel_t *ch;
  int rc;
  int64_t done_ns;
} quorum_arg_t;

static void *quorum_call(void *arg) {
  quorum_arg_t *a = arg;
  uint8_t req[512];
  size_t n = quorum_req(req, "solo");
  sg_err_t err;
  a->rc = call_ms(a->ch, QUORUM, req, n, 60000, NULL, NULL, NULL, &err);
  a->done_ns = sg_now_ns();
  return NULL;
}

/* A Quorum call blocks at the lighthouse; heartbeats on the same connection
 * still flow (no head-of-line blocking), and abort ends the quorum wait. */
static void test_lh_heartbeats_flow_while_quorum_waits(void **state) {
  (void)state;
  NEED_LH(&g_lh2);
  sg_rpc_channel_t *ch = open_to(g_lh2.port, NULL, 0);
  quorum_arg_t a = {ch, 1, 0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, quorum_call, &a), 0);
  uint8_t req[64];
  size_t n = heartbeat_req(req, "solo");
  for (int i = 0; i < 10; i++) {
    sg_err_t err;
    int64_t t0 = sg_now_ns();
    assert_int_equal(
        call_ms(ch, HEARTBEAT, req, n, 2000, NULL, NULL, NULL, &err), 0);
    assert_true(ms_since(t0) < 1000);
    usleep(100000);
  }
  int64_t t_abort = sg_now_ns();
  sg_rpc_channel_abort(ch);
  pthread_join(th, NULL);
  assert_int_equal(a.rc, SG_EABORTED);
  assert_true((a.done_ns - t_abort) / 1000000 < 100);
  sg_rpc_channel_free(ch);
}

static void test_lh_killed_then_restarted(void **state) {
  (void)state;
  NEED_LH(&g_lh2);
  sg_rpc_channel_t *ch = open_to(g_lh2.port, NULL, 0);
  quorum_arg_t a = {ch, 1, 0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, quorum_call, &a), 0);
  usleep(500000); /* the quorum call is waiting at the server */
  int port = g_lh2.port;
  int64_t t_kill = sg_now_ns();
  kill(g_lh2.pid, SIGKILL);
  waitpid(g_lh2.pid, NULL, 0);
  g_lh2.pid = -1;
  pthread_join(th, NULL);
  assert_int_equal(a.rc, SG_ECONNRESET);
  assert_true((a.done_ns - t_kill) / 1000000 < 2000);
  assert_false(sg_rpc_channel_connected(ch));

  /* While it is down a call fails with the connect error at its deadline. */
  uint8_t req[64];
  size_t n = heartbeat_req(req, "solo");
  sg_err_t err;
  int rc = call_ms(ch, HEARTBEAT, req, n, 300, NULL, NULL, NULL, &err);
  assert_int_equal(rc, SG_ECONNREFUSED);

  assert_int_equal(lh_start(&g_lh2, 2, port), 0);
  assert_int_equal(g_lh2.port, port);
  rc = call_ms(ch, HEARTBEAT, req, n, 10000, NULL, NULL, NULL, &err);
  if (rc)
    fail_msg("after restart: %s %s", sg_err_name(rc), err.msg);
  assert_true(sg_rpc_channel_connected(ch));
  sg_rpc_channel_free(ch);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_targets_are_rejected),
      cmocka_unit_test(test_connect_refused_fails_within_timeout),
      cmocka_unit_test(test_targets_rotate_on_failure_and_drop),
      cmocka_unit_test_teardown(test_peer_that_closes_fails_connect, teardown),
      cmocka_unit_test_teardown(test_peer_that_sends_garbage_fails_connect,
                                teardown),
      cmocka_unit_test_teardown(test_peer_that_never_answers_fails_connect,
                                teardown),
      cmocka_unit_test_teardown(test_request_headers_and_echo, teardown),
      cmocka_unit_test_teardown(test_error_status_and_message, teardown),
      cmocka_unit_test_teardown(test_response_over_max_message, teardown),
      cmocka_unit_test_teardown(test_response_header_flood_is_bounded,
                                teardown),
      cmocka_unit_test_teardown(test_stream_reset_by_server, teardown),
      cmocka_unit_test_teardown(test_garbage_mid_call_then_reconnect, teardown),
      cmocka_unit_test_teardown(test_close_mid_call_then_reconnect, teardown),
      cmocka_unit_test_teardown(test_silent_server_call_deadline_resets_stream,
                                teardown),
      cmocka_unit_test_teardown(test_goaway_then_reconnect, teardown),
      cmocka_unit_test_teardown(test_disconnect_then_reconnect, teardown),
      cmocka_unit_test_teardown(test_abort_wakes_waiter_and_fails_later_calls,
                                teardown),
      cmocka_unit_test_teardown(test_concurrent_calls_on_one_connection,
                                teardown),
      cmocka_unit_test_teardown(test_forked_child_fails_fast, teardown),
      cmocka_unit_test_teardown(test_async_call_runs_callback_once_on_io_thread,
                                teardown),
      cmocka_unit_test_teardown(test_async_call_error_status_and_bad_arguments,
                                teardown),
      cmocka_unit_test_teardown(test_async_call_deadline_resets_stream,
                                teardown),
      cmocka_unit_test_teardown(test_async_call_deadline_before_connecting,
                                teardown),
      cmocka_unit_test_teardown(test_fail_fast_call_fails_after_one_attempt,
                                teardown),
      cmocka_unit_test_teardown(test_async_call_abort_and_free_complete_it,
                                teardown),
      cmocka_unit_test_teardown(test_allocation_failures_never_crash, teardown),
      cmocka_unit_test_teardown(test_keepalive_drops_unresponsive_peer,
                                teardown),
      cmocka_unit_test(test_lh_heartbeat_and_quorum),
      cmocka_unit_test(test_lh_keepalive_is_answered),
      cmocka_unit_test(test_lh_unknown_method_is_unimplemented),
      cmocka_unit_test(test_lh_concurrent_calls),
      cmocka_unit_test(test_lh_response_over_max_message),
      cmocka_unit_test(test_lh_quorum_deadline_then_channel_still_works),
      cmocka_unit_test(test_lh_abort_wakes_quorum_waiter),
      cmocka_unit_test(test_lh_heartbeats_flow_while_quorum_waits),
      cmocka_unit_test(test_lh_killed_then_restarted),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
