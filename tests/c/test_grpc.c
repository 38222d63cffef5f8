/*
 * test_grpc.c: the pure gRPC helpers of src/rpc/grpc.c: status names and
 * error mapping, the 5-byte message prefix, grpc-timeout parsing and
 * formatting, grpc-message percent-encoding, UTF-8 validation.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "rpc/grpc.h"

static void test_status_names_and_errors(void **state) {
  (void)state;
  assert_string_equal(sg__grpc_status_name(SG_GRPC_OK), "OK");
  assert_string_equal(sg__grpc_status_name(SG_GRPC_DEADLINE_EXCEEDED),
                      "DEADLINE_EXCEEDED");
  assert_string_equal(sg__grpc_status_name(SG_GRPC_UNAUTHENTICATED),
                      "UNAUTHENTICATED");
  assert_string_equal(sg__grpc_status_name(17), "UNKNOWN");
  assert_string_equal(sg__grpc_status_name(-1), "UNKNOWN");
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_OK), 0);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_DEADLINE_EXCEEDED),
                   SG_ETIMEDOUT);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_CANCELLED), SG_ETIMEDOUT);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_UNAUTHENTICATED), SG_EAUTH);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_NOT_FOUND), SG_ENOTFOUND);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_RESOURCE_EXHAUSTED),
                   SG_ETOOBIG);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_INVALID_ARGUMENT), SG_EINVAL);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_UNAVAILABLE),
                   SG_ECONNREFUSED);
  assert_int_equal(sg__grpc_status_to_err(SG_GRPC_INTERNAL), SG_EPEER);
}

static void test_prefix_roundtrip_and_errors(void **state) {
  (void)state;
  uint8_t p[SG_GRPC_PREFIX_LEN];
  uint32_t len = 0;
  int comp = -1;
  sg__grpc_prefix_write(p, 0x01020304);
  assert_memory_equal(p, "\x00\x01\x02\x03\x04", 5);
  assert_int_equal(sg__grpc_prefix_parse(p, 5, UINT32_MAX, &len, &comp), 0);
  assert_int_equal(len, 0x01020304);
  assert_int_equal(comp, 0);
  /* too short, over the limit, bad flag, compressed */
  assert_int_equal(sg__grpc_prefix_parse(p, 4, UINT32_MAX, &len, &comp),
                   SG_EAGAIN);
  assert_int_equal(sg__grpc_prefix_parse(p, 5, 0x01020303, &len, &comp),
                   SG_ETOOBIG);
  assert_int_equal(sg__grpc_prefix_parse(p, 5, 0x01020304, &len, &comp), 0);
  p[0] = 2;
  assert_int_equal(sg__grpc_prefix_parse(p, 5, UINT32_MAX, &len, &comp),
                   SG_EPROTO);
  p[0] = 1;
  assert_int_equal(sg__grpc_prefix_parse(p, 5, UINT32_MAX, &len, &comp), 0);
  assert_int_equal(comp, 1);
  sg__grpc_prefix_write(p, UINT32_MAX);
  assert_int_equal(sg__grpc_prefix_parse(p, 5, UINT32_MAX, &len, &comp), 0);
  assert_int_equal(len, UINT32_MAX);
}

static void test_timeout_parse(void **state) {
  (void)state;
  static const struct {
    const char *v;
    int64_t ns;
  } ok[] = {
      {"1n", 1},
      {"5u", 5000},
      {"100m", 100000000},
      {"10S", INT64_C(10000000000)},
      {"2M", INT64_C(120000000000)},
      {"1H", INT64_C(3600000000000)},
      {"99999999H", INT64_MAX}, /* saturates */
      {"00000000n", 0},
  };
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    int64_t ns = -1;
    assert_int_equal(sg__grpc_timeout_parse(ok[i].v, strlen(ok[i].v), &ns), 0);
    assert_true(ns == ok[i].ns);
  }
  static const char *const bad[] = {"",    "S",  "1",  "1x",         "-1S",
                                    "1 S", "1s", "1h", "123456789S", "S1"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    int64_t ns = 42;
    assert_int_equal(sg__grpc_timeout_parse(bad[i], strlen(bad[i]), &ns),
                     SG_EINVAL);
    assert_true(ns == 42);
  }
  /* not NUL-terminated: only n bytes are read */
  int64_t ns;
  assert_int_equal(sg__grpc_timeout_parse("7mXYZ", 2, &ns), 0);
  assert_true(ns == 7000000);
}

