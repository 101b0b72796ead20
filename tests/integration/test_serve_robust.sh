#!/usr/bin/env bash
# tests/integration/test_serve_robust.sh: `k3-coordinator serve` under
# failure and abuse (docs/SERVING.md "Robustness"), on tiny with two k3-worker
# processes started here over tcp (--hb-ms 200: a silent worker is dead after
# 3 x 200 = 600 ms, the heartbeat TTL):
#   - kill -9 a worker during a stream (--resumes 0): the client gets an SSE
#     error event within 2 x TTL and the stream ends with [DONE]; the worker
#     is started again on its endpoint, /health shows it alive, and the next
#     request succeeds;
#   - a flood of 5,000 requests from a client bounded to 200 connections at
#     once while two long generations fill --max-queue 2: every answer is 200
#     or 429 (with Retry-After),
#     the server stays up and its resident memory grows by less than 64 MiB;
#   - slow-loris clients (--conn-timeout-s 2): connections that stop after
#     part of their headers are closed within the timeout (+2 s), and so are
#     those whose body trickles in at 1 byte per 0.4 s (a deadline from the
#     headers, not an idle timeout); /health answers meanwhile and afterwards.
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3serve_robust
PY=/usr/bin/python3
HB=200
TTL_MS=$((3 * HB))

EP=("tcp://127.0.0.1:$(port)" "tcp://127.0.0.1:$(port)")
RANGES=("0-4" "4-8")
WPID=()
start_worker() { # i
    "$W" --model "$TINY" --layers "${RANGES[$1]}" --listen "${EP[$1]}" --threads 1 --no-bench \
        --name "w$1" --hb-ms $HB 2>>"$T/workers.log" &
    WPID[$1]=$!
    PIDS+=("${WPID[$1]}")
}
start_worker 0
start_worker 1

P=$(port)
serve_start "$T/out" "$T/err" --model "$TINY" --workers "${EP[0]},${EP[1]}" --hb-ms $HB --resumes 0 --port "$P" \
    --max-queue 2 --max-sessions 4 --ctx 8192 --conn-timeout-s 2 --max-conns 256 || {
    bad "serve did not start: $(tail -3 "$T/err")"
    exit 1
}
URL=http://127.0.0.1:$P
J=(-H "Content-Type: application/json")

# ---- kill -9 a worker during a stream ----
curl -s -N "${J[@]}" --max-time 30 \
    -d '{"prompt":"hi","stream":true,"max_tokens":6000,"temperature":1.5,"seed":5}' \
    "$URL/v1/completions" >"$T/stream" &
CURL=$!
for _ in $(seq 1 200); do grep -q '"text"' "$T/stream" && break; sleep 0.02; done
t_kill=$(date +%s.%N) # the wait is measured from the kill, not from Python's start
kill -9 "${WPID[1]}"
ms=$($PY - "$T/stream" "$t_kill" <<'EOF'
import sys, time
t0 = float(sys.argv[2])
while time.time() - t0 < 20:
    if b'"error"' in open(sys.argv[1], "rb").read():
        break
    time.sleep(0.01)
print(int((time.time() - t0) * 1000))
EOF
)
wait "$CURL"
if grep -q '^data: {"error":' "$T/stream" && [ "$ms" -le $((2 * TTL_MS)) ]; then
    ok "kill -9 of a worker mid-stream: SSE error event after $ms ms (2 x TTL = $((2 * TTL_MS)) ms)"
else
    bad "kill -9 mid-stream: error event after $ms ms: $(grep -v '"text"' "$T/stream" | tail -c 300)"
fi
# a row of make reliability's table (tests/reliability/row_http.sh)
echo "# row|HTTP: kill -9 of a worker during a stream (--resumes 0)|1|n/a (the client gets an SSE error, then [DONE])|$(grep -c '^data: {"error":' "$T/stream") SSE error event|-|$ms ms to the error event"
tail -2 "$T/stream" | grep -q '^data: \[DONE\]$' && ok "the failed stream ends with [DONE]" ||
    bad "the failed stream does not end with [DONE]: $(tail -c 200 "$T/stream")"

