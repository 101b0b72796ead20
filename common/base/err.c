/* common/base/err.c: status names, message formatting, abort-on-OOM wrappers. */
#include "common/base/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *k3_status_name(k3_status st) {
    switch (st) {
    case K3_OK: return "ok";
    case K3_ERR_ARG: return "arg";
    case K3_ERR_IO: return "io";
    case K3_ERR_FORMAT: return "format";
    case K3_ERR_LIMIT: return "limit";
    case K3_ERR_NOMEM: return "nomem";
    case K3_ERR_MISSING: return "missing";
    case K3_ERR_MISMATCH: return "mismatch";
    case K3_ERR_PROTO: return "proto";
    case K3_ERR_STATE: return "state";
    case K3_ERR_TIMEOUT: return "timeout";
    case K3_ERR_AUTH: return "auth";
    case K3_ERR_CANCEL: return "cancel";
    case K3_ERR_BUSY: return "busy";
    case K3_ERR_INTERNAL: return "internal";
    }
    return "unknown";
}

k3_status k3_errf(k3_status st, char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

void k3_err_prefix(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    char pre[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    size_t pl = strlen(pre), el = strnlen(err, errlen - 1);
    if (pl + 2 >= errlen) return;
    size_t keep = el;
    if (pl + 2 + keep >= errlen) keep = errlen - pl - 3;
    memmove(err + pl + 2, err, keep);
    memcpy(err, pre, pl);
    err[pl] = ':';
    err[pl + 1] = ' ';
    err[pl + 2 + keep] = 0;
}

void k3_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "K3_ASSERT failed: %s at %s:%d\n", expr, file, line);
    abort();
}

static void oom(size_t n) {
    fprintf(stderr, "k3: out of memory allocating %zu bytes\n", n);
    abort();
}

void *k3_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}

void *k3_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) oom(n * size);
    return p;
}

void *k3_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) oom(n);
    return q;
}

char *k3_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = k3_xmalloc(n);
    memcpy(p, s, n);
    return p;
}

void *k3_xaligned(size_t align, size_t n) {
    void *p = NULL;
    if (align < sizeof(void *)) align = sizeof(void *);
    size_t sz = (n + align - 1) / align * align;
    if (posix_memalign(&p, align, sz ? sz : align)) oom(n);
    return p;
}
