/*
 * qalgo.c: the quantized allreduce and reduce-scatter (stepguard/comm.h
 * describes them; quant.c has the kernels and the wire block).
 *
 * Part i of the input (the allreduce's chunk i, the reduce-scatter's
 * i-th slice) belongs to rank i.  Each rank:
 *
 *   1. quantizes every part but its own into one wire block each, and
 *      notes whether its input holds a NaN or an infinity (a flag in every
 *      block it sends);
 *   2. all-to-all: sends part i to rank i, receives its own part from every
 *      rank (pairwise exchanges, n - 1 rounds);
 *   3. checks the blocks (format, size) and their flags: every rank has
 *      now seen every rank's flag, so a NaN anywhere fails the operation on
 *      every rank alike, before anything is written;
 *   4. reduces its part in float32: the dequantized blocks and its own
 *      exact values, added in rank order (AVG divides once at the end),
 *      and quantizes the result once;
 *   5. allreduce: all-gather of the reduced blocks (pairwise exchanges);
 *      reduce-scatter: an all-gather of one status byte per rank (so that
 *      an overflow at one owner fails every rank);
 *   6. dequantizes: every reduced block into its part of the buffer
 *      (allreduce), or its own into the output (reduce-scatter); the owner
 *      uses the same quantized bits as everyone else.
 *
 * A failure of a peer in 2 or 5 is the engine's error, as for any
 * operation; the buffers are written only in 6.
 */
#include <stdio.h>
#include <string.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"

/* part: the elements of rank i's part, as [*off, *off + *len) of the
 * input. */
static void part(const sg__comm_op_t *op, int n, int i, size_t *off,
                 size_t *len) {
  if (op->kind == SG__COMM_KIND_ALLREDUCE_Q) {
    sg__comm_chunk(op->count, n, i, off, len);
  } else {
    *off = (size_t)i * op->count;
    *len = op->count;
  }
}

/* name_ranks: "rank 2" or "ranks 1, 3" for the ranks whose bit is set in
 * bad[0..n), into out (256 bytes) after `prefix`; returns how many. */
static int name_ranks(const uint8_t *bad, int n, char *out) {
  int count = 0;
  for (int i = 0; i < n; i++)
    count += bad[i] != 0;
  size_t used = strlen(out);
  used += (size_t)snprintf(out + used, 256 - used, "%s",
                           count == 1 ? "rank " : "ranks ");
  int k = 0;
  for (int i = 0; i < n && used < 200; i++)
    if (bad[i])
      used +=
          (size_t)snprintf(out + used, 256 - used, "%s%d", k++ ? ", " : "", i);
  return count;
}

struct qstate {
  size_t *off, *len, *wb; /* per part: first element, elements, wire bytes */
  size_t *woff;           /* per part: offset of its block in sendbuf */
  uint8_t *sendbuf;       /* every part's block (own slot: the reduced one) */
  uint8_t *recvbuf;       /* n blocks of the own part, one per rank */
  float *acc;             /* the own part's reduction */
  uint8_t *bad;           /* per rank: its flags */
};

static void qstate_free(struct qstate *s) {
  sg_free(s->off);
  sg_free(s->len);
  sg_free(s->wb);
  sg_free(s->woff);
  sg_free(s->sendbuf);
  sg_free(s->recvbuf);
  sg_free(s->acc);
  sg_free(s->bad);
}

