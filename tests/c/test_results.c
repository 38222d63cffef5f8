/*
 * test_results.c: the manager's pure quorum-results function (src/manager/
 * results.c) against torchft's compute_quorum_results: the worked recovery
 * example seen from every replica and group rank, step-0 init sync on and off,
 * round-robin spreading with many or few sources, group-rank offsets up to
 * INT64_MAX, the primary's store address, max_replica_rank, commit_failures,
 * input order, byte-order ties, not-participating, bad arguments, allocation
 * failure at each allocation, the group-step helper, and a seeded property test
 * against a naive model.
 *
 * Every test frees its results; the ASan build checks for leaks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "manager/results.h"
#include "stepguard/base.h"

#define MAXP 64 /* peers in one hand-built quorum */

/* ---- helpers --------------------------------------------------------------
 */

/* A quorum with its strings held in the struct, so peers can borrow them. */
typedef struct quorum_s {
  size_t n;
  sg__mgr_peer_t p[MAXP];
  char id[MAXP][32];
  char addr[MAXP][48];
  char store[MAXP][48];
} quorum_t;

/* add: append a peer; address "http://<id>", store "store-<id>:29500". */
static size_t add(quorum_t *q, const char *id, int64_t step) {
  size_t i = q->n++;
  assert_true(i < MAXP);
  snprintf(q->id[i], sizeof(q->id[i]), "%s", id);
  snprintf(q->addr[i], sizeof(q->addr[i]), "http://%s", id);
  snprintf(q->store[i], sizeof(q->store[i]), "store-%s:29500", id);
  memset(&q->p[i], 0, sizeof(q->p[i]));
  q->p[i].replica_id = q->id[i];
  q->p[i].address = q->addr[i];
  q->p[i].store_address = q->store[i];
  q->p[i].step = step;
  q->p[i].world_size = 2;
  return i;
}

/* quorum_steps: peers "r0", "r1", ... (sorted as given) at these steps. */
static void quorum_steps(quorum_t *q, const int64_t *steps, size_t n) {
  memset(q, 0, sizeof(*q));
  for (size_t i = 0; i < n; i++) {
    char id[16];
    snprintf(id, sizeof(id), "r%zu", i);
    add(q, id, steps[i]);
  }
}

/* compute: sg__mgr_compute_results that must succeed. */
static sg__mgr_results_t compute(const quorum_t *q, const char *id,
                                 int64_t group_rank, int init_sync) {
  sg__mgr_results_t r;
  sg_err_t err;
  int rc = sg__mgr_compute_results(7, q->p, q->n, id, group_rank, init_sync, &r,
                                   &err);
  if (rc)
    fail_msg("compute(%s, %lld): %s %s", id, (long long)group_rank,
             sg_err_name(rc), err.msg);
  assert_int_equal(err.code, 0);
  assert_int_equal(r.quorum_id, 7);
  return r;
}

/* expect_dst: the recover_dst list is exactly want[0 .. n-1]. */
static void expect_dst(const sg__mgr_results_t *r, const int64_t *want,
                       size_t n) {
  assert_int_equal(r->n_recover_dst, n);
  if (n == 0)
    assert_null(r->recover_dst_replica_ranks);
  for (size_t i = 0; i < n; i++)
    assert_int_equal(r->recover_dst_replica_ranks[i], want[i]);
}

/* expect_src: heal with source `src` (or no heal when src < 0), with the
 * source's manager address. */
static void expect_src(const quorum_t *q, const sg__mgr_results_t *r,
                       int64_t src) {
  if (src < 0) {
    assert_int_equal(r->heal, 0);
    assert_int_equal(r->has_recover_src_replica_rank, 0);
    assert_int_equal(r->recover_src_replica_rank, 0);
    assert_string_equal(r->recover_src_manager_address, "");
    return;
  }
  assert_int_equal(r->heal, 1);
  assert_int_equal(r->has_recover_src_replica_rank, 1);
  assert_int_equal(r->recover_src_replica_rank, src);
  /* replica_ids[src] names the source; its address is "http://<id>" */
  char want[64];
  snprintf(want, sizeof(want), "http://%s", r->replica_ids[src]);
  assert_string_equal(r->recover_src_manager_address, want);
  (void)q;
}

/* ---- the worked example ---------------------------------------------------
 */

/*
 * Steps [0,1,0,1,0]: up_to_date [1,3], recovering [0,2,4].  Even group
 * ranks: 0<-1, 2<-3, 4<-1; odd: 0<-3, 2<-1, 4<-3.  Checked for every
 * replica's view, for group ranks 0..5, with init_sync on and off (max_step
 * is 1, so init_sync changes nothing).
 */
