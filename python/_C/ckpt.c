/*
 * ckpt.c: stepguard._C.CkptServer and CkptFetch, heap types over
 * sg_ckpt_server_t and sg_ckpt_fetch_t.
 *
 * Regions cross as two buffers of 8-byte integers (pointers and lengths,
 * e.g. array('Q')), so a state dict of many tensors costs no Python tuple
 * per tensor.  The pointers are borrowed: the Python caller keeps what they
 * point into alive (and unchanged, for the server) until disallow() or
 * shutdown() returns (server) or data() returns (fetch).  The served header
 * is a buffer the server object holds a view of until then.
 *
 * Every call that can wait runs without the GIL; fetch calls go through
 * sg_py_blocking so Ctrl-C aborts them.
 */
#include "module.h"

#include <string.h>

#include "stepguard/ckpt.h"

/* ---- regions from two buffers --------------------------------------------
 */

/* get_regions: build n regions from `ptrs` and `lens` (8-byte items). */
static int get_regions(PyObject *ptrs, PyObject *lens, sg_ckpt_region_t **out,
                       size_t *n) {
  Py_buffer bp, bl;
  int rc = -1;
  *out = NULL;
  *n = 0;
  if (PyObject_GetBuffer(ptrs, &bp, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
    return -1;
  if (PyObject_GetBuffer(lens, &bl, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    PyBuffer_Release(&bp);
    return -1;
  }
  if (bp.itemsize != 8 || bl.itemsize != 8 || bp.len != bl.len) {
    PyErr_SetString(PyExc_ValueError,
                    "ptrs and lens must be equally long buffers of 8-byte "
                    "integers");
    goto out;
  }
  size_t count = (size_t)bp.len / 8;
  if (count > SG_CKPT_MAX_REGIONS) {
    PyErr_SetString(PyExc_ValueError, "too many regions");
    goto out;
  }
  sg_ckpt_region_t *r = PyMem_Calloc(count ? count : 1, sizeof(*r));
  if (!r) {
    PyErr_NoMemory();
    goto out;
  }
  const uint64_t *p = bp.buf, *l = bl.buf;
  for (size_t i = 0; i < count; i++) {
    r[i].ptr = (void *)(uintptr_t)p[i];
    r[i].len = l[i];
  }
  *out = r;
  *n = count;
  rc = 0;
out:
  PyBuffer_Release(&bp);
  PyBuffer_Release(&bl);
  return rc;
}

/* ---- CkptServer -------------------------------------------------------------
 */

typedef struct {
  PyObject_HEAD sg_ckpt_server_t *srv;
  Py_buffer header; /* held while serving */
  int has_header;
  int busy; /* calls running without the GIL */
} ckpt_server_obj;

static int ckptserver_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  static char *kwlist[] = {
      "bind", "auth_token", "max_conns", "request_timeout_s", "stall_timeout_s",
      NULL};
  const char *bind = NULL, *token = NULL;
  int max_conns = 0;
  double req_s = 30.0, stall_s = 30.0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzidd:CkptServer", kwlist, &bind,
                                   &token, &max_conns, &req_s, &stall_s))
    return -1;
  if (self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "CkptServer already started");
    return -1;
  }
  int64_t req_ms = sg_py_timeout_ms(req_s), stall_ms;
  if (req_ms < 0 || (stall_ms = sg_py_timeout_ms(stall_s)) < 0)
    return -1;
  sg_ckpt_server_opts_t o;
  sg_ckpt_server_opts_init(&o);
  o.bind = bind;
  o.auth_token = token;
  o.max_conns = max_conns;
  o.request_timeout_ms = req_ms > 0 ? req_ms : 1;
  o.stall_timeout_ms = stall_ms > 0 ? stall_ms : 1;
  sg_err_t err;
  sg_err_clear(&err);
  sg_ckpt_server_t *srv = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_ckpt_server_start(&o, &srv, &err);
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

static int ckptserver_guard(ckpt_server_obj *self) {
  if (!self->srv) {
    PyErr_SetString(PyExc_RuntimeError, "CkptServer is shut down");
    return -1;
  }
  return 0;
}

static void release_header(ckpt_server_obj *self) {
  if (self->has_header) {
    self->has_header = 0;
    PyBuffer_Release(&self->header);
  }
}

static PyObject *ckptserver_port(PyObject *self_obj, PyObject *unused) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  if (ckptserver_guard(self) < 0)
    return NULL;
  return PyLong_FromLong(sg_ckpt_server_port(self->srv));
}

