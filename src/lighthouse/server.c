/*
 * server.c: the lighthouse process around the pure quorum state.
 *
 *   thread    one libuv loop on a thread of its own; the HTTP/1.1 side
 *             (libmicrohttpd) reads snapshots from its own thread, so the
 *             state is guarded by one mutex
 *   rpc       torchft.LighthouseService/{Quorum,Heartbeat} via src/rpc
 *   decisions event-driven: after every request, cancel, disconnect and
 *             at the earliest instant the decision can change by itself
 *             (one timer); the quorum_tick timer remains as torchft's
 *   liveness  which replica ids speak over which connection; when the last
 *             one closes and the replica stays silent for the grace period,
 *             it is unhealthy at once
 *   ids       quorum ids never go backwards, also across restarts (a file,
 *             or a floor taken from the wall clock; docs/lighthouse.md)
 *   etcd      with --etcd, a thread of its own (leader.c) holds a lease
 *             and campaigns for the leader key; only the leader decides,
 *             and only inside its lease; a new id is written to etcd
 *             (fenced by the leader key's create revision) before it is
 *             answered; followers forward Quorum and Heartbeat calls to the
 *             leader (proxy.c), or answer UNAVAILABLE naming it when they
 *             cannot
 *
 * A quorum response is encoded once and shared by every waiter.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "lighthouse/answer.h"
#include "lighthouse/etcd.h"
#include "lighthouse/history.h"
#include "lighthouse/http.h"
#include "lighthouse/lease.h"
#include "lighthouse/quorum.h"
#include "lighthouse/server_int.h"
#include "lighthouse/status.h"
#include "rpc/client_async.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"
#include "stepguard/lighthouse.h"
#include "stepguard/rpc.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define MAX_DATA_LEN 65536 /* QuorumMember.data, each reconfigure handle */
#define MAX_HANDLES 65536  /* reconfigure handles per member (group ranks) */
#define STATUS_LOG_MS 100  /* at most one "Quorum status" line per 100 ms */
#define QUORUM_LOG_MS 1000 /* a quorum of unchanged id: one line per second */

/* ---- helpers ------------------------------------------------------------- */

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

static int authorized(const sg_lh_server_t *s, sg_rpc_call_t *call) {
  if (!s->o.auth_token)
    return 1;
  const char *h = sg_rpc_call_metadata(call, "authorization");
  if (!h || strncmp(h, "Bearer ", 7) != 0)
    return 0;
  return ct_equal(h + 7, s->o.auth_token);
}

/* check_str: NULL when `v` is acceptable, else the reason.  UTF-8 and NUL
 * bytes were checked on the wire bytes (check_wire). */
static const char *check_str(const char *v, size_t max) {
  return strlen(v) > max ? "too long" : NULL;
}

static const uint32_t hb_strings[] = {1};
static const sg__pb_spec_t hb_spec = {hb_strings, 1, NULL, 0};
static const uint32_t member_strings[] = {1, 2, 3, 7, 9};
static const sg__pb_spec_t member_spec = {member_strings, 5, NULL, 0};
static const sg__pb_nested_t quorum_nested[] = {{1, &member_spec}};
static const uint32_t quorum_strings[] = {101}; /* last_quorum_members */
static const sg__pb_spec_t quorum_spec = {quorum_strings, 1, quorum_nested, 1};

/* check_wire: 0, or answers INVALID_ARGUMENT and returns nonzero. */
static int reject(sg_lh_server_t *s, sg_rpc_call_t *call, int status,
                  const char *fmt, const char *detail);
static int check_wire(sg_lh_server_t *s, sg_rpc_call_t *call,
                      const uint8_t *body, size_t len,
                      const sg__pb_spec_t *spec) {
  uint32_t field = 0;
  int rc = sg__pb_check_strings(body, len, spec, &field);
  if (rc == SG_EINVAL) {
    char what[64];
    snprintf(what, sizeof(what), "%u", field);
    return reject(s, call, SG_GRPC_INVALID_ARGUMENT,
                  "string field %s is not valid UTF-8 or contains NUL", what);
  }
  if (rc)
    return reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
                  "malformed protobuf message");
  return 0;
}

/* Unknown QuorumMember fields (from a newer torchft) kept per member: they
 * stay in the member's encoding made at join, so they reach every peer. */
#define MAX_UNKNOWN 64

/* ---- pending calls ---------------------------------------------------------
 */

static void pending_unlink(sg_lh_server_t *s, struct pending *p) {
  if (p->prev)
    p->prev->next = p->next;
  else
    s->pending = p->next;
  if (p->next)
    p->next->prev = p->prev;
  s->n_pending--;
}

/* pending_has: whether a call of replica `id` still waits.  A walk of the
 * list: only a cancel asks, and a map of counts kept up to date for it
 * cost every request and every answer two hashes of the id. */
static int pending_has(const sg_lh_server_t *s, const char *id) {
  for (const struct pending *p = s->pending; p; p = p->next)
    if (strcmp(p->replica_id, id) == 0)
      return 1;
  return 0;
}

static void pending_free(struct pending *p) { sg_free(p); }

/* ---- the decision ----------------------------------------------------------
 */

/*
 * A quorum held for the step floor (quorum.h) can outlast a caller's
 * deadline: the lighthouse waits up to state_loss_wait_ms, a manager's
 * round a quorum timeout.  A call that simply expired would count against
 * the caller's quorum_retries and end its trainer, so (stepguard) a held
 * call is answered UNAVAILABLE shortly before its deadline instead: a
 * manager takes that as an outage and asks again until its outage timeout,
 * and the trainer waits out the hold.  The margin is a quarter of the
 * call's time, at most HELD_MARGIN_MS.
 */
#define HELD_MARGIN_MS 1000

/* held_answer_at: when a call held for the step floor is answered. */
static int64_t held_answer_at(const struct pending *p) {
  int64_t deadline = sg_rpc_call_deadline(p->call);
  int64_t margin = (deadline - p->start_ns) / 4;
  if (margin > ms_to_ns(HELD_MARGIN_MS))
    margin = ms_to_ns(HELD_MARGIN_MS);
  return deadline - margin;
}

/* answer_held: answer the held calls that are due (see held_answer_at);
 * return the earliest answer time of those still waiting. */
static int64_t answer_held(sg_lh_server_t *s, int64_t now, const char *reason) {
  int64_t next = INT64_MAX;
  struct pending *p = s->pending;
  while (p) {
    struct pending *next_p = p->next;
    int64_t at = held_answer_at(p);
    if (at > now) {
      if (at < next)
        next = at;
    } else {
      char msg[600];
      snprintf(msg, sizeof(msg), SG_LH_HELD_MESSAGE ": %.500s", reason);
      pending_unlink(s, p);
      sg_rpc_call_respond(p->call, SG_GRPC_UNAVAILABLE, msg, NULL, 0);
      if (!pending_has(s, p->replica_id))
        sg__lh_leave(s->st, p->replica_id);
      pending_free(p);
    }
    p = next_p;
  }
  return next;
}

