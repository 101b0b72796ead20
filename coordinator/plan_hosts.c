/* coordinator/plan_hosts.c: the hosts file and the shard files by layer
 * (plan_hosts.h). */
#include "coordinator/plan_hosts.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "coordinator/drives.h"

static k3_status load_json(const char *path, size_t cap, json_t **out, char *err, size_t errlen) {
    struct stat sb;
    if (stat(path, &sb) != 0) return k3_errf(K3_ERR_MISSING, err, errlen, "%s: cannot read", path);
    if ((uint64_t)sb.st_size > cap)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %lld bytes > the limit of %zu", path,
                       (long long)sb.st_size, cap);
    json_error_t je;
    *out = json_load_file(path, 0, &je);
    if (!*out)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "%s: line %d: %s", path, je.line, je.text);
    return K3_OK;
}

static double num_or(json_t *o, const char *key, double def) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : def;
}

k3_status plan_hosts_read(const char *path, double seconds, int remeasure, plan_host **hosts,
                          int *n_hosts, plan_drive **drives, int *n_drives, char *err,
                          size_t errlen) {
    *hosts = NULL, *drives = NULL, *n_hosts = 0, *n_drives = 0;
    json_t *root;
    k3_status st = load_json(path, K3_MAX_HOSTS_FILE, &root, err, errlen);
    if (st) return st;
    const char *fmt = json_string_value(json_object_get(root, "format"));
    json_t *jh = json_object_get(root, "hosts");
    size_t nh = json_array_size(jh), nd = 0;
    if (fmt && strcmp(fmt, K3_PLAN_HOSTS_FORMAT))
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: format '%s', want '%s'", path, fmt,
                     K3_PLAN_HOSTS_FORMAT);
    else if (!nh)
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: no \"hosts\" list (docs/DEPLOY.md)", path);
    else if (nh > K3_MAX_HOSTS)
        st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %zu hosts > K3_MAX_HOSTS %d", path, nh,
                     K3_MAX_HOSTS);
    for (size_t h = 0; !st && h < nh; h++) {
        size_t k = json_array_size(json_object_get(json_array_get(jh, h), "drives"));
        if (!k || k > K3_MAX_DIRS)
            st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: host %zu has %zu drives: need 1..%d", path,
                         h + 1, k, K3_MAX_DIRS);
        nd += k;
    }
    plan_host *H = st ? NULL : calloc(nh, sizeof *H);
    plan_drive *D = st ? NULL : calloc(nd, sizeof *D);
    if (!st && (!H || !D)) st = k3_errf(K3_ERR_NOMEM, err, errlen, "plan: hosts: out of memory");
    int di = 0;
    for (size_t h = 0; !st && h < nh; h++) {
        json_t *o = json_array_get(jh, h);
        const char *name = json_string_value(json_object_get(o, "name"));
        const char *addr = json_string_value(json_object_get(o, "addr"));
        if (!name || !name[0] || strlen(name) >= sizeof H[h].name) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: host %zu: \"name\" missing or longer "
                         "than %zu",
                         path, h + 1, sizeof H[h].name - 1);
            break;
        }
        for (size_t q = 0; q < h; q++)
            if (!strcmp(H[q].name, name))
                st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: host %s listed twice", path, name);
        snprintf(H[h].name, sizeof H[h].name, "%s", name);
        snprintf(H[h].addr, sizeof H[h].addr, "%s", addr && addr[0] ? addr : name);
        double port = num_or(o, "port", K3_PLAN_DEFAULT_PORT);
        H[h].ram_gb = num_or(o, "ram_gb", 0);
        H[h].rtt_ms = num_or(o, "rtt_ms", 0);
        if (!st && (port < 1 || port + K3_MAX_DIRS > 65535 || H[h].ram_gb < 0 || H[h].rtt_ms < 0 ||
                    H[h].rtt_ms > 1e4))
            st = k3_errf(K3_ERR_ARG, err, errlen,
                         "%s: host %s: port %g, ram_gb %g, rtt_ms %g: want a port 1..%d, "
                         "ram_gb >= 0, rtt_ms 0..10000",
                         path, name, port, H[h].ram_gb, H[h].rtt_ms, 65535 - K3_MAX_DIRS);
        H[h].port = (int)port;
        json_t *jd = json_object_get(o, "drives");
        for (size_t k = 0; !st && k < json_array_size(jd); k++, di++) {
            json_t *d = json_array_get(jd, k);
            plan_drive *p = &D[di];
            const char *dp = json_string_value(json_object_get(d, "path"));
            if (!dp || !dp[0] || strlen(dp) >= sizeof p->path) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "%s: host %s drive %zu: \"path\" missing "
                             "or longer than %zu",
                             path, name, k + 1, sizeof p->path - 1);
                break;
            }
            snprintf(p->path, sizeof p->path, "%s", dp);
            p->host = (int)h;
            p->numa = (int)num_or(d, "numa", -1);
            p->seq_gbs = num_or(d, "seq_gbs", 0);
            p->rand_gbs = num_or(d, "rand_gbs", 0);
            if (p->numa < -1 || p->numa > 1023)
                st =
                    k3_errf(K3_ERR_ARG, err, errlen, "%s: host %s drive %s: numa %d: want -1..1023",
                            path, name, dp, p->numa);
            else if (p->rand_gbs < 0 || p->seq_gbs < 0)
                st = k3_errf(K3_ERR_ARG, err, errlen, "%s: host %s drive %s: negative GB/s", path,
                             name, dp);
            else if (p->rand_gbs == 0) {
                /* not given: measure it here, where the path must exist */
                k3_drive kd;
                char perr[512];
                if (k3_drive_probe(&kd, dp, 1, remeasure, seconds, perr, sizeof perr) ||
                    kd.rand_gbs <= 0)
                    st = k3_errf(K3_ERR_MISSING, err, errlen,
                                 "%s: host %s drive %s: no rand_gbs given and not measurable "
                                 "here (%s): give its figures (k3-coordinator plan --describe "
                                 "on that host)",
                                 path, name, dp, kd.note[0] ? kd.note : perr);
                else {
                    p->seq_gbs = kd.seq_gbs, p->rand_gbs = kd.rand_gbs;
                    p->from_cache = kd.from_cache;
                    if (p->numa < 0) p->numa = kd.numa;
                }
            }
        }
    }
    json_decref(root);
    if (st) {
        free(H);
        free(D);
        return st;
    }
    *hosts = H, *drives = D, *n_hosts = (int)nh, *n_drives = di;
    return K3_OK;
}

