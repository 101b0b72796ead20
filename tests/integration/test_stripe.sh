#!/usr/bin/env bash
# tests/integration/test_stripe.sh: expert striping (docs/CLUSTER.md "Expert
# striping", common/experts/placement.h, coordinator/cmd_place.c) on tiny:
#  - `k3-coordinator place --copy` over 4 drives writes sparse copies (each
#    drive holds only its experts' bytes), a rerun keeps every file, a
#    stale .tmp and a lost record are redone; --weights 3,1 puts 3x the
#    experts on the first drive; a plan file's shares are read;
#  - logits and ids bit-identical to --local 0 (unstriped) for --local 0..4
#    with --placement (chunk 32; chunk 1 on 0 and 4); --local 2 --stripe
#    --dirs (hard links); two tcp workers with --placement; test_cluster's
#    identity checks (ipc and tcp, 1, 2, 3, 8 stages, chunk 1 and 32, 3
#    concurrent sessions) and liveness checks (kill -9 mid-decode within
#    2 x TTL, resume token-identical; SIGSTOP; a stuck step) with every
#    worker striped (K3_PLACEMENT); two striped workers in another network
#    namespace over CURVE (root);
#  - refusals at start, naming the thing: another model's placement, a
#    missing drive file, an expert claimed by two drives, --stripe without
#    --dirs.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp stripe-test
export K3_LOG=warn

identity_runs 11 29 5 # IDS, run NAME ARGS..., same A B (tests/lib.sh)

# ---- place ----------------------------------------------------------------
D="$T/d0,$T/d1,$T/d2,$T/d3"
if "$C" place --model "$TINY" --drives "$D" --copy --usage off --out "$T/p4.json" 2>"$T/place.err"; then
    ok "place over 4 drives: $(tail -1 "$T/place.err" | cut -c1-90)"
else
    bad "place over 4 drives failed: $(tail -2 "$T/place.err")"
fi
grep -q 'B) copied' "$T/place.err" && grep -q 'drive 3 .*/d3: ' "$T/place.err" &&
    ok "place reports the bytes copied and each drive's experts" ||
    bad "place's report: $(cat "$T/place.err")"
# sparse: each drive file has the shard's size but holds about a quarter of
# the expert bytes (allocated blocks well below the apparent size)
sparse=$(/usr/bin/python3 - "$TINY" "$T" <<'EOF'
import os, sys
tiny, t = sys.argv[1], sys.argv[2]
ok = 1
for d in range(4):
    sd = os.path.join(t, "d%d" % d, "k3-stripe")
    for f in os.listdir(sd):
        if not f.endswith(".safetensors"):
            continue
        st = os.stat(os.path.join(sd, f))
        ok &= st.st_size == os.path.getsize(os.path.join(tiny, f))
        ok &= st.st_blocks * 512 < st.st_size * 0.6 or st.st_size < 1 << 16
print(ok)
EOF
)
[ "$sparse" = 1 ] && ok "drive files have the shard's size and are sparse (a stripe each)" ||
    bad "drive files: sizes or sparseness wrong"
"$C" place --model "$TINY" --drives "$D" --copy --usage off --out "$T/p4b.json" 2>"$T/place2.err"
grep -q '(0 B) copied' "$T/place2.err" && cmp -s "$T/p4.json" "$T/p4b.json" &&
    ok "a rerun keeps every complete file and writes the same placement" ||
    bad "rerun: $(tail -1 "$T/place2.err")"
f=$(ls "$T/d1/k3-stripe/"*.safetensors | head -1)
echo junk >"$f.tmp"
: >"$T/d1/k3-stripe/.done"
"$C" place --model "$TINY" --drives "$D" --copy --usage off --out "$T/p4.json" 2>"$T/place3.err"
if ! grep -q '(0 B) copied' "$T/place3.err" && ! grep -q '(0 B) kept' "$T/place3.err" &&
    [ ! -e "$f.tmp" ] && cmp -s "$T/p4.json" "$T/p4b.json"; then
    ok "after a lost record and a stale .tmp that drive's files are redone, the others kept"
else
    bad "resume: $(tail -1 "$T/place3.err")"
fi
"$C" place --model "$TINY" --drives "$T/w0,$T/w1" --weights 3,1 --copy --usage off \
    --out "$T/pw.json" 2>"$T/placew.err"
