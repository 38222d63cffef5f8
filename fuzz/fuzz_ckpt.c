/*
 * fuzz_ckpt.c: the checkpoint protocol's parsers on arbitrary bytes.
 *
 * The input is tried as a request, as a response's fixed part, as a region
 * length table and as an address.  Oracles: a parsed request re-encodes to
 * the bytes it came from and parses again to the same fields; every prefix
 * of a request that parses asks for more (0) or fails at the magic; a
 * response that parses keeps its documented invariants; a length table that
 * parses sums to what it reports.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stepguard/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_request(const uint8_t *data, size_t size) {
  sg_ckpt_req_t r, r2;
  int used = sg_ckpt_req_parse(data, size, &r);
  if (used < 0 || used == 0)
    return;
  if ((size_t)used > size || r.token_len > SG_CKPT_MAX_TOKEN)
    abort();
  uint8_t out[SG_CKPT_REQ_FIXED + SG_CKPT_MAX_TOKEN];
  int n = sg_ckpt_req_encode(&r, out);
  if (n != used || memcmp(out, data, (size_t)n) != 0)
    abort();
  if (sg_ckpt_req_parse(out, (size_t)n, &r2) != n || r2.kind != r.kind ||
      r2.step != r.step || r2.layout != r.layout || r2.offset != r.offset ||
      r2.length != r.length || r2.token_len != r.token_len ||
      memcmp(r2.token, r.token, r.token_len) != 0)
    abort();
  for (size_t k = 0; k < (size_t)used; k++) {
    int p = sg_ckpt_req_parse(data, k, &r2);
    if (p > 0)
      abort(); /* a strict prefix never parses */
  }
}

static void check_response(const uint8_t *data, size_t size) {
  sg_ckpt_resp_t r;
  int rc = sg_ckpt_resp_parse(data, size, &r);
  if (size < SG_CKPT_RESP_FIXED) {
    if (rc != SG_EAGAIN)
      abort();
    return;
  }
  if (rc)
    return;
  if (r.status > 0)
    abort();
  if (r.status && r.payload > SG_CKPT_MAX_ERRMSG)
    abort();
  if (!r.status && r.kind == SG_CKPT_KIND_INFO &&
      (r.nregions > SG_CKPT_MAX_REGIONS || r.aux > SG_CKPT_MAX_HEADER ||
       r.payload != (uint64_t)r.nregions * 8 + r.aux))
    abort();
  if (!r.status && r.kind == SG_CKPT_KIND_DATA &&
      (r.payload > SG_CKPT_MAX_TOTAL || r.aux + r.payload > SG_CKPT_MAX_TOTAL))
    abort();
}

static void check_lengths(const uint8_t *data, size_t size) {
  size_t n = size / 8;
  if (n > 4096)
    n = 4096;
  uint64_t *v = malloc((n ? n : 1) * sizeof(*v)), total = 0;
  if (!v)
    return;
  if (sg_ckpt_lengths_parse(data, n, v, &total) == 0) {
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++)
      sum += v[i];
    if (sum != total || total > SG_CKPT_MAX_TOTAL)
      abort();
    (void)sg_ckpt_layout_id(v, n);
  }
  free(v);
}

static void check_addr(const uint8_t *data, size_t size) {
  char s[SG_CKPT_MAX_ADDR + 2], host[SG_CKPT_MAX_ADDR + 1];
  size_t n = size < sizeof(s) - 1 ? size : sizeof(s) - 1;
  memcpy(s, data, n);
  s[n] = '\0';
  int port = -1;
  if (sg_ckpt_parse_addr(s, host, sizeof(host), &port) == 0 &&
      (port < 0 || port > 65535 || strlen(host) == 0 ||
       strlen(host) >= sizeof(host)))
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_request(data, size);
  check_response(data, size);
  check_lengths(data, size);
  check_addr(data, size);
  return 0;
}
