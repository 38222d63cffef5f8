/*
 * test_base.c: the C core's conventions: error codes, clocks, the bounded
 * buffer, allocation failure injection, logging and socket flags.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "stepguard/base.h"
#include "stepguard/samehost.h"

static void test_error_codes_are_distinct_and_named(void **state) {
  (void)state;
  const int codes[] = {
      SG_OK,        SG_EINVAL,     SG_ENOMEM,       SG_EAGAIN,    SG_ETIMEDOUT,
      SG_ECANCELED, SG_ECONNRESET, SG_ECONNREFUSED, SG_EPIPE,     SG_EADDRINUSE,
      SG_EIO,       SG_ETOOBIG,    SG_EAUTH,        SG_ENOTFOUND, SG_ESTATE,
      SG_ECLOSED,   SG_EABORTED,   SG_EPEER,        SG_EPROTO};
  size_t n = sizeof(codes) / sizeof(codes[0]);
  for (size_t i = 0; i < n; i++) {
    assert_true(codes[i] <= 0);
    assert_string_not_equal(sg_strerror(codes[i]), "unknown error");
    assert_string_not_equal(sg_err_name(codes[i]), "SG_E?");
    for (size_t j = i + 1; j < n; j++)
      assert_int_not_equal(codes[i], codes[j]);
  }
  assert_int_equal(SG_ETIMEDOUT, -ETIMEDOUT);
  assert_string_equal(sg_err_name(SG_ETIMEDOUT), "SG_ETIMEDOUT");
  assert_string_equal(sg_strerror(SG_ETOOBIG), "length over limit");
  assert_string_equal(sg_strerror(12345), "unknown error");
  assert_string_equal(sg_strerror(-ENOTDIR), "system error");
  /* project codes sit outside every errno value */
  assert_true(SG_ETOOBIG < -4095 && SG_EPROTO < -4095);
}

static void test_hex_digit(void **state) {
  (void)state;
  assert_int_equal(sg_hex_digit('0'), 0);
  assert_int_equal(sg_hex_digit('9'), 9);
  assert_int_equal(sg_hex_digit('a'), 10);
  assert_int_equal(sg_hex_digit('F'), 15);
  assert_int_equal(sg_hex_digit('g'), -1);
  assert_int_equal(sg_hex_digit('/'), -1);
  assert_int_equal(sg_hex_digit('\0'), -1);
}

static void test_fatal_threshold(void **state) {
  (void)state;
  assert_true(sg_err_is_fatal(SG_EABORTED));
  assert_true(sg_err_is_fatal(SG_EPEER));
  assert_true(sg_err_is_fatal(SG_EPROTO));
  assert_true(sg_err_is_fatal(SG_ECONNRESET));
  assert_false(sg_err_is_fatal(SG_OK));
  assert_false(sg_err_is_fatal(SG_ETIMEDOUT));
  assert_false(sg_err_is_fatal(SG_ETOOBIG));
  assert_false(sg_err_is_fatal(SG_EAUTH));
}

static void test_err_set_formats_and_truncates(void **state) {
  (void)state;
  sg_err_t err;
  sg_err_clear(&err);
  assert_int_equal(err.code, 0);
  assert_string_equal(err.msg, "");
  assert_int_equal(sg_err_set(&err, SG_EPEER, "rank %d: %s", 3, "reset"),
                   SG_EPEER);
  assert_int_equal(err.code, SG_EPEER);
  assert_string_equal(err.msg, "rank 3: reset");
  char big[600];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  sg_err_set(&err, SG_EINVAL, "%s", big);
  assert_int_equal(strlen(err.msg), sizeof(err.msg) - 1);
  assert_int_equal(sg_err_set(NULL, SG_EIO, "ignored"), SG_EIO);
}