static void test_worked_example_every_view(void **state) {
  (void)state;
  static const int64_t steps[] = {0, 1, 0, 1, 0};
  static const int64_t src_even[] = {1, -1, 3, -1, 1};
  static const int64_t src_odd[] = {3, -1, 1, -1, 3};
  static const int64_t dst_even1[] = {0, 4}, dst_even3[] = {2};
  static const int64_t dst_odd1[] = {2}, dst_odd3[] = {0, 4};
  quorum_t q;
  quorum_steps(&q, steps, 5);
  for (int init_sync = 0; init_sync <= 1; init_sync++) {
    for (int64_t g = 0; g < 6; g++) {
      int odd = (int)(g % 2);
      for (size_t me = 0; me < 5; me++) {
        sg__mgr_results_t r = compute(&q, q.id[me], g, init_sync);
        assert_int_equal(r.replica_rank, me);
        assert_int_equal(r.replica_world_size, 5);
        assert_int_equal(r.max_step, 1);
        assert_int_equal(r.max_world_size, 2);
        expect_src(&q, &r, odd ? src_odd[me] : src_even[me]);
        if (me == 1)
          expect_dst(&r, odd ? dst_odd1 : dst_even1, odd ? 1 : 2);
        else if (me == 3)
          expect_dst(&r, odd ? dst_odd3 : dst_even3, odd ? 2 : 1);
        else
          expect_dst(&r, NULL, 0);
        /* max_replica_rank: r1 -> 0, r3 -> 1, the others none */
        assert_int_equal(r.has_max_replica_rank, me == 1 || me == 3);
        assert_int_equal(r.max_replica_rank, me == 3 ? 1 : 0);
        /* primary = M[g % 2] = r1 or r3 */
        assert_string_equal(r.store_address,
                            odd ? "store-r3:29500" : "store-r1:29500");
        assert_int_equal(r.n_up_to_date, 2);
        assert_string_equal(r.up_to_date_addresses[0], "http://r1");
        assert_string_equal(r.up_to_date_addresses[1], "http://r3");
        assert_int_equal(r.n_replica_ids, 5);
        for (size_t i = 0; i < 5; i++)
          assert_ptr_equal(r.replica_ids[i], q.id[i]); /* borrowed */
        sg__mgr_results_free(&r);
      }
    }
  }
}

/* check_order: the worked example given in input order perm[] gives the
 * same answers as in sorted order. */
static void check_order(const int *perm) {
  static const int64_t steps[] = {0, 1, 0, 1, 0};
  quorum_t q;
  memset(&q, 0, sizeof(q));
  for (int j = 0; j < 5; j++) {
    char id[8];
    snprintf(id, sizeof(id), "r%d", perm[j]);
    add(&q, id, steps[perm[j]]);
  }
  sg__mgr_results_t r = compute(&q, "r4", 1, 0);
  assert_int_equal(r.replica_rank, 4);
  expect_src(&q, &r, 3);
  for (int j = 0; j < 5; j++) {
    char want[8];
    snprintf(want, sizeof(want), "r%d", j);
    assert_string_equal(r.replica_ids[j], want);
  }
  assert_string_equal(r.up_to_date_addresses[0], "http://r1");
  assert_string_equal(r.up_to_date_addresses[1], "http://r3");
  assert_string_equal(r.store_address, "store-r3:29500");
  sg__mgr_results_free(&r);
  r = compute(&q, "r3", 1, 0);
  static const int64_t d3[] = {0, 4};
  expect_dst(&r, d3, 2);
  sg__mgr_results_free(&r);
}

/* The same quorum given in every one of its 120 input orders gives the
 * same answers (P is sorted by replica_id). */
static void test_unsorted_input(void **state) {
  (void)state;
  int perm[5] = {0, 1, 2, 3, 4}, c[5] = {0}, count = 1;
  check_order(perm);
  for (int i = 1; i < 5;) { /* Heap's algorithm */
    if (c[i] < i) {
      int a = (i % 2) ? c[i] : 0, t = perm[a];
      perm[a] = perm[i];
      perm[i] = t;
      check_order(perm);
      count++;
      c[i]++;
      i = 1;
    } else {
      c[i] = 0;
      i++;
    }
  }
  assert_int_equal(count, 120);
}

/* ---- step 0 and init_sync -------------------------------------------------
 */

/* All at step 0 with init_sync: everyone but the primary M[g % 3] heals,
 * all from the primary; without init_sync nobody heals. */
static void test_init_sync_step_zero(void **state) {
  (void)state;
  static const int64_t steps[] = {0, 0, 0};
  quorum_t q;
  quorum_steps(&q, steps, 3);
  for (int64_t g = 0; g < 7; g++) {
    size_t prim = (size_t)(g % 3);
    for (size_t me = 0; me < 3; me++) {
      sg__mgr_results_t r = compute(&q, q.id[me], g, 1);
      assert_int_equal(r.max_step, 0);
      assert_int_equal(r.max_world_size, 3);
      assert_int_equal(r.has_max_replica_rank, 1);
      assert_int_equal(r.max_replica_rank, me);
      assert_string_equal(r.store_address, q.store[prim]);
      assert_int_equal(r.n_up_to_date, 1);
      assert_string_equal(r.up_to_date_addresses[0], q.addr[prim]);
      if (me == prim) {
        expect_src(&q, &r, -1);
        int64_t want[2], k = 0;
        for (size_t i = 0; i < 3; i++)
          if (i != prim)
            want[k++] = (int64_t)i;
        expect_dst(&r, want, 2);
      } else {
        expect_src(&q, &r, (int64_t)prim);
        expect_dst(&r, NULL, 0);
      }
      sg__mgr_results_free(&r);

      r = compute(&q, q.id[me], g, 0);
      expect_src(&q, &r, -1);
      expect_dst(&r, NULL, 0);
      assert_int_equal(r.n_up_to_date, 3);
      assert_string_equal(r.store_address, q.store[prim]);
      sg__mgr_results_free(&r);
    }
  }
}

