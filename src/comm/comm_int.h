/*
 * comm_int.h: what the files of src/comm share and nothing else does: the
 * pure parts of the collectives (also used by the unit tests and the
 * fuzzer) and the communicator's state.
 *
 *   proto.c    handshake and frame encoders and parsers (no I/O)
 *   plan.c     chunk plans and ring schedules
 *   kernels.c  reduction kernels and half-precision conversions
 *   quant.c    quantization kernels (int8, fp8 e4m3fn) and their wire blocks
 *   comm.c     the queue, the progress thread, abort and teardown
 *   setup.c    listen, dial lower ranks, accept higher ones, same-host probe
 *   engine.c   the transfer engine (sg__comm_xfer_run)
 *   algo.c     the collective algorithms over the engine
 *   qalgo.c    the quantized allreduce and reduce-scatter
 */
#ifndef SG_COMM_INT_H
#define SG_COMM_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "stepguard/comm.h"

/* ---- wire format (proto.c) ----------------------------------------------- */

/*
 * Everything is little-endian.  A connection starts with HELLO from the
 * connecting (higher) rank and REPLY from the accepting one; after that each
 * operation's transfer on a connection starts with an OP header, and a
 * communicator that shuts down cleanly ends each connection with BYE.
 *
 *   HELLO  "SGC1" u16 version u16 kind=1 u64 generation u32 rank u32 world
 *          u16 job_len u16 token_len, then job and token bytes
 *   REPLY  "SGC1" u16 version u16 kind=2 u64 generation u32 rank i32 status
 *   OFFER  "SGSH" u16 version u16 flags, 32 bytes sg_samehost_id, u64
 *          probe_addr, 32 probe bytes (every connection, both ways, once
 *          the mesh is complete; flags bit 0 = may be read by cross-memory
 *          attach)
 *   PULL   "SGPL" u16 0 u16 0 u64 will_read (0 or 1) u64 0: the answer to an
 *          OFFER: whether the sender will read the offerer's memory
 *   OP     "SGOP" u16 kind u16 flags u64 seq u64 payload_bytes; flags bit 0
 *          = the payload follows as DESC frames, read by the receiver
 *   DESC   "SGDS" u16 0 u16 0 u64 address u64 length: the next `length`
 *          bytes of the payload are at `address` in the sender
 *   ACK    "SGAK" u16 kind u16 0 u64 seq u64 payload_bytes: the receiver of
 *          a DESC payload has read all of it (the sender may reuse it)
 *   BYE    "SGBY" u16 0 u16 0 u64 seq u64 0
 *   SEG    "SGSG" u16 0 u16 0 u64 index u64 length: starts payload segment
 *          `index` (>= 1) of a TCP transfer; segment 0 follows the OP frame
 *   KEEPALIVE "SGKA" u16 0 u16 0 u64 0 u64 0: "still here"; sent on a quiet
 *          connection wherever a frame may start (never inside a payload
 *          segment) and skipped by the reader
 *
 * Version 3 added SEG and KEEPALIVE; HELLO, REPLY and OFFER must carry the
 * same version on both ends, so a version 2 peer is refused at the
 * handshake and never sees them.
 */
#define SG__COMM_VERSION 3
#define SG__COMM_HELLO_FIXED 28
#define SG__COMM_HELLO_MAX                                                     \
  (SG__COMM_HELLO_FIXED + SG_COMM_MAX_JOB + SG_COMM_MAX_TOKEN)
#define SG__COMM_REPLY_LEN 24
#define SG__COMM_FRAME_LEN 24
#define SG__COMM_OFFER_LEN 80
#define SG__COMM_PROBE_LEN 32
#define SG__COMM_OP_PULL 1 /* OP flags: payload by descriptor */

typedef struct sg__comm_hello_s {
  uint64_t generation;
  uint32_t rank, world;
  uint16_t job_len, token_len;
  const uint8_t *job, *token; /* point into the parsed bytes */
} sg__comm_hello_t;

typedef struct sg__comm_reply_s {
  uint64_t generation;
  uint32_t rank;
  int32_t status; /* 0 = accepted, else a negative SG_E* code */
} sg__comm_reply_t;

