/*
 * quorum.c: the lighthouse's quorum state and decision (see quorum.h).
 *
 *   time helpers     saturating ms -> ns, ages that never go negative
 *   idmap            a string-keyed hash index over a dense array
 *   state            heartbeats, participants, previous quorum, quorum id
 *   inputs           heartbeat, join, leave, mark_dead
 *   decision         decide (torchft quorum_compute), tick (apply), deadline
 *   upkeep/readers   prune, id floor, accessors
 *
 * Layout.  Heartbeat records and participant entries each live in a dense
 * array (so iteration and *_at(i) are O(1) per item) with an idmap beside
 * it that maps a replica id to its dense index.  Removal swaps the last
 * entry into the hole.  Every participant also has a heartbeat record (a
 * join is an implicit heartbeat; prune spares participants; mark_dead drops
 * both), so max_replicas bounds both arrays.
 *
 * Out-of-memory safety.  Every mutating call first acquires everything it
 * may need (string copies, array and index capacity) and only then changes
 * the state in steps that cannot fail, so an SG_ENOMEM leaves the state as
 * it was.  Growing capacity is not a visible change.
 *
 * Cost.  The decision runs on every request, so with N replicas a round
 * costs N decisions: each must be a pass over flat arrays, not N hash
 * lookups on N cold strings.  A participant entry therefore carries the
 * index of its heartbeat record (kept right when records move) and its index
 * in the previous quorum (found once, at join, through a hash index of the
 * previous quorum's ids).  A decision with H heartbeat records and P
 * participants is O(H + P) without string compares; the fast quorum is a
 * count; the candidates that were members of the previous quorum are put in
 * order by their old index (it is sorted), so only newcomers are sorted by
 * string, O(k log k) for k newcomers.  Applying a quorum that takes every
 * participant clears the index at once, and the previous quorum's strings
 * are freed after the caller has answered (sg__lh_free_retired).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lighthouse/quorum.h"

#define MAX_TRACKED ((size_t)1 << 28) /* keeps dense indexes in uint32_t */
#define MIN_CAP 8

/* ---- time helpers -------------------------------------------------------- */

/* ms_to_ns: milliseconds to nanoseconds; < 0 gives 0, saturates high. */
static uint64_t ms_to_ns(int64_t ms) {
  if (ms <= 0)
    return 0;
  if (ms > INT64_MAX / 1000000)
    return (uint64_t)INT64_MAX;
  return (uint64_t)ms * 1000000u;
}

/* age_ns: now - t, or 0 when t is not in the past (Rust's saturating
 * Instant::duration_since).  Computed unsigned, so it cannot overflow. */
static uint64_t age_ns(int64_t now, int64_t t) {
  return now > t ? (uint64_t)now - (uint64_t)t : 0;
}

/* add_ns: t + d, saturating at INT64_MAX. */
static int64_t add_ns(int64_t t, uint64_t d) {
  if (d > (uint64_t)INT64_MAX || t > INT64_MAX - (int64_t)d)
    return INT64_MAX;
  return t + (int64_t)d;
}

/* ---- idmap: replica id -> dense index ------------------------------------ */

/*
 * Open addressing with linear probing and backward-shift deletion (no
 * tombstones).  The table has at least twice as many slots as the dense
 * capacity, so probes stay short.  Keys are borrowed from the owner's dense
 * entries; the owner moves its entries exactly as the idmap moves its keys.
 */
typedef struct idmap_s {
  const char **keys; /* dense, borrowed from the owner's entries */
  uint64_t *hashes;  /* dense, hash of keys[i] */
  uint32_t *slots;   /* 0 = empty, else dense index + 1 */
  size_t n;          /* dense entries in use */
  size_t cap;        /* capacity of keys and hashes */
  size_t nslots;     /* power of two, >= 2 * cap, or 0 */
} idmap_t;

/* hash_id: FNV-1a, then a 64-bit finaliser so the low bits mix well. */
static uint64_t hash_id(const char *s) {
  uint64_t h = 1469598103934665603u;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 1099511628211u;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdu;
  h ^= h >> 33;
  return h;
}

static long idmap_find(const idmap_t *m, const char *key, uint64_t h) {
  if (m->nslots == 0)
    return -1;
  size_t mask = m->nslots - 1;
  for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
    uint32_t s = m->slots[i];
    if (s == 0)
      return -1;
    if (m->hashes[s - 1] == h && strcmp(m->keys[s - 1], key) == 0)
      return (long)(s - 1);
  }
}

/* put_slot: enter dense index `idx` in a table that has a free slot. */
static void put_slot(uint32_t *slots, size_t nslots, uint64_t h, size_t idx) {
  size_t mask = nslots - 1;
  size_t i = (size_t)h & mask;
  while (slots[i] != 0)
    i = (i + 1) & mask;
  slots[i] = (uint32_t)(idx + 1);
}

/* slot_of: the table position holding dense index `idx` (which exists). */
static size_t slot_of(const idmap_t *m, size_t idx) {
  size_t mask = m->nslots - 1;
  size_t i = (size_t)m->hashes[idx] & mask;
  while (m->slots[i] != idx + 1)
    i = (i + 1) & mask;
  return i;
}

/* grow: make *p hold at least `want` elements of `size` bytes (capacity
 * doubles).  On failure *p and *cap are unchanged. */
static int grow(void **p, size_t *cap, size_t want, size_t size) {
  if (want <= *cap)
    return 0;
  size_t c = *cap < MIN_CAP ? MIN_CAP : *cap;
  while (c < want)
    c *= 2;
  void *q = sg_realloc(*p, c * size);
  if (!q)
    return SG_ENOMEM;
  *p = q;
  *cap = c;
  return 0;
}

