/*
 * setup.c: building the communicator's mesh.
 *
 *   new        sg_comm_new: listen, the wake eventfd, the staging buffer
 *   handshake  small blocking I/O bounded by a deadline and the wake fd
 *   dial       connect to each lower rank, say HELLO, read REPLY (retries
 *              a refused connect until the deadline)
 *   accept     accept until every higher rank is in; several handshakes
 *              run at once and a bad one is refused without stopping the
 *              others
 *   same host  offer this process's memory to peers on the same host and
 *              probe theirs (stepguard/samehost.h); TCP stays the fallback
 *   connect    sg_comm_connect: all of the above, then the progress thread
 */
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"
#include "stepguard/samehost.h"

#define LOG_SUB "comm"
#define STAGE_BYTES (1u << 20)    /* circular staging buffer for reduction */
#define DEFAULT_SMALL (64u << 10) /* latency algorithm up to this size */
#define PAIR_SMALL (1u << 20)     /* the same, for two ranks (see below) */
#define MAX_PENDING 64            /* handshakes in progress at once */
#define PROGRESS_DEFAULT_MS 2000  /* the progress deadline by default */
#define KA_MAX_MS 500             /* longest gap between KEEPALIVEs */
#define KA_MIN_MS 5               /* shortest gap between KEEPALIVEs */
#define HANDSHAKE_MS 10000        /* one handshake's own limit */
#define SLICE_MS 100              /* abort latency bound for blocking steps */
#define PULL_MIN (256u << 10)     /* same-host path from this size */
#define LOOP_SNDBUF (256 << 10)   /* send buffer between two ends on one host */

/* ---- setup ------------------------------------------------------------------
 */

int sg_comm_new(const sg_comm_opts_t *o, sg_comm_t **out, sg_err_t *err) {
  sg_comm_t *c = NULL;
  int rc = 0;
  if (!o || o->world_size < 1 || o->world_size > SG_COMM_MAX_WORLD ||
      o->rank < 0 || o->rank >= o->world_size)
    return sg_err_set(err, SG_EINVAL, "rank %d / world size %d invalid",
                      o ? o->rank : -1, o ? o->world_size : -1);
  if ((o->job && strlen(o->job) > SG_COMM_MAX_JOB) ||
      (o->auth_token && strlen(o->auth_token) > SG_COMM_MAX_TOKEN))
    return sg_err_set(err, SG_EINVAL, "job or token longer than %d bytes",
                      SG_COMM_MAX_JOB);
  c = sg_calloc(1, sizeof(*c));
  if (!c)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  c->listen_fd = -1;
  c->wake_fd = -1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  c->rank = o->rank;
  c->world = o->world_size;
  c->generation = o->generation;
  /* Two ranks: recursive doubling is one sg__comm_exchange, moving the same
   * bytes each way as the ring's two steps but without the second step waiting
   * on the first one's reduction; it needs the whole message in staging,
   * hence the staging buffer's size as its limit. */
  c->small_max = o->small_max         ? o->small_max
                 : o->world_size == 2 ? PAIR_SMALL
                                      : DEFAULT_SMALL;
  c->same_host = o->same_host;
  c->pull_min = o->pull_min ? o->pull_min : PULL_MIN;
  /* the progress deadline; KEEPALIVEs go at a quarter of it, and at least
   * every KA_MAX_MS whatever it is, so that a peer with a shorter deadline
   * (or ours off) still hears from us in time */
  int64_t pms = o->progress_timeout_ms == 0  ? PROGRESS_DEFAULT_MS
                : o->progress_timeout_ms < 0 ? 0
                                             : o->progress_timeout_ms;
  c->progress_ns = pms * 1000000;
  int64_t ka_ms = pms > 0 && pms / 4 < KA_MAX_MS ? pms / 4 : KA_MAX_MS;
  c->ka_ns = (ka_ms > KA_MIN_MS ? ka_ms : KA_MIN_MS) * 1000000;
  uint64_t seed = (uint64_t)sg_now_ns() ^ ((uint64_t)getpid() << 32) ^
                  (uint64_t)(uintptr_t)c ^ o->generation ^ (uint64_t)o->rank;
  for (size_t i = 0; i < SG__COMM_PROBE_LEN; i++) { /* splitmix64 bytes */
    seed += 0x9e3779b97f4a7c15ull;
    uint64_t z = seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    c->probe[i] = (uint8_t)(z ^ (z >> 31));
  }
  c->job = sg_strdup(o->job ? o->job : "");
  c->token = sg_strdup(o->auth_token ? o->auth_token : "");
  c->peers = sg_calloc((size_t)c->world, sizeof(*c->peers));
  c->stage_cap = STAGE_BYTES > c->small_max ? STAGE_BYTES : c->small_max;
  c->stage_cap = (c->stage_cap + 7) & ~(size_t)7;
  c->quant_chunk = SG__QUANT_CHUNK;
  c->stage = sg_malloc(c->stage_cap);
  if (!c->job || !c->token || !c->peers || !c->stage) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (int i = 0; i < c->world; i++) {
    c->peers[i].fd = -1;
    c->peers[i].ka_off = SG__COMM_FRAME_LEN;
  }
  c->fork_gen = sg_sock_fork_count();
  c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (c->wake_fd < 0) {
    rc = sg_err_set(err, -errno, "eventfd: %s", strerror(errno));
    goto out;
  }
  /* a forked child gets /dev/null here, so it cannot wake our thread */
  rc = sg_sock_register(c->wake_fd);
  if (rc) {
    sg_err_set(err, rc, "cannot register the wakeup descriptor");
    goto out;
  }
  rc = sg_sock_listen(o->bind_host, 0, 128, &c->listen_fd, &c->port, err);
  if (rc)
    goto out;
  *out = c;
  c = NULL;
out:
  if (c)
    sg__comm_release(c);
  return rc;
}