static void test_timeout_format_roundtrips(void **state) {
  (void)state;
  char out[16];
  assert_int_equal(sg__grpc_timeout_format(1, out), 2);
  assert_string_equal(out, "1n");
  sg__grpc_timeout_format(INT64_C(10000000000), out);
  assert_string_equal(out, "10000000u");
  sg__grpc_timeout_format(INT64_C(100000000), out); /* 100 ms fits in ns */
  assert_string_equal(out, "100000u");
  sg__grpc_timeout_format(0, out); /* clamps to 1 ns */
  assert_string_equal(out, "1n");
  sg__grpc_timeout_format(INT64_MAX, out);
  assert_true(strlen(out) <= 9);
  const int64_t samples[] = {1,
                             999,
                             123456789,
                             INT64_C(99999999),
                             INT64_C(100000000),
                             INT64_C(3600000000000),
                             INT64_C(86400000000000),
                             INT64_C(1234567890123456)};
  for (size_t i = 0; i < sizeof(samples) / sizeof(samples[0]); i++) {
    size_t n = sg__grpc_timeout_format(samples[i], out);
    assert_int_equal(n, strlen(out));
    assert_true(n >= 2 && n <= 9);
    int64_t back;
    assert_int_equal(sg__grpc_timeout_parse(out, n, &back), 0);
    /* rounds up, never down, by less than one unit */
    int64_t unit = 1;
    switch (out[n - 1]) {
    case 'u':
      unit = 1000;
      break;
    case 'm':
      unit = 1000000;
      break;
    case 'S':
      unit = 1000000000;
      break;
    case 'M':
      unit = INT64_C(60000000000);
      break;
    case 'H':
      unit = INT64_C(3600000000000);
      break;
    }
    assert_true(back >= samples[i]);
    assert_true(back - samples[i] < unit);
  }
}

static void test_message_encode_decode(void **state) {
  (void)state;
  char enc[64], dec[64];
  size_t n = sg__grpc_message_encode("plain text", enc, sizeof(enc));
  assert_string_equal(enc, "plain text");
  assert_int_equal(n, 10);
  n = sg__grpc_message_encode("100% \xc3\xa9\n", enc, sizeof(enc));
  assert_string_equal(enc, "100%25 %C3%A9%0A");
  assert_int_equal(n, strlen(enc));
  sg__grpc_message_decode(enc, n, dec, sizeof(dec));
  assert_string_equal(dec, "100% \xc3\xa9\n");
  /* truncation never splits an escape */
  n = sg__grpc_message_encode("ab\xff", enc, 5);
  assert_string_equal(enc, "ab");
  assert_int_equal(n, 2);
  assert_int_equal(sg__grpc_message_encode("x", enc, 0), 0);
  /* invalid escapes are kept */
  sg__grpc_message_decode("%zz%4", 5, dec, sizeof(dec));
  assert_string_equal(dec, "%zz%4");
  sg__grpc_message_decode("%41%62", 6, dec, 2);
  assert_string_equal(dec, "A");
}

static void test_utf8(void **state) {
  (void)state;
  assert_true(sg__utf8_valid("", 0));
  assert_true(sg__utf8_valid("ascii", 5));
  assert_true(sg__utf8_valid("\xc3\xa9", 2));          /* e-acute */
  assert_true(sg__utf8_valid("\xe2\x82\xac", 3));      /* euro */
  assert_true(sg__utf8_valid("\xf0\x9f\x98\x80", 4));  /* emoji */
  assert_true(sg__utf8_valid("a\0b", 3));              /* NUL is valid */
  assert_false(sg__utf8_valid("\xc3", 1));             /* truncated */
  assert_false(sg__utf8_valid("\xc0\xaf", 2));         /* overlong */
  assert_false(sg__utf8_valid("\xed\xa0\x80", 3));     /* surrogate */
  assert_false(sg__utf8_valid("\xf4\x90\x80\x80", 4)); /* > U+10FFFF */
  assert_false(sg__utf8_valid("\x80", 1));             /* lone cont. */
  assert_false(sg__utf8_valid("\xe2\x28\xa1", 3));     /* bad cont. */
  assert_false(sg__utf8_valid("\xff", 1));
  /* long strings take the eight-bytes-at-a-time ASCII path: a sequence or
   * a bad byte at every offset, across and at the end of the chunks */
  char buf[40];
  for (size_t at = 0; at + 2 <= 24; at++) {
    memset(buf, 'a', sizeof(buf));
    memcpy(buf + at, "\xc3\xa9", 2);
    assert_true(sg__utf8_valid(buf, 24));
    memcpy(buf + at, "\xc3\x28", 2); /* bad continuation */
    assert_false(sg__utf8_valid(buf, 24));
    buf[at] = '\x80';
    buf[at + 1] = 'a';
    assert_false(sg__utf8_valid(buf, 24));
    buf[at] = '\0'; /* a NUL is valid UTF-8 */
    assert_true(sg__utf8_valid(buf, 24));
  }
  memset(buf, 'a', sizeof(buf));
  buf[23] = '\xc3'; /* cut at the end of the third chunk */
  assert_false(sg__utf8_valid(buf, 24));
  memcpy(buf + 6, "\xf0\x9f\x98\x80", 4); /* straddles the first chunk */
  buf[23] = 'a';
  assert_true(sg__utf8_valid(buf, 24));
  assert_true(sg__utf8_valid(buf, 17)); /* not a multiple of eight */
  buf[16] = '\xff';
  assert_false(sg__utf8_valid(buf, 17));
}

