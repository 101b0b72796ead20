/* tests/test.h: the tiny test harness every tests/test_<module>.c uses.
 *
 * CHECK(cond, fmt, ...) records one check and prints "ok - ..." or
 * "not ok - ... (file:line)". SKIP(what, fmt, ...) records checks that did
 * not run and prints "skip - WHAT: skipped: REASON": never "ok", so a skip
 * is not counted as a pass. tests/run.sh counts those lines across all
 * programs and prints the final "N passed, N failed, N skipped". A program
 * that exits non-zero without printing "not ok" (a crash) counts as one
 * failure, and so does one that prints no ok, not ok or skip line at all.
 * TEST_MAIN_END returns non-zero if any check failed or none was recorded.
 */
#ifndef K3_TEST_H
#define K3_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int t_pass, t_fail, t_skip;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            t_pass++;                                                                              \
            printf("ok - ");                                                                       \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        } else {                                                                                   \
            t_fail++;                                                                              \
            printf("not ok - ");                                                                   \
            printf(__VA_ARGS__);                                                                   \
            printf(" (%s:%d)\n", __FILE__, __LINE__);                                              \
        }                                                                                          \
        fflush(stdout);                                                                            \
    } while (0)

/* `what` names the checks not run (a string), the format the reason:
 * SKIP("tiny fixture checks", "%s does not exist", path). */
#define SKIP(what, ...)                                                                            \
    do {                                                                                           \
        t_skip++;                                                                                  \
        printf("skip - %s: skipped: ", what);                                                      \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        fflush(stdout);                                                                            \
    } while (0)

/* Relative L2 distance ||a-b|| / max(||b||, tiny). */
static inline double t_rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

/* Directory of fixtures (env TINY, default build/fixtures/tiny). */
static inline const char *t_tiny_dir(void) {
    const char *d = getenv("TINY");
    return d && *d ? d : "build/fixtures/tiny";
}

#define TEST_MAIN_END()                                                                            \
    do {                                                                                           \
        if (t_pass + t_fail + t_skip == 0) {                                                       \
            t_fail++;                                                                              \
            printf("not ok - the program recorded no check (%s)\n", __FILE__);                     \
        }                                                                                          \
        printf("# %d passed, %d failed, %d skipped\n", t_pass, t_fail, t_skip);                    \
        return t_fail ? 1 : 0;                                                                     \
    } while (0)

#endif
