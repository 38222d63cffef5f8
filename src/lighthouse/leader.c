/*
 * leader.c: leadership in etcd (--etcd): the etcd thread holds a lease,
 * campaigns for the leader key, keeps the lease alive and writes each new
 * quorum's record, fenced by the leader key's revision.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lighthouse/server_int.h"

/* ---- leadership in etcd ----------------------------------------------------
 *
 * The etcd thread (sg__lh_leader_main) holds a lease, campaigns for the leader
 * key <prefix>/leader (value: our address) and keeps the lease alive; the
 * leader also writes each new quorum's record to <prefix>/quorum.  It
 * talks to the loop only through the fields under mu and etcd_async.
 */

#define ETCD_POLL_MS                                                           \
  100 /* a follower campaigns (reads the holder) this often */
#define ETCD_START_MS 5000 /* start gives up without a lease after this */
#define ETCD_LOG_MS 5000   /* one line per etcd error kind this often */

static int64_t call_ms(const sg_lh_server_t *s) {
  int64_t ms = s->lease_ttl_s * 1000 / 4;
  return ms < 100 ? 100 : ms > 1000 ? 1000 : ms;
}

/* lease_margin_ns: a tenth of the TTL plus 100 ms (clock rates, the
 * keepalive's answer in flight, the answer leaving the socket). */
static int64_t lease_margin_ns(int64_t ttl_s) {
  return ttl_s * 100000000 + 100000000;
}

/* demote: stop leading at once (mu held): no call is answered from here;
 * the loop fails what waits (etcd_async). */
static void demote(sg_lh_server_t *s, const char *why) {
  if (s->fence.role == SG__LH_ROLE_LEADER || s->promote)
    sg_log(SG_LOG_WARN, LOG, "no longer the leader (term %lld): %s",
           (long long)s->term, why);
  s->fence.role = SG__LH_ROLE_FOLLOWER;
  s->fence.ready = 0;
  s->fence.write_in_flight = 0;
  s->fence.lease_deadline = 0;
  s->promote = 0;
  sg__lh_record_ids_free(s->promote_ids, s->promote_n);
  s->promote_ids = NULL;
  s->promote_n = 0;
  sg_free(s->want_rec);
  s->want_rec = NULL;
  sg_free(s->leader_addr);
  s->leader_addr = NULL;
  s->demote = 1;
  uv_async_send(&s->etcd_async);
}

/* install: the loop side of winning (mu held): a fresh quorum state whose
 * ids start above the wall clock, the last quorum in etcd and our id file,
 * and which waits for that quorum's members (or their silence) before its
 * first quorum (sg__lh_expect: the restart hold). */
static void install(sg_lh_server_t *s, int64_t now) {
  sg__lh_state_t *st = NULL;
  int64_t step_floor = sg__lh_step_floor(s->st);
  if (s->persisted_step > step_floor)
    step_floor = s->persisted_step;
  if (sg__lh_state_new(s->o.max_replicas, &st) == 0) {
    sg__lh_fail_pending(s, "lighthouse became the leader; ask again");
    sg__lh_state_free(s->st);
    s->st = st;
    s->lost_for_qid = -1;
  } else {
    sg_log(SG_LOG_ERROR, LOG, "out of memory for a fresh quorum state");
  }
  int64_t floor = sg_wall_ns() / 1000;
  if (s->promote_qid > floor)
    floor = s->promote_qid;
  if (s->persisted_id > floor)
    floor = s->persisted_id;
  sg__lh_set_quorum_id_floor(s->st, floor);
  sg__lh_set_step_floor(s->st, step_floor, now);
  if (s->promote_n)
    sg__lh_expect(s->st, s->promote_qid, (const char *const *)s->promote_ids,
                  s->promote_n, now);
  s->fence.confirmed_id = s->promote_qid;
  s->fence.role = SG__LH_ROLE_LEADER;
  s->fence.ready = 1;
  sg_log(SG_LOG_INFO, LOG,
         "leader (term %lld): the last quorum in etcd is %lld with %zu "
         "members; ids continue above %lld",
         (long long)s->term, (long long)s->promote_qid, s->promote_n,
         (long long)floor);
  sg__lh_record_ids_free(s->promote_ids, s->promote_n);
  s->promote_ids = NULL;
  s->promote_n = 0;
  s->promote = 0;
}

