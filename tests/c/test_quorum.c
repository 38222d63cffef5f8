/*
 * test_quorum.c: the lighthouse's pure quorum decision (src/lighthouse/
 * quorum.c) against torchft's rules (docs/lighthouse.md, "Rules"):
 * health at the heartbeat boundary, min_replicas, split brain, the join
 * timeout, fast quorum, shrink_only, the quorum id bump rules, leave,
 * mark_dead, retained participants, deadlines, pruning, limits, allocation
 * failure torture and a 1,000-replica decision.
 *
 * Every test frees its state; the ASan build checks for leaks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "lighthouse/quorum.h"
#include "stepguard/base.h"

#define MS(x) ((int64_t)(x)*1000000)
#define T0 ((int64_t)1000000000000) /* an arbitrary monotonic origin */

static const sg__lh_opts_t DEFAULT_OPTS = {
    .min_replicas = 1, .join_timeout_ms = 100, .heartbeat_timeout_ms = 5000};

/* ---- helpers --------------------------------------------------------------
 */

static sg__lh_state_t *new_state(size_t max) {
  sg__lh_state_t *st = NULL;
  assert_int_equal(sg__lh_state_new(max, &st), 0);
  assert_non_null(st);
  return st;
}

/* A member whose strings are borrowed from literals (join copies them). */
static sg__lh_member_t member(const char *id, int64_t step, int shrink,
                              int64_t commit_failures) {
  sg__lh_member_t m;
  memset(&m, 0, sizeof(m));
  m.replica_id = (char *)id;
  m.address = (char *)"http://host:1234";
  m.store_address = (char *)"host:29500";
  m.data = (char *)"{\"k\": 1}";
  m.step = step;
  m.world_size = 8;
  m.commit_failures = commit_failures;
  m.shrink_only = shrink;
  return m;
}

static void join(sg__lh_state_t *st, const char *id, int64_t now) {
  sg__lh_member_t m = member(id, 0, 0, 0);
  assert_int_equal(sg__lh_join(st, &m, now), 0);
}

static void join_ex(sg__lh_state_t *st, const char *id, int64_t now,
                    int64_t step, int shrink, int64_t cf) {
  sg__lh_member_t m = member(id, step, shrink, cf);
  assert_int_equal(sg__lh_join(st, &m, now), 0);
}

static void hb(sg__lh_state_t *st, const char *id, int64_t now) {
  assert_int_equal(sg__lh_heartbeat(st, id, now), 0);
}

/* expect_reason: decide at `now` and compare the reason (and `met`). */
static void expect_reason(const sg__lh_state_t *st, int64_t now,
                          const sg__lh_opts_t *o, int met, const char *want) {
  sg__lh_decision_t d;
  assert_int_equal(sg__lh_decide(st, now, o, &d), 0);
  assert_string_equal(d.reason, want);
  assert_int_equal(d.met, met);
  if (!met) {
    assert_int_equal(d.n, 0);
    assert_null(d.members);
  }
  sg__lh_decision_free(&d);
}

/* expect_ids: decide at `now`; a quorum is met with exactly `ids` (a
 * comma-separated, sorted list, "" for none). */
static void expect_ids(const sg__lh_state_t *st, int64_t now,
                       const sg__lh_opts_t *o, const char *ids) {
  sg__lh_decision_t d;
  char got[1024] = "";
  assert_int_equal(sg__lh_decide(st, now, o, &d), 0);
  assert_true(d.met);
  for (size_t i = 0; i < d.n; i++) {
    if (i)
      strcat(got, ",");
    strcat(got, d.members[i]->replica_id);
  }
  assert_string_equal(got, ids);
  sg__lh_decision_free(&d);
}

/* tick: run one tick; returns the issued quorum (or NULL), checks rc. */
static const sg__lh_quorum_t *tick(sg__lh_state_t *st, int64_t now,
                                   const sg__lh_opts_t *o, char *reason,
                                   size_t reason_len) {
  const sg__lh_quorum_t *q = (const sg__lh_quorum_t *)1;
  int rc = sg__lh_tick(st, now, now + 7, o, &q, reason, reason_len);
  assert_true(rc == 0 || rc == 1);
  if (rc == 0)
    assert_null(q);
  else
    assert_non_null(q);
  return q;
}

static void quorum_ids(const sg__lh_quorum_t *q, char *buf, size_t len) {
  buf[0] = '\0';
  for (size_t i = 0; i < q->n; i++) {
    if (i)
      strncat(buf, ",", len - strlen(buf) - 1);
    strncat(buf, q->members[i].replica_id, len - strlen(buf) - 1);
  }
}

static void expect_quorum(const sg__lh_quorum_t *q, int64_t id,
                          const char *ids) {
  char buf[1024];
  assert_non_null(q);
  assert_int_equal(q->quorum_id, id);
  quorum_ids(q, buf, sizeof(buf));
  assert_string_equal(buf, ids);
}

static int64_t joined_of(const sg__lh_state_t *st, const char *id) {
  for (size_t i = 0; i < sg__lh_participant_count(st); i++) {
    int64_t j = 0;
    const sg__lh_member_t *m = sg__lh_participant_at(st, i, &j);
    if (strcmp(m->replica_id, id) == 0)
      return j;
  }
  fail_msg("%s is not a participant", id);
  return -1;
}

/* ---- basics --------------------------------------------------------------
 */

static void test_state_new_and_args(void **state) {
  (void)state;
  sg__lh_state_t *st = (sg__lh_state_t *)1;
  assert_int_equal(sg__lh_state_new(0, &st), SG_EINVAL);
  assert_null(st);
  assert_int_equal(sg__lh_state_new((size_t)1 << 40, &st), SG_EINVAL);
  assert_int_equal(sg__lh_state_new(4, NULL), SG_EINVAL);
  sg__lh_state_free(NULL);

  st = new_state(4);
  sg__lh_decision_t d;
  assert_int_equal(sg__lh_decide(st, T0, NULL, &d), SG_EINVAL);
  assert_int_equal(sg__lh_decide(NULL, T0, &DEFAULT_OPTS, &d), SG_EINVAL);
  assert_int_equal(sg__lh_decide(st, T0, &DEFAULT_OPTS, NULL), SG_EINVAL);
  sg__lh_decision_free(&d);
  sg__lh_decision_free(NULL);
  assert_int_equal(sg__lh_heartbeat(st, NULL, T0), SG_EINVAL);
  sg__lh_member_t m = member("a", 0, 0, 0);
  m.replica_id = NULL;
  assert_int_equal(sg__lh_join(st, &m, T0), SG_EINVAL);
  assert_int_equal(sg__lh_join(st, NULL, T0), SG_EINVAL);
  assert_int_equal(sg__lh_leave(st, NULL), SG_EINVAL);
  assert_int_equal(sg__lh_mark_dead(st, NULL), SG_EINVAL);
  assert_int_equal(sg__lh_tick(st, T0, 0, NULL, NULL, NULL, 0), SG_EINVAL);
  assert_int_equal(sg__lh_next_deadline(st, T0, NULL), INT64_MAX);

  /* an empty state */
  assert_int_equal(sg__lh_quorum_id(st), 0);
  assert_null(sg__lh_prev_quorum(st));
  assert_int_equal(sg__lh_heartbeat_count(st), 0);
  assert_int_equal(sg__lh_participant_count(st), 0);
  assert_int_equal(sg__lh_heartbeat_at(st, 0, NULL, NULL), SG_EINVAL);
  assert_null(sg__lh_participant_at(st, 0, NULL));
  assert_false(sg__lh_is_participant(st, "a"));
  assert_int_equal(sg__lh_pruned_total(st), 0);
  expect_reason(st, T0, &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/0 participants healthy][0 heartbeating]"
                "[shrink_only=false]");
  sg__lh_state_free(st);
}

static void test_member_copy_is_deep_and_fills_nulls(void **state) {
  (void)state;
  char id[] = "rep:1";
  sg__lh_member_t src = member(id, 42, 1, 3);
  src.data = NULL;
  sg__lh_member_t dst;
  assert_int_equal(sg__lh_member_copy(&dst, &src), 0);
  id[0] = 'X'; /* the copy does not alias */
  assert_string_equal(dst.replica_id, "rep:1");
  assert_string_equal(dst.address, "http://host:1234");
  assert_string_equal(dst.store_address, "host:29500");
  assert_string_equal(dst.data, "");
  assert_int_equal(dst.step, 42);
  assert_int_equal(dst.world_size, 8);
  assert_int_equal(dst.commit_failures, 3);
  assert_int_equal(dst.shrink_only, 1);
  sg__lh_member_free(&dst);
  assert_null(dst.replica_id);
  sg__lh_member_free(NULL);

  /* one allocation: when it fails, nothing is left half made */
  sg_test_fail_alloc(1, 0);
  assert_int_equal(sg__lh_member_copy(&dst, &src), SG_ENOMEM);
  assert_int_equal(sg_test_fail_alloc(0, 0), 1);
  assert_null(dst.replica_id);
  assert_null(dst.address);
  assert_null(dst.store_address);
  assert_null(dst.data);
  assert_null(dst.block);
  sg_test_fail_alloc(2, 0); /* the second allocation is never made */
  assert_int_equal(sg__lh_member_copy(&dst, &src), 0);
  assert_int_equal(sg_test_fail_alloc(0, 0), 0);
  sg__lh_member_free(&dst);

  /* wire bytes and handles live in the same block, copied */
  char h0[] = "h0", h1[] = "";
  char *hs[] = {h0, h1, NULL};
  uint8_t wire[] = {0x0a, 0x01, 'x'};
  src.reconfigure_handles = hs;
  src.n_reconfigure_handles = 3;
  src.wire = wire;
  src.wire_len = sizeof(wire);
  assert_int_equal(sg__lh_member_copy(&dst, &src), 0);
  h0[0] = 'X';
  wire[2] = 'y';
  assert_int_equal(dst.n_reconfigure_handles, 3);
  assert_string_equal(dst.reconfigure_handles[0], "h0");
  assert_string_equal(dst.reconfigure_handles[1], "");
  assert_string_equal(dst.reconfigure_handles[2], ""); /* NULL filled */
  assert_int_equal(dst.wire_len, 3);
  assert_int_equal(dst.wire[2], 'x');
  assert_string_equal(dst.replica_id, "Xep:1"); /* the source's, renamed */
  sg__lh_member_free(&dst);
  assert_null(dst.block);
  assert_null(dst.reconfigure_handles);
}

