/*
 * lease.c: lease arithmetic, fencing rules, the quorum record and the few
 * JSON and base64 helpers the etcd client needs.  Pure: see lease.h.
 */
#include "lighthouse/lease.h"

#include <stdio.h>
#include <string.h>

#define MAX_RECORD_ID 1024

int64_t sg__lh_lease_deadline(int64_t sent_ns, int64_t ttl_s,
                              int64_t margin_ns) {
  if (ttl_s <= 0)
    return sent_ns;
  int64_t ttl_ns =
      ttl_s > INT64_MAX / 1000000000 ? INT64_MAX : ttl_s * 1000000000;
  if (margin_ns < 0)
    margin_ns = 0;
  if (margin_ns >= ttl_ns)
    return sent_ns;
  int64_t d = ttl_ns - margin_ns;
  return sent_ns > INT64_MAX - d ? INT64_MAX : sent_ns + d;
}

const char *sg__lh_role_name(sg__lh_role_t r) {
  switch (r) {
  case SG__LH_ROLE_SINGLE:
    return "single";
  case SG__LH_ROLE_FOLLOWER:
    return "follower";
  case SG__LH_ROLE_LEADER:
    return "leader";
  }
  return "?";
}

int sg__lh_fence_may_decide(const sg__lh_fence_t *f, int64_t now_ns) {
  if (f->role == SG__LH_ROLE_SINGLE)
    return 1;
  return f->role == SG__LH_ROLE_LEADER && f->ready && !f->write_in_flight &&
         now_ns < f->lease_deadline;
}

int sg__lh_fence_may_answer(const sg__lh_fence_t *f, int64_t qid,
                            int64_t now_ns) {
  if (f->role == SG__LH_ROLE_SINGLE)
    return 1;
  return f->role == SG__LH_ROLE_LEADER && f->ready &&
         now_ns < f->lease_deadline && f->confirmed_id >= qid;
}

/* ---- record -------------------------------------------------------------- */

int sg__lh_record_encode(int64_t qid, const char *const *ids, size_t n,
                         char **out) {
  *out = NULL;
  size_t need = 24;
  for (size_t i = 0; i < n; i++) {
    size_t l = strlen(ids[i]);
    if (l == 0 || l > MAX_RECORD_ID || strchr(ids[i], '\n'))
      return SG_EINVAL;
    need += l + 1;
  }
  char *s = sg_malloc(need);
  if (!s)
    return SG_ENOMEM;
  size_t off = (size_t)snprintf(s, need, "%lld\n", (long long)qid);
  for (size_t i = 0; i < n; i++) {
    size_t l = strlen(ids[i]);
    memcpy(s + off, ids[i], l);
    off += l;
    s[off++] = '\n';
  }
  s[off] = '\0';
  *out = s;
  return 0;
}

void sg__lh_record_ids_free(char **ids, size_t n) {
  for (size_t i = 0; ids && i < n; i++)
    sg_free(ids[i]);
  sg_free(ids);
}

int sg__lh_record_decode(const char *buf, size_t len, size_t max_ids,
                         int64_t *qid, char ***ids, size_t *n) {
  *qid = 0;
  *ids = NULL;
  *n = 0;
  size_t i = 0;
  int64_t v = 0;
  if (len == 0 || buf[0] < '0' || buf[0] > '9')
    return SG_EINVAL;
  while (i < len && buf[i] >= '0' && buf[i] <= '9') {
    if (v > (INT64_MAX - (buf[i] - '0')) / 10)
      return SG_EINVAL;
    v = v * 10 + (buf[i] - '0');
    i++;
  }
  if (i < len && buf[i] != '\n')
    return SG_EINVAL;
  i++;
  char **out = NULL;
  size_t cnt = 0, cap = 0;
  while (i < len) {
    const char *nl = memchr(buf + i, '\n', len - i);
    size_t l = nl ? (size_t)(nl - (buf + i)) : len - i;
    if (l > 0) {
      if (l > MAX_RECORD_ID || cnt == max_ids) {
        sg__lh_record_ids_free(out, cnt);
        return SG_EINVAL;
      }
      if (cnt == cap) {
        size_t ncap = cap ? cap * 2 : 8;
        char **g = sg_realloc(out, ncap * sizeof(*out));
        if (!g) {
          sg__lh_record_ids_free(out, cnt);
          return SG_ENOMEM;
        }
        out = g;
        cap = ncap;
      }
      out[cnt] = sg_malloc(l + 1);
      if (!out[cnt]) {
        sg__lh_record_ids_free(out, cnt);
        return SG_ENOMEM;
      }
      memcpy(out[cnt], buf + i, l);
      out[cnt][l] = '\0';
      cnt++;
    }
    i += l + 1;
  }
  *qid = v;
  *ids = out;
  *n = cnt;
  return 0;
}