static void test_clock_is_monotonic_and_deadlines_saturate(void **state) {
  (void)state;
  int64_t a = sg_now_ns();
  int64_t b = sg_now_ns();
  assert_true(b >= a);
  assert_true(sg_wall_ns() > INT64_C(1600000000) * 1000000000);

  sg_deadline_t d = sg_deadline_in_ms(60000);
  assert_false(sg_deadline_passed(d));
  int64_t left = sg_deadline_left_ms(d);
  assert_true(left > 50000 && left <= 60000);

  assert_true(sg_deadline_passed(sg_deadline_in_ms(0)));
  assert_true(sg_deadline_passed(sg_deadline_in_ms(-5)));
  assert_int_equal(sg_deadline_left_ms(sg_deadline_in_ms(-5)), 0);
  assert_true(sg_deadline_in_ms(INT64_MAX) == INT64_MAX);
  /* a part of a millisecond left counts as a whole one: rounding is up */
  assert_int_equal(sg_deadline_left_ms(sg_now_ns() + 1000000000), 1000);
}

static void test_buf_limits_and_compaction(void **state) {
  (void)state;
  sg_buf_t b;
  sg_buf_init(&b, 1000);
  uint8_t chunk[300];
  for (size_t i = 0; i < sizeof(chunk); i++)
    chunk[i] = (uint8_t)i;
  assert_int_equal(sg_buf_append(&b, chunk, 300), 0);
  assert_int_equal(sg_buf_append(&b, chunk, 300), 0);
  assert_int_equal(sg_buf_append(&b, chunk, 300), 0);
  assert_int_equal(b.len, 900);
  /* over the limit: error and nothing changed */
  assert_int_equal(sg_buf_append(&b, chunk, 101), SG_ETOOBIG);
  assert_int_equal(b.len, 900);
  /* overflow-safe check on huge sizes */
  assert_int_equal(sg_buf_reserve(&b, SIZE_MAX), SG_ETOOBIG);
  assert_int_equal(sg_buf_reserve(&b, SIZE_MAX - 100), SG_ETOOBIG);

  sg_buf_consume(&b, 600);
  assert_int_equal(b.len, 300);
  assert_memory_equal(sg_buf_head(&b), chunk, 300);
  /* after consuming, the same capacity holds new data: total passing
   * through far exceeds max while memory stays bounded */
  for (int round = 0; round < 50; round++) {
    assert_int_equal(sg_buf_append(&b, chunk, 300), 0);
    sg_buf_consume(&b, 300);
    assert_true(b.cap <= 1000);
  }
  assert_memory_equal(sg_buf_head(&b), chunk, 300);

  assert_int_equal(sg_buf_reserve(&b, 10), 0);
  memcpy(sg_buf_tail(&b), "0123456789", 10);
  sg_buf_commit(&b, 10);
  assert_int_equal(b.len, 310);
  assert_memory_equal(sg_buf_head(&b) + 300, "0123456789", 10);

  /* a buffer smaller than the first allocation step never allocates more
   * than its maximum (found by fuzz_buf) */
  sg_buf_t small;
  sg_buf_init(&small, 10);
  assert_int_equal(sg_buf_append(&small, "0123456789", 10), 0);
  assert_true(small.cap <= 10);
  assert_int_equal(sg_buf_append(&small, "x", 1), SG_ETOOBIG);
  sg_buf_free(&small);

  sg_buf_consume(&b, 1000); /* more than len empties it */
  assert_int_equal(b.len, 0);
  sg_buf_free(&b);
  assert_null(b.data);
  assert_int_equal(b.max, 1000);
}

static void test_buf_survives_allocation_failure(void **state) {
  (void)state;
  sg_buf_t b;
  sg_buf_init(&b, 1 << 20);
  assert_int_equal(sg_buf_append(&b, "abc", 3), 0);
  sg_test_fail_alloc(1, 0);
  uint8_t big[4096] = {0};
  assert_int_equal(sg_buf_append(&b, big, sizeof(big)), SG_ENOMEM);
  assert_int_equal(sg_test_fail_alloc(0, 0), 1);
  assert_int_equal(b.len, 3);
  assert_memory_equal(sg_buf_head(&b), "abc", 3);
  assert_int_equal(sg_buf_append(&b, big, sizeof(big)), 0);
  sg_buf_free(&b);
}

