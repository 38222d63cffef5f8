/*
 * client_int.h: what the two files of the rpc client channel share and
 * nothing else does (see stepguard/rpc_client.h for the channel, and
 * client.c for its threading and fork rules).
 *
 *   client.c     the channel and its calls: target parsing, the call
 *                object and its references, the public API (new, call,
 *                call_start, abort, disconnect, connected, free)
 *   client_io.c  the channel's I/O thread: the connection (socket + the
 *                I/O-free HTTP/2 engine of h2c.c), the connect state
 *                machine, submission, the deadlines of asynchronous calls,
 *                and wake_cb (what callers ask of the thread)
 */
#ifndef SG_RPC_CLIENT_INT_H
#define SG_RPC_CLIENT_INT_H

#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "rpc/client_async.h"
#include "rpc/h2c.h"
#include "stepguard/rpc_client.h"

#define LOG "rpc_client"

#define DEFAULT_MAX_MESSAGE ((size_t)64 << 20)
#define DEFAULT_CONNECT_TIMEOUT_MS 10000
#define DEFAULT_KEEPALIVE_INTERVAL_MS 60000 /* tonic's, as torchft sets it */
#define DEFAULT_KEEPALIVE_TIMEOUT_MS 20000
#define BACKOFF_INITIAL_MS 100
#define BACKOFF_MAX_MS 10000
#define BACKOFF_JITTER_MS 100
#define READ_BUDGET 32             /* reads per readable event */
#define WRITE_BUDGET 64            /* sends per flush */
#define GATHER_MAX 32768           /* frame bytes gathered per send */
#define READ_CHUNK 32768           /* bytes per read */
#define WBUF_MAX ((size_t)4 << 20) /* unsent bytes held for one conn */
#define MAX_PATH_LEN 1024
#define MAX_TOKEN_LEN 4096
#define DISCONNECT_WAIT_MS 1000
#define MAX_TARGETS 16 /* comma-separated targets of one channel */

/* ---- intrusive lists ----------------------------------------------------- */

typedef struct link_s {
  struct link_s *prev, *next;
} link_t;

static inline void link_init(link_t *h) { h->prev = h->next = h; }
static inline int link_empty(const link_t *h) { return h->next == h; }
static inline void link_push(link_t *h, link_t *n) {
  n->prev = h->prev;
  n->next = h;
  h->prev->next = n;
  h->prev = n;
}
/* Unlinks `n` (a no-op if it is not linked) and leaves it self-linked. */
static inline void link_del(link_t *n) {
  n->prev->next = n->next;
  n->next->prev = n->prev;
  n->prev = n->next = n;
}

#define CONTAINER(p, type, field)                                              \
  ((type *)(void *)((char *)(p)-offsetof(type, field)))

/* ---- types --------------------------------------------------------------- */

typedef enum conn_state_e {
  ST_IDLE,       /* no connection and nobody waiting for one */
  ST_BACKOFF,    /* an attempt failed; the timer starts the next one */
  ST_CONNECTING, /* TCP connect in progress (one address after another) */
  ST_HANDSHAKE,  /* preface + SETTINGS sent, waiting for the server's */
  ST_CONNECTED,  /* streams may be opened */
  ST_DRAINING,   /* GOAWAY received: finish open streams, open no more */
  ST_CLOSED,     /* the channel is shutting down; the loop is ending */
} conn_state_t;

typedef struct conn_s conn_t;

/* One unary call: the request object shared by a caller and the I/O thread.
 */
typedef struct call_s {
  /* Immutable after submission. */
  uint8_t *body;   /* 5-byte prefix + request message */
  size_t body_len; /* bytes in body */
  char *path;
  sg_deadline_t deadline;
  sg__rpc_done_cb cb; /* asynchronous: run on completion; NULL: a caller
                         waits on cv */
  void *cb_ud;

  /* Protected by ch->mu. */
  link_t all;    /* in ch->calls from submission until freed */
  link_t sq;     /* in ch->submitq until the I/O thread takes it */
  int refs;      /* caller + I/O thread */
  int done;      /* completed: rc and results are final */
  int cancelled; /* completed by caller/abort: the I/O thread drops it */
  int on_wire;   /* its HEADERS were submitted on a connection */
  int rc;
  pthread_cond_t cv; /* its caller waits here; signalled when it completes */
  int cv_init;       /* cv was initialised */
  int grpc_status;   /* -1 when none came */
  char msg[SG__H2C_MSG_MAX]; /* error detail */
  uint8_t *resp; /* response message (owned until the caller takes it) */
  size_t resp_len;

  /* I/O thread only. */
  link_t io;           /* in ch->pending (or a private list) until submitted */
  sg__h2c_stream_t st; /* its stream: in conn->h2's list while open */
} call_t;

