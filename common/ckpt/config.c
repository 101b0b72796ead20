/* common/ckpt/config.c: config.json -> k3_config (docs/MODEL.md 1.1-1.2).
 *
 * The text is parsed with jansson (duplicate keys rejected), every key the
 * engine reads is fetched from "text_config" when that object exists (else
 * the root), checked for type and against common/base/limits.h, and the per-layer
 * schedules are derived. Nothing here allocates memory sized by the file
 * except jansson's tree, and the file's size is checked against
 * K3_MAX_CONFIG_BYTES before it is read.
 */
#include "common/ckpt/config.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- typed key access ---------------------------------------------------- */

/* Where a key was looked up, for messages ("text_config.hidden_size"). */
typedef struct cfg_ctx {
    json_t *model;     /* text_config or the root */
    const char *where; /* "text_config." or "" */
    char *err;
    size_t errlen;
} cfg_ctx;

static const char *json_type_word(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "unknown";
}

/* Reads an integral JSON number (an integer, or a real with an integral
 * value such as 4.0) into *out. Returns 0 if v is not such a number. */
static int json_as_i64(const json_t *v, long long *out) {
    if (json_is_integer(v)) {
        *out = (long long)json_integer_value(v);
        return 1;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        /* 2^53: beyond it a double no longer holds every integer */
        if (isfinite(d) && d == floor(d) && fabs(d) <= 9007199254740992.0) {
            *out = (long long)d;
            return 1;
        }
    }
    return 0;
}

/* A required integer key of `obj` (named `prefix``key` in messages) in
 * [lo, hi]. `limit_name` names the upper bound's constant. */
static k3_status get_int(const cfg_ctx *c, json_t *obj, const char *prefix, const char *key,
                         long long lo, long long hi, const char *limit_name, int *out) {
    json_t *v = json_object_get(obj, key);
    if (!v)
        return k3_errf(K3_ERR_MISSING, c->err, c->errlen,
                       "config.json: required key '%s%s' is missing", prefix, key);
    long long x;
    if (!json_as_i64(v, &x))
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: key '%s%s' must be an integer, got %s", prefix, key,
                       json_type_word(v));
    if (x < lo)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen, "config.json: %s%s = %lld < minimum %lld",
                       prefix, key, x, lo);
    if (x > hi)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: %s%s = %lld > limit %lld (%s)", prefix, key, x, hi,
                       limit_name);
    *out = (int)x;
    return K3_OK;
}

/* A float key: required (def == NULL) or optional with a default; must be
 * a finite number. */
static k3_status get_float(const cfg_ctx *c, json_t *obj, const char *prefix, const char *key,
                           const float *def, float *out) {
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (def) {
            *out = *def;
            return K3_OK;
        }
        return k3_errf(K3_ERR_MISSING, c->err, c->errlen,
                       "config.json: required key '%s%s' is missing", prefix, key);
    }
    if (!json_is_number(v))
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: key '%s%s' must be a number, got %s", prefix, key,
                       json_type_word(v));
    double d = json_number_value(v);
    if (!isfinite(d) || fabs(d) > 3.0e38)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: %s%s = %g is not a finite float", prefix, key, d);
    *out = (float)d;
    return K3_OK;
}

/* A token id (bos or one eos entry) in [0, vocab). */
static k3_status check_token(const cfg_ctx *c, const json_t *v, const char *key, int idx, int vocab,
                             int *out) {
    long long x;
    char nm[64];
    if (idx < 0)
        snprintf(nm, sizeof nm, "%s", key);
    else
        snprintf(nm, sizeof nm, "%s[%d]", key, idx);
    if (!json_as_i64(v, &x))
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: %s must be an integer token id, got %s", nm,
                       json_type_word(v));
    if (x < 0 || x >= vocab)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: %s = %lld outside the vocabulary [0, %d)", nm, x, vocab);
    *out = (int)x;
    return K3_OK;
}

/* bos_token_id / eos_token_id: the root first, then text_config. JSON null
 * counts as absent. */
