/* tests/test_config.c: config.json parsing, limits and schedules
 * (docs/MODEL.md 1.1-1.2). Configs are generated from a table of
 * the real K3 values, with one key overridden or removed per case. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "tests/test.h"

typedef struct kv {
    const char *key;
    const char *val;
} kv;

/* Real K3 values (docs/MODEL.md 1.1). kda_layers is generated. */
static const kv k_model[] = {
    {"hidden_size", "7168"},
    {"num_hidden_layers", "93"},
    {"vocab_size", "163840"},
    {"first_k_dense_replace", "1"},
    {"intermediate_size", "33792"},
    {"num_attention_heads", "96"},
    {"q_lora_rank", "1536"},
    {"kv_lora_rank", "512"},
    {"qk_nope_head_dim", "128"},
    {"qk_rope_head_dim", "64"},
    {"v_head_dim", "128"},
    {"num_experts", "896"},
    {"num_experts_per_token", "16"},
    {"moe_intermediate_size", "3072"},
    {"routed_expert_hidden_size", "3584"},
    {"num_shared_experts", "2"},
    {"attn_res_block_size", "12"},
    {"activation_situ_beta", "4.0"},
    {"activation_situ_linear_beta", "25.0"},
    {"rms_norm_eps", "1e-05"},
};
#define N_MODEL (sizeof k_model / sizeof k_model[0])
static const kv k_lin[] = {
    {"num_heads", "96"},          {"head_dim", "128"},  {"short_conv_kernel_size", "4"},
    {"gate_lower_bound", "-5.0"}, {"kda_layers", NULL}, /* generated: 1..92 except multiples of 4 */
};
#define N_LIN (sizeof k_lin / sizeof k_lin[0])

static char g_kda[1024];

static void make_kda_list(void) {
    size_t o = 0;
    o += (size_t)snprintf(g_kda + o, sizeof g_kda - o, "[");
    int first = 1;
    for (int j = 1; j <= 92; j++) {
        if (j % 4 == 0) continue;
        o += (size_t)snprintf(g_kda + o, sizeof g_kda - o, "%s%d", first ? "" : ",", j);
        first = 0;
    }
    snprintf(g_kda + o, sizeof g_kda - o, "]");
}

/* Builds a config. text_config != 0 nests the model keys under
 * "text_config". okey names one key to override with oval (NULL: remove);
 * linear_attn_config keys are written "lin.<key>". root_extra and tc_extra
 * are raw JSON members appended to the root / model object ("" for none). */
static const char *build(char *buf, size_t len, int text_config, const char *okey, const char *oval,
                         const char *root_extra, const char *tc_extra) {
    size_t o = 0;
#define OUT(...) o += (size_t)snprintf(buf + o, len - o, __VA_ARGS__)
    OUT("{\"model_type\":\"kimi_k3\"");
    if (root_extra && *root_extra) OUT(",%s", root_extra);
    if (text_config) OUT(",\"text_config\":{\"x\":0");
    for (size_t i = 0; i < N_MODEL; i++) {
        const char *v = k_model[i].val;
        if (okey && strcmp(okey, k_model[i].key) == 0) {
            if (!oval) continue;
            v = oval;
        }
        OUT(",\"%s\":%s", k_model[i].key, v);
    }
    if (tc_extra && *tc_extra) OUT(",%s", tc_extra);
    if (!(okey && strcmp(okey, "linear_attn_config") == 0 && !oval)) {
        OUT(",\"linear_attn_config\":{\"full_attn_layers\":[4]");
        for (size_t i = 0; i < N_LIN; i++) {
            const char *v = k_lin[i].val ? k_lin[i].val : g_kda;
            char lk[96];
            snprintf(lk, sizeof lk, "lin.%s", k_lin[i].key);
            if (okey && strcmp(okey, lk) == 0) {
                if (!oval) continue;
                v = oval;
            }
            OUT(",\"%s\":%s", k_lin[i].key, v);
        }
        OUT("}");
    }
    if (text_config) OUT("}");
    OUT("}");
#undef OUT
    return buf;
}

static char g_buf[16384];
static char g_err[512];

static k3_status parse(k3_config *c, const char *json, int max_layers) {
    g_err[0] = 0;
    return k3_config_parse(c, json, strlen(json), max_layers, g_err, sizeof g_err);
}

