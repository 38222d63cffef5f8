/*
 * test_lighthouse.c: the lighthouse server and client in one process,
 * under the sanitizers: quorums from concurrent clients, connection
 * liveness, the HTTP side read while quorums change, auth, id persistence,
 * stopping with calls in flight, and the answer's encoding (byte for byte
 * what protobuf-c makes, unknown member fields carried to every peer).
 */
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

#include "lighthouse/answer.h"
#include "rpc/h2s.h" /* the blob layout */
#include "stepguard/base.h"
#include "stepguard/lighthouse.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

static sg_lh_server_t *start(sg_lh_opts_t *o) {
  sg_lh_server_t *s = NULL;
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_lh_server_start(o, &s, &err);
  if (rc)
    fail_msg("start: %s", err.msg);
  return s;
}

static void default_opts(sg_lh_opts_t *o) {
  sg_lh_opts_init(o);
  o->bind = "127.0.0.1:0";
  o->min_replicas = 1;
  o->join_timeout_ms = 100;
}

static sg_lh_client_t *connect_to(sg_lh_server_t *s, const char *token) {
  char addr[64];
  snprintf(addr, sizeof(addr), "http://127.0.0.1:%d", sg_lh_server_port(s));
  sg_lh_client_t *c = NULL;
  sg_err_t err;
  if (sg_lh_client_new(addr, 10000, token, &c, &err) != 0)
    fail_msg("client: %s", err.msg);
  return c;
}

struct req {
  sg_lh_client_t *c;
  const char *id;
  int64_t step;
  int64_t timeout_ms;
  int rc;
  sg_lh_quorum_t q;
  sg_err_t err;
};

static void *quorum_thread(void *arg) {
  struct req *r = arg;
  sg_lh_member_t m = {0};
  m.replica_id = (char *)r->id;
  m.address = "http://manager";
  m.store_address = "store:1";
  m.data = "{\"x\": 1}";
  m.step = r->step;
  m.world_size = 2;
  r->rc = sg_lh_client_quorum(r->c, &m, sg_deadline_in_ms(r->timeout_ms), &r->q,
                              &r->err);
  return NULL;
}

static int has_member(const sg_lh_quorum_t *q, const char *id) {
  for (size_t i = 0; i < q->n; i++)
    if (strcmp(q->members[i].replica_id, id) == 0)
      return 1;
  return 0;
}

static void test_invalid_options(void **state) {
  (void)state;
  sg_lh_opts_t o;
  sg_lh_server_t *s = NULL;
  sg_err_t err;
  sg_lh_opts_init(&o);
  o.bind = "127.0.0.1:0";
  assert_int_equal(sg_lh_server_start(&o, &s, &err), SG_EINVAL);
  assert_non_null(strstr(err.msg, "min_replicas"));
  o.min_replicas = 1;
  o.heartbeat_timeout_ms = 0;
  assert_int_equal(sg_lh_server_start(&o, &s, &err), SG_EINVAL);
  o.heartbeat_timeout_ms = 5000;
  o.bind = "not an address";
  assert_true(sg_lh_server_start(&o, &s, &err) < 0);
  assert_null(s);
}

static void test_two_replicas_form_quorums_and_ids_grow(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.min_replicas = 2;
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *a = connect_to(s, NULL), *b = connect_to(s, NULL);
  int64_t last_id = -1;
  for (int round = 0; round < 5; round++) {
    struct req ra = {.c = a, .id = "a", .step = round, .timeout_ms = 10000};
    struct req rb = {.c = b, .id = "b", .step = round, .timeout_ms = 10000};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, quorum_thread, &ra);
    pthread_create(&tb, NULL, quorum_thread, &rb);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_int_equal(ra.rc, 0);
    assert_int_equal(rb.rc, 0);
    assert_int_equal(ra.q.n, 2);
    assert_string_equal(ra.q.members[0].replica_id, "a");
    assert_string_equal(ra.q.members[1].replica_id, "b");
    assert_int_equal(ra.q.members[0].step, round);
    assert_string_equal(ra.q.members[1].data, "{\"x\": 1}");
    assert_int_equal(ra.q.quorum_id, rb.q.quorum_id);
    if (round == 0)
      assert_true(ra.q.quorum_id > 0);
    else /* same membership: same id */
      assert_int_equal(ra.q.quorum_id, last_id);
    last_id = ra.q.quorum_id;
    sg_lh_quorum_free(&ra.q);
    sg_lh_quorum_free(&rb.q);
  }
  assert_int_equal(
      sg_lh_client_heartbeat(a, "a", sg_deadline_in_ms(5000), NULL), 0);
  sg_lh_client_free(a);
  sg_lh_client_free(b);
  sg_lh_server_stop(s);
}

