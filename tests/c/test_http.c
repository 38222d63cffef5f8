/*
 * test_http.c: the lighthouse's HTTP/1.1 side (src/lighthouse/http.c).
 *
 *   pure       router table, /status JSON (checked by a small JSON
 *              validator), /metrics lines, the dashboard page, allocation
 *              failures, argument checks
 *   sockets    a test listener on 127.0.0.1:0 hands accepted sockets to the
 *              module the way the lighthouse's sniffing listener does; a
 *              fake lighthouse supplies snapshots and records kills
 *   bad peer   garbage, HTTP junk, an oversized header, truncated requests,
 *              oversized bodies, a silent client, too many connections;
 *              after each, a well-behaved request must still succeed
 *
 * Every socket test ends by freeing the module and checking that the fork
 * registry holds exactly what it held before the test: the module must
 * unregister every socket that MHD closed.
 */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "lighthouse/http.h"
#include "lighthouse/status.h"
#include "stepguard/base.h"

/* ---- a snapshot with tricky strings ---------------------------------------
 */

/* quote, backslash, newline, a control byte, é, €, U+1F600 */
#define TRICKY_ID "rep\"q\\b\nnl\x01\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"
#define TRICKY_ID_JSON                                                         \
  "\"rep\\\"q\\\\b\\nnl\\u0001\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\""

static const double le_s[] = {0.005, 0.1, 1.0, 2.5};
static const double dec_le_s[] = {0.00005, 0.0005, 0.001};

static int fill_status(sg__lh_status_t *s) {
  memset(s, 0, sizeof(*s));
  s->quorum_id = 7;
  s->reason = sg_strdup("Valid quorum found [2/2 participants healthy]");
  s->has_prev = 1;
  s->prev_quorum_id = 6;
  s->prev_age_ms = 1500;
  s->max_step = 42;
  s->step_floor = 42;
  s->step_regressions = 2;
  s->regressed_from = 30;
  s->regressed_to = 0;
  s->n_members = 2;
  s->members = sg_calloc(2, sizeof(*s->members));
  s->n_heartbeats = 3;
  s->heartbeats = sg_calloc(3, sizeof(*s->heartbeats));
  s->n_lat_buckets = 4;
  s->lat_bucket_le_s = le_s;
  s->lat_bucket_counts = sg_calloc(4, sizeof(uint64_t));
  s->decision.n_buckets = 3;
  s->decision.le_s = dec_le_s;
  s->decision.counts = sg_calloc(3, sizeof(uint64_t));
  if (!s->reason || !s->members || !s->heartbeats || !s->lat_bucket_counts ||
      !s->decision.counts)
    return SG_ENOMEM;
  s->decision.counts[0] = 2;
  s->decision.counts[1] = 3;
  s->decision.counts[2] = 4;
  s->decision.sum_s = 0.0015;
  s->decision.count = 5;
  s->decision_last_ns = 250000;
  s->members[0].replica_id = sg_strdup(TRICKY_ID);
  s->members[0].address = sg_strdup("http://host-a:1234");
  s->members[0].store_address = sg_strdup("host-a:29500 <b>&</b>");
  s->members[0].step = 42;
  s->members[0].world_size = 8;
  s->members[1].replica_id = sg_strdup("rep-b:0000");
  s->members[1].address = sg_strdup("http://host-b:1234");
  s->members[1].store_address = sg_strdup("host-b:29500");
  s->members[1].step = 40; /* recovering */
  s->members[1].world_size = 8;
  s->members[1].commit_failures = 1;
  s->members[1].shrink_only = 1;
  s->heartbeats[0].replica_id = sg_strdup(TRICKY_ID);
  s->heartbeats[0].age_ms = 100;
  s->heartbeats[0].connected = 1;
  s->heartbeats[1].replica_id = sg_strdup("rep-b:0000");
  s->heartbeats[1].age_ms = 9000;
  s->heartbeats[1].expired = 1;
  s->heartbeats[2].replica_id = sg_strdup("bad\xff\xfeutf8\x7f");
  s->heartbeats[2].participating = 1;
  s->n_pending = 1;
  s->heartbeat_timeout_ms = 5000;
  s->pruned_total = 3;
  s->quorums_issued = 6;
  s->heartbeats_total = 12345;
  s->disconnects_total = 2;
  s->quorum_requests_total = 99;
  s->rejected_total = 1;
  s->participants = 1;
  s->healthy_replicas = 2;
  s->connections = 2;
  s->role = "leader"; /* replicated lighthouses (static string) */
  s->term = 5;
  s->lease_ttl_s = 2;
  s->lease_left_ms = 1500;
  s->elections_won = 1;
  s->leader = sg_strdup("http://lh-a:29510");
  if (!s->leader)
    return SG_ENOMEM;
  s->lat_bucket_counts[0] = 1;
  s->lat_bucket_counts[1] = 5;
  s->lat_bucket_counts[2] = 9;
  s->lat_bucket_counts[3] = 10;
  s->lat_sum_s = 3.25;
  s->lat_count = 11;
  for (size_t i = 0; i < 2; i++)
    if (!s->members[i].replica_id || !s->members[i].address ||
        !s->members[i].store_address)
      return SG_ENOMEM;
  for (size_t i = 0; i < 3; i++)
    if (!s->heartbeats[i].replica_id)
      return SG_ENOMEM;
  return 0;
}

/* ---- a small JSON validator ------------------------------------------------
 */

typedef struct jp_s {
  const char *p, *end;
  int depth;
} jp_t;

static int jp_value(jp_t *j);

static void jp_ws(jp_t *j) {
  while (j->p < j->end &&
         (*j->p == ' ' || *j->p == '\n' || *j->p == '\t' || *j->p == '\r'))
    j->p++;
}

static int jp_lit(jp_t *j, const char *lit) {
  size_t n = strlen(lit);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, lit, n) != 0)
    return -1;
  j->p += n;
  return 0;
}

static int jp_string(jp_t *j) {
  if (j->p >= j->end || *j->p != '"')
    return -1;
  j->p++;
  while (j->p < j->end) {
    unsigned char c = (unsigned char)*j->p;
    if (c == '"') {
      j->p++;
      return 0;
    }
    if (c < 0x20)
      return -1;
    if (c == '\\') {
      j->p++;
      if (j->p >= j->end)
        return -1;
      char e = *j->p++;
      if (e == 'u') {
        for (int i = 0; i < 4; i++, j->p++)
          if (j->p >= j->end || !strchr("0123456789abcdefABCDEF", *j->p))
            return -1;
      } else if (!strchr("\"\\/bfnrt", e)) {
        return -1;
      }
      continue;
    }
    if (c >= 0x80) { /* a well-formed multi-byte sequence */
      int n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
      if (!n || j->end - j->p < n)
        return -1;
      for (int i = 1; i < n; i++)
        if (((unsigned char)j->p[i] & 0xC0) != 0x80)
          return -1;
      j->p += n;
      continue;
    }
    j->p++;
  }
  return -1;
}

