/* common/engine/engine_opts.h: the engine settings k3-coordinator and k3-worker share.
 *
 * Owns: the one definition of the options that configure the engine
 * (k3_model_opts): model directory, shard directories, load-time bits,
 * idot / exact, compute threads, the expert cache and its reader, the usage
 * history, K3_LAYERS, and the process-wide kernel and log levels (rows
 * defined by common/kernels/kernels.h and common/base/log.h). Each program
 * embeds a k3_engine_opts in its own option struct and puts
 * K3_ENGINE_OPT_MODEL / K3_ENGINE_OPT_ROWS in its table (common/base/opts.h),
 * so both programs accept the same flags and K3_* variables with the same
 * ranges, help and messages, and the numeric settings a worker reports in
 * HELLO mean what the coordinator's mean.
 * Borrows: the program's table and sources (read only). Strings and lists in
 * k3_engine_opts belong to the program's struct: k3_opts_free frees them.
 * Threads: main() only, before any thread starts.
 */
#ifndef K3_ENGINE_OPTS_H
#define K3_ENGINE_OPTS_H

#include <stddef.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/engine/model.h"
#include "common/base/opts.h"
#include "common/base/log.h"
#include "common/kernels/kernels.h"

typedef struct k3_engine_opts {
    char *model;        /* checkpoint directory */
    k3_opt_list dirs;   /* extra shard directories */
    int bits;           /* load-time bits of KDA, latent, shared, dense: 4, 8, 32 */
    int mla_bits;       /* load-time bits of MLA projections */
    int head_bits;      /* load-time bits of lm_head */
    int idot;           /* int8-activation expert kernels */
    int dense_idot;     /* int8-activation kernels for int8 / int4 dense matrices too */
    int exact;          /* bits 32/32/32 and idot 0 (k3_engine_opts_resolve) */
    int threads;        /* compute threads, 0 = online CPUs */
    double expert_gb;   /* routed-expert cache budget, GB */
    int direct;         /* O_DIRECT expert reads */
    int pipe;           /* overlap expert reads with compute */
    int load_threads;   /* expert loader threads */
    int read_depth;     /* striped expert reads in flight per drive, 0 = 2, -1 = off */
    double expert_topp; /* keep routed experts up to this cumulative weight, 0 = all */
    int max_layers;     /* truncate the stack to this many layers, 0 = all */
    char *usage;        /* usage history file; NULL = <cache dir>/<fp>/usage, "off" = none */
    int usage_save;     /* save the usage history at a clean exit */
    int mmap;           /* map a repacked container's prepared matrices read-only */
    int isa;            /* kernel level: K3_ISA_AUTO or a k3_isa (k3_engine_opts_apply) */
    int log_level;      /* a k3_log_level (k3_engine_opts_apply) */
    int quiet;          /* --quiet: warnings and errors only (beats log_level) */
    char *placement;    /* expert placement file (striping), NULL = none */
    int vk;             /* the Vulkan expert tier (docs/VULKAN.md) */
    int vk_device;      /* its physical device index */
    double vk_gb;       /* its budget, GB (10^9 bytes), 0 = the device's largest heap */
} k3_engine_opts;

/* Offset of engine field f inside the program's struct T, whose
 * k3_engine_opts member is m. */
#define K3_ENGINE_OFF(T, m, f) (offsetof(T, m) + offsetof(k3_engine_opts, f))

/* The --model row, first in both programs' --help. The rows are macros
 * because a static table cannot include another array; clang-format is off
 * for them since it cannot lay out a braced list inside a macro. */
// clang-format off
#define K3_ENGINE_OPT_MODEL(T, m)                                                                  \
    {.name = "model",                                                                              \
     .flag = "--model",                                                                            \
     .env = "K3_MODEL",                                                                            \
     .type = K3_OPT_STRING,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, model),                                                         \
     .metavar = "DIR",                                                                             \
     .help = "checkpoint directory (config.json, index, shards, tokenizer)"}