/* http_get: GET `path`, return the body (malloc'd) or NULL. */
static char *http_get(int port, const char *path) {
  int fd = -1;
  sg_err_t err;
  if (sg_sock_connect("127.0.0.1", port, sg_deadline_in_ms(5000), &fd, &err))
    return NULL;
  char req[256];
  int n =
      snprintf(req, sizeof(req),
               "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
  size_t cap = 1 << 20, len = 0;
  char *buf = malloc(cap);
  sg_deadline_t d = sg_deadline_in_ms(10000);
  if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
    sg_sock_close(fd);
    free(buf);
    return NULL;
  }
  while (!sg_deadline_passed(d) && len + 1 < cap) {
    ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
    if (r == 0)
      break;
    if (r < 0) {
      usleep(1000);
      continue;
    }
    len += (size_t)r;
  }
  buf[len] = '\0';
  sg_sock_close(fd);
  char *body = strstr(buf, "\r\n\r\n");
  if (!body || strncmp(buf, "HTTP/1.1 200", 12) != 0) {
    free(buf);
    return NULL;
  }
  memmove(buf, body + 4, strlen(body + 4) + 1);
  return buf;
}

struct poller {
  int port;
  atomic_int stop;
  atomic_int ok, bad;
};

static void *status_poller(void *arg) {
  struct poller *p = arg;
  while (!atomic_load(&p->stop)) {
    char *body = http_get(p->port, p->ok % 2 ? "/metrics" : "/status");
    if (body)
      p->ok++;
    else
      p->bad++;
    free(body);
  }
  return NULL;
}

/* Counts the lighthouse's "Quorum!" lines by level. */
struct quorum_lines {
  pthread_mutex_t mu;
  int info, debug, info_counted; /* counted: says how many were held back */
};

static void quorum_line_sink(void *ud, sg_log_level_t level,
                             const char *subsystem, const char *line) {
  struct quorum_lines *ql = ud;
  (void)subsystem;
  if (!strstr(line, "Quorum! id"))
    return;
  pthread_mutex_lock(&ql->mu);
  if (level == SG_LOG_INFO) {
    ql->info++;
    ql->info_counted += strstr(line, "quorums of this id since") != NULL;
  } else if (level == SG_LOG_DEBUG) {
    ql->debug++;
  }
  pthread_mutex_unlock(&ql->mu);
}

/*
 * The same members asking again (a training step each) are logged at INFO
 * at most once per second, the others at DEBUG, and the next INFO line
 * counts those held back; a quorum of a new id is always at INFO.
 */
static void test_quorum_lines_of_unchanged_id_held_back(void **state) {
  (void)state;
  sg_log_level_t old = SG_LOG_ERROR;
  for (int lv = SG_LOG_TRACE; lv > SG_LOG_ERROR; lv--)
    if (sg_log_enabled((sg_log_level_t)lv)) {
      old = (sg_log_level_t)lv;
      break;
    }
  struct quorum_lines ql = {.mu = PTHREAD_MUTEX_INITIALIZER};
  sg_log_set_level(SG_LOG_DEBUG);
  sg_log_set_sink(quorum_line_sink, &ql);
  sg_lh_opts_t o;
  default_opts(&o);
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *c = connect_to(s, NULL);
  int64_t t0 = sg_now_ns();
  for (int i = 0; i < 20; i++) {
    struct req r = {.c = c, .id = "solo", .step = i, .timeout_ms = 10000};
    quorum_thread(&r);
    assert_int_equal(r.rc, 0);
    sg_lh_quorum_free(&r.q);
  }
  double secs = (double)(sg_now_ns() - t0) / 1e9;
  pthread_mutex_lock(&ql.mu);
  int info = ql.info, debug = ql.debug;
  pthread_mutex_unlock(&ql.mu);
  assert_int_equal(info + debug, 20); /* every quorum has its line */
  assert_true(info >= 1);             /* the first, a new id */
  assert_true(info <= 1 + (int)secs); /* then at most one a second */
  usleep(1100 * 1000);
  struct req r = {.c = c, .id = "solo", .step = 20, .timeout_ms = 10000};
  quorum_thread(&r);
  assert_int_equal(r.rc, 0);
  sg_lh_quorum_free(&r.q);
  pthread_mutex_lock(&ql.mu);
  assert_int_equal(ql.info, info + 1);
  assert_true(debug > 0);            /* 20 quorums take far less than 1 s */
  assert_true(ql.info_counted >= 1); /* the held-back ones are counted */
  pthread_mutex_unlock(&ql.mu);
  sg_lh_client_free(c);
  sg_lh_server_stop(s);
  sg_log_set_sink(NULL, NULL);
  sg_log_set_level(old);
}

