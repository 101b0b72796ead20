#!/usr/bin/env bash
# tests/reliability/run.sh (make reliability): faults injected into a live
# tiny cluster, one table at the end (docs/RELIABILITY.md "The table").
# Each row: what was done, trials, recovered token-identically, errors
# reported, max RSS (coordinator or worker, peak), max recovery time (the
# run's wall time minus the undisturbed run's).
#  kill -9: a random --local worker (seeded), at a random time during
#    prefill or decode (slow=MS fault: every FORWARD takes MS longer);
#    the coordinator must name the signal, restart the worker, replay, and
#    print the reference ids;
#  SIGSTOP: a --local worker frozen 0.5-2 x TTL, then SIGCONT;
#  another model: a worker whose fingerprint differs is refused, named;
#  oversized / malformed / slow peer: tests/test_peer_budget.c's rows;
#  then every tests/reliability/row_*.sh (the contract is at step 5):
#  iptables DROP between namespaces, EIO on an expert read and a full disk,
#  the HTTP rows, the coordinator restarted with a session on disk.
# Needs root only for the rows that say so. Seeded: RELIABILITY_SEED.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp reliability_table
[ -n "${RELIABILITY_KEEP:-}" ] && trap - EXIT
export K3_LOG=info K3_LOG_TIME=0
SEED=${RELIABILITY_SEED:-20}
TRIALS=${RELIABILITY_TRIALS:-20}
ROWS=()
row() { ROWS+=("$1|$2|$3|$4|$5|$6"); }
rnd() { # seed -> float in [0, 1) (Python's Mersenne Twister: the same on every host)
    /usr/bin/python3 -c "import random; print(random.Random($1).random())"
}
IDS=$(/usr/bin/python3 -c 'import random; r=random.Random(5); print(",".join(str(r.randrange(1280)) for _ in range(40)))')
gen() { # out err args...: one run, the coordinator's peak RSS (kB) in $out.rss
    local out=$1 err=$2
    shift 2
    /usr/bin/time -f '%M' -o "$out.rss" "$C" --model "$TINY" --ids "$IDS" --threads 1 --print-ids \
        --chunk 4 --hb-ms 200 "$@" >"$out" 2>"$err"
}
ms_now() { echo $(($(date +%s%N) / 1000000)); }
# gen in the background: $cpid is the job's pid, $coord the coordinator's
# (a child of /usr/bin/time, itself maybe a child of the job's subshell)
gen_bg() {
    local out=$1 err=$2
    shift 2
    K3_WORKER_FAULT=slow=25 /usr/bin/time -f '%M' -o "$out.rss" "$C" --model "$TINY" --ids "$IDS" \
        --threads 1 --print-ids --chunk 4 --hb-ms 200 "$@" >"$out" 2>"$err" &
    cpid=$!
    coord=""
    for _ in $(seq 100); do
        kids=$(pgrep -P $cpid | paste -sd,)
        coord=$(pgrep -P "$cpid${kids:+,$kids}" -x k3-coordinator) && break
        sleep 0.01
    done
}
peak() { tail -1 "$1.rss" 2>/dev/null | grep -E '^[0-9]+$' || echo 0; }
account() { # out recovery_ms: the row's max RSS and max recovery time so far
    local m
    m=$(peak "$1")
    [ "$m" -gt "$rss" ] && rss=$m
    [ "$2" -gt "$worst" ] && worst=$2
}

# reference: undisturbed, with the same slow workers
gen "$T/ref.out" "$T/ref.err" --local 2 --ngen 24
REF=$(grep '^ids:' "$T/ref.out")
gen_bg "$T/slow.out" "$T/slow.err" --local 2 --ngen 24
for _ in $(seq 400); do grep -q 'stage 1:' "$T/slow.err" && break; sleep 0.01; done
t0=$(ms_now)
wait $cpid
BASE=$(($(ms_now) - t0)) # from the cluster's "stage 1:" line to the end
[ -n "$REF" ] && [ "$(grep '^ids:' "$T/slow.out")" = "$REF" ] ||
    bad "reference runs disagree or failed: $(tail -1 "$T/slow.err")"
echo "# reference: $BASE ms from start-up to the end with slow=25 (prefill 40 tokens in chunks of 4, then 24)"

