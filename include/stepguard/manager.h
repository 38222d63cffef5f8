/*
 * stepguard/manager.h: the manager of one replica group, wire-compatible
 * with torchft's ManagerService (gRPC over HTTP/2).
 *
 *   server   sg_mgr_server_start() runs in the group-rank-0 process on a
 *            thread of its own: it gathers the Quorum calls of every group
 *            rank into one lighthouse Quorum call, answers each rank with its
 *            own recovery assignment, ANDs ShouldCommit votes, serves
 *            CheckpointMetadata and Kill, and heartbeats to the lighthouse
 *   client   sg_mgr_client_*(): the calls each group rank makes to it
 *
 * Where this differs from torchft's ManagerService:
 *   - a failed lighthouse call (after quorum_retries) fails every waiting
 *     group rank at once instead of leaving them to their deadlines;
 *   - an unreachable lighthouse (refused, reset, a connect that does not
 *     complete) is an outage, not a failed attempt: retried with backoff
 *     until the round's deadline, then answered UNAVAILABLE "lighthouse
 *     unreachable" (the Python Manager asks again);
 *   - the lighthouse request carries the last quorum this manager was
 *     answered (extension fields 100 and 101), for a restarted lighthouse;
 *   - the group's step is the minimum of its ranks' steps (torchft takes
 *     the last-arriving rank's unchecked); commit_failures is the maximum;
 *   - a Quorum call that was cancelled before its round started no longer
 *     counts as arrived;
 *   - group liveness: when every connection a group rank spoke on closes
 *     and it stays silent for the grace period, the replica group leaves the
 *     job (see sg_mgr_server_start);
 *   - the commit vote has a deadline: a round that not every group rank
 *     has voted in ends at the earliest cutoff of its waiting calls (a
 *     call's cutoff is SG_MGR_VOTE_MARGIN_MS, at most a quarter of its
 *     timeout, before its deadline) with "no" for every waiting rank, and
 *     the next vote of a rank that missed it is answered "no" at once
 *     (torchft leaves the early ranks to time out and lets the late vote
 *     end the round, so a group's ranks could decide differently);
 *   - Kill calls a handler instead of exiting the process;
 *   - ManagerQuorumResponse carries an extension field,
 *     up_to_date_manager_addresses = 100, that torchft peers skip;
 *   - the heartbeat request carries the last quorum this manager was
 *     answered (extension field 100), and a heartbeat answer that names
 *     members of a quorum lost (fields 100 and 101) wakes
 *     sg_mgr_server_wait_lost and the WaitLost calls;
 *   - WaitLost, a method torchft's clients never call: the other group
 *     ranks' long poll for such a report (sg_mgr_client_wait_lost).
 */
#ifndef STEPGUARD_MANAGER_H
#define STEPGUARD_MANAGER_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bounds on what the server accepts. */
#define SG_MGR_MAX_WORLD_SIZE 65536    /* group ranks per replica group */
#define SG_MGR_MAX_ID_LEN 1024         /* replica id, addresses */
#define SG_MGR_MAX_METADATA_LEN 65536  /* checkpoint_metadata per rank */
#define SG_MGR_DISCONNECT_GRACE_MS 250 /* default group liveness grace */
/* A commit vote round a rank is late to ends this long (at most a quarter
 * of the call's timeout) before the deadline of its earliest waiting call,
 * so that the answer reaches that caller before it gives up. */
#define SG_MGR_VOTE_MARGIN_MS 1000

/*
 * Called on the server's thread when a Kill request arrives, after the OK
 * response was handed to the connection (about 20 ms later, so it usually
 * reaches the caller).  `msg` is borrowed for the call.  The library never
 * exits; the embedding program decides (the Python binding exits).
 */
typedef void (*sg_mgr_kill_cb)(void *ud, const char *msg);

