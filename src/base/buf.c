/*
 * buf.c: sg_buf_t, a byte buffer with a hard maximum.  Unread bytes are
 * moved to the front before the buffer grows, so a long-lived connection
 * buffer stays at most `max` bytes however much passes through it.
 */
#include <string.h>

#include "stepguard/base.h"

void sg_buf_init(sg_buf_t *b, size_t max) {
  memset(b, 0, sizeof(*b));
  b->max = max;
}

void sg_buf_free(sg_buf_t *b) {
  size_t max = b->max;
  sg_free(b->data);
  sg_buf_init(b, max);
}

int sg_buf_reserve(sg_buf_t *b, size_t n) {
  if (n > b->max || b->len > b->max - n)
    return SG_ETOOBIG;
  size_t need = b->len + n;
  if (b->off + need <= b->cap)
    return 0;
  if (need <= b->cap) { /* enough room once the unread bytes move down */
    memmove(b->data, b->data + b->off, b->len);
    b->off = 0;
    return 0;
  }
  size_t cap = b->cap ? b->cap : (b->max < 256 ? b->max : 256);
  while (cap < need)
    cap = cap > b->max / 2 ? b->max : cap * 2;
  uint8_t *p = sg_malloc(cap);
  if (!p)
    return SG_ENOMEM;
  if (b->len)
    memcpy(p, b->data + b->off, b->len);
  sg_free(b->data);
  b->data = p;
  b->off = 0;
  b->cap = cap;
  return 0;
}

int sg_buf_append(sg_buf_t *b, const void *p, size_t n) {
  if (n == 0)
    return 0;
  int rc = sg_buf_reserve(b, n);
  if (rc)
    return rc;
  memcpy(b->data + b->off + b->len, p, n);
  b->len += n;
  return 0;
}

uint8_t *sg_buf_tail(sg_buf_t *b) { return b->data + b->off + b->len; }

void sg_buf_commit(sg_buf_t *b, size_t n) { b->len += n; }

const uint8_t *sg_buf_head(const sg_buf_t *b) { return b->data + b->off; }

void sg_buf_consume(sg_buf_t *b, size_t n) {
  if (n >= b->len) {
    b->off = 0;
    b->len = 0;
    return;
  }
  b->off += n;
  b->len -= n;
}
