/* common/vk/vk_tier.c: see vk_tier.h for what the tier owns and its threads.
 *
 * Locking: t->mu guards the resident table, the entries' pins, the job
 * queue, the candidate ring and the counters. It is never held across a
 * device call or a store call (k3_experts_fetch, k3_experts_usage_count take
 * the layer mutex; the order would be tier then layer, but no path needs
 * both). The device (k3_vk) is used for jobs by the device thread only;
 * the upload thread uploads and frees other experts' buffers, which vk.c
 * allows concurrently (its byte count has a lock of its own). */
#include "common/vk/vk_tier.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"
#include "common/vk/vk.h"

#define TIER_CANDS 64 /* promotion candidates queued at most (more are dropped) */

typedef struct tier_ent {
    k3_vk_expert *x; /* device copy */
    int layer;
    int32_t e;
    int pins; /* jobs holding it */
    int dead; /* evicted: freed when pins reaches 0 */
} tier_ent;

struct k3_vk_job {
    int layer, n;
    int32_t *ids;    /* [n] */
    tier_ent **ents; /* [n] pinned */
    const float *z;
    const int32_t *sel;
    const int *n_sel;
    int T, K;
    float *ysel;
    int started;   /* queued to the device thread */
    int done;      /* the device thread finished it */
    int n_ok;      /* experts [0, n_ok) computed */
    double t_ms;   /* device time */
    char err[320]; /* the failure, n_ok < n */
    struct k3_vk_job *next;
};

struct k3_vk_tier {
    k3_vk *vk;
    k3_experts *s; /* borrowed */
    int layer_a, layer_b, E, latent, inter;
    float b1, b2;
    uint64_t ebytes;  /* one expert on the device */
    tier_ent **table; /* [(layer_b - layer_a) * E], NULL = not resident */
    uint8_t *queued;  /* [(layer_b - layer_a) * E] candidate in the ring */
    pthread_mutex_t mu;
    pthread_cond_t cv; /* job queued or done, candidate queued, pins dropped, stop */
    k3_vk_job *head, *tail;
    int cand_l[TIER_CANDS];
    int32_t cand_e[TIER_CANDS];
    int n_cand, cand_head;
    int stop;
    pthread_t dev_th, up_th;
    int threads;
    int fail_upload, fail_apply; /* test hooks: fail the N-th (0 = never) */
    uint64_t n_uploads, n_applies;
    float *zg, *yg; /* device thread's gather buffers [T][latent] */
    size_t g_rows;
    k3_vk_tier_stats st;
};

static tier_ent **slot(k3_vk_tier *t, int layer, int32_t e) {
    return &t->table[(size_t)(layer - t->layer_a) * (size_t)t->E + (size_t)e];
}

/* ---- uploads ---- */

typedef struct up_ctx {
    k3_vk_tier *t;
    k3_vk_expert *x;
} up_ctx;

static k3_status up_fn(void *ctx, const k3_expert_view *v, char *err, size_t errlen) {
    up_ctx *u = ctx;
    k3_vk_tier *t = u->t;
    pthread_mutex_lock(&t->mu);
    uint64_t nth = ++t->n_uploads;
    pthread_mutex_unlock(&t->mu);
    if (t->fail_upload && nth == (uint64_t)t->fail_upload)
        return k3_errf(K3_ERR_IO, err, errlen,
                       "vulkan tier: upload %llu failed (injected by K3_TEST_VK_FAIL_UPLOAD)",
                       (unsigned long long)nth);
    return k3_vk_expert_upload(t->vk, &v->w1, &v->w2, &v->w3, &u->x, err, errlen);
}

/* Uploads expert e of layer and makes it resident. Called without t->mu. */
static k3_status upload(k3_vk_tier *t, int layer, int32_t e, char *err, size_t errlen) {
    up_ctx u = {t, NULL};
    k3_status st = k3_experts_fetch(t->s, layer, e, up_fn, &u, err, errlen);
    if (st != K3_OK) return st;
    tier_ent *n = k3_xcalloc(1, sizeof *n);
    n->x = u.x;
    n->layer = layer;
    n->e = e;
    pthread_mutex_lock(&t->mu);
    *slot(t, layer, e) = n;
    t->st.resident++;
    t->st.resident_bytes += t->ebytes;
    pthread_mutex_unlock(&t->mu);
    return K3_OK;
}

