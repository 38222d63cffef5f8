/*
 * test_ckpt.c: the checkpoint server and fetch in one process: the frame
 * codecs and chunk plan; round trips over one and two sources (bytes per
 * source); step, layout and token refusals; disallow waiting for and then
 * cutting a response in flight; a source that dies mid-stream (another
 * source takes over, alone it is a clean error); abort and deadline against
 * a source that never answers; and a bad peer (garbage, HTTP, truncated and
 * slow requests, a reader that vanishes) that the server survives.
 *
 * Same host (sources in forked child processes): round trips copied from
 * the sources' memory, striped over two; the TCP path when it is turned off;
 * a grant holds disallow until the fetcher lets go, and the beacon changes
 * when disallow cuts it; a source killed between chunks (alone: a clean
 * error; beside another: the other delivers); hostile descriptors.
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
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
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt/ckpt_int.h"
#include "stepguard/base.h"
#include "stepguard/ckpt.h"

/* ---- fixtures ------------------------------------------------------------ */

typedef struct {
  uint8_t *mem;
  sg_ckpt_region_t regs[8];
  size_t n;
  uint64_t total;
} state_t;

/* make_state: regions of assorted sizes (one empty) with seeded bytes. */
static void make_state(state_t *s, unsigned seed, uint64_t scale) {
  static const uint64_t sizes[] = {1000, 0, 3, 4096, 65537, 7, 200000, 12};
  s->n = 8;
  s->total = 0;
  for (size_t i = 0; i < s->n; i++)
    s->total += sizes[i] * scale;
  s->mem = malloc(s->total ? s->total : 1);
  assert_non_null(s->mem);
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < s->total; i++) {
    x = x * 1103515245u + 12345u;
    s->mem[i] = (uint8_t)(x >> 16);
  }
  uint64_t off = 0;
  for (size_t i = 0; i < s->n; i++) {
    s->regs[i].ptr = s->mem + off;
    s->regs[i].len = sizes[i] * scale;
    off += sizes[i] * scale;
  }
}

static void dst_like(const state_t *src, state_t *d) {
  d->n = src->n;
  d->total = src->total;
  d->mem = calloc(1, src->total ? src->total : 1);
  assert_non_null(d->mem);
  uint64_t off = 0;
  for (size_t i = 0; i < d->n; i++) {
    d->regs[i].ptr = d->mem + off;
    d->regs[i].len = src->regs[i].len;
    off += src->regs[i].len;
  }
}

static sg_ckpt_server_t *start_server(const char *token, int64_t req_ms) {
  sg_ckpt_server_opts_t o;
  sg_ckpt_server_opts_init(&o);
  o.bind = "127.0.0.1:0";
  o.auth_token = token;
  o.request_timeout_ms = req_ms;
  o.stall_timeout_ms = 5000;
  sg_ckpt_server_t *s = NULL;
  sg_err_t err;
  sg_err_clear(&err);
  assert_int_equal(sg_ckpt_server_start(&o, &s, &err), 0);
  return s;
}

static void addr_of(sg_ckpt_server_t *s, char *buf) {
  sprintf(buf, "127.0.0.1:%d", sg_ckpt_server_port(s));
}

static const char header[] = "tree spec and leaf metadata";

static void serve(sg_ckpt_server_t *s, int64_t step, const state_t *st) {
  sg_err_t err;
  assert_int_equal(sg_ckpt_server_serve(s, step, header, sizeof(header),
                                        st->regs, st->n, &err),
                   0);
}

/* raw_connect: a blocking socket to port with a 10 s receive timeout. */
static int raw_connect(int port) {
  int fd = -1;
  sg_err_t err;
  assert_int_equal(
      sg_sock_connect("127.0.0.1", port, sg_deadline_in_ms(5000), &fd, &err),
      0);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  struct timeval tv = {.tv_sec = 10};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

/* read_resp: read a response's fixed part; returns the parse result. */
static int read_resp(int fd, sg_ckpt_resp_t *r) {
  uint8_t b[SG_CKPT_RESP_FIXED];
  size_t got = 0;
  while (got < sizeof(b)) {
    ssize_t n = recv(fd, b + got, sizeof(b) - got, 0);
    if (n <= 0)
      return SG_EPEER;
    got += (size_t)n;
  }
  return sg_ckpt_resp_parse(b, sizeof(b), r);
}

/* eof_after: drain until EOF; returns bytes drained, -1 on a timeout. */
static long eof_after(int fd) {
  char b[65536];
  long total = 0;
  for (;;) {
    ssize_t n = recv(fd, b, sizeof(b), 0);
    if (n == 0)
      return total;
    if (n < 0)
      return errno == ECONNRESET ? total : -1;
    total += n;
  }
}

/* ---- pure parts ------------------------------------------------------------
 */

static void test_request_codec(void **unused) {
  sg_ckpt_req_t q = {.kind = SG_CKPT_KIND_DATA,
                     .step = 7,
                     .layout = 99,
                     .offset = 5,
                     .length = 10,
                     .token_len = 3};
  memcpy(q.token, "abc", 3);
  uint8_t b[SG_CKPT_REQ_MAX];
  int n = sg_ckpt_req_encode(&q, b);
  assert_int_equal(n, SG_CKPT_REQ_FIXED + 3);
  sg_ckpt_req_t r;
  for (int i = 4; i < n; i++) /* every prefix asks for more */
    assert_int_equal(sg_ckpt_req_parse(b, (size_t)i, &r), 0);
  assert_int_equal(sg_ckpt_req_parse(b, (size_t)n, &r), n);
  assert_int_equal(r.kind, SG_CKPT_KIND_DATA);
  assert_int_equal(r.step, 7);
  assert_int_equal(r.layout, 99);
  assert_int_equal(r.offset, 5);
  assert_int_equal(r.length, 10);
  assert_memory_equal(r.token, "abc", 3);

  uint8_t bad[sizeof(b)];
  memcpy(bad, b, sizeof(b));
  bad[0] ^= 1; /* magic */
  assert_int_equal(sg_ckpt_req_parse(bad, 4, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  bad[4] = 9; /* version */
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  bad[6] = 3; /* kind */
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  bad[40] = 0xff; /* token length 0x03ff */
  bad[41] = 0x03;
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  bad[15] = 0x80; /* negative step */
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  memset(bad + 24, 0xff, 16); /* offset + length overflow */
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  memcpy(bad, b, sizeof(b));
  bad[44] = 1; /* reserved */
  assert_int_equal(sg_ckpt_req_parse(bad, (size_t)n, &r), SG_EPROTO);
  q.kind = SG_CKPT_KIND_INFO; /* INFO with a range */
  n = sg_ckpt_req_encode(&q, b);
  assert_int_equal(sg_ckpt_req_parse(b, (size_t)n, &r), SG_EPROTO);
  assert_int_equal(sg_ckpt_req_parse((const uint8_t *)"GET / HTTP/1.1", 14, &r),
                   SG_EPROTO);
  q.token_len = SG_CKPT_MAX_TOKEN + 1;
  assert_int_equal(sg_ckpt_req_encode(&q, b), SG_EINVAL);
}

static void test_response_codec(void **unused) {
  sg_ckpt_resp_t r = {.kind = SG_CKPT_KIND_INFO,
                      .nregions = 2,
                      .step = 3,
                      .layout = 1,
                      .payload = 16 + 5,
                      .aux = 5};
  uint8_t b[SG_CKPT_RESP_FIXED];
  sg_ckpt_resp_encode(&r, b);
  sg_ckpt_resp_t p;
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b) - 1, &p), SG_EAGAIN);
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b), &p), 0);
  assert_int_equal(p.nregions, 2);
  assert_int_equal(p.aux, 5);
  r.payload = 16 + 6; /* inconsistent INFO payload */
  sg_ckpt_resp_encode(&r, b);
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b), &p), SG_EPROTO);
  r = (sg_ckpt_resp_t){.kind = SG_CKPT_KIND_DATA,
                       .status = SG_ESTATE,
                       .step = -1,
                       .payload = SG_CKPT_MAX_ERRMSG + 1};
  sg_ckpt_resp_encode(&r, b);
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b), &p), SG_EPROTO);
  r.status = 5; /* positive status */
  r.payload = 0;
  sg_ckpt_resp_encode(&r, b);
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b), &p), SG_EPROTO);
  r = (sg_ckpt_resp_t){.kind = SG_CKPT_KIND_INFO,
                       .nregions = SG_CKPT_MAX_REGIONS + 1,
                       .step = 0};
  r.payload = (uint64_t)r.nregions * 8;
  sg_ckpt_resp_encode(&r, b);
  assert_int_equal(sg_ckpt_resp_parse(b, sizeof(b), &p), SG_EPROTO);
}

