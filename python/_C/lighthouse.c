/*
 * lighthouse.c: stepguard._C.LighthouseServer and LighthouseClient, heap
 * types over sg_lh_server_t and sg_lh_client_t.
 *
 * Each method starts with a guard (closed objects raise), releases the GIL
 * around every call that can wait, and turns the C result into an
 * exception only after the GIL is back.  A blocking client call runs on a
 * short-lived thread while the caller waits in slices of at most 100 ms
 * and checks for signals, so Ctrl-C stops a call that waits for a quorum
 * (the client is aborted then: later calls fail).  A server still running
 * when collected is stopped with a ResourceWarning.
 */
#include "module.h"

#include <string.h>

#include "stepguard/lighthouse.h"

/* ---- LighthouseServer ------------------------------------------------------
 */

typedef struct {
  PyObject_HEAD sg_lh_server_t *srv;
} lh_server_obj;

static int lhserver_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  lh_server_obj *self = (lh_server_obj *)self_obj;
  static char *kwlist[] = {"bind",
                           "min_replicas",
                           "join_timeout_ms",
                           "quorum_tick_ms",
                           "heartbeat_timeout_ms",
                           "disconnect_grace_ms",
                           "prune_after_ms",
                           "auth_token",
                           "quorum_id_file",
                           "hostname",
                           "max_replicas",
                           "max_connections",
                           "state_loss_wait_ms",
                           NULL};
  sg_lh_opts_t o;
  sg_lh_opts_init(&o);
  long long min_replicas,
      join = o.join_timeout_ms, tick = o.quorum_tick_ms,
      hb = o.heartbeat_timeout_ms, grace = o.disconnect_grace_ms,
      prune = o.prune_after_ms, state_loss = o.state_loss_wait_ms;
  Py_ssize_t max_replicas = (Py_ssize_t)o.max_replicas;
  unsigned int max_conns = o.max_connections;
  const char *bind, *token = NULL, *id_file = NULL, *hostname = NULL;
  if (!PyArg_ParseTupleAndKeywords(
          args, kw, "sL|LLLLLzzznIL:LighthouseServer", kwlist, &bind,
          &min_replicas, &join, &tick, &hb, &grace, &prune, &token, &id_file,
          &hostname, &max_replicas, &max_conns, &state_loss))
    return -1;
  if (self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "LighthouseServer already started");
    return -1;
  }
  if (max_replicas <= 0) {
    PyErr_SetString(PyExc_ValueError, "max_replicas must be > 0");
    return -1;
  }
  o.bind = bind;
  o.min_replicas = min_replicas;
  o.join_timeout_ms = join;
  o.quorum_tick_ms = tick;
  o.heartbeat_timeout_ms = hb;
  o.disconnect_grace_ms = grace;
  o.prune_after_ms = prune;
  o.auth_token = token;
  o.quorum_id_file = id_file;
  o.hostname = hostname;
  o.max_replicas = (size_t)max_replicas;
  o.max_connections = max_conns;
  o.state_loss_wait_ms = state_loss;
  sg_err_t err;
  sg_err_clear(&err);
  int rc;
  sg_lh_server_t *srv = NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_lh_server_start(&o, &srv, &err);
  Py_END_ALLOW_THREADS
  if (rc) {
    if (rc == SG_EINVAL)
      PyErr_SetString(PyExc_ValueError, err.msg);
    else
      sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg);
    return -1;
  }
  self->srv = srv;
  return 0;
}

static PyObject *lhserver_guard(lh_server_obj *self) {
  if (!self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "LighthouseServer is shut down");
    return NULL;
  }
  return Py_None;
}

static PyObject *lhserver_address(PyObject *self_obj, PyObject *unused) {
  lh_server_obj *self = (lh_server_obj *)self_obj;
  if (!lhserver_guard(self))
    return NULL;
  return PyUnicode_FromString(sg_lh_server_address(self->srv));
}

static PyObject *lhserver_port(PyObject *self_obj, PyObject *unused) {
  lh_server_obj *self = (lh_server_obj *)self_obj;
  if (!lhserver_guard(self))
    return NULL;
  return PyLong_FromLong(sg_lh_server_port(self->srv));
}

