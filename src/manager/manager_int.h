/*
 * manager_int.h: what the files of the ManagerServer (src/manager) share and
 * nothing else does: the server's state and the calls between its files.
 * The server is torchft's ManagerService of one replica group, with the
 * differences listed in include/stepguard/manager.h.
 *
 *   files     server.c             RPC handlers, waiters, liveness, the
 *                                  loop, start and stop
 *             vote.c               the commit vote: ShouldCommit, its
 *                                  round and the commit timer
 *             local.c              in-process calls (sg_mgr_local_*)
 *             lighthouse_worker.c  the quorum and heartbeat threads and the
 *                                  asynchronous first attempt of a round
 *             round.c (round.h)    the rounds' decisions, pure
 *             results.c (results.h) each rank's view of a quorum, pure
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
 *   commit    ShouldCommit votes are ANDed per round; a round a rank is
 *             late to ends at the earliest cutoff of its waiting calls
 *             with no (commit_timer; round.h); the round's state is
 *             the loop's but guarded by commit_mu, so that an in-process
 *             vote that ends a round nobody waits in is answered right on
 *             its caller's thread (vote.c)
 *   liveness  which group ranks spoke on which connection; a rank whose
 *             connections all closed and who stays silent past the grace
 *             makes the group leave for good (manager.h)
 *   local     in-process calls (sg_mgr_local_*, manager.h): a caller in this
 *             process queues its call and wakes the loop (local_async),
 *             which runs it through the same handlers as a call from the
 *             wire, answering with the same bytes; a caller that gives up
 *             queues a cancellation the same way
 */
#ifndef SG_MANAGER_INT_H
#define SG_MANAGER_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "manager/round.h"
#include "rpc/grpc.h"
#include "stepguard/base.h"
#include "stepguard/manager.h"
#include "stepguard/rpc.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

typedef struct sg__mgr_waiter_s sg__mgr_waiter_t;
typedef struct sg__mgr_rank_s sg__mgr_rank_t;
typedef struct sg__mgr_job_s sg__mgr_job_t;
typedef struct sg__mgr_qargs_s sg__mgr_qargs_t;

/* The two kinds of call that wait: for a quorum round, or for the group's
 * votes (ShouldCommit). */
typedef enum sg__mgr_kind_e {
  SG__MGR_QUORUM = 1,
  SG__MGR_COMMIT = 2,
  SG__MGR_LOST = 3 /* WaitLost from the wire (loop thread only) */
} sg__mgr_kind_t;

/* Where an answer goes: a call from the wire, or one from this process
 * (an in-process sg_mgr_call_t); exactly one of the two is set. */
typedef struct sg__mgr_reply_s {
  sg_rpc_call_t *call;
  sg_mgr_call_t *local;
} sg__mgr_reply_t;

/* A call waiting for a round (Quorum) or for the group's votes (commit). */
struct sg__mgr_waiter_s {
  sg__mgr_kind_t kind;
  sg__mgr_reply_t to;
  int64_t group_rank;
  int init_sync;
  int in_round;      /* Quorum: its round's lighthouse call is under way */
  int64_t after_qid; /* WaitLost: answer once a newer quorum lost a member */
  int64_t cutoff;    /* commit: when its round ends without every vote
                        (sg__mgr_commit_cutoff; INT64_MAX: never) */
  sg__mgr_waiter_t *prev, *next;
};

/*
 * A started call (manager.h).  References: the caller's; in-process, the
 * server's while the call is in the inbox or has a waiter, and one per
 * posted cancellation; over the wire, the channel callback's until it ran.
 * Whoever completes it first (the loop or the channel with an answer, the
 * caller with a deadline or an abort) sets `done`; the other finds it set.
 */
