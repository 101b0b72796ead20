/* tests/fuzz/fuzz_config.c: libFuzzer target for config.json parsing and
 * validation (k3_config_parse). Any input must give K3_OK with sane fields
 * or an error with a message; never a crash, a hang or an out-of-range
 * schedule. */
#include <stddef.h>
#include <stdint.h>

#include "common/ckpt/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_config cfg;
    char err[512];
    err[0] = 0;
    k3_status st = k3_config_parse(&cfg, (const char *)data, size, 0, err, sizeof err);
    if (st != K3_OK && err[0] == 0) __builtin_trap();
    if (st == K3_OK) {
        if (cfg.n_layers < 1 || cfg.n_layers > K3_MAX_LAYERS || cfg.topk > cfg.n_experts ||
            cfg.n_eos > K3_MAX_EOS)
            __builtin_trap();
        (void)k3_config_snapshots_before(&cfg, cfg.n_layers);
        (void)k3_config_fingerprint(&cfg);
    }
    return 0;
}
