/* common/engine/stage.h: run a layer range [a, b) of the model on a chunk of T
 * consecutive tokens of one session: the unit of work of a worker and of the
 * in-process path alike (ARCHITECTURE.md "One forward step").
 *
 * The boundary state between stages is exactly (B, h): the AttnRes block list
 * B [nb][T][D] (snapshots taken so far, b0 = the embedding) and the hidden h
 * [T][D] (the running prefix p). AttnRes keeps nothing across tokens, so
 * nothing else crosses a stage boundary. k3_stage_forward appends the
 * snapshots its layers take to B (nb grows) and replaces h.
 *
 * k3_state holds one session's sequential state for the model's layer range:
 * per KDA layer the recurrent S [heads][hd][hd] and the q/k/v conv windows,
 * per MLA layer the latent + rope cache [max_ctx][kv_lora + qk_rope]. A
 * session's tokens must be fed in order: pos0 must equal k3_state_pos().
 *
 * Chunked prefill semantics (docs/MODEL.md 5.2): dense matmuls batched over T, experts
 * deduplicated over the chunk and applied in disk-offset order, recurrences
 * sequential per token. Results are bit-identical for every T split.
 *
 * Threads: one call at a time per k3_state; calls on different states may
 * run at once from different threads on the same model, at the same or at
 * different layers. A forward holds no model-wide lock: its pool jobs take
 * turns with the other callers' job by job and its MoE layers share the
 * expert store's slots (model.h "Threads"), so the sessions make progress
 * together, and each gets the bits it gets alone.
 */
#ifndef K3_STAGE_H
#define K3_STAGE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/base/err.h"
#include "common/engine/model.h"

typedef struct k3_state k3_state;

/* max_ctx: capacity in tokens (MLA cache rows), <= K3_MAX_CTX. */
k3_status k3_state_open(k3_state **out, const k3_model *m, int max_ctx, char *err, size_t errlen);
void k3_state_close(k3_state **s);
void k3_state_reset(k3_state *s);    /* back to position 0, all zero */
int k3_state_pos(const k3_state *s); /* tokens consumed so far */
int k3_state_max_ctx(const k3_state *s);
size_t k3_state_bytes(const k3_state *s);

/* Turn checkpoints. A checkpoint holds what a state cannot recompute when
 * it steps back to an earlier position p: every KDA layer's S and conv
 * windows at p. The MLA cache needs no copy: rows are written at positions
 * >= pos only, so rows [0, p) are still those of p as long as the state has
 * not been reset since (the caller drops its checkpoints at every reset).
 * k3_state_restore(s, ck) brings s back to ck's position, which must not be
 * past s's own; a restored state continues bit-identically to one that was
 * fed the same ids from 0. */
typedef struct k3_state_ckpt k3_state_ckpt;
k3_status k3_state_save(const k3_state *s, k3_state_ckpt **out, char *err, size_t errlen);
k3_status k3_state_restore(k3_state *s, const k3_state_ckpt *ck, char *err, size_t errlen);
void k3_state_ckpt_free(k3_state_ckpt **ck);
int k3_state_ckpt_pos(const k3_state_ckpt *ck);
size_t k3_state_ckpt_bytes(const k3_state_ckpt *ck);

/* The whole state at its position as bytes (a checkpoint parked on disk,
 * coordinator/ckpt_dir.h): per layer of the range in order, a KDA layer's
 * S then conv windows, an MLA layer's latent rows [0, pos) then rope rows
 * [0, pos), f32 in host order. k3_state_dump_bytes(s, pos) is the size of
 * such a dump of a state of s's model at pos. k3_state_load reads one of
 * exactly that size for position pos into s (reset first; MLA rows are
 * reserved, so pos <= the state's max_ctx); a loaded state continues
 * bit-identically to one that was fed the same ids from 0. Errors name the
 * file's bytes and what was expected. */
uint64_t k3_state_dump_bytes(const k3_state *s, int pos);
k3_status k3_state_dump(const k3_state *s, FILE *f, char *err, size_t errlen);
k3_status k3_state_load(k3_state *s, FILE *f, int pos, char *err, size_t errlen);

/* Per-step statistics (summed over the stage's layers). */
typedef struct k3_step_stats {
    double compute_ms;      /* wall time in layer math */
    double read_ms;         /* time waiting on expert reads */
    uint64_t bytes_read;    /* expert bytes read from disk */
    uint64_t expert_hits;   /* expert lookups served from cache */
    uint64_t expert_misses; /* expert lookups that read from disk */
} k3_step_stats;

/* Optional per-layer hook (K3_TRACE / --trace): called after layer i with the
 * layer's output h [T][D]. */
typedef void (*k3_trace_fn)(void *ctx, int layer, int pos0, int T, const float *h);

/* Runs layers [a, b) on T tokens at positions [pos0, pos0 + T).
 *   blocks: capacity [K3_MAX_RES_ENTRIES][T][D]; [*nb][T][D] valid on entry,
 *           [*nb + k][T][D] on return (k = snapshots taken in [a, b)).
 *   h:      [T][D] in/out.
 * On error the state is left unusable for this session (caller resets). */
k3_status k3_stage_forward(k3_model *m, k3_state *s, int pos0, int T, float *blocks, int *nb,
                           float *h, k3_step_stats *stats, k3_trace_fn trace, void *trace_ctx,
                           char *err, size_t errlen);

/* Cancellation hook: when *cancel becomes non-zero, k3_stage_forward stops
 * before its next layer and returns K3_ERR_CANCEL (the state is then
 * unusable until k3_state_reset). NULL disables. The pointer is borrowed. */
void k3_stage_set_cancel(k3_state *s, const atomic_int *cancel);

#endif
