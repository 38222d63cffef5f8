/*
 * vote.c: the commit vote of the ManagerServer (manager_int.h has the
 * threads and the locks).  ShouldCommit votes, from the wire or from this
 * process, are ANDed per round; the round ends with the group's last vote,
 * or with no at the earliest cutoff of its waiting votes (commit_timer).
 * What a vote does to the round, and when a round is due, are round.c's
 * pure decisions; this file keeps the round's state and answers the votes.
 * An in-process vote that ends a round nobody waits in is answered on its
 * caller's thread (local.c, commit_here).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <uv.h>

#include "manager/manager_int.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"

#define LOG "manager"

/* sg__mgr_encode_decision: a ShouldCommitResponse into buf (16 bytes); its
 * length. */
size_t sg__mgr_encode_decision(int decision, uint8_t *buf) {
  Torchft__ShouldCommitResponse m = TORCHFT__SHOULD_COMMIT_RESPONSE__INIT;
  m.should_commit = decision;
  return torchft__should_commit_response__pack(&m, buf);
}

/* sg__mgr_commit_round_end: the round decided `decision`: log it and forget the
 * round's votes (commit_mu held). */
void sg__mgr_commit_round_end(sg_mgr_server_t *s, int decision) {
  sg_log(SG_LOG_DEBUG, LOG, "[Replica %s] should_commit: %s", s->name,
         decision ? "yes" : "no");
  for (int64_t g = 0; g < s->world_size; g++)
    memset(&s->ranks[g].ballot, 0, sizeof(s->ranks[g].ballot));
  memset(&s->tally, 0, sizeof(s->tally));
}

/* finish_commit_round: answer every vote of the round that decided
 * `decision`; commit_mu held. */
static void finish_commit_round(sg_mgr_server_t *s, int decision) {
  uint8_t buf[16];
  size_t len = sg__mgr_encode_decision(decision, buf);
  while (s->commit_waiters) {
    sg__mgr_waiter_t *w = s->commit_waiters;
    sg__mgr_waiter_unlink(&s->commit_waiters, w);
    sg__mgr_respond(w->to, SG_GRPC_OK, NULL, buf, len);
    sg__mgr_waiter_free(w);
  }
  sg__mgr_commit_round_end(s, decision);
}

/* commit_cutoff: the earliest cutoff of the waiting votes (commit_mu
 * held); INT64_MAX: none. */
static int64_t commit_cutoff(const sg_mgr_server_t *s) {
  int64_t best = INT64_MAX;
  for (const sg__mgr_waiter_t *w = s->commit_waiters; w; w = w->next)
    if (w->cutoff < best)
      best = w->cutoff;
  return best;
}

static void on_commit_timer(uv_timer_t *t);

/* rearm_commit: the commit timer fires at the round's cutoff (loop thread;
 * takes commit_mu). */
static void rearm_commit(sg_mgr_server_t *s) {
  pthread_mutex_lock(&s->commit_mu);
  int64_t cutoff = commit_cutoff(s);
  pthread_mutex_unlock(&s->commit_mu);
  sg__mgr_timer_at(s, &s->commit_timer, on_commit_timer, cutoff);
}

/* on_commit_timer: a round some rank is late to ends on its cutoff with
 * no; the ranks that missed it are marked late (sg__mgr_commit_misses). */
static void on_commit_timer(uv_timer_t *t) {
  sg_mgr_server_t *s = t->data;
  pthread_mutex_lock(&s->quorum_mu); /* whose Quorum calls wait */
  pthread_mutex_lock(&s->commit_mu);
  if (sg__mgr_commit_due(s->tally, (size_t)s->world_size, commit_cutoff(s),
                         sg_now_ns())) {
    char missing[128] = "";
    size_t used = 0;
    for (int64_t g = 0; g < s->world_size; g++) {
      sg__mgr_rank_t *r = &s->ranks[g];
      if (r->ballot.voted)
        continue;
      if (sg__mgr_commit_misses(r->ballot,
                                r->waiting > 0 || s->round_in_flight)) {
        r->vote_late = 1;
        r->late_step = s->commit_step;
      }
      if (used < sizeof(missing) - 24) {
        int n = snprintf(missing + used, sizeof(missing) - used, "%s%lld",
                         used ? ", " : "", (long long)g);
        used += n > 0 ? (size_t)n : 0;
      }
    }
    sg_log(SG_LOG_WARN, LOG,
           "[Replica %s] should_commit for step %lld: group rank(s) %s did "
           "not vote before the deadline; the group does not commit",
           s->name, (long long)s->commit_step, missing);
    finish_commit_round(s, 0);
  }
  pthread_mutex_unlock(&s->commit_mu);
  pthread_mutex_unlock(&s->quorum_mu);
  rearm_commit(s);
}

/* sg__mgr_commit_vote: group rank g votes; the round ends with the last vote
 * or at its cutoff. */
void sg__mgr_commit_vote(sg_mgr_server_t *s, sg__mgr_reply_t to, int64_t g,
                         int64_t step, int vote, sg_deadline_t deadline,
                         int has_conn, uint64_t conn_id) {
  if (sg__mgr_check_rank(s, to, g) || sg__mgr_check_left(s, to))
    return;
  if (has_conn)
    sg__mgr_note_speaker(s, g, conn_id);
  pthread_mutex_lock(&s->commit_mu);
  sg__mgr_rank_t *r = &s->ranks[g];
  if (r->vote_late) {
    r->vote_late = 0;
    int64_t missed = r->late_step;
    pthread_mutex_unlock(&s->commit_mu);
    sg_log(SG_LOG_INFO, LOG,
           "[Replica %s] should_commit for step %lld: group rank %lld voted "
           "(step %lld) after the group decided no",
           s->name, (long long)missed, (long long)g, (long long)step);
    uint8_t buf[16];
    size_t len = sg__mgr_encode_decision(0, buf);
    sg__mgr_respond(to, SG_GRPC_OK, NULL, buf, len);
    return;
  }
  sg__mgr_waiter_t *w = sg__mgr_waiter_add(s, to, SG__MGR_COMMIT, g);
  if (!w) {
    pthread_mutex_unlock(&s->commit_mu);
    return;
  }
  w->cutoff =
      sg__mgr_commit_cutoff(deadline, sg_now_ns(), SG_MGR_VOTE_MARGIN_MS);
  s->commit_step = step;
  sg__mgr_vote_t v =
      sg__mgr_commit_tally(s->tally, r->ballot, vote, (size_t)s->world_size);
  s->tally = v.tally;
  r->ballot = v.ballot;
  if (v.ends)
    finish_commit_round(s, v.decision);
  pthread_mutex_unlock(&s->commit_mu);
  rearm_commit(s);
}

void sg__mgr_handle_should_commit(sg_mgr_server_t *s, sg_rpc_call_t *call,
                                  const uint8_t *body, size_t len) {
  if (sg__mgr_check_wire(call, body, len, &sg__pb_no_strings))
    return;
  Torchft__ShouldCommitRequest *req =
      torchft__should_commit_request__unpack(&sg__pb_allocator, len, body);
  if (!req) {
    sg__mgr_respond_err(sg__mgr_wire(call), SG_GRPC_INVALID_ARGUMENT,
                        "invalid ShouldCommitRequest");
    return;
  }
  sg__mgr_commit_vote(s, sg__mgr_wire(call), req->group_rank, req->step,
                      req->should_commit != 0, sg_rpc_call_deadline(call), 1,
                      sg_rpc_call_conn_id(call));
  torchft__should_commit_request__free_unpacked(req, &sg__pb_allocator);
}