int sg__comm_run_quant(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank, rc = 0;
  int allreduce = op->kind == SG__COMM_KIND_ALLREDUCE_Q;
  const char *what = sg__comm_kind_name(op->kind);
  const float *in = allreduce ? (const float *)op->buf : (const float *)op->in;
  struct qstate s = {0};
  size_t un = (size_t)n;
  s.off = sg_calloc(un, sizeof(size_t));
  s.len = sg_calloc(un, sizeof(size_t));
  s.wb = sg_calloc(un, sizeof(size_t));
  s.woff = sg_calloc(un, sizeof(size_t));
  s.bad = sg_calloc(un, 1);
  if (!s.off || !s.len || !s.wb || !s.woff || !s.bad)
    goto nomem;
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    part(op, n, i, &s.off[i], &s.len[i]);
    s.wb[i] = sg__quant_wire_bytes(s.len[i]);
    s.woff[i] = total;
    total += s.wb[i];
  }
  size_t own = s.len[r], ownwb = s.wb[r];
  s.sendbuf = sg_malloc(total);
  s.recvbuf = sg_malloc(ownwb * un);
  s.acc = sg_malloc(own ? own * sizeof(float) : 1);
  if (!s.sendbuf || !s.recvbuf || !s.acc)
    goto nomem;

  /* 1. quantize the other ranks' parts; the own one is checked as it is
   * reduced, but its NaN must be known before anything is sent */
  int mine = 0;
  for (int i = 0; i < n; i++)
    if (i != r)
      mine |= sg__quant_encode(op->quant, in + s.off[i], s.len[i],
                               s.sendbuf + s.woff[i]);
  /* the own part: encoded into its slot too, for the NaN scan (the slot is
   * overwritten by the reduced block below) */
  mine |=
      sg__quant_encode(op->quant, in + s.off[r], own, s.sendbuf + s.woff[r]);
  for (int i = 0; i < n; i++)
    sg__quant_set_flags(s.sendbuf + s.woff[i], mine ? SG__QUANT_NONFINITE : 0u);

  /* 2. all-to-all */
  memcpy(s.recvbuf + (size_t)r * ownwb, s.sendbuf + s.woff[r], ownwb);
  for (int k = 1; k < n; k++) {
    int to = (r + k) % n, from = (r - k + n) % n;
    rc = sg__comm_exchange(c, op, to, s.sendbuf + s.woff[to], s.wb[to], from,
                           s.recvbuf + (size_t)from * ownwb, ownwb, msg);
    if (rc)
      goto out;
  }

  /* 3. check what came, and every rank's NaN flag */
  int nbad = 0;
  for (int q = 0; q < n; q++) {
    unsigned flags;
    if (sg__quant_check(s.recvbuf + (size_t)q * ownwb, ownwb, op->quant, own,
                        &flags) != 0) {
      snprintf(msg, 256,
               "%s: rank %d sent a block of another format or size "
               "(ranks disagree on the operation)",
               what, q);
      rc = SG_EPROTO;
      goto out;
    }
    s.bad[q] = (flags & SG__QUANT_NONFINITE) != 0;
    nbad += s.bad[q];
  }
  if (nbad) {
    snprintf(msg, 256, "%s: NaN or infinity in the input of ", what);
    name_ranks(s.bad, n, msg);
    op->data_error = 1;
    rc = SG_EINVAL;
    goto out;
  }

  /* 4. reduce the own part in rank order, quantize once */
  if (own)
    memset(s.acc, 0, own * sizeof(float));
  for (int q = 0; q < n; q++) {
    if (q == r)
      sg__quant_add_f32(s.acc, in + s.off[r], own);
    else
      sg__quant_decode_add(op->quant, s.recvbuf + (size_t)q * ownwb, own,
                           s.acc);
  }
  if (op->redop == SG_COMM_AVG)
    sg__quant_div(s.acc, own, n);
  uint8_t *mineq = s.sendbuf + s.woff[r];
  int over = sg__quant_encode(op->quant, s.acc, own, mineq);
  sg__quant_set_flags(mineq, over ? SG__QUANT_OVERFLOW : 0u);

  /* 5. every rank learns every owner's result (allreduce) or status */
  for (int q = 0; q < n; q++)
    s.bad[q] = q == r ? (uint8_t)over : 0;
  for (int k = 1; k < n; k++) {
    int to = (r + k) % n, from = (r - k + n) % n;
    if (allreduce)
      rc = sg__comm_exchange(c, op, to, mineq, ownwb, from,
                             s.sendbuf + s.woff[from], s.wb[from], msg);
    else
      rc = sg__comm_exchange(c, op, to, &s.bad[r], 1, from, &s.bad[from], 1,
                             msg);
    if (rc)
      goto out;
  }
  nbad = 0;
  for (int q = 0; q < n; q++) {
    if (allreduce) {
      unsigned flags;
      if (sg__quant_check(s.sendbuf + s.woff[q], s.wb[q], op->quant, s.len[q],
                          &flags) != 0) {
        snprintf(msg, 256, "%s: rank %d sent a bad reduced block", what, q);
        rc = SG_EPROTO;
        goto out;
      }
      s.bad[q] = (flags & SG__QUANT_OVERFLOW) != 0;
    } else if (s.bad[q] > 1) {
      snprintf(msg, 256, "%s: rank %d sent a bad status", what, q);
      rc = SG_EPROTO;
      goto out;
    }
    nbad += s.bad[q] != 0;
  }
  if (nbad) {
    snprintf(msg, 256, "%s: the reduction overflowed float32 at ", what);
    name_ranks(s.bad, n, msg);
    op->data_error = 1;
    rc = SG_EINVAL;
    goto out;
  }

  /* 6. dequantize */
  if (allreduce) {
    for (int q = 0; q < n; q++)
      sg__quant_decode(op->quant, s.sendbuf + s.woff[q], s.len[q],
                       (float *)op->buf + s.off[q]);
  } else {
    sg__quant_decode(op->quant, mineq, own, (float *)op->buf);
  }
  goto out;
nomem:
  snprintf(msg, 256, "%s: out of memory", what);
  rc = SG_ENOMEM;
out:
  qstate_free(&s);
  return rc;
}
