/* coordinator/cmd_chat.c: `k3-coordinator chat` (cmd_chat.h, docs/CHAT.md).
 *
 * One engine, one session (id 1). Each message is added to the
 * conversation (coordinator/chat_conv.h), whose next prompt extends the
 * ids the session already holds, so only the new turn is prefilled; the
 * answer streams through the same output filter as the HTTP API
 * (coordinator/chat_prompt.h): thinking dimmed on a colour terminal (or
 * under a "thinking" header), the answer as it is generated, then one
 * stats line. Ctrl-C during an answer sets the engine's cancel flag
 * (k3_engine_req.cancel): the answer keeps what was generated.
 *
 * Interactive when stdin and stdout are terminals (libedit, spinner,
 * colours); otherwise each input line is one message (or command), the
 * answer's text goes to stdout followed by a newline, and everything else
 * (thinking, stats, command output) to stderr, for scripts.
 */
#include "coordinator/cmd_chat.h"

#include <limits.h>
#include <locale.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/base/strbuf.h"
#include "common/engine/engine_opts.h"
#include "coordinator/chat_conv.h"
#include "coordinator/chat_prompt.h"
#include "coordinator/chat_term.h"
#include "coordinator/engine.h"

/* ---- the option table -------------------------------------------------- */

typedef struct chat_opts {
    k3_engine_opts eng; /* model, numerics, threads, expert cache */
    k3_cluster_cli cl;  /* K3_CLUSTER_OPT_ROWS: --local, --workers, liveness, keys */
    char *system;       /* system prompt, NULL = none */
    int think;          /* 1 on, 0 off */
    int ngen;           /* max tokens per answer */
    double temp;
    double top_p;
    int seed;
    int ctx;        /* session capacity, tokens */
    int chunk;      /* prefill chunk */
    char *history;  /* history file, NULL = the default */
    int no_history; /* keep no history file */
    int color;      /* 1 auto, 0 never */
    int help;
} chat_opts;

#define O(f) offsetof(chat_opts, f)
static const k3_opt chat_table[] = {
    K3_ENGINE_OPT_MODEL(chat_opts, eng),
    /* --system, --think and --ngen are not the CLI's rows: the conversation's
     * system prompt (also from K3_SYSTEM), on|off as the :think command takes
     * it, and the bound of one answer (default 1024, at least 1) */
    {.name = "system",
     .flag = "--system",
     .env = "K3_SYSTEM",
     .type = K3_OPT_STRING,
     .offset = O(system),
     .metavar = "TEXT",
     .help = "system prompt of the conversation (:system changes it)"},
    {.name = "think",
     .flag = "--think",
     .env = "K3_THINK",
     .type = K3_OPT_ENUM,
     .offset = O(think),
     .def = "on",
     .n_choices = 4,
     .choices = {1, 0, 1, 0},
     .names = {"on", "off", "1", "0"},
     .metavar = "on|off",
     .help = "thinking mode: the model reasons before it answers (:think on|off)"},
    {.name = "ngen",
     .flag = "--ngen",
     .env = "K3_NGEN",
     .type = K3_OPT_INT,
     .offset = O(ngen),
     .def = "1024",
     .min = 1,
     .max = K3_MAX_NGEN,
     .metavar = "N",
     .help = "most tokens of one answer (thinking included)"},
    K3_SAMPLER_OPT_ROWS(chat_opts, temp, top_p, seed, "0.6"),
    K3_ENGINE_OPT_CTX(chat_opts, ctx),
    K3_ENGINE_OPT_CHUNK(chat_opts, chunk),
    {.name = "history",
     .flag = "--history",
     .env = "K3_CHAT_HISTORY",
     .type = K3_OPT_STRING,
     .offset = O(history),
     .metavar = "FILE",
     .help = "line history (default ~/.local/share/k3shard/history)"},
    {.name = "no_history",
     .flag = "--no-history",
     .type = K3_OPT_BOOL,
     .offset = O(no_history),
     .help = "keep no history file"},
    {.name = "color",
     .flag = "--color",
     .type = K3_OPT_ENUM,
     .offset = O(color),
     .def = "auto",
     .n_choices = 2,
     .choices = {1, 0},
     .names = {"auto", "never"},
     .metavar = "auto|never",
     .help = "colours on a terminal (NO_COLOR in the environment also turns them off)"},
    K3_ENGINE_OPT_ROWS(chat_opts, eng),
    K3_CLUSTER_OPT_ROWS(chat_opts, cl),
    K3_OPT_HELP(chat_opts, help),
};
#undef O
#define N_CHAT_OPTS ((int)(sizeof chat_table / sizeof chat_table[0]))

