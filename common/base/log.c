/* common/base/log.c: see log.h. */
#define _POSIX_C_SOURCE 200809L
#include "common/base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static char g_prog[32] = "k3";
/* The level before k3_log_init / k3_log_set_level; the setting's default
 * is the row's (log.h), which k3_log_init applies. */
static k3_log_level g_level = K3_LOG_INFO;

typedef struct log_opts {
    int level;
} log_opts;

static const k3_opt log_table[] = {K3_LOG_OPT_LEVEL(log_opts, level)};

void k3_log_init(const char *prog) {
    snprintf(g_prog, sizeof g_prog, "%s", prog ? prog : "k3");
    /* the row alone, environment only (argv is the program's to parse) */
    log_opts o;
    char *argv0 = NULL, err[160];
    int n_pos = 0;
    if (k3_opts_parse(log_table, 1, &o, NULL, 0, &argv0, NULL, &n_pos, err, sizeof err) == K3_OK)
        g_level = (k3_log_level)o.level;
}

void k3_log_set_level(k3_log_level lvl) { g_level = lvl; }

int k3_log_enabled(k3_log_level lvl) { return lvl >= g_level; }

void k3_log(k3_log_level lvl, const char *fmt, ...) {
    if (lvl < g_level) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    static int stamp = -1; /* K3_LOG_TIME=0: no time (read once; a race only repeats it) */
    if (stamp < 0) {
        const char *t = getenv("K3_LOG_TIME");
        stamp = !(t && !strcmp(t, "0"));
    }
    char when[64] = "";
    if (stamp) {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        localtime_r(&ts.tv_sec, &tm);
        snprintf(when, sizeof when, "%02d:%02d:%02d.%03ld ", tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000L);
    }
    fprintf(stderr, "%s[%s] %s: %s\n", when, g_prog, names[lvl], msg);
}

double k3_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double k3_now_ms(void) { return k3_now_s() * 1e3; }
