/*
 * server.c: the checkpoint server.  One thread polls the listening socket,
 * an eventfd (stop, disallow) and every connection; each connection is a
 * small state machine (READ a request -> SEND a response -> READ ...).
 *
 * Serving is zero-copy: a DATA response is one sendmsg() over an iovec that
 * points into the served regions, bounded per wakeup (send_budget) so one
 * fast reader cannot starve the others.  The served memory is borrowed:
 * a connection that starts a response against the current step takes a
 * reference (`active`) under the mutex, and disallow waits for the count to
 * fall to zero (cutting the rest at its deadline) before it releases the
 * memory, like a reader-writer lock whose writer is the optimizer step.
 *
 * Same host: a MAP request from a process of this host is answered with
 * this process's id, the address of the beacon and one descriptor per region
 * (built once per serve), and the connection keeps its reference after the
 * response, until the fetcher closes it or sends another request: the
 * fetcher copies the regions itself meanwhile.  The beacon (32 random bytes
 * and a generation that serve and disallow bump) changes before disallow
 * releases the memory, so a fetcher that rereads it after each chunk knows
 * the chunk was copied from the state it was promised, even when a timeout
 * or disallow's deadline dropped its reference.
 *
 * Fork: a forked child has no server thread, and the mutex may have been
 * held at the fork.  Every entry point compares sg_sock_fork_count() with
 * its value at start; in a child, serve and disallow fail or return at once
 * and stop frees nothing (the registry already pointed the sockets at
 * /dev/null there).
 *
 * Bad input: a request that cannot be parsed, a wrong token or a range
 * past the end gets an error response and the connection closes; a
 * request that is merely refused (not serving, wrong step, wrong layout)
 * gets an error response and the connection stays.  Slow or vanished
 * peers are dropped by request_timeout_ms and stall_timeout_ms.
 */
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt_int.h"

#define IOV_BATCH 256    /* iovec entries per sendmsg */
#define ACCEPT_BUDGET 16 /* accepts per wakeup */

typedef enum { C_READ, C_SEND, C_DEAD } conn_state_t;

typedef enum { S_IDLE, S_SERVING, S_DRAINING } srv_state_t;

typedef struct conn_s {
  int fd;
  conn_state_t state;
  uint8_t in[SG_CKPT_REQ_MAX];
  size_t in_len;
  int64_t since_ns; /* READ: when it began waiting; SEND: last progress */
  uint8_t head[SG_CKPT_RESP_FIXED + SG_CKPT_MAX_ERRMSG];
  size_t head_len, head_off;
  int close_after;              /* close once the response is out */
  int holds_ref;                /* counted in server.active */
  int mapped;                   /* keeps its reference for same-host reads */
  const sg_ckpt_region_t *regs; /* what the payload is cut from */
  const uint64_t *prefix;       /* prefix sums of regs (nregs + 1) */
  size_t nregs;
  size_t ri;     /* cursor: region index */
  uint64_t roff; /* cursor: offset inside regs[ri] */
  uint64_t left; /* payload bytes still to send */
  int is_data;   /* counts towards bytes_sent */
} conn_t;

/* The beacon a same-host fetcher rereads; its bytes are the wire form. */
typedef struct beacon_s {
  uint8_t cookie[32]; /* random, per server */
  uint64_t gen;       /* bumped by serve and before disallow releases */
} beacon_t;

_Static_assert(sizeof(beacon_t) == SG_CKPT_BEACON_LEN, "beacon layout");