/*
 * log_quorum: the "Quorum!" line.  A quorum with a new id (its members
 * changed) is always logged at INFO.  One with the id of the last line is
 * the same members asking again, a training step each: a line per step
 * would cost the loop a formatted write per quorum (half its CPU for the
 * rest of the quorum), so such quorums go to INFO at most once per
 * QUORUM_LOG_MS, the others to DEBUG, and the next INFO line says how
 * many were held back.
 */
static void log_quorum(sg_lh_server_t *s, const sg__lh_quorum_t *q,
                       int64_t now) {
  int info = q->quorum_id != s->quorum_logged_id ||
             now - s->quorum_logged_ns >= ms_to_ns(QUORUM_LOG_MS);
  sg_log_level_t level = info ? SG_LOG_INFO : SG_LOG_DEBUG;
  if (!info)
    s->quorums_unlogged++;
  if (!sg_log_enabled(level))
    return;
  char line[900];
  size_t off = 0;
  for (size_t i = 0; i < q->n && off + 4 < sizeof(line); i++) {
    int n = snprintf(line + off, sizeof(line) - off, "%s%s(step %lld)",
                     i ? ", " : "", q->members[i].replica_id,
                     (long long)q->members[i].step);
    if (n < 0)
      break;
    off += (size_t)n;
  }
  if (off >= sizeof(line))
    memcpy(line + sizeof(line) - 4, "...", 4);
  char more[96] = "";
  if (info && s->quorums_unlogged && q->quorum_id == s->quorum_logged_id)
    snprintf(more, sizeof(more),
             " (and %llu quorums of this id since the last line)",
             (unsigned long long)s->quorums_unlogged);
  sg_log(level, LOG, "Quorum! id %lld with %zu participants: [%s]%s",
         (long long)q->quorum_id, q->n, q->n ? line : "", more);
  if (info) {
    s->quorum_logged_id = q->quorum_id;
    s->quorum_logged_ns = now;
    s->quorums_unlogged = 0;
  }
}

/*
 * answer_quorum: respond to every pending call whose replica is in `q`.
 * The decision time ends once the one shared answer is encoded; `event_ns`
 * is when the event that completed the quorum reached the lighthouse.
 */
/*
 * deliver: answer every pending call whose replica is a member of the last
 * issued quorum with `blob` (NULL: out of memory).  `held`: the answer was
 * held for etcd's confirmation, so a member may have asked again meanwhile:
 * its newer participant entry is answered too and must not linger.
 */
static void deliver(sg_lh_server_t *s, sg_rpc_blob_t *blob, int held) {
  struct pending *p = s->pending;
  while (p) {
    struct pending *next = p->next;
    if (sg__lh_is_member(s->st, p->replica_id)) {
      pending_unlink(s, p);
      sg__lh_observe_latency(s, p->start_ns);
      if (blob)
        sg_rpc_call_respond_blob(p->call, blob);
      else
        sg_rpc_call_respond(p->call, SG_GRPC_RESOURCE_EXHAUSTED,
                            "lighthouse out of memory", NULL, 0);
      if (held)
        sg__lh_leave(s->st, p->replica_id);
      pending_free(p);
    }
    p = next;
  }
}

static void answer_quorum(sg_lh_server_t *s, const sg__lh_quorum_t *q,
                          int64_t event_ns) {
  sg_rpc_blob_t *blob = sg__lh_answer_encode(q);
  sg__lh_observe_decision(s, sg_now_ns() - event_ns);
  deliver(s, blob, 0);
  if (blob)
    sg_rpc_blob_unref(blob);
}

/* fail_pending: answer every waiting call with UNAVAILABLE `msg` (a
 * lighthouse that stopped leading; clients try the next address). */
void sg__lh_fail_pending(sg_lh_server_t *s, const char *msg) {
  while (s->pending) {
    struct pending *p = s->pending;
    pending_unlink(s, p);
    sg_rpc_call_respond(p->call, SG_GRPC_UNAVAILABLE, msg, NULL, 0);
    pending_free(p);
  }
}

/*
 * hold_quorum: quorum `q` has a new id: its record (id and members) goes to
 * etcd first, written by the etcd thread under the condition that our
 * leader key still has the create revision we won it with; the answer is
 * encoded now and sent once etcd confirmed it (fence_step).  Without
 * memory for the record its members are failed (they ask again).
 */
static void hold_quorum(sg_lh_server_t *s, const sg__lh_quorum_t *q,
                        int64_t event_ns) {
  const char **ids = sg_calloc(q->n ? q->n : 1, sizeof(*ids));
  char *rec = NULL;
  int rc = ids ? 0 : SG_ENOMEM;
  for (size_t i = 0; !rc && i < q->n; i++)
    ids[i] = q->members[i].replica_id;
  if (!rc)
    rc = sg__lh_record_encode(q->quorum_id, ids, q->n, &rec);
  sg_free(ids);
  sg_rpc_blob_t *blob = rc ? NULL : sg__lh_answer_encode(q);
  sg__lh_observe_decision(s, sg_now_ns() - event_ns);
  if (!blob) {
    sg_log(SG_LOG_ERROR, LOG, "quorum %lld: cannot encode its record: %s",
           (long long)q->quorum_id, sg_strerror(rc ? rc : SG_ENOMEM));
    sg_free(rec);
    deliver(s, NULL, 0);
    return;
  }
  if (s->held)
    sg_rpc_blob_unref(s->held);
  s->held = blob;
  s->held_id = q->quorum_id;
  s->held_event_ns = event_ns;
  sg_free(s->want_rec);
  s->want_rec = rec;
  s->want_id = q->quorum_id;
  s->fence.write_in_flight = 1;
  pthread_cond_signal(&s->etcd_cv);
}

/*
 * fence_step: with etcd, before any decision: send a held answer once etcd
 * has confirmed its id and the lease still runs, and say whether the
 * decision may run now (sg__lh_fence_may_decide).  Caller holds mu.
 */
static int fence_step(sg_lh_server_t *s, int64_t now) {
  if (s->held) {
    if (!sg__lh_fence_may_answer(&s->fence, s->held_id, now))
      return 0;
    deliver(s, s->held, 1);
    sg_rpc_blob_unref(s->held);
    s->held = NULL;
  }
  return sg__lh_fence_may_decide(&s->fence, now);
}

