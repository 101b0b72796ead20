/* coordinator/cmd_place.h: `k3-coordinator place`: stripe the routed experts
 * over drives (docs/CLUSTER.md "Expert striping").
 *
 *   k3-coordinator place --model DIR [--plan PLAN.json] [--drives D1,D2,...]
 *                        [--weights W1,W2,...] [--dirs S1,S2,...] [--out FILE] [--copy]
 *                        [--split [--align BYTES]]
 *
 * Builds a placement (common/experts/placement.h) from the drives' shares
 * (a plan file's "share", or --weights, or equal) and the usage history,
 * lays the expert bytes out on the drives (D/k3-stripe/<shard>: a hard link
 * to the shard where the drive is on the shard's file system, else a
 * sparse copy holding only that drive's experts), verifies the sizes and
 * writes the placement file. Resumable: a shard file is written as .tmp
 * and renamed when complete, and a complete one whose record matches is
 * kept. Exit status: 0 done, 1 error (message on stderr), 2 usage.
 */
#ifndef K3_CMD_PLACE_H
#define K3_CMD_PLACE_H

#include <stdint.h>

#include "common/base/err.h"

typedef struct k3_place_req {
    const char *model;             /* checkpoint directory */
    const char *const *shard_dirs; /* [n_shard_dirs] extra shard directories of model (the
                                      engine's --dirs), NULL = none */
    int n_shard_dirs;
    const char *const *drives; /* [n_drives] directories (created when missing) */
    int n_drives;
    const double *weight; /* [n_drives] shares or speeds, NULL = equal */
    const char *usage;    /* usage history file, NULL = none */
    double topp;          /* K3_TOPP (part of the model fingerprint) */
    int max_layers;       /* K3_LAYERS (part of the config the fingerprint covers) */
    const char *out;      /* placement file to write */
    int force_copy;       /* 1: copy even where a hard link would do */
    int layer_a, layer_b; /* lay out only the experts of layers [layer_a, layer_b) (a host
                             holding one worker's shards); 0, 0 = every layer. The placement
                             file still places every MoE layer */
    int progress;         /* 1: progress on stderr */
    int split;            /* 1: byte-split placement (every expert over every drive) */
    uint64_t align;       /* split: cut alignment, 0 = 4096 */
} k3_place_req;

/* Builds the placement, lays the bytes out, writes req->out. */
k3_status k3_place_layout(const k3_place_req *req, char *err, size_t errlen);

/* `--stripe` (k3-coordinator's in-process run and --local N): lays the
 * experts out over eng->dirs with equal weights and no usage history (so
 * that reruns find the layout complete), writes
 * <dirs[0]>/k3-stripe/placement.json and points eng->placement at it
 * (owned by eng). Refused without --dirs or with --placement. split: a
 * byte-split placement (--split). */
struct k3_engine_opts;
k3_status k3_place_stripe_dirs(struct k3_engine_opts *eng, int split, char *err, size_t errlen);

/* Drive paths (*paths[*n], malloc'd each and the array; the caller frees)
 * and shares (w[K3_MAX_DIRS]) from a plan file (k3-coordinator plan's
 * format); checks its format, version and, when it names one, that its
 * model fingerprint is fp. */
k3_status k3_place_read_plan(const char *path, uint64_t fp, char ***paths, double *w, int *n,
                             char *err, size_t errlen);

int cmd_place(int argc, char **argv);

#endif
