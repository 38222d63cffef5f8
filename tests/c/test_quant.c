/*
 * test_quant.c: the quantization kernels of the quantized collectives
 * (src/comm/quant.c), as pure functions: float8 e4m3fn conversions against
 * a reference built from the format's definition (every code, nearest-even
 * ties, saturation, subnormals), the wire block (header checks, sizes),
 * int8 and fp8 encode/decode against reference values and error bounds,
 * and NaN/infinity detection.  The collectives themselves are in
 * test_comm.c; bit equality with torch.float8_e4m3fn in
 * tests/py/test_quantized.py.
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "comm/comm_int.h"
#include "stepguard/comm.h"

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

/* ref_value: the value of a positive e4m3fn code (c < 0x7f), from the
 * format's definition. */
static double ref_value(int c) {
  int e = c >> 3, m = c & 7;
  return e == 0 ? m * ldexp(1.0, -9) : (1.0 + m / 8.0) * ldexp(1.0, e - 7);
}

/* ref_encode: nearest code by search, ties to the even code, +-448 beyond
 * the range. */
static uint8_t ref_encode(float f) {
  if (isnan(f))
    return (uint8_t)(signbit(f) ? 0xff : 0x7f);
  double a = fabs((double)f);
  int best = 0;
  for (int c = 1; c < 0x7f; c++) {
    double d = fabs(ref_value(c) - a), db = fabs(ref_value(best) - a);
    if (d < db || (d == db && (c & 1) == 0))
      best = c;
  }
  return (uint8_t)(best | (signbit(f) ? 0x80 : 0));
}

static void test_fp8_codes(void **state) {
  (void)state;
  for (int c = 0; c < 256; c++) {
    float f = sg__fp8_to_f32((uint8_t)c);
    if ((c & 0x7f) == 0x7f) {
      assert_true(isnan(f));
      assert_int_equal(sg__fp8_from_f32(f), c); /* sign kept */
      continue;
    }
    double want = ref_value(c & 0x7f) * ((c & 0x80) ? -1 : 1);
    assert_true((double)f == want);
    assert_int_equal(!!signbit(f), !!(c & 0x80));
    assert_int_equal(sg__fp8_from_f32(f), c); /* round trip, -0 too */
  }
  /* reference values */
  assert_int_equal(sg__fp8_from_f32(448.0f), 0x7e);
  assert_int_equal(sg__fp8_from_f32(-448.0f), 0xfe);
  assert_int_equal(sg__fp8_from_f32(1.0f), 0x38);
  assert_int_equal(sg__fp8_from_f32(0.001953125f), 0x01);  /* 2^-9 */
  assert_int_equal(sg__fp8_from_f32(0.0009765625f), 0x00); /* tie to 0 */
  assert_int_equal(sg__fp8_from_f32(0.0029296875f), 0x02); /* 1.5: tie up */
  assert_int_equal(sg__fp8_from_f32(1.0625f), 0x38);       /* tie to even */
  assert_int_equal(sg__fp8_from_f32(1.1875f), 0x3a);       /* tie to even */
  /* saturation */
  assert_int_equal(sg__fp8_from_f32(1e30f), 0x7e);
  assert_int_equal(sg__fp8_from_f32(-INFINITY), 0xfe);
  assert_int_equal(sg__fp8_from_f32(460.0f), 0x7e);
}

static void test_fp8_against_reference(void **state) {
  (void)state;
  /* every float up to 448 with a stride that visits every exponent and
   * many mantissas, plus every midpoint between neighbouring codes */
  for (uint32_t u = 0; u <= 0x43e00000u; u += 4099) {
    float f = u2f(u);
    assert_int_equal(sg__fp8_from_f32(f), ref_encode(f));
    assert_int_equal(sg__fp8_from_f32(-f), ref_encode(-f));
  }
  for (int c = 0; c < 0x7e; c++) {
    float mid = (float)((ref_value(c) + ref_value(c + 1)) / 2);
    assert_int_equal(sg__fp8_from_f32(mid), ref_encode(mid));
    assert_int_equal(sg__fp8_from_f32(nextafterf(mid, 0)), c);
    assert_int_equal(sg__fp8_from_f32(nextafterf(mid, 1000)), c + 1);
  }
  /* float32 subnormals round to zero */
  assert_int_equal(sg__fp8_from_f32(u2f(1)), 0);
  assert_int_equal(sg__fp8_from_f32(-u2f(0x7fffff)), 0x80);
}

