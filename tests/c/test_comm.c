/*
 * test_comm.c: the collectives.  Pure parts first (half conversions,
 * kernels, chunk plans, ring and recursive-doubling schedules, the wire
 * format), then communicators of 1-4 ranks on threads in this process
 * (every collective, every dtype and operator, identical bits on every
 * rank, both algorithms), then failures: abort from another thread,
 * deadlines, mismatched operations, refused handshakes (generation, token,
 * garbage, slow and oversized peers), closing with work queued, and real
 * processes where one rank is SIGKILLed in the middle of an allreduce.
 *
 * The collectives on threads run twice: over TCP (same_host = -1) and over
 * the same-host path (same_host = 1, which lets communicators of one
 * process read each other's memory, with pull_min = 1 so that every
 * transfer takes it).  The SIGKILL test runs both ways in real processes.
 */
#include <arpa/inet.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "comm/comm_int.h"
#include "stepguard/base.h"
#include "stepguard/comm.h"
#include "stepguard/samehost.h"

#define MAXW 4

/* The path the group tests of the running cmocka group use: -1 TCP, 1 the
 * same-host path (set by the group setup functions in main). */
static int test_same_host = -1;
static int test_progress_ms; /* groups' progress deadline (0: default) */

static int setup_tcp(void **state) {
  (void)state;
  test_same_host = -1;
  return 0;
}

static int setup_samehost(void **state) {
  (void)state;
  sg_samehost_id_t id;
  test_same_host = 1;
  if (sg_samehost_self(&id) != 0)
    fprintf(stderr, "note: the same-host path is off here "
                    "($STEPGUARD_SAME_HOST=0 or no /proc); this group runs "
                    "over TCP\n");
  return 0;
}

/* samehost_expected: whether communicators of this process will read each
 * other's memory in the running group. */
static int samehost_expected(void) {
  sg_samehost_id_t id;
  return test_same_host > 0 && sg_samehost_self(&id) == 0;
}

/* ---- completion waiter --------------------------------------------------- */

struct done {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int fired, rc, calls;
  char msg[256];
};

static void done_init(struct done *d) {
  memset(d, 0, sizeof(*d));
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
}

static void done_cb(void *ud, int rc, const char *msg) {
  struct done *d = ud;
  pthread_mutex_lock(&d->mu);
  d->fired = 1;
  d->calls++;
  d->rc = rc;
  snprintf(d->msg, sizeof(d->msg), "%s", msg);
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
}

/* done_wait: the op's rc, or 1 if it did not complete within ms. */
static int done_wait(struct done *d, int64_t ms) {
  sg_deadline_t dl = sg_deadline_in_ms(ms);
  pthread_mutex_lock(&d->mu);
  while (!d->fired && !sg_deadline_passed(dl)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 10 * 1000 * 1000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&d->cv, &d->mu, &ts);
  }
  int rc = d->fired ? d->rc : 1;
  pthread_mutex_unlock(&d->mu);
  return rc;
}

static void done_destroy(struct done *d) {
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->cv);
}

/* ---- a group of communicators on threads ----------------------------------
 */

struct group {
  int n;
  sg_comm_t *c[MAXW];
  char addr[MAXW][64];
  const char *addrs[MAXW];
  int rc[MAXW];
  sg_err_t err[MAXW];
};

struct conn_arg {
  struct group *g;
  int r;
};

static void *connect_thread(void *p) {
  struct conn_arg *a = p;
  struct group *g = a->g;
  g->rc[a->r] = sg_comm_connect(g->c[a->r], g->addrs, sg_deadline_in_ms(10000),
                                &g->err[a->r]);
  return NULL;
}

static void group_start_opts(struct group *g, int n, size_t small_max) {
  memset(g, 0, sizeof(*g));
  g->n = n;
  for (int r = 0; r < n; r++) {
    sg_comm_opts_t o = {.rank = r,
                        .world_size = n,
                        .generation = 7,
                        .job = "job",
                        .auth_token = "secret",
                        .bind_host = "127.0.0.1",
                        .small_max = small_max,
                        .same_host = test_same_host,
                        .pull_min = test_same_host > 0 ? 1 : 0,
                        .progress_timeout_ms = test_progress_ms};
    sg_err_t err;
    assert_int_equal(sg_comm_new(&o, &g->c[r], &err), 0);
    snprintf(g->addr[r], sizeof(g->addr[r]), "127.0.0.1:%d",
             sg_comm_port(g->c[r]));
    g->addrs[r] = g->addr[r];
  }
  pthread_t th[MAXW];
  struct conn_arg a[MAXW];
  for (int r = 0; r < n; r++) {
    a[r] = (struct conn_arg){g, r};
    pthread_create(&th[r], NULL, connect_thread, &a[r]);
  }
  for (int r = 0; r < n; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < n; r++) {
    if (g->rc[r])
      fprintf(stderr, "rank %d connect: %s\n", r, g->err[r].msg);
    assert_int_equal(g->rc[r], 0);
  }
  /* the path the group is meant to test is the one it takes */
  for (int r = 0; r < n; r++)
    for (int p = 0; p < n; p++)
      assert_int_equal(sg_comm_same_host(g->c[r], p),
                       p != r && samehost_expected());
}

static void group_start(struct group *g, int n) { group_start_opts(g, n, 0); }

