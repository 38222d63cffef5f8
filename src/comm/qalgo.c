/*
 * qalgo.c: the quantized allreduce and reduce-scatter (stepguard/comm.h
 * describes them; quant.c has the kernels and the wire block).
 *
 * Part i of the input (the allreduce's chunk i, the reduce-scatter's
 * i-th slice) belongs to rank i.  Each part travels as a run of pieces of
 * at most c->quant_chunk elements (a multiple of the scale block, so the
 * blocks and their scales are those of the whole part), one wire block
 * each: the engine sends a piece as soon as it is quantized and hands over
 * each one that lands, so the kernels run while the link is busy.
 *
 *   A. all-to-all, n - 1 pairwise rounds: round k sends part r + k to its
 *      owner and receives the own part from rank r - k.  Between socket
 *      calls: quantize the next piece to send (first the running round's,
 *      then ahead); in the last round, reduce each piece of the own part
 *      as the last rank's piece lands (every other rank's came in earlier
 *      rounds): the dequantized pieces and the own exact values, added in
 *      rank order in float32 (AVG divides once at the end), quantized once.
 *   S. status: an all-gather of one byte per rank (its input held a NaN or
 *      an infinity; its reduction overflowed; it was sent a malformed
 *      block), so every rank takes the same decision, before anything is
 *      written.
 *   B. allreduce: all-gather of the reduced parts, n - 1 pairwise rounds,
 *      each piece dequantized into the buffer as it lands, the own part's
 *      while the first round runs (the owner uses the same quantized bits
 *      as everyone else).  Reduce-scatter: the own reduced part is
 *      dequantized into the output.
 *
 * The results are those of quantizing, reducing and dequantizing the whole
 * parts at once: the same blocks, scales, additions and order.  A failure
 * of a peer is the engine's error, as for any operation; the buffer is
 * written only in B (a peer lost during B leaves it partly written, as the
 * full-precision ring does).
 */
#include <stdio.h>
#include <string.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"

/* status bits (S) */
#define ST_NONFINITE 1u /* the rank's input held a NaN or an infinity */
#define ST_OVERFLOW 2u  /* its reduction overflowed float32 */
#define ST_PROTO 4u     /* it was sent a malformed block */

struct qpart {
  size_t off, len; /* elements of the input */
  size_t woff;     /* offset of its wire pieces in sendbuf */
  int npc;         /* pieces */
};

struct qrun {
  sg_comm_t *c;
  sg__comm_op_t *op;
  int n, r, allreduce;
  sg_comm_quant_t fmt;
  const float *in;
  float *out;       /* the allreduce's buffer, or the reduce-scatter's output */
  size_t pc, pcwb;  /* elements and wire bytes of a whole piece */
  struct qpart *pt; /* per part */
  uint8_t *sendbuf; /* every part's pieces (own part: the reduced ones) */
  uint8_t *recvbuf; /* n copies of the own part's pieces, one per rank */
  size_t ownwire;   /* wire bytes of the own part */
  float *acc;       /* one piece's reduction */
  sg__comm_seg_t *ss, *rs;
  unsigned mine;    /* own status bits */
  int bad_sender;   /* the first rank that sent a malformed block, or -1 */
  int round;        /* the running transfer's round */
  int enc_k, enc_j; /* next piece to quantize: round enc_k's part, piece
                       enc_j (enc_k == n: all done) */
  int reduced;      /* pieces of the own part reduced */
  int from;         /* B: the running round's source */
  int dec_from;     /* B: its pieces dequantized */
  int dec_own;      /* B: own pieces dequantized */
};

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

static int npieces(size_t len, size_t pc) {
  return len ? (int)((len + pc - 1) / pc) : 1;
}

/* piece_len: elements of piece j of a part of len elements. */
static size_t piece_len(const struct qrun *q, size_t len, int j) {
  size_t o = (size_t)j * q->pc;
  return len - o < q->pc ? len - o : q->pc;
}

static size_t part_wire(const struct qrun *q, size_t len) {
  int np = npieces(len, q->pc);
  return (size_t)(np - 1) * q->pcwb +
         sg__quant_wire_bytes(piece_len(q, len, np - 1));
}

