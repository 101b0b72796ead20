/* common/base/arena.h: a bump allocator over one caller-owned buffer, the
 * scratch memory of a layer call. The layers size it up front with their
 * *_scratch_bytes functions (common/layers/layers.h) and reset it per layer
 * (used = 0), so the forward pass never calls malloc.
 *
 * Owns: nothing (base belongs to whoever owns the arena).
 * Threads: one arena per caller; not shared between threads.
 */
#ifndef K3_ARENA_H
#define K3_ARENA_H

#include <stddef.h>

typedef struct k3_arena {
    unsigned char *base; /* owned by whoever owns the arena */
    size_t cap;          /* bytes */
    size_t used;         /* bytes */
} k3_arena;

/* Returns 64-byte aligned memory; K3_ASSERTs that the arena was sized by the
 * matching *_scratch_bytes function (an overflow is a bug, not bad input). */
void *k3_arena_alloc(k3_arena *a, size_t bytes);
#define K3_ARENA_F(a, n) ((float *)k3_arena_alloc((a), sizeof(float) * (size_t)(n)))
/* Rounded size of one allocation, for *_scratch_bytes sums. */
size_t k3_arena_round(size_t bytes);

#endif
