/* coordinator/engine.c: the coordinator's engine (engine.h): open the model,
 * tokenizer and trunk once, then run requests on sessions kept by id.
 *
 * A request takes its session out of the table (under the lock), runs with
 * no lock held and puts it back, so requests on different sessions only
 * share the trunk, which allows that (generate.h, cluster.h). The session
 * pointer lives in exactly one place at a time: the table while idle, the
 * running call's stack while busy; the lock guards the table only.
 */
#include "coordinator/engine.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "common/experts/experts.h"
#include "common/vk/vk_tier.h"
#include "coordinator/ckpt_dir.h"

/* One entry of the session table. */
typedef struct eng_slot {
    uint64_t id;       /* the caller's session id (valid when sess or busy) */
    k3_session *sess;  /* owned while idle; NULL while busy or free */
    int busy;          /* a generate call holds the session */
    uint64_t last_use; /* e->clock at the last release, for LRU eviction */
} eng_slot;

struct k3_engine {
    k3_model_opts mo;      /* the model options; the cluster borrows them for its life */
    char usage_path[4200]; /* mo.usage_path points here */
    const char *model_dir; /* borrowed from the open options, for messages */
    k3_model *model;       /* owned */
    k3_tok *tok;           /* owned, NULL = no tokenizer */
    k3_cluster *cluster;   /* owned, NULL = in-process */
    k3_trunk *trunk;       /* owned, borrows model or cluster */
    int chunk, progress;   /* session settings */
    int max_resumes;       /* k3_cluster_generate's replays */
    int resume_wait_ms;    /* ... and how long each waits */
    int ckpt;              /* turn checkpoints per session */
    k3_ckpt_dir *store;    /* --ckpt-dir, owned, NULL = none */
    pthread_mutex_t mu;    /* guards slots and clock */
    eng_slot *slots;       /* [n_slots], owned */
    int n_slots;
    uint64_t clock; /* bumped at every release */
};

void k3_engine_open_opts_default(k3_engine_open_opts *o) {
    memset(o, 0, sizeof *o);
    k3_cluster_opts_default(&o->cluster);
    o->chunk = 32;
    o->progress = 1;
    o->n_sessions = 16;
    o->max_resumes = K3_CLUSTER_RESUMES;
    o->resume_wait_ms = K3_CLUSTER_RESUME_WAIT_MS;
}

void k3_engine_open_opts_from_cli(k3_engine_open_opts *o, const k3_engine_opts *eng,
                                  const k3_cluster_cli *cl, const k3_opt *table, int n_table,
                                  const k3_opt_src *src) {
    k3_engine_open_opts_default(o);
    o->eng = eng;
    o->bits_explicit = src[k3_opts_find(table, n_table, "bits")] != K3_OPT_SRC_DEFAULT;
    o->usage_flag = src[k3_opts_find(table, n_table, "usage")] == K3_OPT_SRC_FLAG;
    k3_cluster_opts_from_cli(&o->cluster, cl);
    o->max_resumes = cl->retry.resumes;
    o->resume_wait_ms = cl->retry.resume_wait_ms;
}

/* ---- open / close --------------------------------------------------------- */

static int file_exists(const char *dir, const char *name) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0;
}

/* The model: every layer plus the global tensors in-process; with workers
 * the layers run there, so only the globals here (layer_a = n_layers). */
static k3_status open_model(k3_engine *e, const k3_engine_open_opts *o, char *err, size_t errlen) {
    const k3_engine_opts *eng = o->eng;
    k3_model_opts *mo = &e->mo;
    k3_model_opts_default(mo);
    /* the usage history: <model>/.k3_usage unless given, "off" = none */
    k3_engine_opts_model(eng, mo, e->usage_path, sizeof e->usage_path);
    mo->layer_a = 0;
    mo->layer_b = 0; /* all */
    k3_status st;
    if (o->cluster.n_workers > 0 || o->cluster.local > 0) {
        k3_config c0;
        if ((st = k3_config_load(&c0, eng->model, eng->max_layers, err, errlen))) return st;
        mo->layer_a = c0.n_layers;
    }
    mo->want_global = 1;
    mo->bits_explicit = o->bits_explicit;
    /* Local workers read K3_USAGE / K3_USAGE_SAVE from the inherited
     * environment, so a usage flag is exported for them (no thread of ours
     * runs yet, setenv is safe). */
    if (o->usage_flag) setenv("K3_USAGE", mo->usage_path ? mo->usage_path : "off", 1);
    if (mo->mmap) setenv("K3_MMAP", "1", 1);   /* --mmap reaches local workers too */
    mo->verbose = k3_log_enabled(K3_LOG_INFO); /* per-layer load lines */
    K3_INFO("loading %s (bits %d/%d/%d, idot %d, %d threads)", eng->model, mo->bits, mo->mla_bits,
            mo->head_bits, mo->idot, mo->threads);
    double t_load = k3_now_ms();
    if ((st = k3_model_open(&e->model, mo, err, errlen))) return st;
    const k3_config *cfg = k3_model_config(e->model);
    K3_INFO("loaded %d layers in %.2f s (%.1f MiB dense weights)", cfg->n_layers,
            (k3_now_ms() - t_load) / 1000.0,
            (double)k3_model_resident_bytes(e->model) / (1024.0 * 1024.0));
    return K3_OK;
}

