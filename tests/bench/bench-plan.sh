#!/usr/bin/env bash
# tests/bench/bench-plan.sh: does `k3-coordinator plan` predict decode?
# Printed, not asserted; needs root (loop device, blkio throttle).
# The 2-layer slice at real dimensions (generated into
# $CACHE/workstation_slice when missing, 4.4 GB; repacked --bits 8 into
# $CACHE/workstation_slice_c8) is copied onto one loop-device drive throttled
# to MBPS (default "40 80") MB/s (tests/workstation_lib.sh). plan measures
# it and predicts s/token with the expert cache left by --ram 2.0 (0 GB:
# the dense weights take it all); the in-process engine then decodes 4
# tokens with a 2-slot cache (--expert-gb 0.04) inside the throttle.
# The slice has 16 experts, all selected each token (topk 16), so each
# decode step reads ~16 experts of 17.5 MB.
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
for mbps in ${MBPS:-40 80}; do
    ws_drive "d$mbps" 3000
    D=$WS_DIR
    for f in "$S"_c8/*; do
        case $f in
        *.safetensors) dd if="$f" of="$D/$(basename "$f")" bs=16M oflag=direct status=none ;;
        *) cp "$f" "$D/" ;;
        esac
    done
    ws_throttle "$D" "$mbps"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    pred=$(ws_in_cg "$C" plan --model "$D" --drives "$D" --ram 2.0 --seconds 3 --out "$T/plan.json" 2>/dev/null |
        sed -n 's/^plan: predicted \([0-9.]*\) s\/token.*/\1/p')
    sync
    echo 3 >/proc/sys/vm/drop_caches
    meas=$(ws_in_cg "$C" --model "$D" --local 0 --ids 5,7 --ngen 5 --expert-gb 0.04 --log-level info 2>&1 |
        sed -n 's/.*decode: .*(\([0-9.]*\) ms\/token.*/\1/p')
    echo "drive $mbps MB/s: plan predicts $pred s/token, measured $(echo "$meas" | awk '{printf "%.3f", $1 / 1000}') s/token"
done
