#!/usr/bin/env bash
# tests/reliability/row_netdrop.sh: the "iptables DROP on a namespace link"
# row of `make reliability` (docs/RELIABILITY.md "The table"); run by
# run.sh, or alone.
# Two network namespaces joined by a veth pair (k3relA<pid>, k3relB<pid>):
# two workers in B, the coordinator in A, over tcp with CURVE as a cluster
# runs (keys from k3-coordinator keygen, an allow-list, the workers' public
# keys). Mid-generation every packet from A is dropped in B's INPUT chain
# (iptables -j DROP) for a seeded time, then the rule is deleted:
#  under TTL (3 x --hb-ms 200 = 600 ms): tcp retransmits, the step waits;
#    the ids must be the undisturbed run's;
#  past TTL, within the resume deadline (--resume-wait-ms 8000): the loss
#    is named, the generation resumes (reset + replay) once the link is
#    back; the ids must be the undisturbed run's;
#  past the resume deadline (--resume-wait-ms 1500 --resumes 1, a 12 s
#    DROP): the run must end with an error naming the worker, in bounded
#    time; after the rule is deleted, the next run must be token-identical.
# Prints `ROW|what|trials|recovered|errors|max_rss|max_recovery` (run.sh's
# format), ok / not ok lines; exits 1 when the row is not as required.
# Needs root (ip netns, iptables): a ROW saying so otherwise.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
WHAT="iptables DROP on a namespace link"
if [ "$(id -u)" -ne 0 ]; then
    echo "ROW|$WHAT|-|not run|-|-|- (needs root)"
    skip "$WHAT" "needs root"
    exit 0
fi
C=$(readlink -f "$C")
W=$(readlink -f "$W")
TINY=$(readlink -f "$TINY")
NA=k3relA$$ NB=k3relB$$ VA=k3rva$$ VB=k3rvb$$
SEED=${RELIABILITY_SEED:-20}
make_tmp k3rel_drop
cleanup() {
    k3_cleanup
    ip netns pids "$NA" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns pids "$NB" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$NA" 2>/dev/null
    ip netns del "$NB" 2>/dev/null
    ip link del "$VA" 2>/dev/null
}
trap cleanup EXIT
if ! { ip netns add "$NA" && ip netns add "$NB" && ip link add "$VA" type veth peer name "$VB" &&
    ip link set "$VA" netns "$NA" && ip link set "$VB" netns "$NB" &&
    ip -n "$NA" addr add 10.74.0.1/24 dev "$VA" && ip -n "$NB" addr add 10.74.0.2/24 dev "$VB" &&
    ip -n "$NA" link set "$VA" up && ip -n "$NB" link set "$VB" up &&
    ip -n "$NA" link set lo up && ip -n "$NB" link set lo up; } 2>"$T/ns.err"; then
    echo "ROW|$WHAT|-|not run|-|-|- (no namespaces here: $(head -1 "$T/ns.err"))"
    skip "$WHAT" "cannot create two namespaces with a veth pair: $(head -1 "$T/ns.err")"
    exit 0
fi
if ! ip netns exec "$NB" iptables -S >/dev/null 2>"$T/ipt.err"; then
    echo "ROW|$WHAT|-|not run|-|-|- (no iptables: $(head -1 "$T/ipt.err"))"
    skip "$WHAT" "iptables does not work here"
    exit 0
fi
export K3_LOG=info K3_LOG_TIME=0
for k in coord w0 w1; do "$C" keygen "$T/$k" >/dev/null 2>&1; done
cp "$T/coord.pub" "$T/allow"
P0=27410 P1=27411
printf 'tcp://10.74.0.2:%s %s\ntcp://10.74.0.2:%s %s\n' \
    $P0 "$(sed -n 's/^public = //p' "$T/w0.pub")" $P1 "$(sed -n 's/^public = //p' "$T/w1.pub")" >"$T/wkeys"
EP=tcp://10.74.0.2:$P0,tcp://10.74.0.2:$P1
worker() { # name a b port
    ip netns exec "$NB" env K3_WORKER_FAULT=slow=25 "$W" --model "$TINY" --layers "$2-$3" \
        --listen "tcp://10.74.0.2:$4" --curve-secret "$T/$1.key" --allow "$T/allow" \
        --threads 1 --no-bench --hb-ms 200 --name "$1" 2>>"$T/workers.log" &
    PIDS+=($!)
}
worker w0 0 4 $P0
worker w1 4 8 $P1
for _ in $(seq 200); do [ "$(grep -c serving "$T/workers.log")" -ge 2 ] && break; sleep 0.05; done

IDS=$(/usr/bin/python3 -c 'import random; r=random.Random(5); print(",".join(str(r.randrange(1280)) for _ in range(40)))')
ms_now() { echo $(($(date +%s%N) / 1000000)); }
peak() { tail -1 "$1" 2>/dev/null | grep -E '^[0-9]+$' || echo 0; }
rnd() { /usr/bin/python3 -c "import random; print(random.Random($1).random())"; }
coord_bg() { # name args...: the coordinator in A, in the background ($cpid)
    local name=$1
    shift
    rm -f "$T/$name.end"
    (
        timeout 120 ip netns exec "$NA" /usr/bin/time -f '%M' -o "$T/$name.rss" "$C" --model "$TINY" \
            --ids "$IDS" --ngen 24 --chunk 4 --threads 1 --print-ids --hb-ms 200 --usage off \
            --workers "$EP" --curve-secret "$T/coord.key" --worker-keys "$T/wkeys" "$@" \
            >"$T/$name.out" 2>"$T/$name.err"
        rc=$?
        ms_now >"$T/$name.end" # when it ended, whatever the DROP's sleep
        exit $rc
    ) &
    cpid=$!
}
drop() { ip netns exec "$NB" iptables -"$1" INPUT -s 10.74.0.1 -j DROP; }