void sg__lh_leader_async(uv_async_t *a) {
  sg_lh_server_t *s = a->data;
  int64_t now = sg_now_ns();
  pthread_mutex_lock(&s->mu);
  if (!s->closing) {
    if (s->demote) {
      s->demote = 0;
      if (s->held) {
        sg_rpc_blob_unref(s->held);
        s->held = NULL;
      }
      sg__lh_fail_pending(s,
                          "not the leader; the lighthouse lost its leadership");
    }
    if (s->promote)
      install(s, now);
    sg__lh_process(s, now, 0);
  }
  pthread_mutex_unlock(&s->mu);
}

/* etcd_wait: sleep on etcd_cv until `until` (monotonic ns), stop, or (with
 * `on_record`) a record to write.  mu held. */
static void etcd_wait(sg_lh_server_t *s, int64_t until, int on_record) {
  while (!s->etcd_stop &&
         !(on_record && s->want_rec && s->fence.role == SG__LH_ROLE_LEADER)) {
    int64_t now = sg_now_ns();
    if (now >= until)
      return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t left = until - now;
    ts.tv_sec += left / 1000000000;
    ts.tv_nsec += left % 1000000000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&s->etcd_cv, &s->mu, &ts);
  }
}

/* etcd_error: count and log (at most one line per ETCD_LOG_MS). */
static void etcd_error(sg_lh_server_t *s, const char *what, const sg_err_t *e,
                       int rc, int64_t *logged) {
  s->etcd_errors++;
  s->etcd_ok = 0;
  int64_t now = sg_now_ns();
  if (now - *logged >= ms_to_ns(ETCD_LOG_MS)) {
    *logged = now;
    sg_log(SG_LOG_WARN, LOG, "etcd %s failed: %s%s", what,
           e->msg[0] ? e->msg : sg_strerror(rc),
           s->fence.role == SG__LH_ROLE_LEADER
               ? " (the leader decides only inside its lease)"
               : "");
  }
}