static const char *chat_usage =
    "usage: k3-coordinator chat --model DIR [--local N | --workers EP,...] [--system TEXT]\n"
    "                           [--think on|off] [--ngen N] [--temp T] [--ctx N]\n"
    "Chat with the model in the terminal: type and press Enter; Ctrl-C stops the answer;\n"
    ":help lists the commands; Ctrl-D or :q exits. With stdin not a terminal, each line\n"
    "is one message and each answer one block on stdout (docs/CHAT.md).\n";

static const char *help_text =
    "  :help                  this list (every command also works with / instead of :)\n"
    "  :reset                 start a new conversation (the system prompt stays)\n"
    "  :system [TEXT | -]     show, set, or (-) remove the system prompt; the conversation stays\n"
    "  :think on|off          thinking mode (the model reasons before it answers)\n"
    "  :think hide|show       hide or show the reasoning (thinking stays on)\n"
    "  :set temp|top_p|seed|ngen V   sampling settings for the next answers\n"
    "  :stats                 the engine: workers, layer ranges, busy time, expert caches\n"
    "  :save FILE             the conversation as JSON (OpenAI messages, a valid\n"
    "                         /v1/chat/completions body)\n"
    "  :load FILE             a saved conversation (re-prefilled with the next message)\n"
    "  :retry                 answer the last message again (with the next seed)\n"
    "  :q                     exit (also :quit, :exit, Ctrl-D)\n"
    "  Multi-line: end a line with \\ to continue it, or wrap text in \"\"\" ... \"\"\";\n"
    "  pasted text keeps its lines (press Enter to send).\n";

/* ---- state ----------------------------------------------------------------- */

static atomic_int g_cancel; /* k3_engine_req.cancel: SIGINT during an answer */

static void on_sigint(int sig) {
    (void)sig;
    atomic_store(&g_cancel, 1);
}

typedef struct chat {
    const chat_opts *o;
    k3_engine *eng;
    const k3_tok *tok;
    const k3_config *cfg;
    chat_conv conv;
    chat_term *term; /* interactive only */
    int interactive; /* stdin and stdout are terminals */
    int color;       /* escape sequences on stdout */
    int think;       /* thinking mode */
    int show_think;  /* print the reasoning */
    int ngen;
    k3_sampler_opts samp;
    k3_engine_result last; /* the last answer's result (:stats) */
    int has_last;
    FILE *info; /* command output and stats: stdout when interactive, else stderr */
} chat;

/* One answer in progress (the on_token context). */
typedef struct answer {
    chat *c;
    k3_chat_filter *filter;
    chat_spin *spin;
    k3_tok_ids gen;      /* generated ids up to the stop id */
    k3_strbuf content;   /* the answer's text */
    k3_strbuf reasoning; /* its thinking */
    int stopped;         /* the filter saw a stop id */
    int shown;           /* -1 nothing printed yet, else the channel last printed */
    int think_shown;     /* some reasoning was printed */
    int cancel_own;      /* we set g_cancel ourselves (stop id reached) */
} answer;

/* ---- output ---------------------------------------------------------------- */

#define DIM   "\x1b[2m"
#define RESET "\x1b[0m"

static void show_reasoning(answer *a, const char *s, size_t n) {
    chat *c = a->c;
    if (n == 0 || !c->show_think) return;
    FILE *f = c->interactive ? stdout : stderr;
    if (a->shown != K3_CHAT_CH_THINK) {
        if (c->color)
            fputs(DIM, f);
        else
            fputs("--- thinking ---\n", f);
        a->shown = K3_CHAT_CH_THINK;
    }
    fwrite(s, 1, n, f);
    a->think_shown = 1;
    fflush(f);
}

