#!/usr/bin/env bash
# tests/integration/test_cluster_curve.sh: the cluster across two "hosts"
# (network namespaces joined by a veth pair) over CURVE (docs/TESTING.md 6.3,
# rows C1-C7 of section 4).
#  C1 two workers in namespace B, the coordinator in namespace A, CURVE with
#     allow-listed keys: logits and ids identical (cmp) to --local 0;
#  C2 a coordinator key not on the workers' allow-list: refused;
#  C5 a wrong server key: refused, in bounded time, no hang;
#  C3 a plain (NULL mechanism) client against the CURVE workers: refused;
#  C4 a worker whose ZAP handler is deliberately not started still refuses
#     an unknown key (fail closed: ZAP domain + option 93);
#  plain tcp off loopback without --insecure is refused on both sides;
#  C7 no secret key appears in any log.
# Needs root for `ip netns`: prints "skip - ...: skipped: needs root"
# otherwise, and a skip line with the reason when root cannot create or join
# namespaces here (a container without CAP_SYS_ADMIN). The namespaces are
# removed on exit, whatever happens.
set -u
. "$(dirname "$0")/../lib.sh"
WHAT="C1-C7 CURVE cluster across network namespaces"
need_root "$WHAT"
# absolute paths: the programs run under `ip netns exec`
C=$(readlink -f "$C" || echo "$C")
W=$(readlink -f "$W" || echo "$W")
need_bins "$C" "$W"
TINY=$(readlink -f "$TINY")
NA=k3ca$$
NB=k3cb$$
VA=k3va$$
VB=k3vb$$
make_tmp k3curve
cleanup() {
    k3_cleanup
    ip netns del "$NA" 2>/dev/null
    ip netns del "$NB" 2>/dev/null
    ip link del "$VA" 2>/dev/null
}
trap cleanup EXIT
if ! ip netns add "$NA" 2>"$T/ns.err"; then
    skip "$WHAT" "cannot create a network namespace: $(head -1 "$T/ns.err")"
    exit 0
fi
ip netns add "$NB" && ip link add "$VA" type veth peer name "$VB" &&
    ip link set "$VA" netns "$NA" && ip link set "$VB" netns "$NB" &&
    ip -n "$NA" addr add 10.77.0.1/24 dev "$VA" && ip -n "$NB" addr add 10.77.0.2/24 dev "$VB" &&
    ip -n "$NA" link set "$VA" up && ip -n "$NB" link set "$VB" up &&
    ip -n "$NA" link set lo up && ip -n "$NB" link set lo up
if [ $? -ne 0 ]; then
    skip "$WHAT" "cannot join the namespaces with a veth pair here"
    exit 0
fi
export K3_LOG=info

# keys: the coordinator, an intruder, the two workers
for k in coord intruder w0 w1; do "$C" keygen "$T/$k" >/dev/null 2>&1; done
cp "$T/coord.pub" "$T/allow"
printf 'tcp://10.77.0.2:5551 %s\ntcp://10.77.0.2:5552 %s\n' \
    "$(sed -n 's/^public = //p' "$T/w0.pub")" "$(sed -n 's/^public = //p' "$T/w1.pub")" >"$T/wkeys"
printf '* %s\n' "$(sed -n 's/^public = //p' "$T/coord.pub")" >"$T/wrongkeys" # not a worker key

worker() {  # name a b port [env...]
    local name=$1 a=$2 b=$3 port=$4; shift 4
    ip netns exec "$NB" env "$@" "$W" --model "$TINY" --layers "$a-$b" \
        --listen "tcp://10.77.0.2:$port" --curve-secret "$T/$name.key" --allow "$T/allow" \
        --threads 1 --no-bench --hb-ms 250 --name "$name" 2>>"$T/workers.log" &
    PIDS+=($!)
}
worker w0 0 4 5551
worker w1 4 8 5552
for _ in $(seq 100); do [ "$(grep -c serving "$T/workers.log")" -ge 2 ] && break; sleep 0.05; done

