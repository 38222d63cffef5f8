/*
 * blocking.c: a blocking libstepguard call that Ctrl-C can stop.
 *
 * The call runs on a short-lived helper thread while the calling thread
 * waits for it in slices of at most 100 ms with the GIL released, taking
 * the GIL back between slices to run signal handlers.  When a handler
 * raises (KeyboardInterrupt), the call is aborted through its own abort
 * function, still waited for (it ends promptly with SG_EABORTED), and the
 * exception propagates.
 *
 * Only the main thread runs signal handlers, so a call from any other
 * thread (the Manager's quorum executor, for one) has nothing to watch
 * for: it runs right there with the GIL released, without the helper
 * thread, whose creation and scheduling cost milliseconds on a busy host.
 */
#include "module.h"

#include <pthread.h>
#include <time.h>

struct blocking {
  void (*fn)(void *);
  void *arg;
  int done;
  pthread_mutex_t mu;
  pthread_cond_t cv;
};

static void *blocking_thread(void *p) {
  struct blocking *b = p;
  b->fn(b->arg);
  pthread_mutex_lock(&b->mu);
  b->done = 1;
  pthread_cond_signal(&b->cv);
  pthread_mutex_unlock(&b->mu);
  return NULL;
}

int sg_py_blocking(void (*fn)(void *), void (*abort_fn)(void *), void *arg) {
  if (!_PyOS_IsMainThread()) {
    Py_BEGIN_ALLOW_THREADS
    fn(arg);
    Py_END_ALLOW_THREADS
    return 0;
  }
  struct blocking b = {.fn = fn, .arg = arg};
  pthread_t th;
  pthread_mutex_init(&b.mu, NULL);
  pthread_cond_init(&b.cv, NULL);
  if (pthread_create(&th, NULL, blocking_thread, &b) != 0) {
    pthread_mutex_destroy(&b.mu);
    pthread_cond_destroy(&b.cv);
    PyErr_SetString(PyExc_RuntimeError, "cannot start a thread");
    return -1;
  }
  int signalled = 0;
  for (;;) {
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&b.mu);
    if (!b.done) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 100000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&b.cv, &b.mu, &ts);
    }
    done = b.done;
    pthread_mutex_unlock(&b.mu);
    Py_END_ALLOW_THREADS
    if (done)
      break;
    if (!signalled && PyErr_CheckSignals() < 0) {
      signalled = 1; /* keep the exception; wait for the aborted call */
      abort_fn(arg);
    }
  }
  Py_BEGIN_ALLOW_THREADS
  pthread_join(th, NULL);
  Py_END_ALLOW_THREADS
  pthread_mutex_destroy(&b.mu);
  pthread_cond_destroy(&b.cv);
  return signalled ? -1 : 0;
}
