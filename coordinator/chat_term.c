/* coordinator/chat_term.c: libedit line editing and the prefill spinner of
 * `k3-coordinator chat` (chat_term.h, docs/CHAT.md).
 *
 * Ctrl-C: libedit's edit mode normally keeps ISIG, so ^C would be a
 * SIGINT that interrupts read() inside el_gets in ways libedit retries.
 * We clear ISIG for the edit mode only (EL_SETTY -d -isig) and bind ^C to
 * a function that flags the interrupt and ends the line; while an answer
 * streams the terminal is back in its own mode and ^C is a signal again
 * (cmd_chat's handler cancels the generation).
 *
 * Bracketed paste: "\e[?2004h" is written before each line and "\e[?2004l"
 * after it; the terminal then wraps pasted text in "\e[200~" ... "\e[201~".
 * The start sequence is bound to a function that reads up to the end
 * sequence: a one-line paste is inserted into the line, a paste with
 * newlines is kept whole (newlines included) as part of the message.
 */
#include "coordinator/chat_term.h"

#include <errno.h>
#include <histedit.h>
#include <langinfo.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>

#include "common/base/log.h"
#include "common/base/strbuf.h"

/* A paste larger than this is cut (the rest is read and dropped): a chat
 * message of 16 MiB is far past any context the engine takes. */
#define CHAT_MAX_PASTE (16u << 20)

struct chat_term {
    EditLine *el;
    History *hist;
    char *hist_path;    /* owned, NULL = no file */
    const char *prompt; /* "> " or "... " */
    int intr;           /* ^C was pressed during el_gets */
    k3_strbuf paste;    /* a multi-line paste waiting to join the message */
    int pasted;         /* paste holds one */
};

static const char *prompt_fn(EditLine *el) {
    chat_term *t = NULL;
    el_get(el, EL_CLIENTDATA, &t);
    return t ? t->prompt : "> ";
}

static unsigned char on_intr(EditLine *el, int ch) {
    (void)ch;
    chat_term *t = NULL;
    el_get(el, EL_CLIENTDATA, &t);
    const LineInfo *li = el_line(el);
    if (t) t->intr = li && li->lastchar > li->buffer ? 2 : 1; /* 2: text was dropped */
    return CC_NEWLINE;
}

/* Reads the pasted text up to "\e[201~". */
static unsigned char on_paste(EditLine *el, int ch) {
    (void)ch;
    chat_term *t = NULL;
    el_get(el, EL_CLIENTDATA, &t);
    static const char end[] = "\x1b[201~";
    const size_t n_end = sizeof end - 1;
    k3_strbuf b = {0};
    k3_strbuf_add(&b, "", 0);
    mbstate_t ps;
    memset(&ps, 0, sizeof ps);
    for (;;) {
        wchar_t c;
        if (el_wgetc(el, &c) != 1) break;
        char mb[MB_LEN_MAX];
        size_t k = wcrtomb(mb, c == L'\r' ? L'\n' : c, &ps);
        if (k == (size_t)-1) continue;
        if (b.n + k <= CHAT_MAX_PASTE + n_end) k3_strbuf_add(&b, mb, k);
        if (b.n >= n_end && !memcmp(b.p + b.n - n_end, end, n_end)) {
            b.n -= n_end;
            break;
        }
    }
    b.p[b.n] = 0;
    unsigned char rc = CC_REFRESH;
    if (!memchr(b.p, '\n', b.n)) {
        el_insertstr(el, b.p);
    } else if (t) {
        k3_strbuf_add(&t->paste, b.p, b.n);
        t->pasted = 1;
        rc = CC_NEWLINE;
    }
    free(b.p);
    return rc;
}

char *chat_term_history_path(void) {
    const char *x = getenv("XDG_DATA_HOME"), *h = getenv("HOME");
    char buf[4096];
    if (x && *x)
        snprintf(buf, sizeof buf, "%s/k3shard/history", x);
    else if (h && *h)
        snprintf(buf, sizeof buf, "%s/.local/share/k3shard/history", h);
    else
        return NULL;
    return k3_xstrdup(buf);
}

/* mkdir -p of path's directory. */
static void make_parent(const char *path) {
    char *d = k3_xstrdup(path);
    char *slash = strrchr(d, '/');
    if (slash) {
        *slash = 0;
        for (char *p = d + 1; *p; p++)
            if (*p == '/') {
                *p = 0;
                mkdir(d, 0700);
                *p = '/';
            }
        mkdir(d, 0700);
    }
    free(d);
}

