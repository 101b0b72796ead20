/* coordinator/cluster_replay.c: a generation that survives the loss of a
 * worker (cluster.h, k3_cluster_generate; ARCHITECTURE.md "Sessions and
 * recovery").
 *
 * The coordinator keeps what a replay needs: the session's committed ids
 * are the prompt plus the tokens produced so far (recorded here as they are
 * sampled). When a step fails because a worker was lost or a worker state
 * is gone, the session is reset and the whole history is prefilled again
 * once the cluster is whole; the logits of the last replayed position are
 * the bits the interrupted decode step would have produced (chunking and
 * transport never change bits), and the sampler, which only advances when
 * it samples, continues where it was. So the resumed output equals an
 * uninterrupted run's, for greedy and seeded sampling alike.
 *
 * Not handled: prompt hooks (teacher-forced logits, traces) cannot be
 * resumed exactly once they have seen part of the prompt, so a failure
 * before the first token with hooks set is returned, not resumed; after the
 * first token the hooks have seen the whole prompt and are simply not
 * called again.
 */
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"
#include "coordinator/cluster.h"

typedef struct replay_rec {
    const k3_gen_opts *user; /* the caller's options (its on_token) */
    int32_t *ids;            /* [cap] tokens produced so far, owned */
    int n, cap;
} replay_rec;

static void rec_token(void *ctx, int32_t id) {
    replay_rec *r = ctx;
    if (r->n < r->cap) r->ids[r->n++] = id;
    if (r->user->on_token) r->user->on_token(r->user->token_ctx, id);
}

/* Failures a reset and a replay can cure: a lost or stalled link, a state
 * the workers no longer hold. */
static int resumable(k3_status st) {
    return st == K3_ERR_IO || st == K3_ERR_STATE || st == K3_ERR_TIMEOUT;
}

k3_status k3_cluster_generate(k3_cluster *c, k3_session *s, const int32_t *prompt, int n,
                              const k3_gen_opts *opts, int max_resumes, int wait_ms,
                              k3_gen_result *res, char *err, size_t errlen) {
    memset(res, 0, sizeof *res);
    res->n_prompt = n;
    if (n < 1 || opts->ngen < 0 || opts->ngen > K3_MAX_NGEN)
        return k3_errf(K3_ERR_ARG, err, errlen, "generate: prompt %d tokens, ngen %d", n,
                       opts->ngen);
    replay_rec rec = {opts, NULL, 0, opts->ngen};
    int32_t *feed = malloc(sizeof(int32_t) * ((size_t)n + (size_t)opts->ngen + 1));
    rec.ids = malloc(sizeof(int32_t) * ((size_t)opts->ngen + 1));
    if (!feed || !rec.ids) {
        free(feed);
        free(rec.ids);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "generate: cannot allocate %d ids",
                       n + opts->ngen);
    }
    memcpy(feed, prompt, sizeof(int32_t) * (size_t)n);
    k3_gen_opts o = *opts;
    o.on_token = rec_token;
    o.token_ctx = &rec;
    int hooks = opts->prompt_hooks.logits || opts->prompt_hooks.trace;
    k3_status st = K3_OK;
    for (int attempt = 0;; attempt++) {
        o.ngen = opts->ngen - rec.n;
        memcpy(feed + n, rec.ids, sizeof(int32_t) * (size_t)rec.n);
        k3_gen_result r;
        st = k3_generate(s, feed, n + rec.n, &o, &r, err, errlen);
        res->n_reused = r.n_reused; /* the last attempt's: a replay reuses what it restored
                                       (a parked checkpoint, --ckpt-dir), else nothing */
        res->n_prefilled += r.n_prefilled;
        res->n_gen += r.n_gen;
        res->stop = r.stop;
        res->prefill_ms += r.prefill_ms;
        res->decode_ms += r.decode_ms;
        res->n_decode_steps += r.n_decode_steps;
        res->stats.compute_ms += r.stats.compute_ms;
        res->stats.read_ms += r.stats.read_ms;
        res->stats.bytes_read += r.stats.bytes_read;
        res->stats.expert_hits += r.stats.expert_hits;
        res->stats.expert_misses += r.stats.expert_misses;
        if (!st || !resumable(st) || attempt >= max_resumes) break;
        if (opts->cancel && atomic_load(opts->cancel))
            break;                      /* no replay for a request that
                                           was given up */
        if (hooks && rec.n == 0) break; /* the hooks saw part of the prompt */
        o.prompt_hooks.logits = NULL;   /* they have seen all of it */
        o.prompt_hooks.trace = NULL;
        K3_WARN("generate: step failed (%s); resuming: waiting for the cluster, then replaying "
                "%d tokens",
                err, n + rec.n);
        char werr[512];
        k3_status ws = k3_cluster_wait_ready(c, wait_ms, werr, sizeof werr);
        if (ws) {
            k3_err_prefix(err, errlen, "cannot resume (%s)", werr);
            break;
        }
        k3_session_reset(s);
    }
    free(feed);
    free(rec.ids);
    return st;
}
