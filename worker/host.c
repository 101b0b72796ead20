/* worker/host.c: NUMA pinning (hwloc) and the drive read benchmark
 * (host.h). */
#include "worker/host.h"

#include <errno.h>
#include <fcntl.h>
#include <hwloc.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/ckpt/safetensors.h"
#include "common/experts/placement.h"

k3_status wk_pin_numa(int node, char *desc, size_t desclen, char *err, size_t errlen) {
    if (desc && desclen) desc[0] = 0;
    if (node < 0) return k3_errf(K3_ERR_ARG, err, errlen, "NUMA node %d is negative", node);
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) != 0)
        return k3_errf(K3_ERR_INTERNAL, err, errlen, "hwloc: cannot initialise a topology");
    k3_status st = K3_OK;
    if (hwloc_topology_load(topo) != 0) {
        st =
            k3_errf(K3_ERR_IO, err, errlen, "hwloc: cannot load the topology: %s", strerror(errno));
        goto out;
    }
    int n_nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    hwloc_obj_t obj = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, (unsigned)node);
    if (!obj) {
        st = k3_errf(K3_ERR_ARG, err, errlen, "NUMA node %d does not exist (this machine has %d)",
                     node, n_nodes);
        goto out;
    }
    if (hwloc_set_cpubind(topo, obj->cpuset, HWLOC_CPUBIND_PROCESS) != 0) {
        st = k3_errf(K3_ERR_IO, err, errlen, "hwloc: binding CPUs to NUMA node %d: %s", node,
                     strerror(errno));
        goto out;
    }
    /* Memory: every later allocation of the process comes from this node. */
    if (hwloc_set_membind(topo, obj->nodeset, HWLOC_MEMBIND_BIND,
                          HWLOC_MEMBIND_PROCESS | HWLOC_MEMBIND_BYNODESET) != 0) {
        st = k3_errf(K3_ERR_IO, err, errlen,
                     "hwloc: binding memory to NUMA node %d: %s (CPUs are bound)", node,
                     strerror(errno));
        goto out;
    }
    if (desc && desclen) {
        char cpus[256];
        hwloc_bitmap_list_snprintf(cpus, sizeof cpus, obj->cpuset);
        snprintf(desc, desclen, "NUMA node %d of %d: cpus %s, memory bound", node, n_nodes, cpus);
    }
out:
    hwloc_topology_destroy(topo);
    return st;
}

/* ---- the shards of a layer ---- */

/* Marks in mine[] (n_shards entries) the shards holding tensors every
 * layer l has (its input norm, its first expert), under both name
 * prefixes; through the index only, so no shard is opened. */
static k3_status layer_shards(st_index *idx, int l, unsigned char *mine, int n_shards, char *err,
                              size_t errlen) {
    static const char *const prefixes[2] = {"language_model.", ""};
    static const char *const suffixes[2] = {"input_layernorm.weight",
                                            "block_sparse_moe.experts.0.w1.weight_packed"};
    k3_status st = K3_OK;
    for (int p = 0; p < 2 && !st; p++)
        for (int s = 0; s < 2 && !st; s++) {
            char name[K3_ST_MAX_NAME];
            snprintf(name, sizeof name, "%smodel.layers.%d.%s", prefixes[p], l, suffixes[s]);
            const st_tensor *t = NULL;
            st = st_find_opt(idx, name, &t, err, errlen);
            if (!st && t && t->shard >= 0 && t->shard < n_shards) mine[t->shard] = 1;
        }
    return st;
}

/* Opens the index of model_dir (+ dirs) and marks the shards of layers
 * [a, b) in *mine (n_shards entries, owned by the caller: free). */
static k3_status open_layer_shards(const char *model_dir, const char *const *dirs, int n_dirs,
                                   int a, int b, st_index **idx, unsigned char **mine,
                                   int *n_shards, char *err, size_t errlen) {
    *idx = NULL;
    *mine = NULL;
    st_open_opts so = {model_dir, dirs, n_dirs};
    k3_status st = st_open(idx, &so, err, errlen);
    if (st) return st;
    *n_shards = st_shard_count(*idx);
    *mine = k3_xcalloc((size_t)(*n_shards > 0 ? *n_shards : 1), 1);
    for (int l = a; l < b && !st; l++) st = layer_shards(*idx, l, *mine, *n_shards, err, errlen);
    return st;
}

