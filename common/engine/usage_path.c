/* common/engine/usage_path.c: where the expert usage history lives when no
 * --usage / K3_USAGE names it (engine_opts.h, docs/RELIABILITY.md "Usage
 * history").
 *
 * Owns nothing. Called once per program at start-up, before the model
 * opens, by the thread that parses the options. The default is <cache
 * directory>/<model fingerprint>/usage, the cache directory being
 * k3_cache_dir's (common/base/cache_dir.h: $K3_CACHE_DIR, else
 * $XDG_CACHE_HOME/k3shard, else ~/.cache/k3shard), never the model
 * directory: a read-only snapshot or a directory shared between users must
 * not be written to. The fingerprint is HELLO's (k3_model_fingerprint_dir),
 * so every process of a cluster on one host finds the same file, and
 * another model (or another routing top-p) another one.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/cache_dir.h"
#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/engine/model.h"

k3_status k3_usage_default_path(const char *model_dir, int max_layers, double topp, char *out,
                                size_t cap, char *err, size_t errlen) {
    k3_config cfg;
    uint64_t fp = 0;
    k3_status st = k3_config_load(&cfg, model_dir, max_layers, err, errlen);
    if (!st) st = k3_model_fingerprint_dir(model_dir, &cfg, topp, &fp, err, errlen);
    if (st) return st;
    char base[4096], cerr[480]; /* created only for a model that opens */
    st = k3_cache_dir(base, sizeof base, cerr, sizeof cerr);
    if (st) return k3_errf(st, err, errlen, "%s (give --usage PATH or --usage off)", cerr);
    char dir[4200];
    if (snprintf(dir, sizeof dir, "%s/%016" PRIx64, base, fp) >= (int)sizeof dir ||
        (size_t)snprintf(out, cap, "%s/usage", dir) >= cap)
        return k3_errf(K3_ERR_ARG, err, errlen, "cache directory path too long: %s", base);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return k3_errf(K3_ERR_IO, err, errlen,
                       "cannot create %s: %s (give --usage PATH or --usage off)", dir,
                       strerror(errno));
    return K3_OK;
}
