/*
 * fetch.c: the checkpoint client.  INFO on one connection; DATA striped
 * over every source with streams_per_source connections each.
 *
 * The data regions' concatenation is cut into chunks (sg_ckpt_plan_chunk),
 * and each source gets an equal contiguous share of them.  Each stream
 * thread takes the next chunk of its source's share, asks its source for
 * that byte range and readv()s the payload straight into the destination
 * regions.  A stream whose share is done steals from the end of the
 * largest share left, so faster sources take more chunks.  A chunk that
 * fails goes back in a queue that the remaining sources' streams drain; the
 * source that failed is dropped.  The caller's thread only starts and joins
 * the streams.
 *
 * Same host: the first stream of each source to take a chunk sends a MAP
 * request with this process's same-host id.  A grant (the source's id, its
 * beacon and a descriptor per region, each checked against the announced
 * lengths) that passes the probe (the beacon reads what the source said)
 * turns the source's streams into copiers: each chunk is read from the
 * source's memory with sg_samehost_readv in batches of at most PIECE bytes
 * and 1024 regions, and the beacon is reread after the chunk, so a source
 * that stopped serving (disallow) or died (ESRCH, or another process at that
 * pid) fails the chunk like a cut stream.  The MAP connection stays open until
 * the fetch ends: the source keeps the state until then.  A refusal that says
 * "not the same host", an id that does not match or a failed probe make the
 * source a TCP one.
 *
 * Every wait polls in slices of at most 100 ms and checks the fetch's abort
 * flag and the deadline between slices; a same-host piece takes well under
 * that.
 */
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt_int.h"

#define SLICE_MS 100
#define IOV_BATCH 256
#define PIECE (8u << 20) /* bytes per same-host copy between abort checks */

#define PREFAULT_MIN (256u << 10) /* smaller destinations fault as they go */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/*
 * prefault: map the whole pages inside [p, p + len) for writing in one call.
 * Fresh staging memory otherwise takes one page fault per 4 KiB page inside
 * the copy (measured on the development VM: 105 ms per 64 MiB by faults,
 * 58 ms populated).  Best effort: older kernels refuse, pages already
 * mapped cost a page-table walk.
 */
static void prefault(void *p, uint64_t len) {
  const uintptr_t page = 4096;
  if (len < PREFAULT_MIN)
    return; /* a syscall per small tensor costs more than it saves */
  uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1);
  uintptr_t hi = ((uintptr_t)p + (uintptr_t)len) & ~(page - 1);
  if (hi > lo)
    (void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
}

struct sg_ckpt_fetch_s {
  atomic_int aborted;
  sg_ckpt_fetch_stats_t last; /* written by the data call */
};

void sg_ckpt_fetch_stats(const sg_ckpt_fetch_t *f, sg_ckpt_fetch_stats_t *out) {
  *out = f->last;
}

int sg_ckpt_fetch_new(sg_ckpt_fetch_t **out) {
  sg_ckpt_fetch_t *f = sg_calloc(1, sizeof(*f));
  if (!f)
    return SG_ENOMEM;
  atomic_init(&f->aborted, 0);
  *out = f;
  return 0;
}

void sg_ckpt_fetch_abort(sg_ckpt_fetch_t *f) { atomic_store(&f->aborted, 1); }

void sg_ckpt_fetch_free(sg_ckpt_fetch_t *f) { sg_free(f); }

void sg_ckpt_info_free(sg_ckpt_info_t *info) {
  sg_free(info->header);
  sg_free(info->lens);
  memset(info, 0, sizeof(*info));
}

/* ---- blocking I/O with abort and deadline --------------------------------
 */

/* wait_fd: until `fd` is ready for `events`, aborted or past `d`. */
static int wait_fd(sg_ckpt_fetch_t *f, int fd, short events, sg_deadline_t d) {
  for (;;) {
    if (atomic_load(&f->aborted))
      return SG_EABORTED;
    int64_t left = sg_deadline_left_ms(d);
    if (left == 0)
      return SG_ETIMEDOUT;
    struct pollfd p = {.fd = fd, .events = events};
    int n = poll(&p, 1, left > SLICE_MS ? SLICE_MS : (int)left);
    if (n < 0 && errno != EINTR)
      return -errno;
    if (n > 0)
      return 0;
  }
}