static int jp_number(jp_t *j) {
  const char *s = j->p;
  if (j->p < j->end && *j->p == '-')
    j->p++;
  if (j->p >= j->end || *j->p < '0' || *j->p > '9')
    return -1;
  while (j->p < j->end &&
         ((*j->p >= '0' && *j->p <= '9') || *j->p == '.' || *j->p == 'e' ||
          *j->p == 'E' || *j->p == '+' || *j->p == '-'))
    j->p++;
  return j->p > s ? 0 : -1;
}

static int jp_container(jp_t *j, char close, int keyed) {
  if (++j->depth > 32)
    return -1;
  j->p++;
  jp_ws(j);
  if (j->p < j->end && *j->p == close) {
    j->p++;
    j->depth--;
    return 0;
  }
  for (;;) {
    jp_ws(j);
    if (keyed) {
      if (jp_string(j))
        return -1;
      jp_ws(j);
      if (j->p >= j->end || *j->p++ != ':')
        return -1;
    }
    if (jp_value(j))
      return -1;
    jp_ws(j);
    if (j->p >= j->end)
      return -1;
    char c = *j->p++;
    if (c == close)
      break;
    if (c != ',')
      return -1;
  }
  j->depth--;
  return 0;
}

static int jp_value(jp_t *j) {
  jp_ws(j);
  if (j->p >= j->end)
    return -1;
  switch (*j->p) {
  case '{':
    return jp_container(j, '}', 1);
  case '[':
    return jp_container(j, ']', 0);
  case '"':
    return jp_string(j);
  case 't':
    return jp_lit(j, "true");
  case 'f':
    return jp_lit(j, "false");
  case 'n':
    return jp_lit(j, "null");
  default:
    return jp_number(j);
  }
}

/* json_valid: the whole of s[0..n) is one JSON value. */
static int json_valid(const char *s, size_t n) {
  jp_t j = {s, s + n, 0};
  if (jp_value(&j))
    return 0;
  jp_ws(&j);
  return j.p == j.end;
}

/* ---- Prometheus text checker ----------------------------------------------
 */

static int metric_name_ok(const char *s, size_t n) {
  if (n == 0)
    return 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9'))
      return 0;
  }
  return 1;
}

static int value_ok(const char *s) {
  if (!strcmp(s, "+Inf") || !strcmp(s, "-Inf") || !strcmp(s, "NaN"))
    return 1;
  char *end = NULL;
  strtod(s, &end);
  return end != s && *end == '\0';
}

/*
 * check_exposition: every line of text is a well-formed HELP, TYPE or
 * sample line, every sample belongs to a family TYPEd before it, and the
 * text ends with a newline.  Returns the number of sample lines, or -1.
 */
static int check_exposition(const char *text) {
  char typed[64][96];
  int ntyped = 0, samples = 0;
  size_t len = strlen(text);
  if (len == 0 || text[len - 1] != '\n')
    return -1;
  const char *line = text;
  while (*line) {
    const char *nl = strchr(line, '\n');
    size_t n = (size_t)(nl - line);
    char buf[512];
    if (n == 0 || n >= sizeof(buf))
      return -1;
    memcpy(buf, line, n);
    buf[n] = '\0';
    line = nl + 1;
    if (!strncmp(buf, "# HELP ", 7) || !strncmp(buf, "# TYPE ", 7)) {
      char *name = buf + 7, *sp = strchr(name, ' ');
      if (!sp || !metric_name_ok(name, (size_t)(sp - name)) || !sp[1])
        return -1;
      if (buf[2] == 'T') {
        const char *t = sp + 1;
        if (strcmp(t, "counter") && strcmp(t, "gauge") &&
            strcmp(t, "histogram"))
          return -1;
        if (ntyped == 64)
          return -1;
        snprintf(typed[ntyped++], sizeof(typed[0]), "%.*s", (int)(sp - name),
                 name);
      }
      continue;
    }
    if (buf[0] == '#')
      return -1;
    char *sp = strrchr(buf, ' ');
    if (!sp || !value_ok(sp + 1))
      return -1;
    *sp = '\0';
    char *brace = strchr(buf, '{');
    size_t nlen = brace ? (size_t)(brace - buf) : strlen(buf);
    if (!metric_name_ok(buf, nlen))
      return -1;
    if (brace) { /* only le="..." labels here */
      if (strncmp(brace, "{le=\"", 5) != 0 || sp[-1] != '}' || sp[-2] != '"')
        return -1;
      sp[-2] = '\0';
      if (!value_ok(brace + 5))
        return -1;
    }
    int found = 0;
    for (int i = 0; i < ntyped && !found; i++) {
      size_t tl = strlen(typed[i]);
      if (nlen >= tl && !strncmp(buf, typed[i], tl) &&
          (nlen == tl || !strncmp(buf + tl, "_bucket", nlen - tl) ||
           !strncmp(buf + tl, "_sum", nlen - tl) ||
           !strncmp(buf + tl, "_count", nlen - tl)))
        found = 1;
    }
    if (!found)
      return -1;
    samples++;
  }
  return samples;
}

/* ---- pure tests ------------------------------------------------------------
 */

static void test_route_table(void **state) {
  (void)state;
  static const struct {
    const char *method, *url;
    sg__lh_route_t route;
    int status;
    const char *id;
  } cases[] = {
      {"GET", "/", SG__LH_ROUTE_INDEX, 200, NULL},
      {"HEAD", "/", SG__LH_ROUTE_INDEX, 200, NULL},
      {"GET", "/status", SG__LH_ROUTE_STATUS, 200, NULL},
      {"GET", "/status?x=1&y", SG__LH_ROUTE_STATUS, 200, NULL},
      {"GET", "/metrics", SG__LH_ROUTE_METRICS, 200, NULL},
      {"GET", "/status/", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"GET", "/statusx", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"GET", "//", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"GET", "/nope", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"POST", "/status", SG__LH_ROUTE_BAD_METHOD, 405, NULL},
      {"PUT", "/", SG__LH_ROUTE_BAD_METHOD, 405, NULL},
      {"get", "/", SG__LH_ROUTE_BAD_METHOD, 405, NULL},
      {"POST", "/replica/abc/kill", SG__LH_ROUTE_KILL, 200, "abc"},
      {"POST", "/replica/a%3Ab%2fc/kill", SG__LH_ROUTE_KILL, 200, "a:b/c"},
      {"POST", "/replica/%C3%A9+x/kill?q", SG__LH_ROUTE_KILL, 200,
       "\xc3\xa9+x"},
      {"GET", "/replica/abc/kill", SG__LH_ROUTE_BAD_METHOD, 405, NULL},
      {"DELETE", "/replica/abc/kill", SG__LH_ROUTE_BAD_METHOD, 405, NULL},
      {"POST", "/replica//kill", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"POST", "/replica/a/b/kill", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"POST", "/replica/abc/kill/", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"POST", "/replica/kill", SG__LH_ROUTE_NOT_FOUND, 404, NULL},
      {"POST", "/replica/%zz/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/ab%4/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/ab%/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/a%00b/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/a%0Ab/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/a%7Fb/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/%FF/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/%C0%AF/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/%ED%A0%80/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"POST", "/replica/\x01/kill", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"GET", "status", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"GET", "", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
      {"GET", "*", SG__LH_ROUTE_BAD_REQUEST, 400, NULL},
  };
  sg__lh_route_match_t m;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    sg__lh_route_t r = sg__lh_http_route(cases[i].method, cases[i].url, &m);
    if (r != cases[i].route || m.status != cases[i].status)
      fail_msg("case %zu %s %s: route %d status %d", i, cases[i].method,
               cases[i].url, (int)r, m.status);
    assert_int_equal(m.route, r);
    if (cases[i].id) {
      assert_string_equal(m.replica_id, cases[i].id);
      assert_int_equal(m.replica_id_len, strlen(cases[i].id));
    }
    if (r == SG__LH_ROUTE_BAD_METHOD)
      assert_non_null(m.allow);
    if (r == SG__LH_ROUTE_BAD_REQUEST)
      assert_non_null(m.why);
  }
  assert_int_equal(sg__lh_http_route(NULL, "/", &m), SG__LH_ROUTE_BAD_REQUEST);
  assert_int_equal(sg__lh_http_route("GET", NULL, &m),
                   SG__LH_ROUTE_BAD_REQUEST);
  sg__lh_http_route("POST", "/replica/a/kill", &m);
  assert_string_equal(m.allow ? m.allow : "", "");
  sg__lh_http_route("GET", "/replica/a/kill", &m);
  assert_string_equal(m.allow, "POST");
}

