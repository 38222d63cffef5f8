/*
 * status.c: lifetime of the lighthouse status snapshot (see status.h).
 */
#include "lighthouse/status.h"

#include <string.h>

#include "stepguard/base.h"

void sg__lh_status_free(sg__lh_status_t *s) {
  if (!s)
    return;
  if (s->members) {
    for (size_t i = 0; i < s->n_members; i++) {
      sg_free(s->members[i].replica_id);
      sg_free(s->members[i].address);
      sg_free(s->members[i].store_address);
    }
  }
  if (s->heartbeats) {
    for (size_t i = 0; i < s->n_heartbeats; i++)
      sg_free(s->heartbeats[i].replica_id);
  }
  sg_free(s->members);
  sg_free(s->heartbeats);
  sg_free(s->reason);
  sg_free(s->lat_bucket_counts);
  sg_free(s->decision.counts);
  sg_free(s->leader);
  sg_free(s->history);
  memset(s, 0, sizeof(*s));
}