static void test_first_quorum_is_id_1_and_copies_members(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  char reason[512];
  join_ex(st, "a", T0, 17, 0, 0);
  expect_reason(st, T0, &DEFAULT_OPTS, 1,
                "Valid quorum found [1/1 participants healthy][1 "
                "heartbeating][shrink_only=false]");
  const sg__lh_quorum_t *q = NULL;
  assert_int_equal(
      sg__lh_tick(st, T0, 123456789, &DEFAULT_OPTS, &q, reason, sizeof(reason)),
      1);
  assert_string_equal(reason, "Valid quorum found [1/1 participants "
                              "healthy][1 heartbeating][shrink_only=false]");
  expect_quorum(q, 1, "a");
  assert_ptr_equal(q, sg__lh_prev_quorum(st));
  assert_int_equal(q->created_wall_ns, 123456789);
  assert_string_equal(q->members[0].address, "http://host:1234");
  assert_string_equal(q->members[0].store_address, "host:29500");
  assert_string_equal(q->members[0].data, "{\"k\": 1}");
  assert_int_equal(q->members[0].step, 17);
  assert_int_equal(q->members[0].world_size, 8);
  assert_int_equal(sg__lh_quorum_id(st), 1);
  /* participants are cleared, the heartbeat stays */
  assert_int_equal(sg__lh_participant_count(st), 0);
  assert_int_equal(sg__lh_heartbeat_count(st), 1);
  /* nothing more to issue until a new request */
  assert_null(tick(st, T0 + 1, &DEFAULT_OPTS, reason, sizeof(reason)));
  assert_string_equal(reason, "New quorum not ready, only have 0 "
                              "participants, need min_replicas 1 [0/0 "
                              "participants healthy][1 heartbeating]"
                              "[shrink_only=false]");
  /* a short reason buffer truncates; NULL is allowed */
  assert_null(tick(st, T0 + 1, &DEFAULT_OPTS, reason, 4));
  assert_string_equal(reason, "New");
  assert_int_equal(sg__lh_tick(st, T0 + 1, 0, &DEFAULT_OPTS, NULL, NULL, 0), 0);
  sg__lh_state_free(st);
}

static void test_heartbeat_boundary_is_strict(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  hb(st, "a", T0);
  hb(st, "b", T0 + MS(1));
  /* age 4999.999999 ms: healthy; age exactly 5000 ms: not */
  expect_reason(st, T0 + MS(5000) - 1, &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/0 participants healthy][2 heartbeating]"
                "[shrink_only=false]");
  expect_reason(st, T0 + MS(5000), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/0 participants healthy][1 heartbeating]"
                "[shrink_only=false]");
  expect_reason(st, T0 + MS(5001), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/0 participants healthy][0 heartbeating]"
                "[shrink_only=false]");
  /* a participant whose heartbeat expired is not healthy */
  join(st, "c", T0);
  expect_reason(st, T0 + MS(5000), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/1 participants healthy][1 heartbeating]"
                "[shrink_only=false]");
  /* a heartbeat refreshes it */
  hb(st, "c", T0 + MS(4000));
  expect_reason(st, T0 + MS(5000), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 1 participants, need at "
                "least half of 2 healthy workers [1/1 participants healthy]"
                "[2 heartbeating][shrink_only=false]");
  /* a zero timeout makes nobody healthy; a time before the last heartbeat
   * counts as age 0 */
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.heartbeat_timeout_ms = 0;
  expect_reason(st, T0 + MS(5000), &o, 0,
                "New quorum not ready, only have 0 participants, need "
                "min_replicas 1 [0/1 participants healthy][0 heartbeating]"
                "[shrink_only=false]");
  expect_reason(st, T0 - MS(100000), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 1 participants, need at "
                "least half of 3 healthy workers [1/1 participants healthy]"
                "[3 heartbeating][shrink_only=false]");
  sg__lh_state_free(st);
}

static void test_is_healthy_matches_the_decision(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  assert_false(sg__lh_is_healthy(st, "a", T0, &DEFAULT_OPTS));
  hb(st, "a", T0);
  assert_true(sg__lh_is_healthy(st, "a", T0 + MS(5000) - 1, &DEFAULT_OPTS));
  assert_false(sg__lh_is_healthy(st, "a", T0 + MS(5000), &DEFAULT_OPTS));
  assert_int_equal(sg__lh_mark_dead(st, "a"), 0);
  assert_false(sg__lh_is_healthy(st, "a", T0, &DEFAULT_OPTS));
  assert_false(sg__lh_is_healthy(NULL, "a", T0, &DEFAULT_OPTS));
  sg__lh_state_free(st);
}

static void test_min_replicas(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 2;
  join(st, "a", T0);
  expect_reason(st, T0, &o, 0,
                "New quorum not ready, only have 1 participants, need "
                "min_replicas 2 [1/1 participants healthy][1 heartbeating]"
                "[shrink_only=false]");
  assert_null(tick(st, T0, &o, NULL, 0));
  assert_int_equal(sg__lh_participant_count(st), 1); /* still waiting */
  join(st, "b", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &o, 1,
                "Valid quorum found [2/2 participants healthy][2 "
                "heartbeating][shrink_only=false]");
  /* min_replicas counts healthy participants only */
  expect_reason(st, T0 + MS(5000), &o, 0,
                "New quorum not ready, only have 1 participants, need "
                "min_replicas 2 [1/2 participants healthy][1 heartbeating]"
                "[shrink_only=false]");
  /* min_replicas 0 still needs a majority (split brain) */
  o.min_replicas = 0;
  sg__lh_state_t *empty = new_state(4);
  expect_reason(empty, T0, &o, 0,
                "New quorum not ready, only have 0 participants, need at "
                "least half of 0 healthy workers [0/0 participants healthy]"
                "[0 heartbeating][shrink_only=false]");
  sg__lh_state_free(empty);
  sg__lh_state_free(st);
}

