/* coordinator/cluster_local.c: starting and stopping k3-worker processes on
 * this machine (cluster.h, "local worker processes"). Used by --local N and
 * by the tests, which kill and restart workers.
 *
 * cl_local_start / cl_local_stop are --local N of the cluster: N workers
 * over ipc:// in a private directory with the coordinator's settings.
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

#include "common/base/log.h"
#include "coordinator/cluster_impl.h"

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

/* ---- --local N ---------------------------------------------------------- */

/* --local N: N workers over ipc:// in a private directory, layers split
 * evenly, numerics and model settings copied from the coordinator's. */
k3_status cl_local_start(k3_cluster *c, char *err, size_t errlen) {
    const k3_model_opts *mo = c->o.model;
    cl_fmt(c->tmpdir, sizeof c->tmpdir, "/tmp/k3c.XXXXXX");
    if (!mkdtemp(c->tmpdir)) {
        c->tmpdir[0] = 0;
        return k3_errf(K3_ERR_IO, err, errlen, "local workers: mkdtemp: %s", strerror(errno));
    }
    char bin[4096];
    if (c->o.worker_bin)
        cl_fmt(bin, sizeof bin, "%s", c->o.worker_bin);
    else
        k3_worker_bin(bin, sizeof bin);
    int L = c->cfg.n_layers, N = c->n;
    /* Every worker gets all the threads: a single stream visits the stages
     * one after the other, so a stage computing alone should use every core;
     * when stages overlap (pipelined prefill, several sessions) the pool's
     * short spin then futex sleep lets the kernel share the cores. */
    int threads = c->o.worker_threads > 0 ? c->o.worker_threads : mo->threads;
    if (threads < 1) threads = 1;
    char dirs[4096] = "";
    for (int i = 0; i < mo->n_dirs; i++) { /* "--dirs a,b": joined again */
        size_t off = strlen(dirs);
        cl_fmt(dirs + off, sizeof dirs - off, "%s%s", i ? "," : "", mo->dirs[i]);
    }
    for (int i = 0; i < N; i++) {
        cl_stage *s = &c->st[i];
        int a = (int)((long)i * L / N), b = (int)((long)(i + 1) * L / N);
        cl_fmt(s->endpoint, sizeof s->endpoint, "ipc://%s/w%d", c->tmpdir, i);
        char v[16][64];
        cl_fmt(v[0], 64, "%d-%d", a, b);
        cl_fmt(v[1], 64, "local%d", i);
        cl_fmt(v[2], 64, "%d", c->o.hb_ms);
        cl_fmt(v[3], 64, "%d", mo->bits);
        cl_fmt(v[4], 64, "%d", mo->mla_bits);
        cl_fmt(v[5], 64, "%d", mo->head_bits);
        cl_fmt(v[6], 64, "--idot=%d", mo->idot ? 1 : 0);
        cl_fmt(v[7], 64, "%d", threads);
        cl_fmt(v[8], 64, "%.17g", mo->expert_gb / N); /* the budget is split, not copied */
        cl_fmt(v[9], 64, "--direct=%d", mo->direct ? 1 : 0);
        cl_fmt(v[10], 64, "%d", c->o.max_sessions);
        cl_fmt(v[11], 64, "%d", c->o.max_ctx);
        cl_fmt(v[12], 64, "--dense-idot=%d", mo->dense_idot ? 1 : 0);
        const char *argv[64 + 32];
        int n = 0;
        const char *fixed[] = {
            bin,         "--model",     mo->model_dir, "--layers", v[0],  "--listen",
            s->endpoint, "--name",      v[1],          "--hb-ms",  v[2],  "--mla-bits",
            v[4],        "--head-bits", v[5],          v[6],       v[12], "--threads",
            v[7],        "--expert-gb", v[8],          v[9]};
        for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) argv[n++] = fixed[k];
        /* --bits only when the coordinator's was explicit: a given K3_BITS
         * downcasts a repacked int8 container, the default does not */
        if (mo->bits_explicit) argv[n++] = "--bits", argv[n++] = v[3];
        if (c->o.exact) argv[n++] = "--exact";
        if (c->o.max_sessions > 0) argv[n++] = "--max-sessions", argv[n++] = v[10];
        if (c->o.max_ctx > 0) argv[n++] = "--max-ctx", argv[n++] = v[11];
        if (mo->n_dirs > 0) argv[n++] = "--dirs", argv[n++] = dirs;
        for (int k = 0; k < c->o.n_worker_args && n < 64 + 30; k++) argv[n++] = c->o.worker_args[k];
        argv[n] = NULL;
        /* settings the worker reads from the environment only */
        char e[4][64];
        cl_fmt(e[0], 64, "K3_LAYERS=%d", mo->max_layers);
        cl_fmt(e[1], 64, "K3_TOPP=%.17g", mo->topp);
        cl_fmt(e[2], 64, "K3_PIPE=%d", mo->pipe ? 1 : 0);
        cl_fmt(e[3], 64, "K3_LOAD_THREADS=%d", mo->load_threads);
        char *env[5] = {e[0], e[1], e[2], e[3], NULL};
        k3_status st = k3_worker_spawn(&s->pid, bin, (char *const *)argv, env, err, errlen);
        if (st) return st;
        K3_INFO("cluster: started local worker %d (pid %d) for layers [%d, %d) on %s", i,
                (int)s->pid, a, b, s->endpoint);
    }
    return K3_OK;
}

/* Local workers are stopped after the I/O thread sent them SHUTDOWN:
 * SIGTERM, then SIGKILL after 2 s; then the ipc directory goes. */
void cl_local_stop(k3_cluster *c) {
    for (int i = 0; i < c->n; i++) {
        cl_stage *s = &c->st[i];
        if (!s->pid) continue;
        int status = k3_worker_stop(s->pid, 2000);
        if (status != 0)
            K3_WARN("cluster: local worker %d (pid %d) ended with status 0x%x", i, (int)s->pid,
                    status);
        s->pid = 0;
        if (!strncmp(s->endpoint, "ipc://", 6)) unlink(s->endpoint + 6);
    }
    if (c->tmpdir[0]) rmdir(c->tmpdir);
}
