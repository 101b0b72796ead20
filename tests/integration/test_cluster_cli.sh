#!/usr/bin/env bash
# tests/integration/test_cluster_cli.sh: the k3-coordinator command line on
# the cluster path, compared byte for byte with --local 0.
#  - --all-logits files (teacher-forced logits of every prompt position) and
#    the generated ids are identical (cmp) for --local 1, 2, 3, 8 with
#    --chunk 1 and 32, with default and --exact numerics;
#  - the same with --workers over tcp://127.0.0.1 (workers started here,
#    listed out of layer order);
#  - layer ranges that leave a gap or overlap are refused with the layers
#    named; a worker started with other numerics is refused;
#  - a worker asked to pin to a NUMA node that does not exist warns and
#    serves unpinned, with identical results (docs/TESTING.md B7);
#  - keygen writes a 0600 secret and a public key, never overwrites; a
#    worker refuses a secret key file readable by others (docs/TESTING.md C6).
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3cli
export K3_LOG=warn
# the default usage history goes to the run's own cache, not the user's
export K3_CACHE_DIR="$T/cache"

# IDS, run NAME ARGS..., same A B (tests/lib.sh); `default`: no --usage, so
# the runs keep the default expert usage history as this script's always have
identity_runs 7 41 6 default

for num in "" "--exact"; do
    tag=${num:-default}
    run ref0 --local 0 --chunk 32 $num || bad "--local 0 $num: $(tail -1 "$T/ref0.err")"
    for chunk in 1 32; do
        for L in 1 2 3 8; do
            if run l$L --local $L --chunk $chunk $num && same l$L ref0; then
                ok "--local $L --chunk $chunk ($tag): logits and ids identical to --local 0"
            else
                bad "--local $L --chunk $chunk ($tag) differs or failed: $(tail -1 "$T/l$L.err")"
            fi
        done
    done
done

# --workers over tcp on loopback, started here, given out of order
EPS=()
start_worker() {  # a b ep [args]
    local a=$1 b=$2 ep=$3; shift 3
    "$W" --model "$TINY" --layers "$a-$b" --listen "$ep" --threads 1 --no-bench --name "w$a" "$@" \
        2>>"$T/workers.log" &
    PIDS+=($!)
}
for r in "0 3" "3 5" "5 8"; do
    set -- $r
    ep="tcp://127.0.0.1:$(port)"
    start_worker "$1" "$2" "$ep"
    EPS=("$ep" "${EPS[@]}")
done
list=$(IFS=,; echo "${EPS[*]}")
run ref0 --local 0 --chunk 32
if run tcp --workers "$list" --chunk 32 --stats && same tcp ref0; then
    ok "--workers over tcp (3 workers, listed in reverse): identical to --local 0"
else
    bad "--workers over tcp: $(tail -3 "$T/tcp.err")"
fi
if grep -q 'stage 2 w5 layers \[5, 8)' "$T/tcp.err"; then
    ok "--stats prints per-stage lines"
else
    bad "--stats: no stage lines"
fi

# --numa: pinning that cannot be done (no such node) warns and continues
ep_numa="tcp://127.0.0.1:$(port)"
start_worker 0 8 "$ep_numa" --numa 99
run numa --workers "$ep_numa" --chunk 32
if same numa ref0 && grep -q 'NUMA pinning failed, continuing unpinned: NUMA node 99 does not exist' "$T/workers.log"; then
    ok "--numa 99: the worker warns, runs unpinned, and its results are identical"
else
    bad "--numa 99: $(tail -1 "$T/numa.err")"
fi

# coverage: a gap, an overlap
ep_gap="tcp://127.0.0.1:$(port)"
start_worker 0 2 "$ep_gap"
run gap --workers "$ep_gap,${EPS[0]}" # [0,2) + [5,8)
if grep -q 'layers \[2, 5) are served by no worker' "$T/gap.err"; then
    ok "a gap in the layer ranges is refused: $(grep -o 'layers \[2, 5).*' "$T/gap.err" | head -1)"
