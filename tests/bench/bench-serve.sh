#!/usr/bin/env bash
# tests/bench/bench-serve.sh: what `k3-coordinator serve` delivers
# (`make bench-serve`). Printed, not asserted. On a slice checkpoint (real
# K3 dimensions), for WORKERS local worker processes (default "1 2 4") and
# CONVS concurrent conversations (default "1 2 4") over /v1/completions:
#   - turn 1: every conversation streams NGEN tokens (default 8) after a
#     prompt of about PROMPT words (default 48); aggregate tokens/s (all
#     conversations' completion tokens over the wall time of the turn) and
#     the median time to first token;
#   - turn 2: each conversation sends turn 1's prompt + its answer + a new
#     sentence; the reuse saving is 1 - prefilled / prompt tokens, from
#     usage.prompt_tokens_details.cached_tokens (a session cannot step back,
#     so an answer whose text re-tokenizes differently from the sampled ids
#     is not reused: random weights sample such ids often, a trained model
#     rarely; docs/SERVING.md "Sessions").
# The server keeps --ckpt 4 turn checkpoints (in-process, or on the workers
# since protocol 1.2), so turn 2 restores the end of turn 1's prompt
# whatever the answer's tokenization. WORKERS may name 0: the layers
# in-process.
# SHORT=1: a quicker run for a small shared machine: WORKERS "2 4", CONVS
# "1 2", NGEN 4, PROMPT 24, and (unless SLICE is given) a slice of 4 layers
# with 8 experts per layer ($CACHE/slice-short, generated when missing).
# Every configuration loads the model again (the slice's load-time
# quantization takes minutes on a small machine).
# SLICE=dir picks the checkpoint (default $CACHE/slice, generated when
# missing: `make slice`). The configurations run one after another: on a
# shared machine compare rows of one run, not runs.
set -euo pipefail
BUILD=${BUILD:-build}
CACHE=${CACHE:-$HOME/.cache/k3shard}
cd "$(dirname "$0")/../.."
GEN_ARGS=()
if [ "${SHORT:-0}" = 1 ]; then
    SLICE=${SLICE:-$CACHE/slice-short}
    GEN_ARGS=(--layers 4 --experts 8)
    WORKERS=${WORKERS:-2 4}
    CONVS=${CONVS:-1 2}
    NGEN=${NGEN:-4}
    PROMPT=${PROMPT:-24}
fi
SLICE=${SLICE:-$CACHE/slice}
if [ ! -f "$SLICE/config.json" ]; then
    echo "bench-serve: generating the slice checkpoint in $SLICE"
    /usr/bin/python3 tests/fixtures/k3_gen.py --profile slice "${GEN_ARGS[@]}" --out "$SLICE"
fi
C=$BUILD/k3-coordinator
[ -x "$C" ] && [ -x "$BUILD/k3-worker" ] || make --no-print-directory all
WORKERS=${WORKERS:-1 2 4}
CONVS=${CONVS:-1 2 4}
NGEN=${NGEN:-8}
PROMPT=${PROMPT:-48}
THREADS=${THREADS:-$(nproc)}
T=$(mktemp -d "${TMPDIR:-/tmp}/k3bench_serve.XXXXXX")
SRV=
cleanup() {
    [ -n "$SRV" ] && kill -TERM "$SRV" 2>/dev/null && wait "$SRV" 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT

free_port() { /usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }

echo "bench-serve: $SLICE, prompt ~$PROMPT words, $NGEN tokens per turn, $THREADS threads per worker, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-8s %-6s %12s %10s %12s %12s\n" workers convs "agg tok/s" "ttft ms" "turn2 prompt" "reuse saving"
for w in $WORKERS; do
    P=$(free_port)
    # the slice's load-time quantization can pass the default 10-minute
    # registration wait on a loaded machine: READY_S (default 3600) bounds it
    "$C" serve --model "$SLICE" --local "$w" --port "$P" --max-queue 4 --max-sessions 8 --ctx 1024 --ckpt 4 \
        --threads "$THREADS" --max-tokens "$NGEN" --ready-timeout-ms $((${READY_S:-3600} * 1000)) \
        >"$T/out" 2>"$T/err" &
    SRV=$!
    for _ in $(seq 1 $((${READY_S:-3600} * 10))); do
        grep -q "^serving on" "$T/out" && break
        kill -0 "$SRV" 2>/dev/null || break
        sleep 0.1
    done
    if ! grep -q "^serving on" "$T/out"; then
        echo "bench-serve: --local $w did not start: $(tail -2 "$T/err")"
        SRV=
        continue
    fi
    for c in $CONVS; do
        /usr/bin/python3 - "$P" "$c" "$NGEN" "$PROMPT" "$w" <<'EOF'
import json, statistics, sys, threading, time, urllib.request
port, conv, ngen, words, workers = (int(x) for x in sys.argv[1:])
url = "http://127.0.0.1:%d/v1/completions" % port
base = ("the river keeps a record of every storm that passed over the valley and "
        "the old mill counts the seasons by the sound of its wheel ").split()

def stream(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": ngen, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    t0 = time.time(); ttft = None; text = ""; usage = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            o = json.loads(line[6:])
            if o.get("usage"):
                usage = o["usage"]
            for ch in o.get("choices", []):
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.time() - t0
                    text += ch["text"]
    return text, ttft, usage

def turn(prompts):
    out = [None] * len(prompts)
    def run(i):
        out[i] = stream(prompts[i])
    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    t0 = time.time()
    for t in ts: t.start()
    for t in ts: t.join()
    return out, time.time() - t0

p1 = ["conversation %d: " % k + " ".join(base[(k + i) % len(base)] for i in range(words))
      for k in range(conv)]
r1, wall = turn(p1)
toks = sum(u["completion_tokens"] for _, _, u in r1)
ttfts = [t for _, t, _ in r1 if t is not None]
p2 = [p1[k] + r1[k][0] + " Then the wind turned." for k in range(conv)]
r2, _ = turn(p2)
prompt2 = sum(u["prompt_tokens"] for _, _, u in r2)
cached = sum(u["prompt_tokens_details"]["cached_tokens"] for _, _, u in r2)
print("%-8d %-6d %12.2f %10.0f %12d %11.1f%%" % (
    workers, conv, toks / wall, 1000 * statistics.median(ttfts) if ttfts else -1,
    prompt2 // conv, 100.0 * cached / prompt2 if prompt2 else 0))
EOF
    done
    kill -TERM "$SRV"
    wait "$SRV" || true
    SRV=
done
