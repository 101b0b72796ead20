/* common/experts/placement.c: the expert placement (placement.h): building
 * one, its JSON file, validation.
 *
 * Owns: the k3_placement it returns (drive paths, per layer the drive of
 * each expert). Borrows: nothing. Threads: see placement.h.
 *
 * The in-memory form is the drive of every (layer, expert) (-1 for layers
 * not placed), so a lookup on the read path is one load; the file lists,
 * per layer, the ids of each drive, so that an id given twice (on two
 * drives, or twice on one) is visible and refused.
 */
#include "common/experts/placement.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/limits.h"

struct k3_placement {
    char path[K3_MAX_PATH]; /* the file it was loaded from, "" when built */
    uint64_t fingerprint;
    int n_layers, n_experts;
    uint64_t expert_bytes;
    int n_drives;
    char *drive[K3_MAX_DIRS]; /* owned */
    double weight[K3_MAX_DIRS];
    int16_t *drive_of; /* [n_layers][n_experts], -1 = layer not placed (all -1 when split) */
    int split;         /* version 2: every expert's bytes cut over all drives */
    uint64_t align;    /* split: cut alignment */
};

static k3_placement *alloc_placement(int n_layers, int n_experts) {
    k3_placement *p = k3_xcalloc(1, sizeof *p);
    p->n_layers = n_layers;
    p->n_experts = n_experts;
    size_t n = (size_t)n_layers * (size_t)n_experts;
    p->drive_of = k3_xmalloc(n * sizeof *p->drive_of);
    for (size_t i = 0; i < n; i++) p->drive_of[i] = -1;
    return p;
}

void k3_placement_free(k3_placement **pp) {
    if (!pp || !*pp) return;
    k3_placement *p = *pp;
    for (int d = 0; d < p->n_drives; d++) free(p->drive[d]);
    free(p->drive_of);
    free(p);
    *pp = NULL;
}

static k3_status check_dims(int n_layers, int n_experts, int n_drives, const char *what, char *err,
                            size_t errlen) {
    if (n_layers < 1 || n_layers > K3_MAX_LAYERS)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %d layers outside [1, %d]", what, n_layers,
                       K3_MAX_LAYERS);
    if (n_experts < 1 || n_experts > K3_MAX_EXPERTS)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %d experts outside [1, %d]", what, n_experts,
                       K3_MAX_EXPERTS);
    if (n_drives < 1 || n_drives > K3_MAX_DIRS)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %d drives outside [1, %d]", what, n_drives,
                       K3_MAX_DIRS);
    return K3_OK;
}

/* ---- building ---- */

typedef struct hot {
    uint64_t use;
    int id;
} hot;

static int hot_cmp(const void *pa, const void *pb) {
    const hot *a = pa, *b = pb;
    if (a->use != b->use) return a->use > b->use ? -1 : 1;
    return a->id - b->id;
}

k3_status k3_placement_build(k3_placement **out, const k3_place_input *in, char *err,
                             size_t errlen) {
    *out = NULL;
    k3_status st = check_dims(in->n_layers, in->n_experts, in->n_drives, "placement", err, errlen);
    if (st != K3_OK) return st;
    for (int d = 0; d < in->n_drives; d++) {
        double w = in->weight ? in->weight[d] : 1.0;
        if (!(w > 0.0) || w > 1e12)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "placement: drive %d (%s) has weight %g; it must be > 0", d,
                           in->drives[d], w);
        if (!in->drives[d][0] || strlen(in->drives[d]) >= K3_MAX_PATH - 64)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "placement: drive %d path is empty or longer than %d bytes", d,
                           K3_MAX_PATH - 64);
    }
    uint64_t align = in->align ? in->align : K3_PLACEMENT_ALIGN;
    if (in->split && (align & (align - 1)) != 0)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "placement: cut alignment %llu is not a power of two",
                       (unsigned long long)align);
    int L = in->n_layers, E = in->n_experts;
    k3_placement *p = alloc_placement(L, E);
    p->fingerprint = in->fingerprint;
    p->expert_bytes = in->expert_bytes;
    p->n_drives = in->n_drives;
    p->split = in->split ? 1 : 0;
    p->align = align;
    for (int d = 0; d < in->n_drives; d++) {
        p->drive[d] = k3_xstrdup(in->drives[d]);
        p->weight[d] = in->weight ? in->weight[d] : 1.0;
    }
    if (p->split) { /* no per-expert lists: the cut rule is the placement */
        *out = p;
        return K3_OK;
    }
    hot *h = k3_xcalloc((size_t)E, sizeof *h);
    for (int l = 0; l < L; l++) {
        if (!in->is_moe[l]) continue;
        for (int e = 0; e < E; e++) {
            uint64_t u = in->usage ? in->usage[(size_t)l * (size_t)E + (size_t)e] : 0;
            h[e].use = u < UINT64_MAX ? u + 1 : u; /* +1: an expert never seen still costs */
            h[e].id = e;
        }
        qsort(h, (size_t)E, sizeof *h, hot_cmp);
        double load[K3_MAX_DIRS] = {0};
        for (int i = 0; i < E; i++) {
            int best = 0;
            double best_v = 0.0;
            for (int d = 0; d < p->n_drives; d++) {
                double v = (load[d] + (double)h[i].use) / p->weight[d];
                if (d == 0 || v < best_v) best = d, best_v = v;
            }
            load[best] += (double)h[i].use;
            p->drive_of[(size_t)l * (size_t)E + (size_t)h[i].id] = (int16_t)best;
        }
    }
    free(h);
    *out = p;
    return K3_OK;
}