static void test_http_side_reads_while_quorums_change(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  sg_lh_server_t *s = start(&o);
  struct poller p = {.port = sg_lh_server_port(s)};
  pthread_t tp;
  pthread_create(&tp, NULL, status_poller, &p);
  sg_lh_client_t *c = connect_to(s, NULL);
  /* at least 30 quorums, and on until the poller has read a few pages
   * (quorums take microseconds: 30 of them may pass before its first) */
  int n = 0;
  sg_deadline_t dl = sg_deadline_in_ms(10000);
  while (n < 30 || (atomic_load(&p.ok) < 4 && !sg_deadline_passed(dl))) {
    struct req r = {.c = c, .id = "solo", .step = n, .timeout_ms = 10000};
    quorum_thread(&r);
    assert_int_equal(r.rc, 0);
    assert_int_equal(r.q.n, 1);
    sg_lh_quorum_free(&r.q);
    n++;
  }
  atomic_store(&p.stop, 1);
  pthread_join(tp, NULL);
  assert_true(p.ok > 0);
  assert_int_equal(p.bad, 0);
  char *status = http_get(sg_lh_server_port(s), "/status");
  assert_non_null(status);
  assert_non_null(strstr(status, "\"solo\""));
  free(status);
  char *metrics = http_get(sg_lh_server_port(s), "/metrics");
  assert_non_null(metrics);
  char want[64];
  snprintf(want, sizeof(want), "stepguard_lighthouse_quorums_issued_total %d",
           n);
  assert_non_null(strstr(metrics, want));
  free(metrics);
  sg_lh_client_free(c);
  sg_lh_server_stop(s);
}

/*
 * A replica whose connection closes is dropped after the grace period,
 * although its heartbeat would keep it healthy for a minute.
 */
static void test_closed_connection_stops_blocking_quorum(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.heartbeat_timeout_ms = 60000;
  o.join_timeout_ms = 600000;
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *a = connect_to(s, NULL), *b = connect_to(s, NULL);
  /* both heartbeat first, so that the first quorum waits for both */
  assert_int_equal(
      sg_lh_client_heartbeat(a, "a", sg_deadline_in_ms(5000), NULL), 0);
  assert_int_equal(
      sg_lh_client_heartbeat(b, "b", sg_deadline_in_ms(5000), NULL), 0);
  struct req ra = {.c = a, .id = "a", .step = 1, .timeout_ms = 10000};
  struct req rb = {.c = b, .id = "b", .step = 1, .timeout_ms = 10000};
  pthread_t ta, tb;
  pthread_create(&ta, NULL, quorum_thread, &ra);
  pthread_create(&tb, NULL, quorum_thread, &rb);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  assert_int_equal(ra.rc, 0);
  assert_int_equal(ra.q.n, 2);
  int64_t first = ra.q.quorum_id;
  sg_lh_quorum_free(&ra.q);
  sg_lh_quorum_free(&rb.q);

  sg_lh_client_free(b); /* b "crashes": its connection closes */
  int64_t t0 = sg_now_ns();
  struct req r2 = {.c = a, .id = "a", .step = 2, .timeout_ms = 30000};
  quorum_thread(&r2);
  double secs = (double)(sg_now_ns() - t0) / 1e9;
  assert_int_equal(r2.rc, 0);
  assert_int_equal(r2.q.n, 1);
  assert_true(has_member(&r2.q, "a"));
  assert_true(r2.q.quorum_id > first);
  assert_true(secs < 10.0); /* heartbeat expiry would take 60 s */
  sg_lh_quorum_free(&r2.q);
  sg_lh_client_free(a);
  sg_lh_server_stop(s);
}

