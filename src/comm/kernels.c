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

/*
 * The float16 conversions are branch-free (every case computed, one
 * selected with masks: a conditional would keep a branch, since the float
 * operations of the other cases may not be speculated under the default
 * -ftrapping-math) so that the loops using them vectorise; they give the same
 * bits as the plain definitions (checked for every float16 and every
 * float32 when they were written, and against a branchy reference in
 * test_f16_branch_free).  float32 -> float16 rounds to nearest even: a
 * subnormal result by a float addition of 0.5, which leaves the value's
 * bits rounded at 2^-24 in the low mantissa (flush-to-zero modes do not
 * change it: the sum is normal, and inputs that DAZ would flush round to
 * zero anyway); a normal one by the integer carry trick.  NaN becomes the
 * quiet 0x7e00 (sign kept); values from 65520 on go to infinity.
 */
static inline float f16_to_f32(uint32_t h) { /* h < 0x10000 */
  uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  uint32_t normal = (em << 13) + 0x38000000u; /* exponent - 15 + 127 */
  uint32_t infnan = (em << 13) | 0x7f800000u | ((em & 0x3ffu) ? 0x400000u : 0);
  uint32_t sub = f2u((float)(int32_t)em * 5.9604644775390625e-8f); /* exact */
  uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u);
  uint32_t is_normal = 0u - (uint32_t)(em >= 0x400u);
  uint32_t r = (is_special & infnan) |
               (~is_special & ((is_normal & normal) | (~is_normal & sub)));
  return u2f(r | sign);
}

static inline uint32_t f32_to_f16(float f) { /* < 0x10000 */
  uint32_t x = f2u(f), sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t big = x > 0x7f800000u ? 0x7e00u : 0x7c00u; /* NaN, or infinity */
  uint32_t sub = f2u(u2f(x) + 0.5f) - 0x3f000000u;
  uint32_t normal = (x + 0xc8000fffu + ((x >> 13) & 1)) >> 13;
  uint32_t is_big = 0u - (uint32_t)(x >= 0x47800000u);
  uint32_t is_sub = 0u - (uint32_t)(x < 0x38800000u);
  uint32_t r =
      (is_big & big) | (~is_big & ((is_sub & sub) | (~is_sub & normal)));
  return r | sign;
}

float sg__comm_f16_to_f32(uint16_t h) { return f16_to_f32(h); }

uint16_t sg__comm_f32_to_f16(float f) { return (uint16_t)f32_to_f16(f); }

float sg__comm_bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* bf16_round_hi: float32 bits x rounded to bfloat16 (nearest even; NaN
 * stays NaN, quiet), the result left in the high half.  Branch-free (a
 * select, not a return), so the half loops vectorise. */
static inline uint32_t bf16_round_hi(uint32_t x) {
  uint32_t nan = x | 0x400000u; /* quiet */
  uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1);
  return ((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded) & 0xffff0000u;
}

uint16_t sg__comm_f32_to_bf16(float f) {
  return (uint16_t)(bf16_round_hi(f2u(f)) >> 16);
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

/*
 * Half types two at a time: a 32-bit word holds two values, each widened
 * to float32, combined and rounded back once (one rounding per call) in
 * 32-bit lanes, so the loop needs no widening or narrowing shuffles.  For
 * bfloat16 a value's float32 is the word shifted or masked.  Both halves
 * get the same treatment, so the result does not depend on byte order.
 */

/* Two half values per 32-bit word: x and y are the floats of one half of
 * a word of each operand, the result goes back into the same half. */
#define PAIR_LOOP(LO, HI, JOIN, ONE_IN, ONE_OUT, EXPR)                         \
  do {                                                                         \
    uint8_t *d_ = dst;                                                         \
    const uint8_t *a_ = a, *b_ = b;                                            \
    size_t pairs_ = count / 2;                                                 \
    for (size_t i = 0; i < pairs_; i++) {                                      \
      uint32_t u, v, w;                                                        \
      memcpy(&u, a_ + 4 * i, 4);                                               \
      memcpy(&v, b_ + 4 * i, 4);                                               \
      float x = LO(u), y = LO(v);                                              \
      float lo_ = (EXPR);                                                      \
      x = HI(u);                                                               \
      y = HI(v);                                                               \
      w = JOIN(lo_, (EXPR));                                                   \
      memcpy(d_ + 4 * i, &w, 4);                                               \
    }                                                                          \
    if (count & 1) {                                                           \
      uint16_t u, v, w;                                                        \
      memcpy(&u, a_ + 4 * pairs_, 2);                                          \
      memcpy(&v, b_ + 4 * pairs_, 2);                                          \
      float x = ONE_IN(u), y = ONE_IN(v);                                      \
      w = ONE_OUT(EXPR);                                                       \
      memcpy(d_ + 4 * pairs_, &w, 2);                                          \
    }                                                                          \
  } while (0)

/* bfloat16: a half's float32 is the word shifted or masked */
#define BF16_LO(u) u2f((u) << 16)
#define BF16_HI(u) u2f((u)&0xffff0000u)
#define BF16_JOIN(lo, hi)                                                      \
  ((bf16_round_hi(f2u(lo)) >> 16) | bf16_round_hi(f2u(hi)))
#define BF16_LOOP(EXPR)                                                        \
  PAIR_LOOP(BF16_LO, BF16_HI, BF16_JOIN, sg__comm_bf16_to_f32,                 \
            sg__comm_f32_to_bf16, EXPR)

/* float16: the branch-free conversions on each half */
#define F16_LO(u) f16_to_f32((u)&0xffffu)
#define F16_HI(u) f16_to_f32((u) >> 16)
#define F16_JOIN(lo, hi) (f32_to_f16(lo) | (f32_to_f16(hi) << 16))
#define F16_LOOP(EXPR)                                                         \
  PAIR_LOOP(F16_LO, F16_HI, F16_JOIN, f16_to_f32, (uint16_t)f32_to_f16, EXPR)

#define PAIR_OPS(LOOP)                                                         \
  switch (op) {                                                                \
  case SG_COMM_SUM:                                                            \
  case SG_COMM_AVG:                                                            \
    LOOP(x + y);                                                               \
    break;                                                                     \
  case SG_COMM_PRODUCT:                                                        \
    LOOP(x *y);                                                                \
    break;                                                                     \
  case SG_COMM_MIN:                                                            \
    LOOP(FMIN(x, y));                                                          \
    break;                                                                     \
  case SG_COMM_MAX:                                                            \
    LOOP(FMAX(x, y));                                                          \
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
    PAIR_OPS(F16_LOOP);
    break;
  case SG_COMM_BF16:
    PAIR_OPS(BF16_LOOP);
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
