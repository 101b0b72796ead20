/* worker/sessions.h: the worker's table of session states.
 *
 * Owns: up to max_sessions k3_state objects (KDA recurrent state, conv
 * windows and MLA latent cache for the worker's layer range), keyed by the
 * coordinator's session id, with least-recently-used eviction when a new
 * session arrives and the table is full. Evictions are returned to the
 * caller so that FORWARD_DONE can report them (PROTOCOL.md 4) and the
 * coordinator can rebuild the state by replay.
 * Borrows: the model (must outlive the table).
 * Threads: one thread (the worker's socket loop).
 *
 * Turn checkpoints (PROTOCOL.md "Checkpoints", 1.2): a slot also owns up to
 * K3_MAX_CKPT snapshots of its state (k3_state_ckpt: the KDA states at a
 * position; the MLA rows before it stay in the state), dropped with the
 * session (drop, reset, eviction, a new epoch) and past a restored
 * position. Their bytes count against one budget for the whole table.
 * With a store (--ckpt-dir, 1.3) a checkpoint that carries a key is parked
 * on disk too, and a RESTORE by key finds it there after the worker or the
 * coordinator restarted or the session was evicted.
 *
 * Not handled: truncation to an arbitrary position: TRUNCATE keeps
 * everything or nothing; RESTORE goes back to a checkpoint.
 */
#ifndef K3_WORKER_SESSIONS_H
#define K3_WORKER_SESSIONS_H

#include <stdint.h>

#include "common/base/err.h"
#include "common/engine/model.h"
#include "common/engine/stage.h"

typedef struct wk_sessions wk_sessions;
struct k3_ckpt_store;

/* max_sessions in [1, K3_MAX_SESSIONS]; max_ctx: capacity of each state;
 * ckpt_budget: bytes all checkpoints together may hold (0: none taken). */
k3_status wk_sessions_open(wk_sessions **out, const k3_model *m, int max_sessions, int max_ctx,
                           uint64_t ckpt_budget, char *err, size_t errlen);
void wk_sessions_close(wk_sessions **t);

/* The state of session id, positioned at pos0. A known session must be at
 * pos0 exactly; an unknown one is created when pos0 == 0 (evicting the least
 * recently used state when the table is full: *evicted = its id, else 0)
 * and refused otherwise. K3_ERR_STATE names the session and both positions. */
k3_status wk_sessions_acquire(wk_sessions *t, uint64_t id, int pos0, k3_state **out,
                              uint64_t *evicted, char *err, size_t errlen);

/* Returns 1 when the session existed. reset: back to position 0; drop:
 * frees the slot. */
int wk_sessions_reset(wk_sessions *t, uint64_t id);
int wk_sessions_drop(wk_sessions *t, uint64_t id);

/* Keeps the first n tokens: possible when n == 0 (reset) or n == the
 * session's position (nothing to do); K3_ERR_STATE otherwise, or when the
 * session is unknown and n > 0. */
k3_status wk_sessions_truncate(wk_sessions *t, uint64_t id, int n, char *err, size_t errlen);

/* Drops every state (a new epoch: the coordinator replays what it needs). */
void wk_sessions_clear(wk_sessions *t);

/* Checkpoints parked on disk too (--ckpt-dir; common/engine/ckpt_store.h,
 * this worker's fingerprint and layer range), borrowed; NULL = none. */
void wk_sessions_set_store(wk_sessions *t, struct k3_ckpt_store *store);

/* CHECKPOINT: snapshots session id, which must be at position pos; the
 * oldest checkpoints go first so that at most keep (1..K3_MAX_CKPT) are held
 * (the coordinator's count: both drop the same ones). Holding one at pos
 * already is a no-op. K3_ERR_STATE: unknown session or another position
 * (both named); K3_ERR_LIMIT: past the budget (nothing taken). key != 0
 * (1.3) with a store: the state is parked on disk under key first (a
 * failure to write is logged, not returned: it costs only a later load). */
k3_status wk_sessions_checkpoint(wk_sessions *t, uint64_t id, int pos, int keep, uint64_t key,
                                 char *err, size_t errlen);
/* RESTORE: session id back to its checkpoint at pos (bit-identical to a
 * replay of the ids to pos); later checkpoints are dropped. K3_ERR_STATE:
 * unknown session or no checkpoint at pos. key != 0 (1.3) with a store:
 * without a checkpoint in memory the file parked under key is loaded (the
 * session created when unknown, evicting as acquire does, else reset
 * first); a missing, damaged or foreign file is refused naming it, and
 * the session is left at position 0. */
k3_status wk_sessions_restore(wk_sessions *t, uint64_t id, int pos, uint64_t key, char *err,
                              size_t errlen);
/* Bytes the checkpoints hold now; *count (may be NULL) their number. */
uint64_t wk_sessions_ckpt_bytes(const wk_sessions *t, int *count);

int wk_sessions_count(const wk_sessions *t);
uint64_t wk_sessions_evictions(const wk_sessions *t);

#endif
