/*
 * fuzz_ckpt.c: the checkpoint protocol's parsers on arbitrary bytes.
 *
 * The input is tried as a request, as a response's fixed part, as a region
 * length table and as an address.  Oracles: a parsed request re-encodes to
 * the bytes it came from and parses again to the same fields; every prefix
 * of a request that parses asks for more (0) or fails at the magic; a
 * response that parses keeps its documented invariants; a length table that
 * parses sums to what it reports; a same-host grant that parses re-encodes
 * to its bytes, and its descriptors parse only when each names the announced
 * length and stays below 2^63.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/ckpt_int.h"
#include "stepguard/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_request(const uint8_t *data, size_t size) {
  sg_ckpt_req_t r, r2;
  int used = sg_ckpt_req_parse(data, size, &r);
  if (used < 0 || used == 0)
    return;
  if ((size_t)used > size || r.token_len > SG_CKPT_MAX_TOKEN)
    abort();
  uint8_t out[SG_CKPT_REQ_MAX];
  int n = sg_ckpt_req_encode(&r, out);
  if (n != used || memcmp(out, data, (size_t)n) != 0)
    abort();
  if (sg_ckpt_req_parse(out, (size_t)n, &r2) != n || r2.kind != r.kind ||
      r2.step != r.step || r2.layout != r.layout || r2.offset != r.offset ||
      r2.length != r.length || r2.token_len != r.token_len ||
      memcmp(r2.token, r.token, r.token_len) != 0 ||
      memcmp(r2.peer_id, r.peer_id, sizeof(r.peer_id)) != 0)
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
  if (!r.status && r.kind == SG_CKPT_KIND_MAP &&
      (r.nregions > SG_CKPT_MAX_REGIONS ||
       r.payload !=
           SG_CKPT_MAP_FIXED + (uint64_t)r.nregions * SG_CKPT_DESC_LEN))
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

static uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

static void check_map(const uint8_t *data, size_t size) {
  sg_ckpt_map_t m;
  int rc = sg_ckpt_map_parse(data, size, &m);
  if (size < SG_CKPT_MAP_FIXED) {
    if (rc != SG_EAGAIN)
      abort();
    return;
  }
  if (rc == 0) {
    uint8_t out[SG_CKPT_MAP_FIXED];
    sg_ckpt_map_encode(&m, out);
    if (memcmp(out, data, SG_CKPT_MAP_FIXED) != 0 || m.beacon_addr == 0)
      abort();
  }
  /* descriptors: announced lengths are the descriptors' own, but for the
   * last one when the first byte is odd */
  const uint8_t *d = data + SG_CKPT_MAP_FIXED;
  size_t n = (size - SG_CKPT_MAP_FIXED) / SG_CKPT_DESC_LEN;
  if (n > 1024)
    n = 1024;
  uint64_t lens[1024], addrs[1024];
  for (size_t i = 0; i < n; i++)
    lens[i] = le64(d + SG_CKPT_DESC_LEN * i + 8);
  if (n && (data[0] & 1))
    lens[n - 1] ^= 1;
  if (sg_ckpt_desc_parse(d, n, lens, addrs) != 0)
    return;
  if (n && (data[0] & 1))
    abort(); /* a length other than the announced one passed */
  for (size_t i = 0; i < n; i++)
    if (addrs[i] > (1ull << 63) || lens[i] > (1ull << 63) - addrs[i] ||
        (lens[i] && addrs[i] == 0))
      abort();
}

static void check_addr(const uint8_t *data, size_t size) {
  char s[SG_CKPT_MAX_ADDR + 2], host[SG_CKPT_MAX_ADDR + 1];
  size_t n = size < sizeof(s) - 1 ? size : sizeof(s) - 1;
  memcpy(s, data, n);
  s[n] = '\0';
  int port = -1;
  if (sg_addr_split(s, host, sizeof(host), &port, NULL) == 0 &&
      (port < 0 || port > 65535 || strlen(host) == 0 ||
       strlen(host) >= sizeof(host)))
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_request(data, size);
  check_response(data, size);
  check_lengths(data, size);
  check_map(data, size);
  check_addr(data, size);
  return 0;
}
