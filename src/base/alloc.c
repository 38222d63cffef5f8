/*
 * alloc.c: the library's allocation entry points and the failure injector
 * that lets tests fail the Nth allocation (in the manner of SQLite's fault
 * simulator).  The injector is two atomics, so it costs one relaxed load per
 * allocation when disarmed.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "stepguard/base.h"

static atomic_long fail_countdown; /* 0 = disarmed; 1 = fail next call */
static atomic_int fail_sticky;
static atomic_long fail_hits;

/* should_fail: consume one step of the countdown; nonzero to fail. */
static int should_fail(void) {
  long n = atomic_load_explicit(&fail_countdown, memory_order_relaxed);
  if (n == 0)
    return 0;
  if (n == 1) {
    if (!atomic_load(&fail_sticky))
      atomic_store(&fail_countdown, 0);
    atomic_fetch_add(&fail_hits, 1);
    return 1;
  }
  atomic_fetch_sub(&fail_countdown, 1);
  return 0;
}

long sg_test_fail_alloc(long nth, int sticky) {
  atomic_store(&fail_sticky, sticky);
  atomic_store(&fail_countdown, nth < 0 ? 0 : nth);
  return atomic_exchange(&fail_hits, 0);
}

void *sg_malloc(size_t n) { return should_fail() ? NULL : malloc(n ? n : 1); }

void *sg_calloc(size_t n, size_t size) {
  return should_fail() ? NULL : calloc(n ? n : 1, size ? size : 1);
}

void *sg_realloc(void *p, size_t n) {
  return should_fail() ? NULL : realloc(p, n ? n : 1);
}

void sg_free(void *p) { free(p); }

char *sg_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = sg_malloc(n);
  if (d)
    memcpy(d, s, n);
  return d;
}
