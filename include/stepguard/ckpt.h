/*
 * stepguard/ckpt.h: live recovery.  A checkpoint server serves one step's
 * state straight from the memory it lives in; a fetch pulls it into
 * preallocated memory over parallel streams, striped across every source
 * that serves the same step.
 *
 *   server   sg_ckpt_server_start / serve / disallow / stop
 *   fetch    sg_ckpt_fetch_new / info / data / abort / free
 *   wire     the frame codecs (pure functions, fuzzed)
 *   plan     the chunk plan a fetch hands out to its streams (pure)
 *
 * What is served is a *header* (opaque bytes the embedding program builds:
 * the tree structure, dtypes, shapes, strides, non-tensor leaves) and a list
 * of *data regions* (pointer, length): the tensors' bytes.  A fetch reads the
 * header and region lengths with one INFO request, then asks for byte ranges
 * of the regions' concatenation with DATA requests; a response carries those
 * bytes raw.  The regions' lengths hash to a *layout id* that every DATA
 * request names, so stripes from several sources only combine when every
 * source serves the same layout at the same step.  The protocol is described
 * in docs/internals/ckpt.md.
 *
 * Same host: when a fetch and a source are processes of one host, a MAP
 * request (carrying the fetcher's sg_samehost_id) returns the source's id,
 * a *beacon* (a 40-byte word in the source's memory that changes whenever
 * the served state is released) and one {address, length} descriptor per
 * region.  The fetch then copies with process_vm_readv (sg_samehost_read)
 * and rereads the beacon after every chunk; the source holds the state as
 * it does for a stream until the MAP connection closes.  Anything that
 * fails before the first byte (no same-host id, another host, a failed
 * probe) falls back to DATA requests on TCP.
 */
#ifndef STEPGUARD_CKPT_H
#define STEPGUARD_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "stepguard/base.h"
#include "stepguard/samehost.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- limits ------------------------------------------------------------ */

#define SG_CKPT_MAX_TOKEN 256           /* auth token bytes */
#define SG_CKPT_MAX_REGIONS (1u << 24)  /* data regions per step */
#define SG_CKPT_MAX_HEADER (256u << 20) /* header bytes */
#define SG_CKPT_MAX_TOTAL (1ull << 48)  /* data bytes per step */
#define SG_CKPT_MAX_ERRMSG 512          /* error text in a response */
#define SG_CKPT_MAX_STREAMS 64          /* streams per source in a fetch */
#define SG_CKPT_MAX_SOURCES 256         /* sources in a fetch */
#define SG_CKPT_MAX_ADDR 300            /* "host:port" length */

/* A span of memory: served (read) or fetched into (written). */
typedef struct sg_ckpt_region_s {
  void *ptr;    /* may be NULL only when len == 0 */
  uint64_t len; /* bytes */
} sg_ckpt_region_t;

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
SG_EXPORT int sg_ckpt_req_encode(const sg_ckpt_req_t *r, uint8_t *out);

/*
 * sg_ckpt_req_parse: decode a request from the `len` bytes at `p`.
 * Returns the bytes it used (> 0), 0 when more bytes are needed, or
 * SG_EPROTO (bad magic, version, kind, reserved bits, token length, a
 * range that overflows, an INFO with a range, a MAP whose length is not
 * SG_SAMEHOST_ID_LEN).  Never reads past len.
 */
SG_EXPORT int sg_ckpt_req_parse(const uint8_t *p, size_t len, sg_ckpt_req_t *r);

/* sg_ckpt_resp_encode: write the SG_CKPT_RESP_FIXED bytes of `r`. */
SG_EXPORT void sg_ckpt_resp_encode(const sg_ckpt_resp_t *r, uint8_t *out);

/*
 * sg_ckpt_resp_parse: decode the fixed part of a response from `len` >=
 * SG_CKPT_RESP_FIXED bytes.  Returns 0, SG_EAGAIN when len is short, or
 * SG_EPROTO (bad magic, version, kind, a status that is no SG_E* code,
 * an error payload over SG_CKPT_MAX_ERRMSG, an INFO payload that does not
 * equal nregions * 8 + header, a MAP payload that does not equal
 * SG_CKPT_MAP_FIXED + nregions * SG_CKPT_DESC_LEN, counts over the limits).
 */