static void test_auth_token(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.auth_token = "s3cret";
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *none = connect_to(s, NULL), *wrong = connect_to(s, "nope"),
                 *right = connect_to(s, "s3cret");
  sg_err_t err;
  assert_int_equal(
      sg_lh_client_heartbeat(none, "x", sg_deadline_in_ms(5000), &err),
      SG_EAUTH);
  assert_non_null(strstr(err.msg, "UNAUTHENTICATED"));
  assert_int_equal(
      sg_lh_client_heartbeat(wrong, "x", sg_deadline_in_ms(5000), &err),
      SG_EAUTH);
  assert_int_equal(
      sg_lh_client_heartbeat(right, "x", sg_deadline_in_ms(5000), &err), 0);
  sg_lh_client_free(none);
  sg_lh_client_free(wrong);
  sg_lh_client_free(right);
  sg_lh_server_stop(s);
}

static void test_quorum_ids_grow_across_restart(void **state) {
  (void)state;
  char path[] = "/tmp/sg-lh-ids-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  unlink(path);
  int64_t ids[2];
  for (int run = 0; run < 2; run++) {
    sg_lh_opts_t o;
    default_opts(&o);
    o.quorum_id_file = path;
    sg_lh_server_t *s = start(&o);
    sg_lh_client_t *c = connect_to(s, NULL);
    struct req r = {.c = c, .id = "r", .step = 0, .timeout_ms = 10000};
    quorum_thread(&r);
    assert_int_equal(r.rc, 0);
    ids[run] = r.q.quorum_id;
    sg_lh_quorum_free(&r.q);
    sg_lh_client_free(c);
    sg_lh_server_stop(s);
  }
  assert_int_equal(ids[0], 1); /* a fresh file starts from 0 */
  assert_true(ids[1] > ids[0]);
  unlink(path);

  /* without a file, the floor is the wall clock in milliseconds */
  sg_lh_opts_t o;
  default_opts(&o);
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *c = connect_to(s, NULL);
  struct req r = {.c = c, .id = "r", .step = 0, .timeout_ms = 10000};
  quorum_thread(&r);
  assert_int_equal(r.rc, 0);
  assert_true(r.q.quorum_id > sg_wall_ns() / 1000000 - 600000);
  sg_lh_quorum_free(&r.q);
  sg_lh_client_free(c);
  sg_lh_server_stop(s);
}

/*
 * A replica with two calls waiting (two connections) stays a participant
 * when one of them is cancelled: the other still waits for its quorum.
 */
static void test_cancel_keeps_replica_with_another_call(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.min_replicas = 2;
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *a1 = connect_to(s, NULL), *a2 = connect_to(s, NULL);
  sg_lh_client_t *b = connect_to(s, NULL);
  struct req keep = {.c = a1, .id = "a", .step = 1, .timeout_ms = 10000};
  struct req gone = {.c = a2, .id = "a", .step = 1, .timeout_ms = 500};
  pthread_t tk, tg;
  pthread_create(&tk, NULL, quorum_thread, &keep);
  usleep(100000);
  pthread_create(&tg, NULL, quorum_thread, &gone);
  pthread_join(tg, NULL);
  assert_int_not_equal(gone.rc, 0); /* its deadline passed: cancelled */
  struct req rb = {.c = b, .id = "b", .step = 1, .timeout_ms = 5000};
  quorum_thread(&rb);
  pthread_join(tk, NULL);
  assert_int_equal(rb.rc, 0);
  assert_int_equal(keep.rc, 0);
  assert_int_equal(rb.q.n, 2);
  assert_true(has_member(&rb.q, "a") && has_member(&rb.q, "b"));
  assert_int_equal(keep.q.quorum_id, rb.q.quorum_id);
  sg_lh_quorum_free(&rb.q);
  sg_lh_quorum_free(&keep.q);
  sg_lh_client_free(a1);
  sg_lh_client_free(a2);
  sg_lh_client_free(b);
  sg_lh_server_stop(s);
}

