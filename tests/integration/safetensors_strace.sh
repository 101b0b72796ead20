#!/usr/bin/env bash
# tests/integration/safetensors_strace.sh: docs/TESTING.md S7 under strace.
# A model dir whose index.json points outside it (../evil.safetensors, an
# absolute path, or a bare name that exists only next to the model dir) must
# be refused or resolve to nothing, and no open/openat/stat of the decoy file
# may ever happen. Uses `test_safetensors --open DIR`, which opens DIR, parses
# every shard and resolves every mapped tensor.
set -u
. "$(dirname "$0")/../lib.sh"
BIN=$BUILD/tests/test_safetensors
need_strace "S7 index.json paths under strace"
need_bins "$BIN"
make_tmp k3strace
mkdir -p "$T/model"
# a valid one-tensor shard: 8-byte length, header, 8 data bytes
shard() {  # path tensor-name
    /usr/bin/python3 - "$1" "$2" <<'PY'
import struct, sys
h = ('{"%s":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' % sys.argv[2]).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + bytes(8))
PY
}
shard "$T/evil.safetensors" evil.t
shard "$T/model/model-00001-of-00001.safetensors" ok.t

check() {  # map-value expected-status
    printf '{"weight_map":{"ok.t":"model-00001-of-00001.safetensors","evil.t":"%s"}}' "$1" \
        >"$T/model/model.safetensors.index.json"
    local out touched real
    out=$(strace -f -e trace=open,openat,stat,newfstatat,statx,access -o "$T/trace" \
        "$BIN" --open "$T/model")
    # No syscall may name the decoy. The index.json is read as data, so the
    # map's text never shows up as a path in the trace.
    touched=$(grep -c 'evil\.safetensors' "$T/trace")
    real=$(grep -c 'model-00001-of-00001\.safetensors' "$T/trace")
    if [[ "$out" == "status $2"* ]] && [ "$touched" -eq 0 ] && [ "$real" -ge 1 ]; then
        ok "S7 strace: weight_map '$1' -> $out; decoy never touched ($real syscalls on the real shard)"
    else
        bad "S7 strace: weight_map '$1' -> '$out', $touched syscalls naming the decoy"
        grep 'evil' "$T/trace" | head -5 | sed 's/^/# /'
    fi
}
check "../evil.safetensors" format
check "$T/evil.safetensors" format
check "evil.safetensors" missing
exit $fail
