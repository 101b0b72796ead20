#!/usr/bin/env bash
# tests/integration/test_xstripe.sh: cross-worker expert striping (worker/xstripe.h,
# docs/CLUSTER.md "Expert striping", docs/PROTOCOL.md "Expert calls") on tiny:
#  - --local 1..4 --stripe-remote over 4 drives, chunk 32 and 1: logits and
#    ids bit-identical to --local 0, and the workers did call each other;
#  - test_cluster's identity checks (ipc, 1, 2, 3 and 8 stages, chunk 1 and
#    32, 3 concurrent sessions) with the local workers serving each other's
#    drives (K3_TEST_STRIPE_REMOTE);
#  - two tcp workers serving each other's drives (chunk 32 and 1);
#  - kill -9 of a worker that serves only stripes mid-decode: the stage that
#    called it fails the step within 2 x TTL naming the peer, and once it is
#    back the replay gives the uninterrupted tokens;
#  - refusals at start naming the drive: a stripe claimed twice (by the
#    worker and a peer, by two peers), a drive with no worker; a call for a
#    drive the peer does not serve is answered ERROR naming it.
# Ports 27200-27299 (tests/README: one range per test family).
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp xstripe-test
export K3_LOG=warn

identity_runs 11 29 5 # IDS, run NAME ARGS..., same A B (tests/lib.sh)
calls() { # file: workers that sent at least one expert call
    grep -c 'expert calls: [1-9][0-9]* sent' "$1"
}

D="$T/d0,$T/d1,$T/d2,$T/d3"
"$C" place --model "$TINY" --drives "$D" --copy --usage off --out "$T/p4.json" 2>"$T/place.err" ||
    bad "place over 4 drives: $(tail -1 "$T/place.err")"

# ---- bit identity, local workers -------------------------------------------
run ref --local 0 --chunk 32 || bad "--local 0: $(tail -1 "$T/ref.err")"
for chunk in 32 1; do
    for L in 1 2 3 4; do
        if K3_LOG=info run x$L.$chunk --local $L --chunk $chunk --stripe-remote \
            --placement "$T/p4.json" && same x$L.$chunk ref; then
            n=$(calls "$T/x$L.$chunk.err")
            if [ "$L" = 1 ] || [ "$n" -ge 2 ]; then
                ok "--local $L --stripe-remote --chunk $chunk: identical to --local 0 ($n workers called a peer)"
            else
                bad "--local $L --stripe-remote --chunk $chunk: identical, but $n workers called a peer"
            fi
        else
            bad "--local $L --stripe-remote --chunk $chunk differs or failed: $(tail -1 "$T/x$L.$chunk.err")"
        fi
    done
done
if run xd --local 2 --chunk 32 --stripe-remote --dirs "$T/e0,$T/e1,$T/e2" && same xd ref; then
    ok "--local 2 --stripe-remote --dirs (3 drives dealt to 2 workers): identical to --local 0"
else
    bad "--local 2 --stripe-remote --dirs: $(tail -2 "$T/xd.err")"
fi

# ---- 3 concurrent sessions (test_cluster's identity with cross-worker striping)
if [ -x "$BUILD/tests/test_cluster" ]; then
    K3_TEST_STRIPE_REMOTE=1 K3_PLACEMENT="$T/p4.json" K3_TEST_CLUSTER_ONLY=identity K3_LOG=info \
        "$BUILD/tests/test_cluster" >"$T/tc.out" 2>"$T/tc.err"
    n_ok=$(grep -c '^ok - ipc.*3 concurrent sessions: logits bit-identical' "$T/tc.out")
    n_calls=$(calls "$T/tc.err")
    if ! grep -q '^not ok' "$T/tc.out" && [ "$n_ok" -ge 8 ] && [ "$n_calls" -ge 8 ]; then
        ok "test_cluster identity with local workers serving each other's drives: $n_ok ipc checks (1, 2, 3, 8 stages, chunk 1 and 32, 3 concurrent sessions), $n_calls workers called a peer"
    else
        bad "test_cluster cross-worker: $n_ok identical, $n_calls calling, $(grep '^not ok' "$T/tc.out" | head -2)"
    fi
