#!/usr/bin/env bash
# tests/bench/bench-ckpt-dir.sh: what a turn checkpoint parked on disk
# (`serve --ckpt-dir`, docs/SERVING.md "Parked on disk") costs and saves
# against a full prefill. Printed, not asserted. One server
# (--local LOCAL, default 2; --max-sessions 1 so that another conversation
# evicts the first one's state from the workers' memory):
#   1. warm-up: an unrelated prompt (expert caches, page cache);
#   2. full: prompt P (~WORDS words, default 200) from nothing, max_tokens 1:
#      the wall time of a full prefill (and the checkpoint parked after it);
#   3. another prompt takes the only session (P's state and its in-memory
#      checkpoints are dropped on every worker);
#   4. restore: P plus one sentence: the coordinator finds its file, every
#      worker loads its part from its --ckpt-dir (RESTORE by key) and only
#      the sentence is prefilled; cached_tokens must equal P's tokens.
# Prints both wall times, the workers' own park and load times (their log
# lines) and the bytes parked. MODEL (default the tiny fixture; a slice:
# MODEL=$HOME/.cache/k3shard/slice-l5e24, whose load takes minutes),
# THREADS (default 1). Expected run time: ~5 s on tiny, the model's load
# plus ~1 min on a slice.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-$BUILD/fixtures/tiny}
LOCAL=${LOCAL:-2}
WORDS=${WORDS:-200}
THREADS=${THREADS:-1}
C=$BUILD/k3-coordinator
[ -x "$C" ] && [ -x "$BUILD/k3-worker" ] || make --no-print-directory all
T=$(mktemp -d "${TMPDIR:-/tmp}/k3bench_ckpt_dir.XXXXXX")
SRV=
cleanup() {
    [ -n "$SRV" ] && kill -TERM "$SRV" 2>/dev/null && wait "$SRV" 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT
PY=/usr/bin/python3
P=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
words() { # N SEED
    $PY -c "import random; r=random.Random($2)
w='river stone lamp cloud apple tiger violin copper meadow candle orbit glacier'.split()
print(' '.join(r.choice(w) for _ in range($1)) + '.')"
}
# req NAME PROMPT: /v1/completions, max_tokens 1; prints "ms prompt_tokens cached"
req() {
    $PY -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 1,
        "temperature": 0}))' "$2" >"$T/$1.req"
    local t0 t1
    t0=$(date +%s%N)
    curl -s --max-time 3600 -H "Content-Type: application/json" -d @"$T/$1.req" \
        "http://127.0.0.1:$P/v1/completions" >"$T/$1"
    t1=$(date +%s%N)
    $PY -c 'import json,sys; j=json.load(open(sys.argv[1])); u=j["usage"]
print(sys.argv[2], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])' \
        "$T/$1" $(((t1 - t0) / 1000000))
}
K3_LOG=info "$C" serve --model "$MODEL" --local "$LOCAL" --port "$P" --threads "$THREADS" \
    --ctx 8192 --ckpt 2 --ckpt-dir "$T/ckpt" --max-sessions 1 --parallel 1 --max-queue 2 \
    --ready-timeout-ms 3600000 >"$T/out" 2>"$T/err" &
SRV=$!
for _ in $(seq 1 36000); do
    grep -q "^serving on" "$T/out" && break
    kill -0 "$SRV" 2>/dev/null || break
    sleep 0.1
done
grep -q "^serving on" "$T/out" || {
    echo "bench-ckpt-dir: the server did not start: $(tail -2 "$T/err")"
    exit 1
}
PROMPT=$(words "$WORDS" 1)
echo "bench-ckpt-dir: $MODEL, --local $LOCAL, --threads $THREADS, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M) UTC"
read -r _ _ _ < <(req warm "$(words "$WORDS" 2)")
read -r ms_full n_full c_full < <(req full "$PROMPT")
read -r _ _ _ < <(req other "$(words 12 3)")
read -r ms_rest n_rest c_rest < <(req restore "$PROMPT And then the lamp was gone.")
park=$(grep -o "at $n_full parked: [0-9]* bytes in [0-9.]* ms" "$T/err" | sed 's/.*parked: //' | paste -sd, -)
load=$(grep -o "checkpoint at $c_rest loaded from [^ ]* in [0-9.]* ms" "$T/err" | sed 's/.* in //' | paste -sd, -)
bytes=$(du -sb "$T/ckpt" | cut -f1)
echo "full prefill of $n_full tokens (cached $c_full): $ms_full ms wall (max_tokens 1, the park included)"
echo "restore: $c_rest of $n_rest tokens from disk, $((n_rest - c_rest)) prefilled: $ms_rest ms wall"
echo "workers: parked in ${park:-?}; loaded in ${load:-?}; $bytes bytes in $T/ckpt"
[ "$c_rest" = "$n_full" ] || echo "bench-ckpt-dir: WARNING: $c_rest cached, expected $n_full: $(grep -E 'not loaded|refused' "$T/err" | tail -2)"
