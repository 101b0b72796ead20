/* coordinator/serve.c: `k3-coordinator serve` (serve.h): options, the
 * engine, the HTTP daemon, routing and shutdown.
 *
 * A request goes: headers (route, method, auth, Content-Length against
 * K3_SERVE_MAX_BODY) -> body accumulated up to K3_SERVE_MAX_BODY (more is a
 * 413; a body slower than --conn-timeout-s closes the connection) ->
 * serve_req_parse -> serve_job_start (renders, checks the context, then
 * admission: at most --parallel generations run at once, up to --max-queue
 * in all wait for a slot in arrival order, one more is a 429) -> either a
 * callback response that streams the job's SSE events, or the complete JSON
 * once the job is finished. libmicrohttpd runs every connection on a thread
 * of its own (at most --max-conns), so the access handler and the stream
 * reader may block; both look at the client's socket every 250 ms and
 * cancel the job when it is gone.
 *
 * Sessions: --max-sessions ids, each an engine session. Admission gives a
 * request the idle id whose committed ids (or turn checkpoint) are the
 * longest prefix of its prompt, else the least recently used one, so a
 * conversation's next turn prefills only its new tokens
 * (k3_engine_session_reuse).
 *
 * Shutdown: the signal handler only writes to a pipe. The main thread then
 * quiesces the daemon (no new connections), waits up to --drain-s for the
 * requests in flight, aborts (cancels) the generations still open, stops
 * the daemon, waits for them (each ends within one step) and closes the
 * engine.
 */
#include "coordinator/serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/base/strbuf.h"
#include "common/engine/engine_opts.h"
#include "coordinator/engine.h"
#include "coordinator/serve_api.h"
#include "coordinator/serve_stats.h"
#include "coordinator/serve_web.h"
#include "proto/link.h"

/* ---- the option table -------------------------------------------------- */

typedef struct serve_opts {
    k3_engine_opts eng; /* model, numerics, threads, expert cache */
    char *host;         /* listen address (numeric IPv4) */
    int port;
    k3_cluster_cli cl;  /* K3_CLUSTER_OPT_ROWS: --local, --workers, liveness, keys */
    char *api_key;      /* required Bearer token, NULL = open */
    int max_queue;      /* generations admitted at once: running + waiting for a slot */
    int parallel;       /* generations running at once (at most max_queue) */
    int max_sessions;   /* sessions kept for prefix reuse (>= parallel) */
    int ckpt;           /* turn checkpoints per session */
    char *ckpt_dir;     /* checkpoints parked on disk too */
    int ctx;            /* context of every session, tokens */
    int max_tokens;     /* default max_tokens */
    int chunk;          /* prefill chunk */
    int drain_s;        /* shutdown: how long requests in flight may take */
    int conn_timeout_s; /* idle connection timeout; also the deadline of a request body */
    int max_conns;      /* connections at once (a thread each) */
    char *model_id;     /* id in /v1/models, NULL = the model directory's name */
    int help;
} serve_opts;