/* The layer of a tensor name ("model.layers.7.mlp..." or
 * "language_model.model.layers.7..."), -1 when it is not a layer's. */
static int layer_of(const char *name) {
    if (!strncmp(name, "vision_tower", 12) || !strncmp(name, "mm_projector", 12)) return -1;
    const char *p = strstr(name, "layers.");
    if (!p || (p != name && p[-1] != '.')) return -1;
    p += 7;
    if (*p < '0' || *p > '9') return -1;
    int l = 0;
    while (*p >= '0' && *p <= '9' && l < 100000) l = l * 10 + (*p++ - '0');
    return *p == '.' ? l : -1;
}

static int file_index(plan_files *pf, const char *name) {
    for (int f = 0; f < pf->n_files; f++)
        if (!strcmp(pf->names[f], name)) return f;
    return -1;
}

k3_status plan_files_read(plan_files *pf, const char *model_dir, int n_layers, char *err,
                          size_t errlen) {
    memset(pf, 0, sizeof *pf);
    pf->n_layers = n_layers;
    char p[K3_MAX_PATH];
    DIR *dir = opendir(model_dir);
    if (!dir)
        return k3_errf(K3_ERR_MISSING, err, errlen, "%s: cannot open the directory", model_dir);
    int cap = 0;
    struct dirent *de;
    k3_status st = K3_OK;
    while (!st && (de = readdir(dir))) {
        struct stat sb;
        if (de->d_name[0] == '.' || strlen(de->d_name) >= sizeof pf->names[0]) continue;
        snprintf(p, sizeof p, "%s/%s", model_dir, de->d_name);
        if (stat(p, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (pf->n_files == cap) {
            if (cap >= K3_ST_MAX_SHARDS + 64) {
                st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than %d files", model_dir,
                             K3_ST_MAX_SHARDS + 64);
                break;
            }
            cap = cap ? cap * 2 : 64;
            void *nn = realloc(pf->names, (size_t)cap * sizeof *pf->names);
            if (nn) pf->names = nn;
            void *ns = realloc(pf->sizes, (size_t)cap * sizeof *pf->sizes);
            if (ns) pf->sizes = ns;
            if (!nn || !ns) st = k3_errf(K3_ERR_NOMEM, err, errlen, "plan: out of memory");
            if (st) break;
        }
        snprintf(pf->names[pf->n_files], sizeof pf->names[0], "%s", de->d_name);
        pf->sizes[pf->n_files++] = (uint64_t)sb.st_size;
    }
    closedir(dir);
    /* by name, so the plan lists them the same way every run */
    for (int i = 1; !st && i < pf->n_files; i++)
        for (int j = i; j > 0 && strcmp(pf->names[j - 1], pf->names[j]) > 0; j--) {
            char t[256];
            uint64_t ts = pf->sizes[j];
            memcpy(t, pf->names[j], sizeof t);
            memcpy(pf->names[j], pf->names[j - 1], sizeof t);
            memcpy(pf->names[j - 1], t, sizeof t);
            pf->sizes[j] = pf->sizes[j - 1], pf->sizes[j - 1] = ts;
        }
    if (!st && pf->n_files) {
        pf->layer_has = calloc((size_t)n_layers * (size_t)pf->n_files, 1);
        pf->global = calloc((size_t)pf->n_files, 1);
        if (!pf->layer_has || !pf->global)
            st = k3_errf(K3_ERR_NOMEM, err, errlen, "plan: out of memory");
    }
    json_t *idx = NULL;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", model_dir);
    if (!st) st = load_json(p, K3_MAX_INDEX_BYTES, &idx, err, errlen);
    json_t *wm = idx ? json_object_get(idx, "weight_map") : NULL;
    if (!st && !json_is_object(wm))
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: no weight_map", p);
    uint8_t *shard = st ? NULL : calloc((size_t)pf->n_files + 1, 1);
    const char *key;
    json_t *v;
    if (!st) json_object_foreach(wm, key, v) {
            const char *fn = json_string_value(v);
            int f = fn ? file_index(pf, fn) : -1, l = layer_of(key);
            if (f < 0) {
                st = k3_errf(K3_ERR_MISSING, err, errlen, "%s: tensor %s: shard %s not in %s", p,
                             key, fn ? fn : "(not a string)", model_dir);
                break;
            }
            shard[f] = 1;
            if (l >= n_layers) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: tensor %s: layer %d of %d", p, key, l,
                             n_layers);
                break;
            }
            if (l >= 0)
                pf->layer_has[(size_t)l * (size_t)pf->n_files + (size_t)f] = 1;
            else
                pf->global[f] = 1;
        }
    for (int f = 0; !st && f < pf->n_files; f++)
        if (!shard[f]) pf->global[f] = 1; /* config, index, tokenizer, ... */
    free(shard);
    json_decref(idx);
    if (st) plan_files_free(pf);
    return st;
}

void plan_files_free(plan_files *pf) {
    free(pf->names);
    free(pf->sizes);
    free(pf->layer_has);
    free(pf->global);
    memset(pf, 0, sizeof *pf);
}