static void group_stop(struct group *g) {
  for (int r = 0; r < g->n; r++)
    sg_comm_free(g->c[r]);
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* ---- deterministic data ---------------------------------------------------
 */

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* fill: small integer values (exact in every dtype and every sum of 4). */
static void fill_ints(sg_comm_dtype_t dt, void *buf, size_t count, int rank) {
  for (size_t i = 0; i < count; i++) {
    int v = (int)((rnd() % 7) + 1) * (rank % 2 ? 1 : -1) + (int)(i % 3);
    if (dt == SG_COMM_U8)
      v = v < 0 ? -v : v;
    switch (dt) {
    case SG_COMM_F32:
      ((float *)buf)[i] = (float)v;
      break;
    case SG_COMM_F64:
      ((double *)buf)[i] = v;
      break;
    case SG_COMM_F16:
      ((uint16_t *)buf)[i] = sg__comm_f32_to_f16((float)v);
      break;
    case SG_COMM_BF16:
      ((uint16_t *)buf)[i] = sg__comm_f32_to_bf16((float)v);
      break;
    case SG_COMM_I8:
      ((int8_t *)buf)[i] = (int8_t)v;
      break;
    case SG_COMM_U8:
      ((uint8_t *)buf)[i] = (uint8_t)v;
      break;
    case SG_COMM_I32:
      ((int32_t *)buf)[i] = v;
      break;
    case SG_COMM_I64:
      ((int64_t *)buf)[i] = v;
      break;
    default:
      break;
    }
  }
}

static double get_d(sg_comm_dtype_t dt, const void *buf, size_t i) {
  switch (dt) {
  case SG_COMM_F32:
    return ((const float *)buf)[i];
  case SG_COMM_F64:
    return ((const double *)buf)[i];
  case SG_COMM_F16:
    return sg__comm_f16_to_f32(((const uint16_t *)buf)[i]);
  case SG_COMM_BF16:
    return sg__comm_bf16_to_f32(((const uint16_t *)buf)[i]);
  case SG_COMM_I8:
    return ((const int8_t *)buf)[i];
  case SG_COMM_U8:
    return ((const uint8_t *)buf)[i];
  case SG_COMM_I32:
    return ((const int32_t *)buf)[i];
  case SG_COMM_I64:
    return (double)((const int64_t *)buf)[i];
  default:
    return 0;
  }
}

static int is_int(sg_comm_dtype_t dt) { return dt >= SG_COMM_I8; }

/* expected: op over ranks of small integer inputs, computed in doubles. */
static double expected(sg_comm_dtype_t dt, sg_comm_redop_t op, double *v,
                       int n) {
  double acc = v[0];
  for (int r = 1; r < n; r++) {
    if (op == SG_COMM_SUM || op == SG_COMM_AVG)
      acc += v[r];
    else if (op == SG_COMM_PRODUCT)
      acc *= v[r];
    else if (op == SG_COMM_MIN)
      acc = v[r] < acc ? v[r] : acc;
    else
      acc = v[r] > acc ? v[r] : acc;
  }
  if (op == SG_COMM_AVG)
    acc = is_int(dt) ? trunc(acc / n) : acc / n;
  return acc;
}

/* ---- pure: conversions and kernels ----------------------------------------
 */

static void test_f16_roundtrip(void **state) {
  for (uint32_t h = 0; h < 0x10000; h++) {
    float f = sg__comm_f16_to_f32((uint16_t)h);
    uint16_t back = sg__comm_f32_to_f16(f);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
      assert_true(isnan(f));
      assert_int_equal(back & 0x7e00, 0x7e00); /* NaN, quiet */
    } else {
      assert_int_equal(back, h);
    }
  }
  /* ties to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 */
  assert_int_equal(sg__comm_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  assert_int_equal(sg__comm_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  assert_int_equal(sg__comm_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
  assert_int_equal(sg__comm_f32_to_f16(65504.0f), 0x7bff);
  assert_int_equal(sg__comm_f32_to_f16(65519.0f), 0x7bff);
  assert_int_equal(sg__comm_f32_to_f16(65520.0f), 0x7c00);
  assert_int_equal(sg__comm_f32_to_f16(-1e9f), 0xfc00);
  /* subnormals: 2^-24 is the smallest; half of it ties to 0 */
  assert_int_equal(sg__comm_f32_to_f16(0x1p-24f), 0x0001);
  assert_int_equal(sg__comm_f32_to_f16(0x1p-25f), 0x0000);
  assert_int_equal(sg__comm_f32_to_f16(0x1.8p-24f), 0x0002);
  assert_int_equal(sg__comm_f32_to_f16(-0.0f), 0x8000);
}

static void test_bf16_rounding(void **state) {
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    float f = sg__comm_bf16_to_f32((uint16_t)h);
    if (!isnan(f))
      assert_int_equal(sg__comm_f32_to_bf16(f), h);
  }
  assert_int_equal(sg__comm_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* tie */
  assert_int_equal(sg__comm_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  assert_true(isnan(sg__comm_bf16_to_f32(sg__comm_f32_to_bf16(NAN))));
  assert_int_equal(sg__comm_f32_to_bf16(3.4e38f), 0x7f80); /* to infinity */
}

static void test_kernels(void **state) {
  for (int dt = 0; dt < SG_COMM_NDTYPES; dt++) {
    for (int op = 0; op < SG_COMM_NREDOPS; op++) {
      uint8_t a[64 * 8], b[64 * 8], d[64 * 8];
      fill_ints((sg_comm_dtype_t)dt, a, 64, 0);
      fill_ints((sg_comm_dtype_t)dt, b, 64, 1);
      sg__comm_reduce((sg_comm_dtype_t)dt, (sg_comm_redop_t)op, d, a, b, 64);
      for (size_t i = 0; i < 64; i++) {
        double v[2] = {get_d((sg_comm_dtype_t)dt, a, i),
                       get_d((sg_comm_dtype_t)dt, b, i)};
        double want = expected(
            (sg_comm_dtype_t)dt,
            op == SG_COMM_AVG ? SG_COMM_SUM : (sg_comm_redop_t)op, v, 2);
        if (dt == SG_COMM_U8)
          want = (double)(uint8_t)(int)want;
        assert_true(get_d((sg_comm_dtype_t)dt, d, i) == want);
      }
      /* in place (dst aliases b) gives the same */
      sg__comm_reduce((sg_comm_dtype_t)dt, (sg_comm_redop_t)op, b, a, b, 64);
      assert_memory_equal(b, d, 64 * sg_comm_dtype_size((sg_comm_dtype_t)dt));
    }
  }
  /* integer sums wrap instead of overflowing */
  int32_t x = INT32_MAX, y = 1, z;
  sg__comm_reduce(SG_COMM_I32, SG_COMM_SUM, &z, &x, &y, 1);
  assert_int_equal(z, INT32_MIN);
  /* half: one rounding per combine: 2048 + 1 in float16 is 2048 */
  uint16_t h1 = sg__comm_f32_to_f16(2048.0f), h2 = sg__comm_f32_to_f16(1.0f),
           h3;
  sg__comm_reduce(SG_COMM_F16, SG_COMM_SUM, &h3, &h1, &h2, 1);
  assert_true(sg__comm_f16_to_f32(h3) == 2048.0f);
  /* NaN propagates through MIN and MAX, in either operand */
  float n = NAN, one = 1.0f, r;
  sg__comm_reduce(SG_COMM_F32, SG_COMM_MAX, &r, &one, &n, 1);
  assert_true(isnan(r));
  sg__comm_reduce(SG_COMM_F32, SG_COMM_MIN, &r, &n, &one, 1);
  assert_true(isnan(r));
  /* AVG's final division, integers truncate toward zero */
  int32_t iv[2] = {-7, 7};
  sg__comm_scale_avg(SG_COMM_I32, iv, 2, 2);
  assert_int_equal(iv[0], -3);
  assert_int_equal(iv[1], 3);
}

/* The half kernels work on pairs of values in 32-bit words; they must
 * give, bit for bit, what widening each element, combining and rounding it
 * gives: random bit patterns (NaNs, infinities, subnormals, ties), odd
 * counts, operands at odd addresses, dst aliasing an operand. */
static void half_kernel_bits(sg_comm_dtype_t dt) {
  float (*to32)(uint16_t) =
      dt == SG_COMM_BF16 ? sg__comm_bf16_to_f32 : sg__comm_f16_to_f32;
  uint16_t (*from32)(float) =
      dt == SG_COMM_BF16 ? sg__comm_f32_to_bf16 : sg__comm_f32_to_f16;
  enum { N = 1031 };
  uint16_t a[N + 1], b[N + 1], d[N + 1], want[N];
  uint64_t seed = 0x243f6a8885a308d3ull;
  for (size_t i = 0; i < N + 1; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    a[i] = (uint16_t)(seed >> 48);
    b[i] = (uint16_t)(seed >> 32);
    if (i % 17 == 0) /* values that round: same exponent, close */
      b[i] = (uint16_t)((a[i] & 0xff80) | (b[i] & 0x7f));
  }
  int bf = dt == SG_COMM_BF16;
  a[3] = bf ? 0x7fc1 : 0x7e01;  /* NaN with a payload */
  b[5] = bf ? 0xff81 : 0xfc01;  /* signalling NaN, negative */
  a[7] = bf ? 0x7f80 : 0x7c00;  /* infinity */
  b[7] = bf ? 0xff80 : 0xfc00;  /* minus infinity: inf - inf is NaN */
  a[9] = 0x0001;                /* subnormal */
  a[11] = bf ? 0x7f7f : 0x7bff; /* largest: overflows to infinity */
  b[11] = a[11];
  for (int op = 0; op < SG_COMM_NREDOPS; op++) {
    for (size_t off = 0; off < 2; off++) {
      for (size_t n = N - 3; n <= N; n++) {
        const uint16_t *pa = a + off, *pb = b;
        for (size_t i = 0; i < n; i++) {
          float x = to32(pa[i]), y = to32(pb[i]);
          float r = op == SG_COMM_PRODUCT ? x * y
                    : op == SG_COMM_MIN   ? (x != x   ? x
                                             : y != y ? y
                                             : y < x  ? y
                                                      : x)
                    : op == SG_COMM_MAX   ? (x != x   ? x
                                             : y != y ? y
                                             : y > x  ? y
                                                      : x)
                                          : x + y;
          want[i] = from32(r);
        }
        sg__comm_reduce(dt, (sg_comm_redop_t)op, d + off, pa, pb, n);
        assert_memory_equal(d + off, want, n * 2);
        /* in place: dst is the first operand */
        memcpy(d + off, pa, n * 2);
        sg__comm_reduce(dt, (sg_comm_redop_t)op, d + off, d + off, pb, n);
        assert_memory_equal(d + off, want, n * 2);
      }
    }
  }
}

static void test_half_kernel_bits(void **state) {
  half_kernel_bits(SG_COMM_BF16);
  half_kernel_bits(SG_COMM_F16);
}

/* The float16 conversions are branch-free; a plain, branchy statement of
 * the same rounding (nearest even, subnormals, NaN -> 0x7e00 with the sign,
 * 65520 and up -> infinity) must agree on a spread of float32 values. */
static uint16_t f16_reference(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)
    return sign | 0x7e00;
  if (x >= 0x47800000u)
    return sign | 0x7c00;
  if (x < 0x38800000u) {
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
    r++;
  return (uint16_t)(sign | r);
}

static void test_f16_branch_free(void **state) {
  /* every 251st float32, then values at and next to a rounding tie for
   * every exponent around float16's range (where rounding carries) */
  for (uint64_t u = 0; u < 0x100000000ull; u += 251) {
    float f;
    uint32_t x = (uint32_t)u;
    memcpy(&f, &x, 4);
    assert_int_equal(sg__comm_f32_to_f16(f), f16_reference(f));
  }
  for (uint32_t e = 100; e < 145; e++)
    for (uint32_t m = 0; m < 0x800000u; m += 0x2000 * 7)
      for (uint32_t d = 0; d < 3; d++)
        for (uint32_t sign = 0; sign < 2; sign++) {
          uint32_t x = (sign << 31) | (e << 23) | m | (0x1000u - 1 + d);
          float f;
          memcpy(&f, &x, 4);
          assert_int_equal(sg__comm_f32_to_f16(f), f16_reference(f));
        }
}

/* ---- pure: plans and schedules ----------------------------------------------
 */

static void test_chunks(void **state) {
  for (size_t count = 0; count < 40; count++) {
    for (int n = 1; n <= 7; n++) {
      size_t next = 0;
      for (int i = 0; i < n; i++) {
        size_t off, len;
        sg__comm_chunk(count, n, i, &off, &len);
        assert_int_equal(off, next);
        assert_true(len == count / (size_t)n || len == count / (size_t)n + 1);
        next = off + len;
      }
      assert_int_equal(next, count);
    }
  }
}

/* Simulate the ring schedule symbolically: each chunk's value is a bitmask
 * of the ranks reduced into it.  After allreduce every rank must hold the
 * full mask in every chunk, and every chunk was reduced in one order. */
static void test_ring_schedule(void **state) {
  for (int n = 2; n <= 9; n++) {
    for (int shift = 0; shift <= 1; shift++) {
      unsigned have[9][9];
      for (int r = 0; r < n; r++)
        for (int ch = 0; ch < n; ch++)
          have[r][ch] = 1u << r;
      int steps = shift ? n - 1 : 2 * (n - 1);
      for (int k = 0; k < steps; k++) {
        unsigned sent[9];
        for (int r = 0; r < n; r++)
          sent[r] = have[r][sg__comm_ring_send_chunk(r, n, k, shift)];
        for (int r = 0; r < n; r++) {
          int left = (r + n - 1) % n;
          int ch = sg__comm_ring_recv_chunk(r, n, k, shift);
          /* what the left neighbour sent is the chunk we receive */
          assert_int_equal(sg__comm_ring_send_chunk(left, n, k, shift), ch);
          if (k < n - 1) {
            assert_int_equal(sent[left] & have[r][ch], 0); /* once each */
            have[r][ch] |= sent[left];
          } else {
            have[r][ch] = sent[left];
          }
        }
      }
      unsigned full = (1u << n) - 1;
      for (int r = 0; r < n; r++) {
        if (shift)
          assert_int_equal(have[r][r], full); /* reduce-scatter: own chunk */
        else
          for (int ch = 0; ch < n; ch++)
            assert_int_equal(have[r][ch], full);
      }
      /* send of step k + 1 is the chunk received at step k (pipelining) */
      for (int r = 0; r < n; r++)
        for (int k = 0; k + 1 < steps; k++)
          assert_int_equal(sg__comm_ring_send_chunk(r, n, k + 1, shift),
                           sg__comm_ring_recv_chunk(r, n, k, shift));
    }
  }
}

static void test_rd_schedule(void **state) {
  assert_int_equal(sg__comm_pow2_floor(1), 1);
  assert_int_equal(sg__comm_pow2_floor(3), 2);
  assert_int_equal(sg__comm_pow2_floor(8), 8);
  assert_int_equal(sg__comm_pow2_floor(13), 8);
  for (int n = 1; n <= 13; n++) {
    int p2 = sg__comm_pow2_floor(n);
    for (int r = 0; r < n; r++)
      for (int round = 0; (1 << round) < p2; round++) {
        int q = sg__comm_rd_partner(r, n, round);
        if (r >= p2) {
          assert_int_equal(q, -1);
          continue;
        }
        assert_true(q >= 0 && q < p2 && q != r);
        assert_int_equal(sg__comm_rd_partner(q, n, round), r); /* symmetric */
      }
  }
}

/* ---- pure: wire format
 * ------------------------------------------------------- */

static void test_hello(void **state) {
  uint8_t buf[SG__COMM_HELLO_MAX];
  int n = sg__comm_hello_encode(buf, 42, 3, 4, "job", "tok");
  assert_int_equal(n, SG__COMM_HELLO_FIXED + 6);
  sg__comm_hello_t h;
  for (int i = 0; i < n; i++) /* every prefix asks for more */
    assert_int_equal(sg__comm_hello_parse(buf, (size_t)i, &h), 0);
  assert_int_equal(sg__comm_hello_parse(buf, (size_t)n, &h), n);
  assert_int_equal(h.generation, 42);
  assert_int_equal(h.rank, 3);
  assert_int_equal(h.world, 4);
  assert_memory_equal(h.job, "job", 3);
  sg_err_t err;
  assert_int_equal(sg__comm_hello_check(&h, 42, 1, 4, "job", "tok", &err), 0);
  assert_int_equal(sg__comm_hello_check(&h, 43, 1, 4, "job", "tok", &err),
                   SG_EPROTO);
  assert_non_null(strstr(err.msg, "generation"));
  assert_int_equal(sg__comm_hello_check(&h, 42, 1, 4, "job2", "tok", &err),
                   SG_EPROTO);
  assert_int_equal(sg__comm_hello_check(&h, 42, 1, 4, "job", "tok2", &err),
                   SG_EAUTH);
  assert_int_equal(sg__comm_hello_check(&h, 42, 1, 4, "job", "", &err),
                   SG_EAUTH);
  assert_int_equal(sg__comm_hello_check(&h, 42, 3, 4, "job", "tok", &err),
                   SG_EPROTO); /* only higher ranks connect */
  assert_int_equal(sg__comm_hello_check(&h, 42, 1, 5, "job", "tok", &err),
                   SG_EPROTO);
  /* garbage fails at the first byte; a bad version or kind at 8 */
  assert_int_equal(sg__comm_hello_parse((const uint8_t *)"GET /", 5, &h),
                   SG_EPROTO);
  uint8_t bad[SG__COMM_HELLO_MAX];
  memcpy(bad, buf, (size_t)n);
  bad[4] = 9;
  assert_int_equal(sg__comm_hello_parse(bad, (size_t)n, &h), SG_EPROTO);
  /* a length over its limit is refused before waiting for the bytes */
  memcpy(bad, buf, (size_t)n);
  bad[24] = 0xff;
  bad[25] = 0xff;
  assert_int_equal(sg__comm_hello_parse(bad, SG__COMM_HELLO_FIXED, &h),
                   SG_EPROTO);
  char big[SG_COMM_MAX_TOKEN + 2];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  assert_int_equal(sg__comm_hello_encode(buf, 1, 1, 2, "", big), SG_ETOOBIG);
}

static void test_reply_frame(void **state) {
  uint8_t b[SG__COMM_REPLY_LEN];
  sg__comm_reply_t r;
  sg__comm_reply_encode(b, 9, 2, SG_EAUTH);
  assert_int_equal(sg__comm_reply_parse(b, 3, &r), 0);
  assert_int_equal(sg__comm_reply_parse(b, sizeof(b), &r), SG__COMM_REPLY_LEN);
  assert_int_equal(r.status, SG_EAUTH);
  sg__comm_reply_encode(b, 9, 2, -12345); /* not a status acceptors send */
  assert_int_equal(sg__comm_reply_parse(b, sizeof(b), &r), SG_EPROTO);

  uint8_t f[SG__COMM_FRAME_LEN];
  sg__comm_frame_t in = {.type = SG__COMM_FRAME_OP,
                         .kind = 3,
                         .seq = 77,
                         .bytes = 1ull << 40},
                   out;
  sg__comm_frame_encode(f, &in);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), 0);
  assert_int_equal(out.kind, 3);
  assert_int_equal(out.seq, 77);
  assert_true(out.bytes == 1ull << 40);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f) - 1, &out), SG_EPROTO);
  f[0] = 'X';
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), SG_EPROTO);
  in.type = SG__COMM_FRAME_BYE;
  sg__comm_frame_encode(f, &in);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), 0);
  assert_int_equal(out.type, SG__COMM_FRAME_BYE);

  /* KEEPALIVE: every field zero; SEG: an index of at least 1 */
  in = (sg__comm_frame_t){.type = SG__COMM_FRAME_KEEPALIVE, .seq = 5};
  sg__comm_frame_encode(f, &in);
  assert_memory_equal(f, "SGKA", 4);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), 0);
  assert_int_equal(out.type, SG__COMM_FRAME_KEEPALIVE);
  assert_int_equal(out.seq, 0); /* the encoder wrote 0 */
  f[8] = 1;
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), SG_EPROTO);
  f[8] = 0;
  f[4] = 1; /* a kind */
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), SG_EPROTO);
  in = (sg__comm_frame_t){.type = SG__COMM_FRAME_SEG, .seq = 3, .bytes = 99};
  sg__comm_frame_encode(f, &in);
  assert_memory_equal(f, "SGSG", 4);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), 0);
  assert_int_equal(out.type, SG__COMM_FRAME_SEG);
  assert_int_equal(out.seq, 3);
  assert_int_equal(out.bytes, 99);
  in.seq = 0; /* segment 0 starts with the OP frame, never a SEG */
  sg__comm_frame_encode(f, &in);
  assert_int_equal(sg__comm_frame_parse(f, sizeof(f), &out), SG_EPROTO);
}

/* ---- collectives on threads ------------------------------------------------
 */

/* wrap: the expected integer value as the dtype stores it. */
static double wrap(sg_comm_dtype_t dt, double v) {
  int64_t i = (int64_t)v;
  switch (dt) {
  case SG_COMM_I8:
    return (int8_t)(uint8_t)(uint64_t)i;
  case SG_COMM_U8:
    return (uint8_t)(uint64_t)i;
  case SG_COMM_I32:
    return (int32_t)(uint32_t)(uint64_t)i;
  default:
    return v;
  }
}

/* run_allreduce: every rank reduces its own data; the results must be
 * bitwise identical on every rank and equal the expected values. */