/* name_ranks: "rank 2" or "ranks 1, 3" for the ranks whose status has
 * `bit`, appended to out (256 bytes). */
static void name_ranks(const uint8_t *st, int n, unsigned bit, char *out) {
  int count = 0;
  for (int i = 0; i < n; i++)
    count += (st[i] & bit) != 0;
  size_t used = strlen(out);
  used += (size_t)snprintf(out + used, 256 - used, "%s",
                           count == 1 ? "rank " : "ranks ");
  int k = 0;
  for (int i = 0; i < n && used < 200; i++)
    if (st[i] & bit)
      used +=
          (size_t)snprintf(out + used, 256 - used, "%s%d", k++ ? ", " : "", i);
}

static void note_bad(struct qrun *q, int sender) {
  q->mine |= ST_PROTO;
  if (q->bad_sender < 0)
    q->bad_sender = sender;
}

/* encode_next: quantize the next piece to send (A). */
static void encode_next(struct qrun *q) {
  int p = (q->r + q->enc_k) % q->n, j = q->enc_j;
  const struct qpart *t = &q->pt[p];
  size_t len = piece_len(q, t->len, j);
  uint8_t *w = q->sendbuf + t->woff + (size_t)j * q->pcwb;
  int bad =
      sg__quant_encode(q->fmt, q->in + t->off + (size_t)j * q->pc, len, w);
  sg__quant_set_flags(w, bad ? SG__QUANT_NONFINITE : 0u);
  if (bad)
    q->mine |= ST_NONFINITE;
  if (++q->enc_j == t->npc) {
    q->enc_k++;
    q->enc_j = 0;
  }
}

/* reduce_piece: piece j of the own part, from every rank's (A). */
static void reduce_piece(struct qrun *q, int j) {
  const struct qpart *t = &q->pt[q->r];
  size_t len = piece_len(q, t->len, j), wb = sg__quant_wire_bytes(len);
  size_t at = (size_t)j * q->pcwb;
  if (len)
    memset(q->acc, 0, len * sizeof(float));
  for (int s = 0; s < q->n; s++) {
    if (s == q->r) {
      if (sg__quant_add_f32(q->acc, q->in + t->off + (size_t)j * q->pc, len))
        q->mine |= ST_NONFINITE;
      continue;
    }
    const uint8_t *w = q->recvbuf + (size_t)s * q->ownwire + at;
    unsigned flags;
    if (sg__quant_check(w, wb, q->fmt, len, &flags) != 0)
      note_bad(q, s);
    else
      sg__quant_decode_add(q->fmt, w, len, q->acc);
  }
  if (q->op->redop == SG_COMM_AVG)
    sg__quant_div(q->acc, len, q->n);
  uint8_t *w = q->sendbuf + t->woff + at;
  int over = sg__quant_encode(q->fmt, q->acc, len, w);
  sg__quant_set_flags(w, over ? SG__QUANT_OVERFLOW : 0u);
  if (over)
    q->mine |= ST_OVERFLOW;
}

/* work_a: the all-to-all's computation, one piece per call. */
static int work_a(sg__comm_xfer_t *x) {
  struct qrun *q = x->work_arg;
  int last = q->round == q->n - 1;
  /* keep the stream fed: the running round's pieces first */
  if (q->enc_k == q->round && x->sready <= x->sk + 2) {
    encode_next(q);
    x->sready = q->enc_k == q->round ? q->enc_j : x->ns;
    return 1;
  }
  if (last && q->reduced < sg__comm_xfer_rsegs(x)) {
    reduce_piece(q, q->reduced++);
    return 1;
  }
  if (q->enc_k < q->n) { /* ahead: this round's rest, the next rounds' */
    int mine = q->enc_k == q->round;
    encode_next(q);
    if (mine)
      x->sready = q->enc_k == q->round ? q->enc_j : x->ns;
    return 1;
  }
  return 0;
}

/* decode_from: piece j of part p, received in B, into the output. */
static void decode_from(struct qrun *q, int p, int j) {
  const struct qpart *t = &q->pt[p];
  size_t len = piece_len(q, t->len, j);
  const uint8_t *w = q->sendbuf + t->woff + (size_t)j * q->pcwb;
  unsigned flags;
  if (q->mine & ST_PROTO)
    return; /* failing anyway */
  if (sg__quant_check(w, sg__quant_wire_bytes(len), q->fmt, len, &flags) != 0 ||
      flags != 0) {
    note_bad(q, p);
    return;
  }
  sg__quant_decode(q->fmt, w, len, q->out + t->off + (size_t)j * q->pc);
}