struct sg_ckpt_server_s {
  int listen_fd, wake_fd, port;
  sg_samehost_id_t self_id; /* valid when same_host */
  int same_host;            /* MAP requests can be granted */
  beacon_t beacon;          /* gen under mu; read by other processes */
  pthread_t thread;
  char *token;
  size_t token_len;
  int max_conns;
  int64_t request_timeout_ns, stall_timeout_ns;
  size_t send_budget;
  unsigned fork_count; /* sg_sock_fork_count() at start */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  srv_state_t state; /* under mu */
  int stop;          /* under mu */
  int cut_inflight;  /* under mu: close connections holding a reference */
  int active;        /* under mu: responses holding the served memory */
  int64_t step;      /* under mu; -1 when not serving */
  uint64_t layout;   /* under mu */
  sg_ckpt_region_t *regions; /* under mu: the data regions */
  uint64_t *prefix;          /* under mu: nregions + 1 prefix sums */
  size_t nregions;
  uint8_t *lens_le;         /* under mu: INFO payload part 1 */
  sg_ckpt_region_t info[2]; /* under mu: lens_le and the header */
  uint64_t info_prefix[3];
  uint8_t *map_payload;     /* under mu: MAP payload (same_host only) */
  sg_ckpt_region_t map_reg; /* under mu: the payload as a region */
  uint64_t map_prefix[2];

  conn_t **conns; /* server thread only */
  int nconns;

  atomic_uint_fast64_t st_bytes, st_requests, st_refused, st_bad, st_timeouts,
      st_cut, st_conns, st_maps;
  atomic_int st_open;
};

void sg_ckpt_server_opts_init(sg_ckpt_server_opts_t *o) {
  memset(o, 0, sizeof(*o));
}

static void wake(sg_ckpt_server_t *s) {
  uint64_t one = 1;
  ssize_t r = write(s->wake_fd, &one, sizeof(one));
  (void)r; /* a full counter already wakes the thread */
}

/* ---- responses ------------------------------------------------------------
 */

/* set_error: queue an error response with a message. */
static void set_error(conn_t *c, int kind, int code, int close_after,
                      const char *fmt, ...) SG_PRINTF(5, 6);

static void set_error(conn_t *c, int kind, int code, int close_after,
                      const char *fmt, ...) {
  char msg[SG_CKPT_MAX_ERRMSG];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (n < 0)
    n = 0;
  if ((size_t)n >= sizeof(msg))
    n = (int)sizeof(msg) - 1;
  sg_ckpt_resp_t r = {
      .kind = kind, .status = code, .step = -1, .payload = (uint64_t)n};
  sg_ckpt_resp_encode(&r, c->head);
  memcpy(c->head + SG_CKPT_RESP_FIXED, msg, (size_t)n);
  c->head_len = SG_CKPT_RESP_FIXED + (size_t)n;
  c->head_off = 0;
  c->left = 0;
  c->close_after = close_after;
  c->state = C_SEND;
  c->since_ns = sg_now_ns();
}

static int token_ok(const sg_ckpt_server_t *s, const sg_ckpt_req_t *r) {
  if (!s->token_len)
    return 1;
  if (r->token_len != s->token_len)
    return 0;
  unsigned char diff = 0; /* constant time in the token's length */
  for (size_t i = 0; i < s->token_len; i++)
    diff |= (unsigned char)(s->token[i] ^ r->token[i]);
  return diff == 0;
}

/* start_response: answer a parsed request (called by the server thread). */
static void drop_ref(sg_ckpt_server_t *s, conn_t *c);

