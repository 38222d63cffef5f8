/*
 * server.c: the ManagerServer of one replica group (torchft.ManagerService),
 * reference/torchft-semantics.md section 3, with the differences listed in
 * include/stepguard/manager.h.
 *
 *   threads   loop     libuv loop running the gRPC server, every handler,
 *                      the liveness timer and the delivery of quorum results;
 *                      owns the liveness state; the quorum round's state
 *                      is under quorum_mu and the commit round's under
 *                      commit_mu (below)
 *             quorum   makes the blocking lighthouse Quorum call of a round
 *                      (with torchft's retry rule) and posts the outcome to
 *                      the loop through an async handle.  While the
 *                      lighthouse connection is up, a round's first attempt
 *                      is sent without it instead (an asynchronous call
 *                      from the thread that starts the round, answered on
 *                      the channel's I/O thread, which delivers as the
 *                      quorum thread would); only a failed attempt wakes
 *                      the quorum thread, to retry by the same rule
 *             heartbeat sends Heartbeat every interval
 *             Both workers share one lighthouse channel (one connection, so
 *             the lighthouse sees one liveness signal).  `mu` guards only the
 *             hand-off between the loop and the workers, and the queues of
 *             in-process calls.
 *   rounds    a Quorum round starts when every group rank has a waiting
 *             call; its outcome answers every Quorum call waiting when it
 *             arrives, each with that rank's own view (results.c).  While
 *             only in-process calls wait (a group of one), a call arrives
 *             on its caller's thread and the quorum thread answers it, so
 *             neither wakes the loop; a call from the wire is answered on
 *             the loop only
 *   commit    ShouldCommit votes are ANDed per round; the round's state is
 *             the loop's but guarded by commit_mu, so that an in-process
 *             vote that ends a round nobody waits in is answered right on
 *             its caller's thread
 *   liveness  which group ranks spoke on which connection; a rank whose
 *             connections all closed and who stays silent past the grace
 *             makes the group leave for good (manager.h)
 *   local     in-process calls (sg_mgr_local_*, manager.h): a caller in this
 *             process queues its call and wakes the loop (local_async),
 *             which runs it through the same handlers as a call from the
 *             wire, answering with the same bytes; a caller that gives up
 *             queues a cancellation the same way
 */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "manager/results.h"
#include "manager/wire.h"
#include "rpc/client_async.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"
#include "stepguard/manager.h"
#include "stepguard/rpc.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define LOG "manager"
#define KILL_DELAY_MS 20 /* lets the Kill response leave first */
#define LH_MAX_RESPONSE (64u << 20)
#define MIN_RETRY_SLEEP_MS 100 /* torchft _quorum_with_retries */
#define MAX_HOST_LEN 255       /* advertised host name (DNS: 253) */

enum waiter_kind { W_QUORUM = 1, W_COMMIT = 2 };

/* Where an answer goes: a call from the wire, or one from this process
 * (sg_mgr_local_*); exactly one of the two is set. */
typedef struct reply_s {
  sg_rpc_call_t *call;
  sg_mgr_local_t *local;
} reply_t;

/* A call waiting for a round (Quorum) or for the group's votes (commit). */
struct waiter {
  enum waiter_kind kind;
  reply_t to;
  int64_t group_rank;
  int init_sync;
  int in_round; /* Quorum: its round's lighthouse call is under way */
  struct waiter *prev, *next;
};

/*
 * An in-process call (manager.h).  References: the caller's, the server's
 * while the call is in the inbox or has a waiter, and one per posted
 * cancellation.  Whoever completes it first (the loop with an answer, the
 * caller with a deadline or an abort) sets `done`; the other finds it set.
 */
struct sg_mgr_local_s {
  /* the request: set at start, then read by the loop thread only */
  enum waiter_kind kind;
  int64_t group_rank, step, commit_failures;
  int shrink_only, init_sync, vote;
  char *metadata, *handle; /* owned (Quorum) */
  sg_deadline_t deadline;
  sg_mgr_local_t *next;  /* in the server's inbox (s->mu) */
  sg_mgr_local_t *cnext; /* in the cancel list (s->mu) */
  unsigned forks;        /* sg_sock_fork_count() where it started */
  struct waiter *w;      /* its waiter while it has one (its round's lock) */
  int had_waiter;        /* a waiter took the server's reference (set by the
                            thread that ran it, under its round's lock) */
  pthread_mutex_t mu;    /* guards everything below */
  pthread_cond_t cv;     /* signalled on completion (CLOCK_MONOTONIC) */
  sg_mgr_server_t *srv;  /* NULL once done: nobody posts to it then */
  int refs;
  int done, taken;
  int rc;        /* 0 or the SG_E* code the caller gets */
  char msg[600]; /* detail of rc */
  uint8_t *resp; /* the encoded answer (rc == 0) */
  size_t resp_len;
};

/* Per group rank state; loop thread only. */
struct rank {
  char *metadata;   /* last checkpoint_metadata; NULL: never sent */
  char *handle;     /* last reconfigure_handle; NULL: never sent */
  unsigned waiting; /* Quorum waiters not yet in a round */
  int64_t step;     /* from its latest such call */
  int64_t commit_failures;
  int voted, vote_no;     /* ShouldCommit in the current round */
  unsigned nconns;        /* open connections it spoke on */
  int64_t grace_deadline; /* 0: none */
};

/* One open connection and the group ranks heard on it. */
struct conn {
  int64_t *ranks;
  size_t n, cap;
};

/* The lighthouse round handed to the quorum thread (or to the
 * asynchronous first attempt). */
struct job {
  int64_t step, commit_failures, timeout_ms;
  int shrink_only;
  char **handles; /* owned: one reconfigure handle per group rank, or NULL */
  size_t n_handles;
  int first_rc;        /* nonzero: attempt 0 was made asynchronously and
                          failed with this code (the quorum thread retries) */
  int first_local;     /* ... on a local timeout (its deadline passed) */
  char first_msg[256]; /* ... and its message */
  sg_deadline_t first_deadline; /* the asynchronous attempt's deadline */
};

static void job_clear(struct job *j) {
  for (size_t i = 0; i < j->n_handles; i++)
    sg_free(j->handles[i]);
  sg_free(j->handles);
  j->handles = NULL;
  j->n_handles = 0;
}

struct sg_mgr_server_s {
  /* options (strings owned) */
  char *replica_id, *name, *lighthouse_addr, *store_addr, *auth_token, *bind;
  int64_t logged_qid; /* quorum id last logged at info (quorum_mu) */
  char *address;
  int64_t world_size, hb_interval_ms, connect_timeout_ms, quorum_retries,
      grace_ms;
  sg_mgr_kill_cb kill;
  void *kill_ud;

  uv_loop_t loop;
  uv_thread_t thread;
  uv_async_t stop_async, result_async, local_async;
  uv_timer_t grace_timer, kill_timer;
  sg_rpc_server_t *rpc;
  int port;
  int handles_open;

  /* the commit round: loop thread, and in-process votes, under commit_mu
     (ranks[].voted and .vote_no, n_voted, n_no, commit_waiters) */
  pthread_mutex_t commit_mu;
  /* the quorum round: loop thread, in-process arrivals and the quorum
     thread's answers, under quorum_mu (ranks[].metadata, .handle, .waiting,
     .step, .commit_failures, n_arrived, last_*, quorum_waiters,
     round_in_flight, logged_qid, q_closed).  Order: quorum_mu, then
     commit_mu or mu or a call's mu. */
  pthread_mutex_t quorum_mu;
  int q_closed; /* the server is stopping: no round starts, none waits */

  /* loop thread only */
  int closing;
  struct rank *ranks; /* world_size entries */
  size_t n_arrived;   /* ranks with waiting > 0 */
  size_t n_voted, n_no;
  int last_shrink_only;
  int64_t last_timeout_ms;
  struct waiter *quorum_waiters, *commit_waiters;
  sg_map_t conns; /* "%llu" conn id -> struct conn * */
  int round_in_flight;
  char *kill_msg;

  /* shared: guarded by mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;     /* stop or leave (CLOCK_MONOTONIC) */
  pthread_cond_t job_cv; /* job posted, or stop: the quorum worker only, so
                            posting a job does not wake the heartbeat one */
  int stopping;
  int job_ready;
  struct job job;
  struct job ajob; /* the round whose first attempt runs asynchronously */
  int ajob_live;
  int result_ready, result_rc;
  char result_msg[256];
  Torchft__LighthouseQuorumResponse *result;
  sg_mgr_local_t *inbox, *inbox_tail; /* started in-process calls, in order */
  sg_mgr_local_t *cancels;            /* in-process calls that ended early */
  unsigned forks; /* sg_sock_fork_count() where the server started (its
                     sockets are registered, so a fork() counts) */

  atomic_int left; /* the group left the job (never cleared) */
  uint8_t *hb_req; /* encoded LighthouseHeartbeatRequest */
  size_t hb_req_len;
  sg_rpc_channel_t *lh;
  pthread_t hb_thread, q_thread;
  int hb_started, q_started, loop_started;
};

static const uint32_t qreq_strings[] = {3, 7};
static const sg__pb_spec_t qreq_spec = {qreq_strings, 2, NULL, 0};
static const sg__pb_spec_t no_strings_spec = {NULL, 0, NULL, 0};
static const uint32_t kill_strings[] = {1};
static const sg__pb_spec_t kill_spec = {kill_strings, 1, NULL, 0};
/* LighthouseQuorumResponse -> Quorum (field 1) -> QuorumMember (field 2) */
static const uint32_t member_strings[] = {1, 2, 3, 7, 9};
static const sg__pb_spec_t member_spec = {member_strings, 5, NULL, 0};
static const sg__pb_nested_t quorum_nested[] = {{2, &member_spec}};
static const sg__pb_spec_t quorum_spec = {NULL, 0, quorum_nested, 1};
static const sg__pb_nested_t lhresp_nested[] = {{1, &quorum_spec}};
static const sg__pb_spec_t lhresp_spec = {NULL, 0, lhresp_nested, 1};

/* ---- helpers ------------------------------------------------------------ */

static int64_t ms_to_ns(int64_t ms) {
  return ms > INT64_MAX / 1000000 ? INT64_MAX : ms * 1000000;
}

static void conn_key(uint64_t id, char out[24]) {
  snprintf(out, 24, "%llu", (unsigned long long)id);
}

/* ct_equal: constant-time comparison of two NUL-terminated strings. */
static int ct_equal(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  unsigned char d = (unsigned char)(la != lb);
  for (size_t i = 0; i < la; i++)
    d |= (unsigned char)(a[i] ^ b[i % (lb ? lb : 1)]);
  return d == 0;
}

static int authorized(const sg_mgr_server_t *s, sg_rpc_call_t *call) {
  if (!s->auth_token)
    return 1;
  const char *h = sg_rpc_call_metadata(call, "authorization");
  if (!h || strncmp(h, "Bearer ", 7) != 0)
    return 0;
  return ct_equal(h + 7, s->auth_token);
}

