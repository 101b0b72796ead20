#!/usr/bin/env bash
# tests/bench/bench-vk.sh: builds tests/bench/bench_vk.c with the Makefile's
# compiler and flags and runs it (`make bench-vk`): one MXFP4 expert's time
# on the Vulkan device (lavapipe here) against the CPU exact-float kernel,
# paired round by round. Prints a table; not a timed test. Extra arguments
# go to the program (--quick: K3 width only at n = 1, fewer rounds).
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_vk"
"$BUILD/bench/bench_vk" "$@"

# The tier in a run (common/vk/vk_tier.c, the hook in common/layers/moe.c):
# the tiny checkpoint, --exact, CPU alone against --vk with every expert
# resident (filled from a usage history written by a first run). From the
# --stats line: device and CPU expert time per MoE step, the time a step
# waited for the device after its CPU part, and the overlap achieved: the
# share of the device time hidden behind the step's CPU work.
TINY=${TINY:-$BUILD/fixtures/tiny}
C=$BUILD/k3-coordinator
if [ ! -f "$TINY/config.json" ] || [ ! -x "$C" ]; then
    echo "bench-vk: no $TINY or $C (make tiny all): the run table is skipped"
    exit 0
fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
IDS=5,17,200,33,901,44,12,7,300,301,302,1000,64,65,66,67
"$C" --model "$TINY" --local 0 --exact --ids "$IDS" --ngen 2 --usage "$T/hist" >/dev/null 2>&1
echo
echo "tier in a run: tiny checkpoint, --exact, prompt of 16 ids + 16 generated, every expert resident"
printf '%-8s %10s %10s %12s %12s %12s %10s %s\n' "run" "wall ms" "decode ms" "dev ms/step" \
    "CPU ms/step" "waited/step" "overlap" "same bytes"
for mode in cpu vk; do
    args=(--threads 2)
    if [ $mode = vk ]; then args+=(--vk --vk-gb 0.001); fi
    t0=$(date +%s.%N)
    K3_USAGE_SAVE=0 K3_LOG=info "$C" --model "$TINY" --local 0 --exact --ids "$IDS" --ngen 16 \
        --usage "$T/hist" --stats --all-logits "$T/$mode.f32" "${args[@]}" >"$T/$mode.out" \
        2>"$T/$mode.err"
    wall=$(awk "BEGIN{printf \"%.0f\", ($(date +%s.%N) - $t0) * 1000}")
    dec=$(grep -o 'decode: [0-9]* tokens in [0-9.]* ms' "$T/$mode.err" | awk '{print $5}' || true)
    line=$(grep '^stats: vulkan' "$T/$mode.err" || true)
    dev=$(echo "$line" | grep -o 'device [0-9.]* ms,' | awk '{print $2}' || true)
    cpu=$(echo "$line" | grep -o 'CPU [0-9.]* ms,' | awk '{print $2}' || true)
    wt=$(echo "$line" | grep -o 'waited [0-9.]* ms' | awk '{print $2}' || true)
    ov=-
    if [ -n "$dev" ]; then ov=$(awk "BEGIN{d=$dev; w=$wt; printf \"%.0f%%\", (d > 0 ? 100*(d-w)/d : 0)}"); fi
    same=-
    if [ $mode = vk ]; then cmp -s "$T/cpu.f32" "$T/vk.f32" && same=yes || same=NO; fi
    printf '%-8s %10s %10s %12s %12s %12s %10s %s\n' "$mode" "$wall" "${dec:--}" "${dev:--}" \
        "${cpu:--}" "${wt:--}" "$ov" "$same"
done
