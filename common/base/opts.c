/* common/base/opts.c: the option table engine (see opts.h).
 *
 * Every value, whatever its source, goes through opt_parse_value(), so a
 * default, an environment variable and a flag are validated by the same code
 * and produce messages in the same shape. The source label in a message is
 * the flag ("--chunk") for a command-line value, the variable ("K3_CHUNK")
 * for an environment value and "default of <name>" for a table bug.
 */
#include "common/base/opts.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/base/limits.h"

/* ---- helpers ---------------------------------------------------------- */

/* Address of the option's field inside the caller's struct. The table's
 * offsetof() values are trusted: tables are static code, not input. */
static void *opt_field(const k3_opt *o, void *target) { return (char *)target + o->offset; }

/* The label a message starts with, for this option and source. */
static void opt_label(const k3_opt *o, k3_opt_src src, char *buf, size_t n) {
    if (src == K3_OPT_SRC_FLAG && o->flag)
        snprintf(buf, n, "%s", o->flag);
    else if (src == K3_OPT_SRC_FLAG && o->short_flag)
        snprintf(buf, n, "-%c", o->short_flag);
    else if (src == K3_OPT_SRC_ENV && o->env)
        snprintf(buf, n, "%s", o->env);
    else
        snprintf(buf, n, "default of %s", o->name);
}

/* min = max = 0 means "any value" (strings, free integers). */
static int opt_has_range(const k3_opt *o) { return !(o->min == 0 && o->max == 0); }

/* "4, 8, 32", or for an ENUM "debug, info, warn, error" */
static void opt_choices_text(const k3_opt *o, char *buf, size_t n) {
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < o->n_choices && used < n; i++) {
        if (o->type == K3_OPT_ENUM)
            used += (size_t)snprintf(buf + used, n - used, "%s%s", i ? ", " : "", o->names[i]);
        else
            used += (size_t)snprintf(buf + used, n - used, "%s%d", i ? ", " : "", o->choices[i]);
    }
}

/* Frees every item; the list is empty (and reusable) afterwards. */
static void opt_list_clear(k3_opt_list *l) {
    for (int i = 0; i < l->n; i++) free(l->items[i]);
    free(l->items);
    l->items = NULL;
    l->n = 0;
}

/* Splits "a,b,c" into l (replacing its contents). Empty items are an error:
 * "a,,b" is almost certainly a typo, and an empty path would mean the cwd. */
static k3_status opt_list_parse(const k3_opt *o, const char *label, const char *text,
                                k3_opt_list *l, char *err, size_t errlen) {
    /* count first so the limit is checked before anything is allocated */
    int n = 1;
    for (const char *p = text; *p; p++) n += *p == ',';
    int max = opt_has_range(o) ? (int)o->max : INT_MAX;
    if (n > max)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %d items > limit %d", label, n, max);
    char **items = k3_xcalloc((size_t)n, sizeof *items);
    const char *s = text;
    for (int i = 0; i < n; i++) {
        const char *e = strchr(s, ',');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        if (len == 0) {
            for (int j = 0; j < i; j++) free(items[j]);
            free(items);
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: item %d of '%s' is empty", label, i + 1,
                           text);
        }
        items[i] = k3_xmalloc(len + 1);
        memcpy(items[i], s, len);
        items[i][len] = 0;
        s = e ? e + 1 : s + len;
    }
    opt_list_clear(l);
    l->items = items;
    l->n = n;
    return K3_OK;
}

/* The spellings people use in shells and config files; anything else is an
 * error rather than a guess ("2" or "y" are refused). Returns 1 if parsed. */
static int opt_parse_bool(const char *t, int *out) {
    static const char *yes[] = {"1", "true", "yes", "on"};
    static const char *no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(t, yes[i])) {
            *out = 1;
            return 1;
        }
        if (!strcasecmp(t, no[i])) {
            *out = 0;
            return 1;
        }
    }
    return 0;
}

