/*
 * client.c: the gRPC unary client channel (see stepguard/rpc_client.h).
 *
 * Map of this file (the I/O thread is client_io.c; what both share,
 * the channel's and the call's structures, is client_int.h):
 *   target parsing    "http://host:port" -> host, port, :authority
 *   calls             the call request object, its references and its
 *                     completion (finish_locked)
 *   construction      sg_rpc_channel_new, in steps: targets, options,
 *                     locks, the I/O thread, the first connection
 *   public API        call, call_start, abort, disconnect, connected, free
 *
 * Threading.  One I/O thread per channel runs a private uv loop; only it
 * touches sockets, timers and the HTTP/2 engine, which never sees `mu`:
 * the engine's operations run on the I/O thread without it held.  Caller
 * threads share with it a mutex `mu` that protects the submission queue, every
 * call's completion fields and a few channel flags.  Condition variables
 * (CLOCK_MONOTONIC): the channel's is broadcast when the connection comes
 * up; each call has its own, signalled when it completes, so a response
 * wakes its own caller only.  A call has two references: the caller's and
 * the I/O thread's.  Whoever sets `done` first (under `mu`) completes it,
 * exactly once: the I/O thread on a response or connection loss, the caller
 * itself on its deadline, abort() on abort.  A call completed by its caller
 * is marked `cancelled`; the I/O thread then resets its stream (CANCEL) or
 * drops it from the queue, and releases its reference.  So a caller never
 * waits for the I/O thread beyond its own deadline.
 *
 * An asynchronous call (sg__rpc_channel_call_start, rpc/client_async.h)
 * has no waiting caller: only the I/O thread holds it, completes it and
 * runs its callback (after releasing `mu`); abort leaves it to the I/O
 * thread, which fails it when it handles the abort, and its deadline is
 * the I/O thread's deadline timer.
 *
 * Fork.  A forked child has no I/O thread.  Every entry point compares
 * sg_sock_fork_count() with the value at creation and, in a child, touches
 * neither the mutex, the loop nor the socket (the fork registry has already
 * pointed the socket at /dev/null there).
 */
#include "stepguard/rpc_client.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "rpc/client_async.h"
#include "rpc/client_int.h"
#include "rpc/grpc.h"

/* ---- small helpers ------------------------------------------------------- */

static int is_forked(const sg_rpc_channel_t *ch) {
  return sg_sock_fork_count() != ch->fork_count;
}

static struct timespec deadline_ts(sg_deadline_t d) {
  struct timespec ts;
  if (d < 0)
    d = 0;
  ts.tv_sec = (time_t)(d / 1000000000);
  ts.tv_nsec = (long)(d % 1000000000);
  return ts;
}

/* A header value we send must be visible ASCII or space (no CR/LF/NUL). */
static int header_value_ok(const char *s, size_t max) {
  size_t n = 0;
  for (; s[n]; n++)
    if ((unsigned char)s[n] < 0x20 || (unsigned char)s[n] > 0x7e || n >= max)
      return 0;
  return 1;
}

/* ---- target parsing ------------------------------------------------------ */

/*
 * parse_target: split "http://host:port[/]", "host:port" or "[v6]:port"
 * into host (brackets removed), port and authority.  Pure; the outputs are
 * sg_malloc'd into ch on success.
 */
static int parse_target(struct target_s *ch, const char *t, sg_err_t *err) {
  const char *p = t;
  if (strncmp(p, "http://", 7) == 0)
    p += 7;
  else if (strstr(p, "://"))
    return sg_err_set(err, SG_EINVAL, "target %s: only http:// is supported",
                      t);
  size_t n = strcspn(p, "/");
  if (n == 0 || n > SG_ADDR_MAX || (p[n] == '/' && p[n + 1] != '\0'))
    return sg_err_set(err, SG_EINVAL, "target %s: expected host:port", t);
  char authority[SG_ADDR_MAX + 1], host[SG_ADDR_MAX + 1];
  int port = 0;
  memcpy(authority, p, n);
  authority[n] = '\0';
  int rc = sg_addr_split(authority, host, sizeof(host), &port, err);
  if (rc)
    return rc;
  if (port == 0)
    return sg_err_set(err, SG_EINVAL, "target %s: port out of range", t);
  ch->host = sg_malloc(strlen(host) + 1);
  ch->authority = sg_malloc(n + 1);
  if (!ch->host || !ch->authority)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  memcpy(ch->host, host, strlen(host) + 1);
  memcpy(ch->authority, authority, n + 1);
  snprintf(ch->port_str, sizeof(ch->port_str), "%d", port);
  return 0;
}

