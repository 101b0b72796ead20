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
 * Not handled: truncation to an arbitrary position (no checkpoints in 1.0):
 * only "keep everything" and "keep nothing" are possible.
 */
#ifndef K3_WORKER_SESSIONS_H
#define K3_WORKER_SESSIONS_H

#include <stdint.h>

#include "common/base/err.h"
#include "common/engine/model.h"
#include "common/engine/stage.h"

typedef struct wk_sessions wk_sessions;

/* max_sessions in [1, K3_MAX_SESSIONS]; max_ctx: capacity of each state. */
k3_status wk_sessions_open(wk_sessions **out, const k3_model *m, int max_sessions, int max_ctx,
                           char *err, size_t errlen);
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

int wk_sessions_count(const wk_sessions *t);
uint64_t wk_sessions_evictions(const wk_sessions *t);

#endif