/* A broken tokenizer is an error; a missing one only means ids out. */
static k3_status open_tokenizer(k3_engine *e, char *err, size_t errlen) {
    if (!file_exists(e->model_dir, "tiktoken.model")) {
        K3_INFO("no tokenizer in %s (tiktoken.model): output is ids", e->model_dir);
        return K3_OK;
    }
    return k3_tok_open_dir(&e->tok, e->model_dir, k3_model_config(e->model)->vocab, err, errlen);
}

/* The trunk: in-process, else the cluster of the given workers or of local
 * worker processes, which must agree with this process's numeric settings. */
static k3_status open_trunk(k3_engine *e, const k3_engine_open_opts *o, char *err, size_t errlen) {
    if (o->cluster.n_workers == 0 && o->cluster.local == 0)
        return k3_trunk_open_inproc(&e->trunk, e->model, err, errlen);
    k3_cluster_opts co = o->cluster;
    co.model = &e->mo;
    if (o->ckpt_dir && o->ckpt_dir[0] && o->ckpt > 0) { /* local workers park theirs beside */
        co.ckpt_dir = o->ckpt_dir;
        co.ckpt_files = o->n_sessions * o->ckpt;
    }
    co.exact = o->eng->exact;
    if (o->want_trace)
        K3_WARN("--trace with workers: only each stage's last layer is traced (use --local 0 "
                "for every layer)");
    k3_status st = k3_cluster_open(&e->cluster, k3_model_config(e->model), &co, err, errlen);
    if (!st) st = k3_cluster_trunk(e->cluster, &e->trunk, err, errlen);
    return st;
}

k3_status k3_engine_open(k3_engine **out, const k3_engine_open_opts *o, char *err, size_t errlen) {
    *out = NULL;
    if (!o->eng || !o->eng->model)
        return k3_errf(K3_ERR_ARG, err, errlen, "engine: no model directory given");
    if (o->n_sessions < 1 || o->n_sessions > K3_MAX_SESSIONS)
        return k3_errf(K3_ERR_ARG, err, errlen, "engine: %d sessions: outside 1..%d", o->n_sessions,
                       K3_MAX_SESSIONS);
    k3_engine *e = k3_xcalloc(1, sizeof *e);
    e->model_dir = o->eng->model;
    e->chunk = o->chunk;
    e->progress = o->progress;
    e->max_resumes = o->max_resumes;
    e->resume_wait_ms = o->resume_wait_ms;
    e->ckpt = o->ckpt;
    e->n_slots = o->n_sessions;
    e->slots = k3_xcalloc((size_t)e->n_slots, sizeof *e->slots);
    pthread_mutex_init(&e->mu, NULL);
    k3_status st = open_model(e, o, err, errlen);
    if (!st) st = open_tokenizer(e, err, errlen);
    if (!st) st = open_trunk(e, o, err, errlen);
    if (!st && o->ckpt_dir && o->ckpt_dir[0] && e->ckpt > 0) {
        /* in process the files hold the whole state; with workers the ids
         * only, each worker parking its layers in its own --ckpt-dir */
        int last = e->cluster ? 0 : k3_model_config(e->model)->n_layers;
        st = k3_ckpt_dir_open(&e->store, o->ckpt_dir, k3_model_fingerprint(e->model), 0, last,
                              e->n_slots * e->ckpt, err, errlen);
    } else if (!st && o->ckpt_dir && o->ckpt_dir[0]) {
        K3_WARN("--ckpt-dir %s without --ckpt N: nothing is parked", o->ckpt_dir);
    }
    if (st) {
        k3_engine_close(&e);
        return st;
    }
    *out = e;
    return K3_OK;
}

