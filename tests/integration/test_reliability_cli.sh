#!/usr/bin/env bash
# tests/integration/test_reliability_cli.sh: bounded waits and failures the
# cluster names at once (issue "Reliability and the CLI", docs/RELIABILITY.md).
#  - --workers naming an endpoint nobody answers on: a line every 5 s names
#    the worker, its endpoint and how long it has been silent, and start-up
#    gives up at --ready-timeout-ms with the deadline named;
#  - a worker holding 50 tokens under a coordinator asking for 100: refused
#    before any step, both numbers named;
#  - a --local worker killed with -9 mid-decode: the coordinator names the
#    signal at once, restarts it, replays, and the ids equal an undisturbed
#    run's;
#  - a second coordinator on the same worker: the first one fails within
#    seconds with "taken over by another coordinator" (not a 30 s stall),
#    the second one is served;
#  - a HELLO with another model fingerprint is refused without the worker's
#    fingerprint in the reply;
#  - SIGINT stops gracefully, a second signal at once;
#  - tcp://localhost binds and connects; a worker whose address is taken
#    says so before loading (< 1 s); a coordinator key not on the worker's
#    allow-list ends with the CURVE reason, not "connection closed".
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp reliability_cli
export K3_LOG=info
IDS=1,2,3,4,5,6,7,8,9,10

# 1. an endpoint nobody answers on
t0=$(date +%s%N)
"$C" --model "$TINY" --workers "tcp://127.0.0.1:1" --ready-timeout-ms 6500 --ids "$IDS" --ngen 2 \
    --threads 1 >"$T/wait.out" 2>"$T/wait.err"
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
if [ $rc -eq 1 ] &&
    grep -q 'waiting for worker 0 (tcp://127.0.0.1:1), layers .*: no answer for 5s' "$T/wait.err" &&
    grep -q 'not registered within 6.[0-9] s (--ready-timeout-ms' "$T/wait.err" && [ $ms -lt 15000 ]; then
    ok "unreachable worker: a waiting line at 5 s, gave up after $ms ms: $(tail -1 "$T/wait.err" | cut -c1-140)"
else
    bad "unreachable worker (rc $rc, $ms ms): $(tail -2 "$T/wait.err")"
fi

# 2. context capacity checked at start
ep="tcp://127.0.0.1:$(port)"
"$W" --model "$TINY" --layers 0-8 --listen "$ep" --max-ctx 50 --threads 1 --no-bench \
    --name small 2>"$T/small.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q 'serving layers' "$T/small.log" && break; sleep 0.05; done
"$C" --model "$TINY" --workers "$ep" --ids "$IDS" --ngen 90 --threads 1 --print-ids \
    >"$T/ctx.out" 2>"$T/ctx.err"
rc=$?
if [ $rc -eq 1 ] && grep -q 'a context of 100 tokens was asked, but worker small .* holds at most 50' \
    "$T/ctx.err" && ! grep -q 'prefill:' "$T/ctx.err"; then
    ok "context 100 > worker capacity 50: refused before any step: $(grep -o 'a context of.*' "$T/ctx.err" | cut -c1-120)"
else
    bad "context capacity (rc $rc): $(tail -1 "$T/ctx.err")"
fi

# 3. kill -9 of a --local worker mid-decode
"$C" --model "$TINY" --local 2 --ids "$IDS" --ngen 24 --threads 1 --print-ids \
    >"$T/ref.out" 2>"$T/ref.err"
K3_WORKER_FAULT=slow=60 "$C" --model "$TINY" --local 2 --ids "$IDS" --ngen 24 --threads 1 \
    --print-ids >"$T/kill.out" 2>"$T/kill.err" &
cpid=$!
PIDS+=($cpid)
for _ in $(seq 200); do grep -q 'prefill: chunk' "$T/kill.err" && break; sleep 0.05; done
sleep 0.5
victim=$(pgrep -P $cpid k3-worker | tail -1)
t0=$(date +%s%N)
[ -n "$victim" ] && kill -9 "$victim"
wait $cpid
rc=$?
if [ $rc -eq 0 ] && [ -n "$victim" ] && grep -q "(pid $victim) killed by signal 9" "$T/kill.err" &&
    grep -q 'restarted as pid' "$T/kill.err" && grep '^ids:' "$T/kill.out" >"$T/k.ids" &&
    grep '^ids:' "$T/ref.out" | cmp -s - "$T/k.ids"; then
    ok "kill -9 of local worker pid $victim: named at once, restarted, replayed, ids identical"
