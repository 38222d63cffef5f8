/*
 * lighthouse_load.c: load generator for bench/lighthouse.py.  Simulates N
 * replica groups against one lighthouse (ours or torchft's; both speak
 * torchft's LighthouseService) and prints one JSON object on stdout.
 *
 *   phase 1  heartbeats: every replica heartbeats every --hb-interval-ms,
 *            paced evenly, for the whole of phase 2 (as ManagerServer does)
 *   phase 2  --rounds quorum rounds: all N replicas are released together
 *            from a barrier, each sends one blocking Quorum call; per round
 *            we record the last send, the first and the last response
 *   phase 3  heartbeats stop; --hb-callers threads call Heartbeat back to
 *            back over --hb-channels channels for --hb-seconds (throughput
 *            and latency through our blocking client)
 *   phase 3b --raw-reps runs of --hb-seconds: --raw-depth Heartbeat streams
 *            kept in flight on each of --raw-conns raw nghttp2 connections,
 *            one thread each (what the server can answer)
 *
 * Replicas are spread round-robin over --channels sg_rpc_channel_t
 * connections for Quorum calls (each stays well under the servers'
 * concurrent stream limits) and --bg-channels others for heartbeats.  One
 * thread per replica, because sg_rpc_channel_call blocks.
 * With --server-pid the server's VmRSS and CPU time are sampled between
 * phases.  With --server-metrics 1 (stepguard's lighthouse only) the
 * server's own decision time is read from GET /metrics before the first
 * round and after each: a round that issued exactly one quorum adds one
 * observation to stepguard_lighthouse_decision_seconds, so the difference
 * of its _sum is that quorum's decision time, on the server's clock.
 * Every other time is CLOCK_MONOTONIC, taken in this process.
 */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <nghttp2/nghttp2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "stepguard/base.h"
#include "stepguard/rpc_client.h"
#include "torchft.pb-c.h"

#define QUORUM_PATH "/torchft.LighthouseService/Quorum"
#define HEARTBEAT_PATH "/torchft.LighthouseService/Heartbeat"
#define THREAD_STACK (256u << 10)
#define MAX_CHANNELS 256
#define RAW_MAX_DEPTH 256
#define MAX_REPS 9
#define GRPC_PREFIX 5 /* compressed flag + 32-bit length */

typedef struct opts_s {
  const char *target;
  int replicas;
  int rounds;
  int channels;    /* for Quorum calls */
  int bg_channels; /* for background heartbeats, one thread each */
  int hb_interval_ms;
  int round_gap_ms;   /* pause between rounds (a "training step") */
  int warmup_ms;      /* heartbeats before the first round */
  int hb_callers;     /* phase 3 */
  int hb_channels;    /* phase 3 */
  double hb_seconds;  /* phase 3; 0 skips it */
  int raw_conns;      /* phase 3b; 0 skips it */
  int raw_depth;      /* phase 3b: streams in flight per connection */
  int raw_reps;       /* phase 3b: repetitions; the median is reported */
  int server_pid;     /* 0: no /proc sampling */
  int server_metrics; /* read the decision histogram from GET /metrics */
  int quorum_timeout_s;
  double steady_seconds;  /* steady mode (only it runs); 0: the phases */
  double steady_warmup_s; /* steady mode: rounds before the measurement */
  int steady_gap_us;      /* steady mode: a step's work between quorums */
} opts_t;

typedef struct replica_s {
  char id[64];
  char address[48];
  char store_address[32];
  sg_rpc_channel_t *ch;
  int64_t t_send;    /* this round: just before sg_rpc_channel_call */
  int64_t t_recv;    /* this round: just after it returned */
  int rc;            /* this round's call result */
  int ok;            /* response has N participants including us */
  int64_t quorum_id; /* from the response */
  atomic_llong step; /* steady mode: the step it is asking for */
  size_t resp_len;
} replica_t;

typedef struct bench_s {
  opts_t o;
  replica_t *r;
  sg_rpc_channel_t *ch[MAX_CHANNELS];  /* Quorum calls */
  sg_rpc_channel_t *bch[MAX_CHANNELS]; /* background heartbeats */
  pthread_barrier_t start, end;
  int round;       /* written by main between barriers */
  atomic_int stop; /* quorum threads exit at the next start barrier */
  /* steady mode */
  atomic_llong steady_last; /* steady mode: the last step every replica asks */
  atomic_ullong steady_calls, steady_failed, steady_bad;
  /* background heartbeats */
  atomic_int hb_stop;
  pthread_mutex_t mu;
  uint64_t hb_sent, hb_err;
  int64_t hb_late_max_ns; /* worst lag behind the pacing schedule */
  /* phase 3 */
  atomic_int hammer_go, hammer_stop;
  sg_rpc_channel_t *hch[MAX_CHANNELS];
} bench_t;

static int64_t now_ns(void) { return sg_now_ns(); }

static void sleep_until(int64_t t) {
  int64_t d = t - now_ns();
  if (d <= 0)
    return;
  struct timespec ts = {(time_t)(d / 1000000000), (long)(d % 1000000000)};
  nanosleep(&ts, NULL);
}

/* ---- protobuf ------------------------------------------------------------ */

static int read_varint(const uint8_t **p, const uint8_t *e, uint64_t *v) {
  uint64_t x = 0;
  for (int s = 0; s < 64 && *p < e; s += 7) {
    uint8_t b = *(*p)++;
    x |= (uint64_t)(b & 0x7f) << s;
    if (!(b & 0x80)) {
      *v = x;
      return 0;
    }
  }
  return -1;
}

/* skip_field: skip one field of wire type `wt`; -1 on malformed input. */
static int skip_field(const uint8_t **p, const uint8_t *e, unsigned wt) {
  uint64_t v;
  switch (wt) {
  case 0:
    return read_varint(p, e, &v);
  case 1:
    if (e - *p < 8)
      return -1;
    *p += 8;
    return 0;
  case 2:
    if (read_varint(p, e, &v) || v > (uint64_t)(e - *p))
      return -1;
    *p += v;
    return 0;
  case 5:
    if (e - *p < 4)
      return -1;
    *p += 4;
    return 0;
  default:
    return -1;
  }
}

/*
 * scan_member_id: the replica_id (field 1) of one QuorumMember, without
 * decoding the rest.  Cheap on purpose: a full decode of N responses of N
 * members each would make the client, not the server, the bottleneck.
 */
