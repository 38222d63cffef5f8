/*
 * test_manager.c: the manager server and client in one process against our
 * lighthouse, under the sanitizers: quorums of two replica groups of two
 * ranks over several steps, healing a group that is behind, ShouldCommit
 * AND, CheckpointMetadata, Kill, the group step when ranks disagree, a
 * lighthouse that goes away (waiting ranks fail at once) and comes back on
 * the same port (heartbeats and quorums resume), group liveness (a rank's
 * connection closes: the group leaves), a request without grpc-timeout, bad
 * input and stopping with calls in flight.
 */
#include <arpa/inet.h>
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
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <nghttp2/nghttp2.h>

#include "manager/manager_int.h"
#include "stepguard/base.h"
#include "stepguard/lighthouse.h"
#include "stepguard/manager.h"
#include "torchft.pb-c.h"

/* ---- fixtures ------------------------------------------------------------ */

/* the auth token the next lh_start's lighthouse requires (NULL: none) */
static const char *lh_token;

static sg_lh_server_t *lh_start(int port, int64_t min_replicas,
                                int64_t join_timeout_ms,
                                int64_t heartbeat_timeout_ms) {
  char bind[64];
  snprintf(bind, sizeof(bind), "127.0.0.1:%d", port);
  sg_lh_opts_t o;
  sg_lh_opts_init(&o);
  o.auth_token = lh_token;
  o.bind = bind;
  o.hostname = "127.0.0.1";
  o.min_replicas = min_replicas;
  o.join_timeout_ms = join_timeout_ms;
  o.heartbeat_timeout_ms = heartbeat_timeout_ms;
  sg_lh_server_t *s = NULL;
  sg_err_t err;
  sg_err_clear(&err);
  /* a restart on the same port may race the old socket's close briefly */
  for (int i = 0; i < 50; i++) {
    int rc = sg_lh_server_start(&o, &s, &err);
    if (rc == 0)
      return s;
    if (rc != SG_EADDRINUSE)
      break;
    usleep(100 * 1000);
  }
  fail_msg("lighthouse start: %s", err.msg);
  return NULL;
}

struct killed {
  atomic_int n;
  char msg[128];
};

static void on_kill(void *ud, const char *msg) {
  struct killed *k = ud;
  snprintf(k->msg, sizeof(k->msg), "%s", msg);
  atomic_fetch_add(&k->n, 1);
}

typedef struct group_s {
  sg_mgr_server_t *srv;
  sg_mgr_client_t *cl[4];
  int64_t world;
} group_t;

static void group_start_opts(group_t *g, sg_mgr_server_opts_t *o) {
  memset(g, 0, sizeof(*g));
  sg_err_t err;
  sg_err_clear(&err);
  if (sg_mgr_server_start(o, &g->srv, &err) != 0)
    fail_msg("manager start: %s", err.msg);
  g->world = o->world_size;
  for (int64_t r = 0; r < g->world; r++)
    if (sg_mgr_client_new(sg_mgr_server_address(g->srv), 5000, o->auth_token,
                          &g->cl[r], &err) != 0)
      fail_msg("manager client: %s", err.msg);
}

static void base_opts(sg_mgr_server_opts_t *o, const char *id,
                      const char *lh_addr, const char *store) {
  memset(o, 0, sizeof(*o));
  o->replica_id = id;
  o->lighthouse_addr = lh_addr;
  o->hostname = "127.0.0.1";
  o->bind = "127.0.0.1:0";
  o->store_addr = store;
  o->world_size = 2;
  o->heartbeat_interval_ms = 50;
  o->connect_timeout_ms = 2000;
}

static void group_start(group_t *g, const char *id, const char *lh_addr,
                        const char *store) {
  sg_mgr_server_opts_t o;
  base_opts(&o, id, lh_addr, store);
  group_start_opts(g, &o);
}

static void group_stop(group_t *g) {
  for (int64_t r = 0; r < g->world; r++)
    sg_mgr_client_free(g->cl[r]);
  sg_mgr_server_stop(g->srv);
  memset(g, 0, sizeof(*g));
}

/* lh_group_start: a lighthouse of one replica and group "a" of `world`
 * ranks on it, the setup most tests share; lh_group_stop ends both. */
static sg_lh_server_t *lh_group_start(group_t *g, int64_t world) {
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
  o.world_size = world;
  group_start_opts(g, &o);
  return lh;
}

static void lh_group_stop(group_t *g, sg_lh_server_t *lh) {
  group_stop(g);
  sg_lh_server_stop(lh);
}

struct qreq {
  sg_mgr_client_t *c;
  int64_t group_rank, step;
  const char *md;
  int init_sync;
  int64_t commit_failures;
  const char *handle; /* reconfigure_handle */
  int64_t timeout_ms;
  int64_t delay_ms; /* sleep before calling */
  int rc;
  int64_t elapsed_ms;
  sg_mgr_quorum_result_t r;
  sg_err_t err;
  pthread_t t;
};

static void *quorum_thread(void *arg) {
  struct qreq *q = arg;
  if (q->delay_ms)
    usleep((useconds_t)q->delay_ms * 1000);
  int64_t t0 = sg_now_ns();
  q->rc = sg_mgr_client_quorum(
      q->c, q->group_rank, q->step, q->md, 0, q->init_sync, q->commit_failures,
      q->handle, sg_deadline_in_ms(q->timeout_ms), &q->r, &q->err);
  q->elapsed_ms = (sg_now_ns() - t0) / 1000000;
  return NULL;
}

static void q_init(struct qreq *q, group_t *g, int64_t rank, int64_t step) {
  memset(q, 0, sizeof(*q));
  q->c = g->cl[rank];
  q->group_rank = rank;
  q->step = step;
  q->timeout_ms = 10000;
}

static void q_start(struct qreq *q) {
  assert_int_equal(pthread_create(&q->t, NULL, quorum_thread, q), 0);
}

static void q_join(struct qreq *q) { pthread_join(q->t, NULL); }

static void q_free(struct qreq *q, size_t n) {
  for (size_t i = 0; i < n; i++)
    sg_mgr_quorum_result_free(&q[i].r);
}

/* run_round: every rank of every group calls quorum at once with the given
 * steps (steps[group][rank]); q receives groups * 2 results. */
static void run_round(group_t *gs, size_t ng, const int64_t steps[][2],
                      int init_sync, struct qreq *q) {
  for (size_t g = 0; g < ng; g++)
    for (int64_t r = 0; r < 2; r++) {
      struct qreq *x = &q[g * 2 + (size_t)r];
      q_init(x, &gs[g], r, steps[g][r]);
      x->init_sync = init_sync;
      x->md = g == 0 ? (r == 0 ? "md-a-0" : "md-a-1")
                     : (r == 0 ? "md-b-0" : "md-b-1");
      q_start(x);
    }
  for (size_t i = 0; i < ng * 2; i++) {
    q_join(&q[i]);
    if (q[i].rc)
      fail_msg("quorum %zu: %s", i, q[i].err.msg);
  }
}

struct creq {
  sg_mgr_client_t *c;
  int64_t rank;
  int vote, rc, out;
  pthread_t t;
};

static void *commit_thread(void *arg) {
  struct creq *c = arg;
  sg_err_t err;
  c->rc = sg_mgr_client_should_commit(c->c, c->rank, 1, c->vote,
                                      sg_deadline_in_ms(10000), &c->out, &err);
  return NULL;
}

/* commit_round: both ranks of each group vote at once. */
static void commit_round(group_t *gs, size_t ng, const int votes[][2],
                         int out[][2]) {
  struct creq c[8];
  for (size_t g = 0; g < ng; g++)
    for (int r = 0; r < 2; r++) {
      struct creq *x = &c[g * 2 + (size_t)r];
      memset(x, 0, sizeof(*x));
      x->c = gs[g].cl[r];
      x->rank = r;
      x->vote = votes[g][r];
      pthread_create(&x->t, NULL, commit_thread, x);
    }
  for (size_t g = 0; g < ng; g++)
    for (int r = 0; r < 2; r++) {
      struct creq *x = &c[g * 2 + (size_t)r];
      pthread_join(x->t, NULL);
      assert_int_equal(x->rc, 0);
      out[g][r] = x->out;
    }
}

/* ---- raw HTTP/2: a Quorum request without grpc-timeout -------------------
 */

struct raw {
  int fd;
  int done;
  int status;
  char msg[256];
  uint8_t body[64];
  size_t len, off;
};

static ssize_t raw_send(nghttp2_session *s, const uint8_t *d, size_t n,
                        int flags, void *ud) {
  (void)s;
  (void)flags;
  struct raw *r = ud;
  ssize_t w = send(r->fd, d, n, MSG_NOSIGNAL);
  return w < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : w;
}

static int raw_header(nghttp2_session *s, const nghttp2_frame *f,
                      const uint8_t *name, size_t nl, const uint8_t *value,
                      size_t vl, uint8_t flags, void *ud) {
  (void)s;
  (void)f;
  (void)flags;
  struct raw *r = ud;
  if (nl == 11 && memcmp(name, "grpc-status", 11) == 0)
    r->status = atoi((const char *)value);
  if (nl == 12 && memcmp(name, "grpc-message", 12) == 0)
    snprintf(r->msg, sizeof(r->msg), "%.*s", (int)vl, (const char *)value);
  return 0;
}

static int raw_close(nghttp2_session *s, int32_t id, uint32_t code, void *ud) {
  (void)s;
  (void)id;
  (void)code;
  ((struct raw *)ud)->done = 1;
  return 0;
}

static ssize_t raw_read(nghttp2_session *s, int32_t id, uint8_t *buf,
                        size_t len, uint32_t *flags, nghttp2_data_source *src,
                        void *ud) {
  (void)s;
  (void)id;
  (void)src;
  struct raw *r = ud;
  size_t n = r->len - r->off;
  if (n > len)
    n = len;
  memcpy(buf, r->body + r->off, n);
  r->off += n;
  if (r->off == r->len)
    *flags |= NGHTTP2_DATA_FLAG_EOF;
  return (ssize_t)n;
}

#define NV(n, v)                                                               \
  {                                                                            \
    (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, sizeof(v) - 1,              \
        NGHTTP2_NV_FLAG_NONE                                                   \
  }

/* raw_call: the grpc-status of a request to `path` whose message is
 * msg[0..n) (at most 59 bytes), with or without grpc-timeout; *out gets
 * grpc-message. */
static int raw_call(int port, const char *path, int with_timeout,
                    const void *msg, size_t n, char *out, size_t cap) {
  struct raw r = {0};
  r.status = -1;
  assert_true(n + 5 <= sizeof(r.body));
  r.body[4] = (uint8_t)n;
  memcpy(r.body + 5, msg, n);
  r.len = n + 5;
  r.fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(r.fd, (struct sockaddr *)&a, sizeof(a)), 0);
  nghttp2_session_callbacks *cb;
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_send_callback(cb, raw_send);
  nghttp2_session_callbacks_set_on_header_callback(cb, raw_header);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, raw_close);
  nghttp2_session *s;
  nghttp2_session_client_new(&s, cb, &r);
  nghttp2_session_callbacks_del(cb);
  nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, NULL, 0);
  nghttp2_nv hdrs[] = {
      NV(":method", "POST"),
      NV(":scheme", "http"),
      NV(":path", "/"),
      NV(":authority", "127.0.0.1"),
      NV("content-type", "application/grpc"),
      NV("te", "trailers"),
      NV("grpc-timeout", "5S"),
  };
  hdrs[2].value = (uint8_t *)path;
  hdrs[2].valuelen = strlen(path);
  nghttp2_data_provider dp = {.read_callback = raw_read};
  assert_true(nghttp2_submit_request(s, NULL, hdrs, with_timeout ? 7 : 6, &dp,
                                     NULL) > 0);
  int64_t end = sg_now_ns() + 5000000000LL;
  while (!r.done && sg_now_ns() < end) {
    assert_int_equal(nghttp2_session_send(s), 0);
    struct pollfd p = {r.fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0)
      continue;
    uint8_t buf[4096];
    ssize_t got = recv(r.fd, buf, sizeof(buf), 0);
    if (got <= 0)
      break;
    assert_true(nghttp2_session_mem_recv(s, buf, (size_t)got) >= 0);
  }
  nghttp2_session_del(s);
  close(r.fd);
  snprintf(out, cap, "%s", r.msg);
  return r.status;
}

