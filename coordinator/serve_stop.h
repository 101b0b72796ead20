/* coordinator/serve_stop.h: stop strings over streamed text, for the HTTP
 * API (docs/SERVING.md 4, "Stop strings").
 *
 * Owns: a copy of the stop strings, the tail of the text held back because
 * it could still become one, and the text released by the last push.
 * Borrows: nothing after init.
 * Threads: one matcher per generation, used by one thread at a time.
 *
 * Text goes in piece by piece as it is decoded; what comes out is the text
 * before the stop string that is complete first (at the earliest end byte;
 * of two ending at the same byte, the longer), never the stop string
 * itself, released as soon as no stop string can start in it. The result
 * does not depend on how the text is cut into pieces. A held tail always
 * begins with a stop string's first byte, so a cut falls on a UTF-8
 * boundary whenever the text and the stop strings are valid UTF-8. With no
 * stop strings every piece passes through at once.
 */
#ifndef K3_SERVE_STOP_H
#define K3_SERVE_STOP_H

#include <stddef.h>

#include "common/base/limits.h"
#include "common/base/strbuf.h"

typedef struct serve_stop {
    char *stops[K3_SERVE_MAX_STOPS]; /* [n] non-empty, owned */
    size_t lens[K3_SERVE_MAX_STOPS]; /* bytes of each */
    int n;
    k3_strbuf hold; /* text that may still start a stop string */
    k3_strbuf out;  /* the text released by the last push */
    int matched;    /* a stop string was found: everything after is dropped */
} serve_stop;

/* Copies stops[0, n) (n <= K3_SERVE_MAX_STOPS; empty strings are skipped:
 * they would match everywhere). */
void serve_stop_init(serve_stop *s, const char *const *stops, int n);
void serve_stop_free(serve_stop *s);

/* Feeds text[0, len); flush = 1 at the end of the text releases the held
 * tail. *out, *out_len: the text released now (valid until the next call).
 * Returns 1 when this push found a stop string (the released text is what
 * came before it), else 0; after a match every push releases nothing. */
int serve_stop_push(serve_stop *s, const char *text, size_t len, int flush, const char **out,
                    size_t *out_len);

#endif