static void run_allreduce(struct group *g, sg_comm_dtype_t dt,
                          sg_comm_redop_t op, size_t count) {
  size_t es = sg_comm_dtype_size(dt);
  uint8_t *in[MAXW], *buf[MAXW];
  struct done d[MAXW];
  for (int r = 0; r < g->n; r++) {
    in[r] = malloc(count * es + 1);
    buf[r] = malloc(count * es + 1);
    fill_ints(dt, in[r], count, r);
    memcpy(buf[r], in[r], count * es);
    done_init(&d[r]);
  }
  for (int r = 0; r < g->n; r++) {
    sg_err_t err;
    assert_int_equal(sg_comm_allreduce(g->c[r], buf[r], count, dt, op,
                                       sg_deadline_in_ms(20000), done_cb, &d[r],
                                       &err),
                     0);
  }
  for (int r = 0; r < g->n; r++) {
    int rc = done_wait(&d[r], 30000);
    if (rc)
      fprintf(stderr, "rank %d: %d %s\n", r, rc, d[r].msg);
    assert_int_equal(rc, 0);
    assert_int_equal(d[r].calls, 1);
  }
  for (int r = 1; r < g->n; r++)
    assert_memory_equal(buf[0], buf[r], count * es);
  for (size_t i = 0; i < count; i++) {
    double v[MAXW] = {0}; /* -O3 cannot tell that g->n >= 1 */
    for (int r = 0; r < g->n; r++)
      v[r] = get_d(dt, in[r], i);
    double want = expected(dt, op, v, g->n);
    double got = get_d(dt, buf[0], i);
    if (is_int(dt)) {
      if (op != SG_COMM_AVG)
        want = wrap(dt, want);
      if (got != want)
        fprintf(stderr, "dt %d op %d i %zu: got %g want %g\n", dt, op, i, got,
                want);
      assert_true(got == want);
    } else if (dt == SG_COMM_F16 || dt == SG_COMM_BF16) {
      assert_true(fabs(got - want) <= fabs(want) * 1e-2 + 1e-2);
    } else {
      assert_true(fabs(got - want) <= fabs(want) * 1e-6);
    }
  }
  for (int r = 0; r < g->n; r++) {
    free(in[r]);
    free(buf[r]);
    done_destroy(&d[r]);
  }
}

static void allreduce_matrix(int n, size_t small_max) {
  struct group g;
  group_start_opts(&g, n, small_max);
  size_t counts[] = {0, 1, 7, 3001};
  for (int dt = 0; dt < SG_COMM_NDTYPES; dt++)
    for (int op = 0; op < SG_COMM_NREDOPS; op++)
      for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++)
        run_allreduce(&g, (sg_comm_dtype_t)dt, (sg_comm_redop_t)op, counts[k]);
  group_stop(&g);
}

static void test_allreduce_1(void **state) { allreduce_matrix(1, 0); }
static void test_allreduce_2_small(void **state) { allreduce_matrix(2, 0); }
static void test_allreduce_3_small(void **state) { allreduce_matrix(3, 0); }
static void test_allreduce_3_ring(void **state) { allreduce_matrix(3, 1); }
static void test_allreduce_4_ring(void **state) { allreduce_matrix(4, 1); }
static void test_allreduce_2_ring(void **state) { allreduce_matrix(2, 1); }

/* Random float32 data over 3 ranks, both algorithms, a size that spans
 * several staging buffers: identical bits everywhere, close to the exact
 * sum. */
static void test_allreduce_bits(void **state) {
  for (int alg = 0; alg < 2; alg++) {
    struct group g;
    group_start_opts(&g, 3, alg ? 1 : (size_t)64 << 20);
    size_t count = (3u << 20) / 4 + 13; /* ~3 MiB, uneven chunks */
    float *in[3], *buf[3];
    struct done d[3];
    for (int r = 0; r < 3; r++) {
      in[r] = malloc(count * 4);
      buf[r] = malloc(count * 4);
      for (size_t i = 0; i < count; i++)
        in[r][i] = (float)((double)(rnd() % 2000001) / 1000000.0 - 1.0);
      memcpy(buf[r], in[r], count * 4);
      done_init(&d[r]);
    }
    for (int r = 0; r < 3; r++)
      assert_int_equal(sg_comm_allreduce(g.c[r], buf[r], count, SG_COMM_F32,
                                         SG_COMM_SUM, sg_deadline_in_ms(30000),
                                         done_cb, &d[r], NULL),
                       0);
    for (int r = 0; r < 3; r++)
      assert_int_equal(done_wait(&d[r], 60000), 0);
    assert_memory_equal(buf[0], buf[1], count * 4);
    assert_memory_equal(buf[0], buf[2], count * 4);
    for (size_t i = 0; i < count; i += 997)
      assert_true(fabs(buf[0][i] - ((double)in[0][i] + in[1][i] + in[2][i])) <
                  1e-5);
    for (int r = 0; r < 3; r++) {
      free(in[r]);
      free(buf[r]);
      done_destroy(&d[r]);
    }
    group_stop(&g);
  }
}

/* AVG divides each piece as the ring's last reducing step completes it:
 * the result must be bitwise SUM followed by the separate division, on
 * every rank, for floats and both half types, with both algorithms and a
 * size spanning several staging buffers. */
static void test_allreduce_avg_is_sum_then_divide(void **state) {
  sg_comm_dtype_t dts[] = {SG_COMM_F32, SG_COMM_F16, SG_COMM_BF16};
  for (int alg = 0; alg < 2; alg++) {
    struct group g;
    group_start_opts(&g, 3, alg ? 1 : (size_t)64 << 20);
    for (size_t k = 0; k < sizeof(dts) / sizeof(dts[0]); k++) {
      sg_comm_dtype_t dt = dts[k];
      size_t es = sg_comm_dtype_size(dt);
      size_t count = (3u << 20) / es + 13; /* ~3 MiB, uneven chunks */
      uint8_t *sum[3], *avg[3];
      struct done d[6];
      for (int r = 0; r < 3; r++) {
        sum[r] = malloc(count * es);
        avg[r] = malloc(count * es);
        for (size_t i = 0; i < count; i++) {
          float f = (float)((double)(rnd() % 2000001) / 1000.0 - 1000.0);
          if (dt == SG_COMM_F32) {
            memcpy(sum[r] + i * 4, &f, 4);
          } else {
            uint16_t h = dt == SG_COMM_F16 ? sg__comm_f32_to_f16(f)
                                           : sg__comm_f32_to_bf16(f);
            memcpy(sum[r] + i * 2, &h, 2);
          }
        }
        memcpy(avg[r], sum[r], count * es);
        done_init(&d[r]);
        done_init(&d[3 + r]);
      }
      for (int r = 0; r < 3; r++)
        assert_int_equal(
            sg_comm_allreduce(g.c[r], sum[r], count, dt, SG_COMM_SUM,
                              sg_deadline_in_ms(30000), done_cb, &d[r], NULL),
            0);
      for (int r = 0; r < 3; r++)
        assert_int_equal(done_wait(&d[r], 60000), 0);
      for (int r = 0; r < 3; r++)
        assert_int_equal(sg_comm_allreduce(g.c[r], avg[r], count, dt,
                                           SG_COMM_AVG,
                                           sg_deadline_in_ms(30000), done_cb,
                                           &d[3 + r], NULL),
                         0);
      for (int r = 0; r < 3; r++)
        assert_int_equal(done_wait(&d[3 + r], 60000), 0);
      for (int r = 0; r < 3; r++) {
        sg__comm_scale_avg(dt, sum[r], count, 3);
        assert_memory_equal(sum[r], avg[r], count * es);
        free(sum[r]);
        free(avg[r]);
        done_destroy(&d[r]);
        done_destroy(&d[3 + r]);
      }
    }
    group_stop(&g);
  }
}

static void wait_all(struct group *g, struct done *d) {
  for (int r = 0; r < g->n; r++) {
    int rc = done_wait(&d[r], 30000);
    if (rc)
      fprintf(stderr, "rank %d: %d %s\n", r, rc, d[r].msg);
    assert_int_equal(rc, 0);
    done_destroy(&d[r]);
  }
}

static void test_broadcast(void **state) {
  for (int n = 1; n <= 4; n++) {
    struct group g;
    group_start(&g, n);
    size_t sizes[] = {0, 100, (size_t)1 << 20};
    for (size_t k = 0; k < 3; k++) {
      for (int root = 0; root < n; root++) {
        size_t len = sizes[k];
        uint8_t *buf[MAXW];
        struct done d[MAXW];
        for (int r = 0; r < n; r++) {
          buf[r] = malloc(len + 1);
          memset(buf[r], r == root ? 0 : 0xee, len);
          if (r == root)
            for (size_t i = 0; i < len; i++)
              buf[r][i] = (uint8_t)(i * 31 + (size_t)root);
          done_init(&d[r]);
          assert_int_equal(sg_comm_broadcast(g.c[r], buf[r], len, root,
                                             sg_deadline_in_ms(20000), done_cb,
                                             &d[r], NULL),
                           0);
        }
        wait_all(&g, d);
        for (int r = 0; r < n; r++)
          assert_memory_equal(buf[r], buf[root], len);
        for (int r = 0; r < n; r++)
          free(buf[r]);
      }
    }
    group_stop(&g);
  }
}

static void test_allgather_reduce_scatter(void **state) {
  for (int n = 1; n <= 4; n++) {
    struct group g;
    group_start(&g, n);
    size_t count = n == 3 ? 100003 : 5; /* one large, others small */
    /* allgather */
    int32_t *in[MAXW], *out[MAXW][MAXW];
    struct done d[MAXW];
    for (int r = 0; r < n; r++) {
      in[r] = malloc(count * 4);
      for (size_t i = 0; i < count; i++)
        in[r][i] = (int32_t)(r * 1000000 + (int)i);
      for (int q = 0; q < n; q++)
        out[r][q] = calloc(count, 4);
    }
    for (int r = 0; r < n; r++) {
      done_init(&d[r]);
      assert_int_equal(
          sg_comm_allgather(g.c[r], in[r], count * 4, (void *const *)out[r],
                            sg_deadline_in_ms(20000), done_cb, &d[r], NULL),
          0);
    }
    wait_all(&g, d);
    for (int r = 0; r < n; r++)
      for (int q = 0; q < n; q++)
        assert_memory_equal(out[r][q], in[q], count * 4);
    /* reduce_scatter: rank r gets sum over q of q's block r */
    int32_t *res[MAXW];
    for (int r = 0; r < n; r++) {
      res[r] = calloc(count, 4);
      for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
          out[r][q][i] = (int32_t)(r + 10 * q + (int)i);
    }
    for (int r = 0; r < n; r++) {
      done_init(&d[r]);
      assert_int_equal(sg_comm_reduce_scatter(
                           g.c[r], (const void *const *)out[r], res[r], count,
                           SG_COMM_I32, SG_COMM_SUM, sg_deadline_in_ms(20000),
                           done_cb, &d[r], NULL),
                       0);
    }
    wait_all(&g, d);
    for (int r = 0; r < n; r++) {
      for (size_t i = 0; i < count; i++) {
        int32_t want = 0;
        for (int q = 0; q < n; q++)
          want += q + 10 * r + (int32_t)i;
        assert_int_equal(res[r][i], want);
      }
      /* inputs are left alone */
      assert_int_equal(out[r][n - 1][1], r + 10 * (n - 1) + 1);
      free(res[r]);
      free(in[r]);
      for (int q = 0; q < n; q++)
        free(out[r][q]);
    }
    group_stop(&g);
  }
}

static void test_alltoall_sendrecv_barrier(void **state) {
  for (int n = 1; n <= 4; n++) {
    struct group g;
    group_start(&g, n);
    /* alltoall with uneven splits: block from q to r has q + r + 1 bytes */
    uint8_t *ins[MAXW][MAXW], *outs[MAXW][MAXW];
    size_t ib[MAXW][MAXW], ob[MAXW][MAXW];
    struct done d[MAXW];
    for (int r = 0; r < n; r++)
      for (int q = 0; q < n; q++) {
        ib[r][q] = ob[r][q] = (size_t)(q + r + 1) * 1000;
        ins[r][q] = malloc(ib[r][q]);
        memset(ins[r][q], r * 16 + q, ib[r][q]);
        outs[r][q] = calloc(1, ob[r][q]);
      }
    for (int r = 0; r < n; r++) {
      done_init(&d[r]);
      assert_int_equal(sg_comm_alltoall(g.c[r], (const void *const *)ins[r],
                                        ib[r], (void *const *)outs[r], ob[r],
                                        sg_deadline_in_ms(20000), done_cb,
                                        &d[r], NULL),
                       0);
    }
    wait_all(&g, d);
    for (int r = 0; r < n; r++)
      for (int q = 0; q < n; q++) {
        assert_memory_equal(outs[r][q], ins[q][r], ob[r][q]);
      }
    for (int r = 0; r < n; r++)
      for (int q = 0; q < n; q++) {
        free(ins[r][q]);
        free(outs[r][q]);
      }
    if (n >= 2) {
      /* send/recv between 0 and n-1 only; then a barrier for everyone */
      char msg[] = "hello over tcp", got[sizeof(msg)] = {0};
      struct done ds, dr;
      done_init(&ds);
      done_init(&dr);
      assert_int_equal(sg_comm_recv(g.c[n - 1], got, sizeof(got), 0,
                                    sg_deadline_in_ms(20000), done_cb, &dr,
                                    NULL),
                       0);
      assert_int_equal(sg_comm_send(g.c[0], msg, sizeof(msg), n - 1,
                                    sg_deadline_in_ms(20000), done_cb, &ds,
                                    NULL),
                       0);
      assert_int_equal(done_wait(&ds, 20000), 0);
      assert_int_equal(done_wait(&dr, 20000), 0);
      assert_string_equal(got, msg);
      done_destroy(&ds);
      done_destroy(&dr);
      sg_err_t err;
      assert_int_equal(sg_comm_send(g.c[0], msg, 1, 0, sg_deadline_in_ms(10),
                                    done_cb, &ds, &err),
                       SG_EINVAL); /* not to oneself */
    }
    for (int r = 0; r < n; r++) {
      done_init(&d[r]);
      assert_int_equal(sg_comm_barrier(g.c[r], sg_deadline_in_ms(20000),
                                       done_cb, &d[r], NULL),
                       0);
    }
    wait_all(&g, d);
    group_stop(&g);
  }
}

