/* tests/engine_fixture.h: the engine options the engine tests share
 * (test_engine, test_engine_cancel, test_ckpt): the tiny checkpoint with the
 * default numerics (4/8/8, idot), one thread, a 1 GB expert budget and no
 * usage history, so their runs are comparable bit for bit. */
#ifndef K3_TESTS_ENGINE_FIXTURE_H
#define K3_TESTS_ENGINE_FIXTURE_H

#include <string.h>

#include "common/engine/engine_opts.h"
#include "tests/test.h"

static inline void t_engine_opts_tiny(k3_engine_opts *eng) {
    memset(eng, 0, sizeof *eng);
    eng->model = (char *)t_tiny_dir();
    eng->bits = 4;
    eng->mla_bits = 8;
    eng->head_bits = 8;
    eng->idot = 1;
    eng->threads = 1;
    eng->expert_gb = 1;
    eng->direct = 1;
    eng->pipe = 1;
    eng->load_threads = 2;
    eng->usage = "off";
}

#endif
