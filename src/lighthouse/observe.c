/*
 * observe.c: what the lighthouse shows of itself: its latency and
 * decision histograms, the snapshot behind the dashboard, /status and
 * /metrics (read on the HTTP thread, under the server's mutex), and the
 * dashboard's Kill.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "lighthouse/history.h"
#include "lighthouse/lease.h"
#include "lighthouse/quorum.h"
#include "lighthouse/server_int.h"
#include "lighthouse/status.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define KILL_TIMEOUT_MS 10000

static const double lat_le_s[] = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1,
                                  0.5,    1,     5,     10,   30,   60};
_Static_assert(sizeof(lat_le_s) / sizeof(lat_le_s[0]) == N_LAT, "N_LAT");

/* Decision time: from the event that completes a quorum (a request handed
 * over by the gRPC layer, a heartbeat, a cancel, a disconnect, a timer) to
 * its answer encoded; fine enough below 1 ms for a p99 there. */
static const double dec_le_s[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                                  0.0025,  0.005,  0.01,    0.025,  0.05,
                                  0.1,     0.25,   0.5,     1};
_Static_assert(sizeof(dec_le_s) / sizeof(dec_le_s[0]) == N_DEC, "N_DEC");

void sg__lh_observe_latency(sg_lh_server_t *s, int64_t start_ns) {
  double secs = (double)(sg_now_ns() - start_ns) / 1e9;
  for (size_t i = 0; i < N_LAT; i++)
    if (secs <= lat_le_s[i])
      s->lat_counts[i]++;
  s->lat_sum_s += secs;
  s->lat_count++;
}

/* sg__lh_observe_decision: one quorum took `ns` from its event to its
 * encoding. */
void sg__lh_observe_decision(sg_lh_server_t *s, int64_t ns) {
  double secs = (double)ns / 1e9;
  for (size_t i = 0; i < N_DEC; i++)
    if (secs <= dec_le_s[i])
      s->dec_counts[i]++;
  s->dec_sum_s += secs;
  s->dec_count++;
  s->dec_last_ns = ns;
}

int sg__lh_snapshot(void *ud, sg__lh_status_t *out) {
  sg_lh_server_t *s = ud;
  int rc = SG_ENOMEM;
  memset(out, 0, sizeof(*out));
  pthread_mutex_lock(&s->mu);
  int64_t now = sg_now_ns();
  sg__lh_decision_t d;
  char reason[512] = "";
  if (sg__lh_decide(s->st, now, &s->qopts, &d) == 0) {
    snprintf(reason, sizeof(reason), "%s", d.reason);
    sg__lh_decision_free(&d);
  }
  out->quorum_id = sg__lh_quorum_id(s->st);
  out->reason = sg_strdup(reason);
  out->max_step = -1;
  out->heartbeat_timeout_ms = s->o.heartbeat_timeout_ms;
  out->step_floor = sg__lh_step_floor(s->st);
  out->step_regressions =
      sg__lh_step_regressions(s->st, &out->regressed_from, &out->regressed_to);
  const sg__lh_quorum_t *q = sg__lh_prev_quorum(s->st);
  if (!out->reason)
    goto out;
  if (q) {
    out->has_prev = 1;
    out->prev_quorum_id = q->quorum_id;
    out->prev_age_ms = (sg_wall_ns() - q->created_wall_ns) / 1000000;
    out->members = sg_calloc(q->n ? q->n : 1, sizeof(*out->members));
    if (!out->members)
      goto out;
    for (size_t i = 0; i < q->n; i++) {
      const sg__lh_member_t *m = &q->members[i];
      sg__lh_status_member_t *o = &out->members[i];
      o->replica_id = sg_strdup(m->replica_id);
      o->address = sg_strdup(m->address);
      o->store_address = sg_strdup(m->store_address);
      out->n_members = i + 1;
      if (!o->replica_id || !o->address || !o->store_address)
        goto out;
      o->step = m->step;
      o->world_size = m->world_size;
      o->commit_failures = m->commit_failures;
      o->shrink_only = m->shrink_only;
      if (m->step > out->max_step)
        out->max_step = m->step;
    }
  }
  size_t nh = sg__lh_heartbeat_count(s->st);
  out->heartbeats = sg_calloc(nh ? nh : 1, sizeof(*out->heartbeats));
  if (!out->heartbeats)
    goto out;
  for (size_t i = 0; i < nh; i++) {
    const char *id;
    int64_t last;
    if (sg__lh_heartbeat_at(s->st, i, &id, &last) != 0)
      break;
    sg__lh_status_hb_t *h = &out->heartbeats[out->n_heartbeats];
    h->replica_id = sg_strdup(id);
    if (!h->replica_id)
      goto out;
    out->n_heartbeats++;
    h->age_ms = (now - last) / 1000000;
    h->expired = now - last >= ms_to_ns(s->o.heartbeat_timeout_ms);
    out->healthy_replicas += !h->expired;
    struct live *l = sg_map_get(&s->live, id);
    h->connected = l && l->nconns > 0;
    h->participating = sg__lh_is_participant(s->st, id);
  }
  out->lat_bucket_counts = sg_calloc(N_LAT, sizeof(uint64_t));
  if (!out->lat_bucket_counts)
    goto out;
  memcpy(out->lat_bucket_counts, s->lat_counts, sizeof(s->lat_counts));
  out->n_lat_buckets = N_LAT;
  out->lat_bucket_le_s = lat_le_s;
  out->lat_sum_s = s->lat_sum_s;
  out->lat_count = s->lat_count;
  out->decision.counts = sg_calloc(N_DEC, sizeof(uint64_t));
  if (!out->decision.counts)
    goto out;
  memcpy(out->decision.counts, s->dec_counts, sizeof(s->dec_counts));
  out->decision.n_buckets = N_DEC;
  out->decision.le_s = dec_le_s;
  out->decision.sum_s = s->dec_sum_s;
  out->decision.count = s->dec_count;
  out->decision_last_ns = s->dec_last_ns;
  out->n_pending = s->n_pending;
  out->pruned_total = sg__lh_pruned_total(s->st);
  out->quorums_issued = s->quorums_issued;
  out->heartbeats_total = s->heartbeats_total;
  out->disconnects_total = s->disconnects_total;
  out->quorum_requests_total = s->quorum_requests_total;
  out->rejected_total = s->rejected_total;
  out->participants = sg__lh_participant_count(s->st);
  out->connections = s->conns.len;
  out->role = sg__lh_role_name(s->fence.role);
  if (s->o.etcd && s->fence.role == SG__LH_ROLE_LEADER && !s->fence.ready)
    out->role = "candidate";
  out->term = s->term;
  out->lease_ttl_s = s->o.etcd ? s->lease_ttl_s : 0;
  out->lease_left_ms = s->fence.role == SG__LH_ROLE_LEADER
                           ? (s->fence.lease_deadline - now) / 1000000
                           : -1;
  out->elections_won = s->elections_won;
  out->etcd_errors = s->etcd_errors;
  out->fenced_total = s->fenced_total;
  out->proxied_total = s->proxied_total;
  out->now_ns = now;
  out->history = sg_malloc(sizeof(*out->history));
  if (!out->history)
    goto out;
  sg__lh_history_expire(s->hist, now);
  memcpy(out->history, s->hist, sizeof(*s->hist)); /* flat: a full copy */
  if (s->o.etcd && s->leader_addr && !(out->leader = sg_strdup(s->leader_addr)))
    goto out;
  rc = 0;
out:
  pthread_mutex_unlock(&s->mu);
  if (rc) {
    sg__lh_status_free(out);
    memset(out, 0, sizeof(*out));
  }
  return rc;
}

