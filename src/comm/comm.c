/*
 * comm.c: the communicator: mesh setup with a checked handshake, one
 * progress thread running queued operations in order, the transfer engine
 * and the collective algorithms on top of it.
 *
 *   setup      sg_comm_new (listen), sg_comm_connect (dial lower ranks,
 *              accept higher ones; bad handshakes are refused)
 *   queue      submit_op / progress_main: FIFO of request objects; the first
 *              failure poisons the communicator and fails what follows
 *   engine     xfer_run: one send stream and one receive stream over
 *              non-blocking sockets and poll(), with an eventfd for abort.
 *              A send segment may be gated on a receive segment (pipelining:
 *              a ring forwards bytes as soon as they are reduced); receive
 *              segments either land in place or go through a small circular
 *              staging buffer and are reduced into their destination.
 *              Peers not in the transfer are watched for a crash.
 *   algorithms ring allreduce / reduce-scatter / allgather, recursive
 *              doubling for small allreduces, direct or chain broadcast,
 *              pairwise alltoall, send/recv, barrier
 *
 * Every transfer on a connection starts with an OP frame carrying the
 * operation kind, a per-direction sequence number and the payload length,
 * so ranks that disagree on the operation fail with a protocol error
 * instead of exchanging garbage.  The design notes are in
 * docs/internals/comm.md.
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
#include <sys/uio.h>
#include <unistd.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"
#include "stepguard/samehost.h"

#define LOG_SUB "comm"
#define STAGE_BYTES (1u << 20)      /* circular staging buffer for reduction */
#define SEND_BUDGET (512u << 10)    /* bytes sent per engine pass */
#define RECV_BUDGET (512u << 10)    /* bytes received per engine pass */
#define DEFAULT_SMALL (64u << 10)   /* latency algorithm up to this size */
#define PAIR_SMALL (1u << 20)       /* the same, for two ranks (see below) */
#define MAX_PENDING 64              /* handshakes in progress at once */
#define HANDSHAKE_MS 10000          /* one handshake's own limit */
#define SLICE_MS 100                /* abort latency bound for blocking steps */
#define MAX_BYTES ((size_t)1 << 46) /* largest operation accepted */
#define GONE_GRACE_MS 50            /* see first_gone */
#define PULL_MIN (256u << 10)       /* same-host path from this size */
#define PULL_BUDGET (2u << 20)      /* bytes read from a peer per pass */
#define DESC_MIN (256u << 10)       /* smallest descriptor but a segment end */
#define LOOP_SNDBUF (256 << 10) /* send buffer between two ends on one host */

enum op_kind {
  OP_ALLREDUCE = 1,
  OP_BROADCAST = 2,
  OP_ALLGATHER = 3,
  OP_REDUCE_SCATTER = 4,
  OP_ALLTOALL = 5,
  OP_SEND = 6,
  OP_RECV = 7,
  OP_BARRIER = 8,
};

static const char *kind_name(int k) {
  static const char *names[] = {"?",         "allreduce",      "broadcast",
                                "allgather", "reduce_scatter", "alltoall",
                                "send",      "recv",           "barrier"};
  return k > 0 && k <= OP_BARRIER ? names[k] : "?";
}

struct op {
  struct op *next;
  int kind;
  sg_deadline_t deadline;
  sg_comm_done_cb cb;
  void *ud;
  uint8_t *buf;      /* allreduce, broadcast, send/recv, reduce_scatter out */
  const uint8_t *in; /* allgather input */
  size_t count;      /* elements (allreduce, reduce_scatter) */
  size_t nbytes;     /* bytes (broadcast, allgather, send/recv) */
  sg_comm_dtype_t dtype;
  sg_comm_redop_t redop;
  int peer;            /* root, dst or src */
  uint8_t **outs;      /* world pointers, owned (allgather, alltoall) */
  const uint8_t **ins; /* world pointers, owned (reduce_scatter, alltoall) */
  size_t *in_bytes, *out_bytes; /* world sizes, owned (alltoall) */
};

struct peer {
  int fd;
  int unwatched;    /* crash watch off: seen gone, said BYE or has data */
  uint64_t gone_at; /* order in which it was seen gone; 0 = not seen */
  uint64_t tx_seq;  /* transfers sent on this connection */
  uint64_t rx_seq;  /* transfers received on this connection */
  int pull_from;    /* we read this peer's memory (same host, probed) */
  int pull_to;      /* this peer reads ours */
  uint32_t pid;     /* the peer's pid (pull_from) */
};

enum state { ST_NEW, ST_CONNECTING, ST_READY, ST_FAILED };

struct sg_comm_s {
  int rank, world;
  uint64_t generation;
  char *job, *token;
  size_t small_max;
  int same_host;   /* opts.same_host */
  size_t pull_min; /* same-host path for transfers of at least this */
  uint8_t probe[SG__COMM_PROBE_LEN]; /* what peers read to prove the path */
  int listen_fd, port;
  int wake_fd; /* eventfd: readable once aborted or closing */
  struct peer *peers;

  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct op *head, *tail; /* queue (mu) */
  enum state state;       /* (mu) */
  int closing;            /* sg_comm_free started (mu) */
  int running;            /* an operation is on the progress thread (mu) */
  int err_code;           /* sticky error (mu) */
  char err_msg[256];      /* (mu) */
  atomic_int aborted;
  atomic_int stop; /* abort or close: running work ends now */
  pthread_t thread;
  int thread_started;
  uint64_t gone_count; /* progress thread: peers seen gone so far */
  int clean;           /* progress thread ended with no error: BYE on close */
  unsigned fork_gen;   /* sg_sock_fork_count() at creation */

  uint8_t *stage; /* progress thread only */
  size_t stage_cap;
};

/* ---- small helpers ----------------------------------------------------------
 */

static void wake(sg_comm_t *c) {
  uint64_t one = 1;
  ssize_t n = write(c->wake_fd, &one, sizeof(one));
  (void)n; /* a full counter is still readable: the wakeup is not lost */
}

/* set_error: record the first error; later ones keep the first. */
static void set_error(sg_comm_t *c, int code, const char *msg) {
  pthread_mutex_lock(&c->mu);
  if (!c->err_code) {
    c->err_code = code;
    snprintf(c->err_msg, sizeof(c->err_msg), "%s", msg);
  }
  pthread_mutex_unlock(&c->mu);
}

static int stop_code(sg_comm_t *c) {
  return atomic_load(&c->aborted) ? SG_EABORTED : SG_ECANCELED;
}

static const char *stop_msg(sg_comm_t *c) {
  return atomic_load(&c->aborted) ? "communicator aborted"
                                  : "communicator closed";
}

/* forked: whether this is a child forked after c was created; its copy of
 * c has no progress thread and its descriptors point to /dev/null. */
static int forked(const sg_comm_t *c) {
  return sg_sock_fork_count() != c->fork_gen;
}

int sg_comm_port(const sg_comm_t *c) { return c->port; }
int sg_comm_rank(const sg_comm_t *c) { return c->rank; }

int sg_comm_same_host(const sg_comm_t *c, int peer) {
  return c && peer >= 0 && peer < c->world && c->peers[peer].fd >= 0 &&
         c->peers[peer].pull_from;
}
int sg_comm_size(const sg_comm_t *c) { return c->world; }