/* Parses K3 with one key changed; returns the status, message in g_err. */
static k3_status parse_with(const char *key, const char *val) {
    k3_config c;
    build(g_buf, sizeof g_buf, 1, key, val, "", "");
    return parse(&c, g_buf, 0);
}

static int has(const char *s) { return strstr(g_err, s) != NULL; }

static void test_k3_layout(void) {
    k3_config c;
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"bos_token_id\":163584,\"eos_token_id\":163586",
          "");
    k3_status st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK, "K3 text_config parses (%s)", g_err);
    if (st) return;
    CHECK(c.hidden == 7168 && c.n_layers == 93 && c.n_layers_full == 93 && c.vocab == 163840,
          "K3 hidden/layers/vocab");
    CHECK(c.first_dense == 1 && c.dense_inter == 33792 && c.n_heads == 96 && c.q_lora == 1536 &&
              c.kv_lora == 512,
          "K3 dense/mla dims");
    CHECK(c.qk_nope == 128 && c.qk_rope == 64 && c.v_head == 128 && c.qk_head == 192,
          "K3 head dims, qk_head = 192");
    CHECK(c.n_experts == 896 && c.topk == 16 && c.moe_inter == 3072 && c.latent == 3584 &&
              c.n_shared == 2 && c.shared_inter == 6144,
          "K3 MoE dims, shared_inter = 6144");
    CHECK(c.res_bs == 12 && c.situ_b1 == 4.0f && c.situ_b2 == 25.0f && c.eps == 1e-5f,
          "K3 res_bs, SiTU betas, eps");
    CHECK(c.kda_heads == 96 && c.kda_hd == 128 && c.conv_k == 4 && c.gate_lb == -5.0f &&
              c.kda_proj == 12288,
          "K3 KDA dims, kda_proj = 12288");
    CHECK(c.bos == 163584 && c.n_eos == 1 && c.eos[0] == 163586, "K3 bos/eos");

    int n_mla = 0, mla_ok = 1;
    for (int i = 0; i < 93; i++) {
        int want_mla = ((i + 1) % 4 == 0) || i == 92;
        n_mla += !c.is_kda[i];
        if (c.is_kda[i] == want_mla) mla_ok = 0;
    }
    CHECK(n_mla == 24 && mla_ok, "K3 schedule: 24 MLA layers at 3,7,...,91,92 (got %d)", n_mla);
    CHECK(!c.is_kda[3] && !c.is_kda[91] && !c.is_kda[92] && c.is_kda[0] && c.is_kda[90],
          "K3 schedule spot checks (3, 91, 92 MLA; 0, 90 KDA)");
    int moe_ok = !c.is_moe[0];
    for (int i = 1; i < 93; i++) moe_ok &= c.is_moe[i];
    CHECK(moe_ok, "K3 schedule: layer 0 dense, 1..92 MoE");
    int nb = 0, b_ok = 1;
    for (int i = 0; i < 93; i++) {
        nb += c.is_boundary[i];
        if (c.is_boundary[i] != (i % 12 == 0)) b_ok = 0;
    }
    CHECK(nb == 8 && b_ok, "K3 boundaries 0,12,...,84 (8 snapshots, got %d)", nb);
    CHECK(k3_config_snapshots_before(&c, 0) == 0 && k3_config_snapshots_before(&c, 1) == 1 &&
              k3_config_snapshots_before(&c, 12) == 1 && k3_config_snapshots_before(&c, 13) == 2 &&
              k3_config_snapshots_before(&c, 93) == 8,
          "snapshots_before(0,1,12,13,93) = 0,1,1,2,8");
    int zero_tail = 1;
    for (int i = 93; i < K3_MAX_LAYERS; i++)
        zero_tail &= !c.is_kda[i] && !c.is_moe[i] && !c.is_boundary[i];
    CHECK(zero_tail, "schedules are zero past n_layers");

    /* root layout: same model, same fingerprint */
    k3_config r;
    build(g_buf, sizeof g_buf, 0, NULL, NULL, "\"bos_token_id\":163584,\"eos_token_id\":163586",
          "");
    st = parse(&r, g_buf, 0);
    CHECK(st == K3_OK && r.hidden == 7168 && r.n_layers == 93 && r.is_kda[0] && !r.is_kda[3],
          "K3 root layout (no text_config) parses (%s)", g_err);
    CHECK(k3_config_fingerprint(&c) == k3_config_fingerprint(&r),
          "fingerprint equal for root and text_config layouts");
    k3_config c2 = c;
    c2.eps = 1e-6f;
    CHECK(k3_config_fingerprint(&c) != k3_config_fingerprint(&c2),
          "fingerprint changes with rms_norm_eps");
    c2 = c;
    c2.is_kda[50] ^= 1;
    CHECK(k3_config_fingerprint(&c) != k3_config_fingerprint(&c2),
          "fingerprint changes with the KDA schedule");

    /* truncation (K3_LAYERS) keeps the schedules */
    k3_config t;
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "", "");
    st = parse(&t, g_buf, 5);
    CHECK(st == K3_OK && t.n_layers == 5 && t.n_layers_full == 93, "max_layers 5 truncates to 5");
    CHECK(memcmp(t.is_kda, c.is_kda, sizeof c.is_kda) == 0 &&
              memcmp(t.is_boundary, c.is_boundary, sizeof c.is_boundary) == 0 &&
              memcmp(t.is_moe, c.is_moe, sizeof c.is_moe) == 0,
          "truncation does not change the schedules");
    CHECK(k3_config_fingerprint(&t) != k3_config_fingerprint(&c),
          "fingerprint changes with truncation");
    st = parse(&t, g_buf, 500);
    CHECK(st == K3_OK && t.n_layers == 93, "max_layers above num_hidden_layers keeps 93");
    st = parse(&t, g_buf, 0);
    CHECK(st == K3_OK && t.n_layers == 93 && t.bos == -1 && t.n_eos == 0,
          "no bos/eos anywhere: bos = -1, no eos");
}