static void lhserver_stop(lh_server_obj *self) {
  sg_lh_server_t *srv = self->srv;
  self->srv = NULL;
  if (srv) {
    Py_BEGIN_ALLOW_THREADS
    sg_lh_server_stop(srv);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *lhserver_shutdown(PyObject *self_obj, PyObject *unused) {
  lhserver_stop((lh_server_obj *)self_obj);
  Py_RETURN_NONE;
}

static void lhserver_dealloc(PyObject *self_obj) {
  lh_server_obj *self = (lh_server_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  if (self->srv) {
    PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                     "unclosed LighthouseServer %R; call shutdown()", self_obj);
    lhserver_stop(self);
  }
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef lhserver_methods[] = {
    {"address", lhserver_address, METH_NOARGS,
     "address() -> str: http://host:port of the server."},
    {"port", lhserver_port, METH_NOARGS, "port() -> int: the bound port."},
    {"shutdown", lhserver_shutdown, METH_NOARGS,
     "shutdown(): stop serving and release everything (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lhserver_slots[] = {
    {Py_tp_init, lhserver_init},
    {Py_tp_dealloc, lhserver_dealloc},
    {Py_tp_methods, lhserver_methods},
    {Py_tp_doc, "LighthouseServer(bind, min_replicas, ...): the C lighthouse "
                "on a thread of its own."},
    {0, NULL},
};

static PyType_Spec lhserver_spec = {
    .name = "stepguard._C.LighthouseServer",
    .basicsize = sizeof(lh_server_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = lhserver_slots,
};

/* ---- LighthouseClient ------------------------------------------------------
 */

typedef struct {
  PyObject_HEAD sg_lh_client_t *cli;
  int inflight; /* calls running without the GIL (close waits for none) */
} lh_client_obj;

static int lhclient_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  static char *kwlist[] = {"addr", "connect_timeout_s", "auth_token", NULL};
  const char *addr, *token = NULL;
  double timeout_s;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sd|z:LighthouseClient", kwlist,
                                   &addr, &timeout_s, &token))
    return -1;
  if (self->cli) {
    PyErr_SetString(PyExc_RuntimeError, "LighthouseClient already connected");
    return -1;
  }
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return -1;
  sg_err_t err;
  sg_err_clear(&err);
  sg_lh_client_t *cli = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_lh_client_new(addr, ms, token, &cli, &err);
  Py_END_ALLOW_THREADS
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof(msg),
             "failed to connect to %s within timeout of %lldms: %s", addr,
             (long long)ms, err.msg[0] ? err.msg : sg_strerror(rc));
    /* connection failures are RuntimeError, as in torchft */
    sg_py_raise(sg_py_state_of_type(Py_TYPE(self)),
                rc == SG_ETIMEDOUT ? SG_ECONNREFUSED : rc, msg);
    return -1;
  }
  self->cli = cli;
  return 0;
}

static int lhclient_guard(lh_client_obj *self) {
  if (!self->cli) {
    PyErr_SetString(PyExc_RuntimeError, "LighthouseClient is closed");
    return -1;
  }
  return 0;
}

/* One blocking client call, run through sg_py_blocking. */
struct call_ctx {
  lh_client_obj *self;
  int kind; /* 0 quorum, 1 heartbeat */
  const sg_lh_member_t *member;
  const char *replica_id;
  sg_deadline_t deadline;
  sg_lh_quorum_t q;
  sg_err_t err;
  int rc;
};

static void call_run(void *arg) {
  struct call_ctx *c = arg;
  if (c->kind == 0)
    c->rc = sg_lh_client_quorum(c->self->cli, c->member, c->deadline, &c->q,
                                &c->err);
  else
    c->rc = sg_lh_client_heartbeat(c->self->cli, c->replica_id, c->deadline,
                                   &c->err);
}

static void call_abort(void *arg) {
  struct call_ctx *c = arg;
  sg_lh_client_abort(c->self->cli);
}

/* run_call: returns 0 with c->rc set, or -1 with a Python exception. */
static int run_call(struct call_ctx *c) {
  sg_err_clear(&c->err);
  c->self->inflight++;
  int rc = sg_py_blocking(call_run, call_abort, c);
  c->self->inflight--;
  if (rc < 0)
    sg_lh_quorum_free(&c->q);
  return rc;
}

static PyObject *member_tuple(const sg_lh_member_t *m) {
  return Py_BuildValue("(sssLKOsL)", m->replica_id, m->address,
                       m->store_address, (long long)m->step,
                       (unsigned long long)m->world_size,
                       m->shrink_only ? Py_True : Py_False, m->data,
                       (long long)m->commit_failures);
}