/* Parses text into the option's field, with every check of its row. */
static k3_status opt_parse_value(const k3_opt *o, void *target, const char *text, k3_opt_src src,
                                 char *err, size_t errlen) {
    char label[128];
    opt_label(o, src, label, sizeof label);
    void *field = opt_field(o, target);

    switch (o->type) {
    case K3_OPT_INT: {
        /* strtoll + full-string check: "12x", "" and " 12" are refused, and
         * an out-of-range value is reported with the option's own range */
        char *end = NULL;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (end == text || *end != 0)
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: '%s' is not an integer", label, text);
        if (errno == ERANGE || v < INT_MIN || v > INT_MAX) {
            if (opt_has_range(o))
                return k3_errf(K3_ERR_ARG, err, errlen, "%s: %s is outside %.0f..%.0f", label, text,
                               o->min, o->max);
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: %s is outside %d..%d", label, text,
                           INT_MIN, INT_MAX);
        }
        /* a choice list replaces the range: K3_BITS is 4, 8 or 32, not 4..32 */
        if (o->n_choices > 0) {
            int found = 0;
            for (int i = 0; i < o->n_choices; i++) found |= o->choices[i] == v;
            if (!found) {
                char c[128];
                opt_choices_text(o, c, sizeof c);
                return k3_errf(K3_ERR_ARG, err, errlen, "%s=%s: must be one of %s", label, text, c);
            }
        } else if (opt_has_range(o) && ((double)v < o->min || (double)v > o->max)) {
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: %lld is outside %.0f..%.0f", label, v,
                           o->min, o->max);
        }
        *(int *)field = (int)v;
        return K3_OK;
    }
    case K3_OPT_DOUBLE: {
        /* nan and inf parse with strtod but are never a sensible setting */
        char *end = NULL;
        errno = 0;
        double v = strtod(text, &end);
        if (end == text || *end != 0 || !isfinite(v))
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: '%s' is not a finite number", label, text);
        if (opt_has_range(o) && (v < o->min || v > o->max || (o->min_open && v == o->min)))
            return k3_errf(K3_ERR_ARG, err, errlen, "%s: %s is outside %g..%g%s", label, text,
                           o->min, o->max, o->min_open ? " (min excluded)" : "");
        *(double *)field = v;
        return K3_OK;
    }
    case K3_OPT_BOOL: {
        int v;
        if (!opt_parse_bool(text, &v))
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "%s: '%s' is not a boolean (1/0, true/false, yes/no, on/off)", label,
                           text);
        *(int *)field = v;
        return K3_OK;
    }
    case K3_OPT_STRING: {
        /* a later source replaces an earlier one: free what it replaces */
        char **p = field;
        free(*p);
        *p = k3_xstrdup(text);
        return K3_OK;
    }
    case K3_OPT_LIST: return opt_list_parse(o, label, text, field, err, errlen);
    case K3_OPT_MULTI: {
        k3_opt_list *l = field;
        int max = opt_has_range(o) ? (int)o->max : INT_MAX;
        if (l->n >= max)
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than %d given", label, max);
        l->items = k3_xrealloc(l->items, (size_t)(l->n + 1) * sizeof *l->items);
        l->items[l->n++] = k3_xstrdup(text);
        return K3_OK;
    }
    case K3_OPT_ENUM: {
        /* exact words only: "Debug" or "2" are refused with the list, so a
         * typo in a shared environment is heard about instead of ignored */
        for (int i = 0; i < o->n_choices; i++)
            if (o->names[i] && !strcmp(text, o->names[i])) {
                *(int *)field = o->choices[i];
                return K3_OK;
            }
        char c[256];
        opt_choices_text(o, c, sizeof c);
        return k3_errf(K3_ERR_ARG, err, errlen, "%s=%s: must be one of %s", label, text, c);
    }
    }
    return k3_errf(K3_ERR_INTERNAL, err, errlen, "option %s: unknown type %d", o->name,
                   (int)o->type);
}

k3_status k3_opts_set(const k3_opt *opt, void *target, const char *text, k3_opt_src src, char *err,
                      size_t errlen) {
    return opt_parse_value(opt, target, text, src, err, errlen);
}

int k3_opts_find(const k3_opt *opts, int n_opts, const char *name) {
    for (int i = 0; i < n_opts; i++)
        if (opts[i].name && !strcmp(opts[i].name, name)) return i;
    return -1;
}

/* Row whose long flag is name (name without "=value"), or -1. Tables have
 * tens of rows, so a linear scan costs nothing next to a model load. */
static int opt_find_flag(const k3_opt *opts, int n_opts, const char *name, size_t len) {
    for (int i = 0; i < n_opts; i++)
        if (opts[i].flag && strlen(opts[i].flag) == len && !strncmp(opts[i].flag, name, len))
            return i;
    return -1;
}

static int opt_find_short(const k3_opt *opts, int n_opts, char c) {
    for (int i = 0; i < n_opts; i++)
        if (opts[i].short_flag && opts[i].short_flag == c) return i;
    return -1;
}

/* ---- parse ------------------------------------------------------------ */

