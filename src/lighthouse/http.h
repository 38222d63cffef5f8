/*
 * http.h: the lighthouse's HTTP/1.1 side: dashboard, /status JSON, /metrics
 * and the dashboard's kill action, served by libmicrohttpd on connections
 * that the lighthouse's listener sniffed as HTTP/1.1.
 *
 *   router     sg__lh_http_route(): pure, method + raw path -> route
 *   renderers  sg__lh_render_status_json(), sg__lh_render_metrics(),
 *              sg__lh_index_html() (dashboard.c): pure, snapshot -> bytes
 *   server     sg__lh_http_new() / _add_connection() / _free(): an MHD
 *              daemon without a listening socket and with its own thread
 *
 * Routes:
 *   GET  /                         HTML dashboard (self-contained)
 *   GET  /status                   snapshot as JSON
 *   GET  /metrics                  Prometheus text format 0.0.4
 *   POST /replica/{replica_id}/kill  kill_cb(replica_id); Bearer auth if a
 *                                  token is configured
 * HEAD is accepted wherever GET is.  Unknown path: 404; known path, wrong
 * method: 405 with Allow; bad replica id: 400; request body over
 * SG__LH_HTTP_MAX_BODY: 413 (or a close when it is chunked).
 */
#ifndef STEPGUARD_LH_HTTP_H
#define STEPGUARD_LH_HTTP_H

#include <stddef.h>

#include "lighthouse/status.h"
#include "stepguard/base.h"

#define SG__LH_HTTP_MAX_BODY 4096          /* request body limit, bytes */
#define SG__LH_REPLICA_ID_MAX 512          /* decoded replica id, bytes */
#define SG__LH_HTTP_MAX_RENDER (16u << 20) /* JSON and metrics output cap */

/* ---- router ---------------------------------------------------------- */

typedef enum sg__lh_route_e {
  SG__LH_ROUTE_INDEX = 0,   /* GET / */
  SG__LH_ROUTE_STATUS,      /* GET /status */
  SG__LH_ROUTE_METRICS,     /* GET /metrics */
  SG__LH_ROUTE_KILL,        /* POST /replica/{id}/kill */
  SG__LH_ROUTE_NOT_FOUND,   /* 404 */
  SG__LH_ROUTE_BAD_METHOD,  /* 405; allow says what is */
  SG__LH_ROUTE_BAD_REQUEST, /* 400: malformed path or replica id */
} sg__lh_route_t;

typedef struct sg__lh_route_match_s {
  sg__lh_route_t route;
  int status;        /* HTTP status the route implies: 200, 400, 404, 405 */
  const char *allow; /* static; for 405: the Allow header value, else NULL */
  const char *why;   /* static; for 400: a short reason, else NULL */
  char replica_id[SG__LH_REPLICA_ID_MAX + 1]; /* KILL: the decoded id */
  size_t replica_id_len;
} sg__lh_route_match_t;

/*
 * sg__lh_http_route: map `method` and the raw (not yet percent-decoded)
 * request path `url` to a route, filling *out, and return out->route.
 * A query string ("?...") is ignored.  The replica id segment of the kill
 * route is percent-decoded; it must decode to 1..SG__LH_REPLICA_ID_MAX
 * bytes of valid UTF-8 without control characters (no NUL, no byte below
 * 0x20, no DEL), else the route is BAD_REQUEST.  NULL method or url give
 * BAD_REQUEST.  Pure: no allocation, no I/O; any thread.
 */
sg__lh_route_t sg__lh_http_route(const char *method, const char *url,
                                 sg__lh_route_match_t *out);

/* ---- renderers ------------------------------------------------------- */

/*
 * sg__lh_render_status_json: append the snapshot `s` as one JSON object to
 * `out`.  Strings are escaped (quote, backslash, control characters, and
 * <, >, & as \u escapes); bytes that are not valid UTF-8 become U+FFFD.
 * NULL strings render as "".  Returns 0, SG_ENOMEM or SG_ETOOBIG (out's
 * maximum reached); on error `out` may hold a partial document.
 */
int sg__lh_render_status_json(const sg__lh_status_t *s, sg_buf_t *out);

/*
 * sg__lh_render_metrics: append `s` in the Prometheus text exposition
 * format 0.0.4 (metric names stepguard_lighthouse_*).  Histogram buckets
 * whose bound is not finite or not increasing are skipped.  Returns as
 * sg__lh_render_status_json.
 */
int sg__lh_render_metrics(const sg__lh_status_t *s, sg_buf_t *out);

/*
 * sg__lh_index_html: the dashboard page (dashboard.c), a static
 * NUL-terminated string with inline CSS, JS and SVG (no external URL) that
 * polls /status every second and draws its history.
 */
const char *sg__lh_index_html(void);

/* ---- server ---------------------------------------------------------- */

/*
 * sg__lh_snapshot_cb: fill *out (zeroed by the caller) with the current
 * state; return 0 or an SG_E* code.  On error anything put in *out is still
 * released with sg__lh_status_free().  Called on the HTTP thread.
 */
typedef int (*sg__lh_snapshot_cb)(void *ud, sg__lh_status_t *out);

/*
 * sg__lh_kill_cb: ask replica `replica_id` (decoded, NUL-terminated) to
 * exit; may block (it is synchronous, on the HTTP thread, so it should have
 * its own deadline).  Returns 0, SG_ENOTFOUND when no such replica is in the
 * previous quorum, or another SG_E* code with detail written to err
 * (errlen bytes, NUL-terminated; may be left "").
 */
typedef int (*sg__lh_kill_cb)(void *ud, const char *replica_id, char *err,
                              size_t errlen);

typedef struct sg__lh_http_opts_s {
  const char *auth_token;      /* NULL or "": no auth; copied; <= 1024 bytes */
  unsigned max_connections;    /* 0: 256 */
  unsigned timeout_s;          /* idle connection timeout; 0: 10 s */
  sg__lh_snapshot_cb snapshot; /* required */
  sg__lh_kill_cb kill;         /* required */
  void *ud;                    /* borrowed; passed to both callbacks */
} sg__lh_http_opts_t;

typedef struct sg__lh_http_s sg__lh_http_t;

/*
 * sg__lh_http_new: start the HTTP server thread.  On success *out owns it
 * (release with sg__lh_http_free).  Returns 0, SG_EINVAL (missing callback,
 * token too long), SG_ENOMEM or SG_EIO (MHD would not start); detail in err.
 * The callbacks are never called after an error.
 */
int sg__lh_http_new(const sg__lh_http_opts_t *o, sg__lh_http_t **out,
                    sg_err_t *err);

/*
 * sg__lh_http_add_connection: serve the connected socket `fd` (registered
 * with sg_sock_register, non-blocking; unread bytes may be pending).  Takes
 * ownership of fd in every case: on error it is closed and unregistered.
 * While MHD holds the socket it stays in the fork registry; MHD's close
 * unregisters it.  Returns 0, SG_EINVAL (h NULL or fd < 0), SG_EAGAIN
 * (connection limit reached), or -errno from getpeername()/MHD.  Callable
 * from any thread, but not concurrently with or after sg__lh_http_free.
 */
int sg__lh_http_add_connection(sg__lh_http_t *h, int fd);

/*
 * sg__lh_http_free: stop the thread, close every connection (in-flight
 * requests are dropped), free `h` (NULL is a no-op).  Blocks until a kill_cb
 * that is running returns.  Must not be called from a callback.
 */
void sg__lh_http_free(sg__lh_http_t *h);

#endif /* STEPGUARD_LH_HTTP_H */