SG_EXPORT int sg_ckpt_resp_parse(const uint8_t *p, size_t len,
                                 sg_ckpt_resp_t *r);

/*
 * sg_ckpt_lengths_parse: decode `n` little-endian u64 region lengths from
 * `p` (n * 8 bytes) into `out`, checking that their sum stays within
 * SG_CKPT_MAX_TOTAL; *total gets the sum.  Returns 0 or SG_EPROTO.
 */
SG_EXPORT int sg_ckpt_lengths_parse(const uint8_t *p, size_t n, uint64_t *out,
                                    uint64_t *total);

/* The fixed part of a MAP payload. */
typedef struct sg_ckpt_map_s {
  sg_samehost_id_t id;                /* the source process */
  uint64_t beacon_addr;               /* where its beacon lives */
  uint8_t beacon[SG_CKPT_BEACON_LEN]; /* what the beacon reads while served */
} sg_ckpt_map_t;

/* sg_ckpt_map_encode: write the SG_CKPT_MAP_FIXED bytes of `m`. */
SG_EXPORT void sg_ckpt_map_encode(const sg_ckpt_map_t *m, uint8_t *out);

/*
 * sg_ckpt_map_parse: decode the fixed part of a MAP payload from `len`
 * bytes.  0, SG_EAGAIN when len is short, SG_EPROTO for a zero beacon
 * address or a nonzero reserved id field.
 */
SG_EXPORT int sg_ckpt_map_parse(const uint8_t *p, size_t len, sg_ckpt_map_t *m);

/*
 * sg_ckpt_desc_parse: decode `n` descriptors (n * SG_CKPT_DESC_LEN bytes at
 * `p`) into `addrs`, checking each against the length the source announced
 * in INFO (`lens`): a different length, a zero address for a nonempty
 * region or a range that wraps past 2^63 is SG_EPROTO.  0 otherwise.
 */
SG_EXPORT int sg_ckpt_desc_parse(const uint8_t *p, size_t n,
                                 const uint64_t *lens, uint64_t *addrs);

/* sg_ckpt_layout_id: the layout id (FNV-1a 64) of `n` region lengths. */
SG_EXPORT uint64_t sg_ckpt_layout_id(const uint64_t *lens, size_t n);

/*
 * sg_ckpt_parse_addr: split "host:port" or "[v6]:port" into host (NUL
 * terminated, at most hostcap - 1 bytes) and port.  0 or SG_EINVAL.
 */
SG_EXPORT int sg_ckpt_parse_addr(const char *addr, char *host, size_t hostcap,
                                 int *port);

/* ---- chunk plan (pure) ---------------------------------------------------
 */

/*
 * sg_ckpt_plan_chunk: the chunk size for `total` bytes over `nstreams`
 * streams: about four chunks per stream so that faster sources take more,
 * at least `min_chunk` bytes and at most 64 MiB.  Never 0.
 */
SG_EXPORT uint64_t sg_ckpt_plan_chunk(uint64_t total, size_t nstreams,
                                      uint64_t min_chunk);

/* ---- server ---------------------------------------------------------------
 */

typedef struct sg_ckpt_server_s sg_ckpt_server_t;

typedef struct sg_ckpt_server_opts_s {
  const char *bind;           /* "host:port"; NULL or "" = all interfaces:0 */
  const char *auth_token;     /* NULL or "" = no token required */
  int max_conns;              /* open connections at once; 0 = 256 */
  int64_t request_timeout_ms; /* a request must arrive within; 0 = 30000 */
  int64_t stall_timeout_ms;   /* a reader that takes nothing for this long is
                                 dropped; 0 = 30000 */
  size_t send_budget;         /* bytes per connection per wakeup; 0 = 8 MiB */
} sg_ckpt_server_opts_t;

/* sg_ckpt_server_opts_init: zero everything (the defaults). */
SG_EXPORT void sg_ckpt_server_opts_init(sg_ckpt_server_opts_t *o);

