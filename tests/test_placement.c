/* tests/test_placement.c: the expert placement (common/experts/placement.h):
 *
 *   build     equal drives deal ids round robin; a drive of twice the weight
 *             holds twice the experts; the hottest experts of a layer land on
 *             different drives; dense layers are not placed
 *   file      save / load round trip gives the same drive for every expert
 *   refusals  another model's fingerprint, an expert claimed by two drives
 *             or twice by one, an expert on no drive, a layer listed twice,
 *             a wrong format or version, a MoE layer missing: each refused
 *             with a message naming it
 *   split     byte-split (version 2): the pieces of a span cover it in drive
 *             order without overlap, cut at aligned absolute offsets, in
 *             proportion to the weights (a tiny span: empty pieces); save /
 *             load keeps them; v2 without "split", v1 with it, a split file
 *             with layers, an alignment that is not a power of two, a drive
 *             of weight 0, another model's split placement: refused
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/experts/placement.h"
#include "tests/test.h"

static char g_dir[] = "/tmp/stripe-test-placement.XXXXXX";

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(2);
    }
    fputs(text, f);
    fclose(f);
}

/* Loads text as a placement; returns the status and leaves the message. */
static k3_status load_text(const char *text, char *err, size_t errlen) {
    char path[256];
    snprintf(path, sizeof path, "%s/p.json", g_dir);
    write_file(path, text);
    k3_placement *p = NULL;
    k3_status st = k3_placement_load(&p, path, err, errlen);
    k3_placement_free(&p);
    return st;
}

static void test_build(void) {
    const char *drives[3] = {"/d0", "/d1", "/d2"};
    uint8_t is_moe[3] = {0, 1, 1};
    k3_place_input in = {.drives = drives,
                         .n_drives = 3,
                         .fingerprint = 0x1234,
                         .n_layers = 3,
                         .n_experts = 12,
                         .is_moe = is_moe,
                         .expert_bytes = 100};
    char err[512] = "";
    k3_placement *p = NULL;
    k3_status st = k3_placement_build(&p, &in, err, sizeof err);
    CHECK(st == K3_OK, "build with 3 equal drives: %s", err);
    if (st != K3_OK) return;
    int rr = 1;
    for (int e = 0; e < 12; e++) rr &= k3_placement_drive_of(p, 1, e) == e % 3;
    CHECK(rr, "equal drives, no history: expert e on drive e %% 3");
    CHECK(k3_placement_drive_of(p, 0, 0) == -1, "the dense layer 0 is not placed");
    k3_placement_free(&p);

    double w[3] = {2.0, 1.0, 1.0};
    in.weight = w;
    st = k3_placement_build(&p, &in, err, sizeof err);
    CHECK(st == K3_OK && k3_placement_count(p, 2, 0) == 6 && k3_placement_count(p, 2, 1) == 3 &&
              k3_placement_count(p, 2, 2) == 3,
          "weights 2:1:1 hold 6, 3, 3 of 12 experts (got %d, %d, %d)",
          p ? k3_placement_count(p, 2, 0) : -1, p ? k3_placement_count(p, 2, 1) : -1,
          p ? k3_placement_count(p, 2, 2) : -1);
    k3_placement_free(&p);

    /* usage: experts 9, 10, 11 of layer 1 are hot; they go to 3 drives, and
     * the hottest drive then takes fewer of the cold ones */
    uint64_t usage[3 * 12] = {0};
    usage[12 + 9] = 1000, usage[12 + 10] = 900, usage[12 + 11] = 800;
    in.weight = NULL;
    in.usage = usage;
    st = k3_placement_build(&p, &in, err, sizeof err);
    int a = p ? k3_placement_drive_of(p, 1, 9) : -1, b = p ? k3_placement_drive_of(p, 1, 10) : -1,
        c = p ? k3_placement_drive_of(p, 1, 11) : -1;
    CHECK(st == K3_OK && a != b && b != c && a != c,
          "the 3 hottest experts are on 3 different drives (%d, %d, %d)", a, b, c);
    CHECK(p && k3_placement_count(p, 1, a) < k3_placement_count(p, 1, c),
          "the drive of the hottest expert holds fewer cold ones (%d < %d)",
          p ? k3_placement_count(p, 1, a) : -1, p ? k3_placement_count(p, 1, c) : -1);

    /* save / load round trip */
    char path[256];
    snprintf(path, sizeof path, "%s/rt.json", g_dir);
    st = p ? k3_placement_save(p, path, err, sizeof err) : K3_ERR_STATE;
    CHECK(st == K3_OK, "save: %s", err);
    k3_placement *q = NULL;
    st = k3_placement_load(&q, path, err, sizeof err);
    CHECK(st == K3_OK, "load of the saved file: %s", err);
    if (st == K3_OK && p) {
        int same = k3_placement_drives(q) == 3 && k3_placement_fingerprint(q) == 0x1234;
        for (int l = 0; l < 3; l++)
            for (int e = 0; e < 12; e++)
                same &= k3_placement_drive_of(p, l, e) == k3_placement_drive_of(q, l, e);
        CHECK(same, "round trip: same fingerprint, drives and drive of every expert");
        st = k3_placement_check(q, 0x1234, 3, 12, is_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_OK, "check against its own model: %s", err);
        st = k3_placement_check(q, 0x9999, 3, 12, is_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_ERR_MISMATCH && strstr(err, "0000000000001234") &&
                  strstr(err, "0000000000009999") && strstr(err, "rt.json"),
              "another model's placement is refused naming the file and both fingerprints: %s",
              err);
        uint8_t more_moe[3] = {1, 1, 1};
        st = k3_placement_check(q, 0x1234, 3, 12, more_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_ERR_MISSING && strstr(err, "layer 0"),
              "a MoE layer the placement lacks is refused naming it: %s", err);
        st = k3_placement_check(q, 0x1234, 3, 16, is_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_ERR_MISMATCH, "another expert count is refused: %s", err);
        char fp[256];
        k3_placement_file_path(q, 1, "model-1.safetensors", fp, sizeof fp, err, sizeof err);
        CHECK(strcmp(fp, "/d1/k3-stripe/model-1.safetensors") == 0, "drive file path %s", fp);
    }
    k3_placement_free(&q);
    k3_placement_free(&p);
}

