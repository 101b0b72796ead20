/* coordinator/sampler.h: picks the next token from a logit row (docs/MODEL.md 3.9).
 *
 * Owns: the sampling rule (greedy with ties to the lowest index; otherwise
 * softmax at temperature T restricted to the top-p nucleus), its own seeded
 * PRNG (xoshiro256** seeded through splitmix64, so a run is reproducible per
 * seed on every platform and libc), and scratch [vocab] for the nucleus.
 * Borrows: the logits passed to each call.
 * Threads: one sampler per session; a sampler is not shared between threads.
 *
 * Order: repeat penalty on the logits, then (temp > 0) softmax at T, min-p,
 * top-k (by probability, ties to the lower index), then top-p over the mass
 * that is left; one draw walks the survivors. Every order is total, so the
 * ids depend only on the logits, the options and the seed.
 *
 * temp = 0 is greedy and draws no random numbers. Logits must be finite: the
 * generation loop checks that before calling (a NaN here is reported as an
 * error, never silently sampled).
 */
#ifndef K3_SAMPLER_H
#define K3_SAMPLER_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/opts.h"

typedef struct k3_sampler_opts {
    double temp;   /* >= 0, finite; 0 = greedy */
    double top_p;  /* (0, 1]; 1 = the whole distribution */
    uint64_t seed; /* PRNG seed; same seed + same logits = same ids */
    /* Optional filters (0 = off, so a zeroed struct samples as before): */
    int top_k;             /* keep the k most probable ids, 0..K3_MAX_VOCAB */
    double min_p;          /* drop ids below min_p x the most probable one's p, [0, 1] */
    double repeat_penalty; /* ids among the last K3_SAMPLER_PENALTY_LAST sampled ones get
                              l / penalty (l > 0) or l x penalty (l <= 0) before anything
                              else, greedy included; 0 or 1 = off, else (0, 10] */
} k3_sampler_opts;

/* The repeat penalty looks back this many sampled ids (the sampler's own
 * output: it never sees the prompt). */
#define K3_SAMPLER_PENALTY_LAST 64

/* The --temp, --top-p and --seed rows of a program's option table (the
 * double, double and int fields temp_f, top_p_f, seed_f of T); temp_def
 * is the temperature's default as text. */
// clang-format off
#define K3_SAMPLER_OPT_ROWS(T, temp_f, top_p_f, seed_f, temp_def)                                  \
    {.name = "temp", .flag = "--temp", .env = "K3_TEMP", .env_alias = "COLI_TEMP",                \
     .type = K3_OPT_DOUBLE, .offset = offsetof(T, temp_f), .def = temp_def, .min = 0, .max = 1e6, \
     .metavar = "T", .help = "sampling temperature, 0 = greedy"},                                 \
    {.name = "top_p", .flag = "--top-p", .env = "K3_TOP_P", .type = K3_OPT_DOUBLE,                \
     .offset = offsetof(T, top_p_f), .def = "1", .min = 0, .max = 1, .min_open = 1,               \
     .metavar = "P", .help = "nucleus sampling mass"},                                            \
    {.name = "seed", .flag = "--seed", .env = "K3_SEED", .type = K3_OPT_INT,                      \
     .offset = offsetof(T, seed_f), .def = "0", .min = 0, .max = INT_MAX, .metavar = "S",         \
     .help = "sampler seed"}
// clang-format on

typedef struct k3_sampler k3_sampler;

/* Validates opts (temp >= 0 and finite, top_p in (0, 1], vocab in
 * 1..K3_MAX_VOCAB) and allocates scratch for vocab entries. */
k3_status k3_sampler_open(k3_sampler **out, const k3_sampler_opts *opts, int vocab, char *err,
                          size_t errlen);
void k3_sampler_close(k3_sampler **s);

/* Samples one id from logits [vocab]. Fails (K3_ERR_ARG) on a non-finite logit. */
k3_status k3_sampler_sample(k3_sampler *s, const float *logits, int32_t *id, char *err,
                            size_t errlen);

/* Index of the largest value; ties go to the lowest index. n >= 1. */
int k3_sampler_argmax(const float *logits, int n);

/* Validation alone, for option checking before a model is loaded. */
k3_status k3_sampler_check_opts(const k3_sampler_opts *opts, char *err, size_t errlen);

/* The PRNG, exposed for tests: next 64 random bits / a double in [0, 1). */
uint64_t k3_sampler_next_u64(k3_sampler *s);
double k3_sampler_next_unit(k3_sampler *s);

#endif
