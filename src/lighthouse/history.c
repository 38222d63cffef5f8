/*
 * history.c: the lighthouse's bounded recent past (see history.h).
 *
 *   ids        truncated copies told apart by a 64-bit FNV-1a hash
 *   rings      head + count over a fixed array; a push onto a full ring
 *              overwrites the oldest entry
 *   replicas   a fixed table of slots found by linear search (64 of them,
 *              touched on a quorum change or once per sample period)
 *   recording  sg__lh_history_quorum: changes, failures, heals, spans and
 *              step samples; sg__lh_history_down: a failure seen early
 */
#include "lighthouse/history.h"

#include <string.h>

#define NS_PER_MS 1000000

/* ---- ids and rings ------------------------------------------------------ */

static uint64_t fnv1a(const char *s) {
  uint64_t x = 14695981039346656037ull;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    x ^= *p;
    x *= 1099511628211ull;
  }
  return x;
}

/* copy_trunc: copy s into out[cap], cut on a UTF-8 boundary. */
static void copy_trunc(char *out, size_t cap, const char *s) {
  size_t n = strlen(s);
  if (n >= cap) {
    n = cap - 1;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
      n--; /* s[n] starts the first sequence left out */
  }
  memcpy(out, s, n);
  out[n] = '\0';
}

static void hid_set(sg__lh_hid_t *d, const char *id) {
  copy_trunc(d->s, sizeof(d->s), id);
  d->hash = fnv1a(id);
}

static int hid_is(const sg__lh_hid_t *d, const char *id, uint64_t hash) {
  if (d->hash != hash)
    return 0;
  /* the hash covers the whole id; the kept prefix must match too */
  return strncmp(d->s, id, strlen(d->s)) == 0;
}

/* ring_push: the index to write the next entry of a ring of `cap` at;
 * drops the oldest when it is full. */
static uint32_t ring_push(uint32_t *head, uint32_t *n, uint32_t cap) {
  if (*n == cap) {
    *head = (*head + 1) % cap;
    (*n)--;
  }
  uint32_t at = (*head + *n) % cap;
  (*n)++;
  return at;
}

static void ring_pop(uint32_t *head, uint32_t *n, uint32_t cap) {
  *head = (*head + 1) % cap;
  (*n)--;
}

#define AT(arr, head, i, cap) (&(arr)[((head) + (uint32_t)(i)) % (cap)])

const sg__lh_hchange_t *sg__lh_history_change(const sg__lh_history_t *h,
                                              size_t i) {
  return AT(h->changes, h->change_head, i, SG__LH_HISTORY_CHANGES);
}

const sg__lh_hfailure_t *sg__lh_history_failure(const sg__lh_history_t *h,
                                                size_t i) {
  return AT(h->failures, h->failure_head, i, SG__LH_HISTORY_EVENTS);
}

const sg__lh_hheal_t *sg__lh_history_heal(const sg__lh_history_t *h, size_t i) {
  return AT(h->heals, h->heal_head, i, SG__LH_HISTORY_EVENTS);
}

const sg__lh_hspan_t *sg__lh_history_span(const sg__lh_hreplica_t *r,
                                          size_t i) {
  return AT(r->spans, r->span_head, i, SG__LH_HISTORY_SPANS);
}

const sg__lh_hsample_t *sg__lh_history_sample(const sg__lh_hreplica_t *r,
                                              size_t i) {
  return AT(r->samples, r->sample_head, i, SG__LH_HISTORY_SAMPLES);
}

/* ---- replicas ----------------------------------------------------------- */

static sg__lh_hreplica_t *find(sg__lh_history_t *h, const char *id,
                               uint64_t hash) {
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++)
    if (h->replicas[i].used && hid_is(&h->replicas[i].id, id, hash))
      return &h->replicas[i];
  return NULL;
}

/*
 * add: a slot for a replica not tracked yet: a free one, else the one of
 * the non-member last seen longest ago that is not `keep`-marked (a member
 * of the quorum being recorded).  NULL when every slot holds a member.
 */
static sg__lh_hreplica_t *add(sg__lh_history_t *h, const char *id,
                              uint64_t hash, const unsigned char *keep) {
  sg__lh_hreplica_t *r = NULL;
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS && !r; i++)
    if (!h->replicas[i].used)
      r = &h->replicas[i];
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS && !r; i++) {
    sg__lh_hreplica_t *c = &h->replicas[i];
    if (c->member || (keep && keep[i]))
      continue;
    if (!r || c->last_ns < r->last_ns)
      r = c;
  }
  if (!r)
    return NULL;
  memset(r, 0, sizeof(*r));
  r->used = 1;
  r->step = -1;
  hid_set(&r->id, id);
  r->id.hash = hash;
  return r;
}

