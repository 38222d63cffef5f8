/*
 * blocking.c: blocking libstepguard calls that Ctrl-C can stop, and calls
 * that run in the background while Python goes on.
 *
 * A task runs on a worker thread of a pool kept in the interpreter's
 * state dict (one pool per interpreter, made on first use).  Workers are
 * persistent: a call hands its task to an idle worker, so starting one
 * costs a mutex and a wakeup instead of creating and joining a thread
 * (milliseconds on a busy host, once per step for the commit vote).  A
 * task never queues behind a running one: when every worker is busy, a
 * new one is started.  A worker idle for WORKER_IDLE_NS exits.
 *
 * sg_py_task_wait waits for a task with the GIL released.  On the main
 * thread it wakes every SLICE_NS to run signal handlers; when one raises
 * (KeyboardInterrupt) the task is aborted through its own abort function,
 * still waited for (it ends promptly with SG_EABORTED) and the exception
 * propagates.  Only the main thread runs signal handlers, so a blocking
 * call from any other thread (a Manager on a thread of its own) runs right
 * there, without a worker.
 *
 * Fork: workers do not survive fork().  A pool remembers the pid that made
 * it; a child finds a pool that is not its own, drops it (no thread of the
 * child uses it) and makes a new one on first use.
 *
 * Workers block every signal, so the process's signals reach the threads
 * that run Python.
 */
#include "module.h"

#include <errno.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#define POOL_KEY "stepguard._C.task_pool"
#define SLICE_NS 100000000LL         /* main thread: signal checks */
#define OTHER_SLICE_NS 1000000000LL  /* other threads: re-check period */
#define WORKER_IDLE_NS 30000000000LL /* an idle worker exits after this */
#define MAX_WORKERS 256              /* beyond this a start fails */

struct pool {
  pid_t pid;          /* the process whose threads these are */
  pthread_mutex_t mu; /* guards everything below */
  pthread_cond_t cv;  /* idle workers wait here for a task */
  sg_py_task_t *head; /* queued tasks, oldest first */
  sg_py_task_t *tail;
  size_t queued;  /* tasks in the queue */
  size_t idle;    /* workers waiting on cv */
  size_t workers; /* running worker threads */
  int refs;       /* the capsule's plus one per worker */
  int stop;       /* the interpreter is going: workers exit */
};

/* abs_in: CLOCK_MONOTONIC now + ns, for a monotonic condition variable. */
static struct timespec abs_in(int64_t ns) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t t = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + ns;
  ts.tv_sec = (time_t)(t / 1000000000LL);
  ts.tv_nsec = (long)(t % 1000000000LL);
  return ts;
}

/* cond_init_mono: a condition variable whose timed waits use
 * CLOCK_MONOTONIC.  0 or an errno value. */
static int cond_init_mono(pthread_cond_t *cv) {
  pthread_condattr_t a;
  int rc = pthread_condattr_init(&a);
  if (rc)
    return rc;
  rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  if (!rc)
    rc = pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
  return rc;
}

static void pool_free(struct pool *p) {
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  sg_free(p);
}

/* pool_unref: drop one reference, with p->mu held (released here). */
static void pool_unref_unlock(struct pool *p) {
  int last = --p->refs == 0;
  pthread_mutex_unlock(&p->mu);
  if (last)
    pool_free(p);
}

static void task_finish(sg_py_task_t *t) {
  pthread_mutex_lock(&t->mu);
  t->done = 1;
  pthread_cond_signal(&t->cv);
  /* the owner may free t as soon as this unlock is done */
  pthread_mutex_unlock(&t->mu);
}

/*
 * worker: runs queued tasks until the pool stops or it has been idle for
 * WORKER_IDLE_NS.  Owns one reference to the pool.
 */
static void *worker(void *arg) {
  struct pool *p = arg;
  sg_thread_name("sg-blocking");
  pthread_mutex_lock(&p->mu);
  p->idle++;
  for (;;) {
    struct timespec until = abs_in(WORKER_IDLE_NS);
    int rc = 0;
    while (!p->head && !p->stop && rc != ETIMEDOUT)
      rc = pthread_cond_timedwait(&p->cv, &p->mu, &until);
    sg_py_task_t *t = p->head;
    if (!t)
      break; /* stopping, or idle too long */
    p->head = t->next;
    if (!p->head)
      p->tail = NULL;
    p->queued--;
    p->idle--;
    pthread_mutex_unlock(&p->mu);
    t->fn(t->arg);
    pthread_mutex_lock(&p->mu);
    /* idle again before the owner hears of it, so that the owner's next
       task finds this worker instead of starting another */
    p->idle++;
    task_finish(t);
  }
  p->idle--;
  p->workers--;
  pool_unref_unlock(p);
  return NULL;
}

/* spawn: start one more worker, with p->mu held.  0 or an errno value. */
static int spawn(struct pool *p) {
  if (p->workers >= MAX_WORKERS)
    return EAGAIN;
  pthread_attr_t attr;
  int rc = pthread_attr_init(&attr);
  if (rc)
    return rc;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* the worker inherits it */
  pthread_t th;
  rc = pthread_create(&th, &attr, worker, p);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (!rc) {
    p->workers++;
    p->refs++;
  }
  return rc;
}

/* The capsule's destructor: the interpreter is going (or a forked child
 * dropped its parent's pool). */
