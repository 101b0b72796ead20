/* tests/test_opts.c: the option table engine (common/base/opts.h): defaults,
 * environment vs flag precedence, aliases, every validation message, list
 * parsing, positionals and the --help text. */
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/opts.h"
#include "tests/test.h"

typedef struct topts {
    int chunk;
    int bits;
    double temp;
    int exact;
    int pipe;
    char *model;
    k3_opt_list dirs;
    int level;
    int help;
} topts;

#define T_LEVEL_DEFAULT 20

static const k3_opt table[] = {
    {.name = "chunk",
     .flag = "--chunk",
     .env = "K3T_CHUNK",
     .type = K3_OPT_INT,
     .offset = offsetof(topts, chunk),
     .def = "32",
     .min = 1,
     .max = 512,
     .metavar = "N",
     .help = "prefill chunk"},
    {.name = "bits",
     .flag = "--bits",
     .env = "K3T_BITS",
     .type = K3_OPT_INT,
     .offset = offsetof(topts, bits),
     .def = "4",
     .n_choices = 3,
     .choices = {4, 8, 32},
     .metavar = "B",
     .help = "dense bits"},
    {.name = "temp",
     .flag = "--temp",
     .env = "K3T_TEMP",
     .env_alias = "K3T_COLI_TEMP",
     .type = K3_OPT_DOUBLE,
     .offset = offsetof(topts, temp),
     .def = "0",
     .min = 0,
     .max = 100,
     .metavar = "T",
     .help = "temperature"},
    {.name = "exact",
     .flag = "--exact",
     .type = K3_OPT_BOOL,
     .offset = offsetof(topts, exact),
     .help = "f32 everywhere"},
    {.name = "pipe",
     .env = "K3T_PIPE",
     .type = K3_OPT_BOOL,
     .offset = offsetof(topts, pipe),
     .def = "1",
     .help = "overlap loads"},
    {.name = "model",
     .flag = "--model",
     .type = K3_OPT_STRING,
     .offset = offsetof(topts, model),
     .metavar = "DIR",
     .help = "model directory"},
    {.name = "dirs",
     .flag = "--dirs",
     .env = "K3T_DIRS",
     .type = K3_OPT_LIST,
     .offset = offsetof(topts, dirs),
     .max = 3,
     .metavar = "A,B",
     .help = "shard dirs"},
    {.name = "level",
     .flag = "--level",
     .env = "K3T_LEVEL",
     .type = K3_OPT_ENUM,
     .offset = offsetof(topts, level),
     .def = "info",
     .n_choices = 3,
     .choices = {10, T_LEVEL_DEFAULT, 30},
     .names = {"debug", "info", "warn"},
     .metavar = "LEVEL",
     .help = "verbosity"},
    {.name = "help",
     .flag = "--help",
     .short_flag = 'h',
     .type = K3_OPT_BOOL,
     .offset = offsetof(topts, help),
     .help = "this text"},
};
#define N_TABLE ((int)(sizeof table / sizeof table[0]))

