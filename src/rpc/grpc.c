/*
 * grpc.c: status codes, message prefix, grpc-timeout and grpc-message
 * encoding, UTF-8 validation.  Pure functions; see grpc.h.
 */
#include "rpc/grpc.h"

#include <string.h>

static const char *const status_names[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *sg__grpc_status_name(int status) {
  if (status < 0 || status > SG_GRPC_UNAUTHENTICATED)
    return "UNKNOWN";
  return status_names[status];
}

int sg__grpc_status_to_err(int status) {
  switch (status) {
  case SG_GRPC_OK:
    return 0;
  case SG_GRPC_DEADLINE_EXCEEDED:
  case SG_GRPC_CANCELLED:
    return SG_ETIMEDOUT;
  case SG_GRPC_UNAUTHENTICATED:
    return SG_EAUTH;
  case SG_GRPC_NOT_FOUND:
    return SG_ENOTFOUND;
  case SG_GRPC_RESOURCE_EXHAUSTED:
    return SG_ETOOBIG;
  case SG_GRPC_INVALID_ARGUMENT:
    return SG_EINVAL;
  case SG_GRPC_UNAVAILABLE:
    return SG_ECONNREFUSED;
  default:
    return SG_EPEER;
  }
}

void sg__grpc_prefix_write(uint8_t out[SG_GRPC_PREFIX_LEN], uint32_t len) {
  out[0] = 0;
  out[1] = (uint8_t)(len >> 24);
  out[2] = (uint8_t)(len >> 16);
  out[3] = (uint8_t)(len >> 8);
  out[4] = (uint8_t)len;
}

int sg__grpc_prefix_parse(const uint8_t *p, size_t n, size_t max, uint32_t *len,
                          int *compressed) {
  if (n < SG_GRPC_PREFIX_LEN)
    return SG_EAGAIN;
  if (p[0] > 1)
    return SG_EPROTO;
  uint32_t l = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 |
               (uint32_t)p[3] << 8 | (uint32_t)p[4];
  if (l > max)
    return SG_ETOOBIG;
  *len = l;
  *compressed = p[0];
  return 0;
}

int sg__grpc_timeout_parse(const char *v, size_t n, int64_t *ns) {
  if (n < 2 || n > 9)
    return SG_EINVAL;
  int64_t value = 0;
  for (size_t i = 0; i + 1 < n; i++) {
    if (v[i] < '0' || v[i] > '9')
      return SG_EINVAL;
    value = value * 10 + (v[i] - '0');
  }
  int64_t unit;
  switch (v[n - 1]) {
  case 'H':
    unit = INT64_C(3600000000000);
    break;
  case 'M':
    unit = INT64_C(60000000000);
    break;
  case 'S':
    unit = 1000000000;
    break;
  case 'm':
    unit = 1000000;
    break;
  case 'u':
    unit = 1000;
    break;
  case 'n':
    unit = 1;
    break;
  default:
    return SG_EINVAL;
  }
  *ns = value > INT64_MAX / unit ? INT64_MAX : value * unit;
  return 0;
}

size_t sg__grpc_timeout_format(int64_t ns, char out[16]) {
  static const struct {
    int64_t ns;
    char unit;
  } units[] = {{1, 'n'},
               {1000, 'u'},
               {1000000, 'm'},
               {1000000000, 'S'},
               {INT64_C(60000000000), 'M'},
               {INT64_C(3600000000000), 'H'}};
  if (ns < 1)
    ns = 1;
  for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
    int64_t v = ns / units[i].ns + (ns % units[i].ns != 0);
    if (v <= 99999999 || i + 1 == sizeof(units) / sizeof(units[0])) {
      if (v > 99999999)
        v = 99999999;
      int len = 0;
      char digits[16];
      do {
        digits[len++] = (char)('0' + v % 10);
        v /= 10;
      } while (v);
      for (int k = 0; k < len; k++)
        out[k] = digits[len - 1 - k];
      out[len] = units[i].unit;
      out[len + 1] = '\0';
      return (size_t)len + 1;
    }
  }
  return 0; /* not reached */
}

