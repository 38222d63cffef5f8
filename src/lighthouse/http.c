/*
 * http.c: the lighthouse's HTTP/1.1 side (see http.h for the routes).
 *
 *   1. output helpers   bounded appends to an sg_buf_t
 *   2. UTF-8 / escaping utf8_seq_len(), JSON string escaping
 *   3. router           sg__lh_http_route(): pure
 *   4. renderers        /status JSON, /metrics text (the page itself is in
 *                       dashboard.c)
 *   5. MHD glue         daemon without a listening socket, one internal
 *                       polling thread; request handler, auth, fork registry
 *
 * Threads: everything in 1-4 is pure.  In 5, the request handler and the
 * connection notifier run on MHD's single polling thread; the snapshot and
 * kill callbacks are called from there, synchronously.
 *
 * Fork registry: the listener hands us a registered socket.  MHD may close
 * a handed-over socket on its own thread without telling us (connection
 * limit, pool allocation failure, daemon shutdown before the socket was
 * adopted), and a registry entry that outlives its descriptor would make a
 * forked child dup2() /dev/null over whatever later reuses that number.
 * So the socket leaves the registry for the hand-over and re-enters it when
 * MHD's thread adopts it (MHD_CONNECTION_NOTIFY_STARTED); the CLOSED
 * notification, which MHD sends before it closes the descriptor, removes it
 * again.  The short unregistered window only risks a forked child briefly
 * holding a dashboard connection.
 */
#include "lighthouse/http.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#define SUBSYS "lighthouse.http"
#define TOKEN_MAX 1024                  /* longest accepted auth token */
#define DEFAULT_MAX_CONNECTIONS 256     /* when opts.max_connections == 0 */
#define DEFAULT_TIMEOUT_S 10            /* when opts.timeout_s == 0 */
#define CONN_MEMORY_LIMIT (32u * 1024u) /* per-connection MHD pool, bytes */
#define KILL_ERR_MAX 512                /* kill_cb's error buffer */

/* ---- 1. output helpers ------------------------------------------------- */

static int put(sg_buf_t *b, const char *s) {
  return sg_buf_append(b, s, strlen(s));
}

/* putf: a short formatted piece (numbers and fixed text, < 256 bytes). */
static int putf(sg_buf_t *b, const char *fmt, ...) SG_PRINTF(2, 3);

static int putf(sg_buf_t *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= sizeof(tmp))
    return SG_EINVAL;
  return sg_buf_append(b, tmp, (size_t)n);
}

/*
 * format_double: the shortest decimal form of `v` that reads back exactly,
 * or NaN / +Inf / -Inf as Prometheus spells them.  `out` has >= 32 bytes.
 */
static void format_double(double v, char *out, size_t outlen) {
  if (isnan(v)) {
    snprintf(out, outlen, "NaN");
    return;
  }
  if (isinf(v)) {
    snprintf(out, outlen, "%s", v > 0 ? "+Inf" : "-Inf");
    return;
  }
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(out, outlen, "%.*g", prec, v);
    if (strtod(out, NULL) == v)
      return;
  }
}

/* ---- 2. UTF-8 and escaping ---------------------------------------------- */

/*
 * utf8_seq_len: length (1..4) of the valid UTF-8 sequence at p[0..n), or 0
 * when it is not valid (overlong, surrogate, above U+10FFFF, truncated).
 */
static size_t utf8_seq_len(const uint8_t *p, size_t n) {
  uint8_t c = p[0];
  if (c < 0x80)
    return 1;
  size_t len;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1Fu;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0Fu;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07u;
  } else {
    return 0;
  }
  if (n < len)
    return 0;
  for (size_t i = 1; i < len; i++) {
    if ((p[i] & 0xC0) != 0x80)
      return 0;
    cp = cp << 6 | (p[i] & 0x3Fu);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return len;
}

/*
 * put_json_str: append `s` (NULL = "") as a quoted JSON string.  Control
 * characters, DEL and the HTML-significant <, >, & become \u escapes so the
 * document is safe to embed anywhere; invalid UTF-8 bytes become U+FFFD.
 */
static int put_json_str(sg_buf_t *b, const char *s) {
  const uint8_t *p = (const uint8_t *)(s ? s : "");
  size_t n = strlen((const char *)p);
  int rc = sg_buf_append(b, "\"", 1);
  size_t i = 0;
  while (!rc && i < n) {
    uint8_t c = p[i];
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      rc = sg_buf_append(b, esc, 2);
      i++;
    } else if (c == '\n') {
      rc = sg_buf_append(b, "\\n", 2), i++;
    } else if (c == '\r') {
      rc = sg_buf_append(b, "\\r", 2), i++;
    } else if (c == '\t') {
      rc = sg_buf_append(b, "\\t", 2), i++;
    } else if (c < 0x20 || c == 0x7F || c == '<' || c == '>' || c == '&') {
      rc = putf(b, "\\u%04x", (unsigned)c), i++;
    } else if (c < 0x80) {
      size_t run = 1; /* copy plain ASCII runs in one append */
      while (i + run < n && p[i + run] >= 0x20 && p[i + run] < 0x7F &&
             p[i + run] != '"' && p[i + run] != '\\' && p[i + run] != '<' &&
             p[i + run] != '>' && p[i + run] != '&')
        run++;
      rc = sg_buf_append(b, p + i, run);
      i += run;
    } else {
      size_t len = utf8_seq_len(p + i, n - i);
      if (len) {
        rc = sg_buf_append(b, p + i, len);
        i += len;
      } else {
        rc = sg_buf_append(b, "\\ufffd", 6);
        i++;
      }
    }
  }
  if (!rc)
    rc = sg_buf_append(b, "\"", 1);
  return rc;
}

