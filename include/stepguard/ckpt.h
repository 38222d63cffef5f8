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
