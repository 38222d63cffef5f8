/*
 * server.c: the ManagerServer's wire side and lifecycle (manager_int.h has
 * the threads, the locks and the files of the server).
 *
 *   helpers      authorization, answering a call from the wire or from
 *                this process, the waiter lists
 *   leaving      the group leaves the job for good
 *   liveness     which group ranks spoke on which connection; the grace
 *   rounds       starting a quorum round (its decision is round.c's) and
 *                delivering its outcome (each rank's view is results.c's)
 *   calls        Quorum, CheckpointMetadata, Kill and WaitLost from the
 *                wire (ShouldCommit and the commit round are vote.c's)
 *   lifecycle    the loop thread, start, stop
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "manager/manager_int.h"
#include "manager/results.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"

#define LOG "manager"
#define KILL_DELAY_MS 20 /* lets the Kill response leave first */
#define LH_MAX_RESPONSE (64u << 20)
#define MAX_HOST_LEN 255 /* advertised host name (DNS: 253) */

/* One open connection and the group ranks heard on it. */
struct conn {
  int64_t *ranks;
  size_t n, cap;
};

static const uint32_t qreq_strings[] = {3, 7};
static const sg__pb_spec_t qreq_spec = {qreq_strings, 2, NULL, 0};
static const uint32_t kill_strings[] = {1};
static const sg__pb_spec_t kill_spec = {kill_strings, 1, NULL, 0};

/* ---- helpers ------------------------------------------------------------ */

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

/* sg__mgr_respond: answer a call from the wire or from this process. */
void sg__mgr_respond(sg__mgr_reply_t to, int status, const char *msg,
                     const uint8_t *body, size_t len) {
  if (to.call)
    sg_rpc_call_respond(to.call, status, msg, body, len);
  else
    sg__mgr_local_complete(to.local, status, msg, body, len);
}

void sg__mgr_respond_err(sg__mgr_reply_t to, int status, const char *fmt, ...)
    SG_PRINTF(3, 4);
void sg__mgr_respond_err(sg__mgr_reply_t to, int status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  sg_log(SG_LOG_DEBUG, LOG, "answering %s with %s: %s",
         to.call ? sg_rpc_call_method(to.call) : "an in-process call",
         sg__grpc_status_name(status), msg);
  sg__mgr_respond(to, status, msg, NULL, 0);
}

/* sg__mgr_check_wire: 0, or answers INVALID_ARGUMENT and returns -1. */
int sg__mgr_check_wire(sg_rpc_call_t *call, const uint8_t *body, size_t len,
                       const sg__pb_spec_t *spec) {
  uint32_t field = 0;
  int rc = sg__pb_check_strings(body, len, spec, &field);
  if (rc == SG_EINVAL) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "string field %u is not valid UTF-8 or contains NUL",
                        field);
    return -1;
  }
  if (rc) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "malformed protobuf message");
    return -1;
  }
  return 0;
}

static void respond_msg(sg__mgr_reply_t to, const ProtobufCMessage *m) {
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = sg_malloc(len ? len : 1);
  if (!buf) {
    sg__mgr_respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED,
                        "manager out of memory");
    return;
  }
  protobuf_c_message_pack(m, buf);
  sg__mgr_respond(to, SG_GRPC_OK, NULL, buf, len);
  sg_free(buf);
}

void sg__mgr_waiter_unlink(sg__mgr_waiter_t **head, sg__mgr_waiter_t *w) {
  if (w->prev)
    w->prev->next = w->next;
  else
    *head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  w->prev = w->next = NULL;
}

static void waiter_push(sg__mgr_waiter_t **head, sg__mgr_waiter_t *w) {
  w->prev = NULL;
  w->next = *head;
  if (*head)
    (*head)->prev = w;
  *head = w;
}

/* sg__mgr_waiter_free: free a waiter that left its list (answered or not), and
 * drop the server's reference to its in-process call. */
void sg__mgr_waiter_free(sg__mgr_waiter_t *w) {
  sg_mgr_call_t *c = w->to.local;
  if (c) {
    c->w = NULL;
    sg__mgr_call_unref(c);
  }
  sg_free(w);
}

/* quorum_waiter_gone: bookkeeping when a Quorum waiter leaves the list. */
static void quorum_waiter_gone(sg_mgr_server_t *s, sg__mgr_waiter_t *w) {
  if (!w->in_round) {
    sg__mgr_rank_t *r = &s->ranks[w->group_rank];
    if (r->waiting && --r->waiting == 0)
      s->n_arrived--;
  }
}

/* fail_quorum_waiters: answer every waiting Quorum call with `status`
 * (quorum_mu held; on the loop, or where every waiter is in-process). */