/* ---- the file ---- */

k3_status k3_placement_save(const k3_placement *p, const char *path, char *err, size_t errlen) {
    json_t *root = json_object();
    char fp[32];
    snprintf(fp, sizeof fp, "%016llx", (unsigned long long)p->fingerprint);
    json_object_set_new(root, "format", json_string(K3_PLACEMENT_FORMAT));
    json_object_set_new(root, "version",
                        json_integer(p->split ? K3_PLACEMENT_VERSION_SPLIT : K3_PLACEMENT_VERSION));
    if (p->split) {
        json_object_set_new(root, "split", json_true());
        json_object_set_new(root, "align", json_integer((json_int_t)p->align));
    }
    json_object_set_new(root, "model_fingerprint", json_string(fp));
    json_object_set_new(root, "n_layers", json_integer(p->n_layers));
    json_object_set_new(root, "n_experts", json_integer(p->n_experts));
    json_object_set_new(root, "expert_bytes", json_integer((json_int_t)p->expert_bytes));
    json_t *drives = json_array();
    for (int d = 0; d < p->n_drives; d++)
        json_array_append_new(drives,
                              json_pack("{s:s, s:f}", "path", p->drive[d], "weight", p->weight[d]));
    json_object_set_new(root, "drives", drives);
    json_t *layers = json_array();
    for (int l = 0; l < p->n_layers && !p->split; l++) {
        const int16_t *row = &p->drive_of[(size_t)l * (size_t)p->n_experts];
        if (row[0] < 0) continue;
        json_t *per = json_array();
        for (int d = 0; d < p->n_drives; d++) {
            json_t *ids = json_array();
            for (int e = 0; e < p->n_experts; e++)
                if (row[e] == d) json_array_append_new(ids, json_integer(e));
            json_array_append_new(per, ids);
        }
        json_array_append_new(layers, json_pack("{s:i, s:o}", "layer", l, "experts", per));
    }
    if (p->split)
        json_decref(layers);
    else
        json_object_set_new(root, "layers", layers);

    char tmp[K3_MAX_PATH + 8];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp) {
        json_decref(root);
        return k3_errf(K3_ERR_LIMIT, err, errlen, "placement %s: path longer than %d bytes", path,
                       K3_MAX_PATH);
    }
    int rc = json_dump_file(root, tmp, JSON_INDENT(1) | JSON_COMPACT);
    json_decref(root);
    if (rc != 0) {
        unlink(tmp);
        return k3_errf(K3_ERR_IO, err, errlen, "placement %s: cannot write: %s", tmp,
                       strerror(errno));
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return k3_errf(K3_ERR_IO, err, errlen, "placement %s: cannot rename %s over it: %s", path,
                       tmp, strerror(e));
    }
    return K3_OK;
}

static k3_status get_int(json_t *o, const char *key, long long lo, long long hi, long long *v,
                         const char *path, char *err, size_t errlen) {
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x))
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "placement %s: \"%s\" is missing or not an integer", path, key);
    *v = json_integer_value(x);
    if (*v < lo || *v > hi)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "placement %s: \"%s\" is %lld, outside [%lld, %lld]", path, key, *v, lo, hi);
    return K3_OK;
}