/*
 * idmap_reserve: room for `want` entries without further allocation.
 * Contents are unchanged whether it succeeds or not.
 */
static int idmap_reserve(idmap_t *m, size_t want) {
  size_t kcap = m->cap, hcap = m->cap;
  void *keys = (void *)m->keys;
  int rc = grow(&keys, &kcap, want, sizeof(*m->keys));
  m->keys = keys; /* a bigger block with the same contents */
  if (rc)
    return rc;
  rc = grow((void **)&m->hashes, &hcap, want, sizeof(*m->hashes));
  if (rc)
    return rc;
  m->cap = kcap; /* both arrays now hold at least kcap (== hcap) */
  if (m->nslots >= 2 * m->cap)
    return 0;
  size_t ns = MIN_CAP * 2;
  while (ns < 2 * m->cap)
    ns *= 2;
  uint32_t *slots = sg_calloc(ns, sizeof(*slots));
  if (!slots)
    return SG_ENOMEM;
  for (size_t i = 0; i < m->n; i++)
    put_slot(slots, ns, m->hashes[i], i);
  sg_free(m->slots);
  m->slots = slots;
  m->nslots = ns;
  return 0;
}

/* idmap_insert: append `key` (reserved beforehand); returns its index. */
static size_t idmap_insert(idmap_t *m, const char *key, uint64_t h) {
  size_t idx = m->n++;
  m->keys[idx] = key;
  m->hashes[idx] = h;
  put_slot(m->slots, m->nslots, h, idx);
  return idx;
}

/*
 * idmap_remove: drop dense index `idx`; the last entry moves into its
 * place (the owner must move its entry the same way).
 */
static void idmap_remove(idmap_t *m, size_t idx) {
  size_t mask = m->nslots - 1;
  size_t i = slot_of(m, idx);
  /* Backward shift: pull later entries of the probe run into the hole when
   * the hole lies between their home slot and where they sit. */
  for (size_t j = (i + 1) & mask; m->slots[j] != 0; j = (j + 1) & mask) {
    size_t home = (size_t)m->hashes[m->slots[j] - 1] & mask;
    if (((j - home) & mask) >= ((j - i) & mask)) {
      m->slots[i] = m->slots[j];
      i = j;
    }
  }
  m->slots[i] = 0;
  size_t last = m->n - 1;
  if (idx != last) {
    m->slots[slot_of(m, last)] = (uint32_t)(idx + 1);
    m->keys[idx] = m->keys[last];
    m->hashes[idx] = m->hashes[last];
  }
  m->n--;
}

static void idmap_free(idmap_t *m) {
  sg_free((void *)m->keys);
  sg_free(m->hashes);
  sg_free(m->slots);
  memset(m, 0, sizeof(*m));
}

/* ---- state --------------------------------------------------------------- */

typedef struct hb_s {
  char *id;        /* owned */
  int64_t last_ns; /* monotonic time last seen */
  int64_t best;    /* the highest step it asked a quorum at; -1: none */
} hb_t;

#define NO_INDEX SIZE_MAX

typedef struct part_s {
  sg__lh_member_t m; /* owned copy of the request */
  int64_t joined_ns; /* monotonic time of the request (or of its re-entry) */
  size_t hb_idx;     /* its heartbeat record (every participant has one) */
  size_t prev_idx;   /* its index in the previous quorum, or NO_INDEX */
} part_t;

struct sg__lh_state_s {
  size_t max_replicas; /* limit on heartbeat records (and so participants) */
  hb_t *hb;            /* dense heartbeat records */
  size_t hb_cap;
  idmap_t hb_map;
  part_t *part; /* dense participant entries */
  size_t part_cap;
  idmap_t part_map;
  int has_prev;            /* prev holds the last issued quorum */
  sg__lh_quorum_t prev;    /* owned */
  idmap_t prev_map;        /* replica id -> index in prev.members */
  size_t prev_parts;       /* participants that are members of prev */
  sg__lh_quorum_t retired; /* owned: the quorum prev replaced, to free */
  int64_t quorum_id;       /* last issued id, or the restored floor */
  size_t pruned_total;     /* heartbeat records dropped by prune */
  /* the members of the newest quorum issued before this lighthouse started
   * (sg__lh_expect), waited for until the first quorum here */
  char **expect; /* owned, n_expect ids */
  size_t n_expect;
  int64_t expect_qid;      /* that quorum's id (0: none known) */
  int64_t expect_since_ns; /* monotonic time of the first report */
  /* the step floor (quorum.h): the highest member step of a quorum */
  int64_t step_floor;    /* -1: none yet */
  int64_t floor_seen_ns; /* when a report or the id file restored it */
  size_t regressions;    /* quorums issued below the floor */
  int64_t regressed_from, regressed_to;
};

static void quorum_clear(sg__lh_quorum_t *q) {
  for (size_t i = 0; i < q->n; i++)
    sg__lh_member_free(&q->members[i]);
  sg_free(q->members);
  memset(q, 0, sizeof(*q));
}

int sg__lh_state_new(size_t max_replicas, sg__lh_state_t **out) {
  if (!out)
    return SG_EINVAL;
  *out = NULL;
  if (max_replicas == 0 || max_replicas > MAX_TRACKED)
    return SG_EINVAL;
  sg__lh_state_t *st = sg_calloc(1, sizeof(*st));
  if (!st)
    return SG_ENOMEM;
  st->max_replicas = max_replicas;
  st->step_floor = -1;
  *out = st;
  return 0;
}