static void test_alloc_injection_counts(void **state) {
  (void)state;
  sg_test_fail_alloc(3, 0);
  void *a = sg_malloc(8), *b = sg_malloc(8), *c = sg_malloc(8);
  void *d = sg_malloc(8);
  assert_non_null(a);
  assert_non_null(b);
  assert_null(c);
  assert_non_null(d); /* not sticky: only the third failed */
  sg_free(a);
  sg_free(b);
  sg_free(d);
  assert_int_equal(sg_test_fail_alloc(1, 1), 1);
  assert_null(sg_malloc(1));
  assert_null(sg_strdup("x"));
  assert_int_equal(sg_test_fail_alloc(0, 0), 2);
  char *s = sg_strdup("hello");
  assert_string_equal(s, "hello");
  sg_free(s);
}

struct captured {
  int calls;
  sg_log_level_t level;
  char subsystem[32];
  char line[256];
};

static void capture_cb(void *ud, sg_log_level_t level, const char *subsystem,
                       const char *line) {
  struct captured *c = ud;
  c->calls++;
  c->level = level;
  snprintf(c->subsystem, sizeof(c->subsystem), "%s", subsystem);
  snprintf(c->line, sizeof(c->line), "%s", line);
}

static void test_log_levels_and_sink(void **state) {
  (void)state;
  struct captured c = {0};
  sg_log_set_sink(capture_cb, &c);
  sg_log_set_level(SG_LOG_INFO);
  sg_log(SG_LOG_DEBUG, "test", "hidden %d", 1);
  assert_int_equal(c.calls, 0);
  assert_false(sg_log_enabled(SG_LOG_DEBUG));
  sg_log(SG_LOG_WARN, "lighthouse", "quorum %d", 7);
  assert_int_equal(c.calls, 1);
  assert_int_equal(c.level, SG_LOG_WARN);
  assert_string_equal(c.subsystem, "lighthouse");
  assert_string_equal(c.line, "quorum 7");
  sg_log_set_level(SG_LOG_TRACE);
  sg_log(SG_LOG_TRACE, "test", "shown");
  assert_int_equal(c.calls, 2);
  sg_log_set_sink(NULL, NULL);
  sg_log_set_level(SG_LOG_INFO);

  assert_int_equal(sg_log_level_parse("debug"), SG_LOG_DEBUG);
  assert_int_equal(sg_log_level_parse("WARN"), SG_LOG_WARN);
  assert_int_equal(sg_log_level_parse("warning"), SG_LOG_WARN);
  assert_int_equal(sg_log_level_parse("loud"), -1);
  assert_int_equal(sg_log_level_parse(NULL), -1);
}

/* The default sink never blocks on a full stderr (a pipe nobody reads
 * would otherwise stop the thread that logs, a server's loop among them):
 * the lines that do not fit are counted, and reported once stderr takes
 * lines again. */
static void test_log_to_full_stderr_never_blocks(void **state) {
  (void)state;
  int p[2];
  assert_int_equal(pipe(p), 0);
  int saved = dup(STDERR_FILENO);
  assert_true(saved >= 0);
  assert_true(dup2(p[1], STDERR_FILENO) >= 0);
  /* fill the pipe, then make its write end blocking again, as stderr is */
  int fl = fcntl(p[1], F_GETFL);
  assert_int_equal(fcntl(p[1], F_SETFL, fl | O_NONBLOCK), 0);
  char junk[512];
  memset(junk, 'x', sizeof(junk));
  while (write(p[1], junk, sizeof(junk)) > 0)
    ;
  assert_int_equal(fcntl(p[1], F_SETFL, fl & ~O_NONBLOCK), 0);

  alarm(20); /* a blocked write would end the test here */
  for (int i = 0; i < 200; i++)
    sg_log(SG_LOG_WARN, "test", "line %d that does not fit", i);
  alarm(0);

  /* drain, then the next line gets through after the count */
  assert_int_equal(fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK), 0);
  char buf[4096];
  while (read(p[0], buf, sizeof(buf)) > 0)
    ;
  sg_log(SG_LOG_WARN, "test", "after the drain");
  ssize_t n = read(p[0], buf, sizeof(buf) - 1);
  assert_true(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  close(p[0]);
  close(p[1]);
  assert_true(n > 0);
  buf[n] = '\0';
  assert_non_null(strstr(buf, "200 log line(s) dropped: stderr was full\n"));
  assert_non_null(strstr(buf, "after the drain"));
  assert_null(strstr(buf, "does not fit"));
}

