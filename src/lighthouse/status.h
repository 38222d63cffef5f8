/*
 * status.h: a point-in-time copy of the lighthouse's state for the HTTP side
 * (dashboard, /status JSON, /metrics).
 *
 * The lighthouse fills an sg__lh_status_t under its own lock, in its
 * snapshot callback; the HTTP module only reads it and then releases it with
 * sg__lh_status_free().  Every string and array in it is owned by the
 * snapshot except lat_bucket_le_s and decision.le_s, which are borrowed
 * (normally static tables of bucket bounds), and `role`, which is static.
 */
#ifndef STEPGUARD_LH_STATUS_H
#define STEPGUARD_LH_STATUS_H

#include <stddef.h>
#include <stdint.h>

#include "lighthouse/history.h"

/* A Prometheus histogram.  le_s is borrowed and strictly increasing (finite
 * bounds; +Inf is implied); counts is owned and cumulative: counts[i]
 * observations were <= le_s[i].  count is the +Inf bucket. */
typedef struct sg__lh_hist_s {
  size_t n_buckets;
  const double *le_s;
  uint64_t *counts;
  double sum_s;
  uint64_t count;
} sg__lh_hist_t;

/* One participant of the previous quorum. */
typedef struct sg__lh_status_member_s {
  char *replica_id;        /* owned, never NULL once filled ("" allowed) */
  char *address;           /* owned: ManagerServer address */
  char *store_address;     /* owned: "MASTER_ADDR:MASTER_PORT" */
  int64_t step;            /* step the member reported */
  uint64_t world_size;     /* group world size */
  int64_t commit_failures; /* commit failures it reported */
  int shrink_only;         /* nonzero: it asked for a shrink-only quorum */
} sg__lh_status_member_t;

/* One replica the lighthouse has heard a heartbeat from. */
typedef struct sg__lh_status_hb_s {
  char *replica_id;  /* owned */
  int64_t age_ms;    /* time since its last heartbeat */
  int expired;       /* age_ms >= heartbeat timeout */
  int connected;     /* it has an open lighthouse connection */
  int participating; /* it has a pending quorum request */
} sg__lh_status_hb_t;

typedef struct sg__lh_status_s {
  int64_t quorum_id; /* current quorum id */
  char *reason;      /* owned: reason of a decision computed now */
  int has_prev;      /* nonzero when a previous quorum exists */
  int64_t prev_quorum_id;
  int64_t prev_age_ms;     /* time since the previous quorum was created */
  int64_t max_step;        /* max step in the previous quorum, -1 if none */
  int64_t step_floor;      /* the step the job reached (quorum.h), -1: none */
  size_t step_regressions; /* quorums issued below it since start */
  int64_t regressed_from, regressed_to; /* the last of those */
  size_t n_members;
  sg__lh_status_member_t *members; /* owned: previous quorum's participants */
  size_t n_heartbeats;
  sg__lh_status_hb_t *heartbeats; /* owned */
  size_t n_pending;               /* quorum requests waiting now */
  int64_t heartbeat_timeout_ms;
  size_t pruned_total; /* heartbeat entries pruned since start */

  /* metrics: counters since start and gauges now */
  uint64_t quorums_issued, heartbeats_total, disconnects_total,
      quorum_requests_total, rejected_total;
  size_t participants, healthy_replicas, connections;

  /* Quorum request latency histogram, in seconds.  lat_bucket_le_s is
   * borrowed and strictly increasing (finite bounds; +Inf is implied);
   * lat_bucket_counts is owned and cumulative: counts[i] requests took
   * <= le[i] seconds.  lat_count is the +Inf bucket. */
  size_t n_lat_buckets;
  const double *lat_bucket_le_s;
  uint64_t *lat_bucket_counts;
  double lat_sum_s;
  uint64_t lat_count;

  /* Decision time per quorum: from the event that completed it (normally
   * the last request, complete and parsed) to its answer encoded. */
  sg__lh_hist_t decision;
  int64_t decision_last_ns; /* the last quorum's; -1 when none yet */

  /* replicated lighthouses (--etcd) */
  const char *role;      /* static: "single", "follower", "leader" */
  char *leader;          /* owned: the leader's address; NULL: none known */
  int64_t term;          /* the leader key's create revision; 0: none */
  int64_t lease_ttl_s;   /* granted TTL; 0 without etcd */
  int64_t lease_left_ms; /* leader: to its local lease deadline; else -1 */
  uint64_t elections_won, etcd_errors;
  uint64_t fenced_total;  /* decisions skipped: not a leader inside its lease */
  uint64_t proxied_total; /* calls a follower forwarded to the leader */

  /* the recent past (dashboard timeline, step rates, failures, heals) */
  sg__lh_history_t *history; /* owned copy; NULL: none */
  int64_t now_ns;            /* monotonic time of the snapshot */
} sg__lh_status_t;

/*
 * sg__lh_status_free: release every string and array owned by `s` (which
 * may be NULL) and reset it to all zeros, so that freeing twice is harmless.
 * Does not free `s` itself; the bucket bounds are borrowed and left alone.
 * Any thread; not concurrently with a reader of the same snapshot.
 */
void sg__lh_status_free(sg__lh_status_t *s);

#endif /* STEPGUARD_LH_STATUS_H */
