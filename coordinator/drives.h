/* coordinator/drives.h: what a drive (a directory on one) offers the
 * engine, measured: O_DIRECT support, free space, sequential and 17.5 MB
 * random O_DIRECT read GB/s, and its NUMA node (docs/DEPLOY.md
 * "Workstation"). Used by `doctor` and `plan`.
 *
 * Owns: the probe file <dir>/.k3_probe (written once when the directory
 * holds no file of at least K3_DRIVE_PROBE_MIN bytes to read) and the cache
 * of measurements <dir>/.k3_drive.json (reused while the device is the same
 * and the measurement younger than K3_DRIVE_CACHE_S).
 * Borrows: nothing. Threads: one caller at a time (main thread of a tool).
 */
#ifndef K3_DRIVES_H
#define K3_DRIVES_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/base/opts.h"

#define K3_DRIVE_PROBE_BYTES                                                                       \
    (256ull << 20)                        /* probe file: 256 MiB (at most half the free            \
                                             space), a few s at 100 MB/s */
#define K3_DRIVE_PROBE_MIN  (64ull << 20) /* an existing file this big is read instead */
#define K3_DRIVE_RAND_BYTES 17547264ull   /* one K3 expert slot, 4096-aligned */
#define K3_DRIVE_CACHE_S    (7 * 86400)   /* a measurement is trusted for a week */

typedef struct k3_drive {
    char path[1024];
    char dev[64]; /* block device name ("nvme0n1p1", "loop3"), "" unknown */
    unsigned dev_major, dev_minor;
    int numa;            /* NUMA node of the device, -1 unknown (loop, virtual) */
    int o_direct;        /* 1: an O_DIRECT open and aligned read worked */
    uint64_t free_bytes; /* statvfs f_bavail * f_frsize */
    uint64_t size_bytes; /* file system size */
    double seq_gbs;      /* sequential O_DIRECT read, 4 MiB requests; 0 = not measured */
    double rand_gbs;     /* K3_DRIVE_RAND_BYTES O_DIRECT reads at random offsets */
    int from_cache;      /* the GB/s came from .k3_drive.json */
    char note[256];      /* why o_direct or the measurement failed, "" when fine */
} k3_drive;

/* Fills d for the directory path: device, NUMA node, free space, O_DIRECT.
 * With measure, also the read speeds: from the cache when valid and not
 * remeasure, else ~seconds of sequential then ~seconds of random reads
 * (written back to the cache). K3_ERR_MISSING / K3_ERR_ARG when path is
 * not an existing directory; other problems are recorded in d->note with
 * K3_OK, so a caller can report every drive. */
k3_status k3_drive_probe(k3_drive *d, const char *path, int measure, int remeasure, double seconds,
                         char *err, size_t errlen);

/* Number of NUMA nodes of this machine (hwloc), >= 1. */
int k3_numa_nodes(void);

/* MemAvailable of /proc/meminfo in bytes, 0 when unreadable. */
uint64_t k3_mem_available(void);

/* The option rows doctor and plan share (common/base/opts.h): --model,
 * --drives, --seconds, --remeasure into fields of the program's struct T. */
// clang-format off
#define K3_DRIVE_OPT_ROWS(T, model_f, drives_f, seconds_f, remeasure_f, model_help)               \
    {.name = "model", .flag = "--model", .env = "K3_MODEL", .type = K3_OPT_STRING,                \
     .offset = offsetof(T, model_f), .metavar = "DIR", .help = model_help},                       \
    {.name = "drives", .flag = "--drives", .type = K3_OPT_LIST, .offset = offsetof(T, drives_f),  \
     .max = K3_MAX_DIRS, .metavar = "D1,D2",                                                      \
     .help = "drive directories (O_DIRECT, free space, read GB/s, NUMA node)"},                   \
    {.name = "seconds", .flag = "--seconds", .type = K3_OPT_DOUBLE, .offset = offsetof(T, seconds_f), \
     .def = "2", .min = 0.1, .max = 60, .metavar = "S",                                           \
     .help = "seconds of each drive read measurement (cached in the drive's .k3_drive.json)"},    \
    {.name = "remeasure", .flag = "--remeasure", .type = K3_OPT_BOOL,                             \
     .offset = offsetof(T, remeasure_f), .def = "0",                                              \
     .help = "measure the drives again instead of using their cached figures"}
// clang-format on

#endif
