/*
 * client.c: ManagerService calls (Quorum, CheckpointMetadata, ShouldCommit,
 * Kill, and stepguard's WaitLost) over one gRPC channel, with protobuf encoding
 * and checks of what comes back (strings must be UTF-8 without NUL, as
 * torchft's clients require).  Quorum and ShouldCommit go one road: started
 * as a call object (sg_mgr_call_t, local.c), over the wire or in-process
 * when the client uses a server of this process, then waited for; the
 * blocking forms start one and wait.
 */
#include <stdatomic.h>
#include <string.h>

#include "manager/manager_int.h"
#include "manager/wire.h"
#include "rpc/client_async.h"
#include "rpc/grpc.h"
#include "rpc/pb.h"
#include "stepguard/manager.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define MAX_RESPONSE (64u << 20)

struct sg_mgr_client_s {
  sg_rpc_channel_t *ch;
  _Atomic(sg_mgr_server_t *) srv; /* in-process calls go here; or NULL */
  atomic_int aborted;
};

static const uint32_t qresp_strings[] = {2, 5, 13, 14, 100};
static const sg__pb_spec_t qresp_spec = {qresp_strings, 5, NULL, 0};
static const uint32_t md_strings[] = {1};
static const sg__pb_spec_t md_spec = {md_strings, 1, NULL, 0};

