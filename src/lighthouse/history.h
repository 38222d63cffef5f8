/*
 * history.h: the lighthouse's recent past, for the dashboard and /status:
 * quorum changes (a membership timeline), each replica's membership spans
 * and step rate, the last failures (members lost, and why when known) and
 * heals (members that rejoined behind the quorum's max step).
 *
 * Fixed size.  An sg__lh_history_t is one flat struct of fixed-capacity
 * rings with no pointer inside: it never allocates, its memory is the same
 * after one quorum change or a million, and a memcpy of it is a complete
 * copy (the lighthouse's snapshot for the HTTP thread is one).  What does
 * not fit is dropped oldest first and counted; entries older than the
 * window (sg__lh_history_init) are dropped by sg__lh_history_expire.
 *
 * Pure: no I/O, no lock, no clock (every call is given the monotonic time
 * `now_ns`), no global state.  Not thread-safe: the owner (the lighthouse
 * server, under its lock) serialises all calls.  No call blocks or fails.
 *
 * Replica ids longer than SG__LH_HISTORY_ID_MAX - 1 bytes are kept
 * truncated (on a UTF-8 boundary) and told apart by a hash of the whole id.
 * At most SG__LH_HISTORY_REPLICAS replicas are tracked at once (members of
 * the current quorum first); others are counted in `untracked`.
 */
#ifndef STEPGUARD_LH_HISTORY_H
#define STEPGUARD_LH_HISTORY_H

#include <stddef.h>
#include <stdint.h>

#include "lighthouse/quorum.h"

#define SG__LH_HISTORY_ID_MAX 64      /* bytes kept of an id, with its NUL */
#define SG__LH_HISTORY_REASON_MAX 96  /* bytes kept of a failure's reason */
#define SG__LH_HISTORY_REPLICAS 64    /* replicas tracked at once */
#define SG__LH_HISTORY_SPANS 8        /* membership spans kept per replica */
#define SG__LH_HISTORY_SAMPLES 16     /* step samples kept per replica */
#define SG__LH_HISTORY_SAMPLE_MS 1000 /* at most one step sample a second */
#define SG__LH_HISTORY_CHANGES 128    /* quorum changes kept */
#define SG__LH_HISTORY_LISTED 4       /* joined / left ids listed per change */
#define SG__LH_HISTORY_EVENTS 64      /* failures kept; heals kept */
#define SG__LH_HISTORY_WINDOW_MS (15 * 60 * 1000) /* default window */

typedef struct sg__lh_hid_s {
  char s[SG__LH_HISTORY_ID_MAX]; /* NUL-terminated, maybe truncated */
  uint64_t hash;                 /* of the whole id */
} sg__lh_hid_t;

/* One quorum change: a new quorum id. */
typedef struct sg__lh_hchange_s {
  int64_t t_ns;
  int64_t quorum_id;
  int64_t max_step;   /* the largest step among its members */
  uint32_t n_members; /* all of them, tracked or not */
  uint32_t n_joined;  /* not in the previous quorum */
  uint32_t n_left;    /* in the previous quorum, not in this one */
  uint32_t n_heals;   /* joined behind max_step */
  sg__lh_hid_t joined[SG__LH_HISTORY_LISTED]; /* the first n_joined */
  sg__lh_hid_t left[SG__LH_HISTORY_LISTED];   /* the first n_left */
} sg__lh_hchange_t;

/* A member lost: left out of a quorum, or seen down while a member. */
typedef struct sg__lh_hfailure_s {
  int64_t t_ns;      /* when it was seen down, or the change's time */
  int64_t quorum_id; /* the quorum it was lost from */
  int64_t step;      /* its last step seen, -1 if none */
  sg__lh_hid_t id;
  char reason[SG__LH_HISTORY_REASON_MAX]; /* "" when unknown */
} sg__lh_hfailure_t;

/* A member that rejoined behind the quorum's max step (it heals). */
typedef struct sg__lh_hheal_s {
  int64_t t_ns;
  int64_t quorum_id;
  int64_t step;     /* its step when it joined */
  int64_t max_step; /* the quorum's */
  sg__lh_hid_t id;
} sg__lh_hheal_t;

typedef struct sg__lh_hspan_s {
  int64_t start_ns, end_ns; /* end_ns -1: still a member */
} sg__lh_hspan_t;

typedef struct sg__lh_hsample_s {
  int64_t t_ns, step;
} sg__lh_hsample_t;

