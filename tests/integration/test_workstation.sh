#!/usr/bin/env bash
# tests/integration/test_workstation.sh: deploy/k3-workstation on the tiny
# checkpoint with 3 loop-device drives (tests/workstation_lib.sh):
# setup (doctor, plan, repack onto the drives) then `start run` gives the
# logits of `--local 0` on the source at the same bits; `start serve`
# answers /v1/completions with the CLI's text; `status` lists the workers;
# `stop` leaves no process of ours; `setup --stripe` stripes the experts
# over the 3 drives and striped workers give the same logits; on 2 fresh
# drives `setup --stripe` is one pass (the repacks write the stripes, the
# final place copies nothing) with the same logits; and the failure paths
# say what to do:
# a missing drive, a full drive, a worker that cannot start.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp workstation_ws
. "$(dirname "$0")/../workstation_lib.sh"
ws_init "k3-workstation on loop drives"
KW=$(cd "$(dirname "$0")/../../deploy" && pwd)/k3-workstation
export K3_WS_STATE=$T/state K3_BIN=$(cd "$BUILD" && pwd) K3_USAGE=off
trap '"$KW" stop >/dev/null 2>&1; K3_WS_STATE=$T/state1p "$KW" stop >/dev/null 2>&1; ws_cleanup' EXIT
drives=""
for i in 1 2 3; do
    ws_drive "d$i" 96
    drives+="${drives:+,}$WS_DIR"
done

# setup
if "$KW" setup "$TINY" --drives "$drives" --seconds 0.2 >"$T/setup.out" 2>&1; then
    ok "setup on 3 drives: $(grep -c 'repack: done' "$T/setup.out") repack runs, layout:$(sed -n 's/.*drive \([0-9]\) .*: layers \([0-9]*-[0-9]*\).*/ drive \1 layers \2/p' "$T/setup.out" | tr -d '\n')"
else
    bad "setup failed: $(tail -3 "$T/setup.out")"
    exit 1
