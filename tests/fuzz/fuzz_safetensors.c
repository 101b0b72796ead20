/* tests/fuzz/fuzz_safetensors.c: libFuzzer target for the safetensors header
 * parser (docs/TESTING.md S10). The input is a whole shard file: the 8-byte
 * length, the header and the data section, so every check from the length
 * prefix (S1) to the layout (S4) is reachable. Run by `make fuzz` under
 * ASan + UBSan with -malloc_limit_mb, which also catches any allocation
 * sized by an unchecked header length. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/ckpt/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[512];
    int n = -1;
    k3_status st = st_parse_header_mem(data, size, size, "fuzz.safetensors", &n, err, sizeof err);
    /* every failure must come with a message; success with a count */
    if (st != K3_OK && err[0] == 0) __builtin_trap();
    if (st == K3_OK && n < 0) __builtin_trap();
    /* the conversions take any bit pattern */
    if (size >= 2) {
        uint16_t h;
        memcpy(&h, data, 2);
        volatile float a = st_f16_to_f32(h), b = st_bf16_to_f32(h);
        (void)a, (void)b;
    }
    return 0;
}