struct sg_mgr_call_s {
  /* the request: set at start, then read by the loop thread only */
  sg__mgr_kind_t kind;
  int64_t group_rank, step, commit_failures;
  int shrink_only, init_sync, vote;
  char *metadata, *handle; /* owned (Quorum) */
  sg_deadline_t deadline;
  sg_mgr_call_t *next;  /* in the server's inbox (s->mu) */
  sg_mgr_call_t *cnext; /* in the cancel list (s->mu) */
  unsigned forks;       /* sg_sock_fork_count() where it started */
  sg__mgr_waiter_t *w;  /* its waiter while it has one (its round's lock) */
  int had_waiter;       /* a waiter took the server's reference (set by the
                           thread that ran it, under its round's lock) */
  pthread_mutex_t mu;   /* guards everything below */
  pthread_cond_t cv;    /* signalled on completion (CLOCK_MONOTONIC) */
  sg_mgr_server_t *srv; /* NULL once done: nobody posts to it then */
  int refs;
  int done, taken;
  int rc;        /* 0 or the SG_E* code the caller gets */
  char msg[600]; /* detail of rc */
  uint8_t *resp; /* the encoded answer (rc == 0) */
  size_t resp_len;
};

/* Per group rank state; loop thread only. */
struct sg__mgr_rank_s {
  char *metadata;   /* last checkpoint_metadata; NULL: never sent */
  char *handle;     /* last reconfigure_handle; NULL: never sent */
  unsigned waiting; /* Quorum waiters not yet in a round */
  int64_t step;     /* from its latest such call */
  int64_t commit_failures;
  sg__mgr_ballot_t ballot; /* ShouldCommit in the current round */
  int vote_late;           /* it missed a round that ended on its cutoff
                              (sg__mgr_commit_misses), for step late_step
                              (commit_mu; cleared by its next vote, which
                              is answered no, or its next Quorum call) */
  int64_t late_step;
  unsigned nconns;        /* open connections it spoke on */
  int64_t grace_deadline; /* 0: none */
};

/* The lighthouse round handed to the quorum thread (or to the
 * asynchronous first attempt). */
struct sg__mgr_job_s {
  int64_t step, commit_failures, timeout_ms;
  int shrink_only;
  char **handles; /* owned: one reconfigure handle per group rank, or NULL */
  size_t n_handles;
  int first_rc;        /* nonzero: attempt 0 was made asynchronously and
                          failed with this code (the quorum thread retries) */
  int first_local;     /* ... on a local timeout (its deadline passed) */
  char first_msg[256]; /* ... and its message */
  sg_deadline_t first_deadline; /* the asynchronous attempt's deadline */
  int first_unreachable;        /* ... the lighthouse did not answer at all */
  int64_t last_qid;             /* the last quorum this manager was answered */
  int64_t last_max_step;        /* its highest member step (-1: none) */
  char **last_members;          /* owned: its members' replica ids, n_last */
  size_t n_last;
};

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
  uv_async_t lost_async; /* lost_qid grew: answer the WaitLost calls */
  uv_timer_t grace_timer, kill_timer;
  uv_timer_t commit_timer; /* the commit round's cutoff */
  sg_rpc_server_t *rpc;
  int port;
  int handles_open;

  /* the commit round: loop thread, and in-process votes, under commit_mu
     (ranks[].ballot, tally, commit_waiters) */
  pthread_mutex_t commit_mu;
  /* the quorum round: loop thread, in-process arrivals and the quorum
     thread's answers, under quorum_mu (ranks[].metadata, .handle, .waiting,
     .step, .commit_failures, n_arrived, last_*, quorum_waiters,
     round_in_flight, logged_qid, q_closed).  Order: quorum_mu, then
     commit_mu or mu or a call's mu. */
  pthread_mutex_t quorum_mu;
  int q_closed;     /* the server is stopping: no round starts, none waits */
  int64_t last_qid; /* the last quorum answered (0: none yet) */
  int64_t last_max_step; /* its highest member step */
  char **last_members;   /* owned: its members' replica ids */
  size_t n_last;

  /* loop thread only */
  int closing;
  sg__mgr_rank_t *ranks; /* world_size entries */
  size_t n_arrived;      /* ranks with waiting > 0 */
  sg__mgr_tally_t tally; /* the commit round's count */
  int64_t commit_step;   /* the step of the round's latest vote */
  int last_shrink_only;
  int64_t last_timeout_ms;
  sg__mgr_waiter_t *quorum_waiters, *commit_waiters;
  sg__mgr_waiter_t *lost_calls; /* WaitLost calls (no lock: loop only) */
  sg_map_t conns;               /* "%llu" conn id -> struct conn * */
  int round_in_flight;
  char *kill_msg;

  /* shared: guarded by mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;      /* stop or leave (CLOCK_MONOTONIC) */
  pthread_cond_t job_cv;  /* job posted, or stop: the quorum worker only, so
                             posting a job does not wake the heartbeat one */
  uint64_t lh_back;       /* heartbeats that got through after failing: an
                             outage wait ends early (the lighthouse, or a
                             new leader, answers again) */
  pthread_cond_t lost_cv; /* lost_qid grew, or stop (sg_mgr_server_wait_lost) */
  int64_t lost_qid;       /* the newest quorum the lighthouse reported a
                             member of as lost (0: none) */
  int lost_waiters;       /* callers inside sg_mgr_server_wait_lost */
  int stopping;
  int job_ready;
  sg__mgr_job_t job;
  sg__mgr_job_t ajob; /* the round whose first attempt runs asynchronously */
  int ajob_live;
  int result_ready, result_rc;
  char result_msg[256];
  Torchft__LighthouseQuorumResponse *result;
  sg_mgr_call_t *inbox, *inbox_tail; /* started in-process calls, in order */
  sg_mgr_call_t *cancels;            /* in-process calls that ended early */
  unsigned forks; /* sg_sock_fork_count() where the server started (its
                     sockets are registered, so a fork() counts) */

  atomic_int left; /* the group left the job (never cleared) */
  uint8_t *hb_req; /* encoded LighthouseHeartbeatRequest */
  size_t hb_req_len;
  sg_rpc_channel_t *lh;
  pthread_t hb_thread, q_thread;
  int hb_started, q_started, loop_started;
};