/* ---- 3. router ---------------------------------------------------------- */

/*
 * decode_replica_id: percent-decode seg[0..n) into out->replica_id and
 * check it.  Returns NULL when it is acceptable, else a static reason.
 */
static const char *decode_replica_id(const char *seg, size_t n,
                                     sg__lh_route_match_t *out) {
  size_t len = 0;
  for (size_t i = 0; i < n; i++) {
    int c = (unsigned char)seg[i];
    if (c == '%') {
      int hi = i + 2 < n ? sg_hex_digit(seg[i + 1]) : -1;
      int lo = i + 2 < n ? sg_hex_digit(seg[i + 2]) : -1;
      if (hi < 0 || lo < 0)
        return "malformed percent-encoding";
      c = hi << 4 | lo;
      i += 2;
    }
    if (len == SG__LH_REPLICA_ID_MAX)
      return "replica id too long";
    out->replica_id[len++] = (char)c;
  }
  out->replica_id[len] = '\0';
  out->replica_id_len = len;
  if (len == 0)
    return "empty replica id";
  const uint8_t *p = (const uint8_t *)out->replica_id;
  for (size_t i = 0; i < len;) {
    if (p[i] < 0x20 || p[i] == 0x7F)
      return "control character in replica id";
    size_t sl = utf8_seq_len(p + i, len - i);
    if (!sl)
      return "replica id is not valid UTF-8";
    i += sl;
  }
  return NULL;
}

static int path_is(const char *path, size_t n, const char *lit) {
  return strlen(lit) == n && memcmp(path, lit, n) == 0;
}

sg__lh_route_t sg__lh_http_route(const char *method, const char *url,
                                 sg__lh_route_match_t *out) {
  static const char kill_pre[] = "/replica/", kill_suf[] = "/kill";
  const size_t pre = sizeof(kill_pre) - 1, suf = sizeof(kill_suf) - 1;
  out->route = SG__LH_ROUTE_BAD_REQUEST;
  out->status = 400;
  out->allow = NULL;
  out->why = "malformed request target";
  out->replica_id[0] = '\0';
  out->replica_id_len = 0;
  if (!method || !url || url[0] != '/')
    return out->route;
  size_t n = strcspn(url, "?#");
  int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  int is_post = !strcmp(method, "POST");
  out->why = NULL;

  sg__lh_route_t r = SG__LH_ROUTE_NOT_FOUND;
  if (path_is(url, n, "/"))
    r = SG__LH_ROUTE_INDEX;
  else if (path_is(url, n, "/status"))
    r = SG__LH_ROUTE_STATUS;
  else if (path_is(url, n, "/metrics"))
    r = SG__LH_ROUTE_METRICS;
  if (r != SG__LH_ROUTE_NOT_FOUND) {
    if (is_get) {
      out->route = r;
      out->status = 200;
    } else {
      out->route = SG__LH_ROUTE_BAD_METHOD;
      out->status = 405;
      out->allow = "GET, HEAD";
    }
    return out->route;
  }

  /* /replica/{seg}/kill with a non-empty seg that holds no raw '/' */
  if (n > pre + suf && memcmp(url, kill_pre, pre) == 0 &&
      memcmp(url + n - suf, kill_suf, suf) == 0 &&
      !memchr(url + pre, '/', n - pre - suf)) {
    if (!is_post) {
      out->route = SG__LH_ROUTE_BAD_METHOD;
      out->status = 405;
      out->allow = "POST";
      return out->route;
    }
    const char *why = decode_replica_id(url + pre, n - pre - suf, out);
    if (why) {
      out->route = SG__LH_ROUTE_BAD_REQUEST;
      out->status = 400;
      out->why = why;
      out->replica_id[0] = '\0';
      out->replica_id_len = 0;
      return out->route;
    }
    out->route = SG__LH_ROUTE_KILL;
    out->status = 200;
    return out->route;
  }
  out->route = SG__LH_ROUTE_NOT_FOUND;
  out->status = 404;
  return out->route;
}

/* ---- 4. renderers ------------------------------------------------------- */

#define TRY(expr)                                                              \
  do {                                                                         \
    if ((rc = (expr)) != 0)                                                    \
      goto out;                                                                \
  } while (0)

static const char *json_bool(int v) { return v ? "true" : "false"; }

/* render_member: one element of prev_quorum.members. */
static int render_member(const sg__lh_status_t *s,
                         const sg__lh_status_member_t *m, sg_buf_t *b) {
  int rc;
  TRY(put(b, "{\"replica_id\":"));
  TRY(put_json_str(b, m->replica_id));
  TRY(put(b, ",\"address\":"));
  TRY(put_json_str(b, m->address));
  TRY(put(b, ",\"store_address\":"));
  TRY(put_json_str(b, m->store_address));
  TRY(putf(b,
           ",\"step\":%" PRId64 ",\"world_size\":%" PRIu64
           ",\"commit_failures\":%" PRId64 ",\"shrink_only\":%s"
           ",\"recovering\":%s}",
           m->step, m->world_size, m->commit_failures,
           json_bool(m->shrink_only), json_bool(m->step != s->max_step)));
out:
  return rc;
}

