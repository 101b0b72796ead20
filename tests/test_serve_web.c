/* tests/test_serve_web.c: the embedded web UI's table (coordinator/
 * serve_web.h, coordinator/web/embed.sh): every file of coordinator/web/ is
 * in the binary byte for byte with its content type and an ETag, "/" is the
 * page, and no other path (parent directories, query strings, prefixes of a
 * name) finds a file. The HTTP answers themselves are checked by
 * tests/integration/test_web_ui.sh. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/err.h"
#include "coordinator/serve_web.h"
#include "tests/test.h"

/* The file's bytes, or NULL; *n its size. */
static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char *buf = NULL;
    size_t cap = 0, len = 0, r;
    do {
        if (len == cap) buf = k3_xrealloc(buf, cap = cap ? 2 * cap : 65536);
        r = fread(buf + len, 1, cap - len, f);
        len += r;
    } while (r > 0);
    fclose(f);
    *n = len;
    return buf;
}

int main(void) {
    static const struct {
        const char *path, *type;
    } want[] = {{"/index.html", "text/html; charset=utf-8"},
                {"/app.js", "text/javascript; charset=utf-8"},
                {"/md.js", "text/javascript; charset=utf-8"},
                {"/app.css", "text/css; charset=utf-8"},
                {"/favicon.svg", "image/svg+xml"}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const k3_web_asset *a = serve_web_find(want[i].path);
        CHECK(a && !strcmp(a->type, want[i].type), "%s is embedded as %s", want[i].path,
              want[i].type);
        if (!a) continue;
        char file[256];
        snprintf(file, sizeof file, "coordinator/web%s", want[i].path);
        size_t n = 0;
        unsigned char *src = slurp(file, &n);
        CHECK(src && n == a->len && !memcmp(src, a->data, n) && a->data[n] == 0,
              "%s: the %zu embedded bytes are the file's, NUL after them", want[i].path, a->len);
        free(src);
        char size[32];
        snprintf(size, sizeof size, "-%zu\"", a->len);
        size_t el = strlen(a->etag);
        CHECK(el > 4 && a->etag[0] == '"' && el > strlen(size) &&
                  !strcmp(a->etag + el - strlen(size), size),
              "%s: ETag %s is quoted and ends in the size", want[i].path, a->etag);
    }
    CHECK(serve_web_find("/") == serve_web_find("/index.html"), "/ is index.html");
    int distinct = 1;
    for (int i = 0; i < k3_web_n_assets; i++)
        for (int j = i + 1; j < k3_web_n_assets; j++)
            if (!strcmp(k3_web_assets[i].etag, k3_web_assets[j].etag)) distinct = 0;
    CHECK(distinct, "the %d files have distinct ETags", k3_web_n_assets);
    static const char *none[] = {
        "",         "/index",  "/index.html?x=1", "/../index.html", "/web/app.js", "//app.js",
        "/app.js/", "/APP.JS", "/health",         "/v1/models",     "index.html",  "/.."};
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++)
        CHECK(!serve_web_find(none[i]), "'%s' finds no file", none[i]);
    TEST_MAIN_END();
}