coord_bg ref
wait_line "$T/ref.err" 'stage 1:' $cpid 60
t0=$(ms_now)
wait $cpid
BASE=$(($(cat "$T/ref.end") - t0))
REF=$(grep '^ids:' "$T/ref.out")
if [ -z "$REF" ]; then
    bad "$WHAT: the undisturbed run over CURVE failed: $(tail -2 "$T/ref.err")"
    echo "ROW|$WHAT|-|failed|-|-|- (the undisturbed run failed)"
    exit 1
fi
echo "# netdrop reference: $BASE ms from the cluster's stage 1 to the end (CURVE, slow=25)"

n=0 ok_n=0 err_n=0 rss=0 worst=0 short=0 mid=0 long=0 errms=-
one() { # i kind drop_ms args...: a run with a DROP of drop_ms at 400 ms after stage 1
    local i=$1 kind=$2 ms=$3
    shift 3
    coord_bg d$i "$@"
    wait_line "$T/d$i.err" 'stage 1:' $cpid 60
    sleep 0.4
    local start
    start=$(ms_now)
    drop A
    sleep "$(awk -v a="$ms" 'BEGIN { print a / 1000 }')"
    drop D
    wait $cpid
    local rc=$? took rec r
    took=$(($(cat "$T/d$i.end") - start))
    rec=$((took + 400 - BASE))
    [ $rec -lt 0 ] && rec=0
    r=$(peak "$T/d$i.rss")
    [ "$r" -gt "$rss" ] && rss=$r
    n=$((n + 1))
    local same=0
    [ "$(grep '^ids:' "$T/d$i.out")" = "$REF" ] && same=1
    case $kind in
    short)
        short=$((short + 1))
        [ $same -eq 1 ] && ok_n=$((ok_n + 1)) err_n=$((err_n + 1)) ||
            bad "DROP $ms ms (< TTL): rc $rc, ids differ: $(tail -1 "$T/d$i.err")"
        ;;
    mid)
        mid=$((mid + 1))
        [ $same -eq 1 ] && ok_n=$((ok_n + 1)) ||
            bad "DROP $ms ms (> TTL): rc $rc, ids differ: $(tail -1 "$T/d$i.err")"
        grep -q 'lost\|resuming' "$T/d$i.err" && err_n=$((err_n + 1)) ||
            bad "DROP $ms ms (> TTL): the loss was not named"
        ;;
    long)
        long=$((long + 1))
        if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q '^k3-coordinator: error: .*worker w[01]' "$T/d$i.err"; then
            err_n=$((err_n + 1))
            ok "DROP $ms ms (> resume deadline): rc $rc $took ms after the DROP began: $(grep -m1 '^k3-coordinator: error:' "$T/d$i.err" | cut -c1-200)"
        else
            bad "DROP $ms ms (> resume deadline): rc $rc, no error naming the worker: $(tail -1 "$T/d$i.err")"
        fi
        coord_bg after$i
        wait $cpid
        if [ "$(grep '^ids:' "$T/after$i.out")" = "$REF" ]; then
            ok_n=$((ok_n + 1))
            ok "DROP $ms ms: with the rule deleted, the next run is token-identical"
        else
            bad "DROP $ms ms: the next run after the restore: $(tail -1 "$T/after$i.err")"
        fi
        errms=$took
        took=0 # no recovery inside the run: an error, then a new run
        ;;
    esac
    [ $took -gt 0 ] && [ $rec -gt "$worst" ] && worst=$rec
    echo "# netdrop trial $i: DROP $ms ms ($kind), rc $rc, ids $([ $same -eq 1 ] && echo identical || echo differ), $took ms from the DROP to the end"
}
for i in 1 2; do
    one $i short "$(awk -v r="$(rnd $((SEED * 5000 + i)))" 'BEGIN { printf "%d", 100 + r * 300 }')"
done
for i in 3 4; do
    one $i mid "$(awk -v r="$(rnd $((SEED * 5000 + i)))" 'BEGIN { printf "%d", 1000 + r * 2000 }')" \
        --resume-wait-ms 8000
done
one 5 long 12000 --resume-wait-ms 1500 --resumes 1
echo "ROW|iptables DROP of the coordinator's packets on a namespace link, CURVE tcp ($short under TTL 600 ms, $mid of 1-3 s past TTL, $long of 12 s past the resume deadline: an error, then the next run)|$n|$ok_n|$err_n (the loss named past TTL; the worker named in the error, $errms ms after the DROP began)|$rss kB|$worst ms"
[ $ok_n -eq $n ] && [ $err_n -eq $n ] && ok "$WHAT: $n trials, $ok_n token-identical, $err_n named" ||
    bad "$WHAT: $ok_n/$n token-identical, $err_n/$n named"
exit $fail