size_t sg__grpc_message_encode(const char *msg, char *out, size_t cap) {
  static const char hex[] = "0123456789ABCDEF";
  size_t o = 0;
  if (cap == 0)
    return 0;
  for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
    if (*p >= 0x20 && *p <= 0x7e && *p != '%') {
      if (o + 1 >= cap)
        break;
      out[o++] = (char)*p;
    } else {
      if (o + 3 >= cap)
        break;
      out[o++] = '%';
      out[o++] = hex[*p >> 4];
      out[o++] = hex[*p & 15];
    }
  }
  out[o] = '\0';
  return o;
}

size_t sg__grpc_message_decode(const char *v, size_t n, char *out, size_t cap) {
  size_t o = 0;
  if (cap == 0)
    return 0;
  for (size_t i = 0; i < n && o + 1 < cap; i++) {
    int hi, lo;
    if (v[i] == '%' && i + 2 < n && (hi = sg_hex_digit(v[i + 1])) >= 0 &&
        (lo = sg_hex_digit(v[i + 2])) >= 0) {
      out[o++] = (char)(hi << 4 | lo);
      i += 2;
    } else {
      out[o++] = v[i];
    }
  }
  out[o] = '\0';
  return o;
}

int sg__utf8_valid(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    /* ASCII, the common case (ids, addresses): eight bytes at a time */
    while (n - i >= 8) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & UINT64_C(0x8080808080808080))
        break;
      i += 8;
    }
    if (i >= n)
      break;
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len;
    unsigned min, cp;
    if ((c & 0xe0) == 0xc0) {
      len = 2, min = 0x80, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, min = 0x800, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, min = 0x10000, cp = c & 0x07;
    } else {
      return 0;
    }
    if (n - i < len)
      return 0;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xc0) != 0x80)
        return 0;
      cp = cp << 6 | (s[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return 0;
    i += len;
  }
  return 1;
}

/* ---- protobuf string checks ---------------------------------------------- */

#define PB_MAX_DEPTH 16

/* pb_varint: decode a varint at p[*off..n); 0 or SG_EPROTO. */
static int pb_varint(const uint8_t *p, size_t n, size_t *off, uint64_t *v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*off >= n)
      return SG_EPROTO;
    uint8_t b = p[(*off)++];
    x |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *v = x;
      return 0;
    }
  }
  return SG_EPROTO;
}

static int in_list(const uint32_t *list, size_t n, uint32_t f) {
  for (size_t i = 0; i < n; i++)
    if (list[i] == f)
      return 1;
  return 0;
}

static int pb_check(const uint8_t *p, size_t n, const sg__pb_spec_t *spec,
                    int depth, uint32_t *field) {
  if (depth > PB_MAX_DEPTH)
    return SG_EPROTO;
  size_t off = 0;
  while (off < n) {
    uint64_t key, len;
    if (pb_varint(p, n, &off, &key))
      return SG_EPROTO;
    uint32_t f = (uint32_t)(key >> 3);
    if (key >> 3 > UINT32_MAX / 8 || f == 0)
      return SG_EPROTO;
    switch (key & 7) {
    case 0:
      if (pb_varint(p, n, &off, &len))
        return SG_EPROTO;
      break;
    case 1:
      if (n - off < 8)
        return SG_EPROTO;
      off += 8;
      break;
    case 5:
      if (n - off < 4)
        return SG_EPROTO;
      off += 4;
      break;
    case 2: {
      if (pb_varint(p, n, &off, &len) || len > n - off)
        return SG_EPROTO;
      const uint8_t *v = p + off;
      if (spec && in_list(spec->strings, spec->n_strings, f)) {
        if (memchr(v, 0, (size_t)len) ||
            !sg__utf8_valid((const char *)v, len)) {
          *field = f;
          return SG_EINVAL;
        }
      } else if (spec) {
        for (size_t i = 0; i < spec->n_nested; i++) {
          if (spec->nested[i].field == f) {
            int rc = pb_check(v, (size_t)len, spec->nested[i].spec, depth + 1,
                              field);
            if (rc)
              return rc;
          }
        }
      }
      off += (size_t)len;
      break;
    }
    default: /* groups (3, 4) and unknown wire types */
      return SG_EPROTO;
    }
  }
  return 0;
}

const sg__pb_spec_t sg__pb_no_strings = {NULL, 0, NULL, 0};

int sg__pb_check_strings(const uint8_t *p, size_t n, const sg__pb_spec_t *spec,
                         uint32_t *field) {
  *field = 0;
  return pb_check(p, n, spec, 0, field);
}
