/*
 * quorum.h: the lighthouse's quorum decision as a pure state machine.
 *
 *   state        heartbeats (id -> last seen), participants (id -> pending
 *                quorum request), the previous quorum and the quorum id
 *   inputs       sg__lh_heartbeat, sg__lh_join, sg__lh_leave, sg__lh_mark_dead
 *   decision     sg__lh_decide (read-only), sg__lh_tick (decide + apply)
 *   timers       sg__lh_next_deadline: when the decision could change alone
 *   upkeep       sg__lh_prune, sg__lh_set_quorum_id_floor,
 *                sg__lh_set_step_floor
 *   inspection   counts and *_at accessors for the dashboard and /metrics
 *
 * The rules are torchft's lighthouse quorum rules (docs/lighthouse.md,
 * "Rules"), with the reason strings byte for byte.  Nothing here does I/O,
 * takes a lock, reads a clock or touches global state: every call is given the
 * monotonic time `now_ns` (and `wall_ns` where a wall timestamp is stored).
 * A state object is not thread-safe; its owner (the lighthouse server)
 * serialises all calls.  No call blocks.
 *
 * Ownership: strings passed in are copied; pointers handed out are borrowed
 * from the state and stay valid until the next call that mutates it (any
 * call taking a non-const state), unless a function says otherwise.
 * Out-of-memory returns SG_ENOMEM and leaves the state exactly as it was.
 */
#ifndef SG_LIGHTHOUSE_QUORUM_H
#define SG_LIGHTHOUSE_QUORUM_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"

/* One replica group's quorum request (torchft QuorumMember). */
typedef struct sg__lh_member_s {
  char *replica_id;    /* owned, NUL-terminated; never NULL in a copy */
  char *address;       /* manager address, e.g. "http://host:port" */
  char *store_address; /* "MASTER_ADDR:MASTER_PORT" of the group */
  char *data;          /* opaque user JSON string */
  int64_t step;
  uint64_t world_size;
  int64_t commit_failures;    /* consecutive failed commits of the requester */
  int shrink_only;            /* bool */
  char **reconfigure_handles; /* owned: one per group rank, carried unread */
  size_t n_reconfigure_handles;
  uint8_t *wire; /* owned: this member's QuorumMember encoding, copied
                    into answers (it keeps fields this version does not
                    know); NULL: encoded from the fields above */
  size_t wire_len;
  void *block; /* owned: in a copy, one allocation that every pointer
                  above points into; NULL: each field is its own */
} sg__lh_member_t;

typedef struct sg__lh_opts_s {
  int64_t min_replicas;         /* < 0 is treated as 0 */
  int64_t join_timeout_ms;      /* < 0 is treated as 0 */
  int64_t heartbeat_timeout_ms; /* < 0 is treated as 0 */
  int64_t state_loss_wait_ms;   /* the step hold (sg__lh_set_step_floor):
                                   < 0 holds until a holder is back, 0
                                   never holds (torchft), > 0 holds this
                                   long after a holder was last heard */
} sg__lh_opts_t;

typedef struct sg__lh_quorum_s {
  int64_t quorum_id;
  int64_t created_wall_ns; /* wall_ns given to the sg__lh_tick that made it */
  size_t n;
  sg__lh_member_t *members; /* sorted by replica_id, byte order (strcmp) */
} sg__lh_quorum_t;

typedef struct sg__lh_state_s sg__lh_state_t; /* opaque */

/*
 * sg__lh_state_new: an empty state tracking at most `max_replicas` (1 ..
 * 2^28) replica ids at once.  *out is owned by the caller and freed with
 * sg__lh_state_free.  Returns 0, SG_EINVAL or SG_ENOMEM.
 */
int sg__lh_state_new(size_t max_replicas, sg__lh_state_t **out);

/* sg__lh_state_free: release `st` and everything it owns; NULL is a no-op. */
void sg__lh_state_free(sg__lh_state_t *st);

/*
 * sg__lh_member_free: free the strings of `m` (not `m` itself) and set the
 * pointers to NULL.  NULL is a no-op.
 */
void sg__lh_member_free(sg__lh_member_t *m);

/*
 * sg__lh_member_copy: deep-copy `src` into `dst` (which is overwritten, not
 * freed first).  A NULL string in `src` becomes "".  The caller owns the
 * copy.  Returns 0 or SG_ENOMEM (then `dst` is zeroed and holds nothing).
 */
int sg__lh_member_copy(sg__lh_member_t *dst, const sg__lh_member_t *src);

/*
 * sg__lh_heartbeat: record that `replica_id` was seen at `now_ns`.
 * Returns 0, SG_EINVAL (NULL id), SG_ETOOBIG (a new id while max_replicas
 * ids are tracked) or SG_ENOMEM.
 */
int sg__lh_heartbeat(sg__lh_state_t *st, const char *replica_id,
                     int64_t now_ns);

