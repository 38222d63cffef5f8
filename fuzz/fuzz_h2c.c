/*
 * fuzz_h2c.c: the client HTTP/2 engine (rpc/h2c.h) fed arbitrary server
 * bytes.
 *
 * An engine is created (its preface and SETTINGS drained) with one unary
 * request submitted; then the input is fed to it as what the server sent,
 * in chunks, with the engine's output drained after each chunk.  Checked:
 * the stream ends at most once, through closed() or not_sent(), and is
 * otherwise still open for sg__h2c_take(); sg__h2c_result() of a closed
 * stream is consistent (success means grpc-status 0 and a message within
 * max_message; failure means a negative code and a detail); a PING ACK is
 * reported at most once per PING; nothing leaks (LeakSanitizer).
 *
 * Input: byte 0 sets the chunk size (byte * 4 + 1); byte 1 is flags:
 *   bit 0  send a PING before feeding
 *   bit 1  reset the stream (CANCEL) after the first chunk
 *   bit 2  max_message 16 instead of 4096
 * and the rest is the server's byte stream.
 *
 * Seeds (fuzz/corpus/h2c/) are that layout around frames assembled by hand
 * from RFC 9113 section 4.1 (9-byte header: 24-bit length, type, flags,
 * 31-bit stream id) with HPACK header blocks made of the static-table entry
 * ":status: 200" (0x88) and "literal without indexing, new name" entries
 * without Huffman coding (RFC 7541 section 6.2.2):
 *   settings      SETTINGS (empty)
 *   ok            SETTINGS, SETTINGS ACK, HEADERS (:status 200,
 *                 content-type), DATA (prefix + "pong"), trailers
 *                 grpc-status 0 (END_STREAM), in 1-byte chunks
 *   status        SETTINGS, trailers-only HEADERS: grpc-status 5 and
 *                 grpc-message "no%20such"
 *   rst           SETTINGS, RST_STREAM(1, INTERNAL_ERROR)
 *   goaway        SETTINGS, GOAWAY(last stream 0, NO_ERROR)
 *   ping-ack      flags bit 0; SETTINGS, PING ACK (8 zero bytes)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * The fuzz build compiles the library without coverage or sanitizer
 * instrumentation, so the code under test is compiled into this target
 * instead (the archive's copies are then never linked in).
 */
#include "../src/rpc/grpc.c"
#include "../src/rpc/h2c.c"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  sg_log_set_level(SG_LOG_ERROR);
  return 0;
}

typedef struct harness_s {
  sg__h2c_t h;
  sg__h2c_stream_t st;
  uint8_t body[SG_GRPC_PREFIX_LEN + 5];
  int ended; /* closed() or not_sent() ran */
  int pings, acks;
} harness_t;

static void check_result(const sg__h2c_result_t *r, size_t max_message) {
  if (strlen(r->msg) >= sizeof(r->msg))
    abort();
  if (r->rc == 0) {
    if (r->grpc_status != SG_GRPC_OK || r->msg[0] != '\0' ||
        r->resp_len > max_message || (r->resp_len == 0) != (r->resp == NULL))
      abort();
  } else {
    if (r->rc > 0 || r->msg[0] == '\0' || r->resp || r->resp_len)
      abort();
  }
}

static void op_closed(void *owner, sg__h2c_stream_t *s, uint32_t error_code) {
  harness_t *t = owner;
  if (s != &t->st || t->ended || s->linked)
    abort();
  t->ended = 1;
  sg__h2c_result_t r;
  sg__h2c_result(s, error_code, t->h.cfg.max_message, &r);
  check_result(&r, t->h.cfg.max_message);
  volatile uint8_t sum = 0; /* read the whole message view (ASan checks) */
  for (size_t i = 0; i < r.resp_len; i++)
    sum ^= r.resp[i];
  (void)sum;
  sg__h2c_stream_fini(s);
}

static void op_not_sent(void *owner, sg__h2c_stream_t *s, const char *why) {
  harness_t *t = owner;
  if (s != &t->st || t->ended || s->linked || !why)
    abort();
  t->ended = 1;
}

static void op_ping_acked(void *owner) {
  harness_t *t = owner;
  if (++t->acks > t->pings)
    abort();
}

static const sg__h2c_ops_t ops = {op_closed, op_not_sent, op_ping_acked};

static int drain(harness_t *t) {
  for (int i = 0; i < 1024; i++) {
    const uint8_t *out;
    ssize_t n = sg__h2c_send(&t->h, &out);
    if (n < 0)
      return -1;
    if (n == 0)
      return 0;
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2)
    return 0;
  size_t chunk = (size_t)data[0] * 4 + 1;
  uint8_t flags = data[1];
  const uint8_t *p = data + 2;
  size_t n = size - 2;
  harness_t *t = calloc(1, sizeof(*t));
  if (!t)
    return 0;
  sg__h2c_config_t cfg = {.authority = "fuzz:1",
                          .max_message = (flags & 4) ? 16 : 4096};
  if (sg__h2c_init(&t->h, &cfg, &ops, t) != 0) {
    free(t);
    return 0;
  }
  sg__h2c_stream_init(&t->st, cfg.max_message);
  sg__grpc_prefix_write(t->body, 5);
  memcpy(t->body + SG_GRPC_PREFIX_LEN, "hello", 5);
  sg__h2c_header_t extra[] = {{"grpc-timeout", "1S"}};
  int submitted = sg__h2c_submit(&t->h, &t->st, "/fuzz.Svc/Call", extra, 1,
                                 t->body, sizeof(t->body)) == 0;
  int ok = submitted;
  if (ok && (flags & 1)) {
    ok = sg__h2c_ping(&t->h) == 0;
    t->pings += ok;
  }
  ok = ok && drain(t) == 0;
  for (size_t off = 0; ok && off < n; off += chunk) {
    size_t k = n - off < chunk ? n - off : chunk;
    ok = sg__h2c_recv(&t->h, p + off, k) == 0;
    if (ok && off == 0 && (flags & 2) && !t->ended)
      ok = sg__h2c_reset(&t->h, &t->st, NGHTTP2_CANCEL) == 0;
    ok = ok && drain(t) == 0;
  }
  (void)sg__h2c_want_io(&t->h);
  sg__h2c_stream_t *left = sg__h2c_take(&t->h);
  if ((submitted && !t->ended) ? left != &t->st : left != NULL)
    abort(); /* the one stream ended or is still open, never both */
  if (sg__h2c_take(&t->h) != NULL || !sg__h2c_idle(&t->h))
    abort();
  sg__h2c_stream_fini(&t->st);
  sg__h2c_free(&t->h);
  free(t);
  return 0;
}