#define HEAD                                                                                       \
    "{\"format\":\"k3shard-placement\",\"version\":1,\"model_fingerprint\":\"00000000000000ab\","  \
    "\"n_layers\":2,\"n_experts\":4,\"expert_bytes\":10,"                                          \
    "\"drives\":[{\"path\":\"/a\",\"weight\":1},{\"path\":\"/b\",\"weight\":1}],"

static void test_refusals(void) {
    char err[512];
    struct {
        const char *text, *want, *what;
        k3_status st;
    } cases[] = {
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1],[2,3]]}]}", NULL, "a valid file", K3_OK},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1],[1,2,3]]}]}",
         "layer 1 expert 1 is claimed twice: by drive 0 (/a) and drive 1 (/b)",
         "an expert on two drives", K3_ERR_FORMAT},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1,1],[2,3]]}]}",
         "layer 1 expert 1 is claimed twice", "an expert twice on one drive", K3_ERR_FORMAT},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1],[3]]}]}",
         "layer 1 expert 2 is on no drive", "an expert on no drive", K3_ERR_FORMAT},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1],[2,9]]}]}", "not an expert id in [0, 4)",
         "an expert id out of range", K3_ERR_FORMAT},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1],[2,3]]},"
              "{\"layer\":1,\"experts\":[[0,1],[2,3]]}]}",
         "layer 1 is listed twice", "a layer listed twice", K3_ERR_FORMAT},
        {HEAD "\"layers\":[{\"layer\":5,\"experts\":[[0,1],[2,3]]}]}", "\"layer\" is 5",
         "a layer out of range", K3_ERR_LIMIT},
        {HEAD "\"layers\":[{\"layer\":1,\"experts\":[[0,1,2,3]]}]}", "one per drive",
         "fewer id lists than drives", K3_ERR_FORMAT},
        {"{\"format\":\"k3shard-plan\",\"version\":1}", "expected \"k3shard-placement\"",
         "a plan file given as a placement", K3_ERR_FORMAT},
        {"{\"format\":\"k3shard-placement\",\"version\":7}",
         "version 7, this build reads versions 1 and 2", "a newer version", K3_ERR_MISMATCH},
        {"{\"format\":", "p.json line", "malformed JSON", K3_ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        err[0] = 0;
        k3_status st = load_text(cases[i].text, err, sizeof err);
        CHECK(st == cases[i].st && (!cases[i].want || strstr(err, cases[i].want)), "%s: %s (%s)",
              cases[i].what, st == K3_OK ? "loads" : "refused", st == K3_OK ? "" : err);
    }
    k3_placement *p = NULL;
    k3_status st = k3_placement_load(&p, "/nonexistent/stripe.json", err, sizeof err);
    CHECK(st == K3_ERR_MISSING && strstr(err, "/nonexistent/stripe.json"),
          "a missing placement file is refused naming it: %s", err);
}

