/*
 * clock.c: monotonic and wall clocks, and deadline arithmetic that saturates
 * instead of overflowing.
 */
#include <time.h>

#include "stepguard/base.h"

int64_t sg_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t sg_wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

sg_deadline_t sg_deadline_in_ms(int64_t ms) {
  int64_t now = sg_now_ns();
  if (ms <= 0)
    return now;
  if (ms > (INT64_MAX - now) / 1000000)
    return INT64_MAX;
  return now + ms * 1000000;
}

int64_t sg_deadline_left_ms(sg_deadline_t d) {
  int64_t left = d - sg_now_ns();
  if (left <= 0)
    return 0;
  return left / 1000000 + (left % 1000000 != 0);
}

int sg_deadline_passed(sg_deadline_t d) { return sg_now_ns() >= d; }