/* A line that fits in what is left of a pipe goes in, even when the pipe
 * has no free page (a one-page pipe after its first line: it polls full),
 * and stderr's descriptor stays as it was (blocking). */
static void test_log_to_one_page_pipe_takes_what_fits(void **state) {
  (void)state;
  int p[2];
  assert_int_equal(pipe(p), 0);
  assert_true(fcntl(p[1], F_SETPIPE_SZ, 4096) >= 4096);
  int saved = dup(STDERR_FILENO);
  assert_true(saved >= 0);
  assert_true(dup2(p[1], STDERR_FILENO) >= 0);
  char word[1001];
  memset(word, 'w', sizeof(word) - 1);
  word[sizeof(word) - 1] = '\0';
  alarm(20); /* a blocked write would end the test here */
  sg_log(SG_LOG_WARN, "test", "first %s", word);
  sg_log(SG_LOG_WARN, "test", "second %s", word);
  alarm(0);
  int fl = fcntl(STDERR_FILENO, F_GETFL);
  assert_int_equal(fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK), 0);
  char buf[8192];
  size_t got = 0;
  ssize_t n;
  while (got < sizeof(buf) - 1 &&
         (n = read(p[0], buf + got, sizeof(buf) - 1 - got)) > 0)
    got += (size_t)n;
  buf[got] = '\0';
  assert_true(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  close(p[0]);
  close(p[1]);
  assert_false(fl & O_NONBLOCK);
  assert_non_null(strstr(buf, "first www"));
  assert_non_null(strstr(buf, "second www"));
  assert_null(strstr(buf, "dropped"));
}

static int is_cloexec(int fd) {
  int flags = fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC);
}

static void test_sockets_are_cloexec_and_registered(void **state) {
  (void)state;
  sg_err_t err;
  int lfd = -1, cfd = -1, afd = -1, port = 0;
  size_t before = sg_sock_registered_count();
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 16, &lfd, &port, &err), 0);
  assert_true(port > 0);
  assert_int_equal(
      sg_sock_connect("127.0.0.1", port, sg_deadline_in_ms(5000), &cfd, &err),
      0);
  sg_deadline_t d = sg_deadline_in_ms(5000);
  int rc;
  while ((rc = sg_sock_accept(lfd, &afd)) == SG_EAGAIN &&
         !sg_deadline_passed(d))
    usleep(1000);
  assert_int_equal(rc, 0);
  assert_true(is_cloexec(lfd) && is_cloexec(cfd) && is_cloexec(afd));
  assert_true(fcntl(cfd, F_GETFL) & O_NONBLOCK);
  assert_int_equal(sg_sock_registered_count(), before + 3);
  sg_sock_close(afd);
  sg_sock_close(cfd);
  sg_sock_close(lfd);
  assert_int_equal(sg_sock_registered_count(), before);
}

static void test_connect_errors(void **state) {
  (void)state;
  sg_err_t err;
  int lfd = -1, port = 0, fd = -1;
  /* find a port that nobody listens on: bind, note it, close */
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 1, &lfd, &port, &err), 0);
  sg_sock_close(lfd);
  assert_int_equal(
      sg_sock_connect("127.0.0.1", port, sg_deadline_in_ms(5000), &fd, &err),
      SG_ECONNREFUSED);
  assert_non_null(strstr(err.msg, "connection refused"));
  assert_int_equal(sg_sock_connect("no-such-host.invalid", 80,
                                   sg_deadline_in_ms(5000), &fd, &err),
                   SG_ENOTFOUND);
  assert_int_equal(sg_sock_listen("127.0.0.1", 70000, 1, &lfd, &port, &err),
                   SG_EINVAL);
  assert_int_equal(sg_sock_register(-1), SG_EINVAL);
  assert_int_equal(sg_sock_unregister(123456), SG_EINVAL);
  assert_int_equal(sg_sock_registered_count(), 0);
}

