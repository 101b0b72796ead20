/* tests/st_edit.h: editing copies of a safetensors checkpoint in tests
 * (broken fixtures, repacked containers). A shard is loaded whole into
 * memory (ste_load), tensors are removed / replaced / added, and it is
 * written back with compacted offsets and a space-padded header (ste_save),
 * so the result is a valid file unless a test breaks it on purpose. The
 * index.json weight_map is edited with ste_index_set. Uses jansson. For
 * small fixtures only: no limits, test-only code (single-threaded).
 */
#ifndef K3_TEST_ST_EDIT_H
#define K3_TEST_ST_EDIT_H

#include <dirent.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct ste_tensor {
    char *name;
    char dtype[8];
    int rank;
    int64_t shape[8];
    unsigned char *data;
    size_t nbytes;
    uint64_t order; /* original data offset: keeps the file's data order */
} ste_tensor;

typedef struct ste_file {
    ste_tensor *t;
    int n, cap;
    json_t *meta; /* __metadata__ or NULL */
} ste_file;

static size_t ste_dtype_size(const char *dt) {
    if (!strcmp(dt, "F32") || !strcmp(dt, "I32")) return 4;
    if (!strcmp(dt, "BF16") || !strcmp(dt, "F16")) return 2;
    if (!strcmp(dt, "F64") || !strcmp(dt, "I64")) return 8;
    return 1;
}

static int ste_order_cmp(const void *a, const void *b) {
    const ste_tensor *x = a, *y = b;
    return x->order < y->order ? -1 : x->order > y->order;
}

static void ste_free(ste_file *f) {
    for (int i = 0; i < f->n; i++) free(f->t[i].name), free(f->t[i].data);
    free(f->t);
    if (f->meta) json_decref(f->meta);
    memset(f, 0, sizeof *f);
}

static ste_tensor *ste_push(ste_file *f) {
    if (f->n == f->cap) {
        f->cap = f->cap ? 2 * f->cap : 64;
        f->t = realloc(f->t, sizeof *f->t * (size_t)f->cap);
    }
    ste_tensor *t = &f->t[f->n++];
    memset(t, 0, sizeof *t);
    return t;
}

static int ste_load(ste_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    fseek(fp, 0, SEEK_END);
    long sz = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)sz + 1);
    size_t got = fread(buf, 1, (size_t)sz, fp);
    fclose(fp);
    if (got != (size_t)sz || sz < 8) return free(buf), -1;
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)buf[i] << (8 * i);
    if (hl > (uint64_t)sz - 8) return free(buf), -1;
    json_error_t je;
    json_t *hdr = json_loadb((const char *)buf + 8, (size_t)hl, 0, &je);
    if (!hdr) return free(buf), -1;
    const unsigned char *data = buf + 8 + hl;
    const char *key;
    json_t *v;
    json_object_foreach(hdr, key, v) {
        if (!strcmp(key, "__metadata__")) {
            f->meta = json_incref(v);
            continue;
        }
        ste_tensor *t = ste_push(f);
        t->name = strdup(key);
        snprintf(t->dtype, sizeof t->dtype, "%s", json_string_value(json_object_get(v, "dtype")));
        json_t *shp = json_object_get(v, "shape");
        t->rank = (int)json_array_size(shp);
        for (int d = 0; d < t->rank && d < 8; d++)
            t->shape[d] = json_integer_value(json_array_get(shp, (size_t)d));
        json_t *off = json_object_get(v, "data_offsets");
        uint64_t a = (uint64_t)json_integer_value(json_array_get(off, 0));
        uint64_t b = (uint64_t)json_integer_value(json_array_get(off, 1));
        t->nbytes = (size_t)(b - a);
        t->data = malloc(t->nbytes ? t->nbytes : 1);
        memcpy(t->data, data + a, t->nbytes);
        t->order = a;
    }
    json_decref(hdr);
    free(buf);
    qsort(f->t, (size_t)f->n, sizeof *f->t, ste_order_cmp);
    return 0;
}

