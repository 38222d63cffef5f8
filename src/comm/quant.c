/*
 * quant.c: the quantization kernels of the quantized collectives (qalgo.c):
 * float32 to int8 or fp8 (e4m3fn) codes with one float32 scale per block of
 * SG__QUANT_BLOCK elements, and back.  Pure functions of their arguments.
 *
 * Wire block of `count` elements (sg__quant_wire_bytes(count) bytes, a
 * multiple of 8):
 *
 *   "SGQ1" u8 format u8 flags u16 0 u64 count      (16-byte header)
 *   f32 step[nblocks]                              (nblocks = ceil(count/B))
 *   u8 code[count]
 *   zero padding to a multiple of 8
 *
 * Element i of block b is code[i] * step[b] (code read as int8, or as
 * float8_e4m3fn).  A block's step is absmax / QMAX (QMAX = 127 or 448),
 * so its largest element maps to the largest code; an all-zero block has
 * step 0.  Quantizing multiplies by QMAX / absmax, computed once per block;
 * a block whose absmax is so small that this would overflow (below 2^-64)
 * is first multiplied by 2^64, which is exact.
 *
 * NaN and infinity are found while the block's absmax is computed: the
 * largest magnitude's bits are those of +inf or a NaN exactly when one is
 * present (the magnitudes are compared as integers).  Such a block is
 * encoded as zeros and sg__quant_encode says so.
 *
 * Every loop is branch-free so that it vectorises; on x86-64 each kernel is
 * also compiled for AVX2 and chosen at run time, with the same bits.
 */
#include <string.h>

#include "comm/comm_int.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic")
#endif

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---- float8 e4m3fn ---------------------------------------------------------
 *
 * 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinity;
 * S.1111.111 is NaN, so the largest finite magnitude is 448.  Subnormals
 * are m * 2^-9.
 */

/* fp8_of_abs: the code of the magnitude with float32 bits a (a finite,
 * a <= bits of 448 after the callers' clamp; larger values saturate),
 * rounded to nearest even.  Normal results: the integer carry trick on the
 * mantissa (3 bits kept, 20 dropped).  Subnormal results (a < 2^-6): one
 * float addition of 2^14, whose unit in the last place is 2^-9, rounds the
 * value to a multiple of 2^-9; 8 * 2^-9 = 2^-6 is the smallest normal code,
 * which comes out right too. */
static inline uint32_t fp8_of_abs(uint32_t a) {
  uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - 960u;
  uint32_t sub = f2u(u2f(a) + 16384.0f) - 0x46800000u;
  uint32_t is_sub = 0u - (uint32_t)(a < 0x3c800000u);
  uint32_t r = (is_sub & sub) | (~is_sub & normal);
  return r > 0x7eu ? 0x7eu : r;
}

static inline float fp8_to_f32_inl(uint32_t c) { /* c < 0x100 */
  uint32_t sign = (c & 0x80u) << 24, em = c & 0x7fu;
  uint32_t normal = (em << 20) + 0x3c000000u; /* exponent - 7 + 127 */
  uint32_t sub = f2u((float)(int32_t)em * 0.001953125f); /* m * 2^-9 */
  uint32_t is_normal = 0u - (uint32_t)(em >= 8u);
  uint32_t is_nan = 0u - (uint32_t)(em == 0x7fu);
  uint32_t r = (is_normal & normal) | (~is_normal & sub);
  r = (is_nan & 0x7fc00000u) | (~is_nan & r);
  return u2f(r | sign);
}

uint8_t sg__fp8_from_f32(float f) {
  uint32_t x = f2u(f), sign = (x >> 24) & 0x80u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u)
    return (uint8_t)(sign | 0x7fu);
  if (a > 0x43e00000u) /* above 448, infinity included */
    return (uint8_t)(sign | 0x7eu);
  return (uint8_t)(sign | fp8_of_abs(a));
}

float sg__fp8_to_f32(uint8_t c) { return fp8_to_f32_inl(c); }

/* ---- wire blocks ------------------------------------------------------- */

#define HDR 16
#define B SG__QUANT_BLOCK

static size_t nblocks(size_t count) { return (count + B - 1) / B; }

size_t sg__quant_wire_bytes(size_t count) {
  size_t n = HDR + 4 * nblocks(count) + count;
  return (n + 7) & ~(size_t)7;
}

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

void sg__quant_set_flags(uint8_t *wire, unsigned flags) {
  wire[5] = (uint8_t)flags;
}

int sg__quant_check(const uint8_t *wire, size_t nbytes, sg_comm_quant_t fmt,
                    size_t count, unsigned *flags) {
  if (nbytes != sg__quant_wire_bytes(count) || memcmp(wire, "SGQ1", 4) != 0 ||
      wire[4] != (uint8_t)fmt || wire[6] != 0 || wire[7] != 0 ||
      get64(wire + 8) != count ||
      (wire[5] & ~(unsigned)SG__QUANT_FLAGS_ALL) != 0)
    return SG_EPROTO;
  *flags = wire[5];
  return 0;
}

