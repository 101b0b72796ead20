#!/usr/bin/env bash
# tests/reliability/row_http.sh: the HTTP rows of `make reliability`
# (docs/RELIABILITY.md "The table"; docs/SERVING.md "Robustness"); run by
# run.sh, or alone.
#  bad requests: `k3-coordinator serve --local 2 --api-key`, then 1,000
#    requests cycled over 20 kinds of bad ones (a garbage request line, a
#    bad Content-Length, no key, a wrong key, malformed JSON, wrong types and
#    ranges of every field kind, an 8 MiB + 1 body, an unknown route, a
#    wrong method), 8 connections at once: each must be answered 4xx with
#    an error (a JSON error object where the route is known), or closed
#    when HTTP itself is broken (a garbage request line is closed at
#    --conn-timeout-s 1, not at once); the server stays up, its peak RSS is
#    bounded, and the same good request gives the same text before and
#    after;
#  the flood, the slow-loris clients and a worker killed during a stream:
#    tests/integration/test_serve_robust.sh; clients that disconnect mid-
#    prefill and mid-decode: tests/integration/test_serve_cancel.sh. Both
#    print their rows as `# row|...` lines, taken here.
# Prints `ROW|what|trials|recovered|errors|max_rss|max_recovery` (run.sh's
# format), the scripts' ok / not ok lines; exits 1 when a row is not as
# required.
set -u
DIR=$(cd "$(dirname "$0")" && pwd)
. "$DIR/../lib.sh"
need_bins "$C"
make_tmp k3rel_http
PY=/usr/bin/python3
P=27420
KEY=rel-key-$$
serve_start "$T/out" "$T/err" --model "$TINY" --local 2 --port $P --api-key "$KEY" --ctx 2048 \
    --max-queue 2 --conn-timeout-s 1 || {
    bad "serve did not start: $(tail -3 "$T/err")"
    echo "ROW|HTTP: 1000 bad requests|-|failed|-|-|- (serve did not start)"
    exit 1
}
URL=http://127.0.0.1:$P
GOOD='{"prompt":"The quick brown fox","max_tokens":12,"temperature":0}'
good() { curl -s -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" -d "$GOOD" \
    "$URL/v1/completions" | $PY -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])'; }
before=$(good)
t0=$(date +%s%N)
$PY - "$P" "$KEY" >"$T/bad" <<'EOF'
import collections, json, socket, sys, threading, time
port, key = int(sys.argv[1]), sys.argv[2]
def http(method, path, body=b"", auth=True, ctype=True, extra=b""):
    h = b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % (method, path)
    if auth:
        h += b"Authorization: Bearer " + key.encode() + b"\r\n"
    if ctype:
        h += b"Content-Type: application/json\r\n"
    if body or method == b"POST":
        h += b"Content-Length: %d\r\n" % len(body)
    return h + extra + b"\r\n" + body
chat = b"/v1/chat/completions"
msg = '"messages":[{"role":"user","content":"hi"}]'
def j(s):
    return s.encode()
kinds = [
    ("garbage request line", b"\x00\x01GARBAGE \xff\r\n\r\n", False),
    ("bad Content-Length", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", False),
    ("no API key", http(b"POST", chat, j("{%s}" % msg), auth=False), True),
    ("wrong API key", http(b"POST", chat, j("{%s}" % msg)).replace(key.encode(), b"nope"), True),
    ("malformed JSON", http(b"POST", chat, b'{"messages":['), True),
    ("body not an object", http(b"POST", chat, b"[1]"), True),
    ("messages missing", http(b"POST", chat, b"{}"), True),
    ("unknown role", http(b"POST", chat, b'{"messages":[{"role":"wizard","content":"hi"}]}'), True),
    ("content a number", http(b"POST", chat, b'{"messages":[{"role":"user","content":5}]}'), True),
    ("NUL in content", http(b"POST", chat, b'{"messages":[{"role":"user","content":"a\\u0000b"}]}'), True),
    ("temperature a string", http(b"POST", chat, j('{%s,"temperature":"hot"}' % msg)), True),
    ("temperature 3", http(b"POST", chat, j('{%s,"temperature":3}' % msg)), True),
    ("top_p 1.5", http(b"POST", chat, j('{%s,"top_p":1.5}' % msg)), True),
    ("max_tokens 0", http(b"POST", chat, j('{%s,"max_tokens":0}' % msg)), True),
    ("max_tokens -1e30", http(b"POST", chat, j('{%s,"max_tokens":-1e30}' % msg)), True),
    ("stream 1", http(b"POST", chat, j('{%s,"stream":1}' % msg)), True),
    ("n 2", http(b"POST", chat, j('{%s,"n":2}' % msg)), True),
    ("body over 8 MiB", http(b"POST", chat, b" " * (8 * 1024 * 1024 + 1)), True),
    ("unknown route", http(b"GET", b"/v1/nothing"), True),
    ("GET on a POST route", http(b"GET", chat), True),
]
N = 1000
counts, lock = collections.Counter(), threading.Lock()
worst = {}
slow = collections.Counter()
def one(i):
    name, raw, want_json = kinds[i % len(kinds)]
    t0 = time.time()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=20)
        try:
            s.sendall(raw)
        except OSError:
            pass  # the server may refuse the rest of an oversized body
        data = b""
        while True:  # until the close, or the whole answer (Content-Length)
            try:
                b = s.recv(65536)
            except OSError:
                break
            if not b:
                break
            data += b
            h, sep, rest = data.partition(b"\r\n\r\n")
            if sep:
                cl = [l for l in h.lower().split(b"\r\n") if l.startswith(b"content-length:")]
                if cl and len(rest) >= int(cl[0].split(b":")[1]):
                    break
        s.close()
    except OSError as e:
        with lock:
            counts["connect " + type(e).__name__] += 1
        return
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else ""
    if not status:
        verdict = "closed" if not want_json else "no answer"
    elif not status.startswith("4"):
        verdict = "status " + status
    elif want_json:
        try:
            e = json.loads(body)["error"]
            verdict = "4xx json" if e.get("message") else "4xx no message"
        except Exception:
            verdict = "4xx not json"
    else:
        verdict = "4xx"
    with lock:
        slow[name] = max(slow[name], time.time() - t0)
        counts[verdict] += 1
        if verdict not in ("4xx json", "4xx", "closed"):
            worst.setdefault(name, verdict)
def worker(k):
    for i in range(k, N, 8):
        one(i)
ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
for t in ts:
    t.start()
for t in ts:
    t.join()
good = counts["4xx json"] + counts["4xx"] + counts["closed"]
print("n=%d refused=%d %s wrong=%s" % (N, good, " ".join("%s=%d" % (k.replace(" ", "_"), v)
      for k, v in sorted(counts.items())), json.dumps(worst).replace(" ", "")))
print("# slowest answers: " + ", ".join("%s %.2f s" % kv for kv in slow.most_common(3)))
EOF
dt=$((($(date +%s%N) - t0) / 1000000))
after=$(good)
hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$SRV/status")
echo "# bad requests: $(head -1 "$T/bad") in $dt ms; text before '$before', after '$after'"
refused=$(head -1 "$T/bad" | grep -o "refused=[0-9]*" | cut -d= -f2)
same=0
[ -n "$before" ] && [ "$before" = "$after" ] && kill -0 "$SRV" 2>/dev/null && same=1
if [ "${refused:-0}" = 1000 ]; then
    ok "1000 bad requests: each refused 4xx (JSON error where the route is known) or closed"
else
    bad "bad requests: $(cat "$T/bad")"
fi
[ $same = 1 ] && ok "after the bad requests the server is up and the same request gives the same text" ||
    bad "after the bad requests: up $(kill -0 "$SRV" 2>/dev/null && echo yes || echo no), text '$before' -> '$after'"
echo "ROW|HTTP: 1000 bad requests (20 kinds: broken HTTP, no or wrong key, bad JSON, bad fields, an 8 MiB + 1 body, wrong route or method; 8 connections at once)|1000|$same (the same good request, the same text)|${refused:-0} refused 4xx or closed|$hwm kB (server peak)|-"
kill -TERM "$SRV"
wait "$SRV" 2>/dev/null

for s in test_serve_robust test_serve_cancel; do
    bash "$DIR/../integration/$s.sh" >"$T/$s.out" 2>&1
    rc=$?
    grep '^ok - \|^not ok - \|^skip - ' "$T/$s.out" | sed "s/^/$s: /"
    [ $rc -eq 0 ] || bad "$s: exit status $rc"
    sed -n 's/^# row|/ROW|/p' "$T/$s.out"
    grep -q '^# row|' "$T/$s.out" || echo "ROW|HTTP: $s|-|failed|-|-|- (no row; see above)"
done
exit $fail
