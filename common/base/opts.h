/* common/base/opts.h: one option table per program, after redis config.c.
 *
 * Owns: parsing a program's settings from three sources in one pass of
 * precedence, CLI flag > environment variable > default, into a plain struct
 * the program defines; the --help text; every validation message. Each
 * program (k3-coordinator, k3-worker, tools) declares a static table of
 * k3_opt rows; a row names the option, its flag, its variable (K3_* names
 * compatible with the seed, plus one alias such as COLI_TEMP), its type, its
 * default (as text, parsed by the same code as user input, so a default can
 * never escape its own range), its range or allowed values and its help.
 * Borrows: the table and argv (never modified). Strings and lists written
 * into the target struct are owned by it and freed by k3_opts_free.
 * Threads: parse once in main() before any thread starts (reads environ).
 *
 * Messages name the source, the value and the limit:
 *   "--chunk: 0 is outside 1..512", "K3_BITS=5: must be one of 4, 8, 32",
 *   "K3_LOG=loud: must be one of debug, info, warn, error".
 * Not handled: short option clusters (-abc), optional values. A repeated
 * flag replaces the earlier value, except K3_OPT_MULTI's, which append.
 */
#ifndef K3_OPTS_H
#define K3_OPTS_H

#include <stddef.h>
#include <stdio.h>

#include "common/base/err.h"

typedef enum k3_opt_type {
    K3_OPT_INT,    /* int; range [min, max] */
    K3_OPT_DOUBLE, /* double, finite; range [min, max] */
    K3_OPT_BOOL,   /* int 0/1; a flag takes no value ("--exact", "--exact=0") */
    K3_OPT_STRING, /* char *, owned; NULL when unset and no default */
    K3_OPT_LIST,   /* k3_opt_list, comma-separated; at most max items */
    K3_OPT_ENUM,   /* int; the text is one of names[], stored as choices[] of it */
    K3_OPT_MULTI   /* k3_opt_list; every occurrence of the flag adds one item as given
                      (commas kept: "--stop a,b" is one item); at most max items; no
                      variable (a flag cannot say whether it replaces or adds to one) */
} k3_opt_type;

/* Value of a K3_OPT_LIST option: n items, each an owned string. */
typedef struct k3_opt_list {
    int n;
    char **items; /* [n], owned */
} k3_opt_list;

/* A number as the text of a default: .def = K3_OPT_STR(K3_LINK_HB_MS_DEFAULT),
 * so a #define shared with code that needs the number is the one default. */
#define K3_OPT_STR(x)  K3_OPT_STR_(x)
#define K3_OPT_STR_(x) #x

/* Where an option's value came from (k3_opts_parse's src array). */
typedef enum k3_opt_src { K3_OPT_SRC_DEFAULT = 0, K3_OPT_SRC_ENV, K3_OPT_SRC_FLAG } k3_opt_src;

#define K3_OPT_MAX_CHOICES 8

/* One row of a program's table. Unused fields are 0/NULL. */
typedef struct k3_opt {
    const char *name;      /* key used in --help and lookups, e.g. "chunk" */
    const char *flag;      /* "--chunk", or NULL for env-only options */
    char short_flag;       /* 'h' for -h, or 0 */
    const char *env;       /* "K3_CHUNK", or NULL for flag-only options */
    const char *env_alias; /* second variable read when env is unset ("COLI_TEMP") */
    k3_opt_type type;
    size_t offset;   /* offsetof(target struct, field) */
    const char *def; /* default as text ("32", "0.9", "a,b"), NULL = none */
    double min, max; /* INT/DOUBLE range; LIST: max = most items; both 0 = any */
    int min_open;    /* DOUBLE: min itself is excluded (top-p in (0, 1]) */
    int n_choices;   /* INT: value must be one of choices[]; ENUM: number of names */
    int choices[K3_OPT_MAX_CHOICES];
    const char *names[K3_OPT_MAX_CHOICES]; /* ENUM: the accepted words, names[i] = choices[i] */
    const char *metavar;                   /* "N", "FILE", ... shown in --help */
    const char *help;                      /* one line */
} k3_opt;

/* The -h / --help row (an int field f of T), last in every program's table
 * so that --help ends with it. A macro because a static table cannot
 * include another array (the same holds for the other shared rows:
 * K3_ENGINE_OPT_ROWS, K3_CLUSTER_OPT_ROWS, K3_SAMPLER_OPT_ROWS, ...). */
// clang-format off
#define K3_OPT_HELP(T, f)                                                                          \
    {.name = "help", .flag = "--help", .short_flag = 'h', .type = K3_OPT_BOOL,                    \
     .offset = offsetof(T, f), .help = "this text"}
// clang-format on

/* Fills target from defaults, then the environment, then argv[1..argc).
 * Arguments that are not options (and everything after "--") are returned in
 * positional[0..*n_positional) (pointers into argv; positional has room for
 * argc entries). src, if not NULL, receives [n_opts] sources. On error
 * target may hold partial values: call k3_opts_free either way. */
k3_status k3_opts_parse(const k3_opt *opts, int n_opts, void *target, k3_opt_src *src, int argc,
                        char **argv, char **positional, int *n_positional, char *err,
                        size_t errlen);

/* Sets one option from text as if it came from src (tests, config files). */
k3_status k3_opts_set(const k3_opt *opt, void *target, const char *text, k3_opt_src src, char *err,
                      size_t errlen);

/* Writes "usage" and then one aligned line per option: flag, metavar, help,
 * variable, default and range, all from the table. */
void k3_opts_help(FILE *f, const char *usage, const k3_opt *opts, int n_opts);

/* Frees the strings and lists the table owns in target; safe to call twice. */
void k3_opts_free(const k3_opt *opts, int n_opts, void *target);

/* Index of the row named name, or -1. */
int k3_opts_find(const k3_opt *opts, int n_opts, const char *name);

#endif