void sg__lh_state_free(sg__lh_state_t *st) {
  if (!st)
    return;
  for (size_t i = 0; i < st->hb_map.n; i++)
    sg_free(st->hb[i].id);
  for (size_t i = 0; i < st->part_map.n; i++)
    sg__lh_member_free(&st->part[i].m);
  sg_free(st->hb);
  sg_free(st->part);
  idmap_free(&st->hb_map);
  idmap_free(&st->part_map);
  idmap_free(&st->prev_map);
  quorum_clear(&st->prev);
  quorum_clear(&st->retired);
  for (size_t i = 0; i < st->n_expect; i++)
    sg_free(st->expect[i]);
  sg_free(st->expect);
  sg_free(st);
}

void sg__lh_member_free(sg__lh_member_t *m) {
  if (!m)
    return;
  if (m->block) {
    sg_free(m->block);
  } else {
    sg_free(m->replica_id);
    sg_free(m->address);
    sg_free(m->store_address);
    sg_free(m->data);
    sg_free(m->wire);
    for (size_t i = 0; i < m->n_reconfigure_handles; i++)
      sg_free(m->reconfigure_handles[i]);
    sg_free(m->reconfigure_handles);
  }
  m->block = NULL;
  m->reconfigure_handles = NULL;
  m->n_reconfigure_handles = 0;
  m->replica_id = m->address = m->store_address = m->data = NULL;
  m->wire = NULL;
  m->wire_len = 0;
}

/* add_size: *total += n, or nonzero on overflow. */
static int add_size(size_t *total, size_t n) {
  if (n > SIZE_MAX - *total)
    return -1;
  *total += n;
  return 0;
}

/* put_str: copy `v` (NULL: "") to *at and advance it; returns the copy. */
static char *put_str(char **at, const char *v) {
  size_t n = strlen(v ? v : "") + 1;
  char *d = *at;
  memcpy(d, v ? v : "", n);
  *at += n;
  return d;
}

/*
 * sg__lh_member_copy: one allocation per member, laid out as the handle
 * pointers, the wire bytes, then every string: a join costs one malloc
 * and its member one free, where a field-by-field copy cost 5 or more.
 */
int sg__lh_member_copy(sg__lh_member_t *dst, const sg__lh_member_t *src) {
  if (!dst || !src)
    return SG_EINVAL;
  memset(dst, 0, sizeof(*dst));
  size_t nh = src->n_reconfigure_handles;
  const char *strs[4] = {src->replica_id, src->address, src->store_address,
                         src->data};
  size_t total = 0;
  int over = nh > SIZE_MAX / sizeof(char *) ||
             add_size(&total, nh * sizeof(char *)) ||
             add_size(&total, src->wire ? src->wire_len : 0);
  for (size_t i = 0; i < 4 && !over; i++)
    over = add_size(&total, strlen(strs[i] ? strs[i] : "") + 1);
  for (size_t i = 0; i < nh && !over; i++) {
    const char *h = src->reconfigure_handles[i];
    over = add_size(&total, strlen(h ? h : "") + 1);
  }
  if (over)
    return SG_ENOMEM;
  uint8_t *block = sg_malloc(total);
  if (!block)
    return SG_ENOMEM;
  char **handles = nh ? (char **)(void *)block : NULL;
  uint8_t *wire = block + nh * sizeof(char *);
  char *at = (char *)wire + (src->wire ? src->wire_len : 0);
  if (src->wire) {
    memcpy(wire, src->wire, src->wire_len);
    dst->wire = wire;
    dst->wire_len = src->wire_len;
  }
  dst->replica_id = put_str(&at, src->replica_id);
  dst->address = put_str(&at, src->address);
  dst->store_address = put_str(&at, src->store_address);
  dst->data = put_str(&at, src->data);
  for (size_t i = 0; i < nh; i++)
    handles[i] = put_str(&at, src->reconfigure_handles[i]);
  dst->reconfigure_handles = handles;
  dst->n_reconfigure_handles = nh;
  dst->block = block;
  dst->step = src->step;
  dst->world_size = src->world_size;
  dst->commit_failures = src->commit_failures;
  dst->shrink_only = src->shrink_only ? 1 : 0;
  return 0;
}

/* hb_reserve / part_reserve: room for one more entry, all or nothing as far
 * as contents go. */
static int hb_reserve(sg__lh_state_t *st) {
  void *p = st->hb;
  int rc = grow(&p, &st->hb_cap, st->hb_map.n + 1, sizeof(*st->hb));
  st->hb = p;
  return rc ? rc : idmap_reserve(&st->hb_map, st->hb_map.n + 1);
}

static int part_reserve(sg__lh_state_t *st) {
  void *p = st->part;
  int rc = grow(&p, &st->part_cap, st->part_map.n + 1, sizeof(*st->part));
  st->part = p;
  return rc ? rc : idmap_reserve(&st->part_map, st->part_map.n + 1);
}

/* hb_remove: drop heartbeat record `idx`, freeing its id.  No participant
 * may refer to it; the participant of the record moved into its place (if
 * any) is told the new index. */
static void hb_remove(sg__lh_state_t *st, size_t idx) {
  size_t last = st->hb_map.n - 1;
  if (idx != last) {
    long pi =
        idmap_find(&st->part_map, st->hb[last].id, st->hb_map.hashes[last]);
    if (pi >= 0)
      st->part[pi].hb_idx = idx;
  }
  sg_free(st->hb[idx].id);
  idmap_remove(&st->hb_map, idx);
  if (idx != last)
    st->hb[idx] = st->hb[last];
}

/* part_remove: drop participant entry `idx`; its strings are freed unless
 * `keep_strings` (they were moved elsewhere). */
static void part_remove(sg__lh_state_t *st, size_t idx, int keep_strings) {
  size_t last = st->part_map.n - 1;
  if (st->part[idx].prev_idx != NO_INDEX)
    st->prev_parts--;
  if (!keep_strings)
    sg__lh_member_free(&st->part[idx].m);
  idmap_remove(&st->part_map, idx);
  if (idx != last)
    st->part[idx] = st->part[last];
}