ratio=$(/usr/bin/python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
a = sum(len(l["experts"][0]) for l in p["layers"]); b = sum(len(l["experts"][1]) for l in p["layers"])
print("%d %d" % (a, b))' "$T/pw.json")
set -- $ratio
[ "$1" = $((3 * $2)) ] && ok "--weights 3,1: the first drive holds 3x the experts ($1 vs $2)" ||
    bad "--weights 3,1 gave $ratio"
fp=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model_fingerprint"])' "$T/p4.json")
cat >"$T/plan.json" <<EOF
{"format":"k3shard-plan","version":1,"model":"$TINY","model_fingerprint":"$fp",
 "optimises":"single-session decode","drives":[{"path":"$T/q0","seq_gbs":7,"rand_gbs":5,"numa":0,"share":0.25},
 {"path":"$T/q1","seq_gbs":7,"rand_gbs":5,"numa":0,"share":0.75}],"workers":[],"predicted_s_per_token":1}
EOF
"$C" place --model "$TINY" --plan "$T/plan.json" --copy --usage off 2>"$T/placep.err" &&
    grep -q "drive 1 $T/q1" "$T/placep.err" && [ -s "$T/q0/k3-stripe/placement.json" ] &&
    ok "--plan: drives and shares from a plan file, placement in the first drive" ||
    bad "--plan: $(tail -2 "$T/placep.err")"
sed 's/"model_fingerprint":"[0-9a-f]*"/"model_fingerprint":"00000000deadbeef"/' "$T/plan.json" >"$T/plan2.json"
"$C" place --model "$TINY" --plan "$T/plan2.json" 2>"$T/placep2.err"
grep -q '00000000deadbeef' "$T/placep2.err" && ok "a plan of another model is refused naming it" ||
    bad "plan of another model: $(tail -1 "$T/placep2.err")"

# ---- bit identity -------------------------------------------------------------
run ref --local 0 --chunk 32 || bad "--local 0: $(tail -1 "$T/ref.err")"
# chunk 32 on every split; chunk 1 in process and on 4 workers (test_cluster
# below covers chunk 1 on 1, 2, 3 and 8 stages)
for chunk in 32 1; do
    Ls="0 1 2 3 4"
    [ $chunk = 1 ] && Ls="0 4"
    for L in $Ls; do
        if run s$L --local $L --chunk $chunk --placement "$T/p4.json" && same s$L ref; then
            ok "--local $L --chunk $chunk striped over 4 drives: logits and ids identical to --local 0"
        else
            bad "--local $L --chunk $chunk striped differs or failed: $(tail -1 "$T/s$L.err")"
        fi
    done
done
if run st2 --local 2 --chunk 32 --stripe --dirs "$T/e0,$T/e1,$T/e2" && same st2 ref &&
    [ -s "$T/e0/k3-stripe/placement.json" ]; then
    ok "--local 2 --stripe --dirs (3 drives, hard links): identical to --local 0"
else
    bad "--local 2 --stripe: $(tail -2 "$T/st2.err")"
fi
EPS=()
for r in "0 5" "5 8"; do
    set -- $r
    ep="tcp://127.0.0.1:$(port)"
    "$W" --model "$TINY" --layers "$1-$2" --listen "$ep" --threads 1 --no-bench --usage off \
        --placement "$T/p4.json" --name "s$1" 2>>"$T/tcpw.log" &
    PIDS+=($!)
    EPS+=("$ep")
done
if run tcp --workers "$(IFS=,; echo "${EPS[*]}")" --chunk 32 && same tcp ref; then
    ok "2 tcp workers with --placement: identical to --local 0"
else
    bad "tcp workers striped: $(tail -2 "$T/tcp.err")"
fi
if [ -x "$BUILD/tests/test_cluster" ]; then
    K3_PLACEMENT="$T/p4.json" K3_TEST_CLUSTER_ONLY=identity K3_LOG=info \
        "$BUILD/tests/test_cluster" >"$T/tc.out" 2>"$T/tc.err"
    n_ok=$(grep -c '^ok - .*bit-identical to in-process' "$T/tc.out")
    n_striped=$(grep -c 'striped over 4 drives' "$T/tc.err")
    if ! grep -q '^not ok' "$T/tc.out" && [ "$n_ok" -ge 16 ] && [ "$n_striped" -ge 14 ]; then
        ok "test_cluster identity with every worker striped: $n_ok checks (ipc, tcp, 1-8 stages, chunk 1 and 32, 3 concurrent sessions), $n_striped striped workers"
    else
        bad "test_cluster identity striped: $n_ok identical, $n_striped striped workers, $(grep '^not ok' "$T/tc.out" | head -2)"
    fi
    # liveness with striped workers: kill -9 mid-decode, SIGSTOP, a stuck step
    K3_PLACEMENT="$T/p4.json" K3_TEST_CLUSTER_ONLY=liveness K3_LOG=info \
        "$BUILD/tests/test_cluster" >"$T/lv.out" 2>"$T/lv.err"
    n_striped=$(grep -c 'striped over 4 drives' "$T/lv.err")
    if ! grep -q '^not ok' "$T/lv.out" && grep -q '^ok - T1 kill -9: error after' "$T/lv.out" &&
        grep -q '^ok - T1 resume: killed at token 10' "$T/lv.out" && [ "$n_striped" -ge 2 ]; then
        ok "striped workers, kill -9 mid-decode: $(grep -o 'error after [0-9]* ms (<= 2 x TTL = [0-9]*)' "$T/lv.out"); the resumed generation equals the uninterrupted one"
    else
        bad "liveness with striped workers: $n_striped striped, $(grep '^not ok' "$T/lv.out" | head -2)"
    fi
else
    bad "$BUILD/tests/test_cluster not built"
fi

# ---- CURVE across two network namespaces, striped workers -------------------
curve() {
    local NA=stripeA$$ NB=stripeB$$ VA=stripeva$$ VB=stripevb$$ ep
    if [ "$(id -u)" != 0 ] || ! ip netns add "$NA" 2>/dev/null; then
        skip "striped workers over CURVE across namespaces" "needs root and ip netns"
        return
    fi
    ip netns add "$NB" && ip link add "$VA" type veth peer name "$VB" &&
        ip link set "$VA" netns "$NA" && ip link set "$VB" netns "$NB" &&
        ip -n "$NA" addr add 10.79.0.1/24 dev "$VA" && ip -n "$NB" addr add 10.79.0.2/24 dev "$VB" &&
        ip -n "$NA" link set "$VA" up && ip -n "$NB" link set "$VB" up &&
        ip -n "$NA" link set lo up && ip -n "$NB" link set lo up
    if [ $? -ne 0 ]; then
        skip "striped workers over CURVE across namespaces" "cannot join namespaces with a veth pair"
    else
        for k in coord w0 w1; do "$C" keygen "$T/$k" >/dev/null 2>&1; done
        cp "$T/coord.pub" "$T/allow"
        : >"$T/wkeys"
        for i in 0 1; do
            echo "tcp://10.79.0.2:555$i $(sed -n 's/^public = //p' "$T/w$i.pub")" >>"$T/wkeys"
        done
        local cw cc
        cw=$(readlink -f "$W") cc=$(readlink -f "$C")
        for r in "0 0 4" "1 4 8"; do
            set -- $r
            ip netns exec "$NB" "$cw" --model "$(readlink -f "$TINY")" --layers "$2-$3" \
                --listen "tcp://10.79.0.2:555$1" --curve-secret "$T/w$1.key" --allow "$T/allow" \
                --placement "$T/p4.json" --usage off --threads 1 --no-bench --name "cw$1" \
                2>>"$T/cw.log" &
            PIDS+=($!)
        done
        timeout 60 ip netns exec "$NA" "$cc" --model "$(readlink -f "$TINY")" --ids "$IDS" --ngen 5 \
            --print-ids --threads 1 --usage off --all-logits "$T/curve.f32" --chunk 32 \
            --workers tcp://10.79.0.2:5550,tcp://10.79.0.2:5551 --curve-secret "$T/coord.key" \
            --worker-keys "$T/wkeys" >"$T/curve.out" 2>"$T/curve.err"
        grep '^ids:' "$T/curve.out" >"$T/curve.ids"
        if same curve ref; then
            ok "2 striped workers in another namespace over CURVE: identical to --local 0"
        else
            bad "striped over CURVE: $(tail -2 "$T/curve.err")"
        fi
    fi
    ip netns del "$NA" 2>/dev/null
    ip netns del "$NB" 2>/dev/null
    ip link del "$VA" 2>/dev/null
}
curve

# ---- refusals ------------------------------------------------------------------
sed 's/"model_fingerprint":"[0-9a-f]*"/"model_fingerprint":"00000000deadbeef"/' "$T/p4.json" >"$T/other.json"
run other --local 1 --placement "$T/other.json"
grep -q 'other.json was made for model 00000000deadbeef' "$T/other.err" &&
    ok "another model's placement is refused at start, naming it: $(grep -o 'placement [^ ]* was made for model [0-9a-f]*' "$T/other.err" | head -1)" ||
    bad "another model's placement: $(tail -2 "$T/other.err")"
/usr/bin/python3 - "$T/p4.json" "$T/twice.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
l = p["layers"][0]
l["experts"][1].append(l["experts"][0][0])
json.dump(p, open(sys.argv[2], "w"))
EOF
run twice --local 0 --placement "$T/twice.json"
grep -q 'is claimed twice: by drive 0' "$T/twice.err" &&
    ok "an expert claimed by two drives is refused naming it: $(grep -o 'layer [0-9]* expert [0-9]* is claimed twice' "$T/twice.err")" ||
    bad "claimed twice: $(tail -2 "$T/twice.err")"
cp -a "$T/d3" "$T/d3.keep"
rm -f "$T/d3/k3-stripe/"*.safetensors
run missing --local 2 --placement "$T/p4.json"
grep -q 'is on drive 3, but its file .*/d3/k3-stripe/.*safetensors cannot be opened' "$T/missing.err" &&
    ok "a missing expert file is refused at start naming it" ||
    bad "missing expert file: $(tail -2 "$T/missing.err")"
rm -rf "$T/d3" && mv "$T/d3.keep" "$T/d3"
"$C" --model "$TINY" --ids 1,2 --stripe 2>"$T/nodirs.err"
[ $? = 2 ] && grep -q -- '--stripe needs --dirs' "$T/nodirs.err" &&
    ok "--stripe without --dirs is a usage error" || bad "--stripe without --dirs: $(cat "$T/nodirs.err")"
exit $fail