/* Every other engine row, in --help order. The variables are the original
 * engine's (docs/INTERFACES.md 3: K3_BITS, K3_IDOT, K3_TOPP, ...) plus K3_EXACT;
 * the defaults are docs/MODEL.md's and k3_model_opts_default's. */
#define K3_ENGINE_OPT_ROWS(T, m)                                                                   \
    {.name = "exact",                                                                              \
     .flag = "--exact",                                                                            \
     .env = "K3_EXACT",                                                                            \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, exact),                                                         \
     .help = "f32 weights and exact-float experts (bits 32/32/32, idot 0)"},                       \
    {.name = "threads",                                                                            \
     .flag = "--threads",                                                                          \
     .env = "K3_THREADS",                                                                          \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, threads),                                                       \
     .def = "0",                                                                                   \
     .min = 0,                                                                                     \
     .max = K3_MAX_THREADS,                                                                        \
     .metavar = "N",                                                                               \
     .help = "compute threads, 0 = online CPUs (or the pinned NUMA node's)"},                      \
    {.name = "dirs",                                                                               \
     .flag = "--dirs",                                                                             \
     .env = "K3_DIRS",                                                                             \
     .type = K3_OPT_LIST,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, dirs),                                                          \
     .max = K3_MAX_DIRS,                                                                           \
     .metavar = "D1,D2",                                                                           \
     .help = "extra shard directories (drives)"},                                                  \
    {.name = "bits",                                                                               \
     .flag = "--bits",                                                                             \
     .env = "K3_BITS",                                                                             \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, bits),                                                          \
     .def = "4",                                                                                   \
     .n_choices = 3,                                                                               \
     .choices = {4, 8, 32},                                                                        \
     .metavar = "B",                                                                               \
     .help = "load-time bits of KDA, latent, shared and dense matrices"},                          \
    {.name = "mla_bits",                                                                           \
     .flag = "--mla-bits",                                                                         \
     .env = "K3_MLA_BITS",                                                                         \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, mla_bits),                                                      \
     .def = "8",                                                                                   \
     .n_choices = 3,                                                                               \
     .choices = {4, 8, 32},                                                                        \
     .metavar = "B",                                                                               \
     .help = "load-time bits of MLA projections"},                                                 \
    {.name = "head_bits",                                                                          \
     .flag = "--head-bits",                                                                        \
     .env = "K3_HEAD_BITS",                                                                        \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, head_bits),                                                     \
     .def = "8",                                                                                   \
     .n_choices = 3,                                                                               \
     .choices = {4, 8, 32},                                                                        \
     .metavar = "B",                                                                               \
     .help = "load-time bits of lm_head (a worker has none; HELLO compares it)"},                  \
    {.name = "idot",                                                                               \
     .flag = "--idot",                                                                             \
     .env = "K3_IDOT",                                                                             \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, idot),                                                          \
     .def = "1",                                                                                   \
     .help = "int8-activation expert kernels (0 = exact float)"},                                  \
    {.name = "dense_idot",                                                                         \
     .flag = "--dense-idot",                                                                       \
     .env = "K3_DENSE_IDOT",                                                                       \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, dense_idot),                                                    \
     .def = "0",                                                                                   \
     .help = "int8-activation kernels for int8/int4 dense matrices too (faster; not docs/MODEL.md 4.2)"},   \
    {.name = "expert_gb",                                                                          \
     .flag = "--expert-gb",                                                                        \
     .env = "K3_EXPERT_GB",                                                                        \
     .type = K3_OPT_DOUBLE,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, expert_gb),                                                     \
     .def = "8",                                                                                   \
     .min = 0,                                                                                     \
     .max = 65536,                                                                                 \
     .metavar = "GB",                                                                              \
     .help = "routed-expert cache budget (local workers split it)"},                               \
    {.name = "direct",                                                                             \
     .flag = "--direct",                                                                           \
     .env = "K3_DIRECT",                                                                           \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, direct),                                                        \
     .def = "1",                                                                                   \
     .help = "O_DIRECT expert reads (0 = buffered)"},                                              \
    {.name = "placement",                                                                          \
     .flag = "--placement",                                                                        \
     .env = "K3_PLACEMENT",                                                                        \
     .type = K3_OPT_STRING,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, placement),                                                     \
     .metavar = "FILE",                                                                            \
     .help = "expert placement (k3-coordinator place): read each expert from the drive "           \
             "that holds it, all drives at once"},                                                 \
    {.name = "usage",                                                                              \
     .flag = "--usage",                                                                            \
     .env = "K3_USAGE",                                                                            \
     .env_alias = "COLI_USAGE",                                                                    \
     .type = K3_OPT_STRING,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, usage),                                                         \
     .metavar = "PATH",                                                                            \
     .help = "expert usage history: warms the cache at start, saved at a clean exit, "             \
             "each worker merging its layers' rows (default <cache>/<model fingerprint>/usage, "  \
             "<cache> = $K3_CACHE_DIR, else $XDG_CACHE_HOME/k3shard, else ~/.cache/k3shard; "     \
             "never the model directory; off = none)"},                                           \
    {.name = "usage_save",                                                                         \
     .env = "K3_USAGE_SAVE",                                                                       \
     .env_alias = "USAGE_SAVE",                                                                    \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, usage_save),                                                    \
     .def = "1",                                                                                   \
     .help = "save the expert usage history at a clean exit (0 = read only)"},                     \
    {.name = "mmap",                                                                               \
     .flag = "--mmap",                                                                             \
     .env = "K3_MMAP",                                                                             \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, mmap),                                                          \
     .def = "0",                                                                                   \
     .help = "map a repacked container's U8/F32 matrices read-only (file-backed, not heap); "      \
             "refuses a matrix that needs conversion"},                                            \
    {.name = "pipe",                                                                               \
     .env = "K3_PIPE",                                                                             \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, pipe),                                                          \
     .def = "1",                                                                                   \
     .help = "overlap expert reads with compute"},                                                 \
    {.name = "load_threads",                                                                       \
     .env = "K3_LOAD_THREADS",                                                                     \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, load_threads),                                                  \
     .def = "4",                                                                                   \
     .min = 1,                                                                                     \
     .max = K3_MAX_LOAD_THREADS,                                                                   \
     .metavar = "N",                                                                               \
     .help = "expert loader threads"},                                                             \
    {.name = "read_depth",                                                                         \
     .env = "K3_READ_DEPTH",                                                                       \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, read_depth),                                                    \
     .def = "0",                                                                                   \
     .min = -1,                                                                                    \
     .max = K3_MAX_LOAD_THREADS,                                                                   \
     .metavar = "N",                                                                               \
     .help = "with --placement: expert reads in flight per drive (0 = 2, -1 = off)"},             \
    {.name = "expert_topp",                                                                        \
     .env = "K3_TOPP",                                                                             \
     .type = K3_OPT_DOUBLE,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, expert_topp),                                                   \
     .def = "0",                                                                                   \
     .min = 0,                                                                                     \
     .max = 1,                                                                                     \
     .metavar = "P",                                                                               \
     .help = "keep routed experts up to this cumulative weight (0 = all)"},                        \
    {.name = "max_layers",                                                                         \
     .env = "K3_LAYERS",                                                                           \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, max_layers),                                                    \
     .def = "0",                                                                                   \
     .min = 0,                                                                                     \
     .max = K3_MAX_LAYERS,                                                                         \
     .metavar = "N",                                                                               \
     .help = "truncate the stack to N layers (no head: trace only), 0 = all"},                  \
    {.name = "vk",                                                                                 \
     .flag = "--vk",                                                                               \
     .env = "COLI_VULKAN",                                                                         \
     .env_alias = "K3_VK",                                                                         \
     .type = K3_OPT_BOOL,                                                                          \
     .offset = K3_ENGINE_OFF(T, m, vk),                                                            \
     .def = "0",                                                                                   \
     .help = "Vulkan expert tier: the hottest routed experts computed on the GPU (same tokens "    \
             "with --exact; docs/VULKAN.md)"},                                                     \
    {.name = "vk_device",                                                                          \
     .flag = "--vk-device",                                                                        \
     .env = "K3_VK_DEVICE",                                                                        \
     .type = K3_OPT_INT,                                                                           \
     .offset = K3_ENGINE_OFF(T, m, vk_device),                                                     \
     .def = "0",                                                                                   \
     .min = 0,                                                                                     \
     .max = 63,                                                                                    \
     .metavar = "N",                                                                               \
     .help = "Vulkan device index (vulkaninfo --summary order)"},                                  \
    {.name = "vk_gb",                                                                              \
     .flag = "--vk-gb",                                                                            \
     .env = "COLI_VK_TIER_GB",                                                                     \
     .env_alias = "K3_VK_GB",                                                                      \
     .type = K3_OPT_DOUBLE,                                                                        \
     .offset = K3_ENGINE_OFF(T, m, vk_gb),                                                         \
     .def = "0",                                                                                   \
     .min = 0,                                                                                     \
     .max = 65536,                                                                                 \
     .metavar = "GB",                                                                              \
     .help = "Vulkan tier budget in 10^9 bytes, 0 = the device's largest heap (local workers "     \
             "split it)"},                                                                         \
    K3_KERN_OPT_ISA(T, m.isa),                                                                     \
    K3_LOG_OPT_LEVEL(T, m.log_level),                                                              \
    K3_LOG_OPT_QUIET(T, m.quiet)
