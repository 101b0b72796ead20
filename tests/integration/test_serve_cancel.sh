#!/usr/bin/env bash
# tests/integration/test_serve_cancel.sh: a client that goes away stops its
# generation (docs/SERVING.md "Cancellation"), and GET /health and GET
# /metrics say so. `k3-coordinator serve` on tiny with 2 local workers,
# --chunk 1 (so a long prompt's prefill takes ~1 ms per token and a client
# can leave in the middle of it) and --max-queue 2:
#   - a stream whose client leaves mid-prefill, one that leaves mid-decode
#     and a non-stream request that leaves mid-decode: each generation is
#     logged as cancelled with fewer tokens than asked (prefilled < prompt,
#     generated < max_tokens), the running count is back to 0 within 1.5 s
#     of the disconnect, while the uncancelled run would take seconds more;
#   - no leak: after 6 more aborted streams the engine holds at most
#     --max-sessions sessions, none busy, and each worker holds no more session
#     states than the engine has sessions (/health "sessions");
#   - the next request succeeds, and a second turn that extends the first
#     reports the reused prompt tokens as usage.prompt_tokens_details.
#     cached_tokens;
#   - /health has the per-worker fields and /metrics the counters
#     (requests, cancelled, tokens, per-stage busy seconds, expert bytes).
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp k3serve_cancel
PY=/usr/bin/python3

P=$(port)
serve_start "$T/out" "$T/err" --model "$TINY" --local 2 --port "$P" --ctx 8192 --chunk 1 \
    --max-queue 2 --max-sessions 3 || {
    bad "serve did not start: $(tail -3 "$T/err")"
    exit 1
}
URL=http://127.0.0.1:$P
J=(-H "Content-Type: application/json")