static PyObject *lhclient_quorum(PyObject *self_obj, PyObject *args,
                                 PyObject *kw) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  static char *kwlist[] = {
      "replica_id", "timeout_s",   "address", "store_address",   "step",
      "world_size", "shrink_only", "data",    "commit_failures", NULL};
  sg_lh_member_t m = {0};
  double timeout_s;
  long long step = 0, commit_failures = 0;
  unsigned long long world_size = 0;
  int shrink_only = 0;
  const char *addr = "", *store = "", *data = "";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sd|ssLKpsL:quorum", kwlist,
                                   &m.replica_id, &timeout_s, &addr, &store,
                                   &step, &world_size, &shrink_only, &data,
                                   &commit_failures))
    return NULL;
  if (lhclient_guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  m.address = (char *)addr;
  m.store_address = (char *)store;
  m.data = (char *)data;
  m.step = step;
  m.world_size = world_size;
  m.shrink_only = shrink_only;
  m.commit_failures = commit_failures;
  struct call_ctx c;
  memset(&c, 0, sizeof(c));
  c.self = self;
  c.kind = 0;
  c.member = &m;
  c.deadline = sg_deadline_in_ms(ms);
  if (run_call(&c) < 0)
    return NULL;
  if (c.rc)
    return sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(self)), c.rc, c.err.msg);
  PyObject *members = PyList_New((Py_ssize_t)c.q.n), *ret = NULL;
  if (!members)
    goto out;
  for (size_t i = 0; i < c.q.n; i++) {
    PyObject *t = member_tuple(&c.q.members[i]);
    if (!t) {
      Py_CLEAR(members);
      goto out;
    }
    PyList_SET_ITEM(members, (Py_ssize_t)i, t);
  }
  ret = Py_BuildValue("(LLiN)", (long long)c.q.quorum_id,
                      (long long)c.q.created_seconds, (int)c.q.created_nanos,
                      members);
out:
  sg_lh_quorum_free(&c.q);
  return ret;
}

static PyObject *lhclient_heartbeat(PyObject *self_obj, PyObject *args,
                                    PyObject *kw) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  static char *kwlist[] = {"replica_id", "timeout_s", NULL};
  const char *id;
  double timeout_s = 5.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|d:heartbeat", kwlist, &id,
                                   &timeout_s))
    return NULL;
  if (lhclient_guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  struct call_ctx c;
  memset(&c, 0, sizeof(c));
  c.self = self;
  c.kind = 1;
  c.replica_id = id;
  c.deadline = sg_deadline_in_ms(ms);
  if (run_call(&c) < 0)
    return NULL;
  if (c.rc)
    return sg_py_raise_rpc(sg_py_state_of_type(Py_TYPE(self)), c.rc, c.err.msg);
  Py_RETURN_NONE;
}

static void lhclient_close_now(lh_client_obj *self) {
  sg_lh_client_t *cli = self->cli;
  self->cli = NULL;
  if (cli) {
    Py_BEGIN_ALLOW_THREADS
    sg_lh_client_free(cli);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *lhclient_close(PyObject *self_obj, PyObject *unused) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  if (self->inflight) {
    PyErr_SetString(PyExc_RuntimeError,
                    "LighthouseClient.close() while a call is running; "
                    "abort() it first");
    return NULL;
  }
  lhclient_close_now(self);
  Py_RETURN_NONE;
}

static PyObject *lhclient_abort(PyObject *self_obj, PyObject *unused) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  if (self->cli)
    sg_lh_client_abort(self->cli);
  Py_RETURN_NONE;
}

static void lhclient_dealloc(PyObject *self_obj) {
  lh_client_obj *self = (lh_client_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  lhclient_close_now(self);
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef lhclient_methods[] = {
    {"quorum", (PyCFunction)(void (*)(void))lhclient_quorum,
     METH_VARARGS | METH_KEYWORDS,
     "quorum(replica_id, timeout_s, address='', store_address='', step=0, "
     "world_size=0, shrink_only=False, data='', commit_failures=0) -> "
     "(quorum_id, created_seconds, created_nanos, [member tuples])"},
    {"heartbeat", (PyCFunction)(void (*)(void))lhclient_heartbeat,
     METH_VARARGS | METH_KEYWORDS, "heartbeat(replica_id, timeout_s=5.0)"},
    {"abort", lhclient_abort, METH_NOARGS,
     "abort(): fail every call in progress and later ones."},
    {"close", lhclient_close, METH_NOARGS, "close(): drop the connection."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lhclient_slots[] = {
    {Py_tp_init, lhclient_init},
    {Py_tp_dealloc, lhclient_dealloc},
    {Py_tp_methods, lhclient_methods},
    {Py_tp_doc, "LighthouseClient(addr, connect_timeout_s, auth_token=None)"},
    {0, NULL},
};

static PyType_Spec lhclient_spec = {
    .name = "stepguard._C.LighthouseClient",
    .basicsize = sizeof(lh_client_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = lhclient_slots,
};

int sg_py_lighthouse_init(PyObject *module, sg_py_state *st) {
  st->lh_server_type = PyType_FromModuleAndSpec(module, &lhserver_spec, NULL);
  if (!st->lh_server_type ||
      PyModule_AddObjectRef(module, "LighthouseServer", st->lh_server_type) < 0)
    return -1;
  st->lh_client_type = PyType_FromModuleAndSpec(module, &lhclient_spec, NULL);
  if (!st->lh_client_type ||
      PyModule_AddObjectRef(module, "LighthouseClient", st->lh_client_type) < 0)
    return -1;
  return 0;
}
