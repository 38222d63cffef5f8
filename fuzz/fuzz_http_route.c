/*
 * fuzz_http_route.c: drives the lighthouse HTTP router and the /status JSON
 * string escaping with arbitrary bytes.
 *
 * Input: "METHOD\nURL" routes URL with METHOD (no '\n': the whole input is
 * the URL, method POST).  Invariants: the result is one of the routes with
 * its matching status; a KILL id is 1..SG__LH_REPLICA_ID_MAX bytes of valid
 * UTF-8 without control characters, agrees with replica_id_len, and equals
 * the naive percent-decoding of the segment.  The same bytes are also used
 * as the strings of a snapshot: the rendered JSON must contain no raw
 * control byte before its final newline and be valid UTF-8.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lighthouse/http.h"
#include "lighthouse/status.h"
#include "stepguard/base.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* utf8_ok: the naive oracle, shortest forms and no surrogates. */
static int utf8_ok(const uint8_t *p, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint32_t c = p[i], cp;
    size_t len;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return 0;
    }
    if (i + len > n)
      return 0;
    for (size_t k = 1; k < len; k++) {
      if ((p[i + k] & 0xC0) != 0x80)
        return 0;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return 0;
    i += len;
  }
  return 1;
}

static void check_route(const char *method, const char *url) {
  static sg__lh_route_match_t m;
  sg__lh_route_t r = sg__lh_http_route(method, url, &m);
  if (r != m.route)
    abort();
  switch (r) {
  case SG__LH_ROUTE_INDEX:
  case SG__LH_ROUTE_STATUS:
  case SG__LH_ROUTE_METRICS:
  case SG__LH_ROUTE_KILL:
    if (m.status != 200)
      abort();
    break;
  case SG__LH_ROUTE_NOT_FOUND:
    if (m.status != 404)
      abort();
    break;
  case SG__LH_ROUTE_BAD_METHOD:
    if (m.status != 405 || !m.allow)
      abort();
    break;
  case SG__LH_ROUTE_BAD_REQUEST:
    if (m.status != 400 || !m.why)
      abort();
    break;
  default:
    abort();
  }
  if (r != SG__LH_ROUTE_KILL)
    return;
  size_t n = m.replica_id_len;
  if (n == 0 || n > SG__LH_REPLICA_ID_MAX || strlen(m.replica_id) != n ||
      !utf8_ok((const uint8_t *)m.replica_id, n))
    abort();
  for (size_t i = 0; i < n; i++)
    if ((uint8_t)m.replica_id[i] < 0x20 || m.replica_id[i] == 0x7F)
      abort();
  /* oracle: decode the segment between "/replica/" and "/kill" naively */
  const char *seg = url + 9;
  size_t seglen = strcspn(url, "?#") - 9 - 5;
  static char dec[4 * SG__LH_REPLICA_ID_MAX + 8];
  size_t d = 0;
  for (size_t i = 0; i < seglen && d < sizeof(dec) - 1; i++) {
    if (seg[i] == '%') {
      char hex[3] = {seg[i + 1], seg[i + 2], 0};
      dec[d++] = (char)strtol(hex, NULL, 16);
      i += 2;
    } else {
      dec[d++] = seg[i];
    }
  }
  if (d != n || memcmp(dec, m.replica_id, n) != 0)
    abort();
}

static void check_json(const char *str) {
  sg__lh_status_t s;
  memset(&s, 0, sizeof(s));
  sg__lh_status_member_t mem;
  memset(&mem, 0, sizeof(mem));
  sg__lh_status_hb_t hb;
  memset(&hb, 0, sizeof(hb));
  mem.replica_id = mem.address = mem.store_address = (char *)str;
  hb.replica_id = (char *)str;
  s.reason = (char *)str;
  s.has_prev = 1;
  s.n_members = 1;
  s.members = &mem;
  s.n_heartbeats = 1;
  s.heartbeats = &hb;
  sg_buf_t b;
  sg_buf_init(&b, 1 << 22);
  if (sg__lh_render_status_json(&s, &b) != 0)
    abort();
  const uint8_t *p = sg_buf_head(&b);
  if (b.len < 2 || p[b.len - 1] != '\n' || !utf8_ok(p, b.len))
    abort();
  for (size_t i = 0; i + 1 < b.len; i++)
    if (p[i] < 0x20)
      abort();
  sg_buf_free(&b); /* the snapshot's strings are ours: not status_free */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 8192)
    return 0;
  char *buf = malloc(size + 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  buf[size] = '\0';
  char *nl = memchr(buf, '\n', size);
  if (nl) {
    *nl = '\0';
    check_route(buf, nl + 1);
  } else {
    check_route("POST", buf);
  }
  check_json(nl ? nl + 1 : buf);
  free(buf);
  return 0;
}