typedef struct heat {
    uint64_t count;
    int layer;
    int32_t e;
} heat;

static int heat_desc(const void *a, const void *b) {
    const heat *x = a, *y = b;
    if (x->count != y->count) return x->count < y->count ? 1 : -1;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return x->e < y->e ? -1 : x->e > y->e;
}

/* At open: the hottest experts of the history until the budget is full. */
static k3_status fill(k3_vk_tier *t, char *err, size_t errlen) {
    size_t cap = (size_t)(t->layer_b - t->layer_a) * (size_t)t->E, n = 0;
    heat *h = k3_xcalloc(cap ? cap : 1, sizeof *h);
    for (int l = t->layer_a; l < t->layer_b; l++)
        for (int32_t e = 0; e < t->E; e++) {
            uint64_t c = k3_experts_usage_count(t->s, l, e);
            if (c) h[n++] = (heat){c, l, e};
        }
    qsort(h, n, sizeof *h, heat_desc);
    uint64_t budget = k3_vk_budget_bytes(t->vk);
    k3_status st = K3_OK;
    for (size_t i = 0; i < n && (t->st.filled + 1) * t->ebytes <= budget; i++) {
        char e2[320];
        st = upload(t, h[i].layer, h[i].e, e2, sizeof e2);
        if (st == K3_ERR_MISSING) { /* absent from the checkpoint: the CPU reports it if used */
            st = K3_OK;
            continue;
        }
        if (st != K3_OK) {
            t->st.upload_failures++;
            K3_WARN("vulkan tier: start fill stopped after %llu experts: %s",
                    (unsigned long long)t->st.filled, e2);
            st = K3_OK; /* the others stay on the CPU */
            break;
        }
        t->st.filled++;
    }
    free(h);
    (void)err, (void)errlen;
    return st;
}

/* The upload thread: takes a candidate, promotes it when there is room or
 * it is hotter than the coldest resident expert (which it evicts). */
static void *up_main(void *arg) {
    k3_vk_tier *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && (t->n_cand == 0 || t->st.off)) {
            if (t->st.off) t->n_cand = 0;
            pthread_cond_wait(&t->cv, &t->mu);
        }
        if (t->stop) break;
        int layer = t->cand_l[t->cand_head];
        int32_t e = t->cand_e[t->cand_head];
        t->cand_head = (t->cand_head + 1) % TIER_CANDS;
        t->n_cand--;
        pthread_mutex_unlock(&t->mu);

        uint64_t hc = k3_experts_usage_count(t->s, layer, e);
        /* the coldest resident one (counts read outside the lock: a hint) */
        pthread_mutex_lock(&t->mu);
        int resident = *slot(t, layer, e) != NULL;
        int fits = t->st.resident * t->ebytes + t->ebytes <= k3_vk_budget_bytes(t->vk);
        pthread_mutex_unlock(&t->mu);
        tier_ent *victim = NULL;
        if (!resident && !fits) {
            uint64_t cold = UINT64_MAX;
            int vl = -1;
            int32_t ve = -1;
            for (int l = t->layer_a; l < t->layer_b; l++)
                for (int32_t x = 0; x < t->E; x++) {
                    pthread_mutex_lock(&t->mu);
                    int here = *slot(t, l, x) != NULL;
                    pthread_mutex_unlock(&t->mu);
                    if (!here) continue;
                    uint64_t c = k3_experts_usage_count(t->s, l, x);
                    if (c < cold) cold = c, vl = l, ve = x;
                }
            if (vl >= 0 && hc > cold) {
                pthread_mutex_lock(&t->mu);
                victim = *slot(t, vl, ve);
                if (victim) {
                    *slot(t, vl, ve) = NULL;
                    victim->dead = 1;
                    t->st.resident--;
                    t->st.resident_bytes -= t->ebytes;
                    t->st.evictions++;
                    while (victim->pins > 0 && !t->stop) pthread_cond_wait(&t->cv, &t->mu);
                }
                pthread_mutex_unlock(&t->mu);
                if (victim) {
                    k3_vk_expert_free(t->vk, &victim->x);
                    free(victim);
                }
            }
        }
        if (!resident && (fits || victim)) {
            char err[320];
            k3_status st = upload(t, layer, e, err, sizeof err);
            pthread_mutex_lock(&t->mu);
            if (st == K3_OK) {
                t->st.promotions++;
            } else if (st != K3_ERR_MISSING) {
                t->st.upload_failures++;
                K3_WARN("vulkan tier: layer %d expert %d stays on the CPU: %s", layer, (int)e, err);
            }
            pthread_mutex_unlock(&t->mu);
        }
        pthread_mutex_lock(&t->mu);
        t->queued[(size_t)(layer - t->layer_a) * (size_t)t->E + (size_t)e] = 0;
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ---- device jobs ---- */