/* One layer entry: every id once, on one drive. */
static k3_status load_layer(k3_placement *p, json_t *ent, int i, const char *path, char *err,
                            size_t errlen) {
    long long l;
    if (!json_is_object(ent))
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: layers[%d] is not an object",
                       path, i);
    k3_status st = get_int(ent, "layer", 0, p->n_layers - 1, &l, path, err, errlen);
    if (st != K3_OK) return st;
    int16_t *row = &p->drive_of[(size_t)l * (size_t)p->n_experts];
    if (row[0] != -1 || p->n_experts == 0)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: layer %lld is listed twice", path,
                       l);
    for (int e = 0; e < p->n_experts; e++) row[e] = -2; /* listed, not yet claimed */
    json_t *per = json_object_get(ent, "experts");
    if (!json_is_array(per) || (int)json_array_size(per) != p->n_drives)
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "placement %s: layer %lld: \"experts\" must be an array of %d id lists "
                       "(one per drive)",
                       path, l, p->n_drives);
    for (int d = 0; d < p->n_drives; d++) {
        json_t *ids = json_array_get(per, (size_t)d);
        if (!json_is_array(ids))
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "placement %s: layer %lld drive %d: not an array of expert ids", path, l,
                           d);
        size_t k;
        json_t *x;
        json_array_foreach(ids, k, x) {
            if (!json_is_integer(x) || json_integer_value(x) < 0 ||
                json_integer_value(x) >= p->n_experts)
                return k3_errf(K3_ERR_FORMAT, err, errlen,
                               "placement %s: layer %lld drive %d: entry %zu is not an expert id "
                               "in [0, %d)",
                               path, l, d, k, p->n_experts);
            int e = (int)json_integer_value(x);
            if (row[e] >= 0)
                return k3_errf(K3_ERR_FORMAT, err, errlen,
                               "placement %s: layer %lld expert %d is claimed twice: by drive %d "
                               "(%s) and drive %d (%s)",
                               path, l, e, row[e], p->drive[row[e]], d, p->drive[d]);
            row[e] = (int16_t)d;
        }
    }
    for (int e = 0; e < p->n_experts; e++)
        if (row[e] < 0)
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "placement %s: layer %lld expert %d is on no drive", path, l, e);
    return K3_OK;
}

