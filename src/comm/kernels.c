/*
 * kernels.c: element-wise reduction kernels and half-precision conversions.
 *
 * One plain loop per (type, operator), written so that the compiler
 * vectorises it (no calls, no branches the compiler cannot turn into
 * selects; dst may alias an operand, which it checks at run time).  The
 * operand order is part of the contract: op(a, b) with a and b fixed by the
 * algorithm, so MIN/MAX of NaNs or signed zeros give the same bits on every
 * rank.  Integer SUM and PRODUCT wrap (computed in unsigned arithmetic).
 * Half types are widened to float32, combined, and rounded back to nearest
 * even: one rounding per call.
 */
#include <string.h>

#include "comm/comm_int.h"

/* GCC at -O2 (debugoptimized builds) vectorises only loops that need no
 * run-time alias check; these need one (dst may alias an operand).  The
 * dynamic cost model lets it vectorise them as -O3 does. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("vect-cost-model=dynamic")
#endif

/* ---- half conversions ------------------------------------------------------
 */

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float sg__comm_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {
    float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
    return u2f(f2u(v) | sign);
  }
  if (exp == 31)
    return u2f(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0));
  return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t sg__comm_f32_to_f16(float f) {
  uint32_t x = f2u(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)
    return sign | 0x7e00; /* NaN, quiet */
  if (x >= 0x47800000u)
    return sign | 0x7c00; /* >= 65536 and infinity */
  if (x < 0x38800000u) {  /* below the smallest normal: subnormal or 0 */
    uint32_t e = x >> 23;
    if (e < 102)
      return sign;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1)))
      r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = (((x >> 23) - 112) << 10) | ((x & 0x7fffffu) >> 13);
  uint32_t rem = x & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1)))
    r++; /* may carry into the exponent, up to infinity: correct */
  return (uint16_t)(sign | r);
}