/* expire_graces: replicas whose connections all closed and stayed silent. */
static void expire_graces(sg_lh_server_t *s, int64_t now) {
  if (s->graces == 0)
    return;
  size_t pos = 0;
  const char *id;
  void *v;
  while (sg_map_next(&s->live, &pos, &id, &v)) {
    struct live *l = v;
    if (l->grace_deadline && l->grace_deadline <= now && l->nconns == 0) {
      sg_log(SG_LOG_INFO, LOG,
             "replica %s: connection closed and silent for %lld ms, "
             "marking it unhealthy",
             id, (long long)s->o.disconnect_grace_ms);
      sg__lh_history_down(s->hist, now, id,
                          "connection closed, silent past the grace period");
      sg__lh_mark_dead(s->st, id);
      s->graces--;
      sg_map_del(&s->live, id); /* allowed while iterating: current entry */
      sg_free(l);
    }
  }
}

static int64_t earliest_grace(const sg_lh_server_t *s) {
  int64_t best = INT64_MAX;
  if (s->graces == 0)
    return best;
  size_t pos = 0;
  const char *id;
  void *v;
  while (sg_map_next(&s->live, &pos, &id, &v)) {
    struct live *l = v;
    if (l->grace_deadline && l->grace_deadline < best)
      best = l->grace_deadline;
  }
  return best;
}

static void on_tick(uv_timer_t *t);

/* rearm: one timer at the earliest instant something can change. */
static void rearm(sg_lh_server_t *s, int64_t now) {
  if (s->closing)
    return;
  int64_t next = sg__lh_next_deadline(s->st, now, &s->qopts);
  int64_t g = earliest_grace(s);
  if (g < next)
    next = g;
  if (s->next_prune_ns < next)
    next = s->next_prune_ns;
  if (s->holding && s->held_due_ns < next)
    next = s->held_due_ns;
  if (s->status_unlogged &&
      s->status_logged_ns + ms_to_ns(STATUS_LOG_MS) < next)
    next = s->status_logged_ns + ms_to_ns(STATUS_LOG_MS);
  if (next == INT64_MAX) {
    uv_timer_stop(&s->wake_timer);
    return;
  }
  int64_t ms = next <= now ? 0 : (next - now + 999999) / 1000000;
  s->wake_due_ns = now + ms * 1000000;
  uv_timer_start(&s->wake_timer, on_tick, (uint64_t)ms, 0);
}

/*
 * after_join: the cheap step after a quorum request that cannot complete a
 * quorum (sg__lh_may_meet said so).  A join only moves deadlines later (its
 * heartbeat expires last; its joined time is the latest; a grace it ends
 * goes away), except a first participant's join timeout, now +
 * join_timeout, and the held-back status line.  So the wake timer needs
 * no O(N) re-computation while it is armed no later than those.  The
 * reason changed (its counts did): it is logged within STATUS_LOG_MS.
 */
static void after_join(sg_lh_server_t *s, int64_t now) {
  int64_t bound = ms_to_ns(s->o.join_timeout_ms);
  if (ms_to_ns(s->o.heartbeat_timeout_ms) < bound)
    bound = ms_to_ns(s->o.heartbeat_timeout_ms);
  bound = bound > INT64_MAX - now ? INT64_MAX : now + bound;
  s->status_unlogged = 1;
  int64_t status_due = s->status_logged_ns + ms_to_ns(STATUS_LOG_MS);
  if (status_due < bound)
    bound = status_due;
  if (s->holding && s->pending) { /* the request just made */
    int64_t at = held_answer_at(s->pending);
    if (at < s->held_due_ns)
      s->held_due_ns = at;
    if (at < bound)
      bound = at;
  }
  if (!uv_is_active((uv_handle_t *)&s->wake_timer) || s->wake_due_ns > bound)
    rearm(s, now);
}

/*
 * why_lost: why member `id` of the last quorum is not in the one being
 * issued, for the history (those whose connection closed were told
 * already, in expire_graces).  Caller holds mu.
 */
static const char *why_lost(void *ud, const char *id) {
  sg_lh_server_t *s = ud;
  if (!sg__lh_is_healthy(s->st, id, sg_now_ns(), &s->qopts))
    return "heartbeat timed out";
  return "healthy, but did not ask for this quorum in time";
}

/*
 * process: the decision step, run after every event; `event_ns` is when the
 * event reached the lighthouse (the start of a quorum's decision time).
 * The status line is logged when the reason changed, at most once per
 * STATUS_LOG_MS: while 1,000 requests arrive the counts in it change with
 * each, and a line per request would cost the loop a write each.  A change
 * held back arms the wake timer, so the latest reason is logged within
 * STATUS_LOG_MS.  `join`: the event was a quorum request (after_join may
 * stand in for the decision).  Caller holds mu.
 */