static json_t *get_token_key(json_t *root, json_t *model, const char *key) {
    json_t *v = json_object_get(root, key);
    if ((!v || json_is_null(v)) && model != root) v = json_object_get(model, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* ---- schedules ----------------------------------------------------------- */

/* kda_layers: one-based, each in 1..n_layers, no repeats (a repeat means
 * the list was written by something confused; refuse rather than guess). */
static k3_status parse_kda_layers(const cfg_ctx *c, json_t *lin, k3_config *cfg) {
    json_t *arr = json_object_get(lin, "kda_layers");
    if (!arr)
        return k3_errf(K3_ERR_MISSING, c->err, c->errlen,
                       "config.json: required key '%slinear_attn_config.kda_layers' is missing",
                       c->where);
    if (!json_is_array(arr))
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: linear_attn_config.kda_layers must be an array, got %s",
                       json_type_word(arr));
    size_t n = json_array_size(arr);
    if (n > (size_t)cfg->n_layers_full)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: linear_attn_config.kda_layers has %zu entries > "
                       "num_hidden_layers %d",
                       n, cfg->n_layers_full);
    memset(cfg->is_kda, 0, sizeof cfg->is_kda);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(arr, i);
        long long x;
        if (!json_as_i64(e, &x))
            return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                           "config.json: linear_attn_config.kda_layers[%zu] must be an "
                           "integer, got %s",
                           i, json_type_word(e));
        if (x < 1 || x > cfg->n_layers_full)
            return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                           "config.json: linear_attn_config.kda_layers[%zu] = %lld outside "
                           "1..num_hidden_layers (%d); the list is one-based",
                           i, x, cfg->n_layers_full);
        if (cfg->is_kda[x - 1])
            return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                           "config.json: linear_attn_config.kda_layers[%zu] = %lld is listed "
                           "twice",
                           i, x);
        cfg->is_kda[x - 1] = 1;
    }
    return K3_OK;
}

/* docs/MODEL.md 1.2: dense below first_k_dense_replace, boundary when i % res_bs ==
 * 0. Computed over the full stack so truncation never changes them. */
static void derive_schedules(k3_config *cfg) {
    memset(cfg->is_moe, 0, sizeof cfg->is_moe);
    memset(cfg->is_boundary, 0, sizeof cfg->is_boundary);
    for (int i = 0; i < cfg->n_layers_full; i++) {
        cfg->is_moe[i] = i >= cfg->first_dense;
        cfg->is_boundary[i] = i % cfg->res_bs == 0;
    }
    cfg->qk_head = cfg->qk_nope + cfg->qk_rope;
    cfg->kda_proj = cfg->kda_heads * cfg->kda_hd;
    cfg->shared_inter = cfg->n_shared * cfg->moe_inter;
}

/* ---- the parse ----------------------------------------------------------- */

/* One row of the integer-key table: JSON key, field, range, limit name.
 * Positive dims have lo = 1; the two that may legitimately be 0 (no rope
 * slot, no shared expert) have lo = 0. first_k_dense_replace is checked
 * against n_layers after the table. */
typedef struct int_key {
    const char *key;
    size_t off;
    long long lo, hi;
    const char *limit;
} int_key;