// clang-format on

/* Applies --exact after parsing: bits 32/32/32 and idot 0. A --bits,
 * --mla-bits, --head-bits other than 32 or --idot given as a flag together
 * with it is a usage error naming both (a variable is overridden quietly:
 * the environment may be shared with other runs). table/n_opts/src are the
 * program's table and the sources k3_opts_parse filled; the engine rows are
 * found by name. */
k3_status k3_engine_opts_resolve(k3_engine_opts *e, const k3_opt *table, int n_opts,
                                 const k3_opt_src *src, char *err, size_t errlen);

/* Applies the process-wide rows after parsing: the log level
 * (k3_log_set_level) and the kernel level (k3_isa_select). Both are read
 * before the table is parsed too (k3_log_init, the first kernel call), so
 * this only matters for a flag; call it before any thread starts. */
void k3_engine_opts_apply(const k3_engine_opts *e);

/* Copies the engine settings into mo (after k3_model_opts_default): model
 * directory, shard directories, max_layers, bits, idot, threads (when > 0),
 * the expert cache and reader, the usage history. usage_buf [usage_cap]
 * receives the history path (k3_usage_default_path when none was given,
 * "off" with a warning when that fails);
 * mo->usage_path points to it, or is NULL for "off" / "". mo borrows the
 * strings of e and usage_buf. bits_explicit is the caller's. */
/* usage_path.c: <cache directory>/<model fingerprint>/usage into out [cap],
 * the cache directory k3_cache_dir's (common/base/cache_dir.h: $K3_CACHE_DIR,
 * else $XDG_CACHE_HOME/k3shard, else ~/.cache/k3shard), the directories
 * created (mode 0700). Errors name the model's config when it cannot be
 * read, the variables when no cache directory is usable, or the directory
 * that cannot be created. */
k3_status k3_usage_default_path(const char *model_dir, int max_layers, double topp, char *out,
                                size_t cap, char *err, size_t errlen);

void k3_engine_opts_model(const k3_engine_opts *e, k3_model_opts *mo, char *usage_buf,
                          size_t usage_cap);

#endif