/* http_get: the body of GET `path` from 127.0.0.1:port (sg_malloc'd). */
static char *http_get(int port, const char *path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  char req[256];
  int n =
      snprintf(req, sizeof(req),
               "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
  assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
  size_t cap = 1 << 16, len = 0;
  char *out = sg_malloc(cap);
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0)
      break;
    ssize_t k = recv(fd, out + len, cap - 1 - len, 0);
    if (k <= 0)
      break;
    len += (size_t)k;
  }
  out[len] = '\0';
  close(fd);
  return out;
}

/* heartbeating: /status shows `id` healthy and connected. */
static int heartbeating(int port, const char *id) {
  char *s = http_get(port, "/status");
  char key[128];
  snprintf(key, sizeof(key), "{\"replica_id\":\"%s\",", id);
  const char *h = strstr(s, "\"heartbeats\":[");
  const char *p = h ? strstr(h, key) : NULL;
  int ok = 0;
  if (p) {
    const char *e = strchr(p, '}');
    const char *x = strstr(p, "\"expired\":false");
    const char *c = strstr(p, "\"connected\":true");
    ok = e && x && c && x < e && c < e;
  }
  sg_free(s);
  return ok;
}

/* wait_heartbeating: waits (30 s at most) until the lighthouse on `port`
 * holds `id` healthy, so that the next quorum waits for it: a fixed sleep
 * was not always long enough for a manager's first heartbeat under a
 * sanitizer on a busy host. */
static void wait_heartbeating(int port, const char *id) {
  sg_deadline_t d = sg_deadline_in_ms(30000);
  while (!heartbeating(port, id)) {
    if (sg_deadline_passed(d))
      fail_msg("%s never heartbeated", id);
    usleep(10 * 1000);
  }
}

/* ---- tests --------------------------------------------------------------- */

static void test_invalid_options(void **state) {
  (void)state;
  sg_mgr_server_opts_t o;
  sg_mgr_server_t *s = NULL;
  sg_err_t err;
  base_opts(&o, "a", "http://127.0.0.1:1", "st:1");
  o.world_size = 0;
  assert_int_equal(sg_mgr_server_start(&o, &s, &err), SG_EINVAL);
  o.world_size = SG_MGR_MAX_WORLD_SIZE + 1;
  assert_int_equal(sg_mgr_server_start(&o, &s, &err), SG_EINVAL);
  o.world_size = 2;
  o.replica_id = "";
  assert_int_equal(sg_mgr_server_start(&o, &s, &err), SG_EINVAL);
  o.replica_id = "a";
  o.lighthouse_addr = NULL;
  assert_int_equal(sg_mgr_server_start(&o, &s, &err), SG_EINVAL);
  /* an unreachable lighthouse fails the start within connect_timeout */
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  char addr[64];
  snprintf(addr, sizeof(addr), "http://127.0.0.1:%d", sg_lh_server_port(lh));
  sg_lh_server_stop(lh);
  o.lighthouse_addr = addr;
  o.connect_timeout_ms = 300;
  int64_t t0 = sg_now_ns();
  assert_true(sg_mgr_server_start(&o, &s, &err) < 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 3000);
  assert_null(s);
}

static void test_two_groups_quorum_commit_metadata(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 2, 100, 5000);
  group_t gs[2];
  group_start(&gs[0], "a:uuid1", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b:uuid2", sg_lh_server_address(lh), "storeB:1");
  const char *addr_a = sg_mgr_server_address(gs[0].srv);
  const char *addr_b = sg_mgr_server_address(gs[1].srv);
  assert_non_null(strstr(addr_a, "http://127.0.0.1:"));
  struct qreq q[4];
  int64_t last_id = -1;

  /* init_sync at step 0, first: a quorum behind the step the job reached
   * would wait for a replica that holds it (the lighthouse's step floor) */
  const int64_t zero[2][2] = {{0, 0}, {0, 0}};
  run_round(gs, 2, zero, 1, q);
  assert_false(q[0].r.heal); /* a, rank 0: a is rank 0's primary */
  assert_true(q[1].r.heal);  /* a, rank 1: b is rank 1's primary */
  assert_true(q[2].r.heal);  /* b, rank 0 */
  assert_false(q[3].r.heal); /* b, rank 1 */
  q_free(q, 4);

  /* several steps in lock step: nobody heals */
  for (int64_t step = 0; step < 3; step++) {
    const int64_t steps[2][2] = {{step, step}, {step, step}};
    run_round(gs, 2, steps, 0, q);
    for (int i = 0; i < 4; i++) {
      const sg_mgr_quorum_result_t *r = &q[i].r;
      assert_int_equal(r->quorum_id, q[0].r.quorum_id);
      assert_int_equal(r->replica_rank, i / 2);
      assert_int_equal(r->replica_world_size, 2);
      assert_int_equal(r->max_step, step);
      assert_int_equal(r->max_world_size, 2);
      assert_false(r->heal);
      assert_true(r->has_max_replica_rank);
      assert_int_equal(r->max_replica_rank, i / 2);
      assert_int_equal(r->n_replica_ids, 2);
      assert_string_equal(r->replica_ids[0], "a:uuid1");
      assert_string_equal(r->replica_ids[1], "b:uuid2");
      assert_int_equal(r->n_up_to_date_manager_addresses, 2);
      assert_string_equal(r->up_to_date_manager_addresses[0], addr_a);
      assert_string_equal(r->up_to_date_manager_addresses[1], addr_b);
      /* primary = M[group_rank % |M|] */
      assert_string_equal(r->store_address,
                          i % 2 == 0 ? "storeA:1" : "storeB:1");
    }
    assert_true(q[0].r.quorum_id >= last_id);
    last_id = q[0].r.quorum_id;
    q_free(q, 4);
  }

  /* group b is behind: it heals from a; a sends to it */
  const int64_t behind[2][2] = {{5, 5}, {2, 2}};
  run_round(gs, 2, behind, 0, q);
  for (int i = 0; i < 4; i++) {
    const sg_mgr_quorum_result_t *r = &q[i].r;
    assert_int_equal(r->max_step, 5);
    assert_int_equal(r->max_world_size, 1);
    assert_int_equal(r->n_up_to_date_manager_addresses, 1);
    assert_string_equal(r->up_to_date_manager_addresses[0], addr_a);
    assert_string_equal(r->store_address, "storeA:1");
  }
  for (int i = 0; i < 2; i++) { /* group a, ranks 0 and 1 */
    assert_false(q[i].r.heal);
    assert_int_equal(q[i].r.n_recover_dst_replica_ranks, 1);
    assert_int_equal(q[i].r.recover_dst_replica_ranks[0], 1);
    assert_string_equal(q[i].r.recover_src_manager_address, "");
  }
  for (int i = 2; i < 4; i++) { /* group b */
    assert_true(q[i].r.heal);
    assert_true(q[i].r.has_recover_src_replica_rank);
    assert_int_equal(q[i].r.recover_src_replica_rank, 0);
    assert_string_equal(q[i].r.recover_src_manager_address, addr_a);
    assert_false(q[i].r.has_max_replica_rank);
    assert_int_equal(q[i].r.n_recover_dst_replica_ranks, 0);
  }
  q_free(q, 4);

  /* ShouldCommit: AND within a group, independent across groups, reset */
  int out[2][2];
  const int votes1[2][2] = {{1, 0}, {1, 1}};
  commit_round(gs, 2, votes1, out);
  assert_false(out[0][0]);
  assert_false(out[0][1]);
  assert_true(out[1][0]);
  assert_true(out[1][1]);
  const int votes2[2][2] = {{1, 1}, {0, 0}};
  commit_round(gs, 2, votes2, out);
  assert_true(out[0][0]);
  assert_true(out[0][1]);
  assert_false(out[1][0]);
  assert_false(out[1][1]);

  /* CheckpointMetadata per rank, from the last quorum call */
  char *md = NULL;
  sg_err_t err;
  assert_int_equal(sg_mgr_client_checkpoint_metadata(
                       gs[1].cl[0], 1, sg_deadline_in_ms(5000), &md, &err),
                   0);
  assert_string_equal(md, "md-b-1");
  sg_free(md);
  assert_int_equal(sg_mgr_client_checkpoint_metadata(
                       gs[0].cl[1], 0, sg_deadline_in_ms(5000), &md, &err),
                   0);
  assert_string_equal(md, "md-a-0");
  sg_free(md);
  assert_int_equal(sg_mgr_client_checkpoint_metadata(
                       gs[0].cl[0], 2, sg_deadline_in_ms(5000), &md, &err),
                   SG_EINVAL);
  assert_non_null(strstr(err.msg, "rank not found"));
  assert_null(md);

  group_stop(&gs[0]);
  group_stop(&gs[1]);
  sg_lh_server_stop(lh);
}

/* Each group rank's reconfigure handle reaches the same group rank of every
 * replica, in replica_ids order; a round without handles sends none. */
static void test_reconfigure_handles(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 2, 100, 5000);
  group_t gs[2];
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b", sg_lh_server_address(lh), "storeB:1");
  static const char *handles[4] = {"Ha0", "Ha1", "Hb0", "Hb1"};
  struct qreq q[4];
  for (size_t i = 0; i < 4; i++) {
    q_init(&q[i], &gs[i / 2], (int64_t)(i % 2), 1);
    q[i].handle = handles[i];
    q_start(&q[i]);
  }
  for (size_t i = 0; i < 4; i++) {
    q_join(&q[i]);
    if (q[i].rc)
      fail_msg("quorum %zu: %s", i, q[i].err.msg);
    const sg_mgr_quorum_result_t *r = &q[i].r;
    assert_int_equal(r->n_reconfigure_handles, 2);
    assert_string_equal(r->reconfigure_handles[0], handles[i % 2]);
    assert_string_equal(r->reconfigure_handles[1], handles[2 + i % 2]);
  }
  q_free(q, 4);
  const int64_t steps[2][2] = {{2, 2}, {2, 2}};
  run_round(gs, 2, steps, 0, q);
  for (size_t i = 0; i < 4; i++)
    assert_int_equal(q[i].r.n_reconfigure_handles, 0);
  q_free(q, 4);
  group_stop(&gs[0]);
  group_stop(&gs[1]);
  sg_lh_server_stop(lh);
}

/* STEPGUARD_ADVERTISE_HOST overrides the hostname option; an interface
 * name advertises that interface's address. */
