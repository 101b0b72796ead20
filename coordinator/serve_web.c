/* coordinator/serve_web.c: the embedded web UI's HTTP answers
 * (serve_web.h, docs/WEB.md).
 */
#include "coordinator/serve_web.h"

#include <microhttpd.h>
#include <stdio.h>
#include <string.h>

/* The page loads only its own files and talks only to this server: no
 * inline script or style, no other origin, no framing, no form posts. */
#define WEB_CSP                                                                                    \
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "              \
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

/* set on the main thread before the daemon starts, read-only after */
static int g_announce;

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
