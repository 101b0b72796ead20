#!/usr/bin/env bash
# tests/integration/test_plan.sh: `k3-coordinator plan` on 2 and 4 throttled
# loop-device drives of different speeds (tests/workstation_lib.sh):
# each drive's share of the expert bytes follows its throttle within 15 %,
# the plan file has the agreed format (docs/DEPLOY.md "Workstation"), and a
# second run takes the measurements from the drives' caches.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp workstation_plan
. "$(dirname "$0")/../workstation_lib.sh"
ws_init "plan on throttled loop drives"
PY=/usr/bin/python3

run_case() { # name mbps...
    local name=$1 i=0 d dirs="" rates=""
    shift
    for r in "$@"; do
        ws_drive "${name}_$i" 96 || { bad "$name: cannot make drive $i"; return; }
        d=$WS_DIR
        dd if=/dev/zero of="$d/fill" bs=1M count=72 conv=fsync status=none
        ws_throttle "$d" "$r"
        dirs+="${dirs:+,}$d" rates+="${rates:+,}$r"
        i=$((i + 1))
    done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    if ! ws_in_cg "$C" plan --model "$TINY" --drives "$dirs" --seconds 1.5 --ram 0.0005 --out "$T/$name.json" \
        >"$T/$name.out" 2>"$T/$name.err"; then
        bad "$name: plan failed: $(tail -1 "$T/$name.err")"
        return
    fi
    res=$($PY - "$T/$name.json" "$rates" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
rates = [float(x) for x in sys.argv[2].split(",")]
assert p["format"] == "k3shard-plan" and p["version"] == 1, "format"
assert p["optimises"] == "single-session decode", "optimises"
assert p["predicted_s_per_token"] > 0, "prediction"
shares = [d["share"] for d in p["drives"]]
assert abs(sum(shares) - 1) < 1e-6, "shares sum to %g" % sum(shares)
layers = sorted(l for w in p["workers"] for l in range(w["layers"][0], w["layers"][1] + 1))
assert layers == list(range(len(layers))), "layers not covered once"
want = [r / sum(rates) for r in rates]
worst = max(abs(s - w) / w for s, w in zip(shares, want))
print("%.3f %s %s" % (worst, " ".join("%.3f" % s for s in shares), " ".join("%.3f" % w for w in want)))
PY
) || { bad "$name: plan file: $res"; return; }
    set -- $res
    local worst=$1
    shift
    if $PY -c "import sys; sys.exit(0 if $worst <= 0.15 else 1)"; then
        ok "$name: shares ${*:1:$i} vs throttle shares ${*:$((i + 1))} (worst error $(printf %.0f "$($PY -c "print($worst*100)")") % <= 15 %)"
    else
        bad "$name: shares ${*:1:$i} vs throttle shares ${*:$((i + 1))}: worst error $worst > 0.15"
    fi
    # a second run uses the cached measurements
    if ws_in_cg "$C" plan --model "$TINY" --drives "$dirs" --ram 0.0005 --out "$T/$name.2.json" >/dev/null 2>"$T/$name.2.err" &&
        [ "$(grep -c '(cached)' "$T/$name.2.err")" = "$i" ]; then
        ok "$name: a second plan reads the $i drives' cached measurements"
    else
        bad "$name: second plan did not use the cache: $(tail -1 "$T/$name.2.err")"
    fi
}

run_case two 40 80
run_case four 30 60 90 120
exit $fail