static void test_defaults_and_tokens(void) {
    k3_config c;
    build(g_buf, sizeof g_buf, 1, "rms_norm_eps", NULL, "", "");
    char *p = strstr(g_buf, ",\"gate_lower_bound\":-5.0");
    if (p)
        memmove(p, p + strlen(",\"gate_lower_bound\":-5.0"),
                strlen(p + strlen(",\"gate_lower_bound\":-5.0")) + 1);
    k3_status st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.eps == 1e-5f && c.gate_lb == -5.0f,
          "optional rms_norm_eps / gate_lower_bound default to 1e-5 / -5 (%s)", g_err);

    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"bos_token_id\":1,\"eos_token_id\":[2,3,4]",
          "\"bos_token_id\":7,\"eos_token_id\":9");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.bos == 1 && c.n_eos == 3 && c.eos[0] == 2 && c.eos[2] == 4,
          "bos/eos: root wins over text_config; eos array of 3");
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":null",
          "\"bos_token_id\":7,\"eos_token_id\":9");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.bos == 7 && c.n_eos == 1 && c.eos[0] == 9,
          "bos/eos: text_config used when the root has none (null = absent)");
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":[1,2,3,4,5,6,7,8]", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.n_eos == 8 && c.eos[7] == 8, "eos array of 8 (the limit) accepted");
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":[1,2,3,4,5,6,7,8,9]", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_LIMIT && has("eos_token_id") && has("K3_MAX_EOS"),
          "eos array of 9 rejected: %s", g_err);
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":[]", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.n_eos == 0, "empty eos array accepted");
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":163840", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_LIMIT && has("eos_token_id") && has("163840"), "eos id = vocab rejected: %s",
          g_err);
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"bos_token_id\":-1", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_LIMIT && has("bos_token_id"), "negative bos rejected: %s", g_err);
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"eos_token_id\":[1,\"x\"]", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_FORMAT && has("eos_token_id[1]"), "non-integer eos entry rejected: %s",
          g_err);
}

static void test_required(void) {
    /* every required model key (rms_norm_eps is optional) */
    for (size_t i = 0; i < N_MODEL; i++) {
        if (strcmp(k_model[i].key, "rms_norm_eps") == 0) continue;
        k3_status st = parse_with(k_model[i].key, NULL);
        CHECK(st == K3_ERR_MISSING && has(k_model[i].key) && has("missing"),
              "missing %s rejected: %s", k_model[i].key, g_err);
    }
    const char *lin_req[] = {"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers"};
    for (size_t i = 0; i < 4; i++) {
        char k[64];
        snprintf(k, sizeof k, "lin.%s", lin_req[i]);
        k3_status st = parse_with(k, NULL);
        CHECK(st == K3_ERR_MISSING && has(lin_req[i]) && has("linear_attn_config"),
              "missing linear_attn_config.%s rejected: %s", lin_req[i], g_err);
    }
    k3_status st = parse_with("linear_attn_config", NULL);
    CHECK(st == K3_ERR_MISSING && has("linear_attn_config"), "missing linear_attn_config: %s",
          g_err);
    st = parse_with("hidden_size", "\"7168\"");
    CHECK(st == K3_ERR_FORMAT && has("hidden_size") && has("string"),
          "hidden_size as a string rejected: %s", g_err);
    st = parse_with("activation_situ_beta", "\"4\"");
    CHECK(st == K3_ERR_FORMAT && has("activation_situ_beta"), "string beta rejected: %s", g_err);
    st = parse_with("hidden_size", "7168.5");
    CHECK(st == K3_ERR_FORMAT && has("hidden_size"), "fractional hidden_size rejected: %s", g_err);
    st = parse_with("hidden_size", "7168.0");
    CHECK(st == K3_OK, "hidden_size 7168.0 (integral real) accepted (%s)", g_err);
}