/* age_ms: milliseconds from t_ns to the snapshot's time. */
static int64_t age_ms(const sg__lh_status_t *s, int64_t t_ns) {
  return (s->now_ns - t_ns) / 1000000;
}

/* put_ids: a JSON array of the first min(n, cap) ids. */
static int put_ids(sg_buf_t *b, const sg__lh_hid_t *ids, uint32_t n,
                   uint32_t cap) {
  int rc;
  TRY(put(b, "["));
  for (uint32_t i = 0; i < n && i < cap; i++) {
    if (i)
      TRY(put(b, ","));
    TRY(put_json_str(b, ids[i].s));
  }
  TRY(put(b, "]"));
out:
  return rc;
}

/* render_replica: one element of history.replicas. */
static int render_replica(const sg__lh_status_t *s, const sg__lh_hreplica_t *r,
                          sg_buf_t *b) {
  int rc;
  int64_t win = 0;
  double rate = sg__lh_history_rate(r, &win);
  TRY(put(b, "{\"replica_id\":"));
  TRY(put_json_str(b, r->id.s));
  TRY(putf(b, ",\"member\":%s,\"step\":%" PRId64 ",\"step_age_ms\":",
           json_bool(r->member), r->step));
  if (r->step >= 0)
    TRY(putf(b, "%" PRId64, age_ms(s, r->step_ns)));
  else
    TRY(put(b, "null"));
  TRY(putf(b, ",\"step_rate\":%.3f,\"rate_window_ms\":%" PRId64 ",\"spans\":[",
           rate, win / 1000000));
  for (uint32_t i = 0; i < r->n_spans; i++) {
    const sg__lh_hspan_t *sp = sg__lh_history_span(r, i);
    TRY(putf(b, "%s[%" PRId64 ",", i ? "," : "", age_ms(s, sp->start_ns)));
    if (sp->end_ns >= 0)
      TRY(putf(b, "%" PRId64 "]", age_ms(s, sp->end_ns)));
    else
      TRY(put(b, "null]"));
  }
  TRY(put(b, "]}"));
out:
  return rc;
}

/*
 * render_history: the "history" member: quorum changes, failures and heals
 * oldest first, and the tracked replicas (spans as [start, end] ages in
 * ms, end null while still a member).
 */
static int render_history(const sg__lh_status_t *s, sg_buf_t *b) {
  int rc;
  const sg__lh_history_t *h = s->history;
  if (!h)
    return put(b, "null");
  TRY(putf(b,
           "{\"window_ms\":%" PRId64 ",\"changes_total\":%" PRIu64
           ",\"failures_total\":%" PRIu64 ",\"heals_total\":%" PRIu64
           ",\"untracked\":%" PRIu64 ",\"changes\":[",
           h->window_ns / 1000000, h->changes_total, h->failures_total,
           h->heals_total, h->untracked));
  for (uint32_t i = 0; i < h->n_changes; i++) {
    const sg__lh_hchange_t *c = sg__lh_history_change(h, i);
    TRY(putf(b,
             "%s{\"age_ms\":%" PRId64 ",\"quorum_id\":%" PRId64
             ",\"members\":%" PRIu32 ",\"max_step\":%" PRId64
             ",\"heals\":%" PRIu32 ",\"n_joined\":%" PRIu32
             ",\"n_left\":%" PRIu32 ",\"joined\":",
             i ? "," : "", age_ms(s, c->t_ns), c->quorum_id, c->n_members,
             c->max_step, c->n_heals, c->n_joined, c->n_left));
    TRY(put_ids(b, c->joined, c->n_joined, SG__LH_HISTORY_LISTED));
    TRY(put(b, ",\"left\":"));
    TRY(put_ids(b, c->left, c->n_left, SG__LH_HISTORY_LISTED));
    TRY(put(b, "}"));
  }
  TRY(put(b, "],\"failures\":["));
  for (uint32_t i = 0; i < h->n_failures; i++) {
    const sg__lh_hfailure_t *f = sg__lh_history_failure(h, i);
    TRY(putf(b, "%s{\"age_ms\":%" PRId64 ",\"replica_id\":", i ? "," : "",
             age_ms(s, f->t_ns)));
    TRY(put_json_str(b, f->id.s));
    TRY(putf(b, ",\"quorum_id\":%" PRId64 ",\"step\":%" PRId64 ",\"reason\":",
             f->quorum_id, f->step));
    TRY(put_json_str(b, f->reason));
    TRY(put(b, "}"));
  }
  TRY(put(b, "],\"heals\":["));
  for (uint32_t i = 0; i < h->n_heals; i++) {
    const sg__lh_hheal_t *e = sg__lh_history_heal(h, i);
    TRY(putf(b, "%s{\"age_ms\":%" PRId64 ",\"replica_id\":", i ? "," : "",
             age_ms(s, e->t_ns)));
    TRY(put_json_str(b, e->id.s));
    TRY(putf(b,
             ",\"quorum_id\":%" PRId64 ",\"step\":%" PRId64
             ",\"max_step\":%" PRId64 "}",
             e->quorum_id, e->step, e->max_step));
  }
  TRY(put(b, "],\"replicas\":["));
  int first = 1;
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++) {
    if (!h->replicas[i].used)
      continue;
    if (!first)
      TRY(put(b, ","));
    first = 0;
    TRY(render_replica(s, &h->replicas[i], b));
  }
  TRY(put(b, "]}"));
out:
  return rc;
}

