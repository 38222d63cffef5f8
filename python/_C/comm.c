/*
 * comm.c: stepguard._C.Comm, a heap type over sg_comm_t.
 *
 * Buffers arrive as integer addresses of contiguous CPU memory (the Python
 * side keeps the tensors alive until the operation completes).  Each
 * operation takes a `done(rc, msg)` callable, called exactly once from the
 * communicator's progress thread with the GIL taken, unless the submission
 * raises.  connect() waits without the GIL through sg_py_blocking, so
 * Ctrl-C aborts it; close() and dealloc release the GIL while the progress
 * thread winds down (it may be waiting for the GIL in a callback).
 */
#include "module.h"

#include <string.h>

#include "stepguard/comm.h"

#if PY_VERSION_HEX >= 0x030D0000
#define interpreter_finalizing() Py_IsFinalizing()
#else
#define interpreter_finalizing() _Py_IsFinalizing()
#endif

typedef struct {
  PyObject_HEAD sg_comm_t *comm;
  int world;
} comm_obj;

/* The callback: the Python callable, owned until it has been called. */
static void on_done(void *ud, int rc, const char *msg) {
  PyObject *fn = ud;
  if (interpreter_finalizing())
    return; /* the interpreter is going away: leak rather than crash */
  PyGILState_STATE g = sg_py_gil_enter();
  PyObject *r = PyObject_CallFunction(fn, "is", rc, msg);
  if (!r)
    PyErr_WriteUnraisable(fn);
  Py_XDECREF(r);
  Py_DECREF(fn);
  sg_py_gil_leave(g);
}

static int comm_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  comm_obj *self = (comm_obj *)self_obj;
  static char *kwlist[] = {"rank",      "world_size",          "generation",
                           "job",       "auth_token",          "bind_host",
                           "small_max", "progress_timeout_ms", NULL};
  int rank, world;
  unsigned long long gen = 0;
  const char *job = NULL, *token = NULL, *host = NULL;
  Py_ssize_t small_max = 0;
  int progress_ms = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|Kzzzni:Comm", kwlist, &rank,
                                   &world, &gen, &job, &token, &host,
                                   &small_max, &progress_ms))
    return -1;
  if (self->comm) {
    PyErr_SetString(PyExc_RuntimeError, "Comm already created");
    return -1;
  }
  if (small_max < 0) {
    PyErr_SetString(PyExc_ValueError, "small_max must be >= 0");
    return -1;
  }
  sg_comm_opts_t o = {.rank = rank,
                      .world_size = world,
                      .generation = gen,
                      .job = job,
                      .auth_token = token,
                      .bind_host = host,
                      .small_max = (size_t)small_max,
                      .progress_timeout_ms = progress_ms};
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_comm_new(&o, &self->comm, &err);
  if (rc) {
    if (rc == SG_EINVAL)
      PyErr_SetString(PyExc_ValueError, err.msg);
    else
      sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg);
    return -1;
  }
  self->world = world;
  return 0;
}

static int guard(comm_obj *self) {
  if (!self->comm) {
    PyErr_SetString(PyExc_RuntimeError, "Comm is closed");
    return -1;
  }
  return 0;
}

static PyObject *comm_port(PyObject *self_obj, PyObject *unused) {
  comm_obj *self = (comm_obj *)self_obj;
  if (guard(self) < 0)
    return NULL;
  return PyLong_FromLong(sg_comm_port(self->comm));
}

static PyObject *comm_same_host(PyObject *self_obj, PyObject *arg) {
  comm_obj *self = (comm_obj *)self_obj;
  if (guard(self) < 0)
    return NULL;
  long peer = PyLong_AsLong(arg);
  if (peer == -1 && PyErr_Occurred())
    return NULL;
  if (peer < 0 || peer >= sg_comm_size(self->comm)) {
    PyErr_Format(PyExc_ValueError, "peer %ld is not a rank", peer);
    return NULL;
  }
  return PyBool_FromLong(sg_comm_same_host(self->comm, (int)peer));
}

struct connect_call {
  sg_comm_t *comm;
  const char **addrs;
  sg_deadline_t deadline;
  sg_err_t err;
  int rc;
};

static void connect_run(void *arg) {
  struct connect_call *c = arg;
  c->rc = sg_comm_connect(c->comm, c->addrs, c->deadline, &c->err);
}

