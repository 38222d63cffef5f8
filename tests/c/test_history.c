/*
 * test_history.c: the lighthouse's bounded recent past (src/lighthouse/
 * history.c): quorum changes with their joined and left members, failures
 * with their reasons (seen down early, or left out), heals, membership
 * spans, step rates, the time window, long ids, a quorum larger than the
 * replica table, and fixed memory over thousands of changes (no
 * allocation at all, rings at their capacity, the newest entries kept).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lighthouse/history.h"
#include "stepguard/base.h"

#define MS(x) ((int64_t)(x)*1000000)
#define T0 ((int64_t)1000000000000) /* an arbitrary monotonic origin */
#define MAXQ 200

/* A quorum built on the stack: ids in idbuf, members pointing into it. */
typedef struct {
  sg__lh_quorum_t q;
  sg__lh_member_t m[MAXQ];
  char idbuf[MAXQ][160];
} tq_t;

/* mkq: quorum `qid` of "id:step" items, comma-separated ("" for none). */
static void mkq(tq_t *t, int64_t qid, const char *spec) {
  memset(t, 0, sizeof(*t));
  t->q.quorum_id = qid;
  t->q.members = t->m;
  char tmp[4096];
  snprintf(tmp, sizeof(tmp), "%s", spec);
  char *save = NULL;
  for (char *tok = strtok_r(tmp, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    char *colon = strrchr(tok, ':');
    assert_non_null(colon);
    *colon = '\0';
    assert_true(t->q.n < MAXQ);
    snprintf(t->idbuf[t->q.n], sizeof(t->idbuf[0]), "%s", tok);
    t->m[t->q.n].replica_id = t->idbuf[t->q.n];
    t->m[t->q.n].step = atoll(colon + 1);
    t->q.n++;
  }
}

static void record(sg__lh_history_t *h, int64_t now, int64_t qid,
                   const char *spec, sg__lh_why_cb why, void *ud) {
  tq_t *t = malloc(sizeof(*t));
  assert_non_null(t);
  mkq(t, qid, spec);
  sg__lh_history_quorum(h, now, &t->q, why, ud);
  free(t);
}

static sg__lh_history_t *new_history(int64_t window_ms) {
  sg__lh_history_t *h = malloc(sizeof(*h));
  assert_non_null(h);
  sg__lh_history_init(h, window_ms);
  return h;
}

static const sg__lh_hreplica_t *replica(const sg__lh_history_t *h,
                                        const char *id) {
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++)
    if (h->replicas[i].used && strcmp(h->replicas[i].id.s, id) == 0)
      return &h->replicas[i];
  return NULL;
}

static size_t tracked(const sg__lh_history_t *h) {
  size_t n = 0;
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++)
    n += h->replicas[i].used != 0;
  return n;
}

static const char *why_hb(void *ud, const char *id) {
  (*(int *)ud)++;
  return strcmp(id, "b") == 0 ? "heartbeat timed out" : NULL;
}

/* ---- tests ---------------------------------------------------------------
 */

static void test_first_quorum_is_a_change_with_every_member_joined(void **st) {
  sg__lh_history_t *h = new_history(0);
  assert_int_equal(h->window_ns, MS(SG__LH_HISTORY_WINDOW_MS));
  record(h, T0, 1, "a:0,b:0,c:0", NULL, NULL);
  assert_int_equal(h->n_changes, 1);
  const sg__lh_hchange_t *c = sg__lh_history_change(h, 0);
  assert_int_equal(c->quorum_id, 1);
  assert_int_equal(c->n_members, 3);
  assert_int_equal(c->n_joined, 3);
  assert_int_equal(c->n_left, 0);
  assert_string_equal(c->joined[0].s, "a");
  assert_string_equal(c->joined[2].s, "c");
  assert_int_equal(h->n_failures, 0);
  assert_int_equal(h->n_heals, 0);
  const sg__lh_hreplica_t *r = replica(h, "b");
  assert_non_null(r);
  assert_true(r->member);
  assert_int_equal(r->n_spans, 1);
  assert_int_equal(sg__lh_history_span(r, 0)->start_ns, T0);
  assert_int_equal(sg__lh_history_span(r, 0)->end_ns, -1);
  free(h);
}

