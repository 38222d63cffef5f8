/*
 * wire.c: the checkpoint protocol's frame codecs, the layout id, address
 * splitting and the chunk plan.  Pure functions over byte spans: no I/O,
 * no allocation, so the fuzzer calls them directly.
 *
 * Every integer is little-endian.  A request is 48 fixed bytes and a token
 * (a MAP request then the fetcher's same-host id); a response is 48 fixed
 * bytes and a payload (see docs/internals/ckpt.md).
 */
#include <string.h>

#include "ckpt/ckpt_int.h"

int sg_ckpt_req_encode(const sg_ckpt_req_t *r, uint8_t *out) {
  if ((r->kind != SG_CKPT_KIND_INFO && r->kind != SG_CKPT_KIND_DATA &&
       r->kind != SG_CKPT_KIND_MAP) ||
      r->step < 0 || r->token_len > SG_CKPT_MAX_TOKEN)
    return SG_EINVAL;
  uint64_t length =
      r->kind == SG_CKPT_KIND_MAP ? SG_SAMEHOST_ID_LEN : r->length;
  memset(out, 0, SG_CKPT_REQ_FIXED);
  sg_put_le32(out, SG_CKPT_REQ_MAGIC);
  sg_put_le16(out + 4, SG_CKPT_VERSION);
  sg_put_le16(out + 6, (uint16_t)r->kind);
  sg_put_le64(out + 8, (uint64_t)r->step);
  sg_put_le64(out + 16, r->layout);
  sg_put_le64(out + 24, r->offset);
  sg_put_le64(out + 32, length);
  sg_put_le16(out + 40, (uint16_t)r->token_len);
  if (r->token_len)
    memcpy(out + SG_CKPT_REQ_FIXED, r->token, r->token_len);
  if (r->kind != SG_CKPT_KIND_MAP)
    return (int)(SG_CKPT_REQ_FIXED + r->token_len);
  memcpy(out + SG_CKPT_REQ_FIXED + r->token_len, r->peer_id,
         SG_SAMEHOST_ID_LEN);
  return (int)(SG_CKPT_REQ_FIXED + r->token_len + SG_SAMEHOST_ID_LEN);
}

int sg_ckpt_req_parse(const uint8_t *p, size_t len, sg_ckpt_req_t *r) {
  /* Reject a wrong magic as soon as four bytes are in, so a client that
   * speaks another protocol (HTTP, TLS) is told at once. */
  if (len >= 4 && sg_get_le32(p) != SG_CKPT_REQ_MAGIC)
    return SG_EPROTO;
  if (len < SG_CKPT_REQ_FIXED)
    return 0;
  memset(r, 0, sizeof(*r));
  if (sg_get_le16(p + 4) != SG_CKPT_VERSION)
    return SG_EPROTO;
  r->kind = sg_get_le16(p + 6);
  int64_t step = (int64_t)sg_get_le64(p + 8);
  r->step = step;
  r->layout = sg_get_le64(p + 16);
  r->offset = sg_get_le64(p + 24);
  r->length = sg_get_le64(p + 32);
  r->token_len = sg_get_le16(p + 40);
  if (sg_get_le16(p + 42) != 0 || sg_get_le32(p + 44) != 0 || step < 0 ||
      r->token_len > SG_CKPT_MAX_TOKEN)
    return SG_EPROTO;
  if (r->kind == SG_CKPT_KIND_INFO) {
    if (r->layout || r->offset || r->length)
      return SG_EPROTO;
  } else if (r->kind == SG_CKPT_KIND_DATA) {
    if (r->offset > SG_CKPT_MAX_TOTAL || r->length > SG_CKPT_MAX_TOTAL ||
        r->offset + r->length > SG_CKPT_MAX_TOTAL)
      return SG_EPROTO;
  } else if (r->kind == SG_CKPT_KIND_MAP) {
    if (r->offset || r->length != SG_SAMEHOST_ID_LEN)
      return SG_EPROTO;
  } else {
    return SG_EPROTO;
  }
  size_t extra = r->kind == SG_CKPT_KIND_MAP ? SG_SAMEHOST_ID_LEN : 0;
  if (len - SG_CKPT_REQ_FIXED < r->token_len + extra)
    return 0;
  memcpy(r->token, p + SG_CKPT_REQ_FIXED, r->token_len);
  if (extra)
    memcpy(r->peer_id, p + SG_CKPT_REQ_FIXED + r->token_len, extra);
  return (int)(SG_CKPT_REQ_FIXED + r->token_len + extra);
}

void sg_ckpt_resp_encode(const sg_ckpt_resp_t *r, uint8_t *out) {
  memset(out, 0, SG_CKPT_RESP_FIXED);
  sg_put_le32(out, SG_CKPT_RESP_MAGIC);
  sg_put_le16(out + 4, SG_CKPT_VERSION);
  sg_put_le16(out + 6, (uint16_t)r->kind);
  sg_put_le32(out + 8, (uint32_t)r->status);
  sg_put_le32(out + 12, r->nregions);
  sg_put_le64(out + 16, (uint64_t)r->step);
  sg_put_le64(out + 24, r->layout);
  sg_put_le64(out + 32, r->payload);
  sg_put_le64(out + 40, r->aux);
}