static void test_map_put_get_del_iterate(void **state) {
  (void)state;
  sg_map_t m;
  sg_map_init(&m);
  assert_null(sg_map_get(&m, "missing"));
  assert_null(sg_map_del(&m, "missing"));
  static int vals[5000];
  char key[32];
  for (int i = 0; i < 5000; i++) {
    snprintf(key, sizeof(key), "replica-%d", i);
    void *old = &m;
    assert_int_equal(sg_map_put(&m, key, &vals[i], &old), 0);
    assert_null(old);
  }
  assert_int_equal(m.len, 5000);
  void *old = NULL;
  assert_int_equal(sg_map_put(&m, "replica-7", &vals[8], &old), 0);
  assert_ptr_equal(old, &vals[7]);
  assert_int_equal(m.len, 5000);
  /* delete every other key, then churn: tombstones must not fill the table */
  for (int i = 0; i < 5000; i += 2) {
    snprintf(key, sizeof(key), "replica-%d", i);
    assert_non_null(sg_map_del(&m, key));
  }
  for (int round = 0; round < 20000; round++) {
    snprintf(key, sizeof(key), "churn-%d", round);
    assert_int_equal(sg_map_put(&m, key, &vals[0], NULL), 0);
    assert_ptr_equal(sg_map_del(&m, key), &vals[0]);
  }
  assert_true(m.cap <= 16384);
  for (int i = 0; i < 5000; i++) {
    snprintf(key, sizeof(key), "replica-%d", i);
    void *v = sg_map_get(&m, key);
    if (i % 2 == 0)
      assert_null(v);
    else
      assert_ptr_equal(v, i == 7 ? &vals[8] : &vals[i]);
  }
  size_t pos = 0, n = 0;
  const char *k;
  void *v;
  while (sg_map_next(&m, &pos, &k, &v)) {
    assert_non_null(strstr(k, "replica-"));
    n++;
  }
  assert_int_equal(n, 2500);
  sg_map_free(&m);
  assert_int_equal(m.len, 0);
}

static void test_map_survives_allocation_failure(void **state) {
  (void)state;
  sg_map_t m;
  sg_map_init(&m);
  int v = 1;
  for (long nth = 1; nth <= 3; nth++) {
    sg_test_fail_alloc(nth, 0);
    int rc = sg_map_put(&m, "a", &v, NULL);
    sg_test_fail_alloc(0, 0);
    if (rc == 0)
      break;
    assert_int_equal(rc, SG_ENOMEM);
    assert_int_equal(m.len, 0);
    assert_null(sg_map_get(&m, "a"));
  }
  assert_ptr_equal(sg_map_get(&m, "a"), &v);
  sg_map_free(&m);
}

/* ---- addresses and byte order -------------------------------------------- */

static void test_addr_split_accepts_and_refuses(void **state) {
  (void)state;
  char host[64];
  int port = -1;
  sg_err_t err;
  assert_int_equal(sg_addr_split("h.example:80", host, 64, &port, NULL), 0);
  assert_string_equal(host, "h.example");
  assert_int_equal(port, 80);
  assert_int_equal(sg_addr_split("[::1]:65535", host, 64, &port, NULL), 0);
  assert_string_equal(host, "::1");
  assert_int_equal(port, 65535);
  assert_int_equal(sg_addr_split("127.0.0.1:0", host, 64, &port, NULL), 0);
  assert_int_equal(port, 0); /* binding: a dialer refuses 0 itself */
  const char *bad[] = {"",        "host",  "h:",     ":80",
                       "h:65536", "h:1x",  "h:-1",   "h:123456",
                       "[]:1",    "[::1]", "[::1]5", "::1:5",
                       "h :1",    "h/x:1", "[::1:5", "h:1:2"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    sg_err_clear(&err);
    assert_int_equal(sg_addr_split(bad[i], host, 64, &port, &err), SG_EINVAL);
    assert_non_null(strstr(err.msg, "address"));
  }
  assert_int_equal(sg_addr_split(NULL, host, 64, &port, NULL), SG_EINVAL);
  sg_err_clear(&err);
  assert_int_equal(sg_addr_split("::1:5", host, 64, &port, &err), SG_EINVAL);
  assert_non_null(strstr(err.msg, "brackets"));
  /* the host must fit, with its NUL */
  assert_int_equal(sg_addr_split("abcd:1", host, 4, &port, NULL), SG_EINVAL);
  assert_int_equal(sg_addr_split("abc:1", host, 4, &port, NULL), 0);
  char longaddr[SG_ADDR_MAX + 8];
  memset(longaddr, 'a', sizeof(longaddr));
  memcpy(longaddr + SG_ADDR_MAX - 2, ":1", 3);
  assert_int_equal(sg_addr_split(longaddr, host, 64, &port, NULL), SG_EINVAL);
  memcpy(longaddr + SG_ADDR_MAX + 2, ":1", 3);
  assert_int_equal(sg_addr_split(longaddr, host, 64, &port, NULL), SG_EINVAL);
}

