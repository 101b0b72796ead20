#!/usr/bin/env bash
# tests/bench/kernel-mix.sh: issue 7's profile without a PMU. Runs
# tests/bench/pipe_probe.c (which AVX-512 instructions share a unit, and at
# what rate), then tests/bench/kernel_mix.py on $BUILD's AVX-512 object: each
# n = 1 tile's hot-loop instruction mix per 64 weight bytes and the bandwidth
# bound it implies at the clock pipe_probe measured (vfmadd231ps zmm issue 1
# per cycle). Part of `make bench-kernels`. Prints tables; not a timed test.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/pipe_probe" "$BUILD/common/kernels/kernels_avx512.o"
probe=$("$BUILD/bench/pipe_probe" "${PROBE_ITERS:-10000000}")
echo "$probe"
if ! grep -q '^vfmadd231ps' <<<"$probe"; then
    echo "# kernel-mix: no AVX-512 here, so no AVX-512 mix to weigh"
    exit 0
fi
ghz=$(awk '$1 == "vfmadd231ps" {print $2}' <<<"$probe")
echo
/usr/bin/python3 tests/bench/kernel_mix.py "$BUILD/common/kernels/kernels_avx512.o" "$ghz"