enum {
  SG__COMM_FRAME_OP = 1,
  SG__COMM_FRAME_BYE = 2,
  SG__COMM_FRAME_DESC = 3,
  SG__COMM_FRAME_ACK = 4,
  SG__COMM_FRAME_PULL = 5,
  SG__COMM_FRAME_SEG = 6,
  SG__COMM_FRAME_KEEPALIVE = 7,
};

typedef struct sg__comm_frame_s {
  int type;       /* SG__COMM_FRAME_* */
  uint16_t kind;  /* operation kind (OP, ACK) */
  uint16_t flags; /* OP only: SG__COMM_OP_PULL */
  uint64_t seq;   /* OP, ACK, BYE: sequence; DESC: address; PULL: 0 or 1;
                     SEG: segment index */
  uint64_t bytes; /* OP, ACK: payload bytes; DESC, SEG: length */
} sg__comm_frame_t;

typedef struct sg__comm_offer_s {
  uint16_t flags; /* bit 0: the offerer may be read */
  uint8_t id[32]; /* encoded sg_samehost_id (stepguard/samehost.h) */
  uint64_t probe_addr;
  uint8_t probe[SG__COMM_PROBE_LEN];
} sg__comm_offer_t;

/* sg__comm_hello_encode: writes HELLO into buf (>= SG__COMM_HELLO_MAX);
 * returns its length, or SG_ETOOBIG when job or token is over its limit. */
int sg__comm_hello_encode(uint8_t *buf, uint64_t generation, uint32_t rank,
                          uint32_t world, const char *job, const char *token);

/*
 * sg__comm_hello_parse: parse HELLO from the n bytes at p.  Returns the
 * number of bytes it took (> 0), 0 when more bytes are needed, or SG_EPROTO
 * (bad magic, version, kind, or a length over its limit).
 */
int sg__comm_hello_parse(const uint8_t *p, size_t n, sg__comm_hello_t *h);

/* sg__comm_reply_encode: writes SG__COMM_REPLY_LEN bytes. */
void sg__comm_reply_encode(uint8_t *buf, uint64_t generation, uint32_t rank,
                           int32_t status);

/* sg__comm_reply_parse: as hello_parse. */
int sg__comm_reply_parse(const uint8_t *p, size_t n, sg__comm_reply_t *r);

/* sg__comm_frame_encode: writes SG__COMM_FRAME_LEN bytes. */
void sg__comm_frame_encode(uint8_t *buf, const sg__comm_frame_t *f);

/* sg__comm_frame_parse: needs exactly SG__COMM_FRAME_LEN bytes; returns 0
 * or SG_EPROTO (unknown magic, nonzero reserved fields, unknown OP flags,
 * a DESC of length 0 or one that wraps the address space, a PULL answer
 * other than 0 or 1, a SEG of index 0, a KEEPALIVE with a nonzero field). */
int sg__comm_frame_parse(const uint8_t *p, size_t n, sg__comm_frame_t *f);

/* sg__comm_offer_encode: writes SG__COMM_OFFER_LEN bytes. */
void sg__comm_offer_encode(uint8_t *buf, const sg__comm_offer_t *o);

/* sg__comm_offer_parse: needs exactly SG__COMM_OFFER_LEN bytes; 0 or
 * SG_EPROTO (magic, version, unknown flags). */
int sg__comm_offer_parse(const uint8_t *p, size_t n, sg__comm_offer_t *o);

/*
 * sg__comm_hello_check: whether a parsed HELLO may join a communicator of
 * (generation, rank, world, job, token): 0, SG_EAUTH (token) or SG_EPROTO
 * (generation, job, world, or a rank that is not above `rank`); detail in
 * err.  The token compare takes the same time for every wrong token of a
 * given length.
 */
int sg__comm_hello_check(const sg__comm_hello_t *h, uint64_t generation,
                         int rank, int world, const char *job,
                         const char *token, sg_err_t *err);

/* ---- plans (plan.c) ---------------------------------------------------- */

/*
 * sg__comm_chunk: split `count` elements into `n` chunks, the first
 * count % n of them one element longer; chunk i covers elements
 * [*off, *off + *len).
 */