typedef struct sg_mgr_server_opts_s {
  const char *replica_id;      /* required, non-empty */
  const char *lighthouse_addr; /* required: "http://host:port" */
  const char *hostname;        /* advertised host; NULL: gethostname().
                                  $STEPGUARD_ADVERTISE_HOST, a host or a network
                                  interface name, overrides it */
  const char *bind;            /* NULL: "[::]:0" */
  const char *store_addr;      /* the group's TCPStore "host:port"; NULL: "" */
  int64_t world_size;          /* group ranks, 1..SG_MGR_MAX_WORLD_SIZE */
  int64_t heartbeat_interval_ms; /* <= 0: 100 */
  int64_t connect_timeout_ms;    /* <= 0: 10000.  Bounds the connect at start
                                    and each lighthouse call made while the
                                    lighthouse is unreachable */
  int64_t quorum_retries;        /* torchft's quorum_retries; < 0: 0 */
  int64_t disconnect_grace_ms;   /* group liveness grace; 0: 250; < 0: off */
  const char *auth_token; /* NULL or "": none.  Sent to the lighthouse, and
                             required ("authorization: Bearer <token>") on
                             every call to this server when set */
  sg_mgr_kill_cb kill;    /* may be NULL: Kill is logged and answered only */
  void *kill_ud;
} sg_mgr_server_opts_t;

typedef struct sg_mgr_server_s sg_mgr_server_t;

/*
 * sg_mgr_server_start: connect to the lighthouse (retrying with backoff for
 * up to connect_timeout_ms), bind, and serve on a thread of its own, with a
 * heartbeat thread and a lighthouse-quorum thread beside it.  Strings in `o`
 * are copied.  Blocks up to the connect timeout.  Any thread.  On success
 * *out owns the server until sg_mgr_server_stop().
 *
 * Group liveness: the server tracks which connections each group rank's
 * Quorum and ShouldCommit calls came on.  When the last of them closes and
 * the rank does not call again within disconnect_grace_ms, the replica group
 * has lost a rank and *leaves*: heartbeats stop, the lighthouse connection is
 * closed for good (so the lighthouse drops the group at once), every waiting
 * Quorum and ShouldCommit call fails with UNAVAILABLE, and so does every
 * later one.  A group that left never rejoins: the whole group must restart
 * (as torchrun does when a rank dies) and start a new server.  Group ranks
 * must therefore keep their client open for the life of training.
 *
 * Returns 0; SG_EINVAL (bad option, detail in err); SG_ENOMEM; the
 * lighthouse connect error (SG_ECONNREFUSED, SG_ETIMEDOUT, SG_ENOTFOUND,
 * SG_EPROTO, ...); or the bind error (SG_EADDRINUSE, ...).  On error no
 * callback is ever called.
 */
SG_EXPORT int sg_mgr_server_start(const sg_mgr_server_opts_t *o,
                                  sg_mgr_server_t **out, sg_err_t *err);

/* sg_mgr_server_address: "http://{host}:{port}", owned by the server.  Any
 * thread. */
SG_EXPORT const char *sg_mgr_server_address(const sg_mgr_server_t *s);

/* sg_mgr_server_port: the bound TCP port (useful with port 0). */
SG_EXPORT int sg_mgr_server_port(const sg_mgr_server_t *s);

/* sg_mgr_server_has_left: nonzero once the group left (see above).  Any
 * thread. */
SG_EXPORT int sg_mgr_server_has_left(const sg_mgr_server_t *s);

/*
 * sg_mgr_server_wait_lost: wait until `until` (absolute monotonic ns) for
 * the lighthouse to report a member of a quorum newer than `after_qid` as
 * lost (unhealthy: its heartbeats stopped or its connections closed) in a
 * heartbeat answer (a stepguard extension; a torchft lighthouse never
 * does).  *qid is the newest such quorum id (0: none).  Blocks; any
 * thread; sg_mgr_server_stop wakes and waits for every caller before it
 * frees the server.  0, SG_ETIMEDOUT, SG_ECANCELED (stopping), SG_EINVAL.
 */
SG_EXPORT int sg_mgr_server_wait_lost(sg_mgr_server_t *s, int64_t after_qid,
                                      sg_deadline_t until, int64_t *qid);

/*
 * sg_mgr_server_stop: fail every waiting call with UNAVAILABLE, stop
 * heartbeating, close the lighthouse connection, join the threads and free
 * `s` (NULL is a no-op).  Blocks briefly (the lighthouse calls in flight are
 * aborted).  Call once, from any thread except the server's own (not from
 * the kill callback).
 */