k3_status chat_term_open(chat_term **out, const char *hist_path, char *err, size_t errlen) {
    *out = NULL;
    chat_term *t = k3_xcalloc(1, sizeof *t);
    t->prompt = "> ";
    t->el = el_init("k3-coordinator", stdin, stdout, stderr);
    if (!t->el) {
        free(t);
        return k3_errf(K3_ERR_IO, err, errlen, "cannot start the line editor (libedit el_init)");
    }
    el_set(t->el, EL_CLIENTDATA, t);
    el_set(t->el, EL_EDITOR, "emacs");
    el_set(t->el, EL_PROMPT, prompt_fn);
    el_set(t->el, EL_ADDFN, "k3-intr", "drop the line (Ctrl-C)", on_intr);
    el_set(t->el, EL_BIND, "^C", "k3-intr", NULL);
    el_set(t->el, EL_ADDFN, "k3-paste", "bracketed paste", on_paste);
    el_set(t->el, EL_BIND, "\\e[200~", "k3-paste", NULL);
    el_set(t->el, EL_SETTY, "-d", "-isig", NULL);
    t->hist = history_init();
    HistEvent ev;
    history(t->hist, &ev, H_SETSIZE, 1000);
    history(t->hist, &ev, H_SETUNIQUE, 1);
    el_set(t->el, EL_HIST, history, t->hist);
    if (hist_path) {
        t->hist_path = k3_xstrdup(hist_path);
        make_parent(hist_path);
        if (access(hist_path, F_OK) == 0 && history(t->hist, &ev, H_LOAD, hist_path) < 0)
            K3_WARN("chat: cannot read the history file %s", hist_path);
    }
    *out = t;
    return K3_OK;
}

/* Writes the history to a temporary file renamed over the real one, so a
 * hang-up in the middle never leaves it truncated. Returns 0 on failure. */
static int hist_save(chat_term *t) {
    if (!t->hist_path) return 1;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", t->hist_path, (int)getpid());
    HistEvent ev;
    if (history(t->hist, &ev, H_SAVE, tmp) < 0 || rename(tmp, t->hist_path)) {
        unlink(tmp);
        return 0;
    }
    return 1;
}

void chat_term_close(chat_term **tp) {
    chat_term *t = *tp;
    if (!t) return;
    *tp = NULL;
    if (!hist_save(t)) K3_WARN("chat: cannot write the history file %s", t->hist_path);
    el_end(t->el);
    history_end(t->hist);
    free(t->hist_path);
    free(t->paste.p);
    free(t);
}

/* The line without trailing blanks / newline: [s, s + *n). */
static void rstrip(const char *s, size_t *n) {
    while (*n > 0 &&
           (s[*n - 1] == '\n' || s[*n - 1] == '\r' || s[*n - 1] == ' ' || s[*n - 1] == '\t'))
        (*n)--;
}

static int ends_with(const char *s, size_t n, const char *suf) {
    size_t k = strlen(suf);
    return n >= k && !memcmp(s + n - k, suf, k);
}