static int scan_member_id(const uint8_t *p, const uint8_t *e,
                          const uint8_t **id, size_t *id_len) {
  while (p < e) {
    uint64_t key, len;
    if (read_varint(&p, e, &key))
      return -1;
    if (key == 0x0a) {
      if (read_varint(&p, e, &len) || len > (uint64_t)(e - p))
        return -1;
      *id = p;
      *id_len = len;
      return 0;
    }
    if (skip_field(&p, e, key & 7))
      return -1;
  }
  *id = p;
  *id_len = 0;
  return 0;
}

/*
 * check_response: walk LighthouseQuorumResponse{quorum{quorum_id,
 * participants[]}}; count participants and look for `self`.  Returns 0
 * when the quorum has `want` participants including `self`.
 */
static int check_response(const uint8_t *p, size_t n, const char *self,
                          int want, int64_t *quorum_id) {
  const uint8_t *e = p + n, *q = NULL, *qe = NULL;
  while (p < e) {
    uint64_t key, len;
    if (read_varint(&p, e, &key))
      return -1;
    if (key == 0x0a) {
      if (read_varint(&p, e, &len) || len > (uint64_t)(e - p))
        return -1;
      q = p;
      qe = p + len;
      p += len;
    } else if (skip_field(&p, e, key & 7)) {
      return -1;
    }
  }
  if (!q)
    return -1;
  int count = 0, found = 0;
  size_t self_len = strlen(self);
  while (q < qe) {
    uint64_t key, v;
    if (read_varint(&q, qe, &key))
      return -1;
    if (key == 0x08) {
      if (read_varint(&q, qe, &v))
        return -1;
      *quorum_id = (int64_t)v;
    } else if (key == 0x12) {
      if (read_varint(&q, qe, &v) || v > (uint64_t)(qe - q))
        return -1;
      const uint8_t *id;
      size_t id_len;
      if (scan_member_id(q, q + v, &id, &id_len))
        return -1;
      if (id_len == self_len && !memcmp(id, self, self_len))
        found = 1;
      count++;
      q += v;
    } else if (skip_field(&q, qe, key & 7)) {
      return -1;
    }
  }
  return count == want && found ? 0 : -1;
}

static uint8_t *pack_heartbeat(const char *id, size_t *len) {
  Torchft__LighthouseHeartbeatRequest h =
      TORCHFT__LIGHTHOUSE_HEARTBEAT_REQUEST__INIT;
  h.replica_id = (char *)id;
  *len = torchft__lighthouse_heartbeat_request__get_packed_size(&h);
  uint8_t *b = malloc(*len ? *len : 1);
  if (b)
    torchft__lighthouse_heartbeat_request__pack(&h, b);
  return b;
}

static uint8_t *pack_quorum(const replica_t *r, int64_t step, size_t *len) {
  Torchft__QuorumMember m = TORCHFT__QUORUM_MEMBER__INIT;
  m.replica_id = (char *)r->id;
  m.address = (char *)r->address;
  m.store_address = (char *)r->store_address;
  m.data = (char *)"";
  m.step = step;
  m.world_size = 8;
  Torchft__LighthouseQuorumRequest q = TORCHFT__LIGHTHOUSE_QUORUM_REQUEST__INIT;
  q.requester = &m;
  *len = torchft__lighthouse_quorum_request__get_packed_size(&q);
  uint8_t *b = malloc(*len);
  if (b)
    torchft__lighthouse_quorum_request__pack(&q, b);
  return b;
}

/* ---- server sampling ------------------------------------------------------
 */

static long proc_rss_kb(int pid) {
  char path[64], line[256];
  long kb = -1;
  snprintf(path, sizeof path, "/proc/%d/status", pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) {
      kb = strtol(line + 6, NULL, 10);
      break;
    }
  fclose(f);
  return kb;
}

/* proc_cpu_s: utime + stime of `pid`, all threads, in seconds. */
static double proc_cpu_s(int pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')'); /* comm may contain spaces */
  if (!p)
    return -1;
  unsigned long ut = 0, st = 0;
  /* after ')': state(3) ... utime(14) stime(15) */
  if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut,
             &st) != 2)
    return -1;
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double self_cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

/* ---- phase 1: paced background heartbeats ---------------------------------
 */

typedef struct hb_arg_s {
  bench_t *b;
  int chan;
} hb_arg_t;

/*
 * hb_main: heartbeat every replica on channel `chan` once per interval,
 * spread evenly over the interval; falls behind (and records how far) when
 * calls are slower than the schedule.
 */
static void *hb_main(void *arg) {
  hb_arg_t *a = arg;
  bench_t *b = a->b;
  int n = b->o.replicas, C = b->o.bg_channels, mine = 0;
  for (int i = a->chan; i < n; i += C)
    mine++;
  if (!mine)
    return NULL;
  int64_t step_ns = (int64_t)b->o.hb_interval_ms * 1000000 / mine;
  int64_t t = now_ns(), late_max = 0;
  uint64_t sent = 0, errs = 0;
  uint8_t **reqs = calloc((size_t)mine, sizeof(*reqs));
  size_t *lens = calloc((size_t)mine, sizeof(*lens));
  for (int k = 0, i = a->chan; i < n; i += C, k++)
    reqs[k] = pack_heartbeat(b->r[i].id, &lens[k]);
  for (int k = 0; !b->hb_stop; k = (k + 1) % mine, t += step_ns) {
    sleep_until(t);
    int64_t late = now_ns() - t;
    if (late > late_max)
      late_max = late;
    uint8_t *resp = NULL;
    size_t rl = 0;
    sg_err_t err;
    int rc =
        sg_rpc_channel_call(b->bch[a->chan], HEARTBEAT_PATH, reqs[k], lens[k],
                            sg_deadline_in_ms(5000), &resp, &rl, NULL, &err);
    sg_free(resp);
    sent++;
    if (rc)
      errs++;
  }
  pthread_mutex_lock(&b->mu);
  b->hb_sent += sent;
  b->hb_err += errs;
  if (late_max > b->hb_late_max_ns)
    b->hb_late_max_ns = late_max;
  pthread_mutex_unlock(&b->mu);
  for (int k = 0; k < mine; k++)
    free(reqs[k]);
  free(reqs);
  free(lens);
  return NULL;
}

/* ---- phase 2: quorum rounds ---------------------------------------------- */

typedef struct q_arg_s {
  bench_t *b;
  int idx;
} q_arg_t;

