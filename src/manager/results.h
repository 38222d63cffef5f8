/*
 * results.h: the manager's per-rank view of an issued quorum, as a pure
 * function: what torchft's compute_quorum_results derives from the same
 * quorum.
 *
 *   inputs      sg__mgr_peer_t, one per quorum participant (borrowed)
 *   decision    sg__mgr_compute_results: ranks, primary, recovery plan
 *   release     sg__mgr_results_free
 *   helper      sg__mgr_group_step: one step for a group whose ranks disagree
 *
 * Nothing here does I/O, takes a lock, reads a clock or touches global state
 * (apart from allocating through sg_malloc and friends), so any thread may
 * call these functions concurrently on distinct outputs.  No call blocks.
 */
#ifndef SG_MANAGER_RESULTS_H
#define SG_MANAGER_RESULTS_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

/* The largest quorum accepted, the same bound as the lighthouse's
 * max_replicas; keeps every rank and count far from int64/size_t limits. */
#define SG__MGR_MAX_PEERS ((size_t)1 << 28)

/* One quorum participant (torchft QuorumMember).  Strings are borrowed. */
typedef struct sg__mgr_peer_s {
  const char *replica_id;    /* never NULL */
  const char *address;       /* manager address; NULL is read as "" */
  const char *store_address; /* group's TCPStore; NULL is read as "" */
  int64_t step;
  uint64_t world_size; /* carried for callers; not used by the decision */
  int64_t commit_failures;
  int shrink_only; /* carried for callers; not used by the decision */
} sg__mgr_peer_t;

/*
 * torchft ManagerQuorumResponse, plus one stepguard extension.  "Borrowed"
 * strings point into the sg__mgr_peer_t array given to
 * sg__mgr_compute_results (or are the literal ""), so they live as long as
 * the caller's peers; "owned" arrays are freed by sg__mgr_results_free.
 */
typedef struct sg__mgr_results_s {
  int64_t quorum_id;
  const char *recover_src_manager_address; /* borrowed; "" when !heal */
  int has_recover_src_replica_rank;        /* == heal */
  int64_t recover_src_replica_rank;        /* valid when has_*; else 0 */
  int64_t *recover_dst_replica_ranks; /* owned: the replicas this rank sends
                                         state to, ascending; NULL if none */
  size_t n_recover_dst;
  const char *store_address; /* borrowed: the primary's store address */
  int64_t max_step;
  int has_max_replica_rank; /* this replica is at max_step */
  int64_t max_replica_rank; /* its index among those at max_step; else 0 */
  int64_t max_world_size;   /* how many replicas are at max_step */
  int64_t replica_rank;     /* index of this replica in replica_ids */
  int64_t replica_world_size;
  int heal;
  int64_t commit_failures;  /* max over the participants */
  const char **replica_ids; /* owned array of borrowed strings, sorted by
                               replica_id in byte order */
  size_t n_replica_ids;
  /* stepguard extension for striped recovery: the manager addresses of
     every up-to-date replica (step == max_step and not force-recovering),
     in replica-rank order.  Never empty after success. */
  const char **up_to_date_addresses; /* owned array of borrowed strings */
  size_t n_up_to_date;
} sg__mgr_results_t;

/*
 * sg__mgr_compute_results: what replica `replica_id`'s group rank
 * `group_rank` learns from quorum `quorum_id` whose participants are
 * peers[0 .. n-1], given in any order.  The rules are torchft's, step for
 * step:
 *
 *   P          = the peers, stably sorted by replica_id (strcmp byte order)
 *   replica_rank = first index of replica_id in P
 *   max_step   = max step over P; M = the peers of P at max_step, in order
 *   primary    = M[group_rank % |M|], whose store_address this rank uses
 *   force      = init_sync && max_step == 0
 *   recover_dst = indexes i with P[i].step != max_step, or (force and
 *                 P[i].replica_id != primary's id); up_to_date = the rest
 *   the k-th index of recover_dst pulls from
 *                 up_to_date[(k + group_rank) % |up_to_date|]
 *
 * `out` is overwritten (zeroed first, also on error, so sg__mgr_results_free
 * is always safe on it) and owned by the caller, who releases it with
 * sg__mgr_results_free.  Its borrowed strings point into `peers`.
 * `err` (may be NULL) gets the detail of a failure.
 *
 * Returns 0; SG_ENOTFOUND with "replica {id} not participating in returned
 * quorum" when replica_id is not among the peers (also when n == 0);
 * SG_EINVAL for NULL `out`, `replica_id`, `peers` (with n > 0) or a peer's
 * replica_id, or group_rank < 0; SG_ETOOBIG when n > SG__MGR_MAX_PEERS;
 * SG_ENOMEM (nothing allocated is kept).
 */
int sg__mgr_compute_results(int64_t quorum_id, const sg__mgr_peer_t *peers,
                            size_t n, const char *replica_id,
                            int64_t group_rank, int init_sync,
                            sg__mgr_results_t *out, sg_err_t *err);

/* sg__mgr_results_free: free the owned arrays of `r` and zero it; NULL is a
 * no-op.  `r` may be reused. */
void sg__mgr_results_free(sg__mgr_results_t *r);

/*
 * sg__mgr_group_step: the step a replica group reports to the lighthouse
 * when its n group ranks sent rank_steps[0 .. n-1]: the minimum (torchft
 * takes the last-arriving rank's step unchecked; the minimum is never ahead
 * of any rank's state).  *disagree (may be NULL) is set to 1 when the steps
 * are not all equal, else 0.  n == 0 or NULL rank_steps gives 0.
 */
int64_t sg__mgr_group_step(const int64_t *rank_steps, size_t n, int *disagree);

#endif /* SG_MANAGER_RESULTS_H */