/* ---- kernels -------------------------------------------------------------
 *
 * The *_body functions are inlined into a baseline and an AVX2 clone each.
 */

#if defined(__GNUC__)
#define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define ALWAYS_INLINE inline
#endif

/* absmax_bits: the largest |x[i]| as float32 bits (>= 0x7f800000 when a
 * NaN or an infinity is present). */
static ALWAYS_INLINE uint32_t absmax_bits(const float *x, size_t n) {
  int32_t m = 0;
  for (size_t i = 0; i < n; i++) {
    int32_t a = (int32_t)(f2u(x[i]) & 0x7fffffffu);
    m = a > m ? a : m;
  }
  return (uint32_t)m;
}

/* The scaled value v lies within [-QMAX, QMAX] up to one rounding; both
 * encoders clamp.  int8: round to nearest even by adding 1.5 * 2^23 (the
 * sum's low mantissa bits are the rounded integer, two's complement), then
 * clamp the integer (which vectorises better than a float clamp). */
static ALWAYS_INLINE void enc_int8(const float *x, size_t n, float pre,
                                   float inv, uint8_t *out) {
  for (size_t i = 0; i < n; i++) {
    float v = (x[i] * pre) * inv; /* |v| <= 127 * (1 + 2^-23) */
    int32_t q = (int32_t)(f2u(v + 12582912.0f) - 0x4b400000u);
    q = q > 127 ? 127 : q;
    q = q < -127 ? -127 : q;
    out[i] = (uint8_t)q;
  }
}

static ALWAYS_INLINE void enc_fp8(const float *x, size_t n, float pre,
                                  float inv, uint8_t *out) {
  for (size_t i = 0; i < n; i++) {
    float v = (x[i] * pre) * inv;
    uint32_t u = f2u(v), a = u & 0x7fffffffu;
    a = a > 0x43e00000u ? 0x43e00000u : a; /* clamp to 448 */
    out[i] = (uint8_t)(((u >> 24) & 0x80u) | fp8_of_abs(a));
  }
}

static ALWAYS_INLINE int encode_body(sg_comm_quant_t fmt, const float *x,
                                     size_t count, float *steps,
                                     uint8_t *codes) {
  float qmax = fmt == SG_COMM_QUANT_INT8 ? 127.0f : 448.0f;
  int bad = 0;
  for (size_t b = 0, off = 0; off < count; b++, off += B) {
    size_t n = count - off < B ? count - off : B;
    uint32_t am = absmax_bits(x + off, n);
    if (am >= 0x7f800000u || am == 0) {
      bad |= am >= 0x7f800000u;
      steps[b] = 0.0f;
      memset(codes + off, 0, n);
      continue;
    }
    float absmax = u2f(am);
    float pre = am < 0x1f800000u ? 18446744073709551616.0f : 1.0f; /* 2^64 */
    float inv = qmax / (absmax * pre);
    steps[b] = absmax / qmax;
    if (fmt == SG_COMM_QUANT_INT8)
      enc_int8(x + off, n, pre, inv, codes + off);
    else
      enc_fp8(x + off, n, pre, inv, codes + off);
  }
  return bad;
}

/* decode_body: out = dequantized (add = 0) or acc += dequantized (add =
 * 1). */