/* A barrier does not complete before the last rank enters it. */
static void test_barrier_waits(void **state) {
  struct group g;
  group_start(&g, 3);
  struct done d[3];
  for (int r = 0; r < 2; r++) {
    done_init(&d[r]);
    assert_int_equal(
        sg_comm_barrier(g.c[r], sg_deadline_in_ms(20000), done_cb, &d[r], NULL),
        0);
  }
  assert_int_equal(done_wait(&d[0], 200), 1); /* still waiting */
  assert_int_equal(done_wait(&d[1], 10), 1);
  done_init(&d[2]);
  assert_int_equal(
      sg_comm_barrier(g.c[2], sg_deadline_in_ms(20000), done_cb, &d[2], NULL),
      0);
  wait_all(&g, d);
  group_stop(&g);
}

/* ---- failures --------------------------------------------------------------
 */

struct abort_arg {
  sg_comm_t *c;
  int ms;
};

static void *abort_later(void *p) {
  struct abort_arg *a = p;
  usleep((useconds_t)a->ms * 1000);
  sg_comm_abort(a->c);
  return NULL;
}

/* Rank 1 never joins: abort from another thread ends rank 0's allreduce and
 * the one queued behind it with SG_EABORTED, long before their deadline. */
static void test_abort_from_thread(void **state) {
  struct group g;
  group_start(&g, 2);
  float buf[1000] = {0}, buf2[10] = {0};
  struct done d, d2;
  done_init(&d);
  done_init(&d2);
  assert_int_equal(sg_comm_allreduce(g.c[0], buf, 1000, SG_COMM_F32,
                                     SG_COMM_SUM, sg_deadline_in_ms(60000),
                                     done_cb, &d, NULL),
                   0);
  assert_int_equal(sg_comm_allreduce(g.c[0], buf2, 10, SG_COMM_F32, SG_COMM_SUM,
                                     sg_deadline_in_ms(60000), done_cb, &d2,
                                     NULL),
                   0);
  pthread_t th;
  struct abort_arg a = {g.c[0], 100};
  int64_t t0 = sg_now_ns();
  pthread_create(&th, NULL, abort_later, &a);
  assert_int_equal(done_wait(&d, 20000), SG_EABORTED);
  assert_int_equal(done_wait(&d2, 20000), SG_EABORTED);
  assert_true(sg_now_ns() - t0 < 20000ll * 1000 * 1000); /* not the 60 s */
  pthread_join(th, NULL);
  assert_int_equal(d.calls, 1);
  assert_int_equal(d2.calls, 1);
  /* later submissions are refused and never call back */
  sg_err_t err;
  struct done d3;
  done_init(&d3);
  assert_int_equal(
      sg_comm_barrier(g.c[0], sg_deadline_in_ms(1000), done_cb, &d3, &err),
      SG_EABORTED);
  assert_int_equal(sg_comm_error(g.c[0], &err), SG_EABORTED);
  assert_int_equal(d3.fired, 0);
  /* rank 1 sees rank 0 go away when it finally joins: the first
   * allreduce may still find rank 0's data in flight, the second cannot */
  struct done d4, d5;
  done_init(&d4);
  done_init(&d5);
  assert_int_equal(sg_comm_allreduce(g.c[1], buf, 1000, SG_COMM_F32,
                                     SG_COMM_SUM, sg_deadline_in_ms(20000),
                                     done_cb, &d5, NULL),
                   0);
  int rc5 = done_wait(&d5, 20000);
  assert_true(rc5 == 0 || rc5 == SG_EPEER);
  if (rc5 == 0)
    assert_int_equal(sg_comm_allreduce(g.c[1], buf2, 10, SG_COMM_F32,
                                       SG_COMM_SUM, sg_deadline_in_ms(20000),
                                       done_cb, &d4, NULL),
                     0);
  else
    d4 = d5;
  assert_int_equal(done_wait(&d4, 20000), SG_EPEER);
  assert_non_null(strstr(d4.msg, "rank 0"));
  done_destroy(&d);
  done_destroy(&d2);
  done_destroy(&d3);
  done_destroy(&d4);
  done_destroy(&d5);
  group_stop(&g);
}

/* Rank 2 never joins: the others time out at their deadline, naming who
 * they waited for, and the communicator is poisoned. */
static void test_deadline(void **state) {
  struct group g;
  group_start(&g, 3);
  int32_t buf[2][100000];
  struct done d[2];
  for (int r = 0; r < 2; r++) {
    done_init(&d[r]);
    assert_int_equal(sg_comm_allreduce(g.c[r], buf[r], 100000, SG_COMM_I32,
                                       SG_COMM_SUM, sg_deadline_in_ms(300),
                                       done_cb, &d[r], NULL),
                     0);
  }
  int waited_for_2 = 0;
  for (int r = 0; r < 2; r++) {
    int rc = done_wait(&d[r], 20000);
    assert_true(rc == SG_ETIMEDOUT || rc == SG_EPEER);
    waited_for_2 += strstr(d[r].msg, "rank 2") != NULL;
    assert_int_not_equal(sg_comm_error(g.c[r], NULL), 0);
    done_destroy(&d[r]);
  }
  assert_true(waited_for_2 >= 1);
  group_stop(&g);
}

/* Ranks that submit different operations fail with a protocol error. */
static void test_mismatch(void **state) {
  struct group g;
  group_start(&g, 2);
  int32_t a[10] = {0}, b[20] = {0};
  struct done d[2];
  done_init(&d[0]);
  done_init(&d[1]);
  assert_int_equal(sg_comm_allreduce(g.c[0], a, 10, SG_COMM_I32, SG_COMM_SUM,
                                     sg_deadline_in_ms(10000), done_cb, &d[0],
                                     NULL),
                   0);
  assert_int_equal(sg_comm_allreduce(g.c[1], b, 20, SG_COMM_I32, SG_COMM_SUM,
                                     sg_deadline_in_ms(10000), done_cb, &d[1],
                                     NULL),
                   0);
  int rc0 = done_wait(&d[0], 20000), rc1 = done_wait(&d[1], 20000);
  assert_true(rc0 == SG_EPROTO || rc1 == SG_EPROTO);
  assert_true(rc0 != 0 && rc1 != 0);
  assert_non_null(
      strstr(rc0 == SG_EPROTO ? d[0].msg : d[1].msg, "another operation"));
  done_destroy(&d[0]);
  done_destroy(&d[1]);
  group_stop(&g);
}

/* ---- quantized collectives ------------------------------------------------
 */

/* qerr: the bound on one quantization's error of v in a block of absmax
 * am (int8: half a step; fp8: half an ulp of 3 mantissa bits or half the
 * subnormal step), with slack for the float32 roundings. */
static double qerr(sg_comm_quant_t fmt, double v, double am) {
  double b = fmt == SG_COMM_QUANT_INT8
                 ? am / 127 / 2
                 : fmax(fabs(v) / 16, am / 448 * ldexp(1, -10));
  return b * 1.01 + fabs(v) * 1e-6 + 1e-30;
}

/* block_absmax: the largest |x| of element i's block within its part
 * [off, off + len). */
static double block_absmax(const float *x, size_t off, size_t len, size_t i) {
  size_t b = off + (i - off) / SG__QUANT_BLOCK * SG__QUANT_BLOCK;
  size_t e = b + SG__QUANT_BLOCK < off + len ? b + SG__QUANT_BLOCK : off + len;
  double am = 0;
  for (size_t k = b; k < e; k++)
    am = fmax(am, fabs((double)x[k]));
  return am;
}

/* Quantized allreduce and reduce-scatter on 1-4 ranks, both formats, SUM
 * and AVG: identical bits on every rank, within the error bound of two
 * quantizations of the exact result; the owner's result is the same bits
 * as everyone else's. */
static void test_quantized(void **state) {
  size_t counts[] = {0, 1, 1000, 5001};
  for (int n = 1; n <= 4; n++) {
    struct group g;
    group_start(&g, n);
    for (size_t ci = 0; ci < 4; ci++) {
      for (int fmt = 1; fmt <= 2; fmt++) {
        for (int avg = 0; avg <= 1; avg++) {
          size_t count = counts[ci];
          sg_comm_redop_t op = avg ? SG_COMM_AVG : SG_COMM_SUM;
          float *x[MAXW], *buf[MAXW], *rsin[MAXW], *rsout[MAXW];
          struct done d[MAXW], e[MAXW];
          for (int r = 0; r < n; r++) {
            x[r] = malloc((count + 1) * sizeof(float));
            buf[r] = malloc((count + 1) * sizeof(float));
            rsin[r] = malloc((count * (size_t)n + 1) * sizeof(float));
            rsout[r] = malloc((count + 1) * sizeof(float));
            for (size_t i = 0; i < count; i++) {
              double u = (double)(rnd() >> 11) / 9007199254740992.0 * 2 - 1;
              x[r][i] = (float)(i % 700 == 3 ? u * 1e6 : u); /* outliers */
            }
            memcpy(buf[r], x[r], count * sizeof(float));
            for (int p = 0; p < n; p++)
              memcpy(rsin[r] + (size_t)p * count, x[r], count * sizeof(float));
            done_init(&d[r]);
            done_init(&e[r]);
            assert_int_equal(sg_comm_allreduce_quantized(
                                 g.c[r], buf[r], count, (sg_comm_quant_t)fmt,
                                 op, sg_deadline_in_ms(20000), done_cb, &d[r],
                                 NULL),
                             0);
            assert_int_equal(
                sg_comm_reduce_scatter_quantized(
                    g.c[r], rsin[r], rsout[r], count, (sg_comm_quant_t)fmt, op,
                    sg_deadline_in_ms(20000), done_cb, &e[r], NULL),
                0);
          }
          wait_all(&g, d);
          wait_all(&g, e);
          for (int r = 1; r < n; r++)
            assert_memory_equal(buf[r], buf[0], count * sizeof(float));
          /* pass 0: the allreduce (element i's owner: its chunk's rank);
           * pass 1: rank r's reduce-scatter output (every rank's part r is
           * its x, one part of `count`, owned by r).  The owner's own
           * values are taken exactly, the others' quantized once, the
           * result quantized once more. */
          for (int pass = 0; pass < 2; pass++) {
            for (int r = 0; r < (pass ? n : 1); r++) {
              const float *got = pass ? rsout[r] : buf[0];
              for (size_t i = 0; i < count; i++) {
                size_t off = 0, len = count;
                int owner = r;
                if (!pass)
                  for (owner = 0; owner < n; owner++) {
                    sg__comm_chunk(count, n, owner, &off, &len);
                    if (i >= off && i < off + len)
                      break;
                  }
                double exact = 0, bound = 0, amsum = 0;
                for (int q = 0; q < n; q++) {
                  double am = block_absmax(x[q], off, len, i);
                  exact += x[q][i];
                  amsum += am;
                  if (q != owner)
                    bound += qerr((sg_comm_quant_t)fmt, x[q][i], am);
                }
                double scale = avg ? n : 1;
                bound = bound / scale + qerr((sg_comm_quant_t)fmt,
                                             (fabs(exact) + bound) / scale,
                                             (amsum + bound) / scale);
                exact /= scale;
                if (fabs((double)got[i] - exact) > bound)
                  fail_msg("n %d fmt %d avg %d pass %d r %d i %zu: %g vs %g "
                           "(bound %g)",
                           n, fmt, avg, pass, r, i, (double)got[i], exact,
                           bound);
              }
            }
          }
          for (int r = 0; r < n; r++) {
            free(x[r]);
            free(buf[r]);
            free(rsin[r]);
            free(rsout[r]);
          }
        }
      }
    }
    group_stop(&g);
  }
}

/* A NaN or an infinity on one rank fails the operation on every rank,
 * naming that rank; the buffers are left alone and the communicator goes
 * on working. */