SG_EXPORT void sg_mgr_server_stop(sg_mgr_server_t *s);

/* ---- client ------------------------------------------------------------ */

/* A decoded ManagerQuorumResponse (torchft QuorumResult); every pointer is
 * owned and released by sg_mgr_quorum_result_free. */
typedef struct sg_mgr_quorum_result_s {
  int64_t quorum_id;
  char *recover_src_manager_address; /* "" when not healing */
  int has_recover_src_replica_rank;
  int64_t recover_src_replica_rank;
  int64_t *recover_dst_replica_ranks;
  size_t n_recover_dst_replica_ranks;
  char *store_address;
  int64_t max_step;
  int has_max_replica_rank;
  int64_t max_replica_rank;
  int64_t max_world_size;
  int64_t replica_rank;
  int64_t replica_world_size;
  int heal;
  int64_t commit_failures;
  char **replica_ids;
  size_t n_replica_ids;
  /* stepguard extension: the managers of every up-to-date replica, in
     replica-rank order; empty from a torchft server */
  char **up_to_date_manager_addresses;
  size_t n_up_to_date_manager_addresses;
  /* this group rank's reconfigure_handle of every participant, in
     replica_ids order; empty when no participant sent one */
  char **reconfigure_handles;
  size_t n_reconfigure_handles;
} sg_mgr_quorum_result_t;

/* sg_mgr_quorum_result_free: free what `r` owns and zero it (not `r`). */
SG_EXPORT void sg_mgr_quorum_result_free(sg_mgr_quorum_result_t *r);

typedef struct sg_mgr_client_s sg_mgr_client_t;

/*
 * sg_mgr_client_new: connect to the manager at `addr` ("http://host:port")
 * within connect_timeout_ms (<= 0: 10000), over one persistent connection
 * that later calls reuse and re-establish with backoff.  `auth_token` (may
 * be NULL) is copied.  Blocks up to the timeout; any thread.  The client is
 * thread-safe.  Returns 0, SG_EINVAL, SG_ENOMEM or the connect error, with
 * detail in err.
 */
SG_EXPORT int sg_mgr_client_new(const char *addr, int64_t connect_timeout_ms,
                                const char *auth_token, sg_mgr_client_t **out,
                                sg_err_t *err);

/*
 * sg_mgr_client_quorum: ManagerService/Quorum for `group_rank`, waiting
 * until `deadline` (sent as grpc-timeout).  `checkpoint_metadata` and
 * `reconfigure_handle` (an opaque process-group handle, torchft's native
 * reconfigure) may be NULL ("").  On success *out is filled (free with
 * sg_mgr_quorum_result_free); on error it is zeroed.  Blocks; thread-safe.
 * Returns 0; SG_ETIMEDOUT (deadline, or DEADLINE_EXCEEDED/CANCELLED);
 * SG_EABORTED; SG_EINVAL (INVALID_ARGUMENT); SG_ENOTFOUND (NOT_FOUND);
 * SG_ECONNREFUSED (UNAVAILABLE); SG_EAUTH; SG_EPEER (other statuses);
 * SG_EPROTO (a malformed response); SG_ECONNRESET; SG_ENOMEM; detail in
 * err ('status: NAME, message: "..."' for statuses).
 */
SG_EXPORT int
sg_mgr_client_quorum(sg_mgr_client_t *c, int64_t group_rank, int64_t step,
                     const char *checkpoint_metadata, int shrink_only,
                     int init_sync, int64_t commit_failures,
                     const char *reconfigure_handle, sg_deadline_t deadline,
                     sg_mgr_quorum_result_t *out, sg_err_t *err);

/*
 * sg_mgr_client_checkpoint_metadata: the metadata group rank `rank` sent
 * with its last Quorum call.  *out is an sg_malloc'd string (caller frees)
 * or NULL on error.  Errors as sg_mgr_client_quorum (SG_EINVAL for "rank
 * not found").
 */
SG_EXPORT int sg_mgr_client_checkpoint_metadata(sg_mgr_client_t *c,
                                                int64_t rank,
                                                sg_deadline_t deadline,
                                                char **out, sg_err_t *err);

/*
 * sg_mgr_client_should_commit: vote for this step; *out gets the group's
 * decision (1 only if every group rank voted yes).  Errors as
 * sg_mgr_client_quorum.
 */