static void test_lengths_layout_addr_plan(void **unused) {
  uint8_t b[24];
  uint64_t v[3], total = 0;
  for (int i = 0; i < 3; i++)
    for (int k = 0; k < 8; k++)
      b[8 * i + k] = (uint8_t)(k == 0 ? i + 1 : 0);
  assert_int_equal(sg_ckpt_lengths_parse(b, 3, v, &total), 0);
  assert_int_equal(total, 6);
  memset(b + 8, 0xff, 8); /* sum over the limit */
  assert_int_equal(sg_ckpt_lengths_parse(b, 3, v, &total), SG_EPROTO);
  uint64_t l1[] = {1, 2, 3}, l2[] = {1, 2, 4}, l3[] = {1, 2};
  assert_true(sg_ckpt_layout_id(l1, 3) != sg_ckpt_layout_id(l2, 3));
  assert_true(sg_ckpt_layout_id(l1, 3) != sg_ckpt_layout_id(l3, 2));
  assert_true(sg_ckpt_layout_id(l1, 3) == sg_ckpt_layout_id(l1, 3));

  assert_int_equal(sg_ckpt_plan_chunk(0, 4, 1 << 20), 1 << 20);
  assert_int_equal(sg_ckpt_plan_chunk(1ull << 30, 4, 1 << 20), 64ull << 20);
  assert_int_equal(sg_ckpt_plan_chunk(1ull << 40, 4, 1 << 20), 64ull << 20);
  assert_int_equal(sg_ckpt_plan_chunk(64ull << 20, 4, 1 << 20), 4ull << 20);
  assert_int_equal(sg_ckpt_plan_chunk(10, 0, 0), 2);
}

/* ---- round trips --------------------------------------------------------
 */

/* A fetch striped over two sources hands a source's unstarted share to the
 * other's idle streams: under load one source can take every chunk before
 * the other's first connection is up (same-host copies of 11 MB take a few
 * ms).  Tests that check both contributed pass this progress callback: a
 * stream that finished a chunk waits (up to 30 s) until the other source
 * finished one too. */
typedef struct {
  atomic_int got[2];
} both_t;

static void both_contribute(void *arg, size_t source, uint64_t bytes) {
  both_t *b = arg;
  (void)bytes;
  atomic_store(&b->got[source], 1);
  int64_t until = sg_now_ns() + 30000000000LL;
  while (!atomic_load(&b->got[1 - source]) && sg_now_ns() < until)
    usleep(1000);
}

static void check_fetch(const char *const *addrs, size_t naddr,
                        const char *token, int64_t step, const state_t *src,
                        int streams, uint64_t *bytes) {
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  sg_ckpt_info_t info;
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_ckpt_fetch_info(f, addrs[0], token, step,
                              sg_deadline_in_ms(20000), &info, &err);
  if (rc)
    fail_msg("info: %s", err.msg);
  assert_int_equal(info.step, step);
  assert_int_equal(info.hlen, sizeof(header));
  assert_memory_equal(info.header, header, sizeof(header));
  assert_int_equal(info.nregions, src->n);
  assert_int_equal(info.total, src->total);
  state_t d;
  dst_like(src, &d);
  both_t both = {0};
  sg_ckpt_fetch_opts_t o = {.streams_per_source = streams,
                            .min_chunk = 64 << 10};
  if (naddr == 2) {
    o.progress = both_contribute;
    o.progress_arg = &both;
  }
  rc = sg_ckpt_fetch_data(f, addrs, naddr, token, step, info.layout, d.regs,
                          d.n, &o, sg_deadline_in_ms(60000), bytes, &err);
  if (rc)
    fail_msg("data: %s", err.msg);
  assert_memory_equal(d.mem, src->mem, src->total);
  uint64_t sum = 0;
  for (size_t i = 0; i < naddr; i++)
    sum += bytes[i];
  assert_int_equal(sum, src->total);
  sg_ckpt_info_free(&info);
  free(d.mem);
  sg_ckpt_fetch_free(f);
}

static uint64_t layout_of(const state_t *st);

static void test_round_trip_one_source(void **unused) {
  state_t st;
  make_state(&st, 1, 3);
  sg_ckpt_server_t *s = start_server("secret", 0);
  serve(s, 5, &st);
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  uint64_t bytes[1];
  for (int streams = 1; streams <= 3; streams++)
    check_fetch(addrs, 1, "secret", 5, &st, streams, bytes);
  /* destinations flagged as already mapped (touched memory, in place) are
   * not populated; the bytes are the same */
  state_t d;
  dst_like(&st, &d);
  memset(d.mem, 0x5A, d.total);
  uint8_t mapped[8] = {1, 0, 1, 1, 0, 1, 1, 0};
  sg_ckpt_fetch_opts_t o = {.streams_per_source = 2, .mapped = mapped};
  sg_ckpt_fetch_t *f = NULL;
  sg_err_t err;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  int rc = sg_ckpt_fetch_data(f, addrs, 1, "secret", 5, layout_of(&st), d.regs,
                              d.n, &o, sg_deadline_in_ms(60000), bytes, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_memory_equal(d.mem, st.mem, st.total);
  sg_ckpt_fetch_free(f);
  free(d.mem);
  /* the server counts bytes after each send returns, so the fetch can end
   * first: disallow waits until every response is done */
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(10000)), 0);
  sg_ckpt_server_stats_t ss;
  sg_ckpt_server_stats(s, &ss);
  assert_int_equal(ss.bytes_sent, 4 * st.total);
  assert_int_equal(ss.bad_input, 0);
  sg_ckpt_server_stop(s);
  free(st.mem);
}