static PyObject *ckptserver_serve(PyObject *self_obj, PyObject *args) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  long long step;
  PyObject *header, *ptrs, *lens;
  if (!PyArg_ParseTuple(args, "LOOO:serve", &step, &header, &ptrs, &lens))
    return NULL;
  if (ckptserver_guard(self) < 0)
    return NULL;
  if (self->has_header) {
    PyErr_SetString(PyExc_RuntimeError,
                    "already serving; call disallow() first");
    return NULL;
  }
  sg_ckpt_region_t *regs = NULL;
  size_t n = 0;
  if (get_regions(ptrs, lens, &regs, &n) < 0)
    return NULL;
  if (PyObject_GetBuffer(header, &self->header, PyBUF_SIMPLE) < 0) {
    PyMem_Free(regs);
    return NULL;
  }
  self->has_header = 1;
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_ckpt_server_serve(self->srv, step, self->header.buf,
                                (size_t)self->header.len, regs, n, &err);
  PyMem_Free(regs);
  if (rc) {
    release_header(self);
    if (rc == SG_EINVAL || rc == SG_ETOOBIG) {
      PyErr_SetString(PyExc_ValueError, err.msg);
      return NULL;
    }
    return sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), rc, err.msg);
  }
  Py_RETURN_NONE;
}

static PyObject *ckptserver_disallow(PyObject *self_obj, PyObject *args) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "d:disallow", &timeout_s))
    return NULL;
  if (ckptserver_guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  sg_deadline_t d = sg_deadline_in_ms(ms);
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_ckpt_server_disallow(self->srv, d);
  Py_END_ALLOW_THREADS
  self->busy--;
  release_header(self);
  return PyBool_FromLong(rc == 0);
}

static PyObject *ckptserver_stats(PyObject *self_obj, PyObject *unused) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  if (ckptserver_guard(self) < 0)
    return NULL;
  sg_ckpt_server_stats_t s;
  sg_ckpt_server_stats(self->srv, &s);
  return Py_BuildValue(
      "{sKsKsKsKsKsKsKsKsi}", "bytes_sent", (unsigned long long)s.bytes_sent,
      "requests", (unsigned long long)s.requests, "refused",
      (unsigned long long)s.refused, "bad_input",
      (unsigned long long)s.bad_input, "timeouts",
      (unsigned long long)s.timeouts, "cut", (unsigned long long)s.cut, "conns",
      (unsigned long long)s.conns, "maps", (unsigned long long)s.maps,
      "open_conns", s.open_conns);
}

static void ckptserver_stop(ckpt_server_obj *self) {
  sg_ckpt_server_t *srv = self->srv;
  self->srv = NULL;
  if (srv) {
    Py_BEGIN_ALLOW_THREADS
    sg_ckpt_server_stop(srv);
    Py_END_ALLOW_THREADS
  }
  release_header(self);
}

static PyObject *ckptserver_shutdown(PyObject *self_obj, PyObject *unused) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  if (self->busy) {
    PyErr_SetString(PyExc_RuntimeError,
                    "CkptServer.shutdown() while disallow() runs");
    return NULL;
  }
  ckptserver_stop(self);
  Py_RETURN_NONE;
}

