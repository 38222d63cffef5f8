/*
 * log.c: leveled logging with one replaceable sink.
 *
 * The level is an atomic read on every call, so a disabled sg_log() costs a
 * load and a compare.  The sink pointer pair is swapped under a mutex and
 * read under it, so a sink being replaced is never called after
 * sg_log_set_sink() returns.  The default sink formats the whole line first
 * and emits it with one write(2), so lines from different threads do not
 * interleave.
 *
 * The default sink never blocks: stderr is often a pipe, and a reader that
 * stops reading (a launcher that captured the output and never drains it, a
 * stalled log shipper) would otherwise stop the thread that logs, a server's
 * event loop among them, once the pipe is full.  A line that stderr cannot
 * take at once is dropped and counted; the next line that gets through is
 * preceded by how many were lost.  A pipe or socket is written with
 * RWF_NOWAIT (a per-call O_NONBLOCK: setting the flag on the descriptor
 * would change it for everyone else who writes to stderr).
 *
 * Fork: a thread other than the forking one may hold the sink mutex at
 * fork() (a manager's heartbeat line, say); the child, which has only the
 * forking thread, would then block forever on its first line.  Handlers
 * registered once take the mutex before fork() and release it on both
 * sides, so the child always starts with it free.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "stepguard/base.h"

static atomic_int log_level = -1; /* -1 = not yet read from the environment */
static pthread_mutex_t sink_mu = PTHREAD_MUTEX_INITIALIZER;
static sg_log_cb sink_cb;
static void *sink_ud;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static unsigned long long dropped; /* lines stderr could not take (sink_mu) */

static const char *const level_names[] = {"ERROR", "WARN", "INFO", "DEBUG",
                                          "TRACE"};

int sg_log_level_parse(const char *s) {
  static const char *const words[] = {"error", "warn", "info", "debug",
                                      "trace"};
  if (!s)
    return -1;
  for (int i = 0; i < 5; i++)
    if (strcasecmp(s, words[i]) == 0)
      return i;
  if (strcasecmp(s, "warning") == 0)
    return SG_LOG_WARN;
  return -1;
}

static int level_from_env(void) {
  int lv = sg_log_level_parse(getenv("STEPGUARD_LOG"));
  if (lv < 0)
    lv = sg_log_level_parse(getenv("RUST_LOG"));
  return lv < 0 ? SG_LOG_INFO : lv;
}

static int current_level(void) {
  int lv = atomic_load_explicit(&log_level, memory_order_relaxed);
  if (lv < 0) {
    int expected = -1;
    lv = level_from_env();
    if (!atomic_compare_exchange_strong(&log_level, &expected, lv))
      lv = expected;
  }
  return lv;
}

int sg_log_enabled(sg_log_level_t level) {
  return (int)level <= current_level();
}

void sg_log_set_level(sg_log_level_t level) { atomic_store(&log_level, level); }

static void sink_lock(void) { pthread_mutex_lock(&sink_mu); }

static void sink_unlock(void) { pthread_mutex_unlock(&sink_mu); }

static void atfork_init(void) {
  pthread_atfork(sink_lock, sink_unlock, sink_unlock);
}

/* Every path that takes the mutex registers the handlers first. */
static void sink_enter(void) {
  pthread_once(&atfork_once, atfork_init);
  sink_lock();
}

void sg_log_set_sink(sg_log_cb cb, void *ud) {
  sink_enter();
  sink_cb = cb;
  sink_ud = ud;
  pthread_mutex_unlock(&sink_mu);
}

/*
 * stderr_put: write all of `p` to stderr if it can take it without
 * blocking, else nothing (-1).  A pipe or socket is written with
 * RWF_NOWAIT: it takes what fits at once or refuses (a write of up to
 * PIPE_BUF bytes to a pipe is all or nothing, so a line is never cut
 * there), whoever else writes to it.  Where the kernel does not honour
 * RWF_NOWAIT on it, a poll for POLLOUT comes first instead: a pipe that
 * polls writable has a free page, but one whose last page has room polls
 * full, so a line that would fit can be dropped.  A file or terminal
 * always polls writable.  A socket may take part of a line and then
 * refuse the rest: the line is cut there (-1).
 */
static int stderr_put(const char *p, size_t n) {
  struct stat st;
  int nowait = fstat(STDERR_FILENO, &st) == 0 &&
               (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
  size_t off = 0;
  while (off < n) {
    ssize_t w;
    if (nowait) {
      struct iovec v = {(void *)(p + off), n - off};
      w = pwritev2(STDERR_FILENO, &v, 1, -1, RWF_NOWAIT);
      if (w < 0 &&
          (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS)) {
        nowait = 0; /* an older kernel: poll first */
        continue;
      }
    } else {
      struct pollfd pfd = {.fd = STDERR_FILENO, .events = POLLOUT};
      int r = poll(&pfd, 1, 0);
      if (r < 0 && errno == EINTR)
        continue;
      if (r <= 0 || !(pfd.revents & POLLOUT))
        return -1;
      w = write(STDERR_FILENO, p + off, n - off);
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1; /* full, or nowhere to report a failing stderr */
    off += (size_t)w;
  }
  return 0;
}

static void stderr_sink(sg_log_level_t level, const char *subsystem,
                        const char *msg) {
  char line[1400]; /* under PIPE_BUF: one write, all or nothing on a pipe */
  int n = 0;
  if (dropped > 0)
    n = snprintf(line, sizeof(line),
                 "[stepguard] %llu log line(s) dropped: stderr was full\n",
                 dropped);
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  int m = snprintf(line + n, sizeof(line) - (size_t)n,
                   "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ [%s] [stepguard::%s] "
                   "- %s\n",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                   tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                   level_names[level], subsystem, msg);
  if (m < 0)
    return;
  n += m;
  if ((size_t)n >= sizeof(line)) { /* truncated: keep the newline */
    n = sizeof(line) - 1;
    line[n - 1] = '\n';
  }
  if (stderr_put(line, (size_t)n) == 0)
    dropped = 0;
  else
    dropped++;
}

void sg_logv(sg_log_level_t level, const char *subsystem, const char *fmt,
             va_list ap) {
  if (level > SG_LOG_TRACE || !sg_log_enabled(level))
    return;
  char msg[1024];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  sink_enter();
  if (sink_cb)
    sink_cb(sink_ud, level, subsystem, msg);
  else
    stderr_sink(level, subsystem, msg);
  pthread_mutex_unlock(&sink_mu);
}

void sg_log(sg_log_level_t level, const char *subsystem, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sg_logv(level, subsystem, fmt, ap);
  va_end(ap);
}
