/*
 * map.c: sg_map_t, a string-keyed open-addressing hash map.
 *
 * Keys come from the network (replica ids), so the hash is SipHash-2-4
 * with a random key per map: a peer cannot choose ids that collide.
 * Linear probing; deletions leave tombstones that a resize drops; the table
 * grows at 3/4 occupancy counting tombstones.
 */
#include <string.h>
#include <sys/random.h>

#include "stepguard/base.h"

struct sg_map_slot_s {
  char *key; /* NULL: empty; TOMBSTONE: deleted */
  void *value;
  uint64_t hash;
};

static char tombstone_byte;
#define TOMBSTONE (&tombstone_byte)

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                               \
  do {                                                                         \
    v0 += v1;                                                                  \
    v1 = ROTL(v1, 13);                                                         \
    v1 ^= v0;                                                                  \
    v0 = ROTL(v0, 32);                                                         \
    v2 += v3;                                                                  \
    v3 = ROTL(v3, 16);                                                         \
    v3 ^= v2;                                                                  \
    v0 += v3;                                                                  \
    v3 = ROTL(v3, 21);                                                         \
    v3 ^= v0;                                                                  \
    v2 += v1;                                                                  \
    v1 = ROTL(v1, 17);                                                         \
    v1 ^= v2;                                                                  \
    v2 = ROTL(v2, 32);                                                         \
  } while (0)

/* siphash24: SipHash-2-4 of s[0..n) under key (k0, k1). */
static uint64_t siphash24(const uint8_t *s, size_t n, uint64_t k0,
                          uint64_t k1) {
  uint64_t v0 = k0 ^ UINT64_C(0x736f6d6570736575);
  uint64_t v1 = k1 ^ UINT64_C(0x646f72616e646f6d);
  uint64_t v2 = k0 ^ UINT64_C(0x6c7967656e657261);
  uint64_t v3 = k1 ^ UINT64_C(0x7465646279746573);
  size_t whole = n & ~(size_t)7;
  for (size_t i = 0; i < whole; i += 8) {
    uint64_t m = 0;
    for (int b = 7; b >= 0; b--)
      m = m << 8 | s[i + (size_t)b];
    v3 ^= m;
    SIPROUND;
    SIPROUND;
    v0 ^= m;
  }
  uint64_t last = (uint64_t)n << 56;
  for (size_t i = whole; i < n; i++)
    last |= (uint64_t)s[i] << (8 * (i - whole));
  v3 ^= last;
  SIPROUND;
  SIPROUND;
  v0 ^= last;
  v2 ^= 0xff;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  return v0 ^ v1 ^ v2 ^ v3;
}

void sg_map_init(sg_map_t *m) {
  memset(m, 0, sizeof(*m));
  uint64_t k[2];
  if (getrandom(k, sizeof(k), GRND_NONBLOCK) != (ssize_t)sizeof(k)) {
    /* no entropy yet (early boot): fall back to clock and address bits */
    k[0] = (uint64_t)sg_now_ns() ^ (uint64_t)(uintptr_t)m;
    k[1] = (uint64_t)sg_wall_ns() * UINT64_C(0x9e3779b97f4a7c15);
  }
  m->k0 = k[0];
  m->k1 = k[1];
}

void sg_map_free(sg_map_t *m) {
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].key && m->slots[i].key != TOMBSTONE)
      sg_free(m->slots[i].key);
  sg_free(m->slots);
  uint64_t k0 = m->k0, k1 = m->k1;
  memset(m, 0, sizeof(*m));
  m->k0 = k0;
  m->k1 = k1;
}

static uint64_t hash_key(const sg_map_t *m, const char *key) {
  return siphash24((const uint8_t *)key, strlen(key), m->k0, m->k1);
}

/* find: the slot holding `key`, or NULL. */
static struct sg_map_slot_s *find(const sg_map_t *m, const char *key,
                                  uint64_t h) {
  if (m->cap == 0)
    return NULL;
  size_t mask = m->cap - 1;
  for (size_t i = h & mask, probes = 0; probes < m->cap;
       i = (i + 1) & mask, probes++) {
    struct sg_map_slot_s *s = &m->slots[i];
    if (!s->key)
      return NULL;
    if (s->key != TOMBSTONE && s->hash == h && strcmp(s->key, key) == 0)
      return s;
  }
  return NULL;
}

static int resize(sg_map_t *m, size_t cap) {
  struct sg_map_slot_s *slots = sg_calloc(cap, sizeof(*slots));
  if (!slots)
    return SG_ENOMEM;
  for (size_t i = 0; i < m->cap; i++) {
    struct sg_map_slot_s *s = &m->slots[i];
    if (!s->key || s->key == TOMBSTONE)
      continue;
    size_t j = s->hash & (cap - 1);
    while (slots[j].key)
      j = (j + 1) & (cap - 1);
    slots[j] = *s;
  }
  sg_free(m->slots);
  m->slots = slots;
  m->cap = cap;
  m->used = m->len;
  return 0;
}

void *sg_map_get(const sg_map_t *m, const char *key) {
  struct sg_map_slot_s *s = find(m, key, hash_key(m, key));
  return s ? s->value : NULL;
}

int sg_map_put(sg_map_t *m, const char *key, void *value, void **old) {
  uint64_t h = hash_key(m, key);
  struct sg_map_slot_s *s = find(m, key, h);
  if (old)
    *old = s ? s->value : NULL;
  if (s) {
    s->value = value;
    return 0;
  }
  if ((m->used + 1) * 4 > m->cap * 3) {
    size_t cap = m->cap ? m->cap : 8;
    while ((m->len + 1) * 2 > cap)
      cap *= 2;
    int rc = resize(m, cap);
    if (rc)
      return rc;
  }
  char *k = sg_strdup(key);
  if (!k)
    return SG_ENOMEM;
  size_t mask = m->cap - 1, i = h & mask;
  while (m->slots[i].key && m->slots[i].key != TOMBSTONE)
    i = (i + 1) & mask;
  if (!m->slots[i].key)
    m->used++;
  m->slots[i].key = k;
  m->slots[i].value = value;
  m->slots[i].hash = h;
  m->len++;
  return 0;
}

void *sg_map_del(sg_map_t *m, const char *key) {
  struct sg_map_slot_s *s = find(m, key, hash_key(m, key));
  if (!s)
    return NULL;
  void *v = s->value;
  sg_free(s->key);
  s->key = TOMBSTONE;
  s->value = NULL;
  m->len--;
  return v;
}

int sg_map_next(const sg_map_t *m, size_t *pos, const char **key,
                void **value) {
  for (; *pos < m->cap; (*pos)++) {
    const struct sg_map_slot_s *s = &m->slots[*pos];
    if (s->key && s->key != TOMBSTONE) {
      *key = s->key;
      *value = s->value;
      (*pos)++;
      return 1;
    }
  }
  return 0;
}
