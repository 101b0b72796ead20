/* coordinator/sampler.c: greedy and temperature/top-p sampling (see sampler.h).
 *
 * Nucleus sampling: p_i = softmax(l_i / T) computed in double. When top_p < 1
 * only tokens with p_i >= (1 - top_p) / (n - 1) can belong to the nucleus
 * (if all the others were below that they could not sum to 1 - top_p), so
 * those candidates alone are sorted, by probability descending and index
 * ascending on ties: the order is total, so the result does not depend on
 * the sort algorithm. The nucleus is the shortest prefix whose mass reaches
 * top_p; one uniform draw scaled by that mass walks the prefix.
 */
#include "coordinator/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"

struct k3_sampler {
    k3_sampler_opts opts;
    int vocab;
    uint64_t rng[4];                       /* xoshiro256** state, never all zero */
    double *prob;                          /* [vocab] softmax probabilities, owned */
    int32_t *cand;                         /* [vocab] candidate indices for the nucleus, owned */
    float *adj;                            /* [vocab] penalised logits (repeat penalty), owned */
    int32_t last[K3_SAMPLER_PENALTY_LAST]; /* ring of the last sampled ids */
    int n_last;                            /* ids sampled so far (ring index: % LAST) */
};

/* ---- PRNG ------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t k3_sampler_next_u64(k3_sampler *s) {
    uint64_t *r = s->rng;
    uint64_t out = rotl(r[1] * 5, 7) * 9;
    uint64_t t = r[1] << 17;
    r[2] ^= r[0];
    r[3] ^= r[1];
    r[1] ^= r[2];
    r[0] ^= r[3];
    r[2] ^= t;
    r[3] = rotl(r[3], 45);
    return out;
}

double k3_sampler_next_unit(k3_sampler *s) {
    return (double)(k3_sampler_next_u64(s) >> 11) * (1.0 / 9007199254740992.0); /* 2^-53 */
}

/* ---- open / close ----------------------------------------------------- */

k3_status k3_sampler_check_opts(const k3_sampler_opts *o, char *err, size_t errlen) {
    if (!isfinite(o->temp) || o->temp < 0)
        return k3_errf(K3_ERR_ARG, err, errlen, "temperature %g: must be finite and >= 0", o->temp);
    if (!(o->top_p > 0 && o->top_p <= 1))
        return k3_errf(K3_ERR_ARG, err, errlen, "top-p %g: must be in (0, 1]", o->top_p);
    if (o->top_k < 0 || o->top_k > K3_MAX_VOCAB)
        return k3_errf(K3_ERR_ARG, err, errlen, "top-k %d: must be in 0..%d (0 = off)", o->top_k,
                       K3_MAX_VOCAB);
    if (!(o->min_p >= 0 && o->min_p <= 1))
        return k3_errf(K3_ERR_ARG, err, errlen, "min-p %g: must be in [0, 1] (0 = off)", o->min_p);
    if (!(o->repeat_penalty >= 0 && o->repeat_penalty <= 10))
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "repeat penalty %g: must be in (0, 10] (0 or 1 = off)", o->repeat_penalty);
    return K3_OK;
}

k3_status k3_sampler_open(k3_sampler **out, const k3_sampler_opts *opts, int vocab, char *err,
                          size_t errlen) {
    *out = NULL;
    k3_status st = k3_sampler_check_opts(opts, err, errlen);
    if (st) return st;
    if (vocab < 1 || vocab > K3_MAX_VOCAB)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "sampler: vocab %d outside 1..%d (K3_MAX_VOCAB)",
                       vocab, K3_MAX_VOCAB);
    k3_sampler *s = k3_xcalloc(1, sizeof *s);
    s->opts = *opts;
    s->vocab = vocab;
    uint64_t x = opts->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x); /* splitmix never yields four zeros in a row */
    s->prob = k3_xmalloc((size_t)vocab * sizeof *s->prob);
    s->cand = k3_xmalloc((size_t)vocab * sizeof *s->cand);
    if (opts->repeat_penalty > 0 && opts->repeat_penalty != 1)
        s->adj = k3_xmalloc((size_t)vocab * sizeof *s->adj);
    *out = s;
    return K3_OK;
}

void k3_sampler_close(k3_sampler **s) {
    if (!s || !*s) return;
    free((*s)->prob);
    free((*s)->cand);
    free((*s)->adj);
    free(*s);
    *s = NULL;
}

/* ---- sampling ---------------------------------------------------------- */

int k3_sampler_argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) /* strict: the first maximum wins */
            best = i;
    return best;
}

/* qsort has no context argument, so the comparator reads the probabilities
 * through this pointer, set just before the call; it is thread-local so
 * samplers of different sessions on different threads do not interfere. */
static _Thread_local const double *cmp_prob;