static void test_wire_bytes(void **state) {
  (void)state;
  assert_int_equal(sg__quant_wire_bytes(0), 16);
  assert_int_equal(sg__quant_wire_bytes(1), 24);    /* 16 + 4 + 1 -> 24 */
  assert_int_equal(sg__quant_wire_bytes(512), 536); /* 16 + 4 + 512 */
  assert_int_equal(sg__quant_wire_bytes(513), 544); /* 16 + 8 + 513 -> 544 */
  for (size_t n = 0; n < 3000; n += 7)
    assert_int_equal(sg__quant_wire_bytes(n) % 8, 0);
}

/* roundtrip: encode x (n floats) in fmt, check, decode; returns the flag. */
static int roundtrip(sg_comm_quant_t fmt, const float *x, size_t n, float *y) {
  size_t wb = sg__quant_wire_bytes(n);
  uint8_t *w = malloc(wb);
  assert_non_null(w);
  int bad = sg__quant_encode(fmt, x, n, w);
  unsigned flags = 99;
  assert_int_equal(sg__quant_check(w, wb, fmt, n, &flags), 0);
  assert_int_equal(flags, 0);
  sg__quant_decode(fmt, w, n, y);
  /* decode_add onto zeros gives the same bits */
  float *z = calloc(n ? n : 1, sizeof(float));
  sg__quant_decode_add(fmt, w, n, z);
  for (size_t i = 0; i < n; i++)
    assert_true(f2u(z[i] + 0.0f) == f2u(y[i] + 0.0f));
  free(z);
  free(w);
  return bad;
}

static void test_int8_reference(void **state) {
  (void)state;
  /* one block: absmax 127 gives step 1, so codes are the rounded values */
  float x[8] = {127.0f, -127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, 3.49f};
  float want[8] = {127, -127, 0, 2, 2, -0.0f, -2, 3};
  float y[8];
  assert_int_equal(roundtrip(SG_COMM_QUANT_INT8, x, 8, y), 0);
  for (int i = 0; i < 8; i++)
    assert_true(y[i] == want[i]);
  uint8_t w[64];
  sg__quant_encode(SG_COMM_QUANT_INT8, x, 8, w);
  float step;
  memcpy(&step, w + 16, 4);
  assert_true(step == 1.0f);
  assert_int_equal((int8_t)w[20], 127);
  assert_int_equal((int8_t)w[21], -127);
  assert_int_equal((int8_t)w[23], 2); /* 1.5 -> 2 (even) */
  assert_int_equal((int8_t)w[24], 2); /* 2.5 -> 2 (even) */
}

static void test_error_bounds(void **state) {
  (void)state;
  size_t n = 5000;
  float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
  uint64_t s = 12345;
  for (int kind = 0; kind < 4; kind++) {
    for (size_t i = 0; i < n; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      float u = (float)((double)(s >> 11) / 9007199254740992.0) * 2 - 1;
      switch (kind) {
      case 0: /* uniform */
        x[i] = u * 3.0f;
        break;
      case 1: /* one huge value per block */
        x[i] = i % SG__QUANT_BLOCK == 17 ? 1e30f : u;
        break;
      case 2: /* float32 subnormals */
        x[i] = u * 1e-39f;
        break;
      default: /* zeros */
        x[i] = 0.0f;
      }
    }
    for (int fmt = 1; fmt <= 2; fmt++) {
      assert_int_equal(roundtrip((sg_comm_quant_t)fmt, x, n, y), 0);
      for (size_t b = 0; b < n; b += SG__QUANT_BLOCK) {
        size_t e = b + SG__QUANT_BLOCK < n ? b + SG__QUANT_BLOCK : n;
        double am = 0;
        for (size_t i = b; i < e; i++)
          am = fmax(am, fabs((double)x[i]));
        for (size_t i = b; i < e; i++) {
          double err = fabs((double)y[i] - (double)x[i]);
          /* int8: half a step; fp8: half an ulp of 3 mantissa bits, or
           * half the subnormal step; plus the float32 roundings and, for
           * float32 subnormal blocks, the underflow of the step */
          double bound = fmt == 1 ? am / 127 / 2
                                  : fmax(fabs((double)x[i]) / 16,
                                         am / 448 * ldexp(1, -10));
          bound =
              bound * 1.001 + fabs((double)x[i]) * 1e-6 + 127 * ldexp(1, -149);
          if (err > bound)
            fail_msg("kind %d fmt %d i %zu x %g y %g err %g bound %g", kind,
                     fmt, i, (double)x[i], (double)y[i], err, bound);
        }
      }
      if (kind == 3)
        for (size_t i = 0; i < n; i++)
          assert_true(y[i] == 0.0f);
    }
  }
  free(x);
  free(y);
}