static void *quorum_main(void *arg) {
  q_arg_t *a = arg;
  bench_t *b = a->b;
  replica_t *r = &b->r[a->idx];
  for (;;) {
    pthread_barrier_wait(&b->start);
    if (b->stop)
      break;
    size_t len;
    uint8_t *req = pack_quorum(r, b->round, &len), *resp = NULL;
    size_t rl = 0;
    sg_err_t err;
    sg_deadline_t dl = sg_deadline_in_ms((int64_t)b->o.quorum_timeout_s * 1000);
    r->t_send = now_ns();
    r->rc = sg_rpc_channel_call(r->ch, QUORUM_PATH, req, len, dl, &resp, &rl,
                                NULL, &err);
    r->t_recv = now_ns();
    r->resp_len = rl;
    r->ok = !r->rc &&
            !check_response(resp, rl, r->id, b->o.replicas, &r->quorum_id);
    if (r->rc && a->idx < 3)
      fprintf(stderr, "lighthouse_load: %s: Quorum: %s (%s)\n", r->id,
              sg_strerror(r->rc), err.msg);
    sg_free(resp);
    free(req);
    pthread_barrier_wait(&b->end);
  }
  return NULL;
}

/* ---- steady mode: lockstep quorums, as training steps ask --------------- */

/*
 * task_sample: the server's time on CPU (ns, the first field of
 * /proc/PID/task/TID/schedstat) and its context switches (voluntary +
 * involuntary, from .../status), summed over every thread it has now.
 * Returns 0, or -1 when the process is gone.
 */
typedef struct task_sample_s {
  uint64_t cpu_ns;
  uint64_t ctxsw;
  int threads;
} task_sample_t;

static int task_sample(int pid, task_sample_t *out) {
  char path[96], line[256];
  memset(out, 0, sizeof *out);
  snprintf(path, sizeof path, "/proc/%d/task", pid);
  DIR *d = opendir(path);
  if (!d)
    return -1;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9')
      continue;
    snprintf(path, sizeof path, "/proc/%d/task/%.16s/schedstat", pid,
             e->d_name);
    FILE *f = fopen(path, "r");
    if (!f)
      continue; /* the thread exited meanwhile */
    unsigned long long ns = 0;
    if (fscanf(f, "%llu", &ns) == 1)
      out->cpu_ns += ns;
    fclose(f);
    snprintf(path, sizeof path, "/proc/%d/task/%.16s/status", pid, e->d_name);
    f = fopen(path, "r");
    if (!f)
      continue;
    while (fgets(line, sizeof line, f)) {
      if (!strncmp(line, "voluntary_ctxt_switches:", 24))
        out->ctxsw += strtoull(line + 24, NULL, 10);
      else if (!strncmp(line, "nonvoluntary_ctxt_switches:", 27))
        out->ctxsw += strtoull(line + 27, NULL, 10);
    }
    fclose(f);
    out->threads++;
  }
  closedir(d);
  return 0;
}

/*
 * steady_main: one replica asks for a quorum again as soon as it has its
 * answer, step after step, as a training loop does.  With min_replicas N
 * every quorum needs all N, so the replicas move in lockstep without a
 * barrier: every member of the previous quorum asks again and the
 * lighthouse answers at once (the fast quorum).  --steady-gap-us stands
 * for the step's own work between two quorums (the lighthouse idles).
 * Every replica stops after the same step (steady_last), so none is left
 * waiting for a quorum its peers no longer ask for.
 */
static void *steady_main(void *arg) {
  q_arg_t *a = arg;
  bench_t *b = a->b;
  replica_t *r = &b->r[a->idx];
  for (int64_t step = 0; step <= b->steady_last; step++) {
    r->step = step;
    size_t len;
    uint8_t *req = pack_quorum(r, step, &len), *resp = NULL;
    size_t rl = 0;
    sg_err_t err;
    sg_deadline_t dl = sg_deadline_in_ms((int64_t)b->o.quorum_timeout_s * 1000);
    int rc = sg_rpc_channel_call(r->ch, QUORUM_PATH, req, len, dl, &resp, &rl,
                                 NULL, &err);
    free(req);
    if (rc) {
      b->steady_failed++;
      fprintf(stderr, "lighthouse_load: %s: Quorum: %s (%s)\n", r->id,
              sg_strerror(rc), err.msg);
      sg_free(resp);
      break; /* a peer left: the others cannot make quorums either */
    }
    int64_t qid;
    if (check_response(resp, rl, r->id, b->o.replicas, &qid))
      b->steady_bad++;
    sg_free(resp);
    b->steady_calls++;
    if (b->o.steady_gap_us) /* the step's forward and backward */
      sleep_until(now_ns() + (int64_t)b->o.steady_gap_us * 1000);
  }
  return NULL;
}

/*
 * run_steady: N replicas in lockstep for --steady-seconds after
 * --steady-warmup-s, heartbeats paced as in phase 1; prints one JSON
 * object with the server's CPU and context switches per Quorum request.
 * Returns 0, 1 on setup failure, 3 when calls failed or answers were wrong.
 */
static int run_steady(bench_t *b, pthread_attr_t *attr) {
  const opts_t *o = &b->o;
  int N = o->replicas, nhb = o->bg_channels;
  b->steady_last = INT64_MAX;
  pthread_t hb_t[MAX_CHANNELS], qt[MAX_CHANNELS];
  hb_arg_t hb_a[MAX_CHANNELS];
  q_arg_t qa[MAX_CHANNELS];
  for (int c = 0; c < nhb; c++) {
    hb_a[c] = (hb_arg_t){b, c};
    pthread_create(&hb_t[c], attr, hb_main, &hb_a[c]);
  }
  for (int i = 0; i < N; i++) {
    qa[i] = (q_arg_t){b, i};
    pthread_create(&qt[i], attr, steady_main, &qa[i]);
  }
  sleep_until(now_ns() + (int64_t)(o->steady_warmup_s * 1e9));
  task_sample_t s0 = {0}, s1 = {0};
  int sampled = o->server_pid && task_sample(o->server_pid, &s0) == 0;
  unsigned long long c0 = b->steady_calls;
  double cli0 = self_cpu_s();
  int64_t t0 = now_ns();
  sleep_until(t0 + (int64_t)(o->steady_seconds * 1e9));
  sampled = sampled && task_sample(o->server_pid, &s1) == 0;
  unsigned long long c1 = b->steady_calls;
  int64_t t1 = now_ns();
  double cli1 = self_cpu_s();
  /* every replica is at most one step ahead of the slowest: all of them can
   * still complete the step after the furthest one's */
  long long last = 0;
  for (int i = 0; i < N; i++)
    if (b->r[i].step > last)
      last = b->r[i].step;
  b->steady_last = last + 1;
  b->hb_stop = 1;
  for (int i = 0; i < N; i++)
    pthread_join(qt[i], NULL);
  for (int c = 0; c < nhb; c++)
    pthread_join(hb_t[c], NULL);
  unsigned long long calls = c1 - c0;
  double secs = (double)(t1 - t0) / 1e9;
  double cpu_us = sampled && calls
                      ? (double)(s1.cpu_ns - s0.cpu_ns) / 1e3 / (double)calls
                      : -1.0;
  double ctxsw =
      sampled && calls ? (double)(s1.ctxsw - s0.ctxsw) / (double)calls : -1.0;
  printf("{\n  \"mode\": \"steady\",\n  \"replicas\": %d,\n", N);
  printf("  \"gap_us\": %d,\n", o->steady_gap_us);
  printf("  \"seconds\": %.3f,\n  \"requests\": %llu,\n", secs, calls);
  printf("  \"requests_per_s\": %.1f,\n", calls / secs);
  printf("  \"server_cpu_us_per_request\": %.2f,\n", cpu_us);
  printf("  \"server_ctxsw_per_request\": %.3f,\n", ctxsw);
  printf("  \"server_threads\": %d,\n", s1.threads);
  printf("  \"client_cpu_us_per_request\": %.2f,\n",
         calls ? (cli1 - cli0) * 1e6 / (double)calls : -1.0);
  printf("  \"heartbeats\": {\"sent\": %" PRIu64 ", \"errors\": %" PRIu64
         "},\n",
         b->hb_sent, b->hb_err);
  printf("  \"failed_calls\": %llu,\n  \"bad_responses\": %llu\n}\n",
         (unsigned long long)b->steady_failed,
         (unsigned long long)b->steady_bad);
  return b->steady_failed || b->steady_bad || b->hb_err || !sampled ? 3 : 0;
}