int sg_comm_error(sg_comm_t *c, sg_err_t *err) {
  pthread_mutex_lock(&c->mu);
  int code = c->err_code;
  if (code)
    sg_err_set(err, code, "%s", c->err_msg);
  pthread_mutex_unlock(&c->mu);
  return code;
}

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
  /* Two ranks: recursive doubling is one exchange, moving the same bytes
   * each way as the ring's two steps but without the second step waiting
   * on the first one's reduction; it needs the whole message in staging,
   * hence the staging buffer's size as its limit. */
  c->small_max = o->small_max         ? o->small_max
                 : o->world_size == 2 ? PAIR_SMALL
                                      : DEFAULT_SMALL;
  c->same_host = o->same_host;
  c->pull_min = o->pull_min ? o->pull_min : PULL_MIN;
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
  c->stage = sg_malloc(c->stage_cap);
  if (!c->job || !c->token || !c->peers || !c->stage) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (int i = 0; i < c->world; i++)
    c->peers[i].fd = -1;
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
  if (c) {
    sg_sock_close(c->wake_fd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    sg_free(c->job);
    sg_free(c->token);
    sg_free(c->peers);
    sg_free(c->stage);
    sg_free(c);
  }
  return rc;
}

/* wait_fd: poll one fd (and the wake fd) for `events` until `deadline`.
 * 0 when ready, SG_ETIMEDOUT, or the stop code. */
