/*
 * etcd.h: the few etcd v3 calls a replicated lighthouse makes, through
 * etcd's JSON gateway (HTTP/1.1 + JSON, libcurl): lease grant, keepalive
 * and revoke, a campaign for a key, a read, and a write conditioned on a
 * key's create revision.
 *
 * Why the gateway and not gRPC: every call here is unary (a keepalive is one
 * request and one answer on the gateway), the lighthouse makes a few per
 * second, and libcurl gives per-call deadlines and endpoint failover for
 * free; our gRPC client would need etcd's protobufs and a streaming
 * keepalive for no gain at this rate.
 *
 * Every call blocks for at most `timeout_ms` per endpoint tried (an endpoint
 * that fails to connect or answers 5xx is left for the next one of the
 * list, rotating), so for at most timeout_ms x the number of endpoints.
 * One sg__etcd_t is used by one thread at a time.  Errors: SG_ETIMEDOUT,
 * SG_ECONNREFUSED (no endpoint answered), SG_EPROTO (an answer this client
 * cannot read), SG_EPEER (etcd answered with an error: detail in err),
 * SG_ENOMEM, SG_EINVAL.
 */
#ifndef SG_LIGHTHOUSE_ETCD_H
#define SG_LIGHTHOUSE_ETCD_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

typedef struct sg__etcd_s sg__etcd_t;

/*
 * sg__etcd_new: a client for `endpoints` ("http://h:p,http://h:p"; a bare
 * "h:p" gets http://).  Connects lazily.  Copies the string.  0,
 * SG_EINVAL (empty list, not http) or SG_ENOMEM.
 */
int sg__etcd_new(const char *endpoints, sg__etcd_t **out, sg_err_t *err);
void sg__etcd_free(sg__etcd_t *e);

/* sg__etcd_endpoint: the endpoint the last call used (borrowed). */
const char *sg__etcd_endpoint(const sg__etcd_t *e);

/* sg__etcd_grant: a lease of ttl_s seconds; *id and the *ttl_s etcd granted
 * (it raises a TTL under its floor). */
int sg__etcd_grant(sg__etcd_t *e, int64_t ttl_s, int64_t timeout_ms,
                   int64_t *id, int64_t *granted_ttl_s, sg_err_t *err);

/* sg__etcd_keepalive: renew lease `id`; *ttl_s is what is left of it after
 * the renewal, 0 when etcd no longer has the lease. */
int sg__etcd_keepalive(sg__etcd_t *e, int64_t id, int64_t timeout_ms,
                       int64_t *ttl_s, sg_err_t *err);

/* sg__etcd_revoke: drop lease `id` (its keys go with it). */
int sg__etcd_revoke(sg__etcd_t *e, int64_t id, int64_t timeout_ms,
                    sg_err_t *err);

/*
 * sg__etcd_campaign: put key = value attached to `lease` if the key does
 * not exist (one transaction).  *won = 1 and *create_rev = the key's create
 * revision when it was put; else *won = 0 and *create_rev / *holder (an
 * sg_malloc'd copy of the value, caller frees; NULL when the key vanished
 * meanwhile) describe the current holder.
 */
int sg__etcd_campaign(sg__etcd_t *e, const char *key, const char *value,
                      int64_t lease, int64_t timeout_ms, int *won,
                      int64_t *create_rev, char **holder, sg_err_t *err);

/*
 * sg__etcd_get: read `key`: *value (sg_malloc'd, NUL-terminated, *vlen
 * bytes; NULL when absent) and its *create_rev (0 when absent).  Either
 * out pointer for the value may be NULL.
 */
int sg__etcd_get(sg__etcd_t *e, const char *key, int64_t timeout_ms,
                 char **value, size_t *vlen, int64_t *create_rev,
                 sg_err_t *err);

/*
 * sg__etcd_put_if: put key = value only if `cond_key` exists with create
 * revision `cond_rev` (the writer still holds that leader key).  *ok = 1
 * when written, 0 when the condition failed.
 */
int sg__etcd_put_if(sg__etcd_t *e, const char *cond_key, int64_t cond_rev,
                    const char *key, const char *value, int64_t timeout_ms,
                    int *ok, sg_err_t *err);

#endif /* SG_LIGHTHOUSE_ETCD_H */
