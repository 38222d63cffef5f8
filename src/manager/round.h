/*
 * round.h: the decisions of the manager's two rounds, as pure functions,
 * following torchft's ManagerService (differences in
 * include/stepguard/manager.h).
 *
 *   quorum round  sg__mgr_round_ready: whether a round starts now
 *                 sg__mgr_round_plan: what the group asks the lighthouse
 *   commit round  sg__mgr_commit_tally: one ShouldCommit vote counted, and
 *                 whether it ends the round with which decision;
 *                 sg__mgr_commit_cutoff, sg__mgr_commit_due: when the
 *                 server ends a round a rank is late to (no);
 *                 sg__mgr_commit_misses: which ranks a round so ended
 *                 holds to it (their next vote is answered no)
 *
 * The server keeps the state (manager_int.h) and does the I/O around these;
 * what each rank learns from an issued quorum is results.h.  Nothing here
 * does I/O, takes a lock, reads a clock, allocates or touches global state,
 * so any thread may call these functions concurrently.  No call blocks.
 */
#ifndef SG_MANAGER_ROUND_H
#define SG_MANAGER_ROUND_H

#include <stddef.h>
#include <stdint.h>

/* ---- the quorum round ---------------------------------------------------- */

/*
 * sg__mgr_round_ready: whether a quorum round starts: every one of the
 * `world_size` group ranks has a Quorum call waiting (`n_arrived` of them
 * do), no round is `in_flight`, the server is not `closed` (stopping) and
 * the group has not `left` the job.  Returns 1 or 0.
 */
int sg__mgr_round_ready(size_t n_arrived, size_t world_size, int in_flight,
                        int closed, int left);

/* What the group ranks brought to a round: n entries each, indexed by group
 * rank (borrowed; strings may be NULL). */
typedef struct sg__mgr_arrivals_s {
  const int64_t *step;            /* each rank's step */
  const int64_t *commit_failures; /* each rank's commit_failures */
  const char *const *handle;      /* reconfigure_handle; NULL or "": none */
  size_t n;
} sg__mgr_arrivals_t;

/* The group's part of a LighthouseQuorumRequest for one round. */
typedef struct sg__mgr_round_s {
  int64_t step;            /* sg__mgr_group_step: the minimum */
  int steps_disagree;      /* the ranks' steps are not all equal */
  int64_t commit_failures; /* the maximum over the ranks */
  int send_handles;        /* some rank sent a non-empty handle: every rank's
                              handle travels ("" for none); else none does,
                              so the request stays what an older torchft
                              sends */
} sg__mgr_round_t;

/*
 * sg__mgr_round_plan: the request of a round whose ranks brought `a`.
 * shrink_only and the timeout are the last-arriving rank's (torchft), which
 * the caller tracks.  `out` is overwritten.  Returns 0, or SG_EINVAL for
 * NULL `a` or `out`, or NULL arrays with a->n > 0 (out is then zeroed).
 */
int sg__mgr_round_plan(const sg__mgr_arrivals_t *a, sg__mgr_round_t *out);

/* ---- the commit round ---------------------------------------------------- */

/* One group rank's ballot in the current commit round. */
typedef struct sg__mgr_ballot_s {
  int voted;   /* it voted in this round */
  int vote_no; /* it voted no in this round (a no sticks) */
} sg__mgr_ballot_t;

/* The commit round's count over the group. */
typedef struct sg__mgr_tally_s {
  size_t n_voted; /* ranks that voted */
  size_t n_no;    /* ranks that voted no */
} sg__mgr_tally_t;

/* A vote counted (sg__mgr_commit_tally). */
typedef struct sg__mgr_vote_s {
  sg__mgr_tally_t tally;   /* the round's count after the vote */
  sg__mgr_ballot_t ballot; /* the voter's ballot after the vote */
  int ends;                /* every group rank has voted: the round ends */
  int decision; /* when it ends: 1 (commit) if no rank voted no, else 0 */
} sg__mgr_vote_t;

/*
 * sg__mgr_commit_tally: a rank whose ballot is `b` votes `vote` (nonzero:
 * yes) in a round counted `t`, in a group of `world_size` ranks.  As in
 * torchft, a rank may vote again: a no sticks for the round, and a rank is
 * counted once; the step is not checked.  The round ends when all
 * world_size ranks have voted; the caller then starts the next one with a
 * zero tally and zero ballots.  Returns the new state; `t` and `b` are
 * values, so a caller can ask what a vote would do without applying it.
 */
sg__mgr_vote_t sg__mgr_commit_tally(sg__mgr_tally_t t, sg__mgr_ballot_t b,
                                    int vote, size_t world_size);

/*
 * The commit round's deadline (a difference from torchft, whose round has
 * none: a rank late to the vote leaves its group mates' calls to time out
 * while its own vote, when it comes, still ends the round, so the group's
 * ranks may part).  The server ends a round that not every rank has voted
 * in at its cutoff, with "no" for everyone: the earliest cutoff among the
 * round's waiting calls.  A call's cutoff comes a margin before its own
 * deadline, so that the answer reaches its caller in time:
 * min(margin_ms, a quarter of the time the call had when it arrived).
 */

/*
 * sg__mgr_commit_cutoff: the cutoff of a vote that arrived at `now` with
 * deadline `deadline` (both sg_now_ns() instants; INT64_MAX: none, and then
 * no cutoff: INT64_MAX).  A deadline already passed is its own cutoff.
 */
int64_t sg__mgr_commit_cutoff(int64_t deadline, int64_t now, int64_t margin_ms);

/*
 * sg__mgr_commit_due: whether a round counted `t` in a group of
 * `world_size` ends now (`now`) on its cutoff (the earliest cutoff of its
 * waiting calls; INT64_MAX: none waits): some rank has voted, not all have,
 * and the cutoff passed.  The decision is then no.
 */
int sg__mgr_commit_due(sg__mgr_tally_t t, size_t world_size, int64_t cutoff,
                       int64_t now);

/*
 * sg__mgr_commit_misses: whether a rank whose ballot is `b` missed a round
 * that ended on its cutoff: it did not vote, and it has not `moved_on` (no
 * Quorum call of it waits: a rank waiting for the next quorum voted in an
 * earlier round and owes this one nothing).  Its next vote, whatever step
 * it names (a rank whose heal failed votes with step -1), belongs to the
 * missed round: it is answered no at once and not counted; its next Quorum
 * call, should it come first, forgets that.
 */
int sg__mgr_commit_misses(sg__mgr_ballot_t b, int moved_on);

#endif /* SG_MANAGER_ROUND_H */