/* init_sync only matters at max_step 0: at step 5 nobody heals. */
static void test_init_sync_after_step_zero(void **state) {
  (void)state;
  static const int64_t steps[] = {5, 5, 5, 5};
  quorum_t q;
  quorum_steps(&q, steps, 4);
  for (size_t me = 0; me < 4; me++) {
    sg__mgr_results_t r = compute(&q, q.id[me], 1, 1);
    expect_src(&q, &r, -1);
    expect_dst(&r, NULL, 0);
    assert_int_equal(r.n_up_to_date, 4);
    sg__mgr_results_free(&r);
  }
}

/* max_step 0 with a replica behind it (negative step): with init_sync the
 * behind one and the non-primaries at 0 all recover from the primary. */
static void test_init_sync_with_behind_replica(void **state) {
  (void)state;
  static const int64_t steps[] = {-1, 0, 0};
  quorum_t q;
  quorum_steps(&q, steps, 3);
  /* g = 1: M = [r1, r2], primary r2; dst [0, 1]; up_to_date [2] */
  sg__mgr_results_t r = compute(&q, "r2", 1, 1);
  static const int64_t d[] = {0, 1};
  expect_dst(&r, d, 2);
  expect_src(&q, &r, -1);
  assert_string_equal(r.store_address, "store-r2:29500");
  sg__mgr_results_free(&r);
  r = compute(&q, "r1", 1, 1);
  expect_src(&q, &r, 2);
  assert_int_equal(r.has_max_replica_rank, 1);
  assert_int_equal(r.max_replica_rank, 0);
  sg__mgr_results_free(&r);
  r = compute(&q, "r0", 1, 1);
  expect_src(&q, &r, 2);
  assert_int_equal(r.has_max_replica_rank, 0);
  sg__mgr_results_free(&r);
  /* without init_sync only r0 recovers; k=0, (0+1)%2 -> up_to_date[1] */
  r = compute(&q, "r0", 1, 0);
  expect_src(&q, &r, 2);
  sg__mgr_results_free(&r);
  r = compute(&q, "r1", 1, 0);
  expect_src(&q, &r, -1);
  expect_dst(&r, NULL, 0);
  sg__mgr_results_free(&r);
}

/* ---- round-robin spreading ------------------------------------------------
 */

/* One up-to-date replica serves all six recovering ones. */
static void test_many_recovering_one_source(void **state) {
  (void)state;
  static const int64_t steps[] = {3, 3, 3, 9, 3, 3, 3};
  quorum_t q;
  quorum_steps(&q, steps, 7);
  for (int64_t g = 0; g < 3; g++) {
    sg__mgr_results_t r = compute(&q, "r3", g, 0);
    static const int64_t d[] = {0, 1, 2, 4, 5, 6};
    expect_dst(&r, d, 6);
    expect_src(&q, &r, -1);
    assert_int_equal(r.max_world_size, 1);
    assert_int_equal(r.max_replica_rank, 0);
    sg__mgr_results_free(&r);
    for (size_t me = 0; me < 7; me++) {
      if (me == 3)
        continue;
      r = compute(&q, q.id[me], g, 0);
      expect_src(&q, &r, 3);
      expect_dst(&r, NULL, 0);
      sg__mgr_results_free(&r);
    }
  }
}

/*
 * Nine replicas, up to date at P indexes 2 and 5 (step 4), seven
 * recovering: dst = [0,1,3,4,6,7,8], k = 0..6.  g = 0: sources alternate
 * 2,5,2,5,2,5,2.  g = 3: start at up_to_date[1]: 5,2,5,2,5,2,5.
 */
static void test_more_recovering_than_sources(void **state) {
  (void)state;
  static const int64_t steps[] = {1, 2, 4, 0, 3, 4, 1, 1, 2};
  quorum_t q;
  quorum_steps(&q, steps, 9);
  static const int64_t dst[] = {0, 1, 3, 4, 6, 7, 8};
  static const int64_t g0_src[] = {2, 5, 2, 5, 2, 5, 2};
  static const int64_t g3_src[] = {5, 2, 5, 2, 5, 2, 5};
  for (size_t k = 0; k < 7; k++) {
    sg__mgr_results_t r = compute(&q, q.id[dst[k]], 0, 1);
    expect_src(&q, &r, g0_src[k]);
    sg__mgr_results_free(&r);
    r = compute(&q, q.id[dst[k]], 3, 1);
    expect_src(&q, &r, g3_src[k]);
    sg__mgr_results_free(&r);
  }
  static const int64_t a[] = {0, 3, 6, 8}, b[] = {1, 4, 7};
  sg__mgr_results_t r = compute(&q, "r2", 0, 0);
  expect_dst(&r, a, 4);
  sg__mgr_results_free(&r);
  r = compute(&q, "r5", 0, 0);
  expect_dst(&r, b, 3);
  sg__mgr_results_free(&r);
  r = compute(&q, "r2", 3, 0);
  expect_dst(&r, b, 3);
  sg__mgr_results_free(&r);
  r = compute(&q, "r5", 3, 0);
  expect_dst(&r, a, 4);
  assert_string_equal(r.store_address, "store-r5:29500"); /* M[3 % 2] */
  sg__mgr_results_free(&r);
}

/*
 * Group ranks far beyond the number of sources, up to INT64_MAX (where
 * k + group_rank overflows int64_t).  Three sources at P 1, 2, 3; dst
 * [0, 4, 5].  INT64_MAX % 3 == 1, so k = 0, 1, 2 go to up_to_date[1, 2, 0]
 * = P[2, 3, 1]; INT64_MAX % 2 == 1 for two sources.
 */
