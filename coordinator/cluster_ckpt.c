/* coordinator/cluster_ckpt.c: turn checkpoints on the workers, the cluster
 * trunk's ckpt_save / ckpt_restore / ckpt_free (generate.h; PROTOCOL.md
 * "Checkpoints").
 *
 * A checkpoint of a session lives on every worker: each snapshots its own
 * layers' state (CHECKPOINT) and brings it back (RESTORE). The coordinator
 * keeps only a handle, the position. Both sides drop the same checkpoints:
 * CHECKPOINT carries the count the session keeps (the worker drops its
 * oldest beyond it, as generate.c does), RESTORE drops those past the
 * restored position on both sides, and a reset or a drop of the session
 * drops them all. A save or restore that fails on any worker fails as a
 * whole: the session then replays (generate.c), which is always exact.
 *
 * Parked on disk (1.3, PROTOCOL.md "Parked on disk"): a checkpoint taken
 * with a key is parked by every worker that has a --ckpt-dir, and
 * cl_tr_state_load (the trunk's state_load, called by coordinator/ckpt_dir.c
 * for a file of ids the coordinator parked) sends RESTORE with the key to
 * every worker whatever it holds for the session, which makes the session
 * whole at the position or, on any failure, resets it.
 *
 * Borrows: the cluster. Threads: the caller waits on the cluster's mutex
 * while the I/O thread sends the requests and collects the answers (the
 * sockets are the I/O thread's).
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/log.h"
#include "coordinator/cluster_impl.h"

typedef struct cl_ckpt { /* the coordinator's handle */
    int pos;             /* the session's position when taken */
    uint64_t key;        /* its key when parked on disk too (1.3), else 0 */
} cl_ckpt;

/* c->mu held: is every worker state of x usable for a checkpoint op? */
static k3_status sess_usable(k3_cluster *c, const cl_sess *x, const char *what, char *err,
                             size_t errlen) {
    if (c->stopping) return k3_errf(K3_ERR_CANCEL, err, errlen, "cluster: %s: closing", what);
    if (x->busy || x->broken || x->reset_pending || !x->used)
        return k3_errf(K3_ERR_STATE, err, errlen, "cluster: %s: the session is %s", what,
                       x->busy            ? "running a step"
                       : x->broken        ? "broken by a failed step"
                       : x->reset_pending ? "being reset"
                                          : "empty");
    char lab[512];
    for (int p = 0; p < c->n; p++) {
        const cl_stage *s = &c->st[c->order[p]];
        if (s->state == LINK_READY && s->ver_minor < 2)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "cluster: %s: %s speaks protocol 1.%d, checkpoints need 1.2", what,
                           cl_stage_label(s, lab, sizeof lab), s->ver_minor);
        if (x->lost || s->state != LINK_READY || s->epoch != x->epoch[p])
            return k3_errf(K3_ERR_STATE, err, errlen,
                           "cluster: %s: the session's state on %s is gone (%s)", what,
                           cl_stage_label(s, lab, sizeof lab),
                           x->lost                  ? "evicted"
                           : s->state != LINK_READY ? "not registered"
                                                    : "the worker re-registered");
    }
    return K3_OK;
}

/* c->mu held: can x load a parked checkpoint? Every worker registered and
 * speaking 1.3 (RESTORE by key), the session idle. Whatever state the
 * workers hold for it is replaced. */
static k3_status parked_usable(k3_cluster *c, const cl_sess *x, char *err, size_t errlen) {
    if (c->stopping) return k3_errf(K3_ERR_CANCEL, err, errlen, "cluster: RESTORE: closing");
    if (x->busy)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cluster: RESTORE: the session is running a step");
    char lab[512];
    for (int p = 0; p < c->n; p++) {
        const cl_stage *s = &c->st[c->order[p]];
        if (s->state != LINK_READY)
            return k3_errf(K3_ERR_STATE, err, errlen, "cluster: RESTORE: %s is not registered",
                           cl_stage_label(s, lab, sizeof lab));
        if (s->ver_minor < 3)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "cluster: RESTORE: %s speaks protocol 1.%d, a parked checkpoint needs "
                           "1.3",
                           cl_stage_label(s, lab, sizeof lab), s->ver_minor);
    }
    return K3_OK;
}

/* Sends type (CHECKPOINT or RESTORE) for x at pos to every worker and waits
 * for every answer (bounded by the step deadline). key: the checkpoint's
 * key (0 = none); parked: a RESTORE of a checkpoint parked under key, sent
 * whatever the workers hold (a new epoch, an evicted or reset session),
 * which makes the session whole at pos on success. c->mu is not held. */