static k3_status load_json(k3_placement **out, json_t *root, const char *path, char *err,
                           size_t errlen) {
    if (!json_is_object(root))
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: not a JSON object", path);
    const char *fmt = json_string_value(json_object_get(root, "format"));
    if (!fmt || strcmp(fmt, K3_PLACEMENT_FORMAT) != 0)
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "placement %s: \"format\" is %s%s%s, expected \"%s\"", path, fmt ? "\"" : "",
                       fmt ? fmt : "missing", fmt ? "\"" : "", K3_PLACEMENT_FORMAT);
    long long ver, L, E, eb;
    k3_status st = get_int(root, "version", 0, 1000000, &ver, path, err, errlen);
    if (st != K3_OK) return st;
    if (ver != K3_PLACEMENT_VERSION && ver != K3_PLACEMENT_VERSION_SPLIT)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "placement %s: version %lld, this build reads versions %d and %d", path, ver,
                       K3_PLACEMENT_VERSION, K3_PLACEMENT_VERSION_SPLIT);
    json_t *jsplit = json_object_get(root, "split");
    int split = json_is_true(jsplit);
    if (jsplit && !json_is_boolean(jsplit))
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: \"split\" is not true or false",
                       path);
    if (split != (ver == K3_PLACEMENT_VERSION_SPLIT))
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "placement %s: version %lld %s \"split\": true (version %d is the "
                       "byte-split format)",
                       path, ver, split ? "cannot have" : "needs", K3_PLACEMENT_VERSION_SPLIT);
    long long align = K3_PLACEMENT_ALIGN;
    if (split && json_object_get(root, "align")) {
        k3_status sa = get_int(root, "align", 1, (long long)1 << 30, &align, path, err, errlen);
        if (sa != K3_OK) return sa;
        if (align & (align - 1))
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "placement %s: \"align\" is %lld, not a power of two", path, align);
    }
    if ((st = get_int(root, "n_layers", 1, K3_MAX_LAYERS, &L, path, err, errlen)) != K3_OK ||
        (st = get_int(root, "n_experts", 1, K3_MAX_EXPERTS, &E, path, err, errlen)) != K3_OK ||
        (st = get_int(root, "expert_bytes", 0, (long long)1 << 40, &eb, path, err, errlen)) !=
            K3_OK)
        return st;
    const char *fp = json_string_value(json_object_get(root, "model_fingerprint"));
    char *end = NULL;
    unsigned long long fpv = fp ? strtoull(fp, &end, 16) : 0;
    if (!fp || strlen(fp) != 16 || *end)
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "placement %s: \"model_fingerprint\" must be 16 hex digits", path);
    json_t *drives = json_object_get(root, "drives");
    if (!json_is_array(drives))
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: \"drives\" is not an array",
                       path);
    int nd = (int)json_array_size(drives);
    if ((st = check_dims((int)L, (int)E, nd, path, err, errlen)) != K3_OK) return st;
    k3_placement *p = alloc_placement((int)L, (int)E);
    p->fingerprint = fpv;
    p->expert_bytes = (uint64_t)eb;
    p->split = split;
    p->align = (uint64_t)align;
    snprintf(p->path, sizeof p->path, "%s", path);
    for (int d = 0; d < nd && st == K3_OK; d++) {
        json_t *dv = json_array_get(drives, (size_t)d);
        const char *dp = json_string_value(json_object_get(dv, "path"));
        json_t *w = json_object_get(dv, "weight");
        if (!dp || !dp[0] || strlen(dp) >= K3_MAX_PATH - 64)
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "placement %s: drives[%d].path is missing, empty or longer than %d bytes",
                         path, d, K3_MAX_PATH - 64);
        else if (!json_is_number(w) || !(json_number_value(w) > 0.0))
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "placement %s: drives[%d].weight must be a number > 0", path, d);
        else {
            for (int o = 0; o < d && st == K3_OK; o++)
                if (strcmp(p->drive[o], dp) == 0)
                    st = k3_errf(K3_ERR_FORMAT, err, errlen,
                                 "placement %s: drive %s is listed twice (drives %d and %d)", path,
                                 dp, o, d);
            if (st != K3_OK) break;
            p->drive[d] = k3_xstrdup(dp);
            p->weight[d] = json_number_value(w);
            p->n_drives++;
        }
    }
    json_t *layers = json_object_get(root, "layers");
    if (st == K3_OK && split && layers)
        st = k3_errf(K3_ERR_FORMAT, err, errlen,
                     "placement %s: a split placement has no \"layers\" (every expert is on "
                     "every drive)",
                     path);
    else if (st == K3_OK && !split && !json_is_array(layers))
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s: \"layers\" is not an array", path);
    for (size_t i = 0; st == K3_OK && i < json_array_size(layers); i++)
        st = load_layer(p, json_array_get(layers, i), (int)i, path, err, errlen);
    if (st != K3_OK) {
        k3_placement_free(&p);
        return st;
    }
    *out = p;
    return K3_OK;
}

k3_status k3_placement_load(k3_placement **out, const char *path, char *err, size_t errlen) {
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return k3_errf(errno == ENOENT ? K3_ERR_MISSING : K3_ERR_IO, err, errlen,
                       "placement %s: %s", path, strerror(errno));
    if (sb.st_size > K3_MAX_PLACEMENT_BYTES)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "placement %s: %lld bytes > limit %d", path,
                       (long long)sb.st_size, K3_MAX_PLACEMENT_BYTES);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "placement %s line %d: %s", path, je.line,
                       je.text);
    k3_status st = load_json(out, root, path, err, errlen);
    json_decref(root);
    return st;
}

k3_status k3_placement_check(const k3_placement *p, uint64_t fingerprint, int n_layers,
                             int n_experts, const uint8_t *is_moe, int layer_a, int layer_b,
                             char *err, size_t errlen) {
    const char *name = p->path[0] ? p->path : "(built)";
    if (p->fingerprint != fingerprint)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "placement %s was made for model %016llx, this model is %016llx (another "
                       "model's or another version's placement: run k3-coordinator place again)",
                       name, (unsigned long long)p->fingerprint, (unsigned long long)fingerprint);
    if (p->n_experts != n_experts || p->n_layers < n_layers)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "placement %s: %d layers x %d experts, the model has %d x %d", name,
                       p->n_layers, p->n_experts, n_layers, n_experts);
    for (int l = layer_a; l < layer_b && !p->split; l++)
        if (is_moe[l] && p->drive_of[(size_t)l * (size_t)p->n_experts] < 0)
            return k3_errf(K3_ERR_MISSING, err, errlen, "placement %s: MoE layer %d is not placed",
                           name, l);
    return K3_OK;
}

