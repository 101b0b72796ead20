#!/usr/bin/env bash
# tests/integration/test_cluster_shards.sh: a worker opens only the shards
# that hold its layers (ARCHITECTURE.md: "opens only the shard files that
# hold its layers"; the embedding / head shard and the vision shard never),
# and the coordinator of a cluster opens only the global tensors' shard.
# Proven with strace -ff (one trace file per process): the set of
# *.safetensors paths each process opens is compared with the set the
# checkpoint's index.json assigns to its layers.
set -u
. "$(dirname "$0")/../lib.sh"
need_strace "per-process shard opens under strace"
need_bins "$W" "$C"
[ -f "$TINY/model.safetensors.index.json" ] || { echo "not ok - $TINY has no index.json"; exit 1; }
make_tmp k3shards

# shards the index assigns to layers [a, b) ("global" = no layer prefix)
expected() {  # a b | global
    /usr/bin/python3 - "$TINY" "$@" <<'PY'
import json, re, sys
d = sys.argv[1]
m = json.load(open(d + "/model.safetensors.index.json"))["weight_map"]
out = set()
for name, f in m.items():
    g = re.match(r"(language_model\.)?model\.layers\.(\d+)\.", name)
    if sys.argv[2] == "global":
        if not g and re.match(r"(language_model\.)?(model\.(embed_tokens|norm)|lm_head|model\.w_out)", name):
            out.add(f)
    elif g and int(sys.argv[2]) <= int(g.group(2)) < int(sys.argv[3]):
        out.add(f)
print(" ".join(sorted(out)))
PY
}
# shards a trace file opened successfully
opened() {  # trace-file
    grep -E 'open(at)?\(.*\.safetensors"' "$1" | grep -v ' = -1 ' |
        sed -E 's/.*"([^"]*\.safetensors)".*/\1/' | xargs -r -n1 basename | sort -u | tr '\n' ' ' |
        sed 's/ $//'
}

# 1. a worker alone, drive benchmark on (it reads shards too)
for range in "2 4" "0 1" "5 8"; do
    set -- $range
    rm -f "$T"/w.*
    strace -ff -e trace=open,openat -o "$T/w" "$W" --model "$TINY" --layers "$1-$2" \
        --listen "ipc://$T/w.sock" --threads 1 >"$T/w.log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do grep -qs serving "$T/w.log" && break; sleep 0.05; done
    # strace -o blocks fatal signals: stop the worker itself (strace's child)
    wpid=$(ps -o pid= --ppid $pid | tr -d ' ')
    [ -n "$wpid" ] && kill -TERM $wpid
    wait $pid
    rc=$?
    want=$(expected "$1" "$2")
    got=$(cat "$T"/w.* 2>/dev/null | opened /dev/stdin)
    all=$(ls "$TINY"/*.safetensors | wc -l)
    if [ "$rc" -eq 0 ] && [ -n "$want" ] && [ "$got" = "$want" ]; then
        ok "worker [$1, $2) opened only its shards ($got) of $all, benchmark included"
    else
        bad "worker [$1, $2): opened '$got', expected '$want' (exit $rc)"
    fi
done

# 2. a coordinator with 2 local workers: each process's own set
rm -f "$T"/c.*
strace -ff -s 256 -v -e trace=open,openat,execve -o "$T/c" "$C" --model "$TINY" --ids 5,7,9 --ngen 2 \
    --local 2 --threads 1 >"$T/c.out" 2>"$T/c.log"
rc=$?
own=1
summary=""
for f in "$T"/c.*; do
    case "$f" in *.out|*.log) continue ;; esac
    got=$(opened "$f")
    [ -z "$got" ] && continue
    if grep -q 'execve(".*k3-worker"' "$f"; then
        layers=$(grep -o -- '"--layers", "[0-9]*-[0-9]*"' "$f" | head -1 |
            sed -E 's/.*"([0-9]+-[0-9]+)"/\1/')
        want=$(expected "${layers%-*}" "${layers#*-}")
        who="worker $layers"
    else
        want=$(expected global)
        who="coordinator"
    fi
    summary="$summary $who: $got;"
    [ "$got" = "$want" ] || { own=0; echo "# $who opened '$got', expected '$want'"; }
done
if [ "$rc" -eq 0 ] && [ "$own" -eq 1 ] && [ -n "$summary" ]; then
    ok "cluster run: every process opened only its own shards:$summary"
else
    bad "cluster run (exit $rc):$summary"
    tail -5 "$T/c.log" | sed 's/^/# /'
fi
exit $fail