/* work_b: the all-gather's computation, one piece per call: what landed,
 * else the own part. */
static int work_b(sg__comm_xfer_t *x) {
  struct qrun *q = x->work_arg;
  if (q->dec_from < sg__comm_xfer_rsegs(x)) {
    decode_from(q, q->from, q->dec_from++);
    return 1;
  }
  if (q->dec_own < q->pt[q->r].npc) {
    decode_from(q, q->r, q->dec_own++);
    return 1;
  }
  return 0;
}

/* xfer: one pairwise round: send part `sp`'s pieces from `sbase` to rank
 * to, receive part `rp`'s into `rbase` from rank from. */
static int xfer(struct qrun *q, int to, int sp, uint8_t *sbase, int from,
                int rp, uint8_t *rbase, int sready,
                int (*work)(sg__comm_xfer_t *), char *msg) {
  const struct qpart *s = &q->pt[sp], *t = &q->pt[rp];
  for (int j = 0; j < s->npc; j++)
    q->ss[j] =
        (sg__comm_seg_t){.p = sbase + (size_t)j * q->pcwb,
                         .len = sg__quant_wire_bytes(piece_len(q, s->len, j))};
  for (int j = 0; j < t->npc; j++)
    q->rs[j] =
        (sg__comm_seg_t){.p = rbase + (size_t)j * q->pcwb,
                         .len = sg__quant_wire_bytes(piece_len(q, t->len, j))};
  sg__comm_xfer_t x = {.c = q->c,
                       .op = q->op,
                       .send_peer = to,
                       .recv_peer = from,
                       .ss = q->ss,
                       .rs = q->rs,
                       .ns = s->npc,
                       .nr = t->npc,
                       .link = -1,
                       .esize = 1,
                       .work = work,
                       .work_arg = q,
                       .sready = sready,
                       .msg = msg};
  return sg__comm_xfer_run(&x);
}

static void qrun_free(struct qrun *q) {
  sg_free(q->pt);
  sg_free(q->sendbuf);
  sg_free(q->recvbuf);
  sg_free(q->acc);
  sg_free(q->ss);
  sg_free(q->rs);
}

/* decide: the failure every rank agrees on from the statuses, or 0. */
static int decide(struct qrun *q, const uint8_t *st, const char *what,
                  char *msg) {
  unsigned any = 0;
  for (int i = 0; i < q->n; i++)
    any |= st[i];
  if (any & ST_PROTO) {
    if (q->bad_sender >= 0)
      snprintf(msg, 256,
               "%s: rank %d sent a block of another format or size "
               "(ranks disagree on the operation)",
               what, q->bad_sender);
    else {
      snprintf(msg, 256, "%s: malformed blocks reached ", what);
      name_ranks(st, q->n, ST_PROTO, msg);
    }
    return SG_EPROTO;
  }
  if (any & ST_NONFINITE) {
    snprintf(msg, 256, "%s: NaN or infinity in the input of ", what);
    name_ranks(st, q->n, ST_NONFINITE, msg);
    q->op->data_error = 1;
    return SG_EINVAL;
  }
  if (any & ST_OVERFLOW) {
    snprintf(msg, 256, "%s: the reduction overflowed float32 at ", what);
    name_ranks(st, q->n, ST_OVERFLOW, msg);
    q->op->data_error = 1;
    return SG_EINVAL;
  }
  return 0;
}