static ALWAYS_INLINE void decode_body(sg_comm_quant_t fmt, const float *steps,
                                      const uint8_t *codes, size_t count,
                                      float *out, int add) {
  for (size_t b = 0, off = 0; off < count; b++, off += B) {
    size_t n = count - off < B ? count - off : B;
    float s = steps[b];
    const uint8_t *c = codes + off;
    float *o = out + off;
    if (fmt == SG_COMM_QUANT_INT8) {
      if (add)
        for (size_t i = 0; i < n; i++)
          o[i] += (float)(int8_t)c[i] * s;
      else
        for (size_t i = 0; i < n; i++)
          o[i] = (float)(int8_t)c[i] * s;
    } else {
      if (add)
        for (size_t i = 0; i < n; i++)
          o[i] += fp8_to_f32_inl(c[i]) * s;
      else
        for (size_t i = 0; i < n; i++)
          o[i] = fp8_to_f32_inl(c[i]) * s;
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SG_QUANT_AVX2 1
__attribute__((target("avx2"))) static int
encode_avx2(sg_comm_quant_t fmt, const float *x, size_t count, float *steps,
            uint8_t *codes) {
  return encode_body(fmt, x, count, steps, codes);
}
__attribute__((target("avx2"))) static void
decode_avx2(sg_comm_quant_t fmt, const float *steps, const uint8_t *codes,
            size_t count, float *out, int add) {
  if (add)
    decode_body(fmt, steps, codes, count, out, 1);
  else
    decode_body(fmt, steps, codes, count, out, 0);
}

static int have_avx2(void) {
  __builtin_cpu_init(); /* idempotent */
  return __builtin_cpu_supports("avx2");
}
#endif

/* steps and codes of a wire block (4-byte alignment of the steps comes
 * from the header's 16 bytes; the caller's buffers are malloc'd). */
static float *wire_steps(uint8_t *wire) { return (float *)(wire + HDR); }
static uint8_t *wire_codes(uint8_t *wire, size_t count) {
  return wire + HDR + 4 * nblocks(count);
}

int sg__quant_encode(sg_comm_quant_t fmt, const float *x, size_t count,
                     uint8_t *wire) {
  size_t total = sg__quant_wire_bytes(count);
  memcpy(wire, "SGQ1", 4);
  wire[4] = (uint8_t)fmt;
  wire[5] = 0;
  wire[6] = wire[7] = 0;
  put64(wire + 8, count);
  uint8_t *codes = wire_codes(wire, count);
  memset(codes + count, 0, total - (size_t)(codes + count - wire));
  float *steps = wire_steps(wire);
#ifdef SG_QUANT_AVX2
  if (have_avx2())
    return encode_avx2(fmt, x, count, steps, codes);
#endif
  return encode_body(fmt, x, count, steps, codes);
}

static void decode(sg_comm_quant_t fmt, const uint8_t *wire, size_t count,
                   float *out, int add) {
  const float *steps = wire_steps((uint8_t *)wire);
  const uint8_t *codes = wire_codes((uint8_t *)wire, count);
#ifdef SG_QUANT_AVX2
  if (have_avx2()) {
    decode_avx2(fmt, steps, codes, count, out, add);
    return;
  }
#endif
  if (add)
    decode_body(fmt, steps, codes, count, out, 1);
  else
    decode_body(fmt, steps, codes, count, out, 0);
}

void sg__quant_decode(sg_comm_quant_t fmt, const uint8_t *wire, size_t count,
                      float *out) {
  decode(fmt, wire, count, out, 0);
}

void sg__quant_decode_add(sg_comm_quant_t fmt, const uint8_t *wire,
                          size_t count, float *acc) {
  decode(fmt, wire, count, acc, 1);
}

/* sg__quant_add_f32 / sg__quant_div: the owner's own exact operand (its
 * NaN or infinity found on the way, as absmax_bits does) and AVG's
 * division, vectorised the same way. */
static ALWAYS_INLINE int add_body(float *acc, const float *x, size_t n) {
  int32_t m = 0;
  for (size_t i = 0; i < n; i++) {
    int32_t a = (int32_t)(f2u(x[i]) & 0x7fffffffu);
    m = a > m ? a : m;
    acc[i] += x[i];
  }
  return m >= 0x7f800000;
}

static ALWAYS_INLINE void div_body(float *acc, size_t n, float d) {
  for (size_t i = 0; i < n; i++)
    acc[i] /= d;
}

#ifdef SG_QUANT_AVX2
__attribute__((target("avx2"))) static int add_avx2(float *acc, const float *x,
                                                    size_t n) {
  return add_body(acc, x, n);
}
__attribute__((target("avx2"))) static void div_avx2(float *acc, size_t n,
                                                     float d) {
  div_body(acc, n, d);
}
#endif

int sg__quant_add_f32(float *acc, const float *x, size_t n) {
#ifdef SG_QUANT_AVX2
  if (have_avx2())
    return add_avx2(acc, x, n);
#endif
  return add_body(acc, x, n);
}

void sg__quant_div(float *acc, size_t n, int d) {
#ifdef SG_QUANT_AVX2
  if (have_avx2()) {
    div_avx2(acc, n, (float)d);
    return;
  }
#endif
  div_body(acc, n, (float)d);
}

/* ---- the public wrappers (stepguard/comm.h) ---------------------------- */

size_t sg_comm_quant_wire_bytes(size_t count) {
  return sg__quant_wire_bytes(count);
}

int sg_comm_quant_encode(sg_comm_quant_t fmt, const float *x, size_t count,
                         void *wire) {
  if (fmt != SG_COMM_QUANT_INT8 && fmt != SG_COMM_QUANT_FP8)
    return SG_EINVAL;
  return sg__quant_encode(fmt, x, count, wire);
}

int sg_comm_quant_decode(sg_comm_quant_t fmt, const void *wire, size_t nbytes,
                         size_t count, float *out) {
  unsigned flags;
  if (fmt != SG_COMM_QUANT_INT8 && fmt != SG_COMM_QUANT_FP8)
    return SG_EINVAL;
  if (sg__quant_check(wire, nbytes, fmt, count, &flags) != 0)
    return SG_EPROTO;
  sg__quant_decode(fmt, wire, count, out);
  return 0;
}

void sg_comm_fp8_from_f32(const float *in, uint8_t *out, size_t n) {
  for (size_t i = 0; i < n; i++)
    out[i] = sg__fp8_from_f32(in[i]);
}

void sg_comm_fp8_to_f32(const uint8_t *in, float *out, size_t n) {
  for (size_t i = 0; i < n; i++)
    out[i] = sg__fp8_to_f32(in[i]);
}
