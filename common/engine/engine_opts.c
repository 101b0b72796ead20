/* common/engine/engine_opts.c: what the shared engine rows mean (see engine_opts.h).
 *
 * The rows themselves are the macros in the header (a static table cannot
 * include another array); this file holds the rules that span rows: --exact
 * against explicit bit flags, and the copy into k3_model_opts that both
 * programs did line by line before.
 */
#include "common/engine/engine_opts.h"

#include <stdio.h>
#include <string.h>

#include "common/base/log.h"

/* The label of the row's value for a message: its flag when it came from
 * the command line, else its variable. */
static const char *engine_label(const k3_opt *o, k3_opt_src src) {
    return src == K3_OPT_SRC_FLAG || !o->env ? o->flag : o->env;
}

k3_status k3_engine_opts_resolve(k3_engine_opts *e, const k3_opt *table, int n_opts,
                                 const k3_opt_src *src, char *err, size_t errlen) {
    if (!e->exact) return K3_OK;
    int kx = k3_opts_find(table, n_opts, "exact");
    if (kx < 0) return k3_errf(K3_ERR_INTERNAL, err, errlen, "option table has no 'exact' row");
    const char *exact = engine_label(&table[kx], src[kx]);
    /* an explicit flag that asks for other bits is a mistake, not a wish */
    static const char *names[] = {"bits", "mla_bits", "head_bits"};
    const int *vals[] = {&e->bits, &e->mla_bits, &e->head_bits};
    for (int i = 0; i < 3; i++) {
        int k = k3_opts_find(table, n_opts, names[i]);
        if (k < 0)
            return k3_errf(K3_ERR_INTERNAL, err, errlen, "option table has no '%s' row", names[i]);
        if (src[k] == K3_OPT_SRC_FLAG && *vals[i] != 32)
            return k3_errf(K3_ERR_ARG, err, errlen, "%s conflicts with %s %d", exact, table[k].flag,
                           *vals[i]);
    }
    static const char *ints[] = {"idot", "dense_idot"};
    const int *on[] = {&e->idot, &e->dense_idot};
    for (int i = 0; i < 2; i++) {
        int k = k3_opts_find(table, n_opts, ints[i]);
        if (k < 0)
            return k3_errf(K3_ERR_INTERNAL, err, errlen, "option table has no '%s' row", ints[i]);
        if (src[k] == K3_OPT_SRC_FLAG && *on[i])
            return k3_errf(K3_ERR_ARG, err, errlen, "%s conflicts with %s", exact, table[k].flag);
    }
    e->bits = e->mla_bits = e->head_bits = 32;
    e->idot = 0;
    e->dense_idot = 0;
    return K3_OK;
}

void k3_engine_opts_apply(const k3_engine_opts *e) {
    k3_log_level lvl = (k3_log_level)e->log_level;
    k3_log_set_level(e->quiet && lvl < K3_LOG_WARN ? K3_LOG_WARN : lvl);
    k3_isa_select(e->isa);
}

void k3_engine_opts_model(const k3_engine_opts *e, k3_model_opts *mo, char *usage_buf,
                          size_t usage_cap) {
    mo->model_dir = e->model;
    mo->dirs = (const char *const *)e->dirs.items;
    mo->n_dirs = e->dirs.n;
    mo->max_layers = e->max_layers;
    mo->bits = e->bits;
    mo->mla_bits = e->mla_bits;
    mo->head_bits = e->head_bits;
    mo->idot = e->idot;
    mo->dense_idot = e->dense_idot;
    if (e->threads > 0) mo->threads = e->threads; /* else the default's online CPUs */
    mo->expert_gb = e->expert_gb;
    mo->direct = e->direct;
    mo->pipe = e->pipe;
    mo->load_threads = e->load_threads;
    mo->read_depth = e->read_depth;
    mo->topp = e->expert_topp;
    mo->placement = e->placement;
    /* <cache dir>/<fingerprint>/usage unless given (never the model
     * directory: it may be read-only or shared, usage_path.c); "off" (or "")
     * means none. One file serves every worker of the model: a save merges
     * (common/experts/experts.h). */
    char uerr[512];
    if (!e->usage) {
        if (!e->model || k3_usage_default_path(e->model, e->max_layers, e->expert_topp, usage_buf,
                                               usage_cap, uerr, sizeof uerr)) {
            if (e->model) K3_WARN("expert usage history off: %s", uerr);
            snprintf(usage_buf, usage_cap, "off");
        }
    } else {
        snprintf(usage_buf, usage_cap, "%s", e->usage);
    }
    mo->usage_path = strcmp(usage_buf, "off") != 0 && usage_buf[0] ? usage_buf : NULL;
    mo->usage_save = e->usage_save;
    mo->mmap = e->mmap;
    mo->vk = e->vk;
    mo->vk_device = e->vk_device;
    mo->vk_gb = e->vk_gb;
}
