/*
 * etcd.c: etcd v3 calls over its JSON gateway with libcurl (etcd.h).
 *
 *   post        one POST to the current endpoint, rotating to the next on
 *               a transport failure or a 5xx, each try within timeout_ms
 *   calls       grant, keepalive, revoke, campaign, get, put_if: a JSON body
 *               built with snprintf (keys and values are base64), the
 *               answer read with lease.c's field scanner
 */
#include "lighthouse/etcd.h"

#include <stdio.h>
#include <string.h>

#include <curl/curl.h>

#include "lighthouse/lease.h"

#define MAX_ANSWER (8u << 20) /* a quorum record of 10,000 long ids fits */
#define MAX_ENDPOINTS 16

struct sg__etcd_s {
  CURL *curl;
  char *eps[MAX_ENDPOINTS]; /* owned, without trailing slash */
  size_t n, cur;
  char *buf; /* the last answer, NUL-terminated */
  size_t len, cap;
  int over; /* the answer exceeded MAX_ANSWER */
};

static size_t on_data(char *p, size_t size, size_t nmemb, void *ud) {
  sg__etcd_t *e = ud;
  size_t n = size * nmemb;
  if (e->len + n + 1 > MAX_ANSWER) {
    e->over = 1;
    return 0; /* makes curl fail the transfer */
  }
  if (e->len + n + 1 > e->cap) {
    size_t ncap = e->cap ? e->cap : 4096;
    while (ncap < e->len + n + 1)
      ncap *= 2;
    char *g = sg_realloc(e->buf, ncap);
    if (!g)
      return 0;
    e->buf = g;
    e->cap = ncap;
  }
  memcpy(e->buf + e->len, p, n);
  e->len += n;
  e->buf[e->len] = '\0';
  return n;
}

int sg__etcd_new(const char *endpoints, sg__etcd_t **out, sg_err_t *err) {
  *out = NULL;
  if (!endpoints || !endpoints[0])
    return sg_err_set(err, SG_EINVAL, "etcd: no endpoints");
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
    return sg_err_set(err, SG_ENOMEM, "etcd: curl_global_init failed");
  sg__etcd_t *e = sg_calloc(1, sizeof(*e));
  if (!e)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  const char *p = endpoints;
  int rc = 0;
  while (*p && !rc) {
    size_t l = strcspn(p, ",");
    if (l > 0) {
      if (e->n == MAX_ENDPOINTS) {
        rc = sg_err_set(err, SG_EINVAL, "etcd: more than %d endpoints",
                        MAX_ENDPOINTS);
        break;
      }
      int has = l > 7 && strncmp(p, "http://", 7) == 0;
      if (!has && memchr(p, ':', l) && l > 3 && memmem(p, l, "://", 3)) {
        rc = sg_err_set(err, SG_EINVAL,
                        "etcd: only http:// endpoints are supported");
        break;
      }
      while (l > 0 && p[l - 1] == '/')
        l--;
      char *s = sg_malloc(l + 8);
      if (!s) {
        rc = sg_err_set(err, SG_ENOMEM, "out of memory");
        break;
      }
      snprintf(s, l + 8, "%s%.*s", has ? "" : "http://", (int)l, p);
      e->eps[e->n++] = s;
    }
    p += l + (p[l] == ',');
  }
  if (!rc && e->n == 0)
    rc = sg_err_set(err, SG_EINVAL, "etcd: no endpoints in \"%s\"", endpoints);
  if (!rc && !(e->curl = curl_easy_init()))
    rc = sg_err_set(err, SG_ENOMEM, "etcd: curl_easy_init failed");
  if (rc) {
    sg__etcd_free(e);
    return rc;
  }
  *out = e;
  return 0;
}

void sg__etcd_free(sg__etcd_t *e) {
  if (!e)
    return;
  if (e->curl)
    curl_easy_cleanup(e->curl);
  for (size_t i = 0; i < e->n; i++)
    sg_free(e->eps[i]);
  sg_free(e->buf);
  sg_free(e);
}

const char *sg__etcd_endpoint(const sg__etcd_t *e) { return e->eps[e->cur]; }

/*
 * post: POST `body` to `path` and leave the answer in e->buf.  Tries each
 * endpoint once, starting at the current one; a transport failure or an
 * HTTP status >= 500 moves on (etcd answers 503 while it has no leader).
 */