void sg__lh_process(sg_lh_server_t *s, int64_t event_ns, int join) {
  int64_t now = sg_now_ns();
  if (s->o.etcd && !fence_step(s, now)) {
    if (s->n_pending)
      s->fenced_total++;
    return; /* etcd_async runs this again when the lease or a write moves */
  }
  if (join && s->graces == 0 && now < s->next_prune_ns &&
      now - s->status_logged_ns < ms_to_ns(STATUS_LOG_MS) &&
      !sg__lh_may_meet(s->st, &s->qopts)) {
    after_join(s, now);
    return;
  }
  expire_graces(s, now);
  if (now >= s->next_prune_ns) {
    size_t n = sg__lh_prune(s->st, now, s->o.prune_after_ms);
    if (n)
      sg_log(SG_LOG_INFO, LOG,
             "pruned %zu heartbeat records older than %lld ms", n,
             (long long)s->o.prune_after_ms);
    s->next_prune_ns = now + ms_to_ns(s->o.prune_after_ms / 10 + 1);
  }
  const sg__lh_quorum_t *q = NULL;
  char reason[512];
  int64_t before = sg__lh_quorum_id(s->st);
  size_t regressions = sg__lh_step_regressions(s->st, NULL, NULL);
  int rc = sg__lh_tick(s->st, now, sg_wall_ns(), &s->qopts, &q, reason,
                       sizeof(reason));
  s->holding = rc == 0 && strncmp(reason, "Holding", 7) == 0;
  if (s->holding)
    s->held_due_ns = answer_held(s, now, reason);
  if (rc < 0) {
    sg_log(SG_LOG_ERROR, LOG, "quorum tick failed: %s", sg_strerror(rc));
  } else {
    s->status_unlogged = 0;
    if (strcmp(reason, s->reason) != 0) {
      if (now - s->status_logged_ns >= ms_to_ns(STATUS_LOG_MS)) {
        sg_log(s->holding ? SG_LOG_WARN : SG_LOG_INFO, LOG, "Quorum status: %s",
               reason);
        snprintf(s->reason, sizeof(s->reason), "%s", reason);
        s->status_logged_ns = now;
      } else {
        s->status_unlogged = 1;
      }
    }
    if (rc == 1 && q) {
      s->quorums_issued++;
      int64_t from, to;
      if (sg__lh_step_regressions(s->st, &from, &to) != regressions)
        sg_log(to == 0 ? SG_LOG_ERROR : SG_LOG_WARN, LOG,
               "quorum %lld takes the job back from step %lld to step %lld%s: "
               "no replica holding step %lld is left or came back "
               "(state_loss_wait_ms %lld)",
               (long long)q->quorum_id, (long long)from, (long long)to,
               to == 0 ? ", the job starts over" : "", (long long)from,
               (long long)s->o.state_loss_wait_ms);
      /* before any answer: ids must not repeat after a crash */
      sg__lh_idfile_persist(s, q, now);
      if (s->o.etcd && q->quorum_id > s->fence.confirmed_id)
        hold_quorum(s, q, event_ns);
      else if (s->o.etcd &&
               !sg__lh_fence_may_answer(&s->fence, q->quorum_id, sg_now_ns()))
        hold_quorum(s, q, event_ns); /* the lease ran out meanwhile */
      else
        answer_quorum(s, q, event_ns);
      if (q->quorum_id != before)
        sg_log(SG_LOG_INFO, LOG,
               "Detected quorum change, quorum id is now %lld",
               (long long)q->quorum_id);
      log_quorum(s, q, now);
      sg__lh_history_quorum(s->hist, now, q, why_lost, s);
      sg__lh_free_retired(s->st);
      s->reason[0] = '\0'; /* log the next status afresh */
    }
  }
  rearm(s, now);
}

/* ---- liveness --------------------------------------------------------------
 */

/*
 * note_speaker: replica `id` spoke on connection `conn_id`.  When the pair
 * is the connection's last noted one (a replica's every request after its
 * first), nothing changes: its live entry counts this open connection, so
 * it has no grace deadline either.
 */
static void note_speaker(sg_lh_server_t *s, const char *id, uint64_t conn_id) {
  struct conn *c = s->conn_cache[conn_id % CONN_CACHE];
  if (c && c->id == conn_id && c->last && strcmp(c->last, id) == 0)
    return;
  char key[24];
  conn_key(conn_id, key);
  c = sg_map_get(&s->conns, key);
  if (!c) {
    c = sg_calloc(1, sizeof(*c));
    if (!c)
      return; /* liveness is best effort: heartbeats still decide */
    sg_map_init(&c->ids);
    c->id = conn_id;
    if (sg_map_put(&s->conns, key, c, NULL) != 0) {
      sg_free(c);
      return;
    }
  }
  struct live *l = sg_map_get(&s->live, id);
  if (!l) {
    l = sg_calloc(1, sizeof(*l));
    if (!l || sg_map_put(&s->live, id, l, NULL) != 0) {
      sg_free(l);
      return;
    }
  }
  if (l->grace_deadline) { /* spoke again in time */
    l->grace_deadline = 0;
    s->graces--;
  }
  if (!sg_map_get(&c->ids, id)) {
    if (sg_map_put(&c->ids, id, (void *)1, NULL) != 0)
      return;
    l->nconns++;
  }
  char *last = sg_strdup(id);
  if (!last)
    return; /* the next request takes this path again */
  sg_free(c->last);
  c->last = last;
  s->conn_cache[conn_id % CONN_CACHE] = c;
}

static void on_conn_close(void *ud, uint64_t conn_id) {
  sg_lh_server_t *s = ud;
  int64_t event_ns = sg_now_ns();
  char key[24];
  conn_key(conn_id, key);
  pthread_mutex_lock(&s->mu);
  s->disconnects_total++;
  struct conn *c = sg_map_del(&s->conns, key);
  if (c) {
    int64_t deadline = sg_now_ns() + ms_to_ns(s->o.disconnect_grace_ms);
    size_t pos = 0;
    const char *id;
    void *v;
    while (sg_map_next(&c->ids, &pos, &id, &v)) {
      struct live *l = sg_map_get(&s->live, id);
      if (!l || l->nconns == 0)
        continue;
      if (--l->nconns == 0 && !s->closing) {
        sg_log(SG_LOG_DEBUG, LOG, "replica %s: last connection closed", id);
        if (!l->grace_deadline)
          s->graces++;
        l->grace_deadline = deadline > 0 ? deadline : 1;
      }
    }
    if (s->conn_cache[conn_id % CONN_CACHE] == c)
      s->conn_cache[conn_id % CONN_CACHE] = NULL;
    sg_map_free(&c->ids);
    sg_free(c->last);
    sg_free(c);
    if (!s->closing)
      sg__lh_process(s, event_ns, 0);
  }
  pthread_mutex_unlock(&s->mu);
}

/* ---- calls
 * ------------------------------------------------------------------- */

static int reject(sg_lh_server_t *s, sg_rpc_call_t *call, int status,
                  const char *fmt, const char *detail) {
  char msg[256];
  snprintf(msg, sizeof(msg), fmt, detail);
  s->rejected_total++;
  sg_log(SG_LOG_DEBUG, LOG, "rejecting %s: %s", sg_rpc_call_method(call), msg);
  sg_rpc_call_respond(call, status, msg, NULL, 0);
  return -1;
}

/* is_healthy: whether `id` counts as healthy right now. */
static int is_healthy(const sg_lh_server_t *s, const char *id, int64_t now) {
  return sg__lh_is_healthy(s->st, id, now, &s->qopts);
}

/* a heartbeat answer is recomputed at most this often (1,000 replicas
 * heartbeat 10,000 times a second); it names at most MAX_LOST_LISTED */
#define LOST_CACHE_MS 20
#define MAX_LOST_LISTED 64

/*
 * lost_answer: the answer to a heartbeat from a member of the last issued
 * quorum: the members of that quorum now unhealthy (heartbeats expired, or
 * connections closed past the grace), so that the survivors stop waiting on
 * them (stepguard extension fields; torchft's clients skip them).  Empty
 * when none is.  The bytes stay owned by the server.
 */