static void test_addr_advertised_rule(void **state) {
  (void)state;
  char host[128];
  char *saved = getenv("STEPGUARD_ADVERTISE_HOST");
  saved = saved ? strdup(saved) : NULL;
  unsetenv("STEPGUARD_ADVERTISE_HOST");
  sg_addr_advertised("opt.example", "fb.example", host, sizeof(host));
  assert_string_equal(host, "opt.example");
  sg_addr_advertised(NULL, "fb.example", host, sizeof(host));
  assert_string_equal(host, "fb.example");
  sg_addr_advertised("", "", host, sizeof(host));
  assert_true(host[0] != '\0'); /* gethostname() */
  sg_addr_advertised("::1", NULL, host, sizeof(host));
  assert_string_equal(host, "[::1]");
  sg_addr_advertised("lo", NULL, host, sizeof(host)); /* an interface */
  assert_string_equal(host, "127.0.0.1");
  setenv("STEPGUARD_ADVERTISE_HOST", "env.example", 1);
  sg_addr_advertised("opt.example", "fb.example", host, sizeof(host));
  assert_string_equal(host, "env.example"); /* the variable wins */
  sg_addr_advertised("opt.example", NULL, host, 4);
  assert_string_equal(host, "env"); /* truncated, terminated */
  if (saved) {
    setenv("STEPGUARD_ADVERTISE_HOST", saved, 1);
    free(saved);
  } else {
    unsetenv("STEPGUARD_ADVERTISE_HOST");
  }
}

static void test_little_endian_codecs(void **state) {
  (void)state;
  uint8_t b[8];
  sg_put_le16(b, 0x0102);
  assert_memory_equal(b, "\x02\x01", 2);
  assert_int_equal(sg_get_le16(b), 0x0102);
  sg_put_le32(b, 0x01020304u);
  assert_memory_equal(b, "\x04\x03\x02\x01", 4);
  assert_int_equal(sg_get_le32(b), 0x01020304u);
  sg_put_le64(b, 0x0102030405060708ull);
  assert_memory_equal(b, "\x08\x07\x06\x05\x04\x03\x02\x01", 8);
  assert_true(sg_get_le64(b) == 0x0102030405060708ull);
  sg_put_le64(b, UINT64_MAX);
  assert_true(sg_get_le64(b) == UINT64_MAX);
}

static void test_samehost_ids_match_rules(void **state) {
  (void)state;
  sg_samehost_id_t self, peer, back;
  unsetenv("STEPGUARD_SAME_HOST");
  assert_int_equal(sg_samehost_self(&self), 0);
  assert_int_equal(self.pid, (uint32_t)getpid());
  uint8_t wire[SG_SAMEHOST_ID_LEN];
  sg_samehost_encode(&self, wire);
  sg_samehost_decode(wire, &back);
  assert_memory_equal(&back, &self, sizeof self);

  peer = self;
  assert_false(sg_samehost_match(&self, &peer)); /* same process */
  peer.pid = self.pid + 1;
  assert_true(sg_samehost_match(&self, &peer));
  peer.pid_ns ^= 1; /* another pid namespace: the pid means nothing */
  assert_false(sg_samehost_match(&self, &peer));
  peer.pid_ns = self.pid_ns;
  peer.boot_id[3] ^= 0x40; /* another machine */
  assert_false(sg_samehost_match(&self, &peer));

  setenv("STEPGUARD_SAME_HOST", "0", 1);
  assert_int_equal(sg_samehost_self(&peer), SG_ESTATE);
  unsetenv("STEPGUARD_SAME_HOST");
}

