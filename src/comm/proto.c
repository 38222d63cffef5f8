/*
 * proto.c: the collectives' wire format, as pure functions over byte spans
 * (so the fuzzer can call them): HELLO / REPLY for the handshake, the
 * same-host OFFER, OP / DESC / ACK / PULL / BYE / SEG / KEEPALIVE frames, the
 * handshake admission check and address parsing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_int.h"

enum { KIND_HELLO = 1, KIND_REPLY = 2 };

int sg__comm_hello_encode(uint8_t *buf, uint64_t generation, uint32_t rank,
                          uint32_t world, const char *job, const char *token) {
  size_t jl = job ? strlen(job) : 0, tl = token ? strlen(token) : 0;
  if (jl > SG_COMM_MAX_JOB || tl > SG_COMM_MAX_TOKEN)
    return SG_ETOOBIG;
  memcpy(buf, "SGC1", 4);
  sg_put_le16(buf + 4, SG__COMM_VERSION);
  sg_put_le16(buf + 6, KIND_HELLO);
  sg_put_le64(buf + 8, generation);
  sg_put_le32(buf + 16, rank);
  sg_put_le32(buf + 20, world);
  sg_put_le16(buf + 24, (uint16_t)jl);
  sg_put_le16(buf + 26, (uint16_t)tl);
  if (jl)
    memcpy(buf + SG__COMM_HELLO_FIXED, job, jl);
  if (tl)
    memcpy(buf + SG__COMM_HELLO_FIXED + jl, token, tl);
  return (int)(SG__COMM_HELLO_FIXED + jl + tl);
}

/* check_head: magic, version and kind of the first 8 bytes. */
static int check_head(const uint8_t *p, uint16_t kind) {
  if (memcmp(p, "SGC1", 4) != 0 || sg_get_le16(p + 4) != SG__COMM_VERSION ||
      sg_get_le16(p + 6) != kind)
    return SG_EPROTO;
  return 0;
}

int sg__comm_hello_parse(const uint8_t *p, size_t n, sg__comm_hello_t *h) {
  /* reject garbage as soon as its first bytes show it */
  size_t pre = n < 4 ? n : 4;
  if (memcmp(p, "SGC1", pre) != 0)
    return SG_EPROTO;
  if (n < SG__COMM_HELLO_FIXED)
    return 0;
  if (check_head(p, KIND_HELLO))
    return SG_EPROTO;
  h->generation = sg_get_le64(p + 8);
  h->rank = sg_get_le32(p + 16);
  h->world = sg_get_le32(p + 20);
  h->job_len = sg_get_le16(p + 24);
  h->token_len = sg_get_le16(p + 26);
  if (h->job_len > SG_COMM_MAX_JOB || h->token_len > SG_COMM_MAX_TOKEN)
    return SG_EPROTO;
  size_t total = SG__COMM_HELLO_FIXED + (size_t)h->job_len + h->token_len;
  if (n < total)
    return 0;
  h->job = p + SG__COMM_HELLO_FIXED;
  h->token = h->job + h->job_len;
  return (int)total;
}

void sg__comm_reply_encode(uint8_t *buf, uint64_t generation, uint32_t rank,
                           int32_t status) {
  memcpy(buf, "SGC1", 4);
  sg_put_le16(buf + 4, SG__COMM_VERSION);
  sg_put_le16(buf + 6, KIND_REPLY);
  sg_put_le64(buf + 8, generation);
  sg_put_le32(buf + 16, rank);
  sg_put_le32(buf + 20, (uint32_t)status);
}

int sg__comm_reply_parse(const uint8_t *p, size_t n, sg__comm_reply_t *r) {
  size_t pre = n < 4 ? n : 4;
  if (memcmp(p, "SGC1", pre) != 0)
    return SG_EPROTO;
  if (n < SG__COMM_REPLY_LEN)
    return 0;
  if (check_head(p, KIND_REPLY))
    return SG_EPROTO;
  r->generation = sg_get_le64(p + 8);
  r->rank = sg_get_le32(p + 16);
  r->status = (int32_t)sg_get_le32(p + 20);
  if (r->status != 0 && r->status != SG_EAUTH && r->status != SG_EPROTO)
    return SG_EPROTO; /* only the statuses an acceptor sends */
  return SG__COMM_REPLY_LEN;
}

static const char *const frame_magic[] = {"",     "SGOP", "SGBY", "SGDS",
                                          "SGAK", "SGPL", "SGSG", "SGKA"};

