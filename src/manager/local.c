/*
 * local.c: the started call (sg_mgr_call_*, manager.h), and in-process
 * calls.  A caller in the server's own process skips the wire: its call is
 * queued for the loop
 * (local_async), which runs it through the same handlers as a call from the
 * wire and answers with the same bytes; a Quorum call that only other
 * in-process calls wait with, or a vote that ends a round nobody waits in,
 * is taken on the caller's thread instead.
 *
 *   references   sg__mgr_call_unref, local_set_done,
 *                sg__mgr_local_complete
 *   the loop     local_take, local_run, local_cancel, sg__mgr_on_local,
 *                sg__mgr_local_drain
 *   starting     local_new, local_post, arrive_here, commit_here and the
 *                two sg_mgr_local_*_start
 *   finishing    local_end, wait, done, abort, the results, free
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "manager/manager_int.h"
#include "manager/wire.h"
#include "rpc/grpc.h"

/* ---- references and answers --------------------------------------------- */

static void call_free(sg_mgr_call_t *c) {
  sg_free(c->metadata);
  sg_free(c->handle);
  sg_free(c->resp);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  sg_free(c);
}

void sg__mgr_call_unref(sg_mgr_call_t *c) {
  pthread_mutex_lock(&c->mu);
  int last = --c->refs == 0;
  pthread_mutex_unlock(&c->mu);
  if (last)
    call_free(c);
}

void sg__mgr_call_ref(sg_mgr_call_t *c) {
  pthread_mutex_lock(&c->mu);
  c->refs++;
  pthread_mutex_unlock(&c->mu);
}

/* local_set_done: complete `c` with mu held (no-op if it is complete);
 * the caller then wakes its waiters (c->cv).  Returns 1 if it completed. */
static int local_set_done(sg_mgr_call_t *c, int rc, const char *msg) {
  if (c->done)
    return 0;
  c->done = 1;
  c->srv = NULL;
  c->rc = rc;
  snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
  return 1;
}

/*
 * sg__mgr_local_complete: the server's answer to an in-process call, turned
 * into what the wire client would return for the same answer (a copy of the
 * message, or the error code and 'status: NAME, message: "..."'; and, as
 * for a wire call, SG_ETIMEDOUT when the answer comes after the call's
 * deadline: a round that failed on the lighthouse deadline the call gave
 * it is a timeout for the caller).  Whoever answers calls of its kind.
 */