static void test_split_brain_integer_division(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.join_timeout_ms = 0; /* isolate the split-brain rule */
  /* 3 heartbeating: 1 <= 3/2 (= 1) is split brain, 2 is a majority */
  hb(st, "x", T0);
  join(st, "a", T0);
  join(st, "b", T0);
  sg__lh_mark_dead(st, "b");
  hb(st, "b", T0);
  expect_reason(st, T0, &o, 0,
                "New quorum not ready, only have 1 participants, need at "
                "least half of 3 healthy workers [1/1 participants healthy]"
                "[3 heartbeating][shrink_only=false]");
  join(st, "b", T0);
  expect_reason(st, T0, &o, 1,
                "Valid quorum found [2/2 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  /* 4 heartbeating: 2 <= 4/2 (= 2) is split brain (exact half) */
  hb(st, "y", T0);
  expect_reason(st, T0, &o, 0,
                "New quorum not ready, only have 2 participants, need at "
                "least half of 4 healthy workers [2/2 participants healthy]"
                "[4 heartbeating][shrink_only=false]");
  /* 5 heartbeating: 2 <= 5/2 (= 2) is split brain, 3 passes */
  hb(st, "c", T0);
  expect_reason(st, T0, &o, 0,
                "New quorum not ready, only have 2 participants, need at "
                "least half of 5 healthy workers [2/2 participants healthy]"
                "[5 heartbeating][shrink_only=false]");
  join(st, "c", T0);
  expect_reason(st, T0, &o, 1,
                "Valid quorum found [3/3 participants healthy][5 "
                "heartbeating][shrink_only=false]");
  expect_ids(st, T0, &o, "a,b,c");
  /* expired heartbeats do not count towards the total (x, y expire) */
  hb(st, "a", T0 + MS(3000));
  hb(st, "b", T0 + MS(3000));
  hb(st, "c", T0 + MS(3000));
  expect_reason(st, T0 + MS(6000), &o, 1,
                "Valid quorum found [3/3 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  sg__lh_state_free(st);
}

static void test_join_timeout_waits_then_expires(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  const sg__lh_opts_t *o = &DEFAULT_OPTS; /* join timeout 100 ms */
  char reason[512];
  hb(st, "straggler", T0);
  join(st, "a", T0 + MS(10));
  join(st, "b", T0 + MS(20));
  const char *waiting = "Valid quorum with 2 participants, waiting for 1 "
                        "healthy but not participating stragglers due to join "
                        "timeout [2/2 participants healthy][3 heartbeating]"
                        "[shrink_only=false]";
  expect_reason(st, T0 + MS(20), o, 0, waiting);
  /* measured from the earliest healthy join (a at 10 ms), strict < */
  expect_reason(st, T0 + MS(110) - 1, o, 0, waiting);
  assert_null(tick(st, T0 + MS(110) - 1, o, reason, sizeof(reason)));
  assert_string_equal(reason, waiting);
  const char *found = "Valid quorum found [2/2 participants healthy][3 "
                      "heartbeating][shrink_only=false]";
  expect_reason(st, T0 + MS(110), o, 1, found);
  expect_ids(st, T0 + MS(110), o, "a,b");
  /* a re-join resets a's joined: the earliest is now b at 20 ms */
  join(st, "a", T0 + MS(50));
  assert_int_equal(joined_of(st, "a"), T0 + MS(50));
  assert_int_equal(sg__lh_participant_count(st), 2);
  expect_reason(st, T0 + MS(119), o, 0,
                "Valid quorum with 2 participants, waiting for 1 healthy but "
                "not participating stragglers due to join timeout [2/2 "
                "participants healthy][3 heartbeating][shrink_only=false]");
  expect_reason(st, T0 + MS(120), o, 1, found);
  /* an unhealthy participant's join time does not count */
  sg__lh_state_t *s2 = new_state(16);
  join(s2, "old", T0);
  hb(s2, "s1", T0 + MS(4000));
  join(s2, "a", T0 + MS(5000));
  join(s2, "b", T0 + MS(5000));
  /* at 5050 ms "old" (joined at 0) is expired; a, b joined 50 ms ago */
  expect_reason(s2, T0 + MS(5050), o, 0,
                "Valid quorum with 2 participants, waiting for 1 healthy but "
                "not participating stragglers due to join timeout [2/3 "
                "participants healthy][3 heartbeating][shrink_only=false]");
  expect_ids(s2, T0 + MS(5100), o, "a,b");
  sg__lh_state_free(s2);
  sg__lh_state_free(st);
}

static void test_all_joined_does_not_wait(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.join_timeout_ms = 60000;
  join(st, "b", T0);
  join(st, "a", T0);
  join(st, "c", T0);
  expect_reason(st, T0, &o, 1,
                "Valid quorum found [3/3 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  const sg__lh_quorum_t *q = tick(st, T0, &o, NULL, 0);
  expect_quorum(q, 1, "a,b,c");
  sg__lh_state_free(st);
}

/* ---- fast quorum and shrink_only -----------------------------------------
 */

/* make_prev: issue a first quorum of `ids` (comma-free names, NULL ended). */
static void make_prev(sg__lh_state_t *st, const char *const *ids, int64_t now) {
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.join_timeout_ms = 0;
  o.min_replicas = 0;
  for (size_t i = 0; ids[i]; i++)
    join(st, ids[i], now);
  assert_non_null(tick(st, now, &o, NULL, 0));
}

static void test_fast_quorum_bypasses_other_rules(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  assert_int_equal(sg__lh_quorum_id(st), 1);
  /* four more heartbeating, not joining: split brain and join timeout
   * would block a normal quorum, min_replicas 5 would too */
  hb(st, "c", T0);
  hb(st, "d", T0);
  hb(st, "e", T0);
  hb(st, "f", T0);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 5;
  o.join_timeout_ms = 60000;
  join(st, "b", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &o, 0,
                "New quorum not ready, only have 1 participants, need "
                "min_replicas 5 [1/1 participants healthy][6 heartbeating]"
                "[shrink_only=false]");
  join(st, "a", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &o, 1,
                "Fast quorum found! [2/2 participants healthy][6 "
                "heartbeating][shrink_only=false]");
  const sg__lh_quorum_t *q = tick(st, T0 + MS(1), &o, NULL, 0);
  expect_quorum(q, 1, "a,b"); /* same membership: no bump */
  sg__lh_state_free(st);
}

static void test_fast_quorum_admits_extra_joiners(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  join(st, "c", T0 + MS(1));
  join(st, "a", T0 + MS(1));
  join(st, "b", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &DEFAULT_OPTS, 1,
                "Fast quorum found! [3/3 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  const sg__lh_quorum_t *q = tick(st, T0 + MS(1), &DEFAULT_OPTS, NULL, 0);
  expect_quorum(q, 2, "a,b,c"); /* membership changed: bump */
  sg__lh_state_free(st);
}

static void test_fast_quorum_needs_every_prev_member_healthy(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 2;
  o.join_timeout_ms = 60000;
  /* b's request is there but its heartbeat expired */
  join(st, "b", T0 + MS(1));
  join(st, "a", T0 + MS(4000));
  join(st, "c", T0 + MS(4000));
  expect_reason(st, T0 + MS(5001), &o, 1,
                "Valid quorum found [2/3 participants healthy][2 "
                "heartbeating][shrink_only=false]");
  expect_ids(st, T0 + MS(5001), &o, "a,c");
  /* b only heartbeating (no request) is not enough either */
  assert_int_equal(sg__lh_leave(st, "b"), 0);
  hb(st, "b", T0 + MS(5001));
  expect_reason(st, T0 + MS(5001), &o, 0,
                "Valid quorum with 2 participants, waiting for 1 healthy but "
                "not participating stragglers due to join timeout [2/2 "
                "participants healthy][3 heartbeating][shrink_only=false]");
  sg__lh_state_free(st);
}

static void test_shrink_only_excludes_new_joiners(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  /* fast path: a asks to shrink, c is new and must wait */
  join_ex(st, "a", T0 + MS(1), 0, 1, 0);
  join(st, "b", T0 + MS(1));
  join(st, "c", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &DEFAULT_OPTS, 1,
                "Fast quorum found! [3/3 participants healthy][3 "
                "heartbeating][shrink_only=true]");
  const sg__lh_quorum_t *q = tick(st, T0 + MS(2), &DEFAULT_OPTS, NULL, 0);
  expect_quorum(q, 1, "a,b");
  /* c stays pending, re-entered at the tick's time */
  assert_int_equal(sg__lh_participant_count(st), 1);
  assert_true(sg__lh_is_participant(st, "c"));
  assert_int_equal(joined_of(st, "c"), T0 + MS(2));
  sg__lh_state_free(st);
}

static void test_shrink_only_on_the_slow_path(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const abc[] = {"a", "b", "c", NULL};
  make_prev(st, abc, T0);
  assert_int_equal(sg__lh_mark_dead(st, "c"), 0);
  join(st, "d", T0 + MS(1));
  join_ex(st, "a", T0 + MS(1), 0, 1, 0);
  join(st, "b", T0 + MS(1));
  expect_reason(st, T0 + MS(1), &DEFAULT_OPTS, 1,
                "Valid quorum found [3/3 participants healthy][3 "
                "heartbeating][shrink_only=true]");
  const sg__lh_quorum_t *q = tick(st, T0 + MS(1), &DEFAULT_OPTS, NULL, 0);
  expect_quorum(q, 2, "a,b");
  assert_true(sg__lh_is_participant(st, "d"));
  /* shrink_only of an unhealthy participant does not count */
  join_ex(st, "a", T0 + MS(2), 0, 0, 0);
  join(st, "b", T0 + MS(2));
  join_ex(st, "z", T0 + MS(2) - MS(5000), 0, 1, 0);
  expect_reason(st, T0 + MS(2), &DEFAULT_OPTS, 1,
                "Fast quorum found! [3/4 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  expect_ids(st, T0 + MS(2), &DEFAULT_OPTS, "a,b,d");
  sg__lh_state_free(st);
}

static void test_shrink_only_without_prev_quorum_filters_nothing(void **s) {
  (void)s;
  sg__lh_state_t *st = new_state(16);
  join_ex(st, "b", T0, 0, 1, 0);
  join(st, "a", T0);
  expect_reason(st, T0, &DEFAULT_OPTS, 1,
                "Valid quorum found [2/2 participants healthy][2 "
                "heartbeating][shrink_only=true]");
  expect_ids(st, T0, &DEFAULT_OPTS, "a,b");
  sg__lh_state_free(st);
}

/* torchft issues an empty quorum when shrink_only filters out every
 * candidate; the next quorum is then "fast" (no previous member missing).
 * We match that, and the would-be members stay pending. */
static void test_shrink_only_can_issue_an_empty_quorum(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  sg__lh_mark_dead(st, "a");
  sg__lh_mark_dead(st, "b");
  join_ex(st, "c", T0 + MS(1), 0, 1, 0);
  const sg__lh_quorum_t *q = tick(st, T0 + MS(1), &DEFAULT_OPTS, NULL, 0);
  expect_quorum(q, 2, "");
  assert_null(q->members);
  assert_true(sg__lh_is_participant(st, "c"));
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 3;
  join(st, "c", T0 + MS(2));
  expect_reason(st, T0 + MS(2), &o, 1,
                "Fast quorum found! [1/1 participants healthy][1 "
                "heartbeating][shrink_only=false]");
  q = tick(st, T0 + MS(2), &o, NULL, 0);
  expect_quorum(q, 3, "c");
  sg__lh_state_free(st);
}

/* ---- quorum ids -----------------------------------------------------------
 */

static void test_quorum_id_bump_rules(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  const sg__lh_opts_t *o = &DEFAULT_OPTS;
  const sg__lh_quorum_t *q;
  int64_t t = T0;
  join(st, "b", t);
  join(st, "a", t);
  expect_quorum(tick(st, t, o, NULL, 0), 1, "a,b");
  /* same membership, other addresses, steps, data: no bump */
  t += MS(1);
  sg__lh_member_t m = member("a", 99, 0, 0);
  m.address = (char *)"http://elsewhere:1";
  m.store_address = (char *)"elsewhere:2";
  m.data = (char *)"{}";
  assert_int_equal(sg__lh_join(st, &m, t), 0);
  join_ex(st, "b", t, 5, 0, 0);
  q = tick(st, t, o, NULL, 0);
  expect_quorum(q, 1, "a,b");
  assert_string_equal(q->members[0].address, "http://elsewhere:1");
  assert_int_equal(q->members[0].step, 99);
  assert_int_equal(q->members[1].step, 5);
  /* commit failures with the same membership: bump */
  t += MS(1);
  join_ex(st, "a", t, 100, 0, 0);
  join_ex(st, "b", t, 100, 0, 2);
  expect_quorum(tick(st, t, o, NULL, 0), 2, "a,b");
  /* and back to none: no bump */
  t += MS(1);
  join(st, "a", t);
  join(st, "b", t);
  expect_quorum(tick(st, t, o, NULL, 0), 2, "a,b");
  /* commit failures of a pending non-member do not count */
  t += MS(1);
  join_ex(st, "a", t, 0, 1, 0);
  join(st, "b", t);
  join_ex(st, "n", t, 0, 0, 7);
  expect_quorum(tick(st, t, o, NULL, 0), 2, "a,b");
  assert_true(sg__lh_is_participant(st, "n"));
  assert_int_equal(sg__lh_mark_dead(st, "n"), 0);
  /* a member leaving: bump; one coming back: bump */
  t += MS(1);
  sg__lh_mark_dead(st, "b");
  join(st, "a", t);
  expect_quorum(tick(st, t, o, NULL, 0), 3, "a");
  t += MS(1);
  join(st, "a", t);
  join(st, "b", t);
  expect_quorum(tick(st, t, o, NULL, 0), 4, "a,b");
  /* same size, other ids: bump */
  t += MS(1);
  sg__lh_mark_dead(st, "b");
  join(st, "a", t);
  join(st, "c", t);
  expect_quorum(tick(st, t, o, NULL, 0), 5, "a,c");
  assert_int_equal(sg__lh_quorum_id(st), 5);
  sg__lh_state_free(st);
}

static void test_quorum_id_floor(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_set_quorum_id_floor(st, 41);
  assert_int_equal(sg__lh_quorum_id(st), 41);
  sg__lh_set_quorum_id_floor(st, 7); /* never backwards */
  assert_int_equal(sg__lh_quorum_id(st), 41);
  join(st, "a", T0);
  expect_quorum(tick(st, T0, &DEFAULT_OPTS, NULL, 0), 42, "a");
  sg__lh_set_quorum_id_floor(st, 3);
  join(st, "a", T0 + 1);
  expect_quorum(tick(st, T0 + 1, &DEFAULT_OPTS, NULL, 0), 42, "a");
  join(st, "b", T0 + 2);
  join(st, "a", T0 + 2);
  expect_quorum(tick(st, T0 + 2, &DEFAULT_OPTS, NULL, 0), 43, "a,b");
  /* saturates instead of wrapping */
  sg__lh_set_quorum_id_floor(st, INT64_MAX);
  sg__lh_mark_dead(st, "b");
  join(st, "a", T0 + 3);
  expect_quorum(tick(st, T0 + 3, &DEFAULT_OPTS, NULL, 0), INT64_MAX, "a");
  sg__lh_set_quorum_id_floor(NULL, 5);
  sg__lh_state_free(st);
}

/* ---- the step floor ------------------------------------------------------
 */

#define HOLD_META                                                              \
  " [1/1 participants healthy][1 heartbeating][shrink_only=false]"

/* The job reached step 10; every replica holding it is gone, and a fresh
 * one at step 0 would start the job over: with state_loss_wait_ms < 0 it
 * is held for good, and released by a replica that holds the step. */
static void test_step_floor_holds_a_quorum_that_starts_over(void **state) {
  (void)state;
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.state_loss_wait_ms = -1;
  sg__lh_state_t *st = new_state(16);
  assert_int_equal(sg__lh_step_floor(st), -1);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  assert_int_equal(sg__lh_step_floor(st), 10);
  /* a falls silent; b joins at step 0 */
  join_ex(st, "b", T0 + MS(6000), 0, 0, 0);
  const char *held = "Holding a quorum at step 0: the job reached step 10 "
                     "and no healthy participant holds it; waiting until one "
                     "is back" HOLD_META;
  expect_reason(st, T0 + MS(6000), &o, 0, held);
  for (int64_t t = 7000; t < 3600000; t += 599000)
    hb(st, "b", T0 + MS(t));
  hb(st, "b", T0 + MS(3599999));
  expect_reason(st, T0 + MS(3600000), &o, 0, held);
  assert_null(tick(st, T0 + MS(3600000), &o, NULL, 0));
  /* a replica at the floor (or past it) releases it: b heals from c */
  join_ex(st, "c", T0 + MS(3600001), 10, 0, 0);
  expect_quorum(tick(st, T0 + MS(3600001), &o, NULL, 0), 2, "b,c");
  assert_int_equal(sg__lh_step_floor(st), 10);
  assert_int_equal(sg__lh_step_regressions(st, NULL, NULL), 0);
  sg__lh_state_free(st);

  /* a replica that asked at the floor itself and goes back (to a
   * checkpoint, say) is not held: it knows; the floor follows it */
  st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  join_ex(st, "a", T0 + MS(1), 4, 0, 0);
  expect_quorum(tick(st, T0 + MS(1), &o, NULL, 0), 1, "a");
  assert_int_equal(sg__lh_step_floor(st), 4);
  assert_int_equal(sg__lh_step_regressions(st, NULL, NULL), 1);
  sg__lh_state_free(st);

  /* members behind the floor beside one at it: the usual heal, no hold */
  st = new_state(16);
  sg__lh_set_step_floor(st, 7, T0);
  join_ex(st, "a", T0, 3, 0, 0);
  join_ex(st, "b", T0, 7, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a,b");
  /* the floor only rises by a report */
  sg__lh_set_step_floor(st, 2, T0);
  assert_int_equal(sg__lh_step_floor(st), 7);
  sg__lh_state_free(st);
}

/* A finite wait counts from the last word of a replica at the floor (its
 * heartbeat, while its connection stays open: cut off or hung), or from a
 * restored floor; once over, the quorum is issued, the floor follows it
 * down and the regression is counted.  A holder seen to die (its last
 * connection closed: sg__lh_mark_dead) holds nothing, unless the wait is
 * < 0.  0 is torchft's behaviour: no hold at all. */
static void test_step_floor_wait_is_bounded(void **state) {
  (void)state;
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.state_loss_wait_ms = 10000;
  sg__lh_state_t *st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  hb(st, "a", T0 + MS(3000)); /* then silent */
  join_ex(st, "b", T0 + MS(4000), 0, 0, 0);
  hb(st, "b", T0 + MS(9000));
  expect_reason(st, T0 + MS(12999), &o, 0,
                "Holding a quorum at step 0: the job reached step 10 and no "
                "healthy participant holds it; waiting up to 10000 ms after "
                "one was heard" HOLD_META);
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(12000), &o),
                   T0 + MS(13000));
  assert_null(tick(st, T0 + MS(12999), &o, NULL, 0));
  expect_quorum(tick(st, T0 + MS(13000), &o, NULL, 0), 2, "b");
  int64_t from = 0, to = 0;
  assert_int_equal(sg__lh_step_regressions(st, &from, &to), 1);
  assert_int_equal(from, 10);
  assert_int_equal(to, 0);
  assert_int_equal(sg__lh_step_floor(st), 0);
  sg__lh_state_free(st);

  /* seen to die: nothing to wait for (a resume from a checkpoint after the
   * whole job died is issued at once), but counted */
  st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  assert_int_equal(sg__lh_mark_dead(st, "a"), 0);
  join_ex(st, "b", T0 + MS(1), 6, 0, 0);
  expect_quorum(tick(st, T0 + MS(1), &o, NULL, 0), 2, "b");
  assert_int_equal(sg__lh_step_regressions(st, &from, &to), 1);
  assert_int_equal(to, 6);
  sg__lh_state_free(st);
  /* ... except with a wait < 0 */
  o.state_loss_wait_ms = -1;
  st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  assert_int_equal(sg__lh_mark_dead(st, "a"), 0);
  join_ex(st, "b", T0 + MS(1), 6, 0, 0);
  assert_null(tick(st, T0 + MS(2), &o, NULL, 0));
  sg__lh_state_free(st);
  o.state_loss_wait_ms = 10000;

  /* a restored floor holds for the wait from when it was restored */
  st = new_state(16);
  sg__lh_set_step_floor(st, 10, T0);
  join_ex(st, "b", T0 + MS(1), 0, 0, 0);
  hb(st, "b", T0 + MS(4000));
  hb(st, "b", T0 + MS(8000));
  assert_null(tick(st, T0 + MS(9999), &o, NULL, 0));
  expect_quorum(tick(st, T0 + MS(10000), &o, NULL, 0), 1, "b");
  sg__lh_state_free(st);

  /* a holder that heartbeats without asking holds the quorum past the
   * join timeout, for as long as it is heard */
  st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  join_ex(st, "b", T0 + MS(1), 0, 0, 0);
  for (int64_t t = 0; t <= 30000; t += 1000) {
    hb(st, "a", T0 + MS(t));
    hb(st, "b", T0 + MS(t));
    assert_null(tick(st, T0 + MS(t) + 1, &o, NULL, 0));
  }
  sg__lh_state_free(st);

  /* 0: issued at once (torchft), and still counted */
  o.state_loss_wait_ms = 0;
  st = new_state(16);
  join_ex(st, "a", T0, 10, 0, 0);
  expect_quorum(tick(st, T0, &o, NULL, 0), 1, "a");
  join_ex(st, "b", T0 + MS(6000), 0, 0, 0);
  expect_quorum(tick(st, T0 + MS(6000), &o, NULL, 0), 2, "b");
  assert_int_equal(sg__lh_step_regressions(st, NULL, NULL), 1);
  sg__lh_state_free(st);

  /* a floor restored after a restart holds like one reached here */
  o.state_loss_wait_ms = -1;
  st = new_state(16);
  sg__lh_set_step_floor(st, 10, T0);
  join_ex(st, "b", T0, 0, 0, 0);
  hb(st, "b", T0 + MS(59999));
  assert_null(tick(st, T0 + MS(60000), &o, NULL, 0));
  join_ex(st, "a", T0 + MS(60000), 11, 0, 0);
  expect_quorum(tick(st, T0 + MS(60000), &o, NULL, 0), 1, "a,b");
  assert_int_equal(sg__lh_step_floor(st), 11);
  sg__lh_state_free(st);
}

/* After a restart the first quorum waits for the members of the last one
 * issued before it: each comes back or falls silent (heartbeat timeout
 * from the first report), within heartbeat + join timeout at most. */
static void test_restart_waits_for_last_quorum_members(void **state) {
  (void)state;
  const char *last[] = {"a", "b", "c"};
  sg__lh_state_t *st = new_state(16);
  assert_int_equal(sg__lh_expect(st, 70, last, 3, T0), 0);
  assert_int_equal(sg__lh_quorum_id(st), 70); /* a floor for the ids */
  join(st, "a", T0 + MS(1));
  expect_reason(st, T0 + MS(2), &DEFAULT_OPTS, 0,
                "Waiting for 2 of 3 members of quorum 70 from before a "
                "lighthouse restart [1/1 participants healthy][1 "
                "heartbeating][shrink_only=false]");
  /* b comes back; c heartbeats (alive: still waited for) */
  join(st, "b", T0 + MS(3));
  hb(st, "c", T0 + MS(3));
  expect_reason(st, T0 + MS(4), &DEFAULT_OPTS, 0,
                "Waiting for 1 of 3 members of quorum 70 from before a "
                "lighthouse restart [2/2 participants healthy][3 "
                "heartbeating][shrink_only=false]");
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(4), &DEFAULT_OPTS),
                   T0 + MS(101)); /* the join timeout from a joining */
  join(st, "c", T0 + MS(5));
  expect_quorum(tick(st, T0 + MS(5), &DEFAULT_OPTS, NULL, 0), 71, "a,b,c");
  /* reports after the first quorum change nothing but the floor */
  assert_int_equal(sg__lh_expect(st, 90, last, 1, T0 + MS(6)), 0);
  join(st, "a", T0 + MS(7));
  join(st, "b", T0 + MS(7));
  assert_int_equal(sg__lh_quorum_id(st), 90);
  sg__lh_mark_dead(st, "c");
  expect_quorum(tick(st, T0 + MS(7), &DEFAULT_OPTS, NULL, 0), 91, "a,b");
  sg__lh_state_free(st);

  /* a member never heard of again is excused after the heartbeat timeout
   * from the first report; a newer report replaces an older one, an older
   * one is ignored */
  st = new_state(16);
  const char *older[] = {"a", "z"};
  assert_int_equal(sg__lh_expect(st, 5, older, 2, T0), 0);
  assert_int_equal(sg__lh_expect(st, 6, last, 2, T0 + MS(10)), 0);
  assert_int_equal(sg__lh_expect(st, 4, older, 2, T0 + MS(10)), 0);
  join(st, "a", T0 + MS(20));
  expect_reason(st, T0 + MS(4999), &DEFAULT_OPTS, 0,
                "Waiting for 1 of 2 members of quorum 6 from before a "
                "lighthouse restart [1/1 participants healthy][1 "
                "heartbeating][shrink_only=false]");
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(4999), &DEFAULT_OPTS),
                   T0 + MS(5000));
  expect_quorum(tick(st, T0 + MS(5000), &DEFAULT_OPTS, NULL, 0), 7, "a");
  sg__lh_state_free(st);

  /* a member that heartbeats but never asks holds the first quorum for at
   * most heartbeat + join timeout */
  st = new_state(16);
  assert_int_equal(sg__lh_expect(st, 9, last, 2, T0), 0);
  join(st, "a", T0);
  for (int64_t t = 0; t <= 5000; t += 1000) {
    hb(st, "a", T0 + MS(t));
    hb(st, "b", T0 + MS(t));
  }
  expect_reason(st, T0 + MS(5099), &DEFAULT_OPTS, 0,
                "Waiting for 1 of 2 members of quorum 9 from before a "
                "lighthouse restart [1/1 participants healthy][2 "
                "heartbeating][shrink_only=false]");
  /* then torchft's own rules decide (here: its split-brain check) */
  hb(st, "a", T0 + MS(5100));
  expect_reason(st, T0 + MS(5100), &DEFAULT_OPTS, 0,
                "New quorum not ready, only have 1 participants, need at "
                "least half of 2 healthy workers [1/1 participants "
                "healthy][2 heartbeating][shrink_only=false]");
  sg__lh_state_free(st);

  /* bad arguments and limits */
  st = new_state(2);
  assert_int_equal(sg__lh_expect(NULL, 1, last, 1, T0), SG_EINVAL);
  assert_int_equal(sg__lh_expect(st, -1, last, 1, T0), SG_EINVAL);
  assert_int_equal(sg__lh_expect(st, 1, NULL, 1, T0), SG_EINVAL);
  assert_int_equal(sg__lh_expect(st, 1, last, 3, T0), SG_ETOOBIG);
  sg_test_fail_alloc(1, 0);
  assert_int_equal(sg__lh_expect(st, 3, last, 2, T0), SG_ENOMEM);
  sg_test_fail_alloc(0, 0);
  assert_int_equal(sg__lh_quorum_id(st), 3); /* the floor still moved */
  join(st, "a", T0);
  expect_ids(st, T0, &DEFAULT_OPTS, "a"); /* nothing expected */
  sg__lh_state_free(st);
}

