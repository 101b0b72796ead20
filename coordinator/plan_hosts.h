/* coordinator/plan_hosts.h: what `k3-coordinator plan` reads besides the
 * model: the hosts file of a multi-host plan (--hosts), one host's own
 * description (--describe, what each host contributes to that file), and
 * which shard files hold each layer (the files a worker needs).
 *
 * Owns: the arrays it returns (freed with free()). Borrows: nothing.
 * Threads: one caller at a time.
 *
 * The hosts file (docs/DEPLOY.md "Small cluster", JSON; the cluster
 * playbook writes it from the inventory and each host's --describe):
 *   {"format": "k3shard-hosts", "version": 1,
 *    "hosts": [{"name": "node1", "addr": "10.0.0.2", "port": 5555,
 *               "ram_gb": 250, "rtt_ms": 0.2,
 *               "drives": [{"path": "/mnt/nvme0", "numa": 0,
 *                           "seq_gbs": 3.1, "rand_gbs": 2.6}, ...]}, ...]}
 * name and drives[].path are required; addr (default: the name), port
 * (default 5555: the host's worker k listens on port + k), numa (-1
 * unknown), rtt_ms (the coordinator's round trip to the host, default 0)
 * and ram_gb (default: plan's --ram) are optional. A drive without
 * rand_gbs is measured here when its path exists on this machine, else
 * refused naming the host and drive. JSON rather than the Ansible YAML
 * inventory itself: the planner runs on the control node, which cannot
 * measure another host's drives, and only Ansible knows an inventory's
 * group and variable rules; the playbook has both and writes this file.
 */
#ifndef K3_PLAN_HOSTS_H
#define K3_PLAN_HOSTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"

#define K3_PLAN_HOSTS_FORMAT "k3shard-hosts"
#define K3_PLAN_HOST_FORMAT  "k3shard-host" /* one host's --describe */
#define K3_PLAN_DEFAULT_PORT 5555

typedef struct plan_host {
    char name[128];
    char addr[K3_MAX_ENDPOINT];
    int port;      /* worker k of the host listens on port + k */
    double ram_gb; /* RAM for weights and caches, 0 = plan's --ram */
    double rtt_ms; /* coordinator round trip */
} plan_host;

typedef struct plan_drive {
    char path[1024];
    int host; /* index into the hosts */
    int numa; /* -1 unknown */
    double seq_gbs, rand_gbs;
    int from_cache; /* measured here, figures from .k3_drive.json */
} plan_drive;

/* Reads and validates the hosts file (size <= K3_MAX_HOSTS_FILE, at most
 * K3_MAX_HOSTS hosts and K3_MAX_DIRS drives each, names unique, speeds
 * > 0); measures drives without rand_gbs that exist here (seconds each,
 * remeasure as k3_drive_probe). */
k3_status plan_hosts_read(const char *path, double seconds, int remeasure, plan_host **hosts,
                          int *n_hosts, plan_drive **drives, int *n_drives, char *err,
                          size_t errlen);

/* The shard files of a model directory by layer: for each layer l, bit f
 * of files[l * n_files + f] set when file f holds a tensor of layer l
 * (model.layers.<l>. in its index, vision tensors excepted), global[f]
 * when it holds anything else or is a non-shard file of the directory (the
 * config, index, tokenizer: every host gets those). names[f], sizes[f]:
 * the file's name and size. Dot files (run state) are left out. */
typedef struct plan_files {
    int n_files, n_layers;
    char (*names)[256];
    uint64_t *sizes;
    uint8_t *layer_has; /* [n_layers][n_files] */
    uint8_t *global;    /* [n_files] */
} plan_files;

k3_status plan_files_read(plan_files *pf, const char *model_dir, int n_layers, char *err,
                          size_t errlen);
void plan_files_free(plan_files *pf);

#endif