static void start_response(sg_ckpt_server_t *s, conn_t *c,
                           const sg_ckpt_req_t *r) {
  if (c->mapped) { /* a new request ends the same-host reads */
    c->mapped = 0;
    drop_ref(s, c);
  }
  atomic_fetch_add(&s->st_requests, 1);
  if (!token_ok(s, r)) {
    atomic_fetch_add(&s->st_refused, 1);
    set_error(c, r->kind, SG_EAUTH, 1, "checkpoint server: bad auth token");
    return;
  }
  pthread_mutex_lock(&s->mu);
  if (s->state != S_SERVING || r->step != s->step) {
    int64_t served = s->state == S_SERVING ? s->step : -1;
    pthread_mutex_unlock(&s->mu);
    atomic_fetch_add(&s->st_refused, 1);
    set_error(c, r->kind, SG_ESTATE, 0,
              "invalid checkpoint requested, serving %lld but got step=%lld",
              (long long)served, (long long)r->step);
    return;
  }
  sg_ckpt_resp_t resp = {.kind = r->kind, .step = s->step, .layout = s->layout};
  if (r->kind == SG_CKPT_KIND_INFO) {
    resp.nregions = (uint32_t)s->nregions;
    resp.aux = s->info[1].len;
    resp.payload = s->info[0].len + s->info[1].len;
    c->regs = s->info;
    c->prefix = s->info_prefix;
    c->nregs = 2;
    c->ri = 0;
    c->roff = 0;
    c->is_data = 0;
  } else if (r->kind == SG_CKPT_KIND_MAP) {
    sg_samehost_id_t peer;
    sg_samehost_decode(r->peer_id, &peer);
    if (r->layout != s->layout) {
      pthread_mutex_unlock(&s->mu);
      atomic_fetch_add(&s->st_refused, 1);
      set_error(c, r->kind, SG_ESTATE, 0,
                "checkpoint layout mismatch at step %lld", (long long)r->step);
      return;
    }
    if (!s->same_host || !s->map_payload ||
        !sg_samehost_match(&s->self_id, &peer)) {
      pthread_mutex_unlock(&s->mu);
      set_error(c, r->kind, SG_CKPT_NOT_SAME_HOST, 0,
                "same-host reads unavailable: %s",
                s->same_host ? "not a process of this host" : "turned off");
      return;
    }
    resp.nregions = (uint32_t)s->nregions;
    resp.payload = s->map_reg.len;
    c->regs = &s->map_reg;
    c->prefix = s->map_prefix;
    c->nregs = 1;
    c->ri = 0;
    c->roff = 0;
    c->is_data = 0;
    c->mapped = 1;
    atomic_fetch_add(&s->st_maps, 1);
  } else {
    uint64_t total = s->prefix[s->nregions];
    if (r->layout != s->layout) {
      pthread_mutex_unlock(&s->mu);
      atomic_fetch_add(&s->st_refused, 1);
      set_error(c, r->kind, SG_ESTATE, 0,
                "checkpoint layout mismatch at step %lld", (long long)r->step);
      return;
    }
    if (r->offset > total || r->length > total - r->offset) {
      pthread_mutex_unlock(&s->mu);
      atomic_fetch_add(&s->st_bad, 1);
      set_error(c, r->kind, SG_EINVAL, 1,
                "range %llu+%llu is past the end (%llu bytes)",
                (unsigned long long)r->offset, (unsigned long long)r->length,
                (unsigned long long)total);
      return;
    }
    resp.payload = r->length;
    resp.aux = r->offset;
    c->regs = s->regions;
    c->prefix = s->prefix;
    c->nregs = s->nregions;
    c->ri = sg__ckpt_find(s->prefix, s->nregions, r->offset);
    c->roff = c->ri < s->nregions ? r->offset - s->prefix[c->ri] : 0;
    c->is_data = 1;
  }
  s->active++;
  c->holds_ref = 1;
  pthread_mutex_unlock(&s->mu);
  sg_ckpt_resp_encode(&resp, c->head);
  c->head_len = SG_CKPT_RESP_FIXED;
  c->head_off = 0;
  c->left = resp.payload;
  c->close_after = 0;
  c->state = C_SEND;
  c->since_ns = sg_now_ns();
}