static void test_ids_sort_in_byte_order(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  join(st, "b", T0);
  join(st, "\xc3\xa9t\xc3\xa9", T0); /* UTF-8 sorts after ASCII bytes */
  join(st, "B", T0);
  join(st, "a:2", T0);
  join(st, "a:10", T0);
  join(st, "_", T0);
  join(st, "a", T0);
  expect_ids(st, T0, &DEFAULT_OPTS, "B,_,a,a:10,a:2,b,\xc3\xa9t\xc3\xa9");
  sg__lh_state_free(st);
}

/* ---- leave, mark_dead, retained participants -----------------------------
 */

static void test_leave(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 2;
  join(st, "a", T0);
  join(st, "b", T0);
  assert_int_equal(sg__lh_leave(st, "b"), 0);
  assert_int_equal(sg__lh_leave(st, "b"), SG_ENOTFOUND);
  assert_int_equal(sg__lh_leave(st, "nobody"), SG_ENOTFOUND);
  assert_false(sg__lh_is_participant(st, "b"));
  /* its heartbeat stays */
  expect_reason(st, T0, &o, 0,
                "New quorum not ready, only have 1 participants, need "
                "min_replicas 2 [1/1 participants healthy][2 heartbeating]"
                "[shrink_only=false]");
  sg__lh_state_free(st);
}