static void ckptserver_dealloc(PyObject *self_obj) {
  ckpt_server_obj *self = (ckpt_server_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  if (self->srv) {
    PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                     "unclosed CkptServer; call shutdown()");
    ckptserver_stop(self);
  }
  release_header(self);
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

static PyMethodDef ckptserver_methods[] = {
    {"port", ckptserver_port, METH_NOARGS, "port() -> int: the bound port."},
    {"serve", ckptserver_serve, METH_VARARGS,
     "serve(step, header, ptrs, lens): serve `step`: the header buffer and "
     "the regions (ptrs[i], lens[i]); the memory must stay valid and "
     "unchanged until disallow() or shutdown() returns."},
    {"disallow", ckptserver_disallow, METH_VARARGS,
     "disallow(timeout_s) -> bool: stop serving; waits for responses in "
     "flight up to timeout_s, then cuts them (returns False then)."},
    {"stats", ckptserver_stats, METH_NOARGS, "stats() -> dict of counters."},
    {"shutdown", ckptserver_shutdown, METH_NOARGS,
     "shutdown(): stop the server (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot ckptserver_slots[] = {
    {Py_tp_init, ckptserver_init},
    {Py_tp_dealloc, ckptserver_dealloc},
    {Py_tp_methods, ckptserver_methods},
    {Py_tp_doc, "CkptServer(bind=None, auth_token=None, max_conns=0, "
                "request_timeout_s=30.0, stall_timeout_s=30.0)"},
    {0, NULL},
};

static PyType_Spec ckptserver_spec = {
    .name = "stepguard._C.CkptServer",
    .basicsize = sizeof(ckpt_server_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = ckptserver_slots,
};

/* ---- CkptFetch --------------------------------------------------------------
 */

typedef struct {
  PyObject_HEAD sg_ckpt_fetch_t *f;
} ckpt_fetch_obj;

static int ckptfetch_init(PyObject *self_obj, PyObject *args, PyObject *kw) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  static char *kwlist[] = {NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kw, ":CkptFetch", kwlist))
    return -1;
  if (self->f)
    return 0;
  if (sg_ckpt_fetch_new(&self->f)) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

static int ckptfetch_guard(ckpt_fetch_obj *self) {
  if (!self->f) {
    PyErr_SetString(PyExc_RuntimeError, "CkptFetch is not initialised");
    return -1;
  }
  return 0;
}

struct info_call {
  sg_ckpt_fetch_t *f;
  const char *addr, *token;
  int64_t step;
  sg_deadline_t deadline;
  sg_ckpt_info_t info;
  sg_err_t err;
  int rc;
};

static void info_run(void *p) {
  struct info_call *c = p;
  c->rc = sg_ckpt_fetch_info(c->f, c->addr, c->token, c->step, c->deadline,
                             &c->info, &c->err);
}

static void call_abort(void *p) {
  sg_ckpt_fetch_abort(*(sg_ckpt_fetch_t **)p); /* f is the first field */
}

static PyObject *ckptfetch_info(PyObject *self_obj, PyObject *args) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  struct info_call c;
  memset(&c, 0, sizeof(c));
  long long step;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "szLd:info", &c.addr, &c.token, &step,
                        &timeout_s))
    return NULL;
  if (ckptfetch_guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  c.f = self->f;
  c.step = step;
  c.deadline = sg_deadline_in_ms(ms);
  if (sg_py_blocking(info_run, call_abort, &c) < 0) {
    sg_ckpt_info_free(&c.info);
    return NULL;
  }
  if (c.rc)
    return sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), c.rc, c.err.msg);
  PyObject *lens = NULL, *hdr = NULL, *ret = NULL;
  lens = PyList_New((Py_ssize_t)c.info.nregions);
  if (!lens)
    goto out;
  for (size_t i = 0; i < c.info.nregions; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(c.info.lens[i]);
    if (!v)
      goto out;
    PyList_SET_ITEM(lens, (Py_ssize_t)i, v);
  }
  hdr = PyBytes_FromStringAndSize((const char *)c.info.header,
                                  (Py_ssize_t)c.info.hlen);
  if (!hdr)
    goto out;
  ret = Py_BuildValue("(OOK)", hdr, lens, (unsigned long long)c.info.layout);
out:
  Py_XDECREF(lens);
  Py_XDECREF(hdr);
  sg_ckpt_info_free(&c.info);
  return ret;
}

struct data_call {
  sg_ckpt_fetch_t *f;
  const char **addrs;
  size_t naddr;
  const char *token;
  int64_t step;
  uint64_t layout;
  sg_ckpt_region_t *regs;
  size_t n;
  sg_ckpt_fetch_opts_t o;
  sg_deadline_t deadline;
  uint64_t *bytes;
  sg_err_t err;
  int rc;
};

static void data_run(void *p) {
  struct data_call *c = p;
  c->rc =
      sg_ckpt_fetch_data(c->f, c->addrs, c->naddr, c->token, c->step, c->layout,
                         c->regs, c->n, &c->o, c->deadline, c->bytes, &c->err);
}