static void lost_answer(sg_lh_server_t *s, int64_t now, const uint8_t **body,
                        size_t *len) {
  const sg__lh_quorum_t *q = sg__lh_prev_quorum(s->st);
  *body = NULL;
  *len = 0;
  if (!q)
    return;
  if (s->lost_for_qid != q->quorum_id ||
      now - s->lost_at_ns >= ms_to_ns(LOST_CACHE_MS)) {
    char *ids[MAX_LOST_LISTED];
    size_t n = 0;
    for (size_t i = 0; i < q->n && n < MAX_LOST_LISTED; i++)
      if (!is_healthy(s, q->members[i].replica_id, now))
        ids[n++] = q->members[i].replica_id;
    sg_free(s->lost_resp);
    s->lost_resp = NULL;
    s->lost_resp_len = 0;
    if (n) {
      Torchft__LighthouseHeartbeatResponse r =
          TORCHFT__LIGHTHOUSE_HEARTBEAT_RESPONSE__INIT;
      r.lost_quorum_id = q->quorum_id;
      r.n_lost_members = n;
      r.lost_members = ids;
      size_t need = torchft__lighthouse_heartbeat_response__get_packed_size(&r);
      s->lost_resp = sg_malloc(need);
      if (s->lost_resp) /* out of memory: an empty answer, as torchft's */
        s->lost_resp_len =
            torchft__lighthouse_heartbeat_response__pack(&r, s->lost_resp);
    }
    s->lost_for_qid = q->quorum_id;
    s->lost_at_ns = now;
  }
  *body = s->lost_resp;
  *len = s->lost_resp_len;
}

/*
 * left_out_answer: the answer to a heartbeat from a replica that says it
 * was answered quorum `qid` (a stepguard manager's extension field) while
 * the last issued quorum is newer and leaves it out: that quorum `qid` is
 * over for it, so that a member cut off or hung while the others went on
 * without it stops waiting in that quorum's collectives once it is heard
 * again.  Encoded into buf (cap bytes); *len 0 when there is nothing to say.
 */
static void left_out_answer(const sg_lh_server_t *s, int64_t qid,
                            const char *id, uint8_t *buf, size_t cap,
                            size_t *len) {
  const sg__lh_quorum_t *q = sg__lh_prev_quorum(s->st);
  *len = 0;
  if (qid <= 0 || !q || qid >= q->quorum_id)
    return;
  Torchft__LighthouseHeartbeatResponse r =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_RESPONSE__INIT;
  char *ids[1] = {(char *)id};
  r.lost_quorum_id = qid;
  r.n_lost_members = 1;
  r.lost_members = ids;
  if (torchft__lighthouse_heartbeat_response__get_packed_size(&r) <= cap)
    *len = torchft__lighthouse_heartbeat_response__pack(&r, buf);
}

static void handle_heartbeat(sg_lh_server_t *s, sg_rpc_call_t *call,
                             const uint8_t *body, size_t len,
                             int64_t event_ns) {
  if (check_wire(s, call, body, len, &hb_spec))
    return;
  Torchft__LighthouseHeartbeatRequest *req =
      torchft__lighthouse_heartbeat_request__unpack(&sg__pb_allocator, len,
                                                    body);
  if (!req) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
           "invalid LighthouseHeartbeatRequest");
    return;
  }
  const char *bad = check_str(req->replica_id, MAX_ID_LEN);
  if (bad || req->replica_id[0] == '\0') {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "replica_id %s",
           bad ? bad : "is empty");
    goto out;
  }
  int64_t now = sg_now_ns();
  int was_healthy = is_healthy(s, req->replica_id, now);
  int rc = sg__lh_heartbeat(s->st, req->replica_id, now);
  if (rc) {
    reject(s, call, SG_GRPC_RESOURCE_EXHAUSTED, "heartbeat refused: %s",
           sg_strerror(rc));
    goto out;
  }
  s->heartbeats_total++;
  note_speaker(s, req->replica_id, sg_rpc_call_conn_id(call));
  const uint8_t *answer = NULL;
  size_t answer_len = 0;
  uint8_t own[MAX_ID_LEN + 32];
  if (sg__lh_is_member(s->st, req->replica_id)) {
    lost_answer(s, now, &answer, &answer_len);
  } else {
    left_out_answer(s, req->quorum_id, req->replica_id, own, sizeof(own),
                    &answer_len);
    answer = answer_len ? own : NULL;
  }
  sg_rpc_call_respond(call, SG_GRPC_OK, NULL, answer, answer_len);
  /* A heartbeat of a replica that was already healthy cannot change the
   * decision; skip the work (1,000 replicas heartbeat 10,000 times/s). */
  if (!was_healthy)
    sg__lh_process(s, event_ns, 0);
out:
  torchft__lighthouse_heartbeat_request__free_unpacked(req, &sg__pb_allocator);
}

