/*
 * stepguard/comm.h: fault-tolerant TCP collectives.
 *
 * A communicator joins `world_size` processes of one generation (the quorum
 * id) over a full mesh of TCP connections.  Life cycle:
 *
 *   sg_comm_new()      listen on an ephemeral port; publish sg_comm_port()
 *   sg_comm_connect()  connect to lower ranks, accept higher ranks, check the
 *                      handshake (generation, job, token); starts the
 *                      communicator's progress thread
 *   sg_comm_allreduce() & co.   asynchronous operations with deadlines
 *   sg_comm_abort()    from any thread: every operation completes with
 *                      SG_EABORTED, later ones are refused
 *   sg_comm_free()     tear down (a new quorum gets a new communicator)
 *
 * Operations run one at a time, in submission order, on the progress thread;
 * every rank must submit the same operations in the same order (as with any
 * collective library).  Each operation completes exactly once through its
 * callback, on the progress thread, unless the submit call returns an error,
 * in which case the callback is never called.  Buffers are borrowed from
 * submission until the callback.
 *
 * Every collective gives identical bits on every rank: each element is
 * reduced in one fixed order, and half types (float16, bfloat16) are reduced
 * in float32 and rounded to the half type once per hop.
 *
 * A failure of any peer (reset, EOF, deadline, protocol error) fails the
 * operation with a message naming the peer's rank and poisons the
 * communicator: every later operation fails with the first error.
 *
 * Liveness: the progress thread sends each peer a small KEEPALIVE frame
 * when it has sent it nothing for a while (at most 500 ms, a quarter of
 * the progress deadline), in or between operations.  An operation that
 * waits on a peer from which nothing at all came for the progress deadline
 * (opts.progress_timeout_ms, 2 s by default) fails with SG_EPEER naming the
 * peer's rank and address: a hung (SIGSTOP) or cut-off peer is found in
 * seconds, long before the operation's own deadline, while a peer that is
 * merely late or slow keeps it alive.
 *
 * Same-host path: when a peer is another process of this host (an
 * sg_samehost_id exchanged once the mesh is up, then a probe read; see
 * stepguard/samehost.h), large transfers of the collectives (not send/recv)
 * carry only descriptors over TCP and the receiver copies the payload
 * straight out of the sender's memory with process_vm_readv, then says when
 * it is done.  A failed probe or $STEPGUARD_SAME_HOST=0 keeps plain TCP.
 * Results are the same bits either way.
 *
 * Fork: in a child forked after sg_comm_new(), the communicator's sockets
 * are /dev/null (base.h's fork rule); there, submissions fail with
 * SG_ESTATE and sg_comm_abort() / sg_comm_free() do nothing (the copy is
 * left, not freed: its thread did not survive the fork).
 */
#ifndef STEPGUARD_COMM_H
#define STEPGUARD_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types, numbered as the Python binding passes them. */
typedef enum sg_comm_dtype_e {
  SG_COMM_F32 = 0,
  SG_COMM_F64 = 1,
  SG_COMM_F16 = 2,
  SG_COMM_BF16 = 3,
  SG_COMM_I8 = 4,
  SG_COMM_U8 = 5,
  SG_COMM_I32 = 6,
  SG_COMM_I64 = 7,
  SG_COMM_NDTYPES = 8,
} sg_comm_dtype_t;

/* Reduction operators.  AVG divides the sum by the world size at the end
 * (integer types truncate toward zero). */
typedef enum sg_comm_redop_e {
  SG_COMM_SUM = 0,
  SG_COMM_AVG = 1,
  SG_COMM_MIN = 2,
  SG_COMM_MAX = 3,
  SG_COMM_PRODUCT = 4,
  SG_COMM_NREDOPS = 5,
} sg_comm_redop_t;

/* Formats of the quantized collectives. */
typedef enum sg_comm_quant_e {
  SG_COMM_QUANT_INT8 = 1, /* int8, symmetric: step = absmax / 127 */
  SG_COMM_QUANT_FP8 = 2,  /* float8 e4m3fn: step = absmax / 448 */
} sg_comm_quant_t;

/* Limits on what a peer may send in a handshake. */
#define SG_COMM_MAX_JOB 256
#define SG_COMM_MAX_TOKEN 256
#define SG_COMM_MAX_WORLD 4096

typedef struct sg_comm_s sg_comm_t;

typedef struct sg_comm_opts_s {
  int rank;            /* 0 <= rank < world_size */
  int world_size;      /* 1 .. SG_COMM_MAX_WORLD */
  uint64_t generation; /* quorum id: peers of another generation are refused */
  const char *job;     /* job / store prefix; NULL = ""; copied */
  const char *auth_token; /* shared secret; NULL = none; copied */
  const char *bind_host;  /* NULL or "" = all interfaces */
  size_t small_max;       /* allreduce/broadcast bytes up to which the latency
                             algorithm is used; 0 = default (64 KiB; 1 MiB
                             for two ranks) */
  int same_host;   /* same-host path (see below): 0 = wherever a probe shows
                      it works, -1 = never, 1 = also between communicators of
                      one process (tests) */
  size_t pull_min; /* a transfer of at least this many bytes to a same-host
                      peer uses that path; 0 = default (256 KiB) */
  int progress_timeout_ms; /* progress deadline: an operation waiting on a
                              peer that sent nothing (no data, no keepalive)
                              for this long fails naming it; 0 = default
                              (2000), < 0 = off.  Keep it the same on every
                              rank and well below operation deadlines. */
} sg_comm_opts_t;

