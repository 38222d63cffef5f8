/*
 * fuzz_buf.c: drives sg_buf_t with an operation stream and checks that it
 * never exceeds its maximum and always returns the bytes in order.
 *
 * Input: byte 0-1 = max (1..65536), then ops: 'a' len8 (append len bytes of
 * a running counter), 'c' len8 (consume), 'r' len16 (reserve), anything else
 * ends the run.  A shadow copy of the unread bytes is the oracle.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stepguard/base.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2)
    return 0;
  size_t max = ((size_t)data[0] << 8 | data[1]) + 1;
  sg_buf_t b;
  sg_buf_init(&b, max);
  uint8_t *shadow = malloc(max);
  size_t shadow_len = 0;
  uint8_t counter = 0;
  for (size_t i = 2; i + 1 < size; i += 2) {
    uint8_t op = data[i], arg = data[i + 1];
    if (op == 'a') {
      uint8_t chunk[256];
      for (int k = 0; k < arg; k++)
        chunk[k] = (uint8_t)(counter + k);
      int rc = sg_buf_append(&b, chunk, arg);
      if (rc == 0) {
        memcpy(shadow + shadow_len, chunk, arg);
        shadow_len += arg;
        counter = (uint8_t)(counter + arg);
      } else if (rc != SG_ETOOBIG || shadow_len + arg <= max) {
        abort();
      }
    } else if (op == 'c') {
      size_t n = arg < shadow_len ? arg : shadow_len;
      sg_buf_consume(&b, arg);
      memmove(shadow, shadow + n, shadow_len - n);
      shadow_len -= n;
    } else if (op == 'r') {
      size_t n = (size_t)arg << 8;
      int rc = sg_buf_reserve(&b, n);
      if ((rc == 0) != (shadow_len + n <= max))
        abort();
    } else {
      break;
    }
    if (b.len != shadow_len || b.cap > max ||
        (shadow_len && memcmp(sg_buf_head(&b), shadow, shadow_len) != 0))
      abort();
  }
  sg_buf_free(&b);
  free(shadow);
  return 0;
}