typedef struct lim_case {
    const char *key, *val;
    k3_status want;
    const char *needle1, *needle2;
} lim_case;

static void test_limits(void) {
    static const lim_case cases[] = {
        {"hidden_size", "65537", K3_ERR_LIMIT, "hidden_size", "65536"},
        {"hidden_size", "0", K3_ERR_LIMIT, "hidden_size", "minimum 1"},
        {"hidden_size", "-7", K3_ERR_LIMIT, "hidden_size", "-7"},
        {"num_hidden_layers", "129", K3_ERR_LIMIT, "num_hidden_layers", "128"},
        {"num_experts", "4097", K3_ERR_LIMIT, "num_experts", "4096"},
        {"num_experts_per_token", "0", K3_ERR_LIMIT, "num_experts_per_token", "minimum 1"},
        {"num_experts_per_token", "65", K3_ERR_LIMIT, "num_experts_per_token", "64"},
        {"vocab_size", "4194305", K3_ERR_LIMIT, "vocab_size", "4194304"},
        {"lin.short_conv_kernel_size", "9", K3_ERR_LIMIT, "short_conv_kernel_size", "8"},
        {"routed_expert_hidden_size", "16", K3_ERR_LIMIT, "routed_expert_hidden_size", "32"},
        {"routed_expert_hidden_size", "3600", K3_ERR_FORMAT, "routed_expert_hidden_size",
         "multiple of 32"},
        {"moe_intermediate_size", "3000", K3_ERR_FORMAT, "moe_intermediate_size", "multiple of 32"},
        {"lin.head_dim", "513", K3_ERR_LIMIT, "head_dim", "512"},
        {"kv_lora_rank", "4097", K3_ERR_LIMIT, "kv_lora_rank", "4096"},
        {"attn_res_block_size", "6", K3_ERR_LIMIT, "attn_res_block_size", "16"},
        {"num_attention_heads", "1025", K3_ERR_LIMIT, "num_attention_heads", "K3_MAX_HEADS"},
        {"intermediate_size", "2000000", K3_ERR_LIMIT, "intermediate_size", "K3_MAX_INTER"},
        {"qk_nope_head_dim", "513", K3_ERR_LIMIT, "qk_nope_head_dim", "K3_MAX_HEAD_DIM"},
        {"first_k_dense_replace", "94", K3_ERR_LIMIT, "first_k_dense_replace", "93"},
        {"rms_norm_eps", "0", K3_ERR_LIMIT, "rms_norm_eps", "(0, 1)"},
        {"activation_situ_beta", "1e300", K3_ERR_LIMIT, "activation_situ_beta", "finite"},
        {"lin.kda_layers", "[1,2,0]", K3_ERR_LIMIT, "kda_layers[2]", "one-based"},
        {"lin.kda_layers", "[1,94]", K3_ERR_LIMIT, "kda_layers[1]", "93"},
        {"lin.kda_layers", "[1,2,2]", K3_ERR_FORMAT, "kda_layers[2]", "twice"},
        {"lin.kda_layers", "[1,\"2\"]", K3_ERR_FORMAT, "kda_layers[1]", "integer"},
        {"lin.kda_layers", "5", K3_ERR_FORMAT, "kda_layers", "array"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const lim_case *lc = &cases[i];
        k3_status st = parse_with(lc->key, lc->val);
        CHECK(st == lc->want && has(lc->needle1) && has(lc->needle2), "%s = %s rejected (%s): %s",
              lc->key, lc->val, k3_status_name(st), g_err);
    }
    /* topk > n_experts: a relation, not one key's range */
    k3_config c;
    build(g_buf, sizeof g_buf, 1, "num_experts", "8", "", "");
    k3_status st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_LIMIT && has("num_experts_per_token = 16") && has("num_experts = 8"),
          "topk 16 > n_experts 8 rejected: %s", g_err);
    /* the limits themselves are accepted */
    build(g_buf, sizeof g_buf, 1, "attn_res_block_size", "7", "", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK, "res_bs 7: ceil(93/7)+1 = 15 accepted (%s)", g_err);
    build(g_buf, sizeof g_buf, 1, "num_experts_per_token", "64", "", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_OK && c.topk == 64, "topk 64 accepted (%s)", g_err);
}