static void test_route_id_length(void **state) {
  (void)state;
  static char url[4 * SG__LH_REPLICA_ID_MAX + 64];
  sg__lh_route_match_t m;
  /* exactly the limit, given as raw bytes and as %41 escapes */
  strcpy(url, "/replica/");
  size_t n = strlen(url);
  memset(url + n, 'x', SG__LH_REPLICA_ID_MAX);
  strcpy(url + n + SG__LH_REPLICA_ID_MAX, "/kill");
  assert_int_equal(sg__lh_http_route("POST", url, &m), SG__LH_ROUTE_KILL);
  assert_int_equal(m.replica_id_len, SG__LH_REPLICA_ID_MAX);
  strcpy(url, "/replica/");
  for (size_t i = 0; i < SG__LH_REPLICA_ID_MAX; i++)
    strcat(url, "%41");
  strcat(url, "/kill");
  assert_int_equal(sg__lh_http_route("POST", url, &m), SG__LH_ROUTE_KILL);
  assert_int_equal(m.replica_id[SG__LH_REPLICA_ID_MAX - 1], 'A');
  /* one more byte is refused */
  strcpy(url, "/replica/");
  memset(url + n, 'x', SG__LH_REPLICA_ID_MAX + 1);
  strcpy(url + n + SG__LH_REPLICA_ID_MAX + 1, "/kill");
  assert_int_equal(sg__lh_http_route("POST", url, &m),
                   SG__LH_ROUTE_BAD_REQUEST);
  assert_int_equal(m.status, 400);
  assert_string_equal(m.replica_id, "");
}

static void test_status_json(void **state) {
  (void)state;
  sg__lh_status_t s;
  assert_int_equal(fill_status(&s), 0);
  sg_buf_t b;
  sg_buf_init(&b, 1 << 20);
  assert_int_equal(sg__lh_render_status_json(&s, &b), 0);
  assert_int_equal(sg_buf_append(&b, "", 1), 0);
  const char *j = (const char *)sg_buf_head(&b);
  assert_true(json_valid(j, strlen(j)));
  assert_non_null(strstr(j, "\"replica_id\":" TRICKY_ID_JSON));
  assert_non_null(strstr(j, "\"quorum_id\":7,"));
  assert_non_null(strstr(j, "\"role\":\"leader\",\"leader\":"
                            "\"http://lh-a:29510\",\"term\":5,"
                            "\"lease_ttl_s\":2,\"lease_left_ms\":1500,"));
  assert_non_null(strstr(j, "\"prev_quorum\":{\"quorum_id\":6,"));
  assert_non_null(strstr(j, "\"age_ms\":1500"));
  assert_non_null(strstr(j, "\"max_step\":42"));
  assert_non_null(strstr(j, "\"num_participants\":2"));
  assert_non_null(
      strstr(j, "\"store_address\":\"host-a:29500 \\u003cb\\u003e\\u0026"));
  assert_non_null(strstr(j, "\"step\":42,\"world_size\":8,"
                            "\"commit_failures\":0,\"shrink_only\":false,"
                            "\"recovering\":false}"));
  assert_non_null(strstr(j, "\"step\":40,\"world_size\":8,"
                            "\"commit_failures\":1,\"shrink_only\":true,"
                            "\"recovering\":true}"));
  assert_non_null(strstr(j, "\"replica_id\":\"bad\\ufffd\\ufffdutf8\\u007f\""));
  assert_non_null(strstr(j, "\"age_ms\":9000,\"expired\":true"));
  assert_non_null(strstr(j, "\"participating\":true"));
  assert_non_null(
      strstr(j, "\"last_decision_us\":250.000,\"decisions_total\":5,"));
  assert_non_null(strstr(j, "\"step_floor\":42,\"step_regressions\":2,"
                            "\"last_step_regression\":{\"from\":30,"
                            "\"to\":0},"));
  assert_true(strchr(j, '\n') == j + strlen(j) - 1); /* only the last */
  sg_buf_free(&b);

  /* no previous quorum, NULL strings, NULL arrays with counts set */
  sg__lh_status_free(&s);
  s.n_members = 3; /* ignored: members is NULL */
  s.n_heartbeats = 2;
  s.decision_last_ns = -1; /* no quorum yet */
  sg_buf_init(&b, 4096);
  assert_int_equal(sg__lh_render_status_json(&s, &b), 0);
  assert_int_equal(sg_buf_append(&b, "", 1), 0);
  j = (const char *)sg_buf_head(&b);
  assert_true(json_valid(j, strlen(j)));
  assert_non_null(strstr(j, "\"reason\":\"\""));
  assert_non_null(strstr(j, "\"prev_quorum\":null"));
  assert_non_null(
      strstr(j, "\"last_decision_us\":null,\"decisions_total\":0,"));
  assert_non_null(strstr(j, "\"step_regressions\":0,\"prev_quorum\""));
  assert_null(strstr(j, "last_step_regression"));
  assert_non_null(strstr(j, "\"heartbeats\":[]"));
  sg_buf_free(&b);
}

/* history_status: a snapshot whose history holds a change, a failure, a
 * heal and step rates, with ids that need escaping. */