k3_status k3_opts_parse(const k3_opt *opts, int n_opts, void *target, k3_opt_src *src, int argc,
                        char **argv, char **positional, int *n_positional, char *err,
                        size_t errlen) {
    k3_status st;
    *n_positional = 0;

    /* 1. defaults: zero the field, then parse the default text (if any).
     * A default that fails its own check is a bug in the table and is
     * reported as "default of <name>: ..." */
    for (int i = 0; i < n_opts; i++) {
        const k3_opt *o = &opts[i];
        void *field = opt_field(o, target);
        switch (o->type) {
        case K3_OPT_INT:
        case K3_OPT_ENUM:
        case K3_OPT_BOOL: *(int *)field = 0; break;
        case K3_OPT_DOUBLE: *(double *)field = 0; break;
        case K3_OPT_STRING: *(char **)field = NULL; break;
        case K3_OPT_LIST:
        case K3_OPT_MULTI: memset(field, 0, sizeof(k3_opt_list)); break;
        }
        if (src) src[i] = K3_OPT_SRC_DEFAULT;
        if (o->def && (st = opt_parse_value(o, target, o->def, K3_OPT_SRC_DEFAULT, err, errlen)))
            return st;
    }

    /* 2. environment: the primary name, else the alias; empty counts as unset
     * (so `K3_DIRS= cmd` clears a setting). A bad value is an error even if
     * a flag would override it: a broken environment breaks other runs too,
     * and the user should hear about it once, here. */
    for (int i = 0; i < n_opts; i++) {
        const k3_opt *o = &opts[i];
        const char *v = o->env ? getenv(o->env) : NULL;
        k3_opt row = *o;
        if ((!v || !*v) && o->env_alias) {
            v = getenv(o->env_alias);
            row.env = o->env_alias; /* name the variable actually read */
        }
        if (!v || !*v) continue;
        if ((st = opt_parse_value(&row, target, v, K3_OPT_SRC_ENV, err, errlen))) return st;
        if (src) src[i] = K3_OPT_SRC_ENV;
    }

    /* 3. command line, left to right; a later flag replaces an earlier one */
    int only_positional = 0;
    for (int a = 1; a < argc; a++) {
        char *arg = argv[a];
        /* not an option: plain words, "-" (stdin by convention) and negative
         * numbers such as a prompt "-5 degrees" */
        if (only_positional || arg[0] != '-' || arg[1] == 0 || (arg[1] >= '0' && arg[1] <= '9')) {
            positional[(*n_positional)++] = arg; /* "-" and "-5" are values */
            continue;
        }
        if (!strcmp(arg, "--")) {
            only_positional = 1;
            continue;
        }
        int idx;
        const char *inline_val = NULL;
        if (arg[1] == '-') {
            const char *eq = strchr(arg, '=');
            size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
            idx = opt_find_flag(opts, n_opts, arg, len);
            if (idx < 0)
                return k3_errf(K3_ERR_ARG, err, errlen, "unknown option %.*s (see --help)",
                               (int)len, arg);
            if (eq) inline_val = eq + 1;
        } else {
            idx = arg[2] == 0 ? opt_find_short(opts, n_opts, arg[1]) : -1;
            if (idx < 0)
                return k3_errf(K3_ERR_ARG, err, errlen, "unknown option %s (see --help)", arg);
        }
        const k3_opt *o = &opts[idx];
        const char *val = inline_val;
        /* a bool flag alone means on; every other type takes the next
         * argument even if it starts with '-' ("--temp -1" is then refused
         * by the range check with a clear message, not as an unknown flag) */
        if (!val && o->type == K3_OPT_BOOL) {
            val = "1";
        } else if (!val) {
            if (a + 1 >= argc)
                return k3_errf(K3_ERR_ARG, err, errlen, "%s: missing value (%s)", arg,
                               o->metavar ? o->metavar : "VALUE");
            val = argv[++a];
        }
        if ((st = opt_parse_value(o, target, val, K3_OPT_SRC_FLAG, err, errlen))) return st;
        if (src) src[idx] = K3_OPT_SRC_FLAG;
    }
    return K3_OK;
}

/* ---- help ------------------------------------------------------------- */

/* The parenthesised tail of a help line: "(K3_CHUNK, default 32, 1..512)".
 * The variable is named only for rows that also have a flag (an env-only
 * row shows it on the left). A bool shows "on by default" instead of
 * "default 1"; nothing is printed for an off-by-default bool. */