static void drop_ref(sg_ckpt_server_t *s, conn_t *c) {
  if (!c->holds_ref)
    return;
  c->holds_ref = 0;
  c->mapped = 0;
  pthread_mutex_lock(&s->mu);
  s->active--;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void conn_close(sg_ckpt_server_t *s, conn_t *c) {
  if (c->state == C_DEAD)
    return;
  drop_ref(s, c);
  sg_sock_close(c->fd);
  c->fd = -1;
  c->state = C_DEAD;
  atomic_fetch_sub(&s->st_open, 1);
}

/* ---- connection I/O ---------------------------------------------------------
 */

static void on_writable(sg_ckpt_server_t *s, conn_t *c);

/* on_readable: read and parse; bounded by the request buffer's size. */
static void on_readable(sg_ckpt_server_t *s, conn_t *c) {
  ssize_t n;
  do
    n = recv(c->fd, c->in + c->in_len, sizeof(c->in) - c->in_len, 0);
  while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      conn_close(s, c);
    return;
  }
  if (n == 0) {
    if (c->in_len) /* a truncated request */
      atomic_fetch_add(&s->st_bad, 1);
    conn_close(s, c);
    return;
  }
  c->in_len += (size_t)n;
  sg_ckpt_req_t req;
  int used = sg_ckpt_req_parse(c->in, c->in_len, &req);
  if (used == 0)
    return;
  if (used < 0) {
    atomic_fetch_add(&s->st_bad, 1);
    set_error(c, SG_CKPT_KIND_INFO, SG_EPROTO, 1,
              "malformed checkpoint request");
    on_writable(s, c);
    return;
  }
  memmove(c->in, c->in + used, c->in_len - (size_t)used);
  c->in_len -= (size_t)used;
  start_response(s, c, &req);
  on_writable(s, c); /* write first; poll for POLLOUT only when full */
}

/* on_writable: send up to send_budget bytes of the response. */
static void on_writable(sg_ckpt_server_t *s, conn_t *c) {
  size_t budget = s->send_budget;
  for (;;) {
    struct iovec iov[IOV_BATCH];
    int niov = 0;
    size_t batch = 0;
    if (c->head_off < c->head_len) {
      iov[niov].iov_base = c->head + c->head_off;
      iov[niov].iov_len = c->head_len - c->head_off;
      batch += iov[niov].iov_len;
      niov++;
    }
    size_t ri = c->ri;
    uint64_t roff = c->roff, left = c->left;
    while (niov < IOV_BATCH && left > 0 && batch < budget && ri < c->nregs) {
      uint64_t avail = c->regs[ri].len - roff;
      if (avail == 0) {
        ri++;
        roff = 0;
        continue;
      }
      uint64_t take = avail < left ? avail : left;
      if (take > budget - batch)
        take = budget - batch;
      iov[niov].iov_base = (uint8_t *)c->regs[ri].ptr + roff;
      iov[niov].iov_len = (size_t)take;
      niov++;
      batch += (size_t)take;
      left -= take;
      roff += take;
    }
    if (niov == 0)
      break;
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    ssize_t n;
    do
      n = sendmsg(c->fd, &m, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        conn_close(s, c);
      return;
    }
    c->since_ns = sg_now_ns();
    size_t got = (size_t)n;
    budget = got < budget ? budget - got : 0;
    size_t h = c->head_len - c->head_off;
    if (got <= h) {
      c->head_off += got;
      got = 0;
    } else {
      c->head_off = c->head_len;
      got -= h;
    }
    if (c->is_data)
      atomic_fetch_add(&s->st_bytes, got);
    /* advance the payload cursor by `got` bytes */
    c->left -= got;
    while (got > 0) {
      uint64_t avail = c->regs[c->ri].len - c->roff;
      if (got < avail) {
        c->roff += got;
        got = 0;
      } else {
        got -= (size_t)avail;
        c->ri++;
        c->roff = 0;
      }
    }
    if (budget == 0 || (size_t)n < batch)
      break;
  }
  if (c->head_off == c->head_len && c->left == 0) {
    if (!c->mapped) /* a mapping holds the state until the fetcher is done */
      drop_ref(s, c);
    if (c->close_after) {
      conn_close(s, c);
      return;
    }
    c->state = C_READ;
    c->since_ns = sg_now_ns();
    if (c->in_len) { /* a request already buffered */
      sg_ckpt_req_t req;
      int used = sg_ckpt_req_parse(c->in, c->in_len, &req);
      if (used < 0) {
        atomic_fetch_add(&s->st_bad, 1);
        set_error(c, SG_CKPT_KIND_INFO, SG_EPROTO, 1,
                  "malformed checkpoint request");
      } else if (used > 0) {
        memmove(c->in, c->in + used, c->in_len - (size_t)used);
        c->in_len -= (size_t)used;
        start_response(s, c, &req);
      }
    }
  }
}

