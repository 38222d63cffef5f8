/*
 * comm.c: the communicator's queue and life (comm_int.h lists the other
 * files: setup.c builds the mesh, engine.c moves bytes, algo.c runs the
 * collectives on top of it).
 *
 *   helpers    wake, the first error, stop codes, fork check, accessors
 *   queue      submit / sg__comm_progress_main: FIFO of request objects; the
 *              first failure poisons the communicator and fails what follows
 *   operations sg_comm_allreduce ... sg_comm_barrier: check, copy the
 *              arguments into an op, queue it
 *   teardown   sg_comm_abort, sg_comm_free (BYE on a clean close)
 *
 * Every transfer on a connection starts with an OP frame carrying the
 * operation kind, a per-direction sequence number and the payload length,
 * so ranks that disagree on the operation fail with a protocol error
 * instead of exchanging garbage.  The design notes are in
 * docs/internals/comm.md.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"

#define LOG_SUB "comm"
#define MAX_BYTES ((size_t)1 << 46) /* largest operation accepted */

/* ---- small helpers ----------------------------------------------------------
 */

const char *sg__comm_kind_name(int k) {
  static const char *names[] = {"?",
                                "allreduce",
                                "broadcast",
                                "allgather",
                                "reduce_scatter",
                                "alltoall",
                                "send",
                                "recv",
                                "barrier",
                                "allreduce_quantized",
                                "reduce_scatter_quantized"};
  return k > 0 && k <= SG__COMM_KIND_REDUCE_SCATTER_Q ? names[k] : "?";
}

void sg__comm_wake(sg_comm_t *c) {
  uint64_t one = 1;
  ssize_t n = write(c->wake_fd, &one, sizeof(one));
  (void)n; /* a full counter is still readable: the wakeup is not lost */
}

/* set_error: record the first error; later ones keep the first. */
static void set_error(sg_comm_t *c, int code, const char *msg) {
  pthread_mutex_lock(&c->mu);
  if (!c->err_code) {
    c->err_code = code;
    snprintf(c->err_msg, sizeof(c->err_msg), "%s", msg);
  }
  pthread_mutex_unlock(&c->mu);
}

int sg__comm_stop_code(sg_comm_t *c) {
  return atomic_load(&c->aborted) ? SG_EABORTED : SG_ECANCELED;
}

const char *sg__comm_stop_msg(sg_comm_t *c) {
  return atomic_load(&c->aborted) ? "communicator aborted"
                                  : "communicator closed";
}

/* forked: whether this is a child forked after c was created; its copy of
 * c has no progress thread and its descriptors point to /dev/null. */
int sg__comm_forked(const sg_comm_t *c) {
  return sg_sock_fork_count() != c->fork_gen;
}

int sg_comm_port(const sg_comm_t *c) { return c->port; }
int sg_comm_rank(const sg_comm_t *c) { return c->rank; }

int sg_comm_same_host(const sg_comm_t *c, int peer) {
  return c && peer >= 0 && peer < c->world && c->peers[peer].fd >= 0 &&
         c->peers[peer].pull_from;
}
int sg_comm_size(const sg_comm_t *c) { return c->world; }

int sg_comm_error(sg_comm_t *c, sg_err_t *err) {
  pthread_mutex_lock(&c->mu);
  int code = c->err_code;
  if (code)
    sg_err_set(err, code, "%s", c->err_msg);
  pthread_mutex_unlock(&c->mu);
  return code;
}

/* ---- the queue and the progress thread
 * ----------------------------------------
 */

static void op_free(sg__comm_op_t *op) {
  if (!op)
    return;
  sg_free(op->outs);
  sg_free(op->ins);
  sg_free(op->in_bytes);
  sg_free(op->out_bytes);
  sg_free(op);
}

static void finish(sg__comm_op_t *op, int rc, const char *msg) {
  op->cb(op->ud, rc, msg);
  op_free(op);
}

