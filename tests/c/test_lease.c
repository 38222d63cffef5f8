/*
 * test_lease.c: the pure parts of replicated lighthouses (src/lighthouse/
 * lease.c): the lease deadline arithmetic, the fencing rules (when a
 * lighthouse may decide and when an answer may leave), the quorum record
 * stored in etcd, and the JSON and base64 helpers the etcd client reads
 * etcd's gateway answers with (answers as etcd 3.4 sends them).
 *
 * Every test frees what it allocates; the ASan build checks for leaks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lighthouse/lease.h"
#include "stepguard/base.h"

#define S(x) ((int64_t)(x)*1000000000)
#define MS(x) ((int64_t)(x)*1000000)

/* ---- lease deadline -------------------------------------------------- */

static void test_deadline_is_send_plus_ttl_minus_margin(void **st) {
  (void)st;
  /* counted from the SEND time of the acknowledged keepalive */
  assert_int_equal(sg__lh_lease_deadline(S(100), 2, MS(300)),
                   S(100) + S(2) - MS(300));
  assert_int_equal(sg__lh_lease_deadline(0, 5, 0), S(5));
}

static void test_deadline_gone_lease_is_past(void **st) {
  (void)st;
  /* TTL 0 (etcd lost the lease), negative, or a margin that eats the TTL:
   * the deadline is the send time itself, already past on arrival */
  assert_int_equal(sg__lh_lease_deadline(S(7), 0, MS(100)), S(7));
  assert_int_equal(sg__lh_lease_deadline(S(7), -3, MS(100)), S(7));
  assert_int_equal(sg__lh_lease_deadline(S(7), 1, S(1)), S(7));
  assert_int_equal(sg__lh_lease_deadline(S(7), 1, S(5)), S(7));
  /* a negative margin is no margin: never later than send + TTL */
  assert_int_equal(sg__lh_lease_deadline(S(7), 1, -MS(500)), S(8));
}

static void test_deadline_saturates(void **st) {
  (void)st;
  assert_int_equal(sg__lh_lease_deadline(INT64_MAX - 5, 2, 0), INT64_MAX);
  assert_int_equal(sg__lh_lease_deadline(0, INT64_MAX, 0), INT64_MAX);
}

/* ---- fencing ----------------------------------------------------------- */

static sg__lh_fence_t leader(int64_t deadline, int64_t confirmed) {
  sg__lh_fence_t f = {SG__LH_ROLE_LEADER, 1, deadline, 0, confirmed};
  return f;
}

static void test_single_always_decides_and_answers(void **st) {
  (void)st;
  sg__lh_fence_t f = {SG__LH_ROLE_SINGLE, 0, 0, 0, 0};
  assert_int_equal(sg__lh_fence_may_decide(&f, S(1000)), 1);
  assert_int_equal(sg__lh_fence_may_answer(&f, 12345, S(1000)), 1);
}

static void test_follower_never_decides(void **st) {
  (void)st;
  sg__lh_fence_t f = leader(S(10), 100);
  f.role = SG__LH_ROLE_FOLLOWER;
  assert_int_equal(sg__lh_fence_may_decide(&f, S(1)), 0);
  assert_int_equal(sg__lh_fence_may_answer(&f, 100, S(1)), 0);
}

static void test_leader_only_inside_its_lease(void **st) {
  (void)st;
  sg__lh_fence_t f = leader(S(10), 100);
  assert_int_equal(sg__lh_fence_may_decide(&f, S(10) - 1), 1);
  assert_int_equal(sg__lh_fence_may_decide(&f, S(10)), 0);
  assert_int_equal(sg__lh_fence_may_answer(&f, 100, S(10) - 1), 1);
  /* no answer leaves at or after the deadline, unchanged membership too */
  assert_int_equal(sg__lh_fence_may_answer(&f, 100, S(10)), 0);
  assert_int_equal(sg__lh_fence_may_answer(&f, 99, S(11)), 0);
}

static void test_new_id_waits_for_etcd(void **st) {
  (void)st;
  sg__lh_fence_t f = leader(S(10), 100);
  /* id 101 is not in etcd yet: its answer waits for the write */
  assert_int_equal(sg__lh_fence_may_answer(&f, 101, S(1)), 0);
  f.confirmed_id = 101;
  assert_int_equal(sg__lh_fence_may_answer(&f, 101, S(1)), 1);
  /* while a write is outstanding nothing new is decided */
  f.write_in_flight = 1;
  assert_int_equal(sg__lh_fence_may_decide(&f, S(1)), 0);
}

static void test_leader_not_ready_until_it_read_etcd(void **st) {
  (void)st;
  sg__lh_fence_t f = leader(S(10), 0);
  f.ready = 0;
  assert_int_equal(sg__lh_fence_may_decide(&f, S(1)), 0);
  assert_int_equal(sg__lh_fence_may_answer(&f, 0, S(1)), 0);
}

static void test_role_names(void **st) {
  (void)st;
  assert_string_equal(sg__lh_role_name(SG__LH_ROLE_SINGLE), "single");
  assert_string_equal(sg__lh_role_name(SG__LH_ROLE_FOLLOWER), "follower");
  assert_string_equal(sg__lh_role_name(SG__LH_ROLE_LEADER), "leader");
}

