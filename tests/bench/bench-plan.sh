#!/usr/bin/env bash
# tests/bench/bench-plan.sh (make bench-plan): does `k3-coordinator plan`
# predict decode? Needs root (loop devices, blkio). Prints two lines per
# set of drives and cache size (the plan's terms, predicted against
# measured s/token and the error) and at the end "bench-plan: worst error
# N % over M runs on 2+ drives (target 25 %)".
# The 2-layer slice at real dimensions (generated into
# $CACHE/workstation_slice when missing, 4.4 GB; repacked --bits 8 into
# $CACHE/workstation_slice_c8) on loop-device drives throttled with a cgroup
# v1 blkio group (tests/workstation_lib.sh), one set of drives per word of
# SETS (default "40 80,40 120,90,60,30": MB/s per drive, comma-separated).
# The first drive holds the container (and so the dense weights the load
# reads; the fastest first keeps the load short); with several drives plan
# measures them all, `place` stripes the experts over them by the plan's
# shares (sparse copies on the others) and the engine reads each expert
# from its drive (--placement) with K3_READ_DEPTH reads in flight per drive
# (READ_DEPTH, default 0 = the engine's 2; -1 = the cache slots bound the
# reads, the engine before 2026-12-02). For each RAM of RAMS (default
# "2.08 2.2" GB: the dense weights take 1.83 GB of 90 %, leaving 2 and 8
# expert slots per layer) plan predicts s/token (--remeasure: the drives
# and the host's compute measured in this run, under this load) and the
# in-process engine decodes 5 tokens inside the throttle with the plan's
# expert cache (its cache_gb, as bytes: the engine's --expert-gb counts
# GiB; at least 2 slots, 0.04). The slice has 16 experts, all selected each
# token (topk 16): each decode step reads the 16 - slots experts not
# cached (its one MoE layer). BENCH_TAG prefixes the /tmp directory and
# /dev/shm files (agreements between concurrent runs).
set -u
cd "$(dirname "$0")/../.."
. tests/lib.sh
need_bins "$C"
CACHE=${CACHE:-$HOME/.cache/k3shard}
S=$CACHE/workstation_slice
[ -f "$S/config.json" ] ||
    /usr/bin/python3 tests/fixtures/k3_gen.py --profile slice --layers 2 --experts 16 --out "$S"