static int cmp_cand(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    double pi = cmp_prob[i], pj = cmp_prob[j];
    if (pi != pj) return pi > pj ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* min-p, top-k and top-p over s->prob (softmax done): candidates sorted by
 * probability descending, index ascending, cut by each filter in turn; one
 * draw r walks the survivors' mass. */
static int32_t sample_filtered(k3_sampler *s, int best, double r) {
    int n = s->vocab, nc = 0;
    double floor_p = s->opts.min_p * s->prob[best];
    for (int i = 0; i < n; i++)
        if (s->prob[i] >= floor_p) s->cand[nc++] = i;
    cmp_prob = s->prob;
    qsort(s->cand, (size_t)nc, sizeof *s->cand, cmp_cand);
    if (s->opts.top_k > 0 && nc > s->opts.top_k) nc = s->opts.top_k;
    double left = 0; /* the mass that survived min-p and top-k */
    for (int k = 0; k < nc; k++) left += s->prob[s->cand[k]];
    double mass = 0;
    int last = nc - 1;
    for (int k = 0; k < nc; k++) {
        mass += s->prob[s->cand[k]];
        if (mass >= s->opts.top_p * left) {
            last = k;
            break;
        }
    }
    double target = r * mass, acc = 0;
    for (int k = 0; k <= last; k++) {
        acc += s->prob[s->cand[k]];
        if (target < acc) return s->cand[k];
    }
    return s->cand[last];
}

/* The repeat penalty on a copy of the logits (the caller's stay as they are). */
static const float *penalise(k3_sampler *s, const float *logits) {
    double pen = s->opts.repeat_penalty;
    if (!s->adj || s->n_last == 0) return logits;
    memcpy(s->adj, logits, (size_t)s->vocab * sizeof *s->adj);
    int n = s->n_last < K3_SAMPLER_PENALTY_LAST ? s->n_last : K3_SAMPLER_PENALTY_LAST;
    for (int k = 0; k < n; k++) {
        int32_t id = s->last[k];
        float l = logits[id]; /* from the original: an id seen twice is penalised once */
        s->adj[id] = l > 0 ? (float)((double)l / pen) : (float)((double)l * pen);
    }
    return s->adj;
}

static k3_status sample_core(k3_sampler *s, const float *logits, int32_t *id, char *err,
                             size_t errlen);

k3_status k3_sampler_sample(k3_sampler *s, const float *logits, int32_t *id, char *err,
                            size_t errlen) {
    int n = s->vocab;
    for (int i = 0; i < n; i++)
        if (!isfinite(logits[i]))
            return k3_errf(K3_ERR_ARG, err, errlen, "sampler: logit %d is %g (not finite)", i,
                           (double)logits[i]);
    k3_status st = sample_core(s, penalise(s, logits), id, err, errlen);
    if (!st) s->last[s->n_last++ % K3_SAMPLER_PENALTY_LAST] = *id;
    return st;
}

static k3_status sample_core(k3_sampler *s, const float *logits, int32_t *id, char *err,
                             size_t errlen) {
    (void)err, (void)errlen;
    int n = s->vocab;
    int best = k3_sampler_argmax(logits, n);
    if (s->opts.temp == 0) {
        *id = best;
        return K3_OK;
    }

    /* softmax in double, shifted by the maximum so exp never overflows */
    double inv_t = 1.0 / s->opts.temp, max = logits[best], sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = exp(((double)logits[i] - max) * inv_t);
        sum += s->prob[i];
    }
    for (int i = 0; i < n; i++) s->prob[i] /= sum;

    double r = k3_sampler_next_unit(s);
    if (s->opts.top_k > 0 || s->opts.min_p > 0) {
        *id = sample_filtered(s, best, r);
        return K3_OK;
    }
    if (s->opts.top_p >= 1) {
        /* whole distribution: walk in index order */
        double acc = 0, target = r;
        for (int i = 0; i < n; i++) {
            acc += s->prob[i];
            if (target < acc) {
                *id = i;
                return K3_OK;
            }
        }
        *id = best; /* rounding left target >= sum: fall back to the mode */
        return K3_OK;
    }

    /* nucleus: candidates above the cutoff, sorted, shortest prefix >= top_p */
    double cutoff = n > 1 ? (1.0 - s->opts.top_p) / (double)(n - 1) : 0;
    int nc = 0;
    for (int i = 0; i < n; i++)
        if (s->prob[i] >= cutoff) s->cand[nc++] = i;
    if (nc == 0) /* top_p below a flat distribution's 1/n: the mode alone */
        s->cand[nc++] = best;
    cmp_prob = s->prob;
    qsort(s->cand, (size_t)nc, sizeof *s->cand, cmp_cand);
    double mass = 0;
    int last = nc - 1;
    for (int k = 0; k < nc; k++) {
        mass += s->prob[s->cand[k]];
        if (mass >= s->opts.top_p) {
            last = k;
            break;
        }
    }
    double target = r * mass, acc = 0;
    for (int k = 0; k <= last; k++) {
        acc += s->prob[s->cand[k]];
        if (target < acc) {
            *id = s->cand[k];
            return K3_OK;
        }
    }
    *id = s->cand[last];
    return K3_OK;
}