/* shut_all: stop every connection so that peers notice at once. */
static void shut_all(sg_comm_t *c) {
  for (int p = 0; p < c->world; p++)
    if (c->peers[p].fd >= 0)
      shutdown(c->peers[p].fd, SHUT_RDWR);
}

/* idle_tick: between operations, keep every connection alive (send the
 * KEEPALIVEs that are due) and consume the peers' KEEPALIVEs, so that they
 * do not pile up in the socket buffers. */
static void idle_tick(sg_comm_t *c) {
  sg__comm_keepalive(c, NULL, sg_now_ns());
  for (int p = 0; p < c->world; p++)
    if (p != c->rank && c->peers[p].fd >= 0)
      (void)sg__comm_drain(c, p);
}

void *sg__comm_progress_main(void *arg) {
  sg_comm_t *c = arg;
  sg_thread_name("sg-comm");
  char msg[256];
  for (;;) {
    pthread_mutex_lock(&c->mu);
    if (!c->head && !c->closing && !atomic_load(&c->aborted)) {
      /* idle: wake when the next KEEPALIVE is due (or in a second) */
      int64_t wait_ns = c->ka_next - sg_now_ns();
      if (wait_ns > 1000000000)
        wait_ns = 1000000000;
      if (wait_ns > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)wait_ns;
        ts.tv_sec += ts.tv_nsec / 1000000000;
        ts.tv_nsec %= 1000000000;
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
      }
    }
    sg__comm_op_t *op = c->head;
    if (op) {
      c->head = op->next;
      if (!c->head)
        c->tail = NULL;
    }
    c->running = op != NULL;
    int code = c->err_code, closing = c->closing;
    snprintf(msg, sizeof(msg), "%s", c->err_msg);
    pthread_mutex_unlock(&c->mu);
    if (!op) {
      if (closing || atomic_load(&c->aborted))
        break;
      if (!code)
        idle_tick(c);
      continue;
    }
    int rc;
    if (atomic_load(&c->aborted)) {
      rc = SG_EABORTED;
      snprintf(msg, sizeof(msg), "%s: communicator aborted",
               sg__comm_kind_name(op->kind));
    } else if (closing) {
      rc = SG_ECANCELED;
      snprintf(msg, sizeof(msg), "%s: communicator closed",
               sg__comm_kind_name(op->kind));
    } else if (code) {
      rc = code; /* msg holds the first error */
    } else if (sg_deadline_passed(op->deadline)) {
      rc = SG_ETIMEDOUT;
      snprintf(msg, sizeof(msg), "%s: deadline passed before it started",
               sg__comm_kind_name(op->kind));
    } else {
      msg[0] = '\0';
      rc = sg__comm_run_op(c, op, msg);
    }
    if (rc && !code && op->data_error) {
      /* every rank failed alike, streams in step: no poison */
      sg_log(SG_LOG_WARN, LOG_SUB, "rank %d: %s", c->rank, msg);
    } else if (rc && !code) {
      if (rc != SG_ECANCELED)
        sg_log(SG_LOG_WARN, LOG_SUB, "rank %d: %s", c->rank, msg);
      set_error(c, rc, msg);
      shut_all(c);
    }
    finish(op, rc, rc ? msg : "");
  }
  pthread_mutex_lock(&c->mu);
  c->clean = !c->err_code && !atomic_load(&c->aborted);
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* submit: queue op (owned by the queue from here) or fail without calling
 * its callback. */
static int submit(sg_comm_t *c, sg__comm_op_t *op, sg_err_t *err) {
  int rc = 0;
  if (sg__comm_forked(c)) {
    op_free(op);
    return sg_err_set(err, SG_ESTATE,
                      "communicator belongs to the parent process");
  }
  pthread_mutex_lock(&c->mu);
  if (c->err_code)
    rc = sg_err_set(err, c->err_code, "%s", c->err_msg);
  else if (atomic_load(&c->aborted))
    rc = sg_err_set(err, SG_EABORTED, "communicator aborted");
  else if (c->state != SG__COMM_ST_READY || c->closing)
    rc = sg_err_set(err, SG_ESTATE, "communicator not connected");
  if (rc == 0) {
    if (c->tail)
      c->tail->next = op;
    else
      c->head = op;
    c->tail = op;
    pthread_cond_signal(&c->cv);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc)
    op_free(op);
  return rc;
}