static void pool_capsule_free(PyObject *cap) {
  struct pool *p = PyCapsule_GetPointer(cap, POOL_KEY);
  if (!p)
    return;
  if (p->pid != getpid()) {
    /* inherited through fork: its workers do not exist here, and its lock
       may have been held by one of them; only the memory is ours */
    sg_free(p);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  /* workers still running a task finish it and free the pool last */
  pool_unref_unlock(p);
}

static struct pool *pool_new(void) {
  struct pool *p = sg_calloc(1, sizeof(*p));
  if (!p)
    return NULL;
  if (pthread_mutex_init(&p->mu, NULL) != 0) {
    sg_free(p);
    return NULL;
  }
  if (cond_init_mono(&p->cv) != 0) {
    pthread_mutex_destroy(&p->mu);
    sg_free(p);
    return NULL;
  }
  p->pid = getpid();
  p->refs = 1;
  return p;
}

/* get_pool: this interpreter's pool, made on first use (and again in a
 * forked child).  GIL held; NULL with an exception set. */
static struct pool *get_pool(void) {
  PyObject *dict = PyInterpreterState_GetDict(PyInterpreterState_Get());
  if (!dict) {
    PyErr_SetString(PyExc_RuntimeError, "no interpreter state dict");
    return NULL;
  }
  PyObject *cap = PyDict_GetItemString(dict, POOL_KEY); /* borrowed */
  if (cap) {
    struct pool *p = PyCapsule_GetPointer(cap, POOL_KEY);
    if (p && p->pid == getpid())
      return p;
    PyErr_Clear();
  }
  struct pool *p = pool_new();
  if (!p) {
    PyErr_NoMemory();
    return NULL;
  }
  cap = PyCapsule_New(p, POOL_KEY, pool_capsule_free);
  if (!cap) {
    pool_free(p);
    return NULL;
  }
  /* replaces (and so frees) a pool inherited from the parent */
  int rc = PyDict_SetItemString(dict, POOL_KEY, cap);
  Py_DECREF(cap);
  return rc < 0 ? NULL : p;
}

int sg_py_task_start(sg_py_task_t *t, void (*fn)(void *), void *arg) {
  struct pool *p = get_pool();
  if (!p)
    return -1;
  t->fn = fn;
  t->arg = arg;
  t->next = NULL;
  t->done = 0;
  t->pid = p->pid;
  if (pthread_mutex_init(&t->mu, NULL) != 0) {
    PyErr_SetString(PyExc_RuntimeError, "cannot make a mutex");
    return -1;
  }
  if (cond_init_mono(&t->cv) != 0) {
    pthread_mutex_destroy(&t->mu);
    PyErr_SetString(PyExc_RuntimeError, "cannot make a condition variable");
    return -1;
  }
  pthread_mutex_lock(&p->mu);
  if (p->tail)
    p->tail->next = t;
  else
    p->head = t;
  p->tail = t;
  p->queued++;
  int rc = 0;
  /* every queued task needs a worker of its own: tasks block */
  if (p->queued > p->idle)
    rc = spawn(p);
  else
    pthread_cond_signal(&p->cv);
  if (rc) {
    /* take it back: no worker will come for it (the tail is t) */
    sg_py_task_t **pp = &p->head, *prev = NULL;
    while (*pp != t) {
      prev = *pp;
      pp = &(*pp)->next;
    }
    *pp = NULL;
    p->tail = prev;
    p->queued--;
  }
  pthread_mutex_unlock(&p->mu);
  if (rc) {
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    PyErr_SetString(PyExc_RuntimeError, "cannot start a thread");
    return -1;
  }
  return 0;
}

int sg_py_task_done(sg_py_task_t *t) {
  if (t->pid != getpid())
    return 1; /* started before fork(): it will never end here */
  pthread_mutex_lock(&t->mu);
  int done = t->done;
  pthread_mutex_unlock(&t->mu);
  return done;
}

int sg_py_task_wait(sg_py_task_t *t, void (*abort_fn)(void *), void *arg) {
  if (t->pid != getpid()) {
    /* its worker stayed in the parent; its lock may be held there */
    PyErr_SetString(PyExc_RuntimeError,
                    "the call was started before fork() and cannot finish "
                    "in the child");
    return -1;
  }
  int on_main = _PyOS_IsMainThread();
  int signalled = 0;
  for (;;) {
    int done;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&t->mu);
    /* off the main thread there are no handlers to run: wait in long
       slices without taking the GIL back */
    do {
      if (!t->done) {
        struct timespec until = abs_in(on_main ? SLICE_NS : OTHER_SLICE_NS);
        pthread_cond_timedwait(&t->cv, &t->mu, &until);
      }
    } while (!on_main && !t->done);
    done = t->done;
    pthread_mutex_unlock(&t->mu);
    Py_END_ALLOW_THREADS
    if (done)
      break;
    if (!signalled && PyErr_CheckSignals() < 0) {
      signalled = 1; /* keep the exception; wait for the aborted task */
      if (abort_fn) {
        Py_BEGIN_ALLOW_THREADS
        abort_fn(arg);
        Py_END_ALLOW_THREADS
      }
    }
  }
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  return signalled ? -1 : 0;
}

void sg_py_task_join(sg_py_task_t *t) {
  if (t->pid != getpid())
    return; /* started before fork(): nothing runs it here */
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&t->mu);
  while (!t->done) {
    struct timespec until = abs_in(OTHER_SLICE_NS);
    pthread_cond_timedwait(&t->cv, &t->mu, &until);
  }
  pthread_mutex_unlock(&t->mu);
  Py_END_ALLOW_THREADS
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
}

int sg_py_blocking(void (*fn)(void *), void (*abort_fn)(void *), void *arg) {
  if (!_PyOS_IsMainThread()) {
    Py_BEGIN_ALLOW_THREADS
    fn(arg);
    Py_END_ALLOW_THREADS
    return 0;
  }
  sg_py_task_t t;
  if (sg_py_task_start(&t, fn, arg) < 0)
    return -1;
  return sg_py_task_wait(&t, abort_fn, arg);
}