static void test_mark_dead_and_rejoin(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.join_timeout_ms = 60000;
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  join(st, "a", T0 + MS(1));
  join(st, "b", T0 + MS(1));
  /* b crashed with its request pending: it is gone at once, no waiting for
   * its heartbeat to expire or for the join timeout */
  assert_int_equal(sg__lh_mark_dead(st, "b"), 0);
  assert_false(sg__lh_is_participant(st, "b"));
  assert_int_equal(sg__lh_heartbeat_count(st), 1);
  assert_int_equal(sg__lh_mark_dead(st, "b"), SG_ENOTFOUND);
  expect_reason(st, T0 + MS(1), &o, 1,
                "Valid quorum found [1/1 participants healthy][1 "
                "heartbeating][shrink_only=false]");
  expect_quorum(tick(st, T0 + MS(1), &o, NULL, 0), 2, "a");
  /* a heartbeat-only replica can be marked dead too */
  hb(st, "h", T0 + MS(2));
  assert_int_equal(sg__lh_mark_dead(st, "h"), 0);
  /* b comes back: healthy again, normally (a alone is a fast quorum of
   * the previous {a}, but b now counts as heartbeating) */
  hb(st, "b", T0 + MS(3));
  join(st, "a", T0 + MS(3));
  expect_reason(st, T0 + MS(3), &o, 1,
                "Fast quorum found! [1/1 participants healthy][2 "
                "heartbeating][shrink_only=false]");
  join(st, "b", T0 + MS(4));
  expect_quorum(tick(st, T0 + MS(4), &o, NULL, 0), 3, "a,b");
  sg__lh_state_free(st);
}

static void test_pending_unincluded_participants_are_retained(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.join_timeout_ms = 0;
  /* "late" requested, then stopped heartbeating: not in the quorum, but
   * its request is still pending, so it stays (joined reset) */
  join(st, "late", T0);
  join(st, "a", T0 + MS(5000));
  join(st, "b", T0 + MS(5000));
  const sg__lh_quorum_t *q = tick(st, T0 + MS(6000), &o, NULL, 0);
  expect_quorum(q, 1, "a,b");
  assert_int_equal(sg__lh_participant_count(st), 1);
  int64_t joined = 0;
  const sg__lh_member_t *m = sg__lh_participant_at(st, 0, &joined);
  assert_string_equal(m->replica_id, "late");
  assert_string_equal(m->address, "http://host:1234");
  assert_int_equal(joined, T0 + MS(6000));
  /* a fresh heartbeat makes it eligible for the next quorum */
  hb(st, "late", T0 + MS(6001));
  join(st, "a", T0 + MS(6001));
  join(st, "b", T0 + MS(6001));
  expect_quorum(tick(st, T0 + MS(6001), &o, NULL, 0), 2, "a,b,late");
  assert_int_equal(sg__lh_participant_count(st), 0);
  sg__lh_state_free(st);
}