static void local_complete(sg_mgr_local_t *c, int status, const char *msg,
                           const uint8_t *body, size_t len);

/* respond: answer a call from the wire or from this process. */
static void respond(reply_t to, int status, const char *msg,
                    const uint8_t *body, size_t len) {
  if (to.call)
    sg_rpc_call_respond(to.call, status, msg, body, len);
  else
    local_complete(to.local, status, msg, body, len);
}

static reply_t wire(sg_rpc_call_t *call) {
  reply_t to = {call, NULL};
  return to;
}

static void respond_err(reply_t to, int status, const char *fmt, ...)
    SG_PRINTF(3, 4);
static void respond_err(reply_t to, int status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  sg_log(SG_LOG_DEBUG, LOG, "answering %s with %s: %s",
         to.call ? sg_rpc_call_method(to.call) : "an in-process call",
         sg__grpc_status_name(status), msg);
  respond(to, status, msg, NULL, 0);
}

/* check_wire: 0, or answers INVALID_ARGUMENT and returns -1. */
static int check_wire(sg_rpc_call_t *call, const uint8_t *body, size_t len,
                      const sg__pb_spec_t *spec) {
  uint32_t field = 0;
  int rc = sg__pb_check_strings(body, len, spec, &field);
  if (rc == SG_EINVAL) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT,
                "string field %u is not valid UTF-8 or contains NUL", field);
    return -1;
  }
  if (rc) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT,
                "malformed protobuf message");
    return -1;
  }
  return 0;
}

static void respond_msg(reply_t to, const ProtobufCMessage *m) {
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = sg_malloc(len ? len : 1);
  if (!buf) {
    respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED, "manager out of memory");
    return;
  }
  protobuf_c_message_pack(m, buf);
  respond(to, SG_GRPC_OK, NULL, buf, len);
  sg_free(buf);
}

static void waiter_unlink(struct waiter **head, struct waiter *w) {
  if (w->prev)
    w->prev->next = w->next;
  else
    *head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  w->prev = w->next = NULL;
}

static void waiter_push(struct waiter **head, struct waiter *w) {
  w->prev = NULL;
  w->next = *head;
  if (*head)
    (*head)->prev = w;
  *head = w;
}

static void local_unref(sg_mgr_local_t *c);

/* waiter_free: free a waiter that left its list (answered or not), and
 * drop the server's reference to its in-process call. */
static void waiter_free(struct waiter *w) {
  sg_mgr_local_t *c = w->to.local;
  if (c) {
    c->w = NULL;
    local_unref(c);
  }
  sg_free(w);
}

/* quorum_waiter_gone: bookkeeping when a Quorum waiter leaves the list. */
static void quorum_waiter_gone(sg_mgr_server_t *s, struct waiter *w) {
  if (!w->in_round) {
    struct rank *r = &s->ranks[w->group_rank];
    if (r->waiting && --r->waiting == 0)
      s->n_arrived--;
  }
}

/* fail_quorum_waiters: answer every waiting Quorum call with `status`
 * (quorum_mu held; on the loop, or where every waiter is in-process). */
static void fail_quorum_waiters(sg_mgr_server_t *s, int status,
                                const char *msg) {
  while (s->quorum_waiters) {
    struct waiter *w = s->quorum_waiters;
    waiter_unlink(&s->quorum_waiters, w);
    quorum_waiter_gone(s, w);
    respond(w->to, status, msg, NULL, 0);
    waiter_free(w);
  }
}

/* fail_all: answer every waiting call (both kinds) with `status`.  Loop
 * thread; takes quorum_mu and commit_mu. */
static void fail_all(sg_mgr_server_t *s, int status, const char *msg) {
  pthread_mutex_lock(&s->quorum_mu);
  fail_quorum_waiters(s, status, msg);
  pthread_mutex_unlock(&s->quorum_mu);
  pthread_mutex_lock(&s->commit_mu);
  while (s->commit_waiters) {
    struct waiter *w = s->commit_waiters;
    waiter_unlink(&s->commit_waiters, w);
    respond(w->to, status, msg, NULL, 0);
    waiter_free(w);
  }
  pthread_mutex_unlock(&s->commit_mu);
}

/* ---- leaving ------------------------------------------------------------ */

/*
 * leave: the replica group lost a rank.  Stop heartbeating, close the
 * lighthouse connection for good (the lighthouse sees it close and drops the
 * group at once) and fail every waiting call.  Loop thread.
 */
static void leave(sg_mgr_server_t *s, const char *why) {
  if (atomic_exchange(&s->left, 1))
    return;
  sg_log(SG_LOG_WARN, LOG,
         "[Replica %s] %s: the replica group leaves the job (it must restart "
         "to rejoin)",
         s->name, why);
  pthread_mutex_lock(&s->mu);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  sg_rpc_channel_abort(s->lh); /* wakes both workers, closes the socket */
  char msg[300];
  snprintf(msg, sizeof(msg), "replica group left: %s", why);
  fail_all(s, SG_GRPC_UNAVAILABLE, msg);
}

/* ---- liveness ----------------------------------------------------------- */

static void on_grace(uv_timer_t *t);

static void rearm_grace(sg_mgr_server_t *s) {
  int64_t best = INT64_MAX;
  for (int64_t g = 0; g < s->world_size; g++)
    if (s->ranks[g].grace_deadline && s->ranks[g].grace_deadline < best)
      best = s->ranks[g].grace_deadline;
  if (best == INT64_MAX || s->closing) {
    uv_timer_stop(&s->grace_timer);
    return;
  }
  int64_t now = sg_now_ns();
  int64_t ms = best <= now ? 0 : (best - now + 999999) / 1000000;
  uv_timer_start(&s->grace_timer, on_grace, (uint64_t)ms, 0);
}

static void on_grace(uv_timer_t *t) {
  sg_mgr_server_t *s = t->data;
  if (s->closing || atomic_load(&s->left))
    return;
  int64_t now = sg_now_ns();
  for (int64_t g = 0; g < s->world_size; g++) {
    struct rank *r = &s->ranks[g];
    if (r->grace_deadline && r->grace_deadline <= now && r->nconns == 0) {
      char why[160];
      snprintf(why, sizeof(why),
               "group rank %lld disconnected and stayed silent for %lld ms",
               (long long)g, (long long)s->grace_ms);
      r->grace_deadline = 0;
      leave(s, why);
      return;
    }
  }
  rearm_grace(s);
}

/* note_speaker: group rank `g` spoke on connection `conn_id`. */
static void note_speaker(sg_mgr_server_t *s, int64_t g, uint64_t conn_id) {
  struct rank *r = &s->ranks[g];
  if (r->grace_deadline) { /* came back in time */
    r->grace_deadline = 0;
    rearm_grace(s);
  }
  char key[24];
  conn_key(conn_id, key);
  struct conn *c = sg_map_get(&s->conns, key);
  if (!c) {
    c = sg_calloc(1, sizeof(*c));
    if (!c || sg_map_put(&s->conns, key, c, NULL) != 0) {
      sg_free(c);
      return; /* best effort: liveness then relies on the lighthouse */
    }
  }
  for (size_t i = 0; i < c->n; i++)
    if (c->ranks[i] == g)
      return;
  if (c->n == c->cap) {
    size_t cap = c->cap ? c->cap * 2 : 4;
    int64_t *p = sg_realloc(c->ranks, cap * sizeof(*p));
    if (!p)
      return;
    c->ranks = p;
    c->cap = cap;
  }
  c->ranks[c->n++] = g;
  r->nconns++;
}

static void on_conn_close(void *ud, uint64_t conn_id) {
  sg_mgr_server_t *s = ud;
  char key[24];
  conn_key(conn_id, key);
  struct conn *c = sg_map_del(&s->conns, key);
  if (!c)
    return;
  int armed = 0;
  int64_t deadline = sg_now_ns() + ms_to_ns(s->grace_ms);
  for (size_t i = 0; i < c->n; i++) {
    struct rank *r = &s->ranks[c->ranks[i]];
    if (r->nconns && --r->nconns == 0 && !s->closing && s->grace_ms >= 0 &&
        !atomic_load(&s->left)) {
      sg_log(SG_LOG_DEBUG, LOG,
             "[Replica %s] group rank %lld: last connection closed", s->name,
             (long long)c->ranks[i]);
      r->grace_deadline = deadline > 0 ? deadline : 1;
      armed = 1;
    }
  }
  sg_free(c->ranks);
  sg_free(c);
  if (armed)
    rearm_grace(s);
}

/* ---- quorum rounds ------------------------------------------------------ */

static int lh_start_async(sg_mgr_server_t *s, struct job *j);

/* maybe_start_round: every group rank waits and no round is under way:
 * send the group's request to the lighthouse asynchronously, or hand it to
 * the quorum thread.  quorum_mu held (on the loop, where every waiter is
 * in-process, or on the lighthouse channel's I/O thread). */
static void maybe_start_round(sg_mgr_server_t *s) {
  if (s->round_in_flight || s->q_closed || atomic_load(&s->left) ||
      s->n_arrived < (size_t)s->world_size)
    return;
  int64_t *steps = sg_malloc((size_t)s->world_size * sizeof(*steps));
  if (!steps) {
    fail_quorum_waiters(s, SG_GRPC_RESOURCE_EXHAUSTED, "manager out of memory");
    return;
  }
  struct job j = {0};
  for (int64_t g = 0; g < s->world_size; g++) {
    steps[g] = s->ranks[g].step;
    if (s->ranks[g].commit_failures > j.commit_failures)
      j.commit_failures = s->ranks[g].commit_failures;
  }
  int disagree = 0;
  j.step = sg__mgr_group_step(steps, (size_t)s->world_size, &disagree);
  if (disagree) {
    char line[256];
    size_t off = 0;
    for (int64_t g = 0; g < s->world_size && off + 16 < sizeof(line); g++) {
      int n = snprintf(line + off, sizeof(line) - off, "%s%lld", g ? "," : "",
                       (long long)steps[g]);
      if (n < 0)
        break;
      off += (size_t)n;
    }
    if (off >= sizeof(line) - 16)
      snprintf(line + sizeof(line) - 4, 4, "...");
    sg_log(SG_LOG_WARN, LOG,
           "[Replica %s] group ranks disagree on the step [%s]; using the "
           "minimum %lld",
           s->name, line, (long long)j.step);
  }
  sg_free(steps);
  /* reconfigure handles travel only when some rank sent one, so the
   * request stays what an older torchft sends otherwise */
  int any_handle = 0;
  for (int64_t g = 0; g < s->world_size; g++)
    any_handle |= s->ranks[g].handle && s->ranks[g].handle[0];
  if (any_handle) {
    j.handles = sg_calloc((size_t)s->world_size, sizeof(char *));
    int nomem = !j.handles;
    for (int64_t g = 0; !nomem && g < s->world_size; g++) {
      const char *h = s->ranks[g].handle;
      j.handles[g] = sg_strdup(h ? h : "");
      j.n_handles = (size_t)g + 1;
      nomem = !j.handles[g];
    }
    if (nomem) {
      job_clear(&j);
      fail_quorum_waiters(s, SG_GRPC_RESOURCE_EXHAUSTED,
                          "manager out of memory");
      return;
    }
  }
  /* torchft takes shrink_only and the timeout from the last-arriving rank */
  j.shrink_only = s->last_shrink_only;
  j.timeout_ms = s->last_timeout_ms;
  for (struct waiter *w = s->quorum_waiters; w; w = w->next)
    w->in_round = 1;
  for (int64_t g = 0; g < s->world_size; g++)
    s->ranks[g].waiting = 0;
  s->n_arrived = 0;
  s->round_in_flight = 1;
  if (lh_start_async(s, &j))
    return;
  pthread_mutex_lock(&s->mu);
  s->job = j;
  s->job_ready = 1;
  pthread_mutex_unlock(&s->mu);
  /* after the unlock: the woken quorum thread (often on this core) takes
   * mu at once, and would otherwise block on it and be woken twice */
  pthread_cond_signal(&s->job_cv);
}