static void test_group_rank_offsets(void **state) {
  (void)state;
  static const int64_t steps[] = {0, 8, 8, 8, 0, 7};
  quorum_t q;
  quorum_steps(&q, steps, 6);
  static const int64_t dst[] = {0, 4, 5};
  struct {
    int64_t g;
    int64_t src[3];
    const char *store;
  } cases[] = {
      {7, {2, 3, 1}, "store-r2:29500"},             /* 7 % 3 == 1 */
      {1000, {2, 3, 1}, "store-r2:29500"},          /* 1000 % 3 == 1 */
      {1001, {3, 1, 2}, "store-r3:29500"},          /* 1001 % 3 == 2 */
      {INT64_MAX, {2, 3, 1}, "store-r2:29500"},     /* INT64_MAX % 3 == 1 */
      {INT64_MAX - 1, {1, 2, 3}, "store-r1:29500"}, /* % 3 == 0 */
  };
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    for (size_t k = 0; k < 3; k++) {
      sg__mgr_results_t r = compute(&q, q.id[dst[k]], cases[c].g, 0);
      expect_src(&q, &r, cases[c].src[k]);
      assert_string_equal(r.store_address, cases[c].store);
      sg__mgr_results_free(&r);
    }
  }
  /* two sources: INT64_MAX % 2 == 1, so k = 0 goes to up_to_date[1] */
  static const int64_t steps2[] = {0, 8, 8};
  quorum_steps(&q, steps2, 3);
  sg__mgr_results_t r = compute(&q, "r0", INT64_MAX, 0);
  expect_src(&q, &r, 2);
  sg__mgr_results_free(&r);
}

/* The primary (whose TCPStore a group rank uses) is M[g % |M|], with M in
 * replica-id order and the behind replicas skipped. */
static void test_primary_per_group_rank(void **state) {
  (void)state;
  quorum_t q;
  memset(&q, 0, sizeof(q));
  add(&q, "d", 5);
  add(&q, "a", 5);
  add(&q, "c", 2);
  add(&q, "b", 5);
  /* P = a b c d; M = a b d */
  static const char *want[] = {"store-a:29500", "store-b:29500",
                               "store-d:29500"};
  static const size_t want_in[] = {1, 3, 0}; /* their input indexes */
  for (int64_t g = 0; g < 9; g++) {
    for (size_t me = 0; me < 4; me++) {
      sg__mgr_results_t r = compute(&q, q.id[me], g, 0);
      assert_string_equal(r.store_address, want[g % 3]);
      assert_ptr_equal(r.store_address, q.store[want_in[g % 3]]);
      sg__mgr_results_free(&r);
    }
  }
}

/* max_replica_rank is the index among those at max_step, none for a replica
 * behind; max_world_size counts those at max_step. */
static void test_max_replica_rank(void **state) {
  (void)state;
  static const int64_t steps[] = {4, 2, 4, 4, 1};
  quorum_t q;
  quorum_steps(&q, steps, 5);
  static const int has[] = {1, 0, 1, 1, 0};
  static const int64_t mrr[] = {0, 0, 1, 2, 0};
  for (size_t me = 0; me < 5; me++) {
    sg__mgr_results_t r = compute(&q, q.id[me], 0, 0);
    assert_int_equal(r.has_max_replica_rank, has[me]);
    assert_int_equal(r.max_replica_rank, mrr[me]);
    assert_int_equal(r.max_world_size, 3);
    assert_int_equal(r.heal, !has[me]);
    sg__mgr_results_free(&r);
  }
}

/* commit_failures is the maximum over all participants. */
static void test_commit_failures_max(void **state) {
  (void)state;
  static const int64_t steps[] = {1, 1, 0};
  quorum_t q;
  quorum_steps(&q, steps, 3);
  sg__mgr_results_t r = compute(&q, "r0", 0, 0);
  assert_int_equal(r.commit_failures, 0);
  sg__mgr_results_free(&r);
  q.p[2].commit_failures = 3; /* a behind replica counts too */
  q.p[1].commit_failures = 1;
  for (size_t me = 0; me < 3; me++) {
    r = compute(&q, q.id[me], 1, 0);
    assert_int_equal(r.commit_failures, 3);
    sg__mgr_results_free(&r);
  }
  /* a plain maximum, also over (meaningless) negative counts */
  q.p[0].commit_failures = -5;
  q.p[1].commit_failures = -2;
  q.p[2].commit_failures = -9;
  r = compute(&q, "r0", 0, 0);
  assert_int_equal(r.commit_failures, -2);
  sg__mgr_results_free(&r);
}

/* ---- ids and lookup -------------------------------------------------------
 */

/* replica_id order is strcmp's unsigned byte order: "B" < "a:1" < "a:10" <
 * "a:2" < "\xc3\xa9" (not numeric, not locale, not signed char). */