static void test_bad_json(void) {
    k3_config c;
    memset(&c, 0x5a, sizeof c);
    k3_config before = c;
    k3_status st = parse(&c, "{\"text_config\": {", 0);
    CHECK(st == K3_ERR_FORMAT && has("invalid JSON"), "truncated JSON rejected: %s", g_err);
    CHECK(memcmp(&c, &before, sizeof c) == 0, "a failed parse leaves the struct untouched");
    st = parse(&c, "[1,2]", 0);
    CHECK(st == K3_ERR_FORMAT && has("object"), "array top level rejected: %s", g_err);
    build(g_buf, sizeof g_buf, 1, NULL, NULL, "\"model_type\":\"dup\"", "");
    st = parse(&c, g_buf, 0);
    CHECK(st == K3_ERR_FORMAT && has("duplicate"), "duplicate key rejected: %s", g_err);
    st = parse(&c, "{\"text_config\": 5}", 0);
    CHECK(st == K3_ERR_FORMAT && has("text_config"), "non-object text_config rejected: %s", g_err);
    st = k3_config_parse(&c, "", 0, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_FORMAT, "empty text rejected: %s", g_err);
}

/* ---- files ---------------------------------------------------------------- */

static char g_dir[256];

static void test_load(void) {
    snprintf(g_dir, sizeof g_dir, "%s/k3cfgXXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    k3_config c;
    k3_status st = k3_config_load(&c, g_dir, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_MISSING && has("config.json"), "missing config.json: %s", g_err);

    build(g_buf, sizeof g_buf, 1, NULL, NULL, "", "");
    FILE *f = fopen(path, "w");
    fputs(g_buf, f);
    fclose(f);
    st = k3_config_load(&c, g_dir, 8, g_err, sizeof g_err);
    CHECK(st == K3_OK && c.n_layers == 8 && c.hidden == 7168, "config.json loads from a dir (%s)",
          g_err);

    /* A sparse file just over the limit must be refused by size alone. */
    int fd = open(path, O_WRONLY | O_TRUNC);
    int tr = fd >= 0 ? ftruncate(fd, (off_t)K3_MAX_CONFIG_BYTES + 1) : -1;
    if (fd >= 0) close(fd);
    CHECK(tr == 0, "made a %u-byte sparse config.json", K3_MAX_CONFIG_BYTES + 1);
    st = k3_config_load(&c, g_dir, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_LIMIT && has("K3_MAX_CONFIG_BYTES") && has("67108865"),
          "config.json over 64 MiB rejected before reading: %s", g_err);
    unlink(path);
    rmdir(g_dir);
}

/* The tiny fixture generated by tests/fixtures/k3_gen.py, when present. */
static void test_tiny(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", t_tiny_dir());
    if (access(path, R_OK) != 0) {
        SKIP("tiny fixture checks", "%s does not exist (make tiny)", path);
        return;
    }
    k3_config c;
    g_err[0] = 0;
    k3_status st = k3_config_load(&c, t_tiny_dir(), 0, g_err, sizeof g_err);
    CHECK(st == K3_OK, "tiny fixture config loads (%s)", g_err);
    if (st) return;
    CHECK(c.hidden == 64 && c.n_layers == 8, "tiny: hidden 64, 8 layers (got %d, %d)", c.hidden,
          c.n_layers);
    int mla_ok = 1;
    for (int i = 0; i < c.n_layers; i++) mla_ok &= c.is_kda[i] == !(i == 3 || i == 7);
    CHECK(mla_ok, "tiny: MLA exactly at layers 3 and 7");
}

int main(void) {
    make_kda_list();
    test_k3_layout();
    test_defaults_and_tokens();
    test_required();
    test_limits();
    test_bad_json();
    test_load();
    test_tiny();
    TEST_MAIN_END();
}