# health FIELD: one top-level field of /health
health() { curl -s "$URL/health" | $PY -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

# idle_within SECONDS: 0 when /health's running count is 0 in time; the
# longest wait so far in MAX_IDLE_MS (make reliability's row)
MAX_IDLE_MS=0
idle_within() {
    local end t0 ms
    end=$($PY -c "import time; print(time.time() + $1)")
    t0=$(date +%s%N)
    while $PY -c "import sys,time; sys.exit(0 if time.time() < $end else 1)"; do
        if [ "$(health running)" = 0 ]; then
            ms=$((($(date +%s%N) - t0) / 1000000))
            [ $ms -gt $MAX_IDLE_MS ] && MAX_IDLE_MS=$ms
            return 0
        fi
        sleep 0.05
    done
    return 1
}

# the nth "cancelled" log line's counts: PROMPT PREFILLED GENERATED
cancel_line() {
    grep "cancelled: the client went away" "$T/err" | sed -n "${1}p" |
        sed -E 's/.*prompt ([0-9]+) tokens \([0-9]+ reused, ([0-9]+) prefilled.*\), ([0-9]+) generated.*/\1 \2 \3/'
}

LONG=$($PY -c "print('the quick brown fox jumps over the lazy dog ' * 300)")

# ---- mid-prefill: ~2700 prompt tokens at ~1 ms each, the client leaves at 0.7 s ----
$PY -c "import json,sys; print(json.dumps({'prompt': sys.argv[1], 'stream': True, 'max_tokens': 50}))" \
    "$LONG" >"$T/long.json"
curl -s -N "${J[@]}" --max-time 0.7 -d @"$T/long.json" "$URL/v1/completions" >/dev/null
t0=$(date +%s.%N)
if idle_within 1.5; then
    ok "mid-prefill disconnect: running back to 0 in $($PY -c "print('%.2f' % ($(date +%s.%N) - $t0))") s"
else
    bad "mid-prefill disconnect: still running after 1.5 s: $(curl -s "$URL/health" | head -c 200)"
fi
read -r np nf ng <<<"$(cancel_line 1)"
if [ -n "$np" ] && [ "$nf" -lt "$np" ] && [ "$ng" = 0 ]; then
    ok "mid-prefill disconnect: cancelled after $nf of $np prompt tokens, nothing generated"
else
    bad "mid-prefill disconnect: log '$(grep cancelled "$T/err" | head -1)'"
fi

# ---- mid-decode, stream: 6000 tokens at ~1-2 ms each, the client leaves at 0.7 s ----
DEC='{"prompt":"hi","stream":true,"max_tokens":6000,"temperature":1.5,"seed":3}'
curl -s -N "${J[@]}" --max-time 0.7 -d "$DEC" "$URL/v1/completions" >"$T/dec"
t0=$(date +%s.%N)
idle_within 1.5 && ok "mid-decode stream disconnect: running back to 0 in $($PY -c "print('%.2f' % ($(date +%s.%N) - $t0))") s" ||
    bad "mid-decode stream disconnect: still running after 1.5 s"
read -r np nf ng <<<"$(cancel_line 2)"
if [ -n "$ng" ] && [ "$ng" -gt 0 ] && [ "$ng" -lt 6000 ] && grep -q '"text"' "$T/dec"; then
    ok "mid-decode stream disconnect: cancelled after $ng of 6000 tokens (the client got deltas)"
else
    bad "mid-decode stream disconnect: log '$(grep cancelled "$T/err" | sed -n 2p)'"
fi

# ---- mid-decode, non-stream ----
curl -s "${J[@]}" --max-time 0.7 -d '{"prompt":"hi","max_tokens":6000,"temperature":1.5,"seed":4}' \
    "$URL/v1/completions" >/dev/null
t0=$(date +%s.%N)
idle_within 1.5 && ok "mid-decode non-stream disconnect: running back to 0 in $($PY -c "print('%.2f' % ($(date +%s.%N) - $t0))") s" ||
    bad "mid-decode non-stream disconnect: still running after 1.5 s"
read -r np nf ng <<<"$(cancel_line 3)"
[ -n "$ng" ] && [ "$ng" -lt 6000 ] &&
    ok "mid-decode non-stream disconnect: cancelled after $ng of 6000 tokens" ||
    bad "mid-decode non-stream disconnect: log '$(grep cancelled "$T/err" | sed -n 3p)'"

# ---- no leak after 6 more aborted streams (2 at a time) ----
for i in 1 2 3; do
    curl -s -N "${J[@]}" --max-time 0.4 -d "{\"prompt\":\"x$i\",\"stream\":true,\"max_tokens\":6000,\"temperature\":1.5,\"seed\":$i}" \
        "$URL/v1/completions" >/dev/null &
    c1=$!
    curl -s -N "${J[@]}" --max-time 0.4 -d @"$T/long.json" "$URL/v1/completions" >/dev/null &
    c2=$!
    wait "$c1" "$c2"
    idle_within 1.5 || bad "aborted pair $i: still running after 1.5 s"
done
idle_within 1.5 || bad "aborted streams: still running after 1.5 s"
curl -s "$URL/health" >"$T/health.json"
if $PY - "$T/health.json" <<'EOF'; then
import json, sys
h = json.load(open(sys.argv[1]))
ws = h["workers"]
ok = h["sessions"] <= 3 and h["max_sessions"] == 3 and h["sessions_busy"] == 0 and h["running"] == 0 and len(ws) == 2
ok = ok and all("sessions" in w and w["sessions"] <= h["sessions"] for w in ws)
print("# engine sessions %d, busy %d; worker sessions %s" %
      (h["sessions"], h["sessions_busy"], [w.get("sessions") for w in ws]))
sys.exit(0 if ok else 1)
EOF
    ok "no leak after 9 aborts: engine sessions <= --max-sessions 3, none busy, worker states <= engine sessions"
else
    bad "leak after aborts: $(head -c 400 "$T/health.json")"
fi
n=$(grep -c "cancelled: the client went away" "$T/err")
[ "$n" -ge 9 ] && ok "every aborted request was cancelled ($n log lines)" ||
    bad "cancelled log lines: $n, want >= 9"

# ---- the next requests succeed; a second turn reuses the first ----
T1='{"messages":[{"role":"user","content":"Name a colour."}],"max_tokens":8,"temperature":0}'
curl -s "${J[@]}" -d "$T1" "$URL/v1/chat/completions" >"$T/t1.json"
next=0
grep -q '"completion_tokens":[1-9]' "$T/t1.json" && next=1
# a row of make reliability's table (tests/reliability/row_http.sh)
echo "# row|HTTP: clients that disconnect mid-prefill and mid-decode (stream and not), then 6 more aborted 2 at a time|9|$next (the next request succeeds; no session leaked)|$n cancellations logged|$(awk '/^VmHWM:/ {print $2}' "/proc/$SRV/status") kB|$MAX_IDLE_MS ms to running 0"
grep -q '"completion_tokens":[1-9]' "$T/t1.json" && ok "after the aborts a chat request succeeds" ||
    bad "chat after aborts: $(head -c 300 "$T/t1.json")"
# a second turn: turn 1 stops after 1 token (which is not fed back), so its
# committed ids are exactly its prompt, which turn 2's rendering starts with
# (a longer answer is reused only as far as its re-rendered ids equal the
# generated ones: docs/SERVING.md "Sessions")
curl -s "${J[@]}" -d '{"messages":[{"role":"user","content":"Name a colour."}],"max_tokens":1,"temperature":0}' \
    "$URL/v1/chat/completions" >"$T/c1.json"
$PY - "$T/c1.json" >"$T/c2.req" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"messages": [{"role": "user", "content": "Name a colour."},
                               {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                               {"role": "user", "content": "Another one, please."}],
                  "max_tokens": 2, "temperature": 0}))
