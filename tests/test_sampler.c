/* tests/test_sampler.c: greedy ties, option validation, non-finite logits,
 * seeded reproducibility and the sampled distributions (plain softmax and
 * top-p nucleus) against their exact probabilities. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "coordinator/sampler.h"
#include "tests/test.h"

/* Frequencies of n draws over a vocab of v (<= 16). */
static void draw(k3_sampler *s, const float *logits, int v, int n, double *freq) {
    char err[256];
    memset(freq, 0, (size_t)v * sizeof *freq);
    for (int i = 0; i < n; i++) {
        int32_t id = -1;
        if (k3_sampler_sample(s, logits, &id, err, sizeof err) || id < 0 || id >= v) return;
        freq[id] += 1.0 / n;
    }
}

int main(void) {
    char err[256];
    k3_sampler *s = NULL;
    k3_status st;

    /* argmax: strict maximum, ties to the lowest index */
    float tie[5] = {1, 3, 2, 3, 3};
    float neg[4] = {-5, -1, -1, -7};
    float flat[3] = {0, 0, 0};
    CHECK(k3_sampler_argmax(tie, 5) == 1, "argmax ties go to the lowest index (1)");
    CHECK(k3_sampler_argmax(neg, 4) == 1, "argmax on negatives (1)");
    CHECK(k3_sampler_argmax(flat, 3) == 0, "argmax of a flat row is 0");

/* validation */
#define SO(t, p, s) {.temp = (t), .top_p = (p), .seed = (s)}
    k3_sampler_opts bad[] = {SO(-1, 1, 0), SO(NAN, 1, 0), SO(INFINITY, 1, 0),
                             SO(1, 0, 0),  SO(1, 1.5, 0), SO(1, NAN, 0)};
    const char *expect[] = {"temperature -1: must be finite and >= 0",
                            "temperature nan: must be finite and >= 0",
                            "temperature inf: must be finite and >= 0",
                            "top-p 0: must be in (0, 1]",
                            "top-p 1.5: must be in (0, 1]",
                            "top-p nan: must be in (0, 1]"};
    for (int i = 0; i < 6; i++) {
        st = k3_sampler_open(&s, &bad[i], 10, err, sizeof err);
        CHECK(st == K3_ERR_ARG && s == NULL && !strcmp(err, expect[i]), "rejects: '%s'", err);
    }
    k3_sampler_opts ok = SO(0.7, 0.9, 1);
    st = k3_sampler_open(&s, &ok, 0, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && s == NULL, "vocab 0 rejected: '%s'", err);
    st = k3_sampler_open(&s, &ok, 10, err, sizeof err);
    CHECK(st == K3_OK && s, "temp 0.7, top-p 0.9 accepted");
    k3_sampler_close(&s);
    CHECK(s == NULL, "close nulls the pointer");
    k3_sampler_close(&s); /* twice: a no-op */

    /* greedy draws no random numbers and ignores top-p */
    k3_sampler_opts g = SO(0, 0.5, 42);
    k3_sampler *a = NULL, *b = NULL;
    k3_sampler_open(&a, &g, 5, err, sizeof err);
    k3_sampler_open(&b, &g, 5, err, sizeof err);
    int32_t id = -1;
    int all_one = 1;
    for (int i = 0; i < 100; i++) {
        st = k3_sampler_sample(a, tie, &id, err, sizeof err);
        all_one &= st == K3_OK && id == 1;
    }
    CHECK(all_one, "temp 0 picks the argmax every time");
    CHECK(k3_sampler_next_u64(a) == k3_sampler_next_u64(b), "greedy leaves the PRNG untouched");

    /* non-finite logits are an error naming the index */
    float nanrow[5] = {0, 1, NAN, 2, 0};
    st = k3_sampler_sample(a, nanrow, &id, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "logit 2 is nan"), "NaN logit: '%s'", err);
    float infrow[5] = {0, 1, 0, -INFINITY, 0};
    st = k3_sampler_sample(a, infrow, &id, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "logit 3 is -inf"), "-inf logit: '%s'", err);
    k3_sampler_close(&a);
    k3_sampler_close(&b);

    /* the PRNG: unit draws in [0, 1) with mean ~0.5; seeds differ */
    k3_sampler_opts t1 = SO(1, 1, 7), t2 = SO(1, 1, 8);
    k3_sampler_open(&a, &t1, 4, err, sizeof err);
    k3_sampler_open(&b, &t2, 4, err, sizeof err);
    double mean = 0;
    int in_range = 1;
    for (int i = 0; i < 100000; i++) {
        double u = k3_sampler_next_unit(a);
        in_range &= u >= 0 && u < 1;
        mean += u / 100000;
    }
    CHECK(in_range && fabs(mean - 0.5) < 0.005, "unit draws in [0,1), mean %.4f", mean);
    k3_sampler_close(&a);
    k3_sampler_open(&a, &t1, 4, err, sizeof err);
    float row[4] = {0.1f, 0.2f, 0.3f, 0.4f};
    int32_t seq_a[64], seq_b[64], seq_c[64];
    for (int i = 0; i < 64; i++) {
        k3_sampler_sample(a, row, &seq_a[i], err, sizeof err);
        k3_sampler_sample(b, row, &seq_b[i], err, sizeof err);
    }
    k3_sampler_close(&a);
    k3_sampler_open(&a, &t1, 4, err, sizeof err);
    for (int i = 0; i < 64; i++) k3_sampler_sample(a, row, &seq_c[i], err, sizeof err);
    CHECK(!memcmp(seq_a, seq_c, sizeof seq_a), "same seed, same ids");
    CHECK(memcmp(seq_a, seq_b, sizeof seq_a) != 0, "seeds 7 and 8 give different ids");
    k3_sampler_close(&a);
    k3_sampler_close(&b);

    /* distribution at temp 1: probabilities 0.5, 0.3, 0.15, 0.05 */
    const double p[4] = {0.5, 0.3, 0.15, 0.05};
    float lp[4];
    for (int i = 0; i < 4; i++) lp[i] = (float)log(p[i]) + 3.0f; /* a shift must not matter */
    double freq[4];
    const int N = 200000;
    k3_sampler_open(&a, &t1, 4, err, sizeof err);
    draw(a, lp, 4, N, freq);
    double worst = 0;
    for (int i = 0; i < 4; i++)
        worst = fmax(worst, fabs(freq[i] - p[i]) / sqrt(p[i] * (1 - p[i]) / N));
    CHECK(worst < 5, "temp 1 frequencies %.3f %.3f %.3f %.3f match p (max %.1f sigma)", freq[0],
          freq[1], freq[2], freq[3], worst);
    k3_sampler_close(&a);

    /* temp 2 flattens: p_i ~ sqrt(p) */
    k3_sampler_opts t_half = SO(2, 1, 3);
    k3_sampler_open(&a, &t_half, 4, err, sizeof err);
    draw(a, lp, 4, N, freq);
    double z = 0, q[4];
    for (int i = 0; i < 4; i++) z += sqrt(p[i]);
    worst = 0;
    for (int i = 0; i < 4; i++) {
        q[i] = sqrt(p[i]) / z;
        worst = fmax(worst, fabs(freq[i] - q[i]) / sqrt(q[i] * (1 - q[i]) / N));
    }
    CHECK(worst < 5, "temp 2 frequencies match softmax(l/2) (max %.1f sigma)", worst);
    k3_sampler_close(&a);

    /* top-p 0.75: nucleus {0, 1} (0.5 + 0.3 >= 0.75), renormalized 0.625 / 0.375 */
    k3_sampler_opts tp = SO(1, 0.75, 11);
    k3_sampler_open(&a, &tp, 4, err, sizeof err);
    draw(a, lp, 4, N, freq);
    CHECK(freq[2] == 0 && freq[3] == 0 && fabs(freq[0] - 0.625) < 0.01,
          "top-p 0.75 keeps ids 0 and 1 only (%.3f %.3f %.3f %.3f)", freq[0], freq[1], freq[2],
          freq[3]);
    k3_sampler_close(&a);
    /* top-p 0.9: nucleus {0, 1, 2} */
    tp.top_p = 0.9;
    k3_sampler_open(&a, &tp, 4, err, sizeof err);
    draw(a, lp, 4, N, freq);
    CHECK(freq[3] == 0 && freq[2] > 0.1 && fabs(freq[0] - 0.5 / 0.95) < 0.01,
          "top-p 0.9 keeps ids 0..2 (%.3f %.3f %.3f)", freq[0], freq[1], freq[2]);
    k3_sampler_close(&a);
    /* a tiny top-p is greedy; on a flat row it still picks a valid id (the lowest) */
    tp.top_p = 0.01;
    k3_sampler_open(&a, &tp, 4, err, sizeof err);
    draw(a, lp, 4, 1000, freq);
    CHECK(fabs(freq[0] - 1) < 1e-9, "top-p 0.01 always picks the mode");
    float flat4[4] = {1, 1, 1, 1};
    draw(a, flat4, 4, 1000, freq);
    CHECK(fabs(freq[0] - 1) < 1e-9, "top-p 0.01 on a flat row picks the lowest index");
    k3_sampler_close(&a);
    /* ties inside the nucleus are ordered by index: flat row, top-p 0.5 -> {0, 1} */
    tp.top_p = 0.5;
    k3_sampler_open(&a, &tp, 4, err, sizeof err);
    draw(a, flat4, 4, N, freq);
    CHECK(freq[2] == 0 && freq[3] == 0 && fabs(freq[0] - 0.5) < 0.01,
          "flat row, top-p 0.5 -> ids 0 and 1 (%.3f %.3f)", freq[0], freq[1]);
    k3_sampler_close(&a);

    /* ---- top-k, min-p, repeat penalty (all off when zero) ---- */
    {
        enum { V = 300, STEPS = 400 };
        float *row = malloc(sizeof(float) * V);
        uint64_t x = 12345;
        for (int i = 0; i < V; i++) { /* a fixed pseudo-random row, ties included */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            row[i] = (float)((int)(x >> 40) % 700) / 100.0f;
        }
        row[17] = row[3]; /* a tie */
        k3_sampler_opts base = {.temp = 0.9, .top_p = 0.95, .seed = 77};
        k3_sampler_opts same = base;
        same.repeat_penalty = 1;
        k3_sampler *a = NULL, *b = NULL;
        k3_sampler_open(&a, &base, V, err, sizeof err);
        k3_sampler_open(&b, &same, V, err, sizeof err);
        int equal = 1;
        for (int t = 0; t < STEPS; t++) {
            int32_t ia, ib;
            k3_sampler_sample(a, row, &ia, err, sizeof err);
            k3_sampler_sample(b, row, &ib, err, sizeof err);
            equal &= ia == ib;
        }
        CHECK(equal, "new fields zero (and penalty 1): the ids of the old sampler, %d draws",
              STEPS);
        k3_sampler_close(&a);
        k3_sampler_close(&b);

        /* the k most probable ids: by logit descending, index ascending */
        int order[V];
        for (int i = 0; i < V; i++) order[i] = i;
        for (int i = 1; i < V; i++)
            for (int k = i;
                 k > 0 && (row[order[k]] > row[order[k - 1]] ||
                           (row[order[k]] == row[order[k - 1]] && order[k] < order[k - 1]));
                 k--) {
                int t = order[k];
                order[k] = order[k - 1];
                order[k - 1] = t;
            }
        k3_sampler_opts tk = {.temp = 5, .top_p = 1, .seed = 3, .top_k = 7};
        k3_sampler_open(&a, &tk, V, err, sizeof err);
        int inside = 1, seen[V] = {0}, distinct = 0;
        for (int t = 0; t < 4000; t++) {
            int32_t id;
            k3_sampler_sample(a, row, &id, err, sizeof err);
            int ok_id = 0;
            for (int k = 0; k < 7; k++) ok_id |= order[k] == id;
            inside &= ok_id;
            if (!seen[id]++) distinct++;
        }
        CHECK(inside && distinct == 7,
              "top-k 7 at temperature 5: every id among the 7 largest logits, all 7 drawn (%d)",
              distinct);
        k3_sampler_close(&a);
        tk.top_k = 1;
        k3_sampler_open(&a, &tk, V, err, sizeof err);
        int greedy = 1;
        for (int t = 0; t < 200; t++) {
            int32_t id;
            k3_sampler_sample(a, row, &id, err, sizeof err);
            greedy &= id == k3_sampler_argmax(row, V);
        }
        CHECK(greedy, "top-k 1 is greedy at any temperature");
        k3_sampler_close(&a);

        /* min-p: p_i >= min_p * p_max, i.e. l_i >= l_max + T ln(min_p) */
        k3_sampler_opts mp = {.temp = 1, .top_p = 1, .seed = 5, .min_p = 0.2};
        k3_sampler_open(&a, &mp, V, err, sizeof err);
        float lmax = row[k3_sampler_argmax(row, V)];
        int above = 1, n_ids = 0;
        memset(seen, 0, sizeof seen);
        for (int t = 0; t < 4000; t++) {
            int32_t id;
            k3_sampler_sample(a, row, &id, err, sizeof err);
            above &= (double)row[id] >= (double)lmax + log(0.2) - 1e-9;
            if (!seen[id]++) n_ids++;
        }
        CHECK(above && n_ids > 1, "min-p 0.2: every id within ln(5) of the best logit (%d ids)",
              n_ids);
        k3_sampler_close(&a);

        /* determinism: same options and seed, same ids; another seed differs */
        k3_sampler_opts all = {.temp = 0.8,
                               .top_p = 0.9,
                               .seed = 11,
                               .top_k = 40,
                               .min_p = 0.05,
                               .repeat_penalty = 1.3};
        int32_t s1[200], s2[200], s3[200];
        for (int run = 0; run < 3; run++) {
            k3_sampler_opts o = all;
            if (run == 2) o.seed = 12;
            k3_sampler_open(&a, &o, V, err, sizeof err);
            for (int t = 0; t < 200; t++)
                k3_sampler_sample(a, row,
                                  run == 0   ? &s1[t]
                                  : run == 1 ? &s2[t]
                                             : &s3[t],
                                  err, sizeof err);
            k3_sampler_close(&a);
        }
        CHECK(!memcmp(s1, s2, sizeof s1) && memcmp(s1, s3, sizeof s1),
              "top-k 40 + min-p 0.05 + top-p 0.9 + penalty 1.3: same seed same 200 ids, "
              "seed 12 others");

        /* repeat penalty, greedy: the best id once, then the runner-up */
        float two[4] = {1.0f, 3.0f, 2.5f, -1.0f};
        k3_sampler_opts rp = {.temp = 0, .top_p = 1, .repeat_penalty = 1.5};
        k3_sampler_open(&a, &rp, 4, err, sizeof err);
        int32_t i1, i2, i3;
        k3_sampler_sample(a, two, &i1, err, sizeof err);
        k3_sampler_sample(a, two, &i2, err, sizeof err);
        k3_sampler_sample(a, two, &i3, err, sizeof err);
        CHECK(i1 == 1 && i2 == 2 && i3 == 1 && two[1] == 3.0f,
              "repeat penalty 1.5, greedy: 1 (3.0), then 2 (2.5 > 3/1.5), then 1 again "
              "(3/1.5 > 2.5/1.5); the caller's logits untouched (%d %d %d)",
              i1, i2, i3);
        k3_sampler_close(&a);

        k3_sampler_opts badk = {.temp = 1, .top_p = 1, .top_k = -1};
        k3_sampler_opts badm = {.temp = 1, .top_p = 1, .min_p = 1.5};
        k3_sampler_opts badr = {.temp = 1, .top_p = 1, .repeat_penalty = 11};
        CHECK(k3_sampler_check_opts(&badk, err, sizeof err) == K3_ERR_ARG &&
                  strstr(err, "top-k -1") &&
                  k3_sampler_check_opts(&badm, err, sizeof err) == K3_ERR_ARG &&
                  strstr(err, "min-p 1.5") &&
                  k3_sampler_check_opts(&badr, err, sizeof err) == K3_ERR_ARG &&
                  strstr(err, "repeat penalty 11"),
              "top-k, min-p and repeat penalty ranges are checked: '%s'", err);
        free(row);
    }

    TEST_MAIN_END();
}
