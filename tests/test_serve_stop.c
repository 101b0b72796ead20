/* tests/test_serve_stop.c: stop strings over streamed text
 * (coordinator/serve_stop.h): hand-made cases (a stop split across pieces,
 * a false start, the earliest of several, overlapping prefixes, flush,
 * multi-byte UTF-8, nothing after a match), then random texts, stop strings
 * and piece splits against the reference: the whole text cut before the
 * occurrence that ends first (the longer of two ending together), which
 * makes the answer independent of the split. */
#include <stdint.h>
#include <string.h>

#include "coordinator/serve_stop.h"
#include "tests/test.h"

/* Feeds text in the pieces given by cuts (piece ends, ascending, the last
 * == strlen(text)), then a flush; the released text goes to got. Returns
 * how many pushes reported a match. */
static int feed(const char *const *stops, int n_stops, const char *text, const size_t *cuts,
                int n_cuts, char *got, size_t cap, size_t *first_out_at_match) {
    serve_stop s;
    serve_stop_init(&s, stops, n_stops);
    size_t at = 0, w = 0;
    int hits = 0;
    *first_out_at_match = (size_t)-1;
    for (int i = 0; i <= n_cuts; i++) {
        const char *out;
        size_t len;
        int flush = i == n_cuts;
        size_t end = flush ? at : cuts[i];
        int hit = serve_stop_push(&s, text + at, end - at, flush, &out, &len);
        if (w + len < cap) {
            memcpy(got + w, out, len);
            w += len;
        }
        if (hit) {
            hits++;
            if (*first_out_at_match == (size_t)-1) *first_out_at_match = w;
        }
        at = end;
    }
    got[w] = 0;
    serve_stop_free(&s);
    return hits;
}