static void test_advertised_host(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  const char *cases[][2] = {
      {"lo", "http://127.0.0.1:"},
      {"recovery-net.example", "http://recovery-net.example:"},
      {NULL, "http://127.0.0.1:"}, /* unset: the option */
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    if (cases[i][0])
      setenv("STEPGUARD_ADVERTISE_HOST", cases[i][0], 1);
    else
      unsetenv("STEPGUARD_ADVERTISE_HOST");
    sg_mgr_server_opts_t o;
    base_opts(&o, "adv", sg_lh_server_address(lh), "st:1");
    sg_mgr_server_t *srv = NULL;
    sg_err_t err;
    int rc = sg_mgr_server_start(&o, &srv, &err);
    unsetenv("STEPGUARD_ADVERTISE_HOST");
    if (rc != 0)
      fail_msg("manager start: %s", err.msg);
    char addr[512];
    snprintf(addr, sizeof(addr), "%s", sg_mgr_server_address(srv));
    sg_mgr_server_stop(srv);
    if (strncmp(addr, cases[i][1], strlen(cases[i][1])) != 0)
      fail_msg("%s: advertised %s, want %s...", cases[i][0] ? cases[i][0] : "-",
               addr, cases[i][1]);
  }
  unsetenv("STEPGUARD_ADVERTISE_HOST");
  sg_lh_server_stop(lh);
}

static void test_metadata_of_silent_rank_not_found(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  char *md = NULL;
  sg_err_t err;
  assert_int_equal(sg_mgr_client_checkpoint_metadata(
                       g.cl[0], 0, sg_deadline_in_ms(5000), &md, &err),
                   SG_EINVAL);
  assert_non_null(strstr(err.msg, "rank not found"));
  lh_group_stop(&g, lh);
}

static void test_step_disagreement_uses_minimum(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 2, 100, 5000);
  group_t gs[2];
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b", sg_lh_server_address(lh), "storeB:1");
  /* group a: rank 1 at step 4 first, then rank 0 at step 7 arrives last
   * (torchft would report the last-arriving 7 and b would heal) */
  struct qreq q[4];
  q_init(&q[0], &gs[0], 0, 7);
  q[0].delay_ms = 300;
  q_init(&q[1], &gs[0], 1, 4);
  q_init(&q[2], &gs[1], 0, 4);
  q_init(&q[3], &gs[1], 1, 4);
  q[0].commit_failures = 3; /* forwarded as the max over ranks */
  for (int i = 0; i < 4; i++)
    q_start(&q[i]);
  for (int i = 0; i < 4; i++) {
    q_join(&q[i]);
    if (q[i].rc)
      fail_msg("quorum %d: %s", i, q[i].err.msg);
  }
  for (int i = 0; i < 4; i++) {
    assert_int_equal(q[i].r.max_step, 4);
    assert_false(q[i].r.heal);
    assert_int_equal(q[i].r.max_world_size, 2);
    assert_int_equal(q[i].r.commit_failures, 3);
  }
  q_free(q, 4);
  group_stop(&gs[0]);
  group_stop(&gs[1]);
  sg_lh_server_stop(lh);
}

static void test_kill_calls_handler(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  struct killed k = {0};
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
  o.kill = on_kill;
  o.kill_ud = &k;
  group_t g;
  group_start_opts(&g, &o);
  sg_err_t err;
  assert_int_equal(
      sg_mgr_client_kill(g.cl[0], "bye now", sg_deadline_in_ms(5000), &err), 0);
  for (int i = 0; i < 200 && atomic_load(&k.n) == 0; i++)
    usleep(10 * 1000);
  assert_int_equal(atomic_load(&k.n), 1);
  assert_string_equal(k.msg, "bye now");
  lh_group_stop(&g, lh);
}

static void test_bad_requests(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  sg_mgr_quorum_result_t r;
  int out = 0;
  assert_int_equal(sg_mgr_client_quorum(g.cl[0], 2, 0, "", 0, 0, 0, NULL,
                                        sg_deadline_in_ms(5000), &r, &err),
                   SG_EINVAL);
  assert_non_null(strstr(err.msg, "out of range"));
  assert_int_equal(sg_mgr_client_quorum(g.cl[0], -1, 0, "", 0, 0, 0, NULL,
                                        sg_deadline_in_ms(5000), &r, &err),
                   SG_EINVAL);
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[0], 7, 0, 1, sg_deadline_in_ms(5000), &out, &err),
                   SG_EINVAL);
  /* metadata over the limit */
  size_t big = SG_MGR_MAX_METADATA_LEN + 1;
  char *md = sg_malloc(big + 1);
  memset(md, 'x', big);
  md[big] = '\0';
  assert_int_equal(sg_mgr_client_quorum(g.cl[0], 0, 0, md, 0, 0, 0, NULL,
                                        sg_deadline_in_ms(5000), &r, &err),
                   SG_EINVAL);
  sg_free(md);
  /* no grpc-timeout: INVALID_ARGUMENT "missing timeout" */
  char msg[256];
  int port = sg_mgr_server_port(g.srv);
  const char *qpath = "/torchft.ManagerService/Quorum";
  assert_int_equal(raw_call(port, qpath, 0, "", 0, msg, sizeof(msg)), 3);
  assert_string_equal(msg, "missing timeout");
  /* malformed protobuf, and a string that is not UTF-8 */
  static const uint8_t garbage[] = {0x0a, 0xff, 0xff, 0xff};
  assert_int_equal(
      raw_call(port, qpath, 1, garbage, sizeof(garbage), msg, sizeof(msg)), 3);
  static const uint8_t bad_utf8[] = {0x1a, 0x02, 0xc3, 0x28}; /* field 3 */
  assert_int_equal(
      raw_call(port, qpath, 1, bad_utf8, sizeof(bad_utf8), msg, sizeof(msg)),
      3);
  assert_non_null(strstr(msg, "UTF-8"));
  static const uint8_t nul[] = {0x1a, 0x02, 'a', 0x00};
  assert_int_equal(raw_call(port, qpath, 1, nul, sizeof(nul), msg, sizeof(msg)),
                   3);
  static const uint8_t bad_kill[] = {0x0a, 0x01, 0xff};
  assert_int_equal(raw_call(port, "/torchft.ManagerService/Kill", 1, bad_kill,
                            sizeof(bad_kill), msg, sizeof(msg)),
                   3);
  assert_int_equal(raw_call(port, "/torchft.ManagerService/Nope", 1, "", 0, msg,
                            sizeof(msg)),
                   12);
  assert_int_equal(raw_call(port, "/torchft.ManagerService/ShouldCommit", 1,
                            garbage, sizeof(garbage), msg, sizeof(msg)),
                   3);
  /* the server still serves */
  assert_int_equal(
      sg_mgr_client_kill(g.cl[1], NULL, sg_deadline_in_ms(5000), &err), 0);
  lh_group_stop(&g, lh);
}

static void test_auth_token_required(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
  o.world_size = 1;
  o.auth_token = "s3cret"; /* the lighthouse has none: it ignores it */
  group_t g;
  group_start_opts(&g, &o);
  sg_mgr_client_t *anon = NULL;
  sg_err_t err;
  assert_int_equal(
      sg_mgr_client_new(sg_mgr_server_address(g.srv), 5000, NULL, &anon, &err),
      0);
  int out = 0;
  assert_int_equal(sg_mgr_client_should_commit(
                       anon, 0, 0, 1, sg_deadline_in_ms(5000), &out, &err),
                   SG_EAUTH);
  sg_mgr_client_free(anon);
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[0], 0, 0, 1, sg_deadline_in_ms(5000), &out, &err),
                   0);
  assert_true(out);
  lh_group_stop(&g, lh);
}

/* A manager reports the highest step of its last quorum with its requests
 * (field 102): a restarted lighthouse without an id file learns the step
 * the job reached from it and holds a quorum of replicas behind it until
 * one that holds it is back. */
static void test_restarted_lighthouse_learns_the_step_floor(void **state) {
  (void)state;
  /* min_replicas 2: a alone (asking first) would be a quorum, and b then
   * held for the floor while a heartbeats without asking again */
  sg_lh_server_t *lh = lh_start(0, 2, 100, 500);
  int port = sg_lh_server_port(lh);
  char lh_addr[64];
  snprintf(lh_addr, sizeof(lh_addr), "http://127.0.0.1:%d", port);
  group_t gs[2];
  group_start(&gs[0], "a", lh_addr, "storeA:1");
  group_start(&gs[1], "b", lh_addr, "storeB:1");
  struct qreq q[4];
  const int64_t steps[2][2] = {{10, 10}, {0, 0}}; /* b heals from a */
  run_round(gs, 2, steps, 0, q);
  assert_int_equal(q[2].r.max_step, 10);
  q_free(q, 4);
  /* a dies, and the lighthouse restarts without an id file */
  group_stop(&gs[0]);
  sg_lh_server_stop(lh);
  lh = lh_start(port, 1, 100, 500);
  for (int r = 0; r < 2; r++) {
    q_init(&q[r], &gs[1], r, 0);
    q[r].timeout_ms = 3000;
    q_start(&q[r]);
  }
  for (int r = 0; r < 2; r++) {
    q_join(&q[r]);
    assert_true(q[r].rc < 0); /* held: b alone would start over */
  }
  q_free(q, 2);
  /* c holds step 10: b heals from it */
  group_t c;
  group_start(&c, "c", lh_addr, "storeC:1");
  group_t both[2] = {gs[1], c};
  const int64_t steps2[2][2] = {{0, 0}, {10, 10}};
  run_round(both, 2, steps2, 0, q);
  for (int i = 0; i < 4; i++)
    assert_int_equal(q[i].r.max_step, 10);
  assert_true(q[0].r.heal);
  assert_false(q[2].r.heal);
  q_free(q, 4);
  group_stop(&c);
  group_stop(&gs[1]);
  sg_lh_server_stop(lh);
}

static void test_lighthouse_down_then_back(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 1000);
  int port = sg_lh_server_port(lh);
  char lh_addr[64];
  snprintf(lh_addr, sizeof(lh_addr), "http://127.0.0.1:%d", port);
  group_t g;
  group_start(&g, "a", lh_addr, "st:1");
  struct qreq q[2];
  const int64_t steps[1][2] = {{1, 1}};
  run_round(&g, 1, steps, 0, q);
  assert_int_equal(q[0].r.replica_world_size, 1);
  q_free(q, 2);

  /* the lighthouse goes away: a round is an outage, retried until its
   * deadline; both waiting ranks then fail at once with "lighthouse
   * unreachable" (UNAVAILABLE), which the Python Manager retries */
  sg_lh_server_stop(lh);
  for (int r = 0; r < 2; r++) {
    q_init(&q[r], &g, r, 2);
    q[r].timeout_ms = 1500;
    q_start(&q[r]);
  }
  for (int r = 0; r < 2; r++) {
    q_join(&q[r]);
    assert_true(q[r].rc < 0);
    assert_true(q[r].elapsed_ms >= 1000 && q[r].elapsed_ms < 10000);
    assert_non_null(strstr(q[r].err.msg, "lighthouse unreachable"));
  }
  assert_int_equal(q[0].rc, q[1].rc);
  q_free(q, 2);

  /* a round asked while it is down waits: it comes back on the same port
   * 1 s later and the round gets its quorum, ids above the last one */
  int64_t qid_before = 0;
  {
    struct qreq w[2];
    for (int r = 0; r < 2; r++) {
      q_init(&w[r], &g, r, 3);
      w[r].timeout_ms = 30000;
      q_start(&w[r]);
    }
    usleep(1000 * 1000);
    lh = lh_start(port, 1, 100, 1000);
    for (int r = 0; r < 2; r++) {
      q_join(&w[r]);
      assert_int_equal(w[r].rc, 0);
      assert_true(w[r].elapsed_ms < 20000);
      assert_int_equal(w[r].r.max_step, 3);
    }
    qid_before = w[0].r.quorum_id;
    q_free(w, 2);
  }
  assert_true(qid_before > 0);
  int ok = 0;
  for (int i = 0; i < 100 && !ok; i++) {
    usleep(50 * 1000);
    ok = heartbeating(port, "a");
  }
  assert_true(ok);
  const int64_t steps2[1][2] = {{4, 4}};
  run_round(&g, 1, steps2, 0, q);
  assert_int_equal(q[0].r.max_step, 4);
  assert_int_equal(q[1].r.quorum_id, q[0].r.quorum_id);
  q_free(q, 2);
  /* heartbeats keep it healthy past the heartbeat timeout */
  usleep(1500 * 1000);
  assert_true(heartbeating(port, "a"));
  lh_group_stop(&g, lh);
}