static int ste_save(const ste_file *f, const char *path) {
    json_t *hdr = json_object();
    if (f->meta) json_object_set(hdr, "__metadata__", f->meta);
    uint64_t pos = 0;
    for (int i = 0; i < f->n; i++) {
        const ste_tensor *t = &f->t[i];
        json_t *o = json_object(), *shp = json_array(), *off = json_array();
        json_object_set_new(o, "dtype", json_string(t->dtype));
        for (int d = 0; d < t->rank; d++) json_array_append_new(shp, json_integer(t->shape[d]));
        json_object_set_new(o, "shape", shp);
        json_array_append_new(off, json_integer((json_int_t)pos));
        json_array_append_new(off, json_integer((json_int_t)(pos + t->nbytes)));
        json_object_set_new(o, "data_offsets", off);
        json_object_set_new(hdr, t->name, o);
        pos += t->nbytes;
    }
    char *txt = json_dumps(hdr, JSON_COMPACT);
    json_decref(hdr);
    size_t tl = strlen(txt), pad = (8 - tl % 8) % 8;
    FILE *fp = fopen(path, "wb");
    if (!fp) return free(txt), -1;
    uint64_t hl = tl + pad;
    unsigned char lb[8];
    for (int i = 0; i < 8; i++) lb[i] = (unsigned char)(hl >> (8 * i));
    fwrite(lb, 1, 8, fp);
    fwrite(txt, 1, tl, fp);
    for (size_t i = 0; i < pad; i++) fputc(' ', fp);
    for (int i = 0; i < f->n; i++) fwrite(f->t[i].data, 1, f->t[i].nbytes, fp);
    free(txt);
    return fclose(fp) ? -1 : 0;
}

static int ste_find(const ste_file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return i;
    return -1;
}

static void ste_remove(ste_file *f, int i) {
    free(f->t[i].name), free(f->t[i].data);
    memmove(&f->t[i], &f->t[i + 1], sizeof *f->t * (size_t)(f->n - i - 1));
    f->n--;
}

/* Replaces tensor `name` (kept at its place in the data order) or appends
 * it: dtype, shape and exactly nbytes of data (copied). */
static void ste_set(ste_file *f, const char *name, const char *dtype, int rank,
                    const int64_t *shape, const void *data, size_t nbytes) {
    int i = ste_find(f, name);
    ste_tensor *t;
    if (i >= 0) {
        t = &f->t[i];
        free(t->data);
    } else {
        t = ste_push(f);
        t->name = strdup(name);
    }
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->rank = rank;
    for (int d = 0; d < rank; d++) t->shape[d] = shape[d];
    t->data = malloc(nbytes ? nbytes : 1);
    memcpy(t->data, data, nbytes);
    t->nbytes = nbytes;
}

/* weight_map[name] = file (basename), or deletes it when file is NULL. */
static int ste_index_set(const char *dir, const char *name, const char *file) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) return -1;
    json_t *map = json_object_get(j, "weight_map");
    if (file)
        json_object_set_new(map, name, json_string(file));
    else
        json_object_del(map, name);
    int rc = json_dump_file(j, path, JSON_INDENT(1));
    json_decref(j);
    return rc;
}

/* Full path of the shard holding `name`, from the index. */
static int ste_shard_of(const char *dir, const char *name, char *out, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) return -1;
    const char *s = json_string_value(json_object_get(json_object_get(j, "weight_map"), name));
    int rc = s ? 0 : -1;
    if (s) snprintf(out, n, "%s/%s", dir, s);
    json_decref(j);
    return rc;
}

static int ste_copy_file(const char *src, const char *dst) {
    FILE *a = fopen(src, "rb"), *b = fopen(dst, "wb");
    int ok = a && b;
    char buf[1 << 16];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, n, b) == n;
    if (a) fclose(a);
    if (b && fclose(b)) ok = 0;
    return ok ? 0 : -1;
}

/* Copies the regular files of src into dst (created). */
static int ste_copy_dir(const char *src, const char *dst) {
    mkdir(dst, 0755);
    DIR *d = opendir(src);
    if (!d) return -1;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char a[1024], b[1024];
        snprintf(a, sizeof a, "%s/%s", src, e->d_name);
        snprintf(b, sizeof b, "%s/%s", dst, e->d_name);
        struct stat sb;
        if (stat(a, &sb) == 0 && S_ISREG(sb.st_mode)) rc |= ste_copy_file(a, b);
    }
    closedir(d);
    return rc;
}

/* Removes dir and the regular files in it (flat directories only). */
static void ste_rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char a[1024];
        snprintf(a, sizeof a, "%s/%s", dir, e->d_name);
        unlink(a);
    }
    closedir(d);
    rmdir(dir);
}

#endif
