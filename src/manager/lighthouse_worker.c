/*
 * lighthouse_worker.c: the ManagerServer's side of the lighthouse: the
 * quorum thread (a round's LighthouseService/Quorum call with torchft's
 * retry rule), the asynchronous first attempt of a round (answered on the
 * lighthouse channel's I/O thread), and the heartbeat thread.  Both threads
 * and the attempt share one channel (s->lh).  See manager_int.h for the
 * threads and their hand-off under `mu`.
 *
 *   jobs        sg__mgr_job_clear; the response's string checks
 *   one call    lh_heartbeat, lh_quorum_encode, lh_quorum_decode,
 *               local_timeout, lh_quorum_once
 *   async       on_lh_quorum, sg__mgr_lh_start_async
 *   threads     quorum_with_retries, sg__mgr_quorum_main,
 *               sg__mgr_heartbeat_main
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "manager/manager_int.h"
#include "rpc/client_async.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"
#include "stepguard/lighthouse.h"

#define LOG "manager"
#define MIN_RETRY_SLEEP_MS 100 /* torchft _quorum_with_retries */

#define MAX_OUTAGE_SLEEP_MS 1000 /* backoff cap while unreachable */
/* an outage round answers this long before its deadline, which is also its
 * callers' own: the answer must reach them before they give up */
#define OUTAGE_ANSWER_MARGIN_MS 250

void sg__mgr_job_clear(sg__mgr_job_t *j) {
  for (size_t i = 0; i < j->n_handles; i++)
    sg_free(j->handles[i]);
  sg_free(j->handles);
  j->handles = NULL;
  j->n_handles = 0;
  sg__mgr_free_ids(j->last_members, j->n_last);
  j->last_members = NULL;
  j->n_last = 0;
}

void sg__mgr_free_ids(char **ids, size_t n) {
  for (size_t i = 0; i < n; i++)
    sg_free(ids[i]);
  sg_free(ids);
}

char **sg__mgr_dup_ids(char *const *ids, size_t n) {
  char **out = n ? sg_calloc(n, sizeof(*out)) : NULL;
  if (!out)
    return NULL;
  for (size_t i = 0; i < n; i++) {
    out[i] = sg_strdup(ids[i]);
    if (!out[i]) {
      sg__mgr_free_ids(out, i);
      return NULL;
    }
  }
  return out;
}

/* LighthouseQuorumResponse -> Quorum (field 1) -> QuorumMember (field 2) */
static const uint32_t member_strings[] = {1, 2, 3, 7, 9};
static const sg__pb_spec_t member_spec = {member_strings, 5, NULL, 0};
static const sg__pb_nested_t quorum_nested[] = {{2, &member_spec}};
static const sg__pb_spec_t quorum_spec = {NULL, 0, quorum_nested, 1};
static const sg__pb_nested_t lhresp_nested[] = {{1, &quorum_spec}};
static const sg__pb_spec_t lhresp_spec = {NULL, 0, lhresp_nested, 1};

/* ---- lighthouse workers ------------------------------------------------- */

/* wait_ms: sleep on cv until `ms` passed, stop or leave; returns nonzero
 * when the worker must quit.  Caller holds mu. */
static int wait_ms(sg_mgr_server_t *s, int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t ns = (int64_t)ts.tv_nsec + sg__mgr_ms_to_ns(ms);
  ts.tv_sec += (time_t)(ns / 1000000000);
  ts.tv_nsec = (long)(ns % 1000000000);
  while (!s->stopping && !atomic_load(&s->left))
    if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) != 0)
      break;
  return s->stopping || atomic_load(&s->left);
}

/* wait_outage_ms: wait_ms, also ended by a heartbeat getting through
 * again (s->lh_back moved past `back`): a lighthouse back, or a new leader
 * found, is asked at once instead of after the rest of a backoff. */
static int wait_outage_ms(sg_mgr_server_t *s, int64_t ms, uint64_t back) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t ns = (int64_t)ts.tv_nsec + sg__mgr_ms_to_ns(ms);
  ts.tv_sec += (time_t)(ns / 1000000000);
  ts.tv_nsec = (long)(ns % 1000000000);
  while (!s->stopping && !atomic_load(&s->left) && s->lh_back == back)
    if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) != 0)
      break;
  return s->stopping || atomic_load(&s->left);
}