static void test_replica_id_byte_order(void **state) {
  (void)state;
  quorum_t q;
  memset(&q, 0, sizeof(q));
  add(&q, "a:2", 1);
  add(&q, "\xc3\xa9:0", 1);
  add(&q, "a:10", 0);
  add(&q, "B", 1);
  add(&q, "a:1", 1);
  static const char *order[] = {"B", "a:1", "a:10", "a:2", "\xc3\xa9:0"};
  sg__mgr_results_t r = compute(&q, "a:10", 0, 0);
  assert_int_equal(r.n_replica_ids, 5);
  for (size_t i = 0; i < 5; i++)
    assert_string_equal(r.replica_ids[i], order[i]);
  assert_int_equal(r.replica_rank, 2);
  assert_int_equal(r.has_max_replica_rank, 0);
  /* up_to_date = [0, 1, 3, 4]; k = 0 with g = 0 -> P[0] = "B" */
  expect_src(&q, &r, 0);
  assert_string_equal(r.recover_src_manager_address, "http://B");
  assert_int_equal(r.n_up_to_date, 4);
  assert_string_equal(r.up_to_date_addresses[3], "http://\xc3\xa9:0");
  sg__mgr_results_free(&r);
  r = compute(&q, "\xc3\xa9:0", 3, 0);
  assert_int_equal(r.replica_rank, 4);
  assert_int_equal(r.max_replica_rank, 3);
  static const int64_t d[] = {2}; /* k = 0, g = 3 -> up_to_date[3] = P[4] */
  expect_dst(&r, d, 1);
  sg__mgr_results_free(&r);
}

/* Duplicate ids (the lighthouse never sends them) behave as torchft's stable
 * sort and first-match lookups: the first in input order wins. */
static void test_duplicate_ids_first_wins(void **state) {
  (void)state;
  quorum_t q;
  memset(&q, 0, sizeof(q));
  add(&q, "b", 3);
  add(&q, "a", 3);
  add(&q, "a", 1);
  /* P = a(3) a(1) b(3); replica "a" is P[0], up to date */
  sg__mgr_results_t r = compute(&q, "a", 0, 0);
  assert_int_equal(r.replica_rank, 0);
  assert_int_equal(r.max_replica_rank, 0);
  expect_src(&q, &r, -1);
  static const int64_t d[] = {1};
  expect_dst(&r, d, 1);
  sg__mgr_results_free(&r);
  /* reversed input order: P = a(1) a(3) b(3); "a" is P[0], behind, yet its
   * max_replica_rank is that of the first "a" in M (P[1]) */
  memset(&q, 0, sizeof(q));
  add(&q, "a", 1);
  add(&q, "a", 3);
  add(&q, "b", 3);
  r = compute(&q, "a", 0, 0);
  assert_int_equal(r.replica_rank, 0);
  assert_int_equal(r.has_max_replica_rank, 1);
  assert_int_equal(r.max_replica_rank, 0);
  expect_src(&q, &r, 1);
  expect_dst(&r, NULL, 0);
  sg__mgr_results_free(&r);
  /* init_sync at step 0: the force rule compares ids, so both "a" entries
   * stay up to date when the primary is an "a" */
  memset(&q, 0, sizeof(q));
  add(&q, "a", 0);
  add(&q, "a", 0);
  add(&q, "b", 0);
  r = compute(&q, "b", 1, 1); /* primary M[1] = the second "a" */
  expect_src(&q, &r, 1);      /* dst [2], k = 0: up_to_date[(0+1)%2] */
  assert_int_equal(r.n_up_to_date, 2);
  sg__mgr_results_free(&r);
}

/* A single replica: rank 0 of 1, up to date, nothing to heal. */
static void test_single_replica(void **state) {
  (void)state;
  quorum_t q;
  memset(&q, 0, sizeof(q));
  add(&q, "solo", 0);
  for (int init_sync = 0; init_sync <= 1; init_sync++) {
    sg__mgr_results_t r = compute(&q, "solo", 3, init_sync);
    assert_int_equal(r.replica_rank, 0);
    assert_int_equal(r.replica_world_size, 1);
    assert_int_equal(r.max_world_size, 1);
    expect_src(&q, &r, -1);
    expect_dst(&r, NULL, 0);
    assert_string_equal(r.store_address, "store-solo:29500");
    assert_int_equal(r.n_up_to_date, 1);
    sg__mgr_results_free(&r);
  }
}

/* NULL address/store strings read as "". */
static void test_null_strings_read_as_empty(void **state) {
  (void)state;
  sg__mgr_peer_t p[2];
  memset(p, 0, sizeof(p));
  p[0].replica_id = "a";
  p[0].step = 2;
  p[1].replica_id = "b";
  p[1].step = 1;
  sg__mgr_results_t r;
  assert_int_equal(sg__mgr_compute_results(1, p, 2, "b", 0, 0, &r, NULL), 0);
  assert_int_equal(r.heal, 1);
  assert_string_equal(r.recover_src_manager_address, "");
  assert_string_equal(r.store_address, "");
  assert_string_equal(r.up_to_date_addresses[0], "");
  sg__mgr_results_free(&r);
}

/* Absent replica: SG_ENOTFOUND with torchft's message; out is zeroed. */
static void test_not_participating(void **state) {
  (void)state;
  static const int64_t steps[] = {1, 0};
  quorum_t q;
  quorum_steps(&q, steps, 2);
  sg__mgr_results_t r;
  memset(&r, 0xab, sizeof(r));
  sg_err_t err;
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "ghost", 0, 0, &r, &err),
                   SG_ENOTFOUND);
  assert_int_equal(err.code, SG_ENOTFOUND);
  assert_string_equal(err.msg,
                      "replica ghost not participating in returned quorum");
  assert_null(r.replica_ids);
  assert_null(r.recover_dst_replica_ranks);
  assert_null(r.up_to_date_addresses);
  sg__mgr_results_free(&r);
  /* a prefix of an id is not the id */
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "r", 0, 0, &r, &err),
                   SG_ENOTFOUND);
  assert_string_equal(err.msg,
                      "replica r not participating in returned quorum");
  /* an empty quorum: nobody participates */
  assert_int_equal(sg__mgr_compute_results(1, NULL, 0, "r0", 0, 0, &r, &err),
                   SG_ENOTFOUND);
  assert_string_equal(err.msg,
                      "replica r0 not participating in returned quorum");
  /* not found wins over memory pressure (checked before allocating) */
  sg_test_fail_alloc(1, 1);
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "x", 0, 0, &r, NULL),
                   SG_ENOTFOUND);
  assert_int_equal(sg_test_fail_alloc(0, 0), 0);
}

