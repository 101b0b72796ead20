/* common/base/arena.c: the bump allocator of arena.h. */
#include "common/base/arena.h"
#include "common/base/err.h"

size_t k3_arena_round(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

void *k3_arena_alloc(k3_arena *a, size_t bytes) {
    size_t n = k3_arena_round(bytes);
    /* Sizing is computed by the *_scratch_bytes functions from the config
     * and T; running past it is a bug in that arithmetic. */
    K3_ASSERT(a->used + n <= a->cap);
    void *p = a->base + a->used;
    a->used += n;
    return p;
}