/* ---- phase 3: heartbeat hammer ------------------------------------------- */

typedef struct ham_arg_s {
  bench_t *b;
  int idx;
  uint64_t calls, errs;
  uint32_t *lat_us; /* one per call, up to cap */
  size_t n_lat, cap;
} ham_arg_t;

static void *hammer_main(void *arg) {
  ham_arg_t *a = arg;
  bench_t *b = a->b;
  size_t len;
  uint8_t *req = pack_heartbeat(b->r[a->idx % b->o.replicas].id, &len);
  sg_rpc_channel_t *ch = b->hch[a->idx % b->o.hb_channels];
  while (!b->hammer_go)
    sched_yield();
  while (!b->hammer_stop) {
    uint8_t *resp = NULL;
    size_t rl = 0;
    sg_err_t err;
    int64_t t0 = now_ns();
    int rc =
        sg_rpc_channel_call(ch, HEARTBEAT_PATH, req, len,
                            sg_deadline_in_ms(5000), &resp, &rl, NULL, &err);
    int64_t t1 = now_ns();
    sg_free(resp);
    a->calls++;
    if (rc)
      a->errs++;
    if (a->n_lat < a->cap)
      a->lat_us[a->n_lat++] = (uint32_t)((t1 - t0) / 1000);
  }
  free(req);
  return NULL;
}

static int cmp_u32(const void *x, const void *y) {
  uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
  return a < b ? -1 : a > b;
}

/* ---- phase 3b: pipelined heartbeats on raw HTTP/2 -------------------------
 */

/*
 * The blocking channel costs the client more CPU per call than either
 * server spends answering it, and client and server share the machine's
 * cores.  To find what the server can answer, this phase keeps --raw-depth
 * Heartbeat streams in flight on each of --raw-conns connections from one
 * thread per connection, on nghttp2 directly: no hand-off between threads.
 */

typedef struct raw_conn_s {
  bench_t *b;
  int fd;
  nghttp2_session *h2;
  uint8_t body[GRPC_PREFIX + 128]; /* gRPC frame of the request */
  size_t body_len;
  int64_t start[RAW_MAX_DEPTH]; /* per slot: when its stream was submitted */
  int grpc_ok[RAW_MAX_DEPTH];   /* per slot: grpc-status 0 seen */
  uint64_t calls, errs;
  uint32_t *lat_us;
  size_t n_lat, cap;
  int inflight; /* streams submitted and not yet closed */
  int failed;
} raw_conn_t;

static ssize_t raw_body_read(nghttp2_session *h2, int32_t sid, uint8_t *buf,
                             size_t len, uint32_t *flags,
                             nghttp2_data_source *src, void *ud) {
  raw_conn_t *c = ud;
  size_t n = c->body_len <= len ? c->body_len : len; /* always all */
  memcpy(buf, c->body, n);
  *flags |= NGHTTP2_DATA_FLAG_EOF;
  return (ssize_t)n;
}

static int raw_submit(raw_conn_t *c, intptr_t slot) {
  static const char path[] = HEARTBEAT_PATH;
#define NV(n, v)                                                               \
  {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, sizeof(v) - 1,               \
   NGHTTP2_NV_FLAG_NONE}
  nghttp2_nv nv[] = {
      NV(":method", "POST"),
      NV(":scheme", "http"),
      NV(":path", path),
      NV(":authority", "lighthouse"),
      NV("content-type", "application/grpc"),
      NV("te", "trailers"),
  };
#undef NV
  nghttp2_data_provider dp = {{0}, raw_body_read};
  c->start[slot] = now_ns();
  c->grpc_ok[slot] = 0;
  int32_t sid = nghttp2_submit_request(c->h2, NULL, nv, sizeof nv / sizeof *nv,
                                       &dp, (void *)slot);
  if (sid < 0)
    return -1;
  c->inflight++;
  return 0;
}

static int raw_on_header(nghttp2_session *h2, const nghttp2_frame *f,
                         const uint8_t *name, size_t nlen, const uint8_t *val,
                         size_t vlen, uint8_t flags, void *ud) {
  raw_conn_t *c = ud;
  if (nlen == 11 && !memcmp(name, "grpc-status", 11) && vlen == 1 &&
      val[0] == '0') {
    intptr_t slot =
        (intptr_t)nghttp2_session_get_stream_user_data(h2, f->hd.stream_id);
    c->grpc_ok[slot] = 1;
  }
  return 0;
}

static int raw_on_close(nghttp2_session *h2, int32_t sid, uint32_t code,
                        void *ud) {
  raw_conn_t *c = ud;
  intptr_t slot = (intptr_t)nghttp2_session_get_stream_user_data(h2, sid);
  int64_t t = now_ns();
  c->inflight--;
  c->calls++;
  if (code || !c->grpc_ok[slot])
    c->errs++;
  if (c->n_lat < c->cap)
    c->lat_us[c->n_lat++] = (uint32_t)((t - c->start[slot]) / 1000);
  if (!c->b->hammer_stop && raw_submit(c, slot))
    c->failed = 1;
  return 0;
}

static int write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0)
      return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* raw_main: one connection's loop (blocking socket, one thread). */
