/*
 * test_round.c: the manager's round decisions (src/manager/round.c) against
 * torchft's manager rules (include/stepguard/manager.h): when a quorum
 * round starts, the step (the minimum) and commit_failures (the maximum)
 * the group sends, when reconfigure handles travel, and the commit round's
 * count (a no sticks, a rank counts once, the last vote decides), plus bad
 * arguments, that no decision allocates, and a seeded property test of the
 * commit round against a naive model.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "manager/round.h"
#include "stepguard/base.h"

/* ---- the quorum round ---------------------------------------------------- */

static void test_ready_when_every_rank_waits(void **state) {
  (void)state;
  assert_int_equal(sg__mgr_round_ready(3, 3, 0, 0, 0), 1);
  assert_int_equal(sg__mgr_round_ready(1, 1, 0, 0, 0), 1);
  assert_int_equal(sg__mgr_round_ready(2, 3, 0, 0, 0), 0);
  assert_int_equal(sg__mgr_round_ready(0, 1, 0, 0, 0), 0);
}

static void test_not_ready_in_flight_closed_or_left(void **state) {
  (void)state;
  assert_int_equal(sg__mgr_round_ready(3, 3, 1, 0, 0), 0);
  assert_int_equal(sg__mgr_round_ready(3, 3, 0, 1, 0), 0);
  assert_int_equal(sg__mgr_round_ready(3, 3, 0, 0, 1), 0);
}

/* plan: sg__mgr_round_plan over n ranks; asserts it succeeds. */
static sg__mgr_round_t plan(const int64_t *steps, const int64_t *failures,
                            const char *const *handles, size_t n) {
  sg__mgr_arrivals_t a = {steps, failures, handles, n};
  sg__mgr_round_t r;
  memset(&r, 0x5a, sizeof(r)); /* the call must overwrite all of it */
  assert_int_equal(sg__mgr_round_plan(&a, &r), 0);
  return r;
}

static void test_plan_equal_steps(void **state) {
  (void)state;
  const int64_t steps[] = {7, 7, 7};
  const int64_t failures[] = {0, 0, 0};
  const char *handles[] = {NULL, NULL, NULL};
  sg__mgr_round_t r = plan(steps, failures, handles, 3);
  assert_int_equal(r.step, 7);
  assert_int_equal(r.steps_disagree, 0);
  assert_int_equal(r.commit_failures, 0);
  assert_int_equal(r.send_handles, 0);
}

static void test_plan_disagreeing_steps_take_the_minimum(void **state) {
  (void)state;
  const int64_t steps[] = {9, 4, 6, 4};
  const int64_t failures[] = {0, 0, 0, 0};
  const char *handles[] = {"", "", "", ""};
  sg__mgr_round_t r = plan(steps, failures, handles, 4);
  assert_int_equal(r.step, 4);
  assert_int_equal(r.steps_disagree, 1);
  /* the last rank lowest, as torchft would take it unchecked */
  const int64_t last_low[] = {5, 5, 2};
  r = plan(last_low, failures, handles, 3);
  assert_int_equal(r.step, 2);
  assert_int_equal(r.steps_disagree, 1);
}

static void test_plan_commit_failures_maximum(void **state) {
  (void)state;
  const int64_t steps[] = {1, 1, 1};
  const int64_t failures[] = {2, 5, 3};
  const char *handles[] = {NULL, NULL, NULL};
  assert_int_equal(plan(steps, failures, handles, 3).commit_failures, 5);
  /* never below zero, whatever a rank sends */
  const int64_t negative[] = {-4, -1, -9};
  assert_int_equal(plan(steps, negative, handles, 3).commit_failures, 0);
  const int64_t big[] = {INT64_MAX, 0, 1};
  assert_int_equal(plan(steps, big, handles, 3).commit_failures, INT64_MAX);
}

static void test_plan_handles_travel_when_one_is_set(void **state) {
  (void)state;
  const int64_t steps[] = {1, 1, 1};
  const int64_t failures[] = {0, 0, 0};
  const char *none[] = {NULL, "", NULL};
  assert_int_equal(plan(steps, failures, none, 3).send_handles, 0);
  const char *last[] = {NULL, "", "pg:2"};
  assert_int_equal(plan(steps, failures, last, 3).send_handles, 1);
  const char *first[] = {"h", NULL, NULL};
  assert_int_equal(plan(steps, failures, first, 3).send_handles, 1);
}