SG_EXPORT int sg_mgr_client_should_commit(sg_mgr_client_t *c,
                                          int64_t group_rank, int64_t step,
                                          int should_commit,
                                          sg_deadline_t deadline, int *out,
                                          sg_err_t *err);

/* sg_mgr_client_kill: ManagerService/Kill with `msg` (may be NULL). */
SG_EXPORT int sg_mgr_client_kill(sg_mgr_client_t *c, const char *msg,
                                 sg_deadline_t deadline, sg_err_t *err);

/*
 * sg_mgr_client_wait_lost: stepguard's ManagerService/WaitLost, a long poll:
 * *qid gets the newest quorum, newer than `after_quorum_id`, of which the
 * lighthouse reported a member lost to the group's manager (so that group
 * ranks other than the manager's abort that quorum's collectives too).
 * Returns 0; SG_ETIMEDOUT when none was reported by `deadline`; SG_EPEER
 * with UNIMPLEMENTED in err from a manager without the method (torchft's);
 * otherwise errors as sg_mgr_client_quorum.  Use a client of its own: a
 * rank's liveness is judged on the connection of its other calls.
 */
SG_EXPORT int sg_mgr_client_wait_lost(sg_mgr_client_t *c,
                                      int64_t after_quorum_id,
                                      sg_deadline_t deadline, int64_t *qid,
                                      sg_err_t *err);

/* sg_mgr_client_abort: from any thread, fail every call in progress and
 * every later one with SG_EABORTED.  Idempotent. */
SG_EXPORT void sg_mgr_client_abort(sg_mgr_client_t *c);

/* sg_mgr_client_free: abort, close and free (NULL is a no-op).  No call on
 * `c` may be in progress (abort first, then wait for the callers). */
SG_EXPORT void sg_mgr_client_free(sg_mgr_client_t *c);

/* ---- started calls: one request object ------------------------------------
 */

/*
 * A Quorum or ShouldCommit call as a request object (nng's aio): started,
 * then waited for (possibly in slices, to run signal handlers in between),
 * then its result is taken, then it is freed.  It completes exactly once:
 * answered, failed, ended by its deadline (SG_ETIMEDOUT) or by
 * sg_mgr_call_abort (SG_EABORTED).  The same object whichever way the call
 * goes:
 *
 *   over the wire   sg_mgr_client_quorum_start / _should_commit_start on a
 *                   client: an asynchronous call on its channel (no thread
 *                   waits for it);
 *   in-process      the same functions on a client that
 * sg_mgr_client_use_server pointed at a server of this process (group rank 0
 *                   usually), or sg_mgr_local_*_start on the server itself:
 *                   the call is handed to the server's loop through a queue
 *                   instead of an HTTP/2 connection: no encoding of the
 *                   request, no socket, no client I/O thread, so a vote costs
 *                   one wakeup of the loop and one of the caller.
 *
 * The loop answers an in-process call with the same handlers and the same
 * rounds as a call from the wire (a group may mix both), and the answer a
 * caller gets is what sg_mgr_client_quorum and sg_mgr_client_should_commit
 * return for the same call: the same result, the same error codes and
 * messages.  Differences in-process: no authorization token is checked (the
 * caller holds the server), an in-process rank does not take part in group
 * liveness (it dies with the server), and a call failed by
 * sg_mgr_server_stop gets SG_ECONNREFUSED, as UNAVAILABLE from the wire.
 *
 * In a forked child a call started in the parent is left alone: waiting
 * returns at once, its result is SG_ESTATE, abort and free touch nothing
 * (its locks may have been held at fork(); its memory stays allocated).
 */
typedef struct sg_mgr_call_s sg_mgr_call_t;

/*
 * sg_mgr_client_use_server: send c's later Quorum and ShouldCommit calls
 * to server `s` of this process, in-process (NULL: over the wire again).
 * The caller keeps `s` running while c starts calls through it.
 */
SG_EXPORT void sg_mgr_client_use_server(sg_mgr_client_t *c, sg_mgr_server_t *s);