/* Pieces of [off, off + len) over p's drives: cover, order, alignment. */
static int pieces_ok(const k3_placement *p, uint64_t off, uint64_t len, uint64_t *bytes) {
    uint64_t at = off, A = k3_placement_align(p);
    int ok = 1;
    for (int d = 0; d < k3_placement_drives(p); d++) {
        uint64_t lo, hi;
        k3_placement_piece(p, d, off, len, &lo, &hi);
        ok &= lo == at && hi >= lo && hi <= off + len;
        /* a cut is aligned, or clamped to an end of the span */
        ok &= (lo == off || lo == off + len || lo % A == 0) &&
              (hi == off || hi == off + len || hi % A == 0);
        bytes[d] = hi - lo;
        at = hi;
    }
    return ok && at == off + len;
}

static void test_split(void) {
    const char *drives[3] = {"/s0", "/s1", "/s2"};
    const double w[3] = {2, 1, 1};
    uint8_t is_moe[3] = {0, 1, 1};
    k3_place_input in = {.drives = drives,
                         .n_drives = 3,
                         .weight = w,
                         .fingerprint = 0x77,
                         .n_layers = 3,
                         .n_experts = 8,
                         .is_moe = is_moe,
                         .expert_bytes = 1 << 20,
                         .split = 1};
    char err[512] = "", path[256];
    k3_placement *p = NULL, *q = NULL;
    k3_status st = k3_placement_build(&p, &in, err, sizeof err);
    CHECK(st == K3_OK && k3_placement_split(p) && k3_placement_align(p) == 4096,
          "build a split placement over 3 drives (weights 2,1,1), align 4096: %s", err);
    if (st != K3_OK) return;
    uint64_t b[3], off = 12345, len = 17u << 20; /* an unaligned start, 17 MiB */
    int ok = pieces_ok(p, off, len, b);
    CHECK(ok && b[0] + b[1] + b[2] == len, "pieces cover the span in drive order, cut on 4096");
    double s0 = (double)b[0] / (double)len, s1 = (double)b[1] / (double)len;
    CHECK(s0 > 0.499 && s0 < 0.501 && s1 > 0.249 && s1 < 0.251,
          "weights 2,1,1: shares %.4f, %.4f, %.4f", s0, s1, 1 - s0 - s1);
    ok = pieces_ok(p, 8200, 100, b);
    CHECK(ok && b[0] + b[1] + b[2] == 100 && (b[0] == 0 || b[0] == 100),
          "a 100-byte span inside one block lies on one drive (%llu, %llu, %llu)",
          (unsigned long long)b[0], (unsigned long long)b[1], (unsigned long long)b[2]);
    CHECK(k3_placement_drive_of(p, 1, 3) == -1 && k3_placement_count(p, 1, 0) == 0,
          "a split placement has no per-expert drive");
    snprintf(path, sizeof path, "%s/split.json", g_dir);
    st = k3_placement_save(p, path, err, sizeof err);
    if (st == K3_OK) st = k3_placement_load(&q, path, err, sizeof err);
    int same = st == K3_OK && k3_placement_split(q) && k3_placement_drives(q) == 3;
    for (int d = 0; same && d < 3; d++) {
        uint64_t a0, a1, c0, c1;
        k3_placement_piece(p, d, off, len, &a0, &a1);
        k3_placement_piece(q, d, off, len, &c0, &c1);
        same &= a0 == c0 && a1 == c1 && k3_placement_drive_weight(q, d) == w[d];
    }
    CHECK(same, "save / load of a split placement keeps drives, weights and pieces: %s",
          st == K3_OK ? "" : err);
    if (q) {
        st = k3_placement_check(q, 0x77, 3, 8, is_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_OK, "a split placement covers every MoE layer: %s", st ? err : "");
        st = k3_placement_check(q, 0x78, 3, 8, is_moe, 0, 3, err, sizeof err);
        CHECK(st == K3_ERR_MISMATCH && strstr(err, "made for model 0000000000000077"),
              "another model's split placement is refused: %s", err);
    }
    k3_placement_free(&q);
    k3_placement_free(&p);
    in.align = 3000;
    st = k3_placement_build(&p, &in, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "3000 is not a power of two"),
          "building with align 3000 is refused: %s", err);
    k3_placement_free(&p);