void sg__comm_chunk(size_t count, int n, int i, size_t *off, size_t *len);

/*
 * The ring: rank r sends to r + 1 and receives from r - 1.  Step k of a ring
 * pass sends chunk (r - k - shift) mod n and receives chunk
 * (r - k - 1 - shift) mod n.  Allreduce runs 2(n - 1) steps with shift 0
 * (the first n - 1 reduce, the rest copy); reduce-scatter runs n - 1
 * reducing steps with shift 1 so that chunk r ends on rank r; allgather runs
 * n - 1 copying steps with shift 0.
 */
int sg__comm_ring_send_chunk(int rank, int n, int step, int shift);
int sg__comm_ring_recv_chunk(int rank, int n, int step, int shift);

/*
 * Recursive doubling for the latency algorithm: p2 = the largest power of
 * two <= n.  Ranks >= p2 ("extras") first fold their data into rank - p2 and
 * get the result back at the end.  sg__comm_rd_partner gives the partner of
 * `rank` in round `round` (0 .. log2(p2) - 1), or -1 when it sits out.
 */
int sg__comm_pow2_floor(int n);
int sg__comm_rd_partner(int rank, int n, int round);

/* ---- kernels (kernels.c) ----------------------------------------------- */

/*
 * sg__comm_reduce: dst[i] = op(a[i], b[i]) for i < count, in that operand
 * order (so every rank that reduces the same operands gets the same bits).
 * dst may alias a or b exactly.  AVG reduces as SUM.  Half types are
 * widened to float32, combined, and rounded back once (nearest even).
 */
void sg__comm_reduce(sg_comm_dtype_t dtype, sg_comm_redop_t op, void *dst,
                     const void *a, const void *b, size_t count);

/* sg__comm_scale_avg: buf[i] /= n (AVG's final step). */
void sg__comm_scale_avg(sg_comm_dtype_t dtype, void *buf, size_t count, int n);

/* Conversions (round to nearest even; NaN stays NaN, quiet). */
float sg__comm_f16_to_f32(uint16_t h);
uint16_t sg__comm_f32_to_f16(float f);
float sg__comm_bf16_to_f32(uint16_t h);
uint16_t sg__comm_f32_to_bf16(float f);

/* ---- quantization (quant.c) --------------------------------------------- */

/* Elements per scale.  The wire format is described in quant.c. */
#define SG__QUANT_BLOCK 512

/* Elements per piece of the quantized collectives' pipeline (qalgo.c): a
 * multiple of SG__QUANT_BLOCK; the communicator's quant_chunk, which tests
 * lower to run many pieces on small inputs. */
#define SG__QUANT_CHUNK (256u * SG__QUANT_BLOCK)

/* Wire block flags: the block's values held a NaN or an infinity (those
 * scale blocks went as zeros); the owner's reduction overflowed. */
#define SG__QUANT_NONFINITE 1u
#define SG__QUANT_OVERFLOW 2u
#define SG__QUANT_FLAGS_ALL 3u

/* float32 <-> float8 e4m3fn, bit for bit as torch.float8_e4m3fn converts
 * in range: round to nearest even; beyond +-448 (infinity included) the
 * result saturates to +-448; NaN gives the NaN code (0x7f, sign kept).
 * The NaN codes decode to the quiet NaN, sign kept. */
uint8_t sg__fp8_from_f32(float f);
float sg__fp8_to_f32(uint8_t c);

/* sg__quant_wire_bytes: the size of the wire block of `count` elements. */
size_t sg__quant_wire_bytes(size_t count);

/* sg__quant_encode: quantize x[0..count) into `wire`
 * (sg__quant_wire_bytes(count) bytes, 4-byte aligned) with flags 0.
 * Returns 1 when x holds a NaN or an infinity (those blocks are encoded as
 * zeros), else 0. */
int sg__quant_encode(sg_comm_quant_t fmt, const float *x, size_t count,
                     uint8_t *wire);

/* sg__quant_set_flags: set the header's flags (SG__QUANT_*). */
void sg__quant_set_flags(uint8_t *wire, unsigned flags);

/* sg__quant_check: whether the `nbytes` at wire are a block of `count`
 * elements of format fmt: 0 (flags in *flags) or SG_EPROTO. */