static void accept_some(sg_ckpt_server_t *s) {
  for (int i = 0; i < ACCEPT_BUDGET && s->nconns < s->max_conns; i++) {
    int fd = -1;
    int rc = sg_sock_accept(s->listen_fd, &fd);
    if (rc)
      return;
    conn_t *c = sg_calloc(1, sizeof(*c));
    if (!c) {
      sg_sock_close(fd);
      return;
    }
    c->fd = fd;
    c->state = C_READ;
    c->since_ns = sg_now_ns();
    s->conns[s->nconns++] = c;
    atomic_fetch_add(&s->st_conns, 1);
    atomic_fetch_add(&s->st_open, 1);
  }
}

/* ---- the server thread ------------------------------------------------------
 */

static void *server_main(void *arg) {
  sg_ckpt_server_t *s = arg;
  sg_thread_name("sg-ckpt-serve");
  struct pollfd *pfd = sg_calloc((size_t)s->max_conns + 2, sizeof(*pfd));
  if (!pfd) {
    sg_log(SG_LOG_ERROR, "ckpt", "checkpoint server: out of memory");
    return NULL; /* stop() still joins and cleans up */
  }
  for (;;) {
    int64_t now = sg_now_ns();
    int64_t next = now + 1000000000LL;
    pfd[0] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    pfd[1] = (struct pollfd){.fd = s->listen_fd,
                             .events = s->nconns < s->max_conns ? POLLIN : 0};
    for (int i = 0; i < s->nconns; i++) {
      conn_t *c = s->conns[i];
      pfd[i + 2] = (struct pollfd){
          .fd = c->fd, .events = c->state == C_SEND ? POLLOUT : POLLIN};
      int64_t limit = c->since_ns + (c->state == C_SEND || c->mapped
                                         ? s->stall_timeout_ns
                                         : s->request_timeout_ns);
      if (limit < next)
        next = limit;
    }
    int64_t wait_ms = (next - now) / 1000000 + 1;
    if (wait_ms < 0)
      wait_ms = 0;
    int nfds = s->nconns + 2;
    int n = poll(pfd, (nfds_t)nfds, (int)wait_ms);
    if (n < 0 && errno != EINTR)
      break;
    int cut = 0;
    if (pfd[0].revents) {
      uint64_t v;
      ssize_t r = read(s->wake_fd, &v, sizeof(v));
      (void)r;
    }
    pthread_mutex_lock(&s->mu);
    int stop = s->stop;
    cut = s->cut_inflight;
    pthread_mutex_unlock(&s->mu);
    if (stop)
      break;
    int had = s->nconns;
    for (int i = 0; i < had; i++) {
      conn_t *c = s->conns[i];
      short re = pfd[i + 2].revents;
      if (cut && c->holds_ref) {
        atomic_fetch_add(&s->st_cut, 1);
        conn_close(s, c);
        continue;
      }
      if (c->state == C_SEND && (re & (POLLOUT | POLLERR | POLLHUP)))
        on_writable(s, c);
      else if (c->state == C_READ && (re & (POLLIN | POLLERR | POLLHUP)))
        on_readable(s, c);
      if (c->state == C_DEAD)
        continue;
      int64_t lim = c->state == C_SEND || c->mapped ? s->stall_timeout_ns
                                                    : s->request_timeout_ns;
      if (sg_now_ns() - c->since_ns > lim) {
        atomic_fetch_add(&s->st_timeouts, 1);
        conn_close(s, c);
      }
    }
    if (pfd[1].revents & POLLIN)
      accept_some(s);
    int w = 0;
    for (int i = 0; i < s->nconns; i++) {
      if (s->conns[i]->state == C_DEAD)
        sg_free(s->conns[i]);
      else
        s->conns[w++] = s->conns[i];
    }
    s->nconns = w;
  }
  for (int i = 0; i < s->nconns; i++) {
    conn_close(s, s->conns[i]);
    sg_free(s->conns[i]);
  }
  s->nconns = 0;
  sg_free(pfd);
  return NULL;
}