/* A Quorum request, from the wire or from this process. */
struct sg__mgr_qargs_s {
  int64_t group_rank, step, commit_failures;
  int shrink_only, init_sync;
  const char *metadata, *handle; /* borrowed */
  sg_deadline_t deadline;
  int has_conn; /* from the wire: conn_id counts for group liveness */
  uint64_t conn_id;
};

/* sg__mgr_ms_to_ns: milliseconds to nanoseconds, saturating. */
static inline int64_t sg__mgr_ms_to_ns(int64_t ms) {
  return ms > INT64_MAX / 1000000 ? INT64_MAX : ms * 1000000;
}

/* sg__mgr_wire: where the answer to a call from the wire goes. */
static inline sg__mgr_reply_t sg__mgr_wire(sg_rpc_call_t *call) {
  sg__mgr_reply_t to = {call, NULL};
  return to;
}

/* ---- server.c: answers, waiters, rounds --------------------------------- */

/* sg__mgr_respond: answer `to` with gRPC `status`, detail `msg` and the
 * encoded message `body` (`len` bytes, copied).  Any thread that may
 * answer `to`. */
void sg__mgr_respond(sg__mgr_reply_t to, int status, const char *msg,
                     const uint8_t *body, size_t len);

/* sg__mgr_respond_err: answer `to` with gRPC `status` and a printf-style
 * message (logged at debug).  Any thread that may answer `to`. */
void sg__mgr_respond_err(sg__mgr_reply_t to, int status, const char *fmt, ...)
    SG_PRINTF(3, 4);

/* sg__mgr_check_wire: 0 if the request `body` (`len` bytes) is well formed
 * protobuf whose string fields (`spec`) are UTF-8 without NUL; otherwise
 * the call is answered INVALID_ARGUMENT and -1 returned.  Loop thread. */
int sg__mgr_check_wire(sg_rpc_call_t *call, const uint8_t *body, size_t len,
                       const sg__pb_spec_t *spec);

/* sg__mgr_check_rank, sg__mgr_check_left: 0, or `to` is answered with the
 * refusal (group rank g out of range; the group left the job) and -1
 * returned. */
int sg__mgr_check_rank(sg_mgr_server_t *s, sg__mgr_reply_t to, int64_t g);
int sg__mgr_check_left(sg_mgr_server_t *s, sg__mgr_reply_t to);

/* sg__mgr_note_speaker: group rank `g` spoke on wire connection `conn_id`
 * (liveness).  Loop thread. */
void sg__mgr_note_speaker(sg_mgr_server_t *s, int64_t g, uint64_t conn_id);

