/* common/engine/usage_path.c: where the expert usage history lives when no
 * --usage / K3_USAGE names it (engine_opts.h, docs/RELIABILITY.md "Usage
 * history").
 *
 * Owns nothing. Called once per program at start-up, before the model
 * opens, by the thread that parses the options. The default is
 * $XDG_CACHE_HOME/k3shard/<model fingerprint>/usage (else
 * ~/.cache/k3shard/...), never the model directory: a read-only snapshot
 * or a directory shared between users must not be written to. The
 * fingerprint is HELLO's (k3_model_fingerprint_dir), so every process of a
 * cluster on one host finds the same file, and another model (or another
 * routing top-p) another one.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/engine/model.h"

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

k3_status k3_usage_default_path(const char *model_dir, int max_layers, double topp, char *out,
                                size_t cap, char *err, size_t errlen) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char base[4096];
    if (xdg && xdg[0] == '/')
        snprintf(base, sizeof base, "%s/k3shard", xdg);
    else if (home && home[0] == '/')
        snprintf(base, sizeof base, "%s/.cache/k3shard", home);
    else
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "no cache directory: neither XDG_CACHE_HOME nor HOME is an absolute path "
                       "(give --usage PATH or --usage off)");
    k3_config cfg;
    uint64_t fp = 0;
    k3_status st = k3_config_load(&cfg, model_dir, max_layers, err, errlen);
    if (!st) st = k3_model_fingerprint_dir(model_dir, &cfg, topp, &fp, err, errlen);
    if (st) return st;
    char dir[4200];
    if (snprintf(dir, sizeof dir, "%s/%016" PRIx64, base, fp) >= (int)sizeof dir ||
        (size_t)snprintf(out, cap, "%s/usage", dir) >= cap)
        return k3_errf(K3_ERR_ARG, err, errlen, "cache directory path too long: %s", base);
    if (mkdirs(dir) != 0)
        return k3_errf(K3_ERR_IO, err, errlen,
                       "cannot create %s: %s (give --usage PATH or --usage off)", dir,
                       strerror(errno));
    return K3_OK;
}