static void test_quantized_nonfinite(void **state) {
  struct group g;
  group_start(&g, 3);
  for (int r = 0; r < 3; r++) /* many pieces: the NaN in a late one */
    g.c[r]->quant_chunk = SG__QUANT_BLOCK;
  float special[2] = {NAN, -INFINITY};
  for (int k = 0; k < 2; k++) {
    for (int rs = 0; rs <= 1; rs++) {
      size_t count = 3000;
      float *buf[3], *out[3];
      struct done d[3];
      for (int r = 0; r < 3; r++) {
        buf[r] = malloc(count * 3 * sizeof(float));
        out[r] = malloc(count * sizeof(float));
        for (size_t i = 0; i < count * 3; i++)
          buf[r][i] = (float)i;
        for (size_t i = 0; i < count; i++)
          out[r][i] = -1.0f;
        size_t at = rs ? 2 * count + 5 : k ? count - 3 : 17;
        if (r == 2)
          buf[r][at] = special[k];
        done_init(&d[r]);
        int rc =
            rs ? sg_comm_reduce_scatter_quantized(
                     g.c[r], buf[r], out[r], count, SG_COMM_QUANT_FP8,
                     SG_COMM_AVG, sg_deadline_in_ms(20000), done_cb, &d[r],
                     NULL)
               : sg_comm_allreduce_quantized(
                     g.c[r], buf[r], count, SG_COMM_QUANT_INT8, SG_COMM_SUM,
                     sg_deadline_in_ms(20000), done_cb, &d[r], NULL);
        assert_int_equal(rc, 0);
      }
      for (int r = 0; r < 3; r++) {
        assert_int_equal(done_wait(&d[r], 20000), SG_EINVAL);
        assert_non_null(strstr(d[r].msg, "NaN or infinity"));
        assert_non_null(strstr(d[r].msg, "rank 2"));
        done_destroy(&d[r]);
        for (size_t i = 0; i < count; i++) {
          assert_true(out[r][i] == -1.0f);
          if (!(r == 2 && i == (rs ? 2 * count + 5 : k ? count - 3 : 17)))
            assert_true(buf[r][i] == (float)i);
        }
        assert_int_equal(sg_comm_error(g.c[r], NULL), 0);
      }
      for (int r = 0; r < 3; r++) {
        free(buf[r]);
        free(out[r]);
      }
    }
  }
  /* still usable */
  int32_t v[3][4] = {{1, 2, 3, 4}, {1, 2, 3, 4}, {1, 2, 3, 4}};
  struct done d[3];
  for (int r = 0; r < 3; r++) {
    done_init(&d[r]);
    assert_int_equal(sg_comm_allreduce(g.c[r], v[r], 4, SG_COMM_I32,
                                       SG_COMM_SUM, sg_deadline_in_ms(20000),
                                       done_cb, &d[r], NULL),
                     0);
  }
  wait_all(&g, d);
  assert_int_equal(v[1][3], 12);
  group_stop(&g);
}

/* run_q: one quantized allreduce (rs = 0) or reduce-scatter of every
 * rank's in[r] (count elements, or n * count) into out[r], pieces of
 * `chunk` elements; returns every rank's status in rcs. */
static void run_q(struct group *g, int rs, float **in, float **out,
                  size_t count, int fmt, sg_comm_redop_t op, size_t chunk,
                  int *rcs, char msgs[][256]) {
  struct done d[MAXW];
  for (int r = 0; r < g->n; r++) {
    g->c[r]->quant_chunk = chunk; /* before the submission: no race */
    done_init(&d[r]);
    if (!rs)
      memcpy(out[r], in[r], count * sizeof(float));
    int rc = rs ? sg_comm_reduce_scatter_quantized(
                      g->c[r], in[r], out[r], count, (sg_comm_quant_t)fmt, op,
                      sg_deadline_in_ms(30000), done_cb, &d[r], NULL)
                : sg_comm_allreduce_quantized(
                      g->c[r], out[r], count, (sg_comm_quant_t)fmt, op,
                      sg_deadline_in_ms(30000), done_cb, &d[r], NULL);
    assert_int_equal(rc, 0);
  }
  for (int r = 0; r < g->n; r++) {
    rcs[r] = done_wait(&d[r], 40000);
    if (msgs)
      snprintf(msgs[r], 256, "%s", d[r].msg);
    done_destroy(&d[r]);
  }
}

/* The pipeline's pieces change nothing: cut into pieces of 1, 2 or 3
 * scale blocks (the last one short), the results have the bits of one
 * piece per part, on every rank, both formats, SUM and AVG, allreduce and
 * reduce-scatter. */
static void test_quantized_pieces(void **state) {
  for (int n = 2; n <= 4; n++) {
    struct group g;
    group_start(&g, n);
    size_t count = 7 * SG__QUANT_BLOCK * (size_t)n + 333;
    float *in[MAXW], *one[MAXW], *many[MAXW];
    for (int r = 0; r < n; r++) {
      in[r] = malloc(count * (size_t)n * sizeof(float));
      one[r] = malloc(count * sizeof(float));
      many[r] = malloc(count * sizeof(float));
      for (size_t i = 0; i < count * (size_t)n; i++) {
        double u = (double)(rnd() >> 11) / 9007199254740992.0 * 2 - 1;
        in[r][i] = (float)(i % 333 == 5 ? u * 1e4 : u);
      }
    }
    for (int fmt = 1; fmt <= 2; fmt++) {
      for (int avg = 0; avg <= 1; avg++) {
        for (int rs = 0; rs <= 1; rs++) {
          sg_comm_redop_t op = avg ? SG_COMM_AVG : SG_COMM_SUM;
          int rcs[MAXW];
          run_q(&g, rs, in, one, count, fmt, op, SG__QUANT_CHUNK, rcs, NULL);
          for (int r = 0; r < n; r++)
            assert_int_equal(rcs[r], 0);
          for (size_t k = 1; k <= 3; k++) {
            run_q(&g, rs, in, many, count, fmt, op, k * SG__QUANT_BLOCK, rcs,
                  NULL);
            for (int r = 0; r < n; r++) {
              assert_int_equal(rcs[r], 0);
              assert_memory_equal(many[r], one[r], count * sizeof(float));
              if (!rs)
                assert_memory_equal(many[r], many[0], count * sizeof(float));
            }
          }
        }
      }
    }
    for (int r = 0; r < n; r++) {
      free(in[r]);
      free(one[r]);
      free(many[r]);
    }
    group_stop(&g);
  }
}

/* A reduction that overflows float32 at one owner fails every rank alike,
 * naming the owner, with nothing written; the communicator goes on. */
static void test_quantized_overflow(void **state) {
  struct group g;
  group_start(&g, 3);
  size_t count = 3 * 4 * SG__QUANT_BLOCK;
  float *in[MAXW], *out[MAXW];
  char msgs[MAXW][256];
  for (int r = 0; r < 3; r++) {
    in[r] = malloc(count * 3 * sizeof(float));
    out[r] = malloc(count * 3 * sizeof(float));
    for (size_t i = 0; i < count * 3; i++)
      in[r][i] = (float)(i % 7);
  }
  for (int rs = 0; rs <= 1; rs++) {
    int rcs[MAXW];
    /* in rank 1's part (allreduce: the middle third of count), in its
     * last piece; or in rank 1's slice (reduce-scatter) */
    size_t at = rs ? 2 * count - 9 : count / 3 * 2 - 9;
    for (int r = 0; r < 3; r++) {
      in[r][count / 3 * 2 - 9] = (float)((count / 3 * 2 - 9) % 7);
      in[r][at] = 3e38f;
      for (size_t i = 0; i < count; i++)
        out[r][i] = -1.0f;
    }
    if (rs)
      run_q(&g, 1, in, out, count, SG_COMM_QUANT_INT8, SG_COMM_SUM,
            SG__QUANT_BLOCK, rcs, msgs);
    else /* run_q copies in to out first: check the copy is left */
      run_q(&g, 0, in, out, count, SG_COMM_QUANT_INT8, SG_COMM_SUM,
            SG__QUANT_BLOCK, rcs, msgs);
    for (int r = 0; r < 3; r++) {
      assert_int_equal(rcs[r], SG_EINVAL);
      assert_non_null(strstr(msgs[r], "overflowed"));
      assert_non_null(strstr(msgs[r], "at rank 1"));
      for (size_t i = 0; i < count; i++)
        assert_true(out[r][i] == (rs ? -1.0f : in[r][i]));
      assert_int_equal(sg_comm_error(g.c[r], NULL), 0);
    }
  }
  int rcs[MAXW];
  for (int r = 0; r < 3; r++)
    for (size_t i = 0; i < count; i++)
      in[r][i] = 1.0f;
  run_q(&g, 0, in, out, count, SG_COMM_QUANT_FP8, SG_COMM_SUM, SG__QUANT_BLOCK,
        rcs, NULL);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(rcs[r], 0);
    assert_true(fabsf(out[r][count - 1] - 3.0f) < 0.05f);
    free(in[r]);
    free(out[r]);
  }
  group_stop(&g);
}

/* Ranks that disagree on the format or the operator fail with a protocol
 * error; bad arguments are refused at submission. */
static void test_quantized_mismatch(void **state) {
  struct group g;
  group_start(&g, 2);
  float a[100] = {1}, b[100] = {2};
  struct done d[2];
  assert_int_equal(sg_comm_allreduce_quantized(
                       g.c[0], a, 100, SG_COMM_QUANT_INT8, SG_COMM_MAX,
                       sg_deadline_in_ms(1000), done_cb, &d[0], NULL),
                   SG_EINVAL);
  assert_int_equal(sg_comm_allreduce_quantized(
                       g.c[0], a, 100, (sg_comm_quant_t)0, SG_COMM_SUM,
                       sg_deadline_in_ms(1000), done_cb, &d[0], NULL),
                   SG_EINVAL);
  done_init(&d[0]);
  done_init(&d[1]);
  assert_int_equal(sg_comm_allreduce_quantized(
                       g.c[0], a, 100, SG_COMM_QUANT_INT8, SG_COMM_SUM,
                       sg_deadline_in_ms(10000), done_cb, &d[0], NULL),
                   0);
  assert_int_equal(sg_comm_allreduce_quantized(
                       g.c[1], b, 100, SG_COMM_QUANT_FP8, SG_COMM_SUM,
                       sg_deadline_in_ms(10000), done_cb, &d[1], NULL),
                   0);
  int rc0 = done_wait(&d[0], 20000), rc1 = done_wait(&d[1], 20000);
  assert_true(rc0 == SG_EPROTO || rc1 == SG_EPROTO);
  assert_true(rc0 != 0 && rc1 != 0);
  assert_true(a[0] == 1.0f && b[0] == 2.0f);
  done_destroy(&d[0]);
  done_destroy(&d[1]);
  group_stop(&g);
}

/* Closing with work queued completes it with SG_ECANCELED. */
static void test_free_cancels(void **state) {
  struct group g;
  group_start(&g, 2);
  float buf[3][100] = {{0}};
  struct done d[3];
  for (int i = 0; i < 3; i++) {
    done_init(&d[i]);
    assert_int_equal(sg_comm_allreduce(g.c[0], buf[i], 100, SG_COMM_F32,
                                       SG_COMM_SUM, sg_deadline_in_ms(60000),
                                       done_cb, &d[i], NULL),
                     0);
  }
  sg_comm_free(g.c[0]);
  g.c[0] = NULL;
  for (int i = 0; i < 3; i++) {
    assert_int_equal(d[i].fired, 1);
    assert_int_equal(d[i].calls, 1);
    assert_int_equal(d[i].rc, SG_ECANCELED);
    done_destroy(&d[i]);
  }
  group_stop(&g);
}

/* A clean close says BYE: the peer's next operation fails at once, naming
 * the rank that left. */
static void test_bye(void **state) {
  struct group g;
  group_start(&g, 2);
  sg_comm_free(g.c[1]);
  g.c[1] = NULL;
  int32_t a[4] = {0};
  struct done d;
  done_init(&d);
  assert_int_equal(sg_comm_allreduce(g.c[0], a, 4, SG_COMM_I32, SG_COMM_SUM,
                                     sg_deadline_in_ms(20000), done_cb, &d,
                                     NULL),
                   0);
  assert_int_equal(done_wait(&d, 20000), SG_EPEER);
  assert_non_null(strstr(d.msg, "rank 1"));
  done_destroy(&d);
  group_stop(&g);
}

/* ---- handshakes -------------------------------------------------------------
 */

struct one_conn {
  sg_comm_t *c;
  const char *const *addrs;
  int ms, rc;
  sg_err_t err;
};

static void *one_connect(void *p) {
  struct one_conn *a = p;
  a->rc = sg_comm_connect(a->c, a->addrs, sg_deadline_in_ms(a->ms), &a->err);
  return NULL;
}

static sg_comm_t *mk_sh(int rank, int world, uint64_t gen, const char *token,
                        int same_host) {
  sg_comm_opts_t o = {.rank = rank,
                      .world_size = world,
                      .generation = gen,
                      .job = "job",
                      .auth_token = token,
                      .bind_host = "127.0.0.1",
                      .same_host = same_host,
                      .pull_min = 1};
  sg_comm_t *c = NULL;
  assert_int_equal(sg_comm_new(&o, &c, NULL), 0);
  return c;
}

static sg_comm_t *mk(int rank, int world, uint64_t gen, const char *token) {
  return mk_sh(rank, world, gen, token, 0);
}

/* raw_client: connect a plain socket to c's port and send `n` bytes. */
static int raw_client(sg_comm_t *c, const void *bytes, size_t n) {
  int fd;
  sg_err_t err;
  assert_int_equal(sg_sock_connect("127.0.0.1", sg_comm_port(c),
                                   sg_deadline_in_ms(5000), &fd, &err),
                   0);
  if (n)
    assert_int_equal(send(fd, bytes, n, MSG_NOSIGNAL), (ssize_t)n);
  return fd;
}

/* raw_closed: whether the server closed fd (reading past any reply). */
static int raw_closed(int fd, int ms) {
  uint8_t b[256];
  sg_deadline_t d = sg_deadline_in_ms(ms);
  while (!sg_deadline_passed(d)) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 50) == 1) {
      ssize_t m = recv(fd, b, sizeof(b), 0);
      if (m <= 0)
        return 1;
    }
  }
  return 0;
}