static void *raw_main(void *arg) {
  raw_conn_t *c = arg;
  bench_t *b = c->b;
  uint8_t rbuf[65536];
  while (!b->hammer_go)
    sched_yield();
  for (intptr_t k = 0; k < b->o.raw_depth; k++)
    if (raw_submit(c, k))
      c->failed = 1;
  while (!c->failed && (nghttp2_session_want_read(c->h2) ||
                        nghttp2_session_want_write(c->h2))) {
    const uint8_t *out;
    ssize_t n;
    while ((n = nghttp2_session_mem_send(c->h2, &out)) > 0)
      if (write_all(c->fd, out, (size_t)n))
        c->failed = 1;
    if (b->hammer_stop && c->inflight == 0)
      break;
    ssize_t r = read(c->fd, rbuf, sizeof rbuf);
    if (r <= 0 || nghttp2_session_mem_recv(c->h2, rbuf, (size_t)r) < 0)
      c->failed = 1;
  }
  return NULL;
}

/* target_split: "http://host:port" -> host, port; -1 when malformed. */
static int target_split(const char *t, char *host, size_t cap, int *port) {
  if (!strncmp(t, "http://", 7))
    t += 7;
  const char *colon = strrchr(t, ':');
  if (!colon || (size_t)(colon - t) >= cap)
    return -1;
  memcpy(host, t, (size_t)(colon - t));
  host[colon - t] = 0;
  *port = atoi(colon + 1);
  return 0;
}

static int raw_open(bench_t *b, raw_conn_t *c, int idx) {
  c->fd = -1;
  char host[256];
  int port = 0;
  if (target_split(b->o.target, host, sizeof host, &port))
    return -1;
  sg_err_t err;
  if (sg_sock_connect(host, port, sg_deadline_in_ms(5000), &c->fd, &err)) {
    fprintf(stderr, "lighthouse_load: raw connect: %s\n", err.msg);
    return -1;
  }
  int fl = fcntl(c->fd, F_GETFL);
  fcntl(c->fd, F_SETFL, fl & ~O_NONBLOCK);
  c->b = b;
  size_t len;
  uint8_t *req = pack_heartbeat(b->r[idx % b->o.replicas].id, &len);
  if (!req || len > sizeof c->body - GRPC_PREFIX)
    return -1;
  c->body[0] = 0; /* uncompressed; then the length, big-endian */
  c->body[1] = (uint8_t)(len >> 24);
  c->body[2] = (uint8_t)(len >> 16);
  c->body[3] = (uint8_t)(len >> 8);
  c->body[4] = (uint8_t)len;
  memcpy(c->body + GRPC_PREFIX, req, len);
  c->body_len = GRPC_PREFIX + len;
  free(req);
  nghttp2_session_callbacks *cbs;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_on_header_callback(cbs, raw_on_header);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, raw_on_close);
  int rc = nghttp2_session_client_new(&c->h2, cbs, c);
  nghttp2_session_callbacks_del(cbs);
  if (rc)
    return -1;
  nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0}};
  nghttp2_submit_settings(c->h2, NGHTTP2_FLAG_NONE, iv, 1);
  c->cap = 1u << 20;
  c->lat_us = malloc(c->cap * sizeof(uint32_t));
  return c->lat_us ? 0 : -1;
}

typedef struct raw_result_s {
  uint64_t calls, errs;
  double secs, srv_cpu, cli_cpu;
  uint32_t p50, p99;
} raw_result_t;

/* cmp_raw_rate: order repetitions by calls/s. */
static int cmp_raw_rate(const void *x, const void *y) {
  const raw_result_t *a = x, *b = y;
  double ra = a->secs > 0 ? (double)a->calls / a->secs : 0;
  double rb = b->secs > 0 ? (double)b->calls / b->secs : 0;
  return ra < rb ? -1 : ra > rb;
}

static int run_raw(bench_t *b, raw_result_t *res) {
  int H = b->o.raw_conns;
  raw_conn_t *c = calloc((size_t)H, sizeof(*c));
  pthread_t *t = calloc((size_t)H, sizeof(*t));
  int rc = 0;
  b->hammer_go = 0;
  b->hammer_stop = 0;
  for (int j = 0; j < H; j++)
    if (raw_open(b, &c[j], j)) {
      for (int i = 0; i <= j; i++) {
        if (c[i].h2)
          nghttp2_session_del(c[i].h2);
        sg_sock_close(c[i].fd);
        free(c[i].lat_us);
      }
      free(c);
      free(t);
      return -1;
    }
  for (int j = 0; j < H; j++)
    pthread_create(&t[j], NULL, raw_main, &c[j]);
  double s0 = b->o.server_pid ? proc_cpu_s(b->o.server_pid) : -1;
  double c0 = self_cpu_s();
  int64_t t0 = now_ns();
  b->hammer_go = 1;
  sleep_until(t0 + (int64_t)(b->o.hb_seconds * 1e9));
  b->hammer_stop = 1;
  for (int j = 0; j < H; j++)
    pthread_join(t[j], NULL);
  res->secs = (double)(now_ns() - t0) / 1e9;
  res->cli_cpu = self_cpu_s() - c0;
  res->srv_cpu = b->o.server_pid ? proc_cpu_s(b->o.server_pid) - s0 : -1;
  size_t total = 0;
  for (int j = 0; j < H; j++) {
    res->calls += c[j].calls;
    res->errs += c[j].errs;
    total += c[j].n_lat;
    if (c[j].failed)
      rc = -1;
  }
  uint32_t *all = malloc((total ? total : 1) * sizeof(uint32_t));
  size_t m = 0;
  for (int j = 0; j < H; j++) {
    memcpy(all + m, c[j].lat_us, c[j].n_lat * sizeof(uint32_t));
    m += c[j].n_lat;
    free(c[j].lat_us);
    nghttp2_session_del(c[j].h2);
    sg_sock_close(c[j].fd);
  }
  qsort(all, m, sizeof(uint32_t), cmp_u32);
  if (m) {
    res->p50 = all[m / 2];
    res->p99 = all[(m * 99) / 100];
  }
  free(all);
  free(c);
  free(t);
  return rc;
}

/* ---- the server's decision histogram ------------------------------------ */

#define METRICS_MAX (1 << 20)
#define DECISION_METRIC "stepguard_lighthouse_decision_seconds"

/* metric_value: the value on the line "name value" of Prometheus text. */
static int metric_value(const char *text, const char *name, double *v) {
  size_t n = strlen(name);
  for (const char *p = text; (p = strstr(p, name)) != NULL; p += n) {
    if ((p == text || p[-1] == '\n') && p[n] == ' ') {
      *v = strtod(p + n + 1, NULL);
      return 0;
    }
  }
  return -1;
}