static PyObject *ckptfetch_data(PyObject *self_obj, PyObject *args,
                                PyObject *kw) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  static char *kwlist[] = {"addrs",     "token",     "step",    "layout",
                           "ptrs",      "lens",      "streams", "timeout_s",
                           "min_chunk", "same_host", "mapped",  NULL};
  struct data_call c;
  memset(&c, 0, sizeof(c));
  PyObject *addrs, *ptrs, *lens, *mapped = Py_None, *seq = NULL, *ret = NULL;
  Py_buffer mbuf = {0};
  long long step;
  unsigned long long layout, min_chunk = 0;
  int streams = 0, same_host = 1;
  double timeout_s;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OzLKOOid|KpO:data", kwlist,
                                   &addrs, &c.token, &step, &layout, &ptrs,
                                   &lens, &streams, &timeout_s, &min_chunk,
                                   &same_host, &mapped))
    return NULL;
  if (ckptfetch_guard(self) < 0)
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  seq = PySequence_Fast(addrs, "addrs must be a sequence of str");
  if (!seq)
    return NULL;
  Py_ssize_t na = PySequence_Fast_GET_SIZE(seq);
  if (na < 1 || na > SG_CKPT_MAX_SOURCES) {
    PyErr_SetString(PyExc_ValueError, "between 1 and 256 sources");
    goto out;
  }
  c.addrs = PyMem_Calloc((size_t)na, sizeof(*c.addrs));
  c.bytes = PyMem_Calloc((size_t)na, sizeof(*c.bytes));
  if (!c.addrs || !c.bytes) {
    PyErr_NoMemory();
    goto out;
  }
  for (Py_ssize_t i = 0; i < na; i++) {
    c.addrs[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (!c.addrs[i])
      goto out;
  }
  if (get_regions(ptrs, lens, &c.regs, &c.n) < 0)
    goto out;
  if (mapped != Py_None) {
    /* a reference is held (args) and bytes are immutable: the buffer stays
     * valid while the call runs without the GIL */
    if (!PyBytes_Check(mapped) ||
        PyObject_GetBuffer(mapped, &mbuf, PyBUF_SIMPLE) < 0) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "mapped must be bytes or None");
      goto out;
    }
    if ((size_t)mbuf.len != c.n) {
      PyErr_SetString(PyExc_ValueError, "mapped needs one flag per region");
      goto out;
    }
    c.o.mapped = mbuf.buf;
  }
  c.f = self->f;
  c.naddr = (size_t)na;
  c.step = step;
  c.layout = layout;
  c.o.streams_per_source = streams;
  c.o.min_chunk = min_chunk;
  c.o.same_host = same_host ? 0 : -1;
  c.deadline = sg_deadline_in_ms(ms);
  if (sg_py_blocking(data_run, call_abort, &c) < 0)
    goto out;
  if (c.rc) {
    if (c.rc == SG_EINVAL)
      PyErr_SetString(PyExc_ValueError, c.err.msg);
    else
      sg_py_raise(sg_py_state_of_type(Py_TYPE(self)), c.rc, c.err.msg);
    goto out;
  }
  ret = PyList_New(na);
  if (!ret)
    goto out;
  for (Py_ssize_t i = 0; i < na; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(c.bytes[i]);
    if (!v) {
      Py_CLEAR(ret);
      goto out;
    }
    PyList_SET_ITEM(ret, i, v);
  }
out:
  if (mbuf.obj)
    PyBuffer_Release(&mbuf);
  PyMem_Free(c.addrs);
  PyMem_Free(c.bytes);
  PyMem_Free(c.regs);
  Py_XDECREF(seq);
  return ret;
}

static PyObject *ckptfetch_stats(PyObject *self_obj, PyObject *unused) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  if (ckptfetch_guard(self) < 0)
    return NULL;
  sg_ckpt_fetch_stats_t s;
  sg_ckpt_fetch_stats(self->f, &s);
  return Py_BuildValue("{sKsKsI}", "same_host_bytes",
                       (unsigned long long)s.same_host_bytes, "tcp_bytes",
                       (unsigned long long)s.tcp_bytes, "same_host_sources",
                       (unsigned int)s.same_host_sources);
}

static PyObject *ckptfetch_abort(PyObject *self_obj, PyObject *unused) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  if (ckptfetch_guard(self) < 0)
    return NULL;
  sg_ckpt_fetch_abort(self->f);
  Py_RETURN_NONE;
}

static void ckptfetch_dealloc(PyObject *self_obj) {
  ckpt_fetch_obj *self = (ckpt_fetch_obj *)self_obj;
  PyTypeObject *tp = Py_TYPE(self);
  sg_ckpt_fetch_free(self->f); /* no call runs: it would hold a reference */
  tp->tp_free(self_obj);
  Py_DECREF(tp);
}