/* ---- the drive's NUMA node ---- */

/* The kernel's node in the nearest numa_node file at or above dir (a sysfs
 * device directory), stopping at the sysfs root; -2 when there is none. */
static int numa_of_device_dir(const char *sysfs, char *dir) {
    size_t root = strlen(sysfs);
    for (;;) {
        char f[PATH_MAX + 16];
        snprintf(f, sizeof f, "%s/numa_node", dir);
        FILE *fp = fopen(f, "r");
        if (fp) {
            int v = -2;
            if (fscanf(fp, "%d", &v) != 1) v = -2;
            fclose(fp);
            if (v >= -1) return v;
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) <= root) return -2;
        *slash = 0;
    }
}

k3_status wk_drive_numa(const char *path, const char *sysfs, int *node, char *why, size_t whylen,
                        char *err, size_t errlen) {
    *node = -1;
    if (why && whylen) why[0] = 0;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    char link[PATH_MAX], dev[PATH_MAX];
    snprintf(link, sizeof link, "%s/dev/block/%u:%u", sysfs, major(sb.st_dev), minor(sb.st_dev));
    if (!realpath(link, dev)) {
        k3_errf(K3_OK, why, whylen, "%s: no block device (%s)", link, strerror(errno));
        return K3_OK;
    }
    char canon_root[PATH_MAX];
    if (!realpath(sysfs, canon_root)) snprintf(canon_root, sizeof canon_root, "%s", sysfs);
    int os = numa_of_device_dir(canon_root, dev);
    if (os < 0) {
        k3_errf(K3_OK, why, whylen, "block device %u:%u: the kernel reports no NUMA node",
                major(sb.st_dev), minor(sb.st_dev));
        return K3_OK;
    }
    /* the kernel's (OS) index -> hwloc's logical one */
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) {
        k3_errf(K3_OK, why, whylen, "hwloc: cannot load the topology");
        return K3_OK;
    }
    hwloc_obj_t obj = hwloc_get_numanode_obj_by_os_index(topo, (unsigned)os);
    if (obj)
        *node = (int)obj->logical_index;
    else
        k3_errf(K3_OK, why, whylen,
                "block device %u:%u is on NUMA node %d, which hwloc does not see", major(sb.st_dev),
                minor(sb.st_dev), os);
    hwloc_topology_destroy(topo);
    return K3_OK;
}

k3_status wk_layer_shard(const char *model_dir, const char *const *dirs, int n_dirs, int layer,
                         char *path, size_t pathlen, char *err, size_t errlen) {
    st_index *idx = NULL;
    unsigned char *mine = NULL;
    int n_shards = 0;
    k3_status st = open_layer_shards(model_dir, dirs, n_dirs, layer, layer + 1, &idx, &mine,
                                     &n_shards, err, errlen);
    if (st && !idx) return st;
    int first = -1;
    for (int s = 0; s < n_shards && first < 0; s++)
        if (mine[s]) first = s;
    if (!st && first < 0)
        st = k3_errf(K3_ERR_MISSING, err, errlen, "layer %d: no input_layernorm or expert tensor",
                     layer);
    if (!st) snprintf(path, pathlen, "%s", st_shard_path(idx, first));
    free(mine);
    st_close(&idx);
    return st;
}

#define BENCH_BLOCK (4u << 20) /* bytes per read: large enough to reach a drive's rate */