/* ---- deadlines ------------------------------------------------------------
 */

static void test_next_deadline(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(16);
  const sg__lh_opts_t *o = &DEFAULT_OPTS; /* hb 5000 ms, join 100 ms */
  assert_int_equal(sg__lh_next_deadline(st, T0, o), INT64_MAX);
  hb(st, "x", T0);
  hb(st, "y", T0 + MS(300));
  assert_int_equal(sg__lh_next_deadline(st, T0, o), T0 + MS(5000));
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(5000), o), T0 + MS(5300));
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(5300), o), INT64_MAX);
  /* the join timeout of the earliest healthy participant */
  join(st, "a", T0 + MS(5400));
  join(st, "b", T0 + MS(5450));
  expect_reason(st, T0 + MS(5450), o, 1,
                "Valid quorum found [2/2 participants healthy][2 "
                "heartbeating][shrink_only=false]");
  hb(st, "x", T0 + MS(5420));
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(5450), o), T0 + MS(5500));
  expect_reason(st, T0 + MS(5500) - 1, o, 0,
                "Valid quorum with 2 participants, waiting for 1 healthy but "
                "not participating stragglers due to join timeout [2/2 "
                "participants healthy][3 heartbeating][shrink_only=false]");
  expect_ids(st, T0 + MS(5500), o, "a,b");
  /* once passed, the next one is the earliest heartbeat expiry (a's) */
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(5500), o), T0 + MS(10400));
  /* an expired participant's join time is ignored */
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(10400), o), T0 + MS(10420));
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(10450), o), INT64_MAX);
  sg__lh_state_free(st);
}

/* ---- prune, limits, iteration --------------------------------------------
 */

static int has_heartbeat(const sg__lh_state_t *st, const char *id) {
  for (size_t i = 0; i < sg__lh_heartbeat_count(st); i++) {
    const char *got = NULL;
    int64_t last = 0;
    assert_int_equal(sg__lh_heartbeat_at(st, i, &got, &last), 0);
    if (strcmp(got, id) == 0)
      return 1;
  }
  return 0;
}

static void test_prune(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(64);
  static const char *const ab[] = {"a", "b", NULL};
  make_prev(st, ab, T0);
  join(st, "p", T0);
  hb(st, "old1", T0);
  hb(st, "old2", T0 + MS(1));
  hb(st, "fresh", T0 + MS(60000));
  for (int i = 0; i < 20; i++) { /* enough to exercise index deletion */
    char id[16];
    snprintf(id, sizeof(id), "gone%d", i);
    hb(st, id, T0);
  }
  assert_int_equal(sg__lh_heartbeat_count(st), 26);
  assert_int_equal(sg__lh_prune(st, T0 + MS(60000), 60000), 21);
  assert_int_equal(sg__lh_pruned_total(st), 21);
  assert_int_equal(sg__lh_heartbeat_count(st), 5);
  assert_true(has_heartbeat(st, "a")); /* previous quorum */
  assert_true(has_heartbeat(st, "b"));
  assert_true(has_heartbeat(st, "p")); /* participant */
  assert_true(has_heartbeat(st, "old2"));
  assert_true(has_heartbeat(st, "fresh"));
  assert_false(has_heartbeat(st, "old1"));
  assert_int_equal(sg__lh_prune(st, T0 + MS(60000), 60000), 0);
  assert_int_equal(sg__lh_prune(st, T0 + MS(60001), 60000), 1);
  assert_false(has_heartbeat(st, "old2"));
  assert_int_equal(sg__lh_pruned_total(st), 22);
  /* pruned ids can come back; the rest still work after the deletions */
  hb(st, "old1", T0 + MS(60002));
  assert_true(has_heartbeat(st, "old1"));
  assert_int_equal(sg__lh_prune(NULL, T0, 0), 0);
  sg__lh_state_free(st);
}

static void test_max_replicas(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(2);
  hb(st, "a", T0);
  join(st, "b", T0);
  assert_int_equal(sg__lh_heartbeat(st, "c", T0), SG_ETOOBIG);
  sg__lh_member_t m = member("c", 0, 0, 0);
  assert_int_equal(sg__lh_join(st, &m, T0), SG_ETOOBIG);
  assert_int_equal(sg__lh_heartbeat_count(st), 2);
  assert_int_equal(sg__lh_participant_count(st), 1);
  /* known ids still work */
  hb(st, "b", T0 + 1);
  join(st, "a", T0 + 1);
  join(st, "b", T0 + 1);
  assert_int_equal(sg__lh_participant_count(st), 2);
  /* room again after a replica is gone */
  assert_int_equal(sg__lh_mark_dead(st, "a"), 0);
  assert_int_equal(sg__lh_join(st, &m, T0 + 2), 0);
  assert_int_equal(sg__lh_heartbeat(st, "d", T0), SG_ETOOBIG);
  sg__lh_state_free(st);
}

/* Random joins, leaves, heartbeats and deaths against a naive model. */
static void test_index_against_model(void **state) {
  (void)state;
  enum { N = 300 };
  sg__lh_state_t *st = new_state(N);
  int part[N] = {0}, beat[N] = {0};
  uint64_t rng = 0x9e3779b97f4a7c15u;
  for (int step = 0; step < 20000; step++) {
    rng = rng * 6364136223846793005u + 1442695040888963407u;
    int id = (int)((rng >> 33) % N), op = (int)((rng >> 20) % 4);
    char name[24];
    snprintf(name, sizeof(name), "replica-%d", id);
    if (op == 0) {
      join(st, name, T0);
      part[id] = beat[id] = 1;
    } else if (op == 1) {
      assert_int_equal(sg__lh_leave(st, name), part[id] ? 0 : SG_ENOTFOUND);
      part[id] = 0;
    } else if (op == 2) {
      hb(st, name, T0);
      beat[id] = 1;
    } else {
      assert_int_equal(sg__lh_mark_dead(st, name),
                       beat[id] || part[id] ? 0 : SG_ENOTFOUND);
      part[id] = beat[id] = 0;
    }
    if (step % 1000 == 0 || step == 19999) {
      size_t np = 0, nb = 0;
      for (int i = 0; i < N; i++) {
        snprintf(name, sizeof(name), "replica-%d", i);
        assert_int_equal(sg__lh_is_participant(st, name), part[i]);
        assert_int_equal(has_heartbeat(st, name), beat[i]);
        np += (size_t)part[i];
        nb += (size_t)beat[i];
      }
      assert_int_equal(sg__lh_participant_count(st), np);
      assert_int_equal(sg__lh_heartbeat_count(st), nb);
    }
  }
  sg__lh_state_free(st);
}

/* ---- allocation failure torture ------------------------------------------
 */

/* snapshot: every observable bit of the state as text (libc memory only,
 * so the failure injector is not disturbed). */
static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *snapshot(const sg__lh_state_t *st) {
  size_t nh = sg__lh_heartbeat_count(st), np = sg__lh_participant_count(st);
  char **lines = calloc(nh + np + 1, sizeof(*lines));
  size_t nl = 0;
  assert_non_null(lines);
  for (size_t i = 0; i < nh; i++) {
    const char *id;
    int64_t last;
    assert_int_equal(sg__lh_heartbeat_at(st, i, &id, &last), 0);
    lines[nl] = malloc(256);
    snprintf(lines[nl++], 256, "hb %s %lld", id, (long long)last);
  }
  for (size_t i = 0; i < np; i++) {
    int64_t j;
    const sg__lh_member_t *m = sg__lh_participant_at(st, i, &j);
    lines[nl] = malloc(512);
    snprintf(lines[nl++], 512, "part %s %lld %s %s %s %lld %llu %lld %d",
             m->replica_id, (long long)j, m->address, m->store_address, m->data,
             (long long)m->step, (unsigned long long)m->world_size,
             (long long)m->commit_failures, m->shrink_only);
  }
  qsort(lines, nl, sizeof(*lines), cmp_str);
  size_t cap = 1 << 16, len = 0;
  char *out = malloc(cap);
  assert_non_null(out);
  len += (size_t)snprintf(out + len, cap - len, "id=%lld pruned=%zu\n",
                          (long long)sg__lh_quorum_id(st),
                          sg__lh_pruned_total(st));
  const sg__lh_quorum_t *q = sg__lh_prev_quorum(st);
  if (q) {
    len += (size_t)snprintf(out + len, cap - len,
                            "prev %lld %lld:", (long long)q->quorum_id,
                            (long long)q->created_wall_ns);
    for (size_t i = 0; i < q->n; i++)
      len += (size_t)snprintf(
          out + len, cap - len, " %s/%lld/%s", q->members[i].replica_id,
          (long long)q->members[i].step, q->members[i].address);
    len += (size_t)snprintf(out + len, cap - len, "\n");
  }
  for (size_t i = 0; i < nl; i++) {
    len += (size_t)snprintf(out + len, cap - len, "%s\n", lines[i]);
    free(lines[i]);
  }
  free(lines);
  assert_true(len < cap);
  return out;
}

enum { OP_HB, OP_JOIN, OP_TICK, OP_DECIDE };
typedef struct op_s {
  int kind;
  const char *id;
  int64_t at_ms;
  int64_t step;
  int shrink;
  int64_t cf;
} op_t;

