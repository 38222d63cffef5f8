/*
 * plan.c: chunk plans and ring / recursive-doubling schedules, as pure
 * functions of (rank, world, step).  See comm_int.h for the contracts and
 * docs/internals/comm.md for why each schedule gives identical bits.
 */
#include "comm/comm_int.h"

void sg__comm_chunk(size_t count, int n, int i, size_t *off, size_t *len) {
  size_t base = count / (size_t)n, extra = count % (size_t)n;
  size_t ui = (size_t)i;
  *len = base + (ui < extra ? 1 : 0);
  *off = ui * base + (ui < extra ? ui : extra);
}

static int mod(int a, int n) {
  int m = a % n;
  return m < 0 ? m + n : m;
}

int sg__comm_ring_send_chunk(int rank, int n, int step, int shift) {
  return mod(rank - step - shift, n);
}

int sg__comm_ring_recv_chunk(int rank, int n, int step, int shift) {
  return mod(rank - step - 1 - shift, n);
}

int sg__comm_pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n)
    p *= 2;
  return p;
}

int sg__comm_rd_partner(int rank, int n, int round) {
  int p2 = sg__comm_pow2_floor(n);
  if (rank >= p2 || (1 << round) >= p2)
    return -1;
  return rank ^ (1 << round);
}