/* ---- public API -------------------------------------------------------------
 */

static void release_served(sg_ckpt_server_t *s) {
  sg_free(s->regions);
  sg_free(s->prefix);
  sg_free(s->lens_le);
  sg_free(s->map_payload);
  s->map_payload = NULL;
  memset(&s->map_reg, 0, sizeof(s->map_reg));
  s->regions = NULL;
  s->prefix = NULL;
  s->lens_le = NULL;
  s->nregions = 0;
  memset(s->info, 0, sizeof(s->info));
  s->step = -1;
  s->layout = 0;
}

static void server_free(sg_ckpt_server_t *s) {
  if (s->listen_fd >= 0)
    sg_sock_close(s->listen_fd);
  if (s->wake_fd >= 0)
    close(s->wake_fd);
  release_served(s);
  /* a fetcher that still rereads the beacon must not find it again */
  volatile uint8_t *b = (volatile uint8_t *)&s->beacon;
  for (size_t i = 0; i < sizeof(s->beacon); i++)
    b[i] = 0;
  sg_free(s->conns);
  sg_free(s->token);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  sg_free(s);
}

int sg_ckpt_server_start(const sg_ckpt_server_opts_t *o, sg_ckpt_server_t **out,
                         sg_err_t *err) {
  char host[SG_CKPT_MAX_ADDR + 1] = "";
  int port = 0, rc;
  if (o->bind && o->bind[0] &&
      sg_addr_split(o->bind, host, sizeof(host), &port, err))
    return SG_EINVAL;
  size_t tl = o->auth_token ? strlen(o->auth_token) : 0;
  if (tl > SG_CKPT_MAX_TOKEN)
    return sg_err_set(err, SG_EINVAL, "auth token over %d bytes",
                      SG_CKPT_MAX_TOKEN);
  if (o->max_conns < 0 || o->max_conns > 65536 || o->request_timeout_ms < 0 ||
      o->stall_timeout_ms < 0)
    return sg_err_set(err, SG_EINVAL, "checkpoint server option out of range");
  sg_ckpt_server_t *s = sg_calloc(1, sizeof(*s));
  if (!s)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  s->listen_fd = -1;
  s->wake_fd = -1;
  s->step = -1;
  s->fork_count = sg_sock_fork_count();
  s->same_host = sg_samehost_self(&s->self_id) == 0;
  if (getrandom(s->beacon.cookie, sizeof(s->beacon.cookie), 0) !=
      (ssize_t)sizeof(s->beacon.cookie)) {
    /* no entropy source: unique enough to tell this server from another */
    uint64_t v[4] = {(uint64_t)sg_now_ns(), (uint64_t)getpid(),
                     (uint64_t)(uintptr_t)s, (uint64_t)sg_wall_ns()};
    memcpy(s->beacon.cookie, v, sizeof(v));
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&s->mu, NULL);
  s->max_conns = o->max_conns ? o->max_conns : 256;
  s->request_timeout_ns =
      (o->request_timeout_ms ? o->request_timeout_ms : 30000) * 1000000LL;
  s->stall_timeout_ns =
      (o->stall_timeout_ms ? o->stall_timeout_ms : 30000) * 1000000LL;
  s->send_budget = o->send_budget ? o->send_budget : (8u << 20);
  s->conns = sg_calloc((size_t)s->max_conns, sizeof(*s->conns));
  if (!s->conns) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  if (tl) {
    s->token = sg_strdup(o->auth_token);
    if (!s->token) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
    s->token_len = tl;
  }
  s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd < 0) {
    rc = sg_err_set(err, -errno, "eventfd: %s", strerror(errno));
    goto out;
  }
  rc = sg_sock_listen(host[0] ? host : NULL, port, 1024, &s->listen_fd,
                      &s->port, err);
  if (rc)
    goto out;
  if (pthread_create(&s->thread, NULL, server_main, s) != 0) {
    rc = sg_err_set(err, SG_ENOMEM, "cannot start the server thread");
    goto out;
  }
  *out = s;
  return 0;