/*
 * sg__lh_join: a quorum request from `m` arrived at `now_ns`: an implicit
 * heartbeat, then the participant entry for m->replica_id becomes
 * {joined: now_ns, a copy of *m}, replacing any earlier entry.  `m` stays
 * the caller's.  Returns 0, SG_EINVAL, SG_ETOOBIG or SG_ENOMEM; on error
 * neither the heartbeat nor the entry is recorded.
 */
int sg__lh_join(sg__lh_state_t *st, const sg__lh_member_t *m, int64_t now_ns);

/*
 * sg__lh_leave: the pending request of `replica_id` was cancelled; drop
 * its participant entry now (its heartbeat record stays).
 * Returns 0 or SG_ENOTFOUND.
 */
int sg__lh_leave(sg__lh_state_t *st, const char *replica_id);

/*
 * sg__lh_mark_dead: the replica's last connection closed and its grace
 * period passed: remove its heartbeat record (so it is unhealthy at once)
 * and its participant entry.  A later heartbeat or join makes it healthy
 * again.  Returns 0, or SG_ENOTFOUND when neither record existed.
 */
int sg__lh_mark_dead(sg__lh_state_t *st, const char *replica_id);

typedef struct sg__lh_decision_s {
  int met;                         /* a quorum would be issued now */
  size_t n;                        /* candidates (valid when met) */
  const sg__lh_member_t **members; /* owned array of pointers borrowed from
                                      the state, sorted by replica_id; NULL
                                      when n == 0 */
  size_t *part_idx; /* the members' participant indexes (same block) */
  int same_as_prev; /* the members are exactly the previous quorum's */
  char reason[512]; /* torchft's reason string */
} sg__lh_decision_t;

/*
 * sg__lh_decide: torchft's quorum_compute at `now_ns` (same order, same
 * strings).  Does not change the state.  `out` is overwritten; release it
 * with sg__lh_decision_free (also after an error).  Its member pointers are
 * valid until the next mutation of `st`.
 * Returns 0, SG_EINVAL or SG_ENOMEM.
 */
int sg__lh_decide(const sg__lh_state_t *st, int64_t now_ns,
                  const sg__lh_opts_t *o, sg__lh_decision_t *out);

/* sg__lh_decision_free: free the members array; `d` may be reused. */
void sg__lh_decision_free(sg__lh_decision_t *d);

/*
 * sg__lh_tick: decide, and if a quorum is met apply it (torchft's rules):
 * bump the quorum id (+1 when there is no previous quorum or the ordered
 * replica_id lists differ, else +1 when a member of the new quorum has
 * commit_failures > 0), store it as the previous quorum with
 * created_wall_ns = wall_ns, drop the participant entries it includes, and
 * reset `joined` to now_ns on the entries it leaves out (torchft's waiting
 * requesters re-insert themselves at that moment).
 * `reason` (may be NULL) receives the decision's reason, truncated to
 * reason_len.  Returns 1 with *issued set (borrowed, valid until the next
 * sg__lh_tick or sg__lh_state_free) when a quorum was issued, 0 when not,
 * or SG_EINVAL / SG_ENOMEM (state unchanged).  The quorum an issued one
 * replaces is kept until sg__lh_free_retired, the next issue or
 * sg__lh_state_free, so that freeing its strings need not delay answers.
 */
int sg__lh_tick(sg__lh_state_t *st, int64_t now_ns, int64_t wall_ns,
                const sg__lh_opts_t *o, const sg__lh_quorum_t **issued,
                char *reason, size_t reason_len);

/*
 * sg__lh_may_meet: 0 when sg__lh_decide cannot meet a quorum now, whatever
 * the clock: the fast quorum needs every previous member as a participant
 * and the other rules need min_replicas participants.  1: decide to know.
 * O(1), so a lighthouse can skip the O(N) decision on most of N requests.
 */
int sg__lh_may_meet(const sg__lh_state_t *st, const sg__lh_opts_t *o);

/* sg__lh_free_retired: free the quorum the last issued one replaced. */
void sg__lh_free_retired(sg__lh_state_t *st);

/*
 * sg__lh_next_deadline: the earliest monotonic time > now_ns at which
 * sg__lh_decide could give another result with no new input: a healthy
 * replica's heartbeat expiring, or the join timeout of the earliest healthy
 * participant elapsing.  INT64_MAX if none.
 */
int64_t sg__lh_next_deadline(const sg__lh_state_t *st, int64_t now_ns,
                             const sg__lh_opts_t *o);

/*
 * sg__lh_prune: drop heartbeat records last seen at least older_than_ms
 * ago, except those of participants and of members of the previous quorum.
 * Returns how many were dropped (also added to sg__lh_pruned_total).
 */
size_t sg__lh_prune(sg__lh_state_t *st, int64_t now_ns, int64_t older_than_ms);

/*
 * sg__lh_set_quorum_id_floor: quorum ids never go backwards, also across
 * lighthouse restarts: the current id becomes max(current, id), so the
 * next bump yields at least id + 1.
 */
