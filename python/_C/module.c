/*
 * module.c: stepguard._C, the thin CPython binding over libstepguard.
 *
 * Follows CPython's Modules/_sqlite: multi-phase init, per-module state,
 * no static Python objects.  Arguments are converted here and nothing
 * Python-shaped reaches libstepguard.  Every call that can wait releases the
 * GIL, and the C error becomes an exception only after the GIL is back:
 * SG_ETIMEDOUT -> TimeoutError, the rest -> stepguard._C.Error (a
 * RuntimeError subclass carrying `.code`), matching torchft's mapping.
 */
#include "module.h"

#include "stepguard/lighthouse.h"

static sg_py_state *get_state(PyObject *module) {
  return (sg_py_state *)PyModule_GetState(module);
}

static struct PyModuleDef module_def;

/* Walks the MRO, so instances of Python subclasses find the state too. */
sg_py_state *sg_py_state_of_type(PyTypeObject *tp) {
  PyObject *m = PyType_GetModuleByDef(tp, &module_def);
  return m ? get_state(m) : NULL;
}

#if PY_VERSION_HEX >= 0x030D0000
#define interpreter_finalizing() Py_IsFinalizing()
#else
#define interpreter_finalizing() _Py_IsFinalizing()
#endif

/* The threads whose thread state sg_py_gil_enter keeps: the key holds the
 * state, and its destructor frees it when the thread exits (by the state
 * itself: the C library may already have cleared CPython's own per-thread
 * key by then). */
static pthread_key_t pin_key;
static pthread_once_t pin_once = PTHREAD_ONCE_INIT;
static int pin_ok;

static void pin_release(void *ts) {
  if (interpreter_finalizing())
    return; /* the interpreter is going away: leave the state to it */
  PyEval_RestoreThread(ts);
  PyThreadState_Clear(ts);
  PyThreadState_DeleteCurrent(); /* and releases the GIL */
}

static void pin_init(void) {
  pin_ok = pthread_key_create(&pin_key, pin_release) == 0;
}

PyGILState_STATE sg_py_gil_enter(void) {
  int unknown = PyGILState_GetThisThreadState() == NULL;
  PyGILState_STATE g = PyGILState_Ensure();
  if (unknown) {
    pthread_once(&pin_once, pin_init);
    /* a second, never released count keeps the state alive between
     * calls; only a thread Python did not start is pinned (Python frees
     * the states of its own threads itself) */
    if (pin_ok && pthread_setspecific(pin_key, PyThreadState_Get()) == 0)
      (void)PyGILState_Ensure();
  }
  return g;
}

void sg_py_gil_leave(PyGILState_STATE g) { PyGILState_Release(g); }

int64_t sg_py_timeout_ms(double seconds) {
  if (!(seconds >= 0) || seconds > 86400.0 * 365) {
    PyErr_SetString(PyExc_ValueError, "timeout must be in [0, 1 year]");
    return -1;
  }
  return (int64_t)(seconds * 1000.0 + 0.5);
}

PyObject *sg_py_raise_rpc(sg_py_state *st, int code, const char *detail) {
  if (code != SG_ETIMEDOUT)
    return sg_py_raise(st, code, detail);
  PyErr_Format(PyExc_TimeoutError,
               "status: Cancelled, message: \"Timeout expired\", details: [] "
               "(%s)",
               detail && detail[0] ? detail : sg_strerror(code));
  return NULL;
}

static PyObject *raise_sg(PyObject *module, int code, const char *detail) {
  return sg_py_raise(get_state(module), code, detail);
}

PyObject *sg_py_raise(sg_py_state *st, int code, const char *detail) {
  const char *msg = detail && detail[0] ? detail : sg_strerror(code);
  if (code == SG_ETIMEDOUT || code == SG_ECANCELED) {
    PyErr_SetString(PyExc_TimeoutError, msg);
    return NULL;
  }
  if (code == SG_ENOMEM)
    return PyErr_NoMemory();
  PyObject *exc = PyObject_CallFunction(st->error_type, "s", msg);
  if (!exc)
    return NULL;
  PyObject *pycode = PyLong_FromLong(code);
  if (!pycode || PyObject_SetAttrString(exc, "code", pycode) < 0) {
    Py_XDECREF(pycode);
    Py_DECREF(exc);
    return NULL;
  }
  Py_DECREF(pycode);
  PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
  Py_DECREF(exc);
  return NULL;
}

