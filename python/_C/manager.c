/*
 * manager.c: stepguard._C.ManagerServer and ManagerClient, heap types over
 * sg_mgr_server_t and sg_mgr_client_t.
 *
 * As in lighthouse.c: every method checks that the object is open, waits
 * without the GIL, and raises only once the GIL is back; client calls go
 * through sg_py_blocking so Ctrl-C stops them (the client is aborted then).
 * The Kill handler runs on the server's thread: it takes the GIL and calls
 * the Python callable given at construction (the package's default logs and
 * ends the process).
 *
 * Quorum and ShouldCommit take one road: the library's started call
 * (sg_mgr_call_t), which the C client sends over its connection or, for a
 * ManagerClient made with server=<the ManagerServer of this process>,
 * in-process (the choice is the library's: sg_mgr_client_use_server).  The
 * caller waits for it without the GIL, in slices on the main thread so
 * that Ctrl-C still stops it.  ManagerClient._quorum_start / _quorum_wait
 * split a quorum in two: the Manager starts a step's quorum that way, so
 * the call runs during the forward pass without a Python thread (which
 * would first have to win the GIL from the forward pass).  One such call
 * per client at a time; deallocating a client aborts it.
 */
#include "module.h"

#include <string.h>

#include "stepguard/manager.h"

/* ---- ManagerServer ---------------------------------------------------------
 */

typedef struct {
  PyObject_HEAD sg_mgr_server_t *srv;
  PyObject *kill_handler; /* callable or NULL */
} mgr_server_obj;

#if PY_VERSION_HEX >= 0x030D0000
#define interpreter_finalizing() Py_IsFinalizing()
#else
#define interpreter_finalizing() _Py_IsFinalizing()
#endif

static void on_kill(void *ud, const char *msg) {
  mgr_server_obj *self = ud;
  if (interpreter_finalizing())
    return;
  PyGILState_STATE g = PyGILState_Ensure();
  if (self->kill_handler) {
    PyObject *r = PyObject_CallFunction(self->kill_handler, "s", msg);
    if (!r)
      PyErr_WriteUnraisable(self->kill_handler);
    Py_XDECREF(r);
  }
  PyGILState_Release(g);
}

static int mgrserver_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  static char *kwlist[] = {"replica_id",
                           "lighthouse_addr",
                           "hostname",
                           "bind",
                           "store_addr",
                           "world_size",
                           "heartbeat_interval_s",
                           "connect_timeout_s",
                           "quorum_retries",
                           "auth_token",
                           "disconnect_grace_ms",
                           "kill_handler",
                           NULL};
  const char *id, *lh, *host, *bind, *store, *token = NULL;
  long long world, retries, grace = 0;
  double hb_s, connect_s;
  PyObject *handler = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "szzzzLddL|zLO:ManagerServer",
                                   kwlist, &id, &lh, &host, &bind, &store,
                                   &world, &hb_s, &connect_s, &retries, &token,
                                   &grace, &handler))
    return -1;
  if (self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "ManagerServer already started");
    return -1;
  }
  if (handler != Py_None && !PyCallable_Check(handler)) {
    PyErr_SetString(PyExc_TypeError, "kill_handler must be callable");
    return -1;
  }
  int64_t hb_ms = sg_py_timeout_ms(hb_s), connect_ms;
  if (hb_ms < 0 || (connect_ms = sg_py_timeout_ms(connect_s)) < 0)
    return -1;
  if (!lh) {
    PyErr_SetString(PyExc_ValueError, "lighthouse_addr is required");
    return -1;
  }
  sg_mgr_server_opts_t o;
  memset(&o, 0, sizeof(o));
  o.replica_id = id;
  o.lighthouse_addr = lh;
  o.hostname = host;
  o.bind = bind && bind[0] ? bind : NULL;
  o.store_addr = store;
  o.world_size = world;
  o.heartbeat_interval_ms = hb_ms > 0 ? hb_ms : 1;
  o.connect_timeout_ms = connect_ms > 0 ? connect_ms : 1;
  o.quorum_retries = retries;
  o.disconnect_grace_ms = grace;
  o.auth_token = token;
  o.kill = on_kill;
  o.kill_ud = self;
  Py_XSETREF(self->kill_handler,
             handler == Py_None ? NULL : Py_NewRef(handler));
  sg_err_t err;
  sg_err_clear(&err);
  sg_mgr_server_t *srv = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_mgr_server_start(&o, &srv, &err);
  Py_END_ALLOW_THREADS
  if (rc) {
    if (rc == SG_EINVAL)
      PyErr_SetString(PyExc_ValueError, err.msg);
    else {
      char msg[512];
      snprintf(msg, sizeof(msg), "failed to start manager: %s",
               err.msg[0] ? err.msg : sg_strerror(rc));
      /* unreachable lighthouse is a RuntimeError, as in torchft */
      sg_py_raise(sg_py_state_of_type(Py_TYPE(self)),
                  rc == SG_ETIMEDOUT ? SG_ECONNREFUSED : rc, msg);
    }
    return -1;
  }
  self->srv = srv;
  return 0;
}

