/* worker/xstripe.h: cross-worker expert striping (docs/CLUSTER.md "Expert
 * striping", docs/PROTOCOL.md "Expert calls").
 *
 * A worker started with --stripe-drives serves the routed experts of those
 * placement drives for EVERY MoE layer of the model (its expert store spans
 * all layers and opens only those drives' files), on its own endpoint
 * (--expert-listen). The MoE layers of its own stage send the experts of
 * the other drives to their workers (--stripe-peers D=ENDPOINT,...) as
 * EXPERT_CALL, compute their own meanwhile, and gather the unsummed
 * per-(row, expert) outputs; common/layers/moe.c sums them in expert-id
 * order, so the bits equal the in-process run's.
 *
 * Owns: a ZeroMQ context; the server thread with its ROUTER socket, its own
 * compute pool and scratch (so a call is served while the stage thread of
 * the same worker computes or waits on a call of its own: no deadlock,
 * whatever the order); one DEALER per peer drive (connected on first use,
 * dropped after a timeout so a late answer is never read as a new one); the
 * k3_moe_remote the model's stage calls; counters.
 * Borrows: the model (its expert store and placement), the tick callback.
 * Threads: the k3_moe_remote functions run on the stage thread (one MoE
 * step at a time); the server thread runs from open to close; stats are
 * read under a mutex from any thread.
 */
#ifndef K3_WORKER_XSTRIPE_H
#define K3_WORKER_XSTRIPE_H

#include <stdatomic.h>
#include <stdint.h>

#include "common/base/limits.h"
#include "common/engine/model.h"
#include "proto/link.h"

/* Bit set in a drive mask (k3_model_opts.expert_drive_mask) when the
 * worker runs cross-worker striping: the set of drives it reads may then be
 * empty (a stage that only calls), which a plain 0 ("all") cannot say. */
#define WK_XSTRIPE_MARK (1u << 31)

typedef struct wk_xstripe_opts {
    const char *listen;      /* expert endpoint, NULL when own is empty */
    uint32_t own;            /* placement drives this worker reads and serves (bits) */
    char *peer[K3_MAX_DIRS]; /* endpoint of each other drive's worker, NULL = none */
    k3_link_sockopts sock;   /* heartbeats: a call unanswered for TTL = 3 x hb_ms fails */
    int threads;             /* the server's compute pool */
    /* CURVE (the worker's --curve-secret): the expert endpoint is a CURVE
     * server with kp behind allow (peer workers' public keys, --stripe-allow)
     * and each call a CURVE client of the peer's key in keys_path
     * (--stripe-keys: "ENDPOINT KEY" lines, or "* KEY") */
    int curve;
    const k3_curve_keypair *kp;   /* borrowed */
    const k3_allow_list *allow;   /* borrowed */
    const char *keys_path;        /* borrowed */
    char name[K3_PROTO_MAX_NAME]; /* for logs and errors */
} wk_xstripe_opts;

/* "0,2" into a mask; "none" = empty. Refuses a drive >= K3_MAX_DIRS or
 * given twice, naming it. */
k3_status wk_xstripe_parse_drives(const char *s, uint32_t *mask, char *err, size_t errlen);
/* "1=ipc:///tmp/x1,3=tcp://h:27201" into o->peer (strdup'ed). Refuses a
 * drive claimed twice (by two peers, or by a peer and o->own), naming the
 * drive and both claimants. */
k3_status wk_xstripe_parse_peers(const char *s, wk_xstripe_opts *o, char *err, size_t errlen);
/* Every drive of a placement with n_drives has exactly one worker (own or
 * a peer), and none beyond n_drives is named; with CURVE, every peer has a
 * key in keys_path and a serving worker has an allow list. */
k3_status wk_xstripe_check(const wk_xstripe_opts *o, int n_drives, const char *placement, char *err,
                           size_t errlen);
void wk_xstripe_opts_free(wk_xstripe_opts *o);

typedef struct wk_xstripe wk_xstripe;

/* Binds the expert endpoint (when o->listen), starts the server thread and
 * installs the k3_moe_remote in m. o is copied (peer strings borrowed until
 * close). */
k3_status wk_xstripe_open(wk_xstripe **out, k3_model *m, const wk_xstripe_opts *o, char *err,
                          size_t errlen);
/* While the stage waits on a call: tick(ctx) at least every hb_ms / 2
 * (the worker's HEARTBEAT to its coordinator), and *cancel nonzero gives
 * up the wait (K3_ERR_CANCEL). epoch is stamped on the calls (the link
 * epoch of the step, informational). */
void wk_xstripe_set_tick(wk_xstripe *x, void (*tick)(void *), void *ctx, atomic_int *cancel);
void wk_xstripe_set_epoch(wk_xstripe *x, uint64_t epoch);
/* Stops the server thread, closes the sockets, uninstalls the remote. */
void wk_xstripe_close(wk_xstripe **x, k3_model *m);

typedef struct wk_xstripe_stats {
    /* caller side (the stage's MoE layers) */
    uint64_t layers_called; /* MoE layer steps that called at least one peer */
    uint64_t calls;         /* EXPERT_CALLs sent */
    uint64_t pairs_remote;  /* (row, expert) outputs gathered */
    double gather_wait_ms;  /* time finish() waited for answers, all layers */
    double call_rtt_ms;     /* answered calls: send to answer, summed */
    double peer_compute_ms; /* their EXPERT_DONE compute_ms (the peer's time on them) */
    double peer_read_ms;    /* their EXPERT_DONE read_ms (the peer's wait on its drive) */
    /* server side (calls served for other stages) */
    uint64_t served;        /* EXPERT_CALLs answered EXPERT_DONE */
    uint64_t served_errors; /* answered ERROR */
    uint64_t served_bytes;  /* expert bytes read for them */
    uint64_t served_hits, served_misses;
    double served_ms;       /* time computing them (read waits included) */
    double served_read_ms;  /* of it, waiting on expert reads */
    double served_queue_ms; /* waiting in the queue behind other calls, before that */
} wk_xstripe_stats;
void wk_xstripe_get_stats(wk_xstripe *x, wk_xstripe_stats *out);

/* What one FORWARD_DONE reports of striping (its 1.2 stats keys): the
 * bytes each placement drive gave this worker (k3_experts_drive_bytes:
 * calls it served for other stages meanwhile included) and the waits on
 * stripe peers, as the difference of two snapshots around the step. */
typedef struct wk_drive_snap {
    int n_drives; /* the store's drives (1 without a placement) */
    uint64_t bytes[K3_MAX_DIRS];
    double gather_ms;
    uint64_t gather_layers;
} wk_drive_snap;
void wk_drive_snapshot(k3_model *m, wk_xstripe *x, wk_drive_snap *out);
struct proto_forward_done;
void wk_drive_delta(const wk_drive_snap *a, const wk_drive_snap *b, struct proto_forward_done *o);

#endif