static int conn_open(sg_ckpt_fetch_t *f, const char *addr, sg_deadline_t d,
                     int *out, sg_err_t *err) {
  char host[SG_CKPT_MAX_ADDR + 1], svc[8];
  int port, fd = -1, rc;
  struct addrinfo hints, *res = NULL;
  if ((rc = sg_addr_split(addr, host, sizeof(host), &port, err)) != 0)
    return rc;
  if (port == 0)
    return sg_err_set(err, SG_EINVAL, "checkpoint address \"%s\": port 0",
                      addr);
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  snprintf(svc, sizeof(svc), "%d", port);
  int gai = getaddrinfo(host, svc, &hints, &res);
  if (gai)
    return sg_err_set(err, SG_ENOTFOUND, "resolve %s: %s", host,
                      gai_strerror(gai));
  rc = SG_ENOTFOUND;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      rc = -errno;
      continue;
    }
    rc = sg_sock_register(fd);
    if (rc) {
      close(fd);
      fd = -1;
      break;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      rc = 0;
    } else if (errno != EINPROGRESS) {
      rc = -errno;
    } else {
      rc = wait_fd(f, fd, POLLOUT, d);
      if (rc == 0) {
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        rc = getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 ? -errno
                                                                   : -soerr;
      }
    }
    if (rc == 0)
      break;
    sg_sock_close(fd);
    fd = -1;
    if (rc == SG_ETIMEDOUT || rc == SG_EABORTED)
      break;
  }
  freeaddrinfo(res);
  if (rc)
    return sg_err_set(err, rc, "connect to %s: %s", addr, sg_strerror(rc));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  *out = fd;
  return 0;
}

static int send_all(sg_ckpt_fetch_t *f, int fd, const uint8_t *p, size_t len,
                    sg_deadline_t d) {
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return -errno;
    int rc = wait_fd(f, fd, POLLOUT, d);
    if (rc)
      return rc;
  }
  return 0;
}

/* prefault_range: prefault bytes [off, off + len) of the destination,
 * except regions flagged as already mapped. */
static void prefault_range(const sg_ckpt_region_t *dst, const uint64_t *prefix,
                           const uint8_t *mapped, size_t n, uint64_t off,
                           uint64_t len) {
  size_t ri = sg__ckpt_find(prefix, n, off);
  uint64_t roff = ri < n ? off - prefix[ri] : 0;
  while (len > 0 && ri < n) {
    uint64_t avail = dst[ri].len - roff;
    uint64_t take = avail < len ? avail : len;
    if (take && !(mapped && mapped[ri]))
      prefault((uint8_t *)dst[ri].ptr + roff, take);
    len -= take;
    ri++;
    roff = 0;
  }
}

/*
 * recv_into: receive exactly `len` bytes into the regions `dst` starting at
 * byte `off` of their concatenation (prefix: n + 1 sums).  EOF is SG_EPEER.
 */
static int recv_into(sg_ckpt_fetch_t *f, int fd, const sg_ckpt_region_t *dst,
                     const uint64_t *prefix, size_t n, uint64_t off,
                     uint64_t len, sg_deadline_t d) {
  size_t ri = sg__ckpt_find(prefix, n, off);
  uint64_t roff = ri < n ? off - prefix[ri] : 0;
  while (len > 0) {
    struct iovec iov[IOV_BATCH];
    int niov = 0;
    size_t i = ri;
    uint64_t o = roff, want = len;
    while (niov < IOV_BATCH && want > 0 && i < n) {
      uint64_t avail = dst[i].len - o;
      if (avail == 0) {
        i++;
        o = 0;
        continue;
      }
      uint64_t take = avail < want ? avail : want;
      if (take > (1u << 30))
        take = 1u << 30;
      iov[niov].iov_base = (uint8_t *)dst[i].ptr + o;
      iov[niov].iov_len = (size_t)take;
      niov++;
      want -= take;
      o += take;
    }
    if (niov == 0)
      return SG_EINVAL; /* range past the destination: a caller bug */
    ssize_t got = readv(fd, iov, niov);
    if (got == 0)
      return SG_EPEER;
    if (got < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return -errno;
      int rc = wait_fd(f, fd, POLLIN, d);
      if (rc)
        return rc;
      continue;
    }
    uint64_t g = (uint64_t)got;
    len -= g;
    while (g > 0) {
      uint64_t avail = dst[ri].len - roff;
      if (g < avail) {
        roff += g;
        g = 0;
      } else {
        g -= avail;
        ri++;
        roff = 0;
      }
    }
  }
  return 0;
}