else
    bad "$BUILD/tests/test_cluster not built"
fi

# ---- tcp workers serving each other's drives --------------------------------
P=27210
EA="tcp://127.0.0.1:$P" EB="tcp://127.0.0.1:$((P + 1))"
XA="tcp://127.0.0.1:$((P + 2))" XB="tcp://127.0.0.1:$((P + 3))"
"$W" --model "$TINY" --layers 0-4 --listen "$EA" --threads 1 --no-bench --usage off \
    --placement "$T/p4.json" --name ta --stripe-drives 0,1 --expert-listen "$XA" \
    --stripe-peers "2=$XB,3=$XB" --log-level info 2>"$T/ta.log" &
PIDS+=($!)
TA=$!
"$W" --model "$TINY" --layers 4-8 --listen "$EB" --threads 1 --no-bench --usage off \
    --placement "$T/p4.json" --name tb --stripe-drives 2,3 --expert-listen "$XB" \
    --stripe-peers "0=$XA,1=$XA" --log-level info 2>"$T/tb.log" &
PIDS+=($!)
TB=$!
# ta opens only its own drives' files (0 and 1), for every layer
for _ in $(seq 100); do grep -q 'serves drive' "$T/ta.log" && break; sleep 0.1; done
fds=$(ls -l /proc/$TA/fd 2>/dev/null | grep -o "$T/d[0-9]/k3-stripe/[^ ]*" | sort -u)
if [ -n "$fds" ] && ! echo "$fds" | grep -q "/d[23]/" && echo "$fds" | grep -q "/d0/" &&
    echo "$fds" | grep -q "/d1/"; then
    ok "a worker opens only its own drives' files: $(echo "$fds" | wc -l) files, all on d0 and d1"
else
    bad "files the drive-0/1 worker opened: $(echo "$fds" | tr '\n' ' ')"
fi
for chunk in 32 1; do
    if run tcp$chunk --workers "$EA,$EB" --chunk $chunk && same tcp$chunk ref; then
        ok "2 tcp workers serving each other's drives, chunk $chunk: identical to --local 0"
    else
        bad "tcp cross-worker chunk $chunk: $(tail -2 "$T/tcp$chunk.err")"
    fi
done
# the striping figures: --stats and serve's /metrics over the same workers
"$C" --model "$TINY" --ids "$IDS" --ngen 5 --threads 1 --usage off --workers "$EA,$EB" \
    --chunk 32 --stats >"$T/st.out" 2>"$T/st.err"
if [ "$(grep -c '    drives: d0 .* d3 .*GB/s); gather wait [0-9.]* ms per layer over [1-9][0-9]* MoE layer steps' "$T/st.err")" = 2 ] &&
    [ "$(grep -c '    experts: hit rate [0-9.]* %' "$T/st.err")" = 2 ]; then
    ok "--stats: per stage the hit rate, per-drive MB and GB/s, gather wait per layer: $(grep -m1 '    drives:' "$T/st.err" | cut -c1-150)"
else
    bad "--stats striping lines: $(grep -A3 '^cluster:' "$T/st.err")"
fi
SP=$((P + 4))
if serve_start "$T/srv.out" "$T/srv.err" --model "$TINY" --workers "$EA,$EB" --port $SP --ctx 512; then
    curl -s -o "$T/c.json" -H "Content-Type: application/json" \
        -d '{"prompt":"hello there","temperature":0,"max_tokens":4}' "http://127.0.0.1:$SP/v1/completions"
    curl -s -o "$T/metrics" "http://127.0.0.1:$SP/metrics"
    nd=$(grep -c '^k3_drive_bytes_read_total{stage="[01]",drive="[0-3]"} ' "$T/metrics")
    ng=$(grep -c '^k3_gather_layers_total{stage="[01]"} [1-9]' "$T/metrics")
    nh=$(grep -c '^k3_expert_hit_ratio{stage="[01]"} ' "$T/metrics")
    nw=$(grep -c '^k3_gather_wait_seconds_total{stage="[01]"} ' "$T/metrics")
    [ "$nd" = 8 ] && [ "$ng" = 2 ] && [ "$nh" = 2 ] && [ "$nw" = 2 ] &&
        ok "/metrics: per-drive bytes (8 series), gather layers and wait, hit ratio per stage" ||
        bad "/metrics striping: $nd drive series, $ng gather, $nh hit, $nw wait: $(grep -c . "$T/metrics") lines"
    kill -TERM "$SRV" 2>/dev/null
    wait "$SRV" 2>/dev/null