static void show_content(answer *a, const char *s, size_t n) {
    chat *c = a->c;
    if (n == 0) return;
    if (a->shown == K3_CHAT_CH_THINK) {
        FILE *f = c->interactive ? stdout : stderr;
        if (c->color)
            fputs(RESET "\n\n", f);
        else
            fputs(c->interactive ? "\n--- answer ---\n" : "\n", f);
        fflush(f);
    }
    a->shown = K3_CHAT_CH_RESPONSE;
    fwrite(s, 1, n, stdout);
    fflush(stdout);
}

static void take_delta(answer *a, const k3_chat_delta *d) {
    k3_strbuf_add(&a->reasoning, d->reasoning ? d->reasoning : "", d->reasoning_len);
    k3_strbuf_add(&a->content, d->content ? d->content : "", d->content_len);
    show_reasoning(a, d->reasoning, d->reasoning_len);
    show_content(a, d->content, d->content_len);
}

static void on_token(void *ctx, int32_t id) {
    answer *a = ctx;
    chat_spin_stop(&a->spin);
    if (a->stopped) return; /* ids after the stop id (the engine is stopping) */
    k3_tok_ids_push(&a->gen, id);
    k3_chat_delta d;
    k3_chat_filter_push(a->filter, id, &d);
    take_delta(a, &d);
    if (d.done) {
        a->stopped = 1;
        a->cancel_own = 1;
        atomic_store(&g_cancel, 1); /* <|end_of_msg|> need not be a config eos id */
    }
}

static void on_progress(void *ctx, int done, int n) {
    answer *a = ctx;
    chat_spin_progress(a->spin, done, n);
}

/* "[prompt 45 tokens (30 reused, 15 prefilled), 32 generated, prefill 120 tok/s,
 * decode 45.2 tok/s, experts 87.0% hit, 0.12 GB read]" */
static void stats_line(chat *c, const k3_engine_result *r, int cancelled) {
    const k3_gen_result *g = &r->gen;
    FILE *f = c->info;
    char pre[64] = "n/a", dec[64] = "n/a", hit[64] = "n/a";
    if (g->prefill_ms > 0 && g->n_prefilled > 0)
        snprintf(pre, sizeof pre, "%.1f tok/s", g->n_prefilled * 1000.0 / g->prefill_ms);
    if (g->decode_ms > 0 && g->n_decode_steps > 0) {
        double tps = g->n_decode_steps * 1000.0 / g->decode_ms;
        if (tps >= 1.0)
            snprintf(dec, sizeof dec, "%.1f tok/s", tps);
        else
            snprintf(dec, sizeof dec, "%.2f s/token", 1.0 / tps);
    }
    uint64_t look = g->stats.expert_hits + g->stats.expert_misses;
    if (look) snprintf(hit, sizeof hit, "%.1f%%", 100.0 * (double)g->stats.expert_hits / look);
    if (c->color && f == stdout) fputs(DIM, f);
    fprintf(f,
            "[prompt %d tokens (%d reused, %d prefilled), %d generated%s, prefill %s, decode %s, "
            "experts %s hit, %.2f GB read]",
            g->n_prompt, g->n_reused, g->n_prefilled, g->n_gen, cancelled ? " (stopped)" : "", pre,
            dec, hit, (double)g->stats.bytes_read / 1e9);
    if (c->color && f == stdout) fputs(RESET, f);
    fputs("\n", f);
    fflush(f);
}

/* ---- one answer ---------------------------------------------------------- */

/* Generates the answer to the conversation as it stands. Returns 0 when
 * an answer (maybe empty, maybe stopped) was added, -1 when none was. */