/* prev_index: the index of `id` (hash h) in the previous quorum, or
 * NO_INDEX. */
static size_t prev_index(const sg__lh_state_t *st, const char *id, uint64_t h) {
  long k = st->has_prev ? idmap_find(&st->prev_map, id, h) : -1;
  return k < 0 ? NO_INDEX : (size_t)k;
}

/* ---- inputs -------------------------------------------------------------- */

int sg__lh_heartbeat(sg__lh_state_t *st, const char *replica_id,
                     int64_t now_ns) {
  if (!st || !replica_id)
    return SG_EINVAL;
  uint64_t h = hash_id(replica_id);
  long hi = idmap_find(&st->hb_map, replica_id, h);
  if (hi >= 0) {
    st->hb[hi].last_ns = now_ns;
    return 0;
  }
  if (st->hb_map.n >= st->max_replicas)
    return SG_ETOOBIG;
  char *id = sg_strdup(replica_id);
  if (!id)
    return SG_ENOMEM;
  int rc = hb_reserve(st);
  if (rc) {
    sg_free(id);
    return rc;
  }
  size_t idx = idmap_insert(&st->hb_map, id, h);
  st->hb[idx].id = id;
  st->hb[idx].last_ns = now_ns;
  st->hb[idx].best = -1;
  return 0;
}

int sg__lh_join(sg__lh_state_t *st, const sg__lh_member_t *m, int64_t now_ns) {
  if (!st || !m || !m->replica_id)
    return SG_EINVAL;
  const char *id = m->replica_id;
  uint64_t h = hash_id(id);
  long hi = idmap_find(&st->hb_map, id, h);
  long pi = idmap_find(&st->part_map, id, h);
  char *hb_id = NULL;
  sg__lh_member_t copy;
  memset(&copy, 0, sizeof(copy));
  int rc = 0;

  if (hi < 0 && st->hb_map.n >= st->max_replicas)
    return SG_ETOOBIG;
  /* acquire */
  rc = sg__lh_member_copy(&copy, m);
  if (rc)
    goto out;
  if (hi < 0) {
    hb_id = sg_strdup(id);
    if (!hb_id) {
      rc = SG_ENOMEM;
      goto out;
    }
    rc = hb_reserve(st);
    if (rc)
      goto out;
  }
  if (pi < 0) {
    rc = part_reserve(st);
    if (rc)
      goto out;
  }
  /* commit: nothing below can fail */
  if (hi < 0) {
    size_t idx = idmap_insert(&st->hb_map, hb_id, h);
    st->hb[idx].id = hb_id;
    st->hb[idx].best = -1;
    hb_id = NULL;
    hi = (long)idx;
  }
  st->hb[hi].last_ns = now_ns;
  if (m->step > st->hb[hi].best)
    st->hb[hi].best = m->step;
  if (pi >= 0) {
    sg__lh_member_free(&st->part[pi].m);
    st->part[pi].m = copy;
    st->part_map.keys[pi] = copy.replica_id;
  } else {
    pi = (long)idmap_insert(&st->part_map, copy.replica_id, h);
    st->part[pi].m = copy;
    st->part[pi].prev_idx = prev_index(st, id, h);
    if (st->part[pi].prev_idx != NO_INDEX)
      st->prev_parts++;
  }
  st->part[pi].joined_ns = now_ns;
  st->part[pi].hb_idx = (size_t)hi;
  memset(&copy, 0, sizeof(copy));
out:
  sg_free(hb_id);
  sg__lh_member_free(&copy);
  return rc;
}

int sg__lh_leave(sg__lh_state_t *st, const char *replica_id) {
  if (!st || !replica_id)
    return SG_EINVAL;
  long pi = idmap_find(&st->part_map, replica_id, hash_id(replica_id));
  if (pi < 0)
    return SG_ENOTFOUND;
  part_remove(st, (size_t)pi, 0);
  return 0;
}

int sg__lh_mark_dead(sg__lh_state_t *st, const char *replica_id) {
  if (!st || !replica_id)
    return SG_EINVAL;
  uint64_t h = hash_id(replica_id);
  long hi = idmap_find(&st->hb_map, replica_id, h);
  long pi = idmap_find(&st->part_map, replica_id, h);
  if (hi < 0 && pi < 0)
    return SG_ENOTFOUND;
  if (pi >= 0)
    part_remove(st, (size_t)pi, 0);
  if (hi >= 0)
    hb_remove(st, (size_t)hi);
  return 0;
}

/*
 * sg__lh_expect: keeps the newest report only; the ids are copied into one
 * array before the old one is dropped, so a failure changes nothing.
 */
int sg__lh_expect(sg__lh_state_t *st, int64_t qid, const char *const *ids,
                  size_t n, int64_t now_ns) {
  if (!st || (n && !ids) || qid < 0)
    return SG_EINVAL;
  if (n > st->max_replicas)
    return SG_ETOOBIG;
  sg__lh_set_quorum_id_floor(st, qid);
  if (st->has_prev || qid <= st->expect_qid || n == 0)
    return 0;
  char **copy = sg_calloc(n, sizeof(*copy));
  if (!copy)
    return SG_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    copy[i] = ids[i] ? sg_strdup(ids[i]) : NULL;
    if (!copy[i]) {
      for (size_t k = 0; k < i; k++)
        sg_free(copy[k]);
      sg_free(copy);
      return ids[i] ? SG_ENOMEM : SG_EINVAL;
    }
  }
  for (size_t i = 0; i < st->n_expect; i++)
    sg_free(st->expect[i]);
  sg_free(st->expect);
  st->expect = copy;
  st->n_expect = n;
  if (st->expect_qid == 0)
    st->expect_since_ns = now_ns;
  st->expect_qid = qid;
  return 0;
}