static void test_bad_args(void **state) {
  (void)state;
  static const int64_t steps[] = {1, 0};
  quorum_t q;
  quorum_steps(&q, steps, 2);
  sg__mgr_results_t r;
  sg_err_t err;
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "r0", 0, 0, NULL, &err),
                   SG_EINVAL);
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, NULL, 0, 0, &r, &err),
                   SG_EINVAL);
  assert_null(r.replica_ids);
  assert_int_equal(sg__mgr_compute_results(1, NULL, 2, "r0", 0, 0, &r, &err),
                   SG_EINVAL);
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "r0", -1, 0, &r, &err),
                   SG_EINVAL);
  assert_string_equal(err.msg, "negative group_rank -1");
  assert_int_equal(
      sg__mgr_compute_results(1, q.p, 2, "r0", INT64_MIN, 0, &r, NULL),
      SG_EINVAL);
  q.p[1].replica_id = NULL;
  assert_int_equal(sg__mgr_compute_results(1, q.p, 2, "r0", 0, 0, &r, &err),
                   SG_EINVAL);
  assert_string_equal(err.msg, "participant 1 has no replica_id");
  q.p[1].replica_id = q.id[1];
  /* the size bound is checked before the array is read */
  assert_int_equal(sg__mgr_compute_results(1, q.p, SG__MGR_MAX_PEERS + 1, "r0",
                                           0, 0, &r, &err),
                   SG_ETOOBIG);
  assert_null(r.replica_ids);
  sg__mgr_results_free(NULL);
}

/* ---- allocation failure ---------------------------------------------------
 */

/* Fail each allocation in turn (once, then sticky): SG_ENOMEM, out zeroed,
 * nothing leaked; then the same call succeeds with the same answer. */
static void torture(const quorum_t *q, const char *id, int64_t g,
                    int init_sync) {
  sg__mgr_results_t want = compute(q, id, g, init_sync);
  for (int sticky = 0; sticky <= 1; sticky++) {
    long nth;
    for (nth = 1; nth < 100; nth++) {
      sg__mgr_results_t r;
      sg_err_t err;
      sg_test_fail_alloc(nth, sticky);
      int rc =
          sg__mgr_compute_results(7, q->p, q->n, id, g, init_sync, &r, &err);
      long hits = sg_test_fail_alloc(0, 0);
      if (rc == 0) {
        assert_int_equal(hits, 0);
        assert_int_equal(r.heal, want.heal);
        assert_int_equal(r.recover_src_replica_rank,
                         want.recover_src_replica_rank);
        assert_int_equal(r.n_recover_dst, want.n_recover_dst);
        assert_int_equal(r.n_up_to_date, want.n_up_to_date);
        sg__mgr_results_free(&r);
        break;
      }
      assert_int_equal(rc, SG_ENOMEM);
      assert_int_equal(err.code, SG_ENOMEM);
      assert_true(hits >= 1);
      assert_null(r.replica_ids);
      assert_null(r.recover_dst_replica_ranks);
      assert_null(r.up_to_date_addresses);
      sg__mgr_results_free(&r);
    }
    assert_true(nth > 1); /* at least one allocation was failed */
    assert_true(nth < 100);
  }
  sg__mgr_results_free(&want);
}

static void test_alloc_failure_each_allocation(void **state) {
  (void)state;
  static const int64_t steps[] = {0, 1, 0, 1, 0};
  quorum_t q;
  quorum_steps(&q, steps, 5);
  for (size_t me = 0; me < 5; me++)
    for (int64_t g = 0; g < 2; g++)
      torture(&q, q.id[me], g, 0);
  static const int64_t zero[] = {0, 0, 0};
  quorum_steps(&q, zero, 3);
  torture(&q, "r0", 0, 1);
  torture(&q, "r1", 0, 1);
  torture(&q, "r1", 0, 0);
}

/* ---- group step -----------------------------------------------------------
 */

static void test_group_step(void **state) {
  (void)state;
  int d = 7;
  static const int64_t same[] = {4, 4, 4};
  assert_int_equal(sg__mgr_group_step(same, 3, &d), 4);
  assert_int_equal(d, 0);
  static const int64_t differ[] = {5, 3, 9, 4};
  assert_int_equal(sg__mgr_group_step(differ, 4, &d), 3);
  assert_int_equal(d, 1);
  static const int64_t last_low[] = {5, 5, 2};
  assert_int_equal(sg__mgr_group_step(last_low, 3, &d), 2);
  assert_int_equal(d, 1);
  static const int64_t first_low[] = {2, 5, 5};
  assert_int_equal(sg__mgr_group_step(first_low, 3, &d), 2);
  assert_int_equal(d, 1);
  static const int64_t neg[] = {0, -3};
  assert_int_equal(sg__mgr_group_step(neg, 2, NULL), -3);
  static const int64_t one[] = {INT64_MAX};
  assert_int_equal(sg__mgr_group_step(one, 1, &d), INT64_MAX);
  assert_int_equal(d, 0);
  d = 7;
  assert_int_equal(sg__mgr_group_step(NULL, 3, &d), 0);
  assert_int_equal(d, 0);
  d = 7;
  assert_int_equal(sg__mgr_group_step(same, 0, &d), 0);
  assert_int_equal(d, 0);
}