/* ---- plan: destinations for a header's leaves -------------------------------
 *
 * One pass over the received header's leaves in C: the region table is
 * checked against the header, and every tensor whose counterpart in the
 * replica's own state can take its bytes in place gets that tensor's address.
 * Reading a handful of attributes per tensor through the C API costs a
 * fraction of what the same checks cost as Python bytecode, which matters at
 * thousands of tensors per state.
 */

typedef struct {
  PyObject *torch, *dtypes, *dtype_type, *strided, *tensor_t, *param_t;
  PyObject *s_dtype, *s_shape, *s_stride, *s_is_cpu, *s_layout, *s_is_nested,
      *s_data_ptr, *s_requires_grad, *s_itemsize;
} plan_ctx;

typedef struct {
  uint64_t start, end;
  Py_ssize_t leaf;
  size_t region;
} plan_hit;

static int hit_cmp(const void *a, const void *b) {
  const plan_hit *x = a, *y = b;
  if (x->start != y->start)
    return x->start < y->start ? -1 : 1;
  return x->leaf < y->leaf ? -1 : x->leaf > y->leaf;
}

static int plan_bad(const char *what, Py_ssize_t i) {
  PyErr_Format(PyExc_RuntimeError, "bad checkpoint header: leaf %zd: %s", i,
               what);
  return -1;
}

/* plan_dtype: the (dtype, itemsize) pair named `name`, cached in dtypes. */
static PyObject *plan_dtype(plan_ctx *c, PyObject *name, Py_ssize_t i) {
  PyObject *hit = PyDict_GetItemWithError(c->dtypes, name); /* borrowed */
  if (hit || PyErr_Occurred())
    return hit;
  PyObject *dt = PyObject_GetAttr(c->torch, name), *size = NULL;
  if (!dt) {
    PyErr_Clear();
    plan_bad("unknown dtype", i);
    return NULL;
  }
  if (!PyObject_TypeCheck(dt, (PyTypeObject *)c->dtype_type) ||
      !(size = PyObject_GetAttr(dt, c->s_itemsize))) {
    Py_DECREF(dt);
    if (!PyErr_Occurred())
      plan_bad("not a dtype", i);
    return NULL;
  }
  PyObject *pair = PyTuple_Pack(2, dt, size);
  Py_DECREF(dt);
  Py_DECREF(size);
  if (!pair || PyDict_SetItem(c->dtypes, name, pair) < 0) {
    Py_XDECREF(pair);
    return NULL;
  }
  Py_DECREF(pair); /* the dict holds it */
  return pair;
}

/* plan_elems: product of a shape tuple of non-negative ints (-1: bad). */
static int plan_elems(PyObject *shape, PyObject *stride, uint64_t *out) {
  if (!PyTuple_Check(shape) || !PyTuple_Check(stride) ||
      PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(stride))
    return -1;
  uint64_t n = 1;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape); k++) {
    PyObject *d = PyTuple_GET_ITEM(shape, k);
    if (!PyLong_Check(d))
      return -1;
    long long v = PyLong_AsLongLong(d);
    if (v < 0) {
      PyErr_Clear();
      return -1;
    }
    if (v && n > SG_CKPT_MAX_TOTAL / (uint64_t)v)
      return -1;
    n *= (uint64_t)v;
  }
  *out = n;
  return 0;
}

/* attr_is: 1 when t.<name> is `want` (identity), 0 when not, -1 error. */
static int attr_is(PyObject *t, PyObject *name, PyObject *want) {
  PyObject *v = PyObject_GetAttr(t, name);
  if (!v)
    return -1;
  int r = v == want;
  Py_DECREF(v);
  return r;
}

static int attr_eq(PyObject *v, PyObject *want) {
  if (!v)
    return -1;
  int r = PyObject_RichCompareBool(v, want, Py_EQ);
  Py_DECREF(v);
  return r;
}

/*
 * plan_check: 1 when tensor `t` can take the region in place (*start: its
 * address), 0 when not, -1 on error.  A plain CPU strided tensor with the
 * same dtype, shape and strides (the caller checks the span is dense); the
 * kind is checked first, since sparse and nested tensors have no strides.
 */