static int run_answer(chat *c) {
    char err[1024] = "";
    k3_tok_ids prompt = {0};
    k3_chat_channel start = K3_CHAT_CH_RESPONSE;
    k3_status st = chat_conv_prompt(&c->conv, c->tok, c->think, &prompt, &start, err, sizeof err);
    if (!st && prompt.n >= (size_t)c->o->ctx)
        st = k3_errf(K3_ERR_LIMIT, err, sizeof err,
                     "the conversation has %zu tokens and the context %d: no room for an answer "
                     "(:reset, or a larger --ctx)",
                     prompt.n, c->o->ctx);
    answer a = {.c = c, .shown = -1};
    if (!st) st = k3_chat_prompt_filter(c->tok, c->cfg, start, &a.filter, err, sizeof err);
    if (st) {
        fprintf(stderr, "error: %s\n", err);
        k3_tok_ids_free(&prompt);
        return -1;
    }
    k3_strbuf_add(&a.content, "", 0);
    k3_strbuf_add(&a.reasoning, "", 0);
    int room = c->o->ctx - (int)prompt.n;
    k3_engine_req req = {.session_id = 1,
                         .prompt = prompt.v,
                         .n_prompt = (int)prompt.n,
                         .ngen = c->ngen < room ? c->ngen : room,
                         .max_ctx = c->o->ctx,
                         .sampling = c->samp,
                         .prompt_hooks = {.progress = on_progress, .progress_ctx = &a},
                         .on_token = on_token,
                         .token_ctx = &a,
                         .cancel = &g_cancel};
    atomic_store(&g_cancel, 0);
    if (c->interactive) a.spin = chat_spin_start("prefill");
    k3_engine_result res;
    memset(&res, 0, sizeof res);
    st = k3_engine_generate(c->eng, &req, &res, err, sizeof err);
    chat_spin_stop(&a.spin);
    int cancelled = st == K3_ERR_CANCEL && !a.cancel_own;
    if (st == K3_ERR_CANCEL) st = K3_OK;
    if (!a.stopped) {
        k3_chat_delta d;
        k3_chat_filter_finish(a.filter, &d);
        take_delta(&a, &d);
    }
    if (a.shown == K3_CHAT_CH_THINK && c->color) fputs(RESET, c->interactive ? stdout : stderr);
    if (a.shown >= 0 || !c->interactive) fputs("\n", stdout);
    if (a.think_shown && !c->interactive) fputs("\n", stderr);
    fflush(stdout);
    int rc = 0;
    if (st) fprintf(stderr, "error: %s\n", err);
    if (a.gen.n == 0 && (st || cancelled)) {
        if (cancelled) fprintf(c->info, "(stopped before the first token)\n");
        rc = -1;
    } else {
        chat_conv_answered(&c->conv, &prompt, start, a.gen.v, (int)a.gen.n, a.stopped,
                           k3_chat_filter_channel(a.filter), a.content.p, a.reasoning.p);
        stats_line(c, &res, cancelled);
        c->last = res;
        c->has_last = 1;
    }
    atomic_store(&g_cancel, 0);
    k3_chat_filter_close(&a.filter);
    k3_tok_ids_free(&a.gen);
    k3_tok_ids_free(&prompt);
    free(a.content.p);
    free(a.reasoning.p);
    return rc;
}

/* ---- commands ---------------------------------------------------------- */

/* The word after the command and the rest: "set temp 0.5" -> arg "temp 0.5". */
static const char *skip_ws(const char *s) {
    while (*s == ' ' || *s == '\t') s++;
    return s;
}

static int word_is(const char *s, const char *w, const char **rest) {
    size_t n = strlen(w);
    if (strncmp(s, w, n) || (s[n] && s[n] != ' ' && s[n] != '\t')) return 0;
    *rest = skip_ws(s + n);
    return 1;
}

static void cmd_set(chat *c, const char *arg) {
    char key[32] = "", val[64] = "";
    if (sscanf(arg, "%31s %63s", key, val) != 2) {
        fprintf(c->info, "usage: :set temp|top_p|seed|ngen VALUE\n");
        return;
    }
    char *end = NULL;
    double v = strtod(val, &end);
    if (!end || *end) {
        fprintf(c->info, ":set %s: '%s' is not a number\n", key, val);
        return;
    }
    char err[256];
    if (!strcmp(key, "temp")) {
        k3_sampler_opts s = c->samp;
        s.temp = v;
        if (k3_sampler_check_opts(&s, err, sizeof err)) {
            fprintf(c->info, ":set temp: %s\n", err);
            return;
        }
        c->samp = s;
    } else if (!strcmp(key, "top_p") || !strcmp(key, "top-p")) {
        k3_sampler_opts s = c->samp;
        s.top_p = v;
        if (k3_sampler_check_opts(&s, err, sizeof err)) {
            fprintf(c->info, ":set top_p: %s\n", err);
            return;
        }
        c->samp = s;
    } else if (!strcmp(key, "seed")) {
        if (v < 0 || v > (double)INT_MAX || v != (double)(long long)v) {
            fprintf(c->info, ":set seed: %s is not an integer in 0..%d\n", val, INT_MAX);
            return;
        }
        c->samp.seed = (uint64_t)v;
    } else if (!strcmp(key, "ngen")) {
        if (v < 1 || v > K3_MAX_NGEN || v != (double)(long long)v) {
            fprintf(c->info, ":set ngen: %s is not an integer in 1..%d (K3_MAX_NGEN)\n", val,
                    K3_MAX_NGEN);
            return;
        }
        c->ngen = (int)v;
    } else {
        fprintf(c->info, ":set: unknown setting '%s' (temp, top_p, seed, ngen)\n", key);
        return;
    }
    fprintf(c->info, "temp %g, top_p %g, seed %llu, ngen %d\n", c->samp.temp, c->samp.top_p,
            (unsigned long long)c->samp.seed, c->ngen);
}

