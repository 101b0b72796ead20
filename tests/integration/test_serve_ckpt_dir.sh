#!/usr/bin/env bash
# tests/integration/test_serve_ckpt_dir.sh: turn checkpoints parked on disk
# with workers (`serve --ckpt N --ckpt-dir D`, docs/SERVING.md "Turn
# checkpoints", docs/PROTOCOL.md "Checkpoints" 1.3) on tiny.
#
# --local 2: the coordinator parks the ids in D, each local worker its
# layers' state in D/w<i>-<a>-<b>.
#   - server A answers turn 1 and is killed with -9 (its workers die with
#     it); server B on the same D answers turn 2: only the new tokens are
#     prefilled (usage cached_tokens = turn 1's prompt) and the text equals a
#     fresh full replay's (reference server R, never killed, no --ckpt-dir);
#   - B killed, C on D answers an edited turn 2 (turn 1 kept, the rest
#     different): the checkpoint at turn 1's end comes from disk, the text
#     equals R's for the same prompt;
#   - worker 1's file at that position one byte short: refused with a log
#     line naming it, the prompt prefilled whole, the same text;
#   - worker 0's file of another model (fingerprint changed): refused, the
#     log says why, the same text.
# --workers: two separately started workers with their own --ckpt-dir;
# worker 1 killed with -9 after turn 1 and started again: turn 2 restores
# the checkpoint from its disk (the other worker from memory), the text
# equals R's.
# Ports: 27100-27149 (the ckpt helper's range), pid-seeded.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3_serve_ckpt_dir
PY=/usr/bin/python3
BASE=$((27100 + ($$ % 6) * 7)) # 27100-27141; the workers 27142-27149
D=$T/ckpt
SERVE=(--model "$TINY" --threads 1 --ctx 1024 --ckpt 2 --max-sessions 4 --max-queue 2)

