/* common/experts/placement.h: which drive holds each routed expert (expert
 * striping, docs/CLUSTER.md "Expert striping").
 *
 * Owns: a placement: the model fingerprint it was made for, the drives
 * (directory, weight = relative speed or share of expert bytes), and for
 * every MoE layer which drive holds each expert id; how one is built
 * (k3_placement_build: balance expected bytes per drive by weight, hottest
 * experts first so they spread), its JSON file (save, load, validation) and
 * the per-drive file layout (k3_placement_file_path).
 * Borrows: nothing after a call returns (inputs are copied).
 * Threads: build/load/save from one thread; a loaded placement is read only
 * and may be shared by any threads.
 *
 * The file (JSON, written by `k3-coordinator place` or `--local N --stripe`):
 *   {"format": "k3shard-placement", "version": 1,
 *    "model_fingerprint": "16 hex digits" (k3_model_fingerprint_dir),
 *    "n_layers": L, "n_experts": E, "expert_bytes": B,
 *    "drives": [{"path": "/nvme1/k3", "weight": 0.5}, ...],
 *    "layers": [{"layer": 1, "experts": [[ids on drive 0], [ids on drive 1], ...]}, ...]}
 * Every MoE layer of the model is listed once and every expert id of it is
 * on exactly one drive.
 *
 * Version 2, byte-split ("split": true, docs/CLUSTER.md "Expert striping"):
 *   {"format": "k3shard-placement", "version": 2, "split": true, "align": 4096,
 *    "model_fingerprint": ..., "n_layers": L, "n_experts": E, "expert_bytes": B,
 *    "drives": [{"path": ..., "weight": w}, ...]}
 * no per-expert lists: every expert's bytes are cut over all drives in
 * drive order, drive d's piece proportional to its weight
 * (k3_placement_piece), so each pick reads from every drive and a MoE
 * layer is balanced by construction. The unit cut is the expert's span
 * when its six tensors lie back to back in one shard (slot order), else
 * each tensor on its own. Cut points are absolute file offsets aligned to
 * "align" (4096: the O_DIRECT block; a piece may be empty, then that drive
 * holds nothing of the expert). Drive d's file holds its pieces at the
 * shard's offsets, like version 1. A drive's bytes live in <path>/k3-stripe/<shard>:
 * a copy of the checkpoint shard with the same size and offsets holding
 * (at least) the bytes of that drive's experts, the rest a hole (or a hard
 * link to the whole shard). Same names and offsets mean the disk order and
 * so the sum order of the experts (common/layers/moe.c) do not change: a
 * striped run gives the same bits as an unstriped one.
 */
#ifndef K3_PLACEMENT_H
#define K3_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"

#define K3_PLACEMENT_FORMAT        "k3shard-placement"
#define K3_PLACEMENT_VERSION       1
#define K3_PLACEMENT_VERSION_SPLIT 2           /* byte-split placements */
#define K3_PLACEMENT_ALIGN         4096        /* default cut alignment of a split placement */
#define K3_PLACEMENT_SUBDIR        "k3-stripe" /* <drive>/k3-stripe/<shard name> */

typedef struct k3_placement k3_placement;

typedef struct k3_place_input {
    const char *const *drives; /* [n_drives] directories */
    int n_drives;              /* 1..K3_MAX_DIRS */
    const double *weight;      /* [n_drives] relative speed or share (> 0), NULL = equal */
    uint64_t fingerprint;      /* k3_model_fingerprint_dir */
    int n_layers, n_experts;
    const uint8_t *is_moe; /* [n_layers] */
    uint64_t expert_bytes; /* bytes of one expert (k3_expert_geom.total) */
    const uint64_t *usage; /* [n_layers][n_experts] past selections (the rows of
                              k3_experts_usage_read), NULL = none */
    int split;             /* 1: byte-split (version 2): every expert over every drive */
    uint64_t align;        /* split: cut alignment in bytes (a power of two), 0 = 4096 */
} k3_place_input;

