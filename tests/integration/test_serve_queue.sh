#!/usr/bin/env bash
# tests/integration/test_serve_queue.sh: the waiting queue of `serve`
# (docs/SERVING.md "Sessions and concurrency"). On tiny, with one local
# worker whose every FORWARD takes 250 ms longer (K3_WORKER_FAULT=slow=250)
# and --chunk 1, so a request of a dozen prompt tokens takes seconds on any
# machine (tiny itself prefills thousands of tokens a second), with
# --parallel 1 --max-queue 3; every prompt starts differently, so no
# request reuses another's session state:
#   - 5 requests sent 0.1 s apart: the first runs, the next two wait (while
#     they do, /health says queue 2, running 1 and /metrics k3_queue_depth
#     2), the last two get 429 queue_full with Retry-After at once;
#   - the three admitted ones all answer 200, in arrival order, and the
#     metrics count 2 generations that waited; afterwards the queue is empty;
#   - a request after them is served at once (queue 0);
#   - a client that leaves while it waits leaves the queue within ~250 ms
#     (k3_requests_left_waiting_total 1) and is not run.
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp k3serve_queue
PY=/usr/bin/python3

P=$(port)
K3_WORKER_FAULT=slow=250 serve_start "$T/out" "$T/err" --model "$TINY" --local 1 --threads 1 --port "$P" --ctx 8192 \
    --chunk 1 --parallel 1 --max-queue 3 --max-sessions 3 || {
    bad "serve did not start: $(tail -3 "$T/err")"
    exit 1
}
URL=http://127.0.0.1:$P
health() { curl -s "$URL/health" | $PY -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
metric() { curl -s "$URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }

LONG="tell me about the quick brown fox"
for i in 1 2 3 4 5; do
    $PY -c "import json,sys; print(json.dumps({'prompt': 'request $i: ' + sys.argv[1], 'max_tokens': 2}))" \
        "$LONG" >"$T/req$i.json"
done
CLIENTS=()
for i in 1 2 3 4 5; do
    (
        curl -s -D "$T/hdr$i" -o "$T/body$i" -w '%{http_code}' --max-time 120 \
            -H "Content-Type: application/json" -d @"$T/req$i.json" "$URL/v1/completions" \
            >"$T/code$i"
        date +%s%N >"$T/end$i"
    ) &
    CLIENTS+=($!)
    sleep 0.1
done
sleep 0.2
q=$(health queue)
r=$(health running)
d=$(metric k3_queue_depth)
if [ "$q" = 2 ] && [ "$r" = 1 ] && [ "$d" = 2 ]; then
    ok "while one runs and two wait: /health queue $q, running $r; /metrics k3_queue_depth $d"
else
    bad "while one runs and two wait: /health queue '$q', running '$r', k3_queue_depth '$d'"
fi
for i in 4 5; do
    code=$(cat "$T/code$i" 2>/dev/null)
    if [ "$code" = 429 ] && grep -qi '^retry-after:' "$T/hdr$i" && grep -q '"queue_full"' "$T/body$i"; then
        ok "request $i, past --max-queue 3: 429 queue_full with Retry-After, at once"
    else
        bad "request $i: status '$code', expected 429 queue_full with Retry-After before the others end"
    fi
done
wait "${CLIENTS[@]}"
ends=()
all=1
for i in 1 2 3; do
    [ "$(cat "$T/code$i")" = 200 ] || all=0
    ends+=("$(cat "$T/end$i")")
done
if [ $all -eq 1 ] && [ "${ends[0]}" -le "${ends[1]}" ] && [ "${ends[1]}" -le "${ends[2]}" ]; then
    ok "the running one and the two that waited answer 200, in arrival order"
else
    bad "admitted requests: $(cat "$T/code1") $(cat "$T/code2") $(cat "$T/code3"), ends ${ends[*]}"
fi
qd=$(metric k3_requests_queued_total)
rj=$(metric k3_requests_rejected_total)
if [ "$qd" = 2 ] && [ "$rj" = 2 ] && [ "$(health queue)" = 0 ] && [ "$(health running)" = 0 ]; then
    ok "metrics: 2 generations waited, 2 refused; the queue is empty again"
else
    bad "metrics: queued '$qd' rejected '$rj', queue $(health queue), running $(health running)"
fi
code=$(curl -s -o /dev/null -w '%{http_code}' -H "Content-Type: application/json" \
    -d '{"prompt": "hello", "max_tokens": 2}' "$URL/v1/completions")
[ "$code" = 200 ] && ok "the next request is served (200)" || bad "the next request: $code"

# a waiting client that goes away: one request runs (a prompt not sent
# before: seconds of slowed steps, not a reused session), the second gives
# up after 0.8 s of waiting
for i in 6 7; do
    $PY -c "import json,sys; print(json.dumps({'prompt': 'request $i: ' + sys.argv[1], 'max_tokens': 2}))" \
        "$LONG" >"$T/req$i.json"
done
curl -s -o /dev/null -H "Content-Type: application/json" -d @"$T/req6.json" \
    "$URL/v1/completions" &
RUN=$!
sleep 0.2
curl -s -o /dev/null --max-time 0.8 -H "Content-Type: application/json" -d @"$T/req7.json" \
    "$URL/v1/completions"
sleep 0.6
q=$(health queue)
lw=$(metric k3_requests_left_waiting_total)
[ "$q" = 0 ] && [ "$lw" = 1 ] &&
    ok "a client that left while waiting left the queue (queue $q, k3_requests_left_waiting_total $lw)" ||
    bad "a client that left while waiting: queue '$q', k3_requests_left_waiting_total '$lw'"
wait "$RUN"
sleep 0.3
qd=$(metric k3_requests_queued_total)
[ "$qd" = 2 ] && ok "the client that left was never run (k3_requests_queued_total still $qd)" ||
    bad "the client that left: k3_requests_queued_total '$qd', expected 2"
exit $fail
