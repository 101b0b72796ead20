/* tests/test_engine_opts.c: the engine rows both programs share
 * (common/engine/engine_opts.h): embedded at a non-zero offset of a program's
 * struct, defaults, flags and variables land in the right fields, --exact
 * and its conflicts, the copy into k3_model_opts and the usage path, the
 * cache directory's precedence (common/base/cache_dir.h: K3_CACHE_DIR over
 * XDG_CACHE_HOME over HOME, a relative K3_CACHE_DIR refused naming it),
 * --help listing every row, the process-wide rows (--log-level / K3_LOG,
 * --isa / K3_ISA) and their application, and the coordinator's link rows
 * (heartbeat, back-offs, resumes), whose defaults must be
 * k3_cluster_opts_default's. */
#include <stdarg.h>
#include <sys/stat.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/cache_dir.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/engine/engine_opts.h"
#include "common/engine/model.h"
#include "common/kernels/kernels.h"
#include "coordinator/cluster.h"
#include "proto/link.h"
#include "tests/test.h"

/* A program's struct: own fields around the embedded engine settings, so a
 * wrong offset shows up as a clobbered neighbour. */
typedef struct popts {
    int before;
    k3_engine_opts eng;
    int after;
} popts;

static const k3_opt table[] = {
    {.name = "before",
     .flag = "--before",
     .type = K3_OPT_INT,
     .offset = offsetof(popts, before),
     .def = "7",
     .min = 0,
     .max = 100,
     .help = "a program's own row"},
    K3_ENGINE_OPT_MODEL(popts, eng),
    K3_ENGINE_OPT_ROWS(popts, eng),
    {.name = "after",
     .flag = "--after",
     .type = K3_OPT_INT,
     .offset = offsetof(popts, after),
     .def = "9",
     .min = 0,
     .max = 100,
     .help = "another own row"},
};
#define N_TABLE ((int)(sizeof table / sizeof table[0]))

