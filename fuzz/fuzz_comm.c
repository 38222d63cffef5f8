/*
 * fuzz_comm.c: the collectives' wire parsers (HELLO, REPLY, the same-host
 * OFFER, OP / DESC / ACK / PULL / BYE / SEG / KEEPALIVE frames, the handshake
 * admission check, peer addresses) on arbitrary bytes.
 *
 * Input: byte 0 picks the parser, the rest is what a peer sent.  Checks:
 * no crash or overread (ASan), every prefix of an input that parses asks
 * for more bytes or fails (never succeeds early), a parsed HELLO or frame
 * re-encodes to the same bytes, and a parsed HELLO's strings lie inside
 * the input; a parsed OFFER re-encodes to the same bytes; a parsed DESC
 * never wraps the address space.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void hello(const uint8_t *p, size_t n) {
  sg__comm_hello_t h;
  int rc = sg__comm_hello_parse(p, n, &h);
  if (rc < 0 || rc == 0)
    return;
  if ((size_t)rc > n || h.job < p || h.token + h.token_len > p + rc)
    abort();
  for (size_t i = 0; i < (size_t)rc; i++) /* shorter prefixes never parse */
    if (sg__comm_hello_parse(p, i, &h) > 0)
      abort();
  sg__comm_hello_parse(p, n, &h);
  char job[SG_COMM_MAX_JOB + 1], tok[SG_COMM_MAX_TOKEN + 1];
  memcpy(job, h.job, h.job_len);
  job[h.job_len] = '\0';
  memcpy(tok, h.token, h.token_len);
  tok[h.token_len] = '\0';
  sg_err_t err;
  sg__comm_hello_check(&h, h.generation, 0, (int)(h.world & 0xffff), job, tok,
                       &err);
  sg__comm_hello_check(&h, 1, 1, 2, "job", "token", &err);
  if (strlen(job) == h.job_len && strlen(tok) == h.token_len) {
    uint8_t again[SG__COMM_HELLO_MAX];
    int m =
        sg__comm_hello_encode(again, h.generation, h.rank, h.world, job, tok);
    if (m != rc || memcmp(again, p, (size_t)m) != 0)
      abort();
  }
}

static void reply(const uint8_t *p, size_t n) {
  sg__comm_reply_t r;
  int rc = sg__comm_reply_parse(p, n, &r);
  if (rc > 0) {
    uint8_t again[SG__COMM_REPLY_LEN];
    sg__comm_reply_encode(again, r.generation, r.rank, r.status);
    if (rc != SG__COMM_REPLY_LEN || memcmp(again, p, SG__COMM_REPLY_LEN))
      abort();
  }
}

static void frame(const uint8_t *p, size_t n) {
  sg__comm_frame_t f;
  if (sg__comm_frame_parse(p, n, &f) == 0) {
    uint8_t again[SG__COMM_FRAME_LEN];
    sg__comm_frame_encode(again, &f);
    if (memcmp(again, p, SG__COMM_FRAME_LEN) != 0)
      abort();
    if (f.type == SG__COMM_FRAME_DESC &&
        (f.bytes == 0 || f.seq + f.bytes < f.seq))
      abort();
  }
}

static void offer(const uint8_t *p, size_t n) {
  sg__comm_offer_t o;
  if (sg__comm_offer_parse(p, n, &o) == 0) {
    uint8_t again[SG__COMM_OFFER_LEN];
    if (n != SG__COMM_OFFER_LEN || (o.flags & ~1u))
      abort();
    sg__comm_offer_encode(again, &o);
    if (memcmp(again, p, SG__COMM_OFFER_LEN) != 0)
      abort();
  }
}

static void addr(const uint8_t *p, size_t n) {
  char s[512], host[256];
  int port;
  if (n >= sizeof(s))
    n = sizeof(s) - 1;
  memcpy(s, p, n);
  s[n] = '\0';
  if (sg_addr_split(s, host, sizeof(host), &port, NULL) == 0 &&
      (port < 0 || port > 65535 || strlen(host) == 0))
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  const uint8_t *p = data + 1;
  size_t n = size - 1;
  switch (data[0] % 5) {
  case 0:
    hello(p, n);
    break;
  case 1:
    reply(p, n);
    break;
  case 2:
    frame(p, n);
    break;
  case 3:
    addr(p, n);
    break;
  default:
    offer(p, n);
    break;
  }
  return 0;
}