else
    bad "serve over the tcp workers did not start: $(tail -2 "$T/srv.err")"
fi
kill -TERM $TA $TB 2>/dev/null
wait $TA $TB 2>/dev/null
n=$(cat "$T/ta.log" "$T/tb.log" | calls /dev/stdin)
[ "$n" = 2 ] && ok "both tcp workers called the other: $(grep -h -o 'expert calls: [0-9]* sent[^)]*)' "$T/ta.log" | head -1)" ||
    bad "tcp workers' expert calls: $(grep -h 'expert calls' "$T/ta.log" "$T/tb.log")"

# ---- kill -9 of a worker that serves only stripes ---------------------------
# Stage ta2 runs every layer and reads drives 0 and 1; s2 serves drives 2
# and 3 and is no stage (the coordinator never talks to it). ta2 is slowed
# (K3_WORKER_FAULT slow=) so the decode is in progress when s2 dies.
HB=250
TTL=$((3 * HB))
XS="tcp://127.0.0.1:$((P + 5))"
start_s2() {
    "$W" --model "$TINY" --layers 0-8 --listen "tcp://127.0.0.1:$((P + 6))" --threads 1 \
        --no-bench --usage off --placement "$T/p4.json" --name s2 --stripe-drives 2,3 \
        --expert-listen "$XS" --stripe-peers "0=$XA,1=$XA" --hb-ms $HB 2>>"$T/s2.log" &
    S2=$!
    PIDS+=($S2)
}
start_s2
K3_WORKER_FAULT=slow=60 "$W" --model "$TINY" --layers 0-8 --listen "$EA" --threads 1 \
    --no-bench --usage off --placement "$T/p4.json" --name ta2 --stripe-drives 0,1 \
    --expert-listen "$XA" --stripe-peers "2=$XS,3=$XS" --hb-ms $HB 2>"$T/ta2.log" &
PIDS+=($!)
TA2=$!
"$C" --model "$TINY" --ids "$IDS" --ngen 40 --print-ids --threads 1 --usage off --hb-ms $HB \
    --workers "$EA" --chunk 32 >"$T/refk.out" 2>"$T/refk.err" ||
    bad "uninterrupted run over ta2 + s2: $(tail -1 "$T/refk.err")"
grep '^ids:' "$T/refk.out" >"$T/refk.ids"
K3_LOG=info "$C" --model "$TINY" --ids "$IDS" --ngen 40 --print-ids --threads 1 --usage off \
    --hb-ms $HB --workers "$EA" --chunk 32 >"$T/kill.out" 2>"$T/kill.err" &
