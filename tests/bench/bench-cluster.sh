#!/usr/bin/env bash
# tests/bench/bench-cluster.sh: what the cluster costs (`make bench-cluster`).
# Printed, not asserted. On a slice checkpoint (real K3 dimensions), the
# same prompt and generation with --local 0 (every layer in the
# coordinator) and with --local 2 (two worker processes over ipc://):
#   decode ms/token, prefill tokens/s, the overhead of the cluster on both,
#   per-hop latency (round trip minus the worker's own time) and the bytes
#   each token puts on the wire, per stage, from --stats.
# Both runs get the same expert budget (split over the local workers) and
# every worker gets all the threads (stages of one stream alternate). The
# configurations alternate (single, cluster, single, ...: PASSES, default 3)
# and each reports its median pass by decode ms/token, with the overhead of
# each pass pair: on a shared machine another job's load drifts by more
# than the cluster costs, so one pair proves little.
# SLICE=dir picks the checkpoint (default $CACHE/slice, or
# /tmp/k3slice_stage when present; generated when missing). PROMPT (tokens,
# default 256) and NGEN (default 32) size the run.
set -euo pipefail
BUILD=${BUILD:-build}
CACHE=${CACHE:-$HOME/.cache/k3shard}
cd "$(dirname "$0")/../.."
SLICE=${SLICE:-}
if [ -z "$SLICE" ]; then
    if [ -f /tmp/k3slice_stage/config.json ]; then SLICE=/tmp/k3slice_stage
    else SLICE=$CACHE/slice; fi
fi
if [ ! -f "$SLICE/config.json" ]; then
    echo "bench-cluster: generating the slice checkpoint in $SLICE"
    /usr/bin/python3 tests/fixtures/k3_gen.py --profile slice --out "$SLICE"
fi
C=$BUILD/k3-coordinator
[ -x "$C" ] && [ -x "$BUILD/k3-worker" ] || make --no-print-directory all
PROMPT=${PROMPT:-256}
NGEN=${NGEN:-32}
vocab=$(/usr/bin/python3 -c "import json,sys; c=json.load(open('$SLICE/config.json')); print(c.get('text_config', c)['vocab_size'])")
IDS=$(/usr/bin/python3 -c "import random; r=random.Random(3); print(','.join(str(r.randrange(1024, $vocab - 256)) for _ in range($PROMPT)))")
T=$(mktemp -d "${TMPDIR:-/tmp}/k3bench.XXXXXX")
trap 'rm -rf "$T"' EXIT

run() {  # name local pass
    local name=$1 L=$2 pass=$3
    K3_LOG=info "$C" --model "$SLICE" --ids "$IDS" --ngen "$NGEN" --chunk 32 --local "$L" \
        --stats --print-ids >"$T/$name.$pass.out" 2>"$T/$name.$pass.err" ||
        { echo "bench-cluster: --local $L failed:"; tail -5 "$T/$name.$pass.err"; exit 1; }
}
median() {  # name: the median pass by decode ms/token becomes $name.out/.err
    local name=$1 p mp
    mp=$(for p in $(seq "$PASSES"); do echo "$(dec "$T/$name.$p.err") $p"; done |
         sort -g | awk '{ v[NR] = $2 } END { print v[int((NR + 1) / 2)] }')
    cp "$T/$name.$mp.out" "$T/$name.out"
    cp "$T/$name.$mp.err" "$T/$name.err"
    echo "  $name: pass $mp of $PASSES reported (the median); decode ms/token by pass:$(
        for p in $(seq "$PASSES"); do printf ' %s' "$(dec "$T/$name.$p.err")"; done)" >"$T/$name.note"
}
num() {  # file pattern field-regex
    grep -o "$2" "$1" | tail -1 | grep -o "$3" | head -1 | grep -o '[0-9.]*' | head -1
}
dec() { num "$1" 'decode: [0-9]* tokens in [0-9.]* ms ([0-9.]* ms/token' '([0-9.]* ms/token'; }
PASSES=${PASSES:-3}
for pass in $(seq "$PASSES"); do
    run single 0 "$pass"
    run cluster 2 "$pass"
done
median single
median cluster
same=$(cmp -s <(grep ids: "$T/single.out") <(grep ids: "$T/cluster.out") && echo yes || echo NO)
p0=$(num "$T/single.err" 'prefill: [0-9]* tokens in [0-9.]* ms ([0-9.]* tok/s)' '([0-9.]* tok/s')
p2=$(num "$T/cluster.err" 'prefill: [0-9]* tokens in [0-9.]* ms ([0-9.]* tok/s)' '([0-9.]* tok/s')
d0=$(num "$T/single.err" 'decode: [0-9]* tokens in [0-9.]* ms ([0-9.]* ms/token' '([0-9.]* ms/token')
d2=$(num "$T/cluster.err" 'decode: [0-9]* tokens in [0-9.]* ms ([0-9.]* ms/token' '([0-9.]* ms/token')
echo "bench-cluster: $SLICE, prompt $PROMPT tokens, $NGEN generated, chunk 32, $(nproc) cores"
printf '  %-22s %14s %16s\n' "" "--local 0" "--local 2"
printf '  %-22s %14s %16s\n' "prefill tokens/s" "$p0" "$p2"
printf '  %-22s %14s %16s\n' "decode ms/token" "$d0" "$d2"
awk -v a="$d0" -v b="$d2" -v c="$p0" -v d="$p2" 'BEGIN {
    if (a > 0) printf "  decode overhead        %+.1f %% (target <= 3 %%)\n", (b - a) / a * 100;
    if (d > 0) printf "  prefill time overhead  %+.1f %%\n", (c / d - 1) * 100 }'
echo "  same generated ids: $same"
cat "$T/single.note" "$T/cluster.note"
printf '  decode overhead of each pass pair:'
for p in $(seq "$PASSES"); do
    awk -v a="$(dec "$T/single.$p.err")" -v b="$(dec "$T/cluster.$p.err")" \
        'BEGIN { printf " %+.1f %%", (b - a) / a * 100 }'
done
echo
echo "  per stage (--stats of the --local 2 run):"
grep '^  stage ' "$T/cluster.err" | sed 's/^/  /'
grep '^cluster: ' "$T/cluster.err" | sed 's/^/  /'