IDS=5,7,9,11,300,2,77,1000,1200,3,4,5,6,7,8,9,10,11,12,13
coord() {  # name args...
    local name=$1; shift
    timeout 60 ip netns exec "$NA" "$C" --model "$TINY" --ids "$IDS" --ngen 6 --print-ids \
        --threads 1 --all-logits "$T/$name.f32" --hb-ms 250 "$@" >"$T/$name.out" 2>"$T/$name.err"
}
"$C" --model "$TINY" --ids "$IDS" --ngen 6 --print-ids --threads 1 --local 0 \
    --all-logits "$T/ref.f32" >"$T/ref.out" 2>/dev/null
EP=tcp://10.77.0.2:5551,tcp://10.77.0.2:5552

coord c1 --workers "$EP" --curve-secret "$T/coord.key" --worker-keys "$T/wkeys"
if [ $? -eq 0 ] && cmp -s "$T/c1.f32" "$T/ref.f32" && cmp -s <(grep ids: "$T/c1.out") <(grep ids: "$T/ref.out"); then
    ok "C1: 2 workers in another namespace over CURVE: logits and ids identical to --local 0"
else
    bad "C1 over CURVE: $(grep -v '^\[' "$T/c1.err" | tail -2)"
fi

t0=$(date +%s.%N)
coord c2 --workers "$EP" --curve-secret "$T/intruder.key" --worker-keys "$T/wkeys"
rc=$?
dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
ipub=$(sed -n 's/^public = //p' "$T/intruder.pub")
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'cannot authenticate' "$T/c2.err" &&
    grep -qF -- "$ipub" "$T/workers.log"; then
    ok "C2: a coordinator key not on the allow-list is refused in ${dt} s; the worker logged its public key"
else
    bad "C2 (rc $rc, ${dt} s): $(tail -1 "$T/c2.err")"
fi

t0=$(date +%s.%N)
coord c5 --workers "$EP" --curve-secret "$T/coord.key" --worker-keys "$T/wrongkeys"
rc=$?
dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'cannot authenticate' "$T/c5.err"; then
    ok "C5: a wrong server key is refused in ${dt} s: $(grep -o 'cannot authenticate.*' "$T/c5.err" | head -1 | cut -c1-90)"
else
    bad "C5 (rc $rc, ${dt} s): $(tail -1 "$T/c5.err")"
fi

coord c3 --workers "$EP" --insecure
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'cannot authenticate' "$T/c3.err"; then
    ok "C3: a plain client is refused by the CURVE workers"
else
    bad "C3 (rc $rc): $(tail -1 "$T/c3.err")"
fi

coord plain --workers "$EP"
if [ $? -ne 0 ] && grep -q 'needs CURVE' "$T/plain.err"; then
    ok "plain tcp off loopback without --insecure: the coordinator refuses to connect"
else
    bad "coordinator connected plain off loopback: $(tail -1 "$T/plain.err")"
fi
ip netns exec "$NB" "$W" --model "$TINY" --layers 0-8 --listen tcp://10.77.0.2:5559 \
    --no-bench 2>"$T/wplain.err"
if [ $? -ne 0 ] && grep -q 'needs CURVE' "$T/wplain.err"; then
    ok "plain tcp off loopback without --insecure: the worker refuses to listen"
else
    bad "worker listened plain off loopback"
fi

# C4: no ZAP handler at all; still fail closed
worker w0 0 8 5553 K3_WORKER_FAULT=nozap
sleep 0.5
printf 'tcp://10.77.0.2:5553 %s\n' "$(sed -n 's/^public = //p' "$T/w0.pub")" >"$T/nozapkeys"
coord c4 --workers tcp://10.77.0.2:5553 --curve-secret "$T/intruder.key" --worker-keys "$T/nozapkeys"
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && ! grep -q '^ids:' "$T/c4.out"; then
    ok "C4: a worker without a ZAP handler still refuses an unknown key: $(grep -o 'cannot authenticate.*\|not registered.*' "$T/c4.err" | head -1 | cut -c1-80)"
else
    bad "C4: fail-open without ZAP (rc $rc)"
fi

# C7: no secret in any log
leak=0
for k in coord intruder w0 w1; do
    s=$(sed -n 's/^secret = //p' "$T/$k.key")
    cat "$T"/*.err "$T/workers.log" | grep -qF -- "$s" && leak=1
done
[ $leak -eq 0 ] && ok "C7: no secret key in any log" || bad "C7: a secret key was logged"
exit $fail
