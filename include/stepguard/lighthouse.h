/*
 * stepguard/lighthouse.h: the lighthouse, one per job.  It decides which
 * replica groups take part in each step (the quorum) and serves torchft's
 * LighthouseService (gRPC over HTTP/2) and a dashboard, /status and
 * /metrics (HTTP/1.1) on one port.
 *
 *   server   sg_lh_server_start() runs the lighthouse on a thread of its own
 *   client   sg_lh_client_*(): Quorum and Heartbeat calls over one channel
 */
#ifndef STEPGUARD_LIGHTHOUSE_H
#define STEPGUARD_LIGHTHOUSE_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sg_lh_opts_s {
  const char *bind;             /* "[::]:29510" (torchft's default) */
  int64_t min_replicas;         /* required: torchft has no default */
  int64_t join_timeout_ms;      /* 60000 */
  int64_t quorum_tick_ms;       /* 100; decisions are also event-driven */
  int64_t heartbeat_timeout_ms; /* 5000 */
  int64_t disconnect_grace_ms;  /* 250: see docs/lighthouse.md */
  int64_t prune_after_ms;       /* 600000: drop heartbeat records this old */
  const char *auth_token;       /* NULL: no authentication */
  const char *quorum_id_file;   /* NULL: floor derived from the wall clock */
  const char *hostname;         /* for the advertised address; NULL: own */
  size_t max_replicas;          /* 10000 tracked replica ids */
  unsigned max_connections;     /* 4096 */
  size_t max_message;           /* 4 MiB per request */
  const char *etcd;             /* NULL: one lighthouse.  Else etcd endpoints
                                   ("http://h:p,..."): lighthouses of one job
                                   elect a leader there (docs/lighthouse.md,
                                   "Replicated lighthouses") */
  const char *etcd_prefix;      /* "/stepguard/lighthouse": the job's keys */
  int64_t etcd_ttl_s;           /* 2: the leader's lease TTL in etcd */
  int64_t state_loss_wait_ms;   /* 60000: a quorum whose members are all
                                   behind the job's highest step waits this
                                   long after a replica holding it was last
                                   heard; -1: until one is back; 0: not at
                                   all, as torchft (docs/lighthouse.md,
                                   "The step floor") */
} sg_lh_opts_t;

/* The message a Quorum call held for the step floor is answered with,
 * UNAVAILABLE, shortly before its deadline: the caller asks again (on the
 * same lighthouse: it is the leader) and waits the hold out as an outage
 * (docs/lighthouse.md, "The step floor"). */
#define SG_LH_HELD_MESSAGE "the lighthouse holds the quorum, ask again"

/* sg_lh_opts_init: torchft's CLI defaults plus ours; min_replicas = -1
 * (must be set). */
SG_EXPORT void sg_lh_opts_init(sg_lh_opts_t *o);

typedef struct sg_lh_server_s sg_lh_server_t;

/*
 * sg_lh_server_start: bind, start the lighthouse's thread, return once it
 * serves.  Strings in `o` are copied.  With o->etcd, it first needs a
 * lease from etcd: when no endpoint grants one within 5 s it returns
 * SG_ECONNREFUSED or SG_ETIMEDOUT ("etcd unreachable ...") and starts
 * nothing; later losses of etcd are survived (it stops deciding).  Returns
 * 0, SG_EINVAL (bad option, detail in err), SG_EADDRINUSE, SG_ENOMEM or
 * another -errno.
 */
SG_EXPORT int sg_lh_server_start(const sg_lh_opts_t *o, sg_lh_server_t **out,
                                 sg_err_t *err);

/* sg_lh_server_port: the bound port (useful with port 0). */
SG_EXPORT int sg_lh_server_port(const sg_lh_server_t *s);

/* sg_lh_server_address: "http://{hostname}:{port}", owned by the server. */
SG_EXPORT const char *sg_lh_server_address(const sg_lh_server_t *s);

/*
 * sg_lh_server_stop: stop serving, fail every waiting call with
 * UNAVAILABLE, join the thread and free.  Thread-safe with respect to the
 * server's own thread; call once.
 */
SG_EXPORT void sg_lh_server_stop(sg_lh_server_t *s);

/* ---- client ------------------------------------------------------------ */

/* A quorum member as the client sees it (torchft QuorumMember). */
typedef struct sg_lh_member_s {
  char *replica_id;
  char *address;
  char *store_address;
  char *data;
  int64_t step;
  uint64_t world_size;
  int64_t commit_failures;
  int shrink_only;
} sg_lh_member_t;

typedef struct sg_lh_quorum_s {
  int64_t quorum_id;
  int64_t created_seconds;
  int32_t created_nanos;
  size_t n;
  sg_lh_member_t *members; /* owned */
} sg_lh_quorum_t;

/* sg_lh_quorum_free: free what `q` owns (not `q`). */
SG_EXPORT void sg_lh_quorum_free(sg_lh_quorum_t *q);

typedef struct sg_lh_client_s sg_lh_client_t;

/*
 * sg_lh_client_new: connect to the lighthouse at `addr` ("http://host:port")
 * within connect_timeout_ms.  `auth_token` may be NULL.  Thread-safe object.
 */
SG_EXPORT int sg_lh_client_new(const char *addr, int64_t connect_timeout_ms,
                               const char *auth_token, sg_lh_client_t **out,
                               sg_err_t *err);
SG_EXPORT void sg_lh_client_free(sg_lh_client_t *c);

/* sg_lh_client_abort: wake every call in progress with SG_EABORTED. */
SG_EXPORT void sg_lh_client_abort(sg_lh_client_t *c);

/*
 * sg_lh_client_quorum: send `requester` and wait until `deadline` for the
 * quorum.  On success *out is filled (caller frees with sg_lh_quorum_free).
 * Blocks; may be called from several threads at once.  Returns 0,
 * SG_ETIMEDOUT, SG_EABORTED, SG_EAUTH or another SG_E* with detail in err.
 */
SG_EXPORT int sg_lh_client_quorum(sg_lh_client_t *c,
                                  const sg_lh_member_t *requester,
                                  sg_deadline_t deadline, sg_lh_quorum_t *out,
                                  sg_err_t *err);

/* sg_lh_client_heartbeat: one Heartbeat call; errors as above. */
SG_EXPORT int sg_lh_client_heartbeat(sg_lh_client_t *c, const char *replica_id,
                                     sg_deadline_t deadline, sg_err_t *err);

/* ---- command line ------------------------------------------------------ */

/*
 * sg_lh_main: the stepguard-lighthouse program: parse argv (torchft's
 * flags and ours, --help), run until SIGINT or SIGTERM.  Returns the exit
 * status.  Installs signal handling for the duration of the call.
 */
SG_EXPORT int sg_lh_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_LIGHTHOUSE_H */