/*
 * Completion callback: `rc` is 0 or a negative SG_E* code, `msg` a
 * NUL-terminated detail ("" on success) valid during the call.  Runs on the
 * communicator's progress thread; it may submit further operations but must
 * not call sg_comm_free() on its own communicator.
 */
typedef void (*sg_comm_done_cb)(void *ud, int rc, const char *msg);

/*
 * sg_comm_new: a communicator listening on an ephemeral port.  *out is owned
 * by the caller (sg_comm_free).  Does not block.  Returns 0, SG_EINVAL (bad
 * options; detail in err), SG_ENOMEM or a socket error.
 */
SG_EXPORT int sg_comm_new(const sg_comm_opts_t *opts, sg_comm_t **out,
                          sg_err_t *err);

/* sg_comm_port: the port sg_comm_new() bound (closed once connected). */
SG_EXPORT int sg_comm_port(const sg_comm_t *c);

/*
 * sg_comm_same_host: 1 when this communicator reads rank `peer`'s memory
 * directly (the same-host path was offered and its probe worked), 0 when it
 * receives from `peer` over TCP, or before sg_comm_connect() succeeded.
 * Any thread.
 */
SG_EXPORT int sg_comm_same_host(const sg_comm_t *c, int peer);

/* sg_comm_rank / sg_comm_size: from the options. */
SG_EXPORT int sg_comm_rank(const sg_comm_t *c);
SG_EXPORT int sg_comm_size(const sg_comm_t *c);

/*
 * sg_comm_connect: build the mesh.  `addrs` has world_size entries
 * "host:port" (the own entry is ignored; borrowed).  Connects to every lower
 * rank and accepts every higher rank; connections whose handshake is wrong
 * (other generation, job or token, garbage, duplicates) are refused and the
 * wait goes on.  Blocks the calling thread until done, `deadline`, or
 * sg_comm_abort().  Call once.  Returns 0, SG_ETIMEDOUT, SG_EABORTED,
 * SG_EAUTH or SG_EPROTO (a peer refused us; detail names it), SG_ESTATE.
 */
SG_EXPORT int sg_comm_connect(sg_comm_t *c, const char *const *addrs,
                              sg_deadline_t deadline, sg_err_t *err);

/*
 * The operations.  Each returns 0 when queued (the callback will run
 * exactly once) or an error without calling the callback: SG_EINVAL (bad
 * arguments), SG_ESTATE (not connected), SG_ENOMEM, or the communicator's
 * sticky error (SG_EABORTED, SG_EPEER, ...), detail in err.  They never
 * block.  Buffers are borrowed until the callback.
 */

/* allreduce in place over `count` elements of `buf`. */
SG_EXPORT int sg_comm_allreduce(sg_comm_t *c, void *buf, size_t count,
                                sg_comm_dtype_t dtype, sg_comm_redop_t op,
                                sg_deadline_t deadline, sg_comm_done_cb cb,
                                void *ud, sg_err_t *err);

/* broadcast `nbytes` of `buf` from `root` to every rank. */
SG_EXPORT int sg_comm_broadcast(sg_comm_t *c, void *buf, size_t nbytes,
                                int root, sg_deadline_t deadline,
                                sg_comm_done_cb cb, void *ud, sg_err_t *err);

/* allgather: outs[r] (world_size pointers, each `nbytes`) gets rank r's
 * `in`.  `in` may equal outs[rank].  The pointer array is copied. */
SG_EXPORT int sg_comm_allgather(sg_comm_t *c, const void *in, size_t nbytes,
                                void *const *outs, sg_deadline_t deadline,
                                sg_comm_done_cb cb, void *ud, sg_err_t *err);

/* reduce_scatter: out = reduction over ranks of ins[rank_of_this_process]...
 * precisely: rank r's `out` gets op over every rank q of q's ins[r]; each
 * ins[i] holds `count` elements.  `ins` is copied; inputs are not written. */
SG_EXPORT int sg_comm_reduce_scatter(sg_comm_t *c, const void *const *ins,
                                     void *out, size_t count,
                                     sg_comm_dtype_t dtype, sg_comm_redop_t op,
                                     sg_deadline_t deadline, sg_comm_done_cb cb,
                                     void *ud, sg_err_t *err);

/* alltoall: ins[q] (in_bytes[q]) goes to rank q, whose outs[r]
 * (out_bytes[r]) receives it.  Sizes must agree pairwise.  Arrays copied. */
SG_EXPORT int sg_comm_alltoall(sg_comm_t *c, const void *const *ins,
                               const size_t *in_bytes, void *const *outs,
                               const size_t *out_bytes, sg_deadline_t deadline,
                               sg_comm_done_cb cb, void *ud, sg_err_t *err);