static PyObject *py_version(PyObject *module, PyObject *unused) {
  return PyUnicode_FromString(sg_version());
}

static PyObject *py_strerror(PyObject *module, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred())
    return NULL;
  return PyUnicode_FromString(sg_strerror((int)code));
}

static PyObject *py_err_name(PyObject *module, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred())
    return NULL;
  return PyUnicode_FromString(sg_err_name((int)code));
}

static PyObject *py_err_is_fatal(PyObject *module, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred())
    return NULL;
  return PyBool_FromLong(sg_err_is_fatal((int)code));
}

static PyObject *py_monotonic_ns(PyObject *module, PyObject *unused) {
  return PyLong_FromLongLong(sg_now_ns());
}

static PyObject *py_log(PyObject *module, PyObject *args) {
  int level;
  const char *subsystem, *msg;
  if (!PyArg_ParseTuple(args, "iss:log", &level, &subsystem, &msg))
    return NULL;
  if (level < SG_LOG_ERROR || level > SG_LOG_TRACE) {
    PyErr_Format(PyExc_ValueError, "log level %d out of range", level);
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  sg_log((sg_log_level_t)level, subsystem, "%s", msg);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *py_set_log_level(PyObject *module, PyObject *arg) {
  const char *name = PyUnicode_AsUTF8(arg);
  if (!name)
    return NULL;
  int level = sg_log_level_parse(name);
  if (level < 0) {
    PyErr_Format(PyExc_ValueError, "unknown log level %R", arg);
    return NULL;
  }
  sg_log_set_level((sg_log_level_t)level);
  Py_RETURN_NONE;
}

static PyObject *py_tcp_listen(PyObject *module, PyObject *args) {
  const char *host;
  int port, backlog = 128, fd = -1, bound = 0, rc;
  sg_err_t err;
  if (!PyArg_ParseTuple(args, "si|i:tcp_listen", &host, &port, &backlog))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = sg_sock_listen(host, port, backlog, &fd, &bound, &err);
  Py_END_ALLOW_THREADS
  if (rc)
    return raise_sg(module, rc, err.msg);
  return Py_BuildValue("(ii)", fd, bound);
}

static PyObject *py_tcp_connect(PyObject *module, PyObject *args) {
  const char *host;
  int port, fd = -1, rc;
  double timeout_s;
  sg_err_t err;
  if (!PyArg_ParseTuple(args, "sid:tcp_connect", &host, &port, &timeout_s))
    return NULL;
  int64_t ms = sg_py_timeout_ms(timeout_s);
  if (ms < 0)
    return NULL;
  sg_deadline_t d = sg_deadline_in_ms(ms);
  Py_BEGIN_ALLOW_THREADS
  rc = sg_sock_connect(host, port, d, &fd, &err);
  Py_END_ALLOW_THREADS
  if (rc)
    return raise_sg(module, rc, err.msg);
  return PyLong_FromLong(fd);
}

static PyObject *py_tcp_close(PyObject *module, PyObject *arg) {
  int fd = PyLong_AsLong(arg);
  if (fd == -1 && PyErr_Occurred())
    return NULL;
  sg_sock_close(fd);
  Py_RETURN_NONE;
}

static PyObject *py_registered_sockets(PyObject *module, PyObject *unused) {
  return PyLong_FromSize_t(sg_sock_registered_count());
}

static PyObject *py_fork_count(PyObject *module, PyObject *unused) {
  return PyLong_FromUnsignedLong(sg_sock_fork_count());
}

static PyObject *py_raise_error(PyObject *module, PyObject *args) {
  int code;
  const char *detail = "";
  if (!PyArg_ParseTuple(args, "i|s:_raise_error", &code, &detail))
    return NULL;
  return raise_sg(module, code, detail);
}

/* split_address(addr) -> (host, port): the library's address parser. */
static PyObject *py_split_address(PyObject *module, PyObject *arg) {
  const char *addr = PyUnicode_AsUTF8(arg);
  if (!addr)
    return NULL;
  char host[SG_ADDR_MAX + 1];
  int port = 0;
  sg_err_t err;
  int rc = sg_addr_split(addr, host, sizeof(host), &port, &err);
  if (rc)
    return raise_sg(module, rc, err.msg);
  return Py_BuildValue("(si)", host, port);
}

/* advertised_host(option=None, fallback=None) -> str: the host peers use
 * to reach this process, by the rule every server follows. */
static PyObject *py_advertised_host(PyObject *module, PyObject *args,
                                    PyObject *kw) {
  static char *kwlist[] = {"option", "fallback", NULL};
  const char *option = NULL, *fallback = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|zz:advertised_host", kwlist,
                                   &option, &fallback))
    return NULL;
  char host[SG_ADDR_MAX + 1];
  sg_addr_advertised(option, fallback, host, sizeof(host));
  return PyUnicode_FromString(host);
}