/*
 * not_leader: a lighthouse answered UNAVAILABLE: a follower of replicated
 * lighthouses ("not the leader"), one that lost its leadership, or one
 * shutting down.  Drop the connection so that the channel's next attempt
 * goes to its next address (a channel of one address reconnects to it).
 * A quorum held for the step floor (`msg` SG_LH_HELD_MESSAGE) came from
 * the leader: the connection stays.  Not on the channel's I/O thread.
 */
static void not_leader(sg_mgr_server_t *s, int grpc_status, const char *msg) {
  if (grpc_status == SG_GRPC_UNAVAILABLE && !strstr(msg, SG_LH_HELD_MESSAGE))
    sg_rpc_channel_disconnect(s->lh);
}

/* LighthouseHeartbeatResponse: lost_members (101) */
static const uint32_t hbresp_strings[] = {101};
static const sg__pb_spec_t hbresp_spec = {hbresp_strings, 1, NULL, 0};

/*
 * note_lost: a heartbeat answer that names members of quorum `qid` as lost
 * (a stepguard lighthouse's extension): remember the newest such quorum and
 * wake sg_mgr_server_wait_lost.  Heartbeat thread.
 */
static void note_lost(sg_mgr_server_t *s, const uint8_t *resp,
                      size_t resp_len) {
  uint32_t field = 0;
  if (!resp_len || sg__pb_check_strings(resp, resp_len, &hbresp_spec, &field))
    return;
  Torchft__LighthouseHeartbeatResponse *r =
      torchft__lighthouse_heartbeat_response__unpack(&sg__pb_allocator,
                                                     resp_len, resp);
  if (!r)
    return;
  if (r->lost_quorum_id > 0 && r->n_lost_members > 0) {
    pthread_mutex_lock(&s->mu);
    int news = r->lost_quorum_id > s->lost_qid;
    if (news) {
      s->lost_qid = r->lost_quorum_id;
      pthread_cond_broadcast(&s->lost_cv);
      /* the loop answers the other group ranks' WaitLost calls; the loop
       * runs while this thread does (stop joins this thread first) */
      uv_async_send(&s->lost_async);
    }
    pthread_mutex_unlock(&s->mu);
    if (news)
      sg_log(SG_LOG_WARN, LOG,
             "[Replica %s] the lighthouse holds %s%s of quorum %lld "
             "unhealthy",
             s->name, r->lost_members[0],
             r->n_lost_members > 1 ? " (and others)" : "",
             (long long)r->lost_quorum_id);
  }
  torchft__lighthouse_heartbeat_response__free_unpacked(r, &sg__pb_allocator);
}

/* lh_heartbeat: one Heartbeat call, with the last quorum this manager was
 * answered (a stepguard lighthouse tells a member that a newer quorum left
 * out that its quorum is over); out of memory sends the request encoded at
 * start, without it. */
static int lh_heartbeat(sg_mgr_server_t *s, sg_deadline_t deadline,
                        sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  Torchft__LighthouseHeartbeatRequest h =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_REQUEST__INIT;
  h.replica_id = s->replica_id;
  pthread_mutex_lock(&s->quorum_mu);
  h.quorum_id = s->last_qid;
  pthread_mutex_unlock(&s->quorum_mu);
  size_t len = torchft__lighthouse_heartbeat_request__get_packed_size(&h);
  uint8_t *req = sg_malloc(len ? len : 1);
  if (req)
    len = torchft__lighthouse_heartbeat_request__pack(&h, req);
  int status = -1;
  int rc = sg_rpc_channel_call(s->lh, "/torchft.LighthouseService/Heartbeat",
                               req ? req : s->hb_req, req ? len : s->hb_req_len,
                               deadline, &resp, &resp_len, &status, err);
  sg_free(req);
  if (!rc)
    note_lost(s, resp, resp_len);
  else
    not_leader(s, status, err->msg);
  sg_free(resp);
  return rc;
}

/* lh_quorum_encode: the LighthouseQuorumRequest of round `j`
 * (sg_malloc'd, *len bytes), or NULL when out of memory. */