/*
 * The document:
 *   {"quorum_id", "reason", "heartbeat_timeout_ms", "pending",
 *    "pruned_heartbeats_total",
 *    "last_decision_us": null | the last quorum's decision time,
 *    "decisions_total": quorums timed so far,
 *    "step_floor": the step the job reached (-1: none yet),
 *    "step_regressions": quorums issued below it,
 *    "last_step_regression": {"from", "to"} (only after one),
 *    "prev_quorum": null | {"quorum_id", "age_ms", "max_step",
 *                           "num_participants", "members": [...]},
 *    "heartbeats": [{"replica_id", "age_ms", "expired", "connected",
 *                    "participating"}],
 *    "role": "single" | "follower" | "candidate" | "leader",
 *    "leader": null | address, "term", "lease_ttl_s", "lease_left_ms",
 *    "elections_won", "etcd_errors", "fenced_total", "proxied_total",
 *    "history": null | {"window_ms", "changes_total", "failures_total",
 *       "heals_total", "untracked",
 *       "changes": [{"age_ms", "quorum_id", "members", "max_step", "heals",
 *                    "n_joined", "n_left", "joined": [id], "left": [id]}],
 *       "failures": [{"age_ms", "replica_id", "quorum_id", "step",
 *                     "reason"}],
 *       "heals": [{"age_ms", "replica_id", "quorum_id", "step",
 *                  "max_step"}],
 *       "replicas": [{"replica_id", "member", "step", "step_age_ms",
 *                     "step_rate", "rate_window_ms",
 *                     "spans": [[start_age_ms, end_age_ms | null]]}]}}
 * Ages are milliseconds before the snapshot; lists are oldest first.
 */
int sg__lh_render_status_json(const sg__lh_status_t *s, sg_buf_t *b) {
  int rc;
  TRY(putf(b, "{\"role\":\"%s\",\"leader\":", s->role ? s->role : "single"));
  if (s->leader)
    TRY(put_json_str(b, s->leader));
  else
    TRY(put(b, "null"));
  TRY(putf(b,
           ",\"term\":%" PRId64 ",\"lease_ttl_s\":%" PRId64
           ",\"lease_left_ms\":%" PRId64 ",\"elections_won\":%" PRIu64
           ",\"etcd_errors\":%" PRIu64 ",\"fenced_total\":%" PRIu64
           ",\"proxied_total\":%" PRIu64 ",",
           s->term, s->lease_ttl_s, s->lease_left_ms, s->elections_won,
           s->etcd_errors, s->fenced_total, s->proxied_total));
  TRY(putf(b, "\"quorum_id\":%" PRId64 ",\"reason\":", s->quorum_id));
  TRY(put_json_str(b, s->reason));
  TRY(putf(b,
           ",\"heartbeat_timeout_ms\":%" PRId64 ",\"pending\":%zu"
           ",\"pruned_heartbeats_total\":%zu,\"last_decision_us\":",
           s->heartbeat_timeout_ms, s->n_pending, s->pruned_total));
  if (s->decision_last_ns >= 0)
    TRY(putf(b, "%.3f", (double)s->decision_last_ns / 1e3));
  else
    TRY(put(b, "null"));
  TRY(putf(b,
           ",\"decisions_total\":%" PRIu64 ",\"step_floor\":%" PRId64
           ",\"step_regressions\":%zu",
           s->decision.count, s->step_floor, s->step_regressions));
  if (s->step_regressions)
    TRY(putf(b,
             ",\"last_step_regression\":{\"from\":%" PRId64 ",\"to\":%" PRId64
             "}",
             s->regressed_from, s->regressed_to));
  TRY(put(b, ",\"prev_quorum\":"));
  if (s->has_prev) {
    size_t n = s->members ? s->n_members : 0;
    TRY(putf(b,
             "{\"quorum_id\":%" PRId64 ",\"age_ms\":%" PRId64
             ",\"max_step\":%" PRId64 ",\"num_participants\":%zu"
             ",\"members\":[",
             s->prev_quorum_id, s->prev_age_ms, s->max_step, n));
    for (size_t i = 0; i < n; i++) {
      if (i)
        TRY(put(b, ","));
      TRY(render_member(s, &s->members[i], b));
    }
    TRY(put(b, "]}"));
  } else {
    TRY(put(b, "null"));
  }
  TRY(put(b, ",\"heartbeats\":["));
  size_t nh = s->heartbeats ? s->n_heartbeats : 0;
  for (size_t i = 0; i < nh; i++) {
    const sg__lh_status_hb_t *h = &s->heartbeats[i];
    TRY(put(b, i ? ",{\"replica_id\":" : "{\"replica_id\":"));
    TRY(put_json_str(b, h->replica_id));
    TRY(putf(b,
             ",\"age_ms\":%" PRId64 ",\"expired\":%s,\"connected\":%s"
             ",\"participating\":%s}",
             h->age_ms, json_bool(h->expired), json_bool(h->connected),
             json_bool(h->participating)));
  }
  TRY(put(b, "],\"history\":"));
  TRY(render_history(s, b));
  TRY(put(b, "}\n"));
out:
  return rc;
}

#define METRIC_PREFIX "stepguard_lighthouse_"

/* put_metric: HELP, TYPE and one sample line for an unlabelled metric. */
static int put_metric(sg_buf_t *b, const char *name, const char *type,
                      const char *help, const char *value) {
  int rc;
  TRY(putf(b, "# HELP " METRIC_PREFIX "%s %s\n", name, help));
  TRY(putf(b, "# TYPE " METRIC_PREFIX "%s %s\n", name, type));
  TRY(putf(b, METRIC_PREFIX "%s %s\n", name, value));
out:
  return rc;
}