int sg_mgr_client_new(const char *addr, int64_t connect_timeout_ms,
                      const char *auth_token, sg_mgr_client_t **out,
                      sg_err_t *err) {
  if (!addr || !out)
    return sg_err_set(err, SG_EINVAL, "address required");
  sg_mgr_client_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  sg_rpc_channel_opts_t o = {0};
  o.target = addr;
  o.connect_timeout_ms = connect_timeout_ms;
  o.auth_token = auth_token;
  o.max_message = MAX_RESPONSE;
  o.fail_fast = 1; /* as tonic's channels: no waiting out a dead server */
  int rc = sg_rpc_channel_new(&o, &c->ch, err);
  if (rc) {
    sg_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

void sg_mgr_client_free(sg_mgr_client_t *c) {
  if (!c)
    return;
  sg_rpc_channel_free(c->ch);
  sg_free(c);
}

void sg_mgr_client_abort(sg_mgr_client_t *c) {
  if (!c)
    return;
  atomic_store(&c->aborted, 1);
  sg_rpc_channel_abort(c->ch);
}

void sg_mgr_client_use_server(sg_mgr_client_t *c, sg_mgr_server_t *s) {
  atomic_store(&c->srv, s);
}

static void free_strv(char **v, size_t n) {
  for (size_t i = 0; v && i < n; i++)
    sg_free(v[i]);
  sg_free(v);
}

void sg_mgr_quorum_result_free(sg_mgr_quorum_result_t *r) {
  if (!r)
    return;
  sg_free(r->recover_src_manager_address);
  sg_free(r->recover_dst_replica_ranks);
  sg_free(r->store_address);
  free_strv(r->replica_ids, r->n_replica_ids);
  free_strv(r->up_to_date_manager_addresses, r->n_up_to_date_manager_addresses);
  free_strv(r->reconfigure_handles, r->n_reconfigure_handles);
  memset(r, 0, sizeof(*r));
}

/* dup_strv: an owned copy of v[0..n) (NULL for n == 0); 0 or SG_ENOMEM. */
static int dup_strv(char **v, size_t n, char ***out) {
  *out = NULL;
  if (n == 0)
    return 0;
  char **d = sg_calloc(n, sizeof(*d));
  if (!d)
    return SG_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    d[i] = sg_strdup(v[i]);
    if (!d[i]) {
      free_strv(d, i);
      return SG_ENOMEM;
    }
  }
  *out = d;
  return 0;
}

/* call: one unary call; on success *resp holds the response, its strings
 * checked against `spec` (NULL: the caller checks). */
static int call(sg_mgr_client_t *c, const char *method,
                const ProtobufCMessage *req, const sg__pb_spec_t *spec,
                sg_deadline_t deadline, uint8_t **resp, size_t *resp_len,
                sg_err_t *err) {
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = sg_malloc(len ? len : 1);
  *resp = NULL;
  *resp_len = 0;
  if (!buf)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  protobuf_c_message_pack(req, buf);
  int rc = sg_rpc_channel_call(c->ch, method, buf, len, deadline, resp,
                               resp_len, NULL, err);
  sg_free(buf);
  if (rc)
    return rc;
  uint32_t field = 0;
  if (spec && sg__pb_check_strings(*resp, *resp_len, spec, &field) != 0) {
    sg_free(*resp);
    *resp = NULL;
    return sg_err_set(err, SG_EPROTO, "malformed response to %s", method);
  }
  return 0;
}

int sg__mgr_decode_quorum(const uint8_t *resp, size_t len,
                          sg_mgr_quorum_result_t *out, sg_err_t *err) {
  Torchft__ManagerQuorumResponse *m = NULL;
  int rc = 0;
  uint32_t field = 0;
  memset(out, 0, sizeof(*out));
  if (sg__pb_check_strings(resp, len, &qresp_spec, &field) != 0)
    return sg_err_set(err, SG_EPROTO,
                      "malformed response to /torchft.ManagerService/Quorum");
  m = torchft__manager_quorum_response__unpack(&sg__pb_allocator, len, resp);
  if (!m)
    return sg_err_set(err, SG_EPROTO, "invalid ManagerQuorumResponse");
  out->quorum_id = m->quorum_id;
  out->recover_src_manager_address = sg_strdup(m->recover_src_manager_address);
  out->has_recover_src_replica_rank =
      m->_recover_src_replica_rank_case ==
      TORCHFT__MANAGER_QUORUM_RESPONSE___RECOVER_SRC_REPLICA_RANK_RECOVER_SRC_REPLICA_RANK;
  if (out->has_recover_src_replica_rank)
    out->recover_src_replica_rank = m->recover_src_replica_rank;
  out->store_address = sg_strdup(m->store_address);
  out->max_step = m->max_step;
  out->has_max_replica_rank =
      m->_max_replica_rank_case ==
      TORCHFT__MANAGER_QUORUM_RESPONSE___MAX_REPLICA_RANK_MAX_REPLICA_RANK;
  if (out->has_max_replica_rank)
    out->max_replica_rank = m->max_replica_rank;
  out->max_world_size = m->max_world_size;
  out->replica_rank = m->replica_rank;
  out->replica_world_size = m->replica_world_size;
  out->heal = m->heal != 0;
  out->commit_failures = m->commit_failures;
  if (!out->recover_src_manager_address || !out->store_address) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  if (m->n_recover_dst_replica_ranks) {
    size_t n = m->n_recover_dst_replica_ranks;
    out->recover_dst_replica_ranks = sg_malloc(n * sizeof(int64_t));
    if (!out->recover_dst_replica_ranks) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
    memcpy(out->recover_dst_replica_ranks, m->recover_dst_replica_ranks,
           n * sizeof(int64_t));
    out->n_recover_dst_replica_ranks = n;
  }
  rc = dup_strv(m->replica_ids, m->n_replica_ids, &out->replica_ids);
  if (!rc)
    out->n_replica_ids = m->n_replica_ids;
  if (!rc)
    rc = dup_strv(m->up_to_date_manager_addresses,
                  m->n_up_to_date_manager_addresses,
                  &out->up_to_date_manager_addresses);
  if (!rc)
    out->n_up_to_date_manager_addresses = m->n_up_to_date_manager_addresses;
  if (!rc)
    rc = dup_strv(m->reconfigure_handles, m->n_reconfigure_handles,
                  &out->reconfigure_handles);
  if (!rc)
    out->n_reconfigure_handles = m->n_reconfigure_handles;
  if (rc)
    sg_err_set(err, rc, "out of memory");
out:
  torchft__manager_quorum_response__free_unpacked(m, &sg__pb_allocator);
  if (rc)
    sg_mgr_quorum_result_free(out);
  return rc;
}

/* ---- started calls (Quorum, ShouldCommit) ---------------------------------
 */

/* remote_done: the channel's answer to a started call (its I/O thread). */
static void remote_done(void *ud, int rc, int grpc_status, uint8_t *resp,
                        size_t len, const char *msg) {
  sg_mgr_call_t *call = ud;
  uint32_t field = 0;
  (void)grpc_status;
  if (rc == 0 && call->kind == SG__MGR_COMMIT &&
      sg__pb_check_strings(resp, len, &sg__pb_no_strings, &field) != 0) {
    rc = SG_EPROTO;
    msg = "malformed response to /torchft.ManagerService/ShouldCommit";
  }
  if (rc) {
    sg_free(resp);
    resp = NULL;
  }
  sg__mgr_call_finish(call, rc, rc ? msg : "", resp, len);
  sg__mgr_call_unref(call);
}

/* remote_start: send `req` for `call` on c's channel; the channel's
 * callback takes a reference until it ran. */
static int remote_start(sg_mgr_client_t *c, const char *method,
                        const ProtobufCMessage *req, sg_mgr_call_t *call,
                        sg_err_t *err) {
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = sg_malloc(len ? len : 1);
  if (!buf)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  protobuf_c_message_pack(req, buf);
  sg__mgr_call_ref(call);
  int rc = sg__rpc_channel_call_start(c->ch, method, buf, len, call->deadline,
                                      remote_done, call, err);
  sg_free(buf);
  if (rc)
    sg__mgr_call_unref(call);
  return rc;
}

/* started: hand the started `call` (or its start error) to the caller. */
static int started(int rc, sg_mgr_call_t *call, sg_mgr_call_t **out) {
  if (rc) {
    if (call)
      sg__mgr_call_unref(call);
    return rc;
  }
  *out = call;
  return 0;
}

int sg_mgr_client_quorum_start(sg_mgr_client_t *c, int64_t group_rank,
                               int64_t step, const char *checkpoint_metadata,
                               int shrink_only, int init_sync,
                               int64_t commit_failures,
                               const char *reconfigure_handle,
                               sg_deadline_t deadline, sg_mgr_call_t **out,
                               sg_err_t *err) {
  *out = NULL;
  if (atomic_load(&c->aborted))
    return sg_err_set(err, SG_EABORTED, "channel aborted");
  sg_mgr_server_t *srv = atomic_load(&c->srv);
  if (srv)
    return sg_mgr_local_quorum_start(srv, group_rank, step, checkpoint_metadata,
                                     shrink_only, init_sync, commit_failures,
                                     reconfigure_handle, deadline, out, err);
  sg_mgr_call_t *call = NULL;
  int rc =
      sg__mgr_call_new(SG__MGR_QUORUM, group_rank, step, deadline, &call, err);
  if (!rc)
    rc = sg__mgr_call_set_quorum_args(call, checkpoint_metadata, shrink_only,
                                      init_sync, commit_failures,
                                      reconfigure_handle, err);
  if (!rc) {
    Torchft__ManagerQuorumRequest q = TORCHFT__MANAGER_QUORUM_REQUEST__INIT;
    q.group_rank = group_rank;
    q.step = step;
    q.checkpoint_metadata = call->metadata;
    q.shrink_only = shrink_only != 0;
    q.init_sync = init_sync != 0;
    q.commit_failures = commit_failures;
    q.reconfigure_handle = call->handle;
    rc = remote_start(c, "/torchft.ManagerService/Quorum", &q.base, call, err);
  }
  return started(rc, call, out);
}

int sg_mgr_client_should_commit_start(sg_mgr_client_t *c, int64_t group_rank,
                                      int64_t step, int should_commit,
                                      sg_deadline_t deadline,
                                      sg_mgr_call_t **out, sg_err_t *err) {
  *out = NULL;
  if (atomic_load(&c->aborted))
    return sg_err_set(err, SG_EABORTED, "channel aborted");
  sg_mgr_server_t *srv = atomic_load(&c->srv);
  if (srv)
    return sg_mgr_local_should_commit_start(srv, group_rank, step,
                                            should_commit, deadline, out, err);
  sg_mgr_call_t *call = NULL;
  int rc =
      sg__mgr_call_new(SG__MGR_COMMIT, group_rank, step, deadline, &call, err);
  if (!rc) {
    call->vote = should_commit != 0;
    Torchft__ShouldCommitRequest q = TORCHFT__SHOULD_COMMIT_REQUEST__INIT;
    q.group_rank = group_rank;
    q.step = step;
    q.should_commit = should_commit != 0;
    rc = remote_start(c, "/torchft.ManagerService/ShouldCommit", &q.base, call,
                      err);
  }
  return started(rc, call, out);
}

int sg_mgr_client_quorum(sg_mgr_client_t *c, int64_t group_rank, int64_t step,
                         const char *checkpoint_metadata, int shrink_only,
                         int init_sync, int64_t commit_failures,
                         const char *reconfigure_handle, sg_deadline_t deadline,
                         sg_mgr_quorum_result_t *out, sg_err_t *err) {
  sg_mgr_call_t *call = NULL;
  memset(out, 0, sizeof(*out));
  int rc = sg_mgr_client_quorum_start(c, group_rank, step, checkpoint_metadata,
                                      shrink_only, init_sync, commit_failures,
                                      reconfigure_handle, deadline, &call, err);
  if (rc)
    return rc;
  sg_mgr_call_wait(call, INT64_MAX);
  rc = sg_mgr_call_quorum_result(call, out, err);
  sg_mgr_call_free(call);
  return rc;
}

int sg_mgr_client_checkpoint_metadata(sg_mgr_client_t *c, int64_t rank,
                                      sg_deadline_t deadline, char **out,
                                      sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  *out = NULL;
  Torchft__CheckpointMetadataRequest q =
      TORCHFT__CHECKPOINT_METADATA_REQUEST__INIT;
  q.rank = rank;
  int rc = call(c, "/torchft.ManagerService/CheckpointMetadata", &q.base,
                &md_spec, deadline, &resp, &resp_len, err);
  if (rc)
    return rc;
  Torchft__CheckpointMetadataResponse *m =
      torchft__checkpoint_metadata_response__unpack(&sg__pb_allocator, resp_len,
                                                    resp);
  sg_free(resp);
  if (!m)
    return sg_err_set(err, SG_EPROTO, "invalid CheckpointMetadataResponse");
  *out = sg_strdup(m->checkpoint_metadata);
  torchft__checkpoint_metadata_response__free_unpacked(m, &sg__pb_allocator);
  return *out ? 0 : sg_err_set(err, SG_ENOMEM, "out of memory");
}

int sg__mgr_decode_should_commit(const uint8_t *resp, size_t len, int *out,
                                 sg_err_t *err) {
  *out = 0;
  Torchft__ShouldCommitResponse *m =
      torchft__should_commit_response__unpack(&sg__pb_allocator, len, resp);
  if (!m)
    return sg_err_set(err, SG_EPROTO, "invalid ShouldCommitResponse");
  *out = m->should_commit != 0;
  torchft__should_commit_response__free_unpacked(m, &sg__pb_allocator);
  return 0;
}

int sg_mgr_client_should_commit(sg_mgr_client_t *c, int64_t group_rank,
                                int64_t step, int should_commit,
                                sg_deadline_t deadline, int *out,
                                sg_err_t *err) {
  sg_mgr_call_t *call = NULL;
  *out = 0;
  int rc = sg_mgr_client_should_commit_start(c, group_rank, step, should_commit,
                                             deadline, &call, err);
  if (rc)
    return rc;
  sg_mgr_call_wait(call, INT64_MAX);
  rc = sg_mgr_call_should_commit_result(call, out, err);
  sg_mgr_call_free(call);
  return rc;
}

int sg_mgr_client_kill(sg_mgr_client_t *c, const char *msg,
                       sg_deadline_t deadline, sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  Torchft__KillRequest q = TORCHFT__KILL_REQUEST__INIT;
  q.msg = (char *)(msg ? msg : "");
  int rc = call(c, "/torchft.ManagerService/Kill", &q.base, &sg__pb_no_strings,
                deadline, &resp, &resp_len, err);
  sg_free(resp);
  return rc;
}

int sg_mgr_client_wait_lost(sg_mgr_client_t *c, int64_t after_quorum_id,
                            sg_deadline_t deadline, int64_t *qid,
                            sg_err_t *err) {
  uint8_t *resp = NULL;
  size_t resp_len = 0;
  *qid = 0;
  Torchft__ManagerWaitLostRequest q = TORCHFT__MANAGER_WAIT_LOST_REQUEST__INIT;
  q.after_quorum_id = after_quorum_id;
  int rc = call(c, "/torchft.ManagerService/WaitLost", &q.base,
                &sg__pb_no_strings, deadline, &resp, &resp_len, err);
  if (rc)
    return rc;
  Torchft__ManagerWaitLostResponse *m =
      torchft__manager_wait_lost_response__unpack(&sg__pb_allocator, resp_len,
                                                  resp);
  sg_free(resp);
  if (!m)
    return sg_err_set(err, SG_EPROTO, "invalid ManagerWaitLostResponse");
  *qid = m->lost_quorum_id;
  torchft__manager_wait_lost_response__free_unpacked(m, &sg__pb_allocator);
  return 0;
}