static int mgrserver_guard(mgr_server_obj *self) {
  if (!self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "ManagerServer is shut down");
    return -1;
  }
  return 0;
}

static PyObject *mgrserver_address(PyObject *self_obj, PyObject *unused) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  if (mgrserver_guard(self) < 0)
    return NULL;
  return PyUnicode_FromString(sg_mgr_server_address(self->srv));
}

static PyObject *mgrserver_port(PyObject *self_obj, PyObject *unused) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  if (mgrserver_guard(self) < 0)
    return NULL;
  return PyLong_FromLong(sg_mgr_server_port(self->srv));
}

static PyObject *mgrserver_has_left(PyObject *self_obj, PyObject *unused) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  if (mgrserver_guard(self) < 0)
    return NULL;
  return PyBool_FromLong(sg_mgr_server_has_left(self->srv));
}

/* wait_lost(after_qid, timeout_s) -> int | None: the newest quorum newer
 * than after_qid whose member the lighthouse reported lost, or None at the
 * timeout.  Blocks without the GIL; not to be called concurrently with
 * shutdown() (the Manager joins its watcher first). */
static PyObject *mgrserver_wait_lost(PyObject *self_obj, PyObject *args) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  long long after = 0;
  double timeout_s = 0;
  if (!PyArg_ParseTuple(args, "Ld", &after, &timeout_s))
    return NULL;
  if (mgrserver_guard(self) < 0)
    return NULL;
  if (timeout_s < 0)
    timeout_s = 0;
  if (timeout_s > 3600)
    timeout_s = 3600;
  sg_mgr_server_t *srv = self->srv;
  int64_t qid = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_mgr_server_wait_lost(srv, (int64_t)after,
                               sg_deadline_in_ms((int64_t)(timeout_s * 1000)),
                               &qid);
  Py_END_ALLOW_THREADS
  if (rc == 0)
    return PyLong_FromLongLong((long long)qid);
  Py_RETURN_NONE;
}

static void mgrserver_stop(mgr_server_obj *self) {
  sg_mgr_server_t *srv = self->srv;
  self->srv = NULL;
  if (srv) {
    Py_BEGIN_ALLOW_THREADS
    sg_mgr_server_stop(srv);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *mgrserver_shutdown(PyObject *self_obj, PyObject *unused) {
  mgrserver_stop((mgr_server_obj *)self_obj);
  Py_RETURN_NONE;
}

static int mgrserver_traverse(PyObject *self_obj, visitproc visit, void *arg) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  Py_VISIT(Py_TYPE(self_obj));
  Py_VISIT(self->kill_handler);
  return 0;
}

static int mgrserver_clear(PyObject *self_obj) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  mgrserver_stop(self); /* the handler may run until the server stops */
  Py_CLEAR(self->kill_handler);
  return 0;
}