/* Reads [0, want) of path; returns bytes read (0 on an empty file) or -1. */
static long long read_file(const char *path, size_t want, void *buf, int *direct, char *err,
                           size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    *direct = fd >= 0;
    if (fd < 0 && errno == EINVAL) fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    if (!*direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); /* best effort: cold-ish */
    size_t done = 0;
    while (done < want) {
        size_t n = want - done < BENCH_BLOCK ? want - done : BENCH_BLOCK;
        /* O_DIRECT wants a 4096-multiple length: round up, the file end cuts it */
        size_t n_al = (n + 4095) & ~(size_t)4095;
        ssize_t r = pread(fd, buf, n_al, (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && *direct && errno == EINVAL) { /* fs accepted the flag but not the I/O */
            close(fd);
            fd = open(path, O_RDONLY | O_CLOEXEC);
            *direct = 0;
            if (fd < 0) break;
            continue;
        }
        if (r < 0) {
            k3_errf(K3_ERR_IO, err, errlen, "%s: read at %zu: %s", path, done, strerror(errno));
            if (fd >= 0) close(fd);
            return -1;
        }
        if (r == 0) break;
        done += (size_t)r;
    }
    if (fd >= 0) close(fd);
    return (long long)(done < want ? done : want);
}

k3_status wk_bench_read(const char *model_dir, const char *const *dirs, int n_dirs, int layer_a,
                        int layer_b, size_t max_bytes, double *gbps, size_t *bytes_read,
                        int *direct_used, char *err, size_t errlen) {
    *gbps = 0;
    *bytes_read = 0;
    *direct_used = 0;
    /* the shards of our layers (with an index.json only they are opened) */
    st_index *idx = NULL;
    unsigned char *mine = NULL;
    int n_shards = 0;
    k3_status st = open_layer_shards(model_dir, dirs, n_dirs, layer_a, layer_b, &idx, &mine,
                                     &n_shards, err, errlen);
    if (st && !idx) return st;
    void *buf = NULL;
    if (!st && posix_memalign(&buf, 4096, BENCH_BLOCK) != 0) {
        buf = NULL;
        st = k3_errf(K3_ERR_NOMEM, err, errlen, "bench: cannot allocate %u bytes", BENCH_BLOCK);
    }
    double t0 = k3_now_s();
    size_t total = 0;
    int all_direct = 1, any = 0;
    for (int s = 0; s < n_shards && !st && total < max_bytes; s++) {
        if (!mine[s]) continue;
        int direct = 0;
        long long got =
            read_file(st_shard_path(idx, s), max_bytes - total, buf, &direct, err, errlen);
        if (got < 0) {
            st = K3_ERR_IO;
            break;
        }
        any = 1;
        all_direct &= direct;
        total += (size_t)got;
    }
    double dt = k3_now_s() - t0;
    free(buf);
    free(mine);
    st_close(&idx);
    if (st) return st;
    if (!any)
        return k3_errf(K3_ERR_MISSING, err, errlen, "bench: no shard holds layers [%d, %d) in %s",
                       layer_a, layer_b, model_dir);
    *bytes_read = total;
    *direct_used = all_direct;
    *gbps = dt > 0 ? (double)total / dt / 1e9 : 0;
    return K3_OK;
}

void wk_stripe_desc(const char *placement, int layer_a, int layer_b, char *buf, size_t len) {
    buf[0] = 0;
    k3_placement *p = NULL;
    char err[256];
    if (!placement || k3_placement_load(&p, placement, err, sizeof err)) return;
    int nd = k3_placement_drives(p);
    double total = 0, per[K3_MAX_DIRS] = {0};
    for (int d = 0; d < nd && d < K3_MAX_DIRS; d++) {
        /* split: every expert on every drive, by weight */
        for (int l = layer_a; l < layer_b && !k3_placement_split(p); l++)
            per[d] += k3_placement_count(p, l, d);
        if (k3_placement_split(p)) per[d] = k3_placement_drive_weight(p, d);
        total += per[d];
    }
    size_t used = 0;
    for (int d = 0; d < nd && d < K3_MAX_DIRS && used + 1 < len; d++) {
        int n = snprintf(buf + used, len - used, "%s%s:%.0f%%", d ? "," : "",
                         k3_placement_drive_path(p, d), total > 0 ? 100.0 * per[d] / total : 0);
        if (n < 0) break;
        used += (size_t)n;
    }
    if (used >= len && len > 4) memcpy(buf + len - 4, "...", 4); /* cut: says so */
    k3_placement_free(&p);
}
