/* common/base/err.h: the one error convention of k3shard.
 *
 * Every fallible function returns a k3_status and, on failure, writes a
 * human-readable message into a caller-provided buffer (char *err, size_t
 * errlen). Messages name the thing, the actual value and the expected value
 * or limit ("shard model-00003-of-00010.safetensors: header length 9e18 >
 * limit 100000000"). Nothing below main() calls exit().
 *
 * K3_ASSERT guards invariants whose violation would corrupt memory; it stays
 * on under NDEBUG. Data from disk or network is never asserted: it is checked
 * and returned as an error. k3_xmalloc/k3_xcalloc are for internal,
 * fixed-size allocations only (never sized by a file or a peer): they abort
 * on OOM through one place.
 *
 * Thread safety: all functions here are reentrant.
 */
#ifndef K3_ERR_H
#define K3_ERR_H

#include <stddef.h>

typedef enum k3_status {
    K3_OK = 0,
    K3_ERR_ARG,      /* bad argument or option value */
    K3_ERR_IO,       /* open/read/write failed, short read, EIO */
    K3_ERR_FORMAT,   /* malformed file or message */
    K3_ERR_LIMIT,    /* a size or count beyond a limit in common/base/limits.h */
    K3_ERR_NOMEM,    /* allocation sized by input failed */
    K3_ERR_MISSING,  /* a required tensor, key or file is absent */
    K3_ERR_MISMATCH, /* shapes, versions or fingerprints disagree */
    K3_ERR_PROTO,    /* protocol violation by a peer */
    K3_ERR_STATE,    /* operation not valid in the current state */
    K3_ERR_TIMEOUT,  /* deadline passed */
    K3_ERR_AUTH,     /* authentication / authorisation refused */
    K3_ERR_CANCEL,   /* cancelled by request */
    K3_ERR_BUSY,     /* capacity exhausted */
    K3_ERR_INTERNAL  /* a bug: should not happen */
} k3_status;

/* Short stable name of a status ("io", "format", ...), never NULL. */
const char *k3_status_name(k3_status st);

/* Formats into err (if err && errlen) and returns st, so callers can write
 *   return k3_errf(K3_ERR_FORMAT, err, errlen, "x: %d > %d", v, lim); */
k3_status k3_errf(k3_status st, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Prepends "prefix: " to an existing message in err (for context chaining). */
void k3_err_prefix(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Always-on invariant check; prints file:line and the expression, aborts. */
#define K3_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (__builtin_expect(!(cond), 0)) k3_assert_fail(#cond, __FILE__, __LINE__);               \
    } while (0)

void k3_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

/* Internal fixed-size allocations: abort with a message on OOM. */
void *k3_xmalloc(size_t n);
void *k3_xcalloc(size_t n, size_t size);
void *k3_xrealloc(void *p, size_t n);
char *k3_xstrdup(const char *s);
/* 64-byte aligned; free with free(). Aborts on OOM. */
void *k3_xaligned(size_t align, size_t n);

#endif
