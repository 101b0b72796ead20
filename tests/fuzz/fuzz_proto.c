/* tests/fuzz/fuzz_proto.c: libFuzzer target for the protocol decoder
 * (docs/TESTING.md P8): pre-scan -> decode -> re-encode -> decode ->
 * compare. Run by `make fuzz` with -rss_limit_mb=512 -malloc_limit_mb=64,
 * so an allocation bomb that got past the pre-scan counts as a crash.
 *
 * Invariants checked (abort on violation, which libFuzzer reports):
 * - decode never accepts what the pre-scan rejects;
 * - whatever decodes re-encodes, and the re-encoding decodes to an equal
 *   message whose own encoding is byte-identical (canonical form);
 * - the frame layout of a decoded message is within the limits and
 *   proto_check_frames accepts exactly that layout, not one byte more;
 * - on failure the error message is a non-empty C string.
 * Seeds: tests/corpus/fuzz_proto (every message type, and the bombs).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static proto_msg a, b, c;
    static uint8_t enc1[PROTO_ENCODE_CAP], enc2[PROTO_ENCODE_CAP];
    char err[512];

    err[0] = 0;
    k3_status pre = proto_prescan(data, size, err, sizeof err);
    if (pre != K3_OK && (!err[0] || strlen(err) >= sizeof err)) abort();
    err[0] = 0;
    k3_status st = proto_decode(data, size, &a, err, sizeof err);
    if (st != K3_OK) {
        if (!err[0]) abort();
        return 0;
    }
    if (pre != K3_OK) abort();

    size_t n1, n2;
    if (proto_encode(&a, enc1, sizeof enc1, &n1, err, sizeof err) != K3_OK) abort();
    if (proto_decode(enc1, n1, &b, err, sizeof err) != K3_OK) abort();
    if (!proto_msg_equal(&a, &b)) abort();
    if (b.n_ignored != 0 || b.ver_major != PROTO_VERSION_MAJOR ||
        b.ver_minor != PROTO_VERSION_MINOR)
        abort();
    if (proto_encode(&b, enc2, sizeof enc2, &n2, err, sizeof err) != K3_OK) abort();
    if (n1 != n2 || memcmp(enc1, enc2, n1)) abort();
    if (proto_decode(enc2, n2, &c, err, sizeof err) != K3_OK || !proto_msg_equal(&b, &c)) abort();

    int nf;
    uint64_t bytes[K3_PROTO_MAX_FRAMES];
    if (proto_frame_layout(&a, &nf, bytes, err, sizeof err) != K3_OK) abort();
    if (nf < 0 || nf > K3_PROTO_MAX_FRAMES - 1) abort();
    size_t sizes[K3_PROTO_MAX_FRAMES];
    for (int i = 0; i < nf; i++) {
        if (bytes[i] > K3_PROTO_MAX_FRAME_BYTES) abort();
        sizes[i] = (size_t)bytes[i];
    }
    if (proto_check_frames(&a, sizes, nf, err, sizeof err) != K3_OK) abort();
    if (nf > 0) {
        sizes[nf - 1] += 1;
        if (proto_check_frames(&a, sizes, nf, err, sizeof err) == K3_OK) abort();
    }
    return 0;
}