chat_read chat_term_read(chat_term *t, char **msg) {
    *msg = NULL;
    k3_strbuf m = {0};
    k3_strbuf_add(&m, "", 0);
    int block = 0; /* inside """ ... """ */
    int open = 0;  /* the message continues on the next line */
    chat_read rc = CHAT_READ_MSG;
    t->prompt = "> ";
    for (;;) {
        t->intr = 0;
        t->pasted = 0;
        t->paste.n = 0;
        fputs("\x1b[?2004h", stdout);
        fflush(stdout);
        int n = 0;
        const char *l = el_gets(t->el, &n);
        fputs("\x1b[?2004l", stdout);
        fflush(stdout);
        if (t->intr) {
            fputs("\n", stdout);
            if (t->intr == 1 && !open && !block) {
                rc = CHAT_READ_INTR;
                break;
            }
            m.n = 0; /* like a shell: the text typed so far is dropped */
            m.p[0] = 0;
            open = block = 0;
            t->prompt = "> ";
            continue;
        }
        if (t->pasted) { /* the typed part, the paste, and the message stays open */
            if (l && n > 0) k3_strbuf_add(&m, l, (size_t)n);
            k3_strbuf_add(&m, t->paste.p, t->paste.n);
            fwrite(t->paste.p, 1, t->paste.n, stdout);
            fputs("\n", stdout);
            open = 1;
            t->prompt = "... ";
            continue;
        }
        if (!l || n < 0) {
            if (open || block) { /* Ctrl-D inside a message sends what there is */
                fputs("\n", stdout);
                break;
            }
            rc = CHAT_READ_EOF;
            break;
        }
        size_t len = (size_t)n;
        rstrip(l, &len);
        if (block) {
            if (ends_with(l, len, "\"\"\"")) {
                if (m.n) k3_strbuf_add(&m, "\n", 1);
                k3_strbuf_add(&m, l, len - 3);
                break;
            }
            if (m.n || block > 1) k3_strbuf_add(&m, "\n", 1);
            k3_strbuf_add(&m, l, len);
            block = 2; /* later lines always join with a newline */
            continue;
        }
        if (!open && m.n == 0 && len >= 3 && !memcmp(l, "\"\"\"", 3)) {
            if (len >= 6 && ends_with(l, len, "\"\"\"")) { /* """one line""" */
                k3_strbuf_add(&m, l + 3, len - 6);
                break;
            }
            k3_strbuf_add(&m, l + 3, len - 3);
            block = m.n ? 2 : 1;
            t->prompt = "... ";
            continue;
        }
        if (open && len > 0 && m.n && m.p[m.n - 1] != '\n') k3_strbuf_add(&m, "\n", 1);
        if (ends_with(l, len, "\\")) {
            k3_strbuf_add(&m, l, len - 1);
            open = 1;
            t->prompt = "... ";
            continue;
        }
        k3_strbuf_add(&m, l, len);
        break;
    }
    t->prompt = "> ";
    if (rc != CHAT_READ_MSG) {
        free(m.p);
        return rc;
    }
    while (m.n && (m.p[m.n - 1] == '\n' || m.p[m.n - 1] == '\r')) m.p[--m.n] = 0;
    if (m.n) {
        HistEvent ev;
        history(t->hist, &ev, H_ENTER, m.p);
        hist_save(t);
    }
    *msg = m.p;
    return CHAT_READ_MSG;
}

/* ---- spinner --------------------------------------------------------------- */

struct chat_spin {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop; /* (mu) */
    atomic_int done, n;
    char label[64];
    struct timespec t0;
    int utf8;
};

static double since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + (double)(t.tv_nsec - t0->tv_nsec) / 1e9;
}

static void *spin_thread(void *arg) {
    chat_spin *s = arg;
    static const char *const braille[] = {"⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"};
    static const char *const ascii[] = {"|", "/", "-", "\\"};
    pthread_mutex_lock(&s->mu);
    for (int frame = 0; !s->stop; frame++) {
        double el = since(&s->t0);
        int done = atomic_load(&s->done), n = atomic_load(&s->n);
        const char *f = s->utf8 ? braille[frame % 10] : ascii[frame % 4];
        if (el >= 1.0 && n > 0)
            printf("\r%s %s %.0fs %d%% (%d/%d tokens)\x1b[K", f, s->label, el,
                   (int)(100.0 * done / n), done, n);
        else
            printf("\r%s %s %.0fs\x1b[K", f, s->label, el);
        fflush(stdout);
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += 100000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        while (!s->stop && pthread_cond_timedwait(&s->cv, &s->mu, &dl) == 0) {
        }
    }
    pthread_mutex_unlock(&s->mu);
    fputs("\r\x1b[K", stdout);
    fflush(stdout);
    return NULL;
}

chat_spin *chat_spin_start(const char *label) {
    chat_spin *s = k3_xcalloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    snprintf(s->label, sizeof s->label, "%s", label);
    clock_gettime(CLOCK_MONOTONIC, &s->t0);
    const char *cs = nl_langinfo(CODESET);
    s->utf8 = cs && (!strcmp(cs, "UTF-8") || !strcmp(cs, "utf8"));
    if (pthread_create(&s->th, NULL, spin_thread, s)) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL; /* no spinner: the answer still comes */
    }
    return s;
}

void chat_spin_progress(chat_spin *s, int done, int n) {
    if (!s) return;
    atomic_store(&s->done, done);
    atomic_store(&s->n, n);
}

void chat_spin_stop(chat_spin **sp) {
    chat_spin *s = *sp;
    if (!s) return;
    *sp = NULL;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
