#!/usr/bin/env bash
# tests/integration/test_doctor.sh: `k3-coordinator doctor` passes a good
# snapshot and a good container (exit 0), and each broken case is reported
# by the check that should catch it, with a fix, exit 1: a wrong-shape
# prepared matrix (container), a missing .qs sidecar (files), a truncated
# shard and a missing shard (files), an interrupted repack's .tmp (files),
# no tokenizer (tokenizer), a low open-file limit (limits), a missing
# drive and a full drive (drive N); --workers: a worker of this model
# passes with its name, build, protocol version and layers, a worker of
# another model and an endpoint nobody listens on fail (worker). A
# flipped expert byte is not doctor's to find (no checksums): repack
# --verify-full finds it (test_repack.sh).
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp workstation_doctor
. "$(dirname "$0")/../workstation_lib.sh"
PY=/usr/bin/python3

"$C" repack "$TINY" "$T/ct" --bits 8 --quiet 2>/dev/null || bad "repack for the doctor test"

expect_pass() { # what args...
    local what=$1
    shift
    if "$C" doctor "$@" >"$T/out" 2>&1; then
        ok "doctor passes $what ($(tail -1 "$T/out" | sed 's/doctor: //'))"
    else
        bad "doctor fails $what: $(grep -m1 FAIL "$T/out")"
    fi
}
expect_fail() { # what check args...
    local what=$1 check=$2
    shift 2
    "$C" doctor "$@" >"$T/out" 2>&1
    local rc=$?
    if [ $rc -eq 1 ] && grep -q "^FAIL  $check " "$T/out" && grep -q 'fix:' "$T/out"; then
        ok "$what: reported by '$check' with a fix: $(grep -m1 "^FAIL  $check" "$T/out" | cut -c18- | cut -c1-110)"
    else
        bad "$what: expected a FAIL of '$check' and exit 1, got rc $rc: $(grep -m1 FAIL "$T/out")"
    fi
}
fresh() { rm -rf "$T/b"; cp -r "$T/ct" "$T/b"; }

expect_pass "the tiny snapshot" --model "$TINY"
expect_pass "an int8 container" --model "$T/ct"
if $PY "$(dirname "$0")/../fixtures/k3_gen.py" --profile tiny --single-file --out "$T/single" >/dev/null 2>&1; then
    expect_pass "a single-file snapshot (no index.json)" --model "$T/single"
else
    bad "k3_gen.py --single-file failed"
fi

# broken containers (the same edits as test_repack.sh)
fresh
ws_edit_header "$T/b" swap >/dev/null
"$C" repack "$TINY" "$T/b" --bits 8 --quiet 2>/dev/null # index of the edited shards
expect_fail "a wrong-shape prepared matrix" container --model "$T/b"
fresh
ws_edit_header "$T/b" noqs >/dev/null
"$C" repack "$TINY" "$T/b" --bits 8 --quiet 2>/dev/null
expect_fail "a missing .qs sidecar" files --model "$T/b"
fresh
f=$(ls "$T/b"/model-00003-*.safetensors)
truncate -s -100 "$f"
expect_fail "a truncated shard" files --model "$T/b"
fresh
rm "$T/b"/model-00005-*.safetensors
expect_fail "a missing shard" files --model "$T/b"
fresh
cp "$T/b"/model-00002-*.safetensors "$T/b/model-00002-of-00009.safetensors.tmp"
expect_fail "an interrupted repack" files --model "$T/b"
fresh
rm "$T/b/tiktoken.model"
expect_fail "no tokenizer" tokenizer --model "$T/b"
if bash -c 'ulimit -n 64 && exec "$@"' sh "$C" doctor --model "$T/ct" >"$T/out" 2>&1; then
    bad "doctor passed with ulimit -n 64"
elif grep -q '^FAIL  limits ' "$T/out" && grep -q 'ulimit -n' "$T/out"; then
    ok "a low open-file limit: reported by 'limits' with a fix: $(grep -m1 'fix:' "$T/out" | sed 's/.*fix: //')"