#define O(f) offsetof(serve_opts, f)
static const k3_opt serve_table[] = {
    K3_ENGINE_OPT_MODEL(serve_opts, eng),
    {.name = "host",
     .flag = "--host",
     .env = "K3_HOST",
     .type = K3_OPT_STRING,
     .offset = O(host),
     .def = "127.0.0.1",
     .metavar = "ADDR",
     .help = "listen address (numeric IPv4)"},
    {.name = "port",
     .flag = "--port",
     .env = "K3_PORT",
     .type = K3_OPT_INT,
     .offset = O(port),
     .def = "8080",
     .min = 1,
     .max = 65535,
     .metavar = "N",
     .help = "listen port"},
    {.name = "api_key",
     .flag = "--api-key",
     .env = "K3_API_KEY",
     .type = K3_OPT_STRING,
     .offset = O(api_key),
     .metavar = "KEY",
     .help = "require 'Authorization: Bearer KEY' on /v1/ (unset = no authentication)"},
    {.name = "max_queue",
     .flag = "--max-queue",
     .env = "K3_MAX_QUEUE",
     .type = K3_OPT_INT,
     .offset = O(max_queue),
     .def = "16",
     .min = 1,
     .max = K3_SERVE_MAX_QUEUE,
     .metavar = "N",
     .help = "generations admitted at once: --parallel run, the rest wait in arrival order for "
             "a slot; one more is refused with 429 and Retry-After"},
    {.name = "parallel",
     .flag = "--parallel",
     .env = "K3_PARALLEL",
     .type = K3_OPT_INT,
     .offset = O(parallel),
     .def = "8",
     .min = 1,
     .max = K3_SERVE_MAX_QUEUE,
     .metavar = "N",
     .help = "generations running at once (at most --max-queue: the smaller wins)"},
    /* not the CLI's --max-sessions (what each local worker holds): the
     * conversations the server keeps, so it has a variable and at least 1 */
    {.name = "max_sessions",
     .flag = "--max-sessions",
     .env = "K3_MAX_SESSIONS",
     .type = K3_OPT_INT,
     .offset = O(max_sessions),
     .def = "16",
     .min = 1,
     .max = K3_SERVE_MAX_QUEUE,
     .metavar = "N",
     .help = "conversations kept for prefix reuse (>= --parallel); a request takes the idle one "
             "whose ids are the longest prefix of its prompt, else the least recently used"},
    {.name = "ckpt",
     .flag = "--ckpt",
     .env = "K3_CKPT",
     .type = K3_OPT_INT,
     .offset = O(ckpt),
     .def = "0",
     .min = 0,
     .max = K3_MAX_CKPT,
     .metavar = "N",
     .help = "turn checkpoints kept per session (KDA states at each prompt's end): an edited "
             "earlier turn restores the deepest one instead of replaying (on workers: CHECKPOINT)"},
    {.name = "ckpt-dir",
     .flag = "--ckpt-dir",
     .env = "K3_CKPT_DIR",
     .type = K3_OPT_STRING,
     .offset = O(ckpt_dir),
     .metavar = "DIR",
     .help = "park every turn checkpoint in DIR too (local workers in DIR/w<i>-<a>-<b>, remote "
             "ones in their own --ckpt-dir): a restarted server resumes a conversation from its "
             "last turn instead of prefilling it (needs --ckpt N)"},
    K3_ENGINE_OPT_CTX(serve_opts, ctx),
    /* K3_NGEN as in the CLI and chat, but here only a request's default */
    {.name = "max_tokens",
     .flag = "--max-tokens",
     .env = "K3_NGEN",
     .type = K3_OPT_INT,
     .offset = O(max_tokens),
     .def = "1024",
     .min = 1,
     .max = K3_MAX_NGEN,
     .metavar = "N",
     .help = "max_tokens of a request that gives none"},
    K3_ENGINE_OPT_CHUNK(serve_opts, chunk),
    {.name = "drain_s",
     .flag = "--drain-s",
     .type = K3_OPT_INT,
     .offset = O(drain_s),
     .def = "30",
     .min = 0,
     .max = 3600,
     .metavar = "S",
     .help = "at shutdown, how long requests in flight may still take"},
    {.name = "conn_timeout_s",
     .flag = "--conn-timeout-s",
     .env = "K3_CONN_TIMEOUT_S",
     .type = K3_OPT_INT,
     .offset = O(conn_timeout_s),
     .def = "30",
     .min = 1,
     .max = 3600,
     .metavar = "S",
     .help = "a connection silent this long is closed, and so is one whose request body does "
             "not arrive within it: slow clients cannot hold a thread"},
    {.name = "max_conns",
     .flag = "--max-conns",
     .env = "K3_MAX_CONNS",
     .type = K3_OPT_INT,
     .offset = O(max_conns),
     .def = "512",
     .min = 1,
     .max = K3_SERVE_MAX_CONNS,
     .metavar = "N",
     .help = "connections served at once (a thread each); more are closed at accept"},
    {.name = "model_id",
     .flag = "--model-id",
     .type = K3_OPT_STRING,
     .offset = O(model_id),
     .metavar = "ID",
     .help = "model id in /v1/models (default: the model directory's name)"},
    K3_ENGINE_OPT_ROWS(serve_opts, eng),
    K3_CLUSTER_OPT_ROWS(serve_opts, cl),
    K3_OPT_HELP(serve_opts, help),
};
#undef O
#define N_SERVE_OPTS ((int)(sizeof serve_table / sizeof serve_table[0]))

static const char *serve_usage =
    "usage: k3-coordinator serve --model DIR [--host ADDR] [--port N] [--local N | --workers "
    "EP,...]\n"
    "                            [--api-key KEY] [--max-queue N] [--max-sessions N] [--ctx N]\n"
    "                            [--max-tokens N]\n"
    "OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions,\n"
    "GET /v1/models, GET /health, GET /metrics (docs/SERVING.md).\n"
    "A chat page for a browser at GET / (docs/WEB.md).\n";