static void test_plan_single_rank_and_empty_group(void **state) {
  (void)state;
  const int64_t steps[] = {-3};
  const int64_t failures[] = {1};
  const char *handles[] = {"x"};
  sg__mgr_round_t r = plan(steps, failures, handles, 1);
  assert_int_equal(r.step, -3);
  assert_int_equal(r.steps_disagree, 0);
  assert_int_equal(r.commit_failures, 1);
  assert_int_equal(r.send_handles, 1);
  r = plan(NULL, NULL, NULL, 0);
  assert_int_equal(r.step, 0);
  assert_int_equal(r.steps_disagree, 0);
  assert_int_equal(r.commit_failures, 0);
  assert_int_equal(r.send_handles, 0);
}

static void test_plan_bad_args(void **state) {
  (void)state;
  const int64_t steps[] = {1};
  const int64_t failures[] = {0};
  const char *handles[] = {NULL};
  sg__mgr_round_t r;
  sg__mgr_arrivals_t a = {steps, failures, handles, 1};
  assert_int_equal(sg__mgr_round_plan(NULL, &r), SG_EINVAL);
  assert_int_equal(sg__mgr_round_plan(&a, NULL), SG_EINVAL);
  sg__mgr_arrivals_t no_steps = {NULL, failures, handles, 1};
  sg__mgr_arrivals_t no_failures = {steps, NULL, handles, 1};
  sg__mgr_arrivals_t no_handles = {steps, failures, NULL, 1};
  const sg__mgr_arrivals_t *bad[] = {&no_steps, &no_failures, &no_handles};
  for (size_t i = 0; i < 3; i++) {
    memset(&r, 0x5a, sizeof(r));
    assert_int_equal(sg__mgr_round_plan(bad[i], &r), SG_EINVAL);
    assert_int_equal(r.step, 0); /* zeroed on error */
    assert_int_equal(r.commit_failures, 0);
    assert_int_equal(r.steps_disagree, 0);
    assert_int_equal(r.send_handles, 0);
  }
}

/* ---- the commit round ---------------------------------------------------- */

static const sg__mgr_tally_t no_votes = {0, 0};
static const sg__mgr_ballot_t no_ballot = {0, 0};

static void test_commit_single_rank(void **state) {
  (void)state;
  sg__mgr_vote_t v = sg__mgr_commit_tally(no_votes, no_ballot, 1, 1);
  assert_int_equal(v.ends, 1);
  assert_int_equal(v.decision, 1);
  v = sg__mgr_commit_tally(no_votes, no_ballot, 0, 1);
  assert_int_equal(v.ends, 1);
  assert_int_equal(v.decision, 0);
  assert_int_equal(v.ballot.voted, 1);
  assert_int_equal(v.ballot.vote_no, 1);
  assert_int_equal(v.tally.n_voted, 1);
  assert_int_equal(v.tally.n_no, 1);
}

static void test_commit_last_vote_decides(void **state) {
  (void)state;
  sg__mgr_ballot_t b[3] = {{0, 0}, {0, 0}, {0, 0}};
  sg__mgr_tally_t t = no_votes;
  const int votes[3] = {1, 0, 1};
  for (size_t g = 0; g < 3; g++) {
    sg__mgr_vote_t v = sg__mgr_commit_tally(t, b[g], votes[g], 3);
    assert_int_equal(v.ends, g == 2);
    t = v.tally;
    b[g] = v.ballot;
    if (v.ends)
      assert_int_equal(v.decision, 0); /* rank 1 said no */
  }
  assert_int_equal(t.n_voted, 3);
  assert_int_equal(t.n_no, 1);
}

static void test_commit_no_sticks_and_rank_counts_once(void **state) {
  (void)state;
  /* rank 0 of two votes no, then yes: still one voter, still a no */
  sg__mgr_vote_t v = sg__mgr_commit_tally(no_votes, no_ballot, 0, 2);
  v = sg__mgr_commit_tally(v.tally, v.ballot, 1, 2);
  assert_int_equal(v.ends, 0);
  assert_int_equal(v.tally.n_voted, 1);
  assert_int_equal(v.tally.n_no, 1);
  assert_int_equal(v.ballot.vote_no, 1);
  /* and a second no from it is not counted twice */
  v = sg__mgr_commit_tally(v.tally, v.ballot, 0, 2);
  assert_int_equal(v.tally.n_no, 1);
  v = sg__mgr_commit_tally(v.tally, no_ballot, 1, 2); /* rank 1: yes */
  assert_int_equal(v.ends, 1);
  assert_int_equal(v.decision, 0);
}

