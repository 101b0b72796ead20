#!/usr/bin/env bash
# tests/integration/test_web_ui.sh: the chat page (docs/WEB.md) in Debian's
# chromium. Starts `k3-coordinator web` on the tiny checkpoint with 2 local
# workers and an API key, checks the page's static answers with curl (content
# types, ETag/304, CSP, no key needed for the page, 404 for unknown files),
# then runs tests/web/test_web_ui.mjs (playwright-core): send, stream, Stop,
# regenerate, thinking, edit, reload, HTML in model output as text, the
# cluster panel. Screenshots go to $BUILD/screenshots/ for a person to look
# at. Needs node, tests/web/node_modules and /usr/bin/chromium (make deps):
# without them the browser part is one failure, not a silent skip.
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp webui

KEY=web-key-$$
WORKERS=2
WEBDIR=$(cd "$(dirname "$0")/../web" && pwd)
SHOTS=$(cd "$BUILD" && pwd)/screenshots

P=$(port)
"$C" web --model "$TINY" --local $WORKERS --port "$P" --api-key "$KEY" --ctx 8192 --max-queue 4 \
    >"$T/out" 2>"$T/err" &
SRV=$!
PIDS+=("$SRV")
wait_line "$T/out" "^web UI: open http://127.0.0.1:$P/" "$SRV"
if grep -q "^serving on http://127.0.0.1:$P$" "$T/out" &&
    grep -q "^web UI: open http://127.0.0.1:$P/ in a browser$" "$T/out"; then
    ok "web prints 'serving on' and the page's URL"
else
    bad "web did not start: $(cat "$T/out") $(tail -3 "$T/err")"
    exit 1
fi
URL=http://127.0.0.1:$P

# ---- the static files ----
# get NAME PATH WANT_STATUS WANT_TYPE [curl-args]: one file's status and type
get() {
    local name=$1 path=$2 want=$3 type=$4
    shift 4
    local got
    rm -f "$T/body" # curl writes no file for an empty body
    got=$(curl -s -D "$T/hdr" -o "$T/body" -w '%{http_code} %{content_type}' "$@" "$URL$path")
    if [ "${got%% *}" = "$want" ] && [[ "${got#* }" == $type* ]]; then
        ok "$name: $got"
    else
        bad "$name: got '$got', want $want $type"
    fi
}
get "GET / without a key" / 200 "text/html; charset=utf-8"
grep -q '<textarea id="input"' "$T/body" && ok "/ is the chat page" || bad "/ is not the chat page"
for h in "Content-Security-Policy: default-src 'none'; script-src 'self'" "Cache-Control: no-cache" \
    "X-Content-Type-Options: nosniff" 'ETag: "'; do
    grep -qiF "$h" "$T/hdr" && ok "/ has header $h" || bad "/ lacks header $h: $(tr '\r\n' '  ' <"$T/hdr")"
done
get "app.js" /app.js 200 "text/javascript"
get "md.js" /md.js 200 "text/javascript"
get "app.css" /app.css 200 "text/css"
get "favicon.svg" /favicon.svg 200 "image/svg+xml"
etag=$(curl -s -D - -o /dev/null "$URL/app.js" | tr -d '\r' | sed -n 's/^ETag: //Ip')
get "app.js with its ETag in If-None-Match" /app.js 304 "" -H "If-None-Match: $etag"
[ ! -s "$T/body" ] && ok "a 304 has no body" || bad "a 304 with a body"
get "an unknown file" /nothing.js 404 "application/json"
get "a path outside the page" /../Makefile 404 "application/json" --path-as-is
get "POST /" / 405 "application/json" -X POST
get "the API still wants the key" /v1/models 401 "application/json"

# ---- the browser ----
if ! command -v node >/dev/null 2>&1 || [ ! -d "$WEBDIR/node_modules/playwright-core" ]; then
    bad "node or tests/web/node_modules/playwright-core missing (run make deps)"
elif [ ! -x /usr/bin/chromium ]; then
    bad "/usr/bin/chromium missing (run make deps)"
else
    rm -f "$SHOTS"/web-*.png
    K3_URL=$URL/ K3_API_KEY=$KEY K3_WORKERS=$WORKERS K3_SHOTS="$SHOTS" \
        timeout 150 node "$WEBDIR/test_web_ui.mjs" || fail=1
    for s in web-chat web-cluster; do
        [ -s "$SHOTS/$s.png" ] && ok "screenshot $SHOTS/$s.png" || bad "no screenshot $s.png"
    done
fi

kill -TERM "$SRV"
rc=0
wait "$SRV" || rc=$?
PIDS=()
[ "$rc" = 0 ] && ok "SIGTERM: web exits 0" || bad "SIGTERM: exit status $rc: $(tail -3 "$T/err")"
exit $fail