void sg__mgr_local_complete(sg_mgr_call_t *c, int status, const char *msg,
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

/* ---- the loop ----------------------------------------------------------- */

/* local_take: detach the inbox and the cancel list (s->mu held). */
static void local_take(sg_mgr_server_t *s, sg_mgr_call_t **inbox,
                       sg_mgr_call_t **cancels) {
  *inbox = s->inbox;
  *cancels = s->cancels;
  s->inbox = s->inbox_tail = s->cancels = NULL;
}

/* local_qargs: the arguments of the in-process Quorum call `c`. */
static sg__mgr_qargs_t local_qargs(const sg_mgr_call_t *c) {
  sg__mgr_qargs_t a = {0};
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
static void local_run(sg_mgr_server_t *s, sg_mgr_call_t *c) {
  pthread_mutex_lock(&c->mu);
  int ended = c->done;
  c->refs++; /* ours: an answer below may drop every other one */
  pthread_mutex_unlock(&c->mu);
  sg__mgr_reply_t to = {NULL, c};
  if (ended) {
    /* its caller gave up before we saw it: it never arrived */
  } else if (s->closing) {
    sg__mgr_respond_err(to, SG_GRPC_UNAVAILABLE, "manager shutting down");
  } else if (c->kind == SG__MGR_QUORUM) {
    sg__mgr_qargs_t a = local_qargs(c);
    sg__mgr_quorum_arrive(s, to, &a);
  } else {
    sg__mgr_commit_vote(s, to, c->group_rank, c->step, c->vote, c->deadline, 0,
                        0);
  }
  if (!c->had_waiter) /* answered without waiting, or not run */
    sg__mgr_call_unref(c);
  sg__mgr_call_unref(c);
}

/* local_cancel: forget the in-process call `c` whose caller gave up, if it
 * still waits (its waiter is read under the lock its round is under). */
static void local_cancel(sg_mgr_server_t *s, sg_mgr_call_t *c) {
  pthread_mutex_t *mu = sg__mgr_round_mu(s, c->kind);
  pthread_mutex_lock(mu);
  if (c->w)
    sg__mgr_waiter_drop(s, c->w);
  pthread_mutex_unlock(mu);
}

/* sg__mgr_on_local: run the calls started since the last wakeup, in order, then
 * forget the ones whose callers gave up.  Loop thread. */
void sg__mgr_on_local(uv_async_t *a) {
  sg_mgr_server_t *s = a->data;
  sg_mgr_call_t *inbox, *cancels;
  pthread_mutex_lock(&s->mu);
  local_take(s, &inbox, &cancels);
  pthread_mutex_unlock(&s->mu);
  while (inbox) {
    sg_mgr_call_t *c = inbox;
    inbox = c->next;
    c->next = NULL;
    local_run(s, c);
  }
  while (cancels) {
    sg_mgr_call_t *c = cancels;
    cancels = c->cnext;
    c->cnext = NULL;
    local_cancel(s, c);
    sg__mgr_call_unref(c); /* the cancellation's */
  }
}

/* sg__mgr_local_drain: once the loop has ended, fail what is left (stop). */
void sg__mgr_local_drain(sg_mgr_server_t *s) {
  sg_mgr_call_t *inbox, *cancels;
  pthread_mutex_lock(&s->mu);
  local_take(s, &inbox, &cancels);
  pthread_mutex_unlock(&s->mu);
  while (inbox) {
    sg_mgr_call_t *c = inbox;
    inbox = c->next;
    sg__mgr_local_complete(c, SG_GRPC_UNAVAILABLE, "manager shutting down",
                           NULL, 0);
    sg__mgr_call_unref(c);
  }
  while (cancels) {
    sg_mgr_call_t *c = cancels;
    cancels = c->cnext;
    sg__mgr_call_unref(c);
  }
}

/* ---- starting ----------------------------------------------------------- */

int sg__mgr_call_new(sg__mgr_kind_t kind, int64_t g, int64_t step,
                     sg_deadline_t deadline, sg_mgr_call_t **out,
                     sg_err_t *err) {
  *out = NULL;
  sg_mgr_call_t *c = sg_calloc(1, sizeof(*c));
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
  c->forks = sg_sock_fork_count();
  *out = c;
  return 0;
}

static int local_new(sg_mgr_server_t *s, sg__mgr_kind_t kind, int64_t g,
                     int64_t step, sg_deadline_t deadline, sg_mgr_call_t **out,
                     sg_err_t *err) {
  *out = NULL;
  if (sg_sock_fork_count() != s->forks)
    return sg_err_set(err, SG_ESTATE,
                      "the manager server runs in the parent process");
  return sg__mgr_call_new(kind, g, step, deadline, out, err);
}

int sg__mgr_call_set_quorum_args(sg_mgr_call_t *c, const char *metadata,
                                 int shrink_only, int init_sync,
                                 int64_t commit_failures, const char *handle,
                                 sg_err_t *err) {
  c->metadata = sg_strdup(metadata ? metadata : "");
  c->handle = sg_strdup(handle ? handle : "");
  if (!c->metadata || !c->handle)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  c->shrink_only = shrink_only != 0;
  c->init_sync = init_sync != 0;
  c->commit_failures = commit_failures;
  return 0;
}

void sg__mgr_call_finish(sg_mgr_call_t *c, int rc, const char *msg,
                         uint8_t *resp, size_t len) {
  pthread_mutex_lock(&c->mu);
  int woke = local_set_done(c, rc, msg);
  if (woke && rc == 0) {
    c->resp = resp;
    c->resp_len = len;
    resp = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  if (woke)
    pthread_cond_broadcast(&c->cv);
  sg_free(resp);
}

/* local_post: hand `c` to the loop (or fail it if the server stops). */
static void local_post(sg_mgr_server_t *s, sg_mgr_call_t *c) {
  c->srv = s;
  c->refs = 2; /* the caller's and the server's */
  pthread_mutex_lock(&s->mu);
  if (s->stopping) {
    pthread_mutex_unlock(&s->mu);
    sg__mgr_local_complete(c, SG_GRPC_UNAVAILABLE, "manager shutting down",
                           NULL, 0);
    sg__mgr_call_unref(c);
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
static int arrive_here(sg_mgr_server_t *s, sg_mgr_call_t *c) {
  pthread_mutex_lock(&s->quorum_mu);
  if (s->q_closed || !sg__mgr_all_local(s->quorum_waiters)) {
    pthread_mutex_unlock(&s->quorum_mu);
    return 0;
  }
  c->srv = s;
  c->refs = 2; /* the caller's and the server's: nobody else has c yet */
  sg__mgr_qargs_t a = local_qargs(c);
  sg__mgr_reply_t to = {NULL, c};
  sg__mgr_quorum_arrive_locked(s, to, &a);
  int had_waiter = c->had_waiter;
  pthread_mutex_unlock(&s->quorum_mu);
  if (!had_waiter) /* refused at once */
    sg__mgr_call_unref(c);
  return 1;
}

int sg_mgr_local_quorum_start(sg_mgr_server_t *s, int64_t group_rank,
                              int64_t step, const char *checkpoint_metadata,
                              int shrink_only, int init_sync,
                              int64_t commit_failures,
                              const char *reconfigure_handle,
                              sg_deadline_t deadline, sg_mgr_call_t **out,
                              sg_err_t *err) {
  sg_mgr_call_t *c = NULL;
  int rc = local_new(s, SG__MGR_QUORUM, group_rank, step, deadline, &c, err);
  if (rc)
    return rc;
  rc = sg__mgr_call_set_quorum_args(c, checkpoint_metadata, shrink_only,
                                    init_sync, commit_failures,
                                    reconfigure_handle, err);
  if (rc) {
    sg__mgr_call_unref(c);
    return rc;
  }
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
static int commit_here(sg_mgr_server_t *s, sg_mgr_call_t *c) {
  int64_t g = c->group_rank;
  if (g < 0 || g >= s->world_size || atomic_load(&s->left))
    return 0;
  pthread_mutex_lock(&s->mu);
  int stopping = s->stopping;
  pthread_mutex_unlock(&s->mu);
  if (stopping)
    return 0;
  pthread_mutex_lock(&s->commit_mu);
  /* what the vote would do, as in sg__mgr_commit_vote (round.c decides) */
  sg__mgr_vote_t v = sg__mgr_commit_tally(s->tally, s->ranks[g].ballot, c->vote,
                                          (size_t)s->world_size);
  if (s->commit_waiters || !v.ends || s->ranks[g].vote_late) {
    pthread_mutex_unlock(&s->commit_mu);
    return 0;
  }
  sg__mgr_commit_round_end(s, v.decision);
  pthread_mutex_unlock(&s->commit_mu);
  uint8_t buf[16];
  size_t len = sg__mgr_encode_decision(v.decision, buf);
  sg__mgr_local_complete(c, SG_GRPC_OK, NULL, buf, len);
  return 1;
}

int sg_mgr_local_should_commit_start(sg_mgr_server_t *s, int64_t group_rank,
                                     int64_t step, int should_commit,
                                     sg_deadline_t deadline,
                                     sg_mgr_call_t **out, sg_err_t *err) {
  sg_mgr_call_t *c = NULL;
  int rc = local_new(s, SG__MGR_COMMIT, group_rank, step, deadline, &c, err);
  if (rc)
    return rc;
  c->vote = should_commit != 0;
  if (!commit_here(s, c))
    local_post(s, c);
  *out = c;
  return 0;
}

/* ---- finishing ---------------------------------------------------------- */

/* local_end: the caller ends `c` early with `rc`; the loop is told to
 * forget it.  Takes c->mu, then s->mu (the loop never holds s->mu while it
 * takes c->mu, and it clears c->srv under c->mu before s goes away). */
static void local_end(sg_mgr_call_t *c, int rc, const char *msg) {
  if (sg_sock_fork_count() != c->forks)
    return; /* a forked child: its lock may have been held at fork() */
  pthread_mutex_lock(&c->mu);
  sg_mgr_server_t *s = c->srv;
  if (!c->done) {
    /* under c->mu: another thread may be waiting in sg_mgr_call_wait and
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

int sg_mgr_call_wait(sg_mgr_call_t *c, sg_deadline_t until) {
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

int sg_mgr_call_done(sg_mgr_call_t *c) {
  if (sg_sock_fork_count() != c->forks)
    return 1;
  pthread_mutex_lock(&c->mu);
  int done = c->done;
  pthread_mutex_unlock(&c->mu);
  return done;
}

void sg_mgr_call_abort(sg_mgr_call_t *c) {
  if (c)
    local_end(c, SG_EABORTED, "call aborted");
}

/* local_result: the raw outcome of a complete call of `kind`, once. */
static int local_result(sg_mgr_call_t *c, sg__mgr_kind_t kind, uint8_t **resp,
                        size_t *len, sg_err_t *err) {
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

int sg_mgr_call_quorum_result(sg_mgr_call_t *c, sg_mgr_quorum_result_t *out,
                              sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t len = 0;
  memset(out, 0, sizeof(*out));
  int rc = local_result(c, SG__MGR_QUORUM, &resp, &len, err);
  if (!rc)
    rc = sg__mgr_decode_quorum(resp, len, out, err);
  sg_free(resp);
  return rc;
}

int sg_mgr_call_should_commit_result(sg_mgr_call_t *c, int *out,
                                     sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t len = 0;
  *out = 0;
  int rc = local_result(c, SG__MGR_COMMIT, &resp, &len, err);
  if (!rc)
    rc = sg__mgr_decode_should_commit(resp, len, out, err);
  sg_free(resp);
  return rc;
}

void sg_mgr_call_free(sg_mgr_call_t *c) {
  if (!c || sg_sock_fork_count() != c->forks)
    return; /* in a forked child the memory is left alone, as its locks */
  local_end(c, SG_EABORTED, "call aborted");
  sg__mgr_call_unref(c);
}