static void test_commit_inputs_are_values(void **state) {
  (void)state;
  /* asking what a vote would do changes nothing the caller holds */
  sg__mgr_tally_t t = {1, 0};
  sg__mgr_ballot_t b = no_ballot;
  sg__mgr_vote_t v = sg__mgr_commit_tally(t, b, 0, 2);
  assert_int_equal(v.ends, 1);
  assert_int_equal(v.decision, 0);
  assert_int_equal(t.n_voted, 1);
  assert_int_equal(t.n_no, 0);
  assert_int_equal(b.voted, 0);
  assert_int_equal(b.vote_no, 0);
}

/* ---- purity and a model -------------------------------------------------- */

static void test_decisions_never_allocate(void **state) {
  (void)state;
  sg_test_fail_alloc(1, 1); /* every allocation from here fails */
  const int64_t steps[] = {3, 2};
  const int64_t failures[] = {1, 0};
  const char *handles[] = {"a", NULL};
  sg__mgr_round_t r = plan(steps, failures, handles, 2);
  sg__mgr_vote_t v = sg__mgr_commit_tally(no_votes, no_ballot, 1, 1);
  assert_int_equal(sg_test_fail_alloc(0, 0), 0); /* none was attempted */
  assert_int_equal(r.step, 2);
  assert_int_equal(v.decision, 1);
}

/* A seeded run of random commit rounds: the round ends exactly when every
 * rank has voted at least once, and commits iff none ever voted no. */
static void test_property_commit_rounds(void **state) {
  (void)state;
  unsigned seed = 12345;
  for (int round = 0; round < 2000; round++) {
    size_t n = 1 + (size_t)(rand_r(&seed) % 8);
    sg__mgr_ballot_t b[8];
    int voted[8] = {0}, said_no = 0;
    size_t distinct = 0;
    memset(b, 0, sizeof(b));
    sg__mgr_tally_t t = no_votes;
    for (;;) {
      size_t g = (size_t)rand_r(&seed) % n;
      int vote = rand_r(&seed) % 5 != 0;
      if (!voted[g]) {
        voted[g] = 1;
        distinct++;
      }
      said_no |= !vote;
      sg__mgr_vote_t v = sg__mgr_commit_tally(t, b[g], vote, n);
      t = v.tally;
      b[g] = v.ballot;
      assert_int_equal(v.ends, distinct == n);
      if (v.ends) {
        assert_int_equal(v.decision, !said_no);
        break;
      }
    }
  }
}

/* A vote's cutoff: a margin before its deadline, at most a quarter of the
 * time it had; none without a deadline; a passed deadline is its own. */
static void test_commit_cutoff(void **state) {
  (void)state;
  const int64_t ms = 1000000, now = 5000 * ms;
  /* 4 s left, margin 1 s: 1 s before */
  assert_int_equal(sg__mgr_commit_cutoff(now + 4000 * ms, now, 1000),
                   now + 3000 * ms);
  /* 200 ms left: a quarter (50 ms) is less than the margin */
  assert_int_equal(sg__mgr_commit_cutoff(now + 200 * ms, now, 1000),
                   now + 150 * ms);
  /* 60 s left: the margin */
  assert_int_equal(sg__mgr_commit_cutoff(now + 60000 * ms, now, 1000),
                   now + 59000 * ms);
  assert_int_equal(sg__mgr_commit_cutoff(INT64_MAX, now, 1000), INT64_MAX);
  assert_int_equal(sg__mgr_commit_cutoff(now - 1, now, 1000), now - 1);
  assert_int_equal(sg__mgr_commit_cutoff(now, now, 1000), now);
  /* an absurd margin saturates to the quarter, never past the deadline */
  int64_t c = sg__mgr_commit_cutoff(now + 400 * ms, now, INT64_MAX);
  assert_int_equal(c, now + 300 * ms);
  assert_true(sg__mgr_commit_cutoff(INT64_MAX - 1, 0, 1000) < INT64_MAX - 1);
}