# 1. kill -9 at seeded random times, prefill and decode
ok_n=0 err_n=0 rss=0 worst=0 pre=0 dec=0 missed=0 i=0
while [ $((pre + dec)) -lt "$TRIALS" ] && [ $missed -lt "$TRIALS" ]; do
    i=$((i + 1))
    r=$(rnd $((SEED * 1000 + i)))
    # odd trials aim at the prefill (~the first 500 ms), even ones at the decode
    at=$(awk -v r="$r" -v b="$BASE" -v i="$i" \
        'BEGIN { printf "%d", (i % 2) ? 10 + r * 110 : 300 + r * (0.6 * b - 300) }')
    # everything random is drawn before the run: the kill is not late by a python start
    pick=$(awk -v r="$(rnd $((SEED * 7777 + i)))" 'BEGIN { print (r < 0.5) ? 1 : 2 }')
    gen_bg "$T/k$i.out" "$T/k$i.err" --local 2 --ngen 24
    for _ in $(seq 400); do grep -q 'stage 1:' "$T/k$i.err" && break; sleep 0.01; done
    start=$(ms_now)
    sleep "$(awk -v a="$at" 'BEGIN { print a / 1000 }')"
    victim=$(grep -o "started local worker $((pick - 1)) (pid [0-9]*" "$T/k$i.err" | grep -o '[0-9]*$')
    phase=prefill # until the last prefill chunk (n/n) was reported
    grep -q 'prefill: chunk \([0-9]*\)/\1,' "$T/k$i.err" && phase=decode
    hit=0
    grep -q 'stop: ' "$T/k$i.err" || { [ -n "$victim" ] && kill -9 "$victim" 2>/dev/null && hit=1; }
    echo "# trial $i: kill -9 of worker $pick (pid ${victim:-none}) at $at ms, $phase"
    wait $cpid
    if [ $hit -eq 0 ] || grep -q 'ended with status 0x9' "$T/k$i.err"; then
        # the generation had ended first (the kill met the shutdown): not a trial
        missed=$((missed + 1))
        continue
    fi
    took=$(($(ms_now) - start))
    rec=$((took - BASE))
    [ $rec -lt 0 ] && rec=0
    [ "$phase" = prefill ] && pre=$((pre + 1)) || dec=$((dec + 1))
    [ "$(grep '^ids:' "$T/k$i.out")" = "$REF" ] && ok_n=$((ok_n + 1))
    grep -q "(pid $victim) killed by signal 9" "$T/k$i.err" && err_n=$((err_n + 1))
    account "$T/k$i.out" $rec
done
row "kill -9 of a random --local worker at a seeded time ($pre in prefill, $dec in decode; $missed after the run had ended, not counted)" \
    "$((pre + dec))" "$ok_n" "$err_n" "$rss kB" "$worst ms"
[ $((pre + dec)) -eq "$TRIALS" ] && [ $ok_n -eq "$TRIALS" ] && [ $err_n -eq "$TRIALS" ] || bad "kill -9: $ok_n/$TRIALS identical, $err_n named"

# 2. SIGSTOP for 0.5-2 x TTL (TTL = 3 x 200 ms)
ok_n=0 err_n=0 rss=0 worst=0 n=5
for i in $(seq $n); do
    r=$(rnd $((SEED * 3000 + i)))
    stop_ms=$(awk -v r="$r" 'BEGIN { printf "%d", 300 + r * 900 }')
    gen_bg "$T/s$i.out" "$T/s$i.err" --local 2 --ngen 24
    for _ in $(seq 400); do grep -q 'prefill: chunk' "$T/s$i.err" && break; sleep 0.01; done
    start=$(ms_now)
    victim=$(grep -o "started local worker $((i % 2)) (pid [0-9]*" "$T/s$i.err" | grep -o '[0-9]*$')
    kill -STOP "$victim"
    sleep "$(awk -v a="$stop_ms" 'BEGIN { print a / 1000 }')"
    kill -CONT "$victim"
    wait $cpid
    rec=$(($(ms_now) - start - BASE))
    [ $rec -lt 0 ] && rec=0
    [ "$(grep '^ids:' "$T/s$i.out")" = "$REF" ] && ok_n=$((ok_n + 1))
    # past TTL the loss must be named; under it the step just waits
    if [ "$stop_ms" -gt 600 ]; then
        grep -q 'lost\|resuming' "$T/s$i.err" && err_n=$((err_n + 1))
    else
        err_n=$((err_n + 1))
    fi
    account "$T/s$i.out" $rec
