/* tests/test_plan_model.c: the decode model of `k3-coordinator plan`
 * (coordinator/plan_model.h) on synthetic drives and placements:
 *
 *   deal      the per-drive expert counts are those k3_placement_build gives
 *             (80/40 MB/s: 11/5 of 16; 120/90/60/30: 7/5/3/1), proportional
 *   reads     2 drives of 80/40 MB/s, all 16 experts missing: the busiest
 *             drive's time with every drive busy, the drives' sum with one
 *             read in flight, the formula's value with 2; 14 misses (2
 *             slots): the exact expectation over the 120 ways of 2 hits; a
 *             proportional split over 4 drives reads in total / summed speed
 *   compute   c_fixed / c_under from dense bytes and the expert time; a
 *             layer is c_fixed + max(reads, c_under)
 *   probe     the compute measurement at tiny shapes is positive, cached
 *             (same figures from the file), and redone with remeasure
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/experts/placement.h"
#include "coordinator/plan_model.h"
#include "tests/test.h"

#define B 17547264.0 /* one K3 expert, bytes */

static int close_to(double a, double b, double rel) { return fabs(a - b) <= rel * fabs(b); }

static void test_deal(void) {
    int c[4];
    double w2[2] = {0.08, 0.04};
    k3_plan_deal(w2, 2, 16, c);
    CHECK(c[0] == 11 && c[1] == 5, "80/40 MB/s: %d / %d of 16 experts (11 / 5)", c[0], c[1]);
    double w4[4] = {0.12, 0.09, 0.06, 0.03};
    k3_plan_deal(w4, 4, 16, c);
    CHECK(c[0] == 7 && c[1] == 5 && c[2] == 3 && c[3] == 1,
          "120/90/60/30 MB/s: %d/%d/%d/%d of 16 (7/5/3/1)", c[0], c[1], c[2], c[3]);
    k3_plan_deal(w4, 4, 896, c);
    int prop = 1;
    for (int d = 0; d < 4; d++) prop &= fabs(c[d] / 896.0 - w4[d] / 0.30) < 0.005;
    CHECK(prop, "896 experts over 120/90/60/30: %d/%d/%d/%d, each within 0.5 %% of its speed share",
          c[0], c[1], c[2], c[3]);
    /* the same counts as the placement the engine reads */
    const char *drives[4] = {"/a", "/b", "/c", "/d"};
    uint8_t is_moe[2] = {0, 1};
    k3_place_input in = {drives, 4, w4, 1, 2, 16, is_moe, (uint64_t)B, NULL, 0, 0};
    k3_placement *p = NULL;
    char err[256];
    k3_status st = k3_placement_build(&p, &in, err, sizeof err);
    k3_plan_deal(w4, 4, 16, c);
    int same = st == K3_OK;
    for (int d = 0; d < 4 && same; d++) same = k3_placement_count(p, 1, d) == c[d];
    CHECK(same, "k3_placement_build deals the same counts (%s)", st ? err : "built");
    k3_placement_free(&p);
}

