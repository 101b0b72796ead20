#!/usr/bin/env bash
# tests/integration/test_serve.sh: `k3-coordinator serve` on the tiny
# checkpoint (docs/SERVING.md). Starts the server in-process (--local 0) on
# a free port with an API key and a small context, waits for its
# "serving on" line, then
#   - runs tests/api/test_openai.mjs (the official openai npm client: models,
#     chat, streams, usage, stop, length, seeds, concurrency, and
#     /v1/completions against the CLI's own text for the same prompt),
#   - checks the refusals with curl: 404, 405, 401, 413, 400 naming the field,
#   - stops it with SIGTERM during a stream and expects exit status 0 after
#     the stream completed.
# Needs node and tests/api/node_modules (make deps); without them the client
# part is one failure, not a silent skip.
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp k3serve

KEY=test-key-$$
CTX=1024
PROMPT="The quick brown fox"
NGEN=12
API=$(cd "$(dirname "$0")/../api" && pwd)

# the CLI's text for the same prompt (greedy), without its final newline
cli_text=$("$C" --model "$TINY" --local 0 --ngen $NGEN "$PROMPT" 2>"$T/cli.err") || {
    bad "CLI run for the reference text failed: $(tail -1 "$T/cli.err")"
    exit 1
}

P=$(port)
"$C" serve --model "$TINY" --local 0 --port "$P" --api-key "$KEY" --ctx $CTX --max-queue 4 \
    --model-id tiny-k3 >"$T/out" 2>"$T/err" &
SRV=$!
PIDS+=("$SRV")
for _ in $(seq 1 3000); do
    grep -q "^serving on http://127.0.0.1:$P$" "$T/out" && break
    kill -0 "$SRV" 2>/dev/null || break
    sleep 0.1
done
if grep -q "^serving on http://127.0.0.1:$P$" "$T/out"; then
    ok "serve prints 'serving on http://127.0.0.1:$P'"
else
    bad "serve did not start: $(tail -3 "$T/err")"
    exit 1
fi
URL=http://127.0.0.1:$P

# ---- the official client ----
if ! command -v node >/dev/null 2>&1 || [ ! -d "$API/node_modules/openai" ]; then
    bad "node or tests/api/node_modules/openai missing (run make deps)"
else
    K3_URL=$URL/v1 K3_API_KEY=$KEY K3_MODEL_ID=tiny-k3 K3_CTX=$CTX K3_PROMPT="$PROMPT" \
        K3_NGEN=$NGEN K3_CLI_TEXT="$cli_text" node "$API/test_openai.mjs" || fail=1
fi

# ---- refusals, with curl ----
# req NAME WANT_STATUS WANT_IN_BODY curl-args...: one check of status and body
req() {
    local name=$1 want=$2 grepfor=$3
    shift 3
    local code
    code=$(curl -s -o "$T/body" -w '%{http_code}' "$@")
    if [ "$code" = "$want" ] && grep -q -- "$grepfor" "$T/body" &&
        grep -q '"error":{"message":' "$T/body"; then
        ok "$name: $want"
    else
        bad "$name: got $code, want $want with $grepfor: $(head -c 300 "$T/body")"
    fi
}
AUTH=(-H "Authorization: Bearer $KEY")
J=(-H "Content-Type: application/json")
CHAT=$URL/v1/chat/completions
MSG='"messages":[{"role":"user","content":"hi"}]'

req "unknown route" 404 '"code":"not_found"' "${AUTH[@]}" "$URL/v1/nothing"
req "another model's id" 404 '"code":"model_not_found"' "${AUTH[@]}" "$URL/v1/models/gpt-4"
req "GET on a POST route" 405 '"code":"method_not_allowed"' "${AUTH[@]}" "$CHAT"
curl -s -D "$T/hdr" -o /dev/null "${AUTH[@]}" -X POST "$URL/v1/models"
grep -qi '^Allow: GET' "$T/hdr" && ok "405 names the allowed method" || bad "405 without Allow: GET"
req "no API key" 401 '"type":"authentication_error"' "${J[@]}" -d "{$MSG}" "$CHAT"
req "wrong API key" 401 '"code":"invalid_api_key"' -H "Authorization: Bearer x$KEY" "${J[@]}" \
    -d "{$MSG}" "$CHAT"
req "a key that is a prefix of the right one" 401 'invalid_api_key' \
    -H "Authorization: Bearer ${KEY%?}" "${J[@]}" -d "{$MSG}" "$CHAT"