static void history_status(sg__lh_status_t *s) {
  memset(s, 0, sizeof(*s));
  s->history = sg_malloc(sizeof(*s->history));
  assert_non_null(s->history);
  sg__lh_history_init(s->history, 0);
  const int64_t t0 = 1000000000000, ms = 1000000;
  sg__lh_member_t m[3];
  memset(m, 0, sizeof(m));
  m[0].replica_id = (char *)TRICKY_ID;
  m[1].replica_id = (char *)"<b>&";
  m[2].replica_id = (char *)"late";
  sg__lh_quorum_t q = {.quorum_id = 3, .n = 2, .members = m};
  m[0].step = m[1].step = 10;
  sg__lh_history_quorum(s->history, t0, &q, NULL, NULL);
  m[0].step = m[1].step = 20; /* 10 steps in 1 s */
  sg__lh_history_quorum(s->history, t0 + 1000 * ms, &q, NULL, NULL);
  sg__lh_history_down(s->history, t0 + 1500 * ms, "<b>&", "said \"bye\"\n");
  m[1] = m[2]; /* <b>& out, late in at step 4 behind 30: a heal */
  m[0].step = 30;
  m[1].step = 4;
  q.quorum_id = 4;
  sg__lh_history_quorum(s->history, t0 + 2000 * ms, &q, NULL, NULL);
  s->now_ns = t0 + 2500 * ms;
}

static void test_status_json_history(void **state) {
  (void)state;
  sg__lh_status_t s;
  history_status(&s);
  sg_buf_t b;
  sg_buf_init(&b, 1 << 20);
  assert_int_equal(sg__lh_render_status_json(&s, &b), 0);
  assert_int_equal(sg_buf_append(&b, "", 1), 0);
  const char *j = (const char *)sg_buf_head(&b);
  assert_true(json_valid(j, strlen(j)));
  assert_non_null(strstr(j, "\"history\":{\"window_ms\":900000,"
                            "\"changes_total\":2,\"failures_total\":1,"
                            "\"heals_total\":1,\"untracked\":0,"));
  assert_non_null(strstr(j, "{\"age_ms\":2500,\"quorum_id\":3,\"members\":2,"
                            "\"max_step\":10,\"heals\":0,\"n_joined\":2,"
                            "\"n_left\":0,\"joined\":[" TRICKY_ID_JSON
                            ",\"\\u003cb\\u003e\\u0026\"],\"left\":[]}"));
  assert_non_null(strstr(j, "\"quorum_id\":4,\"members\":2,\"max_step\":30,"
                            "\"heals\":1,\"n_joined\":1,\"n_left\":1,"
                            "\"joined\":[\"late\"],"
                            "\"left\":[\"\\u003cb\\u003e\\u0026\"]}"));
  assert_non_null(strstr(j,
                         "\"failures\":[{\"age_ms\":1000,\"replica_id\":"
                         "\"\\u003cb\\u003e\\u0026\",\"quorum_id\":3,"
                         "\"step\":20,\"reason\":\"said \\\"bye\\\"\\n\"}]"));
  assert_non_null(strstr(j, "\"heals\":[{\"age_ms\":500,\"replica_id\":"
                            "\"late\",\"quorum_id\":4,\"step\":4,"
                            "\"max_step\":30}]"));
  /* the tricky id: 10 steps/s over its first second; open span */
  assert_non_null(strstr(
      j, "{\"replica_id\":" TRICKY_ID_JSON ",\"member\":true,\"step\":30,"
         "\"step_age_ms\":500,\"step_rate\":10.000,"
         "\"rate_window_ms\":2000,\"spans\":[[2500,null]]}"));
  assert_non_null(strstr(j, "\"member\":false,\"step\":20,\"step_age_ms\":1500,"
                            "\"step_rate\":10.000,\"rate_window_ms\":1000,"
                            "\"spans\":[[2500,500]]}"));
  size_t full = strlen(j);
  sg_buf_free(&b);
  /* a buffer too small for the history: SG_ETOOBIG within the maximum */
  sg_buf_init(&b, full - 10);
  assert_int_equal(sg__lh_render_status_json(&s, &b), SG_ETOOBIG);
  sg_buf_free(&b);
  sg__lh_status_free(&s);
  assert_null(s.history);
}

static void test_status_json_limits(void **state) {
  (void)state;
  sg__lh_status_t s;
  assert_int_equal(fill_status(&s), 0);
  sg_buf_t b;
  sg_buf_init(&b, 64);
  assert_int_equal(sg__lh_render_status_json(&s, &b), SG_ETOOBIG);
  assert_true(b.len <= 64);
  sg_buf_free(&b);
  /* fail each allocation in turn: SG_ENOMEM, never a crash or a leak */
  for (long n = 1; n < 40; n++) {
    sg_buf_init(&b, 1 << 20);
    sg_test_fail_alloc(n, 0);
    int rc = sg__lh_render_status_json(&s, &b);
    sg_test_fail_alloc(0, 0);
    assert_true(rc == 0 || rc == SG_ENOMEM);
    sg_buf_free(&b);
    sg_buf_init(&b, 1 << 20);
    sg_test_fail_alloc(n, 1);
    rc = sg__lh_render_metrics(&s, &b);
    sg_test_fail_alloc(0, 0);
    assert_true(rc == 0 || rc == SG_ENOMEM);
    sg_buf_free(&b);
  }
  sg__lh_status_free(&s);
  sg__lh_status_free(&s); /* twice is harmless */
  sg__lh_status_free(NULL);
}