/* sg__mgr_waiter_add: a waiter of `kind` for `to` (group rank g), pushed on
 * its round's list (that round's lock held); an in-process call's waiter
 * holds the server's reference to it from here on.  NULL when out of
 * memory, `to` then answered. */
sg__mgr_waiter_t *sg__mgr_waiter_add(sg_mgr_server_t *s, sg__mgr_reply_t to,
                                     sg__mgr_kind_t kind, int64_t g);

/* sg__mgr_waiter_unlink: take `w` off the list at *head.
 * sg__mgr_waiter_free: free a waiter that left its list (answered or not)
 * and drop the server's reference to its in-process call. */
void sg__mgr_waiter_unlink(sg__mgr_waiter_t **head, sg__mgr_waiter_t *w);
void sg__mgr_waiter_free(sg__mgr_waiter_t *w);

/* sg__mgr_all_local: every call in the list starting at `w` is an
 * in-process one (quorum_mu held). */
int sg__mgr_all_local(const sg__mgr_waiter_t *w);

/*
 * sg__mgr_round_done: a round's outcome (rc 0 with `resp`, or rc and
 * `msg`), from the thread that ended it: the quorum thread, or the
 * lighthouse channel's I/O thread when a round's first attempt succeeded.
 * The one road to the waiting calls: answered right there when only
 * in-process calls wait (the loop is not woken), else handed to the loop
 * (on_result), which answers the calls on the wire; while the server stops,
 * dropped (the stop answers them).  Consumes `resp`.  Called without mu and
 * quorum_mu.
 */
void sg__mgr_round_done(sg_mgr_server_t *s, int rc, const char *msg,
                        Torchft__LighthouseQuorumResponse *resp);

/* sg__mgr_timer_at: arm loop timer `t` to run `cb` at monotonic time `at`
 * (ns); INT64_MAX, or a closing server, stops it.  On the loop. */
void sg__mgr_timer_at(sg_mgr_server_t *s, uv_timer_t *t, uv_timer_cb cb,
                      int64_t at);

/* sg__mgr_quorum_idle: no Quorum call counts as arrived and no round is
 * under way (tests wait for this where a cancel must have been seen). */
int sg__mgr_quorum_idle(sg_mgr_server_t *s);

/* sg__mgr_round_mu: the lock the round of calls of `kind` is under. */
pthread_mutex_t *sg__mgr_round_mu(sg_mgr_server_t *s, sg__mgr_kind_t kind);

/* sg__mgr_waiter_drop: the caller of w's call gave up (its round's lock
 * held); w is freed.  A Quorum call not yet in a round no longer counts as
 * arrived; a vote stays counted (torchft).  Drops an in-process call's
 * server reference. */
void sg__mgr_waiter_drop(sg_mgr_server_t *s, sg__mgr_waiter_t *w);

/* sg__mgr_quorum_arrive_locked: group rank a->group_rank waits for this
 * step's quorum, or `to` is answered with the refusal (quorum_mu held; the
 * strings of `a` are borrowed for the call).  May start the round. */
void sg__mgr_quorum_arrive_locked(sg_mgr_server_t *s, sg__mgr_reply_t to,
                                  const sg__mgr_qargs_t *a);

/* sg__mgr_quorum_arrive: sg__mgr_quorum_arrive_locked from the loop (takes
 * quorum_mu), and the speaker noted for liveness.  Loop thread. */
void sg__mgr_quorum_arrive(sg_mgr_server_t *s, sg__mgr_reply_t to,
                           const sg__mgr_qargs_t *a);

/* ---- vote.c: the commit vote -------------------------------------------- */

/* sg__mgr_encode_decision: a ShouldCommitResponse into buf (16 bytes);
 * returns its length. */
size_t sg__mgr_encode_decision(int decision, uint8_t *buf);

/* sg__mgr_commit_round_end: the commit round decided `decision`: log it
 * and forget the round's votes (commit_mu held). */
void sg__mgr_commit_round_end(sg_mgr_server_t *s, int decision);

/* sg__mgr_commit_vote: group rank g votes `vote` for `step` (answered
 * through `to` when the round ends, at its cutoff from `deadline` at the
 * latest, or at once with a refusal or, late to a round that ended without
 * it, with no); has_conn and conn_id name the wire connection it spoke on.
 * Loop thread; takes commit_mu. */
