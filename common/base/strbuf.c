/* common/base/strbuf.c: see strbuf.h. */
#include "common/base/strbuf.h"

#include <string.h>

#include "common/base/err.h"

void k3_strbuf_add(k3_strbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        b->p = k3_xrealloc(b->p, c);
        b->cap = c;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void k3_strbuf_str(k3_strbuf *b, const char *s) { k3_strbuf_add(b, s, strlen(s)); }