static void connect_abort(void *arg) {
  struct connect_call *c = arg;
  sg_comm_abort(c->comm);
}

static PyObject *comm_connect(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  PyObject *list;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "Od:connect", &list, &timeout_s))
    return NULL;
  if (guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  PyObject *seq = PySequence_Fast(list, "addrs must be a sequence of str");
  if (!seq)
    return NULL;
  PyObject *ret = NULL;
  struct connect_call c;
  memset(&c, 0, sizeof(c));
  if (PySequence_Fast_GET_SIZE(seq) != self->world) {
    PyErr_SetString(PyExc_ValueError, "need one address per rank");
    goto out;
  }
  c.addrs = PyMem_Calloc((size_t)self->world, sizeof(char *));
  if (!c.addrs) {
    PyErr_NoMemory();
    goto out;
  }
  for (int i = 0; i < self->world; i++) {
    c.addrs[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (!c.addrs[i])
      goto out;
  }
  c.comm = self->comm;
  c.deadline = sg_deadline_in_ms(ms);
  if (sg_py_blocking(connect_run, connect_abort, &c) < 0)
    goto out;
  if (c.rc) {
    sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), c.rc, c.err.msg);
    goto out;
  }
  ret = Py_NewRef(Py_None);
out:
  PyMem_Free(c.addrs);
  Py_DECREF(seq);
  return ret;
}

/* ptr_array: a list of integer addresses (or sizes) into out[world]. */
static int ptr_array(PyObject *list, int world, size_t *out, const char *what) {
  PyObject *seq = PySequence_Fast(list, "expected a sequence of int");
  if (!seq)
    return -1;
  int rc = -1;
  if (PySequence_Fast_GET_SIZE(seq) != world) {
    PyErr_Format(PyExc_ValueError, "%s: need one entry per rank", what);
    goto out;
  }
  for (int i = 0; i < world; i++) {
    out[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(seq, i));
    if (out[i] == (size_t)-1 && PyErr_Occurred())
      goto out;
  }
  rc = 0;
out:
  Py_DECREF(seq);
  return rc;
}

/* submit_done: turn a submit result into Python: on success the callable
 * is owned by the operation. */
static PyObject *submit_done(comm_obj *self, int rc, sg_err_t *err,
                             PyObject *fn) {
  if (rc) {
    Py_DECREF(fn);
    return sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), rc, err->msg);
  }
  Py_RETURN_NONE;
}

static int check_fn(PyObject *fn) {
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "done must be callable");
    return -1;
  }
  return 0;
}