/* kill: send torchft.ManagerService/Kill to a member of the last quorum.
 * Runs on the HTTP thread and blocks it for at most KILL_TIMEOUT_MS. */
int sg__lh_kill_replica(void *ud, const char *replica_id, char *err,
                        size_t errlen) {
  sg_lh_server_t *s = ud;
  char *addr = NULL;
  sg_rpc_channel_t *ch = NULL;
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  int status = -1;
  sg_err_t e;
  sg_err_clear(&e);
  pthread_mutex_lock(&s->mu);
  const sg__lh_quorum_t *q = sg__lh_prev_quorum(s->st);
  for (size_t i = 0; q && i < q->n && !addr; i++)
    if (strcmp(q->members[i].replica_id, replica_id) == 0)
      addr = sg_strdup(q->members[i].address);
  pthread_mutex_unlock(&s->mu);
  int rc = 0;
  if (!addr) {
    snprintf(err, errlen, "failed to find replica %s", replica_id);
    return SG_ENOTFOUND;
  }
  sg_rpc_channel_opts_t co = {0};
  co.target = addr;
  co.connect_timeout_ms = KILL_TIMEOUT_MS;
  /* the job's one token: a manager started with it refuses a Kill without */
  co.auth_token = s->o.auth_token;
  rc = sg_rpc_channel_new(&co, &ch, &e);
  if (rc)
    goto out;
  Torchft__KillRequest kr = TORCHFT__KILL_REQUEST__INIT;
  kr.msg = "killed from dashboard";
  uint8_t buf[64];
  size_t n = torchft__kill_request__pack(&kr, buf);
  rc = sg_rpc_channel_call(ch, "/torchft.ManagerService/Kill", buf, n,
                           sg_deadline_in_ms(KILL_TIMEOUT_MS), &resp, &resp_len,
                           &status, &e);
  /* A killed manager may die before it answers: a reset after the request
   * went out still means the kill was delivered. */
  if (rc == SG_ECONNRESET)
    rc = 0;
out:
  if (rc)
    snprintf(err, errlen, "%s", e.msg[0] ? e.msg : sg_strerror(rc));
  if (!rc) {
    sg_log(SG_LOG_INFO, LOG, "killed replica %s at %s from the dashboard",
           replica_id, addr);
    pthread_mutex_lock(&s->mu);
    sg__lh_history_down(s->hist, sg_now_ns(), replica_id,
                        "killed from the dashboard");
    pthread_mutex_unlock(&s->mu);
  }
  sg_free(resp);
  if (ch)
    sg_rpc_channel_free(ch);
  sg_free(addr);
  return rc;
}
