/*
 * module.h: what the files of stepguard._C share.
 */
#ifndef SG_PY_MODULE_H
#define SG_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sys/types.h>

#include "stepguard/base.h"

typedef struct {
  PyObject *error_type;      /* stepguard._C.Error */
  PyObject *lh_server_type;  /* stepguard._C.LighthouseServer */
  PyObject *lh_client_type;  /* stepguard._C.LighthouseClient */
  PyObject *mgr_server_type; /* stepguard._C.ManagerServer */
  PyObject *mgr_client_type; /* stepguard._C.ManagerClient */
  PyObject *comm_types[4];   /* comm.c's types */
  PyObject *ckpt_types[4];   /* ckpt.c's types */
} sg_py_state;

/*
 * sg_py_gil_enter / sg_py_gil_leave: PyGILState_Ensure / _Release for a
 * libstepguard thread that calls into Python (a communicator's progress
 * thread).  On a thread Python does not know, the first call gives it a
 * thread state that stays from one call to the next and is freed when the
 * thread exits: PyGILState_Ensure alone builds one and frees it every call
 * (with an mmap and a munmap of its frame stack).
 */
PyGILState_STATE sg_py_gil_enter(void);
void sg_py_gil_leave(PyGILState_STATE g);

/* sg_py_state_of: the module state reached from a heap type's instance. */
sg_py_state *sg_py_state_of_type(PyTypeObject *tp);

/*
 * sg_py_raise: set the Python exception for libstepguard error `code` with
 * `detail`; returns NULL.  SG_ETIMEDOUT -> TimeoutError, SG_ENOMEM ->
 * MemoryError, others -> stepguard._C.Error (a RuntimeError) with .code.
 * Call with the GIL held.
 */
PyObject *sg_py_raise(sg_py_state *st, int code, const char *detail);

/*
 * sg_py_raise_rpc: sg_py_raise for a lighthouse or manager call.  A missed
 * deadline reads as torchft's does (its clients report the gRPC status:
 * 'status: Cancelled, message: "Timeout expired", ...'), followed by
 * stepguard's detail, so code matching torchft's message keeps working.
 */
PyObject *sg_py_raise_rpc(sg_py_state *st, int code, const char *detail);

/* sg_py_timeout_ms: seconds (float) to whole ms; -1 with ValueError set. */
int64_t sg_py_timeout_ms(double seconds);

/*
 * A task: fn(arg) run on a persistent worker thread (see blocking.c).  The
 * owner keeps it in place (it may be embedded in an object) from
 * sg_py_task_start until sg_py_task_wait returns.
 */
typedef struct sg_py_task_s sg_py_task_t;
struct sg_py_task_s {
  void (*fn)(void *);
  void *arg;
  sg_py_task_t *next; /* the pool's queue */
  pthread_mutex_t mu; /* guards done */
  pthread_cond_t cv;  /* signalled once done is set */
  int done;           /* fn has returned */
  pid_t pid;          /* the process whose worker runs it */
};

/*
 * sg_py_task_start: start fn(arg) on a worker thread without the GIL and
 * return at once.  Call with the GIL held.  0, or -1 with an exception set
 * (no thread could be had; fn will not run).  After 0, sg_py_task_wait
 * must be called exactly once.
 */
int sg_py_task_start(sg_py_task_t *t, void (*fn)(void *), void *arg);

/* sg_py_task_done: nonzero once fn has returned (never blocks long). */
int sg_py_task_done(sg_py_task_t *t);

/*
 * sg_py_task_wait: wait for the task with the GIL released, then release
 * what sg_py_task_start took.  On the main thread, signal handlers run
 * every 100 ms; when one raises, abort_fn(arg) (may be NULL) is called
 * once without the GIL, the task is still waited for, and -1 is returned
 * with the exception set.  Otherwise 0.  A task started before fork()
 * cannot finish in the child: there it fails at once (-1, RuntimeError).
 * Call with the GIL held; fn must return promptly after abort_fn.
 */
int sg_py_task_wait(sg_py_task_t *t, void (*abort_fn)(void *), void *arg);

/*
 * sg_py_task_join: sg_py_task_wait without running signal handlers, for
 * a task already aborted (a deallocator).  GIL held (released while
 * waiting).
 */
void sg_py_task_join(sg_py_task_t *t);

/*
 * sg_py_blocking: run fn(arg) so that Ctrl-C can stop it (see blocking.c).
 * Call with the GIL held; fn runs without it, on a worker thread when
 * called from the main thread (which keeps running signal handlers), in
 * place otherwise.  On a signal whose handler raises, abort_fn(arg) is
 * called once (from this thread, without the GIL) and -1 is returned with
 * the exception set after fn has returned; -1 with an exception also when
 * no worker could be had; otherwise 0.  fn must return promptly after
 * abort_fn.
 */
int sg_py_blocking(void (*fn)(void *), void (*abort_fn)(void *), void *arg);

/* sg_py_lighthouse_init: add LighthouseServer and LighthouseClient. */
int sg_py_lighthouse_init(PyObject *module, sg_py_state *st);

/* sg_py_manager_init: add ManagerServer and ManagerClient. */
int sg_py_manager_init(PyObject *module, sg_py_state *st);

/* sg_py_comm_init: add the collectives' types (comm.c). */
int sg_py_comm_init(PyObject *module, sg_py_state *st);

/* The quantization kernels as module functions (comm.c). */
PyObject *sg_py_quant_wire_bytes(PyObject *mod, PyObject *arg);
PyObject *sg_py_quant_encode(PyObject *mod, PyObject *args);
PyObject *sg_py_quant_decode(PyObject *mod, PyObject *args);
PyObject *sg_py_fp8_from_f32(PyObject *mod, PyObject *args);
PyObject *sg_py_fp8_to_f32(PyObject *mod, PyObject *args);

/* sg_py_ckpt_init: add the checkpoint server and fetch (ckpt.c). */
int sg_py_ckpt_init(PyObject *module, sg_py_state *st);

#endif