static void mgrserver_dealloc(PyObject *self_obj) {
  mgr_server_obj *self = (mgr_server_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self_obj);
  if (self->srv) {
    PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                     "unclosed ManagerServer; call shutdown()");
    mgrserver_stop(self);
  }
  Py_CLEAR(self->kill_handler);
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef mgrserver_methods[] = {
    {"address", mgrserver_address, METH_NOARGS,
     "address() -> str: http://host:port other replicas reach it at."},
    {"port", mgrserver_port, METH_NOARGS, "port() -> int: the bound port."},
    {"has_left", mgrserver_has_left, METH_NOARGS,
     "has_left() -> bool: the group lost a rank and left the job."},
    {"wait_lost", mgrserver_wait_lost, METH_VARARGS,
     "wait_lost(after_qid, timeout_s) -> int | None: a quorum newer than "
     "after_qid the lighthouse reported a member of lost, or None."},
    {"shutdown", mgrserver_shutdown, METH_NOARGS,
     "shutdown(): stop serving (idempotent); waiting calls fail."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mgrserver_slots[] = {
    {Py_tp_init, mgrserver_init},
    {Py_tp_dealloc, mgrserver_dealloc},
    {Py_tp_traverse, mgrserver_traverse},
    {Py_tp_clear, mgrserver_clear},
    {Py_tp_methods, mgrserver_methods},
    {Py_tp_doc, "ManagerServer(replica_id, lighthouse_addr, hostname, bind, "
                "store_addr, world_size, heartbeat_interval_s, "
                "connect_timeout_s, quorum_retries, auth_token=None, "
                "disconnect_grace_ms=0, kill_handler=None)"},
    {0, NULL},
};

static PyType_Spec mgrserver_spec = {
    .name = "stepguard._C.ManagerServer",
    .basicsize = sizeof(mgr_server_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = mgrserver_slots,
};

/* ---- ManagerClient ---------------------------------------------------------
 */

struct mcall;

typedef struct {
  PyObject_HEAD sg_mgr_client_t *cli;
  int inflight;           /* calls running without the GIL */
  sg_mgr_call_t *queued;  /* _quorum_start's call, until _quorum_wait */
  mgr_server_obj *server; /* in-process calls go here; or NULL */
  struct lwait *waiting;  /* started calls being waited for */
} mgr_client_obj;

/* A started call being waited for, on the waiter's C stack, so that
 * abort() from another thread can end it.  The list changes only with the
 * GIL held. */
struct lwait {
  sg_mgr_call_t *c;
  struct lwait *next;
};

#define LOCAL_SLICE_NS 100000000LL /* main thread: signal checks */

/* server_alive: 0 unless the client's in-process server is shut down;
 * then -1 with the exception a call to a stopped server gets. */
static int server_alive(mgr_client_obj *self) {
  if (!self->server || self->server->srv)
    return 0;
  sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), SG_ECONNREFUSED,
              "status: UNAVAILABLE, message: \"manager shutting down\"");
  return -1;
}

/*
 * call_wait: wait for a started call without the GIL (not even
 * dropping it when the call is complete already).  On the main thread,
 * signal handlers run every LOCAL_SLICE_NS; when one raises, the call is
 * aborted and -1 returned with the exception set.  Otherwise 0.
 */
static int call_wait(mgr_client_obj *self, sg_mgr_call_t *c) {
  if (sg_mgr_call_done(c))
    return 0;
  int on_main = _PyOS_IsMainThread();
  struct lwait node = {c, self->waiting};
  self->waiting = &node;
  self->inflight++;
  int out = 0;
  for (;;) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc =
        sg_mgr_call_wait(c, on_main ? sg_now_ns() + LOCAL_SLICE_NS : INT64_MAX);
    Py_END_ALLOW_THREADS
    if (rc == 0)
      break;
    if (PyErr_CheckSignals() < 0) {
      sg_mgr_call_abort(c);
      out = -1;
      break;
    }
  }
  self->inflight--;
  struct lwait **pp = &self->waiting;
  while (*pp != &node)
    pp = &(*pp)->next;
  *pp = node.next;
  return out;
}

