/* coordinator/drives.c: drive probing for doctor and plan (drives.h). */
#include "coordinator/drives.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hwloc.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "common/base/log.h"

#define ALIGN   4096
#define SEQ_REQ (4u << 20) /* sequential request size */

uint64_t k3_mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char key[64];
    unsigned long long kb = 0, v;
    while (fscanf(f, "%63s %llu kB\n", key, &v) == 2)
        if (!strcmp(key, "MemAvailable:")) kb = v;
    fclose(f);
    return (uint64_t)kb * 1024;
}

int k3_numa_nodes(void) {
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) != 0) return 1;
    int n = 1;
    if (hwloc_topology_load(topo) == 0) {
        n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
        if (n < 1) n = 1;
    }
    hwloc_topology_destroy(topo);
    return n;
}

/* The device of the file system holding path, and its NUMA node from sysfs
 * (the block device or a parent: a partition's disk, the disk's PCI device). */
static void find_device(k3_drive *d, dev_t dev) {
    d->dev_major = major(dev);
    d->dev_minor = minor(dev);
    d->numa = -1;
    char link[64], real[PATH_MAX];
    snprintf(link, sizeof link, "/sys/dev/block/%u:%u", d->dev_major, d->dev_minor);
    if (!realpath(link, real)) return;
    const char *b = strrchr(real, '/');
    const char *nm = b ? b + 1 : real;
    size_t l = strlen(nm) < sizeof d->dev - 1 ? strlen(nm) : sizeof d->dev - 1;
    memcpy(d->dev, nm, l);
    d->dev[l] = 0;
    for (;;) {
        static const char *const rel[] = {"/device/numa_node", "/numa_node"};
        for (int k = 0; k < 2; k++) {
            char p[PATH_MAX + 32];
            snprintf(p, sizeof p, "%s%s", real, rel[k]);
            FILE *f = fopen(p, "r");
            if (!f) continue;
            int v = -1;
            if (fscanf(f, "%d", &v) == 1 && v >= 0) d->numa = v;
            fclose(f);
            if (d->numa >= 0) return;
        }
        char *s = strrchr(real, '/');
        if (!s || s == real || strlen(real) <= strlen("/sys/devices")) return;
        *s = 0;
    }
}

/* A file of at least K3_DRIVE_PROBE_MIN bytes in dir (the largest), or "". */
static void largest_file(const char *dir, char *out, size_t n, uint64_t *size) {
    out[0] = 0;
    *size = 0;
    DIR *dp = opendir(dir);
    if (!dp) return;
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == '.' && strcmp(e->d_name, ".k3_probe")) continue;
        char p[2048];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > *size &&
            (uint64_t)sb.st_size >= K3_DRIVE_PROBE_MIN) {
            *size = (uint64_t)sb.st_size;
            snprintf(out, n, "%s", p);
        }
    }
    closedir(dp);
}

/* Writes <dir>/.k3_probe (K3_DRIVE_PROBE_BYTES of non-zero bytes, so no
 * file system can store it sparse). */
static int write_probe(const char *dir, uint64_t bytes, char *path, size_t n, char *note,
                       size_t nl) {
    snprintf(path, n, "%s/.k3_probe", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(note, nl, "cannot write the probe file %.160s: %s", path, strerror(errno));
        return -1;
    }
    unsigned char *buf = malloc(SEQ_REQ);
    if (!buf) {
        snprintf(note, nl, "no memory for the probe's %d-byte buffer", (int)SEQ_REQ);
        close(fd);
        return -1;
    }
    for (size_t i = 0; i < SEQ_REQ; i++) buf[i] = (unsigned char)(i * 131u + 7u);
    int rc = 0;
    for (uint64_t w = 0; w < bytes && !rc; w += SEQ_REQ)
        if (write(fd, buf, SEQ_REQ) != (ssize_t)SEQ_REQ) {
            snprintf(note, nl, "writing the probe file %.160s: %s", path, strerror(errno));
            rc = -1;
        }
    if (!rc) (void)fsync(fd);
    close(fd);
    free(buf);
    if (rc) unlink(path);
    return rc;
}

/* ~seconds of O_DIRECT reads of `req` bytes (sequential or at random
 * aligned offsets) from path; GB/s, or 0 with a note. */
static double timed_reads(const char *path, uint64_t size, size_t req, int random, double seconds,
                          char *note, size_t nl) {
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        snprintf(note, nl, "O_DIRECT open of %s: %s", path, strerror(errno));
        return 0;
    }
    void *buf = NULL;
    if (posix_memalign(&buf, ALIGN, req) != 0) {
        close(fd);
        return 0;
    }
    uint64_t span = size / ALIGN * ALIGN, got = 0, off = 0;
    unsigned seed = 12345u;
    double t0 = k3_now_s(), el = 0;
    while (el < seconds && span >= req) {
        if (random) {
            seed = seed * 1103515245u + 12345u;
            uint64_t slots = (span - req) / ALIGN + 1;
            off = ((uint64_t)seed * 2654435761u % slots) * ALIGN;
        } else if (off + req > span) {
            off = 0;
        }
        ssize_t r = pread(fd, buf, req, (off_t)off);
        if (r <= 0) {
            snprintf(note, nl, "O_DIRECT read of %s at %llu: %s", path, (unsigned long long)off,
                     r < 0 ? strerror(errno) : "end of file");
            break;
        }
        got += (uint64_t)r;
        if (!random) off += (uint64_t)r;
        el = k3_now_s() - t0;
    }
    free(buf);
    close(fd);
    return el > 0 && got ? (double)got / el / 1e9 : 0;
}