/*
 * read_decisions: GET /metrics over HTTP/1.1 (the lighthouse's port serves
 * both) and return the decision histogram's _sum and _count; -1 when the
 * server has no such metric (torchft) or did not answer within 5 s.
 */
static int read_decisions(const char *target, double *sum, double *count) {
  char host[256], *buf = NULL;
  int port = 0, fd = -1, rc = -1;
  sg_err_t err;
  if (target_split(target, host, sizeof host, &port) ||
      sg_sock_connect(host, port, sg_deadline_in_ms(5000), &fd, &err))
    return -1;
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  static const char req[] =
      "GET /metrics HTTP/1.1\r\nHost: lighthouse\r\nConnection: close\r\n\r\n";
  if (write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1))
    goto out;
  buf = malloc(METRICS_MAX + 1);
  size_t len = 0;
  ssize_t r;
  while (buf && len < METRICS_MAX &&
         (r = read(fd, buf + len, METRICS_MAX - len)) > 0)
    len += (size_t)r;
  if (!buf)
    goto out;
  buf[len] = 0;
  if (metric_value(buf, DECISION_METRIC "_sum", sum) == 0 &&
      metric_value(buf, DECISION_METRIC "_count", count) == 0)
    rc = 0;
out:
  free(buf);
  sg_sock_close(fd);
  return rc;
}

/* ---- main -----------------------------------------------------------------
 */

static void usage(void) {
  fprintf(
      stderr,
      "usage: lighthouse_load --target http://HOST:PORT --replicas N\n"
      "  [--rounds R] [--channels C] [--hb-interval-ms MS]\n"
      "  [--round-gap-ms MS] [--warmup-ms MS] [--hb-callers K]\n"
      "  [--hb-channels C] [--hb-seconds S] [--raw-conns H]\n"
      "  [--raw-depth D] [--raw-reps N] [--bg-channels C]\n"
      "  [--server-pid PID] [--server-metrics 0|1]\n"
      "  [--quorum-timeout-s S]\n"
      "  [--steady-seconds S [--steady-warmup-s S] [--steady-gap-us US]]\n");
}

static int parse(int argc, char **argv, opts_t *o) {
  *o = (opts_t){.rounds = 10,
                .channels = 64,
                .bg_channels = 16,
                .hb_interval_ms = 100,
                .round_gap_ms = 100,
                .warmup_ms = 500,
                .hb_callers = 64,
                .hb_channels = 8,
                .hb_seconds = 3.0,
                .raw_conns = 2,
                .raw_depth = 64,
                .raw_reps = 1,
                .quorum_timeout_s = 60,
                .steady_warmup_s = 0.5};
  for (int i = 1; i < argc; i++) {
    const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v)
      return -1;
    i++;
    if (!strcmp(k, "--target"))
      o->target = v;
    else if (!strcmp(k, "--replicas"))
      o->replicas = atoi(v);
    else if (!strcmp(k, "--rounds"))
      o->rounds = atoi(v);
    else if (!strcmp(k, "--channels"))
      o->channels = atoi(v);
    else if (!strcmp(k, "--bg-channels"))
      o->bg_channels = atoi(v);
    else if (!strcmp(k, "--hb-interval-ms"))
      o->hb_interval_ms = atoi(v);
    else if (!strcmp(k, "--round-gap-ms"))
      o->round_gap_ms = atoi(v);
    else if (!strcmp(k, "--warmup-ms"))
      o->warmup_ms = atoi(v);
    else if (!strcmp(k, "--hb-callers"))
      o->hb_callers = atoi(v);
    else if (!strcmp(k, "--hb-channels"))
      o->hb_channels = atoi(v);
    else if (!strcmp(k, "--hb-seconds"))
      o->hb_seconds = atof(v);
    else if (!strcmp(k, "--raw-conns"))
      o->raw_conns = atoi(v);
    else if (!strcmp(k, "--raw-depth"))
      o->raw_depth = atoi(v);
    else if (!strcmp(k, "--raw-reps"))
      o->raw_reps = atoi(v);
    else if (!strcmp(k, "--server-pid"))
      o->server_pid = atoi(v);
    else if (!strcmp(k, "--server-metrics"))
      o->server_metrics = atoi(v);
    else if (!strcmp(k, "--quorum-timeout-s"))
      o->quorum_timeout_s = atoi(v);
    else if (!strcmp(k, "--steady-seconds"))
      o->steady_seconds = atof(v);
    else if (!strcmp(k, "--steady-gap-us"))
      o->steady_gap_us = atoi(v);
    else if (!strcmp(k, "--steady-warmup-s"))
      o->steady_warmup_s = atof(v);
    else
      return -1;
  }
  if (!o->target || o->replicas < 1 || o->rounds < 1 || o->channels < 1 ||
      o->channels > MAX_CHANNELS || o->bg_channels < 1 ||
      o->bg_channels > MAX_CHANNELS || o->hb_channels < 1 ||
      o->hb_channels > MAX_CHANNELS || o->hb_callers < 1 ||
      o->hb_interval_ms < 1 || o->raw_conns < 0 ||
      o->raw_conns > MAX_CHANNELS || o->raw_depth < 1 ||
      o->raw_depth > RAW_MAX_DEPTH || o->raw_reps < 1 ||
      o->raw_reps > MAX_REPS || o->steady_seconds < 0 || o->steady_warmup_s < 0)
    return -1;
  if (o->steady_seconds > 0) { /* one connection per replica, as a manager */
    if (o->replicas > MAX_CHANNELS)
      return -1;
    o->channels = o->replicas;
  }
  if (o->channels > o->replicas)
    o->channels = o->replicas;
  if (o->bg_channels > o->replicas)
    o->bg_channels = o->replicas;
  return 0;
}

static int open_channel(const char *target, sg_rpc_channel_t **ch) {
  sg_rpc_channel_opts_t co = {0};
  sg_err_t err;
  co.target = target;
  co.connect_timeout_ms = 10000;
  int rc = sg_rpc_channel_new(&co, ch, &err);
  if (rc)
    fprintf(stderr, "lighthouse_load: connect %s: %s (%s)\n", target,
            sg_strerror(rc), err.msg);
  return rc;
}

static void print_i64_array(const char *name, const int64_t *v, int n) {
  printf("  \"%s\": [", name);
  for (int i = 0; i < n; i++)
    printf("%s%" PRId64, i ? ", " : "", v[i]);
  printf("],\n");
}