static void sample_reset(sg__lh_hreplica_t *r) {
  r->sample_head = 0;
  r->n_samples = 0;
}

static void sample_push(sg__lh_hreplica_t *r, int64_t now, int64_t step) {
  uint32_t at =
      ring_push(&r->sample_head, &r->n_samples, SG__LH_HISTORY_SAMPLES);
  r->samples[at].t_ns = now;
  r->samples[at].step = step;
}

/* observe: member r's step at `now` (a step sample). */
static void observe(sg__lh_hreplica_t *r, int64_t now, int64_t step) {
  if (r->fresh || (r->step >= 0 && step < r->step)) {
    sample_reset(r); /* a new run of steps: after a heal, or backwards */
    r->fresh = 0;
  }
  r->step = step;
  r->step_ns = now;
  sample_push(r, now, step);
}

double sg__lh_history_rate(const sg__lh_hreplica_t *r, int64_t *window_ns) {
  if (window_ns)
    *window_ns = 0;
  if (r->n_samples < 2)
    return 0;
  const sg__lh_hsample_t *o = sg__lh_history_sample(r, 0);
  int64_t dt = r->step_ns - o->t_ns;
  if (dt <= 0 || r->step < o->step)
    return 0;
  if (window_ns)
    *window_ns = dt;
  return (double)(r->step - o->step) * 1e9 / (double)dt;
}

/* ---- recording ---------------------------------------------------------- */

void sg__lh_history_init(sg__lh_history_t *h, int64_t window_ms) {
  memset(h, 0, sizeof(*h));
  h->window_ns =
      (window_ms > 0 ? window_ms : SG__LH_HISTORY_WINDOW_MS) * NS_PER_MS;
  h->last_sample_ns = INT64_MIN;
}

static void add_failure(sg__lh_history_t *h, int64_t t, sg__lh_hreplica_t *r,
                        int64_t qid, const char *reason) {
  uint32_t at =
      ring_push(&h->failure_head, &h->n_failures, SG__LH_HISTORY_EVENTS);
  sg__lh_hfailure_t *f = &h->failures[at];
  f->t_ns = t;
  f->quorum_id = qid;
  f->step = r->step;
  f->id = r->id;
  copy_trunc(f->reason, sizeof(f->reason), reason ? reason : "");
  h->failures_total++;
  r->down = 1;
}

void sg__lh_history_down(sg__lh_history_t *h, int64_t now_ns, const char *id,
                         const char *reason) {
  if (!id)
    return;
  sg__lh_hreplica_t *r = find(h, id, fnv1a(id));
  if (!r || !r->member || r->down)
    return;
  add_failure(h, now_ns, r, h->quorum_id, reason);
}

void sg__lh_history_expire(sg__lh_history_t *h, int64_t now_ns) {
  int64_t cut = now_ns - h->window_ns;
  while (h->n_changes && sg__lh_history_change(h, 0)->t_ns < cut)
    ring_pop(&h->change_head, &h->n_changes, SG__LH_HISTORY_CHANGES);
  while (h->n_failures && sg__lh_history_failure(h, 0)->t_ns < cut)
    ring_pop(&h->failure_head, &h->n_failures, SG__LH_HISTORY_EVENTS);
  while (h->n_heals && sg__lh_history_heal(h, 0)->t_ns < cut)
    ring_pop(&h->heal_head, &h->n_heals, SG__LH_HISTORY_EVENTS);
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++) {
    sg__lh_hreplica_t *r = &h->replicas[i];
    if (!r->used)
      continue;
    if (!r->member && r->last_ns < cut) {
      memset(r, 0, sizeof(*r));
      continue;
    }
    while (r->n_spans) {
      const sg__lh_hspan_t *s = sg__lh_history_span(r, 0);
      if (s->end_ns < 0 || s->end_ns >= cut)
        break;
      ring_pop(&r->span_head, &r->n_spans, SG__LH_HISTORY_SPANS);
    }
  }
}

/* take_samples: once per sample period, every tracked member's step. */
static void take_samples(sg__lh_history_t *h, int64_t now,
                         const sg__lh_quorum_t *q) {
  h->last_sample_ns = now;
  for (size_t i = 0; i < q->n; i++) {
    const char *id = q->members[i].replica_id;
    sg__lh_hreplica_t *r = find(h, id, fnv1a(id));
    if (r && r->member) {
      observe(r, now, q->members[i].step);
      r->last_ns = now;
    }
  }
}