static int mgrclient_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  static char *kwlist[] = {"addr", "connect_timeout_s", "auth_token", "server",
                           NULL};
  const char *addr, *token = NULL;
  double timeout_s;
  PyObject *server = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sd|zO:ManagerClient", kwlist,
                                   &addr, &timeout_s, &token, &server))
    return -1;
  if (self->cli) {
    PyErr_SetString(PyExc_RuntimeError, "ManagerClient already connected");
    return -1;
  }
  sg_py_state *st = sg_py_state_of_type(Py_TYPE(self));
  if (server != Py_None &&
      !PyObject_TypeCheck(server, (PyTypeObject *)st->mgr_server_type)) {
    PyErr_SetString(PyExc_TypeError,
                    "server must be a ManagerServer of this process or None");
    return -1;
  }
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return -1;
  sg_err_t err;
  sg_err_clear(&err);
  sg_mgr_client_t *cli = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_mgr_client_new(addr, ms > 0 ? ms : 1, token, &cli, &err);
  Py_END_ALLOW_THREADS
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof(msg),
             "failed to connect to %s within timeout of %lldms: %s", addr,
             (long long)ms, err.msg[0] ? err.msg : sg_strerror(rc));
    sg_py_raise(sg_py_state_of_type(Py_TYPE(self)),
                rc == SG_ETIMEDOUT ? SG_ECONNREFUSED : rc, msg);
    return -1;
  }
  self->cli = cli;
  Py_XSETREF(self->server,
             server == Py_None ? NULL : (mgr_server_obj *)Py_NewRef(server));
  if (self->server)
    sg_mgr_client_use_server(cli, self->server->srv);
  return 0;
}

static int mgrclient_guard(mgr_client_obj *self) {
  if (!self->cli) {
    PyErr_SetString(PyExc_RuntimeError, "ManagerClient is closed");
    return -1;
  }
  return 0;
}

enum mcall_kind { MC_METADATA, MC_KILL, MC_LOST };

/* A blocking call other than Quorum and ShouldCommit, run without the GIL
 * through sg_py_blocking. */
struct mcall {
  mgr_client_obj *self;
  enum mcall_kind kind;
  int64_t group_rank, step;
  const char *str; /* kill message */
  sg_deadline_t deadline;
  char *metadata;
  int64_t lost_qid; /* MC_LOST: the answer */
  sg_err_t err;
  int rc;
};

static void mcall_run(void *arg) {
  struct mcall *c = arg;
  sg_mgr_client_t *cli = c->self->cli;
  switch (c->kind) {
  case MC_METADATA:
    c->rc = sg_mgr_client_checkpoint_metadata(cli, c->group_rank, c->deadline,
                                              &c->metadata, &c->err);
    break;
  case MC_KILL:
    c->rc = sg_mgr_client_kill(cli, c->str, c->deadline, &c->err);
    break;
  case MC_LOST:
    c->rc = sg_mgr_client_wait_lost(cli, c->step, c->deadline, &c->lost_qid,
                                    &c->err);
    break;
  }
}

static void mcall_abort(void *arg) {
  struct mcall *c = arg;
  sg_mgr_client_abort(c->self->cli);
}