static void test_striped_two_sources(void **unused) {
  state_t st;
  make_state(&st, 2, 40); /* about 11 MiB */
  sg_ckpt_server_t *s1 = start_server(NULL, 0), *s2 = start_server(NULL, 0);
  serve(s1, 9, &st);
  serve(s2, 9, &st);
  char a1[64], a2[64];
  addr_of(s1, a1);
  addr_of(s2, a2);
  const char *addrs[] = {a1, a2};
  uint64_t bytes[2];
  check_fetch(addrs, 2, NULL, 9, &st, 2, bytes);
  /* every response done (and counted) before the counts are read */
  assert_int_equal(sg_ckpt_server_disallow(s1, sg_deadline_in_ms(10000)), 0);
  assert_int_equal(sg_ckpt_server_disallow(s2, sg_deadline_in_ms(10000)), 0);
  sg_ckpt_server_stats_t t1, t2;
  sg_ckpt_server_stats(s1, &t1);
  sg_ckpt_server_stats(s2, &t2);
  /* each source served what the fetch counted from it, and both served */
  assert_int_equal(t1.bytes_sent, bytes[0]);
  assert_int_equal(t2.bytes_sent, bytes[1]);
  assert_true(bytes[0] > 0);
  assert_true(bytes[1] > 0);
  sg_ckpt_server_stop(s1);
  sg_ckpt_server_stop(s2);
  free(st.mem);
}

static void test_empty_state(void **unused) {
  sg_ckpt_server_t *s = start_server(NULL, 0);
  sg_err_t err;
  assert_int_equal(
      sg_ckpt_server_serve(s, 0, header, sizeof(header), NULL, 0, &err), 0);
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  sg_ckpt_info_t info;
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, NULL, 0, sg_deadline_in_ms(5000), &info, &err),
      0);
  assert_int_equal(info.nregions, 0);
  uint64_t bytes[1];
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, NULL, 0, info.layout, NULL,
                                      0, NULL, sg_deadline_in_ms(5000), bytes,
                                      &err),
                   0);
  sg_ckpt_info_free(&info);
  sg_ckpt_fetch_free(f);
  sg_ckpt_server_stop(s);
}

/* ---- refusals ---------------------------------------------------------------
 */

static void test_refusals(void **unused) {
  state_t st;
  make_state(&st, 3, 1);
  sg_ckpt_server_t *s = start_server("tok", 0);
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  sg_ckpt_info_t info;
  sg_err_t err;
  /* nothing served yet */
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, "tok", 1, sg_deadline_in_ms(5000), &info, &err),
      SG_ESTATE);
  serve(s, 4, &st);
  sg_err_clear(&err);
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, "tok", 3, sg_deadline_in_ms(5000), &info, &err),
      SG_ESTATE);
  assert_non_null(strstr(err.msg, "serving 4 but got step=3"));
  assert_int_equal(sg_ckpt_fetch_info(f, a, "wrong", 4, sg_deadline_in_ms(5000),
                                      &info, &err),
                   SG_EAUTH);
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, NULL, 4, sg_deadline_in_ms(5000), &info, &err),
      SG_EAUTH);
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, "tok", 4, sg_deadline_in_ms(5000), &info, &err),
      0);
  state_t d;
  dst_like(&st, &d);
  uint64_t bytes[1];
  /* wrong step on DATA */
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, "tok", 5, info.layout,
                                      d.regs, d.n, NULL,
                                      sg_deadline_in_ms(5000), bytes, &err),
                   SG_ESTATE);
  /* a destination that does not match the layout */
  d.regs[0].len--;
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, "tok", 4, info.layout,
                                      d.regs, d.n, NULL,
                                      sg_deadline_in_ms(5000), bytes, &err),
                   SG_EINVAL);
  d.regs[0].len++;
  uint64_t layout = info.layout;
  sg_ckpt_info_free(&info);
  /* a served layout that changed under the same step */
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(1000)), 0);
  st.regs[3].len--;
  serve(s, 4, &st);
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, "tok", 4, layout, d.regs,
                                      d.n, NULL, sg_deadline_in_ms(5000), bytes,
                                      &err),
                   SG_ESTATE);
  /* serving twice without disallow */
  assert_int_equal(sg_ckpt_server_serve(s, 6, NULL, 0, NULL, 0, &err),
                   SG_ESTATE);
  /* an allocation failure leaves the server as it was */
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(1000)), 0);
  sg_test_fail_alloc(1, 1);
  int rc =
      sg_ckpt_server_serve(s, 6, header, sizeof(header), st.regs, st.n, &err);
  sg_test_fail_alloc(0, 0);
  assert_int_equal(rc, SG_ENOMEM);
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, "tok", 6, sg_deadline_in_ms(5000), &info, &err),
      SG_ESTATE);
  sg_ckpt_info_free(&info);
  free(d.mem);
  free(st.mem);
  sg_ckpt_fetch_free(f);
  sg_ckpt_server_stop(s);
}

/* ---- disallow ---------------------------------------------------------------
 */

static void send_data_req(int fd, int64_t step, uint64_t layout, uint64_t off,
                          uint64_t len) {
  sg_ckpt_req_t q = {.kind = SG_CKPT_KIND_DATA,
                     .step = step,
                     .layout = layout,
                     .offset = off,
                     .length = len};
  uint8_t b[SG_CKPT_REQ_MAX];
  int n = sg_ckpt_req_encode(&q, b);
  assert_int_equal(send(fd, b, (size_t)n, MSG_NOSIGNAL), n);
}

static void test_disallow_cuts_a_stalled_reader(void **unused) {
  state_t st;
  make_state(&st, 4, 100); /* ~27 MB: more than the socket buffers */
  sg_ckpt_server_t *s = start_server(NULL, 0);
  serve(s, 2, &st);
  uint64_t lens[8];
  for (size_t i = 0; i < st.n; i++)
    lens[i] = st.regs[i].len;
  int fd = raw_connect(sg_ckpt_server_port(s));
  send_data_req(fd, 2, sg_ckpt_layout_id(lens, st.n), 0, st.total);
  sg_ckpt_resp_t r;
  assert_int_equal(read_resp(fd, &r), 0); /* then stop reading */
  assert_int_equal(r.payload, st.total);
  int64_t t0 = sg_now_ns();
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(300)),
                   SG_ETIMEDOUT);
  assert_true(sg_now_ns() - t0 >= 250 * 1000000LL); /* it did wait */
  sg_ckpt_server_stats_t ss;
  sg_ckpt_server_stats(s, &ss);
  assert_int_equal(ss.cut, 1);
  long got = eof_after(fd);
  assert_true(got >= 0 && (uint64_t)got < st.total); /* truncated */
  sg_sock_close(fd);
  /* a finished response does not hold disallow up */
  serve(s, 3, &st);
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  uint64_t bytes[1];
  check_fetch(addrs, 1, NULL, 3, &st, 2, bytes);
  t0 = sg_now_ns();
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(30000)), 0);
  assert_true(sg_now_ns() - t0 < 20000 * 1000000LL);
  sg_ckpt_server_stop(s);
  free(st.mem);
}