static const op_t OPS[] = {
    {OP_HB, "x", 0, 0, 0, 0},        {OP_JOIN, "a", 1, 0, 0, 0},
    {OP_JOIN, "b", 1, 0, 0, 0},      {OP_JOIN, "a", 2, 3, 0, 0},
    {OP_DECIDE, NULL, 2, 0, 0, 0},   {OP_TICK, NULL, 2, 0, 0, 0},
    {OP_TICK, NULL, 200, 0, 0, 0},   {OP_JOIN, "c", 201, 0, 0, 0},
    {OP_JOIN, "d", 201, 0, 0, 0},    {OP_JOIN, "e", 201, 0, 0, 0},
    {OP_JOIN, "f", 201, 0, 0, 0},    {OP_JOIN, "g", 201, 0, 0, 0},
    {OP_JOIN, "h", 201, 0, 0, 0},    {OP_JOIN, "i", 201, 0, 0, 0},
    {OP_JOIN, "j", 201, 0, 0, 0},    {OP_HB, "k", 201, 0, 0, 0},
    {OP_JOIN, "b", 202, 1, 1, 0},    {OP_JOIN, "a", 202, 1, 0, 1},
    {OP_DECIDE, NULL, 202, 0, 0, 0}, {OP_TICK, NULL, 202, 0, 0, 0},
    {OP_JOIN, "a", 203, 2, 0, 0},    {OP_JOIN, "b", 203, 2, 0, 0},
    {OP_TICK, NULL, 400, 0, 0, 0},   {OP_HB, "x", 401, 0, 0, 0},
};
#define NOPS (sizeof(OPS) / sizeof(OPS[0]))

static int run_op(sg__lh_state_t *st, const op_t *op) {
  int64_t now = T0 + MS(op->at_ms);
  if (op->kind == OP_HB)
    return sg__lh_heartbeat(st, op->id, now);
  if (op->kind == OP_JOIN) {
    sg__lh_member_t m = member(op->id, op->step, op->shrink, op->cf);
    return sg__lh_join(st, &m, now);
  }
  if (op->kind == OP_TICK) {
    const sg__lh_quorum_t *q = NULL;
    char reason[512];
    return sg__lh_tick(st, now, now, &DEFAULT_OPTS, &q, reason, sizeof(reason));
  }
  sg__lh_decision_t d;
  int rc = sg__lh_decide(st, now, &DEFAULT_OPTS, &d);
  sg__lh_decision_free(&d);
  return rc;
}

/* reference_run: the results and final snapshot with no failures. */
static char *reference_run(int *rcs) {
  sg__lh_state_t *st = new_state(64);
  for (size_t i = 0; i < NOPS; i++) {
    rcs[i] = run_op(st, &OPS[i]);
    assert_true(rcs[i] >= 0);
  }
  char *snap = snapshot(st);
  sg__lh_state_free(st);
  return snap;
}

static void test_alloc_failure_each_in_turn(void **state) {
  (void)state;
  int want[NOPS];
  char *final = reference_run(want);
  assert_non_null(strstr(final, "prev 3 "));
  long n;
  for (n = 1;; n++) {
    sg__lh_state_t *st = NULL;
    int failures_seen = 0;
    sg_test_fail_alloc(n, 0);
    int rc = sg__lh_state_new(64, &st);
    if (rc) {
      assert_int_equal(rc, SG_ENOMEM);
      assert_null(st);
      failures_seen++;
      st = new_state(64);
    }
    for (size_t i = 0; i < NOPS; i++) {
      char *before = snapshot(st);
      rc = run_op(st, &OPS[i]);
      if (rc == SG_ENOMEM) {
        failures_seen++;
        char *after = snapshot(st);
        assert_string_equal(before, after);
        free(after);
        rc = run_op(st, &OPS[i]); /* the injector fired once; retry */
      }
      assert_int_equal(rc, want[i]);
      free(before);
    }
    long hits = sg_test_fail_alloc(0, 0);
    assert_int_equal(failures_seen, hits); /* no failure was swallowed */
    char *snap = snapshot(st);
    assert_string_equal(snap, final);
    free(snap);
    sg__lh_state_free(st);
    if (hits == 0)
      break; /* n is past the last allocation of the sequence */
  }
  assert_true(n > 20);
  free(final);
}

static void test_alloc_failure_sticky(void **state) {
  (void)state;
  int want[NOPS];
  char *final = reference_run(want);
  for (long n = 1; n < 200; n++) {
    sg__lh_state_t *st = new_state(64);
    sg_test_fail_alloc(n, 1);
    int failed = 0;
    for (size_t i = 0; i < NOPS && !failed; i++) {
      char *before = snapshot(st);
      int rc = run_op(st, &OPS[i]);
      if (rc == SG_ENOMEM) {
        char *after = snapshot(st);
        assert_string_equal(before, after);
        free(after);
        failed = 1;
      } else {
        assert_int_equal(rc, want[i]);
      }
      free(before);
    }
    sg_test_fail_alloc(0, 0);
    /* the state is still usable after the failures */
    if (failed) {
      join(st, "after", T0 + MS(1000));
      assert_true(sg__lh_is_participant(st, "after"));
    }
    sg__lh_state_free(st);
  }
  free(final);
}

/* ---- scale -----------------------------------------------------------------
 */

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the decision against a plain model ------------------------------------
 *
 * The state keeps indexes (a participant's heartbeat record, its place in
 * the previous quorum) that must follow every move of the dense arrays, and
 * orders candidates by those indexes.  A model with plain arrays and one
 * string sort per decision (torchft's rules, 2.3-2.4, with our retained
 * participants) is driven through the same random operations, heartbeats
 * expiring and records moving under prune and mark_dead, and the decision,
 * its reason, the members' order and the quorum id must agree throughout.
 */

enum { MODEL_IDS = 24 };

typedef struct model_s {
  int beat[MODEL_IDS];
  int64_t last[MODEL_IDS];
  int part[MODEL_IDS];
  int64_t joined[MODEL_IDS];
  int shrink[MODEL_IDS];
  int64_t cf[MODEL_IDS];
  int has_prev;
  int prev[MODEL_IDS]; /* membership of the previous quorum */
  int64_t quorum_id;
} model_t;

/* model ids sort like their names: "m00".."m23" */
static void model_name(int i, char *out, size_t len) {
  snprintf(out, len, "m%02d", i);
}

/* model_decide: met (0/1), the reason and the candidates in order. */
static int model_decide(const model_t *m, int64_t now, const sg__lh_opts_t *o,
                        char *reason, size_t rlen, int *cand, int *ncand) {
  int64_t hb_ns = MS(o->heartbeat_timeout_ms), join_ns = MS(o->join_timeout_ms);
  size_t hr = 0, healthy = 0, nparts = 0;
  int shrink = 0, have_first = 0;
  int64_t first = now;
  for (int i = 0; i < MODEL_IDS; i++) {
    int alive = m->beat[i] && now - m->last[i] < hb_ns;
    hr += (size_t)alive;
    nparts += (size_t)m->part[i];
    if (m->part[i] && alive) {
      healthy++;
      shrink |= m->shrink[i];
      if (!have_first || m->joined[i] < first)
        first = m->joined[i];
      have_first = 1;
    }
  }
  char meta[160];
  snprintf(meta, sizeof(meta),
           "[%zu/%zu participants healthy][%zu heartbeating][shrink_only=%s]",
           healthy, nparts, hr, shrink ? "true" : "false");
  int met = 0;
  if (m->has_prev) {
    met = 1;
    for (int i = 0; i < MODEL_IDS; i++)
      if (m->prev[i] && !(m->part[i] && m->beat[i] && now - m->last[i] < hb_ns))
        met = 0;
  }
  if (met) {
    snprintf(reason, rlen, "Fast quorum found! %s", meta);
  } else if ((int64_t)healthy < o->min_replicas) {
    snprintf(reason, rlen,
             "New quorum not ready, only have %zu participants, need "
             "min_replicas %lld %s",
             healthy, (long long)o->min_replicas, meta);
    return 0;
  } else if (healthy <= hr / 2) {
    snprintf(reason, rlen,
             "New quorum not ready, only have %zu participants, need at "
             "least half of %zu healthy workers %s",
             healthy, hr, meta);
    return 0;
  } else if (healthy != hr && now - first < join_ns) {
    snprintf(reason, rlen,
             "Valid quorum with %zu participants, waiting for %zu healthy "
             "but not participating stragglers due to join timeout %s",
             healthy, hr - healthy, meta);
    return 0;
  } else {
    snprintf(reason, rlen, "Valid quorum found %s", meta);
  }
  *ncand = 0;
  for (int i = 0; i < MODEL_IDS; i++) /* index order is name order */
    if (m->part[i] && m->beat[i] && now - m->last[i] < hb_ns &&
        !(m->has_prev && shrink && !m->prev[i]))
      cand[(*ncand)++] = i;
  return 1;
}

static void model_tick(model_t *m, int64_t now, const sg__lh_opts_t *o) {
  char reason[512];
  int cand[MODEL_IDS], n = 0;
  if (!model_decide(m, now, o, reason, sizeof(reason), cand, &n))
    return;
  int in[MODEL_IDS] = {0};
  for (int k = 0; k < n; k++)
    in[cand[k]] = 1;
  int changed = !m->has_prev, failures = 0;
  for (int i = 0; i < MODEL_IDS; i++) {
    changed |= m->has_prev && in[i] != m->prev[i];
    failures |= in[i] && m->cf[i] > 0;
  }
  if (changed || failures)
    m->quorum_id++;
  for (int i = 0; i < MODEL_IDS; i++) {
    m->prev[i] = in[i];
    if (in[i])
      m->part[i] = 0;
    else if (m->part[i])
      m->joined[i] = now;
  }
  m->has_prev = 1;
}