void k3_engine_close(k3_engine **ep) {
    if (!ep || !*ep) return;
    k3_engine *e = *ep;
    for (int i = 0; i < e->n_slots; i++) k3_session_close(&e->slots[i].sess);
    k3_trunk_close(&e->trunk);
    k3_cluster_close(&e->cluster);
    k3_ckpt_dir_close(&e->store);
    k3_tok_close(&e->tok);
    char err[512];
    if (e->model && k3_model_usage_save(e->model, err, sizeof err) != K3_OK)
        K3_WARN("expert usage history not saved: %s", err);
    k3_model_close(&e->model);
    pthread_mutex_destroy(&e->mu);
    free(e->slots);
    free(e);
    *ep = NULL;
}

const k3_config *k3_engine_config(const k3_engine *e) { return k3_model_config(e->model); }
const k3_tok *k3_engine_tok(const k3_engine *e) { return e->tok; }

k3_status k3_engine_encode(const k3_engine *e, const char *text, size_t len, int trusted,
                           int32_t **ids, int *n, char *err, size_t errlen) {
    *ids = NULL;
    *n = 0;
    if (!e->tok)
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "text prompt given but %s has no tokenizer (tiktoken.model)", e->model_dir);
    const k3_config *cfg = k3_engine_config(e);
    k3_tok_ids v = {0};
    if (cfg->bos >= 0) k3_tok_ids_push(&v, cfg->bos);
    k3_status st = k3_tok_encode(e->tok, text, len, trusted, &v, err, errlen);
    if (!st && v.n > (size_t)K3_MAX_CTX)
        st = k3_errf(K3_ERR_LIMIT, err, errlen, "prompt of %zu tokens > %d (K3_MAX_CTX)", v.n,
                     K3_MAX_CTX);
    if (!st && v.n == 0)
        st = k3_errf(K3_ERR_ARG, err, errlen, "the prompt is empty and no BOS is configured");
    if (!st) {
        *ids = k3_xmalloc(v.n * sizeof **ids);
        memcpy(*ids, v.v, v.n * sizeof **ids);
        *n = (int)v.n;
    }
    k3_tok_ids_free(&v);
    return st;
}

/* ---- sessions ------------------------------------------------------------- */

/* Takes session id out of the table for one call (*slot, *sess: NULL when
 * it has to be opened). A session of another capacity, or the least
 * recently used idle session evicted to make room, is handed back in *old
 * to be closed by the caller, outside the lock. */
static k3_status slot_take(k3_engine *e, uint64_t id, int max_ctx, int *slot, k3_session **sess,
                           k3_session **old, char *err, size_t errlen) {
    *sess = *old = NULL;
    k3_status st = K3_OK;
    pthread_mutex_lock(&e->mu);
    int found = -1, free_i = -1, lru = -1;
    for (int i = 0; i < e->n_slots; i++) {
        eng_slot *s = &e->slots[i];
        int used = s->busy || s->sess;
        if (used && s->id == id) found = i;
        if (!used && free_i < 0) free_i = i;
        if (s->sess && !s->busy && (lru < 0 || s->last_use < e->slots[lru].last_use)) lru = i;
    }
    int i = found >= 0 ? found : free_i >= 0 ? free_i : lru;
    if (found >= 0 && e->slots[found].busy) {
        st = k3_errf(K3_ERR_BUSY, err, errlen, "session %llu: another request is running on it",
                     (unsigned long long)id);
    } else if (i < 0) {
        st = k3_errf(K3_ERR_BUSY, err, errlen, "session %llu: all %d sessions are running",
                     (unsigned long long)id, e->n_slots);
    } else {
        eng_slot *s = &e->slots[i];
        if (found >= 0 && k3_session_max_ctx(s->sess) == max_ctx)
            *sess = s->sess; /* reused: its ids are the prefix to keep */
        else
            *old = s->sess; /* evicted, or opened with another capacity */
        s->sess = NULL;
        s->id = id;
        s->busy = 1;
        *slot = i;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

/* Puts the session of a finished call back (sess NULL frees the slot). */
static void slot_put(k3_engine *e, int slot, k3_session *sess) {
    pthread_mutex_lock(&e->mu);
    eng_slot *s = &e->slots[slot];
    s->sess = sess;
    s->busy = 0;
    s->last_use = ++e->clock;
    pthread_mutex_unlock(&e->mu);
}

/* ---- generation ----------------------------------------------------------- */

/* Context: max_ctx when given, else exactly prompt + ngen (the CLI's rule,
 * docs/INTERFACES.md 3); checked before any state is allocated so the message
 * names the setting. */
static k3_status check_ctx(const k3_engine_req *req, int *max_ctx, char *err, size_t errlen) {
    if (req->n_prompt < 1)
        return k3_errf(K3_ERR_ARG, err, errlen, "prompt: %d tokens, need at least 1",
                       req->n_prompt);
    if (req->ngen < 0 || req->ngen > K3_MAX_NGEN)
        return k3_errf(K3_ERR_ARG, err, errlen, "ngen %d: outside 0..%d (K3_MAX_NGEN)", req->ngen,
                       K3_MAX_NGEN);
    long long want = req->max_ctx > 0 ? req->max_ctx : (long long)req->n_prompt + req->ngen;
    if (want > K3_MAX_CTX)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "context of %lld tokens (prompt %d + ngen %d) > %d (K3_MAX_CTX)", want,
                       req->n_prompt, req->ngen, K3_MAX_CTX);
    if (req->n_prompt > want)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "prompt of %d tokens is longer than the context of %lld tokens "
                       "(--max-ctx / K3_MAXT)",
                       req->n_prompt, want);
    *max_ctx = (int)want;
    return K3_OK;
}