void sg__lh_handle_quorum(sg_lh_server_t *s, sg_rpc_call_t *call,
                          const uint8_t *body, size_t len, int64_t event_ns) {
  struct pending *p = NULL;
  s->quorum_requests_total++;
  if (check_wire(s, call, body, len, &quorum_spec))
    return;
  Torchft__LighthouseQuorumRequest *req =
      torchft__lighthouse_quorum_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
           "invalid LighthouseQuorumRequest");
    return;
  }
  Torchft__QuorumMember *r = req->requester;
  if (!r) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s", "missing requester");
    goto out;
  }
  const char *bad;
  if ((bad = check_str(r->replica_id, MAX_ID_LEN)) || !r->replica_id[0]) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "requester.replica_id %s",
           bad ? bad : "is empty");
    goto out;
  }
  if ((bad = check_str(r->address, MAX_ID_LEN))) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "requester.address %s", bad);
    goto out;
  }
  if ((bad = check_str(r->store_address, MAX_ID_LEN))) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "requester.store_address %s",
           bad);
    goto out;
  }
  if ((bad = check_str(r->data, MAX_DATA_LEN))) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "requester.data %s", bad);
    goto out;
  }
  if (r->n_reconfigure_handles > MAX_HANDLES) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
           "requester.reconfigure_handles: too many (one per group rank)");
    goto out;
  }
  for (size_t i = 0; i < r->n_reconfigure_handles; i++) {
    if ((bad = check_str(r->reconfigure_handles[i], MAX_DATA_LEN))) {
      reject(s, call, SG_GRPC_INVALID_ARGUMENT,
             "requester.reconfigure_handles %s", bad);
      goto out;
    }
  }
  sg__lh_member_t m = {
      .replica_id = r->replica_id,
      .address = r->address,
      .store_address = r->store_address,
      .data = r->data,
      .step = r->step,
      .world_size = r->world_size,
      .commit_failures = r->commit_failures,
      .shrink_only = r->shrink_only,
      .reconfigure_handles = r->reconfigure_handles,
      .n_reconfigure_handles = r->n_reconfigure_handles,
  };
  if (req->n_last_quorum_members > s->o.max_replicas ||
      req->last_quorum_id < 0) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
           "last_quorum: too many members or a negative id");
    goto out;
  }
  for (size_t i = 0; i < req->n_last_quorum_members; i++) {
    if ((bad = check_str(req->last_quorum_members[i], MAX_ID_LEN)) ||
        !req->last_quorum_members[i][0]) {
      reject(s, call, SG_GRPC_INVALID_ARGUMENT, "last_quorum_members %s",
             bad ? bad : "has an empty id");
      goto out;
    }
  }
  if (r->base.n_unknown_fields > MAX_UNKNOWN) {
    reject(s, call, SG_GRPC_INVALID_ARGUMENT, "%s",
           "requester has too many unknown fields");
    goto out;
  }
  /* the member's encoding: the request's own bytes when they are exactly
   * the member (no copy, no re-encoding), else encoded from the parse */
  uint8_t *wire = NULL;
  const uint8_t *span;
  int rc = 0;
  if (sg__lh_member_span(body, len, &span, &m.wire_len))
    m.wire = (uint8_t *)(uintptr_t)span; /* sg__lh_join copies it */
  else if ((rc = sg__lh_member_wire(r, &wire, &m.wire_len)) == 0)
    m.wire = wire;
  size_t id_len = strlen(r->replica_id); /* <= MAX_ID_LEN (checked) */
  p = rc ? NULL : sg_calloc(1, sizeof(*p) + id_len + 1);
  if (p)
    memcpy(p->replica_id, r->replica_id, id_len + 1);
  if (!rc && !p)
    rc = SG_ENOMEM;
  if (!rc)
    rc = sg__lh_expect(s->st, req->last_quorum_id,
                       (const char *const *)req->last_quorum_members,
                       req->n_last_quorum_members, sg_now_ns());
  /* a restarted lighthouse (or a new leader) learns how far the job got
   * from the members of its last quorum, as it learns their ids */
  if (!rc && req->last_quorum_id > 0 && !sg__lh_prev_quorum(s->st))
    sg__lh_set_step_floor(s->st, req->last_quorum_max_step, sg_now_ns());
  if (!rc)
    rc = sg__lh_join(s->st, &m, sg_now_ns());
  sg_free(wire); /* the state keeps its own copy */
  if (rc) {
    reject(s, call, SG_GRPC_RESOURCE_EXHAUSTED, "quorum request refused: %s",
           sg_strerror(rc));
    if (p)
      pending_free(p);
    goto out;
  }
  p->call = call;
  p->start_ns = sg_now_ns();
  p->next = s->pending;
  if (s->pending)
    s->pending->prev = p;
  s->pending = p;
  s->n_pending++;
  sg_rpc_call_set_user(call, p);
  note_speaker(s, r->replica_id, sg_rpc_call_conn_id(call));
  sg__lh_process(s, event_ns, 1);
out:
  torchft__lighthouse_quorum_request__free_unpacked(req, &sg__pb_allocator);
}

static void on_call(void *ud, sg_rpc_call_t *call) {
  sg_lh_server_t *s = ud;
  int64_t event_ns = sg_now_ns(); /* the request is complete and parsed */
  const char *method = sg_rpc_call_method(call);
  size_t len = 0;
  const uint8_t *body = sg_rpc_call_body(call, &len);
  pthread_mutex_lock(&s->mu);
  if (s->closing) {
    sg_rpc_call_respond(call, SG_GRPC_UNAVAILABLE, "lighthouse shutting down",
                        NULL, 0);
  } else if (!authorized(s, call)) {
    reject(s, call, SG_GRPC_UNAUTHENTICATED, "%s",
           "missing or wrong authorization token");
  } else if (s->o.etcd && s->fence.role != SG__LH_ROLE_LEADER &&
             sg__lh_proxy_call(s, call, method, body, len)) {
    /* a follower forwarded it to the leader */
  } else if (s->o.etcd && s->fence.role != SG__LH_ROLE_LEADER) {
    /* a follower that cannot forward: the client tries its next address */
    char msg[1200];
    if (s->leader_addr)
      snprintf(msg, sizeof(msg), "not the leader; the leader is %.1024s",
               s->leader_addr);
    else
      snprintf(msg, sizeof(msg), "not the leader; no leader elected yet");
    s->rejected_total++;
    sg_rpc_call_respond(call, SG_GRPC_UNAVAILABLE, msg, NULL, 0);
  } else if (strcmp(method, "/torchft.LighthouseService/Heartbeat") == 0) {
    handle_heartbeat(s, call, body, len, event_ns);
  } else if (strcmp(method, "/torchft.LighthouseService/Quorum") == 0) {
    sg__lh_handle_quorum(s, call, body, len, event_ns);
  } else {
    reject(s, call, SG_GRPC_UNIMPLEMENTED, "unknown method %.200s", method);
  }
  pthread_mutex_unlock(&s->mu);
}

/* on_call_cancel: deadline, RST_STREAM or closed connection before the
 * quorum: the participant leaves at once (torchft keeps it). */
static void on_call_cancel(void *ud, sg_rpc_call_t *call) {
  sg_lh_server_t *s = ud;
  int64_t event_ns = sg_now_ns();
  struct pending *p = sg_rpc_call_user(call);
  if (!p)
    return;
  pthread_mutex_lock(&s->mu);
  if (p->is_proxy) { /* its forwarded call ends at the same deadline */
    ((struct proxied *)(void *)p)->call = NULL;
    pthread_mutex_unlock(&s->mu);
    return;
  }
  pending_unlink(s, p);
  if (!s->closing && !pending_has(s, p->replica_id))
    sg__lh_leave(s->st, p->replica_id);
  pending_free(p);
  if (!s->closing)
    sg__lh_process(s, event_ns, 0);
  pthread_mutex_unlock(&s->mu);
}

/* ---- HTTP/1.1 side
 * ------------------------------------------------------------ */

static void on_http1(void *ud, int fd) {
  sg_lh_server_t *s = ud;
  if (s->http)
    sg__lh_http_add_connection(s->http, fd);
  else
    sg_sock_close(fd);
}

/* ---- loop thread and lifecycle
 * ------------------------------------------------ */

static void on_tick(uv_timer_t *t) {
  sg_lh_server_t *s = t->data;
  int64_t event_ns = sg_now_ns();
  pthread_mutex_lock(&s->mu);
  sg__lh_process(s, event_ns, 0);
  pthread_mutex_unlock(&s->mu);
}

static void on_handle_closed(uv_handle_t *h) {
  sg_lh_server_t *s = h->data;
  s->handles_open--;
}

