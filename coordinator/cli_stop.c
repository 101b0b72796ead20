/* coordinator/cli_stop.c: SIGINT / SIGTERM for the command line
 * (cli_stop.h). Main thread installs; the handler runs on whichever
 * thread the kernel picks and uses async-signal-safe calls only. */
#include "coordinator/cli_stop.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static atomic_int g_cancel;
static volatile sig_atomic_t g_signal;

static void on_stop(int sig) {
    if (g_signal) {
        static const char now[] = "\nk3-coordinator: second signal: exiting now\n";
        ssize_t w = write(2, now, sizeof now - 1);
        (void)w;
        _exit(128 + sig);
    }
    g_signal = sig;
    atomic_store(&g_cancel, 1);
    static const char msg[] = "\nk3-coordinator: stopping after the current step (signal again "
                              "to exit now)\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
}

const atomic_int *k3_cli_stop_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    return &g_cancel;
}

int k3_cli_stop_signal(void) { return (int)g_signal; }

void k3_cli_stop_request(void) { atomic_store(&g_cancel, 1); }