static void test_reads(void) {
    int cnt[2] = {11, 5};
    double gbs[2] = {0.08, 0.04};
    double t0 = 11 * B / 0.08e9, t1 = 5 * B / 0.04e9;
    double all = k3_plan_layer_read_s(cnt, gbs, 2, 16, 16, B, 4);
    CHECK(close_to(all, fmax(t0, t1), 1e-9), "every drive busy, 16 misses: %.4f s = busiest %.4f",
          all, fmax(t0, t1));
    double one = k3_plan_layer_read_s(cnt, gbs, 2, 16, 16, B, 1);
    CHECK(close_to(one, t0 + t1, 1e-9), "one read in flight: %.4f s = the sum %.4f", one, t0 + t1);
    double two = k3_plan_layer_read_s(cnt, gbs, 2, 16, 16, B, 2);
    CHECK(close_to(two, fmax(fmax(t0, t1), (t0 + t1) / 2), 1e-9), "window 2: %.4f s", two);
    /* 2 slots: 14 misses; exact expectation over the 2 hits */
    double exact = 0;
    int ways = 0;
    for (int a = 0; a < 16; a++)
        for (int b = a + 1; b < 16; b++) {
            int n0 = 11 - (a < 11) - (b < 11), n1 = 14 - n0;
            exact += fmax(n0 * B / 0.08e9, n1 * B / 0.04e9);
            ways++;
        }
    exact /= ways;
    double mc = k3_plan_layer_read_s(cnt, gbs, 2, 16, 14, B, 4);
    CHECK(close_to(mc, exact, 0.01), "14 misses of 16: %.4f s, exact expectation %.4f", mc, exact);
    /* proportional over 4 drives, every expert missing: total / summed speed */
    int c4[4] = {40, 30, 20, 10};
    double g4[4] = {0.12, 0.09, 0.06, 0.03};
    double r4 = k3_plan_layer_read_s(c4, g4, 4, 100, 100, B, 8);
    CHECK(close_to(r4, 100 * B / 0.30e9, 1e-9), "proportional split: %.4f s = %.4f", r4,
          100 * B / 0.30e9);
    /* a split that is not proportional waits for the slow drive */
    int ce[4] = {25, 25, 25, 25};
    double re = k3_plan_layer_read_s(ce, g4, 4, 100, 100, B, 8);
    CHECK(close_to(re, 25 * B / 0.03e9, 1e-9) && close_to(re, r4 * 2.5, 1e-9),
          "an even split over 120/90/60/30: %.4f s (the 30 MB/s drive: 2.5 x the proportional)",
          re);
    CHECK(k3_plan_layer_read_s(cnt, gbs, 2, 16, 0, B, 4) == 0, "no misses: no reads");
    double half = k3_plan_layer_read_s(cnt, gbs, 2, 16, 0.5, B, 4);
    double one_m = k3_plan_layer_read_s(cnt, gbs, 2, 16, 1, B, 4);
    CHECK(close_to(half, one_m / 2, 0.02), "half a miss: %.4f s, half of one miss's %.4f", half,
          one_m);
}

static void test_compute(void) {
    k3_plan_compute pc = {10.0, 2.0, 2, 0};
    double fx, un;
    k3_plan_moe_compute(&pc, 1000000000ull, 400000000ull, 16, &fx, &un);
    CHECK(close_to(fx, 0.062, 1e-9) && close_to(un, 0.070, 1e-9),
          "1 GB dense of which 0.4 under the reads, 10 GB/s, 2 ms experts x 16: fixed %.4f s "
          "(0.062), under %.4f s (0.070)",
          fx, un);
    CHECK(close_to(k3_plan_moe_layer_s(0.05, fx, un), 0.132, 1e-9) &&
              close_to(k3_plan_moe_layer_s(0.5, fx, un), 0.562, 1e-9),
          "layer: fixed + max(reads, under): %.3f and %.3f s", k3_plan_moe_layer_s(0.05, fx, un),
          k3_plan_moe_layer_s(0.5, fx, un));
}

static void test_probe(void) {
    char dir[] = "/tmp/plan-test-cache.XXXXXX", err[512];
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp");
        return;
    }
    setenv("K3_CACHE_DIR", dir, 1);
    k3_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.hidden = 256, cfg.latent = 128, cfg.moe_inter = 96;
    k3_plan_compute a, b, c;
    k3_status st = k3_plan_compute_get(&cfg, 0.05, 0, &a, err, sizeof err);
    CHECK(st == K3_OK && a.dense_gbs > 0 && a.expert_ms > 0 && !a.from_cache && a.threads >= 1,
          "measured at 256 x 128 / 96: dense %.2f GB/s, expert %.4f ms, %d threads (%s)",
          a.dense_gbs, a.expert_ms, a.threads, st ? err : "ok");
    st = k3_plan_compute_get(&cfg, 0.05, 0, &b, err, sizeof err);
    CHECK(st == K3_OK && b.from_cache && close_to(b.dense_gbs, a.dense_gbs, 1e-5) &&
              close_to(b.expert_ms, a.expert_ms, 1e-5),
          "second call: from the cache, same figures");
    st = k3_plan_compute_get(&cfg, 0.05, 1, &c, err, sizeof err);
    CHECK(st == K3_OK && !c.from_cache && c.dense_gbs > 0, "remeasure: measured again");
    cfg.latent = 100;
    st = k3_plan_compute_get(&cfg, 0.05, 1, &c, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "latent 100"), "shapes not multiples of 32: %s", err);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

int main(void) {
    test_deal();
    test_reads();
    test_compute();
    test_probe();
    TEST_MAIN_END();
}