out:
  server_free(s);
  return rc;
}

int sg_ckpt_server_port(const sg_ckpt_server_t *s) { return s->port; }

int sg_ckpt_server_serve(sg_ckpt_server_t *s, int64_t step, const void *header,
                         size_t hlen, const sg_ckpt_region_t *regions, size_t n,
                         sg_err_t *err) {
  int rc = 0;
  sg_ckpt_region_t *regs = NULL;
  uint64_t *prefix = NULL;
  uint8_t *lens = NULL, *map = NULL;
  if (sg_sock_fork_count() != s->fork_count)
    return sg_err_set(err, SG_ESTATE,
                      "checkpoint server used in a forked "
                      "child process");
  if (step < 0 || (hlen && !header) || (n && !regions))
    return sg_err_set(err, SG_EINVAL, "bad serve arguments");
  if (hlen > SG_CKPT_MAX_HEADER || n > SG_CKPT_MAX_REGIONS)
    return sg_err_set(err, SG_ETOOBIG, "header or region count over limit");
  regs = sg_malloc((n ? n : 1) * sizeof(*regs));
  prefix = sg_malloc((n + 1) * sizeof(*prefix));
  lens = sg_malloc(n ? n * 8 : 1);
  if (!regs || !prefix || !lens) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  prefix[0] = 0;
  for (size_t i = 0; i < n; i++) {
    if (regions[i].len && !regions[i].ptr) {
      rc = sg_err_set(err, SG_EINVAL, "region %zu has no memory", i);
      goto out;
    }
    if (regions[i].len > SG_CKPT_MAX_TOTAL - prefix[i]) {
      rc = sg_err_set(err, SG_ETOOBIG, "regions over %llu bytes",
                      (unsigned long long)SG_CKPT_MAX_TOTAL);
      goto out;
    }
    regs[i] = regions[i];
    prefix[i + 1] = prefix[i] + regions[i].len;
    sg_put_le64(lens + 8 * i, regions[i].len);
  }
  uint64_t *lv = NULL;
  if (n) {
    lv = sg_malloc(n * sizeof(*lv));
    if (!lv) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
    for (size_t i = 0; i < n; i++)
      lv[i] = regions[i].len;
  }
  uint64_t layout = sg_ckpt_layout_id(lv, n);
  sg_free(lv);
  if (s->same_host) {
    map = sg_malloc(SG_CKPT_MAP_FIXED + n * SG_CKPT_DESC_LEN);
    if (!map) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
    for (size_t i = 0; i < n; i++) {
      uint8_t *d = map + SG_CKPT_MAP_FIXED + SG_CKPT_DESC_LEN * i;
      sg_put_le64(d, (uint64_t)(uintptr_t)regions[i].ptr);
      sg_put_le64(d + 8, regions[i].len);
    }
  }
  pthread_mutex_lock(&s->mu);
  if (s->state != S_IDLE) {
    pthread_mutex_unlock(&s->mu);
    rc = sg_err_set(err, SG_ESTATE, "already serving step %lld",
                    (long long)s->step);
    goto out;
  }
  s->beacon.gen++;
  if (map) {
    sg_ckpt_map_t m = {.id = s->self_id,
                       .beacon_addr = (uint64_t)(uintptr_t)&s->beacon};
    memcpy(m.beacon, &s->beacon, SG_CKPT_BEACON_LEN);
    sg_ckpt_map_encode(&m, map);
    s->map_payload = map;
    s->map_reg = (sg_ckpt_region_t){
        .ptr = map, .len = SG_CKPT_MAP_FIXED + (uint64_t)n * SG_CKPT_DESC_LEN};
    s->map_prefix[0] = 0;
    s->map_prefix[1] = s->map_reg.len;
    map = NULL;
  }
  s->regions = regs;
  s->prefix = prefix;
  s->lens_le = lens;
  s->nregions = n;
  s->info[0] = (sg_ckpt_region_t){.ptr = lens, .len = (uint64_t)n * 8};
  s->info[1] = (sg_ckpt_region_t){.ptr = (void *)header, .len = hlen};
  s->info_prefix[0] = 0;
  s->info_prefix[1] = s->info[0].len;
  s->info_prefix[2] = s->info[0].len + hlen;
  s->layout = layout;
  s->step = step;
  s->state = S_SERVING;
  regs = NULL;
  prefix = NULL;
  lens = NULL;
  pthread_mutex_unlock(&s->mu);
out:
  sg_free(regs);
  sg_free(prefix);
  sg_free(lens);
  sg_free(map);
  return rc;
}