/* lighthouse_main(argv): the stepguard-lighthouse program; blocks until
 * SIGINT or SIGTERM with the GIL released. */
static PyObject *py_lighthouse_main(PyObject *module, PyObject *arg) {
  PyObject *seq = PySequence_Fast(arg, "argv must be a sequence of str");
  if (!seq)
    return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > 1000) {
    Py_DECREF(seq);
    PyErr_SetString(PyExc_ValueError, "too many arguments");
    return NULL;
  }
  char **argv = PyMem_Calloc((size_t)n + 1, sizeof(char *));
  PyObject *ret = NULL;
  if (!argv) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    const char *a = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (!a)
      goto out;
    argv[i] = (char *)a; /* kept alive by seq */
  }
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = sg_lh_main((int)n, argv);
  Py_END_ALLOW_THREADS
  ret = PyLong_FromLong(status);
out:
  PyMem_Free(argv);
  Py_DECREF(seq);
  return ret;
}

static PyMethodDef module_methods[] = {
    {"lighthouse_main", py_lighthouse_main, METH_O,
     "lighthouse_main(argv) -> int: run stepguard-lighthouse."},
    {"version", py_version, METH_NOARGS,
     "version() -> str: libstepguard version."},
    {"strerror", py_strerror, METH_O, "strerror(code) -> str: error text."},
    {"quant_wire_bytes", sg_py_quant_wire_bytes, METH_O,
     "quant_wire_bytes(count) -> int: bytes of a quantized block."},
    {"quant_encode", sg_py_quant_encode, METH_VARARGS,
     "quant_encode(fmt, in_ptr, count, wire_ptr) -> 1 if NaN/inf seen."},
    {"quant_decode", sg_py_quant_decode, METH_VARARGS,
     "quant_decode(fmt, wire_ptr, nbytes, count, out_ptr)."},
    {"fp8_from_f32", sg_py_fp8_from_f32, METH_VARARGS,
     "fp8_from_f32(in_ptr, out_ptr, n): float32 -> float8 e4m3fn codes."},
    {"fp8_to_f32", sg_py_fp8_to_f32, METH_VARARGS,
     "fp8_to_f32(in_ptr, out_ptr, n): float8 e4m3fn codes -> float32."},
    {"err_name", py_err_name, METH_O, "err_name(code) -> str: SG_E* name."},
    {"err_is_fatal", py_err_is_fatal, METH_O,
     "err_is_fatal(code) -> bool: whether the code poisons its object."},
    {"monotonic_ns", py_monotonic_ns, METH_NOARGS,
     "monotonic_ns() -> int: libstepguard's monotonic clock."},
    {"log", py_log, METH_VARARGS, "log(level, subsystem, msg): emit a line."},
    {"set_log_level", py_set_log_level, METH_O,
     "set_log_level(name): error, warn, info, debug or trace."},
    {"tcp_listen", py_tcp_listen, METH_VARARGS,
     "tcp_listen(host, port, backlog=128) -> (fd, port): registered socket."},
    {"tcp_connect", py_tcp_connect, METH_VARARGS,
     "tcp_connect(host, port, timeout_s) -> fd: registered, non-blocking."},
    {"tcp_close", py_tcp_close, METH_O, "tcp_close(fd): unregister and close."},
    {"registered_sockets", py_registered_sockets, METH_NOARGS,
     "registered_sockets() -> int: sockets a fork would drop."},
    {"fork_count", py_fork_count, METH_NOARGS,
     "fork_count() -> int: forks since the original process."},
    {"split_address", py_split_address, METH_O,
     "split_address(addr) -> (host, port): \"host:port\" or \"[v6]:port\" "
     "(raises ValueError)."},
    {"advertised_host", (PyCFunction)(void (*)(void))py_advertised_host,
     METH_VARARGS | METH_KEYWORDS,
     "advertised_host(option=None, fallback=None) -> str: "
     "$STEPGUARD_ADVERTISE_HOST, else option, else fallback, else the host "
     "name; an interface name becomes its address, IPv6 in brackets."},
    {"_raise_error", py_raise_error, METH_VARARGS,
     "_raise_error(code, detail=''): raise the exception for a code (tests)."},
    {NULL, NULL, 0, NULL},
};