static sg__comm_op_t *op_new(int kind, sg_deadline_t deadline,
                             sg_comm_done_cb cb, void *ud) {
  sg__comm_op_t *op = sg_calloc(1, sizeof(*op));
  if (op) {
    op->kind = kind;
    op->deadline = deadline;
    op->cb = cb;
    op->ud = ud;
  }
  return op;
}

static int check_common(sg_comm_t *c, sg_comm_done_cb cb, sg_err_t *err) {
  if (!c || !cb)
    return sg_err_set(err, SG_EINVAL, "communicator and callback required");
  return 0;
}

static int check_reduce(sg_comm_dtype_t dtype, sg_comm_redop_t op, size_t count,
                        int n, sg_err_t *err) {
  if ((unsigned)dtype >= SG_COMM_NDTYPES || (unsigned)op >= SG_COMM_NREDOPS)
    return sg_err_set(err, SG_EINVAL, "unknown dtype %d or op %d", (int)dtype,
                      (int)op);
  if (count > MAX_BYTES / sg_comm_dtype_size(dtype) / (size_t)n)
    return sg_err_set(err, SG_ETOOBIG, "%zu elements is too many", count);
  return 0;
}

int sg_comm_allreduce(sg_comm_t *c, void *buf, size_t count,
                      sg_comm_dtype_t dtype, sg_comm_redop_t redop,
                      sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                      sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc || (rc = check_reduce(dtype, redop, count, 1, err)))
    return rc;
  if (count && !buf)
    return sg_err_set(err, SG_EINVAL, "NULL buffer");
  sg__comm_op_t *op = op_new(SG__COMM_KIND_ALLREDUCE, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->count = count;
  op->dtype = dtype;
  op->redop = redop;
  return submit(c, op, err);
}

int sg_comm_broadcast(sg_comm_t *c, void *buf, size_t nbytes, int root,
                      sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                      sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (root < 0 || root >= c->world || (nbytes && !buf) || nbytes > MAX_BYTES)
    return sg_err_set(err, SG_EINVAL, "bad root %d or buffer", root);
  sg__comm_op_t *op = op_new(SG__COMM_KIND_BROADCAST, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->nbytes = nbytes;
  op->peer = root;
  return submit(c, op, err);
}

/* copy_ptrs: a world-sized copy of a pointer array, or NULL. */
static void *copy_ptrs(const void *const *v, int n) {
  void **p = sg_malloc((size_t)n * sizeof(*p));
  if (p)
    for (int i = 0; i < n; i++)
      p[i] = (void *)v[i];
  return p;
}

int sg_comm_allgather(sg_comm_t *c, const void *in, size_t nbytes,
                      void *const *outs, sg_deadline_t deadline,
                      sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (!outs || (nbytes && !in) || nbytes > MAX_BYTES / (size_t)c->world)
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < c->world; i++)
    if (nbytes && !outs[i])
      return sg_err_set(err, SG_EINVAL, "NULL output %d", i);
  sg__comm_op_t *op = op_new(SG__COMM_KIND_ALLGATHER, deadline, cb, ud);
  if (!op || !(op->outs = copy_ptrs((const void *const *)outs, c->world))) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  op->in = in;
  op->nbytes = nbytes;
  return submit(c, op, err);
}

int sg_comm_reduce_scatter(sg_comm_t *c, const void *const *ins, void *out,
                           size_t count, sg_comm_dtype_t dtype,
                           sg_comm_redop_t redop, sg_deadline_t deadline,
                           sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc || (rc = check_reduce(dtype, redop, count, c->world, err)))
    return rc;
  if (!ins || (count && !out))
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < c->world; i++)
    if (count && !ins[i])
      return sg_err_set(err, SG_EINVAL, "NULL input %d", i);
  sg__comm_op_t *op = op_new(SG__COMM_KIND_REDUCE_SCATTER, deadline, cb, ud);
  if (!op || !(op->ins = copy_ptrs(ins, c->world))) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  op->buf = out;
  op->count = count;
  op->dtype = dtype;
  op->redop = redop;
  return submit(c, op, err);
}