static void test_stop_with_calls_in_flight(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.min_replicas = 3; /* never met */
  sg_lh_server_t *s = start(&o);
  sg_lh_client_t *c = connect_to(s, NULL);
  struct req r = {.c = c, .id = "waiting", .step = 0, .timeout_ms = 60000};
  pthread_t t;
  pthread_create(&t, NULL, quorum_thread, &r);
  usleep(200000);
  int64_t t0 = sg_now_ns();
  sg_lh_server_stop(s);
  pthread_join(t, NULL);
  assert_true(r.rc != 0);
  assert_true((double)(sg_now_ns() - t0) / 1e9 < 30.0);
  sg_lh_client_free(c);
}

/* ---- the answer on the wire ------------------------------------------------
 */

/* A requester as a newer client sends it: known fields, then two this
 * version does not know (field 100 varint 7, field 101 bytes "hi"). */
static Torchft__QuorumMember *unpack_with_unknown(const char *id) {
  Torchft__QuorumMember m = TORCHFT__QUORUM_MEMBER__INIT;
  char *handles[] = {(char *)"h0", (char *)""};
  m.replica_id = (char *)id;
  m.address = (char *)"http://a:1";
  m.store_address = (char *)"a:2";
  m.data = (char *)"{\"x\": 1}";
  m.step = -3;
  m.world_size = 8;
  m.shrink_only = 1;
  m.commit_failures = 2;
  m.n_reconfigure_handles = 2;
  m.reconfigure_handles = handles;
  uint8_t buf[256];
  size_t n = torchft__quorum_member__pack(&m, buf);
  static const uint8_t extra[] = {0xa0, 0x06, 0x07, 0xaa, 0x06, 2, 'h', 'i'};
  memcpy(buf + n, extra, sizeof(extra));
  Torchft__QuorumMember *r =
      torchft__quorum_member__unpack(NULL, n + sizeof(extra), buf);
  assert_non_null(r);
  assert_int_equal(r->base.n_unknown_fields, 2);
  return r;
}

/*
 * A request that is exactly its requester gives the member's bytes as they
 * came (a large member: a two-byte length); anything else, or a cut or
 * overlong record, falls back to encoding the parse.
 */