static void cmd_stats(chat *c) {
    k3_tok_ids p = {0};
    k3_chat_channel ch;
    char err[256];
    int n_conv = 0;
    if (!chat_conv_prompt(&c->conv, c->tok, c->think, &p, &ch, err, sizeof err)) n_conv = (int)p.n;
    k3_tok_ids_free(&p);
    fprintf(c->info, "conversation: %d messages, %zu tokens held by the session, context %d\n",
            c->conv.n, c->conv.has_ids ? c->conv.ids.n : (size_t)0, c->o->ctx);
    (void)n_conv;
    fprintf(c->info, "settings: think %s%s, temp %g, top_p %g, seed %llu, ngen %d\n",
            c->think ? "on" : "off", c->show_think ? "" : " (hidden)", c->samp.temp, c->samp.top_p,
            (unsigned long long)c->samp.seed, c->ngen);
    if (!c->has_last) {
        fprintf(c->info, "(no answer yet: the engine statistics follow the first answer)\n");
        return;
    }
    fflush(c->info);
    k3_engine_print_stats(c->eng, &c->last, c->info);
    fflush(c->info);
}

typedef enum cmd_rc { CMD_NONE = 0, CMD_DONE, CMD_QUIT, CMD_ANSWER } cmd_rc;

/* Runs line as a command when it starts with ':' or '/' and names one. */
static cmd_rc command(chat *c, const char *line) {
    if (line[0] != ':' && line[0] != '/') return CMD_NONE;
    const char *s = line + 1, *arg = NULL;
    char err[1024] = "";
    if (word_is(s, "q", &arg) || word_is(s, "quit", &arg) || word_is(s, "exit", &arg))
        return CMD_QUIT;
    if (word_is(s, "help", &arg) || word_is(s, "h", &arg) || word_is(s, "?", &arg)) {
        fputs(help_text, c->info);
    } else if (word_is(s, "reset", &arg) || word_is(s, "new", &arg)) {
        chat_conv_reset(&c->conv, 1);
        fprintf(c->info, "(new conversation)\n");
    } else if (word_is(s, "system", &arg)) {
        if (!*arg) {
            int has = c->conv.n > 0 && !strcmp(c->conv.m[0].role, "system");
            fprintf(c->info, "system: %s\n", has ? c->conv.m[0].content : "(none)");
        } else {
            chat_conv_set_system(&c->conv, strcmp(arg, "-") ? arg : NULL);
            fprintf(c->info, "(system prompt %s)\n", strcmp(arg, "-") ? "set" : "removed");
        }
    } else if (word_is(s, "think", &arg)) {
        if (!strcmp(arg, "on") || !strcmp(arg, "off")) {
            int on = !strcmp(arg, "on");
            if (on != c->think) chat_conv_drop_ids(&c->conv); /* the history renders anew */
            c->think = on;
            fprintf(c->info, "(thinking %s)\n", arg);
        } else if (!strcmp(arg, "hide") || !strcmp(arg, "show")) {
            c->show_think = !strcmp(arg, "show");
            fprintf(c->info, "(reasoning %s)\n", c->show_think ? "shown" : "hidden");
        } else {
            fprintf(c->info, "usage: :think on|off|hide|show (now %s, %s)\n",
                    c->think ? "on" : "off", c->show_think ? "shown" : "hidden");
        }
    } else if (word_is(s, "set", &arg)) {
        cmd_set(c, arg);
    } else if (word_is(s, "stats", &arg)) {
        cmd_stats(c);
    } else if (word_is(s, "save", &arg)) {
        if (!*arg)
            fprintf(c->info, "usage: :save FILE\n");
        else if (chat_conv_save(&c->conv, c->think, arg, err, sizeof err))
            fprintf(c->info, "error: %s\n", err);
        else
            fprintf(c->info, "(saved %d messages to %s)\n", c->conv.n, arg);
    } else if (word_is(s, "load", &arg)) {
        if (!*arg)
            fprintf(c->info, "usage: :load FILE\n");
        else if (chat_conv_load(&c->conv, arg, k3_tok_n_vocab(c->tok), &c->think, err, sizeof err))
            fprintf(c->info, "error: %s\n", err);
        else
            fprintf(c->info, "(loaded %d messages from %s; thinking %s)\n", c->conv.n, arg,
                    c->think ? "on" : "off");
    } else if (word_is(s, "retry", &arg)) {
        if (chat_conv_retry(&c->conv, err, sizeof err)) {
            fprintf(c->info, "error: %s\n", err);
            return CMD_DONE;
        }
        c->samp.seed++; /* the same seed would give the same answer again */
        fprintf(c->info, "(retry with seed %llu)\n", (unsigned long long)c->samp.seed);
        return CMD_ANSWER;
    } else {
        fprintf(c->info,
                "unknown command '%.40s' (:help lists them; wrap text in \"\"\" to send it "
                "as a message)\n",
                line);
    }
    return CMD_DONE;
}