void sg__comm_frame_encode(uint8_t *buf, const sg__comm_frame_t *f) {
  int t = f->type >= SG__COMM_FRAME_OP && f->type <= SG__COMM_FRAME_KEEPALIVE
              ? f->type
              : SG__COMM_FRAME_BYE;
  int ka = t == SG__COMM_FRAME_KEEPALIVE;
  int has_kind = t == SG__COMM_FRAME_OP || t == SG__COMM_FRAME_ACK;
  memcpy(buf, frame_magic[t], 4);
  sg_put_le16(buf + 4, has_kind ? f->kind : 0);
  sg_put_le16(buf + 6, t == SG__COMM_FRAME_OP ? f->flags : 0);
  sg_put_le64(buf + 8, ka ? 0 : f->seq);
  sg_put_le64(
      buf + 16,
      t == SG__COMM_FRAME_BYE || t == SG__COMM_FRAME_PULL || ka ? 0 : f->bytes);
}

int sg__comm_frame_parse(const uint8_t *p, size_t n, sg__comm_frame_t *f) {
  if (n != SG__COMM_FRAME_LEN)
    return SG_EPROTO;
  f->type = 0;
  for (int t = SG__COMM_FRAME_OP; t <= SG__COMM_FRAME_KEEPALIVE; t++)
    if (memcmp(p, frame_magic[t], 4) == 0)
      f->type = t;
  if (!f->type)
    return SG_EPROTO;
  f->kind = sg_get_le16(p + 4);
  f->flags = sg_get_le16(p + 6);
  f->seq = sg_get_le64(p + 8);
  f->bytes = sg_get_le64(p + 16);
  int has_kind = f->type == SG__COMM_FRAME_OP || f->type == SG__COMM_FRAME_ACK;
  if (!has_kind && f->kind != 0)
    return SG_EPROTO;
  if (f->flags & ~(f->type == SG__COMM_FRAME_OP ? SG__COMM_OP_PULL : 0))
    return SG_EPROTO;
  switch (f->type) {
  case SG__COMM_FRAME_BYE:
    return f->bytes == 0 ? 0 : SG_EPROTO;
  case SG__COMM_FRAME_PULL:
    return f->bytes == 0 && f->seq <= 1 ? 0 : SG_EPROTO;
  case SG__COMM_FRAME_DESC:
    return f->bytes > 0 && f->seq + f->bytes > f->seq ? 0 : SG_EPROTO;
  case SG__COMM_FRAME_SEG:
    return f->seq > 0 ? 0 : SG_EPROTO;
  case SG__COMM_FRAME_KEEPALIVE:
    return f->seq == 0 && f->bytes == 0 ? 0 : SG_EPROTO;
  default:
    return 0;
  }
}

void sg__comm_offer_encode(uint8_t *buf, const sg__comm_offer_t *o) {
  memcpy(buf, "SGSH", 4);
  sg_put_le16(buf + 4, SG__COMM_VERSION);
  sg_put_le16(buf + 6, o->flags);
  memcpy(buf + 8, o->id, 32);
  sg_put_le64(buf + 40, o->probe_addr);
  memcpy(buf + 48, o->probe, SG__COMM_PROBE_LEN);
}

int sg__comm_offer_parse(const uint8_t *p, size_t n, sg__comm_offer_t *o) {
  if (n != SG__COMM_OFFER_LEN || memcmp(p, "SGSH", 4) != 0 ||
      sg_get_le16(p + 4) != SG__COMM_VERSION || (sg_get_le16(p + 6) & ~1u))
    return SG_EPROTO;
  o->flags = sg_get_le16(p + 6);
  memcpy(o->id, p + 8, 32);
  o->probe_addr = sg_get_le64(p + 40);
  memcpy(o->probe, p + 48, SG__COMM_PROBE_LEN);
  return 0;
}

/* same_bytes: constant-time (for a given length) equality of a and b. */
static int same_bytes(const uint8_t *a, size_t al, const char *b) {
  size_t bl = b ? strlen(b) : 0;
  unsigned diff = al != bl;
  for (size_t i = 0; i < al; i++)
    diff |= (unsigned)(a[i] ^ (uint8_t)(i < bl ? b[i] : 0));
  return diff == 0;
}

int sg__comm_hello_check(const sg__comm_hello_t *h, uint64_t generation,
                         int rank, int world, const char *job,
                         const char *token, sg_err_t *err) {
  if (h->generation != generation)
    return sg_err_set(
        err, SG_EPROTO, "generation %llu, expected %llu (another quorum)",
        (unsigned long long)h->generation, (unsigned long long)generation);
  if (!same_bytes(h->job, h->job_len, job))
    return sg_err_set(err, SG_EPROTO, "another job");
  if (h->world != (uint32_t)world)
    return sg_err_set(err, SG_EPROTO, "world size %u, expected %d", h->world,
                      world);
  if (h->rank <= (uint32_t)rank || h->rank >= (uint32_t)world)
    return sg_err_set(err, SG_EPROTO, "rank %u may not connect to rank %d",
                      h->rank, rank);
  if (!same_bytes(h->token, h->token_len, token))
    return sg_err_set(err, SG_EAUTH, "wrong authentication token");
  return 0;
}