/* One push per byte. */
static int feed_bytes(const char *const *stops, int n, const char *text, char *got, size_t cap) {
    size_t cuts[256], m = strlen(text), dummy;
    for (size_t i = 0; i < m; i++) cuts[i] = i + 1;
    return feed(stops, n, text, cuts, (int)m, got, cap, &dummy);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

int main(void) {
    char got[1024];
    const char *end[] = {"END"};

    /* split across pieces: released only once it cannot be a stop string */
    {
        serve_stop s;
        serve_stop_init(&s, end, 1);
        const char *o;
        size_t n;
        int h = serve_stop_push(&s, "abcE", 4, 0, &o, &n);
        CHECK(!h && n == 3 && !memcmp(o, "abc", 3), "'abcE': 'abc' out, 'E' held");
        h = serve_stop_push(&s, "N", 1, 0, &o, &n);
        CHECK(!h && n == 0, "'N': 'EN' still held");
        h = serve_stop_push(&s, "Dxyz", 4, 0, &o, &n);
        CHECK(h == 1 && n == 0, "'Dxyz': the match, nothing more out");
        h = serve_stop_push(&s, "more", 4, 1, &o, &n);
        CHECK(h == 0 && n == 0, "after a match nothing comes out, even at flush");
        serve_stop_free(&s);
    }
    /* a false start is released when it stops matching */
    {
        serve_stop s;
        serve_stop_init(&s, end, 1);
        const char *o;
        size_t n;
        serve_stop_push(&s, "abEN", 4, 0, &o, &n);
        CHECK(n == 2 && !memcmp(o, "ab", 2), "'abEN': 'EN' held");
        int h = serve_stop_push(&s, "x", 1, 0, &o, &n);
        CHECK(!h && n == 3 && !memcmp(o, "ENx", 3), "'x': 'ENx' released");
        serve_stop_free(&s);
    }
    /* flush releases a held prefix */
    feed_bytes(end, 1, "abEN", got, sizeof got);
    CHECK(!strcmp(got, "abEN"), "flush releases a held 'EN' (got '%s')", got);
    /* the earliest match of several wins */
    const char *two[] = {"xyz", "b"};
    feed_bytes(two, 2, "abxyz", got, sizeof got);
    CHECK(!strcmp(got, "a"), "earliest of 'xyz', 'b' in 'abxyz' (got '%s')", got);
    const char *two2[] = {"cd", "bcde"};
    size_t c1[] = {5}, at;
    feed(two2, 2, "abcde", c1, 1, got, sizeof got, &at);
    CHECK(!strcmp(got, "ab"),
          "one piece 'abcde', stops 'cd' and 'bcde': 'cd' ends first (got '%s')", got);
    const char *two3[] = {"cd", "bcd"};
    feed(two3, 2, "abcde", c1, 1, got, sizeof got, &at);
    CHECK(!strcmp(got, "a"), "stops 'cd' and 'bcd' end together: the longer wins (got '%s')", got);
    /* overlapping prefixes: "aab" in "aaab" */
    const char *aab[] = {"aab"};
    int h = feed_bytes(aab, 1, "aaab", got, sizeof got);
    CHECK(h == 1 && !strcmp(got, "a"), "'aab' in 'aaab' byte by byte: 'a' (got '%s')", got);
    /* the stop string at the very start and at the very end */
    h = feed_bytes(end, 1, "ENDabc", got, sizeof got);
    CHECK(h == 1 && !strcmp(got, ""), "stop at the start: nothing (got '%s')", got);
    h = feed_bytes(end, 1, "abcEND", got, sizeof got);
    CHECK(h == 1 && !strcmp(got, "abc"), "stop at the end: 'abc' (got '%s')", got);
    /* UTF-8: the cut lands on a character boundary */
    const char *eacute[] = {"\xc3\xa9t\xc3\xa9"};
    h = feed_bytes(eacute, 1, "un \xc3\xa9l\xc3\xa9phant, un \xc3\xa9t\xc3\xa9", got, sizeof got);
    CHECK(h == 1 && !strcmp(got, "un \xc3\xa9l\xc3\xa9phant, un "), "UTF-8 stop 'été' (got '%s')",
          got);
    /* no stop strings: pieces pass through at once */
    {
        serve_stop s;
        serve_stop_init(&s, NULL, 0);
        const char *o;
        size_t n;
        int hh = serve_stop_push(&s, "abc", 3, 0, &o, &n);
        CHECK(!hh && n == 3 && !memcmp(o, "abc", 3), "no stop strings: passed through");
        serve_stop_free(&s);
    }
    /* an empty stop string is skipped, not a match everywhere */
    const char *empty[] = {"", "zz"};
    h = feed_bytes(empty, 2, "abc", got, sizeof got);
    CHECK(h == 0 && !strcmp(got, "abc"), "an empty stop string is ignored (got '%s')", got);

    /* random: texts over {a,b,c}, 1-4 stops of 1-4 letters, random pieces */
    int bad = 0, cases = 3000;
    for (int t = 0; t < cases; t++) {
        char text[64], stops_buf[4][8];
        const char *stops[4];
        int len = 1 + (int)(next() % 40), n = 1 + (int)(next() % 4);
        for (int i = 0; i < len; i++) text[i] = (char)('a' + next() % 3);
        text[len] = 0;
        for (int k = 0; k < n; k++) {
            int sl = 1 + (int)(next() % 4);
            for (int i = 0; i < sl; i++) stops_buf[k][i] = (char)('a' + next() % 3);
            stops_buf[k][sl] = 0;
            stops[k] = stops_buf[k];
        }
        /* reference: the occurrence that ends first, then the longer */
        size_t want = (size_t)len, best_end = (size_t)-1;
        for (int k = 0; k < n; k++) {
            const char *m = strstr(text, stops[k]);
            if (!m) continue;
            size_t at = (size_t)(m - text), e = at + strlen(stops[k]);
            if (e < best_end || (e == best_end && at < want)) {
                best_end = e;
                want = at;
            }
        }
        size_t cuts[64];
        int nc = 0;
        for (int i = 1; i < len; i++)
            if (next() % 3 == 0) cuts[nc++] = (size_t)i;
        cuts[nc++] = (size_t)len;
        size_t at_match;
        int hits = feed(stops, n, text, cuts, nc, got, sizeof got, &at_match);
        int ok =
            strlen(got) == want && !memcmp(got, text, want) && hits == (want < (size_t)len ? 1 : 0);
        if (!ok && bad++ < 5) {
            char all[64] = "";
            for (int k = 0; k < n; k++) {
                strcat(all, stops[k]);
                strcat(all, k + 1 < n ? "," : "");
            }
            CHECK(0, "random: text '%s', stops %s, %d pieces: got '%s', want %zu bytes", text, all,
                  nc, got, want);
        }
    }
    CHECK(bad == 0, "random: %d texts, stops and piece splits against the reference (%d wrong)",
          cases, bad);
    TEST_MAIN_END();
}