static void test_handshake_rejects(void **state) {
  sg_comm_t *c0 = mk(0, 2, 5, "tok");
  char addr0[64];
  snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", sg_comm_port(c0));
  const char *addrs[2] = {addr0, "127.0.0.1:1"};
  struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 20000};
  pthread_t th0;
  pthread_create(&th0, NULL, one_connect, &a0);

  /* garbage, an oversized hello, a silent peer: each is dropped */
  int g1 = raw_client(c0, "GET / HTTP/1.1\r\n\r\n", 18);
  assert_true(raw_closed(g1, 5000));
  sg_sock_close(g1);
  uint8_t big[SG__COMM_HELLO_MAX + 64];
  int hl = sg__comm_hello_encode(big, 5, 1, 2, "job", "tok");
  big[24] = 0xff; /* job length over the limit */
  big[25] = 0x7f;
  int g2 = raw_client(c0, big, (size_t)hl);
  assert_true(raw_closed(g2, 5000));
  sg_sock_close(g2);
  int slow = raw_client(c0, "SG", 2); /* slowloris: holds a slot */
  /* truncated hello then EOF */
  int g3 = raw_client(c0, big, 10);
  shutdown(g3, SHUT_WR);
  assert_true(raw_closed(g3, 5000));
  sg_sock_close(g3);

  /* wrong generation: refused, with the reason on the dialling side */
  sg_comm_t *bad = mk(1, 2, 4, "tok");
  sg_err_t err;
  assert_int_equal(sg_comm_connect(bad, addrs, sg_deadline_in_ms(5000), &err),
                   SG_EPROTO);
  assert_non_null(strstr(err.msg, "rank 0"));
  assert_int_not_equal(sg_comm_error(bad, NULL), 0);
  sg_comm_free(bad);
  /* wrong token */
  bad = mk(1, 2, 5, "nope");
  assert_int_equal(sg_comm_connect(bad, addrs, sg_deadline_in_ms(5000), &err),
                   SG_EAUTH);
  sg_comm_free(bad);
  /* the real rank 1 still gets in */
  sg_comm_t *c1 = mk(1, 2, 5, "tok");
  assert_int_equal(sg_comm_connect(c1, addrs, sg_deadline_in_ms(5000), &err),
                   0);
  pthread_join(th0, NULL);
  assert_int_equal(a0.rc, 0);
  /* once the mesh is complete nobody listens: a late or duplicate rank 1
   * is refused by the kernel */
  sg_comm_t *late = mk(1, 2, 5, "tok");
  assert_int_equal(sg_comm_connect(late, addrs, sg_deadline_in_ms(300), &err),
                   SG_ETIMEDOUT);
  assert_non_null(strstr(err.msg, "rank 0"));
  sg_comm_free(late);
  int32_t v0 = 1, v1 = 2;
  struct done d0, d1;
  done_init(&d0);
  done_init(&d1);
  sg_comm_allreduce(c0, &v0, 1, SG_COMM_I32, SG_COMM_SUM,
                    sg_deadline_in_ms(5000), done_cb, &d0, NULL);
  sg_comm_allreduce(c1, &v1, 1, SG_COMM_I32, SG_COMM_SUM,
                    sg_deadline_in_ms(5000), done_cb, &d1, NULL);
  assert_int_equal(done_wait(&d0, 10000), 0);
  assert_int_equal(done_wait(&d1, 10000), 0);
  assert_int_equal(v0, 3);
  assert_int_equal(v1, 3);
  done_destroy(&d0);
  done_destroy(&d1);
  sg_sock_close(slow);
  sg_comm_free(c0);
  sg_comm_free(c1);
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* fake_rank1_offer: handshake with c0 as rank 1 of 2 over a raw socket,
 * then send `offer` (NULL: one that declines the same-host path) and the
 * answer "rank 1 will not read rank 0's memory".  Returns the socket. */
static int fake_rank1_offer(sg_comm_t *c0, uint64_t gen,
                            const sg__comm_offer_t *offer) {
  uint8_t hello[SG__COMM_HELLO_MAX], reply[SG__COMM_REPLY_LEN];
  int n = sg__comm_hello_encode(hello, gen, 1, 2, "job", "tok");
  int fd = raw_client(c0, hello, (size_t)n);
  size_t got = 0;
  while (got < sizeof(reply)) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 5000), 1);
    ssize_t m = recv(fd, reply + got, sizeof(reply) - got, 0);
    assert_true(m > 0);
    got += (size_t)m;
  }
  sg__comm_reply_t r;
  assert_int_equal(sg__comm_reply_parse(reply, got, &r), SG__COMM_REPLY_LEN);
  assert_int_equal(r.status, 0);
  sg__comm_offer_t none;
  memset(&none, 0, sizeof(none));
  uint8_t b[SG__COMM_OFFER_LEN + SG__COMM_FRAME_LEN];
  sg__comm_offer_encode(b, offer ? offer : &none);
  sg__comm_frame_t f = {.type = SG__COMM_FRAME_PULL, .seq = 0};
  sg__comm_frame_encode(b + SG__COMM_OFFER_LEN, &f);
  assert_int_equal(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
  return fd;
}

static int fake_rank1(sg_comm_t *c0, uint64_t gen) {
  return fake_rank1_offer(c0, gen, NULL);
}

struct bad_peer_case {
  const char *name;
  uint8_t bytes[64];
  size_t len;
  int close_after; /* then close: a peer that vanishes mid-frame */
  int want;        /* rank 0's error */
  const char *want_msg;
};

/* A peer that completed the handshake and then speaks wrongly: garbage, a
 * frame of another operation, a length that does not match, a truncated
 * frame, a peer that stalls.  Each fails rank 0's allreduce with the
 * rank named; nothing crashes or hangs. */
static void test_bad_peer_frames(void **state) {
  struct bad_peer_case cases[6];
  memset(cases, 0, sizeof(cases));
  sg__comm_frame_t f = {
      .type = SG__COMM_FRAME_OP, .kind = 1, .seq = 0, .bytes = 16};
  cases[0] = (struct bad_peer_case){.name = "garbage",
                                    .len = 24,
                                    .want = SG_EPROTO,
                                    .want_msg = "malformed frame"};
  memset(cases[0].bytes, 'x', 24);
  f.kind = 2; /* broadcast where an allreduce is expected */
  sg__comm_frame_encode(cases[1].bytes, &f);
  cases[1].len = 24;
  cases[1].want = SG_EPROTO;
  cases[1].want_msg = "another operation";
  f.kind = 1;
  f.bytes = (uint64_t)1 << 60; /* a huge length */
  sg__comm_frame_encode(cases[2].bytes, &f);
  cases[2].len = 24;
  cases[2].want = SG_EPROTO;
  cases[2].want_msg = "another operation";
  f.bytes = 16;
  f.seq = 5; /* out of order */
  sg__comm_frame_encode(cases[3].bytes, &f);
  cases[3].len = 24;
  cases[3].want = SG_EPROTO;
  cases[3].want_msg = "another operation";
  f.seq = 0;
  sg__comm_frame_encode(cases[4].bytes, &f); /* truncated payload, then EOF */
  cases[4].len = 30;
  cases[4].close_after = 1;
  cases[4].want = SG_EPEER;
  cases[4].want_msg = "rank 1";
  cases[5].len = 0; /* says nothing: the deadline ends it */
  cases[5].want = SG_ETIMEDOUT;
  cases[5].want_msg = "rank 1";
  for (size_t i = 0; i < 6; i++) {
    sg_comm_t *c0 = mk(0, 2, 9, "tok");
    char addr0[64];
    snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", sg_comm_port(c0));
    const char *addrs[2] = {addr0, "127.0.0.1:1"};
    struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 10000};
    pthread_t th0;
    pthread_create(&th0, NULL, one_connect, &a0);
    int fd = fake_rank1(c0, 9);
    pthread_join(th0, NULL);
    assert_int_equal(a0.rc, 0);
    if (cases[i].len)
      assert_int_equal(send(fd, cases[i].bytes, cases[i].len, MSG_NOSIGNAL),
                       (ssize_t)cases[i].len);
    if (cases[i].close_after)
      shutdown(fd, SHUT_WR);
    int32_t v[4] = {1, 2, 3, 4};
    struct done d;
    done_init(&d);
    assert_int_equal(sg_comm_allreduce(c0, v, 4, SG_COMM_I32, SG_COMM_SUM,
                                       sg_deadline_in_ms(300), done_cb, &d,
                                       NULL),
                     0);
    int rc = done_wait(&d, 10000);
    if (rc != cases[i].want)
      fprintf(stderr, "case %zu: %d %s\n", i, rc, d.msg);
    assert_int_equal(rc, cases[i].want);
    assert_non_null(strstr(d.msg, cases[i].want_msg));
    assert_non_null(strstr(d.msg, "rank 1"));
    assert_int_equal(sg_comm_error(c0, NULL), rc); /* poisoned */
    done_destroy(&d);
    sg_sock_close(fd);
    sg_comm_free(c0);
  }
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* ---- liveness: KEEPALIVE frames and the progress deadline ----------------
 */

/* read_keepalives: read what rank 0 sent the raw peer for `ms`; the number
 * of KEEPALIVE frames.  Anything else must be an OP frame and its payload
 * (*skip: payload bytes still to come). */
static int read_keepalives(int fd, int ms, size_t *skip) {
  uint8_t b[SG__COMM_FRAME_LEN];
  size_t got = 0;
  int n = 0;
  sg_deadline_t dl = sg_deadline_in_ms(ms);
  while (!sg_deadline_passed(dl)) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, (int)sg_deadline_left_ms(dl)) != 1)
      break;
    uint8_t junk[64];
    ssize_t m = *skip ? recv(fd, junk, *skip < 64 ? *skip : 64, MSG_DONTWAIT)
                      : recv(fd, b + got, sizeof(b) - got, MSG_DONTWAIT);
    if (m <= 0)
      break;
    if (*skip) {
      *skip -= (size_t)m;
      continue;
    }
    got += (size_t)m;
    if (got == sizeof(b)) {
      sg__comm_frame_t f;
      assert_int_equal(sg__comm_frame_parse(b, sizeof(b), &f), 0);
      if (f.type == SG__COMM_FRAME_OP)
        *skip = (size_t)f.bytes;
      else
        assert_int_equal(f.type, SG__COMM_FRAME_KEEPALIVE);
      n += f.type == SG__COMM_FRAME_KEEPALIVE;
      got = 0;
    }
  }
  return n;
}

/* A peer that completed the handshake and then sends nothing at all (a
 * process stopped by SIGSTOP, a cut cable): rank 0's allreduce, with a 60 s
 * deadline, fails after the 500 ms progress deadline, naming the peer's
 * rank and address.  Before that, rank 0 kept the quiet connection alive
 * with KEEPALIVEs, idle and in the operation.  A peer that only sends
 * KEEPALIVEs (alive, still computing) keeps the operation waiting until
 * its own deadline. */
static void test_progress_deadline(void **state) {
  for (int alive = 0; alive < 2; alive++) {
    sg_comm_opts_t o = {.rank = 0,
                        .world_size = 2,
                        .generation = 9,
                        .job = "job",
                        .auth_token = "tok",
                        .bind_host = "127.0.0.1",
                        .pull_min = 1,
                        .progress_timeout_ms = 500};
    sg_comm_t *c0 = NULL;
    assert_int_equal(sg_comm_new(&o, &c0, NULL), 0);
    char addr0[64];
    snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", sg_comm_port(c0));
    const char *addrs[2] = {addr0, "127.0.0.1:1"};
    struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 10000};
    pthread_t th0;
    pthread_create(&th0, NULL, one_connect, &a0);
    int fd = fake_rank1(c0, 9);
    pthread_join(th0, NULL);
    assert_int_equal(a0.rc, 0);
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&me, &ml), 0);
    char want_addr[64];
    snprintf(want_addr, sizeof(want_addr), "127.0.0.1:%d", ntohs(me.sin_port));
    uint8_t setup[SG__COMM_OFFER_LEN + SG__COMM_FRAME_LEN]; /* OFFER, PULL */
    for (size_t got = 0; got < sizeof(setup);) {
      ssize_t m = recv(fd, setup + got, sizeof(setup) - got, 0);
      assert_true(m > 0);
      got += (size_t)m;
    }
    /* idle: a KEEPALIVE at least every 125 ms (a quarter of 500 ms) */
    size_t skip = 0;
    int idle_ka = read_keepalives(fd, 600, &skip);
    assert_true(idle_ka >= 3);

    int32_t v[4] = {1, 2, 3, 4};
    struct done d;
    done_init(&d);
    int64_t t0 = sg_now_ns();
    assert_int_equal(sg_comm_allreduce(c0, v, 4, SG_COMM_I32, SG_COMM_SUM,
                                       sg_deadline_in_ms(alive ? 2000 : 60000),
                                       done_cb, &d, NULL),
                     0);
    int op_ka = 0;
    while (done_wait(&d, 0) == 1 && sg_now_ns() - t0 < 10000000000ll) {
      if (alive) { /* "still here", every 100 ms */
        uint8_t k[SG__COMM_FRAME_LEN];
        sg__comm_frame_t f = {.type = SG__COMM_FRAME_KEEPALIVE};
        sg__comm_frame_encode(k, &f);
        assert_int_equal(send(fd, k, sizeof(k), MSG_NOSIGNAL),
                         (ssize_t)sizeof(k));
      }
      op_ka += read_keepalives(fd, 100, &skip);
    }
    int rc = done_wait(&d, 10000);
    double took = (double)(sg_now_ns() - t0) / 1e9;
    fprintf(stderr,
            "%s peer: rc %d after %.2f s (%d KEEPALIVEs idle, %d in "
            "the op): %s\n",
            alive ? "live" : "silent", rc, took, idle_ka, op_ka, d.msg);
    if (alive) {
      assert_int_equal(rc, SG_ETIMEDOUT); /* its own deadline, not liveness */
      assert_true(took >= 1.9);
    } else {
      assert_int_equal(rc, SG_EPEER);
      assert_non_null(strstr(d.msg, "rank 1"));
      assert_non_null(strstr(d.msg, want_addr));
      assert_non_null(strstr(d.msg, "progress deadline"));
      /* the 500 ms progress deadline, not the 60 s one (loose for
       * sanitizers on a busy host) */
      assert_true(took >= 0.45 && took < 30.0);
    }
    assert_true(op_ka >= 2);
    assert_int_equal(sg_comm_error(c0, NULL), rc); /* poisoned */
    done_destroy(&d);
    sg_sock_close(fd);
    sg_comm_free(c0);
  }
  assert_int_equal(sg_sock_registered_count(), 0);
}

