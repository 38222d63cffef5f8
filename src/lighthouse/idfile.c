/*
 * idfile.c: the lighthouse's --quorum_id_file, so that quorum ids never go
 * backwards and the step the job reached is kept across restarts
 * (docs/lighthouse.md, "Quorum ids across restarts", "The step floor").
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "lighthouse/quorum.h"
#include "lighthouse/server_int.h"

/*
 * The id file holds the last issued quorum: its id on the first line, then
 * one member replica id a line.  A file of the id alone (older versions)
 * still reads.
 */
#define ID_FILE_MAX (64 * 1024 * 1024)
#define PERSIST_STEP_MS 1000 /* the step floor alone: at most this often */

/* sg__lh_idfile_load: the id floor, the step floor, and the members of the
 * last quorum handed to sg__lh_expect so a restart waits for them.  The
 * file is "ID STEP" on its first line (a file from before the step floor
 * has the ID alone), then one member id per line. */
int64_t sg__lh_idfile_load(sg_lh_server_t *s) {
  if (!s->o.quorum_id_file) {
    /* No file: the floor is the wall clock in microseconds.  Ids grow by
     * one per quorum, and a quorum takes far longer than a microsecond, so
     * they stay below the clock: a restarted lighthouse starts above every
     * id its predecessor issued, however soon it restarts. */
    return sg_wall_ns() / 1000;
  }
  FILE *f = fopen(s->o.quorum_id_file, "r");
  if (!f)
    return 0;
  long long id = 0, step = -1;
  if (fscanf(f, "%lld", &id) != 1 || id < 0)
    id = 0;
  char first[64] = "";
  if (id > 0 && fgets(first, sizeof(first), f) &&
      sscanf(first, "%lld", &step) == 1 && step >= 0) {
    sg__lh_set_step_floor(s->st, step, sg_now_ns());
    s->persisted_step = step;
    sg_log(SG_LOG_INFO, LOG,
           "the job had reached step %lld: a quorum below it waits for a "
           "replica that holds it",
           step);
  }
  char **ids = NULL;
  size_t n = 0, cap = 0;
  char line[MAX_ID_LEN + 2];
  int nomem = 0;
  while (id > 0 && !nomem && fgets(line, sizeof(line), f)) {
    size_t len = strcspn(line, "\r\n");
    line[len] = '\0';
    if (len == 0)
      continue;
    if (n == cap) {
      size_t ncap = cap ? cap * 2 : 16;
      if (ncap > s->o.max_replicas)
        ncap = s->o.max_replicas;
      char **grown = ncap > cap ? sg_realloc(ids, ncap * sizeof(*ids)) : NULL;
      if (!grown)
        break; /* more members than this lighthouse accepts */
      ids = grown;
      cap = ncap;
    }
    ids[n] = sg_strdup(line);
    nomem = !ids[n];
    n += !nomem;
  }
  fclose(f);
  if (n > 0 && !nomem &&
      sg__lh_expect(s->st, id, (const char *const *)ids, n, sg_now_ns()) == 0)
    sg_log(SG_LOG_INFO, LOG,
           "last quorum %lld had %zu members: waiting for them (or their "
           "silence) before the first quorum",
           id, n);
  for (size_t i = 0; i < n; i++)
    sg_free(ids[i]);
  sg_free(ids);
  return id;
}

/* sg__lh_idfile_persist: write quorum `q` and the step floor to quorum_id_file
 * atomically (tmp + rename): at every new id, and at most once a second
 * when only the step moved (a floor a little behind still holds a job that
 * starts over). */
void sg__lh_idfile_persist(sg_lh_server_t *s, const sg__lh_quorum_t *q,
                           int64_t now) {
  int64_t step = sg__lh_step_floor(s->st);
  if (!s->o.quorum_id_file ||
      (q->quorum_id == s->persisted_id &&
       (step == s->persisted_step ||
        now - s->persisted_ns < ms_to_ns(PERSIST_STEP_MS))))
    return;
  char tmp[4200];
  snprintf(tmp, sizeof(tmp), "%s.tmp", s->o.quorum_id_file);
  FILE *f = NULL;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0 && !(f = fdopen(fd, "w")))
    close(fd);
  if (!f) {
    sg_log(SG_LOG_WARN, LOG, "cannot write %s: %s", tmp, strerror(errno));
    return;
  }
  int ok =
      fprintf(f, "%lld %lld\n", (long long)q->quorum_id, (long long)step) > 0;
  for (size_t i = 0; ok && i < q->n; i++)
    ok = fprintf(f, "%s\n", q->members[i].replica_id) > 0;
  ok = fclose(f) == 0 && ok;
  if (ok && rename(tmp, s->o.quorum_id_file) == 0) {
    s->persisted_id = q->quorum_id;
    s->persisted_step = step;
    s->persisted_ns = now;
  } else
    sg_log(SG_LOG_WARN, LOG, "cannot persist quorum id to %s",
           s->o.quorum_id_file);
}