static int recv_buf(sg_ckpt_fetch_t *f, int fd, void *p, size_t len,
                    sg_deadline_t d) {
  sg_ckpt_region_t r = {.ptr = p, .len = len};
  uint64_t prefix[2] = {0, len};
  return recv_into(f, fd, &r, prefix, 1, 0, len, d);
}

/*
 * exchange: send request `q`, read and check the fixed response.  An error
 * status is read with its message and returned (detail in err).
 */
static int exchange(sg_ckpt_fetch_t *f, int fd, const char *addr,
                    const sg_ckpt_req_t *q, sg_deadline_t d, sg_ckpt_resp_t *r,
                    sg_err_t *err) {
  uint8_t buf[SG_CKPT_REQ_MAX];
  int n = sg_ckpt_req_encode(q, buf);
  if (n < 0)
    return sg_err_set(err, n, "bad checkpoint request");
  int rc = send_all(f, fd, buf, (size_t)n, d);
  if (rc == 0)
    rc = recv_buf(f, fd, buf, SG_CKPT_RESP_FIXED, d);
  if (rc)
    return sg_err_set(
        err, rc == SG_EPEER || rc == SG_ECONNRESET ? SG_EPEER : rc,
        "checkpoint source %s: %s", addr,
        rc == SG_EPEER ? "closed the connection" : sg_strerror(rc));
  rc = sg_ckpt_resp_parse(buf, SG_CKPT_RESP_FIXED, r);
  if (rc == 0 && r->kind != q->kind)
    rc = SG_EPROTO;
  if (rc)
    return sg_err_set(err, SG_EPROTO, "checkpoint source %s: bad response",
                      addr);
  if (r->status) {
    char msg[SG_CKPT_MAX_ERRMSG + 1];
    rc = recv_buf(f, fd, msg, (size_t)r->payload, d);
    msg[rc ? 0 : r->payload] = '\0';
    return sg_err_set(err, r->status, "checkpoint source %s: %s", addr,
                      msg[0] ? msg : sg_strerror(r->status));
  }
  if (r->kind == SG_CKPT_KIND_DATA &&
      (r->step != q->step || r->layout != q->layout || r->aux != q->offset ||
       r->payload != q->length))
    return sg_err_set(err, SG_EPROTO,
                      "checkpoint source %s: response does not match the "
                      "request (step %lld, %llu+%llu)",
                      addr, (long long)r->step, (unsigned long long)r->aux,
                      (unsigned long long)r->payload);
  if (r->kind == SG_CKPT_KIND_MAP &&
      (r->step != q->step || r->layout != q->layout))
    return sg_err_set(err, SG_EPROTO,
                      "checkpoint source %s: same-host grant for step %lld "
                      "does not match the request",
                      addr, (long long)r->step);
  if (r->kind == SG_CKPT_KIND_INFO && r->step != q->step)
    return sg_err_set(err, SG_EPROTO,
                      "checkpoint source %s: asked step %lld, got %lld", addr,
                      (long long)q->step, (long long)r->step);
  return 0;
}

static int fill_token(sg_ckpt_req_t *q, const char *token, sg_err_t *err) {
  size_t tl = token ? strlen(token) : 0;
  if (tl > SG_CKPT_MAX_TOKEN)
    return sg_err_set(err, SG_EINVAL, "auth token over %d bytes",
                      SG_CKPT_MAX_TOKEN);
  q->token_len = tl;
  if (tl)
    memcpy(q->token, token, tl);
  return 0;
}

/* ---- INFO -------------------------------------------------------------------
 */

