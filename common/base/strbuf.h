/* common/base/strbuf.h: a growable, always NUL-terminated byte string.
 *
 * Owns its buffer (p, freed by the caller with free(p)); grows by doubling
 * through k3_xrealloc, so it is for internal text whose size the caller has
 * already bounded (rendered chat, parsed tags), never for sizes taken from a
 * file or a peer before they are checked. Not thread-safe: one owner.
 */
#ifndef K3_STRBUF_H
#define K3_STRBUF_H

#include <stddef.h>

typedef struct k3_strbuf {
    char *p;    /* NUL-terminated bytes, NULL until the first append; owned */
    size_t n;   /* bytes used, excluding the NUL */
    size_t cap; /* bytes allocated */
} k3_strbuf;

/* Appends n bytes of s (which may contain NULs). */
void k3_strbuf_add(k3_strbuf *b, const char *s, size_t n);
/* Appends a C string. */
void k3_strbuf_str(k3_strbuf *b, const char *s);

#endif