static int put_metric_u(sg_buf_t *b, const char *name, const char *type,
                        const char *help, uint64_t v) {
  char num[32];
  snprintf(num, sizeof(num), "%" PRIu64, v);
  return put_metric(b, name, type, help, num);
}

/* put_histogram: HELP, TYPE, the buckets, sum and count of `h`. */
static int put_histogram(sg_buf_t *b, const char *name, const char *help,
                         const sg__lh_hist_t *h) {
  int rc;
  char num[40];
  TRY(putf(b, "# HELP " METRIC_PREFIX "%s %s\n", name, help));
  TRY(putf(b, "# TYPE " METRIC_PREFIX "%s histogram\n", name));
  size_t nb = (h->le_s && h->counts) ? h->n_buckets : 0;
  double last = -INFINITY;
  for (size_t i = 0; i < nb; i++) {
    double le = h->le_s[i];
    if (!isfinite(le) || !(le > last))
      continue; /* +Inf comes last, from count; keep bounds increasing */
    last = le;
    format_double(le, num, sizeof(num));
    TRY(putf(b, METRIC_PREFIX "%s_bucket{le=\"%s\"} %" PRIu64 "\n", name, num,
             h->counts[i]));
  }
  TRY(putf(b, METRIC_PREFIX "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name,
           h->count));
  format_double(h->sum_s, num, sizeof(num));
  TRY(putf(b, METRIC_PREFIX "%s_sum %s\n", name, num));
  TRY(putf(b, METRIC_PREFIX "%s_count %" PRIu64 "\n", name, h->count));
out:
  return rc;
}

int sg__lh_render_metrics(const sg__lh_status_t *s, sg_buf_t *b) {
  int rc;
  char num[40];
  TRY(put_metric_u(b, "quorums_issued_total", "counter",
                   "Quorums issued since start.", s->quorums_issued));
  TRY(put_metric_u(b, "step_regressions_total", "counter",
                   "Quorums issued behind the step the job had reached.",
                   s->step_regressions));
  snprintf(num, sizeof(num), "%" PRId64, s->quorum_id);
  TRY(put_metric(b, "quorum_id", "gauge", "Current quorum id.", num));
  TRY(put_metric_u(b, "participants", "gauge",
                   "Replicas with a pending quorum request.", s->participants));
  TRY(put_metric_u(b, "healthy_replicas", "gauge",
                   "Replicas whose last heartbeat is within the timeout.",
                   s->healthy_replicas));
  TRY(put_metric_u(b, "heartbeats_total", "counter",
                   "Heartbeats received since start.", s->heartbeats_total));
  TRY(put_metric_u(b, "disconnects_total", "counter",
                   "Replica connections closed since start.",
                   s->disconnects_total));
  TRY(put_metric_u(b, "quorum_requests_total", "counter",
                   "Quorum requests received since start.",
                   s->quorum_requests_total));
  TRY(put_metric_u(b, "rejected_total", "counter",
                   "Requests rejected since start.", s->rejected_total));
  TRY(put_metric_u(b, "connections", "gauge", "Open lighthouse connections.",
                   s->connections));
  TRY(put_metric_u(b, "pruned_heartbeats_total", "counter",
                   "Heartbeat entries pruned since start.", s->pruned_total));
  TRY(put_metric_u(b, "is_leader", "gauge",
                   "1: this lighthouse decides (the leader, or the only one).",
                   s->role && (strcmp(s->role, "leader") == 0 ||
                               strcmp(s->role, "single") == 0)));
  snprintf(num, sizeof(num), "%" PRId64, s->term);
  TRY(put_metric(b, "leader_term", "gauge",
                 "Create revision of the leader key in etcd (0: no etcd).",
                 num));
  snprintf(num, sizeof(num), "%" PRId64, s->lease_left_ms);
  TRY(put_metric(b, "lease_left_ms", "gauge",
                 "Leader: time to its local lease deadline; -1 otherwise.",
                 num));
  TRY(put_metric_u(b, "elections_won_total", "counter",
                   "Elections this lighthouse won in etcd.", s->elections_won));
  TRY(put_metric_u(b, "etcd_errors_total", "counter", "Failed etcd calls.",
                   s->etcd_errors));
  TRY(put_metric_u(b, "fenced_total", "counter",
                   "Decisions skipped while calls waited: not a leader "
                   "inside its lease.",
                   s->fenced_total));

  sg__lh_hist_t lat = {s->n_lat_buckets, s->lat_bucket_le_s,
                       s->lat_bucket_counts, s->lat_sum_s, s->lat_count};
  TRY(put_histogram(b, "quorum_request_duration_seconds",
                    "Time from a quorum request to its answer.", &lat));
  TRY(put_histogram(b, "decision_seconds",
                    "Time from the event that completed a quorum (normally "
                    "its last request, parsed) to the quorum computed and "
                    "its answer encoded.",
                    &s->decision));
out:
  return rc;
}

/* ---- 5. MHD glue -------------------------------------------------------- */

struct sg__lh_http_s {
  struct MHD_Daemon *daemon;
  char *token; /* NULL: POSTs need no auth */
  size_t token_len;
  unsigned max_connections;
  atomic_uint live; /* connections handed to MHD and not yet closed */
  sg__lh_snapshot_cb snapshot;
  sg__lh_kill_cb kill;
  void *ud;
};

