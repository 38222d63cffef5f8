/*
 * sock.c: TCP helpers that open every socket SOCK_CLOEXEC | SOCK_NONBLOCK,
 * and the registry that makes libstepguard's sockets vanish in forked
 * children.
 *
 * Why: a trainer forks DataLoader workers.  A worker that inherits the
 * trainer's lighthouse or collective sockets keeps them open after the
 * trainer dies, so its peers never see the connection close and must wait
 * for a heartbeat timeout.  CLOEXEC covers exec(); fork() without exec is
 * covered by the atfork child handler below, which dup2()s /dev/null over
 * every registered descriptor.  The descriptor number stays taken so that a
 * close() that the child's copy of an object may still do is harmless.
 *
 * The registry is a growable array under one mutex.  The prepare handler
 * takes the mutex so the child sees a consistent array; the parent handler
 * releases it; the child handler rewrites the descriptors, empties the
 * array and releases the mutex.  Only async-signal-safe calls (open,
 * dup2, close) run in the child.
 */
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "stepguard/base.h"

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;
static int *reg_fds;
static size_t reg_len, reg_cap;
static atomic_uint fork_count;

static void atfork_prepare(void) { pthread_mutex_lock(&reg_mu); }

static void atfork_parent(void) { pthread_mutex_unlock(&reg_mu); }

static void atfork_child(void) {
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  for (size_t i = 0; i < reg_len; i++) {
    if (null_fd >= 0)
      dup2(null_fd, reg_fds[i]); /* drops the child's socket reference */
    else
      close(reg_fds[i]);
  }
  if (null_fd >= 0)
    close(null_fd);
  reg_len = 0;
  atomic_fetch_add(&fork_count, 1);
  pthread_mutex_unlock(&reg_mu); /* taken by this thread in atfork_prepare */
}

static void reg_init(void) {
  pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

int sg_sock_register(int fd) {
  if (fd < 0)
    return SG_EINVAL;
  pthread_once(&reg_once, reg_init);
  int flags = fcntl(fd, F_GETFD);
  if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0)
    return SG_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&reg_mu);
  for (size_t i = 0; i < reg_len; i++)
    if (reg_fds[i] == fd)
      goto out; /* already registered */
  if (reg_len == reg_cap) {
    size_t cap = reg_cap ? reg_cap * 2 : 64;
    int *p = sg_realloc(reg_fds, cap * sizeof(*p));
    if (!p) {
      rc = SG_ENOMEM;
      goto out;
    }
    reg_fds = p;
    reg_cap = cap;
  }
  reg_fds[reg_len++] = fd;
out:
  pthread_mutex_unlock(&reg_mu);
  return rc;
}

int sg_sock_unregister(int fd) {
  int rc = SG_EINVAL;
  pthread_mutex_lock(&reg_mu);
  for (size_t i = 0; i < reg_len; i++) {
    if (reg_fds[i] == fd) {
      reg_fds[i] = reg_fds[--reg_len];
      rc = 0;
      break;
    }
  }
  pthread_mutex_unlock(&reg_mu);
  return rc;
}

size_t sg_sock_registered_count(void) {
  pthread_mutex_lock(&reg_mu);
  size_t n = reg_len;
  pthread_mutex_unlock(&reg_mu);
  return n;
}

unsigned sg_sock_fork_count(void) { return atomic_load(&fork_count); }

void sg_sock_close(int fd) {
  if (fd < 0)
    return;
  sg_sock_unregister(fd);
  close(fd);
}

/* new_socket: a registered CLOEXEC, non-blocking socket, or -errno. */
static int new_socket(int family) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return -errno;
  int rc = sg_sock_register(fd);
  if (rc) {
    close(fd);
    return rc;
  }
  return fd;
}

static int resolve(const char *host, int port, int passive,
                   struct addrinfo **res, sg_err_t *err) {
  char service[16];
  struct addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  if (port < 0 || port > 65535)
    return sg_err_set(err, SG_EINVAL, "port %d out of range", port);
  snprintf(service, sizeof(service), "%d", port);
  if (host && host[0] == '\0')
    host = NULL;
  int gai = getaddrinfo(host, service, &hints, res);
  if (gai != 0)
    return sg_err_set(err, SG_ENOTFOUND, "resolve %s: %s", host ? host : "*",
                      gai_strerror(gai));
  return 0;
}

int sg_sock_listen(const char *host, int port, int backlog, int *fd_out,
                   int *bound_port, sg_err_t *err) {
  struct addrinfo *res = NULL, *ai;
  int fd = -1;
  int rc = resolve(host, port, 1, &res, err);
  if (rc)
    return rc;
  /* Prefer IPv6 (dual-stack) for the wildcard address, like [::]. */
  rc = SG_ENOTFOUND;
  for (int pass = 0; pass < 2 && fd < 0; pass++) {
    for (ai = res; ai; ai = ai->ai_next) {
      if ((pass == 0) != (ai->ai_family == AF_INET6))
        continue;
      fd = new_socket(ai->ai_family);
      if (fd < 0) {
        rc = fd;
        continue;
      }
      int one = 1, zero = 0;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (ai->ai_family == AF_INET6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
          listen(fd, backlog > 0 ? backlog : 128) == 0)
        break;
      rc = -errno;
      sg_sock_close(fd);
      fd = -1;
    }
  }
  if (fd < 0) {
    sg_err_set(err, rc, "listen on %s:%d: %s", host ? host : "*", port,
               sg_strerror(rc));
    goto out;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
    rc = sg_err_set(err, -errno, "getsockname: %s", strerror(errno));
    sg_sock_close(fd);
    goto out;
  }
  if (bound_port)
    *bound_port = ss.ss_family == AF_INET6
                      ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                      : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  *fd_out = fd;
  rc = 0;
out:
  freeaddrinfo(res);
  return rc;
}

/* connect_one: non-blocking connect bounded by `deadline`; 0 or -errno. */
static int connect_one(int fd, const struct addrinfo *ai,
                       sg_deadline_t deadline) {
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
    return 0;
  if (errno != EINPROGRESS)
    return -errno;
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int64_t left = sg_deadline_left_ms(deadline);
    if (left == 0)
      return SG_ETIMEDOUT;
    int n = poll(&p, 1, left > 1000 ? 1000 : (int)left);
    if (n < 0 && errno != EINTR)
      return -errno;
    if (n > 0) {
      int soerr = 0;
      socklen_t sl = sizeof(soerr);
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
        return -errno;
      return -soerr;
    }
  }
}

int sg_sock_connect(const char *host, int port, sg_deadline_t deadline,
                    int *fd_out, sg_err_t *err) {
  struct addrinfo *res = NULL;
  int rc = resolve(host, port, 0, &res, err);
  if (rc)
    return rc;
  rc = SG_ENOTFOUND;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = new_socket(ai->ai_family);
    if (fd < 0) {
      rc = fd;
      continue;
    }
    rc = connect_one(fd, ai, deadline);
    if (rc == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      *fd_out = fd;
      break;
    }
    sg_sock_close(fd);
    if (rc == SG_ETIMEDOUT)
      break;
  }
  freeaddrinfo(res);
  if (rc)
    sg_err_set(err, rc, "connect to %s:%d: %s", host, port, sg_strerror(rc));
  return rc;
}

int sg_sock_accept(int listen_fd, int *fd_out) {
  int fd;
  do
    fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
  while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return -errno;
  int rc = sg_sock_register(fd);
  if (rc) {
    close(fd);
    return rc;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  *fd_out = fd;
  return 0;
}
