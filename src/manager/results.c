/*
 * results.c: torchft's compute_quorum_results (the rules are in results.h)
 * and the group-step helper.
 *
 *   sorting     a stable sort of peer pointers by replica_id (byte order)
 *   decision    sg__mgr_compute_results: argument checks and the lookup
 *               of this replica (before any allocation), then passes over
 *               the sorted peers:
 *                 1. this replica's rank, max_step, commit_failures, |M|
 *                 2. pick the primary, this replica's max_replica_rank
 *                 3. split into up_to_date and recover_dst
 *                 4. walk recover_dst round-robin over up_to_date
 *   helpers     sg__mgr_results_free, sg__mgr_group_step
 *
 * Cost with n peers: one O(n log n) sort and O(n) work after it.  At most
 * five allocations: two scratch arrays and three output arrays.
 *
 * The sort is stable (ties broken by position in the caller's array) so
 * that duplicate replica ids, which the lighthouse never produces, still
 * give torchft's answer (Rust's sort is stable and its lookups take the
 * first match).
 */
#include <stdlib.h>
#include <string.h>

#include "manager/results.h"

/* str_or_empty: NULL peers' strings are read as "". */
static const char *str_or_empty(const char *s) { return s ? s : ""; }

/* cmp_peer_ptr: replica_id in strcmp (unsigned byte) order, then by
 * position in the input array, which makes qsort stable. */
static int cmp_peer_ptr(const void *a, const void *b) {
  const sg__mgr_peer_t *pa = *(const sg__mgr_peer_t *const *)a;
  const sg__mgr_peer_t *pb = *(const sg__mgr_peer_t *const *)b;
  int c = strcmp(pa->replica_id, pb->replica_id);
  if (c)
    return c;
  return (pa > pb) - (pa < pb);
}

/* check_args: the argument checks of sg__mgr_compute_results, in order. */
static int check_args(const sg__mgr_peer_t *peers, size_t n,
                      const char *replica_id, int64_t group_rank,
                      sg_err_t *err) {
  if (n > SG__MGR_MAX_PEERS)
    return sg_err_set(err, SG_ETOOBIG, "quorum of %zu participants over %zu", n,
                      SG__MGR_MAX_PEERS);
  if (!replica_id || (n > 0 && !peers))
    return sg_err_set(err, SG_EINVAL, "NULL replica_id or participants");
  if (group_rank < 0)
    return sg_err_set(err, SG_EINVAL, "negative group_rank %lld",
                      (long long)group_rank);
  for (size_t i = 0; i < n; i++)
    if (!peers[i].replica_id)
      return sg_err_set(err, SG_EINVAL, "participant %zu has no replica_id", i);
  return 0;
}

