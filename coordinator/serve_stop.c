/* coordinator/serve_stop.c: see serve_stop.h.
 *
 * Each push appends to the held tail and searches the tail for every stop
 * string; the tail is at most the longest stop string minus one byte plus
 * the new piece, so a push costs O(piece + 256) per stop string and the
 * whole text is never rescanned.
 */
#include "coordinator/serve_stop.h"

#include <stdlib.h>
#include <string.h>

#include "common/base/err.h"

void serve_stop_init(serve_stop *s, const char *const *stops, int n) {
    memset(s, 0, sizeof *s);
    K3_ASSERT(n >= 0 && n <= K3_SERVE_MAX_STOPS);
    for (int i = 0; i < n; i++) {
        if (!stops[i] || !*stops[i]) continue;
        s->stops[s->n] = k3_xstrdup(stops[i]);
        s->lens[s->n] = strlen(stops[i]);
        s->n++;
    }
}

void serve_stop_free(serve_stop *s) {
    for (int i = 0; i < s->n; i++) free(s->stops[i]);
    free(s->hold.p);
    free(s->out.p);
    memset(s, 0, sizeof *s);
}

int serve_stop_push(serve_stop *s, const char *text, size_t len, int flush, const char **out,
                    size_t *out_len) {
    s->out.n = 0;
    k3_strbuf_add(&s->out, "", 0); /* out.p is never NULL */
    *out = s->out.p;
    *out_len = 0;
    if (s->matched) return 0;
    if (s->n == 0) {
        k3_strbuf_add(&s->out, text, len);
        *out = s->out.p;
        *out_len = s->out.n;
        return 0;
    }
    k3_strbuf_add(&s->hold, text, len);
    const char *h = s->hold.p;
    /* the match that completes first (as if the text came byte by byte,
     * so the answer does not depend on how it was cut into pieces); of two
     * completing at the same byte, the longer one */
    size_t n = s->hold.n, cut = n, best_end = (size_t)-1;
    for (int i = 0; i < s->n; i++) {
        const char *m = memmem(h, n, s->stops[i], s->lens[i]);
        if (!m) continue;
        size_t at = (size_t)(m - h), e = at + s->lens[i];
        if (e < best_end || (e == best_end && at < cut)) {
            best_end = e;
            cut = at;
        }
    }
    size_t keep = 0;
    if (cut < n) {
        s->matched = 1;
    } else if (!flush) {
        /* the longest tail that is a proper prefix of some stop string */
        for (int i = 0; i < s->n; i++) {
            size_t k = s->lens[i] - 1 < n ? s->lens[i] - 1 : n;
            for (; k > keep; k--)
                if (!memcmp(h + n - k, s->stops[i], k)) break;
            if (k > keep) keep = k;
        }
        cut = n - keep;
    }
    k3_strbuf_add(&s->out, h, cut);
    memmove(s->hold.p, h + n - keep, keep);
    s->hold.n = keep;
    s->hold.p[keep] = 0;
    *out = s->out.p;
    *out_len = s->out.n;
    return s->matched;
}