#define F(field) offsetof(k3_config, field)
static const int_key k_model_ints[] = {
    {"hidden_size", F(hidden), 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"},
    {"num_hidden_layers", F(n_layers_full), 1, K3_MAX_LAYERS, "K3_MAX_LAYERS"},
    {"vocab_size", F(vocab), 1, K3_MAX_VOCAB, "K3_MAX_VOCAB"},
    {"first_k_dense_replace", F(first_dense), 0, K3_MAX_LAYERS, "K3_MAX_LAYERS"},
    {"intermediate_size", F(dense_inter), 1, K3_MAX_INTER, "K3_MAX_INTER"},
    {"num_attention_heads", F(n_heads), 1, K3_MAX_HEADS, "K3_MAX_HEADS"},
    {"q_lora_rank", F(q_lora), 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"},
    {"kv_lora_rank", F(kv_lora), 1, K3_MAX_KV_LORA, "K3_MAX_KV_LORA"},
    {"qk_nope_head_dim", F(qk_nope), 1, K3_MAX_HEAD_DIM, "K3_MAX_HEAD_DIM"},
    {"qk_rope_head_dim", F(qk_rope), 0, K3_MAX_HEAD_DIM, "K3_MAX_HEAD_DIM"},
    {"v_head_dim", F(v_head), 1, K3_MAX_HEAD_DIM, "K3_MAX_HEAD_DIM"},
    {"num_experts", F(n_experts), 1, K3_MAX_EXPERTS, "K3_MAX_EXPERTS"},
    {"num_experts_per_token", F(topk), 1, K3_MAX_TOPK, "K3_MAX_TOPK"},
    {"moe_intermediate_size", F(moe_inter), 1, K3_MAX_INTER, "K3_MAX_INTER"},
    {"routed_expert_hidden_size", F(latent), 32, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"},
    {"num_shared_experts", F(n_shared), 0, K3_MAX_EXPERTS, "K3_MAX_EXPERTS"},
    {"attn_res_block_size", F(res_bs), 1, K3_MAX_LAYERS, "K3_MAX_LAYERS"},
};
static const int_key k_linear_ints[] = {
    {"num_heads", F(kda_heads), 1, K3_MAX_HEADS, "K3_MAX_HEADS"},
    {"head_dim", F(kda_hd), 1, K3_MAX_KDA_HD, "K3_MAX_KDA_HD"},
    {"short_conv_kernel_size", F(conv_k), 1, K3_MAX_CONV_K, "K3_MAX_CONV_K"},
};
#undef F

static k3_status get_int_table(const cfg_ctx *c, json_t *obj, const char *prefix,
                               const int_key *tab, size_t n, k3_config *cfg) {
    for (size_t i = 0; i < n; i++) {
        int *field = (int *)((char *)cfg + tab[i].off);
        k3_status st =
            get_int(c, obj, prefix, tab[i].key, tab[i].lo, tab[i].hi, tab[i].limit, field);
        if (st) return st;
    }
    return K3_OK;
}

/* Cross-key rules of docs/MODEL.md 1.1 that one key's range cannot express. */
static k3_status check_relations(const cfg_ctx *c, const k3_config *cfg) {
    if (cfg->topk > cfg->n_experts)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: num_experts_per_token = %d > num_experts = %d", cfg->topk,
                       cfg->n_experts);
    if (cfg->first_dense > cfg->n_layers_full)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: first_k_dense_replace = %d > num_hidden_layers = %d",
                       cfg->first_dense, cfg->n_layers_full);
    if (cfg->latent % 32)
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: routed_expert_hidden_size = %d is not a multiple of 32 "
                       "(MXFP4 group size)",
                       cfg->latent);
    if (cfg->moe_inter % 32)
        return k3_errf(K3_ERR_FORMAT, c->err, c->errlen,
                       "config.json: moe_intermediate_size = %d is not a multiple of 32 "
                       "(MXFP4 group size)",
                       cfg->moe_inter);
    /* AttnRes keeps one entry per block plus the current partial sum. */
    int entries = (cfg->n_layers_full + cfg->res_bs - 1) / cfg->res_bs + 1;
    if (entries > K3_MAX_RES_ENTRIES)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: ceil(num_hidden_layers %d / attn_res_block_size %d) + 1 = "
                       "%d > limit %d (K3_MAX_RES_ENTRIES)",
                       cfg->n_layers_full, cfg->res_bs, entries, K3_MAX_RES_ENTRIES);
    /* The fused shared expert is one matrix of n_shared * moe_inter rows. */
    if ((long long)cfg->n_shared * cfg->moe_inter > K3_MAX_INTER)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: num_shared_experts %d x moe_intermediate_size %d = %lld > "
                       "limit %d (K3_MAX_INTER)",
                       cfg->n_shared, cfg->moe_inter, (long long)cfg->n_shared * cfg->moe_inter,
                       K3_MAX_INTER);
    if (!(cfg->eps > 0.0f) || cfg->eps >= 1.0f)
        return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                       "config.json: rms_norm_eps = %g outside (0, 1)", (double)cfg->eps);
    return K3_OK;
}