/* A lighthouse that answers with an error (here UNAUTHENTICATED: it wants
 * a token the manager lacks) is retried by torchft's rule: quorum_retries
 * more attempts, each after a sleep of timeout / (retries + 1). */
static void test_quorum_retries(void **state) {
  (void)state;
  lh_token = "not-the-managers";
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  lh_token = NULL;
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
  o.world_size = 1;
  o.quorum_retries = 2;
  o.connect_timeout_ms = 300;
  group_t g;
  group_start_opts(&g, &o);
  struct qreq q;
  q_init(&q, &g, 0, 0);
  /* 3 answered attempts and 2 sleeps of 6000 / 3 ms: about 4 s, within
   * the call's 6 s even on a slow (sanitized, loaded) build */
  q.timeout_ms = 6000;
  q_start(&q);
  q_join(&q);
  assert_true(q.rc < 0);
  assert_non_null(strstr(q.err.msg, "after 2 retries"));
  assert_true(q.elapsed_ms >= 3500);
  lh_group_stop(&g, lh);
}

/* group_on_port: a group of one rank on the lighthouse at
 * 127.0.0.1:`port` (so that a test can put another server there), with
 * `retries` quorum retries and a 300 ms connect timeout. */
static void group_on_port(group_t *g, int port, int64_t retries) {
  char lh_addr[64];
  snprintf(lh_addr, sizeof(lh_addr), "http://127.0.0.1:%d", port);
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", lh_addr, "st:1");
  o.world_size = 1;
  o.quorum_retries = retries;
  o.connect_timeout_ms = 300;
  group_start_opts(g, &o);
}

/* A lighthouse that accepts connections and never answers fails each
 * attempt at the connect timeout, long before the attempt's deadline: an
 * outage (torchft counts it as an RPC error, tonic's transport error, and
 * gives up after quorum_retries); the round retries it until its own
 * deadline and fails then with "lighthouse unreachable". */
static void test_silent_lighthouse_is_an_outage(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  int port = sg_lh_server_port(lh);
  group_t g;
  group_on_port(&g, port, 2);
  sg_lh_server_stop(lh);
  /* the kernel completes the TCP handshakes; nobody sends SETTINGS */
  int fd = -1, bound = 0;
  sg_err_t e;
  assert_int_equal(sg_sock_listen("127.0.0.1", port, 16, &fd, &bound, &e), 0);
  struct qreq q;
  q_init(&q, &g, 0, 0);
  /* with 2 quorum retries torchft's rule would end after 3 attempts of
   * 300 ms and 2 sleeps of 1000 ms: the outage lasts the round's 3 s */
  q.timeout_ms = 3000;
  int64_t t0 = sg_now_ns();
  q_start(&q);
  q_join(&q);
  int64_t el = (sg_now_ns() - t0) / 1000000;
  assert_true(q.rc < 0);
  assert_non_null(strstr(q.err.msg, "lighthouse unreachable"));
  if (el < 2500 || el > 15000) /* answered 250 ms before the deadline */
    fail_msg("failed after %lld ms: %s", (long long)el, q.err.msg);
  sg_sock_close(fd);
  group_stop(&g);
}

/* A quorum attempt made just as the lighthouse goes (queued while the
 * manager's channel still counts the connection up, or after it saw the
 * close) is an outage: retried until the round's deadline, then
 * "lighthouse unreachable". */
static void test_quorum_outage_ends_at_round_deadline(void **state) {
  (void)state;
  for (int seen = 0; seen < 2; seen++) {
    sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
    sg_mgr_server_opts_t o;
    base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
    o.world_size = 1;
    o.connect_timeout_ms = 300;
    group_t g;
    group_start_opts(&g, &o);
    sg_lh_server_stop(lh);
    if (seen)
      usleep(500 * 1000);
    struct qreq q;
    q_init(&q, &g, 0, 0);
    q.timeout_ms = 1500;
    int64_t t0 = sg_now_ns();
    q_start(&q);
    q_join(&q);
    int64_t el = (sg_now_ns() - t0) / 1000000;
    assert_true(q.rc < 0);
    assert_non_null(strstr(q.err.msg, "lighthouse unreachable"));
    if (el < 1000 || el >= 10000)
      fail_msg("seen=%d: failed after %lld ms: %s", seen, (long long)el,
               q.err.msg);
    group_stop(&g);
  }
}

/* A round's first lighthouse attempt is asynchronous while the connection
 * is up; when it fails (here the lighthouse dies under it: an outage), the
 * quorum thread retries the same round with backoff and the call succeeds
 * once a lighthouse is back. */
static void test_async_attempt_fails_then_retry_succeeds(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  int port = sg_lh_server_port(lh);
  group_t g;
  group_on_port(&g, port, 3);
  struct qreq q;
  q_init(&q, &g, 0, 4);
  q_start(&q);
  q_join(&q);
  assert_int_equal(q.rc, 0);
  q_free(&q, 1);

  /* min_replicas 2: the next attempt waits at the lighthouse, which dies */
  sg_lh_server_stop(lh);
  lh = lh_start(port, 2, 60000, 5000);
  for (int i = 0; i < 100 && !heartbeating(port, "a"); i++)
    usleep(20 * 1000);
  q_init(&q, &g, 0, 5);
  q.timeout_ms = 8000;
  int64_t t0 = sg_now_ns();
  q_start(&q);
  usleep(300 * 1000);
  sg_lh_server_stop(lh);
  lh = lh_start(port, 1, 100, 5000);
  q_join(&q);
  int64_t el = (sg_now_ns() - t0) / 1000000;
  assert_int_equal(q.rc, 0);
  assert_int_equal(q.r.max_step, 5);
  assert_int_equal(q.r.replica_world_size, 1);
  assert_true(el >= 250 && el < 7000); /* after the restart, in the round */
  q_free(&q, 1);
  lh_group_stop(&g, lh);
}

static void test_group_leaves_when_rank_disconnects(void **state) {
  (void)state;
  /* long heartbeat and join timeouts: only connection liveness can make
   * the lighthouse drop group a within the test's bound */
  sg_lh_server_t *lh = lh_start(0, 1, 600000, 60000);
  group_t gs[2];
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b", sg_lh_server_address(lh), "storeB:1");
  /* both heartbeat: the first quorum waits for both */
  wait_heartbeating(sg_lh_server_port(lh), "a");
  wait_heartbeating(sg_lh_server_port(lh), "b");
  struct qreq q[4];
  const int64_t steps[2][2] = {{1, 1}, {1, 1}};
  run_round(gs, 2, steps, 0, q);
  assert_int_equal(q[0].r.replica_world_size, 2);
  q_free(q, 4);

  /* a's rank 0 waits for the next quorum; a's rank 1 dies */
  q_init(&q[0], &gs[0], 0, 2);
  q[0].timeout_ms = 30000;
  q_start(&q[0]);
  usleep(100 * 1000);
  sg_mgr_client_free(gs[0].cl[1]);
  gs[0].cl[1] = NULL;
  q_join(&q[0]);
  assert_int_equal(q[0].rc, SG_ECONNREFUSED); /* UNAVAILABLE */
  assert_non_null(strstr(q[0].err.msg, "left"));
  assert_true(q[0].elapsed_ms < 5000);
  assert_true(sg_mgr_server_has_left(gs[0].srv));

  /* b's next quorum no longer includes a */
  q_init(&q[2], &gs[1], 0, 2);
  q_init(&q[3], &gs[1], 1, 2);
  q_start(&q[2]);
  q_start(&q[3]);
  q_join(&q[2]);
  q_join(&q[3]);
  assert_int_equal(q[2].rc, 0);
  assert_int_equal(q[3].rc, 0);
  assert_true(q[2].elapsed_ms < 10000);
  assert_int_equal(q[2].r.replica_world_size, 1);
  assert_string_equal(q[2].r.replica_ids[0], "b");
  q_free(q, 4);

  /* a answers every later call with UNAVAILABLE */
  sg_mgr_quorum_result_t r;
  sg_err_t err;
  assert_int_equal(sg_mgr_client_quorum(gs[0].cl[0], 0, 3, "", 0, 0, 0, NULL,
                                        sg_deadline_in_ms(5000), &r, &err),
                   SG_ECONNREFUSED);
  int out = 1;
  assert_int_equal(sg_mgr_client_should_commit(gs[0].cl[0], 0, 3, 1,
                                               sg_deadline_in_ms(5000), &out,
                                               &err),
                   SG_ECONNREFUSED);
  group_stop(&gs[0]);
  group_stop(&gs[1]);
  sg_lh_server_stop(lh);
}

static void test_reconnect_within_grace_keeps_group(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", sg_lh_server_address(lh), "st:1");
  o.disconnect_grace_ms = 2000;
  group_t g;
  group_start_opts(&g, &o);
  struct qreq q[2];
  const int64_t steps[1][2] = {{1, 1}};
  run_round(&g, 1, steps, 0, q);
  q_free(q, 2);
  /* rank 1 reconnects (a new client) within the grace */
  sg_mgr_client_free(g.cl[1]);
  sg_err_t err;
  assert_int_equal(sg_mgr_client_new(sg_mgr_server_address(g.srv), 5000, NULL,
                                     &g.cl[1], &err),
                   0);
  const int64_t steps2[1][2] = {{2, 2}};
  run_round(&g, 1, steps2, 0, q);
  q_free(q, 2);
  usleep(2500 * 1000);
  assert_false(sg_mgr_server_has_left(g.srv));
  lh_group_stop(&g, lh);
}

/* wait_quorum_idle: until the server counts no Quorum call as arrived and
 * has no round under way: a client's cancel travels to the server on its
 * own, so a test that needs it seen waits for it (10 s at most). */
static void wait_quorum_idle(sg_mgr_server_t *s) {
  sg_deadline_t until = sg_deadline_in_ms(10000);
  while (!sg__mgr_quorum_idle(s)) {
    if (sg_deadline_passed(until))
      fail_msg("the server still counts a cancelled Quorum call after 10 s");
    usleep(5 * 1000);
  }
}