/* wait_fd: poll one fd (and the wake fd) for `events` until `deadline`.
 * 0 when ready, SG_ETIMEDOUT, or the stop code. */
static int wait_fd(sg_comm_t *c, int fd, short events, sg_deadline_t deadline) {
  for (;;) {
    if (atomic_load(&c->stop))
      return sg__comm_stop_code(c);
    int64_t left = sg_deadline_left_ms(deadline);
    if (left == 0)
      return SG_ETIMEDOUT;
    struct pollfd p[2] = {{.fd = fd, .events = events},
                          {.fd = c->wake_fd, .events = POLLIN}};
    int n = poll(p, 2, left > 1000 ? 1000 : (int)left);
    if (n < 0 && errno != EINTR)
      return -errno;
    if (n > 0 && p[0].revents)
      return 0;
  }
}

/* send_all / recv_exact: small blocking I/O for the handshake. */
static int send_all(sg_comm_t *c, int fd, const uint8_t *p, size_t n,
                    sg_deadline_t deadline) {
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno != EAGAIN)
      return -errno;
    int rc = wait_fd(c, fd, POLLOUT, deadline);
    if (rc)
      return rc;
  }
  return 0;
}

/* recv_exact: read exactly n (few) bytes by `deadline`; SG_EPEER at EOF. */
static int recv_exact(sg_comm_t *c, int fd, uint8_t *p, size_t n,
                      sg_deadline_t deadline) {
  while (n) {
    ssize_t m = recv(fd, p, n, MSG_DONTWAIT);
    if (m > 0) {
      p += m;
      n -= (size_t)m;
      continue;
    }
    if (m == 0)
      return SG_EPEER;
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN)
      return -errno;
    int rc = wait_fd(c, fd, POLLIN, deadline);
    if (rc)
      return rc;
  }
  return 0;
}

/* dial: connect to rank p at addr, say HELLO, read REPLY.  Retries refused
 * connections until the deadline (the peer may not be listening yet). */
