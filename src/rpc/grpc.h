/*
 * grpc.h: the parts of gRPC-over-HTTP/2 that the server and the client
 * share, as pure functions over byte spans (no I/O, no nghttp2): status
 * codes, the 5-byte message prefix, the grpc-timeout header, and
 * grpc-message percent-encoding.  Fuzzed by fuzz/fuzz_grpc.c.
 */
#ifndef SG_RPC_GRPC_H
#define SG_RPC_GRPC_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

/* gRPC status codes (grpc/doc/statuscodes.md numbering). */
typedef enum sg_grpc_status_e {
  SG_GRPC_OK = 0,
  SG_GRPC_CANCELLED = 1,
  SG_GRPC_UNKNOWN = 2,
  SG_GRPC_INVALID_ARGUMENT = 3,
  SG_GRPC_DEADLINE_EXCEEDED = 4,
  SG_GRPC_NOT_FOUND = 5,
  SG_GRPC_ALREADY_EXISTS = 6,
  SG_GRPC_PERMISSION_DENIED = 7,
  SG_GRPC_RESOURCE_EXHAUSTED = 8,
  SG_GRPC_FAILED_PRECONDITION = 9,
  SG_GRPC_ABORTED = 10,
  SG_GRPC_OUT_OF_RANGE = 11,
  SG_GRPC_UNIMPLEMENTED = 12,
  SG_GRPC_INTERNAL = 13,
  SG_GRPC_UNAVAILABLE = 14,
  SG_GRPC_DATA_LOSS = 15,
  SG_GRPC_UNAUTHENTICATED = 16,
} sg_grpc_status_t;

/* sg__grpc_status_name: "DEADLINE_EXCEEDED", or "UNKNOWN" for others. */
const char *sg__grpc_status_name(int status);

/*
 * sg__grpc_status_to_err: the SG_E* code a client reports for a non-OK
 * status: DEADLINE_EXCEEDED and CANCELLED -> SG_ETIMEDOUT (torchft maps
 * both to TimeoutError), UNAUTHENTICATED -> SG_EAUTH, NOT_FOUND ->
 * SG_ENOTFOUND, RESOURCE_EXHAUSTED -> SG_ETOOBIG, INVALID_ARGUMENT ->
 * SG_EINVAL, UNAVAILABLE -> SG_ECONNREFUSED, others -> SG_EPEER.
 */
int sg__grpc_status_to_err(int status);

/* Length-prefixed message: 1 byte compressed flag, 4 bytes big-endian length.
 */
#define SG_GRPC_PREFIX_LEN 5

/* sg__grpc_prefix_write: write the prefix for an uncompressed message. */
void sg__grpc_prefix_write(uint8_t out[SG_GRPC_PREFIX_LEN], uint32_t len);

/*
 * sg__grpc_prefix_parse: parse a prefix from `p` (n bytes available).
 * Returns 0 and sets *len when complete, SG_EAGAIN when n < 5, SG_EPROTO
 * when the flag byte is not 0 or 1, SG_ETOOBIG when the length exceeds
 * `max`.  *compressed receives the flag (we never accept compressed
 * messages: callers answer UNIMPLEMENTED or INTERNAL).
 */
int sg__grpc_prefix_parse(const uint8_t *p, size_t n, size_t max, uint32_t *len,
                          int *compressed);

/*
 * sg__grpc_timeout_parse: parse a grpc-timeout header value (`n` bytes,
 * not NUL-terminated): 1 to 8 ASCII digits then one unit of H M S m u n.
 * Sets *ns (saturating at INT64_MAX).  Returns 0 or SG_EINVAL.
 */
int sg__grpc_timeout_parse(const char *v, size_t n, int64_t *ns);

/*
 * sg__grpc_timeout_format: format `ns` (> 0) as a grpc-timeout value of at
 * most 8 digits, choosing the finest unit that fits, rounding up.  `out`
 * receives a NUL-terminated string.  Returns its length.
 */
size_t sg__grpc_timeout_format(int64_t ns, char out[16]);

/*
 * sg__grpc_message_encode: percent-encode `msg` for the grpc-message
 * trailer (bytes outside 0x20-0x7E and '%' become %XX).  Output is
 * truncated to fit `cap` (including the NUL) without splitting an escape.
 * Returns the output length.
 */
size_t sg__grpc_message_encode(const char *msg, char *out, size_t cap);

/* sg__grpc_message_decode: the inverse; invalid escapes are kept as is. */
size_t sg__grpc_message_decode(const char *v, size_t n, char *out, size_t cap);

/*
 * sg__utf8_valid: nonzero when s[0..n) is well-formed UTF-8 (no overlongs,
 * no surrogates, nothing above U+10FFFF).  protobuf-c does not check
 * strings; torchft's clients reject a message with a bad one, so servers
 * answer INVALID_ARGUMENT instead.
 */
int sg__utf8_valid(const char *s, size_t n);

/*
 * Protobuf string checks.  protobuf-c neither checks UTF-8 nor keeps the
 * length of a string (an embedded NUL silently truncates it), so servers
 * walk the raw message first.  A spec names the string fields of a message
 * and the fields that hold nested messages with their own spec.
 */
typedef struct sg__pb_spec_s sg__pb_spec_t;
typedef struct sg__pb_nested_s {
  uint32_t field;
  const sg__pb_spec_t *spec;
} sg__pb_nested_t;
struct sg__pb_spec_s {
  const uint32_t *strings; /* field numbers of string fields */
  size_t n_strings;
  const sg__pb_nested_t *nested;
  size_t n_nested;
};

/*
 * sg__pb_check_strings: walk the wire bytes p[0..n) of a message described
 * by `spec`.  Returns 0; SG_EPROTO for malformed wire data (bad varint,
 * length past the end, groups, unknown wire type, nesting deeper than 16);
 * SG_EINVAL when a string field holds invalid UTF-8 or a NUL byte, with its
 * field number in *field.  Pure; never reads past p + n.
 */
int sg__pb_check_strings(const uint8_t *p, size_t n, const sg__pb_spec_t *spec,
                         uint32_t *field);

/* sg__pb_no_strings: the spec of a message without string fields (the
 * walk still checks its wire format). */
extern const sg__pb_spec_t sg__pb_no_strings;

#endif /* SG_RPC_GRPC_H */