static int part_healthy(const sg__lh_state_t *st, size_t i, int64_t now,
                        uint64_t hb_ns);

/* expect_last_seen: when expected member `id` was last heard of: its
 * heartbeat, or the first report of the quorum when it has none since. */
static int64_t expect_last_seen(const sg__lh_state_t *st, const char *id) {
  long hi = idmap_find(&st->hb_map, id, hash_id(id));
  int64_t t = st->expect_since_ns;
  if (hi >= 0 && st->hb[hi].last_ns > t)
    t = st->hb[hi].last_ns;
  return t;
}

/*
 * expect_missing: how many expected members are neither healthy
 * participants nor silent for the heartbeat timeout; 0 once a quorum was
 * issued here, or when the hold (heartbeat + join timeout from the first
 * report) is over.
 */
static size_t expect_missing(const sg__lh_state_t *st, int64_t now_ns,
                             uint64_t hb_ns, uint64_t join_ns) {
  if (st->has_prev || st->n_expect == 0 ||
      age_ns(now_ns, st->expect_since_ns) >= hb_ns + join_ns)
    return 0;
  size_t missing = 0;
  for (size_t k = 0; k < st->n_expect; k++) {
    const char *id = st->expect[k];
    long pi = idmap_find(&st->part_map, id, hash_id(id));
    if (pi >= 0 && part_healthy(st, (size_t)pi, now_ns, hb_ns))
      continue;
    if (age_ns(now_ns, expect_last_seen(st, id)) >= hb_ns)
      continue; /* silent: it is not coming back soon */
    missing++;
  }
  return missing;
}

/* ---- decision ------------------------------------------------------------ */

/* holder_seen: when a replica at the step floor was last heard: the
 * newest heartbeat of one that asked at the floor and was not seen to die
 * (sg__lh_mark_dead drops its record), or when the floor was restored. */
static int64_t holder_seen(const sg__lh_state_t *st) {
  int64_t t = st->floor_seen_ns;
  for (size_t i = 0; i < st->hb_map.n; i++)
    if (st->hb[i].best >= st->step_floor && st->hb[i].last_ns > t)
      t = st->hb[i].last_ns;
  return t;
}

/* step_held: nonzero when a quorum whose members reach step `top` at most
 * waits for a replica at the floor (quorum.h, "The step floor");
 * `holder`: one of them asked at the floor before, and went back itself. */
static int step_held(const sg__lh_state_t *st, int64_t top, int holder,
                     int64_t now_ns, const sg__lh_opts_t *o) {
  if (st->step_floor < 0 || top >= st->step_floor || holder ||
      o->state_loss_wait_ms == 0)
    return 0;
  if (o->state_loss_wait_ms < 0)
    return 1;
  return now_ns < add_ns(holder_seen(st), ms_to_ns(o->state_loss_wait_ms));
}

/* part_healthy: participant `i` has a heartbeat younger than hb_ns. */
static int part_healthy(const sg__lh_state_t *st, size_t i, int64_t now,
                        uint64_t hb_ns) {
  return age_ns(now, st->hb[st->part[i].hb_idx].last_ns) < hb_ns;
}

/* A candidate that was not a member of the previous quorum. */
typedef struct newcomer_s {
  const char *id;
  size_t idx; /* participant index */
} newcomer_t;

static int cmp_newcomer(const void *a, const void *b) {
  return strcmp(((const newcomer_t *)a)->id, ((const newcomer_t *)b)->id);
}

/*
 * order_candidates: sort the n candidates (participant indexes in idx[])
 * by replica_id, in place.  Members of the previous quorum go by their
 * index there (prev is sorted, so that is their string order) and only
 * newcomers are compared as strings, then the two runs are merged.
 * Scratch: `slot` has room for prev.n indexes, `nc` for n newcomers.
 */
static void order_candidates(const sg__lh_state_t *st, size_t *idx, size_t n,
                             size_t *slot, newcomer_t *nc) {
  size_t nprev = 0, nnew = 0;
  for (size_t k = 0; k < st->prev.n; k++)
    slot[k] = NO_INDEX;
  for (size_t k = 0; k < n; k++) {
    size_t q = st->part[idx[k]].prev_idx;
    if (q != NO_INDEX) {
      slot[q] = idx[k];
      nprev++;
    } else {
      nc[nnew].id = st->part[idx[k]].m.replica_id;
      nc[nnew++].idx = idx[k];
    }
  }
  /* compact the members of prev, in prev's order, to slot[0..nprev) */
  size_t j = 0;
  for (size_t k = 0; j < nprev && k < st->prev.n; k++)
    if (slot[k] != NO_INDEX)
      slot[j++] = slot[k];
  if (nnew > 1)
    qsort(nc, nnew, sizeof(*nc), cmp_newcomer);
  size_t a = 0, b = 0;
  for (size_t o = 0; o < n; o++) {
    int take_new =
        b < nnew &&
        (a == nprev || strcmp(nc[b].id, st->part[slot[a]].m.replica_id) < 0);
    idx[o] = take_new ? nc[b++].idx : slot[a++];
  }
}

/*
 * sg__lh_decide follows torchft's quorum_compute step by step: count the
 * healthy replicas and participants, build the metadata suffix, then try
 * the fast quorum, min_replicas, split brain and the join timeout in that
 * order.  Candidates are gathered and ordered only once a quorum is met.
 */
