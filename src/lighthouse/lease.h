/*
 * lease.h: the pure parts of a lighthouse's leadership in etcd.
 *
 *   lease      sg__lh_lease_deadline: until when a leader may answer
 *   fencing    sg__lh_fence_may_decide, sg__lh_fence_may_answer: what the
 *              loop may do now, from the role, the lease and the last id
 *              etcd confirmed
 *   record     sg__lh_record_encode / _decode: the last quorum as stored in
 *              etcd (its id, then one member id a line: the id file format)
 *   etcd JSON  sg__lh_json_int, sg__lh_json_str, sg__lh_json_bool: the few
 *              fields the lighthouse reads from etcd's v3 JSON gateway;
 *              sg__lh_b64_encode / _decode for its keys and values
 *
 * Nothing here does I/O, reads a clock or keeps state: the caller passes
 * the monotonic time.  Every function may be called from any thread.
 * docs/lighthouse.md ("Replicated lighthouses") says why each rule is there.
 */
#ifndef SG_LIGHTHOUSE_LEASE_H
#define SG_LIGHTHOUSE_LEASE_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

/*
 * sg__lh_lease_deadline: the last monotonic instant at which a leader may
 * still answer: `sent_ns` (when the acknowledged keepalive or grant was
 * SENT; etcd counts the TTL from when it received it, which is later) +
 * `ttl_s` (the TTL etcd granted in that answer) - `margin_ns` (clock rate
 * differences, the answer's time on the wire).  A TTL <= 0 (the lease is
 * gone) or a margin that eats the TTL yields `sent_ns`, i.e. already past.
 * Saturates instead of overflowing.
 */
int64_t sg__lh_lease_deadline(int64_t sent_ns, int64_t ttl_s,
                              int64_t margin_ns);

typedef enum sg__lh_role_e {
  SG__LH_ROLE_SINGLE = 0, /* no etcd: the one lighthouse decides */
  SG__LH_ROLE_FOLLOWER,   /* another lighthouse leads (or none yet) */
  SG__LH_ROLE_LEADER,     /* holds the leader key */
} sg__lh_role_t;

/* sg__lh_role_name: "single", "follower", "leader". */
const char *sg__lh_role_name(sg__lh_role_t r);

/* What the fencing rules look at, copied from the server under its lock. */
typedef struct sg__lh_fence_s {
  sg__lh_role_t role;
  int ready;              /* leader: the last quorum was read from etcd */
  int64_t lease_deadline; /* sg__lh_lease_deadline of the last ack */
  int write_in_flight;    /* a quorum record is being written */
  int64_t confirmed_id;   /* the highest quorum id etcd stored for us */
} sg__lh_fence_t;

/*
 * sg__lh_fence_may_decide: 1 when the lighthouse may run the quorum
 * decision at `now_ns`: always without etcd; with etcd only as a ready
 * leader inside its lease with no record write outstanding (a quorum
 * issued then would wait on the write anyway, and two in flight could be
 * confirmed out of order).  Else 0.
 */
int sg__lh_fence_may_decide(const sg__lh_fence_t *f, int64_t now_ns);

/*
 * sg__lh_fence_may_answer: 1 when an answer for quorum `qid` may leave at
 * `now_ns`: always without etcd; with etcd only from a leader inside its
 * lease whose quorum id `qid` etcd has stored (confirmed_id >= qid: a new
 * id is written first, the same members' next quorum keeps the id).
 */
int sg__lh_fence_may_answer(const sg__lh_fence_t *f, int64_t qid,
                            int64_t now_ns);

/*
 * sg__lh_record_encode: "<qid>\n<id>\n<id>\n..." into a new sg_malloc'd
 * NUL-terminated string (*out, caller frees).  0, SG_EINVAL (an id with a
 * newline or empty) or SG_ENOMEM.
 */
int sg__lh_record_encode(int64_t qid, const char *const *ids, size_t n,
                         char **out);

/*
 * sg__lh_record_decode: parse a record of `len` bytes (need not be
 * NUL-terminated).  *qid gets the id; *ids (caller frees each and the
 * array with sg_free; NULL when *n == 0) the member ids, at most `max_ids`.
 * 0, SG_EINVAL (not a record, a negative id, more than max_ids ids, an
 * id over 1,024 bytes) or SG_ENOMEM.
 */
int sg__lh_record_decode(const char *buf, size_t len, size_t max_ids,
                         int64_t *qid, char ***ids, size_t *n);

/* sg__lh_record_ids_free: free what sg__lh_record_decode handed out. */
void sg__lh_record_ids_free(char **ids, size_t n);

/*
 * sg__lh_json_int: the integer value of the first member named `key`
 * (as "key": 12 or "key": "12", the gateway's int64 form) in the JSON text
 * `js` (len bytes).  0 with *v set, SG_ENOTFOUND, or SG_EINVAL (not an
 * integer, out of range).  A textual scan, enough for etcd's answers:
 * their keys and values are base64, so a member name cannot appear in a
 * string value.
 */
int sg__lh_json_int(const char *js, size_t len, const char *key, int64_t *v);

/* sg__lh_json_bool: 1 for "key": true, 0 for false or absent (the gateway
 * omits false booleans), SG_EINVAL for anything else. */
int sg__lh_json_bool(const char *js, size_t len, const char *key);

/*
 * sg__lh_json_str: the string value of the first member named `key`:
 * *start (borrowed, into js) and *slen, without quotes; escapes are not
 * decoded (base64 has none).  0, SG_ENOTFOUND or SG_EINVAL.
 */
int sg__lh_json_str(const char *js, size_t len, const char *key,
                    const char **start, size_t *slen);

/* sg__lh_b64_encode: standard base64 with padding, NUL-terminated, into a
 * new sg_malloc'd string (NULL when out of memory). */
char *sg__lh_b64_encode(const uint8_t *p, size_t n);

/*
 * sg__lh_b64_decode: decode `n` chars of standard base64 into a new
 * sg_malloc'd buffer (*out, NUL-terminated for convenience, *outlen bytes
 * before the NUL).  0, SG_EINVAL or SG_ENOMEM.
 */
int sg__lh_b64_decode(const char *s, size_t n, uint8_t **out, size_t *outlen);

#endif /* SG_LIGHTHOUSE_LEASE_H */