[ -f "$S"_c8/model.safetensors.index.json ] || "$C" repack "$S" "$S"_c8 --bits 8
make_tmp "${BENCH_TAG:+${BENCH_TAG}-}workstation_benchplan"
. tests/workstation_lib.sh
[ -n "${BENCH_TAG:-}" ] && WS_TAG=${BENCH_TAG}_$WS_TAG && WS_CG=/sys/fs/cgroup/blkio/$WS_TAG
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
    place=()
    if [ ${#rates[@]} -gt 1 ]; then
        # the shares do not depend on the cache: one plan places the experts
        ws_in_cg "$C" plan --model "$D" --drives "$dl" --ram 2.0 --seconds 3 \
            --out "$T/share$n_set.json" >/dev/null 2>&1
        w=$(/usr/bin/python3 -c 'import json,sys; print(",".join("%.6f" % d["share"] for d in json.load(open(sys.argv[1]))["drives"]))' "$T/share$n_set.json")
        "$C" place --model "$D" --drives "$dl" --weights "$w" --usage off --out "$T/place$n_set.json" \
            2>"$T/place$n_set.err" || {
            echo "set $set: place failed: $(tail -1 "$T/place$n_set.err")"
            set_done
            continue
        }
        place=(--placement "$T/place$n_set.json")
    fi
    for ram in ${RAMS:-2.08 2.2}; do
        sync
        echo 3 >/proc/sys/vm/drop_caches
        ws_in_cg "$C" plan --model "$D" --drives "$dl" --ram "$ram" --seconds 3 --remeasure \
            --out "$T/plan$n_set.json" >"$T/plan$n_set.txt" 2>&1
        pred=$(sed -n 's/^plan: predicted \([0-9.]*\) s\/token.*/\1/p' "$T/plan$n_set.txt")
        egb=$(/usr/bin/python3 -c 'import json,sys; print("%.4f" % max(0.04, sum(w["cache_gb"] for w in json.load(open(sys.argv[1]))["workers"]) * 1e9 / 2**30))' "$T/plan$n_set.json")
        sync
        echo 3 >/proc/sys/vm/drop_caches
        t0=$(date +%s)
        meas=$(K3_READ_DEPTH=${READ_DEPTH:-0} ws_in_cg "$C" --model "$D" "${place[@]}" --local 0 \
            --ids 5,7 --ngen 5 --expert-gb "$egb" --log-level info --stats 2>&1 | tee "$T/run$n_set.log" |
            sed -n 's/.*decode: .*(\([0-9.]*\) ms\/token.*/\1/p')
        /usr/bin/python3 - "$T/plan$n_set.json" "$set" "${pred:-0}" "${meas:-0}" "$T/place$n_set.err" \
            "$T/errors" "$(($(date +%s) - t0))" "$(cut -d' ' -f1-3 /proc/loadavg)" "$T/run$n_set.log" <<'PYEOF'
import json, os, re, sys
p, rates = json.load(open(sys.argv[1])), sys.argv[2]
pred, meas = float(sys.argv[3]), float(sys.argv[4]) / 1000
placed = {}
if os.path.exists(sys.argv[5]):
    for l in open(sys.argv[5]):
        m = re.match(r"place: drive (\d+) .*: (\d+) experts", l)
        if m:
            placed[int(m.group(1))] = int(m.group(2))
tot = sum(d["rand_gbs"] for d in p["drives"])
parts = []
for i, d in enumerate(p["drives"]):
    s = "drive %d (%s MB/s): share %.1f%% vs speed %.1f%%" % (
        i, rates.split(",")[i], 100 * d["share"], 100 * d["rand_gbs"] / tot)
    if placed:
        s += ", %d experts" % placed.get(i, 0)
    parts.append(s)
t = p.get("prediction", {})
w = p["workers"][0]
err = (pred - meas) / meas * 100 if meas > 0 and pred > 0 else float("nan")
print("set %s MB/s, cache %.3f GB (%s slots/layer): %s" % (
    rates, sum(x["cache_gb"] for x in p["workers"]), w.get("slots", "?"), "; ".join(parts)))
print("    plan: reads %.3f + compute not under them %.3f + compute beyond them %.3f + dense/head "
      "%.3f s (dense %.2f GB/s, expert %.1f ms) = %.2f s/token; measured %.2f s/token; error "
      "%+.0f %% (run %s s, load %s)" % (
          t.get("reads_s", 0), t.get("compute_not_under_reads_s", 0),
          t.get("compute_beyond_reads_s", 0), t.get("dense_layers_and_head_s", 0),
          t.get("dense_gbs", 0), t.get("expert_ms", 0), pred, meas, err, sys.argv[7], sys.argv[8]))
# the engine's own counts (--stats): hits and misses over the run, MB per drive
hm, dmb = "", []
for l in open(sys.argv[9], errors="replace"):
    m = re.search(r"stats: expert store .*?(\d+) hits, (\d+) misses", l)
    if m:
        hm = "engine: %s hits, %s misses" % m.groups()
    m = re.search(r"stats: expert drive (\d+): ([0-9.]+) MB read", l)
    if m:
        dmb.append("%.0f" % float(m.group(2)))
if hm:
    print("    %s%s" % (hm, "; MB read per drive: " + " / ".join(dmb) if dmb else ""))
with open(sys.argv[6], "a") as f:
    f.write("%d %.1f\n" % (len(p["drives"]), abs(err) if err == err else 999))
PYEOF
    done
    set_done
done
if [ -f "$T/errors" ]; then
    awk '$1 >= 2 {if ($2 > m) m = $2; n++} END {if (n) printf "bench-plan: worst error %.0f %% over %d runs on 2+ drives (target 25 %%)\n", m, n}' "$T/errors"
    awk '$1 < 2 {if ($2 > m) m = $2; n++} END {if (n) printf "bench-plan: worst error %.0f %% over %d runs on 1 drive\n", m, n}' "$T/errors"
fi