#define SHEAD(v)                                                                                   \
    "{\"format\":\"k3shard-placement\",\"version\":" v ",\"model_fingerprint\":"                   \
    "\"00000000000000ab\",\"n_layers\":2,\"n_experts\":4,\"expert_bytes\":10,"
#define SDRIVES "\"drives\":[{\"path\":\"/a\",\"weight\":1},{\"path\":\"/b\",\"weight\":3}]"
    struct {
        const char *text, *want, *what;
        k3_status st;
    } cases[] = {
        {SHEAD("2") "\"split\":true," SDRIVES "}", NULL, "a valid split file", K3_OK},
        {SHEAD("2") "\"split\":true,\"align\":512," SDRIVES "}", NULL, "align 512", K3_OK},
        {SHEAD("2") SDRIVES "}", "version 2 needs \"split\": true", "version 2 without split",
         K3_ERR_FORMAT},
        {SHEAD("1") "\"split\":true," SDRIVES ",\"layers\":[]}", "version 1 cannot have",
         "version 1 with split", K3_ERR_FORMAT},
        {SHEAD("2") "\"split\":true," SDRIVES ",\"layers\":[]}", "has no \"layers\"",
         "a split file with layers", K3_ERR_FORMAT},
        {SHEAD("2") "\"split\":true,\"align\":3000," SDRIVES "}", "3000, not a power of two",
         "align 3000", K3_ERR_FORMAT},
        {SHEAD("2") "\"split\":\"yes\"," SDRIVES "}", "\"split\" is not true or false",
         "split not a boolean", K3_ERR_FORMAT},
        {SHEAD("2") "\"split\":true,\"drives\":[{\"path\":\"/a\",\"weight\":0}]}",
         "drives[0].weight must be a number > 0", "a drive of weight 0", K3_ERR_FORMAT},
        {SHEAD("2") "\"split\":true,\"drives\":[]}", "0 drives outside [1, 16]", "no drives",
         K3_ERR_LIMIT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        err[0] = 0;
        st = load_text(cases[i].text, err, sizeof err);
        CHECK(st == cases[i].st && (!cases[i].want || strstr(err, cases[i].want)),
              "split: %s: %s (%s)", cases[i].what, st == K3_OK ? "loads" : "refused",
              st == K3_OK ? "" : err);
    }
}

int main(void) {
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 2;
    }
    test_build();
    test_refusals();
    test_split();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_MAIN_END();
}
