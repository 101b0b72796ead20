#!/usr/bin/env bash
# tests/integration/test_status.sh: `k3-coordinator status` and the build
# identity check of HELLO on one machine (docs/DEPLOY.md, "Small cluster";
# test_deploy_cluster.sh runs the same across hosts).
#  S1 two workers over ipc: status prints one row each, ok (idle), with name,
#     layers, stripe (--dirs) and this build's identity, and exits 0
#  S2 a worker reporting another build identity: the coordinator is refused
#     naming both identities; status says why and exits 1
#  S3 an endpoint nobody serves: status says down within --timeout-ms
#  S4 while a coordinator holds the workers, status probes them and the
#     coordinator's generation is untouched (same ids as --local 0)
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3status
export K3_LOG=info

worker() { # name a b [env...]
    local name=$1 a=$2 b=$3
    shift 3
    env "$@" "$W" --model "$TINY" --layers "$a-$b" --listen "ipc://$T/$name.sock" --dirs "$TINY" \
        --threads 1 --no-bench --usage off --hb-ms 250 --name "$name" 2>>"$T/workers.log" &
    PIDS+=($!)
}
worker w0 0 4
worker w1 4 8
worker odd 0 8 K3_WORKER_FAULT=build=k3shard-other-build
for _ in $(seq 100); do [ "$(grep -c serving "$T/workers.log")" -ge 3 ] && break; sleep 0.05; done

# S1
"$C" status --workers "ipc://$T/w0.sock,ipc://$T/w1.sock" >"$T/s1.txt" 2>&1
rc=$?
build=$(grep -o "k3shard proto [^ ]* rev [^ ]*" "$T/s1.txt" | head -1)
if [ $rc -eq 0 ] && [ "$(grep -c ' ok (idle)$' "$T/s1.txt")" -eq 2 ] &&
    grep -q "w0 .* 0-4 .*$TINY" "$T/s1.txt" && grep -q "w1 .* 4-8 " "$T/s1.txt" && [ -n "$build" ]; then
    ok "S1: status: 2 rows ok (idle) with name, layers, stripe and build '$build'"
else
    bad "S1: status rc $rc: $(cat "$T/s1.txt")"
fi

# S2
"$C" status --workers "ipc://$T/odd.sock" >"$T/s2.txt" 2>&1
rc=$?
timeout 30 "$C" --model "$TINY" --workers "ipc://$T/odd.sock" --ids 5,7 --ngen 1 --threads 1 \
    --usage off >/dev/null 2>"$T/s2.err"
rc2=$?
if [ $rc -eq 1 ] && grep -q "refused: build identity mismatch: coordinator '$build', worker 'k3shard-other-build'" "$T/s2.txt" &&
    [ $rc2 -ne 0 ] && [ $rc2 -ne 124 ] &&
    grep -q "build identity mismatch: coordinator '$build', worker 'k3shard-other-build'" "$T/s2.err"; then
    ok "S2: another build: the coordinator is refused naming both identities; status says so and exits 1"
else
    bad "S2: status rc $rc ($(tail -1 "$T/s2.txt")), coordinator rc $rc2 ($(grep -v '^\[' "$T/s2.err" | tail -1))"
fi

# S3
t0=$(date +%s.%N)
"$C" status --workers "ipc://$T/nobody.sock" --timeout-ms 500 >"$T/s3.txt" 2>&1
rc=$?
dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
if [ $rc -eq 1 ] && grep -q "down: no answer in 500 ms" "$T/s3.txt"; then
    ok "S3: an endpoint nobody serves: 'down' in ${dt} s"
else
    bad "S3: rc $rc: $(tail -1 "$T/s3.txt")"
fi

# S4: probes while a coordinator generates
IDS=5,7,9,11,300,2,77,1000
"$C" --model "$TINY" --ids "$IDS" --ngen 24 --print-ids --threads 1 --local 0 --usage off \
    >"$T/ref.out" 2>/dev/null
"$C" --model "$TINY" --workers "ipc://$T/w0.sock,ipc://$T/w1.sock" --ids "$IDS" --ngen 24 \
    --print-ids --threads 1 --usage off --hb-ms 250 >"$T/s4.out" 2>"$T/s4.err" &
cpid=$!
n=0
while kill -0 $cpid 2>/dev/null; do
    "$C" status --workers "ipc://$T/w0.sock,ipc://$T/w1.sock" >"$T/s4.txt" 2>&1 && n=$((n + 1))
done
wait $cpid
rc=$?
if [ $rc -eq 0 ] && [ $n -ge 1 ] && cmp -s <(grep ids: "$T/s4.out") <(grep ids: "$T/ref.out"); then
    ok "S4: $n status probes during a generation; its ids equal --local 0's"
else
    bad "S4: rc $rc, $n probes: $(grep -v '^\[' "$T/s4.err" | tail -1)"
fi
exit $fail
