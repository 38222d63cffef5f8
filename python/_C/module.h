/*
 * module.h: what the files of stepguard._C share.
 */
#ifndef SG_PY_MODULE_H
#define SG_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "stepguard/base.h"

typedef struct {
  PyObject *error_type;      /* stepguard._C.Error */
  PyObject *lh_server_type;  /* stepguard._C.LighthouseServer */
  PyObject *lh_client_type;  /* stepguard._C.LighthouseClient */
  PyObject *mgr_server_type; /* stepguard._C.ManagerServer */
  PyObject *mgr_client_type; /* stepguard._C.ManagerClient */
  PyObject *comm_types[4];   /* comm.c's types (SG_PY_HAVE_COMM) */
  PyObject *ckpt_types[4];   /* ckpt.c's types (SG_PY_HAVE_CKPT) */
} sg_py_state;

/* sg_py_state_of: the module state reached from a heap type's instance. */
sg_py_state *sg_py_state_of_type(PyTypeObject *tp);

/*
 * sg_py_raise: set the Python exception for libstepguard error `code` with
 * `detail`; returns NULL.  SG_ETIMEDOUT -> TimeoutError, SG_ENOMEM ->
 * MemoryError, others -> stepguard._C.Error (a RuntimeError) with .code.
 * Call with the GIL held.
 */
PyObject *sg_py_raise(sg_py_state *st, int code, const char *detail);

/* sg_py_timeout_ms: seconds (float) to whole ms; -1 with ValueError set. */
int64_t sg_py_timeout_ms(double seconds);

/*
 * sg_py_blocking: run fn(arg) so that Ctrl-C can stop it (see blocking.c).
 * Call with the GIL held; fn runs without it on another thread.  On a
 * signal whose handler raises, abort_fn(arg) is called once (from this
 * thread, without the GIL) and -1 is returned with the exception set after
 * fn has returned; otherwise 0.  fn must return promptly after abort_fn.
 */
int sg_py_blocking(void (*fn)(void *), void (*abort_fn)(void *), void *arg);

/* sg_py_lighthouse_init: add LighthouseServer and LighthouseClient. */
int sg_py_lighthouse_init(PyObject *module, sg_py_state *st);

/* sg_py_manager_init: add ManagerServer and ManagerClient. */
int sg_py_manager_init(PyObject *module, sg_py_state *st);

/* sg_py_comm_init: add the collectives' types (comm.c, when built). */
int sg_py_comm_init(PyObject *module, sg_py_state *st);

/* sg_py_ckpt_init: add the checkpoint server and fetch (ckpt.c, when built). */
int sg_py_ckpt_init(PyObject *module, sg_py_state *st);

#endif