start_worker 1
alive=0
for _ in $(seq 1 150); do
    curl -s "$URL/health" >"$T/h.json"
    if $PY -c "import json,sys; h=json.load(open(sys.argv[1])); sys.exit(0 if all(w['alive'] for w in h['workers']) else 1)" "$T/h.json" 2>/dev/null; then
        alive=1
        break
    fi
    sleep 0.1
done
[ $alive = 1 ] && ok "the restarted worker is alive again in /health" ||
    bad "restarted worker not alive: $(head -c 400 "$T/h.json")"
code=$(curl -s -o "$T/after.json" -w '%{http_code}' "${J[@]}" \
    -d '{"prompt":"hi","max_tokens":5,"temperature":0}' "$URL/v1/completions")
[ "$code" = 200 ] && grep -q '"finish_reason":"' "$T/after.json" &&
    ok "the next request after the worker returned succeeds" ||
    bad "request after the worker returned: $code $(head -c 300 "$T/after.json")"

# ---- a flood: 5,000 requests, at most 200 connections at once ----
rss() { awk '/^VmRSS:/ {print $2}' "/proc/$SRV/status"; }
# two long generations hold both running slots, so the flood meets a full
# queue (a flood answered one by one would take minutes on 2 cores)
HOLD=()
for i in 1 2; do
    curl -s -N "${J[@]}" --max-time 60 \
        -d "{\"prompt\":\"hold $i\",\"stream\":true,\"max_tokens\":7000,\"temperature\":1.5,\"seed\":$i}" \
        "$URL/v1/completions" >/dev/null &
    HOLD+=($!)
done
for _ in $(seq 1 100); do [ "$(curl -s "$URL/health" | grep -o '"running":[0-9]*')" = '"running":2' ] && break; sleep 0.05; done
rss0=$(rss)
$PY - "$P" >"$T/flood" <<'EOF'
import asyncio, collections, sys
port = int(sys.argv[1])
body = b'{"prompt":"hi","max_tokens":1}'
req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
       b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
counts = collections.Counter()
retry_after = [0]
async def one(sem):
    async with sem:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
            w.write(req)
            data = await asyncio.wait_for(r.read(), 30)
            w.close()
            head = data.split(b"\r\n\r\n", 1)[0].lower()
            status = head.split(b" ", 2)[1].decode() if data else "empty"
            if status == "429" and b"retry-after:" in head:
                retry_after[0] += 1
            counts[status] += 1
        except Exception as e:
            counts[type(e).__name__] += 1
async def main():
    sem = asyncio.Semaphore(200)
    await asyncio.gather(*(one(sem) for _ in range(5000)))
asyncio.run(main())
print(" ".join("%s=%d" % kv for kv in sorted(counts.items())), "retry_after=%d" % retry_after[0])
EOF
rss1=$(rss)
kill "${HOLD[@]}" 2>/dev/null
wait "${HOLD[@]}" 2>/dev/null
echo "# flood: $(cat "$T/flood"); VmRSS $rss0 -> $rss1 KiB"
hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$SRV/status")
echo "# row|HTTP: a flood of 5000 requests (200 connections at once) while 2 generations fill --max-queue 2|5000|real traffic answered (the 2 generations run on)|$(grep -o '200=[0-9]*' "$T/flood"), $(grep -o '429=[0-9]*' "$T/flood") all with Retry-After|$hwm kB (server peak; VmRSS +$(((rss1 - rss0) / 1024)) MiB)|-"
if $PY - "$(cat "$T/flood")" <<'EOF'; then
import sys
kv = dict(x.split("=") for x in sys.argv[1].split())
n200, n429 = int(kv.get("200", 0)), int(kv.get("429", 0))
other = {k: v for k, v in kv.items() if k not in ("200", "429", "retry_after")}
sys.exit(0 if n200 + n429 == 5000 and n429 > 0 and not other
         and int(kv["retry_after"]) == n429 else 1)
EOF
    ok "flood of 5000: only 200s and 429s (all 429s with Retry-After): $(cat "$T/flood")"
else
    bad "flood answers: $(cat "$T/flood")"