/* ---- a bad source -----------------------------------------------------------
 */

typedef enum { BAD_TRUNCATE, BAD_SILENT, BAD_GARBAGE } bad_mode_t;

typedef struct {
  int listen_fd, port;
  bad_mode_t mode;
  atomic_int stop;
  pthread_t th;
} bad_source_t;

/* bad_main: accepts; answers each request per mode; until stop. */
static void *bad_main(void *arg) {
  bad_source_t *b = arg;
  int fds[64];
  int nfd = 0;
  while (!atomic_load(&b->stop)) {
    struct pollfd p = {.fd = b->listen_fd, .events = POLLIN};
    if (poll(&p, 1, 20) <= 0)
      continue;
    int fd;
    if (sg_sock_accept(b->listen_fd, &fd))
      continue;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    uint8_t req[SG_CKPT_REQ_MAX];
    ssize_t n = recv(fd, req, sizeof(req), 0);
    sg_ckpt_req_t q;
    if (n > 0 && sg_ckpt_req_parse(req, (size_t)n, &q) > 0 &&
        q.kind == SG_CKPT_KIND_MAP) {
      /* decline same-host reads, as a server of this process does */
      sg_ckpt_resp_t r = {
          .kind = q.kind, .status = SG_CKPT_NOT_SAME_HOST, .step = -1};
      uint8_t h[SG_CKPT_RESP_FIXED];
      sg_ckpt_resp_encode(&r, h);
      send(fd, h, sizeof(h), MSG_NOSIGNAL);
      n = recv(fd, req, sizeof(req), 0);
    }
    if (n > 0 && sg_ckpt_req_parse(req, (size_t)n, &q) > 0) {
      if (b->mode == BAD_TRUNCATE) {
        sg_ckpt_resp_t r = {.kind = q.kind,
                            .step = q.step,
                            .layout = q.layout,
                            .payload = q.length,
                            .aux = q.offset};
        uint8_t h[SG_CKPT_RESP_FIXED + 100];
        sg_ckpt_resp_encode(&r, h);
        memset(h + SG_CKPT_RESP_FIXED, 0xee, 100);
        send(fd, h, sizeof(h), MSG_NOSIGNAL); /* then vanish */
        sg_sock_close(fd);
        continue;
      }
      if (b->mode == BAD_GARBAGE) {
        uint8_t g[SG_CKPT_RESP_FIXED];
        memset(g, 0x5a, sizeof(g));
        send(fd, g, sizeof(g), MSG_NOSIGNAL);
      }
    }
    if (nfd < 64)
      fds[nfd++] = fd; /* silent: hold it open */
    else
      sg_sock_close(fd);
  }
  for (int i = 0; i < nfd; i++)
    sg_sock_close(fds[i]);
  return NULL;
}

static void bad_start(bad_source_t *b, bad_mode_t mode) {
  memset(b, 0, sizeof(*b));
  b->mode = mode;
  sg_err_t err;
  assert_int_equal(
      sg_sock_listen("127.0.0.1", 0, 16, &b->listen_fd, &b->port, &err), 0);
  assert_int_equal(pthread_create(&b->th, NULL, bad_main, b), 0);
}

static void bad_stop(bad_source_t *b) {
  atomic_store(&b->stop, 1);
  pthread_join(b->th, NULL);
  sg_sock_close(b->listen_fd);
}

/* wait_for_refusal: progress callback that holds a stream that finished a
 * chunk until the server `arg` has refused a request (up to 30 s), so the
 * good source cannot take every chunk before the refused one was asked. */
static void wait_for_refusal(void *arg, size_t source, uint64_t bytes) {
  sg_ckpt_server_t *s = arg;
  (void)source;
  (void)bytes;
  int64_t until = sg_now_ns() + 30000000000LL;
  for (;;) {
    sg_ckpt_server_stats_t ss;
    sg_ckpt_server_stats(s, &ss);
    if (ss.refused > 0 || sg_now_ns() >= until)
      return;
    usleep(1000);
  }
}

static void test_source_dies_mid_stream(void **unused) {
  state_t st;
  make_state(&st, 5, 20);
  uint64_t lens[8];
  for (size_t i = 0; i < st.n; i++)
    lens[i] = st.regs[i].len;
  uint64_t layout = sg_ckpt_layout_id(lens, st.n);
  bad_source_t bad;
  bad_start(&bad, BAD_TRUNCATE);
  sg_ckpt_server_t *s = start_server(NULL, 0);
  serve(s, 8, &st);
  char ab[64], ag[64];
  sprintf(ab, "127.0.0.1:%d", bad.port);
  addr_of(s, ag);
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  state_t d;
  dst_like(&st, &d);
  sg_err_t err;
  uint64_t bytes[2];
  sg_ckpt_fetch_opts_t o = {.streams_per_source = 2, .min_chunk = 64 << 10};
  /* alone, the truncating source is a clean error */
  const char *only_bad[] = {ab};
  assert_int_equal(sg_ckpt_fetch_data(f, only_bad, 1, NULL, 8, layout, d.regs,
                                      d.n, &o, sg_deadline_in_ms(10000), bytes,
                                      &err),
                   SG_EPEER);
  assert_non_null(strstr(err.msg, "truncated"));
  /* with a good source beside it, the good one delivers every byte */
  const char *both[] = {ab, ag};
  memset(d.mem, 0, d.total);
  int rc = sg_ckpt_fetch_data(f, both, 2, NULL, 8, layout, d.regs, d.n, &o,
                              sg_deadline_in_ms(30000), bytes, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_int_equal(bytes[0], 0);
  assert_int_equal(bytes[1], st.total);
  assert_memory_equal(d.mem, st.mem, st.total);
  bad_stop(&bad);

  /* a source at another step is dropped; the one at ours delivers */
  sg_ckpt_server_t *other = start_server(NULL, 0);
  serve(other, 7, &st);
  char ao[64];
  addr_of(other, ao);
  const char *mixed[] = {ao, ag};
  memset(d.mem, 0, d.total);
  o.progress = wait_for_refusal;
  o.progress_arg = other;
  rc = sg_ckpt_fetch_data(f, mixed, 2, NULL, 8, layout, d.regs, d.n, &o,
                          sg_deadline_in_ms(30000), bytes, &err);
  o.progress = NULL;
  if (rc)
    fail_msg("%s", err.msg);
  assert_int_equal(bytes[0], 0);
  assert_int_equal(bytes[1], st.total);
  assert_memory_equal(d.mem, st.mem, st.total);
  sg_ckpt_server_stats_t os;
  sg_ckpt_server_stats(other, &os);
  assert_int_equal(os.bytes_sent, 0);
  assert_true(os.refused >= 1);
  sg_ckpt_server_stop(other);

  /* garbage answers are a protocol error */
  bad_start(&bad, BAD_GARBAGE);
  sprintf(ab, "127.0.0.1:%d", bad.port);
  assert_int_equal(sg_ckpt_fetch_data(f, only_bad, 1, NULL, 8, layout, d.regs,
                                      d.n, &o, sg_deadline_in_ms(10000), bytes,
                                      &err),
                   SG_EPROTO);
  bad_stop(&bad);
  /* nobody listening: refused */
  assert_int_equal(sg_ckpt_fetch_data(f, only_bad, 1, NULL, 8, layout, d.regs,
                                      d.n, &o, sg_deadline_in_ms(10000), bytes,
                                      &err),
                   SG_ECONNREFUSED);
  free(d.mem);
  free(st.mem);
  sg_ckpt_fetch_free(f);
  sg_ckpt_server_stop(s);
}

typedef struct {
  sg_ckpt_fetch_t *f;
  int delay_ms;
} aborter_t;

static void *aborter_main(void *arg) {
  aborter_t *a = arg;
  usleep((useconds_t)a->delay_ms * 1000);
  sg_ckpt_fetch_abort(a->f);
  return NULL;
}

static void test_abort_and_deadline(void **unused) {
  bad_source_t bad;
  bad_start(&bad, BAD_SILENT);
  char ab[64];
  sprintf(ab, "127.0.0.1:%d", bad.port);
  const char *addrs[] = {ab};
  uint8_t mem[1000];
  sg_ckpt_region_t r = {.ptr = mem, .len = sizeof(mem)};
  uint64_t len = sizeof(mem);
  uint64_t layout = sg_ckpt_layout_id(&len, 1);
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  sg_err_t err;
  sg_ckpt_info_t info;
  /* deadline: info and data both give up in time */
  int64_t t0 = sg_now_ns();
  assert_int_equal(
      sg_ckpt_fetch_info(f, ab, NULL, 1, sg_deadline_in_ms(300), &info, &err),
      SG_ETIMEDOUT);
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, NULL, 1, layout, &r, 1, NULL,
                                      sg_deadline_in_ms(300), NULL, &err),
                   SG_ETIMEDOUT);
  assert_true(sg_now_ns() - t0 < 20000 * 1000000LL);
  /* abort from another thread, with a deadline that is far away */
  aborter_t a = {.f = f, .delay_ms = 200};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, aborter_main, &a), 0);
  t0 = sg_now_ns();
  assert_int_equal(sg_ckpt_fetch_data(f, addrs, 1, NULL, 1, layout, &r, 1, NULL,
                                      sg_deadline_in_ms(600000), NULL, &err),
                   SG_EABORTED);
  assert_true(sg_now_ns() - t0 < 60000 * 1000000LL);
  pthread_join(th, NULL);
  /* and every later call fails at once */
  assert_int_equal(sg_ckpt_fetch_info(f, ab, NULL, 1, sg_deadline_in_ms(600000),
                                      &info, &err),
                   SG_EABORTED);
  sg_ckpt_fetch_free(f);
  bad_stop(&bad);
}

