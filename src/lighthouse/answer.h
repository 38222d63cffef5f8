/*
 * answer.h: the lighthouse's Quorum answer on the wire.
 *
 *   member   sg__lh_member_wire(): a requester's QuorumMember encoding,
 *            made once when its request arrives (unknown fields included,
 *            so a newer client's fields reach every peer)
 *   answer   sg__lh_answer_encode(): the LighthouseQuorumResponse of a
 *            quorum, encoded once and shared by every call it answers,
 *            from the members' encodings: the decision copies bytes
 *            instead of re-encoding N members
 *
 * The bytes are the ones protobuf-c would produce for the same message
 * (fields in number order, proto3 defaults left out); tests/c/
 * test_lighthouse.c compares the two.  Pure functions; any thread.
 */
#ifndef SG_LIGHTHOUSE_ANSWER_H
#define SG_LIGHTHOUSE_ANSWER_H

#include <stddef.h>
#include <stdint.h>

#include "lighthouse/quorum.h"
#include "stepguard/rpc.h"
#include "torchft.pb-c.h"

/*
 * sg__lh_member_wire: encode `m` (a parsed QuorumMember, its unknown fields
 * kept by protobuf-c) into a new buffer *out of *len bytes, which the
 * caller owns (sg_free).  Returns 0 or SG_ENOMEM.
 */
int sg__lh_member_wire(const Torchft__QuorumMember *m, uint8_t **out,
                       size_t *len);

/*
 * sg__lh_member_span: the requester's QuorumMember bytes inside the
 * LighthouseQuorumRequest `body` when they can stand for its encoding:
 * the body is that one field and nothing else (as every client sends it),
 * so the bytes are the member exactly as parsed, unknown fields included.
 * Returns 1 and sets *p, *n (pointing into `body`), else 0 (the caller
 * encodes the parsed member instead).  Pure; any thread.
 */
int sg__lh_member_span(const uint8_t *body, size_t len, const uint8_t **p,
                       size_t *n);

/*
 * sg__lh_answer_encode: the LighthouseQuorumResponse for `q`, as a blob
 * with one reference for the caller.  A member with wire bytes is copied
 * from them; one without is encoded from its fields.  Returns NULL on
 * SG_ENOMEM or when the answer would exceed 4 GiB - 1.
 */
sg_rpc_blob_t *sg__lh_answer_encode(const sg__lh_quorum_t *q);

#endif /* SG_LIGHTHOUSE_ANSWER_H */