static void clear_env(void) {
    const char *vars[] = {"K3_MODEL",         "K3_EXACT",         "K3_THREADS",
                          "K3_DIRS",          "K3_BITS",          "K3_MLA_BITS",
                          "K3_HEAD_BITS",     "K3_IDOT",          "K3_EXPERT_GB",
                          "K3_DIRECT",        "K3_USAGE",         "COLI_USAGE",
                          "K3_USAGE_SAVE",    "USAGE_SAVE",       "K3_PIPE",
                          "K3_LOAD_THREADS",  "K3_TOPP",          "K3_LAYERS",
                          "K3_DENSE_IDOT",    "K3_LOG",           "K3_ISA",
                          "K3_HB_MS",         "K3_RESUMES",       "K3_RESUME_WAIT_MS",
                          "K3_RETRY_LOST_MS", "K3_RETRY_OPEN_MS", "K3_RETRY_REFUSED_MS",
                          "K3_HELLO_MIN_MS",  "K3_HANDSHAKE_MS",  "K3_CACHE_DIR"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

static k3_status parse(popts *o, char *err, const char *a0, ...);

/* The coordinator's link rows, as its table has them. */
typedef struct lopts {
    int hb_ms;
    k3_cluster_retry retry;
} lopts;

static const k3_opt link_table[] = {
    K3_LINK_OPT_HB_MS(lopts, hb_ms),
    K3_CLUSTER_OPT_RETRY_ROWS(lopts, retry),
};
#define N_LINK ((int)(sizeof link_table / sizeof link_table[0]))

static k3_status parse_link(lopts *o, char *err, const char *a0, ...) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "prog";
    va_list ap;
    va_start(ap, a0);
    for (const char *a = a0; a && argc < 31; a = va_arg(ap, const char *)) argv[argc++] = (char *)a;
    va_end(ap);
    argv[argc] = NULL;
    char *pos[32];
    int npos = 0;
    memset(o, 0, sizeof *o);
    err[0] = 0;
    return k3_opts_parse(link_table, N_LINK, o, NULL, argc, argv, pos, &npos, err, 256);
}

/* The log level and ISA rows, and the link rows (one default each). */
static void test_process_and_link_rows(void) {
    popts o;
    char err[256];
    k3_status st;
    clear_env();
    st = parse(&o, err, NULL);
    CHECK(st == K3_OK && o.eng.log_level == K3_LOG_INFO && o.eng.isa == K3_ISA_AUTO,
          "defaults: log level info, isa auto (%s)", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3_LOG", "warn", 1);
    setenv("K3_ISA", "scalar", 1);
    st = parse(&o, err, NULL);
    CHECK(st == K3_OK && o.eng.log_level == K3_LOG_WARN && o.eng.isa == K3_ISA_SCALAR,
          "K3_LOG=warn, K3_ISA=scalar (%s)", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, err, "--log-level", "debug", "--isa=avx2", NULL);
    CHECK(st == K3_OK && o.eng.log_level == K3_LOG_DEBUG && o.eng.isa == K3_ISA_AVX2,
          "--log-level debug and --isa=avx2 beat the variables (%s)", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3_LOG", "verbose", 1);
    st = parse(&o, err, "--log-level", "debug", NULL);
    CHECK(st == K3_ERR_ARG &&
              !strcmp(err, "K3_LOG=verbose: must be one of debug, info, warn, error"),
          "a bad K3_LOG is an error naming the variable, the value and the levels: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    unsetenv("K3_LOG");
    setenv("K3_ISA", "sse", 1);
    st = parse(&o, err, NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3_ISA=sse: must be one of auto, scalar, avx2, avx512"),
          "a bad K3_ISA: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* applying them: what main() does after parsing */
    st = parse(&o, err, "--log-level", "error", "--isa", "scalar", NULL);
    k3_engine_opts_apply(&o.eng);
    CHECK(st == K3_OK && !k3_log_enabled(K3_LOG_WARN) && k3_log_enabled(K3_LOG_ERROR) &&
              k3_isa_active() == K3_ISA_SCALAR,
          "k3_engine_opts_apply: log level error, scalar kernels (active %s)",
          k3_isa_name(k3_isa_active()));
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, err, NULL);
    k3_engine_opts_apply(&o.eng);
    CHECK(st == K3_OK && k3_log_enabled(K3_LOG_INFO) && k3_isa_active() == k3_isa_detect(),
          "defaults applied: info, the detected level (%s)", k3_isa_name(k3_isa_active()));
    k3_opts_free(table, N_TABLE, &o);

    /* link rows: the table's defaults are the cluster's */
    lopts l;
    k3_cluster_opts co;
    k3_cluster_opts_default(&co);
    st = parse_link(&l, err, NULL);
    CHECK(st == K3_OK && l.hb_ms == co.hb_ms && l.hb_ms == K3_LINK_HB_MS_DEFAULT &&
              !memcmp(&l.retry, &co.retry, sizeof l.retry),
          "link rows: defaults = k3_cluster_opts_default's (hb %d, resumes %d, wait %d ms)",
          l.hb_ms, l.retry.resumes, l.retry.resume_wait_ms);
    CHECK(l.retry.resumes == 3 && l.retry.resume_wait_ms == 60000 && l.retry.lost_ms == 100 &&
              l.retry.open_ms == 1000 && l.retry.refused_ms == 5000 &&
              l.retry.hello_min_ms == 2000 && l.retry.handshake_ms == 5000 &&
              co.step_timeout_ms == 30000 && co.ready_timeout_ms == 600000,
          "the values the code had: 3 resumes x 60 s, retries 100/1000/5000 ms, HELLO >= 2 s, "
          "handshake 5 s, step 30 s, ready 600 s");
    setenv("K3_RESUMES", "5", 1);
    setenv("K3_RETRY_REFUSED_MS", "250", 1);
    setenv("K3_HB_MS", "200", 1);
    st = parse_link(&l, err, NULL);
    CHECK(st == K3_OK && l.retry.resumes == 5 && l.retry.refused_ms == 250 && l.hb_ms == 200,
          "K3_RESUMES=5, K3_RETRY_REFUSED_MS=250, K3_HB_MS=200 (%s)", err);
    st = parse_link(&l, err, "--resumes", "0", "--hb-ms", "300", NULL);
    CHECK(st == K3_OK && l.retry.resumes == 0 && l.hb_ms == 300,
          "--resumes 0 and --hb-ms 300 beat the variables (%s)", err);
    clear_env();
    st = parse_link(&l, err, "--hb-ms", "19001", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--hb-ms: 19001 is outside 100..19000"),
          "the heartbeat range is K3_LINK_HB_MS_MIN..MAX: '%s'", err);
    setenv("K3_HELLO_MIN_MS", "50", 1);
    st = parse_link(&l, err, NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3_HELLO_MIN_MS: 50 is outside 100..600000"),
          "K3_HELLO_MIN_MS=50: '%s'", err);
    clear_env();
    k3_link_sockopts so = {.hb_ms = K3_LINK_HB_MS_MAX + 1};
    st = k3_link_sockopts_apply(NULL, &so, err, sizeof err);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "heartbeat interval 19001 ms outside [100, 19000]"),
          "k3_link_sockopts_apply checks the same range: '%s'", err);
}

/* Parses a NULL-terminated argument list (argv[0] added) and resolves
 * --exact, as both programs' main() do. */
static k3_status parse(popts *o, char *err, const char *a0, ...) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "prog";
    va_list ap;
    va_start(ap, a0);
    for (const char *a = a0; a && argc < 31; a = va_arg(ap, const char *)) argv[argc++] = (char *)a;
    va_end(ap);
    argv[argc] = NULL;
    char *pos[32];
    int npos = 0;
    k3_opt_src src[N_TABLE];
    memset(o, 0, sizeof *o);
    err[0] = 0;
    k3_status st = k3_opts_parse(table, N_TABLE, o, src, argc, argv, pos, &npos, err, 256);
    if (!st) st = k3_engine_opts_resolve(&o->eng, table, N_TABLE, src, err, 256);
    return st;
}

/* k3_cache_dir's precedence, each directory under a temporary root; HOME
 * and XDG_CACHE_HOME are restored after. */
static void test_cache_dir(void) {
    char root[64] = "/tmp/k3_cache_dir.XXXXXX", k3[128], xdg[128], home[128], want[256], dir[512],
         err[512];
    if (!mkdtemp(root)) {
        CHECK(0, "mkdtemp for the cache directories");
        return;
    }
    char *old_home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    char *old_xdg = getenv("XDG_CACHE_HOME") ? strdup(getenv("XDG_CACHE_HOME")) : NULL;
    snprintf(k3, sizeof k3, "%s/k3", root);
    snprintf(xdg, sizeof xdg, "%s/xdg", root);
    snprintf(home, sizeof home, "%s/home", root);
    struct stat sb;

    setenv("K3_CACHE_DIR", k3, 1);
    setenv("XDG_CACHE_HOME", xdg, 1);
    setenv("HOME", home, 1);
    k3_status st = k3_cache_dir(dir, sizeof dir, err, sizeof err);
    CHECK(st == K3_OK && !strcmp(dir, k3) && stat(k3, &sb) == 0 && (sb.st_mode & 0777) == 0700 &&
              stat(xdg, &sb) != 0,
          "K3_CACHE_DIR wins over XDG_CACHE_HOME and HOME, and is the directory itself (no "
          "/k3shard), created 0700: '%s' (%s)",
          dir, st ? err : "ok");
    /* the usage history follows it */
    popts o;
    char usage[600];
    k3_model_opts mo;
    st = parse(&o, err, "--model", t_tiny_dir(), NULL);
    k3_model_opts_default(&mo);
    k3_engine_opts_model(&o.eng, &mo, usage, sizeof usage);
    snprintf(want, sizeof want, "%s/", k3);
    CHECK(st == K3_OK && mo.usage_path == usage && !strncmp(usage, want, strlen(want)) &&
              strlen(usage) == strlen(want) + 16 + 6,
          "no --usage with K3_CACHE_DIR: $K3_CACHE_DIR/<fingerprint>/usage ('%s')", usage);
    k3_opts_free(table, N_TABLE, &o);

    unsetenv("K3_CACHE_DIR");
    st = k3_cache_dir(dir, sizeof dir, err, sizeof err);
    snprintf(want, sizeof want, "%s/k3shard", xdg);
    CHECK(st == K3_OK && !strcmp(dir, want) && stat(want, &sb) == 0 && S_ISDIR(sb.st_mode),
          "without K3_CACHE_DIR, XDG_CACHE_HOME wins over HOME: '%s' (%s)", dir, st ? err : "ok");

    unsetenv("XDG_CACHE_HOME");
    st = k3_cache_dir(dir, sizeof dir, err, sizeof err);
    snprintf(want, sizeof want, "%s/.cache/k3shard", home);
    CHECK(st == K3_OK && !strcmp(dir, want) && stat(want, &sb) == 0 && S_ISDIR(sb.st_mode),
          "without either, HOME/.cache/k3shard: '%s' (%s)", dir, st ? err : "ok");

    setenv("K3_CACHE_DIR", "rel/k3cache", 1);
    setenv("XDG_CACHE_HOME", xdg, 1);
    st = k3_cache_dir(dir, sizeof dir, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "K3_CACHE_DIR") && strstr(err, "'rel/k3cache'") &&
              strstr(err, "not an absolute path") && stat("rel", &sb) != 0,
          "a relative K3_CACHE_DIR is an error naming it, not a fallback: '%s'", err);
    st = parse(&o, err, "--model", t_tiny_dir(), NULL);
    k3_model_opts_default(&mo);
    k3_engine_opts_model(&o.eng, &mo, usage, sizeof usage);
    CHECK(st == K3_OK && mo.usage_path == NULL && !strcmp(usage, "off"),
          "no --usage with a relative K3_CACHE_DIR: no history, with a warning ('%s')", usage);
    k3_opts_free(table, N_TABLE, &o);

    unsetenv("K3_CACHE_DIR");
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", "relhome", 1);
    st = k3_cache_dir(dir, sizeof dir, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "K3_CACHE_DIR is not set") &&
              strstr(err, "XDG_CACHE_HOME is not set") && strstr(err, "HOME is 'relhome'"),
          "none usable: the error names the three variables: '%s'", err);

    if (old_home)
        setenv("HOME", old_home, 1);
    else
        unsetenv("HOME");
    if (old_xdg) setenv("XDG_CACHE_HOME", old_xdg, 1);
    free(old_home);
    free(old_xdg);
    snprintf(dir, sizeof dir, "rm -rf %s", root);
    if (system(dir) != 0) fprintf(stderr, "could not remove %s\n", root);
}