/* ---- a bad client -----------------------------------------------------------
 */

static void test_server_survives_bad_clients(void **unused) {
  state_t st;
  make_state(&st, 6, 30);
  sg_ckpt_server_t *s = start_server(NULL, 300);
  serve(s, 1, &st);
  int port = sg_ckpt_server_port(s);
  sg_ckpt_resp_t r;

  /* garbage: an error response, then the connection closes */
  int fd = raw_connect(port);
  char junk[100];
  memset(junk, 0xab, sizeof(junk));
  send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
  assert_int_equal(read_resp(fd, &r), 0);
  assert_int_equal(r.status, SG_EPROTO);
  assert_true(eof_after(fd) >= 0);
  sg_sock_close(fd);

  /* HTTP */
  fd = raw_connect(port);
  const char *http = "GET /checkpoint/1/full HTTP/1.1\r\n\r\n";
  send(fd, http, strlen(http), MSG_NOSIGNAL);
  assert_int_equal(read_resp(fd, &r), 0);
  assert_int_equal(r.status, SG_EPROTO);
  sg_sock_close(fd);

  /* a valid magic with an oversized token length */
  fd = raw_connect(port);
  uint8_t b[SG_CKPT_REQ_FIXED];
  sg_ckpt_req_t q = {.kind = SG_CKPT_KIND_INFO, .step = 1};
  sg_ckpt_req_encode(&q, b);
  b[40] = 0xff;
  b[41] = 0xff;
  send(fd, b, sizeof(b), MSG_NOSIGNAL);
  assert_int_equal(read_resp(fd, &r), 0);
  assert_int_equal(r.status, SG_EPROTO);
  sg_sock_close(fd);

  /* a range past the end */
  fd = raw_connect(port);
  uint64_t lens[8];
  for (size_t i = 0; i < st.n; i++)
    lens[i] = st.regs[i].len;
  uint64_t layout = sg_ckpt_layout_id(lens, st.n);
  send_data_req(fd, 1, layout, st.total - 1, 2);
  assert_int_equal(read_resp(fd, &r), 0);
  assert_int_equal(r.status, SG_EINVAL);
  sg_sock_close(fd);

  /* truncated: half a request, then close */
  fd = raw_connect(port);
  send(fd, b, 20, MSG_NOSIGNAL);
  sg_sock_close(fd);

  /* slow: half a request, then nothing: dropped after request_timeout */
  fd = raw_connect(port);
  send(fd, b, 20, MSG_NOSIGNAL);
  int64_t t0 = sg_now_ns();
  assert_true(eof_after(fd) >= 0);
  assert_true(sg_now_ns() - t0 >= 250 * 1000000LL);
  sg_sock_close(fd);

  /* a reader that asks for everything and vanishes */
  for (int i = 0; i < 5; i++) {
    fd = raw_connect(port);
    send_data_req(fd, 1, layout, 0, st.total);
    sg_sock_close(fd);
  }

  /* the server still serves a real fetch, bit for bit */
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  uint64_t bytes[1];
  check_fetch(addrs, 1, NULL, 1, &st, 2, bytes);
  sg_ckpt_server_stats_t ss;
  sg_ckpt_server_stats(s, &ss);
  assert_true(ss.bad_input >= 5);
  assert_true(ss.timeouts >= 1);
  /* nothing holds the served memory any more */
  assert_int_equal(sg_ckpt_server_disallow(s, sg_deadline_in_ms(10000)), 0);
  sg_ckpt_server_stop(s);
  free(st.mem);
}

static void test_max_conns(void **unused) {
  sg_ckpt_server_opts_t o;
  sg_ckpt_server_opts_init(&o);
  o.bind = "127.0.0.1:0";
  o.max_conns = 2;
  o.request_timeout_ms = 10000;
  sg_ckpt_server_t *s = NULL;
  sg_err_t err;
  assert_int_equal(sg_ckpt_server_start(&o, &s, &err), 0);
  int port = sg_ckpt_server_port(s);
  int idle1 = raw_connect(port), idle2 = raw_connect(port);
  usleep(100 * 1000);
  /* a third client waits in the backlog until a slot frees */
  char a[64];
  addr_of(s, a);
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  sg_ckpt_info_t info;
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, NULL, 1, sg_deadline_in_ms(300), &info, &err),
      SG_ETIMEDOUT);
  sg_sock_close(idle1);
  assert_int_equal(
      sg_ckpt_fetch_info(f, a, NULL, 1, sg_deadline_in_ms(10000), &info, &err),
      SG_ESTATE); /* served: answered (nothing is served) */
  sg_sock_close(idle2);
  sg_ckpt_fetch_free(f);
  sg_ckpt_server_stop(s);
  assert_int_equal(sg_ckpt_server_start(
                       &(sg_ckpt_server_opts_t){.bind = "nonsense"}, &s, &err),
                   SG_EINVAL);
}