static int dial(sg_comm_t *c, int p, const char *addr, sg_deadline_t deadline,
                sg_err_t *err) {
  char host[256];
  int port = 0, fd = -1, rc;
  uint8_t hello[SG__COMM_HELLO_MAX], reply[SG__COMM_REPLY_LEN];
  size_t got = 0;
  if (sg_addr_split(addr, host, sizeof(host), &port, NULL) || port == 0)
    return sg_err_set(err, SG_EINVAL, "rank %d: bad address \"%s\"", p,
                      addr ? addr : "(null)");
  for (;;) {
    if (atomic_load(&c->stop)) {
      rc = sg_err_set(err, sg__comm_stop_code(c), "%s", sg__comm_stop_msg(c));
      goto out;
    }
    if (sg_deadline_passed(deadline)) {
      rc = sg_err_set(err, SG_ETIMEDOUT, "rank %d at %s: connect timed out", p,
                      addr);
      goto out;
    }
    sg_deadline_t slice = sg_deadline_in_ms(SLICE_MS);
    sg_err_t e2;
    rc = sg_sock_connect(host, port, slice < deadline ? slice : deadline, &fd,
                         &e2);
    if (rc == 0)
      break;
    if (rc == SG_ENOTFOUND || rc == SG_EINVAL) {
      sg_err_set(err, rc, "rank %d: %s", p, e2.msg);
      goto out;
    }
    if (rc != SG_ETIMEDOUT) { /* refused or reset: wait a little */
      struct pollfd w = {.fd = c->wake_fd, .events = POLLIN};
      poll(&w, 1, 20);
    }
  }
  int n = sg__comm_hello_encode(hello, c->generation, (uint32_t)c->rank,
                                (uint32_t)c->world, c->job, c->token);
  rc = n < 0 ? n : send_all(c, fd, hello, (size_t)n, deadline);
  if (rc) {
    sg_err_set(err, rc, "rank %d at %s: handshake: %s", p, addr,
               sg_strerror(rc));
    goto out;
  }
  sg__comm_reply_t r;
  for (;;) {
    ssize_t m = recv(fd, reply + got, sizeof(reply) - got, MSG_DONTWAIT);
    if (m > 0) {
      got += (size_t)m;
      int pr = sg__comm_reply_parse(reply, got, &r);
      if (pr > 0)
        break;
      if (pr < 0) {
        rc = sg_err_set(err, SG_EPROTO, "rank %d at %s: malformed reply", p,
                        addr);
        goto out;
      }
      continue;
    }
    if (m == 0) {
      rc = sg_err_set(err, SG_EPROTO,
                      "rank %d at %s closed the connection during the "
                      "handshake",
                      p, addr);
      goto out;
    }
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN) {
      rc = sg_err_set(err, -errno, "rank %d at %s: %s", p, addr,
                      strerror(errno));
      goto out;
    }
    rc = wait_fd(c, fd, POLLIN, deadline);
    if (rc) {
      sg_err_set(err, rc, "rank %d at %s: handshake: %s", p, addr,
                 sg_strerror(rc));
      goto out;
    }
  }
  if (r.status) {
    rc = sg_err_set(err, r.status == SG_EAUTH ? SG_EAUTH : SG_EPROTO,
                    "rank %d at %s refused us: %s", p, addr,
                    sg_strerror(r.status));
    goto out;
  }
  if (r.rank != (uint32_t)p || r.generation != c->generation) {
    rc = sg_err_set(err, SG_EPROTO,
                    "%s answered as rank %u generation %llu, expected rank %d "
                    "generation %llu",
                    addr, r.rank, (unsigned long long)r.generation, p,
                    (unsigned long long)c->generation);
    goto out;
  }
  c->peers[p].fd = fd;
  fd = -1;
out:
  sg_sock_close(fd);
  return rc;
}

struct pending {
  int fd;
  size_t len;
  sg_deadline_t deadline;
  uint8_t buf[SG__COMM_HELLO_MAX];
};

/* refuse: tell a bad peer why (best effort) and drop it. */
static void refuse(sg_comm_t *c, struct pending *pd, int status,
                   const char *why) {
  uint8_t reply[SG__COMM_REPLY_LEN];
  sg__comm_reply_encode(reply, c->generation, (uint32_t)c->rank, status);
  ssize_t n = send(pd->fd, reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)n;
  sg_log(SG_LOG_WARN, LOG_SUB, "rank %d refused a connection: %s", c->rank,
         why);
  sg_sock_close(pd->fd);
  pd->fd = -1;
}

/* handle_pending: read what pd's socket has; admit or refuse it when the
 * HELLO is complete.  Returns 1 when a peer was admitted. */