static k3_status parse_tokens(const cfg_ctx *c, json_t *root, k3_config *cfg) {
    cfg->bos = -1;
    cfg->n_eos = 0;
    json_t *v = get_token_key(root, c->model, "bos_token_id");
    if (v) {
        k3_status st = check_token(c, v, "bos_token_id", -1, cfg->vocab, &cfg->bos);
        if (st) return st;
    }
    v = get_token_key(root, c->model, "eos_token_id");
    if (!v) return K3_OK;
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if (n > K3_MAX_EOS)
            return k3_errf(K3_ERR_LIMIT, c->err, c->errlen,
                           "config.json: eos_token_id has %zu entries > limit %d (K3_MAX_EOS)", n,
                           K3_MAX_EOS);
        for (size_t i = 0; i < n; i++) {
            k3_status st = check_token(c, json_array_get(v, i), "eos_token_id", (int)i, cfg->vocab,
                                       &cfg->eos[i]);
            if (st) return st;
        }
        cfg->n_eos = (int)n;
        return K3_OK;
    }
    k3_status st = check_token(c, v, "eos_token_id", -1, cfg->vocab, &cfg->eos[0]);
    if (st) return st;
    cfg->n_eos = 1;
    return K3_OK;
}

static k3_status parse_tree(k3_config *cfg, json_t *root, int max_layers, char *err,
                            size_t errlen) {
    cfg_ctx c = {root, "", err, errlen};
    json_t *tc = json_object_get(root, "text_config");
    if (tc && !json_is_null(tc)) {
        if (!json_is_object(tc))
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "config.json: text_config must be an object, got %s",
                           json_type_word(tc));
        c.model = tc;
        c.where = "text_config.";
    }

    k3_status st = get_int_table(&c, c.model, c.where, k_model_ints,
                                 sizeof k_model_ints / sizeof k_model_ints[0], cfg);
    if (st) return st;
    static const float eps_def = 1e-5f, gate_def = -5.0f;
    if ((st = get_float(&c, c.model, c.where, "activation_situ_beta", NULL, &cfg->situ_b1)) ||
        (st =
             get_float(&c, c.model, c.where, "activation_situ_linear_beta", NULL, &cfg->situ_b2)) ||
        (st = get_float(&c, c.model, c.where, "rms_norm_eps", &eps_def, &cfg->eps)))
        return st;

    json_t *lin = json_object_get(c.model, "linear_attn_config");
    if (!lin)
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "config.json: required key '%slinear_attn_config' is missing", c.where);
    if (!json_is_object(lin))
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "config.json: linear_attn_config must be an object, got %s",
                       json_type_word(lin));
    char lprefix[64];
    snprintf(lprefix, sizeof lprefix, "%slinear_attn_config.", c.where);
    st = get_int_table(&c, lin, lprefix, k_linear_ints,
                       sizeof k_linear_ints / sizeof k_linear_ints[0], cfg);
    if (st) return st;
    if ((st = get_float(&c, lin, lprefix, "gate_lower_bound", &gate_def, &cfg->gate_lb))) return st;

    if ((st = check_relations(&c, cfg))) return st;
    if ((st = parse_kda_layers(&c, lin, cfg))) return st;
    if ((st = parse_tokens(&c, root, cfg))) return st;

    derive_schedules(cfg);
    cfg->n_layers = cfg->n_layers_full;
    if (max_layers > 0 && max_layers < cfg->n_layers_full) cfg->n_layers = max_layers;
    return K3_OK;
}

k3_status k3_config_parse(k3_config *cfg, const char *json, size_t len, int max_layers, char *err,
                          size_t errlen) {
    K3_ASSERT(cfg && (json || !len));
    if (len > K3_MAX_CONFIG_BYTES)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "config.json: %zu bytes > limit %u (K3_MAX_CONFIG_BYTES)", len,
                       K3_MAX_CONFIG_BYTES);
    json_error_t jerr;
    json_t *root = json_loadb(json ? json : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "config.json: invalid JSON at line %d column %d: %s", jerr.line, jerr.column,
                       jerr.text);
    k3_status st;
    if (!json_is_object(root)) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "config.json: top level must be an object, got %s",
                     json_type_word(root));
    } else {
        /* Parse into a scratch copy so a failed parse leaves *cfg untouched. */
        k3_config tmp;
        memset(&tmp, 0, sizeof tmp);
        st = parse_tree(&tmp, root, max_layers, err, errlen);
        if (st == K3_OK) *cfg = tmp;
    }
    json_decref(root);
    return st;
}