const char *k3_placement_path(const k3_placement *p) { return p->path; }
uint64_t k3_placement_fingerprint(const k3_placement *p) { return p->fingerprint; }
int k3_placement_drives(const k3_placement *p) { return p->n_drives; }
const char *k3_placement_drive_path(const k3_placement *p, int d) { return p->drive[d]; }
double k3_placement_drive_weight(const k3_placement *p, int d) { return p->weight[d]; }

int k3_placement_split(const k3_placement *p) { return p->split; }
uint64_t k3_placement_align(const k3_placement *p) { return p->align; }

/* Cut k of [off, off + len) (0..N): see placement.h. */
static uint64_t cut(const k3_placement *p, int k, uint64_t off, uint64_t len) {
    if (k <= 0) return off;
    if (k >= p->n_drives) return off + len;
    double wk = 0.0, w = 0.0;
    for (int d = 0; d < p->n_drives; d++) w += p->weight[d], wk += d < k ? p->weight[d] : 0.0;
    uint64_t c = off + (uint64_t)((double)len * wk / w + 0.5);
    c &= ~(p->align - 1);
    return c < off ? off : c > off + len ? off + len : c;
}

void k3_placement_piece(const k3_placement *p, int d, uint64_t off, uint64_t len, uint64_t *lo,
                        uint64_t *hi) {
    *lo = cut(p, d, off, len);
    *hi = cut(p, d + 1, off, len);
    if (*hi < *lo) *hi = *lo;
}

int k3_placement_drive_of(const k3_placement *p, int layer, int e) {
    if (layer < 0 || layer >= p->n_layers || e < 0 || e >= p->n_experts) return -1;
    return p->drive_of[(size_t)layer * (size_t)p->n_experts + (size_t)e];
}

int k3_placement_count(const k3_placement *p, int layer, int d) {
    int n = 0;
    for (int e = 0; e < p->n_experts; e++) n += k3_placement_drive_of(p, layer, e) == d;
    return n;
}

k3_status k3_placement_file_path(const k3_placement *p, int d, const char *shard_name, char *buf,
                                 size_t n, char *err, size_t errlen) {
    if ((size_t)snprintf(buf, n, "%s/%s/%s", p->drive[d], K3_PLACEMENT_SUBDIR, shard_name) >= n)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "placement: path of %s on drive %s is longer than %zu bytes", shard_name,
                       p->drive[d], n - 1);
    return K3_OK;
}

/* ---- drive file records ---- */

static uint64_t fnv64(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= 1099511628211ull;
    }
    return h;
}

int k3_placement_done_has(const char *dir, uint64_t hash, uint64_t size, const char *name) {
    char path[K3_MAX_PATH + 16], line[K3_MAX_PATH + 64], want[K3_MAX_PATH + 64];
    snprintf(path, sizeof path, "%s/.done", dir);
    snprintf(want, sizeof want, "%016llx %llu %s\n", (unsigned long long)hash,
             (unsigned long long)size, name);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = strcmp(line, want) == 0;
    fclose(f);
    return found;
}

k3_status k3_placement_done_add(const char *dir, uint64_t hash, uint64_t size, const char *name,
                                char *err, size_t errlen) {
    char path[K3_MAX_PATH + 16];
    snprintf(path, sizeof path, "%s/.done", dir);
    FILE *f = fopen(path, "a");
    int ok = f && fprintf(f, "%016llx %llu %s\n", (unsigned long long)hash,
                          (unsigned long long)size, name) > 0;
    if (f) ok &= fflush(f) == 0 && fsync(fileno(f)) == 0, ok &= fclose(f) == 0;
    return ok ? K3_OK
              : k3_errf(K3_ERR_IO, err, errlen, "place: %s: cannot append: %s", path,
                        strerror(errno));
}

uint64_t k3_placement_hash_init(uint64_t size) { return fnv64(1469598103934665603ull, size); }

uint64_t k3_placement_hash_range(uint64_t hash, uint64_t off, uint64_t len) {
    return fnv64(fnv64(hash, off), len);
}