static void test_cancelled_call_no_longer_counts(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  /* rank 0 gives up before rank 1 arrives: rank 1 alone starts no round */
  struct qreq q[2];
  q_init(&q[0], &g, 0, 1);
  q[0].timeout_ms = 200;
  q_start(&q[0]);
  q_join(&q[0]);
  assert_int_equal(q[0].rc, SG_ETIMEDOUT);
  wait_quorum_idle(g.srv); /* the cancel reached the server */
  q_init(&q[1], &g, 1, 1);
  q[1].timeout_ms = 600;
  q_start(&q[1]);
  q_join(&q[1]);
  assert_int_equal(q[1].rc, SG_ETIMEDOUT);
  /* both together still work, once rank 1's cancel is in too (before it,
   * a new rank 0 call would start a round with the stale rank 1 call and
   * take its answer, leaving the new rank 1 call alone) */
  wait_quorum_idle(g.srv);
  const int64_t steps[1][2] = {{1, 1}};
  run_round(&g, 1, steps, 0, q);
  assert_int_equal(q[0].r.replica_world_size, 1);
  q_free(q, 2);
  lh_group_stop(&g, lh);
}

static void test_lighthouse_stops_during_round(void **state) {
  (void)state;
  /* min_replicas 2 and one group: the lighthouse call waits */
  sg_lh_server_t *lh = lh_start(0, 2, 100, 5000);
  group_t g;
  group_start(&g, "a", sg_lh_server_address(lh), "st:1");
  struct qreq q[2];
  for (int r = 0; r < 2; r++) {
    q_init(&q[r], &g, r, 1);
    q[r].timeout_ms = 30000;
    q_start(&q[r]);
  }
  usleep(300 * 1000);
  int64_t t0 = sg_now_ns();
  int port = sg_lh_server_port(lh);
  sg_lh_server_stop(lh);
  /* an outage: the round is retried within its 30 s; a lighthouse back on
   * the same port 1 s later (min_replicas 1 now) answers both ranks */
  usleep(1000 * 1000);
  lh = lh_start(port, 1, 100, 5000);
  for (int r = 0; r < 2; r++) {
    q_join(&q[r]);
    assert_int_equal(q[r].rc, 0);
    assert_int_equal(q[r].r.replica_world_size, 1);
  }
  assert_true((sg_now_ns() - t0) / 1000000 < 20000);
  q_free(q, 2);
  lh_group_stop(&g, lh);
}

/* The lighthouse names a lost member of the last quorum in the other
 * members' heartbeat answers: group b stops (its connections close, so it
 * is unhealthy after the 250 ms grace) and group a's manager learns the
 * quorum's id from its next heartbeat; nothing is reported before, and a
 * wait times out. */
static void test_lost_member_reported_in_heartbeats(void **state) {
  (void)state;
  /* a join timeout longer than any lag between the two groups' calls */
  sg_lh_server_t *lh = lh_start(0, 1, 10000, 60000);
  group_t gs[2];
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b", sg_lh_server_address(lh), "storeB:1");
  /* both heartbeat: the first quorum waits for both */
  wait_heartbeating(sg_lh_server_port(lh), "a");
  wait_heartbeating(sg_lh_server_port(lh), "b");
  struct qreq q[4];
  const int64_t steps[2][2] = {{1, 1}, {1, 1}};
  run_round(gs, 2, steps, 0, q);
  assert_int_equal(q[0].r.replica_world_size, 2);
  int64_t qid = q[0].r.quorum_id;
  q_free(q, 4);

  int64_t got = -1;
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[0].srv, 0, sg_deadline_in_ms(300), &got),
      SG_ETIMEDOUT);
  assert_int_equal(got, 0);
  assert_int_equal(sg_mgr_server_wait_lost(NULL, 0, 0, &got), SG_EINVAL);

  group_stop(&gs[1]);
  int64_t t0 = sg_now_ns();
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[0].srv, 0, sg_deadline_in_ms(10000), &got), 0);
  assert_int_equal(got, qid);
  /* grace 250 ms + a heartbeat (50 ms) + the answer's 20 ms cache */
  assert_true((sg_now_ns() - t0) / 1000000 < 5000);
  /* a newer quorum only is news */
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[0].srv, qid, sg_deadline_in_ms(200), &got),
      SG_ETIMEDOUT);
  lh_group_stop(&gs[0], lh);
}

/* A WaitLost long poll of another group rank, on a client of its own. */
struct lreq {
  sg_mgr_client_t *c;
  int64_t after, timeout_ms;
  int rc;
  int64_t qid, elapsed_ms;
  sg_err_t err;
  pthread_t t;
};

static void *wait_lost_thread(void *arg) {
  struct lreq *l = arg;
  int64_t t0 = sg_now_ns();
  sg_err_clear(&l->err);
  l->rc = sg_mgr_client_wait_lost(
      l->c, l->after, sg_deadline_in_ms(l->timeout_ms), &l->qid, &l->err);
  l->elapsed_ms = (sg_now_ns() - t0) / 1000000;
  return NULL;
}

/* WaitLost (stepguard's long poll, what group ranks other than 0 use): it
 * waits while nothing is lost, ends with the quorum's id once the
 * lighthouse names a member of it lost in the manager's heartbeat answer,
 * answers at once for an older after_quorum_id, times out for the same one,
 * and is failed (not left hanging) when the manager stops. */
static void test_wait_lost_long_poll(void **state) {
  (void)state;
  /* a join timeout longer than any lag between the two groups' calls */
  sg_lh_server_t *lh = lh_start(0, 1, 10000, 60000);
  group_t gs[2];
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "b", sg_lh_server_address(lh), "storeB:1");
  wait_heartbeating(sg_lh_server_port(lh), "a");
  wait_heartbeating(sg_lh_server_port(lh), "b");
  struct qreq q[4];
  const int64_t steps[2][2] = {{1, 1}, {1, 1}};
  run_round(gs, 2, steps, 0, q);
  int64_t qid = q[0].r.quorum_id;
  q_free(q, 4);

  sg_err_t err;
  sg_err_clear(&err);
  sg_mgr_client_t *c = NULL;
  assert_int_equal(
      sg_mgr_client_new(sg_mgr_server_address(gs[0].srv), 5000, NULL, &c, &err),
      0);
  int64_t got = -1;
  assert_int_equal(
      sg_mgr_client_wait_lost(c, 0, sg_deadline_in_ms(300), &got, &err),
      SG_ETIMEDOUT);
  struct lreq l = {c, 0, 10000, -1, 0, 0, {0}, 0};
  assert_int_equal(pthread_create(&l.t, NULL, wait_lost_thread, &l), 0);
  usleep(200 * 1000); /* the call waits in the server */
  group_stop(&gs[1]);
  pthread_join(l.t, NULL);
  if (l.rc)
    fail_msg("WaitLost: %s", l.err.msg);
  assert_int_equal(l.qid, qid);
  assert_true(l.elapsed_ms < 5000);
  /* already reported: at once; the same quorum again: nothing new */
  assert_int_equal(
      sg_mgr_client_wait_lost(c, qid - 1, sg_deadline_in_ms(5000), &got, &err),
      0);
  assert_int_equal(got, qid);
  assert_int_equal(
      sg_mgr_client_wait_lost(c, qid, sg_deadline_in_ms(200), &got, &err),
      SG_ETIMEDOUT);
  /* a poll in progress when the manager stops fails with it */
  struct lreq l2 = {c, qid, 30000, -1, 0, 0, {0}, 0};
  assert_int_equal(pthread_create(&l2.t, NULL, wait_lost_thread, &l2), 0);
  usleep(200 * 1000);
  lh_group_stop(&gs[0], lh);
  pthread_join(l2.t, NULL);
  assert_int_not_equal(l2.rc, 0);
  assert_int_not_equal(l2.rc, SG_ETIMEDOUT);
  assert_true(l2.elapsed_ms < 10000);
  sg_mgr_client_free(c);
}

/* A member that a newer quorum left out while it still heartbeats (cut
 * off, then back) learns that its quorum is over: its heartbeat carries
 * the last quorum it was answered, and the lighthouse names it lost in
 * that quorum.  Groups a and c go on as two (b, silent in the round, is
 * a straggler past the join timeout); b's manager reports quorum 1 lost,
 * a's reports nothing (its quorum lost no one). */
static void test_left_out_member_learns_its_quorum_is_over(void **state) {
  (void)state;
  /* the join timeout: long enough that the first quorum holds all three
   * however late one of them asks, short enough for the second round,
   * which goes on without b once it has passed */
  sg_lh_server_t *lh = lh_start(0, 1, 2000, 60000);
  group_t gs[3]; /* a, c, b: run_round takes the first ones */
  group_start(&gs[0], "a", sg_lh_server_address(lh), "storeA:1");
  group_start(&gs[1], "c", sg_lh_server_address(lh), "storeC:1");
  group_start(&gs[2], "b", sg_lh_server_address(lh), "storeB:1");
  wait_heartbeating(sg_lh_server_port(lh), "a");
  wait_heartbeating(sg_lh_server_port(lh), "c");
  wait_heartbeating(sg_lh_server_port(lh), "b");
  struct qreq q[6];
  const int64_t steps[3][2] = {{1, 1}, {1, 1}, {1, 1}};
  run_round(gs, 3, steps, 0, q);
  int64_t q1 = q[0].r.quorum_id;
  assert_int_equal(q[0].r.replica_world_size, 3);
  q_free(q, 6);
  int64_t got = -1;
  /* before: nothing to say to b */
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[2].srv, 0, sg_deadline_in_ms(300), &got),
      SG_ETIMEDOUT);
  const int64_t steps2[2][2] = {{2, 2}, {2, 2}};
  run_round(gs, 2, steps2, 0, q);
  assert_int_equal(q[0].r.replica_world_size, 2);
  assert_true(q[0].r.quorum_id > q1);
  q_free(q, 4);
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[2].srv, 0, sg_deadline_in_ms(10000), &got), 0);
  assert_int_equal(got, q1);
  assert_int_equal(
      sg_mgr_server_wait_lost(gs[0].srv, 0, sg_deadline_in_ms(300), &got),
      SG_ETIMEDOUT);
  group_stop(&gs[2]);
  group_stop(&gs[1]);
  lh_group_stop(&gs[0], lh);
}

/* A quorum asked while the lighthouse connection is down (it restarted)
 * gets the whole timeout, not just the connect timeout, once it connects. */
static void test_quorum_after_restart_gets_full_timeout(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 2, 100, 60000);
  int port = sg_lh_server_port(lh);
  char lh_addr[64];
  snprintf(lh_addr, sizeof(lh_addr), "http://127.0.0.1:%d", port);
  sg_mgr_server_opts_t o;
  base_opts(&o, "a", lh_addr, "storeA:1");
  o.world_size = 1;
  o.connect_timeout_ms = 300;
  o.heartbeat_interval_ms = 600000; /* only the first heartbeat, at start */
  group_t a, b;
  group_start_opts(&a, &o);
  sg_lh_server_stop(lh);
  lh = lh_start(port, 2, 100, 60000);
  /* a's channel is down; b joins 1 s later (> a's connect timeout) */
  base_opts(&o, "b", lh_addr, "storeB:1");
  o.world_size = 1;
  group_start_opts(&b, &o);
  struct qreq q[2];
  q_init(&q[0], &a, 0, 1);
  q_init(&q[1], &b, 0, 1);
  q[1].delay_ms = 1000;
  q_start(&q[0]);
  q_start(&q[1]);
  q_join(&q[0]);
  q_join(&q[1]);
  if (q[0].rc)
    fail_msg("a: %s", q[0].err.msg);
  assert_int_equal(q[1].rc, 0);
  assert_int_equal(q[0].r.replica_world_size, 2);
  q_free(q, 2);
  group_stop(&a);
  group_stop(&b);
  sg_lh_server_stop(lh);
}

/* Fail each allocation in turn during a round of calls: every call ends
 * (with an error or not), nothing crashes or leaks, and the server serves
 * normally afterwards. */
