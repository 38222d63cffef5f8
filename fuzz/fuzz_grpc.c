/*
 * fuzz_grpc.c: the gRPC layer's parsers.
 *
 * Byte 0 picks a target; the rest is its input.
 *   0  rpc/grpc.h helpers: message prefix, grpc-timeout parse (and format
 *      round trip), grpc-message encode/decode round trip, UTF-8 check
 *   1  sg__rpc_sniff() on every prefix of the input (must be consistent)
 *   2  the server engine (rpc/h2s.h): the HTTP/2 preface and then the input
 *      as client bytes, fed in chunks whose sizes come from byte 1, output
 *      drained after each.  The handler answers odd calls at once (echo),
 *      holds even ones, expires one and lets shutdown cancel the rest;
 *      every dispatched call must complete exactly once.
 *   3  sg__pb_check_strings() with the lighthouse's Quorum request spec;
 *      what it accepts must unpack with protobuf-c, with every string of
 *      the requester free of NULs (the bug class the check exists for)
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
#include "../src/rpc/h2s.c"

#include "torchft.pb-c.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  sg_log_set_level(SG_LOG_ERROR); /* protocol violations log at warn */
  return 0;
}

static void fuzz_helpers(const uint8_t *p, size_t n) {
  uint32_t len;
  int comp;
  int rc = sg__grpc_prefix_parse(p, n, 1024, &len, &comp);
  if (rc == 0 && (len > 1024 || comp > 1))
    abort();
  int64_t ns;
  if (sg__grpc_timeout_parse((const char *)p, n, &ns) == 0) {
    if (ns < 0)
      abort();
    if (ns > 0) {
      char out[16];
      size_t k = sg__grpc_timeout_format(ns, out);
      int64_t back;
      if (k < 2 || k > 9 || sg__grpc_timeout_parse(out, k, &back) != 0 ||
          back < ns)
        abort();
    }
  }
  char msg[256], enc[1024], dec[256];
  size_t m = n < sizeof(msg) - 1 ? n : sizeof(msg) - 1;
  memcpy(msg, p, m);
  msg[m] = '\0';
  size_t e = sg__grpc_message_encode(msg, enc, sizeof(enc));
  if (e != strlen(enc))
    abort();
  sg__grpc_message_decode(enc, e, dec, sizeof(dec));
  if (strcmp(dec, msg) != 0) /* 3 * 255 < 1024: never truncated */
    abort();
  sg__grpc_message_encode(msg, enc, 1 + (n % 16)); /* truncation */
  (void)sg__utf8_valid((const char *)p, n);
}

static void fuzz_sniff(const uint8_t *p, size_t n) {
  sg__sniff_t prev = SG__SNIFF_MORE;
  for (size_t i = 0; i <= n && i <= 64; i++) {
    sg__sniff_t r = sg__rpc_sniff(p, i);
    if (prev != SG__SNIFF_MORE && r != prev)
      abort(); /* a decision never changes with more bytes */
    if (r == SG__SNIFF_H2 &&
        (i < SG__H2_PREFACE_LEN || memcmp(p, SG__H2_PREFACE, 24) != 0))
      abort();
    prev = r;
  }
}

/* ---- engine harness ------------------------------------------------------ */

typedef struct harness_s {
  sg__h2s_t h2;
  sg_rpc_call_t *held[256];
  int nheld;
  long dispatched, responded, cancelled, tracked;
} harness_t;

static void drop_held(harness_t *t, sg_rpc_call_t *c) {
  for (int i = 0; i < t->nheld; i++) {
    if (t->held[i] == c) {
      t->held[i] = t->held[--t->nheld];
      return;
    }
  }
}

static void op_dispatch(void *owner, sg_rpc_call_t *c) {
  harness_t *t = owner;
  t->dispatched++;
  if ((t->dispatched & 1) || t->nheld == 256) {
    size_t len;
    const uint8_t *b = sg_rpc_call_body(c, &len);
    t->responded++;
    if (t->dispatched % 3 == 0)
      sg_rpc_call_respond(c, SG_GRPC_NOT_FOUND, "no \xff such", NULL, 0);
    else
      sg_rpc_call_respond(c, SG_GRPC_OK, NULL, b, len);
  } else {
    t->held[t->nheld++] = c;
  }
}

