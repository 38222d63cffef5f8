/*
 * error.c: the error table behind sg_strerror(), sg_err_name() and
 * sg_err_is_fatal(), and the sg_err_t helpers.
 */
#include <stdio.h>
#include <string.h>

#include "stepguard/base.h"

struct err_entry {
  int code;
  const char *name;
  const char *text;
};

static const struct err_entry err_table[] = {
    {SG_OK, "SG_OK", "success"},
    {SG_EINVAL, "SG_EINVAL", "invalid argument"},
    {SG_ENOMEM, "SG_ENOMEM", "out of memory"},
    {SG_EAGAIN, "SG_EAGAIN", "resource temporarily unavailable"},
    {SG_ETIMEDOUT, "SG_ETIMEDOUT", "deadline exceeded"},
    {SG_ECANCELED, "SG_ECANCELED", "operation canceled"},
    {SG_ECONNRESET, "SG_ECONNRESET", "connection reset by peer"},
    {SG_ECONNREFUSED, "SG_ECONNREFUSED", "connection refused"},
    {SG_EPIPE, "SG_EPIPE", "broken pipe"},
    {SG_EADDRINUSE, "SG_EADDRINUSE", "address already in use"},
    {SG_EIO, "SG_EIO", "i/o error"},
    {SG_ETOOBIG, "SG_ETOOBIG", "length over limit"},
    {SG_EAUTH, "SG_EAUTH", "authentication failed"},
    {SG_ENOTFOUND, "SG_ENOTFOUND", "not found"},
    {SG_ESTATE, "SG_ESTATE", "not allowed in the current state"},
    {SG_ECLOSED, "SG_ECLOSED", "object is closed"},
    {SG_EABORTED, "SG_EABORTED", "aborted"},
    {SG_EPEER, "SG_EPEER", "peer failed"},
    {SG_EPROTO, "SG_EPROTO", "protocol error"},
};

static const struct err_entry *err_find(int code) {
  for (size_t i = 0; i < sizeof(err_table) / sizeof(err_table[0]); i++)
    if (err_table[i].code == code)
      return &err_table[i];
  return NULL;
}

const char *sg_strerror(int code) {
  const struct err_entry *e = err_find(code);
  if (e)
    return e->text;
  /* Other errno-backed codes: strerror() text is not guaranteed to be
   * static or thread-safe, so name the range instead of guessing. */
  return code < 0 && code > SG__EBASE ? "system error" : "unknown error";
}

const char *sg_err_name(int code) {
  const struct err_entry *e = err_find(code);
  return e ? e->name : "SG_E?";
}

int sg_err_is_fatal(int code) {
  if (code < SG__EFATAL)
    return 1;
  switch (code) {
  case SG_ECONNRESET:
  case SG_EPIPE:
  case SG_EIO:
    return 1;
  default:
    return 0;
  }
}

int sg_err_set(sg_err_t *err, int code, const char *fmt, ...) {
  if (err) {
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
  }
  return code;
}

void sg_err_clear(sg_err_t *err) {
  if (err) {
    err->code = 0;
    err->msg[0] = '\0';
  }
}

int sg_hex_digit(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

const char *sg_version(void) { return SG_VERSION_STRING; }