static void test_metrics_text(void **state) {
  (void)state;
  sg__lh_status_t s;
  assert_int_equal(fill_status(&s), 0);
  sg_buf_t b;
  sg_buf_init(&b, 1 << 20);
  assert_int_equal(sg__lh_render_metrics(&s, &b), 0);
  assert_int_equal(sg_buf_append(&b, "", 1), 0);
  const char *t = (const char *)sg_buf_head(&b);
  /* 11 plain samples, then 4 + 3 buckets, each with +Inf, sum and count,
   * then 6 of replicated lighthouses */
  assert_int_equal(check_exposition(t), 11 + 4 + 3 + 3 + 3 + 6);
  static const char *const want[] = {
      "\n# TYPE stepguard_lighthouse_quorums_issued_total counter\n",
      "\nstepguard_lighthouse_quorums_issued_total 6\n",
      "\nstepguard_lighthouse_step_regressions_total 2\n",
      "\nstepguard_lighthouse_quorum_id 7\n",
      "\nstepguard_lighthouse_participants 1\n",
      "\nstepguard_lighthouse_healthy_replicas 2\n",
      "\nstepguard_lighthouse_heartbeats_total 12345\n",
      "\nstepguard_lighthouse_disconnects_total 2\n",
      "\nstepguard_lighthouse_quorum_requests_total 99\n",
      "\nstepguard_lighthouse_rejected_total 1\n",
      "\nstepguard_lighthouse_is_leader 1\n",
      "\nstepguard_lighthouse_leader_term 5\n",
      "\nstepguard_lighthouse_lease_left_ms 1500\n",
      "\nstepguard_lighthouse_elections_won_total 1\n",
      "\nstepguard_lighthouse_connections 2\n",
      "\nstepguard_lighthouse_pruned_heartbeats_total 3\n",
      "\n# TYPE stepguard_lighthouse_quorum_request_duration_seconds "
      "histogram\n",
      "\nstepguard_lighthouse_quorum_request_duration_seconds_bucket"
      "{le=\"0.005\"} 1\n",
      "_bucket{le=\"0.1\"} 5\n",
      "_bucket{le=\"1\"} 9\n",
      "_bucket{le=\"2.5\"} 10\n",
      "_bucket{le=\"+Inf\"} 11\n",
      "\nstepguard_lighthouse_quorum_request_duration_seconds_sum 3.25\n",
      "\nstepguard_lighthouse_quorum_request_duration_seconds_count 11\n",
      "\n# TYPE stepguard_lighthouse_decision_seconds histogram\n",
      "\nstepguard_lighthouse_decision_seconds_bucket{le=\"5e-05\"} 2\n",
      "\nstepguard_lighthouse_decision_seconds_bucket{le=\"0.0005\"} 3\n",
      "\nstepguard_lighthouse_decision_seconds_bucket{le=\"0.001\"} 4\n",
      "\nstepguard_lighthouse_decision_seconds_bucket{le=\"+Inf\"} 5\n",
      "\nstepguard_lighthouse_decision_seconds_sum 0.0015\n",
      "\nstepguard_lighthouse_decision_seconds_count 5\n",
  };
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
    if (!strstr(t, want[i]))
      fail_msg("missing %s in\n%s", want[i], t);
  assert_true(strncmp(t, "# HELP ", 7) == 0);
  sg_buf_free(&b);

  /* bad bounds are skipped, NaN sum spelled as Prometheus does */
  static const double bad_le[] = {0.5, 0.25, NAN, 1.0, INFINITY};
  s.lat_bucket_le_s = bad_le;
  sg_free(s.lat_bucket_counts);
  s.lat_bucket_counts = sg_calloc(5, sizeof(uint64_t));
  assert_non_null(s.lat_bucket_counts);
  s.n_lat_buckets = 5;
  s.lat_sum_s = NAN;
  sg_buf_init(&b, 1 << 20);
  assert_int_equal(sg__lh_render_metrics(&s, &b), 0);
  assert_int_equal(sg_buf_append(&b, "", 1), 0);
  t = (const char *)sg_buf_head(&b);
  assert_int_equal(check_exposition(t), 11 + 2 + 1 + 2 + 3 + 3 + 6);
  assert_null(strstr(t, "le=\"0.25\""));
  assert_non_null(strstr(t, "_sum NaN\n"));
  sg_buf_free(&b);
  sg__lh_status_free(&s);

  /* the checker itself rejects malformed text */
  assert_int_equal(check_exposition("# TYPE x counter\nx 1"), -1);
  assert_int_equal(check_exposition("# TYPE x counter\ny 1\n"), -1);
  assert_int_equal(check_exposition("# TYPE x counter\nx one\n"), -1);
  assert_int_equal(check_exposition("# TYPE x counter\nx 1\n"), 1);
  assert_false(json_valid("{\"a\":1,}", 8));
  assert_false(json_valid("{\"a\n\":1}", 8));
  assert_true(json_valid("{\"a\":[1,true,null]}", 19));
}

static void test_index_html(void **state) {
  (void)state;
  const char *h = sg__lh_index_html();
  assert_non_null(h);
  assert_null(strstr(h, "http://"));
  assert_null(strstr(h, "https://"));
  assert_null(strstr(h, "src=")); /* no external script, image or frame */
  assert_null(strstr(h, "href="));
  assert_null(strstr(h, "@import"));
  assert_null(strstr(h, "innerHTML"));
  assert_non_null(strstr(h, "<!DOCTYPE html>"));
  assert_non_null(strstr(h, "<style>"));
  assert_non_null(strstr(h, "<script>"));
  assert_non_null(strstr(h, "fetch('/status'"));
  assert_non_null(strstr(h, "'/kill'"));
  assert_non_null(strstr(h, "Authorization"));
  assert_non_null(strstr(h, "recovering"));
  assert_non_null(strstr(h, "setTimeout(poll, 1000)"));
  /* the history: timeline (inline SVG), step rates, failures, heals */
  assert_non_null(strstr(h, "<svg id=\"tl\""));
  assert_non_null(strstr(h, "id=\"rates\""));
  assert_non_null(strstr(h, "id=\"changes\""));
  assert_non_null(strstr(h, "id=\"failures\""));
  assert_non_null(strstr(h, "id=\"heals\""));
  assert_non_null(strstr(h, "s.history"));
  assert_non_null(strstr(h, "</html>\n"));
}

static int noop_snapshot(void *ud, sg__lh_status_t *out) { return 0; }
static int noop_kill(void *ud, const char *id, char *err, size_t errlen) {
  return 0;
}

static void test_new_args(void **state) {
  (void)state;
  sg__lh_http_t *h = (sg__lh_http_t *)&h;
  sg_err_t err;
  sg__lh_http_opts_t o;
  memset(&o, 0, sizeof(o));
  assert_int_equal(sg__lh_http_new(NULL, &h, &err), SG_EINVAL);
  assert_int_equal(sg__lh_http_new(&o, &h, &err), SG_EINVAL);
  o.snapshot = noop_snapshot;
  assert_int_equal(sg__lh_http_new(&o, &h, &err), SG_EINVAL);
  o.kill = noop_kill;
  static char big[2000];
  memset(big, 'k', sizeof(big) - 1);
  o.auth_token = big;
  assert_int_equal(sg__lh_http_new(&o, &h, &err), SG_EINVAL);
  assert_null(h);
  o.auth_token = "tok";
  for (long n = 1; n <= 2; n++) {
    sg_test_fail_alloc(n, 0);
    int rc = sg__lh_http_new(&o, &h, &err);
    sg_test_fail_alloc(0, 0);
    assert_int_equal(rc, SG_ENOMEM);
    assert_null(h);
  }
  assert_int_equal(sg__lh_http_new(&o, &h, &err), 0);
  assert_non_null(h);
  assert_int_equal(sg__lh_http_add_connection(h, -1), SG_EINVAL);
  sg__lh_http_free(h);
  sg__lh_http_free(NULL);
  assert_int_equal(sg__lh_http_add_connection(NULL, -1), SG_EINVAL);
}

/* ---- socket fixture --------------------------------------------------------
 */

typedef struct fx_s {
  sg__lh_http_t *h;
  int lfd, port;
  size_t regs0; /* registry size before the fixture */
  pthread_mutex_t mu;
  int kill_calls;
  char kill_id[SG__LH_REPLICA_ID_MAX + 1];
  int kill_rc;
  int snapshot_rc;
  int snapshots;
} fx_t;

static int fx_snapshot(void *ud, sg__lh_status_t *out) {
  fx_t *fx = ud;
  pthread_mutex_lock(&fx->mu);
  int rc = fx->snapshot_rc;
  fx->snapshots++;
  pthread_mutex_unlock(&fx->mu);
  if (rc)
    return rc;
  return fill_status(out);
}

static int fx_kill(void *ud, const char *id, char *err, size_t errlen) {
  fx_t *fx = ud;
  pthread_mutex_lock(&fx->mu);
  fx->kill_calls++;
  snprintf(fx->kill_id, sizeof(fx->kill_id), "%s", id);
  int rc = fx->kill_rc;
  pthread_mutex_unlock(&fx->mu);
  if (rc && rc != SG_ENOTFOUND)
    snprintf(err, errlen, "boom: %s", sg_strerror(rc));
  return rc;
}