int sg__lh_decide(const sg__lh_state_t *st, int64_t now_ns,
                  const sg__lh_opts_t *o, sg__lh_decision_t *out) {
  if (!out)
    return SG_EINVAL;
  memset(out, 0, sizeof(*out));
  if (!st || !o)
    return SG_EINVAL;
  uint64_t hb_ns = ms_to_ns(o->heartbeat_timeout_ms);
  uint64_t join_ns = ms_to_ns(o->join_timeout_ms);
  uint64_t min_replicas = o->min_replicas < 0 ? 0 : (uint64_t)o->min_replicas;

  /* steps 1, 2 and 4, and how many previous members are healthy
   * participants (a participant's prev_idx is unique to it) */
  size_t healthy_replicas = 0;
  for (size_t i = 0; i < st->hb_map.n; i++)
    if (age_ns(now_ns, st->hb[i].last_ns) < hb_ns)
      healthy_replicas++;
  size_t healthy = 0, prev_healthy = 0;
  int shrink_only = 0;
  int64_t first_joined = now_ns;
  for (size_t i = 0; i < st->part_map.n; i++) {
    if (!part_healthy(st, i, now_ns, hb_ns))
      continue;
    if (healthy == 0 || st->part[i].joined_ns < first_joined)
      first_joined = st->part[i].joined_ns;
    healthy++;
    if (st->part[i].m.shrink_only)
      shrink_only = 1;
    if (st->part[i].prev_idx != NO_INDEX)
      prev_healthy++;
  }

  /* step 5: the counts every reason ends with, formatted with it in one
   * pass (this runs for every request that may complete a quorum) */
#define META_FMT                                                               \
  " [%zu/%zu participants healthy][%zu heartbeating][shrink_only=%s]"
#define META_ARGS                                                              \
  healthy, st->part_map.n, healthy_replicas, shrink_only ? "true" : "false"

  /* stepguard: after a restart, the members of the last quorum issued
   * before it come back (or fall silent) before a first quorum here, so
   * the first to return cannot train on without the others */
  size_t missing = expect_missing(st, now_ns, hb_ns, join_ns);
  if (missing) {
    snprintf(out->reason, sizeof(out->reason),
             "Waiting for %zu of %zu members of quorum %" PRId64
             " from before a lighthouse restart" META_FMT,
             missing, st->n_expect, st->expect_qid, META_ARGS);
    return 0;
  }

  /* step 6: fast quorum, when every previous member is a healthy
   * participant; it skips the checks below */
  int met = st->has_prev && prev_healthy == st->prev.n;
  if (met)
    snprintf(out->reason, sizeof(out->reason), "Fast quorum found!" META_FMT,
             META_ARGS);
  if (!met) {
    if ((uint64_t)healthy < min_replicas) { /* step 7 */
      snprintf(out->reason, sizeof(out->reason),
               "New quorum not ready, only have %zu participants, need "
               "min_replicas %" PRIu64 META_FMT,
               healthy, min_replicas, META_ARGS);
      return 0;
    }
    if (healthy <= healthy_replicas / 2) { /* step 8 */
      snprintf(out->reason, sizeof(out->reason),
               "New quorum not ready, only have %zu participants, need at "
               "least half of %zu healthy workers" META_FMT,
               healthy, healthy_replicas, META_ARGS);
      return 0;
    }
    /* step 9 */
    if (healthy != healthy_replicas && age_ns(now_ns, first_joined) < join_ns) {
      snprintf(out->reason, sizeof(out->reason),
               "Valid quorum with %zu participants, waiting for %zu healthy "
               "but not participating stragglers due to join timeout" META_FMT,
               healthy, healthy_replicas - healthy, META_ARGS);
      return 0;
    }
    snprintf(out->reason, sizeof(out->reason), "Valid quorum found" META_FMT,
             META_ARGS);
  }

  /* steps 3 and 6 (shrink_only filter), then the order.  One block holds
   * the member pointers, their participant indexes and the scratch. */
  size_t n = 0, nprev = 0;
  if (healthy > 0) {
    size_t np = st->has_prev ? st->prev.n : 0;
    size_t bytes = healthy * (sizeof(*out->members) + sizeof(size_t) +
                              sizeof(newcomer_t)) +
                   np * sizeof(size_t);
    void *block = sg_malloc(bytes);
    if (!block)
      return SG_ENOMEM; /* out->met stays 0; the reason is kept */
    const sg__lh_member_t **c = block;
    size_t *idx = (size_t *)(c + healthy);
    newcomer_t *nc = (newcomer_t *)(idx + healthy);
    size_t *slot = (size_t *)(nc + healthy);
    int filter = st->has_prev && shrink_only;
    for (size_t i = 0; i < st->part_map.n; i++) {
      if (!part_healthy(st, i, now_ns, hb_ns))
        continue;
      int was_member = st->part[i].prev_idx != NO_INDEX;
      if (filter && !was_member)
        continue;
      nprev += (size_t)was_member;
      idx[n++] = i;
    }
    order_candidates(st, idx, n, slot, nc);
    int64_t top = -1;
    int holder = 0;
    for (size_t k = 0; k < n; k++) {
      c[k] = &st->part[idx[k]].m;
      if (c[k]->step > top)
        top = c[k]->step;
      holder |= st->hb[st->part[idx[k]].hb_idx].best >= st->step_floor;
    }
    out->members = c;
    out->part_idx = idx;
    /* stepguard: the members would start the job over from an older step
     * (quorum.h, "The step floor") */
    if (n > 0 && step_held(st, top, holder, now_ns, o)) {
      char wait[64] = "until one is back";
      if (o->state_loss_wait_ms > 0)
        snprintf(wait, sizeof(wait), "up to %" PRId64 " ms after one was heard",
                 o->state_loss_wait_ms);
      snprintf(out->reason, sizeof(out->reason),
               "Holding a quorum at step %" PRId64
               ": the job reached step %" PRId64
               " and no healthy participant holds it; waiting %s" META_FMT,
               top, st->step_floor, wait, META_ARGS);
      sg_free(block);
      out->members = NULL;
      out->part_idx = NULL;
      return 0;
    }
  }
#undef META_FMT
#undef META_ARGS
  if (n == 0) {
    sg_free((void *)out->members);
    out->members = NULL;
    out->part_idx = NULL;
  }
  out->met = 1;
  out->n = n;
  out->same_as_prev = st->has_prev && nprev == n && n == st->prev.n;
  return 0;
}