/* The generation itself on an open session: the sampler of the request,
 * then k3_generate, resumed by replay across worker losses with a cluster. */
static k3_status run_session(k3_engine *e, k3_session *sess, const k3_engine_req *req,
                             k3_gen_result *res, char *err, size_t errlen) {
    memset(res, 0, sizeof *res);
    const k3_config *cfg = k3_engine_config(e);
    k3_sampler *sampler = NULL;
    k3_status st;
    if (req->ngen > 0 && (st = k3_sampler_open(&sampler, &req->sampling, cfg->vocab, err, errlen)))
        return st;
    k3_gen_opts go = {.ngen = req->ngen,
                      .sampler = sampler,
                      .eos = cfg->eos,
                      .n_eos = req->ignore_eos ? 0 : cfg->n_eos,
                      .prompt_hooks = req->prompt_hooks,
                      .on_token = req->on_token,
                      .token_ctx = req->token_ctx,
                      .cancel = req->cancel};
    K3_INFO("prompt %d tokens, context %lld, chunk %d, %s trunk", req->n_prompt,
            (long long)k3_session_max_ctx(sess), e->chunk, e->trunk->ops->name);
    st = e->cluster ? k3_cluster_generate(e->cluster, sess, req->prompt, req->n_prompt, &go,
                                          e->max_resumes, e->resume_wait_ms, res, err, errlen)
                    : k3_generate(sess, req->prompt, req->n_prompt, &go, res, err, errlen);
    k3_sampler_close(&sampler);
    return st;
}

k3_status k3_engine_generate(k3_engine *e, const k3_engine_req *req, k3_engine_result *res,
                             char *err, size_t errlen) {
    memset(res, 0, sizeof *res);
    int max_ctx = 0, slot = -1;
    k3_status st = check_ctx(req, &max_ctx, err, errlen);
    if (st) return st;
    k3_session *sess = NULL, *old = NULL;
    if ((st = slot_take(e, req->session_id, max_ctx, &slot, &sess, &old, err, errlen))) return st;
    k3_session_close(&old);
    k3_session_opts so = {.max_ctx = max_ctx,
                          .chunk = e->chunk,
                          .progress = e->progress,
                          .ckpt = e->ckpt,
                          .store = e->store};
    if (!sess) st = k3_session_open(&sess, e->model, e->trunk, &so, err, errlen);
    if (!st) {
        st = run_session(e, sess, req, &res->gen, err, errlen);
        res->max_ctx = max_ctx;
        res->state_bytes = k3_session_state_bytes(sess);
    }
    slot_put(e, slot, sess);
    return st;
}

/* ---- statistics ----------------------------------------------------------- */