static uint8_t *lh_quorum_encode(const sg_mgr_server_t *s,
                                 const sg__mgr_job_t *j, size_t *len) {
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
  q.last_quorum_id = j->last_qid;
  q.last_quorum_max_step = j->last_max_step > 0 ? j->last_max_step : 0;
  q.n_last_quorum_members = j->n_last;
  q.last_quorum_members = j->last_members;
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

/*
 * unreachable: whether a failed call never reached a lighthouse (refused,
 * reset, a connect that timed out): no gRPC status came back, and neither
 * the attempt's deadline nor this side's channel ended it.  Such a failure
 * is an outage, retried within the round's deadline without counting
 * against quorum_retries (stepguard; torchft fails the round).
 */
static int unreachable(int rc, int grpc_status, int local) {
  if (rc != 0 && grpc_status == SG_GRPC_UNAVAILABLE)
    return 1; /* not the leader (replicated lighthouses), or shutting down */
  return rc != 0 && grpc_status < 0 && !local && rc != SG_EABORTED &&
         rc != SG_ECLOSED && rc != SG_ECANCELED && rc != SG_ENOMEM;
}

/* lh_quorum_once: one LighthouseService/Quorum call. */
static int lh_quorum_once(sg_mgr_server_t *s, const sg__mgr_job_t *j,
                          sg_deadline_t deadline,
                          Torchft__LighthouseQuorumResponse **out, int *local,
                          int *gone, sg_err_t *err) {
  size_t len = 0;
  uint8_t *req = lh_quorum_encode(s, j, &len), *resp = NULL;
  size_t resp_len = 0;
  int status = -1, rc;
  *out = NULL;
  *local = 0;
  *gone = 0;
  if (!req)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  rc = sg_rpc_channel_call(s->lh, "/torchft.LighthouseService/Quorum", req, len,
                           deadline, &resp, &resp_len, &status, err);
  if (rc) {
    *local = local_timeout(rc, status, deadline);
    *gone = unreachable(rc, status, *local);
    not_leader(s, status, err->msg);
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
 * lighthouse channel's I/O thread).  An answer ends the round
 * (sg__mgr_round_done, as the quorum thread ends the others); a failure
 * goes to the quorum thread, which applies torchft's retry rule from
 * there, except while the server stops: then the failure ends the round.
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
  sg__mgr_job_t j = s->ajob;
  memset(&s->ajob, 0, sizeof(s->ajob));
  s->ajob_live = 0;
  int stopping = s->stopping;
  if (rc && !stopping) {
    j.first_rc = rc;
    j.first_local = local_timeout(call_rc, grpc_status, j.first_deadline);
    j.first_unreachable = unreachable(call_rc, grpc_status, j.first_local);
    snprintf(j.first_msg, sizeof(j.first_msg), "%s", e.msg);
    s->job = j;
    s->job_ready = 1;
    pthread_mutex_unlock(&s->mu);
    pthread_cond_signal(&s->job_cv);
    return;
  }
  pthread_mutex_unlock(&s->mu);
  sg__mgr_job_clear(&j);
  sg__mgr_round_done(s, rc, rc ? e.msg : "", out);
}

/*
 * sg__mgr_lh_start_async: send round `j`'s first attempt as an asynchronous
 * call while the lighthouse connection is up (else the quorum thread makes it:
 * a reconnect is on its way, and a failure takes it there anyway).  Returns 1
 * if it did (the server owns the job from here; *j is emptied), 0 to leave the
 * round to the quorum thread.  quorum_mu held.
 */
int sg__mgr_lh_start_async(sg_mgr_server_t *s, sg__mgr_job_t *j) {
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
 * (it reconnects by itself).
 *
 * stepguard: a call that never reached a lighthouse (unreachable()) is an
 * outage, not an attempt: it is retried with backoff (100 ms doubling to
 * 1 s) until the round's deadline, and then the round fails with
 * "lighthouse unreachable", which the Python Manager retries up to its
 * outage deadline, so a lighthouse restart costs no trainer.  A quorum the
 * lighthouse holds for the step floor past a call's deadline is answered
 * UNAVAILABLE and waited out the same way.  Called without mu.
 */
static int quorum_with_retries(sg_mgr_server_t *s, const sg__mgr_job_t *j,
                               Torchft__LighthouseQuorumResponse **out,
                               sg_err_t *err) {
  sg_deadline_t round_end =
      j->first_rc ? j->first_deadline : sg_deadline_in_ms(j->timeout_ms);
  sg_deadline_t answer_by =
      round_end - (sg_deadline_t)OUTAGE_ANSWER_MARGIN_MS * 1000000;
  int64_t outage_sleep_ms = MIN_RETRY_SLEEP_MS, outages = 0;
  for (int64_t retry = 0, attempt = 0;; attempt++) {
    int local = 0, gone = 0, rc;
    sg_err_t e;
    sg_err_clear(&e);
    if (attempt == 0 && j->first_rc) { /* made asynchronously */
      rc = sg_err_set(&e, j->first_rc, "%s", j->first_msg);
      local = j->first_local;
      gone = j->first_unreachable;
    } else {
      /* an attempt after an outage gets what is left of the round */
      sg_deadline_t d = outages ? answer_by : sg_deadline_in_ms(j->timeout_ms);
      rc = lh_quorum_once(s, j, d, out, &local, &gone, &e);
    }
    if (rc == 0) {
      if (outages)
        sg_log(SG_LOG_INFO, LOG, "[Replica %s] lighthouse %s reachable again",
               s->name, s->lighthouse_addr);
      return 0;
    }
    const char *why = e.msg[0] ? e.msg : sg_strerror(rc);
    /* during an outage an attempt gets only what is left of the round: its
     * deadline passing without an answer is the outage going on */
    gone = gone || (outages > 0 && local);
    if (gone) {
      int64_t left_ms = sg_deadline_left_ms(answer_by);
      pthread_mutex_lock(&s->mu);
      uint64_t back = s->lh_back;
      pthread_mutex_unlock(&s->mu);
      /* a quorum held for the step floor is answered as an outage, so
       * that the trainer waits it out (lighthouse/server.c, answer_held) */
      if (outages++ == 0 && strstr(why, SG_LH_HELD_MESSAGE))
        sg_log(SG_LOG_WARN, LOG, "[Replica %s] lighthouse %s: %s", s->name,
               s->lighthouse_addr, why);
      else if (outages == 1)
        sg_log(SG_LOG_WARN, LOG,
               "[Replica %s] lighthouse %s unreachable (%s): retrying", s->name,
               s->lighthouse_addr, why);
      if (left_ms <= 0)
        return sg_err_set(err, SG_ECONNREFUSED, "lighthouse unreachable: %s",
                          why);
      int64_t sleep_ms = outage_sleep_ms < left_ms ? outage_sleep_ms : left_ms;
      outage_sleep_ms = outage_sleep_ms * 2 > MAX_OUTAGE_SLEEP_MS
                            ? MAX_OUTAGE_SLEEP_MS
                            : outage_sleep_ms * 2;
      pthread_mutex_lock(&s->mu);
      int quit = wait_outage_ms(s, sleep_ms, back);
      pthread_mutex_unlock(&s->mu);
      if (quit)
        return sg_err_set(err, SG_ECANCELED, "manager stopping");
      continue;
    }
    sg_log(SG_LOG_WARN, LOG, "[Replica %s] lighthouse quorum attempt %lld: %s",
           s->name, (long long)retry, why);
    if (rc == SG_EABORTED || rc == SG_ECLOSED)
      return sg_err_set(err, rc, "lighthouse channel closed: %s", why);
    if (retry >= s->quorum_retries)
      return sg_err_set(err, rc,
                        "lighthouse quorum failed after %lld retries: %s",
                        (long long)retry, why);
    retry++;
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

void *sg__mgr_quorum_main(void *arg) {
  sg_mgr_server_t *s = arg;
  sg_thread_name("sg-mgr-quorum");
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->job_ready && !s->stopping)
      pthread_cond_wait(&s->job_cv, &s->mu);
    if (s->stopping)
      break;
    sg__mgr_job_t j = s->job;
    s->job_ready = 0;
    pthread_mutex_unlock(&s->mu);
    Torchft__LighthouseQuorumResponse *resp = NULL;
    sg_err_t e;
    sg_err_clear(&e);
    int rc = quorum_with_retries(s, &j, &resp, &e);
    sg__mgr_job_clear(&j);
    sg__mgr_round_done(s, rc, e.msg[0] ? e.msg : sg_strerror(rc), resp);
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

void *sg__mgr_heartbeat_main(void *arg) {
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
    if (!rc && failing) {
      pthread_mutex_lock(&s->mu);
      s->lh_back++;
      pthread_cond_broadcast(&s->cv);
      pthread_mutex_unlock(&s->mu);
    }
    failing = rc != 0;
    pthread_mutex_lock(&s->mu);
    if (wait_ms(s, s->hb_interval_ms))
      break;
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}