static void test_step_rate_from_samples_once_a_second(void **st) {
  sg__lh_history_t *h = new_history(0);
  /* 10 steps a second for 20 s: a quorum of the same id every step */
  for (int step = 0; step <= 200; step++) {
    char spec[64];
    snprintf(spec, sizeof(spec), "a:%d,b:%d", step, step / 2);
    record(h, T0 + MS(100) * step, 7, spec, NULL, NULL);
  }
  assert_int_equal(h->n_changes, 1); /* one id: one change */
  const sg__lh_hreplica_t *a = replica(h, "a"), *b = replica(h, "b");
  /* one sample a second, the ring keeps the last SAMPLES */
  assert_int_equal(a->n_samples, SG__LH_HISTORY_SAMPLES);
  for (size_t i = 1; i < a->n_samples; i++)
    assert_true(sg__lh_history_sample(a, i)->t_ns -
                    sg__lh_history_sample(a, i - 1)->t_ns >=
                MS(SG__LH_HISTORY_SAMPLE_MS));
  int64_t win = 0;
  double ra = sg__lh_history_rate(a, &win), rb = sg__lh_history_rate(b, NULL);
  assert_true(ra > 9.9 && ra < 10.1);
  assert_true(rb > 4.9 && rb < 5.1);
  assert_int_equal(win, MS(1000) * (SG__LH_HISTORY_SAMPLES - 1));
  assert_int_equal(a->step, 200);
  free(h);
}

static void test_lost_member_is_a_failure_with_its_reason(void **st) {
  sg__lh_history_t *h = new_history(0);
  int calls = 0;
  record(h, T0, 1, "a:5,b:5,c:5", why_hb, &calls);
  record(h, T0 + MS(2000), 2, "a:6", why_hb, &calls);
  assert_int_equal(calls, 2); /* b and c, each once */
  assert_int_equal(h->n_changes, 2);
  const sg__lh_hchange_t *c = sg__lh_history_change(h, 1);
  assert_int_equal(c->n_left, 2);
  assert_int_equal(c->n_joined, 0);
  assert_string_equal(c->left[0].s, "b");
  assert_int_equal(h->n_failures, 2);
  const sg__lh_hfailure_t *f = sg__lh_history_failure(h, 0);
  assert_string_equal(f->id.s, "b");
  assert_string_equal(f->reason, "heartbeat timed out");
  assert_int_equal(f->quorum_id, 1); /* lost from quorum 1 */
  assert_int_equal(f->step, 5);
  assert_int_equal(f->t_ns, T0 + MS(2000));
  assert_string_equal(sg__lh_history_failure(h, 1)->reason, ""); /* unknown */
  const sg__lh_hreplica_t *b = replica(h, "b");
  assert_false(b->member);
  assert_int_equal(sg__lh_history_span(b, 0)->end_ns, T0 + MS(2000));
  free(h);
}

static void test_down_records_once_and_early(void **st) {
  sg__lh_history_t *h = new_history(0);
  int calls = 0;
  record(h, T0, 1, "a:5,b:5", why_hb, &calls);
  sg__lh_history_down(h, T0 + MS(100), "b", "connection closed");
  sg__lh_history_down(h, T0 + MS(150), "b", "again");  /* once */
  sg__lh_history_down(h, T0 + MS(150), "zz", "ghost"); /* not a member */
  sg__lh_history_down(h, T0 + MS(150), NULL, "null");  /* ignored */
  assert_int_equal(h->n_failures, 1);
  assert_int_equal(sg__lh_history_failure(h, 0)->t_ns, T0 + MS(100));
  record(h, T0 + MS(300), 2, "a:6", why_hb, &calls);
  assert_int_equal(calls, 0); /* b's reason was known already */
  assert_int_equal(h->n_failures, 1);
  assert_string_equal(sg__lh_history_failure(h, 0)->reason,
                      "connection closed");
  /* back, then down again: a second failure */
  record(h, T0 + MS(400), 3, "a:7,b:7", why_hb, &calls);
  sg__lh_history_down(h, T0 + MS(500), "b", "killed");
  assert_int_equal(h->n_failures, 2);
  assert_int_equal(h->failures_total, 2);
  free(h);
}