static void fx_set(fx_t *fx, int *field, int v) {
  pthread_mutex_lock(&fx->mu);
  *field = v;
  pthread_mutex_unlock(&fx->mu);
}

static int fx_kills(fx_t *fx) {
  pthread_mutex_lock(&fx->mu);
  int n = fx->kill_calls;
  pthread_mutex_unlock(&fx->mu);
  return n;
}

/* fx_kill_id: the id of the last kill, copied under the lock. */
static const char *fx_kill_id(fx_t *fx) {
  static char id[SG__LH_REPLICA_ID_MAX + 1];
  pthread_mutex_lock(&fx->mu);
  memcpy(id, fx->kill_id, sizeof(id));
  pthread_mutex_unlock(&fx->mu);
  return id;
}

static int fx_setup_with(void **state, const char *token, unsigned maxc,
                         unsigned timeout_s) {
  fx_t *fx = calloc(1, sizeof(*fx));
  if (!fx)
    return -1;
  pthread_mutex_init(&fx->mu, NULL);
  fx->regs0 = sg_sock_registered_count();
  sg_err_t err;
  if (sg_sock_listen("127.0.0.1", 0, 64, &fx->lfd, &fx->port, &err))
    return -1;
  sg__lh_http_opts_t o;
  memset(&o, 0, sizeof(o));
  o.auth_token = token;
  o.max_connections = maxc;
  o.timeout_s = timeout_s;
  o.snapshot = fx_snapshot;
  o.kill = fx_kill;
  o.ud = fx;
  if (sg__lh_http_new(&o, &fx->h, &err))
    return -1;
  *state = fx;
  return 0;
}

static int fx_setup(void **state) { return fx_setup_with(state, NULL, 0, 5); }
static int fx_setup_token(void **state) {
  return fx_setup_with(state, "s3cret token", 0, 5);
}
static int fx_setup_timeout(void **state) {
  return fx_setup_with(state, NULL, 0, 1);
}
static int fx_setup_limit(void **state) {
  return fx_setup_with(state, NULL, 2, 5);
}

/* wait_regs: poll until the registry holds `want` sockets (<= 5 s). */
static int wait_regs(size_t want) {
  for (int i = 0; i < 500; i++) {
    if (sg_sock_registered_count() == want)
      return 1;
    usleep(10000);
  }
  return 0;
}

static int fx_teardown(void **state) {
  fx_t *fx = *state;
  if (!fx)
    return 0;
  sg__lh_http_free(fx->h);
  sg_sock_close(fx->lfd);
  size_t now = sg_sock_registered_count();
  pthread_mutex_destroy(&fx->mu);
  size_t want = fx->regs0;
  free(fx);
  if (now != want) {
    fprintf(stderr, "registry holds %zu sockets, want %zu\n", now, want);
    return -1;
  }
  return 0;
}

/*
 * fx_connect: a plain client socket, accepted on the test listener and
 * handed to the module like the lighthouse's listener does.  Returns the
 * client fd; *add_rc gets sg__lh_http_add_connection's result.
 */
static int fx_connect_rc(fx_t *fx, int *add_rc) {
  int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(c >= 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)fx->port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(c, (struct sockaddr *)&sa, sizeof(sa)), 0);
  struct timeval tv = {10, 0};
  setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  struct pollfd p = {fx->lfd, POLLIN, 0};
  assert_int_equal(poll(&p, 1, 5000), 1);
  int s = -1;
  assert_int_equal(sg_sock_accept(fx->lfd, &s), 0);
  int rc = sg__lh_http_add_connection(fx->h, s);
  if (add_rc)
    *add_rc = rc;
  else
    assert_int_equal(rc, 0);
  return c;
}

static int fx_connect(fx_t *fx) { return fx_connect_rc(fx, NULL); }

static void send_all(int fd, const void *p, size_t n) {
  const char *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0)
      return; /* the server may close first; the reply tells */
    b += w;
    n -= (size_t)w;
  }
}

/* read_to_eof: read until EOF, error or cap; returns the byte count. */
static size_t read_to_eof(int fd, char *buf, size_t cap) {
  size_t n = 0;
  while (n + 1 < cap) {
    ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
    if (r <= 0)
      break;
    n += (size_t)r;
  }
  buf[n] = '\0';
  return n;
}

typedef struct resp_s {
  int status; /* 0: no status line (connection closed) */
  char raw[1 << 16];
  size_t len;
  const char *body;
} resp_t;

static void parse_resp(resp_t *r) {
  r->status = 0;
  r->body = "";
  if (sscanf(r->raw, "HTTP/1.%*d %d", &r->status) != 1)
    r->status = 0;
  char *e = strstr(r->raw, "\r\n\r\n");
  if (e)
    r->body = e + 4;
}

/* exchange: one request on a fresh connection, read the reply to EOF. */
static void exchange(fx_t *fx, const char *req, size_t reqlen, resp_t *r) {
  int c = fx_connect(fx);
  send_all(c, req, reqlen);
  r->len = read_to_eof(c, r->raw, sizeof(r->raw));
  close(c);
  parse_resp(r);
}

static void exchange_str(fx_t *fx, const char *req, resp_t *r) {
  exchange(fx, req, strlen(req), r);
}

/* exchange_eof: as exchange, then half-close so a partial line ends. */
static void exchange_eof(fx_t *fx, const char *req, size_t reqlen, resp_t *r) {
  int c = fx_connect(fx);
  send_all(c, req, reqlen);
  shutdown(c, SHUT_WR);
  r->len = read_to_eof(c, r->raw, sizeof(r->raw));
  close(c);
  parse_resp(r);
}

static int has_header(const resp_t *r, const char *line) {
  const char *e = strstr(r->raw, "\r\n\r\n");
  const char *h = strstr(r->raw, line);
  return h && (!e || h < e);
}