static int plan_check(plan_ctx *c, PyObject *t, PyObject *dtype,
                      PyObject *shape, PyObject *stride, uint64_t *start) {
  int r;
  if ((r = attr_is(t, c->s_dtype, dtype)) != 1)
    return r;
  if ((r = attr_is(t, c->s_layout, c->strided)) != 1)
    return r;
  if ((r = attr_is(t, c->s_is_cpu, Py_True)) != 1)
    return r;
  if ((r = attr_is(t, c->s_is_nested, Py_False)) != 1)
    return r;
  if ((r = attr_eq(PyObject_GetAttr(t, c->s_shape), shape)) != 1)
    return r;
  if ((r = attr_eq(PyObject_CallMethodNoArgs(t, c->s_stride), stride)) != 1)
    return r;
  PyObject *p = PyObject_CallMethodNoArgs(t, c->s_data_ptr);
  if (!p)
    return -1;
  unsigned long long a = PyLong_AsUnsignedLongLong(p);
  Py_DECREF(p);
  if (a == (unsigned long long)-1 && PyErr_Occurred())
    return -1;
  *start = a;
  return a != 0;
}

/* plan_match: plan_check for a tensor of exactly torch.Tensor or
 * Parameter; a tensor whose attributes raise does not match. */
static int plan_match(plan_ctx *c, PyObject *t, PyObject *dtype,
                      PyObject *shape, PyObject *stride, uint64_t *start) {
  if (Py_TYPE(t) != (PyTypeObject *)c->tensor_t &&
      Py_TYPE(t) != (PyTypeObject *)c->param_t)
    return 0;
  int r = plan_check(c, t, dtype, shape, stride, start);
  if (r < 0) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
      return -1; /* KeyboardInterrupt and the like */
    PyErr_Clear();
    r = 0;
  }
  return r;
}

/* plan_keeps: whether in-place tensor `t` is returned as it is (its
 * requires_grad and Parameter-ness are the header's); -1 on error. */
static int plan_keeps(plan_ctx *c, PyObject *t, PyObject *rg, PyObject *param) {
  int want_rg = PyObject_IsTrue(rg), want_p = PyObject_IsTrue(param);
  if (want_rg < 0 || want_p < 0)
    return -1;
  PyObject *v = PyObject_GetAttr(t, c->s_requires_grad);
  if (!v)
    return -1;
  int has_rg = v == Py_True;
  Py_DECREF(v);
  int is_p = Py_TYPE(t) == (PyTypeObject *)c->param_t;
  return has_rg == want_rg && is_p == want_p;
}