static void gather_need(k3_vk_tier *t, int rows) {
    if ((size_t)rows <= t->g_rows) return;
    free(t->zg), free(t->yg);
    t->zg = k3_xcalloc((size_t)rows * (size_t)t->latent, sizeof(float));
    t->yg = k3_xcalloc((size_t)rows * (size_t)t->latent, sizeof(float));
    t->g_rows = (size_t)rows;
}

/* Runs one job on the device thread: every expert's rows gathered from z
 * (expert by expert, positions in order), one device submission for all of
 * them (k3_vk_experts_apply), the results scattered into ysel[t][k]. On a
 * failure nothing of the job counts (n_ok 0): the caller recomputes it. */
static void run_job(k3_vk_tier *t, k3_vk_job *j) {
    const int LT = t->latent;
    double t0 = k3_now_ms();
    gather_need(t, j->T * j->K);
    size_t cap = (size_t)j->T * (size_t)j->K;
    int *rw = k3_xcalloc(cap, sizeof *rw), *rk = k3_xcalloc(cap, sizeof *rk);
    int *cnt = k3_xcalloc((size_t)j->n, sizeof *cnt);
    const k3_vk_expert **xs = k3_xcalloc((size_t)j->n, sizeof *xs);
    int rows = 0;
    for (int i = 0; i < j->n; i++) {
        int32_t e = j->ids[i];
        xs[i] = j->ents[i]->x;
        for (int p = 0; p < j->T; p++)
            for (int k = 0; k < j->n_sel[p]; k++)
                if (j->sel[(size_t)p * j->K + k] == e) {
                    rw[rows] = p, rk[rows] = k;
                    memcpy(t->zg + (size_t)rows * LT, j->z + (size_t)p * LT, sizeof(float) * LT);
                    rows++, cnt[i]++;
                }
    }
    pthread_mutex_lock(&t->mu);
    uint64_t nth = ++t->n_applies;
    pthread_mutex_unlock(&t->mu);
    k3_status st;
    if (t->fail_apply && nth == (uint64_t)t->fail_apply)
        st = k3_errf(K3_ERR_IO, j->err, sizeof j->err,
                     "vulkan: device submission %llu failed (injected by K3_TEST_VK_FAIL_APPLY)",
                     (unsigned long long)nth);
    else
        st = k3_vk_experts_apply(t->vk, xs, cnt, j->n, t->zg, t->b1, t->b2, t->yg, j->err,
                                 sizeof j->err);
    j->n_ok = 0;
    if (st == K3_OK) {
        for (int r = 0; r < rows; r++)
            memcpy(j->ysel + ((size_t)rw[r] * j->K + (size_t)rk[r]) * LT, t->yg + (size_t)r * LT,
                   sizeof(float) * LT);
        j->n_ok = j->n;
        pthread_mutex_lock(&t->mu);
        t->st.calls += (uint64_t)j->n;
        t->st.pairs += (uint64_t)rows;
        t->st.submits++;
        pthread_mutex_unlock(&t->mu);
    }
    free(rw), free(rk), free(cnt), free(xs);
    j->t_ms = k3_now_ms() - t0;
}

static void *dev_main(void *arg) {
    k3_vk_tier *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && !t->head) pthread_cond_wait(&t->cv, &t->mu);
        if (!t->head) break; /* stop with nothing queued */
        k3_vk_job *j = t->head;
        t->head = j->next;
        if (!t->head) t->tail = NULL;
        pthread_mutex_unlock(&t->mu);
        run_job(t, j);
        pthread_mutex_lock(&t->mu);
        j->done = 1;
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