/* member_of: the participant of `q` named `id`; `hint` is where it is when
 * `q` is sorted like the results (the lighthouse sorts by replica id). */
static const Torchft__QuorumMember *member_of(const Torchft__Quorum *q,
                                              const char *id, size_t hint) {
  if (hint < q->n_participants &&
      strcmp(q->participants[hint]->replica_id, id) == 0)
    return q->participants[hint];
  for (size_t i = 0; i < q->n_participants; i++)
    if (strcmp(q->participants[i]->replica_id, id) == 0)
      return q->participants[i];
  return NULL;
}

/* encode_results: answer `call` with `r`, and with group rank g's
 * reconfigure handle of every participant, in the order of r->replica_ids
 * (`scratch` has room for one pointer per participant). */
static void encode_results(reply_t to, const sg__mgr_results_t *r,
                           const Torchft__Quorum *q, int64_t g,
                           char **scratch) {
  Torchft__ManagerQuorumResponse m = TORCHFT__MANAGER_QUORUM_RESPONSE__INIT;
  m.quorum_id = r->quorum_id;
  m.recover_src_manager_address = (char *)r->recover_src_manager_address;
  if (r->has_recover_src_replica_rank) {
    m._recover_src_replica_rank_case =
        TORCHFT__MANAGER_QUORUM_RESPONSE___RECOVER_SRC_REPLICA_RANK_RECOVER_SRC_REPLICA_RANK;
    m.recover_src_replica_rank = r->recover_src_replica_rank;
  }
  m.n_recover_dst_replica_ranks = r->n_recover_dst;
  m.recover_dst_replica_ranks = r->recover_dst_replica_ranks;
  m.store_address = (char *)r->store_address;
  m.max_step = r->max_step;
  if (r->has_max_replica_rank) {
    m._max_replica_rank_case =
        TORCHFT__MANAGER_QUORUM_RESPONSE___MAX_REPLICA_RANK_MAX_REPLICA_RANK;
    m.max_replica_rank = r->max_replica_rank;
  }
  m.max_world_size = r->max_world_size;
  m.replica_rank = r->replica_rank;
  m.replica_world_size = r->replica_world_size;
  m.heal = r->heal != 0;
  m.commit_failures = r->commit_failures;
  m.n_replica_ids = r->n_replica_ids;
  m.replica_ids = (char **)r->replica_ids;
  m.n_up_to_date_manager_addresses = r->n_up_to_date;
  m.up_to_date_manager_addresses = (char **)r->up_to_date_addresses;
  int any_handle = 0;
  for (size_t i = 0; i < r->n_replica_ids; i++) {
    const Torchft__QuorumMember *p = member_of(q, r->replica_ids[i], i);
    scratch[i] = p && (size_t)g < p->n_reconfigure_handles
                     ? p->reconfigure_handles[g]
                     : (char *)"";
    any_handle |= scratch[i][0] != 0;
  }
  if (any_handle) {
    m.n_reconfigure_handles = r->n_replica_ids;
    m.reconfigure_handles = scratch;
  }
  respond_msg(to, &m.base);
}

/* deliver: answer every waiting Quorum call with the round's outcome
 * (quorum_mu held; on the loop, or where every waiter is in-process). */
static void deliver(sg_mgr_server_t *s, int rc, const char *msg,
                    Torchft__LighthouseQuorumResponse *resp) {
  sg__mgr_peer_t *peers = NULL;
  char **scratch = NULL;
  size_t n = 0;
  int64_t qid = 0;
  if (!rc) {
    Torchft__Quorum *q = resp->quorum;
    n = q->n_participants;
    qid = q->quorum_id;
    peers = sg_calloc(n ? n : 1, sizeof(*peers));
    scratch = sg_calloc(n ? n : 1, sizeof(*scratch));
    if (!peers || !scratch) {
      sg_free(peers);
      peers = NULL;
      rc = SG_ENOMEM;
      msg = "manager out of memory";
    }
    for (size_t i = 0; peers && i < n; i++) {
      const Torchft__QuorumMember *p = q->participants[i];
      peers[i].replica_id = p->replica_id;
      peers[i].address = p->address;
      peers[i].store_address = p->store_address;
      peers[i].step = p->step;
      peers[i].world_size = p->world_size;
      peers[i].commit_failures = p->commit_failures;
      peers[i].shrink_only = p->shrink_only;
    }
  }
  if (rc) {
    sg_log(SG_LOG_WARN, LOG, "[Replica %s] quorum failed: %s", s->name, msg);
    while (s->quorum_waiters) {
      struct waiter *w = s->quorum_waiters;
      waiter_unlink(&s->quorum_waiters, w);
      quorum_waiter_gone(s, w);
      respond(w->to,
              rc == SG_ENOMEM ? SG_GRPC_RESOURCE_EXHAUSTED : SG_GRPC_INTERNAL,
              msg, NULL, 0);
      waiter_free(w);
    }
    sg_free(peers);
    sg_free(scratch);
    return;
  }
  int logged = 0;
  while (s->quorum_waiters) {
    struct waiter *w = s->quorum_waiters;
    waiter_unlink(&s->quorum_waiters, w);
    quorum_waiter_gone(s, w);
    sg__mgr_results_t r;
    sg_err_t e;
    sg_err_clear(&e);
    int crc = sg__mgr_compute_results(qid, peers, n, s->replica_id,
                                      w->group_rank, w->init_sync, &r, &e);
    if (crc == 0) {
      if (!logged) {
        /* info when the quorum changes or we heal; every step is debug */
        sg_log_level_t level =
            qid != s->logged_qid || r.heal ? SG_LOG_INFO : SG_LOG_DEBUG;
        s->logged_qid = qid;
        sg_log(level, LOG,
               "[Replica %s] quorum %lld: replica_rank %lld of %lld, "
               "max_step %lld, heal %s",
               s->name, (long long)qid, (long long)r.replica_rank,
               (long long)r.replica_world_size, (long long)r.max_step,
               r.heal ? "yes" : "no");
        logged = 1;
      }
      encode_results(w->to, &r, resp->quorum, w->group_rank, scratch);
    } else {
      respond_err(w->to,
                  crc == SG_ENOTFOUND ? SG_GRPC_NOT_FOUND
                  : crc == SG_ENOMEM  ? SG_GRPC_RESOURCE_EXHAUSTED
                                      : SG_GRPC_INTERNAL,
                  "%s", e.msg[0] ? e.msg : sg_strerror(crc));
    }
    sg__mgr_results_free(&r);
    waiter_free(w);
  }
  sg_free(peers);
  sg_free(scratch);
}

static void on_result(uv_async_t *a) {
  sg_mgr_server_t *s = a->data;
  pthread_mutex_lock(&s->mu);
  if (!s->result_ready) {
    pthread_mutex_unlock(&s->mu);
    return;
  }
  Torchft__LighthouseQuorumResponse *resp = s->result;
  int rc = s->result_rc;
  char msg[256];
  memcpy(msg, s->result_msg, sizeof(msg));
  s->result = NULL;
  s->result_ready = 0;
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_lock(&s->quorum_mu);
  s->round_in_flight = 0;
  if (!s->q_closed && !atomic_load(&s->left))
    deliver(s, rc, msg, resp);
  maybe_start_round(s);
  pthread_mutex_unlock(&s->quorum_mu);
  if (resp)
    torchft__lighthouse_quorum_response__free_unpacked(resp, &sg__pb_allocator);
}

/* all_local: every call in the list is an in-process one (quorum_mu). */
static int all_local(const struct waiter *w) {
  for (; w; w = w->next)
    if (w->to.call)
      return 0;
  return 1;
}

/*
 * deliver_here: the quorum thread (or the I/O thread, for an asynchronous
 * attempt) answers the round itself when only in-process calls wait
 * (nobody on the wire needs the loop to answer), so the loop is not woken.
 * Returns 1 if it did (the result is consumed and freed); 0 leaves it to the
 * loop.
 */
static int deliver_here(sg_mgr_server_t *s, int rc, const char *msg,
                        Torchft__LighthouseQuorumResponse *resp) {
  pthread_mutex_lock(&s->quorum_mu);
  if (s->q_closed || atomic_load(&s->left) || !all_local(s->quorum_waiters)) {
    pthread_mutex_unlock(&s->quorum_mu);
    return 0;
  }
  s->round_in_flight = 0;
  deliver(s, rc, msg, resp);
  maybe_start_round(s); /* only in-process calls can be waiting here */
  pthread_mutex_unlock(&s->quorum_mu);
  if (resp)
    torchft__lighthouse_quorum_response__free_unpacked(resp, &sg__pb_allocator);
  return 1;
}

/* ---- calls -------------------------------------------------------------- */

/* add_waiter: the waiter of `to`; an in-process call's waiter holds the
 * server's reference to it from here on. */
static struct waiter *add_waiter(sg_mgr_server_t *s, reply_t to,
                                 enum waiter_kind kind, int64_t g) {
  struct waiter *w = sg_calloc(1, sizeof(*w));
  if (!w) {
    respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED, "manager out of memory");
    return NULL;
  }
  w->kind = kind;
  w->to = to;
  w->group_rank = g;
  waiter_push(kind == W_QUORUM ? &s->quorum_waiters : &s->commit_waiters, w);
  if (to.call)
    sg_rpc_call_set_user(to.call, w);
  else {
    to.local->w = w;
    to.local->had_waiter = 1;
  }
  return w;
}

/* round_mu: the lock the round of calls of `kind` is under. */
static pthread_mutex_t *round_mu(sg_mgr_server_t *s, enum waiter_kind kind) {
  return kind == W_QUORUM ? &s->quorum_mu : &s->commit_mu;
}

