#!/usr/bin/env bash
# tests/bench/bench-kernels-threads.sh: the short form of issue 21's table
# (`make bench-kernels-threads`): bench_kernels_threads alone, n = 1, for 1
# and 2 threads (THREADS=1,2,4,... for more), every format, with the read
# pattern column, ROUNDS (default 7) rounds of kernel passes paired
# with STREAM passes. About two minutes on a quiet 2-vCPU VM. Columns:
# GB/s of the kernel, GB/s of STREAM (same thread count, same process),
# ratio = kernel / neighbouring STREAM passes (median, min, max over rounds),
# pat = the kernels' read pattern alone against the same STREAM passes, pts =
# that walk with the next tile prefetched in address order, seq = the same
# bytes as one sequential stream per task (a tile-major layout's pattern),
# hot = the kernel on 4 MB per thread (no RAM) against the same STREAM
# passes, sleep = the kernel through a pool whose idle threads sleep after
# 50 us (the pool before 2026-12-03; the pool now yields its CPUs for 2 ms
# first), against the same STREAM passes. Kernel passes and STREAM cover at
# least 4x the L3 the CPU reports.
# Extra arguments go to the program (e.g. --gap 200, int8 int4; --thp made
# this VM's memory read at 1 GB/s for minutes, docs/PERFORMANCE.md).
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_kernels_threads"
"$BUILD/bench/bench_kernels_threads" --quick --rounds "${ROUNDS:-7}" --threads "${THREADS:-1,2}" \
    --n 1 --pattern --hot --sleep "$@"