struct late_arg {
  sg_comm_t *c;
  int32_t *buf;
  size_t count;
  int delay_ms;
  struct done *d;
};

static void *late_allreduce(void *p) {
  struct late_arg *a = p;
  usleep((useconds_t)a->delay_ms * 1000);
  assert_int_equal(sg_comm_allreduce(a->c, a->buf, a->count, SG_COMM_I32,
                                     SG_COMM_SUM, sg_deadline_in_ms(60000),
                                     done_cb, a->d, NULL),
                   0);
  return NULL;
}

/* A rank that is alive but enters the allreduce three progress deadlines
 * late (it was still computing): the others wait on it, in a 3-rank ring
 * also mid-operation (a rank whose next chunk waits for the late rank's
 * data sends nothing on its own), and the KEEPALIVEs keep everyone alive:
 * the result is right.  Then the same after the group sat idle for as
 * long, and with each rank as the late one. */
static void test_progress_late_peer(void **state) {
  test_progress_ms = 300;
  for (int n = 2; n <= 3; n++) {
    struct group g;
    group_start_opts(&g, n, 1); /* small_max 1: the ring */
    for (int late = 0; late < n; late++) {
      enum { COUNT = 200000 };
      static int32_t buf[3][COUNT];
      struct done d[3];
      struct late_arg a[3];
      pthread_t th[3];
      for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < COUNT; i++)
          buf[r][i] = (int32_t)(i % 1000) + r;
        done_init(&d[r]);
        a[r] = (struct late_arg){g.c[r], buf[r], COUNT,
                                 r == late ? 3 * test_progress_ms : 0, &d[r]};
        pthread_create(&th[r], NULL, late_allreduce, &a[r]);
      }
      for (int r = 0; r < n; r++) {
        pthread_join(th[r], NULL);
        int rc = done_wait(&d[r], 20000);
        if (rc)
          fprintf(stderr, "n %d late %d rank %d: %d %s\n", n, late, r, rc,
                  d[r].msg);
        assert_int_equal(rc, 0);
        for (size_t i = 0; i < COUNT; i += 997)
          assert_int_equal(buf[r][i],
                           n * (int32_t)(i % 1000) + n * (n - 1) / 2);
        done_destroy(&d[r]);
      }
      usleep(3 * test_progress_ms * 1000); /* idle: KEEPALIVEs only */
    }
    group_stop(&g);
  }
  test_progress_ms = 0;
}

/* The peer's memory that the same-host bad-peer cases describe. */
static const int32_t fake_payload[4] = {10, 20, 30, 40};
static const uint8_t fake_probe[SG__COMM_PROBE_LEN] = {1, 2, 3, 4, 5};

/* A peer that offers the same-host path (rank 0 reads this process's
 * memory: same_host = 1) and then describes its payload wrongly: a header
 * that does not say DESC, an address the kernel will not read, a length
 * over the payload, garbage or a frame out of place where a DESC belongs,
 * a truncated DESC then EOF.  Each fails rank 0's allreduce with rank 1
 * named; a well-formed DESC gives the right sum, and a garbage OFFER fails
 * the connect with rank 1 named. */
static void test_samehost_bad_peer(void **state) {
  sg_samehost_id_t self;
  if (sg_samehost_self(&self) != 0) {
    fprintf(stderr, "skipped: the same-host path is off here "
                    "($STEPGUARD_SAME_HOST=0 or no /proc)\n");
    return;
  }
  sg__comm_offer_t offer;
  memset(&offer, 0, sizeof(offer));
  offer.flags = 1;
  sg_samehost_encode(&self, offer.id);
  offer.probe_addr = (uint64_t)(uintptr_t)fake_probe;
  memcpy(offer.probe, fake_probe, SG__COMM_PROBE_LEN);

  enum { NCASE = 8 };
  struct {
    uint16_t flags;
    sg__comm_frame_t desc;
    size_t desc_len; /* bytes of desc sent (24, less = truncated + EOF);
                        0x100: then the connection closes */
    int want;
    const char *want_msg;
  } cases[NCASE] = {
      {0, {.type = SG__COMM_FRAME_DESC}, 0, SG_EPROTO, "same-host path"},
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_DESC, .seq = 8, .bytes = 16},
       24,
       SG_EPEER,
       "cannot read its memory"},
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_DESC,
        .seq = (uint64_t)(uintptr_t)fake_payload,
        .bytes = (uint64_t)1 << 40},
       24,
       SG_EPROTO,
       "bad descriptor"},
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_ACK, .kind = 1, .bytes = 16},
       24,
       SG_EPROTO,
       "bad descriptor"},
      {SG__COMM_OP_PULL, {.type = 0}, 24, SG_EPROTO, "bad descriptor"},
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_DESC,
        .seq = (uint64_t)(uintptr_t)fake_payload,
        .bytes = 16},
       10,
       SG_EPEER,
       "rank 1"},
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_DESC,
        .seq = (uint64_t)(uintptr_t)fake_payload,
        .bytes = 16},
       24,
       0,
       ""},
      /* a well-formed DESC, then the peer's connection closes while its
       * memory stays readable, as when it dies and its pid goes to another
       * process: the bytes read must not be used */
      {SG__COMM_OP_PULL,
       {.type = SG__COMM_FRAME_DESC,
        .seq = (uint64_t)(uintptr_t)fake_payload,
        .bytes = 16},
       24 | 0x100,
       SG_EPEER,
       "closed while its memory was read"},
  };
  for (int i = 0; i < NCASE; i++) {
    sg_comm_t *c0 = mk_sh(0, 2, 9, "tok", 1);
    char addr0[64];
    snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", sg_comm_port(c0));
    const char *addrs[2] = {addr0, "127.0.0.1:1"};
    struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 10000};
    pthread_t th0;
    pthread_create(&th0, NULL, one_connect, &a0);
    int fd = fake_rank1_offer(c0, 9, &offer);
    pthread_join(th0, NULL);
    assert_int_equal(a0.rc, 0);
    assert_int_equal(sg_comm_same_host(c0, 1), 1);
    uint8_t b[2 * SG__COMM_FRAME_LEN];
    sg__comm_frame_t op = {.type = SG__COMM_FRAME_OP,
                           .kind = 1,
                           .flags = cases[i].flags,
                           .seq = 0,
                           .bytes = 16};
    sg__comm_frame_encode(b, &op);
    if (cases[i].desc.type)
      sg__comm_frame_encode(b + SG__COMM_FRAME_LEN, &cases[i].desc);
    else
      memset(b + SG__COMM_FRAME_LEN, 'x', SG__COMM_FRAME_LEN);
    size_t dl = cases[i].desc_len & 0xff, hang_up = cases[i].desc_len & 0x100;
    size_t n = SG__COMM_FRAME_LEN + (cases[i].flags ? dl : 16);
    assert_int_equal(send(fd, b, n, MSG_NOSIGNAL), (ssize_t)n);
    if (hang_up || (dl && dl < SG__COMM_FRAME_LEN))
      shutdown(fd, SHUT_WR);
    int32_t v[4] = {1, 2, 3, 4};
    struct done d;
    done_init(&d);
    assert_int_equal(sg_comm_allreduce(c0, v, 4, SG_COMM_I32, SG_COMM_SUM,
                                       sg_deadline_in_ms(5000), done_cb, &d,
                                       NULL),
                     0);
    int rc = done_wait(&d, 10000);
    if (rc != cases[i].want)
      fprintf(stderr, "case %d: %d %s\n", i, rc, d.msg);
    assert_int_equal(rc, cases[i].want);
    if (rc == 0) {
      for (int k = 0; k < 4; k++)
        assert_int_equal(v[k], fake_payload[k] + k + 1);
    } else {
      assert_non_null(strstr(d.msg, cases[i].want_msg));
      assert_non_null(strstr(d.msg, "rank 1"));
      assert_int_equal(sg_comm_error(c0, NULL), rc);
    }
    done_destroy(&d);
    sg_sock_close(fd);
    sg_comm_free(c0);
  }

  /* a garbage OFFER: the connect fails and names the peer */
  sg_comm_t *c0 = mk_sh(0, 2, 9, "tok", 1);
  char addr0[64];
  snprintf(addr0, sizeof(addr0), "127.0.0.1:%d", sg_comm_port(c0));
  const char *addrs[2] = {addr0, "127.0.0.1:1"};
  struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 10000};
  pthread_t th0;
  pthread_create(&th0, NULL, one_connect, &a0);
  uint8_t hello[SG__COMM_HELLO_MAX];
  int hl = sg__comm_hello_encode(hello, 9, 1, 2, "job", "tok");
  uint8_t junk[SG__COMM_OFFER_LEN];
  memset(junk, 'z', sizeof(junk));
  int fd = raw_client(c0, hello, (size_t)hl);
  uint8_t reply[SG__COMM_REPLY_LEN];
  size_t got = 0;
  while (got < sizeof(reply)) { /* the reply, then the junk */
    struct pollfd pl = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pl, 1, 5000), 1);
    ssize_t m = recv(fd, reply + got, sizeof(reply) - got, 0);
    assert_true(m > 0);
    got += (size_t)m;
  }
  assert_int_equal(send(fd, junk, sizeof(junk), MSG_NOSIGNAL),
                   (ssize_t)sizeof(junk));
  pthread_join(th0, NULL);
  assert_int_equal(a0.rc, SG_EPROTO);
  assert_non_null(strstr(a0.err.msg, "rank 1"));
  assert_non_null(strstr(a0.err.msg, "same-host offer"));
  sg_sock_close(fd);
  sg_comm_free(c0);
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* sndbuf_of_port: SO_SNDBUF of this process's TCP socket whose local or
 * peer port is `port`, or -1. */
static int sndbuf_of_port(int port) {
  for (int fd = 3; fd < 1024; fd++) {
    struct sockaddr_in a, b;
    socklen_t la = sizeof(a), lb = sizeof(b);
    int ty = 0, v = 0;
    socklen_t lt = sizeof(ty), lv = sizeof(v);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &ty, &lt) != 0 ||
        ty != SOCK_STREAM || getsockname(fd, (struct sockaddr *)&a, &la) != 0 ||
        getpeername(fd, (struct sockaddr *)&b, &lb) != 0 ||
        a.sin_family != AF_INET)
      continue;
    if ((ntohs(a.sin_port) == port || ntohs(b.sin_port) == port) &&
        getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &lv) == 0)
      return v;
  }
  return -1;
}

/* Connections whose two ends have the same address (both processes on this
 * host) get a small fixed send buffer; others keep the autotuned one.
 * 127.0.0.2 is this host too, but a connection to it from 127.0.0.1 has
 * two different addresses, which is what a connection between hosts looks
 * like to the library. */
static void test_loopback_sndbuf(void **state) {
  const char *hosts[2] = {"127.0.0.1", "127.0.0.2"};
  for (int k = 0; k < 2; k++) {
    sg_comm_opts_t o0 = {.rank = 0,
                         .world_size = 2,
                         .generation = 4,
                         .bind_host = hosts[k],
                         .same_host = -1};
    sg_comm_opts_t o1 = o0;
    o1.rank = 1;
    o1.bind_host = "127.0.0.1";
    sg_comm_t *c0 = NULL, *c1 = NULL;
    assert_int_equal(sg_comm_new(&o0, &c0, NULL), 0);
    assert_int_equal(sg_comm_new(&o1, &c1, NULL), 0);
    int port = sg_comm_port(c0);
    char addr0[64], addr1[64];
    snprintf(addr0, sizeof(addr0), "%s:%d", hosts[k], port);
    snprintf(addr1, sizeof(addr1), "127.0.0.1:%d", sg_comm_port(c1));
    const char *addrs[2] = {addr0, addr1};
    struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 10000};
    struct one_conn a1 = {.c = c1, .addrs = addrs, .ms = 10000};
    pthread_t th0, th1;
    pthread_create(&th0, NULL, one_connect, &a0);
    pthread_create(&th1, NULL, one_connect, &a1);
    pthread_join(th0, NULL);
    pthread_join(th1, NULL);
    assert_int_equal(a0.rc, 0);
    assert_int_equal(a1.rc, 0);
    int v = sndbuf_of_port(port); /* Linux reports twice what was set */
    if (k == 0)
      assert_int_equal(v, 2 * (256 << 10));
    else
      assert_true(v > 0 && v != 2 * (256 << 10));
    sg_comm_free(c0);
    sg_comm_free(c1);
  }
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* Every allocation of creating a communicator and submitting to it may
 * fail: each failure is an error return, never a crash, callback or leak
 * (ASan checks the leaks). */