/* A child announces a buffer; the parent reads it, then reads a dead pid. */
static void test_samehost_read_from_child(void **state) {
  (void)state;
  enum { N = (1 << 20) + 13 };
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    uint8_t *buf = malloc(N);
    if (!buf)
      _exit(1);
    for (size_t i = 0; i < N; i++)
      buf[i] = (uint8_t)(i * 7 + 1);
    uint64_t addr = (uint64_t)(uintptr_t)buf;
    if (write(fds[1], &addr, sizeof addr) != sizeof addr)
      _exit(1);
    pause(); /* until the parent kills it */
    _exit(0);
  }
  uint64_t addr = 0;
  assert_int_equal(read(fds[0], &addr, sizeof addr), (ssize_t)sizeof addr);
  close(fds[0]);
  close(fds[1]);

  uint8_t *got = malloc(N);
  assert_non_null(got);
  int rc = sg_samehost_read((uint32_t)child, got, addr, N);
  if (rc == -EPERM || rc == -ENOSYS) {
    /* A seccomp or ptrace policy forbids it: the caller falls back to TCP. */
    printf("cross-memory attach not permitted here (%s): fallback only\n",
           sg_strerror(rc));
  } else {
    assert_int_equal(rc, 0);
    for (size_t i = 0; i < N; i++)
      if (got[i] != (uint8_t)(i * 7 + 1))
        fail_msg("byte %zu differs", i);
    uint8_t expect[16];
    memcpy(expect, got, sizeof expect);
    assert_int_equal(sg_samehost_probe((uint32_t)child, addr, expect, 16), 0);
    expect[5] ^= 1;
    assert_int_equal(sg_samehost_probe((uint32_t)child, addr, expect, 16),
                     SG_EPROTO);
    assert_int_equal(sg_samehost_probe((uint32_t)child, addr, expect, 65),
                     SG_EINVAL);
    /* An address the child never mapped is an error, not a crash. */
    assert_true(sg_samehost_read((uint32_t)child, got, 8, 64) < 0);
  }
  kill(child, SIGKILL);
  int status;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(sg_samehost_read((uint32_t)child, got, addr, 64) < 0);
  free(got);
}

/*
 * Vectored reads: more pieces than one call takes, empty and odd-sized
 * pieces, a piece that straddles a page the child unmapped (the kernel stops
 * there: the pieces before it are copied, the call fails, nothing after it is
 * written), and a dead pid.
 */