static void clear_env(void) {
    const char *vars[] = {"K3T_CHUNK", "K3T_BITS", "K3T_TEMP", "K3T_COLI_TEMP",
                          "K3T_PIPE",  "K3T_DIRS", "K3T_LEVEL"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

/* Parses a NULL-terminated argument list (argv[0] added). */
static k3_status parse(topts *o, k3_opt_src *src, char **pos, int *npos, char *err, const char *a0,
                       ...) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "prog";
    va_list ap;
    va_start(ap, a0);
    for (const char *a = a0; a && argc < 31; a = va_arg(ap, const char *)) argv[argc++] = (char *)a;
    va_end(ap);
    argv[argc] = NULL;
    memset(o, 0, sizeof *o);
    err[0] = 0;
    return k3_opts_parse(table, N_TABLE, o, src, argc, argv, pos, npos, err, 256);
}

int main(void) {
    topts o;
    k3_opt_src src[N_TABLE];
    char *pos[32];
    int npos = 0;
    char err[256];
    k3_status st;

    /* defaults */
    clear_env();
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.chunk == 32 && o.bits == 4 && o.temp == 0 && o.exact == 0 &&
              o.pipe == 1 && o.model == NULL && o.dirs.n == 0 && npos == 0,
          "defaults: chunk 32, bits 4, temp 0, pipe 1, no model (st %d, %s)", st, err);
    CHECK(src[0] == K3_OPT_SRC_DEFAULT && src[1] == K3_OPT_SRC_DEFAULT, "sources: default");
    k3_opts_free(table, N_TABLE, &o);

    /* environment over default, flag over environment */
    setenv("K3T_CHUNK", "8", 1);
    setenv("K3T_BITS", "32", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.chunk == 8 && o.bits == 32 && src[0] == K3_OPT_SRC_ENV,
          "env K3T_CHUNK=8 beats the default (chunk %d, bits %d)", o.chunk, o.bits);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--chunk", "3", "--bits=8", NULL);
    CHECK(st == K3_OK && o.chunk == 3 && o.bits == 8 && src[0] == K3_OPT_SRC_FLAG &&
              src[1] == K3_OPT_SRC_FLAG,
          "flags --chunk 3 and --bits=8 beat the env (chunk %d, bits %d)", o.chunk, o.bits);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--chunk", "3", "--chunk", "5", NULL);
    CHECK(st == K3_OK && o.chunk == 5, "a repeated flag: the last one wins (%d)", o.chunk);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* alias: read when the primary variable is unset; the primary wins */
    setenv("K3T_COLI_TEMP", "0.5", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.temp == 0.5, "alias K3T_COLI_TEMP=0.5 sets temp (%g)", o.temp);
    setenv("K3T_TEMP", "0.25", 1);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.temp == 0.25, "primary K3T_TEMP beats the alias (%g)", o.temp);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_TEMP", "", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.temp == 0.5, "an empty variable counts as unset (%g)", o.temp);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_TEMP", "", 1);
    setenv("K3T_COLI_TEMP", "-1", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3T_COLI_TEMP: -1 is outside 0..100"),
          "a bad alias value names the alias: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* validation messages: exact text */
    st = parse(&o, src, pos, &npos, err, "--chunk", "0", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--chunk: 0 is outside 1..512"), "range: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_BITS", "5", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3T_BITS=5: must be one of 4, 8, 32"), "choices: '%s'",
          err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();
    st = parse(&o, src, pos, &npos, err, "--chunk", "12x", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--chunk: '12x' is not an integer"),
          "not an integer: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--chunk", "99999999999999", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--chunk: 99999999999999 is outside 1..512"),
          "int overflow: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    k3_opt open_min = table[2];
    open_min.min_open = 1;
    memset(&o, 0, sizeof o);
    st = k3_opts_set(&open_min, &o, "0", K3_OPT_SRC_FLAG, err, sizeof err);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--temp: 0 is outside 0..100 (min excluded)"),
          "open minimum: '%s'", err);
    st = k3_opts_set(&open_min, &o, "1e-9", K3_OPT_SRC_FLAG, err, sizeof err);
    CHECK(st == K3_OK && o.temp == 1e-9, "open minimum: 1e-9 accepted");
    st = parse(&o, src, pos, &npos, err, "--temp", "nan", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--temp: 'nan' is not a finite number"), "nan: '%s'",
          err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--temp", "inf", NULL);
    CHECK(st == K3_ERR_ARG, "inf rejected: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--temp", "-0.5", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--temp: -0.5 is outside 0..100"),
          "a negative value is taken as the value, then range-checked: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_PIPE", "maybe", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_ERR_ARG && strstr(err, "K3T_PIPE: 'maybe' is not a boolean"), "bool: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_PIPE", "off", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.pipe == 0, "K3T_PIPE=off -> 0");
    k3_opts_free(table, N_TABLE, &o);
    clear_env();
    st = parse(&o, src, pos, &npos, err, "--frobnicate", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "unknown option --frobnicate (see --help)"),
          "unknown: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "-x", NULL);
    CHECK(st == K3_ERR_ARG && strstr(err, "unknown option -x"), "unknown short: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--chunk", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--chunk: missing value (N)"), "missing: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);

    /* booleans and strings */
    st = parse(&o, src, pos, &npos, err, "--exact", "--model", "/m", "-h", NULL);
    CHECK(st == K3_OK && o.exact == 1 && o.help == 1 && o.model && !strcmp(o.model, "/m"),
          "bool flags take no value; --model /m; -h");
    k3_opts_free(table, N_TABLE, &o);
    CHECK(o.model == NULL, "k3_opts_free nulls strings");
    st = parse(&o, src, pos, &npos, err, "--exact=0", NULL);
    CHECK(st == K3_OK && o.exact == 0, "--exact=0");
    k3_opts_free(table, N_TABLE, &o);

    /* lists */
    st = parse(&o, src, pos, &npos, err, "--dirs", "/a,/b", NULL);
    CHECK(st == K3_OK && o.dirs.n == 2 && !strcmp(o.dirs.items[0], "/a") &&
              !strcmp(o.dirs.items[1], "/b"),
          "list /a,/b -> 2 items");
    k3_opts_free(table, N_TABLE, &o);
    CHECK(o.dirs.n == 0 && o.dirs.items == NULL, "k3_opts_free clears lists");
    st = parse(&o, src, pos, &npos, err, "--dirs", "a,b,c,d", NULL);
    CHECK(st == K3_ERR_LIMIT && !strcmp(err, "--dirs: 4 items > limit 3"), "list limit: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_DIRS", "a,,b", 1);
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3T_DIRS: item 2 of 'a,,b' is empty"),
          "empty list item: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* positionals, "-", "-5" and "--" */
    st = parse(&o, src, pos, &npos, err, "hello", "--chunk", "2", "-", "-5", "--", "--exact", NULL);
    CHECK(st == K3_OK && npos == 4 && !strcmp(pos[0], "hello") && !strcmp(pos[1], "-") &&
              !strcmp(pos[2], "-5") && !strcmp(pos[3], "--exact") && o.exact == 0 && o.chunk == 2,
          "positionals: hello - -5 and --exact after -- (n %d)", npos);
    k3_opts_free(table, N_TABLE, &o);

    /* enums: words in, the row's numbers out */
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.level == T_LEVEL_DEFAULT, "enum default 'info' -> %d", o.level);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_LEVEL", "debug", 1);
    int i_level = k3_opts_find(table, N_TABLE, "level");
    st = parse(&o, src, pos, &npos, err, NULL);
    CHECK(st == K3_OK && o.level == 10 && src[i_level] == K3_OPT_SRC_ENV,
          "enum K3T_LEVEL=debug -> 10 (%d)", o.level);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--level", "warn", NULL);
    CHECK(st == K3_OK && o.level == 30 && src[i_level] == K3_OPT_SRC_FLAG,
          "enum --level warn beats K3T_LEVEL=debug (%d)", o.level);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3T_LEVEL", "loud", 1);
    st = parse(&o, src, pos, &npos, err, "--level", "warn", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3T_LEVEL=loud: must be one of debug, info, warn"),
          "a bad enum variable is an error even under a flag, naming it and the words: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();
    st = parse(&o, src, pos, &npos, err, "--level=Info", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--level=Info: must be one of debug, info, warn"),
          "enum words are exact: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, src, pos, &npos, err, "--level", "20", NULL);
    CHECK(st == K3_ERR_ARG && strstr(err, "--level=20: must be one of"),
          "an enum takes no number: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    CHECK(!strcmp(K3_OPT_STR(T_LEVEL_DEFAULT), "20"),
          "K3_OPT_STR turns a #define into a default's text");

    /* k3_opts_set and k3_opts_find */
    int i_chunk = k3_opts_find(table, N_TABLE, "chunk");
    CHECK(i_chunk == 0 && k3_opts_find(table, N_TABLE, "nope") == -1, "k3_opts_find");
    memset(&o, 0, sizeof o);
    st = k3_opts_set(&table[i_chunk], &o, "513", K3_OPT_SRC_ENV, err, sizeof err);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3T_CHUNK: 513 is outside 1..512"),
          "k3_opts_set validates: '%s'", err);

    /* a default outside its own range is a table bug, reported as such */
    k3_opt bad = table[0];
    bad.def = "0";
    memset(&o, 0, sizeof o);
    st = k3_opts_parse(&bad, 1, &o, NULL, 1, (char *[]){"prog", NULL}, pos, &npos, err, sizeof err);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "default of chunk: 0 is outside 1..512"),
          "bad default: '%s'", err);

    /* --help text comes from the table */
    FILE *f = tmpfile();
    k3_opts_help(f, "usage: prog [options]", table, N_TABLE);
    long len = ftell(f);
    rewind(f);
    char *text = calloc(1, (size_t)len + 1);
    size_t got = fread(text, 1, (size_t)len, f);
    fclose(f);
    CHECK(got == (size_t)len && strstr(text, "usage: prog [options]") &&
              strstr(text, "--chunk N") &&
              strstr(text, "prefill chunk (K3T_CHUNK, default 32, 1..512)") &&
              strstr(text, "one of 4, 8, 32") && strstr(text, "alias K3T_COLI_TEMP") &&
              strstr(text, "-h, --help") && strstr(text, "environment only:") &&
              strstr(text, "K3T_PIPE=0|1") && strstr(text, "--level LEVEL") &&
              strstr(text, "verbosity (K3T_LEVEL, default info, one of debug, info, warn)"),
          "help lists flags, variables, defaults, ranges and env-only rows");
    free(text);

    TEST_MAIN_END();
}