/* ---- server state ---------------------------------------------------------- */

typedef struct server {
    k3_engine *eng;
    const k3_engine_opts *eng_opts; /* directories for /health */
    serve_limits lim;
    const char *api_key;                  /* NULL = open */
    int body_timeout_ms;                  /* --conn-timeout-s: a body must arrive within it */
    pthread_mutex_t mu;                   /* guards the counts, the id pool and the job list */
    pthread_cond_t cv;                    /* signalled when a count drops */
    int running;                          /* generations admitted and not yet ended */
    int max_running;                      /* --parallel (at most --max-queue) */
    int waiting;                          /* requests waiting for a running slot */
    int max_waiting;                      /* --max-queue - the running slots */
    struct waiter *wait_head, *wait_tail; /* the waiting requests, in arrival order */
    int n_ids;                            /* --max-sessions: session ids 0..n_ids-1 */
    int *id_free;                         /* [n_ids] 1 = session id i is not running */
    int in_flight;                        /* HTTP requests between the first call and completion */
    int stopping;                         /* shutdown began: refuse, end streams */
    struct conn **conns; /* [max_running * 2] requests holding a job (abort at shutdown) */
    int n_conns, cap_conns;
    serve_metrics m; /* (mu) /metrics counters */
} server;

/* One HTTP request (libmicrohttpd's con_cls). */
typedef struct conn {
    server *srv;
    struct MHD_Connection *mc; /* the connection, for the client-gone probe */
    int route;                 /* ROUTE_* */
    k3_strbuf body;            /* the upload, at most K3_SERVE_MAX_BODY bytes */
    int too_big;               /* the body passed the limit: 413 at the end */
    int answered;              /* a refusal was queued at the headers */
    serve_job *job;            /* the running generation, a reference */
    int idle_ticks;            /* 250 ms reader rounds without an SSE write */
    double t0_ms;              /* the headers arrived (the body deadline counts from here) */
} conn;

enum {
    ROUTE_NONE = 0,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MODELS,
    ROUTE_MODEL,
    ROUTE_NO_MODEL, /* /v1/models/{another id} */
    ROUTE_HEALTH,
    ROUTE_METRICS,
    ROUTE_WEB /* the chat page's files (serve_web.h) */
};

static int g_sig_pipe[2] = {-1, -1};

static void on_signal(int sig) {
    unsigned char b = (unsigned char)sig;
    ssize_t w = write(g_sig_pipe[1], &b, 1);
    (void)w;
}

/* ---- responses ----------------------------------------------------------- */

/* Queues json with status http; allow, when not NULL, is the Allow header
 * of a 405, request_id the x-request-id of a generation. */
static enum MHD_Result send_json_hdr(struct MHD_Connection *c, int http, const char *json,
                                     const char *allow, const char *request_id) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(json), (void *)json, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "application/json");
    if (allow) MHD_add_response_header(r, "Allow", allow);
    if (request_id) MHD_add_response_header(r, "x-request-id", request_id);
    if (http == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (http == 429) MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)http, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection *c, int http, const char *json) {
    return send_json_hdr(c, http, json, NULL, NULL);
}

static enum MHD_Result send_err(struct MHD_Connection *c, const serve_err *e) {
    char *s = serve_err_json(e);
    enum MHD_Result r = send_json(c, e->http, s);
    free(s);
    return r;
}

/* ---- routing and authentication --------------------------------------------- */

/* The route of url and the method it takes ("GET" / "POST"). */
static int route_of(const serve_limits *lim, const char *url, const char **method) {
    *method = "POST";
    if (!strcmp(url, "/v1/chat/completions")) return ROUTE_CHAT;
    if (!strcmp(url, "/v1/completions")) return ROUTE_COMPLETIONS;
    *method = "GET";
    if (!strcmp(url, "/v1/models")) return ROUTE_MODELS;
    if (!strncmp(url, "/v1/models/", 11))
        return strcmp(url + 11, lim->model_id) ? ROUTE_NO_MODEL : ROUTE_MODEL;
    if (!strcmp(url, "/health")) return ROUTE_HEALTH;
    if (!strcmp(url, "/metrics")) return ROUTE_METRICS;
    if (serve_web_find(url)) return ROUTE_WEB;
    return ROUTE_NONE;
}