int main(int argc, char **argv) {
  bench_t b;
  memset(&b, 0, sizeof b);
  if (parse(argc, argv, &b.o)) {
    usage();
    return 2;
  }
  const opts_t *o = &b.o;
  int N = o->replicas, R = o->rounds, rc = 1;
  pthread_mutex_init(&b.mu, NULL);

  b.r = calloc((size_t)N, sizeof(*b.r));
  for (int i = 0; i < N; i++) {
    /* torchft's shape: "{group}:{uuid4}", a manager URL, a TCPStore */
    snprintf(b.r[i].id, sizeof b.r[i].id,
             "bench_group_%04d:%08x-%04x-4%03x-8%03x-%012x", i,
             0x9e3779b9u * (unsigned)(i + 1), (unsigned)i & 0xffff,
             (unsigned)i & 0xfff, (unsigned)(i * 7) & 0xfff,
             (unsigned)(i * 2654435761u));
    snprintf(b.r[i].address, sizeof b.r[i].address,
             "http://trainer-%04d.cluster.local:29512", i);
    snprintf(b.r[i].store_address, sizeof b.r[i].store_address,
             "trainer-%04d:29500", i);
  }
  for (int c = 0; c < o->channels; c++)
    if (open_channel(o->target, &b.ch[c]))
      return 1;
  for (int c = 0; c < o->bg_channels; c++)
    if (open_channel(o->target, &b.bch[c]))
      return 1;
  for (int i = 0; i < N; i++)
    b.r[i].ch = b.ch[i % o->channels];

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, THREAD_STACK);

  if (o->steady_seconds > 0) {
    rc = run_steady(&b, &attr);
    for (int c = 0; c < o->channels; c++)
      sg_rpc_channel_free(b.ch[c]);
    for (int c = 0; c < o->bg_channels; c++)
      sg_rpc_channel_free(b.bch[c]);
    free(b.r);
    return rc;
  }

  long rss_start = o->server_pid ? proc_rss_kb(o->server_pid) : -1;

  /* phase 1 */
  pthread_t hb_t[MAX_CHANNELS];
  hb_arg_t hb_a[MAX_CHANNELS];
  for (int c = 0; c < o->bg_channels; c++) {
    hb_a[c] = (hb_arg_t){&b, c};
    pthread_create(&hb_t[c], &attr, hb_main, &hb_a[c]);
  }
  int64_t hb_t0 = now_ns();
  sleep_until(hb_t0 + (int64_t)o->warmup_ms * 1000000);

  /* phase 2 */
  pthread_barrier_init(&b.start, NULL, (unsigned)N + 1);
  pthread_barrier_init(&b.end, NULL, (unsigned)N + 1);
  pthread_t *qt = calloc((size_t)N, sizeof(*qt));
  q_arg_t *qa = calloc((size_t)N, sizeof(*qa));
  for (int i = 0; i < N; i++) {
    qa[i] = (q_arg_t){&b, i};
    if (pthread_create(&qt[i], &attr, quorum_main, &qa[i])) {
      fprintf(stderr, "lighthouse_load: pthread_create failed at %d\n", i);
      return 1;
    }
  }
  int64_t *decision = calloc((size_t)R, sizeof(int64_t));
  int64_t *delivery = calloc((size_t)R, sizeof(int64_t));
  int64_t *spread = calloc((size_t)R, sizeof(int64_t));
  int64_t *qids = calloc((size_t)R, sizeof(int64_t));
  int64_t *srv_dec = calloc((size_t)R, sizeof(int64_t));     /* ns; -1: none */
  int64_t *srv_nquorum = calloc((size_t)R, sizeof(int64_t)); /* per round */
  double dsum0 = 0, dcount0 = 0;
  int metrics_ok =
      o->server_metrics && read_decisions(o->target, &dsum0, &dcount0) == 0;
  if (o->server_metrics && !metrics_ok)
    fprintf(stderr, "lighthouse_load: no decision histogram on /metrics\n");
  int bad = 0, failed = 0;
  size_t resp_bytes = 0;
  double srv_cpu0 = o->server_pid ? proc_cpu_s(o->server_pid) : -1;
  int64_t rounds_t0 = now_ns();
  for (int k = 0; k < R; k++) {
    b.round = k;
    pthread_barrier_wait(&b.start);
    pthread_barrier_wait(&b.end);
    int64_t last_send = 0, first_send = INT64_MAX, first_recv = INT64_MAX,
            last_recv = 0;
    for (int i = 0; i < N; i++) {
      replica_t *r = &b.r[i];
      if (r->t_send > last_send)
        last_send = r->t_send;
      if (r->t_send < first_send)
        first_send = r->t_send;
      if (r->t_recv < first_recv)
        first_recv = r->t_recv;
      if (r->t_recv > last_recv)
        last_recv = r->t_recv;
      if (r->rc)
        failed++;
      else if (!r->ok)
        bad++;
      if (i == 0) {
        qids[k] = r->quorum_id;
        resp_bytes = r->resp_len;
      }
    }
    decision[k] = (first_recv - last_send) / 1000;
    delivery[k] = (last_recv - last_send) / 1000;
    spread[k] = (last_send - first_send) / 1000;
    srv_dec[k] = srv_nquorum[k] = -1;
    double dsum, dcount;
    if (metrics_ok && read_decisions(o->target, &dsum, &dcount) == 0) {
      srv_nquorum[k] = (int64_t)(dcount - dcount0);
      if (srv_nquorum[k] == 1) /* else the round's figure is not one value */
        srv_dec[k] = (int64_t)((dsum - dsum0) * 1e9 + 0.5);
      dsum0 = dsum;
      dcount0 = dcount;
    }
    sleep_until(now_ns() + (int64_t)o->round_gap_ms * 1000000);
  }
  int64_t rounds_t1 = now_ns();
  double srv_cpu1 = o->server_pid ? proc_cpu_s(o->server_pid) : -1;
  long rss_rounds = o->server_pid ? proc_rss_kb(o->server_pid) : -1;
  b.stop = 1;
  pthread_barrier_wait(&b.start);
  for (int i = 0; i < N; i++)
    pthread_join(qt[i], NULL);
  b.hb_stop = 1;
  for (int c = 0; c < o->bg_channels; c++)
    pthread_join(hb_t[c], NULL);
  double hb_secs = (double)(now_ns() - hb_t0) / 1e9;

  /* phase 3 */
  uint64_t ham_calls = 0, ham_errs = 0;
  double ham_secs = 0, ham_srv_cpu = -1, ham_cli_cpu = 0;
  uint32_t p50 = 0, p99 = 0;
  long rss_end = -1;
  if (o->hb_seconds > 0) {
    for (int c = 0; c < o->hb_channels; c++)
      if (open_channel(o->target, &b.hch[c]))
        return 1;
    int K = o->hb_callers;
    pthread_t *ht = calloc((size_t)K, sizeof(*ht));
    ham_arg_t *ha = calloc((size_t)K, sizeof(*ha));
    for (int j = 0; j < K; j++) {
      ha[j].b = &b;
      ha[j].idx = j;
      ha[j].cap = 1u << 18;
      ha[j].lat_us = malloc(ha[j].cap * sizeof(uint32_t));
      pthread_create(&ht[j], &attr, hammer_main, &ha[j]);
    }
    double s0 = o->server_pid ? proc_cpu_s(o->server_pid) : -1;
    double c0 = self_cpu_s();
    int64_t t0 = now_ns();
    b.hammer_go = 1;
    sleep_until(t0 + (int64_t)(o->hb_seconds * 1e9));
    b.hammer_stop = 1;
    for (int j = 0; j < K; j++)
      pthread_join(ht[j], NULL);
    ham_secs = (double)(now_ns() - t0) / 1e9;
    ham_cli_cpu = self_cpu_s() - c0;
    if (o->server_pid)
      ham_srv_cpu = proc_cpu_s(o->server_pid) - s0;
    size_t total = 0;
    for (int j = 0; j < K; j++) {
      ham_calls += ha[j].calls;
      ham_errs += ha[j].errs;
      total += ha[j].n_lat;
    }
    uint32_t *all = malloc((total ? total : 1) * sizeof(uint32_t));
    size_t m = 0;
    for (int j = 0; j < K; j++) {
      memcpy(all + m, ha[j].lat_us, ha[j].n_lat * sizeof(uint32_t));
      m += ha[j].n_lat;
      free(ha[j].lat_us);
    }
    qsort(all, m, sizeof(uint32_t), cmp_u32);
    if (m) {
      p50 = all[m / 2];
      p99 = all[(m * 99) / 100];
    }
    free(all);
    free(ht);
    free(ha);
    for (int c = 0; c < o->hb_channels; c++)
      sg_rpc_channel_free(b.hch[c]);
  }
  raw_result_t reps[MAX_REPS], raw = {0};
  int raw_failed = 0, nrep = 0;
  if (o->hb_seconds > 0 && o->raw_conns > 0)
    for (; nrep < o->raw_reps; nrep++) {
      memset(&reps[nrep], 0, sizeof reps[nrep]);
      raw_failed |= run_raw(&b, &reps[nrep]) != 0;
    }
  if (nrep) {
    raw_result_t sorted[MAX_REPS];
    memcpy(sorted, reps, (size_t)nrep * sizeof *reps);
    qsort(sorted, (size_t)nrep, sizeof *sorted, cmp_raw_rate);
    raw = sorted[nrep / 2];
  }
  rss_end = o->server_pid ? proc_rss_kb(o->server_pid) : -1;

  printf("{\n");
  printf("  \"replicas\": %d,\n  \"rounds\": %d,\n  \"channels\": %d,\n"
         "  \"bg_channels\": %d,\n",
         N, R, o->channels, o->bg_channels);
  print_i64_array("decision_us", decision, R);
  print_i64_array("delivery_us", delivery, R);
  print_i64_array("send_spread_us", spread, R);
  print_i64_array("quorum_ids", qids, R);
  if (o->server_metrics) {
    print_i64_array("server_decision_ns", srv_dec, R);
    print_i64_array("server_quorums_per_round", srv_nquorum, R);
  }
  printf("  \"response_bytes\": %zu,\n", resp_bytes);
  printf("  \"failed_calls\": %d,\n  \"bad_responses\": %d,\n", failed, bad);
  printf("  \"rounds_seconds\": %.3f,\n",
         (double)(rounds_t1 - rounds_t0) / 1e9);
  printf("  \"server_cpu_s_rounds\": %.3f,\n",
         srv_cpu0 >= 0 ? srv_cpu1 - srv_cpu0 : -1.0);
  printf("  \"bg_heartbeats\": {\"sent\": %" PRIu64 ", \"errors\": %" PRIu64
         ", \"per_s\": %.1f, \"target_per_s\": %.1f, \"late_max_ms\": %.1f},\n",
         b.hb_sent, b.hb_err, (double)b.hb_sent / hb_secs,
         N * 1000.0 / o->hb_interval_ms, (double)b.hb_late_max_ns / 1e6);
  printf("  \"hammer\": {\"callers\": %d, \"channels\": %d, \"seconds\": %.3f, "
         "\"calls\": %" PRIu64 ", \"errors\": %" PRIu64
         ", \"per_s\": %.1f, \"lat_p50_us\": %u, \"lat_p99_us\": %u, "
         "\"server_cpu_s\": %.3f, \"client_cpu_s\": %.3f},\n",
         o->hb_callers, o->hb_channels, ham_secs, ham_calls, ham_errs,
         ham_secs > 0 ? (double)ham_calls / ham_secs : 0.0, p50, p99,
         ham_srv_cpu, ham_cli_cpu);
  printf("  \"raw_hammer\": {\"conns\": %d, \"depth\": %d, \"seconds\": %.3f, "
         "\"calls\": %" PRIu64 ", \"errors\": %" PRIu64
         ", \"failed\": %d, \"per_s\": %.1f, \"lat_p50_us\": %u, "
         "\"lat_p99_us\": %u, \"server_cpu_s\": %.3f, "
         "\"client_cpu_s\": %.3f},\n",
         o->raw_conns, o->raw_depth, raw.secs, raw.calls, raw.errs, raw_failed,
         raw.secs > 0 ? (double)raw.calls / raw.secs : 0.0, raw.p50, raw.p99,
         raw.srv_cpu, raw.cli_cpu);
  printf("  \"raw_hammer_reps\": [");
  for (int k = 0; k < nrep; k++)
    printf("%s{\"per_s\": %.1f, \"server_cpu_s\": %.3f, \"calls\": %" PRIu64
           "}",
           k ? ", " : "", reps[k].calls / reps[k].secs, reps[k].srv_cpu,
           reps[k].calls);
  printf("],\n");
  printf("  \"server_rss_kb\": {\"start\": %ld, \"after_rounds\": %ld, "
         "\"end\": %ld}\n",
         rss_start, rss_rounds, rss_end);
  printf("}\n");
  rc = failed || bad || raw_failed || ham_errs || raw.errs ? 3 : 0;

  for (int c = 0; c < o->channels; c++)
    sg_rpc_channel_free(b.ch[c]);
  for (int c = 0; c < o->bg_channels; c++)
    sg_rpc_channel_free(b.bch[c]);
  free(decision);
  free(delivery);
  free(spread);
  free(qids);
  free(srv_dec);
  free(srv_nquorum);
  free(qt);
  free(qa);
  free(b.r);
  return rc;
}