static void on_rpc_closed(void *ud) {
  sg_lh_server_t *s = ud;
  s->rpc = NULL;
  uv_close((uv_handle_t *)&s->tick_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->wake_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->stop_async, on_handle_closed);
  if (s->o.etcd) {
    uv_close((uv_handle_t *)&s->etcd_async, on_handle_closed);
    uv_close((uv_handle_t *)&s->proxy_async, on_handle_closed);
    uv_close((uv_handle_t *)&s->proxy_timer, on_handle_closed);
  }
}

static void on_stop(uv_async_t *a) {
  sg_lh_server_t *s = a->data;
  pthread_mutex_lock(&s->mu);
  s->closing = 1;
  pthread_mutex_unlock(&s->mu);
  uv_timer_stop(&s->tick_timer);
  uv_timer_stop(&s->wake_timer);
  /* the rpc server cancels every waiting call (on_call_cancel) */
  sg_rpc_server_close(s->rpc, on_rpc_closed, s);
}

static void run_loop(void *arg) {
  sg_lh_server_t *s = arg;
  sg_thread_name("sg-lighthouse");
  uv_run(&s->loop, UV_RUN_DEFAULT);
}

static void free_maps(sg_lh_server_t *s) {
  size_t pos = 0;
  const char *k;
  void *v;
  while (sg_map_next(&s->live, &pos, &k, &v))
    sg_free(v);
  pos = 0;
  while (sg_map_next(&s->conns, &pos, &k, &v)) {
    struct conn *c = v;
    sg_map_free(&c->ids);
    sg_free(c->last);
    sg_free(c);
  }
  sg_map_free(&s->live);
  sg_map_free(&s->conns);
}

static void server_free(sg_lh_server_t *s) {
  if (!s)
    return;
  while (s->pending) {
    struct pending *p = s->pending;
    pending_unlink(s, p);
    pending_free(p);
  }
  free_maps(s);
  if (s->http)
    sg__lh_http_free(s->http);
  sg__lh_state_free(s->st);
  sg_free(s->hist);
  sg_free(s->lost_resp);
  sg__etcd_free(s->etcd);
  while (s->proxy_done) { /* answered after the loop stopped */
    struct proxied *p = s->proxy_done;
    s->proxy_done = p->done_next;
    sg_free(p->resp);
    sg_free(p);
  }
  while (s->proxy_wait) {
    struct proxied *p = s->proxy_wait;
    s->proxy_wait = p->done_next;
    sg_free(p);
  }
  sg_free(s->proxy_addr);
  pthread_mutex_destroy(&s->proxy_mu);
  sg_free(s->leader_addr);
  sg_free(s->want_rec);
  sg__lh_record_ids_free(s->promote_ids, s->promote_n);
  if (s->held)
    sg_rpc_blob_unref(s->held);
  sg_free((char *)s->o.etcd);
  sg_free((char *)s->o.etcd_prefix);
  pthread_cond_destroy(&s->etcd_cv);
  sg_free((char *)s->o.bind);
  sg_free((char *)s->o.auth_token);
  sg_free((char *)s->o.quorum_id_file);
  sg_free((char *)s->o.hostname);
  sg_free(s->address);
  pthread_mutex_destroy(&s->mu);
  sg_free(s);
}

void sg_lh_opts_init(sg_lh_opts_t *o) {
  memset(o, 0, sizeof(*o));
  o->bind = "[::]:29510";
  o->min_replicas = -1;
  o->join_timeout_ms = 60000;
  o->quorum_tick_ms = 100;
  o->heartbeat_timeout_ms = 5000;
  o->disconnect_grace_ms = 250;
  o->prune_after_ms = 600000;
  o->max_replicas = 10000;
  o->max_connections = 4096;
  o->max_message = 4 << 20;
  o->etcd_prefix = "/stepguard/lighthouse";
  o->etcd_ttl_s = 2;
  o->state_loss_wait_ms = 60000;
}

static char *dup_or_null(const char *v, int *fail) {
  if (!v)
    return NULL;
  char *d = sg_strdup(v);
  if (!d)
    *fail = 1;
  return d;
}

static int validate(const sg_lh_opts_t *o, sg_err_t *err) {
  if (o->min_replicas < 0)
    return sg_err_set(err, SG_EINVAL, "min_replicas is required (>= 0)");
  if (o->join_timeout_ms < 0 || o->quorum_tick_ms <= 0 ||
      o->heartbeat_timeout_ms <= 0 || o->disconnect_grace_ms < 0 ||
      o->prune_after_ms <= 0)
    return sg_err_set(err, SG_EINVAL,
                      "timeouts must be >= 0 and tick, heartbeat timeout and "
                      "prune age > 0");
  if (o->max_replicas == 0 || o->max_connections == 0 || o->max_message == 0)
    return sg_err_set(err, SG_EINVAL, "limits must be > 0");
  if (!o->bind || !o->bind[0])
    return sg_err_set(err, SG_EINVAL, "bind address is empty");
  if (o->etcd && (o->etcd_ttl_s < 1 || o->etcd_ttl_s > 3600 ||
                  !o->etcd_prefix || strlen(o->etcd_prefix) > 512 ||
                  strchr(o->etcd_prefix, '"') || strchr(o->etcd_prefix, '\\')))
    return sg_err_set(err, SG_EINVAL,
                      "--etcd_ttl_s must be 1 .. 3600 and --etcd_prefix at "
                      "most 512 bytes without quotes");
  return 0;
}

static int is_loopback_bind(const char *bind) {
  return strncmp(bind, "127.", 4) == 0 || strncmp(bind, "[::1]", 5) == 0 ||
         strncmp(bind, "localhost:", 10) == 0;
}