/* mcall_do: 0 with c->rc == 0; -1 with an exception set. */
static int mcall_do(struct mcall *c, double timeout_s) {
  if (mgrclient_guard(c->self) < 0)
    return -1;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return -1;
  c->deadline = sg_deadline_in_ms(ms);
  sg_err_clear(&c->err);
  c->self->inflight++;
  int rc = sg_py_blocking(mcall_run, mcall_abort, c);
  c->self->inflight--;
  if (rc == 0 && c->rc) {
    sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(c->self)), c->rc, c->err.msg);
    rc = -1;
  }
  if (rc < 0) {
    sg_free(c->metadata);
    c->metadata = NULL;
  }
  return rc;
}

static PyObject *str_list(char **v, size_t n) {
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    PyObject *s = PyUnicode_FromString(v[i]);
    if (!s) {
      Py_CLEAR(l);
      break;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)i, s);
  }
  return l;
}

static PyObject *opt_int(int has, int64_t v) {
  return has ? PyLong_FromLongLong(v) : Py_NewRef(Py_None);
}

/* result_dict: the fields of torchft's QuorumResult plus stepguard's. */
static PyObject *result_dict(const sg_mgr_quorum_result_t *r) {
  PyObject *dst = PyList_New((Py_ssize_t)r->n_recover_dst_replica_ranks);
  for (size_t i = 0; dst && i < r->n_recover_dst_replica_ranks; i++) {
    PyObject *x = PyLong_FromLongLong(r->recover_dst_replica_ranks[i]);
    if (!x) {
      Py_CLEAR(dst);
      break;
    }
    PyList_SET_ITEM(dst, (Py_ssize_t)i, x);
  }
  if (!dst)
    return NULL;
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:s,s:N,s:N,s:s,s:L,s:N,s:L,s:O,s:L,s:N,s:N,s:N}",
      "quorum_id", (long long)r->quorum_id, "replica_rank",
      (long long)r->replica_rank, "replica_world_size",
      (long long)r->replica_world_size, "recover_src_manager_address",
      r->recover_src_manager_address, "recover_src_replica_rank",
      opt_int(r->has_recover_src_replica_rank, r->recover_src_replica_rank),
      "recover_dst_replica_ranks", dst, "store_address", r->store_address,
      "max_step", (long long)r->max_step, "max_replica_rank",
      opt_int(r->has_max_replica_rank, r->max_replica_rank), "max_world_size",
      (long long)r->max_world_size, "heal", r->heal ? Py_True : Py_False,
      "commit_failures", (long long)r->commit_failures, "replica_ids",
      str_list(r->replica_ids, r->n_replica_ids), "reconfigure_handles",
      str_list(r->reconfigure_handles, r->n_reconfigure_handles),
      "up_to_date_manager_addresses",
      str_list(r->up_to_date_manager_addresses,
               r->n_up_to_date_manager_addresses));
}

/* The arguments of a started call. */
struct scall {
  int commit; /* ShouldCommit, else Quorum */
  long long group_rank, step, commit_failures;
  const char *metadata, *handle;
  int shrink_only, init_sync, vote;
  double timeout_s;
};

/* call_start: start `a` through the client (over the wire or in-process:
 * the library decides); NULL with an exception set on failure (a closed
 * client, a bad timeout, a stopped server or a refused call). */
