/*
 * algo.c: the collective algorithms over the transfer engine (engine.c);
 * the schedules themselves are plan.c's pure functions.
 *
 *   allreduce       recursive doubling up to c->small_max bytes (setup.c
 *                   picks it), else a pipelined ring: reduce-scatter then
 *                   allgather in one pass
 *   reduce_scatter  one reducing ring pass, chunk r ending on rank r
 *   allgather       one copying ring pass
 *   broadcast       root to everyone directly when small, else a chain
 *   alltoall        pairwise exchanges
 *   send/recv       one exchange; barrier: a one-byte MAX allreduce
 *   quantized       qalgo.c
 */
#include <stdio.h>
#include <string.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"

/* allreduce_rd: recursive doubling, for small buffers.  Partners combine
 * op(lower rank's data, higher rank's data), so both get the same bits. */
static int allreduce_rd(sg_comm_t *c, sg__comm_op_t *op, uint8_t *buf,
                        size_t count, char *msg) {
  int n = c->world, r = c->rank, p2 = sg__comm_pow2_floor(n), rc = 0;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = count * es;
  uint8_t *tmp = c->stage;
  if (r >= p2) { /* extra: fold into r - p2, get the result back */
    rc = sg__comm_exchange(c, op, r - p2, buf, bytes, -1, NULL, 0, msg);
    if (rc == 0)
      rc = sg__comm_exchange(c, op, -1, NULL, 0, r - p2, buf, bytes, msg);
    return rc;
  }
  if (r + p2 < n) {
    rc = sg__comm_exchange(c, op, -1, NULL, 0, r + p2, tmp, bytes, msg);
    if (rc)
      return rc;
    sg__comm_reduce(op->dtype, op->redop, buf, buf, tmp, count);
  }
  for (int round = 0; (1 << round) < p2; round++) {
    int q = sg__comm_rd_partner(r, n, round);
    rc = sg__comm_exchange(c, op, q, buf, bytes, q, tmp, bytes, msg);
    if (rc)
      return rc;
    if (r < q)
      sg__comm_reduce(op->dtype, op->redop, buf, buf, tmp, count);
    else
      sg__comm_reduce(op->dtype, op->redop, buf, tmp, buf, count);
  }
  if (op->redop == SG_COMM_AVG)
    sg__comm_scale_avg(op->dtype, buf, count, n);
  if (r + p2 < n)
    rc = sg__comm_exchange(c, op, r + p2, buf, bytes, -1, NULL, 0, msg);
  return rc;
}

/*
 * ring: one pipelined ring pass.  chunk_p[i] / chunk_len[i] give chunk i's
 * destination and length in bytes; src_p[i] the local operand of chunk i
 * (the bytes sent at step 0 and reduced with incoming partials).  Steps
 * [0, nreduce) reduce, the rest copy.
 */
static int ring(sg_comm_t *c, sg__comm_op_t *op, int steps, int nreduce,
                int shift, uint8_t **chunk_p, const uint8_t **src_p,
                const size_t *chunk_len, char *msg) {
  int n = c->world, r = c->rank, rc = 0;
  sg__comm_seg_t *ss = sg_calloc((size_t)steps, sizeof(*ss));
  sg__comm_seg_t *rs = sg_calloc((size_t)steps, sizeof(*rs));
  if (!ss || !rs) {
    snprintf(msg, 256, "out of memory");
    rc = SG_ENOMEM;
    goto out;
  }
  for (int k = 0; k < steps; k++) {
    int sc = sg__comm_ring_send_chunk(r, n, k, shift);
    int rcn = sg__comm_ring_recv_chunk(r, n, k, shift);
    ss[k].p = k == 0 ? (uint8_t *)src_p[sc] : chunk_p[sc];
    ss[k].len = chunk_len[sc];
    rs[k].p = chunk_p[rcn];
    rs[k].len = chunk_len[rcn];
    rs[k].src = src_p[rcn];
  }
  sg__comm_xfer_t x = {
      .c = c,
      .op = op,
      .send_peer = (r + 1) % n,
      .recv_peer = (r + n - 1) % n,
      .ss = ss,
      .rs = rs,
      .ns = steps,
      .nr = steps,
      .nreduce = nreduce,
      .link = 1,
      .esize = op->dtype < SG_COMM_NDTYPES ? sg_comm_dtype_size(op->dtype) : 1,
      .msg = msg};
  rc = sg__comm_xfer_run(&x);
out:
  sg_free(ss);
  sg_free(rs);
  return rc;
}

/* table: world-sized scratch arrays for ring(). */
struct table {
  uint8_t **p;
  const uint8_t **src;
  size_t *len;
};

static int table_new(struct table *t, int n) {
  t->p = sg_calloc((size_t)n, sizeof(*t->p));
  t->src = sg_calloc((size_t)n, sizeof(*t->src));
  t->len = sg_calloc((size_t)n, sizeof(*t->len));
  return t->p && t->src && t->len ? 0 : SG_ENOMEM;
}

static void table_free(struct table *t) {
  sg_free(t->p);
  sg_free(t->src);
  sg_free(t->len);
}