else
    bad "kill -9 of a local worker (rc $rc, pid '$victim'): $(grep -m2 'killed\|error' "$T/kill.err")"
fi

# 4. a second coordinator on the same worker
ep2="tcp://127.0.0.1:$(port)"
K3_WORKER_FAULT=slow=100 "$W" --model "$TINY" --layers 0-8 --listen "$ep2" --threads 1 --no-bench \
    --name shared 2>"$T/shared.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q 'serving layers' "$T/shared.log" && break; sleep 0.05; done
"$C" --model "$TINY" --workers "$ep2" --ids "$IDS" --ngen 60 --threads 1 --resumes 0 \
    >"$T/first.out" 2>"$T/first.err" &
first=$!
PIDS+=($first)
for _ in $(seq 200); do grep -q 'prefill: chunk' "$T/first.err" && break; sleep 0.05; done
t0=$(date +%s%N)
"$C" --model "$TINY" --workers "$ep2" --ids "$IDS" --ngen 3 --threads 1 >"$T/second.out" \
    2>"$T/second.err"
rc2=$?
wait $first
rc1=$?
ms=$((($(date +%s%N) - t0) / 1000000))
if [ $rc2 -eq 0 ] && [ $rc1 -eq 1 ] &&
    grep -q 'taken over by another coordinator: displaced: another coordinator (peer' "$T/first.err" &&
    [ $ms -lt 10000 ]; then
    ok "second coordinator served; the first failed in $ms ms naming the takeover: $(grep -o 'taken over.*' "$T/first.err" | head -1 | cut -c1-120)"
else
    bad "second coordinator (rc first $rc1, second $rc2, $ms ms): $(tail -1 "$T/first.err")"
fi

# 5. a bad HELLO learns nothing of the worker's fingerprint
K3_TOPP=0.5 "$C" --model "$TINY" --workers "$ep" --ids "$IDS" --ngen 2 --threads 1 \
    --ready-timeout-ms 3000 >"$T/fp.out" 2>"$T/fp.err"
rc=$?
wfp=$(grep -o 'got 0x[0-9a-f]*' "$T/small.log" | head -1 | cut -c5-)
if [ $rc -eq 1 ] && grep -q 'fingerprint mismatch' "$T/fp.err" && [ -n "$wfp" ] &&
    ! grep -q "$wfp" "$T/fp.err"; then
    ok "HELLO with another fingerprint refused; the reply does not carry the worker's ($wfp is only in its log)"
else
    bad "fingerprint disclosure (rc $rc, worker fp '$wfp'): $(grep -m1 fingerprint "$T/fp.err")"
fi

# 6. graceful stop: the first SIGINT ends the run after the current step
"$C" --model "$TINY" --local 2 --ids "$IDS" --ngen 40 --threads 1 --print-ids \
    >"$T/full.out" 2>"$T/full.err"
K3_WORKER_FAULT=slow=60 "$C" --model "$TINY" --local 2 --ids "$IDS" --ngen 40 --threads 1 \
    --print-ids --stats >"$T/int.out" 2>"$T/int.err" &
cpid=$!
PIDS+=($cpid)
for _ in $(seq 200); do grep -q 'prefill: chunk' "$T/int.err" && break; sleep 0.05; done
sleep 0.6
workers=$(pgrep -P $cpid k3-worker | tr '\n' ' ')
kill -INT $cpid
t0=$(date +%s%N)
wait $cpid
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
dir=$(grep -o '/tmp/k3c\.[A-Za-z0-9]*' "$T/int.err" | head -1)
n=$(grep '^ids:' "$T/int.out" | wc -w)
n=$((n - 1))
gone=1
for p in $workers; do kill -0 "$p" 2>/dev/null && gone=0; done
full=$(grep '^ids:' "$T/full.out")
got=$(grep '^ids:' "$T/int.out")
if [ $rc -eq 130 ] && [ $ms -lt 3000 ] && [ $n -ge 1 ] && [ $n -lt 40 ] &&
    [ "${full#"$got"}" != "$full" ] && grep -q "generated $n tokens, stop: interrupted" "$T/int.err" &&
    grep -q '^stats: ' "$T/int.err" && [ -n "$dir" ] && [ ! -e "$dir" ] && [ $gone -eq 1 ]; then
    ok "SIGINT: stopped in $ms ms after $n tokens (a prefix of the full run's ids), stats printed, workers gone, $dir removed, exit 130"