/* One TCP connection with its HTTP/2 engine.  Freed in its close callback.
 */
struct conn_s {
  uv_poll_t poll;
  sg_rpc_channel_t *ch;
  int fd;
  sg__h2c_t h2;    /* its streams are the calls on this connection */
  int h2_live;     /* h2 is set up: not while TCP connects, nor after drop */
  unsigned events; /* uv_poll events currently requested */
  sg_buf_t wbuf;   /* gathered frames; what the socket refused */
  uint8_t rdbuf[READ_CHUNK];
};

struct sg_rpc_channel_s {
  /* Immutable after sg_rpc_channel_new. */
  char *target; /* as given, for messages */
  struct target_s {
    char *host;       /* without brackets */
    char port_str[8]; /* decimal port */
    char *authority;  /* host:port as sent in :authority */
  } tg[MAX_TARGETS];  /* "a,b,c": one each; connect attempts rotate */
  size_t n_tg;
  size_t cur_tg;     /* I/O thread: the target of the current attempt */
  uint64_t attempts; /* I/O thread: connect attempts started */
  char *auth_value;  /* "Bearer <token>" or NULL */
  size_t max_message;
  int64_t connect_timeout_ms;
  int64_t ka_interval_ms; /* keepalive PING period; 0: none */
  int64_t ka_timeout_ms;  /* keepalive ACK timeout */
  int fail_fast;          /* a failed connect attempt fails the queued calls */
  unsigned fork_count;    /* sg_sock_fork_count() at creation */
  pthread_t thread;
  int thread_started;

  /* Protected by mu. */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* broadcast on completions and connection up */
  link_t calls;      /* every live call */
  link_t submitq;    /* calls not yet taken by the I/O thread */
  int aborted;
  int closing;        /* free() is shutting the loop down */
  int cancel_pending; /* some call was cancelled by its caller */
  int conn_up;        /* mirrors `connected` for condition waits */
  uint64_t disc_req;  /* disconnect() requests made */
  uint64_t disc_done; /* disconnect() requests carried out */
  sg_err_t last_err;  /* last connect failure; cleared on connect */

  atomic_int connected; /* for sg_rpc_channel_connected() */

  /* I/O thread only (and the loop's handles). */
  uv_loop_t loop;
  uv_async_t wake;
  uv_timer_t timer;    /* backoff delay or attempt timeout */
  uv_timer_t ka_timer; /* keepalive: next PING, or its ACK deadline */
  uv_timer_t dl_timer; /* the next asynchronous call's deadline */
  conn_state_t state;
  conn_t *conn;
  link_t pending;           /* calls waiting for a connection */
  int64_t backoff_ms;       /* the next backoff delay (before jitter) */
  uint64_t rng;             /* jitter generator state */
  struct addrinfo *ai;      /* addresses of the current attempt */
  struct addrinfo *ai_cur;  /* the next address to try */
  sg_deadline_t ctor_until; /* construction wants a connection until then */
  uint64_t disc_handled;    /* disc_req value last carried out */
};

/* ---- calls (client.c) ---------------------------------------------------- */

/* Frees a call and what it owns (NULL: nothing). */
void sg__rpcc_call_free(call_t *c);

/* Drops one reference; returns 1 when the caller must sg__rpcc_call_free(c)
 * after releasing mu.  Requires mu. */
int sg__rpcc_unref_locked(call_t *c);

/* Marks `c` complete unless it already is, without waking its caller;
 * requires mu.  `resp` (owned) is attached on success and freed otherwise.
 * Returns 1 if it completed. */
int sg__rpcc_complete_locked(call_t *c, int rc, int grpc_status, uint8_t *resp,
                             size_t resp_len, const char *msg);

/* The outcome of call `c` whose deadline passed, as the blocking call
 * reports it: SG_ETIMEDOUT, or the last connect failure when it never got a
 * connection; its message into m[cap].  Requires mu. */
int sg__rpcc_deadline_locked(const sg_rpc_channel_t *ch, const call_t *c,
                             char *m, size_t cap);

/* ---- the I/O thread (client_io.c) ---------------------------------------- */

/* Sets up the channel's loop and its handles and starts the I/O thread
 * (which takes no signals).  On an error nothing of it is left. */
int sg__rpcc_io_start(sg_rpc_channel_t *ch, sg_err_t *err);

#endif /* SG_RPC_CLIENT_INT_H */
