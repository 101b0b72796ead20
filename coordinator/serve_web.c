/* coordinator/serve_web.c: the embedded web UI's HTTP answers
 * (serve_web.h, docs/WEB.md).
 */
#include "coordinator/serve_web.h"

#include <jansson.h>
#include <microhttpd.h>
#include <stdio.h>
#include <string.h>

#include "common/base/opts.h"
#include "coordinator/engine.h"

/* The page loads only its own files and talks only to this server: no
 * inline script or style, no other origin, no framing, no form posts. */
#define WEB_CSP                                                                                    \
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "              \
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

/* set on the main thread before the daemon starts, read-only after */
static int g_announce;
static const char *g_model_dir;
static const k3_opt_list *g_dirs;

const k3_web_asset *serve_web_find(const char *url) {
    if (!strcmp(url, "/")) url = "/index.html";
    for (int i = 0; i < k3_web_n_assets; i++)
        if (!strcmp(url, k3_web_assets[i].path)) return &k3_web_assets[i];
    return NULL;
}

int serve_web_answer(struct MHD_Connection *c, const char *url) {
    const k3_web_asset *a = serve_web_find(url);
    if (!a) return MHD_NO; /* the router only routes known paths here */
    const char *inm = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "If-None-Match");
    int fresh = inm && strstr(inm, a->etag) != NULL;
    struct MHD_Response *r =
        fresh ? MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT)
              : MHD_create_response_from_buffer(a->len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    if (!fresh) MHD_add_response_header(r, "Content-Type", a->type);
    MHD_add_response_header(r, "ETag", a->etag);
    /* no-cache: the browser keeps the file but asks each time (304 when it
     * is unchanged), so a new binary's page is never mixed with an old one */
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    MHD_add_response_header(r, "Content-Security-Policy", WEB_CSP);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "X-Frame-Options", "DENY");
    enum MHD_Result ret = MHD_queue_response(c, fresh ? MHD_HTTP_NOT_MODIFIED : MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

void serve_web_set_announce(int on) { g_announce = on; }

void serve_web_announce(const char *host, int port) {
    if (!g_announce) return;
    /* a wildcard address is not one a browser can open: name this machine */
    int any = !strcmp(host, "0.0.0.0");
    printf("web UI: open http://%s:%d/ in a browser%s\n", any ? "127.0.0.1" : host, port,
           any ? " (listening on every address: use this machine's name from elsewhere)" : "");
    fflush(stdout);
}

void serve_web_set_dirs(const char *model_dir, const k3_opt_list *dirs) {
    g_model_dir = model_dir;
    g_dirs = dirs;
}

static json_t *local_dirs(void) {
    json_t *a = json_array();
    if (g_model_dir) json_array_append_new(a, json_string(g_model_dir));
    for (int i = 0; g_dirs && i < g_dirs->n; i++)
        json_array_append_new(a, json_string(g_dirs->items[i]));
    return a;
}

json_t *serve_web_workers(k3_engine *e) {
    json_t *ws = json_array();
    k3_cluster *c = k3_engine_cluster(e);
    if (!c) {
        int n = k3_engine_config(e)->n_layers;
        json_array_append_new(ws, json_pack("{s:i,s:s,s:[i,i],s:o,s:i,s:b,s:n,s:n,s:n}", "index", 0,
                                            "endpoint", "in-process", "layers", 0, n - 1, "dirs",
                                            local_dirs(), "numa", -1, "alive", 1, "busy_s",
                                            "hit_rate", "gb_read"));
        return ws;
    }
    for (int i = 0; i < k3_cluster_stages(c); i++) {
        k3_stage_info s;
        k3_cluster_stage_info(c, i, &s);
        uint64_t lookups = s.hits + s.misses;
        json_t *w = json_pack("{s:i,s:s,s:[i,i],s:o,s:i,s:b,s:f,s:f}", "index", i, "endpoint",
                              s.endpoint, "layers", s.layer_a, s.layer_b - 1, "dirs",
                              s.pid ? local_dirs() : json_array(), "numa", -1, "alive", s.ready,
                              "busy_s", s.busy_ms / 1e3, "gb_read", (double)s.bytes_read / 1e9);
        json_object_set_new(w, "hit_rate",
                            lookups ? json_real((double)s.hits / (double)lookups) : json_null());
        json_array_append_new(ws, w);
    }
    return ws;
}