/* ---- record ------------------------------------------------------------ */

static void test_record_round_trip(void **st) {
  (void)st;
  const char *ids[] = {"train_0:abc", "train_1:def", "g2"};
  char *rec = NULL;
  assert_int_equal(sg__lh_record_encode(1796530389269247, ids, 3, &rec), 0);
  assert_string_equal(rec, "1796530389269247\ntrain_0:abc\ntrain_1:def\ng2\n");
  int64_t qid = 0;
  char **out = NULL;
  size_t n = 0;
  assert_int_equal(sg__lh_record_decode(rec, strlen(rec), 10, &qid, &out, &n),
                   0);
  assert_int_equal(qid, 1796530389269247);
  assert_int_equal(n, 3);
  for (size_t i = 0; i < n; i++)
    assert_string_equal(out[i], ids[i]);
  sg__lh_record_ids_free(out, n);
  sg_free(rec);
}

static void test_record_id_alone_and_empty_lines(void **st) {
  (void)st;
  int64_t qid = 0;
  char **out = NULL;
  size_t n = 9;
  assert_int_equal(sg__lh_record_decode("42", 2, 10, &qid, &out, &n), 0);
  assert_int_equal(qid, 42);
  assert_int_equal(n, 0);
  assert_null(out);
  assert_int_equal(sg__lh_record_decode("7\n\na\n\n", 6, 10, &qid, &out, &n),
                   0);
  assert_int_equal(n, 1);
  assert_string_equal(out[0], "a");
  sg__lh_record_ids_free(out, n);
}

static void test_record_rejects_garbage(void **st) {
  (void)st;
  int64_t qid = 0;
  char **out = NULL;
  size_t n = 0;
  assert_int_equal(sg__lh_record_decode("", 0, 10, &qid, &out, &n), SG_EINVAL);
  assert_int_equal(sg__lh_record_decode("-1\n", 3, 10, &qid, &out, &n),
                   SG_EINVAL);
  assert_int_equal(sg__lh_record_decode("12x\n", 4, 10, &qid, &out, &n),
                   SG_EINVAL);
  assert_int_equal(
      sg__lh_record_decode("99999999999999999999\n", 21, 10, &qid, &out, &n),
      SG_EINVAL);
  /* more ids than the limit */
  assert_int_equal(sg__lh_record_decode("1\na\nb\nc\n", 8, 2, &qid, &out, &n),
                   SG_EINVAL);
  assert_null(out);
  /* an id over 1,024 bytes */
  char big[1100];
  memset(big, 'x', sizeof(big));
  big[0] = '1';
  big[1] = '\n';
  assert_int_equal(sg__lh_record_decode(big, sizeof(big), 10, &qid, &out, &n),
                   SG_EINVAL);
  const char *bad[] = {"a\nb"};
  char *rec = NULL;
  assert_int_equal(sg__lh_record_encode(1, bad, 1, &rec), SG_EINVAL);
  const char *empty[] = {""};
  assert_int_equal(sg__lh_record_encode(1, empty, 1, &rec), SG_EINVAL);
  assert_null(rec);
}

static void test_record_alloc_failure(void **st) {
  (void)st;
  const char *rec = "5\na\nb\nc\n";
  for (long k = 1; k <= 6; k++) {
    int64_t qid = 0;
    char **out = NULL;
    size_t n = 0;
    sg_test_fail_alloc(k, 0);
    int rc = sg__lh_record_decode(rec, strlen(rec), 10, &qid, &out, &n);
    sg_test_fail_alloc(0, 0);
    assert_true(rc == 0 || rc == SG_ENOMEM);
    if (rc == 0)
      sg__lh_record_ids_free(out, n);
    else
      assert_null(out);
  }
}

/* ---- JSON as etcd 3.4's gateway writes it ------------------------------ */

static const char GRANT[] =
    "{\"header\":{\"cluster_id\":\"603964856947028724\",\"member_id\":"
    "\"16488924474983343082\",\"revision\":\"1\",\"raft_term\":\"2\"},"
    "\"ID\":\"7199745391063258632\",\"TTL\":\"2\"}";
static const char TXN_WON[] =
    "{\"header\":{\"cluster_id\":\"1\",\"member_id\":\"2\",\"revision\":"
    "\"2\",\"raft_term\":\"2\"},\"succeeded\":true,\"responses\":[{"
    "\"response_put\":{\"header\":{\"revision\":\"2\"}}}]}";
static const char TXN_LOST[] =
    "{\"header\":{\"revision\":\"2\"},\"responses\":[{\"response_range\":{"
    "\"header\":{\"revision\":\"2\"},\"kvs\":[{\"key\":\"cC9sZWFkZXI=\","
    "\"create_revision\":\"2\",\"mod_revision\":\"2\",\"version\":\"1\","
    "\"value\":\"bWU=\",\"lease\":\"7199745391063258634\"}],\"count\":\"1\"}}"
    "]}";