/* ---- calls and completion ------------------------------------------------ */

void sg__rpcc_call_free(call_t *c) {
  if (!c)
    return;
  sg__h2c_stream_fini(&c->st);
  sg_free(c->resp);
  sg_free(c->body);
  sg_free(c->path);
  if (c->cv_init)
    pthread_cond_destroy(&c->cv);
  sg_free(c);
}

int sg__rpcc_unref_locked(call_t *c) {
  if (--c->refs > 0)
    return 0;
  link_del(&c->all);
  link_del(&c->sq);
  return 1;
}

int sg__rpcc_complete_locked(call_t *c, int rc, int grpc_status, uint8_t *resp,
                             size_t resp_len, const char *msg) {
  if (c->done) {
    sg_free(resp);
    return 0;
  }
  c->done = 1;
  c->rc = rc;
  c->grpc_status = grpc_status;
  c->resp = resp;
  c->resp_len = resp_len;
  snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
  return 1;
}

/* Completes `c` unless it already is and wakes its caller; requires mu.
 * Returns 1 if it completed. */
static int finish_locked(call_t *c, int rc, int grpc_status, uint8_t *resp,
                         size_t resp_len, const char *msg) {
  if (!sg__rpcc_complete_locked(c, rc, grpc_status, resp, resp_len, msg))
    return 0;
  /* under mu, so the caller cannot have freed the call yet; only its own
   * caller is woken, not every waiter of the channel */
  pthread_cond_signal(&c->cv);
  return 1;
}

int sg__rpcc_deadline_locked(const sg_rpc_channel_t *ch, const call_t *c,
                             char *m, size_t cap) {
  if (!c->on_wire && !ch->conn_up && ch->last_err.code) {
    snprintf(m, cap, "%.60s: deadline passed before connecting (%.150s)",
             c->path, ch->last_err.msg);
    return ch->last_err.code;
  }
  snprintf(m, cap, "%.200s: deadline exceeded", c->path);
  return SG_ETIMEDOUT;
}

/* ---- construction -------------------------------------------------------- */

static void channel_release(sg_rpc_channel_t *ch) {
  sg_free(ch->target);
  for (size_t i = 0; i < ch->n_tg; i++) {
    sg_free(ch->tg[i].host);
    sg_free(ch->tg[i].authority);
  }
  sg_free(ch->auth_value);
  sg_free(ch);
}

/* The comma-separated targets of `target`, each into ch->tg. */
static int parse_targets(sg_rpc_channel_t *ch, const char *target,
                         sg_err_t *err) {
  int rc = 0;
  for (const char *t = target; !rc;) {
    size_t l = strcspn(t, ",");
    char one[320];
    if (l == 0 || l >= sizeof(one) || ch->n_tg == MAX_TARGETS) {
      rc = sg_err_set(err, SG_EINVAL,
                      "target %s: expected up to %d comma-separated "
                      "host:port",
                      target, MAX_TARGETS);
      break;
    }
    memcpy(one, t, l);
    one[l] = '\0';
    rc = parse_target(&ch->tg[ch->n_tg], one, err);
    ch->n_tg++; /* freed with the channel, parsed or not */
    if (!t[l])
      break;
    t += l + 1;
  }
  return rc;
}

/* The options, defaults filled in, and the authorization header value. */
static int apply_opts(sg_rpc_channel_t *ch, const sg_rpc_channel_opts_t *o,
                      sg_err_t *err) {
  if (o->auth_token && o->auth_token[0]) {
    if (!header_value_ok(o->auth_token, MAX_TOKEN_LEN))
      return sg_err_set(err, SG_EINVAL, "auth token: bad characters or length");
    size_t n = strlen(o->auth_token) + 8;
    ch->auth_value = sg_malloc(n);
    if (!ch->auth_value)
      return sg_err_set(err, SG_ENOMEM, "out of memory");
    snprintf(ch->auth_value, n, "Bearer %s", o->auth_token);
  }
  ch->max_message = o->max_message ? o->max_message : DEFAULT_MAX_MESSAGE;
  if (ch->max_message > UINT32_MAX)
    ch->max_message = UINT32_MAX;
  ch->connect_timeout_ms = o->connect_timeout_ms > 0
                               ? o->connect_timeout_ms
                               : DEFAULT_CONNECT_TIMEOUT_MS;
  ch->ka_interval_ms =
      o->keepalive_interval_ms == 0
          ? DEFAULT_KEEPALIVE_INTERVAL_MS
          : (o->keepalive_interval_ms < 0 ? 0 : o->keepalive_interval_ms);
  ch->ka_timeout_ms = o->keepalive_timeout_ms > 0
                          ? o->keepalive_timeout_ms
                          : DEFAULT_KEEPALIVE_TIMEOUT_MS;
  ch->fail_fast = o->fail_fast != 0;
  return 0;
}

