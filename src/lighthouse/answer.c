/*
 * answer.c: the Quorum answer on the wire (see answer.h).
 *
 *   varints      size and write
 *   members      sg__lh_member_wire(), sg__lh_member_span(), and a
 *                fallback from the fields
 *   answer       sg__lh_answer_encode(): sizes first, then one pass of
 *                writes into the blob that will be sent
 *
 * LighthouseQuorumResponse { Quorum quorum = 1; }
 * Quorum { int64 quorum_id = 1; repeated QuorumMember participants = 2;
 *          google.protobuf.Timestamp created = 3; }
 * Timestamp { int64 seconds = 1; int32 nanos = 2; }
 */
#include "lighthouse/answer.h"

#include <string.h>

#define TAG_LEN(field) ((uint8_t)((field) << 3 | 2))    /* length-delimited */
#define TAG_VARINT(field) ((uint8_t)((field) << 3 | 0)) /* varint */
#define ANSWER_MAX ((size_t)UINT32_MAX)                 /* a gRPC message */

/* ---- varints ------------------------------------------------------------- */

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

static uint8_t *varint_put(uint8_t *p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  *p++ = (uint8_t)v;
  return p;
}

/* field_size: a length-delimited field of `len` payload bytes. */
static size_t field_size(size_t len) { return 1 + varint_size(len) + len; }

/* ---- members ------------------------------------------------------------- */

int sg__lh_member_wire(const Torchft__QuorumMember *m, uint8_t **out,
                       size_t *len) {
  size_t n = torchft__quorum_member__get_packed_size(m);
  uint8_t *b = sg_malloc(n ? n : 1);
  if (!b)
    return SG_ENOMEM;
  *len = torchft__quorum_member__pack(m, b);
  *out = b;
  return 0;
}

int sg__lh_member_span(const uint8_t *body, size_t len, const uint8_t **p,
                       size_t *n) {
  if (len < 2 || body[0] != TAG_LEN(1))
    return 0;
  uint64_t v = 0;
  size_t i = 1;
  for (int shift = 0; i < len && shift < 64; shift += 7) {
    uint8_t b = body[i++];
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      if (v != len - i) /* another field follows, or the record is cut */
        return 0;
      *p = body + i;
      *n = (size_t)v;
      return 1;
    }
  }
  return 0;
}

/* member_fields: a protobuf-c view of `m` (strings borrowed). */
static void member_fields(const sg__lh_member_t *m, Torchft__QuorumMember *pm) {
  torchft__quorum_member__init(pm);
  pm->replica_id = m->replica_id ? m->replica_id : "";
  pm->address = m->address ? m->address : "";
  pm->store_address = m->store_address ? m->store_address : "";
  pm->data = m->data ? m->data : "";
  pm->step = m->step;
  pm->world_size = m->world_size;
  pm->shrink_only = m->shrink_only != 0;
  pm->commit_failures = m->commit_failures;
  pm->n_reconfigure_handles = m->n_reconfigure_handles;
  pm->reconfigure_handles = m->reconfigure_handles;
}

/* member_size: the encoded size of member `m`. */
static size_t member_size(const sg__lh_member_t *m) {
  if (m->wire)
    return m->wire_len;
  Torchft__QuorumMember pm;
  member_fields(m, &pm);
  return torchft__quorum_member__get_packed_size(&pm);
}

/* member_put: write member `m` (member_size bytes) at p. */
static uint8_t *member_put(uint8_t *p, const sg__lh_member_t *m) {
  if (m->wire) {
    memcpy(p, m->wire, m->wire_len);
    return p + m->wire_len;
  }
  Torchft__QuorumMember pm;
  member_fields(m, &pm);
  return p + torchft__quorum_member__pack(&pm, p);
}

/* ---- answer -------------------------------------------------------------- */

sg_rpc_blob_t *sg__lh_answer_encode(const sg__lh_quorum_t *q) {
  int64_t secs = q->created_wall_ns / 1000000000;
  int32_t nanos = (int32_t)(q->created_wall_ns % 1000000000);
  size_t ts = (secs ? 1 + varint_size((uint64_t)secs) : 0) +
              (nanos ? 1 + varint_size((uint64_t)(int64_t)nanos) : 0);
  size_t body = q->quorum_id ? 1 + varint_size((uint64_t)q->quorum_id) : 0;
  for (size_t i = 0; i < q->n; i++) {
    size_t ml = member_size(&q->members[i]);
    if (ml > ANSWER_MAX || body > ANSWER_MAX)
      return NULL;
    body += field_size(ml);
  }
  body += field_size(ts);
  if (body > ANSWER_MAX - 16)
    return NULL;
  size_t total = field_size(body);
  uint8_t *p = NULL;
  sg_rpc_blob_t *blob = sg_rpc_blob_alloc(total, &p);
  if (!blob)
    return NULL;
  *p++ = TAG_LEN(1);
  p = varint_put(p, body);
  if (q->quorum_id) {
    *p++ = TAG_VARINT(1);
    p = varint_put(p, (uint64_t)q->quorum_id);
  }
  for (size_t i = 0; i < q->n; i++) {
    const sg__lh_member_t *m = &q->members[i];
    *p++ = TAG_LEN(2);
    p = varint_put(p, member_size(m));
    p = member_put(p, m);
  }
  *p++ = TAG_LEN(3);
  p = varint_put(p, ts);
  if (secs) {
    *p++ = TAG_VARINT(1);
    p = varint_put(p, (uint64_t)secs);
  }
  if (nanos) {
    *p++ = TAG_VARINT(2);
    p = varint_put(p, (uint64_t)(int64_t)nanos);
  }
  return blob;
}