k3_vk_job *k3_vk_tier_claim(k3_vk_tier *t, int layer, int32_t *ids, int *n) {
    if (!t || layer < t->layer_a || layer >= t->layer_b) return NULL;
    k3_vk_job *j = NULL;
    pthread_mutex_lock(&t->mu);
    if (!t->st.off) {
        int m = 0;
        for (int i = 0; i < *n; i++) {
            tier_ent *x = ids[i] >= 0 && ids[i] < t->E ? *slot(t, layer, ids[i]) : NULL;
            if (!x) {
                ids[m++] = ids[i];
                continue;
            }
            if (!j) {
                j = k3_xcalloc(1, sizeof *j);
                j->layer = layer;
                j->ids = k3_xcalloc((size_t)*n, sizeof *j->ids);
                j->ents = k3_xcalloc((size_t)*n, sizeof *j->ents);
            }
            x->pins++;
            j->ids[j->n] = ids[i];
            j->ents[j->n++] = x;
        }
        *n = m;
    }
    pthread_mutex_unlock(&t->mu);
    /* the store counts the experts of its batches; these skip it */
    if (j) k3_experts_count_use(t->s, layer, j->ids, j->n);
    return j;
}

void k3_vk_tier_start(k3_vk_tier *t, k3_vk_job *j, const float *z, const int32_t *sel,
                      const int *n_sel, int T, int K, float *ysel) {
    j->z = z, j->sel = sel, j->n_sel = n_sel, j->T = T, j->K = K, j->ysel = ysel;
    pthread_mutex_lock(&t->mu);
    j->started = 1;
    if (t->tail)
        t->tail->next = j;
    else
        t->head = j;
    t->tail = j;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

int k3_vk_tier_finish(k3_vk_tier *t, k3_vk_job **pj, double cpu_ms, int32_t *redo) {
    k3_vk_job *j = *pj;
    if (!j) return 0;
    double t0 = k3_now_ms();
    pthread_mutex_lock(&t->mu);
    while (j->started && !j->done) pthread_cond_wait(&t->cv, &t->mu);
    double waited = k3_now_ms() - t0;
    if (!j->started) j->n_ok = j->n; /* never ran: nothing to redo (the caller failed) */
    for (int i = 0; i < j->n; i++) j->ents[i]->pins--;
    t->st.steps++;
    t->st.device_ms += j->t_ms;
    t->st.cpu_ms += cpu_ms;
    t->st.wait_ms += waited;
    int n_redo = j->n - j->n_ok;
    int warn = 0;
    if (n_redo > 0) {
        t->st.fallbacks += (uint64_t)n_redo;
        warn = !t->st.off;
        t->st.off = 1; /* no more claims; the upload thread drops its candidates */
    }
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    if (warn)
        K3_WARN("vulkan tier off for the rest of this process (%s); layer %d: %d experts of this "
                "step and all later ones computed on the CPU",
                j->err, j->layer, n_redo);
    for (int i = 0; i < n_redo; i++) redo[i] = j->ids[j->n_ok + i];
    free(j->ids), free(j->ents), free(j);
    *pj = NULL;
    return n_redo;
}

void k3_vk_tier_offer(k3_vk_tier *t, int layer, const int32_t *ids, int n) {
    if (!t || layer < t->layer_a || layer >= t->layer_b || n <= 0) return;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < n && !t->st.off && t->n_cand < TIER_CANDS; i++) {
        if (ids[i] < 0 || ids[i] >= t->E) continue;
        size_t k = (size_t)(layer - t->layer_a) * (size_t)t->E + (size_t)ids[i];
        if (t->queued[k] || t->table[k]) continue;
        t->queued[k] = 1;
        int at = (t->cand_head + t->n_cand) % TIER_CANDS;
        t->cand_l[at] = layer;
        t->cand_e[at] = ids[i];
        t->n_cand++;
    }
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

void k3_vk_tier_stats_get(k3_vk_tier *t, k3_vk_tier_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->st;
    pthread_mutex_unlock(&t->mu);
}

const char *k3_vk_tier_device(const k3_vk_tier *t) { return k3_vk_device_name(t->vk); }

/* ---- open / close ---- */

static int env_int(const char *name) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : 0;
}

