/* tests/test_safetensors.c: the shard reader against
 * docs/TESTING.md section 4, table S (S1-S9): synthetic shard
 * files in a mkdtemp directory, one CHECK per bad case asserting the status
 * and a distinctive piece of the message.
 *
 * `test_safetensors --open DIR` is a helper mode for
 * tests/integration/safetensors_strace.sh: it opens DIR, parses every shard
 * and looks up every mapped tensor, printing the status.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ckpt/safetensors.h"
#include "tests/test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define T_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
#define T_SANITIZED 1
#endif
#endif

static char g_root[256];
static char g_err[1024];

static int has(const char *s) { return strstr(g_err, s) != NULL; }

/* ---- building shard bytes ---------------------------------------------------- */

/* 8-byte little-endian N, the header text, pad spaces, then dlen data bytes
 * (byte i = i & 0xff unless data is given). Returns a malloc'd buffer. */
static uint8_t *mk(uint64_t n_override, const char *hdr, size_t pad, const void *data, size_t dlen,
                   size_t *out_len) {
    size_t hl = strlen(hdr) + pad;
    uint64_t n = n_override ? n_override : hl;
    size_t len = 8 + hl + dlen;
    uint8_t *b = malloc(len);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(n >> (8 * i));
    memcpy(b + 8, hdr, strlen(hdr));
    memset(b + 8 + strlen(hdr), ' ', pad);
    for (size_t i = 0; i < dlen; i++)
        b[8 + hl + i] = data ? ((const uint8_t *)data)[i] : (uint8_t)i;
    *out_len = len;
    return b;
}

/* Parses a header held in memory; data section of dlen bytes. */
static k3_status mem(const char *hdr, size_t dlen, int *nt) {
    size_t len;
    uint8_t *b = mk(0, hdr, 0, NULL, dlen, &len);
    g_err[0] = 0;
    int n = -1;
    k3_status st = st_parse_header_mem(b, len, len, "m.safetensors", &n, g_err, sizeof g_err);
    if (nt) *nt = n;
    free(b);
    return st;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
        exit(2);
    }
    fwrite(p, 1, n, f);
    fclose(f);
}

static void write_text(const char *path, const char *s) { write_bytes(path, s, strlen(s)); }

static void write_shard(const char *path, const char *hdr, const void *data, size_t dlen) {
    size_t len;
    uint8_t *b = mk(0, hdr, 0, data, dlen, &len);
    write_bytes(path, b, len);
    free(b);
}

static char *mkdir_in(char *out, size_t len, const char *name) {
    snprintf(out, len, "%s/%s", g_root, name);
    mkdir(out, 0755);
    return out;
}

/* A one-tensor F32 [n] shard header (data_offsets [0, 4n]). */
static void f32_hdr(char *buf, size_t len, const char *name, int n) {
    snprintf(buf, len, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],\"data_offsets\":[0,%d]}}", name,
             n, 4 * n);
}

/* ---- conversions ---------------------------------------------------------- */

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Reference half -> double by the definition of the format. */
static double f16_ref(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static void test_conversions(void) {
    CHECK(st_bf16_to_f32(0x3f80) == 1.0f && st_bf16_to_f32(0xc000) == -2.0f &&
              st_bf16_to_f32(0x4049) == 3.140625f,
          "bf16 1, -2, 3.140625");
    CHECK(isinf(st_bf16_to_f32(0x7f80)) && isnan(st_bf16_to_f32(0x7fc0)) &&
              st_bf16_to_f32(0x0001) == ldexpf(1.0f, -133) &&
              fbits(st_bf16_to_f32(0x8000)) == 0x80000000u,
          "bf16 inf, nan, smallest subnormal 2^-133, -0");
    int bad = 0, nan_ok = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = st_f16_to_f32((uint16_t)h);
        int e = (h >> 10) & 31;
        if (e == 31) {
            if ((h & 1023) == 0)
                nan_ok &= isinf(f) && (signbit(f) != 0) == (h >> 15);
            else
                nan_ok &= isnan(f) && ((fbits(f) >> 13) & 1023) == (h & 1023);
            continue;
        }
        double r = f16_ref((uint16_t)h);
        if ((double)f != r || (signbit(f) != 0) != (int)(h >> 15)) bad++;
    }
    CHECK(bad == 0, "f16 -> f32 exact for all 63488 finite halves incl. subnormals (%d wrong)",
          bad);
    CHECK(nan_ok, "f16 inf keeps its sign, NaN keeps its payload");
    CHECK(st_f16_to_f32(0x0001) == ldexpf(1.0f, -24) &&
              st_f16_to_f32(0x03ff) == 1023 * ldexpf(1, -24) &&
              st_f16_to_f32(0x0400) == ldexpf(1.0f, -14) && st_f16_to_f32(0x7bff) == 65504.0f,
          "f16 2^-24, largest subnormal, 2^-14, 65504");
    CHECK(st_dtype_size(ST_BF16) == 2 && st_dtype_size(ST_F8_E4M3) == 1 &&
              st_dtype_size(ST_I64) == 8 && strcmp(st_dtype_name(ST_F8_E8M0), "F8_E8M0") == 0,
          "dtype sizes and names");
}

/* ---- S1: header length ---------------------------------------------------- */

static k3_status mem_n(uint64_t n, size_t total, int *nt) {
    uint8_t b[64] = {0};
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(n >> (8 * i));
    memcpy(b + 8, "{}      ", 8);
    g_err[0] = 0;
    return st_parse_header_mem(b, total, total, "s1.safetensors", nt, g_err, sizeof g_err);
}