static void fail_quorum_waiters(sg_mgr_server_t *s, int status,
                                const char *msg) {
  while (s->quorum_waiters) {
    sg__mgr_waiter_t *w = s->quorum_waiters;
    sg__mgr_waiter_unlink(&s->quorum_waiters, w);
    quorum_waiter_gone(s, w);
    sg__mgr_respond(w->to, status, msg, NULL, 0);
    sg__mgr_waiter_free(w);
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
    sg__mgr_waiter_t *w = s->commit_waiters;
    sg__mgr_waiter_unlink(&s->commit_waiters, w);
    sg__mgr_respond(w->to, status, msg, NULL, 0);
    sg__mgr_waiter_free(w);
  }
  pthread_mutex_unlock(&s->commit_mu);
  while (s->lost_calls) {
    sg__mgr_waiter_t *w = s->lost_calls;
    sg__mgr_waiter_unlink(&s->lost_calls, w);
    sg__mgr_respond(w->to, status, msg, NULL, 0);
    sg__mgr_waiter_free(w);
  }
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

void sg__mgr_timer_at(sg_mgr_server_t *s, uv_timer_t *t, uv_timer_cb cb,
                      int64_t at) {
  if (at == INT64_MAX || s->closing) {
    uv_timer_stop(t);
    return;
  }
  int64_t now = sg_now_ns();
  int64_t ms = at <= now ? 0 : (at - now + 999999) / 1000000;
  uv_timer_start(t, cb, (uint64_t)ms, 0);
}

static void rearm_grace(sg_mgr_server_t *s) {
  int64_t best = INT64_MAX;
  for (int64_t g = 0; g < s->world_size; g++)
    if (s->ranks[g].grace_deadline && s->ranks[g].grace_deadline < best)
      best = s->ranks[g].grace_deadline;
  sg__mgr_timer_at(s, &s->grace_timer, on_grace, best);
}

static void on_grace(uv_timer_t *t) {
  sg_mgr_server_t *s = t->data;
  if (s->closing || atomic_load(&s->left))
    return;
  int64_t now = sg_now_ns();
  for (int64_t g = 0; g < s->world_size; g++) {
    sg__mgr_rank_t *r = &s->ranks[g];
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

/* sg__mgr_note_speaker: group rank `g` spoke on connection `conn_id`. */
void sg__mgr_note_speaker(sg_mgr_server_t *s, int64_t g, uint64_t conn_id) {
  sg__mgr_rank_t *r = &s->ranks[g];
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
  int64_t deadline = sg_now_ns() + sg__mgr_ms_to_ns(s->grace_ms);
  for (size_t i = 0; i < c->n; i++) {
    sg__mgr_rank_t *r = &s->ranks[c->ranks[i]];
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

/* log_disagreement: the group ranks sent these different steps (n of
 * them); the round uses `step`. */
static void log_disagreement(sg_mgr_server_t *s, const int64_t *steps, size_t n,
                             int64_t step) {
  char line[256];
  size_t off = 0;
  for (size_t g = 0; g < n && off + 16 < sizeof(line); g++) {
    int k = snprintf(line + off, sizeof(line) - off, "%s%lld", g ? "," : "",
                     (long long)steps[g]);
    if (k < 0)
      break;
    off += (size_t)k;
  }
  if (off >= sizeof(line) - 16)
    snprintf(line + sizeof(line) - 4, 4, "...");
  sg_log(SG_LOG_WARN, LOG,
         "[Replica %s] group ranks disagree on the step [%s]; using the "
         "minimum %lld",
         s->name, line, (long long)step);
}

/* maybe_start_round: every group rank waits and no round is under way
 * (round.c decides both, and what the request carries): send the group's
 * request to the lighthouse asynchronously, or hand it to the quorum
 * thread.  quorum_mu held (on the loop, where every waiter is in-process,
 * or on the lighthouse channel's I/O thread). */
static void maybe_start_round(sg_mgr_server_t *s) {
  if (!sg__mgr_round_ready(s->n_arrived, (size_t)s->world_size,
                           s->round_in_flight, s->q_closed,
                           atomic_load(&s->left)))
    return;
  size_t n = (size_t)s->world_size;
  /* one block: steps, commit_failures, handles (n entries each) */
  int64_t *steps = sg_malloc(n * (2 * sizeof(int64_t) + sizeof(char *)));
  if (!steps) {
    fail_quorum_waiters(s, SG_GRPC_RESOURCE_EXHAUSTED, "manager out of memory");
    return;
  }
  int64_t *failures = steps + n;
  const char **handles = (const char **)(void *)(failures + n);
  for (size_t g = 0; g < n; g++) {
    steps[g] = s->ranks[g].step;
    failures[g] = s->ranks[g].commit_failures;
    handles[g] = s->ranks[g].handle;
  }
  sg__mgr_arrivals_t a = {steps, failures, handles, n};
  sg__mgr_round_t plan;
  sg__mgr_round_plan(&a, &plan); /* cannot fail: every array is set */
  sg__mgr_job_t j = {0};
  j.step = plan.step;
  j.commit_failures = plan.commit_failures;
  if (plan.steps_disagree)
    log_disagreement(s, steps, n, j.step);
  sg_free(steps);
  if (plan.send_handles) {
    j.handles = sg_calloc((size_t)s->world_size, sizeof(char *));
    int nomem = !j.handles;
    for (int64_t g = 0; !nomem && g < s->world_size; g++) {
      const char *h = s->ranks[g].handle;
      j.handles[g] = sg_strdup(h ? h : "");
      j.n_handles = (size_t)g + 1;
      nomem = !j.handles[g];
    }
    if (nomem) {
      sg__mgr_job_clear(&j);
      fail_quorum_waiters(s, SG_GRPC_RESOURCE_EXHAUSTED,
                          "manager out of memory");
      return;
    }
  }
  /* torchft takes shrink_only and the timeout from the last-arriving rank */
  j.shrink_only = s->last_shrink_only;
  j.timeout_ms = s->last_timeout_ms;
  /* what a restarted lighthouse learns from us (optional: a copy that
   * fails leaves it out) */
  j.last_members = sg__mgr_dup_ids(s->last_members, s->n_last);
  j.n_last = j.last_members ? s->n_last : 0;
  j.last_qid = j.last_members ? s->last_qid : 0;
  j.last_max_step = s->last_max_step;
  for (sg__mgr_waiter_t *w = s->quorum_waiters; w; w = w->next)
    w->in_round = 1;
  for (int64_t g = 0; g < s->world_size; g++)
    s->ranks[g].waiting = 0;
  s->n_arrived = 0;
  s->round_in_flight = 1;
  if (sg__mgr_lh_start_async(s, &j))
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
static void encode_results(sg__mgr_reply_t to, const sg__mgr_results_t *r,
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

/* remember_quorum: keep quorum `q`'s id and members for the next rounds'
 * requests (quorum_mu held); out of memory keeps the one before. */
static void remember_quorum(sg_mgr_server_t *s, const Torchft__Quorum *q) {
  int64_t top = -1;
  for (size_t i = 0; i < q->n_participants; i++)
    if (q->participants[i]->step > top)
      top = q->participants[i]->step;
  s->last_max_step = top;
  if (q->quorum_id == s->last_qid && q->n_participants == s->n_last)
    return;
  char **ids =
      q->n_participants ? sg_calloc(q->n_participants, sizeof(*ids)) : NULL;
  size_t n = 0;
  for (; ids && n < q->n_participants; n++)
    if (!(ids[n] = sg_strdup(q->participants[n]->replica_id)))
      break;
  if (!ids || n < q->n_participants) {
    sg__mgr_free_ids(ids, n);
    return;
  }
  sg__mgr_free_ids(s->last_members, s->n_last);
  s->last_members = ids;
  s->n_last = n;
  s->last_qid = q->quorum_id;
}

/* deliver_failure: answer every waiting Quorum call with the round's
 * failure (quorum_mu held). */
static void deliver_failure(sg_mgr_server_t *s, int rc, const char *msg) {
  sg_log(SG_LOG_WARN, LOG, "[Replica %s] quorum failed: %s", s->name, msg);
  int status = rc == SG_ENOMEM         ? SG_GRPC_RESOURCE_EXHAUSTED
               : rc == SG_ECONNREFUSED ? SG_GRPC_UNAVAILABLE
                                       : SG_GRPC_INTERNAL;
  fail_quorum_waiters(s, status, msg);
}

/* peers_of: quorum `q`'s participants as the results computation takes
 * them (strings borrowed from `q`); NULL when out of memory. */
static sg__mgr_peer_t *peers_of(const Torchft__Quorum *q) {
  size_t n = q->n_participants;
  sg__mgr_peer_t *peers = sg_calloc(n ? n : 1, sizeof(*peers));
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
  return peers;
}

/* deliver: answer every waiting Quorum call with the round's outcome
 * (quorum_mu held; on the loop, or where every waiter is in-process). */
static void deliver(sg_mgr_server_t *s, int rc, const char *msg,
                    Torchft__LighthouseQuorumResponse *resp) {
  if (rc) {
    deliver_failure(s, rc, msg);
    return;
  }
  Torchft__Quorum *q = resp->quorum;
  size_t n = q->n_participants;
  int64_t qid = q->quorum_id;
  sg__mgr_peer_t *peers = peers_of(q);
  char **scratch = sg_calloc(n ? n : 1, sizeof(*scratch));
  if (!peers || !scratch) {
    sg_free(peers);
    sg_free(scratch);
    deliver_failure(s, SG_ENOMEM, "manager out of memory");
    return;
  }
  remember_quorum(s, q);
  int logged = 0;
  while (s->quorum_waiters) {
    sg__mgr_waiter_t *w = s->quorum_waiters;
    sg__mgr_waiter_unlink(&s->quorum_waiters, w);
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
      encode_results(w->to, &r, q, w->group_rank, scratch);
    } else {
      sg__mgr_respond_err(w->to,
                          crc == SG_ENOTFOUND ? SG_GRPC_NOT_FOUND
                          : crc == SG_ENOMEM  ? SG_GRPC_RESOURCE_EXHAUSTED
                                              : SG_GRPC_INTERNAL,
                          "%s", e.msg[0] ? e.msg : sg_strerror(crc));
    }
    sg__mgr_results_free(&r);
    sg__mgr_waiter_free(w);
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

/* sg__mgr_all_local: every call in the list is an in-process one (quorum_mu).
 */
int sg__mgr_all_local(const sg__mgr_waiter_t *w) {
  for (; w; w = w->next)
    if (w->to.call)
      return 0;
  return 1;
}

/*
 * deliver_here: answer the round right here when only in-process calls
 * wait (nobody on the wire needs the loop to answer), so the loop is not
 * woken.  Returns 1 if it did (the result is consumed and freed); 0 leaves
 * it to the loop.
 */
static int deliver_here(sg_mgr_server_t *s, int rc, const char *msg,
                        Torchft__LighthouseQuorumResponse *resp) {
  pthread_mutex_lock(&s->quorum_mu);
  if (s->q_closed || atomic_load(&s->left) ||
      !sg__mgr_all_local(s->quorum_waiters)) {
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

void sg__mgr_round_done(sg_mgr_server_t *s, int rc, const char *msg,
                        Torchft__LighthouseQuorumResponse *resp) {
  if (deliver_here(s, rc, msg, resp))
    return;
  pthread_mutex_lock(&s->mu);
  if (s->stopping) { /* the loop may be gone: the stop answers the calls */
    pthread_mutex_unlock(&s->mu);
    if (resp)
      torchft__lighthouse_quorum_response__free_unpacked(resp,
                                                         &sg__pb_allocator);
    return;
  }
  s->result = resp;
  s->result_rc = rc;
  snprintf(s->result_msg, sizeof(s->result_msg), "%s", msg);
  s->result_ready = 1;
  uv_async_send(&s->result_async);
  pthread_mutex_unlock(&s->mu);
}

/* ---- calls -------------------------------------------------------------- */

/* sg__mgr_waiter_add: the waiter of `to`; an in-process call's waiter holds the
 * server's reference to it from here on. */
sg__mgr_waiter_t *sg__mgr_waiter_add(sg_mgr_server_t *s, sg__mgr_reply_t to,
                                     sg__mgr_kind_t kind, int64_t g) {
  sg__mgr_waiter_t *w = sg_calloc(1, sizeof(*w));
  if (!w) {
    sg__mgr_respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED,
                        "manager out of memory");
    return NULL;
  }
  w->kind = kind;
  w->to = to;
  w->group_rank = g;
  waiter_push(kind == SG__MGR_QUORUM ? &s->quorum_waiters : &s->commit_waiters,
              w);
  if (to.call)
    sg_rpc_call_set_user(to.call, w);
  else {
    to.local->w = w;
    to.local->had_waiter = 1;
  }
  return w;
}

/* sg__mgr_quorum_idle: no Quorum call counts as arrived and no round is
 * under way (tests wait for this where a cancel must have been seen). */
int sg__mgr_quorum_idle(sg_mgr_server_t *s) {
  pthread_mutex_lock(&s->quorum_mu);
  int idle = s->n_arrived == 0 && !s->round_in_flight;
  pthread_mutex_unlock(&s->quorum_mu);
  return idle;
}

/* sg__mgr_round_mu: the lock the round of calls of `kind` is under. */
pthread_mutex_t *sg__mgr_round_mu(sg_mgr_server_t *s, sg__mgr_kind_t kind) {
  return kind == SG__MGR_QUORUM ? &s->quorum_mu : &s->commit_mu;
}

/* sg__mgr_waiter_drop: the caller of w's call gave up (its round's lock held).
 * A Quorum call not yet in a round no longer counts as arrived; a vote stays
 * counted (torchft).  Drops an in-process call's server reference. */
void sg__mgr_waiter_drop(sg_mgr_server_t *s, sg__mgr_waiter_t *w) {
  if (w->kind == SG__MGR_QUORUM) {
    sg__mgr_waiter_unlink(&s->quorum_waiters, w);
    quorum_waiter_gone(s, w);
  } else {
    sg__mgr_waiter_unlink(&s->commit_waiters, w);
  }
  sg__mgr_waiter_free(w);
}

/* waiter_cancel: sg__mgr_waiter_drop for a call from the wire. */
static void waiter_cancel(sg_mgr_server_t *s, sg__mgr_waiter_t *w) {
  pthread_mutex_t *mu = sg__mgr_round_mu(s, w->kind);
  pthread_mutex_lock(mu);
  sg__mgr_waiter_drop(s, w);
  pthread_mutex_unlock(mu);
}

int sg__mgr_check_rank(sg_mgr_server_t *s, sg__mgr_reply_t to, int64_t g) {
  if (g < 0 || g >= s->world_size) {
    sg__mgr_respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                        "group_rank %lld out of range [0, %lld)", (long long)g,
                        (long long)s->world_size);
    return -1;
  }
  return 0;
}

int sg__mgr_check_left(sg_mgr_server_t *s, sg__mgr_reply_t to) {
  if (!atomic_load(&s->left))
    return 0;
  sg__mgr_respond_err(to, SG_GRPC_UNAVAILABLE,
                      "replica group left the job; it must restart");
  return -1;
}

/* sg__mgr_quorum_arrive_locked: group rank a->group_rank waits for this step's
 * quorum (quorum_mu held). */
void sg__mgr_quorum_arrive_locked(sg_mgr_server_t *s, sg__mgr_reply_t to,
                                  const sg__mgr_qargs_t *a) {
  if (sg__mgr_check_rank(s, to, a->group_rank) || sg__mgr_check_left(s, to))
    return;
  if (s->q_closed) {
    sg__mgr_respond_err(to, SG_GRPC_UNAVAILABLE, "manager shutting down");
    return;
  }
  if (strlen(a->metadata) > SG_MGR_MAX_METADATA_LEN) {
    sg__mgr_respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                        "checkpoint_metadata too long (max %d bytes)",
                        SG_MGR_MAX_METADATA_LEN);
    return;
  }
  if (strlen(a->handle) > SG_MGR_MAX_METADATA_LEN) {
    sg__mgr_respond_err(to, SG_GRPC_INVALID_ARGUMENT,
                        "reconfigure_handle too long (max %d bytes)",
                        SG_MGR_MAX_METADATA_LEN);
    return;
  }
  sg__mgr_rank_t *r = &s->ranks[a->group_rank];
  pthread_mutex_lock(&s->commit_mu); /* it moved on past any late vote */
  r->vote_late = 0;
  pthread_mutex_unlock(&s->commit_mu);
  char *md = sg_strdup(a->metadata);
  char *handle = sg_strdup(a->handle);
  if (!md || !handle) {
    sg_free(md);
    sg_free(handle);
    sg__mgr_respond_err(to, SG_GRPC_RESOURCE_EXHAUSTED,
                        "manager out of memory");
    return;
  }
  sg__mgr_waiter_t *w =
      sg__mgr_waiter_add(s, to, SG__MGR_QUORUM, a->group_rank);
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

/* sg__mgr_quorum_arrive: sg__mgr_quorum_arrive_locked from the loop. */
void sg__mgr_quorum_arrive(sg_mgr_server_t *s, sg__mgr_reply_t to,
                           const sg__mgr_qargs_t *a) {
  pthread_mutex_lock(&s->quorum_mu);
  sg__mgr_quorum_arrive_locked(s, to, a);
  pthread_mutex_unlock(&s->quorum_mu);
  if (a->has_conn && a->group_rank >= 0 && a->group_rank < s->world_size)
    sg__mgr_note_speaker(s, a->group_rank, a->conn_id);
}

static void handle_quorum(sg_mgr_server_t *s, sg_rpc_call_t *call,
                          const uint8_t *body, size_t len) {
  Torchft__ManagerQuorumRequest *req = NULL;
  if (!sg_rpc_call_metadata(call, "grpc-timeout")) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "missing timeout");
    return;
  }
  if (sg__mgr_check_wire(call, body, len, &qreq_spec))
    return;
  req = torchft__manager_quorum_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "invalid ManagerQuorumRequest");
    return;
  }
  sg__mgr_qargs_t a = {0};
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
  sg__mgr_quorum_arrive(s, sg__mgr_wire(call), &a);
  torchft__manager_quorum_request__free_unpacked(req, &sg__pb_allocator);
}

static void handle_checkpoint_metadata(sg_mgr_server_t *s, sg_rpc_call_t *call,
                                       const uint8_t *body, size_t len) {
  if (sg__mgr_check_wire(call, body, len, &sg__pb_no_strings))
    return;
  Torchft__CheckpointMetadataRequest *req =
      torchft__checkpoint_metadata_request__unpack(&sg__pb_allocator, len,
                                                   body);
  if (!req) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "invalid CheckpointMetadataRequest");
    return;
  }
  pthread_mutex_lock(&s->quorum_mu);
  if (req->rank < 0 || req->rank >= s->world_size ||
      !s->ranks[req->rank].metadata) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "rank not found");
  } else {
    Torchft__CheckpointMetadataResponse m =
        TORCHFT__CHECKPOINT_METADATA_RESPONSE__INIT;
    m.checkpoint_metadata = s->ranks[req->rank].metadata;
    respond_msg(sg__mgr_wire(call), &m.base);
  }
  pthread_mutex_unlock(&s->quorum_mu);
  torchft__checkpoint_metadata_request__free_unpacked(req, &sg__pb_allocator);
}

