#!/usr/bin/env bash
# tests/reliability/row_coord_restart.sh: one row of `make reliability`
# (tests/reliability/run.sh runs it when it exists): a coordinator killed
# with -9 between two turns of a conversation and restarted on the same
# --ckpt-dir resumes the conversation from the turn checkpoint it parked on
# disk (docs/SERVING.md "Turn checkpoints", coordinator/ckpt_dir.h).
#
# Per trial (RELIABILITY_RESTART_TRIALS, default 3; seeded user texts):
#   - a reference server (--ckpt 2, no --ckpt-dir, never killed) answers
#     turn 2 of the conversation: the uninterrupted text;
#   - server A (--ckpt 2 --ckpt-dir D, --local 2 by default) answers turn 1
#     (/v1/completions, temperature 0, 12 tokens), parks its checkpoint at
#     the prompt's end (the ids in D, each worker's layers in D/w<i>-<a>-<b>)
#     and is killed with SIGKILL (its local workers die with it);
#   - server B, started on the same D, answers turn 2: recovered
#     token-identically when its text equals the reference's and its usage
#     reports cached prompt tokens (> 0: the checkpoint was loaded from disk,
#     not replayed).
# Prints ok / not ok lines and one line "ROW|fault|trials|recovered
# token-identically|errors reported|max RSS|max recovery time" (the format
# of tests/test_peer_budget.c's rows), the recovery time being the kill to
# turn 2's answer, restart included. Exit status 1 when a trial failed.
# Ports: 27150-27199 (the ckpt helper's range), pid-seeded.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp k3_row_coord_restart
PY=/usr/bin/python3
TRIALS=${RELIABILITY_RESTART_TRIALS:-3}
SEED=${RELIABILITY_SEED:-20}
BASE=$((27150 + ($$ % 16) * 3))
D=$T/ckpt
mkdir -p "$D"
# RELIABILITY_RESTART_LOCAL (default 2): local workers, which die with the
# killed coordinator and park their layers in D/w<i>-<a>-<b>; 0 = in-process
LOCAL=${RELIABILITY_RESTART_LOCAL:-2}
SERVE_ARGS=(--model "$TINY" --local "$LOCAL" --threads 1 --ctx 1024 --ckpt 2 --max-sessions 4 --max-queue 2)

ms_now() { echo $(($(date +%s%N) / 1000000)); }
hwm_kb() { awk '/^VmHWM:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

# complete FILE PORT PROMPT: a non-stream /v1/completions, temperature 0
# (raw text in and out: the tiny model's random bytes are compared whole)
complete() {
    $PY -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 12,
        "temperature": 0}))' "$3" >"$1.req"
    curl -s --max-time 120 -H "Content-Type: application/json" -d @"$1.req" \
        "http://127.0.0.1:$2/v1/completions" >"$1"
}
field() { # FILE EXPR: a Python expression over the response j
    $PY -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1" 2>/dev/null
}

serve_start "$T/ref.out" "$T/ref.err" "${SERVE_ARGS[@]}" --port "$BASE" || {
    bad "reference server did not start: $(tail -3 "$T/ref.err")"
    exit 1
}
REF=$SRV

rec=0 errs=0 rss=0 worst=0
for ((i = 0; i < TRIALS; i++)); do
    words=$($PY -c "import random; r=random.Random($SEED + $i)
w='river stone lamp cloud apple tiger violin copper meadow candle orbit glacier'.split()
print(' '.join(r.choice(w) for _ in range(12)))")
    # turn 2 extends turn 1's prompt at a word boundary, so turn 1's ids are
    # a prefix of turn 2's (tiktoken's pre-split never merges across " and")
    p1="$words."
    p2="$p1 And then the $words were gone."

    # A: turn 1, then SIGKILL
    rm -rf "${D:?}"/*
    serve_start "$T/a$i.out" "$T/a$i.err" "${SERVE_ARGS[@]}" --ckpt-dir "$D" --port $((BASE + 1)) || {
        bad "trial $i: server A did not start: $(tail -3 "$T/a$i.err")"
        errs=$((errs + 1))
        continue
    }
    A=$SRV
    complete "$T/t1_$i" $((BASE + 1)) "$p1"
    nf=$(ls "$D" | grep -c '\.k3ck$')
    a_rss=$(hwm_kb "$A")
    [ "${a_rss:-0}" -gt "$rss" ] && rss=$a_rss
    kill -9 "$A"
    wait "$A" 2>/dev/null

    # the reference: turn 2 on a server that was never killed (no parked state)
    complete "$T/ref$i" "$BASE" "$p2"
    ref_text=$(field "$T/ref$i" 'json.dumps([j["choices"][0], j["usage"]["completion_tokens"]])')

    # B: restarted on the same directory, turn 2
    t_restart=$(ms_now)
    serve_start "$T/b$i.out" "$T/b$i.err" "${SERVE_ARGS[@]}" --ckpt-dir "$D" --port $((BASE + 2)) || {
        bad "trial $i: server B did not start: $(tail -3 "$T/b$i.err")"
        errs=$((errs + 1))
        continue
    }
    B=$SRV
    complete "$T/t2_$i" $((BASE + 2)) "$p2"
    t_done=$(ms_now)
    text2=$(field "$T/t2_$i" 'json.dumps([j["choices"][0], j["usage"]["completion_tokens"]])')
    cached=$(field "$T/t2_$i" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')
    prompt=$(field "$T/t2_$i" 'j["usage"]["prompt_tokens"]')
    b_rss=$(hwm_kb "$B")
    [ "${b_rss:-0}" -gt "$rss" ] && rss=$b_rss
    kill -TERM "$B"
    wait "$B" 2>/dev/null
    dt=$((t_done - t_restart))
    [ "$dt" -gt "$worst" ] && worst=$dt
    if [ -n "$text2" ] && [ "$text2" = "$ref_text" ] && [ "${cached:-0}" -gt 0 ] 2>/dev/null; then
        rec=$((rec + 1))
        ok "trial $i: restarted after kill -9, turn 2's text and token count equal the uninterrupted run's ($text2); $cached of $prompt prompt tokens from the parked checkpoint ($nf file(s)), restart to answer $dt ms"
    else
        errs=$((errs + 1))
        bad "trial $i: turn 2 after the restart: text '$text2' vs '$ref_text', cached ${cached:-?} of ${prompt:-?} ($(grep -E 'checkpoint|error' "$T/b$i.err" | tail -2))"
    fi
done
kill -TERM "$REF" 2>/dev/null
wait "$REF" 2>/dev/null

echo "ROW|coordinator (serve --local $LOCAL --ckpt 2 --ckpt-dir) killed with -9 between turns, restarted on the same directory|$TRIALS|$rec|$errs failed|$rss kB|$worst ms (restart + turn 2)"
[ "$rec" -eq "$TRIALS" ] || exit 1
exit $fail
