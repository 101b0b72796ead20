/* common/base/cache_dir.c: see cache_dir.h. */
#include "common/base/cache_dir.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* mkdir -p with mode 0700 for what it creates; 0 or -1 (errno set). */
static int mkdirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        int r = mkdir(path, 0700);
        *p = '/';
        if (r != 0 && errno != EEXIST) return -1;
    }
    return mkdir(path, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* The variable, NULL when unset or empty. */
static const char *var(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? v : NULL;
}

/* "NAME is not set" or "NAME is 'VALUE', not an absolute path" into buf. */
static const char *describe(char *buf, size_t cap, const char *name, const char *v) {
    if (!v)
        snprintf(buf, cap, "%s is not set", name);
    else
        snprintf(buf, cap, "%s is '%.200s', not an absolute path", name, v);
    return buf;
}

k3_status k3_cache_dir(char *out, size_t cap, char *err, size_t errlen) {
    const char *k3 = var("K3_CACHE_DIR"), *xdg = var("XDG_CACHE_HOME"), *home = var("HOME");
    char a[256], b[256], c[256];
    int n;
    if (k3 && k3[0] != '/')
        return k3_errf(K3_ERR_ARG, err, errlen, "no cache directory: %s",
                       describe(a, sizeof a, "K3_CACHE_DIR", k3));
    if (k3)
        n = snprintf(out, cap, "%s", k3);
    else if (xdg && xdg[0] == '/')
        n = snprintf(out, cap, "%s/k3shard", xdg);
    else if (home && home[0] == '/')
        n = snprintf(out, cap, "%s/.cache/k3shard", home);
    else
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "no cache directory: %s, %s, %s (set K3_CACHE_DIR to an absolute path)",
                       describe(a, sizeof a, "K3_CACHE_DIR", k3),
                       describe(b, sizeof b, "XDG_CACHE_HOME", xdg),
                       describe(c, sizeof c, "HOME", home));
    if (n < 0 || (size_t)n >= cap)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cache directory path too long (%d bytes, at most %zu): %.200s...", n,
                       cap ? cap - 1 : 0, cap ? out : "");
    while (n > 1 && out[n - 1] == '/') out[--n] = 0; /* K3_CACHE_DIR=/x/ is /x */
    struct stat sb;
    if (mkdirs(out) != 0 || stat(out, &sb) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "cannot create the cache directory %s: %s", out,
                       strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return k3_errf(K3_ERR_IO, err, errlen, "the cache directory %s is not a directory", out);
    return K3_OK;
}