static void test_samehost_readv_batches_and_partial_reads(void **state) {
  (void)state;
  enum { PAGES = 3, NPIECES = 3000 };
  const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  const size_t big = 4u << 20;
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    uint8_t *buf = malloc(big);
    uint8_t *hole = mmap(NULL, PAGES * pg, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!buf || hole == MAP_FAILED)
      _exit(1);
    for (size_t i = 0; i < big; i++)
      buf[i] = (uint8_t)(i * 13 + 5);
    memset(hole, 0xAB, PAGES * pg);
    if (munmap(hole + pg, pg) != 0)
      _exit(1);
    uint64_t addrs[2] = {(uint64_t)(uintptr_t)buf, (uint64_t)(uintptr_t)hole};
    if (write(fds[1], addrs, sizeof addrs) != sizeof addrs)
      _exit(1);
    pause();
    _exit(0);
  }
  uint64_t addrs[2] = {0, 0};
  assert_int_equal(read(fds[0], addrs, sizeof addrs), (ssize_t)sizeof addrs);
  close(fds[0]);
  close(fds[1]);

  uint8_t *got = calloc(1, big);
  sg_samehost_piece_t *pieces = calloc(NPIECES, sizeof(*pieces));
  assert_non_null(got);
  assert_non_null(pieces);
  /* NPIECES pieces in a scrambled order, sizes 0..1399 bytes */
  size_t off = 0, n = 0;
  for (; n < NPIECES && off < big; n++) {
    size_t len = (n * 37) % 1400;
    if (len > big - off)
      len = big - off;
    pieces[n].remote = addrs[0] + off;
    pieces[n].local = got + off;
    pieces[n].len = len;
    off += len;
  }
  for (size_t a = 0; a + 7 < n; a += 7) { /* order must not matter */
    sg_samehost_piece_t t = pieces[a];
    pieces[a] = pieces[a + 7];
    pieces[a + 7] = t;
  }
  int rc = sg_samehost_readv((uint32_t)child, pieces, n);
  if (rc == -EPERM || rc == -ENOSYS) {
    printf("cross-memory attach not permitted here (%s): fallback only\n",
           sg_strerror(rc));
  } else {
    assert_int_equal(rc, 0);
    assert_true(n > 2 * SG_SAMEHOST_IOV_MAX);
    for (size_t i = 0; i < off; i++)
      if (got[i] != (uint8_t)(i * 13 + 5))
        fail_msg("byte %zu differs", i);
    for (size_t i = off; i < big; i++)
      if (got[i] != 0)
        fail_msg("byte %zu past the pieces was written", i);
    assert_int_equal(sg_samehost_readv((uint32_t)child, pieces, 0), 0);

    /* [page 0: ok] [page 0 tail + page 1 (unmapped)] [page 2: ok] */
    uint8_t *dst = malloc(PAGES * pg);
    assert_non_null(dst);
    memset(dst, 0, PAGES * pg);
    sg_samehost_piece_t p3[3] = {
        {.remote = addrs[1], .local = dst, .len = pg / 2},
        {.remote = addrs[1] + pg / 2, .local = dst + pg / 2, .len = pg},
        {.remote = addrs[1] + 2 * pg, .local = dst + 2 * pg, .len = pg},
    };
    rc = sg_samehost_readv((uint32_t)child, p3, 3);
    assert_int_equal(rc, -EFAULT);
    for (size_t i = 0; i < pg; i++) /* what precedes the hole arrived */
      if (dst[i] != 0xAB)
        fail_msg("byte %zu before the hole not copied", i);
    for (size_t i = 2 * pg; i < 3 * pg; i++) /* nothing after it */
      if (dst[i] != 0)
        fail_msg("byte %zu after the hole was written", i);
    /* the readable pieces alone are fine */
    assert_int_equal(sg_samehost_readv((uint32_t)child, &p3[2], 1), 0);
    assert_int_equal(dst[2 * pg], 0xAB);
    free(dst);
  }
  kill(child, SIGKILL);
  int status;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(sg_samehost_readv((uint32_t)child, pieces, n) < 0);
  free(pieces);
  free(got);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_error_codes_are_distinct_and_named),
      cmocka_unit_test(test_fatal_threshold),
      cmocka_unit_test(test_hex_digit),
      cmocka_unit_test(test_err_set_formats_and_truncates),
      cmocka_unit_test(test_clock_is_monotonic_and_deadlines_saturate),
      cmocka_unit_test(test_buf_limits_and_compaction),
      cmocka_unit_test(test_buf_survives_allocation_failure),
      cmocka_unit_test(test_alloc_injection_counts),
      cmocka_unit_test(test_log_levels_and_sink),
      cmocka_unit_test(test_log_to_full_stderr_never_blocks),
      cmocka_unit_test(test_log_to_one_page_pipe_takes_what_fits),
      cmocka_unit_test(test_sockets_are_cloexec_and_registered),
      cmocka_unit_test(test_connect_errors),
      cmocka_unit_test(test_map_put_get_del_iterate),
      cmocka_unit_test(test_map_survives_allocation_failure),
      cmocka_unit_test(test_addr_split_accepts_and_refuses),
      cmocka_unit_test(test_addr_advertised_rule),
      cmocka_unit_test(test_little_endian_codecs),
      cmocka_unit_test(test_samehost_ids_match_rules),
      cmocka_unit_test(test_samehost_read_from_child),
      cmocka_unit_test(test_samehost_readv_batches_and_partial_reads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