int k3_engine_session_reuse(k3_engine *e, uint64_t id, const int32_t *prompt, int n, int max_ctx,
                            uint64_t *last_use) {
    int reuse = 0;
    uint64_t lu = 0;
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_slots; i++) {
        eng_slot *s = &e->slots[i];
        if (!s->sess || s->busy || s->id != id) continue; /* an idle session is only read here */
        lu = s->last_use;
        if (k3_session_max_ctx(s->sess) == max_ctx)
            reuse = k3_session_reusable(s->sess, prompt, n); /* prefix or checkpoint */
        break;
    }
    pthread_mutex_unlock(&e->mu);
    if (last_use) *last_use = lu;
    return reuse;
}

void k3_engine_sessions(k3_engine *e, int *live, int *busy) {
    int l = 0, b = 0;
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_slots; i++) {
        l += e->slots[i].busy || e->slots[i].sess;
        b += e->slots[i].busy;
    }
    pthread_mutex_unlock(&e->mu);
    *live = l;
    *busy = b;
}

k3_cluster *k3_engine_cluster(k3_engine *e) { return e->cluster; }
k3_model *k3_engine_model(k3_engine *e) { return e->model; }

/* Peak resident set in MiB from /proc/self/status (VmHWM), or -1. */
static double peak_rss_mib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    fclose(f);
    return kb < 0 ? -1 : kb / 1024.0;
}

void k3_engine_print_stats(k3_engine *e, const k3_engine_result *res, FILE *f) {
    const k3_step_stats *s = &res->gen.stats;
    fprintf(f,
            "stats: compute %.1f ms, expert reads %.1f ms, %.1f MiB read, expert hits %llu, "
            "misses %llu\n",
            s->compute_ms, s->read_ms, (double)s->bytes_read / (1024.0 * 1024.0),
            (unsigned long long)s->expert_hits, (unsigned long long)s->expert_misses);
    struct k3_experts *xs = k3_model_experts(e->model);
    if (xs) { /* the in-process expert store: its read rate over the run */
        k3_expert_stats et;
        k3_experts_totals(xs, &et);
        fprintf(f,
                "stats: expert store %.3f GB read at %.2f GB/s (%.1f ms with reads in "
                "flight, %.1f ms waited by compute), %llu hits, %llu misses\n",
                (double)et.bytes / 1e9, et.io_ms > 0 ? (double)et.bytes / 1e6 / et.io_ms : 0.0,
                et.io_ms, et.read_ms, (unsigned long long)et.hits, (unsigned long long)et.misses);
        int nd = k3_experts_drives(xs);
        for (int d = 0; nd > 1 && d < nd; d++) { /* striped: each drive's part */
            double mb = (double)k3_experts_drive_bytes(xs, d) / 1e6;
            fprintf(f,
                    "stats: expert drive %d: %.1f MB read, %.1f MB/s over the time with reads "
                    "in flight\n",
                    d, mb, et.io_ms > 0 ? mb * 1e3 / et.io_ms : 0.0);
        }
    }
    struct k3_vk_tier *vt = k3_model_vk(e->model);
    if (vt) { /* the Vulkan expert tier (docs/VULKAN.md "Stats"), since start */
        k3_vk_tier_stats v;
        k3_vk_tier_stats_get(vt, &v);
        double ns = v.steps ? (double)v.steps : 1.0;
        fprintf(f,
                "stats: vulkan %s: %llu device expert calls (%llu pairs) in %llu MoE steps, "
                "%llu resident (%.1f of %.1f MB), %llu filled, %llu promotions, %llu evictions, "
                "%llu upload failures, %llu CPU fallbacks%s; per step device %.2f ms, CPU %.2f "
                "ms, waited %.2f ms\n",
                k3_vk_tier_device(vt), (unsigned long long)v.calls, (unsigned long long)v.pairs,
                (unsigned long long)v.steps, (unsigned long long)v.resident,
                (double)v.resident_bytes / 1e6, (double)v.budget_bytes / 1e6,
                (unsigned long long)v.filled, (unsigned long long)v.promotions,
                (unsigned long long)v.evictions, (unsigned long long)v.upload_failures,
                (unsigned long long)v.fallbacks, v.off ? " (device failed: off)" : "",
                v.device_ms / ns, v.cpu_ms / ns, v.wait_ms / ns);
    }
    fprintf(f, "stats: dense weights %.1f MiB, session state %.1f MiB, peak RSS %.1f MiB\n",
            (double)k3_model_resident_bytes(e->model) / (1024.0 * 1024.0),
            (double)res->state_bytes / (1024.0 * 1024.0), peak_rss_mib());
    if (e->cluster) k3_cluster_print_stats(e->cluster, f);
}