# complete FILE PORT PROMPT: a non-stream /v1/completions, temperature 0
complete() {
    $PY -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 8,
        "temperature": 0}))' "$3" >"$1.req"
    curl -s --max-time 120 -H "Content-Type: application/json" -d @"$1.req" \
        "http://127.0.0.1:$2/v1/completions" >"$1"
}
field() { # FILE EXPR: a Python expression over the response j
    $PY -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1" 2>/dev/null
}
text() { field "$1" 'json.dumps(j["choices"][0]["text"])'; }
cached() { field "$1" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]'; }
ptoks() { field "$1" 'j["usage"]["prompt_tokens"]'; }
kill9() { # PID: SIGKILL and reap
    kill -9 "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}
gone() { # DIR: 0 once no process has DIR on its command line (local workers die with A)
    local i
    for ((i = 0; i < 100; i++)); do
        pgrep -f -- "$1" >/dev/null || return 0
        sleep 0.1
    done
    return 1
}
nfiles() { ls "$1" 2>/dev/null | grep -c '\.k3ck$'; }

P1="river stone lamp cloud apple tiger violin copper meadow candle orbit glacier."
P2="$P1 And then the lamp and the tiger were gone."
P2E="$P1 But the copper violin kept playing until dawn."

serve_start "$T/r.out" "$T/r.err" "${SERVE[@]}" --local 0 --port "$BASE" || {
    bad "reference server did not start: $(tail -3 "$T/r.err")"
    exit 1
}
R=$SRV
complete "$T/ref2" "$BASE" "$P2"
complete "$T/ref2e" "$BASE" "$P2E"
REF2=$(text "$T/ref2")
REF2E=$(text "$T/ref2e")
[ -n "$REF2" ] && [ -n "$REF2E" ] && [ "$(cached "$T/ref2")" = 0 ] ||
    bad "reference answers: '$REF2' '$REF2E'"

# ---- --local 2: coordinator restart ----
serve_start "$T/a.out" "$T/a.err" "${SERVE[@]}" --local 2 --ckpt-dir "$D" --port $((BASE + 1)) || {
    bad "server A did not start: $(tail -3 "$T/a.err")"
    exit 1
}
A=$SRV
complete "$T/t1" $((BASE + 1)) "$P1"
N1=$(ptoks "$T/t1")
nc=$(nfiles "$D") n0=$(nfiles "$D/w0-0-4") n1=$(nfiles "$D/w1-4-8")
if [ "$nc" -ge 1 ] && [ "$n0" -ge 1 ] && [ "$n1" -ge 1 ] && [ -n "$N1" ]; then
    ok "--local 2 --ckpt-dir: turn 1 ($N1 prompt tokens) parked $nc coordinator file(s), $n0 and $n1 in w0-0-4 and w1-4-8"
else
    bad "--local 2 --ckpt-dir: files after turn 1: $nc / $n0 / $n1 ($(ls -R "$D" | head -5))"
fi
F1=$(printf '%08d' "${N1:-0}")
kill9 "$A"
gone "$D" && ok "kill -9 of the coordinator: its local workers exited too" ||
    bad "local workers of the killed coordinator still run: $(pgrep -af -- "$D")"

serve_start "$T/b.out" "$T/b.err" "${SERVE[@]}" --local 2 --ckpt-dir "$D" --port $((BASE + 2)) || {
    bad "server B did not start: $(tail -3 "$T/b.err")"
    exit 1
}
B=$SRV
t0=$(date +%s%N)
complete "$T/t2" $((BASE + 2)) "$P2"
ms=$((($(date +%s%N) - t0) / 1000000))
c2=$(cached "$T/t2") t2=$(text "$T/t2")
if [ "$c2" = "$N1" ] && [ "$t2" = "$REF2" ]; then
    ok "restarted on D: turn 2 prefilled only its new tokens ($c2 of $(ptoks "$T/t2") cached, from disk) and its text equals the full replay's ($ms ms)"
else
    bad "restarted on D: turn 2 cached '$c2' (want $N1), text '$t2' vs '$REF2' ($(grep -E 'checkpoint|warn' "$T/b.err" | tail -3))"
fi
grep -q "checkpoint at $N1 loaded from $D/" "$T/b.err" &&
    ok "the coordinator's log names the parked file it loaded" ||
    bad "no 'checkpoint at $N1 loaded' line: $(grep checkpoint "$T/b.err" | tail -2)"
kill9 "$B"
gone "$D" || bad "local workers of B still run"

serve_start "$T/c.out" "$T/c.err" "${SERVE[@]}" --local 2 --ckpt-dir "$D" --port $((BASE + 3)) || {
    bad "server C did not start: $(tail -3 "$T/c.err")"
    exit 1
}
C_=$SRV
complete "$T/t2e" $((BASE + 3)) "$P2E"
c=$(cached "$T/t2e") t=$(text "$T/t2e")
if [ "$c" = "$N1" ] && [ "$t" = "$REF2E" ]; then
    ok "an edited turn 2 after a restart restores the checkpoint at $N1 from disk ($c cached) and its text equals the full replay's"
else
    bad "edited turn 2: cached '$c' (want $N1), text '$t' vs '$REF2E' ($(grep -E 'checkpoint|warn' "$T/c.err" | tail -3))"
fi
kill9 "$C_"
gone "$D" || bad "local workers of C still run"

# worker 1's file at N1 one byte short
wf=$(ls "$D"/w1-4-8/*-"$F1".k3ck 2>/dev/null | head -1)
[ -n "$wf" ] && truncate -s -1 "$wf"
serve_start "$T/e.out" "$T/e.err" "${SERVE[@]}" --local 2 --ckpt-dir "$D" --port $((BASE + 4)) || {
    bad "server E did not start: $(tail -3 "$T/e.err")"
    exit 1
}
E=$SRV
complete "$T/t3" $((BASE + 4)) "$P2E"
c=$(cached "$T/t3") t=$(text "$T/t3")
if [ -n "$wf" ] && [ "$c" = 0 ] && [ "$t" = "$REF2E" ] &&
    grep -q "parked checkpoint not loaded (.*$wf: .*file bytes" "$T/e.err"; then
    ok "a truncated worker file is refused, logged by name, the prompt prefilled whole (0 cached), the same text"
else
    bad "truncated worker file '$wf': cached '$c', text '$t' vs '$REF2E', log: $(grep -E 'not loaded|refused' "$T/e.err" | tail -2)"
fi
kill9 "$E"
gone "$D" || bad "local workers of E still run"

# worker 0's file at N1 of another model (a fingerprint byte changed)
wf0=$(ls "$D"/w0-0-4/*-"$F1".k3ck 2>/dev/null | head -1)
[ -n "$wf0" ] && printf '\377' | dd of="$wf0" bs=1 seek=8 conv=notrunc status=none
serve_start "$T/f.out" "$T/f.err" "${SERVE[@]}" --local 2 --ckpt-dir "$D" --port $((BASE + 5)) || {
    bad "server F did not start: $(tail -3 "$T/f.err")"
    exit 1
}
F=$SRV
complete "$T/t4" $((BASE + 5)) "$P2E"
c=$(cached "$T/t4") t=$(text "$T/t4")
if [ -n "$wf0" ] && [ "$c" = 0 ] && [ "$t" = "$REF2E" ] &&
    grep -q "$wf0: model fingerprint 0x.*this model's is" "$T/f.err"; then
    ok "a worker file of another model is refused naming both fingerprints, the prompt prefilled whole, the same text"
else
    bad "foreign worker file '$wf0': cached '$c', text '$t', log: $(grep -E 'not loaded|refused' "$T/f.err" | tail -2)"
fi
kill -TERM "$F"
wait "$F" 2>/dev/null

# ---- --workers: a remote worker restarted ----
D2=$T/remote
wstart() { # I A B PORT: worker I for layers [A, B) on PORT with its own --ckpt-dir
    K3_LOG=info "$W" --model "$TINY" --layers "$2-$3" --listen "tcp://127.0.0.1:$4" --threads 1 \
        --no-bench --name "rw$1" --ckpt-dir "$D2/w$1" 2>>"$T/rw$1.err" &
    WPID[$1]=$!
    PIDS+=("${WPID[$1]}")
}
WP=$((27142 + ($$ % 4) * 2))
declare -a WPID
wstart 0 0 4 "$WP"
wstart 1 4 8 $((WP + 1))
serve_start "$T/g.out" "$T/g.err" "${SERVE[@]}" --workers "tcp://127.0.0.1:$WP,tcp://127.0.0.1:$((WP + 1))" \
    --ckpt-dir "$D2/coord" --port $((BASE + 6)) || {
    bad "server G (--workers) did not start: $(tail -3 "$T/g.err")"
    exit 1
}
G=$SRV
complete "$T/w1" $((BASE + 6)) "$P1"
n=$(nfiles "$D2/w1")
kill9 "${WPID[1]}"
wstart 1 4 8 $((WP + 1))
t0=$(date +%s%N)
complete "$T/w2" $((BASE + 6)) "$P2"
ms=$((($(date +%s%N) - t0) / 1000000))
c=$(cached "$T/w2") t=$(text "$T/w2")
if [ "$n" -ge 1 ] && [ "$c" = "$N1" ] && [ "$t" = "$REF2" ] &&
    grep -q "checkpoint at $N1 loaded from $D2/w1/" "$T/rw1.err"; then
    ok "--workers: worker 1 killed with -9 and restarted, turn 2 restores the checkpoint at $N1 from its disk ($c cached) and its text equals the full replay's ($ms ms, the re-registration included)"
else
    bad "--workers, restarted worker: $n file(s), cached '$c' (want $N1), text '$t' vs '$REF2', worker log: $(grep -E 'checkpoint|refused' "$T/rw1.err" | tail -2), coordinator: $(grep -E 'checkpoint|warn' "$T/g.err" | tail -2)"
fi
kill -TERM "$G" "$R" "${WPID[0]}" "${WPID[1]}" 2>/dev/null
wait 2>/dev/null
exit $fail