/* Constant-time comparison of the offered key a with the server's key b:
 * the loop always runs over all of b, so the time depends on b's length
 * only, not on where a differs (a shorter a reads its NUL, then byte 0). */
static int key_equal(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = la != lb;
    for (size_t i = 0; i < lb; i++) d |= (unsigned char)(a[i <= la ? i : 0] ^ b[i]);
    return d == 0;
}

static int authorized(const server *s, struct MHD_Connection *c) {
    if (!s->api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
    h += 7;
    while (*h == ' ') h++;
    return key_equal(h, s->api_key);
}

/* ---- GET endpoints --------------------------------------------------------- */

static json_t *model_obj(const server *s) {
    return json_pack("{s:s,s:s,s:I,s:s}", "id", s->lim.model_id, "object", "model", "created",
                     (json_int_t)0, "owned_by", "k3shard");
}

static enum MHD_Result send_obj(struct MHD_Connection *c, int http, json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return MHD_NO;
    enum MHD_Result r = send_json(c, http, s);
    free(s);
    return r;
}

static enum MHD_Result get_route(server *s, struct MHD_Connection *c, int route, const char *url) {
    if (route == ROUTE_WEB) return (enum MHD_Result)serve_web_answer(c, url);
    if (route == ROUTE_MODELS)
        return send_obj(c, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_obj(s)));
    if (route == ROUTE_MODEL) return send_obj(c, 200, model_obj(s));
    if (route == ROUTE_NO_MODEL) {
        serve_err e;
        serve_fail(&e, 404, "invalid_request_error", "model", "model_not_found",
                   "this server serves one model, '%.200s'", s->lim.model_id);
        return send_err(c, &e);
    }
    if (route == ROUTE_METRICS) {
        pthread_mutex_lock(&s->mu);
        serve_metrics m = s->m;
        int running = s->running, waiting = s->waiting;
        pthread_mutex_unlock(&s->mu);
        char *text = serve_metrics_text(s->eng, &m, running, s->max_running, waiting,
                                        s->max_running + s->max_waiting);
        struct MHD_Response *r =
            MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
        if (!r) {
            free(text);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    /* /health: ready once the engine is open (the daemon starts after) */
    const k3_config *cfg = k3_engine_config(s->eng);
    int live = 0, busy = 0;
    k3_engine_sessions(s->eng, &live, &busy);
    pthread_mutex_lock(&s->mu);
    serve_metrics m = s->m;
    json_t *o = json_pack("{s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "status",
                          s->stopping ? "stopping" : "ok", "model", s->lim.model_id, "layers",
                          cfg->n_layers, "context", s->lim.ctx, "queue", s->waiting, "running",
                          s->running, "parallel", s->max_running, "max_queue",
                          s->max_running + s->max_waiting, "sessions", live, "max_sessions",
                          s->n_ids, "sessions_busy", busy, "requests", s->in_flight);
    int http = s->stopping ? 503 : 200;
    pthread_mutex_unlock(&s->mu);
    double hit_rate = 0, gb_read = 0;
    json_t *ws = serve_workers_json(s->eng, s->eng_opts, &m, &hit_rate, &gb_read);
    json_object_set_new(o, "hit_rate", json_real(hit_rate));
    json_object_set_new(o, "gb_read", json_real(gb_read));
    json_object_set_new(o, "workers", ws);
    return send_obj(c, http, o);
}

/* ---- generations ------------------------------------------------------------ */

/* The idle session whose committed ids are the longest prefix of prompt
 * (ties and no reuse: the least recently used, a never used one first);
 * s->mu held, a running slot taken. */
static int pick_session(server *s, const int32_t *prompt, int n) {
    int id = -1, best = -1;
    uint64_t best_lu = 0;
    for (int i = 0; i < s->n_ids; i++) {
        if (!s->id_free[i]) continue;
        uint64_t lu = 0;
        int reuse = k3_engine_session_reuse(s->eng, (uint64_t)i, prompt, n, s->lim.ctx, &lu);
        if (reuse > best || (reuse == best && lu < best_lu)) {
            best = reuse;
            best_lu = lu;
            id = i;
        }
    }
    return id;
}

/* A request waiting for a running slot (on its connection's stack). */
typedef struct waiter {
    struct waiter *next;
} waiter;

static void wait_unlink(server *s, waiter *w) {
    waiter **pp = &s->wait_head, *prev = NULL;
    while (*pp && *pp != w) prev = *pp, pp = &(*pp)->next;
    if (!*pp) return;
    *pp = w->next;
    if (s->wait_tail == w) s->wait_tail = prev;
    s->waiting--;
    pthread_cond_broadcast(&s->cv); /* the next one in line may go */
}

/* Takes a running slot and a session for prompt. When --parallel are
 * running, waits in arrival order for one to end, as long as fewer than
 * --max-queue - --parallel wait already, looking every 250 ms whether its
 * client left (gone(gone_ctx), may be NULL); -1 when the queue is full
 * (429) or the server shuts down, -2 when the client left. */
static int admit(server *s, const int32_t *prompt, int n, int (*gone)(void *), void *gone_ctx) {
    int id = -1;
    pthread_mutex_lock(&s->mu);
    int queued = 0;
    if (!s->stopping && (s->running >= s->max_running || s->waiting > 0)) {
        if (s->waiting >= s->max_waiting) {
            pthread_mutex_unlock(&s->mu);
            return -1;
        }
        waiter me = {NULL};
        if (s->wait_tail)
            s->wait_tail->next = &me;
        else
            s->wait_head = &me;
        s->wait_tail = &me;
        s->waiting++;
        queued = 1;
        while (!s->stopping && (s->running >= s->max_running || s->wait_head != &me)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 250 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            if (gone && !s->stopping && gone(gone_ctx)) {
                s->m.left_waiting++;
                wait_unlink(s, &me);
                pthread_mutex_unlock(&s->mu);
                return -2;
            }
        }
        wait_unlink(s, &me);
    }
    if (!s->stopping && s->running < s->max_running) {
        id = pick_session(s, prompt, n);
        if (id >= 0) {
            s->id_free[id] = 0;
            s->running++;
            if (queued) s->m.queued++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return id;
}

/* The job's done callback (its thread) or a start that failed. */
typedef struct done_ctx {
    server *srv;
    struct conn *k; /* the request, for the client-gone probe while it waits */
    int session;    /* -1 until admitted */
} done_ctx;

static int client_gone(void *ctx);

/* serve_job_start's admission callback. */
static int job_admit(void *ctx, const int32_t *prompt, int n) {
    done_ctx *d = ctx;
    d->session = admit(d->srv, prompt, n, client_gone, d->k);
    if (d->session == -1) {
        pthread_mutex_lock(&d->srv->mu);
        d->srv->m.rejected_queue++;
        pthread_mutex_unlock(&d->srv->mu);
    }
    return d->session;
}

static void release(server *s, int session) {
    pthread_mutex_lock(&s->mu);
    s->id_free[session] = 1;
    s->running--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void job_done(void *ctx, const serve_job_stats *st) {
    done_ctx *d = ctx;
    pthread_mutex_lock(&d->srv->mu);
    serve_metrics_add(&d->srv->m, st);
    pthread_mutex_unlock(&d->srv->mu);
    release(d->srv, d->session);
    free(d);
}

/* 1 when the client has closed its end (or the socket failed): a peek
 * that reads end-of-file. Called on the connection's own thread. */
static int client_gone(void *ctx) {
    conn *k = ctx;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(k->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    char b;
    ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static void conn_track(server *s, conn *k, int add) {
    pthread_mutex_lock(&s->mu);
    if (add) {
        if (s->n_conns == s->cap_conns) {
            s->cap_conns = s->cap_conns ? 2 * s->cap_conns : 16;
            s->conns = k3_xrealloc(s->conns, (size_t)s->cap_conns * sizeof *s->conns);
        }
        s->conns[s->n_conns++] = k;
    } else {
        for (int i = 0; i < s->n_conns; i++)
            if (s->conns[i] == k) {
                s->conns[i] = s->conns[--s->n_conns];
                break;
            }
    }
    pthread_mutex_unlock(&s->mu);
}

/* The SSE reader: blocks (this connection's own thread) until the job has
 * events. Every 250 ms without any it looks whether the client is gone
 * (then the job is cancelled and the connection closed: the engine stops
 * within one step); a comment line every 10 s keeps idle proxies from
 * closing the stream during a long prefill. A client that leaves while
 * events flow is seen by the failing write instead (on_completed). */
static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    conn *k = cls;
    for (;;) {
        long n = serve_job_read(k->job, buf, max, 250);
        if (n > 0) {
            k->idle_ticks = 0;
            return n;
        }
        if (n < 0) return MHD_CONTENT_READER_END_OF_STREAM;
        if (client_gone(k)) {
            serve_job_cancel(k->job);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (++k->idle_ticks >= 40 && max >= 16) {
            k->idle_ticks = 0;
            memcpy(buf, ": keep-alive\n\n", 14);
            return 14;
        }
    }
}

static enum MHD_Result run_generation(conn *k, struct MHD_Connection *c) {
    server *s = k->srv;
    serve_err e;
    serve_req r;
    int chat = k->route == ROUTE_CHAT;
    if (!serve_req_parse(&r, chat, k->body.p ? k->body.p : "", k->body.n, &e)) {
        serve_req_free(&r);
        return send_err(c, &e);
    }
    done_ctx *d = k3_xmalloc(sizeof *d);
    d->srv = s;
    d->k = k;
    d->session = -1;
    int ok = serve_job_start(&k->job, s->eng, &r, &s->lim, job_admit, job_done, d, &e);
    int stream = r.stream;
    serve_req_free(&r);
    if (!ok) {
        if (d->session >= 0) release(s, d->session);
        free(d);
        return send_err(c, &e);
    }
    conn_track(s, k, 1);
    if (!stream) {
        char *json = serve_job_wait(k->job, client_gone, k, &e);
        if (!json && client_gone(k)) return MHD_NO; /* nobody to answer: close */
        enum MHD_Result ret =
            json ? send_json_hdr(c, 200, json, NULL, serve_job_id(k->job)) : send_err(c, &e);
        free(json);
        return ret;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, k, NULL);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    MHD_add_response_header(resp, "Connection", "close");
    MHD_add_response_header(resp, "x-request-id", serve_job_id(k->job));
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* ---- the access handler -------------------------------------------------------- */

/* First call: the headers. Route, method, authentication and the declared
 * length are checked before any body byte is read. */
static enum MHD_Result first_call(conn *k, struct MHD_Connection *c, const char *url,
                                  const char *method, int *queued) {
    server *s = k->srv;
    *queued = 1; /* every return but the last answers the request */
    serve_err e;
    const char *want;
    k->route = route_of(&s->lim, url, &want);
    if (k->route == ROUTE_NONE) {
        serve_fail(&e, 404, "invalid_request_error", "", "not_found", "no route %.200s %.200s",
                   method, url);
        return send_err(c, &e);
    }
    if (strcmp(method, want)) {
        serve_fail(&e, 405, "invalid_request_error", "", "method_not_allowed",
                   "%s %.200s: method not allowed (use %s)", method, url, want);
        char *j = serve_err_json(&e);
        *queued = 1;
        enum MHD_Result ret = send_json_hdr(c, 405, j, want, NULL);
        free(j);
        return ret;
    }
    if (k->route != ROUTE_HEALTH && k->route != ROUTE_METRICS && k->route != ROUTE_WEB &&
        !authorized(s, c)) {
        serve_fail(&e, 401, "authentication_error", "", "invalid_api_key",
                   "missing or wrong API key (Authorization: Bearer KEY)");
        return send_err(c, &e);
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoull(cl, NULL, 10) > K3_SERVE_MAX_BODY) {
        serve_fail(&e, 413, "invalid_request_error", "", "request_too_large",
                   "request body of %.30s bytes is over %u (K3_SERVE_MAX_BODY)", cl,
                   K3_SERVE_MAX_BODY);
        return send_err(c, &e);
    }
    *queued = 0;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    server *s = cls;
    conn *k = *con_cls;
    if (!k) {
        k = k3_xcalloc(1, sizeof *k);
        k->srv = s;
        k->mc = c;
        k->t0_ms = k3_now_ms();
        *con_cls = k;
        pthread_mutex_lock(&s->mu);
        s->in_flight++;
        pthread_mutex_unlock(&s->mu);
        /* the first call has only the headers: answer now or wait for the body */
        return first_call(k, c, url, method, &k->answered);
    }
    if (k->answered) { /* refused at the headers: the body is dropped */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size && k3_now_ms() - k->t0_ms > s->body_timeout_ms) {
        /* a body trickled in slower than the deadline: close the connection
         * (libmicrohttpd would hold a queued answer until the whole body
         * came, which is what the client is slow at) */
        K3_WARN("serve: a request body took over %d s (--conn-timeout-s): connection closed",
                s->body_timeout_ms / 1000);
        return MHD_NO;
    }
    if (*upload_size) {
        if (k->body.n + *upload_size > K3_SERVE_MAX_BODY)
            k->too_big = 1;
        else
            k3_strbuf_add(&k->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    serve_err e;
    if (k->too_big) {
        serve_fail(&e, 413, "invalid_request_error", "", "request_too_large",
                   "request body over %u bytes (K3_SERVE_MAX_BODY)", K3_SERVE_MAX_BODY);
        return send_err(c, &e);
    }
    pthread_mutex_lock(&s->mu);
    int stopping = s->stopping;
    pthread_mutex_unlock(&s->mu);
    if (stopping) {
        serve_fail(&e, 503, "server_error", "", "shutting_down", "the server is shutting down");
        return send_err(c, &e);
    }
    if (k->route == ROUTE_CHAT || k->route == ROUTE_COMPLETIONS) return run_generation(k, c);
    return get_route(s, c, k->route, url);
}

/* End of a request (answered, failed or the client went away). */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)c;
    (void)toe;
    server *s = cls;
    conn *k = *con_cls;
    if (!k) return;
    *con_cls = NULL;
    if (k->job) {
        serve_job_cancel(k->job); /* no effect once the answer is complete */
        conn_track(s, k, 0);
        serve_job_unref(&k->job);
    }
    free(k->body.p);
    free(k);
    pthread_mutex_lock(&s->mu);
    s->m.http_requests++;
    s->in_flight--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- main ---------------------------------------------------------------- */

/* Waits until *count (under s->mu) is 0, at most secs seconds (< 0: for
 * ever). Returns the count left. */
static int wait_zero(server *s, const int *count, int secs) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += secs;
    pthread_mutex_lock(&s->mu);
    while (*count > 0) {
        if (secs < 0)
            pthread_cond_wait(&s->cv, &s->mu);
        else if (pthread_cond_timedwait(&s->cv, &s->mu, &dl))
            break;
    }
    int left = *count;
    pthread_mutex_unlock(&s->mu);
    return left;
}

static void engine_settings(const serve_opts *o, const k3_opt_src *src, k3_engine_open_opts *eo) {
    k3_engine_open_opts_from_cli(eo, &o->eng, &o->cl, serve_table, N_SERVE_OPTS, src);
    eo->chunk = o->chunk;
    eo->progress = 0; /* no stderr line per prefill chunk of every request */
    eo->n_sessions = o->max_sessions;
    eo->ckpt = o->ckpt;
    eo->ckpt_dir = o->ckpt_dir;
    eo->cluster.max_sessions = o->max_sessions; /* local workers keep as many states */
}

/* The served model id: --model-id, else the directory's last component. */
static void model_id_of(const serve_opts *o, char *out, size_t n) {
    if (o->model_id) {
        snprintf(out, n, "%s", o->model_id);
        return;
    }
    const char *m = o->eng.model;
    size_t len = strlen(m);
    while (len > 1 && m[len - 1] == '/') len--;
    size_t b = len;
    while (b > 0 && m[b - 1] != '/') b--;
    snprintf(out, n, "%.*s", (int)(len - b), m + b);
}

static int parse_cli(int argc, char **argv, serve_opts *o, k3_opt_src *src) {
    char err[1024] = "";
    char **pos = k3_xcalloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0;
    memset(o, 0, sizeof *o);
    k3_status st =
        k3_opts_parse(serve_table, N_SERVE_OPTS, o, src, argc, argv, pos, &n_pos, err, sizeof err);
    int rc = -1;
    if (!st && o->help) {
        k3_opts_help(stdout, serve_usage, serve_table, N_SERVE_OPTS);
        rc = 0;
    } else {
        if (!st && !o->eng.model)
            st =
                k3_errf(K3_ERR_ARG, err, sizeof err, "--model: missing (the checkpoint directory)");
        if (!st && n_pos > 0)
            st = k3_errf(K3_ERR_ARG, err, sizeof err, "unexpected argument '%s'", pos[0]);
        if (o->parallel > o->max_queue) o->parallel = o->max_queue;
        if (!st && o->max_sessions < o->parallel)
            st = k3_errf(K3_ERR_ARG, err, sizeof err,
                         "--max-sessions %d < %d generations running at once (--parallel, "
                         "--max-queue): every running generation needs a session",
                         o->max_sessions, o->parallel);
        if (!st && o->api_key && !*o->api_key)
            st = k3_errf(K3_ERR_ARG, err, sizeof err, "--api-key: empty");
        if (!st)
            st = k3_engine_opts_resolve(&o->eng, serve_table, N_SERVE_OPTS, src, err, sizeof err);
        if (st) {
            fprintf(stderr, "k3-coordinator serve: %s\n", err);
            rc = 2;
        }
    }
    free(pos);
    return rc;
}

int cmd_serve(int argc, char **argv) {
    k3_log_init("k3-coordinator serve");
    serve_opts o;
    k3_opt_src src[N_SERVE_OPTS];
    char err[1024] = "", model_id[256];
    server s;
    memset(&s, 0, sizeof s);
    struct MHD_Daemon *d = NULL;
    k3_engine_open_opts eo;
    int rc = parse_cli(argc, argv, &o, src);
    if (rc >= 0) goto out;
    rc = 1;
    struct in_addr addr;
    if (inet_pton(AF_INET, o.host, &addr) != 1) {
        fprintf(stderr, "k3-coordinator serve: --host %s: not a numeric IPv4 address\n", o.host);
        rc = 2;
        goto out;
    }
    engine_settings(&o, src, &eo);
    k3_status st = k3_engine_open(&s.eng, &eo, err, sizeof err);
    if (st) {
        fprintf(stderr, "k3-coordinator serve: error: %s\n", err);
        goto out;
    }
    model_id_of(&o, model_id, sizeof model_id);
    s.lim = (serve_limits){.ctx = o.ctx, .max_tokens = o.max_tokens, .model_id = model_id};
    s.eng_opts = &o.eng;
    s.api_key = o.api_key;
    s.body_timeout_ms = o.conn_timeout_s * 1000;
    s.max_running = o.parallel;
    s.max_waiting = o.max_queue - o.parallel;
    s.n_ids = o.max_sessions;
    s.id_free = k3_xmalloc((size_t)s.n_ids * sizeof *s.id_free);
    for (int i = 0; i < s.n_ids; i++) s.id_free[i] = 1;
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);

    /* signals go to a pipe the main thread polls */
    if (pipe(g_sig_pipe)) {
        fprintf(stderr, "k3-coordinator serve: pipe: %s\n", strerror(errno));
        goto out_engine;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct sockaddr_in sin;
    memset(&sin, 0, sizeof sin);
    sin.sin_family = AF_INET;
    sin.sin_port = htons((uint16_t)o.port);
    sin.sin_addr = addr;
    d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                             MHD_USE_ITC | MHD_USE_ERROR_LOG,
                         (uint16_t)o.port, NULL, NULL, on_request, &s, MHD_OPTION_SOCK_ADDR, &sin,
                         MHD_OPTION_NOTIFY_COMPLETED, on_completed, &s,
                         MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o.conn_timeout_s,
                         MHD_OPTION_CONNECTION_LIMIT, (unsigned)o.max_conns, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "k3-coordinator serve: cannot listen on %s:%d: %s\n", o.host, o.port,
                strerror(errno));
        goto out_engine;
    }
    printf("serving on http://%s:%d\n", o.host, o.port);
    fflush(stdout);
    serve_web_announce(o.host, o.port);

    for (;;) {
        struct pollfd p = {.fd = g_sig_pipe[0], .events = POLLIN};
        if (poll(&p, 1, -1) > 0) break;
        if (errno != EINTR) break;
    }
    MHD_quiesce_daemon(d);
    pthread_mutex_lock(&s.mu);
    s.stopping = 1;
    pthread_cond_broadcast(&s.cv); /* requests waiting for a slot leave */
    int n_req = s.in_flight, n_gen = s.running;
    pthread_mutex_unlock(&s.mu);
    K3_INFO("serve: shutting down: %d requests in flight, %d generations", n_req, n_gen);
    if ((n_req = wait_zero(&s, &s.in_flight, o.drain_s)) > 0) {
        K3_WARN("serve: %d requests still open after %d s: ending their streams", n_req, o.drain_s);
        pthread_mutex_lock(&s.mu);
        for (int i = 0; i < s.n_conns; i++) serve_job_abort(s.conns[i]->job);
        pthread_mutex_unlock(&s.mu);
    }
    MHD_stop_daemon(d);
    wait_zero(&s, &s.running, -1); /* aborted ones were cancelled: each ends within a step */
    rc = 0;
out_engine:
    k3_engine_close(&s.eng);
    free(s.id_free);
    free(s.conns);
out:
    k3_opts_free(serve_table, N_SERVE_OPTS, &o);
    return rc;
}