/* ---- property test against a naive model ----------------------------------
 */

static uint64_t rng_state;
static uint64_t rnd(void) { /* xorshift64*, seeded per test */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1DULL;
}

/* model_src: results.h's rules written the slow way (insertion sort, explicit
 * lists); returns the source of P[me] or -1, and fills sorted[]. */
typedef struct model_s {
  size_t sorted[MAXP]; /* input indexes in P order */
  int64_t max_step;
  size_t primary; /* P index */
  int dst[MAXP];  /* P index is recovering */
  int64_t src[MAXP];
} model_t;

static void model(const quorum_t *q, int64_t g, int init_sync, model_t *m) {
  size_t n = q->n;
  for (size_t i = 0; i < n; i++) {
    size_t j = i;
    while (j > 0 && strcmp(q->id[m->sorted[j - 1]], q->id[i]) > 0) {
      m->sorted[j] = m->sorted[j - 1];
      j--;
    }
    m->sorted[j] = i;
  }
  m->max_step = INT64_MIN;
  for (size_t i = 0; i < n; i++)
    if (q->p[i].step > m->max_step)
      m->max_step = q->p[i].step;
  size_t mlist[MAXP], nm = 0;
  for (size_t i = 0; i < n; i++)
    if (q->p[m->sorted[i]].step == m->max_step)
      mlist[nm++] = i;
  m->primary = mlist[(uint64_t)g % nm];
  int force = init_sync && m->max_step == 0;
  size_t utd[MAXP], nu = 0, dl[MAXP], nd = 0;
  for (size_t i = 0; i < n; i++) {
    const sg__mgr_peer_t *p = &q->p[m->sorted[i]];
    m->dst[i] = p->step != m->max_step ||
                (force && strcmp(p->replica_id,
                                 q->p[m->sorted[m->primary]].replica_id) != 0);
    m->src[i] = -1;
    if (m->dst[i])
      dl[nd++] = i;
    else
      utd[nu++] = i;
  }
  for (size_t k = 0; k < nd; k++)
    m->src[dl[k]] = (int64_t)utd[(k + (uint64_t)g % nu) % nu];
}

static void test_property_random_quorums(void **state) {
  (void)state;
  rng_state = 0x5eed5eed12345678ULL;
  static const int64_t granks[] = {0, 1, 2, 3, 5, 17, INT64_MAX};
  int healed_any = 0, forced_any = 0;
  for (int iter = 0; iter < 3000; iter++) {
    quorum_t q;
    memset(&q, 0, sizeof(q));
    size_t n = 1 + (size_t)(rnd() % 12);
    int64_t step_range = 1 + (int64_t)(rnd() % 4);
    int init_sync = (int)(rnd() % 2);
    for (size_t i = 0; i < n; i++) {
      char id[24];
      for (;;) { /* unique random ids so the sort has work to do */
        snprintf(id, sizeof(id), "%c%u:%x", (char)('a' + rnd() % 3),
                 (unsigned)(rnd() % 50), (unsigned)(rnd() % 4096));
        size_t j = 0;
        while (j < q.n && strcmp(q.id[j], id) != 0)
          j++;
        if (j == q.n)
          break;
      }
      add(&q, id, (int64_t)(rnd() % (uint64_t)step_range));
      q.p[i].commit_failures = (int64_t)(rnd() % 3);
    }
    int64_t want_cf = 0;
    for (size_t i = 0; i < n; i++)
      if (q.p[i].commit_failures > want_cf)
        want_cf = q.p[i].commit_failures;

    sg__mgr_results_t first = compute(&q, q.id[0], 0, init_sync);
    for (size_t gi = 0; gi < sizeof(granks) / sizeof(granks[0]); gi++) {
      int64_t g = granks[gi];
      model_t m;
      model(&q, g, init_sync, &m);
      size_t seen[MAXP] = {0}; /* times each P index appears as a dst */
      size_t n_heal = 0;
      for (size_t pi = 0; pi < n; pi++) {
        size_t in = m.sorted[pi];
        sg__mgr_results_t r = compute(&q, q.id[in], g, init_sync);
        /* agreement across replicas and group ranks */
        assert_int_equal(r.replica_rank, pi);
        assert_int_equal(r.replica_world_size, n);
        assert_int_equal(r.max_step, first.max_step);
        assert_int_equal(r.max_world_size, first.max_world_size);
        assert_int_equal(r.commit_failures, want_cf);
        assert_int_equal(r.n_replica_ids, n);
        for (size_t i = 0; i < n; i++) {
          assert_ptr_equal(r.replica_ids[i], first.replica_ids[i]);
          assert_ptr_equal(r.replica_ids[i], q.id[m.sorted[i]]);
        }
        if (pi > 0)
          assert_true(strcmp(r.replica_ids[pi - 1], r.replica_ids[pi]) < 0);
        /* the model */
        assert_int_equal(r.max_step, m.max_step);
        assert_ptr_equal(r.store_address, q.store[m.sorted[m.primary]]);
        assert_int_equal(r.heal, m.dst[pi]);
        assert_int_equal(r.heal, r.has_recover_src_replica_rank);
        assert_int_equal(r.heal, m.src[pi] >= 0);
        if (r.heal) {
          n_heal++;
          int64_t s = r.recover_src_replica_rank;
          assert_int_equal(s, m.src[pi]);
          assert_false(m.dst[s]); /* sources are up to date */
          assert_int_equal(q.p[m.sorted[s]].step, r.max_step);
          assert_ptr_equal(r.recover_src_manager_address, q.addr[m.sorted[s]]);
          assert_int_equal(r.n_recover_dst, 0); /* healers send nothing */
        } else {
          assert_string_equal(r.recover_src_manager_address, "");
        }
        if (init_sync && r.max_step == 0) {
          forced_any = 1;
          assert_int_equal(r.heal, pi != m.primary);
        } else {
          assert_int_equal(r.heal, q.p[in].step != r.max_step);
        }
        healed_any |= r.heal;
        assert_int_equal(r.has_max_replica_rank, q.p[in].step == r.max_step);
        /* own destinations: ascending, and each names this replica as src */
        for (size_t k = 0; k < r.n_recover_dst; k++) {
          int64_t d = r.recover_dst_replica_ranks[k];
          assert_true(d >= 0 && (size_t)d < n);
          assert_int_equal(m.src[d], (int64_t)pi);
          if (k > 0)
            assert_true(d > r.recover_dst_replica_ranks[k - 1]);
          seen[d]++;
        }
        /* up_to_date_addresses: the non-recovering, in P order */
        size_t u = 0;
        for (size_t i = 0; i < n; i++)
          if (!m.dst[i]) {
            assert_true(u < r.n_up_to_date);
            assert_ptr_equal(r.up_to_date_addresses[u], q.addr[m.sorted[i]]);
            u++;
          }
        assert_int_equal(u, r.n_up_to_date);
        assert_true(r.n_up_to_date >= 1);
        sg__mgr_results_free(&r);
      }
      /* the dst lists partition recover_dst: each healer exactly once */
      size_t total = 0;
      for (size_t i = 0; i < n; i++) {
        assert_int_equal(seen[i], m.dst[i] ? 1 : 0);
        total += seen[i];
      }
      assert_int_equal(total, n_heal);
    }
    sg__mgr_results_free(&first);
  }
  assert_true(healed_any);
  assert_true(forced_any);
}