fi
n_on=0
for d in ${drives//,/ }; do n_on=$((n_on + $(ls "$d/k3-model" | grep -c 'safetensors$'))); done
[ "$n_on" = 8 ] && ok "the 8 layer shards are on the drives" || bad "$n_on layer shards on the drives, expected 8"
"$KW" setup "$TINY" --drives "$drives" --seconds 0.2 >"$T/setup2.out" 2>&1 &&
    [ "$(grep -c ': 0 shards written' "$T/setup2.out")" = 3 ] &&
    ! grep -q 'repack: done.*: [1-9][0-9]* shards\? written' "$T/setup2.out" &&
    ok "setup again: resumes with nothing to write" || bad "second setup: $(tail -2 "$T/setup2.out")"

# chat: the logits of --local 0 on the source at the same bits
IDS=5,7,9,11,13,17
"$C" --model "$TINY" --bits 8 --local 0 --ids $IDS --ngen 3 --all-logits "$T/ref.bin" >/dev/null 2>&1
if "$KW" start run --ids $IDS --ngen 3 --all-logits "$T/ws.bin" >"$T/chat.out" 2>&1 &&
    cmp -s "$T/ref.bin" "$T/ws.bin"; then
    ok "start run on 3 drive workers: logits bit-identical to --local 0 on the source (--bits 8)"
else
    bad "start run: logits differ or it failed: $(tail -2 "$T/chat.out")"
fi
# the chat prompt on the same workers (piped: one answer a line), the same
# text as the in-process chat for the same message and settings
CHAT_ARGS=(--temp 2 --seed 4 --ngen 12 --think off --log-level warn)
want=$(echo "Hello there" | "$C" chat --model "$TINY" --bits 8 --local 0 "${CHAT_ARGS[@]}" 2>/dev/null)
got=$(echo "Hello there" | "$KW" start chat "${CHAT_ARGS[@]}" 2>"$T/chatp.err")
[ -n "$want" ] && [ "$got" = "$want" ] &&
    ok "start chat: the chat prompt on the drive workers answers as in-process ($(wc -c <<<"$got") bytes)" ||
    bad "start chat: '$got' vs in-process '$want' ($(tail -2 "$T/chatp.err"))"

# serve
P=$(port)
PROMPT="The quick brown fox"
cli=$("$C" --model "$TINY" --bits 8 --local 0 --ngen 6 "$PROMPT" 2>/dev/null)
if "$KW" start serve --port "$P" >"$T/serve.out" 2>&1; then
    got=$(curl -s -m 30 -H 'Content-Type: application/json' \
        -d "{\"prompt\":\"$PROMPT\",\"max_tokens\":6,\"temperature\":0}" \
        "http://127.0.0.1:$P/v1/completions" |
        /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"], end="")')
    [ -n "$got" ] && [ "$got" = "$cli" ] && ok "start serve answers with the CLI's text: \"$got\"" ||
        bad "serve text \"$got\" vs the CLI's \"$cli\""
else
    bad "start serve failed: $(tail -3 "$T/serve.out")"
fi
"$KW" status >"$T/status.out" 2>&1
[ "$(grep -c '^worker [0-9]: running' "$T/status.out")" = 3 ] && grep -q '^server: running' "$T/status.out" &&
    ok "status lists 3 running workers and the server" || bad "status: $(cat "$T/status.out" | head -5)"
pids=$(cat "$K3_WS_STATE"/run/*.pid 2>/dev/null)
"$KW" stop >"$T/stop.out" 2>&1
left=""
for p in $pids; do kill -0 "$p" 2>/dev/null && left+=" $p"; done
[ -z "$left" ] && [ -n "$pids" ] && ok "stop leaves no process ($(echo $pids | wc -w) stopped)" ||
    bad "stop left:$left"

# setup --stripe: the experts striped over every drive, each worker reads all
if "$KW" setup "$TINY" --drives "$drives" --seconds 0.2 --stripe >"$T/setup3.out" 2>&1 &&
    [ -s "$K3_WS_STATE/placement.json" ]; then
    ok "setup --stripe: $(grep -m1 'place: .* files' "$T/setup3.out" | sed 's/^ *place: //' | cut -c1-100)"
    if "$KW" start run --ids $IDS --ngen 3 --all-logits "$T/wss.bin" >"$T/chats.out" 2>&1 &&
        cmp -s "$T/ref.bin" "$T/wss.bin"; then
        ok "start run with striped workers: logits bit-identical to --local 0 on the source"
    else
        bad "start run striped: logits differ or it failed: $(tail -2 "$T/chats.out")"
    fi
    n_str=$(cat "$K3_WS_STATE"/logs/w*.log | grep -c 'striped over 3 drives')
    [ "$n_str" = 3 ] && ok "each of the 3 workers reads its experts from all 3 drives" ||
        bad "$n_str of 3 workers striped: $(grep -h -m1 -i 'placement\|error' "$K3_WS_STATE"/logs/w*.log | head -2)"
    "$KW" stop >/dev/null 2>&1
    rm -f "$K3_WS_STATE/placement.json" # the failure paths below use the plain layout
else
    bad "setup --stripe failed: $(tail -3 "$T/setup3.out")"
fi

# setup --stripe on fresh drives: one pass (the repacks write the stripes
# from the conversion stream; the final place copies nothing)
d1p=""
for i in 1 2; do
    ws_drive "p$i" 96
    d1p+="${d1p:+,}$WS_DIR"
done
if K3_WS_STATE=$T/state1p "$KW" setup "$TINY" --drives "$d1p" --seconds 0.2 --stripe >"$T/setup1p.out" 2>&1 &&
    grep -q 'place: .*expert bytes: 0.00 GB (0 B) copied' "$T/setup1p.out" &&
    [ "$(grep -c 'repack: done.*[1-9] shards\? written' "$T/setup1p.out")" = 2 ] &&
    [ -n "$(ls "${d1p%%,*}/k3-stripe/.done" 2>/dev/null)" ]; then
    ok "setup --stripe on fresh drives: stripes written by the repacks, the final place copies 0 B"
    if K3_WS_STATE=$T/state1p "$KW" start run --ids $IDS --ngen 3 --all-logits "$T/ws1p.bin" >"$T/chat1p.out" 2>&1 &&
        cmp -s "$T/ref.bin" "$T/ws1p.bin"; then
        ok "one-pass striped workers: logits bit-identical to --local 0 on the source"
    else
        bad "one-pass striped run: logits differ or it failed: $(tail -2 "$T/chat1p.out")"
    fi
    K3_WS_STATE=$T/state1p "$KW" stop >/dev/null 2>&1
else
    bad "setup --stripe on fresh drives: $(grep 'place: .*files\|repack: done' "$T/setup1p.out" | tail -3)"
fi

# failure paths
if "$KW" setup "$TINY" --drives "$drives,$T/nope" >"$T/f1.out" 2>&1; then
    bad "setup with a missing drive succeeded"
else
    grep -q 'fix:' "$T/f1.out" && ok "a missing drive: $(grep -m1 'fix:' "$T/f1.out" | sed 's/.*fix: //' | cut -c1-90)" ||
        bad "a missing drive: no fix given: $(tail -1 "$T/f1.out")"
fi
ws_drive full 8
dd if=/dev/zero of="$WS_DIR/fill" bs=1M status=none 2>/dev/null
if K3_WS_STATE=$T/state2 "$KW" setup "$TINY" --drives "$drives,$WS_DIR" --seconds 0.2 >"$T/f2.out" 2>&1; then
    bad "setup with a full drive succeeded"
else
    grep -q 'free' "$T/f2.out" && grep -q 'fix:' "$T/f2.out" &&
        ok "a full drive: $(grep -m1 'FAIL' "$T/f2.out" | cut -c18- | cut -c1-100)" ||
        bad "a full drive: $(tail -2 "$T/f2.out")"
fi
d2=${drives#*,}
d2=${d2%%,*}
mv "$d2/k3-model" "$d2/k3-model.away"
mkdir "$d2/k3-model"
if "$KW" start run --ids 5 --ngen 1 >"$T/f3.out" 2>&1; then
    bad "start with a worker's shards gone succeeded"
else
    grep -q 'could not start' "$T/f3.out" && grep -q 'fix:' "$T/f3.out" &&
        ok "a worker that cannot start: $(grep -m1 'could not start' "$T/f3.out" | cut -c1-80); fix: $(grep -m1 'fix:' "$T/f3.out" | sed 's/.*fix: //' | cut -c1-60)" ||
        bad "a worker that cannot start: $(tail -3 "$T/f3.out")"
fi
left=""
for f in "$K3_WS_STATE"/run/*.pid; do [ -e "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && left+=" $(cat "$f")"; done
[ -z "$left" ] && ok "after the failed start no worker is left" || bad "left running:$left"
rmdir "$d2/k3-model"
mv "$d2/k3-model.away" "$d2/k3-model"
exit $fail
