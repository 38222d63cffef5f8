/*
 * client.c: LighthouseService calls (Quorum, Heartbeat) over one gRPC
 * channel, with protobuf encoding and validation of what comes back.  With
 * several comma-separated addresses (replicated lighthouses) a call that
 * finds a follower or a dead lighthouse is made again on the next address
 * within its deadline (call_any).
 */
#include <string.h>
#include <time.h>

#include "rpc/grpc.h"
#include "rpc/pb.h"
#include "stepguard/lighthouse.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define MAX_RESPONSE (64u << 20)

struct sg_lh_client_s {
  sg_rpc_channel_t *ch;
  size_t n_addrs; /* comma-separated addresses given */
};

#define RETRY_PAUSE_MS 50 /* between addresses: a follower answers at once */

int sg_lh_client_new(const char *addr, int64_t connect_timeout_ms,
                     const char *auth_token, sg_lh_client_t **out,
                     sg_err_t *err) {
  sg_lh_client_t *c = sg_calloc(1, sizeof(*c));
  if (!c)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  sg_rpc_channel_opts_t o = {0};
  o.target = addr;
  o.connect_timeout_ms = connect_timeout_ms;
  o.auth_token = auth_token;
  o.max_message = MAX_RESPONSE;
  o.fail_fast = 1; /* as tonic's channels: no waiting out a dead server */
  c->n_addrs = 1;
  for (const char *p = addr; p && *p; p++)
    c->n_addrs += *p == ',';
  int rc = sg_rpc_channel_new(&o, &c->ch, err);
  if (rc) {
    sg_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

void sg_lh_client_free(sg_lh_client_t *c) {
  if (!c)
    return;
  sg_rpc_channel_free(c->ch);
  sg_free(c);
}

void sg_lh_client_abort(sg_lh_client_t *c) { sg_rpc_channel_abort(c->ch); }

static void member_free(sg_lh_member_t *m) {
  sg_free(m->replica_id);
  sg_free(m->address);
  sg_free(m->store_address);
  sg_free(m->data);
  memset(m, 0, sizeof(*m));
}

void sg_lh_quorum_free(sg_lh_quorum_t *q) {
  for (size_t i = 0; i < q->n; i++)
    member_free(&q->members[i]);
  sg_free(q->members);
  memset(q, 0, sizeof(*q));
}

static const char *nz(const char *s) { return s ? s : ""; }

/*
 * call_any: sg_rpc_channel_call, and with several addresses again on the
 * next one after an answer UNAVAILABLE (a follower, a lighthouse that lost
 * its leadership or is stopping: the connection is dropped so the channel
 * moves on) or a transport failure, pausing RETRY_PAUSE_MS, at most three
 * rounds of the addresses and never past `deadline`.  One address: one
 * call, as torchft's client.
 */
static int call_any(sg_lh_client_t *c, const char *path, const uint8_t *req,
                    size_t len, sg_deadline_t deadline, uint8_t **resp,
                    size_t *resp_len, sg_err_t *err) {
  for (size_t tries = 1;; tries++) {
    int status = -1;
    sg_err_clear(err);
    int rc = sg_rpc_channel_call(c->ch, path, req, len, deadline, resp,
                                 resp_len, &status, err);
    if (!rc || c->n_addrs <= 1 || tries >= 3 * c->n_addrs)
      return rc;
    int moved = status == SG_GRPC_UNAVAILABLE ||
                (status < 0 && rc != SG_ETIMEDOUT && rc != SG_EABORTED &&
                 rc != SG_ECLOSED && rc != SG_ENOMEM && rc != SG_ESTATE);
    if (!moved || sg_deadline_left_ms(deadline) <= RETRY_PAUSE_MS)
      return rc;
    if (status == SG_GRPC_UNAVAILABLE)
      sg_rpc_channel_disconnect(c->ch);
    struct timespec ts = {0, RETRY_PAUSE_MS * 1000000L};
    nanosleep(&ts, NULL);
  }
}

static int copy_member(sg_lh_member_t *d, const Torchft__QuorumMember *m) {
  d->replica_id = sg_strdup(m->replica_id);
  d->address = sg_strdup(m->address);
  d->store_address = sg_strdup(m->store_address);
  d->data = sg_strdup(m->data);
  d->step = m->step;
  d->world_size = m->world_size;
  d->commit_failures = m->commit_failures;
  d->shrink_only = m->shrink_only;
  if (!d->replica_id || !d->address || !d->store_address || !d->data) {
    member_free(d);
    return SG_ENOMEM;
  }
  return 0;
}

int sg_lh_client_quorum(sg_lh_client_t *c, const sg_lh_member_t *r,
                        sg_deadline_t deadline, sg_lh_quorum_t *out,
                        sg_err_t *err) {
  uint8_t *req = NULL, *resp = NULL;
  size_t resp_len = 0;
  int rc;
  Torchft__LighthouseQuorumResponse *msg = NULL;
  memset(out, 0, sizeof(*out));

  Torchft__QuorumMember m = TORCHFT__QUORUM_MEMBER__INIT;
  m.replica_id = (char *)nz(r->replica_id);
  m.address = (char *)nz(r->address);
  m.store_address = (char *)nz(r->store_address);
  m.data = (char *)nz(r->data);
  m.step = r->step;
  m.world_size = r->world_size;
  m.shrink_only = r->shrink_only != 0;
  m.commit_failures = r->commit_failures;
  Torchft__LighthouseQuorumRequest q = TORCHFT__LIGHTHOUSE_QUORUM_REQUEST__INIT;
  q.requester = &m;
  size_t len = torchft__lighthouse_quorum_request__get_packed_size(&q);
  req = sg_malloc(len);
  if (!req) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  torchft__lighthouse_quorum_request__pack(&q, req);
  rc = call_any(c, "/torchft.LighthouseService/Quorum", req, len, deadline,
                &resp, &resp_len, err);
  if (rc)
    goto out;
  msg = torchft__lighthouse_quorum_response__unpack(&sg__pb_allocator, resp_len,
                                                    resp);
  if (!msg || !msg->quorum) {
    rc = sg_err_set(err, SG_EPROTO, "invalid LighthouseQuorumResponse");
    goto out;
  }
  Torchft__Quorum *qq = msg->quorum;
  out->quorum_id = qq->quorum_id;
  if (qq->created) {
    out->created_seconds = qq->created->seconds;
    out->created_nanos = qq->created->nanos;
  }
  out->members = sg_calloc(qq->n_participants ? qq->n_participants : 1,
                           sizeof(*out->members));
  if (!out->members) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < qq->n_participants; i++) {
    rc = copy_member(&out->members[i], qq->participants[i]);
    if (rc) {
      sg_err_set(err, rc, "out of memory");
      goto out;
    }
    out->n = i + 1;
  }
out:
  if (msg)
    torchft__lighthouse_quorum_response__free_unpacked(msg, &sg__pb_allocator);
  if (rc)
    sg_lh_quorum_free(out);
  sg_free(resp);
  sg_free(req);
  return rc;
}

int sg_lh_client_heartbeat(sg_lh_client_t *c, const char *replica_id,
                           sg_deadline_t deadline, sg_err_t *err) {
  Torchft__LighthouseHeartbeatRequest h =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_REQUEST__INIT;
  h.replica_id = (char *)nz(replica_id);
  size_t len = torchft__lighthouse_heartbeat_request__get_packed_size(&h);
  uint8_t *req = sg_malloc(len ? len : 1), *resp = NULL;
  size_t resp_len = 0;
  if (!req)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  torchft__lighthouse_heartbeat_request__pack(&h, req);
  int rc = call_any(c, "/torchft.LighthouseService/Heartbeat", req, len,
                    deadline, &resp, &resp_len, err);
  sg_free(resp);
  sg_free(req);
  return rc;
}