static void test_s1(void) {
    k3_status st = mem_n(2, 5, NULL);
    CHECK(st == K3_ERR_FORMAT && has("5 bytes") && has("8-byte"), "S1 file < 8 bytes: %s", g_err);
    st = mem_n(0, 16, NULL);
    CHECK(st == K3_ERR_FORMAT && has("N = 0"), "S1 N = 0: %s", g_err);
    st = mem_n(100, 16, NULL);
    CHECK(st == K3_ERR_FORMAT && has("N = 100") && has("8 bytes left") && has("16-byte"),
          "S1 N > file - 8: %s", g_err);
    st = mem_n(UINT64_MAX, 16, NULL);
    CHECK(st == K3_ERR_LIMIT && has("18446744073709551615") && has("100000000") &&
              has("K3_ST_MAX_HEADER"),
          "S1 N = 2^64-1 (no wrap of 8 + N): %s", g_err);
    st = mem_n(1ull << 40, 16, NULL);
    CHECK(st == K3_ERR_LIMIT && has("1099511627776") && has("K3_ST_MAX_HEADER"), "S1 N = 2^40: %s",
          g_err);
    st = mem_n(K3_ST_MAX_HEADER + 1, 16, NULL);
    CHECK(st == K3_ERR_LIMIT && has("100000001 > limit 100000000"), "S1 N = cap + 1: %s", g_err);
    int nt = -1;
    st = mem_n(2, 10, &nt);
    CHECK(st == K3_OK && nt == 0, "S1 smallest valid file: N = 2, '{}' (%s)", g_err);
}

/* The file path must reject a huge N before allocating N bytes. A child
 * process caps its address space so an allocation of N would fail (the
 * control at the end proves the cap bites), then opens a 16-byte shard
 * claiming N = 90 MB (under K3_ST_MAX_HEADER, over the file). */
static void test_s1_no_alloc(void) {
#ifdef T_SANITIZED
    SKIP("S1 RLIMIT_AS check", "sanitizers reserve large address ranges");
#else
    char dir[512], path[600];
    mkdir_in(dir, sizeof dir, "s1alloc");
    snprintf(path, sizeof path, "%s/model-00001-of-00001.safetensors", dir);
    size_t len;
    uint8_t *b = mk(90000000ull, "{}      ", 0, NULL, 0, &len);
    write_bytes(path, b, len);
    free(b);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        long pages = 0, page = sysconf(_SC_PAGESIZE);
        FILE *f = fopen("/proc/self/statm", "r");
        if (!f || fscanf(f, "%ld", &pages) != 1) _exit(10);
        fclose(f);
        struct rlimit rl;
        rl.rlim_cur = rl.rlim_max = (rlim_t)pages * (rlim_t)page + (48u << 20);
        if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(11);
        st_index *idx = NULL;
        char err[512];
        st_open_opts o = {.model_dir = dir};
        if (st_open(&idx, &o, err, sizeof err) != K3_OK) _exit(12);
        const st_tensor *t;
        k3_status st = st_find(idx, "x", &t, err, sizeof err);
        st_close(&idx);
        if (st != K3_ERR_FORMAT || !strstr(err, "N = 90000000") || !strstr(err, "bytes left"))
            _exit(13);
        void *volatile p = malloc(90000000); /* control: the cap must bite */
        _exit(p ? 14 : 0);
    }
    int ws = 0;
    waitpid(pid, &ws, 0);
    int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 100 + (WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
    CHECK(code == 0,
          "S1 N = 90 MB in a 16-byte shard rejected under RLIMIT_AS + 48 MB, malloc(N) would "
          "fail there (child code %d)",
          code);
#endif
}

/* ---- S2: header text ------------------------------------------------------ */

static const char *T1 = "\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}";

static void test_s2(void) {
    char h[512];
    k3_status st = mem("x{}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("does not start with '{'") && has("0x78"),
          "S2 header not starting with '{': %s", g_err);
    st = mem(" {}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("does not start with '{'") && has("0x20"),
          "S2 leading space rejected: %s", g_err);
    st = mem("[{}]", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("top level is not a JSON object"),
          "S2 non-object top level: %s", g_err);
    st = mem("\"{}\"", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("top level is not a JSON object") && has("'\"'"),
          "S2 string top level: %s", g_err);
    st = mem("{\"a\xff\":1}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("not valid UTF-8 at byte 3") && has("0xff"),
          "S2 invalid UTF-8 byte: %s", g_err);
    st = mem("{\"\xc0\xaf\":1}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("not valid UTF-8"), "S2 overlong UTF-8: %s", g_err);
    st = mem("{\"\xed\xa0\x80\":1}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("not valid UTF-8"), "S2 UTF-8 surrogate: %s", g_err);
    st = mem("{\"\xe2\x82\":1}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("not valid UTF-8"), "S2 truncated UTF-8 sequence: %s", g_err);
    snprintf(h, sizeof h, "{\"__metadata__\":{\"n\":\"caf\xc3\xa9\"},%s}", T1);
    int nt = -1;
    st = mem(h, 4, &nt);
    CHECK(st == K3_OK && nt == 1, "S2 valid multi-byte UTF-8 in metadata accepted (%s)", g_err);
    snprintf(h, sizeof h, "{%s}x", T1);
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("junk after the header's closing '}'") && has("0x78"),
          "S2 junk after '}': %s", g_err);
    snprintf(h, sizeof h, "{%s}  \n", T1);
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("junk after") && has("0x0a"),
          "S2 newline padding rejected (spaces only): %s", g_err);
    snprintf(h, sizeof h, "{%s}{}", T1);
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("junk after"), "S2 second object after '}': %s", g_err);
    {
        size_t len;
        snprintf(h, sizeof h, "{%s}", T1);
        uint8_t *b = mk(0, h, 7, NULL, 4, &len);
        nt = -1;
        g_err[0] = 0;
        st = st_parse_header_mem(b, len, len, "pad.safetensors", &nt, g_err, sizeof g_err);
        free(b);
        CHECK(st == K3_OK && nt == 1, "S2 padding spaces after '}' accepted (%s)", g_err);
    }
    snprintf(h, sizeof h, "{\"__metadata__\":{\"format\":\"pt\",\"n\":1},%s}", T1);
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("__metadata__ value of 'n'") && has("integer"),
          "S2 non-string __metadata__ value: %s", g_err);
    snprintf(h, sizeof h, "{\"__metadata__\":[\"pt\"],%s}", T1);
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("__metadata__ must be an object") && has("array"),
          "S2 __metadata__ not an object: %s", g_err);
    snprintf(h, sizeof h, "{\"__metadata__\":{\"format\":\"pt\"},%s}", T1);
    st = mem(h, 4, &nt);
    CHECK(st == K3_OK && nt == 1, "S2 string->string __metadata__ accepted, not a tensor (%s)",
          g_err);
    st = mem("{\"t\":{\"dtype\":\"U8\",", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("header JSON invalid"), "S2 truncated JSON: %s", g_err);
    st = mem("{\"t\":{\"dtype\":\"U8\"\x01}}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("header JSON invalid"), "S2 control byte in JSON: %s", g_err);
}

