#!/usr/bin/env bash
# tests/bench/bench-experts.sh: the expert store against the drive
# (`make bench-experts`). Not a timed test. On a slice checkpoint (real K3
# expert size), in one run on the same files:
#   (a) fio O_DIRECT sequential read GB/s, 16 MiB blocks, queue depth 4/16/32
#       (best of the three), over the largest shard;
#   (b) the expert store's read GB/s over a decode of 32 tokens (O_DIRECT,
#       K3_PIPE=1, 4 load threads, 4 slots per MoE layer like K3 at 8 GB);
#   (c) decode ms per MoE layer vs the pure read time of 16 experts;
#   then the read engines side by side (bench_expert_io): loader threads
#   1/2/4/8 vs io_uring queue depth 4/16, 16 O_DIRECT expert reads in disk
#   order per trial (IO_PASSES, default 2; IO_BENCH=0 skips it).
# SLICE=dir picks the checkpoint (default $CACHE/slice, generated if
# missing; /tmp/k3slice_stage is used when present). Caches are dropped when
# permitted; O_DIRECT makes the drive's reads cold either way.
set -euo pipefail
BUILD=${BUILD:-build}
CACHE=${CACHE:-$HOME/.cache/k3shard}
cd "$(dirname "$0")/../.."
SLICE=${SLICE:-}
if [ -z "$SLICE" ]; then
    if [ -f /tmp/k3slice_stage/config.json ]; then SLICE=/tmp/k3slice_stage
    else SLICE=$CACHE/slice; fi
fi
if [ ! -f "$SLICE/config.json" ]; then
    echo "bench-experts: generating the slice checkpoint in $SLICE"
    /usr/bin/python3 tests/fixtures/k3_gen.py --profile slice --out "$SLICE"
fi
command -v fio >/dev/null || { echo "bench-experts: fio missing (apt-get install fio)"; exit 1; }
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_experts" "$BUILD/bench/bench_expert_io"

sync
if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then dropped=yes; else dropped=no; fi
big=$(ls -S "$SLICE"/*.safetensors | head -1)
fio_best() {  # best GB/s over queue depths 4, 16, 32 (each line printed)
    local best=0 bw gbps qd
    for qd in 4 16 32; do
        bw=$(fio --name=seq --filename="$big" --readonly --direct=1 --rw=read --bs=16M \
                 --iodepth=$qd --ioengine=libaio --runtime=${FIO_SECONDS:-4} --time_based \
                 --output-format=terse --terse-version=3 | awk -F';' '{print $7}') # KiB/s
        gbps=$(awk "BEGIN{printf \"%.3f\", $bw * 1024 / 1e9}")
        echo "fio $1 qd=$qd: $gbps GB/s" >&2
        best=$(awk "BEGIN{print ($gbps > $best) ? $gbps : $best}")
    done
    echo "$best"
}
best_cold=$(fio_best before)
out=$("$BUILD/bench/bench_experts" "$SLICE" --tokens "${TOKENS:-32}" --slots "${SLOTS:-4}" \
      --threads "${K3_LOAD_THREADS:-4}" 2>/dev/null)
echo "$out"
best=$(fio_best after)   # same drive state as the decode (host caches warm)
get() { echo "$out" | awk -v k="$1" '$1 == k {print $2}'; }
b=$(get store_read_gbps); layer=$(get moe_layer_ms); pure=$(get pure_read_ms_per_layer)
echo
echo "checkpoint $SLICE (drop_caches: $dropped; the drive is virtual, so its host may cache)"
printf '%-58s %10s\n' "(a) fio O_DIRECT seq read 16 MiB, best qd 4/16/32, before" "$best_cold GB/s"
printf '%-58s %10s\n' "(a) the same, after the decode" "$best GB/s"
printf '%-58s %10s\n' "(b) expert store read over the decode" "$b GB/s"
printf '%-58s %10s\n' "(c) decode per MoE layer (attention included)" "$layer ms"
printf '%-58s %10s\n' "    pure read of 16 experts, before the decode" "$(get pure_read_cold_ms_per_layer) ms"
printf '%-58s %10s\n' "    pure read of 16 experts, after the decode" "$pure ms"
awk "BEGIN{printf \"ratio (b)/(a after) = %.2f (target >= 0.90)\n\", $b / $best}"
awk "BEGIN{printf \"ratio (c)/(read after) = %.2f (target <= 1.10)\n\", $layer / $pure}"
io_layer=$(get decode_io_ms_per_layer)
printf '%-58s %10s\n' "    reads in flight per MoE layer during the decode" "$io_layer ms"
awk "BEGIN{printf \"ratio (c)/(reads in flight, same decode) = %.2f\n\", $layer / $io_layer}"
echo
echo "compute of one MoE layer at T = 1 (best of 5, mean over the MoE layers):"
for k in attention router latent_down shared expert latent_up; do
    printf '    %-54s %10s\n' "$k" "$(get prof_${k}_ms) ms"
done
serial=$(get prof_serial_ms)
printf '%-58s %10s\n' "    serial part (attention + router + latent up + last expert)" "$serial ms"
awk "BEGIN{printf \"model: (reads in flight + serial) / reads in flight = %.2f, measured %.2f\n\", ($io_layer + $serial) / $io_layer, $layer / $io_layer}"
if [ "${IO_BENCH:-1}" != 0 ]; then
    echo
    echo "read engines, 16 x $(get expert_mb) MB O_DIRECT reads in disk order per trial:"
    "$BUILD/bench/bench_expert_io" "$SLICE" --passes "${IO_PASSES:-2}"
fi