int sg__quant_check(const uint8_t *wire, size_t nbytes, sg_comm_quant_t fmt,
                    size_t count, unsigned *flags);

/* sg__quant_decode: out[i] = element i of a checked block;
 * sg__quant_decode_add: acc[i] += it (float32, one rounding each). */
void sg__quant_decode(sg_comm_quant_t fmt, const uint8_t *wire, size_t count,
                      float *out);
void sg__quant_decode_add(sg_comm_quant_t fmt, const uint8_t *wire,
                          size_t count, float *acc);

/* sg__quant_add_f32: acc[i] += x[i]; returns 1 when x holds a NaN or an
 * infinity, else 0.  sg__quant_div: acc[i] /= d. */
int sg__quant_add_f32(float *acc, const float *x, size_t n);
void sg__quant_div(float *acc, size_t n, int d);

/* ---- the communicator (comm.c, setup.c, engine.c, algo.c) -------------- */

typedef struct sg__comm_op_s sg__comm_op_t;
typedef struct sg__comm_peer_s sg__comm_peer_t;
typedef struct sg__comm_seg_s sg__comm_seg_t;
typedef struct sg__comm_xfer_s sg__comm_xfer_t;

/* Operation kinds, as OP frames carry them. */
typedef enum sg__comm_kind_e {
  SG__COMM_KIND_ALLREDUCE = 1,
  SG__COMM_KIND_BROADCAST = 2,
  SG__COMM_KIND_ALLGATHER = 3,
  SG__COMM_KIND_REDUCE_SCATTER = 4,
  SG__COMM_KIND_ALLTOALL = 5,
  SG__COMM_KIND_SEND = 6,
  SG__COMM_KIND_RECV = 7,
  SG__COMM_KIND_BARRIER = 8,
  SG__COMM_KIND_ALLREDUCE_Q = 9,
  SG__COMM_KIND_REDUCE_SCATTER_Q = 10,
} sg__comm_kind_t;

/* A queued operation (a request object): the arguments of one collective. */
struct sg__comm_op_s {
  sg__comm_op_t *next;
  int kind;
  sg_deadline_t deadline;
  sg_comm_done_cb cb;
  void *ud;
  uint8_t *buf;      /* allreduce, broadcast, send/recv, reduce_scatter out */
  const uint8_t *in; /* allgather input */
  size_t count;      /* elements (allreduce, reduce_scatter) */
  size_t nbytes;     /* bytes (broadcast, allgather, send/recv) */
  sg_comm_dtype_t dtype;
  sg_comm_redop_t redop;
  int peer;            /* root, dst or src */
  uint8_t **outs;      /* world pointers, owned (allgather, alltoall) */
  const uint8_t **ins; /* world pointers, owned (reduce_scatter, alltoall) */
  size_t *in_bytes, *out_bytes; /* world sizes, owned (alltoall) */
  sg_comm_quant_t quant;        /* quantized kinds: the format */
  int data_error; /* set by the algorithm: the operation failed on every
                     rank alike for its data (a NaN), with every stream in
                     step, so the communicator stays usable */
};

/* One connection of the mesh. */
struct sg__comm_peer_s {
  int fd;
  int unwatched;    /* crash watch off: seen gone, said BYE or has data */
  uint64_t gone_at; /* order in which it was seen gone; 0 = not seen */
  uint64_t tx_seq;  /* transfers sent on this connection */
  uint64_t rx_seq;  /* transfers received on this connection */
  int pull_from;    /* we read this peer's memory (same host, probed) */
  int pull_to;      /* this peer reads ours */
  uint32_t pid;     /* the peer's pid (pull_from) */
  int64_t last_rx;  /* sg_now_ns() when bytes last came from it */
  int64_t last_tx;  /* sg_now_ns() when bytes last went to it */
  uint8_t ka[SG__COMM_FRAME_LEN]; /* a KEEPALIVE partly sent */
  size_t ka_off; /* bytes of ka sent; SG__COMM_FRAME_LEN: none pending */
};

/* The communicator's life: new, connecting (sg_comm_connect), ready or
 * failed. */
