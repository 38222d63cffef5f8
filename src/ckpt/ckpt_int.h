/*
 * ckpt_int.h: what the files of src/ckpt share (and their tests and fuzz
 * target): the wire codecs, the chunk plan, the region lookup.
 */
#ifndef SG_CKPT_INT_H
#define SG_CKPT_INT_H

#include "stepguard/base.h"
#include "stepguard/ckpt.h"

/* ---- wire codecs (pure; no I/O) ---------------------------------------- */

#define SG_CKPT_REQ_MAGIC 0x51434753u  /* "SGCQ" little-endian */
#define SG_CKPT_RESP_MAGIC 0x52434753u /* "SGCR" little-endian */
#define SG_CKPT_VERSION 1
#define SG_CKPT_REQ_FIXED 48  /* request bytes before the token */
#define SG_CKPT_RESP_FIXED 48 /* response bytes before the payload */
/* the longest request: fixed part, token, a MAP's same-host id */
#define SG_CKPT_REQ_MAX                                                        \
  (SG_CKPT_REQ_FIXED + SG_CKPT_MAX_TOKEN + SG_SAMEHOST_ID_LEN)
#define SG_CKPT_BEACON_LEN 40 /* beacon bytes: 32 random, 8 generation */
/* MAP payload before the descriptors: id, beacon address, beacon bytes */
#define SG_CKPT_MAP_FIXED (SG_SAMEHOST_ID_LEN + 8 + SG_CKPT_BEACON_LEN)
#define SG_CKPT_DESC_LEN 16 /* one descriptor: u64 address, u64 length */

enum { SG_CKPT_KIND_INFO = 1, SG_CKPT_KIND_DATA = 2, SG_CKPT_KIND_MAP = 3 };

/* A MAP refusal that means "use TCP", not "this source failed". */
#define SG_CKPT_NOT_SAME_HOST SG_EAGAIN

typedef struct sg_ckpt_req_s {
  int kind;        /* SG_CKPT_KIND_* */
  int64_t step;    /* the step the client wants */
  uint64_t layout; /* DATA, MAP: the layout id from INFO; INFO: 0 */
  uint64_t offset; /* DATA: first byte of the range; else 0 */
  uint64_t length; /* DATA: bytes in the range; MAP: SG_SAMEHOST_ID_LEN */
  size_t token_len;
  char token[SG_CKPT_MAX_TOKEN];       /* not NUL-terminated */
  uint8_t peer_id[SG_SAMEHOST_ID_LEN]; /* MAP: the fetcher's encoded id */
} sg_ckpt_req_t;

typedef struct sg_ckpt_resp_s {
  int kind;          /* echoes the request's kind */
  int status;        /* 0 or a negative SG_E* code; then payload = message */
  uint32_t nregions; /* INFO, MAP: number of data regions */
  int64_t step;      /* the step the server serves (-1: none) */
  uint64_t layout;   /* layout id of what is served */
  uint64_t payload;  /* bytes that follow the fixed part */
  uint64_t aux;      /* INFO: header bytes; DATA: range offset */
} sg_ckpt_resp_t;

/*
 * sg_ckpt_req_encode: write `r` into `out` (room for SG_CKPT_REQ_MAX bytes);
 * returns the bytes written or SG_EINVAL when a field is out of range.
 */
int sg_ckpt_req_encode(const sg_ckpt_req_t *r, uint8_t *out);

/*
 * sg_ckpt_req_parse: decode a request from the `len` bytes at `p`.
 * Returns the bytes it used (> 0), 0 when more bytes are needed, or
 * SG_EPROTO (bad magic, version, kind, reserved bits, token length, a
 * range that overflows, an INFO with a range, a MAP whose length is not
 * SG_SAMEHOST_ID_LEN).  Never reads past len.
 */
int sg_ckpt_req_parse(const uint8_t *p, size_t len, sg_ckpt_req_t *r);

/* sg_ckpt_resp_encode: write the SG_CKPT_RESP_FIXED bytes of `r`. */
void sg_ckpt_resp_encode(const sg_ckpt_resp_t *r, uint8_t *out);

/*
 * sg_ckpt_resp_parse: decode the fixed part of a response from `len` >=
 * SG_CKPT_RESP_FIXED bytes.  Returns 0, SG_EAGAIN when len is short, or
 * SG_EPROTO (bad magic, version, kind, a status that is no SG_E* code,
 * an error payload over SG_CKPT_MAX_ERRMSG, an INFO payload that does not
 * equal nregions * 8 + header, a MAP payload that does not equal
 * SG_CKPT_MAP_FIXED + nregions * SG_CKPT_DESC_LEN, counts over the limits).
 */
int sg_ckpt_resp_parse(const uint8_t *p, size_t len, sg_ckpt_resp_t *r);

/*
 * sg_ckpt_lengths_parse: decode `n` little-endian u64 region lengths from
 * `p` (n * 8 bytes) into `out`, checking that their sum stays within
 * SG_CKPT_MAX_TOTAL; *total gets the sum.  Returns 0 or SG_EPROTO.
 */
int sg_ckpt_lengths_parse(const uint8_t *p, size_t n, uint64_t *out,
                          uint64_t *total);

/* The fixed part of a MAP payload. */
typedef struct sg_ckpt_map_s {
  sg_samehost_id_t id;                /* the source process */
  uint64_t beacon_addr;               /* where its beacon lives */
  uint8_t beacon[SG_CKPT_BEACON_LEN]; /* what the beacon reads while served */
} sg_ckpt_map_t;

/* sg_ckpt_map_encode: write the SG_CKPT_MAP_FIXED bytes of `m`. */
void sg_ckpt_map_encode(const sg_ckpt_map_t *m, uint8_t *out);

/*
 * sg_ckpt_map_parse: decode the fixed part of a MAP payload from `len`
 * bytes.  0, SG_EAGAIN when len is short, SG_EPROTO for a zero beacon
 * address or a nonzero reserved id field.
 */
int sg_ckpt_map_parse(const uint8_t *p, size_t len, sg_ckpt_map_t *m);

/*
 * sg_ckpt_desc_parse: decode `n` descriptors (n * SG_CKPT_DESC_LEN bytes at
 * `p`) into `addrs`, checking each against the length the source announced
 * in INFO (`lens`): a different length, a zero address for a nonempty
 * region or a range that wraps past 2^63 is SG_EPROTO.  0 otherwise.
 */
int sg_ckpt_desc_parse(const uint8_t *p, size_t n, const uint64_t *lens,
                       uint64_t *addrs);

/* sg_ckpt_layout_id: the layout id (FNV-1a 64) of `n` region lengths. */
uint64_t sg_ckpt_layout_id(const uint64_t *lens, size_t n);

/* ---- chunk plan (pure) ---------------------------------------------------
 */

/*
 * sg_ckpt_plan_chunk: the chunk size for `total` bytes over `nstreams`
 * streams: about four chunks per stream so that faster sources take more,
 * at least `min_chunk` bytes and at most 64 MiB.  Never 0.
 */
uint64_t sg_ckpt_plan_chunk(uint64_t total, size_t nstreams,
                            uint64_t min_chunk);

/*
 * sg__ckpt_find: the index of the region holding byte `off` of the
 * concatenation, given `prefix` (n + 1 entries, prefix[i] = bytes before
 * region i); n when off == prefix[n].  Zero-length regions are skipped.
 */
size_t sg__ckpt_find(const uint64_t *prefix, size_t n, uint64_t off);

#endif