static int post(sg__etcd_t *e, const char *path, const char *body,
                int64_t timeout_ms, sg_err_t *err) {
  int rc = SG_ECONNREFUSED;
  char what[256] = "no endpoint";
  for (size_t t = 0; t < e->n; t++) {
    char url[512];
    snprintf(url, sizeof(url), "%s%s", e->eps[e->cur], path);
    e->len = 0;
    e->over = 0;
    if (e->buf)
      e->buf[0] = '\0';
    CURL *c = e->curl;
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, e);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http");
    CURLcode cc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    if (cc == CURLE_OK && code == 200 && e->buf && e->len > 0)
      return 0;
    if (cc == CURLE_OK && code >= 400 && code < 500) {
      return sg_err_set(err, SG_EPEER, "etcd %s%s: HTTP %ld: %.200s",
                        e->eps[e->cur], path, code, e->buf ? e->buf : "");
    }
    if (e->over)
      return sg_err_set(err, SG_ETOOBIG, "etcd %s%s: answer over %u bytes",
                        e->eps[e->cur], path, MAX_ANSWER);
    if (cc == CURLE_OPERATION_TIMEDOUT)
      rc = SG_ETIMEDOUT;
    else if (cc == CURLE_OUT_OF_MEMORY)
      rc = SG_ENOMEM;
    else if (cc == CURLE_OK)
      rc = SG_EPROTO;
    else
      rc = SG_ECONNREFUSED;
    snprintf(what, sizeof(what), "%s: %s", e->eps[e->cur],
             cc != CURLE_OK ? curl_easy_strerror(cc) : "bad HTTP status");
    e->cur = (e->cur + 1) % e->n;
  }
  return sg_err_set(err, rc, "etcd unreachable (last: %s)", what);
}

int sg__etcd_grant(sg__etcd_t *e, int64_t ttl_s, int64_t timeout_ms,
                   int64_t *id, int64_t *granted_ttl_s, sg_err_t *err) {
  char body[64];
  snprintf(body, sizeof(body), "{\"TTL\":%lld}", (long long)ttl_s);
  int rc = post(e, "/v3/lease/grant", body, timeout_ms, err);
  if (rc)
    return rc;
  if (sg__lh_json_int(e->buf, e->len, "ID", id) ||
      sg__lh_json_int(e->buf, e->len, "TTL", granted_ttl_s) || *id == 0)
    return sg_err_set(err, SG_EPROTO, "etcd lease grant: %.200s", e->buf);
  return 0;
}

int sg__etcd_keepalive(sg__etcd_t *e, int64_t id, int64_t timeout_ms,
                       int64_t *ttl_s, sg_err_t *err) {
  char body[64];
  snprintf(body, sizeof(body), "{\"ID\":\"%lld\"}", (long long)id);
  int rc = post(e, "/v3/lease/keepalive", body, timeout_ms, err);
  if (rc)
    return rc;
  if (!strstr(e->buf, "\"result\""))
    return sg_err_set(err, SG_EPROTO, "etcd lease keepalive: %.200s", e->buf);
  *ttl_s = 0; /* omitted when the lease is gone */
  rc = sg__lh_json_int(e->buf, e->len, "TTL", ttl_s);
  if (rc && rc != SG_ENOTFOUND)
    return sg_err_set(err, SG_EPROTO, "etcd lease keepalive: %.200s", e->buf);
  return 0;
}

int sg__etcd_revoke(sg__etcd_t *e, int64_t id, int64_t timeout_ms,
                    sg_err_t *err) {
  char body[64];
  snprintf(body, sizeof(body), "{\"ID\":\"%lld\"}", (long long)id);
  return post(e, "/v3/lease/revoke", body, timeout_ms, err);
}

/* kv_value: the first kvs entry's value (decoded) and create revision. */
static int kv_value(sg__etcd_t *e, char **value, size_t *vlen,
                    int64_t *create_rev, sg_err_t *err) {
  if (value)
    *value = NULL;
  if (vlen)
    *vlen = 0;
  *create_rev = 0;
  const char *kvs = strstr(e->buf, "\"kvs\"");
  if (!kvs)
    return 0; /* absent */
  size_t rest = e->len - (size_t)(kvs - e->buf);
  if (sg__lh_json_int(kvs, rest, "create_revision", create_rev))
    return sg_err_set(err, SG_EPROTO, "etcd range: %.200s", e->buf);
  const char *v = NULL;
  size_t vl = 0;
  int rc = sg__lh_json_str(kvs, rest, "value", &v, &vl);
  if (rc == SG_ENOTFOUND) { /* an empty value is omitted */
    v = "";
    vl = 0;
  } else if (rc) {
    return sg_err_set(err, SG_EPROTO, "etcd range: %.200s", e->buf);
  }
  if (!value)
    return 0;
  uint8_t *d = NULL;
  size_t dl = 0;
  rc = sg__lh_b64_decode(v, vl, &d, &dl);
  if (rc)
    return sg_err_set(err, rc == SG_ENOMEM ? rc : SG_EPROTO,
                      "etcd range: bad value");
  *value = (char *)d;
  if (vlen)
    *vlen = dl;
  return 0;
}