/* waiter_drop: the caller of w's call gave up (its round's lock held).  A
 * Quorum call not yet in a round no longer counts as arrived; a vote stays
 * counted (torchft).  Drops an in-process call's server reference. */
static void waiter_drop(sg_mgr_server_t *s, struct waiter *w) {
  if (w->kind == W_QUORUM) {
    waiter_unlink(&s->quorum_waiters, w);
    quorum_waiter_gone(s, w);
  } else {
    waiter_unlink(&s->commit_waiters, w);
  }
  waiter_free(w);
}

/* waiter_cancel: waiter_drop for a call from the wire. */
static void waiter_cancel(sg_mgr_server_t *s, struct waiter *w) {
  pthread_mutex_t *mu = round_mu(s, w->kind);
  pthread_mutex_lock(mu);
  waiter_drop(s, w);
  pthread_mutex_unlock(mu);
}

/* local_cancel: forget the in-process call `c` whose caller gave up, if it
 * still waits (its waiter is read under the lock its round is under). */
static void local_cancel(sg_mgr_server_t *s, sg_mgr_local_t *c) {
  pthread_mutex_t *mu = round_mu(s, c->kind);
  pthread_mutex_lock(mu);
  if (c->w)
    waiter_drop(s, c->w);
  pthread_mutex_unlock(mu);
}

static int check_rank(sg_mgr_server_t *s, reply_t to, int64_t g) {
  if (g < 0 || g >= s->world_size) {
    respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                "group_rank %lld out of range [0, %lld)", (long long)g,
                (long long)s->world_size);
    return -1;
  }
  return 0;
}

static int check_left(sg_mgr_server_t *s, reply_t to) {
  if (!atomic_load(&s->left))
    return 0;
  respond_err(to, SG_GRPC_UNAVAILABLE,
              "replica group left the job; it must restart");
  return -1;
}

/* A Quorum request, from the wire or from this process. */
struct qargs {
  int64_t group_rank, step, commit_failures;
  int shrink_only, init_sync;
  const char *metadata, *handle; /* borrowed */
  sg_deadline_t deadline;
  int has_conn; /* from the wire: conn_id counts for group liveness */
  uint64_t conn_id;
};

/* quorum_arrive_locked: group rank a->group_rank waits for this step's
 * quorum (quorum_mu held). */
static void quorum_arrive_locked(sg_mgr_server_t *s, reply_t to,
                                 const struct qargs *a) {
  if (check_rank(s, to, a->group_rank) || check_left(s, to))
    return;
  if (s->q_closed) {
    respond_err(to, SG_GRPC_UNAVAILABLE, "manager shutting down");
    return;
  }
  if (strlen(a->metadata) > SG_MGR_MAX_METADATA_LEN) {
    respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                "checkpoint_metadata too long (max %d bytes)",
                SG_MGR_MAX_METADATA_LEN);
    return;
  }
  if (strlen(a->handle) > SG_MGR_MAX_METADATA_LEN) {
    respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                "reconfigure_handle too long (max %d bytes)",
                SG_MGR_MAX_METADATA_LEN);
    return;
  }
  struct rank *r = &s->ranks[a->group_rank];
  char *md = sg_strdup(a->metadata);
  char *handle = sg_strdup(a->handle);
  if (!md || !handle) {
    sg_free(md);
    sg_free(handle);
    respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED, "manager out of memory");
    return;
  }
  struct waiter *w = add_waiter(s, to, W_QUORUM, a->group_rank);
  if (!w) {
    sg_free(md);
    sg_free(handle);
    return;
  }
  sg_free(r->handle);
  r->handle = handle;
  w->init_sync = a->init_sync != 0;
  sg_free(r->metadata);
  r->metadata = md;
  r->step = a->step;
  r->commit_failures = a->commit_failures;
  if (r->waiting++ == 0)
    s->n_arrived++;
  s->last_shrink_only = a->shrink_only != 0;
  s->last_timeout_ms = sg_deadline_left_ms(a->deadline);
  maybe_start_round(s);
}

/* quorum_arrive: quorum_arrive_locked from the loop. */
static void quorum_arrive(sg_mgr_server_t *s, reply_t to,
                          const struct qargs *a) {
  pthread_mutex_lock(&s->quorum_mu);
  quorum_arrive_locked(s, to, a);
  pthread_mutex_unlock(&s->quorum_mu);
  if (a->has_conn && a->group_rank >= 0 && a->group_rank < s->world_size)
    note_speaker(s, a->group_rank, a->conn_id);
}

static void handle_quorum(sg_mgr_server_t *s, sg_rpc_call_t *call,
                          const uint8_t *body, size_t len) {
  Torchft__ManagerQuorumRequest *req = NULL;
  if (!sg_rpc_call_metadata(call, "grpc-timeout")) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT, "missing timeout");
    return;
  }
  if (check_wire(call, body, len, &qreq_spec))
    return;
  req = torchft__manager_quorum_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT,
                "invalid ManagerQuorumRequest");
    return;
  }
  struct qargs a = {0};
  a.group_rank = req->group_rank;
  a.step = req->step;
  a.commit_failures = req->commit_failures;
  a.shrink_only = req->shrink_only != 0;
  a.init_sync = req->init_sync != 0;
  a.metadata = req->checkpoint_metadata;
  a.handle = req->reconfigure_handle;
  a.deadline = sg_rpc_call_deadline(call);
  a.has_conn = 1;
  a.conn_id = sg_rpc_call_conn_id(call);
  quorum_arrive(s, wire(call), &a);
  torchft__manager_quorum_request__free_unpacked(req, &sg__pb_allocator);
}

/* encode_decision: a ShouldCommitResponse into buf (16 bytes); its length. */
static size_t encode_decision(int decision, uint8_t *buf) {
  Torchft__ShouldCommitResponse m = TORCHFT__SHOULD_COMMIT_RESPONSE__INIT;
  m.should_commit = decision;
  return torchft__should_commit_response__pack(&m, buf);
}

/* commit_round_end: the round decided `decision`: log it and forget the
 * round's votes (commit_mu held). */
static void commit_round_end(sg_mgr_server_t *s, int decision) {
  sg_log(SG_LOG_DEBUG, LOG, "[Replica %s] should_commit: %s", s->name,
         decision ? "yes" : "no");
  for (int64_t g = 0; g < s->world_size; g++)
    s->ranks[g].voted = s->ranks[g].vote_no = 0;
  s->n_voted = s->n_no = 0;
}

/* finish_commit_round: answer every vote of the round; commit_mu held. */
static void finish_commit_round(sg_mgr_server_t *s) {
  int decision = s->n_no == 0;
  uint8_t buf[16];
  size_t len = encode_decision(decision, buf);
  while (s->commit_waiters) {
    struct waiter *w = s->commit_waiters;
    waiter_unlink(&s->commit_waiters, w);
    respond(w->to, SG_GRPC_OK, NULL, buf, len);
    waiter_free(w);
  }
  commit_round_end(s, decision);
}

/* commit_vote: group rank g votes; the round ends with the last vote. */
static void commit_vote(sg_mgr_server_t *s, reply_t to, int64_t g, int vote,
                        int has_conn, uint64_t conn_id) {
  if (check_rank(s, to, g) || check_left(s, to))
    return;
  if (has_conn)
    note_speaker(s, g, conn_id);
  pthread_mutex_lock(&s->commit_mu);
  if (!add_waiter(s, to, W_COMMIT, g)) {
    pthread_mutex_unlock(&s->commit_mu);
    return;
  }
  struct rank *r = &s->ranks[g];
  /* torchft: a no vote sticks for the round; the step is not checked */
  if (!vote && !r->vote_no) {
    r->vote_no = 1;
    s->n_no++;
  }
  if (!r->voted) {
    r->voted = 1;
    s->n_voted++;
  }
  if (s->n_voted == (size_t)s->world_size)
    finish_commit_round(s);
  pthread_mutex_unlock(&s->commit_mu);
}

static void handle_should_commit(sg_mgr_server_t *s, sg_rpc_call_t *call,
                                 const uint8_t *body, size_t len) {
  if (check_wire(call, body, len, &no_strings_spec))
    return;
  Torchft__ShouldCommitRequest *req =
      torchft__should_commit_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT,
                "invalid ShouldCommitRequest");
    return;
  }
  commit_vote(s, wire(call), req->group_rank, req->should_commit != 0, 1,
              sg_rpc_call_conn_id(call));
  torchft__should_commit_request__free_unpacked(req, &sg__pb_allocator);
}

static void handle_checkpoint_metadata(sg_mgr_server_t *s, sg_rpc_call_t *call,
                                       const uint8_t *body, size_t len) {
  if (check_wire(call, body, len, &no_strings_spec))
    return;
  Torchft__CheckpointMetadataRequest *req =
      torchft__checkpoint_metadata_request__unpack(&sg__pb_allocator, len,
                                                   body);
  if (!req) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT,
                "invalid CheckpointMetadataRequest");
    return;
  }
  pthread_mutex_lock(&s->quorum_mu);
  if (req->rank < 0 || req->rank >= s->world_size ||
      !s->ranks[req->rank].metadata) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT, "rank not found");
  } else {
    Torchft__CheckpointMetadataResponse m =
        TORCHFT__CHECKPOINT_METADATA_RESPONSE__INIT;
    m.checkpoint_metadata = s->ranks[req->rank].metadata;
    respond_msg(wire(call), &m.base);
  }
  pthread_mutex_unlock(&s->quorum_mu);
  torchft__checkpoint_metadata_request__free_unpacked(req, &sg__pb_allocator);
}

static void on_kill_timer(uv_timer_t *t) {
  sg_mgr_server_t *s = t->data;
  char *msg = s->kill_msg;
  s->kill_msg = NULL;
  if (s->kill && !s->closing)
    s->kill(s->kill_ud, msg ? msg : "");
  sg_free(msg);
}

static void handle_kill(sg_mgr_server_t *s, sg_rpc_call_t *call,
                        const uint8_t *body, size_t len) {
  if (check_wire(call, body, len, &kill_spec))
    return;
  Torchft__KillRequest *req =
      torchft__kill_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    respond_err(wire(call), SG_GRPC_INVALID_ARGUMENT, "invalid KillRequest");
    return;
  }
  sg_log(SG_LOG_WARN, LOG, "[Replica %s] got kill request: %.1000s", s->name,
         req->msg);
  char *msg = sg_strdup(req->msg);
  torchft__kill_request__free_unpacked(req, &sg__pb_allocator);
  sg_rpc_call_respond(call, SG_GRPC_OK, NULL, NULL, 0);
  sg_free(s->kill_msg);
  s->kill_msg = msg; /* NULL on ENOMEM: the handler gets "" */
  uv_timer_start(&s->kill_timer, on_kill_timer, KILL_DELAY_MS, 0);
}