void *sg__lh_leader_main(void *arg) {
  sg_lh_server_t *s = arg;
  sg_thread_name("sg-lh-etcd");
  char kl[600], kq[600];
  snprintf(kl, sizeof(kl), "%s/leader", s->o.etcd_prefix);
  snprintf(kq, sizeof(kq), "%s/quorum", s->o.etcd_prefix);
  int64_t logged = INT64_MIN / 2;
  int leading = 0, have_record = 0;
  int64_t rev = 0, lease_sent = s->lease_sent_ns, next_campaign = 0;
  int64_t ka_ns = s->lease_ttl_s * 1000000000 / 4;
  int64_t next_ka = lease_sent + ka_ns;
  pthread_mutex_lock(&s->mu);
  while (!s->etcd_stop) {
    int64_t now = sg_now_ns(), cms = call_ms(s);
    sg_err_t e;
    sg_err_clear(&e);
    int rc;
    sg__lh_proxy_sync(s, leading ? NULL : s->leader_addr);
    if (leading && now >= s->fence.lease_deadline) {
      /* no keepalive came back in time: etcd may already have let the key
       * go.  Stop, so clients move on, and start over with a new lease. */
      demote(s, "the lease ran out before a keepalive came back");
      leading = 0;
      s->lease_id = 0;
      continue;
    }
    if (leading && have_record && s->want_rec) {
      /* fencing 2: the write holds only while our leader key does */
      char *rec = s->want_rec;
      int64_t id = s->want_id;
      int ok = 0;
      s->want_rec = NULL;
      pthread_mutex_unlock(&s->mu);
      rc = sg__etcd_put_if(s->etcd, kl, rev, kq, rec, cms, &ok, &e);
      pthread_mutex_lock(&s->mu);
      if (rc) {
        etcd_error(s, "quorum write", &e, rc, &logged);
        if (!s->want_rec && s->fence.role == SG__LH_ROLE_LEADER)
          s->want_rec = rec; /* again, while the lease lasts */
        else
          sg_free(rec);
        etcd_wait(s, sg_now_ns() + ms_to_ns(ETCD_POLL_MS), 0);
        continue;
      }
      sg_free(rec);
      if (!ok) {
        demote(s, "etcd refused the quorum write: another lighthouse holds "
                  "the leader key");
        leading = 0;
        continue;
      }
      if (id > s->fence.confirmed_id)
        s->fence.confirmed_id = id;
      if (!s->want_rec)
        s->fence.write_in_flight = 0;
      uv_async_send(&s->etcd_async);
      continue;
    }
    if (s->lease_id && now >= next_ka) {
      int64_t id = s->lease_id, ttl = 0;
      pthread_mutex_unlock(&s->mu);
      int64_t sent = sg_now_ns();
      rc = sg__etcd_keepalive(s->etcd, id, cms, &ttl, &e);
      pthread_mutex_lock(&s->mu);
      if (rc) {
        etcd_error(s, "lease keepalive", &e, rc, &logged);
        next_ka = sg_now_ns() + ms_to_ns(ETCD_POLL_MS);
      } else if ((s->etcd_ok = 1, s->etcd_ok_ns = sg_now_ns(), ttl <= 0)) {
        if (leading)
          demote(s, "the lease expired in etcd");
        leading = 0;
        s->lease_id = 0;
      } else {
        lease_sent = sent;
        next_ka = sent + ka_ns;
        if (leading) {
          /* fencing 1: no answer after this instant unless renewed */
          s->fence.lease_deadline =
              sg__lh_lease_deadline(sent, ttl, lease_margin_ns(ttl));
          uv_async_send(&s->etcd_async);
        }
      }
      continue;
    }
    if (!s->lease_id) {
      int64_t id = 0, ttl = 0;
      pthread_mutex_unlock(&s->mu);
      int64_t sent = sg_now_ns();
      rc = sg__etcd_grant(s->etcd, s->o.etcd_ttl_s, cms, &id, &ttl, &e);
      pthread_mutex_lock(&s->mu);
      if (rc) {
        etcd_error(s, "lease grant", &e, rc, &logged);
        etcd_wait(s, sg_now_ns() + ms_to_ns(ETCD_POLL_MS), 0);
        continue;
      }
      s->lease_id = id;
      s->lease_ttl_s = ttl;
      lease_sent = sent;
      ka_ns = ttl * 1000000000 / 4;
      next_ka = sent + ka_ns;
      continue;
    }
    if (!leading && now >= next_campaign) {
      int won = 0;
      int64_t crev = 0, id = s->lease_id;
      char *holder = NULL;
      pthread_mutex_unlock(&s->mu);
      rc = sg__etcd_campaign(s->etcd, kl, s->address, id, cms, &won, &crev,
                             &holder, &e);
      pthread_mutex_lock(&s->mu);
      next_campaign = sg_now_ns() + ms_to_ns(ETCD_POLL_MS);
      s->etcd_ok = rc == 0;
      if (rc == 0)
        s->etcd_ok_ns = sg_now_ns();
      if (rc) {
        etcd_error(s, "campaign", &e, rc, &logged);
      } else if (won) {
        leading = 1;
        have_record = 0;
        rev = crev;
        s->term = crev;
        s->elections_won++;
        s->fence.lease_deadline = sg__lh_lease_deadline(
            lease_sent, s->lease_ttl_s, lease_margin_ns(s->lease_ttl_s));
        sg_free(s->leader_addr);
        s->leader_addr = sg_strdup(s->address);
        sg_log(SG_LOG_INFO, LOG, "won the election in etcd (term %lld)",
               (long long)crev);
      } else {
        if (crev != s->term ||
            (holder && (!s->leader_addr || strcmp(holder, s->leader_addr))))
          sg_log(SG_LOG_INFO, LOG, "following the leader %s (term %lld)",
                 holder ? holder : "(none)", (long long)crev);
        s->term = crev;
        sg_free(s->leader_addr);
        s->leader_addr = holder;
        holder = NULL;
      }
      sg_free(holder);
      continue;
    }
    if (leading && !have_record) {
      /* fencing 3: the last quorum etcd holds, before the first decision */
      char *val = NULL;
      size_t vlen = 0;
      int64_t qrev = 0, qid = 0;
      char **ids = NULL;
      size_t n = 0;
      pthread_mutex_unlock(&s->mu);
      rc = sg__etcd_get(s->etcd, kq, cms, &val, &vlen, &qrev, &e);
      if (!rc && val &&
          sg__lh_record_decode(val, vlen, s->o.max_replicas, &qid, &ids, &n))
        sg_log(SG_LOG_WARN, LOG, "%s in etcd is not a quorum record: ignored",
               kq);
      sg_free(val);
      pthread_mutex_lock(&s->mu);
      if (rc) {
        etcd_error(s, "read of the last quorum", &e, rc, &logged);
        etcd_wait(s, sg_now_ns() + ms_to_ns(ETCD_POLL_MS), 0);
        continue;
      }
      have_record = 1;
      sg__lh_record_ids_free(s->promote_ids, s->promote_n);
      s->promote_ids = ids;
      s->promote_n = n;
      s->promote_qid = qid;
      s->promote = 1;
      uv_async_send(&s->etcd_async);
      continue;
    }
    int64_t until = next_ka;
    if (!leading && next_campaign < until)
      until = next_campaign;
    if (leading && s->fence.lease_deadline < until)
      until = s->fence.lease_deadline;
    etcd_wait(s, until, 1);
  }
  int64_t id = s->lease_id;
  s->lease_id = 0;
  sg_rpc_channel_t *pch = s->proxy_ch;
  s->proxy_ch = NULL;
  pthread_mutex_unlock(&s->mu);
  if (pch) /* its calls complete while the loop still runs */
    sg_rpc_channel_free(pch);
  if (id) { /* a successor need not wait for the TTL */
    sg_err_t e;
    sg_err_clear(&e);
    sg__etcd_revoke(s->etcd, id, call_ms(s), &e);
  }
  return NULL;
}