done
row "SIGSTOP of a --local worker for 0.5-2 x TTL (TTL 600 ms), then SIGCONT" \
    "$n" "$ok_n" "$err_n (a loss named when past TTL)" "$rss kB" "$worst ms"
[ $ok_n -eq $n ] || bad "SIGSTOP: $ok_n/$n identical"

# 3. a worker of another model (another fingerprint) is refused
ep="tcp://127.0.0.1:$(port)"
K3_TOPP=0.5 "$W" --model "$TINY" --layers 0-8 --listen "$ep" --threads 1 --no-bench \
    2>"$T/other.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q 'serving layers' "$T/other.log" && break; sleep 0.05; done
t0=$(ms_now)
gen "$T/o.out" "$T/o.err" --workers "$ep" --ngen 4 --ready-timeout-ms 5000
rc=$?
dt=$(($(ms_now) - t0))
named=0
[ $rc -eq 1 ] && grep -q 'fingerprint mismatch' "$T/o.err" && named=1
row "a worker restarted with another model (fingerprint) under the coordinator" 1 \
    "n/a (refused)" "$named (refused in $dt ms)" "$(peak "$T/o.out") kB" "-"
[ $named -eq 1 ] || bad "another model not refused: $(tail -1 "$T/o.err")"

# 4. unauthenticated peers: tests/test_peer_budget's rows
RELIABILITY_OVERSIZED=1000 RELIABILITY_OVERSIZED_MB=2 "$BUILD/tests/test_peer_budget" \
    >"$T/pb.out" 2>"$T/pb.err"
grep -q '^not ok' "$T/pb.out" && bad "test_peer_budget: $(grep '^not ok' "$T/pb.out" | head -1)"
while IFS='|' read -r _ what n rec errs rss t; do
    row "$what" "$n" "$rec" "$errs" "$rss" "$t"
done < <(grep '^# row|' "$T/pb.out")

# 5. the rows of tests/reliability/row_*.sh: row_netdrop.sh (iptables DROP
# on a namespace link), row_disk.sh (EIO on an expert read, full disk),
# row_http.sh (the HTTP rows), row_coord_restart.sh (the coordinator killed
# -9 and restarted with a session on disk; when that file exists). The
# contract of a row script: run as `bash SCRIPT` with BUILD and TINY set; it
# prints one line per row,
#     ROW|what|trials|recovered|errors|max_rss|max_recovery
# (fields without '|'; '-' where none), any ok / not ok / skip / # lines,
# and exits non-zero when a row is not as required (root-only rows print a
# ROW saying "not run (needs root)" and exit 0 without root).
for s in "$(dirname "$0")"/row_*.sh; do
    [ -f "$s" ] || continue
    n=$(basename "$s" .sh)
    bash "$s" >"$T/$n.out" 2>"$T/$n.err"
    rc=$?
    grep '^not ok\|^skip\|^# ' "$T/$n.out" | sed "s/^/# $n: /"
    [ $rc -eq 0 ] || bad "$n: exit status $rc: $(grep '^not ok' "$T/$n.out" | head -3)"
    while IFS='|' read -r _ what n_ rec errs rss t; do
        row "$what" "$n_" "$rec" "$errs" "$rss" "$t"
    done < <(grep '^ROW|' "$T/$n.out")
    grep -q '^ROW|' "$T/$n.out" || row "$n" "-" "failed" "-" "-" "- (no ROW line: $(tail -1 "$T/$n.err"))"
done
[ -f "$(dirname "$0")/row_coord_restart.sh" ] ||
    row "coordinator killed and restarted with a session on disk" "-" "n/a" "-" "-" \
        "- (no tests/reliability/row_coord_restart.sh: no checkpoints in this build)"

echo
printf '| %s | %s | %s | %s | %s | %s |\n' "fault" "trials" "recovered token-identically" \
    "errors reported" "max RSS" "max recovery time"
echo "|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do
    IFS='|' read -r a b c d e f <<<"$r"
    printf '| %s | %s | %s | %s | %s | %s |\n' "$a" "$b" "$c" "$d" "$e" "$f"
done
echo
[ $fail -eq 0 ] && ok "make reliability: every row as required" || bad "make reliability: see above"
exit $fail