static sg_mgr_call_t *call_start(mgr_client_obj *self, const struct scall *a) {
  if (mgrclient_guard(self) < 0 || server_alive(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(a->timeout_s);
  if (ms < 0)
    return NULL;
  sg_deadline_t deadline = sg_deadline_in_ms(ms);
  sg_mgr_call_t *c = NULL;
  sg_err_t err;
  sg_err_clear(&err);
  sg_mgr_client_t *cli = self->cli;
  int rc;
  /* Over the wire, without the GIL: the start allocates, encodes and wakes
   * the channel's thread, and the ranks of a group start theirs at the same
   * moment.  An abort() meanwhile still ends the call: the channel fails
   * it.  An in-process start keeps the GIL, so that abort() cannot come
   * between it and call_wait's list, from which abort() ends calls. */
  PyThreadState *ts = NULL;
  self->inflight++;
  if (!self->server)
    ts = PyEval_SaveThread();
  rc = a->commit ? sg_mgr_client_should_commit_start(
                       cli, a->group_rank, a->step, a->vote, deadline, &c, &err)
                 : sg_mgr_client_quorum_start(cli, a->group_rank, a->step,
                                              a->metadata, a->shrink_only,
                                              a->init_sync, a->commit_failures,
                                              a->handle, deadline, &c, &err);
  if (ts)
    PyEval_RestoreThread(ts);
  self->inflight--;
  if (rc) {
    sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg);
    return NULL;
  }
  return c;
}

/* quorum_finish: wait for `c`, free it, and return the result dict (or
 * NULL with the call's exception). */
static PyObject *quorum_finish(mgr_client_obj *self, sg_mgr_call_t *c) {
  PyObject *d = NULL;
  if (call_wait(self, c) == 0) {
    sg_mgr_quorum_result_t r;
    sg_err_t err;
    sg_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS /* the decode: the others may run meanwhile */
    rc = sg_mgr_call_quorum_result(c, &r, &err);
    Py_END_ALLOW_THREADS
    if (rc)
      sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg);
    else
      d = result_dict(&r);
    sg_mgr_quorum_result_free(&r);
  }
  sg_mgr_call_free(c);
  return d;
}

/* The keywords of _quorum and _quorum_start (the same arguments). */
static char *quorum_kwlist[] = {"group_rank",
                                "step",
                                "checkpoint_metadata",
                                "shrink_only",
                                "init_sync",
                                "commit_failures",
                                "timeout_s",
                                "reconfigure_handle",
                                NULL};

static int quorum_args(PyObject *args, PyObject *kw, const char *fmt,
                       struct scall *a) {
  memset(a, 0, sizeof(*a));
  a->handle = "";
  return PyArg_ParseTupleAndKeywords(
      args, kw, fmt, quorum_kwlist, &a->group_rank, &a->step, &a->metadata,
      &a->shrink_only, &a->init_sync, &a->commit_failures, &a->timeout_s,
      &a->handle);
}

static PyObject *mgrclient_quorum(PyObject *self_obj, PyObject *args,
                                  PyObject *kw) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  struct scall a;
  if (!quorum_args(args, kw, "LLsppLd|s:_quorum", &a))
    return NULL;
  sg_mgr_call_t *c = call_start(self, &a);
  return c ? quorum_finish(self, c) : NULL;
}

/*
 * _quorum_start: the arguments of _quorum; starts the call and returns
 * None at once.  RuntimeError if one is already started and not yet
 * collected by _quorum_wait.
 */
static PyObject *mgrclient_quorum_start(PyObject *self_obj, PyObject *args,
                                        PyObject *kw) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  struct scall a;
  if (!quorum_args(args, kw, "LLsppLd|s:_quorum_start", &a))
    return NULL;
  if (self->queued) {
    PyErr_SetString(PyExc_RuntimeError,
                    "a quorum is already started; _quorum_wait() first");
    return NULL;
  }
  self->queued = call_start(self, &a);
  if (!self->queued)
    return NULL;
  Py_RETURN_NONE;
}

/*
 * _quorum_wait: the result of the call _quorum_start started, as _quorum
 * returns it (and raising what it raises).  Waits without the GIL; on the
 * main thread Ctrl-C aborts the call and raises.  RuntimeError if no call
 * was started.
 */
static PyObject *mgrclient_quorum_wait(PyObject *self_obj, PyObject *unused) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  sg_mgr_call_t *c = self->queued;
  if (!c) {
    PyErr_SetString(PyExc_RuntimeError, "no quorum was started");
    return NULL;
  }
  self->queued = NULL; /* a concurrent waiter finds none */
  return quorum_finish(self, c);
}