else
    bad "ulimit -n 64: expected a FAIL of 'limits': $(grep -m1 FAIL "$T/out")"
fi

# drives
expect_fail "a missing drive" "drive 1" --model "$T/ct" --drives "$T/nope"
# --workers: a STATS probe each, a HELLO to an idle one (coordinator/doctor_workers.c)
if [ -x "$W" ]; then
    ep1="tcp://127.0.0.1:$(port)" ep2="tcp://127.0.0.1:$(port)" ep3="tcp://127.0.0.1:$(port)"
    K3_LOG=info "$W" --model "$T/ct" --layers 0-8 --listen "$ep1" --threads 1 --no-bench \
        --usage off --name dw1 2>"$T/w1.log" &
    wp1=$!
    K3_LOG=info "$W" --model "$TINY" --layers 0-8 --listen "$ep2" --threads 1 --no-bench \
        --usage off --name dw2 2>"$T/w2.log" &
    wp2=$!
    if wait_line "$T/w1.log" "serving layers" $wp1 60 && wait_line "$T/w2.log" "serving layers" $wp2 60; then
        K3_BITS=8 "$C" doctor --model "$T/ct" --workers "$ep1" >"$T/out" 2>&1
        grep -q "^PASS  worker .*same model; its settings differ .*'bits' mismatch" "$T/out" &&
            ok "K3_BITS=8 against a bits-4 worker: the line names the setting" ||
            bad "K3_BITS=8 against a bits-4 worker: $(grep worker "$T/out")"
        expect_pass "a worker of this model" --model "$T/ct" --workers "$ep1"
        grep -q "^PASS  worker .*dw1, build 'k3shard proto [0-9.]*[^']*', protocol [0-9]*\.[0-9]*, layers 0-7" "$T/out" &&
            ok "the worker's line names it, its build, protocol and layers: $(grep '^PASS  worker' "$T/out" | cut -c1-110)" ||
            bad "the worker's line: $(grep 'worker' "$T/out")"
        # the worker is now registered (the HELLO above): a second probe is
        # STATS only, and the worker sees no new registration
        "$C" doctor --model "$T/ct" --workers "$ep1" >"$T/out" 2>&1
        nreg=$(grep -c 'registered (epoch' "$T/w1.log")
        grep -q "^PASS  worker .*dw1, .*a coordinator is registered: model and settings not checked" "$T/out" &&
            [ "$nreg" = 1 ] &&
            ok "a worker a coordinator holds: STATS only, no HELLO (1 registration in its log)" ||
            bad "a registered worker: $nreg registrations: $(grep worker "$T/out")"
        expect_fail "a worker of another model" "worker" --model "$T/ct" --workers "$ep1,$ep2"
        grep -q "$ep2: protocol .*refused this model" "$T/out" ||
            bad "another model's worker: $(grep "$ep2" "$T/out")"
        expect_fail "an endpoint nobody listens on" "worker" --model "$T/ct" --workers "$ep3"
    else
        bad "workers for the --workers checks did not start: $(tail -1 "$T/w1.log") $(tail -1 "$T/w2.log")"
    fi
    kill $wp1 $wp2 2>/dev/null
    wait $wp1 $wp2 2>/dev/null
else
    skip "doctor --workers" "no k3-worker in $BUILD"
fi
if [ "$(id -u)" -ne 0 ]; then
    skip "good and full loop drives" "needs root"
    exit $fail
fi
ws_init "good and full loop drives"
ws_drive good 96
good=$WS_DIR
expect_pass "a good container and a good loop drive" --model "$T/ct" --drives "$good" --seconds 0.3
grep -q "^PASS  drive 1 .*O_DIRECT ok" "$T/out" || bad "the good drive's line: $(grep 'drive 1' "$T/out")"
ws_drive full 8
full=$WS_DIR
dd if=/dev/zero of="$full/fill" bs=1M status=none 2>/dev/null
expect_fail "a full drive" "drive 2" --model "$T/ct" --drives "$good,$full" --seconds 0.3
exit $fail