int sg_lh_server_start(const sg_lh_opts_t *o, sg_lh_server_t **out,
                       sg_err_t *err) {
  sg_lh_server_t *s = NULL;
  int rc = validate(o, err);
  if (rc)
    return rc;
  s = sg_calloc(1, sizeof(*s));
  if (!s)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->proxy_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->etcd_cv, &ca);
  pthread_condattr_destroy(&ca);
  s->dec_last_ns = -1;
  s->status_logged_ns = INT64_MIN / 2; /* the first status is logged */
  s->quorum_logged_id = -1;
  sg_map_init(&s->live);
  sg_map_init(&s->conns);
  s->o = *o;
  int fail = 0;
  s->o.bind = dup_or_null(o->bind, &fail);
  s->o.auth_token = dup_or_null(o->auth_token, &fail);
  s->o.quorum_id_file = dup_or_null(o->quorum_id_file, &fail);
  s->o.hostname = dup_or_null(o->hostname, &fail);
  s->o.etcd = o->etcd && o->etcd[0] ? dup_or_null(o->etcd, &fail) : NULL;
  s->o.etcd_prefix = dup_or_null(o->etcd_prefix, &fail);
  s->fence.role = s->o.etcd ? SG__LH_ROLE_FOLLOWER : SG__LH_ROLE_SINGLE;
  if (fail) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto fail;
  }
  s->qopts.min_replicas = o->min_replicas;
  s->qopts.join_timeout_ms = o->join_timeout_ms;
  s->qopts.heartbeat_timeout_ms = o->heartbeat_timeout_ms;
  s->qopts.state_loss_wait_ms = o->state_loss_wait_ms;
  s->persisted_step = -1;
  rc = sg__lh_state_new(o->max_replicas, &s->st);
  if (rc) {
    sg_err_set(err, rc, "quorum state: %s", sg_strerror(rc));
    goto fail;
  }
  s->hist = sg_malloc(sizeof(*s->hist));
  if (!s->hist) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto fail;
  }
  sg__lh_history_init(s->hist, 0);
  int64_t floor = sg__lh_idfile_load(s);
  sg__lh_set_quorum_id_floor(s->st, floor);
  s->persisted_id = floor;
  if (s->o.etcd && (rc = sg__lh_leader_start(s, err)) != 0)
    goto fail;
  s->next_prune_ns = sg_now_ns() + ms_to_ns(o->prune_after_ms / 10 + 1);
  s->forks = sg_sock_fork_count();

  sg__lh_http_opts_t ho = {0};
  ho.auth_token = s->o.auth_token;
  ho.max_connections = 256;
  ho.timeout_s = 10;
  ho.snapshot = sg__lh_snapshot;
  ho.kill = sg__lh_kill_replica;
  ho.ud = s;
  rc = sg__lh_http_new(&ho, &s->http, err);
  if (rc)
    goto fail;

  rc = uv_loop_init(&s->loop);
  if (rc) {
    sg_err_set(err, rc, "uv_loop_init: %s", uv_strerror(rc));
    goto fail;
  }
  uv_timer_init(&s->loop, &s->tick_timer);
  uv_timer_init(&s->loop, &s->wake_timer);
  uv_async_init(&s->loop, &s->stop_async, on_stop);
  s->tick_timer.data = s->wake_timer.data = s->stop_async.data = s;
  s->handles_open = 3;
  if (s->o.etcd) {
    uv_async_init(&s->loop, &s->etcd_async, sg__lh_leader_async);
    uv_async_init(&s->loop, &s->proxy_async, sg__lh_proxy_answer);
    uv_timer_init(&s->loop, &s->proxy_timer);
    s->etcd_async.data = s->proxy_async.data = s->proxy_timer.data = s;
    s->handles_open += 3;
  }

  sg_rpc_server_opts_t ro = {0};
  ro.bind = s->o.bind;
  ro.max_message = o->max_message;
  ro.max_connections = o->max_connections;
  ro.on_call = on_call;
  ro.on_call_cancel = on_call_cancel;
  ro.on_conn_close = on_conn_close;
  ro.on_http1 = on_http1;
  ro.ud = s;
  rc = sg_rpc_server_start(&s->loop, &ro, &s->rpc, err);
  if (rc) {
    uv_close((uv_handle_t *)&s->tick_timer, NULL);
    uv_close((uv_handle_t *)&s->wake_timer, NULL);
    uv_close((uv_handle_t *)&s->stop_async, NULL);
    if (s->o.etcd) {
      uv_close((uv_handle_t *)&s->etcd_async, NULL);
      uv_close((uv_handle_t *)&s->proxy_async, NULL);
      uv_close((uv_handle_t *)&s->proxy_timer, NULL);
    }
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    goto fail;
  }
  s->port = sg_rpc_server_port(s->rpc);
  char host[256];
  if (s->o.hostname)
    snprintf(host, sizeof(host), "%s", s->o.hostname);
  else if (gethostname(host, sizeof(host)) != 0)
    snprintf(host, sizeof(host), "localhost");
  host[sizeof(host) - 1] = '\0';
  size_t alen = strlen(host) + 32;
  s->address = sg_malloc(alen);
  if (s->address)
    snprintf(s->address, alen, "http://%s:%d", host, s->port);

  uv_timer_start(&s->tick_timer, on_tick, (uint64_t)o->quorum_tick_ms,
                 (uint64_t)o->quorum_tick_ms);
  uv_timer_start(&s->wake_timer, on_tick, 0, 0);
  rc = uv_thread_create(&s->thread, run_loop, s);
  if (rc) {
    sg_err_set(err, rc, "thread: %s", uv_strerror(rc));
    uv_async_send(&s->stop_async);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    goto fail;
  }
  if (s->o.etcd) {
    if (!s->address ||
        pthread_create(&s->etcd_thread, NULL, sg__lh_leader_main, s)) {
      rc = sg_err_set(err, SG_ENOMEM, "cannot start the etcd thread");
      uv_async_send(&s->stop_async);
      uv_thread_join(&s->thread);
      uv_loop_close(&s->loop);
      goto fail;
    }
    s->etcd_started = 1;
  }
  if (!o->auth_token && !is_loopback_bind(s->o.bind))
    sg_log(SG_LOG_WARN, LOG,
           "listening on %s without an auth token: anyone who reaches this "
           "port can join quorums and kill replicas (--auth_token_file)",
           s->o.bind);
  sg_log(SG_LOG_INFO, LOG, "Lighthouse listening on %s (bind %s)",
         s->address ? s->address : "?", s->o.bind);
  *out = s;
  return 0;
fail:
  server_free(s);
  return rc;
}

int sg_lh_server_port(const sg_lh_server_t *s) { return s->port; }

const char *sg_lh_server_address(const sg_lh_server_t *s) {
  return s->address ? s->address : "";
}

void sg_lh_server_stop(sg_lh_server_t *s) {
  if (!s)
    return;
  /* A forked child (a DataLoader worker's garbage collector) may drop its
   * copy: the loop and etcd threads are the parent's, and the mutex may
   * have been held at fork(); the memory is left alone, as the manager
   * server does. */
  if (sg_sock_fork_count() != s->forks)
    return;
  if (s->etcd_started) { /* before the loop: it posts to etcd_async */
    pthread_mutex_lock(&s->mu);
    s->etcd_stop = 1;
    pthread_cond_signal(&s->etcd_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->etcd_thread, NULL);
  }
  uv_async_send(&s->stop_async);
  uv_thread_join(&s->thread);
  if (uv_loop_close(&s->loop) != 0)
    sg_log(SG_LOG_WARN, LOG, "event loop closed with handles open");
  server_free(s);
}