static void test_nonfinite(void **state) {
  (void)state;
  float specials[3] = {NAN, INFINITY, -INFINITY};
  size_t n = 1100;
  float *x = malloc(n * sizeof(float));
  uint8_t *w = malloc(sg__quant_wire_bytes(n));
  for (int k = 0; k < 3; k++) {
    for (size_t pos = 0; pos < n; pos += 271) {
      for (size_t i = 0; i < n; i++)
        x[i] = (float)i;
      x[pos] = specials[k];
      for (int fmt = 1; fmt <= 2; fmt++)
        assert_int_equal(sg__quant_encode((sg_comm_quant_t)fmt, x, n, w), 1);
    }
  }
  /* the largest finite value is not special */
  for (size_t i = 0; i < n; i++)
    x[i] = i & 1 ? FLT_MAX : -FLT_MAX;
  for (int fmt = 1; fmt <= 2; fmt++)
    assert_int_equal(sg__quant_encode((sg_comm_quant_t)fmt, x, n, w), 0);
  free(x);
  free(w);
}

static void test_check_rejects(void **state) {
  (void)state;
  float x[10] = {1, 2, 3};
  size_t wb = sg__quant_wire_bytes(10);
  uint8_t w[64], bad[64];
  unsigned flags;
  sg__quant_encode(SG_COMM_QUANT_FP8, x, 10, w);
  assert_int_equal(sg__quant_check(w, wb, SG_COMM_QUANT_FP8, 10, &flags), 0);
  assert_int_equal(sg__quant_check(w, wb, SG_COMM_QUANT_INT8, 10, &flags),
                   SG_EPROTO);
  assert_int_equal(sg__quant_check(w, wb, SG_COMM_QUANT_FP8, 11, &flags),
                   SG_EPROTO);
  assert_int_equal(sg__quant_check(w, wb - 8, SG_COMM_QUANT_FP8, 10, &flags),
                   SG_EPROTO);
  for (size_t i = 0; i < 16; i++) { /* any header byte changed */
    memcpy(bad, w, wb);
    bad[i] ^= i == 5 ? 0x80 : 0x01; /* flags: an unknown bit */
    assert_int_equal(sg__quant_check(bad, wb, SG_COMM_QUANT_FP8, 10, &flags),
                     SG_EPROTO);
  }
  sg__quant_set_flags(w, SG__QUANT_NONFINITE);
  assert_int_equal(sg__quant_check(w, wb, SG_COMM_QUANT_FP8, 10, &flags), 0);
  assert_int_equal(flags, SG__QUANT_NONFINITE);
  /* the public wrappers */
  assert_int_equal(sg_comm_quant_encode((sg_comm_quant_t)3, x, 10, w),
                   SG_EINVAL);
  float y[10];
  assert_int_equal(sg_comm_quant_decode(SG_COMM_QUANT_INT8, w, wb, 10, y),
                   SG_EPROTO);
}

static void test_add_div(void **state) {
  (void)state;
  float a[5] = {1, 2, 3, 4, 5}, b[5] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  assert_int_equal(sg__quant_add_f32(a, b, 5), 0);
  sg__quant_div(a, 5, 3);
  for (int i = 0; i < 5; i++)
    assert_true(a[i] == (float)(i + 1.5f) / 3.0f);
  /* the operand's NaN or infinity is reported, wherever it is (the
   * vectorised body and the tail) */
  float acc[1000] = {0}, x[1000];
  float special[3] = {NAN, INFINITY, -INFINITY};
  for (int k = 0; k < 3; k++) {
    for (size_t at = 0; at < 1000; at += 97) {
      for (size_t i = 0; i < 1000; i++)
        x[i] = (float)i * (i % 2 ? -1e30f : 1e-30f);
      assert_int_equal(sg__quant_add_f32(acc, x, 1000), 0);
      x[at] = special[k];
      assert_int_equal(sg__quant_add_f32(acc, x, 1000), 1);
      assert_int_equal(sg__quant_add_f32(acc, x, at), 0);
    }
  }
  float big[2] = {3.4028235e38f, -3.4028235e38f}; /* finite */
  assert_int_equal(sg__quant_add_f32(acc, big, 2), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fp8_codes),
      cmocka_unit_test(test_fp8_against_reference),
      cmocka_unit_test(test_wire_bytes),
      cmocka_unit_test(test_int8_reference),
      cmocka_unit_test(test_error_bounds),
      cmocka_unit_test(test_nonfinite),
      cmocka_unit_test(test_check_rejects),
      cmocka_unit_test(test_add_div),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