static void test_alloc_failures(void **state) {
  for (long nth = 1; nth < 40; nth++) {
    sg_comm_opts_t o = {.rank = 0, .world_size = 1, .job = "j"};
    sg_comm_t *c = NULL;
    sg_test_fail_alloc(nth, 1);
    int rc = sg_comm_new(&o, &c, NULL);
    sg_test_fail_alloc(0, 0);
    if (rc) {
      assert_true(rc == SG_ENOMEM);
      assert_null(c);
      continue;
    }
    assert_int_equal(sg_comm_connect(c, NULL, sg_deadline_in_ms(1000), NULL),
                     0);
    float v = 1;
    void *outs[1] = {&v};
    size_t nb[1] = {4};
    struct done d;
    done_init(&d);
    sg_test_fail_alloc(1, 1);
    int r1 = sg_comm_allgather(c, &v, 4, outs, sg_deadline_in_ms(1000), done_cb,
                               &d, NULL);
    int r2 = sg_comm_alltoall(c, (const void *const *)outs, nb, outs, nb,
                              sg_deadline_in_ms(1000), done_cb, &d, NULL);
    sg_test_fail_alloc(0, 0);
    assert_int_equal(r1, SG_ENOMEM);
    assert_int_equal(r2, SG_ENOMEM);
    assert_int_equal(d.fired, 0);
    done_destroy(&d);
    sg_comm_free(c);
  }
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* Connect waits are bounded and abortable; bad arguments are refused. */
static void test_connect_abort_and_args(void **state) {
  sg_comm_t *c0 = mk(0, 2, 1, NULL);
  const char *addrs[2] = {"127.0.0.1:1", "127.0.0.1:1"};
  struct one_conn a0 = {.c = c0, .addrs = addrs, .ms = 60000};
  pthread_t th0, ab;
  struct abort_arg aa = {c0, 100};
  pthread_create(&th0, NULL, one_connect, &a0);
  pthread_create(&ab, NULL, abort_later, &aa);
  pthread_join(th0, NULL);
  pthread_join(ab, NULL);
  assert_int_equal(a0.rc, SG_EABORTED);
  sg_comm_free(c0);

  sg_comm_t *c1 = mk(1, 2, 1, NULL);
  sg_err_t err;
  assert_int_equal(sg_comm_connect(c1, addrs, sg_deadline_in_ms(200), &err),
                   SG_ETIMEDOUT); /* nobody listens on port 1 */
  assert_int_equal(sg_comm_connect(c1, addrs, sg_deadline_in_ms(200), &err),
                   SG_ESTATE);
  float f = 0;
  struct done d;
  assert_int_not_equal(sg_comm_allreduce(c1, &f, 1, SG_COMM_F32, SG_COMM_SUM,
                                         sg_deadline_in_ms(100), done_cb, &d,
                                         &err),
                       0);
  sg_comm_free(c1);

  sg_comm_opts_t o = {.rank = 2, .world_size = 2};
  sg_comm_t *c = NULL;
  assert_int_equal(sg_comm_new(&o, &c, &err), SG_EINVAL);
  o.rank = 0;
  o.world_size = 0;
  assert_int_equal(sg_comm_new(&o, &c, &err), SG_EINVAL);
  assert_null(c);
  sg_comm_free(NULL);
  assert_int_equal(sg_sock_registered_count(), 0);
}

/* A child forked from a process with a live communicator cannot use,
 * abort or free it, and the parent's communicator keeps working (its
 * wakeup descriptor was not disturbed). */
static void test_fork_child_leaves_it_alone(void **state) {
  struct group g;
  group_start(&g, 2);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int32_t v = 1;
    struct done d;
    done_init(&d);
    sg_err_t err;
    int rc = sg_comm_allreduce(g.c[0], &v, 1, SG_COMM_I32, SG_COMM_SUM,
                               sg_deadline_in_ms(1000), done_cb, &d, &err);
    sg_comm_abort(g.c[0]);
    sg_comm_free(g.c[0]);
    sg_comm_free(g.c[1]);
    _exit(rc == SG_ESTATE && !d.fired ? 0 : 1);
  }
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  assert_int_equal(sg_comm_error(g.c[0], NULL), 0);
  int32_t v[2] = {1, 2};
  struct done d[2];
  for (int r = 0; r < 2; r++) {
    done_init(&d[r]);
    assert_int_equal(sg_comm_allreduce(g.c[r], &v[r], 1, SG_COMM_I32,
                                       SG_COMM_SUM, sg_deadline_in_ms(10000),
                                       done_cb, &d[r], NULL),
                     0);
  }
  wait_all(&g, d);
  assert_int_equal(v[0], 3);
  assert_int_equal(v[1], 3);
  group_stop(&g);
}

/* ---- real processes ---------------------------------------------------------
 */

/* rank_main: one rank in a child process: allreduce 8 MiB in a loop until
 * an error; write "rc elapsed_ms message" to fd. */
static void rank_main(int rank, int world, int same_host, int port_fd_w,
                      int addr_fd_r, int out_fd) {
  sg_comm_opts_t o = {.rank = rank,
                      .world_size = world,
                      .generation = 3,
                      .bind_host = "127.0.0.1",
                      .same_host = same_host};
  sg_comm_t *c = NULL;
  if (sg_comm_new(&o, &c, NULL))
    _exit(2);
  int port = sg_comm_port(c);
  if (write(port_fd_w, &port, sizeof(port)) != sizeof(port))
    _exit(2);
  int ports[MAXW];
  if (read(addr_fd_r, ports, sizeof(int) * (size_t)world) !=
      (ssize_t)(sizeof(int) * (size_t)world))
    _exit(2);
  char addr[MAXW][64];
  const char *addrs[MAXW];
  for (int i = 0; i < world; i++) {
    snprintf(addr[i], sizeof(addr[i]), "127.0.0.1:%d", ports[i]);
    addrs[i] = addr[i];
  }
  sg_err_t err;
  if (sg_comm_connect(c, addrs, sg_deadline_in_ms(20000), &err))
    _exit(3);
  size_t count = 2u << 20;
  float *buf = calloc(count, sizeof(float));
  struct done d;
  int rc = 0;
  int64_t t_fail = 0;
  for (int it = 0; it < 100000 && rc == 0; it++) {
    done_init(&d);
    if (it == 2 && write(out_fd, "R", 1) != 1) /* running: kill me now */
      _exit(2);
    rc = sg_comm_allreduce(c, buf, count, SG_COMM_F32, SG_COMM_SUM,
                           sg_deadline_in_ms(60000), done_cb, &d, &err);
    if (rc == 0)
      rc = done_wait(&d, 120000);
    t_fail = sg_now_ns();
  }
  char line[400];
  int n = snprintf(line, sizeof(line), "%d %lld %d %s", rc,
                   (long long)(t_fail / 1000000),
                   sg_comm_same_host(c, (rank + world - 1) % world), d.msg);
  if (write(out_fd, line, (size_t)n) != n)
    _exit(2);
  sg_comm_free(c);
  _exit(0);
}

/* sigkill_mid_allreduce: three rank processes allreduce 8 MiB in a loop
 * (same_host 0: the same-host path where it works, -1: TCP); one is
 * SIGKILLed; the others fail with SG_EPEER naming it, within 5 s. */
static void sigkill_mid_allreduce(int same_host) {
  enum { W = 3, VICTIM = 2 };
  pid_t pids[W];
  int port_p[W][2], addr_p[W][2], out_p[W][2];
  for (int r = 0; r < W; r++) {
    assert_int_equal(pipe(port_p[r]), 0);
    assert_int_equal(pipe(addr_p[r]), 0);
    assert_int_equal(pipe(out_p[r]), 0);
    pids[r] = fork();
    assert_true(pids[r] >= 0);
    if (pids[r] == 0) {
      alarm(120); /* hard limit for the child */
      rank_main(r, W, same_host, port_p[r][1], addr_p[r][0], out_p[r][1]);
    }
  }
  int ports[W];
  for (int r = 0; r < W; r++)
    assert_int_equal(read(port_p[r][0], &ports[r], sizeof(int)), sizeof(int));
  for (int r = 0; r < W; r++)
    assert_int_equal(write(addr_p[r][1], ports, sizeof(ports)),
                     (ssize_t)sizeof(ports));
  /* wait until every rank is in its third allreduce, then kill one */
  for (int r = 0; r < W; r++) {
    char ch = 0;
    struct pollfd p = {.fd = out_p[r][0], .events = POLLIN};
    assert_int_equal(poll(&p, 1, 60000), 1);
    assert_int_equal(read(out_p[r][0], &ch, 1), 1);
    assert_int_equal(ch, 'R');
  }
  usleep(20 * 1000);
  int64_t t_kill = sg_now_ns() / 1000000;
  kill(pids[VICTIM], SIGKILL);
  for (int r = 0; r < W; r++) {
    if (r == VICTIM)
      continue;
    char line[400] = {0};
    struct pollfd p = {.fd = out_p[r][0], .events = POLLIN};
    int ready = poll(&p, 1, 30000);
    if (ready != 1) {
      for (int q = 0; q < W; q++)
        kill(pids[q], SIGKILL);
    }
    assert_int_equal(ready, 1);
    assert_true(read(out_p[r][0], line, sizeof(line) - 1) > 0);
    int rc = 0, sh = -1;
    long long t = 0;
    int off = 0;
    assert_int_equal(sscanf(line, "%d %lld %d %n", &rc, &t, &sh, &off), 3);
    sg_samehost_id_t id;
    assert_int_equal(sh, same_host == 0 && sg_samehost_self(&id) == 0);
    fprintf(stderr, "rank %d after %lld ms: %d %s\n", r, t - t_kill, rc,
            line + off);
    assert_int_equal(rc, SG_EPEER);
    assert_non_null(strstr(line + off, "rank 2"));
    assert_true(t - t_kill < 5000); /* a closed connection, not a timeout */
  }
  for (int r = 0; r < W; r++) {
    int st;
    if (r != VICTIM)
      kill(pids[r], SIGKILL);
    waitpid(pids[r], &st, 0);
    close(port_p[r][0]);
    close(port_p[r][1]);
    close(addr_p[r][0]);
    close(addr_p[r][1]);
    close(out_p[r][0]);
    close(out_p[r][1]);
  }
}

static void test_sigkill_mid_allreduce(void **state) {
  sigkill_mid_allreduce(-1);
}

static void test_sigkill_mid_allreduce_samehost(void **state) {
  sigkill_mid_allreduce(0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  /* SG_TEST_FILTER=test_sigkill* runs the matching tests only (a loop) */
  const char *filter = getenv("SG_TEST_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_f16_roundtrip),
      cmocka_unit_test(test_bf16_rounding),
      cmocka_unit_test(test_kernels),
      cmocka_unit_test(test_half_kernel_bits),
      cmocka_unit_test(test_f16_branch_free),
      cmocka_unit_test(test_chunks),
      cmocka_unit_test(test_ring_schedule),
      cmocka_unit_test(test_rd_schedule),
      cmocka_unit_test(test_hello),
      cmocka_unit_test(test_reply_frame),
      cmocka_unit_test(test_allreduce_1),
      cmocka_unit_test(test_allreduce_2_small),
      cmocka_unit_test(test_allreduce_3_small),
      cmocka_unit_test(test_allreduce_2_ring),
      cmocka_unit_test(test_allreduce_3_ring),
      cmocka_unit_test(test_allreduce_4_ring),
      cmocka_unit_test(test_allreduce_bits),
      cmocka_unit_test(test_allreduce_avg_is_sum_then_divide),
      cmocka_unit_test(test_broadcast),
      cmocka_unit_test(test_allgather_reduce_scatter),
      cmocka_unit_test(test_alltoall_sendrecv_barrier),
      cmocka_unit_test(test_barrier_waits),
      cmocka_unit_test(test_abort_from_thread),
      cmocka_unit_test(test_deadline),
      cmocka_unit_test(test_mismatch),
      cmocka_unit_test(test_quantized),
      cmocka_unit_test(test_quantized_nonfinite),
      cmocka_unit_test(test_quantized_pieces),
      cmocka_unit_test(test_quantized_overflow),
      cmocka_unit_test(test_quantized_mismatch),
      cmocka_unit_test(test_free_cancels),
      cmocka_unit_test(test_bye),
      cmocka_unit_test(test_handshake_rejects),
      cmocka_unit_test(test_connect_abort_and_args),
      cmocka_unit_test(test_bad_peer_frames),
      cmocka_unit_test(test_samehost_bad_peer),
      cmocka_unit_test(test_progress_deadline),
      cmocka_unit_test(test_progress_late_peer),
      cmocka_unit_test(test_loopback_sndbuf),
      cmocka_unit_test(test_alloc_failures),
      cmocka_unit_test(test_fork_child_leaves_it_alone),
      cmocka_unit_test(test_sigkill_mid_allreduce),
      cmocka_unit_test(test_sigkill_mid_allreduce_samehost),
  };
  /* the collectives again, over the same-host path */
  const struct CMUnitTest samehost[] = {
      cmocka_unit_test(test_allreduce_2_small),
      cmocka_unit_test(test_allreduce_3_small),
      cmocka_unit_test(test_allreduce_2_ring),
      cmocka_unit_test(test_allreduce_3_ring),
      cmocka_unit_test(test_allreduce_4_ring),
      cmocka_unit_test(test_allreduce_bits),
      cmocka_unit_test(test_allreduce_avg_is_sum_then_divide),
      cmocka_unit_test(test_broadcast),
      cmocka_unit_test(test_allgather_reduce_scatter),
      cmocka_unit_test(test_alltoall_sendrecv_barrier),
      cmocka_unit_test(test_barrier_waits),
      cmocka_unit_test(test_abort_from_thread),
      cmocka_unit_test(test_deadline),
      cmocka_unit_test(test_mismatch),
      cmocka_unit_test(test_quantized),
      cmocka_unit_test(test_quantized_pieces),
      cmocka_unit_test(test_free_cancels),
      cmocka_unit_test(test_bye),
      cmocka_unit_test(test_progress_late_peer),
  };
  int failed = cmocka_run_group_tests_name("tcp", tests, setup_tcp, NULL);
  failed +=
      cmocka_run_group_tests_name("samehost", samehost, setup_samehost, NULL);
  return failed;
}