static void opt_help_tail(const k3_opt *o, char *buf, size_t n) {
    size_t used = 0;
#define APPEND(...)                                                                                \
    do {                                                                                           \
        if (used < n) used += (size_t)snprintf(buf + used, n - used, __VA_ARGS__);                 \
    } while (0)
    buf[0] = 0;
    const char *sep = " (";
    if (o->env && o->flag) {
        APPEND("%s%s", sep, o->env);
        sep = ", ";
    }
    if (o->env_alias) {
        APPEND("%salias %s", sep, o->env_alias);
        sep = ", ";
    }
    if (o->def && o->type != K3_OPT_BOOL) {
        APPEND("%sdefault %s", sep, o->def);
        sep = ", ";
    } else if (o->def && o->type == K3_OPT_BOOL && o->def[0] == '1') {
        APPEND("%son by default", sep);
        sep = ", ";
    }
    if ((o->type == K3_OPT_INT || o->type == K3_OPT_ENUM) && o->n_choices > 0) {
        char c[128];
        opt_choices_text(o, c, sizeof c);
        APPEND("%sone of %s", sep, c);
        sep = ", ";
    } else if (o->type == K3_OPT_INT && opt_has_range(o)) {
        APPEND("%s%.0f..%.0f", sep, o->min, o->max);
        sep = ", ";
    } else if (o->type == K3_OPT_DOUBLE && opt_has_range(o)) {
        APPEND("%s%g..%g%s", sep, o->min, o->max, o->min_open ? ", min excluded" : "");
        sep = ", ";
    } else if (o->type == K3_OPT_LIST && opt_has_range(o)) {
        APPEND("%sat most %.0f, comma-separated", sep, o->max);
        sep = ", ";
    } else if (o->type == K3_OPT_MULTI) {
        APPEND("%srepeatable", sep);
        if (opt_has_range(o)) APPEND(", at most %.0f", o->max);
        sep = ", ";
    }
    if (sep[0] == ',') APPEND(")");
#undef APPEND
}

/* Two sections: options with a flag (their variable named in the tail), then
 * the variables that have no flag. Everything printed comes from the table,
 * so --help cannot drift from what the parser accepts. */
void k3_opts_help(FILE *f, const char *usage, const k3_opt *opts, int n_opts) {
    if (usage) fprintf(f, "%s\n", usage);
    char left[96], tail[256];
    int any_env_only = 0;
    fprintf(f, "\noptions:\n");
    for (int i = 0; i < n_opts; i++) {
        const k3_opt *o = &opts[i];
        if (!o->flag && !o->short_flag) {
            any_env_only = 1;
            continue;
        }
        /* a flag that is on by default is turned off with "=0": say so */
        const char *mv = o->type != K3_OPT_BOOL         ? (o->metavar ? o->metavar : "VALUE")
                         : (o->def && o->def[0] == '1') ? "[=0]"
                                                        : "";
        if (o->short_flag && o->flag)
            snprintf(left, sizeof left, "-%c, %s%s%s", o->short_flag, o->flag,
                     *mv && *mv != '[' ? " " : "", mv);
        else if (o->flag)
            snprintf(left, sizeof left, "%s%s%s", o->flag, *mv && *mv != '[' ? " " : "", mv);
        else
            snprintf(left, sizeof left, "-%c%s%s", o->short_flag, *mv ? " " : "", mv);
        opt_help_tail(o, tail, sizeof tail);
        fprintf(f, "  %-24s %s%s\n", left, o->help ? o->help : "", tail);
    }
    if (!any_env_only) return;
    fprintf(f, "\nenvironment only:\n");
    for (int i = 0; i < n_opts; i++) {
        const k3_opt *o = &opts[i];
        if (o->flag || o->short_flag || !o->env) continue;
        snprintf(left, sizeof left, "%s=%s", o->env,
                 o->type == K3_OPT_BOOL ? "0|1" : (o->metavar ? o->metavar : "VALUE"));
        opt_help_tail(o, tail, sizeof tail);
        fprintf(f, "  %-24s %s%s\n", left, o->help ? o->help : "", tail);
    }
}

/* Only strings and lists own memory; numbers are left as they are so a
 * caller may still read them after freeing. */
void k3_opts_free(const k3_opt *opts, int n_opts, void *target) {
    for (int i = 0; i < n_opts; i++) {
        void *field = opt_field(&opts[i], target);
        if (opts[i].type == K3_OPT_STRING) {
            free(*(char **)field);
            *(char **)field = NULL;
        } else if (opts[i].type == K3_OPT_LIST || opts[i].type == K3_OPT_MULTI) {
            opt_list_clear(field);
        }
    }
}
