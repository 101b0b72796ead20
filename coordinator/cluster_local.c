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
 * leaves no orphan workers behind, and takes a process group of its own:
 * the terminal's Ctrl-C (SIGINT to the foreground group) is the
 * coordinator's to handle (it stops an answer in `chat`, drains `serve`),
 * and must not also stop the workers that hold the conversation's state.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/log.h"
#include "coordinator/cluster_impl.h"
#include "common/experts/placement.h"

extern char **environ;

void k3_worker_bin(char *out, size_t cap) {
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
        setpgid(0, 0);                     /* out of the terminal's foreground group (above) */
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

/* The argument vector of one local worker, sized from the request: every
 * entry is an owned copy, so one loop frees it whatever it holds. */
typedef struct arg_vec {
    char **v; /* [cap]: n entries then NULL, owned */
    int n, cap;
} arg_vec;

static void av_add(arg_vec *a, const char *s) {
    K3_ASSERT(a->n < a->cap - 1); /* counted by local_argc: a miscount is a bug */
    a->v[a->n++] = k3_xstrdup(s);
}

static void av_addf(arg_vec *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void av_addf(arg_vec *a, const char *fmt, ...) {
    char buf[64]; /* numbers and "--flag=N" only */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    av_add(a, buf);
}

static void av_free(arg_vec *a) {
    for (int i = 0; i < a->n; i++) free(a->v[i]);
    free(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
}

/* "--dirs a,b": the shard directories joined again (owned). */
static char *join_dirs(const k3_model_opts *mo) {
    size_t len = 1;
    for (int i = 0; i < mo->n_dirs; i++) len += strlen(mo->dirs[i]) + 1;
    char *s = k3_xmalloc(len), *p = s;
    for (int i = 0; i < mo->n_dirs; i++) {
        if (i) *p++ = ',';
        size_t n = strlen(mo->dirs[i]);
        memcpy(p, mo->dirs[i], n);
        p += n;
    }
    *p = 0;
    return s;
}

/* Number of argv entries (argv[0] and the NULL included) local_argv passes
 * for this cluster's settings. */
static int local_argc(const k3_cluster *c) {
    const k3_model_opts *mo = c->o.model;
    int n = 22 + 1; /* bin, 9 flag-value pairs and 3 "--x=N" always given; NULL */
    n += mo->bits_explicit ? 2 : 0;
    n += c->o.exact ? 1 : 0;
    n += c->o.max_sessions > 0 ? 2 : 0;
    n += c->o.max_ctx > 0 ? 2 : 0;
    n += c->o.ckpt_dir ? 2 : 0;
    n += c->o.ckpt_dir && c->o.ckpt_files > 0 ? 2 : 0;
    n += mo->n_dirs > 0 ? 2 : 0;
    n += mo->placement ? 2 : 0;
    n += mo->vk ? 5 : 0;
    n += mo->placement && c->o.stripe_remote ? 6 : 0;
    return n + c->o.n_worker_args;
}

/* Cross-worker striping (worker/xstripe.h): worker i reads and serves the
 * drives d with d % N == i and calls the worker of every other drive at
 * its ipc endpoint <tmpdir>/x<j>. A worker without a drive (N > drives)
 * only calls; it still gets an endpoint nobody reaches. */
static void local_xstripe_args(const k3_cluster *c, int i, arg_vec *av) {
    int N = c->n, nd = c->xs_drives;
    char own[4 * K3_MAX_DIRS] = "", peers[K3_MAX_DIRS * (K3_MAX_PATH / 8)] = "";
    size_t no = 0, np = 0;
    for (int d = 0; d < nd; d++) {
        if (d % N == i)
            no += (size_t)snprintf(own + no, sizeof own - no, "%s%d", no ? "," : "", d);
        else
            np += (size_t)snprintf(peers + np, sizeof peers - np, "%s%d=ipc://%s/x%d",
                                   np ? "," : "", d, c->tmpdir, d % N);
    }
    av_add(av, "--stripe-drives"), av_add(av, no ? own : "none");
    av_add(av, "--stripe-peers"), av_add(av, np ? peers : "");
    char ep[K3_MAX_PATH + 16];
    cl_fmt(ep, sizeof ep, "ipc://%s/x%d", c->tmpdir, i);
    av_add(av, "--expert-listen"), av_add(av, ep);
}

/* The argument vector of local worker i serving [a, b). */
static void local_argv(const k3_cluster *c, int i, int a, int b, const char *bin, int threads,
                       const char *dirs, arg_vec *av) {
    const k3_model_opts *mo = c->o.model;
    int N = c->n;
    av->cap = local_argc(c);
    av->n = 0;
    av->v = k3_xcalloc((size_t)av->cap, sizeof *av->v);
    av_add(av, bin);
    av_add(av, "--model"), av_add(av, mo->model_dir);
    av_add(av, "--layers"), av_addf(av, "%d-%d", a, b);
    av_add(av, "--listen"), av_add(av, c->st[i].endpoint);
    av_add(av, "--name"), av_addf(av, "local%d", i);
    av_add(av, "--hb-ms"), av_addf(av, "%d", c->o.hb_ms);
    av_add(av, "--mla-bits"), av_addf(av, "%d", mo->mla_bits);
    av_add(av, "--head-bits"), av_addf(av, "%d", mo->head_bits);
    av_addf(av, "--idot=%d", mo->idot ? 1 : 0);
    av_addf(av, "--dense-idot=%d", mo->dense_idot ? 1 : 0);
    av_add(av, "--threads"), av_addf(av, "%d", threads);
    av_add(av, "--expert-gb"), av_addf(av, "%.17g", mo->expert_gb / N); /* split, not copied */
    av_addf(av, "--direct=%d", mo->direct ? 1 : 0);
    /* --bits only when the coordinator's was explicit: a given K3_BITS
     * downcasts a repacked int8 container, the default does not */
    if (mo->bits_explicit) av_add(av, "--bits"), av_addf(av, "%d", mo->bits);
    if (c->o.exact) av_add(av, "--exact");
    if (c->o.max_sessions > 0) av_add(av, "--max-sessions"), av_addf(av, "%d", c->o.max_sessions);
    if (c->o.max_ctx > 0) av_add(av, "--max-ctx"), av_addf(av, "%d", c->o.max_ctx);
    if (c->o.ckpt_dir) { /* its own directory: a restart finds its layers' files again */
        char cd[K3_MAX_PATH + 64];
        cl_fmt(cd, sizeof cd, "%s/w%d-%d-%d", c->o.ckpt_dir, i, a, b);
        av_add(av, "--ckpt-dir"), av_add(av, cd);
    }
    if (c->o.ckpt_dir && c->o.ckpt_files > 0)
        av_add(av, "--ckpt-files"), av_addf(av, "%d", c->o.ckpt_files);
    if (mo->n_dirs > 0) av_add(av, "--dirs"), av_add(av, dirs);
    if (mo->placement) av_add(av, "--placement"), av_add(av, mo->placement);
    if (mo->vk) { /* one device shared by the local workers: the budget split */
        av_add(av, "--vk");
        av_add(av, "--vk-device"), av_addf(av, "%d", mo->vk_device);
        av_add(av, "--vk-gb"), av_addf(av, "%.17g", mo->vk_gb / N);
    }
    if (mo->placement && c->o.stripe_remote) local_xstripe_args(c, i, av);
    for (int k = 0; k < c->o.n_worker_args; k++) av_add(av, c->o.worker_args[k]);
    K3_ASSERT(av->n == av->cap - 1);
    av->v[av->n] = NULL;
}

/* Starts local worker i ([a, b) of the even split) on its endpoint with the
 * coordinator's settings; s->pid is its pid. */
static k3_status local_spawn(k3_cluster *c, int i, char *err, size_t errlen) {
    const k3_model_opts *mo = c->o.model;
    cl_stage *s = &c->st[i];
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
    char *dirs = join_dirs(mo);
    int a = (int)((long)i * L / N), b = (int)((long)(i + 1) * L / N);
    cl_fmt(s->endpoint, sizeof s->endpoint, "ipc://%s/w%d", c->tmpdir, i);
    arg_vec av;
    local_argv(c, i, a, b, bin, threads, dirs, &av);
    /* settings the worker reads from the environment only */
    char e[5][64];
    cl_fmt(e[0], 64, "K3_LAYERS=%d", mo->max_layers);
    cl_fmt(e[1], 64, "K3_TOPP=%.17g", mo->topp);
    cl_fmt(e[2], 64, "K3_PIPE=%d", mo->pipe ? 1 : 0);
    cl_fmt(e[3], 64, "K3_LOAD_THREADS=%d", mo->load_threads);
    /* the coordinator's log level as it is now (--log-level, --quiet) */
    cl_fmt(e[4], 64, "K3_LOG=%s",
           k3_log_enabled(K3_LOG_DEBUG)  ? "debug"
           : k3_log_enabled(K3_LOG_INFO) ? "info"
           : k3_log_enabled(K3_LOG_WARN) ? "warn"
                                         : "error");
    char *env[6] = {e[0], e[1], e[2], e[3], e[4], NULL};
    /* the child has its own copy of av after fork: freed here either way */
    k3_status st = k3_worker_spawn(&s->pid, bin, av.v, env, err, errlen);
    av_free(&av);
    free(dirs);
    s->registered_since_spawn = 0;
    if (!st)
        K3_INFO("cluster: started local worker %d (pid %d) for layers [%d, %d) on %s", i,
                (int)s->pid, a, b, s->endpoint);
    return st;
}

/* --local N: N workers over ipc:// in a private directory, layers split
 * evenly, numerics and model settings copied from the coordinator's. */
k3_status cl_local_start(k3_cluster *c, char *err, size_t errlen) {
    if (c->o.stripe_remote && c->o.model->placement) { /* the drives to deal out */
        k3_placement *p = NULL;
        k3_status st = k3_placement_load(&p, c->o.model->placement, err, errlen);
        if (st) return st;
        c->xs_drives = k3_placement_drives(p);
        k3_placement_free(&p);
    }
    cl_fmt(c->tmpdir, sizeof c->tmpdir, "/tmp/k3c.XXXXXX");
    if (!mkdtemp(c->tmpdir)) {
        c->tmpdir[0] = 0;
        return k3_errf(K3_ERR_IO, err, errlen,
                       "local workers: cannot create the ipc directory /tmp/k3c.XXXXXX: %s",
                       strerror(errno));
    }
    k3_status st = K3_OK;
    for (int i = 0; i < c->n && !st; i++) st = local_spawn(c, i, err, errlen);
    return st;
}

/* "killed by signal 9 (Killed)" / "exited with status 3" */
static void exit_text(int status, char *out, size_t cap) {
    if (WIFSIGNALED(status))
        cl_fmt(out, cap, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else if (WIFEXITED(status))
        cl_fmt(out, cap, "exited with status %d", WEXITSTATUS(status));
    else
        cl_fmt(out, cap, "ended (wait status 0x%x)", status);
}

int cl_local_reap(k3_cluster *c, int i, char *why, size_t cap) {
    cl_stage *s = &c->st[i];
    int status = 0;
    if (!s->pid || !k3_worker_exited(s->pid, &status)) return 0;
    char how[96], err[512];
    exit_text(status, how, sizeof how);
    pid_t old = s->pid;
    s->pid = 0;
    if (!s->registered_since_spawn) {
        /* it died before serving again: restarting it would loop */
        cl_fmt(why, cap,
               "local worker %d (pid %d) %s before it registered; not restarted (its messages "
               "are above)",
               i, (int)old, how);
        return -1;
    }
    s->restarts++;
    if (local_spawn(c, i, err, sizeof err)) {
        cl_fmt(why, cap, "local worker %d (pid %d) %s; restarting it failed: %s", i, (int)old, how,
               err);
        return -1;
    }
    cl_fmt(why, cap, "local worker %d (pid %d) %s; restarted as pid %d (restart %d)", i, (int)old,
           how, (int)s->pid, s->restarts);
    return 1;
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
        char x[K3_MAX_PATH + 16];
        cl_fmt(x, sizeof x, "%s/x%d", c->tmpdir, i); /* its expert endpoint, if striped */
        unlink(x);
    }
    if (c->tmpdir[0]) rmdir(c->tmpdir);
}
