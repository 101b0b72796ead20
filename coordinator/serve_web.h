/* coordinator/serve_web.h: the web UI's files inside the binary and their
 * HTTP answers (docs/WEB.md).
 *
 * Owns: nothing at run time. The files of coordinator/web/ are compiled in
 * as byte arrays (coordinator/web/embed.sh writes $(BUILD)/gen/
 * web_assets.c: k3_web_assets, k3_web_n_assets); this module finds one by
 * URL and answers it with its content type, an ETag (304 on a matching
 * If-None-Match), `Cache-Control: no-cache` and a Content-Security-Policy
 * that allows only the page's own scripts, styles and API.
 * Threads: serve_web_answer runs on libmicrohttpd's connection threads
 * (read-only data); serve_web_set_announce and serve_web_announce on the
 * main thread (cmd_web, cmd_serve).
 */
#ifndef K3_SERVE_WEB_H
#define K3_SERVE_WEB_H

#include <stddef.h>

struct MHD_Connection;

typedef struct k3_web_asset {
    const char *path;          /* URL path, "/index.html" */
    const char *type;          /* Content-Type */
    const unsigned char *data; /* len bytes (+ a NUL not counted) */
    size_t len;
    const char *etag; /* "\"CRC-SIZE\"" (POSIX cksum of the file) */
} k3_web_asset;

extern const k3_web_asset k3_web_assets[];
extern const int k3_web_n_assets;

/* The asset for a request path ("/" is /index.html); NULL when none. */
const k3_web_asset *serve_web_find(const char *url);

/* Queues the answer for url (which serve_web_find knows); returns what
 * MHD_queue_response returned (an int: enum MHD_Result). */
int serve_web_answer(struct MHD_Connection *c, const char *url);

/* `k3-coordinator web`: after the "serving on" line, also print the URL of
 * the chat page to open. */
void serve_web_set_announce(int on);
void serve_web_announce(const char *host, int port);

#endif