else
    bad "gap not refused: $(tail -1 "$T/gap.err")"
fi
run overlap --workers "$ep_gap,${EPS[2]},${EPS[1]},${EPS[0]}"
if grep -q 'served twice' "$T/overlap.err"; then
    ok "overlapping ranges are refused: $(grep -o 'layer [0-9]* is served twice.*' "$T/overlap.err" | cut -c1-120)"
else
    bad "overlap not refused: $(tail -1 "$T/overlap.err")"
fi
ep_bits="tcp://127.0.0.1:$(port)"
start_worker 0 8 "$ep_bits" --bits 8
run bits --workers "$ep_bits"
if grep -q "numeric setting 'bits'" "$T/bits.err"; then
    ok "a worker with other numerics is refused: $(grep -o "numeric setting 'bits'.*" "$T/bits.err" | head -1)"
else
    bad "numerics mismatch not refused: $(tail -1 "$T/bits.err")"
fi

# keygen and key files
pub=$("$C" keygen "$T/k1" 2>/dev/null)
mode=$(stat -c %a "$T/k1.key")
if [ ${#pub} -eq 40 ] && [ "$mode" = 600 ] && grep -qF -- "$pub" "$T/k1.pub" &&
    ! grep -q secret "$T/k1.pub"; then
    ok "keygen: 0600 secret file, public key $pub in k1.pub"
else
    bad "keygen: pub '${pub}', mode $mode"
fi
if ! "$C" keygen "$T/k1" 2>"$T/kg.err" && grep -q 'refusing to overwrite' "$T/kg.err"; then
    ok "keygen never overwrites a key file"
else
    bad "keygen overwrote or failed oddly: $(cat "$T/kg.err")"
fi
cp "$T/k1.key" "$T/open.key"
chmod 644 "$T/open.key"
"$W" --model "$TINY" --layers 0-8 --listen "tcp://127.0.0.1:$(port)" --curve-secret "$T/open.key" \
    --allow "$T/k1.pub" --no-bench 2>"$T/c6.err"
rc=$?
if [ $rc -ne 0 ] && grep -q 'mode 0644' "$T/c6.err"; then
    ok "C6: a secret key file with mode 0644 is refused: $(tail -1 "$T/c6.err" | cut -c1-120)"
else
    bad "C6: worker accepted a 0644 secret (rc $rc): $(tail -1 "$T/c6.err")"
fi
# --numa-auto: the worker derives the node from its drive (on a VM the kernel
# says -1: it logs why and serves unpinned); --numa N with it is refused
"$W" --model "$TINY" --layers 0-8 --listen "tcp://127.0.0.1:$(port)" --numa 0 --numa-auto \
    --no-bench 2>"$T/na.err"
rc=$?
if [ $rc -eq 2 ] && grep -q 'conflicts with --numa-auto' "$T/na.err"; then
    ok "--numa 0 --numa-auto refused: $(tail -1 "$T/na.err")"
else
    bad "--numa 0 --numa-auto (rc $rc): $(tail -1 "$T/na.err")"
fi
ep="ipc://$T/na.sock"
K3_LOG=info "$W" --model "$TINY" --layers 0-4 --listen "$ep" --numa-auto --no-bench 2>"$T/na2.err" &
wpid=$!
PIDS+=($wpid)
for _ in $(seq 50); do grep -q 'serving layers' "$T/na2.err" && break; sleep 0.1; done
kill -TERM $wpid 2>/dev/null
wait $wpid 2>/dev/null
if grep -q -- '--numa-auto: .*model-0000.*safetensors' "$T/na2.err" && grep -q 'serving layers' "$T/na2.err"; then
    ok "--numa-auto decides from the first layer's shard and serves: $(grep -m1 -- '--numa-auto' "$T/na2.err" | cut -c1-160)"
else
    bad "--numa-auto: $(tail -2 "$T/na2.err")"
fi
exit $fail