static PyObject *comm_allreduce(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t ptr, count;
  int dtype, op;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "nniidO:allreduce", &ptr, &count, &dtype, &op,
                        &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc = sg_comm_allreduce(self->comm, (void *)ptr, count,
                             (sg_comm_dtype_t)dtype, (sg_comm_redop_t)op,
                             sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

static PyObject *comm_broadcast(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t ptr, nbytes;
  int root;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "nnidO:broadcast", &ptr, &nbytes, &root,
                        &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc = sg_comm_broadcast(self->comm, (void *)ptr, nbytes, root,
                             sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

static PyObject *comm_allgather(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t in, nbytes;
  PyObject *outs_list, *fn;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "nnOdO:allgather", &in, &nbytes, &outs_list,
                        &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  size_t *outs = PyMem_Calloc((size_t)self->world, sizeof(size_t));
  if (!outs)
    return PyErr_NoMemory();
  PyObject *ret = NULL;
  if (ptr_array(outs_list, self->world, outs, "outputs") == 0) {
    void **p = PyMem_Calloc((size_t)self->world, sizeof(void *));
    if (!p) {
      PyErr_NoMemory();
    } else {
      for (int i = 0; i < self->world; i++)
        p[i] = (void *)outs[i];
      sg_err_t err;
      sg_err_clear(&err);
      Py_INCREF(fn);
      int rc = sg_comm_allgather(self->comm, (void *)in, nbytes, p,
                                 sg_deadline_in_ms(ms), on_done, fn, &err);
      ret = submit_done(self, rc, &err, fn);
      PyMem_Free(p);
    }
  }
  PyMem_Free(outs);
  return ret;
}

static PyObject *comm_reduce_scatter(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t out, count;
  int dtype, op;
  PyObject *ins_list, *fn;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "OnniidO:reduce_scatter", &ins_list, &out, &count,
                        &dtype, &op, &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  size_t *ins = PyMem_Calloc((size_t)self->world, sizeof(size_t));
  const void **p = PyMem_Calloc((size_t)self->world, sizeof(void *));
  PyObject *ret = NULL;
  if (!ins || !p) {
    PyErr_NoMemory();
  } else if (ptr_array(ins_list, self->world, ins, "inputs") == 0) {
    for (int i = 0; i < self->world; i++)
      p[i] = (const void *)ins[i];
    sg_err_t err;
    sg_err_clear(&err);
    Py_INCREF(fn);
    int rc = sg_comm_reduce_scatter(self->comm, p, (void *)out, count,
                                    (sg_comm_dtype_t)dtype, (sg_comm_redop_t)op,
                                    sg_deadline_in_ms(ms), on_done, fn, &err);
    ret = submit_done(self, rc, &err, fn);
  }
  PyMem_Free(ins);
  PyMem_Free(p);
  return ret;
}

/* comm_quantized: allreduce_quantized(ptr, count, fmt, op, timeout_s, done)
 * and reduce_scatter_quantized(in_ptr, out_ptr, count, fmt, op, timeout_s,
 * done); float32 buffers. */
static PyObject *comm_allreduce_quantized(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t ptr, count;
  int fmt, op;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "nniidO:allreduce_quantized", &ptr, &count, &fmt,
                        &op, &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc = sg_comm_allreduce_quantized(
      self->comm, (float *)ptr, count, (sg_comm_quant_t)fmt,
      (sg_comm_redop_t)op, sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

static PyObject *comm_reduce_scatter_quantized(PyObject *self_obj,
                                               PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t in, out, count;
  int fmt, op;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "nnniidO:reduce_scatter_quantized", &in, &out,
                        &count, &fmt, &op, &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc = sg_comm_reduce_scatter_quantized(
      self->comm, (const float *)in, (float *)out, count, (sg_comm_quant_t)fmt,
      (sg_comm_redop_t)op, sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

/* The kernels, module-level: quant_wire_bytes(count);
 * quant_encode(fmt, in_ptr, count, wire_ptr) -> 1 when a NaN or inf was
 * seen; quant_decode(fmt, wire_ptr, nbytes, count, out_ptr);
 * fp8_from_f32(in_ptr, out_ptr, n); fp8_to_f32(in_ptr, out_ptr, n).  The
 * kernels run without the GIL (they are long for large buffers). */
PyObject *sg_py_quant_wire_bytes(PyObject *mod, PyObject *arg) {
  size_t count = PyLong_AsSize_t(arg);
  if (count == (size_t)-1 && PyErr_Occurred())
    return NULL;
  return PyLong_FromSize_t(sg_comm_quant_wire_bytes(count));
}

PyObject *sg_py_quant_encode(PyObject *mod, PyObject *args) {
  int fmt, rc;
  size_t in, count, wire;
  if (!PyArg_ParseTuple(args, "innn:quant_encode", &fmt, &in, &count, &wire))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_comm_quant_encode((sg_comm_quant_t)fmt, (const float *)in, count,
                            (void *)wire);
  Py_END_ALLOW_THREADS
  if (rc < 0)
    return sg_py_raise((sg_py_state *)PyModule_GetState(mod), rc,
                       "quant_encode: unknown format");
  return PyLong_FromLong(rc);
}

PyObject *sg_py_quant_decode(PyObject *mod, PyObject *args) {
  int fmt, rc;
  size_t wire, nbytes, count, out;
  if (!PyArg_ParseTuple(args, "innnn:quant_decode", &fmt, &wire, &nbytes,
                        &count, &out))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_comm_quant_decode((sg_comm_quant_t)fmt, (const void *)wire, nbytes,
                            count, (float *)out);
  Py_END_ALLOW_THREADS
  if (rc < 0)
    return sg_py_raise((sg_py_state *)PyModule_GetState(mod), rc,
                       "quant_decode: not a block of that format and size");
  Py_RETURN_NONE;
}

static PyObject *fp8_convert(PyObject *args, int to_f32) {
  size_t in, out, n;
  if (!PyArg_ParseTuple(args, "nnn", &in, &out, &n))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  if (to_f32)
    sg_comm_fp8_to_f32((const uint8_t *)in, (float *)out, n);
  else
    sg_comm_fp8_from_f32((const float *)in, (uint8_t *)out, n);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject *sg_py_fp8_from_f32(PyObject *mod, PyObject *args) {
  return fp8_convert(args, 0);
}

PyObject *sg_py_fp8_to_f32(PyObject *mod, PyObject *args) {
  return fp8_convert(args, 1);
}

static PyObject *comm_alltoall(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  PyObject *ins_l, *inb_l, *outs_l, *outb_l, *fn;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "OOOOdO:alltoall", &ins_l, &inb_l, &outs_l,
                        &outb_l, &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  size_t w = (size_t)self->world;
  size_t *v = PyMem_Calloc(4 * w, sizeof(size_t));
  void **p = PyMem_Calloc(2 * w, sizeof(void *));
  PyObject *ret = NULL;
  if (!v || !p) {
    PyErr_NoMemory();
  } else if (ptr_array(ins_l, self->world, v, "inputs") == 0 &&
             ptr_array(inb_l, self->world, v + w, "input sizes") == 0 &&
             ptr_array(outs_l, self->world, v + 2 * w, "outputs") == 0 &&
             ptr_array(outb_l, self->world, v + 3 * w, "output sizes") == 0) {
    for (size_t i = 0; i < w; i++) {
      p[i] = (void *)v[i];
      p[w + i] = (void *)v[2 * w + i];
    }
    sg_err_t err;
    sg_err_clear(&err);
    Py_INCREF(fn);
    int rc =
        sg_comm_alltoall(self->comm, (const void *const *)p, v + w, p + w,
                         v + 3 * w, sg_deadline_in_ms(ms), on_done, fn, &err);
    ret = submit_done(self, rc, &err, fn);
  }
  PyMem_Free(v);
  PyMem_Free(p);
  return ret;
}

static PyObject *p2p(PyObject *self_obj, PyObject *args, int is_send) {
  comm_obj *self = (comm_obj *)self_obj;
  size_t ptr, nbytes;
  int peer;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "nnidO", &ptr, &nbytes, &peer, &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc = is_send ? sg_comm_send(self->comm, (void *)ptr, nbytes, peer,
                                  sg_deadline_in_ms(ms), on_done, fn, &err)
                   : sg_comm_recv(self->comm, (void *)ptr, nbytes, peer,
                                  sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

static PyObject *comm_send(PyObject *self_obj, PyObject *args) {
  return p2p(self_obj, args, 1);
}

static PyObject *comm_recv(PyObject *self_obj, PyObject *args) {
  return p2p(self_obj, args, 0);
}

static PyObject *comm_barrier(PyObject *self_obj, PyObject *args) {
  comm_obj *self = (comm_obj *)self_obj;
  double timeout_s;
  PyObject *fn;
  if (!PyArg_ParseTuple(args, "dO:barrier", &timeout_s, &fn))
    return NULL;
  int64_t ms;
  if (guard(self) < 0 || check_fn(fn) < 0 ||
      (ms = sg_py_timeout_ms(timeout_s)) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  Py_INCREF(fn);
  int rc =
      sg_comm_barrier(self->comm, sg_deadline_in_ms(ms), on_done, fn, &err);
  return submit_done(self, rc, &err, fn);
}

static PyObject *comm_abort(PyObject *self_obj, PyObject *unused) {
  comm_obj *self = (comm_obj *)self_obj;
  if (self->comm) {
    sg_comm_t *c = self->comm;
    Py_BEGIN_ALLOW_THREADS
    sg_comm_abort(c);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *comm_error(PyObject *self_obj, PyObject *unused) {
  comm_obj *self = (comm_obj *)self_obj;
  if (guard(self) < 0)
    return NULL;
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_comm_error(self->comm, &err);
  if (!rc)
    Py_RETURN_NONE;
  return Py_BuildValue("(is)", rc, err.msg);
}

static void close_now(comm_obj *self) {
  sg_comm_t *c = self->comm;
  self->comm = NULL;
  if (c) {
    Py_BEGIN_ALLOW_THREADS
    sg_comm_free(c);
    Py_END_ALLOW_THREADS
  }
}

static PyObject *comm_close(PyObject *self_obj, PyObject *unused) {
  close_now((comm_obj *)self_obj);
  Py_RETURN_NONE;
}

static void comm_dealloc(PyObject *self_obj) {
  comm_obj *self = (comm_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  if (self->comm) {
    PyErr_WarnFormat(PyExc_ResourceWarning, 1, "unclosed Comm; call close()");
    close_now(self);
  }
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef comm_methods[] = {
    {"port", comm_port, METH_NOARGS, "port() -> int: the listening port."},
    {"same_host", comm_same_host, METH_O,
     "same_host(peer) -> bool: whether payloads from `peer` are read from "
     "its memory (same-host path) rather than received over TCP."},
    {"connect", comm_connect, METH_VARARGS,
     "connect(addrs, timeout_s): build the mesh ('host:port' per rank)."},
    {"allreduce", comm_allreduce, METH_VARARGS,
     "allreduce(ptr, count, dtype, op, timeout_s, done)"},
    {"broadcast", comm_broadcast, METH_VARARGS,
     "broadcast(ptr, nbytes, root, timeout_s, done)"},
    {"allgather", comm_allgather, METH_VARARGS,
     "allgather(in_ptr, nbytes, out_ptrs, timeout_s, done)"},
    {"reduce_scatter", comm_reduce_scatter, METH_VARARGS,
     "reduce_scatter(in_ptrs, out_ptr, count, dtype, op, timeout_s, done)"},
    {"allreduce_quantized", comm_allreduce_quantized, METH_VARARGS,
     "allreduce_quantized(ptr, count, fmt, op, timeout_s, done): float32"},
    {"reduce_scatter_quantized", comm_reduce_scatter_quantized, METH_VARARGS,
     "reduce_scatter_quantized(in_ptr, out_ptr, count, fmt, op, timeout_s, "
     "done): float32; in holds world_size * count"},
    {"alltoall", comm_alltoall, METH_VARARGS,
     "alltoall(in_ptrs, in_bytes, out_ptrs, out_bytes, timeout_s, done)"},
    {"send", comm_send, METH_VARARGS,
     "send(ptr, nbytes, dst, timeout_s, done)"},
    {"recv", comm_recv, METH_VARARGS,
     "recv(ptr, nbytes, src, timeout_s, done)"},
    {"barrier", comm_barrier, METH_VARARGS, "barrier(timeout_s, done)"},
    {"abort", comm_abort, METH_NOARGS,
     "abort(): fail everything in flight; later calls raise."},
    {"error", comm_error, METH_NOARGS,
     "error() -> (code, msg) | None: the sticky error."},
    {"close", comm_close, METH_NOARGS,
     "close(): cancel queued work and release (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_init, comm_init},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_methods, comm_methods},
    {Py_tp_doc, "Comm(rank, world_size, generation=0, job=None, "
                "auth_token=None, bind_host=None, small_max=0, "
                "progress_timeout_ms=0): a "
                "communicator of TCP collectives; done(rc, msg) callables "
                "run on its progress thread."},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "stepguard._C.Comm",
    .basicsize = sizeof(comm_obj),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = comm_slots,
};

int sg_py_comm_init(PyObject *module, sg_py_state *st) {
  st->comm_types[0] = PyType_FromModuleAndSpec(module, &comm_spec, NULL);
  if (!st->comm_types[0])
    return -1;
  if (PyModule_AddObjectRef(module, "Comm", st->comm_types[0]) < 0)
    return -1;
  static const struct {
    const char *name;
    int v;
  } consts[] = {
      {"COMM_F32", SG_COMM_F32},         {"COMM_F64", SG_COMM_F64},
      {"COMM_F16", SG_COMM_F16},         {"COMM_BF16", SG_COMM_BF16},
      {"COMM_I8", SG_COMM_I8},           {"COMM_U8", SG_COMM_U8},
      {"COMM_I32", SG_COMM_I32},         {"COMM_I64", SG_COMM_I64},
      {"COMM_SUM", SG_COMM_SUM},         {"COMM_AVG", SG_COMM_AVG},
      {"COMM_MIN", SG_COMM_MIN},         {"COMM_MAX", SG_COMM_MAX},
      {"COMM_PRODUCT", SG_COMM_PRODUCT}, {"QUANT_INT8", SG_COMM_QUANT_INT8},
      {"QUANT_FP8", SG_COMM_QUANT_FP8},
  };
  for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++)
    if (PyModule_AddIntConstant(module, consts[i].name, consts[i].v) < 0)
      return -1;
  return 0;
}