static PyObject *mgrclient_metadata(PyObject *self_obj, PyObject *args,
                                    PyObject *kw) {
  static char *kwlist[] = {"rank", "timeout_s", NULL};
  struct mcall c;
  memset(&c, 0, sizeof(c));
  c.self = (mgr_client_obj *)self_obj;
  c.kind = MC_METADATA;
  long long rank;
  double timeout_s;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "Ld:_checkpoint_metadata", kwlist,
                                   &rank, &timeout_s))
    return NULL;
  c.group_rank = rank;
  if (mcall_do(&c, timeout_s) < 0)
    return NULL;
  PyObject *s = PyUnicode_FromString(c.metadata ? c.metadata : "");
  sg_free(c.metadata);
  return s;
}

static PyObject *mgrclient_should_commit(PyObject *self_obj, PyObject *args,
                                         PyObject *kw) {
  static char *kwlist[] = {"group_rank", "step", "should_commit", "timeout_s",
                           NULL};
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  struct scall a;
  memset(&a, 0, sizeof(a));
  a.commit = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "LLpd:should_commit", kwlist,
                                   &a.group_rank, &a.step, &a.vote,
                                   &a.timeout_s))
    return NULL;
  sg_mgr_call_t *c = call_start(self, &a);
  if (!c)
    return NULL;
  PyObject *out = NULL;
  if (call_wait(self, c) == 0) {
    int decision = 0;
    sg_err_t err;
    sg_err_clear(&err);
    int rc = sg_mgr_call_should_commit_result(c, &decision, &err);
    out = rc ? sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg)
             : PyBool_FromLong(decision);
  }
  sg_mgr_call_free(c);
  return out;
}

static PyObject *mgrclient_kill(PyObject *self_obj, PyObject *args,
                                PyObject *kw) {
  static char *kwlist[] = {"msg", "timeout_s", NULL};
  struct mcall c;
  memset(&c, 0, sizeof(c));
  c.self = (mgr_client_obj *)self_obj;
  c.kind = MC_KILL;
  double timeout_s = 10.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|d:kill", kwlist, &c.str,
                                   &timeout_s))
    return NULL;
  if (mcall_do(&c, timeout_s) < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* _wait_lost(after_quorum_id, timeout_s): the lost quorum's id, or None
 * when the manager reported none newer by the deadline. */
static PyObject *mgrclient_wait_lost(PyObject *self_obj, PyObject *args,
                                     PyObject *kw) {
  static char *kwlist[] = {"after_quorum_id", "timeout_s", NULL};
  struct mcall c;
  memset(&c, 0, sizeof(c));
  c.self = (mgr_client_obj *)self_obj;
  c.kind = MC_LOST;
  long long after;
  double timeout_s;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "Ld:_wait_lost", kwlist, &after,
                                   &timeout_s))
    return NULL;
  c.step = after;
  if (mgrclient_guard(c.self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  c.deadline = sg_deadline_in_ms(ms);
  sg_err_clear(&c.err);
  c.self->inflight++;
  int rc = sg_py_blocking(mcall_run, mcall_abort, &c);
  c.self->inflight--;
  if (rc < 0)
    return NULL;
  if (c.rc == SG_ETIMEDOUT)
    Py_RETURN_NONE;
  if (c.rc)
    return sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(c.self)), c.rc,
                           c.err.msg);
  return PyLong_FromLongLong(c.lost_qid);
}

static PyObject *mgrclient_abort(PyObject *self_obj, PyObject *unused) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  if (self->cli)
    sg_mgr_client_abort(self->cli);
  if (self->queued)
    sg_mgr_call_abort(self->queued);
  for (struct lwait *w = self->waiting; w; w = w->next)
    sg_mgr_call_abort(w->c);
  Py_RETURN_NONE;
}