static int run_allreduce(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = op->count * es;
  if (n == 1)
    return 0;
  if (bytes <= c->small_max || op->count < (size_t)n)
    return allreduce_rd(c, op, op->buf, op->count, msg);
  struct table t;
  int rc = table_new(&t, n);
  if (rc == 0) {
    for (int i = 0; i < n; i++) {
      size_t off, len;
      sg__comm_chunk(op->count, n, i, &off, &len);
      t.p[i] = op->buf + off * es;
      t.src[i] = t.p[i];
      t.len[i] = len * es;
    }
    /* AVG divides as the last reducing step goes (reduce_ready) */
    rc = ring(c, op, 2 * (n - 1), n - 1, 0, t.p, t.src, t.len, msg);
  } else {
    snprintf(msg, 256, "out of memory");
  }
  table_free(&t);
  return rc;
}

static int run_broadcast(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank, root = op->peer;
  if (n == 1)
    return 0;
  if (op->nbytes <= c->small_max) { /* root sends to everyone directly */
    if (r != root)
      return sg__comm_exchange(c, op, -1, NULL, 0, root, op->buf, op->nbytes,
                               msg);
    for (int i = 1; i < n; i++) {
      int rc = sg__comm_exchange(c, op, (root + i) % n, op->buf, op->nbytes, -1,
                                 NULL, 0, msg);
      if (rc)
        return rc;
    }
    return 0;
  }
  /* chain root -> root+1 -> ...: each rank forwards bytes as they land */
  int pos = (r - root + n) % n;
  sg__comm_seg_t s = {.p = op->buf, .len = op->nbytes};
  sg__comm_xfer_t x = {.c = c,
                       .op = op,
                       .send_peer = pos < n - 1 ? (r + 1) % n : -1,
                       .recv_peer = pos > 0 ? (r + n - 1) % n : -1,
                       .ss = &s,
                       .rs = &s,
                       .ns = pos<n - 1, .nr = pos> 0,
                       .link = pos > 0 ? 0 : -1,
                       .esize = 1,
                       .msg = msg};
  return sg__comm_xfer_run(&x);
}

static int run_allgather(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank;
  if (op->outs[r] != op->in && op->nbytes)
    memcpy(op->outs[r], op->in, op->nbytes);
  if (n == 1)
    return 0;
  struct table t;
  int rc = table_new(&t, n);
  if (rc == 0) {
    for (int i = 0; i < n; i++) {
      t.p[i] = op->outs[i];
      t.src[i] = op->outs[i];
      t.len[i] = op->nbytes;
    }
    rc = ring(c, op, n - 1, 0, 0, t.p, t.src, t.len, msg);
  } else {
    snprintf(msg, 256, "out of memory");
  }
  table_free(&t);
  return rc;
}

static int run_reduce_scatter(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank;
  size_t es = sg_comm_dtype_size(op->dtype), bytes = op->count * es;
  if (n == 1) {
    if (bytes)
      memcpy(op->buf, op->ins[0], bytes);
    if (op->redop == SG_COMM_AVG)
      sg__comm_scale_avg(op->dtype, op->buf, op->count, n);
    return 0;
  }
  struct table t;
  uint8_t *work = NULL;
  int rc = table_new(&t, n);
  if (rc == 0 && bytes && !(work = sg_malloc(bytes * (size_t)n)))
    rc = SG_ENOMEM;
  if (rc) {
    snprintf(msg, 256, "out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    t.p[i] = i == r ? op->buf : work + (size_t)i * bytes;
    t.src[i] = op->ins[i];
    t.len[i] = bytes;
  }
  /* AVG divides as the last reducing step goes (reduce_ready) */
  rc = ring(c, op, n - 1, n - 1, 1, t.p, t.src, t.len, msg);
out:
  sg_free(work);
  table_free(&t);
  return rc;
}

static int run_alltoall(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank;
  if (op->in_bytes[r])
    memcpy(op->outs[r], op->ins[r], op->in_bytes[r]);
  for (int s = 1; s < n; s++) {
    int to = (r + s) % n, from = (r - s + n) % n;
    int rc = sg__comm_exchange(c, op, to, op->ins[to], op->in_bytes[to], from,
                               op->outs[from], op->out_bytes[from], msg);
    if (rc)
      return rc;
  }
  return 0;
}

int sg__comm_run_op(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  switch (op->kind) {
  case SG__COMM_KIND_ALLREDUCE:
    return run_allreduce(c, op, msg);
  case SG__COMM_KIND_BROADCAST:
    return run_broadcast(c, op, msg);
  case SG__COMM_KIND_ALLGATHER:
    return run_allgather(c, op, msg);
  case SG__COMM_KIND_REDUCE_SCATTER:
    return run_reduce_scatter(c, op, msg);
  case SG__COMM_KIND_ALLTOALL:
    return run_alltoall(c, op, msg);
  case SG__COMM_KIND_SEND:
    return sg__comm_exchange(c, op, op->peer, op->buf, op->nbytes, -1, NULL, 0,
                             msg);
  case SG__COMM_KIND_RECV:
    return sg__comm_exchange(c, op, -1, NULL, 0, op->peer, op->buf, op->nbytes,
                             msg);
  case SG__COMM_KIND_ALLREDUCE_Q:
  case SG__COMM_KIND_REDUCE_SCATTER_Q:
    return sg__comm_run_quant(c, op, msg);
  case SG__COMM_KIND_BARRIER: {
    uint8_t one = 1;
    if (c->world == 1)
      return 0;
    sg__comm_op_t tmp = *op;
    tmp.dtype = SG_COMM_U8;
    tmp.redop = SG_COMM_MAX;
    return allreduce_rd(c, &tmp, &one, 1, msg);
  }
  default:
    snprintf(msg, 256, "unknown operation");
    return SG_EINVAL;
  }
}
