#!/usr/bin/env bash
# tests/bench/kernel-profile.sh: deterministic instruction counts of the
# kernels (issue 7, docs/PERFORMANCE.md "Kernels"). Builds
# tests/bench/kernel_once.c against $BUILD/libk3.a and runs one single-thread
# call of each kernel under callgrind, collecting only inside kernel_call.
# Prints instructions per weight byte and per multiply-add. valgrind has no
# AVX-512, so the level is K3_ISA (default avx2; scalar also works).
# Usage: tests/bench/kernel-profile.sh [KERNEL...]   (default: all six)
set -euo pipefail
BUILD=${BUILD:-build}
ISA=${K3_ISA:-avx2}
cd "$(dirname "$0")/../.."
command -v valgrind >/dev/null || { echo "kernel-profile: valgrind not found" >&2; exit 1; }
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/kernel_once"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(mxi8 mxf32 int8 int4 int8i int4i)
printf '%-6s %-6s %3s %14s %12s %12s %9s %8s\n' kernel isa n instr weight_B macs instr/B instr/mac
for k in "${kernels[@]}"; do
    for n in 1 32; do
        out=$(K3_ISA=$ISA valgrind --tool=callgrind --dump-instr=no --toggle-collect=kernel_call \
            --callgrind-out-file="$tmp/cg" "$BUILD/bench/kernel_once" "$k" "$n" 2>"$tmp/err") ||
            { cat "$tmp/err" >&2; exit 1; }
        ir=$(sed -n 's/^summary: *//p' "$tmp/cg")
        read -r isa bytes macs < <(awk '{for (i = 1; i < NF; i++) {
            if ($i == "isa") a = $(i+1); if ($i == "weight_bytes") b = $(i+1);
            if ($i == "macs") m = $(i+1) } print a, b, m}' <<<"$out")
        printf '%-6s %-6s %3d %14d %12d %12d %9.3f %8.4f\n' "$k" "$isa" "$n" "$ir" "$bytes" "$macs" \
            "$(awk -v a="$ir" -v b="$bytes" 'BEGIN{print a/b}')" \
            "$(awk -v a="$ir" -v b="$macs" 'BEGIN{print a/b}')"
    done
done