static int handle_pending(sg_comm_t *c, struct pending *pd) {
  for (;;) {
    size_t room = sizeof(pd->buf) - pd->len;
    if (room == 0) {
      refuse(c, pd, SG_EPROTO, "oversized handshake");
      return 0;
    }
    ssize_t m = recv(pd->fd, pd->buf + pd->len, room, MSG_DONTWAIT);
    if (m < 0 && errno == EINTR)
      continue;
    if (m < 0 && errno == EAGAIN)
      return 0;
    if (m <= 0) {
      sg_sock_close(pd->fd);
      pd->fd = -1;
      return 0;
    }
    pd->len += (size_t)m;
    sg__comm_hello_t h;
    int pr = sg__comm_hello_parse(pd->buf, pd->len, &h);
    if (pr == 0)
      continue;
    if (pr < 0 || (size_t)pr != pd->len) {
      refuse(c, pd, SG_EPROTO, "malformed handshake");
      return 0;
    }
    sg_err_t e;
    sg_err_clear(&e);
    int rc = sg__comm_hello_check(&h, c->generation, c->rank, c->world, c->job,
                                  c->token, &e);
    if (rc == 0 && c->peers[h.rank].fd >= 0)
      rc = sg_err_set(&e, SG_EPROTO, "rank %u is already connected", h.rank);
    if (rc) {
      refuse(c, pd, rc, e.msg);
      return 0;
    }
    uint8_t reply[SG__COMM_REPLY_LEN];
    sg__comm_reply_encode(reply, c->generation, (uint32_t)c->rank, 0);
    if (send(pd->fd, reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT) !=
        (ssize_t)sizeof(reply)) {
      sg_sock_close(pd->fd);
      pd->fd = -1;
      return 0;
    }
    c->peers[h.rank].fd = pd->fd;
    pd->fd = -1;
    return 1;
  }
}

/* accept_higher: accept until every rank above ours is connected. */
static int accept_higher(sg_comm_t *c, sg_deadline_t deadline, sg_err_t *err) {
  int need = c->world - 1 - c->rank, rc = 0;
  struct pending *pend = sg_calloc(MAX_PENDING, sizeof(*pend));
  struct pollfd *pfd = sg_calloc(MAX_PENDING + 2, sizeof(*pfd));
  if (!pend || !pfd) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (int i = 0; i < MAX_PENDING; i++)
    pend[i].fd = -1;
  while (need > 0) {
    if (atomic_load(&c->stop)) {
      rc = sg_err_set(err, sg__comm_stop_code(c), "%s", sg__comm_stop_msg(c));
      goto out;
    }
    int64_t left = sg_deadline_left_ms(deadline);
    if (left == 0) {
      char missing[128] = "";
      size_t off = 0;
      for (int p = c->rank + 1; p < c->world && off < sizeof(missing) - 12; p++)
        if (c->peers[p].fd < 0)
          off +=
              (size_t)snprintf(missing + off, sizeof(missing) - off, " %d", p);
      rc = sg_err_set(err, SG_ETIMEDOUT,
                      "timed out waiting for ranks%s to connect", missing);
      goto out;
    }
    int np = 0, free_slot = -1;
    sg_deadline_t now = sg_now_ns();
    for (int i = 0; i < MAX_PENDING; i++) {
      if (pend[i].fd >= 0 && now >= pend[i].deadline)
        refuse(c, &pend[i], SG_EPROTO, "handshake too slow");
      if (pend[i].fd < 0 && free_slot < 0)
        free_slot = i;
    }
    pfd[np++] = (struct pollfd){.fd = c->wake_fd, .events = POLLIN};
    pfd[np++] = (struct pollfd){.fd = free_slot >= 0 ? c->listen_fd : -1,
                                .events = POLLIN};
    for (int i = 0; i < MAX_PENDING; i++)
      pfd[np++] = (struct pollfd){.fd = pend[i].fd, .events = POLLIN};
    int n = poll(pfd, (nfds_t)np, left > SLICE_MS ? SLICE_MS : (int)left);
    if (n < 0 && errno != EINTR) {
      rc = sg_err_set(err, -errno, "poll: %s", strerror(errno));
      goto out;
    }
    if (n <= 0)
      continue;
    for (int i = 0; i < MAX_PENDING; i++)
      if (pend[i].fd >= 0 && pfd[2 + i].revents)
        need -= handle_pending(c, &pend[i]);
    if (free_slot >= 0 && pfd[1].revents) {
      int fd;
      if (sg_sock_accept(c->listen_fd, &fd) == 0) {
        struct pending *pd = &pend[free_slot];
        pd->fd = fd;
        pd->len = 0;
        sg_deadline_t hd = sg_deadline_in_ms(HANDSHAKE_MS);
        pd->deadline = hd < deadline ? hd : deadline;
      }
    }
  }
out:
  for (int i = 0; pend && i < MAX_PENDING; i++)
    sg_sock_close(pend[i].fd);
  sg_free(pend);
  sg_free(pfd);
  return rc;
}

