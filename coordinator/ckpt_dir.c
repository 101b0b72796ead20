/* coordinator/ckpt_dir.c: the coordinator's turn checkpoints parked on disk
 * (ckpt_dir.h). */
#include "coordinator/ckpt_dir.h"

#include <stdint.h>
#include <stdlib.h>

#include "common/base/limits.h"

struct k3_ckpt_dir {
    k3_ckpt_store *store; /* owned */
};

k3_status k3_ckpt_dir_open(k3_ckpt_dir **out, const char *dir, uint64_t fingerprint, int first,
                           int last, int max_files, char *err, size_t errlen) {
    *out = NULL;
    k3_ckpt_store *s = NULL;
    k3_status st = k3_ckpt_store_open(&s, dir, "--ckpt-dir", fingerprint, first, last, max_files,
                                      UINT64_MAX, err, errlen);
    if (st) return st;
    k3_ckpt_dir *d = k3_xcalloc(1, sizeof *d);
    d->store = s;
    *out = d;
    return K3_OK;
}

void k3_ckpt_dir_close(k3_ckpt_dir **dp) {
    if (!dp || !*dp) return;
    k3_ckpt_store_close(&(*dp)->store);
    free(*dp);
    *dp = NULL;
}

uint64_t k3_ckpt_dir_key(const k3_ckpt_dir *d, const int32_t *ids, int n) {
    return k3_ckpt_key(k3_ckpt_store_fp(d->store), ids, n);
}

typedef struct io_ctx {
    k3_trunk *t;
    void *state;
    uint64_t key;
} io_ctx;

static k3_status dump_cb(void *ctx, FILE *f, char *err, size_t errlen) {
    io_ctx *c = ctx;
    return c->t->ops->state_dump(c->t, c->state, f, err, errlen);
}

static k3_status load_cb(void *ctx, FILE *f, int pos, char *err, size_t errlen) {
    io_ctx *c = ctx;
    return c->t->ops->state_load(c->t, c->state, f, pos, c->key, err, errlen);
}

/* Bytes of the trunk's dump at pos: 0 when the state lives elsewhere. */
static uint64_t dump_bytes(k3_trunk *t, void *state, int pos) {
    return t->ops->state_dump && t->ops->state_dump_bytes ? t->ops->state_dump_bytes(t, state, pos)
                                                          : 0;
}

k3_status k3_ckpt_dir_save(k3_ckpt_dir *d, k3_trunk *t, void *state, const int32_t *ids, int n,
                           char *err, size_t errlen) {
    if (n < 1 || n > K3_MAX_CTX)
        return k3_errf(K3_ERR_ARG, err, errlen, "--ckpt-dir: %d ids outside 1..%d", n, K3_MAX_CTX);
    io_ctx c = {t, state, k3_ckpt_dir_key(d, ids, n)};
    return k3_ckpt_store_save(d->store, c.key, n, ids, dump_bytes(t, state, n), dump_cb, &c, err,
                              errlen);
}

int k3_ckpt_dir_find(k3_ckpt_dir *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                     char *path, size_t cap, int *pos) {
    return k3_ckpt_store_find(d->store, ids, n, min_pos, max_ctx, path, cap, pos);
}

k3_status k3_ckpt_dir_load(k3_ckpt_dir *d, const char *path, int pos, const int32_t *ids,
                           k3_trunk *t, void *state, char *err, size_t errlen) {
    if (!t->ops->state_load)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--ckpt-dir: the %s trunk cannot load a parked state", t->ops->name);
    io_ctx c = {t, state, k3_ckpt_dir_key(d, ids, pos)};
    k3_status st = k3_ckpt_store_load(d->store, path, c.key, pos, ids, dump_bytes(t, state, pos),
                                      load_cb, &c, err, errlen);
    if (st && t->ops->state_reset) t->ops->state_reset(t, state);
    return st;
}