void sg__lh_decision_free(sg__lh_decision_t *d) {
  if (!d)
    return;
  sg_free((void *)d->members);
  d->members = NULL;
  d->part_idx = NULL;
  d->n = 0;
  d->met = 0;
  d->same_as_prev = 0;
}

/*
 * sg__lh_tick: two allocations (the new quorum's member array and its id
 * index) besides the decision's; the members' strings move from the
 * participant entries into the quorum, so applying it cannot fail.  The
 * quorum it replaces is retired, not freed (sg__lh_free_retired).
 */
int sg__lh_tick(sg__lh_state_t *st, int64_t now_ns, int64_t wall_ns,
                const sg__lh_opts_t *o, const sg__lh_quorum_t **issued,
                char *reason, size_t reason_len) {
  sg__lh_decision_t d;
  sg__lh_member_t *qm = NULL;
  idmap_t map;
  memset(&map, 0, sizeof(map));
  if (issued)
    *issued = NULL;
  if (reason && reason_len > 0)
    reason[0] = '\0';
  int rc = sg__lh_decide(st, now_ns, o, &d);
  if (reason && reason_len > 0) {
    size_t rl = strnlen(d.reason, sizeof(d.reason));
    rl = rl < reason_len ? rl : reason_len - 1;
    memcpy(reason, d.reason, rl);
    reason[rl] = '\0';
  }
  if (rc || !d.met)
    goto out;

  if (d.n > 0) {
    qm = sg_malloc(d.n * sizeof(*qm));
    rc = qm ? idmap_reserve(&map, d.n) : SG_ENOMEM;
    if (rc)
      goto out;
  }
  /* shallow copies and the new id index first: removing entries below
   * moves them in memory */
  for (size_t k = 0; k < d.n; k++) {
    qm[k] = *d.members[k];
    idmap_insert(&map, qm[k].replica_id, st->part_map.hashes[d.part_idx[k]]);
  }

  /* torchft's id bump rule: the ordered id lists differ unless the
   * members are exactly the previous ones */
  int changed = !d.same_as_prev;
  int failures = 0;
  for (size_t k = 0; k < d.n && !failures; k++)
    failures = qm[k].commit_failures > 0;
  if ((changed || failures) && st->quorum_id < INT64_MAX)
    st->quorum_id++;

  /* included entries leave (their strings now belong to qm); the others
   * stay, re-entered at now_ns like torchft's waiting requesters */
  if (d.n == st->part_map.n) {
    if (st->part_map.nslots)
      memset(st->part_map.slots, 0,
             st->part_map.nslots * sizeof(*st->part_map.slots));
    st->part_map.n = 0;
  } else {
    for (size_t k = 0; k < d.n; k++) {
      long pi = idmap_find(&st->part_map, qm[k].replica_id, map.hashes[k]);
      part_remove(st, (size_t)pi, 1);
    }
  }

  quorum_clear(&st->retired);
  st->retired = st->prev;
  idmap_free(&st->prev_map);
  st->prev_map = map;
  memset(&map, 0, sizeof(map));
  st->prev.quorum_id = st->quorum_id;
  st->prev.created_wall_ns = wall_ns;
  st->prev.n = d.n;
  st->prev.members = qm;
  st->has_prev = 1;
  qm = NULL;
  if (d.n > 0) { /* the step floor follows what was issued */
    int64_t top = -1;
    for (size_t k = 0; k < d.n; k++)
      if (st->prev.members[k].step > top)
        top = st->prev.members[k].step;
    if (top < st->step_floor) {
      st->regressions++;
      st->regressed_from = st->step_floor;
      st->regressed_to = top;
    }
    st->step_floor = top;
  }
  st->prev_parts = 0;
  for (size_t i = 0; i < st->part_map.n; i++) {
    part_t *p = &st->part[i];
    p->joined_ns = now_ns;
    p->prev_idx = prev_index(st, p->m.replica_id, st->part_map.hashes[i]);
    st->prev_parts += p->prev_idx != NO_INDEX;
  }
  if (issued)
    *issued = &st->prev;
  rc = 1;
out:
  idmap_free(&map);
  sg_free(qm);
  sg__lh_decision_free(&d);
  return rc;
}

int sg__lh_may_meet(const sg__lh_state_t *st, const sg__lh_opts_t *o) {
  if (!st || !o)
    return 1;
  if (st->has_prev && st->prev_parts == st->prev.n)
    return 1;
  return o->min_replicas <= 0 ||
         (uint64_t)st->part_map.n >= (uint64_t)o->min_replicas;
}

void sg__lh_free_retired(sg__lh_state_t *st) {
  if (st)
    quorum_clear(&st->retired);
}