static void deadline_ts(sg_deadline_t d, struct timespec *ts) {
  int64_t cap = sg_now_ns() + 100000000LL; /* wake at least every 100 ms */
  if (d > cap)
    d = cap;
  ts->tv_sec = (time_t)(d / 1000000000LL);
  ts->tv_nsec = (long)(d % 1000000000LL);
}

int sg_ckpt_server_disallow(sg_ckpt_server_t *s, sg_deadline_t deadline) {
  int rc = 0;
  if (sg_sock_fork_count() != s->fork_count)
    return 0; /* the child serves nothing */
  pthread_mutex_lock(&s->mu);
  if (s->state == S_IDLE) {
    pthread_mutex_unlock(&s->mu);
    return 0;
  }
  s->state = S_DRAINING; /* refuse new requests from now on */
  while (s->active > 0 && !sg_deadline_passed(deadline)) {
    struct timespec ts;
    deadline_ts(deadline, &ts);
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
  }
  if (s->active > 0) {
    rc = SG_ETIMEDOUT;
    s->cut_inflight = 1;
    wake(s);
    /* the server thread closes them on its next turn */
    while (s->active > 0 && !s->stop) {
      struct timespec ts;
      deadline_ts(sg_now_ns() + 100000000LL, &ts);
      pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    s->cut_inflight = 0;
  }
  /* the beacon changes before the memory may: a same-host reader that
   * rereads it after its copy sees whether the copy can be trusted */
  s->beacon.gen++;
  atomic_thread_fence(memory_order_seq_cst);
  release_served(s);
  s->state = S_IDLE;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

void sg_ckpt_server_stats(sg_ckpt_server_t *s, sg_ckpt_server_stats_t *o) {
  o->bytes_sent = atomic_load(&s->st_bytes);
  o->requests = atomic_load(&s->st_requests);
  o->refused = atomic_load(&s->st_refused);
  o->bad_input = atomic_load(&s->st_bad);
  o->timeouts = atomic_load(&s->st_timeouts);
  o->cut = atomic_load(&s->st_cut);
  o->maps = atomic_load(&s->st_maps);
  o->conns = atomic_load(&s->st_conns);
  o->open_conns = atomic_load(&s->st_open);
}

void sg_ckpt_server_stop(sg_ckpt_server_t *s) {
  if (!s)
    return;
  if (sg_sock_fork_count() != s->fork_count)
    return; /* no thread to join here; the parent owns the rest */
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_mutex_unlock(&s->mu);
  wake(s);
  pthread_join(s->thread, NULL);
  server_free(s);
}
