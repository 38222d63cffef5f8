/*
 * proxy.c: a follower lighthouse forwards Quorum and Heartbeat calls to the
 * leader and answers with what the leader answered.
 */
#include <stdio.h>
#include <string.h>

#include "lighthouse/server_int.h"
#include "rpc/client_async.h"
#include "rpc/grpc.h"

/* ---- followers forward to the leader --------------------------------------
 *
 * A follower sends each Quorum and Heartbeat call on to the leader over one
 * channel (the async call of src/rpc/client.c) and answers with what the
 * leader answered, so a client given this lighthouse's address alone
 * (torchft's) keeps working while another lighthouse leads.  The answer
 * is the leader's: fenced there.  What a proxy changes: the leader sees
 * the follower's connection, not the client's, so a client whose own
 * connection closes is found dead by its heartbeat timeout, not the
 * disconnect grace.
 */

#define PROXY_CONNECT_MS 200    /* the etcd thread dials the leader */
#define PROXY_RETRY_MS 1000     /* after a failed dial */
#define PROXY_RETRY_TICK_MS 100 /* a held Quorum call is forwarded again */

static void on_proxied(void *ud, int rc, int grpc_status, uint8_t *resp,
                       size_t resp_len, const char *msg) {
  struct proxied *p = ud;
  sg_lh_server_t *s = p->s;
  p->rc = rc;
  p->status = grpc_status;
  p->resp = resp;
  p->resp_len = resp_len;
  snprintf(p->msg, sizeof(p->msg), "%s", msg ? msg : "");
  pthread_mutex_lock(&s->proxy_mu);
  p->done_next = s->proxy_done;
  s->proxy_done = p;
  pthread_mutex_unlock(&s->proxy_mu);
  uv_async_send(&s->proxy_async); /* the channel is freed before the loop */
}

static void proxied_unlink(sg_lh_server_t *s, struct proxied *p) {
  if (p->prev)
    p->prev->next = p->next;
  else
    s->proxied = p->next;
  if (p->next)
    p->next->prev = p->prev;
  p->prev = p->next = NULL;
}

static void on_proxy_retry(uv_timer_t *t);

/* forward: send p's call to the leader over proxy_ch (mu held); 0, or
 * an error (then p is not linked anywhere). */
static int forward(sg_lh_server_t *s, struct proxied *p, const char *method,
                   const uint8_t *body, size_t len) {
  if (!s->proxy_ch)
    return SG_ECLOSED;
  p->next = s->proxied;
  p->prev = NULL;
  if (s->proxied)
    s->proxied->prev = p;
  s->proxied = p;
  sg_err_t e;
  sg_err_clear(&e);
  int rc = sg__rpc_channel_call_start(s->proxy_ch, method, body, len,
                                      sg_rpc_call_deadline(p->call), on_proxied,
                                      p, &e);
  if (rc) {
    proxied_unlink(s, p);
    return rc;
  }
  s->proxied_total++;
  return 0;
}

/* proxy_call: forward `call` to the leader (mu held).  1: it will be
 * answered from on_proxy_async; 0: not forwarded (no channel to a leader,
 * not a LighthouseService call, out of memory). */
int sg__lh_proxy_call(sg_lh_server_t *s, sg_rpc_call_t *call,
                      const char *method, const uint8_t *body, size_t len) {
  int quorum = strcmp(method, "/torchft.LighthouseService/Quorum") == 0;
  if (!quorum && strcmp(method, "/torchft.LighthouseService/Heartbeat") != 0)
    return 0;
  /* no leader to forward to: a Quorum call waits for one while etcd
   * answers us (an election is on), or answered within two lease TTLs (a
   * slow etcd call on a busy host is not a partition); cut off from etcd
   * longer we cannot know a leader, and the client had better try its
   * other addresses */
  int64_t now = sg_now_ns();
  int hold =
      quorum &&
      (s->etcd_ok || now - s->etcd_ok_ns < ms_to_ns(2000 * s->lease_ttl_s)) &&
      sg_rpc_call_deadline(call) - now > ms_to_ns(2 * PROXY_RETRY_TICK_MS);
  if (!s->proxy_ch && !hold)
    return 0;
  struct proxied *p = sg_calloc(1, sizeof(*p));
  if (!p)
    return 0;
  p->is_proxy = 1;
  p->s = s;
  p->call = call;
  if (forward(s, p, method, body, len) != 0) {
    if (!hold) {
      sg_free(p);
      return 0;
    }
    p->done_next = s->proxy_wait;
    s->proxy_wait = p;
    if (!uv_is_active((uv_handle_t *)&s->proxy_timer))
      uv_timer_start(&s->proxy_timer, on_proxy_retry, PROXY_RETRY_TICK_MS, 0);
  }
  sg_rpc_call_set_user(call, p);
  return 1;
}

/* on_proxy_retry: forward the held Quorum calls again, or handle them
 * here once this lighthouse leads. */