/* A message or a command. Returns 1 to quit. */
static int handle(chat *c, const char *line) {
    cmd_rc r = command(c, line);
    if (r == CMD_QUIT) return 1;
    if (r == CMD_ANSWER) {
        run_answer(c);
        return 0;
    }
    if (r == CMD_DONE) return 0;
    chat_conv_add(&c->conv, "user", line, NULL);
    if (run_answer(c) < 0) { /* no answer: the message goes too */
        chat_msg *m = &c->conv.m[--c->conv.n];
        free(m->role);
        free(m->content);
        free(m->reasoning);
    }
    return 0;
}

/* ---- main ---------------------------------------------------------------- */

static int parse_cli(int argc, char **argv, chat_opts *o, k3_opt_src *src) {
    char err[1024] = "";
    char **pos = k3_xcalloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0;
    memset(o, 0, sizeof *o);
    k3_status st =
        k3_opts_parse(chat_table, N_CHAT_OPTS, o, src, argc, argv, pos, &n_pos, err, sizeof err);
    int rc = -1;
    if (!st && o->help) {
        k3_opts_help(stdout, chat_usage, chat_table, N_CHAT_OPTS);
        rc = 0;
    } else {
        if (!st && !o->eng.model)
            st =
                k3_errf(K3_ERR_ARG, err, sizeof err, "--model: missing (the checkpoint directory)");
        if (!st && n_pos > 0)
            st = k3_errf(K3_ERR_ARG, err, sizeof err, "unexpected argument '%s'", pos[0]);
        k3_sampler_opts so = {.temp = o->temp, .top_p = o->top_p, .seed = (uint64_t)o->seed};
        if (!st) st = k3_sampler_check_opts(&so, err, sizeof err);
        if (!st)
            st = k3_engine_opts_resolve(&o->eng, chat_table, N_CHAT_OPTS, src, err, sizeof err);
        if (st) {
            fprintf(stderr, "k3-coordinator chat: %s\n", err);
            rc = 2;
        }
    }
    free(pos);
    return rc;
}

static void engine_settings(const chat_opts *o, const k3_opt_src *src, k3_engine_open_opts *eo) {
    k3_engine_open_opts_from_cli(eo, &o->eng, &o->cl, chat_table, N_CHAT_OPTS, src);
    eo->chunk = o->chunk;
    eo->progress = 0; /* the spinner shows the prefill */
    eo->n_sessions = 1;
}