else
    bad "SIGINT (rc $rc, $ms ms, $n ids, dir '$dir', workers gone $gone): $(tail -2 "$T/int.err")"
fi
# a second signal exits at once
K3_WORKER_FAULT=slow=1500 "$C" --model "$TINY" --local 2 --ids "$IDS" --ngen 40 --threads 1 \
    >"$T/int2.out" 2>"$T/int2.err" &
cpid=$!
PIDS+=($cpid)
for _ in $(seq 200); do grep -q 'stage 1:' "$T/int2.err" && break; sleep 0.05; done
sleep 0.3
# the second signal follows at once: the first one's graceful stop takes
# one layer step since cancellation reaches into a running step (tens of
# ms even with slow=1500), so a pause would let it finish first
kill -INT $cpid
t0=$(date +%s%N)
kill -TERM $cpid
wait $cpid
rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
if [ $rc -eq 143 ] && [ $ms -lt 1000 ] && grep -q 'second signal: exiting now' "$T/int2.err"; then
    ok "a second signal (SIGTERM after SIGINT) exits at once: $ms ms, exit 143"
else
    bad "second signal (rc $rc, $ms ms): $(tail -1 "$T/int2.err")"
fi

# 7. tcp://localhost, address in use before the load, the CURVE reason
p=$(port)
"$W" --model "$TINY" --layers 0-8 --listen "tcp://localhost:$p" --threads 1 --no-bench \
    2>"$T/lh.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q 'serving layers' "$T/lh.log" && break; sleep 0.05; done
"$C" --model "$TINY" --workers "tcp://localhost:$p" --ids "$IDS" --ngen 3 --threads 1 --print-ids \
    >"$T/lh.out" 2>"$T/lh.err"
rc=$?
t0=$(date +%s%N)
"$W" --model "$TINY" --layers 0-8 --listen "tcp://127.0.0.1:$p" --threads 1 --no-bench \
    2>"$T/inuse.err"
rc2=$?
ms=$((($(date +%s%N) - t0) / 1000000))
if [ $rc -eq 0 ] && grep -q '^ids: ' "$T/lh.out" && [ $rc2 -eq 1 ] && [ $ms -lt 1000 ] &&
    grep -q 'Address already in use (checked before loading the model)' "$T/inuse.err" &&
    ! grep -q 'loaded' "$T/inuse.err"; then
    ok "tcp://localhost serves; a second worker on its port fails in $ms ms before loading"
else
    bad "localhost (rc $rc) / address in use (rc $rc2, $ms ms): $(tail -1 "$T/lh.err") | $(tail -1 "$T/inuse.err")"
fi
"$C" keygen "$T/wk" >/dev/null 2>&1 && "$C" keygen "$T/ck" >/dev/null 2>&1 &&
    "$C" keygen "$T/ok" >/dev/null 2>&1
p=$(port)
"$W" --model "$TINY" --layers 0-8 --listen "tcp://127.0.0.1:$p" --threads 1 --no-bench \
    --curve-secret "$T/wk.key" --allow "$T/ok.pub" 2>"$T/cw.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q 'serving layers' "$T/cw.log" && break; sleep 0.05; done
echo "* $(grep -o '= .*' "$T/wk.pub" | cut -c3-)" >"$T/keys.txt"
"$C" --model "$TINY" --workers "tcp://127.0.0.1:$p" --curve-secret "$T/ck.key" \
    --worker-keys "$T/keys.txt" --ids "$IDS" --ngen 2 --threads 1 --ready-timeout-ms 8000 \
    >/dev/null 2>"$T/curve.err"
rc=$?
if [ $rc -eq 1 ] && tail -1 "$T/curve.err" | grep -q 'cannot authenticate: the worker refused our CURVE key'; then
    ok "a key not on the allow-list: the final error names the CURVE reason: $(tail -1 "$T/curve.err" | cut -c1-120)"
else
    bad "CURVE reason (rc $rc): $(tail -1 "$T/curve.err")"
fi
exit $fail