static k3_status ckpt_op(k3_cluster *c, cl_sess *x, proto_type type, int pos, int keep,
                         uint64_t key, int parked, char *err, size_t errlen) {
    const char *tn = proto_type_name(type);
    cl_ctl *xs = k3_xcalloc((size_t)c->n, sizeof *xs);
    pthread_mutex_lock(&c->mu);
    k3_status st = parked ? parked_usable(c, x, err, errlen) : sess_usable(c, x, tn, err, errlen);
    if (st) {
        pthread_mutex_unlock(&c->mu);
        free(xs);
        return st;
    }
    if (parked) {    /* the workers may create the session: it must be reset if this fails */
        x->busy = 1; /* no step meanwhile */
        x->used = 1;
        x->reset_pending = 0; /* RESTORE by key replaces the state wholesale */
    }
    for (int p = 0; p < c->n; p++) {
        cl_ctl *q = &xs[p];
        q->stage = p;
        q->type = type;
        q->session = x->id;
        q->epoch = parked ? c->st[c->order[p]].epoch : x->epoch[p];
        q->n = (uint32_t)pos;
        q->keep = (uint32_t)keep;
        q->key = key;
        q->next = c->ctl_in;
        c->ctl_in = q;
    }
    cl_wake(c);
    int limit_ms = c->o.step_timeout_ms + 1000;
    double deadline = k3_now_ms() + limit_ms;
    for (;;) {
        int done = 1;
        for (int p = 0; p < c->n; p++) done &= xs[p].done;
        if (done) break;
        if (k3_now_ms() > deadline) { /* unlink the rest wherever they are */
            for (int p = 0; p < c->n; p++) {
                if (xs[p].done) continue;
                for (cl_ctl **pp = &c->ctl_in; *pp; pp = &(*pp)->next)
                    if (*pp == &xs[p]) {
                        *pp = xs[p].next;
                        break;
                    }
                for (int k = 0; k < c->n; k++)
                    for (cl_req *r = c->st[k].pending; r; r = r->next)
                        if (r->ctl == &xs[p]) r->ctl = NULL;
                xs[p].done = 1;
                xs[p].st = K3_ERR_TIMEOUT;
                cl_fmt(xs[p].err, sizeof xs[p].err, "no answer within %d ms", limit_ms);
            }
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    for (int p = 0; p < c->n && !st; p++)
        if (xs[p].st) {
            char lab[512];
            st = k3_errf(xs[p].st, err, errlen, "cluster: %s of session %llu at %d on %s: %s", tn,
                         (unsigned long long)x->id, pos,
                         cl_stage_label(&c->st[c->order[p]], lab, sizeof lab), xs[p].err);
        }
    if (!st && type == PROTO_MSG_RESTORE) x->pos = pos;
    if (parked) {
        x->busy = 0;
        if (st) { /* whatever some workers loaded goes: reset before the next step */
            x->pos = 0;
            x->reset_pending = 1;
        } else { /* whole again: every worker holds it in the epoch it was sent in */
            x->broken = x->lost = 0;
            for (int p = 0; p < c->n; p++) x->epoch[p] = xs[p].epoch;
        }
    }
    pthread_mutex_unlock(&c->mu);
    free(xs);
    return st;
}

k3_status cl_tr_ckpt_save(k3_trunk *t, void *state, int keep, uint64_t key, void **ck, char *err,
                          size_t errlen) {
    k3_cluster *c = t->impl;
    cl_sess *x = state;
    *ck = NULL;
    pthread_mutex_lock(&c->mu);
    int pos = x->pos;
    pthread_mutex_unlock(&c->mu);
    if (pos < 1)
        return k3_errf(K3_ERR_STATE, err, errlen, "cluster: CHECKPOINT: the session is empty");
    if (keep < 1 || keep > K3_MAX_CKPT)
        return k3_errf(K3_ERR_ARG, err, errlen, "cluster: CHECKPOINT: keep %d outside [1, %d]",
                       keep, K3_MAX_CKPT);
    k3_status st = ckpt_op(c, x, PROTO_MSG_CHECKPOINT, pos, keep, key, 0, err, errlen);
    if (st) return st;
    cl_ckpt *h = k3_xcalloc(1, sizeof *h);
    h->pos = pos;
    h->key = key;
    *ck = h;
    return K3_OK;
}

k3_status cl_tr_ckpt_restore(k3_trunk *t, void *state, const void *ck, char *err, size_t errlen) {
    k3_cluster *c = t->impl;
    const cl_ckpt *h = ck;
    cl_sess *x = state;
    pthread_mutex_lock(&c->mu);
    int pos = x->pos;
    pthread_mutex_unlock(&c->mu);
    if (h->pos > pos)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cluster: RESTORE: the checkpoint at %d is past the session's %d", h->pos,
                       pos);
    /* the key lets a worker that lost this one from memory (its budget)
     * load it from its disk */
    return ckpt_op(c, x, PROTO_MSG_RESTORE, h->pos, 0, h->key, 0, err, errlen);
}

k3_status cl_tr_state_load(k3_trunk *t, void *state, FILE *f, int pos, uint64_t key, char *err,
                           size_t errlen) {
    (void)f; /* the coordinator's file holds the ids only: the state is on the workers */
    k3_cluster *c = t->impl;
    cl_sess *x = state;
    if (pos < 1 || pos > x->max_ctx || key == 0)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cluster: RESTORE: a parked checkpoint at %d (key %llx) outside the "
                       "session's [1, %d]",
                       pos, (unsigned long long)key, x->max_ctx);
    /* a restarted worker may still be registering: wait as a step would */
    k3_status st = k3_cluster_wait_ready(c, c->o.request_wait_ms, err, errlen);
    if (st) {
        k3_err_prefix(err, errlen, "cluster: RESTORE");
        return st;
    }
    return ckpt_op(c, x, PROTO_MSG_RESTORE, pos, 0, key, 1, err, errlen);
}

/* The workers drop their copies themselves (see the top of this file). */
void cl_tr_ckpt_free(k3_trunk *t, void **ck) {
    (void)t;
    free(*ck);
    *ck = NULL;
}
