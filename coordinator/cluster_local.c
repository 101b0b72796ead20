/* coordinator/cluster_local.c: starting and stopping k3-worker processes on
 * this machine (cluster.h, "local worker processes"). Used by --local N and
 * by the tests, which kill and restart workers.
 *
 * The child is started with fork + execve; between the two only
 * async-signal-safe calls run (the parent may have threads). Everything the
 * child needs (argv, the environment) is built before fork. The child asks
 * the kernel for SIGTERM when its parent dies, so an aborted coordinator
 * leaves no orphan workers behind.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "coordinator/cluster.h"

extern char **environ;

void k3_worker_bin(char *out, size_t cap) {
    const char *env = getenv("K3_WORKER_BIN");
    if (env && *env) {
        snprintf(out, cap, "%s", env);
        return;
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        char *slash = strrchr(self, '/');
        if (slash) {
            *slash = 0;
            /* next to this program (build/), or one up (build/tests/) */
            const char *rel[2] = {"/k3-worker", "/../k3-worker"};
            for (int i = 0; i < 2; i++) {
                snprintf(out, cap, "%s%s", self, rel[i]);
                if (access(out, X_OK) == 0) return;
            }
        }
    }
    snprintf(out, cap, "k3-worker");
}

/* Is "K=V" setting the variable named by the "K=..." of `add`? */
static int same_var(const char *a, const char *b) {
    const char *ea = strchr(a, '='), *eb = strchr(b, '=');
    if (!ea || !eb) return 0;
    return ea - a == eb - b && !memcmp(a, b, (size_t)(ea - a));
}

k3_status k3_worker_spawn(pid_t *pid, const char *bin, char *const argv[], char *const env_add[],
                          char *err, size_t errlen) {
    *pid = 0;
    /* the environment: ours, with env_add replacing same-named variables */
    size_t n_env = 0, n_add = 0;
    while (environ && environ[n_env]) n_env++;
    while (env_add && env_add[n_add]) n_add++;
    char **envp = k3_xcalloc(n_env + n_add + 1, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++) {
        int replaced = 0;
        for (size_t j = 0; j < n_add && !replaced; j++) replaced = same_var(environ[i], env_add[j]);
        if (!replaced) envp[k++] = environ[i];
    }
    for (size_t j = 0; j < n_add; j++) envp[k++] = env_add[j];
    envp[k] = NULL;

    pid_t parent = getpid();
    pid_t p = fork();
    if (p < 0) {
        free(envp);
        return k3_errf(K3_ERR_IO, err, errlen, "fork for %s: %s", bin, strerror(errno));
    }
    if (p == 0) {
        /* child: async-signal-safe calls only */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1); /* the parent died before prctl */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        execve(bin, argv, envp);
        static const char msg[] = "k3-coordinator: cannot execute the worker program\n";
        ssize_t w = write(2, msg, sizeof msg - 1);
        (void)w;
        _exit(127);
    }
    free(envp);
    *pid = p;
    return K3_OK;
}

int k3_worker_exited(pid_t pid, int *status) {
    int s = 0;
    pid_t r = waitpid(pid, &s, WNOHANG);
    if (r == pid) {
        if (status) *status = s;
        return 1;
    }
    return 0;
}

int k3_worker_stop(pid_t pid, int grace_ms) {
    if (pid <= 0) return -1;
    int status = 0;
    if (k3_worker_exited(pid, &status)) return status;
    if (kill(pid, SIGTERM) != 0 && errno == ESRCH) return -1;
    struct timespec ts = {0, 10 * 1000000L};
    for (int waited = 0; waited < grace_ms; waited += 10) {
        if (k3_worker_exited(pid, &status)) return status;
        nanosleep(&ts, NULL);
    }
    K3_WARN("worker pid %d did not stop within %d ms of SIGTERM: SIGKILL", (int)pid, grace_ms);
    kill(pid, SIGKILL);
    if (waitpid(pid, &status, 0) != pid) return -1;
    return status;
}