static void test_member_span_of_request(void **state) {
  (void)state;
  char data[300];
  memset(data, 'd', sizeof(data) - 1);
  data[sizeof(data) - 1] = '\0';
  Torchft__QuorumMember m = TORCHFT__QUORUM_MEMBER__INIT;
  m.replica_id = (char *)"rep-a";
  m.address = (char *)"http://a:1";
  m.data = data;
  m.step = 7;
  Torchft__LighthouseQuorumRequest q = TORCHFT__LIGHTHOUSE_QUORUM_REQUEST__INIT;
  q.requester = &m;
  uint8_t body[512], member[512];
  size_t len = torchft__lighthouse_quorum_request__pack(&q, body);
  size_t mlen = torchft__quorum_member__pack(&m, member);
  const uint8_t *p = NULL;
  size_t n = 0;
  assert_int_equal(sg__lh_member_span(body, len, &p, &n), 1);
  assert_int_equal(n, mlen);
  assert_memory_equal(p, member, mlen);
  assert_ptr_equal(p, body + len - mlen);
  assert_int_equal(sg__lh_member_span(body, len - 1, &p, &n), 0); /* cut */
  body[len] = 0x10; /* a field after the requester (field 2, varint) */
  body[len + 1] = 0x01;
  assert_int_equal(sg__lh_member_span(body, len + 2, &p, &n), 0);
  assert_int_equal(sg__lh_member_span(body, 1, &p, &n), 0);
  assert_int_equal(sg__lh_member_span(body, 0, &p, &n), 0);
  static const uint8_t not_field1[] = {0x12, 0x00};
  assert_int_equal(sg__lh_member_span(not_field1, 2, &p, &n), 0);
  static const uint8_t endless[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0xff,
                                    0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  assert_int_equal(sg__lh_member_span(endless, sizeof(endless), &p, &n), 0);
  static const uint8_t empty[] = {0x0a, 0x00};
  assert_int_equal(sg__lh_member_span(empty, 2, &p, &n), 1);
  assert_int_equal(n, 0);
}

static void test_answer_encoding_matches_protobuf_c(void **state) {
  (void)state;
  Torchft__QuorumMember *r = unpack_with_unknown("rep-a");
  sg__lh_member_t ms[3];
  memset(ms, 0, sizeof(ms));
  /* 0: from a request, with its encoding (unknown fields in it) */
  ms[0].replica_id = r->replica_id;
  assert_int_equal(sg__lh_member_wire(r, &ms[0].wire, &ms[0].wire_len), 0);
  /* 1: fields only, proto3 defaults everywhere */
  ms[1].replica_id = (char *)"rep-b";
  /* 2: fields only, everything set */
  char *handles[] = {(char *)"x", (char *)"yy"};
  ms[2].replica_id = (char *)"rep-c";
  ms[2].address = (char *)"http://c:3";
  ms[2].store_address = (char *)"c:4";
  ms[2].data = (char *)"d";
  ms[2].step = INT64_MAX;
  ms[2].world_size = UINT64_MAX;
  ms[2].shrink_only = 1;
  ms[2].commit_failures = -1;
  ms[2].reconfigure_handles = handles;
  ms[2].n_reconfigure_handles = 2;

  Torchft__QuorumMember pm[3], *pp[3] = {r, &pm[1], &pm[2]};
  for (int i = 1; i < 3; i++) {
    torchft__quorum_member__init(&pm[i]);
    pm[i].replica_id = ms[i].replica_id;
    pm[i].address = ms[i].address ? ms[i].address : (char *)"";
    pm[i].store_address =
        ms[i].store_address ? ms[i].store_address : (char *)"";
    pm[i].data = ms[i].data ? ms[i].data : (char *)"";
    pm[i].step = ms[i].step;
    pm[i].world_size = ms[i].world_size;
    pm[i].shrink_only = ms[i].shrink_only;
    pm[i].commit_failures = ms[i].commit_failures;
    pm[i].n_reconfigure_handles = ms[i].n_reconfigure_handles;
    pm[i].reconfigure_handles = ms[i].reconfigure_handles;
  }
  static const struct {
    int64_t id, wall_ns;
    size_t n;
  } cases[] = {{1, 1700000000123456789, 3},
               {0, 0, 3},
               {INT64_MAX, 999999999, 2},
               {-5, 1000000000, 1},
               {42, 5, 0}};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    sg__lh_quorum_t q = {cases[c].id, cases[c].wall_ns, cases[c].n, ms};
    sg_rpc_blob_t *blob = sg__lh_answer_encode(&q);
    assert_non_null(blob);
    Google__Protobuf__Timestamp ts = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    ts.seconds = cases[c].wall_ns / 1000000000;
    ts.nanos = (int32_t)(cases[c].wall_ns % 1000000000);
    Torchft__Quorum quorum = TORCHFT__QUORUM__INIT;
    quorum.quorum_id = cases[c].id;
    quorum.n_participants = cases[c].n;
    quorum.participants = pp;
    quorum.created = &ts;
    Torchft__LighthouseQuorumResponse resp =
        TORCHFT__LIGHTHOUSE_QUORUM_RESPONSE__INIT;
    resp.quorum = &quorum;
    size_t len = torchft__lighthouse_quorum_response__get_packed_size(&resp);
    uint8_t *want = malloc(len);
    assert_non_null(want);
    torchft__lighthouse_quorum_response__pack(&resp, want);
    assert_int_equal(blob->len, len);
    assert_memory_equal(blob->data, want, len);
    free(want);
    /* and it decodes, the unknown fields still on the first member */
    Torchft__LighthouseQuorumResponse *back =
        torchft__lighthouse_quorum_response__unpack(NULL, blob->len,
                                                    blob->data);
    assert_non_null(back);
    assert_int_equal(back->quorum->n_participants, cases[c].n);
    if (cases[c].n > 0) {
      assert_string_equal(back->quorum->participants[0]->replica_id, "rep-a");
      assert_int_equal(back->quorum->participants[0]->base.n_unknown_fields, 2);
      assert_int_equal(back->quorum->participants[0]->step, -3);
    }
    torchft__lighthouse_quorum_response__free_unpacked(back, NULL);
    sg_rpc_blob_unref(blob);
  }
  sg_free(ms[0].wire);
  torchft__quorum_member__free_unpacked(r, NULL);
}

