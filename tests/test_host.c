/* tests/test_host.c: what a worker learns about its machine (worker/host.h):
 * the NUMA node of the drive holding a shard, read through a fake sysfs tree
 * built here for the real st_dev of a file (a device directory with a
 * numa_node file above it, one with -1, a device without any, a missing
 * /dev/block link), and the shard path of a layer on the tiny checkpoint.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "tests/test.h"
#include "worker/host.h"

static char err[512], why[512];

static void mkdirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(buf, 0755);
            *p = '/';
        }
    mkdir(buf, 0755);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* <sys>/dev/block/MAJ:MIN -> <sys>/devices/<dev>; numa_node (if any) in
 * <sys>/devices/<numa_at>. */
static void fake_sysfs(const char *sys, dev_t d, const char *dev, const char *numa_at,
                       const char *numa) {
    char p[4096], q[4096];
    snprintf(p, sizeof p, "rm -rf '%s'", sys);
    if (system(p) != 0) return;
    snprintf(p, sizeof p, "%s/devices/%s", sys, dev);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/dev/block", sys);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/dev/block/%u:%u", sys, major(d), minor(d));
    snprintf(q, sizeof q, "../../devices/%s", dev);
    if (symlink(q, p) != 0) printf("# symlink %s: %s\n", p, strerror(errno));
    if (numa_at) {
        snprintf(p, sizeof p, "%s/devices/%s/numa_node", sys, numa_at);
        write_text(p, numa);
    }
}

static void test_drive_numa(void) {
    char dir[] = "/tmp/k3hostXXXXXX";
    if (!mkdtemp(dir)) {
        printf("not ok - mkdtemp: %s\n", strerror(errno));
        return;
    }
    char file[4200], sys[4200];
    snprintf(file, sizeof file, "%s/shard.safetensors", dir);
    snprintf(sys, sizeof sys, "%s/sys", dir);
    write_text(file, "x");
    struct stat sb;
    if (stat(file, &sb) != 0) {
        printf("not ok - stat %s\n", file);
        return;
    }
    const char *nvme = "pci0000:00/0000:00:01.0/nvme/nvme0/nvme0n1";
    int node = 7;

    /* numa_node on the PCI function, two levels above the block device */
    fake_sysfs(sys, sb.st_dev, nvme, "pci0000:00/0000:00:01.0", "0\n");
    k3_status st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == 0, "drive on node 0 (numa_node above the device): node %d %s",
          node, why);

    /* a node hwloc does not have on this machine: not pinned, the reason says so */
    fake_sysfs(sys, sb.st_dev, nvme, "pci0000:00/0000:00:01.0", "63\n");
    st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == -1 && strstr(why, "node 63"),
          "drive on node 63 (absent here): node %d, '%s'", node, why);

    /* the kernel says -1 (one-node machines, virtual devices) */
    fake_sysfs(sys, sb.st_dev, nvme, "pci0000:00/0000:00:01.0", "-1\n");
    st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == -1 && strstr(why, "reports no NUMA node"),
          "numa_node -1: not pinned, '%s'", why);

    /* no numa_node anywhere (loop devices): not pinned */
    fake_sysfs(sys, sb.st_dev, "virtual/block/loop0", NULL, NULL);
    st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == -1 && strstr(why, "reports no NUMA node"),
          "a device without numa_node: not pinned, '%s'", why);

    /* a numa_node file ABOVE the sysfs root is never read */
    fake_sysfs(sys, sb.st_dev, "virtual/block/loop0", NULL, NULL);
    char above[4300];
    snprintf(above, sizeof above, "%s/numa_node", dir);
    write_text(above, "0\n");
    st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == -1, "the walk stops at the sysfs root: node %d", node);

    /* no /dev/block link for the device */
    char p[4300];
    snprintf(p, sizeof p, "rm -rf '%s/dev'", sys);
    if (system(p) != 0) printf("# rm failed\n");
    st = wk_drive_numa(file, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node == -1 && strstr(why, "no block device"),
          "no /dev/block entry: not pinned, '%s'", why);

    /* the path itself missing is an error naming it */
    char gone[4300];
    snprintf(gone, sizeof gone, "%s/missing.safetensors", dir);
    st = wk_drive_numa(gone, sys, &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_ERR_IO && strstr(err, "missing.safetensors"), "missing shard: '%s'", err);

    /* the real /sys answers for a real file, whatever this machine is */
    st = wk_drive_numa(file, "/sys", &node, why, sizeof why, err, sizeof err);
    CHECK(st == K3_OK && node >= -1, "real /sys: node %d%s%s", node, *why ? ", " : "", why);

    snprintf(p, sizeof p, "rm -rf '%s'", dir);
    if (system(p) != 0) printf("# cleanup failed\n");
}

static void test_layer_shard(void) {
    const char *tiny = getenv("TINY") ? getenv("TINY") : "build/fixtures/tiny";
    char path[4096];
    k3_status st = wk_layer_shard(tiny, NULL, 0, 3, path, sizeof path, err, sizeof err);
    CHECK(st == K3_OK && strstr(path, tiny) && strstr(path, ".safetensors"),
          "layer 3 of tiny is in %s", st ? err : path);
    st = wk_layer_shard(tiny, NULL, 0, 999, path, sizeof path, err, sizeof err);
    CHECK(st == K3_ERR_MISSING && strstr(err, "layer 999"), "layer 999: '%s'", err);
}

int main(void) {
    test_drive_numa();
    test_layer_shard();
    TEST_MAIN_END();
}
