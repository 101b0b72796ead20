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

/* Sends type (CHECKPOINT or RESTORE) for x at pos to every worker and waits
 * for every answer (bounded by the step deadline). c->mu is not held. */
static k3_status ckpt_op(k3_cluster *c, cl_sess *x, proto_type type, int pos, int keep, char *err,
                         size_t errlen) {
    const char *tn = proto_type_name(type);
    cl_ctl *xs = k3_xcalloc((size_t)c->n, sizeof *xs);
    pthread_mutex_lock(&c->mu);
    k3_status st = sess_usable(c, x, tn, err, errlen);
    if (st) {
        pthread_mutex_unlock(&c->mu);
        free(xs);
        return st;
    }
    for (int p = 0; p < c->n; p++) {
        cl_ctl *q = &xs[p];
        q->stage = p;
        q->type = type;
        q->session = x->id;
        q->epoch = x->epoch[p];
        q->n = (uint32_t)pos;
        q->keep = (uint32_t)keep;
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
    pthread_mutex_unlock(&c->mu);
    free(xs);
    return st;
}

k3_status cl_tr_ckpt_save(k3_trunk *t, void *state, int keep, void **ck, char *err, size_t errlen) {
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
    k3_status st = ckpt_op(c, x, PROTO_MSG_CHECKPOINT, pos, keep, err, errlen);
    if (st) return st;
    cl_ckpt *h = k3_xcalloc(1, sizeof *h);
    h->pos = pos;
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
    return ckpt_op(c, x, PROTO_MSG_RESTORE, h->pos, 0, err, errlen);
}

/* The workers drop their copies themselves (see the top of this file). */
void cl_tr_ckpt_free(k3_trunk *t, void **ck) {
    (void)t;
    free(*ck);
    *ck = NULL;
}
