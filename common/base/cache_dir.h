/* common/base/cache_dir.h: k3shard's cache directory, the one place that
 * decides where the files a program keeps between runs go: the expert usage
 * history (common/engine/usage_path.c) and plan's compute measurement
 * (coordinator/plan_model.c).
 *
 * Owns nothing; reads the environment, so call it from the thread that
 * parses the options, before any thread that may setenv starts.
 */
#ifndef K3_CACHE_DIR_H
#define K3_CACHE_DIR_H

#include <stddef.h>

#include "common/base/err.h"

/* Writes k3shard's cache directory into out [cap] and creates it (mkdir -p,
 * mode 0700 for what it creates). One precedence, an empty variable counting
 * as not set:
 *   $K3_CACHE_DIR          the directory itself; a relative path is an
 *                          error naming K3_CACHE_DIR and its value
 *   $XDG_CACHE_HOME/k3shard  when XDG_CACHE_HOME is absolute (a relative
 *                          one is ignored, as the XDG base directory
 *                          specification says)
 *   $HOME/.cache/k3shard   when HOME is absolute
 * K3_ERR_ARG naming the three variables and their values when none is
 * usable, or when the path does not fit in cap; K3_ERR_IO naming the
 * directory when it cannot be created. */
k3_status k3_cache_dir(char *out, size_t cap, char *err, size_t errlen);

#endif
