/*
 * cli.c: the stepguard-lighthouse program.  torchft's flags and defaults
 * (--bind, --min_replicas, --join_timeout_ms, --quorum_tick_ms,
 * --heartbeat_timeout_ms) plus ours.  Flags take "--name value" or
 * "--name=value", with '_' or '-' in names.  SIGINT and SIGTERM stop the
 * server cleanly.
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepguard/lighthouse.h"

#define TOKEN_MAX 4096

static const char usage[] =
    "usage: stepguard-lighthouse --min_replicas N [options]\n"
    "\n"
    "The stepguard lighthouse: decides quorums for fault-tolerant training\n"
    "and serves torchft's LighthouseService (gRPC) and a dashboard, /status\n"
    "and /metrics (HTTP/1.1) on one port.\n"
    "\n"
    "torchft's options:\n"
    "  --bind ADDR               address to bind (default [::]:29510)\n"
    "  --min_replicas N          minimum replicas for a quorum (required)\n"
    "  --join_timeout_ms MS      wait this long for heartbeating stragglers\n"
    "                            to join before issuing a quorum (60000)\n"
    "  --quorum_tick_ms MS       periodic re-check interval; decisions are\n"
    "                            also taken on every event (100)\n"
    "  --heartbeat_timeout_ms MS a replica silent this long is dead (5000)\n"
    "stepguard's options:\n"
    "  --disconnect_grace_ms MS  a replica whose last connection closed and\n"
    "                            that stays silent this long is dead (250)\n"
    "  --prune_after_ms MS       forget heartbeat records this old (600000)\n"
    "  --auth_token_file PATH    require 'authorization: Bearer <token>' on\n"
    "                            gRPC calls and mutating HTTP calls; also\n"
    "                            $STEPGUARD_AUTH_TOKEN\n"
    "  --quorum_id_file PATH     persist quorum ids so they keep growing\n"
    "                            across restarts (default: a floor taken\n"
    "                            from the wall clock, in us), and the step\n"
    "                            the job reached\n"
    "  --state_loss_wait_ms MS   a quorum whose members are all behind the\n"
    "                            step the job reached waits for a replica\n"
    "                            holding it, this long after one was last\n"
    "                            heard (60000); -1 until one is back, 0 not\n"
    "                            at all (torchft)\n"
    "  --hostname NAME           host name in the advertised address\n"
    "  --etcd ENDPOINTS          replicated lighthouses: elect a leader in\n"
    "                            etcd (http://h:p,http://h:p); only the\n"
    "                            leader decides, followers forward\n"
    "  --etcd_prefix P           the job's etcd keys (/stepguard/lighthouse)\n"
    "  --etcd_ttl_s S            the leader's lease TTL in etcd (2)\n"
    "  --max_replicas N          replica ids tracked at once (10000)\n"
    "  --max_connections N       open connections (4096)\n"
    "  --log_level LEVEL         error, warn, info, debug, trace (info)\n"
    "  --help, --version\n";

/* parse_i64: strict decimal, >= 0. */
static int parse_i64(const char *name, const char *v, int64_t *out) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < 0) {
    fprintf(stderr, "stepguard-lighthouse: --%s: invalid value '%s'\n", name,
            v);
    return -1;
  }
  *out = x;
  return 0;
}

/* read_token: the first line of `path`, trailing whitespace removed. */
static char *read_token(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "stepguard-lighthouse: cannot read %s: %s\n", path,
            strerror(errno));
    return NULL;
  }
  char *buf = malloc(TOKEN_MAX + 1);
  size_t n = buf ? fread(buf, 1, TOKEN_MAX, f) : 0;
  fclose(f);
  if (!buf)
    return NULL;
  buf[n] = '\0';
  char *nl = strpbrk(buf, "\r\n");
  if (nl)
    *nl = '\0';
  n = strlen(buf);
  while (n && isspace((unsigned char)buf[n - 1]))
    buf[--n] = '\0';
  if (n == 0) {
    fprintf(stderr, "stepguard-lighthouse: %s holds no token\n", path);
    free(buf);
    return NULL;
  }
  return buf;
}

/* name_is: compare a flag name, treating '-' and '_' alike. */
static int name_is(const char *got, size_t len, const char *want) {
  if (strlen(want) != len)
    return 0;
  for (size_t i = 0; i < len; i++) {
    char a = got[i] == '-' ? '_' : got[i];
    if (a != want[i])
      return 0;
  }
  return 1;
}

