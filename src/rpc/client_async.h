/*
 * client_async.h: the rpc client channel's asynchronous unary call
 * (src/rpc/client.c), which the manager server uses to send a round's
 * lighthouse Quorum without waking a thread to wait for it.  Internal:
 * the blocking sg_rpc_channel_call (stepguard/rpc_client.h) is the public
 * form.
 */
#ifndef SG_RPC_CLIENT_ASYNC_H
#define SG_RPC_CLIENT_ASYNC_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"
#include "stepguard/rpc_client.h"

/*
 * sg__rpc_done_cb: the outcome of an asynchronous call, with the codes and
 * message sg_rpc_channel_call returns for the same outcome; `resp` (owned
 * by the callback: sg_free it; NULL for 0 bytes and on error) is the
 * response message, `grpc_status` the received grpc-status or -1.  Runs on
 * the channel's I/O thread with none of the channel's locks held: it may
 * start another asynchronous call, and must not block or make a blocking
 * call on the same channel.
 */
typedef void (*sg__rpc_done_cb)(void *ud, int rc, int grpc_status,
                                uint8_t *resp, size_t resp_len,
                                const char *msg);

/*
 * sg__rpc_channel_call_start: start the call that sg_rpc_channel_call would
 * make (`req` is copied) and return at once.  On 0, `cb` runs exactly once,
 * on the I/O thread: with the response, or SG_ETIMEDOUT when `deadline`
 * passes first (the stream is reset with CANCEL), SG_EABORTED after
 * sg_rpc_channel_abort or during sg_rpc_channel_free (which returns only
 * after it ran), or a connection error.  On an error return (SG_EINVAL,
 * SG_ETOOBIG, SG_ESTATE in a forked child, SG_EABORTED, SG_ECLOSED,
 * SG_ENOMEM) `cb` never runs.  Any thread; never blocks beyond the
 * channel's mutex.
 */
int sg__rpc_channel_call_start(sg_rpc_channel_t *ch, const char *path,
                               const uint8_t *req, size_t req_len,
                               sg_deadline_t deadline, sg__rpc_done_cb cb,
                               void *ud, sg_err_t *err);

#endif /* SG_RPC_CLIENT_ASYNC_H */