int sg_comm_alltoall(sg_comm_t *c, const void *const *ins,
                     const size_t *in_bytes, void *const *outs,
                     const size_t *out_bytes, sg_deadline_t deadline,
                     sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err), n;
  if (rc)
    return rc;
  n = c->world;
  if (!ins || !outs || !in_bytes || !out_bytes)
    return sg_err_set(err, SG_EINVAL, "bad buffers");
  for (int i = 0; i < n; i++)
    if ((in_bytes[i] && !ins[i]) || (out_bytes[i] && !outs[i]) ||
        in_bytes[i] > MAX_BYTES || out_bytes[i] > MAX_BYTES)
      return sg_err_set(err, SG_EINVAL, "bad buffer %d", i);
  if (in_bytes[c->rank] != out_bytes[c->rank])
    return sg_err_set(err, SG_EINVAL, "own block: %zu bytes in, %zu out",
                      in_bytes[c->rank], out_bytes[c->rank]);
  sg__comm_op_t *op = op_new(SG__COMM_KIND_ALLTOALL, deadline, cb, ud);
  if (op) {
    op->ins = copy_ptrs(ins, n);
    op->outs = copy_ptrs((const void *const *)outs, n);
    op->in_bytes = sg_malloc((size_t)n * sizeof(size_t));
    op->out_bytes = sg_malloc((size_t)n * sizeof(size_t));
  }
  if (!op || !op->ins || !op->outs || !op->in_bytes || !op->out_bytes) {
    op_free(op);
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  }
  memcpy(op->in_bytes, in_bytes, (size_t)n * sizeof(size_t));
  memcpy(op->out_bytes, out_bytes, (size_t)n * sizeof(size_t));
  return submit(c, op, err);
}