/*
 * sg_mgr_client_quorum_start: start sg_mgr_client_quorum's call (arguments
 * as there; strings are copied) and return at once; in-process if c uses a
 * server.  Never blocks beyond a mutex; any thread.  On success *out owns
 * the call (free it with sg_mgr_call_free).  Returns 0, SG_ENOMEM,
 * SG_EABORTED after sg_mgr_client_abort, or SG_ESTATE in a forked child;
 * on error *out is NULL.
 */
SG_EXPORT int sg_mgr_client_quorum_start(
    sg_mgr_client_t *c, int64_t group_rank, int64_t step,
    const char *checkpoint_metadata, int shrink_only, int init_sync,
    int64_t commit_failures, const char *reconfigure_handle,
    sg_deadline_t deadline, sg_mgr_call_t **out, sg_err_t *err);

/* sg_mgr_client_should_commit_start: start ShouldCommit; as above. */
SG_EXPORT int sg_mgr_client_should_commit_start(
    sg_mgr_client_t *c, int64_t group_rank, int64_t step, int should_commit,
    sg_deadline_t deadline, sg_mgr_call_t **out, sg_err_t *err);

/*
 * sg_mgr_local_quorum_start: start ManagerService/Quorum for `group_rank`
 * (arguments as sg_mgr_client_quorum; strings are copied).  Never blocks
 * beyond a mutex.  Any thread, but not concurrently with or after
 * sg_mgr_server_stop(s).  On success *out owns the call (free it with
 * sg_mgr_call_free).  Returns 0, SG_ENOMEM, or SG_ESTATE in a forked child
 * (the server's threads live in the parent); on error *out is NULL.
 */
SG_EXPORT int sg_mgr_local_quorum_start(
    sg_mgr_server_t *s, int64_t group_rank, int64_t step,
    const char *checkpoint_metadata, int shrink_only, int init_sync,
    int64_t commit_failures, const char *reconfigure_handle,
    sg_deadline_t deadline, sg_mgr_call_t **out, sg_err_t *err);

/* sg_mgr_local_should_commit_start: start ShouldCommit; as above. */
SG_EXPORT int sg_mgr_local_should_commit_start(
    sg_mgr_server_t *s, int64_t group_rank, int64_t step, int should_commit,
    sg_deadline_t deadline, sg_mgr_call_t **out, sg_err_t *err);

/*
 * sg_mgr_call_wait: wait until the call completes or `until` passes,
 * whichever is first; a call whose own deadline passes completes with
 * SG_ETIMEDOUT here.  Returns 0 once complete (also when it completed with
 * an error: see the *_result functions), SG_EAGAIN when `until` passed
 * first.  Blocks; one thread at a time per call.
 */
SG_EXPORT int sg_mgr_call_wait(sg_mgr_call_t *c, sg_deadline_t until);

/* sg_mgr_call_done: nonzero once complete.  Any thread; never blocks long. */
SG_EXPORT int sg_mgr_call_done(sg_mgr_call_t *c);

/* sg_mgr_call_abort: complete the call now with SG_EABORTED unless it is
 * complete already.  Any thread; never blocks beyond two mutexes. */
SG_EXPORT void sg_mgr_call_abort(sg_mgr_call_t *c);

/*
 * sg_mgr_call_quorum_result: the outcome of a completed Quorum call:
 * 0 with *out filled (free with sg_mgr_quorum_result_free), or the error of
 * sg_mgr_client_quorum with *out zeroed and detail in err.  SG_ESTATE if the
 * call is not complete or is not a Quorum call.  May be called once.
 */
SG_EXPORT int sg_mgr_call_quorum_result(sg_mgr_call_t *c,
                                        sg_mgr_quorum_result_t *out,
                                        sg_err_t *err);

/* sg_mgr_call_should_commit_result: the group's decision (*out) or the
 * error, as sg_mgr_client_should_commit; SG_ESTATE as above. */
SG_EXPORT int sg_mgr_call_should_commit_result(sg_mgr_call_t *c, int *out,
                                               sg_err_t *err);

/* sg_mgr_call_free: release the call (NULL is a no-op).  If it is not
 * complete it is aborted first.  No other function may be running on `c`.
 * May outlive the server. */
SG_EXPORT void sg_mgr_call_free(sg_mgr_call_t *c);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_MANAGER_H */