head -c $((8 * 1024 * 1024 + 1)) /dev/zero | tr '\0' ' ' >"$T/big"
req "body over 8 MiB" 413 '"code":"request_too_large"' "${AUTH[@]}" "${J[@]}" \
    --data-binary @"$T/big" "$CHAT"
req "malformed JSON" 400 '"code":"invalid_json"' "${AUTH[@]}" "${J[@]}" -d '{"messages":[' "$CHAT"
req "body not an object" 400 'must be a JSON object' "${AUTH[@]}" "${J[@]}" -d '[1]' "$CHAT"
req "messages missing" 400 '"param":"messages"' "${AUTH[@]}" "${J[@]}" -d '{}' "$CHAT"
req "messages empty" 400 '"param":"messages"' "${AUTH[@]}" "${J[@]}" -d '{"messages":[]}' "$CHAT"
req "unknown role" 400 '"param":"messages\[0\].role"' "${AUTH[@]}" "${J[@]}" \
    -d '{"messages":[{"role":"robot","content":"x"}]}' "$CHAT"
req "content of the wrong type" 400 '"param":"messages\[0\].content"' "${AUTH[@]}" "${J[@]}" \
    -d '{"messages":[{"role":"user","content":5}]}' "$CHAT"
req "image content part" 400 '"code":"unsupported_content_type"' "${AUTH[@]}" "${J[@]}" \
    -d '{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}' "$CHAT"
req "NUL in content" 400 'NUL' "${AUTH[@]}" "${J[@]}" \
    -d '{"messages":[{"role":"user","content":"a\u0000b"}]}' "$CHAT"
req "temperature a string" 400 '"param":"temperature"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"temperature\":\"hot\"}" "$CHAT"
req "temperature 3" 400 '"param":"temperature"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"temperature\":3}" "$CHAT"
req "top_p 1.5" 400 '"param":"top_p"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"top_p\":1.5}" "$CHAT"
req "max_tokens 0" 400 '"param":"max_tokens"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"max_tokens\":0}" "$CHAT"
req "max_tokens 2.5" 400 '"param":"max_tokens"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"max_tokens\":2.5}" "$CHAT"
req "stream not a bool" 400 '"param":"stream"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"stream\":1}" "$CHAT"
req "five stop strings" 400 '"param":"stop"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}" "$CHAT"
req "a stop string not a string" 400 '"param":"stop\[1\]"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"stop\":[\"a\",7]}" "$CHAT"
req "n 2" 400 '"param":"n"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"n\":2}" "$CHAT"
req "logprobs" 400 '"param":"logprobs"' "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"logprobs\":true}" "$CHAT"
req "response_format json" 400 '"param":"response_format"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"response_format\":{\"type\":\"json_object\"}}" "$CHAT"
req "presence_penalty" 400 '"param":"presence_penalty"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"presence_penalty\":0.5}" "$CHAT"
req "frequency_penalty" 400 '"param":"frequency_penalty"' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"frequency_penalty\":1}" "$CHAT"
req "completions without prompt" 400 '"param":"prompt"' "${AUTH[@]}" "${J[@]}" -d '{}' \
    "$URL/v1/completions"
req "completions prompt over the context" 400 '"code":"context_length_exceeded"' "${AUTH[@]}" \
    "${J[@]}" -d "{\"prompt\":\"$(printf 'fox %.0s' $(seq 1 3000))\",\"stream\":true}" \
    "$URL/v1/completions"
# zero penalties and n = 1 change nothing: accepted
code=$(curl -s -o "$T/body" -w '%{http_code}' "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"n\":1,\"presence_penalty\":0,\"max_tokens\":2,\"logprobs\":false,\"user\":\"u\"}" "$CHAT")
[ "$code" = 200 ] && ok "neutral values of refused fields are accepted" ||
    bad "neutral values refused: $code $(head -c 300 "$T/body")"

curl -s -D "$T/hdr" -o "$T/body" "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"max_tokens\":1}" "$CHAT"
rid=$(tr -d '\r' <"$T/hdr" | sed -n 's/^x-request-id: //Ip')
grep -q "\"id\":\"$rid\"" "$T/body" && [ -n "$rid" ] && ok "x-request-id is the response id ($rid)" ||
    bad "x-request-id '$rid' vs $(head -c 200 "$T/body")"