static void on_proxy_retry(uv_timer_t *t) {
  sg_lh_server_t *s = t->data;
  int64_t now = sg_now_ns();
  pthread_mutex_lock(&s->mu);
  struct proxied *list = s->proxy_wait, *keep = NULL;
  s->proxy_wait = NULL;
  while (list) {
    struct proxied *p = list;
    list = p->done_next;
    if (!p->call || s->closing) { /* cancelled meanwhile */
      sg_free(p);
      continue;
    }
    size_t len = 0;
    const uint8_t *body = sg_rpc_call_body(p->call, &len);
    const char *method = sg_rpc_call_method(p->call);
    if (s->fence.role == SG__LH_ROLE_LEADER) {
      sg_rpc_call_t *call = p->call;
      sg_rpc_call_set_user(call, NULL);
      sg_free(p);
      sg__lh_handle_quorum(s, call, body, len, now);
      continue;
    }
    if (sg_rpc_call_deadline(p->call) <= now ||
        (forward(s, p, method, body, len) != 0 &&
         sg_rpc_call_deadline(p->call) - now <=
             ms_to_ns(PROXY_RETRY_TICK_MS))) {
      sg_rpc_call_respond(p->call, SG_GRPC_UNAVAILABLE,
                          "not the leader, and no leader answered in time",
                          NULL, 0);
      sg_free(p);
      continue;
    }
    if (!p->prev && s->proxied != p) { /* not forwarded: wait on */
      p->done_next = keep;
      keep = p;
    }
  }
  s->proxy_wait = keep;
  if (keep && !s->closing)
    uv_timer_start(&s->proxy_timer, on_proxy_retry, PROXY_RETRY_TICK_MS, 0);
  pthread_mutex_unlock(&s->mu);
}

/* on_proxy_async: answer the forwarded calls the leader answered. */
void sg__lh_proxy_answer(uv_async_t *a) {
  sg_lh_server_t *s = a->data;
  pthread_mutex_lock(&s->proxy_mu);
  struct proxied *done = s->proxy_done;
  s->proxy_done = NULL;
  pthread_mutex_unlock(&s->proxy_mu);
  pthread_mutex_lock(&s->mu);
  while (done) {
    struct proxied *p = done;
    done = p->done_next;
    proxied_unlink(s, p);
    int again = p->call && !s->closing && p->rc != 0 &&
                (p->status < 0 || p->status == SG_GRPC_UNAVAILABLE) &&
                strcmp(sg_rpc_call_method(p->call),
                       "/torchft.LighthouseService/Quorum") == 0 &&
                sg_rpc_call_deadline(p->call) - sg_now_ns() >
                    ms_to_ns(2 * PROXY_RETRY_TICK_MS);
    if (again) {
      /* no leader answers now (it died, lost its lease, or none is
       * elected yet): hold the Quorum call and forward it again, to
       * whoever leads then, until its deadline; a client of one address
       * (torchft's, with quorum_retries=0) rides out the failover */
      sg_free(p->resp);
      p->resp = NULL;
      p->done_next = s->proxy_wait;
      s->proxy_wait = p;
      if (!uv_is_active((uv_handle_t *)&s->proxy_timer))
        uv_timer_start(&s->proxy_timer, on_proxy_retry, PROXY_RETRY_TICK_MS, 0);
      continue;
    }
    if (p->call && !s->closing) {
      if (p->rc == 0) {
        sg_rpc_call_respond(p->call, SG_GRPC_OK, NULL, p->resp, p->resp_len);
      } else if (p->status > 0) { /* the leader's own error */
        sg_rpc_call_respond(p->call, p->status, p->msg, NULL, 0);
      } else {
        char m[700];
        snprintf(m, sizeof(m),
                 "not the leader, and the leader %.100s did not "
                 "answer: %.500s",
                 s->leader_addr ? s->leader_addr : "(none)", p->msg);
        sg_rpc_call_respond(p->call, SG_GRPC_UNAVAILABLE, m, NULL, 0);
      }
    }
    sg_free(p->resp);
    sg_free(p);
  }
  pthread_mutex_unlock(&s->mu);
}

/* proxy_sync: on the etcd thread (mu held, released while dialing): keep
 * proxy_ch going to `want` (the leader's address; NULL: none, or we lead).
 * The old channel is freed outside mu: its calls in flight complete with
 * SG_EABORTED through on_proxied, while the loop still runs. */
void sg__lh_proxy_sync(sg_lh_server_t *s, const char *want) {
  if (want && s->address && strcmp(want, s->address) == 0)
    want = NULL; /* our own key: no proxy */
  int same = want ? (s->proxy_addr && strcmp(want, s->proxy_addr) == 0)
                  : !s->proxy_addr;
  if (same && (s->proxy_ch || !want || sg_now_ns() < s->proxy_retry_ns))
    return;
  sg_rpc_channel_t *old = s->proxy_ch, *ch = NULL;
  s->proxy_ch = NULL;
  sg_free(s->proxy_addr);
  s->proxy_addr = want ? sg_strdup(want) : NULL;
  char *addr = s->proxy_addr ? sg_strdup(s->proxy_addr) : NULL;
  pthread_mutex_unlock(&s->mu);
  if (old)
    sg_rpc_channel_free(old);
  if (addr) {
    sg_rpc_channel_opts_t co = {0};
    co.target = addr;
    co.connect_timeout_ms = PROXY_CONNECT_MS;
    co.auth_token = s->o.auth_token;
    co.fail_fast = 1;
    sg_err_t e;
    sg_err_clear(&e);
    if (sg_rpc_channel_new(&co, &ch, &e) != 0) {
      sg_log(SG_LOG_DEBUG, LOG, "cannot reach the leader %s to forward: %s",
             addr, e.msg);
      ch = NULL;
    }
  }
  pthread_mutex_lock(&s->mu);
  if (ch && !s->etcd_stop && s->proxy_addr && addr &&
      strcmp(s->proxy_addr, addr) == 0) {
    s->proxy_ch = ch;
    ch = NULL;
  } else {
    s->proxy_retry_ns = sg_now_ns() + ms_to_ns(PROXY_RETRY_MS);
  }
  sg_free(addr);
  if (ch) {
    pthread_mutex_unlock(&s->mu);
    sg_rpc_channel_free(ch);
    pthread_mutex_lock(&s->mu);
  }
}