/* record_change: quorum q has a new id; see sg__lh_history_quorum. */
static void record_change(sg__lh_history_t *h, int64_t now,
                          const sg__lh_quorum_t *q, sg__lh_why_cb why,
                          void *ud) {
  unsigned char in_q[SG__LH_HISTORY_REPLICAS];
  memset(in_q, 0, sizeof(in_q));
  int64_t max_step = -1;
  for (size_t i = 0; i < q->n; i++)
    if (q->members[i].step > max_step)
      max_step = q->members[i].step;
  uint32_t at =
      ring_push(&h->change_head, &h->n_changes, SG__LH_HISTORY_CHANGES);
  sg__lh_hchange_t *c = &h->changes[at];
  memset(c, 0, sizeof(*c));
  c->t_ns = now;
  c->quorum_id = q->quorum_id;
  c->max_step = max_step;
  c->n_members = (uint32_t)q->n;
  h->changes_total++;

  /* members of q that the table holds already keep their slots */
  for (size_t i = 0; i < q->n; i++) {
    const char *id = q->members[i].replica_id;
    sg__lh_hreplica_t *r = find(h, id, fnv1a(id));
    if (r)
      in_q[r - h->replicas] = 1;
  }
  /* members of the last quorum that q leaves out */
  for (size_t i = 0; i < SG__LH_HISTORY_REPLICAS; i++) {
    sg__lh_hreplica_t *r = &h->replicas[i];
    if (!r->used || !r->member || in_q[i])
      continue;
    if (c->n_left < SG__LH_HISTORY_LISTED)
      c->left[c->n_left] = r->id;
    c->n_left++;
    if (!r->down)
      add_failure(h, now, r, h->quorum_id, why ? why(ud, r->id.s) : NULL);
    r->member = 0;
    if (r->n_spans) {
      sg__lh_hspan_t *s =
          &r->spans[(r->span_head + r->n_spans - 1) % SG__LH_HISTORY_SPANS];
      if (s->end_ns < 0)
        s->end_ns = now;
    }
  }
  /* the members of q: joins, heals, steps */
  uint64_t untracked = 0;
  for (size_t i = 0; i < q->n; i++) {
    const sg__lh_member_t *m = &q->members[i];
    uint64_t hash = fnv1a(m->replica_id);
    sg__lh_hreplica_t *r = find(h, m->replica_id, hash);
    if (!r) {
      r = add(h, m->replica_id, hash, in_q);
      if (!r) {
        untracked++;
        continue;
      }
      in_q[r - h->replicas] = 1;
    }
    if (!r->member) {
      if (c->n_joined < SG__LH_HISTORY_LISTED)
        c->joined[c->n_joined] = r->id;
      c->n_joined++;
      r->member = 1;
      r->down = 0;
      uint32_t sp = ring_push(&r->span_head, &r->n_spans, SG__LH_HISTORY_SPANS);
      r->spans[sp].start_ns = now;
      r->spans[sp].end_ns = -1;
      sample_reset(r);
      if (m->step < max_step) {
        uint32_t hat =
            ring_push(&h->heal_head, &h->n_heals, SG__LH_HISTORY_EVENTS);
        sg__lh_hheal_t *e = &h->heals[hat];
        e->t_ns = now;
        e->quorum_id = q->quorum_id;
        e->step = m->step;
        e->max_step = max_step;
        e->id = r->id;
        h->heals_total++;
        c->n_heals++;
        r->step = m->step;
        r->step_ns = now;
        r->fresh = 1; /* its rate starts after the heal's jump */
        r->last_ns = now;
        continue;
      }
    }
    observe(r, now, m->step);
    r->last_ns = now;
  }
  h->untracked = untracked;
  h->quorum_id = q->quorum_id;
  h->n_members = (uint32_t)q->n;
  h->last_sample_ns = now;
}

void sg__lh_history_quorum(sg__lh_history_t *h, int64_t now_ns,
                           const sg__lh_quorum_t *q, sg__lh_why_cb why,
                           void *ud) {
  if (!q)
    return;
  if (q->quorum_id == h->quorum_id && h->changes_total) {
    if (now_ns - h->last_sample_ns < SG__LH_HISTORY_SAMPLE_MS * NS_PER_MS)
      return; /* the common case: a step of the same members */
    sg__lh_history_expire(h, now_ns);
    take_samples(h, now_ns, q);
    return;
  }
  sg__lh_history_expire(h, now_ns);
  record_change(h, now_ns, q, why, ud);
}