int sg__mgr_compute_results(int64_t quorum_id, const sg__mgr_peer_t *peers,
                            size_t n, const char *replica_id,
                            int64_t group_rank, int init_sync,
                            sg__mgr_results_t *out, sg_err_t *err) {
  const sg__mgr_peer_t **p = NULL; /* scratch: P, the sorted peers */
  size_t *utd = NULL;              /* scratch: up_to_date indexes into P */
  sg__mgr_results_t r;
  int rc;

  memset(&r, 0, sizeof(r));
  if (!out)
    return sg_err_set(err, SG_EINVAL, "NULL output");
  memset(out, 0, sizeof(*out));
  rc = check_args(peers, n, replica_id, group_rank, err);
  if (rc)
    return rc;
  size_t found = 0; /* checked before allocating, so memory cannot mask it */
  while (found < n && strcmp(peers[found].replica_id, replica_id) != 0)
    found++;
  if (found == n)
    return sg_err_set(err, SG_ENOTFOUND,
                      "replica %s not participating in returned quorum",
                      replica_id);

  /* P: pointers to the peers, stably sorted by replica_id */
  p = sg_malloc(n * sizeof(*p)); /* n <= SG__MGR_MAX_PEERS: no overflow */
  if (!p) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++)
    p[i] = &peers[i];
  if (n > 1)
    qsort(p, n, sizeof(*p), cmp_peer_ptr);

  /* pass 1: replica_rank = the first index of replica_id in P (present, as
     checked above, so me < n after the loop), max_step, commit_failures */
  size_t me = n;
  int64_t max_step = INT64_MIN;
  int64_t commit_failures = INT64_MIN;
  for (size_t i = 0; i < n; i++) {
    if (me == n && strcmp(p[i]->replica_id, replica_id) == 0)
      me = i;
    if (p[i]->step > max_step)
      max_step = p[i]->step;
    if (p[i]->commit_failures > commit_failures)
      commit_failures = p[i]->commit_failures;
  }
  size_t n_max = 0;
  for (size_t i = 0; i < n; i++)
    n_max += p[i]->step == max_step;

  /* pass 2: the primary is M[group_rank % |M|]; max_replica_rank is the
     first index in M with this replica's id. */
  size_t want = (size_t)((uint64_t)group_rank % (uint64_t)n_max);
  const sg__mgr_peer_t *primary = NULL;
  for (size_t i = 0, m = 0; i < n; i++) {
    if (p[i]->step != max_step)
      continue;
    if (m == want)
      primary = p[i];
    if (!r.has_max_replica_rank && strcmp(p[i]->replica_id, replica_id) == 0) {
      r.has_max_replica_rank = 1;
      r.max_replica_rank = (int64_t)m;
    }
    m++;
  }

  /* pass 3: split P into recover_dst and up_to_date.  The primary is at
     max_step and never force-recovers, so up_to_date is never empty. */
  int force_recover = init_sync && max_step == 0;
  utd = sg_malloc(n * sizeof(*utd));
  if (!utd) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  size_t n_utd = 0;
  for (size_t i = 0; i < n; i++) {
    int dst = p[i]->step != max_step ||
              (force_recover && strcmp(p[i]->replica_id, primary->replica_id));
    if (!dst)
      utd[n_utd++] = i;
  }
  if (n_utd == 0) { /* unreachable (see above); never divide by zero */
    rc = sg_err_set(err, SG_EINVAL, "no up-to-date replica in quorum");
    goto out;
  }

  /* pass 4: the k-th recovering replica pulls from
     utd[(k + group_rank) % n_utd].  k < 2^28 and group_rank <= INT64_MAX,
     so the sum is exact in uint64_t.  First count this replica's
     destinations, then fill them in. */
  size_t my_utd = n_utd; /* this replica's position in utd, if any */
  for (size_t u = 0; u < n_utd; u++)
    if (utd[u] == me)
      my_utd = u;
  size_t n_dst = n - n_utd, n_mine = 0;
  for (size_t k = 0; k < n_dst; k++)
    n_mine += ((uint64_t)k + (uint64_t)group_rank) % n_utd == my_utd;
  if (n_mine) {
    r.recover_dst_replica_ranks =
        sg_malloc(n_mine * sizeof(*r.recover_dst_replica_ranks));
    if (!r.recover_dst_replica_ranks) {
      rc = sg_err_set(err, SG_ENOMEM, "out of memory");
      goto out;
    }
  }
  r.recover_src_manager_address = "";
  for (size_t i = 0, k = 0, u = 0; i < n; i++) {
    if (u < n_utd && utd[u] == i) { /* up to date: skip */
      u++;
      continue;
    }
    size_t src = utd[((uint64_t)k + (uint64_t)group_rank) % n_utd];
    if (src == me)
      r.recover_dst_replica_ranks[r.n_recover_dst++] = (int64_t)i;
    if (i == me) {
      r.has_recover_src_replica_rank = 1;
      r.recover_src_replica_rank = (int64_t)src;
      r.recover_src_manager_address = str_or_empty(p[src]->address);
    }
    k++;
  }

  r.replica_ids = sg_malloc(n * sizeof(*r.replica_ids));
  r.up_to_date_addresses = sg_malloc(n_utd * sizeof(*r.up_to_date_addresses));
  if (!r.replica_ids || !r.up_to_date_addresses) {
    rc = sg_err_set(err, SG_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++)
    r.replica_ids[i] = p[i]->replica_id;
  r.n_replica_ids = n;
  for (size_t u = 0; u < n_utd; u++)
    r.up_to_date_addresses[u] = str_or_empty(p[utd[u]]->address);
  r.n_up_to_date = n_utd;

  r.quorum_id = quorum_id;
  r.store_address = str_or_empty(primary->store_address);
  r.max_step = max_step;
  r.max_world_size = (int64_t)n_max;
  r.replica_rank = (int64_t)me;
  r.replica_world_size = (int64_t)n;
  r.heal = r.has_recover_src_replica_rank;
  r.commit_failures = commit_failures;
  *out = r;
  memset(&r, 0, sizeof(r));
  sg_err_clear(err);
  rc = 0;

out:
  sg__mgr_results_free(&r);
  sg_free(utd);
  sg_free(p);
  return rc;
}

void sg__mgr_results_free(sg__mgr_results_t *r) {
  if (!r)
    return;
  sg_free(r->recover_dst_replica_ranks);
  sg_free(r->replica_ids);
  sg_free(r->up_to_date_addresses);
  memset(r, 0, sizeof(*r));
}

int64_t sg__mgr_group_step(const int64_t *rank_steps, size_t n, int *disagree) {
  int64_t lo = 0;
  int differ = 0;
  if (rank_steps && n > 0) {
    lo = rank_steps[0];
    for (size_t i = 1; i < n; i++) {
      if (rank_steps[i] != rank_steps[0])
        differ = 1;
      if (rank_steps[i] < lo)
        lo = rank_steps[i];
    }
  }
  if (disagree)
    *disagree = differ;
  return lo;
}