static void expect_same_decision(const sg__lh_state_t *st, const model_t *m,
                                 int64_t now, const sg__lh_opts_t *o) {
  char want[512], name[16];
  int cand[MODEL_IDS], n = 0;
  int met = model_decide(m, now, o, want, sizeof(want), cand, &n);
  sg__lh_decision_t d;
  assert_int_equal(sg__lh_decide(st, now, o, &d), 0);
  assert_string_equal(d.reason, want);
  assert_int_equal(d.met, met);
  if (!sg__lh_may_meet(st, o)) /* its shortcut never hides a quorum */
    assert_false(met);
  if (met) {
    assert_int_equal(d.n, (size_t)n);
    for (int k = 0; k < n; k++) {
      model_name(cand[k], name, sizeof(name));
      assert_string_equal(d.members[k]->replica_id, name);
    }
  }
  sg__lh_decision_free(&d);
}

static void test_decision_against_model(void **state) {
  (void)state;
  sg__lh_state_t *st = new_state(MODEL_IDS);
  model_t m;
  memset(&m, 0, sizeof(m));
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = 3;
  o.heartbeat_timeout_ms = 50;
  o.join_timeout_ms = 20;
  uint64_t rng = 0x2545f4914f6cdd1du;
  int64_t now = T0;
  int quorums = 0, fast = 0, mixed = 0, skippable = 0;
  for (int step = 0; step < 40000; step++) {
    rng = rng * 6364136223846793005u + 1442695040888963407u;
    int id = (int)((rng >> 33) % MODEL_IDS), op = (int)((rng >> 24) % 16);
    char name[16];
    model_name(id, name, sizeof(name));
    now += MS((int64_t)((rng >> 40) % 4)); /* 0-3 ms per operation */
    if (op < 6) { /* join, now and then shrink_only or failing */
      int shrink = (rng >> 50) % 23 == 0;
      int64_t cf = (rng >> 45) % 13 == 0;
      join_ex(st, name, now, step, shrink, cf);
      m.beat[id] = m.part[id] = 1;
      m.last[id] = now;
      m.joined[id] = now; /* every request resets it (2.2) */
      m.shrink[id] = shrink;
      m.cf[id] = cf;
    } else if (op < 9) {
      hb(st, name, now);
      m.beat[id] = 1;
      m.last[id] = now;
    } else if (op == 9) {
      assert_int_equal(sg__lh_leave(st, name), m.part[id] ? 0 : SG_ENOTFOUND);
      m.part[id] = 0;
    } else if (op == 10) {
      assert_int_equal(sg__lh_mark_dead(st, name),
                       m.beat[id] || m.part[id] ? 0 : SG_ENOTFOUND);
      m.beat[id] = m.part[id] = 0;
    } else if (op == 11) {
      size_t want = 0;
      for (int i = 0; i < MODEL_IDS; i++)
        if (m.beat[i] && now - m.last[i] >= MS(30) && !m.part[i] &&
            !(m.has_prev && m.prev[i])) {
          m.beat[i] = 0;
          want++;
        }
      assert_int_equal(sg__lh_prune(st, now, 30), want);
    } else if (op == 12) {
      now += MS(40); /* let heartbeats expire */
    } else {
      int before_fast = m.has_prev;
      for (int i = 0; i < MODEL_IDS && before_fast; i++)
        if (m.prev[i] && !(m.part[i] && m.beat[i] &&
                           now - m.last[i] < MS(o.heartbeat_timeout_ms)))
          before_fast = 0;
      expect_same_decision(st, &m, now, &o);
      const sg__lh_quorum_t *q = tick(st, now, &o, NULL, 0);
      int64_t id_before = m.quorum_id;
      int had = m.has_prev;
      model_tick(&m, now, &o);
      if (q) {
        quorums++;
        fast += before_fast;
        int members = 0;
        for (size_t k = 0; k < q->n; k++)
          assert_true(m.prev[atoi(q->members[k].replica_id + 1)]);
        for (int i = 0; i < MODEL_IDS; i++)
          members += m.prev[i];
        assert_int_equal((int)q->n, members);
        mixed += had && q->n > 0;
        assert_int_equal(q->quorum_id, m.quorum_id);
        if (step % 7 == 0)
          sg__lh_free_retired(st);
      } else {
        assert_int_equal(m.quorum_id, id_before);
      }
    }
    expect_same_decision(st, &m, now, &o);
    skippable += !sg__lh_may_meet(st, &o);
    assert_int_equal(sg__lh_quorum_id(st), m.quorum_id);
    for (int i = 0; i < MODEL_IDS; i++) {
      model_name(i, name, sizeof(name));
      assert_int_equal(sg__lh_is_participant(st, name), m.part[i]);
      assert_int_equal(sg__lh_is_member(st, name), m.has_prev && m.prev[i]);
      assert_int_equal(sg__lh_is_healthy(st, name, now, &o),
                       m.beat[i] && now - m.last[i] < MS(50));
    }
  }
  /* the walk reached the interesting cases */
  print_message("model: %d quorums, %d fast, %d after a previous one, "
                "%d states where the decision could be skipped\n",
                quorums, fast, mixed, skippable);
  assert_true(quorums > 100 && fast > 10 && mixed > 50 && skippable > 100);
  sg__lh_state_free(st);
}

static void test_1000_replicas(void **state) {
  (void)state;
  enum { N = 1000 };
  sg__lh_state_t *st = new_state(N);
  char id[32];
  /* ids joined in a scrambled order */
  for (int i = 0; i < N; i++) {
    snprintf(id, sizeof(id), "replica-%04d:uuid", (i * 617) % N);
    join(st, id, T0 + i);
  }
  sg__lh_opts_t o = DEFAULT_OPTS;
  o.min_replicas = N;
  sg__lh_decision_t d;
  const int reps = 200;
  int64_t t = mono_ns();
  for (int r = 0; r < reps; r++) {
    assert_int_equal(sg__lh_decide(st, T0 + N, &o, &d), 0);
    if (r < reps - 1)
      sg__lh_decision_free(&d);
  }
  t = mono_ns() - t;
  print_message("decide() with %d replicas: %.1f us (mean of %d)\n", N,
                (double)t / reps / 1000.0, reps);
  assert_true(d.met);
  assert_int_equal(d.n, N);
  assert_string_equal(d.reason, "Valid quorum found [1000/1000 participants "
                                "healthy][1000 heartbeating][shrink_only="
                                "false]");
  for (int i = 0; i < N; i++) {
    snprintf(id, sizeof(id), "replica-%04d:uuid", i);
    assert_string_equal(d.members[i]->replica_id, id);
  }
  sg__lh_decision_free(&d);

  const sg__lh_quorum_t *q = tick(st, T0 + N, &o, NULL, 0);
  assert_non_null(q);
  assert_int_equal(q->n, N);
  assert_int_equal(sg__lh_participant_count(st), 0);
  /* everyone but one rejoins: no fast quorum, min_replicas blocks */
  for (int i = 1; i < N; i++) {
    snprintf(id, sizeof(id), "replica-%04d:uuid", i);
    join(st, id, T0 + MS(1));
  }
  expect_reason(st, T0 + MS(1), &o, 0,
                "New quorum not ready, only have 999 participants, need "
                "min_replicas 1000 [999/999 participants healthy][1000 "
                "heartbeating][shrink_only=false]");
  join(st, "replica-0000:uuid", T0 + MS(1));
  t = mono_ns();
  q = tick(st, T0 + MS(1), &o, NULL, 0);
  t = mono_ns() - t;
  print_message("tick() with %d replicas: %.1f us\n", N, (double)t / 1000.0);
  assert_non_null(q);
  assert_int_equal(q->quorum_id, 1);
  assert_int_equal(q->n, N);
  assert_int_equal(sg__lh_next_deadline(st, T0 + MS(1), &o),
                   T0 + MS(1) + MS(5000));
  sg__lh_state_free(st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_state_new_and_args),
      cmocka_unit_test(test_member_copy_is_deep_and_fills_nulls),
      cmocka_unit_test(test_first_quorum_is_id_1_and_copies_members),
      cmocka_unit_test(test_heartbeat_boundary_is_strict),
      cmocka_unit_test(test_is_healthy_matches_the_decision),
      cmocka_unit_test(test_min_replicas),
      cmocka_unit_test(test_split_brain_integer_division),
      cmocka_unit_test(test_join_timeout_waits_then_expires),
      cmocka_unit_test(test_all_joined_does_not_wait),
      cmocka_unit_test(test_fast_quorum_bypasses_other_rules),
      cmocka_unit_test(test_fast_quorum_admits_extra_joiners),
      cmocka_unit_test(test_fast_quorum_needs_every_prev_member_healthy),
      cmocka_unit_test(test_shrink_only_excludes_new_joiners),
      cmocka_unit_test(test_shrink_only_on_the_slow_path),
      cmocka_unit_test(test_shrink_only_without_prev_quorum_filters_nothing),
      cmocka_unit_test(test_shrink_only_can_issue_an_empty_quorum),
      cmocka_unit_test(test_quorum_id_bump_rules),
      cmocka_unit_test(test_quorum_id_floor),
      cmocka_unit_test(test_restart_waits_for_last_quorum_members),
      cmocka_unit_test(test_step_floor_holds_a_quorum_that_starts_over),
      cmocka_unit_test(test_step_floor_wait_is_bounded),
      cmocka_unit_test(test_ids_sort_in_byte_order),
      cmocka_unit_test(test_leave),
      cmocka_unit_test(test_mark_dead_and_rejoin),
      cmocka_unit_test(test_pending_unincluded_participants_are_retained),
      cmocka_unit_test(test_next_deadline),
      cmocka_unit_test(test_decision_against_model),
      cmocka_unit_test(test_prune),
      cmocka_unit_test(test_max_replicas),
      cmocka_unit_test(test_index_against_model),
      cmocka_unit_test(test_alloc_failure_each_in_turn),
      cmocka_unit_test(test_alloc_failure_sticky),
      cmocka_unit_test(test_1000_replicas),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