/* ---- S3: duplicates ------------------------------------------------------ */

static void test_s3(void) {
    char h[512];
    snprintf(h, sizeof h,
             "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
             "\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}");
    k3_status st = mem(h, 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("duplicate tensor 'w'"), "S3 duplicate tensor: %s", g_err);
    snprintf(h, sizeof h,
             "{\"w\":{\"dtype\":\"U8\",\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,4]}}");
    st = mem(h, 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("duplicate key 'dtype'") && !has("duplicate tensor"),
          "S3 duplicate key inside an entry told apart: %s", g_err);
    snprintf(h, sizeof h, "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}");
    st = mem(h, 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("duplicate key 'a'"), "S3 duplicate metadata key: %s", g_err);
}

/* ---- S4: offsets and layout ---------------------------------------------------- */

#define E(name, dt, shape, b, e)                                                                   \
    "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static void test_s4(void) {
    k3_status st = mem("{" E("a", "U8", "[4]", 8, 4) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'a'") && has("begin 8 > end 4"), "S4 begin > end: %s",
          g_err);
    st = mem("{" E("a", "U8", "[16]", 0, 16) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'a'") && has("end 16 beyond the data section of 8"),
          "S4 end beyond data section: %s", g_err);
    st = mem("{" E("a", "F32", "[2]", 0, 8) "," E("b", "F32", "[2]", 4, 12) "}", 12, NULL);
    CHECK(st == K3_ERR_FORMAT && has("overlap") && has("'a'") && has("'b'"), "S4 overlap: %s",
          g_err);
    st = mem("{" E("a", "F32", "[2]", 0, 8) "," E("b", "F32", "[2]", 0, 8) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("overlap"), "S4 two tensors aliasing the same bytes: %s",
          g_err);
    st = mem("{" E("a", "F32", "[1]", 0, 4) "," E("b", "F32", "[1]", 8, 12) "}", 12, NULL);
    CHECK(st == K3_ERR_FORMAT && has("gap: data bytes [4, 8)") && has("between 'a' and 'b'"),
          "S4 gap between tensors: %s", g_err);
    st = mem("{" E("a", "F32", "[1]", 4, 8) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("gap: data bytes [0, 4)") && has("before 'a'"),
          "S4 gap before the first tensor: %s", g_err);
    st = mem("{" E("a", "F32", "[1]", 0, 4) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("trailing data bytes [4, 8)") && has("polyglot"),
          "S4 trailing uncovered bytes (polyglot): %s", g_err);
    st = mem("{}", 3, NULL);
    CHECK(st == K3_ERR_FORMAT && has("trailing data bytes [0, 3)"),
          "S4 empty header with data bytes: %s", g_err);
    int nt = -1;
    st = mem("{" E("c", "F32", "[1]", 8, 12) "," E("a", "F32", "[1]", 0, 4) "," E("b", "F32", "[1]",
                                                                                  4, 8) "}",
             12, &nt);
    CHECK(st == K3_OK && nt == 3, "S4 valid file with tensors listed out of order accepted (%s)",
          g_err);
}

/* ---- S5: dtype and shape --------------------------------------------------- */

