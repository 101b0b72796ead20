#!/usr/bin/env bash
# tests/bench/bench-plan.sh (make bench-plan): does `k3-coordinator plan`
# predict decode? Printed, not asserted; needs root (loop devices, blkio).
# The 2-layer slice at real dimensions (generated into
# $CACHE/workstation_slice when missing, 4.4 GB; repacked --bits 8 into
# $CACHE/workstation_slice_c8) on loop-device drives throttled with a cgroup
# v1 blkio group (tests/workstation_lib.sh), one set of drives per word of
# SETS (default "40 80,40 120,90,60,30": MB/s per drive, comma-separated).
# The first drive holds the container (and so the dense weights the load
# reads, the fastest first keeps the load short); with several drives plan measures
# them all, `place` stripes the experts over them by the plan's shares
# (sparse copies on the others) and the engine reads each expert from its
# drive (--placement). plan predicts s/token with the expert cache left by
# --ram RAM (default 2.0: 0 GB of expert cache, the dense weights take it
# all); the in-process engine then decodes 4 tokens inside the throttle
# with the plan's expert cache (its cache_gb, as bytes: the engine's
# --expert-gb counts GiB), at least 2 slots (0.04). The cache's slots also
# bound the expert reads in flight (with 2 slots at most 2 drives are read
# at once), so striped sets want RAM=2.2: 0.147 GB of cache, 8 slots, for
# which plan predicts a 52 % hit rate (cache / expert bytes) and the
# engine's policy keeps 7 of the 16 experts a token reads (44 %). The
# slice has 16 experts, all selected each token (topk 16): without cache
# each decode step reads 16 experts of 17.5 MB (its one MoE layer).
# Prints per set: each drive's share of the expert bytes against its share
# of the measured speed, the bytes place put on it, and predicted against
# measured s/token.
set -u
cd "$(dirname "$0")/../.."
. tests/lib.sh
need_bins "$C"
CACHE=${CACHE:-$HOME/.cache/k3shard}
S=$CACHE/workstation_slice
[ -f "$S/config.json" ] ||
    /usr/bin/python3 tests/fixtures/k3_gen.py --profile slice --layers 2 --experts 16 --out "$S"
[ -f "$S"_c8/model.safetensors.index.json ] || "$C" repack "$S" "$S"_c8 --bits 8
make_tmp workstation_benchplan
. tests/workstation_lib.sh
ws_init "bench-plan"
export K3_USAGE=off
CT_MB=$(($(du -sm "$S"_c8 | cut -f1) + 200))
n_set=0
set_done() { # the set's drives unmounted and freed (they live in /dev/shm)
    local x
    for x in "${WS_MOUNTS[@]}"; do umount "$x" 2>/dev/null || umount -l "$x"; done
    for x in "${WS_LOOPS[@]}"; do losetup -d "$x" 2>/dev/null; done
    rm -f /dev/shm/"$WS_TAG".*.img
    WS_MOUNTS=() WS_LOOPS=()
}
for set in ${SETS:-40 80,40 120,90,60,30}; do
    n_set=$((n_set + 1))
    IFS=, read -r -a rates <<<"$set"
    dirs=() i=0
    for r in "${rates[@]}"; do
        # the first drive holds the container, the others their stripe
        ws_drive "s${n_set}d$i" $([ $i = 0 ] && echo "$CT_MB" || echo 700)
        dirs+=("$WS_DIR")
        i=$((i + 1))
    done
    D=${dirs[0]}
    for f in "$S"_c8/*; do
        case $f in
        *.safetensors) dd if="$f" of="$D/$(basename "$f")" bs=16M oflag=direct status=none ;;
        *) cp "$f" "$D/" ;;
        esac
    done
    for k in "${!rates[@]}"; do ws_throttle "${dirs[$k]}" "${rates[$k]}"; done
    dl=$(IFS=,; echo "${dirs[*]}")
    sync
    echo 3 >/proc/sys/vm/drop_caches
    pred=$(ws_in_cg "$C" plan --model "$D" --drives "$dl" --ram "${RAM:-2.0}" --seconds 3 --out "$T/plan$n_set.json" 2>/dev/null |
        sed -n 's/^plan: predicted \([0-9.]*\) s\/token.*/\1/p')
    place=()
    if [ ${#rates[@]} -gt 1 ]; then
        w=$(/usr/bin/python3 -c 'import json,sys; print(",".join("%.6f" % d["share"] for d in json.load(open(sys.argv[1]))["drives"]))' "$T/plan$n_set.json")
        "$C" place --model "$D" --drives "$dl" --weights "$w" --usage off --out "$T/place$n_set.json" \
            2>"$T/place$n_set.err" || {
            echo "set $set: place failed: $(tail -1 "$T/place$n_set.err")"
            set_done
            continue
        }
        place=(--placement "$T/place$n_set.json")
    fi
    egb=$(/usr/bin/python3 -c 'import json,sys; print("%.4f" % max(0.04, sum(w["cache_gb"] for w in json.load(open(sys.argv[1]))["workers"]) * 1e9 / 2**30))' "$T/plan$n_set.json")
    sync
    echo 3 >/proc/sys/vm/drop_caches
    meas=$(ws_in_cg "$C" --model "$D" "${place[@]}" --local 0 --ids 5,7 --ngen 5 --expert-gb "$egb" --log-level info 2>&1 | tee "$T/run$n_set.log" |
        sed -n 's/.*decode: .*(\([0-9.]*\) ms\/token.*/\1/p')
    /usr/bin/python3 - "$T/plan$n_set.json" "$set" "$pred" "${meas:-0}" "$T/place$n_set.err" <<'EOF'
import json, os, re, sys
p, rates, pred, meas = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3] or 0), float(sys.argv[4]) / 1000
placed = {}
if os.path.exists(sys.argv[5]):
    for l in open(sys.argv[5]):
        m = re.match(r"place: drive (\d+) .*: (\d+) experts", l)
        if m:
            placed[int(m.group(1))] = int(m.group(2))
tot = sum(d["rand_gbs"] for d in p["drives"])
n_exp = sum(placed.values())
parts = []
for i, d in enumerate(p["drives"]):
    s = "drive %d (%s MB/s): share %.1f%% vs speed %.1f%%" % (i, rates.split(",")[i], 100 * d["share"], 100 * d["rand_gbs"] / tot)
    if placed:
        s += ", placed %.1f%% of experts" % (100.0 * placed.get(i, 0) / n_exp)
    parts.append(s)
err = abs(pred - meas) / meas * 100 if meas > 0 else float("nan")
print("set %s MB/s: %s; expert cache %.3f GB; plan predicts %.2f s/token, measured %.2f s/token (%.0f %% off)" % (rates, "; ".join(parts), sum(w["cache_gb"] for w in p["workers"]), pred, meas, err))
EOF
    set_done
done