/* Per-request state, MHD's con_cls; freed in on_completed. */
typedef struct req_s {
  sg__lh_route_match_t match; /* decided when the headers are complete */
  size_t body_len;            /* request body bytes seen so far */
  int answered;               /* a response was queued early */
} req_t;

/*
 * ct_equal: compare a[0..alen) with the secret b[0..blen) in time that
 * depends only on blen.
 */
static int ct_equal(const char *a, size_t alen, const char *b, size_t blen) {
  unsigned diff = (unsigned)(alen != blen);
  for (size_t i = 0; i < blen; i++) {
    unsigned char x = i < alen ? (unsigned char)a[i] : 0;
    diff |= (unsigned)(x ^ (unsigned char)b[i]);
  }
  return diff == 0;
}

/* auth_ok: nonzero when no token is set or the request carries it. */
static int auth_ok(const sg__lh_http_t *h, struct MHD_Connection *c) {
  if (!h->token)
    return 1;
  const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                              MHD_HTTP_HEADER_AUTHORIZATION);
  if (!v || strncasecmp(v, "Bearer", 6) != 0 || (v[6] != ' ' && v[6] != '\t'))
    return 0;
  v += 6;
  while (*v == ' ' || *v == '\t')
    v++;
  size_t n = strlen(v);
  while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
    n--;
  return ct_equal(v, n, h->token, h->token_len);
}

/*
 * origin_ok: a browser's cross-site POST carries an Origin that names
 * another site; refuse those (a cheap CSRF guard for the kill button when
 * no token is set).  Clients that send no Origin (curl, scripts) pass.
 */
static int origin_ok(struct MHD_Connection *c) {
  const char *origin =
      MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
  if (!origin)
    return 1;
  const char *host =
      MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
  if (!host || !*host)
    return 0;
  const char *rest = NULL;
  if (strncasecmp(origin, "http://", 7) == 0)
    rest = origin + 7;
  else if (strncasecmp(origin, "https://", 8) == 0)
    rest = origin + 8;
  return rest && strcasecmp(rest, host) == 0;
}

/*
 * queue: add the common headers to `r`, queue it with `status` and drop
 * our reference.  `r` NULL (allocation failed) closes the connection.
 */
static enum MHD_Result queue(struct MHD_Connection *c, unsigned status,
                             struct MHD_Response *r, const char *ctype,
                             const char *allow) {
  if (!r)
    return MHD_NO;
  int ok =
      MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype) &&
      MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store") &&
      MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
  if (ok && allow)
    ok = MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
  if (ok && status == MHD_HTTP_UNAUTHORIZED)
    ok = MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                 "Bearer realm=\"stepguard\"");
  if (ok && !strncmp(ctype, "text/html", 9))
    ok = MHD_add_response_header(
             r, "Content-Security-Policy",
             "default-src 'none'; script-src 'unsafe-inline'; "
             "style-src 'unsafe-inline'; connect-src 'self'; "
             "base-uri 'none'; form-action 'none'; frame-ancestors 'none'") &&
         MHD_add_response_header(r, "X-Frame-Options", "DENY") &&
         MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
  enum MHD_Result res = ok ? MHD_queue_response(c, status, r) : MHD_NO;
  MHD_destroy_response(r);
  return res;
}

static const char text_plain[] = "text/plain; charset=utf-8";

/* reply_static: a response whose body is a static string. */
static enum MHD_Result reply_static(struct MHD_Connection *c, unsigned status,
                                    const char *ctype, const char *body,
                                    const char *allow) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      strlen(body), (void *)(uintptr_t)body, MHD_RESPMEM_PERSISTENT);
  return queue(c, status, r, ctype, allow);
}

/* reply_buf: a response that takes over b's bytes (b is left empty). */
static enum MHD_Result reply_buf(struct MHD_Connection *c, unsigned status,
                                 const char *ctype, sg_buf_t *b) {
  struct MHD_Response *r = NULL;
  if (b->len == 0) {
    sg_buf_free(b);
    return reply_static(c, status, ctype, "", NULL);
  }
  /* A fresh buffer was never consumed from, so data is its first byte. */
  r = MHD_create_response_from_buffer_with_free_callback(b->len, b->data,
                                                         sg_free);
  if (!r) {
    sg_buf_free(b);
    return MHD_NO;
  }
  sg_buf_init(b, b->max); /* MHD owns data now */
  return queue(c, status, r, ctype, NULL);
}

/* reply_text2: text/plain "<a><b>", b may hold arbitrary bytes. */
static enum MHD_Result reply_text2(struct MHD_Connection *c, unsigned status,
                                   const char *a, const char *bs) {
  sg_buf_t b;
  sg_buf_init(&b, strlen(a) + strlen(bs) + 1);
  if (put(&b, a) || put(&b, bs)) {
    sg_buf_free(&b);
    return MHD_NO;
  }
  return reply_buf(c, status, text_plain, &b);
}