/* The channel's mutex and its condition (on CLOCK_MONOTONIC, as
 * deadline_ts); on an error neither is left. */
static int sync_init(sg_rpc_channel_t *ch, sg_err_t *err) {
  pthread_condattr_t ca;
  if (pthread_condattr_init(&ca) != 0)
    return sg_err_set(err, SG_ENOMEM, "pthread_condattr_init");
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int r1 = pthread_cond_init(&ch->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (r1 != 0)
    return sg_err_set(err, SG_ENOMEM, "pthread_cond_init");
  if (pthread_mutex_init(&ch->mu, NULL) != 0) {
    pthread_cond_destroy(&ch->cv);
    return sg_err_set(err, SG_ENOMEM, "pthread_mutex_init");
  }
  return 0;
}

/* Waits until the I/O thread has connected, or `until`; then the last
 * connect failure, or SG_ETIMEDOUT. */
static int wait_connected(sg_rpc_channel_t *ch, sg_deadline_t until,
                          sg_err_t *err) {
  int rc = 0;
  struct timespec ts = deadline_ts(until);
  pthread_mutex_lock(&ch->mu);
  while (!ch->conn_up) {
    if (pthread_cond_timedwait(&ch->cv, &ch->mu, &ts) == ETIMEDOUT)
      break;
  }
  if (!ch->conn_up) {
    if (ch->last_err.code)
      rc = sg_err_set(err, ch->last_err.code, "%s", ch->last_err.msg);
    else
      rc = sg_err_set(err, SG_ETIMEDOUT,
                      "connect to %s: timed out after %lld ms", ch->target,
                      (long long)ch->connect_timeout_ms);
  }
  pthread_mutex_unlock(&ch->mu);
  return rc;
}

int sg_rpc_channel_new(const sg_rpc_channel_opts_t *o, sg_rpc_channel_t **out,
                       sg_err_t *err) {
  sg_err_clear(err);
  if (!o || !out || !o->target)
    return sg_err_set(err, SG_EINVAL, "sg_rpc_channel_new: NULL argument");
  *out = NULL;
  sg_rpc_channel_t *ch = sg_calloc(1, sizeof(*ch));
  if (!ch)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  int rc = 0, synced = 0;
  ch->target = sg_strdup(o->target);
  if (!ch->target)
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
  if (!rc)
    rc = parse_targets(ch, o->target, err);
  if (!rc)
    rc = apply_opts(ch, o, err);
  if (!rc) {
    ch->fork_count = sg_sock_fork_count();
    ch->rng =
        (uint64_t)sg_now_ns() ^ (uint64_t)(uintptr_t)ch ^ 0x9E3779B97F4A7C15ULL;
    if (!ch->rng)
      ch->rng = 1;
    ch->backoff_ms = BACKOFF_INITIAL_MS;
    atomic_init(&ch->connected, 0);
    link_init(&ch->calls);
    link_init(&ch->submitq);
    link_init(&ch->pending);
    rc = sync_init(ch, err);
    synced = !rc;
  }
  /* read before the I/O thread starts: it clears ctor_until once connected */
  sg_deadline_t until = sg_deadline_in_ms(ch->connect_timeout_ms);
  if (!rc) {
    ch->ctor_until = until;
    rc = sg__rpcc_io_start(ch, err);
  }
  if (!rc)
    rc = wait_connected(ch, until, err);
  if (rc) {
    if (ch->thread_started) {
      sg_rpc_channel_free(ch);
    } else {
      if (synced) {
        pthread_mutex_destroy(&ch->mu);
        pthread_cond_destroy(&ch->cv);
      }
      channel_release(ch);
    }
    return rc;
  }
  *out = ch;
  return 0;
}

/* ---- public API ---------------------------------------------------------- */

/* Copies a call's result out to the caller's pointers.  Requires mu. */
static int take_result_locked(call_t *c, uint8_t **resp, size_t *resp_len,
                              int *grpc_status, sg_err_t *err) {
  if (grpc_status)
    *grpc_status = c->grpc_status;
  if (c->rc == 0) {
    *resp = c->resp;
    *resp_len = c->resp_len;
    c->resp = NULL;
    c->resp_len = 0;
    return 0;
  }
  return sg_err_set(err, c->rc, "%s", c->msg);
}

/*
 * call_submit: check the arguments, build a call of `path` with a copy of
 * `req` and queue it for the I/O thread with `refs` references (2: a
 * caller waits; 1: asynchronous, the I/O thread's only).  On 0, *out is
 * the queued call.
 */
static int call_submit(sg_rpc_channel_t *ch, const char *path,
                       const uint8_t *req, size_t req_len,
                       sg_deadline_t deadline, sg__rpc_done_cb cb, void *ud,
                       call_t **out, sg_err_t *err) {
  *out = NULL;
  if (!ch || !path || (!req && req_len))
    return sg_err_set(err, SG_EINVAL, "sg_rpc_channel_call: NULL argument");
  if (is_forked(ch))
    return sg_err_set(err, SG_ESTATE,
                      "rpc channel used in a forked child process");
  if (path[0] != '/' || !header_value_ok(path, MAX_PATH_LEN) ||
      strchr(path, ' '))
    return sg_err_set(err, SG_EINVAL, "bad method path");
  if (req_len > UINT32_MAX || req_len > SIZE_MAX - SG_GRPC_PREFIX_LEN)
    return sg_err_set(err, SG_ETOOBIG, "request of %zu bytes is too big",
                      req_len);

  call_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  link_init(&c->all);
  link_init(&c->sq);
  link_init(&c->io);
  sg__h2c_stream_init(&c->st, ch->max_message);
  c->grpc_status = -1;
  c->deadline = deadline;
  c->cb = cb;
  c->cb_ud = ud;
  c->path = sg_strdup(path);
  c->body_len = SG_GRPC_PREFIX_LEN + req_len;
  c->body = sg_malloc(c->body_len);
  pthread_condattr_t ca; /* only a caller that waits needs a condition */
  if (!cb && c->path && c->body && pthread_condattr_init(&ca) == 0) {
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* as deadline_ts */
    c->cv_init = pthread_cond_init(&c->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
  }
  if (!c->path || !c->body || (!cb && !c->cv_init)) {
    sg__rpcc_call_free(c);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  sg__grpc_prefix_write(c->body, (uint32_t)req_len);
  if (req_len)
    memcpy(c->body + SG_GRPC_PREFIX_LEN, req, req_len);

  pthread_mutex_lock(&ch->mu);
  if (ch->closing || ch->aborted) {
    int code = ch->closing ? SG_ECLOSED : SG_EABORTED;
    pthread_mutex_unlock(&ch->mu);
    sg__rpcc_call_free(c);
    return sg_err_set(err, code, "channel %s",
                      code == SG_ECLOSED ? "closed" : "aborted");
  }
  c->refs = cb ? 1 : 2;
  link_push(&ch->calls, &c->all);
  link_push(&ch->submitq, &c->sq);
  pthread_mutex_unlock(&ch->mu);
  uv_async_send(&ch->wake);
  *out = c;
  return 0;
}

int sg__rpc_channel_call_start(sg_rpc_channel_t *ch, const char *path,
                               const uint8_t *req, size_t req_len,
                               sg_deadline_t deadline, sg__rpc_done_cb cb,
                               void *ud, sg_err_t *err) {
  sg_err_clear(err);
  call_t *c = NULL;
  if (!cb)
    return sg_err_set(err, SG_EINVAL,
                      "sg__rpc_channel_call_start: no "
                      "callback");
  return call_submit(ch, path, req, req_len, deadline, cb, ud, &c, err);
}

int sg_rpc_channel_call(sg_rpc_channel_t *ch, const char *path,
                        const uint8_t *req, size_t req_len,
                        sg_deadline_t deadline, uint8_t **resp,
                        size_t *resp_len, int *grpc_status, sg_err_t *err) {
  sg_err_clear(err);
  if (resp)
    *resp = NULL;
  if (resp_len)
    *resp_len = 0;
  if (grpc_status)
    *grpc_status = -1;
  if (!resp || !resp_len)
    return sg_err_set(err, SG_EINVAL, "sg_rpc_channel_call: NULL argument");
  call_t *c = NULL;
  int src = call_submit(ch, path, req, req_len, deadline, NULL, NULL, &c, err);
  if (src)
    return src;

  int kick = 0;
  struct timespec ts = deadline_ts(deadline);
  pthread_mutex_lock(&ch->mu);
  while (!c->done) {
    if (pthread_cond_timedwait(&c->cv, &ch->mu, &ts) != ETIMEDOUT)
      continue;
    if (c->done)
      break;
    char m[sizeof(c->msg)];
    int code = sg__rpcc_deadline_locked(ch, c, m, sizeof(m));
    finish_locked(c, code, -1, NULL, 0, m);
    c->cancelled = 1;
    ch->cancel_pending = 1;
    kick = 1;
  }
  int rc = take_result_locked(c, resp, resp_len, grpc_status, err);
  int last = sg__rpcc_unref_locked(c);
  pthread_mutex_unlock(&ch->mu);
  if (kick)
    uv_async_send(&ch->wake);
  if (last)
    sg__rpcc_call_free(c);
  return rc;
}

/* Completes every live call with SG_EABORTED (asynchronous ones are left
 * to the I/O thread, woken after this); requires mu. */
static void abort_locked(sg_rpc_channel_t *ch) {
  ch->aborted = 1;
  for (link_t *l = ch->calls.next; l != &ch->calls; l = l->next) {
    call_t *c = CONTAINER(l, call_t, all);
    if (c->cb)
      continue; /* the I/O thread fails it when it handles the abort */
    if (finish_locked(c, SG_EABORTED, -1, NULL, 0, "channel aborted"))
      c->cancelled = 1;
  }
}

void sg_rpc_channel_abort(sg_rpc_channel_t *ch) {
  if (!ch || is_forked(ch))
    return;
  pthread_mutex_lock(&ch->mu);
  int first = !ch->aborted;
  abort_locked(ch);
  pthread_mutex_unlock(&ch->mu);
  pthread_cond_broadcast(&ch->cv);
  if (first)
    uv_async_send(&ch->wake);
}

void sg_rpc_channel_disconnect(sg_rpc_channel_t *ch) {
  if (!ch || is_forked(ch))
    return;
  pthread_mutex_lock(&ch->mu);
  if (ch->aborted || ch->closing) {
    pthread_mutex_unlock(&ch->mu);
    return;
  }
  uint64_t my = ++ch->disc_req;
  pthread_mutex_unlock(&ch->mu);
  uv_async_send(&ch->wake);
  struct timespec ts = deadline_ts(sg_deadline_in_ms(DISCONNECT_WAIT_MS));
  pthread_mutex_lock(&ch->mu);
  while (ch->disc_done < my && !ch->aborted)
    if (pthread_cond_timedwait(&ch->cv, &ch->mu, &ts) == ETIMEDOUT)
      break;
  pthread_mutex_unlock(&ch->mu);
}

int sg_rpc_channel_connected(const sg_rpc_channel_t *ch) {
  if (!ch || is_forked(ch))
    return 0;
  return atomic_load(&((sg_rpc_channel_t *)ch)->connected);
}

void sg_rpc_channel_free(sg_rpc_channel_t *ch) {
  if (!ch)
    return;
  if (is_forked(ch)) {
    /* The parent's thread does not exist here and its mutex may be held
     * forever: release plain memory only (the loop, session and the
     * descriptors, already pointed at /dev/null, are left as they are). */
    channel_release(ch);
    return;
  }
  if (ch->thread_started) {
    pthread_mutex_lock(&ch->mu);
    abort_locked(ch);
    ch->closing = 1;
    pthread_mutex_unlock(&ch->mu);
    pthread_cond_broadcast(&ch->cv);
    uv_async_send(&ch->wake);
    pthread_join(ch->thread, NULL);
  }
  int lr = uv_loop_close(&ch->loop);
  if (lr != 0)
    sg_log(SG_LOG_WARN, LOG, "uv_loop_close: %s", uv_strerror(lr));
  /* By contract no caller is inside sg_rpc_channel_call any more, and the
   * I/O thread released its references: nothing should be left. */
  while (!link_empty(&ch->calls)) {
    call_t *c = CONTAINER(ch->calls.next, call_t, all);
    link_del(&c->all);
    sg__rpcc_call_free(c);
  }
  pthread_mutex_destroy(&ch->mu);
  pthread_cond_destroy(&ch->cv);
  channel_release(ch);
}
