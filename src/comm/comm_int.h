/*
 * comm_int.h: the pure parts of the collectives, shared by comm.c, the unit
 * tests and the fuzzer.
 *
 *   proto.c    handshake and frame encoders and parsers (no I/O)
 *   plan.c     chunk plans and ring schedules
 *   kernels.c  reduction kernels and half-precision conversions
 */
#ifndef SG_COMM_INT_H
#define SG_COMM_INT_H

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
 */
#define SG__COMM_VERSION 2
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
};

typedef struct sg__comm_frame_s {
  int type;       /* SG__COMM_FRAME_* */
  uint16_t kind;  /* operation kind (OP, ACK) */
  uint16_t flags; /* OP only: SG__COMM_OP_PULL */
  uint64_t seq;   /* OP, ACK, BYE: sequence; DESC: address; PULL: 0 or 1 */
  uint64_t bytes; /* OP, ACK: payload bytes; DESC: length */
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
 * other than 0 or 1). */
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

/* sg__comm_parse_addr: "host:port" or "[v6]:port" into host (cap bytes) and
 * port; 0 or SG_EINVAL. */
int sg__comm_parse_addr(const char *addr, char *host, size_t cap, int *port);

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

#endif