/* A QuorumRequest-shaped spec: field 1 is a member with strings 1, 2, 7. */
static const uint32_t member_strings[] = {1, 2, 7};
static const sg__pb_spec_t member = {member_strings, 3, NULL, 0};
static const sg__pb_nested_t outer_nested[] = {{1, &member}};
static const sg__pb_spec_t outer = {NULL, 0, outer_nested, 1};
/* a spec that nests into itself through field 1, for the depth limit */
static const sg__pb_spec_t self_spec;
static const sg__pb_nested_t self_nested[] = {{1, &self_spec}};
static const sg__pb_spec_t self_spec = {NULL, 0, self_nested, 1};

static void test_pb_check_strings(void **state) {
  (void)state;
  uint32_t field = 99;
  /* requester{replica_id="ab", step=5 (varint), world_size fixed64} */
  const uint8_t ok[] = {0x0a, 0x0f, 0x0a, 0x02, 'a', 'b', 0x20, 0x05, 0x29,
                        1,    2,    3,    4,    5,   6,   7,    8};
  assert_int_equal(sg__pb_check_strings(ok, sizeof(ok), &outer, &field), 0);
  assert_int_equal(field, 0);
  /* an unknown length-delimited field with binary content is fine */
  const uint8_t unknown[] = {0x0a, 0x04, 0x4a, 0x02, 0xff, 0x00};
  assert_int_equal(
      sg__pb_check_strings(unknown, sizeof(unknown), &outer, &field), 0);
  /* invalid UTF-8 in replica_id (field 1 of the member) */
  const uint8_t bad_utf8[] = {0x0a, 0x04, 0x0a, 0x02, 0xff, 0xfe};
  assert_int_equal(
      sg__pb_check_strings(bad_utf8, sizeof(bad_utf8), &outer, &field),
      SG_EINVAL);
  assert_int_equal(field, 1);
  /* a NUL inside data (field 7) */
  const uint8_t nul[] = {0x0a, 0x05, 0x3a, 0x03, 'a', 0x00, 'b'};
  assert_int_equal(sg__pb_check_strings(nul, sizeof(nul), &outer, &field),
                   SG_EINVAL);
  assert_int_equal(field, 7);
  /* malformed: truncated varint, length past the end, a group, wire 7 */
  const uint8_t trunc[] = {0x0a, 0x80};
  const uint8_t past[] = {0x0a, 0x05, 0x0a};
  const uint8_t group[] = {0x0b};
  const uint8_t wire7[] = {0x0f};
  const uint8_t field0[] = {0x02, 0x00};
  assert_int_equal(sg__pb_check_strings(trunc, sizeof(trunc), &outer, &field),
                   SG_EPROTO);
  assert_int_equal(sg__pb_check_strings(past, sizeof(past), &outer, &field),
                   SG_EPROTO);
  assert_int_equal(sg__pb_check_strings(group, sizeof(group), &outer, &field),
                   SG_EPROTO);
  assert_int_equal(sg__pb_check_strings(wire7, sizeof(wire7), &outer, &field),
                   SG_EPROTO);
  assert_int_equal(sg__pb_check_strings(field0, sizeof(field0), &outer, &field),
                   SG_EPROTO);
  /* nesting: 16 levels pass, 20 do not */
  uint8_t deep[64];
  for (int levels = 16; levels <= 20; levels += 4) {
    size_t n = 0;
    for (int i = 0; i < levels; i++) {
      deep[n++] = 0x0a;
      deep[n++] = (uint8_t)(2 * (levels - 1 - i));
    }
    int rc = sg__pb_check_strings(deep, n, &self_spec, &field);
    assert_int_equal(rc, levels <= 16 ? 0 : SG_EPROTO);
  }
  /* empty message */
  assert_int_equal(sg__pb_check_strings(ok, 0, &outer, &field), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_names_and_errors),
      cmocka_unit_test(test_prefix_roundtrip_and_errors),
      cmocka_unit_test(test_timeout_parse),
      cmocka_unit_test(test_timeout_format_roundtrips),
      cmocka_unit_test(test_message_encode_decode),
      cmocka_unit_test(test_utf8),
      cmocka_unit_test(test_pb_check_strings),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