int sg_ckpt_fetch_info(sg_ckpt_fetch_t *f, const char *addr, const char *token,
                       int64_t step, sg_deadline_t deadline,
                       sg_ckpt_info_t *info, sg_err_t *err) {
  int fd = -1, rc;
  sg_ckpt_req_t q;
  sg_ckpt_resp_t r;
  memset(info, 0, sizeof(*info));
  memset(&q, 0, sizeof(q));
  if (step < 0)
    return sg_err_set(err, SG_EINVAL, "step must be >= 0");
  q.kind = SG_CKPT_KIND_INFO;
  q.step = step;
  rc = fill_token(&q, token, err);
  if (rc)
    return rc;
  rc = conn_open(f, addr, deadline, &fd, err);
  if (rc)
    goto out;
  rc = exchange(f, fd, addr, &q, deadline, &r, err);
  if (rc)
    goto out;
  info->nregions = r.nregions;
  info->hlen = (size_t)r.aux;
  info->lens = sg_malloc(r.nregions ? (size_t)r.nregions * 8 : 1);
  info->header = sg_malloc(info->hlen ? info->hlen : 1);
  if (!info->lens || !info->header) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  rc = recv_buf(f, fd, info->lens, (size_t)r.nregions * 8, deadline);
  if (rc == 0)
    rc = recv_buf(f, fd, info->header, info->hlen, deadline);
  if (rc) {
    sg_err_set(err, rc == SG_EPEER ? SG_EPEER : rc, "checkpoint source %s: %s",
               addr, rc == SG_EPEER ? "truncated response" : sg_strerror(rc));
    goto out;
  }
  /* decode in place: each value is read before its slot is written */
  rc = sg_ckpt_lengths_parse((const uint8_t *)info->lens, info->nregions,
                             info->lens, &info->total);
  if (rc == 0 && sg_ckpt_layout_id(info->lens, info->nregions) != r.layout)
    rc = SG_EPROTO;
  if (rc) {
    sg_err_set(err, SG_EPROTO, "checkpoint source %s: bad region table", addr);
    goto out;
  }
  info->step = r.step;
  info->layout = r.layout;
out:
  sg_sock_close(fd);
  if (rc)
    sg_ckpt_info_free(info);
  return rc;
}

/* ---- DATA, striped -------------------------------------------------------
 */

typedef struct job_s job_t;

enum { MODE_UNKNOWN, MODE_TCP, MODE_MAPPED, MODE_FAILED };

/* One source of a fetch: how it is read (decided by its first stream). */
typedef struct source_s {
  pthread_mutex_t mu; /* held while the mode is decided */
  int mode;           /* under mu */
  int map_fd;         /* MAPPED: the connection that holds the state */
  uint32_t pid;       /* MAPPED: the source process */
  uint64_t beacon_addr;
  uint8_t beacon[SG_CKPT_BEACON_LEN];
  uint64_t *raddr; /* MAPPED: region addresses in the source */
  int rc;          /* FAILED: why, for the streams that come later */
  sg_err_t err;
} source_t;

/* errno_text: what a negative errno from sg_samehost_read means. */
static const char *errno_text(int rc) {
  return rc < 0 && rc > -4096 ? strerror(-rc) : sg_strerror(rc);
}

typedef struct stream_s {
  job_t *job;
  size_t src;
  pthread_t th;
  int started;
  int mode; /* the source's mode once known */
} stream_t;

struct job_s {
  sg_ckpt_fetch_t *f;
  const char *const *addrs;
  size_t naddr;
  sg_ckpt_req_t proto; /* kind, step, layout, token */
  const sg_ckpt_region_t *dst;
  const uint64_t *prefix;
  const uint64_t *lens;  /* n announced region lengths */
  const uint8_t *mapped; /* NULL or n flags: not populated */
  size_t n;
  uint64_t total, chunk, nchunks;
  sg_deadline_t deadline;
  int self_ok; /* this process has a same-host id (and may use it) */
  sg_samehost_id_t self;
  source_t *srcs; /* naddr */
  void (*progress)(void *arg, size_t source, uint64_t bytes);
  void *progress_arg;

  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t *lo, *hi; /* per source: its own fresh chunks [lo, hi) */
  uint64_t *retry;   /* chunks that failed somewhere */
  size_t nretry;
  uint64_t done;   /* chunks complete */
  int inflight;    /* chunks being fetched */
  int stop;        /* abort or deadline: everyone leaves */
  int *src_dead;   /* per source */
  size_t alive;    /* sources not dead */
  uint64_t *bytes; /* per source */
  uint64_t same_host_bytes, tcp_bytes;
  int rc; /* first abort/timeout, else last source error */
  sg_err_t err;
};

/* take_chunk: next chunk index for a stream, or -1 when there is none
 * left for it (under mu). */