/* current_lost_qid: the newest quorum the lighthouse reported a member of
 * lost (0: none). */
static int64_t current_lost_qid(sg_mgr_server_t *s) {
  pthread_mutex_lock(&s->mu);
  int64_t q = s->lost_qid;
  pthread_mutex_unlock(&s->mu);
  return q;
}

/* respond_lost: answer a WaitLost call with quorum `qid`. */
static void respond_lost(sg__mgr_reply_t to, int64_t qid) {
  Torchft__ManagerWaitLostResponse m =
      TORCHFT__MANAGER_WAIT_LOST_RESPONSE__INIT;
  m.lost_quorum_id = qid;
  respond_msg(to, &m.base);
}

/*
 * on_lost: the heartbeat thread saw the lighthouse report a member of a
 * newer quorum lost (lost_async): answer every WaitLost call waiting for a
 * quorum older than it.  Loop thread.
 */
static void on_lost(uv_async_t *a) {
  sg_mgr_server_t *s = a->data;
  int64_t qid = current_lost_qid(s);
  sg__mgr_waiter_t *w = s->lost_calls;
  while (w) {
    sg__mgr_waiter_t *next = w->next;
    if (w->after_qid < qid) {
      sg__mgr_waiter_unlink(&s->lost_calls, w);
      respond_lost(w->to, qid);
      sg__mgr_waiter_free(w);
    }
    w = next;
  }
}