/* A large quorum: 100,000 replicas, one ahead; every other one pulls from
 * it and it sends to all of them. */
static void test_large_quorum(void **state) {
  (void)state;
  size_t n = 100000;
  sg__mgr_peer_t *p = calloc(n, sizeof(*p));
  char(*ids)[16] = calloc(n, sizeof(*ids));
  assert_non_null(p);
  assert_non_null(ids);
  for (size_t i = 0; i < n; i++) {
    size_t j = (i * 7919) % n; /* scrambled input order */
    snprintf(ids[i], sizeof(ids[i]), "r%06zu", j);
    p[i].replica_id = ids[i];
    p[i].address = ids[i];
    p[i].step = j == 4242 ? 11 : 10;
  }
  sg__mgr_results_t r;
  assert_int_equal(sg__mgr_compute_results(1, p, n, "r004242", 3, 1, &r, NULL),
                   0);
  assert_int_equal(r.replica_rank, 4242);
  assert_int_equal(r.n_recover_dst, n - 1);
  assert_int_equal(r.recover_dst_replica_ranks[4242], 4243);
  assert_int_equal(r.n_up_to_date, 1);
  assert_string_equal(r.up_to_date_addresses[0], "r004242");
  sg__mgr_results_free(&r);
  assert_int_equal(sg__mgr_compute_results(1, p, n, "r099999", 3, 1, &r, NULL),
                   0);
  assert_int_equal(r.replica_rank, 99999);
  assert_int_equal(r.recover_src_replica_rank, 4242);
  assert_string_equal(r.recover_src_manager_address, "r004242");
  sg__mgr_results_free(&r);
  free(ids);
  free(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_worked_example_every_view),
      cmocka_unit_test(test_unsorted_input),
      cmocka_unit_test(test_init_sync_step_zero),
      cmocka_unit_test(test_init_sync_after_step_zero),
      cmocka_unit_test(test_init_sync_with_behind_replica),
      cmocka_unit_test(test_many_recovering_one_source),
      cmocka_unit_test(test_more_recovering_than_sources),
      cmocka_unit_test(test_group_rank_offsets),
      cmocka_unit_test(test_primary_per_group_rank),
      cmocka_unit_test(test_max_replica_rank),
      cmocka_unit_test(test_commit_failures_max),
      cmocka_unit_test(test_replica_id_byte_order),
      cmocka_unit_test(test_duplicate_ids_first_wins),
      cmocka_unit_test(test_single_replica),
      cmocka_unit_test(test_null_strings_read_as_empty),
      cmocka_unit_test(test_not_participating),
      cmocka_unit_test(test_bad_args),
      cmocka_unit_test(test_alloc_failure_each_allocation),
      cmocka_unit_test(test_group_step),
      cmocka_unit_test(test_property_random_quorums),
      cmocka_unit_test(test_large_quorum),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