static PyObject *ckptfetch_plan(PyObject *self_obj, PyObject *args) {
  plan_ctx c;
  PyObject *metas, *mine, *lens_obj, *ret = NULL;
  PyObject *leaves = NULL, *ptrs = NULL, *mapped = NULL, *rest = NULL;
  plan_hit *hits = NULL;
  Py_buffer lb = {0};
  static const char *const names[] = {"dtype",    "shape",         "stride",
                                      "is_cpu",   "layout",        "is_nested",
                                      "data_ptr", "requires_grad", "itemsize"};
  memset(&c, 0, sizeof(c));
  PyObject **slots[] = {&c.s_dtype,    &c.s_shape,         &c.s_stride,
                        &c.s_is_cpu,   &c.s_layout,        &c.s_is_nested,
                        &c.s_data_ptr, &c.s_requires_grad, &c.s_itemsize};
  (void)self_obj;
  if (!PyArg_ParseTuple(args, "O!OOOO!OOOO:plan", &PyList_Type, &metas, &mine,
                        &lens_obj, &c.torch, &PyDict_Type, &c.dtypes,
                        &c.dtype_type, &c.strided, &c.tensor_t, &c.param_t))
    return NULL;
  if (!PyType_Check(c.dtype_type) || !PyType_Check(c.tensor_t) ||
      !PyType_Check(c.param_t)) {
    PyErr_SetString(PyExc_TypeError, "plan: dtype, tensor and parameter types");
    return NULL;
  }
  Py_ssize_t nleaves = PyList_GET_SIZE(metas);
  if (mine != Py_None &&
      (!PyList_Check(mine) || PyList_GET_SIZE(mine) != nleaves)) {
    PyErr_SetString(PyExc_ValueError, "mine: None or a list, one per leaf");
    return NULL;
  }
  if (PyObject_GetBuffer(lens_obj, &lb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
    return NULL;
  if (lb.itemsize != 8) {
    PyErr_SetString(PyExc_ValueError, "lens: a buffer of 8-byte integers");
    goto out;
  }
  const uint64_t *lens = lb.buf;
  size_t nreg = (size_t)lb.len / 8;
  for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
    if (!(*slots[k] = PyUnicode_InternFromString(names[k])))
      goto out;
  leaves = PyList_New(nleaves);
  ptrs = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(nreg * 8));
  mapped = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)nreg);
  rest = PyList_New(0);
  hits = PyMem_Calloc(nreg ? nreg : 1, sizeof(*hits));
  if (!leaves || !ptrs || !mapped || !rest || !hits) {
    if (!PyErr_Occurred())
      PyErr_NoMemory();
    goto out;
  }
  uint64_t *ptr = (uint64_t *)(void *)PyByteArray_AS_STRING(ptrs);
  uint8_t *map = (uint8_t *)PyByteArray_AS_STRING(mapped);
  memset(ptr, 0, nreg * 8);
  memset(map, 0, nreg);
  size_t r = 0, nhits = 0;
  PyObject *prev = NULL, *dt = NULL; /* the last record checked, its dtype */
  long long span = 0, isz = 1;
  uint64_t numel = 0;
  for (Py_ssize_t i = 0; i < nleaves; i++) {
    PyObject *m = PyList_GET_ITEM(metas, i);
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(m, 0))) {
      plan_bad("not a leaf record", i);
      goto out;
    }
    PyObject *kind = PyTuple_GET_ITEM(m, 0);
    if (PyUnicode_CompareWithASCIIString(kind, "v") == 0) {
      PyObject *v = PyTuple_GET_ITEM(m, 1);
      Py_INCREF(v);
      PyList_SET_ITEM(leaves, i, v);
      continue;
    }
    if (PyUnicode_CompareWithASCIIString(kind, "t") != 0 ||
        PyTuple_GET_SIZE(m) != 8 || !PyUnicode_Check(PyTuple_GET_ITEM(m, 1)) ||
        !PyLong_Check(PyTuple_GET_ITEM(m, 4))) {
      plan_bad("not a leaf record", i);
      goto out;
    }
    Py_INCREF(Py_None);
    PyList_SET_ITEM(leaves, i, Py_None);
    if (r >= nreg) {
      PyErr_SetString(PyExc_RuntimeError,
                      "checkpoint header and region table disagree");
      goto out;
    }
    PyObject *shape = PyTuple_GET_ITEM(m, 2), *stride = PyTuple_GET_ITEM(m, 3);
    if (m != prev) { /* equal records arrive as one object: checked once */
      dt = plan_dtype(&c, PyTuple_GET_ITEM(m, 1), i);
      if (!dt)
        goto out;
      span = PyLong_AsLongLong(PyTuple_GET_ITEM(m, 4));
      isz = PyLong_AsLongLong(PyTuple_GET_ITEM(dt, 1));
      if (PyErr_Occurred() || span < 0 || isz <= 0 ||
          plan_elems(shape, stride, &numel) < 0) {
        PyErr_Clear();
        plan_bad("bad shape, strides or span", i);
        goto out;
      }
      prev = m;
    }
    if ((uint64_t)span > SG_CKPT_MAX_TOTAL / (uint64_t)isz ||
        (uint64_t)span * (uint64_t)isz != lens[r]) {
      PyErr_SetString(PyExc_RuntimeError,
                      "checkpoint header and region table disagree");
      goto out;
    }
    uint64_t start = 0;
    int ok = 0;
    if (mine != Py_None && span > 0 && (uint64_t)span == numel) {
      ok = plan_match(&c, PyList_GET_ITEM(mine, i), PyTuple_GET_ITEM(dt, 0),
                      shape, stride, &start);
      if (ok < 0)
        goto out;
    }
    if (ok) {
      hits[nhits].start = start;
      hits[nhits].end = start + lens[r];
      hits[nhits].leaf = i;
      hits[nhits].region = r;
      nhits++;
    }
    r++;
  }
  if (r != nreg) {
    PyErr_SetString(PyExc_RuntimeError,
                    "checkpoint header and region table disagree");
    goto out;
  }
  /* tied tensors: the first of overlapping memory in place, the rest fresh */
  qsort(hits, nhits, sizeof(*hits), hit_cmp);
  uint64_t end = 0, in_place = 0;
  for (size_t k = 0; k < nhits; k++) {
    plan_hit *h = &hits[k];
    if (h->start < end)
      continue; /* an alias: fresh memory */
    end = h->end > end ? h->end : end;
    ptr[h->region] = h->start;
    map[h->region] = 1;
    in_place += h->end - h->start;
  }
  /* leaves in header order: returned as they are, or left to the caller */
  r = 0;
  for (Py_ssize_t i = 0; i < nleaves; i++) {
    PyObject *m = PyList_GET_ITEM(metas, i);
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(m, 0), "v") == 0)
      continue;
    PyObject *own = Py_None;
    if (map[r]) {
      own = PyList_GET_ITEM(mine, i);
      int keep =
          plan_keeps(&c, own, PyTuple_GET_ITEM(m, 5), PyTuple_GET_ITEM(m, 6));
      if (keep < 0)
        goto out;
      if (keep) {
        Py_INCREF(own);
        PyList_SetItem(leaves, i, own);
        r++;
        continue;
      }
    }
    PyObject *item = Py_BuildValue("(nnO)", i, (Py_ssize_t)r, own);
    if (!item || PyList_Append(rest, item) < 0) {
      Py_XDECREF(item);
      goto out;
    }
    Py_DECREF(item);
    r++;
  }
  ret = Py_BuildValue("(OOOOK)", leaves, ptrs, mapped, rest,
                      (unsigned long long)in_place);