void sg__lh_set_quorum_id_floor(sg__lh_state_t *st, int64_t id);

/*
 * sg__lh_expect: quorum `qid` with members `ids` (n of them) was issued
 * before this lighthouse started: read from its id file, or reported by a
 * client with its quorum request.  The id is a floor for the ids
 * (sg__lh_set_quorum_id_floor).  Until this lighthouse issues its first
 * quorum, it issues none while a member of the newest such quorum is
 * neither a healthy participant nor silent (no heartbeat, counted from the
 * first report) for the heartbeat timeout, and for at most heartbeat + join
 * timeout after the first report: the first replica back after a restart
 * cannot go on alone while the others reconnect.  A stepguard difference
 * from torchft.  Older or equal reports, and reports after the first
 * quorum, change nothing but the floor.  Copies `ids`.  0, SG_EINVAL,
 * SG_ETOOBIG (more than max_replicas ids) or SG_ENOMEM (nothing changed
 * but the floor).
 */
int sg__lh_expect(sg__lh_state_t *st, int64_t qid, const char *const *ids,
                  size_t n, int64_t now_ns);

/*
 * The step floor (a stepguard difference from torchft).  The floor is the
 * highest step of a member of any quorum issued (or restored with
 * sg__lh_set_step_floor): the job's committed state is at least there.  A
 * quorum whose members are all below it would start the job over from
 * their older state, silently: torchft issues it.  Here it is held while a
 * replica that asked at the floor still heartbeats, and for
 * state_loss_wait_ms after one was last heard, unless it was seen to die
 * (sg__lh_mark_dead: its process is gone, and a restarted one has another
 * id), or after the floor was restored; < 0 holds it until one is back
 * whatever happened to them, 0 not at all.  A member that
 * asked at the floor itself before (the same replica id: the same process,
 * with torchft's ids) went back of its own accord, e.g. to a checkpoint,
 * and is not held.  When a quorum below the floor is issued, the floor
 * follows it down and the step regression is counted
 * (sg__lh_step_regressions) for the owner to report.
 */

/* sg__lh_set_step_floor: the floor becomes max(floor, step), learned at
 * `now_ns` (a report of a quorum issued before: the id file, a client). */
void sg__lh_set_step_floor(sg__lh_state_t *st, int64_t step, int64_t now_ns);

/* sg__lh_step_floor: the floor, -1 before any quorum or report. */
int64_t sg__lh_step_floor(const sg__lh_state_t *st);

/* sg__lh_step_regressions: quorums issued below the floor so far; *from and
 * *to (may be NULL) get the last one's floor and step. */
size_t sg__lh_step_regressions(const sg__lh_state_t *st, int64_t *from,
                               int64_t *to);

/* sg__lh_quorum_id: the id of the last issued quorum (or the floor); 0. */
int64_t sg__lh_quorum_id(const sg__lh_state_t *st);

/* sg__lh_prev_quorum: the last issued quorum (borrowed) or NULL if none. */
const sg__lh_quorum_t *sg__lh_prev_quorum(const sg__lh_state_t *st);

/*
 * Read-only iteration.  Indexes run 0 .. count-1 in an order that is stable
 * until the next mutation.
 */
size_t sg__lh_heartbeat_count(const sg__lh_state_t *st);
/* sg__lh_heartbeat_at: 0, or SG_EINVAL when i is out of range.  `id`
 * (borrowed) and `last_ns` may be NULL. */
int sg__lh_heartbeat_at(const sg__lh_state_t *st, size_t i, const char **id,
                        int64_t *last_ns);
size_t sg__lh_participant_count(const sg__lh_state_t *st);
/* sg__lh_participant_at: the entry (borrowed) or NULL when out of range;
 * `joined_ns` may be NULL. */
const sg__lh_member_t *sg__lh_participant_at(const sg__lh_state_t *st, size_t i,
                                             int64_t *joined_ns);
/*
 * sg__lh_is_healthy: nonzero when `replica_id` has a heartbeat younger than
 * the heartbeat timeout at `now_ns` (the same test sg__lh_decide applies).
 */
int sg__lh_is_healthy(const sg__lh_state_t *st, const char *replica_id,
                      int64_t now_ns, const sg__lh_opts_t *o);

/* sg__lh_is_member: 1 if `replica_id` is a member of the last issued
 * quorum, else 0.  O(1). */
int sg__lh_is_member(const sg__lh_state_t *st, const char *replica_id);

/* sg__lh_is_participant: 1 if `replica_id` has a pending entry, else 0. */
int sg__lh_is_participant(const sg__lh_state_t *st, const char *replica_id);
/* sg__lh_pruned_total: heartbeat records dropped by sg__lh_prune so far. */
size_t sg__lh_pruned_total(const sg__lh_state_t *st);

#endif /* SG_LIGHTHOUSE_QUORUM_H */