static void test_rejoin_behind_max_step_is_a_heal(void **st) {
  sg__lh_history_t *h = new_history(0);
  record(h, T0, 1, "a:10,b:10", NULL, NULL);
  record(h, T0 + MS(1000), 2, "a:11", NULL, NULL);
  record(h, T0 + MS(2000), 3, "a:20,b:3", NULL, NULL);       /* b heals */
  record(h, T0 + MS(2500), 4, "a:21,b:21,c:21", NULL, NULL); /* c joins level */
  assert_int_equal(h->n_heals, 1);
  const sg__lh_hheal_t *e = sg__lh_history_heal(h, 0);
  assert_string_equal(e->id.s, "b");
  assert_int_equal(e->step, 3);
  assert_int_equal(e->max_step, 20);
  assert_int_equal(e->quorum_id, 3);
  assert_int_equal(sg__lh_history_change(h, 2)->n_heals, 1);
  assert_int_equal(sg__lh_history_change(h, 3)->n_heals, 0);
  assert_int_equal(sg__lh_history_change(h, 3)->n_joined, 1);
  const sg__lh_hreplica_t *b = replica(h, "b");
  assert_int_equal(b->n_spans, 2);
  /* b's rate starts after the heal: 3 -> 21 is not a step rate */
  for (int i = 1; i <= 10; i++) {
    char spec[64];
    snprintf(spec, sizeof(spec), "a:%d,b:%d,c:%d", 21 + i, 21 + i, 21 + i);
    record(h, T0 + MS(2500) + MS(1000) * i, 4, spec, NULL, NULL);
  }
  double rb = sg__lh_history_rate(replica(h, "b"), NULL);
  assert_true(rb > 0.99 && rb < 1.01);
  free(h);
}

static void test_window_drops_old_entries_and_replicas(void **st) {
  sg__lh_history_t *h = new_history(60000); /* one minute */
  record(h, T0, 1, "a:0,b:0", NULL, NULL);
  record(h, T0 + MS(1000), 2, "a:1", NULL, NULL);
  record(h, T0 + MS(30000), 3, "a:2,c:0", NULL, NULL);
  assert_int_equal(h->n_changes, 3);
  assert_int_equal(h->n_failures, 1);
  sg__lh_history_expire(h, T0 + MS(61500));
  assert_int_equal(h->n_changes, 1); /* quorums 1 and 2 are over a minute */
  assert_int_equal(sg__lh_history_change(h, 0)->quorum_id, 3);
  assert_int_equal(h->n_failures, 0);
  assert_null(replica(h, "b")); /* not a member since then */
  const sg__lh_hreplica_t *a = replica(h, "a");
  assert_non_null(a);
  assert_int_equal(a->n_spans, 1); /* its open span stays */
  sg__lh_history_expire(h, T0 + MS(10 * 60000));
  assert_int_equal(h->n_changes, 0);
  assert_non_null(replica(h, "a")); /* members stay */
  assert_non_null(replica(h, "c"));
  free(h);
}

/* Memory is flat: thousands of changes with fresh ids each time allocate
 * nothing, keep every ring at most at its capacity and keep the newest. */
static void test_memory_is_flat_over_many_changes(void **st) {
  sg__lh_history_t *h = new_history(0);
  const size_t size = sizeof(*h);
  sg_test_fail_alloc(1, 1); /* any allocation from here on would fail */
  const int n = 5000;
  int64_t now = T0;
  for (int i = 1; i <= n; i++) {
    char spec[256];
    /* a steady member, a churning one that leaves and a new one that
     * joins behind (a heal) at every change */
    snprintf(spec, sizeof(spec), "steady:%d,new-%d:%d,old-%d:%d", i * 10, i, i,
             i, i * 10);
    now += MS(50);
    record(h, now, i, spec, NULL, NULL);
    if (i % 7 == 0)
      sg__lh_history_down(h, now + 1, "steady", "flapping");
  }
  assert_int_equal(sg_test_fail_alloc(0, 0), 0); /* none was tried */
  assert_int_equal(sizeof(*h), size);
  assert_int_equal(h->changes_total, n);
  assert_int_equal(h->n_changes, SG__LH_HISTORY_CHANGES);
  assert_int_equal(h->n_failures, SG__LH_HISTORY_EVENTS);
  assert_int_equal(h->n_heals, SG__LH_HISTORY_EVENTS);
  assert_true(h->failures_total >= (uint64_t)n - 1);
  assert_int_equal(h->heals_total, n);
  assert_true(tracked(h) <= SG__LH_HISTORY_REPLICAS);
  /* oldest first, and the newest is the last recorded */
  for (size_t i = 1; i < h->n_changes; i++)
    assert_int_equal(sg__lh_history_change(h, i)->quorum_id,
                     sg__lh_history_change(h, i - 1)->quorum_id + 1);
  assert_int_equal(sg__lh_history_change(h, h->n_changes - 1)->quorum_id, n);
  char want[32];
  snprintf(want, sizeof(want), "new-%d", n);
  assert_string_equal(sg__lh_history_heal(h, h->n_heals - 1)->id.s, want);
  const sg__lh_hreplica_t *s = replica(h, "steady");
  assert_non_null(s);
  assert_true(s->n_spans <= SG__LH_HISTORY_SPANS);
  assert_true(s->n_samples <= SG__LH_HISTORY_SAMPLES);
  free(h);
}