/* ---- JSON ---------------------------------------------------------------- */

/* find_value: the first byte of the value of member `key`, or NULL. */
static const char *find_value(const char *js, size_t len, const char *key) {
  size_t kl = strlen(key);
  const char *end = js + len;
  for (const char *p = js; p + kl + 2 < end; p++) {
    if (*p != '"' || p[kl + 1] != '"' || memcmp(p + 1, key, kl) != 0)
      continue;
    const char *q = p + kl + 2;
    while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r'))
      q++;
    if (q >= end || *q != ':')
      continue;
    q++;
    while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r'))
      q++;
    return q < end ? q : NULL;
  }
  return NULL;
}

int sg__lh_json_int(const char *js, size_t len, const char *key, int64_t *v) {
  const char *end = js + len, *q = find_value(js, len, key);
  if (!q)
    return SG_ENOTFOUND;
  int quoted = *q == '"';
  q += quoted;
  int neg = q < end && *q == '-';
  q += neg;
  if (q >= end || *q < '0' || *q > '9')
    return SG_EINVAL;
  int64_t x = 0;
  while (q < end && *q >= '0' && *q <= '9') {
    if (x > (INT64_MAX - (*q - '0')) / 10)
      return SG_EINVAL;
    x = x * 10 + (*q - '0');
    q++;
  }
  if (quoted && (q >= end || *q != '"'))
    return SG_EINVAL;
  *v = neg ? -x : x;
  return 0;
}

int sg__lh_json_bool(const char *js, size_t len, const char *key) {
  const char *end = js + len, *q = find_value(js, len, key);
  if (!q)
    return 0;
  if (end - q >= 4 && memcmp(q, "true", 4) == 0)
    return 1;
  if (end - q >= 5 && memcmp(q, "false", 5) == 0)
    return 0;
  return SG_EINVAL;
}

int sg__lh_json_str(const char *js, size_t len, const char *key,
                    const char **start, size_t *slen) {
  const char *end = js + len, *q = find_value(js, len, key);
  if (!q)
    return SG_ENOTFOUND;
  if (*q != '"')
    return SG_EINVAL;
  q++;
  const char *e = memchr(q, '"', (size_t)(end - q));
  if (!e)
    return SG_EINVAL;
  *start = q;
  *slen = (size_t)(e - q);
  return 0;
}

/* ---- base64 -------------------------------------------------------------- */

static const char b64[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *sg__lh_b64_encode(const uint8_t *p, size_t n) {
  if (n > (SIZE_MAX - 1) / 4 * 3 - 3)
    return NULL;
  char *s = sg_malloc((n + 2) / 3 * 4 + 1), *o = s;
  if (!s)
    return NULL;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16;
    if (i + 1 < n)
      v |= (uint32_t)p[i + 1] << 8;
    if (i + 2 < n)
      v |= p[i + 2];
    *o++ = b64[(v >> 18) & 63];
    *o++ = b64[(v >> 12) & 63];
    *o++ = i + 1 < n ? b64[(v >> 6) & 63] : '=';
    *o++ = i + 2 < n ? b64[v & 63] : '=';
  }
  *o = '\0';
  return s;
}

static int b64_val(char c) {
  if (c >= 'A' && c <= 'Z')
    return c - 'A';
  if (c >= 'a' && c <= 'z')
    return c - 'a' + 26;
  if (c >= '0' && c <= '9')
    return c - '0' + 52;
  if (c == '+')
    return 62;
  if (c == '/')
    return 63;
  return -1;
}

int sg__lh_b64_decode(const char *s, size_t n, uint8_t **out, size_t *outlen) {
  *out = NULL;
  *outlen = 0;
  if (n % 4)
    return SG_EINVAL;
  uint8_t *o = sg_malloc(n / 4 * 3 + 1);
  if (!o)
    return SG_ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < n; i += 4) {
    int v[4];
    int pad = 0;
    for (int j = 0; j < 4; j++) {
      if (s[i + j] == '=' && i + 4 == n && j >= 2) {
        v[j] = 0;
        pad++;
      } else if (pad || (v[j] = b64_val(s[i + j])) < 0) {
        sg_free(o);
        return SG_EINVAL;
      }
    }
    uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 |
                 (uint32_t)v[2] << 6 | (uint32_t)v[3];
    o[k++] = (uint8_t)(x >> 16);
    if (pad < 2)
      o[k++] = (uint8_t)(x >> 8);
    if (pad < 1)
      o[k++] = (uint8_t)x;
  }
  o[k] = '\0';
  *out = o;
  *outlen = k;
  return 0;
}