fi
# 64 MiB for the server's own buffers; a sanitized server keeps more: ASan's
# quarantine holds up to 256 MiB of freed blocks, TSan's shadow and history
# several bytes per byte touched
allow=64
ldd "$C" 2>/dev/null | grep -q 'libasan' && allow=$((64 + 256))
ldd "$C" 2>/dev/null | grep -q 'libtsan' && allow=$((64 + 512))
kill -0 "$SRV" 2>/dev/null && [ $((rss1 - rss0)) -lt $((allow * 1024)) ] &&
    ok "after the flood the server is up, resident memory +$(((rss1 - rss0) / 1024)) MiB (< $allow)" ||
    bad "after the flood: alive $(kill -0 "$SRV" 2>/dev/null && echo yes || echo no), VmRSS $rss0 -> $rss1 KiB"

# ---- slow-loris ----
$PY - "$P" >"$T/loris" <<'EOF'
import socket, sys, threading, time, urllib.request
port = int(sys.argv[1])
res = {"closed": [], "408": [], "health_ms": None}
lock = threading.Lock()
def partial_headers():
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.time()
    s.settimeout(10)
    try:
        s.recv(1)  # b"" at close (or a reset)
    except OSError:
        pass
    with lock:
        res["closed"].append(time.time() - t0)
    s.close()
def trickle_body():
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n")
    t0 = time.time()
    s.settimeout(0.05)
    closed = False
    for i in range(100):
        try:
            s.sendall(b" ")
            if s.recv(4096) == b"":
                closed = True
                break
        except socket.timeout:
            pass
        except OSError:
            closed = True
            break
        time.sleep(0.35)
    with lock:
        if closed:
            res["408"].append(time.time() - t0)
    s.close()
ts = [threading.Thread(target=partial_headers) for _ in range(30)]
ts += [threading.Thread(target=trickle_body) for _ in range(5)]
for t in ts:
    t.start()
time.sleep(0.5)
t0 = time.time()
ok = urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=5).status == 200
res["health_ms"] = int((time.time() - t0) * 1000) if ok else -1
for t in ts:
    t.join()
c, b = res["closed"], res["408"]
print("closed=%d max_closed_s=%.1f r408=%d max_408_s=%.1f health_ms=%d" %
      (len(c), max(c or [0]), len(b), max(b or [0]), res["health_ms"]))
EOF
echo "# slow-loris: $(cat "$T/loris")"
echo "# row|HTTP: slow-loris: 30 connections stuck in their headers, 5 bodies trickled at 1 byte / 0.35 s (--conn-timeout-s 2)|35|/health answered meanwhile in $(grep -o 'health_ms=[0-9-]*' "$T/loris" | cut -d= -f2) ms|$(grep -o 'closed=[0-9]*' "$T/loris" | cut -d= -f2) + $(grep -o 'r408=[0-9]*' "$T/loris" | cut -d= -f2) closed by the server|$(awk '/^VmHWM:/ {print $2}' "/proc/$SRV/status") kB|$(grep -o 'max_closed_s=[0-9.]*' "$T/loris" | cut -d= -f2) s to the last close"
read -r closed maxc r408 max408 hms <<<"$(tr '=' ' ' <"$T/loris" | awk '{print $2, $4, $6, $8, $10}')"
[ "$closed" = 30 ] && $PY -c "import sys; sys.exit(0 if $maxc <= 4.0 else 1)" &&
    ok "30 connections stuck in their headers are all closed, the last after $maxc s (timeout 2 s)" ||
    bad "partial-header connections: $(cat "$T/loris")"
[ "$r408" = 5 ] && $PY -c "import sys; sys.exit(0 if $max408 <= 4.0 else 1)" &&
    ok "5 bodies trickled at 1 byte / 0.4 s are cut off, the last after $max408 s" ||
    bad "trickled bodies: $(cat "$T/loris")"
[ "$hms" -ge 0 ] && [ "$hms" -lt 1000 ] && ok "/health answers in $hms ms during the slow-loris" ||
    bad "/health during the slow-loris: $hms ms"
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")
[ "$code" = 200 ] && ok "the server is up after the slow-loris" || bad "after the slow-loris: $code"

kill -TERM "$SRV"
rc=0
wait "$SRV" || rc=$?
[ "$rc" = 0 ] && ok "SIGTERM: exit 0" || bad "SIGTERM: exit status $rc: $(tail -3 "$T/err")"
exit $fail