void sg__mgr_commit_vote(sg_mgr_server_t *s, sg__mgr_reply_t to, int64_t g,
                         int64_t step, int vote, sg_deadline_t deadline,
                         int has_conn, uint64_t conn_id);

/* sg__mgr_handle_should_commit: a ShouldCommit call from the wire (its
 * request `body`, `len` bytes): sg__mgr_commit_vote, or answered
 * INVALID_ARGUMENT.  Loop thread. */
void sg__mgr_handle_should_commit(sg_mgr_server_t *s, sg_rpc_call_t *call,
                                  const uint8_t *body, size_t len);

/* ---- local.c: in-process calls ------------------------------------------ */

/* sg__mgr_call_unref: drop one reference to `c`; the last frees it.
 * sg__mgr_call_ref takes one more. */
void sg__mgr_call_unref(sg_mgr_call_t *c);
void sg__mgr_call_ref(sg_mgr_call_t *c);

/* sg__mgr_call_new: a call of `kind` with one reference (the caller's) and
 * no server; 0 or SG_ENOMEM. */
int sg__mgr_call_new(sg__mgr_kind_t kind, int64_t g, int64_t step,
                     sg_deadline_t deadline, sg_mgr_call_t **out,
                     sg_err_t *err);

/* sg__mgr_call_set_quorum_args: copy a Quorum call's arguments into `c`. */
int sg__mgr_call_set_quorum_args(sg_mgr_call_t *c, const char *metadata,
                                 int shrink_only, int init_sync,
                                 int64_t commit_failures, const char *handle,
                                 sg_err_t *err);

/* sg__mgr_call_finish: complete `c` with `rc` (detail `msg`) and, on 0, the
 * encoded answer `resp` (owned: kept, or freed if `c` was complete
 * already).  The wire client's completion. */
void sg__mgr_call_finish(sg_mgr_call_t *c, int rc, const char *msg,
                         uint8_t *resp, size_t len);

/*
 * sg__mgr_local_complete: the server's answer to an in-process call, turned
 * into what the wire client would return for the same answer (`body` is
 * copied).  Whoever answers calls of its kind; `c` stays alive (the caller
 * holds the server's reference to it).
 */
void sg__mgr_local_complete(sg_mgr_call_t *c, int status, const char *msg,
                            const uint8_t *body, size_t len);

/* sg__mgr_on_local: local_async's callback: run the calls started since
 * the last wakeup, in order, then forget those whose callers gave up.  Loop
 * thread. */
void sg__mgr_on_local(uv_async_t *a);

/* sg__mgr_local_drain: once the loop has ended, fail what is left of the
 * inbox and drop the cancellations (sg_mgr_server_stop). */
void sg__mgr_local_drain(sg_mgr_server_t *s);

/* ---- lighthouse_worker.c: the lighthouse side --------------------------- */

/* sg__mgr_job_clear: free the handles of `j` and empty them. */
void sg__mgr_job_clear(sg__mgr_job_t *j);
/* sg__mgr_dup_ids: a copy of n strings (sg_malloc'd), NULL when n == 0 or
 * out of memory; sg__mgr_free_ids frees such a copy. */
char **sg__mgr_dup_ids(char *const *ids, size_t n);
void sg__mgr_free_ids(char **ids, size_t n);

/*
 * sg__mgr_lh_start_async: send round `j`'s first attempt as an asynchronous
 * call while the lighthouse connection is up.  Returns 1 if it did (the
 * server owns the job from here; *j is emptied), 0 to leave the round to
 * the quorum thread (*j unchanged).  quorum_mu held.
 */
int sg__mgr_lh_start_async(sg_mgr_server_t *s, sg__mgr_job_t *j);

/* sg__mgr_quorum_main, sg__mgr_heartbeat_main: the bodies of the quorum
 * and heartbeat threads (pthread_create with the server as argument); each
 * returns NULL once the server stops (and the heartbeat one when the group
 * leaves). */
void *sg__mgr_quorum_main(void *arg);
void *sg__mgr_heartbeat_main(void *arg);

#endif /* SG_MANAGER_INT_H */