static int wait_fd(sg_comm_t *c, int fd, short events, sg_deadline_t deadline) {
  for (;;) {
    if (atomic_load(&c->stop))
      return stop_code(c);
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
  if (sg__comm_parse_addr(addr, host, sizeof(host), &port))
    return sg_err_set(err, SG_EINVAL, "rank %d: bad address \"%s\"", p,
                      addr ? addr : "(null)");
  for (;;) {
    if (atomic_load(&c->stop)) {
      rc = sg_err_set(err, stop_code(c), "%s", stop_msg(c));
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
      rc = sg_err_set(err, stop_code(c), "%s", stop_msg(c));
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

static void *progress_main(void *arg);

int sg_comm_connect(sg_comm_t *c, const char *const *addrs,
                    sg_deadline_t deadline, sg_err_t *err) {
  int rc = 0;
  pthread_mutex_lock(&c->mu);
  if (c->state != ST_NEW || c->closing)
    rc = sg_err_set(err, SG_ESTATE, "sg_comm_connect called twice");
  else
    c->state = ST_CONNECTING;
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
  if (rc == 0 && pthread_create(&c->thread, NULL, progress_main, c) != 0)
    rc = sg_err_set(err, SG_ENOMEM, "cannot start the progress thread");
out:
  if (rc == 0) { /* the mesh is complete: nobody else may connect */
    sg_sock_close(c->listen_fd);
    c->listen_fd = -1;
  }
  pthread_mutex_lock(&c->mu);
  if (rc == 0) {
    c->thread_started = 1;
    c->state = ST_READY;
  } else {
    c->state = ST_FAILED;
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

/* ---- the transfer engine
 * ------------------------------------------------------
 */

struct seg {
  uint8_t *p;         /* where bytes are read from (send) or land (recv) */
  size_t len;         /* bytes */
  const uint8_t *src; /* reduce segments: the local operand */
};

struct xfer {
  sg_comm_t *c;
  struct op *op;
  int send_peer, recv_peer; /* -1 when that side is idle */
  struct seg *ss, *rs;
  int ns, nr;
  int nreduce; /* receive segments [0, nreduce) are reduced */
  int link;    /* send seg j waits for receive seg j - link; -1 never */
  size_t esize;
  int spull; /* send_peer reads the payload: send DESC frames, await ACK */
  int rpull; /* read recv_peer's payload as its DESC frames say, then ACK */
  /* progress */
  uint8_t shdr[SG__COMM_FRAME_LEN], rhdr[SG__COMM_FRAME_LEN];
  size_t shdr_off, rhdr_off;
  uint8_t sdesc[SG__COMM_FRAME_LEN], rdesc[SG__COMM_FRAME_LEN];
  size_t sdesc_off; /* SG__COMM_FRAME_LEN: no DESC going out */
  size_t rdesc_off; /* bytes of the next incoming DESC */
  uint64_t raddr;   /* the current incoming DESC: where its rest is */
  size_t rleft;     /* and how many bytes are left of it */
  uint8_t ack_out[SG__COMM_FRAME_LEN], ack_in[SG__COMM_FRAME_LEN];
  size_t ack_out_off, ack_in_off; /* SG__COMM_FRAME_LEN: done or none */
  int sk, rk;
  size_t soff, roff, rdone;
  uint64_t stotal, rtotal, sent, rcvd;
  char *msg; /* error detail, 256 bytes */
};

static int fail(struct xfer *x, int code, const char *fmt, ...) SG_PRINTF(3, 4);

static int fail(struct xfer *x, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(x->msg, 256, fmt, ap);
  va_end(ap);
  return code;
}

/* peer_gone: called when poll() showed a hangup on rank p's connection:
 * whether it is a crash (an error, EOF with nothing queued, or EOF after
 * bytes that are not a BYE: a peer killed in the middle of sending to us),
 * and record the order in which peers were seen gone; a BYE first turns
 * the watch off (a clean close; the next transfer will tell).  Never
 * blocks. */
static int peer_gone(sg_comm_t *c, int p) {
  struct peer *pe = &c->peers[p];
  uint8_t b[SG__COMM_FRAME_LEN];
  int soerr = 0, gone = 0;
  socklen_t sl = sizeof(soerr);
  if (getsockopt(pe->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr) {
    gone = 1;
  } else {
    ssize_t n = recv(pe->fd, b, sizeof(b), MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
      return 0;
    gone = n < 4 || memcmp(b, "SGBY", 4) != 0; /* n < 0: an error */
  }
  pe->unwatched = 1;
  if (gone && !pe->gone_at)
    pe->gone_at = ++c->gone_count;
  return gone;
}

/* first_gone: the peer other than `except` seen gone first, or -1.  Peers
 * not yet seen gone are probed, for up to GONE_GRACE_MS when none is: a
 * peer that closed because it saw a crash may be heard before the crash
 * itself.  Only failure paths call this. */
static int first_gone(sg_comm_t *c, int except) {
  struct pollfd *pf = sg_calloc((size_t)c->world, sizeof(*pf));
  sg_deadline_t grace = sg_deadline_in_ms(GONE_GRACE_MS);
  int best = -1;
  for (;;) {
    int np = 0;
    for (int p = 0; p < c->world; p++) {
      if (p == c->rank || p == except || c->peers[p].fd < 0 ||
          c->peers[p].gone_at)
        continue;
      struct pollfd one = {.fd = c->peers[p].fd, .events = POLLRDHUP};
      if (poll(&one, 1, 0) == 1)
        peer_gone(c, p);
      else if (pf)
        pf[np++] = one;
    }
    for (int p = 0; p < c->world; p++)
      if (p != except && c->peers[p].gone_at &&
          (best < 0 || c->peers[p].gone_at < c->peers[best].gone_at))
        best = p;
    if (best >= 0 || np == 0 || sg_deadline_passed(grace) ||
        atomic_load(&c->stop))
      break;
    if (poll(pf, (nfds_t)np, (int)sg_deadline_left_ms(grace)) <= 0)
      break;
  }
  sg_free(pf);
  return best;
}

/* eof_fail: a peer this transfer needs closed or reset.  A peer seen gone
 * before is named too: the first one to go is the likely cause. */
static int eof_fail_what(struct xfer *x, int p, const char *what) {
  int q = first_gone(x->c, p);
  if (!x->c->peers[p].gone_at)
    x->c->peers[p].gone_at = ++x->c->gone_count;
  if (q >= 0 && x->c->peers[q].gone_at < x->c->peers[p].gone_at)
    return fail(x, SG_EPEER, "%s: rank %d failed: %s (rank %d was gone first)",
                kind_name(x->op->kind), p, what, q);
  return fail(x, SG_EPEER, "%s: rank %d failed: %s", kind_name(x->op->kind), p,
              what);
}

static int eof_fail(struct xfer *x, int p, int code) {
  return eof_fail_what(
      x, p, code == SG_EPEER ? "connection closed" : sg_strerror(code));
}

/* send_allowed: bytes of send segment j that may go now. */
static size_t send_allowed(const struct xfer *x, int j) {
  if (x->link < 0 || j - x->link < 0)
    return x->ss[j].len;
  int g = j - x->link;
  if (g < x->rk)
    return x->ss[j].len;
  if (g > x->rk)
    return 0;
  return x->rdone < x->ss[j].len ? x->rdone : x->ss[j].len;
}

/* next_desc: describe the payload bytes that may go now in a DESC frame
 * (DESC_MIN of them at least, or up to a segment's end); 1 when one was
 * made. */
static int next_desc(struct xfer *x) {
  while (x->sk < x->ns && x->soff == x->ss[x->sk].len) {
    x->sk++;
    x->soff = 0;
  }
  if (x->sk == x->ns)
    return 0;
  size_t allowed = send_allowed(x, x->sk), seg = x->ss[x->sk].len;
  if (allowed <= x->soff || (allowed - x->soff < DESC_MIN && allowed < seg))
    return 0;
  sg__comm_frame_t f = {.type = SG__COMM_FRAME_DESC,
                        .seq = (uint64_t)(uintptr_t)(x->ss[x->sk].p + x->soff),
                        .bytes = allowed - x->soff};
  sg__comm_frame_encode(x->sdesc, &f);
  x->sdesc_off = 0;
  x->sent += allowed - x->soff;
  x->soff = allowed;
  return 1;
}

/* send_iov: one non-blocking sendmsg of `iov` (the OP header first when it
 * is still owed).  Returns 1 with *body = the bytes sent past the header,
 * 0 with *blocked set when the socket is full, or the peer's failure. */
static int send_iov(struct xfer *x, int fd, struct iovec *iov, int niov,
                    int *blocked, int *moved, size_t *body) {
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
  ssize_t w;
  do
    w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  while (w < 0 && errno == EINTR);
  if (w < 0) {
    if (errno == EAGAIN) {
      *blocked = 1;
      return 0;
    }
    return eof_fail(x, x->send_peer, -errno);
  }
  *moved = 1;
  size_t n = (size_t)w;
  if (x->shdr_off < SG__COMM_FRAME_LEN) {
    size_t h = SG__COMM_FRAME_LEN - x->shdr_off;
    h = h < n ? h : n;
    x->shdr_off += h;
    n -= h;
  }
  *body = n;
  return 1;
}

/* do_send_pull: the same-host form of do_send: the OP header, then a DESC
 * frame for each range that may go; the receiver copies the bytes. */
static int do_send_pull(struct xfer *x, int *blocked, int *moved) {
  int fd = x->c->peers[x->send_peer].fd;
  for (;;) {
    struct iovec iov[2];
    int niov = 0;
    if (x->sdesc_off == SG__COMM_FRAME_LEN)
      next_desc(x);
    if (x->shdr_off < SG__COMM_FRAME_LEN) {
      iov[niov].iov_base = x->shdr + x->shdr_off;
      iov[niov++].iov_len = SG__COMM_FRAME_LEN - x->shdr_off;
    }
    if (x->sdesc_off < SG__COMM_FRAME_LEN) {
      iov[niov].iov_base = x->sdesc + x->sdesc_off;
      iov[niov++].iov_len = SG__COMM_FRAME_LEN - x->sdesc_off;
    }
    if (niov == 0)
      return 0; /* done, or waiting for received bytes */
    size_t n;
    int rc = send_iov(x, fd, iov, niov, blocked, moved, &n);
    if (rc <= 0)
      return rc;
    x->sdesc_off += n;
  }
}

/* do_send: write as much as is allowed; sets *blocked when the socket is
 * full (wait for POLLOUT) and *moved when bytes went out. */
static int do_send(struct xfer *x, int *blocked, int *moved) {
  int fd = x->c->peers[x->send_peer].fd;
  size_t budget = SEND_BUDGET;
  *blocked = 0;
  if (x->spull)
    return do_send_pull(x, blocked, moved);
  while (budget) {
    struct iovec iov[2];
    int niov = 0;
    if (x->shdr_off < SG__COMM_FRAME_LEN) {
      iov[niov].iov_base = x->shdr + x->shdr_off;
      iov[niov++].iov_len = SG__COMM_FRAME_LEN - x->shdr_off;
    }
    while (x->sk < x->ns && x->soff == x->ss[x->sk].len) {
      x->sk++;
      x->soff = 0;
    }
    if (x->sk < x->ns) {
      size_t allowed = send_allowed(x, x->sk);
      if (allowed > x->soff) {
        size_t len = allowed - x->soff;
        iov[niov].iov_base = x->ss[x->sk].p + x->soff;
        iov[niov++].iov_len = len < budget ? len : budget;
      }
    }
    if (niov == 0)
      return 0; /* done, or waiting for received bytes */
    size_t n;
    int rc = send_iov(x, fd, iov, niov, blocked, moved, &n);
    if (rc <= 0)
      return rc;
    x->soff += n;
    x->sent += n;
    budget = budget > n ? budget - n : 0;
  }
  return 0;
}

/* reduce_ready: reduce the whole elements received but not yet reduced.
 * For AVG the last reducing step completes its chunk: each piece is
 * divided right after its sum, while it is in cache, instead of in a pass
 * over the whole result afterwards (the same operations, the same bits);
 * the ring then forwards the chunk already divided. */
static void reduce_ready(struct xfer *x) {
  struct seg *s = &x->rs[x->rk];
  size_t S = x->c->stage_cap;
  int avg = x->op->redop == SG_COMM_AVG && x->rk == x->nreduce - 1;
  for (;;) {
    size_t avail = x->roff - x->rdone;
    avail -= avail % x->esize;
    if (avail == 0)
      return;
    size_t pos = x->rdone % S;
    size_t n = avail < S - pos ? avail : S - pos;
    sg__comm_reduce(x->op->dtype, x->op->redop, s->p + x->rdone,
                    x->c->stage + pos, s->src + x->rdone, n / x->esize);
    if (avg)
      sg__comm_scale_avg(x->op->dtype, s->p + x->rdone, n / x->esize,
                         x->c->world);
    x->rdone += n;
  }
}

static int check_header(struct xfer *x) {
  sg__comm_frame_t f;
  int p = x->recv_peer;
  int expect = x->op->kind == OP_RECV ? OP_SEND : x->op->kind;
  if (sg__comm_frame_parse(x->rhdr, SG__COMM_FRAME_LEN, &f))
    return fail(x, SG_EPROTO, "%s: rank %d sent a malformed frame",
                kind_name(x->op->kind), p);
  if (f.type == SG__COMM_FRAME_BYE)
    return fail(x, SG_EPEER, "%s: rank %d closed its communicator",
                kind_name(x->op->kind), p);
  if (f.type != SG__COMM_FRAME_OP)
    return fail(x, SG_EPROTO, "%s: rank %d sent a frame out of place",
                kind_name(x->op->kind), p);
  if (f.kind == expect && f.seq == x->c->peers[p].rx_seq &&
      f.bytes == x->rtotal && f.flags != (x->rpull ? SG__COMM_OP_PULL : 0))
    return fail(x, SG_EPROTO,
                "%s: rank %d disagrees on the same-host path (flags %u)",
                kind_name(x->op->kind), p, (unsigned)f.flags);
  if (f.kind != expect || f.seq != x->c->peers[p].rx_seq ||
      f.bytes != x->rtotal)
    return fail(x, SG_EPROTO,
                "%s: rank %d is in another operation (%s #%llu, %llu bytes; "
                "expected %s #%llu, %llu bytes)",
                kind_name(x->op->kind), p, kind_name(f.kind),
                (unsigned long long)f.seq, (unsigned long long)f.bytes,
                kind_name(expect), (unsigned long long)x->c->peers[p].rx_seq,
                (unsigned long long)x->rtotal);
  return 0;
}

/* take_desc: accept the DESC frame just read: what it describes must fit
 * in what is left of the payload. */
static int take_desc(struct xfer *x) {
  sg__comm_frame_t f;
  if (sg__comm_frame_parse(x->rdesc, SG__COMM_FRAME_LEN, &f) ||
      f.type != SG__COMM_FRAME_DESC || f.bytes > x->rtotal - x->rcvd)
    return fail(x, SG_EPROTO, "%s: rank %d sent a bad descriptor",
                kind_name(x->op->kind), x->recv_peer);
  x->raddr = f.seq;
  x->rleft = (size_t)f.bytes;
  x->rdesc_off = 0;
  return 0;
}

/* pull: where do_recv would recv() from the socket, read up to `room`
 * payload bytes out of the peer's memory instead, after reading the DESC
 * frame that says where they are.  Returns bytes landed (0: none yet) or a
 * negative code; *again is set when the socket has nothing for now. */
static ssize_t pull(struct xfer *x, int fd, uint8_t *dst, size_t room,
                    int *again) {
  if (x->rleft == 0) {
    ssize_t m = recv(fd, x->rdesc + x->rdesc_off,
                     SG__COMM_FRAME_LEN - x->rdesc_off, MSG_DONTWAIT);
    if (m < 0 && (errno == EAGAIN || errno == EINTR)) {
      *again = errno == EAGAIN;
      return 0;
    }
    if (m <= 0)
      return eof_fail(x, x->recv_peer, m == 0 ? SG_EPEER : -errno);
    x->rdesc_off += (size_t)m;
    if (x->rdesc_off == SG__COMM_FRAME_LEN) {
      int rc = take_desc(x);
      if (rc)
        return rc;
    }
    return 0;
  }
  if (room > x->rleft)
    room = x->rleft;
  int rc = sg_samehost_read(x->c->peers[x->recv_peer].pid, dst, x->raddr, room);
  if (rc) { /* most likely gone (ESRCH), or a peer that lied (EFAULT) */
    char what[96];
    snprintf(what, sizeof(what), "cannot read its memory: %s",
             rc > -10000 ? strerror(-rc) : sg_strerror(rc));
    return eof_fail_what(x, x->recv_peer, what);
  }
  /* The pid could belong to another process by now if the peer died and
   * its pid was reused: then these bytes are not the peer's.  A dying
   * process closes its sockets (do_exit) before its pid can be reaped and
   * reused, and nobody else holds them (CLOEXEC, the fork rule), so while
   * our connection to it shows no hangup after the read, the peer was
   * alive through the whole read and the bytes are its own. */
  struct pollfd hup = {.fd = fd, .events = POLLRDHUP};
  if (poll(&hup, 1, 0) != 0 &&
      (hup.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)))
    return eof_fail_what(x, x->recv_peer,
                         "its connection closed while its memory was read");
  x->raddr += room;
  x->rleft -= room;
  return (ssize_t)room;
}

/* do_recv: read what is there into place or staging, reducing as it
 * arrives. */
static int do_recv(struct xfer *x, int *moved) {
  int fd = x->c->peers[x->recv_peer].fd;
  size_t budget = x->rpull ? PULL_BUDGET : RECV_BUDGET, S = x->c->stage_cap;
  while (budget) {
    uint8_t *dst;
    size_t room;
    if (x->rhdr_off < SG__COMM_FRAME_LEN) {
      dst = x->rhdr + x->rhdr_off;
      room = SG__COMM_FRAME_LEN - x->rhdr_off;
    } else {
      while (x->rk < x->nr && x->rdone == x->rs[x->rk].len) {
        x->rk++;
        x->roff = x->rdone = 0;
      }
      if (x->rk == x->nr)
        return 0;
      struct seg *s = &x->rs[x->rk];
      if (x->rk < x->nreduce) {
        size_t pos = x->roff % S, inflight = x->roff - x->rdone;
        room = S - pos;
        if (room > S - inflight)
          room = S - inflight;
        if (room > s->len - x->roff)
          room = s->len - x->roff;
        dst = x->c->stage + pos;
        if (room == 0) { /* staging full of partial elements: reduce */
          reduce_ready(x);
          continue;
        }
      } else {
        dst = s->p + x->roff;
        room = s->len - x->roff;
      }
    }
    if (room > budget)
      room = budget;
    if (x->rpull && x->rhdr_off == SG__COMM_FRAME_LEN) {
      int again = 0;
      ssize_t got = pull(x, fd, dst, room, &again);
      if (got < 0)
        return (int)got;
      if (again)
        break;
      *moved = 1;
      if (got == 0)
        continue; /* a DESC frame, or part of one */
      size_t n = (size_t)got;
      budget -= n;
      x->roff += n;
      x->rcvd += n;
      if (x->rk < x->nreduce)
        reduce_ready(x); /* at once: the sender waits for these bytes */
      else
        x->rdone = x->roff;
      continue;
    }
    ssize_t m = recv(fd, dst, room, MSG_DONTWAIT);
    if (m < 0 && errno == EINTR)
      continue;
    if (m < 0 && errno == EAGAIN)
      break;
    if (m <= 0)
      return eof_fail(x, x->recv_peer, m == 0 ? SG_EPEER : -errno);
    *moved = 1;
    size_t n = (size_t)m;
    budget -= n;
    if (x->rhdr_off < SG__COMM_FRAME_LEN) {
      x->rhdr_off += n;
      if (x->rhdr_off == SG__COMM_FRAME_LEN) {
        int rc = check_header(x);
        if (rc)
          return rc;
      }
      continue;
    }
    x->roff += n;
    x->rcvd += n;
    if (x->rk < x->nreduce) {
      if (x->roff == x->rs[x->rk].len || x->roff - x->rdone >= S / 4)
        reduce_ready(x);
    } else {
      x->rdone = x->roff;
    }
  }
  if (x->rk < x->nr && x->rk < x->nreduce)
    reduce_ready(x); /* the socket is drained: let the sender go on */
  return 0;
}

static int send_done(const struct xfer *x) {
  if (x->send_peer < 0)
    return 1;
  if (x->shdr_off < SG__COMM_FRAME_LEN || x->sdesc_off < SG__COMM_FRAME_LEN)
    return 0;
  for (int j = x->sk; j < x->ns; j++)
    if ((j == x->sk ? x->soff : 0) < x->ss[j].len)
      return 0;
  return 1;
}

static int recv_done(const struct xfer *x) {
  if (x->recv_peer < 0)
    return 1;
  if (x->rhdr_off < SG__COMM_FRAME_LEN)
    return 0;
  for (int j = x->rk; j < x->nr; j++)
    if ((j == x->rk ? x->rdone : 0) < x->rs[j].len)
      return 0;
  return 1;
}

/* earliest_deadline: the op's, or a queued op's if that is sooner. */
static sg_deadline_t earliest_deadline(sg_comm_t *c, sg_deadline_t d) {
  pthread_mutex_lock(&c->mu);
  for (struct op *o = c->head; o; o = o->next)
    if (o->deadline < d)
      d = o->deadline;
  pthread_mutex_unlock(&c->mu);
  return d;
}

/* check_ack: the ACK that ends a DESC payload must be for this transfer. */
static int check_ack(struct xfer *x) {
  sg__comm_frame_t f;
  int p = x->send_peer;
  int kind = x->op->kind == OP_RECV ? OP_SEND : x->op->kind;
  if (sg__comm_frame_parse(x->ack_in, SG__COMM_FRAME_LEN, &f) ||
      f.type != SG__COMM_FRAME_ACK || f.kind != kind ||
      f.seq != x->c->peers[p].tx_seq || f.bytes != x->stotal)
    return fail(x, SG_EPROTO, "%s: rank %d sent a bad acknowledgement",
                kind_name(x->op->kind), p);
  return 0;
}

/*
 * do_acks: a DESC payload ends with an ACK from its receiver, sent once it
 * has read every byte (and after its own payload when the two ranks send
 * to each other, so each direction stays in order); the sender waits for
 * it before its buffers go back to the caller.  Sets *out_blocked when the
 * ACK waits for room in the socket, *in_wait when it waits for the ACK.
 */
static int do_acks(struct xfer *x, int sdone, int rdone, int *moved,
                   int *out_blocked, int *in_wait) {
  sg_comm_t *c = x->c;
  *out_blocked = *in_wait = 0;
  while (x->ack_out_off < SG__COMM_FRAME_LEN && rdone &&
         (x->recv_peer != x->send_peer || sdone)) {
    ssize_t w =
        send(c->peers[x->recv_peer].fd, x->ack_out + x->ack_out_off,
             SG__COMM_FRAME_LEN - x->ack_out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN) {
      *out_blocked = 1;
      break;
    }
    if (w < 0)
      return eof_fail(x, x->recv_peer, -errno);
    x->ack_out_off += (size_t)w;
    *moved = 1;
  }
  while (x->ack_in_off < SG__COMM_FRAME_LEN && sdone &&
         (x->send_peer != x->recv_peer || rdone)) {
    ssize_t m = recv(c->peers[x->send_peer].fd, x->ack_in + x->ack_in_off,
                     SG__COMM_FRAME_LEN - x->ack_in_off, MSG_DONTWAIT);
    if (m < 0 && errno == EINTR)
      continue;
    if (m < 0 && errno == EAGAIN) {
      *in_wait = 1;
      break;
    }
    if (m <= 0)
      return eof_fail(x, x->send_peer, m == 0 ? SG_EPEER : -errno);
    x->ack_in_off += (size_t)m;
    *moved = 1;
    if (x->ack_in_off == SG__COMM_FRAME_LEN)
      return check_ack(x);
  }
  return 0;
}

/* xfer_run: run one transfer to completion, failure, deadline or stop. */
static int xfer_run(struct xfer *x) {
  sg_comm_t *c = x->c;
  struct pollfd *pfd = NULL;
  int *who = NULL, rc = 0;
  uint64_t s_total = 0, r_total = 0;
  for (int j = 0; j < x->ns; j++)
    s_total += x->ss[j].len;
  for (int j = 0; j < x->nr; j++)
    r_total += x->rs[j].len;
  x->stotal = s_total;
  x->rtotal = r_total;
  /* the same-host path, where both ends can tell that the other takes it:
   * the size is checked against the OP header, the kinds agree but for
   * send/recv, which keep TCP (a send completes without its receiver) */
  int pk = x->op->kind != OP_SEND && x->op->kind != OP_RECV;
  x->spull = pk && x->send_peer >= 0 && c->peers[x->send_peer].pull_to &&
             s_total >= c->pull_min;
  x->rpull = pk && x->recv_peer >= 0 && c->peers[x->recv_peer].pull_from &&
             r_total >= c->pull_min;
  x->sdesc_off = SG__COMM_FRAME_LEN;
  x->ack_in_off = x->spull ? 0 : SG__COMM_FRAME_LEN;
  x->ack_out_off = SG__COMM_FRAME_LEN;
  if (x->rpull) {
    sg__comm_frame_t f = {
        .type = SG__COMM_FRAME_ACK,
        .kind = (uint16_t)(x->op->kind == OP_RECV ? OP_SEND : x->op->kind),
        .seq = c->peers[x->recv_peer].rx_seq,
        .bytes = r_total};
    sg__comm_frame_encode(x->ack_out, &f);
    x->ack_out_off = 0;
  }
  if (x->send_peer >= 0) {
    sg__comm_frame_t f = {
        .type = SG__COMM_FRAME_OP,
        .kind = (uint16_t)(x->op->kind == OP_RECV ? OP_SEND : x->op->kind),
        .flags = x->spull ? SG__COMM_OP_PULL : 0,
        .seq = c->peers[x->send_peer].tx_seq,
        .bytes = s_total};
    sg__comm_frame_encode(x->shdr, &f);
  } else {
    x->shdr_off = SG__COMM_FRAME_LEN;
  }
  if (x->recv_peer < 0)
    x->rhdr_off = SG__COMM_FRAME_LEN;
  pfd = sg_calloc((size_t)c->world + 1, sizeof(*pfd));
  who = sg_calloc((size_t)c->world + 1, sizeof(*who));
  if (!pfd || !who) {
    rc = fail(x, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (;;) {
    if (atomic_load(&c->stop)) {
      rc = fail(x, stop_code(c), "%s: %s", kind_name(x->op->kind), stop_msg(c));
      goto out;
    }
    int moved = 0, blocked = 0;
    if (!send_done(x)) {
      rc = do_send(x, &blocked, &moved);
      if (rc)
        goto out;
    }
    if (!recv_done(x)) {
      rc = do_recv(x, &moved);
      if (rc)
        goto out;
    }
    int sdone = send_done(x), rdone = recv_done(x);
    int ack_blocked = 0, ack_wait = 0;
    rc = do_acks(x, sdone, rdone, &moved, &ack_blocked, &ack_wait);
    if (rc)
      goto out;
    if (sdone && rdone && x->ack_out_off == SG__COMM_FRAME_LEN &&
        x->ack_in_off == SG__COMM_FRAME_LEN)
      break;
    if (moved)
      continue;
    /* nothing moved: wait for the sockets, the wake fd or the deadline */
    sg_deadline_t d = earliest_deadline(c, x->op->deadline);
    int64_t left = sg_deadline_left_ms(d);
    if (left == 0) {
      if (!rdone)
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out waiting for rank %d (received %llu of %llu "
                  "bytes)",
                  kind_name(x->op->kind), x->recv_peer,
                  (unsigned long long)x->rcvd, (unsigned long long)r_total);
      else if (sdone && ack_wait)
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out waiting for rank %d to read what it was "
                  "sent",
                  kind_name(x->op->kind), x->send_peer);
      else if (sdone)
        rc = fail(x, SG_ETIMEDOUT, "%s: timed out sending to rank %d",
                  kind_name(x->op->kind), x->recv_peer);
      else
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out sending to rank %d (sent %llu of %llu "
                  "bytes)",
                  kind_name(x->op->kind), x->send_peer,
                  (unsigned long long)x->sent, (unsigned long long)s_total);
      if (d < x->op->deadline)
        snprintf(x->msg, 256,
                 "a queued operation's deadline passed while %s ran",
                 kind_name(x->op->kind));
      goto out;
    }
    int np = 0;
    pfd[np] = (struct pollfd){.fd = c->wake_fd, .events = POLLIN};
    who[np++] = -1;
    for (int p = 0; p < c->world; p++) {
      if (p == c->rank || c->peers[p].fd < 0)
        continue;
      short ev = 0;
      if ((p == x->recv_peer && !rdone) || (p == x->send_peer && ack_wait))
        ev |= POLLIN;
      else if (!c->peers[p].unwatched)
        ev |= POLLRDHUP;
      if ((p == x->send_peer && !sdone && blocked) ||
          (p == x->recv_peer && ack_blocked))
        ev |= POLLOUT;
      if (!ev)
        continue;
      pfd[np] = (struct pollfd){.fd = c->peers[p].fd, .events = ev};
      who[np++] = p;
    }
    int n = poll(pfd, (nfds_t)np, left > 1000 ? 1000 : (int)left);
    if (n < 0 && errno != EINTR) {
      rc = fail(x, -errno, "poll: %s", strerror(errno));
      goto out;
    }
    /* a watched peer that closed is only recorded: this transfer goes on
     * while its own peers deliver, and fails when one of them does */
    for (int i = 1; n > 0 && i < np; i++)
      if (who[i] != x->recv_peer &&
          (pfd[i].revents & (POLLRDHUP | POLLHUP | POLLERR)))
        peer_gone(c, who[i]);
  }
  if (x->send_peer >= 0)
    c->peers[x->send_peer].tx_seq++;
  if (x->recv_peer >= 0)
    c->peers[x->recv_peer].rx_seq++;
out:
  sg_free(pfd);
  sg_free(who);
  return rc;
}

/* exchange: send one buffer to `sp` while receiving one from `rp` (either
 * may be -1; they may be the same rank). */
static int exchange(sg_comm_t *c, struct op *op, int sp, const void *sbuf,
                    size_t slen, int rp, void *rbuf, size_t rlen, char *msg) {
  struct seg ss = {.p = (uint8_t *)sbuf, .len = slen};
  struct seg rs = {.p = rbuf, .len = rlen};
  struct xfer x = {.c = c,
                   .op = op,
                   .send_peer = sp,
                   .recv_peer = rp,
                   .ss = &ss,
                   .rs = &rs,
                   .ns = sp >= 0,
                   .nr = rp >= 0,
                   .link = -1,
                   .esize = 1,
                   .msg = msg};
  return xfer_run(&x);
}

/* ---- algorithms
 * ---------------------------------------------------------------
 */

/* allreduce_rd: recursive doubling, for small buffers.  Partners combine
 * op(lower rank's data, higher rank's data), so both get the same bits. */
static int allreduce_rd(sg_comm_t *c, struct op *op, uint8_t *buf, size_t count,
                        char *msg) {
  int n = c->world, r = c->rank, p2 = sg__comm_pow2_floor(n), rc = 0;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = count * es;
  uint8_t *tmp = c->stage;
  if (r >= p2) { /* extra: fold into r - p2, get the result back */
    rc = exchange(c, op, r - p2, buf, bytes, -1, NULL, 0, msg);
    if (rc == 0)
      rc = exchange(c, op, -1, NULL, 0, r - p2, buf, bytes, msg);
    return rc;
  }
  if (r + p2 < n) {
    rc = exchange(c, op, -1, NULL, 0, r + p2, tmp, bytes, msg);
    if (rc)
      return rc;
    sg__comm_reduce(op->dtype, op->redop, buf, buf, tmp, count);
  }
  for (int round = 0; (1 << round) < p2; round++) {
    int q = sg__comm_rd_partner(r, n, round);
    rc = exchange(c, op, q, buf, bytes, q, tmp, bytes, msg);
    if (rc)
      return rc;
    if (r < q)
      sg__comm_reduce(op->dtype, op->redop, buf, buf, tmp, count);
    else
      sg__comm_reduce(op->dtype, op->redop, buf, tmp, buf, count);
  }
  if (op->redop == SG_COMM_AVG)
    sg__comm_scale_avg(op->dtype, buf, count, n);
  if (r + p2 < n)
    rc = exchange(c, op, r + p2, buf, bytes, -1, NULL, 0, msg);
  return rc;
}

/*
 * ring: one pipelined ring pass.  chunk_p[i] / chunk_len[i] give chunk i's
 * destination and length in bytes; src_p[i] the local operand of chunk i
 * (the bytes sent at step 0 and reduced with incoming partials).  Steps
 * [0, nreduce) reduce, the rest copy.
 */
static int ring(sg_comm_t *c, struct op *op, int steps, int nreduce, int shift,
                uint8_t **chunk_p, const uint8_t **src_p,
                const size_t *chunk_len, char *msg) {
  int n = c->world, r = c->rank, rc = 0;
  struct seg *ss = sg_calloc((size_t)steps, sizeof(*ss));
  struct seg *rs = sg_calloc((size_t)steps, sizeof(*rs));
  if (!ss || !rs) {
    rc = fail(&(struct xfer){.msg = msg}, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (int k = 0; k < steps; k++) {
    int sc = sg__comm_ring_send_chunk(r, n, k, shift);
    int rcn = sg__comm_ring_recv_chunk(r, n, k, shift);
    ss[k].p = k == 0 ? (uint8_t *)src_p[sc] : chunk_p[sc];
    ss[k].len = chunk_len[sc];
    rs[k].p = chunk_p[rcn];
    rs[k].len = chunk_len[rcn];
    rs[k].src = src_p[rcn];
  }
  struct xfer x = {
      .c = c,
      .op = op,
      .send_peer = (r + 1) % n,
      .recv_peer = (r + n - 1) % n,
      .ss = ss,
      .rs = rs,
      .ns = steps,
      .nr = steps,
      .nreduce = nreduce,
      .link = 1,
      .esize = op->dtype < SG_COMM_NDTYPES ? sg_comm_dtype_size(op->dtype) : 1,
      .msg = msg};
  rc = xfer_run(&x);
out:
  sg_free(ss);
  sg_free(rs);
  return rc;
}

/* table: world-sized scratch arrays for ring(). */
struct table {
  uint8_t **p;
  const uint8_t **src;
  size_t *len;
};

static int table_new(struct table *t, int n) {
  t->p = sg_calloc((size_t)n, sizeof(*t->p));
  t->src = sg_calloc((size_t)n, sizeof(*t->src));
  t->len = sg_calloc((size_t)n, sizeof(*t->len));
  return t->p && t->src && t->len ? 0 : SG_ENOMEM;
}

static void table_free(struct table *t) {
  sg_free(t->p);
  sg_free(t->src);
  sg_free(t->len);
}

static int run_allreduce(sg_comm_t *c, struct op *op, char *msg) {
  int n = c->world;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = op->count * es;
  if (n == 1)
    return 0;
  if (bytes <= c->small_max || op->count < (size_t)n)
    return allreduce_rd(c, op, op->buf, op->count, msg);
  struct table t;
  int rc = table_new(&t, n);
  if (rc == 0) {
    for (int i = 0; i < n; i++) {
      size_t off, len;
      sg__comm_chunk(op->count, n, i, &off, &len);
      t.p[i] = op->buf + off * es;
      t.src[i] = t.p[i];
      t.len[i] = len * es;
    }
    /* AVG divides as the last reducing step goes (reduce_ready) */
    rc = ring(c, op, 2 * (n - 1), n - 1, 0, t.p, t.src, t.len, msg);
  } else {
    snprintf(msg, 256, "out of memory");
  }
  table_free(&t);
  return rc;
}

static int run_broadcast(sg_comm_t *c, struct op *op, char *msg) {
  int n = c->world, r = c->rank, root = op->peer;
  if (n == 1)
    return 0;
  if (op->nbytes <= c->small_max) { /* root sends to everyone directly */
    if (r != root)
      return exchange(c, op, -1, NULL, 0, root, op->buf, op->nbytes, msg);
    for (int i = 1; i < n; i++) {
      int rc = exchange(c, op, (root + i) % n, op->buf, op->nbytes, -1, NULL, 0,
                        msg);
      if (rc)
        return rc;
    }
    return 0;
  }
  /* chain root -> root+1 -> ...: each rank forwards bytes as they land */
  int pos = (r - root + n) % n;
  struct seg s = {.p = op->buf, .len = op->nbytes};
  struct xfer x = {.c = c,
                   .op = op,
                   .send_peer = pos < n - 1 ? (r + 1) % n : -1,
                   .recv_peer = pos > 0 ? (r + n - 1) % n : -1,
                   .ss = &s,
                   .rs = &s,
                   .ns = pos<n - 1, .nr = pos> 0,
                   .link = pos > 0 ? 0 : -1,
                   .esize = 1,
                   .msg = msg};
  return xfer_run(&x);
}

static int run_allgather(sg_comm_t *c, struct op *op, char *msg) {
  int n = c->world, r = c->rank;
  if (op->outs[r] != op->in && op->nbytes)
    memcpy(op->outs[r], op->in, op->nbytes);
  if (n == 1)
    return 0;
  struct table t;
  int rc = table_new(&t, n);
  if (rc == 0) {
    for (int i = 0; i < n; i++) {
      t.p[i] = op->outs[i];
      t.src[i] = op->outs[i];
      t.len[i] = op->nbytes;
    }
    rc = ring(c, op, n - 1, 0, 0, t.p, t.src, t.len, msg);
  } else {
    snprintf(msg, 256, "out of memory");
  }
  table_free(&t);
  return rc;
}

static int run_reduce_scatter(sg_comm_t *c, struct op *op, char *msg) {
  int n = c->world, r = c->rank;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = op->count * es;
  if (n == 1) {
    if (bytes)
      memcpy(op->buf, op->ins[0], bytes);
    if (op->redop == SG_COMM_AVG)
      sg__comm_scale_avg(op->dtype, op->buf, op->count, n);
    return 0;
  }
  struct table t;
  uint8_t *work = NULL;
  int rc = table_new(&t, n);
  if (rc == 0 && bytes && !(work = sg_malloc(bytes * (size_t)n)))
    rc = SG_ENOMEM;
  if (rc) {
    snprintf(msg, 256, "out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    t.p[i] = i == r ? op->buf : work + (size_t)i * bytes;
    t.src[i] = op->ins[i];
    t.len[i] = bytes;
  }
  /* AVG divides as the last reducing step goes (reduce_ready) */
  rc = ring(c, op, n - 1, n - 1, 1, t.p, t.src, t.len, msg);
out:
  sg_free(work);
  table_free(&t);
  return rc;
}

static int run_alltoall(sg_comm_t *c, struct op *op, char *msg) {
  int n = c->world, r = c->rank;
  if (op->in_bytes[r])
    memcpy(op->outs[r], op->ins[r], op->in_bytes[r]);
  for (int s = 1; s < n; s++) {
    int to = (r + s) % n, from = (r - s + n) % n;
    int rc = exchange(c, op, to, op->ins[to], op->in_bytes[to], from,
                      op->outs[from], op->out_bytes[from], msg);
    if (rc)
      return rc;
  }
  return 0;
}

static int run_op(sg_comm_t *c, struct op *op, char *msg) {
  switch (op->kind) {
  case OP_ALLREDUCE:
    return run_allreduce(c, op, msg);
  case OP_BROADCAST:
    return run_broadcast(c, op, msg);
  case OP_ALLGATHER:
    return run_allgather(c, op, msg);
  case OP_REDUCE_SCATTER:
    return run_reduce_scatter(c, op, msg);
  case OP_ALLTOALL:
    return run_alltoall(c, op, msg);
  case OP_SEND:
    return exchange(c, op, op->peer, op->buf, op->nbytes, -1, NULL, 0, msg);
  case OP_RECV:
    return exchange(c, op, -1, NULL, 0, op->peer, op->buf, op->nbytes, msg);
  case OP_BARRIER: {
    uint8_t one = 1;
    if (c->world == 1)
      return 0;
    struct op tmp = *op;
    tmp.dtype = SG_COMM_U8;
    tmp.redop = SG_COMM_MAX;
    return allreduce_rd(c, &tmp, &one, 1, msg);
  }
  default:
    snprintf(msg, 256, "unknown operation");
    return SG_EINVAL;
  }
}

/* ---- the queue and the progress thread
 * ----------------------------------------
 */

static void op_free(struct op *op) {
  if (!op)
    return;
  sg_free(op->outs);
  sg_free(op->ins);
  sg_free(op->in_bytes);
  sg_free(op->out_bytes);
  sg_free(op);
}

static void finish(struct op *op, int rc, const char *msg) {
  op->cb(op->ud, rc, msg);
  op_free(op);
}

/* shut_all: stop every connection so that peers notice at once. */
static void shut_all(sg_comm_t *c) {
  for (int p = 0; p < c->world; p++)
    if (c->peers[p].fd >= 0)
      shutdown(c->peers[p].fd, SHUT_RDWR);
}

static void *progress_main(void *arg) {
  sg_comm_t *c = arg;
  sg_thread_name("sg-comm");
  char msg[256];
  for (;;) {
    pthread_mutex_lock(&c->mu);
    while (!c->head && !c->closing && !atomic_load(&c->aborted)) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += 1;
      pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    struct op *op = c->head;
    if (op) {
      c->head = op->next;
      if (!c->head)
        c->tail = NULL;
    }
    c->running = op != NULL;
    int code = c->err_code, closing = c->closing;
    snprintf(msg, sizeof(msg), "%s", c->err_msg);
    pthread_mutex_unlock(&c->mu);
    if (!op) {
      if (closing || atomic_load(&c->aborted))
        break;
      continue;
    }
    int rc;
    if (atomic_load(&c->aborted)) {
      rc = SG_EABORTED;
      snprintf(msg, sizeof(msg), "%s: communicator aborted",
               kind_name(op->kind));
    } else if (closing) {
      rc = SG_ECANCELED;
      snprintf(msg, sizeof(msg), "%s: communicator closed",
               kind_name(op->kind));
    } else if (code) {
      rc = code; /* msg holds the first error */
    } else if (sg_deadline_passed(op->deadline)) {
      rc = SG_ETIMEDOUT;
      snprintf(msg, sizeof(msg), "%s: deadline passed before it started",
               kind_name(op->kind));
    } else {
      msg[0] = '\0';
      rc = run_op(c, op, msg);
    }
    if (rc && !code) {
      if (rc != SG_ECANCELED)
        sg_log(SG_LOG_WARN, LOG_SUB, "rank %d: %s", c->rank, msg);
      set_error(c, rc, msg);
      shut_all(c);
    }
    finish(op, rc, rc ? msg : "");
  }
  pthread_mutex_lock(&c->mu);
  c->clean = !c->err_code && !atomic_load(&c->aborted);
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* submit: queue op (owned by the queue from here) or fail without calling
 * its callback. */
static int submit(sg_comm_t *c, struct op *op, sg_err_t *err) {
  int rc = 0;
  if (forked(c)) {
    op_free(op);
    return sg_err_set(err, SG_ESTATE,
                      "communicator belongs to the parent process");
  }
  pthread_mutex_lock(&c->mu);
  if (c->err_code)
    rc = sg_err_set(err, c->err_code, "%s", c->err_msg);
  else if (atomic_load(&c->aborted))
    rc = sg_err_set(err, SG_EABORTED, "communicator aborted");
  else if (c->state != ST_READY || c->closing)
    rc = sg_err_set(err, SG_ESTATE, "communicator not connected");
  if (rc == 0) {
    if (c->tail)
      c->tail->next = op;
    else
      c->head = op;
    c->tail = op;
    pthread_cond_signal(&c->cv);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc)
    op_free(op);
  return rc;
}

static struct op *op_new(int kind, sg_deadline_t deadline, sg_comm_done_cb cb,
                         void *ud) {
  struct op *op = sg_calloc(1, sizeof(*op));
  if (op) {
    op->kind = kind;
    op->deadline = deadline;
    op->cb = cb;
    op->ud = ud;
  }
  return op;
}

static int check_common(sg_comm_t *c, sg_comm_done_cb cb, sg_err_t *err) {
  if (!c || !cb)
    return sg_err_set(err, SG_EINVAL, "communicator and callback required");
  return 0;
}

static int check_reduce(sg_comm_dtype_t dtype, sg_comm_redop_t op, size_t count,
                        int n, sg_err_t *err) {
  if ((unsigned)dtype >= SG_COMM_NDTYPES || (unsigned)op >= SG_COMM_NREDOPS)
    return sg_err_set(err, SG_EINVAL, "unknown dtype %d or op %d", (int)dtype,
                      (int)op);
  if (count > MAX_BYTES / sg_comm_dtype_size(dtype) / (size_t)n)
    return sg_err_set(err, SG_ETOOBIG, "%zu elements is too many", count);
  return 0;
}

int sg_comm_allreduce(sg_comm_t *c, void *buf, size_t count,
                      sg_comm_dtype_t dtype, sg_comm_redop_t redop,
                      sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                      sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc || (rc = check_reduce(dtype, redop, count, 1, err)))
    return rc;
  if (count && !buf)
    return sg_err_set(err, SG_EINVAL, "NULL buffer");
  struct op *op = op_new(OP_ALLREDUCE, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->count = count;
  op->dtype = dtype;
  op->redop = redop;
  return submit(c, op, err);
}

int sg_comm_broadcast(sg_comm_t *c, void *buf, size_t nbytes, int root,
                      sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                      sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (root < 0 || root >= c->world || (nbytes && !buf) || nbytes > MAX_BYTES)
    return sg_err_set(err, SG_EINVAL, "bad root %d or buffer", root);
  struct op *op = op_new(OP_BROADCAST, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->nbytes = nbytes;
  op->peer = root;
  return submit(c, op, err);
}

/* copy_ptrs: a world-sized copy of a pointer array, or NULL. */
static void *copy_ptrs(const void *const *v, int n) {
  void **p = sg_malloc((size_t)n * sizeof(*p));
  if (p)
    for (int i = 0; i < n; i++)
      p[i] = (void *)v[i];
  return p;
}

int sg_comm_allgather(sg_comm_t *c, const void *in, size_t nbytes,
                      void *const *outs, sg_deadline_t deadline,
                      sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (!outs || (nbytes && !in) || nbytes > MAX_BYTES / (size_t)c->world)
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < c->world; i++)
    if (nbytes && !outs[i])
      return sg_err_set(err, SG_EINVAL, "NULL output %d", i);
  struct op *op = op_new(OP_ALLGATHER, deadline, cb, ud);
  if (!op || !(op->outs = copy_ptrs((const void *const *)outs, c->world))) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  op->in = in;
  op->nbytes = nbytes;
  return submit(c, op, err);
}

int sg_comm_reduce_scatter(sg_comm_t *c, const void *const *ins, void *out,
                           size_t count, sg_comm_dtype_t dtype,
                           sg_comm_redop_t redop, sg_deadline_t deadline,
                           sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc || (rc = check_reduce(dtype, redop, count, c->world, err)))
    return rc;
  if (!ins || (count && !out))
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < c->world; i++)
    if (count && !ins[i])
      return sg_err_set(err, SG_EINVAL, "NULL input %d", i);
  struct op *op = op_new(OP_REDUCE_SCATTER, deadline, cb, ud);
  if (!op || !(op->ins = copy_ptrs(ins, c->world))) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  op->buf = out;
  op->count = count;
  op->dtype = dtype;
  op->redop = redop;
  return submit(c, op, err);
}

int sg_comm_alltoall(sg_comm_t *c, const void *const *ins,
                     const size_t *in_bytes, void *const *outs,
                     const size_t *out_bytes, sg_deadline_t deadline,
                     sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err), n;
  if (rc)
    return rc;
  n = c->world;
  if (!ins || !outs || !in_bytes || !out_bytes)
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < n; i++)
    if ((in_bytes[i] && !ins[i]) || (out_bytes[i] && !outs[i]) ||
        in_bytes[i] > MAX_BYTES || out_bytes[i] > MAX_BYTES)
      return sg_err_set(err, SG_EINVAL, "bad buffer %d", i);
  if (in_bytes[c->rank] != out_bytes[c->rank])
    return sg_err_set(err, SG_EINVAL, "own block: %zu bytes in, %zu out",
                      in_bytes[c->rank], out_bytes[c->rank]);
  struct op *op = op_new(OP_ALLTOALL, deadline, cb, ud);
  if (op) {
    op->ins = copy_ptrs(ins, n);
    op->outs = copy_ptrs((const void *const *)outs, n);
    op->in_bytes = sg_malloc((size_t)n * sizeof(size_t));
    op->out_bytes = sg_malloc((size_t)n * sizeof(size_t));
  }
  if (!op || !op->ins || !op->outs || !op->in_bytes || !op->out_bytes) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  memcpy(op->in_bytes, in_bytes, (size_t)n * sizeof(size_t));
  memcpy(op->out_bytes, out_bytes, (size_t)n * sizeof(size_t));
  return submit(c, op, err);
}

static int p2p(sg_comm_t *c, int kind, void *buf, size_t nbytes, int peer,
               sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
               sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (peer < 0 || peer >= c->world || peer == c->rank || (nbytes && !buf) ||
      nbytes > MAX_BYTES)
    return sg_err_set(err, SG_EINVAL, "bad peer %d or buffer", peer);
  struct op *op = op_new(kind, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->nbytes = nbytes;
  op->peer = peer;
  return submit(c, op, err);
}

int sg_comm_send(sg_comm_t *c, const void *buf, size_t nbytes, int dst,
                 sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                 sg_err_t *err) {
  return p2p(c, OP_SEND, (void *)buf, nbytes, dst, deadline, cb, ud, err);
}

int sg_comm_recv(sg_comm_t *c, void *buf, size_t nbytes, int src,
                 sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                 sg_err_t *err) {
  return p2p(c, OP_RECV, buf, nbytes, src, deadline, cb, ud, err);
}

int sg_comm_barrier(sg_comm_t *c, sg_deadline_t deadline, sg_comm_done_cb cb,
                    void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  struct op *op = op_new(OP_BARRIER, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  return submit(c, op, err);
}

/* ---- abort and teardown
 * ---------------------------------------------------------
 */

void sg_comm_abort(sg_comm_t *c) {
  if (!c || forked(c))
    return; /* a forked child's copy has nothing running to abort */
  atomic_store(&c->aborted, 1);
  atomic_store(&c->stop, 1);
  wake(c);
  pthread_mutex_lock(&c->mu);
  if (!c->err_code) {
    c->err_code = SG_EABORTED;
    snprintf(c->err_msg, sizeof(c->err_msg), "communicator aborted");
  }
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* say_bye: end each connection with BYE, best effort, then close. */
static void close_peers(sg_comm_t *c, int bye) {
  for (int p = 0; p < c->world; p++) {
    struct peer *pe = &c->peers[p];
    if (pe->fd < 0)
      continue;
    if (bye) {
      uint8_t b[SG__COMM_FRAME_LEN];
      sg__comm_frame_t f = {.type = SG__COMM_FRAME_BYE, .seq = pe->tx_seq};
      sg__comm_frame_encode(b, &f);
      ssize_t n = send(pe->fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)n;
      shutdown(pe->fd, SHUT_WR);
    }
    sg_sock_close(pe->fd);
    pe->fd = -1;
  }
}

void sg_comm_free(sg_comm_t *c) {
  if (!c || forked(c))
    return; /* a forked child's copy: no thread to join, locks may be held
               by threads that did not survive the fork; leave it */
  pthread_mutex_lock(&c->mu);
  c->closing = 1;
  int started = c->thread_started;
  int busy = c->head != NULL || c->running;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (busy || !started) {
    atomic_store(&c->stop, 1); /* cut what is queued or connecting */
    wake(c);
  }
  if (started)
    pthread_join(c->thread, NULL);
  /* no op was running (the queue drained) unless stop cut one */
  close_peers(c, started && c->clean && !atomic_load(&c->stop));
  sg_sock_close(c->listen_fd);
  sg_sock_close(c->wake_fd);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  sg_free(c->job);
  sg_free(c->token);
  sg_free(c->peers);
  sg_free(c->stage);
  sg_free(c);
}