/*
 * samehost_setup: once the mesh is complete, send every peer an OFFER (our
 * sg_samehost_id and where our probe bytes are), read theirs, try each
 * peer's probe, and answer each with PULL: whether we will read its memory.
 * Another host, a failed probe or the path turned off only mean TCP; a
 * malformed offer or answer, a silent peer or a closed connection fail the
 * setup with the peer named.  Every message is small and sent before
 * anything is awaited, so the exchange cannot deadlock.
 */
static int samehost_setup(sg_comm_t *c, sg_deadline_t deadline, sg_err_t *err) {
  sg_samehost_id_t self;
  sg__comm_offer_t mine;
  uint8_t buf[SG__COMM_OFFER_LEN];
  const char *what = "offer";
  int rc = 0, p;
  memset(&mine, 0, sizeof(mine));
  int ok = c->same_host >= 0 && sg_samehost_self(&self) == 0;
  if (ok) {
    mine.flags = 1;
    sg_samehost_encode(&self, mine.id);
    mine.probe_addr = (uint64_t)(uintptr_t)c->probe;
    memcpy(mine.probe, c->probe, SG__COMM_PROBE_LEN);
  }
  sg__comm_offer_encode(buf, &mine);
  for (p = 0; p < c->world && rc == 0; p++)
    if (p != c->rank)
      rc = send_all(c, c->peers[p].fd, buf, sizeof(buf), deadline);
  if (rc) {
    p--;
    goto out;
  }
  for (p = 0; p < c->world; p++) {
    if (p == c->rank)
      continue;
    sg__comm_offer_t theirs;
    rc = recv_exact(c, c->peers[p].fd, buf, sizeof(buf), deadline);
    if (rc == 0 && sg__comm_offer_parse(buf, sizeof(buf), &theirs))
      rc = SG_EPROTO;
    if (rc)
      goto out;
    sg_samehost_id_t id;
    sg_samehost_decode(theirs.id, &id);
    int match = ok && (theirs.flags & 1) &&
                (sg_samehost_match(&self, &id) ||
                 (c->same_host > 0 && memcmp(theirs.id, mine.id, 32) == 0));
    if (match) {
      int pr = sg_samehost_probe(id.pid, theirs.probe_addr, theirs.probe,
                                 SG__COMM_PROBE_LEN);
      if (pr == 0) {
        c->peers[p].pull_from = 1;
        c->peers[p].pid = id.pid;
      } else {
        sg_log(SG_LOG_INFO, LOG_SUB,
               "rank %d: cannot read rank %d's memory (%s); using TCP", c->rank,
               p, sg_strerror(pr));
      }
    }
    uint8_t ans[SG__COMM_FRAME_LEN];
    sg__comm_frame_t f = {.type = SG__COMM_FRAME_PULL,
                          .seq = (uint64_t)c->peers[p].pull_from};
    sg__comm_frame_encode(ans, &f);
    what = "answer";
    rc = send_all(c, c->peers[p].fd, ans, sizeof(ans), deadline);
    if (rc)
      goto out;
    what = "offer";
  }
  what = "answer";
  for (p = 0; p < c->world; p++) {
    if (p == c->rank)
      continue;
    sg__comm_frame_t f;
    rc = recv_exact(c, c->peers[p].fd, buf, SG__COMM_FRAME_LEN, deadline);
    if (rc == 0 && (sg__comm_frame_parse(buf, SG__COMM_FRAME_LEN, &f) ||
                    f.type != SG__COMM_FRAME_PULL))
      rc = SG_EPROTO;
    if (rc)
      goto out;
    c->peers[p].pull_to = (int)f.seq;
  }
out:
  if (rc)
    sg_err_set(err, rc, "rank %d: same-host %s: %s", p, what,
               rc == SG_EPROTO  ? "malformed"
               : rc == SG_EPEER ? "connection closed"
                                : sg_strerror(rc));
  return rc;
}

