/*
 * test_fork.c: a forked child must not keep libstepguard's connections
 * alive.
 *
 * Scenario (real processes): the test process T listens.  It forks P, the
 * "trainer", which connects to T and then forks C, a "DataLoader worker"
 * that sleeps for a long time.  T SIGKILLs P and watches the accepted
 * connection.  With the fork registry, C dropped its copy of the socket at
 * fork, so T sees EOF as soon as P dies.  The control case opens P's socket
 * with plain socket(SOCK_CLOEXEC) and no registration: there C keeps the
 * connection open and T sees no EOF, which shows the test can tell the two
 * apart.  T is a child subreaper so that it can reap C by pid.
 */
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "stepguard/base.h"

/* connect_raw: a CLOEXEC socket that bypasses the registry (control). */
static int connect_raw(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
    return -1;
  return fd;
}

/* Pids to kill if an assertion fails half-way (cmocka longjmps out). */
static pid_t live_pids[2] = {-1, -1};

static int kill_leftovers(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++) {
    if (live_pids[i] > 0) {
      kill(live_pids[i], SIGKILL);
      waitpid(live_pids[i], NULL, 0);
      live_pids[i] = -1;
    }
  }
  return 0;
}

/*
 * trainer: body of P.  Reports the grandchild's pid on `report`; the
 * grandchild reports what it sees on `worker_report`.
 */
static void trainer(int port, int use_registry, int report, int worker_report) {
  int fd = -1;
  if (use_registry) {
    sg_err_t err;
    if (sg_sock_connect("127.0.0.1", port, sg_deadline_in_ms(10000), &fd,
                        &err) != 0)
      _exit(2);
  } else {
    fd = connect_raw(port);
    if (fd < 0)
      _exit(2);
  }
  unsigned forks_before = sg_sock_fork_count();
  pid_t worker = fork();
  if (worker < 0)
    _exit(3);
  if (worker == 0) {
    /* C: report whether our copy of the descriptor is still a socket */
    struct stat st;
    char kind = (fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) ? 'S' : 'N';
    char ok = sg_sock_fork_count() == forks_before + 1 &&
                      sg_sock_registered_count() == 0
                  ? 'Y'
                  : 'N';
    char msg[2] = {kind, ok};
    if (write(worker_report, msg, 2) != 2)
      _exit(4);
    sleep(120); /* outlives P; T kills us by pid */
    _exit(0);
  }
  if (write(report, &worker, sizeof(worker)) != (ssize_t)sizeof(worker))
    _exit(5);
  for (;;)
    pause();
}

static int read_full(int fd, void *p, size_t n) {
  size_t off = 0;
  while (off < n) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (poll(&pfd, 1, 10000) <= 0)
      return -1;
    ssize_t r = read(fd, (char *)p + off, n - off);
    if (r <= 0)
      return -1;
    off += (size_t)r;
  }
  return 0;
}

/* wait_eof: 1 if `fd` reads EOF (or reset) within `ms`, 0 if not. */
static int wait_eof(int fd, int ms) {
  sg_deadline_t d = sg_deadline_in_ms(ms);
  while (!sg_deadline_passed(d)) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int n = poll(&pfd, 1, (int)sg_deadline_left_ms(d));
    if (n > 0) {
      char c;
      ssize_t r = read(fd, &c, 1);
      if (r <= 0)
        return 1;
    }
  }
  return 0;
}

struct outcome {
  int eof_after_kill;  /* EOF seen within the window after P's SIGKILL */
  char child_fd_kind;  /* 'S' socket or 'N' not, as C saw its copy */
  char child_registry; /* 'Y' if C saw one more fork and an empty registry */
};

static struct outcome run_scenario(int use_registry, int window_ms) {
  struct outcome out = {0, '?', '?'};
  sg_err_t err;
  int lfd = -1, port = 0, afd = -1, pipefd[2], wpipe[2];
  assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  assert_int_equal(sg_sock_listen("127.0.0.1", 0, 4, &lfd, &port, &err), 0);
  assert_int_equal(pipe(pipefd), 0);
  assert_int_equal(pipe(wpipe), 0);

  pid_t p = fork();
  assert_true(p >= 0);
  if (p == 0) {
    close(pipefd[0]);
    close(wpipe[0]);
    trainer(port, use_registry, pipefd[1], wpipe[1]);
  }
  live_pids[0] = p;
  close(pipefd[1]);
  close(wpipe[1]);

  char child_msg[2];
  pid_t worker = -1;
  assert_int_equal(read_full(pipefd[0], &worker, sizeof(worker)), 0);
  live_pids[1] = worker;
  assert_int_equal(read_full(wpipe[0], child_msg, 2), 0);
  out.child_fd_kind = child_msg[0];
  out.child_registry = child_msg[1];

  sg_deadline_t d = sg_deadline_in_ms(10000);
  int rc;
  while ((rc = sg_sock_accept(lfd, &afd)) == SG_EAGAIN &&
         !sg_deadline_passed(d))
    usleep(1000);
  assert_int_equal(rc, 0);

  assert_int_equal(kill(p, SIGKILL), 0);
  assert_int_equal(waitpid(p, NULL, 0), p);
  live_pids[0] = -1;
  out.eof_after_kill = wait_eof(afd, window_ms);

  /* clean up the worker by pid; in the control case the connection only
   * closes now */
  assert_int_equal(kill(worker, SIGKILL), 0);
  assert_int_equal(waitpid(worker, NULL, 0), worker);
  live_pids[1] = -1;
  if (!use_registry)
    assert_true(wait_eof(afd, 10000));
  close(pipefd[0]);
  close(wpipe[0]);
  sg_sock_close(afd);
  sg_sock_close(lfd);
  return out;
}

static void test_forked_child_does_not_hold_connection(void **state) {
  (void)state;
  /* generous window: sanitizer builds are slow, the property is binary */
  struct outcome o = run_scenario(1, 10000);
  assert_int_equal(o.child_fd_kind, 'N');
  assert_int_equal(o.child_registry, 'Y');
  assert_true(o.eof_after_kill);
}

static void test_control_unregistered_socket_is_held_by_child(void **state) {
  (void)state;
  struct outcome o = run_scenario(0, 500);
  assert_int_equal(o.child_fd_kind, 'S');
  assert_false(o.eof_after_kill);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_forked_child_does_not_hold_connection,
                                kill_leftovers),
      cmocka_unit_test_teardown(
          test_control_unregistered_socket_is_held_by_child, kill_leftovers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