/* quant_op: check and queue a quantized operation. */
static int quant_op(sg_comm_t *c, int kind, const float *in, float *out,
                    size_t count, size_t parts, sg_comm_quant_t fmt,
                    sg_comm_redop_t redop, sg_deadline_t deadline,
                    sg_comm_done_cb cb, void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (fmt != SG_COMM_QUANT_INT8 && fmt != SG_COMM_QUANT_FP8)
    return sg_err_set(err, SG_EINVAL, "unknown quantization format %d",
                      (int)fmt);
  if (redop != SG_COMM_SUM && redop != SG_COMM_AVG)
    return sg_err_set(err, SG_EINVAL,
                      "quantized collectives support SUM and AVG only");
  if (count > MAX_BYTES / sizeof(float) / parts)
    return sg_err_set(err, SG_ETOOBIG, "%zu elements is too many", count);
  if (count && (!in || !out))
    return sg_err_set(err, SG_EINVAL, "NULL buffer");
  sg__comm_op_t *op = op_new(kind, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->in = (const uint8_t *)in;
  op->buf = (uint8_t *)out;
  op->count = count;
  op->dtype = SG_COMM_F32;
  op->redop = redop;
  op->quant = fmt;
  return submit(c, op, err);
}

int sg_comm_allreduce_quantized(sg_comm_t *c, float *buf, size_t count,
                                sg_comm_quant_t fmt, sg_comm_redop_t redop,
                                sg_deadline_t deadline, sg_comm_done_cb cb,
                                void *ud, sg_err_t *err) {
  return quant_op(c, SG__COMM_KIND_ALLREDUCE_Q, buf, buf, count, 1, fmt, redop,
                  deadline, cb, ud, err);
}

int sg_comm_reduce_scatter_quantized(sg_comm_t *c, const float *in, float *out,
                                     size_t count, sg_comm_quant_t fmt,
                                     sg_comm_redop_t redop,
                                     sg_deadline_t deadline, sg_comm_done_cb cb,
                                     void *ud, sg_err_t *err) {
  return quant_op(c, SG__COMM_KIND_REDUCE_SCATTER_Q, in, out, count,
                  c ? (size_t)c->world : 1, fmt, redop, deadline, cb, ud, err);
}

static int p2p(sg_comm_t *c, int kind, void *buf, size_t nbytes, int peer,
               sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
               sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  if (peer < 0 || peer >= c->world || peer == c->rank || (nbytes && !buf) ||
      nbytes > MAX_BYTES)
    return sg_err_set(err, SG_EINVAL, "bad peer %d or buffer", peer);
  sg__comm_op_t *op = op_new(kind, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  op->buf = buf;
  op->nbytes = nbytes;
  op->peer = peer;
  return submit(c, op, err);
}

int sg_comm_send(sg_comm_t *c, const void *buf, size_t nbytes, int dst,
                 sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                 sg_err_t *err) {
  return p2p(c, SG__COMM_KIND_SEND, (void *)buf, nbytes, dst, deadline, cb, ud,
             err);
}

int sg_comm_recv(sg_comm_t *c, void *buf, size_t nbytes, int src,
                 sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                 sg_err_t *err) {
  return p2p(c, SG__COMM_KIND_RECV, buf, nbytes, src, deadline, cb, ud, err);
}

int sg_comm_barrier(sg_comm_t *c, sg_deadline_t deadline, sg_comm_done_cb cb,
                    void *ud, sg_err_t *err) {
  int rc = check_common(c, cb, err);
  if (rc)
    return rc;
  sg__comm_op_t *op = op_new(SG__COMM_KIND_BARRIER, deadline, cb, ud);
  if (!op)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  return submit(c, op, err);
}

/* ---- abort and teardown
 * ---------------------------------------------------------
 */

void sg_comm_abort(sg_comm_t *c) {
  if (!c || sg__comm_forked(c))
    return; /* a forked child's copy has nothing running to abort */
  atomic_store(&c->aborted, 1);
  atomic_store(&c->stop, 1);
  sg__comm_wake(c);
  pthread_mutex_lock(&c->mu);
  if (!c->err_code) {
    c->err_code = SG_EABORTED;
    snprintf(c->err_msg, sizeof(c->err_msg), "communicator aborted");
  }
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* say_bye: end each connection with BYE, best effort, then close. */
static void close_peers(sg_comm_t *c, int bye) {
  for (int p = 0; p < c->world; p++) {
    sg__comm_peer_t *pe = &c->peers[p];
    if (pe->fd < 0)
      continue;
    if (bye && sg__comm_ka_flush(c, p) == 0) {
      uint8_t b[SG__COMM_FRAME_LEN];
      sg__comm_frame_t f = {.type = SG__COMM_FRAME_BYE, .seq = pe->tx_seq};
      sg__comm_frame_encode(b, &f);
      ssize_t n = send(pe->fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)n;
      shutdown(pe->fd, SHUT_WR);
    }
    sg_sock_close(pe->fd);
    pe->fd = -1;
  }
}

void sg_comm_free(sg_comm_t *c) {
  if (!c || sg__comm_forked(c))
    return; /* a forked child's copy: no thread to join, locks may be held
               by threads that did not survive the fork; leave it */
  pthread_mutex_lock(&c->mu);
  c->closing = 1;
  int started = c->thread_started;
  int busy = c->head != NULL || c->running;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (busy || !started) {
    atomic_store(&c->stop, 1); /* cut what is queued or connecting */
    sg__comm_wake(c);
  }
  if (started)
    pthread_join(c->thread, NULL);
  /* no op was running (the queue drained) unless stop cut one */
  close_peers(c, started && c->clean && !atomic_load(&c->stop));
  sg__comm_release(c);
}

void sg__comm_release(sg_comm_t *c) {
  sg_sock_close(c->listen_fd);
  sg_sock_close(c->wake_fd);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  sg_free(c->job);
  sg_free(c->token);
  sg_free(c->peers);
  sg_free(c->stage);
  sg_free(c);
}
