/* common/base/log.h: leveled logging to stderr, one line per event, prefixed with
 * the program name set by k3_log_init(). K3_LOG=debug|info|warn|error sets
 * the level (default info). Thread-safe: each call is one fprintf. Secret key
 * material must never be passed here. */
#ifndef K3_LOG_H
#define K3_LOG_H

typedef enum { K3_LOG_DEBUG = 0, K3_LOG_INFO, K3_LOG_WARN, K3_LOG_ERROR } k3_log_level;

void k3_log_init(const char *prog);
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