static void test_allocation_failures(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 1);
  long failed = 0;
  for (long nth = 1; nth <= 80; nth++) {
    sg_mgr_quorum_result_t r;
    sg_err_t err;
    char *md = NULL;
    int out = 0;
    sg_test_fail_alloc(nth, 0);
    if (sg_mgr_client_quorum(g.cl[0], 0, nth, "md", 0, 0, 0, NULL,
                             sg_deadline_in_ms(2000), &r, &err) == 0)
      sg_mgr_quorum_result_free(&r);
    sg_mgr_client_should_commit(g.cl[0], 0, nth, 1, sg_deadline_in_ms(2000),
                                &out, &err);
    if (sg_mgr_client_checkpoint_metadata(g.cl[0], 0, sg_deadline_in_ms(2000),
                                          &md, &err) == 0)
      sg_free(md);
    failed += sg_test_fail_alloc(0, 0);
  }
  assert_true(failed > 0);
  /* the server still works */
  usleep(200 * 1000);
  sg_mgr_quorum_result_t r;
  sg_err_t err;
  int rc = sg_mgr_client_quorum(g.cl[0], 0, 100, "md", 0, 0, 0, NULL,
                                sg_deadline_in_ms(10000), &r, &err);
  if (rc)
    fail_msg("quorum after failures: %s", err.msg);
  assert_int_equal(r.max_step, 100);
  sg_mgr_quorum_result_free(&r);
  lh_group_stop(&g, lh);
}

static void test_stop_with_calls_in_flight(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  struct qreq q;
  q_init(&q, &g, 0, 0); /* rank 1 never comes: rank 0 waits */
  q.timeout_ms = 30000;
  q_start(&q);
  usleep(200 * 1000);
  int64_t t0 = sg_now_ns();
  sg_mgr_server_stop(g.srv);
  g.srv = NULL;
  q_join(&q);
  assert_true(q.rc < 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 5000);
  for (int r = 0; r < 2; r++)
    sg_mgr_client_free(g.cl[r]);
  sg_lh_server_stop(lh);
}

/* ---- in-process calls ---------------------------------------------------- */

/* local_quorum: an in-process Quorum for group rank g, waited for. */
static int local_quorum(sg_mgr_server_t *srv, int64_t g, int64_t step,
                        const char *md, int64_t timeout_ms,
                        sg_mgr_quorum_result_t *r, sg_err_t *err) {
  sg_mgr_call_t *c = NULL;
  int rc = sg_mgr_local_quorum_start(srv, g, step, md, 0, 0, 0, NULL,
                                     sg_deadline_in_ms(timeout_ms), &c, err);
  if (rc)
    return rc;
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  rc = sg_mgr_call_quorum_result(c, r, err);
  sg_mgr_call_free(c);
  return rc;
}

/* local_start: group rank 0's in-process Quorum with metadata "m", started
 * and not waited for. */
static int local_start(sg_mgr_server_t *srv, int64_t step, int64_t timeout_ms,
                       sg_mgr_call_t **c, sg_err_t *err) {
  return sg_mgr_local_quorum_start(srv, 0, step, "m", 0, 0, 0, NULL,
                                   sg_deadline_in_ms(timeout_ms), c, err);
}

static int local_vote(sg_mgr_server_t *srv, int64_t g, int vote, int *out,
                      sg_err_t *err) {
  sg_mgr_call_t *c = NULL;
  int rc = sg_mgr_local_should_commit_start(srv, g, 1, vote,
                                            sg_deadline_in_ms(10000), &c, err);
  if (rc)
    return rc;
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  rc = sg_mgr_call_should_commit_result(c, out, err);
  sg_mgr_call_free(c);
  return rc;
}

struct lvote {
  sg_mgr_server_t *srv;
  int64_t g;
  int vote, rc, out;
  pthread_t t;
};

static void *local_vote_thread(void *arg) {
  struct lvote *v = arg;
  sg_err_t err;
  v->rc = local_vote(v->srv, v->g, v->vote, &v->out, &err);
  return NULL;
}

/* Group rank 0 in-process and rank 1 over the wire share rounds: the same
 * quorum, each rank's own view, the same metadata store, and votes ANDed
 * across both paths. */
static void test_local_and_wire_ranks_share_rounds(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  group_t g;
  group_start(&g, "a:1", sg_lh_server_address(lh), "storeA:1");
  for (int64_t step = 3; step < 5; step++) {
    struct qreq q;
    q_init(&q, &g, 1, step);
    q.md = "md-wire-1";
    q_start(&q);
    sg_mgr_quorum_result_t r;
    sg_err_t err;
    sg_err_clear(&err);
    int rc = local_quorum(g.srv, 0, step, "md-local-0", 10000, &r, &err);
    if (rc)
      fail_msg("local quorum: %s", err.msg);
    q_join(&q);
    if (q.rc)
      fail_msg("wire quorum: %s", q.err.msg);
    assert_int_equal(r.quorum_id, q.r.quorum_id);
    assert_int_equal(r.max_step, step);
    assert_int_equal(q.r.max_step, step);
    assert_int_equal(r.replica_world_size, 1);
    assert_true(r.has_max_replica_rank);
    assert_int_equal(r.n_replica_ids, 1);
    assert_string_equal(r.replica_ids[0], "a:1");
    assert_string_equal(r.store_address, "storeA:1");
    assert_int_equal(r.n_up_to_date_manager_addresses, 1);
    assert_string_equal(r.up_to_date_manager_addresses[0],
                        sg_mgr_server_address(g.srv));
    sg_mgr_quorum_result_free(&r);
    q_free(&q, 1);
  }
  char *md = NULL;
  sg_err_t err;
  assert_int_equal(sg_mgr_client_checkpoint_metadata(
                       g.cl[1], 0, sg_deadline_in_ms(5000), &md, &err),
                   0);
  assert_string_equal(md, "md-local-0");
  sg_free(md);
  /* votes: local yes + wire no -> no for both; both yes -> yes */
  for (int round = 0; round < 2; round++) {
    struct lvote v = {g.srv, 0, 1, -1, -1, 0};
    assert_int_equal(pthread_create(&v.t, NULL, local_vote_thread, &v), 0);
    int out = -1;
    assert_int_equal(sg_mgr_client_should_commit(g.cl[1], 1, 1, round,
                                                 sg_deadline_in_ms(10000), &out,
                                                 &err),
                     0);
    pthread_join(v.t, NULL);
    assert_int_equal(v.rc, 0);
    assert_int_equal(out, round);
    assert_int_equal(v.out, round);
  }
  lh_group_stop(&g, lh);
}

/* A group of one, in-process only: many steps, each vote answered. */
static void test_local_steps_world_one(void **state) {
  (void)state;
  sg_lh_server_t *lh = lh_start(0, 1, 100, 5000);
  sg_mgr_server_opts_t o;
  base_opts(&o, "solo", sg_lh_server_address(lh), "st:1");
  o.world_size = 1;
  group_t g;
  group_start_opts(&g, &o);
  for (int64_t step = 0; step < 20; step++) {
    sg_mgr_quorum_result_t r;
    sg_err_t err;
    sg_err_clear(&err);
    if (local_quorum(g.srv, 0, step, "m", 10000, &r, &err))
      fail_msg("step %lld: %s", (long long)step, err.msg);
    assert_int_equal(r.max_step, step);
    sg_mgr_quorum_result_free(&r);
    int out = -1;
    int vote = step % 3 != 0;
    assert_int_equal(local_vote(g.srv, 0, vote, &out, &err), 0);
    assert_int_equal(out, vote);
  }
  lh_group_stop(&g, lh);
}

/* An in-process call that arrived on its caller's thread, then a call from
 * the wire completing the round: the loop answers both (the quorum thread
 * does not answer a round a wire call waits in); then the other order. */
static void test_local_first_then_wire(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  for (int order = 0; order < 2; order++) {
    sg_mgr_call_t *c = NULL;
    sg_err_t err;
    struct qreq q;
    q_init(&q, &g, 1, 7 + order);
    if (order == 1) {
      q_start(&q);
      usleep(100 * 1000);
    }
    assert_int_equal(local_start(g.srv, 7 + order, 10000, &c, &err), 0);
    if (order == 0) {
      usleep(100 * 1000);
      assert_false(sg_mgr_call_done(c));
      q_start(&q);
    }
    assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
    sg_mgr_quorum_result_t r;
    sg_err_clear(&err);
    if (sg_mgr_call_quorum_result(c, &r, &err))
      fail_msg("order %d: %s", order, err.msg);
    q_join(&q);
    if (q.rc)
      fail_msg("order %d, wire: %s", order, q.err.msg);
    assert_int_equal(r.quorum_id, q.r.quorum_id);
    assert_int_equal(r.max_step, 7 + order);
    sg_mgr_quorum_result_free(&r);
    q_free(&q, 1);
    sg_mgr_call_free(c);
  }
  lh_group_stop(&g, lh);
}

/* Refusals come back as the wire client reports them. */
static void test_local_errors_match_wire(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_mgr_quorum_result_t r, rw;
  sg_err_t err, werr;
  sg_err_clear(&err);
  sg_err_clear(&werr);
  int lrc = local_quorum(g.srv, 7, 1, "m", 2000, &r, &err);
  int wrc = sg_mgr_client_quorum(g.cl[0], 7, 1, "m", 0, 0, 0, NULL,
                                 sg_deadline_in_ms(2000), &rw, &werr);
  assert_int_equal(lrc, SG_EINVAL);
  assert_int_equal(lrc, wrc);
  assert_string_equal(err.msg, werr.msg);
  assert_int_equal(r.n_replica_ids, 0); /* zeroed on error */
  /* metadata over the limit */
  char *big = sg_malloc(SG_MGR_MAX_METADATA_LEN + 2);
  assert_non_null(big);
  memset(big, 'x', SG_MGR_MAX_METADATA_LEN + 1);
  big[SG_MGR_MAX_METADATA_LEN + 1] = '\0';
  lrc = local_quorum(g.srv, 0, 1, big, 2000, &r, &err);
  assert_int_equal(lrc, SG_EINVAL);
  assert_non_null(strstr(err.msg, "checkpoint_metadata too long"));
  sg_free(big);
  int out = -1;
  lrc = local_vote(g.srv, -1, 1, &out, &err);
  assert_int_equal(lrc, SG_EINVAL);
  assert_non_null(strstr(err.msg, "out of range"));
  /* a result of the wrong kind, or taken twice, is refused */
  sg_mgr_call_t *c = NULL;
  assert_int_equal(sg_mgr_local_should_commit_start(
                       g.srv, 5, 1, 1, sg_deadline_in_ms(2000), &c, &err),
                   0);
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(5000)), 0);
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), SG_ESTATE);
  assert_int_equal(sg_mgr_call_should_commit_result(c, &out, &err), SG_EINVAL);
  assert_int_equal(sg_mgr_call_should_commit_result(c, &out, &err), SG_ESTATE);
  sg_mgr_call_free(c);
  lh_group_stop(&g, lh);
}

/* Deadline, abort and waiting in slices; an in-process Quorum that ended
 * before its round no longer counts as arrived (as a cancelled wire call). */
