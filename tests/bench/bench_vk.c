/* tests/bench/bench_vk.c: `make bench-vk`. One MXFP4 routed expert (gate,
 * up, SiTU, down) over n pairs on the Vulkan device (common/vk/) and on the
 * CPU (exact-float kernel on the pool, k3_situ), the two timed alternately
 * round by round so a drifting machine load hits both; prints the medians,
 * their ratio and whether the outputs were the same bits. Upload time is
 * printed apart (the tier uploads once per residency, not per step). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/pool.h"
#include "common/kernels/kernels.h"
#include "common/kernels/ops.h"
#include "common/vk/vk.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* the device half of the overlap measurement: one expert call on a thread */
typedef struct dev_call {
    k3_vk *vk;
    const k3_vk_expert *e;
    const float *z;
    int n;
    float *y;
    double ms;
    k3_status st;
} dev_call;

static void *dev_main(void *arg) {
    dev_call *d = arg;
    char err[256];
    double t0 = now_ms();
    d->st = k3_vk_expert_apply(d->vk, d->e, d->z, d->n, 4.0f, 25.0f, d->y, err, sizeof err);
    d->ms = now_ms() - t0;
    return NULL;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    char err[256];
    k3_vk *vk = NULL;
    if (k3_vk_open(&vk, 0, 0, err, sizeof err) != K3_OK) {
        printf("bench-vk: %s\n", err);
        return 0;
    }
    int threads = 2;
    k3_pool *pool = NULL;
    if (k3_pool_open(&pool, threads, err, sizeof err) != K3_OK) {
        printf("bench-vk: %s\n", err);
        return 1;
    }
    printf("device: %s%s, %s shader; CPU: %s kernel on %d threads\n", k3_vk_device_name(vk),
           k3_vk_is_cpu(vk) ? " (a CPU implementation)" : "",
           k3_vk_exact(vk) ? "float64-FMA (CPU bits)" : "fma()", k3_isa_name(k3_isa_active()),
           threads);
    static const int shapes[][3] = {
        {3072, 3584, 1}, {3072, 3584, 4}, {512, 1024, 1}, {512, 1024, 8}};
    const int ns = quick ? 1 : 4, rounds = quick ? 3 : 5;
    printf("%-18s %4s %11s %11s %9s %10s %s\n", "expert I x L", "n", "device ms", "CPU ms",
           "dev/CPU", "upload ms", "same bits");
    uint64_t rng = 12345;
    char ov_line[512];
    int ov_line_len = 0;
    for (int si = 0; si < ns; si++) {
        const int I = shapes[si][0], L = shapes[si][1], n = shapes[si][2];
        const size_t mat = (size_t)I * L;
        uint8_t *buf = malloc(3 * (mat / 2 + mat / 32));
        for (size_t i = 0; i < 3 * (mat / 2 + mat / 32); i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            buf[i] = (uint8_t)(rng >> 56);
        }
        k3_mxfp4 w[3];
        uint8_t *p = buf;
        for (int k = 0; k < 3; k++) {
            uint8_t *sc = p + mat / 2;
            for (size_t i = 0; i < mat / 32; i++) sc[i] = (uint8_t)(120 + sc[i] % 12);
            w[k] = (k3_mxfp4){
                .packed = p, .scale = sc, .rows = k == 1 ? L : I, .cols = k == 1 ? I : L};
            p += mat / 2 + mat / 32;
        }
        float *z = malloc(sizeof(float) * n * L), *yd = malloc(sizeof(float) * n * L),
              *yc = malloc(sizeof(float) * n * L), *g = malloc(sizeof(float) * n * I),
              *u = malloc(sizeof(float) * n * I);
        for (int i = 0; i < n * L; i++) z[i] = (float)((i * 7919) % 2001 - 1000) / 500.0f;
        double t0 = now_ms();
        k3_vk_expert *e = NULL;
        if (k3_vk_expert_upload(vk, &w[0], &w[1], &w[2], &e, err, sizeof err) != K3_OK) {
            printf("upload: %s\n", err);
            return 1;
        }
        double up = now_ms() - t0, td[8], tc[8];
        for (int r = 0; r < rounds; r++) {
            t0 = now_ms();
            if (k3_vk_expert_apply(vk, e, z, n, 4.0f, 25.0f, yd, err, sizeof err) != K3_OK) {
                printf("apply: %s\n", err);
                return 1;
            }
            td[r] = now_ms() - t0;
            t0 = now_ms();
            k3_mxfp4_matmul_f32_mt(&w[0], z, n, g, pool);
            k3_mxfp4_matmul_f32_mt(&w[2], z, n, u, pool);
            k3_situ(g, g, u, n * I, 4.0f, 25.0f);
            k3_mxfp4_matmul_f32_mt(&w[1], g, n, yc, pool);
            tc[r] = now_ms() - t0;
        }
        double md = median(td, rounds), mc = median(tc, rounds);
        char shape[32];
        snprintf(shape, sizeof shape, "%d x %d", I, L);
        int same = 0;
        double num = 0, den = 0;
        for (int i = 0; i < n * L; i++) {
            same += memcmp(&yd[i], &yc[i], sizeof(float)) == 0;
            num += ((double)yd[i] - yc[i]) * ((double)yd[i] - yc[i]);
            den += (double)yc[i] * yc[i];
        }
        printf("%-18s %4d %11.2f %11.2f %9.2f %10.2f %d/%d (rel-L2 %.2g)\n", shape, n, md, mc,
               md / mc, up, same, n * L, den > 0 ? sqrt(num / den) : 0.0);
        if (si == 0) {
            /* Overlap, as a MoE step has it (common/layers/moe.c): one device
             * expert on its own thread while the CPU computes k experts of
             * about the same total time on the pool. Achieved overlap = the
             * time saved against running them one after the other, over the
             * shorter of the two: 100% = fully hidden, 0% = serialised. */
            int k = (int)(md / mc + 0.5);
            if (k < 1) k = 1;
            dev_call d = {vk, e, z, n, yd, 0, K3_OK};
            pthread_t th;
            t0 = now_ms();
            pthread_create(&th, NULL, dev_main, &d);
            for (int r = 0; r < k; r++) {
                k3_mxfp4_matmul_f32_mt(&w[0], z, n, g, pool);
                k3_mxfp4_matmul_f32_mt(&w[2], z, n, u, pool);
                k3_situ(g, g, u, n * I, 4.0f, 25.0f);
                k3_mxfp4_matmul_f32_mt(&w[1], g, n, yc, pool);
            }
            double tcpu = now_ms() - t0;
            pthread_join(th, NULL);
            double both = now_ms() - t0, alone = md + k * mc;
            double shorter = md < k * mc ? md : k * mc;
            double ov = (alone - both) / shorter;
            ov_line_len = snprintf(
                ov_line, sizeof ov_line,
                "overlap (%s, n=%d): device %.1f ms on its thread beside %d CPU experts (%.1f "
                "ms alone, %.1f ms beside it): %.1f ms together against %.1f ms one after the "
                "other: %.0f%% of the shorter hidden%s\n",
                shape, n, d.ms, k, k * mc, tcpu, both, alone, 100.0 * (ov < 0 ? 0 : ov),
                d.st == K3_OK ? "" : " (device call failed)");
        }
        k3_vk_expert_free(vk, &e);
        free(buf), free(z), free(yd), free(yc), free(g), free(u);
    }
    if (ov_line_len > 0) fputs(ov_line, stdout);
    k3_pool_close(&pool);
    k3_vk_close(&vk);
    return 0;
}
