/* worker/host.h: what a worker learns about and does to its machine before
 * it serves: NUMA pinning with hwloc and a quick read benchmark of the drive
 * that holds its shards (reported in HELLO_OK as read GB/s).
 *
 * Owns: nothing after the calls return (the hwloc topology is freed).
 * Borrows: the model directory and shard directories (read only).
 * Threads: call from main() before the worker's threads start, so that the
 * compute pool inherits the CPU binding and allocates on the bound node.
 *
 * Failure policy (docs/TESTING.md B7): pinning errors are returned to main(),
 * which warns and continues unpinned; results do not depend on pinning.
 */
#ifndef K3_WORKER_HOST_H
#define K3_WORKER_HOST_H

#include <stddef.h>

#include "common/base/err.h"

/* Binds the process's CPUs to NUMA node `node` (hwloc logical index) and its
 * memory to that node (HWLOC_MEMBIND_BIND). desc receives e.g. "NUMA node 0:
 * cpus 0-15". */
k3_status wk_pin_numa(int node, char *desc, size_t desclen, char *err, size_t errlen);

/* The NUMA node (hwloc logical index, as wk_pin_numa takes) of the drive
 * holding `path`: the block device of its file system (st_dev) is looked
 * up under <sysfs>/dev/block/MAJ:MIN, and the nearest "numa_node" file on
 * that device's path (the PCI function of an NVMe or SATA controller) gives
 * the kernel's node. *node = -1 and a reason in `why` when the kernel does
 * not know (virtual or loop devices, one-node machines report -1); that is
 * not an error. Errors: the path cannot be stat'ed. sysfs: "/sys" (tests
 * pass a fake tree). */
k3_status wk_drive_numa(const char *path, const char *sysfs, int *node, char *why, size_t whylen,
                        char *err, size_t errlen);

/* Path of the shard holding layer `layer` (its input norm or first expert,
 * under either name prefix), through the index: no shard is opened. */
k3_status wk_layer_shard(const char *model_dir, const char *const *dirs, int n_dirs, int layer,
                         char *path, size_t pathlen, char *err, size_t errlen);

/* Reads up to max_bytes from the start of the shard files that hold layers
 * [layer_a, layer_b) (found through the index, so no other shard is ever
 * opened) with O_DIRECT (buffered when the file system refuses O_DIRECT,
 * e.g. tmpfs; *direct_used says which) and returns the rate in GB/s. */
k3_status wk_bench_read(const char *model_dir, const char *const *dirs, int n_dirs, int layer_a,
                        int layer_b, size_t max_bytes, double *gbps, size_t *bytes_read,
                        int *direct_used, char *err, size_t errlen);

/* The expert stripe of layers [layer_a, layer_b) under the placement file
 * (k3-coordinator place) as "DRIVE:PCT%,DRIVE:PCT%": each drive's share of
 * those layers' experts, what STATS_OK's "stripe" reports. A placement
 * that cannot be read leaves buf "" (the model load names the problem). */
void wk_stripe_desc(const char *placement, int layer_a, int layer_b, char *buf, size_t len);

#endif