/* serve_render: snapshot, render with `fn`, reply. */
static enum MHD_Result serve_render(sg__lh_http_t *h, struct MHD_Connection *c,
                                    int (*fn)(const sg__lh_status_t *,
                                              sg_buf_t *),
                                    const char *ctype) {
  sg__lh_status_t st;
  memset(&st, 0, sizeof(st));
  int rc = h->snapshot(h->ud, &st);
  sg_buf_t b;
  sg_buf_init(&b, SG__LH_HTTP_MAX_RENDER);
  if (!rc)
    rc = fn(&st, &b);
  sg__lh_status_free(&st);
  if (rc) {
    sg_buf_free(&b);
    sg_log(SG_LOG_WARN, SUBSYS, "/status or /metrics failed: %s",
           sg_strerror(rc));
    return reply_text2(c, MHD_HTTP_INTERNAL_SERVER_ERROR,
                       "Something went wrong: ", sg_strerror(rc));
  }
  return reply_buf(c, MHD_HTTP_OK, ctype, &b);
}

/* serve_kill: run kill_cb for the decoded replica id and map its result. */
static enum MHD_Result serve_kill(sg__lh_http_t *h, struct MHD_Connection *c,
                                  const char *replica_id) {
  char err[KILL_ERR_MAX];
  err[0] = '\0';
  sg_log(SG_LOG_INFO, SUBSYS, "dashboard kill request for replica %s",
         replica_id);
  int rc = h->kill(h->ud, replica_id, err, sizeof(err));
  err[sizeof(err) - 1] = '\0';
  if (rc == 0)
    return reply_static(c, MHD_HTTP_OK, text_plain, "ok", NULL);
  if (rc == SG_ENOTFOUND)
    return reply_text2(c, MHD_HTTP_NOT_FOUND, "failed to find replica ",
                       replica_id);
  sg_log(SG_LOG_WARN, SUBSYS, "kill %s failed: %s", replica_id,
         err[0] ? err : sg_strerror(rc));
  return reply_text2(c, MHD_HTTP_INTERNAL_SERVER_ERROR,
                     "Something went wrong: ", err[0] ? err : sg_strerror(rc));
}

/*
 * first_call: the headers are complete.  Answers now whatever needs no
 * body (routing errors, auth, oversized bodies); MHD then discards the
 * body and closes.  Returns MHD_YES to go on reading the body.
 */
static enum MHD_Result first_call(sg__lh_http_t *h, struct MHD_Connection *c,
                                  req_t *rq) {
  const sg__lh_route_match_t *m = &rq->match;
  rq->answered = 1;
  switch (m->route) {
  case SG__LH_ROUTE_NOT_FOUND:
    return reply_static(c, MHD_HTTP_NOT_FOUND, text_plain, "not found", NULL);
  case SG__LH_ROUTE_BAD_METHOD:
    return reply_static(c, MHD_HTTP_METHOD_NOT_ALLOWED, text_plain,
                        "method not allowed", m->allow);
  case SG__LH_ROUTE_BAD_REQUEST:
    return reply_text2(c, MHD_HTTP_BAD_REQUEST,
                       "bad request: ", m->why ? m->why : "malformed");
  case SG__LH_ROUTE_KILL:
    if (!origin_ok(c))
      return reply_static(c, MHD_HTTP_FORBIDDEN, text_plain,
                          "cross-origin request refused", NULL);
    if (!auth_ok(h, c))
      return reply_static(c, MHD_HTTP_UNAUTHORIZED, text_plain,
                          "missing or wrong bearer token", NULL);
    break;
  default:
    break;
  }
  const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                               MHD_HTTP_HEADER_CONTENT_LENGTH);
  if (cl) {
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(cl, &end, 10);
    if (errno || end == cl || n > SG__LH_HTTP_MAX_BODY)
      return reply_static(c, MHD_HTTP_CONTENT_TOO_LARGE, text_plain,
                          "request body too large", NULL);
  }
  rq->answered = 0;
  return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c,
                                  const char *url, const char *method,
                                  const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
  sg__lh_http_t *h = cls;
  req_t *rq = *con_cls;
  if (!rq) {
    rq = sg_calloc(1, sizeof(*rq));
    if (!rq)
      return MHD_NO; /* closes the connection */
    *con_cls = rq;
    sg__lh_http_route(method, url, &rq->match);
    return first_call(h, c, rq);
  }
  if (*upload_data_size) {
    size_t n = *upload_data_size;
    *upload_data_size = 0;
    if (rq->answered)
      return MHD_YES;
    if (n > SG__LH_HTTP_MAX_BODY - rq->body_len)
      return MHD_NO; /* chunked body over the limit: close */
    rq->body_len += n;
    return MHD_YES;
  }
  if (rq->answered)
    return MHD_YES;
  rq->answered = 1;
  switch (rq->match.route) {
  case SG__LH_ROUTE_INDEX:
    return reply_static(c, MHD_HTTP_OK, "text/html; charset=utf-8",
                        sg__lh_index_html(), NULL);
  case SG__LH_ROUTE_STATUS:
    return serve_render(h, c, sg__lh_render_status_json,
                        "application/json; charset=utf-8");
  case SG__LH_ROUTE_METRICS:
    return serve_render(h, c, sg__lh_render_metrics,
                        "text/plain; version=0.0.4; charset=utf-8");
  case SG__LH_ROUTE_KILL:
    return serve_kill(h, c, rq->match.replica_id);
  default:
    return MHD_NO; /* answered in first_call */
  }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  sg_free(*con_cls);
  *con_cls = NULL;
}

/*
 * on_connection: fork-registry bookkeeping (see the file comment).  On
 * STARTED the adopted socket re-enters the registry, and socket_context
 * records that it did; CLOSED, which MHD sends before close(), removes it.
 */