int sg__etcd_campaign(sg__etcd_t *e, const char *key, const char *value,
                      int64_t lease, int64_t timeout_ms, int *won,
                      int64_t *create_rev, char **holder, sg_err_t *err) {
  char *k = sg__lh_b64_encode((const uint8_t *)key, strlen(key));
  char *v = sg__lh_b64_encode((const uint8_t *)value, strlen(value));
  char *body = NULL;
  int rc = SG_ENOMEM;
  *won = 0;
  *create_rev = 0;
  *holder = NULL;
  if (!k || !v)
    goto out;
  size_t need = strlen(k) * 3 + strlen(v) + 400;
  if (!(body = sg_malloc(need)))
    goto out;
  snprintf(body, need,
           "{\"compare\":[{\"key\":\"%s\",\"target\":\"CREATE\","
           "\"create_revision\":\"0\"}],"
           "\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\","
           "\"lease\":\"%lld\"}}],"
           "\"failure\":[{\"request_range\":{\"key\":\"%s\"}}]}",
           k, k, v, (long long)lease, k);
  rc = post(e, "/v3/kv/txn", body, timeout_ms, err);
  if (rc)
    goto out;
  int ok = sg__lh_json_bool(e->buf, e->len, "succeeded");
  if (ok < 0) {
    rc = sg_err_set(err, SG_EPROTO, "etcd txn: %.200s", e->buf);
    goto out;
  }
  if (ok) {
    /* the header's revision is the put's: the key's create revision */
    if (sg__lh_json_int(e->buf, e->len, "revision", create_rev) ||
        *create_rev <= 0)
      rc = sg_err_set(err, SG_EPROTO, "etcd txn: %.200s", e->buf);
    *won = rc == 0;
    goto out;
  }
  rc = kv_value(e, holder, NULL, create_rev, err);
out:
  if (rc == SG_ENOMEM && !err->msg[0])
    sg_err_set(err, rc, "out of memory");
  sg_free(k);
  sg_free(v);
  sg_free(body);
  return rc;
}

int sg__etcd_get(sg__etcd_t *e, const char *key, int64_t timeout_ms,
                 char **value, size_t *vlen, int64_t *create_rev,
                 sg_err_t *err) {
  char *k = sg__lh_b64_encode((const uint8_t *)key, strlen(key));
  if (!k)
    return sg_err_set(err, SG_ENOMEM, "out of memory");
  size_t need = strlen(k) + 32;
  char *body = sg_malloc(need);
  int rc = SG_ENOMEM;
  if (body) {
    snprintf(body, need, "{\"key\":\"%s\"}", k);
    rc = post(e, "/v3/kv/range", body, timeout_ms, err);
    if (!rc)
      rc = kv_value(e, value, vlen, create_rev, err);
  } else {
    sg_err_set(err, rc, "out of memory");
  }
  sg_free(k);
  sg_free(body);
  return rc;
}

int sg__etcd_put_if(sg__etcd_t *e, const char *cond_key, int64_t cond_rev,
                    const char *key, const char *value, int64_t timeout_ms,
                    int *ok, sg_err_t *err) {
  char *ck = sg__lh_b64_encode((const uint8_t *)cond_key, strlen(cond_key));
  char *k = sg__lh_b64_encode((const uint8_t *)key, strlen(key));
  char *v = sg__lh_b64_encode((const uint8_t *)value, strlen(value));
  char *body = NULL;
  int rc = SG_ENOMEM;
  *ok = 0;
  if (!ck || !k || !v)
    goto out;
  size_t need = strlen(ck) + strlen(k) + strlen(v) + 300;
  if (!(body = sg_malloc(need)))
    goto out;
  snprintf(body, need,
           "{\"compare\":[{\"key\":\"%s\",\"target\":\"CREATE\","
           "\"create_revision\":\"%lld\"}],"
           "\"success\":[{\"request_put\":{\"key\":\"%s\",\"value\":\"%s\"}}]}",
           ck, (long long)cond_rev, k, v);
  rc = post(e, "/v3/kv/txn", body, timeout_ms, err);
  if (rc)
    goto out;
  int s = sg__lh_json_bool(e->buf, e->len, "succeeded");
  if (s < 0)
    rc = sg_err_set(err, SG_EPROTO, "etcd txn: %.200s", e->buf);
  else
    *ok = s;
out:
  if (rc == SG_ENOMEM && !err->msg[0])
    sg_err_set(err, rc, "out of memory");
  sg_free(ck);
  sg_free(k);
  sg_free(v);
  sg_free(body);
  return rc;
}