int sg_ckpt_resp_parse(const uint8_t *p, size_t len, sg_ckpt_resp_t *r) {
  if (len < SG_CKPT_RESP_FIXED)
    return SG_EAGAIN;
  memset(r, 0, sizeof(*r));
  if (sg_get_le32(p) != SG_CKPT_RESP_MAGIC ||
      sg_get_le16(p + 4) != SG_CKPT_VERSION)
    return SG_EPROTO;
  r->kind = sg_get_le16(p + 6);
  r->status = (int32_t)sg_get_le32(p + 8);
  r->nregions = sg_get_le32(p + 12);
  r->step = (int64_t)sg_get_le64(p + 16);
  r->layout = sg_get_le64(p + 24);
  r->payload = sg_get_le64(p + 32);
  r->aux = sg_get_le64(p + 40);
  if (r->kind != SG_CKPT_KIND_INFO && r->kind != SG_CKPT_KIND_DATA &&
      r->kind != SG_CKPT_KIND_MAP)
    return SG_EPROTO;
  if (r->step < -1 || r->status > 0 || r->status < SG__EFATAL - 1000)
    return SG_EPROTO;
  if (r->status) {
    if (r->payload > SG_CKPT_MAX_ERRMSG)
      return SG_EPROTO;
    return 0;
  }
  if (r->kind == SG_CKPT_KIND_INFO) {
    if (r->nregions > SG_CKPT_MAX_REGIONS || r->aux > SG_CKPT_MAX_HEADER ||
        r->payload != (uint64_t)r->nregions * 8 + r->aux)
      return SG_EPROTO;
  } else if (r->kind == SG_CKPT_KIND_MAP) {
    if (r->nregions > SG_CKPT_MAX_REGIONS || r->aux ||
        r->payload !=
            SG_CKPT_MAP_FIXED + (uint64_t)r->nregions * SG_CKPT_DESC_LEN)
      return SG_EPROTO;
  } else {
    if (r->nregions || r->payload > SG_CKPT_MAX_TOTAL ||
        r->aux > SG_CKPT_MAX_TOTAL || r->aux + r->payload > SG_CKPT_MAX_TOTAL)
      return SG_EPROTO;
  }
  return 0;
}

int sg_ckpt_lengths_parse(const uint8_t *p, size_t n, uint64_t *out,
                          uint64_t *total) {
  uint64_t sum = 0;
  if (n > SG_CKPT_MAX_REGIONS)
    return SG_EPROTO;
  for (size_t i = 0; i < n; i++) {
    uint64_t v = sg_get_le64(p + 8 * i);
    if (v > SG_CKPT_MAX_TOTAL - sum)
      return SG_EPROTO;
    sum += v;
    out[i] = v;
  }
  *total = sum;
  return 0;
}

void sg_ckpt_map_encode(const sg_ckpt_map_t *m, uint8_t *out) {
  sg_samehost_encode(&m->id, out);
  sg_put_le64(out + SG_SAMEHOST_ID_LEN, m->beacon_addr);
  memcpy(out + SG_SAMEHOST_ID_LEN + 8, m->beacon, SG_CKPT_BEACON_LEN);
}

int sg_ckpt_map_parse(const uint8_t *p, size_t len, sg_ckpt_map_t *m) {
  if (len < SG_CKPT_MAP_FIXED)
    return SG_EAGAIN;
  memset(m, 0, sizeof(*m));
  sg_samehost_decode(p, &m->id);
  m->beacon_addr = sg_get_le64(p + SG_SAMEHOST_ID_LEN);
  memcpy(m->beacon, p + SG_SAMEHOST_ID_LEN + 8, SG_CKPT_BEACON_LEN);
  if (m->id.flags != 0 || m->id.pid == 0 || m->beacon_addr == 0 ||
      m->beacon_addr > UINT64_MAX / 2)
    return SG_EPROTO;
  return 0;
}

int sg_ckpt_desc_parse(const uint8_t *p, size_t n, const uint64_t *lens,
                       uint64_t *addrs) {
  const uint64_t top = 1ull << 63;
  if (n > SG_CKPT_MAX_REGIONS)
    return SG_EPROTO;
  for (size_t i = 0; i < n; i++) {
    uint64_t a = sg_get_le64(p + SG_CKPT_DESC_LEN * i);
    uint64_t l = sg_get_le64(p + SG_CKPT_DESC_LEN * i + 8);
    if (l != lens[i] || (l && a == 0) || a > top || l > top - a)
      return SG_EPROTO;
    addrs[i] = a;
  }
  return 0;
}

uint64_t sg_ckpt_layout_id(const uint64_t *lens, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a offset basis */
  uint8_t b[8];
  sg_put_le64(b, (uint64_t)n);
  for (int k = 0; k < 8; k++)
    h = (h ^ b[k]) * 0x100000001b3ull;
  for (size_t i = 0; i < n; i++) {
    sg_put_le64(b, lens[i]);
    for (int k = 0; k < 8; k++)
      h = (h ^ b[k]) * 0x100000001b3ull;
  }
  return h;
}

uint64_t sg_ckpt_plan_chunk(uint64_t total, size_t nstreams,
                            uint64_t min_chunk) {
  const uint64_t max_chunk = 64ull << 20;
  if (nstreams == 0)
    nstreams = 1;
  if (min_chunk == 0)
    min_chunk = 1;
  uint64_t c = total / ((uint64_t)nstreams * 4);
  if (c < min_chunk)
    c = min_chunk;
  if (c > max_chunk)
    c = max_chunk;
  return c ? c : 1;
}

size_t sg__ckpt_find(const uint64_t *prefix, size_t n, uint64_t off) {
  /* the last i with prefix[i] <= off, then past empty regions */
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo + 1) / 2;
    if (prefix[mid] <= off)
      lo = mid;
    else
      hi = mid - 1;
  }
  while (lo < n && prefix[lo + 1] == prefix[lo])
    lo++;
  return lo;
}
