/*
 * server_int.h: the lighthouse server's state, shared by its files.
 *
 *   server.c   the loop: liveness, Quorum and Heartbeat calls, decisions,
 *              start and stop
 *   observe.c  histograms, the status snapshot and the dashboard's Kill
 *              (the HTTP/1.1 side's callbacks)
 *   idfile.c   the --quorum_id_file: quorum ids and the step floor
 *   proxy.c    a follower forwards calls to the leader (--etcd)
 *   leader.c   the etcd thread: lease, election, fenced quorum records
 *
 * Everything in sg_lh_server_t is guarded by `mu` unless its comment says
 * otherwise; every function below but sg__lh_leader_main and
 * sg__lh_leader_start runs on the loop thread with `mu` held.
 */
#ifndef SG_LIGHTHOUSE_SERVER_INT_H
#define SG_LIGHTHOUSE_SERVER_INT_H

#include <pthread.h>
#include <stdint.h>

#include <uv.h>

#include "lighthouse/etcd.h"
#include "lighthouse/history.h"
#include "lighthouse/http.h"
#include "lighthouse/lease.h"
#include "lighthouse/quorum.h"
#include "lighthouse/status.h"
#include "stepguard/base.h"
#include "stepguard/lighthouse.h"
#include "stepguard/rpc.h"
#include "stepguard/rpc_client.h"

#define LOG "lighthouse"

/* A Quorum call waiting for its quorum. */
struct pending {
  int is_proxy; /* 0: a call's user pointer is a pending or a proxied */
  sg_rpc_call_t *call;
  int64_t start_ns;
  struct pending *prev, *next;
  char replica_id[]; /* in the same allocation */
};

/* A call a follower forwarded to the leader (proxy_call). */
struct proxied {
  int is_proxy; /* 1 */
  struct sg_lh_server_s *s;
  sg_rpc_call_t *call;         /* NULL once cancelled (under mu) */
  struct proxied *prev, *next; /* s->proxied (under mu) */
  struct proxied *done_next;   /* s->proxy_done (under proxy_mu), or
                                  s->proxy_wait (under mu) */
  int rc, status;              /* the leader's answer */
  uint8_t *resp;               /* owned */
  size_t resp_len;
  char msg[512];
};

/* Liveness of one replica id: how many open connections it spoke on. */
struct live {
  unsigned nconns;
  int64_t grace_deadline; /* 0: none pending */
};

/* One open HTTP/2 connection and the replica ids heard on it. */
struct conn {
  sg_map_t ids; /* replica id -> (void *)1 */
  uint64_t id;  /* the connection's */
  char *last;   /* owned: the replica id last noted on it, or NULL */
};

/* Connections by id modulo: a replica's next request finds its connection
 * and itself known there without a formatted key and three lookups. */
#define CONN_CACHE 64
#define MAX_ID_LEN 1024 /* replica ids and addresses */

#define N_LAT 12 /* lat_le_s, observe.c */
#define N_DEC 14 /* dec_le_s, observe.c */

struct sg_lh_server_s {
  /* options (strings owned) */
  sg_lh_opts_t o;
  sg__lh_opts_t qopts;
  char *address;

  uv_loop_t loop;
  uv_thread_t thread;
  uv_async_t stop_async;
  uv_timer_t tick_timer; /* torchft's periodic tick */
  uv_timer_t wake_timer; /* earliest deadline */
  int64_t wake_due_ns;   /* when wake_timer fires, if active */
  sg_rpc_server_t *rpc;
  sg__lh_http_t *http;
  int port;
  int closing;
  int handles_open;

  pthread_mutex_t mu; /* guards everything below (MHD thread reads it) */
  sg__lh_state_t *st;
  struct pending *pending; /* list head */
  size_t n_pending;
  sg_map_t live;                       /* replica id -> struct live * */
  sg_map_t conns;                      /* "%llu" conn id -> struct conn * */
  struct conn *conn_cache[CONN_CACHE]; /* by id % CONN_CACHE, or NULL */
  size_t graces;                       /* live entries with a grace deadline */
  char reason[512];                    /* last logged reason */
  int64_t next_prune_ns;
  int64_t persisted_id;
  int64_t persisted_step; /* the step floor in the id file; -1: none */
  int64_t persisted_ns;   /* when the file was last written */
  /* the heartbeat answer to members of the last quorum (lost_answer) */
  uint8_t *lost_resp; /* owned, lost_resp_len bytes; NULL: none lost */
  size_t lost_resp_len;
  int64_t lost_for_qid, lost_at_ns;

  uint64_t quorums_issued, heartbeats_total, disconnects_total,
      quorum_requests_total, rejected_total;