typedef enum sg__comm_state_e {
  SG__COMM_ST_NEW,
  SG__COMM_ST_CONNECTING,
  SG__COMM_ST_READY,
  SG__COMM_ST_FAILED
} sg__comm_state_t;

/* The communicator (stepguard/comm.h). */
struct sg_comm_s {
  int rank, world;
  uint64_t generation;
  char *job, *token;
  size_t small_max;
  int same_host;       /* opts.same_host */
  size_t pull_min;     /* same-host path for transfers of at least this */
  int64_t progress_ns; /* progress deadline; 0 = off */
  int64_t ka_ns;       /* KEEPALIVE after this long without sending */
  int64_t ka_next;     /* progress thread: no KEEPALIVE is due before */
  uint8_t probe[SG__COMM_PROBE_LEN]; /* what peers read to prove the path */
  int listen_fd, port;
  int wake_fd; /* eventfd: readable once aborted or closing */
  sg__comm_peer_t *peers;

  pthread_mutex_t mu;
  pthread_cond_t cv;
  sg__comm_op_t *head, *tail; /* queue (mu) */
  sg__comm_state_t state;     /* (mu) */
  int closing;                /* sg_comm_free started (mu) */
  int running;                /* an operation is on the progress thread (mu) */
  int err_code;               /* sticky error (mu) */
  char err_msg[256];          /* (mu) */
  atomic_int aborted;
  atomic_int stop; /* abort or close: running work ends now */
  pthread_t thread;
  int thread_started;
  uint64_t gone_count; /* progress thread: peers seen gone so far */
  int clean;           /* progress thread ended with no error: BYE on close */
  unsigned fork_gen;   /* sg_sock_fork_count() at creation */

  uint8_t *stage; /* progress thread only */
  size_t stage_cap;
  size_t quant_chunk; /* SG__QUANT_CHUNK, a multiple of SG__QUANT_BLOCK */
};

/* One segment of a transfer's send or receive stream. */
struct sg__comm_seg_s {
  uint8_t *p;         /* where bytes are read from (send) or land (recv) */
  size_t len;         /* bytes */
  const uint8_t *src; /* reduce segments: the local operand */
};

/* One transfer: a send stream to one peer and a receive stream from one
 * (either may be idle), run by sg__comm_xfer_run. */
struct sg__comm_xfer_s {
  sg_comm_t *c;
  sg__comm_op_t *op;
  int send_peer, recv_peer; /* -1 when that side is idle */
  sg__comm_seg_t *ss, *rs;
  int ns, nr;
  int nreduce; /* receive segments [0, nreduce) are reduced */
  int link;    /* send seg j waits for receive seg j - link; -1 never */
  size_t esize;
  /* Optional computation interleaved with the transfer (the quantized
   * collectives: quantize the next segment while the last one is on the
   * wire, reduce what has landed).  When `work` is set, send segments
   * [sready, ns) wait until it raises sready.  The engine calls it once per
   * pass, after moving what the sockets allow; it returns 1 when it did
   * something (another pass follows at once), 0 when it has nothing to do
   * until more bytes land, or a negative SG_E* code with detail in msg. */
  int (*work)(sg__comm_xfer_t *x);
  void *work_arg;
  int sready;
  int spull; /* send_peer reads the payload: send DESC frames, await ACK */
  int rpull; /* read recv_peer's payload as its DESC frames say, then ACK */
  /* progress */
  uint8_t shdr[SG__COMM_FRAME_LEN], rhdr[SG__COMM_FRAME_LEN];
  size_t shdr_off, rhdr_off;
  uint8_t sdesc[SG__COMM_FRAME_LEN], rdesc[SG__COMM_FRAME_LEN];
  size_t sdesc_off; /* SG__COMM_FRAME_LEN: no DESC going out */
  size_t rdesc_off; /* bytes of the next incoming DESC */
  uint64_t raddr;   /* the current incoming DESC: where its rest is */
  size_t rleft;     /* and how many bytes are left of it */
  uint8_t ack_out[SG__COMM_FRAME_LEN], ack_in[SG__COMM_FRAME_LEN];
  size_t ack_out_off, ack_in_off; /* SG__COMM_FRAME_LEN: done or none */
  int sk, rk;                     /* current send / receive segment */
  size_t soff, roff, rdone;
  int64_t start_ns;    /* sg_now_ns() at the start: no peer is silent before */
  int no_drain;        /* send_peer queued bytes that are not KEEPALIVEs */
  int64_t watch_since; /* when we began to read send_peer's stream; 0: not */
  uint64_t stotal, rtotal, sent, rcvd;
  char *msg; /* error detail, 256 bytes */
};