out:
  for (size_t s = 0; s < sizeof(slots) / sizeof(slots[0]); s++)
    Py_XDECREF(*slots[s]);
  PyMem_Free(hits);
  Py_XDECREF(leaves);
  Py_XDECREF(ptrs);
  Py_XDECREF(mapped);
  Py_XDECREF(rest);
  if (lb.obj)
    PyBuffer_Release(&lb);
  return ret;
}

static PyMethodDef ckptfetch_methods[] = {
    {"info", ckptfetch_info, METH_VARARGS,
     "info(addr, token, step, timeout_s) -> (header: bytes, lens: list[int], "
     "layout: int)"},
    {"data", (PyCFunction)(void (*)(void))ckptfetch_data,
     METH_VARARGS | METH_KEYWORDS,
     "data(addrs, token, step, layout, ptrs, lens, streams, timeout_s, "
     "min_chunk=0, same_host=True, mapped=None) -> list[int]: bytes taken "
     "from each source (same_host=False: TCP only; mapped: bytes, one flag "
     "per region, nonzero where its pages are already mapped)."},
    {"stats", ckptfetch_stats, METH_NOARGS,
     "stats() -> dict: what the last data() moved, same-host and TCP."},
    {"plan", ckptfetch_plan, METH_VARARGS,
     "plan(leaves, mine, lens, torch, dtypes, dtype_type, strided, "
     "tensor_type, parameter_type) -> (values, ptrs: bytearray, mapped: "
     "bytearray, rest: list[(leaf, region, own)], in_place_bytes): checks the "
     "header's leaf records against the region table `lens` and gives each "
     "tensor leaf whose counterpart mine[i] (None: no in-place fetch) can take "
     "it in place that tensor's address (aliases after the first: not); "
     "values holds the non-tensor leaves and the tensors returned as they "
     "are, rest the others (own: the in-place tensor, else None)."},
    {"abort", ckptfetch_abort, METH_NOARGS,
     "abort(): fail the running and every later call (any thread)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot ckptfetch_slots[] = {
    {Py_tp_init, ckptfetch_init},
    {Py_tp_dealloc, ckptfetch_dealloc},
    {Py_tp_methods, ckptfetch_methods},
    {Py_tp_doc, "CkptFetch(): one fetch (its abort is final)."},
    {0, NULL},
};

static PyType_Spec ckptfetch_spec = {
    .name = "stepguard._C.CkptFetch",
    .basicsize = sizeof(ckpt_fetch_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = ckptfetch_slots,
};

int sg_py_ckpt_init(PyObject *module, sg_py_state *st) {
  st->ckpt_types[0] = PyType_FromModuleAndSpec(module, &ckptserver_spec, NULL);
  if (!st->ckpt_types[0] ||
      PyModule_AddObjectRef(module, "CkptServer", st->ckpt_types[0]) < 0)
    return -1;
  st->ckpt_types[1] = PyType_FromModuleAndSpec(module, &ckptfetch_spec, NULL);
  if (!st->ckpt_types[1] ||
      PyModule_AddObjectRef(module, "CkptFetch", st->ckpt_types[1]) < 0)
    return -1;
  return 0;
}
