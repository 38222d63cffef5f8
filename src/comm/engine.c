/*
 * engine.c: the transfer engine.  sg__comm_xfer_run runs one send stream and
 * one receive stream over non-blocking sockets and poll(), with the wake
 * eventfd for abort.  A send segment may be gated on a receive segment
 * (pipelining: a ring forwards bytes as soon as they are reduced); receive
 * segments either land in place or go through a small circular staging
 * buffer and are reduced into their destination.  Between two processes
 * of one host the payload may instead be read from the sender's memory as
 * its DESC frames describe, and acknowledged.  Peers not in the transfer
 * are watched for a crash.  KEEPALIVE frames go out wherever a stream is
 * between frames and are skipped wherever one is read; a peer this
 * transfer waits on that sends nothing for the progress deadline fails it.
 *
 *   liveness   sg__comm_keepalive, sg__comm_ka_flush, sg__comm_drain,
 *              silent_fail
 *   failures   fail, peer_gone, first_gone, eof_fail
 *   sending    send_allowed, next_desc, send_iov, do_send_pull, do_send
 *   receiving  reduce_ready, check_header, take_desc, pull, do_recv
 *   the run    acknowledgements, deadlines, sg__comm_xfer_run,
 *              sg__comm_exchange
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"
#include "stepguard/samehost.h"

#define SEND_BUDGET (512u << 10) /* bytes sent per engine pass */
#define RECV_BUDGET (512u << 10) /* bytes received per engine pass */
#define GONE_GRACE_MS 50         /* see first_gone */
#define PULL_BUDGET (2u << 20)   /* bytes read from a peer per pass */
#define DESC_MIN (256u << 10)    /* smallest descriptor but a segment end */
#define DRAIN_BUDGET 64 /* KEEPALIVEs consumed per sg__comm_drain call */

static int fail(sg__comm_xfer_t *x, int code, const char *fmt, ...)
    SG_PRINTF(3, 4);

static int fail(sg__comm_xfer_t *x, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(x->msg, 256, fmt, ap);
  va_end(ap);
  return code;
}

/* ---- liveness ------------------------------------------------------------ */

static int send_done(const sg__comm_xfer_t *x);

/* between_frames: whether our stream to rank p is between frames, so that
 * a KEEPALIVE may go (x: the running transfer or NULL).  Inside a TCP
 * payload segment it is not: the receiver reads those bytes as payload;
 * a segment's OP or SEG frame waits for its first byte that may go, so a
 * sender waiting on its own receive stream stays between frames. */
static int between_frames(const sg__comm_xfer_t *x, int p) {
  if (!x)
    return 1;
  if (p == x->recv_peer && x->ack_out_off > 0 &&
      x->ack_out_off < SG__COMM_FRAME_LEN)
    return 0;
  if (p != x->send_peer || send_done(x))
    return 1;
  if (x->spull)
    return (x->shdr_off == 0 || x->shdr_off == SG__COMM_FRAME_LEN) &&
           x->sdesc_off == SG__COMM_FRAME_LEN;
  return x->shdr_off == 0;
}