static void on_call(void *ud, sg_rpc_call_t *call) {
  sg_mgr_server_t *s = ud;
  const char *method = sg_rpc_call_method(call);
  size_t len = 0;
  const uint8_t *body = sg_rpc_call_body(call, &len);
  if (s->closing) {
    respond_err(wire(call), SG_GRPC_UNAVAILABLE, "manager shutting down");
  } else if (!authorized(s, call)) {
    respond_err(wire(call), SG_GRPC_UNAUTHENTICATED,
                "missing or wrong authorization token");
  } else if (strcmp(method, "/torchft.ManagerService/Quorum") == 0) {
    handle_quorum(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/ShouldCommit") == 0) {
    handle_should_commit(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/CheckpointMetadata") ==
             0) {
    handle_checkpoint_metadata(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/Kill") == 0) {
    handle_kill(s, call, body, len);
  } else {
    respond_err(wire(call), SG_GRPC_UNIMPLEMENTED, "unknown method %.200s",
                method);
  }
}

/* on_call_cancel: the caller gave up (deadline, reset, closed).  A Quorum
 * call not yet in a round no longer counts as arrived; a vote stays counted
 * (torchft). */
static void on_call_cancel(void *ud, sg_rpc_call_t *call) {
  sg_mgr_server_t *s = ud;
  struct waiter *w = sg_rpc_call_user(call);
  if (w)
    waiter_cancel(s, w);
}

/* ---- in-process calls -------------------------------------------------- */

static void local_unref(sg_mgr_local_t *c) {
  pthread_mutex_lock(&c->mu);
  int last = --c->refs == 0;
  pthread_mutex_unlock(&c->mu);
  if (!last)
    return;
  sg_free(c->metadata);
  sg_free(c->handle);
  sg_free(c->resp);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  sg_free(c);
}

/* local_set_done: complete `c` with mu held (no-op if it is complete);
 * the caller then wakes its waiters (c->cv).  Returns 1 if it completed. */
static int local_set_done(sg_mgr_local_t *c, int rc, const char *msg) {
  if (c->done)
    return 0;
  c->done = 1;
  c->srv = NULL;
  c->rc = rc;
  snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
  return 1;
}

/*
 * local_complete: the server's answer to an in-process call, turned into
 * what the wire client would return for the same answer (a copy of the
 * message, or the error code and 'status: NAME, message: "..."'; and, as
 * for a wire call, SG_ETIMEDOUT when the answer comes after the call's
 * deadline: a round that failed on the lighthouse deadline the call gave
 * it is a timeout for the caller).  Whoever answers calls of its kind.
 */
static void local_complete(sg_mgr_local_t *c, int status, const char *msg,
                           const uint8_t *body, size_t len) {
  uint8_t *copy = NULL;
  char m[sizeof(c->msg)];
  if (status == SG_GRPC_OK && len) {
    copy = sg_malloc(len);
    if (copy)
      memcpy(copy, body, len);
    else {
      status = SG_GRPC_RESOURCE_EXHAUSTED;
      msg = "manager out of memory";
    }
  }
  int late = sg_now_ns() >= c->deadline;
  if (status != SG_GRPC_OK)
    snprintf(m, sizeof(m), "status: %s, message: \"%s\"",
             sg__grpc_status_name(status), msg ? msg : "");
  int woke = 0;
  pthread_mutex_lock(&c->mu);
  if (!c->done && late) {
    woke = local_set_done(c, SG_ETIMEDOUT, "deadline exceeded");
  } else if (!c->done) {
    woke = local_set_done(
        c, status == SG_GRPC_OK ? 0 : sg__grpc_status_to_err(status),
        status == SG_GRPC_OK ? "" : m);
    c->resp = copy;
    c->resp_len = len;
    copy = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  /* after the unlock, so the woken caller does not block on c->mu; c stays
   * alive here: whoever answers holds the server's reference to it */
  if (woke)
    pthread_cond_broadcast(&c->cv);
  sg_free(copy);
}

/* local_take: detach the inbox and the cancel list (s->mu held). */
static void local_take(sg_mgr_server_t *s, sg_mgr_local_t **inbox,
                       sg_mgr_local_t **cancels) {
  *inbox = s->inbox;
  *cancels = s->cancels;
  s->inbox = s->inbox_tail = s->cancels = NULL;
}

/* local_qargs: the arguments of the in-process Quorum call `c`. */
static struct qargs local_qargs(const sg_mgr_local_t *c) {
  struct qargs a = {0};
  a.group_rank = c->group_rank;
  a.step = c->step;
  a.commit_failures = c->commit_failures;
  a.shrink_only = c->shrink_only;
  a.init_sync = c->init_sync;
  a.metadata = c->metadata;
  a.handle = c->handle;
  a.deadline = c->deadline;
  return a;
}

/* local_run: hand one started call to its handler (loop thread).  The
 * server's reference passes to its waiter (which may be answered and
 * freed before the handler returns), or is dropped here when the call got
 * no waiter (refused at once, or ended before it ran). */
static void local_run(sg_mgr_server_t *s, sg_mgr_local_t *c) {
  pthread_mutex_lock(&c->mu);
  int ended = c->done;
  c->refs++; /* ours: an answer below may drop every other one */
  pthread_mutex_unlock(&c->mu);
  reply_t to = {NULL, c};
  if (ended) {
    /* its caller gave up before we saw it: it never arrived */
  } else if (s->closing) {
    respond_err(to, SG_GRPC_UNAVAILABLE, "manager shutting down");
  } else if (c->kind == W_QUORUM) {
    struct qargs a = local_qargs(c);
    quorum_arrive(s, to, &a);
  } else {
    commit_vote(s, to, c->group_rank, c->vote, 0, 0);
  }
  if (!c->had_waiter) /* answered without waiting, or not run */
    local_unref(c);
  local_unref(c);
}

/* on_local: run the calls started since the last wakeup, in order, then
 * forget the ones whose callers gave up.  Loop thread. */
static void on_local(uv_async_t *a) {
  sg_mgr_server_t *s = a->data;
  sg_mgr_local_t *inbox, *cancels;
  pthread_mutex_lock(&s->mu);
  local_take(s, &inbox, &cancels);
  pthread_mutex_unlock(&s->mu);
  while (inbox) {
    sg_mgr_local_t *c = inbox;
    inbox = c->next;
    c->next = NULL;
    local_run(s, c);
  }
  while (cancels) {
    sg_mgr_local_t *c = cancels;
    cancels = c->cnext;
    c->cnext = NULL;
    local_cancel(s, c);
    local_unref(c); /* the cancellation's */
  }
}

/* local_drain: once the loop has ended, fail what is left (stop). */
static void local_drain(sg_mgr_server_t *s) {
  sg_mgr_local_t *inbox, *cancels;
  pthread_mutex_lock(&s->mu);
  local_take(s, &inbox, &cancels);
  pthread_mutex_unlock(&s->mu);
  while (inbox) {
    sg_mgr_local_t *c = inbox;
    inbox = c->next;
    local_complete(c, SG_GRPC_UNAVAILABLE, "manager shutting down", NULL, 0);
    local_unref(c);
  }
  while (cancels) {
    sg_mgr_local_t *c = cancels;
    cancels = c->cnext;
    local_unref(c);
  }
}

static int local_new(sg_mgr_server_t *s, enum waiter_kind kind, int64_t g,
                     int64_t step, sg_deadline_t deadline, sg_mgr_local_t **out,
                     sg_err_t *err) {
  *out = NULL;
  if (sg_sock_fork_count() != s->forks)
    return sg_err_set(err, SG_ESTATE,
                      "the manager server runs in the parent process");
  sg_mgr_local_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int rc = pthread_mutex_init(&c->mu, NULL);
  if (!rc) {
    rc = pthread_cond_init(&c->cv, &ca);
    if (rc)
      pthread_mutex_destroy(&c->mu);
  }
  pthread_condattr_destroy(&ca);
  if (rc) {
    sg_free(c);
    return sg_err_set(err, SG_ENOMEM, "cannot make a condition variable");
  }
  c->kind = kind;
  c->group_rank = g;
  c->step = step;
  c->deadline = deadline;
  c->refs = 1;
  c->forks = s->forks;
  *out = c;
  return 0;
}

/* local_post: hand `c` to the loop (or fail it if the server stops). */
static void local_post(sg_mgr_server_t *s, sg_mgr_local_t *c) {
  c->srv = s;
  c->refs = 2; /* the caller's and the server's */
  pthread_mutex_lock(&s->mu);
  if (s->stopping) {
    pthread_mutex_unlock(&s->mu);
    local_complete(c, SG_GRPC_UNAVAILABLE, "manager shutting down", NULL, 0);
    local_unref(c);
    return;
  }
  if (s->inbox_tail)
    s->inbox_tail->next = c;
  else
    s->inbox = c;
  s->inbox_tail = c;
  uv_async_send(&s->local_async);
  pthread_mutex_unlock(&s->mu);
}

/*
 * arrive_here: the Quorum call `c` (not yet posted) arrives on the caller's
 * thread when only in-process calls wait, so the loop is not woken (the
 * round, if it starts, goes straight to the quorum thread).  Returns 1 if
 * it did (answered or waiting); 0 leaves it to the loop.
 */
static int arrive_here(sg_mgr_server_t *s, sg_mgr_local_t *c) {
  pthread_mutex_lock(&s->quorum_mu);
  if (s->q_closed || !all_local(s->quorum_waiters)) {
    pthread_mutex_unlock(&s->quorum_mu);
    return 0;
  }
  c->srv = s;
  c->refs = 2; /* the caller's and the server's: nobody else has c yet */
  struct qargs a = local_qargs(c);
  reply_t to = {NULL, c};
  quorum_arrive_locked(s, to, &a);
  int had_waiter = c->had_waiter;
  pthread_mutex_unlock(&s->quorum_mu);
  if (!had_waiter) /* refused at once */
    local_unref(c);
  return 1;
}

int sg_mgr_local_quorum_start(sg_mgr_server_t *s, int64_t group_rank,
                              int64_t step, const char *checkpoint_metadata,
                              int shrink_only, int init_sync,
                              int64_t commit_failures,
                              const char *reconfigure_handle,
                              sg_deadline_t deadline, sg_mgr_local_t **out,
                              sg_err_t *err) {
  sg_mgr_local_t *c = NULL;
  int rc = local_new(s, W_QUORUM, group_rank, step, deadline, &c, err);
  if (rc)
    return rc;
  c->metadata = sg_strdup(checkpoint_metadata ? checkpoint_metadata : "");
  c->handle = sg_strdup(reconfigure_handle ? reconfigure_handle : "");
  if (!c->metadata || !c->handle) {
    local_unref(c);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  c->shrink_only = shrink_only != 0;
  c->init_sync = init_sync != 0;
  c->commit_failures = commit_failures;
  if (!arrive_here(s, c))
    local_post(s, c);
  *out = c;
  return 0;
}

/*
 * commit_here: the vote of `c` (not yet posted) ends a round in which no
 * other call waits: decide it on the caller's thread, as the loop would,
 * and complete `c`.  Returns 1 if it did; 0 leaves everything else to the
 * loop (refusals included, so their answers stay the loop's).
 */
static int commit_here(sg_mgr_server_t *s, sg_mgr_local_t *c) {
  int64_t g = c->group_rank;
  if (g < 0 || g >= s->world_size || atomic_load(&s->left))
    return 0;
  pthread_mutex_lock(&s->mu);
  int stopping = s->stopping;
  pthread_mutex_unlock(&s->mu);
  if (stopping)
    return 0;
  pthread_mutex_lock(&s->commit_mu);
  struct rank *r = &s->ranks[g];
  size_t voted = s->n_voted + (r->voted ? 0 : 1);
  if (s->commit_waiters || voted != (size_t)s->world_size) {
    pthread_mutex_unlock(&s->commit_mu);
    return 0;
  }
  /* a no vote sticks for the round, as in commit_vote */
  size_t no = s->n_no + (!c->vote && !r->vote_no ? 1 : 0);
  int decision = no == 0;
  commit_round_end(s, decision);
  pthread_mutex_unlock(&s->commit_mu);
  uint8_t buf[16];
  size_t len = encode_decision(decision, buf);
  local_complete(c, SG_GRPC_OK, NULL, buf, len);
  return 1;
}

int sg_mgr_local_should_commit_start(sg_mgr_server_t *s, int64_t group_rank,
                                     int64_t step, int should_commit,
                                     sg_deadline_t deadline,
                                     sg_mgr_local_t **out, sg_err_t *err) {
  sg_mgr_local_t *c = NULL;
  int rc = local_new(s, W_COMMIT, group_rank, step, deadline, &c, err);
  if (rc)
    return rc;
  c->vote = should_commit != 0;
  if (!commit_here(s, c))
    local_post(s, c);
  *out = c;
  return 0;
}

/* local_end: the caller ends `c` early with `rc`; the loop is told to
 * forget it.  Takes c->mu, then s->mu (the loop never holds s->mu while it
 * takes c->mu, and it clears c->srv under c->mu before s goes away). */
static void local_end(sg_mgr_local_t *c, int rc, const char *msg) {
  if (sg_sock_fork_count() != c->forks)
    return; /* a forked child: its lock may have been held at fork() */
  pthread_mutex_lock(&c->mu);
  sg_mgr_server_t *s = c->srv;
  if (!c->done) {
    /* under c->mu: another thread may be waiting in sg_mgr_local_wait and
     * free c as soon as it sees it done */
    local_set_done(c, rc, msg);
    pthread_cond_broadcast(&c->cv);
    if (s) {
      c->refs++; /* the cancellation's */
      pthread_mutex_lock(&s->mu);
      c->cnext = s->cancels;
      s->cancels = c;
      if (!s->stopping) /* else sg_mgr_server_stop drains the list */
        uv_async_send(&s->local_async);
      pthread_mutex_unlock(&s->mu);
    }
  }
  pthread_mutex_unlock(&c->mu);
}

int sg_mgr_local_wait(sg_mgr_local_t *c, sg_deadline_t until) {
  if (sg_sock_fork_count() != c->forks)
    return 0; /* never completes here: the result says so */
  int timed_out = 0;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    if (c->done)
      break;
    sg_deadline_t now = sg_now_ns();
    if (now >= c->deadline) {
      timed_out = 1;
      break;
    }
    if (now >= until)
      break;
    sg_deadline_t d = until < c->deadline ? until : c->deadline;
    struct timespec ts = {(time_t)(d / 1000000000), (long)(d % 1000000000)};
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
  }
  int done = c->done;
  pthread_mutex_unlock(&c->mu);
  if (timed_out) {
    local_end(c, SG_ETIMEDOUT, "deadline exceeded");
    done = 1;
  }
  return done ? 0 : SG_EAGAIN;
}

int sg_mgr_local_done(sg_mgr_local_t *c) {
  if (sg_sock_fork_count() != c->forks)
    return 1;
  pthread_mutex_lock(&c->mu);
  int done = c->done;
  pthread_mutex_unlock(&c->mu);
  return done;
}

void sg_mgr_local_abort(sg_mgr_local_t *c) {
  if (c)
    local_end(c, SG_EABORTED, "call aborted");
}

/* local_result: the raw outcome of a complete call of `kind`, once. */
static int local_result(sg_mgr_local_t *c, enum waiter_kind kind,
                        uint8_t **resp, size_t *len, sg_err_t *err) {
  *resp = NULL;
  *len = 0;
  if (sg_sock_fork_count() != c->forks)
    return sg_err_set(err, SG_ESTATE,
                      "the call was started before fork() and cannot finish "
                      "in the child");
  pthread_mutex_lock(&c->mu);
  int rc;
  if (!c->done || c->taken || c->kind != kind) {
    rc = sg_err_set(err, SG_ESTATE,
                    "the call is not complete, was taken, or is another kind");
  } else {
    c->taken = 1;
    rc = c->rc;
    if (rc)
      sg_err_set(err, rc, "%s", c->msg);
    *resp = c->resp;
    *len = c->resp_len;
    c->resp = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int sg_mgr_local_quorum_result(sg_mgr_local_t *c, sg_mgr_quorum_result_t *out,
                               sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t len = 0;
  memset(out, 0, sizeof(*out));
  int rc = local_result(c, W_QUORUM, &resp, &len, err);
  if (!rc)
    rc = sg__mgr_decode_quorum(resp, len, out, err);
  sg_free(resp);
  return rc;
}

int sg_mgr_local_should_commit_result(sg_mgr_local_t *c, int *out,
                                      sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t len = 0;
  *out = 0;
  int rc = local_result(c, W_COMMIT, &resp, &len, err);
  if (!rc)
    rc = sg__mgr_decode_should_commit(resp, len, out, err);
  sg_free(resp);
  return rc;
}

void sg_mgr_local_free(sg_mgr_local_t *c) {
  if (!c || sg_sock_fork_count() != c->forks)
    return; /* in a forked child the memory is left alone, as its locks */
  local_end(c, SG_EABORTED, "call aborted");
  local_unref(c);
}

/* ---- lighthouse workers ------------------------------------------------- */

/* wait_ms: sleep on cv until `ms` passed, stop or leave; returns nonzero
 * when the worker must quit.  Caller holds mu. */
static int wait_ms(sg_mgr_server_t *s, int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t ns = (int64_t)ts.tv_nsec + ms_to_ns(ms);
  ts.tv_sec += (time_t)(ns / 1000000000);
  ts.tv_nsec = (long)(ns % 1000000000);
  while (!s->stopping && !atomic_load(&s->left))
    if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) != 0)
      break;
  return s->stopping || atomic_load(&s->left);
}

/* lh_heartbeat: one Heartbeat call (the request is encoded at start). */
static int lh_heartbeat(sg_mgr_server_t *s, sg_deadline_t deadline,
                        sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  int rc = sg_rpc_channel_call(s->lh, "/torchft.LighthouseService/Heartbeat",
                               s->hb_req, s->hb_req_len, deadline, &resp,
                               &resp_len, NULL, err);
  sg_free(resp);
  return rc;
}

/* lh_quorum_encode: the LighthouseQuorumRequest of round `j`
 * (sg_malloc'd, *len bytes), or NULL when out of memory. */
static uint8_t *lh_quorum_encode(const sg_mgr_server_t *s, const struct job *j,
                                 size_t *len) {
  Torchft__QuorumMember m = TORCHFT__QUORUM_MEMBER__INIT;
  m.replica_id = s->replica_id;
  m.address = s->address;
  m.store_address = s->store_addr;
  m.step = j->step;
  m.world_size = (uint64_t)s->world_size;
  m.shrink_only = j->shrink_only;
  m.commit_failures = j->commit_failures;
  m.n_reconfigure_handles = j->n_handles;
  m.reconfigure_handles = j->handles;
  Torchft__LighthouseQuorumRequest q = TORCHFT__LIGHTHOUSE_QUORUM_REQUEST__INIT;
  q.requester = &m;
  *len = torchft__lighthouse_quorum_request__get_packed_size(&q);
  uint8_t *req = sg_malloc(*len ? *len : 1);
  if (req)
    torchft__lighthouse_quorum_request__pack(&q, req);
  return req;
}

/* lh_quorum_decode: check and unpack a LighthouseQuorumResponse into *out
 * (NULL on error); 0 or SG_EPROTO. */
static int lh_quorum_decode(const uint8_t *resp, size_t resp_len,
                            Torchft__LighthouseQuorumResponse **out,
                            sg_err_t *err) {
  uint32_t field = 0;
  *out = NULL;
  if (sg__pb_check_strings(resp, resp_len, &lhresp_spec, &field) != 0)
    return sg_err_set(err, SG_EPROTO, "malformed LighthouseQuorumResponse");
  *out = torchft__lighthouse_quorum_response__unpack(&sg__pb_allocator,
                                                     resp_len, resp);
  if (!*out || !(*out)->quorum) {
    if (*out)
      torchft__lighthouse_quorum_response__free_unpacked(*out,
                                                         &sg__pb_allocator);
    *out = NULL;
    return sg_err_set(err, SG_EPROTO, "lighthouse returned no quorum");
  }
  return 0;
}

/*
 * local_timeout: whether a failed attempt is what torchft calls a local
 * timeout (the attempt's own deadline ran out: retry after 100 ms) rather
 * than an RPC error (retry after timeout / (retries + 1)).  A connect
 * attempt that timed out before the deadline, as a silent lighthouse
 * makes it, is an RPC error there: tonic reports it as a transport error.
 */
static int local_timeout(int rc, int grpc_status, sg_deadline_t deadline) {
  return rc == SG_ETIMEDOUT && grpc_status < 0 && sg_deadline_passed(deadline);
}

/* lh_quorum_once: one LighthouseService/Quorum call. */
static int lh_quorum_once(sg_mgr_server_t *s, const struct job *j,
                          int64_t timeout_ms,
                          Torchft__LighthouseQuorumResponse **out, int *local,
                          sg_err_t *err) {
  size_t len = 0;
  uint8_t *req = lh_quorum_encode(s, j, &len), *resp = NULL;
  size_t resp_len = 0;
  int status = -1, rc;
  *out = NULL;
  *local = 0;
  if (!req)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  sg_deadline_t deadline = sg_deadline_in_ms(timeout_ms);
  rc = sg_rpc_channel_call(s->lh, "/torchft.LighthouseService/Quorum", req, len,
                           deadline, &resp, &resp_len, &status, err);
  if (rc) {
    *local = local_timeout(rc, status, deadline);
    goto out;
  }
  rc = lh_quorum_decode(resp, resp_len, out, err);
out:
  sg_free(resp);
  sg_free(req);
  return rc;
}

/*
 * on_lh_quorum: the outcome of a round's asynchronous first attempt (the
 * lighthouse channel's I/O thread).  An answer is delivered here when only
 * in-process calls wait, else posted to the loop, as the quorum thread
 * does; a failure goes to the quorum thread, which applies torchft's retry
 * rule from there.  While the server stops, a failure is delivered here
 * (or left to the stop, which fails every waiting call) and nothing is
 * posted: the loop and the workers may be gone.
 */
static void on_lh_quorum(void *ud, int rc, int grpc_status, uint8_t *resp,
                         size_t resp_len, const char *msg) {
  sg_mgr_server_t *s = ud;
  Torchft__LighthouseQuorumResponse *out = NULL;
  sg_err_t e;
  sg_err_clear(&e);
  int call_rc = rc;
  if (!rc)
    rc = lh_quorum_decode(resp, resp_len, &out, &e);
  else
    sg_err_set(&e, rc, "%s", msg && msg[0] ? msg : sg_strerror(rc));
  sg_free(resp);
  pthread_mutex_lock(&s->mu);
  struct job j = s->ajob;
  memset(&s->ajob, 0, sizeof(s->ajob));
  s->ajob_live = 0;
  int stopping = s->stopping;
  if (rc && !stopping) {
    j.first_rc = rc;
    j.first_local = local_timeout(call_rc, grpc_status, j.first_deadline);
    snprintf(j.first_msg, sizeof(j.first_msg), "%s", e.msg);
    s->job = j;
    s->job_ready = 1;
    pthread_mutex_unlock(&s->mu);
    pthread_cond_signal(&s->job_cv);
    return;
  }
  pthread_mutex_unlock(&s->mu);
  job_clear(&j);
  if (deliver_here(s, rc, rc ? e.msg : "", out))
    return;
  if (stopping) { /* a call from the wire waits: the stop answers it */
    if (out)
      torchft__lighthouse_quorum_response__free_unpacked(out,
                                                         &sg__pb_allocator);
    return;
  }
  pthread_mutex_lock(&s->mu);
  s->result = out;
  s->result_rc = rc;
  snprintf(s->result_msg, sizeof(s->result_msg), "%s", rc ? e.msg : "");
  s->result_ready = 1;
  uv_async_send(&s->result_async);
  pthread_mutex_unlock(&s->mu);
}

/*
 * lh_start_async: send round `j`'s first attempt as an asynchronous call
 * while the lighthouse connection is up (else the quorum thread makes it:
 * a reconnect is on its way, and a failure takes it there anyway).  Returns 1
 * if it did (the server owns the job from here; *j is emptied), 0 to leave the
 * round to the quorum thread.  quorum_mu held.
 */
static int lh_start_async(sg_mgr_server_t *s, struct job *j) {
  if (!sg_rpc_channel_connected(s->lh))
    return 0;
  size_t len = 0;
  uint8_t *req = lh_quorum_encode(s, j, &len);
  if (!req)
    return 0;
  sg_deadline_t deadline = sg_deadline_in_ms(j->timeout_ms);
  pthread_mutex_lock(&s->mu);
  int busy = s->stopping || s->ajob_live;
  if (!busy) {
    s->ajob = *j;
    s->ajob.first_deadline = deadline;
    s->ajob_live = 1;
  }
  pthread_mutex_unlock(&s->mu);
  if (busy) {
    sg_free(req);
    return 0;
  }
  sg_err_t e;
  int rc =
      sg__rpc_channel_call_start(s->lh, "/torchft.LighthouseService/Quorum",
                                 req, len, deadline, on_lh_quorum, s, &e);
  sg_free(req);
  if (rc) { /* the callback never runs: the quorum thread takes the round */
    pthread_mutex_lock(&s->mu);
    *j = s->ajob;
    memset(&s->ajob, 0, sizeof(s->ajob));
    s->ajob_live = 0;
    pthread_mutex_unlock(&s->mu);
    return 0;
  }
  memset(j, 0, sizeof(*j));
  return 1;
}

/*
 * quorum_with_retries: torchft's _quorum_with_retries.  Attempts are
 * numbered from 0; after a failed attempt n == quorum_retries the round
 * fails; otherwise sleep max(100 ms, timeout / (retries + 1)) after an RPC
 * error, 100 ms after a local timeout, and try again on the same channel
 * (it reconnects by itself).  Called without mu.
 */
static int quorum_with_retries(sg_mgr_server_t *s, const struct job *j,
                               Torchft__LighthouseQuorumResponse **out,
                               sg_err_t *err) {
  for (int64_t retry = 0;; retry++) {
    int local = 0, rc;
    sg_err_t e;
    sg_err_clear(&e);
    if (retry == 0 && j->first_rc) { /* made asynchronously (on_lh_quorum) */
      rc = sg_err_set(&e, j->first_rc, "%s", j->first_msg);
      local = j->first_local;
    } else {
      rc = lh_quorum_once(s, j, j->timeout_ms, out, &local, &e);
    }
    if (rc == 0)
      return 0;
    sg_log(SG_LOG_WARN, LOG, "[Replica %s] lighthouse quorum attempt %lld: %s",
           s->name, (long long)retry, e.msg[0] ? e.msg : sg_strerror(rc));
    if (rc == SG_EABORTED || rc == SG_ECLOSED)
      return sg_err_set(err, rc, "lighthouse channel closed: %s",
                        e.msg[0] ? e.msg : sg_strerror(rc));
    if (retry >= s->quorum_retries)
      return sg_err_set(err, rc,
                        "lighthouse quorum failed after %lld retries: %s",
                        (long long)retry, e.msg[0] ? e.msg : sg_strerror(rc));
    int64_t div = s->quorum_retries + 1;
    int64_t sleep_ms = local ? MIN_RETRY_SLEEP_MS : j->timeout_ms / div;
    if (sleep_ms < MIN_RETRY_SLEEP_MS)
      sleep_ms = MIN_RETRY_SLEEP_MS;
    pthread_mutex_lock(&s->mu);
    int quit = wait_ms(s, sleep_ms);
    pthread_mutex_unlock(&s->mu);
    if (quit)
      return sg_err_set(err, SG_ECANCELED, "manager stopping");
  }
}

static void *quorum_main(void *arg) {
  sg_mgr_server_t *s = arg;
  sg_thread_name("sg-mgr-quorum");
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->job_ready && !s->stopping)
      pthread_cond_wait(&s->job_cv, &s->mu);
    if (s->stopping)
      break;
    struct job j = s->job;
    s->job_ready = 0;
    pthread_mutex_unlock(&s->mu);
    Torchft__LighthouseQuorumResponse *resp = NULL;
    sg_err_t e;
    sg_err_clear(&e);
    int rc = quorum_with_retries(s, &j, &resp, &e);
    job_clear(&j);
    if (rc != SG_ECANCELED &&
        deliver_here(s, rc, e.msg[0] ? e.msg : sg_strerror(rc), resp)) {
      pthread_mutex_lock(&s->mu);
      continue;
    }
    pthread_mutex_lock(&s->mu);
    s->result = resp;
    s->result_rc = rc;
    snprintf(s->result_msg, sizeof(s->result_msg), "%s",
             e.msg[0] ? e.msg : sg_strerror(rc));
    s->result_ready = 1;
    uv_async_send(&s->result_async);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static void *heartbeat_main(void *arg) {
  sg_mgr_server_t *s = arg;
  sg_thread_name("sg-mgr-hbeat");
  int failing = 0;
  pthread_mutex_lock(&s->mu);
  while (!s->stopping && !atomic_load(&s->left)) {
    pthread_mutex_unlock(&s->mu);
    sg_err_t e;
    sg_err_clear(&e);
    int rc = lh_heartbeat(s, sg_deadline_in_ms(s->connect_timeout_ms), &e);
    if (rc && !failing && rc != SG_EABORTED)
      sg_log(SG_LOG_WARN, LOG, "[Replica %s] heartbeat failed: %s", s->name,
             e.msg[0] ? e.msg : sg_strerror(rc));
    else if (!rc && failing)
      sg_log(SG_LOG_INFO, LOG, "[Replica %s] heartbeats to %s resumed", s->name,
             s->lighthouse_addr);
    failing = rc != 0;
    pthread_mutex_lock(&s->mu);
    if (wait_ms(s, s->hb_interval_ms))
      break;
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ---- loop thread and lifecycle ------------------------------------------ */

static void on_handle_closed(uv_handle_t *h) {
  sg_mgr_server_t *s = h->data;
  s->handles_open--;
}

static void close_handles(sg_mgr_server_t *s) {
  uv_close((uv_handle_t *)&s->grace_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->kill_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->stop_async, on_handle_closed);
  uv_close((uv_handle_t *)&s->result_async, on_handle_closed);
  uv_close((uv_handle_t *)&s->local_async, on_handle_closed);
}

static void on_rpc_closed(void *ud) {
  sg_mgr_server_t *s = ud;
  s->rpc = NULL;
  close_handles(s);
}

static void on_stop(uv_async_t *a) {
  sg_mgr_server_t *s = a->data;
  if (s->closing)
    return;
  s->closing = 1;
  uv_timer_stop(&s->grace_timer);
  uv_timer_stop(&s->kill_timer);
  pthread_mutex_lock(&s->quorum_mu);
  s->q_closed = 1; /* no call waits for a round from now on */
  pthread_mutex_unlock(&s->quorum_mu);
  fail_all(s, SG_GRPC_UNAVAILABLE, "manager shutting down");
  on_local(&s->local_async); /* answers calls started before the stop */
  sg_rpc_server_close(s->rpc, on_rpc_closed, s);
}

static void run_loop(void *arg) {
  sg_mgr_server_t *s = arg;
  sg_thread_name("sg-mgr-loop");
  uv_run(&s->loop, UV_RUN_DEFAULT);
}

static void server_free(sg_mgr_server_t *s) {
  if (!s)
    return;
  /* first: an asynchronous lighthouse call still running ends here, and
   * its callback (on_lh_quorum) finds the server whole */
  if (s->lh)
    sg_rpc_channel_free(s->lh);
  s->lh = NULL;
  size_t pos = 0;
  const char *k;
  void *v;
  while (sg_map_next(&s->conns, &pos, &k, &v)) {
    struct conn *c = v;
    sg_free(c->ranks);
    sg_free(c);
  }
  sg_map_free(&s->conns);
  if (s->ranks)
    for (int64_t g = 0; g < s->world_size; g++) {
      sg_free(s->ranks[g].metadata);
      sg_free(s->ranks[g].handle);
    }
  sg_free(s->ranks);
  if (s->job_ready)
    job_clear(&s->job);
  if (s->ajob_live) /* not reached: the channel's free ran its callback */
    job_clear(&s->ajob);
  if (s->result)
    torchft__lighthouse_quorum_response__free_unpacked(s->result,
                                                       &sg__pb_allocator);
  sg_free(s->kill_msg);
  sg_free(s->hb_req);
  sg_free(s->replica_id);
  sg_free(s->name);
  sg_free(s->lighthouse_addr);
  sg_free(s->store_addr);
  sg_free(s->auth_token);
  sg_free(s->bind);
  sg_free(s->address);
  pthread_cond_destroy(&s->cv);
  pthread_cond_destroy(&s->job_cv);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->commit_mu);
  pthread_mutex_destroy(&s->quorum_mu);
  sg_free(s);
}

static char *dup_opt(const char *v, const char *dflt, int *fail) {
  char *d = sg_strdup(v ? v : dflt);
  if (!d)
    *fail = 1;
  return d;
}

static int validate(const sg_mgr_server_opts_t *o, sg_err_t *err) {
  if (!o->replica_id || !o->replica_id[0])
    return sg_err_set(err, SG_EINVAL, "replica_id is required");
  if (strlen(o->replica_id) > SG_MGR_MAX_ID_LEN ||
      !sg__utf8_valid(o->replica_id, strlen(o->replica_id)))
    return sg_err_set(err, SG_EINVAL,
                      "replica_id must be UTF-8 of at most %d bytes",
                      SG_MGR_MAX_ID_LEN);
  if (!o->lighthouse_addr || !o->lighthouse_addr[0])
    return sg_err_set(err, SG_EINVAL, "lighthouse_addr is required");
  if (o->world_size < 1 || o->world_size > SG_MGR_MAX_WORLD_SIZE)
    return sg_err_set(err, SG_EINVAL, "world_size must be in [1, %d]",
                      SG_MGR_MAX_WORLD_SIZE);
  if (o->store_addr && (strlen(o->store_addr) > SG_MGR_MAX_ID_LEN ||
                        !sg__utf8_valid(o->store_addr, strlen(o->store_addr))))
    return sg_err_set(err, SG_EINVAL,
                      "store_addr must be UTF-8 of at most %d bytes",
                      SG_MGR_MAX_ID_LEN);
  if (o->hostname && (strlen(o->hostname) > MAX_HOST_LEN ||
                      !sg__utf8_valid(o->hostname, strlen(o->hostname))))
    return sg_err_set(err, SG_EINVAL,
                      "hostname must be UTF-8 of at most %d bytes",
                      MAX_HOST_LEN);
  return 0;
}

/* interface_addr: the first IPv4 (else IPv6) address of interface `name`
 * as a URL host ("10.0.0.2", "[fe80::1]"); 0 on success. */
static int interface_addr(const char *name, char *host, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0)
    return -1;
  int found = 0;
  for (int want = AF_INET; !found && want;
       want = want == AF_INET ? AF_INET6 : 0)
    for (struct ifaddrs *i = ifs; !found && i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != want ||
          strcmp(i->ifa_name, name) != 0)
        continue;
      char buf[INET6_ADDRSTRLEN];
      const void *a =
          want == AF_INET
              ? (const void *)&((struct sockaddr_in *)i->ifa_addr)->sin_addr
              : (const void *)&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
      if (!inet_ntop(want, a, buf, sizeof(buf)))
        continue;
      snprintf(host, cap, want == AF_INET ? "%s" : "[%s]", buf);
      found = 1;
    }
  freeifaddrs(ifs);
  return found ? 0 : -1;
}

/*
 * advertised_host: $STEPGUARD_ADVERTISE_HOST, else the hostname option,
 * else gethostname().  The variable wins over the option because training
 * code usually passes socket.gethostname() by default, and the operator who
 * sets the variable knows which network must carry recovery traffic.  When
 * it names a network interface ("eth1"), that interface's address is used.
 */
static void advertised_host(const char *opt, char *host, size_t cap) {
  const char *env = getenv("STEPGUARD_ADVERTISE_HOST");
  if (env && env[0]) {
    if (!if_nametoindex(env) || interface_addr(env, host, cap) != 0)
      snprintf(host, cap, "%s", env);
  } else if (opt && opt[0])
    snprintf(host, cap, "%s", opt);
  else if (gethostname(host, cap) != 0)
    snprintf(host, cap, "localhost");
  host[cap - 1] = '\0';
}

int sg_mgr_server_start(const sg_mgr_server_opts_t *o, sg_mgr_server_t **out,
                        sg_err_t *err) {
  sg_mgr_server_t *s = NULL;
  int rc = validate(o, err);
  if (rc)
    return rc;
  s = sg_calloc(1, sizeof(*s));
  if (!s)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->commit_mu, NULL);
  pthread_mutex_init(&s->quorum_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_cond_init(&s->job_cv, &ca);
  pthread_condattr_destroy(&ca);
  sg_map_init(&s->conns);
  atomic_init(&s->left, 0);
  s->forks = sg_sock_fork_count();
  int fail = 0;
  s->replica_id = dup_opt(o->replica_id, "", &fail);
  s->lighthouse_addr = dup_opt(o->lighthouse_addr, "", &fail);
  s->store_addr = dup_opt(o->store_addr, "", &fail);
  s->bind = dup_opt(o->bind, "[::]:0", &fail);
  s->auth_token = o->auth_token && o->auth_token[0]
                      ? dup_opt(o->auth_token, "", &fail)
                      : NULL;
  s->name = dup_opt(o->replica_id, "", &fail);
  s->logged_qid = INT64_MIN;
  s->world_size = o->world_size;
  s->ranks = sg_calloc((size_t)o->world_size, sizeof(*s->ranks));
  if (fail || !s->ranks) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto fail;
  }
  Torchft__LighthouseHeartbeatRequest h =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_REQUEST__INIT;
  h.replica_id = s->replica_id;
  s->hb_req_len = torchft__lighthouse_heartbeat_request__get_packed_size(&h);
  s->hb_req = sg_malloc(s->hb_req_len ? s->hb_req_len : 1);
  if (!s->hb_req) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto fail;
  }
  torchft__lighthouse_heartbeat_request__pack(&h, s->hb_req);
  char *colon = strchr(s->name, ':');
  if (colon)
    *colon = '\0'; /* torchft logs "[Replica {id up to the first ':'}]" */
  s->hb_interval_ms =
      o->heartbeat_interval_ms > 0 ? o->heartbeat_interval_ms : 100;
  s->connect_timeout_ms =
      o->connect_timeout_ms > 0 ? o->connect_timeout_ms : 10000;
  s->quorum_retries = o->quorum_retries > 0 ? o->quorum_retries : 0;
  s->grace_ms = o->disconnect_grace_ms == 0 ? SG_MGR_DISCONNECT_GRACE_MS
                                            : o->disconnect_grace_ms;
  s->kill = o->kill;
  s->kill_ud = o->kill_ud;

  sg_rpc_channel_opts_t co = {0};
  co.target = s->lighthouse_addr;
  co.connect_timeout_ms = s->connect_timeout_ms;
  co.auth_token = s->auth_token;
  co.max_message = LH_MAX_RESPONSE;
  /* A Quorum or Heartbeat while the lighthouse is unreachable fails after
   * one connect attempt (bounded by the connect timeout), however the call
   * met the drop (queued before or after the channel saw it), and the retry
   * rule takes over; a reachable lighthouse still gets the whole timeout. */
  co.fail_fast = 1;
  rc = sg_rpc_channel_new(&co, &s->lh, err);
  if (rc)
    goto fail;

  rc = uv_loop_init(&s->loop);
  if (rc) {
    sg_err_set(err, rc, "uv_loop_init: %s", uv_strerror(rc));
    goto fail;
  }
  uv_timer_init(&s->loop, &s->grace_timer);
  uv_timer_init(&s->loop, &s->kill_timer);
  uv_async_init(&s->loop, &s->stop_async, on_stop);
  uv_async_init(&s->loop, &s->result_async, on_result);
  uv_async_init(&s->loop, &s->local_async, on_local);
  s->grace_timer.data = s->kill_timer.data = s;
  s->stop_async.data = s->result_async.data = s->local_async.data = s;
  s->handles_open = 5;

  sg_rpc_server_opts_t ro = {0};
  ro.bind = s->bind;
  ro.on_call = on_call;
  ro.on_call_cancel = on_call_cancel;
  ro.on_conn_close = on_conn_close;
  ro.ud = s;
  rc = sg_rpc_server_start(&s->loop, &ro, &s->rpc, err);
  if (rc) {
    close_handles(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    goto fail;
  }
  s->port = sg_rpc_server_port(s->rpc);
  char host[MAX_HOST_LEN + 1];
  advertised_host(o->hostname, host, sizeof(host));
  int v6 = strchr(host, ':') && host[0] != '[';
  size_t alen = strlen(host) + 40;
  s->address = sg_malloc(alen);
  if (!s->address) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto fail_loop;
  }
  snprintf(s->address, alen, v6 ? "http://[%s]:%d" : "http://%s:%d", host,
           s->port);

  rc = uv_thread_create(&s->thread, run_loop, s);
  if (rc) {
    sg_err_set(err, rc, "thread: %s", uv_strerror(rc));
    goto fail_loop;
  }
  s->loop_started = 1;
  rc = -pthread_create(&s->q_thread, NULL, quorum_main, s);
  if (!rc) {
    s->q_started = 1;
    rc = -pthread_create(&s->hb_thread, NULL, heartbeat_main, s);
    s->hb_started = rc == 0;
  }
  if (rc) {
    sg_err_set(err, rc, "thread: %s", sg_strerror(rc));
    sg_mgr_server_stop(s);
    return rc;
  }
  sg_log(SG_LOG_INFO, LOG,
         "[Replica %s] manager listening on %s (bind %s), lighthouse %s, "
         "world_size %lld",
         s->name, s->address, s->bind, s->lighthouse_addr,
         (long long)s->world_size);
  *out = s;
  return 0;
fail_loop:
  uv_async_send(&s->stop_async);
  uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_loop_close(&s->loop);
fail:
  server_free(s);
  return rc;
}

const char *sg_mgr_server_address(const sg_mgr_server_t *s) {
  return s->address;
}

int sg_mgr_server_port(const sg_mgr_server_t *s) { return s->port; }

int sg_mgr_server_has_left(const sg_mgr_server_t *s) {
  return atomic_load(&((sg_mgr_server_t *)s)->left);
}

void sg_mgr_server_stop(sg_mgr_server_t *s) {
  if (!s)
    return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_cond_broadcast(&s->job_cv);
  pthread_mutex_unlock(&s->mu);
  sg_rpc_channel_abort(s->lh);
  if (s->q_started)
    pthread_join(s->q_thread, NULL);
  if (s->hb_started)
    pthread_join(s->hb_thread, NULL);
  if (s->loop_started) {
    uv_async_send(&s->stop_async);
    uv_thread_join(&s->thread);
  }
  local_drain(s);
  if (uv_loop_close(&s->loop) != 0)
    sg_log(SG_LOG_WARN, LOG, "manager loop closed with handles open");
  server_free(s);
}