/* A round ends on its cutoff only when some but not all ranks voted and
 * the cutoff passed. */
static void test_commit_due(void **state) {
  (void)state;
  sg__mgr_tally_t none = {0, 0}, one = {1, 0}, one_no = {1, 1}, two = {2, 0};
  assert_false(sg__mgr_commit_due(one, 2, 100, 99));
  assert_true(sg__mgr_commit_due(one, 2, 100, 100));
  assert_true(sg__mgr_commit_due(one_no, 2, 100, 1000));
  assert_false(sg__mgr_commit_due(none, 2, 100, 1000)); /* nobody voted */
  assert_false(sg__mgr_commit_due(two, 2, 100, 1000));  /* all voted */
  assert_false(sg__mgr_commit_due(one, 1, 100, 1000));  /* all voted */
  assert_false(sg__mgr_commit_due(one, 2, INT64_MAX, INT64_MAX - 1));
}

/* A round that ended on its cutoff holds to it only the ranks that did
 * not vote and have not moved on to the next Quorum. */
static void test_commit_misses(void **state) {
  (void)state;
  sg__mgr_ballot_t none = {0, 0}, yes = {1, 0}, no = {1, 1};
  assert_true(sg__mgr_commit_misses(none, 0));
  assert_false(sg__mgr_commit_misses(none, 1)); /* waits for a quorum */
  assert_false(sg__mgr_commit_misses(yes, 0));
  assert_false(sg__mgr_commit_misses(no, 0));
  assert_false(sg__mgr_commit_misses(yes, 1));
}

/* Property: a round some rank missed never decides yes for anyone: it is
 * due at its cutoff (never before), the ranks that voted are not held to
 * it, and exactly the silent ranks that did not move on are. */
static void test_property_missed_round_is_no_for_all(void **state) {
  (void)state;
  srand(11);
  for (int it = 0; it < 2000; it++) {
    size_t n = 2 + (size_t)(rand() % 5);
    sg__mgr_tally_t t = {0, 0};
    sg__mgr_ballot_t b[8] = {{0}};
    int moved_on[8] = {0};
    size_t voters = 1 + (size_t)(rand() % (int)(n - 1)); /* not all */
    for (size_t g = 0; g < voters; g++) {
      sg__mgr_vote_t v = sg__mgr_commit_tally(t, b[g], rand() % 2, n);
      assert_false(v.ends);
      t = v.tally;
      b[g] = v.ballot;
    }
    for (size_t g = 0; g < n; g++)
      moved_on[g] = rand() % 2;
    int64_t cutoff = 1000 + rand() % 1000;
    assert_false(sg__mgr_commit_due(t, n, cutoff, cutoff - 1));
    assert_true(sg__mgr_commit_due(t, n, cutoff, cutoff + rand() % 1000));
    for (size_t g = 0; g < n; g++)
      assert_int_equal(sg__mgr_commit_misses(b[g], moved_on[g]),
                       g >= voters && !moved_on[g]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ready_when_every_rank_waits),
      cmocka_unit_test(test_not_ready_in_flight_closed_or_left),
      cmocka_unit_test(test_plan_equal_steps),
      cmocka_unit_test(test_plan_disagreeing_steps_take_the_minimum),
      cmocka_unit_test(test_plan_commit_failures_maximum),
      cmocka_unit_test(test_plan_handles_travel_when_one_is_set),
      cmocka_unit_test(test_plan_single_rank_and_empty_group),
      cmocka_unit_test(test_plan_bad_args),
      cmocka_unit_test(test_commit_single_rank),
      cmocka_unit_test(test_commit_last_vote_decides),
      cmocka_unit_test(test_commit_no_sticks_and_rank_counts_once),
      cmocka_unit_test(test_commit_inputs_are_values),
      cmocka_unit_test(test_decisions_never_allocate),
      cmocka_unit_test(test_property_commit_rounds),
      cmocka_unit_test(test_commit_cutoff),
      cmocka_unit_test(test_commit_due),
      cmocka_unit_test(test_commit_misses),
      cmocka_unit_test(test_property_missed_round_is_no_for_all),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