int sg__comm_ka_flush(sg_comm_t *c, int p) {
  sg__comm_peer_t *pe = &c->peers[p];
  while (pe->ka_off < SG__COMM_FRAME_LEN) {
    ssize_t w =
        send(pe->fd, pe->ka + pe->ka_off, SG__COMM_FRAME_LEN - pe->ka_off,
             MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return errno == EAGAIN ? 1 : -errno;
    pe->ka_off += (size_t)w;
    pe->last_tx = sg_now_ns();
  }
  return 0;
}

void sg__comm_keepalive(sg_comm_t *c, const sg__comm_xfer_t *x, int64_t now) {
  if (now < c->ka_next)
    return;
  int64_t next = now + c->ka_ns;
  for (int p = 0; p < c->world; p++) {
    sg__comm_peer_t *pe = &c->peers[p];
    if (p == c->rank || pe->fd < 0)
      continue;
    if (pe->ka_off == SG__COMM_FRAME_LEN && now - pe->last_tx >= c->ka_ns &&
        between_frames(x, p)) {
      sg__comm_frame_t f = {.type = SG__COMM_FRAME_KEEPALIVE};
      sg__comm_frame_encode(pe->ka, &f);
      pe->ka_off = 0;
    }
    if (pe->ka_off < SG__COMM_FRAME_LEN)
      (void)sg__comm_ka_flush(c, p); /* a failure shows in the transfer */
    /* a peer that could not have one now is tried again in ka_ns */
    if (pe->last_tx + c->ka_ns > now && pe->last_tx + c->ka_ns < next)
      next = pe->last_tx + c->ka_ns;
  }
  c->ka_next = next;
}

static int is_keepalive(const uint8_t *b) {
  sg__comm_frame_t f;
  return sg__comm_frame_parse(b, SG__COMM_FRAME_LEN, &f) == 0 &&
         f.type == SG__COMM_FRAME_KEEPALIVE;
}

int sg__comm_drain(sg_comm_t *c, int p) {
  sg__comm_peer_t *pe = &c->peers[p];
  uint8_t b[SG__COMM_FRAME_LEN];
  for (int i = 0; i < DRAIN_BUDGET; i++) {
    ssize_t n = recv(pe->fd, b, sizeof(b), MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return errno == EAGAIN ? 0 : -errno;
    if (n == 0)
      return SG_EPEER;
    if ((size_t)n < sizeof(b)) /* a KEEPALIVE on its way, or other bytes */
      return memcmp(b, "SGKA", (size_t)n < 4 ? (size_t)n : 4) == 0 ? 0 : 1;
    if (!is_keepalive(b))
      return 1;
    n = recv(pe->fd, b, sizeof(b), MSG_DONTWAIT); /* the bytes just seen */
    (void)n;
    pe->last_rx = sg_now_ns();
  }
  return 2;
}

/* peer_addr: "host:port" of rank p's end of the connection. */
static void peer_addr(sg_comm_t *c, int p, char *buf, size_t cap) {
  struct sockaddr_storage a;
  socklen_t al = sizeof(a);
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (getpeername(c->peers[p].fd, (struct sockaddr *)&a, &al) == 0) {
    if (a.ss_family == AF_INET) {
      struct sockaddr_in *in = (struct sockaddr_in *)&a;
      inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
      port = ntohs(in->sin_port);
    } else if (a.ss_family == AF_INET6) {
      struct sockaddr_in6 *in = (struct sockaddr_in6 *)&a;
      if (IN6_IS_ADDR_V4MAPPED(&in->sin6_addr)) /* as the peer wrote it */
        inet_ntop(AF_INET, &in->sin6_addr.s6_addr[12], host, sizeof(host));
      else
        inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
      port = ntohs(in->sin6_port);
    }
  }
  snprintf(buf, cap, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

static int eof_fail_what(sg__comm_xfer_t *x, int p, const char *what);

/* silent_fail: rank p, which this transfer waits on, sent nothing for the
 * progress deadline: fail as a reset peer does, naming its address. */
static int silent_fail(sg__comm_xfer_t *x, int p, int64_t silent_ns) {
  char addr[INET6_ADDRSTRLEN + 16], what[160];
  peer_addr(x->c, p, addr, sizeof(addr));
  snprintf(what, sizeof(what),
           "nothing from %s for %.1f s (progress deadline %.1f s: hung or "
           "cut off)",
           addr, (double)silent_ns / 1e9, (double)x->c->progress_ns / 1e9);
  return eof_fail_what(x, p, what);
}

/* peer_gone: called when poll() showed a hangup on rank p's connection:
 * whether it is a crash (an error, EOF with nothing queued, or EOF after
 * bytes that are not a BYE: a peer killed in the middle of sending to us),
 * and record the order in which peers were seen gone; a BYE first turns
 * the watch off (a clean close; the next transfer will tell).  Never
 * blocks. */
static int peer_gone(sg_comm_t *c, int p) {
  sg__comm_peer_t *pe = &c->peers[p];
  uint8_t b[SG__COMM_FRAME_LEN];
  int soerr = 0, gone = 0;
  socklen_t sl = sizeof(soerr);
  if (getsockopt(pe->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr) {
    gone = 1;
  } else {
    if (sg__comm_drain(c, p) == 2)
      return 0; /* more KEEPALIVEs than one call takes: look again */
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
static int eof_fail_what(sg__comm_xfer_t *x, int p, const char *what) {
  int q = first_gone(x->c, p);
  if (!x->c->peers[p].gone_at)
    x->c->peers[p].gone_at = ++x->c->gone_count;
  if (q >= 0 && x->c->peers[q].gone_at < x->c->peers[p].gone_at)
    return fail(x, SG_EPEER, "%s: rank %d failed: %s (rank %d was gone first)",
                sg__comm_kind_name(x->op->kind), p, what, q);
  return fail(x, SG_EPEER, "%s: rank %d failed: %s",
              sg__comm_kind_name(x->op->kind), p, what);
}

static int eof_fail(sg__comm_xfer_t *x, int p, int code) {
  return eof_fail_what(
      x, p, code == SG_EPEER ? "connection closed" : sg_strerror(code));
}

/* send_allowed: bytes of send segment j that may go now. */
static size_t send_allowed(const sg__comm_xfer_t *x, int j) {
  if (x->work && j >= x->sready)
    return 0;
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
static int next_desc(sg__comm_xfer_t *x) {
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
static int send_iov(sg__comm_xfer_t *x, int fd, struct iovec *iov, int niov,
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
  x->c->peers[x->send_peer].last_tx = sg_now_ns();
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
static int do_send_pull(sg__comm_xfer_t *x, int *blocked, int *moved) {
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

/* next_seg: the current TCP segment is all sent: the next one starts with
 * its SEG frame (segment 0 with the OP frame). */
static void next_seg(sg__comm_xfer_t *x) {
  x->sk++;
  x->soff = 0;
  sg__comm_frame_t f = {.type = SG__COMM_FRAME_SEG,
                        .seq = (uint64_t)x->sk,
                        .bytes = x->ss[x->sk].len};
  sg__comm_frame_encode(x->shdr, &f);
  x->shdr_off = 0;
}

/* do_send: write as much as is allowed; sets *blocked when the socket is
 * full (wait for POLLOUT) and *moved when bytes went out.  A segment's
 * frame goes with its first byte that may go (or alone for an empty
 * segment), so that while the segment waits for received bytes the stream
 * is between frames and may carry KEEPALIVEs. */
static int do_send(sg__comm_xfer_t *x, int *blocked, int *moved) {
  int fd = x->c->peers[x->send_peer].fd;
  size_t budget = SEND_BUDGET;
  *blocked = 0;
  int k = sg__comm_ka_flush(x->c, x->send_peer);
  if (k < 0)
    return eof_fail(x, x->send_peer, k);
  if (k) {
    *blocked = 1;
    return 0;
  }
  if (x->spull)
    return do_send_pull(x, blocked, moved);
  while (budget) {
    struct iovec iov[2];
    int niov = 0;
    if (x->sk + 1 < x->ns && x->shdr_off == SG__COMM_FRAME_LEN &&
        x->soff == x->ss[x->sk].len)
      next_seg(x);
    size_t allowed = x->sk < x->ns ? send_allowed(x, x->sk) : 0;
    if (x->shdr_off < SG__COMM_FRAME_LEN) {
      if (allowed == 0 && x->sk < x->ns && x->ss[x->sk].len > 0)
        return 0; /* between frames until a byte may go */
      iov[niov].iov_base = x->shdr + x->shdr_off;
      iov[niov++].iov_len = SG__COMM_FRAME_LEN - x->shdr_off;
    }
    if (x->sk < x->ns && allowed > x->soff) {
      size_t len = allowed - x->soff;
      iov[niov].iov_base = x->ss[x->sk].p + x->soff;
      iov[niov++].iov_len = len < budget ? len : budget;
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
static void reduce_ready(sg__comm_xfer_t *x) {
  sg__comm_seg_t *s = &x->rs[x->rk];
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

static int check_header(sg__comm_xfer_t *x) {
  sg__comm_frame_t f;
  int p = x->recv_peer;
  int expect =
      x->op->kind == SG__COMM_KIND_RECV ? SG__COMM_KIND_SEND : x->op->kind;
  if (sg__comm_frame_parse(x->rhdr, SG__COMM_FRAME_LEN, &f))
    return fail(x, SG_EPROTO, "%s: rank %d sent a malformed frame",
                sg__comm_kind_name(x->op->kind), p);
  if (f.type == SG__COMM_FRAME_KEEPALIVE) {
    x->rhdr_off = 0; /* skipped: the frame we wait for comes after it */
    return 0;
  }
  if (f.type == SG__COMM_FRAME_BYE)
    return fail(x, SG_EPEER, "%s: rank %d closed its communicator",
                sg__comm_kind_name(x->op->kind), p);
  if (x->rk > 0) { /* a TCP segment after the first */
    if (f.type != SG__COMM_FRAME_SEG || f.seq != (uint64_t)x->rk ||
        f.bytes != x->rs[x->rk].len)
      return fail(x, SG_EPROTO,
                  "%s: rank %d disagrees on segment %d (%llu bytes expected)",
                  sg__comm_kind_name(x->op->kind), p, x->rk,
                  (unsigned long long)x->rs[x->rk].len);
    return 0;
  }
  if (f.type != SG__COMM_FRAME_OP)
    return fail(x, SG_EPROTO, "%s: rank %d sent a frame out of place",
                sg__comm_kind_name(x->op->kind), p);
  if (f.kind == expect && f.seq == x->c->peers[p].rx_seq &&
      f.bytes == x->rtotal && f.flags != (x->rpull ? SG__COMM_OP_PULL : 0))
    return fail(x, SG_EPROTO,
                "%s: rank %d disagrees on the same-host path (flags %u)",
                sg__comm_kind_name(x->op->kind), p, (unsigned)f.flags);
  if (f.kind != expect || f.seq != x->c->peers[p].rx_seq ||
      f.bytes != x->rtotal)
    return fail(x, SG_EPROTO,
                "%s: rank %d is in another operation (%s #%llu, %llu bytes; "
                "expected %s #%llu, %llu bytes)",
                sg__comm_kind_name(x->op->kind), p, sg__comm_kind_name(f.kind),
                (unsigned long long)f.seq, (unsigned long long)f.bytes,
                sg__comm_kind_name(expect),
                (unsigned long long)x->c->peers[p].rx_seq,
                (unsigned long long)x->rtotal);
  return 0;
}

/* take_desc: accept the DESC frame just read: what it describes must fit
 * in what is left of the payload. */
static int take_desc(sg__comm_xfer_t *x) {
  sg__comm_frame_t f;
  if (sg__comm_frame_parse(x->rdesc, SG__COMM_FRAME_LEN, &f) ||
      f.type != SG__COMM_FRAME_DESC || f.bytes > x->rtotal - x->rcvd)
    return fail(x, SG_EPROTO, "%s: rank %d sent a bad descriptor",
                sg__comm_kind_name(x->op->kind), x->recv_peer);
  x->raddr = f.seq;
  x->rleft = (size_t)f.bytes;
  x->rdesc_off = 0;
  return 0;
}

/* pull: where do_recv would recv() from the socket, read up to `room`
 * payload bytes out of the peer's memory instead, after reading the DESC
 * frame that says where they are.  Returns bytes landed (0: none yet) or a
 * negative code; *again is set when the socket has nothing for now. */
static ssize_t pull(sg__comm_xfer_t *x, int fd, uint8_t *dst, size_t room,
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
    x->c->peers[x->recv_peer].last_rx = sg_now_ns();
    if (x->rdesc_off == SG__COMM_FRAME_LEN && is_keepalive(x->rdesc)) {
      x->rdesc_off = 0;
      return 0;
    }
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
static int do_recv(sg__comm_xfer_t *x, int *moved) {
  int fd = x->c->peers[x->recv_peer].fd;
  size_t budget = x->rpull ? PULL_BUDGET : RECV_BUDGET, S = x->c->stage_cap;
  while (budget) {
    uint8_t *dst;
    size_t room;
    if (x->rhdr_off < SG__COMM_FRAME_LEN) {
      dst = x->rhdr + x->rhdr_off;
      room = SG__COMM_FRAME_LEN - x->rhdr_off;
    } else {
      if (x->rk >= x->nr)
        return 0;
      if (x->rdone == x->rs[x->rk].len) { /* this segment is complete */
        if (x->rk + 1 >= x->nr)
          return 0;
        x->rk++;
        x->roff = x->rdone = 0;
        if (!x->rpull)
          x->rhdr_off = 0; /* its SEG frame comes first */
        continue;
      }
      sg__comm_seg_t *s = &x->rs[x->rk];
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
    x->c->peers[x->recv_peer].last_rx = sg_now_ns();
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

int sg__comm_xfer_rsegs(const sg__comm_xfer_t *x) {
  if (x->recv_peer < 0 || x->nr == 0)
    return 0;
  if (x->rhdr_off < SG__COMM_FRAME_LEN) /* the frame of segment rk */
    return x->rk;
  return x->rk + (x->rdone == x->rs[x->rk].len);
}

static int send_done(const sg__comm_xfer_t *x) {
  if (x->send_peer < 0)
    return 1;
  if (x->shdr_off < SG__COMM_FRAME_LEN || x->sdesc_off < SG__COMM_FRAME_LEN)
    return 0;
  if (!x->spull) /* every segment's SEG frame must go, even an empty one's */
    return x->ns == 0 || (x->sk == x->ns - 1 && x->soff == x->ss[x->sk].len);
  for (int j = x->sk; j < x->ns; j++)
    if ((j == x->sk ? x->soff : 0) < x->ss[j].len)
      return 0;
  return 1;
}

static int recv_done(const sg__comm_xfer_t *x) {
  if (x->recv_peer < 0)
    return 1;
  if (x->rhdr_off < SG__COMM_FRAME_LEN)
    return 0;
  if (!x->rpull)
    return x->nr == 0 || (x->rk == x->nr - 1 && x->rdone == x->rs[x->rk].len);
  for (int j = x->rk; j < x->nr; j++)
    if ((j == x->rk ? x->rdone : 0) < x->rs[j].len)
      return 0;
  return 1;
}

/* earliest_deadline: the op's, or a queued op's if that is sooner. */
static sg_deadline_t earliest_deadline(sg_comm_t *c, sg_deadline_t d) {
  pthread_mutex_lock(&c->mu);
  for (sg__comm_op_t *o = c->head; o; o = o->next)
    if (o->deadline < d)
      d = o->deadline;
  pthread_mutex_unlock(&c->mu);
  return d;
}

/* check_ack: the ACK that ends a DESC payload must be for this transfer. */
static int check_ack(sg__comm_xfer_t *x) {
  sg__comm_frame_t f;
  int p = x->send_peer;
  int kind =
      x->op->kind == SG__COMM_KIND_RECV ? SG__COMM_KIND_SEND : x->op->kind;
  if (sg__comm_frame_parse(x->ack_in, SG__COMM_FRAME_LEN, &f) ||
      f.type != SG__COMM_FRAME_ACK || f.kind != kind ||
      f.seq != x->c->peers[p].tx_seq || f.bytes != x->stotal)
    return fail(x, SG_EPROTO, "%s: rank %d sent a bad acknowledgement",
                sg__comm_kind_name(x->op->kind), p);
  return 0;
}

/*
 * do_acks: a DESC payload ends with an ACK from its receiver, sent once it
 * has read every byte (and after its own payload when the two ranks send
 * to each other, so each direction stays in order); the sender waits for
 * it before its buffers go back to the caller.  Sets *out_blocked when the
 * ACK waits for room in the socket, *in_wait when it waits for the ACK.
 */
static int do_acks(sg__comm_xfer_t *x, int sdone, int rdone, int *moved,
                   int *out_blocked, int *in_wait) {
  sg_comm_t *c = x->c;
  *out_blocked = *in_wait = 0;
  while (x->ack_out_off < SG__COMM_FRAME_LEN && rdone &&
         (x->recv_peer != x->send_peer || sdone)) {
    int k = x->ack_out_off == 0 ? sg__comm_ka_flush(c, x->recv_peer) : 0;
    if (k < 0)
      return eof_fail(x, x->recv_peer, k);
    if (k) {
      *out_blocked = 1;
      break;
    }
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
    c->peers[x->recv_peer].last_tx = sg_now_ns();
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
    c->peers[x->send_peer].last_rx = sg_now_ns();
    *moved = 1;
    if (x->ack_in_off == SG__COMM_FRAME_LEN && is_keepalive(x->ack_in)) {
      x->ack_in_off = 0;
      continue;
    }
    if (x->ack_in_off == SG__COMM_FRAME_LEN)
      return check_ack(x);
  }
  return 0;
}

/* xfer_run: run one transfer to completion, failure, deadline or stop. */
int sg__comm_xfer_run(sg__comm_xfer_t *x) {
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
  int pk =
      x->op->kind != SG__COMM_KIND_SEND && x->op->kind != SG__COMM_KIND_RECV;
  x->spull = pk && x->send_peer >= 0 && c->peers[x->send_peer].pull_to &&
             s_total >= c->pull_min;
  x->rpull = pk && x->recv_peer >= 0 && c->peers[x->recv_peer].pull_from &&
             r_total >= c->pull_min;
  x->sdesc_off = SG__COMM_FRAME_LEN;
  x->ack_in_off = x->spull ? 0 : SG__COMM_FRAME_LEN;
  x->ack_out_off = SG__COMM_FRAME_LEN;
  if (x->rpull) {
    sg__comm_frame_t f = {.type = SG__COMM_FRAME_ACK,
                          .kind = (uint16_t)(x->op->kind == SG__COMM_KIND_RECV
                                                 ? SG__COMM_KIND_SEND
                                                 : x->op->kind),
                          .seq = c->peers[x->recv_peer].rx_seq,
                          .bytes = r_total};
    sg__comm_frame_encode(x->ack_out, &f);
    x->ack_out_off = 0;
  }
  if (x->send_peer >= 0) {
    sg__comm_frame_t f = {.type = SG__COMM_FRAME_OP,
                          .kind = (uint16_t)(x->op->kind == SG__COMM_KIND_RECV
                                                 ? SG__COMM_KIND_SEND
                                                 : x->op->kind),
                          .flags = x->spull ? SG__COMM_OP_PULL : 0,
                          .seq = c->peers[x->send_peer].tx_seq,
                          .bytes = s_total};
    sg__comm_frame_encode(x->shdr, &f);
  } else {
    x->shdr_off = SG__COMM_FRAME_LEN;
  }
  if (x->recv_peer < 0)
    x->rhdr_off = SG__COMM_FRAME_LEN;
  x->start_ns = sg_now_ns();
  pfd = sg_calloc((size_t)c->world + 1, sizeof(*pfd));
  who = sg_calloc((size_t)c->world + 1, sizeof(*who));
  if (!pfd || !who) {
    rc = fail(x, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (;;) {
    if (atomic_load(&c->stop)) {
      rc = fail(x, sg__comm_stop_code(c), "%s: %s",
                sg__comm_kind_name(x->op->kind), sg__comm_stop_msg(c));
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
    if (x->work) {
      int w = x->work(x);
      if (w < 0) {
        rc = w;
        goto out;
      }
      if (w > 0)
        moved = 1;
    }
    if (sdone && rdone && x->ack_out_off == SG__COMM_FRAME_LEN &&
        x->ack_in_off == SG__COMM_FRAME_LEN)
      break;
    int64_t now = sg_now_ns();
    sg__comm_keepalive(c, x, now);
    if (moved)
      continue;
    /* nothing moved: is a peer we wait on silent past the progress
     * deadline?  The receive stream's peer, the ACK's, and the peer whose
     * socket is full (read for its KEEPALIVEs: it owes us nothing else) */
    int64_t wake_ns = c->ka_next;
    int watch_send =
        blocked && !ack_wait && x->send_peer != x->recv_peer && !x->no_drain;
    int waited[2] = {!rdone ? x->recv_peer : -1,
                     ack_wait || watch_send ? x->send_peer : -1};
    /* its stream is read from the start of the watch, not before */
    if (waited[1] < 0)
      x->watch_since = 0;
    else if (!x->watch_since)
      x->watch_since = now;
    for (int i = 0; i < 2 && c->progress_ns > 0; i++) {
      if (waited[i] < 0)
        continue;
      int64_t heard = c->peers[waited[i]].last_rx;
      if (heard < x->start_ns)
        heard = x->start_ns;
      if (i == 1 && waited[1] != x->recv_peer && heard < x->watch_since)
        heard = x->watch_since;
      if (now - heard >= c->progress_ns) {
        rc = silent_fail(x, waited[i], now - heard);
        goto out;
      }
      if (heard + c->progress_ns < wake_ns)
        wake_ns = heard + c->progress_ns;
    }
    /* wait for the sockets, the wake fd, the deadline, the next KEEPALIVE
     * due or the progress deadline */
    sg_deadline_t d = earliest_deadline(c, x->op->deadline);
    int64_t left = sg_deadline_left_ms(d);
    int64_t wake_ms = (wake_ns - now + 999999) / 1000000;
    if (wake_ms < 1)
      wake_ms = 1;
    if (left == 0) {
      if (!rdone)
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out waiting for rank %d (received %llu of %llu "
                  "bytes)",
                  sg__comm_kind_name(x->op->kind), x->recv_peer,
                  (unsigned long long)x->rcvd, (unsigned long long)r_total);
      else if (sdone && ack_wait)
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out waiting for rank %d to read what it was "
                  "sent",
                  sg__comm_kind_name(x->op->kind), x->send_peer);
      else if (sdone)
        rc = fail(x, SG_ETIMEDOUT, "%s: timed out sending to rank %d",
                  sg__comm_kind_name(x->op->kind), x->recv_peer);
      else
        rc = fail(x, SG_ETIMEDOUT,
                  "%s: timed out sending to rank %d (sent %llu of %llu "
                  "bytes)",
                  sg__comm_kind_name(x->op->kind), x->send_peer,
                  (unsigned long long)x->sent, (unsigned long long)s_total);
      if (d < x->op->deadline)
        snprintf(x->msg, 256,
                 "a queued operation's deadline passed while %s ran",
                 sg__comm_kind_name(x->op->kind));
      goto out;
    }
    int np = 0;
    pfd[np] = (struct pollfd){.fd = c->wake_fd, .events = POLLIN};
    who[np++] = -1;
    for (int p = 0; p < c->world; p++) {
      if (p == c->rank || c->peers[p].fd < 0)
        continue;
      short ev = 0;
      if ((p == x->recv_peer && !rdone) ||
          (p == x->send_peer && (ack_wait || watch_send)))
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
    if (left > wake_ms)
      left = wake_ms;
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
    /* the full socket's peer: its KEEPALIVEs; anything else queued before
     * them (it cannot owe us anything in this transfer) stops the watch,
     * else poll would wake for those bytes forever */
    if (watch_send && n > 0) {
      for (int i = 1; i < np; i++)
        if (who[i] == x->send_peer && (pfd[i].revents & POLLIN)) {
          int k = sg__comm_drain(c, x->send_peer);
          if (k < 0) {
            rc = eof_fail(x, x->send_peer, k);
            goto out;
          }
          if (k == 1)
            x->no_drain = 1;
        }
    }
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
int sg__comm_exchange(sg_comm_t *c, sg__comm_op_t *op, int sp, const void *sbuf,
                      size_t slen, int rp, void *rbuf, size_t rlen, char *msg) {
  sg__comm_seg_t ss = {.p = (uint8_t *)sbuf, .len = slen};
  sg__comm_seg_t rs = {.p = rbuf, .len = rlen};
  sg__comm_xfer_t x = {.c = c,
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
  return sg__comm_xfer_run(&x);
}