static int load_cache(k3_drive *d) {
    char p[1100];
    snprintf(p, sizeof p, "%s/.k3_drive.json", d->path);
    json_error_t je;
    json_t *j = json_load_file(p, 0, &je);
    if (!j) return 0;
    int ok = 0;
    double at = json_number_value(json_object_get(j, "measured_at"));
    const char *dev = json_string_value(json_object_get(j, "device"));
    char want[32];
    snprintf(want, sizeof want, "%u:%u", d->dev_major, d->dev_minor);
    if (dev && !strcmp(dev, want) && (double)time(NULL) - at < K3_DRIVE_CACHE_S && at > 0) {
        d->seq_gbs = json_number_value(json_object_get(j, "seq_gbs"));
        d->rand_gbs = json_number_value(json_object_get(j, "rand_gbs"));
        ok = d->seq_gbs > 0 && d->rand_gbs > 0;
    }
    json_decref(j);
    return ok;
}

static void save_cache(const k3_drive *d) {
    char p[1100], dev[32];
    snprintf(p, sizeof p, "%s/.k3_drive.json", d->path);
    snprintf(dev, sizeof dev, "%u:%u", d->dev_major, d->dev_minor);
    json_t *j = json_pack("{s:s, s:s, s:f, s:f, s:f, s:i}", "format", "k3shard-drive", "device",
                          dev, "seq_gbs", d->seq_gbs, "rand_gbs", d->rand_gbs, "measured_at",
                          (double)time(NULL), "rand_request_bytes", (int)K3_DRIVE_RAND_BYTES);
    if (j) {
        (void)json_dump_file(j, p, JSON_INDENT(2) | JSON_SORT_KEYS);
        json_decref(j);
    }
}

k3_status k3_drive_probe(k3_drive *d, const char *path, int measure, int remeasure, double seconds,
                         char *err, size_t errlen) {
    memset(d, 0, sizeof *d);
    snprintf(d->path, sizeof d->path, "%s", path);
    d->numa = -1;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return k3_errf(K3_ERR_MISSING, err, errlen, "drive %s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return k3_errf(K3_ERR_ARG, err, errlen, "drive %s: not a directory", path);
    find_device(d, sb.st_dev);
    struct statvfs vs;
    if (statvfs(path, &vs) == 0) {
        d->free_bytes = (uint64_t)vs.f_bavail * vs.f_frsize;
        d->size_bytes = (uint64_t)vs.f_blocks * vs.f_frsize;
    }
    char file[2048];
    uint64_t fsize;
    largest_file(path, file, sizeof file, &fsize);
    /* O_DIRECT: an aligned read of a file there (a 4 KiB test file when
     * the directory holds none yet) */
    char test[2048] = "";
    if (!file[0]) {
        snprintf(test, sizeof test, "%s/.k3_odirect", path);
        int tf = open(test, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        char page[ALIGN];
        memset(page, 0x5a, sizeof page);
        int wok = tf >= 0 && write(tf, page, sizeof page) == (ssize_t)sizeof page && fsync(tf) == 0;
        if (tf >= 0) close(tf);
        if (!wok) {
            snprintf(d->note, sizeof d->note, "cannot write a test file in %s: %s", path,
                     strerror(errno));
            unlink(test);
            return K3_OK;
        }
    }
    const char *probe = file[0] ? file : test;
    int fd = open(probe, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        snprintf(d->note, sizeof d->note, "O_DIRECT open: %s", strerror(errno));
    } else {
        d->o_direct = 1;
        void *buf = NULL;
        if (posix_memalign(&buf, ALIGN, ALIGN) == 0 && pread(fd, buf, ALIGN, 0) != ALIGN) {
            d->o_direct = 0;
            snprintf(d->note, sizeof d->note, "O_DIRECT read: %s", strerror(errno));
        }
        free(buf);
        close(fd);
    }
    if (test[0]) unlink(test);
    if (!measure || !d->o_direct) return K3_OK;
    if (!remeasure && load_cache(d)) {
        d->from_cache = 1;
        return K3_OK;
    }
    if (!file[0]) {
        /* at most half the free space, in whole requests */
        uint64_t pb = d->free_bytes / 2 / SEQ_REQ * SEQ_REQ;
        if (pb > K3_DRIVE_PROBE_BYTES) pb = K3_DRIVE_PROBE_BYTES;
        if (pb < 2 * K3_DRIVE_RAND_BYTES) {
            snprintf(d->note, sizeof d->note,
                     "%.1f MB free: too little for a %.0f MB probe file to measure reads",
                     (double)d->free_bytes / 1e6, 2 * K3_DRIVE_RAND_BYTES / 1e6);
            return K3_OK;
        }
        if (write_probe(path, pb, file, sizeof file, d->note, sizeof d->note) != 0) return K3_OK;
        fsize = pb;
        /* the probe was just written: drop its pages so reads hit the drive
         * (O_DIRECT bypasses the cache anyway; this keeps RAM free) */
        int pf = open(file, O_RDONLY | O_CLOEXEC);
        if (pf >= 0) {
            (void)posix_fadvise(pf, 0, 0, POSIX_FADV_DONTNEED);
            close(pf);
        }
    }
    d->seq_gbs = timed_reads(file, fsize, SEQ_REQ, 0, seconds, d->note, sizeof d->note);
    d->rand_gbs =
        timed_reads(file, fsize, K3_DRIVE_RAND_BYTES, 1, seconds, d->note, sizeof d->note);
    if (d->seq_gbs > 0 && d->rand_gbs > 0) save_cache(d);
    return K3_OK;
}