/* A field this version does not know, sent by one requester, reaches every
 * member of the quorum through the server. */
static void test_unknown_member_fields_reach_peers(void **state) {
  (void)state;
  sg_lh_opts_t o;
  default_opts(&o);
  o.min_replicas = 2;
  sg_lh_server_t *s = start(&o);
  struct req b = {
      .c = connect_to(s, NULL), .id = "plain", .step = 1, .timeout_ms = 10000};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, quorum_thread, &b), 0);

  char target[64];
  snprintf(target, sizeof(target), "http://127.0.0.1:%d", sg_lh_server_port(s));
  sg_rpc_channel_opts_t co = {0};
  co.target = target;
  co.connect_timeout_ms = 10000;
  sg_rpc_channel_t *ch = NULL;
  sg_err_t err;
  assert_int_equal(sg_rpc_channel_new(&co, &ch, &err), 0);
  Torchft__QuorumMember *r = unpack_with_unknown("newer");
  Torchft__LighthouseQuorumRequest req =
      TORCHFT__LIGHTHOUSE_QUORUM_REQUEST__INIT;
  req.requester = r;
  uint8_t buf[512];
  size_t n = torchft__lighthouse_quorum_request__pack(&req, buf);
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  int status = -1;
  assert_int_equal(sg_rpc_channel_call(ch, "/torchft.LighthouseService/Quorum",
                                       buf, n, sg_deadline_in_ms(10000), &resp,
                                       &resp_len, &status, &err),
                   0);
  assert_int_equal(status, 0);
  Torchft__LighthouseQuorumResponse *back =
      torchft__lighthouse_quorum_response__unpack(NULL, resp_len, resp);
  assert_non_null(back);
  assert_int_equal(back->quorum->n_participants, 2);
  const Torchft__QuorumMember *p = back->quorum->participants[0];
  assert_string_equal(p->replica_id, "newer");
  assert_int_equal(p->base.n_unknown_fields, 2);
  assert_int_equal(p->base.unknown_fields[0].tag, 100);
  assert_int_equal(p->base.unknown_fields[1].tag, 101);
  assert_int_equal(p->base.unknown_fields[1].len, 3); /* length + "hi" */
  assert_string_equal(back->quorum->participants[1]->replica_id, "plain");
  assert_int_equal(back->quorum->participants[1]->base.n_unknown_fields, 0);
  torchft__lighthouse_quorum_response__free_unpacked(back, NULL);
  sg_free(resp);

  pthread_join(t, NULL);
  assert_int_equal(b.rc, 0);
  assert_int_equal(b.q.n, 2);
  assert_string_equal(b.q.members[0].replica_id, "newer");
  sg_lh_quorum_free(&b.q);
  sg_lh_client_free(b.c);
  torchft__quorum_member__free_unpacked(r, NULL);
  sg_rpc_channel_free(ch);
  sg_lh_server_stop(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_invalid_options),
      cmocka_unit_test(test_two_replicas_form_quorums_and_ids_grow),
      cmocka_unit_test(test_http_side_reads_while_quorums_change),
      cmocka_unit_test(test_quorum_lines_of_unchanged_id_held_back),
      cmocka_unit_test(test_closed_connection_stops_blocking_quorum),
      cmocka_unit_test(test_auth_token),
      cmocka_unit_test(test_quorum_ids_grow_across_restart),
      cmocka_unit_test(test_cancel_keeps_replica_with_another_call),
      cmocka_unit_test(test_stop_with_calls_in_flight),
      cmocka_unit_test(test_answer_encoding_matches_protobuf_c),
      cmocka_unit_test(test_member_span_of_request),
      cmocka_unit_test(test_unknown_member_fields_reach_peers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
