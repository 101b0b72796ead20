/* coordinator/cmd_tokenize.c: `k3-coordinator tokenize` (cmd_tokenize.h). */
#include "coordinator/cmd_tokenize.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/text/tokenizer.h"

static const char USAGE[] =
    "usage: k3-coordinator tokenize --tokenizer DIR [--file F | TEXT] [--trusted]\n"
    "       k3-coordinator tokenize --tokenizer DIR --decode [--file F | ID...]\n"
    "  --tokenizer DIR  directory with tiktoken.model and tokenizer_config.json\n"
    "  --file F         read the text (or ids) from F; '-' is stdin (the default\n"
    "                   when no TEXT / ID is given)\n"
    "  --trusted        recognize added tokens (<|open|> ...) in the text\n"
    "  --decode         ids in, text out\n";

/* Reads all of F (or stdin) up to K3_TOK_MAX_INPUT bytes. */
static char *read_input(const char *path, size_t *len) {
    FILE *f = (!path || !strcmp(path, "-")) ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "tokenize: %s: cannot open\n", path);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = k3_xmalloc(cap);
    for (;;) {
        if (n + 1 >= cap) {
            if (cap > K3_TOK_MAX_INPUT) {
                fprintf(stderr, "tokenize: %s: more than K3_TOK_MAX_INPUT %u bytes\n",
                        path ? path : "stdin", K3_TOK_MAX_INPUT);
                free(buf);
                if (f != stdin) fclose(f);
                return NULL;
            }
            cap *= 2;
            buf = k3_xrealloc(buf, cap);
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        if (got == 0) break;
        n += got;
    }
    int bad = ferror(f);
    if (f != stdin) fclose(f);
    if (bad) {
        fprintf(stderr, "tokenize: %s: read error\n", path ? path : "stdin");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* Parses ids separated by spaces, commas or newlines. Unlike the library's
 * decode (which skips unknown ids, as the engine must), the tool refuses
 * them: a typo in a hand-typed id list should not pass silently. */
static int parse_ids(const k3_tok *tok, const char *s, k3_tok_ids *ids) {
    int32_t nv = k3_tok_n_vocab(tok);
    while (*s) {
        if (strchr(" \t\r\n,", *s)) {
            s++;
            continue;
        }
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || (*end && !strchr(" \t\r\n,", *end))) {
            fprintf(stderr, "tokenize: \"%.20s\" is not an id\n", s);
            return -1;
        }
        if (v < 0 || v >= nv) {
            fprintf(stderr, "tokenize: id %lld is outside the vocabulary 0..%d\n", v, nv - 1);
            return -1;
        }
        k3_tok_ids_push(ids, (int32_t)v);
        s = end;
    }
    return 0;
}

/* Options are parsed by hand: the subcommand has four flags and runs before
 * any engine option matters. The first non-option argument starts the text
 * (or ids); everything after it is joined with single spaces. */
int cmd_tokenize(int argc, char **argv) {
    const char *dir = NULL, *file = NULL;
    int decode = 0, trusted = 0, first_pos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--file") && i + 1 < argc) {
            file = argv[++i];
        } else if (!strcmp(argv[i], "--decode")) {
            decode = 1;
        } else if (!strcmp(argv[i], "--trusted")) {
            trusted = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(USAGE, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--")) {
            first_pos = i + 1;
            break;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "tokenize: unknown option %s\n%s", argv[i], USAGE);
            return 2;
        } else {
            first_pos = i;
            break;
        }
    }
    if (!dir) {
        fprintf(stderr, "tokenize: --tokenizer DIR is required\n%s", USAGE);
        return 2;
    }
    if (file && first_pos && first_pos < argc) {
        fprintf(stderr, "tokenize: give either --file or arguments, not both\n");
        return 2;
    }
    char err[512];
    k3_tok *tok = NULL;
    if (k3_tok_open(&tok, dir, err, sizeof err) != K3_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
        return 1;
    }
    /* the input: the remaining arguments joined by spaces, or a file */
    char *in = NULL;
    size_t len = 0;
    if (first_pos && first_pos < argc) {
        size_t total = 1;
        for (int i = first_pos; i < argc; i++) total += strlen(argv[i]) + 1;
        in = k3_xmalloc(total);
        in[0] = 0;
        for (int i = first_pos; i < argc; i++) {
            if (i > first_pos) strcat(in, " ");
            strcat(in, argv[i]);
        }
        len = strlen(in);
    } else {
        in = read_input(file, &len);
    }
    int rc = 1;
    k3_tok_ids ids = {0};
    if (!in) {
        /* message printed */
    } else if (decode) {
        char *out = NULL;
        size_t ol = 0;
        if (parse_ids(tok, in, &ids) == 0 &&
            k3_tok_decode(tok, ids.v, ids.n, &out, &ol, NULL, err, sizeof err) == K3_OK) {
            fwrite(out, 1, ol, stdout);
            fputc('\n', stdout);
            rc = 0;
        }
        free(out);
    } else if (k3_tok_encode(tok, in, len, trusted, &ids, err, sizeof err) != K3_OK) {
        fprintf(stderr, "tokenize: %s\n", err);
    } else {
        for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.v[i]);
        printf("\n");
        rc = 0;
    }
    if (fflush(stdout) != 0) rc = 1;
    k3_tok_ids_free(&ids);
    free(in);
    k3_tok_close(&tok);
    return rc;
}
