/* common/base/log.h: leveled logging to stderr, one line per event, prefixed with
 * the program name set by k3_log_init(). The level (default info) is the
 * K3_LOG_OPT_LEVEL row: --log-level / K3_LOG = debug|info|warn|error, and
 * --quiet (K3_LOG_OPT_QUIET) for warn. A
 * program puts the row in its option table (common/engine/engine_opts.h
 * does, for both programs) and applies the parsed value with
 * k3_log_set_level; a program without a table (tests, benchmarks) gets the
 * row's environment value from k3_log_init. Thread-safe: each call is one
 * fprintf. Secret key material must never be passed here. */
#ifndef K3_LOG_H
#define K3_LOG_H

#include <stddef.h>

#include "common/base/opts.h"

typedef enum { K3_LOG_DEBUG = 0, K3_LOG_INFO, K3_LOG_WARN, K3_LOG_ERROR } k3_log_level;

/* The one definition of the log level setting (an int field of T). */
// clang-format off
#define K3_LOG_OPT_LEVEL(T, f)                                                                     \
    {.name = "log_level", .flag = "--log-level", .env = "K3_LOG", .type = K3_OPT_ENUM,            \
     .offset = offsetof(T, f), .def = "info", .n_choices = 4,                                     \
     .choices = {K3_LOG_DEBUG, K3_LOG_INFO, K3_LOG_WARN, K3_LOG_ERROR},                           \
     .names = {"debug", "info", "warn", "error"}, .metavar = "LEVEL",                             \
     .help = "messages on stderr from this level up"}
#define K3_LOG_OPT_QUIET(T, f)                                                                     \
    {.name = "quiet", .flag = "--quiet", .short_flag = 'q', .env = "K3_QUIET",                    \
     .type = K3_OPT_BOOL, .offset = offsetof(T, f),                                               \
     .help = "warnings and errors only (--log-level warn)"}
/* Each line starts with the local wall-clock time to the millisecond
 * ("01:22:33.123 [k3-worker] info: ..."); K3_LOG_TIME=0 leaves it out. */
// clang-format on

/* Sets the program name, and the level from K3_LOG through the row above
 * (default info). A bad K3_LOG is ignored here, leaving the default: a
 * program's own table parse reports it as a usage error. */
void k3_log_init(const char *prog);
void k3_log_set_level(k3_log_level lvl);
void k3_log(k3_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int k3_log_enabled(k3_log_level lvl);

#define K3_DEBUG(...) k3_log(K3_LOG_DEBUG, __VA_ARGS__)
#define K3_INFO(...)  k3_log(K3_LOG_INFO, __VA_ARGS__)
#define K3_WARN(...)  k3_log(K3_LOG_WARN, __VA_ARGS__)
#define K3_ERROR(...) k3_log(K3_LOG_ERROR, __VA_ARGS__)

/* Monotonic clock in seconds / milliseconds. */
double k3_now_s(void);
double k3_now_ms(void);

#endif