static int64_t take_chunk(job_t *j, size_t src) {
  for (;;) {
    if (j->stop || j->src_dead[src])
      return -1;
    if (j->nretry)
      return (int64_t)j->retry[--j->nretry];
    if (j->lo[src] < j->hi[src])
      return (int64_t)j->lo[src]++;
    /* out of its own: steal from the end of the largest share left */
    size_t v = src;
    for (size_t i = 0; i < j->naddr; i++)
      if (j->hi[i] - j->lo[i] > j->hi[v] - j->lo[v])
        v = i;
    if (j->lo[v] < j->hi[v])
      return (int64_t)--j->hi[v];
    if (j->inflight == 0)
      return -1; /* all done */
    /* wait: a chunk in flight elsewhere may fail and come back */
    struct timespec ts;
    int64_t d = sg_now_ns() + SLICE_MS * 1000000LL;
    ts.tv_sec = (time_t)(d / 1000000000LL);
    ts.tv_nsec = (long)(d % 1000000000LL);
    pthread_cond_timedwait(&j->cv, &j->mu, &ts);
    if (atomic_load(&j->f->aborted) || sg_deadline_passed(j->deadline))
      return -1;
  }
}

/*
 * map_source: ask source `si` for a same-host grant on *fd (opened here if
 * needed) and check it.  Sets the source's mode: MAPPED (the connection
 * moves to the source, *fd = -1) or TCP (*fd stays usable, or is closed).
 * Returns 0, or a source error (refusal, bad grant, I/O).  Under src->mu.
 */
static int map_source(job_t *j, size_t si, int *fd, sg_err_t *err) {
  source_t *src = &j->srcs[si];
  const char *addr = j->addrs[si];
  uint8_t *buf = NULL;
  uint64_t *raddr = NULL;
  int rc;
  if (!j->self_ok) {
    src->mode = MODE_TCP;
    return 0;
  }
  if (*fd < 0) {
    rc = conn_open(j->f, addr, j->deadline, fd, err);
    if (rc)
      return rc;
  }
  sg_ckpt_req_t q = j->proto;
  sg_ckpt_resp_t r;
  q.kind = SG_CKPT_KIND_MAP;
  q.length = SG_SAMEHOST_ID_LEN;
  sg_samehost_encode(&j->self, q.peer_id);
  rc = exchange(j->f, *fd, addr, &q, j->deadline, &r, err);
  if (rc == SG_CKPT_NOT_SAME_HOST) {
    sg_err_clear(err);
    src->mode = MODE_TCP; /* the connection is still good for DATA */
    return 0;
  }
  if (rc)
    return rc;
  if (r.nregions != j->n) {
    rc = sg_err_set(err, SG_EPROTO,
                    "checkpoint source %s: same-host grant has %u regions, "
                    "%zu announced",
                    addr, r.nregions, j->n);
    goto out;
  }
  buf = sg_malloc((size_t)r.payload);
  raddr = sg_malloc((j->n ? j->n : 1) * sizeof(*raddr));
  if (!buf || !raddr) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  rc = recv_buf(j->f, *fd, buf, (size_t)r.payload, j->deadline);
  if (rc) {
    sg_err_set(err, rc == SG_EPEER ? SG_EPEER : rc, "checkpoint source %s: %s",
               addr, rc == SG_EPEER ? "truncated response" : sg_strerror(rc));
    goto out;
  }
  sg_ckpt_map_t m;
  if (sg_ckpt_map_parse(buf, (size_t)r.payload, &m) ||
      sg_ckpt_desc_parse(buf + SG_CKPT_MAP_FIXED, j->n, j->lens, raddr)) {
    rc = sg_err_set(err, SG_EPROTO,
                    "checkpoint source %s: same-host descriptor outside what "
                    "the source announced",
                    addr);
    goto out;
  }
  if (!sg_samehost_match(&j->self, &m.id) ||
      (rc = sg_samehost_probe(m.id.pid, m.beacon_addr, m.beacon,
                              SG_CKPT_BEACON_LEN)) != 0) {
    sg_log(SG_LOG_DEBUG, "ckpt", "source %s: same-host probe failed (%s), TCP",
           addr, rc ? errno_text(rc) : "another host");
    sg_sock_close(*fd); /* releases the source's hold */
    *fd = -1;
    src->mode = MODE_TCP;
    rc = 0;
    goto out;
  }
  src->mode = MODE_MAPPED;
  src->map_fd = *fd;
  *fd = -1;
  src->pid = m.id.pid;
  src->beacon_addr = m.beacon_addr;
  memcpy(src->beacon, m.beacon, SG_CKPT_BEACON_LEN);
  src->raddr = raddr;
  raddr = NULL;
out:
  sg_free(buf);
  sg_free(raddr);
  return rc;
}