  /* etcd leadership (o.etcd set); under mu unless said otherwise */
  sg__etcd_t *etcd; /* used by the etcd thread only (and by start) */
  pthread_t etcd_thread;
  int etcd_started;
  unsigned forks;         /* sg_sock_fork_count() where the server started */
  pthread_cond_t etcd_cv; /* wakes the etcd thread: a record, or stop */
  uv_async_t etcd_async;  /* wakes the loop: promoted, demoted, confirmed */
  int etcd_stop;
  sg__lh_fence_t fence; /* role, lease deadline, confirmed id */
  char *leader_addr;    /* owned: the leader's address as etcd holds it */
  int64_t term;         /* the leader key's create revision we hold/saw */
  int64_t lease_ttl_s;  /* the TTL etcd granted */
  int64_t lease_id;
  int64_t lease_sent_ns; /* when the grant of lease_id was sent (start) */
  int promote;           /* the etcd thread won: the loop installs */
  int64_t promote_qid;   /* the last quorum read from etcd */
  char **promote_ids;
  size_t promote_n;
  int demote;     /* the loop fails what waits and drops `held` */
  char *want_rec; /* owned: a record for the etcd thread to write */
  int64_t want_id;
  sg_rpc_blob_t *held; /* the answer of quorum held_id, waiting for its
                          record to be confirmed */
  int64_t held_id, held_event_ns;
  uint64_t elections_won, etcd_errors, fenced_total;
  /* followers forward calls to the leader: the channel is made and
   * replaced by the etcd thread (it may block), used by the loop */
  sg_rpc_channel_t *proxy_ch; /* under mu; NULL: answer UNAVAILABLE */
  char *proxy_addr;           /* owned: where proxy_ch goes (etcd thread) */
  int64_t proxy_retry_ns;     /* etcd thread: next try after a failed dial */
  struct proxied *proxied;    /* forwarded calls not answered yet (mu) */
  pthread_mutex_t proxy_mu;   /* guards proxy_done */
  struct proxied *proxy_done; /* answered by the leader, for the loop */
  uv_async_t proxy_async;
  struct proxied *proxy_wait; /* Quorum calls to forward again (mu) */
  int etcd_ok;                /* the etcd thread's last call succeeded */
  int64_t etcd_ok_ns;         /* when a call of the etcd thread last did */
  uv_timer_t proxy_timer;     /* forwards them every PROXY_RETRY_TICK_MS */
  uint64_t proxied_total;

  uint64_t lat_counts[N_LAT];
  double lat_sum_s;
  uint64_t lat_count;
  uint64_t dec_counts[N_DEC]; /* cumulative, like lat_counts */
  double dec_sum_s;
  uint64_t dec_count;
  int64_t dec_last_ns;      /* the last quorum's decision time; -1: none yet */
  int64_t status_logged_ns; /* when the last "Quorum status" line went out */
  int status_unlogged; /* the reason changed since, and is not logged yet */
  int holding;         /* the last decision held a quorum for the step floor */
  int64_t held_due_ns; /* then, when the next held call is answered */
  sg__lh_history_t *hist;    /* owned: the dashboard's recent past */
  int64_t quorum_logged_id;  /* the id on the last "Quorum!" line; -1: none */
  int64_t quorum_logged_ns;  /* when that line went out */
  uint64_t quorums_unlogged; /* quorums of that id since, logged at DEBUG */
};

static inline int64_t ms_to_ns(int64_t ms) {
  return ms > INT64_MAX / 1000000 ? INT64_MAX : ms * 1000000;
}

/* server.c */
void sg__lh_process(sg_lh_server_t *s, int64_t event_ns, int join);
void sg__lh_fail_pending(sg_lh_server_t *s, const char *msg);
void sg__lh_handle_quorum(sg_lh_server_t *s, sg_rpc_call_t *call,
                          const uint8_t *body, size_t len, int64_t event_ns);

/* proxy.c: forward `call` to the leader; 1: it will be answered from
 * sg__lh_proxy_answer (the proxy_async callback), 0: not forwarded. */
int sg__lh_proxy_call(sg_lh_server_t *s, sg_rpc_call_t *call,
                      const char *method, const uint8_t *body, size_t len);
void sg__lh_proxy_answer(uv_async_t *a);
/* On the etcd thread: keep proxy_ch going to `want` (mu held, released
 * while dialing). */
void sg__lh_proxy_sync(sg_lh_server_t *s, const char *want);

/* idfile.c: the --quorum_id_file (none: the wall-clock floor).  Load
 * returns the id floor and hands the step floor and the last quorum's
 * members to the quorum state; persist writes quorum `q` at a new id, and
 * at most once a second when only the step floor moved. */
int64_t sg__lh_idfile_load(sg_lh_server_t *s);
void sg__lh_idfile_persist(sg_lh_server_t *s, const sg__lh_quorum_t *q,
                           int64_t now);

/* observe.c: the histograms (mu held), and the HTTP side's callbacks
 * (sg__lh_http_opts_t: they take mu themselves) */
void sg__lh_observe_latency(sg_lh_server_t *s, int64_t start_ns);
void sg__lh_observe_decision(sg_lh_server_t *s, int64_t ns);
int sg__lh_snapshot(void *ud, sg__lh_status_t *out);
int sg__lh_kill_replica(void *ud, const char *replica_id, char *err,
                        size_t errlen);

/* leader.c */
int sg__lh_leader_start(sg_lh_server_t *s, sg_err_t *err); /* before serving */
void *sg__lh_leader_main(void *arg);                       /* the etcd thread */
void sg__lh_leader_async(uv_async_t *a); /* etcd_async: promoted, demoted */

#endif
