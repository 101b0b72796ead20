/* common/base/log.c: see log.h. */
#define _POSIX_C_SOURCE 200809L
#include "common/base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char g_prog[32] = "k3";
static k3_log_level g_level = K3_LOG_INFO;

void k3_log_init(const char *prog) {
    snprintf(g_prog, sizeof g_prog, "%s", prog ? prog : "k3");
    const char *e = getenv("K3_LOG");
    if (!e) return;
    if (!strcmp(e, "debug"))
        g_level = K3_LOG_DEBUG;
    else if (!strcmp(e, "info"))
        g_level = K3_LOG_INFO;
    else if (!strcmp(e, "warn"))
        g_level = K3_LOG_WARN;
    else if (!strcmp(e, "error"))
        g_level = K3_LOG_ERROR;
}

int k3_log_enabled(k3_log_level lvl) { return lvl >= g_level; }

void k3_log(k3_log_level lvl, const char *fmt, ...) {
    if (lvl < g_level) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[%s] %s: %s\n", g_prog, names[lvl], msg);
}

double k3_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double k3_now_ms(void) { return k3_now_s() * 1e3; }