/*
 * sg__comm_keepalive: send a KEEPALIVE to every peer that has had nothing
 * from us for c->ka_ns, where its stream is between frames (x: the running
 * transfer, or NULL), and finish one partly sent.  One frame per peer per
 * call; errors are left for the next transfer to see.  Progress thread.
 */
void sg__comm_keepalive(sg_comm_t *c, const sg__comm_xfer_t *x, int64_t now);

/* sg__comm_ka_flush: finish rank p's partly sent KEEPALIVE; 0 when none is
 * pending any more, 1 when the socket is full, or -errno. */
int sg__comm_ka_flush(sg_comm_t *c, int p);

/*
 * sg__comm_drain: consume the KEEPALIVEs at the head of rank p's stream (at
 * most a fixed budget), which counts as hearing from it.  Returns 0 when
 * nothing else is queued, 1 when other bytes come first (left in place),
 * 2 when the budget ran out, SG_EPEER at EOF, or -errno.
 */
int sg__comm_drain(sg_comm_t *c, int p);

/* sg__comm_kind_name: "allreduce", ... for an operation kind; "?" else. */
const char *sg__comm_kind_name(int k);

/* sg__comm_wake: make the wake fd readable (abort or close); any thread. */
void sg__comm_wake(sg_comm_t *c);
/* sg__comm_release: close the listening and wakeup descriptors and free
 * what sg_comm_new allocated, `c` included (peers are closed before; the
 * progress thread is not running).  Both the set-up's failure path and
 * sg_comm_free end here. */
void sg__comm_release(sg_comm_t *c);

/* sg__comm_stop_code, sg__comm_stop_msg: the error, and its message, of
 * work cut by a stop: SG_EABORTED after an abort, else SG_ECANCELED. */
int sg__comm_stop_code(sg_comm_t *c);
const char *sg__comm_stop_msg(sg_comm_t *c);

/* sg__comm_forked: whether this is a child forked after c was created; its
 * copy of c has no progress thread and its descriptors point to /dev/null. */
int sg__comm_forked(const sg_comm_t *c);

/* sg__comm_progress_main: the progress thread's body (argument: the
 * communicator), started by sg_comm_connect once the mesh is complete;
 * runs queued operations in order until close or abort. */
void *sg__comm_progress_main(void *arg);

/*
 * sg__comm_xfer_run: run transfer `x` to completion, failure, its op's
 * deadline (or a queued op's, if sooner) or a stop.  Progress thread only.
 * Returns 0 or a negative SG_E* code with detail in x->msg (256 bytes).
 */
int sg__comm_xfer_run(sg__comm_xfer_t *x);

/* sg__comm_xfer_rsegs: how many receive segments of `x` have landed
 * whole (for its work function). */
int sg__comm_xfer_rsegs(const sg__comm_xfer_t *x);

/* sg__comm_exchange: send one buffer to `sp` while receiving one from `rp`
 * (either may be -1; they may be the same rank); as sg__comm_xfer_run,
 * with detail in `msg` (256 bytes). */
int sg__comm_exchange(sg_comm_t *c, sg__comm_op_t *op, int sp, const void *sbuf,
                      size_t slen, int rp, void *rbuf, size_t rlen, char *msg);

/* sg__comm_run_op: run one operation with the algorithm that fits it;
 * 0 or a negative SG_E* code with detail in `msg` (256 bytes).  Progress
 * thread only. */
int sg__comm_run_op(sg_comm_t *c, sg__comm_op_t *op, char *msg);

/* sg__comm_run_quant: the quantized kinds (qalgo.c); as sg__comm_run_op. */
int sg__comm_run_quant(sg_comm_t *c, sg__comm_op_t *op, char *msg);

#endif