int64_t sg__lh_next_deadline(const sg__lh_state_t *st, int64_t now_ns,
                             const sg__lh_opts_t *o) {
  if (!st || !o)
    return INT64_MAX;
  uint64_t hb_ns = ms_to_ns(o->heartbeat_timeout_ms);
  uint64_t join_ns = ms_to_ns(o->join_timeout_ms);
  int64_t best = INT64_MAX;
  for (size_t i = 0; i < st->hb_map.n; i++) {
    if (age_ns(now_ns, st->hb[i].last_ns) >= hb_ns)
      continue; /* already expired: nothing more to change */
    int64_t t = add_ns(st->hb[i].last_ns, hb_ns);
    if (t > now_ns && t < best)
      best = t;
  }
  int any = 0;
  int64_t first = 0, top = -1;
  for (size_t i = 0; i < st->part_map.n; i++) {
    if (!part_healthy(st, i, now_ns, hb_ns))
      continue;
    if (!any || st->part[i].joined_ns < first)
      first = st->part[i].joined_ns;
    if (st->part[i].m.step > top)
      top = st->part[i].m.step;
    any = 1;
  }
  if (any) {
    int64_t t = add_ns(first, join_ns);
    if (t > now_ns && t < best)
      best = t;
  }
  if (any && top < st->step_floor && o->state_loss_wait_ms > 0) {
    /* a step hold may be on: it ends (the walk over the heartbeats only
     * then, not on every decision of a job at its floor) */
    int64_t t = add_ns(holder_seen(st), ms_to_ns(o->state_loss_wait_ms));
    if (t > now_ns && t < best)
      best = t;
  }
  if (expect_missing(st, now_ns, hb_ns, join_ns)) {
    /* the hold ends, or an expected member falls silent */
    int64_t t = add_ns(st->expect_since_ns, hb_ns + join_ns);
    if (t > now_ns && t < best)
      best = t;
    for (size_t k = 0; k < st->n_expect; k++) {
      t = add_ns(expect_last_seen(st, st->expect[k]), hb_ns);
      if (t > now_ns && t < best)
        best = t;
    }
  }
  return best;
}

/* ---- upkeep and readers -------------------------------------------------- */

size_t sg__lh_prune(sg__lh_state_t *st, int64_t now_ns, int64_t older_than_ms) {
  if (!st)
    return 0;
  uint64_t older_ns = ms_to_ns(older_than_ms);
  size_t dropped = 0;
  /* walk down so that the entry swapped into a hole was already visited */
  for (size_t i = st->hb_map.n; i-- > 0;) {
    if (age_ns(now_ns, st->hb[i].last_ns) < older_ns)
      continue;
    const char *id = st->hb[i].id;
    if (idmap_find(&st->part_map, id, st->hb_map.hashes[i]) >= 0 ||
        prev_index(st, id, st->hb_map.hashes[i]) != NO_INDEX)
      continue;
    hb_remove(st, i);
    dropped++;
  }
  st->pruned_total += dropped;
  return dropped;
}

void sg__lh_set_quorum_id_floor(sg__lh_state_t *st, int64_t id) {
  if (st && id > st->quorum_id)
    st->quorum_id = id;
}

void sg__lh_set_step_floor(sg__lh_state_t *st, int64_t step, int64_t now_ns) {
  if (st && step > st->step_floor) {
    st->step_floor = step;
    st->floor_seen_ns = now_ns;
  }
}

int64_t sg__lh_step_floor(const sg__lh_state_t *st) {
  return st ? st->step_floor : -1;
}

size_t sg__lh_step_regressions(const sg__lh_state_t *st, int64_t *from,
                               int64_t *to) {
  if (from)
    *from = st ? st->regressed_from : 0;
  if (to)
    *to = st ? st->regressed_to : 0;
  return st ? st->regressions : 0;
}

int64_t sg__lh_quorum_id(const sg__lh_state_t *st) {
  return st ? st->quorum_id : 0;
}

const sg__lh_quorum_t *sg__lh_prev_quorum(const sg__lh_state_t *st) {
  return st && st->has_prev ? &st->prev : NULL;
}

size_t sg__lh_heartbeat_count(const sg__lh_state_t *st) {
  return st ? st->hb_map.n : 0;
}

int sg__lh_heartbeat_at(const sg__lh_state_t *st, size_t i, const char **id,
                        int64_t *last_ns) {
  if (!st || i >= st->hb_map.n)
    return SG_EINVAL;
  if (id)
    *id = st->hb[i].id;
  if (last_ns)
    *last_ns = st->hb[i].last_ns;
  return 0;
}

size_t sg__lh_participant_count(const sg__lh_state_t *st) {
  return st ? st->part_map.n : 0;
}

const sg__lh_member_t *sg__lh_participant_at(const sg__lh_state_t *st, size_t i,
                                             int64_t *joined_ns) {
  if (!st || i >= st->part_map.n)
    return NULL;
  if (joined_ns)
    *joined_ns = st->part[i].joined_ns;
  return &st->part[i].m;
}

int sg__lh_is_participant(const sg__lh_state_t *st, const char *replica_id) {
  if (!st || !replica_id)
    return 0;
  return idmap_find(&st->part_map, replica_id, hash_id(replica_id)) >= 0;
}

int sg__lh_is_member(const sg__lh_state_t *st, const char *replica_id) {
  if (!st || !replica_id)
    return 0;
  return prev_index(st, replica_id, hash_id(replica_id)) != NO_INDEX;
}

size_t sg__lh_pruned_total(const sg__lh_state_t *st) {
  return st ? st->pruned_total : 0;
}

int sg__lh_is_healthy(const sg__lh_state_t *st, const char *replica_id,
                      int64_t now_ns, const sg__lh_opts_t *o) {
  if (!st || !replica_id || !o)
    return 0;
  long hi = idmap_find(&st->hb_map, replica_id, hash_id(replica_id));
  return hi >= 0 &&
         age_ns(now_ns, st->hb[hi].last_ns) < ms_to_ns(o->heartbeat_timeout_ms);
}