static void test_quorum_larger_than_the_table(void **st) {
  sg__lh_history_t *h = new_history(0);
  char spec[4096] = "";
  size_t off = 0;
  for (int i = 0; i < 100; i++)
    off += (size_t)snprintf(spec + off, sizeof(spec) - off, "%sr%03d:1",
                            i ? "," : "", i);
  record(h, T0, 1, spec, NULL, NULL);
  assert_int_equal(tracked(h), SG__LH_HISTORY_REPLICAS);
  assert_int_equal(h->untracked, 100 - SG__LH_HISTORY_REPLICAS);
  const sg__lh_hchange_t *c = sg__lh_history_change(h, 0);
  assert_int_equal(c->n_members, 100);
  assert_int_equal(c->n_joined, SG__LH_HISTORY_REPLICAS);
  /* a smaller quorum after: the left ones free their slots later */
  record(h, T0 + MS(1000), 2, "r000:2,z:2", NULL, NULL);
  assert_non_null(replica(h, "z"));
  assert_int_equal(h->untracked, 0);
  assert_int_equal(sg__lh_history_change(h, 1)->n_left,
                   SG__LH_HISTORY_REPLICAS - 1);
  free(h);
}

static void test_long_ids_are_cut_on_a_character_and_kept_apart(void **st) {
  sg__lh_history_t *h = new_history(0);
  char a[150], b[150], spec[400];
  memset(a, 'x', 61);
  memcpy(a + 61, "\xc3\xa9", 2); /* e-acute across the cut at 63 bytes */
  memset(a + 63, 'y', 40);
  a[103] = '\0';
  snprintf(b, sizeof(b), "%s", a);
  b[102] = 'z'; /* differs only past the kept prefix */
  snprintf(spec, sizeof(spec), "%s:1,%s:1", a, b);
  record(h, T0, 1, spec, NULL, NULL);
  assert_int_equal(tracked(h), 2);
  const sg__lh_hchange_t *c = sg__lh_history_change(h, 0);
  assert_int_equal(strlen(c->joined[0].s), 63);
  assert_memory_equal(c->joined[0].s + 61, "\xc3\xa9", 2);
  assert_true(c->joined[0].hash != c->joined[1].hash);
  /* the next quorum with only b leaves a out, not b */
  snprintf(spec, sizeof(spec), "%s:2", b);
  record(h, T0 + MS(10), 2, spec, NULL, NULL);
  assert_int_equal(sg__lh_history_change(h, 1)->n_left, 1);
  assert_int_equal(sg__lh_history_change(h, 1)->left[0].hash,
                   c->joined[0].hash);
  /* a cut right after a two-byte character's first byte drops it */
  memset(a, 'x', 62);
  memcpy(a + 62, "\xc3\xa9", 3);
  snprintf(spec, sizeof(spec), "%s:3", a);
  record(h, T0 + MS(20), 3, spec, NULL, NULL);
  assert_int_equal(strlen(sg__lh_history_change(h, 2)->joined[0].s), 62);
  free(h);
}

static void test_copy_is_complete(void **st) {
  sg__lh_history_t *h = new_history(0);
  record(h, T0, 1, "a:1,b:1", NULL, NULL);
  record(h, T0 + MS(10), 2, "a:2", NULL, NULL);
  sg__lh_history_t *copy = malloc(sizeof(*copy));
  assert_non_null(copy);
  memcpy(copy, h, sizeof(*h));
  sg__lh_history_init(h, 0); /* the original overwritten */
  assert_int_equal(copy->n_changes, 2);
  assert_string_equal(sg__lh_history_failure(copy, 0)->id.s, "b");
  assert_int_equal(h->n_changes, 0);
  free(copy);
  free(h);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_first_quorum_is_a_change_with_every_member_joined),
      cmocka_unit_test(test_step_rate_from_samples_once_a_second),
      cmocka_unit_test(test_lost_member_is_a_failure_with_its_reason),
      cmocka_unit_test(test_down_records_once_and_early),
      cmocka_unit_test(test_rejoin_behind_max_step_is_a_heal),
      cmocka_unit_test(test_window_drops_old_entries_and_replicas),
      cmocka_unit_test(test_memory_is_flat_over_many_changes),
      cmocka_unit_test(test_quorum_larger_than_the_table),
      cmocka_unit_test(test_long_ids_are_cut_on_a_character_and_kept_apart),
      cmocka_unit_test(test_copy_is_complete),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