/*
 * Quantized collectives over float32, SUM or AVG only.  Each rank
 * quantizes its input in blocks of 512 elements (one float32 scale per
 * block, int8 or float8 e4m3fn codes), sends each owner its part
 * (all-to-all), the owner dequantizes every rank's part (its own taken
 * exactly), reduces them in float32 in rank order, quantizes the result
 * once and, for the allreduce, sends it to every rank (all-gather); every
 * rank, the owner included, ends with the dequantized result, so the bits
 * are identical everywhere and each element is quantized at most twice,
 * whatever the world size.  About a quarter of the full-precision bytes go
 * on the wire.
 *
 * A NaN or infinity in any rank's input (or a reduction that overflows)
 * fails the operation on every rank with SG_EINVAL and a message naming
 * the rank(s); the buffers are then left as they were and the
 * communicator stays usable (the failure is data, not transport).  A
 * transport failure is handled as for every other operation.
 */

/* allreduce_quantized: buf (count float32) in place. */
SG_EXPORT int sg_comm_allreduce_quantized(sg_comm_t *c, float *buf,
                                          size_t count, sg_comm_quant_t fmt,
                                          sg_comm_redop_t op,
                                          sg_deadline_t deadline,
                                          sg_comm_done_cb cb, void *ud,
                                          sg_err_t *err);

/* reduce_scatter_quantized: `in` holds world_size * count float32; part r
 * (elements [r * count, (r + 1) * count)) of every rank is reduced into
 * rank r's `out` (count float32).  `in` is not written. */
SG_EXPORT int
sg_comm_reduce_scatter_quantized(sg_comm_t *c, const float *in, float *out,
                                 size_t count, sg_comm_quant_t fmt,
                                 sg_comm_redop_t op, sg_deadline_t deadline,
                                 sg_comm_done_cb cb, void *ud, sg_err_t *err);

/* The kernels of the quantized collectives, for tests and benchmarks.
 * sg_comm_quant_wire_bytes: the size of the wire block of `count` floats.
 * sg_comm_quant_encode: quantize x into `wire` (that many bytes, 4-byte
 * aligned); 1 when x holds a NaN or an infinity, 0, or SG_EINVAL (format).
 * sg_comm_quant_decode: check the `nbytes` at wire (SG_EPROTO when they
 * are not a block of `count` elements of fmt) and dequantize into out.
 * sg_comm_fp8_from_f32 / _to_f32: float8 e4m3fn conversions, bit for bit
 * torch.float8_e4m3fn's in range (nearest even); +-448 beyond it. */
SG_EXPORT size_t sg_comm_quant_wire_bytes(size_t count);
SG_EXPORT int sg_comm_quant_encode(sg_comm_quant_t fmt, const float *x,
                                   size_t count, void *wire);
SG_EXPORT int sg_comm_quant_decode(sg_comm_quant_t fmt, const void *wire,
                                   size_t nbytes, size_t count, float *out);
SG_EXPORT void sg_comm_fp8_from_f32(const float *in, uint8_t *out, size_t n);
SG_EXPORT void sg_comm_fp8_to_f32(const uint8_t *in, float *out, size_t n);

/* send / recv `nbytes` to / from one peer (matched in order per pair). */
SG_EXPORT int sg_comm_send(sg_comm_t *c, const void *buf, size_t nbytes,
                           int dst, sg_deadline_t deadline, sg_comm_done_cb cb,
                           void *ud, sg_err_t *err);
SG_EXPORT int sg_comm_recv(sg_comm_t *c, void *buf, size_t nbytes, int src,
                           sg_deadline_t deadline, sg_comm_done_cb cb, void *ud,
                           sg_err_t *err);

/* barrier: completes once every rank has submitted it. */
SG_EXPORT int sg_comm_barrier(sg_comm_t *c, sg_deadline_t deadline,
                              sg_comm_done_cb cb, void *ud, sg_err_t *err);

/*
 * sg_comm_abort: from any thread, any number of times.  A sg_comm_connect()
 * in progress returns SG_EABORTED; every queued or running operation
 * completes with SG_EABORTED within 100 ms; later submissions are refused.
 * Does not wait for the callbacks.
 */
SG_EXPORT void sg_comm_abort(sg_comm_t *c);

/*
 * sg_comm_error: the sticky error (0 while healthy); detail in err (may be
 * NULL).  Thread-safe.
 */
SG_EXPORT int sg_comm_error(sg_comm_t *c, sg_err_t *err);

/*
 * sg_comm_free: abort what is still queued (callbacks get SG_ECANCELED),
 * wait for the progress thread, say goodbye to the peers and close.
 * NULL is a no-op.  Must not be called from a completion callback.
 */
SG_EXPORT void sg_comm_free(sg_comm_t *c);

/* sg_comm_dtype_size: bytes per element, 0 when unknown. */
SG_EXPORT size_t sg_comm_dtype_size(sg_comm_dtype_t dtype);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_COMM_H */
