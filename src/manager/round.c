/*
 * round.c: the decisions of the quorum and commit rounds (see round.h);
 * the server (server.c, vote.c, local.c) keeps their state and answers the
 * calls.
 *
 *   quorum round  sg__mgr_round_ready, sg__mgr_round_plan (the step rule is
 *                 results.c's sg__mgr_group_step)
 *   commit round  sg__mgr_commit_tally, sg__mgr_commit_cutoff,
 *                 sg__mgr_commit_due, sg__mgr_commit_misses
 */
#include <string.h>

#include "manager/results.h"
#include "manager/round.h"
#include "stepguard/base.h"

int sg__mgr_round_ready(size_t n_arrived, size_t world_size, int in_flight,
                        int closed, int left) {
  return !in_flight && !closed && !left && n_arrived >= world_size;
}

int sg__mgr_round_plan(const sg__mgr_arrivals_t *a, sg__mgr_round_t *out) {
  if (out)
    memset(out, 0, sizeof(*out));
  if (!a || !out ||
      (a->n > 0 && (!a->step || !a->commit_failures || !a->handle)))
    return SG_EINVAL;
  out->step = sg__mgr_group_step(a->step, a->n, &out->steps_disagree);
  for (size_t g = 0; g < a->n; g++) {
    if (a->commit_failures[g] > out->commit_failures)
      out->commit_failures = a->commit_failures[g];
    out->send_handles |= a->handle[g] && a->handle[g][0];
  }
  return 0;
}

sg__mgr_vote_t sg__mgr_commit_tally(sg__mgr_tally_t t, sg__mgr_ballot_t b,
                                    int vote, size_t world_size) {
  sg__mgr_vote_t v;
  /* torchft: a no vote sticks for the round; the step is not checked */
  if (!vote && !b.vote_no) {
    b.vote_no = 1;
    t.n_no++;
  }
  if (!b.voted) {
    b.voted = 1;
    t.n_voted++;
  }
  v.tally = t;
  v.ballot = b;
  v.ends = t.n_voted == world_size;
  v.decision = t.n_no == 0;
  return v;
}

int64_t sg__mgr_commit_cutoff(int64_t deadline, int64_t now,
                              int64_t margin_ms) {
  if (deadline == INT64_MAX)
    return INT64_MAX;
  if (deadline <= now)
    return deadline;
  int64_t margin = (deadline - now) / 4;
  if (margin_ms >= 0 && margin_ms < INT64_MAX / 1000000 &&
      margin_ms * 1000000 < margin)
    margin = margin_ms * 1000000;
  return deadline - margin;
}

int sg__mgr_commit_due(sg__mgr_tally_t t, size_t world_size, int64_t cutoff,
                       int64_t now) {
  return t.n_voted > 0 && t.n_voted < world_size && cutoff != INT64_MAX &&
         now >= cutoff;
}

int sg__mgr_commit_misses(sg__mgr_ballot_t b, int moved_on) {
  return !b.voted && !moved_on;
}