/* A forked child (a DataLoader worker) may drop its copy of a server: that
 * must neither hang (no thread to join) nor touch the parent's state. */
static void test_forked_child_stop(void **unused) {
  state_t st;
  make_state(&st, 7, 1);
  sg_ckpt_server_t *s = start_server(NULL, 0);
  serve(s, 1, &st);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(20); /* a hang fails the test instead of blocking it */
    sg_err_t err;
    int bad = sg_ckpt_server_serve(s, 2, NULL, 0, NULL, 0, &err) != SG_ESTATE;
    bad |= sg_ckpt_server_disallow(s, sg_deadline_in_ms(1000)) != 0;
    sg_ckpt_server_stop(s);
    _exit(bad ? 3 : 0);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  /* the parent still serves */
  char a[64];
  addr_of(s, a);
  const char *addrs[] = {a};
  uint64_t bytes[1];
  check_fetch(addrs, 1, NULL, 1, &st, 1, bytes);
  sg_ckpt_server_stop(s);
  free(st.mem);
}

/* ---- same host: sources in child processes --------------------------------
 */

typedef struct {
  pid_t pid;
  int port;
  int ctl, rep; /* parent ends: commands to, replies from the child */
} child_t;

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

static int read_all(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n > 0) {
    ssize_t r = read(fd, b, n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

/* child_serve: the child's side: serve `st` at `step` until told to stop.
 * Command 'd': disallow with a 300 ms deadline; replies rc and ms taken. */
static void child_serve(int in, int out, const state_t *st, int64_t step,
                        const char *token) {
  sg_ckpt_server_opts_t o;
  sg_ckpt_server_opts_init(&o);
  o.bind = "127.0.0.1:0";
  o.auth_token = token;
  o.stall_timeout_ms = 20000;
  sg_ckpt_server_t *s = NULL;
  sg_err_t err;
  if (sg_ckpt_server_start(&o, &s, &err) ||
      sg_ckpt_server_serve(s, step, header, sizeof(header), st->regs, st->n,
                           &err))
    _exit(2);
  int port = sg_ckpt_server_port(s);
  if (write_all(out, &port, sizeof(port)))
    _exit(2);
  char cmd;
  while (read_all(in, &cmd, 1) == 0) {
    if (cmd == 'd') {
      int64_t t0 = sg_now_ns();
      int r[2];
      r[0] = sg_ckpt_server_disallow(s, sg_deadline_in_ms(300));
      r[1] = (int)((sg_now_ns() - t0) / 1000000);
      if (write_all(out, r, sizeof(r)))
        break;
    }
  }
  sg_ckpt_server_stop(s);
  _exit(0);
}

static void child_start(child_t *c, const state_t *st, int64_t step,
                        const char *token) {
  int down[2], up[2];
  assert_int_equal(pipe2(down, O_CLOEXEC), 0);
  assert_int_equal(pipe2(up, O_CLOEXEC), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(120); /* a hang kills the child, never the run */
    close(down[1]);
    close(up[0]);
    child_serve(down[0], up[1], st, step, token);
  }
  close(down[0]);
  close(up[1]);
  c->pid = pid;
  c->ctl = down[1];
  c->rep = up[0];
  assert_int_equal(read_all(c->rep, &c->port, sizeof(c->port)), 0);
}

static void child_stop(child_t *c) {
  close(c->ctl);
  close(c->rep);
  if (c->pid > 0) {
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0);
  }
  c->pid = -1;
}

static uint64_t layout_of(const state_t *st) {
  uint64_t lens[8];
  for (size_t i = 0; i < st->n; i++)
    lens[i] = st->regs[i].len;
  return sg_ckpt_layout_id(lens, st->n);
}

/* fetch_from: fetch `st`'s layout at `step` into a fresh destination. */
static int fetch_from(const char *const *addrs, size_t naddr, const char *token,
                      int64_t step, const state_t *st, sg_ckpt_fetch_opts_t *o,
                      state_t *d, uint64_t *bytes, sg_ckpt_fetch_stats_t *fs,
                      sg_err_t *err) {
  sg_ckpt_fetch_t *f = NULL;
  assert_int_equal(sg_ckpt_fetch_new(&f), 0);
  dst_like(st, d);
  sg_err_clear(err);
  int rc =
      sg_ckpt_fetch_data(f, addrs, naddr, token, step, layout_of(st), d->regs,
                         d->n, o, sg_deadline_in_ms(60000), bytes, err);
  sg_ckpt_fetch_stats(f, fs);
  sg_ckpt_fetch_free(f);
  return rc;
}

static void test_same_host_round_trip(void **unused) {
  state_t st;
  make_state(&st, 11, 40); /* about 11 MB */
  child_t a, b;
  child_start(&a, &st, 6, "tok");
  child_start(&b, &st, 6, "tok");
  char aa[64], ab[64];
  sprintf(aa, "127.0.0.1:%d", a.port);
  sprintf(ab, "127.0.0.1:%d", b.port);
  const char *one[] = {aa}, *two[] = {aa, ab};
  sg_ckpt_fetch_opts_t o = {.streams_per_source = 2, .min_chunk = 64 << 10};
  state_t d;
  uint64_t bytes[2];
  sg_ckpt_fetch_stats_t fs;
  sg_err_t err;
  /* one source: every byte copied from its memory */
  int rc = fetch_from(one, 1, "tok", 6, &st, &o, &d, bytes, &fs, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_memory_equal(d.mem, st.mem, st.total);
  assert_int_equal(fs.same_host_bytes, st.total);
  assert_int_equal(fs.tcp_bytes, 0);
  assert_int_equal(fs.same_host_sources, 1);
  free(d.mem);
  /* striped over two: both contribute, all of it same-host */
  both_t both = {0};
  o.progress = both_contribute;
  o.progress_arg = &both;
  rc = fetch_from(two, 2, "tok", 6, &st, &o, &d, bytes, &fs, &err);
  o.progress = NULL;
  if (rc)
    fail_msg("%s", err.msg);
  assert_memory_equal(d.mem, st.mem, st.total);
  assert_true(bytes[0] > 0 && bytes[1] > 0);
  assert_int_equal(bytes[0] + bytes[1], st.total);
  assert_int_equal(fs.same_host_bytes, st.total);
  assert_int_equal(fs.same_host_sources, 2);
  free(d.mem);
  /* the auth token guards the grant */
  rc = fetch_from(one, 1, "wrong", 6, &st, &o, &d, bytes, &fs, &err);
  assert_int_equal(rc, SG_EAUTH);
  assert_int_equal(fs.same_host_bytes, 0);
  free(d.mem);
  /* a wrong step is refused, not granted */
  rc = fetch_from(one, 1, "tok", 5, &st, &o, &d, bytes, &fs, &err);
  assert_int_equal(rc, SG_ESTATE);
  free(d.mem);
  /* turned off by the option, then by the environment: TCP */
  o.same_host = -1;
  rc = fetch_from(two, 2, "tok", 6, &st, &o, &d, bytes, &fs, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_memory_equal(d.mem, st.mem, st.total);
  assert_int_equal(fs.tcp_bytes, st.total);
  assert_int_equal(fs.same_host_sources, 0);
  free(d.mem);
  o.same_host = 0;
  setenv("STEPGUARD_SAME_HOST", "0", 1);
  rc = fetch_from(one, 1, "tok", 6, &st, &o, &d, bytes, &fs, &err);
  unsetenv("STEPGUARD_SAME_HOST");
  if (rc)
    fail_msg("%s", err.msg);
  assert_memory_equal(d.mem, st.mem, st.total);
  assert_int_equal(fs.tcp_bytes, st.total);
  assert_int_equal(fs.same_host_bytes, 0);
  free(d.mem);
  child_stop(&a);
  child_stop(&b);
  free(st.mem);
}

/* send_map_req: a raw MAP request for `step` and `layout` from this process */
static void send_map_req(int fd, int64_t step, uint64_t layout) {
  sg_ckpt_req_t q = {.kind = SG_CKPT_KIND_MAP, .step = step, .layout = layout};
  sg_samehost_id_t me;
  assert_int_equal(sg_samehost_self(&me), 0);
  sg_samehost_encode(&me, q.peer_id);
  uint8_t b[SG_CKPT_REQ_MAX];
  int n = sg_ckpt_req_encode(&q, b);
  assert_true(n == SG_CKPT_REQ_FIXED + SG_SAMEHOST_ID_LEN);
  assert_int_equal(send(fd, b, (size_t)n, MSG_NOSIGNAL), n);
}

static void test_same_host_grant_holds_the_state(void **unused) {
  state_t st;
  make_state(&st, 12, 2);
  child_t a;
  child_start(&a, &st, 3, NULL);
  int fd = raw_connect(a.port);
  send_map_req(fd, 3, layout_of(&st));
  sg_ckpt_resp_t r;
  assert_int_equal(read_resp(fd, &r), 0);
  assert_int_equal(r.status, 0);
  assert_int_equal(r.kind, SG_CKPT_KIND_MAP);
  assert_int_equal(r.nregions, st.n);
  uint8_t *pay = malloc((size_t)r.payload);
  assert_non_null(pay);
  size_t got = 0;
  while (got < r.payload) {
    ssize_t k = recv(fd, pay + got, (size_t)r.payload - got, 0);
    assert_true(k > 0);
    got += (size_t)k;
  }
  sg_ckpt_map_t m;
  assert_int_equal(sg_ckpt_map_parse(pay, got, &m), 0);
  assert_int_equal(m.id.pid, (uint32_t)a.pid);
  uint64_t lens[8], addrs[8];
  for (size_t i = 0; i < st.n; i++)
    lens[i] = st.regs[i].len;
  assert_int_equal(
      sg_ckpt_desc_parse(pay + SG_CKPT_MAP_FIXED, st.n, lens, addrs), 0);
  assert_int_equal(
      sg_samehost_probe(m.id.pid, m.beacon_addr, m.beacon, SG_CKPT_BEACON_LEN),
      0);
  /* the grant names the child's copy of the regions (forked: same addresses) */
  uint8_t probe[64];
  assert_int_equal(sg_samehost_read(m.id.pid, probe, addrs[4], sizeof(probe)),
                   0);
  assert_memory_equal(probe, st.regs[4].ptr, sizeof(probe));
  /* while granted, disallow waits for the fetcher, then cuts it */
  char cmd = 'd';
  int rep[2];
  assert_int_equal(write_all(a.ctl, &cmd, 1), 0);
  assert_int_equal(read_all(a.rep, rep, sizeof(rep)), 0);
  assert_int_equal(rep[0], SG_ETIMEDOUT);
  assert_true(rep[1] >= 250);
  /* the beacon no longer reads what was granted: a copy made now is void */
  assert_int_not_equal(
      sg_samehost_probe(m.id.pid, m.beacon_addr, m.beacon, SG_CKPT_BEACON_LEN),
      0);
  assert_true(eof_after(fd) >= 0); /* and the grant's connection is closed */
  sg_sock_close(fd);
  free(pay);
  child_stop(&a);

  /* a fetcher that is done (closed the grant) does not hold disallow up */
  child_start(&a, &st, 3, NULL);
  char aa[64];
  sprintf(aa, "127.0.0.1:%d", a.port);
  const char *one[] = {aa};
  state_t d;
  uint64_t bytes[1];
  sg_ckpt_fetch_stats_t fs;
  sg_err_t err;
  int rc = fetch_from(one, 1, NULL, 3, &st, NULL, &d, bytes, &fs, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_int_equal(fs.same_host_bytes, st.total);
  assert_memory_equal(d.mem, st.mem, st.total);
  free(d.mem);
  assert_int_equal(write_all(a.ctl, &cmd, 1), 0);
  assert_int_equal(read_all(a.rep, rep, sizeof(rep)), 0);
  assert_int_equal(rep[0], 0);
  child_stop(&a);
  free(st.mem);
}

typedef struct {
  child_t *victim;
  size_t source; /* the victim's index in the fetch */
  atomic_int killed;
} killer_t;

/* kill_after_first_chunk: progress callback that kills the victim source
 * (and reaps it) once it has delivered one chunk.  Another source's stream
 * that finished a chunk first waits (up to 30 s) for that: under load it
 * could otherwise take every chunk before the victim's stream started, and
 * nothing would be killed. */
static void kill_after_first_chunk(void *arg, size_t source, uint64_t bytes) {
  killer_t *k = arg;
  (void)bytes;
  if (source != k->source) {
    int64_t until = sg_now_ns() + 30000000000LL;
    while (!atomic_load(&k->killed) && sg_now_ns() < until)
      usleep(1000);
    return;
  }
  if (atomic_exchange(&k->killed, 1))
    return;
  kill(k->victim->pid, SIGKILL);
  waitpid(k->victim->pid, NULL, 0);
  k->victim->pid = -1;
}

static void test_same_host_source_killed(void **unused) {
  state_t st;
  make_state(&st, 13, 20); /* about 5 MB: four chunks per stream */
  child_t a, b;
  char aa[64], ab[64];
  state_t d;
  uint64_t bytes[2];
  sg_ckpt_fetch_stats_t fs;
  sg_err_t err;
  /* alone: the read after the kill fails cleanly */
  child_start(&a, &st, 4, NULL);
  sprintf(aa, "127.0.0.1:%d", a.port);
  const char *one[] = {aa};
  killer_t k = {.victim = &a, .source = 0};
  sg_ckpt_fetch_opts_t o = {.streams_per_source = 1,
                            .min_chunk = 64 << 10,
                            .progress = kill_after_first_chunk,
                            .progress_arg = &k};
  int rc = fetch_from(one, 1, NULL, 4, &st, &o, &d, bytes, &fs, &err);
  assert_int_equal(atomic_load(&k.killed), 1);
  assert_int_equal(rc, SG_EPEER);
  if (!strstr(err.msg, "same-host"))
    fail_msg("not a same-host read error (%llu same-host, %llu TCP bytes): %s",
             (unsigned long long)fs.same_host_bytes,
             (unsigned long long)fs.tcp_bytes, err.msg);
  assert_true(fs.same_host_bytes > 0 && fs.same_host_bytes < st.total);
  free(d.mem);
  child_stop(&a);
  /* beside another source: that one delivers the rest */
  child_start(&a, &st, 4, NULL);
  child_start(&b, &st, 4, NULL);
  sprintf(aa, "127.0.0.1:%d", a.port);
  sprintf(ab, "127.0.0.1:%d", b.port);
  const char *two[] = {aa, ab};
  atomic_store(&k.killed, 0);
  rc = fetch_from(two, 2, NULL, 4, &st, &o, &d, bytes, &fs, &err);
  if (rc)
    fail_msg("%s", err.msg);
  assert_int_equal(atomic_load(&k.killed), 1);
  assert_memory_equal(d.mem, st.mem, st.total);
  assert_true(bytes[0] > 0 && bytes[0] < st.total);
  assert_true(bytes[1] > 0);
  assert_int_equal(bytes[0] + bytes[1], st.total);
  assert_int_equal(fs.same_host_bytes, st.total);
  free(d.mem);
  child_stop(&a);
  child_stop(&b);
  free(st.mem);
}

typedef enum { HOSTILE_LENGTH, HOSTILE_UNMAPPED, HOSTILE_WRAP } hostile_t;

/* hostile_serve: the child's side: grant every MAP with one bad descriptor
 * (region 4); its id and beacon are genuine. */
static void hostile_serve(int lfd, const state_t *st, hostile_t mode) {
  static uint8_t beacon[SG_CKPT_BEACON_LEN];
  memset(beacon, 0x42, sizeof(beacon));
  sg_ckpt_map_t m = {.beacon_addr = (uint64_t)(uintptr_t)beacon};
  memcpy(m.beacon, beacon, sizeof(beacon));
  if (sg_samehost_self(&m.id))
    _exit(2);
  size_t plen = SG_CKPT_MAP_FIXED + st->n * SG_CKPT_DESC_LEN;
  uint8_t out[SG_CKPT_RESP_FIXED + SG_CKPT_MAP_FIXED + 8 * SG_CKPT_DESC_LEN];
  for (;;) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
      _exit(2);
    uint8_t req[SG_CKPT_REQ_MAX];
    size_t have = 0;
    sg_ckpt_req_t q;
    int used = 0;
    while (used == 0) {
      ssize_t k = recv(fd, req + have, sizeof(req) - have, 0);
      if (k <= 0)
        break;
      have += (size_t)k;
      used = sg_ckpt_req_parse(req, have, &q);
    }
    if (used > 0 && q.kind == SG_CKPT_KIND_MAP) {
      sg_ckpt_resp_t r = {.kind = q.kind,
                          .step = q.step,
                          .layout = q.layout,
                          .nregions = (uint32_t)st->n,
                          .payload = plen};
      sg_ckpt_resp_encode(&r, out);
      sg_ckpt_map_encode(&m, out + SG_CKPT_RESP_FIXED);
      for (size_t i = 0; i < st->n; i++) {
        uint8_t *dsc =
            out + SG_CKPT_RESP_FIXED + SG_CKPT_MAP_FIXED + SG_CKPT_DESC_LEN * i;
        uint64_t a = (uint64_t)(uintptr_t)st->regs[i].ptr, l = st->regs[i].len;
        if (i == 4 && mode == HOSTILE_LENGTH)
          l += 4096; /* more than was announced: past the region */
        if (i == 4 && mode == HOSTILE_UNMAPPED)
          a = 4096; /* below mmap_min_addr: never mapped */
        if (i == 4 && mode == HOSTILE_WRAP)
          a = UINT64_MAX - 100;
        for (int b = 0; b < 8; b++) {
          dsc[b] = (uint8_t)(a >> (8 * b));
          dsc[8 + b] = (uint8_t)(l >> (8 * b));
        }
      }
      write_all(fd, out, SG_CKPT_RESP_FIXED + plen);
      char sink[256];
      while (recv(fd, sink, sizeof(sink), 0) > 0) {
      }
    }
    close(fd);
  }
}

static void test_same_host_hostile_descriptor(void **unused) {
  state_t st;
  make_state(&st, 14, 1);
  static const hostile_t modes[] = {HOSTILE_LENGTH, HOSTILE_UNMAPPED,
                                    HOSTILE_WRAP};
  static const int want[] = {SG_EPROTO, SG_EPEER, SG_EPROTO};
  static const char *const text[] = {"descriptor", "same-host read failed",
                                     "descriptor"};
  for (size_t mi = 0; mi < 3; mi++) {
    /* a plain socket: the fork rule would close a registered one in the
     * child */
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 16), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);
    int port = ntohs(sa.sin_port);
    sg_err_t err;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      alarm(60);
      hostile_serve(lfd, &st, modes[mi]);
    }
    close(lfd);
    char ah[64];
    sprintf(ah, "127.0.0.1:%d", port);
    const char *one[] = {ah};
    sg_ckpt_fetch_opts_t o = {.streams_per_source = 2};
    state_t d;
    uint64_t bytes[1];
    sg_ckpt_fetch_stats_t fs;
    int rc = fetch_from(one, 1, NULL, 1, &st, &o, &d, bytes, &fs, &err);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    assert_int_equal(rc, want[mi]);
    if (!strstr(err.msg, text[mi]))
      fail_msg("mode %zu: %s", mi, err.msg);
    assert_int_equal(fs.same_host_bytes, 0);
    free(d.mem);
  }
  free(st.mem);
}

int main(void) {
  /* SG_TEST_FILTER=test_same_host* runs the matching tests only (a loop) */
  const char *filter = getenv("SG_TEST_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_request_codec),
      cmocka_unit_test(test_response_codec),
      cmocka_unit_test(test_lengths_layout_addr_plan),
      cmocka_unit_test(test_round_trip_one_source),
      cmocka_unit_test(test_striped_two_sources),
      cmocka_unit_test(test_empty_state),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_disallow_cuts_a_stalled_reader),
      cmocka_unit_test(test_source_dies_mid_stream),
      cmocka_unit_test(test_abort_and_deadline),
      cmocka_unit_test(test_server_survives_bad_clients),
      cmocka_unit_test(test_max_conns),
      cmocka_unit_test(test_forked_child_stop),
      cmocka_unit_test(test_same_host_round_trip),
      cmocka_unit_test(test_same_host_grant_holds_the_state),
      cmocka_unit_test(test_same_host_source_killed),
      cmocka_unit_test(test_same_host_hostile_descriptor),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  if (sg_sock_registered_count() != 0) {
    fprintf(stderr, "leaked %zu sockets\n", sg_sock_registered_count());
    return 1;
  }
  return rc;
}