int sg_lh_main(int argc, char **argv) {
  sg_lh_opts_t o;
  sg_lh_opts_init(&o);
  char *token = NULL;
  int status = 2;
  int64_t v;
  const char *env_token = getenv("STEPGUARD_AUTH_TOKEN");

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(usage, stdout);
      status = 0;
      goto out;
    }
    if (strcmp(a, "--version") == 0) {
      printf("stepguard-lighthouse %s\n", sg_version());
      status = 0;
      goto out;
    }
    if (strncmp(a, "--", 2) != 0) {
      fprintf(stderr, "stepguard-lighthouse: unexpected argument '%s'\n", a);
      goto usage_error;
    }
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
    const char *val = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
    if (!val) {
      fprintf(stderr, "stepguard-lighthouse: --%.*s needs a value\n", (int)nlen,
              name);
      goto usage_error;
    }
#define INT_FLAG(flag, field)                                                  \
  if (name_is(name, nlen, flag)) {                                             \
    if (parse_i64(flag, val, &v))                                              \
      goto usage_error;                                                        \
    o.field = v;                                                               \
    continue;                                                                  \
  }
    INT_FLAG("min_replicas", min_replicas)
    INT_FLAG("join_timeout_ms", join_timeout_ms)
    INT_FLAG("quorum_tick_ms", quorum_tick_ms)
    INT_FLAG("heartbeat_timeout_ms", heartbeat_timeout_ms)
    INT_FLAG("disconnect_grace_ms", disconnect_grace_ms)
    INT_FLAG("prune_after_ms", prune_after_ms)
    INT_FLAG("max_replicas", max_replicas)
    INT_FLAG("max_connections", max_connections)
    INT_FLAG("etcd_ttl_s", etcd_ttl_s)
#undef INT_FLAG
    if (name_is(name, nlen, "state_loss_wait_ms")) {
      if (strcmp(val, "-1") == 0)
        o.state_loss_wait_ms = -1;
      else if (parse_i64("state_loss_wait_ms", val, &o.state_loss_wait_ms))
        goto usage_error;
      continue;
    }
    if (name_is(name, nlen, "bind")) {
      o.bind = val;
    } else if (name_is(name, nlen, "hostname")) {
      o.hostname = val;
    } else if (name_is(name, nlen, "quorum_id_file")) {
      o.quorum_id_file = val;
    } else if (name_is(name, nlen, "etcd")) {
      o.etcd = val;
    } else if (name_is(name, nlen, "etcd_prefix")) {
      o.etcd_prefix = val;
    } else if (name_is(name, nlen, "auth_token_file")) {
      free(token);
      if (!(token = read_token(val)))
        goto out;
    } else if (name_is(name, nlen, "log_level")) {
      int lv = sg_log_level_parse(val);
      if (lv < 0) {
        fprintf(stderr, "stepguard-lighthouse: unknown log level '%s'\n", val);
        goto usage_error;
      }
      sg_log_set_level((sg_log_level_t)lv);
    } else {
      fprintf(stderr, "stepguard-lighthouse: unknown option '--%.*s'\n",
              (int)nlen, name);
      goto usage_error;
    }
  }
  if (o.min_replicas < 0) {
    fprintf(stderr, "stepguard-lighthouse: --min_replicas is required\n");
    goto usage_error;
  }
  if (!token && env_token && env_token[0]) {
    token = strdup(env_token);
    if (!token)
      goto out;
  }
  o.auth_token = token;

  /* Block the stop signals in every thread the server starts; this thread
   * takes them with sigwait. */
  sigset_t stop, old;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  sg_lh_server_t *s = NULL;
  sg_err_t err;
  sg_err_clear(&err);
  int rc = sg_lh_server_start(&o, &s, &err);
  if (rc) {
    fprintf(stderr, "stepguard-lighthouse: %s\n",
            err.msg[0] ? err.msg : sg_strerror(rc));
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    status = 1;
    goto out;
  }
  int sig = 0;
  sigwait(&stop, &sig);
  sg_log(SG_LOG_INFO, "lighthouse", "received %s, shutting down",
         sig == SIGINT ? "SIGINT" : "SIGTERM");
  sg_lh_server_stop(s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  status = 0;
  goto out;
usage_error:
  fputs("run with --help for the options\n", stderr);
  status = 2;
out:
  free(token);
  return status;
}