int main(void) {
    popts o;
    char err[256];
    k3_status st;
    clear_env();

    /* defaults: docs/INTERFACES.md 3's, in the embedded struct, neighbours intact */
    st = parse(&o, err, NULL);
    CHECK(st == K3_OK && o.before == 7 && o.after == 9 && o.eng.bits == 4 && o.eng.mla_bits == 8 &&
              o.eng.head_bits == 8 && o.eng.idot == 1 && !o.eng.exact && o.eng.threads == 0 &&
              o.eng.expert_gb == 8 && o.eng.direct == 1 && o.eng.pipe == 1 &&
              o.eng.load_threads == 4 && o.eng.expert_topp == 0 && o.eng.max_layers == 0 &&
              o.eng.usage_save == 1 && !o.eng.usage && !o.eng.model && o.eng.dirs.n == 0,
          "defaults: bits 4/8/8, idot 1, expert_gb 8, direct/pipe 1, 4 loaders, own rows 7/9 (%s)",
          err);
    k3_opts_free(table, N_TABLE, &o);

    /* every flag either program had, and the env-only variables */
    setenv("K3_TOPP", "0.5", 1);
    setenv("K3_LAYERS", "3", 1);
    setenv("K3_LOAD_THREADS", "2", 1);
    setenv("USAGE_SAVE", "0", 1); /* the alias */
    st = parse(&o, err, "--model", "/m", "--bits", "8", "--mla-bits", "32", "--head-bits", "4",
               "--idot=0", "--threads", "3", "--dirs", "a,b", "--expert-gb", "1.5", "--direct=0",
               "--usage", "off", "--before", "1", "--after", "2", NULL);
    CHECK(st == K3_OK && !strcmp(o.eng.model, "/m") && o.eng.bits == 8 && o.eng.mla_bits == 32 &&
              o.eng.head_bits == 4 && o.eng.idot == 0 && o.eng.threads == 3 && o.eng.dirs.n == 2 &&
              !strcmp(o.eng.dirs.items[1], "b") && o.eng.expert_gb == 1.5 && o.eng.direct == 0 &&
              !strcmp(o.eng.usage, "off") && o.eng.expert_topp == 0.5 && o.eng.max_layers == 3 &&
              o.eng.load_threads == 2 && o.eng.usage_save == 0 && o.before == 1 && o.after == 2,
          "flags of both programs and the variables land in the engine struct (%s)", err);

    /* the copy into k3_model_opts */
    k3_model_opts mo;
    k3_model_opts_default(&mo);
    char usage[256];
    k3_engine_opts_model(&o.eng, &mo, usage, sizeof usage);
    CHECK(!strcmp(mo.model_dir, "/m") && mo.n_dirs == 2 && !strcmp(mo.dirs[0], "a") &&
              mo.bits == 8 && mo.mla_bits == 32 && mo.head_bits == 4 && mo.idot == 0 &&
              mo.threads == 3 && mo.expert_gb == 1.5 && mo.direct == 0 && mo.pipe == 1 &&
              mo.load_threads == 2 && mo.topp == 0.5 && mo.max_layers == 3 &&
              mo.usage_path == NULL && mo.usage_save == 0,
          "k3_engine_opts_model copies every setting; --usage off means no history");
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    st = parse(&o, err, "--model", "/m", NULL);
    k3_model_opts_default(&mo);
    int threads_default = mo.threads;
    k3_engine_opts_model(&o.eng, &mo, usage, sizeof usage);
    CHECK(st == K3_OK && mo.usage_path == NULL && !strcmp(usage, "off") &&
              mo.threads == threads_default,
          "no --usage and no readable model: no history ('%s'), never <model>/.k3_usage; "
          "--threads 0 keeps the default %d",
          usage, mo.threads);
    k3_opts_free(table, N_TABLE, &o);
    /* the default is the cache's, named by the model fingerprint */
    {
        char cache[64] = "/tmp/reliability_cache.XXXXXX", want[256];
        const char *tiny = getenv("TINY") ? getenv("TINY") : "build/fixtures/tiny";
        if (mkdtemp(cache)) {
            setenv("XDG_CACHE_HOME", cache, 1);
            st = parse(&o, err, "--model", tiny, NULL);
            k3_model_opts_default(&mo);
            k3_engine_opts_model(&o.eng, &mo, usage, sizeof usage);
            snprintf(want, sizeof want, "%s/k3shard/", cache);
            size_t n = strlen(want);
            struct stat sb;
            char dir[300];
            snprintf(dir, sizeof dir, "%.*s", (int)(strlen(usage) > 6 ? strlen(usage) - 6 : 0),
                     usage);
            CHECK(st == K3_OK && mo.usage_path == usage && !strncmp(usage, want, n) &&
                      strlen(usage) == n + 16 + 6 && !strcmp(usage + n + 16, "/usage") &&
                      stat(dir, &sb) == 0 && (sb.st_mode & 0777) == 0700,
                  "no --usage: $XDG_CACHE_HOME/k3shard/<16 hex fingerprint>/usage, directory "
                  "0700 ('%s')",
                  usage);
            unsetenv("XDG_CACHE_HOME");
            rmdir(dir);
            snprintf(dir, sizeof dir, "%s/k3shard", cache);
            rmdir(dir);
            rmdir(cache);
        } else {
            CHECK(0, "mkdtemp for the cache directory");
        }
    }
    k3_opts_free(table, N_TABLE, &o);
    test_cache_dir();

    /* ranges are the one definition's */
    st = parse(&o, err, "--expert-gb", "70000", NULL);
    CHECK(st == K3_ERR_ARG && strstr(err, "--expert-gb: 70000 is outside 0..65536"),
          "--expert-gb 70000: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3_MLA_BITS", "5", 1);
    st = parse(&o, err, NULL);
    CHECK(st == K3_ERR_ARG && strstr(err, "K3_MLA_BITS=5: must be one of 4, 8, 32"),
          "K3_MLA_BITS=5: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* --exact: all f32, exact-float experts */
    setenv("K3_BITS", "8", 1); /* a variable is overridden quietly */
    st = parse(&o, err, "--exact", NULL);
    CHECK(st == K3_OK && o.eng.bits == 32 && o.eng.mla_bits == 32 && o.eng.head_bits == 32 &&
              o.eng.idot == 0,
          "--exact (K3_BITS=8 set): bits 32/32/32, idot 0 (%s)", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();
    st = parse(&o, err, "--exact", "--bits", "32", "--idot=0", NULL);
    CHECK(st == K3_OK && o.eng.bits == 32 && o.eng.idot == 0,
          "--exact with matching explicit flags is fine (what --local workers get) (%s)", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, err, "--exact", "--mla-bits", "8", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--exact conflicts with --mla-bits 8"),
          "--exact --mla-bits 8: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, err, "--exact", "--dense-idot", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "--exact conflicts with --dense-idot"),
          "--exact --dense-idot: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    setenv("K3_DENSE_IDOT", "1", 1);
    st = parse(&o, err, "--exact", NULL);
    CHECK(st == K3_OK && o.eng.dense_idot == 0 && o.eng.idot == 0,
          "K3_DENSE_IDOT=1 --exact: the variable yields to --exact (%s)", st ? err : "ok");
    k3_opts_free(table, N_TABLE, &o);
    st = parse(&o, err, NULL);
    k3_model_opts mo2;
    k3_model_opts_default(&mo2);
    char ub[64];
    if (!st) k3_engine_opts_model(&o.eng, &mo2, ub, sizeof ub);
    CHECK(st == K3_OK && o.eng.dense_idot == 1 && mo2.dense_idot == 1,
          "K3_DENSE_IDOT=1 reaches the model options (%s)", st ? err : "ok");
    k3_opts_free(table, N_TABLE, &o);
    unsetenv("K3_DENSE_IDOT");
    setenv("K3_EXACT", "1", 1);
    st = parse(&o, err, "--idot", NULL);
    CHECK(st == K3_ERR_ARG && !strcmp(err, "K3_EXACT conflicts with --idot"),
          "K3_EXACT=1 --idot: '%s'", err);
    k3_opts_free(table, N_TABLE, &o);
    clear_env();

    /* --help lists every engine row: flags, and the env-only variables */
    FILE *f = tmpfile();
    k3_opts_help(f, "usage: prog", table, N_TABLE);
    rewind(f);
    char text[16384];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    const char *want[] = {"--model DIR",
                          "--exact",
                          "--threads N",
                          "--dirs D1,D2",
                          "--bits B",
                          "--mla-bits B",
                          "--head-bits B",
                          "--idot[=0]",
                          "--expert-gb",
                          "--direct[=0]",
                          "--usage PATH",
                          "K3_USAGE_SAVE=0|1",
                          "K3_PIPE=0|1",
                          "K3_TOPP=P",
                          "K3_LOAD_THREADS",
                          "K3_LAYERS=N",
                          "--isa ISA",
                          "--log-level LEVEL",
                          "(K3_LOG, default info, one of debug, info, warn, error)"};
    int missing = -1;
    for (int i = 0; i < (int)(sizeof want / sizeof want[0]) && missing < 0; i++)
        if (!strstr(text, want[i])) missing = i;
    CHECK(missing < 0, "--help lists every engine row%s%s", missing < 0 ? "" : ", missing ",
          missing < 0 ? "" : want[missing]);

    /* row names are unique, one spelling each */
    int dup = 0;
    for (int i = 0; i < N_TABLE; i++) dup |= k3_opts_find(table, N_TABLE, table[i].name) != i;
    CHECK(!dup && k3_opts_find(table, N_TABLE, "mla_bits") >= 0 &&
              k3_opts_find(table, N_TABLE, "mla-bits") < 0,
          "row names unique; 'mla_bits' is the one spelling");
    test_process_and_link_rows();
    TEST_MAIN_END();
}