/* etcd_start: the client and a first lease, before anything serves: an
 * unreachable etcd at start is a clear error, not a silent follower. */
int sg__lh_leader_start(sg_lh_server_t *s, sg_err_t *err) {
  int rc = sg__etcd_new(s->o.etcd, &s->etcd, err);
  if (rc)
    return rc;
  sg_deadline_t until = sg_deadline_in_ms(ETCD_START_MS);
  for (;;) {
    sg_err_t e;
    sg_err_clear(&e);
    int64_t id = 0, ttl = 0, sent = sg_now_ns();
    rc = sg__etcd_grant(s->etcd, s->o.etcd_ttl_s, 1000, &id, &ttl, &e);
    if (!rc) {
      s->lease_id = id;
      s->lease_sent_ns = sent;
      s->lease_ttl_s = ttl;
      s->etcd_ok = 1;
      s->etcd_ok_ns = sg_now_ns();
      sg_log(SG_LOG_INFO, LOG,
             "etcd at %s granted lease %llx with a TTL of %lld s (asked %lld)",
             sg__etcd_endpoint(s->etcd), (unsigned long long)id, (long long)ttl,
             (long long)s->o.etcd_ttl_s);
      return 0;
    }
    if (rc == SG_EPEER || sg_deadline_passed(until))
      return sg_err_set(err, rc,
                        "etcd unreachable at start (--etcd %s, tried for "
                        "%d ms): %s",
                        s->o.etcd, ETCD_START_MS,
                        e.msg[0] ? e.msg : sg_strerror(rc));
    usleep(100000);
  }
}