/* One tracked replica. */
typedef struct sg__lh_hreplica_s {
  int used;
  int member;      /* in the last issued quorum */
  int down;        /* a failure was recorded since it last joined */
  int fresh;       /* step samples restart at the next quorum */
  int64_t last_ns; /* the last quorum it was a member of */
  int64_t step;    /* its last step seen (-1: none) */
  int64_t step_ns; /* when */
  sg__lh_hid_t id;
  uint32_t span_head, n_spans; /* ring, oldest first */
  sg__lh_hspan_t spans[SG__LH_HISTORY_SPANS];
  uint32_t sample_head, n_samples; /* ring, oldest first */
  sg__lh_hsample_t samples[SG__LH_HISTORY_SAMPLES];
} sg__lh_hreplica_t;

typedef struct sg__lh_history_s {
  int64_t window_ns;
  int64_t quorum_id;      /* the last issued quorum's; 0: none yet */
  uint32_t n_members;     /* its member count */
  int64_t last_sample_ns; /* the last round of step samples */
  uint64_t changes_total, failures_total, heals_total; /* since start */
  uint64_t untracked; /* members not tracked for lack of room */
  uint32_t change_head, n_changes;
  sg__lh_hchange_t changes[SG__LH_HISTORY_CHANGES];
  uint32_t failure_head, n_failures;
  sg__lh_hfailure_t failures[SG__LH_HISTORY_EVENTS];
  uint32_t heal_head, n_heals;
  sg__lh_hheal_t heals[SG__LH_HISTORY_EVENTS];
  sg__lh_hreplica_t replicas[SG__LH_HISTORY_REPLICAS]; /* by slot */
} sg__lh_history_t;

/*
 * sg__lh_why_cb: why member `id` of the last quorum is not in the next one
 * (a static or long-lived string, or NULL: unknown).  Called during
 * sg__lh_history_quorum, for members lost without an sg__lh_history_down.
 */
typedef const char *(*sg__lh_why_cb)(void *ud, const char *id);

/*
 * sg__lh_history_init: an empty history keeping `window_ms` (<= 0: the
 * default, SG__LH_HISTORY_WINDOW_MS) of the past.  Overwrites all of *h.
 */
void sg__lh_history_init(sg__lh_history_t *h, int64_t window_ms);

/*
 * sg__lh_history_quorum: quorum `q` was issued at `now_ns`.  A quorum id
 * other than the last one is a change: its joined and left members are
 * recorded, a joined member behind the max step is a heal, a left member
 * not already recorded down is a failure whose reason comes from why(ud,
 * id) (why may be NULL).  The same id again is the same members (quorum
 * ids name memberships) asking for their next step: only step samples are
 * taken, at most once per SG__LH_HISTORY_SAMPLE_MS, so that a quorum per
 * training step costs O(1) here.  Expires old entries first.
 */
void sg__lh_history_quorum(sg__lh_history_t *h, int64_t now_ns,
                           const sg__lh_quorum_t *q, sg__lh_why_cb why,
                           void *ud);

/*
 * sg__lh_history_down: member `id` of the last quorum was seen down at
 * `now_ns` (its connection closed past the grace period, or it was killed)
 * for `reason` (copied, truncated).  Recorded as a failure now, once; the
 * quorum change that later leaves it out does not record it again.  An id
 * that is not a tracked member is ignored.
 */
void sg__lh_history_down(sg__lh_history_t *h, int64_t now_ns, const char *id,
                         const char *reason);

/*
 * sg__lh_history_expire: drop what ended before now_ns - window: changes,
 * failures, heals, closed spans, and replicas that are not members and
 * were last members before then.
 */
void sg__lh_history_expire(sg__lh_history_t *h, int64_t now_ns);

/* Rings, oldest first: the i-th entry (i < the ring's n_*). */
const sg__lh_hchange_t *sg__lh_history_change(const sg__lh_history_t *h,
                                              size_t i);
const sg__lh_hfailure_t *sg__lh_history_failure(const sg__lh_history_t *h,
                                                size_t i);
const sg__lh_hheal_t *sg__lh_history_heal(const sg__lh_history_t *h, size_t i);
const sg__lh_hspan_t *sg__lh_history_span(const sg__lh_hreplica_t *r, size_t i);
const sg__lh_hsample_t *sg__lh_history_sample(const sg__lh_hreplica_t *r,
                                              size_t i);

/*
 * sg__lh_history_rate: replica r's steps per second, from its oldest step
 * sample kept to its last step seen; 0 when it has one sample or less, or
 * its samples span no time.  Sets *window_ns (may be NULL) to that span.
 */
double sg__lh_history_rate(const sg__lh_hreplica_t *r, int64_t *window_ns);

#endif /* STEPGUARD_LH_HISTORY_H */