/* The tokenizer is checked before the model loads (minutes on K3). */
static int has_tokenizer(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/tiktoken.model", dir);
    return access(p, R_OK) == 0;
}

static void loop_interactive(chat *c) {
    const char *model = c->o->eng.model;
    printf("%sk3shard chat · %s · thinking %s%s\n", c->color ? DIM : "", model,
           c->think ? "on" : "off", c->color ? RESET : "");
    printf("type and press Enter · Ctrl-C stops the answer · :help lists the commands · :q "
           "exits\n");
    fflush(stdout);
    for (;;) {
        char *msg = NULL;
        chat_read r = chat_term_read(c->term, &msg);
        if (r == CHAT_READ_EOF) break;
        if (r == CHAT_READ_INTR) {
            printf("(Ctrl-C stops an answer; Ctrl-D or :q exits, :help lists the commands)\n");
            fflush(stdout);
            continue;
        }
        const char *m = skip_ws(msg);
        int quit = *m ? handle(c, m) : 0;
        free(msg);
        if (quit) break;
    }
}

static void loop_piped(chat *c) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
        const char *m = skip_ws(line);
        if (!*m) continue;
        if (handle(c, m)) break;
    }
    free(line);
}

int cmd_chat(int argc, char **argv) {
    k3_log_init("k3-coordinator chat");
    setlocale(LC_CTYPE, ""); /* libedit reads UTF-8 only under a UTF-8 locale */
    chat_opts o;
    k3_opt_src src[N_CHAT_OPTS];
    char err[1024] = "";
    chat c;
    memset(&c, 0, sizeof c);
    int rc = parse_cli(argc, argv, &o, src);
    if (rc >= 0) goto out;
    rc = 1;
    if (!has_tokenizer(o.eng.model)) {
        fprintf(stderr,
                "k3-coordinator chat: %s has no tokenizer (tiktoken.model): the chat prompt "
                "needs text; for token ids use k3-coordinator --model %s --ids ...\n",
                o.eng.model, o.eng.model);
        goto out;
    }
    k3_engine_open_opts eo;
    engine_settings(&o, src, &eo);
    if (k3_engine_open(&c.eng, &eo, err, sizeof err)) {
        fprintf(stderr, "k3-coordinator chat: error: %s\n", err);
        goto out;
    }
    c.o = &o;
    c.tok = k3_engine_tok(c.eng);
    c.cfg = k3_engine_config(c.eng);
    if (!c.tok) {
        fprintf(stderr, "k3-coordinator chat: %s has no usable tokenizer\n", o.eng.model);
        goto out_engine;
    }
    c.interactive = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
    const char *term = getenv("TERM"), *nc = getenv("NO_COLOR");
    c.color = c.interactive && o.color && !(nc && *nc) && !(term && !strcmp(term, "dumb"));
    c.info = c.interactive ? stdout : stderr;
    /* the engine's info line per request would break into the conversation */
    if (c.interactive &&
        src[k3_opts_find(chat_table, N_CHAT_OPTS, "log_level")] == K3_OPT_SRC_DEFAULT)
        k3_log_set_level(K3_LOG_WARN);
    c.think = o.think;
    c.show_think = 1;
    c.ngen = o.ngen;
    c.samp = (k3_sampler_opts){.temp = o.temp, .top_p = o.top_p, .seed = (uint64_t)o.seed};
    if (o.system && *o.system) chat_conv_set_system(&c.conv, o.system);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sa.sa_flags = SA_RESTART;
    if (c.interactive) {
        char *hist = o.no_history ? NULL
                     : o.history  ? k3_xstrdup(o.history)
                                  : chat_term_history_path();
        k3_status st = chat_term_open(&c.term, hist, err, sizeof err);
        free(hist);
        if (st) {
            fprintf(stderr, "k3-coordinator chat: %s\n", err);
            goto out_engine;
        }
        sigaction(SIGINT, &sa, NULL); /* ^C is a key while editing, a signal while answering */
        loop_interactive(&c);
        chat_term_close(&c.term);
    } else {
        loop_piped(&c);
    }
    rc = 0;
out_engine:
    chat_conv_free(&c.conv);
    k3_engine_close(&c.eng);
out:
    k3_opts_free(chat_table, N_CHAT_OPTS, &o);
    return rc;
}
