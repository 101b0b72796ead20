/* common/ckpt/safetensors.h: the checkpoint's shard files, found across several
 * directories (drives), parsed lazily and safely.
 *
 * Owns: the list of *.safetensors files in the model directory and the extra
 * --dirs (a search path: deduplicated by basename, first listing wins, each
 * shard lives on exactly one drive), their parsed headers, and one buffered fd
 * plus one O_DIRECT fd per opened shard.
 *
 * Laziness: st_open() only lists directories and reads
 * model.safetensors.index.json when present. A shard is opened and its header
 * parsed the first time a tensor in it is looked up (st_find) or when
 * st_open_all() is called. With an index.json, looking up a tensor opens only
 * the shard the weight_map names, so a worker that asks only for its own
 * layers never opens another shard (the vision shards and the embedding shard
 * included). Without an index.json every shard is parsed on the first lookup.
 *
 * Validation (docs/TESTING.md 6.5, tests S1-S7): header
 * length against K3_ST_MAX_HEADER and the file size before allocating, JSON
 * object with string->string __metadata__, no trailing junk, no duplicate
 * names, dtype whitelist, rank <= K3_ST_MAX_RANK, checked shape arithmetic,
 * nbytes == elements * dtype size exactly, offsets inside the data section,
 * no overlap, no gap, no uncovered tail; index.json names bare file names
 * only. Errors name the file, the tensor, the value and the limit.
 *
 * Threads: st_find / st_open_all mutate the index (lazy parse) and are
 * serialised by an internal mutex; st_pread and st_read_f32 are safe to call
 * concurrently (pread on fds). The st_tensor pointers stay valid until
 * st_close.
 */
#ifndef K3_SAFETENSORS_H
#define K3_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"

typedef enum st_dtype {
    ST_BF16 = 0,
    ST_F16,
    ST_F32,
    ST_U8,
    ST_I8,
    ST_F8_E4M3,
    ST_F8_E8M0,
    ST_I32,
    ST_I64,
    ST_F64,
    ST_BOOL,
    ST_DTYPE_COUNT
} st_dtype;

const char *st_dtype_name(st_dtype dt);
size_t st_dtype_size(st_dtype dt);

typedef struct st_tensor {
    const char *name; /* owned by the index */
    st_dtype dtype;
    int rank; /* 0..K3_ST_MAX_RANK */
    int64_t shape[K3_ST_MAX_RANK];
    uint64_t offset; /* ABSOLUTE byte offset in the shard file */
    uint64_t nbytes;
    int shard; /* index into the shard table */
} st_tensor;

typedef struct st_index st_index;

typedef struct st_open_opts {
    const char *model_dir;   /* primary directory: config, tokenizer, index */
    const char *const *dirs; /* extra shard directories, may be NULL */
    int n_dirs;
} st_open_opts;

/* Lists shards, reads index.json if present. Returns an owned index. */
k3_status st_open(st_index **out, const st_open_opts *opts, char *err, size_t errlen);
void st_close(st_index **idx);

/* Parses every shard's header now (tools, doctor, tests). */
k3_status st_open_all(st_index *idx, char *err, size_t errlen);

/* Looks a tensor up by its full name. Returns K3_ERR_MISSING (with a message
 * naming the tensor) when absent; other errors when its shard is malformed. */
k3_status st_find(st_index *idx, const char *name, const st_tensor **out, char *err, size_t errlen);

/* Like st_find but a missing tensor is not an error: *out = NULL. */
k3_status st_find_opt(st_index *idx, const char *name, const st_tensor **out, char *err,
                      size_t errlen);

/* Reads the tensor converted to f32 (BF16/F16/F32 sources); n must equal the
 * element count. */
k3_status st_read_f32(st_index *idx, const st_tensor *t, float *dst, size_t n, char *err,
                      size_t errlen);

/* Raw bytes of the tensor (n == t->nbytes). */
k3_status st_read_raw(st_index *idx, const st_tensor *t, void *dst, size_t n, char *err,
                      size_t errlen);

/* pread loop on shard `shard` at absolute offset; a short read (file truncated
 * after start) or EIO is an error naming the shard. direct != 0 uses the
 * O_DIRECT fd (caller guarantees alignment of buf, off and len to 4096). */
k3_status st_pread(st_index *idx, int shard, uint64_t off, void *buf, size_t len, int direct,
                   char *err, size_t errlen);

/* Shard table access. */
int st_shard_count(const st_index *idx);
const char *st_shard_path(const st_index *idx, int shard); /* full path */
const char *st_shard_name(const st_index *idx, int shard); /* basename */
uint64_t st_shard_size(const st_index *idx, int shard);    /* at open (listing before) */
int st_shard_is_open(const st_index *idx, int shard);
int st_shard_fd(const st_index *idx, int shard, int direct); /* -1 if not open */

/* Re-fstat an open shard (docs/TESTING.md 6.5 check 11): K3_ERR_IO naming the file
 * when its size or mtime differs from what was recorded at open (truncated
 * or replaced since), K3_ERR_STATE when it is not open. Cheap enough to run
 * before each streaming pass. */
k3_status st_shard_check(const st_index *idx, int shard, char *err, size_t errlen);

/* The "language_model." prefix used by this checkpoint ("" or the prefix),
 * probed on model.layers.0.input_layernorm.weight (docs/MODEL.md 2.1). */
const char *st_prefix(st_index *idx);

/* Iteration over every parsed tensor (after st_open_all). */
int st_tensor_count(const st_index *idx);
const st_tensor *st_tensor_at(const st_index *idx, int i);

/* Fault hook for tests (S9): when set, called before every pread; a non-zero
 * return is used as the errno of a failed read, a negative return -k makes
 * the read return k bytes short. NULL disables. Process-global. */
typedef int (*st_fault_fn)(int shard, uint64_t off, size_t len, void *ctx);
void st_set_fault_hook(st_fault_fn fn, void *ctx);

/* BF16 / F16 -> f32 conversions (exact). */
float st_bf16_to_f32(uint16_t v);
float st_f16_to_f32(uint16_t v);

/* Parses one safetensors header from memory (fuzzing / unit tests):
 * buf holds the whole file (or at least 8 + N bytes), file_size its size.
 * Returns the tensor count via *n_tensors. */
k3_status st_parse_header_mem(const uint8_t *buf, size_t buf_len, uint64_t file_size,
                              const char *file_name, int *n_tensors, char *err, size_t errlen);

#endif