k3_status k3_config_load(k3_config *cfg, const char *dir, int max_layers, char *err,
                         size_t errlen) {
    char path[4096];
    int pl = snprintf(path, sizeof path, "%s/config.json", dir);
    if (pl < 0 || (size_t)pl >= sizeof path)
        return k3_errf(K3_ERR_ARG, err, errlen, "model dir path too long (%d bytes)", pl);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return k3_errf(errno == ENOENT ? K3_ERR_MISSING : K3_ERR_IO, err, errlen,
                       "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: not a regular file", path);
    }
    /* The size limit is checked before the buffer exists. */
    if ((unsigned long long)sb.st_size > K3_MAX_CONFIG_BYTES) {
        close(fd);
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %lld bytes > limit %u (K3_MAX_CONFIG_BYTES)",
                       path, (long long)sb.st_size, K3_MAX_CONFIG_BYTES);
    }
    size_t n = (size_t)sb.st_size;
    char *buf = malloc(n ? n : 1);
    if (!buf) {
        close(fd);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "%s: cannot allocate %zu bytes", path, n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    int rerr = errno;
    close(fd);
    if (got != n) {
        free(buf);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: short read: got %zu of %zu bytes (%s)", path,
                       got, n, got < n && rerr ? strerror(rerr) : "file shrank");
    }
    k3_status st = k3_config_parse(cfg, buf, n, max_layers, err, errlen);
    free(buf);
    return st;
}

int k3_config_snapshots_before(const k3_config *cfg, int layer_end) {
    if (layer_end > cfg->n_layers_full) layer_end = cfg->n_layers_full;
    int n = 0;
    for (int i = 0; i < layer_end; i++) n += cfg->is_boundary[i];
    return n;
}

/* ---- fingerprint ---------------------------------------------------------- */

/* FNV-1a 64 over fixed-width little-endian encodings of each field, in
 * declaration order, so the result does not depend on struct padding, host
 * byte order or compiler. Floats are hashed by their bit pattern. */
typedef struct fnv {
    uint64_t h;
} fnv;

static void fnv_bytes(fnv *f, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        f->h ^= b[i];
        f->h *= 0x100000001b3ull;
    }
}

static void fnv_u32(fnv *f, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fnv_bytes(f, b, 4);
}

static void fnv_i32(fnv *f, int v) { fnv_u32(f, (uint32_t)v); }

static void fnv_f32(fnv *f, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    fnv_u32(f, u);
}

uint64_t k3_config_fingerprint(const k3_config *cfg) {
    fnv f = {0xcbf29ce484222325ull};
    const int ints[] = {cfg->hidden,      cfg->n_layers,  cfg->vocab,  cfg->first_dense,
                        cfg->dense_inter, cfg->n_heads,   cfg->q_lora, cfg->kv_lora,
                        cfg->qk_nope,     cfg->qk_rope,   cfg->v_head, cfg->n_experts,
                        cfg->topk,        cfg->moe_inter, cfg->latent, cfg->n_shared,
                        cfg->res_bs};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) fnv_i32(&f, ints[i]);
    fnv_f32(&f, cfg->situ_b1);
    fnv_f32(&f, cfg->situ_b2);
    fnv_f32(&f, cfg->eps);
    fnv_i32(&f, cfg->kda_heads);
    fnv_i32(&f, cfg->kda_hd);
    fnv_i32(&f, cfg->conv_k);
    fnv_f32(&f, cfg->gate_lb);
    fnv_i32(&f, cfg->bos);
    fnv_i32(&f, cfg->n_eos);
    for (int i = 0; i < cfg->n_eos && i < K3_MAX_EOS; i++) fnv_i32(&f, cfg->eos[i]);
    /* schedules over the full stack (they never depend on truncation) */
    int nl = cfg->n_layers_full < K3_MAX_LAYERS ? cfg->n_layers_full : K3_MAX_LAYERS;
    if (nl > 0) {
        fnv_bytes(&f, cfg->is_kda, (size_t)nl);
        fnv_bytes(&f, cfg->is_moe, (size_t)nl);
        fnv_bytes(&f, cfg->is_boundary, (size_t)nl);
    }
    fnv_i32(&f, cfg->qk_head);
    fnv_i32(&f, cfg->kda_proj);
    fnv_i32(&f, cfg->shared_inter);
    fnv_i32(&f, cfg->n_layers_full);
    return f.h;
}