static int add_error_constants(PyObject *module) {
  static const struct {
    const char *name;
    int code;
  } codes[] = {
      {"OK", SG_OK},
      {"EINVAL", SG_EINVAL},
      {"ENOMEM", SG_ENOMEM},
      {"EAGAIN", SG_EAGAIN},
      {"ETIMEDOUT", SG_ETIMEDOUT},
      {"ECANCELED", SG_ECANCELED},
      {"ECONNRESET", SG_ECONNRESET},
      {"ECONNREFUSED", SG_ECONNREFUSED},
      {"EPIPE", SG_EPIPE},
      {"EADDRINUSE", SG_EADDRINUSE},
      {"EIO", SG_EIO},
      {"ETOOBIG", SG_ETOOBIG},
      {"EAUTH", SG_EAUTH},
      {"ENOTFOUND", SG_ENOTFOUND},
      {"ESTATE", SG_ESTATE},
      {"ECLOSED", SG_ECLOSED},
      {"EABORTED", SG_EABORTED},
      {"EPEER", SG_EPEER},
      {"EPROTO", SG_EPROTO},
  };
  for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
    if (PyModule_AddIntConstant(module, codes[i].name, codes[i].code) < 0)
      return -1;
  return 0;
}

static int module_exec(PyObject *module) {
  sg_py_state *st = get_state(module);
  st->error_type = PyErr_NewExceptionWithDoc(
      "stepguard._C.Error",
      "A libstepguard error; `code` holds the negative SG_E* code.",
      PyExc_RuntimeError, NULL);
  if (!st->error_type)
    return -1;
  if (PyModule_AddObjectRef(module, "Error", st->error_type) < 0)
    return -1;
  if (sg_py_lighthouse_init(module, st) < 0)
    return -1;
  if (sg_py_manager_init(module, st) < 0)
    return -1;
  if (sg_py_comm_init(module, st) < 0)
    return -1;
  if (sg_py_ckpt_init(module, st) < 0)
    return -1;
  return add_error_constants(module);
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  sg_py_state *st = get_state(module);
  Py_VISIT(st->error_type);
  Py_VISIT(st->lh_server_type);
  Py_VISIT(st->lh_client_type);
  Py_VISIT(st->mgr_server_type);
  Py_VISIT(st->mgr_client_type);
  for (size_t i = 0; i < 4; i++) {
    Py_VISIT(st->comm_types[i]);
    Py_VISIT(st->ckpt_types[i]);
  }
  return 0;
}

static int module_clear(PyObject *module) {
  sg_py_state *st = get_state(module);
  Py_CLEAR(st->error_type);
  Py_CLEAR(st->lh_server_type);
  Py_CLEAR(st->lh_client_type);
  Py_CLEAR(st->mgr_server_type);
  Py_CLEAR(st->mgr_client_type);
  for (size_t i = 0; i < 4; i++) {
    Py_CLEAR(st->comm_types[i]);
    Py_CLEAR(st->ckpt_types[i]);
  }
  return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stepguard._C",
    .m_doc = "libstepguard binding (internal; use the stepguard package).",
    .m_size = sizeof(sg_py_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void);

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