CP=$!
sleep 1.2
t_kill=$(date +%s%3N)
kill -9 $S2
wait $S2 2>/dev/null
sleep 1 # down for more than TTL: the call in flight and the next ones time out
start_s2
wait $CP
rc=$?
grep '^ids:' "$T/kill.out" >"$T/kill.ids"
# the first failed step: the coordinator's WARN line carries its time of day
line=$(grep -m1 'stripe peer of drive [23] .* gave no answer nor progress' "$T/kill.err")
t_err=$(echo "$line" | /usr/bin/python3 -c '
import sys, time, datetime
l = sys.stdin.read().split()
if not l: print(-1); sys.exit()
h, m, s = l[0].split(":")
d = datetime.datetime.now().replace(hour=int(h), minute=int(m), second=0, microsecond=0)
print(int(d.timestamp() * 1000 + float(s) * 1000))')
dt=$((t_err - t_kill))
if [ -n "$line" ] && [ "$t_err" -gt 0 ] && [ "$dt" -le $((2 * TTL)) ] && [ "$dt" -ge 0 ]; then
    ok "kill -9 of the stripe-only worker mid-decode: the step failed after $dt ms (<= 2 x TTL = $((2 * TTL))), naming it: $(echo "$line" | grep -o 'stripe peer of drive [0-9] ([^)]*)' | head -1)"
else
    bad "kill -9 of the stripe-only worker: dt=$dt ms, line: ${line:-none} $(tail -2 "$T/kill.err")"
fi
if [ $rc = 0 ] && cmp -s "$T/kill.ids" "$T/refk.ids" && [ -s "$T/refk.ids" ] &&
    grep -q 'resuming: waiting for the cluster, then replaying' "$T/kill.err"; then
    ok "after it returned the replay gave the uninterrupted 40 tokens"
else
    bad "replay after the stripe worker returned: rc=$rc $(cat "$T/kill.ids") vs $(cat "$T/refk.ids"); $(tail -2 "$T/kill.err")"
fi
kill -TERM $TA2 $S2 2>/dev/null
wait $TA2 $S2 2>/dev/null

# ---- CURVE: workers in two network namespaces serve each other's drives -----
curve() {
    local NA=xstripeA$$ NB=xstripeB$$ VA=xsva$$ VB=xsvb$$
    if [ "$(id -u)" != 0 ] || ! ip netns add "$NA" 2>/dev/null; then
        skip "cross-worker striping over CURVE across namespaces" "needs root and ip netns"
        return
    fi
    ip netns add "$NB" && ip link add "$VA" type veth peer name "$VB" &&
        ip link set "$VA" netns "$NA" && ip link set "$VB" netns "$NB" &&
        ip -n "$NA" addr add 10.81.0.1/24 dev "$VA" && ip -n "$NB" addr add 10.81.0.2/24 dev "$VB" &&
        ip -n "$NA" link set "$VA" up && ip -n "$NB" link set "$VB" up &&
        ip -n "$NA" link set lo up && ip -n "$NB" link set lo up
    if [ $? -ne 0 ]; then
        skip "cross-worker striping over CURVE across namespaces" "cannot join namespaces with a veth pair"
    else
        for k in coord wa wb; do "$C" keygen "$T/$k" >/dev/null 2>&1; done
        cp "$T/coord.pub" "$T/allow"
        pub() { sed -n 's/^public = //p' "$T/$1.pub"; }
        echo "tcp://10.81.0.1:27230 $(pub wa)" >"$T/wkeys"
        echo "tcp://10.81.0.2:27230 $(pub wb)" >>"$T/wkeys"
        echo "tcp://10.81.0.2:27231 $(pub wb)" >"$T/ka"      # A calls B
        echo "tcp://10.81.0.1:27231 $(pub wa)" >"$T/kb"      # B calls A
        pub wb >"$T/aa" # B may call A
        pub wa >"$T/ab"
        local cw cc tiny
        cw=$(readlink -f "$W") cc=$(readlink -f "$C") tiny=$(readlink -f "$TINY")
        ip netns exec "$NA" "$cw" --model "$tiny" --layers 0-4 --listen tcp://10.81.0.1:27230 \
            --curve-secret "$T/wa.key" --allow "$T/allow" --placement "$T/p4.json" --usage off \
            --threads 1 --no-bench --name cwa --stripe-drives 0,1 \
            --expert-listen tcp://10.81.0.1:27231 --stripe-peers "2=tcp://10.81.0.2:27231,3=tcp://10.81.0.2:27231" \
            --stripe-allow "$T/aa" --stripe-keys "$T/ka" --log-level info 2>"$T/cwa.log" &
        PIDS+=($!)
        local pa=$!
        ip netns exec "$NB" "$cw" --model "$tiny" --layers 4-8 --listen tcp://10.81.0.2:27230 \
            --curve-secret "$T/wb.key" --allow "$T/allow" --placement "$T/p4.json" --usage off \
            --threads 1 --no-bench --name cwb --stripe-drives 2,3 \
            --expert-listen tcp://10.81.0.2:27231 --stripe-peers "0=tcp://10.81.0.1:27231,1=tcp://10.81.0.1:27231" \
            --stripe-allow "$T/ab" --stripe-keys "$T/kb" --log-level info 2>"$T/cwb.log" &
        PIDS+=($!)
        local pb=$!
        timeout 60 ip netns exec "$NA" "$cc" --model "$tiny" --ids "$IDS" --ngen 5 \
            --print-ids --threads 1 --usage off --all-logits "$T/curve.f32" --chunk 32 \
            --workers tcp://10.81.0.1:27230,tcp://10.81.0.2:27230 --curve-secret "$T/coord.key" \
            --worker-keys "$T/wkeys" >"$T/curve.out" 2>"$T/curve.err"
        grep '^ids:' "$T/curve.out" >"$T/curve.ids"
        kill -TERM $pa $pb 2>/dev/null
        wait $pa $pb 2>/dev/null
        local n
        n=$(cat "$T/cwa.log" "$T/cwb.log" | calls /dev/stdin)
        if same curve ref && [ "$n" = 2 ] && grep -q 'serves drive(s) 0,1 on tcp://10.81.0.1:27231 with CURVE' "$T/cwa.log"; then
            ok "2 workers in two namespaces serving each other's drives over CURVE: identical to --local 0, both called the other"
        else
            bad "cross-worker over CURVE: $n calling; $(tail -2 "$T/curve.err") $(grep -h 'expert call' "$T/cwa.log" "$T/cwb.log" | head -3)"
        fi
    fi
    ip netns del "$NA" 2>/dev/null
    ip netns del "$NB" 2>/dev/null
    ip link del "$VA" 2>/dev/null
}
curve
"$W" --model "$TINY" --layers 0-4 --listen "ipc://$T/rc" --threads 1 --no-bench --usage off \
    --placement "$T/p4.json" --stripe-drives 0,1 --expert-listen "tcp://10.0.0.9:27240" \
    --stripe-peers "2=ipc://$T/o,3=ipc://$T/o" 2>"$T/plain.err"
[ $? = 2 ] && grep -q 'expert-listen' "$T/plain.err" &&
    ok "a network --expert-listen without CURVE or --insecure is refused at start: $(head -1 "$T/plain.err" | cut -c1-110)" ||
    bad "plain network expert endpoint: $(cat "$T/plain.err")"

# ---- kill -9 of a local worker that is a stage and serves drives ------------
"$C" --model "$TINY" --ids "$IDS" --ngen 300 --print-ids --threads 1 --usage off --local 2 \
    --stripe-remote --placement "$T/p4.json" --hb-ms $HB >"$T/lr.out" 2>"$T/lr.err"
K3_LOG=info "$C" --model "$TINY" --ids "$IDS" --ngen 300 --print-ids --threads 1 --usage off \
    --local 2 --stripe-remote --placement "$T/p4.json" --hb-ms $HB >"$T/lk.out" 2>"$T/lk.err" &
CP=$!
# the kill lands in the decode: right after the prompt's chunk is logged
# (300 tokens decode in ~0.5 s on an idle host, so a fixed delay can miss it)
for _ in $(seq 600); do grep -q 'prefill: chunk' "$T/lk.err" && break; sleep 0.05; done
W1=$(ps -o pid=,args= --ppid $CP | grep -- '--name local1' | awk '{print $1}')
[ -n "$W1" ] && kill -9 "$W1"
wait $CP
rc=$?
if [ -n "$W1" ] && [ $rc = 0 ] && cmp -s "$T/lr.out" "$T/lk.out" && grep -q '^ids:' "$T/lr.out" &&
    grep -q 'local worker 1 .* killed by signal 9' "$T/lk.err"; then
    ok "kill -9 of a local worker (a stage serving drives 1, 3) mid-decode: restarted, the replay gives the uninterrupted 300 tokens"
else
    bad "kill -9 of a local cross-striped worker: pid '$W1' rc=$rc $(grep -E 'error|warn' "$T/lk.err" | tail -2)"
fi

# ---- refusals ----------------------------------------------------------------
wk() { # name args...: a worker that must refuse at start
    local name=$1
    shift
    timeout 20 "$W" --model "$TINY" --layers 0-4 --listen "ipc://$T/r.$name" --threads 1 \
        --no-bench --usage off --placement "$T/p4.json" "$@" 2>"$T/$name.err"
}
wk twice --stripe-drives 0,1 --expert-listen "ipc://$T/rx" --stripe-peers "1=ipc://$T/o,2=ipc://$T/o,3=ipc://$T/o"
[ $? != 0 ] && grep -q 'stripe of drive 1 claimed twice: by this worker (--stripe-drives) and by peer ipc://' "$T/twice.err" &&
    ok "a stripe claimed by the worker and a peer is refused at start: $(head -1 "$T/twice.err" | cut -c1-120)" ||
    bad "claimed by the worker and a peer: $(cat "$T/twice.err")"
wk twice2 --stripe-drives 0,1 --expert-listen "ipc://$T/rx" --stripe-peers "2=ipc://$T/a,3=ipc://$T/b,2=ipc://$T/c"
[ $? != 0 ] && grep -q 'stripe of drive 2 claimed twice: by peer ipc://.*/a and by peer ipc://.*/c' "$T/twice2.err" &&
    ok "a stripe claimed by two peers is refused at start naming both" ||
    bad "claimed by two peers: $(cat "$T/twice2.err")"
wk none --stripe-drives 0,1 --expert-listen "ipc://$T/rx" --stripe-peers "3=ipc://$T/a"
[ $? != 0 ] && grep -q 'drive 2 has no worker' "$T/none.err" &&
    ok "a drive with no worker is refused at start naming it" ||
    bad "drive without a worker: $(cat "$T/none.err")"
# two workers of one coordinator both serving drives 0 and 1: the second to
# register is refused, naming the drive and both workers (HELLO_OK "stripe")
for r in "c1 0-4" "c2 4-8"; do
    set -- $r
    "$W" --model "$TINY" --layers "$2" --listen "ipc://$T/$1w" --threads 1 --no-bench --usage off \
        --placement "$T/p4.json" --name "$1" --stripe-drives 0,1 --expert-listen "ipc://$T/$1x" \
        --stripe-peers "2=ipc://$T/o,3=ipc://$T/o" 2>"$T/$1.log" &
    PIDS+=($!)
done
timeout 60 "$C" --model "$TINY" --ids 1,2,3 --ngen 2 --threads 1 --usage off \
    --workers "ipc://$T/c1w,ipc://$T/c2w" --ready-timeout-ms 8000 >"$T/claim.out" 2>"$T/claim.err"
grep -q 'stripe of drive 0 claimed twice: by worker c[12] (ipc://.*) and by worker c[12] (ipc://' "$T/claim.err" &&
    ok "two workers claiming the same drives are refused at start: $(grep -o 'stripe of drive 0 claimed twice: by worker c[12]' "$T/claim.err" | head -1) ..." ||
    bad "drive claimed by two workers: $(tail -2 "$T/claim.err")"
# a peer that does not serve the drive it is asked for answers ERROR naming it
"$W" --model "$TINY" --layers 4-8 --listen "ipc://$T/wrongw" --threads 1 --no-bench --usage off \
    --placement "$T/p4.json" --name wrong --stripe-drives 3 --expert-listen "ipc://$T/wrongx" \
    --stripe-peers "0=ipc://$T/rax,1=ipc://$T/rax,2=ipc://$T/rax" 2>"$T/wrong.log" &
PIDS+=($!)
"$W" --model "$TINY" --layers 0-4 --listen "ipc://$T/raw" --threads 1 --no-bench --usage off \
    --placement "$T/p4.json" --name ra --stripe-drives 0,1 --expert-listen "ipc://$T/rax" \
    --stripe-peers "2=ipc://$T/wrongx,3=ipc://$T/wrongx" 2>"$T/ra.log" &
PIDS+=($!)
run wrong --workers "ipc://$T/raw,ipc://$T/wrongw" --chunk 32 --resumes 0
grep -q 'does not serve the stripe of drive 2' "$T/wrong.err" &&
    ok "a call for a drive the peer does not serve is refused naming it: $(grep -o '[a-z0-9]* does not serve the stripe of drive 2' "$T/wrong.err" | head -1)" ||
    bad "wrong peer: $(tail -2 "$T/wrong.err")"
exit $fail