int sg__comm_run_quant(sg_comm_t *c, sg__comm_op_t *op, char *msg) {
  int n = c->world, r = c->rank, rc = 0;
  const char *what = sg__comm_kind_name(op->kind);
  struct qrun q = {.c = c,
                   .op = op,
                   .n = n,
                   .r = r,
                   .allreduce = op->kind == SG__COMM_KIND_ALLREDUCE_Q,
                   .fmt = op->quant,
                   .out = (float *)op->buf,
                   .bad_sender = -1};
  q.in = q.allreduce ? (const float *)op->buf : (const float *)op->in;
  q.pc = c->quant_chunk;
  q.pcwb = sg__quant_wire_bytes(q.pc);
  uint8_t *status = sg_malloc((size_t)n);
  q.pt = sg_calloc((size_t)n, sizeof(*q.pt));
  if (!q.pt || !status)
    goto nomem;
  size_t total = 0;
  int maxpc = 1;
  for (int i = 0; i < n; i++) {
    struct qpart *t = &q.pt[i];
    part(op, n, i, &t->off, &t->len);
    t->npc = npieces(t->len, q.pc);
    t->woff = total;
    total += part_wire(&q, t->len);
    maxpc = t->npc > maxpc ? t->npc : maxpc;
  }
  const struct qpart *own = &q.pt[r];
  q.ownwire = part_wire(&q, own->len);
  q.sendbuf = sg_malloc(total);
  q.recvbuf = sg_malloc(q.ownwire * (size_t)n);
  size_t accn = own->len < q.pc ? own->len : q.pc;
  q.acc = sg_malloc(accn ? accn * sizeof(float) : 1);
  q.ss = sg_calloc((size_t)maxpc, sizeof(*q.ss));
  q.rs = sg_calloc((size_t)maxpc, sizeof(*q.rs));
  if (!q.sendbuf || !q.recvbuf || !q.acc || !q.ss || !q.rs)
    goto nomem;

  /* A: all-to-all, quantizing and reducing between socket calls */
  q.enc_k = 1;
  for (int k = 1; k < n; k++) {
    int to = (r + k) % n, from = (r - k + n) % n;
    q.round = k;
    int ready = q.enc_k > k ? q.pt[to].npc : q.enc_k == k ? q.enc_j : 0;
    rc = xfer(&q, to, to, q.sendbuf + q.pt[to].woff, from, r,
              q.recvbuf + (size_t)from * q.ownwire, ready, work_a, msg);
    if (rc)
      goto out;
  }
  while (q.reduced < own->npc) /* what the last round left (n = 1: all) */
    reduce_piece(&q, q.reduced++);

  /* S: every rank's status, before anything is written */
  status[r] = (uint8_t)q.mine;
  for (int k = 1; k < n; k++) {
    int to = (r + k) % n, from = (r - k + n) % n;
    rc = sg__comm_exchange(c, op, to, &status[r], 1, from, &status[from], 1,
                           msg);
    if (rc)
      goto out;
    if (status[from] & ~(ST_NONFINITE | ST_OVERFLOW | ST_PROTO)) {
      snprintf(msg, 256, "%s: rank %d sent a bad status", what, from);
      rc = SG_EPROTO;
      goto out;
    }
  }
  rc = decide(&q, status, what, msg);
  if (rc)
    goto out;

  /* B: the reduced parts, dequantized as they land */
  if (q.allreduce) {
    for (int k = 1; k < n; k++) {
      int to = (r + k) % n, from = (r - k + n) % n;
      q.from = from;
      q.dec_from = 0;
      rc = xfer(&q, to, r, q.sendbuf + own->woff, from, from,
                q.sendbuf + q.pt[from].woff, own->npc, work_b, msg);
      if (rc)
        goto out;
      while (q.dec_from < q.pt[from].npc)
        decode_from(&q, from, q.dec_from++);
    }
    while (q.dec_own < own->npc)
      decode_from(&q, r, q.dec_own++);
  } else {
    /* the output starts at the own part: decode at offset 0 */
    for (int j = 0; j < own->npc; j++) {
      size_t len = piece_len(&q, own->len, j);
      sg__quant_decode(q.fmt, q.sendbuf + own->woff + (size_t)j * q.pcwb, len,
                       q.out + (size_t)j * q.pc);
    }
  }
  if (q.mine & ST_PROTO) {
    snprintf(msg, 256, "%s: rank %d sent a bad reduced block", what,
             q.bad_sender);
    rc = SG_EPROTO;
  }
  goto out;
nomem:
  snprintf(msg, 256, "%s: out of memory", what);
  rc = SG_ENOMEM;
out:
  qrun_free(&q);
  sg_free(status);
  return rc;
}