float sg__comm_bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* Branch-free (a select, not a return), so the half loops vectorise. */
uint16_t sg__comm_f32_to_bf16(float f) {
  uint32_t x = f2u(f);
  uint32_t nan = (x >> 16) | 0x40; /* NaN stays NaN, quiet */
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16;
  return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* ---- reduction loops ------------------------------------------------------
 */

/* NaN-propagating min/max with a fixed operand order. */
#define FMIN(x, y) ((x) != (x) ? (x) : (y) != (y) ? (y) : (y) < (x) ? (y) : (x))
#define FMAX(x, y) ((x) != (x) ? (x) : (y) != (y) ? (y) : (y) > (x) ? (y) : (x))
#define IMIN(x, y) ((y) < (x) ? (y) : (x))
#define IMAX(x, y) ((y) > (x) ? (y) : (x))

#define LOOP(T, EXPR)                                                          \
  do {                                                                         \
    T *d_ = dst;                                                               \
    const T *a_ = a, *b_ = b;                                                  \
    for (size_t i = 0; i < count; i++) {                                       \
      T x = a_[i], y = b_[i];                                                  \
      d_[i] = (EXPR);                                                          \
    }                                                                          \
  } while (0)

#define FLOAT_OPS(T)                                                           \
  switch (op) {                                                                \
  case SG_COMM_SUM:                                                            \
  case SG_COMM_AVG:                                                            \
    LOOP(T, x + y);                                                            \
    break;                                                                     \
  case SG_COMM_PRODUCT:                                                        \
    LOOP(T, x *y);                                                             \
    break;                                                                     \
  case SG_COMM_MIN:                                                            \
    LOOP(T, FMIN(x, y));                                                       \
    break;                                                                     \
  case SG_COMM_MAX:                                                            \
    LOOP(T, FMAX(x, y));                                                       \
    break;                                                                     \
  default:                                                                     \
    break;                                                                     \
  }

#define INT_OPS(T, U)                                                          \
  switch (op) {                                                                \
  case SG_COMM_SUM:                                                            \
  case SG_COMM_AVG:                                                            \
    LOOP(T, (T)(U)((U)x + (U)y));                                              \
    break;                                                                     \
  case SG_COMM_PRODUCT:                                                        \
    LOOP(T, (T)(U)((U)x * (U)y));                                              \
    break;                                                                     \
  case SG_COMM_MIN:                                                            \
    LOOP(T, IMIN(x, y));                                                       \
    break;                                                                     \
  case SG_COMM_MAX:                                                            \
    LOOP(T, IMAX(x, y));                                                       \
    break;                                                                     \
  default:                                                                     \
    break;                                                                     \
  }

/* half_reduce: widen, combine in float32, round once. */
#define HALF_LOOP(TO32, FROM32, EXPR)                                          \
  do {                                                                         \
    uint16_t *d_ = dst;                                                        \
    const uint16_t *a_ = a, *b_ = b;                                           \
    for (size_t i = 0; i < count; i++) {                                       \
      float x = TO32(a_[i]), y = TO32(b_[i]);                                  \
      d_[i] = FROM32(EXPR);                                                    \
    }                                                                          \
  } while (0)

#define HALF_OPS(TO32, FROM32)                                                 \
  switch (op) {                                                                \
  case SG_COMM_SUM:                                                            \
  case SG_COMM_AVG:                                                            \
    HALF_LOOP(TO32, FROM32, x + y);                                            \
    break;                                                                     \
  case SG_COMM_PRODUCT:                                                        \
    HALF_LOOP(TO32, FROM32, x *y);                                             \
    break;                                                                     \
  case SG_COMM_MIN:                                                            \
    HALF_LOOP(TO32, FROM32, FMIN(x, y));                                       \
    break;                                                                     \
  case SG_COMM_MAX:                                                            \
    HALF_LOOP(TO32, FROM32, FMAX(x, y));                                       \
    break;                                                                     \
  default:                                                                     \
    break;                                                                     \
  }

/*
 * bfloat16 two at a time: a 32-bit word holds two values, and each one's
 * float32 is the word shifted or masked (no shuffles), so the loop runs in
 * 32-bit lanes on any vector unit.  Both halves get the same treatment, so
 * the result does not depend on byte order.  bf16_round_hi is
 * sg__comm_f32_to_bf16 with the result left in the high half.
 */
static inline uint32_t bf16_round_hi(uint32_t x) {
  uint32_t nan = x | 0x400000u; /* quiet */
  uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1);
  return ((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded) & 0xffff0000u;
}

#define BF16_LOOP(EXPR)                                                        \
  do {                                                                         \
    uint8_t *d_ = dst;                                                         \
    const uint8_t *a_ = a, *b_ = b;                                            \
    size_t pairs_ = count / 2;                                                 \
    for (size_t i = 0; i < pairs_; i++) {                                      \
      uint32_t u, v, w;                                                        \
      memcpy(&u, a_ + 4 * i, 4);                                               \
      memcpy(&v, b_ + 4 * i, 4);                                               \
      float x = u2f(u << 16), y = u2f(v << 16);                                \
      w = bf16_round_hi(f2u(EXPR)) >> 16;                                      \
      x = u2f(u & 0xffff0000u);                                                \
      y = u2f(v & 0xffff0000u);                                                \
      w |= bf16_round_hi(f2u(EXPR));                                           \
      memcpy(d_ + 4 * i, &w, 4);                                               \
    }                                                                          \
    if (count & 1) {                                                           \
      uint16_t u, v, w;                                                        \
      memcpy(&u, a_ + 4 * pairs_, 2);                                          \
      memcpy(&v, b_ + 4 * pairs_, 2);                                          \
      float x = sg__comm_bf16_to_f32(u), y = sg__comm_bf16_to_f32(v);          \
      w = sg__comm_f32_to_bf16(EXPR);                                          \
      memcpy(d_ + 4 * pairs_, &w, 2);                                          \
    }                                                                          \
  } while (0)

#define BF16_OPS()                                                             \
  switch (op) {                                                                \
  case SG_COMM_SUM:                                                            \
  case SG_COMM_AVG:                                                            \
    BF16_LOOP(x + y);                                                          \
    break;                                                                     \
  case SG_COMM_PRODUCT:                                                        \
    BF16_LOOP(x *y);                                                           \
    break;                                                                     \
  case SG_COMM_MIN:                                                            \
    BF16_LOOP(FMIN(x, y));                                                     \
    break;                                                                     \
  case SG_COMM_MAX:                                                            \
    BF16_LOOP(FMAX(x, y));                                                     \
    break;                                                                     \
  default:                                                                     \
    break;                                                                     \
  }

/* reduce_body: the whole kernel, inlined into each instruction-set clone
 * below.  Every clone computes the same bits: each element is one IEEE
 * operation (no contraction: -std=c11 keeps -ffp-contract=off) and the
 * half rounding is integer arithmetic. */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void
reduce_body(sg_comm_dtype_t dtype, sg_comm_redop_t op, void *dst, const void *a,
            const void *b, size_t count) {
  switch (dtype) {
  case SG_COMM_F32:
    FLOAT_OPS(float);
    break;
  case SG_COMM_F64:
    FLOAT_OPS(double);
    break;
  case SG_COMM_F16:
    HALF_OPS(sg__comm_f16_to_f32, sg__comm_f32_to_f16);
    break;
  case SG_COMM_BF16:
    BF16_OPS();
    break;
  case SG_COMM_I8:
    INT_OPS(int8_t, uint8_t);
    break;
  case SG_COMM_U8:
    INT_OPS(uint8_t, uint8_t);
    break;
  case SG_COMM_I32:
    INT_OPS(int32_t, uint32_t);
    break;
  case SG_COMM_I64:
    INT_OPS(int64_t, uint64_t);
    break;
  default:
    break;
  }
}

/* On x86-64 the same loops are also compiled for AVX2 (twice the vector
 * width of the SSE2 baseline) and chosen at run time; the choice changes
 * the speed, never the bits. */
#if defined(__x86_64__) && defined(__GNUC__)
#define SG_KERNEL_AVX2 1
__attribute__((target("avx2"))) static void
reduce_avx2(sg_comm_dtype_t dtype, sg_comm_redop_t op, void *dst, const void *a,
            const void *b, size_t count) {
  reduce_body(dtype, op, dst, a, b, count);
}
#endif

void sg__comm_reduce(sg_comm_dtype_t dtype, sg_comm_redop_t op, void *dst,
                     const void *a, const void *b, size_t count) {
#ifdef SG_KERNEL_AVX2
  __builtin_cpu_init(); /* idempotent; constructors may not have run yet */
  if (__builtin_cpu_supports("avx2")) {
    reduce_avx2(dtype, op, dst, a, b, count);
    return;
  }
#endif
  reduce_body(dtype, op, dst, a, b, count);
}

#define SCALE(T, WT)                                                           \
  do {                                                                         \
    T *p_ = buf;                                                               \
    for (size_t i = 0; i < count; i++)                                         \
      p_[i] = (T)((WT)p_[i] / (WT)n);                                          \
  } while (0)

void sg__comm_scale_avg(sg_comm_dtype_t dtype, void *buf, size_t count, int n) {
  if (n <= 1)
    return;
  switch (dtype) {
  case SG_COMM_F32:
    SCALE(float, float);
    break;
  case SG_COMM_F64:
    SCALE(double, double);
    break;
  case SG_COMM_F16: {
    uint16_t *p = buf;
    for (size_t i = 0; i < count; i++)
      p[i] = sg__comm_f32_to_f16(sg__comm_f16_to_f32(p[i]) / (float)n);
    break;
  }
  case SG_COMM_BF16: {
    uint16_t *p = buf;
    for (size_t i = 0; i < count; i++)
      p[i] = sg__comm_f32_to_bf16(sg__comm_bf16_to_f32(p[i]) / (float)n);
    break;
  }
  case SG_COMM_I8:
    SCALE(int8_t, int);
    break;
  case SG_COMM_U8:
    SCALE(uint8_t, int);
    break;
  case SG_COMM_I32:
    SCALE(int32_t, int64_t);
    break;
  case SG_COMM_I64:
    SCALE(int64_t, int64_t);
    break;
  default:
    break;
  }
}

size_t sg_comm_dtype_size(sg_comm_dtype_t dtype) {
  static const size_t sizes[SG_COMM_NDTYPES] = {4, 8, 2, 2, 1, 1, 4, 8};
  return (unsigned)dtype < SG_COMM_NDTYPES ? sizes[dtype] : 0;
}
