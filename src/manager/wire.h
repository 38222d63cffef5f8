/*
 * wire.h: decoding of ManagerService responses, shared by the client
 * (responses from the wire) and the server's in-process calls (responses
 * the loop encoded for a caller in its own process), so that both give the
 * same result for the same bytes.
 */
#ifndef SG_MANAGER_WIRE_H
#define SG_MANAGER_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/manager.h"

/*
 * sg__mgr_decode_quorum: check and decode a ManagerQuorumResponse (`len`
 * bytes at `resp`, borrowed) into *out (zeroed first; on error zeroed
 * again).  Returns 0, SG_EPROTO (malformed, or a string that is not UTF-8
 * without NUL) or SG_ENOMEM, with detail in err.  Pure; any thread.
 */
int sg__mgr_decode_quorum(const uint8_t *resp, size_t len,
                          sg_mgr_quorum_result_t *out, sg_err_t *err);

/* sg__mgr_decode_should_commit: *out = the decision of a
 * ShouldCommitResponse; 0 or SG_EPROTO.  Pure; any thread. */
int sg__mgr_decode_should_commit(const uint8_t *resp, size_t len, int *out,
                                 sg_err_t *err);

#endif /* SG_MANAGER_WIRE_H */