static void op_cancel(void *owner, sg_rpc_call_t *c) {
  harness_t *t = owner;
  t->cancelled++;
  drop_held(t, c);
}

static int op_deadline_set(void *owner, sg_rpc_call_t *c) {
  harness_t *t = owner;
  if (c->heap_idx == SIZE_MAX) {
    c->heap_idx = 0;
    t->tracked++;
  }
  return 0;
}

static void op_deadline_clear(void *owner, sg_rpc_call_t *c) {
  harness_t *t = owner;
  if (c->heap_idx != SIZE_MAX) {
    c->heap_idx = SIZE_MAX;
    t->tracked--;
  }
}

static void op_wake(void *owner) { (void)owner; }

static const sg__h2s_ops_t ops = {op_dispatch, op_cancel, op_deadline_set,
                                  op_deadline_clear, op_wake};

static int drain(harness_t *t) {
  for (int i = 0; i < 1024; i++) {
    const uint8_t *out;
    ssize_t n = sg__h2s_send(&t->h2, &out);
    if (n < 0)
      return -1;
    if (n == 0)
      return 0;
  }
  return 0;
}

static void fuzz_engine(const uint8_t *p, size_t n) {
  harness_t *t = calloc(1, sizeof(*t));
  sg__h2s_config_t cfg = {.max_message = 4096,
                          .max_streams = 16,
                          .default_deadline_ms = 1000,
                          .conn_id = 1};
  if (!t || sg__h2s_init(&t->h2, &cfg, &ops, t) != 0) {
    free(t);
    return;
  }
  size_t chunk = n ? (size_t)p[0] * 4 + 1 : 1;
  if (n) {
    p++;
    n--;
  }
  int ok = sg__h2s_recv(&t->h2, (const uint8_t *)SG__H2_PREFACE, 24) == 0 &&
           drain(t) == 0;
  for (size_t off = 0; ok && off < n; off += chunk) {
    size_t k = n - off < chunk ? n - off : chunk;
    ok = sg__h2s_recv(&t->h2, p + off, k) == 0 && drain(t) == 0;
  }
  if (ok && t->nheld) {
    sg_rpc_call_t *c = t->held[0];
    drop_held(t, c);
    sg__h2s_expire(&t->h2, c); /* cancels it */
    drain(t);
  }
  if (!ok)
    sg__h2s_terminate(&t->h2, NGHTTP2_PROTOCOL_ERROR);
  sg__h2s_shutdown(&t->h2);
  if (t->nheld != 0 || t->dispatched != t->responded + t->cancelled)
    abort(); /* every call completed exactly once */
  sg__h2s_free(&t->h2);
  if (t->tracked != 0)
    abort(); /* every deadline was released */
  free(t);
}

static const uint32_t member_strings[] = {1, 2, 3, 7};
static const sg__pb_spec_t member_spec = {member_strings, 4, NULL, 0};
static const sg__pb_nested_t quorum_nested[] = {{1, &member_spec}};
static const sg__pb_spec_t quorum_spec = {NULL, 0, quorum_nested, 1};

static void fuzz_pb(const uint8_t *p, size_t n) {
  uint32_t field;
  if (sg__pb_check_strings(p, n, &quorum_spec, &field) != 0)
    return;
  Torchft__LighthouseQuorumRequest *r =
      torchft__lighthouse_quorum_request__unpack(NULL, n, p);
  if (!r)
    return; /* wire-valid but not this message (e.g. wrong wire types) */
  const Torchft__QuorumMember *m = r->requester;
  if (m) {
    const char *strs[] = {m->replica_id, m->address, m->store_address, m->data};
    for (int i = 0; i < 4; i++)
      if (!sg__utf8_valid(strs[i], strlen(strs[i])))
        abort();
  }
  torchft__lighthouse_quorum_request__free_unpacked(r, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  switch (data[0] % 4) {
  case 0:
    fuzz_helpers(data + 1, size - 1);
    break;
  case 1:
    fuzz_sniff(data + 1, size - 1);
    break;
  case 3:
    fuzz_pb(data + 1, size - 1);
    break;
  default:
    fuzz_engine(data + 1, size - 1);
    break;
  }
  return 0;
}