static void mgrclient_close_now(mgr_client_obj *self) {
  sg_mgr_client_t *cli = self->cli;
  self->cli = NULL;
  if (cli) {
    Py_BEGIN_ALLOW_THREADS
    sg_mgr_client_free(cli);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *mgrclient_close(PyObject *self_obj, PyObject *unused) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  if (self->inflight || self->queued) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ManagerClient.close() while a call is running; abort() "
                    "it first");
    return NULL;
  }
  mgrclient_close_now(self);
  Py_RETURN_NONE;
}

static void mgrclient_dealloc(PyObject *self_obj) {
  mgr_client_obj *self = (mgr_client_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  sg_mgr_call_free(self->queued); /* nobody will collect it: aborts it */
  self->queued = NULL;
  Py_CLEAR(self->server);
  mgrclient_close_now(self);
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef mgrclient_methods[] = {
    {"_quorum", (PyCFunction)(void (*)(void))mgrclient_quorum,
     METH_VARARGS | METH_KEYWORDS,
     "_quorum(group_rank, step, checkpoint_metadata, shrink_only, init_sync, "
     "commit_failures, timeout_s, reconfigure_handle='') -> dict"},
    {"_quorum_start", (PyCFunction)(void (*)(void))mgrclient_quorum_start,
     METH_VARARGS | METH_KEYWORDS,
     "_quorum_start(group_rank, step, checkpoint_metadata, shrink_only, "
     "init_sync, commit_failures, timeout_s, reconfigure_handle='') -> None: "
     "start a quorum call in the background (one at a time)."},
    {"_quorum_wait", mgrclient_quorum_wait, METH_NOARGS,
     "_quorum_wait() -> dict: the result of the started quorum call (raises "
     "its error)."},
    {"_checkpoint_metadata", (PyCFunction)(void (*)(void))mgrclient_metadata,
     METH_VARARGS | METH_KEYWORDS,
     "_checkpoint_metadata(rank, timeout_s) -> str"},
    {"should_commit", (PyCFunction)(void (*)(void))mgrclient_should_commit,
     METH_VARARGS | METH_KEYWORDS,
     "should_commit(group_rank, step, should_commit, timeout_s) -> bool"},
    {"kill", (PyCFunction)(void (*)(void))mgrclient_kill,
     METH_VARARGS | METH_KEYWORDS, "kill(msg, timeout_s=10.0)"},
    {"_wait_lost", (PyCFunction)(void (*)(void))mgrclient_wait_lost,
     METH_VARARGS | METH_KEYWORDS,
     "_wait_lost(after_quorum_id, timeout_s) -> int | None"},
    {"abort", mgrclient_abort, METH_NOARGS,
     "abort(): fail every call in progress and later ones."},
    {"close", mgrclient_close, METH_NOARGS, "close(): drop the connection."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mgrclient_slots[] = {
    {Py_tp_init, mgrclient_init},
    {Py_tp_dealloc, mgrclient_dealloc},
    {Py_tp_methods, mgrclient_methods},
    {Py_tp_doc, "ManagerClient(addr, connect_timeout_s, auth_token=None, "
                "server=None): server, the ManagerServer of this process, "
                "takes its Quorum and ShouldCommit calls in-process"},
    {0, NULL},
};

static PyType_Spec mgrclient_spec = {
    .name = "stepguard._C.ManagerClient",
    .basicsize = sizeof(mgr_client_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = mgrclient_slots,
};

int sg_py_manager_init(PyObject *module, sg_py_state *st) {
  st->mgr_server_type = PyType_FromModuleAndSpec(module, &mgrserver_spec, NULL);
  if (!st->mgr_server_type ||
      PyModule_AddObjectRef(module, "ManagerServer", st->mgr_server_type) < 0)
    return -1;
  st->mgr_client_type = PyType_FromModuleAndSpec(module, &mgrclient_spec, NULL);
  if (!st->mgr_client_type ||
      PyModule_AddObjectRef(module, "ManagerClient", st->mgr_client_type) < 0)
    return -1;
  return 0;
}