/*
 * map_read: copy bytes [off, off + len) of the concatenation from a mapped
 * source into the destination, then reread its beacon.  The range is read
 * in batches of at most PIECE bytes and SG_SAMEHOST_IOV_MAX regions, one
 * process_vm_readv per batch (many small tensors: one call per 1024 of
 * them), checking abort and the deadline between batches.
 */
static int map_read(job_t *j, size_t si, uint64_t off, uint64_t len,
                    sg_err_t *err) {
  source_t *src = &j->srcs[si];
  sg_samehost_piece_t pieces[SG_SAMEHOST_IOV_MAX];
  size_t ri = sg__ckpt_find(j->prefix, j->n, off);
  uint64_t roff = ri < j->n ? off - j->prefix[ri] : 0;
  while (len > 0) {
    if (atomic_load(&j->f->aborted))
      return sg_err_set(err, SG_EABORTED, "fetch aborted");
    if (sg_deadline_passed(j->deadline))
      return sg_err_set(err, SG_ETIMEDOUT, "checkpoint fetch timed out");
    size_t k = 0;
    uint64_t batch = 0;
    while (len > 0 && k < SG_SAMEHOST_IOV_MAX && batch < PIECE) {
      if (ri >= j->n)
        return sg_err_set(err, SG_EINVAL, "range past the destination");
      uint64_t avail = j->dst[ri].len - roff;
      if (avail == 0) {
        ri++;
        roff = 0;
        continue;
      }
      uint64_t take = avail < len ? avail : len;
      if (take > PIECE - batch)
        take = PIECE - batch;
      uint8_t *to = (uint8_t *)j->dst[ri].ptr + roff;
      if (!(j->mapped && j->mapped[ri]))
        prefault(to, take);
      pieces[k].remote = src->raddr[ri] + roff;
      pieces[k].local = to;
      pieces[k].len = (size_t)take;
      k++;
      batch += take;
      roff += take;
      len -= take;
    }
    int rc = sg_samehost_readv(src->pid, pieces, k);
    if (rc)
      return sg_err_set(err, SG_EPEER,
                        "checkpoint source %s: same-host read failed: %s",
                        j->addrs[si], errno_text(rc));
  }
  int rc = sg_samehost_probe(src->pid, src->beacon_addr, src->beacon,
                             SG_CKPT_BEACON_LEN);
  if (rc)
    return sg_err_set(err, SG_EPEER,
                      "checkpoint source %s stopped serving during a "
                      "same-host read (%s)",
                      j->addrs[si], errno_text(rc));
  return 0;
}

/* stream_mode: the source's mode, deciding it if this stream is first. */
static int stream_mode(job_t *j, stream_t *st, int *fd, sg_err_t *err) {
  source_t *src = &j->srcs[st->src];
  int rc = 0;
  pthread_mutex_lock(&src->mu);
  if (src->mode == MODE_UNKNOWN) {
    rc = map_source(j, st->src, fd, err);
    if (rc) {
      src->mode = MODE_FAILED;
      src->rc = rc;
      src->err = *err;
    }
  } else if (src->mode == MODE_FAILED) {
    rc = src->rc;
    *err = src->err;
  }
  st->mode = src->mode;
  pthread_mutex_unlock(&src->mu);
  return rc;
}