static void on_connection(void *cls, struct MHD_Connection *c,
                          void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
  sg__lh_http_t *h = cls;
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    if (ci && sg_sock_register(ci->connect_fd) == 0)
      *socket_context = h;
    else
      sg_log(SG_LOG_WARN, SUBSYS, "could not register a dashboard socket");
  } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
    atomic_fetch_sub(&h->live, 1);
    if (*socket_context && ci)
      sg_sock_unregister(ci->connect_fd);
    *socket_context = NULL;
  }
}

/* keep_raw: MHD's unescape hook; the router decodes the path itself. */
static size_t keep_raw(void *cls, struct MHD_Connection *c, char *s) {
  return strlen(s);
}

/* mhd_log: MHD's messages, at debug level, without their newline. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
  if (!sg_log_enabled(SG_LOG_DEBUG))
    return;
  char line[512];
  int n = vsnprintf(line, sizeof(line), fmt, ap);
  if (n < 0)
    return;
  size_t len = strlen(line);
  while (len && (line[len - 1] == '\n' || line[len - 1] == '\r'))
    line[--len] = '\0';
  sg_log(SG_LOG_DEBUG, SUBSYS, "mhd: %s", line);
}

/* start_daemon: one MHD daemon in the given polling mode, or NULL. */
static struct MHD_Daemon *start_daemon(sg__lh_http_t *h, unsigned poll_flag,
                                       unsigned timeout_s) {
  unsigned flags = MHD_USE_NO_LISTEN_SOCKET | MHD_USE_INTERNAL_POLLING_THREAD |
                   MHD_USE_ITC | MHD_USE_ERROR_LOG | poll_flag;
  return MHD_start_daemon(
      flags, 0, NULL, NULL, on_request, h, MHD_OPTION_CONNECTION_LIMIT,
      /* our own count (sg__lh_http_add_connection) enforces the limit; a
       * daemon that reaches its internal one stops taking connections for
       * good in 0.9.75, so it is kept out of reach */
      (unsigned)h->max_connections + 64, MHD_OPTION_CONNECTION_TIMEOUT,
      (unsigned)timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      (size_t)CONN_MEMORY_LIMIT, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
      MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
      MHD_OPTION_UNESCAPE_CALLBACK, keep_raw, h, MHD_OPTION_EXTERNAL_LOGGER,
      mhd_log, h, MHD_OPTION_END);
}

int sg__lh_http_new(const sg__lh_http_opts_t *o, sg__lh_http_t **out,
                    sg_err_t *err) {
  sg__lh_http_t *h = NULL;
  int rc = 0;
  if (!o || !out || !o->snapshot || !o->kill)
    return sg_err_set(err, SG_EINVAL, "snapshot and kill callbacks required");
  *out = NULL;
  size_t tlen = o->auth_token ? strlen(o->auth_token) : 0;
  if (tlen > TOKEN_MAX)
    return sg_err_set(err, SG_EINVAL, "auth token longer than %d bytes",
                      TOKEN_MAX);
  h = sg_calloc(1, sizeof(*h));
  if (!h) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  if (tlen) {
    h->token = sg_strdup(o->auth_token);
    if (!h->token) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
    h->token_len = tlen;
  }
  h->max_connections =
      o->max_connections ? o->max_connections : DEFAULT_MAX_CONNECTIONS;
  atomic_init(&h->live, 0);
  h->snapshot = o->snapshot;
  h->kill = o->kill;
  h->ud = o->ud;
  unsigned timeout_s = o->timeout_s ? o->timeout_s : DEFAULT_TIMEOUT_S;
  h->daemon = start_daemon(h, MHD_USE_EPOLL, timeout_s);
  if (!h->daemon) /* a build without epoll: poll works everywhere */
    h->daemon = start_daemon(h, MHD_USE_POLL, timeout_s);
  if (!h->daemon) {
    rc = sg_err_set(err, SG_EIO, "libmicrohttpd daemon did not start: %s",
                    strerror(errno));
    goto out;
  }
  *out = h;
  h = NULL;
out:
  if (h) {
    sg_free(h->token);
    sg_free(h);
  }
  return rc;
}

int sg__lh_http_add_connection(sg__lh_http_t *h, int fd) {
  if (fd < 0)
    return SG_EINVAL;
  if (!h || !h->daemon) {
    sg_sock_close(fd);
    return SG_EINVAL;
  }
  /* Reserve a slot before handing the socket over: MHD adopts it later on
   * its own thread, so counting at adoption would let a burst through. */
  if (atomic_fetch_add(&h->live, 1) >= h->max_connections) {
    atomic_fetch_sub(&h->live, 1);
    sg_sock_close(fd);
    return SG_EAGAIN;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  memset(&ss, 0, sizeof(ss));
  if (getpeername(fd, (struct sockaddr *)&ss, &sl) != 0) {
    int e = errno;
    atomic_fetch_sub(&h->live, 1);
    sg_sock_close(fd);
    return -e;
  }
  sg_sock_unregister(fd); /* MHD's thread registers it again on adoption */
  errno = 0;
  if (MHD_add_connection(h->daemon, fd, (struct sockaddr *)&ss, sl) !=
      MHD_YES) { /* MHD closed fd */
    atomic_fetch_sub(&h->live, 1);
    return errno > 0 ? -errno : SG_EIO;
  }
  return 0;
}

void sg__lh_http_free(sg__lh_http_t *h) {
  if (!h)
    return;
  if (h->daemon)
    MHD_stop_daemon(h->daemon); /* closes all; CLOSED unregisters each */
  sg_free(h->token);
  sg_free(h);
}