/* Builds a placement: per MoE layer, experts in descending expected use
 * (usage + 1; ties by id) each go to the drive whose (use so far + its
 * own) / weight is lowest (ties: lowest index). With no history and equal
 * weights this deals the ids round robin; a drive of twice the weight holds
 * twice the experts; the hottest experts of a layer land on different
 * drives. */
k3_status k3_placement_build(k3_placement **out, const k3_place_input *in, char *err,
                             size_t errlen);

/* Writes the JSON to path (via path.tmp + rename). */
k3_status k3_placement_save(const k3_placement *p, const char *path, char *err, size_t errlen);

/* Reads and validates the file on its own: format, version, sizes against
 * the limits, every MoE layer's ids each on exactly one drive (an id on
 * two drives, claimed twice, missing or out of range is refused naming the
 * layer, the expert and the drives). */
k3_status k3_placement_load(k3_placement **out, const char *path, char *err, size_t errlen);

/* Checks a loaded placement against the model a process runs: the
 * fingerprint (another model's placement is refused naming both), the
 * layer and expert counts, and that every MoE layer [layer_a, layer_b) of
 * is_moe is placed. */
k3_status k3_placement_check(const k3_placement *p, uint64_t fingerprint, int n_layers,
                             int n_experts, const uint8_t *is_moe, int layer_a, int layer_b,
                             char *err, size_t errlen);

void k3_placement_free(k3_placement **p);

const char *k3_placement_path(const k3_placement *p); /* the file it was loaded from, or "" */
uint64_t k3_placement_fingerprint(const k3_placement *p);
int k3_placement_drives(const k3_placement *p);
const char *k3_placement_drive_path(const k3_placement *p, int d);
double k3_placement_drive_weight(const k3_placement *p, int d);
/* 1: a byte-split placement (version 2). */
int k3_placement_split(const k3_placement *p);
uint64_t k3_placement_align(const k3_placement *p); /* split: cut alignment, bytes */
/* Split: drive d's piece [*lo, *hi) (absolute file offsets) of a span
 * [off, off + len): cut k (1..N-1) at off + round(len * W_k / W), W_k the
 * weights of drives < k, W all of them, aligned down to `align` and
 * clamped into the span; cut 0 = off, cut N = off + len. *lo == *hi: drive
 * d holds none of it. Writer and reader call this with the same spans. */
void k3_placement_piece(const k3_placement *p, int d, uint64_t off, uint64_t len, uint64_t *lo,
                        uint64_t *hi);
/* Drive holding expert e of layer, -1 for a layer that is not placed (and
 * for every expert of a split placement). */
int k3_placement_drive_of(const k3_placement *p, int layer, int e);
/* Experts of layer on drive d (0 for a layer not placed or a split placement). */
int k3_placement_count(const k3_placement *p, int layer, int d);
/* <drive path>/k3-stripe/<shard_name> into buf; K3_ERR_LIMIT when it does
 * not fit. */
k3_status k3_placement_file_path(const k3_placement *p, int d, const char *shard_name, char *buf,
                                 size_t n, char *err, size_t errlen);

/* The drive files' completion records (<drive>/k3-stripe/.done, one line
 * "HASH SIZE NAME" per complete file; `k3-coordinator place` and `repack
 * --placement` write and honour the same ones). HASH: FNV-1a over the file
 * size, then each byte range (offset, length) of experts the file holds,
 * ranges merged where they touch and in offset order. */
uint64_t k3_placement_hash_init(uint64_t size);
uint64_t k3_placement_hash_range(uint64_t hash, uint64_t off, uint64_t len);
/* 1 when <dir>/.done holds the record. */
int k3_placement_done_has(const char *dir, uint64_t hash, uint64_t size, const char *name);
/* Appends the record to <dir>/.done, fsynced. */
k3_status k3_placement_done_add(const char *dir, uint64_t hash, uint64_t size, const char *name,
                                char *err, size_t errlen);

#endif