static void test_s5(void) {
    char h[2048];
    k3_status st = mem("{" E("a", "F32", "[3]", 0, 8) "}", 8, NULL);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'a'") && has("span 8 bytes") && has("[3] x F32") &&
              has("needs 12"),
          "S5 bytes != elements x size: %s", g_err);
    st = mem("{" E("big", "U8", "[4611686018427387904, 4]", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_LIMIT && has("tensor 'big'") && has("element count") &&
              has("overflows 64 bits"),
          "S5 shape [2^62, 4] element count overflow: %s", g_err);
    st = mem("{" E("big", "F32", "[4611686018427387904, 2]", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_LIMIT && has("tensor 'big'") && has("byte size") && has("F32"),
          "S5 shape [2^62, 2] x F32 byte-size overflow: %s", g_err);
    st = mem("{" E("r9", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1, NULL);
    CHECK(st == K3_ERR_LIMIT && has("tensor 'r9'") && has("rank 9 > limit 8"),
          "S5 rank above the cap: %s", g_err);
    int nt = -1;
    st = mem("{" E("r8", "U8", "[1,1,1,1,1,1,1,2]", 0, 2) "}", 2, &nt);
    CHECK(st == K3_OK && nt == 1, "S5 rank 8 accepted (%s)", g_err);
    st = mem("{" E("q", "Q4_K", "[4]", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'q'") && has("unsupported dtype 'Q4_K'"),
          "S5 unknown dtype: %s", g_err);
    st = mem("{" E("n", "U8", "[-4]", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'n'") && has("shape[0]"), "S5 negative dim: %s",
          g_err);
    st = mem("{" E("n", "U8", "[2.0, 2]", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("shape[0]"), "S5 real-valued dim: %s", g_err);
    st = mem("{" E("n", "U8", "4", 0, 4) "}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("shape must be an array"), "S5 shape not an array: %s", g_err);
    st = mem("{\"n\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0]}}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("data_offsets must be [begin, end]"),
          "S5 data_offsets of one value: %s", g_err);
    st = mem("{\"n\":{\"dtype\":\"U8\",\"shape\":[4]}}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("missing 'data_offsets'"), "S5 missing data_offsets: %s",
          g_err);
    st = mem("{\"n\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":1}}", 4, NULL);
    CHECK(st == K3_ERR_FORMAT && has("unknown key 'x'"), "S5 unknown entry key: %s", g_err);
    st = mem("{\"n\":[1,2]}", 0, NULL);
    CHECK(st == K3_ERR_FORMAT && has("entry must be an object"), "S5 entry not an object: %s",
          g_err);
    char name[600];
    memset(name, 'x', 513);
    name[513] = 0;
    snprintf(h, sizeof h, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", name);
    st = mem(h, 0, NULL);
    CHECK(st == K3_ERR_LIMIT && has("K3_ST_MAX_NAME"), "S5 tensor name of 513 bytes: %.80s", g_err);
    /* zero-size and scalar tensors are legal, also next to each other */
    st = mem("{" E("z", "F32", "[0, 4]", 0, 0) "," E("s", "F32", "[]", 0, 4) "," E(
                 "z2", "BF16", "[3, 0]", 4, 4) "," E("v", "BF16", "[2]", 4, 8) "}",
             8, &nt);
    CHECK(st == K3_OK && nt == 4, "S5 zero-size and scalar tensors accepted (%s)", g_err);
    const char *dts[] = {"BF16",    "F16", "F32", "U8",  "I8",  "F8_E4M3",
                         "F8_E8M0", "I32", "I64", "F64", "BOOL"};
    const int sz[] = {2, 2, 4, 1, 1, 1, 1, 4, 8, 8, 1};
    int all = 1;
    for (int i = 0; i < 11; i++) {
        snprintf(h, sizeof h, "{\"t\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%d]}}",
                 dts[i], 3 * sz[i]);
        all &= mem(h, (size_t)(3 * sz[i]), NULL) == K3_OK;
    }
    CHECK(all, "S5 every whitelisted dtype accepted with its element size");
}

/* ---- files: laziness, --dirs, index.json --------------------------------------------------- */

static st_index *open_dir(const char *dir, const char *const *dirs, int n_dirs, k3_status *st) {
    st_index *idx = NULL;
    st_open_opts o = {.model_dir = dir, .dirs = dirs, .n_dirs = n_dirs};
    g_err[0] = 0;
    *st = st_open(&idx, &o, g_err, sizeof g_err);
    return idx;
}

static int shard_by_name(st_index *idx, const char *name) {
    for (int i = 0; i < st_shard_count(idx); i++)
        if (strcmp(st_shard_name(idx, i), name) == 0) return i;
    return -1;
}

/* Two shards A, B with an index.json: A holds language_model.model.layers.0.*,
 * B holds "b.weight" and is later corrupted to show it is never parsed. */
static void test_lazy(void) {
    char dir[512], p[700], h[512];
    mkdir_in(dir, sizeof dir, "lazy");
    float vals[4] = {1.5f, -2.0f, 0.25f, 8.0f};
    snprintf(h, sizeof h,
             "{\"language_model.model.layers.0.input_layernorm.weight\":{\"dtype\":\"F32\","
             "\"shape\":[4],\"data_offsets\":[0,16]}}");
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    write_shard(p, h, vals, 16);
    f32_hdr(h, sizeof h, "b.weight", 2);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    write_shard(p, h, vals, 8);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_text(p, "{\"metadata\":{\"total_size\":24},\"weight_map\":{"
                  "\"language_model.model.layers.0.input_layernorm.weight\":"
                  "\"model-00001-of-00002.safetensors\","
                  "\"b.weight\":\"model-00002-of-00002.safetensors\"}}");
    k3_status st;
    st_index *idx = open_dir(dir, NULL, 0, &st);
    CHECK(st == K3_OK && st_shard_count(idx) == 2, "lazy: 2 shards listed (%s)", g_err);
    if (st) return;
    int a = shard_by_name(idx, "model-00001-of-00002.safetensors");
    int b = shard_by_name(idx, "model-00002-of-00002.safetensors");
    CHECK(a == 0 && b == 1, "shards sorted by name");
    CHECK(!st_shard_is_open(idx, a) && !st_shard_is_open(idx, b) && st_shard_fd(idx, a, 0) == -1,
          "st_open opens no shard");
    CHECK(strcmp(st_prefix(idx), "language_model.") == 0 && !st_shard_is_open(idx, a) &&
              !st_shard_is_open(idx, b),
          "prefix 'language_model.' probed from index.json without opening a shard");
    const st_tensor *t = NULL;
    st = st_find(idx, "language_model.model.layers.0.input_layernorm.weight", &t, g_err,
                 sizeof g_err);
    CHECK(st == K3_OK && t && t->dtype == ST_F32 && t->rank == 1 && t->shape[0] == 4 &&
              t->nbytes == 16 && t->shard == a,
          "lazy: tensor in shard A found (%s)", g_err);
    CHECK(st_shard_is_open(idx, a) && !st_shard_is_open(idx, b),
          "lazy: looking up a tensor in A leaves B unopened");
    CHECK(st_shard_fd(idx, a, 0) >= 0 && st_shard_fd(idx, b, 0) == -1, "only A has an fd");
    if (t) {
        uint64_t hl = strlen("{\"language_model.model.layers.0.input_layernorm.weight\":"
                             "{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}");
        CHECK(t->offset == 8 + hl, "tensor offset is absolute (8 + N)");
        float out[4] = {0};
        st = st_read_f32(idx, t, out, 4, g_err, sizeof g_err);
        CHECK(st == K3_OK && memcmp(out, vals, 16) == 0, "st_read_f32 of an F32 tensor (%s)",
              g_err);
        st = st_read_f32(idx, t, out, 3, g_err, sizeof g_err);
        CHECK(st == K3_ERR_ARG && has("3 elements"), "st_read_f32 with a wrong count: %s", g_err);
    }
    st = st_find_opt(idx, "nope", &t, g_err, sizeof g_err);
    CHECK(st == K3_OK && t == NULL && !st_shard_is_open(idx, b),
          "st_find_opt: unmapped name -> NULL, nothing opened");
    st = st_find(idx, "nope", &t, g_err, sizeof g_err);
    CHECK(st == K3_ERR_MISSING && has("'nope'"), "S6 missing tensor named: %s", g_err);

    /* Corrupt B: lookups in A are unaffected, a lookup in B reports B. */
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    write_text(p, "garbage!garbage!");
    st = st_find(idx, "b.weight", &t, g_err, sizeof g_err);
    CHECK(st == K3_ERR_LIMIT && has("model-00002-of-00002.safetensors") &&
              has("K3_ST_MAX_HEADER") && !st_shard_is_open(idx, b),
          "a malformed shard B fails only when B is needed: %s", g_err);
    st_close(&idx);
    CHECK(idx == NULL, "st_close nulls the pointer");
    st_close(&idx); /* NULL is fine */

    /* the same directory without index.json: every shard parsed at once */
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    unlink(p);
    f32_hdr(h, sizeof h, "b.weight", 2);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    write_shard(p, h, vals, 8);
    idx = open_dir(dir, NULL, 0, &st);
    CHECK(st == K3_OK && !st_shard_is_open(idx, 0) && !st_shard_is_open(idx, 1),
          "no index.json: st_open still opens nothing (%s)", g_err);
    if (st) return;
    st = st_find(idx, "b.weight", &t, g_err, sizeof g_err);
    CHECK(st == K3_OK && st_shard_is_open(idx, 0) && st_shard_is_open(idx, 1),
          "no index.json: the first lookup parses every shard (%s)", g_err);
    CHECK(strcmp(st_prefix(idx), "language_model.") == 0, "prefix probed from shard headers");
    CHECK(st_tensor_count(idx) == 2 && st_tensor_at(idx, 0) && st_tensor_at(idx, 2) == NULL,
          "tensor iteration after parse");
    st_close(&idx);
}

static void test_read_dtypes(void) {
    char dir[512], p[700], h[1024];
    mkdir_in(dir, sizeof dir, "dtypes");
    uint16_t bf[3] = {0x3f80, 0xc000, 0x7f80};         /* 1, -2, inf */
    uint16_t hf[4] = {0x3c00, 0x0001, 0xfbff, 0x8000}; /* 1, 2^-24, -65504, -0 */
    uint8_t data[16];
    memcpy(data, bf, 6);
    memcpy(data + 6, hf, 8);
    data[14] = 7;
    data[15] = 9;
    snprintf(h, sizeof h,
             "{\"model.layers.0.input_layernorm.weight\":{\"dtype\":\"BF16\",\"shape\":[3],"
             "\"data_offsets\":[0,6]},"
             "\"h\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[6,14]},"
             "\"u\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[14,16]}}");
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    write_shard(p, h, data, 16);
    k3_status st;
    st_index *idx = open_dir(dir, NULL, 0, &st);
    if (st) {
        CHECK(0, "open dtypes dir: %s", g_err);
        return;
    }
    CHECK(strcmp(st_prefix(idx), "") == 0, "plain model.* layout: empty prefix");
    const st_tensor *t;
    float out[4];
    st = st_find(idx, "model.layers.0.input_layernorm.weight", &t, g_err, sizeof g_err);
    st = st ? st : st_read_f32(idx, t, out, 3, g_err, sizeof g_err);
    CHECK(st == K3_OK && out[0] == 1.0f && out[1] == -2.0f && isinf(out[2]),
          "st_read_f32 widens BF16 in place (%s)", g_err);
    st = st_find(idx, "h", &t, g_err, sizeof g_err);
    st = st ? st : st_read_f32(idx, t, out, 4, g_err, sizeof g_err);
    CHECK(st == K3_OK && out[0] == 1.0f && out[1] == ldexpf(1, -24) && out[2] == -65504.0f &&
              out[3] == 0.0f && signbit(out[3]),
          "st_read_f32 widens F16 incl. subnormal and -0 (%s)", g_err);
    st = st_find(idx, "u", &t, g_err, sizeof g_err);
    uint8_t raw[2] = {0};
    k3_status st2 = st ? st : st_read_raw(idx, t, raw, 2, g_err, sizeof g_err);
    CHECK(st2 == K3_OK && raw[0] == 7 && raw[1] == 9, "st_read_raw of U8 bytes");
    st = st_read_f32(idx, t, out, 2, g_err, sizeof g_err);
    CHECK(st == K3_ERR_MISMATCH && has("U8"), "st_read_f32 refuses U8: %s", g_err);
    st = st_read_raw(idx, t, raw, 3, g_err, sizeof g_err);
    CHECK(st == K3_ERR_ARG && has("'u'"), "st_read_raw with a wrong size: %s", g_err);
    uint8_t big[100];
    st = st_pread(idx, 0, st_shard_size(idx, 0) - 10, big, 100, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_ARG && has("beyond"), "st_pread past the end refused: %s", g_err);
    st = st_pread(idx, 5, 0, raw, 1, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_ARG, "st_pread on a bad shard index: %s", g_err);
    st_close(&idx);
}

/* Shards split across the model dir and two --dirs; a duplicate basename in
 * a later dir loses to the first listing. */
static void test_dirs(void) {
    char m[512], d1[512], d2[512], p[700], h[512];
    mkdir_in(m, sizeof m, "dirs_model");
    mkdir_in(d1, sizeof d1, "dirs_nvme0");
    mkdir_in(d2, sizeof d2, "dirs_nvme1");
    float v[2] = {1, 2};
    f32_hdr(h, sizeof h, "m.a", 2);
    snprintf(p, sizeof p, "%s/model-00003-of-00003.safetensors", m);
    write_shard(p, h, v, 8);
    f32_hdr(h, sizeof h, "m.b", 2);
    snprintf(p, sizeof p, "%s/model-00001-of-00003.safetensors", d1);
    write_shard(p, h, v, 8);
    f32_hdr(h, sizeof h, "m.c", 2);
    snprintf(p, sizeof p, "%s/model-00002-of-00003.safetensors", d2);
    write_shard(p, h, v, 8);
    /* same basenames again in later dirs, with other tensors inside */
    f32_hdr(h, sizeof h, "m.b_dup", 2);
    snprintf(p, sizeof p, "%s/model-00001-of-00003.safetensors", d2);
    write_shard(p, h, v, 8);
    f32_hdr(h, sizeof h, "m.a_dup", 2);
    snprintf(p, sizeof p, "%s/model-00003-of-00003.safetensors", d1);
    write_shard(p, h, v, 8);
    snprintf(p, sizeof p, "%s/notes.txt", d1);
    write_text(p, "not a shard");
    snprintf(p, sizeof p, "%s/.hidden.safetensors", d1);
    write_text(p, "partial download");

    const char *dirs[] = {d1, d2, m};
    k3_status st;
    st_index *idx = open_dir(m, dirs, 3, &st);
    CHECK(st == K3_OK && st_shard_count(idx) == 3,
          "--dirs: 3 distinct shards from 3 dirs (dups, dot files, non-shards skipped) (%s)",
          g_err);
    if (st) return;
    int sorted = 1;
    for (int i = 1; i < st_shard_count(idx); i++)
        sorted &= strcmp(st_shard_name(idx, i - 1), st_shard_name(idx, i)) < 0;
    CHECK(sorted, "--dirs: shard table sorted by basename");
    int s1 = shard_by_name(idx, "model-00001-of-00003.safetensors");
    int s3 = shard_by_name(idx, "model-00003-of-00003.safetensors");
    CHECK(s1 >= 0 && strncmp(st_shard_path(idx, s1), d1, strlen(d1)) == 0,
          "--dirs: model-00001 comes from the first dir listing it (%s)",
          s1 >= 0 ? st_shard_path(idx, s1) : "?");
    CHECK(s3 >= 0 && strncmp(st_shard_path(idx, s3), m, strlen(m)) == 0,
          "--dirs: the model dir is listed first and wins");
    st = st_open_all(idx, g_err, sizeof g_err);
    CHECK(st == K3_OK && st_tensor_count(idx) == 3, "--dirs: st_open_all parses 3 shards (%s)",
          g_err);
    const st_tensor *t;
    int found = st_find(idx, "m.a", &t, g_err, sizeof g_err) == K3_OK &&
                st_find(idx, "m.b", &t, g_err, sizeof g_err) == K3_OK &&
                st_find(idx, "m.c", &t, g_err, sizeof g_err) == K3_OK;
    st = st_find_opt(idx, "m.b_dup", &t, g_err, sizeof g_err);
    CHECK(found && st == K3_OK && t == NULL, "--dirs: losing duplicates are never read");
    st_close(&idx);

    const char *bad[] = {d1, "/nonexistent/k3-drive"};
    idx = open_dir(m, bad, 2, &st);
    CHECK(st == K3_ERR_IO && has("/nonexistent/k3-drive") && idx == NULL,
          "--dirs: a missing dir is an error naming it: %s", g_err);
    /* a tensor defined in two different shards (no index) */
    f32_hdr(h, sizeof h, "m.a", 2);
    snprintf(p, sizeof p, "%s/model-00004-of-00004.safetensors", d2);
    write_shard(p, h, v, 8);
    const char *two[] = {d2};
    idx = open_dir(m, two, 1, &st);
    st = st ? st : st_open_all(idx, g_err, sizeof g_err);
    CHECK(st == K3_ERR_FORMAT && has("tensor 'm.a' is defined in both"),
          "same tensor in two shards rejected: %s", g_err);
    st_close(&idx);
}

/* S7: index.json weight_map values that escape the model dir. A decoy
 * ../evil.safetensors (valid, would parse) sits next to the model dir. */
static void test_s7(void) {
    char m[512], p[700], h[512];
    mkdir_in(m, sizeof m, "s7model");
    float v[2] = {1, 2};
    f32_hdr(h, sizeof h, "evil.t", 2);
    snprintf(p, sizeof p, "%s/evil.safetensors", g_root);
    write_shard(p, h, v, 8);
    f32_hdr(h, sizeof h, "ok.t", 2);
    snprintf(p, sizeof p, "%s/model-00001-of-00001.safetensors", m);
    write_shard(p, h, v, 8);
    char ip[700];
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", m);
    struct {
        const char *file, *needle;
    } cases[] = {
        {"../evil.safetensors", "contains '..'"},
        {"sub/evil.safetensors", "path separator"},
        {"/tmp/evil.safetensors", "absolute path"},
        {"..", "contains '..'"},
        {"", "is empty"},
        {"evil.bin", "does not end in .safetensors"},
    };
    char buf[1400];
    k3_status st;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(buf, sizeof buf,
                 "{\"weight_map\":{\"ok.t\":\"model-00001-of-00001.safetensors\","
                 "\"evil.t\":\"%s\"}}",
                 cases[i].file);
        write_text(ip, buf);
        st_index *idx = open_dir(m, NULL, 0, &st);
        CHECK(st == K3_ERR_FORMAT && idx == NULL && has("weight_map['evil.t']") &&
                  has(cases[i].needle),
              "S7 weight_map value '%s' rejected: %s", cases[i].file, g_err);
    }
    snprintf(buf, sizeof buf, "{\"weight_map\":{\"evil.t\":3}}");
    write_text(ip, buf);
    st_index *idx = open_dir(m, NULL, 0, &st);
    CHECK(st == K3_ERR_FORMAT && has("not a string"), "S7 non-string weight_map value: %s", g_err);
    write_text(ip, "{\"metadata\":{}}");
    idx = open_dir(m, NULL, 0, &st);
    CHECK(st == K3_ERR_FORMAT && has("weight_map"), "index.json without weight_map: %s", g_err);

    /* A bare name that only exists outside the model dir resolves to
     * nothing: names are matched against the listing, never joined. */
    write_text(ip, "{\"weight_map\":{\"ok.t\":\"model-00001-of-00001.safetensors\","
                   "\"evil.t\":\"evil.safetensors\"}}");
    idx = open_dir(m, NULL, 0, &st);
    CHECK(st == K3_OK && st_shard_count(idx) == 1 &&
              strcmp(st_shard_name(idx, 0), "model-00001-of-00001.safetensors") == 0,
          "S7 shard table holds only the model dir's shard, not the decoy (%s)", g_err);
    if (!st) {
        const st_tensor *t;
        st = st_find(idx, "evil.t", &t, g_err, sizeof g_err);
        CHECK(st == K3_ERR_MISSING && has("evil.safetensors") && has("neither"),
              "S7 tensor mapped to a file outside the dirs is missing, not opened: %s", g_err);
        st = st_open_all(idx, g_err, sizeof g_err);
        CHECK(st == K3_ERR_MISSING && has("evil.t"), "st_open_all reports it too: %s", g_err);
        st_close(&idx);
    }
    /* a mapped tensor absent from its shard */
    write_text(ip, "{\"weight_map\":{\"ok.t\":\"model-00001-of-00001.safetensors\","
                   "\"ghost.t\":\"model-00001-of-00001.safetensors\"}}");
    idx = open_dir(m, NULL, 0, &st);
    if (!st) {
        const st_tensor *t;
        st = st_find(idx, "ghost.t", &t, g_err, sizeof g_err);
        CHECK(st == K3_ERR_FORMAT && has("'ghost.t'") && has("model-00001-of-00001.safetensors") &&
                  has("does not contain"),
              "S7 mapped tensor absent from its shard names both: %s", g_err);
        g_err[0] = 0;
        st = st_find(idx, "ok.t", &t, g_err, sizeof g_err);
        CHECK(st == K3_OK, "the shard's real tensor still resolves (%s)", g_err);
        st = st_open_all(idx, g_err, sizeof g_err);
        CHECK(st == K3_ERR_FORMAT && has("ghost.t"), "st_open_all checks every mapping: %s", g_err);
        st_close(&idx);
    } else {
        CHECK(0, "open ghost index: %s", g_err);
    }
    unlink(ip);
}

/* ---- S8 / S9: reads after load --------------------------------------------- */

typedef struct fault {
    int calls, fail_at, mode; /* mode 0: EIO, 1: one byte short */
} fault;

static int fault_fn(int shard, uint64_t off, size_t len, void *ctx) {
    (void)shard, (void)off, (void)len;
    fault *f = ctx;
    if (++f->calls != f->fail_at) return 0;
    return f->mode == 0 ? EIO : -1;
}

static char g_s8dir[512];

static void make_s8_dir(void) {
    char p[700], h[256];
    mkdir_in(g_s8dir, sizeof g_s8dir, "s8");
    static uint8_t data[3 * 4096];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 7);
    /* header padded so the data section starts at 4096 (O_DIRECT-able) */
    snprintf(h, sizeof h,
             "{\"experts.0.w1\":{\"dtype\":\"U8\",\"shape\":[2,4096],\"data_offsets\":[0,8192]},"
             "\"experts.0.w2\":{\"dtype\":\"U8\",\"shape\":[4096],\"data_offsets\":[8192,12288]}}");
    size_t len;
    uint8_t *b = mk(0, h, 4096 - 8 - strlen(h), data, sizeof data, &len);
    snprintf(p, sizeof p, "%s/model-00001-of-00001.safetensors", g_s8dir);
    write_bytes(p, b, len);
    free(b);
}

/* One full open -> find -> read sequence; returns its status. */
static k3_status s8_sequence(char *err, size_t errlen) {
    st_index *idx = NULL;
    st_open_opts o = {.model_dir = g_s8dir};
    k3_status st = st_open(&idx, &o, err, errlen);
    const st_tensor *t = NULL;
    if (!st) st = st_find(idx, "experts.0.w2", &t, err, errlen);
    uint8_t buf[4096];
    if (!st) st = st_read_raw(idx, t, buf, sizeof buf, err, errlen);
    if (!st && buf[1] != (uint8_t)((8192 + 1) * 7)) st = K3_ERR_INTERNAL;
    st_close(&idx);
    return st;
}

static void test_s9(void) {
    fault f = {0, 0, 0};
    st_set_fault_hook(fault_fn, &f);
    g_err[0] = 0;
    k3_status st = s8_sequence(g_err, sizeof g_err);
    int total = f.calls;
    CHECK(st == K3_OK && total >= 3, "S9 baseline sequence issues %d preads (%s)", total, g_err);
    for (int mode = 0; mode < 2; mode++) {
        int clean = 1;
        for (int n = 1; n <= total; n++) {
            f = (fault){0, n, mode};
            st = s8_sequence(g_err, sizeof g_err);
            int ok = st == K3_ERR_IO && has("model-00001-of-00001.safetensors") &&
                     has(mode == 0 ? "Input/output error" : "short read");
            if (!ok) {
                clean = 0;
                printf("# S9 mode %d n %d: %s %s\n", mode, n, k3_status_name(st), g_err);
            }
        }
        CHECK(clean,
              "S9 the N-th pread %s for N = 1..%d: always a clean K3_ERR_IO naming the "
              "shard",
              mode == 0 ? "fails with EIO" : "returns one byte short", total);
    }
    f = (fault){0, total + 1, 0};
    g_err[0] = 0;
    st = s8_sequence(g_err, sizeof g_err);
    CHECK(st == K3_OK, "S9 N beyond the last pread: the sequence succeeds (%s)", g_err);
    st_set_fault_hook(NULL, NULL);
}

static void test_s8(void) {
    st_index *idx = NULL;
    st_open_opts o = {.model_dir = g_s8dir};
    g_err[0] = 0;
    k3_status st = st_open(&idx, &o, g_err, sizeof g_err);
    const st_tensor *w1 = NULL, *w2 = NULL;
    if (!st) st = st_find(idx, "experts.0.w1", &w1, g_err, sizeof g_err);
    if (!st) st = st_find(idx, "experts.0.w2", &w2, g_err, sizeof g_err);
    CHECK(st == K3_OK && w1 && w2 && w1->offset == 4096 && w2->offset == 4096 + 8192,
          "S8 shard opened, data section at 4096 (%s)", g_err);
    if (st) {
        st_close(&idx);
        return;
    }
    /* O_DIRECT: aligned reads through the direct fd (or the buffered
     * fallback where the filesystem refuses O_DIRECT) give the same bytes */
    uint8_t *a = aligned_alloc(4096, 8192), *b = malloc(8192);
    st = st_pread(idx, 0, 4096, a, 8192, 1, g_err, sizeof g_err);
    k3_status st2 = st_pread(idx, 0, 4096, b, 8192, 0, g_err, sizeof g_err);
    CHECK(st == K3_OK && st2 == K3_OK && memcmp(a, b, 8192) == 0,
          "direct and buffered reads agree (O_DIRECT fd %s)",
          st_shard_fd(idx, 0, 1) >= 0 ? "open" : "unavailable, buffered fallback");
    st = st_pread(idx, 0, 4097, a, 4096, 1, g_err, sizeof g_err);
    CHECK(st == K3_ERR_ARG && has("aligned to 4096"), "misaligned direct read refused: %s", g_err);

    g_err[0] = 0;
    st = st_shard_check(idx, 0, g_err, sizeof g_err);
    CHECK(st == K3_OK, "st_shard_check: unchanged shard passes (%s)", g_err);
    /* truncate after open: the next read is a clean error, no SIGBUS */
    char p[700];
    snprintf(p, sizeof p, "%s/model-00001-of-00001.safetensors", g_s8dir);
    int tr = truncate(p, 4096 + 8192 + 100);
    st = st_shard_check(idx, 0, g_err, sizeof g_err);
    CHECK(st == K3_ERR_IO && has("changed since it was opened") && has("16384 -> 12388"),
          "st_shard_check sees the truncation: %s", g_err);
    st = st_read_raw(idx, w2, b, 4096, g_err, sizeof g_err);
    CHECK(tr == 0 && st == K3_ERR_IO && has("short read") && has("experts.0.w2") &&
              has("model-00001-of-00001.safetensors") && has("got 100 of 4096"),
          "S8 shard truncated after open: %s", g_err);
    st = st_pread(idx, 0, 4096 + 8192, a, 4096, 1, g_err, sizeof g_err);
    CHECK(st == K3_ERR_IO && has("short read"), "S8 truncated direct read: %s", g_err);
    st = st_read_raw(idx, w1, b, 8192, g_err, sizeof g_err);
    CHECK(st == K3_OK, "S8 tensors before the cut still read (%s)", g_err);
    free(a);
    free(b);
    st_close(&idx);
}

/* Concurrent lookups and reads (the mutex and the pread path; run under
 * make tsan for the race check). */
static void *reader(void *arg) {
    st_index *idx = arg;
    char err[256];
    int bad = 0;
    for (int i = 0; i < 200; i++) {
        const st_tensor *t;
        if (st_find(idx, i & 1 ? "experts.0.w1" : "experts.0.w2", &t, err, sizeof err)) {
            bad++;
            continue;
        }
        uint8_t buf[256];
        if (st_pread(idx, t->shard, t->offset, buf, sizeof buf, 0, err, sizeof err)) bad++;
    }
    return (void *)(intptr_t)bad;
}

static void test_threads(void) {
    make_s8_dir(); /* fresh, untruncated */
    st_index *idx = NULL;
    st_open_opts o = {.model_dir = g_s8dir};
    k3_status st = st_open(&idx, &o, g_err, sizeof g_err);
    if (st) {
        CHECK(0, "open for threads: %s", g_err);
        return;
    }
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, reader, idx);
    intptr_t bad = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        bad += (intptr_t)r;
    }
    CHECK(bad == 0, "4 threads x 200 lazy lookups + preads (%ld failures)", (long)bad);
    st_close(&idx);
}

/* The tiny fixture from tests/fixtures/k3_gen.py, when it exists. */
static void test_tiny(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", t_tiny_dir());
    if (access(p, R_OK) != 0) {
        SKIP("tiny fixture checks", "%s does not exist (make tiny)", p);
        return;
    }
    k3_status st;
    st_index *idx = open_dir(t_tiny_dir(), NULL, 0, &st);
    CHECK(st == K3_OK && st_shard_count(idx) > 0, "tiny fixture: st_open (%s)", g_err);
    if (st) return;
    const char *pre = st_prefix(idx);
    char name[256];
    snprintf(name, sizeof name, "%smodel.layers.0.input_layernorm.weight", pre);
    const st_tensor *t = NULL;
    st = st_find(idx, name, &t, g_err, sizeof g_err);
    CHECK(st == K3_OK && strcmp(pre, "language_model.") == 0 && t && t->rank == 1 &&
              t->shape[0] == 64,
          "tiny fixture: %s found, [64] (prefix '%s') (%s)", name, pre, g_err);
    int n_open = 0;
    for (int i = 0; i < st_shard_count(idx); i++) n_open += st_shard_is_open(idx, i);
    CHECK(n_open == 1, "tiny fixture: one lookup opened %d of %d shards (index.json laziness)",
          n_open, st_shard_count(idx));
    if (t) {
        float w[64];
        st = st_read_f32(idx, t, w, 64, g_err, sizeof g_err);
        int finite = 1;
        for (int i = 0; i < 64 && !st; i++) finite &= isfinite(w[i]);
        CHECK(st == K3_OK && finite, "tiny fixture: input_layernorm reads as finite f32 (%s)",
              g_err);
    }
    st = st_open_all(idx, g_err, sizeof g_err);
    CHECK(st == K3_OK && st_tensor_count(idx) > 0,
          "tiny fixture: every shard parses (%d tensors) (%s)", st_tensor_count(idx), g_err);
    st_close(&idx);
}

/* ---- helper mode for the strace integration test --------------------------- */

static int open_mode(const char *dir) {
    k3_status st;
    st_index *idx = open_dir(dir, NULL, 0, &st);
    if (!st) st = st_open_all(idx, g_err, sizeof g_err);
    printf("status %s: %s\n", k3_status_name(st), st ? g_err : "ok");
    st_close(&idx);
    return 0;
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--open") == 0) return open_mode(argv[2]);
    snprintf(g_root, sizeof g_root, "%s/k3stXXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_root)) {
        printf("not ok - mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    test_conversions();
    test_s1();
    test_s1_no_alloc();
    test_s2();
    test_s3();
    test_s4();
    test_s5();
    test_lazy();
    test_read_dtypes();
    test_dirs();
    test_s7();
    make_s8_dir();
    test_s9();
    test_s8();
    test_threads();
    test_tiny();
    nftw(g_root, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_MAIN_END();
}