static void test_local_deadline_abort_and_slices(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_mgr_call_t *c = NULL;
  sg_err_t err;
  sg_mgr_quorum_result_t r;
  /* rank 1 never comes: slices time out, then the deadline ends it */
  assert_int_equal(local_start(g.srv, 1, 300, &c, &err), 0);
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(20)), SG_EAGAIN);
  assert_false(sg_mgr_call_done(c));
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), SG_ESTATE);
  int64_t t0 = sg_now_ns();
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 5000);
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), SG_ETIMEDOUT);
  sg_mgr_call_free(c);
  usleep(100 * 1000); /* the cancellation reaches the loop */
  /* rank 1 alone starts no round */
  struct qreq q[2];
  q_init(&q[1], &g, 1, 1);
  q[1].timeout_ms = 500;
  q_start(&q[1]);
  q_join(&q[1]);
  assert_int_equal(q[1].rc, SG_ETIMEDOUT);
  /* abort from another thread's point of view: it completes at once */
  assert_int_equal(local_start(g.srv, 1, 30000, &c, &err), 0);
  sg_mgr_call_abort(c);
  sg_mgr_call_abort(c); /* idempotent */
  assert_true(sg_mgr_call_done(c));
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(10)), 0);
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), SG_EABORTED);
  sg_mgr_call_free(c);
  /* free without waiting: aborted, nothing leaks */
  assert_int_equal(local_start(g.srv, 1, 30000, &c, &err), 0);
  sg_mgr_call_free(c);
  usleep(100 * 1000);
  /* both ranks together still work */
  q_init(&q[1], &g, 1, 2);
  q_start(&q[1]);
  sg_err_clear(&err);
  if (local_quorum(g.srv, 0, 2, "m", 10000, &r, &err))
    fail_msg("local quorum: %s", err.msg);
  q_join(&q[1]);
  assert_int_equal(q[1].rc, 0);
  assert_int_equal(r.max_step, 2);
  sg_mgr_quorum_result_free(&r);
  q_free(&q[1], 1);
  lh_group_stop(&g, lh);
}

/* One road: the same started call over the wire (rank 1) and in-process
 * (rank 0's client pointed at its server), sharing rounds; slices, the
 * deadline, abort, free in flight and a client freed under a started call
 * end a wire call as they end an in-process one. */
static void test_started_calls_one_road(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_mgr_client_use_server(g.cl[0], g.srv);
  sg_err_t err;
  sg_mgr_quorum_result_t r0, r1;
  for (int64_t step = 1; step < 4; step++) {
    sg_mgr_call_t *c0 = NULL, *c1 = NULL;
    assert_int_equal(sg_mgr_client_quorum_start(g.cl[0], 0, step, "m0", 0, 0, 0,
                                                NULL, sg_deadline_in_ms(10000),
                                                &c0, &err),
                     0);
    assert_int_equal(sg_mgr_client_quorum_start(g.cl[1], 1, step, "m1", 0, 0, 0,
                                                "h1", sg_deadline_in_ms(10000),
                                                &c1, &err),
                     0);
    assert_int_equal(sg_mgr_call_wait(c1, sg_deadline_in_ms(60000)), 0);
    assert_int_equal(sg_mgr_call_wait(c0, sg_deadline_in_ms(60000)), 0);
    sg_err_clear(&err);
    if (sg_mgr_call_quorum_result(c1, &r1, &err))
      fail_msg("wire quorum: %s", err.msg);
    if (sg_mgr_call_quorum_result(c0, &r0, &err))
      fail_msg("in-process quorum: %s", err.msg);
    assert_int_equal(r0.quorum_id, r1.quorum_id);
    assert_int_equal(r1.max_step, step);
    /* taken once */
    sg_mgr_quorum_result_t again;
    assert_int_equal(sg_mgr_call_quorum_result(c1, &again, &err), SG_ESTATE);
    sg_mgr_quorum_result_free(&r0);
    sg_mgr_quorum_result_free(&r1);
    sg_mgr_call_free(c0);
    sg_mgr_call_free(c1);
    /* the votes, both roads, ANDed */
    int vote1 = step != 2;
    assert_int_equal(sg_mgr_client_should_commit_start(g.cl[0], 0, step, 1,
                                                       sg_deadline_in_ms(10000),
                                                       &c0, &err),
                     0);
    assert_int_equal(sg_mgr_client_should_commit_start(g.cl[1], 1, step, vote1,
                                                       sg_deadline_in_ms(10000),
                                                       &c1, &err),
                     0);
    int d0 = -1, d1 = -1;
    assert_int_equal(sg_mgr_call_wait(c0, sg_deadline_in_ms(60000)), 0);
    assert_int_equal(sg_mgr_call_wait(c1, sg_deadline_in_ms(60000)), 0);
    assert_int_equal(sg_mgr_call_should_commit_result(c0, &d0, &err), 0);
    assert_int_equal(sg_mgr_call_should_commit_result(c1, &d1, &err), 0);
    assert_int_equal(d0, vote1);
    assert_int_equal(d1, vote1);
    sg_mgr_call_free(c0);
    sg_mgr_call_free(c1);
  }
  /* a wire call alone: slices, then its deadline */
  sg_mgr_call_t *c = NULL;
  assert_int_equal(sg_mgr_client_quorum_start(g.cl[1], 1, 9, "m1", 0, 0, 0,
                                              NULL, sg_deadline_in_ms(300), &c,
                                              &err),
                   0);
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(20)), SG_EAGAIN);
  assert_false(sg_mgr_call_done(c));
  int64_t t0 = sg_now_ns();
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 5000);
  assert_int_equal(sg_mgr_call_quorum_result(c, &r1, &err), SG_ETIMEDOUT);
  sg_mgr_call_free(c);
  /* aborted: complete at once */
  assert_int_equal(sg_mgr_client_quorum_start(g.cl[1], 1, 9, "m1", 0, 0, 0,
                                              NULL, sg_deadline_in_ms(30000),
                                              &c, &err),
                   0);
  sg_mgr_call_abort(c);
  assert_true(sg_mgr_call_done(c));
  assert_int_equal(sg_mgr_call_quorum_result(c, &r1, &err), SG_EABORTED);
  sg_mgr_call_free(c);
  /* freed in flight, then the client freed under another started call:
   * the call outlives it and ends aborted */
  assert_int_equal(sg_mgr_client_quorum_start(g.cl[1], 1, 9, "m1", 0, 0, 0,
                                              NULL, sg_deadline_in_ms(30000),
                                              &c, &err),
                   0);
  sg_mgr_call_free(c);
  assert_int_equal(sg_mgr_client_quorum_start(g.cl[1], 1, 9, "m1", 0, 0, 0,
                                              NULL, sg_deadline_in_ms(30000),
                                              &c, &err),
                   0);
  sg_mgr_client_free(g.cl[1]);
  g.cl[1] = NULL;
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  assert_int_equal(sg_mgr_call_quorum_result(c, &r1, &err), SG_EABORTED);
  sg_mgr_call_free(c);
  /* an aborted client starts nothing, whichever road */
  sg_mgr_client_abort(g.cl[0]);
  assert_int_equal(sg_mgr_client_quorum_start(g.cl[0], 0, 9, "m0", 0, 0, 0,
                                              NULL, sg_deadline_in_ms(1000), &c,
                                              &err),
                   SG_EABORTED);
  assert_null(c);
  lh_group_stop(&g, lh);
}

/* The vote that ends a round nobody waits in is decided on the caller's
 * thread: a no vote of a rank whose call gave up still counts (torchft),
 * and the round starts afresh after it.  A rank alone in a round of two
 * gets no at its cutoff, before its deadline, and the rank that missed
 * that round gets no for its step too. */
static void test_local_vote_ends_round_of_departed_voter(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  int out = -1;
  /* rank 1 votes no with a long deadline and gives up before rank 0 comes */
  sg_mgr_call_t *c = NULL;
  assert_int_equal(sg_mgr_client_should_commit_start(
                       g.cl[1], 1, 1, 0, sg_deadline_in_ms(60000), &c, &err),
                   0);
  usleep(100 * 1000);
  sg_mgr_call_abort(c);
  sg_mgr_call_free(c);
  usleep(100 * 1000); /* the cancel reaches the server */
  assert_int_equal(local_vote(g.srv, 0, 1, &out, &err), 0);
  assert_int_equal(out, 0);
  /* a new round: rank 1 yes (gives up), rank 0 yes -> yes */
  assert_int_equal(sg_mgr_client_should_commit_start(
                       g.cl[1], 1, 2, 1, sg_deadline_in_ms(60000), &c, &err),
                   0);
  usleep(100 * 1000);
  sg_mgr_call_abort(c);
  sg_mgr_call_free(c);
  usleep(100 * 1000);
  assert_int_equal(local_vote(g.srv, 0, 1, &out, &err), 0);
  assert_int_equal(out, 1);
  /* rank 0 alone does not end a round of two: it gets no at its cutoff,
   * before its deadline (not a timeout) */
  int64_t t0 = sg_now_ns();
  assert_int_equal(sg_mgr_local_should_commit_start(
                       g.srv, 0, 3, 1, sg_deadline_in_ms(1000), &c, &err),
                   0);
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(10000)), 0);
  assert_int_equal(sg_mgr_call_should_commit_result(c, &out, &err), 0);
  assert_int_equal(out, 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 1000);
  sg_mgr_call_free(c);
  /* rank 1's vote for step 3 comes late: no, at once */
  t0 = sg_now_ns();
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[1], 1, 3, 1, sg_deadline_in_ms(30000), &out, &err),
                   0);
  assert_int_equal(out, 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 10000);
  lh_group_stop(&g, lh);
}

struct wvote {
  sg_mgr_client_t *c;
  int64_t g, step;
  int vote, rc, out;
  int64_t timeout_ms;
  pthread_t t;
};

static void *wire_vote_thread(void *arg) {
  struct wvote *v = arg;
  sg_err_t err;
  v->rc = sg_mgr_client_should_commit(v->c, v->g, v->step, v->vote,
                                      sg_deadline_in_ms(v->timeout_ms), &v->out,
                                      &err);
  return NULL;
}

/* both_vote_yes: ranks 0 (in-process when `local`) and 1 vote yes for
 * `step` at once; both must get yes. */
static void both_vote_yes(group_t *g, int local, int64_t step) {
  struct wvote v1 = {g->cl[1], 1, step, 1, -1, -1, 30000, 0};
  assert_int_equal(pthread_create(&v1.t, NULL, wire_vote_thread, &v1), 0);
  int out = -1;
  sg_err_t err;
  if (local) {
    sg_mgr_call_t *c = NULL;
    assert_int_equal(sg_mgr_local_should_commit_start(g->srv, 0, step, 1,
                                                      sg_deadline_in_ms(30000),
                                                      &c, &err),
                     0);
    assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
    assert_int_equal(sg_mgr_call_should_commit_result(c, &out, &err), 0);
    sg_mgr_call_free(c);
  } else {
    assert_int_equal(sg_mgr_client_should_commit(g->cl[0], 0, step, 1,
                                                 sg_deadline_in_ms(30000), &out,
                                                 &err),
                     0);
  }
  pthread_join(v1.t, NULL);
  assert_int_equal(v1.rc, 0);
  assert_int_equal(out, 1);
  assert_int_equal(v1.out, 1);
}

/* A rank late to the vote: rank 0 votes yes, rank 1 votes yes only after
 * rank 0's call ended.  The server ends the round at rank 0's cutoff with
 * no (an answer, not a timeout), and rank 1's late vote for that step gets
 * no too: the group's ranks decide the same, and no rank gets yes.  The
 * next round commits.  Over the wire (`local` 0) and with rank 0
 * in-process (`local` 1). */