curl -s -N -D "$T/hdr" -o "$T/body" "${AUTH[@]}" "${J[@]}" -d "{$MSG,\"max_tokens\":1,\"stream\":true}" "$CHAT"
rid=$(tr -d '\r' <"$T/hdr" | sed -n 's/^x-request-id: //Ip')
if grep -qi '^content-type: text/event-stream' "$T/hdr" && grep -qi '^cache-control: no-cache' "$T/hdr" &&
    [ -n "$rid" ] && grep -q "\"id\":\"$rid\"" "$T/body"; then
    ok "stream headers: text/event-stream, no-cache, x-request-id"
else
    bad "stream headers: $(tr '\r\n' '  ' <"$T/hdr")"
fi

code=$(curl -s -o "$T/body" -w '%{http_code}' "$URL/health")
if [ "$code" = 200 ] && grep -q '"status":"ok"' "$T/body" && grep -q '"queue":0,"running":0' "$T/body"; then
    ok "health: 200 with the queue"
else
    bad "health: $code $(head -c 300 "$T/body")"
fi

# ---- admission: --max-queue 4 running, the 5th gets 429 ----
for i in 1 2 3 4; do
    curl -s -N "${AUTH[@]}" "${J[@]}" -d '{"prompt":"fox","stream":true,"max_tokens":300}' \
        "$URL/v1/completions" >"$T/q$i" &
    QP[$i]=$!
done
for _ in $(seq 1 200); do
    n=0
    for i in 1 2 3 4; do [ -s "$T/q$i" ] && n=$((n + 1)); done
    [ $n = 4 ] && break
    sleep 0.01
done
req "a 5th generation while 4 run (--max-queue 4)" 429 '"code":"queue_full"' "${AUTH[@]}" \
    "${J[@]}" -d "{$MSG,\"max_tokens\":1}" "$CHAT"
wait "${QP[@]}"
n=0
for i in 1 2 3 4; do grep -q '^data: \[DONE\]$' "$T/q$i" && n=$((n + 1)); done
[ $n = 4 ] && ok "the 4 admitted streams complete" || bad "admitted streams: $n of 4 complete"

# ---- SIGTERM while a stream runs: it completes, then exit 0 ----
curl -s -N "${AUTH[@]}" "${J[@]}" \
    -d "{$MSG,\"stream\":true,\"max_tokens\":40,\"temperature\":0}" "$CHAT" >"$T/stream" &
CURL=$!
for _ in $(seq 1 100); do [ -s "$T/stream" ] && break; sleep 0.05; done
kill -TERM "$SRV"
wait "$CURL"
rc=0
wait "$SRV" || rc=$?
PIDS=()
tail -1 "$T/stream" | grep -q '^$' && grep -q '^data: \[DONE\]$' "$T/stream" &&
    ok "a stream in flight at SIGTERM completes with [DONE]" ||
    bad "stream at SIGTERM: $(tail -c 300 "$T/stream")"
[ "$rc" = 0 ] && ok "SIGTERM: serve exits 0" || bad "SIGTERM: exit status $rc: $(tail -3 "$T/err")"

# ---- with 2 local workers: the same text as the CLI, and a clean stop ----
P2=$(port)
"$C" serve --model "$TINY" --local 2 --port "$P2" --ctx $CTX >"$T/out2" 2>"$T/err2" &
SRV2=$!
PIDS+=("$SRV2")
for _ in $(seq 1 600); do
    grep -q "^serving on" "$T/out2" && break
    kill -0 "$SRV2" 2>/dev/null || break
    sleep 0.1
done
curl -s -o "$T/w.json" "${J[@]}" -d "{\"prompt\":\"$PROMPT\",\"temperature\":0,\"max_tokens\":$NGEN}" \
    "http://127.0.0.1:$P2/v1/completions"
got=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"], end="")' \
    "$T/w.json" 2>/dev/null)
[ "$got" = "$cli_text" ] && ok "--local 2: /v1/completions equals the CLI text" ||
    bad "--local 2: got '$got', want '$cli_text' ($(tail -2 "$T/err2"))"
kids=$(pgrep -P "$SRV2" | tr '\n' ' ')
[ "$(echo $kids | wc -w)" -ge 2 ] && ok "--local 2: two worker processes" ||
    bad "--local 2: worker processes: '$kids'"
kill -TERM "$SRV2"
rc=0
wait "$SRV2" || rc=$?
PIDS=()
[ "$rc" = 0 ] && ok "--local 2: SIGTERM exits 0" || bad "--local 2: exit status $rc"
left=""
for k in $kids; do kill -0 "$k" 2>/dev/null && left="$left $k"; done
[ -z "$left" ] && ok "--local 2: the workers are gone after the exit" ||
    bad "--local 2: workers still running:$left"
exit $fail
