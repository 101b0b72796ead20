#!/usr/bin/env bash
# tests/integration/test_tiktoken.sh: the C tokenizer against the real
# tiktoken (the WASM core of the npm package pinned in tests/tok/), id for id.
#
# Cases (tests/tok/oracle.cjs): the 18 corpus strings of docs/INTERFACES.md 1.7,
# 500 seeded random strings (scripts, emoji, CRLF, digits, contractions,
# invalid bytes) and a 1 MB text. Configurations:
#   1. o200k_base ranks + the Kimi split regex (custom Tiktoken)
#   2. o200k_base ranks + o200k's own regex (the BPE core on a 200k vocab)
#   3. the tiny checkpoint's tiktoken.model + the Kimi regex
# The C side (build/tests/test_tokenizer --ctest) also checks
# decode(encode(x)) == x, that the streaming decoder emits valid UTF-8 only,
# and prints and bounds the 1 MB encode time (< 1 s).
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
TINY=${TINY:-$BUILD/fixtures/tiny}
BIN=$BUILD/tests/test_tokenizer
W=$(mktemp -d /tmp/k3_tiktoken.XXXXXX)
trap 'rm -rf "$W"' EXIT

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "not ok - node/npm not found (make deps installs them)"
    exit 1
fi
if [ ! -x "$BIN" ]; then
    echo "not ok - $BIN not built (make tests-bin)"
    exit 1
fi
if ! (cd tests/tok && npm ci --no-audit --no-fund --loglevel=error) >"$W/npm.log" 2>&1; then
    echo "not ok - npm ci in tests/tok failed:"
    sed 's/^/# /' "$W/npm.log"
    exit 1
fi
ORACLE="node tests/tok/oracle.cjs"
$ORACLE o200k-model "$W/o200k.model" || { echo "not ok - o200k ranks export"; exit 1; }
$ORACLE cases "$W/cases.bin" || { echo "not ok - case generation"; exit 1; }

run_config() {  # label model pattern
    local label=$1 model=$2 pat=$3
    if ! $ORACLE expect "$model" "$pat" "$W/cases.bin" "$W/exp.txt"; then
        echo "not ok - $label: tiktoken failed"
        return
    fi
    "$BIN" --ctest "$model" "$pat" "$W/cases.bin" "$W/got.txt" | sed "s|$W/||"
    $ORACLE compare "$W/exp.txt" "$W/got.txt" "$label" "$W/cases.bin"
}

run_config "o200k_base ranks + Kimi regex" "$W/o200k.model" kimi
run_config "o200k_base ranks + o200k regex" "$W/o200k.model" o200k
if [ -f "$TINY/tiktoken.model" ]; then
    run_config "tiny checkpoint vocab + Kimi regex" "$TINY/tiktoken.model" kimi
else
    echo "skip - tiny checkpoint vocab + Kimi regex: skipped: $TINY/tiktoken.model does not exist (make tiny)"
fi