/*
 * handle_wait_lost: a group rank's long poll for a lost member (stepguard
 * extension): answered at once when the lighthouse already reported a
 * quorum newer than after_quorum_id lost, else when it does (on_lost), else
 * DEADLINE_EXCEEDED at the call's deadline, which it must have.  Not a
 * liveness signal: the connection it comes on is not the rank's.
 */
static void handle_wait_lost(sg_mgr_server_t *s, sg_rpc_call_t *call,
                             const uint8_t *body, size_t len) {
  if (!sg_rpc_call_metadata(call, "grpc-timeout")) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "missing timeout");
    return;
  }
  if (sg__mgr_check_wire(call, body, len, &sg__pb_no_strings))
    return;
  Torchft__ManagerWaitLostRequest *req =
      torchft__manager_wait_lost_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "invalid ManagerWaitLostRequest");
    return;
  }
  int64_t after = req->after_quorum_id;
  torchft__manager_wait_lost_request__free_unpacked(req, &sg__pb_allocator);
  if (sg__mgr_check_left(s, sg__mgr_wire(call)))
    return;
  int64_t qid = current_lost_qid(s);
  if (qid > after) {
    respond_lost(sg__mgr_wire(call), qid);
    return;
  }
  sg__mgr_waiter_t *w = sg_calloc(1, sizeof(*w));
  if (!w) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_RESOURCE_EXHAUSTED,
                        "manager out of memory");
    return;
  }
  w->kind = SG__MGR_LOST;
  w->to = sg__mgr_wire(call);
  w->after_qid = after;
  waiter_push(&s->lost_calls, w);
  sg_rpc_call_set_user(call, w);
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
  if (sg__mgr_check_wire(call, body, len, &kill_spec))
    return;
  Torchft__KillRequest *req =
      torchft__kill_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "invalid KillRequest");
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
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_UNAVAILABLE,
                        "manager shutting down");
  } else if (!authorized(s, call)) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_UNAUTHENTICATED,
                        "missing or wrong authorization token");
  } else if (strcmp(method, "/torchft.ManagerService/Quorum") == 0) {
    handle_quorum(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/ShouldCommit") == 0) {
    sg__mgr_handle_should_commit(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/CheckpointMetadata") ==
             0) {
    handle_checkpoint_metadata(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/Kill") == 0) {
    handle_kill(s, call, body, len);
  } else if (strcmp(method, "/torchft.ManagerService/WaitLost") == 0) {
    handle_wait_lost(s, call, body, len);
  } else {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_UNIMPLEMENTED,
                        "unknown method %.200s", method);
  }
}

/* on_call_cancel: the caller gave up (deadline, reset, closed).  A Quorum
 * call not yet in a round no longer counts as arrived; a vote stays counted
 * (torchft). */
static void on_call_cancel(void *ud, sg_rpc_call_t *call) {
  sg_mgr_server_t *s = ud;
  sg__mgr_waiter_t *w = sg_rpc_call_user(call);
  if (!w)
    return;
  if (w->kind == SG__MGR_LOST) {
    sg__mgr_waiter_unlink(&s->lost_calls, w);
    sg__mgr_waiter_free(w);
  } else {
    waiter_cancel(s, w);
  }
}

/* ---- loop thread and lifecycle ------------------------------------------ */

static void on_handle_closed(uv_handle_t *h) {
  sg_mgr_server_t *s = h->data;
  s->handles_open--;
}

static void close_handles(sg_mgr_server_t *s) {
  uv_close((uv_handle_t *)&s->grace_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->kill_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->commit_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->stop_async, on_handle_closed);
  uv_close((uv_handle_t *)&s->result_async, on_handle_closed);
  uv_close((uv_handle_t *)&s->local_async, on_handle_closed);
  uv_close((uv_handle_t *)&s->lost_async, on_handle_closed);
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
  uv_timer_stop(&s->commit_timer);
  pthread_mutex_lock(&s->quorum_mu);
  s->q_closed = 1; /* no call waits for a round from now on */
  pthread_mutex_unlock(&s->quorum_mu);
  fail_all(s, SG_GRPC_UNAVAILABLE, "manager shutting down");
  sg__mgr_on_local(&s->local_async); /* answers calls started before the stop */
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
    sg__mgr_job_clear(&s->job);
  sg__mgr_free_ids(s->last_members, s->n_last);
  if (s->ajob_live) /* not reached: the channel's free ran its callback */
    sg__mgr_job_clear(&s->ajob);
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
  pthread_cond_destroy(&s->lost_cv);
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

/* server_new: the server object with its locks, its copies of the
 * options and the heartbeat request encoded once; NULL when out of memory
 * (freed). */
static sg_mgr_server_t *server_new(const sg_mgr_server_opts_t *o) {
  sg_mgr_server_t *s = sg_calloc(1, sizeof(*s));
  if (!s)
    return NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->commit_mu, NULL);
  pthread_mutex_init(&s->quorum_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_cond_init(&s->job_cv, &ca);
  pthread_cond_init(&s->lost_cv, &ca);
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
    server_free(s);
    return NULL;
  }
  Torchft__LighthouseHeartbeatRequest h =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_REQUEST__INIT;
  h.replica_id = s->replica_id;
  s->hb_req_len = torchft__lighthouse_heartbeat_request__get_packed_size(&h);
  s->hb_req = sg_malloc(s->hb_req_len ? s->hb_req_len : 1);
  if (!s->hb_req) {
    server_free(s);
    return NULL;
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
  return s;
}

/* lighthouse_channel: the channel to the lighthouse (it connects by
 * itself, on the first call). */
static int lighthouse_channel(sg_mgr_server_t *s, sg_err_t *err) {
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
  return sg_rpc_channel_new(&co, &s->lh, err);
}

/* loop_init: the loop and its handles (not running yet). */
static int loop_init(sg_mgr_server_t *s, sg_err_t *err) {
  int rc = uv_loop_init(&s->loop);
  if (rc)
    return sg_err_set(err, rc, "uv_loop_init: %s", uv_strerror(rc));
  uv_timer_init(&s->loop, &s->grace_timer);
  uv_timer_init(&s->loop, &s->kill_timer);
  uv_timer_init(&s->loop, &s->commit_timer);
  uv_async_init(&s->loop, &s->stop_async, on_stop);
  uv_async_init(&s->loop, &s->result_async, on_result);
  uv_async_init(&s->loop, &s->local_async, sg__mgr_on_local);
  uv_async_init(&s->loop, &s->lost_async, on_lost);
  s->grace_timer.data = s->kill_timer.data = s->commit_timer.data = s;
  s->stop_async.data = s->result_async.data = s->local_async.data = s;
  s->lost_async.data = s;
  s->handles_open = 7;
  return 0;
}

/* start_listening: the RPC server on the loop, and the address to advertise. On
 * failure the loop is closed. */
static int start_listening(sg_mgr_server_t *s, const char *hostname,
                           sg_err_t *err) {
  sg_rpc_server_opts_t ro = {0};
  ro.bind = s->bind;
  ro.on_call = on_call;
  ro.on_call_cancel = on_call_cancel;
  ro.on_conn_close = on_conn_close;
  ro.ud = s;
  int rc = sg_rpc_server_start(&s->loop, &ro, &s->rpc, err);
  if (rc) {
    close_handles(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return rc;
  }
  s->port = sg_rpc_server_port(s->rpc);
  char host[MAX_HOST_LEN + 1];
  sg_addr_advertised(hostname, NULL, host, sizeof(host));
  int v6 = strchr(host, ':') && host[0] != '[';
  size_t alen = strlen(host) + 40;
  s->address = sg_malloc(alen);
  if (!s->address) {
    uv_async_send(&s->stop_async);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  snprintf(s->address, alen, v6 ? "http://[%s]:%d" : "http://%s:%d", host,
           s->port);
  return 0;
}

/* start_threads: the loop's, the quorum thread and the heartbeat thread.
 * On failure the server is stopped and freed. */
static int start_threads(sg_mgr_server_t *s, sg_err_t *err) {
  int rc = uv_thread_create(&s->thread, run_loop, s);
  if (rc) {
    sg_err_set(err, rc, "thread: %s", uv_strerror(rc));
    uv_async_send(&s->stop_async);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    server_free(s);
    return rc;
  }
  s->loop_started = 1;
  rc = -pthread_create(&s->q_thread, NULL, sg__mgr_quorum_main, s);
  if (!rc) {
    s->q_started = 1;
    rc = -pthread_create(&s->hb_thread, NULL, sg__mgr_heartbeat_main, s);
    s->hb_started = rc == 0;
  }
  if (rc) {
    sg_err_set(err, rc, "thread: %s", sg_strerror(rc));
    sg_mgr_server_stop(s);
  }
  return rc;
}

int sg_mgr_server_start(const sg_mgr_server_opts_t *o, sg_mgr_server_t **out,
                        sg_err_t *err) {
  int rc = validate(o, err);
  if (rc)
    return rc;
  sg_mgr_server_t *s = server_new(o);
  if (!s)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  if ((rc = lighthouse_channel(s, err)) != 0 || (rc = loop_init(s, err)) != 0 ||
      (rc = start_listening(s, o->hostname, err)) != 0) {
    server_free(s);
    return rc;
  }
  if ((rc = start_threads(s, err)) != 0)
    return rc; /* the server is gone */
  sg_log(SG_LOG_INFO, LOG,
         "[Replica %s] manager listening on %s (bind %s), lighthouse %s, "
         "world_size %lld",
         s->name, s->address, s->bind, s->lighthouse_addr,
         (long long)s->world_size);
  *out = s;
  return 0;
}

const char *sg_mgr_server_address(const sg_mgr_server_t *s) {
  return s->address;
}

int sg_mgr_server_port(const sg_mgr_server_t *s) { return s->port; }

int sg_mgr_server_has_left(const sg_mgr_server_t *s) {
  return atomic_load(&((sg_mgr_server_t *)s)->left);
}

int sg_mgr_server_wait_lost(sg_mgr_server_t *s, int64_t after_qid,
                            sg_deadline_t until, int64_t *qid) {
  if (!s || !qid)
    return SG_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&s->mu);
  s->lost_waiters++;
  while (!s->stopping && s->lost_qid <= after_qid) {
    if (sg_deadline_passed(until)) {
      rc = SG_ETIMEDOUT;
      break;
    }
    struct timespec ts = {(time_t)(until / 1000000000),
                          (long)(until % 1000000000)};
    pthread_cond_timedwait(&s->lost_cv, &s->mu, &ts);
  }
  if (!rc && s->stopping)
    rc = SG_ECANCELED;
  *qid = s->lost_qid;
  if (--s->lost_waiters == 0 && s->stopping)
    pthread_cond_broadcast(&s->lost_cv);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

void sg_mgr_server_stop(sg_mgr_server_t *s) {
  if (!s)
    return;
  /* A forked child (a DataLoader worker) may drop its copy of a server, for
   * one when its garbage collector frees a cycle the parent had not yet
   * freed: the threads to stop and join are the parent's and do not exist
   * here, and the mutex may have been held at fork().  The memory is left
   * alone (joining them crashed both workers). */
  if (sg_sock_fork_count() != s->forks)
    return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_cond_broadcast(&s->job_cv);
  pthread_cond_broadcast(&s->lost_cv);
  while (s->lost_waiters > 0) /* they return at once now; then s is freed */
    pthread_cond_wait(&s->lost_cv, &s->mu);
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
  sg__mgr_local_drain(s);
  if (uv_loop_close(&s->loop) != 0)
    sg_log(SG_LOG_WARN, LOG, "manager loop closed with handles open");
  server_free(s);
}