static void late_rank_gets_no(int local) {
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  int out0 = -1, out1 = -1;
  int64_t t0 = sg_now_ns();
  if (local) {
    sg_mgr_call_t *c = NULL;
    assert_int_equal(sg_mgr_local_should_commit_start(
                         g.srv, 0, 5, 1, sg_deadline_in_ms(1000), &c, &err),
                     0);
    assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(10000)), 0);
    assert_int_equal(sg_mgr_call_should_commit_result(c, &out0, &err), 0);
    sg_mgr_call_free(c);
  } else {
    assert_int_equal(sg_mgr_client_should_commit(g.cl[0], 0, 5, 1,
                                                 sg_deadline_in_ms(1000), &out0,
                                                 &err),
                     0);
  }
  assert_int_equal(out0, 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 1000); /* before its deadline */
  /* rank 1 votes after rank 0's deadline passed */
  usleep(200 * 1000);
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[1], 1, 5, 1, sg_deadline_in_ms(30000), &out1, &err),
                   0);
  assert_int_equal(out1, 0);
  /* the next round, same step (the group did not commit): yes for both */
  both_vote_yes(&g, local, 5);
  both_vote_yes(&g, local, 6);
  lh_group_stop(&g, lh);
}

static void test_vote_late_rank_wire(void **state) {
  (void)state;
  late_rank_gets_no(0);
}

static void test_vote_late_rank_local(void **state) {
  (void)state;
  late_rank_gets_no(1);
}

/* The late rank's vote belongs to the round it missed whatever step it
 * names (a rank whose heal failed votes with step -1): no, at once, and
 * the next round commits. */
static void test_vote_late_rank_other_step(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  int out = -1;
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[0], 0, 5, 1, sg_deadline_in_ms(1000), &out, &err),
                   0);
  assert_int_equal(out, 0);
  int64_t t0 = sg_now_ns();
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[1], 1, -1, 1, sg_deadline_in_ms(30000), &out, &err),
                   0);
  assert_int_equal(out, 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 10000); /* not at a cutoff */
  both_vote_yes(&g, 0, 5);
  lh_group_stop(&g, lh);
}

/* A rank already waiting for the next quorum when a round ends on its
 * cutoff owes that round nothing: after the quorum, both ranks vote for
 * the same step again and commit. */
static void test_vote_rank_in_quorum_not_held(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  int out = -1;
  struct qreq q[2];
  q_init(&q[1], &g, 1, 5);
  q_start(&q[1]); /* rank 1 moved on to the next quorum */
  usleep(200 * 1000);
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[0], 0, 5, 1, sg_deadline_in_ms(1000), &out, &err),
                   0);
  assert_int_equal(out, 0);
  q_init(&q[0], &g, 0, 5);
  q_start(&q[0]);
  for (int r = 0; r < 2; r++) {
    q_join(&q[r]);
    assert_int_equal(q[r].rc, 0);
  }
  q_free(q, 2);
  both_vote_yes(&g, 0, 5);
  lh_group_stop(&g, lh);
}

/* A late rank that moves on to the next Quorum without voting is not held
 * to the missed round: its next vote for the same step counts. */
static void test_vote_late_mark_cleared_by_quorum(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_err_t err;
  int out = -1;
  assert_int_equal(sg_mgr_client_should_commit(
                       g.cl[0], 0, 5, 1, sg_deadline_in_ms(400), &out, &err),
                   0);
  assert_int_equal(out, 0);
  /* both ranks meet in a quorum round (rank 1 never voted for step 5) */
  struct qreq q[2];
  for (int r = 0; r < 2; r++) {
    q_init(&q[r], &g, r, 5);
    q_start(&q[r]);
  }
  for (int r = 0; r < 2; r++) {
    q_join(&q[r]);
    assert_int_equal(q[r].rc, 0);
  }
  q_free(q, 2);
  both_vote_yes(&g, 0, 5);
  lh_group_stop(&g, lh);
}

/* A forked child (a DataLoader worker) may drop its copy of a server, as its
 * garbage collector does with a cycle the parent had not freed yet: that
 * must neither crash nor hang (the threads to join are the parent's), and
 * the parent's server goes on. */
static void test_server_stop_in_forked_child(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  both_vote_yes(&g, 0, 1);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(20); /* a hang fails the test instead of blocking it */
    sg_mgr_server_stop(g.srv);
    _exit(0);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  both_vote_yes(&g, 0, 2);
  lh_group_stop(&g, lh);
}

/* A forked child that finds a call its parent started leaves it alone and
 * does not hang; the parent's call still completes. */
static void test_local_call_in_forked_child(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_mgr_call_t *c = NULL;
  sg_err_t err;
  assert_int_equal(local_start(g.srv, 1, 30000, &c, &err), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    sg_mgr_quorum_result_t r;
    sg_mgr_call_t *d = NULL;
    int ok = sg_mgr_call_wait(c, sg_deadline_in_ms(60000)) == 0 &&
             sg_mgr_call_done(c) &&
             sg_mgr_call_quorum_result(c, &r, &err) == SG_ESTATE &&
             sg_mgr_local_should_commit_start(g.srv, 0, 1, 1,
                                              sg_deadline_in_ms(1000), &d,
                                              &err) == SG_ESTATE &&
             d == NULL;
    sg_mgr_call_abort(c);
    sg_mgr_call_free(c);
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  int64_t t0 = sg_now_ns();
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if ((sg_now_ns() - t0) / 1000000 > 20000) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      fail_msg("the child hung");
    }
    usleep(10 * 1000);
  }
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  /* the parent's call is untouched: rank 1 completes the round */
  struct qreq q;
  q_init(&q, &g, 1, 1);
  q_start(&q);
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(60000)), 0);
  sg_mgr_quorum_result_t r;
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), 0);
  assert_int_equal(r.max_step, 1);
  sg_mgr_quorum_result_free(&r);
  sg_mgr_call_free(c);
  q_join(&q);
  assert_int_equal(q.rc, 0);
  q_free(&q, 1);
  lh_group_stop(&g, lh);
}

/* Stopping the server fails a waiting in-process call at once, as
 * UNAVAILABLE from the wire; the call may be freed after the server. */
static void test_local_stop_fails_waiting_call(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 2);
  sg_mgr_call_t *c = NULL, *v = NULL;
  sg_err_t err;
  assert_int_equal(local_start(g.srv, 1, 30000, &c, &err), 0);
  assert_int_equal(sg_mgr_local_should_commit_start(
                       g.srv, 0, 1, 1, sg_deadline_in_ms(30000), &v, &err),
                   0);
  usleep(100 * 1000);
  int64_t t0 = sg_now_ns();
  for (int r = 0; r < 2; r++)
    sg_mgr_client_free(g.cl[r]);
  sg_mgr_server_stop(g.srv);
  assert_true(sg_mgr_call_done(c));
  assert_true(sg_mgr_call_done(v));
  assert_int_equal(sg_mgr_call_wait(c, sg_deadline_in_ms(10)), 0);
  assert_true((sg_now_ns() - t0) / 1000000 < 5000);
  sg_mgr_quorum_result_t r;
  assert_int_equal(sg_mgr_call_quorum_result(c, &r, &err), SG_ECONNREFUSED);
  assert_non_null(strstr(err.msg, "UNAVAILABLE"));
  int out = -1;
  assert_int_equal(sg_mgr_call_should_commit_result(v, &out, &err),
                   SG_ECONNREFUSED);
  sg_mgr_call_abort(c); /* complete already: the server is not touched */
  sg_mgr_call_free(c);
  sg_mgr_call_free(v);
  sg_lh_server_stop(lh);
}

/* Fail each allocation in turn around in-process calls: every call ends,
 * nothing leaks, and the server serves normally afterwards. */
static void test_local_allocation_failures(void **state) {
  (void)state;
  group_t g;
  sg_lh_server_t *lh = lh_group_start(&g, 1);
  long failed = 0;
  for (long nth = 1; nth <= 60; nth++) {
    sg_mgr_quorum_result_t r;
    sg_err_t err;
    int out = 0;
    sg_test_fail_alloc(nth, 0);
    if (local_quorum(g.srv, 0, nth, "md", 2000, &r, &err) == 0)
      sg_mgr_quorum_result_free(&r);
    local_vote(g.srv, 0, 1, &out, &err);
    failed += sg_test_fail_alloc(0, 0);
  }
  assert_true(failed > 0);
  usleep(200 * 1000);
  sg_mgr_quorum_result_t r;
  sg_err_t err;
  sg_err_clear(&err);
  if (local_quorum(g.srv, 0, 100, "md", 10000, &r, &err))
    fail_msg("quorum after failures: %s", err.msg);
  assert_int_equal(r.max_step, 100);
  sg_mgr_quorum_result_free(&r);
  lh_group_stop(&g, lh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_invalid_options),
      cmocka_unit_test(test_two_groups_quorum_commit_metadata),
      cmocka_unit_test(test_restarted_lighthouse_learns_the_step_floor),
      cmocka_unit_test(test_reconfigure_handles),
      cmocka_unit_test(test_advertised_host),
      cmocka_unit_test(test_metadata_of_silent_rank_not_found),
      cmocka_unit_test(test_step_disagreement_uses_minimum),
      cmocka_unit_test(test_kill_calls_handler),
      cmocka_unit_test(test_bad_requests),
      cmocka_unit_test(test_auth_token_required),
      cmocka_unit_test(test_lighthouse_down_then_back),
      cmocka_unit_test(test_quorum_retries),
      cmocka_unit_test(test_silent_lighthouse_is_an_outage),
      cmocka_unit_test(test_quorum_outage_ends_at_round_deadline),
      cmocka_unit_test(test_async_attempt_fails_then_retry_succeeds),
      cmocka_unit_test(test_group_leaves_when_rank_disconnects),
      cmocka_unit_test(test_reconnect_within_grace_keeps_group),
      cmocka_unit_test(test_cancelled_call_no_longer_counts),
      cmocka_unit_test(test_lighthouse_stops_during_round),
      cmocka_unit_test(test_lost_member_reported_in_heartbeats),
      cmocka_unit_test(test_wait_lost_long_poll),
      cmocka_unit_test(test_left_out_member_learns_its_quorum_is_over),
      cmocka_unit_test(test_quorum_after_restart_gets_full_timeout),
      cmocka_unit_test(test_allocation_failures),
      cmocka_unit_test(test_stop_with_calls_in_flight),
      cmocka_unit_test(test_local_and_wire_ranks_share_rounds),
      cmocka_unit_test(test_local_steps_world_one),
      cmocka_unit_test(test_local_first_then_wire),
      cmocka_unit_test(test_local_errors_match_wire),
      cmocka_unit_test(test_local_deadline_abort_and_slices),
      cmocka_unit_test(test_started_calls_one_road),
      cmocka_unit_test(test_local_vote_ends_round_of_departed_voter),
      cmocka_unit_test(test_vote_late_rank_wire),
      cmocka_unit_test(test_vote_late_rank_local),
      cmocka_unit_test(test_vote_late_rank_other_step),
      cmocka_unit_test(test_vote_rank_in_quorum_not_held),
      cmocka_unit_test(test_vote_late_mark_cleared_by_quorum),
      cmocka_unit_test(test_local_call_in_forked_child),
      cmocka_unit_test(test_server_stop_in_forked_child),
      cmocka_unit_test(test_local_stop_fails_waiting_call),
      cmocka_unit_test(test_local_allocation_failures),
  };
  /* The rpc server writes with write(2) through libuv: a peer that resets
   * its connection would raise SIGPIPE (Python ignores it already). */
  signal(SIGPIPE, SIG_IGN);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