k3_status k3_vk_tier_open(k3_vk_tier **out, k3_experts *s, const k3_config *cfg, int layer_a,
                          int layer_b, int device, double gb, int idot, char *err, size_t errlen) {
    *out = NULL;
    k3_vk *vk = NULL;
    k3_status st = k3_vk_open(&vk, device, gb, err, errlen);
    if (st != K3_OK) return st;
    k3_vk_tier *t = k3_xcalloc(1, sizeof *t);
    t->vk = vk;
    t->s = s;
    t->layer_a = layer_a;
    t->layer_b = layer_b;
    t->E = cfg->n_experts;
    t->latent = cfg->latent;
    t->inter = cfg->moe_inter;
    t->b1 = cfg->situ_b1;
    t->b2 = cfg->situ_b2;
    t->ebytes = k3_vk_expert_bytes(cfg->moe_inter, cfg->latent);
    size_t cells = (size_t)(layer_b - layer_a) * (size_t)t->E;
    t->table = k3_xcalloc(cells ? cells : 1, sizeof *t->table);
    t->queued = k3_xcalloc(cells ? cells : 1, 1);
    t->fail_upload = env_int("K3_TEST_VK_FAIL_UPLOAD");
    t->fail_apply = env_int("K3_TEST_VK_FAIL_APPLY");
    t->st.budget_bytes = k3_vk_budget_bytes(vk);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (!k3_vk_exact(vk))
        K3_WARN("vulkan tier: %s lacks shaderFloat64, so its experts run the device's own fma(): "
                "within ~1e-6 of the CPU, tokens may differ from a CPU-only run",
                k3_vk_device_name(vk));
    if (idot)
        K3_WARN("vulkan tier without --exact: the device computes its experts with f32 "
                "activations, the CPU with int8 (idot 1), so tokens may differ from a CPU-only "
                "run; --exact gives the CPU-only run's tokens");
    double t0 = k3_now_s();
    st = fill(t, err, errlen);
    if (st == K3_OK) {
        if (pthread_create(&t->dev_th, NULL, dev_main, t) != 0) {
            st = k3_errf(K3_ERR_INTERNAL, err, errlen, "vulkan tier: cannot start its threads");
        } else if (pthread_create(&t->up_th, NULL, up_main, t) != 0) {
            pthread_mutex_lock(&t->mu);
            t->stop = 1;
            pthread_cond_broadcast(&t->cv);
            pthread_mutex_unlock(&t->mu);
            pthread_join(t->dev_th, NULL);
            st = k3_errf(K3_ERR_INTERNAL, err, errlen, "vulkan tier: cannot start its threads");
        } else {
            t->threads = 1;
        }
    }
    if (st != K3_OK) {
        k3_vk_tier_close(&t);
        return st;
    }
    K3_INFO("vulkan tier on %s: layers [%d, %d), budget %.3f GB (%llu experts of %.1f MB), %llu "
            "resident from the usage history in %.2f s",
            k3_vk_device_name(vk), layer_a, layer_b, (double)t->st.budget_bytes / 1e9,
            (unsigned long long)(t->ebytes ? t->st.budget_bytes / t->ebytes : 0),
            (double)t->ebytes / 1e6, (unsigned long long)t->st.filled, k3_now_s() - t0);
    *out = t;
    return K3_OK;
}

void k3_vk_tier_close(k3_vk_tier **pt) {
    k3_vk_tier *t = pt ? *pt : NULL;
    if (!t) return;
    if (t->threads) {
        pthread_mutex_lock(&t->mu);
        t->stop = 1;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->up_th, NULL);
        pthread_join(t->dev_th, NULL);
        k3_vk_tier_stats s = t->st;
        K3_INFO("[VK] tier on %s: %llu expert calls (%llu pairs) in %llu steps, %llu resident, "
                "%llu filled, %llu promotions, %llu evictions, %llu upload failures, %llu CPU "
                "fallbacks; device %.1f ms, CPU %.1f ms, waited %.1f ms",
                k3_vk_device_name(t->vk), (unsigned long long)s.calls, (unsigned long long)s.pairs,
                (unsigned long long)s.steps, (unsigned long long)s.resident,
                (unsigned long long)s.filled, (unsigned long long)s.promotions,
                (unsigned long long)s.evictions, (unsigned long long)s.upload_failures,
                (unsigned long long)s.fallbacks, s.device_ms, s.cpu_ms, s.wait_ms);
    }
    size_t cells = (size_t)(t->layer_b - t->layer_a) * (size_t)t->E;
    for (size_t i = 0; t->table && i < cells; i++)
        if (t->table[i]) {
            k3_vk_expert_free(t->vk, &t->table[i]->x);
            free(t->table[i]);
        }
    free(t->table);
    free(t->queued);
    free(t->zg), free(t->yg);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    k3_vk_close(&t->vk);
    free(t);
    *pt = NULL;
}