static const char KA_GONE[] = "{\"result\":{\"header\":{\"revision\":\"3\"},"
                              "\"ID\":\"7199745391063258634\""
                              "}}\n";

static void test_json_fields(void **st) {
  (void)st;
  int64_t v = 0;
  assert_int_equal(sg__lh_json_int(GRANT, strlen(GRANT), "ID", &v), 0);
  assert_int_equal(v, 7199745391063258632);
  assert_int_equal(sg__lh_json_int(GRANT, strlen(GRANT), "TTL", &v), 0);
  assert_int_equal(v, 2);
  /* "revision" is the header's, not create_revision / mod_revision */
  assert_int_equal(sg__lh_json_int(TXN_LOST, strlen(TXN_LOST), "revision", &v),
                   0);
  assert_int_equal(v, 2);
  assert_int_equal(sg__lh_json_bool(TXN_WON, strlen(TXN_WON), "succeeded"), 1);
  /* the gateway leaves false out */
  assert_int_equal(sg__lh_json_bool(TXN_LOST, strlen(TXN_LOST), "succeeded"),
                   0);
  const char *s = NULL;
  size_t n = 0;
  assert_int_equal(sg__lh_json_str(TXN_LOST, strlen(TXN_LOST), "value", &s, &n),
                   0);
  assert_int_equal(n, 4);
  assert_memory_equal(s, "bWU=", 4);
  /* a keepalive of a lost lease has no TTL */
  assert_int_equal(sg__lh_json_int(KA_GONE, strlen(KA_GONE), "TTL", &v),
                   SG_ENOTFOUND);
  assert_int_equal(sg__lh_json_int("{\"a\":5}", 7, "a", &v), 0);
  assert_int_equal(v, 5);
}

static void test_json_garbage(void **st) {
  (void)st;
  int64_t v = 0;
  const char *s = NULL;
  size_t n = 0;
  const char *bad[] = {"",
                       "{\"TTL\"",
                       "{\"TTL\":",
                       "{\"TTL\":\"",
                       "{\"TTL\":\"12",
                       "{\"TTL\":x}",
                       "{\"TTL\":\"99999999999999999999\"}",
                       "{\"value\":12}",
                       "{\"value\":\"abc",
                       "{\"succeeded\":maybe}"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    size_t l = strlen(bad[i]);
    assert_true(sg__lh_json_int(bad[i], l, "TTL", &v) != 0);
    assert_true(sg__lh_json_str(bad[i], l, "value", &s, &n) != 0);
    assert_true(sg__lh_json_bool(bad[i], l, "succeeded") <= 0);
  }
  assert_int_equal(sg__lh_json_bool("{\"succeeded\":maybe}", 19, "succeeded"),
                   SG_EINVAL);
}

/* ---- base64 ------------------------------------------------------------ */

static void test_b64_round_trip(void **st) {
  (void)st;
  const char *in[] = {"", "m", "me", "p/leader",
                      "/stepguard/lighthouse/quorum"};
  const char *want[] = {"", "bQ==", "bWU=", "cC9sZWFkZXI=",
                        "L3N0ZXBndWFyZC9saWdodGhvdXNlL3F1b3J1bQ=="};
  for (size_t i = 0; i < 5; i++) {
    char *e = sg__lh_b64_encode((const uint8_t *)in[i], strlen(in[i]));
    assert_non_null(e);
    assert_string_equal(e, want[i]);
    uint8_t *d = NULL;
    size_t dl = 0;
    assert_int_equal(sg__lh_b64_decode(e, strlen(e), &d, &dl), 0);
    assert_int_equal(dl, strlen(in[i]));
    assert_memory_equal(d, in[i], dl);
    sg_free(d);
    sg_free(e);
  }
}

static void test_b64_rejects_garbage(void **st) {
  (void)st;
  const char *bad[] = {"a", "abc", "ab=c", "a===", "ab!d", "=abc", "bQ==bQ=="};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint8_t *d = NULL;
    size_t dl = 0;
    assert_int_equal(sg__lh_b64_decode(bad[i], strlen(bad[i]), &d, &dl),
                     SG_EINVAL);
    assert_null(d);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_deadline_is_send_plus_ttl_minus_margin),
      cmocka_unit_test(test_deadline_gone_lease_is_past),
      cmocka_unit_test(test_deadline_saturates),
      cmocka_unit_test(test_single_always_decides_and_answers),
      cmocka_unit_test(test_follower_never_decides),
      cmocka_unit_test(test_leader_only_inside_its_lease),
      cmocka_unit_test(test_new_id_waits_for_etcd),
      cmocka_unit_test(test_leader_not_ready_until_it_read_etcd),
      cmocka_unit_test(test_role_names),
      cmocka_unit_test(test_record_round_trip),
      cmocka_unit_test(test_record_id_alone_and_empty_lines),
      cmocka_unit_test(test_record_rejects_garbage),
      cmocka_unit_test(test_record_alloc_failure),
      cmocka_unit_test(test_json_fields),
      cmocka_unit_test(test_json_garbage),
      cmocka_unit_test(test_b64_round_trip),
      cmocka_unit_test(test_b64_rejects_garbage),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
