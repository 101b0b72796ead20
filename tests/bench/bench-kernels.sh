#!/usr/bin/env bash
# tests/bench/bench-kernels.sh: builds tests/bench/bench_kernels.c with the
# Makefile's own compiler and flags against $BUILD/libk3.a and runs it
# (`make bench-kernels`). Prints a table; not a timed test. Extra arguments
# go to the program (--quick: shorter measurements). K3_ISA picks the level.
# Then bench_kernels_threads: n = 1..4 from RAM per thread count (1, 2, ...
# every CPU), each paired with STREAM of the same thread count (issue 21);
# THREADS_ARGS passes it options (e.g. "--threads 1,2,8 --thp").
# Then kernel-mix.sh: the pipe probes and the AVX-512 tiles' instruction
# mixes, the profile behind the table where `perf` has no counters.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_kernels" \
    "$BUILD/bench/bench_kernels_threads"
"$BUILD/bench/bench_kernels" "$@"
echo
quick=
for a in "$@"; do [ "$a" = --quick ] && quick=--quick; done
# shellcheck disable=SC2086
"$BUILD/bench/bench_kernels_threads" $quick ${THREADS_ARGS:-}
echo
BUILD="$BUILD" bash tests/bench/kernel-mix.sh