/*
 * sg_ckpt_server_start: listen and start the server thread.  Serves nothing
 * (every request is refused with SG_ESTATE) until sg_ckpt_server_serve.
 * `o` and its strings are copied.  Returns 0 (*out set), SG_EINVAL,
 * SG_ENOMEM, or a socket error; detail in err.
 */
SG_EXPORT int sg_ckpt_server_start(const sg_ckpt_server_opts_t *o,
                                   sg_ckpt_server_t **out, sg_err_t *err);

/* sg_ckpt_server_port: the bound port.  Any thread. */
SG_EXPORT int sg_ckpt_server_port(const sg_ckpt_server_t *s);

/*
 * sg_ckpt_server_serve: serve `step` (>= 0): `header` (hlen bytes) and the
 * `n` data regions.  Only while nothing is served (after start or
 * disallow), else SG_ESTATE.  The region array is copied; the memory it
 * points to is BORROWED and must stay valid and unchanged until
 * sg_ckpt_server_disallow or sg_ckpt_server_stop returns.  Returns 0,
 * SG_ESTATE, SG_EINVAL, SG_ETOOBIG (over the limits) or SG_ENOMEM.  Any
 * thread; does not block.
 */
SG_EXPORT int sg_ckpt_server_serve(sg_ckpt_server_t *s, int64_t step,
                                   const void *header, size_t hlen,
                                   const sg_ckpt_region_t *regions, size_t n,
                                   sg_err_t *err);

/*
 * sg_ckpt_server_disallow: stop serving.  New requests are refused at once;
 * responses in flight may finish until `deadline`, after which their
 * connections are closed (their readers see a truncated stream).  When it
 * returns the server reads none of the served memory any more.  Blocks up
 * to the deadline plus one loop turn.  Returns 0, or SG_ETIMEDOUT when
 * responses had to be cut (the state is released either way).  Idempotent.
 */
SG_EXPORT int sg_ckpt_server_disallow(sg_ckpt_server_t *s,
                                      sg_deadline_t deadline);

typedef struct sg_ckpt_server_stats_s {
  uint64_t bytes_sent; /* data bytes sent (DATA payloads) */
  uint64_t requests;   /* well-formed requests answered */
  uint64_t refused;    /* requests answered with an error status */
  uint64_t bad_input;  /* connections dropped for malformed input */
  uint64_t timeouts;   /* connections dropped by a timeout */
  uint64_t cut;        /* responses cut by disallow's deadline */
  uint64_t maps;       /* same-host MAP requests granted */
  uint64_t conns;      /* connections accepted */
  int open_conns;      /* connections open now */
} sg_ckpt_server_stats_t;

/* sg_ckpt_server_stats: a snapshot of the counters.  Any thread. */
SG_EXPORT void sg_ckpt_server_stats(sg_ckpt_server_t *s,
                                    sg_ckpt_server_stats_t *out);

/*
 * sg_ckpt_server_stop: close every connection, join the thread and free
 * `s` (NULL is a no-op).  The served memory is no longer read when it
 * returns.  Must not race other calls on `s`.  In a forked child it returns
 * at once and frees nothing (serve fails with SG_ESTATE there, disallow
 * returns 0).
 */
SG_EXPORT void sg_ckpt_server_stop(sg_ckpt_server_t *s);

/* ---- fetch ----------------------------------------------------------------
 */

typedef struct sg_ckpt_fetch_s sg_ckpt_fetch_t;

/* sg_ckpt_fetch_new: a fetch context (holds the abort flag).  0/SG_ENOMEM. */
SG_EXPORT int sg_ckpt_fetch_new(sg_ckpt_fetch_t **out);

/*
 * sg_ckpt_fetch_abort: make the running and every later info/data call on
 * `f` fail with SG_EABORTED within 100 ms.  Any thread, async-signal-safe.
 */
SG_EXPORT void sg_ckpt_fetch_abort(sg_ckpt_fetch_t *f);

/* sg_ckpt_fetch_free: free `f` (NULL ok); no call may be running on it. */
SG_EXPORT void sg_ckpt_fetch_free(sg_ckpt_fetch_t *f);