/* expect_ok: the well-behaved request that must work after any abuse. */
static void expect_ok(fx_t *fx) {
  static resp_t r;
  exchange_str(
      fx, "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &r);
  assert_int_equal(r.status, 200);
  assert_true(json_valid(r.body, strlen(r.body)));
}

/* ---- socket tests ----------------------------------------------------------
 */

static void test_get_index(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  exchange_str(fx, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
               &r);
  assert_int_equal(r.status, 200);
  assert_true(has_header(&r, "Content-Type: text/html; charset=utf-8\r\n"));
  assert_true(has_header(&r, "Content-Security-Policy: default-src 'none'"));
  assert_string_equal(r.body, sg__lh_index_html());
  assert_null(strstr(r.body, "http://"));
  assert_null(strstr(r.body, "https://"));
  /* HEAD: same headers, no body */
  exchange_str(fx, "HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
               &r);
  assert_int_equal(r.status, 200);
  assert_string_equal(r.body, "");
}

static void test_get_status(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  exchange_str(
      fx, "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &r);
  assert_int_equal(r.status, 200);
  assert_true(has_header(&r, "application/json"));
  assert_true(has_header(&r, "Cache-Control: no-store"));
  assert_true(json_valid(r.body, strlen(r.body)));
  assert_non_null(strstr(r.body, "\"replica_id\":" TRICKY_ID_JSON));
  assert_non_null(strstr(r.body, "bad\\ufffd\\ufffdutf8\\u007f"));
  /* a failing snapshot is a 500, and the next request works */
  fx_set(fx, &fx->snapshot_rc, SG_ESTATE);
  exchange_str(
      fx, "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &r);
  assert_int_equal(r.status, 500);
  assert_non_null(strstr(r.body, "Something went wrong: "));
  fx_set(fx, &fx->snapshot_rc, 0);
  expect_ok(fx);
}

static void test_get_metrics(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  exchange_str(fx, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n", /* 1.0: closes */
               &r);
  assert_int_equal(r.status, 200);
  assert_true(has_header(
      &r, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  assert_int_equal(check_exposition(r.body), 11 + 4 + 3 + 3 + 3 + 6);
  assert_non_null(strstr(r.body, "stepguard_lighthouse_quorum_id 7\n"));
}

static void test_keep_alive(void **state) {
  fx_t *fx = *state;
  int c = fx_connect(fx);
  static char buf[1 << 16];
  const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  for (int i = 0; i < 3; i++) {
    send_all(c, req, strlen(req));
    /* read one response: headers, then Content-Length bytes */
    size_t n = 0;
    long clen = -1;
    char *body = NULL;
    while (n + 1 < sizeof(buf)) {
      ssize_t got = recv(c, buf + n, sizeof(buf) - 1 - n, 0);
      assert_true(got > 0);
      n += (size_t)got;
      buf[n] = '\0';
      if (!body && (body = strstr(buf, "\r\n\r\n")) != NULL) {
        body += 4;
        const char *cl = strcasestr(buf, "Content-Length:");
        assert_non_null(cl);
        clen = strtol(cl + 15, NULL, 10);
      }
      if (body && (long)(n - (size_t)(body - buf)) >= clen)
        break;
    }
    assert_true(strncmp(buf, "HTTP/1.1 200", 12) == 0);
    assert_int_equal((long)(n - (size_t)(body - buf)), clen);
  }
  /* while MHD holds the connection, its socket is in the registry */
  assert_true(wait_regs(fx->regs0 + 2)); /* listener + this connection */
  close(c);
  assert_true(wait_regs(fx->regs0 + 1));
}

static void test_not_found_and_method(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  exchange_str(fx, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
               &r);
  assert_int_equal(r.status, 404);
  exchange_str(fx,
               "PUT /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               "Content-Length: 0\r\n\r\n",
               &r);
  assert_int_equal(r.status, 405);
  assert_true(has_header(&r, "Allow: GET, HEAD\r\n"));
  exchange_str(fx,
               "GET /replica/a/kill HTTP/1.1\r\nHost: x\r\n"
               "Connection: close\r\n\r\n",
               &r);
  assert_int_equal(r.status, 405);
  assert_true(has_header(&r, "Allow: POST\r\n"));
  exchange_str(fx,
               "POST /replica/a%0Ab/kill HTTP/1.1\r\nHost: x\r\n"
               "Connection: close\r\nContent-Length: 0\r\n\r\n",
               &r);
  assert_int_equal(r.status, 400);
  assert_int_equal(fx_kills(fx), 0);
  expect_ok(fx);
}

static const char kill_req_fmt[] = "POST /replica/%s/kill HTTP/1.1\r\n"
                                   "Host: 127.0.0.1\r\nConnection: close\r\n"
                                   "Content-Length: 0\r\n%s\r\n";

static void post_kill(fx_t *fx, const char *id, const char *extra, resp_t *r) {
  char req[2048];
  snprintf(req, sizeof(req), kill_req_fmt, id, extra);
  exchange_str(fx, req, r);
}

static void test_kill_open(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  post_kill(fx, "grp%3A0%2F%C3%A9", "", &r);
  assert_int_equal(r.status, 200);
  assert_string_equal(r.body, "ok");
  assert_int_equal(fx_kills(fx), 1);
  assert_string_equal(fx_kill_id(fx), "grp:0/\xc3\xa9");

  fx_set(fx, &fx->kill_rc, SG_ENOTFOUND);
  post_kill(fx, "ghost", "", &r);
  assert_int_equal(r.status, 404);
  assert_string_equal(r.body, "failed to find replica ghost");

  fx_set(fx, &fx->kill_rc, SG_ETIMEDOUT);
  post_kill(fx, "slow", "", &r);
  assert_int_equal(r.status, 500);
  assert_true(strncmp(r.body, "Something went wrong: boom: ", 28) == 0);
  assert_int_equal(fx_kills(fx), 3);
  fx_set(fx, &fx->kill_rc, 0);

  /* a small body is read and ignored */
  exchange_str(fx,
               "POST /replica/b/kill HTTP/1.1\r\nHost: x\r\n"
               "Connection: close\r\nContent-Length: 5\r\n\r\nhello",
               &r);
  assert_int_equal(r.status, 200);
  assert_int_equal(fx_kills(fx), 4);

  /* cross-site browser POST is refused, same-origin passes */
  post_kill(fx, "c", "Origin: http://evil.example\r\n", &r);
  assert_int_equal(r.status, 403);
  post_kill(fx, "c", "Origin: null\r\n", &r);
  assert_int_equal(r.status, 403);
  post_kill(fx, "c", "Origin: http://127.0.0.1\r\n", &r);
  assert_int_equal(r.status, 200);
  assert_int_equal(fx_kills(fx), 5);
}

static void test_kill_token(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  post_kill(fx, "a", "", &r);
  assert_int_equal(r.status, 401);
  assert_true(has_header(&r, "WWW-Authenticate: Bearer"));
  post_kill(fx, "a", "Authorization: Bearer s3cret\r\n", &r);
  assert_int_equal(r.status, 401);
  post_kill(fx, "a", "Authorization: Bearer s3cret tokenX\r\n", &r);
  assert_int_equal(r.status, 401);
  post_kill(fx, "a", "Authorization: Basic czNjcmV0IHRva2Vu\r\n", &r);
  assert_int_equal(r.status, 401);
  post_kill(fx, "a", "Authorization: Bearers3cret token\r\n", &r);
  assert_int_equal(r.status, 401);
  assert_int_equal(fx_kills(fx), 0);
  post_kill(fx, "a%2Fb", "Authorization: bearer  s3cret token \r\n", &r);
  assert_int_equal(r.status, 200);
  assert_int_equal(fx_kills(fx), 1);
  assert_string_equal(fx_kill_id(fx), "a/b");
  /* GETs stay open */
  expect_ok(fx);
}

static void test_body_limits(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  exchange_str(fx,
               "POST /replica/a/kill HTTP/1.1\r\nHost: x\r\n"
               "Content-Length: 100000\r\n\r\n",
               &r);
  assert_int_equal(r.status, 413);
  exchange_str(fx,
               "POST /replica/a/kill HTTP/1.1\r\nHost: x\r\n"
               "Content-Length: 99999999999999999999999\r\n\r\n",
               &r);
  assert_true(r.status == 413 || r.status == 400 || r.status == 0);
  /* chunked, over the limit: refused with a close, kill never runs */
  static char req[16384];
  int n = snprintf(req, sizeof(req),
                   "POST /replica/a/kill HTTP/1.1\r\nHost: x\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n");
  for (int i = 0; i < 12; i++) {
    n += snprintf(req + n, sizeof(req) - (size_t)n, "400\r\n");
    memset(req + n, 'z', 0x400);
    n += 0x400;
    n += snprintf(req + n, sizeof(req) - (size_t)n, "\r\n");
  }
  n += snprintf(req + n, sizeof(req) - (size_t)n, "0\r\n\r\n");
  exchange(fx, req, (size_t)n, &r);
  assert_true(r.status != 200);
  assert_int_equal(fx_kills(fx), 0);
  expect_ok(fx);
}

static void test_garbage(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  static char junk[4096];
  unsigned x = 12345;
  for (size_t i = 0; i < sizeof(junk); i++) {
    x = x * 1103515245u + 12345u;
    junk[i] = (char)(x >> 16);
  }
  exchange_eof(fx, junk, sizeof(junk), &r);
  assert_true(r.status == 0 || r.status >= 400);
  expect_ok(fx);

  static const char *const bad[] = {
      "\r\n\r\n",
      "GET\r\n\r\n",
      "GET / HTTP/9.9\r\nHost: x\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: "
      "6\r\n\r\n",
      "GET /\x01\x02 HTTP/1.1\r\nHost: x\r\n\r\n",
      "\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", /* a TLS hello */
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    exchange_eof(fx, bad[i], strlen(bad[i]), &r);
    if (i <= 1 || i >= 6) /* broken beyond leniency; 2..5 MHD may accept */
      assert_int_not_equal(r.status, 200);
    expect_ok(fx);
  }
}

static void test_oversized_header(void **state) {
  fx_t *fx = *state;
  static resp_t r;
  static char req[70000];
  int n =
      snprintf(req, sizeof(req), "GET /status HTTP/1.1\r\nHost: x\r\nX-Big: ");
  memset(req + n, 'a', 65536);
  n += 65536;
  n += snprintf(req + n, sizeof(req) - (size_t)n, "\r\n\r\n");
  exchange(fx, req, (size_t)n, &r);
  assert_true(r.status == 0 || r.status == 431 || r.status == 413 ||
              r.status == 400 || r.status == 414);
  /* a huge request target too */
  n = snprintf(req, sizeof(req), "GET /");
  memset(req + n, 'u', 65536);
  n += 65536;
  n += snprintf(req + n, sizeof(req) - (size_t)n,
                " HTTP/1.1\r\nHost: x\r\n\r\n");
  exchange(fx, req, (size_t)n, &r);
  assert_true(r.status == 0 || r.status >= 400);
  expect_ok(fx);
}

static void test_truncated_then_close(void **state) {
  fx_t *fx = *state;
  static const char *const parts[] = {
      "G",
      "GET /status HTTP/1.1\r\nHo",
      "POST /replica/a/kill HTTP/1.1\r\nHost: x\r\nContent-Length: "
      "10\r\n\r\nab",
      "POST /replica/a/kill HTTP/1.1\r\nHost: x\r\n"
      "Transfer-Encoding: chunked\r\n\r\n5\r\nab",
  };
  for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
    int c = fx_connect(fx);
    send_all(c, parts[i], strlen(parts[i]));
    usleep(20000);
    close(c);
  }
  /* reset instead of FIN */
  int c = fx_connect(fx);
  send_all(c, "GET /status HTTP/1.1\r\n", 22);
  struct linger lg = {1, 0};
  setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
  close(c);
  expect_ok(fx);
  assert_int_equal(fx_kills(fx), 0);
  assert_true(wait_regs(fx->regs0 + 1)); /* all those sockets left */
}

static void test_silent_client(void **state) {
  fx_t *fx = *state; /* timeout 1 s */
  int quiet = fx_connect(fx);
  int slow = fx_connect(fx);
  send_all(slow, "GET /status HT", 14);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* meanwhile others are served */
  expect_ok(fx);
  char b[256];
  ssize_t r1 = recv(quiet, b, sizeof(b), 0); /* EOF once timed out */
  ssize_t r2 = recv(slow, b, sizeof(b), 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double el =
      (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  assert_int_equal(r1, 0); /* closed, not our 10 s SO_RCVTIMEO */
  assert_true(r2 >= 0);    /* closed, or an error reply (408) */
  assert_true(el > 0.5 && el < 8.0);
  close(quiet);
  close(slow);
  assert_true(wait_regs(fx->regs0 + 1));
  expect_ok(fx);
}

static void test_connection_limit(void **state) {
  fx_t *fx = *state; /* max 2 */
  int a = fx_connect(fx), b = fx_connect(fx);
  assert_true(wait_regs(fx->regs0 + 3)); /* both adopted */
  int rc = 0;
  int c = fx_connect_rc(fx, &rc);
  assert_int_equal(rc, SG_EAGAIN);
  char buf[64];
  assert_int_equal(recv(c, buf, sizeof(buf), 0), 0); /* closed at once */
  close(c);
  assert_true(wait_regs(fx->regs0 + 3));
  close(a);
  close(b);
  assert_true(wait_regs(fx->regs0 + 1));
  expect_ok(fx);
}

static void test_free_with_open_connections(void **state) {
  fx_t *fx = *state;
  int a = fx_connect(fx), b = fx_connect(fx);
  send_all(b, "GET /status HTTP/1.1\r\n", 22);
  assert_true(wait_regs(fx->regs0 + 3));
  sg__lh_http_free(fx->h); /* closes both and unregisters them */
  fx->h = NULL;
  assert_int_equal(sg_sock_registered_count(), fx->regs0 + 1);
  char buf[64];
  assert_true(recv(a, buf, sizeof(buf), 0) <= 0);
  assert_true(recv(b, buf, sizeof(buf), 0) <= 0);
  close(a);
  close(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_route_table),
      cmocka_unit_test(test_route_id_length),
      cmocka_unit_test(test_status_json),
      cmocka_unit_test(test_status_json_history),
      cmocka_unit_test(test_status_json_limits),
      cmocka_unit_test(test_metrics_text),
      cmocka_unit_test(test_index_html),
      cmocka_unit_test(test_new_args),
      cmocka_unit_test_setup_teardown(test_get_index, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_get_status, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_get_metrics, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_keep_alive, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_not_found_and_method, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_kill_open, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_kill_token, fx_setup_token,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_body_limits, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_garbage, fx_setup, fx_teardown),
      cmocka_unit_test_setup_teardown(test_oversized_header, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_truncated_then_close, fx_setup,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_silent_client, fx_setup_timeout,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_connection_limit, fx_setup_limit,
                                      fx_teardown),
      cmocka_unit_test_setup_teardown(test_free_with_open_connections, fx_setup,
                                      fx_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