/*
 * loopback_tune: a connection whose two ends have the same address joins
 * two processes of this host.  There the receiver copies out of the very
 * pages the sender's copy just wrote, so a small send queue keeps them in
 * cache; the autotuned one (up to tcp_wmem's 4 MiB) spills them: at 64 MiB
 * a 256 KiB SO_SNDBUF took 30-40% less CPU per allreduce, and 2.3x less
 * time at 4 ranks (docs/internals/comm.md).  Between hosts the buffer
 * must cover the bandwidth-delay product, so it stays autotuned there.
 * Best effort: a failure only leaves the default.
 */
static void loopback_tune(int fd) {
  struct sockaddr_storage a, b;
  socklen_t la = sizeof(a), lb = sizeof(b);
  int same = 0, v = LOOP_SNDBUF;
  if (getsockname(fd, (struct sockaddr *)&a, &la) != 0 ||
      getpeername(fd, (struct sockaddr *)&b, &lb) != 0 ||
      a.ss_family != b.ss_family)
    return;
  if (a.ss_family == AF_INET)
    same = ((struct sockaddr_in *)&a)->sin_addr.s_addr ==
           ((struct sockaddr_in *)&b)->sin_addr.s_addr;
  else if (a.ss_family == AF_INET6)
    same = memcmp(&((struct sockaddr_in6 *)&a)->sin6_addr,
                  &((struct sockaddr_in6 *)&b)->sin6_addr,
                  sizeof(struct in6_addr)) == 0;
  if (same)
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v));
}

int sg_comm_connect(sg_comm_t *c, const char *const *addrs,
                    sg_deadline_t deadline, sg_err_t *err) {
  int rc = 0;
  pthread_mutex_lock(&c->mu);
  if (c->state != SG__COMM_ST_NEW || c->closing)
    rc = sg_err_set(err, SG_ESTATE, "sg_comm_connect called twice");
  else
    c->state = SG__COMM_ST_CONNECTING;
  pthread_mutex_unlock(&c->mu);
  if (rc)
    return rc;
  if (!addrs && c->world > 1) {
    rc = sg_err_set(err, SG_EINVAL, "no peer addresses");
    goto out;
  }
  for (int p = 0; p < c->rank && rc == 0; p++)
    rc = dial(c, p, addrs[p], deadline, err);
  if (rc == 0)
    rc = accept_higher(c, deadline, err);
  for (int p = 0; rc == 0 && p < c->world; p++)
    if (p != c->rank)
      loopback_tune(c->peers[p].fd);
  if (rc == 0)
    rc = samehost_setup(c, deadline, err);
  if (rc == 0) { /* every peer's silence clock starts now */
    int64_t now = sg_now_ns();
    for (int p = 0; p < c->world; p++)
      c->peers[p].last_rx = c->peers[p].last_tx = now;
    c->ka_next = now;
  }
  if (rc == 0 &&
      pthread_create(&c->thread, NULL, sg__comm_progress_main, c) != 0)
    rc = sg_err_set(err, SG_ENOMEM, "cannot start the progress thread");
out:
  if (rc == 0) { /* the mesh is complete: nobody else may connect */
    sg_sock_close(c->listen_fd);
    c->listen_fd = -1;
  }
  pthread_mutex_lock(&c->mu);
  if (rc == 0) {
    c->thread_started = 1;
    c->state = SG__COMM_ST_READY;
  } else {
    c->state = SG__COMM_ST_FAILED;
    if (!c->err_code) {
      c->err_code = rc;
      snprintf(c->err_msg, sizeof(c->err_msg), "%s",
               err && err->msg[0] ? err->msg : sg_strerror(rc));
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (rc)
    for (int p = 0; p < c->world; p++) {
      sg_sock_close(c->peers[p].fd);
      c->peers[p].fd = -1;
    }
  return rc;
}