static void *stream_main(void *arg) {
  stream_t *st = arg;
  sg_thread_name("sg-ckpt-fetch");
  job_t *j = st->job;
  const char *addr = j->addrs[st->src];
  int fd = -1;
  sg_err_t err;
  sg_err_clear(&err);
  for (;;) {
    pthread_mutex_lock(&j->mu);
    int64_t c = take_chunk(j, st->src);
    if (c >= 0)
      j->inflight++;
    pthread_mutex_unlock(&j->mu);
    if (c < 0)
      break;
    uint64_t off = (uint64_t)c * j->chunk;
    uint64_t len = j->total - off < j->chunk ? j->total - off : j->chunk;
    int rc = 0;
    if (st->mode == MODE_UNKNOWN || st->mode == MODE_FAILED)
      rc = stream_mode(j, st, &fd, &err);
    if (rc == 0 && st->mode == MODE_MAPPED) {
      rc = map_read(j, st->src, off, len, &err);
    } else if (rc == 0 && fd < 0) {
      rc = conn_open(j->f, addr, j->deadline, &fd, &err);
    }
    if (rc == 0 && st->mode == MODE_TCP) {
      sg_ckpt_req_t q = j->proto;
      sg_ckpt_resp_t r;
      q.offset = off;
      q.length = len;
      rc = exchange(j->f, fd, addr, &q, j->deadline, &r, &err);
      if (rc == 0) {
        prefault_range(j->dst, j->prefix, j->mapped, j->n, off, len);
        rc =
            recv_into(j->f, fd, j->dst, j->prefix, j->n, off, len, j->deadline);
        if (rc)
          sg_err_set(&err, rc == SG_EPEER ? SG_EPEER : rc,
                     "checkpoint source %s: %s", addr,
                     rc == SG_EPEER ? "truncated stream" : sg_strerror(rc));
      }
    }
    pthread_mutex_lock(&j->mu);
    j->inflight--;
    if (rc == 0) {
      j->done++;
      j->bytes[st->src] += len;
      if (st->mode == MODE_MAPPED)
        j->same_host_bytes += len;
      else
        j->tcp_bytes += len;
    } else {
      j->retry[j->nretry++] = (uint64_t)c;
      if (rc == SG_EABORTED || rc == SG_ETIMEDOUT) {
        if (!j->stop) {
          j->stop = 1;
          j->rc = rc;
          j->err = err;
        }
      } else {
        if (!j->src_dead[st->src]) {
          j->src_dead[st->src] = 1;
          j->alive--;
          sg_log(SG_LOG_WARN, "ckpt", "dropping source: %s", err.msg);
        }
        if (!j->stop) {
          j->rc = rc;
          j->err = err;
          if (j->alive == 0)
            j->stop = 1;
        }
      }
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (rc)
      break;
    if (j->progress)
      j->progress(j->progress_arg, st->src, len);
  }
  sg_sock_close(fd);
  return NULL;
}

int sg_ckpt_fetch_data(sg_ckpt_fetch_t *f, const char *const *addrs,
                       size_t naddr, const char *token, int64_t step,
                       uint64_t layout, const sg_ckpt_region_t *dst, size_t n,
                       const sg_ckpt_fetch_opts_t *o, sg_deadline_t deadline,
                       uint64_t *bytes, sg_err_t *err) {
  job_t j;
  stream_t *streams = NULL;
  uint64_t *prefix = NULL, *lens = NULL;
  size_t nstreams = 0;
  int rc = 0, k = o && o->streams_per_source ? o->streams_per_source : 2;
  memset(&j, 0, sizeof(j));
  memset(&f->last, 0, sizeof(f->last));
  if (bytes)
    memset(bytes, 0, naddr * sizeof(*bytes));
  if (naddr == 0 || naddr > SG_CKPT_MAX_SOURCES || !addrs || step < 0 ||
      k < 1 || k > SG_CKPT_MAX_STREAMS || n > SG_CKPT_MAX_REGIONS ||
      (n && !dst))
    return sg_err_set(err, SG_EINVAL, "bad fetch arguments");
  prefix = sg_malloc((n + 1) * sizeof(*prefix));
  lens = sg_malloc((n ? n : 1) * sizeof(*lens));
  if (!prefix || !lens) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  prefix[0] = 0;
  for (size_t i = 0; i < n; i++) {
    if ((dst[i].len && !dst[i].ptr) ||
        dst[i].len > SG_CKPT_MAX_TOTAL - prefix[i]) {
      rc = sg_err_set(err, SG_EINVAL, "bad destination region %zu", i);
      goto out;
    }
    prefix[i + 1] = prefix[i] + dst[i].len;
    lens[i] = dst[i].len;
  }
  if (sg_ckpt_layout_id(lens, n) != layout) {
    rc = sg_err_set(err, SG_EINVAL,
                    "destination regions do not match the served layout");
    goto out;
  }
  if (atomic_load(&f->aborted)) {
    rc = sg_err_set(err, SG_EABORTED, "fetch aborted");
    goto out;
  }
  j.f = f;
  j.addrs = addrs;
  j.naddr = naddr;
  j.proto.kind = SG_CKPT_KIND_DATA;
  j.proto.step = step;
  j.proto.layout = layout;
  rc = fill_token(&j.proto, token, err);
  if (rc)
    goto out;
  j.dst = dst;
  j.prefix = prefix;
  j.lens = lens;
  j.mapped = o ? o->mapped : NULL;
  j.n = n;
  j.self_ok = !(o && o->same_host < 0) && sg_samehost_self(&j.self) == 0;
  j.progress = o ? o->progress : NULL;
  j.progress_arg = o ? o->progress_arg : NULL;
  j.total = prefix[n];
  if (j.total == 0)
    goto out; /* nothing to move */
  nstreams = naddr * (size_t)k;
  j.chunk = sg_ckpt_plan_chunk(j.total, nstreams,
                               o && o->min_chunk ? o->min_chunk : (1u << 20));
  j.nchunks = (j.total + j.chunk - 1) / j.chunk;
  j.deadline = deadline;
  j.alive = naddr;
  j.retry = sg_malloc((size_t)j.nchunks * sizeof(*j.retry));
  j.lo = sg_calloc(naddr, sizeof(*j.lo));
  j.hi = sg_calloc(naddr, sizeof(*j.hi));
  j.src_dead = sg_calloc(naddr, sizeof(*j.src_dead));
  j.bytes = sg_calloc(naddr, sizeof(*j.bytes));
  streams = sg_calloc(nstreams, sizeof(*streams));
  j.srcs = sg_calloc(naddr, sizeof(*j.srcs));
  if (!j.retry || !j.src_dead || !j.bytes || !streams || !j.lo || !j.hi ||
      !j.srcs) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto free_job;
  }
  for (size_t i = 0; i < naddr; i++) {
    j.lo[i] = j.nchunks * i / naddr;
    j.hi[i] = j.nchunks * (i + 1) / naddr;
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&j.mu, NULL);
  pthread_cond_init(&j.cv, &ca);
  pthread_condattr_destroy(&ca);
  for (size_t i = 0; i < naddr; i++) {
    pthread_mutex_init(&j.srcs[i].mu, NULL);
    j.srcs[i].map_fd = -1;
  }
  size_t started = 0;
  for (size_t i = 0; i < nstreams; i++) {
    /* interleave sources so that each gets a stream before any gets two */
    streams[i].job = &j;
    streams[i].src = i % naddr;
    if (pthread_create(&streams[i].th, NULL, stream_main, &streams[i]) == 0) {
      streams[i].started = 1;
      started++;
    }
  }
  for (size_t i = 0; i < nstreams; i++)
    if (streams[i].started)
      pthread_join(streams[i].th, NULL);
  pthread_mutex_destroy(&j.mu);
  pthread_cond_destroy(&j.cv);
  for (size_t i = 0; i < naddr; i++) {
    source_t *src = &j.srcs[i];
    if (src->mode == MODE_MAPPED)
      f->last.same_host_sources++;
    sg_sock_close(src->map_fd); /* the source may release the state */
    sg_free(src->raddr);
    pthread_mutex_destroy(&src->mu);
  }
  f->last.same_host_bytes = j.same_host_bytes;
  f->last.tcp_bytes = j.tcp_bytes;
  if (bytes)
    memcpy(bytes, j.bytes, naddr * sizeof(*bytes));
  if (j.done == j.nchunks) {
    rc = 0;
  } else if (started == 0) {
    rc = sg_err_set(err, SG_ENOMEM, "cannot start fetch threads");
  } else if (atomic_load(&f->aborted)) {
    rc = sg_err_set(err, SG_EABORTED, "fetch aborted");
  } else if (j.rc && j.rc != SG_ETIMEDOUT && j.stop) {
    rc = j.rc;
    if (err)
      *err = j.err;
  } else if (j.rc == SG_ETIMEDOUT || sg_deadline_passed(deadline)) {
    rc = sg_err_set(
        err, SG_ETIMEDOUT, "checkpoint fetch timed out with %llu of %llu bytes",
        (unsigned long long)(j.done * j.chunk), (unsigned long long)j.total);
  } else {
    rc = j.rc ? j.rc : SG_EPEER;
    if (err)
      *err = j.err;
  }
free_job:
  sg_free(j.retry);
  sg_free(j.lo);
  sg_free(j.hi);
  sg_free(j.src_dead);
  sg_free(j.bytes);
  sg_free(j.srcs);
  sg_free(streams);
out:
  sg_free(prefix);
  sg_free(lens);
  return rc;
}