EOF
curl -s "${J[@]}" -d @"$T/c2.req" "$URL/v1/chat/completions" >"$T/c2.json"
if $PY - "$T/c1.json" "$T/c2.json" <<'EOF'; then
import json, sys
u1 = json.load(open(sys.argv[1]))["usage"]
u2 = json.load(open(sys.argv[2]))["usage"]
c = u2["prompt_tokens_details"]["cached_tokens"]
print("# turn 1: prompt %d; turn 2: prompt %d, cached %d, prefilled %d" %
      (u1["prompt_tokens"], u2["prompt_tokens"], c, u2["prompt_tokens"] - c))
sys.exit(0 if c == u1["prompt_tokens"] and u2["prompt_tokens"] > c else 1)
EOF
    ok "second turn: cached_tokens = turn 1's prompt, only the new tokens prefilled"
else
    bad "second turn reuse: $(head -c 300 "$T/c2.json")"
fi

# ---- /health and /metrics ----
if $PY - "$T/health.json" <<'EOF'; then
import json, sys
h = json.load(open(sys.argv[1]))
need = ["index", "endpoint", "layers", "dirs", "numa", "alive", "busy_s", "hit_rate", "gb_read"]
ws = h["workers"]
ok = all(all(k in w for k in need) for w in ws) and all(w["alive"] for w in ws)
ok = ok and ws[0]["layers"][0] == 0 and ws[1]["layers"][1] == h["layers"] - 1
ok = ok and ws[0]["layers"][1] + 1 == ws[1]["layers"][0]
ok = ok and all(w["busy_s"] > 0 and w["gb_read"] > 0 and 0 < w["hit_rate"] <= 1 for w in ws)
sys.exit(0 if ok and h["status"] == "ok" and "queue" in h else 1)
EOF
    ok "/health: per-worker index, endpoint, layers (contiguous), dirs, numa, alive, busy_s > 0, hit_rate, gb_read > 0"
else
    bad "/health fields: $(head -c 600 "$T/health.json")"
fi
curl -s -D "$T/mhdr" "$URL/metrics" >"$T/metrics"
if $PY - "$T/metrics" <<'EOF'; then
import re, sys
v = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    name, val = line.rsplit(" ", 1)
    v[name] = float(val)
need = ["k3_requests_total", "k3_requests_cancelled_total", "k3_prompt_tokens_total",
        "k3_completion_tokens_total", "k3_prefill_tokens_per_second",
        "k3_decode_tokens_per_second", "k3_queue_depth", "k3_sessions"]
ok = all(k in v for k in need)
ok = ok and v["k3_requests_cancelled_total"] >= 9 and v["k3_requests_total"] >= 11
ok = ok and v["k3_prompt_tokens_cached_total"] > 0 and v["k3_queue_depth"] == 0
busy = [k for k in v if k.startswith("k3_stage_busy_seconds_total{")]
xb = [k for k in v if k.startswith("k3_expert_bytes_read_total{")]
ok = ok and len(busy) == 2 and len(xb) == 2 and all(v[k] > 0 for k in busy + xb)
print("# requests %d, cancelled %d, cached %d, prefill %.0f tok/s, decode %.0f tok/s" %
      (v["k3_requests_total"], v["k3_requests_cancelled_total"],
       v["k3_prompt_tokens_cached_total"], v["k3_prefill_tokens_per_second"],
       v["k3_decode_tokens_per_second"]))
sys.exit(0 if ok else 1)
EOF
    ok "/metrics: counters, rates, queue depth, per-stage busy seconds and expert bytes"
else
    bad "/metrics: $(head -c 600 "$T/metrics")"
fi
grep -qi '^Content-Type: text/plain; version=0.0.4' "$T/mhdr" && ok "/metrics: Prometheus text content type" ||
    bad "/metrics content type: $(grep -i content-type "$T/mhdr")"

kill -TERM "$SRV"
rc=0
wait "$SRV" || rc=$?
PIDS=()
[ "$rc" = 0 ] && ok "SIGTERM: exit 0" || bad "SIGTERM: exit status $rc: $(tail -3 "$T/err")"
exit $fail