/* What the last sg_ckpt_fetch_data on a fetch moved, and how. */
typedef struct sg_ckpt_fetch_stats_s {
  uint64_t same_host_bytes;   /* copied from source memory (process_vm_readv) */
  uint64_t tcp_bytes;         /* received in DATA responses */
  uint32_t same_host_sources; /* sources that granted and passed the probe */
} sg_ckpt_fetch_stats_t;

/* sg_ckpt_fetch_stats: the counters of the last data call (none running). */
SG_EXPORT void sg_ckpt_fetch_stats(const sg_ckpt_fetch_t *f,
                                   sg_ckpt_fetch_stats_t *out);

/* What INFO returns.  Owned by the caller; sg_ckpt_info_free releases it. */
typedef struct sg_ckpt_info_s {
  int64_t step;
  uint64_t layout;
  uint8_t *header; /* hlen bytes (sg_malloc) */
  size_t hlen;
  uint64_t *lens; /* nregions lengths (sg_malloc) */
  size_t nregions;
  uint64_t total; /* sum of lens */
} sg_ckpt_info_t;

SG_EXPORT void sg_ckpt_info_free(sg_ckpt_info_t *info);

/*
 * sg_ckpt_fetch_info: ask `addr` ("host:port") for the header and the region
 * lengths of `step`.  Blocks until done or `deadline`.  Returns 0 (*info
 * filled, caller frees), SG_ETIMEDOUT, SG_EABORTED, SG_EAUTH, SG_ESTATE (the
 * source does not serve `step`; detail in err), SG_EPROTO, SG_EPEER,
 * SG_ECONNREFUSED, SG_ENOMEM.
 */
SG_EXPORT int sg_ckpt_fetch_info(sg_ckpt_fetch_t *f, const char *addr,
                                 const char *token, int64_t step,
                                 sg_deadline_t deadline, sg_ckpt_info_t *info,
                                 sg_err_t *err);

typedef struct sg_ckpt_fetch_opts_s {
  int streams_per_source; /* parallel connections per source; 0 = 2 */
  uint64_t min_chunk;     /* smallest chunk handed to a stream; 0 = 1 MiB */
  int same_host;          /* 0 = when possible, -1 = never (TCP only) */
  /* NULL, or one flag per destination region: nonzero when its pages are
   * already mapped (the caller's own, touched memory, fetched into in
   * place), so they are not populated before each copy (a page-table walk
   * per page for nothing: ~70 ms per GiB measured) */
  const uint8_t *mapped;
  /* called by a stream thread after each chunk it completed (may be NULL) */
  void (*progress)(void *arg, size_t source, uint64_t bytes);
  void *progress_arg;
} sg_ckpt_fetch_opts_t;

/*
 * sg_ckpt_fetch_data: fetch the data regions of `step` with layout
 * `layout` into `dst` (n regions whose lengths must equal the served ones,
 * in order), striped over the `naddr` sources: the concatenation is cut
 * into chunks that streams_per_source connections per source take in turn,
 * so a faster source takes more.  A source on the same host (see the top of
 * this file) is read with process_vm_readv instead, by the same streams and
 * chunks.  A chunk that fails on one source is taken
 * again by another; a source that fails is dropped.  Blocks until every
 * byte has arrived, every source has failed, or `deadline`.  `bytes` (may
 * be NULL, else naddr entries) gets the bytes taken from each source.  On
 * error `dst` holds partial data and must be discarded.  Returns 0,
 * SG_ETIMEDOUT, SG_EABORTED, SG_EINVAL, SG_ENOMEM or the last source's
 * error (SG_ESTATE for a wrong step or layout, SG_EAUTH, SG_EPROTO,
 * SG_EPEER, ...); detail in err.
 */
SG_EXPORT int sg_ckpt_fetch_data(sg_ckpt_fetch_t *f, const char *const *addrs,
                                 size_t naddr, const char *token, int64_t step,
                                 uint64_t layout, const sg_ckpt_region_t *dst,
                                 size_t n, const sg_ckpt_fetch_opts_t *o,
                                 sg_deadline_t deadline, uint64_t *bytes,
                                 sg_err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* STEPGUARD_CKPT_H */
