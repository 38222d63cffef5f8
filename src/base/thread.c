/*
 * thread.c: naming the library's threads, so that `top -H`, `perf`,
 * `py-spy` and /proc/PID/task/TID/comm tell them apart from the Python
 * threads they would otherwise be named after.
 */
#include <pthread.h>
#include <string.h>

#include "stepguard/base.h"

void sg_thread_name(const char *name) {
  char buf[16]; /* the kernel keeps 15 bytes and a NUL */
  size_t n = strlen(name);
  if (n > sizeof(buf) - 1)
    n = sizeof(buf) - 1;
  memcpy(buf, name, n);
  buf[n] = '\0';
  (void)pthread_setname_np(pthread_self(), buf);
}
