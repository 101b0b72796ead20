/* coordinator/cluster_wait.c: what a waiting cluster says (cluster.h,
 * "k3_cluster_open", "k3_cluster_wait_ready").
 *
 * Owns nothing: reads the stages of a cluster while the caller holds
 * c->mu. Called by the thread that waits in k3_cluster_open or
 * k3_cluster_wait_ready, every K3_CLUSTER_WAIT_LOG_MS, so a coordinator
 * whose --workers name an endpoint nobody answers on says whom it waits
 * for, how long it has, and when it gives up, instead of going silent.
 */
#include "coordinator/cluster_impl.h"

#include "common/base/log.h"

void cl_wait_log(const k3_cluster *c, double waited_ms, double left_ms, const char *deadline_opt) {
    for (int i = 0; i < c->n; i++) {
        const cl_stage *s = &c->st[i];
        if (s->state == LINK_READY) continue;
        char layers[48];
        if (s->a >= 0) /* it served before: the range it had */
            cl_fmt(layers, sizeof layers, "%d-%d", s->a, s->b);
        else if (!c->o.n_workers) /* --local: the even split cl_local_start gave it */
            cl_fmt(layers, sizeof layers, "%d-%d", (int)((long)i * c->cfg.n_layers / c->n),
                   (int)((long)(i + 1) * c->cfg.n_layers / c->n));
        else
            cl_fmt(layers, sizeof layers, "? (not known before it answers)");
        K3_WARN("cluster: waiting for worker %d (%s), layers %s: no answer for %.0fs%s%s; "
                "giving up in %.0fs (%s)",
                i, s->endpoint, layers, waited_ms / 1000.0, s->last_err[0] ? ", last: " : "",
                s->last_err, left_ms > 0 ? left_ms / 1000.0 : 0.0, deadline_opt);
    }
}
